//! Reads and writes on plain sockets through the kernel's `recvfrom` and
//! `sendto` directly, for the per-message path.
//!
//! glibc's `recv` and `send` are thread-cancellation points: every call
//! switches asynchronous cancellation on before the system call and off
//! after it, about 70 of the 120 instructions each call costs in user
//! space. The proxy makes four such calls per statement, and it never
//! cancels a thread, so the switching buys nothing. `syscall(2)` makes the
//! same system call without it. Readiness is kept exactly as tokio's own
//! `TcpStream` reads and writes keep it.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, RawFd};
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::Interest;

/// A tokio socket whose readiness pgwarden reads and clears itself.
pub(crate) trait Plain: AsRawFd {
    /// `try_io` of the tokio type: runs `f` if the recorded readiness
    /// allows, and clears the readiness when `f` says `WouldBlock`.
    fn try_io<R>(&self, interest: Interest, f: impl FnOnce() -> io::Result<R>) -> io::Result<R>;
    /// `poll_read_ready` of the tokio type.
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

macro_rules! plain {
    ($t:ty) => {
        impl Plain for $t {
            fn try_io<R>(
                &self,
                interest: Interest,
                f: impl FnOnce() -> io::Result<R>,
            ) -> io::Result<R> {
                <$t>::try_io(self, interest, f)
            }

            fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                <$t>::poll_read_ready(self, cx)
            }
        }
    };
}

plain!(tokio::net::TcpStream);
plain!(tokio::net::UnixStream);

fn result(r: libc::c_long) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

fn recv(fd: RawFd, buf: &mut [MaybeUninit<u8>]) -> io::Result<usize> {
    #[allow(unsafe_code)]
    // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`, which
    // is valid for writes of that length; the address arguments are null.
    let r = unsafe {
        libc::syscall(
            libc::SYS_recvfrom,
            fd,
            buf.as_mut_ptr(),
            buf.len(),
            0,
            std::ptr::null_mut::<libc::sockaddr>(),
            std::ptr::null_mut::<libc::socklen_t>(),
        )
    };
    result(r)
}

/// Looks at the next byte without taking it: 0 at the end of input.
fn peek_one(fd: RawFd) -> io::Result<usize> {
    let mut byte = 0u8;
    #[allow(unsafe_code)]
    // SAFETY: the kernel writes at most one byte into `byte`; the address
    // arguments are null.
    let r = unsafe {
        libc::syscall(
            libc::SYS_recvfrom,
            fd,
            std::ptr::addr_of_mut!(byte),
            1usize,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
            std::ptr::null_mut::<libc::sockaddr>(),
            std::ptr::null_mut::<libc::socklen_t>(),
        )
    };
    result(r)
}

/// Resolves once `s` shows the end of its input (the peer closed, or a
/// shutdown of the reading side) or fails, reading nothing. Bytes waiting
/// unread hide the end behind them: it then waits on, for good.
pub(crate) async fn closed<S: Plain>(s: &S) {
    let fd = s.as_raw_fd();
    loop {
        if std::future::poll_fn(|cx| s.poll_read_ready(cx))
            .await
            .is_err()
        {
            return;
        }
        match s.try_io(Interest::READABLE, || peek_one(fd)) {
            Ok(0) => return,
            Ok(_) => return std::future::pending().await,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(_) => return,
        }
    }
}

fn send(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    #[allow(unsafe_code)]
    // SAFETY: the kernel reads at most `buf.len()` bytes from `buf`; the
    // address arguments are null. MSG_NOSIGNAL, as the standard library's
    // `send` passes it: a closed peer is an EPIPE error, not a signal.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sendto,
            fd,
            buf.as_ptr(),
            buf.len(),
            libc::MSG_NOSIGNAL,
            std::ptr::null::<libc::sockaddr>(),
            0 as libc::socklen_t,
        )
    };
    result(r)
}

/// Whether the readiness the event loop recorded for `s` shows nothing to
/// read: no system call, no waker registered.
pub(crate) fn quiet<S: Plain>(s: &S) -> bool {
    not_ready(s.try_io(Interest::READABLE, || Ok(())))
}

/// Clears the read readiness recorded for `s`, as a read that found
/// nothing would.
fn clear_read_ready<S: Plain>(s: &S) {
    not_ready(s.try_io(Interest::READABLE, || {
        Err::<(), _>(io::ErrorKind::WouldBlock.into())
    }));
}

/// Whether a `try_io` whose closure fails with nothing but `WouldBlock`
/// found or left the socket not ready. The error that says so is tokio's,
/// built from an `ErrorKind`; it owns nothing, so it is forgotten rather
/// than dropped: dropping an `io::Error` is an out-of-line call, and the
/// session loop asks this several times per statement. An error that does
/// own something (none is expected) is dropped as usual.
#[inline(always)]
fn not_ready<T>(r: io::Result<T>) -> bool {
    match r {
        Ok(_) => false,
        Err(e) => {
            if e.get_ref().is_none() {
                std::mem::forget(e);
            }
            true
        }
    }
}

/// Writes what the socket takes now: `try_write` of the tokio types.
pub(crate) fn try_send<S: Plain>(s: &S, buf: &[u8]) -> io::Result<usize> {
    let fd = s.as_raw_fd();
    s.try_io(Interest::WRITABLE, || send(fd, buf))
}

/// Reads what is available into the spare capacity of `buf` (which the
/// caller made non-empty): `poll_read_buf` on the tokio types. As there, a
/// read that did not fill the space clears the socket's readiness, so the
/// next read waits for the event loop instead of asking the kernel only to
/// hear `EAGAIN`.
pub(crate) fn poll_recv<S: Plain>(
    s: &S,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    let fd = s.as_raw_fd();
    loop {
        std::task::ready!(s.poll_read_ready(cx))?;
        let spare = buf.spare_capacity_mut();
        let room = spare.len();
        if room == 0 {
            return Poll::Ready(Ok(0));
        }
        match s.try_io(Interest::READABLE, || recv(fd, spare)) {
            Ok(n) => {
                #[allow(unsafe_code)]
                // SAFETY: the kernel initialised the first `n` bytes of the
                // spare capacity.
                unsafe {
                    bytes::BufMut::advance_mut(buf, n)
                };
                if n > 0 && n < room {
                    clear_read_ready(s);
                }
                return Poll::Ready(Ok(n));
            }
            // Readiness without data: `try_io` cleared it; wait again.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = tokio::net::TcpStream::connect(l.local_addr().unwrap());
        let (a, b) = tokio::join!(a, l.accept());
        (a.unwrap(), b.unwrap().0)
    }

    #[tokio::test]
    async fn bytes_sent_arrive_and_a_short_read_waits_for_more() {
        let (mut a, b) = pair().await;
        a.write_all(b"hello").await.unwrap();
        let mut buf = BytesMut::with_capacity(64);
        let n = std::future::poll_fn(|cx| poll_recv(&b, cx, &mut buf))
            .await
            .unwrap();
        assert_eq!(&buf[..n], b"hello");
        // The short read cleared the readiness: the next read waits for the
        // event loop instead of asking the kernel.
        assert!(quiet(&b));
        a.write_all(b" world").await.unwrap();
        std::future::poll_fn(|cx| poll_recv(&b, cx, &mut buf))
            .await
            .unwrap();
        assert_eq!(&buf[..], b"hello world");

        let sent = loop {
            match try_send(&b, b"reply") {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => b.writable().await.unwrap(),
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(sent, 5);
        let mut got = [0u8; 5];
        a.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"reply");
    }

    #[tokio::test]
    async fn the_end_of_the_stream_and_errors_come_through() {
        let (a, b) = pair().await;
        drop(a);
        let mut buf = BytesMut::with_capacity(64);
        let n = std::future::poll_fn(|cx| poll_recv(&b, cx, &mut buf))
            .await
            .unwrap();
        assert_eq!(n, 0);
        // Writing to a closed peer fails (EPIPE or ECONNRESET), and raises
        // no SIGPIPE that would end the test process.
        let mut failed = false;
        for _ in 0..100 {
            match try_send(&b, &[0u8; 4096]) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => b.writable().await.unwrap(),
                Err(_) => {
                    failed = true;
                    break;
                }
                Ok(_) => tokio::task::yield_now().await,
            }
        }
        assert!(failed);
    }
}
