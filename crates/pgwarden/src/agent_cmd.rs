//! `pgwarden agent`: the HA agent of one node and its connection manager.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pgwarden_agent::record::records;
use pgwarden_agent::AgentHandle;
use pgwarden_probe::Engine;
use pgwarden_topology::{HostAddr, HostConfig, PrimaryGate};

/// Options of `pgwarden agent`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The node's configuration file (TOML) with `[agent]` and `[etcd]`.
    #[arg(long, short, value_name = "FILE")]
    config: PathBuf,
    /// Check the file and every file it names (etcd's and the API's TLS
    /// files, passwords, the connection manager's), print what it sets up
    /// and exit, starting nothing: before a start or a SIGHUP.
    #[arg(long)]
    check: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let config = pgwarden_config::load(&args.config)?;
    crate::init_logging(Some(&config.log));
    let (Some(mut agent), Some(mut etcd)) = (config.agent.clone(), config.etcd.clone()) else {
        anyhow::bail!(
            "{}: pgwarden agent needs the [agent] and [etcd] sections (use pgwarden run for standalone mode)",
            args.config.display()
        );
    };
    // Files named in [etcd] and [agent] are relative to the configuration
    // file.
    etcd = etcd_files_resolved(&etcd, &args.config);
    agent = agent_files_resolved(&agent, &args.config);
    if args.check {
        pgwarden_agent::check_files(&agent, &etcd)
            .with_context(|| format!("{}", args.config.display()))?;
        api_credentials(&agent, &args.config)?;
        crate::run_cmd::check(&args.config, &config)?;
        println!(
            "{}: member {} of cluster {} ({} etcd endpoint(s)), data directory {}",
            args.config.display(),
            agent.name,
            etcd.cluster,
            etcd.endpoints.len(),
            agent.data_dir.display()
        );
        return Ok(());
    }
    let runtime = crate::run_cmd::runtime(&config)?;
    let result = runtime.block_on(async {
        let probe = crate::run_cmd::probe_config(&config, &args.config)?;
        // The agent's own server is the one it logs in to (and the one
        // initdb gives this password): its password file line is the
        // line of `pg_listen`, as libpq would pick it.
        let password = probe.password_for(&agent.pg_listen);
        tracing::info!(member = %agent.name, cluster = %etcd.cluster, rto = %agent.rto, "starting the HA agent");
        let credentials = api_credentials(&agent, &args.config)?;
        // Where the other members' agents pause this node's pools: a
        // wildcard bind address is no place to call.
        let proxy_url = agent.advertised_proxy_url(config.listen.http);
        let reachable_only_here = |host: &str| {
            host == "localhost"
                || host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        };
        if agent.proxy_url.is_none()
            && config.listen.http.ip().is_loopback()
            && !reachable_only_here(&agent.pg_connect_address.host)
        {
            tracing::warn!(
                http = %config.listen.http,
                "listen.http is a loopback address, so the other members cannot pause this node's pools around a switchover and its transaction-pooled clients would see errors: listen on an address they reach, or set agent.proxy_url"
            );
        }
        let start = pgwarden_agent::start(
            agent,
            etcd,
            config.cluster.user.clone(),
            password,
            credentials.clone(),
            Some(proxy_url),
        );
        let start = crate::run_cmd::AgentStart {
            start: Box::pin(async move { Ok(start.await?) }),
            api_credentials: credentials,
        };
        crate::run_cmd::serve(&args.config, config, false, Some(start)).await
    });
    crate::run_cmd::finish(runtime);
    result
}

/// `agent` with the API's certificate, key and CA files resolved against
/// the configuration file's directory.
pub(crate) fn agent_files_resolved(
    agent: &pgwarden_config::AgentConfig,
    config_path: &std::path::Path,
) -> pgwarden_config::AgentConfig {
    let mut agent = agent.clone();
    resolve_against(
        config_path,
        [
            &mut agent.api_cert_file,
            &mut agent.api_key_file,
            &mut agent.api_ca_file,
        ],
    );
    agent
}

/// `etcd` with the files it names resolved against the directory of the
/// configuration file at `config_path`.
pub(crate) fn etcd_files_resolved(
    etcd: &pgwarden_config::EtcdConfig,
    config_path: &std::path::Path,
) -> pgwarden_config::EtcdConfig {
    let mut etcd = etcd.clone();
    resolve_against(
        config_path,
        [
            &mut etcd.ca_file,
            &mut etcd.cert_file,
            &mut etcd.key_file,
            &mut etcd.password_file,
        ],
    );
    etcd
}

/// Makes the paths of `files` relative to the configuration file's
/// directory (an absolute one stays as it is).
fn resolve_against<'a>(
    config_path: &std::path::Path,
    files: impl IntoIterator<Item = &'a mut Option<std::path::PathBuf>>,
) {
    let dir = config_path.parent().unwrap_or(std::path::Path::new("."));
    for f in files.into_iter().flatten() {
        *f = dir.join(&*f);
    }
}

/// With `on_sync_blocked = "reject"`: while the leader's commits wait for
/// a synchronous standby, the read-write service refuses new transactions
/// at once with an error saying why, instead of letting them hang too.
pub async fn refuse_writes_while_blocked(
    agent: AgentHandle,
    switch: pgwarden_proxy::RefusalSwitch,
) {
    let mut changes = agent.changes.clone();
    let mut refusing = false;
    loop {
        let st = agent.status.load_full();
        let blocked = st
            .cluster
            .as_ref()
            .and_then(pgwarden_agent::record::sync_state)
            .is_some_and(|s| {
                s.synchronous
                    && s.blocked_since_ms.is_some()
                    && st.leader.as_deref() == Some(s.leader.as_str())
            });
        if blocked != refusing {
            switch.set(
                pgwarden_config::READ_WRITE,
                blocked.then(|| {
                    "writes are refused: the leader waits for a synchronous standby \
                     (on_sync_blocked = reject)"
                        .to_string()
                }),
            );
            refusing = blocked;
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// The REST API's write credentials: `agent.api_password`, the first line
/// of `agent.api_password_file` (relative to the configuration file), or
/// `PGWARDEN_API_PASSWORD`; none of them leaves the write endpoints closed.
pub(crate) fn api_credentials(
    agent: &pgwarden_config::AgentConfig,
    config_path: &std::path::Path,
) -> anyhow::Result<Option<(String, String)>> {
    let password = match (&agent.api_password, &agent.api_password_file) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(f)) => {
            let path = config_path
                .parent()
                .unwrap_or(std::path::Path::new("."))
                .join(f);
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("agent.api_password_file: {}", path.display()))?;
            Some(text.lines().next().unwrap_or_default().to_string())
        }
        (None, None) => std::env::var("PGWARDEN_API_PASSWORD").ok(),
    };
    // An empty password would let anyone who sends one in.
    let password = password.filter(|p| !p.is_empty());
    if password.is_none() {
        tracing::warn!("no API password configured: the REST API's write endpoints are refused");
    }
    Ok(password.map(|p| (agent.api_username.clone(), p)))
}

/// Keeps the topology engine's primary gate on the leader key's holder and
/// its host list on the published members, for as long as the process runs.
///
/// Writes fail closed: with no leader, or with a DCS that has been silent
/// for longer than the lease ttl (another member may lead by now), no host
/// is admitted as primary.
pub async fn follow_leader(
    agent: AgentHandle,
    engine: Arc<Engine>,
    mut configured: tokio::sync::watch::Receiver<Vec<HostConfig>>,
) {
    let mut changes = agent.changes.clone();
    let mut gate: Option<PrimaryGate> = None;
    let mut hosts: Option<Vec<HostConfig>> = None;
    let mut acked = 0;
    loop {
        let st = agent.status.load_full();
        let members = st.cluster.as_ref().map(records).unwrap_or_default();
        let fenced = st
            .cluster
            .as_ref()
            .map(pgwarden_agent::record::fenced)
            .unwrap_or_default();
        // A leader that every member still acknowledges (failsafe) stands
        // even while etcd is silent.
        let failsafe_age = pgwarden_agent::record::unix_ms().saturating_sub(
            agent
                .failsafe_seen
                .load(std::sync::atomic::Ordering::SeqCst),
        );
        let fresh = u128::from(st.dcs_silent_ms) < st.settings.timing.ttl.as_millis()
            || u128::from(failsafe_age) < st.settings.timing.ttl.as_millis();
        // A new leadership first closes the gate (cutting sessions to the
        // earlier primary), is acknowledged, and opens only once the agent
        // reports every live connection manager has done the same.
        if st.leader_generation != acked {
            if gate.is_some() {
                engine.set_primary_gate(PrimaryGate::Leader(None));
                gate = Some(PrimaryGate::Leader(None));
            }
            acked = st.leader_generation;
            agent
                .routing_ack
                .store(acked, std::sync::atomic::Ordering::SeqCst);
            let _ = agent.commands.try_send(pgwarden_agent::Command::Wake);
        }
        // A standby cluster's leader streams from elsewhere and takes no
        // writes.
        let standby = st
            .cluster
            .as_ref()
            .and_then(pgwarden_agent::record::standby_cluster)
            .is_some();
        let leader: Option<HostAddr> = st
            .leader
            .as_ref()
            .filter(|_| fresh && st.routing_ready && !standby)
            .and_then(|l| members.iter().find(|m| &m.state.name == l))
            .and_then(|m| m.pg_address.parse().ok());
        let new_gate = PrimaryGate::Leader(leader);
        if gate.as_ref() != Some(&new_gate) {
            match &new_gate {
                PrimaryGate::Leader(Some(a)) => {
                    tracing::info!(leader = %a, "routing writes to the leader")
                }
                _ if standby => {
                    tracing::info!("standby cluster: no writes are routed")
                }
                _ if !fresh => {
                    tracing::warn!("etcd silent for longer than the ttl: no writes are routed")
                }
                _ => tracing::warn!("no leader: no writes are routed"),
            }
            engine.set_primary_gate(new_gate.clone());
            engine.probe_now();
            gate = Some(new_gate);
        }
        let mut new_hosts = configured.borrow_and_update().clone();
        for m in &members {
            let Ok(addr) = m.pg_address.parse::<HostAddr>() else {
                continue;
            };
            let i = match new_hosts.iter().position(|h| h.addr == addr) {
                Some(i) => i,
                None => {
                    let mut h = HostConfig::new(addr);
                    h.application_name = Some(m.state.name.clone());
                    new_hosts.push(h);
                    new_hosts.len() - 1
                }
            };
            let tags = &mut new_hosts[i].tags;
            // A fenced member takes no read traffic either, from any
            // service (delayed, offline and standby too).
            let is_fenced = fenced.contains(&m.state.name);
            if (m.state.tags.noloadbalance || is_fenced)
                && !tags.iter().any(|t| t == "noloadbalance")
            {
                tags.push("noloadbalance".into());
            }
            if is_fenced && !tags.iter().any(|t| t == pgwarden_topology::FENCED_TAG) {
                tags.push(pgwarden_topology::FENCED_TAG.into());
            }
        }
        if hosts.as_ref() != Some(&new_hosts) {
            engine.set_hosts(new_hosts.clone());
            hosts = Some(new_hosts);
        }
        // A silent DCS produces no changes; re-check so the ttl is noticed.
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            r = changes.changed() => if r.is_err() {
                // The agent has stopped; nothing more to follow.
                return;
            },
            _ = configured.changed() => {}
        }
    }
}
