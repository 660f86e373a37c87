//! The connection manager with a real cluster and real clients.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{
    client, http_get, one, proxy, ready, sql_value, sqlstate, startup_packet, until, via,
};
use pgwarden_testkit::{StopMode, TestCluster};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_write_reaches_primary_and_read_only_a_replica() {
    let c = TestCluster::builder().replicas(1).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 2).await;
    let rw = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(one(&rw, "SELECT pg_is_in_recovery()").await, "f");
    assert_eq!(
        one(&rw, "SELECT inet_server_port()").await,
        c.port(0).to_string()
    );
    let ro = client(&via(&p, "read_only")).await.unwrap();
    assert_eq!(one(&ro, "SELECT pg_is_in_recovery()").await, "t");
    assert_eq!(one(&ro, "SHOW transaction_read_only").await, "on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_passthrough_extended_binary_errors_notices_and_large_rows() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 1).await;
    let db = client(&via(&p, "read_write")).await.unwrap();
    // Extended protocol with parameters and binary results.
    let row = db
        .query_one(
            "SELECT $1::int8 * 2, $2::text || '!', $3::bytea",
            &[&21i64, &"hi", &vec![0u8, 255, 1]],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 42);
    assert_eq!(row.get::<_, String>(1), "hi!");
    assert_eq!(row.get::<_, Vec<u8>>(2), vec![0u8, 255, 1]);
    // A named prepared statement reused.
    let stmt = db.prepare("SELECT $1::int4 + 1").await.unwrap();
    for i in 0..3i32 {
        assert_eq!(
            db.query_one(&stmt, &[&i]).await.unwrap().get::<_, i32>(0),
            i + 1
        );
    }
    // Errors pass through with their SQLSTATE and the session lives on.
    let err = db.simple_query("SELECT 1/0").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("22012"));
    // Transactions.
    db.batch_execute("CREATE TABLE t (id int primary key, v text); BEGIN; INSERT INTO t VALUES (1, 'a'); COMMIT;")
        .await
        .unwrap();
    assert_eq!(one(&db, "SELECT v FROM t WHERE id = 1").await, "a");
    // ParameterStatus follows SET.
    db.batch_execute("SET application_name = 'through-pgwarden'")
        .await
        .unwrap();
    assert_eq!(one(&db, "SHOW application_name").await, "through-pgwarden");
    // A large row (64 MiB) streams through.
    let big = db
        .query_one("SELECT repeat('x', 64 * 1024 * 1024)", &[])
        .await
        .unwrap();
    assert_eq!(big.get::<_, String>(0).len(), 64 * 1024 * 1024);
    // And a large value the other way.
    let payload = "y".repeat(8 * 1024 * 1024);
    let n = db
        .query_one("SELECT length($1::text)", &[&payload])
        .await
        .unwrap();
    assert_eq!(n.get::<_, i32>(0), 8 * 1024 * 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_copy_listen_notify_and_notices() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 1).await;
    let port = p.service_addrs()["read_write"].port().to_string();
    let psql = |args: &[&str], stdin: &str| {
        let mut child = std::process::Command::new("psql")
            .args([
                "-X",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-v",
                "ON_ERROR_STOP=1",
            ])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("psql");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "psql failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    psql(&["-c", "CREATE TABLE c (a int, b text)"], "");
    let rows: String = (0..5000).map(|i| format!("{i}\trow {i}\n")).collect();
    psql(&["-c", "COPY c FROM STDIN"], &rows);
    let (out, _) = psql(&["-At", "-c", "SELECT count(*), sum(a) FROM c"], "");
    assert_eq!(out.trim(), "5000|12497500");
    let (out, _) = psql(
        &[
            "-At",
            "-c",
            "COPY (SELECT a FROM c ORDER BY a LIMIT 3) TO STDOUT",
        ],
        "",
    );
    assert_eq!(out, "0\n1\n2\n");
    let (out, _) = psql(
        &[
            "-c",
            "LISTEN ch",
            "-c",
            "NOTIFY ch, 'hello'",
            "-c",
            "SELECT 1",
        ],
        "",
    );
    assert!(
        out.contains("Asynchronous notification \"ch\" with payload \"hello\""),
        "{out}"
    );
    let (_, err) = psql(
        &["-c", "DO $$BEGIN RAISE NOTICE 'note from server'; END$$"],
        "",
    );
    assert!(err.contains("note from server"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_startup_packets_get_08p01_and_a_close() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    let addr = p.service_addrs()["read_write"];
    let exchange = |bytes: Vec<u8>| {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(&bytes).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        out
    };
    let error_code = |out: &[u8]| -> String {
        assert_eq!(out.first(), Some(&b'E'), "an ErrorResponse: {out:?}");
        let text = String::from_utf8_lossy(out);
        let c = text.find("C08P01").or_else(|| text.find('C')).unwrap();
        text[c + 1..c + 6].to_string()
    };
    // Too short a length.
    assert_eq!(error_code(&exchange(vec![0, 0, 0, 5, 0])), "08P01");
    // Larger than 10,000 bytes.
    let mut big = 20_000u32.to_be_bytes().to_vec();
    big.extend(vec![0u8; 100]);
    assert_eq!(error_code(&exchange(big)), "08P01");
    // No user: PostgreSQL's own code for it is 28000.
    let mut m = Vec::new();
    m.extend(196_608u32.to_be_bytes());
    m.extend(b"database\0x\0\0");
    let mut pkt = ((m.len() + 4) as u32).to_be_bytes().to_vec();
    pkt.extend(m);
    assert_eq!(error_code(&exchange(pkt)), "28000");
    // SSLRequest is answered 'N' (no TLS yet), and the session can go on.
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]).unwrap();
    let mut b = [0u8; 1];
    s.read_exact(&mut b).unwrap();
    assert_eq!(b[0], b'N');
    // Each encryption is asked for once, in either order, as PostgreSQL
    // allows; asked again, the packet is refused as an unknown protocol.
    const SSL: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    const GSS: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x30];
    for (requests, declined, version) in [
        (&[SSL, SSL][..], 1, "1234.5679"),
        (&[GSS, GSS], 1, "1234.5680"),
        (&[SSL, GSS, SSL], 2, "1234.5679"),
        (&[GSS, SSL, GSS], 2, "1234.5680"),
    ] {
        let out = exchange(requests.concat());
        assert_eq!(&out[..declined], &b"NN"[..declined], "{out:?}");
        assert_eq!(error_code(&out[declined..]), "0A000");
        let text = String::from_utf8_lossy(&out);
        assert!(
            text.contains(&format!("unsupported frontend protocol {version}")),
            "{text}"
        );
    }
    // The proxy still serves normal clients.
    let db = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(one(&db, "SELECT 1").await, "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_requests_reach_the_right_backend_and_unknown_keys_are_ignored() {
    let c = TestCluster::builder().replicas(1).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 2).await;
    for service in ["read_write", "read_only"] {
        let db = client(&via(&p, service)).await.unwrap();
        let token = db.cancel_token();
        let q = tokio::spawn(async move { db.simple_query("SELECT pg_sleep(30)").await });
        // Cancel once the query is running on the server.
        let target = if service == "read_write" {
            c.conninfo(0)
        } else {
            c.conninfo(1)
        };
        pgwarden_testkit::eventually("sleep running", WAIT, || {
            let t = target.clone();
            async move {
                match sql_value(
                    &t,
                    "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)'",
                )
                .await
                .as_deref()
                {
                    Some("1") => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        })
        .await;
        token.cancel_query(tokio_postgres::NoTls).await.unwrap();
        let err = tokio::time::timeout(Duration::from_secs(10), q)
            .await
            .expect("cancelled in time")
            .unwrap()
            .unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("57014"), "{service}: {err}");
    }
    // A made-up key: the connection is closed without an answer and
    // nothing else is affected.
    let addr = p.service_addrs()["read_write"];
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&pgwarden_wire::encode::cancel_request(12345, 67890))
        .unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(out.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_sessions_cannot_be_made_read_write() {
    let mut c = TestCluster::builder().replicas(1).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 2).await;
    let rw = client(&via(&p, "read_write")).await.unwrap();
    rw.batch_execute("CREATE TABLE w (x int)").await.unwrap();
    let replica = c.conninfo(1);
    pgwarden_testkit::eventually("table replicated", WAIT, || {
        let r = replica.clone();
        async move {
            match sql_value(&r, "SELECT to_regclass('w') IS NOT NULL")
                .await
                .as_deref()
            {
                Some("t") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;

    let attacks = [
        "SET default_transaction_read_only = off",
        "set  DEFAULT_TRANSACTION_READ_ONLY to false",
        "SET SESSION default_transaction_read_only = off",
        "SET/**/default_transaction_read_only=off",
        "SET \"default_transaction_read_only\" = off",
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
        "BEGIN READ WRITE",
        "BEGIN ISOLATION LEVEL SERIALIZABLE, READ WRITE",
        "START TRANSACTION READ WRITE",
        "SET TRANSACTION READ WRITE",
        "SET LOCAL transaction_read_only = off",
        "RESET ALL",
        "RESET default_transaction_read_only",
        "SELECT set_config('default_transaction_read_only', 'off', false)",
        "SELECT pg_catalog.set_config('transaction_read_only', 'off', true)",
        "SELECT 1; SET default_transaction_read_only = off",
        "DO $$BEGIN EXECUTE 'SET default_transaction_read_only = off'; END$$",
        "DO $$BEGIN PERFORM set_config('default_transaction_read_only', 'off', false); END$$",
        "SET U&\"default!005ftransaction!005fread!005fonly\" UESCAPE $$!$$ = off",
        "SET U&\"default!005ftransaction!005fread!005fonly\" UESCAPE E'!' = off; COMMIT",
        // SQL assembled at run time is out of the lexer's sight; what it
        // needs to matter is a new transaction within the same message,
        // switched back before the server would report the change.
        "DO $$BEGIN EXECUTE 'SET default_transaction' || '_read_only = off'; COMMIT; \
         INSERT INTO w VALUES (1); COMMIT; \
         EXECUTE 'SET default_transaction' || '_read_only = on'; END$$",
        "SELECT query_to_xml('SELECT set_' || 'config(''default_transaction' || \
         '_read_only'', ''off'', false)', true, false, ''); COMMIT; INSERT INTO w VALUES (2); \
         SELECT query_to_xml('SELECT set_' || 'config(''default_transaction' || \
         '_read_only'', ''on'', false)', true, false, '')",
        // Passing DISCARD ALL is no reason to look no further.
        "SELECT 'discard all'; COMMIT; BEGIN READ WRITE; INSERT INTO w VALUES (3); COMMIT",
        // Encodings whose characters may end in a backslash would let a
        // string hide SQL from the check in the messages that follow.
        "SET client_encoding = 'SJIS'",
        "SET NAMES 'big5'",
        // Other languages' commits are calls the check cannot see.
        "DO LANGUAGE plperl $$ spi_commit(); $$",
    ];
    // Also when the read-only service has fallen back to the primary.
    for phase in ["replica", "primary fallback"] {
        if phase == "primary fallback" {
            c.node(1).stop(StopMode::Fast).unwrap();
            until(&e, "replica down", WAIT, |s| {
                (!s.topology.hosts()[1].alive)
                    .then_some(())
                    .ok_or("alive".into())
            })
            .await;
        }
        let ro = client(&via(&p, "read_only")).await.unwrap();
        let expect_recovery = if phase == "replica" { "t" } else { "f" };
        assert_eq!(
            one(&ro, "SELECT pg_is_in_recovery()").await,
            expect_recovery,
            "{phase}"
        );
        for attack in attacks {
            // Simple protocol.
            let err = ro.simple_query(attack).await.expect_err(attack);
            assert_eq!(
                sqlstate(&err).as_deref(),
                Some("25006"),
                "{phase}: {attack}: {err}"
            );
            // Extended protocol (Parse/Bind/Execute).
            if !attack.contains(';') {
                let err = ro.execute(attack, &[]).await.expect_err(attack);
                assert_eq!(
                    sqlstate(&err).as_deref(),
                    Some("25006"),
                    "{phase} extended: {attack}: {err}"
                );
            }
            ro.simple_query("ROLLBACK").await.unwrap();
            assert_eq!(
                one(&ro, "SHOW transaction_read_only").await,
                "on",
                "{phase}: after {attack}"
            );
        }
        let err = ro
            .simple_query("INSERT INTO w VALUES (1)")
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("25006"), "{phase}: {err}");
        // Legitimate session settings still work.
        for ok in [
            "SET search_path TO public",
            "BEGIN READ ONLY",
            "COMMIT",
            "DISCARD ALL",
        ] {
            ro.batch_execute(ok)
                .await
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        assert_eq!(one(&ro, "SHOW transaction_read_only").await, "on");
    }
    assert_eq!(one(&rw, "SELECT count(*) FROM w").await, "0");
    // A startup packet that asks for read-write is refused.
    let conninfo = format!(
        "{} options='-c default_transaction_read_only=off'",
        via(&p, "read_only")
    );
    let Err(err) = client(&conninfo).await else {
        panic!("a read-write startup packet was accepted");
    };
    assert_eq!(sqlstate(&err).as_deref(), Some("25006"), "{err}");
    // So is one in such an encoding, and a replication connection (its
    // commands are not SQL the check reads).
    let Err(err) = client(&format!(
        "{} options='-c client_encoding=SJIS'",
        via(&p, "read_only")
    ))
    .await
    else {
        panic!("an SJIS session was accepted");
    };
    assert_eq!(sqlstate(&err).as_deref(), Some("25006"), "{err}");
    let port = p.service_addrs()["read_only"].port();
    let (ok, stderr) = common::psql_replication(port).await;
    assert!(
        !ok && stderr.contains("replication connections are not allowed"),
        "{stderr}"
    );
    let _ = e;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_host_waits_then_57p03_naming_the_service() {
    let mut c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_millis(1500)).await;
    ready(&e, 1).await;
    c.node(0).stop(StopMode::Fast).unwrap();
    until(&e, "primary down", WAIT, |s| {
        s.topology
            .primary()
            .is_none()
            .then_some(())
            .ok_or("still primary".into())
    })
    .await;
    let started = std::time::Instant::now();
    let Err(err) = client(&via(&p, "read_write")).await else {
        panic!("connected without a primary");
    };
    let waited = started.elapsed();
    assert_eq!(sqlstate(&err).as_deref(), Some("57P03"), "{err}");
    let text = err
        .as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_default();
    assert!(
        text.contains("read_write") && text.contains("no primary"),
        "{text}"
    );
    assert!(
        waited >= Duration::from_millis(1400),
        "waited only {waited:?}"
    );

    // A client that arrives while the primary is down is served as soon
    // as it is back, within the wait.
    let conninfo = via(&p, "read_write");
    let pending = tokio::spawn(async move { client(&conninfo).await });
    c.node(0).start().unwrap();
    let db = pending.await.unwrap();
    // The wait (1.5 s) may be shorter than a restart on a slow machine;
    // then the client saw 57P03 and a retry must succeed.
    let db = match db {
        Ok(db) => db,
        Err(e2) => {
            assert_eq!(sqlstate(&e2).as_deref(), Some("57P03"));
            ready(&e, 1).await;
            client(&via(&p, "read_write")).await.unwrap()
        }
    };
    assert_eq!(one(&db, "SELECT 1").await, "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_change_ends_old_sessions_and_routes_new_ones_to_the_new_primary() {
    let mut c = TestCluster::builder().replicas(1).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(5)).await;
    ready(&e, 2).await;
    let old = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(
        one(&old, "SELECT inet_server_port()").await,
        c.port(0).to_string()
    );
    c.node(1).promote().unwrap();
    until(&e, "node2 is the primary", WAIT, |s| {
        (s.topology.primary() == Some(1))
            .then_some(())
            .ok_or(format!("{:?}", s.topology.primary()))
    })
    .await;
    // The old session is ended with an error that says why.
    pgwarden_testkit::eventually("old session ended", WAIT, || {
        let r = old.is_closed();
        async move {
            if r {
                Ok(())
            } else {
                Err("open".into())
            }
        }
    })
    .await;
    let e2 = old.simple_query("SELECT 1").await.unwrap_err();
    assert!(
        e2.is_closed() || sqlstate(&e2).as_deref() == Some("57P01"),
        "{e2}"
    );
    let new = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(
        one(&new, "SELECT inet_server_port()").await,
        c.port(1).to_string()
    );
    assert_eq!(one(&new, "SELECT pg_is_in_recovery()").await, "f");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_on_a_partitioned_host_are_closed_promptly() {
    let c = TestCluster::builder().replicas(1).start();
    // The replica is reached (by the probe and by sessions) through a relay.
    let relay = pgwarden_testkit::Relay::start(c.addr(1).parse().unwrap()).unwrap();
    let addrs = vec![c.addr(0), relay.addr().to_string()];
    let (e, p) = proxy(&addrs, Duration::from_secs(3)).await;
    ready(&e, 2).await;
    let ro = client(&via(&p, "read_only")).await.unwrap();
    assert_eq!(one(&ro, "SELECT pg_is_in_recovery()").await, "t");
    // A partition: sockets stay open and silent, so without pgwarden the
    // client would wait for TCP time-outs (minutes).
    relay.set_blackhole(true);
    let q = tokio::spawn(async move { ro.simple_query("SELECT 1").await });
    let r = tokio::time::timeout(Duration::from_secs(15), q).await;
    relay.set_blackhole(false);
    let err = r.expect("closed promptly").unwrap().unwrap_err();
    assert!(
        err.is_closed() || sqlstate(&err).as_deref() == Some("08006"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_health_cluster_and_metrics() {
    let c = TestCluster::builder().replicas(1).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 2).await;
    let db = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(one(&db, "SELECT 1").await, "1");
    let http = p.http_addr().unwrap();
    let (status, body) = tokio::task::spawn_blocking(move || http_get(http, "/health"))
        .await
        .unwrap();
    assert_eq!((status, body.trim()), (200, "ok"));
    let (status, body) = tokio::task::spawn_blocking(move || http_get(http, "/cluster"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["primary"], serde_json::json!(c.addr(0)));
    assert_eq!(doc["hosts"].as_array().unwrap().len(), 2);
    let services = doc["services"].as_array().unwrap();
    let rw = services.iter().find(|s| s["name"] == "read_write").unwrap();
    assert_eq!(rw["targets"], serde_json::json!([c.addr(0)]));
    let ro = services.iter().find(|s| s["name"] == "read_only").unwrap();
    assert_eq!(ro["targets"], serde_json::json!([c.addr(1)]));
    assert_eq!(ro["read_only"], true);
    assert_eq!(rw["refused"], serde_json::Value::Null);
    // A service that refuses new sessions (writes blocked by the HA agent)
    // says why, beside targets it does not serve.
    p.refusal_switch()
        .set("read_write", Some("writes are refused: test".into()));
    let (_, body) = tokio::task::spawn_blocking(move || http_get(http, "/cluster"))
        .await
        .unwrap();
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    let rw = doc["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "read_write")
        .unwrap()
        .clone();
    assert_eq!(rw["refused"], "writes are refused: test");
    assert_eq!(rw["targets"], serde_json::json!([c.addr(0)]));
    p.refusal_switch().set("read_write", None);
    let (status, body) = tokio::task::spawn_blocking(move || http_get(http, "/metrics"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    for series in [
        "pgwarden_client_connections{service=\"read_write\"} 1",
        "pgwarden_server_connections{host=",
        "pgwarden_client_received_bytes_total{service=\"read_write\"}",
        "pgwarden_client_sent_bytes_total{service=\"read_write\"}",
        "pgwarden_routing_decisions_total{service=\"read_write\",host=",
        "pgwarden_host_up{host=",
        "pgwarden_host_primary{host=",
        "pgwarden_host_rtt_seconds{host=",
        "pgwarden_host_lag_bytes{host=",
    ] {
        assert!(body.contains(series), "missing {series} in\n{body}");
    }
}

/// The HTTP port holds no connection that sends nothing: one that sends
/// no request head (or part of one) within 10 seconds is closed, and
/// past 256 connections more are closed at once, while a well-behaved
/// request is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_port_drops_idle_and_excess_connections() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 1).await;
    let http = p.http_addr().unwrap();
    pgwarden_testkit::http::drops_idle_and_excess_connections(http).await;
    let (status, body) = tokio::task::spawn_blocking(move || http_get(http, "/health"))
        .await
        .unwrap();
    assert_eq!((status, body.trim()), (200, "ok"));
}

/// With `engine.worker_fill`, new clients fill the first worker, then the
/// next, then go to the worker with the fewest; a client that leaves frees
/// its place. With 0 they are shared out in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_fill_one_worker_before_the_next() {
    let c = TestCluster::builder().replicas(0).start();
    common::WORKER_FILL.with(|f| f.set(3));
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 1).await;
    let http = p.http_addr().unwrap();
    let mut clients = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..7 {
        let db = client(&via(&p, "read_write")).await.unwrap();
        assert_eq!(one(&db, "SELECT 1").await, "1");
        clients.push(db);
        seen.push(common::worker_clients(http).await);
    }
    assert_eq!(
        seen,
        [
            (1.0, 0.0),
            (2.0, 0.0),
            (3.0, 0.0),
            (3.0, 1.0),
            (3.0, 2.0),
            (3.0, 3.0),
            (4.0, 3.0),
        ]
    );
    drop(clients);
    let deadline = std::time::Instant::now() + WAIT;
    while common::worker_clients(http).await != (0.0, 0.0) {
        assert!(
            std::time::Instant::now() < deadline,
            "closed clients still counted: {:?}",
            common::worker_clients(http).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    p.shutdown().await;

    common::WORKER_FILL.with(|f| f.set(0));
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 1).await;
    let http = p.http_addr().unwrap();
    let mut clients = Vec::new();
    for _ in 0..4 {
        let db = client(&via(&p, "read_write")).await.unwrap();
        assert_eq!(one(&db, "SELECT 1").await, "1");
        clients.push(db);
    }
    assert_eq!(common::worker_clients(http).await, (2.0, 2.0), "in turn");
}

/// Whether the established TCP socket from `local` to `remote` port has
/// its keepalive timer running (the `tr` field of /proc/net/tcp is 2):
/// an idle connection without SO_KEEPALIVE has no timer at all.
fn keepalive_timer(local: u16, remote: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next().unwrap(), 16).unwrap();
    let row = table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f[3] == "01" && port(f[1]) == local && port(f[2]) == remote)
        .unwrap_or_else(|| panic!("no established socket {local} -> {remote}:\n{table}"));
    row[5].starts_with("02:")
}

/// Both legs of a relayed session have TCP keepalive on (with the
/// system's timings), as PostgreSQL and libpq do: a client host that
/// vanishes without closing frees its session and the backend behind it
/// instead of holding them for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_connections_have_tcp_keepalive() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 1).await;
    let listen = p.service_addrs()["read_write"].port();
    let mut s = std::net::TcpStream::connect(p.service_addrs()["read_write"]).unwrap();
    let mine = s.local_addr().unwrap().port();
    // A startup packet, so that the server leg exists too.
    s.write_all(&startup_packet(&[
        ("user", "postgres"),
        ("database", "postgres"),
        ("application_name", "ka"),
    ]))
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 1];
    s.read_exact(&mut greeting).unwrap();
    assert!(keepalive_timer(listen, mine), "client leg");
    let server_port: u16 = sql_value(
        &c.conninfo(0),
        "SELECT client_port FROM pg_stat_activity WHERE application_name = 'ka'",
    )
    .await
    .unwrap()
    .parse()
    .unwrap();
    let pg_port = c.addr(0).rsplit(':').next().unwrap().parse().unwrap();
    assert!(keepalive_timer(server_port, pg_port), "server leg");
}

/// A read-write session never starts on a standby. During a switchover
/// the old primary comes back as a standby a moment before the topology
/// shows it; a session that reached it then would fail every write. The
/// server says what it is at login (`in_hot_standby`), and the client is
/// refused with 57P03 ("reconnect") instead; a pooled client waits for a
/// primary instead of getting a standby's connection. Here the host's
/// address starts leading to a replica while the probe's connection still
/// reaches the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_write_session_never_starts_on_a_standby() {
    let c = TestCluster::builder().replicas(1).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(0).parse().unwrap()).unwrap();
    for pooled in [false, true] {
        relay.set_target(c.addr(0).parse().unwrap());
        let settings = pooled.then(|| pgwarden_proxy::PoolSettings {
            size: 1,
            query_wait_timeout: Duration::from_secs(2),
            ..pgwarden_proxy::PoolSettings::default()
        });
        let (e, p) = common::proxy_with(
            &[relay.addr().to_string()],
            Duration::from_secs(2),
            settings,
            10_000,
        )
        .await;
        ready(&e, 1).await;
        relay.set_target(c.addr(1).parse().unwrap());
        let err = match client(&via(&p, "read_write")).await {
            Ok(cl) => match cl.simple_query("SELECT pg_is_in_recovery()").await {
                Ok(r) => panic!("pooled {pooled}: a session on the standby: {r:?}"),
                Err(e) => e,
            },
            Err(e) => e,
        };
        let code = sqlstate(&err);
        let want = if pooled { "08006" } else { "57P03" };
        assert_eq!(code.as_deref(), Some(want), "pooled {pooled}: {err}");
        let message = err.as_db_error().map(|d| d.message().to_string());
        assert!(
            message
                .as_deref()
                .is_some_and(|m| m.contains("is a standby, not the primary")),
            "pooled {pooled}: {message:?}"
        );
        // The probe still sees the primary it reached before.
        assert!(e.snapshot().topology.primary().is_some());
    }
}

/// With `[auth]` pgwarden logs a relayed session in itself, so a standby
/// where the primary is wanted is found before the client is greeted: the
/// client waits for the primary within its `connect_wait_timeout`, and is
/// served by it once new connections reach it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_login_that_lands_on_a_standby_waits_for_the_primary() {
    let c = TestCluster::builder().replicas(1).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(0).parse().unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    common::authenticate_with(
        dir.path().join("pg_hba.conf"),
        "host all postgres 127.0.0.1/32 trust\n",
    );
    let (e, p) = proxy(&[relay.addr().to_string()], Duration::from_secs(20)).await;
    ready(&e, 1).await;
    // The probe's connection stays on the primary; new ones reach the
    // standby.
    relay.set_target(c.addr(1).parse().unwrap());
    let before = relay.accepted();
    let conninfo = via(&p, "read_write");
    let mut pending = tokio::spawn(async move { client(&conninfo).await });
    // Tried twice: the first login found the standby.
    pgwarden_testkit::eventually("the login is tried again", WAIT, || async {
        let n = relay.accepted() - before;
        (n >= 2).then_some(()).ok_or(format!("{n} attempts"))
    })
    .await;
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut pending)
            .await
            .is_err(),
        "the client was answered while only the standby was reached"
    );
    relay.set_target(c.addr(0).parse().unwrap());
    let db = tokio::time::timeout(WAIT, pending)
        .await
        .expect("served once the primary is reached")
        .unwrap()
        .expect("connected");
    assert_eq!(one(&db, "SELECT pg_is_in_recovery()").await, "f");
    assert!(e.snapshot().topology.primary().is_some());
}

/// Pausing a service that relays sessions (no pooling) holds new sessions
/// until it resumes, as it holds a pooled client's transactions; sessions
/// already open go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_relay_service_holds_new_sessions_until_resumed() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(10)).await;
    ready(&e, 1).await;
    let open = client(&via(&p, "read_write")).await.unwrap();
    let http = p.http_addr().unwrap();
    let (status, body) =
        tokio::task::spawn_blocking(move || common::http_post(http, "/pause?service=read_write"))
            .await
            .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(one(&open, "SELECT 1").await, "1");
    let conninfo = via(&p, "read_write");
    let waiting = tokio::spawn(async move {
        let c = client(&conninfo).await.unwrap();
        one(&c, "SELECT 2").await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "a session started while paused");
    let (status, body) =
        tokio::task::spawn_blocking(move || common::http_post(http, "/resume?service=read_write"))
            .await
            .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap(),
        "2"
    );
}

/// A relayed client that goes away while it waits (for a paused service
/// to resume, or for a host) leaves at once: it does not keep its place
/// under `max_client_conn` for the rest of `connect_wait_timeout`, and no
/// backend is opened for it when the service resumes. The wait for a
/// resume and the wait for a host together last `connect_wait_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_client_that_leaves_while_waiting_is_dropped() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(60)).await;
    ready(&e, 1).await;
    let http = p.http_addr().unwrap();
    let (status, body) =
        tokio::task::spawn_blocking(move || common::http_post(http, "/pause?service=read_write"))
            .await
            .unwrap();
    assert_eq!(status, 200, "{body}");
    let conninfo = via(&p, "read_write");
    let clients = move |n: f64| {
        pgwarden_testkit::eventually(
            "relayed clients",
            Duration::from_secs(10),
            move || async move {
                let (_, body) =
                    tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
                        .await
                        .unwrap();
                let v: f64 = body
                    .lines()
                    .find(|l| l.starts_with("pgwarden_client_connections{service=\"read_write\"}"))
                    .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                    .unwrap_or(0.0);
                (v == n)
                    .then_some(())
                    .ok_or(format!("{v} clients, want {n}"))
            },
        )
    };
    let waiting = tokio::spawn(async move { client(&conninfo).await.map(|_| ()) });
    clients(1.0).await;
    waiting.abort();
    // Well within the minute it could wait.
    clients(0.0).await;
}

/// A probe that times out once is not a dead host: sessions on the host,
/// relayed or pooled mid-transaction, go on; only `down_after_failures`
/// (3 by default) such failures in a row would end them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lost_probe_does_not_end_sessions() {
    let c = TestCluster::builder().replicas(1).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(1).parse().unwrap()).unwrap();
    let addrs = vec![c.addr(0), relay.addr().to_string()];
    for pooled in [false, true] {
        let settings = pooled.then(|| pgwarden_proxy::PoolSettings {
            size: 2,
            ..pgwarden_proxy::PoolSettings::default()
        });
        let (e, p) = common::proxy_with(&addrs, Duration::from_secs(10), settings, 10_000).await;
        ready(&e, 2).await;
        let ro = client(&via(&p, "read_only")).await.unwrap();
        ro.simple_query("BEGIN").await.unwrap();
        assert_eq!(one(&ro, "SELECT pg_is_in_recovery()").await, "t");
        // Silent for one probe time-out, then back: the probe's query is
        // lost, the session's idle socket never notices.
        relay.set_blackhole(true);
        let snap = until(&e, "a probe of the replica failed", WAIT, |s| {
            let h = &s.topology.hosts()[1];
            (h.failed_probes >= 1)
                .then_some(())
                .ok_or(format!("{} failed", h.failed_probes))
        })
        .await;
        relay.set_blackhole(false);
        let h = &snap.topology.hosts()[1];
        assert!(
            h.alive,
            "pooled {pooled}: down after {} failure(s)",
            h.failed_probes
        );
        until(&e, "the replica answers again", WAIT, |s| {
            let h = &s.topology.hosts()[1];
            (h.alive && h.failed_probes == 0)
                .then_some(())
                .ok_or(format!("{} failed, alive {}", h.failed_probes, h.alive))
        })
        .await;
        // Two more rounds: every change has been acted on.
        let round = e.snapshot().round;
        e.wait_round(round + 2).await;
        assert_eq!(
            one(&ro, "SELECT pg_is_in_recovery()").await,
            "t",
            "pooled {pooled}: the session ended"
        );
        ro.simple_query("COMMIT").await.unwrap();
    }
}

/// A server listed under two names is one primary: when its first name's
/// probe fails for a while and the primary's entry moves to the second
/// name and back, sessions and pools opened on the second name meanwhile
/// go on, since the server never changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stay_when_the_primary_moves_between_two_names_of_it() {
    let c = TestCluster::builder().replicas(0).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(0).parse().unwrap()).unwrap();
    // The relay's address first: the server is counted under it.
    let addrs = [relay.addr().to_string(), c.addr(0)];
    for pooled in [false, true] {
        let settings = pooled.then(|| pgwarden_proxy::PoolSettings {
            size: 2,
            ..pgwarden_proxy::PoolSettings::default()
        });
        let (e, p) = common::proxy_with(&addrs, Duration::from_secs(10), settings, 10_000).await;
        let primary_is = |want: usize| {
            move |s: &pgwarden_probe::Snapshot| {
                (s.topology.primary() == Some(want))
                    .then_some(())
                    .ok_or(format!("{:?}", s.topology.primary()))
            }
        };
        until(&e, "counted under the relay", WAIT, primary_is(0)).await;
        relay.set_blackhole(true);
        until(&e, "the second name takes over", WAIT, primary_is(1)).await;
        let held = client(&via(&p, "read_write")).await.unwrap();
        assert_eq!(common::one(&held, "SELECT 1").await, "1");
        relay.set_blackhole(false);
        until(&e, "the first name is back", WAIT, primary_is(0)).await;
        // Two more rounds: every change has been acted on.
        let round = e.snapshot().round;
        e.wait_round(round + 2).await;
        assert_eq!(
            common::one(&held, "SELECT 2").await,
            "2",
            "pooled {pooled}: the session ended"
        );
    }
}

/// A relayed session whose pumps both wait on its server (a client
/// streaming COPY data to a host that stopped taking bytes) ends once the
/// host is found down, not when TCP gives up minutes later: the kill shuts
/// the server's socket down as well as the client's reading side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_stuck_writing_to_a_dead_host_ends_when_it_is_found_down() {
    let (c, relay, e, p) = behind_relay(Duration::from_secs(10)).await;
    sql_value(&c.conninfo(0), "CREATE TABLE copied_to_the_dead (x text)").await;
    let mut s = raw_login(p.service_addrs()["read_write"], "postgres");
    // Up to ReadyForQuery, then the COPY's CopyInResponse.
    read_until(&mut s, b'Z');
    s.write_all(&query_message("COPY copied_to_the_dead FROM STDIN"))
        .unwrap();
    read_until(&mut s, b'G');
    relay.set_blackhole(true);
    // Stream rows until pgwarden ends the session (a write fails), with
    // every write bounded so that a stuck session shows as a timeout.
    let streaming = tokio::task::spawn_blocking(move || {
        s.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut row = vec![b'd'];
        let line = [b"x".repeat(8191), b"\n".to_vec()].concat();
        row.extend_from_slice(&((line.len() + 4) as u32).to_be_bytes());
        row.extend_from_slice(&line);
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            match s.write_all(&row) {
                Ok(()) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return Ok(started.elapsed()),
            }
        }
        Err(started.elapsed())
    });
    until(&e, "the host is down", WAIT, |s| {
        (!s.topology.hosts()[0].alive)
            .then_some(())
            .ok_or("alive".into())
    })
    .await;
    let ended = streaming.await.unwrap();
    relay.set_blackhole(false);
    assert!(ended.is_ok(), "the session was still open after {ended:?}");
}

/// A read-write session whose server login was still under way when a
/// new primary appeared ends at once with 57P01 rather than writing to
/// the old primary: the topology is looked at again once the session is
/// registered where route changes find it. (With `[auth]` pgwarden logs
/// in to the server before registering the session; the login waits in a
/// relay here while the replica is promoted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_started_across_a_primary_change_does_not_stay_on_the_old_primary() {
    let mut c = TestCluster::builder().replicas(1).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(0).parse().unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    common::authenticate_with(
        dir.path().join("pg_hba.conf"),
        "host all postgres 127.0.0.1/32 trust\n",
    );
    common::SERVER_CONNECT_TIMEOUT.with(|t| t.set(WAIT));
    let (e, p) = common::proxy_with(
        &[relay.addr().to_string(), c.addr(1)],
        Duration::from_secs(10),
        None,
        10_000,
    )
    .await;
    ready(&e, 2).await;
    // The probe's connection to the primary goes on; a new one waits in
    // the relay.
    relay.set_hold_new(true);
    let before = relay.connections();
    let conninfo = via(&p, "read_write");
    let pending = tokio::spawn(async move { client(&conninfo).await });
    pgwarden_testkit::eventually(
        "the session's connection reaches the relay",
        WAIT,
        || async {
            (relay.connections() > before)
                .then_some(())
                .ok_or("not yet".to_string())
        },
    )
    .await;
    c.node(1).promote().unwrap();
    until(&e, "the promoted replica is the primary", WAIT, |s| {
        (s.topology.primary() == Some(1))
            .then_some(())
            .ok_or(format!("{:?}", s.topology.primary()))
    })
    .await;
    relay.set_hold_new(false);
    match pending.await.unwrap() {
        Err(err) => assert_eq!(sqlstate(&err).as_deref(), Some("57P01"), "{err}"),
        Ok(db) => {
            // Connected: then not to the old primary, and not for long.
            let port = db.simple_query("SELECT inet_server_port()").await.map(|m| {
                m.iter()
                    .find_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
                        _ => None,
                    })
                    .unwrap_or_default()
            });
            assert_ne!(
                port.ok().as_deref(),
                Some(c.port(0).to_string().as_str()),
                "a session writes to the old primary"
            );
        }
    }
    // New sessions reach the new primary.
    let db = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(
        one(&db, "SELECT inet_server_port()").await,
        c.port(1).to_string()
    );
}

/// On a read-only service, client messages that are checked are held
/// whole before they go on; before the login is done none is valid, and
/// one announcing hundreds of megabytes is refused at once (08P01)
/// instead of being buffered for a client nobody has authenticated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_message_before_the_login_is_refused_on_a_read_only_service() {
    let mut c = TestCluster::builder().replicas(0).start();
    sql_value(
        &c.conninfo(0),
        "CREATE ROLE alice LOGIN PASSWORD 'alice-secret'",
    )
    .await;
    c.set_hba(
        0,
        "host all alice 127.0.0.1/32 md5\nhost all all 127.0.0.1/32 trust\n",
    );
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 1).await;
    // A Query of 200 MB, and a Bind as long (whose names a long Bind
    // after the login is let through by), come instead of the password.
    for (tag, start) in [(b'Q', &b"x"[..]), (b'B', b"\0\0")] {
        let mut s = raw_login(p.service_addrs()["read_only"], "alice");
        // The server asks for the password.
        let mut head = [0u8; 5];
        s.read_exact(&mut head).unwrap();
        assert_eq!(head[0], b'R');
        let mut rest =
            vec![0u8; u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize - 4];
        s.read_exact(&mut rest).unwrap();
        let mut q = vec![tag];
        q.extend_from_slice(&200_000_000u32.to_be_bytes());
        q.extend_from_slice(start);
        q.extend_from_slice(&[b'x'; 4096]);
        s.write_all(&q).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out);
        assert_eq!(out.first(), Some(&b'E'), "{text}");
        assert!(
            text.contains("C08P01") && text.contains("too long"),
            "{}: {text}",
            tag as char
        );
    }
}

/// A reload whose new listen address cannot be bound changes nothing: the
/// service that was to move keeps serving at its old address, a service
/// the reload adds does not start, the settings stay, and the error names
/// the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_with_an_address_in_use_changes_nothing() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, mut p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 1).await;
    let before = p.spec().clone();
    let old = p.service_addrs()["read_write"];
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap();
    let extra_addr: std::net::SocketAddr = format!("127.0.0.1:{}", pgwarden_testkit::free_port())
        .parse()
        .unwrap();
    let mut spec = before.clone();
    spec.max_client_conn = 7;
    let mut extra = spec
        .services
        .iter()
        .find(|s| s.name == "read_only")
        .unwrap()
        .clone();
    extra.name = "extra".into();
    extra.listen = extra_addr;
    spec.services.push(extra);
    for s in spec.services.iter_mut().filter(|s| s.name == "read_write") {
        s.listen = taken_addr;
    }
    let err = p.apply(spec).await.unwrap_err();
    assert!(err.to_string().contains(&taken_addr.to_string()), "{err}");
    // As before, all of it.
    assert_eq!(p.spec().max_client_conn, before.max_client_conn);
    assert_eq!(p.spec().services.len(), before.services.len());
    assert_eq!(p.service_addrs()["read_write"], old);
    assert!(!p.service_addrs().contains_key("extra"));
    assert!(
        std::net::TcpStream::connect(extra_addr).is_err(),
        "the added service listens"
    );
    let db = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(one(&db, "SELECT 1").await, "1");
    drop(taken);
}

/// A reload takes the round robin up where it was: alternating replicas
/// go on alternating, rather than the next client going back to the
/// first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_round_robin_turn() {
    let c = TestCluster::builder().replicas(2).start();
    let (e, mut p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 3).await;
    let mut ports = Vec::new();
    for _ in 0..4 {
        let ro = client(&via(&p, "read_only")).await.unwrap();
        ports.push(one(&ro, "SELECT inet_server_port()").await);
        p.apply(p.spec().clone()).await.unwrap();
    }
    let replicas = [c.port(1).to_string(), c.port(2).to_string()];
    assert!(
        ports.iter().all(|port| replicas.contains(port)),
        "{ports:?}"
    );
    assert!(
        ports.windows(2).all(|w| w[0] != w[1]),
        "each reload went back to the first replica: {ports:?}"
    );
}

/// A host the probes still call up but that refuses new connections (a
/// restart, a full listen queue) is tried again within the client's
/// `connect_wait_timeout`, not only when the topology changes: the client
/// connects once the host accepts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_refused_is_tried_again_within_the_wait() {
    use pgwarden_testkit::Listener;
    let (_c, relay, e, p) = behind_relay(Duration::from_secs(20)).await;
    // The probe's connection goes on; new ones are refused.
    relay.set_listener(Listener::Closed);
    let conninfo = via(&p, "read_write");
    let pending = tokio::spawn(async move { client(&conninfo).await });
    let db = common::served_once_open(&relay, pending)
        .await
        .expect("connected");
    assert_eq!(one(&db, "SELECT 1").await, "1");
    assert!(
        e.snapshot().topology.hosts()[0].alive,
        "the topology never changed"
    );
}

/// A host that takes the connection but turns sessions away for now
/// (57P03: a server in a smart shutdown, starting up, not yet consistent)
/// is passed over for the next eligible host within the client's wait, as
/// a refused connect is: the client never sees the refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_not_accepting_sessions_is_passed_over_for_the_next() {
    let mut c = TestCluster::builder().replicas(2).start();
    // Relayed as it is, and with pgwarden logging in itself ([auth]),
    // both probing before the shutdown below (a new probe connection
    // would be turned away too).
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(10)).await;
    let dir = tempfile::tempdir().unwrap();
    common::authenticate_with(
        dir.path().join("pg_hba.conf"),
        "host all postgres 127.0.0.1/32 trust\n",
    );
    let (auth_e, auth_p) = proxy(&c.addrs(), Duration::from_secs(10)).await;
    ready(&e, 3).await;
    ready(&auth_e, 3).await;
    // A smart shutdown lets the sessions it finds (this one, the probes')
    // go on, and turns new ones away until they end.
    let held = client(&c.conninfo(1)).await.unwrap();
    c.node(1).signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    let direct = c.conninfo(1);
    pgwarden_testkit::eventually("replica 1 turns sessions away", WAIT, || async {
        match client(&direct).await {
            Err(e) if sqlstate(&e).as_deref() == Some("57P03") => Ok(()),
            other => Err(format!("{:?}", other.map(|_| "connected"))),
        }
    })
    .await;
    for (e, p, what) in [(&e, &p, "relayed"), (&auth_e, &auth_p, "[auth]")] {
        for _ in 0..6 {
            let ro = client(&via(p, "read_only"))
                .await
                .unwrap_or_else(|err| panic!("{what}: replica 1 not passed over: {err}"));
            assert_eq!(
                one(&ro, "SELECT inet_server_port()").await,
                c.port(2).to_string(),
                "{what}"
            );
        }
        assert!(
            e.snapshot().topology.hosts()[1].alive,
            "{what}: the probes still call replica 1 up"
        );
    }
    drop(held);
}

/// Hosts that do not answer a connect cost the client at most its
/// `connect_wait_timeout`, however long `server_connect_timeout` is: it
/// gets 08006 naming the service when its wait is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unanswered_hosts_do_not_stretch_the_connect_wait() {
    use pgwarden_testkit::Listener;
    common::SERVER_CONNECT_TIMEOUT.with(|t| t.set(Duration::from_secs(8)));
    let (_c, relay, _e, p) = behind_relay(Duration::from_secs(2)).await;
    relay.set_listener(Listener::Unanswered);
    let started = std::time::Instant::now();
    let err = tokio::time::timeout(WAIT, client(&via(&p, "read_write")))
        .await
        .expect("the client is answered")
        .expect_err("no host answers");
    let waited = started.elapsed();
    assert_eq!(sqlstate(&err).as_deref(), Some("08006"), "{err}");
    let message = err.as_db_error().map(|d| d.message()).unwrap_or_default();
    assert!(message.contains("\"read_write\""), "{err:?}");
    assert!(
        // Below the 8 s server_connect_timeout, with room for a loaded
        // machine.
        waited >= Duration::from_millis(1500) && waited < Duration::from_secs(7),
        "answered after {waited:?}"
    );
    relay.set_listener(Listener::Open);
    let db = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(one(&db, "SELECT 1").await, "1");
}

/// A shutdown waits for clients still logging in, as for sessions: one
/// waiting for its host when the shutdown begins is served once the host
/// takes it, and the shutdown ends after it leaves; an admin console
/// session, or a connection that sent nothing, is not waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_waits_for_clients_still_logging_in() {
    use pgwarden_testkit::Listener;
    let (_c, relay, _e, p) = behind_relay(Duration::from_secs(20)).await;
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let console = client(&admin_info).await.unwrap();
    // A connection that never sends its start-up packet (a port check) is
    // not waited for either.
    let silent = std::net::TcpStream::connect(p.service_addrs()["read_write"]).unwrap();
    relay.set_listener(Listener::Closed);
    let pending = common::waiting_client(via(&p, "read_write"), "its host refused").await;
    let mut shutdown = tokio::spawn(p.shutdown());
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut shutdown)
            .await
            .is_err(),
        "the shutdown did not wait for the client logging in"
    );
    relay.set_listener(Listener::Open);
    let db = tokio::time::timeout(WAIT, pending)
        .await
        .expect("the client is served")
        .unwrap()
        .expect("connected during the shutdown's wait");
    assert_eq!(one(&db, "SELECT 1").await, "1");
    drop(db);
    // Well within the shutdown_timeout (5 s) that a waited-for console
    // would run it to.
    tokio::time::timeout(Duration::from_secs(3), shutdown)
        .await
        .expect("the shutdown ends once the client left, console or not")
        .unwrap();
    drop((console, silent));
}

/// A client still waiting for its host when the shutdown time-out runs out
/// is told why it is turned away (57P01), like the sessions, rather than
/// left to find its connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_waiting_for_a_host_at_the_end_of_a_shutdown_is_told_why() {
    use pgwarden_testkit::Listener;
    let (_c, relay, _e, p) = behind_relay(Duration::from_secs(60)).await;
    relay.set_listener(Listener::Closed);
    let pending = common::waiting_client(via(&p, "read_write"), "its host refused").await;
    common::told_at_shutdown(p, pending).await;
}

/// A `connect_wait_timeout` of zero means no waiting for a host to
/// appear, not no trying: a client is served by an eligible host, and
/// turned away at once (57P03) when there is none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_connect_wait_still_tries_the_eligible_hosts() {
    let mut c = TestCluster::builder().replicas(0).start();
    let (e, p) = common::proxy_with(&c.addrs(), Duration::ZERO, None, 10_000).await;
    ready(&e, 1).await;
    let db = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(one(&db, "SELECT 1").await, "1");
    // With no host up, the client is turned away at once.
    c.node(0).stop(StopMode::Fast).unwrap();
    until(&e, "the host is down", WAIT, |s| {
        (!s.topology.hosts()[0].alive)
            .then_some(())
            .ok_or("alive".into())
    })
    .await;
    let started = std::time::Instant::now();
    let err = client(&via(&p, "read_write")).await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("57P03"), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// One primary reached through a fault-injecting relay, and a pgwarden
/// (session relay, no pool) in front of the relay with `connect_wait` as
/// its connect_wait_timeout, once the topology engine has seen the
/// primary.
async fn behind_relay(
    connect_wait: Duration,
) -> (
    TestCluster,
    pgwarden_testkit::Relay,
    pgwarden_probe::Engine,
    pgwarden_proxy::Proxy,
) {
    let c = TestCluster::builder().replicas(0).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(0).parse().unwrap()).unwrap();
    let (e, p) = common::proxy_with(&[relay.addr().to_string()], connect_wait, None, 10_000).await;
    ready(&e, 1).await;
    (c, relay, e, p)
}

/// A client that shuts only its sending side after a query (as `nc -N`
/// or a script piping SQL does) still gets the replies, as PostgreSQL
/// itself would send them, and then the session ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_half_closes_still_gets_its_replies() {
    let c = TestCluster::builder().replicas(1).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 2).await;
    for service in ["read_write", "read_only"] {
        let addr = p.service_addrs()[service];
        let replies = tokio::task::spawn_blocking(move || {
            let mut s = raw_login(addr, "postgres");
            read_until(&mut s, b'Z');
            // The reply comes well after the end of the client's input.
            s.write_all(&query_message(
                "SELECT pg_sleep(0.5), 'answered after the end of input'",
            ))
            .unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            let mut out = Vec::new();
            s.read_to_end(&mut out).expect("the session ends");
            out
        })
        .await
        .unwrap();
        let text = String::from_utf8_lossy(&replies);
        assert!(
            text.contains("answered after the end of input"),
            "{service}: {text:?}"
        );
        assert_eq!(replies.last(), Some(&b'I'), "{service}: {text:?}");
    }
}

/// A read-only session takes a Bind as long as PostgreSQL takes (its
/// parameters up to 1 GB), beyond what the relay holds whole to inspect:
/// only the portal and statement names at its start are needed, and the
/// rest streams through. The checks still hold afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_longer_than_the_inspection_limit_passes_on_a_read_only_service() {
    let c = TestCluster::builder().replicas(1).start();
    let (e, p) = proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 2).await;
    let ro = client(&via(&p, "read_only")).await.unwrap();
    // Past the 256 MiB the relay holds whole to inspect.
    let len = 272 << 20;
    let big = vec![7u8; len];
    let row = ro
        .query_one(
            "SELECT length($1::bytea), get_byte($1::bytea, 12345)",
            &[&big],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0) as usize, len);
    assert_eq!(row.get::<_, i32>(1), 7);
    drop(big);
    let err = ro
        .batch_execute("SET default_transaction_read_only = off")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("25006"), "{err:?}");
    assert_eq!(one(&ro, "SHOW transaction_read_only").await, "on");
}

/// A socket to `addr` that has sent its startup packet as `user` to the
/// database postgres, with reads bounded by [`WAIT`].
fn raw_login(addr: std::net::SocketAddr, user: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(&startup_packet(&[("user", user), ("database", "postgres")]))
        .unwrap();
    s
}

/// Reads messages up to and including one of type `tag`; an
/// ErrorResponse before it fails the test.
fn read_until(s: &mut std::net::TcpStream, tag: u8) {
    loop {
        let mut head = [0u8; 5];
        s.read_exact(&mut head).unwrap();
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let mut rest = vec![0u8; len - 4];
        s.read_exact(&mut rest).unwrap();
        assert_ne!(head[0], b'E', "{}", String::from_utf8_lossy(&rest));
        if head[0] == tag {
            return;
        }
    }
}

/// A Query message.
fn query_message(sql: &str) -> Vec<u8> {
    let mut q = vec![b'Q'];
    q.extend_from_slice(&((sql.len() + 5) as u32).to_be_bytes());
    q.extend_from_slice(sql.as_bytes());
    q.push(0);
    q
}
