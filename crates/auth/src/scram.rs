//! SCRAM-SHA-256 (RFC 5802, RFC 7677) and SCRAM-SHA-256-PLUS, its
//! channel-binding variant, as PostgreSQL speaks them.
//!
//! pgwarden sits between a client and PostgreSQL and plays both roles:
//!
//! * towards the client it is the SCRAM server ([`ScramServer`]), checking
//!   the client's proof against the role's `pg_authid` secret
//!   ([`ScramSecret`]);
//! * towards PostgreSQL it is the SCRAM client ([`ScramClient`]), logging in
//!   as the same role.
//!
//! A successful server-side exchange recovers the client's [`ClientKey`]
//! (ClientProof XOR ClientSignature). Since a client proof is
//! `ClientKey XOR HMAC(H(ClientKey), AuthMessage)`, that key alone is enough
//! to answer PostgreSQL's challenge for any later exchange against the same
//! secret, so pgwarden never needs, or stores, a plaintext password. PgBouncer
//! uses the same technique.
//!
//! The server side mirrors `src/backend/libpq/auth-scram.c`. Over TLS it
//! offers `SCRAM-SHA-256-PLUS` before `SCRAM-SHA-256`
//! ([`ScramServer::with_channel_binding`]); otherwise only `SCRAM-SHA-256`.
//! With PLUS the GS2 header is `p=tls-server-end-point,,` and the
//! client-final `c=` attribute must be the base64 of that header followed by
//! the hash of the certificate the client received (RFC 5929, see
//! [`crate::cert::tls_server_end_point`]): a man in the middle who
//! terminates the client's TLS with a certificate of its own cannot relay
//! the exchange, since the client's proof signs the certificate it saw.
//! Without PLUS the GS2 header is `n,,`, or `y,,` ("I could bind, but the
//! server does not offer it"), which is refused when PLUS was offered: the
//! offer must have been removed on the way. Choosing PLUS without a `p=`
//! header, or `p=` with plain SCRAM-SHA-256, is a protocol violation;
//! `tls-server-end-point` is the only binding type, as in PostgreSQL. An
//! authorization identity or a mandatory extension is refused, and the user
//! name in the client-first message is ignored (PostgreSQL uses the user
//! from the startup packet, and libpq sends an empty `n=`).
//!
//! Binding changes nothing in the ClientKey recovery: the AuthMessage the
//! proof signs simply holds the longer `c=` attribute, and pgwarden logs in
//! to PostgreSQL over its own connection without binding.
//!
//! Nothing here draws randomness or reads a clock: nonces and salts come
//! from the caller, which makes exchanges reproducible in tests.
//!
//! Error mapping for callers, as PostgreSQL reports them:
//! [`ScramError::InvalidProof`] is a failed login (SQLSTATE 28P01, "password
//! authentication failed for user ..."); [`ScramError::ChannelBindingMismatch`]
//! and [`ScramError::ChannelBindingNegotiation`] are refusals of the
//! connection (28000, with their own messages); every other error while
//! acting as a server is a protocol violation (08P01).

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use base64::alphabet;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use base64::Engine as _;
use hmac::digest::Key;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use unicode_normalization::UnicodeNormalization;

/// SASL mechanism name, as listed in AuthenticationSASL and chosen in
/// SASLInitialResponse.
pub const MECHANISM: &str = "SCRAM-SHA-256";

/// SASL mechanism name of SCRAM-SHA-256 with channel binding.
pub const MECHANISM_PLUS: &str = "SCRAM-SHA-256-PLUS";

/// The one channel-binding type PostgreSQL, and so pgwarden, supports: the
/// hash of the server's certificate (RFC 5929).
pub const CHANNEL_BINDING_TYPE: &str = "tls-server-end-point";

/// The GS2 header of a client that binds to [`CHANNEL_BINDING_TYPE`].
const GS2_HEADER_PLUS: &[u8] = b"p=tls-server-end-point,,";

/// PostgreSQL's details for a mechanism that does not match the GS2 flag.
const PLUS_WITHOUT_BINDING: &str = "the client selected SCRAM-SHA-256-PLUS, \
    but the SCRAM message does not include channel binding data";
const BINDING_WITHOUT_PLUS: &str = "the client selected SCRAM-SHA-256 without channel binding, \
    but the SCRAM message includes channel binding data";

/// Iteration count PostgreSQL uses for new secrets by default.
pub const DEFAULT_ITERATIONS: u32 = 4096;

/// Salt length, in bytes, PostgreSQL uses for new secrets.
pub const DEFAULT_SALT_LEN: usize = 16;

/// Length of the random part of a nonce, in bytes, before base64 encoding
/// (PostgreSQL's `SCRAM_RAW_NONCE_LEN`).
pub const NONCE_LEN: usize = 18;

/// Largest iteration count [`ScramClient::with_password`] accepts from a
/// server.
///
/// The count drives a PBKDF2 loop on the client, so an unbounded value would
/// let a hostile server burn the client's CPU. 100 000 is the cap pgjdbc and
/// rust-postgres adopted, about 24 times PostgreSQL's default. The client-key
/// path runs no PBKDF2 at all and is not limited.
pub const MAX_CLIENT_ITERATIONS: u32 = 100_000;

/// Length of SHA-256 output and of every SCRAM-SHA-256 key.
const KEY_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// PostgreSQL's base64 decoder does not insist that unused trailing bits be
/// zero; being as lenient keeps secrets and proofs PostgreSQL accepts
/// acceptable here.
const B64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_allow_trailing_bits(true),
);

/// Why a SCRAM exchange or secret was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScramError {
    /// A message did not follow the SCRAM grammar.
    #[error("malformed SCRAM message: {0}")]
    Malformed(String),
    /// The peer asked for something PostgreSQL does not support either
    /// (a channel-binding type other than `tls-server-end-point`, an
    /// authorization identity, a mandatory extension).
    #[error("unsupported SCRAM feature: {0}")]
    Unsupported(&'static str),
    /// The client chose a SASL mechanism that was not offered.
    #[error("client selected an invalid SASL authentication mechanism")]
    InvalidMechanism,
    /// The client can bind but believes the server cannot (GS2 flag `y`),
    /// although `SCRAM-SHA-256-PLUS` was offered: the offer may have been
    /// stripped from the list on the way, a downgrade attack. Report as
    /// SQLSTATE 28000.
    #[error("SCRAM channel binding negotiation error")]
    ChannelBindingNegotiation,
    /// The channel-binding data is not this connection's: the client bound
    /// to another certificate than the one pgwarden presents, as happens
    /// when something in between terminated its TLS. Report as SQLSTATE
    /// 28000.
    #[error("SCRAM channel binding check failed")]
    ChannelBindingMismatch,
    /// The nonce in the final message is not the one agreed on.
    #[error("invalid SCRAM response: nonce does not match")]
    NonceMismatch,
    /// The client's proof is wrong: wrong password, or unknown user behind a
    /// [`ScramSecret::mock`] secret. Report as SQLSTATE 28P01.
    #[error("password authentication failed")]
    InvalidProof,
    /// The server's signature is wrong: it does not know the secret.
    #[error("invalid SCRAM server signature")]
    InvalidServerSignature,
    /// The server ended the exchange with an `e=` attribute.
    #[error("error received from server in SCRAM exchange: {0}")]
    ServerError(String),
    /// A stored secret is not in PostgreSQL's SCRAM-SHA-256 format.
    #[error("invalid SCRAM secret: {0}")]
    InvalidSecret(&'static str),
    /// The server demands more PBKDF2 iterations than
    /// [`MAX_CLIENT_ITERATIONS`].
    #[error("SCRAM iteration count {0} exceeds the limit of {MAX_CLIENT_ITERATIONS}")]
    TooManyIterations(u32),
    /// A nonce given to a constructor contains characters SCRAM forbids.
    #[error("invalid SCRAM nonce")]
    InvalidNonce,
    /// A step was called out of order, or after the exchange ended.
    #[error("SCRAM exchange step out of order")]
    OutOfOrder,
}

fn malformed(detail: impl Into<String>) -> ScramError {
    ScramError::Malformed(detail.into())
}

/// The ClientKey of RFC 5802: `HMAC(SaltedPassword, "Client Key")`.
///
/// It is password-equivalent for SCRAM (anyone holding it can log in against
/// the secret it came from), so it has no `Display` and its `Debug` output is
/// redacted.
#[derive(Clone)]
pub struct ClientKey([u8; KEY_LEN]);

impl ClientKey {
    /// Wraps raw key bytes.
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        ClientKey(bytes)
    }

    /// The raw key bytes.
    pub fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }

    /// `H(ClientKey)`, the StoredKey of the secret this key belongs to.
    pub fn stored_key(&self) -> [u8; KEY_LEN] {
        sha256(&self.0)
    }
}

impl fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClientKey(..)")
    }
}

impl PartialEq for ClientKey {
    fn eq(&self, other: &Self) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl Eq for ClientKey {}

/// One side's contribution to the exchange nonce.
///
/// Normally built from [`NONCE_LEN`] random bytes, base64-encoded as
/// PostgreSQL and libpq do; [`Nonce::printable`] takes a ready-made string
/// (for test vectors such as RFC 7677's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nonce(String);

impl Nonce {
    /// The base64 encoding of `bytes`, which should come from a
    /// cryptographically secure generator.
    pub fn from_random(bytes: [u8; NONCE_LEN]) -> Self {
        Nonce(B64.encode(bytes))
    }

    /// A nonce used verbatim. SCRAM allows printable ASCII except `,`.
    pub fn printable(s: &str) -> Result<Self, ScramError> {
        if s.is_empty() || !is_printable(s.as_bytes()) {
            return Err(ScramError::InvalidNonce);
        }
        Ok(Nonce(s.to_owned()))
    }

    /// The nonce as sent on the wire.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<[u8; NONCE_LEN]> for Nonce {
    fn from(bytes: [u8; NONCE_LEN]) -> Self {
        Nonce::from_random(bytes)
    }
}

/// A role's SCRAM-SHA-256 verifier, as stored in `pg_authid.rolpassword`.
///
/// `Display` writes PostgreSQL's format and `FromStr` is [`Self::parse`].
/// `Debug` leaves the keys out: the StoredKey together with one observed
/// exchange, or the ServerKey alone, is enough to impersonate one side.
#[derive(Clone, PartialEq, Eq)]
pub struct ScramSecret {
    /// PBKDF2 iteration count.
    pub iterations: u32,
    /// Salt, decoded.
    pub salt: Vec<u8>,
    /// `H(ClientKey)`.
    pub stored_key: [u8; KEY_LEN],
    /// `HMAC(SaltedPassword, "Server Key")`.
    pub server_key: [u8; KEY_LEN],
}

impl ScramSecret {
    /// Parses `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`
    /// with base64 salt and keys, like PostgreSQL's `parse_scram_secret`.
    pub fn parse(s: &str) -> Result<Self, ScramError> {
        let rest = s
            .strip_prefix("SCRAM-SHA-256$")
            .ok_or(ScramError::InvalidSecret("not a SCRAM-SHA-256 secret"))?;
        let (params, keys) = rest
            .split_once('$')
            .ok_or(ScramError::InvalidSecret("missing keys"))?;
        let (iterations, salt) = params
            .split_once(':')
            .ok_or(ScramError::InvalidSecret("missing salt"))?;
        let (stored_key, server_key) = keys
            .split_once(':')
            .ok_or(ScramError::InvalidSecret("missing server key"))?;
        let iterations = parse_iterations(iterations.as_bytes())
            .ok_or(ScramError::InvalidSecret("invalid iteration count"))?;
        let salt = B64
            .decode(salt)
            .ok()
            .filter(|s| !s.is_empty())
            .ok_or(ScramError::InvalidSecret("invalid salt"))?;
        let stored_key = decode_key(stored_key.as_bytes())
            .ok_or(ScramError::InvalidSecret("invalid stored key"))?;
        let server_key = decode_key(server_key.as_bytes())
            .ok_or(ScramError::InvalidSecret("invalid server key"))?;
        Ok(ScramSecret {
            iterations,
            salt,
            stored_key,
            server_key,
        })
    }

    /// Derives the secret PostgreSQL would store for `password`, as
    /// `CREATE ROLE ... PASSWORD` does with `password_encryption =
    /// scram-sha-256`. The password goes through PostgreSQL's SASLprep first.
    ///
    /// `salt` should be [`DEFAULT_SALT_LEN`] random bytes; `iterations` must
    /// be at least 1.
    pub fn from_password(
        password: impl AsRef<[u8]>,
        salt: &[u8],
        iterations: u32,
    ) -> Result<Self, ScramError> {
        if iterations == 0 {
            return Err(ScramError::InvalidSecret(
                "iteration count must be positive",
            ));
        }
        if salt.is_empty() {
            return Err(ScramError::InvalidSecret("salt must not be empty"));
        }
        let salted = hi(&saslprep(password.as_ref()), salt, iterations);
        let client_key = hmac(&salted, &[b"Client Key"]);
        Ok(ScramSecret {
            iterations,
            salt: salt.to_vec(),
            stored_key: sha256(&client_key),
            server_key: hmac(&salted, &[b"Server Key"]),
        })
    }

    /// A stand-in secret for a role that does not exist (or has no SCRAM
    /// secret), so that the exchange runs to the proof check and fails there
    /// with [`ScramError::InvalidProof`], exactly like a wrong password.
    ///
    /// As in PostgreSQL's `scram_mock_salt`, the salt is derived from the
    /// user name and a server-wide secret `seed`: it stays the same across
    /// attempts, as a real salt would, without revealing anything. `seed`
    /// must therefore be secret, random (32 bytes is plenty) and stable for
    /// at least the life of the process. The iteration count is
    /// [`DEFAULT_ITERATIONS`]; set the field to match the cluster's if it uses
    /// another. The keys are derived from the seed too, so no proof can match
    /// short of a SHA-256 preimage.
    pub fn mock(username: &str, seed: &[u8]) -> Self {
        let digest = {
            let mut h = Sha256::new();
            h.update(username.as_bytes());
            h.update(seed);
            h.finalize()
        };
        let salt = digest.iter().take(DEFAULT_SALT_LEN).copied().collect();
        ScramSecret {
            iterations: DEFAULT_ITERATIONS,
            salt,
            stored_key: hmac(seed, &[b"pgwarden mock StoredKey\0", username.as_bytes()]),
            server_key: hmac(seed, &[b"pgwarden mock ServerKey\0", username.as_bytes()]),
        }
    }
}

impl fmt::Display for ScramSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SCRAM-SHA-256${}:{}${}:{}",
            self.iterations,
            B64.encode(&self.salt),
            B64.encode(self.stored_key),
            B64.encode(self.server_key)
        )
    }
}

impl fmt::Debug for ScramSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScramSecret")
            .field("iterations", &self.iterations)
            .field("salt", &B64.encode(&self.salt))
            .finish_non_exhaustive()
    }
}

impl FromStr for ScramSecret {
    type Err = ScramError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ScramSecret::parse(s)
    }
}

/// Server state between messages.
enum ServerState {
    AwaitClientFirst,
    AwaitClientFinal {
        /// The `c=` attribute the final message must carry: the base64 GS2
        /// header (`n,,` or `y,,`), or for PLUS the header and the binding
        /// data.
        cbind: Vec<u8>,
        /// Whether the client binds (`p=`), which turns a wrong `c=` from a
        /// malformed message into a failed binding check.
        bound: bool,
        client_first_bare: Vec<u8>,
        server_first: Vec<u8>,
        /// Client nonce followed by server nonce.
        nonce: Vec<u8>,
    },
    Done,
}

/// The server side of one SCRAM-SHA-256 exchange.
///
/// List [`Self::mechanisms`] in AuthenticationSASL, feed the client's
/// SASLInitialResponse (its mechanism and data) to
/// [`Self::initial_response`] and send the result in
/// AuthenticationSASLContinue, then feed it the SASLResponse data with
/// [`Self::client_final`] and send the result in AuthenticationSASLFinal.
/// Any error ends the exchange.
pub struct ScramServer {
    secret: ScramSecret,
    nonce: Nonce,
    /// `tls-server-end-point` data when `SCRAM-SHA-256-PLUS` is offered.
    channel_binding: Option<Vec<u8>>,
    state: ServerState,
}

impl ScramServer {
    /// Starts an exchange against `secret` (use [`ScramSecret::mock`] for an
    /// unknown role). `nonce` is the server's part of the exchange nonce:
    /// [`NONCE_LEN`] bytes from a cryptographically secure generator.
    pub fn new(secret: &ScramSecret, nonce: impl Into<Nonce>) -> Self {
        ScramServer {
            secret: secret.clone(),
            nonce: nonce.into(),
            channel_binding: None,
            state: ServerState::AwaitClientFirst,
        }
    }

    /// Offers `SCRAM-SHA-256-PLUS` too, as PostgreSQL does over TLS: `data`
    /// is the `tls-server-end-point` binding data of the certificate the
    /// client received in this connection's handshake
    /// ([`crate::cert::tls_server_end_point`]). A client that binds must
    /// then send exactly that; one that could bind but sends `y` is refused.
    pub fn with_channel_binding(mut self, data: impl Into<Vec<u8>>) -> Self {
        self.channel_binding = Some(data.into());
        self
    }

    /// The mechanisms to list in AuthenticationSASL, preferred first as
    /// PostgreSQL lists them: `SCRAM-SHA-256-PLUS` when binding is offered,
    /// then `SCRAM-SHA-256`.
    pub fn mechanisms(&self) -> &'static [&'static str] {
        if self.channel_binding.is_some() {
            &[MECHANISM_PLUS, MECHANISM]
        } else {
            &[MECHANISM]
        }
    }

    /// Handles client-first-message for [`MECHANISM`] and returns
    /// server-first-message: [`Self::initial_response`] for a client that
    /// chose SCRAM-SHA-256.
    pub fn client_first(&mut self, msg: &[u8]) -> Result<Vec<u8>, ScramError> {
        self.initial_response(MECHANISM, msg)
    }

    /// Handles SASLInitialResponse, the mechanism the client chose among
    /// [`Self::mechanisms`] and its client-first-message, and returns
    /// server-first-message.
    pub fn initial_response(&mut self, mechanism: &str, msg: &[u8]) -> Result<Vec<u8>, ScramError> {
        if !matches!(self.state, ServerState::AwaitClientFirst) {
            self.state = ServerState::Done;
            return Err(ScramError::OutOfOrder);
        }
        self.state = ServerState::Done;
        let plus = match (mechanism, &self.channel_binding) {
            (MECHANISM, _) => false,
            (MECHANISM_PLUS, Some(_)) => true,
            _ => return Err(ScramError::InvalidMechanism),
        };
        check_message(msg)?;

        // The checks and their order are read_client_first_message's.
        let (&cbind_flag, rest) = msg
            .split_first()
            .ok_or_else(|| malformed("message is empty"))?;
        let (rest, cbind) = match cbind_flag {
            b'n' | b'y' => {
                if plus {
                    return Err(malformed(PLUS_WITHOUT_BINDING));
                }
                if cbind_flag == b'y' && self.channel_binding.is_some() {
                    return Err(ScramError::ChannelBindingNegotiation);
                }
                let rest = rest
                    .strip_prefix(b",")
                    .ok_or_else(|| malformed("comma expected after channel-binding flag"))?;
                let header: &[u8] = if cbind_flag == b'y' { b"y,," } else { b"n,," };
                (rest, B64.encode(header).into_bytes())
            }
            b'p' => {
                let Some(data) = self.channel_binding.as_deref().filter(|_| plus) else {
                    return Err(malformed(BINDING_WITHOUT_PLUS));
                };
                let mut r = Reader(msg);
                if r.attr(b'p')? != CHANNEL_BINDING_TYPE.as_bytes() {
                    return Err(ScramError::Unsupported("channel-binding type"));
                }
                let mut input = GS2_HEADER_PLUS.to_vec();
                input.extend_from_slice(data);
                (r.0, B64.encode(input).into_bytes())
            }
            _ => return Err(malformed("unexpected channel-binding flag")),
        };
        if rest.first() == Some(&b'a') {
            return Err(ScramError::Unsupported("authorization identity"));
        }
        let bare = rest
            .strip_prefix(b",")
            .ok_or_else(|| malformed("unexpected attribute in client-first-message"))?;
        if bare.first() == Some(&b'm') {
            return Err(ScramError::Unsupported("mandatory extension"));
        }

        let mut r = Reader(bare);
        // The user name is ignored: the role is the one from the startup
        // packet, and libpq leaves this empty.
        r.attr(b'n')?;
        let client_nonce = r.attr(b'r')?;
        if !is_printable(client_nonce) {
            return Err(malformed("non-printable characters in SCRAM nonce"));
        }
        while !r.is_empty() {
            r.any_attr()?;
        }

        let mut nonce = client_nonce.to_vec();
        nonce.extend_from_slice(self.nonce.as_str().as_bytes());
        let mut server_first = b"r=".to_vec();
        server_first.extend_from_slice(&nonce);
        server_first.extend_from_slice(b",s=");
        server_first.extend_from_slice(B64.encode(&self.secret.salt).as_bytes());
        server_first.extend_from_slice(format!(",i={}", self.secret.iterations).as_bytes());

        self.state = ServerState::AwaitClientFinal {
            cbind,
            bound: cbind_flag == b'p',
            client_first_bare: bare.to_vec(),
            server_first: server_first.clone(),
            nonce,
        };
        Ok(server_first)
    }

    /// Handles client-final-message. On a valid proof, returns
    /// server-final-message and the client's [`ClientKey`], with which
    /// [`ScramClient::with_client_key`] can log in to PostgreSQL as the same
    /// role.
    pub fn client_final(&mut self, msg: &[u8]) -> Result<(Vec<u8>, ClientKey), ScramError> {
        let ServerState::AwaitClientFinal {
            cbind: expected,
            bound,
            client_first_bare,
            server_first,
            nonce,
        } = std::mem::replace(&mut self.state, ServerState::Done)
        else {
            return Err(ScramError::OutOfOrder);
        };
        check_message(msg)?;

        let mut r = Reader(msg);
        // The attribute repeats the first message's GS2 header, followed
        // for PLUS by the binding data: a client that bound to another
        // certificate fails here, before its proof (which signs what it
        // sent, so would hold) is looked at. As in PostgreSQL the base64
        // text is compared, not what it decodes to.
        if r.attr(b'c')? != expected.as_slice() {
            return Err(if bound {
                ScramError::ChannelBindingMismatch
            } else {
                malformed("unexpected SCRAM channel-binding attribute in client-final-message")
            });
        }
        let final_nonce = r.attr(b'r')?;
        // Extensions may come before the proof, which must be last.
        let (without_proof_len, proof) = loop {
            // The proof is preceded by a comma that is not part of the
            // signed message.
            let before = msg.len().saturating_sub(r.0.len() + 1);
            let (attr, value) = r.any_attr()?;
            if attr == b'p' {
                break (before, value);
            }
        };
        let proof = decode_key(proof).ok_or_else(|| malformed("malformed proof"))?;
        if !r.is_empty() {
            return Err(malformed(
                "garbage found at the end of client-final-message",
            ));
        }
        if final_nonce != nonce.as_slice() {
            return Err(ScramError::NonceMismatch);
        }

        let without_proof = msg
            .get(..without_proof_len)
            .ok_or_else(|| malformed("truncated client-final-message"))?;
        let auth_message = auth_message(&client_first_bare, &server_first, without_proof);
        let client_signature = hmac(&self.secret.stored_key, &[&auth_message]);
        let client_key = xor(&proof, &client_signature);
        if !bool::from(sha256(&client_key).ct_eq(&self.secret.stored_key)) {
            return Err(ScramError::InvalidProof);
        }
        let server_signature = hmac(&self.secret.server_key, &[&auth_message]);
        let mut server_final = b"v=".to_vec();
        server_final.extend_from_slice(B64.encode(server_signature).as_bytes());
        Ok((server_final, ClientKey(client_key)))
    }
}

/// What the client logs in with.
enum Credentials {
    /// SASLprep-ed password.
    Password(Vec<u8>),
    /// A key recovered by [`ScramServer::client_final`], and the ServerKey
    /// if known, to check the server's signature.
    Key {
        client_key: ClientKey,
        server_key: Option<[u8; KEY_LEN]>,
    },
}

/// Client state between messages.
enum ClientState {
    Initial,
    AwaitServerFirst {
        client_first_bare: Vec<u8>,
    },
    AwaitServerFinal {
        /// `None` when the ServerKey is unknown.
        server_signature: Option<[u8; KEY_LEN]>,
    },
    Done,
}

/// Whether [`ScramClient::server_final`] could authenticate the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerVerification {
    /// The server's signature proves it knows the ServerKey.
    Verified,
    /// The client was built without a ServerKey, so the signature was only
    /// parsed, not checked.
    Unchecked,
}

/// The client side of one SCRAM-SHA-256 exchange.
///
/// Send [`Self::client_first`] in SASLInitialResponse (mechanism
/// [`Self::mechanism`]), answer AuthenticationSASLContinue with
/// [`Self::server_first`] in a SASLResponse, and check
/// AuthenticationSASLFinal with [`Self::server_final`]. Any error ends the
/// exchange.
pub struct ScramClient {
    credentials: Credentials,
    nonce: Nonce,
    username: String,
    /// `tls-server-end-point` data to bind to, for SCRAM-SHA-256-PLUS.
    channel_binding: Option<Vec<u8>>,
    state: ClientState,
}

impl ScramClient {
    /// A client that knows the password. Non-UTF-8 passwords, and passwords
    /// SASLprep rejects, are used as raw bytes, as PostgreSQL does.
    pub fn with_password(password: impl AsRef<[u8]>, nonce: impl Into<Nonce>) -> Self {
        ScramClient {
            credentials: Credentials::Password(saslprep(password.as_ref()).into_owned()),
            nonce: nonce.into(),
            username: String::new(),
            channel_binding: None,
            state: ClientState::Initial,
        }
    }

    /// A client that knows only the ClientKey, typically recovered from the
    /// connecting client's exchange by [`ScramServer::client_final`].
    ///
    /// The login succeeds only if PostgreSQL's secret is the one the key
    /// belongs to (same password, salt and iteration count); otherwise
    /// PostgreSQL refuses the proof. With `server_key`, the server's
    /// signature is checked as well.
    pub fn with_client_key(
        client_key: ClientKey,
        server_key: Option<[u8; KEY_LEN]>,
        nonce: impl Into<Nonce>,
    ) -> Self {
        ScramClient {
            credentials: Credentials::Key {
                client_key,
                server_key,
            },
            nonce: nonce.into(),
            username: String::new(),
            channel_binding: None,
            state: ClientState::Initial,
        }
    }

    /// Sets the user name sent in client-first-message. PostgreSQL ignores
    /// it (libpq sends it empty, which is the default here); other SCRAM
    /// servers, and RFC test vectors, need it.
    pub fn with_username(mut self, username: &str) -> Self {
        self.username = username.to_owned();
        self
    }

    /// Binds the exchange to the server's certificate (SCRAM-SHA-256-PLUS):
    /// `data` is the `tls-server-end-point` data of the certificate the
    /// server presented ([`crate::cert::tls_server_end_point`]).
    pub fn with_channel_binding(mut self, data: impl Into<Vec<u8>>) -> Self {
        self.channel_binding = Some(data.into());
        self
    }

    /// The mechanism to name in SASLInitialResponse: [`MECHANISM_PLUS`]
    /// when binding, else [`MECHANISM`].
    pub fn mechanism(&self) -> &'static str {
        if self.channel_binding.is_some() {
            MECHANISM_PLUS
        } else {
            MECHANISM
        }
    }

    /// Returns client-first-message.
    pub fn client_first(&mut self) -> Result<Vec<u8>, ScramError> {
        if !matches!(self.state, ClientState::Initial) {
            self.state = ClientState::Done;
            return Err(ScramError::OutOfOrder);
        }
        let mut bare = b"n=".to_vec();
        for &b in self.username.as_bytes() {
            // RFC 5802 saslname escaping.
            match b {
                b',' => bare.extend_from_slice(b"=2C"),
                b'=' => bare.extend_from_slice(b"=3D"),
                _ => bare.push(b),
            }
        }
        bare.extend_from_slice(b",r=");
        bare.extend_from_slice(self.nonce.as_str().as_bytes());
        let mut msg = match self.channel_binding {
            Some(_) => GS2_HEADER_PLUS.to_vec(),
            None => b"n,,".to_vec(),
        };
        msg.extend_from_slice(&bare);
        self.state = ClientState::AwaitServerFirst {
            client_first_bare: bare,
        };
        Ok(msg)
    }

    /// Handles server-first-message and returns client-final-message.
    pub fn server_first(&mut self, msg: &[u8]) -> Result<Vec<u8>, ScramError> {
        let ClientState::AwaitServerFirst { client_first_bare } =
            std::mem::replace(&mut self.state, ClientState::Done)
        else {
            return Err(ScramError::OutOfOrder);
        };
        check_message(msg)?;

        let mut r = Reader(msg);
        let nonce = r.attr(b'r')?;
        if !nonce.starts_with(self.nonce.as_str().as_bytes()) || !is_printable(nonce) {
            return Err(ScramError::NonceMismatch);
        }
        let salt = r.attr(b's')?;
        let salt = B64
            .decode(salt)
            .map_err(|_| malformed("invalid salt in server-first-message"))?;
        let iterations = parse_iterations(r.attr(b'i')?)
            .ok_or_else(|| malformed("invalid iteration count in server-first-message"))?;
        if !r.is_empty() {
            return Err(malformed("garbage at end of server-first-message"));
        }

        let (client_key, server_key) = match &self.credentials {
            Credentials::Password(password) => {
                if iterations > MAX_CLIENT_ITERATIONS {
                    return Err(ScramError::TooManyIterations(iterations));
                }
                let salted = hi(password, &salt, iterations);
                (
                    hmac(&salted, &[b"Client Key"]),
                    Some(hmac(&salted, &[b"Server Key"])),
                )
            }
            Credentials::Key {
                client_key,
                server_key,
            } => (client_key.0, *server_key),
        };

        // The channel-binding attribute: the GS2 header, then for PLUS the
        // binding data, in base64.
        let cbind_input = match &self.channel_binding {
            Some(data) => [GS2_HEADER_PLUS, data].concat(),
            None => b"n,,".to_vec(),
        };
        let mut without_proof = b"c=".to_vec();
        without_proof.extend_from_slice(B64.encode(cbind_input).as_bytes());
        without_proof.extend_from_slice(b",r=");
        without_proof.extend_from_slice(nonce);
        let auth_message = auth_message(&client_first_bare, msg, &without_proof);
        let client_signature = hmac(&sha256(&client_key), &[&auth_message]);
        let proof = xor(&client_key, &client_signature);

        let mut client_final = without_proof;
        client_final.extend_from_slice(b",p=");
        client_final.extend_from_slice(B64.encode(proof).as_bytes());
        self.state = ClientState::AwaitServerFinal {
            server_signature: server_key.map(|k| hmac(&k, &[&auth_message])),
        };
        Ok(client_final)
    }

    /// Handles server-final-message, checking the server's signature when
    /// the ServerKey is known.
    pub fn server_final(&mut self, msg: &[u8]) -> Result<ServerVerification, ScramError> {
        let ClientState::AwaitServerFinal { server_signature } =
            std::mem::replace(&mut self.state, ClientState::Done)
        else {
            return Err(ScramError::OutOfOrder);
        };
        check_message(msg)?;

        if let Some(error) = msg.strip_prefix(b"e=") {
            return Err(ScramError::ServerError(
                String::from_utf8_lossy(error).into_owned(),
            ));
        }
        let mut r = Reader(msg);
        let signature =
            decode_key(r.attr(b'v')?).ok_or_else(|| malformed("malformed server signature"))?;
        if !r.is_empty() {
            return Err(malformed("garbage at end of server-final-message"));
        }
        match server_signature {
            None => Ok(ServerVerification::Unchecked),
            Some(expected) if bool::from(expected.ct_eq(&signature)) => {
                Ok(ServerVerification::Verified)
            }
            Some(_) => Err(ScramError::InvalidServerSignature),
        }
    }
}

/// Cursor over a SCRAM message's comma-separated `x=value` attributes,
/// following the reading rules of PostgreSQL's `read_attr_value` and
/// `read_any_attr`: a value runs to the next comma, which is consumed.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Reads the value of attribute `attr`, which must come next.
    fn attr(&mut self, attr: u8) -> Result<&'a [u8], ScramError> {
        match self.0.first() {
            Some(&a) if a == attr => self.value(attr),
            _ => Err(malformed(format!(
                "expected attribute \"{}\"",
                char::from(attr)
            ))),
        }
    }

    /// Reads whatever attribute comes next.
    fn any_attr(&mut self) -> Result<(u8, &'a [u8]), ScramError> {
        match self.0.first() {
            Some(&a) if a.is_ascii_alphabetic() => Ok((a, self.value(a)?)),
            Some(_) => Err(malformed("attribute expected, but found invalid character")),
            None => Err(malformed("attribute expected, but found end of string")),
        }
    }

    fn value(&mut self, attr: u8) -> Result<&'a [u8], ScramError> {
        let Some(rest) = self.0.get(1..).and_then(|r| r.strip_prefix(b"=")) else {
            return Err(malformed(format!(
                "expected character \"=\" for attribute \"{}\"",
                char::from(attr)
            )));
        };
        match rest.iter().position(|&b| b == b',') {
            Some(end) => {
                self.0 = rest.get(end + 1..).unwrap_or_default();
                Ok(rest.get(..end).unwrap_or_default())
            }
            None => {
                self.0 = &[];
                Ok(rest)
            }
        }
    }
}

/// PostgreSQL reads SCRAM messages as C strings: an empty one, or one with
/// a NUL inside, is refused before parsing.
fn check_message(msg: &[u8]) -> Result<(), ScramError> {
    if msg.is_empty() {
        return Err(malformed("the message is empty"));
    }
    if msg.contains(&0) {
        return Err(malformed("message length does not match input length"));
    }
    Ok(())
}

/// SCRAM's `printable`: ASCII 0x21..=0x7E except `,`.
fn is_printable(s: &[u8]) -> bool {
    s.iter().all(|&b| (0x21..=0x7e).contains(&b) && b != b',')
}

/// A positive decimal iteration count, like PostgreSQL's (it rejects signs,
/// spaces and overflow through `strtol` plus an end check).
fn parse_iterations(s: &[u8]) -> Option<u32> {
    if s.is_empty() || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(s)
        .ok()?
        .parse::<u32>()
        .ok()
        .filter(|&i| i > 0 && i <= i32::MAX as u32)
}

fn decode_key(s: &[u8]) -> Option<[u8; KEY_LEN]> {
    B64.decode(s).ok()?.try_into().ok()
}

fn auth_message(client_first_bare: &[u8], server_first: &[u8], client_final: &[u8]) -> Vec<u8> {
    let mut m =
        Vec::with_capacity(client_first_bare.len() + server_first.len() + client_final.len() + 2);
    m.extend_from_slice(client_first_bare);
    m.push(b',');
    m.extend_from_slice(server_first);
    m.push(b',');
    m.extend_from_slice(client_final);
    m
}

fn xor(a: &[u8; KEY_LEN], b: &[u8; KEY_LEN]) -> [u8; KEY_LEN] {
    let mut out = *a;
    for (o, b) in out.iter_mut().zip(b) {
        *o ^= b;
    }
    out
}

fn sha256(data: &[u8]) -> [u8; KEY_LEN] {
    Sha256::digest(data).into()
}

/// An HMAC-SHA-256 instance keyed with `key`.
///
/// HMAC hashes keys longer than a block and zero-pads shorter ones, so it
/// accepts any key; doing that padding here lets us use the infallible
/// constructor instead of carrying an unreachable error around.
fn keyed(key: &[u8]) -> HmacSha256 {
    let mut block = Key::<HmacSha256>::default();
    if key.len() > block.len() {
        for (d, s) in block.iter_mut().zip(Sha256::digest(key).iter()) {
            *d = *s;
        }
    } else {
        for (d, s) in block.iter_mut().zip(key) {
            *d = *s;
        }
    }
    HmacSha256::new(&block)
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; KEY_LEN] {
    let mut mac = keyed(key);
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

/// PBKDF2-HMAC-SHA-256 with one output block: RFC 5802's `Hi()`.
fn hi(password: &[u8], salt: &[u8], iterations: u32) -> [u8; KEY_LEN] {
    let base = keyed(password);
    let mut mac = base.clone();
    mac.update(salt);
    mac.update(&1u32.to_be_bytes());
    let mut u: [u8; KEY_LEN] = mac.finalize().into_bytes().into();
    let mut out = u;
    for _ in 1..iterations {
        let mut mac = base.clone();
        mac.update(&u);
        u = mac.finalize().into_bytes().into();
        out = xor(&out, &u);
    }
    out
}

/// PostgreSQL's `pg_saslprep`, falling back to the raw bytes whenever it
/// would fail, as both the server (`scram_build_secret`) and libpq do.
///
/// PostgreSQL's version has two quirks kept here because the derived keys
/// must match byte for byte: pure ASCII is passed through untouched (even
/// control characters, which SASLprep prohibits), and the prohibited-output
/// and bidirectional checks look at the mapped string before NFKC
/// normalization rather than after. The remaining possible difference is the
/// Unicode version of the NFKC tables.
fn saslprep(password: &[u8]) -> Cow<'_, [u8]> {
    use stringprep::tables;

    let Ok(text) = std::str::from_utf8(password) else {
        return Cow::Borrowed(password);
    };
    if text.is_ascii() {
        return Cow::Borrowed(password);
    }
    // Spaces first: U+200B is on both lists, and PostgreSQL maps it to a
    // space.
    let mapped: Vec<char> = text
        .chars()
        .filter_map(|c| {
            if tables::non_ascii_space_character(c) {
                Some(' ')
            } else if tables::commonly_mapped_to_nothing(c) {
                None
            } else {
                Some(c)
            }
        })
        .collect();
    let prohibited = |c: char| {
        tables::non_ascii_space_character(c)
            || tables::ascii_control_character(c)
            || tables::non_ascii_control_character(c)
            || tables::private_use(c)
            || tables::non_character_code_point(c)
            || tables::surrogate_code(c)
            || tables::inappropriate_for_plain_text(c)
            || tables::inappropriate_for_canonical_representation(c)
            || tables::change_display_properties_or_deprecated(c)
            || tables::tagging_character(c)
            || tables::unassigned_code_point(c)
    };
    let (Some(&first), Some(&last)) = (mapped.first(), mapped.last()) else {
        // PostgreSQL refuses an empty result, which means raw bytes.
        return Cow::Borrowed(password);
    };
    if mapped.iter().any(|&c| prohibited(c)) {
        return Cow::Borrowed(password);
    }
    if mapped.iter().any(|&c| tables::bidi_r_or_al(c))
        && (mapped.iter().any(|&c| tables::bidi_l(c))
            || !tables::bidi_r_or_al(first)
            || !tables::bidi_r_or_al(last))
    {
        return Cow::Borrowed(password);
    }
    Cow::Owned(mapped.into_iter().nfkc().collect::<String>().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Independent PBKDF2: a fresh HMAC per step, straight from RFC 2898.
    fn pbkdf2_naive(password: &[u8], salt: &[u8], iterations: u32) -> [u8; 32] {
        let mac = |key: &[u8], data: &[u8]| -> [u8; 32] {
            let mut m = <HmacSha256 as KeyInit>::new_from_slice(key).unwrap();
            m.update(data);
            m.finalize().into_bytes().into()
        };
        let mut first = salt.to_vec();
        first.extend_from_slice(&[0, 0, 0, 1]);
        let mut u = mac(password, &first);
        let mut out = u;
        for _ in 1..iterations {
            u = mac(password, &u);
            for (o, x) in out.iter_mut().zip(u) {
                *o ^= x;
            }
        }
        out
    }

    // RFC 7677, section 3.
    const RFC_CLIENT_FIRST: &str = "n,,n=user,r=rOprNGfwEbeRWgbNEkqO";
    const RFC_SERVER_FIRST: &str =
        "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096";
    const RFC_CLIENT_FINAL: &str = "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,\
                                    p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=";
    const RFC_SERVER_FINAL: &str = "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=";

    fn rfc_secret() -> ScramSecret {
        let salt = B64.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
        ScramSecret::from_password("pencil", &salt, 4096).unwrap()
    }

    #[test]
    fn hi_matches_naive_pbkdf2() {
        for (pw, salt, i) in [
            (&b"pencil"[..], &b"salt"[..], 1),
            (b"pencil", b"salt", 2),
            (b"", b"s", 3),
            (&[7u8; 100][..], b"long key is hashed first", 5),
            (&[1u8; 64][..], b"exactly one block", 2),
        ] {
            assert_eq!(hi(pw, salt, i), pbkdf2_naive(pw, salt, i));
        }
    }

    #[test]
    fn rfc7677_server() {
        let secret = rfc_secret();
        let nonce = Nonce::printable("%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0").unwrap();
        let mut server = ScramServer::new(&secret, nonce);
        let server_first = server.client_first(RFC_CLIENT_FIRST.as_bytes()).unwrap();
        assert_eq!(server_first, RFC_SERVER_FIRST.as_bytes());
        let (server_final, key) = server.client_final(RFC_CLIENT_FINAL.as_bytes()).unwrap();
        assert_eq!(server_final, RFC_SERVER_FINAL.as_bytes());
        assert_eq!(key.stored_key(), secret.stored_key);
        // The exchange is over.
        assert_eq!(
            server.client_final(RFC_CLIENT_FINAL.as_bytes()),
            Err(ScramError::OutOfOrder)
        );
    }

    #[test]
    fn rfc7677_client() {
        let nonce = Nonce::printable("rOprNGfwEbeRWgbNEkqO").unwrap();
        let mut client = ScramClient::with_password("pencil", nonce).with_username("user");
        assert_eq!(client.client_first().unwrap(), RFC_CLIENT_FIRST.as_bytes());
        let client_final = client.server_first(RFC_SERVER_FIRST.as_bytes()).unwrap();
        assert_eq!(client_final, RFC_CLIENT_FINAL.as_bytes());
        assert_eq!(
            client.server_final(RFC_SERVER_FINAL.as_bytes()),
            Ok(ServerVerification::Verified)
        );
    }

    #[test]
    fn rfc7677_client_rejects_forged_server_signature() {
        let nonce = Nonce::printable("rOprNGfwEbeRWgbNEkqO").unwrap();
        let mut client = ScramClient::with_password("pencil", nonce).with_username("user");
        client.client_first().unwrap();
        client.server_first(RFC_SERVER_FIRST.as_bytes()).unwrap();
        let forged = format!("v={}", B64.encode([0u8; 32]));
        assert_eq!(
            client.server_final(forged.as_bytes()),
            Err(ScramError::InvalidServerSignature)
        );
    }

    #[test]
    fn secret_generation_matches_formulas() {
        let salt = [0x5au8; 16];
        let secret = ScramSecret::from_password("s3cr3t", &salt, 4096).unwrap();

        let salted = pbkdf2_naive(b"s3cr3t", &salt, 4096);
        let mac = |key: &[u8], data: &[u8]| -> [u8; 32] {
            let mut m = <HmacSha256 as KeyInit>::new_from_slice(key).unwrap();
            m.update(data);
            m.finalize().into_bytes().into()
        };
        let client_key = mac(&salted, b"Client Key");
        let stored_key: [u8; 32] = Sha256::digest(client_key).into();
        let server_key = mac(&salted, b"Server Key");
        let expected = format!(
            "SCRAM-SHA-256$4096:{}${}:{}",
            B64.encode(salt),
            B64.encode(stored_key),
            B64.encode(server_key)
        );
        assert_eq!(secret.to_string(), expected);
        assert_eq!(ScramSecret::parse(&expected).unwrap(), secret);
        assert_eq!(expected.parse::<ScramSecret>().unwrap(), secret);
    }

    /// Secrets written by PostgreSQL 15.18 (`SET password_encryption =
    /// 'scram-sha-256'; CREATE ROLE ... PASSWORD ...`), with random salts;
    /// re-deriving them from the password checks the whole derivation,
    /// SASLprep included.
    const PG15_SECRETS: [(&str, &str); 4] = [
        (
            "pencil",
            "SCRAM-SHA-256$4096:KF1Ggg/2hPyC4Mtnud/hCA==$hEgabPsL+BNDZxm7nz8fVxGxX7qoM8jAdlHyg0Qsfxk=:4Yhvc8I3yr4VzpRu7lVySidU01l2kQkZFkvh6yQKiJY=",
        ),
        // Ligature (NFKC), no-break space (mapped to space) and soft hyphen
        // (mapped to nothing).
        (
            "\u{FB01}\u{00A0}x\u{00AD}",
            "SCRAM-SHA-256$4096:saYb1KfEob5fS/YeYj8QKQ==$bQMjorhzKxMhO0AdtCNfUR/aQbJ4fSmLnYyKitaKquM=:HWzLSoqsyTlyC/xTGOqjqZFRmJN/lg/kIsa7RWSL9RI=",
        ),
        // Private-use character: SASLprep fails, raw bytes are used.
        (
            "x\u{E000}",
            "SCRAM-SHA-256$4096:9PvRlWA+GsPv9zlTGpbleA==$9GCGn+t5dznbMNY0AjKhEPr5Kp9AcrUJjIg8q7GJLBs=:of/vEk6rjtyyKiHMRM9Ci4ciRlUZSUV5cnnNdocP2lw=",
        ),
        // Mixed right-to-left and left-to-right: bidi check fails, raw.
        (
            "\u{05D0}a",
            "SCRAM-SHA-256$4096:v8+H7JoRo9XikfBAjEI0JQ==$GOKELBZHuywin+pRjYtbuBef79aKgkTZc8f5GZPkbSg=:KRrmKgRjhOX5G1URe81EJEzY5+TXBfI5Dt08/YdzP/w=",
        ),
    ];

    #[test]
    fn matches_postgres_secrets() {
        for (password, text) in PG15_SECRETS {
            let parsed = ScramSecret::parse(text).unwrap();
            assert_eq!(parsed.iterations, 4096);
            assert_eq!(parsed.salt.len(), DEFAULT_SALT_LEN);
            assert_eq!(parsed.to_string(), text);
            let derived =
                ScramSecret::from_password(password, &parsed.salt, parsed.iterations).unwrap();
            assert_eq!(derived, parsed, "{password:?}");

            // And a full exchange against it.
            let mut client = ScramClient::with_password(password, [1u8; NONCE_LEN]);
            let (key, v) = exchange(&mut client, &parsed, [2u8; NONCE_LEN]).unwrap();
            assert_eq!(v, ServerVerification::Verified);
            assert_eq!(key.stored_key(), parsed.stored_key);
        }
        let parsed = ScramSecret::parse(PG15_SECRETS[0].1).unwrap();
        assert!(!format!("{parsed:?}").contains("hEgabPsL"));
    }

    #[test]
    fn rejects_bad_secrets() {
        let good = rfc_secret().to_string();
        let (head, keys) = good.rsplit_once('$').unwrap();
        let (stored, server) = keys.split_once(':').unwrap();
        let bad = [
            String::new(),
            "md5abcdef".to_owned(),
            "SCRAM-SHA-256$".to_owned(),
            good.replacen("SCRAM-SHA-256", "SCRAM-SHA-1", 1),
            good.replacen("4096", "0", 1),
            good.replacen("4096", "-1", 1),
            good.replacen("4096", "99999999999", 1),
            good.replacen("4096", "40x6", 1),
            good.replacen("W22ZaJ0SNY7soEsUEjb6gQ==", "", 1),
            good.replacen("W22ZaJ0SNY7soEsUEjb6gQ==", "!!!", 1),
            format!("{head}${stored}"),
            format!("{head}${stored}:{}", &server[4..]),
            format!("{head}$AAAA:{server}"),
            format!("{good}:extra"),
        ];
        for s in bad {
            assert!(
                matches!(ScramSecret::parse(&s), Err(ScramError::InvalidSecret(_))),
                "{s:?}"
            );
        }
        assert!(ScramSecret::from_password("x", b"salt", 0).is_err());
        assert!(ScramSecret::from_password("x", b"", 1).is_err());
    }

    /// Runs a whole exchange; returns the server's result.
    fn exchange(
        client: &mut ScramClient,
        secret: &ScramSecret,
        server_nonce: [u8; NONCE_LEN],
    ) -> Result<(ClientKey, ServerVerification), ScramError> {
        let mut server = ScramServer::new(secret, server_nonce);
        let first = client.client_first()?;
        let server_first = server.client_first(&first)?;
        let client_final = client.server_first(&server_first)?;
        let (server_final, key) = server.client_final(&client_final)?;
        let verification = client.server_final(&server_final)?;
        Ok((key, verification))
    }

    #[test]
    fn client_key_reuse() {
        let secret = ScramSecret::from_password("correct horse", &[3u8; 16], 4096).unwrap();
        let mut client = ScramClient::with_password("correct horse", [1u8; NONCE_LEN]);
        let (key, v) = exchange(&mut client, &secret, [2u8; NONCE_LEN]).unwrap();
        assert_eq!(v, ServerVerification::Verified);
        assert_eq!(key.stored_key(), secret.stored_key);

        // pgwarden logging in to PostgreSQL (another server, same secret)
        // with fresh nonces and only the key.
        let mut upstream =
            ScramClient::with_client_key(key.clone(), Some(secret.server_key), [4u8; NONCE_LEN]);
        let (key2, v) = exchange(&mut upstream, &secret, [5u8; NONCE_LEN]).unwrap();
        assert_eq!(v, ServerVerification::Verified);
        assert_eq!(key2, key);

        // Without the ServerKey the exchange works but is not verified.
        let mut upstream = ScramClient::with_client_key(key.clone(), None, [6u8; NONCE_LEN]);
        let (_, v) = exchange(&mut upstream, &secret, [7u8; NONCE_LEN]).unwrap();
        assert_eq!(v, ServerVerification::Unchecked);

        // A secret for another password (or salt) refuses the key.
        let other = ScramSecret::from_password("correct horse", &[9u8; 16], 4096).unwrap();
        let mut upstream = ScramClient::with_client_key(key, None, [8u8; NONCE_LEN]);
        assert_eq!(
            exchange(&mut upstream, &other, [9u8; NONCE_LEN]).unwrap_err(),
            ScramError::InvalidProof
        );
    }

    #[test]
    fn wrong_password_and_unknown_user() {
        let secret = ScramSecret::from_password("right", &[3u8; 16], 4096).unwrap();
        let mut client = ScramClient::with_password("wrong", [1u8; NONCE_LEN]);
        assert_eq!(
            exchange(&mut client, &secret, [2u8; NONCE_LEN]).unwrap_err(),
            ScramError::InvalidProof
        );

        // An unknown user gets a stable, plausible salt and fails the same
        // way, whatever password is tried.
        let seed = [42u8; 32];
        let mock = ScramSecret::mock("nobody", &seed);
        assert_eq!(mock, ScramSecret::mock("nobody", &seed));
        assert_ne!(mock.salt, ScramSecret::mock("somebody", &seed).salt);
        assert_ne!(mock.salt, ScramSecret::mock("nobody", &[43u8; 32]).salt);
        assert_eq!(mock.salt.len(), DEFAULT_SALT_LEN);
        assert_eq!(mock.iterations, DEFAULT_ITERATIONS);
        for password in ["", "right", "nobody"] {
            let mut client = ScramClient::with_password(password, [1u8; NONCE_LEN]);
            assert_eq!(
                exchange(&mut client, &mock, [2u8; NONCE_LEN]).unwrap_err(),
                ScramError::InvalidProof
            );
        }
    }

    #[test]
    fn libpq_style_messages() {
        let secret = rfc_secret();
        // libpq sends an empty user name; `y` is accepted since PLUS is
        // not offered (as over plain TCP or a Unix-domain socket).
        for (first, cbind) in [("n,,n=,r=abc", "biws"), ("y,,n=,r=abc", "eSws")] {
            let mut server = ScramServer::new(&secret, [0u8; NONCE_LEN]);
            let server_first = server.client_first(first.as_bytes()).unwrap();
            let nonce = format!("abc{}", Nonce::from_random([0u8; NONCE_LEN]).as_str());
            assert!(server_first.starts_with(format!("r={nonce},s=").as_bytes()));
            // Wrong channel-binding echo.
            let other = if cbind == "biws" { "eSws" } else { "biws" };
            let bad = format!("c={other},r={nonce},p={}", B64.encode([0u8; 32]));
            assert!(matches!(
                server.client_final(bad.as_bytes()),
                Err(ScramError::Malformed(_))
            ));
        }
    }

    #[test]
    fn server_refusals() {
        let secret = rfc_secret();
        let first =
            |msg: &str| ScramServer::new(&secret, [0u8; NONCE_LEN]).client_first(msg.as_bytes());
        // Binding data with plain SCRAM-SHA-256, and PLUS, which is not
        // offered here.
        assert!(matches!(
            first("p=tls-server-end-point,,n=,r=a"),
            Err(ScramError::Malformed(_))
        ));
        assert_eq!(
            ScramServer::new(&secret, [0u8; NONCE_LEN])
                .initial_response(MECHANISM_PLUS, b"p=tls-server-end-point,,n=,r=a"),
            Err(ScramError::InvalidMechanism)
        );
        assert_eq!(
            ScramServer::new(&secret, [0u8; NONCE_LEN]).mechanisms(),
            &[MECHANISM]
        );
        assert_eq!(
            first("n,a=admin,n=,r=a"),
            Err(ScramError::Unsupported("authorization identity"))
        );
        assert_eq!(
            first("n,,m=ext,n=,r=a"),
            Err(ScramError::Unsupported("mandatory extension"))
        );
        for bad in [
            "",
            "x,,n=,r=a",
            "n",
            "n,",
            "n,,",
            "n,,r=a",
            "n,,n=,r=a b",
            "n,,n=,r=a,1=x",
            "n,,n=\0,r=a",
        ] {
            assert!(
                matches!(first(bad), Err(ScramError::Malformed(_))),
                "{bad:?}"
            );
        }
        // Extensions after the nonce are ignored.
        assert!(first("n,,n=,r=a,x=y").is_ok());

        let nonce = |server: &mut ScramServer| {
            let sf = server.client_first(b"n,,n=,r=abc").unwrap();
            let sf = String::from_utf8(sf).unwrap();
            sf[2..sf.find(',').unwrap()].to_owned()
        };
        let zero_proof = B64.encode([0u8; 32]);
        let mut s = ScramServer::new(&secret, [0u8; NONCE_LEN]);
        let n = nonce(&mut s);
        assert_eq!(
            s.client_final(format!("c=biws,r={n}x,p={zero_proof}").as_bytes()),
            Err(ScramError::NonceMismatch)
        );
        for bad in [
            format!("c=biws,r={n}"),
            format!("c=biws,r={n},p=AAAA"),
            format!("c=biws,r={n},p={zero_proof},x=1"),
            format!("r={n},p={zero_proof}"),
        ] {
            let mut s = ScramServer::new(&secret, [0u8; NONCE_LEN]);
            let n2 = nonce(&mut s);
            assert_eq!(n, n2);
            assert!(
                matches!(
                    s.client_final(bad.as_bytes()),
                    Err(ScramError::Malformed(_))
                ),
                "{bad:?}"
            );
        }
        // Extensions before the proof are allowed, and are signed.
        let mut s = ScramServer::new(&secret, [0u8; NONCE_LEN]);
        nonce(&mut s);
        assert_eq!(
            s.client_final(format!("c=biws,r={n},x=1,p={zero_proof}").as_bytes()),
            Err(ScramError::InvalidProof)
        );
        // Final before first.
        let mut s = ScramServer::new(&secret, [0u8; NONCE_LEN]);
        assert_eq!(s.client_final(b"c=biws"), Err(ScramError::OutOfOrder));
    }

    /// Binding data as a server would hold it: a SHA-256 hash.
    const CERT_HASH: [u8; 32] = [0xc5; 32];

    /// Runs a whole exchange with the mechanism the client picks.
    fn exchange_with(
        client: &mut ScramClient,
        server: &mut ScramServer,
    ) -> Result<(ClientKey, ServerVerification), ScramError> {
        let first = client.client_first()?;
        let server_first = server.initial_response(client.mechanism(), &first)?;
        let client_final = client.server_first(&server_first)?;
        let (server_final, key) = server.client_final(&client_final)?;
        let verification = client.server_final(&server_final)?;
        Ok((key, verification))
    }

    #[test]
    fn plus_exchange_binds_to_the_certificate() {
        let secret = ScramSecret::from_password("correct horse", &[3u8; 16], 4096).unwrap();
        let mut server =
            ScramServer::new(&secret, [2u8; NONCE_LEN]).with_channel_binding(CERT_HASH);
        // PLUS first, as PostgreSQL lists them over TLS.
        assert_eq!(server.mechanisms(), &[MECHANISM_PLUS, MECHANISM]);
        let mut client = ScramClient::with_password("correct horse", [1u8; NONCE_LEN])
            .with_channel_binding(CERT_HASH);
        assert_eq!(client.mechanism(), MECHANISM_PLUS);

        let first = client.client_first().unwrap();
        assert!(first.starts_with(b"p=tls-server-end-point,,n=,r="));
        let server_first = server.initial_response(MECHANISM_PLUS, &first).unwrap();
        let client_final = client.server_first(&server_first).unwrap();
        // c= is the GS2 header and the certificate hash, in base64.
        let cbind = [&b"p=tls-server-end-point,,"[..], &CERT_HASH].concat();
        let expected = format!("c={},r=", B64.encode(cbind));
        assert!(
            client_final.starts_with(expected.as_bytes()),
            "{}",
            String::from_utf8_lossy(&client_final)
        );
        let (server_final, key) = server.client_final(&client_final).unwrap();
        assert_eq!(
            client.server_final(&server_final),
            Ok(ServerVerification::Verified)
        );
        assert_eq!(key.stored_key(), secret.stored_key);

        // The key proven through a bound exchange logs in to PostgreSQL
        // (unbound, over pgwarden's own connection) all the same.
        let mut upstream =
            ScramClient::with_client_key(key.clone(), Some(secret.server_key), [4u8; NONCE_LEN]);
        let (key2, v) = exchange(&mut upstream, &secret, [5u8; NONCE_LEN]).unwrap();
        assert_eq!(v, ServerVerification::Verified);
        assert_eq!(key2, key);

        // A client that does not bind may still use plain SCRAM-SHA-256
        // with `n`, as libpq's channel_binding=disable does over TLS.
        let mut server =
            ScramServer::new(&secret, [2u8; NONCE_LEN]).with_channel_binding(CERT_HASH);
        let mut plain = ScramClient::with_password("correct horse", [1u8; NONCE_LEN]);
        let (key3, v) = exchange_with(&mut plain, &mut server).unwrap();
        assert_eq!(v, ServerVerification::Verified);
        assert_eq!(key3, key);
    }

    #[test]
    fn plus_wrong_binding_data_is_refused() {
        let secret = ScramSecret::from_password("pw", &[3u8; 16], 4096).unwrap();
        let server = || ScramServer::new(&secret, [2u8; NONCE_LEN]).with_channel_binding(CERT_HASH);

        // The client saw another certificate (a man in the middle's): its
        // binding data is not the server's.
        let mut client =
            ScramClient::with_password("pw", [1u8; NONCE_LEN]).with_channel_binding([0xaa; 32]);
        assert_eq!(
            exchange_with(&mut client, &mut server()),
            Err(ScramError::ChannelBindingMismatch)
        );
        // A hash of another length (SHA-384) and none at all.
        let mut client =
            ScramClient::with_password("pw", [1u8; NONCE_LEN]).with_channel_binding([0xc5; 48]);
        assert_eq!(
            exchange_with(&mut client, &mut server()),
            Err(ScramError::ChannelBindingMismatch)
        );
        let mut client =
            ScramClient::with_password("pw", [1u8; NONCE_LEN]).with_channel_binding(Vec::new());
        assert_eq!(
            exchange_with(&mut client, &mut server()),
            Err(ScramError::ChannelBindingMismatch)
        );
        // Even the right password proves nothing with the GS2 header of an
        // unbound exchange in c=.
        let mut s = server();
        let first = s
            .initial_response(MECHANISM_PLUS, b"p=tls-server-end-point,,n=,r=abc")
            .unwrap();
        let nonce = String::from_utf8(first).unwrap()[2..]
            .split(',')
            .next()
            .unwrap()
            .to_owned();
        let zero_proof = B64.encode([0u8; 32]);
        assert_eq!(
            s.client_final(format!("c=biws,r={nonce},p={zero_proof}").as_bytes()),
            Err(ScramError::ChannelBindingMismatch)
        );

        // Something in between that rewrites c= to the server's binding
        // data cannot fix the proof, which signs what the client sent.
        let mut client =
            ScramClient::with_password("pw", [1u8; NONCE_LEN]).with_channel_binding([0xaa; 32]);
        let mut s = server();
        let first = client.client_first().unwrap();
        let server_first = s.initial_response(MECHANISM_PLUS, &first).unwrap();
        let client_final = String::from_utf8(client.server_first(&server_first).unwrap()).unwrap();
        let theirs = B64.encode([&b"p=tls-server-end-point,,"[..], &[0xaa; 32]].concat());
        let ours = B64.encode([&b"p=tls-server-end-point,,"[..], &CERT_HASH].concat());
        let rewritten = client_final.replacen(&theirs, &ours, 1);
        assert_ne!(rewritten, client_final);
        assert_eq!(
            s.client_final(rewritten.as_bytes()),
            Err(ScramError::InvalidProof)
        );
    }

    #[test]
    fn plus_mechanism_and_gs2_flag_must_agree() {
        let secret = rfc_secret();
        let bound = || ScramServer::new(&secret, [0u8; NONCE_LEN]).with_channel_binding(CERT_HASH);
        // PLUS chosen, but no binding in the message.
        for first in ["n,,n=,r=a", "y,,n=,r=a"] {
            assert!(
                matches!(
                    bound().initial_response(MECHANISM_PLUS, first.as_bytes()),
                    Err(ScramError::Malformed(_))
                ),
                "{first}"
            );
        }
        // Binding in the message, but plain SCRAM-SHA-256 chosen.
        assert!(matches!(
            bound().initial_response(MECHANISM, b"p=tls-server-end-point,,n=,r=a"),
            Err(ScramError::Malformed(_))
        ));
        // A mechanism nobody offered.
        for mechanism in ["SCRAM-SHA-1", "scram-sha-256-plus", ""] {
            assert_eq!(
                bound().initial_response(mechanism, b"n,,n=,r=a"),
                Err(ScramError::InvalidMechanism),
                "{mechanism:?}"
            );
        }
        // The well-formed combinations.
        assert!(bound()
            .initial_response(MECHANISM_PLUS, b"p=tls-server-end-point,,n=,r=a")
            .is_ok());
        assert!(bound().initial_response(MECHANISM, b"n,,n=,r=a").is_ok());
    }

    #[test]
    fn y_is_refused_once_plus_is_offered() {
        let secret = rfc_secret();
        // The client could bind but saw no PLUS in the list: someone may
        // have removed it.
        let mut server =
            ScramServer::new(&secret, [0u8; NONCE_LEN]).with_channel_binding(CERT_HASH);
        assert_eq!(
            server.initial_response(MECHANISM, b"y,,n=,r=abc"),
            Err(ScramError::ChannelBindingNegotiation)
        );
        // The exchange is over.
        assert_eq!(server.client_final(b"c=eSws"), Err(ScramError::OutOfOrder));
        // Without the offer (plain TCP), `y` is fine.
        let mut server = ScramServer::new(&secret, [0u8; NONCE_LEN]);
        assert!(server.initial_response(MECHANISM, b"y,,n=,r=abc").is_ok());
    }

    #[test]
    fn plus_refuses_other_binding_types_and_bad_headers() {
        let secret = rfc_secret();
        let first = |msg: &str| {
            ScramServer::new(&secret, [0u8; NONCE_LEN])
                .with_channel_binding(CERT_HASH)
                .initial_response(MECHANISM_PLUS, msg.as_bytes())
        };
        for other in [
            "p=tls-unique,,n=,r=a",
            "p=tls-exporter,,n=,r=a",
            "p=,,n=,r=a",
        ] {
            assert_eq!(
                first(other),
                Err(ScramError::Unsupported("channel-binding type")),
                "{other}"
            );
        }
        assert_eq!(
            first("p=tls-server-end-point,a=admin,n=,r=a"),
            Err(ScramError::Unsupported("authorization identity"))
        );
        assert_eq!(
            first("p=tls-server-end-point,,m=ext,n=,r=a"),
            Err(ScramError::Unsupported("mandatory extension"))
        );
        for bad in [
            "p",
            "p=tls-server-end-point",
            "p=tls-server-end-point,",
            "p=tls-server-end-point,,",
            "ptls-server-end-point,,n=,r=a",
            "p=tls-server-end-point,,n=,r=a b",
        ] {
            assert!(
                matches!(first(bad), Err(ScramError::Malformed(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn client_refusals() {
        let start = || {
            let mut c = ScramClient::with_password("pencil", [1u8; NONCE_LEN]);
            c.client_first().unwrap();
            c
        };
        let nonce = Nonce::from_random([1u8; NONCE_LEN]).as_str().to_owned();
        for bad in [
            "r=other,s=QUJD,i=4096".to_owned(),
            format!("r={nonce}x,s=!!,i=4096"),
            format!("r={nonce}x,s=QUJD,i=0"),
            format!("r={nonce}x,s=QUJD,i=-5"),
            format!("r={nonce}x,s=QUJD"),
            format!("r={nonce}x,s=QUJD,i=1,junk"),
            format!("m=x,r={nonce}x,s=QUJD,i=1"),
        ] {
            assert!(start().server_first(bad.as_bytes()).is_err(), "{bad:?}");
        }
        assert_eq!(
            start().server_first(format!("r={nonce}x,s=QUJD,i=100001").as_bytes()),
            Err(ScramError::TooManyIterations(100_001))
        );
        let mut c = start();
        c.server_first(format!("r={nonce}x,s=QUJD,i=1").as_bytes())
            .unwrap();
        assert_eq!(
            c.server_final(b"e=invalid-proof"),
            Err(ScramError::ServerError("invalid-proof".into()))
        );
        let mut c = ScramClient::with_password("x", [1u8; NONCE_LEN]);
        assert_eq!(c.server_first(b"r=x"), Err(ScramError::OutOfOrder));
        assert!(Nonce::printable("a,b").is_err());
        assert!(Nonce::printable("").is_err());
    }

    #[test]
    fn saslprep_like_postgres() {
        // ASCII, control characters included, passes through.
        assert_eq!(&*saslprep(b"pen\x01cil"), b"pen\x01cil");
        // Non-UTF-8 is used raw.
        assert_eq!(&*saslprep(b"\xff\xfe"), b"\xff\xfe");
        // Non-ASCII space maps to space; soft hyphen maps to nothing.
        assert_eq!(&*saslprep("a\u{00A0}b\u{00AD}c".as_bytes()), b"a bc");
        // Zero-width space is on both lists; PostgreSQL makes it a space.
        assert_eq!(
            &*saslprep("\u{E9}\u{200B}x".as_bytes()),
            "\u{E9} x".as_bytes()
        );
        // NFKC: the "fi" ligature and a full-width digit.
        assert_eq!(&*saslprep("\u{FB01}\u{FF11}".as_bytes()), b"fi1");
        // Only mapped-to-nothing characters: empty after mapping, so raw.
        assert_eq!(&*saslprep("\u{00AD}".as_bytes()), "\u{00AD}".as_bytes());
        // Prohibited (private use) or bad bidi: raw.
        assert_eq!(&*saslprep("x\u{E000}".as_bytes()), "x\u{E000}".as_bytes());
        assert_eq!(&*saslprep("\u{05D0}a".as_bytes()), "\u{05D0}a".as_bytes());
        assert_eq!(
            &*saslprep("\u{05D0}\u{05D1}".as_bytes()),
            "\u{05D0}\u{05D1}".as_bytes()
        );
        // Secrets follow: a password and its normalised form are the same.
        let a = ScramSecret::from_password("\u{FB01}", b"salt", 1).unwrap();
        let b = ScramSecret::from_password("fi", b"salt", 1).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn client_key_debug_is_redacted() {
        let key = ClientKey::from_bytes([0xab; 32]);
        assert_eq!(format!("{key:?}"), "ClientKey(..)");
        assert_eq!(key.as_bytes(), &[0xab; 32]);
    }
}
