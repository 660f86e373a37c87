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
}
