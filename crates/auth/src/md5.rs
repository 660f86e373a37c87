//! PostgreSQL's `md5` password method.
//!
//! The stored secret is `"md5" || hex(md5(password || user))`. In the
//! exchange the server sends a 4-byte salt and the client answers
//! `"md5" || hex(md5(hex(md5(password || user)) || salt))`, so the stored
//! secret is itself enough to log in: treat it like a password.

use md5::{Digest, Md5};
use subtle::ConstantTimeEq;

/// Length of an md5 secret or response: `md5` and 32 hex digits.
pub const MD5_SECRET_LEN: usize = 35;

/// The secret PostgreSQL stores for `password` with
/// `password_encryption = md5`. The user name acts as the salt.
pub fn md5_secret(user: impl AsRef<[u8]>, password: impl AsRef<[u8]>) -> String {
    md5_hex(&[password.as_ref(), user.as_ref()])
}

/// The client's answer to AuthenticationMD5Password.
///
/// `secret_or_hash` is either a stored secret (`md5` followed by 32 hex
/// digits, as from [`md5_secret`]) or the bare 32 hex digits; the `md5`
/// prefix is stripped if present, as libpq does.
pub fn md5_response(secret_or_hash: &str, salt: [u8; 4]) -> String {
    let hash = secret_or_hash.strip_prefix("md5").unwrap_or(secret_or_hash);
    md5_hex(&[hash.as_bytes(), &salt])
}

/// Whether `client_response` is the right answer to `salt` for the stored
/// secret, compared in constant time.
///
/// Only md5 secrets can verify an md5 response; anything else (a SCRAM
/// secret, a plaintext password) yields `false`. PostgreSQL switches to SCRAM
/// when the role's secret is a SCRAM one; that decision is the caller's.
pub fn verify_md5(stored_secret: &str, salt: [u8; 4], client_response: &str) -> bool {
    if !is_md5_secret(stored_secret) {
        return false;
    }
    let expected = md5_response(stored_secret, salt);
    // The lengths are public (always 35 for a well-formed answer), so only
    // the content needs a constant-time comparison.
    expected.len() == client_response.len()
        && bool::from(expected.as_bytes().ct_eq(client_response.as_bytes()))
}

/// Whether `s` is an md5 secret as PostgreSQL recognises one: `md5`
/// followed by exactly 32 lowercase hex digits.
pub fn is_md5_secret(s: &str) -> bool {
    s.len() == MD5_SECRET_LEN
        && s.strip_prefix("md5").is_some_and(|hex| {
            hex.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// `"md5"` followed by the lowercase hex MD5 of the concatenated parts.
fn md5_hex(parts: &[&[u8]]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut h = Md5::new();
    for part in parts {
        h.update(part);
    }
    let mut out = String::with_capacity(MD5_SECRET_LEN);
    out.push_str("md5");
    for b in h.finalize() {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0x0f)]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The widely published secret for user `postgres` with password
    /// `postgres` (as in `pg_authid` after `ALTER ROLE postgres PASSWORD
    /// 'postgres'` under `password_encryption = md5`).
    const POSTGRES_SECRET: &str = "md53175bce1d3201d16594cebf9d7eb3f9d";

    #[test]
    fn known_answers() {
        assert_eq!(md5_secret("postgres", "postgres"), POSTGRES_SECRET);
        // Written by PostgreSQL 15.18 for `CREATE ROLE k5 PASSWORD 'pencil'`
        // under `password_encryption = md5`.
        assert_eq!(
            md5_secret("k5", "pencil"),
            "md51697efd1767a099e84d5067fbd4a20f8"
        );
        // User `postgres`, password `pencil`, salt 01 02 03 04; computed
        // independently with Python's hashlib.
        let secret = md5_secret("postgres", "pencil");
        assert_eq!(secret, "md54c21b325d75177d5e9b9789a50ab0c9c");
        assert_eq!(
            md5_response(&secret, [1, 2, 3, 4]),
            "md5dba33b405438ce4ca5423846a9bffead"
        );
        // md5("") and md5("a") from RFC 1321's test suite, via the empty
        // user and password.
        assert_eq!(md5_secret("", ""), "md5d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(md5_secret("", "a"), "md50cc175b9c0f1b6a831c399e269772661");
        // RFC 1321: md5("abc"), split across password and user.
        assert_eq!(md5_secret("c", "ab"), "md5900150983cd24fb0d6963f7d28e17f72");
        // md5("message digest").
        assert_eq!(
            md5_secret(" digest", "message"),
            "md5f96b697d7cb7938d525a2f31aaf161d0"
        );
    }

    #[test]
    fn response_round_trip() {
        let secret = md5_secret("postgres", "pencil");
        assert!(is_md5_secret(&secret));
        let salt = [1, 2, 3, 4];
        let response = md5_response(&secret, salt);
        // The bare hash gives the same answer as the prefixed secret.
        assert_eq!(md5_response(&secret[3..], salt), response);
        // md5(hex || salt) computed independently.
        let mut h = Md5::new();
        h.update(&secret.as_bytes()[3..]);
        h.update(salt);
        let expected: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(response, format!("md5{expected}"));

        assert!(verify_md5(&secret, salt, &response));
        assert!(!verify_md5(&secret, [4, 3, 2, 1], &response));
        assert!(!verify_md5(&secret, salt, &response.to_uppercase()));
        assert!(!verify_md5(&secret, salt, &response[..34]));
        assert!(!verify_md5(&secret, salt, ""));
        assert!(!verify_md5(
            &md5_secret("postgres", "other"),
            salt,
            &response
        ));
        assert!(!verify_md5("pencil", salt, &response));
        assert!(!verify_md5(
            "SCRAM-SHA-256$4096:abc$def:ghi",
            salt,
            &response
        ));
    }

    #[test]
    fn secret_shape() {
        assert!(is_md5_secret(POSTGRES_SECRET));
        assert!(!is_md5_secret(&POSTGRES_SECRET[1..]));
        assert!(!is_md5_secret(&POSTGRES_SECRET.to_uppercase()));
        assert!(!is_md5_secret(&format!("{POSTGRES_SECRET}0")));
        assert!(!is_md5_secret("md5"));
        assert!(!is_md5_secret("md5a5a2dba1c4ee8a2f7e0dbc4a7a2b5d8g"));
        assert!(!is_md5_secret("md5é5a2dba1c4ee8a2f7e0dbc4a7a2b5d8"));
    }
}
