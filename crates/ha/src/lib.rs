//! The high-availability brain of a pgwarden agent: how long a leader lease
//! lives, who may take it when it lapses, and what the local node should do
//! in one turn of the HA loop.
//!
//! This crate is deliberately pure. It opens no sockets, spawns no tasks and
//! never reads the clock: the agent observes etcd and the local PostgreSQL,
//! passes the snapshot and the current [`std::time::Instant`] in, and executes
//! the [`Decision`] that comes back. Every failover rule can therefore be
//! replayed in a unit test from a hand-written fixture.
//!
//! * [`rto`]: the timing presets, the `loop_wait + 2 × retry_timeout ≤ ttl`
//!   check, and timings derived from a target recovery time.
//! * [`member`]: what one member publishes about itself.
//! * [`view`]: the cluster snapshot read from the DCS and the local
//!   observation.
//! * [`election`]: which members may become leader, best first.
//! * [`identity`]: whether a data directory holds the cluster's database.
//! * [`protection`]: protection modes and the synchronous standby set.
//! * [`schedule`]: when a scheduled switchover is due.
//! * [`standby`]: standby clusters, which follow a PostgreSQL outside them.
//! * [`timeline`]: whether a standby's history forked off its source's.
//! * [`decide`](mod@decide): the action for this loop iteration.
//!
//! # Timing presets
//!
//! | preset | ttl | loop_wait | retry_timeout | primary_start_timeout | safety_margin | passive RTO min / avg / max | active RTO min / avg / max |
//! | --- | --- | --- | --- | --- | --- | --- | --- |
//! | `fast` | 20 s | 5 s | 5 s | 15 s | 5 s | 16 / 23 / 29 s | 1 / 24 / 29 s |
//! | `norm` | 30 s | 5 s | 10 s | 25 s | 5 s | 27 / 34 / 41 s | 2 / 35 / 41 s |
//! | `safe` | 60 s | 10 s | 20 s | 45 s | 10 s | 53 / 66 / 78 s | 3 / 61 / 73 s |
//! | `wide` | 120 s | 20 s | 30 s | 95 s | 15 s | 104 / 127 / 150 s | 4 / 122 / 145 s |
//!
//! The RTO columns are the Patroni + HAProxy model figures published with
//! these presets; they include a replica noticing the lapsed lease on its
//! next loop and HAProxy's health-check rise. pgwarden watches the leader key,
//! so that detection delay disappears; see [`Timing::expected_passive_rto`].

pub mod decide;
pub mod election;
pub mod identity;
pub mod member;
pub mod protection;
pub mod rto;
pub mod schedule;
pub mod standby;
pub mod timeline;
pub mod view;

mod secs;

#[cfg(test)]
mod fixtures;

pub use decide::{
    after_renewal, decide, AcquireReason, CancelReason, Decision, DemoteReason, ReleaseReason,
    StartMode, WaitReason, UNATTENDED_REQUEST,
};
pub use election::{
    is_best, rank_candidates, ElectionSettings, ExclusionReason, Ranking,
    DEFAULT_MAXIMUM_LAG_ON_FAILOVER,
};
pub use member::{MemberRole, MemberState, Tags};
pub use protection::{
    plan_sync, wanted_config, Claim, Protection, SyncConfig, SyncMethod, SyncObservation,
    SyncSettings, SyncState, SyncStep, NO_STANDBY,
};
pub use rto::{
    ParseRtoError, ReferenceRto, RtoPreset, RtoRange, RtoSetting, Timing, TimingError,
    TimingOverrides,
};
pub use schedule::{format_timestamp, overdue_after, parse_timestamp, Schedule, TimestampError};
pub use standby::StandbyCluster;
pub use view::{ClusterView, FailoverRequest, LeaderInfo, LocalPg, LocalView};
