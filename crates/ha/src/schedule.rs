//! Scheduled switchovers: reading the operator's timestamp, and where a
//! scheduled request stands against the wall clock.
//!
//! A request carries its time as an ISO 8601 timestamp with a UTC offset,
//! as Patroni's `scheduled_at` does. It is stored normalised to UTC, and
//! every agent compares it with its own wall clock, so the members' clocks
//! must agree (NTP) to well within a loop.
//!
//! A scheduled request does nothing until its time comes; then the leader
//! carries it out like an immediate one. One whose time passed more than
//! [`overdue_after`] ago without it being carried out (the candidate was not
//! ready, the cluster was paused) is dropped by the leader rather than
//! carried out at a moment nobody chose, as Patroni does.

use std::fmt;
use std::time::Duration;

use crate::rto::Timing;

/// Why a timestamp was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TimestampError {
    /// Not an ISO 8601 date and time.
    Invalid,
    /// A date and time without a UTC offset, which every member could read
    /// in a different time zone.
    NoOffset,
}

impl fmt::Display for TimestampError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TimestampError::Invalid => {
                "not an ISO 8601 timestamp (expected e.g. 2030-01-01T12:00:00+00:00)"
            }
            TimestampError::NoOffset => "the timestamp has no UTC offset (append Z or +HH:MM)",
        })
    }
}

/// Parses an ISO 8601 timestamp with a UTC offset into Unix milliseconds:
/// `YYYY-MM-DDTHH:MM[:SS[.fraction]]` followed by `Z` or `±HH[:MM]`
/// (`T` may be a space; `±HHMM` is accepted too). Digits beyond the
/// millisecond are ignored.
pub fn parse_timestamp(text: &str) -> Result<i64, TimestampError> {
    use TimestampError::Invalid;
    let s = text.trim().as_bytes();
    let mut p = Cursor { s, i: 0 };
    let year = p.digits(4)?;
    p.expect(b'-')?;
    let month = p.digits(2)?;
    p.expect(b'-')?;
    let day = p.digits(2)?;
    if !matches!(p.next(), Some(b'T' | b't' | b' ')) {
        return Err(Invalid);
    }
    let hour = p.digits(2)?;
    p.expect(b':')?;
    let minute = p.digits(2)?;
    let (mut second, mut millis) = (0, 0);
    if p.peek() == Some(b':') {
        p.i += 1;
        second = p.digits(2)?;
        if matches!(p.peek(), Some(b'.' | b',')) {
            p.i += 1;
            let start = p.i;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.i += 1;
            }
            let frac = &s[start..p.i];
            if frac.is_empty() {
                return Err(Invalid);
            }
            millis = frac
                .iter()
                .chain(b"00")
                .take(3)
                .fold(0, |acc, d| acc * 10 + i64::from(d - b'0'));
        }
    }
    let offset_min = match p.next() {
        None => return Err(TimestampError::NoOffset),
        Some(b'Z' | b'z') => 0,
        Some(sign @ (b'+' | b'-')) => {
            let h = p.digits(2)?;
            if p.peek() == Some(b':') {
                p.i += 1;
            }
            let m = if p.peek().is_some() { p.digits(2)? } else { 0 };
            if h > 23 || m > 59 {
                return Err(Invalid);
            }
            let off = h * 60 + m;
            if sign == b'-' {
                -off
            } else {
                off
            }
        }
        Some(_) => return Err(Invalid),
    };
    if p.peek().is_some()
        || !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 59
    {
        return Err(Invalid);
    }
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_min * 60;
    Ok(secs * 1000 + millis)
}

/// Unix milliseconds as an RFC 3339 UTC timestamp, `2030-01-01T12:00:00Z`
/// (with `.mmm` when there are milliseconds), the form requests are stored
/// in.
pub fn format_timestamp(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    let frac = if millis == 0 {
        String::new()
    } else {
        format!(".{millis:03}")
    };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}{frac}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// How late a due request may still be carried out: one and a half loops,
/// as in Patroni, so that a request whose moment the leader's loop just
/// missed still runs, and one that could not run then is not run at some
/// later moment nobody chose.
pub fn overdue_after(timing: &Timing) -> Duration {
    timing.loop_wait * 3 / 2
}

/// Where a scheduled request stands at a given moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Not scheduled: to be carried out as soon as possible.
    Immediate,
    /// Its time has not come; it comes after this long.
    Waiting(Duration),
    /// Its time has come, this long ago (within [`overdue_after`]).
    Due(Duration),
    /// Its time passed this long ago, more than [`overdue_after`].
    Overdue(Duration),
    /// The stored time cannot be read (written by hand, or by a newer
    /// version in another form).
    Unreadable,
}

impl Schedule {
    /// Where a request scheduled at `scheduled_at` (as stored; `None`:
    /// not scheduled) stands at wall-clock `now_ms`.
    pub fn of(scheduled_at: Option<&str>, now_ms: u64, overdue_after: Duration) -> Schedule {
        let Some(text) = scheduled_at else {
            return Schedule::Immediate;
        };
        let Ok(at) = parse_timestamp(text) else {
            return Schedule::Unreadable;
        };
        let now = i64::try_from(now_ms).unwrap_or(i64::MAX);
        if at > now {
            return Schedule::Waiting(Duration::from_millis((at - now) as u64));
        }
        let late = Duration::from_millis((now - at) as u64);
        if late > overdue_after {
            Schedule::Overdue(late)
        } else {
            Schedule::Due(late)
        }
    }

    /// Whether the request is to be acted on now.
    pub fn is_active(&self) -> bool {
        matches!(self, Schedule::Immediate | Schedule::Due(_))
    }
}

struct Cursor<'a> {
    s: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn expect(&mut self, c: u8) -> Result<(), TimestampError> {
        (self.next() == Some(c))
            .then_some(())
            .ok_or(TimestampError::Invalid)
    }

    fn digits(&mut self, n: usize) -> Result<i64, TimestampError> {
        let mut v = 0;
        for _ in 0..n {
            match self.next() {
                Some(c) if c.is_ascii_digit() => v = v * 10 + i64::from(c - b'0'),
                _ => return Err(TimestampError::Invalid),
            }
        }
        Ok(v)
    }
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_with_an_offset_parse_to_unix_milliseconds() {
        let cases = [
            ("1970-01-01T00:00:00Z", 0),
            ("1970-01-01T00:00:00+00:00", 0),
            ("2023-11-14T22:13:20Z", 1_700_000_000_000),
            ("2023-11-14T22:13:20.123Z", 1_700_000_000_123),
            ("2023-11-14T22:13:20.1Z", 1_700_000_000_100),
            ("2023-11-14T22:13:20.123456+00:00", 1_700_000_000_123),
            ("2023-11-14 22:13:20z", 1_700_000_000_000),
            ("2023-11-14t22:13:20Z", 1_700_000_000_000),
            // The same instant written in other zones.
            ("2023-11-15T00:13:20+02:00", 1_700_000_000_000),
            ("2023-11-15T00:13:20+0200", 1_700_000_000_000),
            ("2023-11-15T00:13:20+02", 1_700_000_000_000),
            ("2023-11-14T17:43:20-04:30", 1_700_000_000_000),
            // Seconds are optional.
            ("2023-11-14T22:13Z", 1_699_999_980_000),
            ("2000-02-29T00:00:00Z", 951_782_400_000),
            ("  2000-02-29T00:00:00Z ", 951_782_400_000),
        ];
        for (text, want) in cases {
            assert_eq!(parse_timestamp(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn a_timestamp_without_an_offset_is_refused_as_such() {
        assert_eq!(
            parse_timestamp("2030-01-01T12:00:00"),
            Err(TimestampError::NoOffset)
        );
        assert_eq!(
            parse_timestamp("2030-01-01T12:00"),
            Err(TimestampError::NoOffset)
        );
    }

    #[test]
    fn malformed_timestamps_are_refused() {
        for bad in [
            "",
            "tomorrow",
            "2030-01-01",
            "2030-1-01T12:00:00Z",
            "2030-01-01T12:00:00ZZ",
            "2030-01-01T12:00:00+25:00",
            "2030-01-01T12:00:00+01:60",
            "2030-13-01T12:00:00Z",
            "2030-00-01T12:00:00Z",
            "2030-02-29T12:00:00Z",
            "1900-02-29T12:00:00Z",
            "2030-04-31T12:00:00Z",
            "2030-01-01T24:00:00Z",
            "2030-01-01T12:60:00Z",
            "2030-01-01T12:00:60Z",
            "2030-01-01T12:00:00.Z",
            "2030-01-01X12:00:00Z",
            "2030-01-01T12:00:00 UTC",
        ] {
            assert_eq!(parse_timestamp(bad), Err(TimestampError::Invalid), "{bad}");
        }
        assert!(parse_timestamp("2000-02-29T00:00:00Z").is_ok(), "leap day");
    }

    #[test]
    fn stored_form_is_utc_and_round_trips() {
        assert_eq!(format_timestamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            format_timestamp(1_700_000_000_123),
            "2023-11-14T22:13:20.123Z"
        );
        assert_eq!(format_timestamp(951_782_400_000), "2000-02-29T00:00:00Z");
        for ms in [0, 1, 999, 86_399_999, 951_782_400_000, 4_102_444_800_000] {
            assert_eq!(parse_timestamp(&format_timestamp(ms)), Ok(ms), "{ms}");
        }
        // Every day of four centuries converts both ways.
        for days in (-719_162..=2_932_896).step_by(97) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
            assert!(d >= 1 && d <= days_in_month(y, m));
        }
    }

    #[test]
    fn a_request_waits_then_is_due_then_overdue() {
        let at = "2023-11-14T22:13:20Z";
        let t = 1_700_000_000_000u64;
        let grace = Duration::from_millis(1_500);
        assert_eq!(Schedule::of(None, t, grace), Schedule::Immediate);
        assert_eq!(
            Schedule::of(Some(at), t - 3_000, grace),
            Schedule::Waiting(Duration::from_secs(3))
        );
        assert_eq!(
            Schedule::of(Some(at), t - 1, grace),
            Schedule::Waiting(Duration::from_millis(1))
        );
        assert_eq!(
            Schedule::of(Some(at), t, grace),
            Schedule::Due(Duration::ZERO)
        );
        assert_eq!(
            Schedule::of(Some(at), t + 1_500, grace),
            Schedule::Due(grace)
        );
        assert_eq!(
            Schedule::of(Some(at), t + 1_501, grace),
            Schedule::Overdue(Duration::from_millis(1_501))
        );
        assert_eq!(Schedule::of(Some("soon"), t, grace), Schedule::Unreadable);
        let active: Vec<bool> = [
            Schedule::Immediate,
            Schedule::Waiting(grace),
            Schedule::Due(grace),
            Schedule::Overdue(grace),
            Schedule::Unreadable,
        ]
        .iter()
        .map(Schedule::is_active)
        .collect();
        assert_eq!(active, [true, false, true, false, false]);
    }

    #[test]
    fn the_grace_is_one_and_a_half_loops() {
        let t = Timing {
            loop_wait: Duration::from_secs(5),
            ..Timing::default()
        };
        assert_eq!(overdue_after(&t), Duration::from_millis(7_500));
    }
}
