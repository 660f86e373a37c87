//! The one duration syntax used by every time-valued key.
//!
//! A duration is either a string with a unit (`"500ms"`, `"2s"`, `"1.5min"`)
//! or a bare TOML integer counting milliseconds. A string without a unit is
//! rejected rather than guessed at: `"30"` could mean seconds to one reader
//! and milliseconds to another.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

const NANOS_PER_SEC: u128 = 1_000_000_000;

/// Units accepted after the number, with their length in nanoseconds.
const UNITS: [(&str, u128); 5] = [
    ("ms", 1_000_000),
    ("s", NANOS_PER_SEC),
    ("min", 60 * NANOS_PER_SEC),
    ("h", 3600 * NANOS_PER_SEC),
    ("d", 86_400 * NANOS_PER_SEC),
];

/// The longest duration any key accepts. Far beyond any sensible time-out,
/// yet small enough that adding it to the current time cannot overflow,
/// which would otherwise panic the first time the value is used.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 86_400);

/// Rejects a duration above [`MAX_DURATION`], with the message to show.
pub(crate) fn within_bound(d: Duration) -> Result<Duration, String> {
    if d > MAX_DURATION {
        Err(format!(
            "longer than the maximum of {} (100 years); for no limit, see the key's documentation",
            format_duration(MAX_DURATION)
        ))
    } else {
        Ok(d)
    }
}

/// Why a duration string was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {reason}")]
pub struct DurationError {
    input: String,
    reason: String,
}

impl DurationError {
    fn new(input: &str, reason: impl Into<String>) -> Self {
        DurationError {
            input: input.to_string(),
            reason: reason.into(),
        }
    }
}

/// Parses a duration string such as `"500ms"`, `"2s"`, `"1.5min"`, `"1h"`
/// or `"7d"`. Whitespace between the number and the unit is allowed.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let text = input.trim();
    let number_len = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(number_len);
    let unit = unit.trim_start();
    if number.is_empty() {
        return Err(DurationError::new(
            input,
            "expected a number followed by a unit, e.g. \"2s\"",
        ));
    }
    if unit.is_empty() {
        return Err(DurationError::new(
            input,
            "missing unit: write e.g. \"500ms\" or \"2s\", or a bare integer for milliseconds",
        ));
    }
    let Some(&(_, unit_ns)) = UNITS.iter().find(|(name, _)| *name == unit) else {
        // "m" is the one unit people reach for that is genuinely ambiguous.
        let hint = if unit == "m" {
            "\"m\" is ambiguous: use \"min\" for minutes or \"ms\" for milliseconds"
        } else {
            "expected one of ms, s, min, h, d"
        };
        return Err(DurationError::new(
            input,
            format!("unknown unit {unit:?}; {hint}"),
        ));
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if whole.is_empty() || fraction.contains('.') || (number.contains('.') && fraction.is_empty()) {
        return Err(DurationError::new(
            input,
            format!("malformed number {number:?}"),
        ));
    }
    let too_large = || DurationError::new(input, "value is too large");
    // Fixed-point arithmetic in nanoseconds keeps "0.1s" exact, which a
    // detour through f64 would not.
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    let mut nanos = whole.checked_mul(unit_ns).ok_or_else(too_large)?;
    if !fraction.is_empty() {
        if fraction.len() > 18 {
            return Err(DurationError::new(input, "too many decimal places"));
        }
        let digits: u128 = fraction.parse().map_err(|_| too_large())?;
        nanos = nanos
            .checked_add(digits * unit_ns / 10u128.pow(fraction.len() as u32))
            .ok_or_else(too_large)?;
    }
    let secs = u64::try_from(nanos / NANOS_PER_SEC).map_err(|_| too_large())?;
    within_bound(Duration::new(secs, (nanos % NANOS_PER_SEC) as u32))
        .map_err(|why| DurationError::new(input, why))
}

/// Renders a duration in the largest unit that represents it exactly, so
/// that values echoed back to operators read the way they would write them.
pub fn format_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_string();
    }
    for (name, unit_ns) in UNITS.iter().rev() {
        if nanos % unit_ns == 0 {
            return format!("{}{name}", nanos / unit_ns);
        }
    }
    format!("{}ns", nanos)
}

/// Serde adapter for any duration key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dur(pub(crate) Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DurVisitor).map(Dur)
    }
}

/// A duration that must not be zero, for intervals and timeouts where zero
/// would make every attempt fail or spin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PositiveDur(pub(crate) Duration);

impl<'de> Deserialize<'de> for PositiveDur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Dur(v) = Dur::deserialize(d)?;
        if v.is_zero() {
            return Err(de::Error::custom("must be greater than zero"));
        }
        Ok(PositiveDur(v))
    }
}

struct DurVisitor;

impl Visitor<'_> for DurVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a duration such as \"500ms\", \"2s\", \"1min\", or an integer of milliseconds")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
        parse_duration(v).map_err(E::custom)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
        let ms = u64::try_from(v)
            .map_err(|_| E::custom(format!("invalid duration {v}: must not be negative")))?;
        self.visit_u64(ms)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
        within_bound(Duration::from_millis(v))
            .map_err(|why| E::custom(format!("invalid duration {v}: {why}")))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Duration, E> {
        // A bare float has no unit to anchor it; integers are milliseconds
        // by convention, but "1.5" would most likely be meant as seconds.
        Err(E::custom(format!(
            "invalid duration {v}: write fractional durations as a string with a unit, e.g. \"{v}s\""
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted() {
        for (s, d) in [
            ("500ms", Duration::from_millis(500)),
            ("2s", Duration::from_secs(2)),
            ("1min", Duration::from_secs(60)),
            ("1h", Duration::from_secs(3600)),
            ("1d", Duration::from_secs(86_400)),
            ("0s", Duration::ZERO),
            ("0.1s", Duration::from_millis(100)),
            ("1.5min", Duration::from_secs(90)),
            (" 10 ms ", Duration::from_millis(10)),
            ("0.0005s", Duration::from_micros(500)),
        ] {
            assert_eq!(parse_duration(s), Ok(d), "{s}");
        }
    }

    #[test]
    fn rejected() {
        for (s, why) in [
            ("", "expected a number"),
            ("ms", "expected a number"),
            ("5", "missing unit"),
            ("5 parsecs", "unknown unit \"parsecs\""),
            ("5m", "ambiguous"),
            ("5S", "unknown unit"),
            ("-5s", "expected a number"),
            ("1.s", "malformed"),
            (".5s", "malformed"),
            ("1.2.3s", "malformed"),
            ("99999999999999999999999999999999d", "too large"),
            // The whole part just fits; adding the fraction overflows.
            ("340282366920938463463374607431768.999999ms", "too large"),
            ("1.0000000000000000001s", "decimal places"),
            ("106751991167300d", "maximum"),
            ("18446744073709551615s", "maximum"),
            ("36501d", "maximum"),
        ] {
            let e = parse_duration(s).unwrap_err().to_string();
            assert!(e.contains(why), "{s}: {e}");
            assert!(e.contains(&format!("{s:?}")), "{s}: {e}");
        }
    }

    #[test]
    fn bound_is_inclusive_and_far_from_overflow() {
        assert_eq!(parse_duration("36500d"), Ok(MAX_DURATION));
        // The bound itself can be added to the current time.
        let _ = std::time::Instant::now() + MAX_DURATION;
        #[derive(Deserialize)]
        struct K {
            #[allow(dead_code)]
            k: Dur,
        }
        let e = toml::from_str::<K>("k = 9223372036854775807\n")
            .err()
            .unwrap();
        assert!(e.to_string().contains("maximum"), "{e}");
        assert!(toml::from_str::<K>("k = 3153600000000\n").is_ok());
    }

    #[test]
    fn formatting_round_trips() {
        for s in ["0s", "1ms", "1500ms", "2s", "1min", "90s", "1h", "2d"] {
            let d = parse_duration(s).unwrap();
            assert_eq!(format_duration(d), s);
        }
        assert_eq!(format_duration(Duration::from_nanos(7)), "7ns");
    }
}
