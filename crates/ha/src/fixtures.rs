//! Builders for cluster and local snapshots, so each test states only what
//! matters to it: `cluster().leader("n1").replica("n2", 300)`.

use std::time::{Duration, Instant};

use crate::member::{MemberRole, MemberState};
use crate::view::{ClusterView, FailoverRequest, LeaderInfo, LocalPg, LocalView};

pub(crate) const MIB: u64 = 1024 * 1024;

/// The wall clock of every local fixture: 2023-11-14T22:13:20Z.
pub(crate) const NOW_MS: u64 = 1_700_000_000_000;

/// Where the (last) leader's WAL stands in every fixture.
pub(crate) const LEADER_LSN: u64 = 0x3_0000_0000;

pub(crate) fn cluster() -> ClusterBuilder {
    ClusterBuilder {
        view: ClusterView {
            last_leader_lsn: Some(LEADER_LSN),
            ..ClusterView::default()
        },
    }
}

pub(crate) struct ClusterBuilder {
    view: ClusterView,
}

impl ClusterBuilder {
    /// `name` holds the leader key and runs as primary at [`LEADER_LSN`].
    pub(crate) fn leader(mut self, name: &str) -> Self {
        self.view.leader = Some(LeaderInfo {
            name: name.to_string(),
            lease_ttl_left: Some(Duration::from_secs(25)),
        });
        let mut m = member(name, 0);
        m.role = MemberRole::Primary;
        self.view.members.push(m);
        self
    }

    /// A leader key naming `name`, without adding a member.
    pub(crate) fn leader_key(mut self, name: &str) -> Self {
        self.view.leader = Some(LeaderInfo {
            name: name.to_string(),
            lease_ttl_left: None,
        });
        self
    }

    /// A standby cluster following `source`.
    pub(crate) fn standby_of(mut self, source: &str) -> Self {
        self.view.standby_cluster = Some(source.to_string());
        self
    }

    /// A streaming replica `lag` bytes behind the leader.
    pub(crate) fn replica(mut self, name: &str, lag: u64) -> Self {
        self.view.members.push(member(name, lag));
        self
    }

    /// Adjusts one member already added.
    pub(crate) fn with(mut self, name: &str, f: impl FnOnce(&mut MemberState)) -> Self {
        let m = self
            .view
            .members
            .iter_mut()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("fixture has no member {name}"));
        f(m);
        self
    }

    pub(crate) fn paused(mut self) -> Self {
        self.view.paused = true;
        self
    }

    pub(crate) fn failover_to(mut self, candidate: &str, forced: bool) -> Self {
        self.view.failover_request = Some(FailoverRequest {
            candidate: Some(candidate.to_string()),
            from_leader: None,
            forced,
            scheduled_at: None,
            released: false,
            ..FailoverRequest::default()
        });
        self
    }

    pub(crate) fn switchover(mut self, from: &str, to: &str) -> Self {
        self.view.failover_request = Some(FailoverRequest {
            candidate: Some(to.to_string()),
            from_leader: Some(from.to_string()),
            forced: false,
            scheduled_at: None,
            released: false,
            ..FailoverRequest::default()
        });
        self
    }

    /// The pending request was written `age` ago.
    pub(crate) fn requested_ago(mut self, age: Duration) -> Self {
        if let Some(r) = self.view.failover_request.as_mut() {
            r.age = Some(age);
        }
        self
    }

    /// The state right after the old leader `from` handed its key over to
    /// `to`: the key gone, the request marked released.
    pub(crate) fn handed_over(mut self, from: &str, to: &str) -> Self {
        self = self.switchover(from, to);
        if let Some(r) = self.view.failover_request.as_mut() {
            r.released = true;
        }
        self
    }

    /// A switchover from `from` to `to` scheduled at `at` (as stored).
    pub(crate) fn scheduled_switchover(mut self, from: &str, to: &str, at: &str) -> Self {
        self = self.switchover(from, to);
        if let Some(r) = self.view.failover_request.as_mut() {
            r.scheduled_at = Some(at.to_string());
        }
        self
    }

    pub(crate) fn build(self) -> ClusterView {
        self.view
    }
}

fn member(name: &str, lag: u64) -> MemberState {
    MemberState {
        timeline: 1,
        received_lsn: Some(LEADER_LSN - lag),
        replayed_lsn: Some(LEADER_LSN - lag),
        last_seen_ms_ago: 1_000,
        api_url: format!("http://{name}:8008"),
        ..MemberState::new(name)
    }
}

/// The local node: a running, streaming replica with a reachable DCS.
pub(crate) fn local(name: &str) -> LocalBuilder {
    // Far enough from the process start that `now - age` never underflows.
    let now = Instant::now() + Duration::from_secs(3_600);
    let mut view = LocalView::new(name, now);
    view.unix_ms = NOW_MS;
    view.postgres = LocalPg {
        running: true,
        in_recovery: true,
        timeline: 1,
        ..LocalPg::default()
    };
    LocalBuilder { view }
}

pub(crate) struct LocalBuilder {
    view: LocalView,
}

impl LocalBuilder {
    pub(crate) fn primary(mut self) -> Self {
        self.view.postgres.running = true;
        self.view.postgres.in_recovery = false;
        self
    }

    pub(crate) fn stopped(mut self) -> Self {
        self.view.postgres.running = false;
        self
    }

    /// Holds the lease, renewed one second ago.
    pub(crate) fn holding_lease(self) -> Self {
        self.renewed_ago(Duration::from_secs(1))
    }

    pub(crate) fn renewed_ago(mut self, age: Duration) -> Self {
        self.view.holds_lease = true;
        self.view.last_lease_renewal = Some(self.view.now - age);
        self
    }

    pub(crate) fn never_renewed(mut self) -> Self {
        self.view.holds_lease = true;
        self.view.last_lease_renewal = None;
        self
    }

    pub(crate) fn dcs_down(mut self) -> Self {
        self.view.dcs_reachable = false;
        self
    }

    pub(crate) fn start_failed_for(mut self, d: Duration) -> Self {
        self.view.postgres.start_failed_for = Some(d);
        self
    }

    pub(crate) fn build(self) -> LocalView {
        self.view
    }
}
