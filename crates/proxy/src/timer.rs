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
use std::future::IntoFuture;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::{Instant, Sleep, Timeout};

thread_local! {
    static DRIVER: RefCell<Option<Handle>> = const { RefCell::new(None) };
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
