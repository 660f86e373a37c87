//! The agent's REST API, compatible with Patroni's where an endpoint of the
//! same name exists, so load balancer health checks, Kubernetes probes and
//! operators' habits carry over.
//!
//! # Health checks
//!
//! `GET`, `HEAD` and `OPTIONS` on each of these answer 200 when the local
//! member passes the check and 503 when it does not. A `GET` carries the
//! same JSON body as `/patroni`; `HEAD` and `OPTIONS` (what HAProxy's
//! `option httpchk OPTIONS /` sends) only the status line.
//!
//! | path | 200 when |
//! | --- | --- |
//! | `/`, `/primary`, `/master`, `/read-write`, `/leader` | this agent holds the leader lease and its PostgreSQL runs as primary |
//! | `/replica` | PostgreSQL is `running` as a replica without the `noloadbalance` tag, not fenced, and passes the `lag` and `tag_*` filters |
//! | `/read-only` | `/primary` or `/replica` passes |
//! | `/sync`, `/synchronous` | `/replica` passes, the member is listed in the `sync` key, and the DCS is reachable |
//! | `/async`, `/asynchronous` | `/replica` passes, the member is not listed in the `sync` key, and the DCS is reachable |
//! | `/health` | PostgreSQL is `running`, in any role |
//! | `/liveness` | always, while the process serves requests |
//! | `/readiness` | leader, or a `running` replica no more than `lag` bytes behind (default `maximum_lag_on_failover`) |
//!
//! Filters, as query parameters: `lag=<bytes|16kB|10MB|...>` limits the
//! replica's lag behind the leader's last published WAL position; a replica
//! whose lag is not known yet fails a check that sets a limit, so a load
//! balancer never sends reads to a replica of unknown staleness.
//! `tag_<name>=<value>` requires one of the member's tags (`nofailover`,
//! `nosync`, `noloadbalance`, `failover_priority`) to have that value;
//! unknown tags never match. Unlike Patroni, tags left at their default
//! values count as present, so `tag_nofailover=false` matches an untagged
//! member.
//!
//! `/liveness` differs from Patroni's, which checks that the HA loop ran
//! recently: here the loop's health is the business of `/readiness` and the
//! role checks, and a liveness probe that restarts the agent while its loop
//! waits out a DCS outage would only add a restart to an outage.
//!
//! # Information
//!
//! `GET /patroni` (the member's state; members read each other's WAL
//! positions from it during an election), `GET /cluster` (every member,
//! the leader, maintenance mode and a pending failover), `GET /history`
//! (promotions, as objects rather than Patroni's arrays), `GET /config`
//! (the dynamic configuration, `{}` when there is none).
//!
//! # Control
//!
//! Write endpoints require HTTP basic authentication with the configured
//! credentials; without configured credentials they are refused (403), so a
//! forgotten password never leaves the cluster open to anyone who can reach
//! the port. `PATCH /config` (JSON merge patch: `null` deletes a key),
//! `POST /switchover`, `DELETE /switchover`, `POST /failover`,
//! `POST /pause`, `POST /resume`, `POST /restart` (now or at `schedule`,
//! under conditions), `DELETE /restart`, `POST /reinitialize`,
//! `POST /reload`.
//!
//! A switchover or failover is written to the DCS as a request that the
//! members' HA loops carry out; the API then waits for the leader key to
//! name the new leader and answers 200, or 503 "status unknown" when that
//! takes longer than [`ApiState::switchover_wait`] (the leader withdraws a
//! request nobody carried out by then). A switchover with
//! `scheduled_at` (ISO 8601 with a UTC offset) is only written, answered
//! 202, and carried out by the leader's loop at that time; `DELETE
//! /switchover` withdraws it.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, on, post, MethodFilter};
use axum::{Json, Router};
use pgwarden_dcs::{ClusterSnapshot, EtcdDcs};
use pgwarden_ha::{
    format_timestamp, parse_timestamp, rank_candidates, ElectionSettings, ExclusionReason,
    MemberRole, TimestampError,
};
use serde_json::{json, Map, Value};

use crate::handover;
use crate::record::{self, MemberRecord, RestartOrder};
use crate::status::{AgentStatus, Command, Reply, StatusHandle};

/// How long a switchover or failover request waits for the leader to
/// change before answering "status unknown", unless configured otherwise.
pub const DEFAULT_SWITCHOVER_WAIT: Duration = Duration::from_secs(30);

/// How often a waiting switchover re-reads the leader key.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// How long a request must stay missing, with the leader unchanged, before
/// a waiting switchover reports it withdrawn. An HA loop may consume the
/// request a moment before it takes the leader key, so one read that sees
/// neither is no proof.
const WITHDRAWN_GRACE: Duration = Duration::from_secs(2);

/// How long sending a command may wait for room in the HA loop's queue.
const COMMAND_SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// Everything the API's handlers need.
pub struct ApiState {
    /// This member's name.
    pub name: String,
    /// The latest status published by the HA loop.
    pub status: StatusHandle,
    /// The cluster's store, for the information and control endpoints.
    pub dcs: EtcdDcs,
    /// Requests to the HA loop.
    pub commands: tokio::sync::mpsc::Sender<Command>,
    /// User name and password required by the write endpoints; none
    /// refuses every write.
    pub credentials: Arc<Credentials>,
    /// How long `POST /switchover` and `POST /failover` wait for the leader
    /// to change ([`DEFAULT_SWITCHOVER_WAIT`] in the agent).
    pub switchover_wait: Duration,
    /// When (Unix ms) this member last acknowledged a failsafe request.
    pub failsafe_seen: Arc<std::sync::atomic::AtomicU64>,
    /// Set from a reinitialize request until the HA loop has carried it
    /// out, so a second one is refused rather than cloning twice.
    pub reinitializing: Arc<std::sync::atomic::AtomicBool>,
}

/// The API's routes over `state`.
pub fn router(state: Arc<ApiState>) -> Router {
    let check = MethodFilter::GET
        .or(MethodFilter::HEAD)
        .or(MethodFilter::OPTIONS);
    let mut r = Router::new();
    for path in CHECK_PATHS {
        r = r.route(path, on(check, health_check));
    }
    // OPTIONS answers with the status GET would have, without a body, as
    // in Patroni (load balancers probe with it).
    r.route(
        "/patroni",
        get(patroni).options(|s| async { status_only(patroni(s).await) }),
    )
    .route(
        "/metrics",
        get(metrics).options(|s| async { status_only(metrics(s).await) }),
    )
    .route("/failsafe", axum::routing::post(failsafe))
    .route(
        "/cluster",
        get(cluster).options(|s| async { status_only(cluster(s).await.into_response()) }),
    )
    .route(
        "/history",
        get(history).options(|s| async { status_only(history(s).await.into_response()) }),
    )
    .route(
        "/config",
        get(get_config)
            .patch(patch_config)
            .put(put_config)
            .options(|s| async { status_only(get_config(s).await.into_response()) }),
    )
    .route("/switchover", post(switchover).delete(cancel_switchover))
    .route("/failover", post(failover))
    .route("/pause", post(pause))
    .route("/resume", post(resume))
    .route("/restart", post(restart).delete(cancel_restart))
    .route("/reload", post(reload))
    .route("/reinitialize", post(reinitialize))
    .fallback(|| async { text(StatusCode::NOT_FOUND, "no such endpoint") })
    .with_state(state)
}

/// `response`'s status alone.
fn status_only(response: Response) -> Response {
    response.status().into_response()
}

/// Connections the API serves at once; more are closed as they come. The
/// port is open to the other members, load balancers and operators, and
/// shares the process's descriptors with everything else.
const MAX_CONNECTIONS: usize = 256;

/// How long a connection may take to send a request's head, and may sit
/// idle between requests, before it is closed (also the TLS handshake's
/// bound): a client that opens connections and sends nothing, or a byte
/// at a time, cannot hold them.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the API on `listener` until `shutdown` resolves; requests in
/// flight then run on until they end.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ApiState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_connections(listener, state, None, shutdown).await
}

/// [`serve`] over HTTPS with `tls`. With `writes_need_certificate`, a
/// connection whose client presented no certificate gets only `GET` and
/// `HEAD` (health checks, information); anything else is refused with 403.
/// At `shutdown` no new connection is accepted; requests in flight run on
/// until they end.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    state: Arc<ApiState>,
    tls: Arc<arc_swap::ArcSwap<tokio_rustls::rustls::ServerConfig>>,
    writes_need_certificate: bool,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_connections(
        listener,
        state,
        Some((tls, writes_need_certificate)),
        shutdown,
    )
    .await
}

/// The accept loop of [`serve`] and [`serve_tls`]: HTTP/1.1 with a header
/// read timeout and a cap on connections (`axum::serve` has neither: its
/// connections have no timer, so hyper's timeout never fires).
async fn serve_connections(
    listener: tokio::net::TcpListener,
    state: Arc<ApiState>,
    tls: Option<(
        Arc<arc_swap::ArcSwap<tokio_rustls::rustls::ServerConfig>>,
        bool,
    )>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(state);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: pause rather than spin.
                    tracing::warn!(error = %e, "REST API: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "REST API: connection limit reached, closing");
            continue;
        };
        let _ = tcp.set_nodelay(true);
        // The configuration in force now: a reload swaps in renewed
        // certificates for the connections that follow.
        let tls = tls
            .as_ref()
            .map(|(cfg, need)| (tokio_rustls::TlsAcceptor::from(cfg.load_full()), *need));
        let app = app.clone();
        tokio::spawn(async move {
            match tls {
                None => serve_connection(tcp, app, false).await,
                Some((acceptor, writes_need_certificate)) => {
                    // A client that never finishes its handshake holds
                    // nothing for long.
                    let tls = match tokio::time::timeout(HEAD_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "REST API: TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    };
                    let certified = tls
                        .get_ref()
                        .1
                        .peer_certificates()
                        .is_some_and(|c| !c.is_empty());
                    serve_connection(tls, app, writes_need_certificate && !certified).await
                }
            }
            drop(slot);
        });
    }
}

/// Serves one connection's requests. `read_only`: only `GET` and `HEAD`,
/// anything else refused with 403.
async fn serve_connection<Io>(io: Io, app: Router, read_only: bool)
where
    Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let mut app = app.clone();
        async move {
            // OPTIONS too: what HAProxy's health checks send.
            if read_only && !matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
                return Ok(text(
                    StatusCode::FORBIDDEN,
                    "a client certificate is required for this endpoint",
                ));
            }
            tower_service::Service::call(&mut app, req).await
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .serve_connection(hyper_util::rt::TokioIo::new(io), service)
        .await;
}

// ---------------------------------------------------------------------------
// Health checks

const CHECK_PATHS: [&str; 19] = [
    "/",
    "/primary",
    "/master",
    "/read-write",
    "/leader",
    "/replica",
    "/read-only",
    "/sync",
    "/synchronous",
    "/async",
    "/asynchronous",
    "/health",
    "/liveness",
    "/readiness",
    "/standby-leader",
    "/standby_leader",
    "/quorum",
    "/read-only-sync",
    "/read-only-quorum",
];

/// Whether the local member passes the check named by `path`.
fn passes(
    path: &str,
    name: &str,
    st: &AgentStatus,
    query: &[(String, String)],
    default_lag: u64,
) -> Result<bool, String> {
    let lag_limit = match query.iter().rev().find(|(k, _)| k == "lag") {
        Some((_, v)) => Some(parse_lag(v)?),
        None => None,
    };
    // `?replication_state=streaming`: only a replica in that state.
    let state_wanted = query
        .iter()
        .rev()
        .find(|(k, _)| k == "replication_state")
        .map(|(_, v)| v.as_str());
    let replica = || {
        replica_check(&st.member, lag_limit)
            && tags_match(&st.member.state.tags, query)
            && state_wanted.is_none_or(|want| st.member.replication_state.as_deref() == Some(want))
    };
    let in_sync = || {
        st.cluster
            .as_ref()
            .is_some_and(|c| sync_members(c).iter().any(|m| m == name))
    };
    // Under quorum commit (fewer acknowledgements than listed standbys)
    // the listed ones are quorum standbys, as Patroni names them.
    let quorum = || {
        st.cluster.as_ref().is_some_and(|c| {
            let listed = sync_members(c).len();
            record::sync_state(c)
                .and_then(|s| s.quorum)
                .is_some_and(|q| q < listed)
        })
    };
    let leads = st.is_leader || st.standby_leader;
    // A standby leader runs in recovery, but is no replica of this
    // cluster's: Patroni gives it a role of its own.
    let plain_replica = || !st.standby_leader && replica();
    // As Patroni names them: under quorum commit the listed standbys are
    // quorum standbys, otherwise synchronous ones.
    let sync_standby = || st.dcs_reachable && in_sync() && !quorum() && plain_replica();
    let quorum_standby = || st.dcs_reachable && in_sync() && quorum() && plain_replica();
    Ok(match path {
        "/" | "/primary" | "/master" | "/read-write" => st.is_leader,
        // As in Patroni: whoever holds the leader key, primary or standby
        // leader of a standby cluster, whether PostgreSQL runs or not.
        "/leader" => st.holds_leader_key,
        "/standby-leader" | "/standby_leader" => st.standby_leader,
        "/replica" => plain_replica(),
        "/read-only" => st.is_leader || st.standby_leader || replica(),
        "/sync" | "/synchronous" => sync_standby(),
        "/quorum" => quorum_standby(),
        "/read-only-sync" => leads || sync_standby(),
        "/read-only-quorum" => leads || quorum_standby(),
        "/async" | "/asynchronous" => st.dcs_reachable && !in_sync() && plain_replica(),
        "/health" => st.member.status == "running",
        "/liveness" => true,
        "/readiness" => {
            // `mode=write`: the lag of what the replica received rather
            // than of what it replayed.
            let write = query
                .iter()
                .rev()
                .find(|(k, _)| k == "mode")
                .is_some_and(|(_, v)| v == "write");
            let limit = lag_limit.unwrap_or(default_lag);
            let lag_ok = if write {
                let leader_lsn = st
                    .cluster
                    .as_ref()
                    .and_then(|c| record::cluster_view(c, 0).last_leader_lsn);
                match (leader_lsn, st.member.state.received_lsn) {
                    (Some(l), Some(r)) => l.saturating_sub(r) <= limit,
                    _ => lag_within(&st.member, limit),
                }
            } else {
                lag_within(&st.member, limit)
            };
            st.is_leader
                || st.standby_leader
                || (st.member.status == "running"
                    && st.member.state.role == MemberRole::Replica
                    && st.member.replication_state.as_deref() == Some("streaming")
                    && lag_ok)
        }
        _ => false,
    })
}

fn replica_check(m: &MemberRecord, lag_limit: Option<u64>) -> bool {
    m.status == "running"
        && m.state.role == MemberRole::Replica
        && !m.state.tags.noloadbalance
        && !m.state.fenced
        && match lag_limit {
            Some(limit) => lag_within(m, limit),
            None => true,
        }
}

/// Unknown lag counts as too much: a replica that has not measured its lag
/// yet may be arbitrarily stale.
fn lag_within(m: &MemberRecord, limit: u64) -> bool {
    m.lag_bytes.is_some_and(|lag| lag <= limit)
}

fn tags_match(tags: &pgwarden_ha::Tags, query: &[(String, String)]) -> bool {
    let tags = serde_json::to_value(tags).unwrap_or_default();
    query.iter().all(|(k, want)| match k.strip_prefix("tag_") {
        None => true,
        Some(tag) => match tags.get(tag) {
            Some(Value::String(s)) => s.eq_ignore_ascii_case(want),
            Some(v) => v.to_string().eq_ignore_ascii_case(want.trim()),
            None => false,
        },
    })
}

/// Parses a lag limit as Patroni does: bytes, or a number with a
/// PostgreSQL memory unit (`B`, `kB`, `MB`, `GB`, `TB`, powers of 1024).
/// Units are accepted in any case, since a lag limit has no bits to confuse
/// them with.
pub fn parse_lag(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().map_err(|_| {
        format!("invalid lag {s:?}: expected bytes or a number with kB, MB, GB, TB")
    })?;
    let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1 << 10,
        "mb" => 1 << 20,
        "gb" => 1 << 30,
        "tb" => 1 << 40,
        _ => return Err(format!("invalid lag {s:?}: unknown unit {unit:?}")),
    };
    n.checked_mul(factor)
        .ok_or_else(|| format!("invalid lag {s:?}: too large"))
}

async fn health_check(
    State(state): State<Arc<ApiState>>,
    method: Method,
    uri: Uri,
    Query(query): Query<Vec<(String, String)>>,
) -> Response {
    let st = state.status.load_full();
    let code = match passes(
        uri.path(),
        &state.name,
        &st,
        &query,
        st.settings.maximum_lag_on_failover,
    ) {
        Ok(true) => StatusCode::OK,
        Ok(false) => StatusCode::SERVICE_UNAVAILABLE,
        Err(msg) => return text(StatusCode::BAD_REQUEST, &msg),
    };
    if method == Method::GET {
        (code, Json(member_json(&state, &st))).into_response()
    } else {
        code.into_response()
    }
}

// ---------------------------------------------------------------------------
// Information

/// The cluster's name, the last segment of the key prefix.
fn scope(dcs: &EtcdDcs) -> String {
    dcs.keys()
        .prefix()
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_string()
}

fn sync_members(c: &ClusterSnapshot) -> Vec<String> {
    c.sync
        .as_ref()
        .and_then(|s| s.get("members"))
        .and_then(|m| serde_json::from_value(m.clone()).ok())
        .unwrap_or_default()
}

fn member_json(state: &ApiState, st: &AgentStatus) -> Value {
    let m = &st.member;
    let mut xlog = json!({
        "received_location": m.state.received_lsn,
        "replayed_location": m.state.replayed_lsn,
    });
    if st.is_leader {
        // Patroni's primaries report a single `location`.
        xlog["location"] = json!(m.state.received_lsn);
    }
    let mut v = json!({
        "name": state.name,
        "role": if st.standby_leader {
            "standby_leader".to_string()
        } else {
            m.state.role.to_string()
        },
        "state": m.status,
        "replication_state": m.replication_state,
        "timeline": m.state.timeline,
        "received_lsn": m.state.received_lsn,
        "replayed_lsn": m.state.replayed_lsn,
        "lag": m.lag_bytes,
        "xlog": xlog,
        "is_leader": st.is_leader,
        "leader": st.leader,
        "cluster_unlocked": st.leader.is_none(),
        "paused": st.paused,
        "dcs_reachable": st.dcs_reachable,
        "tags": m.state.tags,
        "api_url": m.state.api_url,
        "pg_address": m.pg_address,
        "last_decision": st.last_decision,
        "problem": m.problem,
        "pending_restart": m.pending_restart,
        "scheduled_restart": m.scheduled_restart,
        "postmaster_start_time": m.postmaster_start_time,
        "fenced": m.state.fenced,
        "logical_slots": m.logical_slots,
        "settings": st.settings.to_json(),
        "patroni": {
            "version": env!("CARGO_PKG_VERSION"),
            "scope": scope(&state.dcs),
            "name": state.name,
        },
    });
    // Patroni lists the standbys on the primary only.
    if !st.replication.is_empty() {
        v["replication"] = json!(st.replication);
    }
    // Patroni's fields, present only when true (check_patroni reads them).
    if st.paused {
        v["pause"] = json!(true);
    }
    if let Some(c) = st.cluster.as_ref() {
        let listed = sync_members(c);
        if !st.standby_leader && m.state.role == MemberRole::Replica && listed.contains(&state.name)
        {
            let quorum = record::sync_state(c)
                .and_then(|s| s.quorum)
                .is_some_and(|q| q < listed.len());
            let field = if quorum {
                "quorum_standby"
            } else {
                "sync_standby"
            };
            v[field] = json!(true);
        }
    }
    v
}

async fn patroni(State(state): State<Arc<ApiState>>) -> Response {
    let st = state.status.load_full();
    Json(member_json(&state, &st)).into_response()
}

/// The JSON of `/cluster`, from one snapshot.
pub fn cluster_json(snap: &ClusterSnapshot, scope: &str) -> Value {
    let leader = snap.leader.as_ref().map(|l| l.name.clone());
    let sync = sync_members(snap);
    let fenced = record::fenced(snap);
    let quorum = record::sync_state(snap).and_then(|s| s.quorum);
    let standby = record::standby_cluster(snap).is_some();
    let members: Vec<Value> = record::records(snap)
        .into_iter()
        .map(|r| {
            let name = r.state.name.clone();
            let role = if leader.as_deref() == Some(name.as_str()) {
                if standby {
                    "standby_leader".to_string()
                } else {
                    "leader".to_string()
                }
            } else if sync.contains(&name) && r.state.role == MemberRole::Replica {
                // Patroni's names: every listed standby holds each commit,
                // or under quorum commit some of them do.
                if quorum.is_some_and(|q| q < sync.len()) {
                    "quorum_standby".to_string()
                } else {
                    "sync_standby".to_string()
                }
            } else {
                r.state.role.to_string()
            };
            let (host, port) = split_address(&r.pg_address);
            // Patroni's word for a replica's lag not known.
            let lag = if role.ends_with("leader") {
                Value::Null
            } else {
                r.lag_bytes.map_or_else(|| json!("unknown"), |l| json!(l))
            };
            json!({
                "name": name,
                "role": role,
                "state": r.shown_state(),
                "host": host,
                "port": port,
                "pg_address": r.pg_address,
                "api_url": r.state.api_url,
                "timeline": r.state.timeline,
                "lag": lag,
                "tags": r.state.tags,
                "problem": r.problem,
                "decision": r.decision,
                "upstream": r.upstream,
                "pending_restart": r.pending_restart,
                "scheduled_restart": r.scheduled_restart,
                "fenced": fenced.contains(&name),
            })
        })
        .collect();
    let mut out = json!({
        "scope": scope,
        "members": members,
        "leader": leader,
        "paused": record::paused(snap),
        "failover": snap.failover,
        "sync": snap.sync,
    });
    // Patroni's field, present only when paused.
    if record::paused(snap) {
        out["pause"] = json!(true);
    }
    // In Patroni's form, so tools that read it find it.
    if let Some(f) = snap
        .failover
        .as_ref()
        .filter(|f| f.get("scheduled_at").is_some_and(|v| !v.is_null()))
    {
        out["scheduled_switchover"] = json!({
            "at": f["scheduled_at"],
            "from": f.get("from_leader"),
            "to": f.get("candidate"),
        });
    }
    out
}

/// `host:port` into its parts; IPv6 hosts lose their brackets, as in
/// Patroni's output.
fn split_address(addr: &str) -> (String, Option<u16>) {
    match addr.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() => match p.parse() {
            Ok(port) => (
                h.trim_start_matches('[').trim_end_matches(']').to_string(),
                Some(port),
            ),
            Err(_) => (addr.to_string(), None),
        },
        _ => (addr.to_string(), None),
    }
}

async fn cluster(State(state): State<Arc<ApiState>>) -> Result<Response, ApiError> {
    let st = state.status.load_full();
    // Before the HA loop's first read, ask the store rather than show an
    // empty cluster.
    let snap = match &st.cluster {
        Some(c) => c.clone(),
        None => read(&state).await?,
    };
    Ok(Json(cluster_json(&snap, &scope(&state.dcs))).into_response())
}

async fn history(State(state): State<Arc<ApiState>>) -> Result<Response, ApiError> {
    Ok(Json(read(&state).await?.history).into_response())
}

async fn get_config(State(state): State<Arc<ApiState>>) -> Result<Response, ApiError> {
    let config = read(&state).await?.config.unwrap_or_else(|| json!({}));
    Ok(Json(config).into_response())
}

/// A fresh read of the store; the control endpoints must not decide from
/// the HA loop's last snapshot, which may be a loop interval old.
async fn read(state: &ApiState) -> Result<ClusterSnapshot, ApiError> {
    state.dcs.read_cluster().await.map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot read the cluster from the DCS: {}", chain(&e)),
        )
    })
}

// ---------------------------------------------------------------------------
// Control

/// An error with its causes, for messages that must stand alone.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s += &format!(": {c}");
        cause = c.source();
    }
    s
}

/// A plain-text answer, as Patroni gives for its control endpoints.
fn text(code: StatusCode, msg: &str) -> Response {
    (code, format!("{msg}\n")).into_response()
}

/// A refused or failed request: the status and a message for the operator.
#[derive(Debug)]
struct ApiError {
    code: StatusCode,
    msg: String,
}

impl ApiError {
    fn new(code: StatusCode, msg: impl Into<String>) -> Self {
        ApiError {
            code,
            msg: msg.into(),
        }
    }

    fn bad_request(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, msg)
    }

    fn precondition(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::PRECONDITION_FAILED, msg)
    }

    fn unavailable(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, msg)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = text(self.code, &self.msg);
        if self.code == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Basic realm=\"pgwarden\""),
            );
        }
        r
    }
}

/// The write endpoints' user name and password, which a reloaded
/// configuration file replaces while the API serves.
#[derive(Debug, Default)]
pub struct Credentials(arc_swap::ArcSwapOption<(String, String)>);

impl Credentials {
    /// Credentials of `user` and `password`; `None` refuses every write.
    pub fn new(credentials: Option<(String, String)>) -> Arc<Credentials> {
        Arc::new(Credentials(arc_swap::ArcSwapOption::from_pointee(
            credentials,
        )))
    }

    /// The user and password now in force.
    pub fn get(&self) -> Option<(String, String)> {
        self.0.load_full().map(|c| (*c).clone())
    }

    /// Replaces them; whether they changed.
    pub fn set(&self, credentials: Option<(String, String)>) -> bool {
        let old = self.0.swap(credentials.clone().map(Arc::new));
        old.as_deref() != credentials.as_ref()
    }
}

fn authorize(state: &ApiState, headers: &HeaderMap) -> Result<(), ApiError> {
    let credentials = state.credentials.0.load();
    let Some((user, password)) = credentials.as_deref() else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "write endpoints are disabled: configure agent.api_password \
             (or agent.api_password_file, or PGWARDEN_API_PASSWORD)",
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if pgwarden_auth::basic_auth_matches(given, user, password) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication required",
        ))
    }
}

fn is_blank(body: &Bytes) -> bool {
    body.iter().all(u8::is_ascii_whitespace)
}

/// The request body as a JSON object; an empty body is an empty object.
fn body_object(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    if is_blank(body) {
        return Ok(Map::new());
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "the request body is not valid JSON: {}",
            chain(&e)
        ))),
    }
}

/// A string field of a request body; `null` and `""` count as absent.
fn str_field(body: &Map<String, Value>, key: &str) -> Result<Option<String>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad_request(format!("{key:?} must be a string"))),
    }
}

/// Tells the HA loop to look at the DCS now. Best effort: a full queue
/// means an iteration is due anyway.
fn wake(state: &ApiState) {
    let _ = state.commands.try_send(Command::Wake);
}

/// RFC 7396 JSON merge patch: objects merge key by key, `null` deletes,
/// anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(t) = target {
        for (k, v) in patch {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// Applies `patch` to the config key in one compare-and-set. `Ok(None)`:
/// the key changed since it was read.
async fn patch_config_once(state: &ApiState, patch: &Value) -> Result<Option<Value>, ApiError> {
    write_config_once(state, |old| {
        let mut config = old.unwrap_or_else(|| json!({}));
        merge_patch(&mut config, patch);
        config
    })
    .await
}

/// Writes the config `make` builds from the one stored, checked as every
/// agent will read it, in one compare-and-set. `Ok(None)`: the key changed
/// since it was read.
async fn write_config_once(
    state: &ApiState,
    make: impl FnOnce(Option<Value>) -> Value,
) -> Result<Option<Value>, ApiError> {
    let snap = read(state).await?;
    let config = make(snap.config.clone());
    crate::parameters::dynamic(Some(&config)).map_err(ApiError::bad_request)?;
    crate::slots::permanent(Some(&config)).map_err(ApiError::bad_request)?;
    // Read as "not paused" otherwise: an operator would believe automatic
    // failover off while it is on.
    if config
        .get("pause")
        .is_some_and(|v| !v.is_null() && !v.is_boolean())
    {
        return Err(ApiError::bad_request("pause: must be true or false"));
    }
    if let Some(v) = config.get("standby_cluster").filter(|v| !v.is_null()) {
        pgwarden_ha::StandbyCluster::from_json(v).map_err(ApiError::bad_request)?;
    }
    let fenced = record::fenced_in(Some(&config)).map_err(ApiError::bad_request)?;
    if let Some(l) = snap.leader.as_ref().filter(|l| fenced.contains(&l.name)) {
        return Err(ApiError::bad_request(format!(
            "fenced.{}: it leads; switch over to another member before fencing it",
            l.name
        )));
    }
    state
        .status
        .load()
        .node_settings
        .with_dynamic(Some(&config))
        .map_err(ApiError::bad_request)?;
    match state
        .dcs
        .compare_and_put_config(&config, snap.config_revision)
        .await
    {
        Ok(true) => {
            wake(state);
            Ok(Some(config))
        }
        Ok(false) => Ok(None),
        Err(e) => Err(ApiError::unavailable(format!(
            "cannot write the config to the DCS: {}",
            chain(&e)
        ))),
    }
}

async fn patch_config(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    config_request(&state, &headers, &body, "PATCH", |old, patch| {
        let mut config = old.unwrap_or_else(|| json!({}));
        merge_patch(&mut config, &patch);
        config
    })
    .await
}

/// `PUT /config`: replaces the whole dynamic configuration, checked as a
/// patch is.
async fn put_config(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    config_request(&state, &headers, &body, "PUT", |_, whole| whole).await
}

/// A `method` of `/config` whose body (a JSON object) `make` turns, with
/// the stored config, into the new one.
async fn config_request(
    state: &ApiState,
    headers: &HeaderMap,
    body: &Bytes,
    method: &str,
    make: impl FnOnce(Option<Value>, Value) -> Value,
) -> Result<Response, ApiError> {
    authorize(state, headers)?;
    if is_blank(body) {
        return Err(ApiError::bad_request(format!(
            "{method} /config needs a JSON object"
        )));
    }
    let given = Value::Object(body_object(body)?);
    // No retry on conflict, as in Patroni: the caller decided on the change
    // from the config it read, and should look again.
    match write_config_once(state, |old| make(old, given)).await? {
        Some(config) => Ok(Json(config).into_response()),
        None => Err(ApiError::new(
            StatusCode::CONFLICT,
            "the config changed meanwhile; try again",
        )),
    }
}

async fn set_pause(state: &ApiState, headers: &HeaderMap, on: bool) -> Result<Response, ApiError> {
    authorize(state, headers)?;
    let patch = json!({ "pause": on });
    // Setting one flag does not depend on what else the config holds, so a
    // lost race is simply tried again.
    for _ in 0..3 {
        if patch_config_once(state, &patch).await?.is_some() {
            let what = if on {
                "maintenance mode on: automatic failover is paused"
            } else {
                "maintenance mode off: automatic failover resumed"
            };
            return Ok(text(StatusCode::OK, what));
        }
    }
    Err(ApiError::new(
        StatusCode::CONFLICT,
        "the config kept changing concurrently; try again",
    ))
}

async fn pause(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    set_pause(&state, &headers, true).await
}

async fn resume(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    set_pause(&state, &headers, false).await
}

async fn send_command(state: &ApiState, cmd: Command) -> Result<(), ApiError> {
    match tokio::time::timeout(COMMAND_SEND_TIMEOUT, state.commands.send(cmd)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(ApiError::unavailable("the HA loop is not running")),
        Err(_) => Err(ApiError::unavailable("the HA loop is busy; try again")),
    }
}

/// How long a restart order waits for the HA loop to check a condition
/// the published status cannot settle: a loop iteration, the settings'
/// reload and a read of `pg_settings`.
const RESTART_CHECK_TIMEOUT: Duration = Duration::from_secs(20);

/// Requests a restart of PostgreSQL in its current role, at once or at
/// `schedule`, and only if `role` and `restart_pending` (when given) hold
/// then. Answers once the HA loop has the request, not when the restart
/// is done.
async fn restart(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let body = body_object(&body)?;
    let order = restart_order(&body)?;
    let st = state.status.load_full();
    match order.at_ms {
        None => {
            let role = st.member.state.role;
            if role == MemberRole::Stopped {
                return Err(ApiError::unavailable(
                    "restart conditions are not satisfied: PostgreSQL is not running here; the HA loop starts it in the role the cluster gives it",
                ));
            }
            // Settings changed a moment ago may not be applied or seen yet,
            // so only the role is judged here; the loop settles the rest.
            if let Some(why) = order.unmet(role, st.standby_leader, true) {
                return Err(ApiError::unavailable(format!(
                    "restart conditions are not satisfied: {why}"
                )));
            }
            let (reply, answer) = Reply::new();
            send_command(&state, Command::Restart(order, reply)).await?;
            // Dropped on time-out, the answer tells the loop not to restart
            // behind the caller's back.
            match tokio::time::timeout(RESTART_CHECK_TIMEOUT, answer).await {
                Ok(Ok(Ok(()))) => Ok(text(StatusCode::OK, "restart requested")),
                Ok(Ok(Err(why))) => Err(ApiError::unavailable(format!(
                    "restart conditions are not satisfied: {why}"
                ))),
                _ => Err(ApiError::unavailable(
                    "the HA loop did not check the restart conditions in time; not restarted",
                )),
            }
        }
        Some(_) => {
            if st.paused {
                return Err(ApiError::bad_request(
                    "Can't schedule restart in the paused state",
                ));
            }
            // Whether one is scheduled already is the loop's to say: the
            // published status may not show a DELETE or POST answered a
            // moment ago.
            let at = order.schedule.clone().unwrap_or_default();
            let (reply, answer) = Reply::new();
            send_command(&state, Command::Restart(order, reply)).await?;
            match tokio::time::timeout(RESTART_CHECK_TIMEOUT, answer).await {
                Ok(Ok(Ok(()))) => Ok(text(
                    StatusCode::ACCEPTED,
                    &format!("restart scheduled at {at}"),
                )),
                Ok(Ok(Err(why))) => Err(ApiError::new(StatusCode::CONFLICT, why)),
                _ => Err(ApiError::unavailable(
                    "the HA loop did not take the scheduled restart in time; not scheduled",
                )),
            }
        }
    }
}

/// The restart a `POST /restart` body asks for.
fn restart_order(body: &Map<String, Value>) -> Result<RestartOrder, ApiError> {
    // A mistyped condition must not turn into an unconditional restart.
    if let Some(key) = body.keys().find(|k| {
        ![
            "schedule",
            "role",
            "restart_pending",
            "postgres_version",
            "timeout",
        ]
        .contains(&k.as_str())
    }) {
        return Err(ApiError::bad_request(format!(
            "Unknown filter for the scheduled restart: {key}"
        )));
    }
    if body.get("timeout").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad_request(
            "the timeout of a restart is not supported: the HA loop waits primary_start_timeout for a leader's PostgreSQL to start",
        ));
    }
    if body.get("postgres_version").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad_request(
            "the postgres_version condition is not supported",
        ));
    }
    let role = match str_field(body, "role")?.as_deref() {
        None => None,
        Some("primary" | "master") => Some("primary".to_string()),
        Some("replica") => Some("replica".to_string()),
        Some("standby_leader" | "standby-leader") => Some("standby_leader".to_string()),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "role {other:?}: use primary, standby_leader or replica"
            )))
        }
    };
    let restart_pending = match body.get("restart_pending") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::bad_request(
                "\"restart_pending\" must be true or false",
            ))
        }
    };
    let (schedule, at_ms) = match str_field(body, "schedule")? {
        None => (None, None),
        Some(text) => {
            let at = future_timestamp(&text).map_err(|e| {
                ApiError::bad_request(match e {
                    Some(TimestampError::NoOffset) => {
                        "Timezone information is mandatory for the scheduled restart".to_string()
                    }
                    Some(TimestampError::Invalid) => unparsable(&text),
                    None => "Cannot schedule restart in the past".to_string(),
                })
            })?;
            (Some(format_timestamp(at)), Some(at as u64))
        }
    };
    Ok(RestartOrder {
        schedule,
        at_ms,
        role,
        restart_pending,
    })
}

/// Wipes this replica's data and clones the leader again. Refused on the
/// leader, and without a leader to clone.
async fn reinitialize(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let st = state.status.load_full();
    if st.is_leader || st.member.state.role == MemberRole::Primary {
        return Err(ApiError::unavailable(
            "I am the leader, can not reinitialize",
        ));
    }
    if st.leader.is_none() || st.leader.as_deref() == Some(state.name.as_str()) {
        return Err(ApiError::unavailable(
            "there is no leader to clone; can not reinitialize",
        ));
    }
    use std::sync::atomic::Ordering;
    if state
        .reinitializing
        .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return Err(ApiError::unavailable("reinitialize already in progress"));
    }
    if let Err(e) = send_command(&state, Command::Reinitialize).await {
        state.reinitializing.store(false, Ordering::SeqCst);
        return Err(e);
    }
    Ok(text(StatusCode::OK, "reinitialize started"))
}

/// Withdraws the scheduled restart.
async fn cancel_restart(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    // Answered by the loop once its status no longer shows the restart, so
    // that a new order right after is not refused as a second one.
    let (reply, answer) = Reply::new();
    send_command(&state, Command::CancelRestart(reply)).await?;
    match tokio::time::timeout(RESTART_CHECK_TIMEOUT, answer).await {
        Ok(Ok(Ok(()))) => Ok(text(StatusCode::OK, "scheduled restart cancelled")),
        Ok(Ok(Err(why))) => Err(ApiError::new(StatusCode::NOT_FOUND, why)),
        _ => Err(ApiError::unavailable(
            "the HA loop did not take the cancellation in time; it may still withdraw the restart",
        )),
    }
}

async fn reload(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    send_command(&state, Command::Reload).await?;
    Ok(text(StatusCode::ACCEPTED, "reload requested"))
}

/// Refuses `candidate` as the target of a manual switchover or failover
/// if it may not lead. The operator's intent (tags, fencing) always
/// counts; `data_checks` adds a stopped PostgreSQL and the election's
/// liveness, lag and timeline checks, which a scheduled switchover leaves
/// to the moment it is carried out.
fn check_candidate(
    st: &AgentStatus,
    snap: &ClusterSnapshot,
    candidate: &str,
    data_checks: bool,
    switchover: bool,
) -> Result<(), ApiError> {
    let mut view = record::cluster_view(snap, record::unix_ms());
    if switchover {
        // The candidate catches up with the stopped leader before it is
        // promoted (as the HA loops judge it too): lag does not count, nor
        // the quorum rule.
        view.last_leader_lsn = None;
        view.sync_quorum = None;
    }
    if view.member(candidate).is_none() {
        return Err(ApiError::precondition(format!(
            "candidate {candidate} is not a member of the cluster"
        )));
    }
    if switchover
        && data_checks
        && view
            .member(candidate)
            .is_some_and(|m| m.streaming == Some(false))
    {
        // The leader would not hand over (it stops first, and only a
        // streaming standby receives its last WAL on the way down).
        return Err(ApiError::precondition(format!(
            "candidate {candidate} cannot be promoted: it is not streaming from the leader, \
             so it would not receive the leader's last WAL"
        )));
    }
    let ranking = rank_candidates(&view, &election_settings(st));
    let Some(reason) = ranking.exclusion(candidate) else {
        return Ok(());
    };
    let operator_intent = matches!(
        reason,
        ExclusionReason::NoFailoverTag | ExclusionReason::PriorityZero | ExclusionReason::Fenced
    );
    if data_checks || operator_intent {
        return Err(ApiError::precondition(format!(
            "candidate {candidate} cannot be promoted: {reason}"
        )));
    }
    Ok(())
}

fn election_settings(st: &AgentStatus) -> ElectionSettings {
    ElectionSettings {
        maximum_lag_on_failover: st.settings.maximum_lag_on_failover,
        ttl: st.settings.timing.ttl,
    }
}

/// What a waiting request counts as done.
enum Goal<'a> {
    /// The leader key names this member.
    Leader(&'a str),
    /// The leader key names anyone but this member.
    AwayFrom(&'a str),
}

impl Goal<'_> {
    fn reached(&self, holder: Option<&str>) -> bool {
        match *self {
            Goal::Leader(c) => holder == Some(c),
            Goal::AwayFrom(l) => holder.is_some_and(|h| h != l),
        }
    }
}

/// Writes the failover key, then waits for the leader key to move.
async fn request_and_wait(
    state: &ApiState,
    mut request: Value,
    goal: Goal<'_>,
    what: &str,
) -> Result<Response, ApiError> {
    // Dated: the leader withdraws a request nobody carried out within
    // [`pgwarden_ha::UNATTENDED_REQUEST`] (as long as this waits), which a
    // later leader would otherwise carry out whenever its candidate
    // qualified. The leader, which acts on it, decides: never a race with
    // a hand-over under way.
    request["requested_ms"] = json!(record::unix_ms());
    let leader_before = state
        .dcs
        .read_cluster()
        .await
        .ok()
        .and_then(|s| s.leader.map(|l| l.name));
    state.dcs.put_failover(&request).await.map_err(|e| {
        ApiError::unavailable(format!(
            "cannot write the {what} request to the DCS: {}",
            chain(&e)
        ))
    })?;
    wake(state);
    tracing::info!(%request, "{what} requested through the API");
    let deadline = Instant::now() + state.switchover_wait;
    let mut withdrawn_since: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        tokio::time::sleep(POLL_INTERVAL.min(deadline - now)).await;
        // A failed read is no answer either way; the deadline bounds the
        // retries.
        let Ok(snap) = state.dcs.read_cluster().await else {
            continue;
        };
        let holder = snap.leader.as_ref().map(|l| l.name.as_str());
        if goal.reached(holder) {
            let verb = if what == "switchover" {
                "switched"
            } else {
                "failed"
            };
            let new = holder.unwrap_or_default();
            return Ok(text(
                StatusCode::OK,
                &format!("Successfully {verb} over to {new}"),
            ));
        }
        if snap.failover.is_some() {
            withdrawn_since = None;
        } else if withdrawn_since.get_or_insert_with(Instant::now).elapsed() >= WITHDRAWN_GRACE {
            // Another request, carried out meanwhile, replaced this one.
            if let Some(now) = holder.filter(|h| Some(*h) != leader_before.as_deref()) {
                return Err(ApiError::unavailable(format!(
                    "{what} not carried out as requested: {now} leads now; \
                     another request replaced this one"
                )));
            }
            return Err(ApiError::unavailable(format!(
                "{what} status unknown: the request was withdrawn (cancelled, or refused \
                 by the cluster) and the leader did not change"
            )));
        }
    }
    Err(ApiError::unavailable(format!(
        "{what} status unknown: the leader did not change within {:?}",
        state.switchover_wait
    )))
}

/// The Unix time (ms) of a switchover scheduled at `text`, refused as
/// Patroni refuses it: in maintenance mode, without a UTC offset, not a
/// timestamp, or in the past.
fn schedule_time(snap: &ClusterSnapshot, text: &str) -> Result<i64, ApiError> {
    if record::paused(snap) {
        return Err(ApiError::bad_request(
            "Can't schedule switchover in the paused state",
        ));
    }
    future_timestamp(text).map_err(|e| match e {
        Some(TimestampError::NoOffset) => {
            ApiError::bad_request("Timezone information is mandatory for the scheduled switchover")
        }
        Some(TimestampError::Invalid) => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, unparsable(text))
        }
        None => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Cannot schedule switchover in the past",
        ),
    })
}

/// The Unix time (ms) of `text`, an ISO 8601 timestamp with a UTC offset
/// that has not passed; `Err(None)` when it has.
fn future_timestamp(text: &str) -> Result<i64, Option<TimestampError>> {
    let at = parse_timestamp(text).map_err(Some)?;
    if at < i64::try_from(record::unix_ms()).unwrap_or(i64::MAX) {
        return Err(None);
    }
    Ok(at)
}

/// Patroni's answer to a schedule it cannot read.
fn unparsable(text: &str) -> String {
    format!(
        "Unable to parse scheduled timestamp {text:?}. It should be in an unambiguous \
         format, e.g. ISO 8601"
    )
}

async fn switchover(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let body = body_object(&body)?;
    do_switchover(&state, &body).await
}

async fn do_switchover(
    state: &Arc<ApiState>,
    body: &Map<String, Value>,
) -> Result<Response, ApiError> {
    let leader = str_field(body, "leader")?;
    let mut candidate = str_field(body, "candidate")?;
    let scheduled_at = str_field(body, "scheduled_at")?;
    if leader.is_none() && candidate.is_none() {
        return Err(ApiError::bad_request(
            "a switchover needs the current leader or a candidate",
        ));
    }
    if leader.is_some() && leader == candidate {
        return Err(ApiError::bad_request(
            "the candidate is the leader; a switchover is only possible to another member",
        ));
    }
    let snap = read(state).await?;
    let scheduled_at = match scheduled_at {
        Some(text) => Some(schedule_time(&snap, &text)?),
        None => None,
    };
    let Some(current) = snap.leader.as_ref().map(|l| l.name.clone()) else {
        return Err(ApiError::precondition(
            "there is no leader to switch over from; use failover",
        ));
    };
    if leader.as_ref().is_some_and(|l| *l != current) {
        return Err(ApiError::precondition(format!(
            "leader name does not match: the leader is {current}"
        )));
    }
    if candidate.as_deref() == Some(current.as_str()) {
        return Err(ApiError::bad_request(format!(
            "{current} is already the leader; a switchover is only possible to another member"
        )));
    }
    let st = state.status.load_full();
    let goal = match &candidate {
        Some(c) => {
            // Health and lag may change before a scheduled time; the
            // leader judges them when it comes.
            check_candidate(&st, &snap, c, scheduled_at.is_none(), true)?;
            Goal::Leader(c)
        }
        None if record::paused(&snap) => {
            // In maintenance mode the operator names the member, as in
            // Patroni: the automation picks no one.
            return Err(ApiError::bad_request(
                "Switchover is possible only to a specific candidate in a paused state",
            ));
        }
        None => {
            // Without a candidate the best-ranked other member is named, so
            // the request is one the HA loops act on.
            let mut view = record::cluster_view(&snap, record::unix_ms());
            view.members
                .retain(|m| m.name != current && m.streaming != Some(false));
            view.last_leader_lsn = None;
            let Some(best) = rank_candidates(&view, &election_settings(&st))
                .best()
                .map(str::to_string)
            else {
                return Err(ApiError::precondition("no good candidates have been found"));
            };
            candidate = Some(best);
            Goal::AwayFrom(&current)
        }
    };
    let mut request = json!({ "from_leader": current });
    if let Some(c) = &candidate {
        request["candidate"] = json!(c);
    }
    if let Some(at) = scheduled_at {
        // The leader's loop carries it out when the time comes (and pauses
        // the connection managers then); nobody waits for it here.
        request["scheduled_at"] = json!(format_timestamp(at));
        state.dcs.put_failover(&request).await.map_err(|e| {
            ApiError::unavailable(format!(
                "cannot write the switchover request to the DCS: {}",
                chain(&e)
            ))
        })?;
        wake(state);
        tracing::info!(%request, "switchover scheduled through the API");
        return Ok(text(StatusCode::ACCEPTED, "Switchover scheduled"));
    }
    // Transaction-pooled clients must not notice: every node's read-write
    // pools pause (new transactions wait, those in flight finish) before
    // the old leader stops, and resume once the new one takes writes.
    let proxies: Vec<String> = record::records(&snap)
        .into_iter()
        .filter_map(|r| r.proxy_url)
        .collect();
    // In a task of its own: a caller that hangs up (Ctrl-C, a client
    // time-out) drops this handler, and the pools must still resume.
    let (leader_goal, name) = match goal {
        Goal::Leader(c) => (true, c.to_string()),
        Goal::AwayFrom(c) => (false, c.to_string()),
    };
    let state = state.clone();
    let task = tokio::spawn(async move {
        let goal = if leader_goal {
            Goal::Leader(&name)
        } else {
            Goal::AwayFrom(&name)
        };
        let paused = handover::pause_proxies(&proxies, &state.credentials).await;
        let result = request_and_wait(&state, request, goal, "switchover").await;
        if result.is_ok() {
            handover::wait_for_writable_leader(&state.dcs, None, handover::WRITABLE_WAIT).await;
        }
        handover::resume_proxies(&paused, &state.credentials).await;
        result
    });
    task.await
        .unwrap_or_else(|e| Err(ApiError::unavailable(format!("the switchover failed: {e}"))))
}

async fn failover(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let body = body_object(&body)?;
    // As in Patroni, naming the leader turns a failover into a switchover.
    if body.get("leader").is_some_and(|v| !v.is_null()) {
        return do_switchover(&state, &body).await;
    }
    if body.get("scheduled_at").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad_request("Failover can't be scheduled"));
    }
    // Patroni takes `member` for the candidate too.
    let candidate = match str_field(&body, "candidate")? {
        Some(c) => Some(c),
        None => str_field(&body, "member")?,
    };
    let Some(candidate) = candidate else {
        return Err(ApiError::bad_request("a failover needs a candidate"));
    };
    let force = match body.get("force") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad_request("\"force\" must be true or false")),
    };
    let snap = read(&state).await?;
    let healthy_leader = snap
        .leader
        .as_ref()
        .filter(|l| !l.ttl_left.is_some_and(|t| t.is_zero()));
    if let Some(l) = healthy_leader {
        if l.name == candidate {
            return Err(ApiError::bad_request(format!(
                "{candidate} is already the leader"
            )));
        }
        if !force {
            return Err(ApiError::precondition(format!(
                "failover is possible only to a cluster without a leader, and {} holds the leader key: use switchover, or failover --force if that leader is known to be dead",
                l.name
            )));
        }
    }
    if force {
        // A forced failover is the operator overriding every check but the
        // one that makes it meaningful.
        if !record::records(&snap)
            .iter()
            .any(|r| r.state.name == candidate)
        {
            return Err(ApiError::precondition(format!(
                "candidate {candidate} is not a member of the cluster"
            )));
        }
        // Fencing is the operator's own word that the member must not
        // lead; force overrides health checks, not that.
        if record::fenced(&snap).contains(&candidate) {
            return Err(ApiError::precondition(format!(
                "candidate {candidate} is fenced; unfence it first"
            )));
        }
    } else {
        // The candidate's agent acts on an unforced request only if it
        // passes the election's checks, so refuse here what it would ignore.
        let st = state.status.load_full();
        check_candidate(&st, &snap, &candidate, true, false)?;
    }
    let request = json!({ "candidate": candidate, "forced": force });
    request_and_wait(&state, request, Goal::Leader(&candidate), "failover").await
}

/// `DELETE /switchover`: withdraws the pending request, scheduled or not,
/// but only the one read: a request written meanwhile stays (409).
async fn cancel_switchover(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let snap = read(&state).await?;
    let Some(request) = snap.failover else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "no switchover is scheduled",
        ));
    };
    let deleted = state
        .dcs
        .delete_failover_if(snap.failover_revision)
        .await
        .map_err(|e| {
            ApiError::unavailable(format!(
                "cannot delete the switchover request: {}",
                chain(&e)
            ))
        })?;
    if !deleted {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "the request changed while it was being withdrawn; look again",
        ));
    }
    wake(&state);
    tracing::info!(%request, "switchover request withdrawn through the API");
    let what = if request.get("scheduled_at").is_some_and(|v| !v.is_null()) {
        "scheduled switchover deleted"
    } else {
        "pending switchover cancelled"
    };
    Ok(text(StatusCode::OK, what))
}

/// `GET /metrics`: the local member's HA state in Prometheus text format,
/// including whether commits wait for a synchronous standby and whether
/// durability is degraded, and since how long.
async fn metrics(State(state): State<Arc<ApiState>>) -> Response {
    use prometheus_client::metrics::gauge::Gauge;
    let st = state.status.load_full();
    let mut registry = prometheus_client::registry::Registry::with_prefix("pgwarden_ha");
    let mut gauge = |name: &str, help: &str, value: i64| {
        let g: Gauge = Gauge::default();
        g.set(value);
        registry.register(name, help, g);
    };
    let now = record::unix_ms();
    let sync = st
        .cluster
        .as_ref()
        .and_then(record::sync_state)
        .filter(|s| st.leader.as_deref() == Some(s.leader.as_str()));
    let since = |v: Option<u64>| v.map_or(0, |t| (now.saturating_sub(t) / 1000) as i64);
    gauge(
        "leader",
        "1 while this member leads and takes writes",
        i64::from(st.is_leader),
    );
    gauge(
        "dcs_reachable",
        "1 while the last etcd request succeeded",
        i64::from(st.dcs_reachable),
    );
    gauge("paused", "1 in maintenance mode", i64::from(st.paused));
    let replication = st.member.replication_state.as_deref();
    gauge(
        "streaming",
        "1 while this standby's WAL receiver streams",
        i64::from(replication == Some("streaming")),
    );
    gauge(
        "in_archive_recovery",
        "1 while this standby replays without streaming (from the archive or its own WAL)",
        i64::from(replication == Some("in archive recovery")),
    );
    gauge(
        "timeline",
        "PostgreSQL timeline",
        i64::from(st.member.state.timeline),
    );
    gauge(
        "lag_bytes",
        "Bytes this replica trails the leader's last published position",
        st.member.lag_bytes.map_or(0, |l| l as i64),
    );
    gauge(
        "sync_standbys",
        "Synchronous standbys listed by the leader",
        sync.as_ref().map_or(0, |s| s.members.len() as i64),
    );
    gauge(
        "sync_quorum",
        "How many of the listed synchronous standbys hold each acknowledged commit",
        sync.as_ref().map_or(0, |s| s.claim().quorum as i64),
    );
    gauge(
        "sync_blocked_seconds",
        "Seconds commits have waited with no synchronous standby acknowledging (0: not waiting)",
        since(sync.as_ref().and_then(|s| s.blocked_since_ms)),
    );
    gauge(
        "sync_degraded_seconds",
        "Seconds the leader has run asynchronously for want of a standby (0: not degraded)",
        since(sync.as_ref().and_then(|s| s.degraded_since_ms)),
    );
    let mut body = String::new();
    if prometheus_client::encoding::text::encode(&mut body, &registry).is_err() {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// How long a member asked to acknowledge a leader spends checking that it
/// cannot reach etcd itself: well inside the leader's request budget.
const FAILSAFE_CHECK: Duration = Duration::from_secs(1);

/// `POST /failsafe`: a leader that cannot reach etcd asks whether it may
/// keep leading. A member answers yes only while it cannot reach etcd
/// either and does not lead itself: one that reaches etcd follows etcd,
/// where another leader may be elected, so it must refuse.
async fn failsafe(State(state): State<Arc<ApiState>>, headers: HeaderMap) -> Response {
    let st = state.status.load_full();
    // An acknowledgement holds this member back from taking the key after
    // an outage: only the members (which send the API's credentials, as
    // Patroni's do) may give it one, and only in failsafe mode.
    if state.credentials.get().is_some() {
        if let Err(e) = authorize(&state, &headers) {
            return e.into_response();
        }
    }
    if !st.settings.failsafe {
        return text(StatusCode::BAD_GATEWAY, "failsafe mode is not enabled");
    }
    if st.is_leader {
        return text(StatusCode::CONFLICT, "this member leads");
    }
    // The HA loop's view is up to a loop old: a leader that lost etcd a
    // moment ago asks before this member's own next read has failed. The
    // answer is what etcd says now, so ask it.
    if st.dcs_reachable
        && matches!(
            tokio::time::timeout(FAILSAFE_CHECK, state.dcs.read_cluster()).await,
            Ok(Ok(_))
        )
    {
        return text(
            StatusCode::CONFLICT,
            "etcd is reachable from here; follow etcd",
        );
    }
    state
        .failsafe_seen
        .store(record::unix_ms(), std::sync::atomic::Ordering::SeqCst);
    text(StatusCode::OK, "acknowledged")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_accepts_bytes_and_memory_units() {
        assert_eq!(parse_lag("0"), Ok(0));
        assert_eq!(parse_lag("1048576"), Ok(1_048_576));
        assert_eq!(parse_lag("16kB"), Ok(16 * 1024));
        assert_eq!(parse_lag("10MB"), Ok(10 * 1024 * 1024));
        assert_eq!(parse_lag("2GB"), Ok(2 << 30));
        assert_eq!(parse_lag("1TB"), Ok(1 << 40));
        assert_eq!(parse_lag("512B"), Ok(512));
        assert_eq!(parse_lag(" 16 kb "), Ok(16 * 1024));
        for bad in [
            "",
            "kB",
            "-1",
            "1.5MB",
            "10XB",
            "99999999999999999999",
            "20000000TB",
        ] {
            assert!(parse_lag(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn merge_patch_merges_replaces_and_deletes() {
        let mut c = json!({"ttl": 30, "postgresql": {"parameters": {"a": 1, "b": 2}}, "x": 1});
        merge_patch(
            &mut c,
            &json!({"ttl": 20, "postgresql": {"parameters": {"a": null, "c": 3}}, "x": null, "y": [1]}),
        );
        assert_eq!(
            c,
            json!({"ttl": 20, "postgresql": {"parameters": {"b": 2, "c": 3}}, "y": [1]})
        );
    }

    #[test]
    fn credentials_are_replaced_in_place() {
        let c = Credentials::new(Some(("u".into(), "p".into())));
        assert!(!c.set(Some(("u".into(), "p".into()))), "unchanged");
        assert!(c.set(Some(("u".into(), "q".into()))));
        assert_eq!(
            c.0.load().as_deref(),
            Some(&("u".to_string(), "q".to_string()))
        );
        assert!(c.set(None));
        assert!(c.0.load().is_none());
    }

    #[test]
    fn addresses_split_into_host_and_port() {
        assert_eq!(
            split_address("10.0.0.1:5432"),
            ("10.0.0.1".into(), Some(5432))
        );
        assert_eq!(split_address("[::1]:5433"), ("::1".into(), Some(5433)));
        assert_eq!(split_address("db1"), ("db1".into(), None));
    }
}
