//! The HA agent: runs beside one PostgreSQL node, keeps the cluster's leader
//! lease in etcd, and makes the local server follow the decisions of
//! [`pgwarden_ha::decide`].
//!
//! * [`record`]: what a member publishes in etcd, and the decision's view
//!   of a DCS snapshot.
//! * [`status`]: the agent's state as the API and the router read it.
//! * `ha_loop`: observe, read the DCS, decide, act, publish.
//! * [`postgres`]: the local PostgreSQL, driven and observed.
//! * [`watchdog`]: the Linux watchdog armed while leading.
//! * [`fence`]: the process that stops a leader's PostgreSQL when its
//!   agent dies.
//! * `handover`: the connection managers paused around a switchover.
//! * [`api`]: the Patroni-compatible REST API; [`http_client`] is how
//!   members and `pgwarden ctl` call it.

pub mod api;
pub mod cluster_settings;
pub mod fence;
mod ha_loop;
mod handover;
pub mod http_client;
pub mod parameters;
pub mod postgres;
pub mod record;
pub mod slots;
pub mod status;
pub mod tls;
pub mod watchdog;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use pgwarden_config::{AgentConfig, EtcdConfig};
use pgwarden_dcs::EtcdDcs;
use pgwarden_pgctl::{Instance, InstanceSpec, PgBinaries, RunAs};
use tokio::sync::{mpsc, watch};

pub use record::MemberRecord;
pub use status::{AgentStatus, Command, Reply, StatusHandle};

/// Whether going from the node file's `old` `[agent]` to `new` needs no
/// restart of the agent: only tags, parameters, callbacks, the cluster
/// settings (timings, lag limit, protection, failsafe), `use_slots`,
/// `reclone_on_rewind_failure`, the API's credentials, the watchdog, the
/// replication user, the replica creation methods, and `standby_cluster`
/// and `bootstrap` (which only a new cluster reads) differ, which a running
/// agent takes on `SIGHUP`.
pub fn reloadable(old: &AgentConfig, new: &AgentConfig) -> bool {
    let mut rest = new.clone();
    rest.tags = old.tags.clone();
    rest.parameters = old.parameters.clone();
    rest.callbacks = old.callbacks.clone();
    rest.rto = old.rto;
    rest.timing = old.timing;
    rest.maximum_lag_on_failover = old.maximum_lag_on_failover;
    rest.sync = old.sync;
    rest.failsafe = old.failsafe;
    rest.use_slots = old.use_slots;
    rest.reclone_on_rewind_failure = old.reclone_on_rewind_failure;
    rest.api_username = old.api_username.clone();
    rest.api_password = old.api_password.clone();
    rest.api_password_file = old.api_password_file.clone();
    rest.watchdog = old.watchdog.clone();
    rest.replication_user = old.replication_user.clone();
    rest.create_replica = old.create_replica.clone();
    rest.replica_methods = old.replica_methods.clone();
    // Read only when the cluster is created.
    rest.standby_cluster = old.standby_cluster.clone();
    rest.bootstrap = old.bootstrap.clone();
    rest == *old
}

/// The `[agent]` keys that differ between `old` and `new` and take effect
/// only when the agent restarts (empty when [`reloadable`]), for the
/// warning a reload logs.
pub fn restart_needed(old: &AgentConfig, new: &AgentConfig) -> Vec<&'static str> {
    let mut keys = Vec::new();
    let mut differs = |changed: bool, key: &'static str| {
        if changed {
            keys.push(key);
        }
    };
    differs(old.name != new.name, "agent.name");
    differs(old.data_dir != new.data_dir, "agent.data_dir");
    differs(old.pg_listen != new.pg_listen, "agent.pg_listen");
    differs(
        old.pg_connect_address != new.pg_connect_address,
        "agent.pg_connect_address",
    );
    differs(old.api != new.api, "agent.api");
    differs(old.api_url != new.api_url, "agent.api_url");
    differs(old.proxy_url != new.proxy_url, "agent.proxy_url");
    differs(
        old.api_cert_file != new.api_cert_file || old.api_key_file != new.api_key_file,
        "agent.api_cert_file/api_key_file",
    );
    differs(old.api_ca_file != new.api_ca_file, "agent.api_ca_file");
    differs(
        old.api_verify_client != new.api_verify_client,
        "agent.api_verify_client",
    );
    differs(old.run_as != new.run_as, "agent.run_as");
    differs(old.bin_dir != new.bin_dir, "agent.bin_dir");
    differs(old.pg_hba != new.pg_hba, "agent.pg_hba");
    differs(
        old.on_sync_blocked != new.on_sync_blocked,
        "agent.on_sync_blocked",
    );
    if keys.is_empty() && !reloadable(old, new) {
        keys.push("agent");
    }
    keys
}

/// Settings the agent always gives its PostgreSQL, before the operator's
/// `agent.parameters`: enough WAL kept for a demoted primary to rejoin
/// without a fresh clone, and hot standbys that answer the probes.
pub(crate) const DEFAULT_PARAMETERS: &[(&str, &str)] = &[
    ("wal_level", "replica"),
    ("hot_standby", "on"),
    ("wal_keep_size", "128MB"),
    ("max_wal_senders", "10"),
    ("max_replication_slots", "10"),
    ("wal_log_hints", "on"),
];

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// PostgreSQL binaries or the unprivileged user are missing.
    #[error(transparent)]
    Pg(#[from] pgwarden_pgctl::PgCtlError),
    /// The REST API's address cannot be bound.
    #[error("agent.api: cannot listen on {addr}: {source}")]
    Api {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The API's certificate, key or CA cannot be used.
    #[error("agent.api_cert_file/api_key_file/api_ca_file: {0}")]
    ApiTls(String),
    /// A file named in `[etcd]` cannot be read.
    #[error("etcd.{key}: cannot read {}: {source}", path.display())]
    EtcdFile {
        /// The key that names the file.
        key: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// What a running agent on `old` can take of `new` by reconnecting
/// ([`AgentHandle::reconnect_etcd`]): the endpoints, TLS files and
/// credentials; the cluster's keys (`namespace`, `cluster`) and
/// `op_timeout` need a restart, so they keep `old`'s values, and the keys
/// so held back are returned beside.
pub fn etcd_reloadable(old: &EtcdConfig, new: &EtcdConfig) -> (EtcdConfig, Vec<&'static str>) {
    let mut wanted = new.clone();
    let mut held = Vec::new();
    if wanted.namespace != old.namespace {
        held.push("etcd.namespace");
        wanted.namespace = old.namespace.clone();
    }
    if wanted.cluster != old.cluster {
        held.push("etcd.cluster");
        wanted.cluster = old.cluster.clone();
    }
    if wanted.op_timeout != old.op_timeout {
        held.push("etcd.op_timeout");
        wanted.op_timeout = old.op_timeout;
    }
    (wanted, held)
}

/// Loads the files the agent's configuration names (etcd's CA,
/// certificate, key and password file; the API's certificate, key and CA)
/// as starting would, without connecting to anything: `pgwarden agent
/// --check`. Relative paths must already be resolved.
pub fn check_files(cfg: &AgentConfig, etcd: &EtcdConfig) -> Result<(), AgentError> {
    etcd_security(etcd)?;
    let own = cfg
        .api_cert_file
        .as_deref()
        .zip(cfg.api_key_file.as_deref());
    if let Some(ca) = &cfg.api_ca_file {
        tls::client_config(ca, own).map_err(AgentError::ApiTls)?;
    }
    if let Some((cert, key)) = own {
        let (client_ca, optional) = api_client_verification(cfg);
        tls::server_config(cert, key, client_ca, optional).map_err(AgentError::ApiTls)?;
    }
    Ok(())
}

/// Whom the API asks for a client certificate: the CA it must chain to
/// (none: nobody is asked), and whether one may be left out.
fn api_client_verification(cfg: &AgentConfig) -> (Option<&Path>, bool) {
    use pgwarden_config::VerifyClient;
    let client_ca = cfg
        .api_ca_file
        .as_deref()
        .filter(|_| cfg.api_verify_client != VerifyClient::None);
    (client_ca, cfg.api_verify_client == VerifyClient::Optional)
}

/// What the agent shows etcd, read from the files `[etcd]` names (paths
/// as given: the caller resolves relative ones).
pub fn etcd_security(etcd: &EtcdConfig) -> Result<pgwarden_dcs::EtcdSecurity, AgentError> {
    let read = |key: &'static str, path: &std::path::Path| {
        std::fs::read(path).map_err(|source| AgentError::EtcdFile {
            key,
            path: path.to_path_buf(),
            source,
        })
    };
    let ca_pem = etcd
        .ca_file
        .as_deref()
        .map(|p| read("ca_file", p))
        .transpose()?;
    let identity = match (&etcd.cert_file, &etcd.key_file) {
        (Some(c), Some(k)) => Some((read("cert_file", c)?, read("key_file", k)?)),
        _ => None,
    };
    let password = match (&etcd.password, &etcd.password_file) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(f)) => {
            let text = read("password_file", f)?;
            Some(
                String::from_utf8_lossy(&text)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
            )
        }
        (None, None) => None,
    };
    let user = etcd.username.clone().zip(password);
    Ok(pgwarden_dcs::EtcdSecurity {
        ca_pem,
        identity,
        user,
    })
}

/// A running agent, as the rest of the process uses it.
#[derive(Clone)]
pub struct AgentHandle {
    /// The latest status, swapped after every loop iteration.
    pub status: StatusHandle,
    /// Bumped whenever the status changes.
    pub changes: watch::Receiver<u64>,
    /// Requests to the loop.
    pub commands: mpsc::Sender<Command>,
    /// The DCS connection, shared with the API.
    pub dcs: EtcdDcs,
    /// The leader generation this node's connection manager routes by: set
    /// by the router once it has cut sessions to any earlier primary, and
    /// published in this member's record for the new leader to wait on.
    pub routing_ack: Arc<std::sync::atomic::AtomicI64>,
    stopped: Arc<tokio::sync::Notify>,
    failed: watch::Receiver<Option<String>>,
    /// When (Unix ms) this member last took part in a successful failsafe
    /// exchange (as the leader, or acknowledging it): while recent, the
    /// leader stands even though etcd is silent.
    pub failsafe_seen: Arc<std::sync::atomic::AtomicU64>,
    /// The REST API's write credentials, replaced on a reload.
    pub api_credentials: Arc<api::Credentials>,
    api_tls: ApiTlsFiles,
}

impl AgentHandle {
    /// Connects to etcd anew with a reloaded `[etcd]` (its relative paths
    /// already resolved): new endpoints, renewed certificates or a rotated
    /// password. The old connection stays if the new one cannot read the
    /// cluster's keys.
    pub async fn reconnect_etcd(&self, etcd: &EtcdConfig) -> Result<(), String> {
        let security = etcd_security(etcd).map_err(|e| e.to_string())?;
        self.dcs
            .reconnect(&etcd.endpoints, &security)
            .await
            .map_err(|e| api::chain(&e))
    }

    /// Waits until the agent gives up managing its node for good (its data
    /// directory holds another database than the cluster's), and says why.
    /// Never returns while the agent runs.
    pub async fn failure(&self) -> String {
        let mut failed = self.failed.clone();
        loop {
            if let Some(why) = failed.borrow_and_update().clone() {
                return why;
            }
            if failed.changed().await.is_err() {
                // The loop ended without failing (a shutdown).
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops the agent as an operator's `systemctl stop` expects: PostgreSQL
    /// is stopped, the leader key (if held) is released so a replica takes
    /// over without waiting for the ttl, and the member record withdrawn.
    /// Waits for that, at most `within`.
    pub async fn shutdown(&self, within: Duration) {
        let done = self.stopped.notified();
        if self.commands.send(Command::Shutdown).await.is_ok() {
            let _ = tokio::time::timeout(within, done).await;
        }
    }
}

/// Starts the agent of one node: connects to etcd (retrying until it
/// answers), then runs the HA loop in the background.
///
/// `superuser` and `password` are what the agent connects to its
/// PostgreSQL with (and what initdb creates); `api_credentials` guard the
/// REST API's write endpoints (`None` refuses them all); `proxy_url` is
/// this node's connection manager's HTTP port, published for switchovers.
pub async fn start(
    cfg: AgentConfig,
    etcd: EtcdConfig,
    superuser: String,
    password: Option<String>,
    api_credentials: Option<(String, String)>,
    proxy_url: Option<String>,
) -> Result<AgentHandle, AgentError> {
    // The CA first: this agent calls the other members' APIs with it,
    // presenting its own certificate where they ask for one.
    let own = cfg
        .api_cert_file
        .as_deref()
        .zip(cfg.api_key_file.as_deref());
    if let Some(ca) = &cfg.api_ca_file {
        http_client::trust_with(ca, own).map_err(AgentError::ApiTls)?;
    }
    let (client_ca, optional) = api_client_verification(&cfg);
    let api_tls = match own {
        Some((cert, key)) => Some((
            Arc::new(arc_swap::ArcSwap::new(
                tls::server_config(cert, key, client_ca, optional).map_err(AgentError::ApiTls)?,
            )),
            optional,
        )),
        None => None,
    };
    let api_tls_files = ApiTlsFiles {
        cert_key: own.map(|(c, k)| (c.to_path_buf(), k.to_path_buf())),
        ca: cfg.api_ca_file.clone(),
        client_ca: client_ca.map(Path::to_path_buf),
        optional,
        server: api_tls.as_ref().map(|(t, _)| t.clone()),
    };
    let api_listener = tokio::net::TcpListener::bind(cfg.api)
        .await
        .map_err(|source| AgentError::Api {
            addr: cfg.api,
            source,
        })?;
    let bins = match &cfg.bin_dir {
        Some(d) => PgBinaries::at(d),
        None => PgBinaries::discover()?,
    };
    let run_as = match &cfg.run_as {
        Some(name) => RunAs::named(name)?,
        None if nix::unistd::geteuid().is_root() => RunAs::unprivileged()?,
        None => RunAs::current(),
    };
    let mut spec = InstanceSpec::new(&cfg.name, &cfg.data_dir, cfg.pg_listen.port);
    spec.host = cfg.pg_listen.host.clone();
    spec.primary_slot = cfg.use_slots.then(|| slots::slot_name(&cfg.name));
    let mut settings: BTreeMap<String, String> = DEFAULT_PARAMETERS
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    settings.extend(cfg.parameters.clone());
    spec.settings = settings;
    let instance = Instance::new(spec, bins, run_as);
    let pg = postgres::LocalPostgres::new(
        instance,
        cfg.pg_listen.clone(),
        superuser,
        password,
        cfg.replication_user.clone(),
    );
    let security = etcd_security(&etcd)?;
    let dcs = loop {
        match EtcdDcs::connect_with(
            &etcd.endpoints,
            &etcd.namespace,
            &etcd.cluster,
            etcd.op_timeout,
            &security,
        )
        .await
        {
            Ok(d) => break d,
            Err(e) => {
                // The cause (a refused password, a certificate etcd does
                // not trust) is in the source chain.
                let why = api::chain(&e);
                tracing::warn!(error = %why, "cannot reach etcd yet; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let status: StatusHandle = Arc::new(ArcSwap::from_pointee(AgentStatus {
        settings: cluster_settings::ClusterSettings::of(&cfg),
        node_settings: cluster_settings::ClusterSettings::of(&cfg),
        ..AgentStatus::initial(MemberRecord::default(), cfg.timing)
    }));
    let (changes_tx, changes) = watch::channel(0);
    let (commands, commands_rx) = mpsc::channel(16);
    let failsafe_seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let reinitializing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let credentials = api::Credentials::new(api_credentials);
    let api_state = Arc::new(api::ApiState {
        name: cfg.name.clone(),
        status: status.clone(),
        dcs: dcs.clone(),
        commands: commands.clone(),
        credentials: credentials.clone(),
        switchover_wait: api::DEFAULT_SWITCHOVER_WAIT,
        failsafe_seen: failsafe_seen.clone(),
        reinitializing: reinitializing.clone(),
    });
    tokio::spawn(async move {
        let served = match api_tls {
            Some((tls, optional)) => {
                api::serve_tls(
                    api_listener,
                    api_state,
                    tls,
                    optional,
                    std::future::pending(),
                )
                .await
            }
            None => api::serve(api_listener, api_state, std::future::pending()).await,
        };
        if let Err(e) = served {
            tracing::error!(error = %e, "the REST API stopped");
        }
    });
    let routing_ack = Arc::new(std::sync::atomic::AtomicI64::new(0));
    let stopped = Arc::new(tokio::sync::Notify::new());
    let (failed_tx, failed) = watch::channel(None);
    let ha = ha_loop::HaLoop::new(
        cfg,
        proxy_url,
        etcd,
        dcs.clone(),
        pg,
        ha_loop::LoopLinks {
            status: status.clone(),
            changes: changes_tx,
            commands: commands_rx,
            routing_ack: routing_ack.clone(),
            stopped: stopped.clone(),
            failsafe_seen: failsafe_seen.clone(),
            credentials: credentials.clone(),
            reinitializing,
            failed: failed_tx,
        },
    );
    tokio::spawn(ha.run());
    Ok(AgentHandle {
        status,
        changes,
        commands,
        dcs,
        routing_ack,
        stopped,
        failed,
        failsafe_seen,
        api_credentials: credentials,
        api_tls: api_tls_files,
    })
}

/// The REST API's TLS files as the agent started with them, read again on
/// a reload.
#[derive(Clone, Debug)]
struct ApiTlsFiles {
    /// The API's own certificate and key, which it also presents to the
    /// members that ask for a client certificate.
    cert_key: Option<(PathBuf, PathBuf)>,
    /// What this agent trusts in the other members' certificates.
    ca: Option<PathBuf>,
    /// What clients' certificates must chain to, when asked for.
    client_ca: Option<PathBuf>,
    optional: bool,
    /// The server configuration in force.
    server: Option<Arc<arc_swap::ArcSwap<tokio_rustls::rustls::ServerConfig>>>,
}

impl AgentHandle {
    /// Reads the REST API's certificate, key and CA files again (renewed
    /// certificates), for the API's new connections and this agent's
    /// calls to the other members. `Ok(false)`: the API has no TLS. On an
    /// error nothing changes.
    pub fn reload_api_tls(&self) -> Result<bool, String> {
        let f = &self.api_tls;
        let own = f.cert_key.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
        let server = match (own, &f.server) {
            (Some((cert, key)), Some(_)) => Some(tls::server_config(
                cert,
                key,
                f.client_ca.as_deref(),
                f.optional,
            )?),
            _ => None,
        };
        if let Some(ca) = &f.ca {
            http_client::trust_with(ca, own)?;
        }
        match (server, &f.server) {
            (Some(new), Some(swap)) => {
                swap.store(new);
                Ok(true)
            }
            _ => Ok(f.ca.is_some()),
        }
    }
}

/// Runs futures concurrently, outputs in order.
pub(crate) async fn join_all<F: std::future::Future>(
    futs: impl Iterator<Item = F>,
) -> Vec<F::Output> {
    let mut pending: Vec<_> = futs.map(|f| Some(Box::pin(f))).collect();
    let mut out: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut done = true;
        for (i, slot) in pending.iter_mut().enumerate() {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        out[i] = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => done = false,
                }
            }
        }
        if done {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.into_iter().map(|v| v.expect("ready")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(extra: &str) -> AgentConfig {
        let text = format!(
            "[agent]\nname = \"n1\"\ndata_dir = \"/var/lib/pgwarden/n1\"\n\
             pg_listen = \"127.0.0.1:5432\"\napi = \"127.0.0.1:8008\"\n{extra}\n\
             [etcd]\nendpoints = [\"127.0.0.1:2379\"]\ncluster = \"demo\"\n"
        );
        pgwarden_config::parse(&text, "pgwarden.toml")
            .unwrap()
            .agent
            .unwrap()
    }

    #[test]
    fn cluster_settings_tags_and_parameters_reload_the_rest_does_not() {
        let old = agent("rto = \"fast\"");
        for same in [
            "rto = \"safe\"",
            "rto = \"fast\"\nttl = 30\nloop_wait = 2",
            "rto = \"fast\"\nprotection = \"maximum_protection\"\nsync_method = \"quorum\"",
            "rto = \"fast\"\nfailsafe = true\nmaximum_lag_on_failover = 5",
            "rto = \"fast\"\nnofailover = true\nparameters = { work_mem = \"8MB\" }",
            "rto = \"fast\"\non_start = \"true\"",
            "rto = \"fast\"\nuse_slots = false\nreclone_on_rewind_failure = false",
            "rto = \"fast\"\napi_username = \"admin\"\napi_password = \"x\"",
            "rto = \"fast\"\nwatchdog = \"automatic\"",
            "rto = \"fast\"\nreplication_user = \"replicator\"",
            "rto = \"fast\"\nstandby_cluster = { host = \"10.0.0.5\" }",
            "rto = \"fast\"\ncreate_replica_methods = [\"r\"]\nreplica_methods = { r = { command = \"x\" } }",
            "rto = \"fast\"\nbootstrap = { command = \"x\" }",
        ] {
            assert!(reloadable(&old, &agent(same)), "{same}");
            assert!(restart_needed(&old, &agent(same)).is_empty(), "{same}");
        }
        for (restart, keys) in [
            (
                "rto = \"fast\"\npg_connect_address = \"10.0.0.1:5432\"",
                vec!["agent.pg_connect_address"],
            ),
            ("rto = \"fast\"\nbin_dir = \"/opt/pg/bin\"", vec!["agent.bin_dir"]),
            (
                "rto = \"fast\"\nbin_dir = \"/opt/pg/bin\"\npg_hba = [\"host all all 10.0.0.0/8 trust\"]",
                vec!["agent.bin_dir", "agent.pg_hba"],
            ),
        ] {
            assert!(!reloadable(&old, &agent(restart)), "{restart}");
            assert_eq!(restart_needed(&old, &agent(restart)), keys, "{restart}");
        }
    }
}
