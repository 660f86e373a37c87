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
