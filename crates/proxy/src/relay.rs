//! The per-message hot path: move bytes between client and server, looking
//! only at the few message types a direction cares about.
//!
//! Bytes are forwarded in the chunks they were read in. Only messages whose
//! body must be inspected (e.g. a Query on a read-only service) are held
//! back until complete; everything else, including a 64 MiB DataRow or
//! COPY chunk, streams through without being buffered whole.
//!
//! A pump holds a read buffer only while bytes are in flight: it borrows
//! one from the worker's free list when its socket has data and gives it
//! back once everything read is forwarded. An idle session then costs no
//! buffer, and the sessions of a worker take turns with the same few
//! buffers, which stay in the CPU's cache (64 sessions with two 16 KiB
//! buffers each would spread every message over 2 MiB).

use std::future::Future;
use std::pin::pin;

use bytes::{Buf, BytesMut};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::bufcache;
use crate::stream::taken;
use pgwarden_wire::sqlstate::SqlState;

/// Read buffer size per direction.
const CHUNK: usize = bufcache::SIZE;

/// Longest message pgwarden holds back for inspection. Larger inspected
/// messages are a protocol error (PostgreSQL itself caps a Query at 1 GB).
pub const MAX_INSPECTED: usize = 256 * 1024 * 1024;

/// What a pump can learn from, or do with, one end of the relay without
/// polling a future. Plain sockets answer from the readiness the event
/// loop recorded; other streams (TLS, test pipes) use the defaults, which
/// always go through the future.
pub trait Direct {
    /// Whether the socket, as the event loop last saw it, has nothing to
    /// read: no system call and no waker registered.
    fn quiet(&self) -> bool {
        false
    }

    /// Writes what the socket takes at once, without waiting; `Ok(0)`
    /// leaves everything to the future.
    fn write_now(&mut self, _buf: &[u8]) -> std::io::Result<usize> {
        Ok(0)
    }

    /// Reads into `buf` directly ([`crate::sock::poll_recv`]); `None`
    /// leaves the read to the stream's `AsyncRead`.
    fn poll_recv(
        &mut self,
        _cx: &mut std::task::Context<'_>,
        _buf: &mut BytesMut,
    ) -> Option<std::task::Poll<std::io::Result<usize>>> {
        None
    }
}

/// The halves of a plain socket (TCP or Unix-domain) answer directly.
macro_rules! direct_socket_halves {
    ($read:ty, $write:ty) => {
        impl Direct for $read {
            fn quiet(&self) -> bool {
                crate::sock::quiet(self.as_ref())
            }

            fn poll_recv(
                &mut self,
                cx: &mut std::task::Context<'_>,
                buf: &mut BytesMut,
            ) -> Option<std::task::Poll<std::io::Result<usize>>> {
                Some(crate::sock::poll_recv(self.as_ref(), cx, buf))
            }
        }

        impl Direct for $write {
            fn write_now(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                taken(crate::sock::try_send(self.as_ref(), buf))
            }
        }
    };
}

direct_socket_halves!(
    tokio::net::tcp::ReadHalf<'_>,
    tokio::net::tcp::WriteHalf<'_>
);
direct_socket_halves!(
    tokio::net::unix::ReadHalf<'_>,
    tokio::net::unix::WriteHalf<'_>
);

impl<T> Direct for tokio::io::ReadHalf<T> {}
impl<T> Direct for tokio::io::WriteHalf<T> {}
impl Direct for tokio::io::DuplexStream {}
impl Direct for tokio::io::Sink {}

impl<T: Direct + ?Sized> Direct for &mut T {
    fn quiet(&self) -> bool {
        (**self).quiet()
    }

    fn write_now(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        (**self).write_now(buf)
    }

    fn poll_recv(
        &mut self,
        cx: &mut std::task::Context<'_>,
        buf: &mut BytesMut,
    ) -> Option<std::task::Poll<std::io::Result<usize>>> {
        (**self).poll_recv(cx, buf)
    }
}

/// Writes all of `buf`: what the socket takes at once without a future
/// (a reply smaller than the socket's buffer, the common case), the rest
/// as `write_all` does.
async fn send_all<W: AsyncWrite + Direct + Unpin>(
    writer: &mut W,
    buf: &[u8],
) -> std::io::Result<()> {
    let n = writer.write_now(buf)?;
    if n < buf.len() {
        writer.write_all(&buf[n..]).await?;
        // A TLS stream takes bytes it cannot send yet (the socket is
        // full) into its own buffer and says they were written; only a
        // flush sends them. Unflushed, the end of a reply could wait there
        // for good. A plain socket's flush does nothing.
        writer.flush().await?;
    }
    Ok(())
}

/// What to do with one inspected, complete message.
pub enum Verdict {
    /// Forward it (possibly modified in place).
    Keep,
    /// Forward these bytes instead.
    Replace(BytesMut),
    /// Forward nothing more: the session ends with this error.
    Stop(SqlState, String),
    /// Not yet: forward what precedes it, then inspect it again once the
    /// pump's gate is opened.
    Wait,
}

/// Where one scan of the buffer got to.
enum Step {
    /// Forward `buf[..n]` and read more.
    Forward(usize),
    /// Forward `buf[..start]`, then `with` instead of `buf[start..end]`.
    Replace {
        start: usize,
        end: usize,
        with: BytesMut,
    },
    /// Forward `buf[..start]` and stop.
    Stop {
        start: usize,
        reason: (SqlState, String),
    },
    /// Forward `buf[..start]`, then wait for the gate before the rest.
    Wait { start: usize },
}

/// How a pump ended.
#[derive(Debug)]
pub enum End {
    /// The reading side closed the connection.
    Eof,
    /// An inspected message ended the session, with this error.
    Stopped(SqlState, String),
    /// The byte stream is not the PostgreSQL protocol.
    Protocol(String),
    /// A socket error.
    Io(std::io::Error),
}

/// How much of an inspected message longer than the limit inspection
/// needs ([`Framing::head`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// All of it: such a message is refused as too long.
    Whole,
    /// More bytes are needed to tell.
    More,
    /// Its first this many bytes (header included); the rest streams
    /// through unexamined, and the message cannot be replaced.
    Is(usize),
}

/// Longest head of a long message that is waited for ([`Head::More`]).
pub const MAX_HEAD: usize = 64 * 1024;

/// Message framing state of one direction, kept outside the pump future so
/// the session can tell, after cancelling it, whether the peer is at a
/// message boundary (and may be sent an ErrorResponse).
#[derive(Debug, Default)]
pub struct Framing {
    /// Bytes of the current message still to pass through unexamined.
    skip: usize,
    /// Bytes read but not yet forwarded (a partial inspected message).
    pending: usize,
    /// A write to the peer was in progress.
    writing: bool,
    /// The largest inspected message taken, when not [`MAX_INSPECTED`]:
    /// a read-only session's client before its login is done, whose
    /// inspected messages must be held whole, is allowed little.
    pub limit: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
    /// For an inspected message over the limit, how much of it inspection
    /// needs (given the tag and the message's bytes read so far, no more
    /// than the message); `None` for all of every one.
    pub head: Option<HeadOf>,
}

/// How much of a long message with this tag and these bytes is needed.
pub type HeadFn = dyn Fn(u8, &[u8]) -> Head + Send + Sync;

/// Tells how much of a long inspected message is needed ([`Framing::head`]).
pub struct HeadOf(pub Box<HeadFn>);

impl std::fmt::Debug for HeadOf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeadOf")
    }
}

impl Framing {
    /// Whether the peer has received only whole messages.
    pub fn at_boundary(&self) -> bool {
        self.skip == 0 && self.pending == 0 && !self.writing
    }

    fn scan(
        &mut self,
        buf: &mut [u8],
        interesting: &impl Fn(u8) -> bool,
        inspect: &mut impl FnMut(u8, &mut [u8]) -> Verdict,
    ) -> Result<Step, String> {
        let mut pos = 0;
        if self.skip > 0 {
            pos = self.skip.min(buf.len());
            self.skip -= pos;
        }
        while buf.len() - pos >= 5 {
            let tag = buf[pos];
            let len = u32::from_be_bytes([buf[pos + 1], buf[pos + 2], buf[pos + 3], buf[pos + 4]])
                as usize;
            // PostgreSQL reads the length as a signed 32-bit number: above
            // i32::MAX it is negative, and refused.
            if len < 4 || len > i32::MAX as usize {
                return Err(format!(
                    "invalid message length {len} for message type {:?}",
                    tag as char
                ));
            }
            let total = len + 1;
            let avail = buf.len() - pos;
            if interesting(tag) {
                let max = self.limit.as_ref().map_or(MAX_INSPECTED, |l| {
                    l.load(std::sync::atomic::Ordering::Relaxed)
                });
                if total > max {
                    let too_long = || format!("message of {total} bytes is too long");
                    let seen = &buf[pos..pos + total.min(avail)];
                    let head = self.head.as_ref().map_or(Head::Whole, |f| (f.0)(tag, seen));
                    match head {
                        Head::Whole => return Err(too_long()),
                        Head::More if avail >= MAX_HEAD.min(total) => return Err(too_long()),
                        Head::More => break,
                        Head::Is(n) if n > seen.len() => return Err(too_long()),
                        Head::Is(n) => match inspect(tag, &mut buf[pos..pos + n]) {
                            Verdict::Keep if avail >= total => pos += total,
                            Verdict::Keep => {
                                self.skip = total - avail;
                                pos = buf.len();
                            }
                            Verdict::Wait => return Ok(Step::Wait { start: pos }),
                            Verdict::Stop(code, why) => {
                                return Ok(Step::Stop {
                                    start: pos,
                                    reason: (code, why),
                                })
                            }
                            Verdict::Replace(_) => return Err(too_long()),
                        },
                    }
                    continue;
                }
                if avail < total {
                    break;
                }
                match inspect(tag, &mut buf[pos..pos + total]) {
                    Verdict::Keep => pos += total,
                    Verdict::Replace(with) => {
                        return Ok(Step::Replace {
                            start: pos,
                            end: pos + total,
                            with,
                        })
                    }
                    Verdict::Stop(code, why) => {
                        return Ok(Step::Stop {
                            start: pos,
                            reason: (code, why),
                        })
                    }
                    Verdict::Wait => return Ok(Step::Wait { start: pos }),
                }
            } else if avail >= total {
                pos += total;
            } else {
                self.skip = total - avail;
                pos = buf.len();
            }
        }
        Ok(Step::Forward(pos))
    }
}

/// Reads into `buf`, which holds a buffer from the free list only while
/// the read returns data or `buf` still holds bytes: a read that has to
/// wait gives an empty buffer back.
///
/// Both directions of a session are polled whenever either wakes the
/// task. `armed` says this read's waker is registered with its socket:
/// while the socket's recorded readiness shows nothing, the read waits
/// without polling it again (which would register the same waker once
/// more).
async fn read_borrowing<R: AsyncRead + Direct + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    armed: &mut bool,
) -> std::io::Result<usize> {
    std::future::poll_fn(|cx| {
        if *armed && reader.quiet() {
            return std::task::Poll::Pending;
        }
        if buf.capacity() == 0 {
            *buf = bufcache::take();
        } else if buf.capacity() - buf.len() < CHUNK / 4 {
            buf.reserve(CHUNK);
        }
        let polled = match reader.poll_recv(cx, buf) {
            Some(polled) => polled,
            None => pin!(reader.read_buf(&mut *buf)).poll(cx),
        };
        // A read held back by the task's budget registered no waker.
        *armed = polled.is_pending() && tokio::task::coop::has_budget_remaining();
        if polled.is_pending() && buf.is_empty() {
            bufcache::release(buf);
        }
        polled
    })
    .await
}

/// Copies messages from `reader` to `writer` until EOF, an error, or an
/// inspected message that stops the session. `buf` holds bytes already
/// read from `reader`, starting at a message boundary (often none). An
/// inspected message judged [`Verdict::Wait`] stays unread, with what
/// follows it, until `gate` is notified; nothing more is read meanwhile.
#[allow(clippy::too_many_arguments)]
pub async fn pump<R, W>(
    reader: &mut R,
    writer: &mut W,
    framing: &mut Framing,
    bytes: &Counter,
    interesting: impl Fn(u8) -> bool,
    mut inspect: impl FnMut(u8, &mut [u8]) -> Verdict,
    mut buf: BytesMut,
    gate: Option<&tokio::sync::Notify>,
) -> End
where
    R: AsyncRead + Direct + Unpin,
    W: AsyncWrite + Direct + Unpin,
{
    let mut armed = false;
    // Bytes read before the relay began (the client's, pipelined behind
    // its startup packet) go through the same framing and inspection as
    // every later byte, before anything more is read.
    let mut read_first = buf.is_empty();
    loop {
        if std::mem::replace(&mut read_first, true) {
            match read_borrowing(reader, &mut buf, &mut armed).await {
                Ok(0) => return End::Eof,
                Ok(n) => {
                    bytes.inc_by(n as u64);
                }
                Err(e) => return End::Io(e),
            }
        }
        loop {
            let step = match framing.scan(&mut buf, &interesting, &mut inspect) {
                Ok(s) => s,
                Err(e) => return End::Protocol(e),
            };
            framing.writing = true;
            let result = match step {
                Step::Forward(n) => {
                    let r = if n > 0 {
                        send_all(writer, &buf[..n]).await
                    } else {
                        Ok(())
                    };
                    buf.advance(n);
                    framing.pending = buf.len();
                    framing.writing = false;
                    if let Err(e) = r {
                        return End::Io(e);
                    }
                    break;
                }
                Step::Replace { start, end, with } => {
                    let r = async {
                        writer.write_all(&buf[..start]).await?;
                        writer.write_all(&with).await?;
                        writer.flush().await
                    }
                    .await;
                    buf.advance(end);
                    r
                }
                Step::Wait { start } => {
                    let r = send_all(writer, &buf[..start]).await;
                    buf.advance(start);
                    framing.pending = buf.len();
                    framing.writing = false;
                    if let Err(e) = r {
                        return End::Io(e);
                    }
                    match gate {
                        Some(gate) => gate.notified().await,
                        None => std::future::pending().await,
                    }
                    continue;
                }
                Step::Stop { start, reason } => {
                    let r = async {
                        writer.write_all(&buf[..start]).await?;
                        writer.flush().await
                    }
                    .await;
                    framing.writing = false;
                    framing.pending = 0;
                    return match r {
                        Ok(()) => End::Stopped(reason.0, reason.1),
                        Err(e) => End::Io(e),
                    };
                }
            };
            framing.writing = false;
            if let Err(e) = result {
                return End::Io(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replaces the Query `bad` with the Query `fixed`.
    fn fix_bad(_: u8, m: &mut [u8]) -> Verdict {
        if &m[5..] == b"bad\0" {
            Verdict::Replace(BytesMut::from(&msg(b'Q', b"fixed\0")[..]))
        } else {
            Verdict::Keep
        }
    }

    fn msg(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    /// A length PostgreSQL reads as negative is refused, not streamed (on
    /// a 32-bit target, adding the tag's byte would wrap it to zero).
    #[test]
    fn lengths_above_i32_max_are_refused() {
        for len in [0x8000_0000u32, u32::MAX] {
            let mut buf = vec![b'D'];
            buf.extend_from_slice(&len.to_be_bytes());
            buf.extend_from_slice(&[0; 16]);
            let r = Framing::default().scan(&mut buf, &|_| false, &mut |_, _| Verdict::Keep);
            assert!(
                matches!(&r, Err(e) if e.contains("invalid message length")),
                "{len}"
            );
        }
        let mut ok = msg(b'D', &[1, 2, 3]);
        assert!(Framing::default()
            .scan(&mut ok, &|_| false, &mut |_, _| Verdict::Keep)
            .is_ok());
    }

    #[tokio::test]
    async fn streams_uninteresting_and_replaces_inspected_messages_across_chunk_edges() {
        let mut input = Vec::new();
        input.extend(msg(b'D', &vec![7u8; 100_000]));
        input.extend(msg(b'Q', b"bad\0"));
        input.extend(msg(b'Q', b"good\0"));
        let (mut client, mut proxy_in) = tokio::io::duplex(977);
        let (mut proxy_out, mut server) = tokio::io::duplex(1 << 20);
        let writer = tokio::spawn(async move {
            client.write_all(&input).await.unwrap();
        });
        let reader = tokio::spawn(async move {
            let mut out = Vec::new();
            server.read_to_end(&mut out).await.unwrap();
            out
        });
        let mut framing = Framing::default();
        let counter = Counter::default();
        let end = pump(
            &mut proxy_in,
            &mut proxy_out,
            &mut framing,
            &counter,
            |t| t == b'Q',
            fix_bad,
            BytesMut::new(),
            None,
        )
        .await;
        writer.await.unwrap();
        assert!(matches!(end, End::Eof));
        drop(proxy_out);
        let out = reader.await.unwrap();
        let mut expected = msg(b'D', &vec![7u8; 100_000]);
        expected.extend(msg(b'Q', b"fixed\0"));
        expected.extend(msg(b'Q', b"good\0"));
        assert_eq!(out, expected);
        assert!(framing.at_boundary());
    }

    /// A writer that keeps what it is given until flushed, as a TLS
    /// stream does while its socket is full.
    struct Buffering(std::sync::Arc<std::sync::Mutex<(Vec<u8>, Vec<u8>)>>);

    impl Direct for Buffering {}

    impl AsyncWrite for Buffering {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.0.lock().unwrap().0.extend_from_slice(buf);
            std::task::Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let mut s = self.0.lock().unwrap();
            let held = std::mem::take(&mut s.0);
            s.1.extend(held);
            std::task::Poll::Ready(Ok(()))
        }

        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            self.poll_flush(cx)
        }
    }

    /// What a writer took is flushed before the pump waits for more: a
    /// reply must not stay in a TLS stream's buffer while the peer waits
    /// for it, plain, replaced or the last before a stop.
    #[tokio::test]
    async fn what_is_written_is_flushed_before_waiting() {
        for (first, stops) in [
            (&b"good\0"[..], false),
            (b"bad\0", false),
            (b"stop\0", true),
        ] {
            let state = std::sync::Arc::new(std::sync::Mutex::new((Vec::new(), Vec::new())));
            let (mut client, mut proxy_in) = tokio::io::duplex(1 << 16);
            let mut out = Buffering(state.clone());
            let mut input = msg(b'D', b"row");
            input.extend(msg(b'Q', first));
            client.write_all(&input).await.unwrap();
            let pumping = tokio::spawn(async move {
                let mut framing = Framing::default();
                let counter = Counter::default();
                pump(
                    &mut proxy_in,
                    &mut out,
                    &mut framing,
                    &counter,
                    |t| t == b'Q',
                    |t, m| {
                        if &m[5..] == b"stop\0" {
                            Verdict::Stop(
                                pgwarden_wire::sqlstate::PROTOCOL_VIOLATION,
                                "stop".into(),
                            )
                        } else {
                            fix_bad(t, m)
                        }
                    },
                    BytesMut::new(),
                    None,
                )
                .await
            });
            let mut expected = msg(b'D', b"row");
            if !stops {
                expected.extend(msg(
                    b'Q',
                    if first == b"bad\0" { b"fixed\0" } else { first },
                ));
            }
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
            loop {
                let (held, flushed) = state.lock().unwrap().clone();
                if flushed == expected {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{:?}: flushed {flushed:?}, held {held:?}",
                    String::from_utf8_lossy(first),
                );
                tokio::task::yield_now().await;
            }
            if stops {
                assert!(matches!(pumping.await.unwrap(), End::Stopped(..)));
            } else {
                // Still waiting for the client, which has not closed.
                assert!(!pumping.is_finished());
                pumping.abort();
            }
            drop(client);
        }
    }

    /// Two pumps in one task over real sockets, as a session runs them:
    /// each waits armed on its socket while the other works, and must
    /// still see every byte that arrives.
    #[tokio::test]
    async fn pumps_sharing_a_task_see_every_byte_over_real_sockets() {
        use tokio::net::{TcpListener, TcpStream};
        async fn pair() -> (TcpStream, TcpStream) {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (a, b) = tokio::join!(TcpStream::connect(addr), listener.accept());
            let (a, b) = (a.unwrap(), b.unwrap().0);
            a.set_nodelay(true).unwrap();
            b.set_nodelay(true).unwrap();
            (a, b)
        }
        let (mut client, mut from_client) = pair().await;
        let (mut to_server, mut server) = pair().await;
        let relay = tokio::spawn(async move {
            let (mut cr, mut cw) = from_client.split();
            let (mut sr, mut sw) = to_server.split();
            let (mut up, mut down) = (Framing::default(), Framing::default());
            let counter = Counter::default();
            tokio::select! {
                e = pump(&mut cr, &mut sw, &mut up, &counter, |_| false, |_, _| Verdict::Keep, BytesMut::new(), None) => e,
                e = pump(&mut sr, &mut cw, &mut down, &counter, |_| false, |_, _| Verdict::Keep, BytesMut::new(), None) => e,
            }
        });
        let exchange = async {
            for i in 0..500u32 {
                let query = msg(b'Q', format!("select {i}\0").as_bytes());
                client.write_all(&query).await.unwrap();
                let mut got = vec![0u8; query.len()];
                server.read_exact(&mut got).await.unwrap();
                assert_eq!(got, query);
                // Replies of every size, some larger than a read buffer.
                let reply = msg(b'D', &vec![i as u8; (i as usize * 97) % 40_000]);
                server.write_all(&reply).await.unwrap();
                let mut got = vec![0u8; reply.len()];
                client.read_exact(&mut got).await.unwrap();
                assert_eq!(got, reply);
            }
        };
        crate::timer::timeout(std::time::Duration::from_secs(30), exchange)
            .await
            .expect("a byte was left unread");
        drop(client);
        assert!(matches!(relay.await.unwrap(), End::Eof));
    }

    #[tokio::test]
    async fn a_waiting_read_holds_no_buffer() {
        let (mut a, mut b) = tokio::io::duplex(64);
        let mut buf = BytesMut::new();
        let mut armed = false;
        {
            let read = std::pin::pin!(read_borrowing(&mut b, &mut buf, &mut armed));
            let waker = std::task::Waker::noop();
            let polled = read.poll(&mut std::task::Context::from_waker(waker));
            assert!(polled.is_pending());
        }
        assert_eq!(buf.capacity(), 0, "an idle read gives its buffer back");
        a.write_all(b"hello").await.unwrap();
        assert_eq!(
            read_borrowing(&mut b, &mut buf, &mut armed).await.unwrap(),
            5
        );
        assert_eq!(&buf[..], b"hello");
        // Bytes not yet forwarded keep their buffer across a wait.
        {
            let read = std::pin::pin!(read_borrowing(&mut b, &mut buf, &mut armed));
            let waker = std::task::Waker::noop();
            assert!(read
                .poll(&mut std::task::Context::from_waker(waker))
                .is_pending());
        }
        assert_eq!(&buf[..], b"hello");
    }

    #[tokio::test]
    async fn bytes_read_before_the_relay_are_framed_and_inspected_first() {
        // A whole message and the start of the next one were read with the
        // startup packet; the rest of that one arrives from the socket.
        let bad = msg(b'Q', b"bad\0");
        let mut early = BytesMut::from(&bad[..]);
        early.extend_from_slice(&bad[..3]);
        let mut rest = bad[3..].to_vec();
        rest.extend(msg(b'Q', b"good\0"));
        let (mut client, mut proxy_in) = tokio::io::duplex(64);
        client.write_all(&rest).await.unwrap();
        drop(client);
        let (mut proxy_out, mut server) = tokio::io::duplex(1 << 16);
        let end = pump(
            &mut proxy_in,
            &mut proxy_out,
            &mut Framing::default(),
            &Counter::default(),
            |t| t == b'Q',
            fix_bad,
            early,
            None,
        )
        .await;
        assert!(matches!(end, End::Eof));
        drop(proxy_out);
        let mut out = Vec::new();
        server.read_to_end(&mut out).await.unwrap();
        let mut want = msg(b'Q', b"fixed\0");
        want.extend(msg(b'Q', b"fixed\0"));
        want.extend(msg(b'Q', b"good\0"));
        assert_eq!(out, want);
    }

    #[tokio::test]
    async fn a_message_told_to_wait_goes_only_once_the_gate_opens() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let mut input = msg(b'Q', b"first\0");
        input.extend(msg(b'Q', b"second\0"));
        input.extend(msg(b'D', b"after"));
        let (mut client, mut proxy_in) = tokio::io::duplex(1 << 16);
        client.write_all(&input).await.unwrap();
        drop(client);
        let (mut proxy_out, mut server) = tokio::io::duplex(1 << 16);
        let open = AtomicBool::new(false);
        let gate = tokio::sync::Notify::new();
        let (mut framing, counter) = (Framing::default(), Counter::default());
        let pumped = pump(
            &mut proxy_in,
            &mut proxy_out,
            &mut framing,
            &counter,
            |t| t == b'Q',
            |_, m| {
                if &m[5..] == b"second\0" && !open.load(Ordering::Relaxed) {
                    Verdict::Wait
                } else {
                    Verdict::Keep
                }
            },
            BytesMut::new(),
            Some(&gate),
        );
        let first = msg(b'Q', b"first\0");
        let mut want = msg(b'Q', b"second\0");
        want.extend(msg(b'D', b"after"));
        let check = async {
            let mut got = vec![0u8; first.len()];
            server.read_exact(&mut got).await.unwrap();
            assert_eq!(got, first);
            // Nothing more until the gate opens, however long it takes.
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
            let mut more = [0u8; 1];
            let early = futures_now(server.read(&mut more));
            assert!(early.is_none(), "sent before the gate opened");
            // A spurious wake-up changes nothing; opening does.
            gate.notify_one();
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
            assert!(futures_now(server.read(&mut more)).is_none());
            open.store(true, Ordering::Relaxed);
            gate.notify_one();
            let mut rest = vec![0u8; want.len()];
            server.read_exact(&mut rest).await.unwrap();
            rest
        };
        let (end, rest) = tokio::join!(pumped, check);
        assert!(matches!(end, End::Eof));
        assert_eq!(rest, want);
    }

    /// The future's output if it is ready at its first poll.
    fn futures_now<F: Future>(f: F) -> Option<F::Output> {
        let f = pin!(f);
        match f.poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }

    /// Runs `input` through a pump whose inspected messages are 'B' and
    /// 'Q', limited to 64 bytes, read in small pieces; returns how it
    /// ended, what it sent and what inspection was shown.
    async fn pump_limited(input: Vec<u8>) -> (End, Vec<u8>, Vec<Vec<u8>>) {
        let (mut client, mut proxy_in) = tokio::io::duplex(977);
        let (mut proxy_out, mut server) = tokio::io::duplex(1 << 20);
        let writer = tokio::spawn(async move {
            let _ = client.write_all(&input).await;
        });
        let reader = tokio::spawn(async move {
            let mut out = Vec::new();
            server.read_to_end(&mut out).await.unwrap();
            out
        });
        let mut framing = Framing {
            limit: Some(std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(64))),
            head: Some(HeadOf(Box::new(crate::session::bind_head))),
            ..Framing::default()
        };
        let mut seen = Vec::new();
        let end = pump(
            &mut proxy_in,
            &mut proxy_out,
            &mut framing,
            &Counter::default(),
            |t| t == b'Q' || t == b'B',
            |t, m| {
                seen.push(m.to_vec());
                if t == b'B' && m.windows(3).any(|w| w == b"bad") {
                    Verdict::Replace(BytesMut::new())
                } else {
                    fix_bad(t, m)
                }
            },
            BytesMut::new(),
            None,
        )
        .await;
        drop((proxy_in, proxy_out));
        writer.await.unwrap();
        (end, reader.await.unwrap(), seen)
    }

    #[tokio::test]
    async fn a_long_message_with_a_head_is_inspected_by_its_head_and_streamed() {
        let names = b"portal\0statement\0";
        let bind = msg(b'B', &[&names[..], &vec![9u8; 100_000]].concat());
        let mut input = bind.clone();
        input.extend(msg(b'Q', b"bad\0"));
        let (end, out, seen) = pump_limited(input).await;
        assert!(matches!(end, End::Eof), "{end:?}");
        let mut want = bind.clone();
        want.extend(msg(b'Q', b"fixed\0"));
        assert_eq!(out, want);
        assert_eq!(seen[0], bind[..5 + names.len()]);
        assert_eq!(seen.len(), 2);
    }

    #[tokio::test]
    async fn long_messages_without_a_head_in_reach_are_too_long() {
        // A Query is needed whole.
        let (end, out, _) = pump_limited(msg(b'Q', &vec![b'x'; 1000])).await;
        assert!(
            matches!(&end, End::Protocol(e) if e.contains("too long")),
            "{end:?}"
        );
        assert!(out.is_empty());
        // A Bind whose names do not end within MAX_HEAD.
        let (end, out, seen) = pump_limited(msg(b'B', &vec![b'p'; MAX_HEAD * 2])).await;
        assert!(
            matches!(&end, End::Protocol(e) if e.contains("too long")),
            "{end:?}"
        );
        assert!(out.is_empty() && seen.is_empty());
        // One whose names do not end within it, followed by a message
        // whose header holds zero bytes: only its own bytes count.
        let mut input = msg(b'B', &[&b"p\0"[..], &[b'x'; 100]].concat());
        input.extend(msg(b'Q', b"good\0"));
        let (end, out, seen) = pump_limited(input).await;
        assert!(
            matches!(&end, End::Protocol(e) if e.contains("too long")),
            "{end:?}"
        );
        assert!(out.is_empty() && seen.is_empty());
        // A long message cannot be replaced: only its head was seen.
        let (end, out, _) = pump_limited(msg(b'B', &[&b"\0bad\0"[..], &[0u8; 100]].concat())).await;
        assert!(
            matches!(&end, End::Protocol(e) if e.contains("too long")),
            "{end:?}"
        );
        assert!(out.is_empty());
    }

    #[tokio::test]
    async fn bad_length_is_a_protocol_error() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&[b'Q', 0, 0, 0, 1]).await.unwrap();
        let mut sink = tokio::io::sink();
        let end = pump(
            &mut b,
            &mut sink,
            &mut Framing::default(),
            &Counter::default(),
            |_| true,
            |_, _| Verdict::Keep,
            BytesMut::new(),
            None,
        )
        .await;
        assert!(matches!(end, End::Protocol(_)));
    }
}
