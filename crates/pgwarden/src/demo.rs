//! `pgwarden demo`: a local cluster behind pgwarden, for newcomers.
//!
//! By default an HA cluster: a local etcd and three `pgwarden agent`
//! processes (`--replicas` + 1), each managing its own PostgreSQL and serving its own
//! connection manager, so a newcomer can kill the primary and watch the
//! failover. `--standalone` runs the connection manager in front of a
//! plain streaming cluster instead (what the benchmarks use).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use pgwarden_pgctl::{ClusterSpec, LocalCluster, PgBinaries, RunAs};

/// Options of `pgwarden demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory for the data directories (default: a new temporary one,
    /// removed on exit).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Number of streaming replicas (with agents: nodes besides the first).
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Port of the first PostgreSQL; the others take the next ones. The
    /// connection manager's ports follow from it (PORT+1000, +1001, +1002;
    /// with agents, node i's at PORT+1000+3i..), and the agents' APIs take
    /// Patroni's 8008, 8009, 8010 and on. Default: free ports chosen by the
    /// OS.
    #[arg(long)]
    port: Option<u16>,
    /// Start the cluster and wait for Ctrl-C without printing the topology.
    #[arg(long)]
    quiet: bool,
    /// No HA agents: the connection manager in front of a primary and
    /// `--replicas` streaming replicas that nothing fails over.
    #[arg(long)]
    standalone: bool,
    /// The HA agents' recovery time target (`fast`, `norm`, or seconds).
    #[arg(long, default_value = "10")]
    rto: String,
}

pub fn run(args: Args, runtime: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    let stop = Interrupt::catch(runtime)?;
    if args.standalone {
        run_standalone(args, runtime, &stop)
    } else {
        run_ha(args, runtime, &stop)
    }
}

/// Ctrl-C or SIGTERM, caught from the demo's first step: the default
/// action would kill the process in the middle of starting the cluster,
/// before anything stops its servers or removes its directory. The
/// start-up steps look at it and give up, which runs the cleanup.
struct Interrupt(tokio::sync::watch::Receiver<bool>);

impl Interrupt {
    fn catch(runtime: &tokio::runtime::Runtime) -> anyhow::Result<Interrupt> {
        let signal = runtime.block_on(async { crate::shutdown_signal() })?;
        let (tx, rx) = tokio::sync::watch::channel(false);
        runtime.spawn(async move {
            signal.await;
            let _ = tx.send(true);
        });
        Ok(Interrupt(rx))
    }

    /// An error once a stop was asked for.
    fn check(&self) -> anyhow::Result<()> {
        if *self.0.borrow() {
            anyhow::bail!("interrupted while starting the demo cluster");
        }
        Ok(())
    }

    /// Resolves once a stop is asked for.
    async fn asked(&self) {
        let _ = self.0.clone().wait_for(|s| *s).await;
    }
}

fn run_standalone(
    args: Args,
    runtime: &tokio::runtime::Runtime,
    stop: &Interrupt,
) -> anyhow::Result<()> {
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
    if let Err(e) = stop.check() {
        let _ = cluster.stop_all();
        return Err(e);
    }
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

/// One node of the HA demo.
struct DemoNode {
    name: String,
    data_dir: PathBuf,
    agent: Child,
}

/// Everything the HA demo started, stopped in reverse on drop: agents
/// (with what they run at that moment, `initdb` or `pg_basebackup`), then
/// their PostgreSQL servers (which outlive an agent by design), then etcd,
/// then the directory.
struct HaDemo {
    nodes: Vec<DemoNode>,
    etcd: Option<Child>,
    run_as: RunAs,
    bins: PgBinaries,
    /// The directory, when the demo made it: removed last.
    tmp: Option<tempfile::TempDir>,
}

impl Drop for HaDemo {
    fn drop(&mut self) {
        // What an agent runs at this moment (initdb, pg_basebackup) would
        // outlive it and write into the directory being removed: found
        // before the agents die, while they are still its parents. The
        // servers among them are left to the clean stop below.
        let agents: Vec<i32> = self.nodes.iter().map(|n| n.agent.id() as i32).collect();
        let spawned: Vec<i32> = descendants(&agents)
            .into_iter()
            .filter(|(_, name)| name != "postgres")
            .map(|(pid, _)| pid)
            .collect();
        for n in &mut self.nodes {
            let _ = n.agent.kill();
            let _ = n.agent.wait();
        }
        kill_and_wait(&spawned);
        for n in &self.nodes {
            let mut i = pgwarden_pgctl::Instance::new(
                pgwarden_pgctl::InstanceSpec::new(&n.name, &n.data_dir, 0),
                self.bins.clone(),
                self.run_as.clone(),
            );
            let _ = i.stop(pgwarden_pgctl::StopMode::Fast);
        }
        if let Some(mut e) = self.etcd.take() {
            let _ = e.kill();
            let _ = e.wait();
        }
        if let Some(tmp) = self.tmp.take() {
            let path = tmp.keep();
            // A process ending meanwhile may still create a file: again.
            for _ in 0..5 {
                if std::fs::remove_dir_all(&path).is_ok() || !path.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// Every process below `roots` (children, their children, ...), with its
/// name, from the parent links in `/proc`.
fn descendants(roots: &[i32]) -> Vec<(i32, String)> {
    let links: Vec<(i32, i32, String)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // "pid (comm) state ppid ...": comm may hold anything.
            let (head, rest) = stat.rsplit_once(')')?;
            let name = head.split_once('(')?.1.to_string();
            let ppid = rest.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid, name))
        })
        .collect();
    let mut found: Vec<(i32, String)> = Vec::new();
    let mut parents = roots.to_vec();
    while let Some(parent) = parents.pop() {
        for (pid, ppid, name) in &links {
            if *ppid == parent && !found.iter().any(|(p, _)| p == pid) {
                found.push((*pid, name.clone()));
                parents.push(*pid);
            }
        }
    }
    found
}

/// Whether `pid` runs (a zombie does not: an orphan waits for init to
/// reap it, which some containers' init never does).
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .is_some_and(|zombie| !zombie)
}

/// Kills `pids` and waits (up to 10 s) for them to be gone: orphans, so
/// init reaps them.
fn kill_and_wait(pids: &[i32]) {
    for &pid in pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until && pids.iter().any(|&p| running(p)) {
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run_ha(args: Args, runtime: &tokio::runtime::Runtime, stop: &Interrupt) -> anyhow::Result<()> {
    // A leader and the replicas asked for, each node under an agent.
    let nodes = args.replicas + 1;
    let bins = PgBinaries::discover()?;
    let run_as = RunAs::unprivileged()?;
    let etcd_bin = etcd_binary().context(
        "etcd not found: install Debian's etcd-server package (scripts/install-deps.sh does)",
    )?;
    let exe = std::env::current_exe().context("locating the pgwarden binary")?;
    let (base, tmp) = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            (d.clone(), None)
        }
        None => {
            let t = tempfile::Builder::new()
                .prefix("pgwarden-demo-")
                .tempdir()?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    // PostgreSQL runs as another user, who must reach its data directory.
    std::fs::set_permissions(&base, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let port = |i: u16, offset: u16| match args.port {
        Some(p) => Ok(p + i + offset),
        None => free_port(),
    };
    let (client, peer) = (free_port()?, free_port()?);
    let etcd_log = std::fs::File::create(base.join("etcd.log"))?;
    let mut cmd = Command::new(&etcd_bin);
    cmd.arg("--name")
        .arg("demo")
        .arg("--data-dir")
        .arg(base.join("etcd"))
        .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
        .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
        .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
        .arg(format!(
            "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
        ))
        .arg(format!("--initial-cluster=demo=http://127.0.0.1:{peer}"))
        .stdin(Stdio::null())
        .stdout(etcd_log.try_clone()?)
        .stderr(etcd_log);
    die_with_parent(&mut cmd);
    let mut demo = HaDemo {
        nodes: Vec::new(),
        etcd: Some(cmd.spawn().context("starting etcd")?),
        run_as,
        bins,
        tmp,
    };
    wait_for(stop, Duration::from_secs(30), "etcd", || {
        std::net::TcpStream::connect(("127.0.0.1", client)).is_ok()
    })?;
    eprintln!(
        "etcd on 127.0.0.1:{client}; starting {nodes} agents under {}",
        base.display()
    );
    let mut apis = Vec::new();
    for i in 0..nodes as u16 {
        stop.check()?;
        let name = format!("n{}", i + 1);
        let pg = port(i, 0)?;
        let (rw, ro, http) = match args.port {
            Some(p) => (p + 1000 + 3 * i, p + 1001 + 3 * i, p + 1002 + 3 * i),
            None => (free_port()?, free_port()?, free_port()?),
        };
        let api = match args.port {
            Some(_) => 8008 + i,
            None => free_port()?,
        };
        let data_dir = base.join(&name);
        let rto = if args.rto.parse::<f64>().is_ok() {
            args.rto.clone()
        } else {
            format!("\"{}\"", args.rto)
        };
        let config = format!(
            "[cluster]\nuser = \"postgres\"\n\n[listen]\nread_write = \"127.0.0.1:{rw}\"\nread_only = \"127.0.0.1:{ro}\"\nhttp = \"127.0.0.1:{http}\"\n\n\
             [agent]\nname = \"{name}\"\ndata_dir = \"{}\"\npg_listen = \"127.0.0.1:{pg}\"\napi = \"127.0.0.1:{api}\"\nrto = {rto}\napi_password = \"demo\"\n\n\
             [etcd]\nendpoints = [\"127.0.0.1:{client}\"]\ncluster = \"demo\"\n",
            data_dir.display()
        );
        let path = base.join(format!("{name}.toml"));
        std::fs::write(&path, config)?;
        // Validate now so a mistake shows here, not in an agent's log.
        pgwarden_config::load(&path)?;
        let log = std::fs::File::create(base.join(format!("{name}-agent.log")))?;
        let mut cmd = Command::new(&exe);
        cmd.arg("agent")
            .arg("--config")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        die_with_parent(&mut cmd);
        let agent = cmd.spawn().context("starting an agent")?;
        println!(
            "{name}: read-write psql \"host=127.0.0.1 port={rw} user=postgres\"   read-only port {ro}   HTTP http://127.0.0.1:{http}/cluster   API http://127.0.0.1:{api}   agent pid {}",
            agent.id()
        );
        apis.push(format!("http://127.0.0.1:{api}"));
        demo.nodes.push(DemoNode {
            name,
            data_dir,
            agent,
        });
        if i == 0 {
            // The first node creates the cluster; the others clone it.
            wait_for(stop, Duration::from_secs(60), "n1 to lead", || {
                http_status(&apis[0], "/primary") == Some(200)
            })?;
        }
    }
    println!("cluster:  pgwarden ctl --api {} list", apis[0]);
    println!(
        "failover: kill the leader's agent and PostgreSQL, e.g. for n1:\n          kill -9 {} $(head -1 {}/postmaster.pid)\n          then watch `pgwarden ctl --api {} list` (a replica takes over once the lease runs out)",
        demo.nodes[0].agent.id(),
        demo.nodes[0].data_dir.display(),
        apis[1]
    );
    println!(
        "logs:     {}/*-agent.log; Ctrl-C stops everything",
        base.display()
    );
    let quiet = args.quiet;
    let api_list = apis.clone();
    let result: anyhow::Result<()> = runtime.block_on(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        // Caught since the start: a signal that arrives while another
        // branch runs is not lost.
        let mut stop = std::pin::pin!(stop.asked());
        loop {
            tokio::select! {
                _ = &mut stop => return Ok(()),
                _ = tick.tick(), if !quiet => {
                    // Any member answers for the whole cluster.
                    for api in &api_list {
                        if let Ok(v) = pgwarden_agent::http_client::get_json(
                            &format!("{api}/cluster"),
                            Duration::from_secs(1),
                        )
                        .await
                        {
                            println!("{}", crate::ctl::render_list(&v));
                            break;
                        }
                    }
                }
            }
        }
    });
    eprintln!("stopping the demo cluster");
    drop(demo);
    result
}

fn wait_for(
    stop: &Interrupt,
    within: Duration,
    what: &str,
    mut ready: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let until = Instant::now() + within;
    while !ready() {
        stop.check()?;
        if Instant::now() > until {
            anyhow::bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn http_status(base: &str, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let addr = base.strip_prefix("http://")?;
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_whitespace().nth(1)?.parse().ok()
}

/// The etcd binary: `$PATH` first, then where Debian installs it.
fn etcd_binary() -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("etcd"))
        .chain([PathBuf::from("/usr/bin/etcd")])
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The demo's processes die with it, even when it is killed outright.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only makes the
    // async-signal-safe prctl system call.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                .map_err(std::io::Error::from)
        });
    }
}
