//! The REST API served on a real socket, backed by a real etcd, and spoken
//! to with the crate's own HTTP client.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use pgwarden_agent::api::{self, ApiState};
use pgwarden_agent::http_client::{get_json, request, Response};
use pgwarden_agent::record::{unix_ms, RestartOrder};
use pgwarden_agent::{AgentStatus, Command, MemberRecord, StatusHandle};
use pgwarden_dcs::{EtcdDcs, HistoryEntry, LeaseId};
use pgwarden_ha::{MemberRole, MemberState, Timing};
use pgwarden_testkit::etcd::EtcdServer;
use pgwarden_testkit::eventually;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

const T: Duration = Duration::from_secs(5);
const USER: &str = "pgwarden";
const PASSWORD: &str = "s3cret";

async fn dcs(etcd: &EtcdServer) -> EtcdDcs {
    EtcdDcs::connect(&[etcd.endpoint()], "pgwarden", "c", Duration::from_secs(2))
        .await
        .expect("connect")
}

/// A running member's record, as an HA loop would publish it.
fn member(name: &str, role: MemberRole, lag: Option<u64>) -> MemberRecord {
    let mut state = MemberState::new(name);
    state.role = role;
    state.timeline = 1;
    state.received_lsn = Some(5000);
    state.replayed_lsn = Some(5000);
    state.api_url = format!("http://127.0.0.1:1/{name}");
    MemberRecord {
        state,
        pg_address: "127.0.0.1:5432".into(),
        status: "running".into(),
        updated_ms: unix_ms(),
        lag_bytes: lag,
        replication_state: (role == MemberRole::Replica).then(|| "streaming".into()),
        ..MemberRecord::default()
    }
}

fn status_of(rec: MemberRecord, is_leader: bool) -> AgentStatus {
    let mut st = AgentStatus::initial(rec, Timing::default());
    st.is_leader = is_leader;
    st.holds_leader_key = is_leader;
    st.dcs_reachable = true;
    st.leader = Some("n1".into());
    st
}

/// One API server on 127.0.0.1, with the receiving end of its commands.
struct Api {
    url: String,
    status: StatusHandle,
    commands: mpsc::Receiver<Command>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Api {
    async fn start(
        dcs: EtcdDcs,
        st: AgentStatus,
        credentials: Option<(&str, &str)>,
        switchover_wait: Duration,
    ) -> Api {
        Self::start_on(dcs, st, credentials, switchover_wait, None).await
    }

    /// [`Api::start`] on HTTPS, asking for client certificates that
    /// chain to `ca` but requiring them only for writes.
    async fn start_tls_optional(
        dcs: EtcdDcs,
        st: AgentStatus,
        cert: &std::path::Path,
        key: &std::path::Path,
        ca: &std::path::Path,
    ) -> Api {
        let tls = pgwarden_agent::tls::server_config(cert, key, Some(ca), true).unwrap();
        Self::start_on(dcs, st, Some((USER, PASSWORD)), T, Some(tls)).await
    }

    async fn start_on(
        dcs: EtcdDcs,
        st: AgentStatus,
        credentials: Option<(&str, &str)>,
        switchover_wait: Duration,
        tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    ) -> Api {
        let status: StatusHandle = Arc::new(ArcSwap::from_pointee(st));
        let (tx, rx) = mpsc::channel(64);
        let state = Arc::new(ApiState {
            name: status.load().member.state.name.clone(),
            status: status.clone(),
            dcs,
            commands: tx,
            credentials: pgwarden_agent::api::Credentials::new(
                credentials.map(|(u, p)| (u.to_string(), p.to_string())),
            ),
            switchover_wait,
            failsafe_seen: Default::default(),
            reinitializing: Default::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopped = async {
            let _ = stopped.await;
        };
        match tls {
            Some(tls) => tokio::spawn(api::serve_tls(
                listener,
                state,
                Arc::new(arc_swap::ArcSwap::new(tls)),
                true,
                stopped,
            )),
            None => tokio::spawn(api::serve(listener, state, stopped)),
        };
        Api {
            url,
            status,
            commands: rx,
            _stop: stop,
        }
    }

    fn set(&self, st: AgentStatus) {
        self.status.store(Arc::new(st));
    }

    async fn call(&self, method: &str, path: &str) -> Response {
        request(method, &format!("{}{path}", self.url), None, None, T)
            .await
            .unwrap()
    }

    async fn code(&self, method: &str, path: &str) -> u16 {
        self.call(method, path).await.status
    }

    async fn write(&self, method: &str, path: &str, body: Option<Value>) -> Response {
        request(
            method,
            &format!("{}{path}", self.url),
            body.as_ref(),
            Some((USER, PASSWORD)),
            T,
        )
        .await
        .unwrap()
    }

    fn drain(&mut self) -> Vec<Command> {
        let mut v = Vec::new();
        while let Ok(c) = self.commands.try_recv() {
            v.push(c);
        }
        v
    }
}

/// Publishes `recs` in etcd under one lease and makes `leader` (if any)
/// hold the leader key; returns the lease.
async fn publish(dcs: &EtcdDcs, recs: &[&MemberRecord], leader: Option<&str>) -> LeaseId {
    let lease = dcs.grant_lease(Duration::from_secs(30)).await.unwrap();
    for r in recs {
        let v = serde_json::to_value(r).unwrap();
        dcs.publish_member(&r.state.name, &v, lease).await.unwrap();
    }
    if let Some(l) = leader {
        assert!(dcs.acquire_leader(l, lease).await.unwrap());
    }
    lease
}

#[tokio::test]
async fn health_checks_answer_for_the_local_role() {
    let etcd = EtcdServer::start();
    let api = Api::start(
        dcs(&etcd).await,
        status_of(member("n1", MemberRole::Primary, None), true),
        None,
        T,
    )
    .await;

    for path in [
        "/",
        "/primary",
        "/master",
        "/read-write",
        "/leader",
        "/read-only",
        "/read-only-sync",
        "/read-only-quorum",
    ] {
        assert_eq!(api.code("GET", path).await, 200, "leader {path}");
    }
    for path in ["/replica", "/sync", "/quorum", "/async", "/standby-leader"] {
        assert_eq!(api.code("GET", path).await, 503, "leader {path}");
    }
    assert_eq!(api.code("GET", "/health").await, 200);
    assert_eq!(api.code("GET", "/readiness").await, 200);
    // Tag filters do not apply to the leader endpoints.
    assert_eq!(api.code("GET", "/primary?tag_nofailover=true").await, 200);

    // GET carries the member's state; HEAD and OPTIONS only the status.
    let get = api.call("GET", "/primary").await;
    let body: Value = serde_json::from_str(&get.body).unwrap();
    assert_eq!(
        (body["name"].as_str(), body["role"].as_str()),
        (Some("n1"), Some("primary"))
    );
    assert_eq!(body["is_leader"], true);
    for method in ["HEAD", "OPTIONS"] {
        let r = api.call(method, "/primary").await;
        assert_eq!((r.status, r.body.as_str()), (200, ""), "{method}");
        let r = api.call(method, "/replica").await;
        assert_eq!((r.status, r.body.as_str()), (503, ""), "{method}");
    }
    let get = api.call("GET", "/replica").await;
    assert_eq!(get.status, 503);
    assert_eq!(
        serde_json::from_str::<Value>(&get.body).unwrap()["name"],
        "n1"
    );

    // The same process as a streaming replica 10 000 bytes behind.
    api.set(status_of(
        member("n1", MemberRole::Replica, Some(10_000)),
        false,
    ));
    for path in ["/", "/primary", "/master", "/read-write", "/leader"] {
        assert_eq!(api.code("GET", path).await, 503, "replica {path}");
    }
    for path in [
        "/replica",
        "/read-only",
        "/health",
        "/liveness",
        "/readiness",
        "/async",
        "/replica?lag=16kB",
        "/replica?lag=10000",
        "/replica?lag=1MB",
        "/readiness?lag=16kB",
        "/replica?tag_nofailover=false",
        "/replica?tag_failover_priority=1",
        "/replica?tag_nosync=false&tag_noloadbalance=false",
        "/read-only?lag=16kB&tag_nofailover=false",
    ] {
        assert_eq!(api.code("GET", path).await, 200, "replica {path}");
    }
    for path in [
        "/sync",
        "/replica?lag=9999",
        "/replica?lag=1kB",
        "/read-only?lag=1kB",
        "/read-only-sync",
        "/read-only-quorum",
        "/readiness?lag=1kB",
        "/replica?tag_nofailover=true",
        "/replica?tag_failover_priority=2",
        "/replica?tag_datacenter=east",
    ] {
        assert_eq!(api.code("GET", path).await, 503, "replica {path}");
    }
    assert_eq!(api.code("GET", "/replica?lag=ten").await, 400);
    // The replication state asked for, as Patroni takes it.
    let mut streaming = status_of(member("n1", MemberRole::Replica, Some(10_000)), false);
    streaming.member.replication_state = Some("streaming".into());
    api.set(streaming);
    assert_eq!(
        api.code("GET", "/replica?replication_state=streaming")
            .await,
        200
    );
    assert_eq!(
        api.code("GET", "/replica?replication_state=in%20archive%20recovery")
            .await,
        503
    );
    assert_eq!(
        api.code("GET", "/replica?replication_state=bogus").await,
        503
    );
    // Ready only while streaming, as in Patroni: a replica that replays
    // from the archive alone is no place for a load balancer to send reads.
    let mut archive = status_of(member("n1", MemberRole::Replica, Some(0)), false);
    archive.member.replication_state = Some("in archive recovery".into());
    api.set(archive);
    assert_eq!(api.code("GET", "/readiness").await, 503);
    assert_eq!(api.code("GET", "/replica").await, 200);
    // `mode=write` judges the lag by what was received: here 10 000 bytes
    // replayed behind the leader's 15 000, but all of it received.
    let mut write = status_of(member("n1", MemberRole::Replica, Some(10_000)), false);
    write.member.state.received_lsn = Some(15_000);
    write.cluster = Some(pgwarden_dcs::ClusterSnapshot {
        status: Some(json!({"lsn": 15_000})),
        ..Default::default()
    });
    api.set(write);
    assert_eq!(api.code("GET", "/readiness?lag=1kB").await, 503);
    assert_eq!(api.code("GET", "/readiness?lag=1kB&mode=write").await, 200);
    assert_eq!(api.code("GET", "/readiness?lag=1kB&mode=apply").await, 503);
    api.set(status_of(
        member("n1", MemberRole::Replica, Some(10_000)),
        false,
    ));
    assert_eq!(api.code("HEAD", "/replica?lag=16kB").await, 200);

    // The key holder with PostgreSQL stopped (maintenance mode): still the
    // leader for `/leader`, as in Patroni, but not a primary.
    let mut st = status_of(member("n1", MemberRole::Stopped, None), false);
    st.member.status = "stopped".into();
    st.holds_leader_key = true;
    api.set(st);
    assert_eq!(api.code("GET", "/leader").await, 200);
    for path in ["/primary", "/health", "/read-only"] {
        assert_eq!(
            api.code("GET", path).await,
            503,
            "stopped key holder {path}"
        );
    }

    // Listed as a synchronous standby.
    let mut st = status_of(member("n1", MemberRole::Replica, Some(0)), false);
    st.cluster = Some(pgwarden_dcs::ClusterSnapshot {
        sync: Some(json!({"leader": "n0", "members": ["n1"]})),
        ..Default::default()
    });
    api.set(st.clone());
    assert_eq!(api.code("GET", "/sync").await, 200);
    assert_eq!(api.code("GET", "/synchronous").await, 200);
    assert_eq!(api.code("GET", "/read-only-sync").await, 200);
    assert_eq!(api.code("GET", "/async").await, 503);
    assert_eq!(api.code("GET", "/quorum").await, 503);
    assert_eq!(api.code("GET", "/read-only-quorum").await, 503);
    // Under quorum commit (one acknowledgement of two listed standbys) a
    // listed standby is a quorum standby too.
    let mut quorum = st.clone();
    quorum.cluster = Some(pgwarden_dcs::ClusterSnapshot {
        sync: Some(json!({"leader": "n0", "members": ["n1", "n2"], "quorum": 1})),
        ..Default::default()
    });
    api.set(quorum);
    assert_eq!(api.code("GET", "/quorum").await, 200);
    assert_eq!(api.code("GET", "/read-only-quorum").await, 200);
    // ... and not a synchronous one, as Patroni has it.
    assert_eq!(api.code("GET", "/sync").await, 503);
    assert_eq!(api.code("GET", "/read-only-sync").await, 503);
    let p = get_json(&format!("{}/patroni", api.url), T).await.unwrap();
    assert_eq!(
        (p["quorum_standby"].clone(), p["sync_standby"].clone()),
        (json!(true), Value::Null)
    );
    api.set(st.clone());
    let p = get_json(&format!("{}/patroni", api.url), T).await.unwrap();
    assert_eq!(
        (p["sync_standby"].clone(), p["quorum_standby"].clone()),
        (json!(true), Value::Null)
    );
    // Without the DCS the sync role cannot be vouched for.
    st.dcs_reachable = false;
    api.set(st);
    assert_eq!(api.code("GET", "/sync").await, 503);
    assert_eq!(api.code("GET", "/async").await, 503);
    assert_eq!(api.code("GET", "/replica").await, 200);

    // A replica of unknown lag passes unless a limit is asked for.
    api.set(status_of(member("n1", MemberRole::Replica, None), false));
    assert_eq!(api.code("GET", "/replica").await, 200);
    assert_eq!(api.code("GET", "/replica?lag=1TB").await, 503);
    assert_eq!(api.code("GET", "/readiness").await, 503);

    // Kept out of load balancing.
    let mut rec = member("n1", MemberRole::Replica, Some(0));
    rec.state.tags.noloadbalance = true;
    api.set(status_of(rec, false));
    assert_eq!(api.code("GET", "/replica").await, 503);
    assert_eq!(api.code("GET", "/read-only").await, 503);
    assert_eq!(api.code("GET", "/health").await, 200);

    // A standby cluster's leader: in recovery, but no replica of this
    // cluster's (Patroni gives it a role of its own).
    let mut st = status_of(member("n1", MemberRole::Replica, Some(0)), false);
    st.standby_leader = true;
    st.holds_leader_key = true;
    api.set(st);
    for path in ["/standby-leader", "/leader", "/read-only", "/readiness"] {
        assert_eq!(api.code("GET", path).await, 200, "standby leader {path}");
    }
    for path in ["/primary", "/replica", "/async", "/asynchronous", "/sync"] {
        assert_eq!(api.code("GET", path).await, 503, "standby leader {path}");
    }

    // PostgreSQL down.
    let mut rec = member("n1", MemberRole::Stopped, None);
    rec.status = "stopped".into();
    api.set(status_of(rec, false));
    for path in [
        "/health",
        "/replica",
        "/read-only",
        "/readiness",
        "/primary",
    ] {
        assert_eq!(api.code("GET", path).await, 503, "stopped {path}");
    }
    assert_eq!(api.code("GET", "/liveness").await, 200);
    assert_eq!(api.code("GET", "/no-such-thing").await, 404);
}

#[tokio::test]
async fn state_endpoints_report_member_cluster_history_and_config() {
    let etcd = EtcdServer::start();
    let d = dcs(&etcd).await;
    let n1 = member("n1", MemberRole::Primary, None);
    let mut n2 = member("n2", MemberRole::Replica, Some(2 * 1024 * 1024));
    n2.pg_address = "10.0.0.2:5433".into();
    n2.problem = Some("rewind failed".into());
    let n3 = member("n3", MemberRole::Replica, None);
    publish(&d, &[&n1, &n2, &n3], Some("n1")).await;
    d.put_config(&json!({"ttl": 30, "pause": true}))
        .await
        .unwrap();
    d.append_history(&HistoryEntry {
        timeline: 1,
        lsn: 4242,
        reason: "switchover requested by operator".into(),
        time_ms: 1,
        leader: "n1".into(),
    })
    .await
    .unwrap();
    let mut st = status_of(n2.clone(), false);
    st.cluster = Some(d.read_cluster().await.unwrap());
    st.paused = true;
    let api = Api::start(d, st, None, T).await;

    let p = get_json(&format!("{}/patroni", api.url), T).await.unwrap();
    assert_eq!(p["name"], "n2");
    assert_eq!(p["role"], "replica");
    assert_eq!(p["state"], "running");
    assert_eq!(p["received_lsn"], 5000);
    assert_eq!(p["xlog"]["replayed_location"], 5000);
    assert_eq!(p["leader"], "n1");
    assert_eq!(p["pg_address"], "10.0.0.2:5433");
    assert_eq!(p["problem"], "rewind failed");
    assert_eq!(
        (p["paused"].clone(), p["pause"].clone()),
        (json!(true), json!(true))
    );
    assert_eq!(p["tags"]["failover_priority"], 1);
    assert_eq!(p["patroni"]["scope"], "c");

    let c = get_json(&format!("{}/cluster", api.url), T).await.unwrap();
    assert_eq!(c["leader"], "n1");
    assert_eq!(c["paused"], true);
    assert_eq!(c["pause"], true, "Patroni's name for it");
    assert_eq!(c["scope"], "c");
    assert_eq!(c["failover"], Value::Null);
    let members = c["members"].as_array().unwrap();
    assert_eq!(members.len(), 3);
    // Patroni's word for a replica whose lag is not known.
    assert_eq!(members[2]["lag"], "unknown");
    assert_eq!(members[0]["name"], "n1");
    assert_eq!(members[0]["role"], "leader");
    assert_eq!(members[0]["lag"], Value::Null);
    assert_eq!(members[1]["role"], "replica");
    assert_eq!(members[1]["host"], "10.0.0.2");
    assert_eq!(members[1]["port"], 5433);
    assert_eq!(members[1]["lag"], 2 * 1024 * 1024);
    assert_eq!(members[1]["problem"], "rewind failed");

    let h = get_json(&format!("{}/history", api.url), T).await.unwrap();
    assert_eq!(h[0]["lsn"], 4242);
    assert_eq!(h[0]["leader"], "n1");
    let cfg = get_json(&format!("{}/config", api.url), T).await.unwrap();
    assert_eq!(cfg, json!({"ttl": 30, "pause": true}));
    // OPTIONS: GET's status, no body, on every read endpoint.
    for path in ["/patroni", "/cluster", "/history", "/config", "/metrics"] {
        let r = api.call("OPTIONS", path).await;
        assert_eq!((r.status, r.body.as_str()), (200, ""), "{path}");
    }
}

/// A raw request, to see the headers the client does not return.
async fn raw_http(url: &str, request: &str) -> String {
    let addr = url.strip_prefix("http://").unwrap();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(T, s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    out
}

/// A connection that sends no request head (or part of one) is closed
/// after 10 seconds, and one past the 256 the API serves at once is
/// closed at once; a well-behaved request is still answered.
#[tokio::test]
async fn idle_and_excess_connections_are_closed() {
    let etcd = EtcdServer::start();
    let d = dcs(&etcd).await;
    let st = status_of(member("n1", MemberRole::Primary, None), true);
    let api = Api::start(d, st, None, T).await;
    let addr = api.url.strip_prefix("http://").unwrap().parse().unwrap();
    pgwarden_testkit::http::drops_idle_and_excess_connections(addr).await;
    let raw = raw_http(
        &api.url,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
}

#[tokio::test]
async fn writes_need_configured_and_matching_credentials() {
    let etcd = EtcdServer::start();
    let d = dcs(&etcd).await;
    let st = status_of(member("n1", MemberRole::Primary, None), true);
    let open = Api::start(d.clone(), st.clone(), None, T).await;
    for (method, path) in [
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("PATCH", "/config"),
        ("POST", "/switchover"),
        ("DELETE", "/switchover"),
        ("POST", "/failover"),
        ("POST", "/restart"),
        ("POST", "/reload"),
    ] {
        let r = open.write(method, path, Some(json!({}))).await;
        assert_eq!(r.status, 403, "{method} {path}");
        assert!(r.body.contains("api_password"), "{}", r.body);
    }

    let api = Api::start(d.clone(), st, Some((USER, PASSWORD)), T).await;
    let url = format!("{}/pause", api.url);
    let r = request("POST", &url, None, None, T).await.unwrap();
    assert_eq!(r.status, 401);
    for wrong in [(USER, "s3cre"), (USER, "s3crett"), ("postgres", PASSWORD)] {
        let r = request("POST", &url, None, Some(wrong), T).await.unwrap();
        assert_eq!(r.status, 401, "{wrong:?}");
    }
    let raw = raw_http(
        &api.url,
        "POST /pause HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await
    .to_ascii_lowercase();
    assert!(raw.starts_with("http/1.1 401"), "{raw}");
    assert!(raw.contains("www-authenticate: basic"), "{raw}");
    assert!(
        d.read_cluster().await.unwrap().config.is_none(),
        "nothing was written"
    );
}

#[tokio::test]
async fn pause_resume_and_config_patches_change_the_config_key() {
    let etcd = EtcdServer::start();
    let d = dcs(&etcd).await;
    let st = status_of(member("n1", MemberRole::Primary, None), true);
    let mut api = Api::start(d.clone(), st, Some((USER, PASSWORD)), T).await;
    let config = || async { d.read_cluster().await.unwrap().config };

    let r = api.write("POST", "/pause", None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(config().await, Some(json!({"pause": true})));
    assert_eq!(api.drain(), [Command::Wake]);
    let r = api.write("POST", "/resume", None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(config().await, Some(json!({"pause": false})));

    d.put_config(&json!({
        "ttl": 30,
        "pause": false,
        "postgresql": {"parameters": {"work_mem": "4MB", "max_connections": 100}},
    }))
    .await
    .unwrap();
    api.drain();
    let r = api
        .write(
            "PATCH",
            "/config",
            Some(json!({
                "ttl": 40,
                "pause": null,
                "postgresql": {"parameters": {"work_mem": null, "shared_buffers": "1GB"}},
            })),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let want = json!({
        "ttl": 40,
        "postgresql": {"parameters": {"max_connections": 100, "shared_buffers": "1GB"}},
    });
    assert_eq!(serde_json::from_str::<Value>(&r.body).unwrap(), want);
    assert_eq!(config().await, Some(want.clone()));
    assert_eq!(api.drain(), [Command::Wake]);
    assert_eq!(
        get_json(&format!("{}/config", api.url), T).await.unwrap(),
        want
    );

    for bad in ["{not json", "[1, 2]", ""] {
        let r = raw_http(
            &api.url,
            &format!(
                "PATCH /config HTTP/1.1\r\nHost: x\r\nAuthorization: Basic cGd3YXJkZW46czNjcmV0\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{bad}",
                bad.len()
            ),
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 400"), "{bad:?}: {r}");
    }
    // Timers that do not fit this node's own (the norm preset: loop_wait 5,
    // retry_timeout 10), or are not durations.
    for (bad, says) in [
        (json!({"ttl": 20}), "exceeds ttl 20 s"),
        (json!({"retry_timeout": 30}), "exceeds ttl 40 s"),
        (json!({"loop_wait": "soon"}), "loop_wait:"),
        (
            json!({"maximum_lag_on_failover": "1MB"}),
            "maximum_lag_on_failover:",
        ),
    ] {
        let r = api.write("PATCH", "/config", Some(bad.clone())).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert!(r.body.contains(says), "{bad}: {}", r.body);
    }
    // Maintenance mode is on or off: anything else would read as off.
    for bad in [json!({"pause": "yes"}), json!({"pause": 1})] {
        let r = api.write("PATCH", "/config", Some(bad.clone())).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert!(
            r.body.contains("pause: must be true or false"),
            "{}",
            r.body
        );
    }
    assert_eq!(config().await, Some(want), "bad patches change nothing");

    // PUT replaces the whole configuration, checked as a patch is.
    let whole = json!({"ttl": 45, "postgresql": {"parameters": {"work_mem": "8MB"}}});
    let r = api.write("PUT", "/config", Some(whole.clone())).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(config().await, Some(whole.clone()));
    let r = api
        .write("PUT", "/config", Some(json!({"pause": "yes"})))
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(config().await, Some(whole));
}

/// A request as written, without the time the API dates it with.
fn undated(request: &Value) -> Value {
    let mut v = request.clone();
    assert!(v["requested_ms"].is_u64(), "{request}");
    v.as_object_mut().unwrap().remove("requested_ms");
    v
}

async fn post_restart(api: &Api, body: Value) -> Response {
    api.write("POST", "/restart", Some(body)).await
}

/// Posts a restart order to be carried out now and plays the HA loop: the
/// order it receives is answered with `answer`. Returns the order and the
/// API's response.
async fn restart_answered(
    api: &mut Api,
    body: Value,
    answer: Result<(), String>,
) -> (RestartOrder, Response) {
    let url = format!("{}/restart", api.url);
    let asked = tokio::spawn(async move {
        request("POST", &url, Some(&body), Some((USER, PASSWORD)), T)
            .await
            .unwrap()
    });
    let (order, reply) = loop {
        if let Some(Command::Restart(order, reply)) = api.drain().pop() {
            break (order, reply);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(reply.send(answer), "the API stopped waiting");
    (order, asked.await.unwrap())
}

/// Sends `DELETE /restart` and plays the HA loop, answering the
/// withdrawal with `answer`.
async fn cancel_answered(api: &mut Api, answer: Result<(), String>) -> Response {
    let url = format!("{}/restart", api.url);
    let asked = tokio::spawn(async move {
        request("DELETE", &url, None, Some((USER, PASSWORD)), T)
            .await
            .unwrap()
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let reply = loop {
        if let Some(Command::CancelRestart(reply)) = api.drain().pop() {
            break reply;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the withdrawal never reached the loop"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(reply.send(answer), "the API stopped waiting");
    asked.await.unwrap()
}

#[tokio::test]
async fn restart_and_reload_reach_the_ha_loop() {
    let etcd = EtcdServer::start();
    let st = status_of(member("n1", MemberRole::Primary, None), true);
    let mut api = Api::start(dcs(&etcd).await, st.clone(), Some((USER, PASSWORD)), T).await;
    // An order for now is answered once the loop has checked it.
    let (order, r) = restart_answered(&mut api, json!({}), Ok(())).await;
    assert_eq!((r.status, r.body.trim()), (200, "restart requested"));
    assert_eq!(order, RestartOrder::default());
    assert_eq!(api.write("POST", "/reload", None).await.status, 202);
    assert_eq!(api.drain(), [Command::Reload]);
    let (_, r) = restart_answered(
        &mut api,
        json!({}),
        Err("PostgreSQL refuses its configuration".into()),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("refuses its configuration"), "{}", r.body);

    // The role is checked against what the member is now.
    let r = post_restart(&api, json!({"role": "replica"})).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("is primary, not replica"), "{}", r.body);
    assert!(api.drain().is_empty());
    // Whether settings wait for a restart, the loop settles: it may not
    // have applied or seen a change made a moment ago.
    let (order, r) = restart_answered(
        &mut api,
        json!({"restart_pending": true}),
        Err("no setting is waiting for a restart".into()),
    )
    .await;
    assert!(order.restart_pending);
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        r.body.contains("no setting is waiting for a restart"),
        "{}",
        r.body
    );
    let (order, r) = restart_answered(&mut api, json!({"role": "master"}), Ok(())).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(order.role.as_deref(), Some("primary"));
    // A standby cluster's leader is a role of its own, as in Patroni: an
    // order for the replicas passes it over.
    let mut standby_leader = status_of(member("n1", MemberRole::Replica, Some(0)), false);
    standby_leader.standby_leader = true;
    standby_leader.holds_leader_key = true;
    api.set(standby_leader);
    let r = post_restart(&api, json!({"role": "replica"})).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        r.body.contains("is standby_leader, not replica"),
        "{}",
        r.body
    );
    let (order, r) = restart_answered(&mut api, json!({"role": "standby_leader"}), Ok(())).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(order.role.as_deref(), Some("standby_leader"));
    api.set(st.clone());
    // Refused outright: a time in the past or without an offset, an
    // unknown role, a condition pgwarden does not check.
    for bad in [
        json!({"schedule": "2020-01-01T00:00:00Z"}),
        json!({"schedule": "2030-01-01T00:00:00"}),
        json!({"schedule": "soon"}),
        json!({"role": "leader"}),
        json!({"restart_pending": "yes"}),
        json!({"postgres_version": "15.4"}),
        // A mistyped condition, and one pgwarden does not take.
        json!({"restart_pendin": true}),
        json!({"timeout": "30s"}),
    ] {
        let r = post_restart(&api, bad.clone()).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
    assert!(api.drain().is_empty());

    // A scheduled one goes to the loop with its time, in UTC.
    let (order, r) = restart_answered(
        &mut api,
        json!({"schedule": "2030-01-01T03:00:00+02:00", "restart_pending": true}),
        Ok(()),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.body);
    assert!(r.body.contains("2030-01-01T01:00:00Z"), "{}", r.body);
    assert_eq!(order.at_ms, Some(1_893_459_600_000));
    assert!(order.restart_pending);
    // The loop has the last word: a second one it refuses is a conflict,
    // however recent the status the API read.
    let (_, r) = restart_answered(
        &mut api,
        json!({"schedule": "2031-01-01T00:00:00Z"}),
        Err("a restart is already scheduled at 2030-01-01T01:00:00Z; DELETE /restart first".into()),
    )
    .await;
    assert_eq!(r.status, 409, "{}", r.body);
    // Once the loop shows it, /patroni lists it.
    let mut with = st.clone();
    with.member.scheduled_restart = Some(order.clone());
    api.set(with);
    let v = get_json(&format!("{}/patroni", api.url), T).await.unwrap();
    assert_eq!(v["scheduled_restart"]["schedule"], "2030-01-01T01:00:00Z");
    assert_eq!(v["scheduled_restart"]["restart_pending"], true);
    // A withdrawal is answered by the loop, not by the status the API
    // last read: one answered a moment ago may not show there yet.
    assert_eq!(cancel_answered(&mut api, Ok(())).await.status, 200);
    // Nor in maintenance mode, as in Patroni; and a stopped server is not
    // started by an order to restart it.
    let mut paused = st.clone();
    paused.paused = true;
    api.set(paused);
    let r = post_restart(&api, json!({"schedule": "2031-01-01T00:00:00Z"})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("paused state"), "{}", r.body);
    api.set(status_of(member("n1", MemberRole::Stopped, None), false));
    let r = post_restart(&api, json!({})).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("not running"), "{}", r.body);
    api.set(st);
    let r = cancel_answered(&mut api, Err("no restart is scheduled".into())).await;
    assert_eq!(r.status, 404, "{}", r.body);
    // Not without credentials.
    assert_eq!(api.code("DELETE", "/restart").await, 401);
}

#[tokio::test]
async fn a_reinitialize_in_progress_refuses_a_second_one() {
    let etcd = EtcdServer::start();
    let st = status_of(member("n2", MemberRole::Replica, Some(0)), false);
    let mut api = Api::start(dcs(&etcd).await, st, Some((USER, PASSWORD)), T).await;
    let r = api.write("POST", "/reinitialize", None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = api.write("POST", "/reinitialize", None).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("already in progress"), "{}", r.body);
    assert_eq!(api.drain(), [Command::Reinitialize]);
}

#[tokio::test]
async fn switchover_requests_are_checked_written_and_awaited() {
    let etcd = EtcdServer::start();
    let d = dcs(&etcd).await;
    let n1 = member("n1", MemberRole::Primary, None);
    let n2 = member("n2", MemberRole::Replica, Some(0));
    let mut n3 = member("n3", MemberRole::Replica, Some(0));
    n3.state.tags.nofailover = true;
    let st = status_of(n1.clone(), true);
    let quick = Api::start(
        d.clone(),
        st.clone(),
        Some((USER, PASSWORD)),
        Duration::from_millis(600),
    )
    .await;

    // No leader yet.
    let r = quick
        .write("POST", "/switchover", Some(json!({"candidate": "n2"})))
        .await;
    assert_eq!(r.status, 412, "{}", r.body);

    let lease1 = publish(&d, &[&n1], Some("n1")).await;
    let lease2 = publish(&d, &[&n2, &n3], None).await;

    for (body, code) in [
        (json!({}), 400),
        (json!({"leader": "n1", "candidate": "n1"}), 400),
        (json!({"candidate": "n1"}), 400),
        (json!({"candidate": 7}), 400),
        (
            json!({"leader": "n1", "candidate": "n2", "scheduled_at": "2030-01-01T00:00:00"}),
            400,
        ),
        (
            json!({"leader": "n1", "candidate": "n2", "scheduled_at": "next tuesday"}),
            422,
        ),
        (
            json!({"leader": "n1", "candidate": "n2", "scheduled_at": "2001-01-01T00:00:00Z"}),
            422,
        ),
        (
            json!({"leader": "n1", "candidate": "n3", "scheduled_at": "2099-01-01T00:00:00Z"}),
            412,
        ),
        (
            json!({"leader": "n1", "candidate": "n2", "scheduled_at": 5}),
            400,
        ),
        (json!({"leader": "n1", "candidate": "n9"}), 412),
        (json!({"leader": "n1", "candidate": "n3"}), 412),
        (json!({"leader": "n2", "candidate": "n3"}), 412),
    ] {
        let r = quick.write("POST", "/switchover", Some(body.clone())).await;
        assert_eq!(r.status, code, "{body}: {}", r.body);
    }
    let r = quick
        .write("POST", "/switchover", Some(json!({"candidate": "n3"})))
        .await;
    assert!(r.body.contains("nofailover"), "{}", r.body);
    let r = raw_http(
        &quick.url,
        "POST /switchover HTTP/1.1\r\nHost: x\r\nAuthorization: Basic cGd3YXJkZW46czNjcmV0\r\n\
         Content-Length: 5\r\nConnection: close\r\n\r\n{oops",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    // In maintenance mode the operator names the candidate.
    d.put_config(&json!({"pause": true})).await.unwrap();
    let r = quick
        .write("POST", "/switchover", Some(json!({"leader": "n1"})))
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body.contains("only to a specific candidate"),
        "{}",
        r.body
    );
    d.put_config(&json!({})).await.unwrap();
    assert!(
        d.read_cluster().await.unwrap().failover.is_none(),
        "refused requests write nothing"
    );

    // Nobody acts on the request here, so the answer is "unknown", quickly;
    // the request is dated, for the leader to withdraw it once nobody
    // carried it out in time.
    let before = unix_ms();
    let r = quick
        .write(
            "POST",
            "/switchover",
            Some(json!({"leader": "n1", "candidate": "n2"})),
        )
        .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("status unknown"), "{}", r.body);
    let mut written = d.read_cluster().await.unwrap().failover.unwrap();
    let at = written["requested_ms"].as_u64().unwrap();
    assert!(at >= before && at <= unix_ms(), "{written}");
    written.as_object_mut().unwrap().remove("requested_ms");
    assert_eq!(written, json!({"candidate": "n2", "from_leader": "n1"}));
    let r = quick.write("DELETE", "/switchover", None).await;
    assert_eq!(
        (r.status, r.body.trim()),
        (200, "pending switchover cancelled")
    );
    assert!(d.read_cluster().await.unwrap().failover.is_none());
    let r = quick.write("DELETE", "/switchover", None).await;
    assert_eq!(r.status, 404, "{}", r.body);

    // Scheduled: written at once (normalised to UTC), answered 202, shown on
    // /cluster in Patroni's form, and withdrawn.
    let r = quick
        .write(
            "POST",
            "/switchover",
            Some(json!({"leader": "n1", "candidate": "n2",
                        "scheduled_at": "2099-06-01T14:30:00.250+02:00"})),
        )
        .await;
    assert_eq!((r.status, r.body.trim()), (202, "Switchover scheduled"));
    assert_eq!(
        d.read_cluster().await.unwrap().failover,
        Some(json!({"candidate": "n2", "from_leader": "n1",
                    "scheduled_at": "2099-06-01T12:30:00.250Z"}))
    );
    let cluster = get_json(&format!("{}/cluster", quick.url), T)
        .await
        .unwrap();
    assert_eq!(
        cluster["scheduled_switchover"],
        json!({"at": "2099-06-01T12:30:00.250Z", "from": "n1", "to": "n2"})
    );
    let r = quick.write("DELETE", "/switchover", None).await;
    assert_eq!(
        (r.status, r.body.trim()),
        (200, "scheduled switchover deleted")
    );
    assert!(d.read_cluster().await.unwrap().failover.is_none());
    // Not in maintenance mode, and a failover is never scheduled.
    d.put_config(&json!({"pause": true})).await.unwrap();
    let r = quick
        .write(
            "POST",
            "/switchover",
            Some(json!({"candidate": "n2", "scheduled_at": "2099-06-01T14:30:00Z"})),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("paused"), "{}", r.body);
    d.put_config(&json!({})).await.unwrap();
    let r = quick
        .write(
            "POST",
            "/failover",
            Some(json!({"candidate": "n2", "scheduled_at": "2099-06-01T14:30:00Z"})),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(d.read_cluster().await.unwrap().failover.is_none());

    // The leader key moves while the request waits.
    let patient = Api::start(
        d.clone(),
        st,
        Some((USER, PASSWORD)),
        Duration::from_secs(20),
    )
    .await;
    let url = format!("{}/switchover", patient.url);
    let waiting = tokio::spawn(async move {
        request(
            "POST",
            &url,
            Some(&json!({"candidate": "n2"})),
            Some((USER, PASSWORD)),
            Duration::from_secs(30),
        )
        .await
        .unwrap()
    });
    let req = eventually("the failover key", T, || async {
        match d.read_cluster().await.map(|s| s.failover) {
            Ok(Some(v)) => Ok(v),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        undated(&req),
        json!({"candidate": "n2", "from_leader": "n1"})
    );
    assert!(d.release_leader("n1").await.unwrap());
    assert!(d.take_over_leader("n1", "n2", lease2).await.unwrap());
    let r = waiting.await.unwrap();
    assert_eq!(
        (r.status, r.body.trim()),
        (200, "Successfully switched over to n2")
    );

    // Another request is carried out instead: the answer says who leads.
    let url = format!("{}/switchover", patient.url);
    let waiting = tokio::spawn(async move {
        request(
            "POST",
            &url,
            Some(&json!({"candidate": "n1"})),
            Some((USER, PASSWORD)),
            Duration::from_secs(30),
        )
        .await
        .unwrap()
    });
    eventually("the failover key", T, || async {
        match d.read_cluster().await.map(|s| s.failover) {
            Ok(Some(_)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(d.release_leader("n2").await.unwrap());
    assert!(d.acquire_leader("n3", lease2).await.unwrap());
    d.delete_failover().await.unwrap();
    let r = waiting.await.unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("n3 leads now"), "{}", r.body);
    let _ = lease1;
}

#[tokio::test]
async fn failover_needs_a_leaderless_cluster_unless_forced() {
    let etcd = EtcdServer::start();
    let d = dcs(&etcd).await;
    let n1 = member("n1", MemberRole::Primary, None);
    let n2 = member("n2", MemberRole::Replica, Some(0));
    let st = status_of(n2.clone(), false);
    let quick = Api::start(
        d.clone(),
        st.clone(),
        Some((USER, PASSWORD)),
        Duration::from_millis(600),
    )
    .await;
    publish(&d, &[&n1], Some("n1")).await;
    let lease2 = publish(&d, &[&n2], None).await;

    let r = quick.write("POST", "/failover", Some(json!({}))).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let r = quick
        .write("POST", "/failover", Some(json!({"candidate": "n2"})))
        .await;
    assert_eq!(r.status, 412, "{}", r.body);
    assert!(r.body.contains("use switchover"), "{}", r.body);
    assert!(d.read_cluster().await.unwrap().failover.is_none());

    let r = quick
        .write(
            "POST",
            "/failover",
            Some(json!({"candidate": "n2", "force": true})),
        )
        .await;
    assert_eq!(r.status, 503, "{}", r.body);
    let mut written = d.read_cluster().await.unwrap().failover.unwrap();
    assert!(written["requested_ms"].is_u64(), "{written}");
    written.as_object_mut().unwrap().remove("requested_ms");
    assert_eq!(written, json!({"candidate": "n2", "forced": true}));
    d.delete_failover().await.unwrap();
    // `member` names the candidate too, as in Patroni; and force does not
    // override fencing, the operator's own word.
    d.put_config(&json!({"fenced": {"n2": true}}))
        .await
        .unwrap();
    let r = quick
        .write(
            "POST",
            "/failover",
            Some(json!({"member": "n2", "force": true})),
        )
        .await;
    assert_eq!(r.status, 412, "{}", r.body);
    assert!(r.body.contains("n2 is fenced"), "{}", r.body);
    assert!(d.read_cluster().await.unwrap().failover.is_none());
    d.put_config(&json!({})).await.unwrap();

    // The leader is gone: a plain failover is accepted and awaited.
    assert!(d.release_leader("n1").await.unwrap());
    let patient = Api::start(
        d.clone(),
        st,
        Some((USER, PASSWORD)),
        Duration::from_secs(20),
    )
    .await;
    let r = patient
        .write("POST", "/failover", Some(json!({"candidate": "n9"})))
        .await;
    assert_eq!(r.status, 412, "{}", r.body);
    let url = format!("{}/failover", patient.url);
    let waiting = tokio::spawn(async move {
        request(
            "POST",
            &url,
            Some(&json!({"candidate": "n2"})),
            Some((USER, PASSWORD)),
            Duration::from_secs(30),
        )
        .await
        .unwrap()
    });
    eventually("the failover key", T, || async {
        match d.read_cluster().await.map(|s| s.failover) {
            Ok(Some(v)) if undated(&v) == json!({"candidate": "n2", "forced": false}) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(d.acquire_leader("n2", lease2).await.unwrap());
    let r = waiting.await.unwrap();
    assert_eq!(
        (r.status, r.body.trim()),
        (200, "Successfully failed over to n2")
    );
}

/// A CA, a server certificate naming 127.0.0.1 and a client certificate,
/// as files in `dir`: (ca, (cert, key), (client cert, client key)).
#[allow(clippy::type_complexity)]
fn certificates(
    dir: &std::path::Path,
) -> (
    std::path::PathBuf,
    (std::path::PathBuf, std::path::PathBuf),
    (std::path::PathBuf, std::path::PathBuf),
) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let pair = |name: &str, san: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![san.to_string()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (
            write(&format!("{name}.crt"), cert.pem()),
            write(&format!("{name}.key"), key.serialize_pem()),
        )
    };
    let server = pair("server", "127.0.0.1");
    let client = pair("client", "operator");
    (write("ca.pem", ca.pem()), server, client)
}

#[tokio::test]
async fn with_optional_client_certificates_reads_need_none_and_writes_need_one() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, (cert, key), (client_cert, client_key)) = certificates(dir.path());
    let etcd = EtcdServer::start();
    let st = status_of(member("n1", MemberRole::Primary, None), true);
    let mut api = Api::start_tls_optional(dcs(&etcd).await, st, &cert, &key, &ca).await;
    // Trusting the CA, without a certificate: reading works, writing not.
    pgwarden_agent::http_client::trust(&ca).unwrap();
    assert_eq!(api.code("GET", "/patroni").await, 200);
    // HAProxy's health check (`option httpchk OPTIONS /primary`) too.
    assert_eq!(api.code("OPTIONS", "/primary").await, 200);
    assert_eq!(api.code("OPTIONS", "/replica").await, 503);
    let r = api.write("POST", "/reload", None).await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert!(r.body.contains("client certificate"), "{}", r.body);
    assert!(api.drain().is_empty());
    // With one, the write goes through (and still needs the password).
    pgwarden_agent::http_client::trust_with(&ca, Some((&client_cert, &client_key))).unwrap();
    assert_eq!(api.write("POST", "/reload", None).await.status, 202);
    assert_eq!(api.drain(), [Command::Reload]);
    assert_eq!(api.code("POST", "/reload").await, 401);
}

/// `POST /failsafe` holds a member back from taking the key after an
/// outage: only in failsafe mode, and only for callers with the API's
/// credentials (the members send them).
#[tokio::test]
async fn failsafe_acknowledgements_need_the_mode_and_the_credentials() {
    let etcd = EtcdServer::start();
    let mut st = status_of(member("n2", MemberRole::Replica, Some(0)), false);
    let api = Api::start(dcs(&etcd).await, st.clone(), Some((USER, PASSWORD)), T).await;
    assert_eq!(api.write("POST", "/failsafe", None).await.status, 502);
    st.settings.failsafe = true;
    api.set(st);
    assert_eq!(api.code("POST", "/failsafe").await, 401);
    // Past the checks: etcd answers here, so the member follows etcd.
    let r = api.write("POST", "/failsafe", None).await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.body.contains("etcd is reachable"), "{}", r.body);
}
