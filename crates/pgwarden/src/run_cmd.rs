//! `pgwarden run`: the connection manager in front of a cluster
//! (standalone mode: whatever manages the cluster).

use std::path::{Path, PathBuf};

use anyhow::Context;
use pgwarden_config::{ClientTls, ServerTls};
use pgwarden_config::{Config, PoolMode};
use pgwarden_probe::{Engine, ProbeConfig};
use pgwarden_proxy::{
    AuthSpec, ClientTlsMode, ConnLimits, PoolOverrides, PoolSettings, Proxy, ProxySpec,
    ServerTlsMode, ServiceSpec, TlsSpec,
};
use pgwarden_topology::{PrimaryGate, Want};
use std::sync::Arc;
use std::time::Duration;

/// Options of `pgwarden run`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The configuration file (TOML).
    #[arg(long, short, value_name = "FILE")]
    config: PathBuf,
    /// Check the file and every file it names (password, TLS, hba, auth),
    /// print what it sets up and exit, starting nothing: before a start
    /// or a SIGHUP.
    #[arg(long)]
    check: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let config = pgwarden_config::load(&args.config)?;
    crate::init_logging(Some(&config.log));
    if config.agent.is_some() {
        anyhow::bail!(
            "{}: this file has an [agent] section: start it with pgwarden agent (pgwarden run is the connection manager alone, for a cluster managed by something else)",
            args.config.display()
        );
    }
    if args.check {
        check(&args.config, &config)?;
        return Ok(());
    }
    let runtime = runtime(&config)?;
    let result = runtime.block_on(serve(&args.config, config, false, None));
    finish(runtime);
    result
}

/// Host names are case-insensitive: a reload that writes a running host's
/// name in another case keeps the running spelling, so that the host (its
/// sessions, pools, probe connection and metric series) goes on instead
/// of being replaced by a "new" one. A Unix-domain socket directory is a
/// path, whose case matters.
fn keep_host_spelling(new: &mut Config, running: &Config) {
    for h in &mut new.cluster.hosts {
        if h.addr.host.starts_with('/') {
            continue;
        }
        if let Some(old) =
            running.cluster.hosts.iter().find(|o| {
                o.addr.port == h.addr.port && o.addr.host.eq_ignore_ascii_case(&h.addr.host)
            })
        {
            h.addr = old.addr.clone();
        }
    }
}

/// Stops a runtime whose work is done. Dropping it would wait for every
/// blocking task, and one may be stuck for as long as the system lets it:
/// a name lookup on a resolver that does not answer, a callback script
/// that hangs. Those get a few seconds, then the process exits anyway.
pub fn finish(runtime: tokio::runtime::Runtime) {
    runtime.shutdown_timeout(Duration::from_secs(3));
}

/// `--check`: loads what starting would load from files, binds and
/// connects to nothing, and prints a summary on success.
pub fn check(path: &Path, config: &Config) -> anyhow::Result<()> {
    let probe = probe_config(config, path)?;
    pgwarden_proxy::check_spec(&proxy_spec(config, path, &probe)?)
        .with_context(|| format!("{}", path.display()))?;
    let services: Vec<String> = config
        .services()
        .iter()
        .map(|s| format!("{} on {}", s.name, s.listen))
        .collect();
    println!(
        "{}: configuration OK: {} host(s); {}; HTTP on {}",
        path.display(),
        config.cluster.hosts.len(),
        services.join(", "),
        config.listen.http
    );
    Ok(())
}

/// The control runtime: the topology engine, the listeners, the HTTP
/// port, reloads and (in agent mode) the HA loop. Client traffic runs on
/// the proxy's own worker threads (`engine.worker_threads`), so neither
/// waits for the other. Two threads, so that a slow control task (an etcd
/// call, a pg_ctl) never holds up the rest.
pub fn runtime(config: &Config) -> anyhow::Result<tokio::runtime::Runtime> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("pgwarden-control")
        // The HA loop's futures nest deeply (a switchover polls etcd and
        // PostgreSQL clients inside its steps); tokio's 2 MiB default is
        // tight for them in debug builds. Untouched stack costs nothing.
        .thread_stack_size(8 << 20)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    tracing::info!(
        worker_threads = config.engine.effective_worker_threads(cores),
        "starting"
    );
    Ok(runtime)
}

/// How `serve` starts the HA agent of agent mode, once the connection
/// manager's listeners are bound.
pub struct AgentStart {
    /// Connects to etcd (retrying until it answers) and starts the agent.
    pub start: std::pin::Pin<
        Box<dyn std::future::Future<Output = anyhow::Result<pgwarden_agent::AgentHandle>> + Send>,
    >,
    /// The REST API's credentials from the file, which guard the HTTP
    /// port's pause and resume until the agent, which reloads them, runs.
    pub api_credentials: Option<(String, String)>,
}

/// Runs the topology engine and the connection manager until SIGINT or
/// SIGTERM, reloading `path` on SIGHUP. With `print_rounds`, the topology
/// table is printed after every probe round (the demo).
///
/// With an `agent` (agent mode), writes go only to the member holding the
/// leader key, and the other members' servers join the host list as they
/// publish themselves.
pub async fn serve(
    path: &Path,
    config: Config,
    print_rounds: bool,
    agent: Option<AgentStart>,
) -> anyhow::Result<()> {
    // Registered before anything else: until then SIGHUP would end the
    // process (a reload sent while etcd is still unreachable, say), and a
    // service manager counts that as a clean exit.
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    // One caught before this listened, while the files were read: they
    // are read again once running. Taken now, so that a hang-up from here
    // on (which the start-up catcher, chained, also notes) reloads once.
    let mut early = crate::early_hangup();
    let mut stop = std::pin::pin!(crate::shutdown_signal()?);
    let probe = probe_config(&config, path)?;
    let engine = Arc::new(Engine::start(
        config.cluster.host_configs(),
        config.cluster.topology_config(),
        probe.clone(),
    ));
    let (configured_hosts, configured_rx) =
        tokio::sync::watch::channel(config.cluster.host_configs());
    if agent.is_some() {
        // Closed until the first DCS read names a leader.
        engine.set_primary_gate(PrimaryGate::Leader(None));
    }
    if print_rounds {
        let mut rounds = engine.rounds();
        let snapshots = engine.snapshot_handle();
        tokio::spawn(async move {
            while rounds.changed().await.is_ok() {
                let snap = snapshots.load_full();
                println!(
                    "{}",
                    pgwarden_topology::view::TopologyView::new(&snap.topology, snap.round)
                        .to_table()
                );
            }
        });
    }
    warn_unimplemented(&config);
    let mut proxy = Proxy::start(
        proxy_spec(&config, path, &probe)?,
        engine.snapshot_handle(),
        engine.changes(),
    )
    .await?;
    // The listeners are bound before the HA agent starts: a port in use
    // then stops the node before it takes part in the cluster, not after
    // it took the leader key.
    let agent = match agent {
        None => None,
        Some(AgentStart {
            start,
            api_credentials,
        }) => {
            // Other members' agents pause this node's pools around a
            // switchover with the API credentials; anyone else needs
            // them too, from the start.
            proxy.set_http_credentials(Arc::new(move || api_credentials.clone()));
            let admin_shutdown = proxy.shutdown_requests();
            let handle = tokio::select! {
                h = start => match h {
                    Ok(h) => h,
                    Err(e) => {
                        drain(proxy, config.engine.shutdown_timeout).await?;
                        return Err(e);
                    }
                },
                _ = &mut stop => {
                    drain(proxy, config.engine.shutdown_timeout).await?;
                    return Ok(());
                }
                _ = admin_shutdown.notified() => {
                    tracing::info!("admin console: SHUTDOWN");
                    drain(proxy, config.engine.shutdown_timeout).await?;
                    return Ok(());
                }
            };
            tokio::spawn(crate::agent_cmd::follow_leader(
                handle.clone(),
                engine.clone(),
                configured_rx,
            ));
            let credentials = handle.api_credentials.clone();
            proxy.set_http_credentials(Arc::new(move || credentials.get()));
            Some(handle)
        }
    };
    if let (Some(agent), Some(a)) = (&agent, &config.agent) {
        if a.on_sync_blocked == pgwarden_config::OnSyncBlocked::Reject {
            tokio::spawn(crate::agent_cmd::refuse_writes_while_blocked(
                agent.clone(),
                proxy.refusal_switch(),
            ));
        }
    }
    let mut admin_reload = proxy
        .reload_requests()
        .expect("the reload requests are taken once, here");
    let admin_shutdown = proxy.shutdown_requests();
    // What a restart would change is compared with the start's values, so
    // that every reload says it again until the restart.
    let started = config.clone();
    // The etcd settings in force: a reload that could not reconnect
    // leaves them, and the next one tries again.
    let mut applied_etcd = config.etcd.clone();
    let mut running = config;
    let mut running_probe = probe;
    let mut failure = None;
    loop {
        tokio::select! {
            reply = async {
                if std::mem::take(&mut early) {
                    return None;
                }
                tokio::select! {
                    _ = hangup.recv() => None,
                    r = admin_reload.recv() => r,
                }
            } => {
                // Every file the start would load (passwords, certificates,
                // the hba file) is loaded before anything changes: a reload
                // takes effect whole or not at all.
                let loaded = pgwarden_config::load(path)
                    .map_err(anyhow::Error::from)
                    .and_then(|mut new| {
                        keep_host_spelling(&mut new, &running);
                        if new.agent.is_some() != running.agent.is_some() {
                            anyhow::bail!(
                                "{}: adding or removing the [agent] section takes a restart (pgwarden agent, or pgwarden run for standalone mode)",
                                path.display()
                            );
                        }
                        let probe = probe_config(&new, path)?;
                        let spec = proxy_spec(&new, path, &probe)?;
                        pgwarden_proxy::check_spec(&spec)
                            .with_context(|| format!("{}", path.display()))?;
                        // The agent's files too (the API's password and
                        // certificates, etcd's), as `agent --check` reads
                        // them: a bad one rejects the reload before
                        // anything of it is applied.
                        let credentials = match (&new.agent, &new.etcd) {
                            (Some(a), Some(e)) => {
                                pgwarden_agent::check_files(
                                    &crate::agent_cmd::agent_files_resolved(a, path),
                                    &crate::agent_cmd::etcd_files_resolved(e, path),
                                )
                                .with_context(|| format!("{}", path.display()))?;
                                Some(crate::agent_cmd::api_credentials(a, path)?)
                            }
                            _ => None,
                        };
                        Ok((new, probe, spec, credentials))
                    });
                // What the admin console's RELOAD answers.
                // The connection manager's listeners are bound first: a new
                // address that cannot be bound rejects the whole reload.
                let loaded = match loaded {
                    Ok((new, probe, spec, credentials)) => match proxy.apply(spec).await {
                        Ok(()) => Ok((new, probe, credentials)),
                        // Bound after everything else is applied (its
                        // path follows the ports): the rest stands, and
                        // the old socket still serves.
                        Err(e @ pgwarden_proxy::ProxyError::BindUnix { .. }) => {
                            tracing::error!(error = %e, "a Unix-domain socket could not be bound; the old one stays, the rest of the configuration is reloaded");
                            Ok((new, probe, credentials))
                        }
                        Err(e) => Err(anyhow::Error::from(e)),
                    },
                    Err(e) => Err(e),
                };
                let outcome: Result<(), String> = match loaded {
                    Ok((new, new_probe, credentials)) => {
                        if new_probe != running_probe {
                            tracing::info!("probe settings changed: the probe reconnects with them now; server connections opened from now on use a changed password");
                            engine.set_probe_config(new_probe.clone());
                        }
                        if new.engine.worker_threads != started.engine.worker_threads
                            || new.engine.worker_fill != started.engine.worker_fill
                            || new.engine.pool_affinity != started.engine.pool_affinity
                        {
                            tracing::warn!("engine.worker_threads, worker_fill and pool_affinity take effect at the next restart");
                        }
                        if new.log != started.log {
                            tracing::warn!("log.level and log.format take effect at the next restart");
                        }
                        if let (Some(handle), Some(old), Some(fresh)) = (&agent, &started.agent, &new.agent) {
                            if let Some(c) = credentials {
                                if handle.api_credentials.set(c) {
                                    tracing::info!("REST API credentials reloaded");
                                }
                            }
                            match handle.reload_api_tls() {
                                Ok(true) => tracing::info!("REST API certificates reloaded"),
                                Ok(false) => {}
                                Err(e) => tracing::error!("REST API certificates not reloaded, the old ones stay: {e}"),
                            }
                            let mut pending = pgwarden_agent::restart_needed(old, fresh);
                            // The other members pause this node's pools at
                            // the address published at the start.
                            if fresh.proxy_url.is_none() && new.listen.http != started.listen.http {
                                pending.push("listen.http (where the other members pause this node's pools; or set agent.proxy_url)");
                            }
                            if !pending.is_empty() {
                                tracing::warn!(keys = %pending.join(", "), "changed settings that take effect at the next restart of the agent (the others are reloaded; the API's certificate files are read again, at the same paths)");
                            }
                            if let (Some(old_etcd), Some(new_etcd)) = (applied_etcd.clone(), &new.etcd) {
                                // Endpoints, credentials and TLS are
                                // reloaded whatever else changed.
                                let (wanted, held) = pgwarden_agent::etcd_reloadable(&old_etcd, new_etcd);
                                if !held.is_empty() {
                                    tracing::warn!(keys = %held.join(", "), "take effect at the next restart; the other etcd settings are reloaded");
                                }
                                let files = wanted.ca_file.is_some() || wanted.password_file.is_some();
                                if wanted != old_etcd || files {
                                    // Also unchanged, for renewed certificate and password files.
                                    let resolved = crate::agent_cmd::etcd_files_resolved(&wanted, path);
                                    match handle.reconnect_etcd(&resolved).await {
                                        Ok(()) => {
                                            tracing::info!(endpoints = ?resolved.endpoints, "etcd connection reloaded");
                                            applied_etcd = Some(wanted);
                                        }
                                        Err(e) => tracing::error!("etcd settings not reloaded, the old connection stays (a later reload tries again): {e}"),
                                    }
                                }
                            }
                            let _ = handle
                                .commands
                                .send(pgwarden_agent::Command::Reconfigure(Box::new(fresh.clone())))
                                .await;
                        }
                        if agent.is_some() {
                            // The router merges them with the members from etcd.
                            let _ = configured_hosts.send(new.cluster.host_configs());
                        } else {
                            engine.set_hosts(new.cluster.host_configs());
                        }
                        engine.set_topology_config(new.cluster.topology_config());
                        warn_unimplemented(&new);
                        tracing::info!(file = %path.display(), "configuration reloaded");
                        running = new;
                        running_probe = new_probe;
                        Ok(())
                    }
                    Err(e) => {
                        tracing::error!("reload rejected, the running configuration stays: {e:#}");
                        Err(format!("configuration not reloaded, the running one stays: {e:#}"))
                    }
                };
                if let Some(reply) = reply {
                    let _ = reply.send(outcome);
                }
            }
            why = async {
                match &agent {
                    Some(a) => a.failure().await,
                    None => std::future::pending().await,
                }
            } => {
                failure = Some(why);
                break;
            }
            _ = &mut stop => break,
            _ = admin_shutdown.notified() => {
                tracing::info!("admin console: SHUTDOWN");
                break;
            }
        }
    }
    // Nothing reloads from here on: an admin console's RELOAD is answered
    // at once rather than left waiting through the shutdown.
    drop(admin_reload);
    drain(proxy, running.engine.shutdown_timeout).await?;
    if let Some(agent) = agent {
        agent.shutdown(Duration::from_secs(90)).await;
    }
    match failure {
        Some(why) => Err(anyhow::anyhow!("the HA agent gave up: {why}")),
        None => Ok(()),
    }
}

/// Stops accepting and lets sessions finish for up to `timeout`; a second
/// SIGINT or SIGTERM ends them at once. Once a signal is caught, the
/// process no longer dies of the next one: without this, an operator's
/// second Ctrl-C would be swallowed for the whole time-out.
async fn drain(proxy: pgwarden_proxy::Proxy, timeout: Duration) -> anyhow::Result<()> {
    tracing::info!(?timeout, "shutting down: no new connections, waiting for sessions (a second SIGINT or SIGTERM ends them now)");
    let again = crate::shutdown_signal()?;
    proxy
        .shutdown_unless(async {
            again.await;
            tracing::warn!("second signal: ending the sessions now");
        })
        .await;
    Ok(())
}

fn warn_unimplemented(config: &Config) {
    let transaction = config
        .services()
        .iter()
        .any(|s| s.pool_mode == PoolMode::Transaction)
        || config.pool.reuse_session_servers;
    if transaction && config.auth.is_none() {
        tracing::warn!("pooling (transaction pooling, or reuse_session_servers) authenticates clients as 'trust' until [auth] is configured: keep the pooled ports on trusted networks");
    }
    if config.tls.client_ca.is_some() && config.auth.is_none() {
        tracing::warn!("tls.client_ca is set without [auth]: client certificates are verified in the handshake, but only pgwarden's pg_hba.conf rules use them");
    }
}

/// Relative paths in the configuration are relative to its file.
fn config_dir(path: &Path) -> &Path {
    path.parent().unwrap_or(Path::new("."))
}

/// SHOW CONFIG's rows: each setting in force, with the value it has when
/// the file does not set it (`""` where there is none, such as a service of
/// the file's own), pgwarden's keys first, then PgBouncer's names for the
/// settings that have a PgBouncer counterpart, in PgBouncer's units
/// (seconds, 0 for off), for tools that read those.
fn config_rows(config: &Config) -> Vec<(String, String, String)> {
    // The defaults a file naming only these hosts gets: derived values
    // (the listen ports) follow the hosts.
    let hosts = config
        .cluster
        .hosts
        .iter()
        .map(|h| format!("{:?}", h.addr.to_string()))
        .collect::<Vec<_>>()
        .join(", ");
    let defaults =
        pgwarden_config::parse(&format!("[cluster]\nhosts = [{hosts}]\n"), "defaults").ok();
    let default_of: std::collections::HashMap<String, String> = defaults
        .as_ref()
        .map(|d| settings_view(d).into_iter().collect())
        .unwrap_or_default();
    let mut rows: Vec<(String, String, String)> = settings_view(config)
        .into_iter()
        .map(|(k, v)| {
            let d = default_of.get(&k).cloned().unwrap_or_default();
            (k, v, d)
        })
        .collect();
    let bouncer_default: std::collections::HashMap<&str, String> = defaults
        .as_ref()
        .map(|d| pgbouncer_view(&d.pool).into_iter().collect())
        .unwrap_or_default();
    rows.extend(pgbouncer_view(&config.pool).into_iter().map(|(k, v)| {
        let d = bouncer_default.get(k).cloned().unwrap_or_default();
        (k.to_string(), v, d)
    }));
    rows
}

/// The pool settings under PgBouncer's names and in its units.
fn pgbouncer_view(p: &pgwarden_config::PoolConfig) -> Vec<(&'static str, String)> {
    let secs = |d: Duration| {
        if d.subsec_nanos() == 0 {
            d.as_secs().to_string()
        } else {
            let s = format!("{:.3}", d.as_secs_f64());
            let s = s.trim_end_matches('0').trim_end_matches('.');
            if s == "0" {
                // Less than a millisecond, which is not off.
                "0.001".to_string()
            } else {
                s.to_string()
            }
        }
    };
    let off = |d: Option<Duration>| d.map_or("0".to_string(), secs);
    vec![
        ("pool_mode", p.mode.to_string()),
        ("default_pool_size", p.size.to_string()),
        ("min_pool_size", p.min_size.to_string()),
        ("reserve_pool_size", p.reserve_size.to_string()),
        ("reserve_pool_timeout", secs(p.reserve_timeout)),
        ("max_client_conn", p.max_client_conn.to_string()),
        ("max_db_connections", p.max_db_connections.to_string()),
        ("max_user_connections", p.max_user_connections.to_string()),
        (
            "max_prepared_statements",
            p.max_prepared_statements.to_string(),
        ),
        ("server_idle_timeout", off(p.server_idle_timeout)),
        ("server_lifetime", off(p.server_lifetime)),
        ("query_wait_timeout", off(p.query_wait_timeout)),
        ("client_idle_timeout", off(p.client_idle_timeout)),
        ("idle_transaction_timeout", off(p.idle_transaction_timeout)),
        ("stats_period", secs(p.stats_period)),
    ]
}

/// The effective settings under pgwarden's keys.
fn settings_view(config: &Config) -> Vec<(String, String)> {
    let d = |v: Option<Duration>| v.map_or("0".to_string(), pgwarden_config::format_duration);
    let c = &config.cluster;
    let p = &config.pool;
    let mut v = vec![
        (
            "cluster.hosts",
            c.hosts
                .iter()
                .map(|h| h.addr.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ),
        ("cluster.user", c.user.clone()),
        (
            "cluster.probe_interval",
            pgwarden_config::format_duration(c.probe_interval),
        ),
        (
            "cluster.rtt_threshold",
            pgwarden_config::format_duration(c.rtt_threshold),
        ),
        (
            "cluster.rtt_threshold_enabled",
            c.rtt_threshold_enabled.to_string(),
        ),
        ("pool.mode", p.mode.to_string()),
        ("pool.size", p.size.to_string()),
        ("pool.max_client_conn", p.max_client_conn.to_string()),
        (
            "pool.max_prepared_statements",
            p.max_prepared_statements.to_string(),
        ),
        (
            "pool.reuse_session_servers",
            p.reuse_session_servers.to_string(),
        ),
        ("pool.query_wait_timeout", d(p.query_wait_timeout)),
        ("pool.server_idle_timeout", d(p.server_idle_timeout)),
        ("pool.server_lifetime", d(p.server_lifetime)),
        ("pool.min_size", p.min_size.to_string()),
        ("pool.reserve_size", p.reserve_size.to_string()),
        ("pool.max_db_connections", p.max_db_connections.to_string()),
        (
            "pool.max_user_connections",
            p.max_user_connections.to_string(),
        ),
        (
            "pool.reserve_timeout",
            pgwarden_config::format_duration(p.reserve_timeout),
        ),
        ("pool.client_idle_timeout", d(p.client_idle_timeout)),
        (
            "pool.stats_period",
            pgwarden_config::format_duration(p.stats_period),
        ),
        (
            "pool.idle_transaction_timeout",
            d(p.idle_transaction_timeout),
        ),
        (
            "engine.connect_wait_timeout",
            pgwarden_config::format_duration(config.engine.connect_wait_timeout),
        ),
        (
            "engine.shutdown_timeout",
            pgwarden_config::format_duration(config.engine.shutdown_timeout),
        ),
        (
            "engine.worker_threads",
            config
                .engine
                .effective_worker_threads(
                    std::thread::available_parallelism().map_or(1, |n| n.get()),
                )
                .to_string(),
        ),
        ("engine.worker_fill", config.engine.worker_fill.to_string()),
        (
            "engine.pool_affinity",
            config.engine.pool_affinity.to_string(),
        ),
        (
            "engine.tcp_keepalives_idle",
            d(config.engine.tcp.keepalives_idle),
        ),
        (
            "engine.tcp_keepalives_interval",
            d(config.engine.tcp.keepalives_interval),
        ),
        (
            "engine.tcp_keepalives_count",
            config.engine.tcp.keepalives_count.unwrap_or(0).to_string(),
        ),
        ("engine.tcp_user_timeout", d(config.engine.tcp.user_timeout)),
    ];
    let path = |p: &Option<std::path::PathBuf>| {
        p.as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    };
    v.push(("tls.cert", path(&config.tls.cert)));
    v.push(("tls.client_ca", path(&config.tls.client_ca)));
    if let Some(a) = &config.auth {
        v.push(("auth.hba_file", a.hba_file.display().to_string()));
        v.push(("auth.auth_user", a.auth_user.clone()));
    }
    let mut v: Vec<(String, String)> = v.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    for s in config.services() {
        v.push((
            format!("services.{}", s.name),
            format!(
                "listen={} select={} read_only={} pool_mode={}",
                s.listen, s.kind, s.read_only, s.pool_mode
            ),
        ));
    }
    v
}

/// Probe settings from the `[cluster]` section; the password from the
/// config, the file (relative to the configuration file's directory
/// `config_dir`, like the other files it names), `PGPASSWORD`, or else
/// `~/.pgpass`, looked up for each host as libpq does. A password file
/// that cannot be read is an error.
pub fn probe_config(config: &Config, config_path: &Path) -> anyhow::Result<ProbeConfig> {
    let c = &config.cluster;
    let password = password(
        c.password.as_ref(),
        c.password_file.as_deref(),
        "cluster.password_file",
        "PGPASSWORD",
        config_path,
    )?;
    Ok(ProbeConfig {
        user: c.user.clone(),
        dbname: c.dbname.clone(),
        password,
        pgpass: true,
        interval: c.probe_interval,
        connect_timeout: c.connect_timeout,
        query_timeout: c.query_timeout,
        ..ProbeConfig::default()
    })
}

/// A password given outright, else read from its `file` (relative to the
/// directory of the configuration file at `config_path`; one that cannot
/// be read is an error naming that file and `key`), else from the
/// environment variable `env`.
fn password(
    given: Option<&String>,
    file: Option<&Path>,
    key: &str,
    env: &str,
    config_path: &Path,
) -> anyhow::Result<Option<String>> {
    Ok(match (given, file) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(file)) => {
            let file = config_dir(config_path).join(file);
            Some(
                std::fs::read_to_string(&file)
                    .with_context(|| {
                        format!("{}: {key}: {}", config_path.display(), file.display())
                    })?
                    .trim_end_matches(['\r', '\n'])
                    .to_string(),
            )
        }
        (None, None) => std::env::var(env).ok(),
    })
}

/// The proxy's services and ports from the configuration; server
/// connections log in with the probe's password.
pub fn proxy_spec(
    config: &Config,
    config_path: &Path,
    probe: &ProbeConfig,
) -> anyhow::Result<ProxySpec> {
    let config_dir = config_dir(config_path);
    let auth_password = match config.auth.as_ref() {
        None => None,
        Some(a) => password(
            a.auth_password.as_ref(),
            a.auth_password_file.as_deref(),
            "auth.auth_password_file",
            "PGWARDEN_AUTH_PASSWORD",
            config_path,
        )?,
    };
    // A password given outright serves every server; otherwise each pool
    // finds its own line in the password file when it connects.
    let password = probe.password.clone();
    let p = &config.pool;
    let base = PoolSettings {
        size: p.size as usize,
        reserve_size: p.reserve_size as usize,
        reserve_timeout: p.reserve_timeout,
        // "Off" means: wait as long as it takes.
        query_wait_timeout: p
            .query_wait_timeout
            .unwrap_or(Duration::from_secs(365 * 86_400)),
        wants_primary: true,
        server_idle_timeout: p.server_idle_timeout,
        server_lifetime: p.server_lifetime,
        server_pgpass: password.is_none(),
        server_password: password,
        min_size: p.min_size as usize,
        client_idle_timeout: p.client_idle_timeout,
        idle_transaction_timeout: p.idle_transaction_timeout,
        max_prepared_statements: p.max_prepared_statements as usize,
        hold_session: false,
    };
    let exception = |o: &pgwarden_config::PoolOverride| {
        (
            o.mode.map(|m| m == PoolMode::Transaction),
            o.size.map(|s| s as usize),
        )
    };
    Ok(ProxySpec {
        services: config
            .services()
            .into_iter()
            .map(|s| ServiceSpec {
                pool: (s.pool_mode == PoolMode::Transaction).then(|| {
                    std::sync::Arc::new(PoolSettings {
                        wants_primary: s.want == Want::Primary,
                        ..base.clone()
                    })
                }),
                name: s.name,
                listen: s.listen,
                want: s.want,
                policy: s.policy,
                read_only: s.read_only,
                connect_wait_timeout: s.connect_wait_timeout,
                direct: s.direct,
            })
            .collect(),
        http: Some(config.listen.http),
        unix_socket_dir: config.listen.unix_socket_dir.clone(),
        server_connect_timeout: config.engine.server_connect_timeout,
        shutdown_timeout: config.engine.shutdown_timeout,
        tcp: {
            let t = config.engine.tcp;
            pgwarden_proxy::TcpTimings {
                keepalives_idle: t.keepalives_idle,
                keepalives_interval: t.keepalives_interval,
                keepalives_count: t.keepalives_count,
                user_timeout: t.user_timeout,
            }
        },
        max_client_conn: p.max_client_conn as usize,
        pool_affinity: config.engine.pool_affinity,
        worker_fill: config.engine.worker_fill,
        worker_threads: config
            .engine
            .effective_worker_threads(std::thread::available_parallelism().map_or(1, |n| n.get())),
        admin_users: p.admin_users.clone(),
        settings: config_rows(config),
        stats_period: p.stats_period,
        auth_timeout: config
            .auth
            .as_ref()
            .map_or(Duration::from_secs(60), |a| a.auth_timeout),
        auth: config.auth.as_ref().map(|a| AuthSpec {
            hba_file: config_dir.join(&a.hba_file),
            auth_user: a.auth_user.clone(),
            auth_password: auth_password.clone(),
            auth_dbname: a
                .auth_dbname
                .clone()
                .unwrap_or_else(|| config.cluster.dbname.clone()),
            auth_query: a.auth_query.clone(),
            cache_ttl: a.auth_cache_ttl,
        }),
        tls: match (&config.tls.cert, &config.tls.key) {
            (Some(cert), Some(key)) if config.tls.client_tls != ClientTls::Disable => {
                Some(TlsSpec {
                    cert: config_dir.join(cert),
                    key: config_dir.join(key),
                    mode: match config.tls.client_tls {
                        ClientTls::Require => ClientTlsMode::Require,
                        _ => ClientTlsMode::Allow,
                    },
                    client_ca: config.tls.client_ca.as_ref().map(|f| config_dir.join(f)),
                })
            }
            _ => None,
        },
        server_tls: match config.tls.server_tls {
            ServerTls::Disable => ServerTlsMode::Disable,
            ServerTls::Prefer => ServerTlsMode::Prefer,
            ServerTls::Require => ServerTlsMode::Require,
            ServerTls::VerifyCa => ServerTlsMode::VerifyCa,
            ServerTls::VerifyFull => ServerTlsMode::VerifyFull,
        },
        server_ca: config.tls.server_ca.as_ref().map(|f| config_dir.join(f)),
        pool_overrides: PoolOverrides {
            databases: p
                .databases
                .iter()
                .map(|(k, o)| (k.clone(), exception(o)))
                .collect(),
            users: p
                .users
                .iter()
                .map(|(k, o)| (k.clone(), exception(o)))
                .collect(),
            defaults: base,
            reuse_session_servers: p.reuse_session_servers,
            db_limits: limits(p.max_db_connections, &p.databases),
            user_limits: limits(p.max_user_connections, &p.users),
        },
    })
}

/// `pool.max_db_connections` or `pool.max_user_connections` with the
/// exceptions of one table.
fn limits(
    default: u32,
    table: &std::collections::BTreeMap<String, pgwarden_config::PoolOverride>,
) -> ConnLimits {
    ConnLimits {
        default: default as usize,
        by_name: table
            .iter()
            .filter_map(|(k, o)| Some((k.clone(), o.max_connections? as usize)))
            .collect(),
    }
}
