//! The HA loop: observe, read the DCS, decide, act, publish — every
//! `loop_wait`, and at once when the leader key changes, the local
//! postmaster dies or the API asks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden_config::{AgentConfig, EtcdConfig};
use pgwarden_dcs::{ClusterSnapshot, EtcdDcs, HistoryEntry, LeaderWatch, LeaseId};
use pgwarden_ha::{
    after_renewal, decide, overdue_after, plan_sync, rank_candidates, wanted_config, AcquireReason,
    ClusterView, Decision, DemoteReason, ElectionSettings, MemberRole, MemberState, Protection,
    ReleaseReason, Schedule, StartMode, SyncConfig, SyncObservation, SyncState, SyncStep, Timing,
};
use pgwarden_pgctl::{PgCtlError, StopMode};
use pgwarden_topology::HostAddr;
use tokio::sync::{mpsc, watch};

use crate::cluster_settings::ClusterSettings;
use crate::handover;
use crate::postgres::{LocalPostgres, Observation};
use crate::record::{self, cluster_view, records, unix_ms, MemberRecord};
use crate::status::{AgentStatus, Command, Reply, StatusHandle};

/// How long a peer's API may take to report its WAL position during an
/// election before it is left out of the comparison.
const PEER_TIMEOUT: Duration = Duration::from_secs(2);

/// Retry pace while something is failing (DCS, a start), well inside any
/// retry window.
const RETRY_PACE: Duration = Duration::from_secs(1);

/// How often a standby leader that does not stream compares its history
/// with its remote source's: two connections to a source that may be
/// slow to answer, so not at every round.
const FORK_CHECK_PACE: Duration = Duration::from_secs(5);

/// Pace while a new leadership waits for the connection managers'
/// acknowledgements, so writes resume within a fraction of a second.
const ACK_PACE: Duration = Duration::from_millis(200);

/// How the loop talks to the rest of the process.
pub(crate) struct LoopLinks {
    pub(crate) status: StatusHandle,
    pub(crate) changes: watch::Sender<u64>,
    pub(crate) commands: mpsc::Receiver<Command>,
    pub(crate) routing_ack: Arc<std::sync::atomic::AtomicI64>,
    pub(crate) stopped: Arc<tokio::sync::Notify>,
    pub(crate) failsafe_seen: Arc<std::sync::atomic::AtomicU64>,
    /// The REST API's credentials, which the connection managers' pause
    /// and resume also take.
    pub(crate) credentials: Arc<crate::api::Credentials>,
    /// Cleared once a reinitialize the API passed on is done.
    pub(crate) reinitializing: Arc<std::sync::atomic::AtomicBool>,
    /// Set, once, to why the agent gave up.
    pub(crate) failed: watch::Sender<Option<String>>,
}

/// One agent's loop and the state it keeps between iterations.
pub(crate) struct HaLoop {
    pub(crate) cfg: AgentConfig,
    pub(crate) etcd: EtcdConfig,
    pub(crate) dcs: EtcdDcs,
    pub(crate) pg: LocalPostgres,
    pub(crate) status: StatusHandle,
    pub(crate) changes: watch::Sender<u64>,
    pub(crate) commands: mpsc::Receiver<Command>,
    pub(crate) timing: Timing,
    pub(crate) settings: ElectionSettings,
    /// The protection mode in force: the node's, or the dynamic
    /// configuration's.
    sync: pgwarden_ha::SyncSettings,
    /// Failsafe in force: the node's, or the dynamic configuration's.
    failsafe: bool,
    lease: Option<LeaseId>,
    /// The TTL `lease` was granted with.
    lease_ttl: Duration,
    /// A lease the leader key was being moved to (a new TTL) when etcd's
    /// answer was lost, and the timing that came with it: the key may be
    /// bound to it already.
    lease_moving: Option<(LeaseId, Timing)>,
    last_renewal: Option<Instant>,
    /// A switchover this leader abandoned, or did not begin for want of a
    /// renewal, kept it leading this round ([`Self::release`]): the
    /// watchdog and fence stay armed.
    kept_key: bool,
    /// The renewal ([`Self::last_renewal`]) the watchdog was last fed for.
    watchdog_fed_for: Option<Instant>,
    /// The revision of a switchover request this leader abandoned but
    /// could not withdraw: not acted on again.
    abandoned_request: Option<i64>,
    dcs_ok: bool,
    last_dcs_ok: Instant,
    snapshot: ClusterSnapshot,
    /// This data directory has run as a primary since it last streamed from
    /// a leader, so its history may have forked: rewind before following.
    former_primary: bool,
    /// The data directory was just rewound (or found not to need it) onto
    /// the leader's history, and is to start as its replica as it is. A
    /// second rejoin would find the state pg_rewind leaves (not a clean
    /// shutdown), run crash recovery on it as a primary, writing WAL of
    /// its own on the leader's timeline, and then need no rewind.
    rejoined: bool,
    /// This agent started the server as a replica right after a rejoin,
    /// and it has not answered yet: it replays up to consistency, which
    /// after a long divergence takes more than a round, and is left to.
    recovering_after_rejoin: bool,
    /// Why a former primary last waited to rejoin, logged once.
    rejoin_wait: Option<String>,
    start_failed_since: Option<Instant>,
    /// What the agent itself is doing, when that says more than the
    /// server's state (`rewinding`, `cloning`).
    activity: Option<&'static str>,
    problem: Option<String>,
    last_decision: String,
    last_role: Option<MemberRole>,
    obs: Observation,
    routing_ack: Arc<std::sync::atomic::AtomicI64>,
    stopped: Arc<tokio::sync::Notify>,
    /// The leader generation being acknowledged, and since when.
    ack_wait: (i64, Instant),
    routing_ready: bool,
    watchdog: crate::watchdog::Watchdog,
    /// Why a required watchdog cannot be used; such a member stays out of
    /// elections.
    watchdog_problem: Option<String>,
    /// What PostgreSQL reports wrong in its configuration files (a value
    /// it refuses, from the dynamic configuration or the node's file): the
    /// server keeps its old settings, and would not start again.
    config_problem: Option<String>,
    /// What `synchronous_standby_names` makes PostgreSQL wait for, as this
    /// agent last set it.
    sync_applied: SyncConfig,
    /// The leader's WAL position once `sync_applied` was in effect; read on
    /// the iteration after the change, so every walsender has it too.
    sync_applied_at: Option<u64>,
    /// Since when commits have had no acknowledging standby.
    sync_blocked_since: Option<(Instant, u64)>,
    /// The synchronous set is not yet what the settings want.
    sync_pending: bool,
    proxy_url: Option<String>,
    /// Armed while this node leads.
    fence: Option<crate::fence::Fence>,
    /// When (Unix ms) a failsafe round last succeeded, or this member last
    /// acknowledged a leader's.
    failsafe_seen: Arc<std::sync::atomic::AtomicU64>,
    credentials: Arc<crate::api::Credentials>,
    reinitializing: Arc<std::sync::atomic::AtomicBool>,
    /// The leader (name, API URL) this member acknowledged through an
    /// etcd outage, while etcd has no leader key since: its lease ran out
    /// while it kept leading on the members' word, so it may still be the
    /// primary with the newest writes.
    failsafe_leader: Option<(String, String)>,
    /// The revision of the scheduled switchover request last logged.
    scheduled_seen: Option<i64>,
    /// The data directory is known to hold the cluster's database (or its
    /// identifier cannot be read): until then PostgreSQL is not started
    /// and the member takes no part.
    identity_known: bool,
    /// Why this agent must stop managing its node, once it must.
    fatal: Option<String>,
    /// A restart ordered for later through the API.
    scheduled_restart: Option<crate::record::RestartOrder>,
    /// The dynamic configuration's PostgreSQL parameters as last written.
    dynamic_applied: std::collections::BTreeMap<String, String>,
    /// When settings were last written and PostgreSQL told to reload.
    reloaded_at: Option<Instant>,
    /// The dynamic parameters last refused, so it is logged once.
    dynamic_refused: Option<String>,
    /// Since when each of our replication slots has been unneeded.
    slots_unwanted: std::collections::HashMap<String, Instant>,
    /// The dynamic configuration's permanent slots, as last read well.
    permanent_slots: std::collections::BTreeSet<String>,
    /// The permanent slots last refused, so it is logged once.
    slots_refused: Option<String>,
    /// The last failed slot change, so it is logged once.
    slot_error: Option<String>,
    /// The member PostgreSQL was last pointed at as its upstream.
    upstream: Option<String>,
    /// Since when this standby leader has not streamed from the remote
    /// source.
    remote_silent_since: Option<Instant>,
    /// When this standby leader last compared its history with the remote
    /// source's, so that a source that is slow to answer is not asked at
    /// every round.
    remote_fork_checked: Option<Instant>,
    /// While a long step (a clone, a restore, a rewind) holds up the loop:
    /// what keeps this member's record in etcd meanwhile.
    presence: Option<Presence>,
    /// As the leader: the standbys connected to it, as last read.
    replication: Vec<crate::status::ReplicationConnection>,
    /// As the leader: how far each permanent logical slot's consumer has
    /// confirmed, published with the lease for the replicas to follow.
    logical_positions: std::collections::BTreeMap<String, u64>,
    /// As a replica: when each logical slot was last copied from the
    /// leader, so that a copy PostgreSQL does not load costs one restart,
    /// not one per loop.
    logical_copied: std::collections::HashMap<String, Instant>,
    /// As a replica: per copy, the leader's `catalog_xmin` for that slot
    /// when this replica's feedback first reached the leader, and whether
    /// the copy is safe to decode from after a failover.
    logical_ready: std::collections::BTreeMap<String, (Option<u32>, bool)>,
    /// The dynamic cluster settings last refused, so it is logged once.
    settings_refused: Option<String>,
    failed: watch::Sender<Option<String>>,
}

impl HaLoop {
    pub(crate) fn new(
        cfg: AgentConfig,
        proxy_url: Option<String>,
        etcd: EtcdConfig,
        dcs: EtcdDcs,
        pg: LocalPostgres,
        links: LoopLinks,
    ) -> Self {
        let LoopLinks {
            status,
            changes,
            commands,
            routing_ack,
            stopped,
            failsafe_seen,
            credentials,
            reinitializing,
            failed,
        } = links;
        let timing = cfg.timing;
        let settings = ElectionSettings {
            maximum_lag_on_failover: cfg.maximum_lag_on_failover,
            ttl: timing.ttl,
        };
        HaLoop {
            etcd,
            dcs,
            pg,
            status,
            changes,
            commands,
            timing,
            settings,
            sync: cfg.sync,
            failsafe: cfg.failsafe,
            lease: None,
            lease_ttl: timing.ttl,
            lease_moving: None,
            last_renewal: None,
            kept_key: false,
            watchdog_fed_for: None,
            abandoned_request: None,
            dcs_ok: false,
            last_dcs_ok: Instant::now(),
            snapshot: ClusterSnapshot::default(),
            former_primary: false,
            rejoined: false,
            recovering_after_rejoin: false,
            rejoin_wait: None,
            start_failed_since: None,
            activity: None,
            problem: None,
            last_decision: String::new(),
            last_role: None,
            obs: Observation::default(),
            routing_ack,
            stopped,
            ack_wait: (0, Instant::now()),
            routing_ready: false,
            watchdog: crate::watchdog::Watchdog::new(
                &cfg.watchdog,
                timing.ttl.saturating_sub(timing.safety_margin),
            ),
            watchdog_problem: None,
            config_problem: None,
            sync_applied: SyncConfig::none(),
            sync_applied_at: None,
            sync_blocked_since: None,
            sync_pending: false,
            proxy_url,
            fence: None,
            failsafe_seen,
            credentials,
            reinitializing,
            failsafe_leader: None,
            scheduled_seen: None,
            identity_known: false,
            fatal: None,
            scheduled_restart: None,
            dynamic_applied: Default::default(),
            reloaded_at: None,
            dynamic_refused: None,
            settings_refused: None,
            slots_unwanted: Default::default(),
            permanent_slots: Default::default(),
            slots_refused: None,
            slot_error: None,
            upstream: None,
            remote_silent_since: None,
            remote_fork_checked: None,
            presence: None,
            replication: Vec::new(),
            logical_positions: Default::default(),
            logical_copied: Default::default(),
            logical_ready: Default::default(),
            failed,
            cfg,
        }
    }

    /// Bootstraps the data directory if there is none, then loops until the
    /// runtime shuts down.
    pub(crate) async fn run(mut self) {
        self.pg.supervise();
        if let Err(e) = self.watchdog.probe() {
            if self.watchdog.required() {
                tracing::error!("watchdog required but unusable, this member will not lead: {e}");
                self.watchdog_problem = Some(format!("watchdog required but unusable: {e}"));
            } else {
                tracing::warn!("no watchdog ({e}); leading without one");
            }
        }
        let crashes = self.pg.crashes();
        let mut leader_watch = self.dcs.watch_leader().await;
        let mut request_watch = self.dcs.watch_failover().await;
        self.bootstrap(&mut leader_watch).await;
        loop {
            self.iterate().await;
            if let Some(why) = self.fatal.take() {
                self.give_up(why).await;
                return;
            }
            if self.until_restart() == Some(Duration::ZERO) {
                if let Some(order) = self.scheduled_restart.take() {
                    self.restart_if(order, Reply::default()).await;
                }
            }
            // A leader key whose lease has run out is deleted by etcd within
            // half a second; the watch says when, and the short pace covers
            // a watch that is being re-established.
            let expiring = self
                .snapshot
                .leader
                .as_ref()
                .is_some_and(|l| l.ttl_left.is_some_and(|t| t.is_zero()));
            let pace = if (!self.routing_ready && self.snapshot.leader.is_some())
                || self.sync_pending
                || expiring
            {
                ACK_PACE
            } else if !self.dcs_ok || self.start_failed_since.is_some() || !self.obs.pg.running {
                RETRY_PACE.min(self.timing.loop_wait)
            } else {
                self.timing.loop_wait
            };
            // A scheduled switchover runs at its time, not up to a loop
            // later.
            let pace = self.until_scheduled().map_or(pace, |d| pace.min(d));
            let pace = self.until_restart().map_or(pace, |d| pace.min(d));
            tokio::select! {
                _ = tokio::time::sleep(pace) => {}
                ev = leader_watch.next() => {
                    tracing::debug!(event = ?ev, "leader key changed");
                }
                ev = request_watch.next() => {
                    tracing::debug!(event = ?ev, "switchover request changed");
                }
                _ = crashes.notified() => {}
                cmd = self.commands.recv() => match cmd {
                    Some(Command::Restart(order, reply)) if order.at_ms.is_some() => {
                        // Decided here, not on the published status: two
                        // requests at once would both pass that check.
                        if let Some(earlier) = &self.scheduled_restart {
                            reply.send(Err(format!(
                                "a restart is already scheduled at {}; DELETE /restart first",
                                earlier.schedule.as_deref().unwrap_or("?")
                            )));
                        } else {
                            // Published before the answer, so that the
                            // caller's next look finds it; taken back if
                            // the caller stopped waiting.
                            let at = order.schedule.clone().unwrap_or_default();
                            self.scheduled_restart = Some(order);
                            self.publish_status();
                            if reply.send(Ok(())) {
                                tracing::info!(at, "restart scheduled");
                            } else {
                                self.scheduled_restart = None;
                                self.publish_status();
                            }
                        }
                    }
                    Some(Command::Restart(order, reply)) => self.restart_if(order, reply).await,
                    Some(Command::Reconfigure(new)) => self.reconfigure(*new).await,
                    Some(Command::Reinitialize) => {
                        self.reinitialize().await;
                        self.reinitializing
                            .store(false, std::sync::atomic::Ordering::SeqCst);
                    }
                    Some(Command::CancelRestart(reply)) => {
                        if self.scheduled_restart.take().is_some() {
                            tracing::info!("scheduled restart cancelled");
                            self.publish_status();
                            reply.send(Ok(()));
                        } else {
                            reply.send(Err("no restart is scheduled".into()));
                        }
                    }
                    Some(Command::Reload) => {
                        if self.pg.with(|i| i.reload()).await.is_ok() {
                            self.reloaded();
                        }
                    }
                    Some(Command::Shutdown) => {
                        self.shutdown().await;
                        return;
                    }
                    Some(Command::Wake) | None => {}
                },
            }
        }
    }

    /// Creates the data directory of a new member: the first member of an
    /// empty cluster wins the `initialize` key and runs initdb; every other
    /// member clones the leader.
    async fn bootstrap(&mut self, leader_watch: &mut LeaderWatch) {
        if self.pg.has_data().await {
            self.adopt_sync_setting().await;
            let state = self.control_state().await;
            // A data directory last shut down (or crashed) as a primary may
            // have diverged from whoever leads now.
            self.former_primary = matches!(state.as_deref(), Some("in production" | "shut down"));
            tracing::info!(
                state = state.as_deref().unwrap_or("unknown"),
                former_primary = self.former_primary,
                "existing data directory"
            );
            return;
        }
        loop {
            match self.dcs.read_cluster().await {
                Ok(snap) => {
                    self.snapshot = snap;
                    self.dcs_ok = true;
                    match self.try_bootstrap().await {
                        Ok(true) => return,
                        Ok(false) => {}
                        Err(e) => {
                            tracing::error!(error = %e, "bootstrap step failed; retrying");
                            self.problem = Some(format!("bootstrap: {e}"));
                            let _ = self.pg.with(|i| i.wipe()).await;
                        }
                    }
                }
                Err(e) => {
                    self.dcs_ok = false;
                    tracing::warn!(error = %e, "cannot read the DCS to bootstrap");
                }
            }
            self.publish_status();
            tokio::select! {
                _ = tokio::time::sleep(RETRY_PACE) => {}
                _ = leader_watch.next() => {}
            }
        }
    }

    /// Takes back what an earlier run of the agent made PostgreSQL wait
    /// for. The settings file it rewrites holds every setting it knows of:
    /// without this, the first rewrite (dynamic parameters, say) would
    /// drop `synchronous_standby_names` from a primary still running, and
    /// commits would be acknowledged without a standby while the sync key
    /// says otherwise.
    ///
    /// Whatever the protection mode this node's file says: the cluster's
    /// may be set in etcd, not read yet, and keeping what runs is safe
    /// either way (the synchronous-standby step relaxes it in its order).
    async fn adopt_sync_setting(&mut self) {
        let written = self
            .pg
            .with(|i| Ok(i.adopt_written_setting("synchronous_standby_names")))
            .await
            .ok()
            .flatten();
        let Some(written) = written else {
            return;
        };
        match pgwarden_topology::ssn::parse(&written) {
            Ok(Some(ssn)) => {
                tracing::info!(synchronous_standby_names = %written, "synchronous standbys taken over from the last run");
                self.sync_applied = SyncConfig {
                    names: ssn.names,
                    num: ssn.num_sync as usize,
                };
                self.sync_applied_at = None;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(synchronous_standby_names = %written, error = %e, "cannot read the synchronous standbys the last run set")
            }
        }
    }

    /// One bootstrap attempt; `Ok(true)` once this member has data.
    async fn try_bootstrap(&mut self) -> Result<bool, AgentStepError> {
        // A cluster with a leader or members has data even if etcd lost its
        // `initialize` key: clone the leader (or wait for one) rather than
        // create another database.
        // This member's own record (left by a clone that failed) does not
        // count.
        let fresh = self.snapshot.leader.is_none()
            && self
                .snapshot
                .members
                .iter()
                .all(|(m, _)| *m == self.cfg.name);
        if self.snapshot.initialize.is_none() && self.snapshot.leader.is_none() && !fresh {
            tracing::debug!("the cluster has members but no initialize key: waiting for a leader");
        }
        let claim = pgwarden_ha::identity::claim(&self.cfg.name);
        // This member's own claim in a cluster still without data: it won
        // the race before (an answer lost on its way back, or the agent
        // stopped before the data was made), and no one else creates the
        // cluster while the claim stands. It goes on as the winner.
        let claimed = fresh && self.snapshot.initialize.as_deref() == Some(claim.as_str());
        if (self.snapshot.initialize.is_none() && fresh) || claimed {
            // A standby cluster is named in the dynamic configuration (set
            // before any member started) or in the first member's file.
            let standby = match record::standby_cluster(&self.snapshot) {
                Some(Ok(s)) => Some(s),
                Some(Err(e)) => {
                    self.standby_cluster_unreadable(e);
                    return Ok(false);
                }
                None => self.cfg.standby_cluster.clone(),
            };
            if claimed || self.dcs.initialize_race(&claim).await? {
                self.busy("initializing").await;
                let res = match &standby {
                    None => match self.cfg.bootstrap.clone() {
                        None => {
                            tracing::info!(
                                "won the initialize race: creating the cluster with initdb"
                            );
                            self.initialize(&claim).await
                        }
                        Some(b) => {
                            tracing::info!(
                                "won the initialize race: creating the cluster from a backup"
                            );
                            self.initialize_from_backup(&claim, b).await
                        }
                    },
                    Some(remote) => {
                        tracing::info!(
                            source = %remote.address(),
                            "won the initialize race: creating a standby cluster by cloning its remote source"
                        );
                        self.initialize_standby(&claim, remote).await
                    }
                };
                self.idle();
                if let Err(e) = res {
                    // Withdraw the claim so that another member (or this one,
                    // after the data directory is wiped) can try again; a
                    // member listed without a leader or a claim would make
                    // the others wait for a leader instead.
                    let _ = self.pg.stop(StopMode::Immediate).await;
                    let _ = self.dcs.delete_member(&self.cfg.name).await;
                    let _ = self.dcs.cancel_initialize(&claim).await;
                    return Err(e);
                }
                let role = if standby.is_some() {
                    "standby_leader"
                } else {
                    "primary"
                };
                self.run_callback(self.cfg.callbacks.on_start.clone(), "on_start", role);
                return Ok(true);
            }
            return Ok(false);
        }
        let Some(source) = self.leader_address() else {
            return Ok(false);
        };
        let methods: Vec<&str> = self.cfg.create_replica.iter().map(|m| m.name()).collect();
        tracing::info!(from = %source, ?methods, "cloning the leader");
        self.busy("cloning").await;
        let cloned = self.clone_from(&source).await;
        self.idle();
        cloned?;
        self.pg
            .start(self.timing.loop_wait)
            .await
            .or_else(still_starting)?;
        self.run_callback(self.cfg.callbacks.on_start.clone(), "on_start", "replica");
        Ok(true)
    }

    /// Creates the cluster after winning the initialize race: initdb, start
    /// as primary, take the leader key, record the system identifier.
    async fn initialize(&mut self, claim: &str) -> Result<(), AgentStepError> {
        let superuser = self.pg.superuser().to_string();
        let hba = self.cfg.pg_hba.clone();
        // In maximum protection not even the first commit may be
        // acknowledged without a standby: PostgreSQL starts waiting for one.
        let strict = self.sync.protection == Protection::MaximumProtection;
        let blocked = SyncConfig::blocked();
        let names = blocked.standby_names(self.sync.method);
        self.pg
            .with(move |i| {
                i.initdb(&superuser)?;
                append_hba(i.datadir(), &hba)?;
                if strict {
                    i.set_setting("synchronous_standby_names", &names)?;
                }
                i.clear_standby()
            })
            .await?;
        if strict {
            self.sync_applied = blocked;
            self.sync_applied_at = None;
        }
        self.pg.start(Duration::from_secs(60)).await?;
        self.lead_new_cluster(claim).await;
        self.former_primary = true;
        Ok(())
    }

    /// Creates a standby cluster after winning the initialize race: clone
    /// the remote source (through its slot, if one is named), start
    /// streaming from it, take the leader key, record the system identifier
    /// and make sure the dynamic configuration says this is a standby
    /// cluster, so that no later leader promotes itself.
    async fn initialize_standby(
        &mut self,
        claim: &str,
        remote: &pgwarden_ha::StandbyCluster,
    ) -> Result<(), AgentStepError> {
        self.create_standby_leader(remote).await?;
        self.pg
            .start(Duration::from_secs(60))
            .await
            .or_else(still_starting)?;
        if record::standby_cluster(&self.snapshot).is_none() {
            let mut config = self
                .snapshot
                .config
                .clone()
                .filter(serde_json::Value::is_object)
                .unwrap_or_else(|| serde_json::json!({}));
            config["standby_cluster"] =
                serde_json::to_value(remote).unwrap_or(serde_json::Value::Null);
            if !self
                .dcs
                .compare_and_put_config(&config, self.snapshot.config_revision)
                .await?
            {
                return Err(AgentStepError::Conflict(
                    "the dynamic configuration changed while the standby cluster was created",
                ));
            }
        }
        self.lead_new_cluster(claim).await;
        Ok(())
    }

    /// The methods that create a standby leader's data from `remote`: the
    /// standby cluster's own list, else a base backup of the source, or, for
    /// a source followed through its archive alone, this member's methods
    /// other than `basebackup` (which needs a server to copy). A name this
    /// member has no table for is skipped and logged: the list may come from
    /// the dynamic configuration, written with other members in mind.
    fn standby_methods(
        &self,
        remote: &pgwarden_ha::StandbyCluster,
    ) -> Vec<pgwarden_config::ReplicaMethod> {
        use pgwarden_config::ReplicaMethod;
        match &remote.create_replica_methods {
            Some(names) => names
                .iter()
                .filter_map(|n| {
                    if n == "basebackup" {
                        return Some(ReplicaMethod::Basebackup);
                    }
                    let m = self.cfg.replica_methods.get(n).cloned();
                    if m.is_none() {
                        tracing::error!(
                            method = %n,
                            "standby_cluster.create_replica_methods names a method without an [agent.replica_methods.NAME] table on this member"
                        );
                    }
                    m
                })
                .collect(),
            None if remote.host.is_some() => vec![ReplicaMethod::Basebackup],
            None => self
                .cfg
                .create_replica
                .iter()
                .filter(|m| !matches!(m, ReplicaMethod::Basebackup))
                .cloned()
                .collect(),
        }
    }

    /// Fills the data directory of a standby leader of `remote`, by the
    /// first of [`Self::standby_methods`] that works, and sets it up to
    /// follow the source (its slot, its recovery settings).
    async fn create_standby_leader(
        &mut self,
        remote: &pgwarden_ha::StandbyCluster,
    ) -> Result<(), PgCtlError> {
        use pgwarden_config::ReplicaMethod;
        let user = self.pg.replication_user().to_string();
        let hba = self.cfg.pg_hba.clone();
        let slot = remote.primary_slot_name.clone();
        let recovery = remote.recovery_settings();
        let upstream = remote.upstream().map(|(h, p)| (h.to_string(), p));
        let mut last = PgCtlError::CommandFailed {
            program: "standby_cluster.create_replica_methods".into(),
            status: String::new(),
            output: "no method to create the standby leader with (a standby cluster without \
                     standby_cluster.host is restored from a backup: it needs a method other \
                     than basebackup)"
                .into(),
        };
        for method in self.standby_methods(remote) {
            let label = method.name().to_string();
            let (slot, recovery, hba, user, upstream) = (
                slot.clone(),
                recovery.clone(),
                hba.clone(),
                user.clone(),
                upstream.clone(),
            );
            let res = match method {
                ReplicaMethod::Basebackup => {
                    let Some((host, port)) = upstream else {
                        continue;
                    };
                    self.pg
                        .with(move |i| {
                            i.wipe()?;
                            // pg_basebackup creates the slot when missing.
                            i.set_primary_slot(slot)?;
                            i.basebackup(&host, port, &user)?;
                            i.set_source_settings(recovery)?;
                            append_hba(i.datadir(), &hba)
                        })
                        .await
                }
                ReplicaMethod::Command {
                    name,
                    command,
                    keep_data,
                    no_params,
                } => {
                    if let (Some(slot), Some((h, p))) = (&slot, &upstream) {
                        self.ensure_remote_slot(&HostAddr::new(h.as_str(), *p), slot)
                            .await;
                    }
                    let connstring = upstream.as_ref().map(|(h, p)| {
                        format!(
                            "host={h} port={p} user={} dbname=postgres",
                            pgwarden_pgctl::conninfo_value(&user)
                        )
                    });
                    let args = self.method_args(no_params, Some("replica"), connstring);
                    self.pg
                        .with(move |i| {
                            if !keep_data {
                                i.wipe()?;
                            }
                            i.set_primary_slot(slot)?;
                            let source = upstream.as_ref().map(|(h, p)| (h.as_str(), *p));
                            i.create_replica_with(&name, &command, &args, source, &user)?;
                            i.set_source_settings(recovery)?;
                            append_hba(i.datadir(), &hba)
                        })
                        .await
                }
            };
            match res {
                Ok(()) => {
                    tracing::info!(method = %label, source = %remote.address(), "standby leader created from the remote source");
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(method = %label, error = %e, "creating the standby leader failed");
                    last = e;
                }
            }
        }
        Err(last)
    }

    /// Creates the standby leader's slot on the source before a backup
    /// tool's restore (a base backup creates it itself), so that the source
    /// keeps the WAL the restored copy will stream. A source that refuses is
    /// logged; streaming then tells.
    async fn ensure_remote_slot(&self, source: &HostAddr, slot: &str) {
        // The name passed valid_slot_name: lower-case letters, digits, '_'.
        let sql = format!(
            "SELECT pg_create_physical_replication_slot('{slot}', true) \
             WHERE NOT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = '{slot}')"
        );
        if let Err(e) = self
            .pg
            .query_in(Some(source), "postgres", &sql, Duration::from_secs(5))
            .await
        {
            tracing::warn!(%source, slot, error = %e, "cannot create the standby leader's slot on the source");
        }
    }

    /// The arguments an operator's restore command gets, Patroni's, so that
    /// scripts written for it work: the cluster and data directory, then
    /// the role and the source to copy when there are any; none with
    /// `no_params`.
    fn method_args(
        &self,
        no_params: bool,
        role: Option<&str>,
        connstring: Option<String>,
    ) -> Vec<String> {
        if no_params {
            return Vec::new();
        }
        let mut args = vec![
            format!("--scope={}", self.etcd.cluster),
            format!("--datadir={}", self.cfg.data_dir.display()),
        ];
        args.extend(role.map(|r| format!("--role={r}")));
        args.extend(connstring.map(|c| format!("--connstring={c}")));
        args
    }

    /// Creates the cluster from a backup after winning the initialize race:
    /// the operator's command fills the data directory, PostgreSQL recovers
    /// (from the archive, up to the target, with `bootstrap.recovery`) and
    /// promotes itself at the end, then this member leads. Recovery may
    /// take long; the member's status says `restoring` meanwhile.
    async fn initialize_from_backup(
        &mut self,
        claim: &str,
        b: pgwarden_config::BootstrapMethod,
    ) -> Result<(), AgentStepError> {
        let hba = self.cfg.pg_hba.clone();
        let args = self.method_args(b.no_params, None, None);
        let mut recovery = b.recovery.clone();
        recovery.insert("recovery_target_action".into(), "promote".into());
        let command = b.command.clone();
        self.pg
            .with(move |i| {
                i.wipe()?;
                i.restore_with("bootstrap", &command, &args, &recovery)?;
                append_hba(i.datadir(), &hba)
            })
            .await?;
        self.busy("restoring").await;
        self.pg
            .start(Duration::from_secs(60))
            .await
            .or_else(still_starting)?;
        loop {
            let seen = self.pg.observe(Duration::from_secs(2)).await;
            if !seen.process {
                let log = self.pg.with(|i| Ok(i.log_tail())).await.unwrap_or_default();
                return Err(PgCtlError::CommandFailed {
                    program: "postgres".into(),
                    status: "stopped during recovery".into(),
                    output: log,
                }
                .into());
            }
            if seen.pg.running && !seen.pg.in_recovery {
                break;
            }
            tokio::time::sleep(RETRY_PACE).await;
        }
        tracing::info!("the restored server finished its recovery and promoted itself");
        // The recovery settings belong to the restore; a later restart of
        // this primary must not recover again.
        self.pg
            .with(|i| {
                i.set_source_settings(Default::default())?;
                i.reload()
            })
            .await?;
        self.lead_new_cluster(claim).await;
        self.former_primary = true;
        Ok(())
    }

    /// The last steps of creating a cluster, once its first server runs:
    /// take the leader key and swap the initialize claim for the system
    /// identifier.
    ///
    /// Neither step can fail the creation. An etcd that times out may
    /// still have made the write, and a creation given up wipes the data
    /// directory: with the leader key or the identifier then in etcd and
    /// no data anywhere, no member could ever create or clone the
    /// cluster. What is not done here the loop does at its next turn, as
    /// for any running primary: it takes the key when no one holds it,
    /// and replaces this member's own claim with the identifier.
    async fn lead_new_cluster(&mut self, claim: &str) {
        match self.ensure_lease().await {
            Ok(lease) => {
                let t0 = Instant::now();
                let led = match self.dcs.keep_alive_once(lease).await {
                    Ok(_) => self.dcs.acquire_leader(&self.cfg.name, lease).await,
                    Err(e) => Err(e),
                };
                match led {
                    Ok(true) => self.last_renewal = Some(t0),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot take the new cluster's leader key yet")
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot grant a lease for the new cluster yet"),
        }
        let sysid = self
            .controldata("Database system identifier")
            .await
            .unwrap_or_default();
        match self.dcs.finish_initialize(claim, &sysid).await {
            Ok(true) => self.identity_known = true,
            // Compared (and recorded) by the loop's identity check.
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "cannot record the new cluster's system identifier yet")
            }
        }
    }

    /// Creates this replica's data from `source` with the configured
    /// methods (`create_replica_methods`), in order, until one succeeds;
    /// the last failure is returned if none does.
    async fn clone_from(&mut self, source: &HostAddr) -> Result<(), PgCtlError> {
        let mut last = None;
        for method in self.cfg.create_replica.clone() {
            match self.clone_with(&method, source).await {
                Ok(()) => {
                    tracing::info!(method = method.name(), from = %source, "replica created");
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(method = method.name(), error = %e, "creating the replica failed");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| PgCtlError::CommandFailed {
            program: "create_replica_methods".into(),
            status: String::new(),
            output: "no method configured".into(),
        }))
    }

    async fn clone_with(
        &mut self,
        method: &pgwarden_config::ReplicaMethod,
        source: &HostAddr,
    ) -> Result<(), PgCtlError> {
        let user = self.pg.replication_user().to_string();
        let (h, p) = (source.host.clone(), source.port);
        // A former standby leader's instance still names the remote
        // source's slot; the clone must create this member's own.
        let slot = self.member_slot();
        match method.clone() {
            pgwarden_config::ReplicaMethod::Basebackup => {
                self.pg
                    .with(move |i| {
                        i.wipe()?;
                        i.set_primary_slot(slot)?;
                        i.basebackup(&h, p, &user)
                    })
                    .await
            }
            pgwarden_config::ReplicaMethod::Command {
                name,
                command,
                keep_data,
                no_params,
            } => {
                let connstring = format!(
                    "host={h} port={p} user={} dbname=postgres",
                    pgwarden_pgctl::conninfo_value(&user)
                );
                let args = self.method_args(no_params, Some("replica"), Some(connstring));
                self.pg
                    .with(move |i| {
                        if !keep_data {
                            i.wipe()?;
                        }
                        i.set_primary_slot(slot)?;
                        i.create_replica_with(&name, &command, &args, Some((&h, p)), &user)
                    })
                    .await
            }
        }
    }

    /// The address of the leader's PostgreSQL, when the leader is known
    /// and published one.
    fn leader_address(&self) -> Option<HostAddr> {
        let leader = self.snapshot.leader.as_ref()?;
        self.member_address(&leader.name)
    }

    fn member_address(&self, name: &str) -> Option<HostAddr> {
        records(&self.snapshot)
            .into_iter()
            .find(|r| r.state.name == name)
            .and_then(|r| r.pg_address.parse().ok())
    }

    fn member_record(&self, name: &str) -> Option<MemberRecord> {
        records(&self.snapshot)
            .into_iter()
            .find(|r| r.state.name == name)
    }

    /// Starts a long step that holds up the loop: shows `activity` in the
    /// status and keeps this member listed in etcd with it until
    /// [`Self::idle`], so that `ctl list` and the other members see a
    /// member that is cloning or restoring rather than none.
    async fn busy(&mut self, activity: &'static str) {
        self.activity = Some(activity);
        self.publish_status();
        // The previous step's task, if any, stops first.
        self.presence = None;
        if !self.dcs_ok {
            return;
        }
        let lease = match tokio::time::timeout(self.dcs_budget(), self.ensure_lease()).await {
            Ok(Ok(l)) => l,
            _ => return,
        };
        let Ok(record) = serde_json::to_value(self.record()) else {
            return;
        };
        self.presence = Some(Presence::start(
            self.dcs.clone(),
            self.cfg.name.clone(),
            record,
            lease,
            self.timing.ttl,
        ));
    }

    /// Ends the step [`Self::busy`] started; the loop publishes again.
    fn idle(&mut self) {
        self.activity = None;
        self.presence = None;
    }

    async fn ensure_lease(&mut self) -> Result<LeaseId, pgwarden_dcs::DcsError> {
        if let Some(l) = self.lease {
            return Ok(l);
        }
        let l = self.dcs.grant_lease(self.timing.ttl).await?;
        tracing::debug!(lease = %l, "granted a lease");
        self.lease = Some(l);
        self.lease_ttl = self.timing.ttl;
        Ok(l)
    }

    /// How long a DCS request may take now: the operation time-out, and for
    /// a leader never past the moment it must demote, so a hung etcd
    /// cannot keep it writable past its lease.
    fn dcs_budget(&self) -> Duration {
        let op = self.etcd.op_timeout;
        if !self.holds_leader_key() {
            return op;
        }
        match self.last_renewal {
            Some(at) => (at + self.timing.demote_after())
                .saturating_duration_since(Instant::now())
                .min(op),
            None => op,
        }
    }

    /// How long the cluster read and the lease renewal may keep retrying:
    /// a leader may use all the time left before it must demote (each
    /// attempt is bounded by `op_timeout`, so an etcd member that died
    /// costs one attempt, not the loop); others two attempts.
    fn retry_budget(&self) -> Duration {
        let op = self.etcd.op_timeout;
        match (self.holds_leader_key(), self.last_renewal) {
            // In maintenance mode nothing demotes a leader whose lease
            // ran out: it goes on reading (and renewing) as a member does,
            // or it would never see etcd again, nor the resume.
            (true, Some(at))
                if !(record::paused(&self.snapshot)
                    && at.elapsed() >= self.timing.demote_after()) =>
            {
                let left =
                    (at + self.timing.demote_after()).saturating_duration_since(Instant::now());
                // With failsafe on, a read retried up to the deadline would
                // leave the members no time to acknowledge this leader.
                if self.failsafe {
                    left.saturating_sub(self.failsafe_budget().min(left / 2))
                } else {
                    left
                }
            }
            _ => op * 2,
        }
    }

    fn holds_leader_key(&self) -> bool {
        matches!(
            (&self.snapshot.leader, self.lease),
            (Some(l), Some(lease)) if l.name == self.cfg.name && l.lease == lease
        )
    }

    async fn iterate(&mut self) {
        let began_ms = unix_ms();
        let probe_timeout = Duration::from_secs(2).min(self.timing.loop_wait.max(RETRY_PACE));
        self.obs = self.pg.observe(probe_timeout).await;
        if self.obs.pg.running || !self.obs.process {
            self.recovering_after_rejoin = false;
        }
        if self.obs.pg.running {
            self.start_failed_since = None;
            if !self.obs.pg.in_recovery {
                self.former_primary = true;
            } else if self.obs.streaming {
                // Streaming from the leader proves the histories agree.
                self.former_primary = false;
            }
            // A failed rewind, followed by a clone, is history once the
            // member runs as a primary or streams.
            if (self.obs.streaming || !self.obs.pg.in_recovery)
                && self
                    .problem
                    .as_deref()
                    .is_some_and(|p| p.starts_with("pg_rewind failed"))
            {
                self.problem = None;
            }
        }
        let budget = self.retry_budget();
        let read = if budget.is_zero() {
            None
        } else {
            tokio::time::timeout(budget, retrying(budget, || self.dcs.read_cluster()))
                .await
                .ok()
        };
        match read {
            Some(Ok(snap)) => {
                self.note_failsafe_leader(&snap);
                self.snapshot = snap;
                self.dcs_ok = true;
                self.last_dcs_ok = Instant::now();
                if let Err(e) = self.ensure_lease().await {
                    tracing::warn!(error = %e, "cannot grant a lease");
                }
                if self.identity_known
                    && self.obs.pg.running
                    && !self
                        .snapshot
                        .members
                        .iter()
                        .any(|(n, _)| *n == self.cfg.name)
                {
                    self.reappear().await;
                }
            }
            Some(Err(e)) => {
                if self.dcs_ok {
                    tracing::warn!(error = %e, "the DCS is unreachable");
                }
                self.dcs_ok = false;
            }
            None => {
                if self.dcs_ok {
                    tracing::warn!("the DCS did not answer in time");
                }
                self.dcs_ok = false;
            }
        }
        if self.identity_known && self.dcs_ok && !recorded(&self.snapshot) {
            // etcd lost the record (restored from an old snapshot): put it
            // back before an empty member takes the cluster for a new one.
            let _ = self.record_identity(self.snapshot.initialize.clone()).await;
        }
        if !self.identity_known {
            // Unchecked, PostgreSQL is not started; but one already running
            // still goes through the decision while etcd is silent, which
            // demotes a primary that holds no lease.
            let go_on = if self.dcs_ok {
                self.verify_identity().await
            } else {
                self.obs.pg.running
            };
            if !go_on {
                self.publish_status();
                return;
            }
        }
        if self.dcs_ok {
            self.apply_cluster_settings().await;
            self.apply_dynamic_parameters().await;
        }
        if !self.dcs_ok && self.failsafe && self.holds_leader_key() && self.obs.pg.running {
            self.failsafe_round().await;
        }
        let mut pg = self.obs.pg.clone();
        pg.start_failed_for = self.start_failed_since.map(|t| t.elapsed());
        let mut view = cluster_view(&self.snapshot, unix_ms());
        if self.abandoned_request.is_some() {
            if self.abandoned_request == Some(self.snapshot.failover_revision) {
                // Carried out, it would stop this leader again for the
                // same candidate; withdrawn, as meant, when etcd answers
                // (within what is left of the lease: a leader must still
                // demote in time).
                view.failover_request = None;
                let withdraw = self.dcs.delete_failover_if(self.snapshot.failover_revision);
                if self.dcs_ok {
                    if let Ok(Ok(true)) = tokio::time::timeout(self.dcs_budget(), withdraw).await {
                        self.abandoned_request = None;
                    }
                }
            } else {
                self.abandoned_request = None;
            }
        }
        let local = pgwarden_ha::LocalView {
            name: self.cfg.name.clone(),
            postgres: pg,
            holds_lease: self.holds_leader_key(),
            last_lease_renewal: self.last_renewal,
            now: Instant::now(),
            dcs_reachable: self.dcs_ok,
            unix_ms: began_ms,
        };
        self.note_scheduled(&view);
        let decision = decide(&view, &local, &self.timing, &self.settings);
        self.log_decision(&decision);
        // A leader keeps its lease through every decision that means to
        // stay leader (restarting or promoting PostgreSQL included), or a
        // slow restart would cost it the key.
        let decision = if decision.keeps_lease() {
            let renewed = self.renew().await;
            let local = pgwarden_ha::LocalView {
                holds_lease: self.holds_leader_key(),
                last_lease_renewal: self.last_renewal,
                now: Instant::now(),
                dcs_reachable: self.dcs_ok,
                ..local
            };
            let decision = after_renewal(
                decision,
                renewed,
                &view,
                &local,
                &self.timing,
                &self.settings,
            );
            self.log_decision(&decision);
            decision
        } else {
            self.keep_member_alive().await;
            decision
        };
        self.execute(&decision, &view).await;
        self.remote_silent_since = match (&decision, self.obs.streaming) {
            (Decision::FollowRemote { .. }, false) => {
                Some(self.remote_silent_since.unwrap_or_else(Instant::now))
            }
            _ => None,
        };
        // In maintenance mode too, as Patroni's leader does: a leader made
        // by hand there must list its synchronous standbys (routing waits
        // for that key), and one that lost its standby must degrade.
        if matches!(
            decision,
            Decision::RenewLease | Decision::Paused { renew_lease: true }
        ) && self.holds_leader_key()
            && self.obs.pg.running
            && !self.obs.pg.in_recovery
        {
            self.manage_sync().await;
        }
        if self.dcs_ok && self.obs.pg.running {
            // A standby leader keeps its members' slots as a primary does.
            let leading = self.holds_leader_key()
                && (!self.obs.pg.in_recovery || record::standby_cluster(&self.snapshot).is_some());
            self.manage_slots(leading).await;
            self.manage_logical_slots().await;
        }
        // The round that took the key counts as leading too: the watchdog
        // armed before taking it stays armed, and the fence starts now.
        let leading = decision.keeps_lease()
            || matches!(decision, Decision::AcquireLeader { .. })
            || std::mem::take(&mut self.kept_key);
        if self.holds_leader_key() && leading {
            // Fed once per renewal that succeeded (as it succeeded, see
            // `fed_on_renewal`; here when the watchdog was not yet armed
            // then), never for a round whose renewal failed: the
            // watchdog's time-out (ttl − safety_margin) then runs from the
            // last renewal, and resets a hung leader before its lease can
            // run out.
            // In maintenance mode the leader stays what it is even with
            // etcd out of reach, as documented: fed every round then.
            if !self.watchdog.armed()
                || self.watchdog_fed_for != self.last_renewal
                || matches!(decision, Decision::Paused { .. })
            {
                if let Err(e) = self.watchdog.arm() {
                    tracing::error!("cannot arm the watchdog: {e}");
                }
                self.watchdog_fed_for = self.last_renewal;
            }
            self.arm_fence();
        } else {
            self.watchdog_fed_for = None;
            self.watchdog.disarm();
            if let Some(f) = self.fence.take() {
                f.disarm();
            }
        }
        self.routing_ready = self.leadership_acknowledged();
        self.publish_status();
        self.publish_member().await;
    }

    /// Logs the decision's sentence when it differs from the last one.
    fn log_decision(&mut self, decision: &Decision) {
        let text = decision.to_string();
        if text != self.last_decision {
            tracing::info!(member = %self.cfg.name, "{text}");
            self.last_decision = text;
        }
    }

    /// Compares the data directory's system identifier with the cluster's
    /// (recording it if the cluster has none); `true` once this member may
    /// take part. A different database sets `fatal`.
    async fn verify_identity(&mut self) -> bool {
        use pgwarden_ha::identity::{check, Identity};
        if !self.dcs_ok {
            return false;
        }
        let local = self.controldata("Database system identifier").await;
        let recorded = self.snapshot.initialize.clone();
        match check(recorded.as_deref(), local.as_deref(), &self.cfg.name) {
            Identity::Matches => {
                self.identity_known = true;
                if self
                    .problem
                    .as_deref()
                    .is_some_and(|p| p.starts_with("waiting for"))
                {
                    self.problem = None;
                }
            }
            Identity::Unreadable => {
                tracing::warn!(
                    data_dir = %self.cfg.data_dir.display(),
                    "cannot read the data directory's system identifier; it is not compared with the cluster's"
                );
                self.identity_known = true;
            }
            Identity::Pending { member } => {
                self.problem = Some(format!(
                    "waiting for member {member} to finish creating the cluster"
                ));
            }
            Identity::Record { previous } => {
                // Another member may write first: then compared at the next
                // turn.
                self.identity_known = self.record_identity(previous).await;
            }
            Identity::Mismatch { local, recorded } => {
                let why = format!(
                    "the data directory {} holds another database (system identifier {local}) than cluster {} (system identifier {recorded}, recorded in etcd); \
                     PostgreSQL is not started. Remove or move the data directory for this member to clone the leader, or point the agent at the cluster this data belongs to",
                    self.cfg.data_dir.display(),
                    self.etcd.cluster,
                );
                self.problem = Some(why.clone());
                self.fatal = Some(why);
            }
        }
        self.identity_known
    }

    /// Writes this data directory's system identifier into `initialize`
    /// in place of `previous` (`None`: the key is absent); `true` once
    /// written.
    async fn record_identity(&mut self, previous: Option<String>) -> bool {
        let Some(local) = self.controldata("Database system identifier").await else {
            return false;
        };
        let local = local.trim().to_string();
        let written = match &previous {
            None => self.dcs.initialize_race(&local).await,
            Some(p) => self.dcs.finish_initialize(p, &local).await,
        };
        match written {
            Ok(true) => {
                tracing::info!(system_identifier = %local, "the cluster had no system identifier recorded: recorded this data directory's");
                self.snapshot.initialize = Some(local);
                true
            }
            Ok(false) => false,
            Err(e) => {
                tracing::warn!(error = %e, "cannot record the system identifier");
                false
            }
        }
    }

    /// Stops managing this node for good: withdraws from the DCS, publishes
    /// why and tells whoever runs the agent.
    async fn give_up(&mut self, why: String) {
        tracing::error!("{why}");
        if let Some(lease) = self.lease.take() {
            let _ = self.dcs.revoke_lease(lease).await;
        }
        self.watchdog.disarm();
        self.publish_status();
        let _ = self.failed.send(Some(why));
        self.stopped.notify_one();
    }

    /// Whether every live member's connection manager routes by the
    /// current leader generation, so none can still send writes to an
    /// earlier primary. A member that has not acknowledged within one
    /// `loop_wait` (plus a second of slack) is not waited for longer: its
    /// own connection manager fails closed once etcd has been silent for
    /// the ttl, and a dead one sends nothing.
    fn leadership_acknowledged(&mut self) -> bool {
        let Some(leader) = &self.snapshot.leader else {
            return false;
        };
        let generation = leader.generation;
        if self.ack_wait.0 != generation {
            self.ack_wait = (generation, Instant::now());
        }
        // In a synchronous mode a new leader takes writes only once it has
        // said which standbys acknowledge them (or that it runs without):
        // no write is acknowledged on the strength of the leader alone.
        if self.sync.protection.synchronous()
            && crate::record::sync_state(&self.snapshot).is_none_or(|s| s.leader != leader.name)
        {
            return false;
        }
        let own = self.routing_ack.load(std::sync::atomic::Ordering::SeqCst) >= generation;
        let now = unix_ms();
        let ttl_ms = self.timing.ttl.as_millis() as u64;
        let others = records(&self.snapshot)
            .into_iter()
            .filter(|r| r.state.name != self.cfg.name)
            .filter(|r| now.saturating_sub(r.updated_ms) < ttl_ms)
            .all(|r| r.routing_generation >= generation);
        (own && others)
            || self.ack_wait.1.elapsed() >= self.timing.loop_wait + Duration::from_secs(1)
    }

    async fn execute(&mut self, decision: &Decision, view: &ClusterView) {
        match decision {
            Decision::RenewLease | Decision::WaitForLeader { .. } => {}
            Decision::Paused { .. } => self.follow_paused().await,
            Decision::AcquireLeader { reason } => self.acquire(reason, view).await,
            Decision::Promote => {
                self.promote("the leader key holder was still in recovery")
                    .await;
            }
            Decision::Demote { reason } => self.demote(reason).await,
            Decision::FollowLeader { leader } => self.follow(leader).await,
            Decision::FollowRemote { .. } => self.follow_remote().await,
            Decision::StartPostgres { mode } => self.start(mode).await,
            Decision::ReleaseLeader { reason } => self.release(reason, view).await,
            Decision::CancelSwitchover { reason } => {
                match self
                    .dcs
                    .delete_failover_if(self.snapshot.failover_revision)
                    .await
                {
                    Ok(true) => tracing::warn!("switchover request withdrawn: {reason}"),
                    Ok(false) => {}
                    Err(e) => tracing::warn!(error = %e, "cannot withdraw the switchover request"),
                }
            }
        }
    }

    /// How long until a scheduled switchover is due, while one waits.
    fn until_scheduled(&self) -> Option<Duration> {
        let req = crate::record::cluster_view(&self.snapshot, 0).failover_request?;
        match Schedule::of(
            req.scheduled_at.as_deref(),
            unix_ms(),
            overdue_after(&self.timing),
        ) {
            Schedule::Waiting(d) => Some(d),
            _ => None,
        }
    }

    /// Logs a scheduled switchover once, when the leader first sees it.
    fn note_scheduled(&mut self, view: &ClusterView) {
        let revision = self.snapshot.failover_revision;
        let Some(req) = view.failover_request.as_ref() else {
            return;
        };
        let (Some(at), true) = (&req.scheduled_at, self.holds_leader_key()) else {
            return;
        };
        if self.scheduled_seen == Some(revision) {
            return;
        }
        self.scheduled_seen = Some(revision);
        tracing::info!(
            candidate = req.candidate.as_deref().unwrap_or("?"),
            "awaiting the switchover scheduled at {at}"
        );
    }

    /// Renews the leader lease; whether it worked. A request that fails or
    /// times out marks etcd unreachable, as a failed read does: the round
    /// is decided again from that, and the next one comes at the retry
    /// pace rather than a whole `loop_wait` later.
    /// Feeds an armed watchdog as soon as a renewal succeeds: fed only at
    /// the round's end, its time-out (ttl − safety_margin) would run from
    /// however late in the round that is (steps after the renewal can take
    /// seconds on a struggling server), and could end after the lease it
    /// is there to outrun.
    fn fed_on_renewal(&mut self) {
        if self.watchdog.armed() {
            self.watchdog.keepalive();
            self.watchdog_fed_for = self.last_renewal;
        }
    }

    /// Renews the key after a long step (a standby leader's rewind or
    /// clone), with a budget of its own: the step's presence task kept the
    /// lease alive, but the loop judges the lease by its last renewal, made
    /// before the step, and would stop the server it just rebuilt. A key no
    /// longer held on this lease is not renewed, and the loop acts on that.
    async fn renew_after_step(&mut self) {
        let (Some(lease), true) = (self.lease, self.holds_leader_key()) else {
            return;
        };
        let t0 = Instant::now();
        let renewal = self.dcs.renew_leader(&self.cfg.name, lease);
        if let Ok(Ok(true)) = tokio::time::timeout(self.etcd.op_timeout * 2, renewal).await {
            self.last_renewal = Some(t0);
            self.fed_on_renewal();
        }
    }

    async fn renew(&mut self) -> bool {
        let Some(lease) = self.lease else {
            return false;
        };
        let budget = self.retry_budget();
        if budget.is_zero() {
            return false;
        }
        let t0 = Instant::now();
        let name = self.cfg.name.clone();
        let renewal = retrying(budget, || self.dcs.renew_leader(&name, lease));
        match tokio::time::timeout(budget, renewal).await {
            Ok(Ok(true)) => {
                self.last_renewal = Some(t0);
                self.fed_on_renewal();
                if let Some(lsn) = self.obs.pg.received_lsn {
                    let mut status = serde_json::json!({ "lsn": lsn });
                    if !self.logical_positions.is_empty() {
                        status["slots"] = serde_json::json!(self.logical_positions);
                    }
                    let _ = tokio::time::timeout(
                        self.dcs_budget(),
                        self.dcs.put_status(&self.cfg.name, &status),
                    )
                    .await;
                }
                return true;
            }
            Ok(Ok(false)) => {
                // Moved to the new lease after all (see `move_lease`).
                if let Some((moved, timing)) = self.lease_moving.take() {
                    if let Ok(Ok(true)) =
                        tokio::time::timeout(budget, self.dcs.renew_leader(&name, moved)).await
                    {
                        self.lease = Some(moved);
                        self.lease_ttl = timing.ttl;
                        self.last_renewal = Some(t0);
                        self.fed_on_renewal();
                        self.adopt_timing(timing);
                        return true;
                    }
                }
                tracing::warn!("the leader key is no longer held by this agent's lease");
                self.lease = None;
                // etcd answered: the round decides again with it reachable
                // (a failsafe leader whose lease ran out during an outage
                // takes its key back next; it must not demote for the
                // outage just ended).
                self.dcs_ok = true;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "leader lease renewal failed");
                self.dcs_ok = false;
            }
            Err(_) => {
                tracing::warn!("leader lease renewal timed out");
                self.dcs_ok = false;
            }
        }
        false
    }

    async fn keep_member_alive(&mut self) {
        let Some(lease) = self.lease else { return };
        if !self.dcs_ok {
            return;
        }
        if let Err(e) = self.dcs.keep_alive_once(lease).await {
            if matches!(e, pgwarden_dcs::DcsError::LeaseNotFound(_)) {
                // The lease lapsed (a long clone, a partition): take a new one.
                self.lease = None;
            }
            tracing::debug!(error = %e, "member lease keep-alive failed");
        }
    }

    /// Publishes this member's record again when etcd lost it (its lease
    /// ran out while etcd was out of reach), and reads the cluster back,
    /// before deciding: a member missing from its own view stands aside,
    /// and a primary standing aside demotes.
    async fn reappear(&mut self) {
        if let Some(lease) = self.lease {
            if let Err(pgwarden_dcs::DcsError::LeaseNotFound(_)) =
                self.dcs.keep_alive_once(lease).await
            {
                self.lease = None;
            }
        }
        if let Err(e) = self.ensure_lease().await {
            tracing::warn!(error = %e, "cannot grant a lease");
            return;
        }
        self.publish_member().await;
        if let Ok(snap) = self.dcs.read_cluster().await {
            self.note_failsafe_leader(&snap);
            self.snapshot = snap;
        }
    }

    /// Keeps track of the leader this member acknowledged in failsafe
    /// rounds, from the last snapshot read before etcd answered again.
    fn note_failsafe_leader(&mut self, fresh: &ClusterSnapshot) {
        if fresh.leader.is_some() {
            self.failsafe_leader = None;
            return;
        }
        let acked = self.failsafe_seen.load(std::sync::atomic::Ordering::SeqCst);
        let ttl_ms = self.timing.ttl.as_millis() as u64;
        if !self.failsafe || unix_ms().saturating_sub(acked) > 2 * ttl_ms {
            return;
        }
        let Some(leader) = self.snapshot.leader.as_ref() else {
            return;
        };
        if leader.name == self.cfg.name {
            return;
        }
        if let Some(r) = records(&self.snapshot)
            .into_iter()
            .find(|r| r.state.name == leader.name && !r.state.api_url.is_empty())
        {
            self.failsafe_leader = Some((leader.name.clone(), r.state.api_url));
        }
    }

    /// Whether the leader this member acknowledged through an etcd outage
    /// has stopped running as primary (or cannot be asked): until then its
    /// writes since the outage began may exist nowhere else, and it takes
    /// its key back itself.
    async fn failsafe_leader_gone(&mut self) -> bool {
        let Some((name, url)) = self.failsafe_leader.clone() else {
            return true;
        };
        let answer = crate::http_client::get_json(&format!("{url}/patroni"), PEER_TIMEOUT)
            .await
            .ok();
        if answer.as_ref().is_some_and(|v| v["role"] == "primary") {
            tracing::info!(
                leader = %name,
                "not taking the leader key: the leader acknowledged while etcd was out of reach still runs as primary"
            );
            return false;
        }
        if answer.is_none() {
            let acked = self.failsafe_seen.load(std::sync::atomic::Ordering::SeqCst);
            if let Some(wait_ms) = silent_failsafe_leader_wait(acked, unix_ms(), &self.timing) {
                tracing::info!(
                    leader = %name,
                    wait_ms,
                    "not taking the leader key yet: the leader acknowledged while etcd was out of reach does not answer, and may take writes until its own deadline"
                );
                return false;
            }
        }
        self.failsafe_leader = None;
        true
    }

    /// Before taking the key, asks the other members for their current
    /// positions, since the published ones are up to a loop old: a replica
    /// that received more WAL since must win instead, and under quorum
    /// commit only positions read now count (a published one may predate
    /// the last commit that member acknowledged), so a member that does not
    /// answer is not counted as seen. Whether this node may still take the
    /// key: as the best candidate, or, for a manual failover, as an
    /// eligible one.
    async fn fresh_check(&self, view: &ClusterView, best_only: bool) -> bool {
        let mut fresh = view.clone();
        let quorum = view.quorum_commit();
        let peers: Vec<(usize, String)> = fresh
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.name != self.cfg.name && m.running && !m.api_url.is_empty())
            .map(|(i, m)| (i, format!("{}/patroni", m.api_url)))
            .collect();
        let answers = crate::join_all(peers.iter().map(|(_, url)| {
            let url = url.clone();
            async move { crate::http_client::get_json(&url, PEER_TIMEOUT).await.ok() }
        }))
        .await;
        for ((i, _), answer) in peers.iter().zip(answers) {
            let m = &mut fresh.members[*i];
            // A peer that does not answer keeps its published record.
            if let Some(v) = answer {
                let lsn = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
                m.received_lsn = lsn("received_lsn").or(m.received_lsn);
                m.replayed_lsn = lsn("replayed_lsn").or(m.replayed_lsn);
            }
        }
        if quorum {
            // A member's API reports its last loop's observation; the
            // quorum rule needs what it holds now, so ask its PostgreSQL.
            let listed: Vec<(usize, Option<HostAddr>)> = fresh
                .members
                .iter()
                .enumerate()
                .filter(|(_, m)| m.name != self.cfg.name && view.sync_members.contains(&m.name))
                .map(|(i, m)| (i, self.member_address(&m.name)))
                .collect();
            let positions = crate::join_all(
                listed
                    .iter()
                    .map(|(_, addr)| self.standby_position(addr.clone())),
            )
            .await;
            for m in fresh.members.iter_mut() {
                if m.name != self.cfg.name && view.sync_members.contains(&m.name) {
                    m.received_lsn = None;
                    m.replayed_lsn = None;
                }
            }
            for ((i, _), pos) in listed.iter().zip(positions) {
                if let Some((received, replayed)) = pos {
                    fresh.members[*i].received_lsn = received;
                    fresh.members[*i].replayed_lsn = replayed;
                }
            }
        }
        if let Some(me) = fresh.members.iter_mut().find(|m| m.name == self.cfg.name) {
            me.received_lsn = self.obs.pg.received_lsn.or(me.received_lsn);
            me.replayed_lsn = self.obs.pg.replayed_lsn.or(me.replayed_lsn);
            me.running = self.obs.pg.running;
            me.last_seen_ms_ago = 0;
        }
        let ranking = rank_candidates(&fresh, &self.settings);
        let me = self.cfg.name.as_str();
        let ok = if best_only {
            ranking.best() == Some(me)
        } else {
            ranking.is_eligible(me)
        };
        if !ok {
            match ranking.exclusion(me) {
                Some(why) => tracing::info!("not taking the leader key: {why}"),
                None => tracing::info!(
                    best = ranking.best().unwrap_or("nobody"),
                    "a peer reported a better position; not taking the leader key"
                ),
            }
        }
        ok
    }

    /// A standby's WAL positions (received, replayed) read from its
    /// PostgreSQL now, or `None` if it cannot be asked.
    async fn standby_position(&self, addr: Option<HostAddr>) -> Option<(Option<u64>, Option<u64>)> {
        standby_position_at(&self.pg.source_conninfo(&addr?)).await
    }

    async fn acquire(&mut self, reason: &AcquireReason, view: &ClusterView) {
        if !self.try_acquire(reason, view).await
            // A key this primary could not take back was gone or changed
            // since the view was read (a failsafe leader's lease ran out
            // in an outage): the next round, on a fresh view, takes it in
            // an election or follows whoever has it, demoting then.
            && !matches!(reason, AcquireReason::OwnKey | AcquireReason::PausedPrimary)
            && self.obs.pg.running
            && !self.obs.pg.in_recovery
            && !self.holds_leader_key()
        {
            // A primary that could not take the key (checks failed, another
            // member was first, etcd failed) must not go on taking writes
            // while someone else may.
            self.demote(&DemoteReason::NoLeaderKey {
                because: pgwarden_ha::WaitReason::AcquireFailed,
            })
            .await;
        }
    }

    /// Tries to take the leader key; whether it did.
    async fn try_acquire(&mut self, reason: &AcquireReason, view: &ClusterView) -> bool {
        // Only a key the old leader handed over after its checks; a
        // switchover request left behind by a leader that died is a
        // failover like any other.
        let switchover = view
            .failover_request
            .as_ref()
            .is_some_and(|r| r.from_leader.is_some() && r.released);
        let checked = match reason {
            AcquireReason::BestCandidate => {
                self.failsafe_leader_gone().await && self.fresh_check(view, true).await
            }
            // A failover the operator named still may not lose a commit
            // under quorum commit; a switchover's candidate catches up with
            // the stopped leader instead.
            AcquireReason::FailoverRequested { forced: false }
                if view.quorum_commit() && !switchover =>
            {
                self.fresh_check(view, false).await
            }
            AcquireReason::FailoverRequested { .. } => true,
            // Already the primary the key names: nothing to check.
            AcquireReason::OwnKey => true,
            // The operator owns the cluster; this primary already takes
            // the writes.
            AcquireReason::PausedPrimary => true,
        };
        if !checked {
            return false;
        }
        // Before the lease is refreshed: the demotion deadline runs from
        // the refresh, and a long catch-up must not eat into it. Only a
        // switchover's: the stopped leader's final position is on its way.
        // A failover's leader is gone, its last published position up to a
        // loop old; WAL not received by now will not come, and waiting a
        // ttl for it would only hold the failover up.
        if let (AcquireReason::FailoverRequested { forced: false }, Some(target), true) =
            (reason, view.last_leader_lsn, switchover)
        {
            self.catch_up(target).await;
        }
        let lease = match self.ensure_lease().await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot take the leader key without a lease");
                return false;
            }
        };
        if let Err(e) = self.watchdog.arm() {
            if self.watchdog.required() {
                tracing::error!("not taking the leader key: watchdog required but {e}");
                return false;
            }
        }
        // The lease's expiry runs from its last refresh, so refresh it now:
        // the demotion deadline is counted from this moment.
        let t0 = Instant::now();
        if let Err(e) = self.dcs.keep_alive_once(lease).await {
            tracing::warn!(error = %e, "cannot refresh the lease before taking the leader key");
            if matches!(e, pgwarden_dcs::DcsError::LeaseNotFound(_)) {
                self.lease = None;
            }
            return false;
        }
        let won = match reason {
            AcquireReason::BestCandidate | AcquireReason::PausedPrimary => {
                self.dcs.acquire_leader(&self.cfg.name, lease).await
            }
            AcquireReason::FailoverRequested { .. } => {
                let from = view
                    .failover_request
                    .as_ref()
                    .and_then(|r| r.from_leader.clone())
                    .unwrap_or_default();
                self.dcs
                    .take_over_leader(&from, &self.cfg.name, lease)
                    .await
            }
            AcquireReason::OwnKey => match self.snapshot.leader.as_ref() {
                Some(k) if k.name == self.cfg.name => {
                    self.dcs.rebind_leader(&self.cfg.name, k.lease, lease).await
                }
                _ => Ok(false),
            },
        };
        match won {
            Ok(true) => {
                self.last_renewal = Some(t0);
                tracing::info!(member = %self.cfg.name, "acquired the leader key");
                // Read back so this iteration's publication knows it leads.
                if let Ok(snap) = self.dcs.read_cluster().await {
                    self.snapshot = snap;
                }
                let why = match reason {
                    AcquireReason::BestCandidate => "automatic failover: the leader key was free",
                    AcquireReason::FailoverRequested { .. } => "manual failover or switchover",
                    AcquireReason::OwnKey => "the key named this node already",
                    AcquireReason::PausedPrimary => {
                        "maintenance mode: the primary took the free key"
                    }
                };
                if *reason == AcquireReason::PausedPrimary {
                    // The operator's primary, in maintenance mode: only the
                    // key changes hands (a standby cluster's leader
                    // promoted by hand is not turned back into a standby).
                } else if record::standby_cluster(&self.snapshot).is_some() {
                    self.follow_remote().await;
                } else if self.obs.pg.running && self.obs.pg.in_recovery {
                    self.promote(why).await;
                }
                true
            }
            Ok(false) => {
                self.watchdog.disarm();
                tracing::info!("another member took the leader key first");
                false
            }
            Err(e) => {
                self.watchdog.disarm();
                tracing::warn!(error = %e, "taking the leader key failed");
                false
            }
        }
    }

    /// Waits (at most a ttl) until this replica has received WAL up to
    /// `target`, the old leader's final position in a switchover, so the
    /// promotion keeps every transaction the old leader committed.
    async fn catch_up(&mut self, target: u64) {
        let deadline = Instant::now() + self.timing.ttl;
        let every = self.renew_every();
        let mut renewed = Instant::now();
        loop {
            // The member's lease is renewed by the loop, which waits here:
            // a catch-up of a ttl would let it run out.
            if renewed.elapsed() >= every {
                if let Some(lease) = self.lease {
                    let _ = self.dcs.keep_alive_once(lease).await;
                }
                renewed = Instant::now();
            }
            let received = self.obs.pg.received_lsn.max(self.obs.pg.replayed_lsn);
            if received.is_some_and(|r| r >= target) {
                return;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    target,
                    ?received,
                    "promoting before reaching the old leader's final position"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.obs = self.pg.observe(Duration::from_secs(1)).await;
        }
    }

    async fn promote(&mut self, why: &str) {
        if self.sync.protection.synchronous() {
            // Before the first write can be acknowledged, PostgreSQL must
            // already wait for standbys: those running now will reconnect to
            // this node. In strict mode with none, commits wait for one.
            let fenced = crate::record::fenced(&self.snapshot);
            let members: Vec<String> = records(&self.snapshot)
                .into_iter()
                .filter(|r| r.state.name != self.cfg.name && r.state.running)
                .filter(|r| !r.state.tags.nosync && !fenced.contains(&r.state.name))
                .map(|r| r.state.name)
                .collect();
            let config = wanted_config(&self.sync, &SyncConfig::none(), &members);
            self.apply_sync(&config).await;
        }
        let timeline = self.obs.pg.timeline;
        let lsn = self.obs.pg.received_lsn.unwrap_or(0);
        tracing::info!(member = %self.cfg.name, "promoting the local PostgreSQL: {why}");
        let mut promotion = self.pg.promote();
        let promoted = loop {
            tokio::select! {
                r = &mut promotion => break r.unwrap_or_else(|e| Err(PgCtlError::CommandFailed {
                    program: "pg_ctl promote".into(),
                    status: "panicked".into(),
                    output: e.to_string(),
                })),
                // A promotion that waits for recovery (a server that just
                // crashed and restarts) must not cost this node its lease.
                _ = tokio::time::sleep(self.timing.loop_wait) => {
                    self.renew().await;
                }
            }
        };
        // A promotion that outlasted the lease (renewals failing while
        // PostgreSQL replayed a backlog) ends with a primary another
        // member may already have been elected beside: it stops at once.
        if promoted.is_ok() && !self.lease_fresh() && !self.renew().await {
            let since = self.last_renewal.map_or(Duration::MAX, |t| t.elapsed());
            self.demote(&DemoteReason::LeaseRenewalFailed {
                since,
                limit: self.timing.demote_after(),
            })
            .await;
            return;
        }
        match promoted {
            Ok(()) => {
                self.former_primary = true;
                self.obs = self.pg.observe(Duration::from_secs(2)).await;
                // Before the replicas come to stream from here.
                self.manage_slots(true).await;
                let entry = HistoryEntry {
                    timeline,
                    lsn,
                    reason: why.to_string(),
                    time_ms: unix_ms(),
                    leader: self.cfg.name.clone(),
                };
                if let Err(e) = self.dcs.append_history(&entry).await {
                    tracing::warn!(error = %e, "could not record the promotion in history");
                }
                let _ = self
                    .dcs
                    .put_status(&self.cfg.name, &serde_json::json!({ "lsn": lsn }))
                    .await;
                self.run_callback(
                    self.cfg.callbacks.on_role_change.clone(),
                    "on_role_change",
                    "primary",
                );
            }
            Err(e) => tracing::error!(error = %e, "promotion failed"),
        }
    }

    async fn demote(&mut self, reason: &DemoteReason) {
        if !self.obs.process {
            // Already stopped (an earlier demotion while etcd stays out of
            // reach): nothing takes writes, so nothing to do or announce.
            if self.holds_leader_key() && self.dcs_ok {
                let _ = self.dcs.release_leader(&self.cfg.name).await;
            }
            return;
        }
        // Without a valid lease every moment counts: an immediate stop ends
        // writes now; crash recovery at the next start is the price.
        let mode = match reason {
            DemoteReason::OtherLeader { .. } => StopMode::Fast,
            _ => StopMode::Immediate,
        };
        tracing::warn!(member = %self.cfg.name, mode = ?mode, "stopping the local primary: {reason}");
        if let Err(e) = self.pg.stop(mode).await {
            tracing::error!(error = %e, "stopping PostgreSQL failed; killing it");
            let _ = self
                .pg
                .with(|i| {
                    i.kill9();
                    Ok(())
                })
                .await;
        }
        self.former_primary = true;
        self.last_renewal = None;
        // Health checks and routing learn it now, not at the end of a
        // round that may wait out etcd's time-outs.
        self.obs.pg.running = false;
        self.obs.process = false;
        self.publish_status();
        if self.holds_leader_key() && self.dcs_ok {
            let _ = self.dcs.release_leader(&self.cfg.name).await;
        }
        self.run_callback(self.cfg.callbacks.on_stop.clone(), "on_stop", "demoted");
        self.run_callback(
            self.cfg.callbacks.on_role_change.clone(),
            "on_role_change",
            "replica",
        );
    }

    async fn start(&mut self, mode: &StartMode) {
        let (wait, role) = match mode {
            StartMode::AsLeader {
                failed_for,
                timeout,
            } => {
                let role = match record::standby_cluster(&self.snapshot) {
                    None => "primary",
                    Some(Ok(remote)) => {
                        if let Err(e) = self.point_at_remote(&remote, false).await {
                            tracing::error!(error = %e, "cannot configure the standby leader");
                            return;
                        }
                        "standby_leader"
                    }
                    Some(Err(e)) => {
                        self.standby_cluster_unreadable(e);
                        return;
                    }
                };
                (
                    timeout
                        .saturating_sub(*failed_for)
                        .min(self.timing.loop_wait)
                        .max(RETRY_PACE),
                    role,
                )
            }
            StartMode::ReplicaOf { leader } => {
                let Some(addr) = self.member_address(leader) else {
                    return;
                };
                // A rewound server still starting (replaying up to
                // consistency, which takes longer than a round after a long
                // divergence) is left to finish: a rejoin would stop it,
                // rewind again (nothing to do) and start it from its last
                // restart point, every round, and an unclean stop before
                // consistency would leave single-user recovery an
                // inconsistent data directory to finish. Any other
                // postmaster (one started as a primary, say) is rejoined.
                let left_to_finish = self.obs.process && self.recovering_after_rejoin;
                if self.former_primary && !self.rejoined && !left_to_finish {
                    match self.rejoin(&addr, None).await {
                        Ok(true) => self.recovering_after_rejoin = true,
                        // The leader is not ready yet: the next round.
                        Ok(false) => return,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot rejoin as a replica");
                            return;
                        }
                    }
                }
                let user = self.pg.replication_user().to_string();
                let slot = self.member_slot();
                let res = self
                    .pg
                    .with(move |i| {
                        i.set_primary_slot(slot)?;
                        i.set_standby(Some((&addr.host, addr.port)), &user)
                    })
                    .await;
                if let Err(e) = res {
                    tracing::error!(error = %e, "cannot configure the replica");
                    return;
                }
                self.upstream = Some(leader.clone());
                (self.timing.loop_wait, "replica")
            }
            StartMode::Replica => {
                let user = self.pg.replication_user().to_string();
                if let Err(e) = self.pg.with(move |i| i.set_standby(None, &user)).await {
                    tracing::error!(error = %e, "cannot configure the replica");
                    return;
                }
                (self.timing.loop_wait, "replica")
            }
        };
        let t0 = Instant::now();
        match self.pg.start(wait).await {
            Ok(()) => {
                self.start_failed_since = None;
                self.run_callback(self.cfg.callbacks.on_start.clone(), "on_start", role);
            }
            Err(e) => {
                let exited = matches!(e, PgCtlError::Exited { .. });
                tracing::warn!(error = %first_line(&e), "PostgreSQL is not up yet");
                if exited || matches!(mode, StartMode::AsLeader { .. }) {
                    self.start_failed_since.get_or_insert(t0);
                }
            }
        }
    }

    /// Whether the local replica replayed WAL past the point where the
    /// leader's timeline `leader_tl` forked off the one it is on. Asked
    /// only while it does not stream; an answer that cannot be had is no.
    async fn replayed_past_fork(&self, leader: &HostAddr, leader_tl: u32) -> bool {
        let Some(replayed) = self.obs.pg.replayed_lsn else {
            return false;
        };
        let Some((local_tli, local_history)) = self.local_standing(replayed).await else {
            return false;
        };
        // A leader's timeline in its record may trail its promotion: only a
        // leader ahead of this replica can have left it behind.
        if local_tli >= leader_tl {
            return false;
        }
        let leader_history = self.history(Some(leader), leader_tl).await;
        pgwarden_ha::timeline::diverged_from_source(
            pgwarden_ha::timeline::Standing {
                tli: local_tli,
                history: local_history.as_deref(),
            },
            replayed,
            pgwarden_ha::timeline::Standing {
                tli: leader_tl,
                history: leader_history.as_deref(),
            },
        )
    }

    /// Makes a former primary, or a standby whose history forked, fit to
    /// follow `leader`, a member or, given `remote`, a standby cluster's
    /// source: crash recovery if it went down hard, then pg_rewind; a fresh
    /// clone (by the standby cluster's methods, for its source) when
    /// rewinding fails and that is allowed. A former primary that shut
    /// down cleanly after the leader received all its WAL (a switchover)
    /// needs none of it. `Ok(false)`: the leader is not ready to be
    /// followed yet (still promoting, or out of reach); nothing was done.
    async fn rejoin(
        &mut self,
        leader: &HostAddr,
        remote: Option<&pgwarden_ha::StandbyCluster>,
    ) -> Result<bool, PgCtlError> {
        let whom = if remote.is_some() {
            "the remote source"
        } else {
            "the leader"
        };
        // pg_rewind reads the source's timeline from its control file, which
        // a promotion updates only at its next checkpoint: without one it
        // may see no fork and rewind nothing, or a fork at the wrong place.
        // A member leader still in recovery has not even chosen its new
        // timeline: rewinding onto it ruins the data directory. A source
        // whose control file is current (a standby cluster's source that
        // never failed over, say, the primary of another site) is spared
        // the I/O of a checkpoint.
        let source_tli = match self.prepare_source(leader, remote.is_none()).await {
            Ok(Some(tli)) => {
                self.rejoin_wait = None;
                tli
            }
            Ok(None) => {
                self.note_rejoin_wait(format!("{whom} is still promoting"));
                return Ok(false);
            }
            Err(e) if remote.is_none() => {
                self.note_rejoin_wait(format!("{whom} cannot be reached ({e})"));
                return Ok(false);
            }
            Err(e) => {
                tracing::warn!(error = %e, source = %leader, "CHECKPOINT on the source before pg_rewind failed");
                0
            }
        };
        self.busy("rewinding").await;
        // A fast stop that runs out of time (a long shutdown checkpoint)
        // leaves the server running; the steps that follow rewrite its
        // data directory, and refuse to under a live server.
        if self.pg.stop(StopMode::Fast).await.is_err() {
            let _ = self.pg.stop(StopMode::Immediate).await;
        }
        let state = self.control_state().await;
        let source = self.pg.tool_conninfo(leader);
        let password = self.pg.password().map(str::to_string);
        let crashed = !matches!(
            state.as_deref(),
            Some("shut down" | "shut down in recovery")
        );
        // Only a primary's own clean shutdown: a standby's last checkpoint
        // is a restart point, which says nothing of what it replayed.
        if remote.is_none() && state.as_deref() == Some("shut down") && source_tli > 1 {
            let local_tli = self
                .controldata("Latest checkpoint's TimeLineID")
                .await
                .and_then(|v| v.trim().parse::<u32>().ok());
            let checkpoint = self
                .controldata("Latest checkpoint location")
                .await
                .and_then(|v| parse_lsn(&v));
            let history = self.history(Some(leader), source_tli).await;
            if let (Some(local_tli), Some(checkpoint), Some(history)) =
                (local_tli, checkpoint, history.as_deref())
            {
                let source = pgwarden_ha::timeline::Standing {
                    tli: source_tli,
                    history: Some(history),
                };
                if !pgwarden_ha::timeline::needs_rewind_after_clean_shutdown(
                    local_tli, checkpoint, source,
                ) {
                    tracing::info!(
                        leader = %leader,
                        "no rewind needed: the leader's timeline forked after this server's last WAL"
                    );
                    self.problem = None;
                    self.idle();
                    return Ok(true);
                }
            }
        }
        let res = self
            .pg
            .with(move |i| {
                if crashed {
                    // Single-user mode refuses to run in standby mode.
                    i.clear_standby()?;
                    i.recover_single_user()?;
                }
                i.rewind(&source, password.as_deref())
            })
            .await;
        // former_primary stays set until the replica streams from the
        // leader: that, not pg_rewind's exit code, proves the histories met.
        let res = match res {
            Ok(()) => {
                tracing::info!(leader = %leader, "rewound onto the history of {whom}");
                self.problem = None;
                Ok(true)
            }
            Err(e) => {
                let why = format!("pg_rewind failed: {}", telling_line(&e));
                tracing::error!("{why}");
                if self.cfg.reclone_on_rewind_failure {
                    self.problem = Some(format!("{why}; re-cloned from {whom}"));
                    self.busy("cloning").await;
                    match remote {
                        Some(r) => self.create_standby_leader(r).await,
                        None => self.clone_from(leader).await,
                    }
                    .map(|()| true)
                } else {
                    self.problem = Some(format!(
                        "{why}; left stopped (reclone_on_rewind_failure = false)"
                    ));
                    Err(e)
                }
            }
        };
        self.idle();
        res
    }

    async fn follow(&mut self, leader: &str) {
        let Some(addr) = self.member_address(leader) else {
            return;
        };
        let leader_tl = self.member_record(leader).map_or(0, |r| r.state.timeline);
        // Asked of a former primary too: a WAL receiver that connected once
        // fetched the leader's history file, and the timeline the server
        // reports counts it, so comparing timelines alone would have such a
        // former primary follow, never rewound, with WAL the leader lacks.
        let diverged = !self.obs.streaming
            && self.obs.pg.in_recovery
            && leader_tl > 1
            && self.replayed_past_fork(&addr, leader_tl).await;
        if diverged && !self.former_primary {
            tracing::warn!(
                leader,
                "this replica replayed WAL that the leader's timeline does not have; it must rewind"
            );
            self.former_primary = true;
        }
        if self.former_primary
            && !self.obs.streaming
            && (leader_tl > self.obs.pg.timeline || diverged)
        {
            tracing::info!(leader, "this former primary must rejoin the new timeline");
            if let Ok(true) = self.rejoin(&addr, None).await {
                self.rejoined = true;
                self.recovering_after_rejoin = true;
                self.start(&StartMode::ReplicaOf {
                    leader: leader.to_string(),
                })
                .await;
                self.rejoined = false;
            }
            return;
        }
        self.repoint(leader, addr).await;
    }

    /// In maintenance mode the operator owns PostgreSQL, but a running
    /// replica still follows a leader that changed by hand (a switchover
    /// or failover the operator asked for), as Patroni's do: its
    /// `primary_conninfo` is rewritten and reloaded. Nothing is stopped,
    /// started or rewound.
    async fn follow_paused(&mut self) {
        let Some(leader) = self.snapshot.leader.as_ref().map(|l| l.name.clone()) else {
            return;
        };
        if leader == self.cfg.name
            || !self.obs.pg.running
            || !self.obs.pg.in_recovery
            || record::standby_cluster(&self.snapshot).is_some()
        {
            return;
        }
        let Some(addr) = self.member_address(&leader) else {
            return;
        };
        self.repoint(&leader, addr).await;
    }

    /// Points the local replica at `leader` (at `addr`), or at the member
    /// its `replicatefrom` names, reloading if that changes anything.
    async fn repoint(&mut self, leader: &str, addr: HostAddr) {
        let (source, addr) = self
            .upstream_of(leader)
            .unwrap_or_else(|| (leader.to_string(), addr));
        let user = self.pg.replication_user().to_string();
        let slot = self.member_slot();
        let res = self
            .pg
            .with(move |i| {
                if i.upstream() == Some((addr.host.as_str(), addr.port))
                    && i.primary_slot() == slot.as_deref()
                {
                    return Ok(false);
                }
                // A former standby leader streamed through the remote's slot.
                i.set_primary_slot(slot)?;
                i.set_standby(Some((&addr.host, addr.port)), &user)?;
                // primary_conninfo is reloadable since PostgreSQL 13.
                i.reload()?;
                Ok(true)
            })
            .await;
        match res {
            Ok(true) if source == leader => tracing::info!(leader, "now streaming from the leader"),
            Ok(true) => {
                tracing::info!(upstream = %source, "now streaming from {source} (replicatefrom)")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::error!(error = %e, "cannot point the replica at its upstream");
                return;
            }
        }
        self.upstream = Some(source);
    }

    /// The slot this member streams through from another member.
    fn member_slot(&self) -> Option<String> {
        self.cfg
            .use_slots
            .then(|| crate::slots::slot_name(&self.cfg.name))
    }

    /// Writes the recovery settings that make this node stream from the
    /// standby cluster's remote source (and fetch its archive, when a
    /// `restore_command` is given); `Ok(true)` if anything changed. `force`
    /// writes them even when they look unchanged, as after pg_rewind, which
    /// replaces the data directory's files with the source's.
    async fn point_at_remote(
        &self,
        remote: &pgwarden_ha::StandbyCluster,
        force: bool,
    ) -> Result<bool, PgCtlError> {
        let user = self.pg.replication_user().to_string();
        let upstream = remote.upstream().map(|(h, p)| (h.to_string(), p));
        let slot = remote.primary_slot_name.clone();
        let recovery = remote.recovery_settings();
        self.pg
            .with(move |i| {
                let upstream = upstream.as_ref().map(|(h, p)| (h.as_str(), *p));
                if !force
                    && i.upstream() == upstream
                    && i.primary_slot() == slot.as_deref()
                    && *i.source_settings() == recovery
                {
                    return Ok(false);
                }
                i.set_primary_slot(slot)?;
                i.set_standby(upstream, &user)?;
                i.set_source_settings(recovery)?;
                Ok(true)
            })
            .await
    }

    /// Whether this standby leader, in recovery but not streaming from
    /// `source` for a round, has a history that parted from the source's
    /// (the source failed over after this one replayed past its fork, or
    /// this one was a primary of its own): then no reconnecting helps,
    /// only a rewind. Asked at most every [`FORK_CHECK_PACE`]; whatever
    /// cannot be read answers no.
    async fn must_rewind_onto_remote(&mut self, source: &HostAddr) -> bool {
        let pg = &self.obs.pg;
        if !(pg.running && pg.in_recovery)
            || self.obs.streaming
            || self.remote_silent_since.is_none()
            || self
                .remote_fork_checked
                .is_some_and(|t| t.elapsed() < FORK_CHECK_PACE)
        {
            return false;
        }
        let Some(replayed) = pg.replayed_lsn else {
            return false;
        };
        self.remote_fork_checked = Some(Instant::now());
        let (Some((local_tli, local_history)), Some((source_tli, source_history))) = (
            self.local_standing(replayed).await,
            self.source_standing(source).await,
        ) else {
            return false;
        };
        use pgwarden_ha::timeline::{diverged_from_source, Standing};
        diverged_from_source(
            Standing {
                tli: local_tli,
                history: local_history.as_deref(),
            },
            replayed,
            Standing {
                tli: source_tli,
                history: source_history.as_deref(),
            },
        )
    }

    /// The timeline this standby replays, and its history file. Its last
    /// restart point may predate a timeline switch it followed, so the
    /// WAL segments it holds from its replay position on count too: they
    /// are named after the timeline they were received or recycled on.
    async fn local_standing(&self, replayed: u64) -> Option<(u32, Option<String>)> {
        const WAIT: Duration = Duration::from_secs(2);
        let rows = self
            .pg
            .query(
                "SELECT (SELECT timeline_id FROM pg_control_checkpoint()), \
                 (SELECT setting FROM pg_settings WHERE name = 'wal_segment_size')",
                WAIT,
            )
            .await
            .ok()?;
        let row = rows.first()?;
        let checkpoint_tli: u32 = row.first()?.as_deref()?.parse().ok()?;
        let segment_size: u64 = row.get(1)?.as_deref()?.parse().ok()?;
        let from = pgwarden_ha::timeline::segment_name_suffix(replayed, segment_size);
        let segments = self
            .pg
            .query(
                &format!(
                    "SELECT name FROM pg_ls_waldir() WHERE length(name) = 24 AND substr(name, 9) >= '{from}'"
                ),
                WAIT,
            )
            .await
            .ok()?;
        let tli = segments
            .iter()
            .filter_map(|r| {
                r.first()?
                    .as_deref()
                    .and_then(pgwarden_ha::timeline::segment_timeline)
            })
            .chain([checkpoint_tli])
            .max()?;
        let history = self.history(None, tli).await;
        Some((tli, history))
    }

    /// The timeline of the server at `source` (the one it writes, if it is
    /// a primary: its control file learns of a promotion only at the next
    /// checkpoint), and its history file.
    async fn source_standing(&self, source: &HostAddr) -> Option<(u32, Option<String>)> {
        let rows = self
            .pg
            .query_in(
                Some(source),
                "postgres",
                "SELECT CASE WHEN pg_is_in_recovery() \
                 THEN (SELECT timeline_id FROM pg_control_checkpoint()) \
                 ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END",
                Duration::from_secs(2),
            )
            .await
            .ok()?;
        let tli: u32 = rows.first()?.first()?.as_deref()?.parse().ok()?;
        let history = self.history(Some(source), tli).await;
        Some((tli, history))
    }

    /// The text of timeline `tli`'s history file on the local server or,
    /// given `at`, on another; `None` for timeline 1, which has none, or
    /// when it cannot be read.
    async fn history(&self, at: Option<&HostAddr>, tli: u32) -> Option<String> {
        if tli <= 1 {
            return None;
        }
        let sql = format!(
            "SELECT pg_read_file('pg_wal/{}', 0, 1048576, true)",
            pgwarden_ha::timeline::history_file_name(tli)
        );
        let wait = Duration::from_secs(2);
        let rows = match at {
            None => self.pg.query(&sql, wait).await,
            Some(a) => self.pg.query_in(Some(a), "postgres", &sql, wait).await,
        }
        .ok()?;
        rows.into_iter().next()?.into_iter().next()?
    }

    fn standby_cluster_unreadable(&mut self, e: String) {
        let why = format!("{e}; the standby leader is left as it is");
        if self.problem.as_deref() != Some(why.as_str()) {
            tracing::error!("{why}");
            self.problem = Some(why);
        }
    }

    /// As the standby leader: stream from the remote source, turning a
    /// primary into a standby of it when the cluster was just made a
    /// standby cluster.
    async fn follow_remote(&mut self) {
        let remote = match record::standby_cluster(&self.snapshot) {
            Some(Ok(r)) => r,
            Some(Err(e)) => return self.standby_cluster_unreadable(e),
            None => return,
        };
        self.upstream = None;
        if self.obs.pg.running && !self.obs.pg.in_recovery {
            tracing::warn!(
                source = %remote.address(),
                "this primary leads a standby cluster now: restarting it as a standby of the remote source"
            );
            self.run_callback(self.cfg.callbacks.on_stop.clone(), "on_stop", "primary");
            if let Err(e) = self.pg.stop(StopMode::Fast).await {
                tracing::error!(error = %e, "cannot stop the primary to make it a standby");
                return;
            }
            if let Err(e) = self.point_at_remote(&remote, false).await {
                tracing::error!(error = %e, "cannot configure the standby leader");
                return;
            }
            match self.pg.start(self.timing.loop_wait).await {
                Ok(()) => self.run_callback(
                    self.cfg.callbacks.on_role_change.clone(),
                    "on_role_change",
                    "standby_leader",
                ),
                Err(e) => tracing::warn!(error = %first_line(&e), "PostgreSQL is not up yet"),
            }
            return;
        }
        if let Some((host, port)) = remote.upstream() {
            let addr = HostAddr::new(host, port);
            if self.must_rewind_onto_remote(&addr).await {
                tracing::warn!(
                    source = %remote.address(),
                    "this standby leader replayed WAL that its source's history does not have; it must rewind"
                );
                // A rewind, or the clone that replaces a failed one, holds
                // the loop for as long as it takes, its presence task
                // keeping the lease (and so the key) alive: unfed, the
                // watchdog would reset the node mid-step. A standby leader
                // takes no writes for it to stop.
                self.watchdog.disarm();
                let rejoined = self.rejoin(&addr, Some(&remote)).await;
                self.renew_after_step().await;
                if !matches!(rejoined, Ok(true)) {
                    return;
                }
                if let Err(e) = self.point_at_remote(&remote, true).await {
                    tracing::error!(error = %e, "cannot configure the standby leader");
                    return;
                }
                if let Err(e) = self.pg.start(self.timing.loop_wait).await {
                    tracing::warn!(error = %first_line(&e), "PostgreSQL is not up yet");
                }
                return;
            }
        }
        match self.point_at_remote(&remote, false).await {
            Ok(true) => {
                // primary_conninfo and primary_slot_name are reloadable.
                if let Err(e) = self.pg.with(|i| i.reload()).await {
                    tracing::error!(error = %e, "cannot reload the standby leader's settings");
                    return;
                }
                tracing::info!(source = %remote.address(), "standby leader: now streaming from the remote source");
                if self
                    .problem
                    .as_deref()
                    .is_some_and(|p| p.contains("standby_cluster"))
                {
                    self.problem = None;
                }
            }
            Ok(false) => {}
            Err(e) => {
                tracing::error!(error = %e, "cannot point the standby leader at the remote source")
            }
        }
    }

    /// Whom a replica streams from: the member its `replicatefrom` tag
    /// names while that one is up (running, heard from within the ttl,
    /// and not streaming from this member itself), else the leader.
    fn upstream_of(&self, leader: &str) -> Option<(String, HostAddr)> {
        let ttl_ms = self.timing.ttl.as_millis() as u64;
        let now = unix_ms();
        let from = self
            .cfg
            .tags
            .replicatefrom
            .as_deref()
            .filter(|f| *f != leader && *f != self.cfg.name);
        let cascade = from.and_then(|from| {
            records(&self.snapshot)
                .into_iter()
                .find(|r| r.state.name == from)
                .filter(|r| {
                    now.saturating_sub(r.updated_ms) <= ttl_ms
                        && r.state.running
                        && r.status == "running"
                        && r.upstream.as_deref() != Some(self.cfg.name.as_str())
                })
                .and_then(|r| r.pg_address.parse().ok())
                .map(|a| (from.to_string(), a))
        });
        cascade.or_else(|| self.member_address(leader).map(|a| (leader.to_string(), a)))
    }

    async fn release(&mut self, reason: &ReleaseReason, view: &ClusterView) {
        let mut paused = Vec::new();
        match reason {
            ReleaseReason::Switchover { .. } => {
                let scheduled = view
                    .failover_request
                    .as_ref()
                    .is_some_and(|r| r.scheduled_at.is_some());
                if scheduled {
                    // Nobody waits on the API now: pause the connection
                    // managers here, as the API does for an immediate one.
                    let proxies: Vec<String> = records(&self.snapshot)
                        .into_iter()
                        .filter_map(|r| r.proxy_url)
                        .collect();
                    paused = handover::pause_proxies(&proxies, &self.credentials).await;
                    // The drain may have taken a while: stop only with a
                    // lease that certainly still stands.
                    if !self.renew().await {
                        tracing::warn!("not switching over: the leader lease could not be renewed");
                        handover::resume_proxies(&paused, &self.credentials).await;
                        // Still the running primary, under the lease it
                        // last renewed: the watchdog stays armed with the
                        // deadline that renewal set (disarmed here, a later
                        // round would arm it afresh, as if renewed now).
                        self.kept_key = true;
                        return;
                    }
                }
                // A checkpoint first makes the shutdown checkpoint short.
                let conninfo = self.pg.source_conninfo(&self.cfg.pg_listen);
                let pg = &self.pg;
                let checkpoint_for = self.timing.loop_wait;
                let stop = async {
                    // Bounded: PostgreSQL takes writes until the stop, and
                    // a lease lost meanwhile (etcd out of reach) must not
                    // find it still running. The shutdown checkpoint does
                    // what this one did not get to.
                    let _ = tokio::time::timeout(checkpoint_for, checkpoint_at(&conninfo)).await;
                    if let Err(e) = pg.stop(StopMode::Fast).await {
                        tracing::error!(error = %e, "clean stop failed; stopping immediately");
                        let _ = pg.stop(StopMode::Immediate).await;
                    }
                };
                // Both can outlast the lease: the key (and the watchdog)
                // stay renewed until PostgreSQL has stopped taking writes,
                // so the candidate cannot be promoted beside it.
                let every = self.renew_every();
                holding_key(
                    &self.dcs,
                    &self.cfg.name,
                    self.lease,
                    every,
                    (&mut self.watchdog, &mut self.last_renewal),
                    stop,
                )
                .await;
                // The shutdown checkpoint is the last WAL this leader wrote;
                // the candidate promotes only once it has received it.
                let last = self
                    .controldata("Latest checkpoint location")
                    .await
                    .and_then(|v| parse_lsn(&v));
                if let Some(lsn) = last {
                    let status = serde_json::json!({ "lsn": lsn });
                    let _ = self.dcs.put_status(&self.cfg.name, &status).await;
                }
                let forced = view.failover_request.as_ref().is_some_and(|r| r.forced);
                if let (ReleaseReason::Switchover { candidate }, false) = (reason, forced) {
                    // After an immediate stop (the clean one failed) WAL
                    // goes on past the last checkpoint, where no position
                    // says what the candidate must have.
                    let clean = matches!(
                        self.controldata("Database cluster state").await.as_deref(),
                        // A standby leader stops in recovery.
                        Some("shut down" | "shut down in recovery")
                    );
                    let why = match last {
                        Some(lsn) if clean => self
                            .received_by(candidate, lsn, self.snapshot.failover_revision)
                            .await
                            .err(),
                        _ => Some("PostgreSQL did not shut down cleanly"),
                    };
                    if let Some(why) = why {
                        self.abandon_switchover(candidate, why).await;
                        handover::resume_proxies(&paused, &self.credentials).await;
                        return;
                    }
                }
            }
            ReleaseReason::PostgresDidNotStart { .. } => {
                let _ = self.pg.stop(StopMode::Immediate).await;
            }
        }
        // A standby leader wrote no WAL of its own: nothing to rewind.
        self.former_primary = !(self.obs.pg.running && self.obs.pg.in_recovery);
        self.run_callback(self.cfg.callbacks.on_stop.clone(), "on_stop", "demoted");
        // A switchover hands the key over: deleted together with a mark on
        // the request, so the candidate knows the key was not lost and may
        // skip the lag and quorum checks. A request changed meanwhile gets
        // no mark, and its candidate is judged as in any failover.
        let handed = match reason {
            ReleaseReason::Switchover { .. } => self
                .dcs
                .hand_over_leader(&self.cfg.name, self.snapshot.failover_revision)
                .await
                .unwrap_or(false),
            _ => false,
        };
        let released = if handed {
            Ok(true)
        } else {
            self.dcs.release_leader(&self.cfg.name).await
        };
        match released {
            Ok(_) => {
                tracing::info!(member = %self.cfg.name, handed_over = handed, "released the leader key: {reason}")
            }
            Err(e) => tracing::warn!(error = %e, "releasing the leader key failed"),
        }
        self.last_renewal = None;
        self.start_failed_since = None;
        self.run_callback(
            self.cfg.callbacks.on_role_change.clone(),
            "on_role_change",
            "replica",
        );
        if !paused.is_empty() {
            let dcs = self.dcs.clone();
            let me = self.cfg.name.clone();
            let credentials = self.credentials.clone();
            tokio::spawn(async move {
                let wait = crate::api::DEFAULT_SWITCHOVER_WAIT + handover::WRITABLE_WAIT;
                handover::wait_for_writable_leader(&dcs, Some(&me), wait).await;
                handover::resume_proxies(&paused, &credentials).await;
            });
        }
    }

    /// How often the leader key (or the member's lease) is renewed while
    /// a long step holds up the loop: every `loop_wait`, at most every
    /// third of the ttl.
    fn renew_every(&self) -> Duration {
        self.timing.loop_wait.min(self.timing.ttl / 3)
    }

    /// Waits until `candidate` has received WAL up to `lsn`, with the
    /// leader key (and the watchdog) kept renewed; `Err` says why not.
    /// Its server is asked directly; its member record, should that be out
    /// of reach, can only show positions it reached (a record from before
    /// the stop shows less than the shutdown checkpoint). With this leader
    /// stopped nothing more can reach it, so the wait is short: 2 s of
    /// the candidate's own answers, or two rounds of its loop when only
    /// its record can tell. A request cancelled or replaced meanwhile (its
    /// revision is no longer `revision`) ends it.
    async fn received_by(
        &mut self,
        candidate: &str,
        lsn: u64,
        revision: i64,
    ) -> Result<(), &'static str> {
        let conninfo = self
            .member_address(candidate)
            .map(|a| self.pg.source_conninfo(&a));
        // A record is published at the end of a round with the positions
        // read at its start: two rounds may pass before one shows it.
        let wait_for = self
            .timing
            .ttl
            .min(self.timing.loop_wait * 2 + Duration::from_secs(2));
        let deadline = Instant::now() + wait_for;
        let dcs = &self.dcs;
        let wait = async {
            // The candidate's own answer settles it sooner: what it has not
            // received a moment after the stop, it never will.
            let mut behind_since: Option<Instant> = None;
            loop {
                if let Some(c) = &conninfo {
                    if let Some((received, replayed)) = standby_position_at(c).await {
                        if received.max(replayed).is_some_and(|p| p >= lsn) {
                            return Ok(());
                        }
                        if behind_since.get_or_insert_with(Instant::now).elapsed()
                            >= Duration::from_secs(2)
                        {
                            return Err("the candidate did not receive this leader's last WAL");
                        }
                    }
                }
                if let Ok(snap) = dcs.read_cluster().await {
                    if snap.failover_revision != revision {
                        return Err("the request was cancelled or replaced");
                    }
                    let published = records(&snap)
                        .into_iter()
                        .find(|r| r.state.name == candidate)
                        .and_then(|r| r.state.wal_position());
                    if published.is_some_and(|p| p >= lsn) {
                        return Ok(());
                    }
                }
                if Instant::now() >= deadline {
                    return Err("the candidate did not receive this leader's last WAL");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let every = self.renew_every();
        // Boxed: the loop's future is deep enough already.
        holding_key(
            &self.dcs,
            &self.cfg.name,
            self.lease,
            every,
            (&mut self.watchdog, &mut self.last_renewal),
            Box::pin(wait),
        )
        .await
    }

    /// Gives up a switchover after this leader stopped PostgreSQL: the
    /// request is withdrawn, and PostgreSQL starts again as the primary
    /// at once (in maintenance mode too, where the loop would not start
    /// it), provided the key is still this leader's.
    async fn abandon_switchover(&mut self, candidate: &str, why: &str) {
        tracing::error!(%candidate, "switchover abandoned: {why}; staying leader");
        let revision = self.snapshot.failover_revision;
        match self.dcs.delete_failover_if(revision).await {
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "cannot withdraw the switchover request; ignoring it");
                self.abandoned_request = Some(revision);
            }
        }
        if !self.renew().await {
            tracing::warn!(
                "the leader key was lost meanwhile: not starting PostgreSQL as the primary"
            );
            return;
        }
        self.kept_key = true;
        let mode = StartMode::AsLeader {
            failed_for: Duration::ZERO,
            timeout: self.timing.primary_start_timeout,
        };
        self.start(&mode).await;
    }

    /// One step of keeping the synchronous standbys as the protection mode
    /// wants them; see [`pgwarden_ha::protection`] for the order of steps.
    async fn manage_sync(&mut self) {
        let settings = self.sync;
        let rows = match self
            .pg
            .query(
                "SELECT application_name, state, coalesce(sync_state, ''), \
                 pg_wal_lsn_diff(coalesce(flush_lsn, '0/0'), '0/0')::int8, \
                 pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8, \
                 usename, host(client_addr), sync_priority \
                 FROM pg_stat_replication \
                 UNION ALL SELECT NULL, NULL, NULL, NULL, \
                 pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8, NULL, NULL, NULL",
                Duration::from_secs(2),
            )
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read pg_stat_replication");
                return;
            }
        };
        let records = records(&self.snapshot);
        let fenced = crate::record::fenced(&self.snapshot);
        let col =
            |r: &Vec<Option<String>>, i: usize| r.get(i).cloned().flatten().unwrap_or_default();
        // The extra row, the only one without a name, carries the position
        // even when nothing streams.
        let current_lsn: Option<u64> = rows
            .iter()
            .find(|r| r.first().is_some_and(Option::is_none))
            .and_then(|r| col(r, 4).parse().ok());
        let rows: Vec<&Vec<Option<String>>> = rows
            .iter()
            .filter(|r| r.first().is_some_and(Option::is_some))
            .collect();
        self.replication = rows
            .iter()
            .map(|r| crate::status::ReplicationConnection {
                usename: col(r, 5),
                application_name: col(r, 0),
                client_addr: r.get(6).cloned().flatten(),
                state: col(r, 1),
                sync_state: col(r, 2),
                sync_priority: col(r, 7).parse().unwrap_or(0),
            })
            .collect();
        let mut streaming: Vec<(String, u64)> = rows
            .iter()
            .copied()
            .filter(|r| col(r, 1) == "streaming")
            .filter(|r| {
                let name = col(r, 0);
                name != self.cfg.name
                    && !fenced.contains(&name)
                    && records
                        .iter()
                        .any(|m| m.state.name == name && !m.state.tags.nosync)
            })
            .map(|r| (col(r, 0), col(r, 3).parse().unwrap_or(0)))
            .collect();
        streaming.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let acknowledging = rows
            .iter()
            .copied()
            .filter(|r| col(r, 1) == "streaming")
            .filter(|r| matches!(col(r, 2).as_str(), "sync" | "quorum"))
            .filter(|r| self.sync_applied.names.contains(&col(r, 0)))
            .count();
        // Commits wait while fewer standbys than required acknowledge them.
        let blocked = !self.sync_applied.is_async() && acknowledging < self.sync_applied.num;
        if blocked {
            if self.sync_blocked_since.is_none() {
                tracing::warn!(
                    "commits are waiting: too few synchronous standbys acknowledge them"
                );
                self.sync_blocked_since = Some((Instant::now(), unix_ms()));
            }
        } else if self.sync_blocked_since.take().is_some() {
            tracing::info!("synchronous standbys acknowledge commits again");
        }
        let published =
            crate::record::sync_state(&self.snapshot).filter(|s| s.leader == self.cfg.name);
        let obs = SyncObservation {
            applied: self.sync_applied.clone(),
            applied_at: self.sync_applied_at,
            candidates: streaming.iter().map(|(n, _)| n.clone()).collect(),
            flushed: streaming,
            blocked_for: self.sync_blocked_since.map(|(at, _)| at.elapsed()),
        };
        if self.sync_applied_at.is_none() {
            // The change made on an earlier iteration is in effect by now:
            // every commit acknowledged under the old rule lies before this.
            self.sync_applied_at = current_lsn;
        }
        let step = plan_sync(&settings, published.as_ref(), &obs);
        let blocked_ms = self.sync_blocked_since.map(|(_, ms)| ms);
        self.sync_pending = step != SyncStep::Nothing;
        match step {
            SyncStep::Nothing => {
                // Keep the published blocked-since current.
                if let Some(p) = published.filter(|p| p.blocked_since_ms != blocked_ms) {
                    let next = SyncState {
                        blocked_since_ms: blocked_ms,
                        ..p
                    };
                    self.put_sync(&next).await;
                }
            }
            SyncStep::Publish {
                members,
                quorum,
                degraded,
            } => {
                if degraded {
                    tracing::warn!("no synchronous standby left: recording asynchronous operation, then no longer waiting");
                } else if !members.is_empty() {
                    tracing::info!(standbys = ?members, quorum, "synchronous standbys listed");
                }
                let state = SyncState {
                    leader: self.cfg.name.clone(),
                    synchronous: settings.protection.synchronous(),
                    members,
                    quorum: Some(quorum),
                    degraded_since_ms: degraded.then(|| {
                        published
                            .as_ref()
                            .and_then(|p| p.degraded_since_ms)
                            .unwrap_or_else(unix_ms)
                    }),
                    blocked_since_ms: blocked_ms,
                };
                self.put_sync(&state).await;
            }
            SyncStep::Apply(config) => self.apply_sync(&config).await,
        }
    }

    async fn put_sync(&mut self, state: &SyncState) -> bool {
        let Ok(value) = serde_json::to_value(state) else {
            return false;
        };
        match self.dcs.put_sync(&self.cfg.name, &value).await {
            Ok(true) => {
                self.snapshot.sync = Some(value);
                true
            }
            Ok(false) => false,
            Err(e) => {
                tracing::warn!(error = %e, "cannot write the sync key");
                false
            }
        }
    }

    /// Makes PostgreSQL wait as `config` says and waits (briefly) until it
    /// does.
    async fn apply_sync(&mut self, config: &SyncConfig) {
        let names = config.standby_names(self.sync.method);
        let value = names.clone();
        let res = self
            .pg
            .with(move |i| {
                i.set_setting("synchronous_standby_names", &value)?;
                i.reload()
            })
            .await;
        if let Err(e) = res {
            tracing::error!(error = %e, "cannot set synchronous_standby_names");
            return;
        }
        tracing::info!(synchronous_standby_names = %names, "synchronous standbys set");
        self.sync_applied = config.clone();
        self.sync_applied_at = None;
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            let now = self
                .pg
                .query("SHOW synchronous_standby_names", Duration::from_secs(1))
                .await
                .ok()
                .and_then(|r| r.into_iter().next())
                .and_then(|r| r.into_iter().next().flatten());
            if now.as_deref() == Some(names.as_str()) || !self.obs.pg.running {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Readies the source of a rewind at `addr`: `CHECKPOINT` when its
    /// control file still names an earlier timeline than the one it
    /// writes. Returns the timeline it is on, or `None` when `must_lead`
    /// and it is still in recovery (a leader finishing its promotion).
    async fn prepare_source(
        &self,
        addr: &HostAddr,
        must_lead: bool,
    ) -> Result<Option<u32>, tokio_postgres::Error> {
        let (c, conn) =
            tokio_postgres::connect(&self.pg.source_conninfo(addr), tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        let row = c
            .query_one(
                // CASE: pg_walfile_name fails during recovery.
                "SELECT pg_is_in_recovery(), (SELECT timeline_id FROM pg_control_checkpoint()), \
                 CASE WHEN pg_is_in_recovery() THEN 0 \
                 ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END",
                &[],
            )
            .await?;
        let (in_recovery, control_tli, writing_tli): (bool, i32, i32) =
            (row.get(0), row.get(1), row.get(2));
        if in_recovery {
            return Ok((!must_lead).then_some(control_tli as u32));
        }
        if control_tli != writing_tli {
            tracing::info!(source = %addr, "CHECKPOINT on the source: its control file predates its promotion");
            c.batch_execute("CHECKPOINT").await?;
        }
        Ok(Some(writing_tli as u32))
    }

    /// Logs once why a former primary waits before rejoining.
    fn note_rejoin_wait(&mut self, why: String) {
        if self.rejoin_wait.as_deref() != Some(why.as_str()) {
            tracing::info!("waiting to rejoin: {why}");
            self.rejoin_wait = Some(why);
        }
    }

    /// How long the members have to acknowledge this leader.
    fn failsafe_budget(&self) -> Duration {
        Duration::from_secs(2).min(self.timing.retry_timeout)
    }

    /// With etcd out of reach, asks every other member of the last known
    /// membership to acknowledge this leader. All of them answering counts
    /// as a lease renewal, so the leader keeps taking writes; one missing
    /// answer and the renewal is not counted, so it demotes on schedule.
    async fn failsafe_round(&mut self) {
        let t0 = Instant::now();
        let budget = self.failsafe_budget();
        let peers: Vec<(String, String)> = records(&self.snapshot)
            .into_iter()
            .filter(|r| r.state.name != self.cfg.name)
            .map(|r| (r.state.name, r.state.api_url))
            .collect();
        let credentials = self.credentials.get();
        let auth = credentials.as_ref().map(|(u, p)| (u.as_str(), p.as_str()));
        let calls = peers.iter().map(|(_, url)| async move {
            crate::http_client::request("POST", &format!("{url}/failsafe"), None, auth, budget)
                .await
                .map(|r| r.status)
        });
        let answers = crate::join_all(calls).await;
        let missing: Vec<&str> = peers
            .iter()
            .zip(&answers)
            .filter(|(_, a)| !matches!(a, Ok(200)))
            .map(|((n, _), _)| n.as_str())
            .collect();
        if missing.is_empty() {
            let before = self
                .failsafe_seen
                .swap(unix_ms(), std::sync::atomic::Ordering::SeqCst);
            if unix_ms().saturating_sub(before) > self.timing.ttl.as_millis() as u64 {
                tracing::warn!(
                    "etcd unreachable: every member acknowledges this leader (failsafe)"
                );
            }
            self.last_renewal = Some(t0);
        } else {
            tracing::warn!(
                ?missing,
                "failsafe: not every member acknowledges this leader"
            );
        }
    }

    /// Starts the fence if it is not running.
    fn arm_fence(&mut self) {
        if self.fence.is_some() {
            return;
        }
        let started = std::env::current_exe()
            .and_then(|exe| crate::fence::Fence::start(&exe, &self.cfg.data_dir));
        match started {
            Ok(f) => self.fence = Some(f),
            Err(e) => tracing::error!(error = %e, "cannot start the fence"),
        }
    }

    async fn shutdown(&mut self) {
        if let Some(f) = self.fence.take() {
            f.disarm();
        }
        tracing::info!(member = %self.cfg.name, "shutting down: stopping PostgreSQL");
        if let Err(e) = self.pg.stop(StopMode::Fast).await {
            tracing::error!(error = %first_line(&e), "stopping PostgreSQL failed");
        }
        self.run_callback(self.cfg.callbacks.on_stop.clone(), "on_stop", "shutdown");
        if self.holds_leader_key() {
            match self.dcs.release_leader(&self.cfg.name).await {
                Ok(_) => tracing::info!("released the leader key"),
                Err(e) => tracing::warn!(error = %e, "releasing the leader key failed"),
            }
        }
        self.watchdog.disarm();
        if let Some(lease) = self.lease.take() {
            // Revoking deletes the member record bound to it.
            let _ = self.dcs.revoke_lease(lease).await;
        }
        self.stopped.notify_one();
    }

    /// The settings in force, as `/patroni` shows them.
    fn cluster_settings(&self) -> ClusterSettings {
        ClusterSettings {
            timing: self.timing,
            maximum_lag_on_failover: self.settings.maximum_lag_on_failover,
            sync: self.sync,
            failsafe: self.failsafe,
        }
    }

    /// Puts the dynamic configuration's cluster settings (on top of the
    /// node's own) into force. The protection mode changes through the
    /// same steps as any change of the synchronous standbys
    /// ([`Self::manage_sync`]). A new TTL needs a new lease, and a leader
    /// moves its key to it before it takes the new timers: until then the
    /// timers that match the lease its key is bound to stay in force.
    async fn apply_cluster_settings(&mut self) {
        self.settle_moving_lease().await;
        let wanted = ClusterSettings::of(&self.cfg).with_dynamic(self.snapshot.config.as_ref());
        let wanted = match wanted {
            Ok(w) => {
                self.settings_refused = None;
                w
            }
            Err(e) => {
                if self.settings_refused.as_deref() != Some(e.as_str()) {
                    tracing::error!(
                        "dynamic configuration not applied, the settings in force stay: {e}"
                    );
                    self.settings_refused = Some(e);
                }
                return;
            }
        };
        self.settings.maximum_lag_on_failover = wanted.maximum_lag_on_failover;
        if wanted.sync != self.sync {
            tracing::info!(
                "protection now {}, {} standby(s) by {}, degrading after {} s",
                wanted.sync.protection,
                wanted.sync.count,
                match wanted.sync.method {
                    pgwarden_ha::SyncMethod::First => "first",
                    pgwarden_ha::SyncMethod::Quorum => "quorum",
                },
                wanted.sync.degrade_after.as_secs_f64()
            );
            self.sync = wanted.sync;
        }
        if wanted.failsafe != self.failsafe {
            tracing::info!(
                "failsafe now {}",
                if wanted.failsafe { "on" } else { "off" }
            );
            self.failsafe = wanted.failsafe;
        }
        let timing = wanted.timing;
        if timing == self.timing {
            return;
        }
        if timing.ttl != self.lease_ttl && !self.move_lease(timing).await {
            return;
        }
        self.adopt_timing(timing);
        if self.lease.is_none() {
            if let Err(e) = self.ensure_lease().await {
                tracing::warn!(error = %e, "cannot grant a lease");
            }
        }
    }

    fn adopt_timing(&mut self, timing: Timing) {
        let s = |d: Duration| d.as_secs_f64();
        tracing::info!(
            "timing now ttl {} s, loop_wait {} s, retry_timeout {} s, primary_start_timeout {} s, safety_margin {} s",
            s(timing.ttl),
            s(timing.loop_wait),
            s(timing.retry_timeout),
            s(timing.primary_start_timeout),
            s(timing.safety_margin)
        );
        self.timing = timing;
        self.settings.ttl = timing.ttl;
        self.watchdog
            .set_timeout(timing.ttl.saturating_sub(timing.safety_margin));
    }

    /// Gives this member a lease of `timing.ttl`; whether `timing` may be
    /// adopted now. A member that does not lead simply takes a new lease:
    /// its key follows when next published, and the old lease, no longer
    /// renewed, runs out. The leader moves its key to the new lease in one
    /// transaction, so the key is never absent; its last renewal is then
    /// the new lease's start.
    async fn move_lease(&mut self, timing: Timing) -> bool {
        let Some(old) = self.lease else {
            return true;
        };
        if !self.holds_leader_key() {
            self.dcs.forget_lease(old).await;
            self.lease = None;
            return true;
        }
        if self.lease_moving.is_some() {
            // Not settled yet (etcd did not answer): nothing new until it is.
            return false;
        }
        // Bounded like any request of a leader: a slow etcd must not hold
        // it past the moment it has to demote.
        let t0 = Instant::now();
        let new =
            match tokio::time::timeout(self.dcs_budget(), self.dcs.grant_lease(timing.ttl)).await {
                Ok(Ok(l)) => l,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot grant a lease for the new ttl");
                    return false;
                }
                Err(_) => return false,
            };
        let budget = self.dcs_budget();
        let moved = tokio::time::timeout(budget, self.dcs.rebind_leader(&self.cfg.name, old, new))
            .await
            .unwrap_or(Err(pgwarden_dcs::DcsError::Timeout {
                op: "rebind leader",
                after: budget,
            }));
        match moved {
            Ok(true) => {
                tracing::info!(lease = %new, "the leader key moved to a lease of the new ttl");
                self.dcs.forget_lease(old).await;
                self.lease = Some(new);
                self.lease_ttl = timing.ttl;
                self.last_renewal = Some(t0);
                true
            }
            Ok(false) => {
                let _ = self.dcs.revoke_lease(new).await;
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "moving the leader key to a new lease failed");
                self.lease_moving = Some((new, timing));
                false
            }
        }
    }

    /// Keeps the members' replication slots ([`crate::slots`]): one for
    /// every member that streams from here (as the leader, also for those
    /// that have not said whom they stream from), and as the leader the
    /// permanent ones of the dynamic configuration; ours that nobody needs
    /// go after the grace.
    async fn manage_slots(&mut self, leading: bool) {
        match crate::slots::permanent(self.snapshot.config.as_ref()) {
            Ok(p) => {
                self.permanent_slots = p;
                self.slots_refused = None;
            }
            Err(e) => {
                if self.slots_refused.as_deref() != Some(e.as_str()) {
                    tracing::error!("permanent slots not applied, the previous ones stay: {e}");
                    self.slots_refused = Some(e);
                }
            }
        }
        let rows = match self
            .pg
            .query(
                "SELECT slot_name, active FROM pg_replication_slots WHERE slot_type = 'physical'",
                Duration::from_secs(2),
            )
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read pg_replication_slots");
                return;
            }
        };
        let existing: Vec<(String, bool)> = rows
            .into_iter()
            .filter_map(|r| {
                let name = r.first().cloned().flatten()?;
                let active = r.get(1).cloned().flatten().as_deref() == Some("t");
                Some((name, active))
            })
            .collect();
        // The slots of the members that say they stream from here (the
        // leader's also of those that have not said yet).
        let me = self.cfg.name.as_str();
        let mut wanted: std::collections::BTreeSet<String> = records(&self.snapshot)
            .into_iter()
            .filter(|r| r.state.name != me)
            .filter(|r| match r.upstream.as_deref() {
                Some(u) => u == me,
                None => leading,
            })
            .filter_map(|r| r.slot)
            .filter(|s| crate::slots::is_member_slot(s))
            .collect();
        if leading {
            wanted.extend(self.permanent_slots.iter().cloned());
        }
        let plan = crate::slots::plan(
            &existing,
            &wanted,
            &mut self.slots_unwanted,
            Instant::now(),
            self.timing.ttl * 2,
        );
        // Slot names are made of [a-z0-9_] (ours, and those read back are
        // quoted as literals), so they go into the statements as they are.
        for name in plan.create {
            let sql = format!("SELECT pg_create_physical_replication_slot('{name}', true)");
            match self.pg.query(&sql, Duration::from_secs(2)).await {
                Ok(_) => tracing::info!(slot = %name, "replication slot created"),
                Err(e) => self.slot_failed(&name, "cannot create a replication slot", e),
            }
        }
        for name in plan.drop {
            let literal = name.replace('\'', "''");
            let sql = format!("SELECT pg_drop_replication_slot('{literal}')");
            match self.pg.query(&sql, Duration::from_secs(2)).await {
                Ok(_) => {
                    self.slots_unwanted.remove(&name);
                    tracing::info!(slot = %name, "replication slot of no member dropped");
                }
                Err(e) => self.slot_failed(&name, "cannot drop a replication slot", e),
            }
        }
    }

    /// Keeps the permanent logical slots: the leader creates them and
    /// records how far their consumers have confirmed; a replica copies the
    /// ones it lacks from the leader and advances its copies to the
    /// published positions (see [`crate::slots`]).
    async fn manage_logical_slots(&mut self) {
        let Ok(wanted) = crate::slots::permanent_logical(self.snapshot.config.as_ref()) else {
            // manage_slots has said why.
            return;
        };
        if wanted.is_empty() {
            self.logical_positions.clear();
            self.logical_ready.clear();
            return;
        }
        let rows = match self
            .pg
            .query(
                "SELECT slot_name, database, plugin, confirmed_flush_lsn - '0/0', catalog_xmin \
                 FROM pg_replication_slots WHERE slot_type = 'logical'",
                Duration::from_secs(2),
            )
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the logical slots");
                return;
            }
        };
        // Ours: named in the configuration, with its database and plugin.
        let mut local = std::collections::BTreeMap::new();
        let mut catalog_xmin = std::collections::BTreeMap::new();
        let mut foreign = Vec::new();
        for r in rows {
            let col = |i: usize| r.get(i).cloned().flatten();
            let Some(name) = col(0) else { continue };
            let Some(want) = wanted.get(&name) else {
                continue;
            };
            if col(1).as_deref() == Some(want.database.as_str())
                && col(2).as_deref() == Some(want.plugin.as_str())
            {
                catalog_xmin.insert(name.clone(), col(4).and_then(|v| v.parse::<u32>().ok()));
                local.insert(name, col(3).and_then(|v| v.parse::<u64>().ok()));
            } else {
                foreign.push(name);
            }
        }
        for name in &foreign {
            self.slot_failed(
                name,
                "a logical slot of this name has another database or plugin than the configuration's; left alone",
                String::new(),
            );
        }
        let leading = self.holds_leader_key() && self.obs.pg.running && !self.obs.pg.in_recovery;
        if leading {
            for (name, slot) in &wanted {
                if local.contains_key(name) || foreign.contains(name) {
                    continue;
                }
                let sql = format!(
                    "SELECT pg_create_logical_replication_slot('{name}', '{}')",
                    slot.plugin
                );
                match self
                    .pg
                    .query_in(None, &slot.database, &sql, Duration::from_secs(10))
                    .await
                {
                    Ok(_) => {
                        tracing::info!(slot = %name, database = %slot.database, plugin = %slot.plugin, "logical replication slot created")
                    }
                    Err(e) => self.slot_failed(name, "cannot create a logical replication slot", e),
                }
            }
            self.logical_positions = local
                .into_iter()
                .filter_map(|(n, at)| Some((n, at?)))
                .collect();
            self.logical_ready.clear();
            return;
        }
        self.logical_positions.clear();
        if !(self.obs.pg.running && self.obs.pg.in_recovery) {
            return;
        }
        for name in &foreign {
            local.remove(name);
        }
        let published = record::logical_positions(&self.snapshot);
        let mut wanted = wanted;
        wanted.retain(|n, _| !foreign.contains(n));
        let plan =
            crate::slots::logical_plan(&wanted, &local, &published, self.obs.pg.replayed_lsn);
        for (name, database, at) in plan.advance {
            let lsn = format!("{:X}/{:X}", at >> 32, at & 0xffff_ffff);
            let sql = format!("SELECT pg_replication_slot_advance('{name}', '{lsn}')");
            if let Err(e) = self
                .pg
                .query_in(None, &database, &sql, Duration::from_secs(10))
                .await
            {
                self.slot_failed(&name, "cannot advance a copied logical slot", e);
            }
        }
        let (recent, copy): (Vec<String>, Vec<String>) = plan.copy.into_iter().partition(|n| {
            self.logical_copied
                .get(n)
                .is_some_and(|at| at.elapsed() < LOGICAL_RECOPY_AFTER)
        });
        for n in &recent {
            self.slot_failed(
                n,
                "a logical slot copied from the leader was not loaded by PostgreSQL; see its log",
                String::new(),
            );
        }
        self.logical_ready.retain(|n, _| local.contains_key(n));
        if self.logical_ready.len() < local.len() || self.logical_ready.values().any(|r| !r.1) {
            self.check_logical_copies(&catalog_xmin).await;
        }
        if !copy.is_empty() && self.obs.streaming {
            for n in &copy {
                self.logical_ready.remove(n);
            }
            self.copy_logical_slots(&copy, &wanted).await;
        }
    }

    /// Asks the leader whether this replica's copies of logical slots are
    /// safe to decode from after a failover (see
    /// [`crate::slots::copy_ready`]); `copies` maps each copy to its own
    /// `catalog_xmin`.
    async fn check_logical_copies(
        &mut self,
        copies: &std::collections::BTreeMap<String, Option<u32>>,
    ) {
        let (Some(leader), true) = (self.leader_address(), self.cfg.use_slots) else {
            // Without a slot of its own on the leader, no feedback shows.
            for n in copies.keys() {
                self.logical_ready.entry(n.clone()).or_insert((None, false));
            }
            return;
        };
        let mine = crate::slots::slot_name(&self.cfg.name);
        let list = copies
            .keys()
            .chain(std::iter::once(&mine))
            .map(|n| format!("'{n}'"))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "SELECT slot_name, catalog_xmin FROM pg_replication_slots \
             WHERE NOT pg_is_in_recovery() AND slot_name IN ({list})"
        );
        let Ok(rows) = self
            .pg
            .query_in(Some(&leader), "postgres", &sql, Duration::from_secs(2))
            .await
        else {
            return;
        };
        let on_leader: std::collections::BTreeMap<String, Option<u32>> = rows
            .into_iter()
            .filter_map(|r| {
                let name = r.first().cloned().flatten()?;
                let xmin = r.get(1).cloned().flatten().and_then(|v| v.parse().ok());
                Some((name, xmin))
            })
            .collect();
        let physical = on_leader.get(&mine).copied().flatten();
        for (name, &copy) in copies {
            let entry = self
                .logical_ready
                .entry(name.clone())
                .or_insert((None, false));
            if entry.1 {
                continue;
            }
            if entry.0.is_none() && physical.is_some() {
                entry.0 = on_leader.get(name).copied().flatten();
            }
            if let Some(then) = entry.0 {
                entry.1 = crate::slots::copy_ready(then, physical, copy);
                if entry.1 {
                    tracing::info!(slot = %name, "the copied logical slot is safe to use after a failover");
                }
            }
        }
    }

    /// Copies the state files of the logical slots `names` from the leader
    /// into this replica's data directory and restarts PostgreSQL, which
    /// loads slots only at start-up.
    async fn copy_logical_slots(
        &mut self,
        names: &[String],
        wanted: &std::collections::BTreeMap<String, crate::slots::LogicalSlot>,
    ) {
        let Some(leader) = self.leader_address() else {
            return;
        };
        // Names come from the checked configuration: [a-z0-9_] only.
        let list = names
            .iter()
            .map(|n| format!("'{n}'"))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "SELECT slot_name, database, plugin, \
             encode(pg_read_binary_file('pg_replslot/' || slot_name || '/state'), 'hex') \
             FROM pg_replication_slots \
             WHERE slot_type = 'logical' AND NOT pg_is_in_recovery() AND slot_name IN ({list})"
        );
        let rows = match self
            .pg
            .query_in(Some(&leader), "postgres", &sql, Duration::from_secs(5))
            .await
        {
            Ok(r) => r,
            Err(e) => {
                self.slot_failed(&list, "cannot read logical slots from the leader", e);
                return;
            }
        };
        let states: Vec<(String, Vec<u8>)> = rows
            .into_iter()
            .filter_map(|r| {
                let col = |i: usize| r.get(i).cloned().flatten();
                let name = col(0)?;
                let want = wanted.get(&name)?;
                if col(1)? != want.database || col(2)? != want.plugin {
                    return None;
                }
                Some((name, hex_bytes(&col(3)?)?))
            })
            .collect();
        if states.is_empty() {
            return;
        }
        let copied: Vec<&str> = states.iter().map(|(n, _)| n.as_str()).collect();
        for n in &copied {
            self.logical_copied.insert(n.to_string(), Instant::now());
        }
        tracing::info!(
            slots = ?copied,
            "copying logical slots from the leader; PostgreSQL restarts to load them"
        );
        if let Err(e) = self.pg.stop(StopMode::Fast).await {
            tracing::error!(error = %e, "cannot stop PostgreSQL to copy logical slots");
            return;
        }
        let res = self
            .pg
            .with(move |i| {
                for (name, state) in &states {
                    i.install_slot_state(name, state)?;
                }
                Ok(())
            })
            .await;
        if let Err(e) = res {
            tracing::error!(error = %e, "cannot write the copied logical slots");
        }
        if let Err(e) = self.pg.start(self.timing.loop_wait).await {
            tracing::warn!(error = %first_line(&e), "PostgreSQL is not up yet");
        }
    }

    /// Logs a failed slot change, once while it keeps failing the same way
    /// (a full `max_replication_slots` would otherwise warn every loop).
    fn slot_failed(&mut self, slot: &str, what: &str, error: String) {
        let key = format!("{what} {slot}: {error}");
        if self.slot_error.as_deref() != Some(key.as_str()) {
            tracing::warn!(slot, error = %error, "{what}");
            self.slot_error = Some(key);
        }
    }

    /// Finds out where a move of the leader key whose answer was lost
    /// ended: on the new lease (which, with its timing, is then this
    /// agent's) or not (the new lease is dropped). Before anything reads
    /// whether this agent holds the key.
    async fn settle_moving_lease(&mut self) {
        let Some((moved, timing)) = self.lease_moving.take() else {
            return;
        };
        let t0 = Instant::now();
        let settled = tokio::time::timeout(
            self.dcs_budget(),
            self.dcs.renew_leader(&self.cfg.name, moved),
        )
        .await;
        match settled {
            Ok(Ok(true)) => {
                if let Some(old) = self.lease {
                    self.dcs.forget_lease(old).await;
                }
                self.lease = Some(moved);
                self.lease_ttl = timing.ttl;
                self.last_renewal = Some(t0);
                self.adopt_timing(timing);
            }
            Ok(Ok(false)) => {
                let _ = self.dcs.revoke_lease(moved).await;
            }
            _ => self.lease_moving = Some((moved, timing)),
        }
    }

    /// Writes the dynamic configuration's PostgreSQL parameters into the
    /// settings file where they changed, and reloads a running server;
    /// those that need a restart then show as `pending_restart`.
    async fn apply_dynamic_parameters(&mut self) {
        let wanted = match crate::parameters::dynamic(self.snapshot.config.as_ref()) {
            Ok(w) => w,
            Err(e) => {
                if self.dynamic_refused.as_deref() != Some(e.as_str()) {
                    tracing::error!("dynamic configuration not applied: {e}");
                    self.dynamic_refused = Some(e);
                }
                return;
            }
        };
        self.dynamic_refused = None;
        let mut wanted = wanted;
        // A replica's copy of a logical slot is of use after a failover only
        // if the leader keeps the catalog rows it needs.
        if crate::slots::permanent_logical(self.snapshot.config.as_ref())
            .is_ok_and(|l| !l.is_empty())
        {
            wanted
                .entry("hot_standby_feedback".to_string())
                .or_insert_with(|| "on".to_string());
        }
        let before = effective_parameters(&self.dynamic_applied, &self.cfg.parameters);
        let after = effective_parameters(&wanted, &self.cfg.parameters);
        if self.write_parameters(&before, &after).await {
            self.dynamic_applied = wanted;
        }
    }

    /// Writes what changed between two sets of settings and reloads a
    /// running server; `false` if the file could not be written.
    async fn write_parameters(
        &mut self,
        before: &std::collections::BTreeMap<String, String>,
        after: &std::collections::BTreeMap<String, String>,
    ) -> bool {
        let changes = crate::parameters::changes(before, after);
        if !changes.is_empty() {
            let text = changes
                .iter()
                .map(|(k, v)| format!("{k} = {}", v.as_deref().unwrap_or("(default)")))
                .collect::<Vec<_>>()
                .join(", ");
            let running = self.obs.pg.running;
            let written = self
                .pg
                .with(move |i| {
                    for (k, v) in &changes {
                        match v {
                            Some(v) => i.set_setting(k, v)?,
                            None => i.remove_setting(k)?,
                        }
                    }
                    if running {
                        i.reload()?;
                    }
                    Ok(())
                })
                .await;
            if let Err(e) = written {
                tracing::error!(error = %first_line(&e), "cannot write the PostgreSQL parameters");
                return false;
            }
            if running {
                self.reloaded();
            }
            tracing::info!("parameters applied: {text}");
            self.check_config_files().await;
        }
        true
    }

    /// Has PostgreSQL read its configuration files as a start would, and
    /// keeps what it refuses as this member's problem until it is fixed: a
    /// reload only logs a bad value and keeps the old one.
    async fn check_config_files(&mut self) {
        let problem = match self.pg.with(|i| i.check_config()).await {
            Ok(()) => None,
            Err(e) => {
                let text = match &e {
                    PgCtlError::CommandFailed { output, .. } => output
                        .lines()
                        .map(str::trim)
                        .filter(|l| !l.is_empty())
                        .collect::<Vec<_>>()
                        .join(" "),
                    other => first_line(other),
                };
                Some(format!(
                    "PostgreSQL refuses its configuration ({text}); it keeps its previous settings and would not start again"
                ))
            }
        };
        if problem != self.config_problem {
            match &problem {
                Some(p) => tracing::error!("{p}"),
                None => tracing::info!("PostgreSQL accepts its configuration again"),
            }
            self.config_problem = problem;
        }
    }

    /// Takes the reloadable settings of a reloaded node file: tags (in the
    /// member record from now on), the node's own PostgreSQL parameters
    /// (written and reloaded) and callbacks.
    async fn reconfigure(&mut self, new: AgentConfig) {
        let node_settings = ClusterSettings::of(&new);
        if new.tags != self.cfg.tags {
            tracing::info!(tags = ?new.tags, "tags reloaded");
            self.cfg.tags = new.tags;
        }
        if new.callbacks != self.cfg.callbacks {
            tracing::info!("callbacks reloaded");
            self.cfg.callbacks = new.callbacks;
        }
        if new.parameters != self.cfg.parameters {
            let before = effective_parameters(&self.dynamic_applied, &self.cfg.parameters);
            let after = effective_parameters(&self.dynamic_applied, &new.parameters);
            if self.write_parameters(&before, &after).await {
                self.cfg.parameters = new.parameters;
            }
        }
        // The node's own cluster settings: the next loop puts them into
        // force where the dynamic configuration does not replace them,
        // moving the leader key to a lease of a new ttl as for a dynamic
        // change.
        if new.create_replica != self.cfg.create_replica {
            let names: Vec<&str> = new.create_replica.iter().map(|m| m.name()).collect();
            tracing::info!(methods = ?names, "create_replica_methods reloaded");
            self.cfg.create_replica = new.create_replica.clone();
        }
        if new.replica_methods != self.cfg.replica_methods {
            tracing::info!("replica_methods reloaded");
            self.cfg.replica_methods = new.replica_methods.clone();
        }
        if new.reclone_on_rewind_failure != self.cfg.reclone_on_rewind_failure {
            tracing::info!(
                reclone = new.reclone_on_rewind_failure,
                "reclone_on_rewind_failure reloaded"
            );
            self.cfg.reclone_on_rewind_failure = new.reclone_on_rewind_failure;
        }
        if new.use_slots != self.cfg.use_slots {
            // A replica streams through its slot from now on, or without
            // one; the leader follows the published record.
            let slot = new
                .use_slots
                .then(|| crate::slots::slot_name(&self.cfg.name));
            let running = self.obs.pg.running;
            let res = self
                .pg
                .with(move |i| {
                    i.set_primary_slot(slot)?;
                    if running {
                        i.reload()?;
                    }
                    Ok(())
                })
                .await;
            match res {
                Ok(()) => {
                    tracing::info!(use_slots = new.use_slots, "use_slots reloaded");
                    self.cfg.use_slots = new.use_slots;
                }
                Err(e) => tracing::error!(error = %e, "cannot change primary_slot_name"),
            }
        }
        // Only a cluster being created reads it.
        self.cfg.standby_cluster = new.standby_cluster;
        if new.watchdog != self.cfg.watchdog {
            match self.watchdog.reconfigure(&new.watchdog) {
                Ok(()) => {
                    tracing::info!(mode = ?new.watchdog.mode, device = %new.watchdog.device.display(), "watchdog reloaded");
                    self.watchdog_problem = None;
                    self.cfg.watchdog = new.watchdog;
                }
                Err(e) if self.watchdog.armed() => {
                    tracing::error!(
                        "the reloaded watchdog cannot be armed, the old one stays: {e}"
                    );
                }
                Err(e) => {
                    self.cfg.watchdog = new.watchdog;
                    if self.watchdog.required() {
                        tracing::error!(
                            "watchdog required but unusable, this member will not lead: {e}"
                        );
                        self.watchdog_problem =
                            Some(format!("watchdog required but unusable: {e}"));
                    } else {
                        tracing::warn!("no watchdog ({e}); leading without one");
                        self.watchdog_problem = None;
                    }
                }
            }
        }
        if new.replication_user != self.cfg.replication_user {
            self.pg.set_replication_user(new.replication_user.clone());
            // A streaming standby reconnects as the new user at once.
            let user = new.replication_user.clone();
            let running = self.obs.pg.running;
            let res = self
                .pg
                .with(move |i| {
                    let Some((h, p)) = i.upstream().map(|(h, p)| (h.to_string(), p)) else {
                        return Ok(());
                    };
                    i.set_standby(Some((&h, p)), &user)?;
                    if running {
                        i.reload()?;
                    }
                    Ok(())
                })
                .await;
            match res {
                Ok(()) => tracing::info!(user = %new.replication_user, "replication user reloaded"),
                Err(e) => {
                    tracing::error!(error = %e, "cannot rewrite primary_conninfo for the new replication user")
                }
            }
            self.cfg.replication_user = new.replication_user;
        }
        if node_settings != ClusterSettings::of(&self.cfg) {
            tracing::info!("timings, protection and failsafe of the node file reloaded");
            self.cfg.rto = new.rto;
            self.cfg.timing = new.timing;
            self.cfg.maximum_lag_on_failover = new.maximum_lag_on_failover;
            self.cfg.sync = new.sync;
            self.cfg.failsafe = new.failsafe;
            if self.dcs_ok {
                self.apply_cluster_settings().await;
            }
        }
        self.publish_status();
        self.publish_member().await;
    }

    /// Wipes a replica's data directory and clones the leader again, for a
    /// replica that cannot recover on its own (corruption, a lost slot).
    /// Never on a primary or the leader.
    async fn reinitialize(&mut self) {
        if self.holds_leader_key() || (self.obs.pg.running && !self.obs.pg.in_recovery) {
            tracing::warn!("reinitialize refused: this member is the leader or a primary");
            return;
        }
        let Some(source) = self.leader_address().filter(|_| {
            self.snapshot
                .leader
                .as_ref()
                .is_some_and(|l| l.name != self.cfg.name)
        }) else {
            tracing::warn!("reinitialize refused: no leader to clone");
            return;
        };
        tracing::info!(from = %source, "reinitializing: wiping the data directory and cloning the leader");
        self.busy("reinitializing").await;
        // A fast stop that runs out of time (a long shutdown checkpoint)
        // leaves the server running; the steps that follow rewrite its
        // data directory, and refuse to under a live server.
        if self.pg.stop(StopMode::Fast).await.is_err() {
            let _ = self.pg.stop(StopMode::Immediate).await;
        }
        self.run_callback(
            self.cfg.callbacks.on_stop.clone(),
            "on_stop",
            "reinitialize",
        );
        let cloned = self.clone_from(&source).await;
        self.idle();
        match cloned {
            Ok(()) => {
                self.former_primary = false;
                self.problem = None;
                match self
                    .pg
                    .start(self.timing.loop_wait)
                    .await
                    .or_else(still_starting)
                {
                    Ok(()) => self.run_callback(
                        self.cfg.callbacks.on_start.clone(),
                        "on_start",
                        "replica",
                    ),
                    Err(e) => {
                        tracing::error!(error = %first_line(&e), "start after reinitialize failed")
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %first_line(&e), "reinitialize failed");
                self.problem = Some(format!("reinitialize failed: {}", first_line(&e)));
            }
        }
        self.publish_status();
    }

    /// An order to restart only with settings pending can come right after
    /// the settings changed (`ctl edit-config`, then `ctl restart --all
    /// --pending`), before this member's loop applied them; skipped, a
    /// replica would then stay on a lower `max_connections` than its
    /// restarted primary, and PostgreSQL pauses its replay. So the order
    /// applies the dynamic settings first and lets the server read them.
    async fn catch_up_settings(&mut self) {
        let op = self.etcd.op_timeout;
        let Ok(Ok(snap)) = tokio::time::timeout(op, self.dcs.read_cluster()).await else {
            return;
        };
        self.snapshot.config = snap.config;
        self.snapshot.config_revision = snap.config_revision;
        self.apply_dynamic_parameters().await;
        // A reload reaches the server's backends a moment later; one older
        // than this has been observed since.
        let recent = Duration::from_secs(3) + self.timing.loop_wait;
        if self.reloaded_at.is_none_or(|t| t.elapsed() > recent) {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            self.obs = self.pg.observe(Duration::from_secs(1)).await;
            if self.obs.pending_restart {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// How long until the scheduled restart is due; zero once it is.
    fn until_restart(&self) -> Option<Duration> {
        let at = self.scheduled_restart.as_ref()?.at_ms?;
        Some(Duration::from_millis(at.saturating_sub(unix_ms())))
    }

    /// Why an ordered restart must not happen whatever its conditions: it
    /// starts the server in the role its data directory has, so a stopped
    /// server (a demoted leader, a member the loop has not started) would
    /// come back as it last ran, perhaps a primary beside the leader.
    fn restart_refusal(&self) -> Option<String> {
        if let Some(p) = &self.config_problem {
            return Some(format!("{p}; fix the setting first"));
        }
        if !self.obs.pg.running {
            return Some(
                "PostgreSQL is not running here; the HA loop starts it in the role the cluster gives it"
                    .into(),
            );
        }
        let paused = record::paused(&self.snapshot);
        if !self.obs.pg.in_recovery && !self.holds_leader_key() && !paused {
            return Some("this primary does not hold the leader key; it is being demoted".into());
        }
        None
    }

    /// Restarts PostgreSQL if `order`'s conditions hold now.
    async fn restart_if(&mut self, order: crate::record::RestartOrder, reply: Reply) {
        if order.restart_pending && !self.obs.pending_restart {
            self.catch_up_settings().await;
        }
        let role = self.record().state.role;
        let standby_leader = self.holds_leader_key()
            && self.obs.pg.in_recovery
            && record::standby_cluster(&self.snapshot).is_some();
        let refused = self
            .restart_refusal()
            .or_else(|| order.unmet(role, standby_leader, self.obs.pending_restart));
        if let Some(why) = refused {
            tracing::info!("restart not carried out: {why}");
            reply.send(Err(why));
            return;
        }
        if !reply.send(Ok(())) {
            tracing::info!("restart not carried out: the request gave up waiting");
            return;
        }
        self.restart().await;
    }

    /// Restarts PostgreSQL in its current role. The start waits at most one
    /// `loop_wait`: a server still starting is then seen by the next
    /// iteration, and a leader keeps renewing its lease meanwhile.
    async fn restart(&mut self) {
        tracing::info!("restart requested through the API");
        // Health checks and routing read the published status: they must
        // not report a primary while its server is down.
        self.obs.pg.running = false;
        self.publish_status();
        let stop = self.pg.stop(StopMode::Fast);
        // A leader keeps its key through a slow stop (up to a minute), or
        // another member could be promoted before this one starts again
        // as a primary.
        let lease = self.lease.filter(|_| self.holds_leader_key());
        let every = self.renew_every();
        let _ = holding_key(
            &self.dcs,
            &self.cfg.name,
            lease,
            every,
            (&mut self.watchdog, &mut self.last_renewal),
            stop,
        )
        .await;
        // A primary starts again only with a lease that still stands: one
        // that lapsed during a slow stop may have let another member be
        // promoted. The next round then decides what this node is.
        // In maintenance mode the operator owns PostgreSQL: started as
        // asked, whatever etcd says.
        if lease.is_some()
            && !self.obs.pg.in_recovery
            && !record::paused(&self.snapshot)
            && !self.renew().await
        {
            tracing::warn!("not starting PostgreSQL again as the primary: the leader lease could not be renewed after the stop");
            return;
        }
        // With on_restart, as in Patroni, it alone says so.
        let on_restart = self.cfg.callbacks.on_restart.clone();
        if on_restart.is_none() {
            self.run_callback(self.cfg.callbacks.on_stop.clone(), "on_stop", "restart");
        }
        match self
            .pg
            .start(self.timing.loop_wait)
            .await
            .or_else(still_starting)
        {
            Ok(()) => {
                let role = if self.obs.pg.in_recovery {
                    "replica"
                } else {
                    "primary"
                };
                match on_restart {
                    Some(cmd) => self.run_callback(Some(cmd), "on_restart", role),
                    None => {
                        self.run_callback(self.cfg.callbacks.on_start.clone(), "on_start", role)
                    }
                }
            }
            Err(e) => tracing::error!(error = %first_line(&e), "restart failed"),
        }
    }

    /// Runs `on_reload` after PostgreSQL was made to re-read its settings.
    fn reloaded(&mut self) {
        self.reloaded_at = Some(Instant::now());
        let role = if self.obs.pg.in_recovery {
            "replica"
        } else {
            "primary"
        };
        self.run_callback(self.cfg.callbacks.on_reload.clone(), "on_reload", role);
    }

    async fn control_state(&self) -> Option<String> {
        self.controldata("Database cluster state").await
    }

    async fn controldata(&self, field: &'static str) -> Option<String> {
        self.pg
            .with(move |i| Ok(i.controldata()?.remove(field)))
            .await
            .ok()
            .flatten()
    }

    fn record(&self) -> MemberRecord {
        // While a step replaces or rewrites the data directory (creating,
        // cloning, rewinding it) the last observation no longer holds: the
        // member is shown stopped with no WAL, or an election would count
        // it as a candidate, perhaps the best one, until the step ends.
        let in_flux = pgwarden_ha::LocalPg::default();
        let (pg, process) = if self.activity.is_some() {
            (&in_flux, false)
        } else {
            (&self.obs.pg, self.obs.process)
        };
        let role = match (pg.running, pg.in_recovery, process) {
            (true, true, _) => MemberRole::Replica,
            (true, false, _) => MemberRole::Primary,
            (false, _, true) => MemberRole::Unknown,
            (false, _, false) => MemberRole::Stopped,
        };
        let status = self.activity.unwrap_or(match (pg.running, process) {
            (true, _) => "running",
            (false, true) => "starting",
            (false, false) if self.start_failed_since.is_some() => "start failed",
            (false, false) => "stopped",
        });
        let last_leader_lsn = cluster_view(&self.snapshot, 0).last_leader_lsn;
        MemberRecord {
            state: MemberState {
                name: self.cfg.name.clone(),
                role,
                running: pg.running,
                timeline: pg.timeline,
                received_lsn: pg.received_lsn,
                replayed_lsn: pg.replayed_lsn,
                tags: {
                    let mut t = self.cfg.tags.clone();
                    // Without its required watchdog this member may not lead.
                    t.nofailover |= self.watchdog_problem.is_some();
                    t
                },
                fenced: crate::record::fenced(&self.snapshot).contains(&self.cfg.name),
                last_seen_ms_ago: 0,
                api_url: self.cfg.api_url.clone(),
                // Published beside the state (`replication_state`).
                streaming: None,
            },
            pg_address: self.cfg.pg_connect_address.to_string(),
            status: status.to_string(),
            updated_ms: unix_ms(),
            problem: self
                .problem
                .clone()
                .or_else(|| self.watchdog_problem.clone())
                .or_else(|| self.config_problem.clone())
                .or_else(|| self.remote_problem()),
            routing_generation: self.routing_ack.load(std::sync::atomic::Ordering::SeqCst),
            lag_bytes: match (pg.in_recovery, last_leader_lsn, pg.replayed_lsn) {
                (true, Some(l), Some(r)) => Some(l.saturating_sub(r)),
                _ => None,
            },
            proxy_url: self.proxy_url.clone(),
            decision: self.last_decision.clone(),
            pending_restart: pg.running && self.obs.pending_restart,
            scheduled_restart: self.scheduled_restart.clone(),
            slot: self
                .cfg
                .use_slots
                .then(|| crate::slots::slot_name(&self.cfg.name)),
            upstream: self.upstream.clone().filter(|_| pg.in_recovery),
            replication_state: (pg.running && pg.in_recovery).then(|| {
                if self.obs.streaming {
                    "streaming"
                } else {
                    "in archive recovery"
                }
                .to_string()
            }),
            logical_slots: self
                .logical_ready
                .iter()
                .map(|(n, r)| (n.clone(), r.1))
                .collect(),
            postmaster_start_time: self
                .obs
                .postmaster_start_time
                .clone()
                .filter(|_| pg.running),
        }
    }

    /// Why a standby leader that has not streamed from its source for a
    /// ttl is of no use as one: a source that is down or refuses it, or a
    /// history that forked off the source's.
    fn remote_problem(&self) -> Option<String> {
        let since = self.remote_silent_since?;
        if since.elapsed() < self.timing.ttl {
            return None;
        }
        let source = match record::standby_cluster(&self.snapshot)? {
            // Following the archive alone, there is nothing to stream from.
            Ok(s) if s.host.is_none() => return None,
            Ok(s) => s.address(),
            Err(_) => return None,
        };
        Some(format!(
            "standby leader not streaming from the remote source {source} for {} s: see \
             PostgreSQL's log (a history that forked off the source's is rewound when the \
             source answers)",
            since.elapsed().as_secs()
        ))
    }

    async fn publish_member(&mut self) {
        let (Some(lease), true) = (self.lease, self.dcs_ok) else {
            return;
        };
        let rec = self.record();
        let value = match serde_json::to_value(&rec) {
            Ok(v) => v,
            Err(_) => return,
        };
        let budget = self.dcs_budget();
        match tokio::time::timeout(
            budget,
            self.dcs.publish_member(&self.cfg.name, &value, lease),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "publishing the member state failed"),
            Err(_) => tracing::debug!("publishing the member state timed out"),
        }
    }

    /// Swaps in the status the API and the router read.
    fn publish_status(&mut self) {
        let rec = self.record();
        let role = rec.state.role;
        if self.last_role != Some(role) {
            tracing::info!(member = %self.cfg.name, role = %role, "local role");
            self.last_role = Some(role);
        }
        let leader = self.snapshot.leader.as_ref();
        // In maintenance mode a primary that holds the key (as last read)
        // leads whether or not etcd answers, as nothing demotes it.
        let paused = record::paused(&self.snapshot);
        let leads =
            self.holds_leader_key() && self.obs.pg.running && (self.lease_fresh() || paused);
        let status = AgentStatus {
            is_leader: leads && !self.obs.pg.in_recovery,
            standby_leader: leads
                && self.obs.pg.in_recovery
                && record::standby_cluster(&self.snapshot).is_some(),
            holds_leader_key: self.holds_leader_key() && (self.lease_fresh() || paused),
            leader: leader.map(|l| l.name.clone()),
            leader_generation: leader.map_or(0, |l| l.generation),
            routing_ready: self.routing_ready,
            dcs_reachable: self.dcs_ok,
            dcs_silent_ms: if self.dcs_ok {
                0
            } else {
                self.last_dcs_ok.elapsed().as_millis() as u64
            },
            paused,
            last_decision: self.last_decision.clone(),
            settings: self.cluster_settings(),
            node_settings: ClusterSettings::of(&self.cfg),
            cluster: Some(self.snapshot.clone()),
            replication: if leads && !self.obs.pg.in_recovery {
                self.replication.clone()
            } else {
                Vec::new()
            },
            member: rec,
        };
        self.status.store(Arc::new(status));
        self.changes.send_modify(|n| *n += 1);
    }

    /// Whether the leader's last renewal is recent enough that its lease
    /// certainly still holds.
    fn lease_fresh(&self) -> bool {
        self.last_renewal
            .is_some_and(|at| at.elapsed() < self.timing.demote_after())
    }

    fn run_callback(&self, command: Option<String>, action: &'static str, role: &'static str) {
        let Some(command) = command else { return };
        let cluster = self.etcd.cluster.clone();
        // A thread of its own that waits for the shell, rather than tokio's
        // child processes, whose driver would look for exited children at
        // every wake-up of every event loop in the binary, the proxy's
        // included; and rather than the blocking pool, which a shutting-down
        // runtime waits for: a hung callback must not hold up the agent.
        let run = move || {
            let res = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("{command} \"$@\""))
                .arg("sh")
                .args([action, role, &cluster])
                .status();
            match res {
                Ok(s) if s.success() => {}
                Ok(s) => tracing::warn!(action, status = %s, "callback failed"),
                Err(e) => tracing::warn!(action, error = %e, "callback could not run"),
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("pgwarden-callback".into())
            .spawn(run)
        {
            tracing::warn!(action, error = %e, "callback could not run");
        }
    }
}

/// A failed step of the bootstrap.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AgentStepError {
    #[error(transparent)]
    Dcs(#[from] pgwarden_dcs::DcsError),
    #[error(transparent)]
    Pg(#[from] PgCtlError),
    /// Someone else changed what this step was about to write.
    #[error("{0}")]
    Conflict(&'static str),
}

/// A server that has not finished starting within the wait is not an
/// error: the loop observes it until it is up.
/// Keeps a member's record in etcd while its loop is held up by a long
/// step: the record as it was when the step began, published again with
/// a fresh `updated_ms` every third of a ttl, on a lease kept alive as
/// often. Dropped, it stops.
struct Presence(tokio::task::JoinHandle<()>);

impl Presence {
    fn start(
        dcs: EtcdDcs,
        name: String,
        mut record: serde_json::Value,
        lease: LeaseId,
        ttl: Duration,
    ) -> Self {
        let pace = ttl / 3;
        Presence(tokio::spawn(async move {
            loop {
                record["updated_ms"] = unix_ms().into();
                if let Err(e) = dcs.publish_member(&name, &record, lease).await {
                    tracing::debug!(error = %e, "publishing the member state failed");
                }
                tokio::time::sleep(pace).await;
                if let Err(e) = dcs.keep_alive_once(lease).await {
                    tracing::debug!(error = %e, "member lease keep-alive failed");
                }
            }
        }))
    }
}

impl Drop for Presence {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn still_starting(e: PgCtlError) -> Result<(), PgCtlError> {
    match e {
        PgCtlError::Timeout { .. } => Ok(()),
        e => Err(e),
    }
}

fn first_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// The line of a tool's output that says what went wrong: the last one
/// reporting an error (pg_rewind prints what it found before it fails,
/// `servers diverged at ...`, then `error: ...`), else the first.
fn telling_line(e: &dyn std::fmt::Display) -> String {
    let text = e.to_string();
    let head = text.lines().next().unwrap_or_default();
    let telling = text.lines().rev().find(|l| {
        l.contains("error:") || l.contains("FATAL") || l.contains("PANIC") || l.contains("ERROR")
    });
    match telling {
        Some(l) if l != head => format!("{head} ... {}", l.trim()),
        _ => head.to_string(),
    }
}

fn append_hba(datadir: &std::path::Path, lines: &[String]) -> Result<(), PgCtlError> {
    if lines.is_empty() {
        return Ok(());
    }
    let path = datadir.join("pg_hba.conf");
    let mut text = std::fs::read_to_string(&path).map_err(|source| PgCtlError::Io {
        path: path.clone(),
        source,
    })?;
    // First match wins, so the operator's lines go first.
    let mut head = String::from("# Added by pgwarden from agent.pg_hba\n");
    for l in lines {
        head.push_str(l);
        head.push('\n');
    }
    text.insert_str(0, &head);
    std::fs::write(&path, text).map_err(|source| PgCtlError::Io { path, source })
}

/// Retries a DCS request that failed outright (not one that timed out)
/// until it succeeds or `budget` is spent: with several etcd members, a
/// request that hit a member that just died fails at once, and the next
/// one goes to a live member.
async fn retrying<T, F, Fut>(budget: Duration, mut op: F) -> pgwarden_dcs::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = pgwarden_dcs::Result<T>>,
{
    let deadline = Instant::now() + budget;
    loop {
        match op().await {
            Err(e) if e.is_unavailable() && Instant::now() + RETRY_GAP < deadline => {
                tracing::debug!(error = %e, "DCS request failed; retrying");
                tokio::time::sleep(RETRY_GAP).await;
            }
            // Given up only at the deadline, not just before it: a leader's
            // renewal runs to its demotion deadline, and a failure returned
            // early would be judged with the lease not yet too old, leaving
            // PostgreSQL taking writes for another round.
            Err(e) if e.is_unavailable() => {
                tokio::time::sleep_until(deadline.into()).await;
                return Err(e);
            }
            other => return other,
        }
    }
}

/// How long (ms) a member must still wait before it may count a failsafe
/// leader it acknowledged at `acked_ms` and that no longer answers as gone;
/// `None` once it may. Silent is not gone: cut off from this member, the
/// leader counts the last acknowledgement as a renewal, takes writes until
/// its demotion deadline (`loop_wait + retry_timeout`) runs out from it,
/// and demotes in the round after.
fn silent_failsafe_leader_wait(acked_ms: u64, now_ms: u64, timing: &Timing) -> Option<u64> {
    let wait = timing.demote_after() + timing.loop_wait + PEER_TIMEOUT;
    let until = acked_ms.saturating_add(wait.as_millis() as u64);
    (now_ms < until).then(|| until - now_ms)
}

/// Pause between retries of a failed DCS request.
const RETRY_GAP: Duration = Duration::from_millis(100);

/// `X/Y` (hexadecimal halves, as PostgreSQL prints a WAL position) as a
/// byte position.
/// How long a replica waits before copying a logical slot again that
/// PostgreSQL did not load after the last copy and restart.
const LOGICAL_RECOPY_AFTER: Duration = Duration::from_secs(600);

/// The bytes of a hex string as `encode(..., 'hex')` prints it.
fn hex_bytes(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn parse_lsn(text: &str) -> Option<u64> {
    let (hi, lo) = text.trim().split_once('/')?;
    Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
}

/// Whether the cluster's `initialize` key holds something: an identifier
/// or a claim.
fn recorded(snapshot: &ClusterSnapshot) -> bool {
    snapshot
        .initialize
        .as_deref()
        .is_some_and(|v| !v.trim().is_empty())
}

/// The settings in force with these `dynamic` and node-own `local`
/// parameters over pgwarden's defaults.
fn effective_parameters(
    dynamic: &std::collections::BTreeMap<String, String>,
    local: &std::collections::BTreeMap<String, String>,
) -> std::collections::BTreeMap<String, String> {
    let defaults = crate::DEFAULT_PARAMETERS
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    crate::parameters::effective(&defaults, dynamic, local)
}

/// Runs `work` with the leader key renewed (and the watchdog fed) every
/// `every` while it lasts, when `lease` holds the key; see
/// [`EtcdDcs::hold_leader_while`]. Each renewal counts in `last_renewal`,
/// so that the loop, once back, judges the lease by it.
async fn holding_key<T>(
    dcs: &EtcdDcs,
    name: &str,
    lease: Option<LeaseId>,
    every: Duration,
    (watchdog, last_renewal): (&mut crate::watchdog::Watchdog, &mut Option<Instant>),
    work: impl std::future::Future<Output = T>,
) -> T {
    match lease {
        Some(lease) => {
            let renewed = |at: Instant| {
                watchdog.keepalive();
                *last_renewal = Some(at);
            };
            dcs.hold_leader_while(name, lease, every, renewed, work)
                .await
        }
        None => work.await,
    }
}

/// A standby's WAL positions (received, replayed), asked of the server
/// `conninfo` names now; `None` if it cannot be asked or is no standby.
async fn standby_position_at(conninfo: &str) -> Option<(Option<u64>, Option<u64>)> {
    let ask = async {
        let (c, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
            .await
            .ok()?;
        tokio::spawn(conn);
        let row = c
            .query_one(
                "SELECT pg_wal_lsn_diff(pg_last_wal_receive_lsn(), '0/0')::int8, \
                 pg_wal_lsn_diff(pg_last_wal_replay_lsn(), '0/0')::int8 \
                 WHERE pg_is_in_recovery()",
                &[],
            )
            .await
            .ok()?;
        let lsn = |i: usize| row.get::<_, Option<i64>>(i).map(|v| v.max(0) as u64);
        Some((lsn(0), lsn(1)))
    };
    tokio::time::timeout(PEER_TIMEOUT, ask).await.ok().flatten()
}

/// Runs `CHECKPOINT` on the server `conninfo` names.
async fn checkpoint_at(conninfo: &str) -> Result<(), tokio_postgres::Error> {
    let (c, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    c.batch_execute("CHECKPOINT").await
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_silent_failsafe_leader_counts_as_gone_only_past_its_own_deadline() {
        // fast: loop_wait 5 + retry_timeout 5 = the leader's deadline,
        // then one more round and the time a peer gets to answer.
        let timing = pgwarden_ha::Timing::preset(pgwarden_ha::RtoPreset::Fast);
        let acked = 1_000_000;
        let wait_ms =
            (timing.demote_after() + timing.loop_wait + super::PEER_TIMEOUT).as_millis() as u64;
        assert_eq!(
            super::silent_failsafe_leader_wait(acked, acked + 1, &timing),
            Some(wait_ms - 1)
        );
        assert!(super::silent_failsafe_leader_wait(acked, acked + wait_ms - 1, &timing).is_some());
        assert_eq!(
            super::silent_failsafe_leader_wait(acked, acked + wait_ms, &timing),
            None
        );
        // Never acknowledged (0): long past.
        assert_eq!(super::silent_failsafe_leader_wait(0, acked, &timing), None);
    }

    /// A leader's renewal that keeps failing fast (etcd refusing
    /// connections) returns at its deadline, not a retry gap before it, so
    /// the same round sees the lease too old and demotes.
    #[test]
    fn a_request_failing_fast_is_given_up_at_the_deadline_not_before() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let budget = std::time::Duration::from_millis(950);
            let start = std::time::Instant::now();
            let failed = super::retrying(budget, || async {
                Err::<(), _>(pgwarden_dcs::DcsError::Timeout {
                    op: "renew leader",
                    after: std::time::Duration::ZERO,
                })
            })
            .await;
            assert!(failed.is_err());
            let took = start.elapsed();
            assert!(took >= budget, "gave up after {took:?}, before {budget:?}");
        });
    }

    #[test]
    fn a_tools_error_line_is_the_one_kept() {
        let e = "pg_rewind failed (exit status: 1): pg_rewind: servers diverged at WAL location 0/A01A228 on timeline 5\n\
                 pg_rewind: rewinding from last common checkpoint at 0/9000060 on timeline 5\n\
                 pg_rewind: error: could not open file \"x\": No such file or directory\n";
        assert_eq!(
            super::telling_line(&e),
            "pg_rewind failed (exit status: 1): pg_rewind: servers diverged at WAL location 0/A01A228 on timeline 5 ... pg_rewind: error: could not open file \"x\": No such file or directory"
        );
        assert_eq!(super::telling_line(&"just this\nand that"), "just this");
    }

    use super::parse_lsn;

    #[test]
    fn hex_as_postgresql_encodes_it() {
        assert_eq!(super::hex_bytes("00a1FF"), Some(vec![0, 0xa1, 0xff]));
        assert_eq!(super::hex_bytes(""), Some(vec![]));
        assert_eq!(super::hex_bytes("abc"), None);
        assert_eq!(super::hex_bytes("zz"), None);
    }

    #[test]
    fn wal_positions_parse_as_postgresql_prints_them() {
        assert_eq!(parse_lsn("0/3000060"), Some(0x300_0060));
        assert_eq!(parse_lsn("1/0"), Some(1 << 32));
        assert_eq!(parse_lsn("nonsense"), None);
    }
}
