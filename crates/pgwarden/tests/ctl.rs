//! `pgwarden ctl` against a member's API backed by a real etcd.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use pgwarden_agent::api::{self, ApiState};
use pgwarden_agent::record::unix_ms;
use pgwarden_agent::{AgentStatus, MemberRecord};
use pgwarden_dcs::EtcdDcs;
use pgwarden_ha::{MemberRole, MemberState, Timing};
use pgwarden_testkit::etcd::EtcdServer;
use serde_json::json;

async fn ctl(args: Vec<String>) -> (bool, String, String) {
    tokio::task::spawn_blocking(move || {
        let out = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
            .arg("ctl")
            .args(&args)
            .env("RUST_LOG", "warn")
            .env_remove("PGWARDEN_API")
            .env_remove("PGWARDEN_API_PASSWORD")
            .output()
            .expect("run pgwarden");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

fn member(name: &str, role: MemberRole, lag: Option<u64>) -> MemberRecord {
    let mut state = MemberState::new(name);
    state.role = role;
    state.timeline = 1;
    state.received_lsn = Some(5000);
    MemberRecord {
        state,
        pg_address: format!("127.0.0.1:54{}", &name[1..]),
        status: "running".into(),
        updated_ms: unix_ms(),
        lag_bytes: lag,
        ..MemberRecord::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_lists_pauses_edits_and_reports_api_errors() {
    let etcd = EtcdServer::start();
    let dcs = EtcdDcs::connect(&[etcd.endpoint()], "pgwarden", "c", Duration::from_secs(2))
        .await
        .unwrap();
    let lease = dcs.grant_lease(Duration::from_secs(30)).await.unwrap();
    let (n1, n2) = (
        member("n1", MemberRole::Primary, None),
        member("n2", MemberRole::Replica, Some(3 << 20)),
    );
    for r in [&n1, &n2] {
        let v = serde_json::to_value(r).unwrap();
        dcs.publish_member(&r.state.name, &v, lease).await.unwrap();
    }
    assert!(dcs.acquire_leader("n1", lease).await.unwrap());

    let mut st = AgentStatus::initial(n1, Timing::default());
    st.is_leader = true;
    let (tx, _rx) = tokio::sync::mpsc::channel(16);
    let state = Arc::new(ApiState {
        name: "n1".into(),
        status: Arc::new(ArcSwap::from_pointee(st)),
        dcs: dcs.clone(),
        commands: tx,
        credentials: pgwarden_agent::api::Credentials::new(Some(("pgwarden".into(), "pw".into()))),
        switchover_wait: Duration::from_millis(500),
        failsafe_seen: Default::default(),
        reinitializing: Default::default(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(api::serve(listener, state, std::future::pending()));
    let args = |rest: &[&str]| {
        let mut v = vec!["--api".to_string(), url.clone()];
        v.extend(rest.iter().map(|s| s.to_string()));
        v
    };

    let (ok, out, err) = ctl(args(&["list"])).await;
    assert!(ok, "{err}");
    assert!(out.starts_with("Cluster: c (leader: n1)\n"), "{out}");
    assert!(
        out.contains("| n1     | 127.0.0.1:541 | Leader  | running |  1 |           |"),
        "{out}"
    );
    assert!(
        out.contains("| n2     | 127.0.0.1:542 | Replica | running |  1 |         3 |"),
        "{out}"
    );
    assert!(!out.contains("Maintenance"), "{out}");

    let (ok, _, err) = ctl(args(&["pause"])).await;
    assert!(!ok);
    assert!(err.contains("401") && err.contains("--password"), "{err}");
    let (ok, out, err) = ctl(args(&["pause", "--password", "pw"])).await;
    assert!(ok, "{err}");
    assert!(out.contains("maintenance mode on"), "{out}");
    assert_eq!(
        dcs.read_cluster().await.unwrap().config,
        Some(json!({"pause": true}))
    );
    let (ok, out, err) = ctl(args(&["list"])).await;
    assert!(ok, "{err}");
    assert!(out.contains("\nMaintenance mode: on\n"), "{out}");

    let (ok, out, err) = ctl(args(&[
        "edit-config",
        "--password",
        "pw",
        "--set",
        "postgresql.parameters.work_mem=4MB",
        "--set",
        "pause=null",
    ]))
    .await;
    assert!(ok, "{err}");
    assert!(out.contains("\"work_mem\": \"4MB\""), "{out}");
    let (ok, out, _) = ctl(args(&["show-config"])).await;
    assert!(ok);
    let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        shown,
        json!({"postgresql": {"parameters": {"work_mem": "4MB"}}})
    );

    let (ok, _, err) = ctl(args(&[
        "switchover",
        "--candidate",
        "n9",
        "--password",
        "pw",
    ]))
    .await;
    assert!(!ok);
    assert!(err.contains("412") && err.contains("n9"), "{err}");

    // A scheduled switchover is stored, shown, and withdrawn.
    let schedule = |at: &'static str| {
        args(&[
            "switchover",
            "--candidate",
            "n2",
            "--scheduled",
            at,
            "--password",
            "pw",
        ])
    };
    let (ok, _, err) = ctl(schedule("2001-01-01T00:00:00+00:00")).await;
    assert!(!ok);
    assert!(err.contains("422") && err.contains("in the past"), "{err}");
    let (ok, out, err) = ctl(schedule("2099-01-01T01:00:00+01:00")).await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "Switchover scheduled");
    let (ok, out, err) = ctl(args(&["list"])).await;
    assert!(ok, "{err}");
    assert!(
        out.contains("\nSwitchover scheduled at 2099-01-01T00:00:00Z: from n1 to n2\n"),
        "{out}"
    );
    let (ok, out, err) = ctl(args(&["cancel-switchover", "--password", "pw"])).await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "scheduled switchover deleted");
    assert!(dcs.read_cluster().await.unwrap().failover.is_none());
    let (ok, _, err) = ctl(args(&["cancel-switchover", "--password", "pw"])).await;
    assert!(!ok);
    assert!(err.contains("404"), "{err}");

    let (ok, _, err) = ctl(vec![
        "--api".into(),
        "http://127.0.0.1:1".into(),
        "list".into(),
    ])
    .await;
    assert!(!ok);
    assert!(err.contains("cannot connect"), "{err}");
}
