//! Server connection pools for transaction pooling.
//!
//! A pool holds the server connections of one (host, database, user,
//! read-only) combination. Its size is a FIFO semaphore: clients waiting
//! for a server connection are served in arrival order, so none starves
//! however many clients share a few servers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::BytesMut;
use pgwarden_auth::ScramClient;
use pgwarden_topology::HostAddr;
use pgwarden_wire::message::{self, backend};
use pgwarden_wire::startup::StartupMessage;

use crate::auth::Credential;
use crate::stats::Totals;
use crate::stream::{ServerStream, ServerTls};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// What identifies a pool.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    /// The server.
    pub host: HostAddr,
    /// Database name.
    pub database: String,
    /// Role name.
    pub user: String,
    /// Server connections start with `default_transaction_read_only=on`.
    pub read_only: bool,
}

/// Default of `pool.max_prepared_statements`.
pub const DEFAULT_MAX_PREPARED_STATEMENTS: usize = 1000;

/// How long warm-ups wait after one failed, as PgBouncer's default
/// `server_login_retry`. Clients still open connections as they need them.
pub const WARM_RETRY: Duration = Duration::from_secs(15);

/// Pool settings (see `[pool]` in the configuration reference).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSettings {
    /// Largest number of server connections per pool.
    pub size: usize,
    /// Server connections lent beyond `size` to clients that have waited
    /// `reserve_timeout` (PgBouncer's reserve pool); 0: none.
    pub reserve_size: usize,
    /// How long a client waits before the reserve may serve it.
    pub reserve_timeout: Duration,
    /// Longest wait for a server connection before the client gets an error.
    pub query_wait_timeout: Duration,
    /// Whether the service wants the primary: its pools retire when their
    /// host stops being the primary.
    pub wants_primary: bool,
    /// Idle server connections older than this are closed.
    pub server_idle_timeout: Option<Duration>,
    /// Server connections older than this are closed when released.
    pub server_lifetime: Option<Duration>,
    /// Password pgwarden uses to log in to servers, when they ask for one.
    pub server_password: Option<String>,
    /// Without `server_password`, look the password up in `$PGPASSFILE`
    /// or `~/.pgpass` for each new server connection, by the pool's host,
    /// port, database and user, as libpq does for every connection.
    pub server_pgpass: bool,
    /// Server connections opened ahead of demand and kept open.
    pub min_size: usize,
    /// A client with no transaction running for this long is disconnected.
    pub client_idle_timeout: Option<Duration>,
    /// Disconnect a client that holds a server connection idle inside a
    /// transaction this long; `None` never does.
    pub idle_transaction_timeout: Option<Duration>,
    /// Most statements kept prepared on one server connection; past it,
    /// the least recently used are closed.
    pub max_prepared_statements: usize,
    /// Session pooling: the client keeps the server connection it first
    /// borrows until it leaves; the connection is then reset (`DISCARD
    /// ALL`) and kept for the next client. Set per client by
    /// [`crate::PoolOverrides::resolve`].
    pub hold_session: bool,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            size: 20,
            reserve_size: 0,
            reserve_timeout: Duration::from_secs(5),
            query_wait_timeout: Duration::from_secs(120),
            wants_primary: true,
            server_idle_timeout: Some(Duration::from_secs(600)),
            server_lifetime: Some(Duration::from_secs(3600)),
            server_password: None,
            server_pgpass: false,
            min_size: 0,
            client_idle_timeout: None,
            idle_transaction_timeout: None,
            max_prepared_statements: DEFAULT_MAX_PREPARED_STATEMENTS,
            hold_session: false,
        }
    }
}

/// Session parameters that belong to the client, not the server connection:
/// when a client lands on a server whose value differs, pgwarden sets it
/// before the client's first statement.
pub(crate) const TRACKED: [&str; 6] = [
    "application_name",
    "client_encoding",
    "DateStyle",
    "TimeZone",
    "IntervalStyle",
    "standard_conforming_strings",
];

/// Values of the [`TRACKED`] parameters, by position: compared on every
/// transaction of a pooled client, so kept in a form that costs no hashing.
#[derive(Debug, Default, Clone)]
pub(crate) struct Tracked([Option<Arc<str>>; TRACKED.len()]);

impl PartialEq for Tracked {
    fn eq(&self, other: &Tracked) -> bool {
        // `Arc`'s own comparison looks at the address first only for sized
        // contents; for `str` it always compares the bytes.
        self.0
            .iter()
            .zip(other.0.iter())
            .all(|(a, b)| match (a, b) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a == b,
                (None, None) => true,
                _ => false,
            })
    }
}

impl Eq for Tracked {}

/// One shared copy of each value servers report for the tracked
/// parameters: a client's values are compared with its server's at every
/// transaction, and equal values in one allocation compare by address.
/// Bounded, so that clients choosing ever new values (an application name
/// per process) cannot grow it without end; past the bound values are
/// copied, which costs only speed.
fn intern(value: &str) -> Arc<str> {
    const MOST: usize = 4096;
    // foldhash (seeded per process) rather than SipHash: this runs for
    // every client that logs in, and the set is bounded.
    type Values = std::collections::HashSet<Arc<str>, foldhash::fast::RandomState>;
    static VALUES: Mutex<Option<Values>> = Mutex::new(None);
    let mut values = VALUES.lock().expect("poisoned");
    let values = values.get_or_insert_with(Default::default);
    if let Some(v) = values.get(value) {
        return v.clone();
    }
    let v: Arc<str> = value.into();
    if values.len() < MOST {
        values.insert(v.clone());
    }
    v
}

impl Tracked {
    fn index(name: &str) -> Option<usize> {
        TRACKED.iter().position(|k| *k == name)
    }

    /// The tracked parameter `name` is, in whatever case it is written:
    /// PostgreSQL matches parameter names without regard to case (libpq
    /// sends `timezone` for `PGTZ`).
    pub fn name_of(name: &str) -> Option<&'static str> {
        TRACKED
            .iter()
            .copied()
            .find(|k| k.eq_ignore_ascii_case(name))
    }

    /// The tracked parameters a client gave at start-up, under any
    /// spelling and in `options` too (`-c TimeZone=...`), read as
    /// PostgreSQL reads them: `options` first, then the other parameters,
    /// later values winning. An `options` that does not parse was refused
    /// already ([`Extras::from_startup`]).
    pub fn from_startup(startup: &StartupMessage) -> Tracked {
        let mut tracked = Tracked::default();
        let options = startup.get("options").map(parse_options);
        for (name, value) in options.into_iter().flatten().flatten() {
            if let Some(name) = Self::name_of(&name) {
                tracked.set(name, &value);
            }
        }
        for (name, value) in &startup.params {
            if let Some(name) = Self::name_of(name) {
                tracked.set(name, value);
            }
        }
        tracked
    }

    /// The client's `application_name`, shared rather than copied (the
    /// session table keeps one per client).
    pub(crate) fn application_name(&self) -> Option<Arc<str>> {
        Self::index("application_name").and_then(|i| self.0[i].clone())
    }

    /// The value of a tracked parameter, if known.
    pub fn get(&self, name: &str) -> Option<&str> {
        Self::index(name).and_then(|i| self.0[i].as_deref())
    }

    /// Records a value; parameters that are not tracked are ignored.
    pub fn set(&mut self, name: &str, value: &str) {
        if let Some(i) = Self::index(name) {
            if self.0[i].as_deref() != Some(value) {
                self.0[i] = Some(intern(value));
            }
        }
    }

    /// Takes the values `other` knows and this does not, sharing them:
    /// a client starts with its first server's values, which most
    /// clients of a pool have in common.
    pub fn adopt_missing(&mut self, other: &Tracked) {
        for (mine, theirs) in self.0.iter_mut().zip(other.0.iter()) {
            if mine.is_none() {
                mine.clone_from(theirs);
            }
        }
    }

    /// The known (name, value) pairs.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &str)> {
        TRACKED
            .iter()
            .zip(self.0.iter())
            .filter_map(|(k, v)| v.as_deref().map(|v| (*k, v)))
    }
}

/// Settings a pooled client asked for at start-up beyond the tracked
/// parameters: other start-up parameters (`search_path`,
/// `extra_float_digits`, ...) and the `-c name=value` of its `options`.
/// Pooled server connections open without them; pgwarden sets them with
/// `set_config` on whichever server the client lands on, and resets them
/// when a client without them lands there. Sorted by name; `None` (the
/// usual case) when there are none, so comparing costs nothing.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Extras(Option<Arc<[(String, String)]>>);

impl Extras {
    /// The settings in `startup` beyond what pooling handles itself, or
    /// why they cannot be honoured with a pooled server connection.
    /// `read_only`: the service sets `default_transaction_read_only`
    /// itself.
    pub fn from_startup(startup: &StartupMessage, read_only: bool) -> Result<Extras, String> {
        let mut found: Vec<(String, String)> = Vec::new();
        let top_level = |lower: &str| {
            startup
                .params
                .iter()
                .any(|(n, _)| n.eq_ignore_ascii_case(lower))
        };
        let mut add = |name: &str, value: &str, from_options: bool| -> Result<(), String> {
            let valid = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.');
            if !valid {
                return Err(format!("invalid configuration parameter name \"{name}\""));
            }
            // A tracked parameter is replayed as such, however it came
            // ([`Tracked::from_startup`]): set here too, it would undo
            // the client's own SET of it on the next server it lands on.
            if Tracked::name_of(name).is_some() {
                return Ok(());
            }
            let lower = name.to_ascii_lowercase();
            if matches!(lower.as_str(), "session_authorization" | "role") {
                return Err(format!(
                    "start-up parameter \"{name}\" is not supported with pooling: connect as that role instead"
                ));
            }
            if (from_options && top_level(&lower))
                || (read_only && lower == "default_transaction_read_only")
            {
                return Ok(());
            }
            // Later values win, as in PostgreSQL.
            found.retain(|(n, _)| *n != lower);
            found.push((lower, value.to_string()));
            Ok(())
        };
        // PostgreSQL applies `options` first, then the other parameters,
        // which win where both set something.
        if let Some(options) = startup.get("options") {
            for (n, v) in parse_options(options)? {
                add(&n, &v, true)?;
            }
        }
        for (name, value) in &startup.params {
            match name.as_str() {
                "user" | "database" | "options" => {}
                "replication" => {
                    return Err("replication connections are not supported with pooling".into())
                }
                n if n.starts_with("_pq_.") => {}
                n => add(n, value, false)?,
            }
        }
        if found.is_empty() {
            return Ok(Extras(None));
        }
        found.sort();
        Ok(Extras(Some(found.into())))
    }

    /// The (name, value) pairs.
    pub fn iter(&self) -> impl Iterator<Item = &(String, String)> {
        self.0.iter().flat_map(|e| e.iter())
    }

    /// No settings at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// These settings and `more`, whose names are not among these.
    pub fn with(&self, more: impl IntoIterator<Item = (String, String)>) -> Extras {
        let mut all: Vec<(String, String)> = self.iter().cloned().collect();
        let mine = all.len();
        all.extend(more);
        if all.len() == mine {
            return self.clone();
        }
        all.sort();
        Extras(Some(all.into()))
    }

    /// The statements that take a server whose settings are `from` to
    /// these: `set_config` for each value that differs, `RESET` for each
    /// setting `from` has and these do not. Empty when they agree.
    pub fn sql_from(&self, from: &Extras) -> String {
        let mut sql = String::new();
        if self == from {
            return sql;
        }
        let had = |name: &str| {
            from.iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        for (name, value) in self.iter() {
            if had(name) != Some(value.as_str()) {
                // set_config reads the value as a start-up parameter is
                // read (a list such as "a, b" stays a list).
                sql.push_str(&format!(
                    "SELECT pg_catalog.set_config('{name}', {}, false);",
                    text_expr(value)
                ));
            }
        }
        for (name, _) in from.iter() {
            if !self.iter().any(|(n, _)| n == name) {
                sql.push_str(&format!("RESET {name};"));
            }
        }
        sql
    }
}

/// The `-c name=value` and `--name=value` settings of a start-up
/// `options` string (white space separates them; a backslash keeps the
/// next character, as PostgreSQL reads it).
fn parse_options(options: &str) -> Result<Vec<(String, String)>, String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => word.extend(chars.next()),
            c if c.is_ascii_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    let mut settings = Vec::new();
    let mut words = words.into_iter();
    while let Some(w) = words.next() {
        let setting = if w == "-c" {
            words
                .next()
                .ok_or_else(|| "start-up options: -c without a setting".to_string())?
        } else if let Some(rest) = w.strip_prefix("--").or_else(|| w.strip_prefix("-c")) {
            rest.to_string()
        } else {
            return Err(format!(
                "start-up option \"{w}\" is not supported with pooling (only -c name=value)"
            ));
        };
        let Some((name, value)) = setting.split_once('=') else {
            return Err(format!("start-up options: \"{setting}\" is not name=value"));
        };
        // PostgreSQL reads '-' in an option's name as '_'.
        settings.push((name.replace('-', "_"), value.to_string()));
    }
    Ok(settings)
}

/// One server connection, logged in and idle at a transaction boundary
/// whenever it sits in a pool.
#[derive(Debug)]
pub struct ServerConn {
    /// The socket.
    pub stream: ServerStream,
    /// The server's address, for cancel requests.
    pub peer: SocketAddr,
    /// ParameterStatus values the server last reported (change them with
    /// [`ServerConn::set_param`], which keeps `tracked` in step).
    pub params: HashMap<String, String>,
    /// The tracked subset of `params`.
    pub(crate) tracked: Tracked,
    /// The start-up settings of the client it last served ([`Extras`]).
    pub(crate) extras: Extras,
    /// The backend's own cancel key.
    pub backend_key: (i32, i32),
    /// Statements prepared on this connection (server-side names).
    pub prepared: StatementCache,
    /// When the connection was opened ([`now_ns`]).
    pub created: u64,
    /// When it was last released ([`now_ns`]).
    pub last_used: u64,
    /// The worker whose event loop the socket is registered with
    /// ([`crate::workers::NONE`]: the control runtime's).
    pub home: usize,
    /// Cache of [`ServerConn::status_block`].
    status_block: Option<bytes::Bytes>,
    /// Its places under the pool's [`ConnLimit`]s, given back when the
    /// connection is dropped.
    slots: [Option<Slot>; 2],
}

/// An idle server connection as SHOW SERVERS lists it.
pub(crate) struct IdleServer {
    /// The server's address.
    pub peer: SocketAddr,
    /// pgwarden's end of the connection.
    pub local: Option<SocketAddr>,
    /// The backend's process id.
    pub pid: i32,
    /// When it was opened and last given back, Unix seconds.
    pub opened_s: u64,
    pub used_s: u64,
    /// Whether it is encrypted.
    pub tls: bool,
    /// The `application_name` the server last reported for it.
    pub application_name: Option<String>,
}

/// The statements prepared on one server connection, by server-side name,
/// with when each was last used: the least recently used go first when
/// the connection holds more than `max_prepared_statements`.
#[derive(Debug, Default)]
pub struct StatementCache {
    names: HashMap<String, u64>,
    tick: u64,
}

impl StatementCache {
    /// Whether `name` is prepared; marks it used.
    pub fn touch(&mut self, name: &str) -> bool {
        self.tick += 1;
        match self.names.get_mut(name) {
            Some(t) => {
                *t = self.tick;
                true
            }
            None => false,
        }
    }

    /// Records `name` as prepared (and just used).
    pub fn insert(&mut self, name: &str) {
        self.tick += 1;
        match self.names.get_mut(name) {
            Some(t) => *t = self.tick,
            None => {
                self.names.insert(name.to_string(), self.tick);
            }
        }
    }

    /// Forgets `name`; whether it was prepared.
    pub fn remove(&mut self, name: &str) -> bool {
        self.names.remove(name).is_some()
    }

    /// Forgets every statement.
    pub fn clear(&mut self) {
        self.names.clear();
    }

    /// How many statements are prepared.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Removes and returns the least recently used names until at most
    /// `bound` remain, sparing `keep` (the statement about to run).
    pub fn evict(&mut self, bound: usize, keep: &str) -> Vec<String> {
        let mut out = Vec::new();
        while self.names.len() > bound.max(1) {
            let Some(victim) = self
                .names
                .iter()
                .filter(|(n, _)| n.as_str() != keep)
                .min_by_key(|(_, t)| **t)
                .map(|(n, _)| n.clone())
            else {
                break;
            };
            self.names.remove(&victim);
            out.push(victim);
        }
        out
    }
}

impl ServerConn {
    /// Whether the server said at login that it is a hot standby
    /// (PostgreSQL 14 and later report `in_hot_standby`).
    pub fn in_hot_standby(&self) -> bool {
        self.params
            .get("in_hot_standby")
            .is_some_and(|v| v.eq_ignore_ascii_case("on"))
    }

    /// Records a ParameterStatus the server sent.
    pub fn set_param(&mut self, name: &str, value: &str) {
        self.tracked.set(name, value);
        match self.params.get_mut(name) {
            Some(v) if v == value => {}
            Some(v) => {
                *v = value.to_string();
                self.status_block = None;
            }
            None => {
                self.params.insert(name.to_string(), value.to_string());
                self.status_block = None;
            }
        }
    }

    /// `params` as ParameterStatus messages (sorted by name), built once
    /// and kept until a parameter changes: most new clients are greeted
    /// with exactly these.
    pub fn status_block(&mut self) -> &[u8] {
        if self.status_block.is_none() {
            let mut params: Vec<(&String, &String)> = self.params.iter().collect();
            params.sort();
            let room = params.iter().map(|(k, v)| 7 + k.len() + v.len()).sum();
            let mut block = BytesMut::with_capacity(room);
            for (k, v) in params {
                pgwarden_wire::encode::parameter_status(&mut block, k, v);
            }
            self.status_block = Some(block.freeze());
        }
        self.status_block.as_deref().unwrap_or_default()
    }
}

/// Why a server connection could not be had.
#[derive(Debug)]
pub enum ServerError {
    /// The server refused the login; its ErrorResponse, to relay as is.
    Refused(BytesMut),
    /// No connection within the wait (pool exhausted or server unreachable).
    Timeout,
    /// The pool retired while we waited: pick a host again.
    Retired,
    /// A [`ConnLimit`] stayed full for the whole wait; what it is.
    Limit(String),
    /// Network or protocol failure.
    Failed(String),
    /// The server turned the connection away before authentication, as
    /// not ready for any (57P03: starting up, shutting down, not yet
    /// consistent); its message. The host, not the login, is at fault.
    NotReady(String),
}

/// Counters of one pool, for `SHOW POOLS`/`SHOW STATS` and metrics.
#[derive(Debug, Default)]
pub struct PoolStats {
    /// How long each client waited for one of the pool's server
    /// connections (0 for an idle one at hand).
    pub wait: crate::metrics::WaitHistogram,
    /// Clients waiting for a server connection now.
    pub waiting: AtomicUsize,
    /// Clients that have the pool's permit and wait for room under a
    /// shared cap ([`ConnLimit`]); shown as waiting too.
    pub capped: AtomicUsize,
    /// Server connections handed out now.
    pub active: AtomicUsize,
    /// Server connections in existence.
    pub total: AtomicUsize,
    /// Transactions served (server connections returned).
    pub transactions: AtomicU64,
    /// Queries and extended-protocol batches completed.
    pub queries: AtomicU64,
    /// Bytes sent to servers for clients.
    pub received: AtomicU64,
    /// Bytes of server replies passed to clients.
    pub sent: AtomicU64,
    /// Microseconds server connections were lent (PgBouncer's
    /// `total_xact_time`).
    pub xact_us: AtomicU64,
    /// Microseconds servers spent on queries: from sending one to its
    /// ReadyForQuery (PgBouncer's `total_query_time`).
    pub query_us: AtomicU64,
    /// Total microseconds clients waited for a server connection.
    pub wait_us: AtomicU64,
    /// Server connections moved to another worker thread's event loop
    /// because a client there borrowed them.
    pub moves: AtomicU64,
    /// The totals at the last two ends of a stats period, older first:
    /// the averages the admin console shows are between them.
    period: Mutex<[Totals; 2]>,
}

impl PoolStats {
    /// The counters now.
    pub fn totals(&self) -> Totals {
        let o = Ordering::Relaxed;
        Totals {
            xact_count: self.transactions.load(o),
            query_count: self.queries.load(o),
            received: self.received.load(o),
            sent: self.sent.load(o),
            xact_us: self.xact_us.load(o),
            query_us: self.query_us.load(o),
            wait_us: self.wait_us.load(o),
        }
    }

    /// Ends a stats period: the one that ended becomes the period the
    /// averages cover.
    pub fn roll(&self) {
        let now = self.totals();
        let mut p = self.period.lock().expect("poisoned");
        *p = [p[1], now];
    }

    /// The totals at the start and the end of the last complete period.
    pub fn last_period(&self) -> [Totals; 2] {
        *self.period.lock().expect("poisoned")
    }
}

/// A pool of server connections.
#[derive(Debug)]
pub struct Pool {
    /// Its identity.
    pub key: PoolKey,
    /// Swapped whole by a reload ([`Pool::update`]); read without a lock.
    settings: ArcSwap<PoolSettings>,
    /// The service whose settings the pool took: a reload resolves them
    /// anew from that service's.
    pub(crate) service: std::sync::OnceLock<Arc<str>>,
    /// The proxy's count of open server connections to the pool's host
    /// (`pgwarden_server_connections`), which the pool's connections are
    /// part of.
    pub(crate) server_gauge: std::sync::OnceLock<prometheus_client::metrics::gauge::Gauge>,
    /// One permit per connection the pool may lend: `size` of them.
    permits: Arc<Semaphore>,
    /// The reserve ([`PoolSettings::reserve_size`]).
    reserve: Arc<Semaphore>,
    /// Permits of `permits` and `reserve` that a reload took away while
    /// they were lent: each is forgotten, not given back, when its loan
    /// ends, so a smaller size takes effect without ending anyone's
    /// transaction.
    owed: [AtomicUsize; 2],
    // Boxed: a connection changes hands twice per transaction, and a
    // pointer moves cheaper than the few hundred bytes of its state.
    #[allow(clippy::vec_box)]
    idle: Mutex<Vec<Box<ServerConn>>>,
    /// Counters.
    pub stats: PoolStats,
    /// Set when the host no longer serves this pool's purpose (demoted,
    /// dead): idle connections are closed and released ones not kept.
    retired: AtomicBool,
    /// Wakes clients waiting for room under a cap when the pool retires,
    /// so they pick a host again instead of waiting out their time.
    retired_signal: Notify,
    /// Connections opened before this ([`now_ns`]; 0: none) are
    /// closed instead of reused ([`Pool::reconnect`]).
    renew_before: AtomicU64,
    /// Longest a new server connection may take to open and log in, in
    /// microseconds (`engine.server_connect_timeout`).
    connect_limit_us: AtomicU64,
    /// Lent connections that will close when given back, for the admin
    /// console's WAIT_CLOSE.
    stale: AtomicUsize,
    /// Warm-up connections being opened now.
    warming: AtomicUsize,
    /// No warm-up starts before this ([`now_ns`]): set when one failed,
    /// so that a pool whose logins fail (a database that does not exist,
    /// a host refusing connections) is not retried at every topology
    /// change, several times a second.
    warm_after: AtomicU64,
    /// Connections being opened for clients now.
    opening: AtomicUsize,
    /// Loans kept by their clients between two transactions (pinned by
    /// session state, or session-pooled): lent, yet no transaction runs
    /// on them ([`Checkout::set_held`]).
    held: AtomicUsize,
    /// The clients waiting for a server connection, in the order they
    /// began to: a ticket and since when.
    waiters: Mutex<std::collections::VecDeque<(u64, Instant)>>,
    /// The next waiter's ticket.
    next_waiter: AtomicU64,
    /// The clients past the line waiting for room under
    /// `max_db_connections` or `max_user_connections`: a ticket and since
    /// when they began to wait for a server at all.
    capped_waiters: Mutex<Vec<(u64, Instant)>>,
    /// Idle connections set aside for clients waiting under a cap
    /// (changed under the `idle` lock): they hold the pool's permits
    /// already, and a line of clients behind them would otherwise take
    /// every connection given back while they wait for room that never
    /// frees up ([`Checkout::release`]).
    promised: AtomicUsize,
    /// Wakes a client waiting under a cap when a connection is set aside
    /// for it.
    promised_signal: Notify,
    /// Since when ([`now_ns`]) the pool has been seen unused, and its
    /// query count then ([`Pool::unused_for`]).
    unused_since: Mutex<Option<(u64, u64)>>,
    /// What the last authenticated client proved, to open new connections
    /// as its role (the pool is per role).
    credential: Mutex<Credential>,
    /// TLS towards the server, shared with the proxy so reloads apply.
    server_tls: Arc<arc_swap::ArcSwap<ServerTls>>,
    /// Caps shared with other pools of the same server: its database's
    /// and its user's.
    limits: Vec<Arc<ConnLimit>>,
    /// The tracked parameters as a server session of this database and
    /// role starts without any client's start-up values: what a client
    /// that asked for none of them has, whatever the connection it lands
    /// on was last set to.
    baseline: Mutex<Tracked>,
    /// Whether `baseline` knows `application_name`: until then
    /// connections open without the client's, to learn the server's own.
    baseline_app: AtomicBool,
}

/// A client in line for a server connection ([`Pool::count_waiting`]):
/// counted as waiting while it lives, and counted down however the wait
/// ends, the caller's dropping of the waiting future (a cancel request, a
/// client that left) included.
struct Waiting<'a> {
    pool: &'a Pool,
    ticket: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut line = self.pool.waiters.lock().expect("poisoned");
        // Served in order, so nearly always the first.
        if let Some(i) = line.iter().position(|(t, _)| *t == self.ticket) {
            line.remove(i);
        }
        drop(line);
        self.pool.stats.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A client waiting for room under a connection cap: counted in
/// `capped` and listed for [`Pool::oldest_wait`] while it lives.
struct CappedWait<'a> {
    pool: &'a Pool,
    ticket: u64,
}

impl<'a> CappedWait<'a> {
    fn new(pool: &'a Pool, since: Instant) -> Self {
        pool.stats.capped.fetch_add(1, Ordering::Relaxed);
        let ticket = pool.next_waiter.fetch_add(1, Ordering::Relaxed);
        pool.capped_waiters
            .lock()
            .expect("poisoned")
            .push((ticket, since));
        CappedWait { pool, ticket }
    }
}

impl Drop for CappedWait<'_> {
    fn drop(&mut self) {
        self.pool
            .capped_waiters
            .lock()
            .expect("poisoned")
            .retain(|(t, _)| *t != self.ticket);
        let left = self.pool.stats.capped.fetch_sub(1, Ordering::Relaxed) - 1;
        // A connection set aside for a client that gave up (or got room)
        // goes back to everyone.
        let _idle = self.pool.idle.lock().expect("poisoned");
        let promised = self.pool.promised.load(Ordering::Relaxed);
        if promised > left {
            self.pool.promised.store(left, Ordering::Relaxed);
        }
    }
}

/// Where a client waiting under a cap got its connection.
enum Room {
    /// Places under the caps, to open a new connection in.
    Slots([Option<Slot>; 2]),
    /// An idle connection given back while it waited.
    Idle(Box<ServerConn>),
}

/// One more in a count while it lives: counted down however the future
/// holding it ends.
struct Counted<'a>(&'a AtomicUsize, Ordering);

impl<'a> Counted<'a> {
    fn new(count: &'a AtomicUsize, order: Ordering) -> Counted<'a> {
        count.fetch_add(1, order);
        Counted(count, order)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, self.1);
    }
}

/// A connection being opened to warm a pool ([`Pool::warm`]): counted
/// from before its task is spawned until it is open or failed, however
/// the task ends.
struct Warming(Arc<Pool>);

impl Warming {
    fn new(pool: Arc<Pool>) -> Warming {
        pool.warming.fetch_add(1, Ordering::Relaxed);
        Warming(pool)
    }
}

impl Drop for Warming {
    fn drop(&mut self) {
        self.0.warming.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Which of PgBouncer's two shared caps a [`ConnLimit`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LimitKind {
    /// `max_db_connections`: the pools of one database.
    Database,
    /// `max_user_connections`: the pools of one user.
    User,
}

/// A cap on the server connections that several pools of one server open
/// together: those of one database (`max_db_connections`) or of one user
/// (`max_user_connections`). A pool that needs a new connection while the
/// cap is reached closes an idle connection of another pool under the same
/// cap, or waits until one closes; a pool that gets a connection back
/// while others wait closes it instead of keeping it idle.
#[derive(Debug)]
pub struct ConnLimit {
    /// Its kind, name and server, for messages.
    pub kind: LimitKind,
    /// The database or user name.
    pub name: String,
    /// The server.
    pub host: HostAddr,
    /// 0: no cap. Changed by a reload.
    max: AtomicUsize,
    /// Connections holding a [`Slot`].
    open: AtomicUsize,
    /// Clients (with their pool's permit) waiting for a slot.
    waiting: AtomicUsize,
    freed: Notify,
    members: Mutex<Vec<Weak<Pool>>>,
}

/// One connection's place under a [`ConnLimit`].
#[derive(Debug)]
pub struct Slot(Arc<ConnLimit>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
        self.0.freed.notify_one();
    }
}

impl ConnLimit {
    /// A cap of `max` (0: none).
    pub fn new(kind: LimitKind, name: &str, host: HostAddr, max: usize) -> Arc<ConnLimit> {
        Arc::new(ConnLimit {
            kind,
            name: name.to_string(),
            host,
            max: AtomicUsize::new(max),
            open: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            freed: Notify::new(),
            members: Mutex::new(Vec::new()),
        })
    }

    /// The cap; 0: none.
    pub fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }

    /// Connections open under it.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Changes the cap (a reload). Connections above a lowered cap close
    /// as they become idle; waiters look again under a raised one.
    pub fn set_max(&self, max: usize) {
        if self.max.swap(max, Ordering::SeqCst) != max {
            self.freed.notify_waiters();
        }
    }

    /// The configuration key and what it limits, for messages.
    pub fn describe(&self) -> String {
        let (key, what) = match self.kind {
            LimitKind::Database => ("max_db_connections", "database"),
            LimitKind::User => ("max_user_connections", "user"),
        };
        format!(
            "{key} ({}) of {what} \"{}\" on {}",
            self.max(),
            self.name,
            self.host
        )
    }

    /// Whether no pool and no connection is under the cap any more.
    pub fn unused(&self) -> bool {
        self.open.load(Ordering::SeqCst) == 0
            && self.waiting.load(Ordering::SeqCst) == 0
            && self
                .members
                .lock()
                .expect("poisoned")
                .iter()
                .all(|p| p.strong_count() == 0)
    }

    fn join(&self, pool: &Arc<Pool>) {
        let mut members = self.members.lock().expect("poisoned");
        members.retain(|p| p.strong_count() > 0);
        members.push(Arc::downgrade(pool));
    }

    fn try_take(self: &Arc<Self>) -> Option<Slot> {
        let max = self.max();
        let taken = self
            .open
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (max == 0 || n < max).then_some(n + 1)
            });
        taken.ok().map(|_| Slot(self.clone()))
    }

    /// Whether a connection coming back idle should close to make room:
    /// pools wait for a slot, or the cap was lowered below what is open.
    fn wants_room(&self) -> bool {
        let max = self.max();
        max != 0
            && (self.waiting.load(Ordering::SeqCst) > 0 || self.open.load(Ordering::SeqCst) > max)
    }

    /// Closes one idle connection of a pool under this cap; whether there
    /// was one.
    fn evict_idle(&self) -> bool {
        let members: Vec<Arc<Pool>> = self
            .members
            .lock()
            .expect("poisoned")
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        members.iter().any(|p| p.close_idle())
    }

    /// A slot, once one is free: made by closing another pool's idle
    /// connection, or waited for.
    async fn take(self: &Arc<Self>) -> Slot {
        // Counted before looking for idle connections: a pool that keeps
        // one idle after this looks at the count and closes it (see
        // `Checkout::release`), so one of the two always sees the other.
        let _waiting = Counted::new(&self.waiting, Ordering::SeqCst);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(s) = self.try_take() {
                return s;
            }
            if self.evict_idle() {
                continue;
            }
            freed.await;
        }
    }
}

static EPOCH: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// The pools' clock: nanoseconds on the monotonic clock since the first
/// pool was created. A plain integer fits an atomic and a client's state
/// (below 2^63 it leaves the top bit for a flag: that is 292 years), and
/// comparing two costs no `Instant` arithmetic, which would add a few
/// hundred instructions to every transaction.
fn now_ns() -> u64 {
    fn monotonic() -> u64 {
        use nix::time::{clock_gettime, ClockId};
        // The monotonic clock cannot fail to be read on Linux.
        clock_gettime(ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
            (t.tv_sec() as u64)
                .saturating_mul(1_000_000_000)
                .saturating_add(t.tv_nsec() as u64)
        })
    }
    let epoch = *EPOCH.get_or_init(monotonic);
    monotonic().saturating_sub(epoch)
}

/// `d` in nanoseconds, saturating.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A server connection lent to one client until its transaction ends.
#[derive(Debug)]
pub struct Checkout {
    /// The connection.
    pub conn: Box<ServerConn>,
    /// The pool it returns to.
    pub pool: Arc<Pool>,
    /// Traffic while lent, added to the pool's [`PoolStats`] at release
    /// (one atomic add each per transaction rather than per message).
    pub traffic: Traffic,
    /// The borrower's last read of the socket found nothing, with a budget
    /// left, so the borrower's waker is registered with it: until the
    /// socket is readable there is no need to poll it again (see
    /// [`crate::stream::ServerStream::quiet`]). False for a new loan.
    pub read_armed: bool,
    /// Kept by its client between two transactions ([`Checkout::set_held`]).
    held: bool,
    /// Taken by [`Checkout::release`], or by the drop of a loan never
    /// released.
    permit: Option<OwnedSemaphorePermit>,
}

/// A loan dropped without [`Checkout::release`] (a session task that
/// panicked, a future dropped while it held one) is closed and counted
/// back: otherwise the pool would count it lent for ever, and a pause
/// waiting for its transactions to end (a switchover) would never see
/// them done.
impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            let (_, _permit) = settle(
                &self.pool,
                &self.conn,
                self.traffic,
                self.held,
                permit,
                false,
            );
            self.pool.closed(1);
        }
    }
}

/// Counts of one loan of a server connection. Part of every attached
/// client's state, so its times are kept as [`now_ns`] nanoseconds
/// rather than as `Instant`s of twice the size.
#[derive(Debug, Clone, Copy)]
pub struct Traffic {
    /// Queries and extended-protocol batches completed (ReadyForQuery).
    pub queries: u64,
    /// Bytes sent to the server for the client.
    pub received: u64,
    /// Bytes of the server's replies passed to the client.
    pub sent: u64,
    /// Microseconds the server spent on queries during the loan.
    pub query_us: u64,
    /// Transactions that ended during the loan (a ReadyForQuery `I`): one
    /// for a transaction-pooled loan, several for a pinned client's.
    transactions: u64,
    /// Nanoseconds of the loan spent in those transactions, from the
    /// message that began each to the `I` that ended it: a pinned
    /// client's time between transactions is none.
    xact_ns: u64,
    /// When the transaction under way began; 0 between transactions.
    xact_start: u64,
    /// With [`BUSY`]: since when the server has had a query to answer.
    /// Without: when the last ReadyForQuery came.
    mark: u64,
}

/// The flag of [`Traffic::mark`].
const BUSY: u64 = 1 << 63;

impl Traffic {
    /// A loan starting now; the client's first message, which asked for
    /// it, is on its way, so the server counts as busy from here.
    pub fn starting() -> Traffic {
        let now = now_ns();
        Traffic {
            queries: 0,
            received: 0,
            sent: 0,
            query_us: 0,
            transactions: 0,
            xact_ns: 0,
            xact_start: now,
            mark: now | BUSY,
        }
    }

    /// Bytes were sent to the server: it is busy from now on, unless it
    /// already was; a transaction begins, unless one is under way.
    pub fn sending(&mut self) {
        if self.mark & BUSY == 0 {
            let now = now_ns();
            self.mark = now | BUSY;
            if self.xact_start == 0 {
                self.xact_start = now;
            }
        }
    }

    /// Nothing in flight and no transaction under way from now: a loan
    /// kept from the login on (session pooling), whose first transaction
    /// begins with the client's first message.
    pub fn settle(&mut self) {
        self.mark = now_ns();
        self.xact_start = 0;
    }

    /// A ReadyForQuery came; `idle`: the server has answered everything;
    /// `ended`: its status is `I`, no transaction is open.
    pub fn ready(&mut self, idle: bool, ended: bool) {
        self.queries += 1;
        if idle || ended {
            let now = now_ns();
            if idle {
                if self.mark & BUSY != 0 {
                    self.query_us += now.saturating_sub(self.mark & !BUSY) / 1000;
                }
                self.mark = now;
            }
            if ended && self.xact_start != 0 {
                self.transactions += 1;
                self.xact_ns += now.saturating_sub(self.xact_start);
                // More already sent begins the next one at once.
                self.xact_start = if idle { 0 } else { now };
            }
        }
    }

    /// Transactions of the loan, and microseconds spent in them: one under
    /// way when the loan ended (a client gone mid-transaction) counts up
    /// to then.
    fn transaction_totals(&self) -> (u64, u64) {
        let mut n = self.transactions;
        let mut ns = self.xact_ns;
        if self.xact_start != 0 && self.queries > 0 {
            n += 1;
            ns += self.ended().saturating_sub(self.xact_start);
        }
        (n, ns / 1000)
    }

    /// When the loan ended: at the last ReadyForQuery, unless the server
    /// was sent more since (a client that left mid-batch).
    fn ended(&self) -> u64 {
        if self.mark & BUSY == 0 {
            self.mark
        } else {
            now_ns()
        }
    }
}

impl Pool {
    /// A new, empty pool.
    pub fn new(key: PoolKey, settings: PoolSettings) -> Arc<Pool> {
        Self::with_server_tls(key, settings, Default::default())
    }

    /// A new, empty pool whose connections use `server_tls`.
    pub fn with_server_tls(
        key: PoolKey,
        settings: PoolSettings,
        server_tls: Arc<arc_swap::ArcSwap<ServerTls>>,
    ) -> Arc<Pool> {
        Self::limited(key, settings, server_tls, Vec::new())
    }

    /// A new, empty pool under shared caps ([`ConnLimit`]).
    pub fn limited(
        key: PoolKey,
        settings: PoolSettings,
        server_tls: Arc<arc_swap::ArcSwap<ServerTls>>,
        limits: Vec<Arc<ConnLimit>>,
    ) -> Arc<Pool> {
        // Fixes the epoch before any connection exists.
        now_ns();
        let pool = Arc::new(Pool {
            limits,
            server_tls,
            key,
            permits: Arc::new(Semaphore::new(settings.size)),
            reserve: Arc::new(Semaphore::new(settings.reserve_size)),
            owed: Default::default(),
            settings: ArcSwap::from_pointee(settings),
            service: std::sync::OnceLock::new(),
            server_gauge: std::sync::OnceLock::new(),
            idle: Mutex::new(Vec::new()),
            stats: PoolStats::default(),
            retired: AtomicBool::new(false),
            retired_signal: Notify::new(),
            renew_before: AtomicU64::new(0),
            // The default of engine.server_connect_timeout; the proxy sets its own.
            connect_limit_us: AtomicU64::new(2_000_000),
            stale: AtomicUsize::new(0),
            warming: AtomicUsize::new(0),
            warm_after: AtomicU64::new(0),
            opening: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            waiters: Mutex::new(std::collections::VecDeque::new()),
            next_waiter: AtomicU64::new(0),
            capped_waiters: Mutex::new(Vec::new()),
            promised: AtomicUsize::new(0),
            promised_signal: Notify::new(),
            unused_since: Mutex::new(None),
            credential: Mutex::new(Credential::None),
            baseline: Mutex::new(Tracked::default()),
            baseline_app: AtomicBool::new(false),
        });
        for l in &pool.limits {
            l.join(&pool);
        }
        pool
    }

    /// Counts a connection the pool opened.
    fn opened(&self) {
        self.stats.total.fetch_add(1, Ordering::Relaxed);
        if let Some(g) = self.server_gauge.get() {
            g.inc();
        }
    }

    /// Counts `n` connections the pool closed.
    fn closed(&self, n: usize) {
        self.stats.total.fetch_sub(n, Ordering::Relaxed);
        if let Some(g) = self.server_gauge.get() {
            g.dec_by(n as i64);
        }
    }

    /// The shared caps this pool is under.
    pub fn limits(&self) -> &[Arc<ConnLimit>] {
        &self.limits
    }

    /// Closes the least recently used idle connection; whether there was
    /// one.
    fn close_idle(&self) -> bool {
        let oldest = {
            let mut idle = self.idle.lock().expect("poisoned");
            (!idle.is_empty()).then(|| idle.remove(0))
        };
        // Closed outside the lock: its slots wake a waiting pool.
        let Some(conn) = oldest else { return false };
        self.closed(1);
        drop(conn);
        true
    }

    /// A place under each of the pool's caps, waiting until `deadline`,
    /// or (`free_only`) only if there is one now.
    /// `since`: when the client began to wait for a server, for `maxwait`.
    async fn slots(
        &self,
        deadline: tokio::time::Instant,
        free_only: bool,
        since: Instant,
    ) -> Result<Room, ServerError> {
        let mut slots = [None, None];
        for (slot, limit) in slots.iter_mut().zip(&self.limits) {
            let s = match limit.try_take() {
                Some(s) => s,
                None if free_only => return Err(ServerError::Limit(limit.describe())),
                None => {
                    let _capped = CappedWait::new(self, since);
                    let take = crate::timer::timeout_at(deadline, limit.take());
                    tokio::pin!(take);
                    loop {
                        let retired = self.retired_signal.notified();
                        tokio::pin!(retired);
                        retired.as_mut().enable();
                        let handed = self.promised_signal.notified();
                        tokio::pin!(handed);
                        handed.as_mut().enable();
                        if self.is_retired() {
                            return Err(ServerError::Retired);
                        }
                        // A connection given back meanwhile serves this
                        // client: it has the pool's permit already.
                        if let Some(c) = self.pop_live(true) {
                            return Ok(Room::Idle(c));
                        }
                        tokio::select! {
                            _ = retired => return Err(ServerError::Retired),
                            s = take.as_mut() => {
                                break s.map_err(|_| ServerError::Limit(limit.describe()))?;
                            }
                            _ = handed => {}
                        }
                    }
                }
            };
            *slot = Some(s);
        }
        Ok(Room::Slots(slots))
    }

    /// Sets how long a new server connection may take to open and log in.
    pub fn set_connect_limit(&self, limit: Duration) {
        let us = u64::try_from(limit.as_micros()).unwrap_or(u64::MAX);
        self.connect_limit_us.store(us, Ordering::Relaxed);
    }

    fn connect_limit(&self) -> Duration {
        Duration::from_micros(self.connect_limit_us.load(Ordering::Relaxed))
    }

    /// Marks the pool unusable and closes its idle connections.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::SeqCst);
        // Waiting clients give up on this pool and pick a host again.
        self.permits.close();
        self.reserve.close();
        self.retired_signal.notify_waiters();
        let drained: Vec<Box<ServerConn>> =
            std::mem::take(&mut *self.idle.lock().expect("poisoned"));
        self.closed(drained.len());
    }

    /// Replaces every server connection gracefully (the admin console's
    /// RECONNECT, after the servers' settings or passwords changed): idle
    /// ones close now, lent ones when their client lets them go; new ones
    /// open as clients need them. No client sees an error.
    pub fn reconnect(&self) {
        self.renew_before.store(now_ns() + 1, Ordering::SeqCst);
        // Every connection lent now predates the mark.
        self.stale
            .store(self.stats.active.load(Ordering::SeqCst), Ordering::SeqCst);
        let drained: Vec<Box<ServerConn>> =
            std::mem::take(&mut *self.idle.lock().expect("poisoned"));
        self.closed(drained.len());
    }

    /// Lent connections that close when given back (after a RECONNECT);
    /// none once every connection is new.
    pub fn stale_count(&self) -> usize {
        self.stale.load(Ordering::SeqCst)
    }

    /// Whether the pool was retired.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::SeqCst)
    }

    /// Counts a client as waiting for one of the pool's connections, and
    /// puts it in line for [`Pool::oldest_wait`], while the guard lives: in
    /// [`Pool::checkout`], and for a wait outside it (a paused service).
    pub(crate) fn count_waiting(&self) -> impl Drop + '_ {
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        let ticket = self.next_waiter.fetch_add(1, Ordering::Relaxed);
        self.waiters
            .lock()
            .expect("poisoned")
            .push_back((ticket, Instant::now()));
        Waiting { pool: self, ticket }
    }

    /// How long the client waiting longest now has waited (PgBouncer's
    /// `maxwait`), in line or past it for room under a connection cap;
    /// zero with nobody waiting.
    pub fn oldest_wait(&self) -> Duration {
        let in_line = self
            .waiters
            .lock()
            .expect("poisoned")
            .front()
            .map_or(Duration::ZERO, |(_, since)| since.elapsed());
        let capped = self
            .capped_waiters
            .lock()
            .expect("poisoned")
            .iter()
            .map(|(_, since)| since.elapsed())
            .max()
            .unwrap_or(Duration::ZERO);
        in_line.max(capped)
    }

    /// Server connections being opened (logging in) now.
    pub fn opening(&self) -> usize {
        self.opening.load(Ordering::Relaxed)
    }

    /// Whether anything has to do with the pool now: a server connection
    /// open or being opened, a client holding one or waiting for one.
    pub fn in_use(&self) -> bool {
        let s = &self.stats;
        [
            &s.total,
            &s.active,
            &s.waiting,
            &s.capped,
            &self.warming,
            &self.opening,
            &self.stale,
        ]
        .iter()
        .any(|n| n.load(Ordering::SeqCst) > 0)
    }

    /// Whether the pool has been unused ([`Pool::in_use`]), with no query
    /// run, for `quiet` or longer, as far as calls of this, made from time
    /// to time, have seen.
    pub fn unused_for(&self, quiet: Duration) -> bool {
        let queries = self.stats.queries.load(Ordering::Relaxed);
        let mut since = self.unused_since.lock().expect("poisoned");
        if self.in_use() {
            *since = None;
            return false;
        }
        let now = now_ns();
        match *since {
            Some((at, q)) if q == queries => now.saturating_sub(at) >= nanos(quiet),
            _ => {
                *since = Some((now, queries));
                false
            }
        }
    }

    /// Opens connections until `min_size` exist, in the background; a
    /// [`WARM_RETRY`] after a warm-up failed.
    pub fn warm(self: &Arc<Self>) {
        let min = self.settings.load().min_size;
        if min == 0 || now_ns() < self.warm_after.load(Ordering::Relaxed) {
            return;
        }
        // Connections being opened count too, or every topology change
        // would start another batch before the last one logged in.
        let have = self.stats.total.load(Ordering::Relaxed) + self.warming.load(Ordering::Relaxed);
        let missing = min.saturating_sub(have);
        for _ in 0..missing {
            let pool = self.clone();
            let warming = Warming::new(self.clone());
            tokio::spawn(async move {
                let startup = StartupMessage::new(vec![
                    ("user".into(), pool.key.user.clone()),
                    ("database".into(), pool.key.database.clone()),
                ]);
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                // A warm-up takes only room that is free under the caps:
                // pools warming against each other would otherwise close
                // each other's idle connections round after round.
                let r = pool
                    .checkout_inner(&startup, deadline, &mut None, true)
                    .await;
                drop(warming);
                match r {
                    Ok((c, _)) => c.release(true),
                    // No room free now: not the server's doing.
                    Err(ServerError::Timeout | ServerError::Retired | ServerError::Limit(_)) => {}
                    Err(e) => {
                        pool.warm_after
                            .store(now_ns() + nanos(WARM_RETRY), Ordering::Relaxed);
                        tracing::debug!(host = %pool.key.host, error = ?e, "warming a pool failed")
                    }
                }
            });
        }
    }

    /// Records what a freshly opened connection reported for the tracked
    /// parameters it was not given (`with_app`: it was given
    /// `application_name`).
    fn learn_baseline(&self, c: &ServerConn, with_app: bool) {
        let mut base = self.baseline.lock().expect("poisoned");
        for (name, value) in c.tracked.iter() {
            if name == "application_name" && with_app {
                continue;
            }
            base.set(name, value);
        }
        if base.get("application_name").is_some() {
            self.baseline_app.store(true, Ordering::Relaxed);
        }
    }

    /// Fills the tracked parameters `params` lacks with the pool's
    /// baseline: a client that did not ask for a `DateStyle` gets the
    /// server's default, not the one another client left behind.
    pub(crate) fn adopt_baseline(&self, params: &mut Tracked) {
        params.adopt_missing(&self.baseline.lock().expect("poisoned"));
    }

    /// Remembers how to log in as the pool's role.
    pub fn set_credential(&self, cred: &Credential) {
        if !matches!(cred, Credential::None) {
            *self.credential.lock().expect("poisoned") = cred.clone();
        }
    }

    /// The pool's settings.
    pub fn settings(&self) -> Arc<PoolSettings> {
        self.settings.load_full()
    }

    /// Applies new settings (a reload) to the pool in place. A larger size
    /// or reserve serves waiting clients at once; a smaller one closes
    /// idle connections above it now and lent ones as they come back,
    /// so no transaction is cut short. A new `server_idle_timeout` and
    /// `min_size` apply at once, a new `server_lifetime` as connections
    /// are given back.
    pub fn update(self: &Arc<Self>, new: &PoolSettings) {
        let old = self.settings.swap(Arc::new(new.clone()));
        if self.is_retired() {
            return;
        }
        resize(&self.permits, &self.owed[0], old.size, new.size);
        resize(
            &self.reserve,
            &self.owed[1],
            old.reserve_size,
            new.reserve_size,
        );
        while self.stats.total.load(Ordering::Relaxed) > new.size + new.reserve_size
            && self.close_idle()
        {}
        self.prune();
        self.warm();
    }

    /// Server connections lent to clients or being opened for one now:
    /// what a switchover's drain waits for.
    pub fn busy_count(&self) -> usize {
        self.stats.active.load(Ordering::SeqCst) + self.opening.load(Ordering::SeqCst)
    }

    /// Server connections lent to or being opened for clients that are in
    /// a transaction (or about to start one): [`busy_count`](Self::busy_count)
    /// less the loans kept between transactions.
    pub fn in_transaction(&self) -> usize {
        // The loans first: a held one released in between is then
        // counted in (a pause waits a moment longer), never out twice.
        let busy = self.busy_count();
        busy.saturating_sub(self.held.load(Ordering::SeqCst))
    }

    /// Idle connections now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().expect("poisoned").len()
    }

    /// What the admin console's SHOW SERVERS tells of each idle
    /// connection.
    pub(crate) fn idle_servers(&self) -> Vec<IdleServer> {
        let now = now_ns();
        let wall = crate::proxy::unix_now_s();
        let at = |t: u64| wall.saturating_sub(now.saturating_sub(t) / 1_000_000_000);
        self.idle
            .lock()
            .expect("poisoned")
            .iter()
            .map(|c| IdleServer {
                peer: c.peer,
                local: c.stream.local_addr(),
                pid: c.backend_key.0,
                opened_s: at(c.created),
                used_s: at(c.last_used),
                tls: c.stream.is_tls(),
                application_name: c.params.get("application_name").cloned(),
            })
            .collect()
    }

    /// Closes idle connections past `server_lifetime`, and those past
    /// `server_idle_timeout` above `min_size` (the longest idle first), as
    /// PgBouncer's janitor does; [`Pool::warm`] replaces the former.
    pub fn prune(&self) {
        let settings = self.settings.load();
        let (idle_limit, lifetime) = (settings.server_idle_timeout, settings.server_lifetime);
        if idle_limit.is_none() && lifetime.is_none() {
            return;
        }
        let now = now_ns();
        let mut idle = self.idle.lock().expect("poisoned");
        let before = idle.len();
        if let Some(l) = lifetime {
            let l = nanos(l);
            idle.retain(|c| now.saturating_sub(c.created) < l);
        }
        if let Some(l) = idle_limit {
            let l = nanos(l);
            let total = self.stats.total.load(Ordering::Relaxed) - (before - idle.len());
            let mut spare = total.saturating_sub(settings.min_size);
            // Oldest use first: the vector is kept in order of return.
            idle.retain(|c| {
                let close = spare > 0 && now.saturating_sub(c.last_used) >= l;
                spare -= usize::from(close);
                !close
            });
        }
        self.closed(before - idle.len());
    }

    /// An idle connection at once, or `None` (no permit free, or nothing
    /// idle, or clients already waiting: they go first).
    pub fn try_checkout(self: &Arc<Self>) -> Option<Checkout> {
        if self.stats.waiting.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        let conn = self.pop_live(false)?;
        let conn = self.moved_here(conn)?;
        // Sequentially consistent (a locked instruction either way on x86):
        // a client looks at its service's pause switch after this, and a
        // pause that then finds no server lent must be seen there.
        self.stats.active.fetch_add(1, Ordering::SeqCst);
        Some(Checkout {
            conn,
            pool: self.clone(),
            traffic: Traffic::starting(),
            read_armed: false,
            held: false,
            permit: Some(permit),
        })
    }

    /// An idle connection ([`pop_idle`]) whose server has not gone away
    /// meanwhile; those that have are closed on the way, so that no client
    /// gets a stale FATAL for its first statement.
    /// `capped`: for a client waiting under a cap, which may take one set
    /// aside for such clients ([`Pool::promised`]); others may not.
    fn pop_live(&self, capped: bool) -> Option<Box<ServerConn>> {
        loop {
            let conn = {
                let mut idle = self.idle.lock().expect("poisoned");
                let promised = self.promised.load(Ordering::Relaxed);
                if capped {
                    if promised > 0 {
                        self.promised.store(promised - 1, Ordering::Relaxed);
                    }
                } else if idle.len() <= promised {
                    return None;
                }
                pop_idle(&mut idle)?
            };
            if !conn.stream.spoke_while_idle() {
                return Some(conn);
            }
            tracing::debug!(host = %self.key.host, "an idle server connection was closed by the server");
            self.closed(1);
        }
    }

    /// The password for a new server connection of a client pgwarden
    /// holds no credential of: the configured one, or this pool's own
    /// password file line (read at each connect, as libpq does, so an
    /// edited file needs no reload).
    fn server_password(&self) -> Option<String> {
        let settings = self.settings.load();
        settings.server_password.clone().or_else(|| {
            let k = &self.key;
            settings
                .server_pgpass
                .then(|| {
                    pgwarden_probe::pgpass_lookup(&k.host.host, k.host.port, &k.database, &k.user)
                })
                .flatten()
        })
    }

    /// [`move_here`], counting a connection lost on the way.
    fn moved_here(&self, conn: Box<ServerConn>) -> Option<Box<ServerConn>> {
        let from = conn.home;
        match move_here(conn) {
            Ok(c) => {
                if c.home != from {
                    self.stats.moves.fetch_add(1, Ordering::Relaxed);
                }
                Some(c)
            }
            Err(e) => {
                tracing::warn!(host = %self.key.host, error = %e, "moving a server connection between workers failed; it is closed");
                self.closed(1);
                None
            }
        }
    }

    /// Waits (FIFO, up to `query_wait_timeout`) for a permit, then reuses an
    /// idle connection or opens a new one.
    pub async fn checkout(
        self: &Arc<Self>,
        startup: &StartupMessage,
        deadline: tokio::time::Instant,
    ) -> Result<Checkout, ServerError> {
        let (c, _waited) = self.checkout_timed(startup, deadline, &mut None).await?;
        Ok(c)
    }

    /// A permit of the reserve once the client has waited
    /// `reserve_timeout` since `started`; never without a reserve.
    async fn from_reserve(
        self: &Arc<Self>,
        started: Instant,
    ) -> Result<OwnedSemaphorePermit, ServerError> {
        let settings = self.settings.load();
        if settings.reserve_size == 0 {
            return std::future::pending().await;
        }
        let wait = settings.reserve_timeout;
        drop(settings);
        crate::timer::sleep_until((started + wait).into()).await;
        let p = self.reserve.clone().acquire_owned().await;
        p.map_err(|_| ServerError::Retired)
    }

    /// [`checkout`](Self::checkout) with a timer the caller keeps between
    /// waits. Once a client has waited, the next wait only moves its
    /// timer's deadline later, an atomic store, instead of adding a timer
    /// to the event loop's wheel and removing it again: with clients
    /// outnumbering servers, every transaction waits. Also says how long
    /// the client waited.
    pub async fn checkout_timed(
        self: &Arc<Self>,
        startup: &StartupMessage,
        deadline: tokio::time::Instant,
        timer: &mut Option<Pin<Box<tokio::time::Sleep>>>,
    ) -> Result<(Checkout, Duration), ServerError> {
        self.checkout_inner(startup, deadline, timer, false).await
    }

    /// [`checkout_timed`](Self::checkout_timed); `warming`: a new
    /// connection takes only room that is free under the caps now.
    async fn checkout_inner(
        self: &Arc<Self>,
        startup: &StartupMessage,
        deadline: tokio::time::Instant,
        timer: &mut Option<Pin<Box<tokio::time::Sleep>>>,
        warming: bool,
    ) -> Result<(Checkout, Duration), ServerError> {
        let started = Instant::now();
        let (permit, mut waited) = if warming {
            // A warm-up opens a connection only in room free now, and is
            // no client: not in line (cl_waiting, maxwait, the fast path
            // that lets a line go first), never given an idle one.
            let p = self.permits.clone().try_acquire_owned();
            (p.map_err(|_| ServerError::Timeout)?, 0)
        } else {
            let waiting = self.count_waiting();
            let timer = match timer {
                Some(t) => {
                    t.as_mut().reset(deadline);
                    t
                }
                None => timer.insert(Box::pin(crate::timer::sleep_until(deadline))),
            };
            let permit = tokio::select! {
                biased;
                p = self.permits.clone().acquire_owned() => p.map_err(|_| ServerError::Retired),
                _ = timer.as_mut() => Err(ServerError::Timeout),
                // A client that has waited this long may take a connection
                // of the reserve, while still in line for the pool's own.
                p = self.from_reserve(started) => p,
            };
            drop(waiting);
            let permit = permit?;
            let waited = started.elapsed().as_micros() as u64;
            self.stats.wait_us.fetch_add(waited, Ordering::Relaxed);
            (permit, waited)
        };
        let reused = if warming { None } else { self.pop_live(false) };
        let conn = match reused.and_then(|c| self.moved_here(c)) {
            Some(c) => c,
            None => {
                let stored = self.credential.lock().expect("poisoned").clone();
                let cred = match stored {
                    Credential::None => match self.server_password() {
                        Some(p) => Credential::Password(p.into_bytes()),
                        None => Credential::None,
                    },
                    c => c,
                };
                loop {
                    let room = self.slots(deadline, warming, started).await?;
                    // A wait for room under a cap is a wait for a server too.
                    let capped = (started.elapsed().as_micros() as u64).saturating_sub(waited);
                    if capped > 0 && !warming {
                        self.stats.wait_us.fetch_add(capped, Ordering::Relaxed);
                        waited += capped;
                    }
                    let slots = match room {
                        Room::Slots(slots) => slots,
                        Room::Idle(c) => match self.moved_here(c) {
                            Some(c) => break c,
                            None => continue,
                        },
                    };
                    // A server that accepts and then says nothing (frozen, or
                    // partitioned before the probes mark it down) costs the
                    // client its connect time-out, not its whole wait: it then
                    // picks a host again.
                    let limit = self.connect_limit();
                    let remaining = deadline
                        .saturating_duration_since(tokio::time::Instant::now())
                        .max(Duration::from_secs(1))
                        .min(limit);
                    let retired = self.retired_signal.notified();
                    tokio::pin!(retired);
                    retired.as_mut().enable();
                    if self.is_retired() {
                        return Err(ServerError::Retired);
                    }
                    // Boxed: logging in is rare and its state large, and
                    // without it every wait for a server would carry it.
                    let with_app = self.baseline_app.load(Ordering::Relaxed);
                    // The pool is in use while it opens one, though nothing
                    // else counts it yet.
                    let _opening = Counted::new(&self.opening, Ordering::SeqCst);
                    let server_tls = self.server_tls.load();
                    let opened = crate::timer::timeout(
                        remaining,
                        Box::pin(connect(&self.key, startup, &cred, &server_tls, with_app)),
                    );
                    let c = tokio::select! {
                        // Retired meanwhile (its host failed or was demoted):
                        // the client picks a host again at once.
                        _ = retired => return Err(ServerError::Retired),
                        r = opened => match r {
                            Ok(r) => r?,
                            Err(_) if remaining == limit => {
                                return Err(ServerError::Failed(format!(
                                    "connecting to {} timed out after {} ms",
                                    self.key.host,
                                    limit.as_millis()
                                )))
                            }
                            Err(_) => return Err(ServerError::Timeout),
                        },
                    };
                    if self.settings.load().wants_primary && c.in_hot_standby() {
                        // The old primary of a switchover, back as a standby
                        // before the topology shows it: the client waits for
                        // the new one instead.
                        return Err(ServerError::Failed(format!(
                            "{} is a standby, not the primary",
                            self.key.host
                        )));
                    }
                    self.learn_baseline(&c, with_app);
                    self.opened();
                    let mut c = Box::new(c);
                    c.slots = slots;
                    break c;
                }
            }
        };
        // Retired while the connection was being found or opened (a
        // failover): it would reach a host that no longer serves the pool.
        if self.is_retired() {
            self.closed(1);
            return Err(ServerError::Retired);
        }
        // Sequentially consistent (a locked instruction either way on x86):
        // a client looks at its service's pause switch after this, and a
        // pause that then finds no server lent must be seen there.
        self.stats.active.fetch_add(1, Ordering::SeqCst);
        let checkout = Checkout {
            conn,
            pool: self.clone(),
            traffic: Traffic::starting(),
            read_armed: false,
            held: false,
            permit: Some(permit),
        };
        Ok((checkout, Duration::from_micros(waited)))
    }
}

/// Changes the permits of `sem` from `from` to `to`: added at once, or
/// taken away at once where free and otherwise owed, to be forgotten as
/// their loans end.
fn resize(sem: &Semaphore, owed: &AtomicUsize, from: usize, to: usize) {
    if to >= from {
        let grow = to - from;
        // What is still owed is simply no longer owed.
        let mut cancelled = 0;
        let _ = owed.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            cancelled = n.min(grow);
            Some(n - cancelled)
        });
        sem.add_permits(grow - cancelled);
    } else {
        let shrink = from - to;
        let now = sem.forget_permits(shrink);
        owed.fetch_add(shrink - now, Ordering::SeqCst);
    }
}

impl Checkout {
    /// Marks whether the client keeps this server between two
    /// transactions now, as [`Pool::in_transaction`] counts it.
    /// Sequentially consistent: a pause that looks after its switch was
    /// set must see a transaction that started before.
    pub fn set_held(&mut self, on: bool) {
        if self.held != on {
            self.held = on;
            if on {
                self.pool.held.fetch_add(1, Ordering::SeqCst);
            } else {
                self.pool.held.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// Returns the connection to its pool (it must be idle, outside a
    /// transaction), or closes it when `reusable` is false, the pool was
    /// retired or the connection outlived `server_lifetime`.
    pub fn release(mut self, reusable: bool) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped nor used again, so the
        // connection and the pool are moved out of it once; the other
        // fields own nothing (the permit was taken above).
        #[allow(unsafe_code)]
        let (mut conn, pool) = unsafe { (std::ptr::read(&this.conn), std::ptr::read(&this.pool)) };
        let traffic = this.traffic;
        // Held until the connection is back (or counted closed): a client
        // woken by the permit must find it idle, not open another.
        let (reuse, _permit) = settle(&pool, &conn, traffic, this.held, permit, reusable);
        if !reuse {
            pool.closed(1);
            return;
        }
        conn.last_used = traffic.ended();
        let promise = {
            let mut idle = pool.idle.lock().expect("poisoned");
            if pool.is_retired() {
                // Retired since `settle` looked, its idle connections
                // already closed: one pushed now would stay open, and
                // counted, in a pool nobody uses any more. (Seen here
                // under the lock, which the retirement takes after
                // setting the flag.)
                drop(idle);
                pool.closed(1);
                return;
            }
            idle.push(conn);
            // Its own clients waiting under a cap come before the
            // line: they were in it earlier, and room under the cap
            // may not free up while the line keeps every connection
            // busy.
            let promised = pool.promised.load(Ordering::Relaxed);
            let promise = pool.stats.capped.load(Ordering::Relaxed) > promised;
            if promise {
                pool.promised.store(promised + 1, Ordering::Relaxed);
            }
            promise
        };
        if promise {
            pool.promised_signal.notify_one();
        } else if pool.stats.waiting.load(Ordering::Relaxed) == 0
            && pool.limits.iter().any(|l| l.wants_room())
        {
            // Kept idle first, then the caps looked at: a pool that
            // starts waiting for a slot meanwhile either finds it idle
            // or is seen here.
            pool.close_idle();
        }
    }
}

/// The accounting of a loan that ends: its traffic added to the pool's
/// counts, no longer counted as `held` between transactions, a permit a
/// reload took away forgotten. True when `conn` may go
/// back to the pool (`reusable`, and neither expired nor retired); false
/// when the caller is to close it and count it closed. The permit comes
/// back unless it was forgotten, for the caller to drop once it is done.
fn settle(
    pool: &Arc<Pool>,
    conn: &ServerConn,
    traffic: Traffic,
    held: bool,
    permit: OwnedSemaphorePermit,
    reusable: bool,
) -> (bool, Option<OwnedSemaphorePermit>) {
    if held {
        pool.held.fetch_sub(1, Ordering::SeqCst);
    }
    // After the `held` count: a drain that sees the loan gone sees it no
    // longer held either, and never counts it out twice.
    pool.stats.active.fetch_sub(1, Ordering::SeqCst);
    // A loan that ran nothing (a login's greeting, a wait cancelled
    // as the server came) is no transaction.
    let (transactions, xact_us) = traffic.transaction_totals();
    if transactions > 0 {
        pool.stats
            .transactions
            .fetch_add(transactions, Ordering::Relaxed);
    }
    pool.stats
        .queries
        .fetch_add(traffic.queries, Ordering::Relaxed);
    pool.stats
        .received
        .fetch_add(traffic.received, Ordering::Relaxed);
    pool.stats.sent.fetch_add(traffic.sent, Ordering::Relaxed);
    let ended = traffic.ended();
    if traffic.queries > 0 {
        pool.stats.xact_us.fetch_add(xact_us, Ordering::Relaxed);
        pool.stats
            .query_us
            .fetch_add(traffic.query_us, Ordering::Relaxed);
    }
    let settings = pool.settings.load();
    // A permit a reload took away ends with this loan.
    let which = usize::from(!Arc::ptr_eq(permit.semaphore(), &pool.permits));
    let permit = if pool.owed[which].load(Ordering::Relaxed) > 0
        && pool.owed[which]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    {
        permit.forget();
        None
    } else {
        Some(permit)
    };
    let lifetime = settings.server_lifetime;
    let renewed = conn.created < pool.renew_before.load(Ordering::Relaxed);
    if renewed {
        let _ = pool
            .stale
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }
    // Above a size a reload lowered, connections close as they come
    // back (steadily there are never more than size and reserve).
    let excess = pool.stats.total.load(Ordering::Relaxed) > settings.size + settings.reserve_size;
    let expired = lifetime.is_some_and(|l| ended.saturating_sub(conn.created) >= nanos(l))
        || renewed
        || excess;
    (reusable && !expired && !pool.is_retired(), permit)
}

/// The start-up parameter a new server connection takes from the client
/// it opens for. Most clients of a pool are one application: with its
/// name as the server's default, neither a new client nor a reset
/// (DISCARD ALL returns to the default) needs a SET. The other tracked
/// parameters are left to the server, so that what RESET returns to on a
/// server is the pool's baseline, never one client's choice.
const SERVER_DEFAULTS: [&str; 1] = ["application_name"];

/// The part of a client's start-up message that opening a server
/// connection for it reads ([`SERVER_DEFAULTS`]). Kept in place, not
/// copied: a connect-per-transaction client would pay two allocations for
/// its application name alone.
pub(crate) fn server_defaults(mut client_startup: StartupMessage) -> StartupMessage {
    client_startup
        .params
        .retain(|(k, _)| SERVER_DEFAULTS.contains(&k.as_str()));
    // Kept for the client's whole life, idle or not.
    client_startup.params.shrink_to_fit();
    client_startup.protocol = (3, 0);
    client_startup
}

/// Opens a server connection for a pool and logs in.
async fn connect(
    key: &PoolKey,
    client_startup: &StartupMessage,
    cred: &Credential,
    server_tls: &ServerTls,
    with_app: bool,
) -> Result<ServerConn, ServerError> {
    let fail = |e: std::io::Error| ServerError::Failed(format!("{}: {e}", key.host));
    let tcp = TcpStream::connect((key.host.host.as_str(), key.host.port))
        .await
        .map_err(fail)?;
    crate::stream::tune(&tcp);
    let stream = server_tls
        .start(tcp, &key.host.host)
        .await
        .map_err(|e| ServerError::Failed(format!("{}: {e}", key.host)))?;
    let mut startup = StartupMessage::new(vec![
        ("user".into(), key.user.clone()),
        ("database".into(), key.database.clone()),
    ]);
    if with_app {
        for (name, v) in &client_startup.params {
            if SERVER_DEFAULTS.contains(&name.as_str()) {
                startup.set(name, v);
            }
        }
    }
    if key.read_only {
        startup.set("default_transaction_read_only", "on");
    }
    login(stream, &startup, cred).await
}

/// Logs in on an open server connection: startup packet, authentication
/// with what the client proved (or the configured password), then
/// ParameterStatus and BackendKeyData until ReadyForQuery.
pub(crate) async fn login(
    mut stream: ServerStream,
    startup: &StartupMessage,
    cred: &Credential,
) -> Result<ServerConn, ServerError> {
    let peer = stream
        .peer_addr()
        .map_err(|e| ServerError::Failed(e.to_string()))?;
    let fail = |e: std::io::Error| ServerError::Failed(format!("{peer}: {e}"));
    let user = startup.user().unwrap_or_default().to_string();
    stream.write_all(&startup.encode()).await.map_err(fail)?;
    let mut buf = BytesMut::with_capacity(4096);
    let mut params = HashMap::new();
    let mut tracked = Tracked::default();
    let mut backend_key = (0, 0);
    let mut scram: Option<ScramClient> = None;
    // Not worth retrying: the next attempt would find no credential either.
    // The client hears it at once, as a refused login.
    let need = |what: &str| {
        let why = format!("{peer} asks for {what} authentication and pgwarden has no credential for role \"{user}\" that fits");
        tracing::warn!("{why}");
        ServerError::Refused(pgwarden_wire::encode::fatal(
            pgwarden_wire::sqlstate::CONNECTION_FAILURE.code(),
            &why,
        ))
    };
    loop {
        let (tag, msg) = loop {
            match message::split_message(&mut buf, 1 << 20) {
                Ok(Some(m)) => break m,
                Ok(None) => {}
                Err(e) => return Err(ServerError::Failed(format!("{peer}: {e}"))),
            }
            if stream.read_buf(&mut buf).await.map_err(fail)? == 0 {
                return Err(ServerError::Failed(format!(
                    "{peer} closed the connection during login"
                )));
            }
        };
        let body = &msg[5..];
        match tag {
            backend::ERROR_RESPONSE => {
                // "Starting up", "shutting down", "in recovery mode": the
                // host, not the login, is not ready (a restart, the old
                // primary of a switchover). A failure, which the client's
                // wait tries again or elsewhere, not a refusal to relay.
                let fields = message::error_fields_raw(body).unwrap_or_default();
                if message::find_raw_field(&fields, b'C')
                    == Some(
                        pgwarden_wire::sqlstate::CANNOT_CONNECT_NOW
                            .code()
                            .as_bytes(),
                    )
                {
                    let text = message::find_raw_field(&fields, b'M')
                        .map_or("not ready".into(), String::from_utf8_lossy);
                    return Err(ServerError::NotReady(text.into_owned()));
                }
                return Err(ServerError::Refused(msg));
            }
            backend::AUTHENTICATION_REQUEST => {
                let code = message::authentication_code(body)
                    .map_err(|e| ServerError::Failed(e.to_string()))?;
                let mut out = BytesMut::new();
                match (code, cred) {
                    (0, _) => continue,
                    (3, Credential::Password(p)) => password_message(&mut out, p),
                    (3, _) => return Err(need("cleartext password")),
                    (5, Credential::Password(_) | Credential::Md5Secret(_)) => {
                        let salt: [u8; 4] = body
                            .get(4..8)
                            .and_then(|s| s.try_into().ok())
                            .ok_or_else(|| ServerError::Failed("bad md5 request".into()))?;
                        let secret = match cred {
                            Credential::Password(p) => pgwarden_auth::md5_secret(&user, p),
                            Credential::Md5Secret(s) => s.clone(),
                            _ => unreachable!("matched above"),
                        };
                        password_message(
                            &mut out,
                            pgwarden_auth::md5_response(&secret, salt).as_bytes(),
                        );
                    }
                    (5, _) => return Err(need("md5")),
                    (10, Credential::Password(_) | Credential::ClientKey(_)) => {
                        let nonce: [u8; 18] = rand::random();
                        let mut c = match cred {
                            Credential::Password(p) => ScramClient::with_password(p, nonce),
                            Credential::ClientKey(k) => {
                                ScramClient::with_client_key(k.clone(), None, nonce)
                            }
                            _ => unreachable!("matched above"),
                        };
                        let first = c
                            .client_first()
                            .map_err(|e| ServerError::Failed(e.to_string()))?;
                        sasl_initial(&mut out, pgwarden_auth::scram::MECHANISM, &first);
                        scram = Some(c);
                    }
                    (10, _) => return Err(need("SCRAM-SHA-256")),
                    (11, _) => {
                        let c = scram.as_mut().ok_or_else(|| {
                            ServerError::Failed("SASL continue without start".into())
                        })?;
                        let m = c
                            .server_first(&body[4..])
                            .map_err(|e| ServerError::Failed(e.to_string()))?;
                        sasl_response(&mut out, &m);
                    }
                    (12, _) => {
                        let c = scram.as_mut().ok_or_else(|| {
                            ServerError::Failed("SASL final without start".into())
                        })?;
                        c.server_final(&body[4..])
                            .map_err(|e| ServerError::Failed(e.to_string()))?;
                        continue;
                    }
                    (other, _) => {
                        return Err(ServerError::Failed(format!(
                            "{peer} asks for unsupported authentication method {other}"
                        )));
                    }
                }
                stream.write_all(&out).await.map_err(fail)?;
            }
            backend::PARAMETER_STATUS => {
                if let Ok((k, v)) = message::parameter_status(body) {
                    tracked.set(k, v);
                    params.insert(k.to_string(), v.to_string());
                }
            }
            backend::BACKEND_KEY_DATA => {
                if let Ok(k) = message::backend_key_data(body) {
                    backend_key = k;
                }
            }
            backend::READY_FOR_QUERY => break,
            _ => {}
        }
    }
    let opened = now_ns();
    Ok(ServerConn {
        stream,
        peer,
        params,
        tracked,
        extras: Extras::default(),
        backend_key,
        prepared: StatementCache::default(),
        created: opened,
        last_used: opened,
        home: crate::workers::current(),
        status_block: None,
        slots: [None, None],
    })
}

/// Takes the idle connection that suits this thread best: the most
/// recently used one registered with this worker's event loop, else the
/// most recently used of all.
#[allow(clippy::vec_box)] // see `Pool::idle`
fn pop_idle(idle: &mut Vec<Box<ServerConn>>) -> Option<Box<ServerConn>> {
    let here = crate::workers::current();
    match idle.iter().rposition(|c| c.home == here) {
        Some(i) => Some(idle.remove(i)),
        None => idle.pop(),
    }
}

/// Moves a connection's socket into the epoll of the worker running now,
/// so that its replies wake this thread directly rather than through
/// another worker's event loop. TLS connections stay where they are
/// (rustls' stream cannot be taken apart and put back): they work from
/// any worker, at the cost of a cross-thread wake-up per read.
fn move_here(mut conn: Box<ServerConn>) -> std::io::Result<Box<ServerConn>> {
    let here = crate::workers::current();
    if conn.home == here || here == crate::workers::NONE {
        return Ok(conn);
    }
    if let ServerStream::Plain(tcp) = conn.stream {
        let tcp = TcpStream::from_std(tcp.into_std()?)?;
        conn.stream = ServerStream::Plain(tcp);
        conn.home = here;
    }
    Ok(conn)
}

/// PasswordMessage: a NUL-terminated password or md5 hash.
fn password_message(out: &mut BytesMut, data: &[u8]) {
    out.extend_from_slice(b"p");
    out.extend_from_slice(&((4 + data.len() + 1) as u32).to_be_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&[0]);
}

/// SASLResponse: raw mechanism data, no terminator.
fn sasl_response(out: &mut BytesMut, data: &[u8]) {
    out.extend_from_slice(b"p");
    out.extend_from_slice(&((4 + data.len()) as u32).to_be_bytes());
    out.extend_from_slice(data);
}

fn sasl_initial(out: &mut BytesMut, mechanism: &str, data: &[u8]) {
    out.extend_from_slice(b"p");
    let len = 4 + mechanism.len() + 1 + 4 + data.len();
    out.extend_from_slice(&(len as u32).to_be_bytes());
    out.extend_from_slice(mechanism.as_bytes());
    out.extend_from_slice(&[0]);
    out.extend_from_slice(&(data.len() as i32).to_be_bytes());
    out.extend_from_slice(data);
}

/// A SQL expression for the text `v` that the server reads as `v` whatever
/// the connection's `standard_conforming_strings` and `client_encoding`.
///
/// The values come from clients (start-up parameters, reported settings)
/// and end up in SQL that pgwarden runs on shared server connections. A
/// backslash would escape the closing quote once a client turned
/// `standard_conforming_strings` off, and under the client-only encodings
/// (SJIS, BIG5, GBK, UHC, GB18030) a non-ASCII byte can swallow the quote or
/// backslash after it. Printable ASCII without a backslash is safe as a
/// plain literal (the usual case); anything else travels as hex digits.
pub(crate) fn text_expr(v: &str) -> String {
    if plain_text(v) {
        return format!("'{}'", v.replace('\'', "''"));
    }
    let mut hex = String::with_capacity(v.len() * 2);
    for b in v.bytes() {
        hex.push_str(&format!("{b:02x}"));
    }
    format!("pg_catalog.convert_from(pg_catalog.decode('{hex}', 'hex'), 'UTF8')")
}

/// The statement that sets the session parameter `name` (a fixed,
/// pgwarden-known name) to `v`: `SET` with a plain literal where
/// [`text_expr`] allows one, `set_config` otherwise (`SET` takes no
/// expressions).
pub(crate) fn set_parameter_sql(name: &str, v: &str) -> String {
    if plain_text(v) {
        format!("SET {name} TO '{}';", v.replace('\'', "''"))
    } else {
        format!(
            "SELECT pg_catalog.set_config('{name}', {}, false);",
            text_expr(v)
        )
    }
}

fn plain_text(v: &str) -> bool {
    v.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'\\')
}

#[cfg(test)]
mod tests {

    #[test]
    fn client_text_reaches_sql_as_plain_literals_or_hex() {
        use super::{set_parameter_sql, text_expr};
        assert_eq!(text_expr("Europe/Paris"), "'Europe/Paris'");
        assert_eq!(text_expr("it's"), "'it''s'");
        assert_eq!(
            set_parameter_sql("TimeZone", "UTC"),
            "SET TimeZone TO 'UTC';"
        );
        // A backslash, a control character or a non-ASCII byte: hex, which
        // no quoting rule or client encoding can misread.
        for v in [r"a\'; SET x TO y; --", "tab\there", "caf\u{e9}"] {
            let e = text_expr(v);
            let hex: String = v.bytes().map(|b| format!("{b:02x}")).collect();
            assert_eq!(
                e,
                format!("pg_catalog.convert_from(pg_catalog.decode('{hex}', 'hex'), 'UTF8')")
            );
            assert!(e.bytes().all(|b| b.is_ascii_graphic() || b == b' ') && !e.contains('\\'));
            assert!(set_parameter_sql("application_name", v).starts_with(
                "SELECT pg_catalog.set_config('application_name', pg_catalog.convert_from("
            ));
        }
    }

    use super::{Extras, StatementCache, Tracked};
    use pgwarden_wire::startup::StartupMessage;

    #[test]
    fn tracked_values_compare_by_content_whatever_their_allocation() {
        let mut a = Tracked::default();
        let mut b = Tracked::default();
        assert_eq!(a, b);
        a.set("TimeZone", "UTC");
        assert_ne!(a, b, "a value against none");
        b.0[3] = Some(std::sync::Arc::from(String::from("UTC")));
        assert_eq!(a, b, "equal values in two allocations");
        b.adopt_missing(&a);
        b.set("TimeZone", "Europe/Paris");
        assert_ne!(a, b);
        let mut c = Tracked::default();
        c.adopt_missing(&a);
        assert_eq!(a, c, "shared values");
    }

    fn startup(params: &[(&str, &str)]) -> StartupMessage {
        StartupMessage::new(
            params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    fn pairs(e: &Extras) -> Vec<(&str, &str)> {
        e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }

    #[test]
    fn start_up_settings_come_from_parameters_and_options() {
        let s = startup(&[
            ("user", "app"),
            ("database", "db"),
            ("application_name", "tracked, not extra"),
            ("_pq_.something", "protocol extension"),
            ("extra_float_digits", "3"),
            (
                "options",
                r"-c search_path=a,\ b --statement-timeout=5s -cwork_mem=8MB",
            ),
        ]);
        let e = Extras::from_startup(&s, false).unwrap();
        assert_eq!(
            pairs(&e),
            [
                ("extra_float_digits", "3"),
                ("search_path", "a, b"),
                ("statement_timeout", "5s"),
                ("work_mem", "8MB"),
            ]
        );
        // Nothing beyond the basics: nothing to compare.
        let plain = Extras::from_startup(&startup(&[("user", "app")]), false).unwrap();
        assert_eq!(plain, Extras::default());
        // A read-only service sets this one itself.
        let ro = startup(&[("default_transaction_read_only", "on")]);
        assert_eq!(Extras::from_startup(&ro, true).unwrap(), Extras::default());
        assert_eq!(pairs(&Extras::from_startup(&ro, false).unwrap()).len(), 1);
        // A parameter wins over the same setting in `options`, as in
        // PostgreSQL, wherever it comes in the packet.
        for twice in [
            startup(&[("work_mem", "1MB"), ("options", "-c work_mem=2MB")]),
            startup(&[("options", "-c work_mem=2MB"), ("work_mem", "1MB")]),
        ] {
            let e = Extras::from_startup(&twice, false).unwrap();
            assert_eq!(pairs(&e), [("work_mem", "1MB")]);
        }
        // A tracked parameter is tracked however it comes, never set
        // like the rest.
        let enc = startup(&[
            ("options", "-c client_encoding=LATIN1 -c DateStyle=German"),
            ("TIMEZONE", "UTC"),
            ("work_mem", "1MB"),
        ]);
        assert_eq!(
            pairs(&Extras::from_startup(&enc, false).unwrap()),
            [("work_mem", "1MB")]
        );
    }

    #[test]
    fn tracked_parameters_are_read_in_any_case_and_from_options() {
        let t = Tracked::from_startup(&startup(&[
            ("user", "app"),
            (
                "options",
                "-c TimeZone=Asia/Tokyo -c intervalstyle=iso_8601 --datestyle=German",
            ),
            ("datestyle", "ISO, DMY"),
            ("application_name", "app"),
        ]));
        // A parameter wins over `options`, as in PostgreSQL.
        assert_eq!(
            t.iter().collect::<Vec<_>>(),
            [
                ("application_name", "app"),
                ("DateStyle", "ISO, DMY"),
                ("TimeZone", "Asia/Tokyo"),
                ("IntervalStyle", "iso_8601"),
            ]
        );
        // Later values win.
        let t = Tracked::from_startup(&startup(&[
            ("options", "-c TimeZone=UTC -c timezone=Asia/Tokyo"),
            ("TimeZone", "UTC"),
            ("timezone", "Europe/Paris"),
        ]));
        assert_eq!(t.get("TimeZone"), Some("Europe/Paris"));
        let t = Tracked::from_startup(&startup(&[(
            "options",
            "-c TimeZone=UTC -c timezone=Asia/Tokyo",
        )]));
        assert_eq!(t.get("TimeZone"), Some("Asia/Tokyo"));
        assert_eq!(
            Tracked::name_of("STANDARD_CONFORMING_STRINGS"),
            Some("standard_conforming_strings")
        );
        assert_eq!(Tracked::name_of("search_path"), None);
    }

    #[test]
    fn start_up_settings_pooling_cannot_honour_are_refused() {
        for (params, why) in [
            (vec![("options", "-B 100")], "not supported"),
            (vec![("options", "-c")], "without a setting"),
            (vec![("options", "-c search_path")], "not name=value"),
            (vec![("replication", "database")], "replication"),
            (vec![("role", "admin")], "connect as that role"),
            (
                vec![("options", "-c session_authorization=x")],
                "connect as that role",
            ),
            (
                vec![("bad name;", "1")],
                "invalid configuration parameter name",
            ),
        ] {
            let err = Extras::from_startup(&startup(&params), false).unwrap_err();
            assert!(err.contains(why), "{params:?}: {err}");
        }
    }

    #[test]
    fn settings_are_set_where_they_differ_and_reset_where_not_wanted() {
        let e = |p: &[(&str, &str)]| Extras::from_startup(&startup(p), false).unwrap();
        let mine = e(&[("search_path", "it's, b"), ("work_mem", "8MB")]);
        assert_eq!(mine.sql_from(&mine), "");
        assert_eq!(
            mine.sql_from(&Extras::default()),
            "SELECT pg_catalog.set_config('search_path', 'it''s, b', false);\
             SELECT pg_catalog.set_config('work_mem', '8MB', false);"
        );
        let theirs = e(&[("work_mem", "8MB"), ("lock_timeout", "1s")]);
        assert_eq!(
            mine.sql_from(&theirs),
            "SELECT pg_catalog.set_config('search_path', 'it''s, b', false);RESET lock_timeout;"
        );
        assert_eq!(
            Extras::default().sql_from(&theirs),
            "RESET lock_timeout;RESET work_mem;"
        );
    }

    #[test]
    fn the_least_recently_used_statements_go_first_and_the_one_in_use_stays() {
        let mut c = StatementCache::default();
        for n in ["a", "b", "c", "d"] {
            c.insert(n);
        }
        assert!(c.touch("a"));
        assert!(!c.touch("x"));
        // "b" is now the oldest, then "c".
        assert_eq!(c.evict(2, "d"), vec!["b".to_string(), "c".to_string()]);
        assert_eq!(c.len(), 2);
        assert!(c.touch("a") && c.touch("d"));
        // The statement about to run is spared even when it is the oldest.
        c.insert("e");
        c.insert("f");
        assert_eq!(
            c.evict(1, "a"),
            vec!["d".to_string(), "e".to_string(), "f".to_string()]
        );
        assert!(c.touch("a"));
        // Nothing to do within the bound; a bound of 0 counts as 1.
        assert!(c.evict(5, "a").is_empty());
        assert!(c.evict(0, "a").is_empty());
        c.remove("a");
        assert!(c.is_empty());
    }
}
