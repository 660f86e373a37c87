//! TLS termination towards clients, with certificates made at test time.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{proxy_full, until};
use pgwarden_proxy::{ClientTlsMode, TlsSpec};
use pgwarden_testkit::TestCluster;

const WAIT: Duration = Duration::from_secs(30);

/// A CA and a server certificate for 127.0.0.1/localhost signed by it.
fn make_certs(
    dir: &Path,
    tag: &str,
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("pgwarden test CA {tag}"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
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
    let spec = TlsSpec {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        mode,
        client_ca: None,
    };
    let (e, p) = proxy_full(
        &c.addrs(),
        Duration::from_secs(3),
        None,
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
        let spec = TlsSpec {
            cert: cert.clone(),
            key: key.clone(),
            mode: ClientTlsMode::Require,
            client_ca: None,
        };
        let (e, p) = proxy_full(
            &c.addrs(),
            Duration::from_secs(3),
            pool.clone(),
            1000,
            Default::default(),
            Some(spec),
        )
        .await;
        until(&e, "primary", WAIT, |s| {
            s.topology.primary().map(|_| ()).ok_or("none".into())
        })
        .await;
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
/// "SSL error: unexpected eof" although the request was taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_request_over_tls_ends_with_close_notify() {
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_certs(dir.path(), "a");
    let (_e, p) = tls_proxy(&c, &cert, &key, ClientTlsMode::Allow).await;
    let port = p.service_addrs()["read_write"].port();
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(&ca).unwrap() {
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
    // SSLRequest.
    tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .unwrap();
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer[0], b'S');
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
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
}
