//! Framing of tagged messages and read access to their bodies.
//!
//! After the startup phase every message in either direction is a one-byte
//! tag followed by a big-endian `Int32` length that counts itself and the
//! body but not the tag. The proxy mostly forwards messages untouched, so
//! [`split_message`] hands back the whole message as it was received; the
//! accessors below take the body (the bytes after the five-byte header, see
//! [`body`]) of the few messages the proxy has to look into.
//!
//! Strings on the wire are NUL-terminated and, for the accessors returning
//! `&str`, must be UTF-8. That holds whenever `client_encoding` is `UTF8`;
//! for other encodings use the byte-level accessors such as [`query_bytes`].

use bytes::BytesMut;

/// Size of a message header: the tag byte and the `Int32` length.
pub const HEADER_LEN: usize = 5;

/// Tags of messages sent by the client.
pub mod frontend {
    /// Simple query.
    pub const QUERY: u8 = b'Q';
    /// Extended protocol: prepare a statement.
    pub const PARSE: u8 = b'P';
    /// Extended protocol: bind parameters to a statement, creating a portal.
    pub const BIND: u8 = b'B';
    /// Extended protocol: describe a statement or portal.
    pub const DESCRIBE: u8 = b'D';
    /// Extended protocol: run a portal.
    pub const EXECUTE: u8 = b'E';
    /// Extended protocol: end of a pipeline step; the server answers with
    /// ReadyForQuery.
    pub const SYNC: u8 = b'S';
    /// Extended protocol: ask the server to send pending output.
    pub const FLUSH: u8 = b'H';
    /// Extended protocol: close a statement or portal.
    pub const CLOSE: u8 = b'C';
    /// Orderly end of the session.
    pub const TERMINATE: u8 = b'X';
    /// COPY FROM STDIN payload.
    pub const COPY_DATA: u8 = b'd';
    /// End of COPY FROM STDIN payload.
    pub const COPY_DONE: u8 = b'c';
    /// Abort of COPY FROM STDIN.
    pub const COPY_FAIL: u8 = b'f';
    /// Legacy fast-path function call.
    pub const FUNCTION_CALL: u8 = b'F';
    /// Password, or a SASL / GSSAPI response; the meaning depends on the
    /// authentication request it answers.
    pub const PASSWORD_MESSAGE: u8 = b'p';
}

/// Tags of messages sent by the server.
pub mod backend {
    /// Any authentication request or outcome; the body starts with a code.
    pub const AUTHENTICATION_REQUEST: u8 = b'R';
    /// Process id and secret key for cancel requests.
    pub const BACKEND_KEY_DATA: u8 = b'K';
    /// Current value of a reported run-time parameter.
    pub const PARAMETER_STATUS: u8 = b'S';
    /// The server is ready for a new command; carries the transaction status.
    pub const READY_FOR_QUERY: u8 = b'Z';
    /// Error report.
    pub const ERROR_RESPONSE: u8 = b'E';
    /// Warning or informational report.
    pub const NOTICE_RESPONSE: u8 = b'N';
    /// A command finished; carries the command tag.
    pub const COMMAND_COMPLETE: u8 = b'C';
    /// Column descriptions of a result set.
    pub const ROW_DESCRIPTION: u8 = b'T';
    /// One row of a result set.
    pub const DATA_ROW: u8 = b'D';
    /// Answer to Parse.
    pub const PARSE_COMPLETE: u8 = b'1';
    /// Answer to Bind.
    pub const BIND_COMPLETE: u8 = b'2';
    /// Answer to Close.
    pub const CLOSE_COMPLETE: u8 = b'3';
    /// Describe of something that returns no rows.
    pub const NO_DATA: u8 = b'n';
    /// Answer to an empty query string.
    pub const EMPTY_QUERY_RESPONSE: u8 = b'I';
    /// Execute stopped at its row limit.
    pub const PORTAL_SUSPENDED: u8 = b's';
    /// Parameter types of a described statement.
    pub const PARAMETER_DESCRIPTION: u8 = b't';
    /// Start of COPY FROM STDIN.
    pub const COPY_IN_RESPONSE: u8 = b'G';
    /// Start of COPY TO STDOUT.
    pub const COPY_OUT_RESPONSE: u8 = b'H';
    /// Start of bidirectional copy (replication).
    pub const COPY_BOTH_RESPONSE: u8 = b'W';
    /// COPY TO STDOUT payload.
    pub const COPY_DATA: u8 = b'd';
    /// End of COPY TO STDOUT payload.
    pub const COPY_DONE: u8 = b'c';
    /// LISTEN/NOTIFY delivery.
    pub const NOTIFICATION_RESPONSE: u8 = b'A';
    /// Result of a fast-path function call.
    pub const FUNCTION_CALL_RESPONSE: u8 = b'V';
    /// The server does not support the requested minor version or options.
    pub const NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
}

/// Field type bytes of ErrorResponse and NoticeResponse.
pub mod field {
    /// Severity, possibly translated.
    pub const SEVERITY: u8 = b'S';
    /// Severity, never translated (PostgreSQL 9.6 and later).
    pub const SEVERITY_NONLOCALIZED: u8 = b'V';
    /// SQLSTATE code.
    pub const CODE: u8 = b'C';
    /// Primary message.
    pub const MESSAGE: u8 = b'M';
    /// Optional detail.
    pub const DETAIL: u8 = b'D';
    /// Optional hint.
    pub const HINT: u8 = b'H';
}

/// The five-byte header of a tagged message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Message type.
    pub tag: u8,
    /// Length field as on the wire: body length plus four.
    pub len: u32,
}

impl Header {
    /// Bytes the whole message occupies, tag included.
    pub fn total_len(&self) -> usize {
        self.len as usize + 1
    }
}

/// A message header that cannot be framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length field is smaller than the field itself, or negative.
    #[error("invalid message length {len} for message type {:?}", char::from(*tag))]
    InvalidLength {
        /// Message type.
        tag: u8,
        /// Length field as received.
        len: u32,
    },
    /// The length field exceeds the caller's bound.
    #[error("message type {:?} of length {len} exceeds the limit of {max}", char::from(*tag))]
    TooLong {
        /// Message type.
        tag: u8,
        /// Length field as received.
        len: u32,
        /// The bound that was passed in.
        max: usize,
    },
}

/// Reads the header at the start of `buf`.
///
/// `max_len` bounds the length field (which counts itself and the body), so
/// that a peer cannot make the caller buffer an arbitrary amount of data.
/// Returns `Ok(None)` while fewer than five bytes are available.
pub fn peek_header(buf: &[u8], max_len: usize) -> Result<Option<Header>, FrameError> {
    let Some(head) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let tag = head[0];
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
    // Values above i32::MAX are negative to PostgreSQL, hence invalid.
    if len < 4 || len > i32::MAX as u32 {
        return Err(FrameError::InvalidLength { tag, len });
    }
    if len as usize > max_len {
        return Err(FrameError::TooLong {
            tag,
            len,
            max: max_len,
        });
    }
    Ok(Some(Header { tag, len }))
}

/// Splits the first complete message off the front of `buf`.
///
/// The returned buffer holds the message exactly as received, header
/// included, so it can be forwarded without re-encoding. Returns `Ok(None)`
/// if the message is not complete yet; in that case room for the rest of it
/// is reserved in `buf`, so the next read can fetch it in one go.
pub fn split_message(
    buf: &mut BytesMut,
    max_len: usize,
) -> Result<Option<(u8, BytesMut)>, FrameError> {
    let Some(header) = peek_header(buf, max_len)? else {
        return Ok(None);
    };
    let total = header.total_len();
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    Ok(Some((header.tag, buf.split_to(total))))
}

/// The body of a whole message as returned by [`split_message`]; empty if
/// `msg` is shorter than a header.
pub fn body(msg: &[u8]) -> &[u8] {
    msg.get(HEADER_LEN..).unwrap_or(&[])
}

/// A message body that does not have the layout its type requires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// The body ended before a fixed-size field or a string terminator.
    #[error("invalid message format: body too short")]
    Truncated,
    /// Bytes were left after the last field.
    #[error("invalid message format: unexpected data after the last field")]
    TrailingData,
    /// A string was not valid UTF-8.
    #[error("invalid message format: string is not valid UTF-8")]
    InvalidUtf8,
    /// A field had a value its type does not allow.
    #[error("invalid message format: {0}")]
    InvalidValue(&'static str),
}

/// Sequential checked reads over a message body.
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(body: &'a [u8]) -> Self {
        Reader { rest: body }
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], BodyError> {
        if self.rest.len() < n {
            return Err(BodyError::Truncated);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, BodyError> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn i16(&mut self) -> Result<i16, BodyError> {
        let b = self.take(2)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }

    pub(crate) fn i32(&mut self) -> Result<i32, BodyError> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A NUL-terminated string, without its terminator.
    pub(crate) fn cstr_bytes(&mut self) -> Result<&'a [u8], BodyError> {
        let end = memchr::memchr(0, self.rest).ok_or(BodyError::Truncated)?;
        let s = &self.rest[..end];
        self.rest = &self.rest[end + 1..];
        Ok(s)
    }

    pub(crate) fn cstr(&mut self) -> Result<&'a str, BodyError> {
        std::str::from_utf8(self.cstr_bytes()?).map_err(|_| BodyError::InvalidUtf8)
    }

    pub(crate) fn finish(&self) -> Result<(), BodyError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(BodyError::TrailingData)
        }
    }
}

/// Query text of a Query (`Q`) body, as raw bytes in the client encoding.
pub fn query_bytes(body: &[u8]) -> Result<&[u8], BodyError> {
    let mut r = Reader::new(body);
    let q = r.cstr_bytes()?;
    r.finish()?;
    Ok(q)
}

/// Query text of a Query (`Q`) body.
pub fn query_text(body: &[u8]) -> Result<&str, BodyError> {
    std::str::from_utf8(query_bytes(body)?).map_err(|_| BodyError::InvalidUtf8)
}

/// The parts of a Parse (`P`) body the proxy needs.
///
/// Name and query are raw bytes in the client's encoding: a client with
/// `client_encoding = LATIN1` sends bytes that are not UTF-8, and the
/// proxy's checks must see its statements all the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParseMsg<'a> {
    /// Statement name; empty for the unnamed statement.
    pub name: &'a [u8],
    /// Query text.
    pub query: &'a [u8],
    /// Number of parameter type OIDs the client specified (they follow in
    /// the body and are validated but not returned).
    pub param_type_count: u16,
}

/// Reads a Parse (`P`) body.
pub fn parse_message(body: &[u8]) -> Result<ParseMsg<'_>, BodyError> {
    let mut r = Reader::new(body);
    let name = r.cstr_bytes()?;
    let query = r.cstr_bytes()?;
    // PostgreSQL reads the count as an unsigned 16-bit number: 32,768 to
    // 65,535 parameter types are valid, not negative.
    let count = r.i16()? as u16;
    r.take(usize::from(count) * 4)?;
    r.finish()?;
    Ok(ParseMsg {
        name,
        query,
        param_type_count: count,
    })
}

/// The OID of the function a FunctionCall (`F`) body calls; the arguments
/// are left to the server.
pub fn function_call_oid(body: &[u8]) -> Result<u32, BodyError> {
    Reader::new(body).i32().map(|oid| oid as u32)
}

/// Portal and statement names of a Bind (`B`) body, in that order.
///
/// Only the names are read; parameter values and formats are left to the
/// server to validate.
pub fn bind_names(body: &[u8]) -> Result<(&str, &str), BodyError> {
    let mut r = Reader::new(body);
    let portal = r.cstr()?;
    let statement = r.cstr()?;
    Ok((portal, statement))
}

/// Portal name of an Execute (`E`) body; the row limit is the server's
/// business.
pub fn execute_portal(body: &[u8]) -> Result<&str, BodyError> {
    let mut r = Reader::new(body);
    let portal = r.cstr()?;
    r.i32()?;
    r.finish()?;
    Ok(portal)
}

/// Kind (`b'S'` statement or `b'P'` portal) and name of a Close (`C`) body.
pub fn close_target(body: &[u8]) -> Result<(u8, &str), BodyError> {
    target(body)
}

/// Kind (`b'S'` statement or `b'P'` portal) and name of a Describe (`D`) body.
pub fn describe_target(body: &[u8]) -> Result<(u8, &str), BodyError> {
    target(body)
}

fn target(body: &[u8]) -> Result<(u8, &str), BodyError> {
    let mut r = Reader::new(body);
    let kind = r.u8()?;
    if kind != b'S' && kind != b'P' {
        return Err(BodyError::InvalidValue("target must be 'S' or 'P'"));
    }
    let name = r.cstr()?;
    r.finish()?;
    Ok((kind, name))
}

/// Name and value of a ParameterStatus (`S`) body.
pub fn parameter_status(body: &[u8]) -> Result<(&str, &str), BodyError> {
    let mut r = Reader::new(body);
    let name = r.cstr()?;
    let value = r.cstr()?;
    r.finish()?;
    Ok((name, value))
}

/// Transaction status reported by ReadyForQuery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TxStatus {
    /// Not in a transaction block (`I`).
    Idle,
    /// In a transaction block (`T`).
    InTransaction,
    /// In a failed transaction block; commands are refused until it ends (`E`).
    Failed,
}

impl TxStatus {
    /// The status byte as sent on the wire.
    pub fn as_byte(self) -> u8 {
        match self {
            TxStatus::Idle => b'I',
            TxStatus::InTransaction => b'T',
            TxStatus::Failed => b'E',
        }
    }

    /// The status for a wire byte, if it is one of the three defined ones.
    pub fn from_byte(b: u8) -> Option<TxStatus> {
        match b {
            b'I' => Some(TxStatus::Idle),
            b'T' => Some(TxStatus::InTransaction),
            b'E' => Some(TxStatus::Failed),
            _ => None,
        }
    }
}

/// Transaction status of a ReadyForQuery (`Z`) body.
pub fn ready_for_query_status(body: &[u8]) -> Result<TxStatus, BodyError> {
    let mut r = Reader::new(body);
    let status = TxStatus::from_byte(r.u8()?)
        .ok_or(BodyError::InvalidValue("unknown transaction status"))?;
    r.finish()?;
    Ok(status)
}

/// Process id and secret key of a BackendKeyData (`K`) body.
///
/// Only the four-byte keys of protocol 3.0 are accepted; the proxy never
/// negotiates the longer keys of 3.2 with servers.
pub fn backend_key_data(body: &[u8]) -> Result<(i32, i32), BodyError> {
    let mut r = Reader::new(body);
    let pid = r.i32()?;
    let secret = r.i32()?;
    r.finish()?;
    Ok((pid, secret))
}

/// The process id and secret key of a BackendKeyData body of any
/// protocol 3.x version: the key is 4 bytes under 3.0 and 4 to 256 bytes
/// under 3.2.
pub fn backend_key_data_any(body: &[u8]) -> Result<(i32, &[u8]), BodyError> {
    let mut r = Reader::new(body);
    let pid = r.i32()?;
    let secret = &body[4..];
    if !(4..=256).contains(&secret.len()) {
        return Err(BodyError::InvalidValue("secret key length out of range"));
    }
    Ok((pid, secret))
}

/// The request code at the start of an Authentication (`R`) body, such as
/// 0 for success, 3 for a cleartext password or 10 for SASL.
pub fn authentication_code(body: &[u8]) -> Result<i32, BodyError> {
    Reader::new(body).i32()
}

/// A whole AuthenticationSASL message (`R`, code 10) without the
/// mechanisms that bind to the TLS channel (`…-PLUS`), or `None` when the
/// message is something else, offers none of them, or would offer nothing
/// without them.
///
/// A proxy that relays a server's SASL offer to a client on another
/// channel needs this: over the server's TLS the server offers
/// `SCRAM-SHA-256-PLUS`, which libpq refuses to see on a plaintext
/// connection, and which no client could bind to the server's channel.
pub fn sasl_offer_without_binding(msg: &[u8]) -> Option<Vec<u8>> {
    if msg.first() != Some(&backend::AUTHENTICATION_REQUEST) || msg.len() < 9 {
        return None;
    }
    if authentication_code(&msg[5..9]).ok()? != 10 {
        return None;
    }
    let mut r = Reader::new(&msg[9..]);
    let mut kept: Vec<&str> = Vec::new();
    let mut dropped = false;
    loop {
        let name = r.cstr().ok()?;
        if name.is_empty() {
            break;
        }
        if name.ends_with("-PLUS") {
            dropped = true;
        } else {
            kept.push(name);
        }
    }
    r.finish().ok()?;
    if !dropped || kept.is_empty() {
        return None;
    }
    let body_len: usize = 4 + kept.iter().map(|k| k.len() + 1).sum::<usize>() + 1;
    let mut out = Vec::with_capacity(1 + 4 + body_len);
    out.push(backend::AUTHENTICATION_REQUEST);
    out.extend_from_slice(&(4 + body_len as u32).to_be_bytes());
    out.extend_from_slice(&10i32.to_be_bytes());
    for k in kept {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
    }
    out.push(0);
    Some(out)
}

/// The string of a PasswordMessage (`p`) body sent in answer to
/// AuthenticationCleartextPassword or AuthenticationMD5Password: the password
/// or the md5 response.
///
/// As in PostgreSQL, bytes after the terminator make the message invalid.
pub fn password_message(body: &[u8]) -> Result<&str, BodyError> {
    std::str::from_utf8(password_bytes(body)?).map_err(|_| BodyError::InvalidUtf8)
}

/// The password of a PasswordMessage body as the client sent it: a
/// client whose encoding is not UTF-8 sends its password in that
/// encoding, and PostgreSQL compares the bytes.
pub fn password_bytes(body: &[u8]) -> Result<&[u8], BodyError> {
    let mut r = Reader::new(body);
    let password = r.cstr_bytes()?;
    r.finish()?;
    Ok(password)
}

/// Mechanism and initial client response of a SASLInitialResponse (`p`)
/// body; `None` for a length of -1, "no initial response" (RFC 4422
/// lets a client send its first message in a SASLResponse instead, after
/// an empty challenge). Any other negative length is refused.
pub fn sasl_initial_response(body: &[u8]) -> Result<(&str, Option<&[u8]>), BodyError> {
    let mut r = Reader::new(body);
    let mechanism = r.cstr()?;
    let data = match r.i32()? {
        -1 => None,
        len => {
            let len = usize::try_from(len)
                .map_err(|_| BodyError::InvalidValue("negative SASL response length"))?;
            Some(r.take(len)?)
        }
    };
    r.finish()?;
    Ok((mechanism, data))
}

/// Fields of an ErrorResponse (`E`) or NoticeResponse (`N`) body, as
/// `(field type, value)` pairs in wire order.
pub fn error_fields(body: &[u8]) -> Result<Vec<(u8, &str)>, BodyError> {
    error_fields_raw(body)?
        .into_iter()
        .map(|(ty, v)| {
            std::str::from_utf8(v)
                .map(|v| (ty, v))
                .map_err(|_| BodyError::InvalidUtf8)
        })
        .collect()
}

/// The value of the last field of type `ty` (see [`field`]), if present.
pub fn find_field<'a>(fields: &[(u8, &'a str)], ty: u8) -> Option<&'a str> {
    fields.iter().rev().find(|(t, _)| *t == ty).map(|(_, v)| *v)
}

/// Fields of an ErrorResponse or NoticeResponse body as bytes, for a
/// server whose messages may not be UTF-8 (they are in the client's
/// encoding, or the server's during a login): severity and SQLSTATE are
/// ASCII whatever the encoding, and a message must still be told a FATAL
/// when its text is in LATIN1.
pub fn error_fields_raw(body: &[u8]) -> Result<Vec<(u8, &[u8])>, BodyError> {
    let mut r = Reader::new(body);
    let mut fields = Vec::new();
    loop {
        let ty = r.u8()?;
        if ty == 0 {
            break;
        }
        fields.push((ty, r.cstr_bytes()?));
    }
    r.finish()?;
    Ok(fields)
}

/// The value of the last field of type `ty` in [`error_fields_raw`]
/// output, if present.
pub fn find_raw_field<'a>(fields: &[(u8, &'a [u8])], ty: u8) -> Option<&'a [u8]> {
    fields.iter().rev().find(|(t, _)| *t == ty).map(|(_, v)| *v)
}

/// The fields of an error or notice that the proxy acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ErrorSummary<'a> {
    /// Severity, preferring the untranslated `V` field over `S` so that it
    /// can be compared with `ERROR`, `FATAL` and so on.
    pub severity: Option<&'a str>,
    /// SQLSTATE.
    pub code: Option<&'a str>,
    /// Primary message.
    pub message: Option<&'a str>,
}

impl<'a> ErrorSummary<'a> {
    /// Picks the summary fields out of [`error_fields`] output.
    pub fn from_fields(fields: &[(u8, &'a str)]) -> Self {
        ErrorSummary {
            severity: find_field(fields, field::SEVERITY_NONLOCALIZED)
                .or_else(|| find_field(fields, field::SEVERITY)),
            code: find_field(fields, field::CODE),
            message: find_field(fields, field::MESSAGE),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sasl_offer_loses_its_channel_binding_mechanisms() {
        fn offer(names: &[&str]) -> Vec<u8> {
            let mut body = 10i32.to_be_bytes().to_vec();
            for n in names {
                body.extend_from_slice(n.as_bytes());
                body.push(0);
            }
            body.push(0);
            let mut m = vec![b'R'];
            m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
            m.extend_from_slice(&body);
            m
        }
        let both = offer(&["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]);
        assert_eq!(
            super::sasl_offer_without_binding(&both),
            Some(offer(&["SCRAM-SHA-256"]))
        );
        // Nothing to drop, nothing left, or not a SASL offer: untouched.
        assert_eq!(
            super::sasl_offer_without_binding(&offer(&["SCRAM-SHA-256"])),
            None
        );
        assert_eq!(
            super::sasl_offer_without_binding(&offer(&["SCRAM-SHA-256-PLUS"])),
            None
        );
        let mut md5 = vec![b'R', 0, 0, 0, 12];
        md5.extend_from_slice(&5i32.to_be_bytes());
        md5.extend_from_slice(b"salt");
        assert_eq!(super::sasl_offer_without_binding(&md5), None);
        // Malformed: no terminator.
        let mut cut = both.clone();
        cut.truncate(cut.len() - 1);
        assert_eq!(super::sasl_offer_without_binding(&cut), None);
    }

    use super::*;

    fn msg(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn password_and_sasl_initial_response_bodies() {
        assert_eq!(password_message(b"secret\0"), Ok("secret"));
        assert_eq!(password_message(b"secret"), Err(BodyError::Truncated));
        assert_eq!(password_message(b"a\0b"), Err(BodyError::TrailingData));
        assert_eq!(password_bytes(b"caf\xe9\0"), Ok(&b"caf\xe9"[..]));
        assert_eq!(password_message(b"caf\xe9\0"), Err(BodyError::InvalidUtf8));
        assert_eq!(
            sasl_initial_response(b"SCRAM-SHA-256\0\0\0\0\x03n,,"),
            Ok(("SCRAM-SHA-256", Some(&b"n,,"[..])))
        );
        assert_eq!(
            sasl_initial_response(b"M\0\xff\xff\xff\xff"),
            Ok(("M", None))
        );
        assert_eq!(
            sasl_initial_response(b"M\0\xff\xff\xff\xfe"),
            Err(BodyError::InvalidValue("negative SASL response length"))
        );
        assert_eq!(
            sasl_initial_response(b"M\0\0\0\0\x04abc"),
            Err(BodyError::Truncated)
        );
        assert_eq!(
            sasl_initial_response(b"M\0\0\0\0\x01abc"),
            Err(BodyError::TrailingData)
        );
    }

    #[test]
    fn header_needs_five_bytes_and_valid_length() {
        assert_eq!(peek_header(b"Q\0\0\0", 100), Ok(None));
        assert_eq!(
            peek_header(b"Q\0\0\0\x04", 100),
            Ok(Some(Header { tag: b'Q', len: 4 }))
        );
        assert_eq!(
            peek_header(b"Q\0\0\0\x03", 100),
            Err(FrameError::InvalidLength { tag: b'Q', len: 3 })
        );
        assert_eq!(
            peek_header(b"Q\xff\xff\xff\xff", usize::MAX),
            Err(FrameError::InvalidLength {
                tag: b'Q',
                len: u32::MAX
            })
        );
        assert_eq!(
            peek_header(b"Q\0\0\x01\0", 100),
            Err(FrameError::TooLong {
                tag: b'Q',
                len: 256,
                max: 100
            })
        );
    }

    #[test]
    fn split_returns_whole_messages_in_order() {
        let mut wire = msg(b'Q', b"SELECT 1\0");
        wire.extend(msg(b'S', b""));
        wire.extend(&msg(b'X', b"")[..3]);
        let mut buf = BytesMut::from(&wire[..]);
        let (tag, m) = split_message(&mut buf, 1 << 20).unwrap().unwrap();
        assert_eq!(tag, b'Q');
        assert_eq!(&m[..], &msg(b'Q', b"SELECT 1\0")[..]);
        assert_eq!(query_text(body(&m)), Ok("SELECT 1"));
        let (tag, m) = split_message(&mut buf, 1 << 20).unwrap().unwrap();
        assert_eq!((tag, m.len()), (b'S', 5));
        assert_eq!(split_message(&mut buf, 1 << 20), Ok(None));
        assert_eq!(buf.len(), 3);
    }

    #[test]
    fn split_waits_for_the_body() {
        let wire = msg(b'Q', b"SELECT 1\0");
        let mut buf = BytesMut::from(&wire[..7]);
        assert_eq!(split_message(&mut buf, 1 << 20), Ok(None));
        assert!(buf.capacity() >= wire.len());
        buf.extend_from_slice(&wire[7..]);
        assert!(split_message(&mut buf, 1 << 20).unwrap().is_some());
        assert!(buf.is_empty());
    }

    #[test]
    fn query_text_requires_a_single_terminated_string() {
        assert_eq!(query_text(b"SELECT 1"), Err(BodyError::Truncated));
        assert_eq!(query_text(b"a\0b\0"), Err(BodyError::TrailingData));
        assert_eq!(query_text(b"\xff\0"), Err(BodyError::InvalidUtf8));
        assert_eq!(query_bytes(b"\xff\0"), Ok(&b"\xff"[..]));
        assert_eq!(query_text(b"\0"), Ok(""));
    }

    #[test]
    fn parse_message_checks_parameter_types() {
        let b = b"s1\0SELECT $1\0\0\x01\0\0\0\x17";
        assert_eq!(
            parse_message(b),
            Ok(ParseMsg {
                name: b"s1",
                query: b"SELECT $1",
                param_type_count: 1
            })
        );
        // Not UTF-8 (a LATIN1 client): read all the same.
        assert_eq!(
            parse_message(b"s\xe9\0SELECT '\xe9'\0\0\0").map(|p| (p.name, p.query)),
            Ok((&b"s\xe9"[..], &b"SELECT '\xe9'"[..]))
        );
        let mut wide = b"\0SET x = 1\0\x80\0".to_vec();
        wide.resize(wide.len() + 0x8000 * 4, 0);
        assert_eq!(parse_message(&wide).map(|p| p.param_type_count), Ok(0x8000));
        assert_eq!(
            parse_message(b"s1\0SELECT $1\0\0\x02\0\0\0\x17"),
            Err(BodyError::Truncated)
        );
        // 65,535 parameter types announced, none there.
        assert_eq!(parse_message(b"\0q\0\xff\xff"), Err(BodyError::Truncated));
    }

    #[test]
    fn function_call_oid_is_the_first_word() {
        assert_eq!(function_call_oid(b"\0\0\x08\x1e\0\0"), Ok(2078));
        assert_eq!(function_call_oid(b"\0\0"), Err(BodyError::Truncated));
    }

    #[test]
    fn targets_and_statuses() {
        assert_eq!(close_target(b"Sstmt\0"), Ok((b'S', "stmt")));
        assert_eq!(describe_target(b"P\0"), Ok((b'P', "")));
        assert!(close_target(b"Xa\0").is_err());
        assert_eq!(bind_names(b"p\0s\0\0\0"), Ok(("p", "s")));
        assert_eq!(execute_portal(b"p\0\0\0\0\0"), Ok("p"));
        assert_eq!(execute_portal(b"\0\0\0\0\x0a"), Ok(""));
        assert_eq!(execute_portal(b"p\0\0\0"), Err(BodyError::Truncated));
        assert_eq!(
            parameter_status(b"TimeZone\0UTC\0"),
            Ok(("TimeZone", "UTC"))
        );
        assert_eq!(ready_for_query_status(b"T"), Ok(TxStatus::InTransaction));
        assert!(ready_for_query_status(b"Q").is_err());
        assert!(ready_for_query_status(b"II").is_err());
        assert_eq!(
            backend_key_data(&[0, 0, 0, 7, 255, 255, 255, 254]),
            Ok((7, -2))
        );
        // Protocol 3.2: a secret of 4 to 256 bytes.
        let long = [&[0, 0, 0, 7][..], &[9; 32]].concat();
        assert_eq!(backend_key_data_any(&long), Ok((7, &[9u8; 32][..])));
        assert!(backend_key_data(&long).is_err());
        for n in [0, 3, 257] {
            let body = [&[0, 0, 0, 7][..], &vec![9; n]].concat();
            assert!(backend_key_data_any(&body).is_err(), "{n}");
        }
        assert!(backend_key_data_any(&[0, 0, 7]).is_err());
        assert_eq!(authentication_code(&[0, 0, 0, 10, b'x']), Ok(10));
    }

    #[test]
    fn error_fields_and_summary() {
        let b = b"SERREUR\0VERROR\0C42P01\0Mno such table\0\0";
        let f = error_fields(b).unwrap();
        assert_eq!(f.len(), 4);
        let s = ErrorSummary::from_fields(&f);
        assert_eq!(s.severity, Some("ERROR"));
        assert_eq!(s.code, Some("42P01"));
        assert_eq!(s.message, Some("no such table"));
        assert_eq!(error_fields(b"Sx\0"), Err(BodyError::Truncated));
        assert_eq!(error_fields(b"\0x"), Err(BodyError::TrailingData));
    }

    #[test]
    fn error_fields_in_another_encoding_are_read_as_bytes() {
        // A German server's message in LATIN1: not UTF-8.
        let b = b"SFATAL\0VFATAL\0C57P01\0Mbeende Verbindung auf Anweisung des Administrators \xbbx\xab\0\0";
        assert_eq!(error_fields(b), Err(BodyError::InvalidUtf8));
        let f = error_fields_raw(b).unwrap();
        assert_eq!(find_raw_field(&f, b'V'), Some(&b"FATAL"[..]));
        assert_eq!(find_raw_field(&f, b'C'), Some(&b"57P01"[..]));
        assert!(find_raw_field(&f, b'M').unwrap().ends_with(b"\xbbx\xab"));
        assert_eq!(error_fields_raw(b"Sx\0"), Err(BodyError::Truncated));
        assert_eq!(error_fields_raw(b"\0x"), Err(BodyError::TrailingData));
    }
}
