//! Authentication by pgwarden: pg_hba.conf, SCRAM/md5/password with
//! verifiers from the auth query, and logging in to servers as the client.

mod common;

use std::time::Duration;

use common::{proxy_with, sql, sqlstate, until, AUTH_TIMEOUT};
use pgwarden_proxy::PoolSettings;
use pgwarden_testkit::TestCluster;

const WAIT: Duration = Duration::from_secs(30);

/// `café-secret` in LATIN1.
const LATIN1_PASSWORD: &[u8] = b"caf\xe9-secret";

struct Setup {
    c: TestCluster,
    _dir: tempfile::TempDir,
    e: pgwarden_probe::Engine,
    p: pgwarden_proxy::Proxy,
}

async fn setup(pool: Option<PoolSettings>, cache_ttl: Duration) -> Setup {
    let mut c = TestCluster::builder().replicas(0).start();
    let admin = c.conninfo(0);
    sql(&admin, "CREATE ROLE alice LOGIN PASSWORD 'alice-secret'").await;
    sql(&admin, "CREATE ROLE dave LOGIN PASSWORD 'dave-secret'").await;
    // A password in LATIN1, not UTF-8: its secret is made here, as a
    // LATIN1 client's libpq would make it (the server takes only text).
    let latin =
        pgwarden_auth::ScramSecret::from_password(LATIN1_PASSWORD, b"latin-salt", 4096).unwrap();
    sql(
        &admin,
        &format!("CREATE ROLE lena LOGIN PASSWORD '{latin}'"),
    )
    .await;
    sql(
        &admin,
        "SET password_encryption = 'md5'; CREATE ROLE carol LOGIN PASSWORD 'carol-secret'",
    )
    .await;
    // A secret made with more iterations than PostgreSQL 15's 4096, as a
    // cluster with a raised `scram_iterations` (PostgreSQL 16) makes them.
    let slow = pgwarden_auth::ScramSecret::from_password(b"ivan-secret", b"ivan-salt-16byte", 8192)
        .unwrap();
    sql(&admin, &format!("CREATE ROLE ivan LOGIN PASSWORD '{slow}'")).await;
    sql(&admin, "CREATE ROLE mallory LOGIN PASSWORD 'x'").await;
    sql(&admin, "CREATE ROLE sam LOGIN PASSWORD 'sam-secret'").await;
    sql(&admin, "CREATE ROLE nat LOGIN PASSWORD 'nat-secret'").await;
    sql(&admin, "CREATE ROLE trudy LOGIN").await;
    sql(
        &admin,
        &format!(
            "CREATE ROLE \"{}\" LOGIN PASSWORD 'long-secret'",
            "r".repeat(63)
        ),
    )
    .await;
    sql(
        &admin,
        "CREATE ROLE readers; CREATE ROLE erin LOGIN PASSWORD 'erin-secret' IN ROLE readers; CREATE ROLE frank LOGIN PASSWORD 'frank-secret'",
    )
    .await;
    // The servers want passwords from everyone but the superuser, so a
    // login by pgwarden only works with what the client proved.
    c.set_hba(
        0,
        "host all postgres 127.0.0.1/32 trust\nhost all trudy 127.0.0.1/32 trust\n\
         host all all 127.0.0.1/32 md5\n",
    );
    let dir = tempfile::tempdir().unwrap();
    let hba = dir.path().join("pg_hba.conf");
    common::authenticate_with_ttl(
        hba,
        "# pgwarden's rules\n\
         host replication all 127.0.0.1/32 reject\n\
         host all alice 127.0.0.1/32 scram-sha-256\n\
         host all carol 127.0.0.1/32 md5\n\
         host all dave 127.0.0.1/32 password\n\
         host all lena 127.0.0.1/32 password\n\
         host all ivan 127.0.0.1/32 scram-sha-256\n\
         host md5db all 127.0.0.1/32 md5\n\
         host all mallory 127.0.0.1/32 reject\n\
         host all sam samehost reject\n\
         host all nat samenet reject\n\
         host template1 +readers 127.0.0.1/32 scram-sha-256\n\
         host all postgres 127.0.0.1/32 trust\n\
         host all trudy 127.0.0.1/32 trust\n\
         host postgres all 127.0.0.1/32 scram-sha-256\n",
        cache_ttl,
    );
    AUTH_TIMEOUT.with(|t| *t.borrow_mut() = Duration::from_secs(1));
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool, 1000).await;
    until(&e, "primary", WAIT, |s| {
        s.topology.primary().map(|_| ()).ok_or("none".into())
    })
    .await;
    Setup { c, _dir: dir, e, p }
}

fn ci(p: &pgwarden_proxy::Proxy, user: &str, password: &str) -> String {
    format!(
        "{} user={user} password={password}",
        common::via(p, "read_write").replace("user=postgres ", "")
    )
}

async fn login(
    p: &pgwarden_proxy::Proxy,
    user: &str,
    password: &str,
) -> Result<String, (Option<String>, String)> {
    match common::client(&ci(p, user, password)).await {
        Ok(c) => {
            let rows = c
                .simple_query("SELECT current_user")
                .await
                .map_err(|e| (sqlstate(&e), e.to_string()))?;
            Ok(rows
                .iter()
                .find_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
                    _ => None,
                })
                .unwrap())
        }
        Err(e) => Err((
            sqlstate(&e),
            e.as_db_error()
                .map(|d| d.message().to_string())
                .unwrap_or_else(|| e.to_string()),
        )),
    }
}

/// A raw connection to the read-write port that has sent a start-up
/// packet with `params`.
async fn raw_login(p: &pgwarden_proxy::Proxy, params: &[(&str, &str)]) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut sock = tokio::net::TcpStream::connect(p.service_addrs()["read_write"])
        .await
        .unwrap();
    sock.write_all(&common::startup_packet(params))
        .await
        .unwrap();
    sock
}

/// The next message on a raw connection: its type and body.
async fn next_message(sock: &mut tokio::net::TcpStream) -> (u8, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let tag = sock.read_u8().await.unwrap();
    let len = sock.read_u32().await.unwrap() as usize;
    let mut body = vec![0; len - 4];
    sock.read_exact(&mut body).await.unwrap();
    (tag, body)
}

/// A password-type message (`p`: PasswordMessage, SASLInitialResponse,
/// SASLResponse) around `body`.
fn password_frame(body: &[u8]) -> Vec<u8> {
    let mut out = vec![b'p'];
    out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// The body of a SASLInitialResponse choosing SCRAM-SHA-256 with
/// `first` as its client-first-message.
fn sasl_initial(first: &[u8]) -> Vec<u8> {
    let mut msg = b"SCRAM-SHA-256\0".to_vec();
    msg.extend_from_slice(&(first.len() as u32).to_be_bytes());
    msg.extend_from_slice(first);
    msg
}

/// The server-first-message of a SCRAM exchange pgwarden starts for
/// `user`, read over a raw connection that then goes away.
async fn scram_first(p: &pgwarden_proxy::Proxy, user: &str) -> String {
    use tokio::io::AsyncWriteExt;
    let mut sock = raw_login(p, &[("user", user), ("database", "postgres")]).await;
    let (tag, sasl) = next_message(&mut sock).await;
    assert_eq!(
        (tag, &sasl[..4]),
        (b'R', &10u32.to_be_bytes()[..]),
        "AuthenticationSASL"
    );
    let initial = sasl_initial(b"n,,n=,r=fyko+d2lbbFgONRv9qkxdawL");
    sock.write_all(&password_frame(&initial)).await.unwrap();
    let (tag, cont) = next_message(&mut sock).await;
    assert_eq!(
        (tag, &cont[..4]),
        (b'R', &11u32.to_be_bytes()[..]),
        "AuthenticationSASLContinue"
    );
    String::from_utf8(cont[4..].to_vec()).unwrap()
}

/// The code of the first authentication request pgwarden sends `user`
/// for `database` (5: md5, 10: SASL).
async fn first_auth_request(p: &pgwarden_proxy::Proxy, user: &str, database: &str) -> u32 {
    let mut sock = raw_login(p, &[("user", user), ("database", database)]).await;
    let (tag, body) = next_message(&mut sock).await;
    assert_eq!(tag, b'R');
    u32::from_be_bytes(body[..4].try_into().unwrap())
}

/// On an md5 line a role without a verifier (here, one that does not
/// exist) is asked what PostgreSQL would ask it: what the server's
/// `password_encryption` makes, so the request does not tell it from a
/// real role whose password is md5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_role_on_an_md5_line_is_asked_as_the_server_would_ask() {
    let s = setup(None, Duration::from_secs(60)).await;
    sql(
        &s.c.conninfo(0),
        "ALTER SYSTEM SET password_encryption = 'md5'",
    )
    .await;
    sql(&s.c.conninfo(0), "SELECT pg_reload_conf()").await;
    // carol's password is md5: she is asked for md5.
    assert_eq!(first_auth_request(&s.p, "carol", "md5db").await, 5);
    assert_eq!(first_auth_request(&s.p, "ghost", "md5db").await, 5);
    // And the exchange fails as a wrong password does.
    let (ok, stderr) = {
        let out = tokio::process::Command::new("psql")
            .env("PGPASSWORD", "nope")
            .arg(format!(
                "host=127.0.0.1 port={} user=ghost dbname=md5db",
                s.p.service_addrs()["read_write"].port()
            ))
            .args(["-c", "SELECT 1"])
            .output()
            .await
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    assert!(!ok);
    assert!(
        stderr.contains("password authentication failed for user \"ghost\""),
        "{stderr}"
    );
}

/// The SQLSTATE pgwarden ends a raw login with: the start-up with
/// `params`, then, after the first authentication request, `answer`.
async fn login_error(p: &pgwarden_proxy::Proxy, params: &[(&str, &str)], answer: &[u8]) -> String {
    use tokio::io::AsyncWriteExt;
    let mut sock = raw_login(p, params).await;
    loop {
        match next_message(&mut sock).await {
            (b'R', _) => sock.write_all(answer).await.unwrap(),
            (b'E', body) => {
                let code = body
                    .split(|b| *b == 0)
                    .find_map(|f| f.strip_prefix(b"C"))
                    .unwrap();
                return String::from_utf8(code.to_vec()).unwrap();
            }
            (other, _) => panic!("unexpected message {}", other as char),
        }
    }
}

/// Malformed logins are refused with the codes PostgreSQL uses: a bad
/// `replication` value is an invalid parameter value, a password message
/// that is not one string a protocol violation (not a wrong password), a
/// SCRAM authorization identity a feature not supported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_logins_get_postgres_s_codes() {
    let s = setup(None, Duration::from_secs(60)).await;
    let code = login_error(
        &s.p,
        &[
            ("user", "dave"),
            ("database", "postgres"),
            ("replication", "maybe"),
        ],
        b"",
    )
    .await;
    assert_eq!(code, "22023");
    // `password` method: a body without its NUL.
    let code = login_error(
        &s.p,
        &[("user", "dave"), ("database", "postgres")],
        &[b'p', 0, 0, 0, 7, b'a', b'b', b'c'],
    )
    .await;
    assert_eq!(code, "08P01");
    // SCRAM with an authorization identity.
    let authzid = password_frame(&sasl_initial(b"n,a=bob,n=,r=fyko+d2lbbFgONRv9qkxdawL"));
    let code = login_error(
        &s.p,
        &[("user", "alice"), ("database", "postgres")],
        &authzid,
    )
    .await;
    assert_eq!(code, "0A000");
}

/// A SASLInitialResponse without an initial response (length -1) gets
/// an empty challenge, and the client-first-message may follow as a
/// SASLResponse, as PostgreSQL takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_without_an_initial_response_logs_in() {
    use tokio::io::AsyncWriteExt;
    let s = setup(None, Duration::from_secs(60)).await;
    let mut sock = raw_login(&s.p, &[("user", "alice"), ("database", "postgres")]).await;
    let (tag, body) = next_message(&mut sock).await;
    assert_eq!((tag, &body[..4]), (b'R', &10u32.to_be_bytes()[..]));
    let mut initial = b"SCRAM-SHA-256\0".to_vec();
    initial.extend_from_slice(&(-1i32).to_be_bytes());
    sock.write_all(&password_frame(&initial)).await.unwrap();
    let (tag, body) = next_message(&mut sock).await;
    assert_eq!(
        (tag, &body[..]),
        (b'R', &11u32.to_be_bytes()[..]),
        "an empty challenge"
    );
    let mut scram = pgwarden_auth::ScramClient::with_password("alice-secret", [7u8; 18]);
    let first = scram.client_first().unwrap();
    sock.write_all(&password_frame(&first)).await.unwrap();
    let (tag, body) = next_message(&mut sock).await;
    assert_eq!((tag, &body[..4]), (b'R', &11u32.to_be_bytes()[..]));
    let fin = scram.server_first(&body[4..]).unwrap();
    sock.write_all(&password_frame(&fin)).await.unwrap();
    loop {
        match next_message(&mut sock).await {
            (b'Z', _) => break,
            (b'E', body) => panic!("{}", String::from_utf8_lossy(&body)),
            _ => {}
        }
    }
}

async fn check_methods(s: &Setup) {
    // +group: members of readers may use template1, others may not.
    let on_template1 = |user: &str, pw: &str| {
        format!(
            "host=127.0.0.1 port={} user={user} password={pw} dbname=template1",
            s.p.service_addrs()["read_write"].port()
        )
    };
    let erin = common::client(&on_template1("erin", "erin-secret")).await;
    assert!(
        erin.is_ok(),
        "a member of +readers was refused: {:?}",
        erin.err()
    );
    let Err(frank) = common::client(&on_template1("frank", "frank-secret")).await else {
        panic!("a non-member matched +readers");
    };
    assert_eq!(sqlstate(&frank).as_deref(), Some("28000"), "{frank}");
    // A superuser is no member of +readers (PostgreSQL's pg_hba.conf does
    // not count superuser powers as membership): postgres skips that line
    // and reaches its own trust line.
    let su = common::client(&on_template1("postgres", "unused")).await;
    assert!(su.is_ok(), "postgres matched +readers: {:?}", su.err());
    // SCRAM to pgwarden, then the ClientKey to the server.
    assert_eq!(login(&s.p, "alice", "alice-secret").await.unwrap(), "alice");
    // A name longer than 63 bytes is its first 63, as in PostgreSQL.
    let long = "r".repeat(63);
    assert_eq!(
        login(&s.p, &format!("{long}r"), "long-secret")
            .await
            .unwrap(),
        long
    );
    // A physical replication connection meets the `replication` lines,
    // not the `all` ones.
    let port = s.p.service_addrs()["read_write"].port();
    let (ok, stderr) = common::psql_replication(port).await;
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains(
            "pg_hba.conf rejects replication connection for host \"127.0.0.1\", user \"postgres\""
        ),
        "{stderr}"
    );
    // md5 against an md5 verifier, then md5 to the server.
    assert_eq!(login(&s.p, "carol", "carol-secret").await.unwrap(), "carol");
    // cleartext against a SCRAM verifier.
    assert_eq!(login(&s.p, "dave", "dave-secret").await.unwrap(), "dave");
    // A password that is not UTF-8 (a LATIN1 client's), compared as bytes
    // and used as bytes to log in to the server, as PostgreSQL does.
    let lena = |password: &'static [u8]| {
        let mut cfg = tokio_postgres::Config::new();
        cfg.host("127.0.0.1")
            .port(s.p.service_addrs()["read_write"].port())
            .user("lena")
            .dbname("postgres")
            .password(password);
        async move {
            let (db, conn) = cfg.connect(tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            db.simple_query("SELECT 1").await.map(|_| ())
        }
    };
    lena(LATIN1_PASSWORD).await.expect("a LATIN1 password");
    let wrong = lena(b"caf\xe9-wrong").await.unwrap_err();
    assert_eq!(sqlstate(&wrong).as_deref(), Some("28P01"), "{wrong:?}");
    // Wrong password, and an unknown role: the same answer.
    let wrong = login(&s.p, "alice", "nope").await.unwrap_err();
    assert_eq!(wrong.0.as_deref(), Some("28P01"), "{wrong:?}");
    assert_eq!(wrong.1, "password authentication failed for user \"alice\"");
    let unknown = login(&s.p, "nobody", "nope").await.unwrap_err();
    assert_eq!(unknown.0.as_deref(), Some("28P01"), "{unknown:?}");
    assert_eq!(
        unknown.1,
        "password authentication failed for user \"nobody\""
    );
    // An unknown role is offered the iteration count of the cluster's
    // real secrets, not a fixed one that would set it apart.
    let before = scram_first(&s.p, "ghost").await;
    assert_eq!(login(&s.p, "ivan", "ivan-secret").await.unwrap(), "ivan");
    assert!(scram_first(&s.p, "ivan").await.ends_with(",i=8192"));
    let after = scram_first(&s.p, "ghost").await;
    assert!(after.ends_with(",i=8192"), "{after}");
    // ... with the same salt as before, as a real role's would be.
    let salt = |m: &str| {
        m.split(',')
            .find(|p| p.starts_with("s="))
            .unwrap()
            .to_string()
    };
    assert_eq!(salt(&before), salt(&after));
    // reject, and no matching line.
    // 127.0.0.1 is one of this host's addresses, on its loopback network:
    // `samehost` and `samenet` match it, as in PostgreSQL.
    for (user, password) in [
        ("mallory", "x"),
        ("sam", "sam-secret"),
        ("nat", "nat-secret"),
    ] {
        let rejected = login(&s.p, user, password).await.unwrap_err();
        assert_eq!(rejected.0.as_deref(), Some("28000"), "{user}: {rejected:?}");
        assert!(
            rejected.1.contains("rejects connection"),
            "{user}: {rejected:?}"
        );
    }
    let Err(unmatched) = common::client(&format!(
        "{} dbname=template1",
        ci(&s.p, "nobody", "x").replace("dbname=postgres", "")
    ))
    .await
    else {
        panic!("a client without a matching hba line got in");
    };
    assert_eq!(sqlstate(&unmatched).as_deref(), Some("28000"));
    let msg = unmatched.as_db_error().unwrap().message().to_string();
    assert!(
        msg.starts_with(
            "no pg_hba.conf entry for host \"127.0.0.1\", user \"nobody\", database \"template1\""
        ),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_methods_failures_and_server_login() {
    let s = setup(None, Duration::from_secs(60)).await;
    check_methods(&s).await;
    // Failures are counted by reason.
    let http = s.p.http_addr().unwrap();
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
        .await
        .unwrap();
    assert!(
        // alice's and lena's wrong passwords, and the unknown role.
        body.contains("pgwarden_auth_failures_total{reason=\"bad_password\"} 3"),
        "{body}"
    );
    assert!(
        // mallory, sam, nat and the replication connection.
        body.contains("pgwarden_auth_failures_total{reason=\"hba_reject\"} 4"),
        "{body}"
    );
    let _ = &s.e;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_pooling_logs_in_with_the_clients_proof() {
    let s = setup(
        Some(PoolSettings {
            size: 2,
            ..PoolSettings::default()
        }),
        Duration::from_secs(60),
    )
    .await;
    check_methods(&s).await;
    // The pooled connections run as the client's role.
    for _ in 0..3 {
        assert_eq!(login(&s.p, "alice", "alice-secret").await.unwrap(), "alice");
    }
}

/// [`setup`] with a transaction pool of two and verifiers cached for
/// 300 ms.
async fn pooled_setup() -> Setup {
    setup(
        Some(PoolSettings {
            size: 2,
            ..PoolSettings::default()
        }),
        Duration::from_millis(300),
    )
    .await
}

/// Logs in as `user` until the login is refused with `message` (the
/// verifier cache holds a change back for up to its TTL), and checks the
/// refusal's SQLSTATE.
async fn refused_with(s: &Setup, user: &str, password: &str, code: &str, message: &str) {
    let refused = pgwarden_testkit::eventually(
        "the login refused once the cache TTL is over",
        WAIT,
        || async {
            match login(&s.p, user, password).await {
                Ok(u) => Err(format!("logged in as {u}")),
                // An earlier answer, still cached.
                Err(e) if e.1 != message => Err(e.1),
                Err(e) => Ok(e),
            }
        },
    )
    .await;
    assert_eq!(refused.0.as_deref(), Some(code), "{message}: {refused:?}");
}

/// A password that expires (`VALID UNTIL`) stops working through a
/// transaction pool too, where the pool's open connection to the server
/// would let the client in without a login of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_password_is_refused_by_the_pool() {
    let s = pooled_setup().await;
    assert_eq!(login(&s.p, "alice", "alice-secret").await.unwrap(), "alice");
    sql(
        &s.c.conninfo(0),
        "ALTER ROLE alice VALID UNTIL '2000-01-01'",
    )
    .await;
    refused_with(
        &s,
        "alice",
        "alice-secret",
        "28P01",
        "password authentication failed for user \"alice\"",
    )
    .await;
}

/// On a `trust` line too, a role made NOLOGIN or dropped is refused
/// through a transaction pool, whose open connections would serve it
/// without a login of its own, as PostgreSQL refuses it at every login.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_no_longer_log_in_is_refused_by_the_pool() {
    let s = pooled_setup().await;
    assert_eq!(login(&s.p, "trudy", "unused").await.unwrap(), "trudy");
    let admin = s.c.conninfo(0);
    sql(&admin, "ALTER ROLE trudy NOLOGIN").await;
    refused_with(
        &s,
        "trudy",
        "unused",
        "28000",
        "role \"trudy\" is not permitted to log in",
    )
    .await;
    sql(&admin, "DROP ROLE trudy").await;
    refused_with(
        &s,
        "trudy",
        "unused",
        "28000",
        "role \"trudy\" does not exist",
    )
    .await;
}

/// An authentication request answered with another message is a protocol
/// violation (08P01), as PostgreSQL says, not a wrong password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_of_another_type_is_a_protocol_violation() {
    use std::io::{Read, Write};
    let s = setup(None, Duration::from_secs(60)).await;
    let addr = s.p.service_addrs()["read_write"];
    let replies = tokio::task::spawn_blocking(move || {
        let mut sock = std::net::TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut body = 196_608u32.to_be_bytes().to_vec();
        for part in ["user", "alice", "database", "postgres", ""] {
            body.extend_from_slice(part.as_bytes());
            body.push(0);
        }
        let mut startup = ((body.len() + 4) as u32).to_be_bytes().to_vec();
        startup.extend_from_slice(&body);
        sock.write_all(&startup).unwrap();
        let mut tags = Vec::new();
        let mut fields = Vec::new();
        loop {
            let mut head = [0u8; 5];
            if sock.read_exact(&mut head).is_err() {
                return (tags, fields);
            }
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            let mut rest = vec![0u8; len - 4];
            sock.read_exact(&mut rest).unwrap();
            tags.push(head[0]);
            if head[0] == b'R' {
                // Asked for SASL: a Query instead.
                sock.write_all(b"Q\0\0\0\x0dSELECT 1\0").unwrap();
            }
            if head[0] == b'E' {
                fields = rest;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(replies.0, vec![b'R', b'E'], "{replies:?}");
    let text = String::from_utf8_lossy(&replies.1);
    assert!(text.contains("C08P01"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verifier_cache_expires_and_slow_clients_are_dropped() {
    let s = setup(None, Duration::from_millis(500)).await;
    assert_eq!(login(&s.p, "alice", "alice-secret").await.unwrap(), "alice");
    sql(&s.c.conninfo(0), "ALTER ROLE alice PASSWORD 'rotated'").await;
    pgwarden_testkit::eventually(
        "new password accepted after the cache TTL",
        WAIT,
        || async {
            login(&s.p, "alice", "rotated")
                .await
                .map(|_| ())
                .map_err(|e| format!("{e:?}"))
        },
    )
    .await;
    let old = login(&s.p, "alice", "alice-secret").await.unwrap_err();
    assert_eq!(old.0.as_deref(), Some("28P01"));
    // auth_timeout (1 s here): a client that never authenticates is dropped.
    let addr = s.p.service_addrs()["read_write"];
    let started = std::time::Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut sock = std::net::TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut buf = Vec::new();
        let _ = sock.read_to_end(&mut buf);
        buf
    })
    .await
    .unwrap();
    // auth_timeout is 1 s here, 30 s by default.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "slow client kept for {:?}",
        started.elapsed()
    );
    // Told why, as PostgreSQL tells a client that never sends its
    // start-up packet.
    assert_eq!(out.first(), Some(&b'E'), "no ErrorResponse: {out:?}");
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("C08P01"), "{text}");
    assert!(
        text.contains("timeout waiting for the startup packet"),
        "{text}"
    );
}

/// `peer` on a Unix-domain socket: the kernel's word on which operating-
/// system user runs the client must match the user it logs in as
/// (PostgreSQL's message otherwise, 28000), with and without pooling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_authentication_on_a_unix_socket() {
    let c = TestCluster::builder().replicas(0).start();
    let me = nix::unistd::User::from_uid(nix::unistd::getuid())
        .unwrap()
        .expect("this process's user has a name")
        .name;
    let other = if me == "alice" { "bob" } else { "alice" };
    sql(
        &c.conninfo(0),
        &format!("CREATE ROLE \"{me}\" LOGIN; CREATE ROLE {other} LOGIN"),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let sockets = dir.path().join("run");
    std::fs::create_dir(&sockets).unwrap();
    let hba = dir.path().join("pg_hba.conf");
    common::authenticate_with(
        hba.clone(),
        "local all all peer\nhost all postgres 127.0.0.1/32 trust\n",
    );
    common::UNIX_SOCKET_DIR.with(|d| *d.borrow_mut() = Some(sockets.clone()));
    let pooled = PoolSettings {
        size: 2,
        ..PoolSettings::default()
    };
    for pool in [None, Some(pooled)] {
        let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool, 1000).await;
        common::ready(&e, 1).await;
        let port = p.service_addrs()["read_write"].port();
        let local = |user: &str| {
            format!(
                "host={} port={port} user={user} dbname=postgres",
                sockets.display()
            )
        };
        let db = common::client(&local(&me)).await.unwrap();
        assert_eq!(common::one(&db, "SELECT current_user::text").await, me);
        let err = common::client(&local(other)).await.unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("28000"), "{err}");
        assert_eq!(
            err.as_db_error().unwrap().message(),
            format!("Peer authentication failed for user \"{other}\"")
        );
        // Over TCP no line matches this user.
        let err = common::client(
            &common::via(&p, "read_write").replace("user=postgres", &format!("user={me}")),
        )
        .await
        .unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("28000"), "{err}");
    }
}

/// A relayed session that pgwarden logs in to the server itself ([auth])
/// gives up on a server that takes the connection and never answers,
/// after `server_connect_timeout`, as the pool's logins do: the client
/// gets 08006 instead of waiting for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_the_login_is_given_up() {
    let c = TestCluster::builder().replicas(0).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(0).parse().unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    common::authenticate_with(
        dir.path().join("pg_hba.conf"),
        "host all postgres 127.0.0.1/32 trust\n",
    );
    let (e, p) = proxy_with(
        &[relay.addr().to_string()],
        Duration::from_secs(3),
        None,
        1000,
    )
    .await;
    until(&e, "primary", WAIT, |s| {
        s.topology.primary().map(|_| ()).ok_or("none".into())
    })
    .await;
    let first = common::client(&common::via(&p, "read_write"))
        .await
        .unwrap();
    assert_eq!(common::one(&first, "SELECT 1").await, "1");
    // The probe's connection goes on; new ones reach the relay and stop.
    relay.set_hold_new(true);
    let started = std::time::Instant::now();
    let Err(err) = tokio::time::timeout(WAIT, common::client(&common::via(&p, "read_write")))
        .await
        .expect("the login is given up")
    else {
        panic!("a login without an answering server");
    };
    assert_eq!(sqlstate(&err).as_deref(), Some("08006"), "{err}");
    assert!(started.elapsed() < WAIT, "{:?}", started.elapsed());
    relay.set_hold_new(false);
    assert_eq!(common::one(&first, "SELECT 2").await, "2");
}
