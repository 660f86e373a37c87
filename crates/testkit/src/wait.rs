//! Waiting for a condition with a deadline instead of sleeping.

use std::time::{Duration, Instant};

/// A point in time after which waiting is a failure.
#[derive(Debug, Clone, Copy)]
pub struct Deadline(Instant);

impl Deadline {
    /// `d` from now.
    pub fn after(d: Duration) -> Self {
        Self(Instant::now() + d)
    }

    /// Whether the deadline has passed.
    pub fn passed(&self) -> bool {
        Instant::now() >= self.0
    }
}

/// Polls `check` every 20 ms until it returns `Some`, and returns that
/// value; panics with `what` and the last failure if `within` passes first.
/// `check` returns `Err(reason)` while the condition does not hold, so the
/// panic message says what was last seen.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Deadline::after(within);
    loop {
        let last = match check().await {
            Ok(v) => return v,
            Err(e) => e,
        };
        if deadline.passed() {
            panic!("timed out after {within:?} waiting for {what}; last seen: {last}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
