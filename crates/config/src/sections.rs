//! The resolved configuration, one type per section of the file.
//!
//! These are plain values with every default filled in; the serde-facing
//! shapes, which must keep optional keys and source positions apart, live
//! in `raw` and never leave the crate.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use pgwarden_topology::{HostConfig, LagLimit, TopologyConfig};
use serde::Deserialize;

/// `[cluster]`: the PostgreSQL servers and how the prober talks to them.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// The managed servers, in file order. Never empty, no duplicates.
    pub hosts: Vec<HostConfig>,
    /// Role the prober logs in as.
    pub user: String,
    /// Database the prober connects to.
    pub dbname: String,
    /// Password written in the file, if any.
    pub password: Option<String>,
    /// File whose first line is the password; never set together with
    /// `password`.
    pub password_file: Option<PathBuf>,
    /// Time between the starts of two probe rounds; never zero.
    pub probe_interval: Duration,
    /// Longest a probe connection attempt may take; never zero.
    pub connect_timeout: Duration,
    /// Longest the probe query may take; never zero.
    pub query_timeout: Duration,
    /// Doubtful probe failures in a row before a host that was up counts
    /// as down; at least 1.
    pub down_after_failures: u32,
    /// Default RTT window for round-robin services.
    pub rtt_threshold: Duration,
    /// Whether services apply the RTT window unless they say otherwise.
    pub rtt_threshold_enabled: bool,
    /// Replicas further behind than this many WAL bytes stop taking reads.
    pub max_replica_lag_bytes: Option<u64>,
    /// Replicas whose replay is further behind than this stop taking reads.
    pub max_replica_lag: Option<Duration>,
    /// How long an excluded replica must stay within the lag limits before
    /// it is readmitted.
    pub lag_hold: Duration,
}

impl ClusterConfig {
    /// A cluster section with the given hosts and every other key at its
    /// default.
    pub fn new(hosts: Vec<HostConfig>) -> Self {
        ClusterConfig {
            hosts,
            user: "postgres".into(),
            dbname: "postgres".into(),
            password: None,
            password_file: None,
            probe_interval: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            query_timeout: Duration::from_secs(2),
            down_after_failures: TopologyConfig::default().down_after_failures,
            rtt_threshold: Duration::from_millis(20),
            rtt_threshold_enabled: true,
            max_replica_lag_bytes: None,
            max_replica_lag: None,
            lag_hold: TopologyConfig::default().lag_hold,
        }
    }

    /// The topology tunables these settings imply.
    pub fn topology_config(&self) -> TopologyConfig {
        let limited = self.max_replica_lag_bytes.is_some() || self.max_replica_lag.is_some();
        TopologyConfig {
            max_replica_lag: limited.then_some(LagLimit {
                bytes: self.max_replica_lag_bytes,
                time: self.max_replica_lag,
            }),
            lag_hold: self.lag_hold,
            down_after_failures: self.down_after_failures,
        }
    }

    /// The hosts, as the topology wants them.
    pub fn host_configs(&self) -> Vec<HostConfig> {
        self.hosts.clone()
    }
}

// Written by hand so that a password never ends up in a log line through
// `{:?}`.
impl fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("hosts", &self.hosts)
            .field("user", &self.user)
            .field("dbname", &self.dbname)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("password_file", &self.password_file)
            .field("probe_interval", &self.probe_interval)
            .field("connect_timeout", &self.connect_timeout)
            .field("query_timeout", &self.query_timeout)
            .field("down_after_failures", &self.down_after_failures)
            .field("rtt_threshold", &self.rtt_threshold)
            .field("rtt_threshold_enabled", &self.rtt_threshold_enabled)
            .field("max_replica_lag_bytes", &self.max_replica_lag_bytes)
            .field("max_replica_lag", &self.max_replica_lag)
            .field("lag_hold", &self.lag_hold)
            .finish()
    }
}

/// `[listen]`: where the two default services and the HTTP endpoint
/// accept connections, after deriving the ones the file left out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenConfig {
    /// The `read_write` service.
    pub read_write: SocketAddr,
    /// The `read_only` service.
    pub read_only: SocketAddr,
    /// The HTTP status and metrics endpoint.
    pub http: SocketAddr,
    /// A directory where every service also listens on a Unix-domain
    /// socket, `.s.PGSQL.PORT` after its TCP port (libpq's naming).
    pub unix_socket_dir: Option<std::path::PathBuf>,
}

/// `[engine]`: the proxy runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Worker threads; `None` sizes the pool from the core count, see
    /// [`EngineConfig::effective_worker_threads`].
    pub worker_threads: Option<usize>,
    /// Pooled clients of one (service, database, user) move, once logged
    /// in, to one worker thread chosen by those names.
    pub pool_affinity: bool,
    /// Clients a worker takes before new ones go to the next worker;
    /// 0 shares them out in turn.
    pub worker_fill: usize,
    /// How long a new client may wait for an eligible host to appear
    /// (during a failover, say) before it is turned away.
    pub connect_wait_timeout: Duration,
    /// Longest a connection to a PostgreSQL server may take to open.
    pub server_connect_timeout: Duration,
    /// On shutdown, how long to let clients finish before closing them.
    pub shutdown_timeout: Duration,
    /// TCP keepalive and retransmission timings of client and server
    /// connections.
    pub tcp: TcpTimings,
}

/// TCP timings of every client and server connection, as PostgreSQL's
/// `tcp_keepalives_*` and `tcp_user_timeout` settings name them; `None`
/// keeps the system's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpTimings {
    /// Idle time before the first keepalive probe (whole seconds).
    pub keepalives_idle: Option<Duration>,
    /// Time between unanswered probes (whole seconds).
    pub keepalives_interval: Option<Duration>,
    /// Unanswered probes before the connection is dropped.
    pub keepalives_count: Option<u32>,
    /// Longest sent data may stay unacknowledged before the connection is
    /// dropped (milliseconds).
    pub user_timeout: Option<Duration>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            worker_threads: None,
            pool_affinity: true,
            worker_fill: 8,
            connect_wait_timeout: Duration::from_secs(5),
            server_connect_timeout: Duration::from_secs(2),
            shutdown_timeout: Duration::from_secs(30),
            tcp: TcpTimings::default(),
        }
    }
}

impl EngineConfig {
    /// Worker threads to start on a machine with `cores` cores.
    ///
    /// Relaying bytes needs far fewer threads than cores, and the machine
    /// is usually shared with PostgreSQL itself; two is the floor so that
    /// one busy connection cannot stall the rest.
    pub fn effective_worker_threads(&self, cores: usize) -> usize {
        self.worker_threads.unwrap_or((cores / 4).clamp(2, 8))
    }
}

/// When a server connection goes back to the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolMode {
    /// When the client disconnects: every session feature works.
    #[default]
    Session,
    /// At the end of each transaction: far fewer server connections, but
    /// session state (prepared statements, `SET`, advisory locks) does not
    /// survive between transactions.
    Transaction,
}

impl fmt::Display for PoolMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        })
    }
}

/// `[pool.databases.NAME]` or `[pool.users.NAME]`: per-name exceptions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolOverride {
    /// Pool mode for this database or user.
    pub mode: Option<PoolMode>,
    /// Pool size for this database or user; at least 1 and at least
    /// `pool.min_size`.
    pub size: Option<u32>,
    /// `max_db_connections` of a database, `max_user_connections` of a
    /// user; 0: no limit.
    pub max_connections: Option<u32>,
}

/// Whether clients may or must use TLS.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientTls {
    /// SSLRequest is answered `N`; clients talk in plaintext.
    Disable,
    /// Clients choose (the default when a certificate is configured).
    #[default]
    Allow,
    /// Clients that do not ask for TLS are refused before authentication.
    Require,
}

/// Whether and how pgwarden uses TLS on its connections to the servers
/// (the names follow libpq's `sslmode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServerTls {
    /// Plaintext; no SSLRequest is sent.
    #[default]
    Disable,
    /// TLS when the server offers it, plaintext when it does not; the
    /// certificate is not checked.
    Prefer,
    /// TLS or no connection; the certificate is not checked.
    Require,
    /// TLS, with a certificate chain to `server_ca`.
    VerifyCa,
    /// As `verify-ca`, and the certificate names the host as configured.
    VerifyFull,
}

impl ServerTls {
    /// Whether the mode checks the server's certificate (and so needs a CA).
    pub fn verifies(self) -> bool {
        matches!(self, ServerTls::VerifyCa | ServerTls::VerifyFull)
    }

    /// The mode as written in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            ServerTls::Disable => "disable",
            ServerTls::Prefer => "prefer",
            ServerTls::Require => "require",
            ServerTls::VerifyCa => "verify-ca",
            ServerTls::VerifyFull => "verify-full",
        }
    }
}

/// `[auth]`: pgwarden authenticates clients itself.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthConfig {
    /// pg_hba.conf to follow; relative to the configuration file.
    pub hba_file: std::path::PathBuf,
    /// Role that runs the auth query.
    pub auth_user: String,
    /// Its password (prefer `PGWARDEN_AUTH_PASSWORD` or `auth_password_file`).
    pub auth_password: Option<String>,
    /// File holding that password.
    pub auth_password_file: Option<std::path::PathBuf>,
    /// Query returning (role name, verifier) for the role `$1`.
    pub auth_query: String,
    /// Database the auth query runs in (default `cluster.dbname`).
    pub auth_dbname: Option<String>,
    /// How long a looked-up verifier is reused.
    pub auth_cache_ttl: Duration,
    /// Longest time from connect to authenticated.
    pub auth_timeout: Duration,
}

impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthConfig")
            .field("hba_file", &self.hba_file)
            .field("auth_user", &self.auth_user)
            .field("auth_query", &self.auth_query)
            .finish_non_exhaustive()
    }
}

/// The default auth query: needs a superuser `auth_user`; the
/// configuration reference shows a `SECURITY DEFINER` function instead.
pub const DEFAULT_AUTH_QUERY: &str =
    "SELECT usename, passwd FROM pg_catalog.pg_shadow WHERE usename = $1 \
     AND (valuntil IS NULL OR valuntil > pg_catalog.now())";

/// `[tls]`: TLS termination towards clients.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// Server certificate chain (PEM); relative to the configuration file.
    pub cert: Option<std::path::PathBuf>,
    /// Its private key (PEM).
    pub key: Option<std::path::PathBuf>,
    /// Whether clients may (`allow`), must (`require`) or cannot
    /// (`disable`) use TLS; without a certificate only `disable` works.
    pub client_tls: ClientTls,
    /// TLS on pgwarden's own connections to the servers.
    pub server_tls: ServerTls,
    /// CA certificates (PEM) that server certificates must chain to;
    /// relative to the configuration file.
    pub server_ca: Option<std::path::PathBuf>,
    /// CA certificates (PEM) that client certificates must chain to, for
    /// the `cert` method and `clientcert`; relative to the configuration
    /// file. Without it pgwarden asks clients for no certificate.
    pub client_ca: Option<std::path::PathBuf>,
}

/// `[pool]`: server connection pooling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Default pool mode.
    pub mode: PoolMode,
    /// Server connections per (host, database, user) pool; at least 1.
    pub size: u32,
    /// Server connections kept open even when idle; at most `size`.
    pub min_size: u32,
    /// Server connections a pool may lend beyond `size` to clients that
    /// have waited `reserve_timeout`; 0: none.
    pub reserve_size: u32,
    /// How long a client waits before the reserve may serve it.
    pub reserve_timeout: Duration,
    /// Client connections accepted across all listeners; at least 1.
    pub max_client_conn: u32,
    /// Server connections to one database on one server, across its
    /// users' pools; 0: no limit.
    pub max_db_connections: u32,
    /// Server connections of one user on one server, across the pools of
    /// its databases; 0: no limit.
    pub max_user_connections: u32,
    /// Close server connections idle this long; `None` keeps them.
    pub server_idle_timeout: Option<Duration>,
    /// Close server connections this old once they are idle; `None` keeps
    /// them indefinitely.
    pub server_lifetime: Option<Duration>,
    /// Fail a query that waited this long for a server connection; `None`
    /// waits indefinitely.
    pub query_wait_timeout: Option<Duration>,
    /// Disconnect clients idle this long; `None` never does.
    pub client_idle_timeout: Option<Duration>,
    /// Disconnect pooled clients idle this long inside a transaction (the
    /// server connection they hold is closed); `None` never does.
    pub idle_transaction_timeout: Option<Duration>,
    /// Statements kept prepared per server connection; at least 1.
    pub max_prepared_statements: u32,
    /// The period the admin console's averages cover; above zero.
    pub stats_period: Duration,
    /// Session mode pools too: a client's server connection is reset with
    /// `DISCARD ALL` when it leaves and kept for the next client.
    pub reuse_session_servers: bool,
    /// Roles allowed into the admin console (database `pgwarden` on the
    /// read-write port).
    pub admin_users: Vec<String>,
    /// Exceptions by database name.
    pub databases: BTreeMap<String, PoolOverride>,
    /// Exceptions by user name.
    pub users: BTreeMap<String, PoolOverride>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            mode: PoolMode::Session,
            size: 20,
            min_size: 0,
            reserve_size: 0,
            reserve_timeout: Duration::from_secs(5),
            max_client_conn: 10_000,
            max_db_connections: 0,
            max_user_connections: 0,
            server_idle_timeout: Some(Duration::from_secs(600)),
            server_lifetime: Some(Duration::from_secs(3600)),
            query_wait_timeout: Some(Duration::from_secs(120)),
            client_idle_timeout: None,
            idle_transaction_timeout: None,
            max_prepared_statements: 1000,
            stats_period: Duration::from_secs(60),
            reuse_session_servers: false,
            admin_users: Vec::new(),
            databases: BTreeMap::new(),
            users: BTreeMap::new(),
        }
    }
}

impl PoolConfig {
    /// Pool mode for a client of a service whose mode is `service_mode`
    /// (see [`crate::ServiceConfig::pool_mode`]). The most specific setting
    /// wins: user, then database, then the service.
    pub fn mode_for(&self, service_mode: PoolMode, database: &str, user: &str) -> PoolMode {
        self.users
            .get(user)
            .and_then(|o| o.mode)
            .or_else(|| self.databases.get(database).and_then(|o| o.mode))
            .unwrap_or(service_mode)
    }

    /// `max_db_connections` of a database: its own, then the default; 0:
    /// no limit.
    pub fn db_limit(&self, database: &str) -> u32 {
        self.databases
            .get(database)
            .and_then(|o| o.max_connections)
            .unwrap_or(self.max_db_connections)
    }

    /// `max_user_connections` of a user: its own, then the default; 0: no
    /// limit.
    pub fn user_limit(&self, user: &str) -> u32 {
        self.users
            .get(user)
            .and_then(|o| o.max_connections)
            .unwrap_or(self.max_user_connections)
    }

    /// Pool size for a (database, user) pair: user, then database, then
    /// `pool.size`.
    pub fn size_for(&self, database: &str, user: &str) -> u32 {
        self.users
            .get(user)
            .and_then(|o| o.size)
            .or_else(|| self.databases.get(database).and_then(|o| o.size))
            .unwrap_or(self.size)
    }
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// `[log]`: logging.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConfig {
    /// A level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or a
    /// filter such as `info,pgwarden_probe=debug`.
    pub level: String,
    /// Line format.
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}
