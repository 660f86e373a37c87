//! The decision of one HA loop iteration.
//!
//! [`decide`] looks at the two snapshots and returns exactly one
//! [`Decision`]. The agent executes it and logs its `Display` form, which is
//! a complete sentence saying what happens and why; tests assert on the same
//! sentence, so the log is tested too.
//!
//! Safety comes first in every branch: a node stops accepting writes as soon
//! as it cannot prove it owns the leader key, and no node claims the key from
//! a stale view.

use std::fmt;
use std::time::Duration;

use crate::election::{is_best, rank_candidates, ElectionSettings, ExclusionReason, Ranking};
use crate::member::MemberRole;
use crate::rto::Timing;
use crate::schedule::{overdue_after, Schedule};
use crate::secs::Secs;
use crate::view::{ClusterView, LocalView};

/// What the agent should do in this iteration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// This node is the leader and all is well: refresh the lease.
    RenewLease,
    /// The leader key is free and this node should take it with a
    /// create-if-absent transaction, then promote once it won.
    AcquireLeader {
        /// Why this node rather than another.
        reason: AcquireReason,
    },
    /// This node holds the leader key but PostgreSQL is still in recovery:
    /// promote it (and keep renewing the lease).
    Promote,
    /// Stop accepting writes now: demote PostgreSQL to a replica (or stop
    /// it), and drop the leader key if this node still has it.
    Demote {
        /// What makes writes here unsafe.
        reason: DemoteReason,
    },
    /// Stream from `leader`; nothing to do if that is already the case.
    FollowLeader {
        /// The leader key's holder.
        leader: String,
    },
    /// This node leads a standby cluster: it keeps the leader key and
    /// streams from the remote source instead of taking writes (a primary
    /// is turned into a standby of it).
    FollowRemote {
        /// The remote source's address.
        source: String,
    },
    /// Start the local PostgreSQL.
    StartPostgres {
        /// In which role.
        mode: StartMode,
    },
    /// Make sure PostgreSQL takes no writes, then delete the leader key so
    /// that another member can be elected at once instead of after the ttl.
    ReleaseLeader {
        /// Why leadership is handed over.
        reason: ReleaseReason,
    },
    /// Change nothing and wait for the leader key to be settled.
    WaitForLeader {
        /// Why this node does not act itself.
        reason: WaitReason,
    },
    /// Maintenance mode: take no automatic action.
    Paused {
        /// The leader still refreshes its lease, so that resuming does not
        /// start with a failover.
        renew_lease: bool,
    },
    /// The leader, otherwise in good order, withdraws a scheduled switchover
    /// that can no longer be carried out at the time it was asked for.
    CancelSwitchover {
        /// Why.
        reason: CancelReason,
    },
}

impl Decision {
    /// Whether the agent must refresh the lease in this iteration.
    ///
    /// True for every decision a leader makes while it means to stay leader,
    /// not only [`Decision::RenewLease`]: a leader that is promoting or
    /// restarting PostgreSQL would otherwise lose the key halfway.
    pub fn keeps_lease(&self) -> bool {
        match self {
            Decision::RenewLease
            | Decision::Promote
            | Decision::FollowRemote { .. }
            | Decision::CancelSwitchover { .. } => true,
            Decision::StartPostgres { mode } => matches!(mode, StartMode::AsLeader { .. }),
            Decision::Paused { renew_lease } => *renew_lease,
            _ => false,
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::RenewLease => f.write_str("no action: I am the leader with the lock"),
            Decision::AcquireLeader { reason } => write!(f, "acquiring the leader key: {reason}"),
            Decision::Promote => f.write_str(
                "promoting PostgreSQL: this node holds the leader key but is still in recovery",
            ),
            Decision::Demote { reason } => write!(f, "demoting: {reason}"),
            Decision::FollowLeader { leader } => write!(f, "following the leader {leader}"),
            Decision::FollowRemote { source } => write!(
                f,
                "standby leader with the lock: streaming from the remote source {source}"
            ),
            Decision::StartPostgres { mode } => write!(f, "starting PostgreSQL {mode}"),
            Decision::ReleaseLeader { reason } => {
                write!(f, "releasing the leader key: {reason}")
            }
            Decision::WaitForLeader { reason } => write!(f, "waiting for a leader: {reason}"),
            Decision::Paused { renew_lease: true } => {
                f.write_str("paused: renewing the leader lease, no automatic failover")
            }
            Decision::Paused { renew_lease: false } => f.write_str("paused: no automatic failover"),
            Decision::CancelSwitchover {
                reason: r @ (CancelReason::Stale { .. } | CancelReason::Unattended { .. }),
            } => write!(f, "withdrawing the switchover request: {r}"),
            Decision::CancelSwitchover { reason } => {
                write!(f, "cancelling the scheduled switchover: {reason}")
            }
        }
    }
}

/// Why this node goes for the free leader key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcquireReason {
    /// It heads the ranking.
    BestCandidate,
    /// An operator asked for a failover to this node.
    FailoverRequested {
        /// Eligibility checks were skipped on the operator's word.
        forced: bool,
    },
    /// The key names this node, a running primary, but is bound to a
    /// lease this process does not hold (an earlier run's, or one a failed
    /// lease change left behind): bound to this process's lease instead,
    /// in one transaction on the name and that lease, as Patroni takes its
    /// own key back. Waiting for it to expire would leave the primary
    /// taking writes with no lease held, and no deadline to stop by.
    OwnKey,
    /// In maintenance mode the key is free and this node is a running
    /// primary (its lease ran out in an etcd outage, say): it takes the
    /// key back, as Patroni does, without an election's checks; nothing
    /// is promoted, and failing to take it demotes nothing.
    PausedPrimary,
}

impl fmt::Display for AcquireReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcquireReason::BestCandidate => f.write_str("this node is the best candidate"),
            AcquireReason::PausedPrimary => {
                f.write_str("maintenance mode: the key is free and this node is a running primary")
            }
            AcquireReason::FailoverRequested { forced: false } => {
                f.write_str("a manual failover named this node")
            }
            AcquireReason::FailoverRequested { forced: true } => {
                f.write_str("a forced manual failover named this node, eligibility not checked")
            }
            AcquireReason::OwnKey => {
                f.write_str("the key names this primary under a lease it no longer holds")
            }
        }
    }
}

/// Why this node must stop accepting writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DemoteReason {
    /// The lease has gone unrenewed for longer than the retry window, so it
    /// may lapse at any moment and another node may be promoted.
    LeaseRenewalFailed {
        /// Time since the last successful renewal.
        since: Duration,
        /// [`Timing::demote_after`]: `loop_wait + retry_timeout`.
        limit: Duration,
    },
    /// The DCS is unreachable and no renewal is on record (none since the
    /// agent started, or since it last demoted), so the lease cannot be
    /// shown to be alive.
    LeaseUnconfirmed,
    /// Another member holds the leader key.
    OtherLeader {
        /// That member.
        leader: String,
    },
    /// The leader key is free, but this node is not the one to take it.
    NoLeaderKey {
        /// Why not.
        because: WaitReason,
    },
}

impl fmt::Display for DemoteReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DemoteReason::LeaseRenewalFailed { since, limit } => write!(
                f,
                "the leader lease was last renewed {} ago, past loop_wait + retry_timeout ({})",
                Secs(*since),
                Secs(*limit)
            ),
            DemoteReason::LeaseUnconfirmed => f.write_str(
                "the DCS is unreachable and the leader lease was not renewed since this member started or last demoted",
            ),
            DemoteReason::OtherLeader { leader } => write!(f, "{leader} holds the leader key"),
            DemoteReason::NoLeaderKey { because } => {
                write!(f, "no leader key and {because}")
            }
        }
    }
}

/// Why the leader hands over the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReleaseReason {
    /// PostgreSQL stayed down for the whole start timeout.
    PostgresDidNotStart {
        /// [`Timing::primary_start_timeout`].
        timeout: Duration,
    },
    /// An operator asked for a switchover to another member.
    Switchover {
        /// The member that should take over.
        candidate: String,
    },
}

impl fmt::Display for ReleaseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReleaseReason::PostgresDidNotStart { timeout } => {
                write!(f, "PostgreSQL did not start within {}", Secs(*timeout))
            }
            ReleaseReason::Switchover { candidate } => {
                write!(f, "switching over to {candidate}")
            }
        }
    }
}

/// Why the leader withdraws a scheduled switchover.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CancelReason {
    /// Its time passed longer ago than [`crate::overdue_after`] allows
    /// (the candidate was not ready then, or the cluster was paused).
    Overdue {
        /// The time it was scheduled for, as stored.
        scheduled_at: String,
        /// How long ago that was.
        late: Duration,
    },
    /// Its time cannot be read.
    Unreadable {
        /// The stored value.
        scheduled_at: String,
    },
    /// A switchover request this leader must not act on and nobody else
    /// will: away from another (earlier) leader, or one whose key was
    /// handed over already and is now held again. Left in place, it would
    /// steer a later election.
    Stale {
        /// The leader it was meant to move away from.
        from_leader: String,
        /// Whether that leader had handed its key over.
        released: bool,
    },
    /// Not carried out within [`UNATTENDED_REQUEST`] of its writing (its
    /// candidate not ready, or a failover meant for a cluster without a
    /// leader): the API has given up on it. Left in place, it would be
    /// carried out whenever the candidate qualified, by whoever led then,
    /// and a forced one without the checks that keep acknowledged writes.
    Unattended {
        /// The member it named.
        candidate: String,
        /// How long ago it was written.
        age: Duration,
    },
}

/// How long an immediate switchover or failover request may wait to be
/// carried out: as long as the API waits for it.
pub const UNATTENDED_REQUEST: Duration = Duration::from_secs(30);

impl fmt::Display for CancelReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CancelReason::Overdue { scheduled_at, late } => write!(
                f,
                "it was due at {scheduled_at}, {} ago, and could not be carried out then",
                Secs(*late)
            ),
            CancelReason::Unreadable { scheduled_at } => {
                write!(f, "its time {scheduled_at:?} cannot be read")
            }
            CancelReason::Unattended { candidate, age } => write!(
                f,
                "nobody carried it out within {} of its request ({} ago; {candidate} was not ready)",
                Secs(UNATTENDED_REQUEST),
                Secs(*age)
            ),
            CancelReason::Stale {
                from_leader,
                released: true,
            } => write!(f, "{from_leader} handed its key over already"),
            CancelReason::Stale { from_leader, .. } => {
                write!(f, "it is away from {from_leader}, which no longer leads")
            }
        }
    }
}

/// Why a node without the leader key leaves it alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitReason {
    /// Another member ranks higher.
    BetterCandidate {
        /// The best-ranked member.
        name: String,
    },
    /// This node failed an eligibility check.
    NotEligible {
        /// Which one.
        reason: ExclusionReason,
    },
    /// This node has not published its member state, so no other agent
    /// would agree it is a candidate.
    NotInView,
    /// An operator asked for a failover to another member.
    FailoverRequested {
        /// That member.
        candidate: String,
    },
    /// The DCS cannot be reached, so the view may be stale.
    DcsUnreachable,
    /// The leader key names this node but belongs to a lease this process
    /// does not hold, left by an earlier run; only its expiry frees it.
    StaleOwnKey,
    /// The leader's lease has run out but etcd has not deleted the key yet
    /// (it does within half a second); the key cannot be taken before, and
    /// the deletion wakes every agent.
    KeyExpiring,
    /// This node set out to take the free key and did not get it (a check
    /// failed, another member was first, or the DCS failed).
    AcquireFailed,
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitReason::BetterCandidate { name } => write!(f, "{name} is a better candidate"),
            WaitReason::NotEligible { reason } => {
                write!(f, "this node is not eligible ({reason})")
            }
            WaitReason::NotInView => {
                f.write_str("this node has not published its member state yet")
            }
            WaitReason::FailoverRequested { candidate } => {
                write!(f, "a manual failover named {candidate}")
            }
            WaitReason::DcsUnreachable => f.write_str("the DCS is unreachable"),
            WaitReason::StaleOwnKey => f.write_str(
                "the leader key names this node but belongs to an earlier lease; \
                 waiting for it to expire",
            ),
            WaitReason::KeyExpiring => {
                f.write_str("the leader's lease has run out; waiting for etcd to delete its key")
            }
            WaitReason::AcquireFailed => f.write_str("taking the leader key did not succeed"),
        }
    }
}

/// In which role to start PostgreSQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartMode {
    /// As the primary, because this node holds the leader key.
    AsLeader {
        /// How long starts have been failing so far.
        failed_for: Duration,
        /// How long they may fail before the key is released.
        timeout: Duration,
    },
    /// As a replica of the current leader.
    ReplicaOf {
        /// The leader key's holder.
        leader: String,
    },
    /// In recovery with no upstream, so that it reports a WAL position and
    /// can stand in the coming election.
    Replica,
}

impl fmt::Display for StartMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartMode::AsLeader {
                failed_for,
                timeout,
            } if failed_for.is_zero() => write!(
                f,
                "as the leader (the leader key is released if it is not up within {})",
                Secs(*timeout)
            ),
            StartMode::AsLeader {
                failed_for,
                timeout,
            } => write!(
                f,
                "as the leader (failing for {} of the {} allowed)",
                Secs(*failed_for),
                Secs(*timeout)
            ),
            StartMode::ReplicaOf { leader } => write!(f, "as a replica of {leader}"),
            StartMode::Replica => f.write_str("as a replica to join the leader election"),
        }
    }
}

/// Decides what this node does in the current loop iteration.
///
/// The local node's own member entry is refreshed from `local` before the
/// ranking, since the published copy can be a whole loop old.
pub fn decide(
    cluster: &ClusterView,
    local: &LocalView,
    timing: &Timing,
    settings: &ElectionSettings,
) -> Decision {
    let mut view = with_local_observation(cluster, local);
    let cancel = scheduled_request(&mut view, local, timing);
    let ranking = rank_candidates(&view, settings);
    match view.current_leader() {
        Some(l) if l.name == local.name && local.holds_lease => {
            let manual = manual_ranking(&view, settings, &ranking, true);
            as_leader(&view, local, timing, &manual, cancel)
        }
        Some(l) if l.name == local.name => {
            if !local.dcs_reachable {
                // The view may be older than the key: it may have lapsed,
                // or been deleted when this process lost the lease, and
                // another member may lead by now. Nothing renews the key
                // from here, so a primary must stop as without a key.
                stand_by(&view, local, WaitReason::DcsUnreachable)
            } else if view.paused {
                Decision::Paused { renew_lease: false }
            } else if local.is_running_primary() {
                Decision::AcquireLeader {
                    reason: AcquireReason::OwnKey,
                }
            } else {
                Decision::WaitForLeader {
                    reason: WaitReason::StaleOwnKey,
                }
            }
        }
        Some(l) => as_follower(&view, local, &l.name),
        None => {
            let manual = manual_ranking(&view, settings, &ranking, false);
            without_leader(&view, local, &ranking, &manual)
        }
    }
}

/// The decision to carry out once the renewal that `decided` asked for
/// ([`Decision::keeps_lease`]) has been tried: `decided` itself if the
/// lease was renewed, otherwise the round decided again from `local` as it
/// stands after the attempt (the time read then, the hold on the lease as
/// the renewal left it, a failed request counted as an unreachable DCS).
///
/// [`decide`] runs before the renewal, and a renewal that keeps failing
/// retries up to the demotion deadline. Carried out as if the lease had
/// been renewed, `decided` would leave a primary taking writes until the
/// next round, a whole `loop_wait` past that deadline, which the lease
/// check `loop_wait + 2 × retry_timeout ≤ ttl` leaves no room for.
pub fn after_renewal(
    decided: Decision,
    renewed: bool,
    cluster: &ClusterView,
    local: &LocalView,
    timing: &Timing,
    settings: &ElectionSettings,
) -> Decision {
    if renewed || !decided.keeps_lease() {
        return decided;
    }
    decide(cluster, local, timing, settings)
}

/// Leaves a scheduled request in the view only while it is to be acted on:
/// its time has come (within [`overdue_after`]) and the cluster is not in
/// maintenance mode, where scheduled actions wait as in Patroni. Returns why
/// the leader should withdraw it, if it should.
fn scheduled_request(
    view: &mut ClusterView,
    local: &LocalView,
    timing: &Timing,
) -> Option<CancelReason> {
    let req = view.failover_request.as_ref()?;
    let at = req.scheduled_at.clone()?;
    let schedule = Schedule::of(Some(&at), local.unix_ms, overdue_after(timing));
    if !schedule.is_active() || view.paused {
        view.failover_request = None;
    }
    if view.paused {
        return None;
    }
    match schedule {
        Schedule::Overdue(late) => Some(CancelReason::Overdue {
            scheduled_at: at,
            late,
        }),
        Schedule::Unreadable => Some(CancelReason::Unreadable { scheduled_at: at }),
        _ => None,
    }
}

fn as_leader(
    view: &ClusterView,
    local: &LocalView,
    timing: &Timing,
    ranking: &Ranking,
    cancel: Option<CancelReason>,
) -> Decision {
    // In maintenance mode the operator owns PostgreSQL; demoting on a DCS
    // outage would be exactly the surprise pause is meant to rule out.
    if !view.paused {
        let limit = timing.demote_after();
        match local.lease_age() {
            Some(since) if since >= limit => {
                return Decision::Demote {
                    reason: DemoteReason::LeaseRenewalFailed { since, limit },
                }
            }
            None if !local.dcs_reachable => {
                return Decision::Demote {
                    reason: DemoteReason::LeaseUnconfirmed,
                }
            }
            _ => {}
        }
    }
    if cancel.is_none() {
        if let Some(reason) =
            stale_request(view, local).or_else(|| unattended_request(view, local, ranking))
        {
            return Decision::CancelSwitchover { reason };
        }
    }
    if let Some(candidate) = switchover_target(view, local, ranking) {
        return Decision::ReleaseLeader {
            reason: ReleaseReason::Switchover { candidate },
        };
    }
    if view.paused {
        return Decision::Paused { renew_lease: true };
    }
    let pg = &local.postgres;
    if !pg.running {
        // A crash just noticed has not failed any start yet; with a zero
        // timeout that still means "fail over at once".
        let failed_for = pg.start_failed_for.unwrap_or_default();
        let timeout = timing.primary_start_timeout;
        return if failed_for < timeout {
            Decision::StartPostgres {
                mode: StartMode::AsLeader {
                    failed_for,
                    timeout,
                },
            }
        } else {
            Decision::ReleaseLeader {
                reason: ReleaseReason::PostgresDidNotStart { timeout },
            }
        };
    }
    if let (Some(source), None) = (&view.standby_cluster, &cancel) {
        return Decision::FollowRemote {
            source: source.clone(),
        };
    }
    if pg.in_recovery && view.standby_cluster.is_none() {
        return Decision::Promote;
    }
    match cancel {
        Some(reason) => Decision::CancelSwitchover { reason },
        None => Decision::RenewLease,
    }
}

/// Why the leader should withdraw the pending switchover request, if it
/// is one left over: aimed at an earlier leader (this one took the key in
/// an election meanwhile), or handed over already (the candidate did not
/// take the key, and this node holds it again). Its `released` mark would
/// otherwise let a later election skip the checks for its candidate.
fn stale_request(view: &ClusterView, local: &LocalView) -> Option<CancelReason> {
    let req = view.failover_request.as_ref()?;
    let from = req.from_leader.as_deref()?;
    (from != local.name || req.released).then(|| CancelReason::Stale {
        from_leader: from.to_string(),
        released: req.released,
    })
}

/// Why the leader should withdraw a request nobody carried out in time,
/// if it is one: see [`CancelReason::Unattended`]. A switchover this
/// leader can carry out now still goes ahead.
fn unattended_request(
    view: &ClusterView,
    local: &LocalView,
    ranking: &Ranking,
) -> Option<CancelReason> {
    let req = view.failover_request.as_ref()?;
    let age = req.age.filter(|a| *a > UNATTENDED_REQUEST)?;
    if req.scheduled_at.is_some() {
        return None;
    }
    let actionable = req.from_leader.is_some() && switchover_target(view, local, ranking).is_some();
    (!actionable).then(|| CancelReason::Unattended {
        candidate: req.candidate.clone().unwrap_or_default(),
        age,
    })
}

/// The member a pending switchover away from this leader should go to, if
/// the request is one this leader should honour now.
fn switchover_target(view: &ClusterView, local: &LocalView, ranking: &Ranking) -> Option<String> {
    let req = view.failover_request.as_ref()?;
    let candidate = req.candidate.as_deref()?;
    if candidate == local.name {
        return None;
    }
    if req.from_leader.as_deref().is_some_and(|l| l != local.name) {
        // Aimed at an earlier leader; acting on it would bounce leadership.
        return None;
    }
    // The candidate receives this leader's last WAL as PostgreSQL stops
    // (its WAL senders wait for streaming standbys) or not at all: one
    // that is not streaming would be promoted without it.
    if !req.forced
        && view
            .member(candidate)
            .is_some_and(|m| m.streaming == Some(false))
    {
        return None;
    }
    candidate_ready(view, ranking, candidate, req.forced).then(|| candidate.to_string())
}

/// Whether `candidate` can take over right now: eligible, or at least
/// running when the operator forced the move.
fn candidate_ready(view: &ClusterView, ranking: &Ranking, candidate: &str, forced: bool) -> bool {
    ranking.is_eligible(candidate) || (forced && view.member(candidate).is_some_and(|m| m.running))
}

fn as_follower(view: &ClusterView, local: &LocalView, leader: &str) -> Decision {
    if view.paused {
        return Decision::Paused { renew_lease: false };
    }
    if local.is_running_primary() {
        return Decision::Demote {
            reason: DemoteReason::OtherLeader {
                leader: leader.to_string(),
            },
        };
    }
    if !local.postgres.running {
        return Decision::StartPostgres {
            mode: StartMode::ReplicaOf {
                leader: leader.to_string(),
            },
        };
    }
    Decision::FollowLeader {
        leader: leader.to_string(),
    }
}

/// The ranking that judges an operator's request. In a switchover the old
/// leader stops cleanly and hands the key over only once the candidate has
/// received its last WAL, so lag behind the last published position (a
/// loop old under load) does not disqualify the candidate: not for the
/// `leading` old leader, which checks that itself, nor for the members once
/// it handed the key over ([`crate::view::FailoverRequest::released`]). A
/// failover away from a lost leader keeps every check, and so does a
/// switchover request the old leader never acted on.
fn manual_ranking(
    view: &ClusterView,
    settings: &ElectionSettings,
    ranking: &Ranking,
    leading: bool,
) -> Ranking {
    match &view.failover_request {
        Some(req) if req.from_leader.is_some() && (leading || req.released) => {
            // Nor does the quorum rule: the candidate receives everything
            // the old leader wrote before it is promoted.
            let relaxed = ClusterView {
                last_leader_lsn: None,
                sync_quorum: None,
                ..view.clone()
            };
            rank_candidates(&relaxed, settings)
        }
        _ => ranking.clone(),
    }
}

fn without_leader(
    view: &ClusterView,
    local: &LocalView,
    ranking: &Ranking,
    manual: &Ranking,
) -> Decision {
    if !local.dcs_reachable {
        return stand_by(view, local, WaitReason::DcsUnreachable);
    }
    // A manual failover is honoured even in maintenance mode: it is the
    // operator acting, not the automation.
    if let Some(req) = &view.failover_request {
        if let Some(candidate) = req.candidate.as_deref() {
            if candidate == local.name {
                if local.postgres.running && (req.forced || manual.is_eligible(&local.name)) {
                    return acquire(
                        view,
                        local,
                        AcquireReason::FailoverRequested { forced: req.forced },
                    );
                }
            } else if candidate_ready(view, manual, candidate, req.forced) {
                return stand_by(
                    view,
                    local,
                    WaitReason::FailoverRequested {
                        candidate: candidate.to_string(),
                    },
                );
            }
        }
    }
    if view.paused {
        // Without a key holder the next resume would hold an election
        // beside a primary that still takes writes.
        if local.is_running_primary() {
            return acquire(view, local, AcquireReason::PausedPrimary);
        }
        return Decision::Paused { renew_lease: false };
    }
    if !local.postgres.running {
        return Decision::StartPostgres {
            mode: StartMode::Replica,
        };
    }
    if is_best(&local.name, ranking) {
        return acquire(view, local, AcquireReason::BestCandidate);
    }
    let reason = if view.member(&local.name).is_none() {
        WaitReason::NotInView
    } else if let Some(r) = ranking.exclusion(&local.name) {
        WaitReason::NotEligible { reason: r.clone() }
    } else {
        // Eligible but not first, so a best member exists.
        WaitReason::BetterCandidate {
            name: ranking.best().unwrap_or_default().to_string(),
        }
    };
    stand_by(view, local, reason)
}

/// Takes the free key, or waits for it when it is only nearly free: a key
/// whose lease has run out still exists until etcd deletes it, a
/// create-if-absent cannot succeed before, and an attempt would ask every
/// member for its position, the dead leader included, whose API may not
/// answer for seconds when its host is gone rather than refusing.
///
/// A running primary that only waits stops taking writes meanwhile: the
/// key it sees run out may be its own (a loop that stalled for a ttl) or
/// another's, and another member may take it the moment etcd deletes it.
fn acquire(view: &ClusterView, local: &LocalView, reason: AcquireReason) -> Decision {
    if let Some(key) = &view.leader {
        // This node's own key from an earlier run of its agent (a lease
        // this process does not hold): its primary keeps going until it
        // can take the key back, as while the key still had time left.
        if key.name == local.name && !local.holds_lease {
            return Decision::WaitForLeader {
                reason: WaitReason::KeyExpiring,
            };
        }
        return stand_by(view, local, WaitReason::KeyExpiring);
    }
    Decision::AcquireLeader { reason }
}

/// Leaves the key to others; a primary without the key must also stop
/// taking writes, or the next leader would be a split brain.
fn stand_by(view: &ClusterView, local: &LocalView, because: WaitReason) -> Decision {
    if view.paused {
        Decision::Paused { renew_lease: false }
    } else if local.is_running_primary() {
        Decision::Demote {
            reason: DemoteReason::NoLeaderKey { because },
        }
    } else {
        Decision::WaitForLeader { reason: because }
    }
}

/// The cluster view with this node's entry replaced by what was observed
/// locally a moment ago. Positions fall back to the published ones when the
/// local probe could not read them.
fn with_local_observation(cluster: &ClusterView, local: &LocalView) -> ClusterView {
    let mut view = cluster.clone();
    if let Some(me) = view.members.iter_mut().find(|m| m.name == local.name) {
        let pg = &local.postgres;
        me.running = pg.running;
        me.role = match (pg.running, pg.in_recovery) {
            (false, _) => MemberRole::Stopped,
            (true, true) => MemberRole::Replica,
            (true, false) => MemberRole::Primary,
        };
        if pg.running {
            me.timeline = pg.timeline;
        }
        me.received_lsn = pg.received_lsn.or(me.received_lsn);
        me.replayed_lsn = pg.replayed_lsn.or(me.replayed_lsn);
        me.last_seen_ms_ago = 0;
    }
    view
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{cluster, local, LEADER_LSN, MIB};
    use crate::rto::RtoPreset;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// One row of a rule's table: a scenario, the expected decision, and the
    /// sentence the agent will log for it.
    struct Case {
        name: &'static str,
        cluster: ClusterView,
        local: LocalView,
        want: Decision,
        says: &'static str,
    }

    fn check(cases: Vec<Case>) {
        let timing = Timing::preset(RtoPreset::Norm);
        let settings = ElectionSettings::for_timing(&timing);
        for c in cases {
            let got = decide(&c.cluster, &c.local, &timing, &settings);
            assert_eq!(got, c.want, "case {:?}", c.name);
            assert_eq!(got.to_string(), c.says, "case {:?}", c.name);
        }
    }

    fn wait(reason: WaitReason) -> Decision {
        Decision::WaitForLeader { reason }
    }

    #[test]
    fn healthy_leader_renews_its_lease() {
        check(vec![
            Case {
                name: "steady state",
                cluster: cluster().leader("n1").replica("n2", 100).build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::RenewLease,
                says: "no action: I am the leader with the lock",
            },
            Case {
                name: "one failed renewal is retried, not acted on",
                cluster: cluster().leader("n1").build(),
                local: local("n1")
                    .primary()
                    .renewed_ago(secs(14))
                    .dcs_down()
                    .build(),
                want: Decision::RenewLease,
                says: "no action: I am the leader with the lock",
            },
            Case {
                name: "just acquired, promotion still pending",
                cluster: cluster().leader("n1").build(),
                local: local("n1").holding_lease().build(),
                want: Decision::Promote,
                says: "promoting PostgreSQL: this node holds the leader key but is still in \
                       recovery",
            },
        ]);
    }

    #[test]
    fn a_standby_cluster_s_leader_follows_the_remote_source_and_is_never_promoted() {
        let remote = || Decision::FollowRemote {
            source: "10.0.0.5:5432".into(),
        };
        let says = "standby leader with the lock: streaming from the remote source 10.0.0.5:5432";
        check(vec![
            Case {
                name: "standby leader in recovery",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .standby_of("10.0.0.5:5432")
                    .build(),
                local: local("n1").holding_lease().build(),
                want: remote(),
                says,
            },
            Case {
                name: "a primary in a cluster made a standby cluster is turned into a standby",
                cluster: cluster().leader("n1").standby_of("10.0.0.5:5432").build(),
                local: local("n1").primary().holding_lease().build(),
                want: remote(),
                says,
            },
            Case {
                name: "the standby leader's PostgreSQL is started in its role",
                cluster: cluster().leader("n1").standby_of("10.0.0.5:5432").build(),
                local: local("n1").stopped().holding_lease().build(),
                want: Decision::StartPostgres {
                    mode: StartMode::AsLeader {
                        failed_for: Duration::ZERO,
                        timeout: secs(25),
                    },
                },
                says: "starting PostgreSQL as the leader (the leader key is released if it is \
                       not up within 25 s)",
            },
            Case {
                name: "the other members follow the standby leader",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .standby_of("10.0.0.5:5432")
                    .build(),
                local: local("n2").build(),
                want: Decision::FollowLeader {
                    leader: "n1".into(),
                },
                says: "following the leader n1",
            },
            Case {
                name: "without standby_cluster the same leader is promoted",
                cluster: cluster().leader("n1").replica("n2", 0).build(),
                local: local("n1").holding_lease().build(),
                want: Decision::Promote,
                says: "promoting PostgreSQL: this node holds the leader key but is still in \
                       recovery",
            },
        ]);
        assert!(remote().keeps_lease());
    }

    #[test]
    fn leader_demotes_before_its_lease_can_lapse() {
        check(vec![
            Case {
                name: "renewals failing for loop_wait + retry_timeout",
                cluster: cluster().leader("n1").build(),
                local: local("n1")
                    .primary()
                    .renewed_ago(secs(15))
                    .dcs_down()
                    .build(),
                want: Decision::Demote {
                    reason: DemoteReason::LeaseRenewalFailed {
                        since: secs(15),
                        limit: secs(15),
                    },
                },
                says: "demoting: the leader lease was last renewed 15 s ago, past loop_wait + \
                       retry_timeout (15 s)",
            },
            Case {
                name: "stale renewal even though the last request succeeded",
                cluster: cluster().leader("n1").build(),
                local: local("n1").primary().renewed_ago(secs(22)).build(),
                want: Decision::Demote {
                    reason: DemoteReason::LeaseRenewalFailed {
                        since: secs(22),
                        limit: secs(15),
                    },
                },
                says: "demoting: the leader lease was last renewed 22 s ago, past loop_wait + \
                       retry_timeout (15 s)",
            },
            Case {
                name: "no renewal on record and no DCS",
                cluster: cluster().leader("n1").build(),
                local: local("n1").primary().never_renewed().dcs_down().build(),
                want: Decision::Demote {
                    reason: DemoteReason::LeaseUnconfirmed,
                },
                says: "demoting: the DCS is unreachable and the leader lease was not renewed \
                       since this member started or last demoted",
            },
            Case {
                name: "demotion wins over restarting a crashed primary",
                cluster: cluster().leader("n1").build(),
                local: local("n1").stopped().renewed_ago(secs(16)).build(),
                want: Decision::Demote {
                    reason: DemoteReason::LeaseRenewalFailed {
                        since: secs(16),
                        limit: secs(15),
                    },
                },
                says: "demoting: the leader lease was last renewed 16 s ago, past loop_wait + \
                       retry_timeout (15 s)",
            },
        ]);
    }

    #[test]
    fn a_failed_renewal_is_acted_on_in_the_same_round() {
        let timing = Timing::preset(RtoPreset::Norm);
        let settings = ElectionSettings::for_timing(&timing);
        let view = cluster().leader("n1").replica("n2", 0).build();
        // The round's read succeeded a loop after the last renewal, so the
        // leader means to renew.
        let before = local("n1").primary().renewed_ago(secs(5)).build();
        let decided = decide(&view, &before, &timing, &settings);
        assert_eq!(decided, Decision::RenewLease);
        let after = |waited: u64, reachable: bool, holds_lease: bool| LocalView {
            now: before.now + secs(waited),
            dcs_reachable: reachable,
            holds_lease,
            ..before.clone()
        };
        let redecide = |renewed: bool, local: &LocalView| {
            after_renewal(decided.clone(), renewed, &view, local, &timing, &settings)
        };
        // The renewal retried for retry_timeout, to the demotion deadline.
        let at_deadline = redecide(false, &after(10, false, true));
        assert_eq!(
            at_deadline,
            Decision::Demote {
                reason: DemoteReason::LeaseRenewalFailed {
                    since: secs(15),
                    limit: secs(15),
                },
            }
        );
        assert_eq!(
            at_deadline.to_string(),
            "demoting: the leader lease was last renewed 15 s ago, past loop_wait + \
             retry_timeout (15 s)"
        );
        // One that failed early is retried, soon, by the next round.
        assert_eq!(
            redecide(false, &after(1, false, true)),
            Decision::RenewLease
        );
        // The key was gone or bound to another lease, and the view does not
        // show it yet: no longer carried out as the leader; the primary
        // takes the key back under its lease (or, failing, demotes).
        assert_eq!(
            redecide(false, &after(0, true, false)),
            Decision::AcquireLeader {
                reason: AcquireReason::OwnKey
            }
        );
        // A renewal that went through changes nothing, even late.
        assert_eq!(redecide(true, &after(10, true, true)), Decision::RenewLease);
        // Nor does the outcome matter to a decision that renews nothing.
        let demote = Decision::Demote {
            reason: DemoteReason::LeaseUnconfirmed,
        };
        assert_eq!(
            after_renewal(
                demote.clone(),
                false,
                &view,
                &after(0, true, true),
                &timing,
                &settings
            ),
            demote
        );
    }

    #[test]
    fn demotion_deadline_leaves_the_lease_unexpired() {
        for p in RtoPreset::ALL {
            let t = Timing::preset(p);
            // Demotion starts at the deadline and has one more retry window.
            assert!(t.demote_after() + t.retry_timeout <= t.ttl, "{p}");
        }
    }

    #[test]
    fn leader_with_postgres_down_restarts_then_hands_over() {
        check(vec![
            Case {
                name: "crash just noticed",
                cluster: cluster().leader("n1").replica("n2", 0).build(),
                local: local("n1").stopped().holding_lease().build(),
                want: Decision::StartPostgres {
                    mode: StartMode::AsLeader {
                        failed_for: Duration::ZERO,
                        timeout: secs(25),
                    },
                },
                says: "starting PostgreSQL as the leader (the leader key is released if it is \
                       not up within 25 s)",
            },
            Case {
                name: "restarts failing, still within the timeout",
                cluster: cluster().leader("n1").replica("n2", 0).build(),
                local: local("n1")
                    .stopped()
                    .holding_lease()
                    .start_failed_for(secs(24))
                    .build(),
                want: Decision::StartPostgres {
                    mode: StartMode::AsLeader {
                        failed_for: secs(24),
                        timeout: secs(25),
                    },
                },
                says: "starting PostgreSQL as the leader (failing for 24 s of the 25 s allowed)",
            },
            Case {
                name: "timeout reached",
                cluster: cluster().leader("n1").replica("n2", 0).build(),
                local: local("n1")
                    .stopped()
                    .holding_lease()
                    .start_failed_for(secs(25))
                    .build(),
                want: Decision::ReleaseLeader {
                    reason: ReleaseReason::PostgresDidNotStart { timeout: secs(25) },
                },
                says: "releasing the leader key: PostgreSQL did not start within 25 s",
            },
        ]);
    }

    #[test]
    fn zero_start_timeout_fails_over_at_once() {
        let timing = Timing {
            primary_start_timeout: Duration::ZERO,
            ..Timing::default()
        };
        let d = decide(
            &cluster().leader("n1").build(),
            &local("n1").stopped().holding_lease().build(),
            &timing,
            &ElectionSettings::default(),
        );
        assert_eq!(
            d.to_string(),
            "releasing the leader key: PostgreSQL did not start within 0 s"
        );
    }

    #[test]
    fn free_key_goes_to_the_best_candidate() {
        let free = || {
            cluster()
                .replica("n2", 100)
                .replica("n3", 500)
                .replica("n4", 0)
                .with("n4", |m| m.tags.nofailover = true)
        };
        check(vec![
            Case {
                name: "best takes it",
                cluster: free().build(),
                local: local("n2").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::BestCandidate,
                },
                says: "acquiring the leader key: this node is the best candidate",
            },
            Case {
                name: "second best waits",
                cluster: free().build(),
                local: local("n3").build(),
                want: wait(WaitReason::BetterCandidate { name: "n2".into() }),
                says: "waiting for a leader: n2 is a better candidate",
            },
            Case {
                name: "excluded node says why",
                cluster: free().build(),
                local: local("n4").build(),
                want: wait(WaitReason::NotEligible {
                    reason: ExclusionReason::NoFailoverTag,
                }),
                says: "waiting for a leader: this node is not eligible (tagged nofailover)",
            },
            Case {
                name: "too far behind",
                cluster: cluster().replica("n2", 0).replica("n3", 4 * MIB).build(),
                local: local("n3").build(),
                want: wait(WaitReason::NotEligible {
                    reason: ExclusionReason::LaggingTooMuch {
                        lag_bytes: 4 * MIB,
                        limit: MIB,
                    },
                }),
                says: "waiting for a leader: this node is not eligible (lagging 4194304 bytes \
                       behind the last leader position (limit 1048576))",
            },
            Case {
                name: "fresher local position overrides the published one",
                cluster: free().build(),
                local: {
                    let mut l = local("n3").build();
                    l.postgres.received_lsn = Some(LEADER_LSN);
                    l
                },
                want: Decision::AcquireLeader {
                    reason: AcquireReason::BestCandidate,
                },
                says: "acquiring the leader key: this node is the best candidate",
            },
            Case {
                name: "not published yet",
                cluster: free().build(),
                local: local("n9").build(),
                want: wait(WaitReason::NotInView),
                says: "waiting for a leader: this node has not published its member state yet",
            },
            Case {
                name: "an expired key is no leader, but not free until etcd deletes it",
                cluster: {
                    let mut v = free().leader_key("n1").build();
                    v.leader.as_mut().unwrap().lease_ttl_left = Some(Duration::ZERO);
                    v
                },
                local: local("n2").build(),
                want: wait(WaitReason::KeyExpiring),
                says: "waiting for a leader: the leader's lease has run out; waiting for etcd \
                       to delete its key",
            },
            Case {
                name: "a primary under a restarted agent waits for its own old key",
                cluster: {
                    let mut v = free().leader("n1").build();
                    v.leader.as_mut().unwrap().lease_ttl_left = Some(Duration::ZERO);
                    v
                },
                local: local("n1").primary().build(),
                want: wait(WaitReason::KeyExpiring),
                says: "waiting for a leader: the leader's lease has run out; waiting for etcd \
                       to delete its key",
            },
            Case {
                name: "a primary whose own key ran out stops taking writes while it waits",
                cluster: {
                    let mut v = free().leader("n1").build();
                    v.leader.as_mut().unwrap().lease_ttl_left = Some(Duration::ZERO);
                    v
                },
                local: local("n1").primary().holding_lease().build(),
                want: Decision::Demote {
                    reason: DemoteReason::NoLeaderKey {
                        because: WaitReason::KeyExpiring,
                    },
                },
                says: "demoting: no leader key and the leader's lease has run out; waiting for \
                       etcd to delete its key",
            },
            Case {
                name: "nor for a manual failover",
                cluster: {
                    let mut v = free().leader_key("n1").failover_to("n3", true).build();
                    v.leader.as_mut().unwrap().lease_ttl_left = Some(Duration::ZERO);
                    v
                },
                local: local("n3").build(),
                want: wait(WaitReason::KeyExpiring),
                says: "waiting for a leader: the leader's lease has run out; waiting for etcd \
                       to delete its key",
            },
            Case {
                name: "a primary not first in line still stops taking writes",
                cluster: {
                    let mut v = free().leader_key("n4").build();
                    v.leader.as_mut().unwrap().lease_ttl_left = Some(Duration::ZERO);
                    v
                },
                local: local("n3").primary().build(),
                want: Decision::Demote {
                    reason: DemoteReason::NoLeaderKey {
                        because: WaitReason::BetterCandidate { name: "n2".into() },
                    },
                },
                says: "demoting: no leader key and n2 is a better candidate",
            },
        ]);
    }

    #[test]
    fn nobody_claims_the_key_from_a_stale_or_empty_view() {
        check(vec![
            Case {
                name: "DCS unreachable",
                cluster: cluster().replica("n2", 0).build(),
                local: local("n2").dcs_down().build(),
                want: wait(WaitReason::DcsUnreachable),
                says: "waiting for a leader: the DCS is unreachable",
            },
            Case {
                name: "stopped node starts in recovery to join the election",
                cluster: cluster().replica("n2", 0).build(),
                local: local("n2").stopped().build(),
                want: Decision::StartPostgres {
                    mode: StartMode::Replica,
                },
                says: "starting PostgreSQL as a replica to join the leader election",
            },
        ]);
    }

    #[test]
    fn primary_without_the_key_stops_writes_unless_it_wins() {
        check(vec![
            Case {
                name: "key lost but still the best: take it back",
                cluster: cluster().replica("n1", 0).replica("n2", 300).build(),
                local: local("n1").primary().build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::BestCandidate,
                },
                says: "acquiring the leader key: this node is the best candidate",
            },
            Case {
                name: "key lost and another member ranks higher",
                cluster: cluster()
                    .replica("n1", 0)
                    .replica("n2", 0)
                    .with("n2", |m| m.tags.failover_priority = 5)
                    .build(),
                local: local("n1").primary().build(),
                want: Decision::Demote {
                    reason: DemoteReason::NoLeaderKey {
                        because: WaitReason::BetterCandidate { name: "n2".into() },
                    },
                },
                says: "demoting: no leader key and n2 is a better candidate",
            },
            Case {
                name: "key lost and the DCS is gone",
                cluster: cluster().replica("n1", 0).build(),
                local: local("n1").primary().dcs_down().build(),
                want: Decision::Demote {
                    reason: DemoteReason::NoLeaderKey {
                        because: WaitReason::DcsUnreachable,
                    },
                },
                says: "demoting: no leader key and the DCS is unreachable",
            },
        ]);
    }

    #[test]
    fn someone_else_leads() {
        check(vec![
            Case {
                name: "replica follows",
                cluster: cluster().leader("n1").replica("n2", 0).build(),
                local: local("n2").build(),
                want: Decision::FollowLeader {
                    leader: "n1".into(),
                },
                says: "following the leader n1",
            },
            Case {
                name: "a second primary is demoted",
                cluster: cluster().leader("n2").replica("n1", 0).build(),
                local: local("n1").primary().build(),
                want: Decision::Demote {
                    reason: DemoteReason::OtherLeader {
                        leader: "n2".into(),
                    },
                },
                says: "demoting: n2 holds the leader key",
            },
            Case {
                name: "believing it holds the lease does not beat the key",
                cluster: cluster().leader("n2").replica("n1", 0).build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::Demote {
                    reason: DemoteReason::OtherLeader {
                        leader: "n2".into(),
                    },
                },
                says: "demoting: n2 holds the leader key",
            },
            Case {
                name: "stopped replica is started against the leader",
                cluster: cluster().leader("n1").replica("n2", 0).build(),
                local: local("n2").stopped().build(),
                want: Decision::StartPostgres {
                    mode: StartMode::ReplicaOf {
                        leader: "n1".into(),
                    },
                },
                says: "starting PostgreSQL as a replica of n1",
            },
            Case {
                name: "own name in a key this process cannot renew, as a primary",
                cluster: cluster().leader("n1").build(),
                local: local("n1").primary().build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::OwnKey,
                },
                says: "acquiring the leader key: the key names this primary under a lease it \
                       no longer holds",
            },
            Case {
                name: "own name in a key this process cannot renew",
                cluster: cluster().leader("n1").build(),
                local: local("n1").stopped().build(),
                want: wait(WaitReason::StaleOwnKey),
                says: "waiting for a leader: the leader key names this node but belongs to an \
                       earlier lease; waiting for it to expire",
            },
        ]);
    }

    #[test]
    fn own_name_in_a_key_this_process_cannot_renew_while_the_dcs_is_unreachable() {
        // The lease was lost (the renewal found the key gone or rebound)
        // and the next read failed: the view still names this node, but
        // its key may have lapsed and another member may lead by now.
        check(vec![
            Case {
                name: "a running primary stops taking writes",
                cluster: cluster().leader("n1").replica("n2", 0).build(),
                local: local("n1").primary().dcs_down().build(),
                want: Decision::Demote {
                    reason: DemoteReason::NoLeaderKey {
                        because: WaitReason::DcsUnreachable,
                    },
                },
                says: "demoting: no leader key and the DCS is unreachable",
            },
            Case {
                name: "a stopped server is neither started nor promoted",
                cluster: cluster().leader("n1").replica("n2", 0).build(),
                local: local("n1").stopped().dcs_down().build(),
                want: wait(WaitReason::DcsUnreachable),
                says: "waiting for a leader: the DCS is unreachable",
            },
            Case {
                name: "a server in recovery is not promoted",
                cluster: cluster().leader("n1").replica("n2", 0).build(),
                local: local("n1").dcs_down().build(),
                want: wait(WaitReason::DcsUnreachable),
                says: "waiting for a leader: the DCS is unreachable",
            },
            Case {
                name: "maintenance mode still leaves the server alone",
                cluster: cluster().leader("n1").paused().build(),
                local: local("n1").primary().dcs_down().build(),
                want: Decision::Paused { renew_lease: false },
                says: "paused: no automatic failover",
            },
        ]);
    }

    #[test]
    fn pause_stops_automation_but_not_the_lease() {
        check(vec![
            Case {
                name: "leader keeps renewing",
                cluster: cluster().leader("n1").paused().build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::Paused { renew_lease: true },
                says: "paused: renewing the leader lease, no automatic failover",
            },
            Case {
                name: "leader is not demoted for a DCS outage",
                cluster: cluster().leader("n1").paused().build(),
                local: local("n1")
                    .primary()
                    .renewed_ago(secs(40))
                    .dcs_down()
                    .build(),
                want: Decision::Paused { renew_lease: true },
                says: "paused: renewing the leader lease, no automatic failover",
            },
            Case {
                name: "leader's crashed PostgreSQL is left alone",
                cluster: cluster().leader("n1").paused().build(),
                local: local("n1")
                    .stopped()
                    .holding_lease()
                    .start_failed_for(secs(60))
                    .build(),
                want: Decision::Paused { renew_lease: true },
                says: "paused: renewing the leader lease, no automatic failover",
            },
            Case {
                name: "no election for a free key",
                cluster: cluster().replica("n2", 0).paused().build(),
                local: local("n2").build(),
                want: Decision::Paused { renew_lease: false },
                says: "paused: no automatic failover",
            },
            Case {
                name: "a running primary takes a free key back",
                cluster: cluster().replica("n2", 0).paused().build(),
                local: local("n1").primary().build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::PausedPrimary,
                },
                says: "acquiring the leader key: maintenance mode: the key is free and this node is a running primary",
            },
            Case {
                name: "a stopped former primary does not",
                cluster: cluster().replica("n2", 0).paused().build(),
                local: local("n1").stopped().build(),
                want: Decision::Paused { renew_lease: false },
                says: "paused: no automatic failover",
            },
            Case {
                name: "no demotion of a second primary",
                cluster: cluster().leader("n2").replica("n1", 0).paused().build(),
                local: local("n1").primary().build(),
                want: Decision::Paused { renew_lease: false },
                says: "paused: no automatic failover",
            },
        ]);
    }

    #[test]
    fn manual_failover_names_the_winner() {
        check(vec![
            Case {
                name: "forced to a node that is not the best",
                cluster: cluster()
                    .replica("n2", 0)
                    .replica("n3", 5 * MIB)
                    .failover_to("n3", true)
                    .build(),
                local: local("n3").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::FailoverRequested { forced: true },
                },
                says: "acquiring the leader key: a forced manual failover named this node, \
                       eligibility not checked",
            },
            Case {
                name: "unforced to an eligible node that is not the best",
                cluster: cluster()
                    .replica("n2", 0)
                    .replica("n3", 300)
                    .failover_to("n3", false)
                    .build(),
                local: local("n3").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::FailoverRequested { forced: false },
                },
                says: "acquiring the leader key: a manual failover named this node",
            },
            Case {
                name: "unforced to an ineligible node falls back to the election",
                cluster: cluster()
                    .replica("n2", 0)
                    .replica("n3", 5 * MIB)
                    .failover_to("n3", false)
                    .build(),
                local: local("n2").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::BestCandidate,
                },
                says: "acquiring the leader key: this node is the best candidate",
            },
            Case {
                name: "the best node steps aside for the named one",
                cluster: cluster()
                    .replica("n2", 0)
                    .replica("n3", 300)
                    .failover_to("n3", false)
                    .build(),
                local: local("n2").build(),
                want: wait(WaitReason::FailoverRequested {
                    candidate: "n3".into(),
                }),
                says: "waiting for a leader: a manual failover named n3",
            },
            Case {
                name: "honoured during pause",
                cluster: cluster()
                    .replica("n2", 0)
                    .replica("n3", 300)
                    .failover_to("n3", false)
                    .paused()
                    .build(),
                local: local("n3").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::FailoverRequested { forced: false },
                },
                says: "acquiring the leader key: a manual failover named this node",
            },
            Case {
                name: "a dead forced candidate does not stall the cluster",
                cluster: cluster()
                    .replica("n2", 0)
                    .replica("n3", 0)
                    .with("n3", |m| m.running = false)
                    .failover_to("n3", true)
                    .build(),
                local: local("n2").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::BestCandidate,
                },
                says: "acquiring the leader key: this node is the best candidate",
            },
        ]);
    }

    /// A request nobody carried out within the API's wait is withdrawn by
    /// the leader, not left to be carried out whenever its candidate
    /// qualifies; one the leader can carry out now still goes ahead.
    #[test]
    fn a_request_left_unattended_is_withdrawn_by_the_leader() {
        let late = Duration::from_secs(31);
        let stopped_n2 = || {
            cluster()
                .leader("n1")
                .replica("n2", 0)
                .with("n2", |m| m.running = false)
        };
        check(vec![
            Case {
                name: "a switchover whose candidate is not ready, past the wait",
                cluster: stopped_n2().switchover("n1", "n2").requested_ago(late).build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::CancelSwitchover {
                    reason: CancelReason::Unattended {
                        candidate: "n2".into(),
                        age: late,
                    },
                },
                says: "withdrawing the switchover request: nobody carried it out within 30 s of its request (31 s ago; n2 was not ready)",
            },
            Case {
                name: "the same within the wait",
                cluster: stopped_n2()
                    .switchover("n1", "n2")
                    .requested_ago(Duration::from_secs(5))
                    .build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::RenewLease,
                says: "no action: I am the leader with the lock",
            },
            Case {
                name: "a forced failover whose candidate is down, past the wait",
                cluster: stopped_n2().failover_to("n2", true).requested_ago(late).build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::CancelSwitchover {
                    reason: CancelReason::Unattended {
                        candidate: "n2".into(),
                        age: late,
                    },
                },
                says: "withdrawing the switchover request: nobody carried it out within 30 s of its request (31 s ago; n2 was not ready)",
            },
            Case {
                name: "a switchover the leader can carry out now",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .switchover("n1", "n2")
                    .requested_ago(late)
                    .build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::ReleaseLeader {
                    reason: ReleaseReason::Switchover {
                        candidate: "n2".into(),
                    },
                },
                says: "releasing the leader key: switching over to n2",
            },
        ]);
    }

    #[test]
    fn switchover_releases_the_key_to_a_ready_candidate() {
        check(vec![
            Case {
                name: "to an eligible replica",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .switchover("n1", "n2")
                    .build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::ReleaseLeader {
                    reason: ReleaseReason::Switchover {
                        candidate: "n2".into(),
                    },
                },
                says: "releasing the leader key: switching over to n2",
            },
            Case {
                // Published positions are a loop old under load; the
                // candidate catches up with the stopped leader before it is
                // promoted, so lag does not stop a switchover.
                name: "to a lagging one too",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 8 * MIB)
                    .switchover("n1", "n2")
                    .build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::ReleaseLeader {
                    reason: ReleaseReason::Switchover {
                        candidate: "n2".into(),
                    },
                },
                says: "releasing the leader key: switching over to n2",
            },
            Case {
                name: "not to a stopped one",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .with("n2", |m| m.running = false)
                    .switchover("n1", "n2")
                    .build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::RenewLease,
                says: "no action: I am the leader with the lock",
            },
            Case {
                // Its WAL receiver down, it would not get the last WAL this
                // leader writes as it stops, and be promoted without it.
                name: "not to one that is not streaming",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .with("n2", |m| m.streaming = Some(false))
                    .switchover("n1", "n2")
                    .build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::RenewLease,
                says: "no action: I am the leader with the lock",
            },
            Case {
                name: "to one that streams",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .with("n2", |m| m.streaming = Some(true))
                    .switchover("n1", "n2")
                    .build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::ReleaseLeader {
                    reason: ReleaseReason::Switchover {
                        candidate: "n2".into(),
                    },
                },
                says: "releasing the leader key: switching over to n2",
            },
            Case {
                name: "not when aimed at another leader: it is withdrawn",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .switchover("n0", "n2")
                    .build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::CancelSwitchover {
                    reason: CancelReason::Stale {
                        from_leader: "n0".into(),
                        released: false,
                    },
                },
                says: "withdrawing the switchover request: it is away from n0, which no longer \
                       leads",
            },
            Case {
                name: "nor when handed over already and the key is held again",
                cluster: cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .handed_over("n1", "n2")
                    .build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::CancelSwitchover {
                    reason: CancelReason::Stale {
                        from_leader: "n1".into(),
                        released: true,
                    },
                },
                says: "withdrawing the switchover request: n1 handed its key over already",
            },
        ]);
    }

    #[test]
    fn a_scheduled_switchover_waits_for_its_time_then_runs_or_is_cancelled() {
        // NOW_MS is 2023-11-14T22:13:20Z; overdue after 7.5 s (norm).
        let sched = |at: &str| {
            cluster()
                .leader("n1")
                .replica("n2", 0)
                .scheduled_switchover("n1", "n2", at)
        };
        let release = Decision::ReleaseLeader {
            reason: ReleaseReason::Switchover {
                candidate: "n2".into(),
            },
        };
        check(vec![
            Case {
                name: "not yet",
                cluster: sched("2023-11-14T22:13:21Z").build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::RenewLease,
                says: "no action: I am the leader with the lock",
            },
            Case {
                name: "due now",
                cluster: sched("2023-11-14T22:13:20Z").build(),
                local: local("n1").primary().holding_lease().build(),
                want: release.clone(),
                says: "releasing the leader key: switching over to n2",
            },
            Case {
                name: "due, written in another zone, a loop late",
                cluster: sched("2023-11-15T00:13:15+02:00").build(),
                local: local("n1").primary().holding_lease().build(),
                want: release,
                says: "releasing the leader key: switching over to n2",
            },
            Case {
                name: "due but paused: scheduled actions wait",
                cluster: sched("2023-11-14T22:13:20Z").paused().build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::Paused { renew_lease: true },
                says: "paused: renewing the leader lease, no automatic failover",
            },
            Case {
                name: "overdue: withdrawn, not carried out late",
                cluster: sched("2023-11-14T22:13:10Z").build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::CancelSwitchover {
                    reason: CancelReason::Overdue {
                        scheduled_at: "2023-11-14T22:13:10Z".into(),
                        late: secs(10),
                    },
                },
                says: "cancelling the scheduled switchover: it was due at \
                       2023-11-14T22:13:10Z, 10 s ago, and could not be carried out then",
            },
            Case {
                name: "overdue while paused: left for later",
                cluster: sched("2023-11-14T22:13:10Z").paused().build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::Paused { renew_lease: true },
                says: "paused: renewing the leader lease, no automatic failover",
            },
            Case {
                name: "unreadable time",
                cluster: sched("at noon").build(),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::CancelSwitchover {
                    reason: CancelReason::Unreadable {
                        scheduled_at: "at noon".into(),
                    },
                },
                says: "cancelling the scheduled switchover: its time \"at noon\" cannot be read",
            },
            Case {
                name: "a crashed PostgreSQL comes first",
                cluster: sched("2023-11-14T22:13:10Z").build(),
                local: local("n1").stopped().holding_lease().build(),
                want: Decision::StartPostgres {
                    mode: StartMode::AsLeader {
                        failed_for: Duration::ZERO,
                        timeout: secs(25),
                    },
                },
                says: "starting PostgreSQL as the leader (the leader key is released if it is \
                       not up within 25 s)",
            },
        ]);
    }

    #[test]
    fn a_switchover_not_yet_due_does_not_steer_an_election() {
        let free = |at: &str| {
            cluster()
                .replica("n2", 0)
                .replica("n3", 300)
                .scheduled_switchover("n1", "n3", at)
        };
        check(vec![
            Case {
                name: "the best candidate takes the key",
                cluster: free("2023-11-14T22:20:00Z").build(),
                local: local("n2").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::BestCandidate,
                },
                says: "acquiring the leader key: this node is the best candidate",
            },
            Case {
                name: "the named candidate does not",
                cluster: free("2023-11-14T22:20:00Z").build(),
                local: local("n3").build(),
                want: wait(WaitReason::BetterCandidate { name: "n2".into() }),
                says: "waiting for a leader: n2 is a better candidate",
            },
            Case {
                name: "once due, it names the winner",
                cluster: free("2023-11-14T22:13:19Z").build(),
                local: local("n3").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::FailoverRequested { forced: false },
                },
                says: "acquiring the leader key: a manual failover named this node",
            },
            Case {
                name: "and the best one steps aside",
                cluster: free("2023-11-14T22:13:19Z").build(),
                local: local("n2").build(),
                want: wait(WaitReason::FailoverRequested {
                    candidate: "n3".into(),
                }),
                says: "waiting for a leader: a manual failover named n3",
            },
        ]);
    }

    #[test]
    fn quorum_commit_elects_only_a_member_known_to_hold_every_commit() {
        let q = |b: crate::fixtures::ClusterBuilder| {
            let mut v = b.build();
            v.sync_restricted = true;
            v.sync_members = vec!["n2".into(), "n3".into()];
            v.sync_quorum = Some(1);
            v
        };
        check(vec![
            Case {
                name: "the more advanced takes the key",
                cluster: q(cluster().replica("n2", 0).replica("n3", 64)),
                local: local("n2").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::BestCandidate,
                },
                says: "acquiring the leader key: this node is the best candidate",
            },
            Case {
                name: "the other says why not",
                cluster: q(cluster().replica("n2", 0).replica("n3", 64)),
                local: local("n3").build(),
                want: wait(WaitReason::NotEligible {
                    reason: ExclusionReason::QuorumBehind { lag_bytes: 64 },
                }),
                says: "waiting for a leader: this node is not eligible (64 bytes behind another \
                       listed synchronous standby, so it may lack acknowledged commits)",
            },
            Case {
                name: "without the other's position, nobody",
                cluster: q(cluster()
                    .replica("n2", 0)
                    .replica("n3", 0)
                    .with("n3", |m| m.last_seen_ms_ago = 60_000)),
                local: local("n2").build(),
                want: wait(WaitReason::NotEligible {
                    reason: ExclusionReason::QuorumUnseen { seen: 1, needed: 2 },
                }),
                says: "waiting for a leader: this node is not eligible (only 1 listed \
                       synchronous standbys report a WAL position, 2 needed to know which holds \
                       every acknowledged commit)",
            },
            Case {
                name: "a switchover to the one behind still happens: it catches up first",
                cluster: q(cluster()
                    .leader("n1")
                    .replica("n2", 0)
                    .replica("n3", 64)
                    .switchover("n1", "n3")),
                local: local("n1").primary().holding_lease().build(),
                want: Decision::ReleaseLeader {
                    reason: ReleaseReason::Switchover {
                        candidate: "n3".into(),
                    },
                },
                says: "releasing the leader key: switching over to n3",
            },
            Case {
                name: "a switchover request left by a leader that died is a failover: \
                       its candidate, behind, does not take the key",
                cluster: q(cluster()
                    .replica("n2", 0)
                    .replica("n3", 64)
                    .switchover("n1", "n3")),
                local: local("n3").build(),
                want: wait(WaitReason::NotEligible {
                    reason: ExclusionReason::QuorumBehind { lag_bytes: 64 },
                }),
                says: "waiting for a leader: this node is not eligible (64 bytes behind another \
                       listed synchronous standby, so it may lack acknowledged commits)",
            },
            Case {
                name: "and the one holding every commit does",
                cluster: q(cluster()
                    .replica("n2", 0)
                    .replica("n3", 64)
                    .switchover("n1", "n3")),
                local: local("n2").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::BestCandidate,
                },
                says: "acquiring the leader key: this node is the best candidate",
            },
            Case {
                name: "once the old leader handed the key over, the candidate takes it",
                cluster: q(cluster()
                    .replica("n2", 0)
                    .replica("n3", 64)
                    .handed_over("n1", "n3")),
                local: local("n3").build(),
                want: Decision::AcquireLeader {
                    reason: AcquireReason::FailoverRequested { forced: false },
                },
                says: "acquiring the leader key: a manual failover named this node",
            },
        ]);
    }

    #[test]
    fn only_leader_decisions_keep_the_lease() {
        let keeps = [
            Decision::RenewLease,
            Decision::Promote,
            Decision::StartPostgres {
                mode: StartMode::AsLeader {
                    failed_for: Duration::ZERO,
                    timeout: secs(1),
                },
            },
            Decision::Paused { renew_lease: true },
            Decision::CancelSwitchover {
                reason: CancelReason::Unreadable {
                    scheduled_at: String::new(),
                },
            },
        ];
        assert!(keeps.iter().all(Decision::keeps_lease));
        let drops = [
            Decision::Demote {
                reason: DemoteReason::LeaseUnconfirmed,
            },
            Decision::ReleaseLeader {
                reason: ReleaseReason::PostgresDidNotStart { timeout: secs(1) },
            },
            Decision::StartPostgres {
                mode: StartMode::Replica,
            },
            Decision::Paused { renew_lease: false },
            wait(WaitReason::NotInView),
        ];
        assert!(!drops.iter().any(Decision::keeps_lease));
    }
}
