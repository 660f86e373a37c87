//! The untagged first packet of a connection.
//!
//! Before authentication the client sends one packet without a type byte:
//! an `Int32` length (counting itself) and an `Int32` code. The code is
//! either a protocol version, in which case a list of `name\0value\0` pairs
//! ending with an extra NUL follows, or one of the special request codes
//! PostgreSQL carves out of the unused major version 1234.
//!
//! Validation mirrors the server's `ProcessStartupPacket`, so a client sees
//! the same refusal through pgwarden as it would from PostgreSQL, with two
//! deliberate differences: names and values must be UTF-8 (they end up in
//! logs and routing decisions), and a cancel request must have exactly the
//! protocol 3.0 length because pgwarden always negotiates 3.0.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::encode::{put_cstr, untagged_packet};
use crate::message::backend;
use crate::sqlstate::{self, SqlState};

/// Largest startup packet PostgreSQL accepts, length field included: it
/// allows 10,000 bytes after the four of the length.
pub const MAX_STARTUP_PACKET: usize = 10_004;
/// Protocol version 3.0 as sent in a startup packet.
pub const PROTOCOL_3_0: i32 = 196_608;
/// Request to upgrade the connection to TLS.
pub const SSL_REQUEST: i32 = 80_877_103;
/// Request to upgrade the connection to GSSAPI encryption.
pub const GSSENC_REQUEST: i32 = 80_877_104;
/// Request to cancel the query running in another session.
pub const CANCEL_REQUEST: i32 = 80_877_102;

/// Prefix of protocol-extension options (as opposed to run-time parameters)
/// in a startup packet.
pub const PROTOCOL_OPTION_PREFIX: &str = "_pq_.";

/// One decoded startup-phase packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartupFrame {
    /// SSLRequest. The reply is a single byte. The caller must treat any
    /// bytes already buffered after this packet as a protocol violation:
    /// they arrived unencrypted and could have been injected by a third party.
    SslRequest,
    /// GSSENCRequest, answered like [`StartupFrame::SslRequest`] and subject
    /// to the same rule about buffered bytes.
    GssEncRequest,
    /// CancelRequest with the key from the target session's BackendKeyData.
    Cancel {
        /// Process id of the session to cancel.
        pid: i32,
        /// Secret key of that session.
        secret: i32,
    },
    /// StartupMessage opening a session.
    Startup(StartupMessage),
}

/// A connection's replication mode (the `replication` start-up parameter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    /// An ordinary connection.
    None,
    /// A physical walsender (`replication=true`): pg_hba.conf's
    /// `replication` entries apply.
    Physical,
    /// A logical walsender (`replication=database`): an ordinary
    /// connection as far as pg_hba.conf goes.
    Logical,
}

/// PostgreSQL's `parse_bool`: `true`/`false`, `yes`/`no` and their
/// prefixes, `on`/`off` (at least two letters), `1`/`0`, in any case.
fn parse_bool(v: &str) -> Option<bool> {
    let l = v.to_ascii_lowercase();
    let prefix_of = |word: &str, min: usize| l.len() >= min && word.starts_with(l.as_str());
    if prefix_of("true", 1) || prefix_of("yes", 1) || l == "on" || l == "1" {
        Some(true)
    } else if prefix_of("false", 1) || prefix_of("no", 1) || prefix_of("off", 2) || l == "0" {
        Some(false)
    } else {
        None
    }
}

/// Longest role or database name PostgreSQL keeps (`NAMEDATALEN` - 1):
/// it cuts longer ones in the start-up packet before anything else.
pub const NAME_MAX: usize = 63;

/// The version and parameters of a StartupMessage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartupMessage {
    /// Requested protocol version as (major, minor); major is always 3.
    pub protocol: (u16, u16),
    /// Parameters in the order received, including `_pq_.` options.
    pub params: Vec<(String, String)>,
}

impl StartupMessage {
    /// A protocol 3.0 startup message with the given parameters.
    pub fn new(params: Vec<(String, String)>) -> Self {
        StartupMessage {
            protocol: (3, 0),
            params,
        }
    }

    /// Value of parameter `name`. Names are matched exactly; if a name is
    /// repeated, the last value wins, as it does in PostgreSQL.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The role to log in as. Always present and non-empty in a message
    /// returned by [`parse_startup`].
    pub fn user(&self) -> Option<&str> {
        self.get("user").filter(|u| !u.is_empty())
    }

    /// The database to connect to, defaulting to the user name when absent
    /// or empty, as PostgreSQL does.
    pub fn database(&self) -> Option<&str> {
        self.get("database")
            .filter(|d| !d.is_empty())
            .or_else(|| self.user())
    }

    /// What the `replication` parameter asks for, read as PostgreSQL reads
    /// it: `database` is a logical walsender, a boolean (`true`, `on`,
    /// `yes`, `1`, their prefixes, any case) a physical one or none. `Err`
    /// carries a value PostgreSQL refuses.
    pub fn replication(&self) -> Result<Replication, &str> {
        match self.get("replication") {
            None => Ok(Replication::None),
            Some("database") => Ok(Replication::Logical),
            Some(v) => match parse_bool(v) {
                Some(true) => Ok(Replication::Physical),
                Some(false) => Ok(Replication::None),
                None => Err(v),
            },
        }
    }

    /// Sets `name` to `value`, replacing all earlier values in place (at the
    /// position of the first one) or appending a new parameter.
    pub fn set(&mut self, name: &str, value: &str) {
        let mut seen = false;
        self.params.retain_mut(|(n, v)| {
            if n != name {
                return true;
            }
            if seen {
                return false;
            }
            seen = true;
            value.clone_into(v);
            true
        });
        if !seen {
            self.params.push((name.to_owned(), value.to_owned()));
        }
    }

    /// Removes every occurrence of `name`.
    pub fn remove(&mut self, name: &str) {
        self.params.retain(|(n, _)| n != name);
    }

    /// Names of the `_pq_.` protocol options the client asked for.
    pub fn protocol_options(&self) -> impl Iterator<Item = &str> {
        self.params
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| n.starts_with(PROTOCOL_OPTION_PREFIX))
    }

    /// The NegotiateProtocolVersion message to send before authentication,
    /// if the client asked for a minor version newer than `newest_minor` or
    /// for any protocol option (the proxy recognises none).
    pub fn negotiation(&self, newest_minor: u16) -> Option<Bytes> {
        let options: Vec<&str> = self.protocol_options().collect();
        if self.protocol.1 <= newest_minor && options.is_empty() {
            return None;
        }
        Some(negotiate_protocol_version(
            i32::from(newest_minor),
            &options,
        ))
    }

    /// Serialises the message for sending to a server. The protocol version
    /// is written as recorded, so set [`Self::protocol`] to `(3, 0)` (and
    /// drop `_pq_.` options) unless the server is meant to negotiate itself.
    pub fn encode(&self) -> BytesMut {
        let mut dst = BytesMut::new();
        untagged_packet(&mut dst, |b| {
            b.put_u16(self.protocol.0);
            b.put_u16(self.protocol.1);
            for (n, v) in &self.params {
                put_cstr(b, n.as_bytes());
                put_cstr(b, v.as_bytes());
            }
            b.put_u8(0);
        });
        dst
    }
}

/// A startup packet PostgreSQL would refuse. The `Display` text is meant for
/// the message of the FATAL ErrorResponse sent back, with [`Self::sqlstate`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StartupError {
    /// The length field is below 8 or above [`MAX_STARTUP_PACKET`].
    #[error("invalid length of startup packet")]
    InvalidLength(u32),
    /// The major protocol version is not 3.
    #[error("unsupported frontend protocol {major}.{minor}: server supports 3.0")]
    UnsupportedProtocol {
        /// Requested major version.
        major: u16,
        /// Requested minor version.
        minor: u16,
    },
    /// The parameter list is not a sequence of NUL-terminated name/value
    /// pairs ending with a single NUL.
    #[error("invalid startup packet layout: expected terminator as last byte")]
    InvalidLayout,
    /// A parameter name or value is not UTF-8.
    #[error("invalid startup packet: parameter names and values must be valid UTF-8")]
    InvalidUtf8,
    /// No `user` parameter, or an empty one.
    #[error("no PostgreSQL user name specified in startup packet")]
    MissingUser,
    /// A CancelRequest of other than 16 bytes.
    #[error("invalid length of query cancel packet")]
    InvalidCancelLength(u32),
}

impl StartupError {
    /// The SQLSTATE PostgreSQL reports for this problem.
    pub fn sqlstate(&self) -> SqlState {
        match self {
            StartupError::UnsupportedProtocol { .. } => sqlstate::FEATURE_NOT_SUPPORTED,
            StartupError::MissingUser => sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
            _ => sqlstate::PROTOCOL_VIOLATION,
        }
    }
}

/// Decodes the startup-phase packet at the front of `buf`.
///
/// Returns `Ok(None)` until the whole packet has arrived, and consumes it
/// only on success; after an error the connection should be closed. The
/// length is checked as soon as it is readable, so at most
/// [`MAX_STARTUP_PACKET`] bytes ever need buffering.
pub fn parse_startup(buf: &mut BytesMut) -> Result<Option<StartupFrame>, StartupError> {
    let Some(head) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
    if len < 8 || len as usize > MAX_STARTUP_PACKET {
        return Err(StartupError::InvalidLength(len));
    }
    let Some(packet) = buf.get(..len as usize) else {
        return Ok(None);
    };
    let frame = decode(packet, len)?;
    buf.advance(len as usize);
    Ok(Some(frame))
}

/// Decodes a whole packet whose length field has been checked.
fn decode(packet: &[u8], len: u32) -> Result<StartupFrame, StartupError> {
    let code = i32::from_be_bytes([packet[4], packet[5], packet[6], packet[7]]);
    let rest = &packet[8..];
    match code {
        SSL_REQUEST => return Ok(StartupFrame::SslRequest),
        GSSENC_REQUEST => return Ok(StartupFrame::GssEncRequest),
        CANCEL_REQUEST => {
            let key: [u8; 8] = rest
                .try_into()
                .map_err(|_| StartupError::InvalidCancelLength(len))?;
            return Ok(StartupFrame::Cancel {
                pid: i32::from_be_bytes([key[0], key[1], key[2], key[3]]),
                secret: i32::from_be_bytes([key[4], key[5], key[6], key[7]]),
            });
        }
        _ => {}
    }
    let major = u16::from_be_bytes([packet[4], packet[5]]);
    let minor = u16::from_be_bytes([packet[6], packet[7]]);
    if major != 3 {
        return Err(StartupError::UnsupportedProtocol { major, minor });
    }
    let mut params = decode_params(rest)?;
    // As PostgreSQL does first: a longer name is looked up, matched in
    // pg_hba.conf and pooled as its first 63 bytes (here cut at a
    // character boundary, so that it stays text).
    for (name, value) in &mut params {
        if (name == "user" || name == "database") && value.len() > NAME_MAX {
            let mut end = NAME_MAX;
            while !value.is_char_boundary(end) {
                end -= 1;
            }
            value.truncate(end);
        }
    }
    let msg = StartupMessage {
        protocol: (major, minor),
        params,
    };
    if msg.user().is_none() {
        return Err(StartupError::MissingUser);
    }
    Ok(StartupFrame::Startup(msg))
}

fn decode_params(rest: &[u8]) -> Result<Vec<(String, String)>, StartupError> {
    // One check of the whole list (NUL is valid UTF-8) rather than one per
    // string: most of a short string's check is its fixed cost.
    let mut rest = std::str::from_utf8(rest).map_err(|_| StartupError::InvalidUtf8)?;
    let mut params = Vec::new();
    loop {
        match rest.as_bytes().first() {
            None => return Err(StartupError::InvalidLayout),
            Some(0) if rest.len() == 1 => return Ok(params),
            Some(0) => return Err(StartupError::InvalidLayout),
            Some(_) => {}
        }
        let name = take_cstr(&mut rest)?;
        let value = take_cstr(&mut rest)?;
        params.push((name, value));
    }
}

fn take_cstr(rest: &mut &str) -> Result<String, StartupError> {
    let end = memchr::memchr(0, rest.as_bytes()).ok_or(StartupError::InvalidLayout)?;
    let s = &rest[..end];
    *rest = &rest[end + 1..];
    Ok(s.to_owned())
}

/// NegotiateProtocolVersion (`v`): the newest minor version supported for
/// the requested major version 3, and the protocol options not recognised.
///
/// The version goes on the wire whole (major in the high 16 bits), as
/// PostgreSQL sends it and as libpq reads it: a bare minor number reads
/// as a downgrade to before 3.0, which libpq refuses.
pub fn negotiate_protocol_version(newest_minor: i32, unrecognized: &[&str]) -> Bytes {
    let mut dst = BytesMut::new();
    dst.put_u8(backend::NEGOTIATE_PROTOCOL_VERSION);
    untagged_packet(&mut dst, |b| {
        b.put_i32((3 << 16) | newest_minor);
        b.put_i32(i32::try_from(unrecognized.len()).unwrap_or(i32::MAX));
        for o in unrecognized {
            put_cstr(b, o.as_bytes());
        }
    });
    dst.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{body, split_message, Reader};

    fn packet(code: u32, rest: &[u8]) -> BytesMut {
        let mut b = BytesMut::new();
        b.put_u32(rest.len() as u32 + 8);
        b.put_u32(code);
        b.put_slice(rest);
        b
    }

    fn startup(rest: &[u8]) -> Result<Option<StartupFrame>, StartupError> {
        parse_startup(&mut packet(PROTOCOL_3_0 as u32, rest))
    }

    #[test]
    fn special_requests() {
        let mut b = packet(SSL_REQUEST as u32, b"");
        b.extend_from_slice(b"junk");
        assert_eq!(parse_startup(&mut b), Ok(Some(StartupFrame::SslRequest)));
        // The caller sees the unencrypted bytes that followed.
        assert_eq!(&b[..], b"junk");
        let mut b = packet(GSSENC_REQUEST as u32, b"");
        assert_eq!(parse_startup(&mut b), Ok(Some(StartupFrame::GssEncRequest)));
        let mut b = packet(CANCEL_REQUEST as u32, &[0, 0, 1, 0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(
            parse_startup(&mut b),
            Ok(Some(StartupFrame::Cancel {
                pid: 256,
                secret: -1
            }))
        );
        let mut b = packet(CANCEL_REQUEST as u32, &[0; 12]);
        assert_eq!(
            parse_startup(&mut b),
            Err(StartupError::InvalidCancelLength(20))
        );
    }

    #[test]
    fn waits_for_whole_packet() {
        let full = packet(PROTOCOL_3_0 as u32, b"user\0bob\0\0");
        for cut in 0..full.len() {
            let mut b = BytesMut::from(&full[..cut]);
            assert_eq!(parse_startup(&mut b), Ok(None), "cut at {cut}");
            assert_eq!(b.len(), cut);
        }
    }

    #[test]
    fn length_bounds() {
        let mut b = BytesMut::from(&[0u8, 0, 0, 7][..]);
        assert_eq!(parse_startup(&mut b), Err(StartupError::InvalidLength(7)));
        // PostgreSQL's 10,000 bytes after the length field, and no more.
        let mut b = BytesMut::from(&[0u8, 0, 0x27, 0x14][..]);
        assert_eq!(parse_startup(&mut b), Ok(None), "10,004 waits for the rest");
        let mut b = BytesMut::from(&[0u8, 0, 0x27, 0x15][..]);
        assert_eq!(
            parse_startup(&mut b),
            Err(StartupError::InvalidLength(10_005))
        );
        let mut b = BytesMut::from(&[0xffu8, 0xff, 0xff, 0xff][..]);
        assert!(parse_startup(&mut b).is_err());
    }

    #[test]
    fn parses_parameters() {
        let Ok(Some(StartupFrame::Startup(m))) =
            startup(b"user\0alice\0database\0\0application_name\0psql\0\0")
        else {
            panic!("expected a startup message");
        };
        assert_eq!(m.protocol, (3, 0));
        assert_eq!(m.user(), Some("alice"));
        assert_eq!(m.database(), Some("alice"));
        assert_eq!(m.get("application_name"), Some("psql"));
        assert_eq!(m.get("Application_Name"), None);
    }

    #[test]
    fn long_names_are_cut_as_postgresql_cuts_them() {
        let long = format!("{}é", "u".repeat(62));
        let body = format!(
            "user\0{long}x\0database\0{}\0application_name\0{}\0\0",
            "d".repeat(70),
            "a".repeat(70)
        );
        let Ok(Some(StartupFrame::Startup(m))) = startup(body.as_bytes()) else {
            panic!("expected a startup message");
        };
        // 62 bytes and a two-byte character: cut before the character.
        assert_eq!(m.user(), Some("u".repeat(62).as_str()));
        assert_eq!(m.database(), Some("d".repeat(63).as_str()));
        assert_eq!(
            m.get("application_name").map(str::len),
            Some(70),
            "only names are cut"
        );
    }

    #[test]
    fn replication_is_read_as_postgresql_reads_it() {
        let with = |v: &str| {
            StartupMessage::new(vec![
                ("user".into(), "u".into()),
                ("replication".into(), v.into()),
            ])
        };
        assert_eq!(
            StartupMessage::new(vec![]).replication(),
            Ok(Replication::None)
        );
        for v in ["true", "t", "TRU", "yes", "Y", "on", "ON", "1"] {
            assert_eq!(with(v).replication(), Ok(Replication::Physical), "{v}");
        }
        for v in ["false", "F", "no", "n", "off", "of", "0"] {
            assert_eq!(with(v).replication(), Ok(Replication::None), "{v}");
        }
        assert_eq!(with("database").replication(), Ok(Replication::Logical));
        for v in ["", "o", "Database", "2", "truex", "yes please"] {
            assert_eq!(with(v).replication(), Err(v), "{v}");
        }
    }

    #[test]
    fn layout_errors() {
        assert_eq!(startup(b""), Err(StartupError::InvalidLayout));
        assert_eq!(startup(b"user\0bob\0"), Err(StartupError::InvalidLayout));
        assert_eq!(startup(b"user\0bob"), Err(StartupError::InvalidLayout));
        assert_eq!(startup(b"user\0"), Err(StartupError::InvalidLayout));
        assert_eq!(startup(b"user\0bob\0\0x"), Err(StartupError::InvalidLayout));
        assert_eq!(startup(b"\0\0"), Err(StartupError::InvalidLayout));
        assert_eq!(startup(b"user\0\xff\0\0"), Err(StartupError::InvalidUtf8));
        assert_eq!(startup(b"\0"), Err(StartupError::MissingUser));
        assert_eq!(startup(b"user\0\0\0"), Err(StartupError::MissingUser));
        assert_eq!(
            StartupError::MissingUser.sqlstate(),
            sqlstate::INVALID_AUTHORIZATION_SPECIFICATION
        );
    }

    #[test]
    fn protocol_versions() {
        let mut b = packet(2 << 16, b"user\0u\0\0");
        let e = parse_startup(&mut b).unwrap_err();
        assert_eq!(e, StartupError::UnsupportedProtocol { major: 2, minor: 0 });
        assert_eq!(
            e.to_string(),
            "unsupported frontend protocol 2.0: server supports 3.0"
        );
        assert_eq!(e.sqlstate(), sqlstate::FEATURE_NOT_SUPPORTED);
        let mut b = packet((1234 << 16) | 5681, b"");
        assert!(matches!(
            parse_startup(&mut b),
            Err(StartupError::UnsupportedProtocol { major: 1234, .. })
        ));

        let mut b = packet(
            (3 << 16) | 2,
            b"user\0u\0_pq_.compression\0on\0_pq_.x\0y\0\0",
        );
        let Ok(Some(StartupFrame::Startup(m))) = parse_startup(&mut b) else {
            panic!("3.2 must be accepted");
        };
        assert_eq!(m.protocol, (3, 2));
        assert_eq!(
            m.protocol_options().collect::<Vec<_>>(),
            ["_pq_.compression", "_pq_.x"]
        );
        let mut nego = BytesMut::from(&m.negotiation(0).unwrap()[..]);
        let (tag, msg) = split_message(&mut nego, 1000).unwrap().unwrap();
        assert_eq!(tag, b'v');
        let mut r = Reader::new(body(&msg));
        // 3.0, as PostgreSQL writes it.
        assert_eq!(r.i32(), Ok(0x0003_0000));
        assert_eq!(r.i32(), Ok(2));
        assert_eq!(r.cstr(), Ok("_pq_.compression"));
        assert_eq!(r.cstr(), Ok("_pq_.x"));
        assert_eq!(r.finish(), Ok(()));
        assert!(StartupMessage::new(vec![]).negotiation(0).is_none());
    }

    #[test]
    fn edit_and_encode_round_trip() {
        let mut m = StartupMessage::new(vec![
            ("user".into(), "a".into()),
            ("options".into(), "-c x=1".into()),
            ("user".into(), "b".into()),
        ]);
        assert_eq!(m.user(), Some("b"));
        m.set("user", "c");
        assert_eq!(
            m.params,
            vec![
                ("user".to_string(), "c".to_string()),
                ("options".to_string(), "-c x=1".to_string())
            ]
        );
        m.set("database", "db");
        m.remove("options");
        assert_eq!(m.database(), Some("db"));
        let mut wire = m.encode();
        assert_eq!(&wire[4..8], &PROTOCOL_3_0.to_be_bytes());
        assert_eq!(parse_startup(&mut wire), Ok(Some(StartupFrame::Startup(m))));
        assert!(wire.is_empty());
    }
}
