//! The traffic engine: a fixed set of worker threads, each running its own
//! single-threaded event loop, among which client connections are shared
//! out.
//!
//! A work-stealing runtime moves a session between threads whenever one
//! is idle, and wakes idle threads to look for work: on a machine that
//! PostgreSQL and its clients keep busy, those cross-thread wake-ups cost
//! more CPU than relaying the bytes (measured in docs/benchmarks.md). Here
//! a session lives on the worker that accepted it, with its sockets
//! registered in that worker's own epoll, so a message in and a message
//! out take no other thread's time. Server connections shared through a
//! pool move to the worker that borrows them (see `pool`), for the same
//! reason.
//!
//! The listeners, the HTTP port, the topology engine and configuration
//! reloads stay on the control runtime that started the proxy: routing
//! updates never queue behind traffic, nor traffic behind them.
//!
//! New clients fill one worker before the next is used ([`Workers::pick`]):
//! the machine is usually shared with PostgreSQL and the clients, and one
//! event loop with sixteen sessions finds several of them ready at each
//! wake-up, where two loops with eight each sleep and wake about twice as
//! often for the same traffic (measured in docs/benchmarks.md).

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(NONE) };
}

/// Period of the timer thread's tick (see `start_timer_thread`).
const TICK: std::time::Duration = std::time::Duration::from_secs(1);

/// The "worker" of any thread that is not one.
pub const NONE: usize = usize::MAX;

/// The worker this thread is, or [`NONE`].
pub fn current() -> usize {
    CURRENT.with(|c| c.get())
}

/// The worker threads.
#[derive(Debug)]
pub struct Workers {
    handles: Vec<Handle>,
    next: AtomicUsize,
    /// Clients placed on each worker and still connected.
    clients: Vec<AtomicUsize>,
    /// See [`Workers::pick`].
    fill: usize,
    /// Dropping a sender ends its worker: its runtime, with every session
    /// still on it, is dropped.
    stop: Mutex<Vec<oneshot::Sender<()>>>,
}

impl Workers {
    /// Starts `n` workers (at least one) that take `fill` clients each
    /// before the next one is used (0: in turn).
    pub fn start(n: usize, fill: usize) -> io::Result<Workers> {
        let n = n.max(1);
        let timers = start_timer_thread()?;
        let mut handles = Vec::with_capacity(n);
        let mut stop = Vec::with_capacity(n);
        for id in 0..n {
            // No timer driver (see `crate::timer`).
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()?;
            let (tx, rx) = oneshot::channel::<()>();
            handles.push(runtime.handle().clone());
            stop.push(tx);
            let (timer_handle, alive) = (timers.handle.clone(), timers.alive.clone());
            std::thread::Builder::new()
                .name(format!("pgwarden-worker-{id}"))
                .spawn(move || {
                    CURRENT.with(|c| c.set(id));
                    crate::timer::use_driver_of(timer_handle);
                    crate::alloc::keep_freed_blocks();
                    // Ends when the sender is dropped; the runtime and its
                    // tasks go with the thread.
                    runtime.block_on(async {
                        let _ = rx.await;
                    });
                    drop(runtime);
                    // Only now may the timer thread end: a task polling a
                    // timer whose driver is gone would panic.
                    drop(alive);
                })?;
        }
        Ok(Workers {
            clients: (0..handles.len()).map(|_| AtomicUsize::new(0)).collect(),
            fill,
            handles,
            next: AtomicUsize::new(0),
            stop: Mutex::new(stop),
        })
    }

    /// The worker for a new client: the first with fewer than `fill`
    /// clients, else the one with the fewest; in turn when `fill` is 0.
    pub fn pick(&self) -> usize {
        if self.fill == 0 {
            return self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        }
        let counts = self.clients.iter().map(|c| c.load(Ordering::Relaxed));
        pick_filling(counts, self.fill)
    }

    /// Whether [`Workers::pick`] fills workers one after the other (rather
    /// than sharing clients out in turn).
    pub fn fills(&self) -> bool {
        self.fill > 0
    }

    /// Whether worker `i` is the one being filled: it holds no more than
    /// `fill` clients, counting one just placed there.
    pub fn filling(&self, i: usize) -> bool {
        self.clients
            .get(i)
            .is_some_and(|c| c.load(Ordering::Relaxed) <= self.fill)
    }

    /// Clients counted on each worker, in worker order.
    pub fn client_counts(&self) -> impl Iterator<Item = usize> + '_ {
        self.clients.iter().map(|c| c.load(Ordering::Relaxed))
    }

    /// Counts a client on worker `i` until [`Workers::leave`].
    pub fn enter(&self, i: usize) {
        if let Some(c) = self.clients.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A client counted by [`Workers::enter`] is gone.
    pub fn leave(&self, i: usize) {
        if let Some(c) = self.clients.get(i) {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Runs `task` on worker `i` (modulo their number).
    pub fn spawn_on<F>(&self, i: usize, task: F) -> tokio::task::JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.handles[i % self.handles.len()].spawn(task)
    }

    /// The worker for the pooled clients of one service, database and
    /// user: the same for all of them, so that their pool's connections
    /// stay on one thread.
    pub fn pool_home(&self, service: &str, database: &str, user: &str) -> usize {
        use std::hash::BuildHasher;
        let h = foldhash::fast::FixedState::default().hash_one((service, database, user));
        (h % self.handles.len() as u64) as usize
    }

    /// Ends every worker and drops what runs on it. Idempotent.
    pub fn stop(&self) {
        self.stop.lock().expect("poisoned").clear();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread whose runtime drives the workers' timers.
struct TimerThread {
    handle: Handle,
    /// Held by every worker thread; the timer thread ends when the last
    /// one is dropped.
    alive: tokio::sync::mpsc::Sender<()>,
}

fn start_timer_thread() -> io::Result<TimerThread> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let handle = runtime.handle().clone();
    let (alive, mut gone) = tokio::sync::mpsc::channel::<()>(1);
    std::thread::Builder::new()
        .name("pgwarden-timers".into())
        .spawn(move || {
            runtime.block_on(async {
                // A timer that always expires within a second: a worker's
                // new time-out (every client's start-up deadline, every
                // wait for a server) then falls after this thread's next
                // wake-up, and arming it does not have to wake this
                // thread early (a futex call from the arming worker).
                let tick = tokio::spawn(async {
                    let mut t = crate::timer::interval(TICK);
                    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        t.tick().await;
                    }
                });
                let _ = gone.recv().await;
                tick.abort();
            });
        })?;
    Ok(TimerThread { handle, alive })
}

/// The first worker with fewer than `fill` clients, else the least busy
/// (the first of equals).
fn pick_filling(counts: impl Iterator<Item = usize>, fill: usize) -> usize {
    let mut least = (usize::MAX, 0);
    for (i, n) in counts.enumerate() {
        if n < fill {
            return i;
        }
        if n < least.0 {
            least = (n, i);
        }
    }
    least.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn clients_fill_one_worker_then_the_next_then_the_least_busy() {
        assert_eq!(pick_filling([0, 0].into_iter(), 2), 0);
        assert_eq!(pick_filling([1, 0].into_iter(), 2), 0);
        assert_eq!(pick_filling([2, 0].into_iter(), 2), 1);
        assert_eq!(pick_filling([2, 1, 0].into_iter(), 2), 1);
        assert_eq!(pick_filling([3, 2].into_iter(), 2), 1);
        assert_eq!(pick_filling([2, 2].into_iter(), 2), 0);
        // A worker that emptied is filled again first.
        assert_eq!(pick_filling([5, 0, 9].into_iter(), 4), 1);
    }

    #[test]
    fn counted_clients_steer_the_pick() {
        let workers = Workers::start(2, 2).unwrap();
        assert!(workers.fills());
        let a = workers.pick();
        workers.enter(a);
        let b = workers.pick();
        workers.enter(b);
        let c = workers.pick();
        workers.enter(c);
        assert_eq!((a, b, c), (0, 0, 1));
        workers.leave(a);
        assert_eq!(workers.pick(), 0, "a freed place on the first worker");
        let in_turn = Workers::start(2, 0).unwrap();
        assert!(!in_turn.fills());
        let picks: Vec<_> = (0..4).map(|_| in_turn.pick()).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
    }

    #[test]
    fn tasks_are_shared_out_round_robin_and_know_their_worker() {
        let workers = Workers::start(2, 0).unwrap();
        assert_eq!(current(), NONE);
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..4 {
            let tx = tx.clone();
            workers.spawn_on(workers.pick(), async move {
                tx.send((current(), std::thread::current().id())).unwrap();
            });
        }
        let seen: Vec<_> = (0..4).map(|_| rx.recv().unwrap()).collect();
        let ids: HashSet<usize> = seen.iter().map(|s| s.0).collect();
        assert_eq!(ids, HashSet::from([0, 1]));
        let threads: HashSet<_> = seen.iter().map(|s| s.1).collect();
        assert_eq!(threads.len(), 2, "each worker is its own thread");
    }

    #[test]
    fn time_outs_armed_on_a_worker_fire() {
        let workers = Workers::start(2, 0).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..2 {
            let tx = tx.clone();
            workers.spawn_on(i, async move {
                let started = std::time::Instant::now();
                crate::timer::sleep(std::time::Duration::from_millis(20)).await;
                let never = std::future::pending::<()>();
                let timed_out =
                    crate::timer::timeout(std::time::Duration::from_millis(20), never).await;
                tx.send((started.elapsed(), timed_out.is_err())).unwrap();
            });
        }
        for _ in 0..2 {
            let (waited, timed_out) = rx
                .recv_timeout(std::time::Duration::from_secs(10))
                .expect("the worker's timers fired");
            assert!(waited >= std::time::Duration::from_millis(40));
            assert!(timed_out);
        }
    }

    #[test]
    fn stopping_drops_what_runs_on_the_workers() {
        let workers = Workers::start(1, 0).unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        workers.spawn_on(workers.pick(), async move {
            let _held = tx;
            std::future::pending::<()>().await;
        });
        workers.stop();
        // The sender is dropped with the task, which disconnects the channel.
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        );
    }
}
