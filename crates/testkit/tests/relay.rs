//! Tests for the fault-injecting TCP relay.
//!
//! Every test runs its own echo server(s) on 127.0.0.1:0. Waiting is done on
//! conditions with timeouts, never on fixed sleeps.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden_testkit::Relay;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::timeout;

/// Generous bound for things that should happen "promptly" on a loaded CI box.
const PROMPT: Duration = Duration::from_secs(10);

/// How long a blackhole must visibly hold bytes.
const HOLD: Duration = Duration::from_millis(300);

/// An echo server that counts the connections it accepted.
struct Echo {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Echo {
    async fn start() -> Echo {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.split();
                    if tokio::io::copy(&mut r, &mut w).await.is_ok() {
                        let _ = w.shutdown().await;
                    }
                });
            }
        });
        Echo {
            addr,
            accepted,
            task,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn connect(relay: &Relay) -> TcpStream {
    let stream = timeout(PROMPT, TcpStream::connect(relay.addr()))
        .await
        .expect("connect timed out")
        .expect("connect failed");
    stream.set_nodelay(true).unwrap();
    stream
}

/// Sends `msg` and waits (bounded) for the same bytes to come back.
async fn round_trip(stream: &mut TcpStream, msg: &[u8]) {
    stream.write_all(msg).await.unwrap();
    let mut buf = vec![0u8; msg.len()];
    timeout(PROMPT, stream.read_exact(&mut buf))
        .await
        .expect("echo timed out")
        .expect("echo read failed");
    assert_eq!(buf, msg);
}

/// Polls a relay/server counter; these are plain numbers with no way to
/// await a change, so a bounded poll is the only option.
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PROMPT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Asserts nothing arrives within `wait`. Uses `read`, which is cancel-safe,
/// so a timeout consumes nothing.
async fn assert_silent(stream: &mut TcpStream, wait: Duration, what: &str) {
    let mut buf = [0u8; 64];
    let r = timeout(wait, stream.read(&mut buf)).await;
    assert!(r.is_err(), "{what}: {r:?}");
}

/// Asserts a new connection through `relay` is closed on arrival.
///
/// The kernel completes the handshake before the relay sees the connection,
/// and the reset can land before or after `connect` returns, so it may show
/// up on connect or on the first read. A FIN is tolerated too: either way the
/// client learns at once that nobody is there.
async fn assert_turned_away(relay: &Relay) {
    let connected = timeout(PROMPT, TcpStream::connect(relay.addr()))
        .await
        .expect("connect timed out");
    let result = match connected {
        Ok(mut stream) => read_closed(&mut stream).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(n) => assert_eq!(n, 0, "turned-away connection returned data"),
        Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
    }
}

/// Reads once, expecting the connection to have been closed.
async fn read_closed(stream: &mut TcpStream) -> io::Result<usize> {
    let mut buf = [0u8; 64];
    timeout(PROMPT, stream.read(&mut buf))
        .await
        .expect("read on closed connection timed out")
}

#[tokio::test]
async fn bytes_pass_through_and_eof_propagates() {
    let echo = Echo::start().await;
    let relay = Relay::start(echo.addr).unwrap();
    assert_eq!(relay.target(), echo.addr);
    assert!(relay.addr().ip().is_loopback());

    let mut stream = connect(&relay).await;
    round_trip(&mut stream, b"hello").await;
    wait_until("connection count", || relay.connections() == 1).await;

    // 4 MiB with a non-repeating-at-64KiB pattern, so reordered or dropped
    // chunks would be detected.
    let payload: Vec<u8> = (0..4 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let (mut r, mut w) = stream.split();
    let send = async {
        w.write_all(&payload).await.unwrap();
        // Half-close: the echo server sees EOF only if the relay forwards it,
        // and closes back only after echoing everything.
        w.shutdown().await.unwrap();
    };
    let recv = async {
        let mut got = Vec::with_capacity(payload.len());
        r.read_to_end(&mut got).await.unwrap();
        got
    };
    let ((), got) = timeout(PROMPT, async { tokio::join!(send, recv) })
        .await
        .expect("4 MiB echo timed out");
    assert_eq!(got.len(), payload.len());
    assert!(got == payload, "payload corrupted in transit");

    drop(stream);
    wait_until("connection to be released", || relay.connections() == 0).await;
}

#[tokio::test]
async fn delay_adds_latency_both_ways_and_can_be_removed() {
    let echo = Echo::start().await;
    let relay = Relay::start(echo.addr).unwrap();
    let mut stream = connect(&relay).await;
    round_trip(&mut stream, b"warm-up").await;

    relay.set_delay(Duration::from_millis(30), Duration::from_millis(30));
    for _ in 0..3 {
        let start = Instant::now();
        round_trip(&mut stream, b"x").await;
        let rtt = start.elapsed();
        assert!(rtt >= Duration::from_millis(60), "rtt {rtt:?} < 60ms");
    }

    relay.set_delay(Duration::ZERO, Duration::ZERO);
    // Scheduling noise can inflate a single sample, never shrink it; the best
    // of a few is what reflects the relay.
    let mut best = Duration::MAX;
    for _ in 0..20 {
        let start = Instant::now();
        round_trip(&mut stream, b"y").await;
        best = best.min(start.elapsed());
    }
    assert!(best < Duration::from_millis(30), "best rtt {best:?}");
}

#[tokio::test]
async fn shrinking_delay_keeps_bytes_in_order() {
    let echo = Echo::start().await;
    let relay = Relay::start(echo.addr).unwrap();
    let mut stream = connect(&relay).await;
    round_trip(&mut stream, b"warm-up").await;

    relay.set_delay(Duration::from_millis(100), Duration::ZERO);
    let start = Instant::now();
    let before = relay.queued_upstream();
    stream.write_all(b"first-").await.unwrap();
    // The relay (on its own thread) has stamped "first-" with the long
    // delay before the delay shrinks.
    let deadline = Instant::now() + PROMPT;
    while relay.queued_upstream() < before + 6 {
        assert!(Instant::now() < deadline, "the relay never read the bytes");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    relay.set_delay(Duration::ZERO, Duration::ZERO);
    stream.write_all(b"second").await.unwrap();

    let mut buf = [0u8; 12];
    timeout(PROMPT, stream.read_exact(&mut buf))
        .await
        .expect("echo timed out")
        .unwrap();
    assert!(start.elapsed() >= Duration::from_millis(100));
    assert_eq!(&buf, b"first-second");
}

#[tokio::test]
async fn blackhole_holds_bytes_and_new_connections_until_lifted() {
    let echo = Echo::start().await;
    let relay = Relay::start(echo.addr).unwrap();
    let mut old = connect(&relay).await;
    round_trip(&mut old, b"before").await;
    assert_eq!(echo.accepted(), 1);

    relay.set_blackhole(true);
    old.write_all(b"held").await.unwrap();
    assert_silent(&mut old, HOLD, "echo crossed the blackhole").await;

    // The handshake with the relay completes, but nothing goes upstream.
    let mut new = connect(&relay).await;
    new.write_all(b"new!").await.unwrap();
    assert_silent(&mut new, HOLD, "new connection got through the blackhole").await;
    assert_eq!(
        echo.accepted(),
        1,
        "relay connected upstream while blackholed"
    );
    wait_until("both connections held", || relay.connections() == 2).await;

    relay.set_blackhole(false);
    let mut buf = [0u8; 4];
    timeout(PROMPT, old.read_exact(&mut buf))
        .await
        .expect("held bytes never arrived")
        .unwrap();
    assert_eq!(&buf, b"held");
    timeout(PROMPT, new.read_exact(&mut buf))
        .await
        .expect("held connection never connected")
        .unwrap();
    assert_eq!(&buf, b"new!");
    assert_eq!(echo.accepted(), 2);
    round_trip(&mut old, b"after").await;
    round_trip(&mut new, b"after").await;
}

#[tokio::test]
async fn reset_all_sends_rst_to_both_sides() {
    // A one-shot server that reports how its side of the connection ended.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server_addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 64];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => return Ok::<_, io::Error>(()),
                Ok(n) => stream.write_all(&buf[..n]).await?,
                Err(e) => return Err(e),
            }
        }
    });

    let relay = Relay::start(server_addr).unwrap();
    let mut stream = connect(&relay).await;
    round_trip(&mut stream, b"hello").await;

    relay.reset_all();
    let err = read_closed(&mut stream)
        .await
        .expect_err("client saw a clean close, not a reset");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);

    let server_end = timeout(PROMPT, server)
        .await
        .expect("server never saw the reset")
        .unwrap();
    assert_eq!(
        server_end.expect_err("server saw a clean close").kind(),
        io::ErrorKind::ConnectionReset
    );
    wait_until("connection to be released", || relay.connections() == 0).await;
}

#[tokio::test]
async fn refuse_resets_new_connections_but_keeps_existing_ones() {
    let echo = Echo::start().await;
    let relay = Relay::start(echo.addr).unwrap();
    let mut old = connect(&relay).await;
    round_trip(&mut old, b"before").await;

    relay.set_refuse(true);
    assert_turned_away(&relay).await;
    round_trip(&mut old, b"still-alive").await;
    assert_eq!(echo.accepted(), 1);

    relay.set_refuse(false);
    let mut new = connect(&relay).await;
    round_trip(&mut new, b"accepted-again").await;
}

#[tokio::test]
async fn set_target_moves_new_connections_only() {
    let first = Echo::start().await;
    let second = Echo::start().await;
    let relay = Relay::start(first.addr).unwrap();
    let mut old = connect(&relay).await;
    round_trip(&mut old, b"one").await;

    relay.set_target(second.addr);
    assert_eq!(relay.target(), second.addr);
    let mut new = connect(&relay).await;
    round_trip(&mut new, b"two").await;
    assert_eq!(first.accepted(), 1);
    assert_eq!(second.accepted(), 1);

    // The old connection stays on the first node.
    round_trip(&mut old, b"still-one").await;
    assert_eq!(first.accepted(), 1);
}

#[tokio::test]
async fn unreachable_target_resets_the_client() {
    // Bind then drop to get a port with (very likely) nothing listening.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let relay = Relay::start(dead).unwrap();
    assert_turned_away(&relay).await;
    wait_until("connection to be released", || relay.connections() == 0).await;
}

#[tokio::test]
async fn start_on_listens_on_the_given_address() {
    let echo = Echo::start().await;
    let listen: SocketAddr = "127.0.0.2:0".parse().unwrap();
    let relay = Relay::start_on(listen, echo.addr).unwrap();
    assert_eq!(relay.addr().ip(), listen.ip());
    assert_ne!(relay.addr().port(), 0);
    let mut stream = connect(&relay).await;
    round_trip(&mut stream, b"hi").await;

    // A taken address is reported synchronously.
    assert!(Relay::start_on(relay.addr(), echo.addr).is_err());
}

#[tokio::test]
async fn drop_closes_connections_and_joins_thread() {
    let echo = Echo::start().await;
    let relay = Relay::start(echo.addr).unwrap();
    let addr = relay.addr();
    let mut stream = connect(&relay).await;
    round_trip(&mut stream, b"hello").await;
    // Also a connection parked behind a partition must be closed.
    relay.set_blackhole(true);
    let mut parked = connect(&relay).await;
    wait_until("both connections held", || relay.connections() == 2).await;

    // Drop joins the relay thread; run it off the runtime so a hang fails the
    // test instead of wedging it.
    let dropped = tokio::task::spawn_blocking(move || drop(relay));
    timeout(PROMPT, dropped)
        .await
        .expect("Relay::drop did not return (thread not joined)")
        .unwrap();

    // EOF or an error are both a close.
    let _ = read_closed(&mut stream).await;
    let _ = read_closed(&mut parked).await;
    let err = TcpStream::connect(addr)
        .await
        .expect_err("listener still open after drop");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
}

/// The relay needs no runtime from the caller: it works from a plain test
/// with blocking sockets.
#[test]
fn works_without_a_caller_runtime() {
    use std::io::{Read, Write};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let server_addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    });

    let relay = Relay::start(server_addr).unwrap();
    let mut stream = std::net::TcpStream::connect(relay.addr()).unwrap();
    stream.set_read_timeout(Some(PROMPT)).unwrap();
    stream.write_all(b"sync").unwrap();
    let mut buf = [0u8; 4];
    stream.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"sync");

    drop(relay);
    let mut rest = [0u8; 4];
    // EOF or an error are both a close; a timeout would mean it stayed open.
    if let Err(e) = stream.read(&mut rest) {
        assert!(
            !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            "connection stayed open after drop"
        );
    }
    drop(stream);
    server.join().unwrap();
}

#[tokio::test]
async fn a_closed_or_unanswered_port_keeps_existing_connections() {
    use pgwarden_testkit::Listener;
    let echo = Echo::start().await;
    let relay = Relay::start(echo.addr).unwrap();
    let mut kept = connect(&relay).await;
    round_trip(&mut kept, b"before").await;

    relay.set_listener(Listener::Closed);
    let refused = TcpStream::connect(relay.addr()).await.unwrap_err();
    assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);
    round_trip(&mut kept, b"while closed").await;

    relay.set_listener(Listener::Unanswered);
    assert!(
        timeout(HOLD, TcpStream::connect(relay.addr()))
            .await
            .is_err(),
        "a connect completed"
    );
    round_trip(&mut kept, b"while unanswered").await;

    relay.set_listener(Listener::Open);
    let accepted = echo.accepted();
    let mut fresh = connect(&relay).await;
    round_trip(&mut fresh, b"after").await;
    assert_eq!(echo.accepted(), accepted + 1);
    round_trip(&mut kept, b"still").await;
}
