//! HA clusters for tests: a real etcd and one `pgwarden agent` process per
//! node, each managing its own PostgreSQL and serving its connection
//! manager, all on 127.0.0.1.
//!
//! The agents run as separate processes so that a test can kill one with
//! SIGKILL, as a node crash would, and its PostgreSQL outlives it exactly as
//! in production. Dropping the cluster kills the agents and every
//! postmaster of its data directories, and removes the directories.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::cluster::{free_port, sweep_leftovers, DIR_PREFIX};
use crate::etcd::{EtcdCluster, EtcdOptions, EtcdTls};
use crate::relay::Relay;

/// One node: its ports, files and agent process.
#[derive(Debug)]
pub struct AgentNode {
    /// Member name (`n1`, `n2`, ...).
    pub name: String,
    /// The PostgreSQL port.
    pub pg_port: u16,
    /// The agent's REST API port.
    pub api_port: u16,
    /// The connection manager's read-write port.
    pub rw_port: u16,
    /// The connection manager's read-only port.
    pub ro_port: u16,
    /// The connection manager's HTTP port.
    pub http_port: u16,
    /// The node's configuration file.
    pub config: PathBuf,
    /// The PostgreSQL data directory.
    pub data_dir: PathBuf,
    /// The agent's log (stdout and stderr).
    pub log: PathBuf,
    /// The REST API serves HTTPS.
    pub api_https: bool,
    /// Settings added to the file's `parameters`.
    pg_parameters: String,
    child: Option<Child>,
}

impl AgentNode {
    /// A libpq connection string straight to this node's PostgreSQL.
    pub fn pg_conninfo(&self) -> String {
        conninfo(self.pg_port)
    }

    /// A libpq connection string to this node's read-write port.
    pub fn rw_conninfo(&self) -> String {
        conninfo(self.rw_port)
    }

    /// A libpq connection string to this node's read-only port.
    pub fn ro_conninfo(&self) -> String {
        conninfo(self.ro_port)
    }

    /// The base URL of this node's REST API.
    pub fn api_url(&self) -> String {
        let scheme = if self.api_https { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.api_port)
    }

    /// The pid of this node's postmaster, if one runs.
    pub fn postmaster_pid(&self) -> Option<i32> {
        postmaster_pid(&self.data_dir)
    }

    /// Whether the agent process is alive.
    pub fn agent_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(Child::try_wait), Some(Ok(None)))
    }

    /// The agent's whole log.
    pub fn agent_log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last part of the agent's log and then of its PostgreSQL's log,
    /// for failure messages.
    pub fn log_tail(&self) -> String {
        let mut pg_log = self.data_dir.clone().into_os_string();
        pg_log.push(".log");
        format!(
            "{}----- postgres -----\n{}",
            tail(&self.log, 30000),
            tail(Path::new(&pg_log), 3000)
        )
    }
}

fn tail(path: &Path, max: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let start = text.len().saturating_sub(max);
    let start = (start..text.len())
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(0);
    text[start..].to_string()
}

fn conninfo(port: u16) -> String {
    format!("host=127.0.0.1 port={port} user=postgres dbname=postgres connect_timeout=3")
}

/// Builder of an [`AgentCluster`].
#[derive(Debug)]
pub struct AgentClusterBuilder {
    bin: PathBuf,
    nodes: usize,
    agent_toml: String,
    node_toml: Vec<(usize, String)>,
    etcd_relays: bool,
    tables: String,
    etcd_members: usize,
    held_back: Vec<usize>,
    etcd_tls: Option<(EtcdTls, Option<(PathBuf, PathBuf)>)>,
    etcd_auth: Option<(String, String)>,
    api_tls: Option<ApiTls>,
    pg_parameters: String,
}

/// The REST API over HTTPS: every node serves `cert_file` (which must name
/// 127.0.0.1) and trusts `ca_file`.
#[derive(Debug, Clone)]
pub struct ApiTls {
    /// PEM certificate.
    pub cert_file: PathBuf,
    /// Its private key.
    pub key_file: PathBuf,
    /// The CA that signed it.
    pub ca_file: PathBuf,
    /// `agent.api_verify_client`: `none`, `optional` or `required`; unless
    /// `none`, the kit presents `cert_file`.
    pub verify_client: &'static str,
}

impl AgentClusterBuilder {
    /// Number of nodes (default 3).
    pub fn nodes(mut self, n: usize) -> Self {
        self.nodes = n;
        self
    }

    /// Extra `[agent]` keys for every node, e.g. `"ttl = 6\nloop_wait = 1"`.
    pub fn agent_settings(mut self, toml: &str) -> Self {
        self.agent_toml.push_str(toml);
        self.agent_toml.push('\n');
        self
    }

    /// Extra `[agent]` keys for node `i` only, e.g. `"nofailover = true"`.
    pub fn node_settings(mut self, i: usize, toml: &str) -> Self {
        self.node_toml.push((i, toml.to_string()));
        self
    }

    /// PostgreSQL settings for every node, added to the file's
    /// `agent.parameters`, e.g. `wal_level = "logical"`.
    pub fn pg_parameters(mut self, toml: &str) -> Self {
        self.pg_parameters.push_str(", ");
        self.pg_parameters.push_str(toml);
        self
    }

    /// Extra tables for every node's file, e.g. `"[pool]\nmode = \"transaction\""`.
    pub fn tables(mut self, toml: &str) -> Self {
        self.tables.push_str(toml);
        self.tables.push('\n');
        self
    }

    /// Runs etcd with `n` members (default 1); every agent lists them all.
    pub fn etcd_members(mut self, n: usize) -> Self {
        self.etcd_members = n;
        self
    }

    /// Does not start node `i` with the others; the test starts it with
    /// [`AgentCluster::launch_held_back`], for instance to see a new
    /// cluster before its first replica joins. With node 0 held back no
    /// node starts: the cluster is not created until the test launches
    /// its nodes (after setting etcd up, say).
    pub fn hold_back(mut self, i: usize) -> Self {
        self.held_back.push(i);
        self
    }

    /// Runs etcd with TLS on its client port; the agents trust `tls.ca_file`
    /// and present `client` (certificate and key files), if given.
    pub fn etcd_tls(mut self, tls: EtcdTls, client: Option<(PathBuf, PathBuf)>) -> Self {
        self.etcd_tls = Some((tls, client));
        self
    }

    /// Enables etcd's authentication, with tokens that expire after 2 s;
    /// the agents log in as `user`, who may use the keys under
    /// `/pgwarden/` only.
    pub fn etcd_auth(mut self, user: &str, password: &str) -> Self {
        self.etcd_auth = Some((user.to_string(), password.to_string()));
        self
    }

    /// Serves every node's REST API over HTTPS.
    pub fn api_tls(mut self, tls: ApiTls) -> Self {
        self.api_tls = Some(tls);
        self
    }

    /// Puts a fault relay between each agent and etcd, so a test can cut
    /// one node off from etcd alone.
    pub fn etcd_relays(mut self) -> Self {
        self.etcd_relays = true;
        self
    }

    /// Starts etcd, writes each node's configuration and starts the agents:
    /// node 0 first and alone until it leads, so that tests know which
    /// node is the first primary; then the others, which clone it.
    pub fn start(self) -> AgentCluster {
        sweep_leftovers();
        let etcd = EtcdCluster::start_with(
            self.etcd_members,
            &EtcdOptions {
                tls: self.etcd_tls.as_ref().map(|(t, _)| t.clone()),
                // Tokens that expire within a test: the agents must log in
                // again.
                auth_token_ttl: self.etcd_auth.as_ref().map(|_| 2),
            },
        );
        let mut etcd_extra = String::new();
        if let Some((tls, client)) = &self.etcd_tls {
            let _ = writeln!(
                etcd_extra,
                "ca_file = {:?}",
                tls.ca_file.display().to_string()
            );
            if let Some((cert, key)) = client {
                let _ = writeln!(etcd_extra, "cert_file = {:?}", cert.display().to_string());
                let _ = writeln!(etcd_extra, "key_file = {:?}", key.display().to_string());
            }
        }
        let mut agent_toml = self.agent_toml.clone();
        if let Some(t) = &self.api_tls {
            let _ = writeln!(
                agent_toml,
                "api_cert_file = {:?}\napi_key_file = {:?}\napi_ca_file = {:?}\napi_verify_client = {:?}",
                t.cert_file.display().to_string(),
                t.key_file.display().to_string(),
                t.ca_file.display().to_string(),
                t.verify_client
            );
        }
        if let Some((user, password)) = &self.etcd_auth {
            etcd.enable_auth("root-secret", user, password, "/pgwarden/");
            let _ = writeln!(etcd_extra, "username = {user:?}\npassword = {password:?}");
        }
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()
            .expect("temp dir");
        // PostgreSQL runs as another user, who must reach the data dirs.
        fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod temp dir");
        let cluster_name = format!("t{}", free_port());
        let mut nodes = Vec::new();
        let mut tails = Vec::new();
        let mut relays = Vec::new();
        for i in 0..self.nodes {
            let name = format!("n{}", i + 1);
            let etcd_endpoint = if self.etcd_relays {
                let target = format!("127.0.0.1:{}", etcd.client_port(0));
                let relay = Relay::start(target.parse().expect("addr")).expect("etcd relay");
                // host:port: the scheme follows the agents' TLS settings.
                let ep = relay.addr().to_string();
                relays.push(relay);
                ep
            } else {
                etcd.endpoints().join("\", \"")
            };
            let node = AgentNode {
                pg_port: free_port(),
                api_port: free_port(),
                rw_port: free_port(),
                ro_port: free_port(),
                http_port: free_port(),
                config: dir.path().join(format!("{name}.toml")),
                data_dir: dir.path().join(&name),
                log: dir.path().join(format!("{name}-agent.log")),
                api_https: self.api_tls.is_some(),
                pg_parameters: self.pg_parameters.clone(),
                name,
                child: None,
            };
            let node_extra: String = self
                .node_toml
                .iter()
                .filter(|(n, _)| *n == i)
                .map(|(_, t)| format!("{t}\n"))
                .collect();
            let tail = format!(
                "{}{node_extra}\n[etcd]\nendpoints = [\"{etcd_endpoint}\"]\ncluster = \"{cluster_name}\"\nop_timeout = \"1s\"\n{etcd_extra}\n{}",
                agent_toml, self.tables
            );
            write_config(&node, &tail);
            tails.push(tail);
            nodes.push(node);
        }
        let mut c = AgentCluster {
            cluster_name,
            bin: self.bin,
            nodes,
            relays,
            etcd,
            tails: tails.clone(),
            api_tls: self.api_tls,
            zombies: Vec::new(),
            dir,
        };
        if self.held_back.contains(&0) {
            return c;
        }
        c.launch(0, &tails[0]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        // `/leader`: the primary, or a standby cluster's standby leader.
        while c.api_status(0, "/leader") != Some(200) {
            assert!(
                std::time::Instant::now() < deadline,
                "node n1 did not become leader\n{}",
                c.logs()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        for (i, tail) in tails.iter().enumerate().skip(1) {
            if !self.held_back.contains(&i) {
                c.launch(i, tail);
            }
        }
        c
    }
}

/// Writes a node's configuration: its ports, then `tail` (the shared and
/// per-node `[agent]` keys, `[etcd]` and extra tables).
fn write_config(node: &AgentNode, tail: &str) {
    let mut toml = String::new();
    let _ = write!(
        toml,
        "[cluster]\nuser = \"postgres\"\nprobe_interval = \"250ms\"\n\n\
         [listen]\nread_write = \"127.0.0.1:{rw}\"\nread_only = \"127.0.0.1:{ro}\"\nhttp = \"127.0.0.1:{http}\"\n\n\
         [engine]\nconnect_wait_timeout = \"3s\"\n\n\
         [agent]\nname = \"{name}\"\ndata_dir = \"{data}\"\npg_listen = \"127.0.0.1:{pg}\"\napi = \"127.0.0.1:{api}\"\n\
         api_password = \"secret\"\n\
         parameters = {{ fsync = \"off\", full_page_writes = \"on\", shared_buffers = \"16MB\", max_connections = 50{params} }}\n{tail}",
        rw = node.rw_port,
        ro = node.ro_port,
        http = node.http_port,
        name = node.name,
        data = node.data_dir.display(),
        pg = node.pg_port,
        api = node.api_port,
        params = node.pg_parameters,
    );
    fs::write(&node.config, toml).expect("write node config");
}

/// A running HA cluster; see the module documentation.
#[derive(Debug)]
pub struct AgentCluster {
    cluster_name: String,
    bin: PathBuf,
    nodes: Vec<AgentNode>,
    relays: Vec<Relay>,
    etcd: EtcdCluster,
    /// Each node's configuration after its ports.
    tails: Vec<String>,
    /// With the API on HTTPS, its certificates.
    api_tls: Option<ApiTls>,
    /// Agents killed and not yet reaped ([`AgentCluster::kill_agent_unreaped`]).
    zombies: Vec<std::process::Child>,
    // Dropped last: the directories outlive every process using them.
    dir: tempfile::TempDir,
}

impl AgentCluster {
    /// Starts describing a cluster whose agents run the `pgwarden` binary
    /// at `bin` (in integration tests: `env!("CARGO_BIN_EXE_pgwarden")`).
    pub fn builder(bin: impl Into<PathBuf>) -> AgentClusterBuilder {
        AgentClusterBuilder {
            bin: bin.into(),
            nodes: 3,
            agent_toml: String::new(),
            node_toml: Vec::new(),
            etcd_relays: false,
            tables: String::new(),
            etcd_members: 1,
            held_back: Vec::new(),
            etcd_tls: None,
            etcd_auth: None,
            api_tls: None,
            pg_parameters: String::new(),
        }
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether there are no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i`.
    pub fn node(&self, i: usize) -> &AgentNode {
        &self.nodes[i]
    }

    /// Every node.
    pub fn nodes(&self) -> &[AgentNode] {
        &self.nodes
    }

    /// The etcd the agents use.
    pub fn etcd(&mut self) -> &mut EtcdCluster {
        &mut self.etcd
    }

    /// A client endpoint of etcd (not through any relay).
    pub fn etcd_endpoint(&self) -> String {
        self.etcd.endpoints()[0].clone()
    }

    /// The cluster's name in etcd (`etcd.cluster`).
    pub fn cluster_name(&self) -> &str {
        &self.cluster_name
    }

    /// The relay between node `i`'s agent and etcd (with
    /// [`AgentClusterBuilder::etcd_relays`]).
    pub fn etcd_relay(&self, i: usize) -> &Relay {
        &self.relays[i]
    }

    /// The directory holding every node's files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Index of the node named `name`.
    pub fn index_of(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// The status code node `i`'s REST API answers `GET path` with, over
    /// HTTPS when the cluster serves it so; `None` without an answer.
    pub fn api_status(&self, i: usize, path: &str) -> Option<u16> {
        let port = self.nodes[i].api_port;
        match &self.api_tls {
            None => http_status(port, path),
            Some(t) => {
                let identity = (t.verify_client != "none")
                    .then_some((t.cert_file.as_path(), t.key_file.as_path()));
                https_status(port, path, &t.ca_file, identity)
            }
        }
    }

    /// Starts node `i`'s agent for the first time. A port picked as free
    /// can be taken by another process before the agent binds it; then the
    /// agent exits at once, and the node gets new ports and another try.
    fn launch(&mut self, i: usize, tail: &str) {
        for _attempt in 0..4 {
            self.start_agent(i);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            loop {
                // The REST API binds first, the connection manager's ports
                // after it: both answering means every port is ours.
                let n = &self.nodes[i];
                if self.api_status(i, "/liveness").is_some()
                    && http_status(n.http_port, "/health").is_some()
                {
                    return;
                }
                if !self.nodes[i].agent_running() {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the agent of node {i} did not start\n{}",
                    self.logs()
                );
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let log = self.nodes[i].agent_log();
            assert!(
                log.contains("Address already in use"),
                "the agent of node {i} exited\n{}",
                self.logs()
            );
            let n = &mut self.nodes[i];
            n.pg_port = free_port();
            n.api_port = free_port();
            n.rw_port = free_port();
            n.ro_port = free_port();
            n.http_port = free_port();
            write_config(n, tail);
        }
        panic!("node {i}: no free ports after four tries\n{}", self.logs());
    }

    /// Starts node `i`'s agent for the first time, after it was held back
    /// ([`AgentClusterBuilder::hold_back`]).
    pub fn launch_held_back(&mut self, i: usize) {
        let tail = self.tails[i].clone();
        self.launch(i, &tail);
    }

    /// Starts (or restarts) node `i`'s agent.
    pub fn start_agent(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)
            .expect("agent log");
        let err = log.try_clone().expect("agent log");
        let mut cmd = Command::new(&self.bin);
        cmd.arg("agent")
            .arg("--config")
            .arg(&node.config)
            .env(
                "RUST_LOG",
                std::env::var("PGWARDEN_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err);
        die_with_parent(&mut cmd);
        node.child = Some(cmd.spawn().expect("spawn pgwarden agent"));
    }

    /// How node `i`'s agent exited, once it has; `None` while it runs (or
    /// was never started).
    pub fn agent_exit(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        self.nodes[i].child.as_mut()?.try_wait().ok().flatten()
    }

    /// Makes node `i`'s agent re-read its file (SIGHUP).
    pub fn reload_agent(&self, i: usize) {
        if let Some(c) = &self.nodes[i].child {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGHUP);
        }
    }

    /// Asks node `i`'s agent to stop (SIGTERM) and waits for it to exit.
    pub fn stop_agent(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
            let _ = c.wait();
        }
    }

    /// Kills node `i`'s agent with SIGKILL; its PostgreSQL keeps running.
    pub fn kill_agent(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills node `i`'s agent with SIGKILL and does not reap it until the
    /// cluster is dropped: it stays a zombie, as under a supervisor that
    /// waits for its children late.
    pub fn kill_agent_unreaped(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = c.kill();
            self.zombies.push(c);
        }
    }

    /// Kills node `i`'s postmaster and its children with SIGKILL.
    pub fn kill_postgres(&mut self, i: usize) {
        kill_postmaster(&self.nodes[i].data_dir);
    }

    /// Kills node `i` outright: agent and PostgreSQL.
    pub fn kill_node(&mut self, i: usize) {
        self.kill_agent(i);
        self.kill_postgres(i);
    }

    /// A summary of every node's log tail, for failure messages.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for n in &self.nodes {
            let _ = writeln!(s, "===== {} =====\n{}", n.name, n.log_tail());
        }
        s
    }
}

impl Drop for AgentCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill_agent(i);
        }
        for mut z in self.zombies.drain(..) {
            let _ = z.wait();
        }
        for n in &self.nodes {
            kill_postmaster(&n.data_dir);
        }
        if std::thread::panicking() || std::env::var_os("PGWARDEN_TEST_KEEP_LOGS").is_some() {
            eprintln!("{}", self.logs());
        }
    }
}

/// [`http_status`] over TLS, trusting only the CA certificates in `ca`
/// (PEM), and presenting `identity` (certificate and key files) if given;
/// the server's certificate must name 127.0.0.1.
pub fn https_status(
    port: u16,
    path: &str,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Option<u16> {
    use rustls::pki_types::pem::PemObject;
    use std::io::{Read, Write};
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).ok()? {
        roots.add(c.ok()?).ok()?;
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .ok()?
    .with_root_certificates(roots);
    let config = match identity {
        None => config.with_no_client_auth(),
        Some((cert, key)) => {
            let certs = rustls::pki_types::CertificateDer::pem_file_iter(cert)
                .ok()?
                .collect::<Result<Vec<_>, _>>()
                .ok()?;
            let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key).ok()?;
            config.with_client_auth_cert(certs, key).ok()?
        }
    };
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").ok()?;
    let mut conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name).ok()?;
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    let mut s = rustls::Stream::new(&mut conn, &mut tcp);
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_whitespace().nth(1)?.parse().ok()
}

/// The status code of a GET on the local port, if anything answers.
pub fn http_status(port: u16, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_whitespace().nth(1)?.parse().ok()
}

pub(crate) fn postmaster_pid(data_dir: &Path) -> Option<i32> {
    let text = fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
    let pid: i32 = text.lines().next()?.trim().parse().ok()?;
    kill(Pid::from_raw(pid), None).ok().map(|_| pid)
}

/// SIGKILLs a data directory's postmaster and its children; the
/// postmaster is frozen first so it cannot fork meanwhile.
pub(crate) fn kill_postmaster(data_dir: &Path) {
    let Some(pid) = postmaster_pid(data_dir) else {
        return;
    };
    let pm = Pid::from_raw(pid);
    let _ = kill(pm, Signal::SIGSTOP);
    let children =
        fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    for c in children.split_whitespace().filter_map(|s| s.parse().ok()) {
        let _ = kill(Pid::from_raw(c), Signal::SIGKILL);
    }
    let _ = kill(pm, Signal::SIGKILL);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while kill(pm, None).is_ok() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only makes the
    // async-signal-safe prctl system call.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
        });
    }
}
