//! Protection modes: how much acknowledged data a failover may lose, and
//! how the leader keeps its synchronous standbys so that the answer holds.
//!
//! The invariant every step keeps: **a member listed in the `sync` key has
//! every commit that was acknowledged to a client.** The election promotes
//! only listed members while the cluster runs synchronously, so a failover
//! loses nothing. Hence the order of each change:
//!
//! * a standby joins the set in PostgreSQL first (`synchronous_standby_names`)
//!   and in the `sync` key only once it acknowledges commits;
//! * a standby leaves the set in the `sync` key first and in PostgreSQL
//!   after, and so does the whole set when the leader degrades to
//!   asynchronous replication (recorded before it stops waiting).
//!
//! Every listed standby must acknowledge each commit (`FIRST n` or `ANY n`
//! over exactly n names), since any of them may be the one promoted.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a failover may cost in acknowledged writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protection {
    /// Asynchronous replication; failover candidates are bounded by
    /// `maximum_lag_on_failover`, and what they lack is lost.
    #[default]
    MaximumPerformance,
    /// Synchronous replication while a standby is there to acknowledge;
    /// without one the leader records that it runs asynchronously, then
    /// keeps serving writes.
    MaximumAvailability,
    /// Synchronous replication, always: without a standby, commits wait.
    MaximumProtection,
}

impl Protection {
    /// Whether the leader manages synchronous standbys at all.
    pub fn synchronous(self) -> bool {
        self != Protection::MaximumPerformance
    }
}

impl fmt::Display for Protection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protection::MaximumPerformance => "maximum_performance",
            Protection::MaximumAvailability => "maximum_availability",
            Protection::MaximumProtection => "maximum_protection",
        })
    }
}

/// How the names are written into `synchronous_standby_names`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMethod {
    /// `FIRST n (...)`.
    #[default]
    First,
    /// `ANY n (...)`.
    Quorum,
}

/// The protection settings of a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncSettings {
    /// The mode.
    pub protection: Protection,
    /// How many standbys acknowledge each commit (at most).
    pub count: usize,
    /// `FIRST` or `ANY`.
    pub method: SyncMethod,
    /// In maximum availability, how long commits may wait with no
    /// acknowledging standby before the leader degrades to asynchronous
    /// replication (zero: at once). Ignored in the other modes.
    pub degrade_after: Duration,
}

impl Default for SyncSettings {
    fn default() -> Self {
        SyncSettings {
            protection: Protection::MaximumPerformance,
            count: 1,
            method: SyncMethod::First,
            degrade_after: Duration::ZERO,
        }
    }
}

/// The `sync` key: the leader's synchronous replication state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SyncState {
    /// The leader that wrote it; a state left by an earlier leader says
    /// nothing about the current one.
    pub leader: String,
    /// Whether the cluster runs in a synchronous mode.
    pub synchronous: bool,
    /// Standbys holding every acknowledged commit: while `synchronous` and
    /// not degraded, the only members that may be promoted automatically.
    pub members: Vec<String>,
    /// Since when (Unix ms) the leader runs asynchronously for want of a
    /// standby, in maximum availability.
    pub degraded_since_ms: Option<u64>,
    /// Since when (Unix ms) commits wait with no acknowledging standby.
    pub blocked_since_ms: Option<u64>,
}

impl SyncState {
    /// Whether promotion is restricted to [`SyncState::members`].
    pub fn restricts_promotion(&self) -> bool {
        self.synchronous && self.degraded_since_ms.is_none()
    }
}

/// What the leader observes of its own replication.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncObservation {
    /// The standbys PostgreSQL currently waits for.
    pub applied: Vec<String>,
    /// Members streaming from this leader that may be synchronous (not
    /// tagged `nosync`), best first.
    pub candidates: Vec<String>,
    /// Of `applied`, those that acknowledge commits now.
    pub acknowledging: Vec<String>,
    /// How long commits have had nobody to acknowledge them, while
    /// PostgreSQL waits for someone.
    pub blocked_for: Option<Duration>,
}

/// One step towards the wanted synchronous set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SyncStep {
    /// In line with the settings.
    Nothing,
    /// Write the `sync` key first, then make PostgreSQL wait for `members`
    /// (a shrinking set, or degrading to asynchronous replication).
    PublishThenApply {
        /// The new set.
        members: Vec<String>,
        /// Record asynchronous operation.
        degraded: bool,
    },
    /// Make PostgreSQL wait for `members`, then write the `sync` key once
    /// all of them acknowledge (a growing or changed set).
    ApplyThenPublish {
        /// The new set.
        members: Vec<String>,
    },
}

/// The next step for the leader, from the published state (`None` if the
/// key is missing or another leader's) and what it observes.
pub fn plan_sync(
    settings: &SyncSettings,
    published: Option<&SyncState>,
    obs: &SyncObservation,
) -> SyncStep {
    let published_members: &[String] = published.map_or(&[], |p| &p.members);
    if !settings.protection.synchronous() {
        let stale = published.is_some_and(|p| p.synchronous || !p.members.is_empty());
        return if stale || !obs.applied.is_empty() || published.is_none() {
            SyncStep::PublishThenApply {
                members: Vec::new(),
                degraded: false,
            }
        } else {
            SyncStep::Nothing
        };
    }
    // Keep the standbys already waited for, for stability; fill up from the
    // best of the rest.
    let mut target: Vec<String> = obs
        .applied
        .iter()
        .filter(|m| obs.candidates.contains(m))
        .cloned()
        .collect();
    for c in &obs.candidates {
        if target.len() >= settings.count.max(1) {
            break;
        }
        if !target.contains(c) {
            target.push(c.clone());
        }
    }
    target.truncate(settings.count.max(1));
    let degraded = published.is_some_and(|p| p.degraded_since_ms.is_some());
    if target.is_empty() {
        let may_degrade = settings.protection == Protection::MaximumAvailability
            && (obs.applied.is_empty()
                || obs.blocked_for.is_some_and(|b| b >= settings.degrade_after));
        // Otherwise nobody is left to list, and commits keep waiting for
        // the standbys PostgreSQL was told about.
        return if may_degrade && !degraded {
            SyncStep::PublishThenApply {
                members: Vec::new(),
                degraded: true,
            }
        } else {
            SyncStep::Nothing
        };
    }
    let leaving: Vec<&String> = published_members
        .iter()
        .filter(|m| !target.contains(m))
        .collect();
    if !leaving.is_empty() {
        let kept: Vec<String> = published_members
            .iter()
            .filter(|m| target.contains(m))
            .cloned()
            .collect();
        return SyncStep::PublishThenApply {
            members: kept,
            degraded: false,
        };
    }
    let in_line = obs.applied == target
        && published.is_some_and(|p| p.synchronous && p.members == target && !degraded);
    if in_line {
        SyncStep::Nothing
    } else {
        SyncStep::ApplyThenPublish { members: target }
    }
}

/// The `synchronous_standby_names` value that makes PostgreSQL wait for
/// every one of `members`; empty for none.
pub fn standby_names(method: SyncMethod, members: &[String]) -> String {
    if members.is_empty() {
        return String::new();
    }
    let names: Vec<String> = members
        .iter()
        .map(|m| format!("\"{}\"", m.replace('"', "\"\"")))
        .collect();
    let keyword = match method {
        SyncMethod::First => "FIRST",
        SyncMethod::Quorum => "ANY",
    };
    format!("{keyword} {} ({})", members.len(), names.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn settings(p: Protection) -> SyncSettings {
        SyncSettings {
            protection: p,
            ..SyncSettings::default()
        }
    }

    fn state(members: &[&str]) -> SyncState {
        SyncState {
            leader: "n1".into(),
            synchronous: true,
            members: names(members),
            ..SyncState::default()
        }
    }

    fn obs(applied: &[&str], candidates: &[&str], acking: &[&str]) -> SyncObservation {
        SyncObservation {
            applied: names(applied),
            candidates: names(candidates),
            acknowledging: names(acking),
            blocked_for: None,
        }
    }

    #[test]
    fn a_new_standby_is_waited_for_before_it_is_listed() {
        let s = settings(Protection::MaximumAvailability);
        assert_eq!(
            plan_sync(&s, None, &obs(&[], &["n2", "n3"], &[])),
            SyncStep::ApplyThenPublish {
                members: names(&["n2"])
            }
        );
        // Applied and acknowledging, not yet published: publish.
        assert_eq!(
            plan_sync(&s, None, &obs(&["n2"], &["n2", "n3"], &["n2"])),
            SyncStep::ApplyThenPublish {
                members: names(&["n2"])
            }
        );
        assert_eq!(
            plan_sync(
                &s,
                Some(&state(&["n2"])),
                &obs(&["n2"], &["n2", "n3"], &["n2"])
            ),
            SyncStep::Nothing
        );
    }

    #[test]
    fn a_lost_standby_is_unlisted_before_it_is_replaced() {
        let s = settings(Protection::MaximumAvailability);
        // n2 stopped streaming: first drop it from the key...
        assert_eq!(
            plan_sync(&s, Some(&state(&["n2"])), &obs(&["n2"], &["n3"], &[])),
            SyncStep::PublishThenApply {
                members: vec![],
                degraded: false
            }
        );
        // ...then wait for n3, and list it once it acknowledges.
        assert_eq!(
            plan_sync(&s, Some(&state(&[])), &obs(&[], &["n3"], &[])),
            SyncStep::ApplyThenPublish {
                members: names(&["n3"])
            }
        );
    }

    #[test]
    fn without_standbys_availability_degrades_and_protection_waits() {
        let blocked = SyncObservation {
            blocked_for: Some(Duration::from_secs(3)),
            ..obs(&["n2"], &[], &[])
        };
        assert_eq!(
            plan_sync(
                &settings(Protection::MaximumAvailability),
                Some(&state(&["n2"])),
                &blocked
            ),
            SyncStep::PublishThenApply {
                members: vec![],
                degraded: true
            }
        );
        assert_eq!(
            plan_sync(
                &settings(Protection::MaximumProtection),
                Some(&state(&["n2"])),
                &blocked
            ),
            SyncStep::Nothing,
            "strict mode never stops waiting"
        );
        // Bounded degradation: not before the timeout.
        let bounded = SyncSettings {
            degrade_after: Duration::from_secs(10),
            ..settings(Protection::MaximumAvailability)
        };
        assert_eq!(
            plan_sync(&bounded, Some(&state(&["n2"])), &blocked),
            SyncStep::Nothing
        );
        // A standby back after degrading: synchronous again.
        let mut degraded = state(&[]);
        degraded.degraded_since_ms = Some(1);
        assert_eq!(
            plan_sync(
                &settings(Protection::MaximumAvailability),
                Some(&degraded),
                &obs(&[], &["n2"], &[])
            ),
            SyncStep::ApplyThenPublish {
                members: names(&["n2"])
            }
        );
    }

    #[test]
    fn performance_mode_clears_any_synchronous_state() {
        let s = settings(Protection::MaximumPerformance);
        assert_eq!(
            plan_sync(&s, Some(&state(&["n2"])), &obs(&["n2"], &["n2"], &["n2"])),
            SyncStep::PublishThenApply {
                members: vec![],
                degraded: false
            }
        );
        let clear = SyncState {
            leader: "n1".into(),
            ..SyncState::default()
        };
        assert_eq!(
            plan_sync(&s, Some(&clear), &obs(&[], &["n2"], &[])),
            SyncStep::Nothing
        );
    }

    #[test]
    fn the_set_is_capped_at_the_count_and_kept_stable() {
        let s = SyncSettings {
            count: 2,
            ..settings(Protection::MaximumProtection)
        };
        assert_eq!(
            plan_sync(&s, None, &obs(&["n4"], &["n2", "n3", "n4"], &["n4"])),
            SyncStep::ApplyThenPublish {
                members: names(&["n4", "n2"])
            }
        );
    }

    #[test]
    fn names_are_quoted_and_all_listed_standbys_must_acknowledge() {
        assert_eq!(standby_names(SyncMethod::First, &[]), "");
        assert_eq!(
            standby_names(SyncMethod::First, &names(&["n2", "a\"b"])),
            "FIRST 2 (\"n2\", \"a\"\"b\")"
        );
        assert_eq!(
            standby_names(SyncMethod::Quorum, &names(&["n3"])),
            "ANY 1 (\"n3\")"
        );
    }
}
