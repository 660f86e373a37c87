//! From the raw file to a [`Config`]: defaults, derived values and the
//! checks that involve more than one key.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::time::Duration;

use pgwarden_topology::{HostConfig, SelectPolicy};
use toml::Spanned;

use crate::duration::Dur;
use crate::error::ConfigError;
use crate::keypath::segment as key_segment;
use crate::raw::{
    ListenAddr, RawCluster, RawEngine, RawFile, RawListen, RawLog, RawPool, RawPoolOverride,
    RawService,
};
use crate::sections::{
    ClusterConfig, EngineConfig, ListenConfig, LogConfig, PoolConfig, PoolOverride, TcpTimings,
};
use crate::service::{ServiceConfig, ServiceKind, READ_ONLY, READ_WRITE};
use crate::Config;

/// How far the derived listen ports sit above the first host's port.
const RW_OFFSET: u32 = 1000;
const RO_OFFSET: u32 = 1001;
const HTTP_OFFSET: u32 = 1002;

/// Longest service name; names end up in metrics labels and log fields,
/// where a bounded length keeps them readable.
const MAX_NAME_LEN: usize = 63;

/// Upper bound for `engine.worker_threads`, far above anything useful, to
/// catch a misplaced digit before it spawns thousands of threads.
const MAX_WORKER_THREADS: usize = 1024;

const LOG_LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// Where the text came from, for turning byte spans into error messages.
pub(crate) struct Source<'a> {
    pub text: &'a str,
    pub origin: &'a str,
}

impl Source<'_> {
    /// 1-based line of a byte offset.
    pub fn line_of(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    pub(crate) fn invalid(
        &self,
        span: Option<Range<usize>>,
        key: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError::Invalid {
            origin: self.origin.to_string(),
            line: span.map(|s| self.line_of(s.start)),
            key: key.into(),
            message: message.into(),
        }
    }
}

pub(crate) fn resolve(raw: RawFile, src: &Source<'_>) -> Result<Config, ConfigError> {
    // Derived listen ports come from the first host, so errors about them
    // point at it.
    let cluster_span = raw.cluster.as_ref().map(Spanned::span);
    let raw_cluster = raw.cluster.map(Spanned::into_inner).unwrap_or_default();
    let first_host = raw_cluster
        .hosts
        .as_ref()
        .and_then(|h| h.0.first())
        .map(Spanned::span);
    let user = raw_cluster
        .user
        .as_ref()
        .map_or_else(|| "postgres".to_string(), |u| u.0.clone());
    let (agent, etcd) = match (raw.agent, raw.etcd) {
        (Some(a), Some(e)) => (
            Some(crate::agent::agent(a, &user, src)?),
            Some(crate::agent::etcd(e.into_inner(), src)?),
        ),
        (Some(_), None) => {
            return Err(src.invalid(
                None,
                "etcd",
                "the [agent] section needs an [etcd] section: the agents keep the leader lease there",
            ))
        }
        (None, Some(e)) => {
            return Err(src.invalid(
                Some(e.span()),
                "agent",
                "an [etcd] section without [agent]: add the [agent] section of this node, or remove [etcd] for standalone mode",
            ))
        }
        (None, None) => (None, None),
    };
    let cluster = cluster(raw_cluster, cluster_span, agent.as_ref(), src)?;
    let engine = engine(&raw.engine, src)?;
    let pool = pool(raw.pool, src)?;
    let log = log(raw.log, src)?;
    let tls = tls(raw.tls, src)?;
    if let Some((Some(_), Some(file))) = raw
        .auth
        .as_ref()
        .map(|a| (&a.auth_password, &a.auth_password_file))
    {
        return Err(src.invalid(
            Some(file.span()),
            "auth.auth_password_file",
            "auth.auth_password is set too; keep only one of them",
        ));
    }
    let auth = raw.auth.map(|a| crate::sections::AuthConfig {
        hba_file: a.hba_file.into_inner().into(),
        auth_user: a.auth_user,
        auth_password: a.auth_password,
        auth_password_file: a.auth_password_file.map(|p| p.into_inner().into()),
        auth_query: a
            .auth_query
            .unwrap_or_else(|| crate::sections::DEFAULT_AUTH_QUERY.to_string()),
        auth_dbname: a.auth_dbname,
        auth_cache_ttl: a.auth_cache_ttl.map_or(Duration::from_secs(60), |d| d.0),
        auth_timeout: a.auth_timeout.map_or(Duration::from_secs(60), |d| d.0),
    });
    let (listen, services, listeners) = services(
        &raw.listen,
        raw.services,
        first_host,
        &cluster,
        &engine,
        &pool,
        src,
    )?;
    if let Some(a) = &agent {
        check_clear_of_agent(&listeners, a, src)?;
    }
    Ok(Config {
        cluster,
        listen,
        engine,
        pool,
        log,
        tls,
        auth,
        agent,
        etcd,
        services,
    })
}

fn tls(
    raw: crate::raw::RawTls,
    src: &Source<'_>,
) -> Result<crate::sections::TlsConfig, ConfigError> {
    use crate::sections::ClientTls;
    let span = |v: &Option<toml::Spanned<String>>| v.as_ref().map(|s| s.span());
    match (&raw.cert, &raw.key) {
        (Some(_), None) => {
            return Err(src.invalid(
                span(&raw.cert),
                "tls.key",
                "a certificate needs its private key",
            ));
        }
        (None, Some(_)) => {
            return Err(src.invalid(
                span(&raw.key),
                "tls.cert",
                "a private key needs its certificate",
            ));
        }
        _ => {}
    }
    let has_cert = raw.cert.is_some();
    let client_tls = raw.client_tls.as_ref().map_or(
        if has_cert {
            ClientTls::Allow
        } else {
            ClientTls::Disable
        },
        |v| *v.get_ref(),
    );
    if client_tls != ClientTls::Disable && !has_cert {
        return Err(src.invalid(
            raw.client_tls.as_ref().map(|v| v.span()),
            "tls.client_tls",
            "needs tls.cert and tls.key",
        ));
    }
    if let Some(ca) = &raw.client_ca {
        if !has_cert {
            return Err(src.invalid(
                Some(ca.span()),
                "tls.client_ca",
                "client certificates are checked in the TLS handshake with clients, which needs tls.cert and tls.key",
            ));
        }
        if client_tls == ClientTls::Disable {
            return Err(src.invalid(
                Some(ca.span()),
                "tls.client_ca",
                "client certificates need TLS towards clients, and tls.client_tls is \"disable\"",
            ));
        }
    }
    let server_tls = raw
        .server_tls
        .as_ref()
        .map_or_else(Default::default, |v| *v.get_ref());
    if server_tls.verifies() && raw.server_ca.is_none() {
        return Err(src.invalid(
            raw.server_tls.as_ref().map(|v| v.span()),
            "tls.server_ca",
            "server_tls = verify-ca and verify-full need the CA that signed the servers' certificates",
        ));
    }
    if let (false, Some(ca)) = (server_tls.verifies(), &raw.server_ca) {
        // Silently unused, it would look like a check that is not made.
        return Err(src.invalid(
            Some(ca.span()),
            "tls.server_ca",
            format!(
                "is used only by server_tls = \"verify-ca\" or \"verify-full\"; with \"{}\" servers' certificates are not checked: set one of those, or remove server_ca",
                server_tls.as_str()
            ),
        ));
    }
    Ok(crate::sections::TlsConfig {
        cert: raw.cert.map(|c| c.into_inner().into()),
        key: raw.key.map(|k| k.into_inner().into()),
        client_tls,
        server_tls,
        server_ca: raw.server_ca.map(|c| c.into_inner().into()),
        client_ca: raw.client_ca.map(|c| c.into_inner().into()),
    })
}

fn cluster(
    raw: RawCluster,
    span: Option<Range<usize>>,
    agent: Option<&crate::agent::AgentConfig>,
    src: &Source<'_>,
) -> Result<ClusterConfig, ConfigError> {
    let listed = match (raw.hosts, agent) {
        (Some(h), _) => h.0,
        (None, Some(_)) => Vec::new(),
        (None, None) => {
            return Err(src.invalid(
                span,
                "cluster.hosts",
                "is required: list the PostgreSQL servers (or add an [agent] section to run the HA agent)",
            ))
        }
    };
    let mut hosts: Vec<HostConfig> = Vec::with_capacity(listed.len() + 1);
    for item in listed {
        let span = item.span();
        let h = item.into_inner();
        // Host names are case-insensitive, so DB1 and db1 are one server.
        if let Some(other) = hosts
            .iter()
            .find(|o| o.addr.port == h.addr.port && o.addr.host.eq_ignore_ascii_case(&h.addr.host))
        {
            return Err(src.invalid(
                Some(span),
                "cluster.hosts",
                format!("{} is listed more than once", other.addr),
            ));
        }
        if let Some(name) = &h.application_name {
            // Matched against pg_stat_replication case-insensitively, as
            // PostgreSQL matches synchronous_standby_names, so names that
            // differ only in case would be one name there.
            if let Some(other) = hosts.iter().find(|o| {
                o.application_name
                    .as_deref()
                    .is_some_and(|n| n.eq_ignore_ascii_case(name))
            }) {
                return Err(src.invalid(
                    Some(span),
                    "cluster.hosts",
                    format!(
                        "application_name {name:?} of {} is already used by {}",
                        h.addr, other.addr
                    ),
                ));
            }
        }
        hosts.push(HostConfig {
            addr: h.addr,
            application_name: h.application_name,
            tags: h.tags,
        });
    }
    // The agent's own node is always one of the hosts, so that its
    // connection manager serves from the first moment, before etcd lists
    // the other members.
    if let Some(a) = agent {
        let own = &a.pg_connect_address;
        if !hosts.iter().any(|h| &h.addr == own) {
            let mut h = HostConfig::new(own.clone());
            h.application_name = Some(a.name.clone());
            hosts.insert(0, h);
        }
    }
    if let (Some(_), Some(file)) = (&raw.password, &raw.password_file) {
        return Err(src.invalid(
            Some(file.span()),
            "cluster.password_file",
            "cluster.password is set too; keep only one of them",
        ));
    }
    let d = ClusterConfig::new(Vec::new());
    if let Some(n) = &raw.down_after_failures {
        if *n.get_ref() == 0 {
            return Err(src.invalid(
                Some(n.span()),
                "cluster.down_after_failures",
                "0 is out of range: expected 1 or more (1 marks a host down at its first failed probe)",
            ));
        }
    }
    Ok(ClusterConfig {
        hosts,
        user: raw.user.map_or(d.user, |s| s.0),
        dbname: raw.dbname.map_or(d.dbname, |s| s.0),
        password: raw.password.map(Spanned::into_inner),
        password_file: raw.password_file.map(|p| p.into_inner().into()),
        probe_interval: raw.probe_interval.map_or(d.probe_interval, |v| v.0),
        connect_timeout: raw.connect_timeout.map_or(d.connect_timeout, |v| v.0),
        query_timeout: raw.query_timeout.map_or(d.query_timeout, |v| v.0),
        down_after_failures: raw
            .down_after_failures
            .map_or(d.down_after_failures, Spanned::into_inner),
        rtt_threshold: raw.rtt_threshold.map_or(d.rtt_threshold, |v| v.0),
        rtt_threshold_enabled: raw.rtt_threshold_enabled.unwrap_or(d.rtt_threshold_enabled),
        max_replica_lag_bytes: raw.max_replica_lag_bytes,
        max_replica_lag: raw.max_replica_lag.map(|v| v.0),
        lag_hold: raw.lag_hold.map_or(d.lag_hold, |v| v.0),
    })
}

fn engine(raw: &RawEngine, src: &Source<'_>) -> Result<EngineConfig, ConfigError> {
    let d = EngineConfig::default();
    if let Some(n) = &raw.worker_threads {
        if !(1..=MAX_WORKER_THREADS).contains(n.get_ref()) {
            return Err(src.invalid(
                Some(n.span()),
                "engine.worker_threads",
                format!(
                    "{} is out of range: expected 1 to {MAX_WORKER_THREADS}, or leave it out to size by core count",
                    n.get_ref()
                ),
            ));
        }
    }
    Ok(EngineConfig {
        worker_threads: raw.worker_threads.as_ref().map(|n| *n.get_ref()),
        pool_affinity: raw.pool_affinity.unwrap_or(d.pool_affinity),
        worker_fill: raw.worker_fill.unwrap_or(d.worker_fill),
        connect_wait_timeout: raw
            .connect_wait_timeout
            .map_or(d.connect_wait_timeout, |v| v.0),
        server_connect_timeout: raw
            .server_connect_timeout
            .map_or(d.server_connect_timeout, |v| v.0),
        shutdown_timeout: raw.shutdown_timeout.map_or(d.shutdown_timeout, |v| v.0),
        tcp: tcp_timings(raw, src)?,
    })
}

/// Linux's largest keepalive idle time and interval (seconds) and probe
/// count.
const MAX_KEEPALIVE_SECS: u64 = 32_767;
const MAX_KEEPALIVE_COUNT: u32 = 127;

/// Zero keeps the system's value, as in PostgreSQL.
fn tcp_timings(raw: &RawEngine, src: &Source<'_>) -> Result<TcpTimings, ConfigError> {
    let seconds = |v: &Option<Spanned<Dur>>, key: &str| -> Result<Option<Duration>, ConfigError> {
        let Some(v) = v else {
            return Ok(None);
        };
        let d = v.get_ref().0;
        if d.subsec_nanos() != 0 || d.as_secs() > MAX_KEEPALIVE_SECS {
            return Err(src.invalid(
                Some(v.span()),
                key,
                format!(
                    "expected whole seconds from 0 (the system's default) to {MAX_KEEPALIVE_SECS}"
                ),
            ));
        }
        Ok((!d.is_zero()).then_some(d))
    };
    let keepalives_count = match &raw.tcp_keepalives_count {
        Some(n) if *n.get_ref() > MAX_KEEPALIVE_COUNT => {
            return Err(src.invalid(
                Some(n.span()),
                "engine.tcp_keepalives_count",
                format!(
                "{} is out of range: expected 0 (the system's default) to {MAX_KEEPALIVE_COUNT}",
                n.get_ref()
            ),
            ))
        }
        Some(n) => Some(*n.get_ref()).filter(|&n| n > 0),
        None => None,
    };
    let user_timeout = match &raw.tcp_user_timeout {
        // The kernel reads it as a signed int of milliseconds.
        Some(v) if v.get_ref().0.as_millis() > i32::MAX as u128 => {
            return Err(src.invalid(
                Some(v.span()),
                "engine.tcp_user_timeout",
                "too long: at most 2147483647ms (about 24 days)",
            ))
        }
        Some(v) => Some(v.get_ref().0).filter(|d| !d.is_zero()),
        None => None,
    };
    Ok(TcpTimings {
        keepalives_idle: seconds(&raw.tcp_keepalives_idle, "engine.tcp_keepalives_idle")?,
        keepalives_interval: seconds(
            &raw.tcp_keepalives_interval,
            "engine.tcp_keepalives_interval",
        )?,
        keepalives_count,
        user_timeout,
    })
}

/// Zero turns a pool timeout off.
fn optional_timeout(v: Option<Dur>, default: Option<Duration>) -> Option<Duration> {
    match v {
        Some(Dur(d)) if d.is_zero() => None,
        Some(Dur(d)) => Some(d),
        None => default,
    }
}

fn at_least_one(v: &Option<Spanned<u32>>, key: &str, src: &Source<'_>) -> Result<(), ConfigError> {
    match v {
        Some(s) if *s.get_ref() == 0 => Err(src.invalid(Some(s.span()), key, "must be at least 1")),
        _ => Ok(()),
    }
}

fn pool(raw: RawPool, src: &Source<'_>) -> Result<PoolConfig, ConfigError> {
    let d = PoolConfig::default();
    at_least_one(&raw.size, "pool.size", src)?;
    at_least_one(&raw.max_client_conn, "pool.max_client_conn", src)?;
    at_least_one(
        &raw.max_prepared_statements,
        "pool.max_prepared_statements",
        src,
    )?;
    let size = raw.size.as_ref().map_or(d.size, |s| *s.get_ref());
    let min_size = raw.min_size.as_ref().map_or(d.min_size, |s| *s.get_ref());
    if let Some(m) = &raw.min_size {
        if min_size > size {
            return Err(src.invalid(
                Some(m.span()),
                "pool.min_size",
                format!("{min_size} is larger than pool.size ({size})"),
            ));
        }
    }
    let admin_users = match raw.admin_users {
        None => d.admin_users,
        Some(names) => {
            // No role has an empty name; an empty entry is a slip (a
            // stray comma inside quotes, an unset template variable).
            if let Some((i, name)) = names
                .iter()
                .enumerate()
                .find(|(_, n)| n.get_ref().is_empty())
            {
                return Err(src.invalid(
                    Some(name.span()),
                    format!("pool.admin_users[{i}]"),
                    "a role name must not be empty",
                ));
            }
            names.into_iter().map(Spanned::into_inner).collect()
        }
    };
    let databases = overrides("databases", raw.databases, min_size, src)?;
    let users = overrides("users", raw.users, min_size, src)?;
    Ok(PoolConfig {
        mode: raw.mode.unwrap_or(d.mode),
        size,
        min_size,
        reserve_size: raw.reserve_size.map_or(d.reserve_size, Spanned::into_inner),
        reserve_timeout: raw.reserve_timeout.map_or(d.reserve_timeout, |Dur(t)| t),
        max_client_conn: raw
            .max_client_conn
            .map_or(d.max_client_conn, Spanned::into_inner),
        max_db_connections: raw
            .max_db_connections
            .map_or(d.max_db_connections, Spanned::into_inner),
        max_user_connections: raw
            .max_user_connections
            .map_or(d.max_user_connections, Spanned::into_inner),
        server_idle_timeout: optional_timeout(raw.server_idle_timeout, d.server_idle_timeout),
        server_lifetime: optional_timeout(raw.server_lifetime, d.server_lifetime),
        query_wait_timeout: optional_timeout(raw.query_wait_timeout, d.query_wait_timeout),
        client_idle_timeout: optional_timeout(raw.client_idle_timeout, d.client_idle_timeout),
        idle_transaction_timeout: optional_timeout(
            raw.idle_transaction_timeout,
            d.idle_transaction_timeout,
        ),
        max_prepared_statements: raw
            .max_prepared_statements
            .map_or(d.max_prepared_statements, Spanned::into_inner),
        stats_period: raw.stats_period.map_or(d.stats_period, |v| v.0),
        reuse_session_servers: raw.reuse_session_servers.unwrap_or(d.reuse_session_servers),
        admin_users,
        databases,
        users,
    })
}

/// `[pool.databases]` or `[pool.users]`.
fn overrides(
    table: &str,
    raw: BTreeMap<Spanned<String>, RawPoolOverride>,
    min_size: u32,
    src: &Source<'_>,
) -> Result<BTreeMap<String, PoolOverride>, ConfigError> {
    let mut out = BTreeMap::new();
    for (name, o) in raw {
        let prefix = format!("pool.{table}.{}", key_segment(name.get_ref()));
        if name.get_ref().is_empty() {
            return Err(src.invalid(Some(name.span()), prefix, "name must not be empty"));
        }
        if o.mode.is_none()
            && o.size.is_none()
            && o.max_db_connections.is_none()
            && o.max_user_connections.is_none()
        {
            // An override that overrides nothing is a mistake: most often
            // its keys were written under the next table's header.
            let keys = match table {
                "databases" => "mode, size or max_db_connections",
                _ => "mode, size or max_user_connections",
            };
            return Err(src.invalid(
                Some(name.span()),
                prefix,
                format!("sets nothing: give it {keys}, or remove the table"),
            ));
        }
        if let Some(s) = &o.size {
            let key = format!("{prefix}.size");
            at_least_one(&o.size, &key, src)?;
            // Keeping min_size connections in a pool capped below that
            // could never be satisfied.
            if *s.get_ref() < min_size {
                return Err(src.invalid(
                    Some(s.span()),
                    key,
                    format!("{} is smaller than pool.min_size ({min_size})", s.get_ref()),
                ));
            }
        }
        // PgBouncer's names: a database has max_db_connections, a user
        // max_user_connections.
        let (limit, misplaced) = match table {
            "databases" => (o.max_db_connections, o.max_user_connections),
            _ => (o.max_user_connections, o.max_db_connections),
        };
        if let Some(m) = misplaced {
            let (key, belongs) = match table {
                "databases" => ("max_user_connections", "pool.users.NAME"),
                _ => ("max_db_connections", "pool.databases.NAME"),
            };
            return Err(src.invalid(
                Some(m.span()),
                format!("{prefix}.{key}"),
                format!("not a key of this table; it belongs in [{belongs}] or [pool]"),
            ));
        }
        out.insert(
            name.into_inner(),
            PoolOverride {
                mode: o.mode,
                size: o.size.map(Spanned::into_inner),
                max_connections: limit.map(Spanned::into_inner),
            },
        );
    }
    Ok(out)
}

/// What is wrong with a `log.level` filter, if anything. Each of its
/// comma-separated directives must be a level, or `target=level`. The
/// logging library would read a lone word that is no level as a target to
/// log at every level, and a filter without a default level logs nothing
/// else, errors included: `inof,pgwarden_probe=debug` would silence the
/// log, so such a word is refused (`target=trace` says it on purpose).
fn log_filter_error(text: &str) -> Option<String> {
    let is_level = |w: &str| LOG_LEVELS.iter().any(|v| v.eq_ignore_ascii_case(w.trim()));
    if text.is_empty() {
        return Some("empty level".into());
    }
    for directive in text.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        // A span filter (`target[span{field=value}]=level`) has `=` inside
        // its brackets: the level is what follows them.
        let (target, level) = match directive.rfind(']') {
            Some(close) => match &directive[close + 1..] {
                "" => (directive, None),
                rest => match rest.strip_prefix('=') {
                    Some(level) => (&directive[..close + 1], Some(level)),
                    None => return Some(format!("malformed directive {directive:?}")),
                },
            },
            None => match directive.rsplit_once('=') {
                Some((target, level)) => (target, Some(level)),
                None => (directive, None),
            },
        };
        match level {
            None if is_level(target) => {}
            None => return Some(format!("unknown level {directive:?}")),
            Some(level) if !is_level(level) => {
                return Some(format!("unknown level {level:?} in {directive:?}"))
            }
            Some(_) if target.trim().is_empty() => {
                return Some(format!("no target before \"=\" in {directive:?}"))
            }
            Some(_) => {}
        }
    }
    None
}

fn log(raw: RawLog, src: &Source<'_>) -> Result<LogConfig, ConfigError> {
    let d = LogConfig::default();
    let level = match raw.level {
        None => d.level,
        Some(l) => {
            let text = l.get_ref().trim();
            if let Some(why) = log_filter_error(text) {
                return Err(src.invalid(
                    Some(l.span()),
                    "log.level",
                    format!(
                        "{why}: expected one of {} or a filter such as \"info,pgwarden_probe=debug\"",
                        LOG_LEVELS.join(", ")
                    ),
                ));
            }
            text.to_string()
        }
    };
    Ok(LogConfig {
        level,
        format: raw.format.unwrap_or(d.format),
    })
}

/// Whether a service name can be used as written.
fn valid_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic())
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        && name.len() <= MAX_NAME_LEN
}

/// A listener in the making: where its address came from decides which
/// key an error names and which line it points at.
struct Listener {
    key: String,
    addr: SocketAddr,
    /// `None` when derived from the first host's port.
    span: Option<Range<usize>>,
}

/// Both listeners claim the same port on addresses that overlap: equal, or
/// one of them a wildcard that covers the other (`[::]` covers IPv4 too on
/// a dual-stack system, which is the common default).
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    // `[::ffff:127.0.0.1]` is 127.0.0.1 on a dual-stack socket.
    let plain = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let (ia, ib) = (plain(a.ip()), plain(b.ip()));
    let covers = |w: IpAddr, x: IpAddr| match w {
        IpAddr::V6(ip) => ip.is_unspecified(),
        IpAddr::V4(ip) => ip.is_unspecified() && x.is_ipv4(),
    };
    a.port() == b.port() && (ia == ib || covers(ia, ib) || covers(ib, ia))
}

fn check_distinct(listeners: &[Listener], src: &Source<'_>) -> Result<(), ConfigError> {
    // Services arrive in name order; the operator reads the file top down
    // and expects the second of two clashing lines to be the one blamed.
    let mut listeners: Vec<&Listener> = listeners.iter().collect();
    listeners.sort_by_key(|l| l.span.as_ref().map_or(usize::MAX, |s| s.start));
    for (j, later) in listeners.iter().enumerate() {
        let Some(earlier) = listeners[..j].iter().find(|e| overlaps(e.addr, later.addr)) else {
            continue;
        };
        // Point at a key the operator actually wrote when one of the two
        // was derived.
        let (at, other) = if later.span.is_none() && earlier.span.is_some() {
            (earlier, later)
        } else {
            (later, earlier)
        };
        let derived = if other.span.is_none() {
            " (derived from the first host's port)"
        } else {
            ""
        };
        let message = if at.addr == other.addr {
            format!("{} is already used by {}{derived}", at.addr, other.key)
        } else {
            format!(
                "{} overlaps {} of {}{derived}",
                at.addr, other.addr, other.key
            )
        };
        return Err(src.invalid(at.span.clone(), at.key.clone(), message));
    }
    Ok(())
}

fn services(
    raw_listen: &RawListen,
    mut raw_services: BTreeMap<Spanned<String>, RawService>,
    first_host: Option<Range<usize>>,
    cluster: &ClusterConfig,
    engine: &EngineConfig,
    pool: &PoolConfig,
    src: &Source<'_>,
) -> Result<(ListenConfig, Vec<ServiceConfig>, Vec<Listener>), ConfigError> {
    for name in raw_services.keys() {
        if !valid_name(name.get_ref()) {
            return Err(src.invalid(
                Some(name.span()),
                format!("services.{}", key_segment(name.get_ref())),
                format!(
                    "invalid service name: use a letter followed by letters, digits, '_' or '-', at most {MAX_NAME_LEN} characters"
                ),
            ));
        }
    }
    // The implicit services are handled apart from the named ones.
    let mut take = |name: &str| {
        let key = raw_services.keys().find(|k| k.get_ref() == name)?.clone();
        raw_services.remove(&key)
    };
    let rw = take(READ_WRITE);
    let ro = take(READ_ONLY);

    // The first host's span stands in for the missing key: changing that
    // port, or setting the key, is the fix.
    let first = &cluster.hosts[0];
    let derive = |key: &str, offset: u32| -> Result<Listener, ConfigError> {
        let port = u32::from(first.addr.port) + offset;
        let port = u16::try_from(port).map_err(|_| {
            src.invalid(
                first_host.clone(),
                key,
                format!(
                    "not set, and the derived port {port} (port {} of the first host + {offset}) is above 65535; set {key} explicitly",
                    first.addr.port
                ),
            )
        })?;
        Ok(Listener {
            key: key.to_string(),
            addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port),
            span: None,
        })
    };
    let written = |key: &str, v: &Spanned<ListenAddr>| Listener {
        key: key.to_string(),
        addr: v.get_ref().0,
        span: Some(v.span()),
    };
    // An implicit service's address can come from [listen] or from its
    // own table, but not both: two sources for one value invite edits to
    // the one that is not in effect.
    let implicit = |name: &str,
                    from_listen: &Option<Spanned<ListenAddr>>,
                    raw: Option<&RawService>,
                    offset: u32|
     -> Result<Listener, ConfigError> {
        let listen_key = format!("listen.{name}");
        let service_key = format!("services.{name}.listen");
        match (from_listen, raw.and_then(|r| r.listen.as_ref())) {
            (Some(_), Some(s)) => Err(src.invalid(
                Some(s.span()),
                service_key,
                format!("{listen_key} is set too; keep only one of them"),
            )),
            (Some(l), None) => Ok(written(&listen_key, l)),
            (None, Some(s)) => Ok(written(&service_key, s)),
            (None, None) => derive(&listen_key, offset),
        }
    };
    let rw_listener = implicit(READ_WRITE, &raw_listen.read_write, rw.as_ref(), RW_OFFSET)?;
    let ro_listener = implicit(READ_ONLY, &raw_listen.read_only, ro.as_ref(), RO_OFFSET)?;
    let http_listener = match &raw_listen.http {
        Some(l) => written("listen.http", l),
        None => derive("listen.http", HTTP_OFFSET)?,
    };

    let unix_socket_dir = match &raw_listen.unix_socket_dir {
        None => None,
        Some(d) => {
            let dir = std::path::PathBuf::from(d.get_ref());
            let bad =
                |why: &str| src.invalid(Some(d.span()), "listen.unix_socket_dir", why.to_string());
            if !dir.is_absolute() {
                return Err(bad("must be an absolute path"));
            }
            // sockaddr_un holds 107 bytes of path.
            if d.get_ref().len() + "/.s.PGSQL.65535".len() > 107 {
                return Err(bad("too long: a socket path in it would exceed 107 bytes"));
            }
            Some(dir)
        }
    };
    let listen = ListenConfig {
        read_write: rw_listener.addr,
        read_only: ro_listener.addr,
        http: http_listener.addr,
        unix_socket_dir,
    };
    let defaults = Defaults {
        cluster,
        engine,
        pool,
        src,
    };
    let mut out = vec![
        defaults.service(
            READ_WRITE,
            rw.as_ref(),
            ServiceKind::Primary,
            listen.read_write,
        )?,
        defaults.service(
            READ_ONLY,
            ro.as_ref(),
            ServiceKind::Replica,
            listen.read_only,
        )?,
    ];
    let mut listeners = vec![rw_listener, ro_listener, http_listener];
    for (name, raw) in &raw_services {
        let prefix = format!("services.{}", name.get_ref());
        let required =
            |what: &str| src.invalid(Some(name.span()), format!("{prefix}.{what}"), "is required");
        let listen = raw.listen.as_ref().ok_or_else(|| required("listen"))?;
        let kind = raw.select.as_ref().ok_or_else(|| required("select"))?;
        listeners.push(written(&format!("{prefix}.listen"), listen));
        out.push(defaults.service(
            name.get_ref(),
            Some(raw),
            *kind.get_ref(),
            listen.get_ref().0,
        )?);
    }
    check_distinct(&listeners, src)?;
    if listen.unix_socket_dir.is_some() {
        check_distinct_ports(&listeners, src)?;
    }
    Ok((listen, out, listeners))
}

/// With `listen.unix_socket_dir`, every service also listens on a socket
/// named after its TCP port alone, so two services on one port clash
/// there even on different addresses.
fn check_distinct_ports(listeners: &[Listener], src: &Source<'_>) -> Result<(), ConfigError> {
    let services: Vec<&Listener> = listeners
        .iter()
        .filter(|l| l.key != "listen.http")
        .collect();
    for (j, later) in services.iter().enumerate() {
        let Some(earlier) = services[..j]
            .iter()
            .find(|e| e.addr.port() == later.addr.port())
        else {
            continue;
        };
        let (at, other) = if later.span.is_none() && earlier.span.is_some() {
            (*earlier, *later)
        } else {
            (*later, *earlier)
        };
        return Err(src.invalid(
            at.span.clone(),
            at.key.clone(),
            format!(
                "port {} is also the port of {} ({}): with listen.unix_socket_dir both would listen on the socket .s.PGSQL.{}",
                at.addr.port(),
                other.key,
                other.addr,
                at.addr.port()
            ),
        ));
    }
    Ok(())
}

/// The agent's REST API and its PostgreSQL listen on the same machine as
/// the connection manager: an overlap would only show when binding.
fn check_clear_of_agent(
    listeners: &[Listener],
    agent: &crate::agent::AgentConfig,
    src: &Source<'_>,
) -> Result<(), ConfigError> {
    let pg = agent
        .pg_listen
        .host
        .parse::<IpAddr>()
        .ok()
        .map(|ip| SocketAddr::new(ip, agent.pg_listen.port));
    for (key, addr) in [("agent.api", Some(agent.api)), ("agent.pg_listen", pg)] {
        let Some(addr) = addr else { continue };
        if let Some(l) = listeners.iter().find(|l| overlaps(l.addr, addr)) {
            let derived = if l.span.is_none() {
                " (derived from the first host's port)"
            } else {
                ""
            };
            return Err(src.invalid(
                l.span.clone(),
                l.key.clone(),
                format!("{}{derived} overlaps {key} ({addr})", l.addr),
            ));
        }
    }
    Ok(())
}

/// Cluster-, engine- and pool-wide values that services inherit.
struct Defaults<'a> {
    cluster: &'a ClusterConfig,
    engine: &'a EngineConfig,
    pool: &'a PoolConfig,
    src: &'a Source<'a>,
}

impl Defaults<'_> {
    fn service(
        &self,
        name: &str,
        raw: Option<&RawService>,
        default_kind: ServiceKind,
        listen: SocketAddr,
    ) -> Result<ServiceConfig, ConfigError> {
        let prefix = format!("services.{name}");
        let kind = raw
            .and_then(|r| r.select.as_ref())
            .map_or(default_kind, |s| *s.get_ref());
        if name == READ_WRITE && !kind.is_primary() {
            let span = raw.and_then(|r| r.select.as_ref()).map(|s| s.span());
            return Err(self.src.invalid(
                span,
                format!("{prefix}.select"),
                format!("the read_write service must select primary or default, not {kind}"),
            ));
        }
        // The read_only service keeps its promise even when pointed at the
        // primary; any other primary service is writable unless told.
        let default_read_only = !kind.is_primary() || name == READ_ONLY;
        let read_only = match raw.and_then(|r| r.read_only.as_ref()) {
            None => default_read_only,
            Some(v) => {
                let v_bool = *v.get_ref();
                if !v_bool && !kind.is_primary() {
                    return Err(self.src.invalid(
                        Some(v.span()),
                        format!("{prefix}.read_only"),
                        format!(
                            "cannot be false for select = \"{kind}\": a replica cannot take writes"
                        ),
                    ));
                }
                if !v_bool && name == READ_ONLY {
                    return Err(self.src.invalid(
                        Some(v.span()),
                        format!("{prefix}.read_only"),
                        "the read_only service cannot be made writable; define a separate service",
                    ));
                }
                if v_bool && name == READ_WRITE {
                    return Err(self.src.invalid(
                        Some(v.span()),
                        format!("{prefix}.read_only"),
                        "the read_write service cannot be read-only; define a separate service",
                    ));
                }
                v_bool
            }
        };
        let policy = SelectPolicy {
            strategy: raw.and_then(|r| r.strategy).unwrap_or_default(),
            rtt_threshold: raw
                .and_then(|r| r.rtt_threshold)
                .map_or(self.cluster.rtt_threshold, |v| v.0),
            rtt_threshold_enabled: raw
                .and_then(|r| r.rtt_threshold_enabled)
                .unwrap_or(self.cluster.rtt_threshold_enabled),
            fallback_to_primary: raw
                .and_then(|r| r.fallback_to_primary)
                .unwrap_or(kind.default_fallback()),
        };
        let direct = kind == ServiceKind::Default && raw.and_then(|r| r.pool_mode).is_none();
        Ok(ServiceConfig {
            name: name.to_string(),
            kind,
            listen,
            want: kind.want(),
            policy,
            read_only,
            pool_mode: if direct {
                crate::PoolMode::Session
            } else {
                raw.and_then(|r| r.pool_mode).unwrap_or(self.pool.mode)
            },
            direct,
            connect_wait_timeout: raw
                .and_then(|r| r.connect_wait_timeout)
                .map_or(self.engine.connect_wait_timeout, |v| v.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn overlap_rules() {
        assert!(overlaps(sa("127.0.0.1:1"), sa("127.0.0.1:1")));
        assert!(!overlaps(sa("127.0.0.1:1"), sa("127.0.0.1:2")));
        assert!(!overlaps(sa("127.0.0.1:1"), sa("127.0.0.2:1")));
        assert!(overlaps(sa("0.0.0.0:1"), sa("10.0.0.1:1")));
        assert!(overlaps(sa("10.0.0.1:1"), sa("0.0.0.0:1")));
        assert!(!overlaps(sa("0.0.0.0:1"), sa("[::1]:1")));
        assert!(overlaps(sa("[::]:1"), sa("127.0.0.1:1")));
        assert!(overlaps(sa("[::1]:1"), sa("[::]:1")));
    }

    #[test]
    fn names() {
        for ok in ["standby", "a", "reports-2", "x_y", &"a".repeat(63)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "2x", "-a", "a b", "a.b", "é", &"a".repeat(64)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn line_numbers() {
        let src = Source {
            text: "a\nbb\n\nc",
            origin: "f",
        };
        assert_eq!(src.line_of(0), 1);
        assert_eq!(src.line_of(2), 2);
        assert_eq!(src.line_of(5), 3);
        assert_eq!(src.line_of(6), 4);
        assert_eq!(src.line_of(999), 4);
    }
}
