//! `pgwarden demo`: a local cluster behind pgwarden, for newcomers.

use std::path::PathBuf;

use anyhow::Context;
use pgwarden_pgctl::{ClusterSpec, LocalCluster, PgBinaries, RunAs};

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
        "probe:      pgwarden topology --watch --hosts {}",
        cluster.addrs().join(",")
    );
    // The connection manager in front of it, configured by the same kind of
    // file an operator writes, so the demo shows the real thing.
    let (rw, ro, http) = match args.port {
        Some(p) => (p + 1000, p + 1001, p + 1002),
        None => (free_port()?, free_port()?, free_port()?),
    };
    let hosts: Vec<String> = cluster.addrs().iter().map(|a| format!("\"{a}\"")).collect();
    let config_text = format!(
        "[cluster]\nhosts = [{}]\nuser = \"postgres\"\n\n[listen]\nread_write = \"127.0.0.1:{rw}\"\nread_only = \"127.0.0.1:{ro}\"\nhttp = \"127.0.0.1:{http}\"\n",
        hosts.join(", ")
    );
    let config_path = base.join("pgwarden.toml");
    std::fs::write(&config_path, &config_text)?;
    let config = pgwarden_config::load(&config_path)?;
    println!("read-write: psql \"host=127.0.0.1 port={rw} user=postgres\"");
    println!("read-only:  psql \"host=127.0.0.1 port={ro} user=postgres\"");
    println!("HTTP:       http://127.0.0.1:{http}/cluster  /metrics  /health");
    println!(
        "config:     {} (edit it and send SIGHUP to reload)",
        config_path.display()
    );
    let result = runtime.block_on(crate::run_cmd::serve(
        &config_path,
        config,
        !args.quiet,
        None,
    ));
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
