//! Lease and loop timing: the named presets, a check that a leader cut off
//! from the DCS can step down before anyone else may take over, and timings
//! derived from a recovery-time target.
//!
//! Only the HA agent's own timers live here. The reference presets also set
//! HAProxy check intervals; pgwarden routes clients itself from the leader key
//! and its own probes, so those have no counterpart.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::secs::Secs;

/// What an election plus promotion costs once a replica sees the leader key
/// vanish: one round of member reads, one compare-and-set, `pg_ctl promote`.
///
/// The model behind the presets budgets one second on average for this.
pub const ELECTION_OVERHEAD: Duration = Duration::from_secs(1);

/// Shortest `loop_wait` that [`Timing::for_target`] will produce.
///
/// Each loop reads PostgreSQL and the DCS; much faster than once a second and
/// the agent's own probes become a measurable load on a busy primary.
pub const MIN_LOOP_WAIT: Duration = Duration::from_secs(1);

/// Shortest `retry_timeout` that [`Timing::for_target`] will produce.
///
/// A single etcd round trip that stalls on a leader election inside etcd can
/// take several hundred milliseconds; less than this and a routine etcd hiccup
/// would demote a healthy primary.
pub const MIN_RETRY_TIMEOUT: Duration = Duration::from_secs(1);

/// Smallest `safety_margin` that [`Timing::for_target`] will produce: the
/// watchdog's time-out is `ttl − safety_margin` from a feed that follows the
/// renewal's answer, so without room it could fire after the lease has
/// already run out in etcd.
pub const MIN_SAFETY_MARGIN: Duration = Duration::from_millis(500);

/// Shortest `ttl` that [`Timing::for_target`] will produce: one loop plus two
/// retry windows at their minimums, plus the least safety margin.
pub const MIN_TTL: Duration = Duration::from_millis(3_500);

/// The smallest target [`Timing::for_target`] accepts: the expected passive
/// RTO of the minimum timings (`3.5 s − 1 s / 2 + 1 s`).
pub const MIN_TARGET_RTO: Duration = Duration::from_millis(4_000);

/// The largest target [`Timing::for_target`] accepts.
///
/// Beyond an hour a "failover" is an operator's job, and a typo such as
/// `rto = 36000` is far more likely than a real wish.
pub const MAX_TARGET_RTO: Duration = Duration::from_secs(3_600);

/// Derived values are rounded down to this step so they read well in logs and
/// `/config` without pushing the expected RTO over the target.
const STEP_MS: u64 = 100;

/// The safety margin never grows past this; the presets up to `safe` use it.
const MAX_DERIVED_SAFETY_MARGIN: Duration = Duration::from_secs(5);

/// A named set of timings, from tight single-rack clusters to cross-region
/// ones. The longer presets trade recovery time for tolerance of jitter, since
/// a lease that lapses on a slow network is a failover nobody wanted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RtoPreset {
    /// ttl 20 s, loop 5 s, retry 5 s, start 15 s, margin 5 s.
    /// Model RTO: passive 16 / 23 / 29 s, active 1 / 24 / 29 s; budget 30 s.
    /// Only for sub-millisecond, loss-free networks.
    Fast,
    /// ttl 30 s, loop 5 s, retry 10 s, start 25 s, margin 5 s.
    /// Model RTO: passive 27 / 34 / 41 s, active 2 / 35 / 41 s; budget 45 s.
    /// The default, for one data centre.
    #[default]
    Norm,
    /// ttl 60 s, loop 10 s, retry 20 s, start 45 s, margin 10 s.
    /// Model RTO: passive 53 / 66 / 78 s, active 3 / 61 / 73 s; budget 90 s.
    /// For data centres in one city.
    Safe,
    /// ttl 120 s, loop 20 s, retry 30 s, start 95 s, margin 15 s.
    /// Model RTO: passive 104 / 127 / 150 s, active 4 / 122 / 145 s;
    /// budget 150 s. For cross-region links with packet loss.
    Wide,
}

impl RtoPreset {
    /// Every preset, shortest first.
    pub const ALL: [RtoPreset; 4] = [
        RtoPreset::Fast,
        RtoPreset::Norm,
        RtoPreset::Safe,
        RtoPreset::Wide,
    ];

    /// The spelling used in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            RtoPreset::Fast => "fast",
            RtoPreset::Norm => "norm",
            RtoPreset::Safe => "safe",
            RtoPreset::Wide => "wide",
        }
    }

    /// The recovery-time bound each preset is sold with.
    pub fn budget(self) -> Duration {
        Duration::from_secs(match self {
            RtoPreset::Fast => 30,
            RtoPreset::Norm => 45,
            RtoPreset::Safe => 90,
            RtoPreset::Wide => 150,
        })
    }

    /// The published Patroni + HAProxy model figures for this preset, so
    /// measured failovers can be compared with what the reference promises.
    pub fn reference_rto(self) -> ReferenceRto {
        let (passive, active) = match self {
            RtoPreset::Fast => ([16, 23, 29], [1, 24, 29]),
            RtoPreset::Norm => ([27, 34, 41], [2, 35, 41]),
            RtoPreset::Safe => ([53, 66, 78], [3, 61, 73]),
            RtoPreset::Wide => ([104, 127, 150], [4, 122, 145]),
        };
        ReferenceRto {
            passive: RtoRange::from_secs(passive),
            active: RtoRange::from_secs(active),
        }
    }
}

impl fmt::Display for RtoPreset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RtoPreset {
    type Err = ParseRtoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        RtoPreset::ALL
            .into_iter()
            .find(|p| t.eq_ignore_ascii_case(p.name()))
            .ok_or_else(|| ParseRtoError {
                input: s.to_string(),
            })
    }
}

/// Best, average and worst recovery time of one failure path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtoRange {
    /// When the failure lands at the luckiest moment of every cycle.
    pub min: Duration,
    /// The mean over a failure time spread evenly across the cycles.
    pub avg: Duration,
    /// When every phase waits its full length.
    pub max: Duration,
}

impl RtoRange {
    fn from_secs([min, avg, max]: [u64; 3]) -> Self {
        RtoRange {
            min: Duration::from_secs(min),
            avg: Duration::from_secs(avg),
            max: Duration::from_secs(max),
        }
    }
}

/// The reference model's recovery times for one preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReferenceRto {
    /// The node (or its agent) is gone, so the cluster waits out the lease.
    pub passive: RtoRange,
    /// PostgreSQL crashed under a live agent, which tries to restart it
    /// before giving the leader key up. The minimum is a restart that works.
    pub active: RtoRange,
}

/// The HA agent's timers. Values are only trustworthy after [`validate`]
/// (the constructors here always return valid sets; overrides may not).
///
/// [`validate`]: Timing::validate
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// Lifetime of the leader lease. A dead leader is noticed only when this
    /// runs out, so it dominates the recovery time after a node loss.
    pub ttl: Duration,
    /// Pause between HA loop iterations, and so the normal age of the last
    /// lease renewal when the next one is attempted.
    pub loop_wait: Duration,
    /// How long the leader keeps retrying the DCS before it gives up and
    /// demotes, so that it stops taking writes before its lease can lapse.
    pub retry_timeout: Duration,
    /// How long a leader whose PostgreSQL crashed may spend restarting it
    /// before handing the leader key over; zero fails over at once.
    pub primary_start_timeout: Duration,
    /// Slack kept between the watchdog firing and the lease expiring, so a
    /// hung agent's node is reset before another member can be promoted.
    pub safety_margin: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing::preset(RtoPreset::default())
    }
}

impl Timing {
    /// The timings of a named preset.
    pub fn preset(preset: RtoPreset) -> Timing {
        let [ttl, loop_wait, retry_timeout, primary_start_timeout, safety_margin] = match preset {
            RtoPreset::Fast => [20, 5, 5, 15, 5],
            RtoPreset::Norm => [30, 5, 10, 25, 5],
            RtoPreset::Safe => [60, 10, 20, 45, 10],
            RtoPreset::Wide => [120, 20, 30, 95, 15],
        }
        .map(Duration::from_secs);
        Timing {
            ttl,
            loop_wait,
            retry_timeout,
            primary_start_timeout,
            safety_margin,
        }
    }

    /// Derives timings whose [expected passive RTO](Timing::expected_passive_rto)
    /// does not exceed `target`.
    ///
    /// The presets only offer four points; this fills the space between and
    /// below them with the same proportions:
    ///
    /// * `loop_wait` is about a sixth of `ttl` (as in `norm`, `safe`, `wide`),
    ///   at least [`MIN_LOOP_WAIT`];
    /// * `ttl` is then as long as the target allows, because a longer lease is
    ///   what keeps a network blip from turning into a failover;
    /// * `retry_timeout` is a third of what the lease leaves after one loop,
    ///   at least [`MIN_RETRY_TIMEOUT`], so `loop_wait + 2 × retry_timeout ≤ ttl`
    ///   holds with room to spare;
    /// * `safety_margin` is that spare room, capped at 5 s, so the watchdog
    ///   also fires before the lease lapses;
    /// * `primary_start_timeout` is `ttl − loop_wait`, which keeps the
    ///   expected RTO after a PostgreSQL crash under the target too.
    ///
    /// Values are rounded down to 100 ms. Targets below [`MIN_TARGET_RTO`] or
    /// above [`MAX_TARGET_RTO`] are refused.
    pub fn for_target(target: Duration) -> Result<Timing, TimingError> {
        if target < MIN_TARGET_RTO {
            return Err(TimingError::TargetTooShort {
                target,
                minimum: MIN_TARGET_RTO,
            });
        }
        if target > MAX_TARGET_RTO {
            return Err(TimingError::TargetTooLong {
                target,
                maximum: MAX_TARGET_RTO,
            });
        }
        // All arithmetic in whole milliseconds: the bounds above keep every
        // value far from overflow, and integer rounding can only go down.
        let budget = millis(target) - millis(ELECTION_OVERHEAD);
        // ttl − loop/2 = budget with loop = ttl/6 gives loop = budget / 5.5.
        let loop_wait = round_down(budget * 2 / 11).max(millis(MIN_LOOP_WAIT));
        let ttl = round_down(budget + loop_wait / 2);
        if ttl < millis(MIN_TTL) {
            // Unreachable with the bounds above, but it is the real rule.
            return Err(TimingError::TargetTooShort {
                target,
                minimum: MIN_TARGET_RTO,
            });
        }
        let retry_timeout = round_down((ttl - loop_wait) / 3).max(millis(MIN_RETRY_TIMEOUT));
        let spare = ttl.saturating_sub(loop_wait + 2 * retry_timeout);
        let timing = Timing {
            ttl: Duration::from_millis(ttl),
            loop_wait: Duration::from_millis(loop_wait),
            retry_timeout: Duration::from_millis(retry_timeout),
            primary_start_timeout: Duration::from_millis(ttl - loop_wait),
            safety_margin: Duration::from_millis(spare).min(MAX_DERIVED_SAFETY_MARGIN),
        };
        timing.validate()?;
        Ok(timing)
    }

    /// Replaces the fields an operator set explicitly. The result may violate
    /// the lease constraint; call [`Timing::validate`] (or use
    /// [`RtoSetting::resolve`], which does).
    pub fn with_overrides(self, overrides: &TimingOverrides) -> Timing {
        Timing {
            ttl: overrides.ttl.unwrap_or(self.ttl),
            loop_wait: overrides.loop_wait.unwrap_or(self.loop_wait),
            retry_timeout: overrides.retry_timeout.unwrap_or(self.retry_timeout),
            primary_start_timeout: overrides
                .primary_start_timeout
                .unwrap_or(self.primary_start_timeout),
            safety_margin: overrides.safety_margin.unwrap_or(self.safety_margin),
        }
    }

    /// Checks that the timers are usable and that a leader cut off from the
    /// DCS demotes while its lease is still valid.
    ///
    /// The leader notices a failed renewal at most one `loop_wait` late, then
    /// retries for `retry_timeout`; a second `retry_timeout` of headroom
    /// covers the demotion itself and clock drift between the agent and etcd.
    pub fn validate(&self) -> Result<(), TimingError> {
        for (field, value) in [
            ("ttl", self.ttl),
            ("loop_wait", self.loop_wait),
            ("retry_timeout", self.retry_timeout),
        ] {
            if value.is_zero() {
                return Err(TimingError::NotPositive { field });
            }
        }
        let needed = self
            .loop_wait
            .saturating_add(self.retry_timeout.saturating_mul(2));
        if needed > self.ttl {
            return Err(TimingError::LeaseTooShort {
                loop_wait: self.loop_wait,
                retry_timeout: self.retry_timeout,
                ttl: self.ttl,
            });
        }
        if self.safety_margin >= self.ttl {
            return Err(TimingError::SafetyMarginTooLong {
                safety_margin: self.safety_margin,
                ttl: self.ttl,
            });
        }
        Ok(())
    }

    /// How long after its last successful renewal a leader must demote.
    ///
    /// Renewals normally happen once per loop, so the last success is up to
    /// `loop_wait` old before anything is wrong; the retry window starts
    /// from there.
    pub fn demote_after(&self) -> Duration {
        self.loop_wait.saturating_add(self.retry_timeout)
    }

    /// Mean recovery time after losing the leader node: the lease runs out
    /// `ttl − loop_wait / 2` after the crash on average, and the winner of the
    /// election is promoted about [`ELECTION_OVERHEAD`] later.
    ///
    /// Unlike the reference model there is no replica polling delay, because
    /// the agents watch the leader key and see its deletion at once.
    pub fn expected_passive_rto(&self) -> Duration {
        self.ttl
            .saturating_sub(self.loop_wait / 2)
            .saturating_add(ELECTION_OVERHEAD)
    }

    /// Recovery time after losing the leader node just after it renewed.
    pub fn worst_passive_rto(&self) -> Duration {
        self.ttl.saturating_add(ELECTION_OVERHEAD)
    }

    /// Mean recovery time after a PostgreSQL crash that a restart does not
    /// fix: half a loop to notice, the whole start timeout, then an election
    /// that starts as soon as the key is released.
    pub fn expected_active_rto(&self) -> Duration {
        (self.loop_wait / 2)
            .saturating_add(self.primary_start_timeout)
            .saturating_add(ELECTION_OVERHEAD)
    }
}

fn millis(d: Duration) -> u64 {
    // Callers bound their inputs to an hour, far below u64 milliseconds.
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn round_down(ms: u64) -> u64 {
    ms - ms % STEP_MS
}

/// Timing fields set explicitly by the operator on top of a preset or target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimingOverrides {
    /// Replaces [`Timing::ttl`].
    pub ttl: Option<Duration>,
    /// Replaces [`Timing::loop_wait`].
    pub loop_wait: Option<Duration>,
    /// Replaces [`Timing::retry_timeout`].
    pub retry_timeout: Option<Duration>,
    /// Replaces [`Timing::primary_start_timeout`].
    pub primary_start_timeout: Option<Duration>,
    /// Replaces [`Timing::safety_margin`].
    pub safety_margin: Option<Duration>,
}

/// Why a set of timings cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    /// A timer that must tick was zero.
    #[error("{field} must be greater than zero")]
    NotPositive {
        /// The configuration key at fault.
        field: &'static str,
    },
    /// The lease would lapse before a cut-off leader demotes.
    #[error(
        "loop_wait {} + 2 × retry_timeout {} = {} exceeds ttl {}: a leader that loses the DCS \
         would still accept writes after its lease expired; raise ttl or lower the others",
        Secs(*loop_wait),
        Secs(*retry_timeout),
        Secs(loop_wait.saturating_add(retry_timeout.saturating_mul(2))),
        Secs(*ttl)
    )]
    LeaseTooShort {
        /// The configured loop interval.
        loop_wait: Duration,
        /// The configured DCS retry window.
        retry_timeout: Duration,
        /// The configured lease lifetime.
        ttl: Duration,
    },
    /// The watchdog would fire no earlier than the lease expires.
    #[error(
        "safety_margin {} must be shorter than ttl {}",
        Secs(*safety_margin),
        Secs(*ttl)
    )]
    SafetyMarginTooLong {
        /// The configured margin.
        safety_margin: Duration,
        /// The configured lease lifetime.
        ttl: Duration,
    },
    /// No timings meet the target while keeping the minimum timer values.
    #[error(
        "an RTO target of {} cannot be met: with loop_wait ≥ 1 s, retry_timeout ≥ 1 s and \
         ttl ≥ 3.5 s (0.5 s for the watchdog) the expected recovery after a node loss is at least {}",
        Secs(*target),
        Secs(*minimum)
    )]
    TargetTooShort {
        /// The requested target.
        target: Duration,
        /// The smallest target that can be met.
        minimum: Duration,
    },
    /// The target is beyond what automatic failover is meant for.
    #[error(
        "an RTO target of {} is longer than the {} maximum",
        Secs(*target),
        Secs(*maximum)
    )]
    TargetTooLong {
        /// The requested target.
        target: Duration,
        /// The largest accepted target.
        maximum: Duration,
    },
}

/// The `rto` configuration value: a preset name or a target in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RtoSetting {
    /// One of the named presets.
    Preset(RtoPreset),
    /// A recovery-time target to derive timings from.
    Target(Duration),
}

impl Default for RtoSetting {
    fn default() -> Self {
        RtoSetting::Preset(RtoPreset::default())
    }
}

impl RtoSetting {
    /// The timings this setting stands for, before any overrides.
    pub fn timing(&self) -> Result<Timing, TimingError> {
        match *self {
            RtoSetting::Preset(p) => Ok(Timing::preset(p)),
            RtoSetting::Target(t) => Timing::for_target(t),
        }
    }

    /// The timings with the operator's overrides applied, validated.
    pub fn resolve(&self, overrides: &TimingOverrides) -> Result<Timing, TimingError> {
        let timing = self.timing()?.with_overrides(overrides);
        timing.validate()?;
        Ok(timing)
    }
}

impl fmt::Display for RtoSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RtoSetting::Preset(p) => p.fmt(f),
            // No space before the unit, so the output parses back.
            RtoSetting::Target(t) => write!(f, "{}s", t.as_secs_f64()),
        }
    }
}

/// An `rto` value that is neither a preset nor a number of seconds.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid rto {input:?}: expected fast, norm, safe, wide or a number of seconds")]
pub struct ParseRtoError {
    /// The rejected input.
    pub input: String,
}

impl FromStr for RtoSetting {
    type Err = ParseRtoError;

    /// Accepts a preset name (any case) or seconds, optionally with an `s`
    /// suffix: `"norm"`, `"8"`, `"7.5s"`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(p) = s.parse::<RtoPreset>() {
            return Ok(RtoSetting::Preset(p));
        }
        let err = || ParseRtoError {
            input: s.to_string(),
        };
        let t = s.trim();
        let number = t.strip_suffix('s').unwrap_or(t).trim_end();
        // f64's parser also takes "inf", "NaN" and exponents; seconds are
        // always written as plain decimals.
        if number.is_empty()
            || !number.bytes().all(|b| b.is_ascii_digit() || b == b'.')
            || number.bytes().filter(|&b| b == b'.').count() > 1
        {
            return Err(err());
        }
        let secs: f64 = number.parse().map_err(|_| err())?;
        Duration::try_from_secs_f64(secs)
            .map(RtoSetting::Target)
            .map_err(|_| err())
    }
}

impl Serialize for RtoSetting {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            RtoSetting::Preset(p) => serializer.serialize_str(p.name()),
            RtoSetting::Target(t) if t.subsec_nanos() == 0 => serializer.serialize_u64(t.as_secs()),
            RtoSetting::Target(t) => serializer.serialize_f64(t.as_secs_f64()),
        }
    }
}

impl<'de> Deserialize<'de> for RtoSetting {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(RtoVisitor)
    }
}

struct RtoVisitor;

impl Visitor<'_> for RtoVisitor {
    type Value = RtoSetting;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("fast, norm, safe, wide or a number of seconds")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<RtoSetting, E> {
        v.parse().map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<RtoSetting, E> {
        Ok(RtoSetting::Target(Duration::from_secs(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<RtoSetting, E> {
        u64::try_from(v)
            .map(|s| RtoSetting::Target(Duration::from_secs(s)))
            .map_err(|_| E::custom(format!("invalid rto {v}: seconds cannot be negative")))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<RtoSetting, E> {
        Duration::try_from_secs_f64(v)
            .map(RtoSetting::Target)
            .map_err(|_| E::custom(format!("invalid rto {v}: expected a number of seconds")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn ms(m: u64) -> Duration {
        Duration::from_millis(m)
    }

    #[test]
    fn presets_match_the_reference_table() {
        let table = [
            (RtoPreset::Fast, [20, 5, 5, 15, 5]),
            (RtoPreset::Norm, [30, 5, 10, 25, 5]),
            (RtoPreset::Safe, [60, 10, 20, 45, 10]),
            (RtoPreset::Wide, [120, 20, 30, 95, 15]),
        ];
        for (preset, [ttl, lw, rt, start, margin]) in table {
            let t = Timing::preset(preset);
            assert_eq!(
                t,
                Timing {
                    ttl: secs(ttl),
                    loop_wait: secs(lw),
                    retry_timeout: secs(rt),
                    primary_start_timeout: secs(start),
                    safety_margin: secs(margin),
                },
                "{preset}"
            );
            t.validate().unwrap();
        }
        assert_eq!(Timing::default(), Timing::preset(RtoPreset::Norm));
    }

    #[test]
    fn reference_figures_and_budgets() {
        let norm = RtoPreset::Norm.reference_rto();
        assert_eq!(norm.passive.avg, secs(34));
        assert_eq!(norm.active.avg, secs(35));
        assert_eq!(RtoPreset::Fast.reference_rto().passive.min, secs(16));
        assert_eq!(RtoPreset::Wide.reference_rto().passive.max, secs(150));
        for p in RtoPreset::ALL {
            let r = p.reference_rto();
            assert!(r.passive.max <= p.budget(), "{p}");
            assert!(r.active.max <= p.budget(), "{p}");
            // Watching the leader key removes the replica polling delay, so
            // pgwarden's own estimate must beat the reference average.
            assert!(
                Timing::preset(p).expected_passive_rto() < r.passive.avg,
                "{p}"
            );
        }
    }

    #[test]
    fn constraint_refuses_a_lease_shorter_than_loop_plus_two_retries() {
        let t = Timing {
            ttl: secs(20),
            loop_wait: secs(10),
            retry_timeout: secs(10),
            ..Timing::default()
        };
        let err = t.validate().unwrap_err();
        assert_eq!(
            err,
            TimingError::LeaseTooShort {
                loop_wait: secs(10),
                retry_timeout: secs(10),
                ttl: secs(20),
            }
        );
        let msg = err.to_string();
        for needle in ["loop_wait 10 s", "retry_timeout 10 s", "= 30 s", "ttl 20 s"] {
            assert!(msg.contains(needle), "{msg}");
        }
        // Exactly on the boundary is allowed: the fast preset sits there.
        let edge = Timing { ttl: secs(30), ..t };
        edge.validate().unwrap();
    }

    #[test]
    fn zero_timers_and_oversized_margin_are_refused() {
        let base = Timing::default();
        for (field, t) in [
            (
                "ttl",
                Timing {
                    ttl: Duration::ZERO,
                    ..base
                },
            ),
            (
                "loop_wait",
                Timing {
                    loop_wait: Duration::ZERO,
                    ..base
                },
            ),
            (
                "retry_timeout",
                Timing {
                    retry_timeout: Duration::ZERO,
                    ..base
                },
            ),
        ] {
            assert_eq!(t.validate(), Err(TimingError::NotPositive { field }));
        }
        let t = Timing {
            safety_margin: secs(30),
            ..base
        };
        assert!(matches!(
            t.validate(),
            Err(TimingError::SafetyMarginTooLong { .. })
        ));
        // Immediate failover on a crash is a legitimate choice.
        Timing {
            primary_start_timeout: Duration::ZERO,
            ..base
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn target_of_eight_seconds() {
        let t = Timing::for_target(secs(8)).unwrap();
        t.validate().unwrap();
        assert!(t.expected_passive_rto() <= secs(8), "{t:?}");
        assert!(t.loop_wait >= MIN_LOOP_WAIT);
        assert!(t.retry_timeout >= MIN_RETRY_TIMEOUT);
        assert!(t.ttl >= MIN_TTL);
        assert!(t.loop_wait + 2 * t.retry_timeout + t.safety_margin <= t.ttl);
        assert_eq!(
            t,
            Timing {
                ttl: ms(7_600),
                loop_wait: ms(1_200),
                retry_timeout: ms(2_100),
                primary_start_timeout: ms(6_400),
                safety_margin: ms(2_200),
            }
        );
    }

    #[test]
    fn targets_across_the_range_stay_consistent() {
        let mut previous_ttl = Duration::ZERO;
        let mut target = MIN_TARGET_RTO;
        while target <= MAX_TARGET_RTO {
            let t = Timing::for_target(target).unwrap_or_else(|e| panic!("{target:?}: {e}"));
            t.validate().unwrap();
            assert!(t.expected_passive_rto() <= target, "{target:?} {t:?}");
            assert!(t.expected_active_rto() <= target, "{target:?} {t:?}");
            // Rounding must not waste more than a couple of steps.
            assert!(
                t.expected_passive_rto() + ms(300) >= target,
                "{target:?} {t:?}"
            );
            assert!(t.loop_wait >= MIN_LOOP_WAIT && t.retry_timeout >= MIN_RETRY_TIMEOUT);
            assert!(t.ttl >= MIN_TTL);
            assert!(t.loop_wait + 2 * t.retry_timeout + t.safety_margin <= t.ttl);
            assert!(t.safety_margin >= MIN_SAFETY_MARGIN, "{target:?} {t:?}");
            assert!(t.ttl >= previous_ttl, "ttl must grow with the target");
            previous_ttl = t.ttl;
            target += ms(1_700);
        }
    }

    #[test]
    fn derived_timings_resemble_the_presets() {
        let t = Timing::for_target(secs(30)).unwrap();
        assert_eq!(t.loop_wait, ms(5_200));
        assert_eq!(t.ttl, ms(31_600));
        assert_eq!(t.safety_margin, secs(5));
    }

    #[test]
    fn targets_outside_the_range_are_refused() {
        let err = Timing::for_target(secs(2)).unwrap_err();
        assert_eq!(
            err,
            TimingError::TargetTooShort {
                target: secs(2),
                minimum: MIN_TARGET_RTO,
            }
        );
        assert!(err.to_string().contains("at least 4 s"), "{err}");
        assert!(Timing::for_target(ms(3_999)).is_err());
        let min = Timing::for_target(MIN_TARGET_RTO).unwrap();
        assert_eq!(
            (min.ttl, min.loop_wait, min.retry_timeout, min.safety_margin),
            (MIN_TTL, secs(1), secs(1), MIN_SAFETY_MARGIN)
        );
        assert_eq!(
            MIN_TARGET_RTO,
            MIN_TTL - MIN_LOOP_WAIT / 2 + ELECTION_OVERHEAD
        );
        assert!(matches!(
            Timing::for_target(secs(3_601)),
            Err(TimingError::TargetTooLong { .. })
        ));
    }

    #[test]
    fn overrides_replace_only_what_is_set() {
        let o = TimingOverrides {
            ttl: Some(secs(40)),
            primary_start_timeout: Some(secs(5)),
            ..TimingOverrides::default()
        };
        let t = RtoSetting::Preset(RtoPreset::Norm).resolve(&o).unwrap();
        assert_eq!(t.ttl, secs(40));
        assert_eq!(t.loop_wait, secs(5));
        assert_eq!(t.retry_timeout, secs(10));
        assert_eq!(t.primary_start_timeout, secs(5));

        let bad = TimingOverrides {
            retry_timeout: Some(secs(15)),
            ..TimingOverrides::default()
        };
        assert!(matches!(
            RtoSetting::Preset(RtoPreset::Fast).resolve(&bad),
            Err(TimingError::LeaseTooShort { .. })
        ));
    }

    #[test]
    fn parses_presets_and_seconds() {
        let p = |s: &str| s.parse::<RtoSetting>();
        assert_eq!(p("fast"), Ok(RtoSetting::Preset(RtoPreset::Fast)));
        assert_eq!(p(" NORM "), Ok(RtoSetting::Preset(RtoPreset::Norm)));
        assert_eq!(p("safe"), Ok(RtoSetting::Preset(RtoPreset::Safe)));
        assert_eq!(p("wide"), Ok(RtoSetting::Preset(RtoPreset::Wide)));
        assert_eq!(p("8"), Ok(RtoSetting::Target(secs(8))));
        assert_eq!(p("7.5s"), Ok(RtoSetting::Target(ms(7_500))));
        for bad in ["", "s", "quick", "-5", "inf", "NaN", "1e3", "1.2.3", "5ms"] {
            let err = p(bad).unwrap_err();
            assert!(
                err.to_string().contains("expected fast, norm"),
                "{bad}: {err}"
            );
        }
        assert_eq!(RtoSetting::default(), RtoSetting::Preset(RtoPreset::Norm));
        for s in [
            RtoSetting::Preset(RtoPreset::Safe),
            RtoSetting::Target(ms(7_500)),
        ] {
            assert_eq!(p(&s.to_string()), Ok(s));
        }
    }

    #[test]
    fn serde_accepts_names_and_numbers() {
        let de = |j: &str| serde_json::from_str::<RtoSetting>(j);
        assert_eq!(de("\"wide\"").unwrap(), RtoSetting::Preset(RtoPreset::Wide));
        assert_eq!(de("8").unwrap(), RtoSetting::Target(secs(8)));
        assert_eq!(de("\"12\"").unwrap(), RtoSetting::Target(secs(12)));
        assert_eq!(de("2.5").unwrap(), RtoSetting::Target(ms(2_500)));
        assert!(de("-1").is_err());
        assert!(de("\"bogus\"").is_err());
        assert!(de("true").is_err());

        let ser = |s: RtoSetting| serde_json::to_string(&s).unwrap();
        assert_eq!(ser(RtoSetting::Preset(RtoPreset::Fast)), "\"fast\"");
        assert_eq!(ser(RtoSetting::Target(secs(8))), "8");
        assert_eq!(ser(RtoSetting::Target(ms(2_500))), "2.5");
        assert_eq!(serde_json::to_string(&RtoPreset::Norm).unwrap(), "\"norm\"");
    }

    #[test]
    fn model_estimates() {
        let norm = Timing::preset(RtoPreset::Norm);
        assert_eq!(norm.expected_passive_rto(), ms(28_500));
        assert_eq!(norm.worst_passive_rto(), secs(31));
        assert_eq!(norm.expected_active_rto(), ms(28_500));
        assert_eq!(norm.demote_after(), secs(15));
    }
}
