//! One client connection: startup, routing, the relay, and its end.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use pgwarden_topology::{HostAddr, NoTarget};
use pgwarden_wire::encode;
use pgwarden_wire::message::{backend, frontend, TxStatus};
use pgwarden_wire::readonly::{check_read_only_bytes, startup_sets_read_only_guc};
use pgwarden_wire::readonly_pipeline::{Admission, ReadOnlyPipeline};
use pgwarden_wire::sqlstate::{self, SqlState};
use pgwarden_wire::startup::{parse_startup, StartupFrame, StartupMessage};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::Instrument;

use crate::auth::Credential;
use crate::cancel::BackendKey;
use crate::metrics::{HostLabel, RouteLabel, ServiceLabel};
use crate::proxy::ClientTlsMode;
use crate::proxy::{Kill, KillState, Service, SessionEntry, SessionGuard, Shared};
use crate::relay::{pump, Direct, End, Framing, Verdict};
use crate::stream::{ClientStream, ServerStream};

/// An error to report to the client before closing.
struct Refusal {
    code: SqlState,
    message: String,
    reason: &'static str,
}

impl Refusal {
    fn new(code: SqlState, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            reason,
        }
    }
}

/// Turns a client away when `max_client_conn` is reached; existing clients
/// are not affected. Its SSLRequest (libpq's default `sslmode=prefer`
/// sends one first) is declined first, so that the client reads the error
/// as the answer to its start-up rather than as a broken SSL exchange;
/// all of it within a second. A CancelRequest is forwarded, as PostgreSQL
/// serves cancels whatever its connection count: a pooler full of clients
/// waiting on long queries is when they are needed most.
pub(crate) async fn refuse_busy<S>(shared: Arc<Shared>, mut client: S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let Some(_refusing) = Refusing::take() else {
        return;
    };
    let out = encode::fatal(
        sqlstate::TOO_MANY_CONNECTIONS.code(),
        "no more connections allowed (max_client_conn)",
    );
    let read = crate::timer::timeout(Duration::from_secs(1), async {
        let mut declined = false;
        loop {
            let mut head = [0u8; 8];
            client.read_exact(&mut head).await.ok()?;
            let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
            let code = i32::from_be_bytes([head[4], head[5], head[6], head[7]]);
            if code == pgwarden_wire::startup::CANCEL_REQUEST && len == 16 {
                let mut key = [0u8; 8];
                client.read_exact(&mut key).await.ok()?;
                return Some(Some((
                    i32::from_be_bytes([key[0], key[1], key[2], key[3]]),
                    i32::from_be_bytes([key[4], key[5], key[6], key[7]]),
                )));
            }
            if !declined
                && (code == pgwarden_wire::startup::SSL_REQUEST
                    || code == pgwarden_wire::startup::GSSENC_REQUEST)
            {
                client.write_all(b"N").await.ok()?;
                declined = true;
                continue;
            }
            // A start-up packet, whose rest goes unread.
            return Some(None);
        }
    })
    .await;
    match read {
        Ok(Some(Some((pid, secret)))) => forward_cancel(&shared, pid, secret).await,
        Ok(Some(None)) | Err(_) => {
            let _ = crate::timer::timeout(Duration::from_secs(1), client.write_all(&out)).await;
        }
        Ok(None) => {}
    }
    let _ = client.shutdown().await;
}

/// Refusals at `max_client_conn` served at once, process-wide.
static REFUSING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Most refusals served at once: each holds its socket for up to a second
/// or two, and a flood of connections at the limit would otherwise hold
/// descriptors without bound, until accept and server connections failed
/// for everyone. Past this many, connections are closed unanswered.
const MAX_REFUSING: usize = 256;

/// A refusal being served ([`refuse_busy`]), counted while it lives.
struct Refusing;

impl Refusing {
    /// A place, if fewer than [`MAX_REFUSING`] are taken.
    fn take() -> Option<Refusing> {
        use std::sync::atomic::Ordering;
        REFUSING
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < MAX_REFUSING).then_some(n + 1)
            })
            .ok()
            .map(|_| Refusing)
    }
}

impl Drop for Refusing {
    fn drop(&mut self) {
        REFUSING.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A client's place under `max_client_conn` and on the worker it was
/// counted on ([`crate::workers::Workers::enter`]), given back when its
/// session ends, however it ends.
struct ClientSlot<'a>(&'a Shared, usize);

impl Drop for ClientSlot<'_> {
    fn drop(&mut self) {
        self.0
            .clients
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        self.0.workers.leave(self.1);
    }
}

/// A client counted in its service's `pgwarden_client_connections`, until
/// its session ends, however it ends (a panic included).
struct ClientGauge(prometheus_client::metrics::gauge::Gauge);

impl ClientGauge {
    fn new(gauge: &prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for ClientGauge {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A client connection as the accept loop hands it over.
pub(crate) enum Accepted {
    /// Accepted by the worker that serves it, already in its epoll.
    Here(TcpStream),
    /// Accepted on another worker, to be registered where it is served.
    Handed(std::net::TcpStream),
    /// On a Unix-domain socket, to be registered where it is served.
    Local(std::os::unix::net::UnixStream),
}

/// The peer address recorded for a client on a Unix-domain socket (no TCP
/// client has port 0): shown as such, never matched by `host` rules.
pub(crate) const LOCAL_PEER: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);

/// Serves one client connection until it ends. A plain function around
/// an `async move` block rather than an async fn, whose arguments would be
/// kept twice in the future for the client's whole life.
#[allow(clippy::manual_async_fn)]
pub(crate) fn run(
    shared: Arc<Shared>,
    service: Arc<Service>,
    client: Accepted,
    peer: SocketAddr,
    worker: usize,
) -> impl std::future::Future<Output = ()> + Send {
    async move {
        // The accept loop counted this client against max_client_conn and
        // on `worker`.
        let _slot = ClientSlot(&shared, worker);
        let mut client = match client {
            Accepted::Here(tcp) => ClientStream::Plain(tcp),
            // Registered with the epoll of the worker this runs on.
            Accepted::Handed(tcp) => match TcpStream::from_std(tcp) {
                Ok(tcp) => ClientStream::Plain(tcp),
                Err(_) => return,
            },
            Accepted::Local(s) => match tokio::net::UnixStream::from_std(s) {
                Ok(s) => ClientStream::Local(s),
                Err(_) => return,
            },
        };
        if let ClientStream::Plain(tcp) = &client {
            crate::stream::tune(tcp);
        }
        let gauge = ClientGauge::new(&service.handles.client_connections);
        let span = tracing::debug_span!("session", service = %service.spec.name, client = %peer);
        // The start-up and authentication phase is boxed and freed once done:
        // a task's future is allocated at its largest, and a pooled client
        // spends its life idle in the much smaller transaction loop. For the
        // same reason nothing of that phase may stay live across the loop:
        // what it hands on is boxed.
        let served = Box::pin(serve(&shared, &service, &mut client, peer))
            .instrument(span.clone())
            .await;
        let refused = match served {
            Ok(Some(pooled)) => {
                let home = shared.workers.pool_home(
                    &service.spec.name,
                    pooled.startup.database().unwrap_or_default(),
                    pooled.startup.user().unwrap_or_default(),
                );
                // A session-mode pool lends a server for a whole session,
                // so its servers rarely change hands and gain nothing from
                // one thread; its clients are placed like relayed ones.
                let affinity = shared.pool_affinity && !pooled.settings.hold_session;
                if affinity {
                    service
                        .home_hint
                        .store(home, std::sync::atomic::Ordering::Relaxed);
                }
                let moving = affinity
                    && home != crate::workers::current()
                    && matches!(client, ClientStream::Plain(_));
                if moving {
                    if let ClientStream::Plain(tcp) =
                        std::mem::replace(&mut client, ClientStream::Gone)
                    {
                        if let Ok(tcp) = tcp.into_std() {
                            // The task on the pool's worker takes over the
                            // client's slot and gauge.
                            std::mem::forget(_slot);
                            shared.workers.leave(worker);
                            shared.workers.enter(home);
                            shared.metrics.client_moves.inc();
                            drop(shared.workers.spawn_on(
                                home,
                                pooled_on_home(
                                    shared.clone(),
                                    service.clone(),
                                    tcp,
                                    pooled,
                                    peer,
                                    gauge,
                                    span,
                                ),
                            ));
                        }
                        return;
                    }
                }
                crate::txn::run(&shared, &service, &mut client, pooled, peer)
                    .instrument(span)
                    .await;
                None
            }
            Ok(None) => None,
            Err(r) => Some(r),
        };
        if let Some(r) = refused {
            shared.metrics.error(&service.spec.name, r.reason);
            tracing::debug!(reason = r.reason, message = %r.message, "client refused");
            let out = encode::fatal(r.code.code(), &r.message);
            let _ = crate::timer::timeout(Duration::from_secs(1), client.write_all(&out)).await;
            let _ = crate::timer::timeout(SHUTDOWN_WRITE, client.shutdown()).await;
        }
        drop(gauge);
    }
}

/// The rest of a pooled client's life, on the worker of its pool
/// ([`crate::workers::Workers::pool_home`]). Not an async fn, for the
/// reason given at [`run`].
#[allow(clippy::manual_async_fn)]
fn pooled_on_home(
    shared: Arc<Shared>,
    service: Arc<Service>,
    client: std::net::TcpStream,
    pooled: Box<Pooled>,
    peer: SocketAddr,
    gauge: ClientGauge,
    span: tracing::Span,
) -> impl std::future::Future<Output = ()> + Send {
    async move {
        let home = crate::workers::current();
        let _slot = ClientSlot(&shared, home);
        if let Ok(tcp) = TcpStream::from_std(client) {
            let mut client = ClientStream::Plain(tcp);
            crate::txn::run(&shared, &service, &mut client, pooled, peer)
                .instrument(span)
                .await;
        }
        drop(gauge);
    }
}

/// A client that goes on to transaction pooling, once logged in.
pub(crate) struct Pooled {
    /// What the client sent at start-up.
    pub startup: StartupMessage,
    /// Bytes the client sent after its start-up, not yet handled.
    pub early: BytesMut,
    /// The client's pool settings (service, database and user combined).
    pub settings: Arc<crate::pool::PoolSettings>,
    /// What the client proved, for opening server connections as its role.
    pub credential: Credential,
    /// Its start-up settings that pooled servers do not open with.
    pub extras: crate::pool::Extras,
}

/// Start-up, authentication, and for session mode the whole session;
/// `Some` hands a client on to transaction pooling.
async fn serve(
    shared: &Arc<Shared>,
    service: &Arc<Service>,
    client: &mut ClientStream,
    peer: SocketAddr,
) -> Result<Option<Box<Pooled>>, Refusal> {
    // Empty: the first read takes a buffer from the thread's list
    // (`bufcache`), which is where it goes back when the client is done.
    let mut buf = BytesMut::new();
    // One budget from accept to an authenticated client, so a slow client
    // costs a bounded amount.
    let auth_timeout = *shared.auth_timeout.lock().expect("poisoned");
    let deadline = crate::timer::Deadline::after(auth_timeout);
    let mut startup = match deadline
        .run(read_startup(client, &mut buf, shared, &service.spec.name))
        .await
    {
        Ok(Ok(Some(s))) => s,
        Ok(Ok(None)) => return Ok(None),
        Ok(Err(r)) => return Err(r),
        Err(_) => {
            return Err(Refusal::new(
                sqlstate::PROTOCOL_VIOLATION,
                "startup_timeout",
                "timeout waiting for the startup packet",
            ))
        }
    };
    // From here the client is logging in, which a shutdown waits for; a
    // connection that never sent its start-up packet (a port check, a
    // scanner) is not waited for.
    let logging_in = crate::proxy::LoggingIn::new(shared);
    let spec = &service.spec;
    // A Unix-domain socket never leaves the machine: TLS is neither
    // offered nor required there, as in PostgreSQL.
    if shared.client_tls() == ClientTlsMode::Require && !client.is_tls() && !client.is_local() {
        return Err(Refusal::new(
            sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
            "tls_required",
            "SSL connection is required (tls.client_tls = require)",
        ));
    }
    if spec.read_only {
        if startup_sets_read_only_guc(&startup) {
            return Err(Refusal::new(
                sqlstate::READ_ONLY_SQL_TRANSACTION,
                "read_only",
                format!("service \"{}\" is read-only: startup parameters may not change default_transaction_read_only or transaction_read_only", spec.name),
            ));
        }
        // Its characters may end in an ASCII byte, which the server would
        // read as part of a character where the statement check sees SQL.
        if let Some(enc) = pgwarden_wire::readonly::startup_client_only_encoding(&startup) {
            return Err(Refusal::new(
                sqlstate::READ_ONLY_SQL_TRANSACTION,
                "read_only",
                format!("service \"{}\" is read-only: client_encoding {enc} is not allowed here (its characters may end in an ASCII byte); use UTF8", spec.name),
            ));
        }
        // A walsender takes replication commands, which the statement
        // check does not read and read-only transactions do not stop
        // (dropping a standby's slot, say).
        if startup
            .get("replication")
            .is_some_and(|v| v != "false" && v != "off" && v != "0" && v != "no")
        {
            return Err(Refusal::new(
                sqlstate::READ_ONLY_SQL_TRANSACTION,
                "read_only",
                format!(
                    "service \"{}\" is read-only: replication connections are not allowed",
                    spec.name
                ),
            ));
        }
        // The server enforces read-only from the first statement on, and
        // RESET/DISCARD return to this value, since startup parameters are
        // a session's defaults.
        startup.set("default_transaction_read_only", "on");
    }

    let admin = !spec.read_only
        && startup.database() == Some(crate::admin::ADMIN_DATABASE)
        && spec.want == pgwarden_topology::Want::Primary;
    if !admin && shared.any_disabled.load(Ordering::Relaxed) {
        let db = startup.database().unwrap_or_default();
        if shared.disabled.lock().expect("poisoned").contains(db) {
            return Err(Refusal::new(
                sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
                "disabled",
                format!("database \"{db}\" is not currently accepting connections (DISABLE in the pgwarden admin console)"),
            ));
        }
    }
    let pool = shared.pool_overrides.lock().expect("poisoned").resolve(
        spec,
        startup.database().unwrap_or_default(),
        startup.user().unwrap_or_default(),
    );
    // Where pgwarden answers the login itself, it also answers a request
    // for a newer protocol minor version or for protocol options, as
    // PostgreSQL does before authentication: it speaks 3.0 and knows no
    // option, and its servers are asked for nothing more. A plain relay
    // leaves that to the server.
    if admin || pool.is_some() || shared.auth.load().is_some() {
        if let Some(v) = startup.negotiation(0) {
            if client.write_all(&v).await.is_err() {
                return Ok(None);
            }
            startup.protocol = (3, 0);
            startup
                .params
                .retain(|(n, _)| !n.starts_with(pgwarden_wire::startup::PROTOCOL_OPTION_PREFIX));
        }
    }

    let credential = match shared.auth.load_full() {
        None => None,
        Some(auth) => match deadline
            .run(Box::pin(async {
                let credential = auth
                    .authenticate(shared, client, &startup, peer, spec.connect_wait_timeout)
                    .await?;
                // A pooled client may get a server another client's login
                // opened: a method that asked nothing of the role leaves
                // PostgreSQL's login check to pgwarden.
                // Not for the admin console, whose users need not be roles.
                // No wait for a primary: the check is not worth delaying
                // every such login while there is none.
                if !admin && pool.is_some() && matches!(credential, Credential::None) {
                    auth.check_login(shared, startup.user().unwrap_or_default(), Duration::ZERO)
                        .await?;
                }
                Ok::<_, crate::auth::AuthError>(credential)
            }))
            .await
        {
            Ok(Ok(c)) => Some(c),
            // Nobody is left to tell, and no login failed.
            Ok(Err(e)) if e.is_gone() => return Ok(None),
            Ok(Err(e)) => {
                tracing::info!(
                    user = startup.user().unwrap_or_default(),
                    reason = e.reason,
                    detail = e.detail.as_deref(),
                    "authentication failed"
                );
                shared
                    .metrics
                    .auth_failures
                    .get_or_create(&crate::metrics::ReasonLabel {
                        reason: e.reason.to_string(),
                    })
                    .inc();
                return Err(Refusal::new(e.code, e.reason, e.message));
            }
            Err(_) => {
                shared
                    .metrics
                    .auth_failures
                    .get_or_create(&crate::metrics::ReasonLabel {
                        reason: "auth_timeout".into(),
                    })
                    .inc();
                return Err(auth_timed_out());
            }
        },
    };
    if admin {
        // Without [auth] pgwarden checks no password itself; a user then
        // proves who they are to the primary, as a relayed session would,
        // before it may pause or shut anything down. Every user, not just
        // the admin users: a refusal before the password would tell which
        // names are admin users. The console turns the others away after.
        if credential.is_none() {
            match deadline
                .run(Box::pin(server_vouches(shared, service, client, &startup)))
                .await
            {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => return Ok(None),
                Ok(Err(r)) => return Err(r),
                Err(_) => return Err(auth_timed_out()),
            }
        }
        // A console session is not waited for: it may be where the
        // shutdown was asked for.
        drop(logging_in);
        Box::pin(crate::admin::run(
            shared,
            client,
            &startup,
            peer,
            &service.name,
        ))
        .await;
        return Ok(None);
    }
    if let Some(pool) = pool {
        let extras = crate::pool::Extras::from_startup(&startup, spec.read_only)
            .map_err(|e| Refusal::new(sqlstate::FEATURE_NOT_SUPPORTED, "startup_parameter", e))?;
        return Ok(Some(Box::new(Pooled {
            startup,
            early: buf,
            settings: pool,
            credential: credential.unwrap_or(Credential::None),
            extras,
        })));
    }
    // Boxed: a relayed session's connect and relay states are large, and
    // a pooled client's start-up future would otherwise carry (and copy)
    // them too.
    Box::pin(async move {
        // One wait, for a resume and a host together: a paused service
        // holds new sessions until it resumes, as it holds a pooled
        // client's new transactions.
        let deadline = tokio::time::Instant::now() + spec.connect_wait_timeout;
        let waited = async {
            let mut paused = service.handles.paused.clone();
            if *paused.borrow() {
                tokio::select! {
                    _ = paused.wait_for(|p| !*p) => {}
                    _ = crate::timer::sleep_until(deadline) => {
                        return Err(Refusal::new(
                            sqlstate::CANNOT_CONNECT_NOW,
                            "paused",
                            format!("service \"{}\" is paused and did not resume within connect_wait_timeout", spec.name),
                        ));
                    }
                }
            }
            let open = |s: ServerStream, host: HostAddr, bound: Duration| {
                let (startup, credential) = (&startup, &credential);
                async move {
                    match credential {
                        None => first_answer(s, startup, bound)
                            .await
                            .map(|(s, answer)| Opened::Relayed(s, answer)),
                        Some(cred) => relay_login(shared, spec, s, &host, startup, cred).await,
                    }
                }
            };
            connect_server(shared, service, deadline, open).await
        };
        let (opened, host) = unless_gone(shared, client, waited).await?;
        shared
            .metrics
            .routing_decisions
            .get_or_create(&RouteLabel {
                service: spec.name.clone(),
                host: host.to_string(),
            })
            .inc();
        relay(shared, service, client, buf, opened, host, startup, peer).await;
        Ok(None)
    })
    .await
}

/// The refusal of a client that did not finish authenticating within
/// `auth_timeout`.
fn auth_timed_out() -> Refusal {
    Refusal::new(
        sqlstate::PROTOCOL_VIOLATION,
        "auth_timeout",
        "authentication timed out (auth_timeout)",
    )
}

/// Has the service's server authenticate the client: the client's start-up
/// goes to it and the authentication exchange is relayed, up to the
/// server's AuthenticationOk (true; the server connection is then closed)
/// or its refusal, which the client gets (false).
async fn server_vouches(
    shared: &Shared,
    service: &Service,
    client: &mut ClientStream,
    startup: &StartupMessage,
) -> Result<bool, Refusal> {
    let deadline = tokio::time::Instant::now() + service.spec.connect_wait_timeout;
    let open = |s: ServerStream, _: HostAddr, bound: Duration| first_answer(s, startup, bound);
    let ((mut server, mut buf), host) = unless_gone(
        shared,
        client,
        connect_server(shared, service, deadline, open),
    )
    .await?;
    let failed = |e: String| {
        Refusal::new(
            sqlstate::CONNECTION_FAILURE,
            "server_connect",
            format!("could not authenticate with {host}: {e}"),
        )
    };
    loop {
        let (tag, msg) = match pgwarden_wire::message::split_message(&mut buf, 64 * 1024) {
            Ok(Some(m)) => m,
            Ok(None) => {
                match server.read_buf(&mut buf).await {
                    Ok(0) => return Err(failed("the server closed the connection".into())),
                    Err(e) => return Err(failed(e.to_string())),
                    Ok(_) => {}
                }
                continue;
            }
            Err(e) => return Err(failed(e.to_string())),
        };
        match tag {
            backend::AUTHENTICATION_REQUEST => {
                let code = msg
                    .get(5..9)
                    .map_or(-1, |b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                match code {
                    0 => return Ok(true),
                    // SASL's final message asks for no answer.
                    12 => {
                        client
                            .write_all(&msg)
                            .await
                            .map_err(|e| failed(e.to_string()))?;
                    }
                    _ => {
                        // As in a relayed session (see `relay`).
                        let unbound = (server.is_tls() && !client.is_tls())
                            .then(|| pgwarden_wire::message::sasl_offer_without_binding(&msg))
                            .flatten();
                        let asked = unbound.as_deref().unwrap_or(&msg);
                        let Some(answer) = crate::auth::exchange(client, asked).await else {
                            return Ok(false);
                        };
                        use bytes::BufMut;
                        let mut reply = BytesMut::with_capacity(answer.len() + 5);
                        reply.put_u8(frontend::PASSWORD_MESSAGE);
                        reply.put_u32(answer.len() as u32 + 4);
                        reply.put_slice(&answer);
                        server
                            .write_all(&reply)
                            .await
                            .map_err(|e| failed(e.to_string()))?;
                    }
                }
            }
            backend::ERROR_RESPONSE => {
                let _ = client.write_all(&msg).await;
                return Ok(false);
            }
            // A newer protocol version or options the server declines.
            backend::NEGOTIATE_PROTOCOL_VERSION => {}
            other => return Err(failed(format!("unexpected message type {other}"))),
        }
    }
}

/// Reads until a StartupMessage; answers SSL and GSS encryption requests
/// with 'N' (plaintext only) and serves cancel requests. `None` = nothing
/// more to do (cancel served, or the client went away).
async fn read_startup(
    client: &mut ClientStream,
    buf: &mut BytesMut,
    shared: &Shared,
    service: &str,
) -> Result<Option<StartupMessage>, Refusal> {
    // Each encryption is negotiated at most once, as PostgreSQL allows:
    // GSS after SSL was declined and the other way round, nothing after
    // TLS is up. A request past that is no valid start-up packet.
    let (mut ssl_done, mut gss_done) = (client.is_tls(), client.is_tls());
    loop {
        match parse_startup(buf) {
            Ok(Some(StartupFrame::SslRequest)) if ssl_done => {
                return Err(renegotiation(pgwarden_wire::startup::SSL_REQUEST))
            }
            Ok(Some(StartupFrame::GssEncRequest)) if gss_done => {
                return Err(renegotiation(pgwarden_wire::startup::GSSENC_REQUEST))
            }
            Ok(Some(StartupFrame::SslRequest)) if !client.is_local() => {
                ssl_done = true;
                let tls = match shared.client_tls() {
                    ClientTlsMode::Disable => None,
                    _ => shared.tls.load_full(),
                };
                let Some(tls) = tls else {
                    if client
                        .write_all(&[encode::ssl_response(false)])
                        .await
                        .is_err()
                    {
                        return Ok(None);
                    }
                    continue;
                };
                // Bytes sent after SSLRequest and before the handshake would
                // be trusted as if they came over TLS (CVE-2021-23214).
                if !buf.is_empty() {
                    return Err(Refusal::new(
                        sqlstate::PROTOCOL_VIOLATION,
                        "protocol",
                        "received unencrypted data after SSL request",
                    ));
                }
                if client
                    .write_all(&[encode::ssl_response(true)])
                    .await
                    .is_err()
                {
                    return Ok(None);
                }
                // Boxed: the handshake's state is large and rarely needed,
                // and every client's start-up future would carry it.
                if let Err(e) = Box::pin(client.upgrade(&tls)).await {
                    if crate::stream::is_client_certificate_error(&e) {
                        // Refused credentials, like a wrong password: worth
                        // the operator's attention, unlike clients that
                        // hang up mid-handshake.
                        tracing::info!(error = %e, "TLS handshake failed: client certificate refused");
                        shared
                            .metrics
                            .auth_failures
                            .get_or_create(&crate::metrics::ReasonLabel {
                                reason: "cert_invalid".into(),
                            })
                            .inc();
                        // The handshake ends the connection before any
                        // refusal is sent, so it is counted here.
                        shared.metrics.error(service, "cert_invalid");
                    } else {
                        tracing::debug!(error = %e, "TLS handshake failed");
                    }
                    return Ok(None);
                }
                gss_done = true;
                continue;
            }
            Ok(Some(frame @ (StartupFrame::SslRequest | StartupFrame::GssEncRequest))) => {
                if matches!(frame, StartupFrame::SslRequest) {
                    ssl_done = true;
                } else {
                    gss_done = true;
                }
                if client
                    .write_all(&[encode::ssl_response(false)])
                    .await
                    .is_err()
                {
                    return Ok(None);
                }
                continue;
            }
            Ok(Some(StartupFrame::Cancel { pid, secret })) => {
                Box::pin(forward_cancel(shared, pid, secret)).await;
                // PostgreSQL ends a cancel connection over TLS with
                // close_notify; libpq 17 and later report a close without
                // it as a failed cancel ("SSL error: unexpected eof").
                if client.is_tls() {
                    let _ = crate::timer::timeout(SHUTDOWN_WRITE, client.shutdown()).await;
                }
                return Ok(None);
            }
            Ok(Some(StartupFrame::Startup(m))) => return Ok(Some(m)),
            Ok(None) => {}
            Err(e) => return Err(Refusal::new(e.sqlstate(), "protocol", e.to_string())),
        }
        // As in the session loop: the buffer comes from the thread's list
        // (`bufcache`) once the socket is readable, and a plain socket is
        // read without glibc's wrappers.
        match std::future::poll_fn(|cx| client.poll_read_some(cx, buf, 1024)).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(_) => {}
        }
    }
}

/// A second SSLRequest or GSSENCRequest (`code`), refused as PostgreSQL
/// refuses a start-up packet of a protocol it does not speak.
fn renegotiation(code: i32) -> Refusal {
    Refusal::new(
        sqlstate::FEATURE_NOT_SUPPORTED,
        "protocol",
        format!(
            "unsupported frontend protocol {}.{}: server supports 3.0 to 3.0",
            code >> 16,
            code & 0xffff
        ),
    )
}

async fn forward_cancel(shared: &Shared, pid: i32, secret: i32) {
    // An unknown key is ignored silently, as PostgreSQL does: a wrong
    // guess must not learn anything.
    let Some((key, mut guard)) = shared.cancel.lookup((pid, secret)) else {
        tracing::debug!("cancel request with an unknown key or no query to cancel ignored");
        return;
    };
    let timeout = shared.server_connect_timeout();
    if let Ok(Ok(mut s)) = crate::timer::timeout(timeout, TcpStream::connect(key.server)).await {
        if s.write_all(&key.cancel_request()).await.is_ok() {
            let mut sink = [0u8; 1];
            // The server closes once it has signalled the backend.
            if let Ok(Ok(0)) = crate::timer::timeout(timeout, s.read(&mut sink)).await {
                if let Some(g) = guard.as_mut() {
                    g.delivered();
                }
            }
        }
    }
    drop(guard);
}

/// Runs a wait for a server unless the client goes away first: a client
/// that gave up (a driver's own connect timeout, an impatient user) must
/// not keep its `max_client_conn` slot, hold up a shutdown, or have a
/// backend opened for it on a primary that has just come up.
async fn unless_gone<T>(
    shared: &Shared,
    client: &ClientStream,
    wait: impl std::future::Future<Output = Result<T, Refusal>>,
) -> Result<T, Refusal> {
    // A shutdown past its time-out ends the sessions; a client still
    // waiting for a server is not one yet, and is told here.
    let mut ending = shared.ending_signal.subscribe();
    tokio::select! {
        biased;
        () = client.closed() => Err(Refusal::new(
            sqlstate::CONNECTION_FAILURE,
            "client_gone",
            "the client went away while waiting for a server",
        )),
        _ = ending.wait_for(|e| *e) => Err(Refusal::new(
            sqlstate::ADMIN_SHUTDOWN,
            "shutdown",
            "terminating connection: pgwarden is shutting down",
        )),
        r = wait => r,
    }
}

/// The client-only encoding (see
/// [`pgwarden_wire::readonly::client_only_encoding`]) a server reported as
/// a session's `client_encoding`, if it did.
pub(crate) fn client_only_encoding_of(
    params: &std::collections::HashMap<String, String>,
) -> Option<&str> {
    params
        .get("client_encoding")
        .map(String::as_str)
        .filter(|v| pgwarden_wire::readonly::client_only_encoding(v.as_bytes()))
}

/// The least time a connection attempt gets, however little of the
/// client's wait is left.
const MIN_ATTEMPT: Duration = Duration::from_secs(1);

/// Why a host that took the connection cannot serve the session: the
/// client's wait goes on to the next eligible host, or a later round.
struct Unusable {
    code: SqlState,
    why: String,
}

impl Unusable {
    fn failed(why: impl Into<String>) -> Self {
        Unusable {
            code: sqlstate::CONNECTION_FAILURE,
            why: why.into(),
        }
    }
}

/// Picks a host, connects, and has `open` start the session on it (send
/// the start-up, log in), waiting up to the service's
/// `connect_wait_timeout` for a host to become available and trying the
/// other eligible hosts when one fails or `open` finds it unusable.
/// `open` is given the time the connect itself was allowed, and bounds
/// its own steps: what it may retry (a login whose password went out may
/// not be) is its business.
async fn connect_server<T, F, Fut>(
    shared: &Shared,
    service: &Service,
    deadline: tokio::time::Instant,
    mut open: F,
) -> Result<(T, HostAddr), Refusal>
where
    F: FnMut(ServerStream, HostAddr, Duration) -> Fut,
    Fut: std::future::Future<Output = Result<T, Unusable>>,
{
    let spec = &service.spec;
    let mut changes = shared.changes.clone();
    let mut last = Refusal::new(sqlstate::CANNOT_CONNECT_NOW, "no_host", "");
    let mut failed_rounds = 0u32;
    // The hosts of the last round that all failed, and when to try them
    // again. The probes publish after every probe result, several times
    // a round, so a change that leaves the eligible hosts as they were
    // does not shorten the pause: a host the probes call up but that
    // refuses connections (a full backlog, max_connections) would
    // otherwise be hit several times a second by every waiting client.
    let mut failed: Vec<HostAddr> = Vec::new();
    let mut retry = deadline;
    loop {
        // Checked at every round: a refusal switched on while clients
        // wait (an agent fencing this node) turns them away too.
        if let Some(reason) = shared.refusal(&spec.name) {
            return Err(Refusal::new(
                sqlstate::CANNOT_CONNECT_NOW,
                "refused",
                format!("service \"{}\": {reason}", spec.name),
            ));
        }
        // Seen before the topology is read: a change after the read ends
        // the wait below at once.
        changes.borrow_and_update();
        let snap = shared.snapshot.load_full();
        let topo = &snap.topology;
        let mut order: Vec<usize> = Vec::new();
        // Peeked: a round that is skipped below takes no turn of the
        // round robin.
        let picked = service.selector.peek(topo, &spec.want);
        if let Ok(p) = picked {
            // The next hosts tried are the next the strategy prefers.
            order.push(p.index);
            order.extend(
                service
                    .selector
                    .preference_order(topo, &spec.want, Some(p))
                    .into_iter()
                    .filter(|&j| j != p.index),
            );
        }
        let addrs: Vec<HostAddr> = order
            .iter()
            .map(|&i| topo.hosts()[i].config.addr.clone())
            .collect();
        let set = service.eligible_addrs(topo);
        let now = tokio::time::Instant::now();
        if !failed.is_empty() && set == failed && now < retry {
            tokio::select! {
                r = changes.changed() => if r.is_err() { return Err(last) },
                _ = crate::timer::sleep_until(retry) => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(last);
            }
            continue;
        }
        if let Ok(p) = picked {
            service.selector.advance(&spec.want, p);
        }
        match picked {
            Ok(_) => {
                last = Refusal::new(
                    sqlstate::CONNECTION_FAILURE,
                    "server_connect",
                    format!(
                        "service \"{}\": could not connect to any eligible host",
                        spec.name
                    ),
                );
            }
            Err(e) => {
                let why = match e {
                    NoTarget::NoPrimary => {
                        "no primary is available (failover in progress?)".to_string()
                    }
                    other => other.to_string(),
                };
                last = Refusal::new(
                    sqlstate::CANNOT_CONNECT_NOW,
                    "no_host",
                    format!("service \"{}\": {why}", spec.name),
                );
            }
        }
        let tried = !addrs.is_empty();
        for addr in addrs.iter().cloned() {
            // Several hosts that time out must not stretch the client's
            // wait far past connect_wait_timeout; each still gets a
            // second (or server_connect_timeout, if shorter), so that a
            // wait of zero, or one nearly over, still tries the host.
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let timeout = shared.server_connect_timeout().min(left.max(MIN_ATTEMPT));
            let server_tls = shared.server_tls.load_full();
            let attempt = async {
                let s = TcpStream::connect((addr.host.as_str(), addr.port))
                    .await
                    .map_err(|e| Unusable::failed(e.to_string()))?;
                crate::stream::tune(&s);
                server_tls
                    .start(s, &addr.host)
                    .await
                    .map_err(Unusable::failed)
            };
            let opened = match crate::timer::timeout(timeout, attempt).await {
                Ok(Ok(s)) => Ok(open(s, addr.clone(), timeout).await),
                Ok(Err(u)) => Ok(Err(u)),
                Err(elapsed) => Err(elapsed),
            };
            match opened {
                Ok(Ok(t)) => return Ok((t, addr)),
                Ok(Err(Unusable { code, why: e })) => {
                    if failed_rounds == 0 {
                        tracing::warn!(host = %addr, error = %e, "server connection failed; trying the next eligible host");
                    } else {
                        tracing::debug!(host = %addr, error = %e, "server connection failed again");
                    }
                    last = Refusal::new(
                        code,
                        "server_connect",
                        format!(
                            "service \"{}\": could not connect to {addr}: {e}",
                            spec.name
                        ),
                    );
                }
                Err(_) => {
                    if failed_rounds == 0 {
                        tracing::warn!(host = %addr, "server connection timed out; trying the next eligible host");
                    } else {
                        tracing::debug!(host = %addr, "server connection timed out again");
                    }
                    last = Refusal::new(
                        sqlstate::CONNECTION_FAILURE,
                        "server_connect",
                        format!("service \"{}\": connection to {addr} timed out", spec.name),
                    );
                }
            }
        }
        // Nothing usable now: wait for the topology to change or, when
        // eligible hosts failed, try them again a little later; the probes
        // may still call a host up that refused a moment ago (a restart,
        // max_connections reached), and it may be back within the wait.
        retry = if tried {
            let pause = crate::timer::retry_pause(failed_rounds);
            failed_rounds += 1;
            (tokio::time::Instant::now() + pause).min(deadline)
        } else {
            deadline
        };
        failed = set;
        tokio::select! {
            r = changes.changed() => if r.is_err() { return Err(last) },
            _ = crate::timer::sleep_until(retry) => {}
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(last);
        }
    }
}

/// A relayed session's server connection, as [`connect_server`] leaves it.
enum Opened {
    /// The client's start-up went to the server; the bytes of its first
    /// answer (at least the first message's type) are in the buffer.
    Relayed(ServerStream, BytesMut),
    /// pgwarden logged in with what the client proved (`[auth]`).
    LoggedIn(Box<crate::pool::ServerConn>),
    /// The server refused that login: its ErrorResponse, for the client.
    Refused(BytesMut),
}

/// Longest first message a server's refusal may take to be read whole.
const MAX_FIRST_ERROR: usize = 64 * 1024;

/// Sends the client's start-up packet to a server just connected to and
/// reads its first answer. A server that turns every connection away
/// for now (57P03: starting up, shutting down, not yet consistent, hot
/// standby off) is unusable: the client's wait goes on to another host,
/// as it would for a refused connect, instead of relaying the refusal.
/// The bytes read are returned, for the relay to pass on.
async fn first_answer(
    server: ServerStream,
    startup: &StartupMessage,
    bound: Duration,
) -> Result<(ServerStream, BytesMut), Unusable> {
    crate::timer::timeout(bound, read_first_answer(server, startup))
        .await
        .unwrap_or_else(|_| {
            Err(Unusable::failed(format!(
                "no answer to the start-up within {} ms",
                bound.as_millis()
            )))
        })
}

async fn read_first_answer(
    mut server: ServerStream,
    startup: &StartupMessage,
) -> Result<(ServerStream, BytesMut), Unusable> {
    let fail = |e: std::io::Error| Unusable::failed(e.to_string());
    server.write_all(&startup.encode()).await.map_err(fail)?;
    let mut buf = BytesMut::with_capacity(1024);
    // Where the message looked at starts: past a NegotiateProtocolVersion,
    // which a server sends before its refusal to a client asking for a
    // newer protocol.
    let mut at = 0;
    loop {
        if let Some(&tag) = buf.get(at) {
            // Only an error needs reading whole; anything else (an
            // authentication request) is the client's to answer.
            let skipped = tag == backend::NEGOTIATE_PROTOCOL_VERSION && at == 0;
            if tag != backend::ERROR_RESPONSE && !skipped {
                return Ok((server, buf));
            }
            if let Some(head) = buf.get(at + 1..at + 5) {
                let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
                if len > MAX_FIRST_ERROR {
                    return Ok((server, buf));
                }
                if let Some(body) = buf.get(at + 5..at + 1 + len.max(4)) {
                    if skipped {
                        at += 1 + len.max(4);
                        continue;
                    }
                    let fields = pgwarden_wire::message::error_fields_raw(body).unwrap_or_default();
                    let code = pgwarden_wire::message::find_raw_field(&fields, b'C');
                    if code == Some(sqlstate::CANNOT_CONNECT_NOW.code().as_bytes()) {
                        let text = pgwarden_wire::message::find_raw_field(&fields, b'M');
                        return Err(Unusable {
                            code: sqlstate::CANNOT_CONNECT_NOW,
                            why: text.map_or("not accepting connections".into(), |t| {
                                String::from_utf8_lossy(t).into_owned()
                            }),
                        });
                    }
                    return Ok((server, buf));
                }
            }
        }
        match server.read_buf(&mut buf).await {
            Ok(0) => {
                return Err(Unusable::failed(
                    "the server closed the connection at start-up",
                ))
            }
            Ok(_) => {}
            Err(e) => return Err(fail(e)),
        }
    }
}

/// Logs in to a server with what a relayed client proved (`[auth]`),
/// within `server_connect_timeout` as the pool's logins. A server not
/// ready for any login (57P03, answered before authentication), or a
/// standby where the primary is wanted (the old primary of a switchover,
/// back before every connection manager saw it go), is unusable: the
/// client's wait goes on. Any other failure is the client's at once, as
/// a refused login is: retrying one whose password may have gone out
/// would turn one client's login into several failed ones on the server.
async fn relay_login(
    shared: &Shared,
    spec: &crate::proxy::ServiceSpec,
    server: ServerStream,
    host: &HostAddr,
    startup: &StartupMessage,
    cred: &Credential,
) -> Result<Opened, Unusable> {
    use crate::pool::ServerError;
    let login = crate::pool::login(server, startup, cred);
    let failed = |why: String| {
        let out = encode::fatal(
            sqlstate::CONNECTION_FAILURE.code(),
            &format!("could not log in to {host}: {why}"),
        );
        Ok(Opened::Refused(BytesMut::from(&out[..])))
    };
    match crate::timer::timeout(shared.server_connect_timeout(), login).await {
        Ok(Ok(conn)) if spec.want == pgwarden_topology::Want::Primary && conn.in_hot_standby() => {
            Err(Unusable {
                code: sqlstate::CANNOT_CONNECT_NOW,
                why: "it is a standby, not the primary (the primary is changing)".into(),
            })
        }
        Ok(Ok(conn)) => Ok(Opened::LoggedIn(Box::new(conn))),
        Ok(Err(ServerError::Refused(raw))) => Ok(Opened::Refused(raw)),
        Ok(Err(ServerError::NotReady(why))) => Err(Unusable {
            code: sqlstate::CANNOT_CONNECT_NOW,
            why,
        }),
        Ok(Err(ServerError::Failed(why))) => {
            tracing::warn!(host = %host, error = %why, "server login failed");
            failed(why)
        }
        Ok(Err(e)) => failed(format!("{e:?}")),
        Err(_) => {
            tracing::warn!(host = %host, "server login timed out");
            failed("timed out".into())
        }
    }
}

/// Longest wait for a connection's shutdown (TLS close_notify) to be
/// written.
pub(crate) const SHUTDOWN_WRITE: Duration = Duration::from_secs(1);

/// The DO block that replaces a refused statement on a read-only service:
/// the server raises the error itself, so the client sees it in its place
/// in the stream of replies, pipelined or not.
fn refusal_sql(message: &str) -> String {
    format!(
        "DO $pgwarden$BEGIN RAISE EXCEPTION USING ERRCODE = '25006', MESSAGE = '{}'; END$pgwarden$",
        message.replace('\'', "''")
    )
}

/// The type `text`, fixed in PostgreSQL's catalog.
const TEXT_OID: u32 = 25;

/// `pg_catalog.set_config(text, text, boolean)`, fixed in PostgreSQL's
/// catalog.
pub(crate) const SET_CONFIG_OID: u32 = 2078;

/// The server messages a read-only service's relay follows for its
/// pipeline ([`ReadOnlyPipeline`]).
fn read_only_replies(tag: u8) -> bool {
    matches!(
        tag,
        backend::PARSE_COMPLETE
            | backend::CLOSE_COMPLETE
            | backend::ERROR_RESPONSE
            | backend::COPY_IN_RESPONSE
            | backend::READY_FOR_QUERY
    )
}

/// What the read-only checks need of a Bind too long to hold whole (its
/// parameters can be large, up to PostgreSQL's 1 GB): the portal and
/// statement names at its start. Every other inspected message is needed
/// whole.
pub(crate) fn bind_head(tag: u8, msg: &[u8]) -> crate::relay::Head {
    use crate::relay::Head;
    if tag != frontend::BIND {
        return Head::Whole;
    }
    let body = msg.get(5..).unwrap_or_default();
    let mut nuls = body.iter().enumerate().filter(|(_, &b)| b == 0);
    match nuls.nth(1) {
        Some((i, _)) => Head::Is(5 + i + 1),
        None => Head::More,
    }
}

/// The client messages a read-only service's relay looks at: those the
/// statement check reads ([`guarded`]) and those that move its pipeline
/// ([`ReadOnlyPipeline`]).
fn read_only_inspects(tag: u8) -> bool {
    matches!(
        tag,
        frontend::QUERY
            | frontend::PARSE
            | frontend::FUNCTION_CALL
            | frontend::BIND
            | frontend::DESCRIBE
            | frontend::EXECUTE
            | frontend::CLOSE
            | frontend::SYNC
    )
}

/// The client messages a read-only service inspects.
pub(crate) fn guarded(tag: u8) -> bool {
    matches!(
        tag,
        frontend::QUERY | frontend::PARSE | frontend::FUNCTION_CALL
    )
}

/// What to send instead of a client message on a read-only service, if
/// it would make the session or its transaction read-write.
pub(crate) fn guard_message(service: &str, tag: u8, msg: &[u8]) -> Option<BytesMut> {
    let body = &msg[5..];
    // A message the check cannot read is refused, not passed on: the
    // server's reading of it might differ, and nothing unchecked may reach
    // a read-only session.
    let malformed = |what: &str| {
        let sql = refusal_sql(&format!(
            "service \"{service}\" is read-only: malformed {what} message"
        ));
        let mut out = BytesMut::new();
        match tag {
            frontend::PARSE => encode::parse(&mut out, b"", &sql, &[]),
            _ => encode::query(&mut out, &sql),
        }
        Some(out)
    };
    if tag == frontend::FUNCTION_CALL {
        // The fast-path interface calls a function by OID, with no SQL
        // for the lexer to see: `set_config` there could turn off
        // read-only before the server's report of it arrives, with
        // statements pipelined behind it. A refused call gets the same
        // ErrorResponse and ReadyForQuery a failed call would.
        let Ok(oid) = pgwarden_wire::message::function_call_oid(body) else {
            return malformed("FunctionCall");
        };
        if oid != SET_CONFIG_OID {
            return None;
        }
        let sql = refusal_sql(&format!(
            "service \"{service}\" is read-only: set_config through the function-call interface is not allowed"
        ));
        let mut out = BytesMut::new();
        encode::query(&mut out, &sql);
        return Some(out);
    }
    let (text, parse) = match tag {
        frontend::QUERY => match pgwarden_wire::message::query_bytes(body) {
            Ok(text) => (text, None),
            Err(_) => return malformed("Query"),
        },
        frontend::PARSE => match pgwarden_wire::message::parse_message(body) {
            Ok(p) => {
                // The declared types follow the two strings and the count.
                let at = p.name.len() + 1 + p.query.len() + 1 + 2;
                let types = &body[at..at + 4 * usize::from(p.param_type_count)];
                (p.query, Some((p.name, types)))
            }
            Err(_) => return malformed("Parse"),
        },
        _ => return None,
    };
    let violation = match check_read_only_bytes(text) {
        Ok(()) => return None,
        Err(v) => v,
    };
    let sql = refusal_sql(&format!("service \"{service}\" is read-only: {violation}"));
    let mut out = BytesMut::new();
    match parse {
        None => encode::query(&mut out, &sql),
        Some((name, types)) => {
            // The client's types, so that its Bind is accepted and the
            // Execute raises the refusal. A type left to the server (0)
            // cannot be found from a DO block, and PostgreSQL would refuse
            // the Parse for it (42P18): text takes any value bound as text.
            let types: Vec<u32> = types
                .chunks_exact(4)
                .map(|t| match u32::from_be_bytes([t[0], t[1], t[2], t[3]]) {
                    0 => TEXT_OID,
                    oid => oid,
                })
                .collect();
            encode::parse(&mut out, name, &sql, &types)
        }
    }
    Some(out)
}

#[allow(clippy::too_many_arguments)]
async fn relay(
    shared: &Arc<Shared>,
    service: &Arc<Service>,
    client: &mut ClientStream,
    mut early: BytesMut,
    opened: Opened,
    host: HostAddr,
    startup: StartupMessage,
    peer: SocketAddr,
) {
    let spec = &service.spec;
    // With pgwarden authenticating, it has logged in to the server itself
    // with what the client proved, and greets the client as the server
    // would.
    let (mut server, logged_in, server_early) = match opened {
        Opened::Relayed(server, answer) => (server, None, answer),
        Opened::Refused(raw) => {
            let _ = client.write_all(&raw).await;
            return;
        }
        Opened::LoggedIn(conn)
            if spec.read_only && client_only_encoding_of(&conn.params).is_some() =>
        {
            // A role's or database's default, which the server's
            // greeting would hand the client (see `relay`'s check of
            // ParameterStatus, which this greeting does not pass).
            let v = client_only_encoding_of(&conn.params).unwrap_or_default();
            let out = encode::fatal(
                sqlstate::READ_ONLY_SQL_TRANSACTION.code(),
                &format!("client_encoding {v} is not allowed on a read-only service"),
            );
            let _ = client.write_all(&out).await;
            return;
        }
        Opened::LoggedIn(conn) => {
            let key = (conn.backend_key, conn.params);
            (conn.stream, Some(key), BytesMut::new())
        }
    };
    let server_addr = server.peer_addr().ok();
    // A plaintext client cannot use the server's channel binding (libpq
    // refuses a -PLUS offer outside TLS). A TLS client binds to
    // pgwarden's certificate instead, which the server accepts only when
    // it presents the same one; that offer is left as it is, since
    // without it libpq's default (prefer) would answer in a way the server
    // must refuse.
    let unbind_sasl = logged_in.is_none() && server.is_tls() && !client.is_tls();
    let host_gauge = shared
        .metrics
        .server_connections
        .get_or_create(&HostLabel {
            host: host.to_string(),
        })
        .clone();
    host_gauge.inc();
    // Released however the session ends, a panic included: a cancel key
    // left behind would send a later client's cancel to whichever backend
    // reuses the pid, and the gauge would count a connection for good.
    let mut release = Release {
        cancel: &shared.cancel,
        key: None,
        gauge: host_gauge,
    };
    let killed = Arc::new(KillState::default());
    let id = shared
        .next_session
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let registration = SessionGuard::register(
        shared,
        id,
        SessionEntry {
            service: service.name.clone(),
            user: Arc::from(startup.user().unwrap_or_default()),
            database: Arc::from(startup.database().unwrap_or_default()),
            client: peer,
            want: spec.want.clone(),
            host: Some(host.clone()),
            pooled: None,
            killed: killed.clone(),
            client_fd: client.raw_fd(),
            server_fd: Some(server.raw_fd()),
            connected_s: crate::proxy::unix_now_s(),
            tls: client.is_tls(),
            application_name: startup.get("application_name").map(Arc::from),
        },
    );
    // The topology may have changed while the server was connected to and
    // logged in to, after the routing chose it and before the session was
    // registered where route changes look: a new primary meanwhile would
    // leave this session writing to the old one. Looked at once more.
    {
        let snap = shared.snapshot.load();
        let topo = &snap.topology;
        let idx = topo.hosts().iter().position(|h| h.config.addr == host);
        if let Some(k) = crate::proxy::relayed_kill(topo, idx, &spec.want) {
            if let Some(e) = shared.sessions.lock().expect("poisoned").get(&id) {
                tracing::info!(service = %spec.name, host = %host, reason = ?k, "ending session: the topology changed while it started");
                e.kill(k);
            }
        }
    }
    let label = ServiceLabel {
        service: spec.name.clone(),
    };
    let (from_client, to_client) = (
        service.handles.bytes_from_clients.clone(),
        service.handles.bytes_to_clients.clone(),
    );
    // Only read-only services have the series: a writable one refuses
    // nothing.
    let refusals = if spec.read_only {
        shared
            .metrics
            .read_only_refusals
            .get_or_create(&label)
            .clone()
    } else {
        Default::default()
    };
    let result = async {
        match &logged_in {
            // The start-up went to the server as the connection opened.
            None => {}
            Some(((pid, secret), params)) => {
                let mut hello = BytesMut::new();
                encode::authentication_ok(&mut hello);
                let mut sorted: Vec<_> = params.iter().collect();
                sorted.sort();
                for (k, v) in sorted {
                    encode::parameter_status(&mut hello, k, v);
                }
                if let Some(server) = server_addr {
                    let (p, s) = shared.cancel.register(BackendKey {
                        server,
                        pid: *pid,
                        secret: crate::cancel::Secret::Four(*secret),
                    });
                    release.key = Some((p, s));
                    encode::backend_key_data(&mut hello, p, s);
                }
                encode::ready_for_query(&mut hello, TxStatus::Idle);
                client.send_all(&hello).await?;
            }
        }
        Ok::<_, std::io::Error>(())
    }
    .await;
    if result.is_err() {
        crate::bufcache::release(&mut early);
        return;
    }
    // Read as the connection opened, and counted as the pump counts.
    to_client.inc_by(server_early.len() as u64);
    let early = Early {
        client: early,
        server: server_early,
    };

    let io = Io {
        shared,
        spec,
        host: &host,
        server_addr,
        from_client: &from_client,
        to_client: &to_client,
        refusals: &refusals,
        unbind_sasl,
        login_passes_through: logged_in.is_none(),
    };
    // Plain TCP splits for free; TLS needs tokio's locking split.
    let key = &mut release.key;
    match client {
        ClientStream::Plain(tcp) => {
            let (mut cr, mut cw) = tcp.split();
            io.run_to(&mut cr, &mut cw, &mut server, &killed, early, key)
                .await
        }
        ClientStream::Tls(tls) => {
            let (mut cr, mut cw) = tokio::io::split(tls.stream());
            io.run_to(&mut cr, &mut cw, &mut server, &killed, early, key)
                .await
        }
        ClientStream::Local(s) => {
            let (mut cr, mut cw) = s.split();
            io.run_to(&mut cr, &mut cw, &mut server, &killed, early, key)
                .await
        }
        ClientStream::Gone => {}
    }
    drop(registration);
}

/// Bytes read from each side before a relayed session's relay began,
/// which go through it before anything more is read.
struct Early {
    /// The client's, pipelined behind its start-up packet.
    client: BytesMut,
    /// The server's first answer to the start-up (see [`first_answer`]).
    server: BytesMut,
}

enum Ended {
    Upstream(End),
    Downstream(End),
    Killed(Option<Kill>),
}

/// What a relayed session holds outside itself, given back when it ends.
struct Release<'a> {
    cancel: &'a crate::cancel::CancelRegistry,
    /// The cancel key handed to the client, if any.
    key: Option<(i32, i32)>,
    /// The session's host's count of open server connections.
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        if let Some(k) = self.key.take() {
            self.cancel.remove(k);
        }
        self.gauge.dec();
    }
}

/// Puts pgwarden's own cancel key in place of the server's in a relayed
/// BackendKeyData (`msg`, header included), registering where the
/// server's leads; the key handed out goes in `key_slot`. A protocol 3.2
/// server's longer secret is kept for the cancel request, and the client
/// gets a 4-byte one, which 3.2 allows. A message that is neither is
/// passed on as it is.
fn own_backend_key(
    cancel: &crate::cancel::CancelRegistry,
    server: SocketAddr,
    key_slot: &mut Option<(i32, i32)>,
    msg: &mut [u8],
) -> Verdict {
    use crate::cancel::Secret;
    let (pid, secret) = match pgwarden_wire::message::backend_key_data_any(&msg[5..]) {
        Ok((pid, &[a, b, c, d])) => (pid, Secret::Four(i32::from_be_bytes([a, b, c, d]))),
        Ok((pid, long)) => (pid, Secret::Long(long.into())),
        Err(_) => return Verdict::Keep,
    };
    let long = matches!(secret, Secret::Long(_));
    let (p, s) = cancel.register(BackendKey {
        server,
        pid,
        secret,
    });
    // A second one (none is sent) would replace the first, which must not
    // linger.
    if let Some(old) = key_slot.replace((p, s)) {
        cancel.remove(old);
    }
    if long {
        let mut out = BytesMut::new();
        encode::backend_key_data(&mut out, p, s);
        return Verdict::Replace(out);
    }
    msg[5..9].copy_from_slice(&p.to_be_bytes());
    msg[9..13].copy_from_slice(&s.to_be_bytes());
    Verdict::Keep
}

/// What the two pumps of a session need, apart from the sockets.
struct Io<'a> {
    shared: &'a Arc<Shared>,
    spec: &'a crate::proxy::ServiceSpec,
    host: &'a HostAddr,
    server_addr: Option<SocketAddr>,
    from_client: &'a prometheus_client::metrics::counter::Counter,
    to_client: &'a prometheus_client::metrics::counter::Counter,
    refusals: &'a prometheus_client::metrics::counter::Counter,
    /// The server authenticates the client through the relay over TLS
    /// the client does not share: its channel-binding mechanisms are
    /// taken out of its SASL offer
    /// ([`pgwarden_wire::message::sasl_offer_without_binding`]).
    unbind_sasl: bool,
    /// The server's answer to the startup packet passes through the relay
    /// (pgwarden does not log in for the client).
    login_passes_through: bool,
}

impl Io<'_> {
    /// Splits the server connection (plain TCP for free, TLS with tokio's
    /// locking split) and relays.
    async fn run_to<CR, CW>(
        &self,
        cr: &mut CR,
        cw: &mut CW,
        server: &mut ServerStream,
        killed: &KillState,
        early: Early,
        key: &mut Option<(i32, i32)>,
    ) where
        CR: tokio::io::AsyncRead + Direct + Unpin,
        CW: tokio::io::AsyncWrite + Direct + Unpin,
    {
        match server {
            ServerStream::Plain(tcp) => {
                let (mut sr, mut sw) = tcp.split();
                self.run(cr, cw, &mut sr, &mut sw, killed, early, key).await
            }
            ServerStream::Tls(tls) => {
                let (mut sr, mut sw) = tokio::io::split(tls.as_mut());
                self.run(cr, cw, &mut sr, &mut sw, killed, early, key).await
            }
        }
    }

    /// Relays until either side ends or the session is told to end.
    /// The cancel key handed to the client in place of the server's goes
    /// in `key` (where the session releases it).
    #[allow(clippy::too_many_arguments)]
    async fn run<CR, CW, SR, SW>(
        &self,
        cr: &mut CR,
        cw: &mut CW,
        mut sr: &mut SR,
        mut sw: &mut SW,
        killed: &KillState,
        early: Early,
        key_slot: &mut Option<(i32, i32)>,
    ) where
        CR: tokio::io::AsyncRead + Direct + Unpin,
        CW: tokio::io::AsyncWrite + Direct + Unpin,
        SR: tokio::io::AsyncRead + Direct + Unpin,
        SW: tokio::io::AsyncWrite + Direct + Unpin,
    {
        let read_only = self.spec.read_only;
        // A read-write session must not start on a standby: during a
        // switchover the old primary comes back as one before every
        // connection manager has seen it go.
        let wants_primary = self.spec.want == pgwarden_topology::Want::Primary;
        let name = self.spec.name.clone();
        let mut c2s = Framing::default();
        // Before the login is done, no inspected message is valid, and
        // one would be held whole, unauthenticated: little is allowed
        // until the login's ReadyForQuery.
        let login_limit = (read_only && self.login_passes_through).then(|| {
            Arc::new(std::sync::atomic::AtomicUsize::new(
                pgwarden_wire::startup::MAX_STARTUP_PACKET,
            ))
        });
        c2s.limit = login_limit.clone();
        // Before the login, nothing long is taken, not even by its head.
        let logged_in = login_limit.clone();
        c2s.head = Some(crate::relay::HeadOf(Box::new(move |tag, msg| {
            let limit = logged_in.as_ref().map_or(crate::relay::MAX_INSPECTED, |l| {
                l.load(std::sync::atomic::Ordering::Relaxed)
            });
            if limit < crate::relay::MAX_INSPECTED {
                crate::relay::Head::Whole
            } else {
                bind_head(tag, msg)
            }
        })));
        let mut s2c = Framing::default();
        // Statements pipelined behind a possible change of the read-only
        // default wait for the server's report of it
        // ([`ReadOnlyPipeline`]): the client pump waits at the gate, the
        // server pump opens it at ReadyForQuery.
        let pipeline = std::sync::Mutex::new(if self.login_passes_through {
            ReadOnlyPipeline::logging_in()
        } else {
            ReadOnlyPipeline::default()
        });
        let gate = tokio::sync::Notify::new();
        let ended = {
            let upstream = pump(
                cr,
                &mut sw,
                &mut c2s,
                self.from_client,
                |t| read_only && read_only_inspects(t),
                |tag, msg| {
                    let mut pipeline = pipeline.lock().unwrap_or_else(|p| p.into_inner());
                    if pipeline.admit(tag) == Admission::Wait {
                        return Verdict::Wait;
                    }
                    // See `encode::batch_marker`: without it, a Query the
                    // server skips after an error would leave a
                    // ReadyForQuery owed forever, and the session stuck.
                    let marked = matches!(tag, frontend::QUERY | frontend::FUNCTION_CALL)
                        && pipeline.in_batch();
                    if marked {
                        pipeline.marker_sent();
                    }
                    if let Err(v) = pipeline.sent(tag, &msg[5..]) {
                        self.refusals.inc();
                        return Verdict::Stop(
                            sqlstate::READ_ONLY_SQL_TRANSACTION,
                            format!("service \"{name}\" is read-only: {v}"),
                        );
                    }
                    let refused = if guarded(tag) {
                        guard_message(&name, tag, msg)
                    } else {
                        None
                    };
                    if refused.is_some() {
                        self.refusals.inc();
                    }
                    match (refused, marked) {
                        (None, false) => Verdict::Keep,
                        (Some(replacement), false) => Verdict::Replace(replacement),
                        (refused, true) => {
                            let mut with = BytesMut::new();
                            encode::batch_marker(&mut with);
                            with.extend_from_slice(refused.as_deref().unwrap_or(msg));
                            Verdict::Replace(with)
                        }
                    }
                },
                early.client,
                Some(&gate),
            );
            let cancel = &self.shared.cancel;
            let downstream = pump(
                &mut sr,
                cw,
                &mut s2c,
                self.to_client,
                |t| {
                    t == backend::BACKEND_KEY_DATA
                        || ((read_only || wants_primary) && t == backend::PARAMETER_STATUS)
                        || (read_only && read_only_replies(t))
                        || (self.unbind_sasl && t == backend::AUTHENTICATION_REQUEST)
                },
                |tag, msg| {
                    if read_only && read_only_replies(tag) {
                        let mut pipeline = pipeline.lock().unwrap_or_else(|p| p.into_inner());
                        let mut verdict = Verdict::Keep;
                        match tag {
                            backend::PARSE_COMPLETE => pipeline.parse_complete(),
                            backend::CLOSE_COMPLETE => {
                                if pipeline.close_complete() {
                                    verdict = Verdict::Replace(BytesMut::new());
                                }
                            }
                            backend::ERROR_RESPONSE => pipeline.error(),
                            backend::COPY_IN_RESPONSE => pipeline.copy_in(),
                            // Any report before it was checked (below) and
                            // would have stopped the session.
                            _ => {
                                pipeline.ready();
                                if let Some(l) = &login_limit {
                                    l.store(
                                        crate::relay::MAX_INSPECTED,
                                        std::sync::atomic::Ordering::Relaxed,
                                    );
                                }
                            }
                        }
                        if !pipeline.awaiting_ready() {
                            gate.notify_one();
                        }
                        return verdict;
                    }
                    if tag == backend::AUTHENTICATION_REQUEST {
                        return match pgwarden_wire::message::sasl_offer_without_binding(msg) {
                            Some(offer) => Verdict::Replace(BytesMut::from(&offer[..])),
                            None => Verdict::Keep,
                        };
                    }
                    if tag == backend::BACKEND_KEY_DATA {
                        return match self.server_addr {
                            Some(server) => own_backend_key(cancel, server, key_slot, msg),
                            None => Verdict::Keep,
                        };
                    }
                    match pgwarden_wire::message::parameter_status(&msg[5..]) {
                        Ok(("default_transaction_read_only", v))
                            if read_only && !v.eq_ignore_ascii_case("on") =>
                        {
                            Verdict::Stop(
                                sqlstate::READ_ONLY_SQL_TRANSACTION,
                                "the session was made read-write on a read-only service".into(),
                            )
                        }
                        Ok(("client_encoding", v))
                            if read_only
                                && pgwarden_wire::readonly::client_only_encoding(v.as_bytes()) =>
                        {
                            Verdict::Stop(
                                sqlstate::READ_ONLY_SQL_TRANSACTION,
                                format!("client_encoding {v} is not allowed on a read-only service"),
                            )
                        }
                        // Sent at login since PostgreSQL 14.
                        Ok(("in_hot_standby", v)) if wants_primary && v.eq_ignore_ascii_case("on") => {
                            Verdict::Stop(
                                sqlstate::CANNOT_CONNECT_NOW,
                                format!("{} is a standby, not the primary (the primary is changing); reconnect", self.host),
                            )
                        }
                        _ => Verdict::Keep,
                    }
                },
                early.server,
                None,
            );
            let mut downstream = std::pin::pin!(downstream);
            let mut ended = tokio::select! {
                e = upstream => Ended::Upstream(e),
                e = &mut downstream => Ended::Downstream(e),
                // Only a client pump held at the gate reads no end of
                // input when the session is told to end.
                () = killed.told(), if read_only => Ended::Killed(killed.reason()),
            };
            // A client that shut only its sending side still reads: the
            // server answers what it was sent before it sees the end of
            // input, as it would answer the client directly. The server
            // is shown the end, and the replies relayed until it closes
            // (or the session is told to end). A server not shown the end
            // (a TLS close_notify that could not be written in time)
            // would wait for more input for good: the session ends then,
            // as it did before.
            if matches!(ended, Ended::Upstream(End::Eof))
                && killed.reason().is_none()
                && matches!(
                    crate::timer::timeout(SHUTDOWN_WRITE, sw.shutdown()).await,
                    Ok(Ok(()))
                )
            {
                ended = tokio::select! {
                    e = &mut downstream => match e {
                        // The server closing after the client's end is
                        // the session's natural end.
                        End::Eof => Ended::Upstream(End::Eof),
                        e => Ended::Downstream(e),
                    },
                    () = killed.told() => Ended::Killed(killed.reason()),
                };
            }
            // Being told to end shows as the end of the client's input
            // (the read side of its socket is shut).
            match (ended, killed.reason()) {
                (Ended::Upstream(End::Eof | End::Io(_)), Some(k))
                | (Ended::Downstream(End::Eof | End::Io(_)), Some(k)) => Ended::Killed(Some(k)),
                (e, _) => e,
            }
        };

        if let Ended::Upstream(End::Io(e)) | Ended::Downstream(End::Io(e)) = &ended {
            tracing::debug!(error = %e, "session ended by a socket error");
        }
        let notice = match &ended {
        Ended::Killed(Some(Kill::NotPrimary)) => Some((sqlstate::ADMIN_SHUTDOWN, format!("terminating connection: {} is no longer the primary; reconnect to reach the new one", self.host))),
        Ended::Killed(Some(Kill::HostDown)) => Some((sqlstate::CONNECTION_FAILURE, format!("terminating connection: server {} is down", self.host))),
        Ended::Killed(Some(Kill::HostRemoved)) => Some((sqlstate::ADMIN_SHUTDOWN, format!("terminating connection: server {} was removed from pgwarden's configuration", self.host))),
        Ended::Killed(Some(Kill::Shutdown)) | Ended::Killed(None) => Some((sqlstate::ADMIN_SHUTDOWN, "terminating connection: pgwarden is shutting down".to_string())),
        Ended::Killed(Some(Kill::Admin)) => Some((sqlstate::ADMIN_SHUTDOWN, "terminating connection: administrator command".to_string())),
        Ended::Downstream(End::Stopped(code, why)) | Ended::Upstream(End::Stopped(code, why)) => Some((*code, format!("terminating connection: {why}"))),
        Ended::Upstream(End::Protocol(e)) => Some((sqlstate::PROTOCOL_VIOLATION, format!("invalid frontend message: {e}"))),
        _ => None,
    };
        if let Ended::Killed(Some(k)) = &ended {
            self.shared
                .metrics
                .sessions_terminated
                .get_or_create(&crate::metrics::ErrorLabel {
                    service: self.spec.name.clone(),
                    reason: format!("{k:?}"),
                })
                .inc();
        }
        if let Some((code, message)) = notice {
            if s2c.at_boundary() {
                let out = encode::fatal(code.code(), &message);
                let _ = crate::timer::timeout(Duration::from_secs(1), cw.write_all(&out)).await;
            }
        }
        // Over TLS a shutdown writes close_notify and whatever the stream
        // holds: a peer that stopped reading would hold the session (and
        // its server connection) for good. Past the bound, the sockets
        // are simply dropped.
        let _ = crate::timer::timeout(SHUTDOWN_WRITE, cw.shutdown()).await;
        let _ = crate::timer::timeout(SHUTDOWN_WRITE, sw.shutdown()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At most MAX_REFUSING refusals are served at once; a place comes
    /// back when one ends. (The only test of this process to take any.)
    #[test]
    fn refusals_at_the_limit_are_bounded() {
        let held: Vec<Refusing> = (0..MAX_REFUSING).map_while(|_| Refusing::take()).collect();
        assert_eq!(held.len(), MAX_REFUSING);
        assert!(Refusing::take().is_none());
        drop(held.into_iter().next());
        assert!(Refusing::take().is_some());
    }

    #[test]
    fn refused_statements_become_a_server_side_error_and_others_pass() {
        let mut q = BytesMut::new();
        encode::query(&mut q, "SELECT 1; SET default_transaction_read_only = off");
        let r = guard_message("read_only", frontend::QUERY, &q).expect("refused");
        let text = pgwarden_wire::message::query_text(&r[5..]).unwrap();
        assert!(text.starts_with("DO $pgwarden$"), "{text}");
        assert!(text.contains("25006"));

        let mut ok = BytesMut::new();
        encode::query(&mut ok, "SELECT 'it''s fine'");
        assert!(guard_message("read_only", frontend::QUERY, &ok).is_none());

        let mut p = BytesMut::new();
        encode::parse(&mut p, "s1", "BEGIN READ WRITE", &[23]);
        let r = guard_message("ro", frontend::PARSE, &p).expect("refused");
        let parsed = pgwarden_wire::message::parse_message(&r[5..]).unwrap();
        assert_eq!(parsed.name, b"s1");
        assert_eq!(parsed.param_type_count, 1);

        // A client encoding other than UTF-8 (LATIN1 bytes in the name and
        // a comment) is checked all the same, and the name kept.
        let mut p = BytesMut::new();
        encode::parse(&mut p, b"s\xe9", b"BEGIN READ WRITE /* \xe9 */", &[]);
        let r = guard_message("ro", frontend::PARSE, &p).expect("refused");
        let parsed = pgwarden_wire::message::parse_message(&r[5..]).unwrap();
        assert_eq!(parsed.name, b"s\xe9");
        let body = b"SET TRANSACTION READ WRITE -- \xe9\0";
        let mut q = vec![frontend::QUERY];
        q.extend_from_slice(&(4 + body.len() as u32).to_be_bytes());
        q.extend_from_slice(body);
        assert!(guard_message("ro", frontend::QUERY, &q).is_some());
    }

    #[test]
    fn messages_the_check_cannot_read_are_refused() {
        // PostgreSQL takes 32,768 and more parameter types (an unsigned
        // count): such a Parse is read and checked like any other.
        let mut p = BytesMut::new();
        encode::parse(
            &mut p,
            "",
            "SET default_transaction_read_only = off",
            &[25; 0x8000],
        );
        let r = guard_message("ro", frontend::PARSE, &p).expect("refused");
        let parsed = pgwarden_wire::message::parse_message(&r[5..]).unwrap();
        assert_eq!(parsed.param_type_count, 0x8000);
        let mut p = BytesMut::new();
        encode::parse(&mut p, "", "SELECT 1", &[25; 0x8000]);
        assert!(guard_message("ro", frontend::PARSE, &p).is_none());
        // Text without its terminator, a Parse cut short: refused.
        let q = [frontend::QUERY, 0, 0, 0, 8, b'S', b'E', b'T', b' '];
        let r = guard_message("ro", frontend::QUERY, &q).expect("refused");
        assert!(pgwarden_wire::message::query_text(&r[5..])
            .unwrap()
            .contains("malformed Query message"));
        let mut p = BytesMut::new();
        encode::parse(&mut p, "s", "BEGIN READ WRITE", &[]);
        let cut = p.len() - 1;
        p.truncate(cut);
        p[1..5].copy_from_slice(&(cut as u32 - 1).to_be_bytes());
        let r = guard_message("ro", frontend::PARSE, &p).expect("refused");
        let parsed = pgwarden_wire::message::parse_message(&r[5..]).unwrap();
        assert!(std::str::from_utf8(parsed.query)
            .unwrap()
            .contains("malformed Parse message"));
    }

    #[test]
    fn fast_path_set_config_is_refused_and_other_calls_pass() {
        let call = |oid: u32| {
            let mut m = vec![frontend::FUNCTION_CALL, 0, 0, 0, 14];
            m.extend_from_slice(&oid.to_be_bytes());
            m.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
            m
        };
        let r =
            guard_message("ro", frontend::FUNCTION_CALL, &call(SET_CONFIG_OID)).expect("refused");
        assert_eq!(r[0], frontend::QUERY);
        assert!(guard_message("ro", frontend::FUNCTION_CALL, &call(89)).is_none());
        // One too short to name a function is refused, not passed on.
        assert!(guard_message("ro", frontend::FUNCTION_CALL, &[b'F', 0, 0, 0, 4]).is_some());
        assert!(guarded(frontend::FUNCTION_CALL) && !guarded(frontend::BIND));
    }

    /// A relayed session's task that panics is dropped by the runtime,
    /// and with it what the session held outside itself.
    #[tokio::test]
    async fn a_session_that_panics_gives_back_its_cancel_key_and_gauges() {
        let cancel = Arc::new(crate::cancel::CancelRegistry::default());
        let gauge = prometheus_client::metrics::gauge::Gauge::<i64>::default();
        gauge.inc();
        let key = cancel.register(crate::cancel::BackendKey {
            server: SocketAddr::from(([127, 0, 0, 1], 5432)),
            pid: 7,
            secret: crate::cancel::Secret::Four(9),
        });
        let clients = prometheus_client::metrics::gauge::Gauge::<i64>::default();
        let (c, g, cl) = (cancel.clone(), gauge.clone(), clients.clone());
        let task = tokio::spawn(async move {
            let _client = ClientGauge::new(&cl);
            let mut release = Release {
                cancel: &c,
                key: None,
                gauge: g,
            };
            release.key = Some(key);
            tokio::task::yield_now().await;
            panic!("a bug in the relay");
        });
        assert!(task.await.unwrap_err().is_panic());
        assert!(cancel.lookup(key).is_none(), "the cancel key stayed");
        assert_eq!(gauge.get(), 0, "the server connection is still counted");
        assert_eq!(clients.get(), 0, "the client is still counted");
    }

    /// The server's key never reaches the client; a protocol 3.2 key of
    /// 32 bytes is kept whole for the cancel request, which is sent to the
    /// server as long as the server sent it.
    #[test]
    fn relayed_backend_keys_are_replaced_with_pgwarden_s_own() {
        use crate::cancel::{CancelRegistry, Secret};
        let server = SocketAddr::from(([127, 0, 0, 1], 5432));
        let key_data = |secret: &[u8]| {
            let mut m = vec![backend::BACKEND_KEY_DATA];
            m.extend_from_slice(&(8 + secret.len() as u32).to_be_bytes());
            m.extend_from_slice(&4242i32.to_be_bytes());
            m.extend_from_slice(secret);
            m
        };
        let cancel = CancelRegistry::default();
        // Protocol 3.0: four bytes, rewritten in place.
        let mut slot = None;
        let mut m = key_data(&77i32.to_be_bytes());
        assert!(matches!(
            own_backend_key(&cancel, server, &mut slot, &mut m),
            Verdict::Keep
        ));
        let (p, s) = slot.unwrap();
        assert_eq!(
            pgwarden_wire::message::backend_key_data(&m[5..]).unwrap(),
            (p, s)
        );
        let (key, _) = cancel.lookup((p, s)).unwrap();
        assert_eq!((key.pid, &key.secret), (4242, &Secret::Four(77)));
        assert_eq!(key.cancel_request().len(), 16);
        // Protocol 3.2: 32 bytes, replaced by a 4-byte key.
        let long: Vec<u8> = (1..=32).collect();
        let mut slot = None;
        let mut m = key_data(&long);
        let Verdict::Replace(out) = own_backend_key(&cancel, server, &mut slot, &mut m) else {
            panic!("a long key must be replaced");
        };
        assert_eq!(out[0], backend::BACKEND_KEY_DATA);
        let (p, s) = slot.unwrap();
        assert_eq!(
            pgwarden_wire::message::backend_key_data(&out[5..]).unwrap(),
            (p, s)
        );
        let (key, _) = cancel.lookup((p, s)).unwrap();
        let packet = key.cancel_request();
        assert_eq!(packet.len(), 12 + 32);
        assert_eq!(&packet[0..4], &44u32.to_be_bytes());
        assert_eq!(&packet[8..12], &4242i32.to_be_bytes());
        assert_eq!(&packet[12..], &long[..]);
        // Out of range (over 256 bytes, or under 4): passed on untouched.
        for bad in [vec![1u8; 257], vec![1u8; 2]] {
            let mut slot = None;
            let mut m = key_data(&bad);
            let before = m.clone();
            assert!(matches!(
                own_backend_key(&cancel, server, &mut slot, &mut m),
                Verdict::Keep
            ));
            assert!(slot.is_none());
            assert_eq!(m, before);
        }
    }

    #[test]
    fn refusal_message_quotes_are_escaped() {
        assert!(refusal_sql("it's").contains("'it''s'"));
    }
}
