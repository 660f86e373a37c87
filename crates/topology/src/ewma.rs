//! Smoothed round-trip time.

use std::time::Duration;

/// Weight of the newest sample; low enough that one slow probe does not
/// throw a host out of the latency window.
const ALPHA: f64 = 0.2;

/// Exponentially weighted moving average of round-trip times, in milliseconds.
///
/// Empty until the first sample, which is taken as is; an unset estimate
/// keeps a host that was just (re)discovered from inheriting stale latency.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ewma(Option<f64>);

impl Ewma {
    /// An estimate with no samples yet.
    pub const fn new() -> Self {
        Ewma(None)
    }

    /// Folds in one sample.
    pub fn update(&mut self, sample: Duration) {
        let ms = duration_ms(sample);
        self.0 = Some(match self.0 {
            None => ms,
            Some(prev) => ALPHA * ms + (1.0 - ALPHA) * prev,
        });
    }

    /// The current estimate in milliseconds, if any sample has been seen.
    pub fn get(&self) -> Option<f64> {
        self.0
    }

    /// Forgets all samples.
    pub fn reset(&mut self) {
        self.0 = None;
    }
}

/// Converts to fractional milliseconds the same way everywhere, so that
/// RTT estimates and thresholds compare on equal footing.
pub(crate) fn duration_ms(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1_000_000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn first_sample_initialises_then_smooths() {
        let mut e = Ewma::new();
        assert_eq!(e.get(), None);
        e.update(Duration::from_millis(10));
        assert_eq!(e.get(), Some(10.0));
        e.update(Duration::from_millis(20));
        assert!(close(e.get().unwrap(), 12.0));
        e.update(Duration::from_millis(2));
        assert!(close(e.get().unwrap(), 0.2 * 2.0 + 0.8 * 12.0)); // 10.0
        e.update(Duration::from_micros(500));
        assert!(close(e.get().unwrap(), 8.1));
    }

    #[test]
    fn reset_starts_over() {
        let mut e = Ewma::new();
        e.update(Duration::from_millis(100));
        e.reset();
        assert_eq!(e.get(), None);
        e.update(Duration::from_millis(3));
        assert_eq!(e.get(), Some(3.0));
    }

    #[test]
    fn sub_millisecond_precision() {
        let mut e = Ewma::default();
        e.update(Duration::from_nanos(1_500_000));
        assert_eq!(e.get(), Some(1.5));
    }
}
