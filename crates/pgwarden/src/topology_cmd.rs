//! `pgwarden topology`: probe a cluster from the command line.

use std::time::Duration;

use anyhow::{bail, Context};
use pgwarden_probe::{Engine, ProbeConfig};
use pgwarden_topology::view::TopologyView;
use pgwarden_topology::{
    HostAddr, HostConfig, LagLimit, SelectPolicy, Selector, Strategy, TopologyConfig, Want,
};

/// Options of `pgwarden topology`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Hosts of the cluster, comma-separated `host:port` pairs.
    #[arg(long, value_delimiter = ',', required = true, value_name = "HOST:PORT")]
    hosts: Vec<String>,
    /// Role the probe logs in as.
    #[arg(long, env = "PGUSER", default_value = "postgres")]
    user: String,
    /// Database the probe connects to.
    #[arg(long, env = "PGDATABASE", default_value = "postgres")]
    dbname: String,
    /// Probe once (one round) and exit; the default.
    #[arg(long, conflicts_with = "watch")]
    once: bool,
    /// Print every round until interrupted.
    #[arg(long)]
    watch: bool,
    /// One JSON document per line per round instead of a table.
    #[arg(long)]
    json: bool,
    /// Time between probe rounds, in milliseconds.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    interval_ms: u64,
    /// Longest connection attempt, in milliseconds.
    #[arg(long, default_value_t = 2000, value_name = "MS")]
    connect_timeout_ms: u64,
    /// Longest probe query; past it the probe has failed.
    #[arg(long, default_value_t = 2000, value_name = "MS")]
    query_timeout_ms: u64,
    /// Print the hosts a selector picks for this role instead of the table.
    #[arg(long, value_name = "primary|replica|standby|delayed")]
    select: Option<Want>,
    /// Selection strategy.
    #[arg(
        long,
        default_value = "round-robin",
        value_name = "round-robin|nearest"
    )]
    strategy: Strategy,
    /// How many successive picks to print.
    #[arg(long, default_value_t = 1, value_name = "N")]
    count: usize,
    /// Probe rounds to run before selecting.
    #[arg(long, default_value_t = 3, value_name = "K")]
    rounds: u64,
    /// RTT window above the fastest host, in milliseconds.
    #[arg(long, default_value_t = 20.0, value_name = "MS", value_parser = milliseconds)]
    rtt_threshold_ms: f64,
    /// Turn the RTT window off: rotate over every eligible host.
    #[arg(long)]
    no_rtt_threshold: bool,
    /// Do not fall back to the primary when no replica is eligible.
    #[arg(long)]
    no_fallback: bool,
    /// Skip replicas more than this many bytes behind.
    #[arg(long, value_name = "BYTES")]
    max_lag_bytes: Option<u64>,
    /// Skip replicas whose replay is more than this far behind.
    #[arg(long, value_name = "MS")]
    max_lag_ms: Option<u64>,
    /// How long a lagging replica must stay within the limit to come back.
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    lag_hold_ms: u64,
    /// Doubtful probe failures (time-outs, broken connections) in a row
    /// before a host that was up counts as down; refused connections and
    /// a server shutting down count at once.
    #[arg(long, default_value_t = 3, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    down_after_failures: u32,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let hosts = args
        .hosts
        .iter()
        .map(|h| {
            h.parse::<HostAddr>()
                .map(HostConfig::new)
                .with_context(|| format!("--hosts: {h:?}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if !(args.rtt_threshold_ms >= 0.0 && args.rtt_threshold_ms.is_finite()) {
        bail!("--rtt-threshold-ms must be a number >= 0");
    }
    // Zero would make every probe fail at once and show every host dead.
    for (flag, v) in [
        ("--interval-ms", args.interval_ms),
        ("--connect-timeout-ms", args.connect_timeout_ms),
        ("--query-timeout-ms", args.query_timeout_ms),
    ] {
        if v == 0 {
            bail!("{flag} must be > 0");
        }
    }
    let max_replica_lag =
        (args.max_lag_bytes.is_some() || args.max_lag_ms.is_some()).then(|| LagLimit {
            bytes: args.max_lag_bytes,
            time: args.max_lag_ms.map(Duration::from_millis),
        });
    let topo_cfg = TopologyConfig {
        max_replica_lag,
        lag_hold: Duration::from_millis(args.lag_hold_ms),
        down_after_failures: args.down_after_failures,
    };
    // Without PGPASSWORD, each host's own password file entry, as libpq.
    let password = std::env::var("PGPASSWORD").ok();
    let probe_cfg = ProbeConfig {
        user: args.user.clone(),
        dbname: args.dbname.clone(),
        password,
        pgpass: true,
        interval: Duration::from_millis(args.interval_ms),
        connect_timeout: Duration::from_millis(args.connect_timeout_ms),
        query_timeout: Duration::from_millis(args.query_timeout_ms),
        ..ProbeConfig::default()
    };
    let engine = Engine::start(hosts, topo_cfg, probe_cfg);

    if let Some(want) = &args.select {
        engine.wait_round(args.rounds.max(1)).await;
        every_host_answered(&engine).await;
        let policy = SelectPolicy {
            strategy: args.strategy,
            rtt_threshold: Duration::from_secs_f64(args.rtt_threshold_ms / 1000.0),
            rtt_threshold_enabled: !args.no_rtt_threshold,
            fallback_to_primary: !args.no_fallback,
        };
        let selector = Selector::new(policy);
        let snap = engine.snapshot();
        let mut failed = false;
        for _ in 0..args.count {
            match selector.select(&snap.topology, want) {
                Ok(i) => println!("{}", snap.topology.hosts()[i].config.addr),
                Err(e) => {
                    println!("none: {e}");
                    failed = true;
                }
            }
        }
        if failed {
            bail!("no host to select");
        }
        return Ok(());
    }

    let mut rounds = engine.rounds();
    // Listening from here on, not only while the loop waits: a signal
    // that arrives while another branch runs is not lost.
    let mut stop = std::pin::pin!(crate::shutdown_signal()?);
    loop {
        tokio::select! {
            changed = rounds.changed() => {
                if changed.is_err() {
                    bail!("the topology engine stopped");
                }
            }
            _ = &mut stop => return Ok(()),
        }
        if !args.watch {
            // One answer: a host whose probe outlasted the first round
            // (a slow login) is waited for, not shown as unknown.
            every_host_answered(&engine).await;
        }
        let snap = engine.snapshot();
        let view = TopologyView::new(&snap.topology, snap.round);
        if args.json {
            println!("{}", serde_json::to_string(&view)?);
        } else {
            println!("{}", view.to_table());
        }
        if !args.watch {
            return Ok(());
        }
    }
}

/// Waits until every host has answered its probe or failed it (each probe
/// is bounded by the connect and query time-outs).
async fn every_host_answered(engine: &Engine) {
    let mut changes = engine.changes();
    loop {
        let snap = engine.snapshot();
        if snap
            .topology
            .hosts()
            .iter()
            .all(|h| h.alive || h.error.is_some())
        {
            return;
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// A number of milliseconds for a duration: finite and not negative (and
/// below a century), so that it makes a `Duration`.
fn milliseconds(text: &str) -> Result<f64, String> {
    let ms: f64 = text.parse().map_err(|e| format!("{e}"))?;
    if !ms.is_finite() || !(0.0..=3.2e12).contains(&ms) {
        return Err(format!(
            "{text} is not a number of milliseconds from 0 to 3.2e12"
        ));
    }
    Ok(ms)
}
