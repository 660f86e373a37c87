//! Durations written the way operators read them in logs: `25 s`, `7.6 s`.

use std::fmt;
use std::time::Duration;

/// Displays a duration in seconds, without trailing zeros.
///
/// `Debug` for `Duration` prints `25s` and `7.6s` but also `250ms`, which
/// makes log lines about timeouts harder to compare at a glance; every
/// outcome sentence uses this one form instead.
pub(crate) struct Secs(pub(crate) Duration);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        let millis = d.subsec_millis();
        if millis == 0 {
            return write!(f, "{} s", d.as_secs());
        }
        let frac = format!("{millis:03}");
        write!(f, "{}.{} s", d.as_secs(), frac.trim_end_matches('0'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_and_fractional_seconds() {
        let show = |ms| Secs(Duration::from_millis(ms)).to_string();
        assert_eq!(show(25_000), "25 s");
        assert_eq!(show(7_600), "7.6 s");
        assert_eq!(show(250), "0.25 s");
        assert_eq!(show(1_005), "1.005 s");
        assert_eq!(show(0), "0 s");
    }
}
