//! Client certificates towards pgwarden (`tls.client_ca`, the `cert` method,
//! `clientcert=`), with certificates made at test time, real PostgreSQL,
//! psql and psycopg, and a Rust client where the exact SQLSTATE matters
//! (libpq does not print it for a refused connection).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{proxy_full, sql, until, AUTH};
use pgwarden_proxy::{ClientTlsMode, PoolSettings, TlsSpec};
use pgwarden_testkit::{eventually, free_port, TestCluster};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

const WAIT: Duration = Duration::from_secs(30);

/// A certificate and its private key, as PEM files.
type KeyCert = (PathBuf, PathBuf);

/// A test CA, writing what it signs as PEM files into one directory.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
    /// The CA certificate: what `tls.client_ca` and `sslrootcert` name.
    pem: PathBuf,
}

impl Ca {
    /// A CA whose certificate is written to `{name}-ca.pem`.
    fn new(dir: &Path, name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("pgwarden test CA {name}"));
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let pem = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&pem, issuer.pem()).unwrap();
        Ca {
            issuer,
            dir: dir.to_path_buf(),
            pem,
        }
    }

    /// A certificate for pgwarden's listeners (localhost, 127.0.0.1).
    fn server(&self, file: &str) -> KeyCert {
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        self.sign(CertificateParams::new(names).unwrap(), file)
    }

    /// A client certificate with subject `O=pgwarden tests`, then `CN=cn`
    /// when there is one.
    fn client(&self, cn: Option<&str>, file: &str) -> KeyCert {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::OrganizationName, "pgwarden tests");
        if let Some(cn) = cn {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params, file)
    }

    fn sign(&self, params: CertificateParams, file: &str) -> KeyCert {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let paths = (
            self.dir.join(format!("{file}.crt")),
            self.dir.join(format!("{file}.key")),
        );
        std::fs::write(&paths.0, cert.pem()).unwrap();
        std::fs::write(&paths.1, key.serialize_pem()).unwrap();
        // libpq refuses a private key that others may read.
        std::fs::set_permissions(&paths.1, std::fs::Permissions::from_mode(0o600)).unwrap();
        paths
    }
}

/// A libpq connection string over TLS that verifies pgwarden's certificate
/// against `ca` and presents `cert` if given.
fn conninfo(port: u16, user: &str, ca: &Path, cert: Option<&KeyCert>) -> String {
    let mut s = format!(
        "host=localhost hostaddr=127.0.0.1 port={port} user={user} dbname=postgres sslmode=verify-full sslrootcert={}",
        ca.display()
    );
    if let Some((crt, key)) = cert {
        s.push_str(&format!(
            " sslcert={} sslkey={}",
            crt.display(),
            key.display()
        ));
    }
    s
}

/// Runs `command` with psql: (success, stdout and stderr). `home` is an
/// empty directory, so that no `~/.postgresql` certificate joins in.
async fn psql(conninfo: String, command: &str, home: &Path) -> (bool, String) {
    let (command, home) = (command.to_string(), home.to_path_buf());
    tokio::task::spawn_blocking(move || {
        let out = Command::new("psql")
            .args(["-X", "-At", "-c", &command, &conninfo])
            .env("HOME", &home)
            .env("PGCONNECT_TIMEOUT", "10")
            .output()
            .expect("psql");
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    })
    .await
    .unwrap()
}

/// One login with psycopg 3: "ok <user> <TLS in use>" or "error <message>".
async fn psycopg(conninfo: String, home: &Path) -> String {
    let home = home.to_path_buf();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/psycopg_cert.py");
    tokio::task::spawn_blocking(move || {
        let out = Command::new("python3")
            .arg(script)
            .arg(&conninfo)
            .env("HOME", &home)
            .env("PGCONNECT_TIMEOUT", "10")
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "psycopg script failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    })
    .await
    .unwrap()
}

/// Logs in over TLS with tokio-postgres, presenting `cert` if given; on a
/// refusal, the SQLSTATE (none for a failed handshake) and the message.
async fn rust_login(
    port: u16,
    user: &str,
    password: Option<&str>,
    ca: &Path,
    cert: Option<&KeyCert>,
) -> Result<tokio_postgres::Client, (Option<String>, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    // SSLRequest.
    tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .unwrap();
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer[0], b'S', "pgwarden offers TLS");
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match cert {
        None => builder.with_no_client_auth(),
        Some((crt, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_file_iter(crt)
                    .unwrap()
                    .map(Result::unwrap)
                    .collect(),
                PrivateKeyDer::from_pem_file(key).unwrap(),
            )
            .unwrap(),
    };
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| (None, format!("TLS handshake: {e}")))?;
    let mut cfg = tokio_postgres::Config::new();
    cfg.user(user)
        .dbname("postgres")
        .ssl_mode(tokio_postgres::config::SslMode::Disable);
    if let Some(p) = password {
        cfg.password(p);
    }
    let (client, conn) = cfg
        .connect_raw(tls, tokio_postgres::NoTls)
        .await
        .map_err(|e| {
            (
                common::sqlstate(&e),
                e.as_db_error()
                    .map_or_else(|| e.to_string(), |d| d.message().to_string()),
            )
        })?;
    tokio::spawn(conn);
    Ok(client)
}

/// The roles of these tests, and the servers' pg_hba.conf: they trust
/// pgwarden's address for the roles that log in with a certificate (a
/// certificate proves nothing pgwarden could pass on to them), and want
/// passwords from everyone else. Returns once the new rules are in force.
async fn cluster() -> TestCluster {
    let mut c = TestCluster::builder().replicas(0).start();
    sql(
        &c.conninfo(0),
        "CREATE ROLE alice LOGIN; \
         CREATE ROLE bob LOGIN PASSWORD 'bob-secret'; \
         CREATE ROLE carol LOGIN PASSWORD 'carol-secret'; \
         CREATE ROLE dave LOGIN PASSWORD 'dave-secret'; \
         CREATE ROLE erin LOGIN PASSWORD 'erin-secret'; \
         CREATE ROLE frank LOGIN",
    )
    .await;
    c.set_hba(
        0,
        "host all postgres 127.0.0.1/32 trust\n\
         host all alice,frank 127.0.0.1/32 trust\n\
         host all all 127.0.0.1/32 scram-sha-256\n",
    );
    let direct = format!(
        "host=127.0.0.1 port={} user=dave dbname=postgres",
        c.port(0)
    );
    eventually("the servers' pg_hba.conf in force", WAIT, || {
        let direct = direct.clone();
        async move {
            match common::client(&direct).await {
                Ok(_) => Err("dave still gets in without a password".to_string()),
                Err(_) => Ok(()),
            }
        }
    })
    .await;
    c
}

/// pgwarden's own rules.
const HBA: &str = "# pgwarden's rules\n\
    hostssl all alice 127.0.0.1/32 cert\n\
    hostssl all bob 127.0.0.1/32 cert\n\
    hostssl all carol 127.0.0.1/32 scram-sha-256 clientcert=verify-full\n\
    hostssl all erin 127.0.0.1/32 scram-sha-256 clientcert=verify-ca\n\
    hostssl all frank 127.0.0.1/32 trust clientcert=verify-full\n\
    host all postgres 127.0.0.1/32 trust\n\
    host all all 127.0.0.1/32 scram-sha-256\n";

/// `pgwarden run` with its log in a file; killed when dropped.
struct Running {
    child: Child,
    log: PathBuf,
}

impl Running {
    fn start(config: &Path, dir: &Path) -> Running {
        let log = dir.join("pgwarden.log");
        let child = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
            .args(["run", "--config"])
            .arg(config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start pgwarden run");
        Running { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of one sample of `/metrics`, 0 when absent.
fn metric(body: &str, sample: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
        .unwrap_or(0)
}

/// The configuration file of the `pgwarden run` test, with `client_ca`.
fn run_config(c: &TestCluster, ports: (u16, u16, u16), client_ca: &str) -> String {
    let (rw, ro, http) = ports;
    format!(
        "[cluster]\nhosts = [\"{}\"]\n\n\
         [listen]\nread_write = \"127.0.0.1:{rw}\"\nread_only = \"127.0.0.1:{ro}\"\nhttp = \"127.0.0.1:{http}\"\n\n\
         [tls]\ncert = \"server.crt\"\nkey = \"server.key\"\nclient_ca = \"{client_ca}\"\n\n\
         [auth]\nhba_file = \"pg_hba.conf\"\nauth_user = \"postgres\"\n",
        c.addr(0)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_logins_with_psql_and_psycopg_and_a_ca_reload() {
    let c = cluster().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let home = d.join("home");
    std::fs::create_dir(&home).unwrap();
    // One CA signs pgwarden's certificate and the clients'; another one
    // signs certificates pgwarden trusts only after a reload.
    let main = Ca::new(d, "clients");
    let other = Ca::new(d, "other");
    main.server("server");
    let alice = main.client(Some("alice"), "alice");
    let bob = main.client(Some("bob"), "bob");
    let carol = main.client(Some("carol"), "carol");
    let alice_other = other.client(Some("alice"), "alice-other");
    std::fs::write(d.join("pg_hba.conf"), HBA).unwrap();
    let (rw, ro, http) = (free_port(), free_port(), free_port());
    let config = d.join("pgwarden.toml");
    std::fs::write(&config, run_config(&c, (rw, ro, http), "clients-ca.pem")).unwrap();
    let pg = Running::start(&config, d);
    let ca = main.pem.clone();
    let ci = |port: u16, user: &str, cert: Option<&KeyCert>| conninfo(port, user, &ca, cert);

    // CN=alice logs in as alice.
    eventually("alice logs in with her certificate", WAIT, || {
        let (ci, home) = (ci(rw, "alice", Some(&alice)), home.clone());
        async move {
            match psql(ci, "SELECT current_user", &home).await {
                (true, out) if out.trim() == "alice" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    // The read-only port stays read-only for her.
    let (ok, out) = psql(
        ci(ro, "alice", Some(&alice)),
        "SHOW transaction_read_only",
        &home,
    )
    .await;
    assert!(ok && out.trim() == "on", "{out}");
    let (ok, out) = psql(
        ci(ro, "alice", Some(&alice)),
        "CREATE TABLE written_by_alice ()",
        &home,
    )
    .await;
    assert!(!ok && out.contains("read-only"), "{out}");

    // Bob's certificate does not make anyone alice.
    let (ok, out) = psql(ci(rw, "alice", Some(&bob)), "SELECT 1", &home).await;
    assert!(!ok, "{out}");
    assert!(
        out.contains("FATAL:  certificate authentication failed for user \"alice\""),
        "{out}"
    );
    // A cert rule without a certificate.
    let (ok, out) = psql(ci(rw, "alice", None), "SELECT 1", &home).await;
    assert!(!ok, "{out}");
    assert!(
        out.contains("FATAL:  connection requires a valid client certificate"),
        "{out}"
    );
    // A certificate from a CA pgwarden does not trust: the handshake fails.
    let (ok, out) = psql(ci(rw, "alice", Some(&alice_other)), "SELECT 1", &home).await;
    assert!(!ok, "{out}");
    assert!(
        out.contains("alert unknown ca") && !out.contains("FATAL"),
        "refused before authentication: {out}"
    );

    // Clients without a certificate still use the other rules over TLS.
    let dave = format!("{} password=dave-secret", ci(rw, "dave", None));
    let (ok, out) = psql(dave, "SELECT current_user", &home).await;
    assert!(ok && out.trim() == "dave", "{out}");
    // clientcert=verify-full: certificate and password, and the name must
    // be the user's; a mismatch reads like a wrong password, as in
    // PostgreSQL.
    let carol_pw = |cert| format!("{} password=carol-secret", ci(rw, "carol", cert));
    let (ok, out) = psql(carol_pw(Some(&carol)), "SELECT current_user", &home).await;
    assert!(ok && out.trim() == "carol", "{out}");
    let (ok, out) = psql(carol_pw(Some(&alice)), "SELECT 1", &home).await;
    assert!(!ok, "{out}");
    assert!(
        out.contains("FATAL:  password authentication failed for user \"carol\""),
        "{out}"
    );
    let (ok, out) = psql(carol_pw(None), "SELECT 1", &home).await;
    assert!(
        !ok && out.contains("connection requires a valid client certificate"),
        "{out}"
    );
    // clientcert=verify-ca: any certificate of the CA, with the password.
    let erin = format!("{} password=erin-secret", ci(rw, "erin", Some(&bob)));
    let (ok, out) = psql(erin, "SELECT current_user", &home).await;
    assert!(ok && out.trim() == "erin", "{out}");
    // Bob's certificate convinces pgwarden, but the servers do not trust
    // pgwarden for bob and it has no password to give them.
    let (ok, out) = psql(ci(rw, "bob", Some(&bob)), "SELECT 1", &home).await;
    assert!(
        !ok && out.contains("pgwarden has no credential for role \"bob\""),
        "{out}"
    );

    // psycopg, through the same libpq options.
    assert_eq!(
        psycopg(ci(rw, "alice", Some(&alice)), &home).await,
        "ok alice True"
    );
    let refused = psycopg(ci(rw, "alice", Some(&bob)), &home).await;
    assert!(
        refused.starts_with("error ")
            && refused.contains("certificate authentication failed for user \"alice\""),
        "{refused}"
    );

    // Each refusal is counted by its reason and logged with the real one.
    let http_addr: std::net::SocketAddr = format!("127.0.0.1:{http}").parse().unwrap();
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http_addr, "/metrics"))
        .await
        .unwrap();
    let failures = |reason: &str| {
        metric(
            &body,
            &format!("pgwarden_auth_failures_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(failures("cert_name_mismatch"), 3, "{body}");
    assert_eq!(failures("cert_missing"), 2, "{body}");
    assert_eq!(failures("cert_invalid"), 1, "{body}");
    // A failed login counts as a connection error of its service too, the
    // certificate refused in the handshake included.
    for reason in ["cert_name_mismatch", "cert_missing", "cert_invalid"] {
        let errors = metric(
            &body,
            &format!(
                "pgwarden_connection_errors_total{{service=\"read_write\",reason=\"{reason}\"}}"
            ),
        );
        assert_eq!(errors, failures(reason), "{reason}: {body}");
    }
    let log = pg.log();
    assert!(
        log.contains(r#"the certificate's common name \"bob\" is not the user name \"alice\""#),
        "{log}"
    );
    assert!(
        log.contains("cert authentication (pg_hba.conf line 2): the client sent no certificate"),
        "{log}"
    );
    assert!(log.contains("client certificate refused"), "{log}");

    // SIGHUP with another client_ca: new handshakes use it.
    std::fs::write(&config, run_config(&c, (rw, ro, http), "other-ca.pem")).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pg.child.id() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
    eventually("a certificate of the new CA is accepted", WAIT, || {
        let (ci, home) = (ci(rw, "alice", Some(&alice_other)), home.clone());
        async move {
            match psql(ci, "SELECT current_user", &home).await {
                (true, out) if out.trim() == "alice" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let (ok, out) = psql(ci(rw, "alice", Some(&alice)), "SELECT 1", &home).await;
    assert!(
        !ok && out.contains("alert unknown ca"),
        "the old CA still trusted: {out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlstates_and_transaction_pooling() {
    let c = cluster().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let main = Ca::new(d, "clients");
    let other = Ca::new(d, "other");
    let (server_crt, server_key) = main.server("server");
    let alice = main.client(Some("alice"), "alice");
    let bob = main.client(Some("bob"), "bob");
    let carol = main.client(Some("carol"), "carol");
    let nameless = main.client(None, "nameless");
    let alice_other = other.client(Some("alice"), "alice-other");
    common::authenticate_with(d.join("pg_hba.conf"), HBA);
    let tls = TlsSpec {
        cert: server_crt,
        key: server_key,
        mode: ClientTlsMode::Allow,
        client_ca: Some(main.pem.clone()),
    };
    let pool = PoolSettings {
        size: 2,
        ..PoolSettings::default()
    };
    let (e, p) = proxy_full(
        &c.addrs(),
        Duration::from_secs(3),
        Some(pool),
        1000,
        Default::default(),
        Some(tls),
    )
    .await;
    AUTH.with(|a| *a.borrow_mut() = None);
    until(&e, "primary", WAIT, |s| {
        s.topology.primary().map(|_| ()).ok_or("none".into())
    })
    .await;
    let rw = p.service_addrs()["read_write"].port();
    let ro = p.service_addrs()["read_only"].port();
    let ca = main.pem.clone();

    // Pooled server connections log in as alice with no credential, which
    // the servers accept from pgwarden's address.
    for _ in 0..3 {
        let client = rust_login(rw, "alice", None, &ca, Some(&alice))
            .await
            .unwrap();
        assert_eq!(common::one(&client, "SELECT current_user").await, "alice");
    }
    let client = rust_login(ro, "alice", None, &ca, Some(&alice))
        .await
        .unwrap();
    assert_eq!(
        common::one(&client, "SHOW transaction_read_only").await,
        "on"
    );
    let err = client
        .simple_query("CREATE TABLE written_by_alice ()")
        .await
        .unwrap_err();
    assert_eq!(common::sqlstate(&err).as_deref(), Some("25006"), "{err}");

    let refused = |r: Result<tokio_postgres::Client, (Option<String>, String)>| match r {
        Ok(_) => panic!("logged in"),
        Err(e) => e,
    };
    let wrong = refused(rust_login(rw, "alice", None, &ca, Some(&bob)).await);
    assert_eq!(
        wrong,
        (
            Some("28000".into()),
            "certificate authentication failed for user \"alice\"".into()
        )
    );
    let nameless = refused(rust_login(rw, "alice", None, &ca, Some(&nameless)).await);
    assert_eq!(
        nameless,
        (
            Some("28000".into()),
            "certificate authentication failed for user \"alice\"".into()
        )
    );
    let missing = refused(rust_login(rw, "alice", None, &ca, None).await);
    assert_eq!(
        missing,
        (
            Some("28000".into()),
            "connection requires a valid client certificate".into()
        )
    );
    let mismatch = refused(rust_login(rw, "carol", Some("carol-secret"), &ca, Some(&alice)).await);
    assert_eq!(
        mismatch,
        (
            Some("28P01".into()),
            "password authentication failed for user \"carol\"".into()
        )
    );
    let trusted = refused(rust_login(rw, "frank", None, &ca, Some(&alice)).await);
    assert_eq!(
        trusted,
        (
            Some("28000".into()),
            "\"trust\" authentication failed for user \"frank\"".into()
        )
    );
    // bob proves himself with his certificate, but the servers want a
    // password from him, which pgwarden does not have: a refused login,
    // at once, not a wait for a server until query_wait_timeout.
    let no_credential = tokio::time::timeout(
        Duration::from_secs(10),
        rust_login(rw, "bob", None, &ca, Some(&bob)),
    )
    .await
    .expect("refused at once");
    let (code, message) = refused(no_credential);
    assert_eq!(code.as_deref(), Some("08006"), "{message}");
    assert!(
        message.contains("pgwarden has no credential for role \"bob\""),
        "{message}"
    );
    let foreign = refused(rust_login(rw, "alice", None, &ca, Some(&alice_other)).await);
    assert_eq!(foreign.0, None, "refused in the handshake: {foreign:?}");
    let client = rust_login(rw, "carol", Some("carol-secret"), &ca, Some(&carol))
        .await
        .unwrap();
    assert_eq!(common::one(&client, "SELECT current_user").await, "carol");
}

#[test]
fn a_cert_rule_without_client_ca_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let hba = dir.path().join("pg_hba.conf");
    std::fs::write(
        &hba,
        "host all postgres 127.0.0.1/32 trust\n\n\
         hostssl all alice 127.0.0.1/32 cert\n",
    )
    .unwrap();
    let config = dir.path().join("pgwarden.toml");
    std::fs::write(
        &config,
        format!(
            "[cluster]\nhosts = [\"127.0.0.1:{}\"]\n\n[listen]\nread_write = \"127.0.0.1:{}\"\nread_only = \"127.0.0.1:{}\"\nhttp = \"127.0.0.1:{}\"\n\n[auth]\nhba_file = \"pg_hba.conf\"\nauth_user = \"postgres\"\n",
            free_port(),
            free_port(),
            free_port(),
            free_port()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["run", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "{}:3: tls.client_ca: \"cert\" authentication needs",
            hba.display()
        )),
        "{err}"
    );
}
