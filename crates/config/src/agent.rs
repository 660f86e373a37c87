//! `[agent]` and `[etcd]`: the HA agent that manages the local PostgreSQL
//! node, and the etcd store it keeps the leader lease in.
//!
//! Both sections come together: an agent without a store could not agree
//! with anyone on who leads, and a store section alone would mean nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use pgwarden_ha::{
    Protection, RtoSetting, SyncMethod, SyncSettings, Tags, Timing, TimingOverrides,
};
use pgwarden_topology::HostAddr;
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use toml::Spanned;

use crate::error::ConfigError;
use crate::raw::{ListenAddr, NonEmpty};
use crate::resolve::Source;

/// Namespace of the keys when `etcd.namespace` is not set.
pub const DEFAULT_ETCD_NAMESPACE: &str = "pgwarden";

/// `[agent]`: one node of an HA cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentConfig {
    /// Member name: unique in the cluster, written into the leader key, and
    /// the `application_name` the node's WAL receiver reports.
    pub name: String,
    /// The PostgreSQL data directory the agent manages (created by initdb
    /// or pg_basebackup when empty).
    pub data_dir: PathBuf,
    /// Where the local PostgreSQL listens.
    pub pg_listen: HostAddr,
    /// Where the other members and the connection managers reach it;
    /// `pg_listen` unless the node sits behind NAT or a relay.
    pub pg_connect_address: HostAddr,
    /// Where the agent's REST API listens.
    pub api: SocketAddr,
    /// The API's base URL as other members use it.
    pub api_url: String,
    /// The base URL of this node's connection manager HTTP port as the
    /// other members' agents use it to pause and resume its pools around a
    /// switchover; `None`: `listen.http`, or with a wildcard there, the host
    /// of `pg_connect_address` at its port.
    pub proxy_url: Option<String>,
    /// PEM certificate (chain) the API serves HTTPS with. As written:
    /// relative to the file.
    pub api_cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    pub api_key_file: Option<PathBuf>,
    /// PEM CA certificates that the members' API certificates chain to:
    /// what this agent (and `pgwarden ctl`) trusts when calling an
    /// `https://` API.
    pub api_ca_file: Option<PathBuf>,
    /// Whether the API asks clients for a certificate chained to
    /// `api_ca_file`; the members present their own API certificate.
    pub api_verify_client: VerifyClient,
    /// The timing preset or target, as written.
    pub rto: RtoSetting,
    /// The effective timings: the preset with the overrides applied,
    /// checked against `loop_wait + 2 × retry_timeout ≤ ttl`.
    pub timing: Timing,
    /// Candidates further behind the last known leader position than this
    /// many bytes are not promoted automatically.
    pub maximum_lag_on_failover: u64,
    /// This member's tags.
    pub tags: Tags,
    /// The unprivileged OS user that runs PostgreSQL when the agent is root.
    pub run_as: Option<String>,
    /// Directory of the PostgreSQL server binaries; discovered if absent.
    pub bin_dir: Option<PathBuf>,
    /// Role used for replication connections (pg_basebackup, streaming).
    pub replication_user: String,
    /// Extra `postgresql.conf` settings for the managed server.
    pub parameters: BTreeMap<String, String>,
    /// Lines appended to `pg_hba.conf` when the cluster is created.
    pub pg_hba: Vec<String>,
    /// Commands run on lifecycle events.
    pub callbacks: Callbacks,
    /// The watchdog device armed while this node is leader.
    pub watchdog: WatchdogConfig,
    /// User name for the API's write endpoints (HTTP basic auth).
    pub api_username: String,
    /// Password for the API's write endpoints, as written in the file.
    /// Without any password (here, in `api_password_file` or in
    /// `PGWARDEN_API_PASSWORD`) the write endpoints are refused.
    pub api_password: Option<String>,
    /// File whose first line is the API password, relative to the
    /// configuration file.
    pub api_password_file: Option<PathBuf>,
    /// Re-clone a former primary from the leader when pg_rewind fails,
    /// instead of leaving it stopped for an operator.
    pub reclone_on_rewind_failure: bool,
    /// Keep a physical replication slot on the leader for every other
    /// member, and stream through it.
    pub use_slots: bool,
    /// Protection mode and synchronous replication settings; every member
    /// of a cluster should have the same.
    pub sync: SyncSettings,
    /// Keep the leader while etcd is unreachable for every member, as long
    /// as every member acknowledges it over the agents' API each loop.
    pub failsafe: bool,
    /// What the read-write port does with new transactions while commits
    /// wait for a synchronous standby.
    pub on_sync_blocked: OnSyncBlocked,
    /// `[agent.standby_cluster]`: make a new cluster a standby cluster of
    /// this remote source. Read only by the member that creates the
    /// cluster, which copies it into the dynamic configuration; from then on
    /// the dynamic configuration's `standby_cluster` decides.
    pub standby_cluster: Option<pgwarden_ha::StandbyCluster>,
    /// How this node gets its data when it joins as a replica or is
    /// re-cloned: methods tried in order until one succeeds
    /// (`create_replica_methods`, as Patroni names it).
    pub create_replica: Vec<ReplicaMethod>,
    /// Every `[agent.replica_methods.NAME]`, listed in
    /// `create_replica_methods` or not: a standby cluster's own
    /// `create_replica_methods` may name them too.
    pub replica_methods: BTreeMap<String, ReplicaMethod>,
    /// `[agent.bootstrap]`: create a new cluster from a backup instead of
    /// with initdb. Read only by the member that creates the cluster.
    pub bootstrap: Option<BootstrapMethod>,
}

/// A new cluster restored from a backup: the command fills the data
/// directory, PostgreSQL recovers with `recovery` and promotes itself at
/// the end of it (Patroni's custom bootstrap).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootstrapMethod {
    /// Run through `sh -c` as PostgreSQL's user; must leave a data
    /// directory.
    pub command: String,
    /// Append no `--scope` and `--datadir` arguments.
    pub no_params: bool,
    /// Recovery settings in force until the end of recovery:
    /// `restore_command`, `recovery_target_*`.
    pub recovery: BTreeMap<String, String>,
}

/// One way to create a replica's data directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaMethod {
    /// `pg_basebackup` from the leader.
    Basebackup,
    /// An operator's command (`[agent.replica_methods.NAME]`), e.g. a
    /// restore from a backup tool.
    Command {
        /// The method's name in `create_replica_methods`.
        name: String,
        /// Run through `sh -c` as PostgreSQL's user.
        command: String,
        /// Leave the data directory as it is instead of emptying it first
        /// (for tools that restore by difference).
        keep_data: bool,
        /// Append no `--scope`, `--datadir`, `--role` and `--connstring`
        /// arguments.
        no_params: bool,
    },
}

impl ReplicaMethod {
    /// The name it goes by in `create_replica_methods`.
    pub fn name(&self) -> &str {
        match self {
            ReplicaMethod::Basebackup => "basebackup",
            ReplicaMethod::Command { name, .. } => name,
        }
    }
}

/// `agent.api_verify_client`, with Patroni's names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifyClient {
    /// No client certificate is asked for.
    #[default]
    None,
    /// Asked for and verified when given; required for the write endpoints
    /// (everything but `GET`), so health checks need none.
    Optional,
    /// Required for every request.
    Required,
}

/// `agent.on_sync_blocked`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnSyncBlocked {
    /// Let them wait with the blocked ones.
    #[default]
    Wait,
    /// Refuse them at once with an error that says why.
    Reject,
}

/// Commands run by the agent; each is run through `sh -c` with the action,
/// the role and the cluster name appended as arguments, as Patroni does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Callbacks {
    /// After PostgreSQL was started by the agent.
    pub on_start: Option<String>,
    /// After PostgreSQL was stopped by the agent.
    pub on_stop: Option<String>,
    /// After the node was promoted or demoted.
    pub on_role_change: Option<String>,
    /// After a restart through the API, instead of `on_stop` and
    /// `on_start`.
    pub on_restart: Option<String>,
    /// After the agent made PostgreSQL re-read its configuration (the API's
    /// reload, changed parameters).
    pub on_reload: Option<String>,
}

/// Whether and how the agent uses a Linux watchdog.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WatchdogMode {
    /// No watchdog.
    #[default]
    Off,
    /// Use the device when it can be opened; lead without it otherwise.
    Automatic,
    /// Refuse to lead without an armed watchdog.
    Required,
}

/// `agent.watchdog*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// Off, automatic or required.
    pub mode: WatchdogMode,
    /// The device, `/dev/watchdog` by default.
    pub device: PathBuf,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        WatchdogConfig {
            mode: WatchdogMode::Off,
            device: PathBuf::from("/dev/watchdog"),
        }
    }
}

/// `[etcd]`: where the cluster's state is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// etcd client endpoints, `host:port` or `http://host:port`.
    pub endpoints: Vec<String>,
    /// Top-level key prefix, so that pgwarden shares etcd with others.
    pub namespace: String,
    /// The cluster's name under the namespace; several clusters can share
    /// one etcd.
    pub cluster: String,
    /// Bound on each etcd request; the agent treats a time-out as a failed
    /// request and retries within `retry_timeout`.
    pub op_timeout: Duration,
    /// PEM file of the CA that signed etcd's server certificates; set, the
    /// agent speaks TLS to etcd. As written: relative to the file.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate for etcd's `--client-cert-auth`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub key_file: Option<PathBuf>,
    /// etcd user, when etcd's authentication is enabled.
    pub username: Option<String>,
    /// That user's password.
    pub password: Option<String>,
    /// A file whose first line is the password. As written: relative to the
    /// file.
    pub password_file: Option<PathBuf>,
}

impl AgentConfig {
    /// [`AgentConfig::proxy_url`], or the default for a connection manager
    /// whose HTTP port listens at `http`.
    pub fn advertised_proxy_url(&self, http: SocketAddr) -> String {
        match &self.proxy_url {
            Some(u) => u.clone(),
            None if http.ip().is_unspecified() => format!(
                "http://{}",
                HostAddr::new(self.pg_connect_address.host.clone(), http.port())
            ),
            None => format!("http://{http}"),
        }
    }
}

impl EtcdConfig {
    /// Whether the agent speaks TLS to etcd.
    pub fn tls(&self) -> bool {
        self.ca_file.is_some()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawAgent {
    name: Spanned<NonEmpty>,
    data_dir: NonEmpty,
    pg_listen: Spanned<ListenAddr>,
    pg_connect_address: Option<Spanned<String>>,
    api: ListenAddr,
    api_url: Option<Spanned<NonEmpty>>,
    proxy_url: Option<Spanned<NonEmpty>>,
    api_cert_file: Option<Spanned<NonEmpty>>,
    api_key_file: Option<Spanned<NonEmpty>>,
    api_ca_file: Option<NonEmpty>,
    api_verify_client: Option<Spanned<VerifyClient>>,
    rto: Option<Spanned<RtoSetting>>,
    ttl: Option<HaTimer>,
    loop_wait: Option<HaTimer>,
    retry_timeout: Option<HaTimer>,
    primary_start_timeout: Option<HaTimer>,
    safety_margin: Option<HaTimer>,
    maximum_lag_on_failover: Option<u64>,
    #[serde(default)]
    nofailover: bool,
    replicatefrom: Option<Spanned<String>>,
    failover_priority: Option<i32>,
    #[serde(default)]
    nosync: bool,
    #[serde(default)]
    noloadbalance: bool,
    run_as: Option<NonEmpty>,
    bin_dir: Option<NonEmpty>,
    replication_user: Option<NonEmpty>,
    #[serde(default)]
    parameters: BTreeMap<String, ParamValue>,
    #[serde(default)]
    pg_hba: Vec<String>,
    on_start: Option<NonEmpty>,
    on_stop: Option<NonEmpty>,
    on_role_change: Option<NonEmpty>,
    on_restart: Option<NonEmpty>,
    on_reload: Option<NonEmpty>,
    watchdog: Option<WatchdogMode>,
    watchdog_device: Option<NonEmpty>,
    api_username: Option<NonEmpty>,
    api_password: Option<String>,
    api_password_file: Option<Spanned<NonEmpty>>,
    reclone_on_rewind_failure: Option<bool>,
    use_slots: Option<bool>,
    failsafe: Option<bool>,
    on_sync_blocked: Option<OnSyncBlocked>,
    protection: Option<Protection>,
    synchronous_node_count: Option<Spanned<u32>>,
    sync_method: Option<SyncMethod>,
    sync_degrade_timeout: Option<HaTimer>,
    standby_cluster: Option<pgwarden_ha::StandbyCluster>,
    create_replica_methods: Option<Spanned<Vec<NonEmpty>>>,
    #[serde(default)]
    replica_methods: BTreeMap<String, RawReplicaMethod>,
    bootstrap: Option<RawBootstrap>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBootstrap {
    command: NonEmpty,
    #[serde(default)]
    no_params: bool,
    #[serde(default)]
    recovery: BTreeMap<String, ParamValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawReplicaMethod {
    command: NonEmpty,
    #[serde(default)]
    keep_data: bool,
    #[serde(default)]
    no_params: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawEtcd {
    endpoints: Spanned<Vec<NonEmpty>>,
    namespace: Option<Spanned<String>>,
    cluster: Spanned<String>,
    op_timeout: Option<crate::duration::PositiveDur>,
    ca_file: Option<NonEmpty>,
    cert_file: Option<Spanned<NonEmpty>>,
    key_file: Option<Spanned<NonEmpty>>,
    username: Option<Spanned<NonEmpty>>,
    password: Option<Spanned<String>>,
    password_file: Option<Spanned<NonEmpty>>,
}

/// A PostgreSQL parameter value: TOML strings, integers, floats and
/// booleans are all written as PostgreSQL would read them.
pub(crate) struct ParamValue(String);

impl<'de> Deserialize<'de> for ParamValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ParamValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, number or boolean")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ParamValue, E> {
                Ok(ParamValue(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ParamValue, E> {
                Ok(ParamValue(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ParamValue, E> {
                Ok(ParamValue(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<ParamValue, E> {
                Ok(ParamValue(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<ParamValue, E> {
                Ok(ParamValue(if v { "on" } else { "off" }.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// An HA timer. Bare numbers count seconds, as in Patroni's settings that
/// operators copy from; strings take the usual units (`"500ms"`, `"2s"`).
/// Also how the dynamic configuration's timers are read.
#[derive(Clone, Copy, Debug)]
pub struct HaTimer(pub Duration);

impl<'de> Deserialize<'de> for HaTimer {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = HaTimer;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of seconds or a duration such as \"500ms\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HaTimer, E> {
                let secs = u64::try_from(v).map_err(|_| E::custom("must not be negative"))?;
                self.visit_u64(secs)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HaTimer, E> {
                crate::duration::within_bound(Duration::from_secs(v))
                    .map(HaTimer)
                    .map_err(E::custom)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<HaTimer, E> {
                let d = Duration::try_from_secs_f64(v)
                    .map_err(|_| E::custom("must be a non-negative number of seconds"))?;
                crate::duration::within_bound(d)
                    .map(HaTimer)
                    .map_err(E::custom)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HaTimer, E> {
                crate::duration::parse_duration(v)
                    .map(HaTimer)
                    .map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// Member names go into etcd keys, `application_name` and
/// `synchronous_standby_names`, so they are kept to a portable alphabet.
fn valid_member_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

pub(crate) fn agent(
    raw: RawAgent,
    user: &str,
    src: &Source<'_>,
) -> Result<AgentConfig, ConfigError> {
    let name_span = raw.name.span();
    let name = raw.name.into_inner().0;
    if !valid_member_name(&name) {
        return Err(src.invalid(
            Some(name_span),
            "agent.name",
            format!("invalid member name {name:?}: use letters, digits, '_', '-' or '.', at most 63 characters"),
        ));
    }
    let listen = raw.pg_listen.get_ref().0;
    let pg_listen = HostAddr::new(listen.ip().to_string(), listen.port());
    let pg_connect_address = match raw.pg_connect_address {
        // A wildcard is where PostgreSQL listens, not where anyone can
        // reach it: other members would connect to their own machine.
        None if listen.ip().is_unspecified() => {
            return Err(src.invalid(
                Some(raw.pg_listen.span()),
                "agent.pg_listen",
                format!(
                    "{listen} listens on all addresses: set agent.pg_connect_address to the address other members and connection managers reach this server at"
                ),
            ))
        }
        None => pg_listen.clone(),
        Some(s) => {
            let span = s.span();
            s.get_ref().parse::<HostAddr>().map_err(|e| {
                src.invalid(
                    Some(span),
                    "agent.pg_connect_address",
                    format!("invalid address {:?}: {e}", s.get_ref()),
                )
            })?
        }
    };
    let api = raw.api.0;
    match (&raw.api_cert_file, &raw.api_key_file) {
        (Some(c), None) => {
            return Err(src.invalid(
                Some(c.span()),
                "agent.api_cert_file",
                "needs agent.api_key_file, the certificate's private key",
            ))
        }
        (None, Some(k)) => {
            return Err(src.invalid(
                Some(k.span()),
                "agent.api_key_file",
                "needs agent.api_cert_file, the certificate it belongs to",
            ))
        }
        (Some(c), Some(_)) if raw.api_ca_file.is_none() => {
            return Err(src.invalid(
                Some(c.span()),
                "agent.api_cert_file",
                "needs agent.api_ca_file too: the members call each other's API and must trust the CA of its certificates",
            ))
        }
        _ => {}
    }
    let tls = raw.api_cert_file.is_some();
    if let Some(v) = raw
        .api_verify_client
        .as_ref()
        .filter(|v| *v.get_ref() != VerifyClient::None && !tls)
    {
        return Err(src.invalid(
            Some(v.span()),
            "agent.api_verify_client",
            "needs agent.api_cert_file and api_key_file: client certificates are asked for over HTTPS",
        ));
    }
    // A wildcard API address is advertised at the host other members reach
    // PostgreSQL at.
    let advertised = if api.ip().is_unspecified() {
        HostAddr::new(pg_connect_address.host.clone(), api.port()).to_string()
    } else {
        api.to_string()
    };
    let api_url = match raw.api_url {
        None if tls => format!("https://{advertised}"),
        None => format!("http://{advertised}"),
        Some(u) => {
            let url = u.get_ref().0.trim_end_matches('/').to_string();
            let wanted = if tls { "https://" } else { "http://" };
            if !url.starts_with(wanted) {
                return Err(src.invalid(
                    Some(u.span()),
                    "agent.api_url",
                    format!(
                        "{url:?} must start with {wanted}: the API serves {}",
                        if tls {
                            "HTTPS (agent.api_cert_file)"
                        } else {
                            "plain HTTP (no agent.api_cert_file)"
                        }
                    ),
                ));
            }
            url
        }
    };
    let proxy_url = match raw.proxy_url {
        None => None,
        Some(u) => {
            let url = u.get_ref().0.trim_end_matches('/').to_string();
            if !url.starts_with("http://") && !url.starts_with("https://") {
                return Err(src.invalid(
                    Some(u.span()),
                    "agent.proxy_url",
                    format!("{url:?} must start with http:// or https://"),
                ));
            }
            Some(url)
        }
    };
    let overrides = TimingOverrides {
        ttl: raw.ttl.map(|s| s.0),
        loop_wait: raw.loop_wait.map(|s| s.0),
        retry_timeout: raw.retry_timeout.map(|s| s.0),
        primary_start_timeout: raw.primary_start_timeout.map(|s| s.0),
        safety_margin: raw.safety_margin.map(|s| s.0),
    };
    let rto_span = raw.rto.as_ref().map(Spanned::span);
    let rto = raw.rto.map(Spanned::into_inner).unwrap_or_default();
    let timing = rto.resolve(&overrides).map_err(|e| {
        let key = if overrides == TimingOverrides::default() {
            "agent.rto"
        } else {
            "agent.ttl"
        };
        src.invalid(rto_span.clone(), key, format!("{e} (rto = {rto})"))
    })?;
    if let Some(spanned) = &raw.replicatefrom {
        let from = spanned.get_ref();
        if !valid_member_name(from) || *from == name {
            return Err(src.invalid(
                Some(spanned.span()),
                "agent.replicatefrom",
                format!("{from:?} must name another member of the cluster"),
            ));
        }
    }
    let mut tags = Tags {
        nofailover: raw.nofailover,
        nosync: raw.nosync,
        noloadbalance: raw.noloadbalance,
        replicatefrom: raw.replicatefrom.as_ref().map(|f| f.get_ref().clone()),
        ..Tags::default()
    };
    if let Some(p) = raw.failover_priority {
        tags.failover_priority = p;
    }
    if let (Some(_), Some(file)) = (&raw.api_password, &raw.api_password_file) {
        return Err(src.invalid(
            Some(file.span()),
            "agent.api_password_file",
            "agent.api_password is set too; keep only one of them",
        ));
    }
    if let Some(Err(e)) = raw.standby_cluster.as_ref().map(|s| s.check()) {
        let (key, why) = e.split_once(": ").unwrap_or(("standby_cluster", &e));
        return Err(src.invalid(None, format!("agent.{key}"), why.to_string()));
    }
    let (create_replica, all_methods) =
        replica_methods(raw.create_replica_methods, raw.replica_methods, src)?;
    if let Some(names) = raw
        .standby_cluster
        .as_ref()
        .and_then(|s| s.create_replica_methods.as_ref())
    {
        if let Some(name) = names
            .iter()
            .find(|n| *n != "basebackup" && !all_methods.contains_key(*n))
        {
            return Err(src.invalid(
                None,
                "agent.standby_cluster.create_replica_methods",
                format!(
                    "{name:?} is neither basebackup nor a table [agent.replica_methods.{name}]"
                ),
            ));
        }
    }
    let bootstrap = raw.bootstrap.map(|b| bootstrap(b, src)).transpose()?;
    let d = WatchdogConfig::default();
    let count = match raw.synchronous_node_count {
        None => 1,
        Some(c) if *c.get_ref() >= 1 => *c.get_ref() as usize,
        Some(c) => {
            return Err(src.invalid(
                Some(c.span()),
                "agent.synchronous_node_count",
                "must be at least 1",
            ))
        }
    };
    let sync = SyncSettings {
        protection: raw.protection.unwrap_or_default(),
        count,
        method: raw.sync_method.unwrap_or_default(),
        degrade_after: raw.sync_degrade_timeout.map_or(Duration::ZERO, |s| s.0),
    };
    Ok(AgentConfig {
        name,
        data_dir: raw.data_dir.into(),
        pg_listen,
        pg_connect_address,
        api,
        api_url,
        proxy_url,
        api_cert_file: raw.api_cert_file.map(|f| f.into_inner().into()),
        api_key_file: raw.api_key_file.map(|f| f.into_inner().into()),
        api_ca_file: raw.api_ca_file.map(Into::into),
        api_verify_client: raw
            .api_verify_client
            .map(Spanned::into_inner)
            .unwrap_or_default(),
        rto,
        timing,
        maximum_lag_on_failover: raw
            .maximum_lag_on_failover
            .unwrap_or(pgwarden_ha::DEFAULT_MAXIMUM_LAG_ON_FAILOVER),
        tags,
        run_as: raw.run_as.map(|s| s.0),
        bin_dir: raw.bin_dir.map(Into::into),
        replication_user: raw
            .replication_user
            .map_or_else(|| user.to_string(), |s| s.0),
        parameters: raw.parameters.into_iter().map(|(k, v)| (k, v.0)).collect(),
        pg_hba: raw.pg_hba,
        callbacks: Callbacks {
            on_start: raw.on_start.map(|s| s.0),
            on_stop: raw.on_stop.map(|s| s.0),
            on_role_change: raw.on_role_change.map(|s| s.0),
            on_restart: raw.on_restart.map(|s| s.0),
            on_reload: raw.on_reload.map(|s| s.0),
        },
        watchdog: WatchdogConfig {
            mode: raw.watchdog.unwrap_or(d.mode),
            device: raw.watchdog_device.map_or(d.device, Into::into),
        },
        api_username: raw
            .api_username
            .map_or_else(|| "pgwarden".to_string(), |s| s.0),
        api_password: raw.api_password,
        api_password_file: raw.api_password_file.map(|f| f.into_inner().into()),
        reclone_on_rewind_failure: raw.reclone_on_rewind_failure.unwrap_or(true),
        use_slots: raw.use_slots.unwrap_or(true),
        failsafe: raw.failsafe.unwrap_or(false),
        on_sync_blocked: raw.on_sync_blocked.unwrap_or_default(),
        sync,
        standby_cluster: raw.standby_cluster,
        create_replica,
        replica_methods: all_methods,
        bootstrap,
    })
}

/// `[agent.bootstrap]`, checked: parameter names, one line each, and no
/// recovery end other than promotion (the agent waits for a primary).
fn bootstrap(raw: RawBootstrap, src: &Source<'_>) -> Result<BootstrapMethod, ConfigError> {
    let mut recovery = BTreeMap::new();
    for (k, ParamValue(v)) in raw.recovery {
        let key = format!("agent.bootstrap.recovery.{k}");
        let name_ok = k.bytes().next().is_some_and(|b| b.is_ascii_alphabetic())
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !name_ok {
            return Err(src.invalid(None, key, "not a PostgreSQL parameter name"));
        }
        if v.contains(['\n', '\r', '\0']) {
            return Err(src.invalid(None, key, "line breaks are not allowed"));
        }
        let k = k.to_ascii_lowercase();
        if k == "recovery_target_action" && v != "promote" {
            return Err(src.invalid(
                None,
                key,
                format!("{v:?}: only \"promote\" (the new cluster's first member must end its recovery as a primary)"),
            ));
        }
        recovery.insert(k, v);
    }
    Ok(BootstrapMethod {
        command: raw.command.0,
        no_params: raw.no_params,
        recovery,
    })
}

/// `create_replica_methods` with the tables its names refer to (without
/// it, `pg_basebackup` alone), and every table by its name.
type Methods = (Vec<ReplicaMethod>, BTreeMap<String, ReplicaMethod>);

fn replica_methods(
    order: Option<Spanned<Vec<NonEmpty>>>,
    tables: BTreeMap<String, RawReplicaMethod>,
    src: &Source<'_>,
) -> Result<Methods, ConfigError> {
    if tables.contains_key("basebackup") {
        return Err(src.invalid(
            None,
            "agent.replica_methods.basebackup",
            "basebackup is built in and takes no table",
        ));
    }
    let mut tables: BTreeMap<String, ReplicaMethod> = tables
        .into_iter()
        .map(|(name, t)| {
            let method = ReplicaMethod::Command {
                name: name.clone(),
                command: t.command.0,
                keep_data: t.keep_data,
                no_params: t.no_params,
            };
            (name, method)
        })
        .collect();
    let all = tables.clone();
    let Some(order) = order else {
        return Ok((vec![ReplicaMethod::Basebackup], all));
    };
    let span = order.span();
    let names = order.into_inner();
    if names.is_empty() {
        return Err(src.invalid(
            Some(span),
            "agent.create_replica_methods",
            "names no method; leave it out for basebackup alone",
        ));
    }
    let mut out = Vec::with_capacity(names.len());
    for NonEmpty(name) in names {
        if name == "basebackup" {
            out.push(ReplicaMethod::Basebackup);
            continue;
        }
        let Some(method) = tables.remove(&name) else {
            return Err(src.invalid(
                Some(span),
                "agent.create_replica_methods",
                format!(
                    "{name:?} is neither basebackup nor a table [agent.replica_methods.{name}] (or is listed twice)"
                ),
            ));
        };
        out.push(method);
    }
    Ok((out, all))
}

pub(crate) fn etcd(raw: RawEtcd, src: &Source<'_>) -> Result<EtcdConfig, ConfigError> {
    let span = raw.endpoints.span();
    let endpoints: Vec<String> = raw
        .endpoints
        .into_inner()
        .into_iter()
        .map(|e| e.0.trim().to_string())
        .collect();
    if endpoints.is_empty() {
        return Err(src.invalid(
            Some(span),
            "etcd.endpoints",
            "is empty: list at least one etcd member",
        ));
    }
    let segment_ok = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
    };
    let cluster_span = raw.cluster.span();
    let cluster = raw.cluster.into_inner();
    if !segment_ok(&cluster) {
        return Err(src.invalid(
            Some(cluster_span),
            "etcd.cluster",
            format!("invalid cluster name {cluster:?}: use letters, digits, '_', '-' or '.'"),
        ));
    }
    let namespace = match raw.namespace {
        None => DEFAULT_ETCD_NAMESPACE.to_string(),
        Some(n) => {
            let text = n.get_ref().trim_matches('/').to_string();
            if !segment_ok(&text) {
                return Err(src.invalid(
                    Some(n.span()),
                    "etcd.namespace",
                    format!(
                        "invalid namespace {:?}: use letters, digits, '_', '-' or '.'",
                        n.get_ref()
                    ),
                ));
            }
            text
        }
    };
    let tls = raw.ca_file.is_some();
    if let Some(e) = endpoints.iter().find(|e| {
        if tls {
            e.starts_with("http://")
        } else {
            e.starts_with("https://")
        }
    }) {
        let message = if tls {
            format!(
                "{e:?} is plain http, but etcd.ca_file asks for TLS: write https:// or host:port"
            )
        } else {
            format!("{e:?} needs TLS: set etcd.ca_file to the CA that signed etcd's certificate")
        };
        return Err(src.invalid(Some(span), "etcd.endpoints", message));
    }
    match (&raw.cert_file, &raw.key_file) {
        (Some(c), None) => {
            return Err(src.invalid(
                Some(c.span()),
                "etcd.cert_file",
                "needs etcd.key_file, the certificate's private key",
            ))
        }
        (None, Some(k)) => {
            return Err(src.invalid(
                Some(k.span()),
                "etcd.key_file",
                "needs etcd.cert_file, the certificate it belongs to",
            ))
        }
        (Some(c), Some(_)) if !tls => {
            return Err(src.invalid(
                Some(c.span()),
                "etcd.cert_file",
                "a client certificate needs TLS: set etcd.ca_file too",
            ))
        }
        _ => {}
    }
    match (&raw.username, &raw.password, &raw.password_file) {
        (_, Some(_), Some(f)) => {
            return Err(src.invalid(
                Some(f.span()),
                "etcd.password_file",
                "etcd.password is set too; keep only one of them",
            ))
        }
        (None, Some(p), None) => {
            return Err(src.invalid(Some(p.span()), "etcd.password", "needs etcd.username"))
        }
        (None, None, Some(f)) => {
            return Err(src.invalid(Some(f.span()), "etcd.password_file", "needs etcd.username"))
        }
        (Some(u), None, None) => {
            return Err(src.invalid(
                Some(u.span()),
                "etcd.username",
                "needs etcd.password or etcd.password_file",
            ))
        }
        (Some(_), Some(p), None) if p.get_ref().is_empty() => {
            return Err(src.invalid(Some(p.span()), "etcd.password", "is empty"))
        }
        _ => {}
    }
    Ok(EtcdConfig {
        endpoints,
        namespace,
        cluster,
        op_timeout: raw.op_timeout.map_or(Duration::from_secs(2), |d| d.0),
        ca_file: raw.ca_file.map(Into::into),
        cert_file: raw.cert_file.map(|f| f.into_inner().into()),
        key_file: raw.key_file.map(|f| f.into_inner().into()),
        username: raw.username.map(|u| u.into_inner().0),
        password: raw.password.map(Spanned::into_inner),
        password_file: raw.password_file.map(|f| f.into_inner().into()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_names() {
        for ok in ["n1", "pg-1.dc2", "A_b"] {
            assert!(valid_member_name(ok), "{ok}");
        }
        for bad in ["", "a b", "a/b", "é", &"a".repeat(64)] {
            assert!(!valid_member_name(bad), "{bad}");
        }
    }
}
