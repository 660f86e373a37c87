//! Builders for the messages the proxy originates itself.
//!
//! Every builder appends one complete message to a caller-owned buffer, so a
//! whole reply (for instance AuthenticationOk, a few ParameterStatus,
//! BackendKeyData and ReadyForQuery) can be assembled in one allocation and
//! written with one system call.
//!
//! Strings are written up to their first NUL byte, if any: a NUL inside a
//! string would end it early on the receiving side and desynchronise the
//! rest of the message, which is worse than a shortened text.

use bytes::{BufMut, BytesMut};

use crate::message::{backend, frontend, TxStatus};
use crate::startup::CANCEL_REQUEST;

/// Severity of an error or notice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Severity {
    /// The current command failed.
    Error,
    /// The session is being ended.
    Fatal,
    /// All sessions are being ended.
    Panic,
    /// A notice about likely trouble.
    Warning,
    /// A notice of general interest.
    Notice,
    /// Information the client asked for.
    Info,
    /// Debugging output.
    Debug,
    /// Administrative log output.
    Log,
}

impl Severity {
    /// The untranslated keyword, as sent in both the `S` and `V` fields.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "ERROR",
            Severity::Fatal => "FATAL",
            Severity::Panic => "PANIC",
            Severity::Warning => "WARNING",
            Severity::Notice => "NOTICE",
            Severity::Info => "INFO",
            Severity::Debug => "DEBUG",
            Severity::Log => "LOG",
        }
    }
}

/// Writes `tag`, a length placeholder, the body produced by `f`, then
/// patches the length.
fn framed(dst: &mut BytesMut, tag: u8, f: impl FnOnce(&mut BytesMut)) {
    dst.put_u8(tag);
    untagged(dst, f);
}

/// Writes a length placeholder, the body produced by `f`, then patches the
/// length (which counts itself).
fn untagged(dst: &mut BytesMut, f: impl FnOnce(&mut BytesMut)) {
    let at = dst.len();
    dst.put_u32(0);
    f(dst);
    // A message over 2 GiB cannot be sent anyway; saturating keeps this
    // function total, and the peer rejects the length.
    let len = u32::try_from(dst.len() - at).unwrap_or(u32::MAX);
    dst[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

/// Appends `s` up to its first NUL, then a NUL.
pub(crate) fn put_cstr(dst: &mut BytesMut, s: &[u8]) {
    let end = memchr::memchr(0, s).unwrap_or(s.len());
    dst.put_slice(&s[..end]);
    dst.put_u8(0);
}

/// Clamps a count to the `Int16` the protocol uses.
fn count16(n: usize) -> i16 {
    i16::try_from(n).unwrap_or(i16::MAX)
}

fn report(
    dst: &mut BytesMut,
    tag: u8,
    severity: Severity,
    code: &str,
    message: &str,
    detail: Option<&str>,
    hint: Option<&str>,
) {
    framed(dst, tag, |b| {
        b.put_u8(b'S');
        put_cstr(b, severity.as_str().as_bytes());
        b.put_u8(b'V');
        put_cstr(b, severity.as_str().as_bytes());
        b.put_u8(b'C');
        put_cstr(b, code.as_bytes());
        b.put_u8(b'M');
        put_cstr(b, message.as_bytes());
        if let Some(d) = detail {
            b.put_u8(b'D');
            put_cstr(b, d.as_bytes());
        }
        if let Some(h) = hint {
            b.put_u8(b'H');
            put_cstr(b, h.as_bytes());
        }
        b.put_u8(0);
    });
}

/// ErrorResponse (`E`). `code` is a SQLSTATE such as
/// [`crate::sqlstate::CANNOT_CONNECT_NOW`]`.code()`.
pub fn error_response(
    dst: &mut BytesMut,
    severity: Severity,
    code: &str,
    message: &str,
    detail: Option<&str>,
    hint: Option<&str>,
) {
    report(
        dst,
        backend::ERROR_RESPONSE,
        severity,
        code,
        message,
        detail,
        hint,
    );
}

/// A FATAL ErrorResponse with only a code and a message, as a message of
/// its own: what a client is sent just before its connection is closed.
pub fn fatal(code: &str, message: &str) -> BytesMut {
    let mut out = BytesMut::new();
    error_response(&mut out, Severity::Fatal, code, message, None, None);
    out
}

/// NoticeResponse (`N`); same layout as [`error_response`].
pub fn notice_response(
    dst: &mut BytesMut,
    severity: Severity,
    code: &str,
    message: &str,
    detail: Option<&str>,
    hint: Option<&str>,
) {
    report(
        dst,
        backend::NOTICE_RESPONSE,
        severity,
        code,
        message,
        detail,
        hint,
    );
}

/// ReadyForQuery (`Z`).
pub fn ready_for_query(dst: &mut BytesMut, status: TxStatus) {
    framed(dst, backend::READY_FOR_QUERY, |b| {
        b.put_u8(status.as_byte())
    });
}

/// BackendKeyData (`K`) with a protocol 3.0 four-byte secret.
pub fn backend_key_data(dst: &mut BytesMut, pid: i32, secret: i32) {
    framed(dst, backend::BACKEND_KEY_DATA, |b| {
        b.put_i32(pid);
        b.put_i32(secret);
    });
}

/// ParameterStatus (`S`).
pub fn parameter_status(dst: &mut BytesMut, name: &str, value: &str) {
    framed(dst, backend::PARAMETER_STATUS, |b| {
        put_cstr(b, name.as_bytes());
        put_cstr(b, value.as_bytes());
    });
}

/// CommandComplete (`C`) with a command tag such as `SET` or `SELECT 1`.
pub fn command_complete(dst: &mut BytesMut, tag: &str) {
    framed(dst, backend::COMMAND_COMPLETE, |b| {
        put_cstr(b, tag.as_bytes())
    });
}

fn authentication(dst: &mut BytesMut, code: i32, extra: &[u8]) {
    framed(dst, backend::AUTHENTICATION_REQUEST, |b| {
        b.put_i32(code);
        b.put_slice(extra);
    });
}

/// AuthenticationOk (`R`, code 0).
pub fn authentication_ok(dst: &mut BytesMut) {
    authentication(dst, 0, &[]);
}

/// AuthenticationCleartextPassword (`R`, code 3).
pub fn authentication_cleartext(dst: &mut BytesMut) {
    authentication(dst, 3, &[]);
}

/// AuthenticationMD5Password (`R`, code 5) with its salt.
pub fn authentication_md5(dst: &mut BytesMut, salt: [u8; 4]) {
    authentication(dst, 5, &salt);
}

/// AuthenticationSASL (`R`, code 10) offering `mechanisms` in order of
/// preference.
pub fn authentication_sasl(dst: &mut BytesMut, mechanisms: &[&str]) {
    framed(dst, backend::AUTHENTICATION_REQUEST, |b| {
        b.put_i32(10);
        for m in mechanisms {
            put_cstr(b, m.as_bytes());
        }
        b.put_u8(0);
    });
}

/// AuthenticationSASLContinue (`R`, code 11) with mechanism data.
pub fn authentication_sasl_continue(dst: &mut BytesMut, data: &[u8]) {
    authentication(dst, 11, data);
}

/// AuthenticationSASLFinal (`R`, code 12) with mechanism data.
pub fn authentication_sasl_final(dst: &mut BytesMut, data: &[u8]) {
    authentication(dst, 12, data);
}

/// EmptyQueryResponse (`I`): the answer to a query string with no
/// statement in it.
pub fn empty_query_response(dst: &mut BytesMut) {
    framed(dst, backend::EMPTY_QUERY_RESPONSE, |_| {});
}

/// Query (`Q`).
pub fn query(dst: &mut BytesMut, text: &str) {
    framed(dst, frontend::QUERY, |b| put_cstr(b, text.as_bytes()));
}

/// Parse (`P`); a zero type OID leaves the parameter type to the server.
pub fn parse(
    dst: &mut BytesMut,
    name: impl AsRef<[u8]>,
    query: impl AsRef<[u8]>,
    param_types: &[u32],
) {
    framed(dst, frontend::PARSE, |b| {
        put_cstr(b, name.as_ref());
        put_cstr(b, query.as_ref());
        // An unsigned count here, as PostgreSQL reads it.
        let n = u16::try_from(param_types.len()).unwrap_or(u16::MAX);
        b.put_u16(n);
        for t in param_types.iter().take(usize::from(n)) {
            b.put_u32(*t);
        }
    });
}

/// Bind (`B`) with all parameters in text format; `None` is SQL NULL.
/// `result_formats` follows the protocol: empty for all text, one entry for
/// all columns, or one per column (0 text, 1 binary).
pub fn bind(
    dst: &mut BytesMut,
    portal: &str,
    statement: &str,
    params: &[Option<&[u8]>],
    result_formats: &[i16],
) {
    framed(dst, frontend::BIND, |b| {
        put_cstr(b, portal.as_bytes());
        put_cstr(b, statement.as_bytes());
        // No parameter format codes: all parameters are text.
        b.put_i16(0);
        b.put_i16(count16(params.len()));
        for p in params.iter().take(i16::MAX as usize) {
            match p {
                None => b.put_i32(-1),
                Some(v) => {
                    b.put_i32(i32::try_from(v.len()).unwrap_or(i32::MAX));
                    b.put_slice(v);
                }
            }
        }
        b.put_i16(count16(result_formats.len()));
        for f in result_formats.iter().take(i16::MAX as usize) {
            b.put_i16(*f);
        }
    });
}

/// Execute (`E`); `max_rows` 0 means no limit.
pub fn execute(dst: &mut BytesMut, portal: &str, max_rows: i32) {
    framed(dst, frontend::EXECUTE, |b| {
        put_cstr(b, portal.as_bytes());
        b.put_i32(max_rows);
    });
}

/// Describe (`D`) of a prepared statement.
pub fn describe_statement(dst: &mut BytesMut, name: &str) {
    framed(dst, frontend::DESCRIBE, |b| {
        b.put_u8(b'S');
        put_cstr(b, name.as_bytes());
    });
}

/// Describe (`D`) of a portal.
pub fn describe_portal(dst: &mut BytesMut, name: &str) {
    framed(dst, frontend::DESCRIBE, |b| {
        b.put_u8(b'P');
        put_cstr(b, name.as_bytes());
    });
}

/// Close (`C`) of a prepared statement.
pub fn close_statement(dst: &mut BytesMut, name: &str) {
    framed(dst, frontend::CLOSE, |b| {
        b.put_u8(b'S');
        put_cstr(b, name.as_bytes());
    });
}

/// Close (`C`) of a portal.
pub fn close_portal(dst: &mut BytesMut, name: &str) {
    framed(dst, frontend::CLOSE, |b| {
        b.put_u8(b'P');
        put_cstr(b, name.as_bytes());
    });
}

/// The portal [`batch_marker`] closes: no client's (portal names are the
/// client's to choose, but none starts with a control character).
pub const BATCH_MARKER_PORTAL: &str = "\u{1}pgwarden batch marker";

/// Close (`C`) of the portal [`BATCH_MARKER_PORTAL`], which never exists.
///
/// Sent just ahead of a Query or FunctionCall that goes out inside an
/// unfinished extended-protocol batch (no Sync since its last Parse, Bind,
/// Describe, Execute or Close). After an error in such a batch PostgreSQL
/// skips every message up to the Sync, the Query included, and a skipped
/// Query gets no ReadyForQuery. Closing a portal that does not exist is no
/// error, so the server answers the marker with CloseComplete exactly when
/// it will run the Query: the proxy drops that CloseComplete and, when it
/// never comes, knows the Query's ReadyForQuery will not either.
pub fn batch_marker(dst: &mut BytesMut) {
    close_portal(dst, BATCH_MARKER_PORTAL);
}

/// Sync (`S`).
pub fn sync(dst: &mut BytesMut) {
    framed(dst, frontend::SYNC, |_| {});
}

/// Flush (`H`).
pub fn flush(dst: &mut BytesMut) {
    framed(dst, frontend::FLUSH, |_| {});
}

/// Terminate (`X`).
pub fn terminate(dst: &mut BytesMut) {
    framed(dst, frontend::TERMINATE, |_| {});
}

/// CancelRequest packet, sent on a fresh connection instead of a startup
/// packet.
pub fn cancel_request(pid: i32, secret: i32) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[0..4].copy_from_slice(&16u32.to_be_bytes());
    out[4..8].copy_from_slice(&CANCEL_REQUEST.to_be_bytes());
    out[8..12].copy_from_slice(&pid.to_be_bytes());
    out[12..16].copy_from_slice(&secret.to_be_bytes());
    out
}

/// CancelRequest packet with a secret key of any length (protocol 3.2
/// servers send keys of up to 256 bytes).
pub fn cancel_request_long(pid: i32, secret: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + secret.len());
    out.extend_from_slice(&(12 + secret.len() as u32).to_be_bytes());
    out.extend_from_slice(&CANCEL_REQUEST.to_be_bytes());
    out.extend_from_slice(&pid.to_be_bytes());
    out.extend_from_slice(secret);
    out
}

/// The single-byte answer to SSLRequest or GSSENCRequest: `S` to go ahead
/// with the handshake, `N` to continue unencrypted.
pub fn ssl_response(accept: bool) -> u8 {
    if accept {
        b'S'
    } else {
        b'N'
    }
}

/// Appends an untagged packet (startup-phase framing) whose body is produced
/// by `f`.
pub(crate) fn untagged_packet(dst: &mut BytesMut, f: impl FnOnce(&mut BytesMut)) {
    untagged(dst, f);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{self, body, split_message, ErrorSummary};
    use crate::startup::{parse_startup, StartupFrame};

    fn one(buf: &mut BytesMut) -> (u8, BytesMut) {
        let (tag, m) = split_message(buf, 1 << 20).unwrap().unwrap();
        (tag, m)
    }

    #[test]
    fn error_response_round_trip() {
        let mut buf = BytesMut::new();
        error_response(
            &mut buf,
            Severity::Fatal,
            "57P03",
            "the database system is starting up",
            Some("detail"),
            None,
        );
        let (tag, m) = one(&mut buf);
        assert_eq!(tag, backend::ERROR_RESPONSE);
        let f = message::error_fields(body(&m)).unwrap();
        let s = ErrorSummary::from_fields(&f);
        assert_eq!(s.severity, Some("FATAL"));
        assert_eq!(s.code, Some("57P03"));
        assert_eq!(s.message, Some("the database system is starting up"));
        assert_eq!(message::find_field(&f, b'D'), Some("detail"));
        assert_eq!(message::find_field(&f, b'H'), None);
        assert_eq!(message::find_field(&f, b'S'), Some("FATAL"));
        assert!(buf.is_empty());
    }

    #[test]
    fn notice_with_embedded_nul_stays_framed() {
        let mut buf = BytesMut::new();
        notice_response(
            &mut buf,
            Severity::Warning,
            "01000",
            "a\0b",
            None,
            Some("h"),
        );
        let (tag, m) = one(&mut buf);
        assert_eq!(tag, backend::NOTICE_RESPONSE);
        let f = message::error_fields(body(&m)).unwrap();
        assert_eq!(message::find_field(&f, b'M'), Some("a"));
        assert_eq!(message::find_field(&f, b'H'), Some("h"));
    }

    #[test]
    fn backend_messages_round_trip() {
        let mut buf = BytesMut::new();
        authentication_ok(&mut buf);
        parameter_status(&mut buf, "server_version", "17.2");
        backend_key_data(&mut buf, 4242, -7);
        ready_for_query(&mut buf, TxStatus::Failed);
        command_complete(&mut buf, "SET");
        authentication_md5(&mut buf, [1, 2, 3, 4]);
        authentication_cleartext(&mut buf);
        authentication_sasl(&mut buf, &["SCRAM-SHA-256", "SCRAM-SHA-256-PLUS"]);
        authentication_sasl_continue(&mut buf, b"r=abc");
        authentication_sasl_final(&mut buf, b"v=xyz");

        let (t, m) = one(&mut buf);
        assert_eq!((t, message::authentication_code(body(&m))), (b'R', Ok(0)));
        assert_eq!(m.len(), 9);
        let (t, m) = one(&mut buf);
        assert_eq!(t, b'S');
        assert_eq!(
            message::parameter_status(body(&m)),
            Ok(("server_version", "17.2"))
        );
        let (_, m) = one(&mut buf);
        assert_eq!(message::backend_key_data(body(&m)), Ok((4242, -7)));
        let (_, m) = one(&mut buf);
        assert_eq!(
            message::ready_for_query_status(body(&m)),
            Ok(TxStatus::Failed)
        );
        let (t, m) = one(&mut buf);
        assert_eq!((t, body(&m)), (b'C', &b"SET\0"[..]));
        let (_, m) = one(&mut buf);
        assert_eq!(body(&m), &[0, 0, 0, 5, 1, 2, 3, 4]);
        let (_, m) = one(&mut buf);
        assert_eq!(message::authentication_code(body(&m)), Ok(3));
        let (_, m) = one(&mut buf);
        assert_eq!(
            body(&m),
            &b"\0\0\0\x0aSCRAM-SHA-256\0SCRAM-SHA-256-PLUS\0\0"[..]
        );
        let (_, m) = one(&mut buf);
        assert_eq!(body(&m), &b"\0\0\0\x0br=abc"[..]);
        let (_, m) = one(&mut buf);
        assert_eq!(body(&m), &b"\0\0\0\x0cv=xyz"[..]);
        assert!(buf.is_empty());
    }

    #[test]
    fn frontend_messages_round_trip() {
        let mut buf = BytesMut::new();
        query(&mut buf, "SELECT 1");
        parse(&mut buf, "s1", "SELECT $1::int", &[23]);
        bind(&mut buf, "p", "s1", &[Some(b"42"), None], &[1]);
        execute(&mut buf, "p", 0);
        describe_statement(&mut buf, "s1");
        describe_portal(&mut buf, "p");
        close_statement(&mut buf, "s1");
        close_portal(&mut buf, "p");
        flush(&mut buf);
        sync(&mut buf);
        terminate(&mut buf);

        let (t, m) = one(&mut buf);
        assert_eq!((t, message::query_text(body(&m))), (b'Q', Ok("SELECT 1")));
        let (t, m) = one(&mut buf);
        assert_eq!(t, b'P');
        let p = message::parse_message(body(&m)).unwrap();
        assert_eq!(
            (p.name, p.query, p.param_type_count),
            (&b"s1"[..], &b"SELECT $1::int"[..], 1)
        );
        let (t, m) = one(&mut buf);
        assert_eq!(t, b'B');
        assert_eq!(message::bind_names(body(&m)), Ok(("p", "s1")));
        assert_eq!(
            &body(&m)[5..],
            &b"\0\0\0\x02\0\0\0\x0242\xff\xff\xff\xff\0\x01\0\x01"[..]
        );
        let (t, m) = one(&mut buf);
        assert_eq!((t, body(&m)), (b'E', &b"p\0\0\0\0\0"[..]));
        let (t, m) = one(&mut buf);
        assert_eq!(
            (t, message::describe_target(body(&m))),
            (b'D', Ok((b'S', "s1")))
        );
        let (_, m) = one(&mut buf);
        assert_eq!(message::describe_target(body(&m)), Ok((b'P', "p")));
        let (t, m) = one(&mut buf);
        assert_eq!(
            (t, message::close_target(body(&m))),
            (b'C', Ok((b'S', "s1")))
        );
        let (_, m) = one(&mut buf);
        assert_eq!(message::close_target(body(&m)), Ok((b'P', "p")));
        for tag in [b'H', b'S', b'X'] {
            let (t, m) = one(&mut buf);
            assert_eq!((t, m.len()), (tag, 5));
        }
        assert!(buf.is_empty());
    }

    #[test]
    fn cancel_request_parses_back() {
        let packet = cancel_request(99, -5);
        let mut buf = BytesMut::from(&packet[..]);
        assert_eq!(
            parse_startup(&mut buf),
            Ok(Some(StartupFrame::Cancel {
                pid: 99,
                secret: -5
            }))
        );
        assert_eq!(ssl_response(true), b'S');
        assert_eq!(ssl_response(false), b'N');
    }
}
