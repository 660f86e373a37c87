//! The file as serde sees it.
//!
//! Every key is optional here, even required ones, so that defaults and
//! requirements are decided in one place (`resolve`) with the source
//! position at hand. Values that can be judged on their own (addresses,
//! durations, non-empty strings) are checked while deserialising, because
//! only then does the TOML parser attach the line and the key to the error.
//! `Spanned` marks the values that later cross-field checks must point at.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

use pgwarden_topology::{HostAddr, Strategy};
use serde::de::{self, value::MapAccessDeserializer, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use toml::Spanned;

use crate::duration::{Dur, PositiveDur};
use crate::sections::{LogFormat, PoolMode};
use crate::service::ServiceKind;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFile {
    pub cluster: Option<Spanned<RawCluster>>,
    #[serde(default)]
    pub listen: RawListen,
    #[serde(default)]
    pub services: BTreeMap<Spanned<String>, RawService>,
    #[serde(default)]
    pub engine: RawEngine,
    #[serde(default)]
    pub pool: RawPool,
    #[serde(default)]
    pub log: RawLog,
    #[serde(default)]
    pub tls: RawTls,
    pub auth: Option<RawAuth>,
    pub agent: Option<crate::agent::RawAgent>,
    pub etcd: Option<Spanned<crate::agent::RawEtcd>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawAuth {
    pub hba_file: Spanned<String>,
    pub auth_user: String,
    pub auth_password: Option<String>,
    pub auth_password_file: Option<Spanned<NonEmpty>>,
    pub auth_query: Option<String>,
    pub auth_dbname: Option<String>,
    pub auth_cache_ttl: Option<Dur>,
    pub auth_timeout: Option<PositiveDur>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTls {
    pub cert: Option<Spanned<String>>,
    pub key: Option<Spanned<String>>,
    pub client_tls: Option<Spanned<crate::sections::ClientTls>>,
    pub server_tls: Option<Spanned<crate::sections::ServerTls>>,
    pub server_ca: Option<Spanned<String>>,
    pub client_ca: Option<Spanned<String>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawCluster {
    /// Required in standalone mode; under the HA agent the members found in
    /// etcd are added to what is listed here.
    pub hosts: Option<Hosts>,
    pub user: Option<NonEmpty>,
    pub dbname: Option<NonEmpty>,
    pub password: Option<Spanned<String>>,
    pub password_file: Option<Spanned<NonEmpty>>,
    pub probe_interval: Option<PositiveDur>,
    pub connect_timeout: Option<PositiveDur>,
    pub query_timeout: Option<PositiveDur>,
    pub down_after_failures: Option<Spanned<u32>>,
    pub rtt_threshold: Option<Dur>,
    pub rtt_threshold_enabled: Option<bool>,
    pub max_replica_lag_bytes: Option<u64>,
    pub max_replica_lag: Option<Dur>,
    pub lag_hold: Option<Dur>,
}

/// `cluster.hosts`: emptiness is caught here so the error points at the
/// empty array itself.
pub(crate) struct Hosts(pub Vec<Spanned<RawHost>>);

impl<'de> Deserialize<'de> for Hosts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let hosts = Vec::<Spanned<RawHost>>::deserialize(d)?;
        if hosts.is_empty() {
            return Err(de::Error::custom(
                "cluster.hosts is empty: list at least one PostgreSQL server",
            ));
        }
        Ok(Hosts(hosts))
    }
}

/// One `cluster.hosts` item: `"host:port"` or an inline table.
pub(crate) struct RawHost {
    pub addr: HostAddr,
    pub application_name: Option<String>,
    pub tags: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHostTable {
    addr: Addr,
    application_name: Option<NonEmpty>,
    #[serde(default)]
    tags: Vec<NonEmpty>,
}

impl<'de> Deserialize<'de> for RawHost {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHost;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"host:port\" or { addr = \"host:port\", tags = [...], application_name = \"...\" }")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawHost, E> {
                Ok(RawHost {
                    addr: parse_host_addr(v)?,
                    application_name: None,
                    tags: Vec::new(),
                })
            }
            fn visit_map<M: MapAccess<'de>>(self, map: M) -> Result<RawHost, M::Error> {
                let t = RawHostTable::deserialize(MapAccessDeserializer::new(map))?;
                Ok(RawHost {
                    addr: t.addr.0,
                    application_name: t.application_name.map(|n| n.0),
                    tags: t.tags.into_iter().map(|t| t.0).collect(),
                })
            }
        }
        d.deserialize_any(V)
    }
}

fn parse_host_addr<E: de::Error>(v: &str) -> Result<HostAddr, E> {
    v.parse::<HostAddr>()
        .map_err(|e| E::custom(format!("invalid host address {v:?}: {e}")))
}

/// A PostgreSQL server address as written in a host table.
struct Addr(HostAddr);

impl<'de> Deserialize<'de> for Addr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_host_addr(&s).map(Addr)
    }
}

/// A string that must contain something other than whitespace.
pub(crate) struct NonEmpty(pub String);

impl<'de> Deserialize<'de> for NonEmpty {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.trim().is_empty() {
            return Err(de::Error::custom("must not be empty"));
        }
        Ok(NonEmpty(s))
    }
}

impl From<NonEmpty> for PathBuf {
    fn from(s: NonEmpty) -> PathBuf {
        PathBuf::from(s.0)
    }
}

/// A listening socket address: an IP literal and a non-zero port.
#[derive(Clone, Copy)]
pub(crate) struct ListenAddr(pub SocketAddr);

impl<'de> Deserialize<'de> for ListenAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let addr: SocketAddr = s.trim().parse().map_err(|_| {
            de::Error::custom(format!(
                "invalid listen address {s:?}: expected IP:port such as \"127.0.0.1:6432\", \
                 \"0.0.0.0:6432\" or \"[::1]:6432\" (host names are not resolved)"
            ))
        })?;
        // Port 0 would bind a random port that clients cannot know.
        if addr.port() == 0 {
            return Err(de::Error::custom(format!(
                "invalid listen address {s:?}: port 0 is not allowed"
            )));
        }
        Ok(ListenAddr(addr))
    }
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawListen {
    pub read_write: Option<Spanned<ListenAddr>>,
    pub read_only: Option<Spanned<ListenAddr>>,
    pub http: Option<Spanned<ListenAddr>>,
    pub unix_socket_dir: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawService {
    pub listen: Option<Spanned<ListenAddr>>,
    pub select: Option<Spanned<ServiceKind>>,
    pub strategy: Option<Strategy>,
    pub fallback_to_primary: Option<bool>,
    pub read_only: Option<Spanned<bool>>,
    pub rtt_threshold: Option<Dur>,
    pub rtt_threshold_enabled: Option<bool>,
    pub pool_mode: Option<PoolMode>,
    pub connect_wait_timeout: Option<Dur>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawEngine {
    pub worker_threads: Option<Spanned<usize>>,
    pub pool_affinity: Option<bool>,
    pub worker_fill: Option<usize>,
    pub connect_wait_timeout: Option<Dur>,
    pub server_connect_timeout: Option<PositiveDur>,
    pub shutdown_timeout: Option<Dur>,
    pub tcp_keepalives_idle: Option<Spanned<Dur>>,
    pub tcp_keepalives_interval: Option<Spanned<Dur>>,
    pub tcp_keepalives_count: Option<Spanned<u32>>,
    pub tcp_user_timeout: Option<Spanned<Dur>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPool {
    pub mode: Option<PoolMode>,
    pub size: Option<Spanned<u32>>,
    pub min_size: Option<Spanned<u32>>,
    pub reserve_size: Option<Spanned<u32>>,
    pub reserve_timeout: Option<Dur>,
    pub max_client_conn: Option<Spanned<u32>>,
    pub max_db_connections: Option<Spanned<u32>>,
    pub max_user_connections: Option<Spanned<u32>>,
    pub server_idle_timeout: Option<Dur>,
    pub server_lifetime: Option<Dur>,
    pub query_wait_timeout: Option<Dur>,
    pub client_idle_timeout: Option<Dur>,
    pub idle_transaction_timeout: Option<Dur>,
    pub max_prepared_statements: Option<Spanned<u32>>,
    pub stats_period: Option<PositiveDur>,
    pub reuse_session_servers: Option<bool>,
    pub admin_users: Option<Vec<Spanned<String>>>,
    #[serde(default)]
    pub databases: BTreeMap<Spanned<String>, RawPoolOverride>,
    #[serde(default)]
    pub users: BTreeMap<Spanned<String>, RawPoolOverride>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPoolOverride {
    pub mode: Option<PoolMode>,
    pub size: Option<Spanned<u32>>,
    // Each belongs to one of the two tables; the other is refused by name.
    pub max_db_connections: Option<Spanned<u32>>,
    pub max_user_connections: Option<Spanned<u32>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLog {
    pub level: Option<Spanned<String>>,
    pub format: Option<LogFormat>,
}
