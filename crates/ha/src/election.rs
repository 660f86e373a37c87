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
use crate::protection::Claim;
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
    /// The cluster runs with quorum commit, and too few listed standbys
    /// report a WAL position to tell which of them holds every
    /// acknowledged commit.
    QuorumUnseen {
        /// Listed standbys whose position is known.
        seen: usize,
        /// How many are needed: listed − quorum + 1.
        needed: usize,
    },
    /// The cluster runs with quorum commit, and it is behind the position
    /// that enough listed standbys reach to hold every acknowledged commit,
    /// so it may lack some.
    QuorumBehind {
        /// How far behind that position it is.
        lag_bytes: u64,
    },
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
            ExclusionReason::QuorumUnseen { seen, needed } => write!(
                f,
                "only {seen} listed synchronous standbys report a WAL position, {needed} needed \
                 to know which holds every acknowledged commit"
            ),
            ExclusionReason::QuorumBehind { lag_bytes } => write!(
                f,
                "{lag_bytes} bytes behind another listed synchronous standby, so it may lack \
                 acknowledged commits"
            ),
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
    let floor = quorum_floor(view, ttl_ms);
    for m in &view.members {
        let reason = if view.sync_restricted && !view.sync_members.contains(&m.name) {
            Some(ExclusionReason::NotSynchronous)
        } else {
            exclusion(m, lag_base, newest_timeline, ttl_ms, settings)
                .or_else(|| quorum_exclusion(m, floor.as_ref()?))
        };
        match reason {
            Some(reason) => excluded.push((m.name.clone(), reason)),
            None => eligible.push(m),
        }
    }
    // At an equal position a running primary comes first: a leader whose
    // key lapsed while it kept writing (failsafe through an etcd outage)
    // takes it back rather than hand its role to a replica that streamed
    // all of it and demote for nothing.
    eligible.sort_by_key(|m| {
        (
            Reverse(m.tags.failover_priority),
            Reverse(m.wal_position()),
            m.role != MemberRole::Primary,
            m.name.as_str(),
        )
    });
    Ranking {
        eligible: eligible.into_iter().map(|m| m.name.clone()).collect(),
        excluded,
    }
}

/// Under quorum commit, the WAL position a listed standby must reach to
/// be sure to hold every acknowledged commit: each commit is on `quorum`
/// of the m listed, so any m − quorum + 1 of them include a holder, and a
/// member at least as far as the furthest of some such group holds them
/// all. The group with the lowest such position is the `needed` lowest
/// positions seen. `Err((seen, needed))` when fewer are known. `None`
/// without quorum commit (every listed standby holds everything).
///
/// A position is known for a listed member heard from within the ttl that
/// reports one. The agent fills in fresh positions (and drops those of
/// members that do not answer) before it takes the key.
fn quorum_floor(view: &ClusterView, ttl_ms: u64) -> Option<Result<u64, (usize, usize)>> {
    if !view.sync_restricted {
        return None;
    }
    let claim = Claim::new(
        view.sync_members.clone(),
        view.sync_quorum.unwrap_or(view.sync_members.len()),
    );
    let needed = claim.needed()?;
    if needed <= 1 {
        return None;
    }
    let mut seen: Vec<u64> = view
        .members
        .iter()
        .filter(|m| claim.members.contains(&m.name) && m.last_seen_ms_ago <= ttl_ms)
        .filter_map(MemberState::wal_position)
        .collect();
    seen.sort_unstable();
    Some(seen.get(needed - 1).copied().ok_or((seen.len(), needed)))
}

fn quorum_exclusion(
    m: &MemberState,
    floor: &Result<u64, (usize, usize)>,
) -> Option<ExclusionReason> {
    match *floor {
        Err((seen, needed)) => Some(ExclusionReason::QuorumUnseen { seen, needed }),
        Ok(floor) => match m.wal_position() {
            None => Some(ExclusionReason::NoWalPosition),
            Some(p) if p < floor => Some(ExclusionReason::QuorumBehind {
                lag_bytes: floor - p,
            }),
            Some(_) => None,
        },
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

    /// A cluster whose `sync` key lists `listed` with `quorum`, and whose
    /// members stand `lag` bytes behind the last leader position.
    fn quorum(members: &[(&str, u64)], listed: &[&str], quorum: usize) -> ClusterView {
        let mut b = cluster();
        for (name, lag) in members {
            b = b.replica(name, *lag);
        }
        let mut v = b.build();
        v.sync_restricted = true;
        v.sync_members = listed.iter().map(|s| s.to_string()).collect();
        v.sync_quorum = Some(quorum);
        v
    }

    #[test]
    fn quorum_one_of_two_promotes_only_the_more_advanced_of_both() {
        let v = quorum(&[("n2", 0), ("n3", 100)], &["n2", "n3"], 1);
        let r = rank(&v);
        assert_eq!(r.eligible, ["n2"]);
        assert_eq!(
            r.exclusion("n3"),
            Some(&ExclusionReason::QuorumBehind { lag_bytes: 100 })
        );
        // Lag behind the old leader's last position does not count: the
        // WAL no standby has was never acknowledged.
        let v = quorum(&[("n2", 5 * MIB), ("n3", 6 * MIB)], &["n2", "n3"], 1);
        assert_eq!(rank(&v).eligible, ["n2"]);
    }

    #[test]
    fn quorum_one_of_two_with_one_member_missing_promotes_nobody() {
        // n3 alone may have acknowledged the last commits.
        for gone in [
            (|m: &mut MemberState| m.last_seen_ms_ago = 31_000) as fn(&mut MemberState),
            |m| {
                m.received_lsn = None;
                m.replayed_lsn = None;
            },
        ] {
            let v = cluster()
                .replica("n2", 0)
                .replica("n3", 0)
                .with("n3", gone)
                .build();
            let v = ClusterView {
                sync_restricted: true,
                sync_members: vec!["n2".into(), "n3".into()],
                sync_quorum: Some(1),
                ..v
            };
            let r = rank(&v);
            assert!(r.eligible.is_empty(), "{r:?}");
            assert_eq!(
                r.exclusion("n2"),
                Some(&ExclusionReason::QuorumUnseen { seen: 1, needed: 2 })
            );
        }
    }

    #[test]
    fn quorum_two_of_three_tolerates_one_missing_member() {
        let mut v = quorum(
            &[("n2", 0), ("n3", 100), ("n4", 300)],
            &["n2", "n3", "n4"],
            2,
        );
        // All three seen: a commit on two of them is on n2 or n3, so
        // anyone at least as far as the second lowest (n3) holds them all.
        let r = rank(&v);
        assert_eq!(r.eligible, ["n2", "n3"]);
        assert_eq!(
            r.exclusion("n4"),
            Some(&ExclusionReason::QuorumBehind { lag_bytes: 200 })
        );
        // n2 gone: the two left must be compared, and n3 leads them.
        v.members.retain(|m| m.name != "n2");
        let r = rank(&v);
        assert_eq!(r.eligible, ["n3"]);
        // n3 gone too: nobody can be sure.
        v.members.retain(|m| m.name != "n3");
        assert_eq!(
            rank(&v).exclusion("n4"),
            Some(&ExclusionReason::QuorumUnseen { seen: 1, needed: 2 })
        );
    }

    #[test]
    fn quorum_ties_are_all_safe_and_broken_by_priority_then_name() {
        let v = quorum(&[("n3", 0), ("n2", 0), ("n4", 50)], &["n2", "n3", "n4"], 1);
        assert_eq!(rank(&v).eligible, ["n2", "n3"]);
        let mut v = quorum(&[("n3", 0), ("n2", 0)], &["n2", "n3"], 1);
        v.members[0].tags.failover_priority = 3;
        assert_eq!(rank(&v).eligible, ["n3", "n2"]);
    }

    #[test]
    fn quorum_a_higher_priority_behind_is_passed_over_not_waited_for() {
        let v = cluster()
            .replica("n2", 100)
            .with("n2", |m| m.tags.failover_priority = 9)
            .replica("n3", 0)
            .build();
        let v = ClusterView {
            sync_restricted: true,
            sync_members: vec!["n2".into(), "n3".into()],
            sync_quorum: Some(1),
            ..v
        };
        assert_eq!(rank(&v).eligible, ["n3"]);
    }

    #[test]
    fn quorum_counts_positions_of_listed_members_only_but_of_all_of_them() {
        // A nofailover standby is never promoted, yet its position may be
        // the one that holds the last commits.
        let v = cluster()
            .replica("n2", 100)
            .replica("n3", 0)
            .with("n3", |m| m.tags.nofailover = true)
            .replica("n4", 0)
            .build();
        let v = ClusterView {
            sync_restricted: true,
            sync_members: vec!["n2".into(), "n3".into()],
            sync_quorum: Some(1),
            ..v
        };
        let r = rank(&v);
        assert!(r.eligible.is_empty(), "{r:?}");
        assert_eq!(
            r.exclusion("n2"),
            Some(&ExclusionReason::QuorumBehind { lag_bytes: 100 })
        );
        assert_eq!(r.exclusion("n4"), Some(&ExclusionReason::NotSynchronous));
    }

    #[test]
    fn first_keeps_promoting_any_listed_standby() {
        // Every listed standby holds every acknowledged commit: priority
        // still decides, whatever the positions.
        for q in [None, Some(2)] {
            let mut v = quorum(&[("n2", 100), ("n3", 0)], &["n2", "n3"], 2);
            v.sync_quorum = q;
            v.members[0].tags.failover_priority = 2;
            assert_eq!(rank(&v).eligible, ["n2", "n3"], "{q:?}");
        }
        // A claim of nothing promotes nobody.
        let v = quorum(&[("n2", 0)], &[], 0);
        assert_eq!(
            rank(&v).exclusion("n2"),
            Some(&ExclusionReason::NotSynchronous)
        );
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
    fn a_running_primary_wins_a_tie_in_position() {
        let v = cluster()
            .replica("n1", 0)
            .replica("n3", 0)
            .with("n3", |m| m.role = MemberRole::Primary)
            .replica("n2", 10)
            .build();
        assert_eq!(rank(&v).eligible, ["n3", "n1", "n2"]);
        // Position still comes first.
        let v = cluster()
            .replica("n1", 0)
            .replica("n3", 10)
            .with("n3", |m| m.role = MemberRole::Primary)
            .build();
        assert_eq!(rank(&v).eligible, ["n1", "n3"]);
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
        assert_eq!(
            ExclusionReason::QuorumUnseen { seen: 1, needed: 2 }.to_string(),
            "only 1 listed synchronous standbys report a WAL position, 2 needed to know which \
             holds every acknowledged commit"
        );
        assert_eq!(
            ExclusionReason::QuorumBehind { lag_bytes: 8 }.to_string(),
            "8 bytes behind another listed synchronous standby, so it may lack acknowledged \
             commits"
        );
    }
}
