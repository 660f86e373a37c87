//! A fault-injecting TCP relay for integration tests.
//!
//! The kernels we test on have no `netem`, so network faults (latency,
//! partitions, resets, refused ports) are simulated by a userspace relay
//! placed between a client and a PostgreSQL or etcd node. Every connection
//! accepted on [`Relay::addr`] is forwarded to [`Relay::target`], and the
//! control methods change how bytes flow on existing and future connections
//! immediately.
//!
//! The relay owns a dedicated thread with its own single-threaded tokio
//! runtime, so it behaves the same whether the test is a plain `#[test]` or a
//! `#[tokio::test]`, and a blocked test runtime can never stall the relay.
//!
//! Per connection and direction, a reader stamps each chunk with
//! `read time + current delay` and queues it; a writer waits for the stamp and
//! for the partition to be lifted before writing. This keeps latency separate
//! from throughput and keeps chunks in order when the delay changes.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Matches the size of a large socket read so a bulk transfer is not split
/// into needlessly many chunks.
const CHUNK_SIZE: usize = 64 * 1024;

/// Bounds memory per direction; with 64 KiB chunks this is up to 16 MiB in
/// flight, enough that a 30 ms delay does not noticeably cap throughput.
const QUEUE_CHUNKS: usize = 256;

/// Back-off after a failed `accept` (e.g. EMFILE) so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// A TCP relay in front of one target address that can inject faults.
///
/// Dropping it stops the listener, closes every relayed connection and joins
/// the relay thread.
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Control state shared between the handle and the relay thread.
///
/// Values that tasks must react to while blocked live in `watch` channels so
/// a change wakes them at once instead of being noticed by polling.
#[derive(Debug)]
struct Shared {
    target: Mutex<SocketAddr>,
    /// (upstream, downstream) one-way latency.
    delay: Mutex<(Duration, Duration)>,
    blackhole: watch::Sender<bool>,
    /// New connections wait before connecting upstream.
    hold_new: watch::Sender<bool>,
    refuse: AtomicBool,
    /// What the relay's port does with new connections.
    listener: watch::Sender<Listener>,
    /// The state the port is in, once the relay thread has put it there,
    /// or why it could not.
    /// `None` while a change is under way.
    listener_applied: (Mutex<Option<Result<Listener, String>>>, std::sync::Condvar),
    /// Bumped by `reset_all`; each connection subscribes when accepted, so it
    /// only sees resets requested after it was counted.
    reset: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
    connections: AtomicUsize,
    accepted: AtomicUsize,
    /// Bytes read from clients and queued (stamped with their delay).
    queued_up: AtomicUsize,
}

/// Mutex poisoning cannot leave these plain values inconsistent, so a panic
/// elsewhere must not turn every later control call into a panic too.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Relay {
    /// Listens on 127.0.0.1:0 and forwards every accepted connection to
    /// `target`.
    pub fn start(target: SocketAddr) -> io::Result<Relay> {
        Relay::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), target)
    }

    /// Like [`Relay::start`] but listening on `listen` (the port may be 0).
    ///
    /// Errors binding the listener or building the runtime are returned here
    /// rather than surfacing later on the relay thread.
    pub fn start_on(listen: SocketAddr, target: SocketAddr) -> io::Result<Relay> {
        // Bind synchronously so the address is known and bind errors reach
        // the caller before any thread exists.
        let std_listener = std::net::TcpListener::bind(listen)?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;

        let shared = Arc::new(Shared {
            target: Mutex::new(target),
            delay: Mutex::new((Duration::ZERO, Duration::ZERO)),
            blackhole: watch::Sender::new(false),
            hold_new: watch::Sender::new(false),
            refuse: AtomicBool::new(false),
            listener: watch::Sender::new(Listener::Open),
            listener_applied: (
                Mutex::new(Some(Ok(Listener::Open))),
                std::sync::Condvar::new(),
            ),
            reset: watch::Sender::new(0),
            shutdown: watch::Sender::new(false),
            connections: AtomicUsize::new(0),
            accepted: AtomicUsize::new(0),
            queued_up: AtomicUsize::new(0),
        });

        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<()>>();
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("relay-{}", addr.port()))
            .spawn(move || {
                // The runtime is built and dropped on this thread only: dropping
                // a runtime inside the caller's async context would panic.
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let listener = {
                    let _guard = runtime.enter();
                    match TcpListener::from_std(std_listener) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    }
                };
                let _ = ready_tx.send(Ok(()));
                runtime.block_on(listen_loop(listener, addr, thread_shared));
                // Dropping the runtime here cancels every connection task,
                // which closes all relayed sockets.
            })?;

        let ready = ready_rx
            .recv()
            .unwrap_or_else(|_| Err(io::Error::other("relay thread exited before starting")));
        if let Err(e) = ready {
            let _ = thread.join();
            return Err(e);
        }
        Ok(Relay {
            addr,
            shared,
            thread: Some(thread),
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where new connections are forwarded.
    pub fn target(&self) -> SocketAddr {
        *lock(&self.shared.target)
    }

    /// Points new connections at `target`; existing connections stay with
    /// the node they were opened to, as they would after a real failover.
    pub fn set_target(&self, target: SocketAddr) {
        *lock(&self.shared.target) = target;
    }

    /// Adds one-way latency to client→server (`upstream`) and server→client
    /// (`downstream`) bytes.
    ///
    /// This is latency, not a throughput limit: each chunk is delivered
    /// `delay` after it was read, and chunks stay in order even when the delay
    /// shrinks. The change applies to bytes read from now on, including on
    /// existing connections.
    pub fn set_delay(&self, upstream: Duration, downstream: Duration) {
        *lock(&self.shared.delay) = (upstream, downstream);
    }

    /// Simulates a network partition.
    ///
    /// While on, no byte flows in either direction on existing connections,
    /// and new connections complete their handshake with the relay but are
    /// not connected upstream. Nothing is closed, and the relay does not even
    /// read, so neither peer can notice the other closing. Turning it off lets
    /// held bytes flow again (as TCP retransmission would) and lets held
    /// connections connect upstream.
    pub fn set_blackhole(&self, on: bool) {
        self.shared.blackhole.send_replace(on);
    }

    /// While on, new connections are accepted but not connected upstream
    /// (their bytes wait in the relay); existing connections flow as
    /// usual. Turning it off connects the held ones. Models a peer that is
    /// slow to accept, such as a busy postmaster.
    pub fn set_hold_new(&self, on: bool) {
        self.shared.hold_new.send_replace(on);
    }

    /// Resets every current connection: both the client and the server get an
    /// RST (not a FIN), as after a crashed peer or a middlebox dropping state.
    ///
    /// Connections still in the listen backlog (not yet counted by
    /// [`Relay::connections`]) are not affected.
    pub fn reset_all(&self) {
        self.shared.reset.send_modify(|generation| *generation += 1);
    }

    /// While on, new connections are accepted and immediately reset, like a
    /// refused or filtered port; existing connections continue.
    pub fn set_refuse(&self, on: bool) {
        self.shared.refuse.store(on, Ordering::SeqCst);
    }

    /// Changes what the relay's port does with new connections, without
    /// touching the connections it relays: [`Listener::Closed`] refuses
    /// them at the TCP level (nothing listens), [`Listener::Unanswered`]
    /// lets their connect hang (a full accept queue drops their SYNs, as
    /// a host that stopped answering would).
    ///
    /// Returns once the port is in that state; panics if the relay could
    /// not put it there (within ten seconds).
    pub fn set_listener(&self, state: Listener) {
        let (applied, changed) = &self.shared.listener_applied;
        let mut now = lock(applied);
        // Asked under the lock, so the answer cannot come before the wait.
        // The same state again changes nothing (and is no new request).
        let asked = self.shared.listener.send_if_modified(|s| {
            let new = *s != state;
            *s = state;
            new
        });
        if asked {
            *now = None;
        }
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match &*now {
                Some(Ok(s)) if *s == state => return,
                Some(Err(e)) => panic!("relay {}: {e}", self.addr),
                _ => {}
            }
            let left = give_up.saturating_duration_since(std::time::Instant::now());
            assert!(
                !left.is_zero(),
                "relay {}: the port did not become {state:?}",
                self.addr
            );
            now = changed
                .wait_timeout(now, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Number of client connections currently held by the relay, including
    /// those waiting for a partition to be lifted before connecting upstream.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Number of connections accepted since the relay started, those
    /// reset at once ([`Relay::set_refuse`]) included: how often a client
    /// tried to connect.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Bytes read from clients so far, each already stamped with the
    /// upstream delay in force when it was read: a test that changes the
    /// delay can first wait for the bytes it sent to be counted here.
    pub fn queued_upstream(&self) -> usize {
        self.shared.queued_up.load(Ordering::SeqCst)
    }
}

impl fmt::Debug for Relay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("addr", &self.addr)
            .field("target", &self.target())
            .field("connections", &self.connections())
            .finish_non_exhaustive()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::debug!(addr = %self.addr, "relay thread panicked");
            }
        }
    }
}

/// What the relay's port does with new connections
/// ([`Relay::set_listener`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// Accepted and relayed (subject to the other faults).
    Open,
    /// Refused: nothing listens on the port, so a connect gets an RST.
    Closed,
    /// Never answered: the port listens with a full accept queue, so the
    /// kernel drops a connect's SYN and the connect waits.
    Unanswered,
}

/// Accepts on `listener` while the port is open; otherwise closes it and
/// holds the port as asked, then listens on `addr` again.
async fn listen_loop(listener: TcpListener, addr: SocketAddr, shared: Arc<Shared>) {
    let mut state = shared.listener.subscribe();
    let mut shutdown = shared.shutdown.subscribe();
    let mut listener = Some(listener);
    loop {
        let now = *state.borrow_and_update();
        if now == Listener::Open {
            let bound = match listener.take() {
                Some(l) => Ok(l),
                None => listen_again(addr).await,
            };
            match bound {
                Ok(l) => {
                    applied(&shared, Ok(now));
                    tokio::select! {
                        () = accept_loop(l, Arc::clone(&shared)) => return,
                        _ = state.changed() => continue,
                    }
                }
                // Reported to the test; the relayed connections go on.
                Err(e) => applied(&shared, Err(format!("cannot listen on {addr} again: {e}"))),
            }
        } else {
            listener = None;
            // Held for as long as the port must not answer.
            let held = if now == Listener::Unanswered {
                unanswered(addr).await.map(Some)
            } else {
                Ok(None)
            };
            match held {
                Ok(held) => {
                    applied(&shared, Ok(now));
                    tokio::select! {
                        _ = state.changed() => {}
                        () = until(&mut shutdown, true) => return,
                    }
                    drop(held);
                    continue;
                }
                Err(e) => applied(
                    &shared,
                    Err(format!("cannot fill the accept queue of {addr}: {e}")),
                ),
            }
        }
        tokio::select! {
            _ = state.changed() => {}
            () = until(&mut shutdown, true) => return,
        }
    }
}

/// Listens on `addr` once more. While the port was closed, another socket
/// may have taken it for a moment (an outgoing connection's local port):
/// tried for a few seconds.
async fn listen_again(addr: SocketAddr) -> io::Result<TcpListener> {
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) if Instant::now() >= give_up => return Err(e),
            Err(_) => tokio::time::sleep(ACCEPT_BACKOFF).await,
        }
    }
}

/// Tells [`Relay::set_listener`] what became of the state it asked for.
fn applied(shared: &Shared, outcome: Result<Listener, String>) {
    let (applied, changed) = &shared.listener_applied;
    *lock(applied) = Some(outcome);
    changed.notify_all();
}

/// A listener on `addr` whose accept queue is full, and what fills it: a
/// backlog of none, its one queue place taken by a connection nobody
/// accepts. (A connect that lands between the two is queued instead of
/// left unanswered; nothing connects to the port in that instant in the
/// tests.)
async fn unanswered(addr: SocketAddr) -> io::Result<(tokio::net::TcpListener, Vec<TcpStream>)> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    let listener = socket.listen(0)?;
    let mut fillers = Vec::new();
    // Linux queues backlog + 1 connections; a spare one makes sure.
    for _ in 0..2 {
        match tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await {
            Ok(Ok(s)) => fillers.push(s),
            Ok(Err(e)) => return Err(e),
            Err(_) => break,
        }
    }
    if fillers.is_empty() {
        return Err(io::Error::other("no connection could fill the queue"));
    }
    Ok((listener, fillers))
}

/// Which way bytes flow, to pick the matching delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Upstream,
    Downstream,
}

/// A chunk read from one side, due to be written to the other at `due`.
/// `data == None` marks EOF, so the half-close is delayed like the data
/// before it.
struct Chunk {
    due: Instant,
    data: Option<Vec<u8>>,
}

/// Decrements the connection count however the connection task ends,
/// including cancellation when the runtime shuts down.
struct ConnGuard(Arc<Shared>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits until the watched flag equals `want`.
///
/// Returns `()` rather than the `watch::Ref`, which must not be held across
/// an await. If the sender is gone the relay is shutting down, so waiting
/// forever is right: the task is about to be cancelled.
async fn until(rx: &mut watch::Receiver<bool>, want: bool) {
    if rx.wait_for(|v| *v == want).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Sends an RST instead of a FIN when `stream` is dropped.
fn abort(stream: TcpStream) {
    if let Err(e) = stream.set_zero_linger() {
        tracing::debug!(error = %e, "relay: setting SO_LINGER 0 failed");
    }
    drop(stream);
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut shutdown = shared.shutdown.subscribe();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = until(&mut shutdown, true) => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                if shared.refuse.load(Ordering::SeqCst) {
                    tracing::debug!(%peer, "relay: refusing connection");
                    abort(stream);
                    continue;
                }
                // Subscribe before counting, so any reset_all issued after
                // `connections()` includes this one also reaches it.
                let reset = shared.reset.subscribe();
                shared.connections.fetch_add(1, Ordering::SeqCst);
                let guard = ConnGuard(Arc::clone(&shared));
                tokio::spawn(serve(stream, peer, reset, guard));
            }
            Err(e) => {
                tracing::debug!(error = %e, "relay: accept failed");
                tokio::select! {
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    () = until(&mut shutdown, true) => return,
                }
            }
        }
    }
}

/// Runs one relayed connection until both directions finish, either side
/// fails, or `reset_all` is called.
async fn serve(
    mut client: TcpStream,
    peer: SocketAddr,
    mut reset: watch::Receiver<u64>,
    guard: ConnGuard,
) {
    let shared = Arc::clone(&guard.0);
    let mut server: Option<TcpStream> = None;
    let outcome = tokio::select! {
        r = relay(&mut client, &mut server, &shared) => r,
        () = async {
            if reset.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        } => Err(io::Error::new(io::ErrorKind::ConnectionReset, "reset_all")),
    };
    match outcome {
        Ok(()) => {
            tracing::debug!(%peer, "relay: connection finished");
        }
        Err(e) => {
            // A failure on one side is passed on as an RST to the other, the
            // way the failure would have surfaced without the relay.
            tracing::debug!(%peer, error = %e, "relay: closing connection with reset");
            abort(client);
            if let Some(server) = server {
                abort(server);
            }
        }
    }
    drop(guard);
}

/// Connects upstream (once no partition is in force) and pumps both
/// directions. `server` is an out-parameter so the caller can reset it when
/// this future is cancelled.
async fn relay(
    client: &mut TcpStream,
    server: &mut Option<TcpStream>,
    shared: &Shared,
) -> io::Result<()> {
    let mut blackhole = shared.blackhole.subscribe();
    until(&mut shared.hold_new.subscribe(), false).await;
    until(&mut blackhole, false).await;
    let target = *lock(&shared.target);
    let server = server.insert(TcpStream::connect(target).await?);
    // The relay must not add Nagle delays on top of the configured latency.
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;

    let (client_read, client_write) = client.split();
    let (server_read, server_write) = server.split();
    let (up_tx, up_rx) = mpsc::channel(QUEUE_CHUNKS);
    let (down_tx, down_rx) = mpsc::channel(QUEUE_CHUNKS);
    tokio::try_join!(
        pump_read(
            client_read,
            up_tx,
            Direction::Upstream,
            shared,
            blackhole.clone()
        ),
        pump_write(server_write, up_rx, blackhole.clone()),
        pump_read(
            server_read,
            down_tx,
            Direction::Downstream,
            shared,
            blackhole.clone()
        ),
        pump_write(client_write, down_rx, blackhole),
    )?;
    Ok(())
}

/// Reads chunks from one side and queues them stamped with their due time.
async fn pump_read(
    mut from: ReadHalf<'_>,
    queue: mpsc::Sender<Chunk>,
    direction: Direction,
    shared: &Shared,
    mut blackhole: watch::Receiver<bool>,
) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK_SIZE];
    loop {
        // Not reading during a partition keeps EOFs and errors from the peer
        // hidden until it heals, as with a real partition.
        until(&mut blackhole, false).await;
        let n = tokio::select! {
            r = from.read(&mut buf) => r?,
            // `read` is cancel-safe: nothing is lost by abandoning it.
            () = until(&mut blackhole, true) => continue,
        };
        let (up, down) = *lock(&shared.delay);
        let delay = match direction {
            Direction::Upstream => up,
            Direction::Downstream => down,
        };
        let chunk = Chunk {
            due: Instant::now() + delay,
            data: (n > 0).then(|| buf[..n].to_vec()),
        };
        if direction == Direction::Upstream {
            shared.queued_up.fetch_add(n, Ordering::SeqCst);
        }
        if queue.send(chunk).await.is_err() || n == 0 {
            // Either EOF was queued, or the writer has stopped and its error
            // (if any) ends the connection.
            return Ok(());
        }
    }
}

/// Writes queued chunks to the other side once due and not partitioned, then
/// propagates EOF as a half-close.
async fn pump_write(
    mut to: WriteHalf<'_>,
    mut queue: mpsc::Receiver<Chunk>,
    mut blackhole: watch::Receiver<bool>,
) -> io::Result<()> {
    while let Some(chunk) = queue.recv().await {
        tokio::time::sleep_until(chunk.due).await;
        let Some(data) = chunk.data else {
            until(&mut blackhole, false).await;
            to.shutdown().await?;
            return Ok(());
        };
        let mut written = 0;
        while written < data.len() {
            until(&mut blackhole, false).await;
            tokio::select! {
                // `write` is cancel-safe (unlike `write_all`), so a partition
                // starting mid-chunk stops it without losing track of progress.
                r = to.write(&data[written..]) => {
                    let n = r?;
                    if n == 0 {
                        return Err(io::ErrorKind::WriteZero.into());
                    }
                    written += n;
                }
                () = until(&mut blackhole, true) => {}
            }
        }
    }
    // The reader stopped without queuing EOF, meaning it failed; its error
    // is what try_join reports.
    Ok(())
}
