//! The agent's state as the rest of the process sees it: the REST API, the
//! connection manager's routing, `pgwarden ctl` through the API.
//!
//! The HA loop is the only writer; it swaps in a new [`AgentStatus`] after
//! every iteration, so readers never wait on the loop.

use std::sync::Arc;

use arc_swap::ArcSwap;
use pgwarden_dcs::ClusterSnapshot;
use pgwarden_ha::Timing;
use serde::Serialize;

use crate::cluster_settings::ClusterSettings;
use crate::record::MemberRecord;

/// A snapshot of the agent after one loop iteration.
#[derive(Clone, Debug, Serialize)]
pub struct AgentStatus {
    /// This member's record as last published (or about to be).
    pub member: MemberRecord,
    /// True while this agent's lease holds the leader key and its PostgreSQL
    /// runs as a primary: the one member that may take writes.
    pub is_leader: bool,
    /// True while this agent's lease holds the leader key of a standby
    /// cluster and its PostgreSQL streams from the remote source.
    pub standby_leader: bool,
    /// True while this agent's lease holds the leader key, whether its
    /// PostgreSQL runs or not (stopped in maintenance mode, say).
    pub holds_leader_key: bool,
    /// The leader key's holder, as last read.
    pub leader: Option<String>,
    /// The leader key's create revision: a new number for every leadership.
    pub leader_generation: i64,
    /// Every live member's connection manager has acknowledged
    /// `leader_generation` (cut its sessions to the previous primary), or
    /// the bounded wait for that has passed: writes may go to the leader.
    pub routing_ready: bool,
    /// Whether the last DCS request succeeded.
    pub dcs_reachable: bool,
    /// Milliseconds since the DCS last answered (0 when it just did).
    pub dcs_silent_ms: u64,
    /// Maintenance mode.
    pub paused: bool,
    /// The last decision, as logged.
    pub last_decision: String,
    /// The timings, lag limit, protection mode and failsafe in force.
    #[serde(skip)]
    pub settings: ClusterSettings,
    /// The node's own (its file's), which the dynamic configuration's
    /// replace.
    #[serde(skip)]
    pub node_settings: ClusterSettings,
    /// The cluster as last read from the DCS.
    #[serde(skip)]
    pub cluster: Option<ClusterSnapshot>,
    /// As the leader: the standbys connected to it, from
    /// `pg_stat_replication`, as Patroni's `/patroni` lists them.
    pub replication: Vec<ReplicationConnection>,
}

/// One row of the leader's `pg_stat_replication`, with Patroni's names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReplicationConnection {
    /// The role it logged in as.
    pub usename: String,
    /// The standby's `application_name` (a member's name).
    pub application_name: String,
    /// Its address, when it came over TCP.
    pub client_addr: Option<String>,
    /// `startup`, `catchup`, `streaming`, ...
    pub state: String,
    /// `async`, `potential`, `sync` or `quorum`.
    pub sync_state: String,
    /// Its place in `synchronous_standby_names` (0: not listed).
    pub sync_priority: i64,
}

impl AgentStatus {
    /// The status before the first loop iteration, with the defaults of
    /// every setting but the timing.
    pub fn initial(member: MemberRecord, timing: Timing) -> Self {
        let defaults = ClusterSettings {
            timing,
            maximum_lag_on_failover: pgwarden_ha::DEFAULT_MAXIMUM_LAG_ON_FAILOVER,
            sync: Default::default(),
            failsafe: false,
        };
        AgentStatus {
            member,
            is_leader: false,
            standby_leader: false,
            holds_leader_key: false,
            leader: None,
            leader_generation: 0,
            routing_ready: false,
            dcs_reachable: false,
            dcs_silent_ms: 0,
            paused: false,
            last_decision: "starting".into(),
            settings: defaults,
            node_settings: defaults,
            cluster: None,
            replication: Vec::new(),
        }
    }
}

/// Shared, lock-free access to the latest [`AgentStatus`].
pub type StatusHandle = Arc<ArcSwap<AgentStatus>>;

/// Where the HA loop answers an order: `Ok` when it carries it out, or
/// why not. Empty (the default), nobody waits. Every reply compares equal,
/// so commands still compare by what they ask.
#[derive(Clone, Debug, Default)]
pub struct Reply(Option<Arc<std::sync::Mutex<Option<ReplySender>>>>);

type ReplySender = tokio::sync::oneshot::Sender<Result<(), String>>;

impl Reply {
    /// A reply and where its answer arrives.
    pub fn new() -> (Reply, tokio::sync::oneshot::Receiver<Result<(), String>>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (Reply(Some(Arc::new(std::sync::Mutex::new(Some(tx))))), rx)
    }

    /// Answers; `false` if the one who asked stopped waiting, so the order
    /// is not carried out behind the back of a caller told it failed.
    pub fn send(&self, answer: Result<(), String>) -> bool {
        let Some(slot) = &self.0 else {
            return true;
        };
        let tx = slot.lock().ok().and_then(|mut s| s.take());
        tx.is_some_and(|tx| tx.send(answer).is_ok())
    }
}

impl PartialEq for Reply {
    fn eq(&self, _: &Reply) -> bool {
        true
    }
}

impl Eq for Reply {}

/// Requests to the HA loop from the API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Run an iteration now (something changed in the DCS).
    Wake,
    /// Restart the local PostgreSQL in its current role: at once, or keep
    /// the order until its time (replacing one kept before). An order
    /// given at once is answered through its [`Reply`] once its conditions
    /// are checked.
    Restart(crate::record::RestartOrder, Reply),
    /// Forget the scheduled restart; answered once the published status
    /// no longer shows it, or with why not (none is scheduled).
    CancelRestart(Reply),
    /// Throw the replica's data away and clone the leader again.
    Reinitialize,
    /// The node's file was reloaded: take its tags, parameters and
    /// callbacks (the rest needs a restart of the agent).
    Reconfigure(Box<pgwarden_config::AgentConfig>),
    /// Make the local PostgreSQL re-read its configuration.
    Reload,
    /// Stop for good: stop PostgreSQL, hand the leader key over at once
    /// rather than letting it expire, withdraw the member's record.
    Shutdown,
}
