//! Time-outs for code that may run on a worker thread.
//!
//! The workers' event loops have no timer driver: tokio's driver takes
//! its wheel's lock, looks for the next expiry and reads the clock around
//! every sleep of the event loop, which on a pooled connection is about a
//! tenth of each statement's instructions (docs/benchmarks.md). The
//! workers' timers live on one timer thread instead. They are time-outs
//! and seldom fire; arming one takes that thread's wheel lock, moving one
//! later is an atomic store, and neither wakes the thread, whose own tick
//! keeps its next wake-up within a second of now.
//!
//! Every timer created in this crate goes through these functions (clippy
//! rejects tokio's own, see `clippy.toml`); on a thread that is not a
//! worker they are tokio's.

use std::cell::RefCell;
use std::future::{Future, IntoFuture};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep, Timeout};

thread_local! {
    static DRIVER: RefCell<Option<Handle>> = const { RefCell::new(None) };
    /// The newest [`Deadline`] group created on this thread.
    static GROUP: RefCell<Option<Arc<Group>>> = const { RefCell::new(None) };
}

/// Makes the runtime of `handle` the home of the timers this thread
/// creates from now on.
pub(crate) fn use_driver_of(handle: Handle) {
    DRIVER.with(|d| *d.borrow_mut() = Some(handle));
}

/// The runtime whose timer driver this thread's timers use, if not the
/// current one.
fn driver() -> Option<Handle> {
    DRIVER.with(|d| d.borrow().clone())
}

/// Evaluates `$make` inside this thread's timer runtime. Entered by a guard
/// rather than through a closure: a closure would move the future a
/// time-out wraps (often over a kilobyte) in and out of it, a copy each way.
macro_rules! on_driver {
    ($make:expr) => {{
        let driver = driver();
        let _entered = driver.as_ref().map(Handle::enter);
        $make
    }};
}

/// How long to wait before trying servers again after the `round`th
/// (from 0) round in which every eligible one failed: 100 ms, doubling up
/// to a second, so a host back from a restart is found soon and one that
/// stays down is not hammered.
pub(crate) fn retry_pause(round: u32) -> Duration {
    Duration::from_millis(100u64 << round.min(4)).min(Duration::from_secs(1))
}

/// [`tokio::time::sleep`].
#[allow(clippy::disallowed_methods)]
pub fn sleep(duration: Duration) -> Sleep {
    on_driver!(tokio::time::sleep(duration))
}

/// [`tokio::time::sleep_until`].
#[allow(clippy::disallowed_methods)]
pub fn sleep_until(deadline: Instant) -> Sleep {
    on_driver!(tokio::time::sleep_until(deadline))
}

/// [`tokio::time::timeout`].
#[allow(clippy::disallowed_methods)]
pub fn timeout<F: IntoFuture>(duration: Duration, future: F) -> Timeout<F::IntoFuture> {
    on_driver!(tokio::time::timeout(duration, future))
}

/// [`tokio::time::timeout_at`].
#[allow(clippy::disallowed_methods)]
pub fn timeout_at<F: IntoFuture>(deadline: Instant, future: F) -> Timeout<F::IntoFuture> {
    on_driver!(tokio::time::timeout_at(deadline, future))
}

/// [`tokio::time::interval`].
#[allow(clippy::disallowed_methods)]
pub fn interval(period: Duration) -> tokio::time::Interval {
    on_driver!(tokio::time::interval(period))
}

/// A time limit that the connections a thread accepts within a short span
/// share: one timer for all of them instead of one each. It expires
/// between its duration and an eighth of it (at most a second) later,
/// never earlier.
///
/// Every client's start-up and log-in run under one. With a timer of
/// their own, arming it in and removing it from the timer thread's wheel
/// cost a connect-per-transaction client about 1.3 µs of user time per
/// connection (docs/benchmarks.md); joining a group is a reference count
/// and a wait-list entry on this thread.
#[derive(Debug)]
pub(crate) struct Deadline {
    group: Arc<Group>,
}

#[derive(Debug)]
struct Group {
    at: Instant,
    expired: AtomicBool,
    notify: Notify,
}

/// [`Deadline::run`]'s error: the deadline passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Expired;

impl Deadline {
    /// A deadline `limit` (or a little more) from now.
    pub(crate) fn after(limit: Duration) -> Deadline {
        let slack = (limit / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let earliest = Instant::now() + limit;
        GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if let Some(group) = g.as_ref() {
                if group.at >= earliest && group.at <= earliest + slack {
                    return Deadline {
                        group: group.clone(),
                    };
                }
            }
            let group = Arc::new(Group {
                at: earliest + slack,
                expired: AtomicBool::new(false),
                notify: Notify::new(),
            });
            let timer = group.clone();
            // On the timer thread's runtime where this thread has one
            // (`use_driver_of`), else on this thread's.
            drop(on_driver!(tokio::spawn(async move {
                sleep_until(timer.at).await;
                // Stored before waking, so a client that joins the wait
                // list too late to be woken still sees it.
                timer.expired.store(true, Ordering::Release);
                timer.notify.notify_waiters();
            })));
            *g = Some(group.clone());
            Deadline { group }
        })
    }

    /// Runs `work` until it completes or the deadline passes.
    pub(crate) async fn run<F: Future>(&self, work: F) -> Result<F::Output, Expired> {
        let group = &*self.group;
        let mut expiry = pin!(group.notify.notified());
        expiry.as_mut().enable();
        let mut work = pin!(work);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = work.as_mut().poll(cx) {
                return Poll::Ready(Ok(out));
            }
            if group.expired.load(Ordering::Acquire) || expiry.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(Expired));
            }
            Poll::Pending
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_deadline_expires_after_its_limit_and_not_much_later() {
        let limit = Duration::from_millis(400);
        let start = Instant::now();
        let d = Deadline::after(limit);
        assert_eq!(d.run(std::future::pending::<()>()).await, Err(Expired));
        let took = start.elapsed();
        assert!(took >= limit, "expired early, after {took:?}");
        // The slack is 50 ms here; the rest is room for a busy machine.
        assert!(took < limit * 3, "expired after {took:?}");
        // Work that finishes in time is not cut.
        let d = Deadline::after(limit);
        let out = d
            .run(async {
                sleep(limit / 4).await;
                7
            })
            .await;
        assert_eq!(out, Ok(7));
    }

    #[tokio::test]
    async fn deadlines_made_close_together_share_a_timer_but_never_expire_early() {
        // A slack of 100 ms.
        let limit = Duration::from_millis(800);
        let first = Deadline::after(limit);
        sleep(Duration::from_millis(20)).await;
        let start = Instant::now();
        let second = Deadline::after(limit);
        assert!(Arc::ptr_eq(&first.group, &second.group));
        assert_eq!(second.run(std::future::pending::<()>()).await, Err(Expired));
        let took = start.elapsed();
        assert!(took >= limit, "expired early, after {took:?}");
        // Once expired, a late joiner of the same group expires at once.
        assert_eq!(first.run(std::future::pending::<()>()).await, Err(Expired));
        // Past the group's slack, a new group starts.
        let third = Deadline::after(limit);
        assert!(!Arc::ptr_eq(&first.group, &third.group));
    }
}
