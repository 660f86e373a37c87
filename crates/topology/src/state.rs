//! The cluster view built from probe results.
//!
//! [`Topology`] is fed one probe result at a time and re-derives the
//! cluster-wide facts (which host is primary, replica lag, synchronous
//! standbys, lag exclusion) after each, returning only what changed so
//! that callers can log transitions instead of every probe.

use std::collections::VecDeque;
use std::fmt;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::ewma::Ewma;
use crate::model::{
    HostAddr, HostConfig, InstanceId, Observation, ProbeResult, ReplicationRow, Role, SyncState,
    TopologyConfig,
};
use crate::ssn::{self, SyncMethod, SyncStandbyNames};

/// What is known about one configured host.
///
/// Fields are public for reading; only [`Topology`] changes them, and it
/// hands out shared references only.
#[derive(Clone, Debug)]
pub struct HostState {
    /// The host's configuration.
    pub config: HostConfig,
    /// Whether the host counts as up: false once `down_after_failures`
    /// probes in a row failed (at once for a refused connection), true
    /// again at the next success.
    pub alive: bool,
    /// Last role the host reported; kept while it is down so operators can
    /// see what went missing.
    pub role: Role,
    /// Smoothed probe round-trip time; cleared when the host goes down so
    /// that it re-enters with a fresh estimate.
    pub rtt: Ewma,
    /// Last reported timeline.
    pub timeline: Option<u32>,
    /// Synchronous-replication status per the primary; `None` unless the
    /// host is a live replica the primary lists.
    pub sync_state: Option<SyncState>,
    /// WAL distance behind the primary, when both positions are known.
    pub lag_bytes: Option<u64>,
    /// How long the primary had been past the replica's replay position
    /// when the replica was probed: the age of the oldest change it lacks.
    pub replay_delay: Option<Duration>,
    /// The replica applies WAL with a deliberate delay (`recovery_min_apply_delay`).
    pub delayed: bool,
    /// Message of the last failed probe; cleared by a successful one.
    pub error: Option<String>,
    /// Failed probes since the last successful one. A host that was up
    /// stays up (with its role and sessions) until doubtful failures reach
    /// [`TopologyConfig::down_after_failures`].
    pub failed_probes: u32,
    /// When the last successful probe was applied.
    pub last_ok: Option<Instant>,
    /// Excluded from read traffic for lagging too far behind.
    pub lag_excluded: bool,
    /// Why this live replica is not following the current primary (it is
    /// on an older timeline, or streams from a server that claims to be
    /// primary but is not the chosen one); such a replica takes no reads.
    pub off_primary: Option<String>,
    /// The primary `off_primary` was found against, when the flag is to
    /// outlast it: a replica behind it, or fed by another server, stays
    /// flagged while no primary is resolved, as long as that primary is
    /// still configured. `None` for a replica ahead of it (on a later
    /// timeline), which may well hold the newest data.
    off_primary_kept: Option<HostAddr>,
    /// The index (in [`Topology::hosts`]) of another entry that is the same
    /// server under another name, when this live entry is one: the first
    /// live entry of the server in configuration order. Such an
    /// entry is neither a second primary nor a second replica: the server
    /// counts once, as that entry.
    pub duplicate_of: Option<usize>,
    /// The identity the host reported before its latest one, when that was
    /// a restart, and since when the new one holds. Another name of this
    /// server not probed since still shows the old identity, and must not
    /// pass for a second server in the meantime.
    restarted_from: Option<(InstanceId, Instant)>,
    /// Since when an excluded replica has been continuously within the limit.
    under_limit_since: Option<Instant>,
    /// Whether any probe result has been applied yet.
    probed: bool,
    observation: Option<Observation>,
    /// WAL positions the host reported as a primary, oldest first, each with
    /// when it was first seen. Replica lag is measured against the position
    /// the primary had when the replica was observed, not its newest one.
    wal_history: VecDeque<(Instant, u64)>,
}

/// Distinct primary positions kept per host: minutes of history at usual
/// probe intervals, small enough to copy with every published snapshot.
const WAL_HISTORY_LEN: usize = 512;

impl HostState {
    fn new(config: HostConfig) -> Self {
        HostState {
            config,
            alive: false,
            role: Role::Unknown,
            rtt: Ewma::new(),
            timeline: None,
            sync_state: None,
            lag_bytes: None,
            replay_delay: None,
            delayed: false,
            error: None,
            failed_probes: 0,
            last_ok: None,
            lag_excluded: false,
            off_primary: None,
            off_primary_kept: None,
            duplicate_of: None,
            restarted_from: None,
            under_limit_since: None,
            probed: false,
            observation: None,
            wal_history: VecDeque::new(),
        }
    }

    /// Records the WAL position a primary reported at `at`. Only the first
    /// sighting of each position is kept: that is when the WAL up to it is
    /// known to have existed.
    fn record_wal(&mut self, at: Instant, lsn: u64) {
        match self.wal_history.back() {
            Some(&(_, last)) if last == lsn => return,
            // Going backwards is another server (or a restored one) at this
            // address: its old positions say nothing about the new one.
            Some(&(_, last)) if lsn < last => self.wal_history.clear(),
            _ => {}
        }
        if self.wal_history.len() == WAL_HISTORY_LEN {
            self.wal_history.pop_front();
        }
        self.wal_history.push_back((at, lsn));
    }

    /// The host's address.
    pub fn addr(&self) -> &HostAddr {
        &self.config.addr
    }

    /// The last successful observation, even if the host has since gone down.
    pub fn observation(&self) -> Option<&Observation> {
        self.observation.as_ref()
    }

    /// The name under which this host, as a replica, appears in the
    /// primary's `pg_stat_replication`: the configured override, else what
    /// its WAL receiver reports.
    pub fn replication_name(&self) -> Option<&str> {
        self.config.application_name.as_deref().or_else(|| {
            self.observation
                .as_ref()
                .and_then(|o| o.wal_receiver_name.as_deref())
        })
    }

    fn is_live_replica(&self) -> bool {
        self.alive && self.role == Role::Replica
    }

    fn instance(&self) -> Option<&InstanceId> {
        self.observation.as_ref()?.instance.as_ref()
    }
}

/// A change in the cluster view worth telling an operator about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopologyEvent {
    /// A host answered after being down (or on its first probe).
    HostUp {
        /// The host.
        host: HostAddr,
    },
    /// A host stopped answering (or failed its first probe).
    HostDown {
        /// The host.
        host: HostAddr,
        /// The probe error.
        error: String,
    },
    /// A probe of a host that is up failed in a way that may pass; the
    /// host stays up until `limit` such failures in a row.
    ProbeFailed {
        /// The host.
        host: HostAddr,
        /// The probe error.
        error: String,
        /// Failures in a row so far.
        failures: u32,
        /// Failures in a row that mark the host down.
        limit: u32,
    },
    /// A host reported a different role than before.
    RoleChanged {
        /// The host.
        host: HostAddr,
        /// Previous role.
        from: Role,
        /// New role.
        to: Role,
    },
    /// The resolved primary changed.
    PrimaryChanged {
        /// Previous primary.
        from: Option<HostAddr>,
        /// New primary.
        to: Option<HostAddr>,
    },
    /// Several hosts claim to be primary and none can be preferred.
    PrimaryConflict {
        /// The claimants.
        hosts: Vec<HostAddr>,
    },
    /// The set of synchronous standbys changed.
    SyncSetChanged {
        /// Hosts currently in state `sync` or `quorum`.
        sync: Vec<HostAddr>,
        /// Whether the primary uses quorum commit (`ANY`).
        quorum: bool,
    },
    /// A replica fell too far behind and no longer takes read traffic.
    LagExcluded {
        /// The replica.
        host: HostAddr,
        /// Its WAL lag at the time.
        lag_bytes: Option<u64>,
        /// Its replay delay at the time.
        replay_delay: Option<Duration>,
    },
    /// A previously excluded replica takes read traffic again.
    LagReadmitted {
        /// The replica.
        host: HostAddr,
    },
    /// A host claims to be primary but does not hold the leader key, so it
    /// gets no traffic (agent mode).
    PrimaryWithoutKey {
        /// The claimant.
        host: HostAddr,
    },
    /// Several replicas go by the same replication name and the primary's
    /// rows for it disagree, so none of them gets a sync state.
    SyncAmbiguous {
        /// The shared `application_name`.
        name: String,
        /// The replicas that bear it.
        hosts: Vec<HostAddr>,
    },
    /// A replica does not follow the current primary, so its data may miss
    /// what was written there; it takes no read traffic.
    OffPrimary {
        /// The replica.
        host: HostAddr,
        /// Why, for the operator.
        reason: String,
    },
    /// A replica that did not follow the primary does again.
    OnPrimary {
        /// The replica.
        host: HostAddr,
    },
    /// Two entries of the host list reach the same server; the later one
    /// is not counted again (not as another primary, nor as another
    /// replica to balance reads over).
    SameServer {
        /// The entry that duplicates another.
        host: HostAddr,
        /// The entry it duplicates, the one the server is counted as.
        of: HostAddr,
    },
    /// The primary's `synchronous_standby_names` could not be parsed.
    SyncConfigInvalid {
        /// The raw setting.
        value: String,
        /// Why it was rejected.
        error: String,
    },
}

fn addr_list(hosts: &[HostAddr]) -> String {
    if hosts.is_empty() {
        return "none".to_string();
    }
    hosts
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn opt_addr(a: &Option<HostAddr>) -> String {
    a.as_ref()
        .map_or_else(|| "none".to_string(), ToString::to_string)
}

impl fmt::Display for TopologyEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TopologyEvent::HostUp { host } => write!(f, "host {host} is up"),
            TopologyEvent::HostDown { host, error } => write!(f, "host {host} is down: {error}"),
            TopologyEvent::ProbeFailed {
                host,
                error,
                failures,
                limit,
            } => write!(
                f,
                "probe of host {host} failed ({failures} of {limit} in a row before it counts as down): {error}"
            ),
            TopologyEvent::RoleChanged { host, from, to } => {
                write!(f, "host {host} changed role from {from} to {to}")
            }
            TopologyEvent::PrimaryChanged { from, to } => write!(
                f,
                "primary changed from {} to {}",
                opt_addr(from),
                opt_addr(to)
            ),
            TopologyEvent::PrimaryConflict { hosts } => write!(
                f,
                "several hosts claim to be primary on the same timeline, refusing to pick one: {}",
                addr_list(hosts)
            ),
            TopologyEvent::SyncSetChanged { sync, quorum } => write!(
                f,
                "synchronous standbys are now {} ({} commit)",
                addr_list(sync),
                if *quorum { "quorum" } else { "priority" }
            ),
            TopologyEvent::LagExcluded {
                host,
                lag_bytes,
                replay_delay,
            } => {
                write!(f, "replica {host} excluded for lag")?;
                let mut parts = Vec::new();
                if let Some(b) = lag_bytes {
                    parts.push(format!("{b} bytes behind"));
                }
                if let Some(d) = replay_delay {
                    parts.push(format!("replay {:.3}s behind", d.as_secs_f64()));
                }
                if !parts.is_empty() {
                    write!(f, " ({})", parts.join(", "))?;
                }
                Ok(())
            }
            TopologyEvent::LagReadmitted { host } => {
                write!(f, "replica {host} readmitted after catching up")
            }
            TopologyEvent::PrimaryWithoutKey { host } => write!(
                f,
                "host {host} claims to be primary but does not hold the leader key; it gets no traffic"
            ),
            TopologyEvent::SyncAmbiguous { name, hosts } => write!(
                f,
                "replicas {} all stream as application_name {name:?} and the primary reports them differently; none is treated as synchronous (give each a distinct application_name or replication slot)",
                addr_list(hosts)
            ),
            TopologyEvent::OffPrimary { host, reason } => write!(
                f,
                "replica {host} does not follow the primary ({reason}); it gets no read traffic"
            ),
            TopologyEvent::OnPrimary { host } => {
                write!(f, "replica {host} follows the primary again")
            }
            TopologyEvent::SameServer { host, of } => write!(
                f,
                "host {host} is the same server as {of} (same system identifier, start time and port); it is counted once, as {of}"
            ),
            TopologyEvent::SyncConfigInvalid { value, error } => write!(
                f,
                "cannot parse primary's synchronous_standby_names {value:?} ({error}); treating it as empty"
            ),
        }
    }
}

/// Which hosts may be taken as the primary.
///
/// Standalone, the probes alone decide: whoever reports it is out of
/// recovery (the higher timeline winning a conflict). Under the HA agent,
/// the leader key in the store decides and the probe only confirms: a host
/// that claims primary without the key gets no traffic, and without a known
/// key holder nothing is primary, so routing fails closed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PrimaryGate {
    /// Probes decide (standalone mode).
    #[default]
    Open,
    /// Only this host may be primary; `None`: no host may.
    Leader(Option<HostAddr>),
}

/// The cluster as pgwarden currently sees it.
#[derive(Clone, Debug)]
pub struct Topology {
    hosts: Vec<HostState>,
    config: TopologyConfig,
    gate: PrimaryGate,
    /// Claimants without the key already reported, so each is logged once.
    rogues: Vec<HostAddr>,
    primary: Option<usize>,
    conflict_hosts: Vec<usize>,
    ssn: Option<SyncStandbyNames>,
    ssn_error: Option<String>,
    /// Last (value, error) reported as invalid, so a bad setting is reported once.
    ssn_reported: Option<(String, String)>,
    sync_set: Vec<usize>,
    quorum: bool,
    /// Shared replication names already reported, so each is logged once.
    ambiguous_reported: Vec<(String, Vec<HostAddr>)>,
    /// Pairs of entries already reported as one server, so each pair is
    /// logged once rather than every time one of them goes down and up.
    same_reported: Vec<(HostAddr, HostAddr)>,
}

impl Topology {
    /// A topology with every host not yet probed.
    pub fn new(hosts: Vec<HostConfig>, config: TopologyConfig) -> Topology {
        Topology {
            hosts: hosts.into_iter().map(HostState::new).collect(),
            config,
            gate: PrimaryGate::Open,
            rogues: Vec::new(),
            primary: None,
            conflict_hosts: Vec::new(),
            ssn: None,
            ssn_error: None,
            ssn_reported: None,
            sync_set: Vec::new(),
            quorum: false,
            ambiguous_reported: Vec::new(),
            same_reported: Vec::new(),
        }
    }

    /// Replaces the tunables; lag exclusion follows the new limit from the
    /// next [`Topology::apply`], which is the first moment a time is known.
    pub fn set_config(&mut self, config: TopologyConfig) {
        self.config = config;
    }

    /// Replaces the rule for who may be primary and re-derives the view.
    /// Returns the changes, e.g. the primary the gate just closed on.
    pub fn set_primary_gate(&mut self, gate: PrimaryGate) -> Vec<TopologyEvent> {
        let prev = self.snapshot();
        self.gate = gate;
        self.rogues.clear();
        let mut events = Vec::new();
        self.derive(prev, &mut events);
        events
    }

    /// The rule in force for who may be primary.
    pub fn primary_gate(&self) -> &PrimaryGate {
        &self.gate
    }

    /// Replaces the host list (configuration reload). Hosts whose address
    /// remains keep their probe state under their new index; new hosts
    /// start unprobed. Returns the changes to the derived view, e.g. a
    /// primary that is no longer configured.
    pub fn set_hosts(&mut self, hosts: Vec<HostConfig>) -> Vec<TopologyEvent> {
        let prev = self.snapshot();
        let mut old: Vec<Option<HostState>> = std::mem::take(&mut self.hosts)
            .into_iter()
            .map(Some)
            .collect();
        self.hosts = hosts
            .into_iter()
            .map(|cfg| {
                let kept = old
                    .iter_mut()
                    .find(|o| o.as_ref().is_some_and(|s| s.config.addr == cfg.addr))
                    .and_then(Option::take);
                match kept {
                    Some(mut state) => {
                        state.config = cfg;
                        state
                    }
                    None => HostState::new(cfg),
                }
            })
            .collect();
        let configured = |a: &HostAddr| self.hosts.iter().any(|h| &h.config.addr == a);
        let same_reported = std::mem::take(&mut self.same_reported);
        self.same_reported = same_reported
            .into_iter()
            .filter(|(a, b)| configured(a) && configured(b))
            .collect();
        let mut events = Vec::new();
        self.derive(prev, &mut events);
        events
    }

    /// Records one probe result for host `idx` and re-derives the cluster
    /// view. Returns the resulting changes, in the order: host status,
    /// primary, synchronous configuration, lag exclusion. An out-of-range
    /// index is ignored.
    pub fn apply(&mut self, idx: usize, result: ProbeResult, now: Instant) -> Vec<TopologyEvent> {
        let mut events = Vec::new();
        let prev = self.snapshot();
        let Some(h) = self.hosts.get_mut(idx) else {
            return events;
        };
        let first = !h.probed;
        h.probed = true;
        let doubtful = matches!(result, ProbeResult::Err(_));
        match result {
            ProbeResult::Ok(obs) => {
                if !h.alive {
                    events.push(TopologyEvent::HostUp {
                        host: h.config.addr.clone(),
                    });
                }
                let role = if obs.in_recovery {
                    Role::Replica
                } else {
                    Role::Primary
                };
                // The first role ever seen is not a change; HostUp covers it.
                if h.role != role && h.role != Role::Unknown {
                    events.push(TopologyEvent::RoleChanged {
                        host: h.config.addr.clone(),
                        from: h.role,
                        to: role,
                    });
                }
                h.alive = true;
                h.failed_probes = 0;
                h.role = role;
                h.rtt.update(obs.rtt);
                // A replica whose WAL receiver is down reports no timeline,
                // yet its data is still on the last one it received (or
                // on the one it led, for a former primary): kept, so that
                // one that cannot follow the primary is still seen as off
                // it.
                h.timeline = match (obs.timeline, role) {
                    (None, Role::Replica) => h.timeline,
                    (tl, _) => tl,
                };
                h.delayed = !obs.min_apply_delay.is_zero();
                h.error = None;
                h.last_ok = Some(now);
                if let (Some(old), Some(new)) = (h.instance(), obs.instance.as_ref()) {
                    if old.restarted_as(new) {
                        h.restarted_from = Some((old.clone(), now));
                    }
                }
                match obs.current_lsn {
                    Some(lsn) if !obs.in_recovery => h.record_wal(now, lsn),
                    _ => h.wal_history.clear(),
                }
                h.observation = Some(obs);
            }
            ProbeResult::Err(error) | ProbeResult::Down(error) => {
                h.failed_probes = h.failed_probes.saturating_add(1);
                let limit = self.config.down_after_failures.max(1);
                if h.alive && doubtful && h.failed_probes < limit {
                    // Up it stays, as last seen: its sessions go on, and a
                    // connection it cannot take is retried elsewhere.
                    events.push(TopologyEvent::ProbeFailed {
                        host: h.config.addr.clone(),
                        error: error.clone(),
                        failures: h.failed_probes,
                        limit,
                    });
                } else {
                    if h.alive || first {
                        events.push(TopologyEvent::HostDown {
                            host: h.config.addr.clone(),
                            error: error.clone(),
                        });
                    }
                    h.alive = false;
                    h.rtt.reset();
                }
                h.error = Some(error);
            }
        }
        self.derive(prev, &mut events);
        self.update_lag_exclusion(now, &mut events);
        events
    }

    /// All hosts, indexed by host id.
    pub fn hosts(&self) -> &[HostState] {
        &self.hosts
    }

    /// One host by id.
    pub fn host(&self, idx: usize) -> Option<&HostState> {
        self.hosts.get(idx)
    }

    /// The resolved primary, if exactly one can be trusted.
    pub fn primary(&self) -> Option<usize> {
        self.primary
    }

    /// Whether entry `i` reaches the primary server: it is the primary's
    /// entry, or another name of the same server. Sessions and pools bound
    /// to one name of the primary stay when the primary's entry moves to
    /// another name of it (one name's probe failed for a moment).
    pub fn reaches_primary(&self, i: usize) -> bool {
        self.primary.is_some_and(|p| {
            p == i || (i < self.hosts.len() && self.counted_as(i) == self.counted_as(p))
        })
    }

    /// Whether several live hosts claim to be primary and none wins.
    pub fn conflict(&self) -> bool {
        !self.conflict_hosts.is_empty()
    }

    /// The hosts in conflict (empty when there is none).
    pub fn conflict_hosts(&self) -> &[usize] {
        &self.conflict_hosts
    }

    /// Whether the primary uses quorum commit (`ANY n (...)`).
    pub fn quorum_commit(&self) -> bool {
        self.ssn
            .as_ref()
            .is_some_and(|s| s.method == SyncMethod::Any)
    }

    /// The primary's parsed `synchronous_standby_names`, if set and valid.
    pub fn sync_standby_names(&self) -> Option<&SyncStandbyNames> {
        self.ssn.as_ref()
    }

    /// Why the primary's `synchronous_standby_names` was rejected, if it was.
    pub fn ssn_error(&self) -> Option<&str> {
        self.ssn_error.as_deref()
    }

    /// Hosts currently in state `sync` or `quorum`.
    pub fn sync_set(&self) -> &[usize] {
        &self.sync_set
    }

    /// The tunables in force.
    pub fn config(&self) -> &TopologyConfig {
        &self.config
    }

    fn snapshot(&self) -> Snapshot {
        let addr = |i: usize| self.hosts[i].config.addr.clone();
        Snapshot {
            primary: self.primary.map(addr),
            conflict: self.conflict_hosts.iter().copied().map(addr).collect(),
            sync: self.sync_set.iter().copied().map(addr).collect(),
            quorum: self.quorum,
        }
    }

    fn addrs(&self, idx: &[usize]) -> Vec<HostAddr> {
        idx.iter()
            .map(|&i| self.hosts[i].config.addr.clone())
            .collect()
    }

    /// Recomputes primary, lag and sync states and reports differences
    /// against `prev`.
    fn derive(&mut self, prev: Snapshot, events: &mut Vec<TopologyEvent>) {
        self.compute_duplicates(events);
        self.resolve_primary(events);
        if !self.conflict_hosts.is_empty() {
            let now = self.addrs(&self.conflict_hosts);
            if now != prev.conflict {
                events.push(TopologyEvent::PrimaryConflict { hosts: now });
            }
        }
        let primary = self.primary.map(|i| self.hosts[i].config.addr.clone());
        if primary != prev.primary {
            events.push(TopologyEvent::PrimaryChanged {
                from: prev.primary,
                to: primary,
            });
        }

        self.compute_upstream(events);
        self.compute_lag();
        self.compute_sync(events);
        let sync = self.addrs(&self.sync_set);
        if sync != prev.sync || self.quorum != prev.quorum {
            events.push(TopologyEvent::SyncSetChanged {
                sync,
                quorum: self.quorum,
            });
        }
    }

    /// Marks each live entry that reaches the same server as an earlier
    /// one, and reports each such pair once.
    ///
    /// Two entries are one server when they report the same identity. An
    /// entry also counts as a server that has since restarted when it still
    /// shows the identity that server had before, and has not been probed
    /// since the restart was seen: the names of one server are probed at
    /// slightly different moments, and without this a restarted primary
    /// listed twice would look like two primaries until the other name's
    /// next probe.
    fn compute_duplicates(&mut self, events: &mut Vec<TopologyEvent>) {
        let n = self.hosts.len();
        let mut dup: Vec<Option<usize>> = vec![None; n];
        fn live(h: &HostState) -> Option<&InstanceId> {
            h.alive.then(|| h.instance()).flatten()
        }
        for i in 0..n {
            let Some(id) = live(&self.hosts[i]) else {
                continue;
            };
            dup[i] = (0..i).find(|&j| dup[j].is_none() && live(&self.hosts[j]) == Some(id));
        }
        for i in 0..n {
            let (Some(id), None) = (live(&self.hosts[i]), dup[i]) else {
                continue;
            };
            let seen = self.hosts[i].last_ok;
            let restarted = (0..n).find(|&k| {
                let h = &self.hosts[k];
                k != i
                    && dup[k].is_none()
                    && live(h).is_some()
                    && h.restarted_from
                        .as_ref()
                        .is_some_and(|(old, since)| old == id && seen <= Some(*since))
            });
            if let Some(k) = restarted {
                for d in dup.iter_mut().filter(|d| **d == Some(i)) {
                    *d = Some(k);
                }
                dup[i] = Some(k);
            }
        }
        for (i, of) in dup.iter().enumerate() {
            self.hosts[i].duplicate_of = *of;
            let Some(of) = *of else { continue };
            let (a, b) = (
                self.hosts[i].config.addr.clone(),
                self.hosts[of].config.addr.clone(),
            );
            let known = self
                .same_reported
                .iter()
                .any(|(x, y)| (x == &a && y == &b) || (x == &b && y == &a));
            if !known {
                self.same_reported.push((a.clone(), b.clone()));
                events.push(TopologyEvent::SameServer { host: a, of: b });
            }
        }
    }

    /// The entry a live host is counted as: the one it duplicates, else
    /// itself.
    fn counted_as(&self, i: usize) -> usize {
        self.hosts[i].duplicate_of.unwrap_or(i)
    }

    fn resolve_primary(&mut self, events: &mut Vec<TopologyEvent>) {
        let claiming: Vec<usize> = (0..self.hosts.len())
            .filter(|&i| self.hosts[i].alive && self.hosts[i].role == Role::Primary)
            .collect();
        self.primary = None;
        self.conflict_hosts.clear();
        if let PrimaryGate::Leader(leader) = &self.gate {
            let named = |i: usize| Some(&self.hosts[i].config.addr) == leader.as_ref();
            // The key holder's own entry first; failing that, another name
            // of the same server: after a promotion the names are probed at
            // different moments, and the one probed first must not make the
            // new leader a rogue (nor leave writes without a primary) until
            // the holder's own entry is probed again.
            let key_server = (0..self.hosts.len())
                .find(|&i| named(i) && self.hosts[i].alive)
                .map(|i| self.counted_as(i));
            let holder = claiming.iter().copied().find(|&i| named(i)).or_else(|| {
                claiming
                    .iter()
                    .copied()
                    .find(|&i| key_server == Some(self.counted_as(i)))
            });
            self.primary = holder;
            // Another name of the key holder is the key holder; a rogue
            // listed twice is one rogue, reported under the entry it is
            // counted as when that entry claims too.
            let mut rogues: Vec<usize> = Vec::new();
            for &i in &claiming {
                let server = self.counted_as(i);
                if holder.is_some_and(|l| self.counted_as(l) == server)
                    || rogues.iter().any(|&r| self.counted_as(r) == server)
                {
                    continue;
                }
                rogues.push(if claiming.contains(&server) {
                    server
                } else {
                    i
                });
            }
            let known = |addr: &HostAddr| {
                self.hosts
                    .iter()
                    .position(|h| &h.config.addr == addr)
                    .map(|k| self.counted_as(k))
            };
            for &r in &rogues {
                let server = Some(self.counted_as(r));
                if !self.rogues.iter().any(|old| known(old) == server) {
                    events.push(TopologyEvent::PrimaryWithoutKey {
                        host: self.hosts[r].config.addr.clone(),
                    });
                }
            }
            self.rogues = rogues
                .into_iter()
                .map(|r| self.hosts[r].config.addr.clone())
                .collect();
            return;
        }
        // A server listed twice claims primary once: as the entry it is
        // counted as when that entry claims it too, else as its first name
        // that does (a promotion is seen by the names at different
        // moments, and the first to see it must count).
        let claimants: Vec<usize> = claiming
            .iter()
            .copied()
            .filter(|&i| {
                let server = self.counted_as(i);
                let counted_claims = claiming.contains(&server);
                if counted_claims {
                    i == server
                } else {
                    claiming.iter().find(|&&j| self.counted_as(j) == server) == Some(&i)
                }
            })
            .collect();
        match claimants.as_slice() {
            [] => {}
            [only] => self.primary = Some(*only),
            _ => {
                // A promoted replica switches to a new timeline, so with
                // known timelines the highest one is the current primary and
                // the others are stale. Without that evidence, refuse.
                let timelines: Option<Vec<u32>> =
                    claimants.iter().map(|&i| self.hosts[i].timeline).collect();
                let winner = timelines.and_then(|tls| {
                    let top = *tls.iter().max()?;
                    let mut at_top = claimants.iter().zip(&tls).filter(|(_, &t)| t == top);
                    let first = at_top.next()?;
                    at_top.next().is_none().then_some(*first.0)
                });
                match winner {
                    Some(w) => self.primary = Some(w),
                    None => self.conflict_hosts = claimants,
                }
            }
        }
    }

    /// Flags live replicas that cannot be following the resolved primary.
    ///
    /// After a promotion the old primary may keep running, and replicas
    /// still streaming from it stay on the old timeline: their WAL
    /// positions look current, yet they lack what the new primary wrote.
    /// A replica on a later timeline than the primary's followed a
    /// promotion the primary never saw (the primary chosen is an old one,
    /// its successor gone): it cannot stream from it. A replica on the
    /// primary's timeline may still stream from another server claiming
    /// primary, for instance a rogue without the leader key: its upstream
    /// tells, see [`Topology::feeder`].
    fn compute_upstream(&mut self, events: &mut Vec<TopologyEvent>) {
        let primary = self.primary.map(|p| {
            let h = &self.hosts[p];
            (p, h.config.addr.clone(), h.timeline)
        });
        let listed = self.listed_replicas();
        // Each flag, with the primary it outlasts (see `off_primary_kept`).
        let reasons: Vec<Option<(String, Option<HostAddr>)>> = (0..self.hosts.len())
            .map(|i| {
                let h = &self.hosts[i];
                if !h.is_live_replica() {
                    return None;
                }
                // With no primary resolved (it is down, or two claim it on
                // one timeline) there is nothing to compare against: a
                // replica found behind the last one, or fed by another
                // server, stays flagged rather than serve its stale data
                // until a primary is known again; unless that primary left
                // the configuration.
                let Some((p, paddr, ptl)) = primary.as_ref() else {
                    let kept = h.off_primary_kept.as_ref()?;
                    let reason = h.off_primary.clone()?;
                    return self
                        .hosts
                        .iter()
                        .any(|x| &x.config.addr == kept)
                        .then(|| (reason, Some(kept.clone())));
                };
                let timeline = match (h.timeline, *ptl) {
                    (Some(tl), Some(ptl)) if tl != ptl => Some((
                        tl < ptl,
                        format!("on timeline {tl}, the primary {paddr} is on timeline {ptl}"),
                    )),
                    _ => None,
                };
                if let Some((true, behind)) = timeline {
                    return Some((behind, Some(paddr.clone())));
                }
                // The server it streams from, when known, says more than
                // a later timeline does.
                let fed = self.feeder(i, &listed).and_then(|(s, how)| {
                    let source = &self.hosts[s];
                    // Another name of the primary is the primary; a replica
                    // feeding it is a cascade, which is fine.
                    (source.alive
                        && source.role == Role::Primary
                        && self.counted_as(s) != self.counted_as(*p))
                    .then(|| {
                        format!(
                            "streams from {}{how}, which is not the primary {paddr}",
                            source.config.addr
                        )
                    })
                });
                fed.map(|r| (r, Some(paddr.clone())))
                    .or(timeline.map(|(_, ahead)| (ahead, None)))
            })
            .collect();
        for (h, flag) in self.hosts.iter_mut().zip(reasons) {
            if !h.alive {
                // Kept while down: being down proves nothing either way.
                continue;
            }
            let (reason, kept) = flag.map_or((None, None), |(r, k)| (Some(r), k));
            h.off_primary_kept = kept;
            if reason == h.off_primary {
                continue;
            }
            match &reason {
                Some(r) => events.push(TopologyEvent::OffPrimary {
                    host: h.config.addr.clone(),
                    reason: r.clone(),
                }),
                None if h.role == Role::Replica && primary.is_some() => {
                    events.push(TopologyEvent::OnPrimary {
                        host: h.config.addr.clone(),
                    })
                }
                None => {}
            }
            h.off_primary = reason;
        }
    }

    /// For each live server claiming primary (counted once), which hosts
    /// its `pg_stat_replication` shows streaming from it, by the same
    /// slot-then-unique-name rule as the sync states.
    fn listed_replicas(&self) -> Vec<(usize, Vec<bool>)> {
        let cascaded = self.cascaded();
        (0..self.hosts.len())
            .filter(|&c| {
                let h = &self.hosts[c];
                h.alive && h.role == Role::Primary && h.duplicate_of.is_none()
            })
            .map(|c| {
                let rows = self.hosts[c]
                    .observation
                    .as_ref()
                    .map_or(&[][..], |o| &o.replication[..]);
                let (rows, _) = attribute_rows(&self.hosts, rows, &cascaded);
                (c, rows.iter().map(Option::is_some).collect())
            })
            .collect()
    }

    /// The configured host live replica `i` streams from, with how that
    /// was found (text for the operator), if it can be told.
    ///
    /// What the servers report comes first: a server claiming primary
    /// whose `pg_stat_replication` shows the replica (by its slot, or by a
    /// name no other replica bears) is its upstream, whatever names either
    /// is configured under; the resolved primary is asked first. Failing
    /// that, the replica's `sender_host`/`sender_port` is matched to a
    /// host: the replica names its upstream as its own configuration does
    /// (`localhost`, a DNS alias, an address), so the comparison is by
    /// machine and port rather than by spelling. A loopback address or a
    /// Unix-socket directory is the replica's own machine; another name is
    /// taken at the addresses the prober resolved it to. A host's machine
    /// is the address it accepted the probe on, and a host is also known
    /// by its configured name. An upstream that is no configured host
    /// (an unlisted cascading replica, say) is unknown: `None`.
    fn feeder(&self, i: usize, listed: &[(usize, Vec<bool>)]) -> Option<(usize, &'static str)> {
        let r = self.counted_as(i);
        let mut listers = listed.iter().filter(|(_, l)| l[r]).map(|(c, _)| *c);
        let first = match self.primary {
            Some(p) if listed.iter().any(|(c, l)| *c == self.counted_as(p) && l[r]) => {
                Some(self.counted_as(p))
            }
            _ => listers.next(),
        };
        if let Some(c) = first {
            return Some((c, " (in its pg_stat_replication)"));
        }
        self.named_upstream(i).map(|s| (s, ""))
    }

    /// The configured host that live replica `i` names as its upstream
    /// (`sender_host`/`sender_port`), matched by machine and port as
    /// [`Self::feeder`] describes; `None` when it names none of them.
    fn named_upstream(&self, i: usize) -> Option<usize> {
        let r = self.counted_as(i);
        let obs = self.hosts[i].observation.as_ref()?;
        let up = obs.upstream.as_ref()?;
        let local = up.host.starts_with('/')
            || up.host.eq_ignore_ascii_case("localhost")
            || up.host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
        let at: Vec<IpAddr> = if local {
            obs.server_ip.into_iter().collect()
        } else {
            obs.upstream_ips.clone()
        };
        (0..self.hosts.len()).find(|&s| {
            let o = &self.hosts[s];
            if self.counted_as(s) == r {
                return false;
            }
            let port =
                o.config.addr.port == up.port || o.instance().is_some_and(|id| id.port == up.port);
            let named = !local && o.config.addr.host.eq_ignore_ascii_case(&up.host);
            let machine = o
                .observation
                .as_ref()
                .and_then(|x| x.server_ip)
                .is_some_and(|ip| at.iter().any(|a| same_machine(*a, ip)));
            port && (named || machine)
        })
    }

    /// Live replicas that stream from another live replica (a cascade),
    /// by the upstream they name. The primary's `pg_stat_replication`
    /// cannot list them, so none of its rows is theirs, whatever name they
    /// share with a standby of the primary.
    fn cascaded(&self) -> Vec<bool> {
        (0..self.hosts.len())
            .map(|i| {
                self.hosts[i].is_live_replica()
                    && self.named_upstream(i).is_some_and(|s| {
                        let u = &self.hosts[s];
                        u.alive && u.role == Role::Replica
                    })
            })
            .collect()
    }

    fn compute_lag(&mut self) {
        let lags: Vec<Option<Lag>> = self
            .hosts
            .iter()
            .map(|h| {
                let p = &self.hosts[self.primary?];
                let replay = h.observation.as_ref()?.replay_lsn?;
                Some(lag_against(&p.wal_history, h.last_ok?, replay))
            })
            .collect();
        for (h, lag) in self.hosts.iter_mut().zip(lags) {
            // Positions on another timeline are not comparable.
            if h.is_live_replica() && h.off_primary.is_none() {
                (h.lag_bytes, h.replay_delay) = lag.unwrap_or((None, None));
            } else {
                h.lag_bytes = None;
                h.replay_delay = None;
            }
        }
    }

    fn compute_sync(&mut self, events: &mut Vec<TopologyEvent>) {
        let primary_obs = self.primary.and_then(|p| self.hosts[p].observation.clone());
        self.ssn = None;
        self.ssn_error = None;
        if let Some(raw) = primary_obs
            .as_ref()
            .and_then(|o| o.synchronous_standby_names.as_deref())
        {
            match ssn::parse(raw) {
                Ok(parsed) => {
                    self.ssn = parsed;
                    self.ssn_reported = None;
                }
                Err(e) => {
                    let error = e.to_string();
                    self.ssn_error = Some(error.clone());
                    let report = (raw.to_string(), error.clone());
                    if self.ssn_reported.as_ref() != Some(&report) {
                        events.push(TopologyEvent::SyncConfigInvalid {
                            value: raw.to_string(),
                            error,
                        });
                        self.ssn_reported = Some(report);
                    }
                }
            }
        }
        self.quorum = self.quorum_commit();

        let rows = primary_obs.as_ref().map_or(&[][..], |o| &o.replication[..]);
        let sync_configured = self.ssn.is_some();
        let (attributed, ambiguous) = attribute_rows(&self.hosts, rows, &self.cascaded());
        self.sync_set.clear();
        for (i, row_state) in attributed.into_iter().enumerate() {
            // The server's own verdict is authoritative, except that nothing
            // can be synchronous without a setting.
            let state = row_state.and_then(|s| {
                if sync_configured {
                    SyncState::parse(s)
                } else {
                    Some(SyncState::Async)
                }
            });
            if matches!(state, Some(SyncState::Sync | SyncState::Quorum)) {
                self.sync_set.push(i);
            }
            self.hosts[i].sync_state = state;
        }
        // Another name of a standby is that standby, in the set once.
        for i in 0..self.hosts.len() {
            if let Some(of) = self.hosts[i].duplicate_of {
                self.hosts[i].sync_state = self.hosts[of].sync_state;
            }
        }
        for (name, idx) in &ambiguous {
            let hosts = self.addrs(idx);
            let report = (name.clone(), hosts.clone());
            if !self.ambiguous_reported.contains(&report) {
                events.push(TopologyEvent::SyncAmbiguous {
                    name: name.clone(),
                    hosts,
                });
            }
        }
        self.ambiguous_reported = ambiguous
            .into_iter()
            .map(|(name, idx)| {
                let hosts = self.addrs(&idx);
                (name, hosts)
            })
            .collect();
    }

    fn update_lag_exclusion(&mut self, now: Instant, events: &mut Vec<TopologyEvent>) {
        let limit = self.config.max_replica_lag;
        let hold = self.config.lag_hold;
        for h in &mut self.hosts {
            let was = h.lag_excluded;
            match limit {
                None => {
                    h.lag_excluded = false;
                    h.under_limit_since = None;
                }
                Some(_) if !h.alive => {
                    // Time spent down proves nothing about catching up.
                    h.under_limit_since = None;
                }
                Some(_) if h.role != Role::Replica => {
                    h.lag_excluded = false;
                    h.under_limit_since = None;
                }
                Some(limit) => {
                    if limit.exceeded(h.lag_bytes, h.replay_delay) {
                        h.lag_excluded = true;
                        h.under_limit_since = None;
                    } else if h.lag_excluded {
                        if limit.within(h.lag_bytes, h.replay_delay) {
                            let since = *h.under_limit_since.get_or_insert(now);
                            if now.saturating_duration_since(since) >= hold {
                                h.lag_excluded = false;
                                h.under_limit_since = None;
                            }
                        } else {
                            // Unknown lag is no evidence of catching up.
                            h.under_limit_since = None;
                        }
                    }
                }
            }
            if h.lag_excluded && !was {
                events.push(TopologyEvent::LagExcluded {
                    host: h.config.addr.clone(),
                    lag_bytes: h.lag_bytes,
                    replay_delay: h.replay_delay,
                });
            } else if was && !h.lag_excluded {
                events.push(TopologyEvent::LagReadmitted {
                    host: h.config.addr.clone(),
                });
            }
        }
    }
}

/// Whether two addresses, as seen from the prober, are one machine: equal,
/// or both loopback (the prober's own machine, however it is reached).
fn same_machine(a: IpAddr, b: IpAddr) -> bool {
    a == b || (a.is_loopback() && b.is_loopback())
}

/// Bytes and time a replica is behind; `None` where unknown.
type Lag = (Option<u64>, Option<Duration>);

/// How far behind a replica was when, at `seen`, it had replayed up to
/// `replay`, given the positions its primary reported (`history`, oldest
/// first, each with when it was first seen).
///
/// Only primary readings taken no later than the replica's count: compared
/// with a newer one, the replica would look behind by the WAL written in
/// between. The bytes are what the primary had written by then beyond the
/// replica. The time is how long the primary had been past the replica's
/// position: the age of the oldest change the replica lacks, as far as the
/// probes can tell (a lower bound, to within one probe interval and at most
/// the span of the history). It does not depend on when the replica last
/// replayed a commit, which an idle primary makes arbitrarily old and a
/// replica that receives nothing never updates.
///
/// Before any earlier primary reading the lag is known only if the replica
/// had already replayed what the primary reported next: then it is zero.
fn lag_against(history: &VecDeque<(Instant, u64)>, seen: Instant, replay: u64) -> Lag {
    let mut earlier = history.iter().take_while(|(at, _)| *at <= seen).peekable();
    if earlier.peek().is_none() {
        return match history.front() {
            Some(&(_, lsn)) if lsn <= replay => (Some(0), Some(Duration::ZERO)),
            _ => (None, None),
        };
    }
    let mut ahead_since = None;
    let mut last = 0;
    for &(at, lsn) in earlier {
        if lsn > replay && ahead_since.is_none() {
            ahead_since = Some(at);
        }
        last = lsn;
    }
    let delay = ahead_since.map_or(Duration::ZERO, |at| seen.saturating_duration_since(at));
    (Some(last.saturating_sub(replay)), Some(delay))
}

/// A replication name borne by several replicas (their indices) whose rows
/// cannot be told apart.
type SharedName = (String, Vec<usize>);

/// The `sync_state` text of the primary's `pg_stat_replication` row of each
/// host (`None`: not a live replica, not streaming from the primary, or not
/// attributable), and the names that could not be attributed, with the
/// hosts that share them.
///
/// A slot ties a row to one standby, so it is matched first. A name ties a
/// row to a host only when exactly one row and one live replica carry it:
/// standbys often share a name (`walreceiver` is the default), and the
/// first row of a name says nothing about which of its bearers is
/// synchronous. A shared name still yields a state when every row of that
/// name reports the same one and no bearer can be left without a row.
fn attribute_rows<'r>(
    hosts: &[HostState],
    rows: &'r [ReplicationRow],
    cascaded: &[bool],
) -> (Vec<Option<&'r str>>, Vec<SharedName>) {
    let mut out: Vec<Option<&str>> = vec![None; hosts.len()];
    let mut row_taken = vec![false; rows.len()];
    let mut host_done = vec![false; hosts.len()];
    for (i, h) in hosts.iter().enumerate() {
        // A second name of a replica would otherwise share its name and
        // slot with it, and make its row look ambiguous; a cascading
        // replica streams from another standby, not from the server whose
        // rows these are.
        if !h.is_live_replica() || h.duplicate_of.is_some() || cascaded[i] {
            host_done[i] = true;
            continue;
        }
        let slot = h
            .observation
            .as_ref()
            .and_then(|o| o.wal_receiver_slot.as_deref());
        let Some(slot) = slot else { continue };
        if let Some(r) = rows
            .iter()
            .position(|r| r.slot_name.as_deref() == Some(slot))
        {
            out[i] = Some(rows[r].sync_state.as_str());
            row_taken[r] = true;
            host_done[i] = true;
        }
    }
    let mut ambiguous = Vec::new();
    for i in 0..hosts.len() {
        if host_done[i] {
            continue;
        }
        let Some(name) = hosts[i].replication_name() else {
            host_done[i] = true;
            continue;
        };
        let shown = ShownName::of(name);
        let bearers: Vec<usize> = (i..hosts.len())
            .filter(|&j| {
                !host_done[j]
                    && hosts[j]
                        .replication_name()
                        .is_some_and(|n| shown.same_as(&ShownName::of(n)))
            })
            .collect();
        let named: Vec<&ReplicationRow> = rows
            .iter()
            .zip(&row_taken)
            .filter(|(r, taken)| !**taken && shown.is(&r.application_name))
            .map(|(r, _)| r)
            .collect();
        for &j in &bearers {
            host_done[j] = true;
        }
        match (named.as_slice(), bearers.as_slice()) {
            ([], _) => {}
            ([row], [only]) => out[*only] = Some(row.sync_state.as_str()),
            ([first, rest @ ..], _)
                if named.len() >= bearers.len()
                    && rest.iter().all(|r| r.sync_state == first.sync_state) =>
            {
                for &j in &bearers {
                    out[j] = Some(first.sync_state.as_str());
                }
            }
            _ => ambiguous.push((name.to_string(), bearers)),
        }
    }
    (out, ambiguous)
}

/// A standby's `application_name` as the primary shows it in
/// `pg_stat_replication`: every byte outside printable ASCII replaced (by
/// `?` up to PostgreSQL 15, by `\xNN` from 16; both forms are kept, since
/// the primary's version is not probed), then cut to 63 bytes
/// (`NAMEDATALEN` - 1). Compared without regard to ASCII case, as
/// PostgreSQL compares names in `synchronous_standby_names`.
struct ShownName([String; 2]);

/// Longest `application_name` PostgreSQL keeps in a session's status.
const SHOWN_NAME_MAX: usize = 63;

impl ShownName {
    fn of(name: &str) -> Self {
        let mut marked = String::with_capacity(name.len());
        let mut escaped = String::with_capacity(name.len());
        for &b in name.as_bytes() {
            if (32..=126).contains(&b) {
                marked.push(char::from(b));
                escaped.push(char::from(b));
            } else {
                marked.push('?');
                escaped.push_str(&format!("\\x{b:02x}"));
            }
        }
        // All ASCII now, so any byte is a character boundary.
        marked.truncate(SHOWN_NAME_MAX);
        escaped.truncate(SHOWN_NAME_MAX);
        ShownName([marked, escaped])
    }

    /// Whether a row's `application_name` is this name.
    fn is(&self, row: &str) -> bool {
        self.0.iter().any(|f| f.eq_ignore_ascii_case(row))
    }

    /// Whether the primary would show both names alike.
    fn same_as(&self, other: &ShownName) -> bool {
        self.0
            .iter()
            .zip(&other.0)
            .any(|(a, b)| a.eq_ignore_ascii_case(b))
    }
}

/// Derived facts before a change, by address so that they survive a host
/// list reload that renumbers hosts.
struct Snapshot {
    primary: Option<HostAddr>,
    conflict: Vec<HostAddr>,
    sync: Vec<HostAddr>,
    quorum: bool,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::LagLimit;

    pub(crate) fn cfg(name: &str) -> HostConfig {
        HostConfig::new(HostAddr::new(name, 5432))
    }

    pub(crate) fn addr(name: &str) -> HostAddr {
        HostAddr::new(name, 5432)
    }

    pub(crate) fn primary_obs(tl: u32, lsn: u64) -> Observation {
        Observation {
            in_recovery: false,
            rtt: Duration::from_millis(1),
            timeline: Some(tl),
            current_lsn: Some(lsn),
            ..Observation::default()
        }
    }

    pub(crate) fn replica_obs(name: &str, replay: u64, rtt_ms: u64) -> Observation {
        Observation {
            in_recovery: true,
            rtt: Duration::from_millis(rtt_ms),
            timeline: Some(1),
            receive_lsn: Some(replay),
            replay_lsn: Some(replay),
            replay_delay: Some(Duration::ZERO),
            wal_receiver_name: Some(name.to_string()),
            ..Observation::default()
        }
    }

    fn row(name: &str, sync: &str) -> ReplicationRow {
        ReplicationRow {
            application_name: name.to_string(),
            state: "streaming".to_string(),
            sync_state: sync.to_string(),
            replay_lsn: None,
            slot_name: None,
        }
    }

    fn topo(names: &[&str]) -> Topology {
        Topology::new(
            names.iter().map(|n| cfg(n)).collect(),
            TopologyConfig::default(),
        )
    }

    #[test]
    fn role_from_recovery_and_events() {
        let t0 = Instant::now();
        let mut t = topo(&["p", "r"]);
        let ev = t.apply(0, ProbeResult::Ok(primary_obs(1, 100)), t0);
        assert_eq!(
            ev,
            vec![
                TopologyEvent::HostUp { host: addr("p") },
                TopologyEvent::PrimaryChanged {
                    from: None,
                    to: Some(addr("p"))
                },
            ]
        );
        let ev = t.apply(1, ProbeResult::Ok(replica_obs("r", 100, 2)), t0);
        assert_eq!(ev, vec![TopologyEvent::HostUp { host: addr("r") }]);
        assert_eq!(t.hosts()[0].role, Role::Primary);
        assert_eq!(t.hosts()[1].role, Role::Replica);
        assert_eq!(t.primary(), Some(0));
        assert_eq!(t.host(1).unwrap().last_ok, Some(t0));
        // Repeating the same observation changes nothing.
        assert!(t
            .apply(1, ProbeResult::Ok(replica_obs("r", 100, 2)), t0)
            .is_empty());
        assert!(t.host(9).is_none());
        assert!(t.apply(9, ProbeResult::Down("x".into()), t0).is_empty());
    }

    #[test]
    fn dead_host_keeps_role_and_resets_rtt() {
        let t0 = Instant::now();
        let mut t = topo(&["p", "r"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 100)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 100, 30)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 100, 10)), t0);
        let ev = t.apply(1, ProbeResult::Down("timeout".into()), t0);
        assert_eq!(
            ev,
            vec![TopologyEvent::HostDown {
                host: addr("r"),
                error: "timeout".into()
            }]
        );
        let h = &t.hosts()[1];
        assert!(!h.alive);
        assert_eq!(h.role, Role::Replica);
        assert_eq!(h.rtt.get(), None);
        assert_eq!(h.error.as_deref(), Some("timeout"));
        assert!(h.observation().is_some());
        // Further failures are not news.
        assert!(t.apply(1, ProbeResult::Down("again".into()), t0).is_empty());
        assert_eq!(t.hosts()[1].error.as_deref(), Some("again"));
        // Recovery starts the RTT estimate afresh and clears the error.
        t.apply(1, ProbeResult::Ok(replica_obs("r", 100, 7)), t0);
        assert_eq!(t.hosts()[1].rtt.get(), Some(7.0));
        assert_eq!(t.hosts()[1].error, None);
        // Primary dies: no primary, role kept.
        let ev = t.apply(0, ProbeResult::Down("refused".into()), t0);
        assert!(ev.contains(&TopologyEvent::PrimaryChanged {
            from: Some(addr("p")),
            to: None
        }));
        assert_eq!(t.primary(), None);
        assert_eq!(t.hosts()[0].role, Role::Primary);
    }

    #[test]
    fn doubtful_failures_keep_a_host_up_until_the_limit() {
        let t0 = Instant::now();
        let mut t = topo(&["p", "r"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 100)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 100, 10)), t0);
        let failed = |host: &str, failures| TopologyEvent::ProbeFailed {
            host: addr(host),
            error: "timeout".into(),
            failures,
            limit: 3,
        };
        for n in 1..=2 {
            let ev = t.apply(0, ProbeResult::Err("timeout".into()), t0);
            assert_eq!(ev, vec![failed("p", n)], "failure {n}");
            let p = &t.hosts()[0];
            assert!(p.alive);
            assert_eq!(p.failed_probes, n);
            assert_eq!(p.error.as_deref(), Some("timeout"));
            assert_eq!(p.rtt.get(), Some(1.0), "the estimate is kept");
            assert_eq!(t.primary(), Some(0), "still the primary");
        }
        // The third in a row: down, and no longer the primary.
        let ev = t.apply(0, ProbeResult::Err("timeout".into()), t0);
        assert_eq!(
            ev[0],
            TopologyEvent::HostDown {
                host: addr("p"),
                error: "timeout".into()
            }
        );
        assert!(!t.hosts()[0].alive);
        assert_eq!(t.primary(), None);
        // An answer clears the count.
        t.apply(0, ProbeResult::Ok(primary_obs(1, 100)), t0);
        assert_eq!(t.hosts()[0].failed_probes, 0);
        assert_eq!(t.hosts()[0].error, None);
        // Failures must be in a row.
        for _ in 0..2 {
            t.apply(1, ProbeResult::Err("timeout".into()), t0);
        }
        t.apply(1, ProbeResult::Ok(replica_obs("r", 100, 10)), t0);
        for n in 1..=2 {
            assert_eq!(
                t.apply(1, ProbeResult::Err("timeout".into()), t0),
                vec![failed("r", n)]
            );
        }
        assert!(t.hosts()[1].alive);
    }

    #[test]
    fn a_certain_failure_or_a_limit_of_one_downs_a_host_at_once() {
        let t0 = Instant::now();
        let mut t = topo(&["p", "r"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 100)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 100, 10)), t0);
        // A doubtful failure first, then the server says it is shutting down.
        t.apply(1, ProbeResult::Err("timeout".into()), t0);
        let ev = t.apply(1, ProbeResult::Down("shutting down".into()), t0);
        assert_eq!(
            ev,
            vec![TopologyEvent::HostDown {
                host: addr("r"),
                error: "shutting down".into()
            }]
        );
        assert!(!t.hosts()[1].alive);
        // A host never seen up is down from its first failure, whatever kind.
        let mut fresh = topo(&["a"]);
        let ev = fresh.apply(0, ProbeResult::Err("timeout".into()), t0);
        assert_eq!(
            ev,
            vec![TopologyEvent::HostDown {
                host: addr("a"),
                error: "timeout".into()
            }]
        );
        assert!(!fresh.hosts()[0].alive);
        // With a limit of one, every failure counts at once.
        let mut strict = Topology::new(
            vec![cfg("p")],
            TopologyConfig {
                down_after_failures: 1,
                ..TopologyConfig::default()
            },
        );
        strict.apply(0, ProbeResult::Ok(primary_obs(1, 100)), t0);
        let ev = strict.apply(0, ProbeResult::Err("timeout".into()), t0);
        assert_eq!(
            ev[0],
            TopologyEvent::HostDown {
                host: addr("p"),
                error: "timeout".into()
            }
        );
        assert_eq!(strict.primary(), None);
    }

    #[test]
    fn first_probe_failure_is_reported() {
        let mut t = topo(&["a"]);
        let ev = t.apply(0, ProbeResult::Down("no route".into()), Instant::now());
        assert_eq!(
            ev,
            vec![TopologyEvent::HostDown {
                host: addr("a"),
                error: "no route".into()
            }]
        );
        assert_eq!(t.hosts()[0].role, Role::Unknown);
    }

    #[test]
    fn a_promotion_seen_first_under_the_second_name_counts() {
        let t0 = Instant::now();
        let replica = ided(replica_obs("r", 100, 1), 2000, 5433);
        let promoted = ided(primary_obs(2, 200), 2000, 5433);
        let stale = ided(primary_obs(1, 100), 1000, 5432);
        // The old primary still runs; the replica, listed as r and r-alias,
        // is promoted, and r-alias is probed first.
        let setup = |gate: PrimaryGate| {
            let mut t = topo(&["old", "r", "r-alias"]);
            t.set_primary_gate(gate);
            t.apply(0, ProbeResult::Ok(stale.clone()), t0);
            t.apply(1, ProbeResult::Ok(replica.clone()), t0);
            t.apply(2, ProbeResult::Ok(replica.clone()), t0);
            t
        };

        // Standalone: the new timeline wins at once, not the stale primary.
        let mut t = setup(PrimaryGate::Open);
        assert_eq!(t.primary(), Some(0));
        t.apply(2, ProbeResult::Ok(promoted.clone()), t0);
        assert_eq!(t.primary(), Some(2));
        assert!(!t.conflict());
        t.apply(1, ProbeResult::Ok(promoted.clone()), t0);
        assert_eq!(t.primary(), Some(1));

        // Under the leader key, naming r: r-alias is the key holder's
        // server, not a rogue, and takes the writes until r is probed.
        let mut t = setup(PrimaryGate::Leader(Some(addr("r"))));
        let ev = t.apply(2, ProbeResult::Ok(promoted.clone()), t0);
        assert!(
            !ev.contains(&TopologyEvent::PrimaryWithoutKey {
                host: addr("r-alias")
            }),
            "{ev:?}"
        );
        assert_eq!(t.primary(), Some(2));
        t.apply(1, ProbeResult::Ok(promoted), t0);
        assert_eq!(t.primary(), Some(1));
        // The old primary is the rogue it is.
        assert_eq!(t.rogues, vec![addr("old")]);
    }

    #[test]
    fn leader_gate_admits_only_the_key_holder_and_fails_closed() {
        let t0 = Instant::now();
        let mut t = topo(&["a", "b", "c"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 100)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("b", 100, 1)), t0);
        t.apply(2, ProbeResult::Ok(primary_obs(2, 100)), t0);
        // Open: the higher timeline wins.
        assert_eq!(t.primary(), Some(2));
        // The key names "a": the timeline no longer matters, "c" is a rogue.
        let ev = t.set_primary_gate(PrimaryGate::Leader(Some(addr("a"))));
        assert!(ev.contains(&TopologyEvent::PrimaryWithoutKey { host: addr("c") }));
        assert!(ev.contains(&TopologyEvent::PrimaryChanged {
            from: Some(addr("c")),
            to: Some(addr("a"))
        }));
        assert_eq!(t.primary(), Some(0));
        assert!(!t.conflict());
        // The rogue is reported once, not on every probe.
        let ev = t.apply(2, ProbeResult::Ok(primary_obs(2, 100)), t0);
        assert!(ev.is_empty(), "{ev:?}");
        // The key holder is still a replica: nothing is primary.
        t.set_primary_gate(PrimaryGate::Leader(Some(addr("b"))));
        assert_eq!(t.primary(), None);
        t.apply(1, ProbeResult::Ok(primary_obs(3, 200)), t0);
        assert_eq!(t.primary(), Some(1));
        // No known key holder: fail closed although hosts claim primary.
        let ev = t.set_primary_gate(PrimaryGate::Leader(None));
        assert_eq!(t.primary(), None);
        assert!(ev.contains(&TopologyEvent::PrimaryChanged {
            from: Some(addr("b")),
            to: None
        }));
        assert_eq!(t.primary_gate(), &PrimaryGate::Leader(None));
        // Back to standalone: probes decide again.
        t.set_primary_gate(PrimaryGate::Open);
        assert_eq!(t.primary(), Some(1));
    }

    #[test]
    fn primary_resolution_by_timeline() {
        let t0 = Instant::now();
        // (timeline of a, timeline of b, expected primary, conflict)
        type Case = (Option<u32>, Option<u32>, Option<usize>, bool);
        let table: &[Case] = &[
            (Some(1), Some(2), Some(1), false),
            (Some(3), Some(2), Some(0), false),
            (Some(2), Some(2), None, true),
            (None, Some(2), None, true),
            (None, None, None, true),
        ];
        for &(ta, tb, want, conflict) in table {
            let mut t = topo(&["a", "b"]);
            let mut oa = primary_obs(0, 1);
            oa.timeline = ta;
            let mut ob = primary_obs(0, 1);
            ob.timeline = tb;
            t.apply(0, ProbeResult::Ok(oa), t0);
            let ev = t.apply(1, ProbeResult::Ok(ob), t0);
            assert_eq!(t.primary(), want, "{ta:?} {tb:?}");
            assert_eq!(t.conflict(), conflict, "{ta:?} {tb:?}");
            if conflict {
                assert!(ev.contains(&TopologyEvent::PrimaryConflict {
                    hosts: vec![addr("a"), addr("b")]
                }));
                assert!(ev.contains(&TopologyEvent::PrimaryChanged {
                    from: Some(addr("a")),
                    to: None
                }));
                assert_eq!(t.conflict_hosts(), &[0, 1]);
            }
        }
    }

    #[test]
    fn promotion_reports_role_and_primary_change() {
        let t0 = Instant::now();
        let mut t = topo(&["a", "b"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 100)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("b", 100, 1)), t0);
        let ev = t.apply(1, ProbeResult::Ok(primary_obs(2, 200)), t0);
        assert_eq!(
            ev,
            vec![
                TopologyEvent::RoleChanged {
                    host: addr("b"),
                    from: Role::Replica,
                    to: Role::Primary
                },
                TopologyEvent::PrimaryChanged {
                    from: Some(addr("a")),
                    to: Some(addr("b"))
                },
            ]
        );
        assert!(!t.conflict());
    }

    #[test]
    fn lag_is_computed() {
        let t0 = Instant::now();
        let mut t = topo(&["p", "r1", "r2"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 1000)), t0);
        // The replica's own estimate is not what counts.
        let mut o = replica_obs("r1", 400, 1);
        o.replay_delay = Some(Duration::from_secs(99));
        t.apply(1, ProbeResult::Ok(o), t0 + Duration::from_millis(1500));
        let mut o = replica_obs("r2", 0, 1);
        o.replay_lsn = None;
        o.min_apply_delay = Duration::from_secs(3600);
        t.apply(2, ProbeResult::Ok(o), t0);
        assert_eq!(t.hosts()[1].lag_bytes, Some(600));
        assert_eq!(t.hosts()[1].replay_delay, Some(Duration::from_millis(1500)));
        assert!(!t.hosts()[1].delayed);
        assert_eq!(t.hosts()[2].lag_bytes, None);
        assert!(t.hosts()[2].delayed);
        assert_eq!(t.hosts()[0].lag_bytes, None);
        // A replica ahead of a stale primary reading is not negative.
        t.apply(1, ProbeResult::Ok(replica_obs("r1", 5000, 1)), t0);
        assert_eq!(t.hosts()[1].lag_bytes, Some(0));
        assert_eq!(t.hosts()[1].replay_delay, Some(Duration::ZERO));
        // Without a primary the lag is unknown.
        t.apply(0, ProbeResult::Down("down".into()), t0);
        assert_eq!(t.hosts()[1].lag_bytes, None);
    }

    fn sync_cluster(
        ssn_text: Option<&str>,
        rows: Vec<ReplicationRow>,
    ) -> (Topology, Vec<TopologyEvent>) {
        let t0 = Instant::now();
        let mut hosts: Vec<HostConfig> = ["p", "r1", "r2", "r3"].iter().map(|n| cfg(n)).collect();
        hosts[3].application_name = Some("Custom".into());
        let mut t = Topology::new(hosts, TopologyConfig::default());
        t.apply(1, ProbeResult::Ok(replica_obs("r1", 1, 1)), t0);
        t.apply(2, ProbeResult::Ok(replica_obs("R2", 1, 1)), t0);
        t.apply(3, ProbeResult::Ok(replica_obs("ignored", 1, 1)), t0);
        let mut p = primary_obs(1, 1);
        p.synchronous_standby_names = ssn_text.map(str::to_string);
        p.replication = rows;
        let ev = t.apply(0, ProbeResult::Ok(p), t0);
        (t, ev)
    }

    fn states(t: &Topology) -> Vec<Option<SyncState>> {
        t.hosts().iter().map(|h| h.sync_state).collect()
    }

    /// Names as the primary shows them: cut to 63 bytes, bytes outside
    /// printable ASCII replaced (`?` in PostgreSQL 15, `\xNN` from 16).
    #[test]
    fn long_and_non_ascii_names_match_as_the_primary_shows_them() {
        use SyncState::*;
        let long = format!("standby-{}", "x".repeat(70));
        let t0 = Instant::now();
        for (names, rows, want) in [
            (
                [long.as_str(), "nœud-2"],
                vec![row(&long[..63], "sync"), row("n??ud-2", "potential")],
                [None, Some(Sync), Some(Potential)],
            ),
            (
                [long.as_str(), "nœud-2"],
                vec![
                    row(&long[..63].to_uppercase(), "sync"),
                    row("n\\xc5\\x93ud-2", "async"),
                ],
                [None, Some(Sync), Some(Async)],
            ),
        ] {
            let mut t = topo(&["p", "r1", "r2"]);
            t.apply(1, ProbeResult::Ok(replica_obs(names[0], 1, 1)), t0);
            t.apply(2, ProbeResult::Ok(replica_obs(names[1], 1, 1)), t0);
            let mut p = primary_obs(1, 1);
            p.synchronous_standby_names = Some("FIRST 1 (*)".into());
            p.replication = rows;
            t.apply(0, ProbeResult::Ok(p), t0);
            assert_eq!(states(&t), want);
        }
        // Two names alike in their first 63 bytes are one name to the
        // primary: which of the two is synchronous cannot be told.
        let mut t = topo(&["p", "r1", "r2"]);
        t.apply(
            1,
            ProbeResult::Ok(replica_obs(&format!("{long}-a"), 1, 1)),
            t0,
        );
        t.apply(
            2,
            ProbeResult::Ok(replica_obs(&format!("{long}-b"), 1, 1)),
            t0,
        );
        let mut p = primary_obs(1, 1);
        p.synchronous_standby_names = Some("FIRST 1 (*)".into());
        p.replication = vec![row(&long[..63], "sync"), row(&long[..63], "potential")];
        t.apply(0, ProbeResult::Ok(p), t0);
        assert_eq!(states(&t), [None, None, None]);
    }

    #[test]
    fn sync_marking() {
        use SyncState::*;
        let (t, ev) = sync_cluster(
            Some("FIRST 1 (r1, r2, custom)"),
            vec![
                row("r1", "sync"),
                row("r2", "potential"),
                row("custom", "potential"),
            ],
        );
        assert_eq!(
            states(&t),
            [None, Some(Sync), Some(Potential), Some(Potential)]
        );
        assert!(!t.quorum_commit());
        assert_eq!(t.sync_standby_names().unwrap().num_sync, 1);
        assert!(ev.contains(&TopologyEvent::SyncSetChanged {
            sync: vec![addr("r1")],
            quorum: false
        }));

        let (t, ev) = sync_cluster(
            Some("ANY 2 (*)"),
            vec![
                row("r1", "quorum"),
                row("R2", "quorum"),
                row("CUSTOM", "quorum"),
            ],
        );
        assert_eq!(states(&t), [None, Some(Quorum), Some(Quorum), Some(Quorum)]);
        assert!(t.quorum_commit());
        assert_eq!(t.sync_set(), &[1, 2, 3]);
        assert!(ev.contains(&TopologyEvent::SyncSetChanged {
            sync: vec![addr("r1"), addr("r2"), addr("r3")],
            quorum: true
        }));

        // Missing row: no state. Empty setting: async whatever the row says.
        let (t, _) = sync_cluster(Some(""), vec![row("r1", "sync")]);
        assert_eq!(states(&t), [None, Some(Async), None, None]);
        assert!(t.sync_standby_names().is_none());
        let (t, ev) = sync_cluster(None, vec![row("r2", "async")]);
        assert_eq!(states(&t), [None, None, Some(Async), None]);
        assert!(!ev
            .iter()
            .any(|e| matches!(e, TopologyEvent::SyncSetChanged { .. })));
    }

    /// A primary "p" and replicas "a", "b", "c", all reporting `name`.
    fn twins(
        rows: Vec<ReplicationRow>,
        slots: [Option<&str>; 3],
    ) -> (Topology, Vec<TopologyEvent>) {
        let t0 = Instant::now();
        let mut t = topo(&["p", "a", "b", "c"]);
        for (i, slot) in slots.into_iter().enumerate() {
            let mut o = replica_obs("walreceiver", 1, 1);
            o.wal_receiver_slot = slot.map(str::to_string);
            t.apply(i + 1, ProbeResult::Ok(o), t0);
        }
        let mut p = primary_obs(1, 1);
        p.synchronous_standby_names = Some("FIRST 1 (walreceiver)".into());
        p.replication = rows;
        let ev = t.apply(0, ProbeResult::Ok(p), t0);
        (t, ev)
    }

    fn slotted(name: &str, sync: &str, slot: &str) -> ReplicationRow {
        ReplicationRow {
            slot_name: Some(slot.to_string()),
            ..row(name, sync)
        }
    }

    #[test]
    fn shared_replication_names_are_not_guessed() {
        use SyncState::*;
        // Three standbys named alike, one sync: PostgreSQL's rows cannot say
        // which, so nobody is sync, and that is reported once.
        let rows = vec![
            row("walreceiver", "sync"),
            row("WalReceiver", "potential"),
            row("walreceiver", "potential"),
        ];
        let (mut t, ev) = twins(rows.clone(), [None; 3]);
        assert_eq!(states(&t), [None, None, None, None]);
        assert!(t.sync_set().is_empty());
        assert!(ev.contains(&TopologyEvent::SyncAmbiguous {
            name: "walreceiver".into(),
            hosts: vec![addr("a"), addr("b"), addr("c")],
        }));
        let mut p = t.host(0).unwrap().observation().unwrap().clone();
        let ev = t.apply(0, ProbeResult::Ok(p.clone()), Instant::now());
        assert!(ev.is_empty(), "{ev:?}");
        assert!(TopologyEvent::SyncAmbiguous {
            name: "walreceiver".into(),
            hosts: vec![addr("a")],
        }
        .to_string()
        .contains("walreceiver"));

        // All rows agree: the state holds whichever row is whose.
        p.replication = vec![
            row("walreceiver", "async"),
            row("walreceiver", "async"),
            row("walreceiver", "async"),
        ];
        t.apply(0, ProbeResult::Ok(p.clone()), Instant::now());
        assert_eq!(states(&t), [None, Some(Async), Some(Async), Some(Async)]);
        // ... unless a bearer may have no row at all.
        p.replication.pop();
        t.apply(0, ProbeResult::Ok(p), Instant::now());
        assert_eq!(states(&t), [None, None, None, None]);

        // Slots tie rows to standbys, whatever the names.
        let (t, ev) = twins(
            vec![
                slotted("walreceiver", "potential", "sa"),
                slotted("walreceiver", "sync", "sb"),
                row("walreceiver", "potential"),
            ],
            [Some("sa"), Some("sb"), None],
        );
        assert_eq!(
            states(&t),
            [None, Some(Potential), Some(Sync), Some(Potential)]
        );
        assert_eq!(t.sync_set(), &[2]);
        assert!(!ev
            .iter()
            .any(|e| matches!(e, TopologyEvent::SyncAmbiguous { .. })));
    }

    #[test]
    fn a_cascading_replica_bears_none_of_the_primarys_rows() {
        use SyncState::*;
        let t0 = Instant::now();
        let mut t = at(&["127.0.0.1:5432", "127.0.0.1:5433", "127.0.0.1:5434"]);
        // "a" streams from the primary; "b" streams from "a", under the
        // same name, so the primary lists one row of that name.
        let mut a = reached_at(replica_obs("walreceiver", 1, 1), "127.0.0.1");
        a.upstream = Some(HostAddr::new("127.0.0.1", 5432));
        t.apply(1, ProbeResult::Ok(a), t0);
        let mut b = reached_at(replica_obs("walreceiver", 1, 1), "127.0.0.1");
        b.upstream = Some(HostAddr::new("localhost", 5433));
        t.apply(2, ProbeResult::Ok(b.clone()), t0);
        let mut p = reached_at(primary_obs(1, 1), "127.0.0.1");
        p.synchronous_standby_names = Some("FIRST 1 (walreceiver)".into());
        p.replication = vec![row("walreceiver", "sync")];
        let ev = t.apply(0, ProbeResult::Ok(p), t0);
        assert_eq!(states(&t), [None, Some(Sync), None]);
        assert_eq!(t.sync_set(), &[1]);
        assert!(!ev
            .iter()
            .any(|e| matches!(e, TopologyEvent::SyncAmbiguous { .. })));
        // The same replica seen streaming from the primary: the name is
        // shared again and says nothing.
        b.upstream = Some(HostAddr::new("127.0.0.1", 5432));
        t.apply(2, ProbeResult::Ok(b), t0);
        assert_eq!(states(&t), [None, None, None]);
    }

    #[test]
    fn invalid_sync_config_is_reported_once() {
        let (mut t, ev) = sync_cluster(Some("FIRST 1 (r1"), vec![row("r1", "sync")]);
        assert!(ev.iter().any(|e| matches!(e,
            TopologyEvent::SyncConfigInvalid { value, .. } if value == "FIRST 1 (r1")));
        assert!(t.ssn_error().is_some());
        assert_eq!(t.hosts()[1].sync_state, Some(SyncState::Async));
        let mut p = primary_obs(1, 1);
        p.synchronous_standby_names = Some("FIRST 1 (r1".into());
        let ev = t.apply(0, ProbeResult::Ok(p.clone()), Instant::now());
        assert!(ev.is_empty(), "{ev:?}");
        p.synchronous_standby_names = Some("r1".into());
        p.replication = vec![row("r1", "sync")];
        let ev = t.apply(0, ProbeResult::Ok(p), Instant::now());
        assert_eq!(t.ssn_error(), None);
        assert_eq!(
            ev,
            vec![TopologyEvent::SyncSetChanged {
                sync: vec![addr("r1")],
                quorum: false
            }]
        );
    }

    fn lag_topo(hold: Duration) -> Topology {
        Topology::new(
            vec![cfg("p"), cfg("r")],
            TopologyConfig {
                max_replica_lag: Some(LagLimit {
                    bytes: Some(100),
                    time: None,
                }),
                lag_hold: hold,
                ..TopologyConfig::default()
            },
        )
    }

    #[test]
    fn lag_hysteresis() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut t = lag_topo(s(10));
        t.apply(0, ProbeResult::Ok(primary_obs(1, 1000)), t0);
        // Within the limit and never excluded: included at once.
        let ev = t.apply(1, ProbeResult::Ok(replica_obs("r", 950, 1)), t0);
        assert_eq!(ev, vec![TopologyEvent::HostUp { host: addr("r") }]);
        assert!(!t.hosts()[1].lag_excluded);

        // (seconds since t0, replay lsn, expect excluded, expected event)
        #[derive(Debug, PartialEq)]
        enum E {
            None,
            Excluded,
            Readmitted,
        }
        let steps: &[(u64, u64, bool, E)] = &[
            (1, 800, true, E::Excluded),
            (2, 990, true, E::None),
            (8, 990, true, E::None),
            (9, 850, true, E::None), // excursion restarts the hold
            (10, 990, true, E::None),
            (19, 990, true, E::None),
            (20, 990, false, E::Readmitted),
            (21, 990, false, E::None),
            (22, 899, true, E::Excluded),
        ];
        for (secs, lsn, excluded, want) in steps {
            let ev = t.apply(1, ProbeResult::Ok(replica_obs("r", *lsn, 1)), t0 + s(*secs));
            assert_eq!(t.hosts()[1].lag_excluded, *excluded, "t={secs}");
            let got = match ev.as_slice() {
                [] => E::None,
                [TopologyEvent::LagExcluded { lag_bytes, .. }] => {
                    assert_eq!(*lag_bytes, Some(1000 - lsn));
                    E::Excluded
                }
                [TopologyEvent::LagReadmitted { .. }] => E::Readmitted,
                other => panic!("t={secs}: {other:?}"),
            };
            assert_eq!(&got, want, "t={secs}");
        }
    }

    #[test]
    fn an_excluded_replica_is_not_readmitted_while_its_lag_is_unknown() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut t = lag_topo(s(10));
        t.apply(0, ProbeResult::Ok(primary_obs(1, 5000)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 100, 1)), t0);
        assert!(t.hosts()[1].lag_excluded);
        // The primary goes down: nothing to measure the replica against.
        t.apply(0, ProbeResult::Down("down".into()), t0 + s(1));
        for secs in [2, 5, 12, 30] {
            t.apply(1, ProbeResult::Ok(replica_obs("r", 100, 1)), t0 + s(secs));
            assert_eq!(t.hosts()[1].lag_bytes, None, "t={secs}");
            assert!(
                t.hosts()[1].lag_excluded,
                "readmitted at t={secs} on unknown lag"
            );
        }
    }

    #[test]
    fn lag_primary_advance_excludes_and_no_limit_clears() {
        let t0 = Instant::now();
        let mut t = lag_topo(Duration::ZERO);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 1000, 1)), t0);
        // A primary position seen no later than the replica's own reading
        // is enough to exclude the replica.
        let ev = t.apply(0, ProbeResult::Ok(primary_obs(1, 2000)), t0);
        assert!(ev
            .iter()
            .any(|e| matches!(e, TopologyEvent::LagExcluded { .. })));
        assert!(t.hosts()[1].lag_excluded);
        // A dead excluded replica stays excluded.
        t.apply(1, ProbeResult::Down("gone".into()), t0);
        assert!(t.hosts()[1].lag_excluded);
        // Zero hold readmits on the first good reading.
        let ev = t.apply(1, ProbeResult::Ok(replica_obs("r", 2000, 1)), t0);
        assert!(ev.contains(&TopologyEvent::LagReadmitted { host: addr("r") }));
        t.apply(1, ProbeResult::Ok(replica_obs("r", 0, 1)), t0);
        assert!(t.hosts()[1].lag_excluded);
        t.set_config(TopologyConfig::default());
        let ev = t.apply(1, ProbeResult::Ok(replica_obs("r", 0, 1)), t0);
        assert!(!t.hosts()[1].lag_excluded);
        assert!(ev.contains(&TopologyEvent::LagReadmitted { host: addr("r") }));
    }

    #[test]
    fn steady_writes_do_not_make_replicas_look_behind() {
        // 500 ms probes, 1.75 MB of WAL per interval, replicas truly 100 kB
        // behind and probed a few milliseconds after the primary: the
        // primary's next position must not be held against their last one.
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut t = Topology::new(
            vec![cfg("p"), cfg("r1"), cfg("r2")],
            TopologyConfig {
                max_replica_lag: Some(LagLimit {
                    bytes: Some(600_000),
                    time: None,
                }),
                lag_hold: Duration::from_secs(3),
                ..TopologyConfig::default()
            },
        );
        let per_round = 1_750_000u64;
        for k in 1..40u64 {
            let round = t0 + ms(500 * k);
            let ev = t.apply(0, ProbeResult::Ok(primary_obs(1, k * per_round)), round);
            assert!(
                !ev.iter()
                    .any(|e| matches!(e, TopologyEvent::LagExcluded { .. })),
                "round {k}: {ev:?}"
            );
            for (i, name) in [(1, "r1"), (2, "r2")] {
                let replay = k * per_round - 100_000;
                let at = round + ms(3 * i as u64);
                t.apply(i, ProbeResult::Ok(replica_obs(name, replay, 1)), at);
                assert_eq!(t.hosts()[i].lag_bytes, Some(100_000), "round {k}");
            }
            assert!(t.hosts().iter().all(|h| !h.lag_excluded), "round {k}");
        }
        // A replica that answered before the primary's first reading has no
        // fair comparison yet: unknown, not the whole WAL.
        let mut t = lag_topo(Duration::ZERO);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 10, 1)), t0);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 5000)), t0 + ms(1));
        assert_eq!(t.hosts()[1].lag_bytes, None);
        assert!(!t.hosts()[1].lag_excluded);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 10, 1)), t0 + ms(2));
        assert_eq!(t.hosts()[1].lag_bytes, Some(4990));
        assert!(t.hosts()[1].lag_excluded);
    }

    #[test]
    fn a_replica_whose_receiver_is_down_keeps_its_last_timeline() {
        let t0 = Instant::now();
        let mut t = topo(&["p", "r"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 5000)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 4000, 1)), t0);
        assert_eq!(t.hosts()[1].off_primary, None);
        // A new primary on timeline 2 that the replica cannot follow: its
        // WAL receiver keeps failing, so the probe sees no timeline.
        t.apply(
            0,
            ProbeResult::Ok(primary_obs(2, 6000)),
            t0 + Duration::from_millis(1),
        );
        let mut down = replica_obs("r", 4000, 1);
        down.timeline = None;
        down.wal_receiver_name = None;
        t.apply(1, ProbeResult::Ok(down), t0 + Duration::from_millis(2));
        assert_eq!(t.hosts()[1].timeline, Some(1));
        let reason = t.hosts()[1].off_primary.clone().expect("flagged");
        assert!(reason.contains("timeline 1"), "{reason}");
    }

    /// The primary chosen is an old one whose successor went down: a
    /// replica that followed the successor onto its timeline cannot stream
    /// from it, whatever its positions say.
    #[test]
    fn a_replica_on_a_later_timeline_than_the_primary_is_flagged() {
        let t0 = Instant::now();
        let mut t = topo(&["old", "r"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 5000)), t0);
        let mut r = replica_obs("r", 4000, 1);
        r.timeline = Some(2);
        t.apply(1, ProbeResult::Ok(r), t0);
        assert_eq!(t.primary(), Some(0));
        let reason = t.hosts()[1].off_primary.clone().expect("flagged");
        assert!(reason.contains("on timeline 2"), "{reason}");
        assert_eq!(t.hosts()[1].lag_bytes, None);
        let sel = crate::Selector::default();
        assert_eq!(sel.eligible(&t, &crate::Want::Replica), [0]);
    }

    /// Without a primary to compare against, a replica found on a
    /// dead-end fork is not let back in.
    #[test]
    fn a_flag_outlasts_the_primary() {
        let t0 = Instant::now();
        let mut t = topo(&["new", "r", "other"]);
        t.apply(0, ProbeResult::Ok(primary_obs(2, 5000)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 4000, 1)), t0);
        let reason = t.hosts()[1].off_primary.clone().expect("flagged");
        // The primary goes down: nothing says the replica is right now.
        t.apply(0, ProbeResult::Down("gone".into()), t0);
        assert_eq!(t.primary(), None);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 4000, 1)), t0);
        assert_eq!(t.hosts()[1].off_primary.as_ref(), Some(&reason));
        // Two primaries on one timeline: none resolved, still flagged.
        t.apply(0, ProbeResult::Ok(primary_obs(2, 5000)), t0);
        t.apply(2, ProbeResult::Ok(primary_obs(2, 5000)), t0);
        assert!(t.conflict());
        t.apply(1, ProbeResult::Ok(replica_obs("r", 4000, 1)), t0);
        assert_eq!(t.hosts()[1].off_primary.as_ref(), Some(&reason));
        let sel = crate::Selector::default();
        assert!(!sel.eligible(&t, &crate::Want::Replica).contains(&1));
        // Promoted, it is no replica and carries no flag.
        t.apply(2, ProbeResult::Down("gone".into()), t0);
        t.apply(0, ProbeResult::Down("gone".into()), t0);
        t.apply(1, ProbeResult::Ok(primary_obs(3, 4000)), t0);
        assert_eq!(t.hosts()[1].off_primary, None);
        assert_eq!(t.primary(), Some(1));

        // A primary taken out of the configuration is nothing to be
        // behind: the flag goes with it.
        let mut t = topo(&["new", "r"]);
        t.apply(0, ProbeResult::Ok(primary_obs(2, 5000)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 4000, 1)), t0);
        assert!(t.hosts()[1].off_primary.is_some());
        t.apply(0, ProbeResult::Down("gone".into()), t0);
        assert!(t.hosts()[1].off_primary.is_some());
        t.set_hosts(vec![cfg("r")]);
        assert_eq!(t.hosts()[0].off_primary, None);

        // A replica ahead of the primary chosen (which it cannot follow)
        // may hold the newest data: once that primary is gone, it is
        // flagged no more.
        let mut t = topo(&["old", "r"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 5000)), t0);
        let mut ahead = replica_obs("r", 4000, 1);
        ahead.timeline = Some(2);
        t.apply(1, ProbeResult::Ok(ahead.clone()), t0);
        assert!(t.hosts()[1].off_primary.is_some());
        t.apply(0, ProbeResult::Down("stopped".into()), t0);
        t.apply(1, ProbeResult::Ok(ahead), t0);
        assert_eq!(t.hosts()[1].off_primary, None);
    }

    #[test]
    fn replicas_not_following_the_primary_are_flagged() {
        let t0 = Instant::now();
        let mut t = topo(&["old", "new", "r"]);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 5000)), t0);
        t.apply(1, ProbeResult::Ok(primary_obs(2, 3000)), t0);
        // Still streaming from the old primary, ahead of the new one.
        let mut o = replica_obs("r", 4000, 1);
        o.upstream = Some(HostAddr::new("OLD", 5432));
        let ev = t.apply(2, ProbeResult::Ok(o.clone()), t0);
        assert_eq!(t.primary(), Some(1));
        let reason = t.hosts()[2].off_primary.clone().expect("flagged");
        assert!(reason.contains("timeline 1"), "{reason}");
        assert!(ev.contains(&TopologyEvent::OffPrimary {
            host: addr("r"),
            reason: reason.clone()
        }));
        // Its positions are not comparable with the new primary's.
        assert_eq!(t.hosts()[2].lag_bytes, None);
        let sel = crate::Selector::default();
        assert_eq!(sel.eligible(&t, &crate::Want::Replica), [1]);
        // Reported once.
        assert!(t.apply(2, ProbeResult::Ok(o.clone()), t0).is_empty());

        // On the new timeline but fed by the old primary: still flagged.
        o.timeline = Some(2);
        t.apply(2, ProbeResult::Ok(o.clone()), t0);
        let reason = t.hosts()[2].off_primary.clone().expect("flagged");
        assert!(reason.contains("streams from old:5432"), "{reason}");

        // Following the new primary: back in.
        o.upstream = Some(HostAddr::new("new", 5432));
        let ev = t.apply(2, ProbeResult::Ok(o), t0);
        assert_eq!(t.hosts()[2].off_primary, None);
        assert!(ev.contains(&TopologyEvent::OnPrimary { host: addr("r") }));
        assert_eq!(sel.eligible(&t, &crate::Want::Replica), [2]);
        assert!(TopologyEvent::OffPrimary {
            host: addr("r"),
            reason: "x".into()
        }
        .to_string()
        .contains("no read traffic"));
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Hosts at `host:port` addresses; each is reached at its own host.
    fn at(addrs: &[&str]) -> Topology {
        let hosts = addrs.iter().map(|a| HostConfig::new(a.parse().unwrap()));
        Topology::new(hosts.collect(), TopologyConfig::default())
    }

    fn reached_at(mut o: Observation, server_ip: &str) -> Observation {
        o.server_ip = Some(ip(server_ip));
        o
    }

    #[test]
    fn upstream_is_found_whatever_it_is_called() {
        let t0 = Instant::now();
        // The key holder, and a rogue primary on a later timeline.
        let mut t = at(&["127.0.0.1:5432", "127.0.0.1:5433", "127.0.0.1:5434"]);
        t.set_primary_gate(PrimaryGate::Leader(Some("127.0.0.1:5432".parse().unwrap())));
        t.apply(
            0,
            ProbeResult::Ok(reached_at(primary_obs(1, 100), "127.0.0.1")),
            t0,
        );
        t.apply(
            1,
            ProbeResult::Ok(reached_at(primary_obs(2, 100), "127.0.0.1")),
            t0,
        );
        // The replica streams from the rogue, which it calls localhost.
        let mut r = reached_at(replica_obs("r", 100, 1), "127.0.0.1");
        r.timeline = Some(2);
        r.upstream = Some(HostAddr::new("localhost", 5433));
        let ev = t.apply(2, ProbeResult::Ok(r.clone()), t0);
        let reason = t.hosts()[2].off_primary.clone().expect("flagged");
        assert_eq!(
            reason,
            "streams from 127.0.0.1:5433, which is not the primary 127.0.0.1:5432"
        );
        assert!(ev.contains(&TopologyEvent::OffPrimary {
            host: "127.0.0.1:5434".parse().unwrap(),
            reason
        }));
        // A DNS name, at the address the prober resolved it to.
        r.upstream = Some(HostAddr::new("rogue.example", 5433));
        r.upstream_ips = vec![ip("::1"), ip("127.0.0.1")];
        t.apply(2, ProbeResult::Ok(r.clone()), t0);
        assert!(t.hosts()[2].off_primary.is_some());
        // Unresolved, the name says nothing: not flagged (on the key
        // holder's timeline; a later one alone would flag it).
        r.timeline = Some(1);
        t.apply(2, ProbeResult::Ok(r.clone()), t0);
        assert!(t.hosts()[2].off_primary.is_some(), "still fed by the rogue");
        r.upstream_ips.clear();
        t.apply(2, ProbeResult::Ok(r.clone()), t0);
        assert_eq!(t.hosts()[2].off_primary, None);
        // The key holder under another name is the key holder.
        r.upstream = Some(HostAddr::new("LocalHost", 5432));
        t.apply(2, ProbeResult::Ok(r.clone()), t0);
        assert_eq!(t.hosts()[2].off_primary, None);
        r.upstream = Some(HostAddr::new("/run/postgresql", 5433));
        t.apply(2, ProbeResult::Ok(r), t0);
        assert!(t.hosts()[2].off_primary.is_some());
    }

    #[test]
    fn a_loopback_upstream_is_on_the_replica_machine() {
        let t0 = Instant::now();
        let mut t = at(&["10.0.0.1:5432", "127.0.0.1:5433", "10.0.0.3:5432"]);
        t.set_primary_gate(PrimaryGate::Leader(Some("10.0.0.1:5432".parse().unwrap())));
        t.apply(
            0,
            ProbeResult::Ok(reached_at(primary_obs(1, 100), "10.0.0.1")),
            t0,
        );
        // A rogue primary on the prober's machine.
        t.apply(
            1,
            ProbeResult::Ok(reached_at(primary_obs(1, 100), "127.0.0.1")),
            t0,
        );
        // The replica's 127.0.0.1 is its own machine, not the prober's: it
        // streams from an unlisted server there.
        let mut r = reached_at(replica_obs("r", 100, 1), "10.0.0.3");
        r.upstream = Some(HostAddr::new("127.0.0.1", 5433));
        r.upstream_ips = vec![ip("127.0.0.1")];
        t.apply(2, ProbeResult::Ok(r.clone()), t0);
        assert_eq!(t.hosts()[2].off_primary, None);

        // Listed, the server on the replica's machine is known.
        let mut t = at(&["10.0.0.1:5432", "10.0.0.3:5433", "10.0.0.3:5432"]);
        t.set_primary_gate(PrimaryGate::Leader(Some("10.0.0.1:5432".parse().unwrap())));
        t.apply(
            0,
            ProbeResult::Ok(reached_at(primary_obs(1, 100), "10.0.0.1")),
            t0,
        );
        t.apply(
            1,
            ProbeResult::Ok(reached_at(primary_obs(1, 100), "10.0.0.3")),
            t0,
        );
        t.apply(2, ProbeResult::Ok(r), t0);
        let reason = t.hosts()[2].off_primary.clone().expect("flagged");
        assert!(
            reason.starts_with("streams from 10.0.0.3:5433,"),
            "{reason}"
        );
    }

    #[test]
    fn pg_stat_replication_tells_the_upstream_before_names_do() {
        let t0 = Instant::now();
        let mut t = topo(&["a", "b", "r"]);
        t.set_primary_gate(PrimaryGate::Leader(Some(addr("a"))));
        let a = primary_obs(1, 100);
        let mut b = primary_obs(1, 100);
        b.replication = vec![slotted("walreceiver", "async", "r_slot")];
        t.apply(0, ProbeResult::Ok(a.clone()), t0);
        t.apply(1, ProbeResult::Ok(b.clone()), t0);
        // A name the prober cannot place; the rogue's slot row can.
        let mut r = replica_obs("walreceiver", 100, 1);
        r.wal_receiver_slot = Some("r_slot".into());
        r.upstream = Some(HostAddr::new("b.internal", 5432));
        t.apply(2, ProbeResult::Ok(r.clone()), t0);
        let reason = t.hosts()[2].off_primary.clone().expect("flagged");
        assert_eq!(
            reason,
            "streams from b:5432 (in its pg_stat_replication), which is not the primary a:5432"
        );
        // The key holder listing it settles it, whatever the name says.
        b.replication.clear();
        let mut a = a;
        a.replication = vec![slotted("walreceiver", "async", "r_slot")];
        r.upstream = Some(HostAddr::new("b", 5432));
        t.apply(1, ProbeResult::Ok(b), t0);
        t.apply(0, ProbeResult::Ok(a), t0);
        t.apply(2, ProbeResult::Ok(r), t0);
        assert_eq!(t.hosts()[2].off_primary, None);
    }

    fn ided(mut o: Observation, started_us: i64, port: u16) -> Observation {
        o.instance = Some(InstanceId {
            system_identifier: 7,
            started_us,
            port,
        });
        o
    }

    #[test]
    fn one_server_under_two_names_counts_once() {
        use SyncState::*;
        let t0 = Instant::now();
        let mut t = topo(&["p", "p-alias", "r", "r-alias"]);
        let mut p = ided(primary_obs(1, 100), 1000, 5432);
        p.synchronous_standby_names = Some("r".into());
        p.replication = vec![row("r", "sync")];
        let mut r = ided(replica_obs("r", 100, 1), 2000, 5433);
        // Streams from the primary's second name.
        r.upstream = Some(HostAddr::new("p-alias", 5432));
        let mut ev = Vec::new();
        for (i, o) in [(0, &p), (1, &p), (2, &r), (3, &r)] {
            ev.extend(t.apply(i, ProbeResult::Ok(o.clone()), t0));
        }
        assert_eq!(t.primary(), Some(0));
        assert!(!t.conflict());
        let dups: Vec<_> = t.hosts().iter().map(|h| h.duplicate_of).collect();
        assert_eq!(dups, [None, Some(0), None, Some(2)]);
        let same: Vec<_> = ev
            .iter()
            .filter(|e| matches!(e, TopologyEvent::SameServer { .. }))
            .collect();
        assert_eq!(
            same,
            [
                &TopologyEvent::SameServer {
                    host: addr("p-alias"),
                    of: addr("p")
                },
                &TopologyEvent::SameServer {
                    host: addr("r-alias"),
                    of: addr("r")
                },
            ]
        );
        assert!(!ev
            .iter()
            .any(|e| matches!(e, TopologyEvent::PrimaryConflict { .. })));
        // The replica is one standby, not two sharing a name.
        assert!(!ev
            .iter()
            .any(|e| matches!(e, TopologyEvent::SyncAmbiguous { .. })));
        assert_eq!(states(&t), [None, None, Some(Sync), Some(Sync)]);
        assert_eq!(t.sync_set(), &[2]);
        assert_eq!(t.hosts()[2].off_primary, None);
        let sel = crate::Selector::default();
        assert_eq!(sel.eligible(&t, &crate::Want::Replica), [2]);
        assert_eq!(sel.eligible(&t, &crate::Want::SyncStandby), [2]);
        let view = crate::view::TopologyView::new(&t, 1);
        assert_eq!(view.hosts[1].duplicate_of.as_deref(), Some("p:5432"));
        assert_eq!(view.hosts[0].duplicate_of, None);

        // Reported once, not at every probe.
        assert!(t.apply(1, ProbeResult::Ok(p.clone()), t0).is_empty());
        // The first name lost (say its DNS entry): the second carries on.
        let ev = t.apply(0, ProbeResult::Down("no such host".into()), t0);
        assert_eq!(t.primary(), Some(1));
        assert!(ev.contains(&TopologyEvent::PrimaryChanged {
            from: Some(addr("p")),
            to: Some(addr("p-alias"))
        }));
        assert_eq!(t.hosts()[1].duplicate_of, None);
        // Sessions opened on the second name meanwhile still reach it.
        assert!(t.reaches_primary(1));
        let ev = t.apply(0, ProbeResult::Ok(p), t0);
        assert_eq!(t.primary(), Some(0));
        assert!(t.reaches_primary(0) && t.reaches_primary(1));
        assert!(!t.reaches_primary(2) && !t.reaches_primary(3));
        assert!(!ev
            .iter()
            .any(|e| matches!(e, TopologyEvent::SameServer { .. })));
        assert!(TopologyEvent::SameServer {
            host: addr("b"),
            of: addr("a")
        }
        .to_string()
        .contains("same server as a:5432"));
    }

    #[test]
    fn servers_of_one_lineage_are_still_two_primaries() {
        let t0 = Instant::now();
        // A primary and a copy of it (same system identifier and port, on
        // another machine), both writable on one timeline: split brain.
        let mut t = topo(&["a", "b"]);
        t.apply(
            0,
            ProbeResult::Ok(ided(primary_obs(1, 100), 1000, 5432)),
            t0,
        );
        let ev = t.apply(
            1,
            ProbeResult::Ok(ided(primary_obs(1, 100), 1001, 5432)),
            t0,
        );
        assert!(t.conflict());
        assert_eq!(t.primary(), None);
        assert!(ev.contains(&TopologyEvent::PrimaryConflict {
            hosts: vec![addr("a"), addr("b")]
        }));
        assert!(t.hosts().iter().all(|h| h.duplicate_of.is_none()));
        // Same start time, another port: another server on the same machine.
        t.apply(
            1,
            ProbeResult::Ok(ided(primary_obs(1, 100), 1000, 5433)),
            t0,
        );
        assert!(t.conflict());
        // Servers that do not say who they are are never taken as one.
        t.apply(0, ProbeResult::Ok(primary_obs(1, 100)), t0);
        t.apply(1, ProbeResult::Ok(primary_obs(1, 100)), t0);
        assert!(t.conflict());

        // Under the leader key, another name of the holder is no rogue; a
        // second server is.
        let mut t = topo(&["a", "a-alias", "b"]);
        t.set_primary_gate(PrimaryGate::Leader(Some(addr("a-alias"))));
        let a = ided(primary_obs(1, 100), 1000, 5432);
        t.apply(0, ProbeResult::Ok(a.clone()), t0);
        let ev = t.apply(1, ProbeResult::Ok(a), t0);
        assert_eq!(t.primary(), Some(1));
        assert!(!ev
            .iter()
            .any(|e| matches!(e, TopologyEvent::PrimaryWithoutKey { .. })));
        let ev = t.apply(
            2,
            ProbeResult::Ok(ided(primary_obs(1, 100), 1001, 5432)),
            t0,
        );
        assert_eq!(
            ev,
            vec![
                TopologyEvent::HostUp { host: addr("b") },
                TopologyEvent::PrimaryWithoutKey { host: addr("b") }
            ]
        );
    }

    #[test]
    fn a_rogue_listed_twice_is_reported_once() {
        let t0 = Instant::now();
        let mut t = topo(&["a", "b", "b-alias"]);
        t.set_primary_gate(PrimaryGate::Leader(Some(addr("a"))));
        t.apply(
            0,
            ProbeResult::Ok(ided(primary_obs(1, 100), 1000, 5432)),
            t0,
        );
        let b = ided(primary_obs(1, 100), 1001, 5432);
        let rogue = |ev: &[TopologyEvent]| -> Vec<HostAddr> {
            ev.iter()
                .filter_map(|e| match e {
                    TopologyEvent::PrimaryWithoutKey { host } => Some(host.clone()),
                    _ => None,
                })
                .collect()
        };
        // Seen first under its second name, then under its own: the
        // second sight is the same rogue.
        let ev = t.apply(2, ProbeResult::Ok(b.clone()), t0);
        assert_eq!(rogue(&ev), [addr("b-alias")]);
        let ev = t.apply(1, ProbeResult::Ok(b.clone()), t0);
        assert_eq!(rogue(&ev), []);
        assert_eq!(t.hosts()[2].duplicate_of, Some(1));
        assert_eq!(t.rogues, [addr("b")]);
        for i in [1, 2, 1] {
            let ev = t.apply(i, ProbeResult::Ok(b.clone()), t0);
            assert_eq!(rogue(&ev), [], "probe of {i}");
        }
        assert_eq!(t.primary(), Some(0));
    }

    #[test]
    fn restart_of_a_primary_listed_twice_is_not_a_conflict() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut t = topo(&["p", "p-alias"]);
        let before = ided(primary_obs(1, 100), 1000, 5432);
        let after = ided(primary_obs(1, 200), 9000, 5432);
        t.apply(0, ProbeResult::Ok(before.clone()), t0);
        t.apply(1, ProbeResult::Ok(before.clone()), t0);
        // The first name is probed after the restart, the second not yet.
        let ev = t.apply(0, ProbeResult::Ok(after.clone()), t0 + ms(1000));
        assert!(ev.is_empty(), "{ev:?}");
        assert_eq!(t.primary(), Some(0));
        assert_eq!(t.hosts()[1].duplicate_of, Some(0));
        let ev = t.apply(1, ProbeResult::Ok(after), t0 + ms(1010));
        assert!(ev.is_empty(), "{ev:?}");
        assert_eq!(t.hosts()[1].duplicate_of, Some(0));

        // A second name probed since, still showing the old server, is
        // another server.
        let mut t = topo(&["p", "p-alias"]);
        t.apply(0, ProbeResult::Ok(before.clone()), t0);
        t.apply(1, ProbeResult::Ok(before.clone()), t0);
        let restarted = ided(primary_obs(1, 200), 9000, 5432);
        t.apply(0, ProbeResult::Ok(restarted), t0 + ms(1000));
        let ev = t.apply(1, ProbeResult::Ok(before), t0 + ms(1010));
        assert!(t.conflict());
        assert!(ev.contains(&TopologyEvent::PrimaryConflict {
            hosts: vec![addr("p"), addr("p-alias")]
        }));
    }

    #[test]
    fn time_lag_is_the_age_of_what_the_replica_lacks() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let limit = TopologyConfig {
            max_replica_lag: Some(LagLimit {
                bytes: None,
                time: Some(s(5)),
            }),
            lag_hold: Duration::ZERO,
            ..TopologyConfig::default()
        };
        // A replica whose WAL receiver is gone replays nothing and reports
        // no replay backlog of its own, while the primary keeps writing.
        let mut t = Topology::new(vec![cfg("p"), cfg("r")], limit.clone());
        t.apply(0, ProbeResult::Ok(primary_obs(1, 1000)), t0);
        t.apply(1, ProbeResult::Ok(replica_obs("r", 1000, 1)), t0);
        for sec in 1..=17u64 {
            t.apply(
                0,
                ProbeResult::Ok(primary_obs(1, 1000 + sec * 225_000)),
                t0 + s(sec),
            );
            t.apply(
                1,
                ProbeResult::Ok(replica_obs("r", 1000, 1)),
                t0 + s(sec) + Duration::from_millis(10),
            );
        }
        let h = &t.hosts()[1];
        assert_eq!(h.replay_delay, Some(s(16) + Duration::from_millis(10)));
        assert_eq!(h.lag_bytes, Some(17 * 225_000));
        assert!(h.lag_excluded);

        // An idle primary, then one large write the replicas replay within
        // a second: their last replayed commit is old, their data is not.
        let mut t = Topology::new(vec![cfg("p"), cfg("r")], limit);
        for sec in 0..25u64 {
            t.apply(0, ProbeResult::Ok(primary_obs(1, 1000)), t0 + s(sec));
            t.apply(1, ProbeResult::Ok(replica_obs("r", 1000, 1)), t0 + s(sec));
        }
        t.apply(0, ProbeResult::Ok(primary_obs(1, 9_000_000)), t0 + s(25));
        let mut o = replica_obs("r", 4_000_000, 1);
        o.receive_lsn = Some(9_000_000);
        o.replay_delay = Some(s(25));
        t.apply(
            1,
            ProbeResult::Ok(o),
            t0 + s(25) + Duration::from_millis(400),
        );
        let h = &t.hosts()[1];
        assert_eq!(h.replay_delay, Some(Duration::from_millis(400)));
        assert!(!h.lag_excluded);
        t.apply(
            1,
            ProbeResult::Ok(replica_obs("r", 9_000_000, 1)),
            t0 + s(26),
        );
        assert_eq!(t.hosts()[1].replay_delay, Some(Duration::ZERO));

        // A replica probed before the primary's first reading: zero if it
        // already had what the primary then reported, else unknown.
        let mut t = topo(&["p", "r1", "r2"]);
        t.apply(1, ProbeResult::Ok(replica_obs("r1", 700, 1)), t0);
        t.apply(2, ProbeResult::Ok(replica_obs("r2", 699, 1)), t0);
        t.apply(0, ProbeResult::Ok(primary_obs(1, 700)), t0 + s(1));
        assert_eq!(t.hosts()[1].lag_bytes, Some(0));
        assert_eq!(t.hosts()[1].replay_delay, Some(Duration::ZERO));
        assert_eq!(t.hosts()[2].lag_bytes, None);
        assert_eq!(t.hosts()[2].replay_delay, None);
    }

    #[test]
    fn set_hosts_keeps_surviving_state() {
        let t0 = Instant::now();
        let mut t = topo(&["a", "p", "r"]);
        t.apply(1, ProbeResult::Ok(primary_obs(1, 10)), t0);
        t.apply(2, ProbeResult::Ok(replica_obs("r", 10, 3)), t0);
        let mut rcfg = cfg("r");
        rcfg.tags = vec!["offline".into()];
        let ev = t.set_hosts(vec![cfg("new"), rcfg, cfg("p")]);
        assert!(ev.is_empty(), "{ev:?}");
        assert_eq!(t.primary(), Some(2));
        assert!(t.hosts()[1].alive);
        assert!(t.hosts()[1].config.has_tag("offline"));
        assert!(!t.hosts()[0].alive);
        let ev = t.set_hosts(vec![cfg("r")]);
        assert_eq!(
            ev,
            vec![TopologyEvent::PrimaryChanged {
                from: Some(addr("p")),
                to: None
            }]
        );
        assert_eq!(t.primary(), None);
    }

    #[test]
    fn events_read_as_sentences() {
        let shown = [
            TopologyEvent::HostDown {
                host: addr("a"),
                error: "refused".into(),
            },
            TopologyEvent::PrimaryChanged {
                from: None,
                to: Some(HostAddr::new("::1", 5)),
            },
            TopologyEvent::LagExcluded {
                host: addr("a"),
                lag_bytes: Some(5),
                replay_delay: Some(Duration::from_millis(1500)),
            },
            TopologyEvent::SyncSetChanged {
                sync: vec![],
                quorum: true,
            },
        ]
        .map(|e| e.to_string());
        assert_eq!(shown[0], "host a:5432 is down: refused");
        assert_eq!(shown[1], "primary changed from none to [::1]:5");
        assert_eq!(
            shown[2],
            "replica a:5432 excluded for lag (5 bytes behind, replay 1.500s behind)"
        );
        assert_eq!(
            shown[3],
            "synchronous standbys are now none (quorum commit)"
        );
    }
}
