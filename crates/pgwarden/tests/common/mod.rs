//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use pgwarden_probe::{Engine, ProbeConfig, Snapshot};
use pgwarden_topology::{HostAddr, HostConfig, TopologyConfig};

/// Probe settings for tests: short rounds so tests are quick, time-outs
/// that still tolerate a loaded CI machine.
pub fn fast_probe() -> ProbeConfig {
    ProbeConfig {
        interval: Duration::from_millis(250),
        connect_timeout: Duration::from_millis(1500),
        query_timeout: Duration::from_millis(1500),
        ..ProbeConfig::default()
    }
}

pub fn hosts(addrs: &[String]) -> Vec<HostConfig> {
    addrs
        .iter()
        .map(|a| HostConfig::new(a.parse::<HostAddr>().expect("host:port")))
        .collect()
}

pub fn engine(addrs: &[String], topo: TopologyConfig) -> Engine {
    Engine::start(hosts(addrs), topo, fast_probe())
}

/// Waits (bounded) until the snapshot satisfies `check`.
pub async fn until<F>(
    engine: &Engine,
    what: &str,
    within: Duration,
    check: F,
) -> std::sync::Arc<Snapshot>
where
    F: Fn(&Snapshot) -> Result<(), String>,
{
    pgwarden_testkit::eventually(what, within, || {
        let snap = engine.snapshot();
        let r = check(&snap).map(|_| snap.clone());
        async move { r }
    })
    .await
}

/// Runs one SQL command on `conninfo` (simple protocol).
pub async fn sql(conninfo: &str, query: &str) -> Vec<tokio_postgres::SimpleQueryMessage> {
    let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {conninfo}: {e}"));
    let task = tokio::spawn(conn);
    let rows = client
        .simple_query(query)
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"));
    drop(client);
    let _ = task.await;
    rows
}

/// The first column of the first row of `query`.
pub async fn sql_value(conninfo: &str, query: &str) -> Option<String> {
    sql(conninfo, query)
        .await
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).map(str::to_string)),
            _ => None,
        })?
}

/// A connection manager in front of `addrs`, every listener on a free
/// port: services `read_write`, `read_only` and `standby`.
pub async fn proxy(addrs: &[String], connect_wait: Duration) -> (Engine, pgwarden_proxy::Proxy) {
    proxy_with(addrs, connect_wait, None, 10_000).await
}

/// Like [`proxy`], with transaction pooling (`pool`) and a client limit.
pub async fn proxy_with(
    addrs: &[String],
    connect_wait: Duration,
    pool: Option<pgwarden_proxy::PoolSettings>,
    max_client_conn: usize,
) -> (Engine, pgwarden_proxy::Proxy) {
    proxy_full(
        addrs,
        connect_wait,
        pool,
        max_client_conn,
        Default::default(),
        None,
    )
    .await
}

/// Like [`proxy_with`], with per-database/per-user pool exceptions.
pub async fn proxy_full(
    addrs: &[String],
    connect_wait: Duration,
    pool: Option<pgwarden_proxy::PoolSettings>,
    max_client_conn: usize,
    pool_overrides: pgwarden_proxy::PoolOverrides,
    tls: Option<pgwarden_proxy::TlsSpec>,
) -> (Engine, pgwarden_proxy::Proxy) {
    use pgwarden_proxy::{Proxy, ProxySpec, ServiceSpec};
    use pgwarden_topology::{SelectPolicy, Want};
    // RUST_LOG=... shows the proxy's logs when a test fails.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let e = engine(addrs, TopologyConfig::default());
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let svc = |name: &str, want: Want, read_only: bool, fallback: bool| ServiceSpec {
        pool: pool.clone().map(|p| {
            std::sync::Arc::new(pgwarden_proxy::PoolSettings {
                wants_primary: want == Want::Primary,
                ..p
            })
        }),
        name: name.into(),
        listen: any,
        want,
        policy: SelectPolicy {
            fallback_to_primary: fallback,
            ..SelectPolicy::default()
        },
        read_only,
        connect_wait_timeout: connect_wait,
        direct: false,
    };
    let spec = ProxySpec {
        services: vec![
            svc("read_write", Want::Primary, false, false),
            svc("read_only", Want::Replica, true, true),
            svc("standby", Want::SyncStandby, true, true),
        ],
        http: Some(any),
        server_connect_timeout: SERVER_CONNECT_TIMEOUT.with(|t| t.get()),
        shutdown_timeout: Duration::from_secs(5),
        max_client_conn,
        worker_threads: WORKERS.with(|w| w.get()),
        pool_affinity: POOL_AFFINITY.with(|a| a.get()),
        worker_fill: WORKER_FILL.with(|a| a.get()),
        admin_users: vec!["postgres".into()],
        settings: vec![("pool.size".into(), "test".into(), "20".into())],
        // Short, so that tests see averages change.
        stats_period: Duration::from_secs(1),
        pool_overrides,
        tls,
        auth: AUTH.with(|a| a.borrow().clone()),
        auth_timeout: AUTH_TIMEOUT.with(|a| *a.borrow()),
        server_tls: SERVER_TLS.with(|t| t.borrow().0),
        server_ca: SERVER_TLS.with(|t| t.borrow().1.clone()),
        unix_socket_dir: UNIX_SOCKET_DIR.with(|d| d.borrow().clone()),
        tcp: Default::default(),
    };
    let p = Proxy::start(spec, e.snapshot_handle(), e.changes())
        .await
        .expect("proxy starts");
    (e, p)
}

/// libpq-style connection string for a service of `proxy`.
pub fn via(proxy: &pgwarden_proxy::Proxy, service: &str) -> String {
    let addr = proxy.service_addrs()[service];
    format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        addr.port()
    )
}

/// Connects with tokio-postgres; the connection task runs in the background.
pub async fn client(conninfo: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(client)
}

/// A plain HTTP/1.0 GET; returns (status, body).
/// The value of the first `/metrics` sample whose line starts with
/// `prefix` (a metric name and its opening `{`, or a name and a space).
pub async fn metric_sample(http: std::net::SocketAddr, prefix: &str) -> f64 {
    let (_, body) = tokio::task::spawn_blocking(move || http_get(http, "/metrics"))
        .await
        .unwrap();
    body.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} sample: {body}"))
}

/// The clients placed on workers 0 and 1 (`pgwarden_worker_clients`).
pub async fn worker_clients(http: std::net::SocketAddr) -> (f64, f64) {
    (
        metric_sample(http, "pgwarden_worker_clients{worker=\"0\"} ").await,
        metric_sample(http, "pgwarden_worker_clients{worker=\"1\"} ").await,
    )
}

pub fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    http_request(addr, "GET", path)
}

/// `POST path` (no body) to an HTTP port: status and body.
pub fn http_post(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    http_request(addr, "POST", path)
}

fn http_request(addr: std::net::SocketAddr, method: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect HTTP");
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The SQLSTATE of a tokio-postgres error, if the server (or pgwarden) sent one.
pub fn sqlstate(e: &tokio_postgres::Error) -> Option<String> {
    e.code().map(|c| c.code().to_string())
}

/// Writes `rules` to the pg_hba.conf file `hba` and has the next proxy
/// built on this thread authenticate clients itself with it (auth user
/// `postgres`, the default auth query, a minute's cache).
pub fn authenticate_with(hba: std::path::PathBuf, rules: &str) {
    authenticate_with_ttl(hba, rules, Duration::from_secs(60));
}

/// [`authenticate_with`], with `cache_ttl` as the verifier cache's life.
pub fn authenticate_with_ttl(hba: std::path::PathBuf, rules: &str, cache_ttl: Duration) {
    std::fs::write(&hba, rules).unwrap();
    AUTH.with(|a| {
        *a.borrow_mut() = Some(pgwarden_proxy::AuthSpec {
            hba_file: hba,
            auth_user: "postgres".into(),
            auth_password: None,
            auth_dbname: "postgres".into(),
            auth_query: pgwarden_config::DEFAULT_AUTH_QUERY.into(),
            cache_ttl,
        })
    });
}

thread_local! {
    /// Authentication settings for the next proxy built on this thread
    /// (tests that need them set it first).
    pub static AUTH: std::cell::RefCell<Option<pgwarden_proxy::AuthSpec>> = const { std::cell::RefCell::new(None) };
    /// The auth time-out for the next proxy built on this thread.
    pub static AUTH_TIMEOUT: std::cell::RefCell<Duration> = const { std::cell::RefCell::new(Duration::from_secs(30)) };
    /// `server_connect_timeout` for the next proxy built on this thread.
    pub static SERVER_CONNECT_TIMEOUT: std::cell::Cell<Duration> = const { std::cell::Cell::new(Duration::from_secs(2)) };
    /// TLS towards the servers (mode, CA file) for the next proxy built on
    /// this thread.
    pub static SERVER_TLS: std::cell::RefCell<(pgwarden_proxy::ServerTlsMode, Option<std::path::PathBuf>)> = const { std::cell::RefCell::new((pgwarden_proxy::ServerTlsMode::Disable, None)) };
    /// The Unix-socket directory of the next proxy built on this thread.
    pub static UNIX_SOCKET_DIR: std::cell::RefCell<Option<std::path::PathBuf>> = const { std::cell::RefCell::new(None) };
    /// Worker threads of the next proxy built on this thread. Two by
    /// default, so that consecutive clients land on different workers and
    /// pooled servers move between them.
    pub static WORKERS: std::cell::Cell<usize> = const { std::cell::Cell::new(2) };
    /// `engine.pool_affinity` of the next proxy built on this thread.
    pub static POOL_AFFINITY: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
    /// `engine.worker_fill` of the next proxy built on this thread: 0 (in
    /// turn) by default, for the same reason as [`WORKERS`].
    pub static WORKER_FILL: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Waits until `n` hosts are alive and a primary is known.
pub async fn ready(e: &Engine, n: usize) {
    until(e, "all hosts probed", Duration::from_secs(30), |s| {
        let alive = s.topology.hosts().iter().filter(|h| h.alive).count();
        (alive == n && s.topology.primary().is_some())
            .then_some(())
            .ok_or(format!("{alive} alive"))
    })
    .await;
}

/// The first column of the first row of `q` on an open client.
pub async fn one(c: &tokio_postgres::Client, q: &str) -> String {
    let rows = c
        .simple_query(q)
        .await
        .unwrap_or_else(|e| panic!("{q}: {e}"));
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .expect("a row")
}

/// Runs the driver script `tests/clients/NAME` with python3 and `args`;
/// panics with its output unless it exits successfully.
pub async fn python_client(name: &str, args: Vec<String>) {
    client_program("python3", Vec::new(), name, args).await;
}

/// Where Debian's libpostgresql-jdbc-java puts the PostgreSQL JDBC driver.
const JDBC_JAR: &str = "/usr/share/java/postgresql.jar";

/// Runs the single-file Java program `tests/clients/NAME` (launched from
/// source, with the PostgreSQL JDBC driver on the class path) with `args`;
/// panics with its output unless it exits successfully.
pub async fn java_client(name: &str, args: Vec<String>) {
    client_program("java", vec!["-cp".into(), JDBC_JAR.into()], name, args).await;
}

/// Runs the PHP program `tests/clients/NAME` with the PHP command line and
/// `args`; panics with its output unless it exits successfully.
pub async fn php_client(name: &str, args: Vec<String>) {
    client_program("php", Vec::new(), name, args).await;
}

/// Runs the Node.js program `tests/clients/NAME` with `args`, with npm's
/// global modules (where scripts/install-deps.sh puts node-postgres) on
/// its module path; panics with its output unless it exits successfully.
pub async fn node_client(name: &str, args: Vec<String>) {
    let root = std::process::Command::new("npm")
        .args(["root", "-g"])
        .output()
        .expect("npm (scripts/install-deps.sh installs it)");
    let root = String::from_utf8_lossy(&root.stdout).trim().to_string();
    client_program_env("node", Vec::new(), name, args, vec![("NODE_PATH", root)]).await;
}

async fn client_program(program: &str, pre: Vec<String>, name: &str, args: Vec<String>) {
    client_program_env(program, pre, name, args, Vec::new()).await;
}

async fn client_program_env(
    program: &str,
    pre: Vec<String>,
    name: &str,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
) {
    let script = format!("{}/tests/clients/{name}", env!("CARGO_MANIFEST_DIR"));
    let prog = program.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&prog)
            .args(&pre)
            .arg(&script)
            .args(&args)
            .envs(env)
            .output()
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{name} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `IDENTIFY_SYSTEM` through psql over a physical replication
/// connection (`replication=true`) to `port` on 127.0.0.1 as postgres:
/// whether it worked, and what psql printed on stderr.
pub async fn psql_replication(port: u16) -> (bool, String) {
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("psql")
            .arg(format!(
                "host=127.0.0.1 port={port} user=postgres replication=true"
            ))
            .args(["-X", "-c", "IDENTIFY_SYSTEM"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// For a client `pending` on a host whose relay refuses new connections:
/// checks that it still waits after long enough for a first attempt to
/// fail, opens the relay's port, and returns what the client then got.
pub async fn served_once_open<T>(
    relay: &pgwarden_testkit::Relay,
    mut pending: tokio::task::JoinHandle<T>,
) -> T {
    assert!(
        tokio::time::timeout(Duration::from_millis(800), &mut pending)
            .await
            .is_err(),
        "the client was answered while its host refused"
    );
    relay.set_listener(pgwarden_testkit::Listener::Open);
    tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the client is served once its host accepts")
        .unwrap()
}

/// A protocol 3.0 startup packet with these parameters.
pub fn startup_packet(params: &[(&str, &str)]) -> Vec<u8> {
    let mut body = 196_608u32.to_be_bytes().to_vec();
    for (k, v) in params {
        for part in [k, v] {
            body.extend_from_slice(part.as_bytes());
            body.push(0);
        }
    }
    body.push(0);
    let mut packet = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    packet.extend(body);
    packet
}

/// A client connecting to `conninfo` in the background, once it is seen
/// waiting (not answered within 300 ms) for the reason `why_waiting`.
pub async fn waiting_client(
    conninfo: String,
    why_waiting: &str,
) -> tokio::task::JoinHandle<Result<tokio_postgres::Client, tokio_postgres::Error>> {
    let mut pending = tokio::spawn(async move { client(&conninfo).await });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut pending)
            .await
            .is_err(),
        "the client was answered while {why_waiting}"
    );
    pending
}

/// Shuts `proxy` down with `pending` still waiting to be let in, and checks
/// that the client is told why it is turned away (57P01) once the
/// shutdown time-out runs out, and that the shutdown then ends.
pub async fn told_at_shutdown(
    proxy: pgwarden_proxy::Proxy,
    pending: tokio::task::JoinHandle<Result<tokio_postgres::Client, tokio_postgres::Error>>,
) {
    let shutdown = tokio::spawn(proxy.shutdown());
    let Err(err) = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the client is answered once the shutdown's wait is over")
        .unwrap()
    else {
        panic!("the client was let in");
    };
    assert_eq!(sqlstate(&err).as_deref(), Some("57P01"), "{err:?}");
    let message = err.as_db_error().map(|d| d.message()).unwrap_or_default();
    assert!(message.contains("shutting down"), "{message}");
    tokio::time::timeout(Duration::from_secs(5), shutdown)
        .await
        .expect("the shutdown ends once the client is told")
        .unwrap();
}
