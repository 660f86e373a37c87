//! The HTTP port: health, cluster state and metrics.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use pgwarden_topology::view::TopologyView;
use serde::Serialize;

use crate::proxy::Shared;

/// Connections the HTTP port serves at once; more are closed as they
/// come. Scrapers, health checks and the agents need a handful, and the
/// port shares the process's descriptors with the database listeners.
const MAX_HTTP_CONNECTIONS: usize = 256;

/// How long a connection may take to send a request's head, and may sit
/// idle between requests, before it is closed: a client that opens
/// connections and sends nothing (or a byte at a time) cannot hold them.
const HTTP_HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `app` on `listener`, HTTP/1.1, with each request's
/// `ConnectInfo` set to the peer's address. Not `axum::serve`, whose
/// connections have no timer, so hyper's header read timeout never fires.
pub(crate) async fn serve(listener: tokio::net::TcpListener, app: Router) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors and the like: pause rather than spin.
                tracing::warn!(error = %e, "HTTP: accept failed");
                crate::timer::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "HTTP: connection limit reached, closing");
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let app = app.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    req.extensions_mut()
                        .insert(axum::extract::ConnectInfo(peer));
                    let mut app = app.clone();
                    async move { tower_service::Service::call(&mut app, req).await }
                },
            );
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HTTP_HEAD_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                .await;
            drop(slot);
        });
    }
}

/// The HTTP routes, over the proxy's shared state.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/cluster", get(cluster))
        .route("/metrics", get(metrics))
        .route("/pause", axum::routing::post(pause))
        .route("/resume", axum::routing::post(resume))
        .with_state(shared)
}

async fn health(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    if shared.accepting.load(Ordering::SeqCst) {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
    }
}

#[derive(Serialize)]
struct ServiceView {
    name: String,
    listen: String,
    select: String,
    strategy: String,
    read_only: bool,
    /// Whether the service is paused: new transactions (or sessions) wait.
    paused: bool,
    /// Hosts a new session could be routed to now, in `host:port` form.
    targets: Vec<String>,
    /// Why the service refuses new sessions and transactions now (writes
    /// blocked by the HA agent), or null: its targets are then reachable
    /// but not served.
    refused: Option<String>,
}

#[derive(Serialize)]
struct ClusterView {
    #[serde(flatten)]
    topology: TopologyView,
    services: Vec<ServiceView>,
    sessions: usize,
}

async fn cluster(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let snap = shared.snapshot.load_full();
    let topo = &snap.topology;
    let mut services: Vec<ServiceView> = shared
        .services
        .lock()
        .expect("poisoned")
        .values()
        .map(|s| {
            let s = s.load_full();
            ServiceView {
                name: s.spec.name.clone(),
                listen: s.spec.listen.to_string(),
                select: s.spec.want.to_string(),
                strategy: s.spec.policy.strategy.to_string(),
                read_only: s.spec.read_only,
                paused: *shared.paused(&s.spec.name).borrow(),
                targets: s
                    .selector
                    .eligible(topo, &s.spec.want)
                    .into_iter()
                    .map(|i| topo.hosts()[i].config.addr.to_string())
                    .collect(),
                refused: shared.refusal(&s.spec.name).map(|r| r.to_string()),
            }
        })
        .collect();
    services.sort_by(|a, b| a.name.cmp(&b.name));
    Json(ClusterView {
        topology: TopologyView::new(topo, snap.round),
        services,
        sessions: shared.sessions.lock().expect("poisoned").len(),
    })
}

#[derive(serde::Deserialize)]
struct ServiceQuery {
    service: String,
    /// With `pause`: wait up to this many milliseconds for the transactions
    /// in flight on the paused services' pools to finish.
    wait_ms: Option<u64>,
}

/// Whether a request may pause or resume services, which stops traffic.
fn may_switch(
    shared: &Shared,
    peer: std::net::SocketAddr,
    headers: &axum::http::HeaderMap,
) -> Result<(), (StatusCode, String)> {
    use axum::http::header;
    let source = shared.http_credentials.lock().expect("poisoned").clone();
    switch_allowed(
        source.and_then(|s| s()),
        peer,
        headers.contains_key(header::ORIGIN),
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    )
}

/// The rule behind [`may_switch`]. With `credentials` (in agent mode, the
/// REST API's), the request must carry them; without, it must come from
/// this machine. One a web page makes (it carries `Origin`) never may: a
/// page could otherwise have the browser of someone on this machine stop
/// the cluster's writes.
fn switch_allowed(
    credentials: Option<(String, String)>,
    peer: std::net::SocketAddr,
    from_web_page: bool,
    authorization: Option<&str>,
) -> Result<(), (StatusCode, String)> {
    if from_web_page {
        return Err((
            StatusCode::FORBIDDEN,
            "requests from web pages are refused\n".into(),
        ));
    }
    match credentials {
        Some((user, password)) => {
            if pgwarden_auth::basic_auth_matches(authorization, &user, &password) {
                Ok(())
            } else {
                Err((
                    StatusCode::UNAUTHORIZED,
                    "authentication required (the agent's REST API credentials)\n".into(),
                ))
            }
        }
        // A dual-stack listener shows an IPv4 peer as ::ffff:a.b.c.d.
        None if peer.ip().to_canonical().is_loopback() => Ok(()),
        None => Err((
            StatusCode::FORBIDDEN,
            "pause and resume are taken from this machine only (or, in agent mode, with the REST API's credentials); the admin console's PAUSE and RESUME work from anywhere\n".into(),
        )),
    }
}

async fn pause(
    State(shared): State<Arc<Shared>>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    headers: axum::http::HeaderMap,
    axum::extract::Query(q): axum::extract::Query<ServiceQuery>,
) -> impl IntoResponse {
    if let Err(refused) = may_switch(&shared, peer, &headers) {
        return refused;
    }
    let (code, text) = switch(&shared, &q.service, true);
    let Some(wait) = q.wait_ms.filter(|_| code == StatusCode::OK) else {
        return (code, text);
    };
    // A planned switchover pauses every node, then waits here until no
    // server connection of a read-write pool is in a transaction, so that
    // stopping the old primary cuts nothing.
    // A wait longer than an hour is taken as an hour: the caller gets its
    // answer, and the deadline cannot overflow the clock.
    let wait = std::time::Duration::from_millis(wait.min(3_600_000));
    let deadline = tokio::time::Instant::now() + wait;
    // The transactions the pause holds back are those of the pools its
    // services use (pools are shared by the services of a kind), as the
    // admin console's PAUSE counts them: a paused read-only service does
    // not wait for the writers, nor the writers for the readers.
    let services = shared.pause_targets(Some(&q.service));
    loop {
        // A resume of any of them (another caller, the admin console)
        // ends the wait: a 200 "paused" must not tell a switchover it may
        // stop the old primary while new transactions run there.
        if !services.iter().all(|s| *shared.paused(s).borrow()) {
            return (
                StatusCode::CONFLICT,
                format!("{} was resumed while waiting\n", q.service),
            );
        }
        let busy = shared.in_transaction(&services);
        if busy == 0 {
            return (
                StatusCode::OK,
                format!("paused {}; no transaction in flight\n", q.service),
            );
        }
        if tokio::time::Instant::now() >= deadline {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "paused {}; {busy} transactions still in flight\n",
                    q.service
                ),
            );
        }
        crate::timer::sleep(std::time::Duration::from_millis(10)).await;
    }
}

async fn resume(
    State(shared): State<Arc<Shared>>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    headers: axum::http::HeaderMap,
    axum::extract::Query(q): axum::extract::Query<ServiceQuery>,
) -> impl IntoResponse {
    if let Err(refused) = may_switch(&shared, peer, &headers) {
        return refused;
    }
    switch(&shared, &q.service, false)
}

/// Pausing stops new transactions from getting a server connection (they
/// wait, bounded by `query_wait_timeout`); transactions in flight finish.
fn switch(shared: &Shared, service: &str, pause: bool) -> (StatusCode, String) {
    if shared.set_paused(service, pause) {
        let what = if pause { "paused" } else { "resumed" };
        tracing::info!(service, "{what}");
        (StatusCode::OK, format!("{what} {service}\n"))
    } else {
        (
            StatusCode::NOT_FOUND,
            format!("no service named {service:?}\n"),
        )
    }
}

async fn metrics(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let snap = shared.snapshot.load_full();
    for (i, n) in shared.workers.client_counts().enumerate() {
        shared
            .metrics
            .worker_clients
            .get_or_create(&crate::metrics::WorkerLabel {
                worker: i.to_string(),
            })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    {
        // Under the lock a reload removes services with: a series set
        // here for a service removed meanwhile would stay for ever.
        let services = shared.services.lock().expect("poisoned");
        for name in services.keys() {
            let paused = *shared.paused(name).borrow();
            shared
                .metrics
                .service_paused
                .get_or_create(&crate::metrics::ServiceLabel {
                    service: name.clone(),
                })
                .set(i64::from(paused));
        }
    }
    // Taken out of the table first: logins look pools up under its lock,
    // and must not wait for the page to be rendered.
    let pools: Vec<_> = shared
        .pools
        .lock()
        .expect("poisoned")
        .values()
        .cloned()
        .collect();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        shared.metrics.render(&snap, &pools),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_and_resume_need_this_machine_or_the_credentials() {
        let local: std::net::SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let remote: std::net::SocketAddr = "10.1.2.3:5000".parse().unwrap();
        let local6: std::net::SocketAddr = "[::1]:5000".parse().unwrap();
        let code = |r: Result<(), (StatusCode, String)>| r.err().map(|(c, _)| c);
        // No credentials: this machine only, and never a web page.
        assert_eq!(code(switch_allowed(None, local, false, None)), None);
        assert_eq!(code(switch_allowed(None, local6, false, None)), None);
        // An IPv4 client of a dual-stack listener.
        let mapped: std::net::SocketAddr = "[::ffff:127.0.0.1]:5000".parse().unwrap();
        assert_eq!(code(switch_allowed(None, mapped, false, None)), None);
        let mapped_remote: std::net::SocketAddr = "[::ffff:10.1.2.3]:5000".parse().unwrap();
        assert_eq!(
            code(switch_allowed(None, mapped_remote, false, None)),
            Some(StatusCode::FORBIDDEN)
        );
        assert_eq!(
            code(switch_allowed(None, remote, false, None)),
            Some(StatusCode::FORBIDDEN)
        );
        assert_eq!(
            code(switch_allowed(None, local, true, None)),
            Some(StatusCode::FORBIDDEN)
        );
        // Credentials: required from everyone, this machine included.
        let creds = || Some(("pgwarden".to_string(), "s3cret".to_string()));
        // base64("pgwarden:s3cret")
        let good = "Basic cGd3YXJkZW46czNjcmV0";
        assert_eq!(
            code(switch_allowed(creds(), remote, false, Some(good))),
            None
        );
        assert_eq!(
            code(switch_allowed(
                creds(),
                local,
                false,
                Some("basic cGd3YXJkZW46czNjcmV0")
            )),
            None
        );
        for bad in [
            None,
            Some("Basic cGd3YXJkZW46d3Jvbmc="),
            Some("Bearer x"),
            Some("Basic !!"),
        ] {
            assert_eq!(
                code(switch_allowed(creds(), local, false, bad)),
                Some(StatusCode::UNAUTHORIZED),
                "{bad:?}"
            );
        }
        assert_eq!(
            code(switch_allowed(creds(), remote, true, Some(good))),
            Some(StatusCode::FORBIDDEN)
        );
    }
}
