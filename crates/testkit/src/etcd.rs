//! Real etcd servers for tests: one member ([`EtcdServer`]) or a cluster of
//! several ([`EtcdCluster`]), on 127.0.0.1 with free ports and a per-test
//! data directory.
//!
//! Servers can be killed, frozen and started again on the same data and
//! ports, which is what fault tests need. They die with the thread that
//! started them (parent-death signal), so a test killed by a time-out leaves
//! no etcd behind; start them from the test's own thread, not from a task
//! that may run on a pool thread.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::cluster::free_port;

/// Directory prefix shared with the PostgreSQL clusters, so one sweep of
/// leftovers (pid after the prefix) covers both.
const DIR_PREFIX: &str = "pgwarden-test-";

/// How long a member may take to answer `/health` after starting.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a graceful stop may take before the member is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS on etcd's client port (PEM files).
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// The CA that signed the server's (and clients') certificates.
    pub ca_file: PathBuf,
    /// The server certificate; it must name 127.0.0.1.
    pub cert_file: PathBuf,
    /// Its private key.
    pub key_file: PathBuf,
    /// Require clients to present a certificate signed by the CA
    /// (`--client-cert-auth`).
    pub client_cert_auth: bool,
}

/// How the members are started, beyond the defaults.
#[derive(Debug, Clone, Default)]
pub struct EtcdOptions {
    /// TLS on the client port.
    pub tls: Option<EtcdTls>,
    /// `--auth-token-ttl` in seconds (etcd's default is 300): short, a test
    /// sees authentication tokens expire.
    pub auth_token_ttl: Option<u32>,
}

/// Where one member listens and keeps its data; fixed for the member's
/// life so that a restart comes back as the same member.
#[derive(Debug, Clone)]
struct MemberSpec {
    name: String,
    client_port: u16,
    /// With TLS: a second, plain client listener, for the kit's health
    /// checks and administration (it has no TLS client of its own).
    admin_port: u16,
    tls: Option<EtcdTls>,
    auth_token_ttl: Option<u32>,
    peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    /// `name=peer-url,...` for every member of the cluster.
    initial_cluster: String,
}

impl MemberSpec {
    /// The port the kit itself speaks plain HTTP to.
    fn plain_port(&self) -> u16 {
        if self.tls.is_some() {
            self.admin_port
        } else {
            self.client_port
        }
    }
}

/// One etcd process.
#[derive(Debug)]
struct Member {
    spec: MemberSpec,
    bin: PathBuf,
    child: Option<Child>,
}

impl Member {
    fn spawn(&mut self) -> std::io::Result<()> {
        let s = &self.spec;
        let log = File::options().create(true).append(true).open(&s.log)?;
        let (client, listen) = match &s.tls {
            None => {
                let url = format!("http://127.0.0.1:{}", s.client_port);
                (url.clone(), url)
            }
            Some(_) => {
                let url = format!("https://127.0.0.1:{}", s.client_port);
                let listen = format!("{url},http://127.0.0.1:{}", s.admin_port);
                (url, listen)
            }
        };
        let peer = format!("http://127.0.0.1:{}", s.peer_port);
        let mut cmd = Command::new(&self.bin);
        if let Some(tls) = &s.tls {
            cmd.arg("--cert-file")
                .arg(&tls.cert_file)
                .arg("--key-file")
                .arg(&tls.key_file)
                .arg("--trusted-ca-file")
                .arg(&tls.ca_file);
            if tls.client_cert_auth {
                cmd.arg("--client-cert-auth");
            }
        }
        if let Some(ttl) = s.auth_token_ttl {
            cmd.arg("--auth-token-ttl").arg(ttl.to_string());
        }
        cmd.arg("--name")
            .arg(&s.name)
            .arg("--data-dir")
            .arg(&s.data_dir)
            .arg("--listen-client-urls")
            .arg(&listen)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(&s.initial_cluster)
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--initial-cluster-token")
            .arg(&s.initial_cluster)
            // zap avoids 3.4's deprecation warning for the old logger.
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // etcd refuses to start on architectures it does not test on unless
        // told to; amd64 needs nothing.
        if let Some(arch) = unsupported_arch() {
            cmd.env("ETCD_UNSUPPORTED_ARCH", arch);
        }
        die_with_parent(&mut cmd);
        self.child = Some(cmd.spawn()?);
        Ok(())
    }

    /// Waits for `/health` to report true; `Err` with the log tail if the
    /// process exits or `within` passes first.
    fn wait_healthy(&mut self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        let addr = SocketAddr::from(([127, 0, 0, 1], self.spec.plain_port()));
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(format!("etcd exited ({status}): {}", self.log_tail()));
                }
            }
            if healthy(addr) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "etcd not healthy after {within:?}: {}",
                    self.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&self, sig: Signal) {
        if let Some(child) = &self.child {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = kill(Pid::from_raw(pid), sig);
            }
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn stop(&mut self) {
        self.signal(Signal::SIGCONT);
        self.signal(Signal::SIGTERM);
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + STOP_TIMEOUT;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.spec.log).unwrap_or_default();
        let start = text.len().saturating_sub(2000);
        let start = (start..text.len())
            .find(|i| text.is_char_boundary(*i))
            .unwrap_or(0);
        text[start..].trim().to_string()
    }
}

/// A single-member etcd on 127.0.0.1, killed and its data removed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    cluster: EtcdCluster,
}

impl EtcdServer {
    /// Starts a member on free ports and waits until it serves requests.
    /// Panics if etcd cannot be found or does not start: a test cannot
    /// proceed without it.
    pub fn start() -> EtcdServer {
        EtcdServer {
            cluster: EtcdCluster::start(1),
        }
    }

    /// `127.0.0.1:port` of the client listener, as the DCS takes it.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port())
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.cluster.client_port(0)
    }

    /// Whether the process is running (it may still be frozen).
    pub fn is_running(&self) -> bool {
        self.cluster.is_running(0)
    }

    /// Kills the server with SIGKILL, as a crash or power loss would.
    pub fn kill(&mut self) {
        self.cluster.kill(0);
    }

    /// Stops the server with SIGTERM, waiting for it to exit.
    pub fn stop(&mut self) {
        self.cluster.stop(0);
    }

    /// Freezes the server (SIGSTOP): connections stay open but nothing is
    /// answered, the hardest case for time-outs.
    pub fn freeze(&self) {
        self.cluster.freeze(0);
    }

    /// Resumes a frozen server.
    pub fn thaw(&self) {
        self.cluster.thaw(0);
    }

    /// Starts the server again on the same data and ports after
    /// [`kill`](Self::kill) or [`stop`](Self::stop), and waits until it
    /// serves requests.
    pub fn start_again(&mut self) {
        self.cluster.start_again(0);
    }
}

/// An etcd cluster of several members on 127.0.0.1, for tests of losing a
/// member or the quorum. Killed and its data removed on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Member>,
    // Dropped after the members (field order): processes are killed before
    // their directory is removed.
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `size` members (at least one) and waits until every one
    /// serves requests, retrying with new ports if another process took one
    /// of ours in the meantime.
    pub fn start(size: usize) -> EtcdCluster {
        Self::start_with(size, &EtcdOptions::default())
    }

    /// [`start`](Self::start), with `options`.
    pub fn start_with(size: usize, options: &EtcdOptions) -> EtcdCluster {
        let size = size.max(1);
        let tls = &options.tls;
        let bin = etcd_binary().expect("etcd binary (run scripts/install-deps.sh)");
        sweep_leftovers();
        let mut last_err = String::new();
        for _attempt in 0..3 {
            let dir = tempfile::Builder::new()
                .prefix(&format!("{DIR_PREFIX}{}-etcd-", std::process::id()))
                .tempdir()
                .expect("temp dir");
            let ports: Vec<(u16, u16)> = (0..size).map(|_| (free_port(), free_port())).collect();
            let initial_cluster = ports
                .iter()
                .enumerate()
                .map(|(i, (_, peer))| format!("etcd{i}=http://127.0.0.1:{peer}"))
                .collect::<Vec<_>>()
                .join(",");
            let mut members: Vec<Member> = ports
                .iter()
                .enumerate()
                .map(|(i, &(client_port, peer_port))| Member {
                    spec: MemberSpec {
                        name: format!("etcd{i}"),
                        client_port,
                        admin_port: if tls.is_some() { free_port() } else { 0 },
                        tls: tls.clone(),
                        auth_token_ttl: options.auth_token_ttl,
                        peer_port,
                        data_dir: dir.path().join(format!("etcd{i}.data")),
                        log: dir.path().join(format!("etcd{i}.log")),
                        initial_cluster: initial_cluster.clone(),
                    },
                    bin: bin.clone(),
                    child: None,
                })
                .collect();
            // All members first: none is healthy before a quorum is up.
            for m in &mut members {
                m.spawn().expect("spawn etcd");
            }
            match members
                .iter_mut()
                .try_for_each(|m| m.wait_healthy(START_TIMEOUT))
            {
                Ok(()) => return EtcdCluster { members, _dir: dir },
                Err(e) => {
                    members.iter_mut().for_each(Member::kill);
                    last_err = e;
                }
            }
        }
        panic!("could not start etcd: {last_err}");
    }

    /// How many members the cluster was started with.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Client endpoints (`127.0.0.1:port`) of every member, running or not.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.spec.client_port))
            .collect()
    }

    /// The client port of member `i`.
    pub fn client_port(&self, i: usize) -> u16 {
        self.members[i].spec.client_port
    }

    /// Turns on etcd's authentication: creates `root` (password
    /// `root_password`) and `user` (password `password`), who may read and
    /// write the keys under `prefix` and nothing else, then enables
    /// authentication. Through etcd's JSON gateway on member 0.
    pub fn enable_auth(&self, root_password: &str, user: &str, password: &str, prefix: &str) {
        use base64::Engine as _;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let mut end = prefix.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let port = self.members[0].spec.plain_port();
        let calls = [
            ("/v3/auth/role/add", format!(r#"{{"name":"{user}"}}"#)),
            (
                "/v3/auth/role/grant",
                format!(
                    r#"{{"name":"{user}","perm":{{"permType":"READWRITE","key":"{}","range_end":"{}"}}}}"#,
                    b64(prefix.as_bytes()),
                    b64(&end)
                ),
            ),
            (
                "/v3/auth/user/add",
                format!(r#"{{"name":"{user}","password":"{password}"}}"#),
            ),
            (
                "/v3/auth/user/grant",
                format!(r#"{{"user":"{user}","role":"{user}"}}"#),
            ),
            (
                "/v3/auth/user/add",
                format!(r#"{{"name":"root","password":"{root_password}"}}"#),
            ),
            ("/v3/auth/role/add", r#"{"name":"root"}"#.to_string()),
            (
                "/v3/auth/user/grant",
                r#"{"user":"root","role":"root"}"#.to_string(),
            ),
            ("/v3/auth/enable", "{}".to_string()),
        ];
        for (path, body) in calls {
            let reply = post(port, path, &body);
            assert!(reply.starts_with("HTTP/1.1 200"), "etcd {path}: {reply}");
        }
    }

    /// Whether member `i`'s process is running (it may still be frozen).
    pub fn is_running(&self, i: usize) -> bool {
        self.members[i].child.is_some()
    }

    /// Kills member `i` with SIGKILL.
    pub fn kill(&mut self, i: usize) {
        self.members[i].kill();
    }

    /// Stops member `i` with SIGTERM.
    pub fn stop(&mut self, i: usize) {
        self.members[i].stop();
    }

    /// Freezes member `i` (SIGSTOP).
    pub fn freeze(&self, i: usize) {
        self.members[i].signal(Signal::SIGSTOP);
    }

    /// Resumes member `i`.
    pub fn thaw(&self, i: usize) {
        self.members[i].signal(Signal::SIGCONT);
    }

    /// Starts member `i` again on its data and ports, and waits until it
    /// serves requests (which needs a quorum of the cluster up).
    pub fn start_again(&mut self, i: usize) {
        let m = &mut self.members[i];
        assert!(m.child.is_none(), "etcd member {i} is still running");
        m.spawn().expect("spawn etcd");
        if let Err(e) = m.wait_healthy(START_TIMEOUT) {
            panic!("etcd member {i} did not come back: {e}");
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The etcd binary: `$PATH` first, then where Debian installs it.
pub fn etcd_binary() -> Option<PathBuf> {
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

fn unsupported_arch() -> Option<&'static str> {
    match std::env::consts::ARCH {
        "x86_64" => None,
        "aarch64" => Some("arm64"),
        "powerpc64" => Some("ppc64le"),
        other => Some(other),
    }
}

/// One bounded `GET /health`; etcd serves HTTP and gRPC on the client port
/// and reports healthy only once it has a leader.
fn healthy(addr: SocketAddr) -> bool {
    let timeout = Duration::from_millis(500);
    let Ok(mut s) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    let req = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut body = String::new();
    let _ = s.take(64 * 1024).read_to_string(&mut body);
    body.starts_with("HTTP/1.1 200") && body.contains(r#""health":"true""#)
}

/// One `POST` to etcd's JSON gateway; the whole reply.
fn post(port: u16, path: &str, body: &str) -> String {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return format!("cannot connect to {addr}");
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(req.as_bytes()).is_err() {
        return "write failed".into();
    }
    let mut reply = String::new();
    let _ = s.take(64 * 1024).read_to_string(&mut reply);
    reply
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

/// Removes directories left by test processes that no longer exist.
fn sweep_leftovers() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if !PathBuf::from(format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}
