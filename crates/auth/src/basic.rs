//! HTTP basic authentication, as the HA agent's REST API and the connection
//! manager's HTTP port check it.

use base64::Engine as _;
use subtle::ConstantTimeEq;

/// Whether an `Authorization` header value carries `user` and `password`
/// (`Basic base64(user:password)`, the scheme in any case). The comparison
/// takes the same time however much of a guess is right.
pub fn basic_auth_matches(authorization: Option<&str>, user: &str, password: &str) -> bool {
    let given = authorization
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("basic").then_some(token.trim())
        })
        .and_then(|t| base64::engine::general_purpose::STANDARD.decode(t).ok());
    let expected = format!("{user}:{password}");
    given.is_some_and(|g| bool::from(g.as_slice().ct_eq(expected.as_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_pair_matches() {
        // base64("u:p") and base64("u:q")
        assert!(basic_auth_matches(Some("Basic dTpw"), "u", "p"));
        assert!(basic_auth_matches(Some("basic  dTpw "), "u", "p"));
        for bad in [
            None,
            Some("Basic dTpx"),
            Some("Bearer dTpw"),
            Some("Basic !!"),
            Some("dTpw"),
        ] {
            assert!(!basic_auth_matches(bad, "u", "p"), "{bad:?}");
        }
        assert!(!basic_auth_matches(Some("Basic dTpw"), "u", "pp"));
    }
}
