//! `pgwarden topology` from the outside, as an operator runs it.

use std::process::Command;

use pgwarden_testkit::{free_port, TestCluster};

fn pgwarden(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run pgwarden");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn json_round_has_the_documented_fields_and_errors_stay_per_host() {
    let c = TestCluster::builder().replicas(1).start();
    let refused = format!("127.0.0.1:{}", free_port());
    let hosts = format!("{},{},{refused}", c.addr(0), c.addr(1));
    let (ok, stdout, stderr) = pgwarden(&[
        "topology",
        "--hosts",
        &hosts,
        "--once",
        "--json",
        "--interval-ms",
        "300",
    ]);
    assert!(ok, "exit failure: {stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON document per round: {stdout}");
    let doc: serde_json::Value = serde_json::from_str(lines[0]).expect("JSON");
    assert_eq!(doc["primary"], serde_json::json!(c.addr(0)));
    assert_eq!(doc["quorum_commit"], false);
    assert_eq!(doc["conflict"], false);
    let hosts = doc["hosts"].as_array().unwrap();
    assert_eq!(hosts.len(), 3);
    for h in hosts {
        for field in [
            "host",
            "port",
            "role",
            "alive",
            "sync_state",
            "lag_bytes",
            "replay_delay_ms",
            "delayed",
            "rtt_ms",
            "timeline",
            "error",
            "failed_probes",
        ] {
            assert!(h.get(field).is_some(), "field {field} missing in {h}");
        }
    }
    assert_eq!(hosts[0]["role"], "primary");
    assert_eq!(hosts[0]["alive"], true);
    assert_eq!(hosts[0]["timeline"], 1);
    assert_eq!(hosts[1]["role"], "replica");
    assert_eq!(hosts[1]["sync_state"], "async");
    assert_eq!(hosts[1]["lag_bytes"], 0);
    assert!(hosts[1]["rtt_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(hosts[2]["role"], "unknown");
    assert_eq!(hosts[2]["alive"], false);
    let err = hosts[2]["error"].as_str().unwrap();
    assert!(err.contains("refused"), "error names the cause: {err}");
}

#[test]
fn table_shows_each_host_and_a_bad_database_as_that_hosts_error() {
    let c = TestCluster::builder().replicas(1).start();
    let hosts = format!("{},{}", c.addr(0), c.addr(1));
    let (ok, stdout, _) = pgwarden(&["topology", "--hosts", &hosts]);
    assert!(ok);
    assert!(stdout.contains("HOST"), "{stdout}");
    assert!(stdout.contains(&c.addr(0)) && stdout.contains(&c.addr(1)));
    assert!(stdout.contains("primary") && stdout.contains("replica"));

    let (ok, stdout, _) = pgwarden(&["topology", "--hosts", &hosts, "--dbname", "nosuchdb"]);
    assert!(ok, "connection errors are per-host, not a crash");
    assert!(stdout.contains("does not exist"), "{stdout}");
}

#[test]
fn select_prints_successive_picks() {
    let c = TestCluster::builder().replicas(2).start();
    let hosts = c.addrs().join(",");
    let (ok, stdout, stderr) = pgwarden(&[
        "topology",
        "--hosts",
        &hosts,
        "--select",
        "replica",
        "--count",
        "4",
        "--rounds",
        "2",
        "--interval-ms",
        "200",
        "--no-rtt-threshold",
    ]);
    assert!(ok, "{stderr}");
    let picks: Vec<&str> = stdout.lines().collect();
    assert_eq!(picks.len(), 4);
    // Round robin alternates between the two replicas, never the primary.
    assert_ne!(picks[0], picks[1]);
    assert_eq!(picks[0], picks[2]);
    assert_eq!(picks[1], picks[3]);
    assert!(picks.iter().all(|p| *p == c.addr(1) || *p == c.addr(2)));

    let (ok, stdout, _) = pgwarden(&[
        "topology", "--hosts", &hosts, "--select", "primary", "--count", "2", "--rounds", "1",
    ]);
    assert!(ok);
    assert_eq!(stdout.lines().collect::<Vec<_>>(), [c.addr(0), c.addr(0)]);
}

#[test]
fn bad_arguments_are_clear_errors() {
    let (ok, _, stderr) = pgwarden(&["topology", "--hosts", "localhost"]);
    assert!(!ok);
    assert!(
        stderr.contains("localhost") && stderr.contains("port"),
        "{stderr}"
    );
    let (ok, _, stderr) = pgwarden(&["topology", "--hosts", "a:1", "--select", "leader"]);
    assert!(!ok);
    assert!(stderr.contains("leader"), "{stderr}");
    // A window no duration can hold is refused, not a crash.
    for bad in ["-1", "NaN", "inf", "1e300"] {
        let flag = format!("--rtt-threshold-ms={bad}");
        let (ok, _, stderr) = pgwarden(&["topology", "--hosts", "a:1", &flag]);
        assert!(!ok);
        assert!(
            stderr.contains("--rtt-threshold-ms") && !stderr.contains("panicked"),
            "{bad}: {stderr}"
        );
    }
}

/// `pgwarden run --check` / `agent --check` on `config` written to a file
/// in `dir`: success, stdout, stderr.
fn check(dir: &std::path::Path, command: &str, config: &str) -> (bool, String, String) {
    let path = dir.join("pgwarden.toml");
    std::fs::write(&path, config).unwrap();
    pgwarden(&[command, "--config", path.to_str().unwrap(), "--check"])
}

#[test]
fn check_loads_the_file_and_every_file_it_names_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    std::fs::write(dir.path().join("server.crt"), cert.pem()).unwrap();
    std::fs::write(dir.path().join("server.key"), key.serialize_pem()).unwrap();
    std::fs::write(
        dir.path().join("hba.conf"),
        "host all all 127.0.0.1/32 scram-sha-256\n",
    )
    .unwrap();
    let rw = free_port();
    let standalone = format!(
        "[cluster]\n\
         hosts = [\"127.0.0.1:5432\", \"127.0.0.1:5433\", \"127.0.0.1:5434\"]\n\
         user = \"postgres\"\n\
         [listen]\n\
         read_write = \"127.0.0.1:{rw}\"\n\
         read_only = \"127.0.0.1:{}\"\n\
         http = \"127.0.0.1:{}\"\n\
         [tls]\n\
         cert = \"server.crt\"\n\
         key = \"server.key\"\n\
         [auth]\n\
         hba_file = \"hba.conf\"\n\
         auth_user = \"pgwarden_auth\"\n",
        free_port(),
        free_port()
    );
    let (ok, out, err) = check(dir.path(), "run", &standalone);
    assert!(ok, "{err}");
    assert!(
        out.contains("configuration OK: 3 host(s)")
            && out.contains(&format!("read_write on 127.0.0.1:{rw}")),
        "{out}"
    );
    // Nothing was started: the read-write port is free.
    std::net::TcpListener::bind(("127.0.0.1", rw)).expect("the port is free");

    // Each file it names is loaded, and what is wrong is named.
    for (bad, names) in [
        (
            standalone.replace("server.key", "missing.key"),
            vec!["missing.key"],
        ),
        (standalone.replace("server.crt", "hba.conf"), vec!["TLS"]),
        (
            standalone.replace("hba.conf", "nowhere.conf"),
            vec!["nowhere.conf"],
        ),
        (
            standalone.replace("user = \"postgres\"", "user = \"postgres\"\nhostz = 1"),
            vec!["pgwarden.toml", "line 4", "hostz"],
        ),
        (
            format!("{standalone}auth_password_file = \"auth.pw\"\n"),
            vec!["pgwarden.toml: auth.auth_password_file", "auth.pw"],
        ),
        (
            standalone.replace(
                "user = \"postgres\"",
                "user = \"postgres\"\npassword_file = \"probe.pw\"",
            ),
            vec!["pgwarden.toml: cluster.password_file", "probe.pw"],
        ),
        (
            format!("{standalone}auth_password = \"x\"\nauth_password_file = \"auth.pw\"\n"),
            vec!["pgwarden.toml", "auth.auth_password_file", "keep only one"],
        ),
    ] {
        let (ok, out, err) = check(dir.path(), "run", &bad);
        assert!(!ok, "{bad}: {out}");
        for n in names {
            assert!(err.contains(n), "{n} not in: {err}");
        }
    }
    std::fs::write(
        dir.path().join("hba.conf"),
        "host all all 127.0.0.1/32 scram-sha-256\nhost all all 127.0.0.1/32 krb5\n",
    )
    .unwrap();
    let (ok, _, err) = check(dir.path(), "run", &standalone);
    assert!(!ok);
    assert!(err.contains("hba.conf:2:"), "{err}");

    // An agent's file: etcd's and the API's files too.
    let agent = format!(
        "[agent]\n\
         name = \"n1\"\n\
         data_dir = \"{}\"\n\
         pg_listen = \"127.0.0.1:{}\"\n\
         api = \"127.0.0.1:{}\"\n\
         [etcd]\n\
         endpoints = [\"127.0.0.1:{}\"]\n\
         cluster = \"demo\"\n\
         ca_file = \"etcd-ca.pem\"\n\
         [listen]\n\
         read_write = \"127.0.0.1:{rw}\"\n\
         read_only = \"127.0.0.1:{}\"\n\
         http = \"127.0.0.1:{}\"\n",
        dir.path().join("data").display(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port()
    );
    let (ok, _, err) = check(dir.path(), "agent", &agent);
    assert!(!ok);
    assert!(err.contains("etcd-ca.pem"), "{err}");
    std::fs::write(dir.path().join("etcd-ca.pem"), cert.pem()).unwrap();
    let (ok, out, err) = check(dir.path(), "agent", &agent);
    assert!(ok, "{err}");
    assert!(
        out.contains("member n1 of cluster demo (1 etcd endpoint(s))"),
        "{out}"
    );
    // A node's file is not for the standalone connection manager: run
    // alone, it would take writes to any primary without the leader key.
    let path = dir.path().join("pgwarden.toml");
    let (ok, _, err) = pgwarden(&["run", "--config", path.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("[agent]") && err.contains("pgwarden agent"),
        "{err}"
    );
    assert!(!dir.path().join("data").exists(), "nothing was created");
}

/// Two servers with different passwords, each with its own `.pgpass`
/// line: libpq matches the file per host, so both must be reachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgpass_is_looked_up_for_each_host() {
    let mut servers = [
        TestCluster::builder().replicas(0).start(),
        TestCluster::builder().replicas(0).start(),
    ];
    let dir = tempfile::tempdir().unwrap();
    let mut pgpass = String::new();
    for (i, c) in servers.iter_mut().enumerate() {
        let pw = format!("pw{i}");
        let (client, conn) = tokio_postgres::connect(&c.conninfo(0), tokio_postgres::NoTls)
            .await
            .unwrap();
        let task = tokio::spawn(conn);
        client
            .simple_query(&format!("ALTER ROLE postgres PASSWORD '{pw}'"))
            .await
            .unwrap();
        drop(client);
        let _ = task.await;
        c.set_hba(0, "host all all 127.0.0.1/32 scram-sha-256\n");
        pgpass.push_str(&format!("127.0.0.1:{}:*:postgres:{pw}\n", c.port(0)));
    }
    let file = dir.path().join("pgpass");
    std::fs::write(&file, pgpass).unwrap();
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let hosts = format!("{},{}", servers[0].addr(0), servers[1].addr(0));
    let out = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args([
            "topology",
            "--hosts",
            &hosts,
            "--json",
            "--interval-ms",
            "300",
        ])
        .env("PGPASSFILE", &file)
        .env_remove("PGPASSWORD")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run pgwarden");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let doc: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {stdout} {}", String::from_utf8_lossy(&out.stderr)));
    for h in doc["hosts"].as_array().unwrap() {
        assert_eq!(h["alive"], true, "{h}");
    }
}

#[test]
fn zero_intervals_and_timeouts_are_refused_alike() {
    let host = format!("127.0.0.1:{}", free_port());
    for flag in [
        "--interval-ms",
        "--connect-timeout-ms",
        "--query-timeout-ms",
    ] {
        let (ok, stdout, stderr) = pgwarden(&["topology", "--hosts", &host, flag, "0"]);
        assert!(!ok, "{flag} 0 accepted: {stdout}");
        assert!(stderr.contains(&format!("{flag} must be > 0")), "{stderr}");
        assert!(stdout.is_empty(), "{stdout}");
    }
}
