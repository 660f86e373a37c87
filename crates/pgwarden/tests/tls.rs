//! TLS termination towards clients, with certificates made at test time,
//! and SCRAM channel binding to them.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{proxy_full, until};
use pgwarden_proxy::{ClientTlsMode, TlsSpec};
use pgwarden_testkit::TestCluster;

const WAIT: Duration = Duration::from_secs(30);

/// A CA and a server certificate for 127.0.0.1/localhost signed by it,
/// with ECDSA P-256 keys and SHA-256 signatures.
fn make_certs(
    dir: &Path,
    tag: &str,
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    make_certs_signed_with(dir, tag, &rcgen::PKCS_ECDSA_P256_SHA256)
}

fn psql(conninfo: &str, command: &str) -> (bool, String) {
    let out = Command::new("psql")
        .args(["-X", "-At", "-c", command, conninfo])
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
}

async fn tls_proxy(
    c: &TestCluster,
    cert: &Path,
    key: &Path,
    mode: ClientTlsMode,
) -> (pgwarden_probe::Engine, pgwarden_proxy::Proxy) {
    tls_proxy_pooled(c, cert, key, mode, None).await
}

/// [`tls_proxy`], with transaction pooling when `pool` is given.
async fn tls_proxy_pooled(
    c: &TestCluster,
    cert: &Path,
    key: &Path,
    mode: ClientTlsMode,
    pool: Option<pgwarden_proxy::PoolSettings>,
) -> (pgwarden_probe::Engine, pgwarden_proxy::Proxy) {
    let spec = TlsSpec {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        mode,
        client_ca: None,
    };
    let (e, p) = proxy_full(
        &c.addrs(),
        Duration::from_secs(3),
        pool,
        1000,
        Default::default(),
        Some(spec),
    )
    .await;
    until(&e, "primary", WAIT, |s| {
        s.topology.primary().map(|_| ()).ok_or("none".into())
    })
    .await;
    (e, p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_allow_serves_verify_full_and_plaintext_clients() {
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_certs(dir.path(), "a");
    let (_e, p) = tls_proxy(&c, &cert, &key, ClientTlsMode::Allow).await;
    let port = p.service_addrs()["read_write"].port();
    let ca = ca.display().to_string();
    let r = tokio::task::spawn_blocking(move || {
        let verify = format!("host=localhost hostaddr=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=verify-full sslrootcert={ca}");
        let plain = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=disable");
        (psql(&verify, "\\conninfo"), psql(&verify, "SELECT 40 + 2"), psql(&plain, "SELECT 1"))
    })
    .await
    .unwrap();
    let ((ok1, info), (ok2, answer), (ok3, plain)) = r;
    assert!(ok1 && info.contains("SSL connection"), "{info}");
    assert!(
        info.contains("TLSv1.3") || info.contains("TLSv1.2"),
        "{info}"
    );
    assert!(ok2 && answer.trim() == "42", "{answer}");
    assert!(
        ok3 && plain.trim() == "1",
        "allow also serves plaintext: {plain}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_require_refuses_plaintext_before_authentication() {
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (_, cert, key) = make_certs(dir.path(), "b");
    let (_e, p) = tls_proxy(&c, &cert, &key, ClientTlsMode::Require).await;
    let port = p.service_addrs()["read_write"].port();
    let (ok, out) = tokio::task::spawn_blocking(move || {
        psql(
            &format!("host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=disable"),
            "SELECT 1",
        )
    })
    .await
    .unwrap();
    assert!(!ok, "plaintext accepted: {out}");
    assert!(out.contains("SSL connection is required"), "{out}");
    let (ok, out) = tokio::task::spawn_blocking(move || {
        psql(
            &format!("host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=require"),
            "SELECT 1",
        )
    })
    .await
    .unwrap();
    assert!(ok && out.trim() == "1", "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_rejected_by_the_client_and_reload_swaps_certificates() {
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (ca_a, cert_a, key_a) = make_certs(dir.path(), "a");
    let (ca_b, cert_b, key_b) = make_certs(dir.path(), "b");
    let (_e, mut p) = tls_proxy(&c, &cert_a, &key_a, ClientTlsMode::Allow).await;
    let port = p.service_addrs()["read_write"].port();
    let try_ca = |ca: &Path| {
        let ci = format!(
            "host=localhost hostaddr=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=verify-full sslrootcert={}",
            ca.display()
        );
        psql(&ci, "SELECT 1").0
    };
    assert!(try_ca(&ca_a));
    assert!(
        !try_ca(&ca_b),
        "a certificate from another CA must not verify"
    );
    // A reload with new files: new sessions get the new certificate.
    let held = common::client(&format!(
        "host=127.0.0.1 port={port} user=postgres dbname=postgres"
    ))
    .await
    .unwrap();
    let mut spec = tls_spec_for(&p, &c);
    spec.tls = Some(TlsSpec {
        cert: cert_b.clone(),
        key: key_b.clone(),
        mode: ClientTlsMode::Allow,
        client_ca: None,
    });
    p.apply(spec).await.unwrap();
    assert!(try_ca(&ca_b));
    assert!(!try_ca(&ca_a));
    held.simple_query("SELECT 1")
        .await
        .expect("sessions survive a certificate reload");
}

/// The spec the test proxy runs with, to modify and re-apply.
fn tls_spec_for(p: &pgwarden_proxy::Proxy, c: &TestCluster) -> pgwarden_proxy::ProxySpec {
    let _ = c;
    p.spec().clone()
}

/// Sessions are ended by shutting the read side of the client's socket;
/// under TLS that shows as an unexpected end of the TLS stream, and the
/// client must still get pgwarden's reason, in session and transaction mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_sessions_told_to_end_get_the_reason() {
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (_ca, cert, key) = make_certs(dir.path(), "a");
    for pool in [None, Some(pgwarden_proxy::PoolSettings::default())] {
        let (_e, p) = tls_proxy_pooled(&c, &cert, &key, ClientTlsMode::Require, pool.clone()).await;
        let port = p.service_addrs()["read_write"].port();
        // A statement of its own per round: the previous round's backend
        // may still be sleeping.
        let sql = format!("SELECT pg_sleep(60) AS pooled_{}", pool.is_some());
        let sleep_sql = sql.clone();
        let sleeper = tokio::task::spawn_blocking(move || {
            psql(
                &format!(
                    "host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=require"
                ),
                &sleep_sql,
            )
        });
        // The statement runs on the server: the session is in the relay.
        let direct = format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            c.port(0)
        );
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let (_, n) = tokio::task::block_in_place(|| {
                psql(
                    &direct,
                    &format!("SELECT count(*) FROM pg_stat_activity WHERE query = '{sql}'"),
                )
            });
            if n.trim() == "1" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline && !sleeper.is_finished(),
                "the sleeper never started: {n}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let started = std::time::Instant::now();
        p.shutdown().await;
        let (ok, out) = tokio::time::timeout(WAIT, sleeper).await.unwrap().unwrap();
        assert!(!ok, "pooled={}: {out}", pool.is_some());
        assert!(
            out.contains("pgwarden is shutting down"),
            "pooled={}: {out}",
            pool.is_some()
        );
        // shutdown_timeout is 5 s; the kill itself is immediate.
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{:?}",
            started.elapsed()
        );
    }
}

/// A cancel request sent over TLS, as libpq 17 and later send it on a TLS
/// connection, is answered as PostgreSQL answers it: the connection ends
/// with TLS close_notify, not a bare close, which libpq reports as
/// "SSL error: unexpected eof" although the request was taken. A second
/// SSLRequest over TLS is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_requests_over_tls_are_answered_as_postgresql_does() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_certs(dir.path(), "a");
    let (_e, p) = tls_proxy(&c, &cert, &key, ClientTlsMode::Allow).await;
    let port = p.service_addrs()["read_write"].port();
    let connect = || tls_connect(port, &ca);
    let mut tls = connect().await;
    // CancelRequest (code 80877102) for a key nobody has: ignored, and the
    // connection closed.
    let mut cancel = vec![0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e];
    cancel.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 2]);
    tls.write_all(&cancel).await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(WAIT, tls.read_to_end(&mut rest))
        .await
        .expect("the connection closes");
    // rustls reports a close without close_notify as UnexpectedEof.
    assert_eq!(read.map_err(|e| e.to_string()).ok(), Some(0), "{rest:?}");

    // Another SSLRequest inside TLS is refused as PostgreSQL refuses it
    // (an unsupported protocol), not answered as if it came first.
    let mut tls = connect().await;
    tls.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(WAIT, tls.read_to_end(&mut rest))
        .await
        .expect("the connection closes");
    assert_eq!(rest.first(), Some(&b'E'), "{rest:?}");
    let text = String::from_utf8_lossy(&rest);
    assert!(
        text.contains("C0A000") && text.contains("unsupported frontend protocol 1234.5679"),
        "{text}"
    );
}

/// A TLS connection to pgwarden's port `port` (SSLRequest answered `S`,
/// then the handshake), the server's certificate checked against `ca`.
async fn tls_connect(
    port: u16,
    ca: &Path,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .unwrap();
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer[0], b'S');
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap()
}

/// A raw TLS session through pgwarden's read-write port at `port`, logged
/// in as postgres (trust) up to its first ReadyForQuery; the server's
/// certificate checked against `ca`.
async fn raw_tls_session(
    port: u16,
    ca: &Path,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tls = tls_connect(port, ca).await;
    let mut startup = Vec::new();
    startup.extend_from_slice(&196_608u32.to_be_bytes());
    startup.extend_from_slice(b"user\0postgres\0database\0postgres\0\0");
    let mut packet = ((startup.len() + 4) as u32).to_be_bytes().to_vec();
    packet.extend(startup);
    tls.write_all(&packet).await.unwrap();
    let mut got = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    while !got.ends_with(READY) {
        let n = tokio::time::timeout(WAIT, tls.read(&mut chunk))
            .await
            .expect("the login completes")
            .unwrap();
        assert!(n > 0, "closed during login: {got:?}");
        got.extend_from_slice(&chunk[..n]);
    }
    tls
}

/// ReadyForQuery, idle.
const READY: &[u8] = &[b'Z', 0, 0, 0, 5, b'I'];

/// A simple Query of `sql`.
fn query_message(sql: &str) -> Vec<u8> {
    let mut q = vec![b'Q'];
    q.extend_from_slice(&((sql.len() + 5) as u32).to_be_bytes());
    q.extend_from_slice(sql.as_bytes());
    q.push(0);
    q
}

/// A large result read slowly by a TLS client arrives whole, up to its
/// ReadyForQuery, through the relay's writes to a socket that is often
/// full (where TLS keeps what it was given in its own buffer until
/// flushed; the relay's unit tests show the flush).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_tls_reader_gets_the_whole_reply() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_certs(dir.path(), "a");
    let (_e, p) = tls_proxy(&c, &cert, &key, ClientTlsMode::Require).await;
    let port = p.service_addrs()["read_write"].port();
    let mut tls = raw_tls_session(port, &ca).await;
    tls.write_all(&query_message(
        "SELECT repeat('x', 8000000) FROM generate_series(1, 2)",
    ))
    .await
    .unwrap();
    // Read a little at a time, so that pgwarden's writes often find the
    // client's socket full.
    let mut chunk = vec![0u8; 16 * 1024];
    let mut total = 0usize;
    let mut tail = Vec::new();
    while !tail.ends_with(READY) {
        let n = tokio::time::timeout(WAIT, tls.read(&mut chunk))
            .await
            .expect("the whole reply arrives")
            .unwrap();
        assert!(n > 0, "closed after {total} bytes");
        total += n;
        tail.extend_from_slice(&chunk[..n]);
        let keep = tail.len().saturating_sub(READY.len());
        tail.drain(..keep);
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    assert!(total > 16_000_000, "{total} bytes");
}

/// How a test client binds SCRAM to the certificate it received.
#[derive(Clone, Copy, Debug)]
enum Binding {
    /// The certificate's SHA-256 hash: what RFC 5929 asks for a
    /// certificate signed with ECDSA and SHA-256.
    Sha256,
    /// Its SHA-384 hash, for ECDSA with SHA-384.
    Sha384,
    /// Bytes that are no certificate's hash.
    Wrong,
    /// No binding data: the client does not bind (libpq without OpenSSL's
    /// help, or `channel_binding=disable`).
    Absent,
}

/// tokio-postgres over rustls, binding SCRAM as `binding` says, with the
/// hash computed here from the certificate received. With `pause`, the
/// connection stops after the TLS handshake: it says so on the first
/// channel and goes on when the second one fires.
struct RustlsConnect {
    config: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
    binding: Binding,
    pause: Option<(
        tokio::sync::oneshot::Sender<()>,
        tokio::sync::oneshot::Receiver<()>,
    )>,
}

struct RustlsStream {
    tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    binding: Binding,
}

impl tokio_postgres::tls::TlsConnect<tokio::net::TcpStream> for RustlsConnect {
    type Stream = RustlsStream;
    type Error = std::io::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<RustlsStream>> + Send>>;

    fn connect(self, tcp: tokio::net::TcpStream) -> Self::Future {
        use tokio_rustls::rustls::pki_types::ServerName;
        Box::pin(async move {
            let tls = tokio_rustls::TlsConnector::from(self.config)
                .connect(ServerName::try_from("localhost").unwrap(), tcp)
                .await?;
            if let Some((handshaken, resume)) = self.pause {
                let _ = handshaken.send(());
                let _ = resume.await;
            }
            Ok(RustlsStream {
                tls,
                binding: self.binding,
            })
        })
    }
}

impl tokio_postgres::tls::TlsStream for RustlsStream {
    fn channel_binding(&self) -> tokio_postgres::tls::ChannelBinding {
        use sha2::Digest;
        use tokio_postgres::tls::ChannelBinding;
        let cert = self
            .tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .expect("the server sent a certificate");
        match self.binding {
            Binding::Sha256 => {
                ChannelBinding::tls_server_end_point(sha2::Sha256::digest(cert).to_vec())
            }
            Binding::Sha384 => {
                ChannelBinding::tls_server_end_point(sha2::Sha384::digest(cert).to_vec())
            }
            Binding::Wrong => ChannelBinding::tls_server_end_point(vec![0x5a; 32]),
            Binding::Absent => ChannelBinding::none(),
        }
    }
}

impl tokio::io::AsyncRead for RustlsStream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().tls).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for RustlsStream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().tls).poll_write(cx, data)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().tls).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().tls).poll_shutdown(cx)
    }
}

/// A rustls client configuration trusting the CA in `ca`.
fn client_config(ca: &Path) -> std::sync::Arc<tokio_rustls::rustls::ClientConfig> {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    std::sync::Arc::new(
        tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// A login refused: its SQLSTATE, if any, and message.
type Refused = (Option<String>, String);

fn refused(e: tokio_postgres::Error) -> Refused {
    (
        common::sqlstate(&e),
        e.as_db_error()
            .map_or_else(|| e.to_string(), |d| d.message().to_string()),
    )
}

/// Logs in with tokio-postgres over TLS (`sslmode=require`), binding as
/// `binding` says (`channel_binding=require`, or `prefer` for
/// [`Binding::Absent`]), and returns `current_user`.
async fn bound_login(
    port: u16,
    user: &str,
    password: &str,
    ca: &Path,
    binding: Binding,
    pause: Option<(
        tokio::sync::oneshot::Sender<()>,
        tokio::sync::oneshot::Receiver<()>,
    )>,
) -> Result<String, Refused> {
    use tokio_postgres::config::{ChannelBinding, SslMode};
    let mut cfg = tokio_postgres::Config::new();
    cfg.user(user)
        .password(password)
        .dbname("postgres")
        .ssl_mode(SslMode::Require)
        .channel_binding(match binding {
            Binding::Absent => ChannelBinding::Prefer,
            _ => ChannelBinding::Require,
        });
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let connector = RustlsConnect {
        config: client_config(ca),
        binding,
        pause,
    };
    let (client, conn) = cfg.connect_raw(tcp, connector).await.map_err(refused)?;
    tokio::spawn(conn);
    Ok(common::one(&client, "SELECT current_user::text").await)
}

/// Logs in with tokio-postgres without TLS (`channel_binding=prefer`, the
/// default) and returns `current_user`.
async fn plain_login(port: u16, user: &str, password: &str) -> Result<String, Refused> {
    let client = common::client(&format!(
        "host=127.0.0.1 port={port} user={user} password={password} dbname=postgres sslmode=disable channel_binding=prefer"
    ))
    .await
    .map_err(refused)?;
    Ok(common::one(&client, "SELECT current_user::text").await)
}

/// A cluster whose servers want a password from alice (SCRAM verifier
/// `alice-secret`), so that pgwarden can only log in to them as her with
/// the key her exchange with pgwarden proved; and pgwarden's own hba file
/// asking her for SCRAM. Returns once the servers' rules are in force.
async fn scram_cluster(dir: &Path) -> TestCluster {
    let mut c = TestCluster::builder().replicas(0).start();
    common::sql(
        &c.conninfo(0),
        "CREATE ROLE alice LOGIN PASSWORD 'alice-secret'",
    )
    .await;
    c.set_hba(
        0,
        "host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 md5\n",
    );
    let direct = format!(
        "host=127.0.0.1 port={} user=alice dbname=postgres",
        c.port(0)
    );
    pgwarden_testkit::eventually("the servers' pg_hba.conf in force", WAIT, || {
        let direct = direct.clone();
        async move {
            match common::client(&direct).await {
                Ok(_) => Err("alice still gets in without a password".to_string()),
                Err(_) => Ok(()),
            }
        }
    })
    .await;
    common::authenticate_with(
        dir.join("pg_hba.conf"),
        "host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n",
    );
    c
}

/// SCRAM-SHA-256-PLUS towards clients over TLS, as PostgreSQL offers it:
/// libpq and tokio-postgres with `channel_binding=require` log in through
/// pgwarden (which then logs in to the server with the key the bound
/// exchange proved), in session mode and with a transaction pool; binding
/// data of another certificate is refused; over plain TCP nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_binding_require_logs_in_through_pgwarden() {
    let dir = tempfile::tempdir().unwrap();
    let c = scram_cluster(dir.path()).await;
    let (ca, cert, key) = make_certs(dir.path(), "cb");
    for pool in [None, Some(pgwarden_proxy::PoolSettings::default())] {
        let pooled = pool.is_some();
        let (_e, p) = tls_proxy_pooled(&c, &cert, &key, ClientTlsMode::Allow, pool).await;
        let port = p.service_addrs()["read_write"].port();

        // libpq computes the binding itself (SHA-256 for this ECDSA-SHA256
        // certificate) and, with `require`, insists on SCRAM-SHA-256-PLUS.
        let ca_text = ca.display().to_string();
        let (bound, wrong, plain) = tokio::task::spawn_blocking(move || {
            let tls = format!(
                "host=localhost hostaddr=127.0.0.1 port={port} user=alice dbname=postgres sslmode=verify-full sslrootcert={ca_text} channel_binding=require"
            );
            let plain = format!(
                "host=127.0.0.1 port={port} user=alice password=alice-secret dbname=postgres sslmode=disable channel_binding=prefer"
            );
            (
                psql(&format!("{tls} password=alice-secret"), "SELECT current_user"),
                psql(&format!("{tls} password=nope"), "SELECT current_user"),
                psql(&plain, "SELECT current_user"),
            )
        })
        .await
        .unwrap();
        assert!(
            bound.0 && bound.1.trim() == "alice",
            "pooled={pooled}: {}",
            bound.1
        );
        assert!(
            !wrong.0
                && wrong
                    .1
                    .contains("password authentication failed for user \"alice\""),
            "pooled={pooled}: {}",
            wrong.1
        );
        assert!(
            plain.0 && plain.1.trim() == "alice",
            "pooled={pooled}: {}",
            plain.1
        );

        // tokio-postgres, binding with the hash computed here.
        let login = |password: &'static str, binding| {
            let ca = ca.clone();
            async move { bound_login(port, "alice", password, &ca, binding, None).await }
        };
        assert_eq!(
            login("alice-secret", Binding::Sha256).await,
            Ok("alice".to_string()),
            "pooled={pooled}"
        );
        // Not binding over TLS is still allowed (plain SCRAM-SHA-256 with
        // GS2 flag `n`).
        assert_eq!(
            login("alice-secret", Binding::Absent).await,
            Ok("alice".to_string()),
            "pooled={pooled}"
        );
        // Binding data that is not pgwarden's certificate's, as a client
        // whose TLS was terminated by something in between would send.
        assert_eq!(
            login("alice-secret", Binding::Wrong).await,
            Err((
                Some("28000".to_string()),
                "SCRAM channel binding check failed".to_string()
            )),
            "pooled={pooled}"
        );
        assert_eq!(
            login("nope", Binding::Sha256).await,
            Err((
                Some("28P01".to_string()),
                "password authentication failed for user \"alice\"".to_string()
            )),
            "pooled={pooled}"
        );

        // Without TLS: SCRAM-SHA-256 as before.
        assert_eq!(
            plain_login(port, "alice", "alice-secret").await,
            Ok("alice".to_string()),
            "pooled={pooled}"
        );
        assert_eq!(
            plain_login(port, "alice", "nope").await,
            Err((
                Some("28P01".to_string()),
                "password authentication failed for user \"alice\"".to_string()
            )),
            "pooled={pooled}"
        );
    }
    common::AUTH.with(|a| *a.borrow_mut() = None);
}

/// A CA and a server certificate for 127.0.0.1/localhost signed by it,
/// keys and signatures with the ECDSA algorithm `alg`: its hash is the one
/// of `tls-server-end-point`.
fn make_certs_signed_with(
    dir: &Path,
    tag: &str,
    alg: &'static rcgen::SignatureAlgorithm,
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate_for(alg).unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("pgwarden test CA {tag}"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate_for(alg).unwrap();
    let params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let cert = params.signed_by(&key, &issuer).unwrap();
    let (ca_path, cert_path, key_path) = (
        dir.join(format!("ca-{tag}.pem")),
        dir.join(format!("server-{tag}.crt")),
        dir.join(format!("server-{tag}.key")),
    );
    std::fs::write(&ca_path, ca.pem()).unwrap();
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    (ca_path, cert_path, key_path)
}

/// Anything a login can run over: TCP or TLS.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// One backend message: its type and body.
async fn read_message(s: &mut Box<dyn Io>) -> (u8, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let kind = s.read_u8().await.unwrap();
    let len = s.read_i32().await.unwrap();
    let mut body = vec![0; usize::try_from(len - 4).unwrap()];
    s.read_exact(&mut body).await.unwrap();
    (kind, body)
}

/// Starts a login as alice, over TLS when `ca` is given, and answers
/// AuthenticationSASL with `mechanism` and the client-first-message
/// `first`, built by hand to say what libpq would not. Returns the
/// mechanisms pgwarden offered and its answer: the server-first-message,
/// or the SQLSTATE and message of its refusal.
async fn sasl_first(
    port: u16,
    ca: Option<&Path>,
    mechanism: &str,
    first: &str,
) -> (Vec<String>, Result<String, (String, String)>) {
    sasl_answer(port, ca, mechanism, first, None).await
}

/// [`sasl_first`], or with `raw` as the whole SASLInitialResponse body
/// when given.
async fn sasl_answer(
    port: u16,
    ca: Option<&Path>,
    mechanism: &str,
    first: &str,
    raw: Option<&[u8]>,
) -> (Vec<String>, Result<String, (String, String)>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::ServerName;
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut s: Box<dyn Io> = match ca {
        None => Box::new(tcp),
        Some(ca) => {
            // SSLRequest.
            tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
                .await
                .unwrap();
            assert_eq!(tcp.read_u8().await.unwrap(), b'S');
            Box::new(
                tokio_rustls::TlsConnector::from(client_config(ca))
                    .connect(ServerName::try_from("localhost").unwrap(), tcp)
                    .await
                    .unwrap(),
            )
        }
    };
    let mut startup = 196_608i32.to_be_bytes().to_vec();
    for part in ["user", "alice", "database", "postgres", ""] {
        startup.extend_from_slice(part.as_bytes());
        startup.push(0);
    }
    let len = i32::try_from(startup.len() + 4).unwrap();
    s.write_all(&[&len.to_be_bytes()[..], &startup].concat())
        .await
        .unwrap();
    let (kind, body) = read_message(&mut s).await;
    assert_eq!(
        (kind, &body[..4]),
        (b'R', &10i32.to_be_bytes()[..]),
        "AuthenticationSASL"
    );
    let offered: Vec<String> = body[4..]
        .split(|&b| b == 0)
        .take_while(|m| !m.is_empty())
        .map(|m| String::from_utf8(m.to_vec()).unwrap())
        .collect();
    // SASLInitialResponse.
    let response = match raw {
        Some(raw) => raw.to_vec(),
        None => {
            let mut response = mechanism.as_bytes().to_vec();
            response.push(0);
            response.extend_from_slice(&i32::try_from(first.len()).unwrap().to_be_bytes());
            response.extend_from_slice(first.as_bytes());
            response
        }
    };
    let len = i32::try_from(response.len() + 4).unwrap();
    s.write_all(&[&[b'p'][..], &len.to_be_bytes(), &response].concat())
        .await
        .unwrap();
    let answer = match read_message(&mut s).await {
        (b'R', body) if body[..4] == 11i32.to_be_bytes() => {
            Ok(String::from_utf8(body[4..].to_vec()).unwrap())
        }
        (b'E', body) => {
            let field = |code: u8| {
                body.split(|&b| b == 0)
                    .find(|f| f.first() == Some(&code))
                    .map(|f| String::from_utf8_lossy(&f[1..]).into_owned())
                    .unwrap_or_default()
            };
            Err((field(b'C'), field(b'M')))
        }
        (kind, body) => panic!("unexpected message {}: {body:?}", char::from(kind)),
    };
    (offered, answer)
}

/// A client binds to the certificate its own handshake received, even when
/// a reload puts another one in place before it authenticates; clients
/// after the reload bind to the new one, whose SHA-384 signature makes the
/// binding a SHA-384 hash (computed by libpq itself too). And the
/// negotiation rules: over TLS `SCRAM-SHA-256-PLUS` is offered first, and
/// a client that could bind but says the server cannot (`y`) is refused as
/// a possible downgrade; a mechanism that does not match the GS2 header is
/// a protocol violation; over plain TCP only `SCRAM-SHA-256` is offered and
/// `y` goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_binding_follows_the_certificate_and_refuses_downgrades() {
    let dir = tempfile::tempdir().unwrap();
    let c = scram_cluster(dir.path()).await;
    let (ca_a, cert_a, key_a) = make_certs(dir.path(), "a");
    let (ca_b, cert_b, key_b) =
        make_certs_signed_with(dir.path(), "b", &rcgen::PKCS_ECDSA_P384_SHA384);
    let (_e, mut p) = tls_proxy(&c, &cert_a, &key_a, ClientTlsMode::Allow).await;
    common::AUTH.with(|a| *a.borrow_mut() = None);
    let port = p.service_addrs()["read_write"].port();

    // Handshake with certificate a, then a reload to b, then the SCRAM
    // exchange, bound to a.
    let (handshaken_tx, handshaken) = tokio::sync::oneshot::channel();
    let (resume, resume_rx) = tokio::sync::oneshot::channel();
    let early = tokio::spawn({
        let ca_a = ca_a.clone();
        async move {
            bound_login(
                port,
                "alice",
                "alice-secret",
                &ca_a,
                Binding::Sha256,
                Some((handshaken_tx, resume_rx)),
            )
            .await
        }
    });
    handshaken.await.expect("the early client's TLS handshake");
    let mut spec = p.spec().clone();
    spec.tls = Some(TlsSpec {
        cert: cert_b.clone(),
        key: key_b.clone(),
        mode: ClientTlsMode::Allow,
        client_ca: None,
    });
    p.apply(spec).await.unwrap();
    resume.send(()).unwrap();
    assert_eq!(early.await.unwrap(), Ok("alice".to_string()));

    // New clients get b, signed with SHA-384.
    assert_eq!(
        bound_login(port, "alice", "alice-secret", &ca_b, Binding::Sha384, None).await,
        Ok("alice".to_string())
    );
    assert_eq!(
        bound_login(port, "alice", "alice-secret", &ca_b, Binding::Sha256, None).await,
        Err((
            Some("28000".to_string()),
            "SCRAM channel binding check failed".to_string()
        ))
    );
    let ca_text = ca_b.display().to_string();
    let (ok, out) = tokio::task::spawn_blocking(move || {
        psql(
            &format!("host=localhost hostaddr=127.0.0.1 port={port} user=alice password=alice-secret dbname=postgres sslmode=verify-full sslrootcert={ca_text} channel_binding=require"),
            "SELECT current_user",
        )
    })
    .await
    .unwrap();
    assert!(ok && out.trim() == "alice", "{out}");

    // The negotiation, message by message.
    let plus = "SCRAM-SHA-256-PLUS";
    let plain = "SCRAM-SHA-256";
    let (offered, answer) = sasl_first(port, Some(&ca_b), plain, "y,,n=,r=abcdef").await;
    assert_eq!(offered, [plus, plain]);
    assert_eq!(
        answer,
        Err((
            "28000".to_string(),
            "SCRAM channel binding negotiation error".to_string()
        ))
    );
    for (mechanism, first) in [
        (plus, "n,,n=,r=abcdef"),
        (plus, "y,,n=,r=abcdef"),
        (plain, "p=tls-server-end-point,,n=,r=abcdef"),
        (plus, "p=tls-unique,,n=,r=abcdef"),
    ] {
        let (_, answer) = sasl_first(port, Some(&ca_b), mechanism, first).await;
        assert_eq!(
            answer.as_ref().map_err(|(code, _)| code.as_str()),
            Err("08P01"),
            "{mechanism} {first}: {answer:?}"
        );
    }
    // The well-formed ones go on to the server-first-message.
    for (mechanism, first) in [
        (plus, "p=tls-server-end-point,,n=,r=abcdef"),
        (plain, "n,,n=,r=abcdef"),
    ] {
        let (_, answer) = sasl_first(port, Some(&ca_b), mechanism, first).await;
        assert!(
            answer.as_ref().is_ok_and(|a| a.starts_with("r=abcdef")),
            "{mechanism} {first}: {answer:?}"
        );
    }
    // Plain TCP: no PLUS, and `y` is the truth.
    let (offered, answer) = sasl_first(port, None, plain, "y,,n=,r=abcdef").await;
    assert_eq!(offered, [plain]);
    assert!(answer.is_ok_and(|a| a.starts_with("r=abcdef")));
    let (_, answer) = sasl_first(port, None, plus, "p=tls-server-end-point,,n=,r=abcdef").await;
    assert_eq!(
        answer.as_ref().map_err(|(code, _)| code.as_str()),
        Err("08P01"),
        "{answer:?}"
    );
}

/// A SASLInitialResponse that does not parse (its data shorter than its
/// length says, no length at all, a mechanism without its terminator) is
/// a protocol violation, over TLS and plain TCP alike, counted as
/// `protocol`: it used to be answered and counted as a wrong password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_sasl_initial_response_is_a_protocol_violation() {
    let dir = tempfile::tempdir().unwrap();
    let c = scram_cluster(dir.path()).await;
    let (ca, cert, key) = make_certs(dir.path(), "m");
    let (_e, p) = tls_proxy(&c, &cert, &key, ClientTlsMode::Allow).await;
    common::AUTH.with(|a| *a.borrow_mut() = None);
    let port = p.service_addrs()["read_write"].port();
    let first = b"n,,n=,r=abcdef";
    let mut long = b"SCRAM-SHA-256\0".to_vec();
    long.extend_from_slice(&100i32.to_be_bytes());
    long.extend_from_slice(first);
    let mut trailing = b"SCRAM-SHA-256\0".to_vec();
    trailing.extend_from_slice(&4i32.to_be_bytes());
    trailing.extend_from_slice(first);
    let cases: [&[u8]; 4] = [&long, &trailing, b"SCRAM-SHA-256\0\0\0", b"SCRAM-SHA-256"];
    for ca in [Some(ca.as_path()), None] {
        for raw in cases {
            let (_, answer) = sasl_answer(port, ca, "", "", Some(raw)).await;
            assert_eq!(
                answer.as_ref().map_err(|(code, _)| code.as_str()),
                Err("08P01"),
                "tls={} {}: {answer:?}",
                ca.is_some(),
                String::from_utf8_lossy(raw)
            );
        }
    }
    let http = p.http_addr().unwrap();
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
        .await
        .unwrap();
    assert!(
        body.contains("pgwarden_auth_failures_total{reason=\"protocol\"} 8"),
        "{body}"
    );
    assert!(!body.contains("reason=\"bad_password\""), "{body}");
}

/// libpq without a password closes the connection when asked for one,
/// and psql then prompts and connects again: as in PostgreSQL that is no
/// failed login, over TLS (with SCRAM-SHA-256-PLUS offered) or not. It
/// used to be counted and logged as a wrong password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_when_asked_for_a_password_is_no_failure() {
    let dir = tempfile::tempdir().unwrap();
    let c = scram_cluster(dir.path()).await;
    let (ca, cert, key) = make_certs(dir.path(), "w");
    let (_e, p) = tls_proxy(&c, &cert, &key, ClientTlsMode::Allow).await;
    common::AUTH.with(|a| *a.borrow_mut() = None);
    let port = p.service_addrs()["read_write"].port();
    let ca_text = ca.display().to_string();
    for conninfo in [
        format!("host=localhost hostaddr=127.0.0.1 port={port} user=alice dbname=postgres sslmode=verify-full sslrootcert={ca_text}"),
        format!("host=127.0.0.1 port={port} user=alice dbname=postgres sslmode=disable"),
    ] {
        let out = tokio::task::spawn_blocking(move || {
            Command::new("psql")
                .args(["-X", "-w", "-At", "-c", "SELECT 1", &conninfo])
                .env_remove("PGPASSWORD")
                .env("PGPASSFILE", "/nonexistent")
                .output()
                .expect("psql")
        })
        .await
        .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains("no password supplied"),
            "{stderr}"
        );
    }
    // A wrong password still counts.
    assert!(plain_login(port, "alice", "nope").await.is_err());
    let http = p.http_addr().unwrap();
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
        .await
        .unwrap();
    assert!(
        body.contains("pgwarden_auth_failures_total{reason=\"bad_password\"} 1"),
        "{body}"
    );
}
