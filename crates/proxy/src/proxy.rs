//! Listeners, services, the session registry and the router task.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use pgwarden_probe::Snapshot;
use pgwarden_topology::{HostAddr, SelectPolicy, Selector, Want};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cancel::CancelRegistry;
use crate::metrics::Metrics;
use crate::pool::{ConnLimit, LimitKind, Pool, PoolKey, PoolSettings};

/// What `POST /pause?service=` and `/resume` take for every service that
/// writes to the primary: `read_write` and the named services that select
/// it. A switchover pauses them all.
pub const WRITERS: &str = "*writers";

/// One service: where it listens and how it picks hosts.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceSpec {
    /// Name, e.g. `read_write`, `read_only`, `standby`.
    pub name: String,
    /// Listen address.
    pub listen: SocketAddr,
    /// The kind of host wanted.
    pub want: Want,
    /// Strategy, RTT window, fallback.
    pub policy: SelectPolicy,
    /// Sessions cannot write, whatever host they land on.
    pub read_only: bool,
    /// How long a new client waits for an eligible host.
    pub connect_wait_timeout: Duration,
    /// Transaction pooling with these settings; `None` = session mode
    /// (each client session relayed to its own server connection).
    /// Shared by every client of the service that no override touches.
    pub pool: Option<Arc<crate::pool::PoolSettings>>,
    /// Never pooled, whatever the per-database and per-user settings and
    /// `reuse_session_servers` say (the `default` service: administrators
    /// bypass the pool).
    pub direct: bool,
}

/// Where a reload's outcome goes: `Err` carries what the client is told.
pub type ReloadReply = tokio::sync::oneshot::Sender<Result<(), String>>;

/// Gives the user and password a request must carry, as they are now.
pub type CredentialSource = Arc<dyn Fn() -> Option<(String, String)> + Send + Sync>;

/// Everything the connection manager serves.
#[derive(Debug, Clone)]
pub struct ProxySpec {
    /// The services, each with its own listener.
    pub services: Vec<ServiceSpec>,
    /// The HTTP status port.
    pub http: Option<SocketAddr>,
    /// Longest connection attempt to a server.
    pub server_connect_timeout: Duration,
    /// How long shutdown lets sessions finish before closing them.
    pub shutdown_timeout: Duration,
    /// Most client connections at once, over all services; counted from
    /// accept, before any authentication, so idle sockets cannot pile up.
    pub max_client_conn: usize,
    /// Threads that carry client traffic, each with its own event loop.
    /// Read once, at start.
    pub worker_threads: usize,
    /// Pooled clients of one (service, database, user) share one worker.
    /// Read once, at start.
    pub pool_affinity: bool,
    /// Clients a worker takes before new ones go to the next one; 0
    /// shares them out in turn. Read once, at start.
    pub worker_fill: usize,
    /// Roles allowed into the admin console.
    pub admin_users: Vec<String>,
    /// The effective configuration as `SHOW CONFIG` lists it: key, value,
    /// default.
    pub settings: Vec<(String, String, String)>,
    /// Pool mode and size exceptions by database and by user.
    pub pool_overrides: PoolOverrides,
    /// TLS towards clients: certificate and key files, and the mode.
    pub tls: Option<TlsSpec>,
    /// TLS on the connections pgwarden opens to the servers.
    pub server_tls: crate::stream::ServerTlsMode,
    /// Where every service also listens on a Unix-domain socket named
    /// `.s.PGSQL.PORT` after its TCP port, as libpq names them.
    pub unix_socket_dir: Option<std::path::PathBuf>,
    /// CA certificates (PEM) for `verify-ca` and `verify-full`.
    pub server_ca: Option<std::path::PathBuf>,
    /// Longest time from accept to an authenticated client.
    pub auth_timeout: Duration,
    /// Authentication by pgwarden (pg_hba.conf + auth query); `None`:
    /// session-mode clients authenticate with the server itself, pooled
    /// clients are trusted.
    pub auth: Option<crate::auth::AuthSpec>,
    /// The period the admin console's averages (`avg_*`) cover.
    pub stats_period: Duration,
    /// TCP keepalive and retransmission timings of new client and server
    /// connections.
    pub tcp: crate::stream::TcpTimings,
}

/// Whether clients may or must use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClientTlsMode {
    /// Plaintext only: SSLRequest is answered `N`.
    #[default]
    Disable,
    /// The client decides.
    Allow,
    /// Clients that do not ask for TLS are refused before authentication.
    Require,
}

/// TLS termination settings; the files are read (again) on every apply,
/// so a reload picks up renewed certificates without dropping sessions.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsSpec {
    /// Certificate chain, PEM.
    pub cert: std::path::PathBuf,
    /// Private key, PEM.
    pub key: std::path::PathBuf,
    /// Whether TLS is allowed or required.
    pub mode: ClientTlsMode,
    /// CA certificates (PEM) that client certificates must chain to; with
    /// it, clients are asked for a certificate (and may send none).
    pub client_ca: Option<std::path::PathBuf>,
}

/// Per-database and per-user exceptions to a service's pool mode and size
/// (the user's wins over the database's, which wins over the service's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolOverrides {
    /// By database name: (transaction pooling?, pool size).
    pub databases: HashMap<String, (Option<bool>, Option<usize>)>,
    /// By user name: (transaction pooling?, pool size).
    pub users: HashMap<String, (Option<bool>, Option<usize>)>,
    /// Settings for pools that exist only because of an override (the
    /// service itself is in session mode).
    pub defaults: PoolSettings,
    /// Session-mode clients share pools too: each keeps one server
    /// connection for its session, which is reset and reused by the next
    /// client instead of being closed.
    pub reuse_session_servers: bool,
    /// `max_db_connections`: server connections to one database on one
    /// server, across its pools.
    pub db_limits: ConnLimits,
    /// `max_user_connections`: server connections of one user on one
    /// server, across its pools.
    pub user_limits: ConnLimits,
}

/// A cap on server connections by database or user name (0: none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConnLimits {
    /// For names without their own.
    pub default: usize,
    /// By name.
    pub by_name: HashMap<String, usize>,
}

impl ConnLimits {
    /// The cap for `name`.
    pub fn of(&self, name: &str) -> usize {
        self.by_name.get(name).copied().unwrap_or(self.default)
    }
}

impl PoolOverrides {
    /// The pool settings for one client session, `None` = session mode
    /// without pooling (a server connection of its own, closed with it).
    pub fn resolve(
        &self,
        service: &ServiceSpec,
        database: &str,
        user: &str,
    ) -> Option<Arc<PoolSettings>> {
        if service.direct {
            return None;
        }
        let u = self.users.get(user).copied().unwrap_or_default();
        let d = self.databases.get(database).copied().unwrap_or_default();
        let transaction = u.0.or(d.0).unwrap_or(service.pool.is_some());
        if !transaction && !self.reuse_session_servers {
            return None;
        }
        let size = u.1.or(d.1);
        if let (true, Some(s), None) = (transaction, &service.pool, size) {
            return Some(s.clone());
        }
        let mut s = service
            .pool
            .as_deref()
            .cloned()
            .unwrap_or_else(|| PoolSettings {
                wants_primary: service.want == Want::Primary,
                ..self.defaults.clone()
            });
        if let Some(size) = size {
            s.size = size;
        }
        s.hold_session = !transaction;
        Some(Arc::new(s))
    }
}

/// A service as sessions see it: swapped whole on reload.
pub(crate) struct Service {
    pub spec: ServiceSpec,
    pub selector: Selector,
    /// The service's name, shared by its entries in the session table.
    pub name: Arc<str>,
    /// The worker the last pooled client of this service was sent to
    /// ([`crate::workers::Workers::pool_home`]), or
    /// [`crate::workers::NONE`]. The accept loop serves new clients there,
    /// so that a client of the usual pool never changes thread.
    pub home_hint: AtomicUsize,
    /// The service's metric series and pause switch, looked up once here
    /// rather than by label for every client.
    pub handles: ServiceHandles,
    /// The pool its last pooled client used: a new client of the same
    /// database and user starts from it, without a look-up in the pool
    /// table.
    pub recent_pool: arc_swap::ArcSwapOption<Pool>,
}

impl Service {
    /// The addresses of the hosts the service could be served by in
    /// `topo`, sorted: compared from one wait for a server to the next, as
    /// a set (the round robin turns their order at every pick, and the
    /// probes publish topologies that change nothing of it).
    pub fn eligible_addrs(&self, topo: &pgwarden_topology::Topology) -> Vec<HostAddr> {
        let mut v: Vec<HostAddr> = self
            .selector
            .eligible(topo, &self.spec.want)
            .into_iter()
            .map(|i| topo.hosts()[i].config.addr.clone())
            .collect();
        v.sort();
        v
    }
}

/// Per-service metric series and pause switch, resolved when the service
/// is (re)built.
pub(crate) struct ServiceHandles {
    pub client_connections: prometheus_client::metrics::gauge::Gauge,
    pub bytes_from_clients: prometheus_client::metrics::counter::Counter,
    pub bytes_to_clients: prometheus_client::metrics::counter::Counter,
    pub pool_wait: crate::metrics::WaitHistogram,
    pub paused: watch::Receiver<bool>,
}

impl ServiceHandles {
    fn new(shared: &Shared, name: &str) -> ServiceHandles {
        let label = crate::metrics::ServiceLabel {
            service: name.to_string(),
        };
        let (bytes_from_clients, bytes_to_clients) = shared.metrics.byte_counters(name);
        ServiceHandles {
            client_connections: shared
                .metrics
                .client_connections
                .get_or_create(&label)
                .clone(),
            bytes_from_clients,
            bytes_to_clients,
            pool_wait: shared.metrics.pool_wait.get_or_create(&label).clone(),
            paused: shared.paused(name),
        }
    }
}

/// Why pgwarden ends a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kill {
    /// The host is no longer the primary a read-write session needs.
    NotPrimary,
    /// The host stopped answering its probes.
    HostDown,
    /// pgwarden is shutting down.
    Shutdown,
    /// An administrator ended it (the admin console's KILL).
    Admin,
    /// Its host was taken out of the configuration by a reload.
    HostRemoved,
}

impl Kill {
    fn code(self) -> u8 {
        match self {
            Kill::NotPrimary => 1,
            Kill::HostDown => 2,
            Kill::Shutdown => 3,
            Kill::Admin => 4,
            Kill::HostRemoved => 5,
        }
    }

    fn from_code(c: u8) -> Option<Kill> {
        match c {
            1 => Some(Kill::NotPrimary),
            2 => Some(Kill::HostDown),
            3 => Some(Kill::Shutdown),
            4 => Some(Kill::Admin),
            5 => Some(Kill::HostRemoved),
            _ => None,
        }
    }
}

/// Whether, and why, a session was told to end. The session reads it when
/// its client socket reports end of input: [`SessionEntry::kill`] records
/// the reason, then shuts the read side of the client's socket, which wakes
/// the session at the read it is waiting on anyway. So a session watches no
/// channel of its own, and its per-message path polls nothing extra. Only
/// a session that has stopped reading its client (a read-only session
/// holding a pipelined statement until the server's answer is in) waits
/// on [`KillState::told`] meanwhile.
#[derive(Debug, Default)]
pub(crate) struct KillState {
    code: std::sync::atomic::AtomicU8,
    woken: tokio::sync::Notify,
}

impl KillState {
    /// The reason the session was told to end, if it was.
    pub fn reason(&self) -> Option<Kill> {
        Kill::from_code(self.code.load(Ordering::Acquire))
    }

    /// Completes once the session has been told to end.
    pub async fn told(&self) {
        while self.reason().is_none() {
            // A kill between the check and this wait leaves a permit.
            self.woken.notified().await;
        }
    }
}

/// Counts a client in [`Shared::logging_in`] while it lives.
pub(crate) struct LoggingIn<'a>(&'a Shared);

impl<'a> LoggingIn<'a> {
    pub fn new(shared: &'a Shared) -> Self {
        shared.logging_in.fetch_add(1, Ordering::SeqCst);
        Self(shared)
    }
}

impl Drop for LoggingIn<'_> {
    fn drop(&mut self) {
        self.0.logging_in.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Registers a session in [`Shared::sessions`] and removes it when dropped.
///
/// The entry holds the raw descriptor of the client socket, so the entry
/// must be gone before the socket is closed: the guard lives inside the
/// function that borrows the socket, and a descriptor is only used under
/// the sessions lock, while its entry is still there.
pub(crate) struct SessionGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl<'a> SessionGuard<'a> {
    /// Inserts `entry` under `id`.
    pub fn register(shared: &'a Shared, id: u64, entry: SessionEntry) -> Self {
        let mut sessions = shared.sessions.lock().expect("poisoned");
        // Under the lock the shutdown's sweep takes after setting the flag:
        // a session either is swept or sees the flag here.
        if shared.ending.load(Ordering::SeqCst) {
            entry.kill(Kill::Shutdown);
        }
        sessions.insert(id, entry);
        drop(sessions);
        Self { shared, id }
    }
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        self.shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

pub(crate) struct SessionEntry {
    pub service: Arc<str>,
    pub user: Arc<str>,
    pub database: Arc<str>,
    pub client: SocketAddr,
    pub want: Want,
    /// The host a session is bound to; `None` for pooled clients, whose
    /// server connections are governed by their pools.
    pub host: Option<HostAddr>,
    /// A pooled client's server of the moment (and whether it waits for
    /// one), as its cancel requests find it.
    pub pooled: Option<Arc<crate::cancel::CancelSlot>>,
    /// Read by the session.
    pub killed: Arc<KillState>,
    /// The client's socket (see [`SessionGuard`] for why it is valid).
    pub client_fd: std::os::fd::RawFd,
    /// A relayed session's server socket, valid as `client_fd` is: shut
    /// down by a kill, so that a session whose pumps both wait on the
    /// server (a dead host that takes no more bytes) ends too.
    pub server_fd: Option<std::os::fd::RawFd>,
    /// When the session was registered, Unix seconds (SHOW CLIENTS).
    pub connected_s: u64,
    /// Whether the client's connection is TLS (SHOW CLIENTS).
    pub tls: bool,
    /// The client's `application_name` at login (SHOW CLIENTS).
    pub application_name: Option<Arc<str>>,
}

/// Now, Unix seconds.
pub(crate) fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl SessionEntry {
    /// Tells the session to end, for `why`; the first reason given stays.
    /// Call only with the sessions lock held and the entry in the map.
    pub fn kill(&self, why: Kill) {
        let first = self
            .killed
            .code
            .compare_exchange(0, why.code(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if first {
            // SAFETY: the descriptor belongs to the session's client socket,
            // which outlives the entry (SessionGuard), and the caller holds
            // the lock that the guard takes to remove the entry.
            #[allow(unsafe_code)]
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.client_fd) };
            let _ = socket2::SockRef::from(&fd).shutdown(std::net::Shutdown::Read);
            if let Some(server) = self.server_fd {
                // SAFETY: as for the client's socket.
                #[allow(unsafe_code)]
                let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(server) };
                let _ = socket2::SockRef::from(&fd).shutdown(std::net::Shutdown::Both);
            }
            self.killed.woken.notify_one();
        }
    }

    /// Whether the session was already told to end.
    pub fn is_killed(&self) -> bool {
        self.killed.reason().is_some()
    }
}

/// State shared by listeners, sessions, the router and the HTTP port.
pub(crate) struct Shared {
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    pub changes: watch::Receiver<u64>,
    pub cancel: CancelRegistry,
    pub metrics: Metrics,
    pub sessions: Mutex<HashMap<u64, SessionEntry, foldhash::fast::RandomState>>,
    pub next_session: AtomicU64,
    pub server_connect_timeout: Mutex<Duration>,
    pub services: Mutex<HashMap<String, Arc<ArcSwap<Service>>>>,
    pub accepting: AtomicBool,
    /// Set when a shutdown ends the sessions: one registered after that
    /// (a client that was still logging in) is ended as it registers.
    pub ending: AtomicBool,
    /// `ending`, to wait on: a client still waiting for a server when the
    /// sessions are ended is told so too.
    pub ending_signal: tokio::sync::watch::Sender<bool>,
    /// Clients that sent their start-up packet and are not yet sessions
    /// ([`LoggingIn`]), which a shutdown waits for.
    pub logging_in: AtomicU64,
    pub pools: Mutex<HashMap<PoolKey, Arc<Pool>>>,
    /// The caps pools share ([`crate::pool::ConnLimit`]), by server, kind
    /// and name; kept for the life of the process so a reload can change
    /// them in place.
    pub limits: Mutex<HashMap<(HostAddr, LimitKind, String), Arc<ConnLimit>>>,
    pub paused: Mutex<HashMap<String, watch::Sender<bool>>>,
    /// Services that refuse new transactions, with the reason clients are
    /// told; `any_refusal` lets the per-transaction fast path skip the map.
    pub refusals: Mutex<HashMap<String, Arc<str>>>,
    pub any_refusal: AtomicBool,
    /// Databases the admin console's DISABLE closed to new clients;
    /// `any_disabled` lets a login skip the set.
    pub disabled: Mutex<std::collections::HashSet<String>>,
    pub any_disabled: AtomicBool,
    /// Admin console sessions, by an id from `next_session`.
    pub consoles: Mutex<HashMap<u64, crate::admin::Console>>,
    /// Signalled by the admin console's SHUTDOWN; whoever runs the proxy
    /// shuts it down as on SIGTERM.
    pub shutdown: Arc<tokio::sync::Notify>,
    pub clients: AtomicU64,
    pub max_client_conn: AtomicU64,
    pub admin_users: Mutex<Vec<String>>,
    /// Where the HTTP port's pause and resume find the credentials they
    /// require; without, they are taken from this machine only.
    pub http_credentials: Mutex<Option<CredentialSource>>,
    pub settings_view: Mutex<Vec<(String, String, String)>>,
    /// The admin console's RELOAD requests, each with where to answer:
    /// whoever owns the configuration file reloads it and says how it went.
    pub reload: tokio::sync::mpsc::Sender<ReloadReply>,
    reload_rx: Mutex<Option<tokio::sync::mpsc::Receiver<ReloadReply>>>,
    pub pool_overrides: Mutex<PoolOverrides>,
    pub tls: arc_swap::ArcSwapOption<crate::stream::ClientTls>,
    pub client_tls: Mutex<ClientTlsMode>,
    /// TLS towards the servers; pools share it, so a reload reaches the
    /// connections they open next.
    pub server_tls: Arc<ArcSwap<crate::stream::ServerTls>>,
    pub auth: arc_swap::ArcSwapOption<crate::auth::Authenticator>,
    /// How long a client may take from connecting to being authenticated.
    pub auth_timeout: Mutex<Duration>,
    /// The threads sessions run on.
    pub workers: crate::workers::Workers,
    /// See [`ProxySpec::pool_affinity`].
    pub pool_affinity: bool,
    /// See [`ProxySpec::stats_period`].
    pub stats_period: Mutex<Duration>,
    /// How long the last complete stats period lasted: what the pools'
    /// [`crate::pool::PoolStats::last_period`] spans.
    pub stats_span: Mutex<Duration>,
    /// The totals of pools that are gone (idle past their timeout, retired
    /// by a failover), by database: SHOW STATS and SHOW TOTALS count them,
    /// so that their totals never go down (exporters read them as
    /// counters).
    pub gone_totals: Mutex<GoneTotals>,
}

/// [`Shared::gone_totals`].
#[derive(Default)]
pub(crate) struct GoneTotals {
    /// By database, for SHOW STATS.
    pub by_database: std::collections::BTreeMap<String, crate::stats::Totals>,
    /// Pools that never ran a query (logins refused: a database that does
    /// not exist) get no row of their own, since clients choose database
    /// names and a row kept for ever for each would grow without bound;
    /// their figures count in SHOW TOTALS only.
    pub unlisted: crate::stats::Totals,
}

impl Shared {
    /// The TLS mode in force.
    pub fn client_tls(&self) -> ClientTlsMode {
        *self.client_tls.lock().expect("poisoned")
    }

    /// The pool for `key`, created on first use with the settings
    /// `service` resolved for it.
    pub fn pool(&self, key: PoolKey, service: &Arc<str>, settings: &PoolSettings) -> Arc<Pool> {
        let mut pools = self.pools.lock().expect("poisoned");
        pools
            .entry(key)
            .or_insert_with_key(|k| {
                let limits = vec![
                    self.limit(&k.host, LimitKind::Database, &k.database),
                    self.limit(&k.host, LimitKind::User, &k.user),
                ];
                let pool =
                    Pool::limited(k.clone(), settings.clone(), self.server_tls.clone(), limits);
                let _ = pool.service.set(service.clone());
                pool.set_connect_limit(self.server_connect_timeout());
                let gauge = self
                    .metrics
                    .server_connections
                    .get_or_create(&crate::metrics::HostLabel {
                        host: k.host.to_string(),
                    })
                    .clone();
                let _ = pool.server_gauge.set(gauge);
                pool.warm();
                pool
            })
            .clone()
    }

    /// Removes `pool` if nothing has to do with it (a login the server
    /// refused, say), so that logins naming databases or users that do not
    /// exist leave no pool and no metric series behind.
    pub fn forget_if_unused(&self, pool: &Arc<Pool>) {
        let mut pools = self.pools.lock().expect("poisoned");
        if pools.get(&pool.key).is_some_and(|p| Arc::ptr_eq(p, pool)) && !pool.in_use() {
            // Retired: a client that still holds it picks the pool again.
            pool.retire();
            pools.remove(&pool.key);
            self.keep_totals(pool);
        }
    }

    /// Adds the totals of `pool`, removed from the table, to those of the
    /// pools that are gone.
    pub fn keep_totals(&self, pool: &Pool) {
        let totals = pool.stats.totals();
        let mut gone = self.gone_totals.lock().expect("poisoned");
        let gone = &mut *gone;
        match gone.by_database.get_mut(&pool.key.database) {
            Some(kept) => kept.add(&totals),
            None if totals.xact_count == 0 && totals.query_count == 0 => gone.unlisted.add(&totals),
            None => gone
                .by_database
                .entry(pool.key.database.clone())
                .or_default()
                .add(&totals),
        }
    }

    /// The cap of `kind` on `name`'s connections to `host`, created on
    /// first use with the configured value.
    fn limit(&self, host: &HostAddr, kind: LimitKind, name: &str) -> Arc<ConnLimit> {
        let max = self.limit_of(kind, name);
        self.limits
            .lock()
            .expect("poisoned")
            .entry((host.clone(), kind, name.to_string()))
            .or_insert_with(|| ConnLimit::new(kind, name, host.clone(), max))
            .clone()
    }

    /// The configured cap of `kind` on `name` (0: none).
    fn limit_of(&self, kind: LimitKind, name: &str) -> usize {
        let o = self.pool_overrides.lock().expect("poisoned");
        match kind {
            LimitKind::Database => o.db_limits.of(name),
            LimitKind::User => o.user_limits.of(name),
        }
    }

    /// The pause switch of a service.
    pub fn paused(&self, service: &str) -> watch::Receiver<bool> {
        self.paused
            .lock()
            .expect("poisoned")
            .entry(service.to_string())
            .or_insert_with(|| watch::channel(false).0)
            .subscribe()
    }

    /// The services a pause names: every service for `None`, those that
    /// write to the primary for `*writers`, else the one named (whether
    /// or not it exists).
    pub fn pause_targets(&self, name: Option<&str>) -> Vec<String> {
        let services = self.services.lock().expect("poisoned");
        match name {
            None => services.keys().cloned().collect(),
            Some(WRITERS) => services
                .iter()
                .filter(|(_, s)| {
                    let s = s.load();
                    s.spec.want == Want::Primary && !s.spec.read_only
                })
                .map(|(n, _)| n.clone())
                .collect(),
            Some(n) => vec![n.to_string()],
        }
    }

    /// Server connections lent for transactions that a pause of `services`
    /// must wait for: those of every pool of the same kind (read-write or
    /// read-only) as one of them, since pools are shared by services of a
    /// kind, less the servers kept by clients between two transactions
    /// (pinned by session state, or session-pooled): a paused service
    /// holds their next one.
    ///
    /// A server counts as lent from its checkout, before the client's
    /// session parameters are set on it and its first statement goes: the
    /// client looks at the pause switch only after that count went up.
    pub fn in_transaction(&self, services: &[String]) -> usize {
        // Pairs with the checkout's count and the held clients' switch:
        // the pause set before this is seen by any client counted after.
        std::sync::atomic::fence(Ordering::SeqCst);
        let (mut writers, mut readers) = (false, false);
        for (name, s) in self.services.lock().expect("poisoned").iter() {
            if services.contains(name) {
                let read_only = s.load().spec.read_only;
                writers |= !read_only;
                readers |= read_only;
            }
        }
        let counted = |read_only: bool| if read_only { readers } else { writers };
        // Counted per pool: a client kept on a pool since retired (its
        // host removed, no longer primary) counts on neither side.
        self.pools
            .lock()
            .expect("poisoned")
            .iter()
            .filter(|(k, _)| counted(k.read_only))
            .map(|(_, p)| p.in_transaction())
            .sum()
    }

    /// Pauses or resumes a service; false if there is no such service.
    pub fn set_paused(&self, service: &str, on: bool) -> bool {
        if service == WRITERS {
            for name in self.pause_targets(Some(WRITERS)) {
                self.set_paused(&name, on);
            }
            return true;
        }
        if !self
            .services
            .lock()
            .expect("poisoned")
            .contains_key(service)
        {
            return false;
        }
        self.paused
            .lock()
            .expect("poisoned")
            .entry(service.to_string())
            .or_insert_with(|| watch::channel(false).0)
            .send_replace(on);
        true
    }

    /// Why `service` refuses new transactions right now, if it does.
    pub fn refusal(&self, service: &str) -> Option<Arc<str>> {
        if !self.any_refusal.load(Ordering::Relaxed) {
            return None;
        }
        self.refusals
            .lock()
            .expect("poisoned")
            .get(service)
            .cloned()
    }

    pub fn server_connect_timeout(&self) -> Duration {
        *self.server_connect_timeout.lock().expect("poisoned")
    }
}

struct Listener {
    addr: SocketAddr,
    service: Arc<ArcSwap<Service>>,
    task: Arc<AcceptTask>,
}

/// The task accepting on one listener. It moves to the worker its pooled
/// clients live on, so it is found here rather than through one
/// `JoinHandle`.
#[derive(Default)]
struct AcceptTask(Mutex<(bool, Option<JoinHandle<()>>)>);

impl AcceptTask {
    /// Ends the accept loop wherever it runs now; the listening socket is
    /// closed with it.
    fn stop(&self) {
        let mut t = self.0.lock().expect("poisoned");
        t.0 = true;
        if let Some(h) = t.1.take() {
            h.abort();
        }
    }

    /// Starts the accept loop on worker `worker` (any, round robin, for
    /// [`crate::workers::NONE`]) unless the listener was stopped.
    fn start(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        service: Arc<ArcSwap<Service>>,
        listener: std::net::TcpListener,
        worker: usize,
    ) {
        let mut t = self.0.lock().expect("poisoned");
        if t.0 {
            return;
        }
        let task = accept_loop(shared.clone(), service, listener, self.clone());
        t.1 = Some(if worker == crate::workers::NONE {
            shared.workers.spawn_on(shared.workers.pick(), task)
        } else {
            shared.workers.spawn_on(worker, task)
        });
    }
}

/// Makes a service refuse new transactions (and sessions) with a reason,
/// or serve again; cheap to clone, usable from any task.
#[derive(Clone)]
pub struct RefusalSwitch(Arc<Shared>);

impl RefusalSwitch {
    /// Refuses new transactions on `service` with `reason` (`None`: serve).
    /// Transactions already running are not affected.
    pub fn set(&self, service: &str, reason: Option<String>) {
        let mut map = self.0.refusals.lock().expect("poisoned");
        let changed = match reason {
            Some(r) => map.insert(service.to_string(), r.into()).is_none(),
            None => map.remove(service).is_some(),
        };
        self.0.any_refusal.store(!map.is_empty(), Ordering::SeqCst);
        if changed {
            tracing::info!(
                service,
                refusing = !map.is_empty(),
                "service refusal changed"
            );
        }
    }
}

/// The running connection manager.
pub struct Proxy {
    shared: Arc<Shared>,
    listeners: HashMap<String, Listener>,
    /// Unix-domain listeners by service: socket path and accept loop.
    unix: HashMap<String, (std::path::PathBuf, JoinHandle<()>)>,
    http: Option<(SocketAddr, JoinHandle<()>)>,
    router: JoinHandle<()>,
    stats_roller: JoinHandle<()>,
    shutdown_timeout: Duration,
    spec: Option<ProxySpec>,
}

/// Why the proxy could not start or apply a spec.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The hba file could not be loaded.
    #[error("authentication: {0}")]
    Auth(String),
    /// The TLS certificate or key could not be loaded.
    #[error("TLS: {0}")]
    Tls(String),
    /// A Unix-domain socket could not be bound.
    #[error("cannot listen on {} for service {service}", path.display())]
    BindUnix {
        /// Service name.
        service: String,
        /// Socket path.
        path: std::path::PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A listen address could not be bound.
    #[error("cannot listen on {addr} for service {service}")]
    Bind {
        /// The service.
        service: String,
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The worker threads could not be started.
    #[error("starting the worker threads")]
    Workers {
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Loads what `spec` names from files (the TLS certificate, key and CAs,
/// the hba file, the auth file) as starting with it would, without binding
/// or serving anything: `pgwarden run --check`, before a start or a
/// `SIGHUP`.
pub fn check_spec(spec: &ProxySpec) -> Result<(), ProxyError> {
    if let Some(t) = &spec.tls {
        crate::stream::tls_acceptor(&t.cert, &t.key, t.client_ca.as_deref())
            .map_err(ProxyError::Tls)?;
    }
    crate::stream::ServerTls::new(spec.server_tls, spec.server_ca.as_deref())
        .map_err(ProxyError::Tls)?;
    if let Some(a) = &spec.auth {
        crate::auth::Authenticator::new(
            a.clone(),
            spec.tls.as_ref().is_some_and(|t| t.client_ca.is_some()),
        )
        .map_err(ProxyError::Auth)?;
    }
    Ok(())
}

impl Proxy {
    /// Binds every listener and starts serving, routing by the snapshots
    /// of a topology engine (`snapshot`, `changes` from
    /// [`pgwarden_probe::Engine`]).
    pub async fn start(
        spec: ProxySpec,
        snapshot: Arc<ArcSwap<Snapshot>>,
        changes: watch::Receiver<u64>,
    ) -> Result<Proxy, ProxyError> {
        let (reload_tx, reload_rx) = tokio::sync::mpsc::channel(4);
        crate::stream::set_tcp_timings(&spec.tcp);
        let shared = Arc::new(Shared {
            snapshot,
            changes: changes.clone(),
            cancel: CancelRegistry::default(),
            metrics: Metrics::new(),
            sessions: Mutex::new(HashMap::default()),
            next_session: AtomicU64::new(1),
            server_connect_timeout: Mutex::new(spec.server_connect_timeout),
            services: Mutex::new(HashMap::new()),
            accepting: AtomicBool::new(true),
            ending: AtomicBool::new(false),
            ending_signal: tokio::sync::watch::Sender::new(false),
            logging_in: AtomicU64::new(0),
            consoles: Mutex::new(HashMap::new()),
            pools: Mutex::new(HashMap::new()),
            limits: Mutex::new(HashMap::new()),
            paused: Mutex::new(HashMap::new()),
            refusals: Mutex::new(HashMap::new()),
            any_refusal: AtomicBool::new(false),
            clients: AtomicU64::new(0),
            max_client_conn: AtomicU64::new(spec.max_client_conn as u64),
            admin_users: Mutex::new(Vec::new()),
            http_credentials: Mutex::new(None),
            settings_view: Mutex::new(Vec::new()),
            reload: reload_tx,
            reload_rx: Mutex::new(Some(reload_rx)),
            shutdown: Arc::new(tokio::sync::Notify::new()),
            disabled: Mutex::new(Default::default()),
            any_disabled: AtomicBool::new(false),
            pool_overrides: Mutex::new(PoolOverrides::default()),
            tls: arc_swap::ArcSwapOption::empty(),
            client_tls: Mutex::new(ClientTlsMode::Disable),
            server_tls: Arc::new(ArcSwap::from_pointee(Default::default())),
            auth: arc_swap::ArcSwapOption::empty(),
            auth_timeout: Mutex::new(Duration::from_secs(60)),
            workers: crate::workers::Workers::start(spec.worker_threads, spec.worker_fill)
                .map_err(|source| ProxyError::Workers { source })?,
            pool_affinity: spec.pool_affinity,
            stats_period: Mutex::new(spec.stats_period),
            stats_span: Mutex::new(Duration::ZERO),
            gone_totals: Mutex::new(Default::default()),
        });
        let router = tokio::spawn(route_changes(shared.clone(), changes));
        let stats_roller = tokio::spawn(roll_stats(shared.clone()));
        let mut proxy = Proxy {
            shared,
            listeners: HashMap::new(),
            unix: HashMap::new(),
            http: None,
            router,
            stats_roller,
            shutdown_timeout: spec.shutdown_timeout,
            spec: None,
        };
        proxy.apply(spec).await?;
        Ok(proxy)
    }

    /// The spec last applied.
    pub fn spec(&self) -> &ProxySpec {
        self.spec.as_ref().expect("applied at start")
    }

    /// The address each service listens on (useful with port 0 in tests).
    pub fn service_addrs(&self) -> HashMap<String, SocketAddr> {
        self.listeners
            .iter()
            .map(|(n, l)| (n.clone(), l.addr))
            .collect()
    }

    /// The HTTP port's address.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(|(a, _)| *a)
    }

    /// Makes the HTTP port's `POST /pause` and `/resume` require the
    /// user and password `source` gives at each request (in agent mode,
    /// the REST API's, which a reload may change); `source` giving `None`
    /// leaves them to clients on this machine.
    pub fn set_http_credentials(&self, source: CredentialSource) {
        *self.shared.http_credentials.lock().expect("poisoned") = Some(source);
    }

    /// A switch to make services refuse new transactions.
    pub fn refusal_switch(&self) -> RefusalSwitch {
        RefusalSwitch(self.shared.clone())
    }

    /// The admin console's requests for a configuration reload, each to be
    /// answered with the reload's outcome (the error a client is shown).
    /// There is one receiver: later calls get `None`.
    pub fn reload_requests(&self) -> Option<tokio::sync::mpsc::Receiver<ReloadReply>> {
        self.shared.reload_rx.lock().expect("poisoned").take()
    }

    /// Notified when the admin console asks pgwarden to shut down.
    pub fn shutdown_requests(&self) -> Arc<tokio::sync::Notify> {
        self.shared.shutdown.clone()
    }

    /// Number of client sessions currently relayed.
    pub fn session_count(&self) -> usize {
        self.shared.sessions.lock().expect("poisoned").len()
    }

    /// Whether a shutdown still has clients to wait for: sessions, and
    /// clients logging in (which may go on to be sessions).
    fn clients_to_wait_for(&self) -> bool {
        self.shared.logging_in.load(Ordering::SeqCst) > 0
            || !self.shared.sessions.lock().expect("poisoned").is_empty()
    }

    /// Applies a new spec (a reload): services whose address is unchanged
    /// keep their listener and get the new routing rules for new sessions;
    /// changed addresses are rebound; removed services stop accepting.
    /// Existing sessions are never dropped. On a bind error nothing that
    /// was already serving is changed for that service.
    pub async fn apply(&mut self, spec: ProxySpec) -> Result<(), ProxyError> {
        let first = self.spec.is_none();
        // Files first, so that one that does not load leaves nothing half
        // applied. `None`: keep what is in force (on a reload, a file that
        // broke after `check_spec` passed; at start that is an error).
        let client_tls = match &spec.tls {
            Some(t) => match crate::stream::tls_acceptor(&t.cert, &t.key, t.client_ca.as_deref()) {
                Ok(acceptor) => Some(Some(acceptor)),
                Err(e) => {
                    tracing::error!(error = %e, "cannot load the TLS certificate");
                    if self.shared.tls.load().is_none() {
                        return Err(ProxyError::Tls(e));
                    }
                    None
                }
            },
            None => Some(None),
        };
        let server_tls = match crate::stream::ServerTls::new(
            spec.server_tls,
            spec.server_ca.as_deref(),
        ) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(error = %e, "cannot load the TLS settings for server connections");
                if first {
                    return Err(ProxyError::Tls(e));
                }
                None
            }
        };
        let auth = match &spec.auth {
            Some(a) => match crate::auth::Authenticator::new(
                a.clone(),
                spec.tls.as_ref().is_some_and(|t| t.client_ca.is_some()),
            ) {
                Ok(auth) => Some(Some(auth)),
                Err(e) => {
                    tracing::error!(error = %e, "cannot load the authentication settings");
                    if self.shared.auth.load().is_none() {
                        return Err(ProxyError::Auth(e));
                    }
                    None
                }
            },
            None => Some(None),
        };
        // Listeners first: every new address is bound before anything
        // else changes, so that a reload with an address that cannot be
        // bound (in use, not local) changes nothing and keeps every
        // listener where it was.
        let wanted: Vec<String> = spec.services.iter().map(|s| s.name.clone()).collect();
        // Listeners that go or move are closed before any is bound: in one
        // reload a service may take the address another gives up (a rename,
        // two services swapping ports, a service moving onto the HTTP port).
        let stays = |name: &str, addr: SocketAddr| {
            spec.services.iter().any(|s| {
                s.name == name
                    && (addr == s.listen || (s.listen.port() == 0 && addr.ip() == s.listen.ip()))
            })
        };
        let moving: Vec<String> = self
            .listeners
            .iter()
            .filter(|(name, l)| !stays(name, l.addr))
            .map(|(name, _)| name.clone())
            .collect();
        // Only those whose address a new listener needs are closed first;
        // the others go on taking clients until every new address is
        // bound, and then close: a reload that fails leaves them as they
        // were even when their address could not be bound again (an
        // address taken off the interface still serves its socket).
        let overlaps = |a: SocketAddr, b: SocketAddr| {
            a.port() == b.port()
                && b.port() != 0
                && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
        };
        let needed = |addr: SocketAddr| {
            spec.services.iter().any(|s| overlaps(addr, s.listen))
                || spec.http.is_some_and(|h| overlaps(addr, h))
        };
        let mut stopped: Vec<(String, Listener)> = Vec::new();
        let mut retiring: Vec<String> = Vec::new();
        for name in moving {
            let in_the_way = self.listeners.get(&name).is_some_and(|l| needed(l.addr));
            if !in_the_way {
                retiring.push(name);
                continue;
            }
            if let Some(l) = self.listeners.remove(&name) {
                l.task.stop();
                stopped.push((name, l));
            }
        }
        let http_moves = match (&self.http, spec.http) {
            (Some((addr, _)), Some(want)) => *addr != want && want.port() != 0,
            (Some(_), None) => true,
            (None, _) => false,
        };
        let old_http = if http_moves {
            self.http.take().map(|(addr, t)| {
                t.abort();
                addr
            })
        } else {
            None
        };
        let mut bound: HashMap<String, (std::net::TcpListener, SocketAddr)> = HashMap::new();
        let mut failed = None;
        for svc in &spec.services {
            if self.listeners.contains_key(&svc.name) && !retiring.contains(&svc.name) {
                continue;
            }
            match bind_for_worker(svc.listen).await {
                Ok(b) => {
                    bound.insert(svc.name.clone(), b);
                }
                Err(source) => {
                    tracing::error!(service = %svc.name, addr = %svc.listen, error = %source, "cannot listen");
                    failed = Some(ProxyError::Bind {
                        service: svc.name.clone(),
                        addr: svc.listen,
                        source,
                    });
                    break;
                }
            }
        }
        let mut http_listener = None;
        if let (None, Some(want)) = (&failed, spec.http) {
            let needed = match &self.http {
                Some((addr, _)) => *addr != want && want.port() != 0,
                None => true,
            };
            if needed {
                match bind_retrying(want).await {
                    Ok(l) => http_listener = Some(l),
                    Err(source) => {
                        tracing::error!(addr = %want, error = %source, "cannot listen for HTTP");
                        failed = Some(ProxyError::Bind {
                            service: "http".into(),
                            addr: want,
                            source,
                        });
                    }
                }
            }
        }
        if let Some(err) = failed {
            // Back as it was: the new sockets close, the old ones open again
            // with the services they served.
            drop(bound);
            drop(http_listener);
            for (name, l) in stopped {
                match bind_for_worker(l.addr).await {
                    Ok((listener, addr)) => {
                        let task = Arc::new(AcceptTask::default());
                        task.start(
                            &self.shared,
                            l.service.clone(),
                            listener,
                            crate::workers::NONE,
                        );
                        self.listeners.insert(
                            name,
                            Listener {
                                addr,
                                service: l.service,
                                task,
                            },
                        );
                    }
                    Err(e) => {
                        tracing::error!(service = %name, addr = %l.addr, error = %e, "cannot listen at the old address again: the service takes no new clients until a reload binds it");
                    }
                }
            }
            if let Some(old) = old_http {
                match bind_retrying(old).await {
                    Ok(l) => self.serve_http(l, old),
                    Err(e) => {
                        tracing::error!(addr = %old, error = %e, "cannot listen for HTTP at the old address again")
                    }
                }
            }
            return Err(err);
        }
        for name in retiring {
            if let Some(l) = self.listeners.remove(&name) {
                l.task.stop();
                stopped.push((name, l));
            }
        }
        self.spec = Some(spec.clone());
        *self.shared.server_connect_timeout.lock().expect("poisoned") = spec.server_connect_timeout;
        self.shared
            .max_client_conn
            .store(spec.max_client_conn as u64, Ordering::Relaxed);
        *self.shared.admin_users.lock().expect("poisoned") = spec.admin_users.clone();
        {
            let mut view = self.shared.settings_view.lock().expect("poisoned");
            let mut fresh = spec.settings.clone();
            // What a reload cannot change shows what is in force.
            for (key, value, _) in &mut fresh {
                if crate::admin::RESTART_ONLY.contains(&key.as_str()) {
                    if let Some((_, running, _)) = view.iter().find(|(k, _, _)| k == key) {
                        value.clone_from(running);
                    }
                }
            }
            *view = fresh;
        }
        *self.shared.stats_period.lock().expect("poisoned") = spec.stats_period;
        *self.shared.pool_overrides.lock().expect("poisoned") = spec.pool_overrides.clone();
        // Pools that exist take the new settings too: resolved as for a
        // client of the service that made them. Pools are shared by the
        // services of a kind (read-write or read-only), so when that
        // service is gone or no longer pools, another of the same kind
        // that pools stands in: its clients may well be using the pool.
        // Only a pool no service pools any more keeps its settings, for
        // the clients it has.
        for pool in self.shared.pools.lock().expect("poisoned").values() {
            let resolve = |svc: &ServiceSpec| {
                spec.pool_overrides
                    .resolve(svc, &pool.key.database, &pool.key.user)
            };
            let resolved = pool
                .service
                .get()
                .and_then(|name| spec.services.iter().find(|s| *s.name == **name))
                .and_then(resolve)
                .or_else(|| {
                    // One that wants the same kind of host (the primary,
                    // or not) if there is one, so that the pool's
                    // settings keep the behaviour its clients had.
                    let wants_primary = pool.settings().wants_primary;
                    let same_kind: Vec<Arc<crate::pool::PoolSettings>> = spec
                        .services
                        .iter()
                        .filter(|s| s.read_only == pool.key.read_only)
                        .filter_map(resolve)
                        .collect();
                    same_kind
                        .iter()
                        .find(|st| st.wants_primary == wants_primary)
                        .or(same_kind.first())
                        .cloned()
                });
            if let Some(settings) = resolved {
                pool.update(&settings);
            }
            pool.set_connect_limit(spec.server_connect_timeout);
        }
        for ((_, kind, name), limit) in self.shared.limits.lock().expect("poisoned").iter() {
            limit.set_max(self.shared.limit_of(*kind, name));
        }
        if let Some(acceptor) = client_tls {
            self.shared.tls.store(acceptor.map(Arc::new));
            *self.shared.client_tls.lock().expect("poisoned") =
                spec.tls.as_ref().map_or(ClientTlsMode::Disable, |t| t.mode);
        }
        if let Some(t) = server_tls {
            self.shared.server_tls.store(Arc::new(t));
        }
        *self.shared.auth_timeout.lock().expect("poisoned") = spec.auth_timeout;
        crate::stream::set_tcp_timings(&spec.tcp);
        if let Some(auth) = auth {
            self.shared.auth.store(auth.map(Arc::new));
        }
        self.shutdown_timeout = spec.shutdown_timeout;
        let mut first_err = None;
        // With the handle their clients' service is read from, which the
        // new listener takes over: the Unix socket of a service whose
        // port stays (only the address changes) keeps following it.
        let mut given_up: HashMap<String, Arc<ArcSwap<Service>>> = HashMap::new();
        for (name, l) in stopped {
            if wanted.contains(&name) {
                given_up.insert(name, l.service);
            } else {
                // The series goes under the services' lock, which a
                // scrape holds while it sets the series of the services
                // it finds: one racing this reload cannot bring it back.
                let mut services = self.shared.services.lock().expect("poisoned");
                services.remove(&name);
                // A pause ends with its service: clients still waiting
                // go on, and a service added again under the name
                // does not start paused.
                if let Some(switch) = self.shared.paused.lock().expect("poisoned").get(&name) {
                    switch.send_replace(false);
                }
                self.shared
                    .metrics
                    .service_paused
                    .remove(&crate::metrics::ServiceLabel {
                        service: name.clone(),
                    });
                drop(services);
                tracing::info!(service = %name, "service removed; its sessions continue");
            }
        }
        for svc in spec.services {
            let name = svc.name.clone();
            let service = Service {
                selector: Selector::new(svc.policy.clone()),
                name: Arc::from(svc.name.as_str()),
                spec: svc.clone(),
                home_hint: AtomicUsize::new(crate::workers::NONE),
                handles: ServiceHandles::new(&self.shared, &svc.name),
                recent_pool: Default::default(),
            };
            if let Some(l) = self.listeners.get(&name) {
                let previous = l.service.load_full();
                service.selector.continue_from(&previous.selector);
                let hint = previous.home_hint.load(Ordering::Relaxed);
                service.home_hint.store(hint, Ordering::Relaxed);
                l.service.store(Arc::new(service));
                continue;
            }
            let Some((listener, addr)) = bound.remove(&name) else {
                continue;
            };
            let handle = match given_up.get(&name) {
                Some(handle) => {
                    service.selector.continue_from(&handle.load().selector);
                    handle.store(Arc::new(service));
                    handle.clone()
                }
                None => Arc::new(ArcSwap::from_pointee(service)),
            };
            // Accepting on a worker rather than here saves a thread
            // wake-up per connection: the clients served by the worker
            // that accepted them need none.
            let task = Arc::new(AcceptTask::default());
            task.start(&self.shared, handle.clone(), listener, crate::workers::NONE);
            self.listeners.insert(
                name.clone(),
                Listener {
                    addr,
                    service: handle.clone(),
                    task,
                },
            );
            self.shared
                .services
                .lock()
                .expect("poisoned")
                .insert(name.clone(), handle);
            tracing::info!(service = %name, %addr, "listening");
        }
        if let Err(e) = self.apply_unix(spec.unix_socket_dir.as_deref()) {
            first_err.get_or_insert(e);
        }
        if let (Some(listener), Some(want)) = (http_listener, spec.http) {
            self.serve_http(listener, want);
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Serves the HTTP port on `listener` (bound for `want`).
    fn serve_http(&mut self, listener: TcpListener, want: SocketAddr) {
        let addr = listener.local_addr().unwrap_or(want);
        let app = crate::http::router(self.shared.clone());
        let task = tokio::spawn(crate::http::serve(listener, app));
        if let Some((_, old)) = self.http.replace((addr, task)) {
            old.abort();
        }
        tracing::info!(%addr, "HTTP listening");
    }

    /// Brings the Unix-domain listeners in line with the services' TCP
    /// ports and `dir`: one socket per service, `.s.PGSQL.PORT`.
    fn apply_unix(&mut self, dir: Option<&std::path::Path>) -> Result<(), ProxyError> {
        let wanted: HashMap<String, std::path::PathBuf> = match dir {
            None => HashMap::new(),
            Some(dir) => self
                .listeners
                .iter()
                .map(|(name, l)| {
                    (
                        name.clone(),
                        dir.join(format!(".s.PGSQL.{}", l.addr.port())),
                    )
                })
                .collect(),
        };
        // Sockets no longer wanted at all go, and so do those whose path
        // another service takes over (services swapping ports): that path
        // cannot be bound while its old listener holds it.
        let taken: std::collections::HashSet<&std::path::PathBuf> = wanted.values().collect();
        let unwanted: Vec<String> = self
            .unix
            .iter()
            .filter(|(name, (path, _))| match wanted.get(*name) {
                None => true,
                Some(mine) => mine != path && taken.contains(path),
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in unwanted {
            if let Some((path, task)) = self.unix.remove(&name) {
                task.abort();
                let _ = std::fs::remove_file(&path);
            }
        }
        // A socket that moves is bound at its new path before the old one
        // goes: a path that cannot be bound (a directory that does not
        // exist) leaves the old socket serving.
        let mut first_err = None;
        for (name, path) in wanted {
            if self.unix.get(&name).is_some_and(|(old, _)| *old == path) {
                continue;
            }
            let Some(service) = self.listeners.get(&name).map(|l| l.service.clone()) else {
                continue;
            };
            match bind_unix(&path) {
                Ok(listener) => {
                    tracing::info!(service = %name, path = %path.display(), "listening");
                    let task =
                        tokio::spawn(unix_accept_loop(self.shared.clone(), service, listener));
                    if let Some((old, task)) = self.unix.insert(name, (path, task)) {
                        task.abort();
                        let _ = std::fs::remove_file(&old);
                    }
                }
                Err(source) => {
                    tracing::error!(service = %name, path = %path.display(), error = %source, "cannot listen");
                    first_err.get_or_insert(ProxyError::BindUnix {
                        service: name,
                        path,
                        source,
                    });
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn stop_unix(&mut self) {
        for (_, (path, task)) in self.unix.drain() {
            task.abort();
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Stops accepting, lets sessions finish for up to the shutdown
    /// time-out, then ends the rest with an error that says why.
    pub async fn shutdown(self) {
        self.shutdown_unless(std::future::pending()).await;
    }

    /// [`Proxy::shutdown`], with the wait for sessions cut short when
    /// `hurry` resolves (an operator's second Ctrl-C): the sessions are
    /// then told to end at once.
    pub async fn shutdown_unless(mut self, hurry: impl std::future::Future<Output = ()>) {
        self.shared.accepting.store(false, Ordering::SeqCst);
        for (_, l) in self.listeners.drain() {
            l.task.stop();
        }
        self.stop_unix();
        let deadline = tokio::time::Instant::now() + self.shutdown_timeout;
        let mut changes = self.shared.changes.clone();
        let mut hurry = std::pin::pin!(hurry);
        while self.clients_to_wait_for() && tokio::time::Instant::now() < deadline {
            tokio::select! {
                _ = crate::timer::sleep(Duration::from_millis(50)) => {}
                _ = changes.changed() => {}
                () = &mut hurry => break,
            }
        }
        self.shared.ending.store(true, Ordering::SeqCst);
        self.shared.ending_signal.send_replace(true);
        {
            let sessions = self.shared.sessions.lock().expect("poisoned");
            for e in sessions.values() {
                e.kill(Kill::Shutdown);
            }
        }
        let grace = tokio::time::Instant::now() + Duration::from_secs(2);
        while self.clients_to_wait_for() && tokio::time::Instant::now() < grace {
            crate::timer::sleep(Duration::from_millis(20)).await;
        }
        self.router.abort();
        self.stats_roller.abort();
        if let Some((_, t)) = self.http.take() {
            t.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop_unix();
        self.shared.workers.stop();
        self.router.abort();
        self.stats_roller.abort();
        for l in self.listeners.values() {
            l.task.stop();
        }
        if let Some((_, t)) = &self.http {
            t.abort();
        }
    }
}

/// Binds a Unix-domain socket at `path`, replacing a socket file left by
/// a process that is gone (nothing answers on it); anything else there is
/// an error. Anyone may connect, as to PostgreSQL's socket: who gets in is
/// for the hba rules (`local` lines) to say.
fn bind_unix(path: &std::path::Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "a file that is not a socket is in the way",
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another process is listening on it",
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777))?;
    Ok(listener)
}

/// Counts a new client against `max_client_conn`: false, with the
/// refusal counted and the client not, when it would go over.
fn admit(shared: &Shared, svc: &Service) -> bool {
    let n = shared.clients.fetch_add(1, Ordering::Relaxed) + 1;
    if n > shared.max_client_conn.load(Ordering::Relaxed) {
        shared.clients.fetch_sub(1, Ordering::Relaxed);
        shared.metrics.error(&svc.spec.name, "max_client_conn");
        return false;
    }
    true
}

/// A socket taken out of this runtime for worker `target`; when that
/// fails, the client's counts (see [`admit`]) are given back.
fn handed<T>(shared: &Shared, target: usize, socket: std::io::Result<T>) -> Option<T> {
    match socket {
        Ok(s) => Some(s),
        Err(e) => {
            shared.clients.fetch_sub(1, Ordering::Relaxed);
            shared.workers.leave(target);
            tracing::warn!(error = %e, "handing a connection to a worker failed");
            None
        }
    }
}

/// Accepts Unix-domain clients here and hands each to a worker
/// ([`crate::workers::Workers::pick`]), as TCP clients are.
async fn unix_accept_loop(
    shared: Arc<Shared>,
    service: Arc<ArcSwap<Service>>,
    listener: tokio::net::UnixListener,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                crate::timer::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let svc = service.load_full();
        if !admit(&shared, &svc) {
            tokio::spawn(crate::session::refuse_busy(shared.clone(), stream));
            continue;
        }
        let target = shared.workers.pick();
        shared.workers.enter(target);
        let Some(stream) = handed(&shared, target, stream.into_std()) else {
            continue;
        };
        let session = crate::session::run(
            shared.clone(),
            svc,
            crate::session::Accepted::Local(stream),
            crate::session::LOCAL_PEER,
            target,
        );
        // Boxed for the reason given in `accept_loop`.
        drop(shared.workers.spawn_on(target, Box::pin(session)));
    }
}

/// Binds `addr`, waiting a moment for a listener this process just closed
/// there (on another thread) to let go of it.
async fn bind_retrying(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let mut tries = 0;
    loop {
        match TcpListener::bind(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 20 => {
                tries += 1;
                crate::timer::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

/// Binds `addr` here, so that errors are reported to the caller, and hands
/// the socket over for a worker's event loop to register.
async fn bind_for_worker(addr: SocketAddr) -> std::io::Result<(std::net::TcpListener, SocketAddr)> {
    let listener = bind_retrying(addr).await?;
    let local = listener.local_addr().unwrap_or(addr);
    if let Err(e) = defer_accept(&listener) {
        tracing::debug!(error = %e, "TCP_DEFER_ACCEPT not set");
    }
    Ok((listener.into_std()?, local))
}

/// A PostgreSQL client speaks first, so the kernel may keep a new
/// connection until its first bytes (the SSLRequest or start-up packet)
/// arrive: accepting it and reading them then take one wake-up of the
/// worker instead of two. A client that stays silent is handed over
/// anyway after about a second, and `auth_timeout` deals with it.
#[allow(unsafe_code)]
fn defer_accept(listener: &TcpListener) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let secs: libc::c_int = 1;
    // SAFETY: a valid socket descriptor, and a pointer to a c_int that
    // lives for the call with its exact size.
    let r = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&secs as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Accepts clients and shares them out among the workers
/// ([`crate::workers::Workers::pick`]), or for a pooled service sends
/// them to the worker of its usual pool. The loop moves itself to where
/// its next clients are likely to go, so that such a client is served by
/// the thread that accepted it, with no other thread woken and its socket
/// registered once.
async fn accept_loop(
    shared: Arc<Shared>,
    service: Arc<ArcSwap<Service>>,
    listener: std::net::TcpListener,
    task: Arc<AcceptTask>,
) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot register a listener");
            return;
        }
    };
    let here = crate::workers::current();
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let svc = service.load_full();
                if !admit(&shared, &svc) {
                    tokio::spawn(crate::session::refuse_busy(shared.clone(), stream));
                    continue;
                }
                let hint = if shared.pool_affinity {
                    svc.home_hint.load(Ordering::Relaxed)
                } else {
                    crate::workers::NONE
                };
                let target = if hint == crate::workers::NONE {
                    shared.workers.pick()
                } else {
                    hint
                };
                shared.workers.enter(target);
                if target == here {
                    // Boxed: tokio moves a task's future by value several
                    // times while spawning it and again as it finishes, a
                    // copy of the whole session future (over a kilobyte)
                    // each time, where a box moves as a pointer. Not
                    // wrapped in a block, which would hold the future
                    // twice. The session gives its slots back.
                    drop(tokio::spawn(Box::pin(crate::session::run(
                        shared.clone(),
                        svc,
                        crate::session::Accepted::Here(stream),
                        peer,
                        target,
                    ))));
                    continue;
                }
                // The socket leaves this runtime's epoll for the worker's:
                // its readiness is then reported on the thread that serves
                // it.
                let Some(stream) = handed(&shared, target, stream.into_std()) else {
                    continue;
                };
                let session = crate::session::run(
                    shared.clone(),
                    svc,
                    crate::session::Accepted::Handed(stream),
                    peer,
                    target,
                );
                // Boxed, as above.
                drop(shared.workers.spawn_on(target, Box::pin(session)));
                // Follow the usual pool, or the worker being filled, so
                // that the next clients need no hand-over. Moving costs
                // about what handing one client over does, and happens
                // only when the usual pool changes worker or a worker is
                // full; not while clients are shared out in turn.
                let follow = hint != crate::workers::NONE
                    || (shared.workers.fills() && shared.workers.filling(target));
                if !follow {
                    continue;
                }
                match listener.into_std() {
                    Ok(l) => task.start(&shared, service, l, target),
                    Err(e) => tracing::error!(error = %e, "cannot move a listener between workers"),
                }
                return;
            }
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                crate::timer::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Ends a stats period for every pool every `stats_period` (read anew
/// each time, so a reload changes it from the next period on).
async fn roll_stats(shared: Arc<Shared>) {
    let mut last = std::time::Instant::now();
    loop {
        let period = *shared.stats_period.lock().expect("poisoned");
        crate::timer::sleep(period).await;
        let now = std::time::Instant::now();
        for pool in shared.pools.lock().expect("poisoned").values() {
            pool.stats.roll();
        }
        *shared.stats_span.lock().expect("poisoned") = now - last;
        last = now;
    }
}

/// How long a pool without `server_idle_timeout` may stay unused before it
/// is removed.
const UNUSED_POOL_TIMEOUT: Duration = Duration::from_secs(600);

/// Off the traffic path: on every topology change, end the sessions whose
/// host is no longer right for them.
/// Why a relayed session wanting `want`, on the host at `idx` of `topo`
/// (`None`: no longer listed), must end, if it must.
pub(crate) fn relayed_kill(
    topo: &pgwarden_topology::Topology,
    idx: Option<usize>,
    want: &Want,
) -> Option<Kill> {
    let Some(i) = idx else {
        return Some(Kill::HostRemoved);
    };
    if !topo.hosts()[i].alive {
        Some(Kill::HostDown)
    } else if *want == Want::Primary && !topo.reaches_primary(i) {
        Some(Kill::NotPrimary)
    } else {
        None
    }
}

async fn route_changes(shared: Arc<Shared>, mut changes: watch::Receiver<u64>) {
    while changes.changed().await.is_ok() {
        let snap = shared.snapshot.load_full();
        let topo = &snap.topology;
        let index: HashMap<&HostAddr, usize> = topo
            .hosts()
            .iter()
            .enumerate()
            .map(|(i, h)| (&h.config.addr, i))
            .collect();
        {
            // Pools whose host is gone, or is no longer the primary their
            // service needs, retire: idle connections close, waiting clients
            // pick a host again, clients mid-transaction are told.
            let mut pools = shared.pools.lock().expect("poisoned");
            pools.retain(|key, pool| {
                pool.prune();
                pool.warm();
                let idx = index.get(&key.host).copied();
                let alive = idx.is_some_and(|i| topo.hosts()[i].alive);
                let keep = alive
                    && (!pool.settings().wants_primary
                        || idx.is_some_and(|i| topo.reaches_primary(i)));
                if !keep {
                    tracing::info!(host = %key.host, database = %key.database, user = %key.user, "retiring pool");
                    pool.retire();
                    shared.keep_totals(pool);
                    return false;
                }
                // A pool that has had no server connection and no client
                // for a server_idle_timeout goes, with its metric series;
                // its next client makes it again.
                let quiet = pool
                    .settings()
                    .server_idle_timeout
                    .unwrap_or(UNUSED_POOL_TIMEOUT);
                if pool.unused_for(quiet) {
                    tracing::debug!(host = %key.host, database = %key.database, user = %key.user, "removing an unused pool");
                    pool.retire();
                    shared.keep_totals(pool);
                    return false;
                }
                true
            });
            // Caps with no pool left under them go too (a new pool makes
            // its caps again, with the configured values). Under the pools'
            // lock, as pools are made.
            shared
                .limits
                .lock()
                .expect("poisoned")
                .retain(|_, l| !l.unused());
        }
        // A pooled client's server is known by its socket address: the
        // addresses of the hosts that are down, looked up here, off the
        // traffic path (and before the sessions lock is taken).
        // Relayed sessions first: their hosts are known by name, so no
        // lookup below (up to a second each, for hosts listed by name)
        // delays ending them.
        {
            let sessions = shared.sessions.lock().expect("poisoned");
            for e in sessions.values() {
                let Some(host) = &e.host else { continue };
                if e.is_killed() {
                    continue;
                }
                if let Some(k) = relayed_kill(topo, index.get(host).copied(), &e.want) {
                    tracing::info!(service = %e.service, host = %host, reason = ?k, "ending session");
                    e.kill(k);
                }
            }
        }
        let mut down: Vec<std::net::SocketAddr> = Vec::new();
        for h in topo.hosts().iter().filter(|h| !h.alive) {
            let addr = &h.config.addr;
            match addr.host.parse::<std::net::IpAddr>() {
                Ok(ip) => down.push((ip, addr.port).into()),
                Err(_) => {
                    let lookup = tokio::net::lookup_host((addr.host.as_str(), addr.port));
                    if let Ok(Ok(found)) =
                        crate::timer::timeout(Duration::from_secs(1), lookup).await
                    {
                        down.extend(found);
                    }
                }
            }
        }
        if down.is_empty() {
            continue;
        }
        let sessions = shared.sessions.lock().expect("poisoned");
        for e in sessions.values() {
            if e.is_killed() {
                continue;
            }
            if let (None, Some(slot)) = (&e.host, &e.pooled) {
                // A pooled client mid-transaction on a host that went
                // down would otherwise wait for the kernel to give up on
                // a silent socket; between transactions it holds none.
                if let (Some(backend), _) = slot.state() {
                    if down.contains(&backend.server) {
                        tracing::info!(service = %e.service, server = %backend.server, "ending pooled session: its server is down");
                        e.kill(Kill::HostDown);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod unix_tests {
    use super::bind_unix;

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_anything_else_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".s.PGSQL.6432");
        // A socket file nobody listens on, as a crashed process leaves it.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let live = bind_unix(&path).expect("the stale socket is replaced");
        // One that answers belongs to someone.
        let err = bind_unix(&path).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
        drop(live);
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, "not a socket").unwrap();
        let err = bind_unix(&path).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "not a socket");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `default` service bypasses the pool: no per-database or
    /// per-user pool mode, nor reused session servers, pools its clients.
    #[test]
    fn a_direct_service_is_never_pooled() {
        let spec = |direct| ServiceSpec {
            name: "admin".into(),
            listen: "127.0.0.1:1".parse().unwrap(),
            want: Want::Primary,
            policy: SelectPolicy::default(),
            read_only: false,
            connect_wait_timeout: Duration::from_secs(1),
            pool: None,
            direct,
        };
        let overrides = PoolOverrides {
            databases: HashMap::from([("app".to_string(), (Some(true), None))]),
            reuse_session_servers: true,
            ..PoolOverrides::default()
        };
        assert!(overrides.resolve(&spec(false), "app", "u").is_some());
        assert!(overrides.resolve(&spec(false), "other", "u").is_some());
        assert!(overrides.resolve(&spec(true), "app", "u").is_none());
        assert!(overrides.resolve(&spec(true), "other", "u").is_none());
    }
}
