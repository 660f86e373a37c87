//! Probe scheduling, result application and snapshot publication.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use pgwarden_topology::{
    HostAddr, HostConfig, PrimaryGate, ProbeResult, Topology, TopologyConfig, TopologyEvent,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant, MissedTickBehavior};
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

use crate::query::{parse_observation_row, PROBE_QUERY, RTT_QUERY};

/// How the probe connects and how often.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeConfig {
    /// Role the probe logs in as (needs `pg_monitor` to see replication rows).
    pub user: String,
    /// Database the probe connects to.
    pub dbname: String,
    /// Password for every host, if the servers ask for one.
    pub password: Option<String>,
    /// Without `password`, look each host's password up in `$PGPASSFILE` or
    /// `~/.pgpass` when connecting to it, as libpq does per host.
    pub pgpass: bool,
    /// `application_name` of the probe connections, so operators can tell
    /// them apart in `pg_stat_activity`.
    pub application_name: String,
    /// Time between the starts of two rounds.
    pub interval: Duration,
    /// Longest time a connection attempt (TCP + startup + auth) may take.
    pub connect_timeout: Duration,
    /// Longest time the probe query may take; past it the host is dead.
    pub query_timeout: Duration,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            user: "postgres".into(),
            dbname: "postgres".into(),
            password: None,
            pgpass: true,
            application_name: "pgwarden-probe".into(),
            interval: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            query_timeout: Duration::from_secs(2),
        }
    }
}

impl ProbeConfig {
    /// The password to present to `addr`: the configured one, else the
    /// password file's entry for that host (when `pgpass` is set).
    pub fn password_for(&self, addr: &HostAddr) -> Option<String> {
        self.password.clone().or_else(|| {
            self.pgpass
                .then(|| crate::pgpass_lookup(&addr.host, addr.port, &self.dbname, &self.user))
                .flatten()
        })
    }
}

/// An immutable view of the cluster, replaced as a whole after every change.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Hosts, roles, RTT and the derived cluster view.
    pub topology: Topology,
    /// Number of completed probe rounds; 0 before the first one ends.
    pub round: u64,
}

enum Command {
    SetHosts(Vec<HostConfig>),
    SetTopologyConfig(TopologyConfig),
    SetPrimaryGate(PrimaryGate),
    SetProbeConfig(ProbeConfig),
    ProbeNow,
}

/// The running topology engine. Dropping it stops all probing.
pub struct Engine {
    snapshot: Arc<ArcSwap<Snapshot>>,
    rounds: watch::Receiver<u64>,
    changes: watch::Receiver<u64>,
    commands: mpsc::UnboundedSender<Command>,
    task: JoinHandle<()>,
}

impl Engine {
    /// Starts probing `hosts` on the current tokio runtime.
    pub fn start(hosts: Vec<HostConfig>, topo: TopologyConfig, probe: ProbeConfig) -> Engine {
        let snapshot = Arc::new(ArcSwap::from_pointee(Snapshot {
            topology: Topology::new(hosts.clone(), topo),
            round: 0,
        }));
        let (round_tx, rounds) = watch::channel(0);
        let (changes_tx, changes) = watch::channel(0);
        let (commands, command_rx) = mpsc::unbounded_channel();
        let aggregator = Aggregator {
            snapshot: snapshot.clone(),
            round_tx,
            changes: changes_tx,
            probe: Arc::new(probe),
            hosts,
        };
        let task = tokio::spawn(aggregator.run(command_rx));
        Engine {
            snapshot,
            rounds,
            changes,
            commands,
            task,
        }
    }

    /// The current view: a pointer load, no lock, no await.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// A handle readers can keep to load snapshots themselves.
    pub fn snapshot_handle(&self) -> Arc<ArcSwap<Snapshot>> {
        self.snapshot.clone()
    }

    /// Completed round numbers, to await the next round.
    pub fn rounds(&self) -> watch::Receiver<u64> {
        self.rounds.clone()
    }

    /// A counter bumped on every published snapshot, for reacting to a
    /// change (a host found dead, a new primary) without waiting for the
    /// round to end.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.clone()
    }

    /// Waits until round `n` has completed.
    pub async fn wait_round(&self, n: u64) {
        let mut rx = self.rounds.clone();
        let _ = rx.wait_for(|r| *r >= n).await;
    }

    /// Replaces the host list; state of hosts that stay is kept.
    pub fn set_hosts(&self, hosts: Vec<HostConfig>) {
        let _ = self.commands.send(Command::SetHosts(hosts));
    }

    /// Replaces the lag limits and hold time without a restart.
    pub fn set_topology_config(&self, config: TopologyConfig) {
        let _ = self.commands.send(Command::SetTopologyConfig(config));
    }

    /// Replaces the rule for who may be primary; the new view is published
    /// at once, so sessions on a host the gate closed on are cut without
    /// waiting for a probe.
    pub fn set_primary_gate(&self, gate: PrimaryGate) {
        let _ = self.commands.send(Command::SetPrimaryGate(gate));
    }

    /// Replaces how the probe connects and how often. Changed settings
    /// (role, database, password, time-outs) take new connections, opened
    /// at once: a round starts now with them, and the rounds follow the new
    /// interval from there. RTT history and host states are kept.
    pub fn set_probe_config(&self, probe: ProbeConfig) {
        let _ = self.commands.send(Command::SetProbeConfig(probe));
    }

    /// Probes every host now rather than at the next round, e.g. when the
    /// leader changed and its promotion should be confirmed within
    /// milliseconds. Hosts whose probe is still running are left alone.
    pub fn probe_now(&self) {
        let _ = self.commands.send(Command::ProbeNow);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Aggregator {
    snapshot: Arc<ArcSwap<Snapshot>>,
    round_tx: watch::Sender<u64>,
    changes: watch::Sender<u64>,
    probe: Arc<ProbeConfig>,
    hosts: Vec<HostConfig>,
}

/// A probe result, tagged with the host-list generation it belongs to so
/// results of a replaced host list are dropped, and with the moment the
/// server answered.
type Tagged = (u64, usize, ProbeResult, Instant);

struct Prober {
    trigger: mpsc::Sender<()>,
    busy: bool,
    task: JoinHandle<()>,
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the aggregator owns while it runs.
struct Running {
    topology: Topology,
    generation: u64,
    probers: Vec<Prober>,
    results: mpsc::UnboundedSender<Tagged>,
    probe: Arc<ProbeConfig>,
    hosts: Vec<HostConfig>,
}

impl Running {
    /// Applies a command; true when it calls for a new round now (the
    /// probers were replaced, or the interval changed).
    fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::SetHosts(hosts) => {
                // A reload that leaves the hosts as they were (a log
                // rotation's SIGHUP) keeps the probes' connections and
                // the round under way.
                if hosts == self.hosts {
                    return false;
                }
                for e in self.topology.set_hosts(hosts.clone()) {
                    log_event(&e);
                }
                self.hosts = hosts;
                self.respawn();
                return true;
            }
            Command::SetProbeConfig(probe) => {
                if probe == *self.probe {
                    return false;
                }
                self.probe = Arc::new(probe);
                // New connections for the new role, password or time-outs;
                // results of the old ones are dropped by generation.
                self.respawn();
                return true;
            }
            Command::SetTopologyConfig(c) => self.topology.set_config(c),
            Command::SetPrimaryGate(gate) => {
                for e in self.topology.set_primary_gate(gate) {
                    log_event(&e);
                }
            }
            Command::ProbeNow => {
                for p in &mut self.probers {
                    if !p.busy && p.trigger.try_send(()).is_ok() {
                        p.busy = true;
                    }
                }
            }
        }
        false
    }

    fn respawn(&mut self) {
        self.generation += 1;
        self.probers = spawn_probers(&self.hosts, &self.probe, self.generation, &self.results);
    }

    /// Applies a result; false if it belongs to a replaced host list.
    fn result(&mut self, (gen, idx, result, answered): Tagged) -> bool {
        if gen != self.generation {
            return false;
        }
        if let Some(p) = self.probers.get_mut(idx) {
            p.busy = false;
        }
        for e in self.topology.apply(idx, result, answered.into_std()) {
            log_event(&e);
        }
        true
    }
}

impl Aggregator {
    async fn run(self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let (results, mut result_rx) = mpsc::unbounded_channel::<Tagged>();
        let mut st = Running {
            topology: self.snapshot.load().topology.clone(),
            generation: 0,
            probers: spawn_probers(&self.hosts, &self.probe, 0, &results),
            results,
            probe: self.probe.clone(),
            hosts: self.hosts.clone(),
        };
        let mut round = 0u64;
        // Hosts probed in the open round that have not answered yet. A round
        // closes when all have answered or when the next one is due, so a
        // hung host never holds the others back; its result is applied
        // whenever its own time-out fires.
        let mut waiting: Vec<bool> = Vec::new();
        let mut open = false;
        let mut round_end = Instant::now();
        let mut tick = tokio::time::interval(st.probe.interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let close = tokio::select! {
                started = tick.tick() => {
                    if open {
                        self.close_round(&st.topology, &mut round);
                    }
                    waiting = st.probers.iter_mut().map(|p| {
                        let fire = !p.busy && p.trigger.try_send(()).is_ok();
                        p.busy |= fire;
                        fire
                    }).collect();
                    open = true;
                    round_end = started + st.probe.interval;
                    !waiting.contains(&true)
                }
                Some(r) = result_rx.recv() => {
                    let idx = r.1;
                    if st.result(r) {
                        // Publish at once so a host found dead is unroutable
                        // now, not at the end of the round.
                        self.publish(&st.topology, round);
                        if let Some(w) = waiting.get_mut(idx) {
                            *w = false;
                        }
                    }
                    open && !waiting.contains(&true)
                }
                Some(cmd) = commands.recv() => {
                    if st.command(cmd) {
                        // The open round's probers are gone (their results
                        // are dropped): it is abandoned, not closed, and a
                        // new one starts now on the new probers and interval
                        // (the first tick of an interval is immediate).
                        waiting.clear();
                        open = false;
                        tick = tokio::time::interval(st.probe.interval);
                        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
                    }
                    self.publish(&st.topology, round);
                    open
                }
                _ = tokio::time::sleep_until(round_end), if open => true,
            };
            if close && open {
                open = false;
                self.close_round(&st.topology, &mut round);
            }
        }
    }

    fn close_round(&self, topology: &Topology, round: &mut u64) {
        *round += 1;
        self.publish(topology, *round);
        self.round_tx.send_replace(*round);
    }

    fn publish(&self, topology: &Topology, round: u64) {
        self.snapshot.store(Arc::new(Snapshot {
            topology: topology.clone(),
            round,
        }));
        self.changes.send_modify(|v| *v += 1);
    }
}

fn log_event(e: &TopologyEvent) {
    match e {
        TopologyEvent::HostDown { .. }
        | TopologyEvent::ProbeFailed { .. }
        | TopologyEvent::PrimaryConflict { .. }
        | TopologyEvent::SyncConfigInvalid { .. }
        | TopologyEvent::SyncAmbiguous { .. }
        | TopologyEvent::OffPrimary { .. }
        | TopologyEvent::SameServer { .. }
        | TopologyEvent::PrimaryWithoutKey { .. }
        | TopologyEvent::LagExcluded { .. } => tracing::warn!(event = %e, "topology"),
        _ => tracing::info!(event = %e, "topology"),
    }
}

fn spawn_probers(
    hosts: &[HostConfig],
    probe: &Arc<ProbeConfig>,
    generation: u64,
    results: &mpsc::UnboundedSender<Tagged>,
) -> Vec<Prober> {
    hosts
        .iter()
        .enumerate()
        .map(|(idx, h)| {
            let (trigger, trigger_rx) = mpsc::channel(1);
            let task = tokio::spawn(probe_host(
                generation,
                idx,
                h.addr.clone(),
                probe.clone(),
                trigger_rx,
                results.clone(),
            ));
            Prober {
                trigger,
                busy: false,
                task,
            }
        })
        .collect()
}

async fn probe_host(
    generation: u64,
    idx: usize,
    addr: HostAddr,
    cfg: Arc<ProbeConfig>,
    mut trigger: mpsc::Receiver<()>,
    results: mpsc::UnboundedSender<Tagged>,
) {
    let mut client: Option<Client> = None;
    let mut names = NameCache::default();
    while trigger.recv().await.is_some() {
        let mut result = probe_once(&mut client, &addr, &cfg).await;
        // Lag and identity are facts of this moment, not of when a slow
        // resolver let the result go.
        let answered = Instant::now();
        if let ProbeResult::Ok(obs) = &mut result {
            if let Some(up) = &obs.upstream {
                obs.upstream_ips = names.resolve(up, cfg.connect_timeout).await;
            }
        }
        if results.send((generation, idx, result, answered)).is_err() {
            break;
        }
    }
}

/// How long a resolved upstream name is trusted: a replica reports its
/// upstream at every probe, and a lookup per probe would load DNS for a
/// fact that rarely changes; a moved name is noticed within this time.
const NAME_TTL: Duration = Duration::from_secs(30);

/// The addresses of the last upstream name a replica reported.
#[derive(Default)]
struct NameCache {
    last: Option<(HostAddr, Instant, Vec<IpAddr>)>,
}

impl NameCache {
    /// The addresses `up`'s host stands for from here: the literal itself,
    /// nothing for a Unix-socket directory, else what the resolver says
    /// within `limit` (nothing on failure, cached like an answer so a
    /// broken resolver is not asked at every probe).
    async fn resolve(&mut self, up: &HostAddr, limit: Duration) -> Vec<IpAddr> {
        if let Ok(ip) = up.host.parse::<IpAddr>() {
            return vec![ip];
        }
        if up.host.starts_with('/') {
            return Vec::new();
        }
        if let Some((name, at, ips)) = &self.last {
            if name == up && at.elapsed() < NAME_TTL {
                return ips.clone();
            }
        }
        let lookup = tokio::net::lookup_host((up.host.as_str(), up.port));
        let mut ips: Vec<IpAddr> = match timeout(limit, lookup).await {
            Ok(Ok(found)) => found.map(|a| a.ip()).collect(),
            Ok(Err(e)) => {
                tracing::debug!(host = %up, error = %e, "cannot resolve a replica's upstream");
                Vec::new()
            }
            Err(_) => Vec::new(),
        };
        ips.sort();
        ips.dedup();
        self.last = Some((up.clone(), Instant::now(), ips.clone()));
        ips
    }
}

async fn probe_once(
    client: &mut Option<Client>,
    addr: &HostAddr,
    cfg: &ProbeConfig,
) -> ProbeResult {
    // A connection kept from an earlier probe may have broken since (the
    // server restarted, an operator ended it): that says little about the
    // server, so a fresh connection is tried at once, and its outcome
    // (refused, or an answer) is the probe's.
    let reused = client.as_ref().is_some_and(|c| !c.is_closed());
    match probe_on(client, addr, cfg).await {
        Attempt::Broken(_) if reused => probe_on(client, addr, cfg).await.into(),
        attempt => attempt.into(),
    }
}

/// One probe over one connection.
// Moved once per probe, as `ProbeResult` is; a box would add an allocation.
#[allow(clippy::large_enum_variant)]
enum Attempt {
    Done(ProbeResult),
    /// The connection broke during the probe's statements.
    Broken(String),
}

impl From<Attempt> for ProbeResult {
    fn from(a: Attempt) -> ProbeResult {
        match a {
            Attempt::Done(r) => r,
            Attempt::Broken(e) => ProbeResult::Err(e),
        }
    }
}

async fn probe_on(client: &mut Option<Client>, addr: &HostAddr, cfg: &ProbeConfig) -> Attempt {
    if client.as_ref().is_none_or(Client::is_closed) {
        *client = None;
        match timeout(cfg.connect_timeout, connect(addr, cfg)).await {
            Ok(Ok(c)) => *client = Some(c),
            Ok(Err(e)) if certainly_down(&e) => {
                return Attempt::Done(ProbeResult::Down(error_text(&e)))
            }
            Ok(Err(e)) => return Attempt::Done(ProbeResult::Err(error_text(&e))),
            Err(_) => {
                return Attempt::Done(ProbeResult::Err(format!(
                    "connection timed out after {} ms",
                    cfg.connect_timeout.as_millis()
                )))
            }
        }
    }
    let c = client.as_ref().expect("connected above");
    // RTT is timed on a trivial statement: the probe query itself reads
    // replication views and costs about a millisecond of server time,
    // which would drown the network latency the window is about.
    let exchange = async {
        let started = Instant::now();
        c.simple_query(RTT_QUERY).await?;
        let rtt = started.elapsed();
        Ok::<_, tokio_postgres::Error>((rtt, c.simple_query(PROBE_QUERY).await?))
    };
    let outcome = timeout(cfg.query_timeout, exchange).await;
    let (rtt, messages) = match outcome {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            *client = None;
            // A fatal error ends the session as surely as a reset does.
            let broken = e
                .as_db_error()
                .is_none_or(|db| matches!(db.severity(), "FATAL" | "PANIC"));
            return if broken {
                Attempt::Broken(error_text(&e))
            } else {
                Attempt::Done(ProbeResult::Err(error_text(&e)))
            };
        }
        Err(_) => {
            // The connection may be wedged behind a partition; a fresh one
            // is the only way to learn when the host is back. The statement
            // may still run on a server that is only slow: cancelled, so
            // that a stall does not leave one busy backend per probe.
            if let Some(old) = client.take() {
                let token = old.cancel_token();
                let limit = cfg.connect_timeout;
                tokio::spawn(async move {
                    let _ = timeout(limit, token.cancel_query(NoTls)).await;
                });
            }
            return Attempt::Done(ProbeResult::Err(format!(
                "probe query timed out after {} ms",
                cfg.query_timeout.as_millis()
            )));
        }
    };
    let Some(row) = messages.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(r) => Some(r),
        _ => None,
    }) else {
        return Attempt::Done(ProbeResult::Err("probe query returned no row".into()));
    };
    let cols: Vec<Option<&str>> = (0..row.len()).map(|i| row.get(i)).collect();
    Attempt::Done(match parse_observation_row(&cols, rtt) {
        Ok(obs) => ProbeResult::Ok(obs),
        Err(e) => ProbeResult::Err(e),
    })
}

async fn connect(addr: &HostAddr, cfg: &ProbeConfig) -> Result<Client, tokio_postgres::Error> {
    let mut pg = tokio_postgres::Config::new();
    pg.host(&addr.host)
        .port(addr.port)
        .user(&cfg.user)
        .dbname(&cfg.dbname)
        .application_name(&cfg.application_name)
        .connect_timeout(cfg.connect_timeout)
        .keepalives(true);
    // Looked up at each connection, so a host added later or a password
    // file edited since is honoured, as libpq would.
    if let Some(p) = cfg.password_for(addr) {
        pg.password(p);
    }
    let (client, connection) = pg.connect(NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "probe connection ended");
        }
    });
    Ok(client)
}

/// Whether a failed connection attempt proves that the server does not
/// serve: nothing listens at its address (a refused TCP connection, a
/// missing Unix socket), or it says it is starting up, shutting down or
/// recovering from a crash (57P03). A time-out, a reset or a refused login
/// may pass, and counts toward `down_after_failures` instead.
fn certainly_down(e: &tokio_postgres::Error) -> bool {
    if let Some(db) = e.as_db_error() {
        return *db.code() == tokio_postgres::error::SqlState::CANNOT_CONNECT_NOW;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            );
        }
        source = s.source();
    }
    false
}

fn error_text(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{}: {}", db.severity(), db.message());
    }
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let s = s.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        source = s_source(source);
    }
    text
}

fn s_source<'a>(
    e: Option<&'a (dyn std::error::Error + 'static)>,
) -> Option<&'a (dyn std::error::Error + 'static)> {
    e.and_then(std::error::Error::source)
}
