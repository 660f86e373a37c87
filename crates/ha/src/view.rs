//! The two snapshots one HA loop iteration decides from: the cluster as read
//! from the DCS, and the local node as observed directly.
//!
//! Both are built once per iteration and never change while the decision is
//! made, so a decision can always be explained from the values it was given.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::member::MemberState;

/// The holder of the leader key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderInfo {
    /// Member name stored in the key.
    pub name: String,
    /// Time left on the key's lease, when the DCS reports it. A key seen with
    /// nothing left is about to vanish and counts as no leader.
    pub lease_ttl_left: Option<Duration>,
}

/// An operator's request to move leadership, read from the `failover` key.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FailoverRequest {
    /// The member that should become leader. Requests without one are left
    /// to the normal election.
    pub candidate: Option<String>,
    /// The leader to move away from; a switchover if set, a failover if not.
    pub from_leader: Option<String>,
    /// Skip the candidate's eligibility checks. This can lose data and is
    /// meant for a cluster with no healthy candidate left.
    pub forced: bool,
    /// When a scheduled switchover is to happen, as an RFC 3339 UTC
    /// timestamp; `None` for a request to carry out at once. See
    /// [`crate::schedule`].
    pub scheduled_at: Option<String>,
    /// Set by the old leader in the same transaction that deletes its key,
    /// once it stopped cleanly and saw the candidate receive its last WAL:
    /// only then may the candidate be judged without the lag and quorum
    /// checks. A switchover request still pending when the leader died or
    /// lost its key is judged like any failover.
    pub released: bool,
    /// When the API wrote it (Unix milliseconds); `None` for a request
    /// written otherwise.
    pub requested_ms: Option<u64>,
    /// How long ago that was when the view was read (not stored).
    #[serde(skip)]
    pub age: Option<Duration>,
}

/// The cluster as published in the DCS at the start of this iteration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// Who holds the leader key, if anyone.
    pub leader: Option<LeaderInfo>,
    /// Every member that has published its state, the local node included.
    pub members: Vec<MemberState>,
    /// The last WAL position the leader published; candidates are measured
    /// against it because a dead leader cannot be asked any more.
    pub last_leader_lsn: Option<u64>,
    /// Maintenance mode: agents keep observing but take no automatic action.
    pub paused: bool,
    /// A pending manual failover or switchover.
    pub failover_request: Option<FailoverRequest>,
    /// Members currently acting as synchronous standbys, for the protection
    /// modes that may promote only one of them.
    pub sync_members: Vec<String>,
    /// Whether only `sync_members` may be promoted automatically: the
    /// cluster runs synchronously and has not degraded.
    pub sync_restricted: bool,
    /// How many of `sync_members` hold each acknowledged commit; `None`:
    /// all of them (`FIRST`). Below that, the election must compare the
    /// positions of enough of them ([`crate::protection::Claim::needed`]).
    pub sync_quorum: Option<usize>,
    /// In a standby cluster, the remote source's address: the leader
    /// streams from it and is never promoted.
    pub standby_cluster: Option<String>,
}

impl ClusterView {
    /// The published state of one member.
    pub fn member(&self, name: &str) -> Option<&MemberState> {
        self.members.iter().find(|m| m.name == name)
    }

    /// Whether promotion is restricted by a quorum claim: each acknowledged
    /// commit is on fewer than all listed standbys, so an election must
    /// compare their positions.
    pub fn quorum_commit(&self) -> bool {
        self.sync_restricted
            && self
                .sync_quorum
                .is_some_and(|q| q > 0 && q < self.sync_members.len())
    }

    /// The leader key's holder, unless the key is missing or its lease has
    /// run out.
    pub fn current_leader(&self) -> Option<&LeaderInfo> {
        self.leader
            .as_ref()
            .filter(|l| !matches!(l.lease_ttl_left, Some(left) if left.is_zero()))
    }
}

/// The local PostgreSQL, observed directly rather than through the DCS.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalPg {
    /// Whether it accepts connections.
    pub running: bool,
    /// `pg_is_in_recovery()`: true on a replica.
    pub in_recovery: bool,
    /// Current timeline.
    pub timeline: u32,
    /// WAL received from upstream (on a primary: written locally).
    pub received_lsn: Option<u64>,
    /// WAL replayed.
    pub replayed_lsn: Option<u64>,
    /// How long attempts to start it have been failing; `None` when no start
    /// has failed yet. Bounds how long a leader may keep the key while down.
    pub start_failed_for: Option<Duration>,
}

/// The local node: its PostgreSQL, its hold on the lease, and the time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalView {
    /// This member's name.
    pub name: String,
    /// The local PostgreSQL.
    pub postgres: LocalPg,
    /// Whether this agent's own lease is attached to the leader key. The key
    /// naming this node is not enough: it may be a leftover from an earlier
    /// run whose lease this process cannot renew.
    pub holds_lease: bool,
    /// When the lease was last renewed successfully (or acquired).
    pub last_lease_renewal: Option<Instant>,
    /// The current time, passed in so decisions are reproducible.
    pub now: Instant,
    /// Whether the last DCS request succeeded; when false the cluster view is
    /// stale and must not be used to claim leadership.
    pub dcs_reachable: bool,
    /// The wall clock, Unix milliseconds, which times scheduled requests
    /// (the monotonic `now` cannot be compared with a calendar time). The
    /// agent passes the moment its iteration began, so that a request the
    /// loop woke up for is judged on time even when observing PostgreSQL
    /// and reading the DCS took a while on a loaded machine.
    pub unix_ms: u64,
}

impl LocalView {
    /// A node that is up, reachable, not leader, with PostgreSQL stopped:
    /// the state right after the agent starts.
    pub fn new(name: impl Into<String>, now: Instant) -> Self {
        LocalView {
            name: name.into(),
            postgres: LocalPg::default(),
            holds_lease: false,
            last_lease_renewal: None,
            now,
            dcs_reachable: true,
            unix_ms: 0,
        }
    }

    /// How long ago the lease was last renewed, if it ever was.
    pub fn lease_age(&self) -> Option<Duration> {
        self.last_lease_renewal
            .map(|at| self.now.saturating_duration_since(at))
    }

    /// Whether the local PostgreSQL is up and accepting writes.
    pub fn is_running_primary(&self) -> bool {
        self.postgres.running && !self.postgres.in_recovery
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expired_leader_key_is_no_leader() {
        let mut v = ClusterView {
            leader: Some(LeaderInfo {
                name: "n1".into(),
                lease_ttl_left: None,
            }),
            ..ClusterView::default()
        };
        assert_eq!(v.current_leader().map(|l| l.name.as_str()), Some("n1"));
        v.leader.as_mut().unwrap().lease_ttl_left = Some(Duration::from_secs(3));
        assert!(v.current_leader().is_some());
        v.leader.as_mut().unwrap().lease_ttl_left = Some(Duration::ZERO);
        assert!(v.current_leader().is_none());
    }

    #[test]
    fn quorum_commit_is_a_quorum_below_the_list() {
        let v = |restricted, members: &[&str], quorum| ClusterView {
            sync_restricted: restricted,
            sync_members: members.iter().map(|m| m.to_string()).collect(),
            sync_quorum: quorum,
            ..ClusterView::default()
        };
        assert!(v(true, &["a", "b"], Some(1)).quorum_commit());
        assert!(!v(true, &["a", "b"], Some(2)).quorum_commit());
        assert!(!v(true, &["a", "b"], None).quorum_commit());
        assert!(!v(false, &["a", "b"], Some(1)).quorum_commit());
        assert!(!v(true, &[], Some(0)).quorum_commit());
    }

    #[test]
    fn lease_age_never_goes_negative() {
        let t0 = Instant::now();
        let mut l = LocalView::new("n1", t0);
        assert_eq!(l.lease_age(), None);
        l.last_lease_renewal = Some(t0 + Duration::from_secs(1));
        assert_eq!(l.lease_age(), Some(Duration::ZERO));
    }
}
