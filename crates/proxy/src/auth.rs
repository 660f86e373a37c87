//! Client authentication by pgwarden itself: pg_hba.conf rules, password
//! verifiers looked up on the primary with an auth query, SCRAM-SHA-256,
//! md5 and cleartext towards the client, and client certificates (the
//! `cert` method and `clientcert`); what the client proved is then used to
//! log in to the servers as the same user.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use pgwarden_auth::hba::{AuthMethod, ClientCert, ConnType, Hba, HbaContext};
use pgwarden_auth::{md5_secret, verify_md5, ClientKey, ScramError, ScramSecret, ScramServer};
use pgwarden_wire::encode;
use pgwarden_wire::message::{self, frontend};
use pgwarden_wire::sqlstate::{self, SqlState};
use pgwarden_wire::startup::{Replication, StartupMessage};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::proxy::Shared;
use crate::stream::ClientStream;

/// How pgwarden authenticates clients (`[auth]`).
#[derive(Debug, Clone)]
pub struct AuthSpec {
    /// The pg_hba.conf file (read again on every apply).
    pub hba_file: PathBuf,
    /// The role that runs the auth query.
    pub auth_user: String,
    /// Its password.
    pub auth_password: Option<String>,
    /// Database the auth query runs in.
    pub auth_dbname: String,
    /// Returns the verifier of the role `$1` (one row: the role name and
    /// its `rolpassword`), or no row.
    pub auth_query: String,
    /// How long a looked-up verifier is reused.
    pub cache_ttl: Duration,
}

/// What a client proved, to log in to servers as the same user.
#[derive(Clone, Debug)]
pub enum Credential {
    /// Nothing that servers could check (`trust`, `cert`): they must not
    /// ask pgwarden for a password.
    None,
    /// The cleartext password (method `password`, or the pool's
    /// configured server password), as bytes: a client whose encoding is
    /// not UTF-8 sends it in that encoding.
    Password(Vec<u8>),
    /// The md5 verifier (method `md5` against an md5 secret).
    Md5Secret(String),
    /// The SCRAM ClientKey recovered from the client's proof.
    ClientKey(ClientKey),
}

/// A refused authentication: the code and message the client sees, the
/// reason counted in metrics and logged, and for the log only, what
/// exactly was wrong when the client is told less.
pub(crate) struct AuthError {
    pub code: SqlState,
    pub message: String,
    pub reason: &'static str,
    pub detail: Option<String>,
}

impl AuthError {
    fn new(code: SqlState, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            reason,
            detail: None,
        }
    }

    fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// The client went away in the middle of the exchange: libpq does so
    /// when the server asks for a password it was not given, and psql
    /// then prompts for one and connects again. PostgreSQL ends such a
    /// connection silently; it is no failed login.
    fn gone() -> Self {
        Self::new(sqlstate::CONNECTION_FAILURE, GONE, "the client went away")
    }

    /// Whether this is [`Self::gone`]: nothing to count, log or answer.
    pub fn is_gone(&self) -> bool {
        self.reason == GONE
    }
}

/// The reason of [`AuthError::gone`].
const GONE: &str = "client_gone";

/// Per-proxy authentication state: the parsed hba file and the verifier cache.
pub(crate) struct Authenticator {
    pub spec: AuthSpec,
    pub hba: Hba,
    /// Verifiers by role (`None`: no such role, or no password).
    cache: Mutex<Cache<Option<String>>>,
    /// Role memberships by role, for `+group` and `samerole`.
    roles_cache: Mutex<Cache<Vec<String>>>,
    /// Whether each role may log in (`None`: no such role), for the
    /// methods that ask nothing of it ([`Authenticator::check_login`]).
    login_cache: Mutex<Cache<Option<bool>>>,
    /// When a login check last could not be made.
    login_unchecked: Mutex<Option<Instant>>,
    lookup: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
    /// Whether the server's `password_encryption` is `md5`, and when that
    /// was looked up.
    md5_encryption: Mutex<Option<(bool, Instant)>>,
    /// Seed of mock verifiers for unknown roles: stable for the process so
    /// that an unknown role always gets the same salt, as a real one would.
    mock_seed: [u8; 16],
}

/// Entries a lookup cache keeps at most. Names come from clients before
/// they authenticate, so the cache must not grow with what they send: at
/// the cap, expired entries go, then unknown roles, then everything.
const CACHE_MAX: usize = 10_000;

/// Looked-up values by role name, each with when it was looked up.
struct Cache<T> {
    entries: HashMap<String, (T, Instant)>,
}

impl<T: Clone> Cache<T> {
    fn new() -> Self {
        Self {
            entries: HashMap::new(),
        }
    }

    fn get(&self, key: &str, ttl: Duration) -> Option<T> {
        self.entries
            .get(key)
            .filter(|(_, at)| at.elapsed() < ttl)
            .map(|(v, _)| v.clone())
    }

    fn insert(&mut self, key: &str, value: T, ttl: Duration, known: impl Fn(&T) -> bool) {
        if self.entries.len() >= CACHE_MAX && !self.entries.contains_key(key) {
            self.entries.retain(|_, (_, at)| at.elapsed() < ttl);
            if self.entries.len() >= CACHE_MAX {
                self.entries.retain(|_, (v, _)| known(v));
            }
            if self.entries.len() >= CACHE_MAX {
                self.entries.clear();
            }
        }
        self.entries
            .insert(key.to_string(), (value, Instant::now()));
    }
}

/// The iteration count an unknown role's mock secret offers: that of the
/// last real SCRAM secret used. PostgreSQL offers its own
/// `scram_iterations`, which is what the cluster's secrets are made with;
/// a fixed 4096 would set unknown roles apart in a cluster that uses
/// another count. Process-wide, like the seed, so a reload keeps it.
static MOCK_ITERATIONS: AtomicU32 = AtomicU32::new(pgwarden_auth::scram::DEFAULT_ITERATIONS);

/// The mock seed: one per process, so that a reload (which builds a new
/// [`Authenticator`]) does not change an unknown role's salt and give it
/// away.
fn mock_seed() -> [u8; 16] {
    static SEED: std::sync::OnceLock<[u8; 16]> = std::sync::OnceLock::new();
    *SEED.get_or_init(rand::random)
}

impl Authenticator {
    /// Loads the hba file. `client_ca`: whether `tls.client_ca` is set, without
    /// which rules that need a client certificate could never be met.
    pub fn new(spec: AuthSpec, client_ca: bool) -> Result<Self, String> {
        let hba = Hba::load(&spec.hba_file).map_err(|e| e.to_string())?;
        if !client_ca {
            check_no_client_certs(&hba, &spec.hba_file)?;
        }
        Ok(Self {
            spec,
            hba,
            cache: Mutex::new(Cache::new()),
            roles_cache: Mutex::new(Cache::new()),
            login_cache: Mutex::new(Cache::new()),
            login_unchecked: Mutex::new(None),
            lookup: tokio::sync::Mutex::new(None),
            md5_encryption: Mutex::new(None),
            mock_seed: mock_seed(),
        })
    }

    /// The role's verifier (`SCRAM-SHA-256$…` or `md5…`), `None` when the
    /// role does not exist or has no password.
    async fn verifier(
        &self,
        shared: &Shared,
        user: &str,
        primary_wait: Duration,
    ) -> Result<Option<String>, String> {
        if let Some(v) = self
            .cache
            .lock()
            .expect("poisoned")
            .get(user, self.spec.cache_ttl)
        {
            return Ok(v);
        }
        let mut guard = self.lookup_connection(shared, primary_wait).await?;
        let client = guard.as_ref().expect("connected");
        let rows = match crate::timer::timeout(
            Duration::from_secs(5),
            client.query(&self.spec.auth_query, &[&user]),
        )
        .await
        {
            Ok(Ok(rows)) => rows,
            Ok(Err(e)) => {
                // The server's error (a missing function, a permission)
                // leaves the connection usable; only a broken one goes.
                if e.as_db_error().is_none() || e.is_closed() {
                    *guard = None;
                }
                return Err(format!("auth query failed: {}", pg_error(&e)));
            }
            // The query still runs there (a lock, a slow function): the
            // next lookup would queue behind it on this connection.
            Err(_) => {
                *guard = None;
                return Err("auth query timed out".into());
            }
        };
        let v: Option<String> = rows
            .first()
            .and_then(|r| r.try_get::<_, Option<String>>(1).ok().flatten());
        self.cache.lock().expect("poisoned").insert(
            user,
            v.clone(),
            self.spec.cache_ttl,
            Option::is_some,
        );
        Ok(v)
    }

    /// Whether the server's `password_encryption` is `md5`: what
    /// PostgreSQL asks a role without a verifier (one that does not exist,
    /// or has no password) for on an `md5` line. Looked up on the auth
    /// connection and kept as long as verifiers are; SCRAM when it cannot
    /// be.
    async fn md5_encryption(&self, shared: &Shared, primary_wait: Duration) -> bool {
        if let Some((md5, at)) = *self.md5_encryption.lock().expect("poisoned") {
            if at.elapsed() < self.spec.cache_ttl {
                return md5;
            }
        }
        let Ok(mut guard) = self.lookup_connection(shared, primary_wait).await else {
            return false;
        };
        let client = guard.as_ref().expect("connected");
        let shown = crate::timer::timeout(
            Duration::from_secs(5),
            client.simple_query("SHOW password_encryption"),
        )
        .await;
        let md5 = match shown {
            Ok(Ok(rows)) => rows.iter().any(|m| {
                matches!(m, tokio_postgres::SimpleQueryMessage::Row(r)
                    if r.get(0).is_some_and(|v| v.eq_ignore_ascii_case("md5")))
            }),
            Ok(Err(e)) => {
                if e.as_db_error().is_none() || e.is_closed() {
                    *guard = None;
                }
                return false;
            }
            Err(_) => {
                *guard = None;
                return false;
            }
        };
        *self.md5_encryption.lock().expect("poisoned") = Some((md5, Instant::now()));
        md5
    }

    /// After `trust`, `cert` or `peer`, which ask nothing of the role:
    /// whether it exists and may log in (`rolcanlogin`), as PostgreSQL
    /// checks at every login. A pooled client may be served by a server
    /// connection another client's login opened, so without this a role
    /// dropped or made `NOLOGIN` would go on being served until those
    /// connections close. A lookup that fails (no primary to ask, within
    /// `primary_wait`) lets the client in: servers still check the logins
    /// they see, and refusing would make a read-only pool depend on the
    /// primary for these methods. The failure is remembered for a second,
    /// so that logins during an outage do not each try again.
    pub async fn check_login(
        &self,
        shared: &Shared,
        user: &str,
        primary_wait: Duration,
    ) -> Result<(), AuthError> {
        let recently_failed = self
            .login_unchecked
            .lock()
            .expect("poisoned")
            .is_some_and(|at| at.elapsed() < Duration::from_secs(1));
        let cached = self
            .login_cache
            .lock()
            .expect("poisoned")
            .get(user, self.spec.cache_ttl);
        if cached.is_none() && recently_failed {
            return Ok(());
        }
        let may = match cached {
            Some(v) => v,
            None => match self.look_up_login(shared, user, primary_wait).await {
                Ok(v) => {
                    self.login_cache.lock().expect("poisoned").insert(
                        user,
                        v,
                        self.spec.cache_ttl,
                        Option::is_some,
                    );
                    v
                }
                Err(e) => {
                    tracing::warn!(user, error = %e, "could not check that the role may log in; letting it in");
                    *self.login_unchecked.lock().expect("poisoned") = Some(Instant::now());
                    return Ok(());
                }
            },
        };
        match may {
            Some(true) => Ok(()),
            Some(false) => Err(AuthError::new(
                sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                "role_login",
                format!("role \"{user}\" is not permitted to log in"),
            )),
            None => Err(AuthError::new(
                sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                "role_login",
                format!("role \"{user}\" does not exist"),
            )),
        }
    }

    async fn look_up_login(
        &self,
        shared: &Shared,
        user: &str,
        primary_wait: Duration,
    ) -> Result<Option<bool>, String> {
        let mut guard = self.lookup_connection(shared, primary_wait).await?;
        let client = guard.as_ref().expect("connected");
        let q = "SELECT rolcanlogin FROM pg_catalog.pg_roles WHERE rolname = $1::text";
        match crate::timer::timeout(Duration::from_secs(5), client.query_opt(q, &[&user])).await {
            Ok(Ok(row)) => Ok(row.and_then(|r| r.try_get::<_, bool>(0).ok())),
            Ok(Err(e)) => {
                if e.as_db_error().is_none() || e.is_closed() {
                    *guard = None;
                }
                Err(format!("role lookup failed: {}", pg_error(&e)))
            }
            Err(_) => {
                *guard = None;
                Err("role lookup timed out".into())
            }
        }
    }

    /// The roles `user` is a member of (directly or not), itself included.
    async fn roles(
        &self,
        shared: &Shared,
        user: &str,
        primary_wait: Duration,
    ) -> Result<Vec<String>, String> {
        if let Some(v) = self
            .roles_cache
            .lock()
            .expect("poisoned")
            .get(user, self.spec.cache_ttl)
        {
            return Ok(v);
        }
        let mut guard = self.lookup_connection(shared, primary_wait).await?;
        let client = guard.as_ref().expect("connected");
        // Membership through grants only, as pg_hba.conf counts it:
        // pg_has_role would make a superuser a member of every role.
        let q = "WITH RECURSIVE m(oid) AS ( \
                   SELECT oid FROM pg_catalog.pg_roles WHERE rolname = $1::text \
                   UNION SELECT a.roleid FROM pg_catalog.pg_auth_members a JOIN m ON a.member = m.oid) \
                 SELECT r.rolname::text FROM pg_catalog.pg_roles r JOIN m ON r.oid = m.oid";
        let rows = match crate::timer::timeout(Duration::from_secs(5), client.query(q, &[&user]))
            .await
        {
            Ok(Ok(rows)) => rows,
            // An unknown role is a member of nothing.
            Ok(Err(e)) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_OBJECT) => {
                Vec::new()
            }
            Ok(Err(e)) => {
                if e.as_db_error().is_none() || e.is_closed() {
                    *guard = None;
                }
                return Err(format!("role lookup failed: {}", pg_error(&e)));
            }
            Err(_) => {
                *guard = None;
                return Err("role lookup timed out".into());
            }
        };
        let roles: Vec<String> = rows
            .iter()
            .filter_map(|r| r.try_get::<_, String>(0).ok())
            .collect();
        self.roles_cache.lock().expect("poisoned").insert(
            user,
            roles.clone(),
            self.spec.cache_ttl,
            |r| !r.is_empty(),
        );
        Ok(roles)
    }

    /// The auth user's connection to the primary, connected if need be,
    /// held for one lookup. Right after a start, or during a failover, the
    /// primary may be moments away: this waits up to `primary_wait` for
    /// one, as a routed client would (the client's `auth_timeout` still
    /// bounds its whole login). The wait happens outside the lock, so that
    /// clients arriving while there is no primary each wait their own
    /// `primary_wait` rather than one after the other's.
    async fn lookup_connection(
        &self,
        shared: &Shared,
        primary_wait: Duration,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<tokio_postgres::Client>>, String> {
        let give_up = tokio::time::Instant::now() + primary_wait;
        let mut changes = shared.changes.clone();
        loop {
            // Seen before the topology is read: a change after the read
            // wakes the wait below.
            changes.borrow_and_update();
            let mut guard = self.lookup.lock().await;
            if guard.as_ref().is_some_and(|c| !c.is_closed()) {
                return Ok(guard);
            }
            if let Some(primary) = primary_addr(shared) {
                *guard = Some(self.connect(shared, &primary).await?);
                return Ok(guard);
            }
            drop(guard);
            match crate::timer::timeout_at(give_up, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Err("no primary to run the auth query on".into()),
            }
        }
    }

    /// A connection to `primary` as the auth user.
    async fn connect(
        &self,
        shared: &Shared,
        primary: &pgwarden_topology::HostAddr,
    ) -> Result<tokio_postgres::Client, String> {
        let mut cfg = tokio_postgres::Config::new();
        cfg.host(&primary.host)
            .port(primary.port)
            .user(&self.spec.auth_user)
            .dbname(&self.spec.auth_dbname)
            .application_name("pgwarden-auth");
        if let Some(p) = &self.spec.auth_password {
            cfg.password(p);
        }
        // Through the same TLS negotiation as every other server
        // connection; tokio-postgres then speaks over the ready stream.
        cfg.ssl_mode(tokio_postgres::config::SslMode::Disable);
        let server_tls = shared.server_tls.load_full();
        let attempt = async {
            let tcp = tokio::net::TcpStream::connect((primary.host.as_str(), primary.port))
                .await
                .map_err(|e| e.to_string())?;
            crate::stream::tune(&tcp);
            let stream = server_tls.start(tcp, &primary.host).await?;
            cfg.connect_raw(stream, tokio_postgres::NoTls)
                .await
                .map_err(|e| pg_error(&e))
        };
        let (client, conn) = crate::timer::timeout(Duration::from_secs(5), attempt)
            .await
            .map_err(|_| format!("auth user cannot connect to {primary}: timed out"))?
            .map_err(|e| format!("auth user cannot connect to {primary}: {e}"))?;
        tokio::spawn(conn);
        Ok(client)
    }

    /// Runs the hba decision and the method's exchange with the client.
    /// A lookup on the primary waits up to `primary_wait` for one to be
    /// known (the service's `connect_wait_timeout`).
    pub async fn authenticate(
        &self,
        shared: &Shared,
        client: &mut ClientStream,
        startup: &StartupMessage,
        peer: SocketAddr,
        primary_wait: Duration,
    ) -> Result<Credential, AuthError> {
        let user = startup.user().unwrap_or_default().to_string();
        let database = startup.database().unwrap_or_default().to_string();
        // As PostgreSQL reads it before anything else: a physical
        // walsender matches only pg_hba.conf's `replication` entries.
        let physical = match startup.replication() {
            Ok(r) => r == Replication::Physical,
            Err(v) => {
                return Err(AuthError::new(
                    sqlstate::INVALID_PARAMETER_VALUE,
                    "protocol",
                    format!("invalid value for parameter \"replication\": \"{v}\""),
                ))
            }
        };
        let locals = if self.hba.needs_local_addrs() {
            local_addrs()
        } else {
            Vec::new()
        };
        // Group membership (`+group`, `samerole`) comes from the primary:
        // looked up only when the scan of the rules reaches an entry that
        // needs it, and the scan then made again with it. A login that no
        // such entry precedes (trust, cert, peer lines first) does not
        // depend on the primary.
        let mut roles: Option<Vec<String>> = None;
        let (method, client_cert, line, reject) = loop {
            // Made before any await: the context borrows a callback that
            // is not Send.
            let asked = std::cell::Cell::new(false);
            let (found, no_match) = {
                let of_user = |_: &str| match &roles {
                    Some(r) => r.clone(),
                    None => {
                        asked.set(true);
                        Vec::new()
                    }
                };
                let mut ctx = if client.is_local() {
                    HbaContext::new(ConnType::Local, &database, &user, None)
                } else {
                    HbaContext::new(
                        ConnType::Host {
                            ssl: client.is_tls(),
                        },
                        &database,
                        &user,
                        Some(peer.ip()),
                    )
                };
                ctx.physical_replication = physical;
                ctx.roles_of_user = &of_user;
                ctx.local_addrs = &locals;
                let found = self.hba.find(&ctx).map(|rule| {
                    (
                        rule.method,
                        rule.client_cert,
                        rule.line,
                        pgwarden_auth::hba::reject_message(&ctx),
                    )
                });
                (found, pgwarden_auth::hba::no_match_message(&ctx))
            };
            if roles.is_none() && asked.get() {
                roles = Some(self.roles(shared, &user, primary_wait).await.map_err(|e| {
                    tracing::error!(error = %e, user = %user, "role membership lookup failed");
                    AuthError::new(
                        sqlstate::CONNECTION_FAILURE,
                        "auth_query",
                        "authentication is unavailable: role membership could not be looked up",
                    )
                })?);
                continue;
            }
            match found {
                Some(decision) => break decision,
                None => {
                    return Err(AuthError::new(
                        sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                        "hba_no_match",
                        no_match,
                    ))
                }
            }
        };
        // As in PostgreSQL, before the method runs: the rule wants a
        // certificate and the client sent none (one that does not chain to
        // tls.client_ca never gets this far: its handshake failed).
        let cert_rule = match (method, client_cert) {
            (AuthMethod::Cert, _) => "cert authentication",
            (_, Some(ClientCert::VerifyCa)) => "clientcert=verify-ca",
            _ => "clientcert=verify-full",
        };
        let cert_name = match client_cert {
            None => None,
            Some(_) => match client.peer_certificate() {
                None => {
                    return Err(AuthError::new(
                        sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                        "cert_missing",
                        "connection requires a valid client certificate",
                    )
                    .with_detail(format!(
                        "{cert_rule} (pg_hba.conf line {line}): the client sent no certificate"
                    )))
                }
                Some(der) => Some(
                    pgwarden_auth::subject_common_name(der)
                        .map(|name| name.map(<[u8]>::to_vec))
                        .map_err(|e| e.to_string()),
                ),
            },
        };
        let failed = || {
            AuthError::new(
                sqlstate::INVALID_PASSWORD,
                "bad_password",
                format!("password authentication failed for user \"{user}\""),
            )
        };
        // An answer of another type is a protocol violation, as
        // PostgreSQL says, not a wrong password.
        let no_answer = |e: NoAnswer| match e {
            NoAnswer::Gone => AuthError::gone(),
            NoAnswer::Other => protocol_violation("expected password response"),
        };
        let lookup = |e: String| {
            tracing::error!(error = %e, user = %user, "verifier lookup failed");
            AuthError::new(
                sqlstate::CONNECTION_FAILURE,
                "auth_query",
                "authentication is unavailable: the password verifier could not be looked up",
            )
        };
        let credential = match method {
            AuthMethod::Trust => Ok(Credential::None),
            AuthMethod::Reject => Err(AuthError::new(
                sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                "hba_reject",
                reject,
            )),
            // The certificate is the proof; its name is checked below.
            AuthMethod::Cert => Ok(Credential::None),
            // The kernel's word on who runs the client; as after trust,
            // pgwarden has nothing to show a server that asks.
            AuthMethod::Peer => match client.peer_os_user() {
                Ok(os_user) if os_user == user => Ok(Credential::None),
                found => {
                    let why = match found {
                        Ok(os_user) => format!("Provided user name ({user}) and authenticated user name ({os_user}) do not match."),
                        Err(e) => e,
                    };
                    tracing::info!(user = %user, line, "peer authentication failed: {why}");
                    Err(AuthError::new(
                        sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                        "peer_mismatch",
                        format!("Peer authentication failed for user \"{user}\""),
                    ))
                }
            },
            AuthMethod::Password => {
                let verifier = self
                    .verifier(shared, &user, primary_wait)
                    .await
                    .map_err(lookup)?;
                let mut out = BytesMut::new();
                encode::authentication_cleartext(&mut out);
                let reply = ask(client, &out).await.map_err(no_answer)?;
                let password = message::password_bytes(&reply)
                    .map_err(|_| bad_password_packet())?
                    .to_vec();
                // PBKDF2 with the verifier's iterations: milliseconds or
                // more, off the event loop that serves other clients.
                let ok = match verifier {
                    Some(v) => {
                        let (u, p) = (user.clone(), password.clone());
                        tokio::task::spawn_blocking(move || password_matches(&v, &u, &p))
                            .await
                            .unwrap_or(false)
                    }
                    None => false,
                };
                if ok {
                    Ok(Credential::Password(password))
                } else {
                    Err(failed())
                }
            }
            AuthMethod::Md5 | AuthMethod::ScramSha256 => {
                let verifier = self
                    .verifier(shared, &user, primary_wait)
                    .await
                    .map_err(lookup)?;
                // As in PostgreSQL, md5 with a SCRAM verifier runs SCRAM;
                // without a verifier (no such role, no password) the
                // server's password_encryption decides, so that the
                // exchange does not tell such a role from a real one.
                let md5 = method == AuthMethod::Md5
                    && match verifier.as_deref() {
                        Some(v) => pgwarden_auth::is_md5_secret(v),
                        None => self.md5_encryption(shared, primary_wait).await,
                    };
                if md5 && verifier.is_none() {
                    let salt: [u8; 4] = rand::random();
                    let mut out = BytesMut::new();
                    encode::authentication_md5(&mut out, salt);
                    let reply = ask(client, &out).await.map_err(no_answer)?;
                    message::password_message(&reply).map_err(|_| bad_password_packet())?;
                    Err(failed())
                } else if md5 {
                    let secret = verifier.expect("checked");
                    let salt: [u8; 4] = rand::random();
                    let mut out = BytesMut::new();
                    encode::authentication_md5(&mut out, salt);
                    let reply = ask(client, &out).await.map_err(no_answer)?;
                    let response =
                        message::password_message(&reply).map_err(|_| bad_password_packet())?;
                    if verify_md5(&secret, salt, response) {
                        Ok(Credential::Md5Secret(secret))
                    } else {
                        Err(failed())
                    }
                } else {
                    let secret = match verifier.as_deref().map(ScramSecret::parse) {
                        Some(Ok(secret)) => {
                            MOCK_ITERATIONS.store(secret.iterations, Ordering::Relaxed);
                            secret
                        }
                        _ => ScramSecret {
                            iterations: MOCK_ITERATIONS.load(Ordering::Relaxed),
                            ..ScramSecret::mock(&user, &self.mock_seed)
                        },
                    };
                    self.scram(client, &secret)
                        .await
                        .map_err(|e| scram_refusal(e, failed()))
                        .map(Credential::ClientKey)
                }
            }
        }?;
        // verify-full (and cert, which implies it): after the method
        // succeeded, the certificate must name the user. The client is told
        // what PostgreSQL tells it, which names the method, not the reason.
        if client_cert == Some(ClientCert::VerifyFull) {
            let name = cert_name.unwrap_or_else(|| Err("no client certificate".into()));
            if let Err(why) = check_cert_name(name, &user) {
                let refused = match method {
                    AuthMethod::Cert => AuthError::new(
                        sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                        "cert_name_mismatch",
                        format!("certificate authentication failed for user \"{user}\""),
                    ),
                    AuthMethod::Trust => AuthError::new(
                        sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                        "cert_name_mismatch",
                        format!("\"trust\" authentication failed for user \"{user}\""),
                    ),
                    _ => AuthError {
                        reason: "cert_name_mismatch",
                        ..failed()
                    },
                };
                return Err(
                    refused.with_detail(format!("{cert_rule} (pg_hba.conf line {line}): {why}"))
                );
            }
        }
        Ok(credential)
    }

    /// The SCRAM exchange with the client. Over TLS SCRAM-SHA-256-PLUS is
    /// offered too, bound to the certificate this connection's handshake
    /// presented, as PostgreSQL offers it. A SASL response that does not
    /// parse is [`ScramError::Malformed`].
    async fn scram(
        &self,
        client: &mut ClientStream,
        secret: &ScramSecret,
    ) -> Result<ClientKey, ScramFailure> {
        let mut server = ScramServer::new(secret, rand::random::<[u8; 18]>());
        if let Some(data) = client.tls_server_end_point() {
            server = server.with_channel_binding(data);
        }
        let mut out = BytesMut::new();
        encode::authentication_sasl(&mut out, server.mechanisms());
        let initial = ask(client, &out).await?;
        // A SASLInitialResponse that does not parse is a protocol
        // violation, as in PostgreSQL, not a wrong password.
        let (mech, data) = message::sasl_initial_response(&initial)
            .map_err(|e| ScramError::Malformed(e.to_string()))?;
        // No initial response: as PostgreSQL, an empty challenge, and the
        // client-first-message comes as a SASLResponse.
        let later;
        let data = match data {
            Some(d) => d,
            None => {
                if !server.mechanisms().contains(&mech) {
                    return Err(ScramError::InvalidMechanism.into());
                }
                let mut out = BytesMut::new();
                encode::authentication_sasl_continue(&mut out, b"");
                later = ask(client, &out).await?;
                &later[..]
            }
        };
        let first = server.initial_response(mech, data)?;
        let mut out = BytesMut::new();
        encode::authentication_sasl_continue(&mut out, &first);
        let fin = ask(client, &out).await?;
        let (server_final, key) = server.client_final(&fin)?;
        let mut out = BytesMut::new();
        encode::authentication_sasl_final(&mut out, &server_final);
        client
            .write_all(&out)
            .await
            .map_err(|_| ScramFailure::Answer(NoAnswer::Gone))?;
        Ok(key)
    }
}

/// Why a SCRAM exchange with the client did not succeed.
enum ScramFailure {
    /// The client gave no SASL response.
    Answer(NoAnswer),
    /// Its SASL messages were refused.
    Scram(ScramError),
}

impl From<NoAnswer> for ScramFailure {
    fn from(e: NoAnswer) -> Self {
        ScramFailure::Answer(e)
    }
}

impl From<ScramError> for ScramFailure {
    fn from(e: ScramError) -> Self {
        ScramFailure::Scram(e)
    }
}

/// What the client is told when its SCRAM exchange fails, with PostgreSQL's
/// codes: a wrong proof (or an answer of another type) is `failed`, the
/// password failure; a client that went away is [`AuthError::gone`]; a binding to another certificate, or `y` although
/// PLUS was offered, refuses the connection (28000); an authorization
/// identity or a mandatory extension is a feature not supported (0A000);
/// anything else is a protocol violation (08P01).
fn scram_refusal(e: ScramFailure, failed: AuthError) -> AuthError {
    const MISMATCH: &str = "the client bound SCRAM to another certificate than the one \
        pgwarden presented: its TLS may have been intercepted";
    const NEGOTIATION: &str = "the client supports SCRAM channel binding but thinks the \
        server does not, although SCRAM-SHA-256-PLUS was offered: the offer may have been \
        removed on the way";
    let e = match e {
        ScramFailure::Answer(NoAnswer::Gone) => return AuthError::gone(),
        ScramFailure::Answer(NoAnswer::Other) => {
            return protocol_violation("expected SASL response")
        }
        ScramFailure::Scram(e) => e,
    };
    match e {
        ScramError::InvalidProof => failed,
        e @ (ScramError::ChannelBindingMismatch | ScramError::ChannelBindingNegotiation) => {
            let detail = match e {
                ScramError::ChannelBindingMismatch => MISMATCH,
                _ => NEGOTIATION,
            };
            AuthError::new(
                sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                "channel_binding",
                e.to_string(),
            )
            .with_detail(detail)
        }
        // As PostgreSQL: an authorization identity or a mandatory
        // extension is a feature it lacks, an unknown binding type a
        // protocol violation.
        e @ ScramError::Unsupported("authorization identity" | "mandatory extension") => {
            AuthError::new(sqlstate::FEATURE_NOT_SUPPORTED, "protocol", e.to_string())
        }
        e => AuthError::new(sqlstate::PROTOCOL_VIOLATION, "protocol", e.to_string()),
    }
}

/// The address of the primary the topology knows, if any.
fn primary_addr(shared: &Shared) -> Option<pgwarden_topology::HostAddr> {
    let snap = shared.snapshot.load_full();
    snap.topology
        .primary()
        .map(|i| snap.topology.hosts()[i].config.addr.clone())
}

/// Refuses an hba file with a rule that needs a client certificate when
/// no CA to verify one is configured, naming the first such rule: without
/// `tls.client_ca` no client is even asked for a certificate.
fn check_no_client_certs(hba: &Hba, origin: &Path) -> Result<(), String> {
    let Some(rule) = hba.rules().iter().find(|r| r.client_cert.is_some()) else {
        return Ok(());
    };
    let what = match (rule.method, rule.client_cert) {
        (AuthMethod::Cert, _) => "\"cert\" authentication",
        (_, Some(ClientCert::VerifyCa)) => "clientcert=verify-ca",
        _ => "clientcert=verify-full",
    };
    Err(format!(
        "{}:{}: tls.client_ca: {what} needs the CA certificates that client certificates must chain to; set tls.client_ca",
        origin.display(),
        rule.line
    ))
}

/// Whether the certificate's common name (see
/// [`pgwarden_auth::subject_common_name`]) is the user name, byte for byte
/// as in PostgreSQL; the error says why not, for the log.
fn check_cert_name(name: Result<Option<Vec<u8>>, String>, user: &str) -> Result<(), String> {
    match name? {
        None => Err("the certificate's subject has no common name (CN)".into()),
        Some(cn) if cn.is_empty() => Err("the certificate's common name (CN) is empty".into()),
        Some(cn) if cn.contains(&0) => {
            Err("the certificate's common name (CN) contains a NUL byte".into())
        }
        Some(cn) if cn == user.as_bytes() => Ok(()),
        Some(cn) => Err(format!(
            "the certificate's common name {:?} is not the user name {user:?}",
            String::from_utf8_lossy(&cn)
        )),
    }
}

/// Whether a cleartext password matches a verifier of either kind.
fn password_matches(verifier: &str, user: &str, password: &[u8]) -> bool {
    if pgwarden_auth::is_md5_secret(verifier) {
        let mine = md5_secret(user, password);
        return subtle_eq(mine.as_bytes(), verifier.as_bytes());
    }
    match ScramSecret::parse(verifier) {
        Ok(s) => match ScramSecret::from_password(password, &s.salt, s.iterations) {
            Ok(p) => {
                subtle_eq(&p.stored_key, &s.stored_key) & subtle_eq(&p.server_key, &s.server_key)
            }
            Err(_) => false,
        },
        Err(_) => false,
    }
}

/// A tokio-postgres error with what the server said (its `Display` is
/// only "db error" for a server's ErrorResponse): the reason an operator
/// needs, a wrong password or a missing function.
fn pg_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({}): {}", db.message(), db.code().code(), e),
        None => match std::error::Error::source(e) {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        },
    }
}

/// This machine's interface addresses with their network prefix lengths,
/// for `samehost` and `samenet`, read when a login needs them (interfaces
/// come and go).
fn local_addrs() -> Vec<(std::net::IpAddr, u8)> {
    let Ok(ifaces) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    ifaces
        .filter_map(|i| {
            let addr = i.address?;
            let mask = i.netmask;
            if let (Some(a), m) = (
                addr.as_sockaddr_in(),
                mask.as_ref().and_then(|m| m.as_sockaddr_in()),
            ) {
                let prefix = m.map_or(32, |m| u32::from(m.ip()).count_ones() as u8);
                return Some((std::net::IpAddr::V4(a.ip()), prefix));
            }
            if let (Some(a), m) = (
                addr.as_sockaddr_in6(),
                mask.as_ref().and_then(|m| m.as_sockaddr_in6()),
            ) {
                let prefix = m.map_or(128, |m| u128::from(m.ip()).count_ones() as u8);
                return Some((std::net::IpAddr::V6(a.ip()), prefix));
            }
            None
        })
        .collect()
}

/// Constant-time comparison (length is not secret).
fn subtle_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Sends an authentication request and returns the body of the client's
/// PasswordMessage-type reply (`p`); `None` if the client answers with
/// anything else or goes away.
pub(crate) async fn exchange(client: &mut ClientStream, request: &[u8]) -> Option<BytesMut> {
    ask(client, request).await.ok()
}

/// Why a client did not answer an authentication request.
pub(crate) enum NoAnswer {
    /// It closed the connection, or the socket failed.
    Gone,
    /// It sent a message of another type, or one too large.
    Other,
}

/// The client answered an authentication request with another message
/// (or one too large): PostgreSQL's 08P01, counted as `protocol`.
/// A password message that is not one NUL-terminated string, refused as
/// PostgreSQL refuses it: malformed, not a wrong password.
fn bad_password_packet() -> AuthError {
    AuthError::new(
        sqlstate::PROTOCOL_VIOLATION,
        "protocol",
        "invalid password packet size",
    )
}

fn protocol_violation(expected: &str) -> AuthError {
    AuthError::new(
        sqlstate::PROTOCOL_VIOLATION,
        "protocol",
        format!("{expected}, got another message"),
    )
}

/// [`exchange`], saying why there is no answer.
async fn ask(client: &mut ClientStream, request: &[u8]) -> Result<BytesMut, NoAnswer> {
    client
        .write_all(request)
        .await
        .map_err(|_| NoAnswer::Gone)?;
    let mut buf = BytesMut::with_capacity(512);
    loop {
        match message::split_message(&mut buf, 64 * 1024) {
            Ok(Some((frontend::PASSWORD_MESSAGE, mut m))) => {
                m.advance(5);
                return Ok(m);
            }
            Ok(Some(_)) | Err(_) => return Err(NoAnswer::Other),
            Ok(None) => {}
        }
        match client.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return Err(NoAnswer::Gone),
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names come from clients before they authenticate: the cache stays
    /// within its cap whatever they send, keeping known roles longest, and
    /// keeps values whole (a role name may hold a newline).
    #[test]
    fn lookup_caches_are_bounded() {
        let ttl = Duration::from_secs(60);
        let mut c: Cache<Option<String>> = Cache::new();
        c.insert("alice", Some("v".into()), ttl, Option::is_some);
        for i in 0..(CACHE_MAX * 3) {
            c.insert(&format!("nobody{i}"), None, ttl, Option::is_some);
            assert!(c.entries.len() <= CACHE_MAX);
        }
        assert_eq!(
            c.get("alice", ttl),
            Some(Some("v".into())),
            "a known role stays"
        );
        let mut roles: Cache<Vec<String>> = Cache::new();
        roles.insert("x", vec!["x".into(), "a\nb".into()], ttl, |r| !r.is_empty());
        assert_eq!(
            roles.get("x", ttl),
            Some(vec!["x".to_string(), "a\nb".to_string()])
        );
        assert_eq!(roles.get("x", Duration::ZERO), None, "expired");
        assert_eq!(mock_seed(), mock_seed(), "one seed per process");
    }

    fn hba(text: &str) -> Hba {
        Hba::parse(text, Path::new("conf/pg_hba.conf"), &|_| {
            Err(std::io::ErrorKind::NotFound.into())
        })
        .unwrap()
    }

    #[test]
    fn rules_needing_a_certificate_need_a_ca() {
        let origin = Path::new("conf/pg_hba.conf");
        let plain = hba("host all all all scram-sha-256\nhostssl all all all md5\n");
        assert_eq!(check_no_client_certs(&plain, origin), Ok(()));
        let cert = hba("# comment\nhost all postgres all trust\nhostssl all all all cert\n");
        assert_eq!(
            check_no_client_certs(&cert, origin),
            Err("conf/pg_hba.conf:3: tls.client_ca: \"cert\" authentication needs the CA certificates that client certificates must chain to; set tls.client_ca".into())
        );
        let full = hba("hostssl all all all scram-sha-256 clientcert=verify-full\n");
        let err = check_no_client_certs(&full, origin).unwrap_err();
        assert!(
            err.starts_with("conf/pg_hba.conf:1: tls.client_ca: clientcert=verify-full needs"),
            "{err}"
        );
        let ca = hba("host all all all md5\nhostssl all all all trust clientcert=verify-ca\n");
        let err = check_no_client_certs(&ca, origin).unwrap_err();
        assert!(
            err.starts_with("conf/pg_hba.conf:2: tls.client_ca: clientcert=verify-ca needs"),
            "{err}"
        );
    }

    #[test]
    fn certificate_names_compare_byte_for_byte() {
        let name = |n: &[u8]| Ok(Some(n.to_vec()));
        assert_eq!(check_cert_name(name(b"alice"), "alice"), Ok(()));
        assert_eq!(check_cert_name(name("zoë".as_bytes()), "zoë"), Ok(()));
        // No case folding, no trimming, as in PostgreSQL without a map.
        assert!(check_cert_name(name(b"Alice"), "alice").is_err());
        assert!(check_cert_name(name(b"alice "), "alice").is_err());
        let err = check_cert_name(name(b"bob"), "alice").unwrap_err();
        assert!(
            err.contains("\"bob\"") && err.contains("\"alice\""),
            "{err}"
        );
        assert!(check_cert_name(name(b"alice\0x"), "alice").is_err());
        assert!(check_cert_name(name(b""), "").is_err());
        assert!(check_cert_name(Ok(None), "alice").is_err());
        assert!(check_cert_name(Err("malformed".into()), "alice").is_err());
        // A BMPString name keeps its NUL bytes and names nobody.
        assert!(check_cert_name(name(&[0, b'a']), "\0a").is_err());
    }
}
