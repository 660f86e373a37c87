//! `pgwarden demo`: a local cluster behind pgwarden, for newcomers.

use std::path::PathBuf;

use anyhow::Context;
use pgwarden_pgctl::{ClusterSpec, LocalCluster, PgBinaries, RunAs};
use pgwarden_probe::{Engine, ProbeConfig};
use pgwarden_topology::view::TopologyView;
use pgwarden_topology::{HostAddr, HostConfig, TopologyConfig};

/// Options of `pgwarden demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory for the data directories (default: a new temporary one,
    /// removed on exit).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Number of streaming replicas.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Port of the primary; replicas take the next ones (default: free
    /// ports chosen by the OS).
    #[arg(long)]
    port: Option<u16>,
    /// Start the cluster and wait for Ctrl-C without printing the topology.
    #[arg(long)]
    quiet: bool,
}

pub fn run(args: Args, runtime: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    let bins = PgBinaries::discover()?;
    let run_as = RunAs::unprivileged()?;
    let (base, _tmp) = match &args.dir {
        Some(d) => (d.clone(), None),
        None => {
            let t = tempfile::Builder::new()
                .prefix("pgwarden-demo-")
                .tempdir()?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let ports: Vec<u16> = match args.port {
        Some(p) => (0..=args.replicas as u16).map(|i| p + i).collect(),
        None => (0..=args.replicas)
            .map(|_| free_port())
            .collect::<anyhow::Result<_>>()?,
    };
    eprintln!(
        "starting a primary and {} replicas under {}",
        args.replicas,
        base.display()
    );
    let mut spec = ClusterSpec::new(base.join("cluster"), ports);
    spec.die_with_parent = true;
    let mut cluster =
        LocalCluster::start(spec, &bins, &run_as).context("starting the demo cluster")?;
    for n in cluster.nodes() {
        println!(
            "{:<6} psql -h {} -p {} -U postgres",
            n.name(),
            n.host(),
            n.port()
        );
    }
    println!(
        "probing with: pgwarden topology --watch --hosts {}",
        cluster.addrs().join(",")
    );
    let hosts = cluster
        .addrs()
        .iter()
        .map(|a| a.parse::<HostAddr>().map(HostConfig::new))
        .collect::<Result<Vec<_>, _>>()?;
    let quiet = args.quiet;
    let result = runtime.block_on(async move {
        let engine = Engine::start(hosts, TopologyConfig::default(), ProbeConfig::default());
        let mut rounds = engine.rounds();
        loop {
            tokio::select! {
                _ = crate::shutdown_signal() => break,
                r = rounds.changed() => if r.is_err() { break },
            }
            if !quiet {
                let snap = engine.snapshot();
                println!(
                    "{}",
                    TopologyView::new(&snap.topology, snap.round).to_table()
                );
            }
        }
        anyhow::Ok(())
    });
    eprintln!("stopping the demo cluster");
    cluster.stop_all()?;
    drop(cluster);
    result
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
