//! `pgwarden run` as a process: the configuration file, reloads on SIGHUP,
//! graceful shutdown on SIGTERM, and a non-Rust driver (psycopg 3).

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{client, sqlstate};
use pgwarden_testkit::{eventually, free_port, TestCluster};

const WAIT: Duration = Duration::from_secs(30);

struct Running {
    child: Child,
    stderr: std::path::PathBuf,
}

impl Running {
    fn start(config: &Path, dir: &Path) -> Running {
        Running::command("run", config, dir)
    }

    /// `pgwarden COMMAND --config CONFIG`, its log in `dir`.
    fn command(command: &str, config: &Path, dir: &Path) -> Running {
        let stderr = dir.join("pgwarden.stderr");
        let child = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
            .args([command, "--config"])
            .arg(config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("start pgwarden");
        Running { child, stderr }
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write(path: &Path, text: &str) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

async fn select_one(conninfo: String) -> Result<String, String> {
    let db = client(&conninfo).await.map_err(|e| e.to_string())?;
    let rows = db
        .simple_query("SELECT pg_is_in_recovery()")
        .await
        .map_err(|e| e.to_string())?;
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .ok_or_else(|| "no row".into())
}

/// Waits until `port` serves and lands on a host whose recovery state is
/// `want` (`t` replica, `f` primary): right after start the probe may not
/// have seen the replicas yet, and a read-only service falls back.
async fn lands_on(what: &str, port: u16, want: &str) {
    eventually(what, WAIT, || async move {
        match select_one(conninfo(port)).await {
            Ok(v) if v == want => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}

/// A configuration file for `hosts` with the read-write, read-only and
/// HTTP ports given, then `extra`.
fn listening(hosts: &[String], (rw, ro, http): (u16, u16, u16), extra: &str) -> String {
    let hosts: Vec<String> = hosts.iter().map(|h| format!("\"{h}\"")).collect();
    format!(
        "[cluster]\nhosts = [{}]\n[listen]\nread_write = \"127.0.0.1:{rw}\"\n\
         read_only = \"127.0.0.1:{ro}\"\nhttp = \"127.0.0.1:{http}\"\n{extra}",
        hosts.join(", ")
    )
}

/// Waits for `pg` to exit successfully, and checks that `held`, a
/// session through it, was ended (57P01, or closed).
async fn exits_ending(pg: &mut Running, held: &tokio_postgres::Client) {
    exits_cleanly(pg).await;
    let err = held.simple_query("SELECT 1").await.unwrap_err();
    assert!(
        err.is_closed() || sqlstate(&err).as_deref() == Some("57P01"),
        "{err}"
    );
}

/// Waits for `pg` to exit, and checks that it exited successfully.
async fn exits_cleanly(pg: &mut Running) {
    let status = eventually("process exit", WAIT, || {
        let s = pg.child.try_wait().unwrap();
        async move { s.ok_or_else(|| "running".to_string()) }
    })
    .await;
    assert!(status.success(), "{status:?}\n{}", pg.log());
}

fn conninfo(port: u16) -> String {
    format!("host=127.0.0.1 port={port} user=postgres dbname=postgres")
}

/// pg_hba.conf lines that trust `postgres` (the auth user) and want SCRAM
/// of everyone else.
const TRUST_POSTGRES: &str =
    "host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n";

/// Starts `pgwarden run` in `dir` in front of node 0 of `c`, with `[auth]`
/// (the hba file `hba`, auth user `postgres`, then the `auth` lines) and
/// the `engine` lines in `[engine]`; returns it and its read-write port
/// once that port listens.
async fn run_with_auth(
    c: &TestCluster,
    dir: &Path,
    hba: &str,
    engine: &str,
    auth: &str,
) -> (Running, u16) {
    let (rw, ro, http) = (free_port(), free_port(), free_port());
    write(&dir.join("pg_hba.conf"), hba);
    let config = dir.join("pgwarden.toml");
    write(
        &config,
        &format!(
            "{}\n[engine]\n{engine}\n\
             [auth]\nhba_file = \"pg_hba.conf\"\nauth_user = \"postgres\"\n{auth}",
            listening(&[c.addr(0)], (rw, ro, http), "")
        ),
    );
    let pg = Running::start(&config, dir);
    eventually("listening", WAIT, || async move {
        std::net::TcpStream::connect(("127.0.0.1", rw))
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await;
    (pg, rw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimal_config_reload_and_graceful_shutdown() {
    let c = TestCluster::builder().replicas(2).start();
    let (rw, ro, http, standby, extra) = (
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pgwarden.toml");
    let base = format!(
        r#"[cluster]
hosts = ["{}", "{}", "{}"]
user = "postgres"              # the probe connects as this user

[listen]
read_write = "127.0.0.1:{rw}"
read_only = "127.0.0.1:{ro}"
http = "127.0.0.1:{http}"

[services.standby]
listen = "127.0.0.1:{standby}"
select = "standby"
"#,
        c.addr(0),
        c.addr(1),
        c.addr(2)
    );
    let shutdown = "\n[engine]\nshutdown_timeout = \"1s\"\n";
    write(&config, &format!("{base}{shutdown}"));
    let pg = Running::start(&config, dir.path());
    let v = eventually("read-write port serves", WAIT, || select_one(conninfo(rw))).await;
    assert_eq!(v, "f");
    // Right after start the probe may not have seen the replicas yet, and
    // the read-only port then falls back to the primary.
    lands_on("read-only port on a replica", ro, "t").await;
    // No synchronous standby: the standby service falls back to the primary.
    assert_eq!(
        eventually("standby service serves", WAIT, || select_one(conninfo(
            standby
        )))
        .await,
        "f"
    );
    let held = client(&conninfo(rw)).await.unwrap();

    // Reload with a new service: it starts listening; held sessions go on.
    write(
        &config,
        &format!("{base}{shutdown}\n[services.extra]\nlisten = \"127.0.0.1:{extra}\"\nselect = \"replica\"\n"),
    );
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    lands_on("new service after SIGHUP", extra, "t").await;
    held.simple_query("SELECT 1")
        .await
        .expect("session survives the reload");

    // Moving a listener: the new address serves, the old one is closed,
    // sessions go on.
    let extra2 = free_port();
    write(
        &config,
        &format!("{base}{shutdown}\n[services.extra]\nlisten = \"127.0.0.1:{extra2}\"\nselect = \"replica\"\n"),
    );
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    lands_on("moved service", extra2, "t").await;
    eventually("old address closed", WAIT, || async move {
        match std::net::TcpStream::connect(("127.0.0.1", extra)) {
            Err(_) => Ok(()),
            Ok(_) => Err("still listening".to_string()),
        }
    })
    .await;
    held.simple_query("SELECT 1")
        .await
        .expect("session survives the move");

    // A bad file is refused with file, line and key; everything keeps running.
    write(&config, &format!("{base}{shutdown}\n[services.extra]\nlisten = \"127.0.0.1:{extra2}\"\nselect = \"replica\"\nbogus = 1\n"));
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    eventually("reload rejected in the log", WAIT, || {
        let log = pg.log();
        async move {
            if log.contains("reload rejected")
                && log.contains("bogus")
                && log.contains("pgwarden.toml")
            {
                Ok(())
            } else {
                Err(log)
            }
        }
    })
    .await;
    held.simple_query("SELECT 1").await.expect("still serving");
    assert_eq!(
        select_one(conninfo(extra2)).await.unwrap(),
        "t",
        "old config stays"
    );

    // A reload whose files do not all load is refused as a whole: here a
    // new service and an [auth] section whose hba file is missing. Neither
    // takes effect (before, the service stayed unbound and the log blamed a
    // listener).
    let extra3 = free_port();
    write(&config, &format!("{base}{shutdown}\n[services.extra]\nlisten = \"127.0.0.1:{extra2}\"\nselect = \"replica\"\n[services.more]\nlisten = \"127.0.0.1:{extra3}\"\nselect = \"replica\"\n[auth]\nhba_file = \"missing_hba.conf\"\nauth_user = \"postgres\"\n"));
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    eventually("second reload rejected in the log", WAIT, || {
        let log = pg.log();
        async move {
            if log.matches("reload rejected").count() == 2 && log.contains("missing_hba.conf") {
                Ok(())
            } else {
                Err(log)
            }
        }
    })
    .await;
    assert!(!pg.log().contains("could not be bound"), "{}", pg.log());
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", extra3)).is_err(),
        "the new service of a refused reload does not listen"
    );
    held.simple_query("SELECT 1").await.expect("still serving");

    // In one reload a service may take an address another gives up: a
    // rename on the same port, then two services swapping ports. No port
    // is left without a listener.
    write(
        &config,
        &format!("{base}{shutdown}\n[services.renamed]\nlisten = \"127.0.0.1:{extra2}\"\nselect = \"replica\"\n"),
    );
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    eventually("the renamed service listens", WAIT, || {
        let log = pg.log();
        async move {
            log.contains("renamed")
                .then_some(())
                .ok_or("not yet".to_string())
        }
    })
    .await;
    assert_eq!(select_one(conninfo(extra2)).await.unwrap(), "t");
    let swapped = base.replace(
        &format!("listen = \"127.0.0.1:{standby}\""),
        &format!("listen = \"127.0.0.1:{extra2}\""),
    );
    write(
        &config,
        &format!("{swapped}{shutdown}\n[services.renamed]\nlisten = \"127.0.0.1:{standby}\"\nselect = \"replica\"\n"),
    );
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    // The standby service (no synchronous standby: the primary) now on
    // the renamed one's port, and the other way round.
    lands_on("standby service on its new port", extra2, "f").await;
    lands_on("renamed service on its new port", standby, "t").await;
    assert!(!pg.log().contains("could not be bound"), "{}", pg.log());

    // A host taken out of the file: its sessions end, saying so (not that
    // the server is down).
    let reader = client(&conninfo(ro)).await.unwrap();
    let port = common::one(&reader, "SELECT inet_server_port()").await;
    let gone = [c.addr(1), c.addr(2)]
        .into_iter()
        .find(|a| a.ends_with(&format!(":{port}")))
        .expect("the read-only session is on a replica");
    let fewer = swapped.replace(&format!(", \"{gone}\""), "");
    assert_ne!(fewer, swapped);
    write(
        &config,
        &format!("{fewer}{shutdown}\n[services.renamed]\nlisten = \"127.0.0.1:{standby}\"\nselect = \"replica\"\n"),
    );
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    eventually("the session on the removed host ends", WAIT, || async {
        match reader.simple_query("SELECT 1").await {
            Ok(_) => Err("still open".to_string()),
            Err(_) => Ok(()),
        }
    })
    .await;
    let log = pg.log();
    assert!(
        log.contains("HostRemoved") && !log.contains("HostDown"),
        "{log}"
    );

    // SIGTERM: no new connections; the idle session is ended with 57P01
    // after shutdown_timeout, and the process exits.
    let mut pg = pg;
    pg.signal(nix::sys::signal::Signal::SIGTERM);
    exits_ending(&mut pg, &held).await;
}

/// A second SIGINT during the wait for sessions (shutdown_timeout, here an
/// hour) ends them at once, with 57P01, and the process exits; the first
/// only stopped new connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_ends_the_wait_for_sessions() {
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (rw, ro, http) = (free_port(), free_port(), free_port());
    let config = dir.path().join("pgwarden.toml");
    write(
        &config,
        &listening(
            &[c.addr(0)],
            (rw, ro, http),
            "[engine]\nshutdown_timeout = \"1h\"\n",
        ),
    );
    let mut pg = Running::start(&config, dir.path());
    eventually("read-write port serves", WAIT, || select_one(conninfo(rw))).await;
    let held = client(&conninfo(rw)).await.unwrap();
    pg.signal(nix::sys::signal::Signal::SIGINT);
    eventually("the shutdown begins", WAIT, || {
        let log = pg.log();
        async move { log.contains("shutting down").then_some(()).ok_or(log) }
    })
    .await;
    // The held session is waited for.
    held.simple_query("SELECT 1")
        .await
        .expect("the session goes on during the wait");
    assert!(pg.child.try_wait().unwrap().is_none(), "{}", pg.log());
    pg.signal(nix::sys::signal::Signal::SIGINT);
    exits_ending(&mut pg, &held).await;
    assert!(pg.log().contains("second signal"), "{}", pg.log());
}

/// The FIFO at `path` opened for writing once a reader has it open. Opened
/// without blocking and tried again: a reader that never comes (the
/// process died) fails the test instead of hanging it.
async fn fifo_writer(path: &Path) -> std::fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    eventually("the file is opened for reading", WAIT, || {
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::libc::O_NONBLOCK)
            .open(path);
        async move { opened.map_err(|e| e.to_string()) }
    })
    .await
}

/// A SIGHUP sent while pgwarden is still reading its configuration (a
/// service manager's reload, a log rotation, right after a start) does not
/// end the process: the file is read again once it runs. The file is a
/// FIFO here, so the test knows when pgwarden is reading it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_during_start_up_is_a_reload() {
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (rw, ro, http, extra) = (free_port(), free_port(), free_port(), free_port());
    let config = dir.path().join("pgwarden.toml");
    nix::unistd::mkfifo(
        &config,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
    let mut pg = Running::start(&config, dir.path());
    // The FIFO opens for writing once pgwarden opened it to read the file:
    // it is starting up, and would not survive a hang-up yet.
    let mut writer = fifo_writer(&config).await;
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    // A small write to a pipe goes in whole.
    writer
        .write_all(listening(&[c.addr(0)], (rw, ro, http), "").as_bytes())
        .unwrap();
    drop(writer);
    eventually("read-write port serves", WAIT, || select_one(conninfo(rw))).await;
    // The reload that follows reads the file again, now with a service
    // more.
    let mut writer = fifo_writer(&config).await;
    writer
        .write_all(
            listening(
                &[c.addr(0)],
                (rw, ro, http),
                &format!(
                    "[services.extra]\nlisten = \"127.0.0.1:{extra}\"\nselect = \"primary\"\n"
                ),
            )
            .as_bytes(),
        )
        .unwrap();
    drop(writer);
    eventually("the reloaded service serves", WAIT, || {
        select_one(conninfo(extra))
    })
    .await;
    assert!(pg.child.try_wait().unwrap().is_none(), "{}", pg.log());
    assert!(pg.log().contains("configuration reloaded"), "{}", pg.log());
    pg.signal(nix::sys::signal::Signal::SIGTERM);
    exits_cleanly(&mut pg).await;
}

/// A reload that writes a running host's name in another case keeps the
/// host: host names are case-insensitive, so its sessions go on and it
/// keeps its name (and metric series) rather than being replaced by a
/// "new" host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_a_host_names_case_keeps_the_host() {
    let c = TestCluster::builder().replicas(0).start();
    let port = c.addr(0).rsplit_once(':').unwrap().1.to_string();
    let dir = tempfile::tempdir().unwrap();
    let (rw, ro, http) = (free_port(), free_port(), free_port());
    let config = dir.path().join("pgwarden.toml");
    let with = |host: &str| {
        listening(&[format!("{host}:{port}")], (rw, ro, http), "")
            .replace("[listen]", "probe_interval = \"100ms\"\n[listen]")
    };
    write(&config, &with("localhost"));
    let pg = Running::start(&config, dir.path());
    eventually("read-write port serves", WAIT, || select_one(conninfo(rw))).await;
    let held = client(&conninfo(rw)).await.unwrap();
    let cluster = || {
        let (status, body) = common::http_get(
            std::net::SocketAddr::from(([127, 0, 0, 1], http)),
            "/cluster",
        );
        assert_eq!(status, 200, "{body}");
        let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
        let round = doc["round"].as_u64().unwrap_or_else(|| panic!("{doc}"));
        (round, body)
    };
    write(&config, &with("LocalHost"));
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    eventually("the reload", WAIT, || {
        let log = pg.log();
        async move {
            log.contains("configuration reloaded")
                .then_some(())
                .ok_or(log)
        }
    })
    .await;
    // A few probe rounds after it, the host is the one it was.
    let after = cluster().0;
    eventually("three more rounds", WAIT, || {
        let (round, _) = cluster();
        async move { (round >= after + 3).then_some(()).ok_or(round.to_string()) }
    })
    .await;
    let body = cluster().1;
    assert!(
        body.contains(&format!("localhost:{port}")) && !body.contains("LocalHost"),
        "{body}"
    );
    held.simple_query("SELECT 1")
        .await
        .expect("the session goes on");
}

#[test]
fn invalid_config_at_start_names_file_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad.toml");
    write(
        &config,
        "[cluster]\nhosts = [\"127.0.0.1:5432\"]\nprobe_interval = \"5 parsecs\"\n",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["run", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.toml") && err.contains("probe_interval") && err.contains('3'),
        "{err}"
    );
}

/// PgBouncer's operator commands through `pgwarden run`: the connection
/// caps come from the file (SHOW CONFIG), DISABLE refuses new clients of a
/// database (55000) while its connected clients go on, ENABLE lets them in
/// again, and SHUTDOWN stops the process as SIGTERM does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_console_disable_enable_and_shutdown() {
    let c = TestCluster::builder().replicas(0).start();
    let (rw, ro, http) = (free_port(), free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pgwarden.toml");
    write(
        &config,
        &listening(
            &[c.addr(0)],
            (rw, ro, http),
            "[engine]\nshutdown_timeout = \"5s\"\n\
             [pool]\nmode = \"transaction\"\nsize = 3\nmax_db_connections = 2\n\
             max_user_connections = 4\nadmin_users = [\"postgres\"]\n\
             [pool.databases.postgres]\nmax_db_connections = 1\n",
        ),
    );
    let mut pg = Running::start(&config, dir.path());
    lands_on("read-write port", rw, "f").await;
    let console = client(&conninfo(rw).replace("dbname=postgres", "dbname=pgwarden"))
        .await
        .unwrap();
    let mut shown = std::collections::HashMap::new();
    for m in console.simple_query("SHOW CONFIG").await.unwrap() {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            shown.insert(
                r.get("key").unwrap().to_string(),
                (
                    r.get("value").unwrap().to_string(),
                    r.get("changeable").unwrap().to_string(),
                    r.get("default").unwrap().to_string(),
                ),
            );
        }
    }
    assert_eq!(shown["pool.max_db_connections"].0, "2");
    assert_eq!(shown["pool.max_user_connections"].0, "4");
    assert_eq!(shown["pool.mode"].0, "transaction");
    // What a RELOAD changes, and what needs a restart.
    assert_eq!(shown["pool.size"].1, "yes");
    assert_eq!(shown["cluster.probe_interval"].1, "yes");
    assert_eq!(shown["engine.worker_threads"].1, "no");
    // The value a key has when the file does not set it, as PgBouncer's
    // SHOW CONFIG has it.
    assert_eq!(shown["pool.size"].2, "20");
    assert_eq!(shown["pool.mode"].2, "session");
    assert_eq!(shown["engine.shutdown_timeout"].2, "30s");
    // And under PgBouncer's own names and units, for tools that read those
    // (pgbouncer_exporter's max_client_conn, say).
    assert_eq!(shown["max_db_connections"].0, "2");
    assert_eq!(
        shown["default_pool_size"],
        ("3".into(), "yes".into(), "20".into())
    );
    assert_eq!(shown["pool_mode"].0, "transaction");
    assert_eq!(shown["max_client_conn"].2, shown["pool.max_client_conn"].2);
    assert_eq!(
        shown["services.read_write"].0,
        format!("listen=127.0.0.1:{rw} select=primary read_only=false pool_mode=transaction")
    );

    let connected = client(&conninfo(rw)).await.unwrap();
    console.batch_execute("DISABLE postgres").await.unwrap();
    let err = client(&conninfo(rw)).await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("55000"), "{err}");
    let msg = err.as_db_error().unwrap().message();
    assert!(
        msg.contains("database \"postgres\" is not currently accepting connections"),
        "{msg}"
    );
    // Clients already in go on; other databases and the console too.
    assert_eq!(common::one(&connected, "SELECT 7").await, "7");
    let err = console.batch_execute("DISABLE pgwarden").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("22023"), "{err}");
    console.batch_execute("ENABLE postgres").await.unwrap();
    let again = client(&conninfo(rw)).await.unwrap();
    assert_eq!(common::one(&again, "SELECT 8").await, "8");
    let err = console.batch_execute("SUSPEND").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("0A000"), "{err}");

    // RELOAD answers how the reload went: a broken file is refused with
    // its error, and the running configuration stays.
    let good = std::fs::read_to_string(&config).unwrap();
    write(&config, &format!("{good}\n[pool]\nsize = \"lots\"\n"));
    let err = console.batch_execute("RELOAD").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("F0000"), "{err}");
    let msg = err.as_db_error().unwrap().message().to_string();
    assert!(
        msg.contains("not reloaded") && msg.contains("pgwarden.toml"),
        "{msg}"
    );
    // A command the console refuses as written does not reload first.
    let rejected = pg.log().matches("reload rejected").count();
    for bad in ["RELOAD; SHOW POOLS", "RELOAD now"] {
        let err = console.batch_execute(bad).await.unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("0A000"), "{bad}: {err}");
    }
    assert_eq!(
        pg.log().matches("reload rejected").count(),
        rejected,
        "a refused command reloaded"
    );
    // A reload shows what it changed, and what needs a restart as it is
    // in force.
    write(
        &config,
        &good.replace("size = 3", "size = 4").replace(
            "shutdown_timeout = \"5s\"",
            "shutdown_timeout = \"5s\"\nworker_threads = 7",
        ),
    );
    console.batch_execute("RELOAD").await.unwrap();
    assert_eq!(common::one(&again, "SELECT 9").await, "9");
    let mut after = std::collections::HashMap::new();
    for m in console.simple_query("SHOW CONFIG").await.unwrap() {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            after.insert(
                r.get("key").unwrap().to_string(),
                r.get("value").unwrap().to_string(),
            );
        }
    }
    assert_eq!(after["pool.size"], "4");
    assert_eq!(
        after["engine.worker_threads"],
        shown["engine.worker_threads"].0
    );
    assert_ne!(after["engine.worker_threads"], "7");

    console.batch_execute("SHUTDOWN").await.unwrap();
    // Sessions may finish (up to shutdown_timeout); a RELOAD meanwhile is
    // answered at once, not left waiting through it.
    let reload =
        tokio::time::timeout(Duration::from_secs(3), console.batch_execute("RELOAD")).await;
    assert!(
        matches!(reload, Ok(Err(_))),
        "RELOAD while shutting down: {reload:?}"
    );
    drop((console, connected, again));
    let status = eventually("process exit", WAIT, || {
        let s = pg.child.try_wait().unwrap();
        async move { s.ok_or_else(|| "running".to_string()) }
    })
    .await;
    assert!(status.success(), "{status:?}\n{}", pg.log());
    assert!(pg.log().contains("SHUTDOWN"), "{}", pg.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg_through_both_ports() {
    psycopg_run("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg_through_transaction_pooling() {
    psycopg_run("[pool]\nmode = \"transaction\"\nsize = 2\n").await;
}

async fn psycopg_run(extra: &str) {
    let c = TestCluster::builder().replicas(1).start();
    let (rw, ro, http) = (free_port(), free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pgwarden.toml");
    write(
        &config,
        &listening(&[c.addr(0), c.addr(1)], (rw, ro, http), extra),
    );
    let _pg = Running::start(&config, dir.path());
    lands_on("read-only port on the replica", ro, "t").await;
    common::python_client("psycopg_ops.py", vec![rw.to_string(), ro.to_string()]).await;
}

/// When the auth query fails, the client gets "authentication is
/// unavailable" and the log says why in the server's words (a missing
/// relation here), not tokio-postgres's bare "db error".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_auth_query_is_logged_with_the_servers_reason() {
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (pg, rw) = run_with_auth(
        &c,
        dir.path(),
        TRUST_POSTGRES,
        "",
        "auth_query = \"SELECT usename, passwd FROM no_such_verifiers WHERE usename = $1\"\n",
    )
    .await;
    let refused = eventually("pgwarden answers", WAIT, || async {
        match client(&format!(
            "host=127.0.0.1 port={rw} user=alice password=x dbname=postgres"
        ))
        .await
        {
            Ok(_) => Err("logged in".to_string()),
            Err(e) if e.as_db_error().is_some() => Ok(e),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    assert_eq!(sqlstate(&refused).as_deref(), Some("08006"), "{refused}");
    let log = pg.log();
    assert!(
        log.contains("relation \"no_such_verifiers\" does not exist (42P01)"),
        "{log}"
    );
}

/// `cluster.password_file` is relative to the configuration file, a reload
/// naming a file that cannot be read is refused as a start would be, and a
/// changed password says what takes it when.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_file_is_relative_to_the_config_and_checked_on_reload() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pgwarden.toml");
    write(&dir.path().join("probe.pw"), "secret\n");
    let ports = (free_port(), free_port(), free_port());
    let hosts = [format!("127.0.0.1:{}", free_port())];
    let with = |extra: &str| {
        format!(
            "{}shutdown_timeout = \"1s\"\n",
            listening(&hosts, ports, &format!("{extra}[engine]\n"))
        )
    };
    // The relative name sits inside [cluster], before [listen].
    let file = |line: &str| with("").replacen("[listen]", &format!("{line}\n[listen]"), 1);
    write(&config, &file("password_file = \"probe.pw\""));
    // The test's working directory is not the file's.
    assert_ne!(std::env::current_dir().unwrap(), dir.path());
    let check = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["run", "--check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let pg = Running::start(&config, dir.path());
    eventually("listening", WAIT, || async move {
        std::net::TcpStream::connect(("127.0.0.1", ports.0))
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await;

    write(&config, &file("password_file = \"missing.pw\""));
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    eventually("reload refused for the missing file", WAIT, || {
        let log = pg.log();
        async move {
            (log.contains("reload rejected") && log.contains("missing.pw"))
                .then_some(())
                .ok_or(log)
        }
    })
    .await;

    write(&config, &file("password = \"other\""));
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    eventually("the new password taken at once", WAIT, || {
        let log = pg.log();
        async move {
            (log.contains("probe settings changed") && log.contains("configuration reloaded"))
                .then_some(())
                .ok_or(log)
        }
    })
    .await;
    assert!(pg.child.id() > 0);
}

/// Pooled server connections find their password file line by their own
/// host, database and user, as libpq would: here only the replica, listed
/// second, asks for a password, and only its line holds one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_servers_take_their_own_password_file_line() {
    let mut c = TestCluster::builder().replicas(1).start();
    common::sql(&c.conninfo(0), "ALTER ROLE postgres PASSWORD 'replica-pw'").await;
    let replica = c.conninfo(1);
    eventually("the password on the replica", WAIT, || {
        let replica = replica.clone();
        async move {
            let q = "SELECT rolpassword IS NOT NULL FROM pg_authid WHERE rolname = 'postgres'";
            match common::sql_value(&replica, q).await.as_deref() {
                Some("t") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    c.set_hba(1, "host all all 127.0.0.1/32 scram-sha-256\n");
    let dir = tempfile::tempdir().unwrap();
    let pgpass = dir.path().join("pgpass");
    write(
        &pgpass,
        &format!("127.0.0.1:{}:postgres:postgres:replica-pw\n", c.port(1)),
    );
    std::fs::set_permissions(&pgpass, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let config = dir.path().join("pgwarden.toml");
    let ports = (free_port(), free_port(), free_port());
    write(
        &config,
        &listening(
            &c.addrs(),
            ports,
            "[pool]\nmode = \"transaction\"\nsize = 2\n",
        ),
    );
    let stderr = dir.path().join("pgwarden.stderr");
    let child = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["run", "--config"])
        .arg(&config)
        .env("PGPASSFILE", &pgpass)
        .env_remove("PGPASSWORD")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .expect("start pgwarden run");
    let pg = Running { child, stderr };
    // The replica answers through the pool only with its own line's
    // password; the primary, listed first, has none and needs none.
    lands_on("read-only port on the replica", ports.1, "t").await;
    lands_on("read-write port on the primary", ports.0, "f").await;
    let log = pg.log();
    assert!(!log.contains("authentication failed"), "{log}");
}

/// The probe's settings are reloaded: a new role, and a new interval,
/// take effect on SIGHUP without a restart, and the old connections go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_settings_are_reloaded() {
    let c = TestCluster::builder().replicas(0).start();
    common::sql(
        &c.conninfo(0),
        "CREATE ROLE prober LOGIN; GRANT pg_monitor TO prober",
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pgwarden.toml");
    let ports = (free_port(), free_port(), free_port());
    let with = |user: &str, interval: &str| {
        listening(&[c.addr(0)], ports, "").replacen(
            "[listen]",
            &format!("user = \"{user}\"\nprobe_interval = \"{interval}\"\n[listen]"),
            1,
        )
    };
    // An hour between rounds: after the first, none before the reload.
    write(&config, &with("postgres", "1h"));
    let pg = Running::start(&config, dir.path());
    lands_on("read-write port", ports.0, "f").await;
    let probers = |user: &'static str| {
        let conninfo = c.conninfo(0);
        async move {
            common::sql_value(
                &conninfo,
                &format!(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE application_name = 'pgwarden-probe' AND usename = '{user}'"
                ),
            )
            .await
            .unwrap_or_default()
        }
    };
    assert_eq!(probers("postgres").await, "1");
    let round = || {
        let (status, body) = common::http_get(
            std::net::SocketAddr::from(([127, 0, 0, 1], ports.2)),
            "/cluster",
        );
        assert_eq!(status, 200, "{body}");
        let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
        doc["round"].as_u64().unwrap_or_else(|| panic!("{doc}"))
    };
    let before = round();

    write(&config, &with("prober", "100ms"));
    pg.signal(nix::sys::signal::Signal::SIGHUP);
    eventually("the probe connects as the new role", WAIT, || async {
        match (
            probers("prober").await.as_str(),
            probers("postgres").await.as_str(),
        ) {
            ("1", "0") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    eventually("rounds at the new interval", WAIT, || async {
        let now = round();
        (now >= before + 5)
            .then_some(())
            .ok_or(format!("{before} -> {now}"))
    })
    .await;
    let log = pg.log();
    assert!(!log.contains("next restart"), "{log}");
}

/// A login whose verifier must be looked up while no primary is known
/// (pgwarden just started, the primary is coming up) waits for one rather
/// than failing at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verifier_lookup_waits_for_the_primary() {
    let mut c = TestCluster::builder().replicas(0).start();
    common::sql(
        &c.conninfo(0),
        "CREATE ROLE alice LOGIN PASSWORD 'alice-pw'",
    )
    .await;
    c.node(0)
        .stop(pgwarden_pgctl::StopMode::Fast)
        .expect("stop the primary");
    let dir = tempfile::tempdir().unwrap();
    let (pg, rw) = run_with_auth(
        &c,
        dir.path(),
        TRUST_POSTGRES,
        "connect_wait_timeout = \"20s\"",
        "",
    )
    .await;
    let conninfo = format!("host=127.0.0.1 port={rw} user=alice password=alice-pw dbname=postgres");
    let login = tokio::spawn(async move { client(&conninfo).await });
    // The client is waiting on its lookup before the primary returns.
    let down = format!("127.0.0.1:{} is down", c.port(0));
    eventually("the login waits", WAIT, || {
        let log = pg.log();
        let seen = log.contains(&down);
        async move { seen.then_some(()).ok_or(log) }
    })
    .await;
    c.node(0).start().expect("start the primary");
    let alice = login
        .await
        .unwrap()
        .expect("alice logs in once the primary is up");
    assert_eq!(common::one(&alice, "SELECT current_user").await, "alice");
}

/// Logins that need the auth query while there is no primary each wait
/// their own `connect_wait_timeout` for one, side by side: they used to
/// wait one after the other on the lookup, the fifth failing after five
/// times the wait (or the client's `auth_timeout`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_waiting_for_a_primary_wait_side_by_side() {
    let mut c = TestCluster::builder().replicas(0).start();
    c.node(0)
        .stop(pgwarden_pgctl::StopMode::Fast)
        .expect("stop the primary");
    let dir = tempfile::tempdir().unwrap();
    let (pg, rw) = run_with_auth(
        &c,
        dir.path(),
        "host all all 127.0.0.1/32 scram-sha-256\n",
        "connect_wait_timeout = \"2s\"",
        "",
    )
    .await;
    let started = std::time::Instant::now();
    let logins: Vec<_> = (0..5)
        .map(|i| {
            let conninfo =
                format!("host=127.0.0.1 port={rw} user=user{i} password=pw dbname=postgres");
            tokio::spawn(async move {
                let refused = client(&conninfo).await.err().map(|e| sqlstate(&e));
                (refused, started.elapsed())
            })
        })
        .collect();
    for login in logins {
        let (refused, after) = login.await.unwrap();
        // The lookup's own failure, not the end of auth_timeout.
        assert_eq!(refused, Some(Some("08006".to_string())), "{}", pg.log());
        assert!(
            // In turn, the last would wait five times the 2 s.
            after < Duration::from_secs(8),
            "refused after {after:?}: the logins waited in turn"
        );
    }
}

/// An auth query that outlasts its time-out leaves the connection it
/// runs on: the next lookup opens another rather than queueing behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_auth_query_does_not_hold_up_the_next_login() {
    let c = TestCluster::builder().replicas(0).start();
    common::sql(
        &c.conninfo(0),
        "CREATE ROLE alice LOGIN PASSWORD 'alice-pw'; CREATE ROLE slow LOGIN PASSWORD 'slow-pw'",
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    // The lookup of `slow` runs far past the 5 s the query is given.
    let (pg, rw) = run_with_auth(
        &c,
        dir.path(),
        TRUST_POSTGRES,
        "",
        "auth_query = \"SELECT usename, passwd FROM pg_catalog.pg_shadow WHERE usename = $1 \
         AND EXISTS (SELECT 1 FROM pg_catalog.pg_sleep(CASE WHEN $1 = 'slow' THEN 60 ELSE 0 END))\"\n",
    )
    .await;
    let login = |user: &'static str| async move {
        client(&format!(
            "host=127.0.0.1 port={rw} user={user} password={user}-pw dbname=postgres"
        ))
        .await
    };
    // postgres needs no lookup (trust): the primary is known.
    lands_on("read-write port", rw, "f").await;
    assert!(login("slow").await.is_err(), "{}", pg.log());
    assert!(pg.log().contains("auth query timed out"), "{}", pg.log());
    let alice = login("alice")
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", pg.log()));
    assert_eq!(common::one(&alice, "SELECT current_user").await, "alice");
}

/// An agent whose etcd does not answer yet (with a user name, the client
/// logs in when it connects, so the agent retries until etcd answers): its
/// connection manager already
/// listens (so a port in use stops the node before it joins the cluster),
/// a SIGHUP meanwhile (`systemctl reload`) does not end the process, and
/// SIGTERM stops it cleanly. A port in use makes the agent exit before it
/// ever tries etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_waiting_for_etcd_listens_survives_sighup_and_stops() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.toml");
    let (rw, ro, http) = (free_port(), free_port(), free_port());
    let text = format!(
        "[agent]\nname = \"n1\"\ndata_dir = \"{}\"\npg_listen = \"127.0.0.1:{}\"\napi = \"127.0.0.1:{}\"\n\n\
         [etcd]\nendpoints = [\"127.0.0.1:{}\"]\ncluster = \"demo\"\nusername = \"root\"\npassword = \"x\"\n\n\
         [listen]\nread_write = \"127.0.0.1:{rw}\"\nread_only = \"127.0.0.1:{ro}\"\nhttp = \"127.0.0.1:{http}\"\n",
        dir.path().join("data").display(),
        free_port(),
        free_port(),
        free_port(),
    );
    write(&config, &text);
    let mut agent = Running::command("agent", &config, dir.path());
    let tries = |log: &str| log.matches("cannot reach etcd yet").count();
    eventually("the agent waits for etcd", WAIT, || {
        let log = agent.log();
        async move { (tries(&log) > 0).then_some(()).ok_or(log) }
    })
    .await;
    std::net::TcpStream::connect(("127.0.0.1", rw)).expect("the read-write port listens");
    agent.signal(nix::sys::signal::Signal::SIGHUP);
    let before = tries(&agent.log());
    eventually("the agent goes on waiting after SIGHUP", WAIT, || {
        let log = agent.log();
        async move { (tries(&log) > before).then_some(()).ok_or(log) }
    })
    .await;
    assert!(agent.child.try_wait().unwrap().is_none(), "{}", agent.log());
    agent.signal(nix::sys::signal::Signal::SIGTERM);
    let status = eventually("the agent exits", WAIT, || {
        let s = agent.child.try_wait().unwrap();
        async move { s.ok_or_else(|| "running".to_string()) }
    })
    .await;
    assert!(status.success(), "{status:?}\n{}", agent.log());

    // The read-write port taken: the agent stops at once, with the port
    // named, and never tries etcd.
    let taken = std::net::TcpListener::bind(("127.0.0.1", rw)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["agent", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    drop(taken);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{rw}")), "{err}");
    assert!(!err.contains("cannot reach etcd"), "{err}");
}

/// `[log]` sets the level and the format: with `warn` and `json`, every
/// line is a JSON object and none is at INFO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_section_sets_level_and_format() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pgwarden.toml");
    // Nothing listens at the host: the probe warns that it is down.
    write(
        &config,
        &format!(
            "{}[log]\nlevel = \"warn\"\nformat = \"json\"\n",
            listening(
                &[format!("127.0.0.1:{}", free_port())],
                (free_port(), free_port(), free_port()),
                ""
            )
        ),
    );
    let pg = Running::start(&config, dir.path());
    eventually("a warning is logged", WAIT, || {
        let log = pg.log();
        async move { log.contains("is down").then_some(()).ok_or(log) }
    })
    .await;
    let log = pg.log();
    for line in log.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert_ne!(v["level"], "INFO", "{line}");
    }
}

/// Ctrl-C while `pgwarden demo` still starts its cluster (the first agent
/// creating it) stops every process it started and removes its directory.
#[test]
fn a_demo_interrupted_while_it_starts_cleans_up() {
    stop_demo(false);
}

/// Ctrl-C once the demo's cluster runs stops it, promptly, and removes
/// its directory.
#[test]
fn a_running_demo_stops_at_ctrl_c_and_cleans_up() {
    stop_demo(true);
}

/// Starts `pgwarden demo` with one replica, sends it SIGINT while it
/// starts or once it runs, and checks that it ends within 30 s leaving no
/// directory and no process behind.
fn stop_demo(running: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (stdout, stderr) = (
        dir.path().join("demo.stdout"),
        dir.path().join("demo.stderr"),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["demo", "--replicas", "1", "--quiet"])
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .expect("start pgwarden demo");
    let read = |f: &Path| std::fs::read_to_string(f).unwrap_or_default();
    let until = |what: &str, within: Duration, mut done: Box<dyn FnMut() -> bool + '_>| {
        let deadline = std::time::Instant::now() + within;
        while !done() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}: {}{}",
                read(&stdout),
                read(&stderr)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // "etcd on ...; starting 2 agents under BASE"
    let mut base = None;
    until(
        "the agents to start",
        Duration::from_secs(90),
        Box::new(|| {
            base = read(&stderr).lines().find_map(|l| {
                l.split_once(" agents under ")
                    .map(|(_, b)| b.trim().to_string())
            });
            base.is_some()
        }),
    );
    let base = std::path::PathBuf::from(base.unwrap());
    if running {
        until(
            "the cluster to run",
            Duration::from_secs(120),
            Box::new(|| read(&stdout).contains("Ctrl-C stops everything")),
        );
    } else {
        // Once a PostgreSQL process works in the first node's directory
        // (the single-user server of its initdb, or the server itself):
        // there is something to stop, which the agent's death alone does
        // not.
        until(
            "the first node's server",
            Duration::from_secs(90),
            Box::new(|| base.join("n1").join("postmaster.pid").exists()),
        );
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    until(
        "the demo to exit",
        Duration::from_secs(30),
        Box::new(|| child.try_wait().unwrap().is_some()),
    );
    assert!(
        !base.exists(),
        "{} left behind: {}",
        base.display(),
        read(&stderr)
    );
    // Nothing it started runs on: no process names its directory.
    let needle = base.to_string_lossy().into_owned();
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let cmdline = std::fs::read(e.ok()?.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline.contains(&needle).then_some(cmdline)
        })
        .collect();
    assert!(left.is_empty(), "still running: {left:?}");
}
