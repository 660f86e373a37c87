//! TLS from pgwarden to the servers (`tls.server_tls`), against PostgreSQL
//! with `ssl = on` and certificates made at test time.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{proxy_full, until, SERVER_TLS};
use pgwarden_proxy::{PoolSettings, ServerTlsMode};
use pgwarden_testkit::TestCluster;

const WAIT: Duration = Duration::from_secs(30);

/// A CA (PEM file) and a server certificate for 127.0.0.1 (IP SAN) and
/// localhost signed by it, readable by the user the servers run as.
struct Certs {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn make_certs(dir: &Path, tag: &str) -> Certs {
    make_certs_for(dir, tag, &["localhost", "127.0.0.1"])
}

/// As `make_certs`, with the certificate naming only `names`.
fn make_certs_for(dir: &Path, tag: &str, names: &[&str]) -> Certs {
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
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let cert = params.signed_by(&key, &issuer).unwrap();
    let certs = Certs {
        ca: dir.join(format!("ca-{tag}.pem")),
        cert: dir.join(format!("server-{tag}.crt")),
        key: dir.join(format!("server-{tag}.key")),
    };
    std::fs::write(&certs.ca, ca.pem()).unwrap();
    std::fs::write(&certs.cert, cert.pem()).unwrap();
    std::fs::write(&certs.key, key.serialize_pem()).unwrap();
    // PostgreSQL reads them as its own user and wants a private key only
    // its owner can read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&certs.cert, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(&certs.key, std::fs::Permissions::from_mode(0o600)).unwrap();
    pgwarden_pgctl::RunAs::unprivileged()
        .unwrap()
        .own(&certs.key)
        .unwrap();
    certs
}

/// A one-node cluster serving TLS with `certs`.
fn ssl_cluster(certs: &Certs) -> TestCluster {
    TestCluster::builder()
        .replicas(0)
        .setting("ssl", "on")
        .setting("ssl_cert_file", &certs.cert.display().to_string())
        .setting("ssl_key_file", &certs.key.display().to_string())
        .start()
}

async fn proxy(
    c: &TestCluster,
    mode: ServerTlsMode,
    ca: Option<&Path>,
    pool: Option<PoolSettings>,
) -> (pgwarden_probe::Engine, pgwarden_proxy::Proxy) {
    SERVER_TLS.with(|t| *t.borrow_mut() = (mode, ca.map(Path::to_path_buf)));
    let (e, p) = proxy_full(
        &c.addrs(),
        Duration::from_secs(2),
        pool,
        1000,
        Default::default(),
        None,
    )
    .await;
    SERVER_TLS.with(|t| *t.borrow_mut() = (ServerTlsMode::Disable, None));
    until(&e, "primary", WAIT, |s| {
        s.topology.primary().map(|_| ()).ok_or("none".into())
    })
    .await;
    (e, p)
}

/// Whether the server sees the connection it serves this query on as TLS.
const SSL_OF_SELF: &str = "SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()";

async fn try_sql(conninfo: &str, query: &str) -> Result<String, String> {
    let client = common::client(conninfo).await.map_err(|e| {
        e.as_db_error()
            .map_or_else(|| e.to_string(), |d| d.message().to_string())
    })?;
    let rows = client.simple_query(query).await.map_err(|e| {
        e.as_db_error()
            .map_or_else(|| e.to_string(), |d| d.message().to_string())
    })?;
    Ok(rows
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_encrypts_sessions_and_pooled_connections() {
    let dir = tempfile::tempdir().unwrap();
    let certs = make_certs(dir.path(), "a");
    let c = ssl_cluster(&certs);
    // Session passthrough.
    let (_e, p) = proxy(&c, ServerTlsMode::VerifyFull, Some(&certs.ca), None).await;
    let ssl = try_sql(&common::via(&p, "read_write"), SSL_OF_SELF).await;
    assert_eq!(ssl.as_deref(), Ok("true"), "session through pgwarden");
    // Transaction pooling.
    let pool = PoolSettings {
        size: 2,
        ..PoolSettings::default()
    };
    let (_e2, p2) = proxy(&c, ServerTlsMode::VerifyFull, Some(&certs.ca), Some(pool)).await;
    let ssl = try_sql(&common::via(&p2, "read_write"), SSL_OF_SELF).await;
    assert_eq!(ssl.as_deref(), Ok("true"), "pooled connection");
    // verify-ca accepts the same chain too.
    let (_e3, p3) = proxy(&c, ServerTlsMode::VerifyCa, Some(&certs.ca), None).await;
    let ssl = try_sql(&common::via(&p3, "read_write"), SSL_OF_SELF).await;
    assert_eq!(ssl.as_deref(), Ok("true"), "verify-ca");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_refuses_a_certificate_from_another_ca() {
    let dir = tempfile::tempdir().unwrap();
    let certs = make_certs(dir.path(), "a");
    let other = make_certs(dir.path(), "other");
    let c = ssl_cluster(&certs);
    for mode in [ServerTlsMode::VerifyFull, ServerTlsMode::VerifyCa] {
        let (_e, p) = proxy(&c, mode, Some(&other.ca), None).await;
        let err = try_sql(&common::via(&p, "read_write"), "SELECT 1")
            .await
            .expect_err("a server certificate from another CA must be refused");
        assert!(
            err.contains("TLS handshake failed") && err.contains(mode.name()),
            "{mode:?}: {err}"
        );
    }
    // require does not look at the certificate: it only encrypts.
    let (_e, p) = proxy(&c, ServerTlsMode::Require, None, None).await;
    let ssl = try_sql(&common::via(&p, "read_write"), SSL_OF_SELF).await;
    assert_eq!(ssl.as_deref(), Ok("true"), "require");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefer_falls_back_to_plaintext_and_require_fails_without_ssl() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = proxy(&c, ServerTlsMode::Prefer, None, None).await;
    let ssl = try_sql(&common::via(&p, "read_write"), SSL_OF_SELF).await;
    assert_eq!(ssl.as_deref(), Ok("false"), "prefer against ssl = off");
    let (_e2, p2) = proxy(&c, ServerTlsMode::Require, None, None).await;
    let err = try_sql(&common::via(&p2, "read_write"), "SELECT 1")
        .await
        .expect_err("require against ssl = off must fail");
    assert!(
        err.contains("does not support TLS") && err.contains("server_tls = require"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ca_ignores_the_host_name_and_verify_full_does_not() {
    let dir = tempfile::tempdir().unwrap();
    // Signed by the right CA, but for another host.
    let certs = make_certs_for(dir.path(), "elsewhere", &["db.example.net"]);
    let c = ssl_cluster(&certs);
    let (_e, p) = proxy(&c, ServerTlsMode::VerifyCa, Some(&certs.ca), None).await;
    let ssl = try_sql(&common::via(&p, "read_write"), SSL_OF_SELF).await;
    assert_eq!(ssl.as_deref(), Ok("true"), "verify-ca");
    let (_e2, p2) = proxy(&c, ServerTlsMode::VerifyFull, Some(&certs.ca), None).await;
    let err = try_sql(&common::via(&p2, "read_write"), "SELECT 1")
        .await
        .expect_err("verify-full must check the host name");
    assert!(
        err.contains("TLS handshake failed") && err.contains("not valid for name"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_query_and_server_logins_go_over_tls() {
    use pgwarden_proxy::AuthSpec;
    let dir = tempfile::tempdir().unwrap();
    let certs = make_certs(dir.path(), "a");
    let mut c = ssl_cluster(&certs);
    common::sql(
        &c.conninfo(0),
        "CREATE ROLE alice LOGIN PASSWORD 'alice-secret'",
    )
    .await;
    // Plaintext is only allowed for the health probe (postgres in the
    // postgres database): the auth query (as postgres in template1) and
    // alice's login only work over TLS.
    c.set_hba(
        0,
        "host postgres postgres 127.0.0.1/32 trust\nhostssl all postgres 127.0.0.1/32 trust\nhostssl all all 127.0.0.1/32 scram-sha-256\n",
    );
    let hba = dir.path().join("pg_hba.conf");
    std::fs::write(&hba, "host all alice 127.0.0.1/32 scram-sha-256\n").unwrap();
    common::AUTH.with(|a| {
        *a.borrow_mut() = Some(AuthSpec {
            hba_file: hba,
            auth_user: "postgres".into(),
            auth_password: None,
            auth_dbname: "template1".into(),
            auth_query: pgwarden_config::DEFAULT_AUTH_QUERY.into(),
            cache_ttl: Duration::from_secs(60),
        })
    });
    let (_e, p) = proxy(&c, ServerTlsMode::VerifyFull, Some(&certs.ca), None).await;
    common::AUTH.with(|a| *a.borrow_mut() = None);
    let alice = format!(
        "{} user=alice password=alice-secret",
        common::via(&p, "read_write").replace("user=postgres ", "")
    );
    let ssl = try_sql(&alice, SSL_OF_SELF).await;
    assert_eq!(ssl.as_deref(), Ok("true"), "alice through pgwarden");
    let wrong = alice.replace("alice-secret", "nope");
    let err = try_sql(&wrong, "SELECT 1")
        .await
        .expect_err("wrong password");
    assert!(err.contains("password authentication failed"), "{err}");
}

/// Without `[auth]` the server checks the password through a relayed
/// session. Over TLS to the server it offers SCRAM-SHA-256-PLUS, bound to
/// that channel: a plaintext client never sees it (libpq refuses such an
/// offer), and a TLS client can use it only when pgwarden presents the
/// server's own certificate; otherwise it must not ask for binding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_scram_over_tls_to_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let certs = make_certs(dir.path(), "a");
    let own = make_certs(dir.path(), "b");
    let mut c = ssl_cluster(&certs);
    common::sql(
        &c.conninfo(0),
        "CREATE ROLE alice LOGIN PASSWORD 'alice-pw'",
    )
    .await;
    c.set_hba(
        0,
        "host all postgres 127.0.0.1/32 trust\nhostssl all alice 127.0.0.1/32 scram-sha-256\n",
    );
    let login = |port: u16, sslmode: &str, binding: &str| {
        let out = std::process::Command::new("psql")
            .args([
                "-X",
                "-At",
                "-c",
                "SELECT current_user",
                &format!(
                    "host=127.0.0.1 port={port} user=alice dbname=postgres password=alice-pw \
                     sslmode={sslmode} channel_binding={binding}"
                ),
            ])
            .env("PGCONNECT_TIMEOUT", "10")
            .output()
            .unwrap();
        let ok = out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "alice";
        (ok, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for (cert, same) in [(&own, false), (&certs, true)] {
        SERVER_TLS.with(|t| *t.borrow_mut() = (ServerTlsMode::Require, None));
        let spec = pgwarden_proxy::TlsSpec {
            cert: cert.cert.clone(),
            key: cert.key.clone(),
            mode: pgwarden_proxy::ClientTlsMode::Allow,
            client_ca: None,
        };
        let (e, p) = proxy_full(
            &c.addrs(),
            Duration::from_secs(2),
            None,
            1000,
            Default::default(),
            Some(spec),
        )
        .await;
        SERVER_TLS.with(|t| *t.borrow_mut() = (ServerTlsMode::Disable, None));
        until(&e, "primary", WAIT, |s| {
            s.topology.primary().map(|_| ()).ok_or("none".into())
        })
        .await;
        let port = p.service_addrs()["read_write"].port();
        for (sslmode, binding) in [("disable", "prefer"), ("require", "disable")] {
            let (ok, err) = login(port, sslmode, binding);
            assert!(ok, "sslmode={sslmode} channel_binding={binding}: {err}");
        }
        // libpq's default over TLS binds to the certificate it got.
        let (ok, err) = login(port, "require", "prefer");
        if same {
            assert!(ok, "the server's own certificate: {err}");
        } else {
            assert!(!ok && err.contains("channel binding"), "{err}");
        }
    }
}
