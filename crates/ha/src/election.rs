//! Who may become leader when the leader key is free, best first.
//!
//! Exclusion runs before ranking so that a strong preference can never put an
//! unsafe member first: operator intent (fencing, tags) first, then liveness,
//! then data. Each excluded member keeps the reason it was dropped, which is
//! what an operator needs when a failover does not happen.

use std::cmp::Reverse;
use std::fmt;
use std::time::Duration;

use crate::member::{MemberRole, MemberState};
use crate::rto::{RtoPreset, Timing};
use crate::secs::Secs;
use crate::view::ClusterView;

/// Default for [`ElectionSettings::maximum_lag_on_failover`]: 1 MiB.
pub const DEFAULT_MAXIMUM_LAG_ON_FAILOVER: u64 = 1024 * 1024;

/// Knobs of the election.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElectionSettings {
    /// How far, in bytes, a candidate may trail the last known leader
    /// position. It is checked against a sampled position, so it limits the
    /// candidates, not the data actually lost.
    pub maximum_lag_on_failover: u64,
    /// A member whose state is older than this is treated as gone: its agent
    /// would already have lost a lease of this length.
    pub ttl: Duration,
}

impl ElectionSettings {
    /// Settings for a cluster running with `timing`, with the default lag
    /// limit; the liveness window follows the lease so the two never
    /// disagree about whether a member is gone.
    pub fn for_timing(timing: &Timing) -> Self {
        ElectionSettings {
            ttl: timing.ttl,
            ..ElectionSettings::default()
        }
    }
}

impl Default for ElectionSettings {
    fn default() -> Self {
        ElectionSettings {
            maximum_lag_on_failover: DEFAULT_MAXIMUM_LAG_ON_FAILOVER,
            ttl: Timing::preset(RtoPreset::default()).ttl,
        }
    }
}

/// Why a member cannot become leader right now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExclusionReason {
    /// PostgreSQL is not running, so there is nothing to promote.
    NotRunning,
    /// The operator tagged it `nofailover`.
    NoFailoverTag,
    /// Its `failover_priority` is zero or negative.
    PriorityZero,
    /// The operator fenced it.
    Fenced,
    /// Its published state is older than the lease ttl.
    NotHeardFrom {
        /// Age of its state, in milliseconds.
        ms: u64,
    },
    /// It is on an older timeline than another running member, so its WAL
    /// position cannot be compared and it may hold a diverged history.
    BehindTimeline {
        /// Its timeline.
        timeline: u32,
        /// The newest timeline among running members.
        newest: u32,
    },
    /// It reported no WAL position, so its lag cannot be judged.
    NoWalPosition,
    /// The cluster runs synchronously and it is not a listed synchronous
    /// standby, so it may lack acknowledged commits.
    NotSynchronous,
    /// It trails the last known leader position by more than allowed.
    LaggingTooMuch {
        /// How far behind it is.
        lag_bytes: u64,
        /// [`ElectionSettings::maximum_lag_on_failover`].
        limit: u64,
    },
}

impl fmt::Display for ExclusionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExclusionReason::NotRunning => f.write_str("PostgreSQL is not running"),
            ExclusionReason::NoFailoverTag => f.write_str("tagged nofailover"),
            ExclusionReason::PriorityZero => f.write_str("failover_priority is 0"),
            ExclusionReason::Fenced => f.write_str("fenced"),
            ExclusionReason::NotHeardFrom { ms } => write!(
                f,
                "not heard from for {}, longer than the lease ttl",
                Secs(Duration::from_millis(*ms))
            ),
            ExclusionReason::BehindTimeline { timeline, newest } => {
                write!(f, "on timeline {timeline}, behind timeline {newest}")
            }
            ExclusionReason::NoWalPosition => f.write_str("WAL position unknown"),
            ExclusionReason::NotSynchronous => {
                f.write_str("not a synchronous standby, so it may lack acknowledged commits")
            }
            ExclusionReason::LaggingTooMuch { lag_bytes, limit } => write!(
                f,
                "lagging {lag_bytes} bytes behind the last leader position (limit {limit})"
            ),
        }
    }
}

/// The outcome of ranking: who may lead, in order, and why the rest may not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ranking {
    /// Eligible members, best first.
    pub eligible: Vec<String>,
    /// Members left out, in the order they appear in the view.
    pub excluded: Vec<(String, ExclusionReason)>,
}

impl Ranking {
    /// The member that should take the leader key, if any qualifies.
    pub fn best(&self) -> Option<&str> {
        self.eligible.first().map(String::as_str)
    }

    /// Whether a member passed every check.
    pub fn is_eligible(&self, name: &str) -> bool {
        self.eligible.iter().any(|n| n == name)
    }

    /// Why a member was left out, if it was.
    pub fn exclusion(&self, name: &str) -> Option<&ExclusionReason> {
        self.excluded
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r)
    }
}

/// Sorts the members of `view` into eligible candidates and excluded ones.
///
/// Among eligible members the highest `failover_priority` wins, then the most
/// WAL (the further of received and replayed), then the smallest name, so
/// that every agent computes the same order from the same view.
pub fn rank_candidates(view: &ClusterView, settings: &ElectionSettings) -> Ranking {
    let ttl_ms = u64::try_from(settings.ttl.as_millis()).unwrap_or(u64::MAX);
    let newest_timeline = view
        .members
        .iter()
        .filter(|m| is_running(m))
        .map(|m| m.timeline)
        .max()
        .unwrap_or(0);

    let mut eligible: Vec<&MemberState> = Vec::new();
    let mut excluded = Vec::new();
    // A listed synchronous standby holds every acknowledged commit, so
    // lag behind the leader's last (possibly unacknowledged) WAL does not
    // count against it; an unlisted member may lack acknowledged commits.
    let lag_base = if view.sync_restricted {
        None
    } else {
        view.last_leader_lsn
    };
    for m in &view.members {
        let reason = if view.sync_restricted && !view.sync_members.contains(&m.name) {
            Some(ExclusionReason::NotSynchronous)
        } else {
            exclusion(m, lag_base, newest_timeline, ttl_ms, settings)
        };
        match reason {
            Some(reason) => excluded.push((m.name.clone(), reason)),
            None => eligible.push(m),
        }
    }
    eligible.sort_by_key(|m| {
        (
            Reverse(m.tags.failover_priority),
            Reverse(m.wal_position()),
            m.name.as_str(),
        )
    });
    Ranking {
        eligible: eligible.into_iter().map(|m| m.name.clone()).collect(),
        excluded,
    }
}

/// Whether `local_name` heads the ranking.
pub fn is_best(local_name: &str, ranking: &Ranking) -> bool {
    ranking.best() == Some(local_name)
}

fn is_running(m: &MemberState) -> bool {
    m.running && m.role != MemberRole::Stopped
}

fn exclusion(
    m: &MemberState,
    last_leader_lsn: Option<u64>,
    newest_timeline: u32,
    ttl_ms: u64,
    settings: &ElectionSettings,
) -> Option<ExclusionReason> {
    if m.fenced {
        return Some(ExclusionReason::Fenced);
    }
    if m.tags.nofailover {
        return Some(ExclusionReason::NoFailoverTag);
    }
    if m.tags.failover_priority <= 0 {
        return Some(ExclusionReason::PriorityZero);
    }
    if m.last_seen_ms_ago > ttl_ms {
        return Some(ExclusionReason::NotHeardFrom {
            ms: m.last_seen_ms_ago,
        });
    }
    if !is_running(m) {
        return Some(ExclusionReason::NotRunning);
    }
    if m.timeline < newest_timeline {
        return Some(ExclusionReason::BehindTimeline {
            timeline: m.timeline,
            newest: newest_timeline,
        });
    }
    // Without a leader position there is nothing to measure lag against;
    // ranking by WAL still prefers the most complete member.
    let leader_lsn = last_leader_lsn?;
    let Some(position) = m.wal_position() else {
        return Some(ExclusionReason::NoWalPosition);
    };
    let lag_bytes = leader_lsn.saturating_sub(position);
    (lag_bytes > settings.maximum_lag_on_failover).then_some(ExclusionReason::LaggingTooMuch {
        lag_bytes,
        limit: settings.maximum_lag_on_failover,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{cluster, LEADER_LSN, MIB};

    #[test]
    fn a_synchronous_cluster_promotes_only_listed_standbys_whatever_their_lag() {
        let mut v = cluster().replica("n2", 0).replica("n3", 5 * MIB).build();
        v.sync_restricted = true;
        v.sync_members = vec!["n3".into()];
        let r = rank(&v);
        assert_eq!(r.eligible, vec!["n3".to_string()]);
        assert_eq!(r.exclusion("n2"), Some(&ExclusionReason::NotSynchronous));
        // Degraded (or performance mode): the usual rules again.
        v.sync_restricted = false;
        assert_eq!(rank(&v).eligible, vec!["n2".to_string()]);
    }

    fn rank(view: &ClusterView) -> Ranking {
        rank_candidates(view, &ElectionSettings::default())
    }

    #[test]
    fn most_wal_wins_among_equal_priorities() {
        let v = cluster()
            .replica("n2", 300)
            .replica("n3", 100)
            .replica("n4", 200)
            .build();
        let r = rank(&v);
        assert_eq!(r.eligible, ["n3", "n4", "n2"]);
        assert!(r.excluded.is_empty());
        assert!(is_best("n3", &r));
        assert!(!is_best("n2", &r));
    }

    #[test]
    fn priority_beats_wal_and_name_breaks_ties() {
        let v = cluster()
            .replica("n2", 0)
            .replica("n3", 5_000)
            .with("n3", |m| m.tags.failover_priority = 2)
            .replica("n5", 10)
            .replica("n4", 10)
            .build();
        assert_eq!(rank(&v).eligible, ["n3", "n2", "n4", "n5"]);
    }

    #[test]
    fn received_or_replayed_whichever_is_further() {
        let v = cluster()
            .replica("a", 0)
            .with("a", |m| {
                m.received_lsn = None;
                m.replayed_lsn = Some(LEADER_LSN - 10);
            })
            .replica("b", 0)
            .with("b", |m| {
                m.received_lsn = Some(LEADER_LSN - 20);
                m.replayed_lsn = Some(LEADER_LSN - 30);
            })
            .build();
        assert_eq!(rank(&v).eligible, ["a", "b"]);
    }

    #[test]
    fn each_exclusion_is_reported_with_its_reason() {
        type Tweak = fn(&mut MemberState);
        let table: Vec<(&str, Tweak, ExclusionReason)> = vec![
            (
                "stopped",
                |m| m.running = false,
                ExclusionReason::NotRunning,
            ),
            (
                "stopped-role",
                |m| m.role = MemberRole::Stopped,
                ExclusionReason::NotRunning,
            ),
            (
                "tagged",
                |m| m.tags.nofailover = true,
                ExclusionReason::NoFailoverTag,
            ),
            (
                "prio0",
                |m| m.tags.failover_priority = 0,
                ExclusionReason::PriorityZero,
            ),
            (
                "negative",
                |m| m.tags.failover_priority = -3,
                ExclusionReason::PriorityZero,
            ),
            ("fenced", |m| m.fenced = true, ExclusionReason::Fenced),
            (
                "silent",
                |m| m.last_seen_ms_ago = 31_000,
                ExclusionReason::NotHeardFrom { ms: 31_000 },
            ),
            (
                "old-tl",
                |m| m.timeline = 1,
                ExclusionReason::BehindTimeline {
                    timeline: 1,
                    newest: 2,
                },
            ),
            (
                "blind",
                |m| {
                    m.received_lsn = None;
                    m.replayed_lsn = None;
                },
                ExclusionReason::NoWalPosition,
            ),
            (
                "behind",
                |m| {
                    m.received_lsn = Some(LEADER_LSN - 2 * MIB);
                    m.replayed_lsn = Some(LEADER_LSN - 3 * MIB);
                },
                ExclusionReason::LaggingTooMuch {
                    lag_bytes: 2 * MIB,
                    limit: MIB,
                },
            ),
        ];
        for (name, tweak, want) in table {
            let v = cluster()
                .replica("healthy", 0)
                .with("healthy", |m| m.timeline = 2)
                .replica(name, 0)
                .with(name, |m| m.timeline = 2)
                .with(name, tweak)
                .build();
            let r = rank(&v);
            assert_eq!(r.eligible, ["healthy"], "{name}");
            assert_eq!(r.exclusion(name), Some(&want), "{name}");
        }
    }

    #[test]
    fn settings_follow_the_timing() {
        let s = ElectionSettings::for_timing(&Timing::preset(RtoPreset::Wide));
        assert_eq!(s.ttl, Duration::from_secs(120));
        assert_eq!(s.maximum_lag_on_failover, 1_048_576);
        assert_eq!(ElectionSettings::default().ttl, Duration::from_secs(30));
    }

    #[test]
    fn lag_up_to_the_limit_is_allowed() {
        let v = cluster()
            .replica("edge", MIB)
            .replica("over", MIB + 1)
            .build();
        let r = rank(&v);
        assert_eq!(r.eligible, ["edge"]);
        assert!(r.is_eligible("edge") && !r.is_eligible("over"));
    }

    #[test]
    fn operator_intent_is_reported_before_health() {
        let v = cluster()
            .replica("n2", 10 * MIB)
            .with("n2", |m| {
                m.running = false;
                m.fenced = true;
            })
            .build();
        assert_eq!(rank(&v).exclusion("n2"), Some(&ExclusionReason::Fenced));
    }

    #[test]
    fn without_a_leader_position_lag_is_not_checked() {
        let mut v = cluster()
            .replica("far", 100 * MIB)
            .replica("blind", 0)
            .with("blind", |m| {
                m.received_lsn = None;
                m.replayed_lsn = None;
            })
            .build();
        v.last_leader_lsn = None;
        assert_eq!(rank(&v).eligible, ["far", "blind"]);
    }

    #[test]
    fn nobody_qualifies_and_every_reason_is_kept() {
        let v = cluster()
            .replica("n2", 0)
            .with("n2", |m| m.running = false)
            .replica("n3", 0)
            .with("n3", |m| m.tags.nofailover = true)
            .build();
        let r = rank(&v);
        assert!(r.eligible.is_empty());
        assert_eq!(r.best(), None);
        assert!(!is_best("n2", &r));
        assert_eq!(
            r.excluded,
            [
                ("n2".to_string(), ExclusionReason::NotRunning),
                ("n3".to_string(), ExclusionReason::NoFailoverTag),
            ]
        );
    }

    #[test]
    fn reasons_read_well_in_logs() {
        assert_eq!(
            ExclusionReason::LaggingTooMuch {
                lag_bytes: 2_097_152,
                limit: 1_048_576
            }
            .to_string(),
            "lagging 2097152 bytes behind the last leader position (limit 1048576)"
        );
        assert_eq!(
            ExclusionReason::NotHeardFrom { ms: 31_500 }.to_string(),
            "not heard from for 31.5 s, longer than the lease ttl"
        );
        assert_eq!(
            ExclusionReason::BehindTimeline {
                timeline: 3,
                newest: 4
            }
            .to_string(),
            "on timeline 3, behind timeline 4"
        );
    }
}
