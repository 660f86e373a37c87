//! Transaction pooling with a real cluster and real clients.

mod common;

use std::time::Duration;

use common::{
    client, one, proxy_with, ready, sql_value, sqlstate, startup_packet, until, via, POOL_AFFINITY,
    WORKERS,
};
use pgwarden_proxy::PoolSettings;
use pgwarden_testkit::TestCluster;

const WAIT: Duration = Duration::from_secs(30);

fn pool(size: usize, wait: Duration) -> Option<PoolSettings> {
    Some(PoolSettings {
        size,
        query_wait_timeout: wait,
        ..PoolSettings::default()
    })
}

/// A pgwarden in front of `c` (one node) with a transaction pool of
/// `size` server connections and `WAIT` as its query_wait_timeout, once
/// the topology engine has seen the node.
async fn pooled(c: &TestCluster, size: usize) -> (pgwarden_probe::Engine, pgwarden_proxy::Proxy) {
    pooled_for(c, size, WAIT).await
}

/// A pgwarden in front of `c` (one node) reached through a TCP relay,
/// for faults, with `settings` as its pool, once the topology engine has
/// seen the node.
async fn behind_relay(
    c: &TestCluster,
    settings: Option<PoolSettings>,
) -> (
    pgwarden_testkit::Relay,
    pgwarden_probe::Engine,
    pgwarden_proxy::Proxy,
) {
    let relay = pgwarden_testkit::Relay::start(c.addr(0).parse().unwrap()).unwrap();
    let (e, p) = proxy_with(
        &[relay.addr().to_string()],
        Duration::from_secs(3),
        settings,
        10_000,
    )
    .await;
    ready(&e, 1).await;
    (relay, e, p)
}

/// One server connection that keeps at most `bound` prepared statements.
async fn pooled_bounded(
    c: &TestCluster,
    bound: usize,
) -> (pgwarden_probe::Engine, pgwarden_proxy::Proxy) {
    let (e, p) = proxy_with(
        &c.addrs(),
        Duration::from_secs(3),
        Some(PoolSettings {
            size: 1,
            query_wait_timeout: WAIT,
            max_prepared_statements: bound,
            ..PoolSettings::default()
        }),
        10_000,
    )
    .await;
    ready(&e, 1).await;
    (e, p)
}

/// [`pooled`] with `wait` as the query_wait_timeout.
async fn pooled_for(
    c: &TestCluster,
    size: usize,
    wait: Duration,
) -> (pgwarden_probe::Engine, pgwarden_proxy::Proxy) {
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool(size, wait), 10_000).await;
    ready(&e, 1).await;
    (e, p)
}

/// `(state, server)` of every row of the admin console's SHOW CLIENTS.
async fn client_states(admin: &tokio_postgres::Client) -> Vec<(String, String)> {
    admin
        .simple_query("SHOW CLIENTS")
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some((
                r.get("state").unwrap_or_default().to_string(),
                r.get("server").unwrap_or_default().to_string(),
            )),
            _ => None,
        })
        .collect()
}

/// Client backends on `conninfo`'s server other than probes and ourselves.
async fn server_connections(conninfo: &str) -> usize {
    sql_value(
        conninfo,
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' \
         AND pid <> pg_backend_pid() AND application_name <> 'pgwarden-probe'",
    )
    .await
    .unwrap()
    .parse()
    .unwrap()
}

/// Waits until no client backend but the probe's is connected to the
/// server at `conninfo`.
async fn until_no_server_connections(conninfo: &str) {
    pgwarden_testkit::eventually("server connections closed", WAIT, || async {
        match server_connections(conninfo).await {
            0 => Ok(()),
            n => Err(format!("{n} left")),
        }
    })
    .await;
}

fn pgbench(port: u16, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new("pgbench")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
        .args(args)
        .arg("postgres")
        .output()
        .expect("pgbench");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_share_few_servers_in_every_protocol_mode() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 2, Duration::from_secs(30)).await;
    let (ok, out) = pgbench(c.port(0), &["-i", "-s", "1", "-q"]);
    assert!(ok, "{out}");
    let port = p.service_addrs()["read_write"].port();
    // TPC-B (explicit transactions) in every protocol mode, and select-only.
    // pgbench prepares statements synchronously, blocking its whole thread
    // while it waits for a server connection; with more clients per thread
    // than pool connections, a thread whose other client holds a server in
    // a transaction stalls (with any transaction pooler), so the prepared
    // TPC-B run gives each client its own thread.
    for (mode, threads, select_only) in [
        ("simple", "2", false),
        ("extended", "2", false),
        ("prepared", "12", false),
        ("simple", "2", true),
        ("prepared", "2", true),
    ] {
        let (ok, out) = tokio::task::spawn_blocking(move || {
            let mut args = vec!["-c", "12", "-j", threads, "-t", "40", "-M", mode];
            if select_only {
                args.push("-S");
            }
            pgbench(port, &args)
        })
        .await
        .unwrap();
        assert!(ok, "{mode}: {out}");
        assert!(
            out.contains("number of failed transactions: 0"),
            "{mode}: {out}"
        );
    }
    assert!(
        server_connections(&c.conninfo(0)).await <= 2,
        "more server connections than the pool size"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_follow_the_client_across_servers() {
    let c = TestCluster::builder().replicas(0).start();
    // One worker: idle servers are then reused most recent first, so b's
    // transaction takes the server a used last and a must move. (With
    // several workers a would keep to the server on its own worker.)
    WORKERS.with(|w| w.set(1));
    let (_e, p) = pooled_for(&c, 2, Duration::from_secs(30)).await;
    let a = client(&via(&p, "read_write")).await.unwrap();
    let b = client(&via(&p, "read_write")).await.unwrap();
    // tokio-postgres prepares named statements (Parse) once and binds them later.
    let stmt = a
        .prepare("SELECT $1::int4 * 10, pg_backend_pid()")
        .await
        .unwrap();
    let mut backends = std::collections::BTreeSet::new();
    for i in 0..6i32 {
        // b holds one server inside a transaction every other round, so a
        // has to run on the other one.
        if i % 2 == 0 {
            b.batch_execute("BEGIN").await.unwrap();
            one(&b, "SELECT 1").await;
        }
        let row = a.query_one(&stmt, &[&i]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), i * 10);
        backends.insert(row.get::<_, i32>(1));
        if i % 2 == 0 {
            b.batch_execute("COMMIT").await.unwrap();
        }
    }
    assert!(
        backends.len() >= 2,
        "the statement ran on one backend only: {backends:?}"
    );
    // DEALLOCATE of a protocol-level statement (psycopg does this).
    let stmt2 = a.prepare("SELECT 2").await.unwrap();
    assert_eq!(a.query_one(&stmt2, &[]).await.unwrap().get::<_, i32>(0), 2);
    drop(stmt2);
    // A second client may use the same statement name for other text.
    let stmt_b = b.prepare("SELECT $1::text || '!'").await.unwrap();
    assert_eq!(
        b.query_one(&stmt_b, &[&"x"])
            .await
            .unwrap()
            .get::<_, String>(0),
        "x!"
    );
    // Errors inside a batch do not confuse the bookkeeping.
    let err = a.query_one("SELECT 1/0", &[]).await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("22012"));
    assert_eq!(
        a.query_one(&stmt, &[&7i32]).await.unwrap().get::<_, i32>(0),
        70
    );
}

/// Clients are shared out among the worker threads in turn, so two
/// consecutive clients connect on different workers. Without pool
/// affinity they stay there, and the one server between them moves to the
/// borrowing client's worker on every transaction, working there in both
/// protocols. With it (the default), both clients move at login to their
/// pool's worker, and the server never moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_serves_clients_on_different_workers() {
    let c = TestCluster::builder().replicas(0).start();
    for affinity in [false, true] {
        POOL_AFFINITY.with(|a| a.set(affinity));
        let (e, p) = proxy_with(
            &c.addrs(),
            Duration::from_secs(5),
            pool(1, Duration::from_secs(10)),
            100,
        )
        .await;
        ready(&e, 1).await;
        let a = client(&via(&p, "read_write")).await.unwrap();
        let b = client(&via(&p, "read_write")).await.unwrap();
        let stmt_a = a
            .prepare("SELECT pg_backend_pid(), $1::int4 + 1")
            .await
            .unwrap();
        let stmt_b = b
            .prepare("SELECT pg_backend_pid(), $1::int4 + 2")
            .await
            .unwrap();
        let mut pids = std::collections::BTreeSet::new();
        for i in 0..20i32 {
            let (who, stmt, add) = if i % 2 == 0 {
                (&a, &stmt_a, 1)
            } else {
                (&b, &stmt_b, 2)
            };
            let row = tokio::time::timeout(Duration::from_secs(10), who.query_one(stmt, &[&i]))
                .await
                .expect("a borrowed server answers on the client's worker")
                .unwrap();
            assert_eq!(row.get::<_, i32>(1), i + add);
            pids.insert(row.get::<_, i32>(0));
            let simple = tokio::time::timeout(Duration::from_secs(10), one(who, "SELECT 40 + 2"))
                .await
                .expect("simple protocol too");
            assert_eq!(simple, "42");
        }
        assert_eq!(pids.len(), 1, "one server connection: {pids:?}");
        let http = p.http_addr().unwrap();
        let moves = common::metric_sample(http, "pgwarden_pool_server_moves_total{").await;
        if affinity {
            assert_eq!(moves, 0.0, "both clients share their pool's worker");
        } else {
            // a and b alternate 20 times; each turn after the first moves it.
            assert!(moves >= 19.0, "the server moved {moves} times");
        }
        // Once a pooled client has shown where its pool lives, the next
        // ones are accepted there: at most the first one changes worker,
        // where round robin would move about half of them.
        for _ in 0..10 {
            let c = client(&via(&p, "read_write")).await.unwrap();
            assert_eq!(one(&c, "SELECT 1").await, "1");
        }
        let client_moves = common::metric_sample(http, "pgwarden_client_moves_total ").await;
        if affinity {
            assert!(client_moves <= 1.0, "{client_moves} of 12 clients moved");
        } else {
            assert_eq!(client_moves, 0.0, "without affinity clients stay put");
        }
    }
}

/// Round robin over replicas takes one turn per transaction: a pooled
/// client's transactions spread over both replicas, not back to the host of
/// its last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_transactions_take_turns_over_the_replicas() {
    let c = TestCluster::builder().replicas(2).start();
    let pool = PoolSettings {
        size: 2,
        ..PoolSettings::default()
    };
    let (e, p) = common::proxy_with(&c.addrs(), Duration::from_secs(10), Some(pool), 10_000).await;
    ready(&e, 3).await;
    let ro = client(&via(&p, "read_only")).await.unwrap();
    let mut ports = std::collections::BTreeSet::new();
    // Alone on the service, the client takes every turn; a replica briefly
    // outside the RTT window may skip a few.
    for _ in 0..40 {
        ports.insert(one(&ro, "SELECT current_setting('port')").await);
        if ports.len() == 2 {
            break;
        }
    }
    assert_eq!(ports.len(), 2, "transactions stayed on {ports:?}");
}

/// A session-pooled client that ran `LOAD` leaves a server with the module
/// loaded, which `DISCARD ALL` does not undo: the server is closed, not
/// passed to the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_pooling_closes_a_server_that_loaded_a_module() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = session_pooling_proxy(
        &c,
        PoolSettings {
            size: 1,
            ..PoolSettings::default()
        },
    )
    .await;
    let url = via(&p, "read_write");
    let plain = client(&url).await.unwrap();
    let pid = one(&plain, "SELECT pg_backend_pid()").await;
    drop(plain);
    // Reset and kept: the next client has the same backend.
    let loader = pgwarden_testkit::eventually("the server back in the pool", WAIT, || async {
        let c = client(&url).await.map_err(|e| e.to_string())?;
        let again = one(&c, "SELECT pg_backend_pid()").await;
        (again == pid)
            .then_some(c)
            .ok_or(format!("{again} after {pid}"))
    })
    .await;
    loader.batch_execute("LOAD 'auto_explain'").await.unwrap();
    drop(loader);
    let next = pgwarden_testkit::eventually("the next client served", WAIT, || async {
        client(&url).await.map_err(|e| e.to_string())
    })
    .await;
    let other = one(&next, "SELECT pg_backend_pid()").await;
    assert_ne!(other, pid, "the server that loaded a module was passed on");
}

/// Session pooling (`reuse_session_servers`): a session-mode client keeps
/// one server connection with all its session state across transactions;
/// when it leaves, the connection is reset with DISCARD ALL and the next
/// client gets it clean. One that leaves mid-transaction is not reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_pooling_resets_servers_and_reuses_them() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = session_pooling_proxy(
        &c,
        PoolSettings {
            size: 1,
            query_wait_timeout: Duration::from_secs(2),
            ..PoolSettings::default()
        },
    )
    .await;
    let url = via(&p, "read_write");
    let direct = c.conninfo(0);

    let a = client(&url).await.unwrap();
    a.batch_execute(
        "SET work_mem = '7MB'; CREATE TEMP TABLE t (x int); PREPARE p AS SELECT 7; \
         LISTEN ch; SELECT pg_advisory_lock(42)",
    )
    .await
    .unwrap();
    let pid_a = one(&a, "SELECT pg_backend_pid()").await;
    a.batch_execute("BEGIN; INSERT INTO t VALUES (1); COMMIT")
        .await
        .unwrap();
    // Session state outlives the transactions: the server stays with a.
    assert_eq!(one(&a, "SHOW work_mem").await, "7MB");
    assert_eq!(one(&a, "EXECUTE p").await, "7");
    assert_eq!(one(&a, "SELECT count(*) FROM t").await, "1");
    assert_eq!(one(&a, "SELECT pg_backend_pid()").await, pid_a);

    // The pool's one connection is taken: another client waits, then is
    // told why.
    let err = client(&url).await.expect_err("the pool is full");
    assert_eq!(sqlstate(&err).as_deref(), Some("57P03"), "{err}");

    drop(a);
    // The next client waits for a's connection, which comes back reset.
    let b = client(&url).await.unwrap();
    assert_eq!(one(&b, "SELECT pg_backend_pid()").await, pid_a, "reused");
    assert_eq!(one(&b, "SHOW work_mem").await, "4MB");
    assert_eq!(
        one(&b, "SELECT to_regclass('pg_temp.t') IS NULL").await,
        "t"
    );
    assert_eq!(
        one(&b, "SELECT count(*) FROM pg_listening_channels()").await,
        "0"
    );
    let gone = b.simple_query("EXECUTE p").await.unwrap_err();
    assert_eq!(sqlstate(&gone).as_deref(), Some("26000"), "{gone}");
    assert_eq!(
        sql_value(&direct, "SELECT pg_try_advisory_lock(42)")
            .await
            .as_deref(),
        Some("t"),
        "a's advisory lock was released"
    );

    // Leaving inside a transaction: the connection is closed, not reused.
    b.batch_execute("BEGIN; SELECT 1").await.unwrap();
    drop(b);
    let d = client(&url).await.unwrap();
    let pid_d = one(&d, "SELECT pg_backend_pid()").await;
    assert_ne!(
        pid_d, pid_a,
        "a connection left mid-transaction is not reused"
    );
    let q = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid_a}");
    pgwarden_testkit::eventually("the old backend exits", Duration::from_secs(10), || {
        let q = q.clone();
        let direct = direct.clone();
        async move {
            match sql_value(&direct, &q).await.as_deref() {
                Some("0") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_server_keeps_a_bounded_number_of_prepared_statements() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_bounded(&c, 3).await;
    let a = client(&via(&p, "read_write")).await.unwrap();
    let b = client(&via(&p, "read_write")).await.unwrap();
    // Two clients, one server: ten statements each, used in turns, the
    // first ones again after the later ones pushed them out.
    let mut stmts = Vec::new();
    for i in 0..10i32 {
        let sa = a.prepare(&format!("SELECT $1::int4 + {i}")).await.unwrap();
        let sb = b.prepare(&format!("SELECT $1::int4 * {i}")).await.unwrap();
        stmts.push((i, sa, sb));
    }
    for round in 0..2 {
        for (i, sa, sb) in &stmts {
            let ra: i32 = a.query_one(sa, &[&round]).await.unwrap().get(0);
            let rb: i32 = b.query_one(sb, &[&round]).await.unwrap().get(0);
            assert_eq!((ra, rb), (round + i, round * i));
            // Seen from the server, between transactions: never more than
            // the bound.
            let held: i64 = a
                .query_one("SELECT count(*) FROM pg_prepared_statements", &[])
                .await
                .unwrap()
                .get(0);
            assert!(held <= 3, "{held} statements on the server");
        }
    }
    // After an error, every statement still works (prepared again where
    // it was closed).
    let err = a.query_one("SELECT 1/0", &[]).await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("22012"));
    for (i, sa, _) in &stmts {
        let r: i32 = a.query_one(sa, &[&1]).await.unwrap().get(0);
        assert_eq!(r, 1 + i);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_state_pins_the_client_to_its_server() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 3, Duration::from_secs(30)).await;
    let a = client(&via(&p, "read_write")).await.unwrap();
    let pid = one(&a, "SELECT pg_backend_pid()").await;
    // A temporary table lives in one backend: the client keeps it.
    a.batch_execute("CREATE TEMP TABLE scratch (x int)")
        .await
        .unwrap();
    let others: Vec<_> = futures_like_clients(&p, 2).await;
    for o in &others {
        o.batch_execute("BEGIN").await.unwrap();
        one(o, "SELECT 1").await;
    }
    a.batch_execute("INSERT INTO scratch VALUES (1)")
        .await
        .unwrap();
    assert_eq!(one(&a, "SELECT count(*) FROM scratch").await, "1");
    assert_eq!(one(&a, "SELECT pg_backend_pid()").await, pid);
    // A session-level SET keeps its effect for the client.
    a.batch_execute("SET search_path TO pg_catalog")
        .await
        .unwrap();
    assert_eq!(one(&a, "SHOW search_path").await, "pg_catalog");
    for o in &others {
        o.batch_execute("COMMIT").await.unwrap();
    }
    // Tracked parameters are replayed rather than pinned: application_name
    // follows a client that is not pinned.
    let b = client(&format!(
        "{} application_name=client_b",
        via(&p, "read_write")
    ))
    .await
    .unwrap();
    for _ in 0..4 {
        assert_eq!(one(&b, "SHOW application_name").await, "client_b");
    }
}

/// Temporary objects however they are spelled (a comment before TEMP, the
/// `pg_temp` schema named outright), holdable cursors and loaded modules
/// live in one backend: the client that made them keeps its server, and
/// no other client of a pool of one ever lands on that backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn temporary_objects_in_any_spelling_stay_with_their_client() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 1, Duration::from_secs(30)).await;
    let url = via(&p, "read_write");
    // What a backend holds that the session before it left behind.
    let leftovers = "SELECT (SELECT count(*) FROM pg_class \
                     WHERE relnamespace = pg_my_temp_schema()) \
         + (SELECT count(*) FROM pg_proc WHERE pronamespace = pg_my_temp_schema()) \
         + (SELECT count(*) FROM pg_cursors) \
         + (SELECT count(*) FROM pg_settings WHERE name LIKE 'auto_explain.%')";
    for make in [
        "CREATE TABLE pg_temp.tt3(x int)",
        "CREATE /*x*/ TEMP TABLE tt2(x int)",
        "CREATE -- x\n TEMPORARY TABLE tt2(x int)",
        "CREATE TABLE \"pg_temp\".t (x int)",
        "CREATE TABLE pg_temp . t (x int)",
        "CREATE VIEW pg_temp.v AS SELECT 1 AS x",
        "CREATE FUNCTION pg_temp.f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        "DECLARE c CURSOR WITH /*x*/ HOLD FOR SELECT 1",
        "LOAD 'auto_explain'",
    ] {
        let a = client(&url).await.unwrap();
        a.batch_execute(make).await.unwrap();
        assert_ne!(one(&a, leftovers).await, "0", "{make}");
        drop(a);
        let b = client(&url).await.unwrap();
        assert_eq!(one(&b, leftovers).await, "0", "after {make}");
    }
}

/// Session-level changes that do not start with SET pin too, so their
/// server never goes back to the pool to surprise another client:
/// `set_config(..., false)`, a SET after another statement of the same
/// query, and a RESET of a start-up setting the pool applied (the pool
/// would otherwise believe the server still had it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_changes_that_do_not_start_with_set_do_not_leak() {
    let c = TestCluster::builder().replicas(0).start();
    sql_value(&c.conninfo(0), "CREATE SCHEMA app; SELECT 1")
        .await
        .unwrap();
    let (_e, p) = pooled_for(&c, 1, Duration::from_secs(30)).await;
    let url = via(&p, "read_write");
    let default_path = {
        let probe = client(&url).await.unwrap();
        one(&probe, "SHOW search_path").await
    };
    for change in [
        "SELECT set_config('search_path', 'pg_catalog', false)",
        "SELECT 1; SET search_path TO pg_catalog",
    ] {
        let a = client(&url).await.unwrap();
        a.batch_execute(change).await.unwrap();
        assert_eq!(one(&a, "SHOW search_path").await, "pg_catalog", "{change}");
        drop(a);
        // The pool's one server: the next client must not inherit it.
        let b = client(&url).await.unwrap();
        assert_eq!(
            one(&b, "SHOW search_path").await,
            default_path,
            "after {change}"
        );
    }
    // A transaction-local set_config leaves nothing behind and pins no one.
    let a = client(&url).await.unwrap();
    a.batch_execute("BEGIN; SELECT set_config('search_path', 'pg_catalog', true); COMMIT")
        .await
        .unwrap();
    let b = client(&url).await.unwrap();
    assert_eq!(one(&b, "SHOW search_path").await, default_path);
    drop((a, b));
    // RESET of the start-up setting the pool applied for this client.
    let with_app = format!("{url} options=-csearch_path=app");
    let a = client(&with_app).await.unwrap();
    assert_eq!(one(&a, "SHOW search_path").await, "app");
    a.batch_execute("RESET search_path").await.unwrap();
    assert_eq!(one(&a, "SHOW search_path").await, default_path);
    drop(a);
    let b = client(&with_app).await.unwrap();
    assert_eq!(one(&b, "SHOW search_path").await, "app");
    drop(b);

    // DEALLOCATE ALL drops statements and keeps settings: the next client,
    // which has no start-up setting, must not inherit the last one's.
    for prepared in [false, true] {
        let a = client(&with_app).await.unwrap();
        if prepared {
            let st = a.prepare("DEALLOCATE ALL").await.unwrap();
            a.execute(&st, &[]).await.unwrap();
        } else {
            a.batch_execute("DEALLOCATE ALL").await.unwrap();
        }
        // Gone now, with the server in the pool as DEALLOCATE ALL left it.
        drop(a);
        let b = client(&url).await.unwrap();
        assert_eq!(
            one(&b, "SHOW search_path").await,
            default_path,
            "after DEALLOCATE ALL, prepared: {prepared}"
        );
    }

    // A client without start-up settings is not pinned by a RESET: its
    // server then has the pool's defaults, and serves the next client
    // while this one idles.
    let a = client(&url).await.unwrap();
    for reset in ["RESET ALL", "RESET search_path", "SELECT 1; RESET work_mem"] {
        a.batch_execute(reset).await.unwrap();
        let b = client(&url).await.unwrap();
        let path = tokio::time::timeout(Duration::from_secs(10), one(&b, "SHOW search_path"))
            .await
            .unwrap_or_else(|_| panic!("{reset} pinned the pool's one server"));
        assert_eq!(path, default_path, "after {reset}");
    }
}

async fn futures_like_clients(p: &pgwarden_proxy::Proxy, n: usize) -> Vec<tokio_postgres::Client> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(client(&via(p, "read_write")).await.unwrap());
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_change_is_invisible_between_transactions() {
    let mut c = TestCluster::builder().replicas(1).start();
    let (e, p) = proxy_with(
        &c.addrs(),
        Duration::from_secs(5),
        pool(4, Duration::from_secs(30)),
        10_000,
    )
    .await;
    ready(&e, 2).await;
    let idle = client(&via(&p, "read_write")).await.unwrap();
    let busy = client(&via(&p, "read_write")).await.unwrap();
    let stmt = idle.prepare("SELECT inet_server_port()").await.unwrap();
    assert_eq!(
        idle.query_one(&stmt, &[]).await.unwrap().get::<_, i32>(0),
        c.port(0) as i32
    );
    busy.batch_execute("BEGIN").await.unwrap();
    one(&busy, "SELECT 1").await;

    c.node(1).promote().unwrap();
    until(&e, "node2 primary", WAIT, |s| {
        (s.topology.primary() == Some(1))
            .then_some(())
            .ok_or("not yet".into())
    })
    .await;
    // Between transactions: the next one runs on the new primary, on the
    // same client connection, prepared statement included.
    assert_eq!(
        idle.query_one(&stmt, &[]).await.unwrap().get::<_, i32>(0),
        c.port(1) as i32
    );
    assert_eq!(one(&idle, "SELECT pg_is_in_recovery()").await, "f");
    // Mid-transaction on the lost server: an error.
    let err = busy.simple_query("SELECT 1").await.unwrap_err();
    assert!(err.is_closed() || sqlstate(&err).is_some(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_wait_timeout_errors_only_the_waiting_client() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 1, Duration::from_millis(700)).await;
    let holder = client(&via(&p, "read_write")).await.unwrap();
    let waiter = client(&via(&p, "read_write")).await.unwrap();
    holder.batch_execute("BEGIN").await.unwrap();
    one(&holder, "SELECT 1").await;
    let started = std::time::Instant::now();
    let err = waiter.simple_query("SELECT 1").await.unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(650));
    let msg = err
        .as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_default();
    assert!(msg.contains("query_wait_timeout"), "{err}: {msg}");
    // The transaction holding the server is unaffected.
    assert_eq!(one(&holder, "SELECT 2").await, "2");
    holder.batch_execute("COMMIT").await.unwrap();
}

/// Every wait for a server has its own `query_wait_timeout`, counted from
/// when that wait began, however often the client waited before (the
/// timer of a client's waits is kept and moved between them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_wait_for_a_server_gets_its_own_query_wait_timeout() {
    let c = TestCluster::builder().replicas(0).start();
    // The second wait is served a quarter of a wait after the first
    // wait's deadline and as long before its own: room for a loaded
    // machine either way.
    let wait = Duration::from_secs(4);
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool(1, wait), 10_000).await;
    ready(&e, 1).await;
    let holder = client(&via(&p, "read_write")).await.unwrap();
    let waiter = client(&via(&p, "read_write")).await.unwrap();
    // First wait: served after half a wait.
    holder.batch_execute("BEGIN").await.unwrap();
    one(&holder, "SELECT 1").await;
    let t0 = tokio::time::Instant::now();
    let first = tokio::spawn(async move {
        let r = one(&waiter, "SELECT 3").await;
        (waiter, r)
    });
    tokio::time::sleep_until(t0 + wait / 2).await;
    holder.batch_execute("COMMIT").await.unwrap();
    let (waiter, r) = first.await.unwrap();
    assert_eq!(r, "3");
    // Second wait: it lasts past the first wait's deadline and is served.
    holder.batch_execute("BEGIN").await.unwrap();
    one(&holder, "SELECT 1").await;
    let second = tokio::spawn(async move {
        let r = waiter.simple_query("SELECT 4").await.map(|_| ());
        (waiter, r)
    });
    tokio::time::sleep_until(t0 + wait + wait / 4).await;
    holder.batch_execute("COMMIT").await.unwrap();
    let (waiter, r) = second.await.unwrap();
    r.expect("a wait is measured from its own start, not from an earlier one");
    // Third wait: still ends with the time-out, a full query_wait_timeout later.
    holder.batch_execute("BEGIN").await.unwrap();
    one(&holder, "SELECT 1").await;
    let started = std::time::Instant::now();
    let err = waiter.simple_query("SELECT 5").await.unwrap_err();
    assert!(
        started.elapsed() >= wait - Duration::from_millis(50),
        "{:?}",
        started.elapsed()
    );
    let msg = err
        .as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_default();
    assert!(msg.contains("query_wait_timeout"), "{err}: {msg}");
    holder.batch_execute("COMMIT").await.unwrap();
}

/// `pgwarden_pool_clients_waiting` summed over every pool.
async fn clients_waiting(http: std::net::SocketAddr) -> f64 {
    pool_metric(http, "pgwarden_pool_clients_waiting").await
}

/// Waits until `enough` holds for the clients waiting in every pool.
async fn until_waiting(http: std::net::SocketAddr, what: &str, enough: fn(f64) -> bool) {
    pgwarden_testkit::eventually(what, WAIT, || async move {
        let n = clients_waiting(http).await;
        enough(n).then_some(()).ok_or(format!("{n} waiting"))
    })
    .await;
}

/// A POST to the HTTP port: status and body.
async fn post(http: std::net::SocketAddr, path: &'static str) -> (u16, String) {
    tokio::task::spawn_blocking(move || common::http_post(http, path))
        .await
        .unwrap()
}

/// Pooled clients turned away count in `pgwarden_connection_errors_total`
/// by reason, as relayed ones do: no host within `query_wait_timeout`, and
/// a pause that outlasts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_clients_turned_away_are_counted_by_reason() {
    let c = TestCluster::builder().replicas(1).start();
    // The replica alone: the read-write service has no host.
    let (e, p) = proxy_with(
        &c.addrs()[1..],
        Duration::from_secs(3),
        pool(2, Duration::from_millis(500)),
        10_000,
    )
    .await;
    common::until(&e, "the replica probed", WAIT, |s| {
        let alive = s.topology.hosts().iter().filter(|h| h.alive).count();
        (alive == 1).then_some(()).ok_or(format!("{alive} alive"))
    })
    .await;
    let http = p.http_addr().unwrap();
    let err = client(&via(&p, "read_write")).await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("57P03"), "{err}");
    let reader = client(&via(&p, "read_only")).await.unwrap();
    assert_eq!(one(&reader, "SELECT 1").await, "1");
    assert_eq!(post(http, "/pause?service=read_only").await.0, 200);
    let err = reader.simple_query("SELECT 2").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("57P03"), "{err}");
    for (service, reason) in [("read_write", "no_host"), ("read_only", "paused")] {
        let sample = format!(
            "pgwarden_connection_errors_total{{service=\"{service}\",reason=\"{reason}\"}} "
        );
        assert_eq!(common::metric_sample(http, &sample).await, 1.0, "{sample}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_new_transactions_and_resume_releases_them() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 2, Duration::from_secs(30)).await;
    let http = p.http_addr().unwrap();
    let post = move |path: String| common::http_post(http, &path);
    // `read_write` by name, then `*writers` (what a switchover pauses):
    // every service that writes to the primary, and only those.
    for service in ["read_write", "%2Awriters"] {
        let inflight = client(&via(&p, "read_write")).await.unwrap();
        let later = client(&via(&p, "read_write")).await.unwrap();
        let reader = client(&via(&p, "read_only")).await.unwrap();
        inflight.batch_execute("BEGIN").await.unwrap();
        one(&inflight, "SELECT 1").await;
        let (status, body) =
            tokio::task::spawn_blocking(move || post(format!("/pause?service={service}")))
                .await
                .unwrap();
        assert_eq!(status, 200, "{body}");
        // The transaction in flight finishes; the read-only service goes on.
        assert_eq!(one(&inflight, "SELECT 2").await, "2");
        inflight.batch_execute("COMMIT").await.unwrap();
        assert_eq!(one(&reader, "SELECT 4").await, "4");
        // A new one waits while paused, and counts as waiting...
        let waiting = tokio::spawn(async move { one(&later, "SELECT 3").await });
        pgwarden_testkit::eventually("a client counted as waiting", WAIT, || async move {
            let n = clients_waiting(http).await;
            (n == 1.0).then_some(()).ok_or(n.to_string())
        })
        .await;
        assert!(!waiting.is_finished(), "{service}: ran while paused");
        // ...and runs on resume.
        tokio::task::spawn_blocking(move || post(format!("/resume?service={service}")))
            .await
            .unwrap();
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(5), waiting)
                .await
                .unwrap()
                .unwrap(),
            "3"
        );
    }
    // A web page cannot have a browser on this machine stop the writes.
    let refused = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(http).unwrap();
        write!(
            s,
            "POST /pause?service=read_write HTTP/1.0\r\nHost: x\r\n\
             Origin: http://example.com\r\nContent-Length: 0\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
    .await
    .unwrap();
    assert!(refused.starts_with("HTTP/1.0 403"), "{refused}");
    let after = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), one(&after, "SELECT 5"))
            .await
            .expect("paused by a web page"),
        "5"
    );
}

/// The sum of one `/metrics` series over every pool.
async fn pool_metric(http: std::net::SocketAddr, name: &'static str) -> f64 {
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
        .await
        .unwrap();
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `maxwait`/`maxwait_us` of `SHOW POOLS` (and
/// `pgwarden_pool_wait_max_seconds`) are how long the client waiting
/// longest now has waited, as in PgBouncer: they grow while a client waits
/// and drop back to zero once it is served, so an alert on them clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maxwait_is_the_age_of_the_oldest_client_waiting_now() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 2, Duration::from_secs(30)).await;
    let http = p.http_addr().unwrap();
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = std::sync::Arc::new(client(&admin_info).await.unwrap());
    let maxwait_us = |admin: std::sync::Arc<tokio_postgres::Client>| async move {
        let rows = admin.simple_query("SHOW POOLS").await.unwrap();
        rows.iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => {
                    let s: u64 = r.get("maxwait")?.parse().ok()?;
                    let us: u64 = r.get("maxwait_us")?.parse().ok()?;
                    Some(s * 1_000_000 + us)
                }
                _ => None,
            })
            .max()
            .unwrap_or(0)
    };
    let a = client(&via(&p, "read_write")).await.unwrap();
    let b = client(&via(&p, "read_write")).await.unwrap();
    let waiter = client(&via(&p, "read_write")).await.unwrap();
    for h in [&a, &b] {
        h.batch_execute("BEGIN").await.unwrap();
        one(h, "SELECT 1").await;
    }
    let waiting = tokio::spawn(async move { one(&waiter, "SELECT 3").await });
    pgwarden_testkit::eventually("the waiter's wait shows", WAIT, || {
        let admin = admin.clone();
        async move {
            let us = maxwait_us(admin).await;
            (us >= 200_000)
                .then_some(())
                .ok_or(format!("maxwait {us} us"))
        }
    })
    .await;
    assert!(pool_metric(http, "pgwarden_pool_wait_max_seconds").await >= 0.2);
    a.batch_execute("COMMIT").await.unwrap();
    assert_eq!(waiting.await.unwrap(), "3");
    assert_eq!(maxwait_us(admin.clone()).await, 0, "nobody waits any more");
    assert_eq!(
        pool_metric(http, "pgwarden_pool_wait_max_seconds").await,
        0.0
    );
    b.batch_execute("COMMIT").await.unwrap();
}

/// Database and user names come from clients: one with a quote, a
/// backslash or a newline in it leaves `/metrics` well-formed, its pool
/// one series per metric with the name escaped; the same user's pools of
/// the read-write and read-only ports (the latter falling back to the
/// primary) stay apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_stay_well_formed_whatever_the_names() {
    let c = TestCluster::builder().replicas(0).start();
    let direct = client(&c.conninfo(0)).await.unwrap();
    for sql in [
        "CREATE DATABASE \"we\"\"ird\\db\"",
        "CREATE ROLE \"odd\nuser\" LOGIN",
    ] {
        direct.batch_execute(sql).await.unwrap();
    }
    let (_e, p) = pooled_for(&c, 2, Duration::from_secs(30)).await;
    let http = p.http_addr().unwrap();
    for service in ["read_write", "read_only"] {
        let mut cfg = tokio_postgres::Config::new();
        cfg.host("127.0.0.1")
            .dbname("we\"ird\\db")
            .user("odd\nuser")
            .port(p.service_addrs()[service].port());
        let (odd, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(conn);
        assert_eq!(one(&odd, "SELECT 1").await, "1");
    }
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
        .await
        .unwrap();
    let series: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("pgwarden_pool_transactions_total{"))
        .collect();
    let escaped = "database=\"we\\\"ird\\\\db\",user=\"odd\\nuser\"";
    let odd: Vec<&&str> = series.iter().filter(|l| l.contains(escaped)).collect();
    assert_eq!(odd.len(), 2, "{body}");
    assert!(
        odd.iter().any(|l| l.contains("read_only=\"true\"")),
        "{body}"
    );
    // Every line is a comment or one well-formed sample.
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let (name_labels, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        value.parse::<f64>().unwrap_or_else(|_| panic!("{line}"));
        if let Some((_, labels)) = name_labels.split_once('{') {
            let labels = labels.strip_suffix('}').unwrap_or_else(|| panic!("{line}"));
            // Outside quoted values only name=, commas; inside, escapes.
            let (mut quoted, mut escape) = (false, false);
            for ch in labels.chars() {
                match (quoted, escape, ch) {
                    (true, true, _) => escape = false,
                    (true, false, '\\') => escape = true,
                    (true, false, '"') => quoted = false,
                    (false, _, '"') => quoted = true,
                    (false, _, c) => assert!(
                        c.is_ascii_alphanumeric() || c == '_' || c == '=' || c == ',',
                        "{line}"
                    ),
                    _ => {}
                }
            }
            assert!(!quoted, "{line}");
        }
    }
}

/// A client already queued for a server when the service is paused does
/// not start its transaction when a server comes free: the server goes
/// back unused, and the client runs once resumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_queued_before_a_pause_waits_for_the_resume() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 2, Duration::from_secs(30)).await;
    let http = p.http_addr().unwrap();
    let post = move |path: &'static str| common::http_post(http, path);
    let a = client(&via(&p, "read_write")).await.unwrap();
    let b = client(&via(&p, "read_write")).await.unwrap();
    let queued = client(&via(&p, "read_write")).await.unwrap();
    for h in [&a, &b] {
        h.batch_execute("BEGIN").await.unwrap();
        one(h, "SELECT 1").await;
    }
    let waiting = tokio::spawn(async move {
        let r = one(&queued, "SELECT 3").await;
        (queued, r)
    });
    pgwarden_testkit::eventually("the third client queued", WAIT, || async move {
        let n = clients_waiting(http).await;
        (n == 1.0).then_some(()).ok_or(n.to_string())
    })
    .await;
    let (status, body) = tokio::task::spawn_blocking(move || post("/pause?service=read_write"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    for h in [&a, &b] {
        h.batch_execute("COMMIT").await.unwrap();
    }
    // Both servers are back and idle, and the client still waits.
    pgwarden_testkit::eventually(
        "the servers idle, the client waiting",
        WAIT,
        || async move {
            let active = pool_metric(http, "pgwarden_pool_servers_active").await;
            let waiting = clients_waiting(http).await;
            (active == 0.0 && waiting == 1.0)
                .then_some(())
                .ok_or(format!(
                    "{active} servers active, {waiting} clients waiting"
                ))
        },
    )
    .await;
    assert!(!waiting.is_finished(), "ran while paused");
    tokio::task::spawn_blocking(move || post("/resume?service=read_write"))
        .await
        .unwrap();
    let (_queued, r) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r, "3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_client_conn_refuses_new_clients_with_53300() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy_with(
        &c.addrs(),
        Duration::from_secs(3),
        pool(2, Duration::from_secs(30)),
        3,
    )
    .await;
    ready(&e, 1).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(client(&via(&p, "read_write")).await.unwrap());
    }
    let Err(err) = client(&via(&p, "read_write")).await else {
        panic!("a fourth client was accepted");
    };
    assert_eq!(sqlstate(&err).as_deref(), Some("53300"), "{err}");
    // libpq's default sslmode=prefer asks for SSL first: it is declined,
    // and psql shows the reason rather than a broken SSL exchange.
    let out = tokio::process::Command::new("psql")
        .arg(format!("{} sslmode=prefer", via(&p, "read_write")))
        .args(["-c", "SELECT 1"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no more connections allowed (max_client_conn)"),
        "{stderr}"
    );
    for h in &held {
        assert_eq!(one(h, "SELECT 1").await, "1");
    }
    // A cancel request still gets through while no more clients fit: it
    // is what a client stuck behind a long query needs then.
    let token = held[0].cancel_token();
    let sleeper = held.remove(0);
    let long = tokio::spawn(async move { sleeper.simple_query("SELECT pg_sleep(60)").await });
    pgwarden_testkit::eventually("the query running", Duration::from_secs(10), || async {
        let rows = held[1]
            .simple_query("SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(60)' AND state = 'active'")
            .await
            .map_err(|e| e.to_string())?;
        match rows.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        }) {
            Some(n) if n == "1" => Ok(()),
            n => Err(format!("{n:?}")),
        }
    })
    .await;
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(10), long)
        .await
        .expect("the cancel was not delivered")
        .unwrap()
        .unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("57014"), "{err}");
}

/// A flood of connections at `max_client_conn` that send nothing: each is
/// answered with 53300 or, past the refusals served at once (see the
/// proxy's unit test of the bound), closed unanswered; the clients in
/// stay served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_at_max_client_conn_is_turned_away() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool(1, WAIT), 1).await;
    ready(&e, 1).await;
    let held = client(&via(&p, "read_write")).await.unwrap();
    let addr = p.service_addrs()["read_write"];
    let (answered, closed) = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let socks: Vec<std::net::TcpStream> = (0..300)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        let (mut answered, mut closed) = (0, 0);
        for mut s in socks {
            s.set_read_timeout(Some(WAIT)).unwrap();
            let mut got = Vec::new();
            let _ = s.read_to_end(&mut got);
            if got.first() == Some(&b'E') {
                answered += 1;
            } else if got.is_empty() {
                closed += 1;
            }
        }
        (answered, closed)
    })
    .await
    .unwrap();
    assert_eq!(
        answered + closed,
        300,
        "{answered} answered, {closed} closed"
    );
    assert_eq!(one(&held, "SELECT 1").await, "1");
}

/// A pooled client still logging in (waiting for the server its login
/// needs) when the shutdown time-out runs out is told why it is turned
/// away, as the sessions are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_client_still_logging_in_at_the_end_of_a_shutdown_is_told_why() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 1, Duration::from_secs(60)).await;
    let holder = client(&via(&p, "read_write")).await.unwrap();
    holder.batch_execute("BEGIN").await.unwrap();
    one(&holder, "SELECT 1").await;
    let pending = common::waiting_client(
        via(&p, "read_write"),
        "the pool's only server was in a transaction",
    )
    .await;
    common::told_at_shutdown(p, pending).await;
    drop(holder);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_console_counts_each_transaction_of_a_pinned_client() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 2, Duration::from_secs(30)).await;
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = client(&admin_info).await.unwrap();
    let stats = || async {
        let rows = admin.simple_query("SHOW STATS").await.unwrap();
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r)
                    if r.get("database") == Some("postgres") =>
                {
                    Some((
                        r.get("total_xact_count").unwrap().parse::<u64>().unwrap(),
                        r.get("total_xact_time").unwrap().parse::<u64>().unwrap(),
                    ))
                }
                _ => None,
            })
            .unwrap_or((0, 0))
    };
    let (count, time) = stats().await;
    // LISTEN pins the client to its server: every later transaction is on
    // one loan, with time between them that is no transaction's.
    let app = client(&via(&p, "read_write")).await.unwrap();
    app.batch_execute("LISTEN pinned").await.unwrap();
    for i in 0..3 {
        assert_eq!(one(&app, &format!("SELECT {i}")).await, i.to_string());
        // Idle between transactions: the gap being measured, not a wait.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    drop(app);
    let (after, after_time) = pgwarden_testkit::eventually("the loan is counted", WAIT, || async {
        let (n, t) = stats().await;
        (n > count)
            .then_some((n, t))
            .ok_or(format!("{n} transactions"))
    })
    .await;
    assert_eq!(after - count, 4, "LISTEN and three SELECTs");
    assert!(
        after_time - time < 600_000,
        "{} µs in transactions: the idle time between them counted",
        after_time - time
    );
}

/// A relayed (session-mode) client's own server connection is listed by
/// SHOW SERVERS too, linked to the client, as PgBouncer lists every server
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_servers_lists_relayed_sessions_servers() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), None, 10_000).await;
    ready(&e, 1).await;
    let relayed = client(&format!(
        "{} application_name=relayed",
        via(&p, "read_write")
    ))
    .await
    .unwrap();
    let pid = one(&relayed, "SELECT pg_backend_pid()").await;
    let local_port = one(
        &relayed,
        "SELECT client_port FROM pg_stat_activity WHERE pid = pg_backend_pid()",
    )
    .await;
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = client(&admin_info).await.unwrap();
    let rows =
        |msgs: Vec<tokio_postgres::SimpleQueryMessage>| -> Vec<tokio_postgres::SimpleQueryRow> {
            msgs.into_iter()
                .filter_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
                    _ => None,
                })
                .collect()
        };
    let servers = rows(admin.simple_query("SHOW SERVERS").await.unwrap());
    let [server] = &servers[..] else {
        panic!("{} server rows", servers.len());
    };
    let port = c.port(0).to_string();
    assert_eq!(
        (
            server.get("state"),
            server.get("addr"),
            server.get("port"),
            server.get("local_port"),
            server.get("application_name"),
        ),
        (
            Some("active"),
            Some("127.0.0.1"),
            Some(port.as_str()),
            Some(local_port.as_str()),
            Some("relayed")
        ),
        "the backend {pid} sees pgwarden's end as its client"
    );
    let clients = rows(admin.simple_query("SHOW CLIENTS").await.unwrap());
    let client_row = clients
        .iter()
        .find(|r| r.get("database") == Some("postgres"))
        .expect("the relayed client");
    assert_eq!(client_row.get("ptr"), server.get("link"));
    assert_eq!(client_row.get("link"), server.get("ptr"));
    assert_eq!(client_row.get("application_name"), Some("relayed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_console_shows_pools_and_pauses() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 2, Duration::from_secs(30)).await;
    let app = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(one(&app, "SELECT 1").await, "1");
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = client(&admin_info).await.unwrap();
    let rows = admin.simple_query("SHOW POOLS").await.unwrap();
    let row = rows
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
            _ => None,
        })
        .expect("a pool row");
    // PgBouncer 1.18's columns, in its order (tools read them by name or
    // by position), then pgwarden's own.
    let names: Vec<&str> = row.columns().iter().map(|c| c.name()).collect();
    assert_eq!(
        names,
        [
            "database",
            "user",
            "cl_active",
            "cl_waiting",
            "cl_active_cancel_req",
            "cl_waiting_cancel_req",
            "sv_active",
            "sv_active_cancel",
            "sv_being_canceled",
            "sv_idle",
            "sv_used",
            "sv_tested",
            "sv_login",
            "maxwait",
            "maxwait_us",
            "pool_mode",
            "sv_total",
        ]
    );
    assert_eq!(row.get("database"), Some("postgres"));
    assert_eq!(row.get("pool_mode"), Some("transaction"));
    // The client between transactions counts as active, as in PgBouncer;
    // it holds no server (the admin console is no pooled client).
    assert_eq!(
        (
            row.get("cl_active"),
            row.get("cl_waiting"),
            row.get("sv_active")
        ),
        (Some("1"), Some("0"), Some("0"))
    );
    for cmd in ["SHOW CLIENTS", "SHOW SERVERS", "SHOW STATS", "SHOW CONFIG"] {
        admin
            .simple_query(cmd)
            .await
            .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    }
    // What monitoring tools built for PgBouncer read, by its column names.
    let first_row = |msgs: Vec<tokio_postgres::SimpleQueryMessage>| {
        msgs.into_iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
                _ => None,
            })
            .expect("a row")
    };
    let v = first_row(admin.simple_query("SHOW VERSION").await.unwrap());
    assert!(v.get("version").unwrap().starts_with("pgwarden "));
    let d = first_row(admin.simple_query("SHOW DATABASES").await.unwrap());
    assert_eq!(d.get("name"), Some("postgres"));
    assert_eq!(d.get("pool_size"), Some("2"));
    assert_eq!(d.get("port"), Some(c.port(0).to_string().as_str()));
    assert!(d.get("current_connections").is_some());
    let lists = admin.simple_query("SHOW LISTS").await.unwrap();
    let items: std::collections::HashMap<String, String> = lists
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some((r.get("list")?.to_string(), r.get("items")?.to_string()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(items["pools"], "1", "{items:?}");
    assert_eq!(items["databases"], "1", "{items:?}");
    assert!(
        items["used_clients"].parse::<usize>().unwrap() >= 1,
        "{items:?}"
    );
    let clients = admin.simple_query("SHOW CLIENTS").await.unwrap();
    let mut listed: Vec<(String, String)> = clients
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some((
                r.get("database").unwrap_or_default().to_string(),
                r.get("state").unwrap_or_default().to_string(),
            )),
            _ => None,
        })
        .collect();
    listed.sort();
    // The application client, and this console session, as PgBouncer
    // lists its console's clients.
    assert_eq!(
        listed,
        [
            ("pgwarden".to_string(), "active".to_string()),
            ("postgres".to_string(), "idle".to_string()),
        ],
        "SHOW CLIENTS lists the application client and the console"
    );
    // A pooled client is active, with its server, while it holds one, and
    // waiting while it waits for one.
    let busy = client(&format!("{} application_name=busy", via(&p, "read_write")))
        .await
        .unwrap();
    busy.batch_execute("BEGIN").await.unwrap();
    one(&busy, "SELECT 1").await;
    let seen = client_states(&admin).await;
    assert!(
        seen.contains(&("active".into(), format!("127.0.0.1:{}", c.port(0)))),
        "{seen:?}"
    );
    // PgBouncer's columns in its order (tools read them by position),
    // pgwarden's after them; the busy client's own row says where it came
    // in and which backend serves it.
    let busy_pid = one(&busy, "SELECT pg_backend_pid()").await;
    for cmd in ["SHOW CLIENTS", "SHOW SERVERS"] {
        let msgs = admin.simple_query(cmd).await.unwrap();
        let columns: Vec<String> = msgs
            .iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::RowDescription(d) => {
                    Some(d.iter().map(|c| c.name().to_string()).collect())
                }
                _ => None,
            })
            .unwrap();
        assert_eq!(
            columns,
            [
                "type",
                "user",
                "database",
                "state",
                "addr",
                "port",
                "local_addr",
                "local_port",
                "connect_time",
                "request_time",
                "wait",
                "wait_us",
                "close_needed",
                "ptr",
                "link",
                "remote_pid",
                "tls",
                "application_name",
                "service",
                "server"
            ],
            "{cmd}"
        );
    }
    let rows = admin.simple_query("SHOW CLIENTS").await.unwrap();
    let row = rows
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r)
                if r.get("remote_pid") == Some(busy_pid.as_str()) =>
            {
                Some(r)
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no row for backend {busy_pid}"));
    let rw_port = p.service_addrs()["read_write"].port().to_string();
    assert_eq!(row.get("local_port"), Some(rw_port.as_str()));
    assert_eq!(row.get("local_addr"), Some("127.0.0.1"));
    // `link` is the server connection's `ptr` in SHOW SERVERS, and that
    // row's `link` the client's `ptr`, as in PgBouncer.
    let backend = format!("127.0.0.1:{}/{busy_pid}", c.port(0));
    assert_eq!(row.get("link"), Some(backend.as_str()));
    assert_eq!(row.get("application_name"), Some("busy"));
    let client_ptr = row.get("ptr").unwrap().to_string();
    let connected = row.get("connect_time").unwrap();
    assert!(
        connected.len() == 23 && connected.ends_with(" UTC") && connected.starts_with("20"),
        "{connected}"
    );
    let server_row = |msgs: Vec<tokio_postgres::SimpleQueryMessage>| {
        msgs.into_iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r)
                if r.get("remote_pid") == Some(busy_pid.as_str()) =>
            {
                Some(r)
            }
            _ => None,
        })
    };
    let lent = server_row(admin.simple_query("SHOW SERVERS").await.unwrap())
        .expect("SHOW SERVERS lists the lent server");
    let port = c.port(0).to_string();
    assert_eq!(
        (
            lent.get("state"),
            lent.get("addr"),
            lent.get("port"),
            lent.get("ptr"),
            lent.get("link"),
        ),
        (
            Some("active"),
            Some("127.0.0.1"),
            Some(port.as_str()),
            Some(backend.as_str()),
            Some(client_ptr.as_str())
        )
    );
    busy.batch_execute("COMMIT").await.unwrap();
    // Given back, it is idle, linked to no client, with its own details.
    let idle = pgwarden_testkit::eventually("the server is idle", WAIT, || async {
        let row = server_row(admin.simple_query("SHOW SERVERS").await.unwrap());
        match row {
            Some(r) if r.get("state") == Some("idle") => Ok(r),
            other => Err(format!(
                "{:?}",
                other.map(|r| r.get("state").map(String::from))
            )),
        }
    })
    .await;
    assert_eq!(idle.get("link"), Some(""));
    assert_eq!(idle.get("ptr"), Some(backend.as_str()));
    assert_eq!(idle.get("local_addr"), Some("127.0.0.1"));
    assert!(
        idle.get("local_port").unwrap().parse::<u16>().unwrap() > 0,
        "{:?}",
        idle.get("local_port")
    );
    for time in ["connect_time", "request_time"] {
        assert!(idle.get(time).unwrap().ends_with(" UTC"), "{time}");
    }
    assert_eq!(idle.get("application_name"), Some("busy"));
    admin.simple_query("PAUSE read_write").await.unwrap();
    let waiting = tokio::spawn(async move { one(&app, "SELECT 5").await });
    pgwarden_testkit::eventually("the client waits for the resume", WAIT, || async {
        let seen = client_states(&admin).await;
        seen.contains(&("waiting".into(), String::new()))
            .then_some(())
            .ok_or(format!("{seen:?}"))
    })
    .await;
    // SHOW CLIENTS says for how long, in seconds and microseconds.
    let waited = pgwarden_testkit::eventually("the wait is timed", WAIT, || async {
        let rows = admin.simple_query("SHOW CLIENTS").await.unwrap();
        let waits: Vec<u64> = rows
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) if r.get("state") == Some("waiting") => {
                    let s: u64 = r.get("wait")?.parse().ok()?;
                    let us: u64 = r.get("wait_us")?.parse().ok()?;
                    Some(s * 1_000_000 + us)
                }
                _ => None,
            })
            .collect();
        match waits[..] {
            [us] if us > 0 => Ok(us),
            _ => Err(format!("{waits:?}")),
        }
    })
    .await;
    assert!(waited < 60_000_000, "{waited} µs");
    assert!(!waiting.is_finished(), "ran while paused");
    admin.simple_query("RESUME read_write").await.unwrap();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap(),
        "5"
    );
    let err = admin.simple_query("SHOW NONSENSE").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("0A000"));
    // A PgBouncer habit, pausing a database, is told what pgwarden pauses.
    let err = admin.simple_query("PAUSE postgres").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("22023"));
    let hint = err.as_db_error().and_then(|d| d.hint()).unwrap_or_default();
    assert!(
        hint.contains("service name") && hint.contains("read_write"),
        "{hint}"
    );
    // Only configured admin users get in.
    let Err(err) = client(&admin_info.replace("user=postgres", "user=intruder")).await else {
        panic!("a non-admin user got into the console");
    };
    assert_eq!(sqlstate(&err).as_deref(), Some("28000"), "{err}");
}

/// The admin console's PAUSE answers once the paused service's pooled
/// clients hold no server connection, as PgBouncer's does: a transaction
/// in flight is waited for, another service's is not. The pause shows on
/// /cluster and /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_pause_waits_for_transactions_in_flight() {
    let c = TestCluster::builder().replicas(1).start();
    let pool = PoolSettings {
        size: 2,
        ..PoolSettings::default()
    };
    let (e, p) = common::proxy_with(&c.addrs(), Duration::from_secs(10), Some(pool), 10_000).await;
    ready(&e, 2).await;
    let http = p.http_addr().unwrap();
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = client(&admin_info).await.unwrap();
    let busy = client(&via(&p, "read_write")).await.unwrap();
    busy.batch_execute("BEGIN").await.unwrap();
    one(&busy, "SELECT 1").await;
    // Another service's transaction is not waited for.
    tokio::time::timeout(
        Duration::from_secs(10),
        admin.simple_query("PAUSE read_only"),
    )
    .await
    .expect("PAUSE read_only waited for read_write")
    .unwrap();
    admin.simple_query("RESUME read_only").await.unwrap();
    // The paused service's is.
    let pausing = tokio::spawn(async move {
        admin.simple_query("PAUSE read_write").await.unwrap();
        admin
    });
    pgwarden_testkit::eventually("the pause shows", WAIT, || async move {
        let (code, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/cluster"))
            .await
            .unwrap();
        let doc: serde_json::Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        let paused = doc["services"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["name"] == "read_write")
            .map(|s| s["paused"].clone());
        (code == 200 && paused == Some(serde_json::Value::Bool(true)))
            .then_some(())
            .ok_or(format!("{code} {paused:?}"))
    })
    .await;
    assert_eq!(
        common::metric_sample(http, "pgwarden_service_paused{service=\"read_write\"}").await,
        1.0
    );
    // Given time to answer early, it does not.
    let round = e.snapshot().round;
    e.wait_round(round + 2).await;
    assert!(
        !pausing.is_finished(),
        "PAUSE answered with a transaction in flight"
    );
    busy.batch_execute("COMMIT").await.unwrap();
    let admin = tokio::time::timeout(Duration::from_secs(10), pausing)
        .await
        .expect("PAUSE answered once the transaction ended")
        .unwrap();
    admin.simple_query("RESUME read_write").await.unwrap();
    assert_eq!(one(&busy, "SELECT 2").await, "2");
    assert_eq!(
        common::metric_sample(http, "pgwarden_service_paused{service=\"read_write\"}").await,
        0.0
    );
    // Written with a space before its semicolon, it waits all the same;
    // and a resume from elsewhere (here the HTTP port) ends the wait.
    busy.batch_execute("BEGIN").await.unwrap();
    one(&busy, "SELECT 3").await;
    let pausing = tokio::spawn(async move {
        admin.simple_query("PAUSE read_write ;").await.unwrap();
        admin
    });
    pgwarden_testkit::eventually("the pause shows", WAIT, || async move {
        let v =
            common::metric_sample(http, "pgwarden_service_paused{service=\"read_write\"}").await;
        (v == 1.0).then_some(()).ok_or(format!("{v}"))
    })
    .await;
    let round = e.snapshot().round;
    e.wait_round(round + 2).await;
    assert!(
        !pausing.is_finished(),
        "PAUSE answered with a transaction in flight"
    );
    let (code, _) =
        tokio::task::spawn_blocking(move || common::http_post(http, "/resume?service=read_write"))
            .await
            .unwrap();
    assert_eq!(code, 200);
    tokio::time::timeout(Duration::from_secs(10), pausing)
        .await
        .expect("PAUSE answered once resumed elsewhere")
        .unwrap();
    busy.batch_execute("COMMIT").await.unwrap();
}

/// A client pinned to its server by session state is between transactions
/// most of the time: a pause holds its next transaction as it holds any
/// other client's, and neither a switchover's drain (`POST /pause` with
/// `wait_ms`) nor the admin console's PAUSE waits for it to leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_client_is_paused_between_transactions_not_waited_for() {
    let c = TestCluster::builder().replicas(0).start();
    let pool = PoolSettings {
        size: 2,
        ..PoolSettings::default()
    };
    let (e, p) = common::proxy_with(&c.addrs(), Duration::from_secs(10), Some(pool), 10_000).await;
    ready(&e, 1).await;
    let http = p.http_addr().unwrap();
    let pinned = std::sync::Arc::new(client(&via(&p, "read_write")).await.unwrap());
    pinned
        .batch_execute("LISTEN pgwarden_pinned")
        .await
        .unwrap();
    assert_eq!(one(&pinned, "SELECT 1").await, "1");
    let (code, body) = tokio::task::spawn_blocking(move || {
        common::http_post(http, "/pause?service=read_write&wait_ms=3000")
    })
    .await
    .unwrap();
    assert_eq!(
        (code, body.as_str()),
        (200, "paused read_write; no transaction in flight\n")
    );
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = client(&admin_info).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        admin.simple_query("PAUSE read_write"),
    )
    .await
    .expect("the admin PAUSE waited for the pinned client")
    .unwrap();
    // Its next transaction waits for the resume, counted as waiting.
    let held = pinned.clone();
    let next = tokio::spawn(async move { one(&held, "SELECT 2").await });
    until_waiting(http, "the pinned client waits", |n| n == 1.0).await;
    assert!(!next.is_finished(), "ran while paused");
    admin.simple_query("RESUME read_write").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("served after the resume")
        .unwrap();
    assert_eq!(got, "2");
    // Still its own server, LISTEN and all.
    let listening = one(&pinned, "SELECT count(*) FROM pg_listening_channels()").await;
    assert_eq!(listening, "1");
}

/// A pinned client left idle on a pool that was retired (its host removed
/// while still running) keeps its server until its next message; it must
/// not be taken for a client between transactions of the pools in use,
/// or a drain would answer "no transaction in flight" while one runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_kept_on_a_retired_pool_does_not_hide_a_transaction_from_a_drain() {
    let c = TestCluster::builder().replicas(1).start();
    let (e, p) =
        common::proxy_with(&c.addrs(), Duration::from_secs(10), pool(2, WAIT), 10_000).await;
    ready(&e, 2).await;
    let http = p.http_addr().unwrap();
    let pinned = client(&via(&p, "read_only")).await.unwrap();
    pinned
        .batch_execute("SELECT pg_advisory_lock(7)")
        .await
        .unwrap();
    assert_eq!(
        one(&pinned, "SELECT inet_server_port()").await,
        c.port(1).to_string()
    );
    // The replica leaves the configuration but keeps running.
    e.set_hosts(common::hosts(&c.addrs()[..1]));
    pgwarden_testkit::eventually("the replica is gone", WAIT, || {
        let n = e.snapshot().topology.hosts().len();
        async move { (n == 1).then_some(()).ok_or(n.to_string()) }
    })
    .await;
    // Read-only traffic falls back to the primary, in a transaction now.
    let busy = client(&via(&p, "read_only")).await.unwrap();
    busy.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        one(&busy, "SELECT inet_server_port()").await,
        c.port(0).to_string()
    );
    let (code, body) = post(http, "/pause?service=read_only&wait_ms=300").await;
    assert_eq!(
        (code, body.as_str()),
        (503, "paused read_only; 1 transactions still in flight\n")
    );
    assert_eq!(post(http, "/resume?service=read_only").await.0, 200);
    busy.batch_execute("COMMIT").await.unwrap();
    drop(pinned);
}

/// A cancel request for a pinned client whose statement waits for a paused
/// service to resume cancels that statement (57014): it never runs, and
/// the client keeps its server and session state. Sent on to the idle
/// server, it was ignored and the statement ran at the resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_ends_a_pinned_clients_wait_for_the_resume() {
    let c = TestCluster::builder().replicas(0).start();
    common::sql(&c.conninfo(0), "CREATE TABLE held_cancel (x int)").await;
    let (e, p) =
        common::proxy_with(&c.addrs(), Duration::from_secs(10), pool(2, WAIT), 10_000).await;
    ready(&e, 1).await;
    let http = p.http_addr().unwrap();
    let pinned = std::sync::Arc::new(client(&via(&p, "read_write")).await.unwrap());
    pinned.batch_execute("LISTEN held_cancel").await.unwrap();
    let (code, _) = post(http, "/pause?service=read_write&wait_ms=3000").await;
    assert_eq!(code, 200);
    let held = pinned.clone();
    let insert = tokio::spawn(async move {
        held.batch_execute("INSERT INTO held_cancel VALUES (1)")
            .await
    });
    until_waiting(http, "the pinned client waits", |n| n == 1.0).await;
    pinned
        .cancel_token()
        .cancel_query(tokio_postgres::NoTls)
        .await
        .unwrap();
    let err = tokio::time::timeout(Duration::from_secs(10), insert)
        .await
        .expect("the cancel ended the wait")
        .unwrap()
        .unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("57014"), "{err}");
    assert_eq!(post(http, "/resume?service=read_write").await.0, 200);
    assert_eq!(
        one(&pinned, "SELECT count(*) FROM pg_listening_channels()").await,
        "1"
    );
    assert_eq!(
        common::sql_value(&c.conninfo(0), "SELECT count(*) FROM held_cancel")
            .await
            .unwrap(),
        "0"
    );
}

/// A session-pooled client (`reuse_session_servers`) that has run nothing
/// since it logged in is between transactions: a switchover's drain
/// (`POST /pause` with `wait_ms`) does not wait for it, and its first
/// statement waits for the resume instead of running on the paused
/// service's host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_session_pooled_client_is_paused_not_waited_for() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = session_pooling_proxy(
        &c,
        PoolSettings {
            size: 2,
            ..PoolSettings::default()
        },
    )
    .await;
    let http = p.http_addr().unwrap();
    let fresh = std::sync::Arc::new(client(&via(&p, "read_write")).await.unwrap());
    let (code, body) = post(http, "/pause?service=read_write&wait_ms=3000").await;
    assert_eq!(
        (code, body.as_str()),
        (200, "paused read_write; no transaction in flight\n")
    );
    let held = fresh.clone();
    let first = tokio::spawn(async move { one(&held, "SELECT 1").await });
    until_waiting(http, "the fresh client waits", |n| n == 1.0).await;
    assert!(!first.is_finished(), "ran while paused");
    assert_eq!(post(http, "/resume?service=read_write").await.0, 200);
    let got = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("served after the resume")
        .unwrap();
    assert_eq!(got, "1");
}

/// With `max_db_connections` below the pool's size, a client that has the
/// pool's permit and waits for room under the cap is served by the next
/// connection given back, ahead of the clients in line behind it; a line
/// that keeps every connection busy no longer starves it until
/// `query_wait_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_waiting_under_a_cap_is_not_starved_by_the_line() {
    let c = TestCluster::builder().replicas(0).start();
    let settings = PoolSettings {
        size: 2,
        query_wait_timeout: Duration::from_secs(6),
        ..PoolSettings::default()
    };
    let overrides = pgwarden_proxy::PoolOverrides {
        db_limits: pgwarden_proxy::ConnLimits {
            default: 1,
            by_name: Default::default(),
        },
        ..Default::default()
    };
    let (e, p) = common::proxy_full(
        &c.addrs(),
        Duration::from_secs(3),
        Some(settings),
        10_000,
        overrides,
        None,
    )
    .await;
    ready(&e, 1).await;
    let http = p.http_addr().unwrap();
    let rw = via(&p, "read_write");
    // Logged in before the cap is taken: a login borrows a server too.
    let holder = client(&rw).await.unwrap();
    let capped = client(&rw).await.unwrap();
    let mut busy = Vec::new();
    for _ in 0..3 {
        busy.push(client(&rw).await.unwrap());
    }
    holder.batch_execute("BEGIN").await.unwrap();
    one(&holder, "SELECT 1").await;
    // The second permit's holder waits under the cap.
    let served = tokio::spawn(async move {
        let t = std::time::Instant::now();
        capped.batch_execute("SELECT 1").await.map(|_| t.elapsed())
    });
    until_waiting(http, "a client waiting under the cap", |n| n == 1.0).await;
    // A line behind it that never lets up.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut line = Vec::new();
    for cl in busy {
        let stop = stop.clone();
        line.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                cl.batch_execute("SELECT pg_sleep(0.02)").await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    until_waiting(http, "the line waiting", |n| n >= 2.0).await;
    holder.batch_execute("COMMIT").await.unwrap();
    let waited = served.await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in line {
        l.await.unwrap().unwrap();
    }
    let waited = waited.expect("the client under the cap was served");
    assert!(waited < Duration::from_secs(6), "waited {waited:?}");
}

/// `server_lifetime` also closes connections that sit idle past it (they
/// were only closed when given back), and `server_idle_timeout` keeps
/// `min_size` of them open, as PgBouncer's janitor does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_follow_server_lifetime_and_keep_min_size() {
    let c = TestCluster::builder().replicas(0).start();
    let target = c.conninfo(0);
    let count = |n: usize| {
        let t = target.clone();
        pgwarden_testkit::eventually("server connections", WAIT, move || {
            let t = t.clone();
            async move {
                let have = server_connections(&t).await;
                (have == n)
                    .then_some(())
                    .ok_or(format!("{have} server connections, want {n}"))
            }
        })
    };
    // Lifetime: an idle connection goes, with nothing given back.
    let (e, p) = proxy_with(
        &c.addrs(),
        Duration::from_secs(3),
        Some(PoolSettings {
            size: 3,
            server_lifetime: Some(Duration::from_secs(1)),
            ..PoolSettings::default()
        }),
        10_000,
    )
    .await;
    ready(&e, 1).await;
    let a = client(&via(&p, "read_write")).await.unwrap();
    one(&a, "SELECT 1").await;
    count(0).await;
    // Still served, on a new connection.
    assert_eq!(one(&a, "SELECT 2").await, "2");
    drop((a, p, e));
    count(0).await;
    // Idle timeout: three opened, two kept.
    let (e, p) = proxy_with(
        &c.addrs(),
        Duration::from_secs(3),
        Some(PoolSettings {
            size: 3,
            min_size: 2,
            server_idle_timeout: Some(Duration::from_millis(500)),
            ..PoolSettings::default()
        }),
        10_000,
    )
    .await;
    ready(&e, 1).await;
    let clients = [
        client(&via(&p, "read_write")).await.unwrap(),
        client(&via(&p, "read_write")).await.unwrap(),
        client(&via(&p, "read_write")).await.unwrap(),
    ];
    for cl in &clients {
        cl.batch_execute("BEGIN").await.unwrap();
    }
    count(3).await;
    for cl in &clients {
        cl.batch_execute("COMMIT").await.unwrap();
    }
    count(2).await;
    // And stays so over several more rounds of the janitor.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(server_connections(&target).await, 2);
}

/// A read-only pooled service refuses a session whose `client_encoding`
/// would be a client-only encoding (one whose characters may end in a
/// backslash or quote): asked for in any case at start-up, or left at a
/// role's default that the greeting would hand the client. A client that
/// asks for UTF8 is let in as that role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_pools_refuse_client_only_encodings_from_any_source() {
    let c = TestCluster::builder().replicas(0).start();
    common::sql(
        &c.conninfo(0),
        "CREATE ROLE sj LOGIN; ALTER ROLE sj SET client_encoding = 'SJIS'",
    )
    .await;
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool(2, WAIT), 10_000).await;
    ready(&e, 1).await;
    let ro = p.service_addrs()["read_only"];
    let rw = p.service_addrs()["read_write"];
    let refused = |addr: std::net::SocketAddr, params: Vec<(&'static str, &'static str)>| {
        let (_, greeting) = RawClient::greeted(addr, &params);
        match greeting.last() {
            Some((b'E', body)) => String::from_utf8_lossy(body).contains("C25006"),
            _ => false,
        }
    };
    let cases = [
        (
            ro,
            vec![
                ("user", "postgres"),
                ("database", "postgres"),
                ("Client_Encoding", "SJIS"),
            ],
            true,
        ),
        (ro, vec![("user", "sj"), ("database", "postgres")], true),
        (
            ro,
            vec![
                ("user", "sj"),
                ("database", "postgres"),
                ("client_encoding", "UTF8"),
            ],
            false,
        ),
        (rw, vec![("user", "sj"), ("database", "postgres")], false),
    ];
    for (addr, params, want) in cases {
        let shown = format!("{params:?}");
        let got = tokio::task::spawn_blocking(move || refused(addr, params))
            .await
            .unwrap();
        assert_eq!(got, want, "{shown} on {addr}");
    }
}

/// A pool with `min_size` whose logins fail (here a database that does
/// not exist) does not try again at every topology change, several times
/// a second: warm-ups wait after a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_warm_ups_back_off() {
    let c = TestCluster::builder().replicas(0).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(0).parse().unwrap()).unwrap();
    let settings = PoolSettings {
        size: 5,
        min_size: 3,
        ..PoolSettings::default()
    };
    let (e, p) = proxy_with(
        &[relay.addr().to_string()],
        Duration::from_secs(3),
        Some(settings),
        10_000,
    )
    .await;
    ready(&e, 1).await;
    let rw = via(&p, "read_write").replace("dbname=postgres", "dbname=nosuchdb");
    let Err(err) = client(&rw).await else {
        panic!("logged in to a database that does not exist");
    };
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::INVALID_CATALOG_NAME)
    );
    // The login and one round of warm-ups; then, over several probe
    // rounds, nothing more (it was three every round).
    let before = relay.accepted();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = relay.accepted();
    assert!(after - before <= 5, "{} connections in 4 s", after - before);
}

/// A client that closes its connection, or is killed, while it waits for
/// a server leaves the line at once, and the statement it sent never runs:
/// run later, after the application gave up (and perhaps retried), it
/// could write twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_waiting_is_not_served() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(0).start();
    common::sql(&c.conninfo(0), "CREATE TABLE ghost (x int)").await;
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool(1, WAIT), 10_000).await;
    ready(&e, 1).await;
    let http = p.http_addr().unwrap();
    let rw = p.service_addrs()["read_write"];
    let waiting = |n: f64| {
        pgwarden_testkit::eventually("clients waiting", WAIT, move || async move {
            let v = common::metric_sample(http, "pgwarden_pool_clients_waiting{").await;
            (v == n)
                .then_some(())
                .ok_or(format!("{v} waiting, want {n}"))
        })
    };
    // Logged in first: a login borrows a server too.
    let connect =
        move || RawClient::connect_with(rw, &[("user", "postgres"), ("database", "postgres")]);
    let mut gone = tokio::task::spawn_blocking(connect).await.unwrap();
    let mut killed = tokio::task::spawn_blocking(connect).await.unwrap();
    let mut killed_busy = tokio::task::spawn_blocking(connect).await.unwrap();
    let holder = client(&via(&p, "read_write")).await.unwrap();
    holder.batch_execute("BEGIN").await.unwrap();
    one(&holder, "SELECT 1").await;
    // Closed while waiting.
    gone.0
        .write_all(&msg_query(b"INSERT INTO ghost VALUES (1)"))
        .unwrap();
    waiting(1.0).await;
    drop(gone);
    waiting(0.0).await;
    // Killed while waiting: told why at once (the holder goes too).
    killed
        .0
        .write_all(&msg_query(b"INSERT INTO ghost VALUES (2)"))
        .unwrap();
    // One that sent more than pgwarden reads at once: the bytes left in
    // its socket hide the end a kill shows there.
    let mut pipeline = Vec::new();
    for _ in 0..4000 {
        pipeline.extend(msg_query(b"INSERT INTO ghost VALUES (3)"));
    }
    killed_busy.0.write_all(&pipeline).unwrap();
    waiting(2.0).await;
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = client(&admin_info).await.unwrap();
    admin.simple_query("KILL postgres").await.unwrap();
    let replies = tokio::task::spawn_blocking(move || killed.until_closed())
        .await
        .unwrap();
    assert_eq!(
        error_code(&replies).as_deref(),
        Some("57P01"),
        "{replies:?}"
    );
    // Its FATAL may be lost to the reset that closing a socket with
    // unread bytes sends: that it ends is what counts.
    tokio::task::spawn_blocking(move || killed_busy.until_closed())
        .await
        .unwrap();
    waiting(0.0).await;
    // Nothing of them ran, then or later.
    let round = e.snapshot().round;
    e.wait_round(round + 2).await;
    let n = common::sql_value(&c.conninfo(0), "SELECT count(*) FROM ghost").await;
    assert_eq!(n.as_deref(), Some("0"));
}

/// A statement pipelined with a Terminate behind it (sent in one go, the
/// connection then closed) still waits its turn and runs, as on a direct
/// connection: the client ended its session, it did not give up on the
/// statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_pipelined_before_a_terminate_runs_after_its_wait() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(0).start();
    common::sql(&c.conninfo(0), "CREATE TABLE piped (x int)").await;
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool(1, WAIT), 10_000).await;
    ready(&e, 1).await;
    let http = p.http_addr().unwrap();
    let rw = p.service_addrs()["read_write"];
    let connect =
        move || RawClient::connect_with(rw, &[("user", "postgres"), ("database", "postgres")]);
    let piped = tokio::task::spawn_blocking(connect).await.unwrap();
    let holder = client(&via(&p, "read_write")).await.unwrap();
    holder.batch_execute("BEGIN").await.unwrap();
    one(&holder, "SELECT 1").await;
    let mut bytes = msg_query(b"INSERT INTO piped VALUES (1)");
    bytes.extend([b'X', 0, 0, 0, 4]);
    (&piped.0).write_all(&bytes).unwrap();
    piped.0.shutdown(std::net::Shutdown::Write).unwrap();
    pgwarden_testkit::eventually("the statement waits", WAIT, || async move {
        let v = common::metric_sample(http, "pgwarden_pool_clients_waiting{").await;
        (v == 1.0).then_some(()).ok_or(format!("{v} waiting"))
    })
    .await;
    drop(piped);
    holder.batch_execute("COMMIT").await.unwrap();
    let conninfo = c.conninfo(0);
    pgwarden_testkit::eventually("the statement ran", WAIT, || {
        let conninfo = conninfo.clone();
        async move {
            let n = common::sql_value(&conninfo, "SELECT count(*) FROM piped").await;
            (n.as_deref() == Some("1"))
                .then_some(())
                .ok_or(format!("{n:?}"))
        }
    })
    .await;
}

/// A Terminate sent with the start-up packet, before the greeting, ends
/// the session once the client is greeted (the connection was left open
/// until more bytes came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminate_with_the_start_up_packet_ends_the_session() {
    use std::io::{Read, Write};
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool(2, WAIT), 10_000).await;
    ready(&e, 1).await;
    let rw = p.service_addrs()["read_write"];
    let terminate = [b'X', 0, 0, 0, 4];
    let got = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(rw).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut bytes = startup_packet(&[("user", "postgres"), ("database", "postgres")]);
        bytes.extend_from_slice(&terminate);
        s.write_all(&bytes).unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).map(|_| got)
    })
    .await
    .unwrap()
    .expect("closed after the greeting");
    assert_eq!(got.first(), Some(&b'R'), "greeted first");
}

/// A server that accepts a connection and then says nothing (frozen, or
/// cut off before the probes notice) costs a pooled client its
/// `server_connect_timeout` (2 s here), not its whole `query_wait_timeout`
/// (30 s): it then picks a host again and is served by another replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_costs_the_connect_timeout_not_the_whole_wait() {
    let c = TestCluster::builder().replicas(2).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(1).parse().unwrap()).unwrap();
    let addrs = vec![c.addr(0), relay.addr().to_string(), c.addr(2)];
    let (e, p) = proxy_with(
        &addrs,
        Duration::from_secs(3),
        pool(2, Duration::from_secs(30)),
        10_000,
    )
    .await;
    ready(&e, 3).await;
    // The probe's connection stays; new ones to the replica hang.
    relay.set_hold_new(true);
    for i in 0..4 {
        let served = tokio::time::timeout(Duration::from_secs(15), async {
            let ro = client(&via(&p, "read_only")).await.unwrap();
            for _ in 0..2 {
                assert_eq!(one(&ro, "SELECT pg_is_in_recovery()").await, "t");
            }
        })
        .await;
        assert!(served.is_ok(), "client {i} waited on the silent server");
    }
    relay.set_hold_new(false);
}

/// Message lengths are checked as PostgreSQL checks them: a message of a
/// type that carries no SQL or data may not claim more than 10,000 bytes,
/// and a header claiming a gigabyte of Query gets room as bytes arrive,
/// not a gigabyte at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_lengths_are_checked_before_memory_is_taken() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool(2, WAIT), 10_000).await;
    ready(&e, 1).await;
    let rw = p.service_addrs()["read_write"];
    let connect =
        move || RawClient::connect_with(rw, &[("user", "postgres"), ("database", "postgres")]);
    let mut raw = tokio::task::spawn_blocking(connect).await.unwrap();
    let mut sync = vec![b'S'];
    sync.extend_from_slice(&20_000u32.to_be_bytes());
    raw.0.write_all(&sync).unwrap();
    let replies = tokio::task::spawn_blocking(move || raw.until_closed())
        .await
        .unwrap();
    assert_eq!(
        error_code(&replies).as_deref(),
        Some("08P01"),
        "{replies:?}"
    );
    let vm_size = || {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmSize:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap()
    };
    let before = vm_size();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut raw = tokio::task::spawn_blocking(connect).await.unwrap();
        let mut q = vec![b'Q'];
        q.extend_from_slice(&0x3FFF_FFF0u32.to_be_bytes());
        q.extend_from_slice(b"SELECT ");
        raw.0.write_all(&q).unwrap();
        held.push(raw);
    }
    // Every header has been read: the clients still work as a whole.
    let check = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(one(&check, "SELECT 1").await, "1");
    let round = e.snapshot().round;
    e.wait_round(round + 2).await;
    let grown_kib = vm_size().saturating_sub(before);
    assert!(
        grown_kib < 1 << 20,
        "address space grew by {grown_kib} KiB for four headers"
    );
    drop(held);
}

/// Each pool counts the queries it served, the bytes both ways, how long
/// its servers were lent and how long they worked on queries, in SHOW
/// STATS (PgBouncer's column names) and on /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_count_queries_and_bytes() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 2).await;
    let mut app = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    // Three queries, one of them an extended-protocol batch (unnamed, so
    // passed on unchanged), and 100 kB back.
    let mut batch = msg_parse(b"", b"SELECT 2");
    batch.extend(msg_bind_execute(b""));
    batch.extend_from_slice(MSG_SYNC);
    let sent = [
        msg_query(b"SELECT 1"),
        batch,
        msg_query(b"SELECT repeat('y', 100000)"),
    ];
    for m in &sent {
        assert_eq!(error_code(&app.send(m)), None);
    }
    let sent_bytes: usize = sent.iter().map(Vec::len).sum();
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = client(&admin_info).await.unwrap();
    // A pool's counts grow when the server goes back to it, just after the
    // client has its reply.
    let admin = &admin;
    let stats = stats_once(admin, "total_query_count", 3).await;
    // Each query its own transaction; the login's loan of a server (for
    // its greeting) is none.
    assert_eq!(stats["total_xact_count"], 3, "{stats:?}");
    assert_eq!(stats["total_received"], sent_bytes as u64, "{stats:?}");
    assert!(stats["total_sent"] > 100_000, "{stats:?}");
    let http = p.http_addr().unwrap();
    let series = metrics_of(http).await;
    assert_eq!(series("pgwarden_pool_queries_total"), 3.0);
    assert_eq!(
        series("pgwarden_pool_received_bytes_total"),
        sent_bytes as f64
    );
    assert!(series("pgwarden_pool_sent_bytes_total") > 100_000.0);
    assert_eq!(series("pgwarden_pool_clients_active"), 0.0);

    // Times: a transaction that runs a 300 ms query, then sits idle in the
    // transaction for 400 ms. Its server was lent for 700 ms or more, and
    // busy with queries for 300 ms or more but not during the idle part.
    let before_xact = stats["total_xact_time"];
    let before_query = stats["total_query_time"];
    assert!(before_xact >= before_query, "{stats:?}");
    for m in [&b"BEGIN"[..], b"SELECT pg_sleep(0.3)"] {
        assert_eq!(error_code(&app.send(&msg_query(m))), None);
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(error_code(&app.send(&msg_query(b"COMMIT"))), None);
    let stats = stats_once(admin, "total_xact_count", 4).await;
    let xact = stats["total_xact_time"] - before_xact;
    let query = stats["total_query_time"] - before_query;
    assert!(xact >= 700_000, "transaction time {xact} µs: {stats:?}");
    assert!(query >= 300_000, "query time {query} µs: {stats:?}");
    assert!(
        query + 350_000 <= xact,
        "idle time counted as query time: {query} of {xact} µs"
    );
    let seconds = metrics_of(http).await;
    assert!(seconds("pgwarden_pool_transaction_seconds_total") >= 0.7);
    assert!(seconds("pgwarden_pool_query_seconds_total") >= 0.3);
}

/// pgwarden keeps a read-write and a read-only pool where both services
/// use the primary; the admin console still shows one `SHOW POOLS` row
/// per (database, user), one `SHOW STATS` row per database and one `SHOW
/// DATABASES` row per (database, server, user), as PgBouncer does, since
/// monitoring tools key their series by those columns and refuse
/// duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_rows_are_keyed_as_pgbouncer_keys_them() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 2).await;
    let rw = client(&via(&p, "read_write")).await.unwrap();
    let ro = client(&via(&p, "read_only")).await.unwrap();
    assert_eq!(one(&rw, "SELECT 1").await, "1");
    assert_eq!(one(&ro, "SHOW transaction_read_only").await, "on");
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = client(&admin_info).await.unwrap();
    let rows = |cmd: &'static str| admin_rows(&admin, cmd);
    pgwarden_testkit::eventually("both transactions counted", WAIT, || async {
        let stats = rows("SHOW STATS").await;
        match stats.as_slice() {
            [r] if r.get("database") == Some("postgres")
                && r.get("total_xact_count") == Some("2") =>
            {
                Ok(())
            }
            other => Err(format!("{} rows", other.len())),
        }
    })
    .await;
    let pools = rows("SHOW POOLS").await;
    assert_eq!(pools.len(), 1, "one row per (database, user)");
    assert_eq!(pools[0].get("user"), Some("postgres"));
    assert_eq!(pools[0].get("sv_total"), Some("2"), "both pools' servers");
    assert_eq!(pools[0].get("pool_mode"), Some("transaction"));
    let databases = rows("SHOW DATABASES").await;
    assert_eq!(databases.len(), 1, "one row per (database, server, user)");
    assert_eq!(databases[0].get("pool_size"), Some("4"), "two pools of 2");
    assert_eq!(databases[0].get("current_connections"), Some("2"));
}

/// The admin console's averages (PgBouncer's `avg_*` columns, `SHOW
/// STATS_AVERAGES`, the `avg_` rows of `SHOW TOTALS`) cover the last
/// complete stats period (1 s here): rates while traffic flows, zero once a
/// period passes without any, while the totals stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_console_averages_the_last_stats_period() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 2).await;
    let app = client(&via(&p, "read_write")).await.unwrap();
    let admin_info = via(&p, "read_write").replace("dbname=postgres", "dbname=pgwarden");
    let admin = client(&admin_info).await.unwrap();
    let admin = &admin;
    let figures = |cmd: &'static str| first_row_numbers(admin, cmd);

    // One transaction that holds its server for 600 ms: the period it
    // ends in averages 600 ms or more per transaction and per query.
    app.batch_execute("BEGIN; SELECT pg_sleep(0.6); COMMIT")
        .await
        .unwrap();
    pgwarden_testkit::eventually("a period with the slow transaction", WAIT, || async {
        let a = figures("SHOW STATS_AVERAGES").await?;
        (a["xact_time"] >= 600_000 && a["query_time"] >= 600_000)
            .then_some(())
            .ok_or(format!("{a:?}"))
    })
    .await;

    // Steady traffic: rates per second.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let stop = stop.clone();
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                app.simple_query("SELECT 1").await.unwrap();
            }
        })
    };
    pgwarden_testkit::eventually("averages while traffic flows", WAIT, || async {
        let s = figures("SHOW STATS").await?;
        (s["avg_xact_count"] >= 20
            && s["avg_query_count"] >= 20
            && s["avg_recv"] > 0
            && s["avg_sent"] > 0)
            .then_some(())
            .ok_or(format!("{s:?}"))
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.unwrap();

    // A quiet period: averages back to zero, totals kept, and SHOW TOTALS
    // (the sum over pools, one pool here) agrees with SHOW STATS_TOTALS.
    let totals = pgwarden_testkit::eventually("a quiet period", WAIT, || async {
        let s = figures("SHOW STATS").await?;
        let quiet = ["avg_xact_count", "avg_query_count", "avg_recv", "avg_sent"]
            .iter()
            .all(|k| s[*k] == 0);
        if quiet && s["total_xact_count"] > 20 {
            Ok(s)
        } else {
            Err(format!("{s:?}"))
        }
    })
    .await;
    let t = figures("SHOW STATS_TOTALS").await.unwrap();
    assert_eq!(t["xact_count"], totals["total_xact_count"]);
    assert_eq!(t["bytes_received"], totals["total_received"]);
    let by_name: std::collections::HashMap<String, u64> = admin_rows(admin, "SHOW TOTALS")
        .await
        .iter()
        .filter_map(|r| Some((r.get("name")?.to_string(), r.get("value")?.parse().ok()?)))
        .collect();
    assert_eq!(by_name["total_xact_count"], t["xact_count"], "{by_name:?}");
    assert_eq!(
        by_name["total_client_bytes"], t["bytes_received"],
        "{by_name:?}"
    );
    assert_eq!(by_name["avg_xact_count"], 0, "{by_name:?}");
    let names: Vec<(String, String)> = admin_rows(admin, "SHOW USERS")
        .await
        .iter()
        .filter_map(|r| Some((r.get("name")?.to_string(), r.get("pool_mode")?.to_string())))
        .collect();
    assert_eq!(names, [("postgres".to_string(), String::new())]);
}

/// The first pool row of SHOW STATS once its `column` reads `want`.
async fn stats_once(
    admin: &tokio_postgres::Client,
    column: &str,
    want: u64,
) -> std::collections::HashMap<String, u64> {
    pgwarden_testkit::eventually(&format!("{column} = {want}"), WAIT, || async move {
        let stats = first_row_numbers(admin, "SHOW STATS").await?;
        match stats.get(column) {
            Some(n) if *n == want => Ok(stats),
            _ => Err(format!("{stats:?}")),
        }
    })
    .await
}

/// The rows an admin console command returns.
async fn admin_rows(
    admin: &tokio_postgres::Client,
    cmd: &str,
) -> Vec<tokio_postgres::SimpleQueryRow> {
    admin
        .simple_query(cmd)
        .await
        .unwrap_or_else(|e| panic!("{cmd}: {e}"))
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
            _ => None,
        })
        .collect()
}

/// The numeric columns of the first row an admin console command returns,
/// by column name.
async fn first_row_numbers(
    admin: &tokio_postgres::Client,
    cmd: &str,
) -> Result<std::collections::HashMap<String, u64>, String> {
    let rows = admin.simple_query(cmd).await.map_err(|e| e.to_string())?;
    let row = rows
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
            _ => None,
        })
        .ok_or("no pool row")?;
    Ok(row
        .columns()
        .iter()
        .enumerate()
        .filter_map(|(i, c)| Some((c.name().to_string(), row.get(i)?.parse().ok()?)))
        .collect())
}

/// `/metrics` now, as a look-up of the first series of a name.
async fn metrics_of(http: std::net::SocketAddr) -> impl Fn(&str) -> f64 {
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
        .await
        .unwrap();
    move |name: &str| -> f64 {
        body.lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .unwrap_or_else(|| panic!("{name} missing:\n{body}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }
}

/// How many pools `/metrics` shows series for.
async fn pool_series(http: std::net::SocketAddr) -> usize {
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
        .await
        .unwrap();
    body.lines()
        .filter(|l| l.starts_with("pgwarden_pool_servers_open{"))
        .count()
}

/// A pool of two in front of `c` whose server connections close after a
/// second idle.
async fn pool_closing_idle_servers(
    c: &TestCluster,
) -> (pgwarden_probe::Engine, pgwarden_proxy::Proxy) {
    let settings = PoolSettings {
        size: 2,
        query_wait_timeout: WAIT,
        server_idle_timeout: Some(Duration::from_secs(1)),
        ..PoolSettings::default()
    };
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), Some(settings), 10_000).await;
    ready(&e, 1).await;
    (e, p)
}

/// Logins the server refuses (a user that does not exist) leave no pool
/// behind, and a pool that has had neither a server connection nor a
/// client for a server_idle_timeout goes, with its metric series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_logins_and_unused_pools_leave_nothing_behind() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pool_closing_idle_servers(&c).await;
    let http = p.http_addr().unwrap();
    let url = via(&p, "read_write");
    for i in 0..20 {
        let bogus = url.replace("user=postgres", &format!("user=nobody{i}"));
        let err = client(&bogus).await.unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("28000"), "{err:?}");
    }
    assert_eq!(pool_series(http).await, 0);
    let a = client(&url).await.unwrap();
    one(&a, "SELECT 1").await;
    assert_eq!(pool_series(http).await, 1);
    drop(a);
    // Its server closes after a second idle, the pool a second later.
    pgwarden_testkit::eventually("the unused pool removed", WAIT, || async move {
        let n = pool_series(http).await;
        (n == 0).then_some(()).ok_or(format!("{n} pools"))
    })
    .await;
    // Its transactions still count in SHOW STATS and SHOW TOTALS, whose
    // totals exporters read as counters.
    let admin = client(&url.replace("dbname=postgres", "dbname=pgwarden"))
        .await
        .unwrap();
    let stat = |msgs: Vec<tokio_postgres::SimpleQueryMessage>, key: &str, col: &str| {
        msgs.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some(key) => {
                    r.get(col).map(str::to_string)
                }
                _ => None,
            })
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let xacts = stat(
        admin.simple_query("SHOW STATS").await.unwrap(),
        "postgres",
        "total_xact_count",
    );
    assert!(xacts >= 1, "total_xact_count {xacts} after the pool went");
    let totals = stat(
        admin.simple_query("SHOW TOTALS").await.unwrap(),
        "total_xact_count",
        "value",
    );
    assert!(totals >= 1, "total_xact_count {totals} after the pool went");
    // Databases that do not exist, chosen by clients, leave no SHOW STATS
    // row for ever: the rows would grow with every name tried.
    for i in 0..20 {
        let bogus = url.replace("dbname=postgres", &format!("dbname=nosuchdb{i}"));
        let err = client(&bogus).await.unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("3D000"), "{err:?}");
    }
    let rows: Vec<String> = admin
        .simple_query("SHOW STATS")
        .await
        .unwrap()
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get("database").map(String::from),
            _ => None,
        })
        .collect();
    assert_eq!(rows, ["postgres"], "SHOW STATS rows");
    // The next client makes it again.
    let b = client(&url).await.unwrap();
    assert_eq!(one(&b, "SELECT 2").await, "2");
    assert_eq!(pool_series(http).await, 1);
}

/// `pgwarden_server_connections` counts the pools' server connections as
/// they open and close, not only relayed sessions'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_server_connections_count_as_open_server_connections() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pool_closing_idle_servers(&c).await;
    let http = p.http_addr().unwrap();
    let url = via(&p, "read_write");
    let (a, b) = (client(&url).await.unwrap(), client(&url).await.unwrap());
    for x in [&a, &b] {
        x.batch_execute("BEGIN").await.unwrap();
        one(x, "SELECT 1").await;
    }
    let open = || common::metric_sample(http, "pgwarden_server_connections{");
    assert_eq!(open().await, 2.0);
    for x in [&a, &b] {
        x.batch_execute("COMMIT").await.unwrap();
    }
    // Idle, they stay open; past server_idle_timeout they close.
    assert_eq!(open().await, 2.0);
    pgwarden_testkit::eventually("idle server connections closed", WAIT, || async {
        let n = open().await;
        (n == 0.0).then_some(()).ok_or(n.to_string())
    })
    .await;
}

/// A client pinned to its server (a session-level SET) and idle between
/// transactions is disconnected by client_idle_timeout like any other, and
/// its server, which carries its SET, is closed rather than handed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_idle_timeout_ends_pinned_clients_too() {
    let c = TestCluster::builder().replicas(0).start();
    let settings = PoolSettings {
        size: 1,
        query_wait_timeout: WAIT,
        client_idle_timeout: Some(Duration::from_secs(1)),
        ..PoolSettings::default()
    };
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), Some(settings), 10_000).await;
    ready(&e, 1).await;
    let url = via(&p, "read_write");
    let (a, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    a.batch_execute("SET work_mem = '8MB'").await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), conn)
        .await
        .expect("the idle pinned client is disconnected")
        .unwrap();
    let err = ended.expect_err("ends with an error");
    assert_eq!(sqlstate(&err).as_deref(), Some("57P05"), "{err:?}");
    // The pool's one server was not handed on with the SET.
    let b = client(&url).await.unwrap();
    assert_ne!(one(&b, "SHOW work_mem").await, "8MB");
}

/// RECONNECT in the admin console replaces the pool's server connections
/// without an error for anyone: an idle one at once, one lent to a client
/// mid-transaction only once that transaction is over, which WAIT_CLOSE
/// waits for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_replaces_server_connections_gracefully() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 2).await;
    let url = via(&p, "read_write");
    let admin = client(&url.replace("dbname=postgres", "dbname=pgwarden"))
        .await
        .unwrap();
    let (a, b) = (client(&url).await.unwrap(), client(&url).await.unwrap());
    async fn pid(c: &tokio_postgres::Client) -> String {
        one(c, "SELECT pg_backend_pid()").await
    }
    // b holds a server mid-transaction; a's server is idle.
    b.batch_execute("BEGIN").await.unwrap();
    let b_pid = pid(&b).await;
    let a_pid = pid(&a).await;
    assert_ne!(a_pid, b_pid);
    admin.batch_execute("RECONNECT").await.unwrap();
    // WAIT_CLOSE returns once b's old server is closed, when b lets it go.
    let waiter = client(&url.replace("dbname=postgres", "dbname=pgwarden"))
        .await
        .unwrap();
    let wait_close = tokio::spawn(async move { waiter.batch_execute("WAIT_CLOSE postgres").await });
    // b's transaction goes on where it was.
    assert_eq!(pid(&b).await, b_pid);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !wait_close.is_finished(),
        "WAIT_CLOSE returned while b's old server was lent"
    );
    b.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(WAIT, wait_close)
        .await
        .expect("WAIT_CLOSE returns once the old server is closed")
        .unwrap()
        .unwrap();
    admin.batch_execute("WAIT_CLOSE").await.unwrap();
    let err = admin
        .batch_execute("WAIT_CLOSE nosuchdb")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("3D000"), "{err}");
    let new_pids = [pid(&a).await, pid(&b).await];
    for old in [&a_pid, &b_pid] {
        assert!(!new_pids.contains(old), "{old} still serves: {new_pids:?}");
    }
    let err = admin.batch_execute("RECONNECT nosuchdb").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("3D000"), "{err}");
    admin.batch_execute("RECONNECT postgres").await.unwrap();
    let again = pid(&a).await;
    assert!(
        !new_pids.contains(&again),
        "{again} outlived RECONNECT postgres"
    );
}

/// A client that stops reading a large result leaves its session blocked
/// writing to it; KILL still ends the session and frees its server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_ends_a_session_whose_client_stopped_reading() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 2).await;
    let url = via(&p, "read_write");
    let admin = client(&url.replace("dbname=postgres", "dbname=pgwarden"))
        .await
        .unwrap();
    let mut stuck = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    // Far more than the sockets between the three of them hold.
    stuck
        .0
        .write_all(&msg_query(
            b"SELECT repeat('x', 1000000) FROM generate_series(1, 500)",
        ))
        .unwrap();
    let direct = c.conninfo(0);
    pgwarden_testkit::eventually("the server blocks on its write", WAIT, || {
        let direct = direct.clone();
        async move {
            match sql_value(
                &direct,
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event = 'ClientWrite' AND query LIKE 'SELECT repeat%'",
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
    admin.batch_execute("KILL postgres").await.unwrap();
    until_no_server_connections(&direct).await;
    drop(stuck);
    let fresh = client(&url).await.unwrap();
    assert_eq!(one(&fresh, "SELECT 2").await, "2");
}

/// KILL in the admin console ends every client of a database at once,
/// between transactions or in one (57P01), and closes its pools' server
/// connections; new clients are served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_ends_a_databases_clients_and_server_connections() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 2).await;
    let url = via(&p, "read_write");
    let admin = client(&url.replace("dbname=postgres", "dbname=pgwarden"))
        .await
        .unwrap();
    let idle = client(&url).await.unwrap();
    assert_eq!(one(&idle, "SELECT 1").await, "1");
    let mut busy = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    let r = busy.simple(b"BEGIN");
    assert_eq!(
        r.last().map(|(_, b)| b.as_slice()),
        Some(&b"T"[..]),
        "{r:?}"
    );
    let err = admin.batch_execute("KILL nosuchdb").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("3D000"), "{err}");
    admin.batch_execute("KILL postgres").await.unwrap();
    // The client in a transaction is told why.
    let r = busy.until_error();
    assert_eq!(error_code(&r).as_deref(), Some("57P01"), "{r:?}");
    pgwarden_testkit::eventually("the idle client closed", WAIT, || {
        let closed = idle.is_closed();
        async move {
            if closed {
                Ok(())
            } else {
                Err("open".into())
            }
        }
    })
    .await;
    let direct = c.conninfo(0);
    until_no_server_connections(&direct).await;
    let fresh = client(&url).await.unwrap();
    assert_eq!(one(&fresh, "SELECT 2").await, "2");
    // Both pooled clients count as sessions ended by the administrator.
    let http = p.http_addr().unwrap();
    pgwarden_testkit::eventually("the kills counted", WAIT, || async {
        let n = common::metric_sample(
            http,
            "pgwarden_sessions_terminated_total{service=\"read_write\",reason=\"Admin\"}",
        )
        .await;
        (n == 2.0).then_some(()).ok_or(n.to_string())
    })
    .await;
}

/// With `listen.unix_socket_dir`, every service also listens on
/// `.s.PGSQL.PORT` in that directory; clients there are matched by `local`
/// hba rules, never by
/// `host` ones, get `N` to an SSLRequest, and show as `unix` in SHOW
/// CLIENTS; the socket is removed when pgwarden stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_on_a_unix_socket() {
    let c = TestCluster::builder().replicas(0).start();
    let dir = tempfile::tempdir().unwrap();
    common::authenticate_with(
        dir.path().join("hba.conf"),
        "local all postgres trust\nhost all postgres 127.0.0.1/32 reject\n",
    );
    let sockets = dir.path().join("run");
    std::fs::create_dir(&sockets).unwrap();
    common::UNIX_SOCKET_DIR.with(|d| *d.borrow_mut() = Some(sockets.clone()));
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), pool(2, WAIT), 10_000).await;
    ready(&e, 1).await;
    let port = p.service_addrs()["read_write"].port();
    let path = sockets.join(format!(".s.PGSQL.{port}"));
    assert!(path.exists(), "{} missing", path.display());
    let local = |db: &str| {
        format!(
            "host={} port={port} user=postgres dbname={db}",
            sockets.display()
        )
    };
    let app = client(&local("postgres")).await.unwrap();
    assert_eq!(one(&app, "SELECT 1").await, "1");
    // The same user over TCP meets the `host ... reject` rule.
    let Err(err) = client(&via(&p, "read_write")).await else {
        panic!("a host rule let a TCP client in");
    };
    assert_eq!(sqlstate(&err).as_deref(), Some("28000"), "{err}");
    // TLS is not offered on the socket.
    {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
        s.write_all(&[0, 0, 0, 8, 4, 210, 22, 47]).unwrap();
        let mut answer = [0u8; 1];
        s.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"N");
    }
    let admin = client(&local("pgwarden")).await.unwrap();
    let rows = admin.simple_query("SHOW CLIENTS").await.unwrap();
    let addrs: Vec<String> = rows
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get("addr").map(str::to_string),
            _ => None,
        })
        .collect();
    assert!(addrs.iter().any(|a| a == "unix"), "{addrs:?}");
    drop(p);
    assert!(!path.exists(), "{} left behind", path.display());
    drop(e);
    // Relayed (session mode) clients too.
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), None, 10_000).await;
    ready(&e, 1).await;
    let port = p.service_addrs()["read_write"].port();
    let relayed = client(&format!(
        "host={} port={port} user=postgres dbname=postgres",
        sockets.display()
    ))
    .await
    .unwrap();
    assert_eq!(one(&relayed, "SELECT 3").await, "3");
    let rows = relayed
        .query("SELECT g FROM generate_series(1, 50000) g", &[])
        .await
        .unwrap();
    assert_eq!(rows.len(), 50_000);
    // A reload follows the key: off removes the socket (the session on it
    // goes on), on brings it back.
    let mut p = p;
    let path = sockets.join(format!(".s.PGSQL.{port}"));
    let mut spec = p.spec().clone();
    spec.unix_socket_dir = None;
    p.apply(spec.clone()).await.unwrap();
    assert!(
        !path.exists(),
        "{} left after the key was removed",
        path.display()
    );
    assert_eq!(one(&relayed, "SELECT 4").await, "4");
    spec.unix_socket_dir = Some(sockets.clone());
    p.apply(spec).await.unwrap();
    let again = client(&format!(
        "host={} port={port} user=postgres dbname=postgres",
        sockets.display()
    ))
    .await
    .unwrap();
    assert_eq!(one(&again, "SELECT 5").await, "5");
    // A directory that cannot be bound (a typo) leaves the sockets where
    // they are, serving: the new path is bound before the old one goes.
    let mut typo = p.spec().clone();
    typo.unix_socket_dir = Some(sockets.join("no-such-dir"));
    assert!(matches!(
        p.apply(typo).await,
        Err(pgwarden_proxy::ProxyError::BindUnix { .. })
    ));
    assert!(path.exists(), "{} removed by a failed move", path.display());
    let still = client(&format!(
        "host={} port={port} user=postgres dbname=postgres",
        sockets.display()
    ))
    .await
    .unwrap();
    assert_eq!(one(&still, "SELECT 6").await, "6");
    drop(still);
    let mut back = p.spec().clone();
    back.unix_socket_dir = Some(sockets.clone());
    p.apply(back).await.unwrap();
    // A service that changes address but keeps its port keeps its socket,
    // which follows the service's later changes like the TCP listener.
    let mut spec = p.spec().clone();
    let rw = spec
        .services
        .iter_mut()
        .find(|s| s.name == "read_write")
        .unwrap();
    rw.listen = format!("127.0.0.2:{port}").parse().unwrap();
    p.apply(spec.clone()).await.unwrap();
    for s in spec.services.iter_mut().filter(|s| s.name == "read_write") {
        s.read_only = true;
    }
    p.apply(spec).await.unwrap();
    let now = client(&format!(
        "host={} port={port} user=postgres dbname=postgres",
        sockets.display()
    ))
    .await
    .unwrap();
    assert_eq!(one(&now, "SHOW transaction_read_only").await, "on");
    drop(now);
    // Two services swapping ports swap their sockets too, though each new
    // path is the other's old one.
    let mut spec = p.spec().clone();
    let ro_port = p.service_addrs()["read_only"].port();
    for s in spec.services.iter_mut() {
        match s.name.as_str() {
            "read_write" => {
                s.read_only = false;
                s.listen = format!("127.0.0.1:{ro_port}").parse().unwrap();
            }
            "read_only" => s.listen = format!("127.0.0.1:{port}").parse().unwrap(),
            _ => {}
        }
    }
    p.apply(spec).await.unwrap();
    for (at, read_only) in [(port, "on"), (ro_port, "off")] {
        let c = client(&format!(
            "host={} port={at} user=postgres dbname=postgres",
            sockets.display()
        ))
        .await
        .unwrap_or_else(|e| {
            let there: Vec<_> = std::fs::read_dir(&sockets)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            panic!("the socket of port {at}: {e}; the directory holds {there:?}")
        });
        assert_eq!(
            one(&c, "SHOW transaction_read_only").await,
            read_only,
            "the socket of port {at}"
        );
    }
}

/// `spec` with every pooled service's size set to `size`.
fn sized(mut spec: pgwarden_proxy::ProxySpec, size: usize) -> pgwarden_proxy::ProxySpec {
    for svc in &mut spec.services {
        if let Some(p) = &svc.pool {
            svc.pool = Some(std::sync::Arc::new(PoolSettings {
                size,
                ..(**p).clone()
            }));
        }
    }
    spec
}

/// A reload resizes the pools that exist: a larger size serves a client
/// that would otherwise wait, a smaller one lets every transaction in
/// flight finish and closes the connections above it as they come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_resizes_existing_pools() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, mut p) = pooled_for(&c, 1, Duration::from_secs(2)).await;
    let url = via(&p, "read_write");
    let a = client(&url).await.unwrap();
    a.batch_execute("BEGIN").await.unwrap();
    one(&a, "SELECT 1").await;
    // The pool exists with its one server lent: a second client would wait
    // out query_wait_timeout, but the reload makes room for it.
    p.apply(sized(p.spec().clone(), 3)).await.unwrap();
    let b = client(&url).await.unwrap();
    let d = client(&url).await.unwrap();
    for x in [&b, &d] {
        x.batch_execute("BEGIN").await.unwrap();
        one(x, "SELECT 1").await;
    }
    assert_eq!(server_connections(&c.conninfo(0)).await, 3);
    // Smaller again while all three are lent: nobody's transaction ends.
    p.apply(sized(p.spec().clone(), 1)).await.unwrap();
    for x in [&a, &b, &d] {
        one(x, "SELECT 2").await;
        x.batch_execute("COMMIT").await.unwrap();
    }
    let conninfo = c.conninfo(0);
    pgwarden_testkit::eventually("the pool down to one server", WAIT, || {
        let conninfo = conninfo.clone();
        async move {
            let n = server_connections(&conninfo).await;
            (n == 1).then_some(()).ok_or(n.to_string())
        }
    })
    .await;
    // And one it is: a client in a transaction holds it, the next waits.
    a.batch_execute("BEGIN").await.unwrap();
    let err = b.batch_execute("SELECT 1").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("57P03"), "{err:?}");
    a.batch_execute("COMMIT").await.unwrap();
    assert_eq!(one(&d, "SELECT 3").await, "3");
}

/// Pools are shared by the services of a kind: a reload's settings reach
/// a pool also when the service whose client made it is gone, through
/// another service of its kind that pools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_reaches_a_pool_whose_first_service_is_gone() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, mut p) = pooled_for(&c, 1, Duration::from_secs(2)).await;
    let mut spec = p.spec().clone();
    let mut other = spec
        .services
        .iter()
        .find(|s| s.name == "read_write")
        .unwrap()
        .clone();
    other.name = "other".into();
    other.listen = format!("127.0.0.1:{}", pgwarden_testkit::free_port())
        .parse()
        .unwrap();
    spec.services.push(other);
    p.apply(spec.clone()).await.unwrap();
    // A client of "other" makes the primary's read-write pool.
    let first = client(&via(&p, "other")).await.unwrap();
    assert_eq!(one(&first, "SELECT 1").await, "1");
    drop(first);
    spec.services.retain(|s| s.name != "other");
    p.apply(sized(spec, 3)).await.unwrap();
    // The pool has room for three transactions at once now.
    let url = via(&p, "read_write");
    let mut held = Vec::new();
    for i in 0..3 {
        let x = client(&url).await.unwrap();
        x.batch_execute("BEGIN; SELECT 1")
            .await
            .unwrap_or_else(|e| panic!("transaction {i}: {e}"));
        held.push(x);
    }
    assert_eq!(server_connections(&c.conninfo(0)).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_clients_on_a_pool_of_twenty() {
    // Both pgbench and the proxy (in this process) hold 5,000 sockets.
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    // Root may raise the hard limit; others live with theirs.
    if setrlimit(Resource::RLIMIT_NOFILE, 65_536, 65_536).is_err() {
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).expect("raise the open-file limit");
    }
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    assert!(
        soft >= 12_000,
        "the open-file limit ({soft}) is too low for 5,000 clients"
    );
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy_with(
        &c.addrs(),
        Duration::from_secs(3),
        pool(20, Duration::from_secs(120)),
        20_000,
    )
    .await;
    ready(&e, 1).await;
    let (ok, out) = pgbench(c.port(0), &["-i", "-s", "1", "-q"]);
    assert!(ok, "{out}");
    let port = p.service_addrs()["read_write"].port();
    let (ok, out) = tokio::task::spawn_blocking(move || {
        pgbench(port, &["-c", "5000", "-j", "2", "-t", "2", "-S"])
    })
    .await
    .unwrap();
    assert!(ok, "{out}");
    assert!(
        out.contains("number of transactions actually processed: 10000/10000"),
        "{out}"
    );
    assert!(out.contains("number of failed transactions: 0"), "{out}");
    assert!(server_connections(&c.conninfo(0)).await <= 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_override_warm_connections_idle_clients_and_wait_histogram() {
    let c = TestCluster::builder().replicas(0).start();
    // The services are in session mode; the database "postgres" is
    // switched to transaction pooling (pool of 3) by an override.
    let overrides = pgwarden_proxy::PoolOverrides {
        databases: [("postgres".to_string(), (Some(true), Some(3)))]
            .into_iter()
            .collect(),
        users: Default::default(),
        reuse_session_servers: false,
        defaults: PoolSettings {
            min_size: 2,
            client_idle_timeout: Some(Duration::from_millis(800)),
            ..PoolSettings::default()
        },
        ..Default::default()
    };
    let (e, p) = common::proxy_full(
        &c.addrs(),
        Duration::from_secs(3),
        None,
        10_000,
        overrides,
        None,
    )
    .await;
    ready(&e, 1).await;
    let a = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(one(&a, "SELECT 1").await, "1");
    // One client ran one query; the pool still opens min_size connections.
    let target = c.conninfo(0);
    pgwarden_testkit::eventually("two warm server connections", WAIT, || {
        let t = target.clone();
        async move {
            // The client's own checkout may have opened one more while
            // the warm-up was logging in, never more than the pool size.
            match server_connections(&t).await {
                2 | 3 => Ok(()),
                n => Err(format!("{n} server connections")),
            }
        }
    })
    .await;
    // Pooled, not session mode: the pool exists and counts transactions.
    let http = p.http_addr().unwrap();
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
        .await
        .unwrap();
    assert!(body.contains("pgwarden_pool_transactions_total{"), "{body}");
    assert!(
        body.contains("pgwarden_pool_wait_seconds_bucket{"),
        "{body}"
    );
    // The same wait per pool: every transaction counted once, the last
    // bucket holding them all.
    let sample = |prefix: &str| -> f64 {
        body.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in {body}"))
    };
    let checkouts = sample("pgwarden_pool_checkout_wait_seconds_count{");
    assert!(checkouts >= 1.0, "{body}");
    assert!(
        body.contains("pgwarden_pool_checkout_wait_seconds_bucket{")
            && body.contains("le=\"+Inf\""),
        "{body}"
    );
    assert!(
        body.contains("# TYPE pgwarden_pool_checkout_wait_seconds histogram"),
        "{body}"
    );
    // A client idle between transactions past client_idle_timeout is closed.
    pgwarden_testkit::eventually("idle client closed", WAIT, || {
        let closed = a.is_closed();
        async move {
            if closed {
                Ok(())
            } else {
                Err("open".into())
            }
        }
    })
    .await;
}

/// The reserve: with the pool's one server held, a client that has
/// waited `reserve_timeout` is served by a connection beyond `size`, up to
/// `reserve_size`; one more waits for a connection to come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_serves_clients_that_waited() {
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy_with(
        &c.addrs(),
        Duration::from_secs(3),
        Some(PoolSettings {
            size: 1,
            reserve_size: 1,
            reserve_timeout: Duration::from_millis(300),
            query_wait_timeout: WAIT,
            ..PoolSettings::default()
        }),
        10_000,
    )
    .await;
    ready(&e, 1).await;
    let url = via(&p, "read_write");
    let holder = client(&url).await.unwrap();
    holder.batch_execute("BEGIN").await.unwrap();
    let holder_pid = one(&holder, "SELECT pg_backend_pid()").await;
    // Served by the reserve while the holder keeps the pool's server.
    let second = client(&url).await.unwrap();
    second.batch_execute("BEGIN").await.unwrap();
    let second_pid = one(&second, "SELECT pg_backend_pid()").await;
    assert_ne!(second_pid, holder_pid);
    // The reserve is used up: a third waits until one comes back.
    // (Its login needs a server too.)
    let url3 = url.clone();
    let waiting = tokio::spawn(async move {
        let third = client(&url3).await.unwrap();
        one(&third, "SELECT 3").await
    });
    pgwarden_testkit::eventually(
        "the third client waits past the reserve time-out",
        WAIT,
        || {
            let direct = c.conninfo(0);
            async move {
                // Two servers at most: size 1 plus a reserve of 1.
                match server_connections(&direct).await {
                    2 => Ok(()),
                    n => Err(format!("{n} server connections")),
                }
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!waiting.is_finished(), "served beyond size + reserve_size");
    second.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        tokio::time::timeout(WAIT, waiting).await.unwrap().unwrap(),
        "3"
    );
    assert!(server_connections(&c.conninfo(0)).await <= 2);
    holder.batch_execute("COMMIT").await.unwrap();
}

/// Server connections of the test's roles (u1, u2, ...) whose `column`
/// (`datname`, `usename`) is `name`, as PostgreSQL counts them.
async fn backends_of(conninfo: &str, column: &str, name: &str) -> usize {
    sql_value(
        conninfo,
        &format!(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' \
             AND usename ~ '^u[0-9]$' AND {column} = '{name}'"
        ),
    )
    .await
    .unwrap()
    .parse()
    .unwrap()
}

/// `max_db_connections` caps the pools of one database together, across
/// users: a pool that needs a connection at the cap waits for one to be
/// given back (a pool that gets one back while others wait closes it), or
/// closes another pool's idle connection at once; a wait that outlasts
/// `query_wait_timeout` gets 53300 naming the limit. `max_user_connections`
/// does the same for one user across databases, and a reload changes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_and_user_connection_limits_span_pools() {
    let c = TestCluster::builder().replicas(0).start();
    let direct = c.conninfo(0);
    let admin = client(&direct).await.unwrap();
    admin
        .batch_execute(
            "CREATE ROLE u1 LOGIN; CREATE ROLE u2 LOGIN; CREATE ROLE u3 LOGIN; \
             GRANT ALL ON SCHEMA public TO PUBLIC",
        )
        .await
        .unwrap();
    admin.batch_execute("CREATE DATABASE other").await.unwrap();
    let settings = PoolSettings {
        size: 5,
        query_wait_timeout: Duration::from_secs(3),
        ..PoolSettings::default()
    };
    let overrides = |db: usize, user: usize| pgwarden_proxy::PoolOverrides {
        db_limits: pgwarden_proxy::ConnLimits {
            default: 0,
            by_name: [("postgres".to_string(), db)].into_iter().collect(),
        },
        user_limits: pgwarden_proxy::ConnLimits {
            default: user,
            by_name: Default::default(),
        },
        ..Default::default()
    };
    let (e, mut p) = common::proxy_full(
        &c.addrs(),
        Duration::from_secs(3),
        Some(settings.clone()),
        10_000,
        overrides(2, 0),
        None,
    )
    .await;
    ready(&e, 1).await;
    let port = p.service_addrs()["read_write"].port();
    let url = |user: &str, db: &str| format!("host=127.0.0.1 port={port} user={user} dbname={db}");
    let on_postgres = |d: String| async move { backends_of(&d, "datname", "postgres").await };

    // Two users take the database's two connections.
    let a = client(&url("u1", "postgres")).await.unwrap();
    a.batch_execute("BEGIN").await.unwrap();
    let b = client(&url("u2", "postgres")).await.unwrap();
    b.batch_execute("BEGIN").await.unwrap();
    assert_eq!(on_postgres(direct.clone()).await, 2);
    // A third user's pool has connections free but the database has none:
    // it waits, and gets the connection u1 gives back.
    let u3 = url("u3", "postgres");
    let waiting = tokio::spawn(async move {
        let cl = client(&u3).await?;
        cl.batch_execute("SELECT 1").await?;
        Ok::<_, tokio_postgres::Error>(cl)
    });
    // It shows as waiting in its pool.
    let http = p.http_addr().unwrap();
    pgwarden_testkit::eventually("u3's client counted as waiting", WAIT, || async move {
        let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
            .await
            .unwrap();
        let line = body
            .lines()
            .find(|l| l.starts_with("pgwarden_pool_clients_waiting{") && l.contains("user=\"u3\""))
            .map(str::to_string);
        match line {
            Some(l) if l.ends_with(" 1") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "served beyond max_db_connections");
    assert_eq!(on_postgres(direct.clone()).await, 2);
    // Its wait counts in the pool's maxwait, as a wait in line does.
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
        .await
        .unwrap();
    let maxwait: f64 = body
        .lines()
        .find(|l| l.starts_with("pgwarden_pool_wait_max_seconds{") && l.contains("user=\"u3\""))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .expect("u3's maxwait");
    assert!(maxwait >= 0.5, "maxwait {maxwait} s after 0.5 s of waiting");
    a.batch_execute("COMMIT").await.unwrap();
    let c3 = tokio::time::timeout(WAIT, waiting)
        .await
        .unwrap()
        .unwrap()
        .expect("the waiting client is served once u1 gives its connection back");
    // u3's connection is now idle in its pool; u1 needs one again and the
    // idle one of u3 is closed to make room, long before any time-out.
    assert_eq!(one(&a, "SELECT current_user::text").await, "u1");
    // The closed connection's backend leaves pg_stat_activity a moment
    // after pgwarden's Terminate: PostgreSQL ends it asynchronously.
    pgwarden_testkit::eventually("two backends on postgres", WAIT, || {
        let d = direct.clone();
        async move {
            let n = on_postgres(d).await;
            (n == 2).then_some(()).ok_or(n.to_string())
        }
    })
    .await;
    // With both held, a client that waits out query_wait_timeout is told
    // which limit it hit.
    a.batch_execute("BEGIN").await.unwrap();
    let err = c3.batch_execute("SELECT 1").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("53300"), "{err:?}");
    let msg = err.as_db_error().unwrap().message().to_string();
    assert!(
        msg.contains("max_db_connections (2) of database \"postgres\""),
        "{msg}"
    );
    a.batch_execute("COMMIT").await.unwrap();
    b.batch_execute("COMMIT").await.unwrap();

    // A reload caps each user at one connection across databases.
    let mut spec = p.spec().clone();
    spec.pool_overrides = overrides(2, 1);
    spec.admin_users = vec!["postgres".into()];
    p.apply(spec).await.unwrap();
    // SHOW DATABASES gives the cap and the connections counted against it.
    let console = client(&url("postgres", "pgwarden")).await.unwrap();
    let mut rows = 0;
    for m in console.simple_query("SHOW DATABASES").await.unwrap() {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            if r.get("name") == Some("postgres") {
                rows += 1;
                assert_eq!(r.get("max_connections"), Some("2"));
                let open: usize = r.get("current_connections").unwrap().parse().unwrap();
                assert_eq!(open, on_postgres(direct.clone()).await);
            }
        }
    }
    assert_eq!(rows, 3, "a row per pool of database postgres");
    let in_other = client(&url("u2", "other")).await.unwrap();
    in_other.batch_execute("BEGIN").await.unwrap();
    assert_eq!(backends_of(&direct, "usename", "u2").await, 1);
    // u2's connection to "postgres" went idle at COMMIT above; it was
    // closed to make room, and now u2 has none left for "postgres".
    let err = b.batch_execute("SELECT 1").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("53300"), "{err:?}");
    let msg = err.as_db_error().unwrap().message().to_string();
    assert!(
        msg.contains("max_user_connections (1) of user \"u2\""),
        "{msg}"
    );
    in_other.batch_execute("COMMIT").await.unwrap();
    assert_eq!(backends_of(&direct, "usename", "u2").await, 1);
}

/// Pool overrides that cap every database at `n` server connections per
/// server (`max_db_connections`).
fn db_cap(n: usize) -> pgwarden_proxy::PoolOverrides {
    pgwarden_proxy::PoolOverrides {
        db_limits: pgwarden_proxy::ConnLimits {
            default: n,
            by_name: Default::default(),
        },
        ..Default::default()
    }
}

/// Warm-up (`min_size`) takes only free room under a cap: two pools that
/// each want more warm connections than the cap allows do not close each
/// other's idle connections round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_warming_under_one_cap_do_not_take_turns() {
    let c = TestCluster::builder().replicas(0).start();
    let direct = c.conninfo(0);
    sql_value(
        &direct,
        "CREATE ROLE u1 LOGIN; CREATE ROLE u2 LOGIN; SELECT 1",
    )
    .await
    .unwrap();
    let overrides = db_cap(3);
    let (e, p) = common::proxy_full(
        &c.addrs(),
        Duration::from_secs(3),
        Some(PoolSettings {
            size: 3,
            min_size: 2,
            query_wait_timeout: Duration::from_secs(5),
            ..PoolSettings::default()
        }),
        10_000,
        overrides,
        None,
    )
    .await;
    ready(&e, 1).await;
    let port = p.service_addrs()["read_write"].port();
    for user in ["u1", "u2"] {
        let cl = client(&format!(
            "host=127.0.0.1 port={port} user={user} dbname=postgres"
        ))
        .await
        .unwrap();
        assert_eq!(one(&cl, "SELECT 1").await, "1");
    }
    let pids = || {
        let direct = direct.clone();
        async move {
            sql_value(
                &direct,
                "SELECT coalesce(string_agg(pid::text, ',' ORDER BY pid), '') \
                 FROM pg_stat_activity WHERE usename IN ('u1', 'u2')",
            )
            .await
            .unwrap()
        }
    };
    // Both pools have warmed what they could: three connections.
    pgwarden_testkit::eventually("the cap filled", WAIT, || async {
        match pids().await.split(',').filter(|p| !p.is_empty()).count() {
            3 => Ok(()),
            n => Err(format!("{n} connections")),
        }
    })
    .await;
    let before = pids().await;
    // Several topology rounds, each of which warms both pools again.
    let round = e.snapshot().round;
    until(&e, "five more rounds", WAIT, |s| {
        (s.round >= round + 5)
            .then_some(())
            .ok_or(format!("round {}", s.round))
    })
    .await;
    assert_eq!(pids().await, before, "warm connections were replaced");
}

/// A client waiting for room under a cap when the primary changes is
/// served by the new primary at once, not left waiting on the old one
/// until its time-out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_waiting_under_a_cap_follows_a_primary_change() {
    let mut c = TestCluster::builder().replicas(1).start();
    let overrides = db_cap(1);
    let (e, p) = common::proxy_full(
        &c.addrs(),
        Duration::from_secs(5),
        pool(4, WAIT),
        10_000,
        overrides,
        None,
    )
    .await;
    ready(&e, 2).await;
    let url = via(&p, "read_write");
    let holder = client(&url).await.unwrap();
    holder.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        one(&holder, "SELECT inet_server_port()").await,
        c.port(0).to_string()
    );
    let waiter = tokio::spawn({
        let url = url.clone();
        async move {
            let cl = client(&url).await?;
            let row = cl.query_one("SELECT inet_server_port()::text", &[]).await?;
            Ok::<_, tokio_postgres::Error>(row.get::<_, String>(0))
        }
    });
    let http = p.http_addr().unwrap();
    let series = |http| async move {
        let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
            .await
            .unwrap();
        body.lines()
            .filter(|l| l.starts_with("pgwarden_pool_clients_waiting{"))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum::<f64>()
    };
    pgwarden_testkit::eventually(
        "the second client waits under the cap",
        WAIT,
        || async move {
            let n = series(http).await;
            if n == 1.0 {
                Ok(())
            } else {
                Err(format!("{n} waiting"))
            }
        },
    )
    .await;
    c.node(1).promote().unwrap();
    until(&e, "node2 primary", WAIT, |s| {
        (s.topology.primary() == Some(1))
            .then_some(())
            .ok_or("not yet".into())
    })
    .await;
    // Well inside query_wait_timeout (WAIT).
    let port = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiting client is served by the new primary")
        .unwrap()
        .unwrap();
    assert_eq!(port, c.port(1).to_string());
}

/// `idle_transaction_timeout`: a client that holds its server idle inside
/// a transaction past it is disconnected (25P03) and the server closed
/// (which rolls the transaction back), so the pool serves others again; a
/// transaction whose statement runs longer, and a client idle between
/// transactions, are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_idle_in_a_transaction_are_disconnected_and_free_their_server() {
    use std::io::Read;
    let c = TestCluster::builder().replicas(0).start();
    let (e, p) = proxy_with(
        &c.addrs(),
        Duration::from_secs(3),
        Some(PoolSettings {
            size: 1,
            query_wait_timeout: WAIT,
            idle_transaction_timeout: Some(Duration::from_millis(500)),
            ..PoolSettings::default()
        }),
        10_000,
    )
    .await;
    ready(&e, 1).await;
    let url = via(&p, "read_write");
    let between = client(&url).await.unwrap();
    assert_eq!(one(&between, "SELECT 1").await, "1");
    // A statement longer than the time-out, inside a transaction.
    let busy = client(&url).await.unwrap();
    busy.batch_execute("BEGIN").await.unwrap();
    busy.batch_execute("SELECT pg_sleep(0.8)").await.unwrap();
    busy.batch_execute("COMMIT").await.unwrap();
    // Idle in a transaction, holding the only server, with a row written.
    let direct = client(&c.conninfo(0)).await.unwrap();
    direct
        .batch_execute("CREATE TABLE itt (v int)")
        .await
        .unwrap();
    let mut idle = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    let r = idle.simple(b"BEGIN; INSERT INTO itt VALUES (1)");
    assert_eq!(
        r.last().map(|(_, b)| b.as_slice()),
        Some(&b"T"[..]),
        "{r:?}"
    );
    let mut head = [0u8; 5];
    idle.0.read_exact(&mut head).unwrap();
    assert_eq!(head[0], b'E');
    let mut body = vec![0u8; u32::from_be_bytes(head[1..5].try_into().unwrap()) as usize - 4];
    idle.0.read_exact(&mut body).unwrap();
    assert_eq!(
        error_code(&[(b'E', body.clone())]).as_deref(),
        Some("25P03"),
        "{body:?}"
    );
    assert_eq!(
        idle.0.read(&mut head).unwrap(),
        0,
        "the connection is closed"
    );
    // Rolled back; the pool serves the next transaction.
    assert_eq!(one(&between, "SELECT count(*) FROM itt").await, "0");
    assert_eq!(
        sql_value(&c.conninfo(0), "SELECT count(*) FROM itt")
            .await
            .unwrap(),
        "0"
    );
}

/// Session-pooled clients hold a server for their whole session, so pool
/// affinity does not gather them on one worker: they stay where they were
/// placed (here in turn), and none moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_pooled_clients_stay_where_they_were_placed() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = session_pooling_proxy(
        &c,
        PoolSettings {
            size: 4,
            ..PoolSettings::default()
        },
    )
    .await;
    let url = via(&p, "read_write");
    let mut clients = Vec::new();
    for _ in 0..4 {
        let db = client(&url).await.unwrap();
        assert_eq!(one(&db, "SELECT 1").await, "1");
        clients.push(db);
    }
    let http = p.http_addr().unwrap();
    assert_eq!(common::worker_clients(http).await, (2.0, 2.0));
    let moves = common::metric_sample(http, "pgwarden_client_moves_total ").await;
    assert_eq!(moves, 0.0);
}

/// A proxy in front of `c` whose session-mode services reuse server
/// connections (`reuse_session_servers`) with pools of `settings`, once
/// its one host is ready.
async fn session_pooling_proxy(
    c: &TestCluster,
    settings: PoolSettings,
) -> (pgwarden_probe::Engine, pgwarden_proxy::Proxy) {
    let overrides = pgwarden_proxy::PoolOverrides {
        reuse_session_servers: true,
        defaults: settings,
        ..Default::default()
    };
    let (e, p) = common::proxy_full(
        &c.addrs(),
        Duration::from_secs(5),
        None,
        100,
        overrides,
        None,
    )
    .await;
    ready(&e, 1).await;
    (e, p)
}

/// A client speaking the protocol byte by byte, for encodings that
/// tokio-postgres does not speak (it insists on UTF8); with the cancel key
/// it was given.
struct RawClient(std::net::TcpStream, (i32, i32));

impl RawClient {
    fn connect(addr: std::net::SocketAddr, client_encoding: &str) -> RawClient {
        RawClient::connect_to(addr, "postgres", client_encoding)
    }

    fn connect_to(addr: std::net::SocketAddr, database: &str, client_encoding: &str) -> RawClient {
        RawClient::connect_with(
            addr,
            &[
                ("user", "postgres"),
                ("database", database),
                ("client_encoding", client_encoding),
            ],
        )
    }

    /// With these start-up parameters.
    fn connect_with(addr: std::net::SocketAddr, params: &[(&str, &str)]) -> RawClient {
        let (c, greeting) = RawClient::greeted(addr, params);
        assert!(greeting.iter().all(|(t, _)| *t != b'E'), "{greeting:?}");
        c
    }

    /// With these start-up parameters, and the messages that answer the
    /// login up to ReadyForQuery or an error.
    fn greeted(
        addr: std::net::SocketAddr,
        params: &[(&str, &str)],
    ) -> (RawClient, Vec<(u8, Vec<u8>)>) {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(&startup_packet(params)).unwrap();
        let mut c = RawClient(s, (0, 0));
        let mut greeting = Vec::new();
        while !matches!(greeting.last(), Some((b'Z' | b'E', _))) {
            greeting.extend(c.until_any());
        }
        if let Some((_, key)) = greeting.iter().find(|(t, _)| *t == b'K') {
            c.1 = (
                i32::from_be_bytes(key[0..4].try_into().unwrap()),
                i32::from_be_bytes(key[4..8].try_into().unwrap()),
            );
        }
        (c, greeting)
    }

    /// The next message.
    fn until_any(&mut self) -> Vec<(u8, Vec<u8>)> {
        self.until(0)
    }

    /// Messages up to and including the next ReadyForQuery.
    fn until_ready(&mut self) -> Vec<(u8, Vec<u8>)> {
        self.until(b'Z')
    }

    /// Messages up to and including the next one of type `tag` (0: the
    /// next message, whatever its type).
    fn until(&mut self, tag: u8) -> Vec<(u8, Vec<u8>)> {
        use std::io::Read;
        let mut out = Vec::new();
        loop {
            let mut head = [0u8; 5];
            self.0.read_exact(&mut head).unwrap();
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            let mut body = vec![0u8; len - 4];
            self.0.read_exact(&mut body).unwrap();
            out.push((head[0], body));
            if head[0] == tag || tag == 0 {
                return out;
            }
        }
    }

    /// Every message until the connection is closed.
    fn until_closed(&mut self) -> Vec<(u8, Vec<u8>)> {
        use std::io::Read;
        let mut out = Vec::new();
        loop {
            let mut head = [0u8; 5];
            if self.0.read_exact(&mut head).is_err() {
                return out;
            }
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            let mut body = vec![0u8; len - 4];
            if self.0.read_exact(&mut body).is_err() {
                return out;
            }
            out.push((head[0], body));
        }
    }

    /// Messages up to and including the next ErrorResponse.
    fn until_error(&mut self) -> Vec<(u8, Vec<u8>)> {
        self.until(b'E')
    }

    fn send(&mut self, bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
        use std::io::Write;
        self.0.write_all(bytes).unwrap();
        self.until_ready()
    }

    fn simple(&mut self, sql: &[u8]) -> Vec<(u8, Vec<u8>)> {
        self.send(&msg_query(sql))
    }

    /// Parse under `name`, Bind, Execute, Sync.
    fn extended(&mut self, name: &[u8], sql: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let mut m = msg_parse(name, sql);
        m.extend(msg_bind_execute(name));
        m.extend_from_slice(MSG_SYNC);
        self.send(&m)
    }
}

/// Query (simple protocol) of `sql`.
fn msg_query(sql: &[u8]) -> Vec<u8> {
    let mut m = vec![b'Q'];
    m.extend_from_slice(&((sql.len() + 5) as u32).to_be_bytes());
    m.extend_from_slice(sql);
    m.push(0);
    m
}

/// Parse of `sql` as statement `name`, parameter types left to the server.
fn msg_parse(name: &[u8], sql: &[u8]) -> Vec<u8> {
    let mut m = vec![b'P'];
    m.extend_from_slice(&((4 + name.len() + 1 + sql.len() + 1 + 2) as u32).to_be_bytes());
    for part in [name, sql] {
        m.extend_from_slice(part);
        m.push(0);
    }
    m.extend_from_slice(&[0, 0]);
    m
}

/// Bind of statement `name` (no parameters) to the unnamed portal, and
/// Execute of it, all rows.
fn msg_bind_execute(name: &[u8]) -> Vec<u8> {
    let mut m = vec![b'B'];
    m.extend_from_slice(&((4 + 1 + name.len() + 1 + 6) as u32).to_be_bytes());
    m.push(0);
    m.extend_from_slice(name);
    m.push(0);
    m.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    m.extend_from_slice(&[b'E', 0, 0, 0, 9, 0, 0, 0, 0, 0]);
    m
}

const MSG_SYNC: &[u8] = &[b'S', 0, 0, 0, 4];

/// The first column of the first row among `replies` (text format),
/// which must hold no error.
fn value(replies: &[(u8, Vec<u8>)]) -> String {
    assert_eq!(error_code(replies), None, "{replies:?}");
    let (_, row) = replies.iter().find(|(t, _)| *t == b'D').expect("a row");
    String::from_utf8_lossy(&row[6..]).into_owned()
}

/// The SQLSTATE of the first ErrorResponse among `replies`.
fn error_code(replies: &[(u8, Vec<u8>)]) -> Option<String> {
    let (_, body) = replies.iter().find(|(t, _)| *t == b'E')?;
    body.split(|b| *b == 0)
        .find(|f| f.first() == Some(&b'C'))
        .map(|f| String::from_utf8_lossy(&f[1..]).into_owned())
}

/// Statements a client pipelines behind its startup packet, arriving in
/// the same read, are checked like any later ones, in the relay as in the
/// pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_sent_with_the_startup_packet_are_checked_too() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(0).start();
    common::sql(&c.conninfo(0), "CREATE TABLE w (v int)").await;
    for pooled in [false, true] {
        let settings = if pooled { pool(2, WAIT) } else { None };
        let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), settings, 10_000).await;
        ready(&e, 1).await;
        // No replica: the read-only service falls back to the primary.
        let ro = p.service_addrs()["read_only"];
        let mut bytes = startup_packet(&[("user", "postgres"), ("database", "postgres")]);
        bytes.extend(msg_query(
            b"BEGIN READ WRITE; INSERT INTO w VALUES (1); COMMIT",
        ));
        let mut s = std::net::TcpStream::connect(ro).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(&bytes).unwrap();
        let mut raw = RawClient(s, (0, 0));
        let greeting = raw.until_ready();
        assert_eq!(error_code(&greeting), None, "pooled {pooled}: {greeting:?}");
        let replies = raw.until_ready();
        assert_eq!(
            error_code(&replies).as_deref(),
            Some("25006"),
            "pooled {pooled}: {replies:?}"
        );
    }
    assert_eq!(
        sql_value(&c.conninfo(0), "SELECT count(*) FROM w")
            .await
            .as_deref(),
        Some("0")
    );
}

/// SQL assembled while it runs is out of the statement check's sight,
/// and can turn the read-only default off; the server reports that only
/// at its next ReadyForQuery. Statements pipelined behind it must not run
/// in a transaction begun after the change, before pgwarden has seen the
/// report: neither behind a Query or Sync, nor behind an extended-protocol
/// COMMIT in the same batch. Pipelines that do no such thing still flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_statements_cannot_outrun_the_read_only_report() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(0).start();
    common::sql(&c.conninfo(0), "CREATE TABLE w (v int)").await;
    let default_to = |v: &str| {
        format!(
            "SELECT query_to_xml('SELECT set_' || 'config(''default_transaction' || \
             '_read_only'', ''{v}'', false)', true, false, '')"
        )
        .into_bytes()
    };
    let (off, on) = (default_to("off"), default_to("on"));
    // Slow enough that any ReadyForQuery owed before it comes back first.
    let mut slow_off = b"SELECT pg_sleep(0.3); ".to_vec();
    slow_off.extend_from_slice(&off);
    let extended = |sql: &[u8]| {
        let mut m = msg_parse(b"", sql);
        m.extend(msg_bind_execute(b""));
        m
    };
    // The pipeline ends the session with 25006, the read-only error.
    let refused = |mut raw: RawClient, pipeline: &[u8], pooled: bool| {
        raw.0.write_all(pipeline).unwrap();
        let replies = raw.until_closed();
        assert_eq!(
            error_code(&replies).as_deref(),
            Some("25006"),
            "pooled {pooled}: {replies:?}"
        );
    };
    for pooled in [false, true] {
        let settings = if pooled { pool(2, WAIT) } else { None };
        let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), settings, 10_000).await;
        ready(&e, 1).await;
        // No replica: the read-only service falls back to the primary.
        let ro = p.service_addrs()["read_only"];
        let connect =
            || RawClient::connect_with(ro, &[("user", "postgres"), ("database", "postgres")]);

        // Behind a Query.
        let raw = connect();
        let mut pipeline = msg_query(&off);
        pipeline.extend(msg_query(b"INSERT INTO w VALUES (1)"));
        pipeline.extend(msg_query(&on));
        refused(raw, &pipeline, pooled);

        // Behind a Sync.
        let raw = connect();
        let mut pipeline = extended(&off);
        pipeline.extend_from_slice(MSG_SYNC);
        pipeline.extend(extended(b"INSERT INTO w VALUES (2)"));
        pipeline.extend_from_slice(MSG_SYNC);
        pipeline.extend(extended(&on));
        pipeline.extend_from_slice(MSG_SYNC);
        refused(raw, &pipeline, pooled);

        // Behind a COMMIT in the same batch: no ReadyForQuery, so no
        // report, comes between the transactions.
        for commit in [&b"COMMIT"[..], b"end", b"ROLLBACK"] {
            let mut raw = connect();
            let mut pipeline = extended(&off);
            pipeline.extend(extended(commit));
            pipeline.extend(extended(b"INSERT INTO w VALUES (3)"));
            pipeline.extend(extended(&on));
            pipeline.extend_from_slice(MSG_SYNC);
            raw.0.write_all(&pipeline).unwrap();
            let replies = raw.until_closed();
            let (_, error) = replies
                .iter()
                .find(|(t, _)| *t == b'E')
                .unwrap_or_else(|| panic!("pooled {pooled}: no error: {replies:?}"));
            let text = String::from_utf8_lossy(error);
            assert!(
                text.contains("25006") && text.contains("before the next Sync"),
                "pooled {pooled}: {text}"
            );
        }

        // Sent with the startup packet, before the login's own
        // ReadyForQuery.
        let mut bytes = startup_packet(&[("user", "postgres"), ("database", "postgres")]);
        bytes.extend(msg_query(&slow_off));
        bytes.extend(msg_query(b"INSERT INTO w VALUES (5)"));
        bytes.extend(msg_query(&on));
        let mut s = std::net::TcpStream::connect(ro).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(&bytes).unwrap();
        let replies = RawClient(s, (0, 0)).until_closed();
        assert_eq!(
            error_code(&replies).as_deref(),
            Some("25006"),
            "pooled {pooled}: {replies:?}"
        );

        // Behind many bare Syncs: every ReadyForQuery owed counts, not
        // just the first to come back.
        let mut raw = connect();
        let mut pipeline = msg_query(b"SELECT 1");
        for _ in 0..200 {
            pipeline.extend_from_slice(MSG_SYNC);
        }
        pipeline.extend(msg_query(&slow_off));
        pipeline.extend(msg_query(b"INSERT INTO w VALUES (6)"));
        pipeline.extend(msg_query(&on));
        raw.0.write_all(&pipeline).unwrap();
        let replies = raw.until_closed();
        assert_eq!(
            error_code(&replies[replies.len() - 1..]).as_deref(),
            Some("25006"),
            "pooled {pooled}: {replies:?}"
        );

        // A name the server kept: a Parse that reuses it fails (42P05),
        // and the statement is still COMMIT.
        let mut raw = connect();
        let mut prepare = msg_parse(b"c", b"COMMIT");
        prepare.extend_from_slice(MSG_SYNC);
        assert_eq!(error_code(&raw.send(&prepare)), None, "pooled {pooled}");
        let mut again = msg_parse(b"c", b"SELECT 1");
        again.extend_from_slice(MSG_SYNC);
        assert_eq!(
            error_code(&raw.send(&again)).as_deref(),
            Some("42P05"),
            "pooled {pooled}"
        );
        let mut pipeline = extended(&off);
        pipeline.extend(msg_bind_execute(b"c"));
        pipeline.extend(extended(b"INSERT INTO w VALUES (7)"));
        pipeline.extend(extended(&on));
        pipeline.extend_from_slice(MSG_SYNC);
        refused(raw, &pipeline, pooled);

        // A named statement, prepared in an earlier batch, counts too.
        let mut raw = connect();
        let mut prepare = msg_parse(b"c", b"COMMIT");
        prepare.extend_from_slice(MSG_SYNC);
        assert_eq!(error_code(&raw.send(&prepare)), None, "pooled {pooled}");
        let mut pipeline = extended(&off);
        pipeline.extend(msg_bind_execute(b"c"));
        pipeline.extend(extended(b"INSERT INTO w VALUES (4)"));
        pipeline.extend(extended(&on));
        pipeline.extend_from_slice(MSG_SYNC);
        refused(raw, &pipeline, pooled);

        // Pipelines that change nothing are answered in full.
        let mut raw = connect();
        let mut pipeline = msg_query(b"SELECT 1");
        pipeline.extend(msg_query(b"SELECT 2"));
        for sql in [&b"BEGIN"[..], b"SELECT 3", b"COMMIT", b"SELECT 4"] {
            pipeline.extend(extended(sql));
            pipeline.extend_from_slice(MSG_SYNC);
        }
        raw.0.write_all(&pipeline).unwrap();
        let mut rows = Vec::new();
        for _ in 0..6 {
            let replies = raw.until_ready();
            assert_eq!(error_code(&replies), None, "pooled {pooled}: {replies:?}");
            rows.extend(
                replies
                    .iter()
                    .filter(|(t, _)| *t == b'D')
                    .map(|(_, r)| String::from_utf8_lossy(&r[6..]).into_owned()),
            );
        }
        assert_eq!(rows, ["1", "2", "3", "4"], "pooled {pooled}");
        assert_eq!(value(&raw.simple(b"SHOW transaction_read_only")), "on");
    }
    assert_eq!(
        sql_value(&c.conninfo(0), "SELECT count(*) FROM w")
            .await
            .as_deref(),
        Some("0")
    );
}

/// A read-only session holding a pipelined statement for the server's
/// answer reads nothing from its client meanwhile; it must still end
/// promptly when its host is cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_session_holding_a_statement_still_ends_with_its_host() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(1).start();
    // The replica is reached (by the probe and by sessions) through a relay.
    let relay = pgwarden_testkit::Relay::start(c.addr(1).parse().unwrap()).unwrap();
    let addrs = vec![c.addr(0), relay.addr().to_string()];
    for pooled in [false, true] {
        let settings = if pooled { pool(2, WAIT) } else { None };
        let (e, p) = proxy_with(&addrs, Duration::from_secs(3), settings, 10_000).await;
        ready(&e, 2).await;
        let ro = p.service_addrs()["read_only"];
        let mut raw =
            RawClient::connect_with(ro, &[("user", "postgres"), ("database", "postgres")]);
        assert_eq!(value(&raw.simple(b"SELECT pg_is_in_recovery()")), "t");
        let mut pipeline = msg_query(b"SELECT pg_sleep(60)");
        pipeline.extend(msg_query(b"SELECT 1"));
        raw.0.write_all(&pipeline).unwrap();
        // The sleep is running (so the second Query is held) when the
        // replica is cut off.
        let replica = c.conninfo(1);
        pgwarden_testkit::eventually("sleep running", WAIT, || {
            let r = replica.clone();
            async move {
                match sql_value(
                    &r,
                    "SELECT count(*) > 0 FROM pg_stat_activity \
                     WHERE query = 'SELECT pg_sleep(60)' AND state = 'active'",
                )
                .await
                .as_deref()
                {
                    Some("t") => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        })
        .await;
        relay.set_blackhole(true);
        let started = std::time::Instant::now();
        let replies = tokio::task::spawn_blocking(move || raw.until_closed())
            .await
            .unwrap();
        let waited = started.elapsed();
        relay.set_blackhole(false);
        assert!(
            waited < Duration::from_secs(20),
            "pooled {pooled}: closed after {waited:?}: {replies:?}"
        );
        assert!(
            replies.iter().all(|(t, _)| *t != b'D'),
            "pooled {pooled}: {replies:?}"
        );
        ready(&e, 2).await;
    }
}

/// A server cut off while idle in the pool answers nothing: a client whose
/// start-up settings are being applied on it at login gets an error once
/// its `query_wait_timeout` is over, rather than waiting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_on_a_silent_server_ends_within_the_wait() {
    let c = TestCluster::builder().replicas(0).start();
    let (relay, e, p) = behind_relay(&c, pool(1, Duration::from_secs(2))).await;
    let url = via(&p, "read_write");
    // Leaves its server idle in the pool, without the setting below.
    let first = client(&url).await.unwrap();
    assert_eq!(one(&first, "SELECT 1").await, "1");
    drop(first);
    let wanted = format!("{url} options='-c work_mem=7MB'");
    relay.set_blackhole(true);
    let err = tokio::time::timeout(WAIT, client(&wanted))
        .await
        .expect("the login is answered")
        .expect_err("the server is silent");
    relay.set_blackhole(false);
    let db = err.as_db_error().expect("an ErrorResponse");
    assert_eq!(db.code().code(), "08006", "{db:?}");
    assert!(db.message().contains("query_wait_timeout"), "{db:?}");
    // The silent server was closed, not given back: once the host
    // answers again, the next login is served.
    ready(&e, 1).await;
    let again = client(&wanted).await.unwrap();
    assert_eq!(one(&again, "SHOW work_mem").await, "7MB");
}

/// A client that pipelines a large statement behind one with a large
/// result, reading while it writes (as libpq's pipeline mode does), is
/// served as PostgreSQL serves it. The server reads no more input while
/// its replies are unread, so the pool must read them while the rest of
/// the pipeline waits to be sent, not wait for the send first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_larger_than_the_socket_buffers_does_not_stall() {
    use std::io::{Read, Write};
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 1).await;
    let addr = p.service_addrs()["read_write"];
    // Both larger than what the kernel buffers between two sockets.
    const RESULT: usize = 64 << 20;
    const PADDING: usize = 48 << 20;
    let result = tokio::task::spawn_blocking(move || {
        let raw = RawClient::connect_with(addr, &[("user", "postgres"), ("database", "postgres")]);
        let mut s = raw.0;
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut reader = s.try_clone().unwrap();
        let replies = std::thread::spawn(move || {
            // (tag, body length) of every message up to the second
            // ReadyForQuery.
            let mut seen = Vec::new();
            let mut ready = 0;
            while ready < 2 {
                let mut head = [0u8; 5];
                if let Err(e) = reader.read_exact(&mut head) {
                    return Err(format!("after {seen:?}: {e}"));
                }
                let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize - 4;
                std::io::copy(&mut (&mut reader).take(len as u64), &mut std::io::sink())
                    .map_err(|e| e.to_string())?;
                seen.push((head[0], len));
                ready += usize::from(head[0] == b'Z');
            }
            Ok(seen)
        });
        let mut pipeline = msg_query(format!("SELECT repeat('x', {RESULT})").as_bytes());
        let mut padded = b"SELECT 2 /*".to_vec();
        padded.resize(padded.len() + PADDING, b' ');
        padded.extend_from_slice(b"*/");
        pipeline.extend(msg_query(&padded));
        s.write_all(&pipeline).unwrap();
        replies.join().unwrap()
    })
    .await
    .unwrap();
    let seen = result.expect("both replies");
    let rows: Vec<usize> = seen
        .iter()
        .filter(|(t, _)| *t == b'D')
        .map(|(_, len)| *len)
        .collect();
    // DataRow: a column count, one length, the value.
    assert_eq!(rows, [2 + 4 + RESULT, 2 + 4 + 1], "{seen:?}");
}

/// A statement name is the client's to choose, quotes included: the
/// DEALLOCATE the pool rewrites to a server-side name reads the client's
/// SQL as PostgreSQL does and writes the new name quoted, so no name can
/// end pgwarden's identifier and run what follows, here to make a
/// read-only service's server read-write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_names_with_quotes_stay_names_in_deallocate() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 1).await;
    common::sql(&c.conninfo(0), "CREATE TABLE w (v int)").await;
    // No replica: the read-only service falls back to the primary.
    let ro = p.service_addrs()["read_only"];
    let mut raw = RawClient::connect(ro, "UTF8");
    let name: &[u8] = b"x\";SET/**/default_transaction_read_only=off;--";
    assert_eq!(value(&raw.extended(name, b"SELECT 1")), "1");
    // Unquoted, the name is no identifier: a syntax error, as from
    // PostgreSQL, and nothing else runs.
    let replies = raw.simple(b"DEALLOCATE x\";SET/**/default_transaction_read_only=off;--");
    assert_eq!(
        error_code(&replies).as_deref(),
        Some("42601"),
        "{replies:?}"
    );
    // Quoted as SQL quotes it, it names the statement.
    let replies = raw.simple(b"DEALLOCATE \"x\"\";SET/**/default_transaction_read_only=off;--\"");
    assert_eq!(error_code(&replies), None, "{replies:?}");
    assert!(replies.iter().any(|(t, _)| *t == b'C'), "{replies:?}");
    assert_eq!(
        value(&raw.simple(b"SHOW default_transaction_read_only")),
        "on"
    );
    assert_eq!(
        error_code(&raw.simple(b"INSERT INTO w VALUES (1)")).as_deref(),
        Some("25006")
    );
}

/// A client's unnamed statement, prepared again on the server it lands
/// on, may be skipped by the server after an earlier error in the same
/// batch. A batch the client pipelined behind that one then binds its own
/// statement, as on PostgreSQL, never the server's leftover unnamed
/// statement of another client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_unnamed_statement_never_lets_a_client_run_anothers() {
    let c = TestCluster::builder().replicas(0).start();
    // One server: each client's turn finds the previous one's leftovers.
    let (_engine, p) = pooled(&c, 1).await;
    let addr = p.service_addrs()["read_write"];
    let mut a = RawClient::connect(addr, "UTF8");
    let mut b = RawClient::connect(addr, "UTF8");
    assert_eq!(value(&a.extended(b"", b"SELECT 'mine'")), "mine");
    assert_eq!(value(&b.extended(b"", b"SELECT 'theirs'")), "theirs");
    // Batch 1 fails before binding the unnamed statement; batch 2 binds it.
    let mut m = msg_parse(b"f", b"SELECT 1/0");
    m.extend(msg_bind_execute(b"f"));
    m.extend(msg_bind_execute(b""));
    m.extend_from_slice(MSG_SYNC);
    m.extend(msg_bind_execute(b""));
    m.extend_from_slice(MSG_SYNC);
    let first = a.send(&m);
    assert_eq!(error_code(&first).as_deref(), Some("22012"), "{first:?}");
    assert_eq!(value(&a.until_ready()), "mine");
}

/// A named statement the pool prepares again on a server may be skipped
/// there after an earlier error in its batch. Batches the client
/// pipelined behind that one still run it, as on PostgreSQL, whichever
/// batch fails, and the server is left with one copy of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_statement_prepared_again_survives_a_skipped_batch() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 1).await;
    let addr = p.service_addrs()["read_write"];
    let mut a = RawClient::connect(addr, "UTF8");
    let mut b = RawClient::connect(addr, "UTF8");
    assert_eq!(value(&a.extended(b"s1", b"SELECT 'mine'")), "mine");
    let prepared = |a: &mut RawClient| {
        let n = value(&a.simple(b"SELECT count(*) FROM pg_prepared_statements"));
        n.parse::<u32>().unwrap()
    };
    // Which of three pipelined batches fails before it binds s1, if any.
    for failing in [Some(0), None, Some(1)] {
        // The one server loses every statement: pgwarden must prepare
        // a's again.
        assert_eq!(error_code(&b.simple(b"DEALLOCATE ALL")), None);
        let mut m = Vec::new();
        for batch in 0..3 {
            if failing == Some(batch) {
                m.extend(msg_parse(b"", b"SELECT 1/0"));
                m.extend(msg_bind_execute(b""));
            }
            m.extend(msg_bind_execute(b"s1"));
            m.extend(msg_describe_statement(b"s1"));
            m.extend_from_slice(MSG_SYNC);
        }
        a.0.write_all(&m).unwrap();
        for batch in 0..3 {
            let r = a.until_ready();
            if failing == Some(batch) {
                assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
            } else {
                assert_eq!(error_code(&r), None, "{failing:?}, batch {batch}: {r:?}");
                assert_eq!(value(&r), "mine");
            }
        }
        assert_eq!(value(&a.extended(b"s2", b"SELECT 'later'")), "later");
        let mut m = msg_bind_execute(b"s1");
        m.extend_from_slice(MSG_SYNC);
        assert_eq!(value(&a.send(&m)), "mine", "{failing:?}");
        // s1 and s2, each once.
        assert_eq!(prepared(&mut a), 2, "{failing:?}");
        let mut m = Vec::new();
        for name in [&b"s1"[..], b"s2"] {
            m.extend_from_slice(&[b'C', 0, 0, 0, 4 + 1 + name.len() as u8 + 1, b'S']);
            m.extend_from_slice(name);
            m.push(0);
        }
        m.extend_from_slice(MSG_SYNC);
        assert_eq!(error_code(&a.send(&m)), None);
        assert_eq!(value(&a.extended(b"s1", b"SELECT 'mine'")), "mine");
    }
    // A Parse of a name the client has, pipelined behind the batch whose
    // Parse of it the server skipped, is refused as PostgreSQL refuses it,
    // and the statement keeps its text.
    assert_eq!(error_code(&b.simple(b"DEALLOCATE ALL")), None);
    let mut m = msg_parse(b"", b"SELECT 1/0");
    m.extend(msg_bind_execute(b""));
    m.extend(msg_bind_execute(b"s1"));
    m.extend_from_slice(MSG_SYNC);
    m.extend(msg_parse(b"s1", b"SELECT 'other'"));
    m.extend_from_slice(MSG_SYNC);
    a.0.write_all(&m).unwrap();
    assert_eq!(error_code(&a.until_ready()).as_deref(), Some("22012"));
    assert_eq!(error_code(&a.until_ready()).as_deref(), Some("42P05"));
    let mut m = msg_bind_execute(b"s1");
    m.extend_from_slice(MSG_SYNC);
    assert_eq!(value(&a.send(&m)), "mine");

    // A Query inside an extended-protocol batch that failed is ignored by
    // PostgreSQL, up to the Sync: a Bind behind it must not wait for its
    // ReadyForQuery.
    assert_eq!(error_code(&b.simple(b"DEALLOCATE ALL")), None);
    let mut m = msg_parse(b"", b"SELECT 1/0");
    m.extend(msg_bind_execute(b""));
    m.extend(msg_bind_execute(b"s1"));
    m.extend(msg_query(b"SELECT 1"));
    m.extend(msg_bind_execute(b"s1"));
    m.extend_from_slice(MSG_SYNC);
    a.0.write_all(&m).unwrap();
    assert_eq!(error_code(&a.until_ready()).as_deref(), Some("22012"));
    let mut m = msg_bind_execute(b"s1");
    m.extend_from_slice(MSG_SYNC);
    assert_eq!(value(&a.send(&m)), "mine");
}

/// PostgreSQL skips a Query sent inside an extended-protocol batch (no
/// Sync before it) after an error earlier in that batch, and sends it no
/// ReadyForQuery; one that runs gets its own. pgwarden follows both,
/// showing the client nothing of how: the pool's server goes back at the
/// batch's end, and a read-only session, pooled or relayed, takes its
/// next statement at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_inside_an_extended_batch_is_followed_whether_or_not_it_runs() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(0).start();
    for pooled in [true, false] {
        let settings = if pooled {
            pool(1, Duration::from_secs(5))
        } else {
            None
        };
        let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), settings, 10_000).await;
        ready(&e, 1).await;
        for service in ["read_write", "read_only"] {
            let addr = p.service_addrs()[service];
            let mut a = RawClient::connect(addr, "UTF8");
            let mut b = RawClient::connect(addr, "UTF8");
            // (extended statement, Query, ReadyForQuery count, error, rows)
            type Case<'a> = (&'a [u8], &'a [u8], usize, Option<&'a str>, &'a [&'a str]);
            let cases: [Case; 3] = [
                (b"SELECT 1/0", b"SELECT 'q'", 1, Some("22012"), &[]),
                (b"SELECT 1", b"SELECT 'q'", 2, None, &["1", "q", "after"]),
                (
                    b"SELECT 1",
                    b"SELECT 1/0",
                    2,
                    Some("22012"),
                    &["1", "after"],
                ),
            ];
            for (ext, query, readies, code, rows) in cases {
                let what = format!(
                    "pooled {pooled}, {service}, {:?}",
                    String::from_utf8_lossy(ext)
                );
                let mut m = msg_parse(b"", ext);
                m.extend(msg_bind_execute(b""));
                m.extend(msg_query(query));
                m.extend(msg_parse(b"", b"SELECT 'after'"));
                m.extend(msg_bind_execute(b""));
                m.extend_from_slice(MSG_SYNC);
                a.0.write_all(&m).unwrap();
                let mut r = Vec::new();
                for _ in 0..readies {
                    r.extend(a.until_ready());
                }
                assert_eq!(error_code(&r).as_deref(), code, "{what}: {r:?}");
                let got: Vec<String> = r
                    .iter()
                    .filter(|(t, _)| *t == b'D')
                    .map(|(_, row)| String::from_utf8_lossy(&row[6..]).into_owned())
                    .collect();
                assert_eq!(got, rows, "{what}: {r:?}");
                assert!(
                    r.iter().all(|(t, _)| *t != b'3'),
                    "{what}: a CloseComplete the client did not ask for: {r:?}"
                );
                assert_eq!(value(&a.simple(b"SELECT 'next'")), "next", "{what}");
                // The pool's one server is free again.
                assert_eq!(value(&b.simple(b"SELECT 'other'")), "other", "{what}");
            }
        }
    }
}

/// Describe of prepared statement `name`.
fn msg_describe_statement(name: &[u8]) -> Vec<u8> {
    let mut m = vec![b'D'];
    m.extend_from_slice(&((4 + 1 + name.len() + 1) as u32).to_be_bytes());
    m.push(b'S');
    m.extend_from_slice(name);
    m.push(0);
    m
}

/// A refused statement parsed with parameter types, some left to the
/// server (0), fails on a read-only service with 25006 when it runs, as
/// without types: the statement that stands in for it keeps the client's
/// types (one the server cannot determine would fail the Parse, 42P18).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_statement_with_declared_parameter_types_fails_as_read_only() {
    let c = TestCluster::builder().replicas(0).start();
    for pooled in [false, true] {
        let settings = if pooled { pool(2, WAIT) } else { None };
        let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), settings, 10_000).await;
        ready(&e, 1).await;
        let mut s = RawClient::connect(p.service_addrs()["read_only"], "UTF8");
        let sql = b"SELECT set_config('default_transaction_read_only', $1, false), $2 + 1";
        let mut m = vec![b'P'];
        m.extend_from_slice(&((4 + 2 + sql.len() + 1 + 2 + 8) as u32).to_be_bytes());
        m.extend_from_slice(b"w\0");
        m.extend_from_slice(sql);
        m.push(0);
        m.extend_from_slice(&2u16.to_be_bytes());
        m.extend_from_slice(&0u32.to_be_bytes());
        m.extend_from_slice(&23u32.to_be_bytes());
        m.extend_from_slice(MSG_SYNC);
        let r = s.send(&m);
        assert_eq!(
            error_code(&r),
            None,
            "pooled {pooled}: the Parse stands: {r:?}"
        );
        // Bind both parameters as text, Execute.
        let mut bind = Vec::new();
        bind.extend_from_slice(b"\0w\0");
        bind.extend_from_slice(&[0, 0, 0, 2]);
        for v in [&b"x"[..], b"1"] {
            bind.extend_from_slice(&(v.len() as u32).to_be_bytes());
            bind.extend_from_slice(v);
        }
        bind.extend_from_slice(&[0, 0]);
        let mut m = vec![b'B'];
        m.extend_from_slice(&((4 + bind.len()) as u32).to_be_bytes());
        m.extend_from_slice(&bind);
        m.extend_from_slice(&[b'E', 0, 0, 0, 9, 0, 0, 0, 0, 0]);
        m.extend_from_slice(MSG_SYNC);
        let r = s.send(&m);
        assert_eq!(
            error_code(&r).as_deref(),
            Some("25006"),
            "pooled {pooled}: {r:?}"
        );
        assert_eq!(value(&s.simple(b"SELECT 'still here'")), "still here");
    }
}

/// A client whose encoding is not UTF-8 (LATIN1) sends bytes that are not
/// UTF-8 text; its statements are checked all the same: switching a
/// read-only session to read-write is refused, in the relay and in the
/// transaction pool, and session state pins a pooled client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latin1_clients_get_the_read_only_and_pinning_rules_too() {
    let c = TestCluster::builder().replicas(0).start();
    for pooled in [false, true] {
        let settings = if pooled { pool(2, WAIT) } else { None };
        let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), settings, 10_000).await;
        ready(&e, 1).await;
        // No replica: the read-only service falls back to the primary.
        let ro = p.service_addrs()["read_only"];
        let mut s = RawClient::connect(ro, "LATIN1");
        let r = s.extended(b"s\xe9", b"BEGIN READ WRITE /* \xe9 */");
        assert_eq!(error_code(&r).as_deref(), Some("25006"), "{pooled}: {r:?}");
        let r = s.simple(b"SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE -- \xe9");
        assert_eq!(error_code(&r).as_deref(), Some("25006"), "{pooled}: {r:?}");
        let r = s.extended(b"", b"CREATE TABLE latin1_\xe9 (x int)");
        assert_eq!(error_code(&r).as_deref(), Some("25006"), "{pooled}: {r:?}");
        // The two switches are counted, relayed or pooled; a writable
        // service has no such series.
        let http = p.http_addr().unwrap();
        let refused = common::metric_sample(
            http,
            "pgwarden_read_only_refusals_total{service=\"read_only\"}",
        )
        .await;
        assert_eq!(refused, 2.0, "{pooled}");
        let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics"))
            .await
            .unwrap();
        assert!(
            !body.contains("pgwarden_read_only_refusals_total{service=\"read_write\"}"),
            "{pooled}"
        );
        // Plain reads with LATIN1 text work.
        let r = s.simple(b"SELECT 'caf\xe9'");
        assert_eq!(error_code(&r), None, "{pooled}: {r:?}");
        let row = r.iter().find(|(t, _)| *t == b'D').expect("a row");
        assert!(row.1.ends_with(b"caf\xe9"), "{row:?}");
    }

    // Session state with a LATIN1 literal pins the client in the pool: the
    // server it set search_path on serves nobody else. The pool hands out
    // the server released last, so without the pin the next client would
    // get it and see the setting.
    let (_engine, p) = pooled(&c, 2).await;
    let rw = p.service_addrs()["read_write"];
    let mut a = RawClient::connect(rw, "LATIN1");
    let r = a.simple(b"SET search_path TO \"caf\xe9\", public");
    assert_eq!(error_code(&r), None, "{r:?}");
    let b = client(&via(&p, "read_write")).await.unwrap();
    for _ in 0..3 {
        let path = one(&b, "SHOW search_path").await;
        assert!(
            !path.contains("caf"),
            "another client's setting leaked: {path}"
        );
    }
    let r = a.simple(b"SHOW search_path");
    let row = r.iter().find(|(t, _)| *t == b'D').expect("a row");
    assert!(
        row.1.windows(4).any(|w| w == b"caf\xe9"),
        "{:?}",
        String::from_utf8_lossy(&row.1)
    );
}

/// A FunctionCall (`F`) message: the fast-path call of function `oid`
/// with text arguments, text result.
fn function_call(oid: u32, args: &[&[u8]]) -> Vec<u8> {
    let mut b = oid.to_be_bytes().to_vec();
    b.extend_from_slice(&1i16.to_be_bytes());
    b.extend_from_slice(&0i16.to_be_bytes());
    b.extend_from_slice(&(args.len() as i16).to_be_bytes());
    for a in args {
        b.extend_from_slice(&(a.len() as i32).to_be_bytes());
        b.extend_from_slice(a);
    }
    b.extend_from_slice(&0i16.to_be_bytes());
    let mut m = vec![b'F'];
    m.extend_from_slice(&((b.len() + 4) as u32).to_be_bytes());
    m.extend_from_slice(&b);
    m
}

/// `set_config` through the fast-path function-call interface, with a
/// write pipelined behind it, cannot make a read-only session write: the
/// call is refused (25006) and the write fails, in the relay and in the
/// transaction pool. Other function calls still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_services_refuse_set_config_through_function_calls() {
    let c = TestCluster::builder().replicas(0).start();
    let primary = c.conninfo(0);
    sql_value(&primary, "CREATE TABLE fastpath_t (x int)").await;
    let oid = |name: &'static str| {
        let primary = primary.clone();
        async move {
            sql_value(&primary, &format!("SELECT '{name}'::regproc::oid"))
                .await
                .unwrap()
                .parse::<u32>()
                .unwrap()
        }
    };
    let (set_config, version) = (
        oid("pg_catalog.set_config").await,
        oid("pg_catalog.version").await,
    );
    for pooled in [false, true] {
        let settings = if pooled { pool(2, WAIT) } else { None };
        let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(3), settings, 10_000).await;
        ready(&e, 1).await;
        // No replica: the read-only service falls back to the primary.
        let mut s = RawClient::connect(p.service_addrs()["read_only"], "UTF8");
        let mut pipelined = function_call(
            set_config,
            &[b"default_transaction_read_only", b"off", b"false"],
        );
        pipelined.extend(msg_query(b"INSERT INTO fastpath_t VALUES (1)"));
        let r = s.send(&pipelined);
        assert_eq!(error_code(&r).as_deref(), Some("25006"), "{pooled}: {r:?}");
        let r = s.until_ready();
        assert_eq!(error_code(&r).as_deref(), Some("25006"), "{pooled}: {r:?}");
        let r = s.send(&function_call(version, &[]));
        assert_eq!(error_code(&r), None, "{pooled}: {r:?}");
        let (_, v) = r.iter().find(|(t, _)| *t == b'V').expect("a result");
        assert!(String::from_utf8_lossy(v).contains("PostgreSQL"), "{v:?}");
        let r = s.simple(b"SHOW transaction_read_only");
        let (_, row) = r.iter().find(|(t, _)| *t == b'D').expect("a row");
        assert!(row.ends_with(b"on"), "{row:?}");
    }
    assert_eq!(
        sql_value(&primary, "SELECT count(*) FROM fastpath_t")
            .await
            .as_deref(),
        Some("0")
    );
}

/// A session advisory lock taken through the fast-path interface pins the
/// client like `SELECT pg_advisory_lock(...)` does: its unlock reaches the
/// server that holds the lock even while another client holds a
/// transaction open. The pool hands out the server released last, so
/// without the pin the other client would take the lock holder's server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_path_advisory_locks_pin_the_client() {
    let c = TestCluster::builder().replicas(0).start();
    let primary = c.conninfo(0);
    let oid = |sig: &'static str| {
        let primary = primary.clone();
        async move {
            sql_value(&primary, &format!("SELECT '{sig}'::regprocedure::oid"))
                .await
                .unwrap()
                .parse::<u32>()
                .unwrap()
        }
    };
    let lock = oid("pg_catalog.pg_advisory_lock(bigint)").await;
    let unlock = oid("pg_catalog.pg_advisory_unlock(bigint)").await;
    let (_engine, p) = pooled(&c, 2).await;
    let mut a = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    let r = a.send(&function_call(lock, &[b"42"]));
    assert_eq!(error_code(&r), None, "{r:?}");
    let b = client(&via(&p, "read_write")).await.unwrap();
    b.batch_execute("BEGIN").await.unwrap();
    one(&b, "SELECT 1").await;
    let r = a.send(&function_call(unlock, &[b"42"]));
    let (_, v) = r.iter().find(|(t, _)| *t == b'V').expect("a result");
    assert!(
        v.ends_with(b"t"),
        "the unlock ran where the lock is held: {r:?}"
    );
    b.batch_execute("COMMIT").await.unwrap();
}

/// The admin console answers like a PostgreSQL server: an empty query gets
/// EmptyQueryResponse; the extended protocol works (Parse, Bind, Describe,
/// Execute, Close, Sync), with one ErrorResponse per failed batch, the rest
/// of it skipped up to its Sync; the settings drivers send when they
/// connect (JDBC's `SET extra_float_digits`) are accepted, others refused.
/// JDBC, with its default extended protocol and in simple mode, reads
/// SHOW output by PgBouncer's column names (tests/clients/JdbcAdmin.java).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_console_answers_like_postgres_in_both_protocols() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 2).await;
    let addr = p.service_addrs()["read_write"];
    // A pool to show.
    let app = client(&via(&p, "read_write")).await.unwrap();
    app.batch_execute("SELECT 1").await.unwrap();
    let mut s = RawClient::connect_to(addr, "pgwarden", "UTF8");
    let tags = |r: &[(u8, Vec<u8>)]| r.iter().map(|(t, _)| *t as char).collect::<String>();
    assert_eq!(tags(&s.simple(b"")), "IZ");
    assert_eq!(tags(&s.simple(b" ; ")), "IZ");
    // Parse, Bind, Execute (rows, no RowDescription), Sync.
    let r = s.extended(b"", b"SHOW POOLS");
    assert_eq!(error_code(&r), None, "{r:?}");
    let t = tags(&r);
    assert!(
        t.starts_with("12") && t.ends_with("CZ") && !t.contains('T'),
        "{r:?}"
    );
    // A named statement described, run twice, closed.
    let mut m = msg_parse(b"st", b"SHOW STATS");
    m.extend_from_slice(&[b'D', 0, 0, 0, 8, b'S', b's', b't', 0]);
    m.extend(msg_bind_execute(b"st"));
    m.extend(msg_bind_execute(b"st"));
    m.extend_from_slice(&[b'C', 0, 0, 0, 8, b'S', b's', b't', 0]);
    m.extend_from_slice(MSG_SYNC);
    let r = s.send(&m);
    // (DataRows, one per pool, left out: there may be none yet.)
    assert_eq!(tags(&r).replace('D', ""), "1tT2C2C3Z", "{r:?}");
    // An unknown command fails at Execute; the batch is skipped to Sync.
    let mut m = msg_parse(b"", b"SHOW NOTHING");
    m.extend(msg_bind_execute(b""));
    m.extend(msg_bind_execute(b""));
    m.extend_from_slice(MSG_SYNC);
    let r = s.send(&m);
    assert_eq!(tags(&r), "12EZ", "{r:?}");
    assert_eq!(error_code(&r).as_deref(), Some("0A000"));
    // A Query in the skipped part of a batch is skipped too, as on
    // PostgreSQL: one ErrorResponse, one ReadyForQuery.
    let mut m = msg_parse(b"", b"SHOW NOTHING");
    m.extend(msg_bind_execute(b""));
    m.extend(msg_query(b"SHOW VERSION"));
    m.extend_from_slice(MSG_SYNC);
    let r = s.send(&m);
    assert_eq!(tags(&r), "12EZ", "{r:?}");
    // Copy messages outside a COPY are ignored, not answered.
    let mut m = vec![b'd', 0, 0, 0, 7, b'a', b'b', b'c'];
    m.extend_from_slice(&[b'c', 0, 0, 0, 4]);
    m.extend_from_slice(&[b'f', 0, 0, 0, 7, b'n', b'o', 0]);
    m.extend_from_slice(MSG_SYNC);
    let r = s.send(&m);
    assert_eq!(tags(&r), "Z", "{r:?}");
    let mut m = msg_bind_execute(b"closed");
    m.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&s.send(&m)).as_deref(), Some("26000"));
    // A Flush alone is no error, and the console still answers.
    let r = s.send(&[b'H', 0, 0, 0, 4, b'S', 0, 0, 0, 4]);
    assert_eq!(tags(&r), "Z", "{r:?}");
    // Driver settings pass; pgwarden's own are not set this way.
    for ok in [
        &b"SET extra_float_digits = 3"[..],
        b"SET application_name TO 'x'",
        b"set SESSION TimeZone='UTC'",
        b"RESET ALL",
    ] {
        let r = s.simple(ok);
        assert_eq!(error_code(&r), None, "{r:?}");
    }
    assert_eq!(
        error_code(&s.simple(b"SET default_pool_size = 5")).as_deref(),
        Some("0A000")
    );
    // Several commands in one query are refused, not cut to the first.
    for several in [
        &b"set application_name='x'; show version"[..],
        b"SHOW VERSION; SHOW LISTS",
    ] {
        let r = s.simple(several);
        assert_eq!(tags(&r), "EZ", "{r:?}");
        assert_eq!(error_code(&r).as_deref(), Some("0A000"));
    }
    assert_eq!(tags(&s.simple(b"SHOW VERSION;")), "TDCZ");
    // A function call is answered with an error, then ReadyForQuery.
    let r = s.send(&function_call(1, &[]));
    assert_eq!(tags(&r), "EZ", "{r:?}");
    // A row limit the result fits in is no limit; one it does not fit in
    // is refused rather than ignored.
    let execute = |max_rows: i32| {
        let mut m = msg_parse(b"", b"SHOW LISTS");
        m.extend_from_slice(&[b'B', 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 0]);
        m.extend_from_slice(&[b'E', 0, 0, 0, 9, 0]);
        m.extend_from_slice(&max_rows.to_be_bytes());
        m.extend_from_slice(MSG_SYNC);
        m
    };
    let r = s.send(&execute(1000));
    assert_eq!(error_code(&r), None, "{r:?}");
    assert!(tags(&r).ends_with("DCZ"), "{r:?}");
    let r = s.send(&execute(1));
    assert_eq!(tags(&r), "12EZ", "{r:?}");
    assert_eq!(error_code(&r).as_deref(), Some("0A000"));
    // tokio-postgres: every query is prepared (Parse, Describe statement).
    let url = format!(
        "host={} port={} user=postgres dbname=pgwarden",
        addr.ip(),
        addr.port()
    );
    let admin = client(&url).await.unwrap();
    let rows = admin.query("SHOW POOLS", &[]).await.unwrap();
    assert!(!rows.is_empty());
    let _: &str = rows[0].get("cl_active");
    common::java_client("JdbcAdmin.java", vec![addr.port().to_string()]).await;
}

/// `DISCARD ALL` from one client (connection pools of Npgsql and others
/// send it on every checkout) drops all prepared statements of the server
/// it runs on. The other clients' statements there are prepared again when
/// they are next used; the discarding client's own are gone, as on
/// PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_all_from_one_client_does_not_break_the_others_statements() {
    let c = TestCluster::builder().replicas(0).start();
    // One server: every client shares it.
    let (_engine, p) = pooled(&c, 1).await;
    let a = client(&via(&p, "read_write")).await.unwrap();
    let b = client(&via(&p, "read_write")).await.unwrap();
    let a_stmt = a.prepare("SELECT $1::int4 + 1").await.unwrap();
    let b_stmt = b.prepare("SELECT $1::int4 + 2").await.unwrap();
    assert_eq!(
        a.query_one(&a_stmt, &[&1i32])
            .await
            .unwrap()
            .get::<_, i32>(0),
        2
    );
    assert_eq!(
        b.query_one(&b_stmt, &[&1i32])
            .await
            .unwrap()
            .get::<_, i32>(0),
        3
    );
    for discard in ["DISCARD ALL", "discard all;", "SELECT 1; DEALLOCATE ALL"] {
        b.batch_execute(discard).await.unwrap();
        let row = a.query_one(&a_stmt, &[&2i32]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 3, "after {discard}");
        let err = b.query_one(&b_stmt, &[&1i32]).await.unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("26000"), "{err}");
    }
    // Through the extended protocol too.
    let discard = b.prepare("DISCARD ALL").await.unwrap();
    b.execute(&discard, &[]).await.unwrap();
    let row = a.query_one(&a_stmt, &[&3i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 4);
    // A DISCARD ALL that fails (inside a transaction block) leaves the
    // server's statements where they were; a's still works.
    b.batch_execute("BEGIN").await.unwrap();
    let err = b.batch_execute("DISCARD ALL").await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("25001"), "{err}");
    b.batch_execute("ROLLBACK").await.unwrap();
    let row = a.query_one(&a_stmt, &[&4i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 5);
    // One that ran is final: an error pipelined behind it costs no
    // server (the one server stays, with the same backend), and a's
    // statement is prepared again on it.
    drop(b);
    let mut r = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    let pid = value(&r.simple(b"SELECT pg_backend_pid()"));
    let mut m = msg_query(b"DISCARD ALL");
    m.extend(msg_query(b"SELECT 1/0"));
    let replies = r.send(&m);
    assert_eq!(error_code(&replies), None, "{replies:?}");
    assert_eq!(error_code(&r.until_ready()).as_deref(), Some("22012"));
    assert_eq!(value(&r.simple(b"SELECT pg_backend_pid()")), pid);
    let row = a.query_one(&a_stmt, &[&5i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 6);
    // One the error made the server skip leaves a's statement there; it
    // still works.
    let mut m = msg_parse(b"", b"SELECT 1/0");
    m.extend(msg_bind_execute(b""));
    m.extend(msg_query(b"DISCARD ALL"));
    m.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&r.send(&m)).as_deref(), Some("22012"));
    let row = a.query_one(&a_stmt, &[&6i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 7);
}

/// A client that closes a statement and prepares another under the same
/// name gets the new one, also on a server that still holds the old one:
/// the Close reached only the server the client was on at the time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_name_reused_after_close_gets_the_new_statement() {
    let c = TestCluster::builder().replicas(0).start();
    // One worker: idle servers are reused most recent first.
    WORKERS.with(|w| w.set(1));
    let (_engine, p) = pooled(&c, 2).await;
    let rw = p.service_addrs()["read_write"];
    let mut a = RawClient::connect(rw, "UTF8");
    let b = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(value(&a.extended(b"s1", b"SELECT 'old'")), "old");
    // b takes the server a used; a's Close goes to the other one.
    b.batch_execute("BEGIN").await.unwrap();
    one(&b, "SELECT 1").await;
    let r = a.send(&[b'C', 0, 0, 0, 8, b'S', b's', b'1', 0, b'S', 0, 0, 0, 4]);
    assert_eq!(
        r.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        b"3Z",
        "{r:?}"
    );
    b.batch_execute("COMMIT").await.unwrap();
    // Back on the server that still has the old statement.
    assert_eq!(value(&a.extended(b"s1", b"SELECT 'new'")), "new");
    let mut bind_again = msg_bind_execute(b"s1");
    bind_again.extend_from_slice(MSG_SYNC);
    assert_eq!(value(&a.send(&bind_again)), "new");
}

/// A statement pgwarden prepares on a server just before the client binds
/// it, in a batch where an earlier message failed, is skipped by the
/// server; pgwarden then knows it is not there and prepares it again the
/// next time instead of binding a statement the server does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_prepared_in_a_failed_batch_is_prepared_again() {
    let c = TestCluster::builder().replicas(0).start();
    // One worker: idle servers are reused most recent first.
    WORKERS.with(|w| w.set(1));
    let (_engine, p) = pooled(&c, 2).await;
    let mut a = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    let b = client(&via(&p, "read_write")).await.unwrap();
    let r = a.extended(b"s2", b"SELECT 'two'");
    assert_eq!(error_code(&r), None, "{r:?}");
    let mut use_s2 = msg_bind_execute(b"s2");
    use_s2.extend_from_slice(MSG_SYNC);
    for round in 0..2 {
        // b holds the server that has s2, so a is on the other one.
        b.batch_execute("BEGIN").await.unwrap();
        one(&b, "SELECT 1").await;
        if round == 0 {
            // A failing statement first: the server skips the rest of the
            // batch, the Parse pgwarden puts before the Bind of s2 too.
            let mut batch = msg_parse(b"", b"SELECT 1/0");
            batch.extend(msg_bind_execute(b""));
            batch.extend(msg_bind_execute(b"s2"));
            batch.extend_from_slice(MSG_SYNC);
            let r = a.send(&batch);
            assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
        } else {
            let r = a.send(&use_s2);
            assert_eq!(error_code(&r), None, "{r:?}");
            let (_, row) = r.iter().find(|(t, _)| *t == b'D').expect("a row");
            assert!(row.ends_with(b"two"), "{row:?}");
        }
        b.batch_execute("COMMIT").await.unwrap();
    }
}

const MSG_FLUSH: &[u8] = &[b'H', 0, 0, 0, 4];

/// libpq's pipeline mode (psycopg 3's `conn.pipeline()`) follows each
/// Sync with a Flush. A Flush once the transaction has ended asks for
/// nothing that needs a server, so it must not hold one: on a pool of
/// one, another client still gets the server at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_between_transactions_does_not_hold_a_server() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 1, Duration::from_secs(5)).await;
    let b = client(&via(&p, "read_write")).await.unwrap();
    let mut a = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    // A pipeline whose second statement fails, as psycopg sends it.
    let mut pipeline = msg_parse(b"", b"SELECT 1");
    pipeline.extend(msg_bind_execute(b""));
    pipeline.extend(msg_parse(b"", b"SELECT 1/0"));
    pipeline.extend(msg_bind_execute(b""));
    pipeline.extend_from_slice(MSG_FLUSH);
    pipeline.extend_from_slice(MSG_SYNC);
    pipeline.extend_from_slice(MSG_FLUSH);
    for round in 0..3 {
        let r = a.send(&pipeline);
        assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
        if round == 2 {
            // A Flush on its own, between transactions.
            std::io::Write::write_all(&mut a.0, MSG_FLUSH).unwrap();
        }
        assert_eq!(one(&b, "SELECT 7").await, "7", "round {round}");
    }
    assert_eq!(one(&b, "SELECT 8").await, "8");
    let r = a.simple(b"SELECT 9");
    assert_eq!(error_code(&r), None, "{r:?}");
}

/// A lone Flush (libpq's pipeline mode sends one after each Sync) or a
/// stray CopyDone from a pinned client between transactions asks its
/// server for nothing: it starts no transaction that a switchover's drain
/// would wait for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_clients_lone_flush_starts_no_transaction() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 2, WAIT).await;
    let http = p.http_addr().unwrap();
    let mut a = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    let r = a.simple(b"LISTEN pgwarden_flush");
    assert_eq!(error_code(&r), None, "{r:?}");
    let received = "pgwarden_client_received_bytes_total";
    let before = pool_metric(http, received).await;
    std::io::Write::write_all(&mut a.0, MSG_FLUSH).unwrap();
    std::io::Write::write_all(&mut a.0, &[b'c', 0, 0, 0, 4]).unwrap();
    pgwarden_testkit::eventually("pgwarden read them", WAIT, || async {
        let n = pool_metric(http, received).await;
        (n >= before + 10.0).then_some(()).ok_or(format!("{n}"))
    })
    .await;
    let (code, body) = post(http, "/pause?service=read_write&wait_ms=1000").await;
    assert_eq!(
        (code, body.as_str()),
        (200, "paused read_write; no transaction in flight\n")
    );
    assert_eq!(post(http, "/resume?service=read_write").await.0, 200);
    // Still its own server, LISTEN and all.
    let r = a.simple(b"SELECT count(*) FROM pg_listening_channels()");
    assert_eq!(error_code(&r), None, "{r:?}");
    assert!(
        r.iter().any(|(t, body)| *t == b'D' && body.ends_with(b"1")),
        "{r:?}"
    );
}

/// A client may prepare `DISCARD ALL` in one batch and run it in another
/// (psycopg 3 does, with `prepare_threshold=0`): the two can land on
/// different servers. The statements are gone from the server it ran on,
/// not from the one where it was only prepared; another client's statement
/// keeps working on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_discard_all_forgets_statements_where_it_runs() {
    let c = TestCluster::builder().replicas(0).start();
    // One worker: idle servers are reused most recent first.
    WORKERS.with(|w| w.set(1));
    let (_engine, p) = pooled(&c, 2).await;
    let addr = p.service_addrs()["read_write"];
    let (mut a, mut b) = (
        RawClient::connect(addr, "UTF8"),
        RawClient::connect(addr, "UTF8"),
    );
    let holder = client(&via(&p, "read_write")).await.unwrap();
    let mut use_sb = msg_bind_execute(b"sb");
    use_sb.extend_from_slice(MSG_SYNC);
    let b_runs = |b: &mut RawClient, step: &str| {
        let r = b.send(&use_sb);
        assert_eq!(error_code(&r), None, "{step}: {r:?}");
        assert!(
            r.iter().any(|(t, body)| *t == b'D' && body.ends_with(b"b")),
            "{step}: {r:?}"
        );
    };
    // b's statement on both servers: X, then Y while the holder has X.
    let r = b.extended(b"sb", b"SELECT 'b'");
    assert_eq!(error_code(&r), None, "{r:?}");
    holder.batch_execute("BEGIN").await.unwrap();
    b_runs(&mut b, "prepared on the second server");
    holder.batch_execute("COMMIT").await.unwrap();
    // a prepares DISCARD ALL on X...
    let mut prepare = msg_parse(b"d", b"DISCARD ALL");
    prepare.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&a.send(&prepare)), None);
    // ...and runs it on Y, while the holder has X.
    holder.batch_execute("BEGIN").await.unwrap();
    let mut run = msg_bind_execute(b"d");
    run.extend_from_slice(MSG_SYNC);
    let r = a.send(&run);
    assert_eq!(error_code(&r), None, "{r:?}");
    assert!(
        r.iter()
            .any(|(t, body)| *t == b'C' && body.starts_with(b"DISCARD ALL")),
        "{r:?}"
    );
    b_runs(&mut b, "on the server DISCARD ALL ran on");
    holder.batch_execute("COMMIT").await.unwrap();
    b_runs(&mut b, "on the server DISCARD ALL was prepared on");
    // As on PostgreSQL, `d` dropped itself.
    let r = a.send(&run);
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
}

/// `DEALLOCATE name` of a protocol-level statement prepared on another
/// server answers as PostgreSQL would: it succeeds without preparing the
/// statement again (which would fail here: its table is gone), and inside
/// a failed transaction it fails with 25P02 and the statement stays; in
/// neither case is the client left waiting (PHP's PDO drops every
/// statement it prepared this way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deallocate_of_a_statement_prepared_on_another_server() {
    let c = TestCluster::builder().replicas(0).start();
    // One worker: idle servers are reused most recent first.
    WORKERS.with(|w| w.set(1));
    let (_engine, p) = pooled(&c, 2).await;
    let addr = p.service_addrs()["read_write"];
    let direct = client(&c.conninfo(0)).await.unwrap();
    let holder = client(&via(&p, "read_write")).await.unwrap();
    let mut a = RawClient::connect(addr, "UTF8");
    direct
        .batch_execute("CREATE TABLE gone (v int)")
        .await
        .unwrap();
    // `s` prepared on X, whose table then goes; the holder takes X.
    assert_eq!(
        error_code(&a.extended(b"s", b"SELECT count(*) FROM gone")),
        None
    );
    holder.batch_execute("BEGIN").await.unwrap();
    direct.batch_execute("DROP TABLE gone").await.unwrap();
    let r = a.simple(b"DEALLOCATE s");
    assert_eq!(error_code(&r), None, "{r:?}");
    assert_eq!(tags(&r), ["DEALLOCATE"], "{r:?}");
    holder.batch_execute("COMMIT").await.unwrap();
    // Gone, as on PostgreSQL.
    let mut run = msg_bind_execute(b"s");
    run.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&a.send(&run)).as_deref(), Some("26000"));

    // `s2` prepared on X; the holder takes X; on Y a's transaction fails.
    assert_eq!(error_code(&a.extended(b"s2", b"SELECT 2")), None);
    holder.batch_execute("BEGIN").await.unwrap();
    let r = a.simple(b"BEGIN; SELECT 1/0");
    assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    let r = a.simple(b"DEALLOCATE s2");
    assert_eq!(error_code(&r).as_deref(), Some("25P02"), "{r:?}");
    assert_eq!(tags(&r), Vec::<String>::new(), "{r:?}");
    assert_eq!(
        r.last().map(|(_, b)| b.as_slice()),
        Some(&b"E"[..]),
        "{r:?}"
    );
    let r = a.simple(b"ROLLBACK");
    assert_eq!(error_code(&r), None, "{r:?}");
    holder.batch_execute("COMMIT").await.unwrap();
    // The DEALLOCATE failed, so, as on PostgreSQL, s2 is still there.
    let mut run = msg_bind_execute(b"s2");
    run.extend_from_slice(MSG_SYNC);
    assert_eq!(value(&a.send(&run)), "2");
    // The same for a statement on the server the transaction is on.
    let r = a.simple(b"BEGIN");
    assert_eq!(error_code(&r), None, "{r:?}");
    assert_eq!(error_code(&a.extended(b"s3", b"SELECT 3")), None);
    let r = a.simple(b"SELECT 1/0");
    assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    let r = a.simple(b"DEALLOCATE s3");
    assert_eq!(error_code(&r).as_deref(), Some("25P02"), "{r:?}");
    assert_eq!(error_code(&a.simple(b"ROLLBACK")), None);
    let mut run = msg_bind_execute(b"s3");
    run.extend_from_slice(MSG_SYNC);
    assert_eq!(value(&a.send(&run)), "3");
    // And one that succeeds drops it.
    let r = a.simple(b"DEALLOCATE s3");
    assert_eq!(tags(&r), ["DEALLOCATE"], "{r:?}");
    assert_eq!(error_code(&a.send(&run)).as_deref(), Some("26000"));
    assert_eq!(value(&a.simple(b"SELECT 'still served'")), "still served");
}

/// `sql` as libpq's PQexecParams sends it, and psycopg in a pipeline:
/// Parse of the unnamed statement, Bind, Describe of the portal,
/// Execute, Sync.
fn msg_exec_params(sql: &[u8]) -> Vec<u8> {
    let mut m = msg_parse(b"", sql);
    m.extend_from_slice(&[b'B', 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 0]);
    m.extend_from_slice(&[b'D', 0, 0, 0, 6, b'P', 0]);
    m.extend_from_slice(&[b'E', 0, 0, 0, 9, 0, 0, 0, 0, 0]);
    m.extend_from_slice(MSG_SYNC);
    m
}

/// The CommandComplete tags among `replies`.
fn tags(replies: &[(u8, Vec<u8>)]) -> Vec<String> {
    replies
        .iter()
        .filter(|(t, _)| *t == b'C')
        .map(|(_, b)| String::from_utf8_lossy(&b[..b.len() - 1]).into_owned())
        .collect()
}

/// `DEALLOCATE name` through the extended protocol (psycopg 3.0 and 3.1,
/// and later ones with a libpq older than 17, evict their statement
/// cache so) drops the client's statement as through a Query: renamed
/// to its server-side name, where the statement is not prepared too
/// (even with its table gone), and forgotten only once it ran: parsed in
/// one transaction and run in another on another server, it drops the
/// statement; failing in an aborted transaction, it leaves it; run a
/// second time, it fails as on PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deallocate_through_the_extended_protocol() {
    let c = TestCluster::builder().replicas(0).start();
    // One worker: idle servers are reused most recent first.
    WORKERS.with(|w| w.set(1));
    let (_engine, p) = pooled(&c, 2).await;
    let addr = p.service_addrs()["read_write"];
    let direct = client(&c.conninfo(0)).await.unwrap();
    let holder = client(&via(&p, "read_write")).await.unwrap();
    let mut a = RawClient::connect(addr, "UTF8");
    let dropped = |r: &[(u8, Vec<u8>)], what: &str| {
        assert_eq!(error_code(r), None, "{what}: {r:?}");
        assert_eq!(tags(r), ["DEALLOCATE"], "{what}: {r:?}");
    };
    let gone = |r: &[(u8, Vec<u8>)], name: &str| {
        assert_eq!(error_code(r).as_deref(), Some("26000"), "{name}: {r:?}");
        assert_eq!(
            error_message(r),
            Some(format!("prepared statement \"{name}\" does not exist"))
        );
    };

    // On the server the statement is prepared on.
    assert_eq!(error_code(&a.extended(b"s1", b"SELECT 1")), None);
    dropped(&a.send(&msg_exec_params(b"DEALLOCATE s1")), "same server");
    gone(&a.send(&msg_run(b"s1")), "s1");

    // On another server, the statement's table gone meanwhile.
    direct
        .batch_execute("CREATE TABLE dropped_later (v int)")
        .await
        .unwrap();
    let r = a.extended(b"s2", b"SELECT count(*) FROM dropped_later");
    assert_eq!(error_code(&r), None, "{r:?}");
    holder.batch_execute("BEGIN").await.unwrap();
    direct
        .batch_execute("DROP TABLE dropped_later")
        .await
        .unwrap();
    let r = a.send(&msg_exec_params(b"DEALLOCATE PREPARE s2"));
    dropped(&r, "another server");
    holder.batch_execute("COMMIT").await.unwrap();
    gone(&a.send(&msg_run(b"s2")), "s2");

    // Parsed in one transaction, run in another on another server.
    assert_eq!(error_code(&a.extended(b"s3", b"SELECT 3")), None);
    let mut parse = msg_parse(b"", b"DEALLOCATE s3");
    parse.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&a.send(&parse)), None);
    holder.batch_execute("BEGIN").await.unwrap();
    dropped(&a.send(&msg_run(b"")), "run later");
    holder.batch_execute("COMMIT").await.unwrap();
    gone(&a.send(&msg_run(b"s3")), "s3");

    // In an aborted transaction it fails, and the statement stays.
    assert_eq!(error_code(&a.extended(b"s4", b"SELECT 4")), None);
    let r = a.simple(b"BEGIN; SELECT 1/0");
    assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    let r = a.send(&msg_exec_params(b"DEALLOCATE s4"));
    assert_eq!(error_code(&r).as_deref(), Some("25P02"), "{r:?}");
    assert_eq!(error_code(&a.simple(b"ROLLBACK")), None);
    assert_eq!(value(&a.send(&msg_run(b"s4"))), "4");
    // The same on another server than the statement's.
    holder.batch_execute("BEGIN").await.unwrap();
    let r = a.simple(b"BEGIN; SELECT 1/0");
    assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    let r = a.send(&msg_exec_params(b"DEALLOCATE s4"));
    assert_eq!(error_code(&r).as_deref(), Some("25P02"), "{r:?}");
    assert_eq!(error_code(&a.simple(b"ROLLBACK")), None);
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(value(&a.send(&msg_run(b"s4"))), "4");

    // Bound to a portal in one batch, run in a later one of the same
    // transaction on a server that lacks the statement: after an error
    // it fails and the statement stays; otherwise it drops it.
    assert_eq!(error_code(&a.extended(b"s5", b"SELECT 5")), None);
    let mut bind = msg_parse(b"", b"DEALLOCATE s5");
    bind.extend_from_slice(&[b'B', 0, 0, 0, 13, b'p', 0, 0, 0, 0, 0, 0, 0, 0]);
    bind.extend_from_slice(MSG_SYNC);
    let mut execute = vec![b'E', 0, 0, 0, 10, b'p', 0, 0, 0, 0, 0];
    execute.extend_from_slice(MSG_SYNC);
    for fail in [true, false] {
        holder.batch_execute("BEGIN").await.unwrap();
        assert_eq!(error_code(&a.simple(b"BEGIN")), None);
        assert_eq!(error_code(&a.send(&bind)), None);
        if fail {
            let r = a.simple(b"SELECT 1/0");
            assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
            let r = a.send(&execute);
            assert_eq!(error_code(&r).as_deref(), Some("25P02"), "{r:?}");
        } else {
            dropped(&a.send(&execute), "bound earlier");
        }
        assert_eq!(error_code(&a.simple(b"COMMIT")), None);
        holder.batch_execute("COMMIT").await.unwrap();
        if fail {
            assert_eq!(value(&a.send(&msg_run(b"s5"))), "5");
        } else {
            gone(&a.send(&msg_run(b"s5")), "s5");
        }
    }

    // A named DEALLOCATE statement, run twice: the second finds nothing.
    let mut parse = msg_parse(b"d", b"DEALLOCATE s4");
    parse.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&a.send(&parse)), None);
    dropped(&a.send(&msg_run(b"d")), "named");
    gone(&a.send(&msg_run(b"d")), "s4");
    gone(&a.send(&msg_run(b"s4")), "s4");

    // Both servers still serve, with nothing left over: a name used
    // again gets its new statement everywhere.
    for round in 0..2 {
        let r = a.extended(b"s1", format!("SELECT {round}").as_bytes());
        assert_eq!(values(&r), [round.to_string()], "{r:?}");
        holder.batch_execute("BEGIN").await.unwrap();
        assert_eq!(values(&a.send(&msg_run(b"s1"))), [round.to_string()]);
        holder.batch_execute("COMMIT").await.unwrap();
        dropped(&a.send(&msg_exec_params(b"DEALLOCATE s1")), "again");
    }
    assert_eq!(value(&a.simple(b"SELECT 'still served'")), "still served");
}

/// psycopg 3 dropping statements from its cache with DEALLOCATE inside
/// pipelines, through the extended protocol, as psycopg 3.0 and 3.1 (and
/// later ones with a libpq older than 17) do: clients with a cache of two
/// on a pool of two (tests/clients/psycopg_deallocate.py). No error in
/// the clients, none in the server's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg_drops_cached_statements_with_deallocate_in_pipelines() {
    on_a_pool_of_two(
        |port| common::python_client("psycopg_deallocate.py", vec![port.to_string()]),
        Some(&[]),
    )
    .await;
}

/// A pool of one server in front of `c`'s primary through a relay (to
/// delay the server's answers), a table `table` on it, and two clients
/// whose `application_name` differ, the server last used by `a`: `b`'s
/// next statement needs its name set on the server first.
struct SyncRig {
    relay: pgwarden_testkit::Relay,
    e: pgwarden_probe::Engine,
    p: pgwarden_proxy::Proxy,
    direct: String,
    a: tokio_postgres::Client,
    b: tokio_postgres::Client,
}

/// Waits until the server of a [`SyncRig`] has run the SET of `b`'s
/// application_name (its answer may still be on its way).
async fn b_is_being_set(direct: &str) {
    pgwarden_testkit::eventually("b's application_name is being set", WAIT, || async {
        let q = "SELECT count(*) FROM pg_stat_activity \
                 WHERE query LIKE '%application_name%second%' AND pid <> pg_backend_pid()";
        if sql_value(direct, q).await.as_deref() == Some("1") {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;
}

async fn sync_rig(c: &TestCluster, table: &str) -> SyncRig {
    let (relay, e, p) = behind_relay(c, pool(1, WAIT)).await;
    let direct = c.conninfo(0);
    client(&direct)
        .await
        .unwrap()
        .batch_execute(&format!("CREATE TABLE {table} (x text)"))
        .await
        .unwrap();
    let rw = via(&p, "read_write");
    let a = client(&format!("{rw} application_name=first"))
        .await
        .unwrap();
    let b = client(&format!("{rw} application_name=second"))
        .await
        .unwrap();
    one(&a, "SELECT 1").await;
    SyncRig {
        relay,
        e,
        p,
        direct,
        a,
        b,
    }
}

/// A cancel request that comes while pgwarden sets the client's session
/// parameters on the server it borrowed, before the client's statement
/// goes there, cancels that statement: it never runs, and the client gets
/// 57014, as when cancelled while waiting for a server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_while_parameters_are_set_cancels_the_statement() {
    let c = TestCluster::builder().replicas(0).start();
    let SyncRig {
        relay,
        e: _e,
        p: _p,
        direct,
        a,
        b,
    } = sync_rig(&c, "cancelled_in_sync").await;
    // The server's answers now come late: b's application_name is set
    // on the server, and pgwarden waits for the confirmation.
    relay.set_delay(Duration::ZERO, Duration::from_secs(3));
    let token = b.cancel_token();
    let insert = tokio::spawn(async move {
        b.batch_execute("INSERT INTO cancelled_in_sync VALUES ('ran')")
            .await
    });
    b_is_being_set(&direct).await;
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let err = insert.await.unwrap().unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("57014"), "{err}");
    relay.set_delay(Duration::ZERO, Duration::ZERO);
    assert_eq!(
        sql_value(&direct, "SELECT count(*) FROM cancelled_in_sync")
            .await
            .as_deref(),
        Some("0"),
        "the cancelled statement ran"
    );
    // The server went back to the pool: a runs on it.
    one(&a, "SELECT 1").await;
}

/// The admin console's PAUSE waits for a transaction whose server was
/// taken before the pause, also while pgwarden is still setting the
/// client's session parameters on it (no statement of the client's has
/// reached the server yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_waits_for_a_transaction_still_setting_its_parameters() {
    let c = TestCluster::builder().replicas(0).start();
    let SyncRig {
        relay,
        e: _e,
        p,
        direct,
        a: _a,
        b,
    } = sync_rig(&c, "paused_in_sync").await;
    let rw = via(&p, "read_write");
    let admin = client(&rw.replace("dbname=postgres", "dbname=pgwarden"))
        .await
        .unwrap();
    relay.set_delay(Duration::ZERO, Duration::from_secs(2));
    let insert = tokio::spawn(async move {
        b.batch_execute("INSERT INTO paused_in_sync VALUES ('ran')")
            .await
    });
    b_is_being_set(&direct).await;
    let mut pausing = tokio::spawn(async move {
        admin.simple_query("PAUSE read_write").await.unwrap();
        admin
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut pausing)
            .await
            .is_err(),
        "PAUSE answered with a transaction about to run"
    );
    insert
        .await
        .unwrap()
        .expect("taken before the pause, it runs");
    let admin = tokio::time::timeout(WAIT, pausing)
        .await
        .expect("PAUSE answered once it ended")
        .unwrap();
    relay.set_delay(Duration::ZERO, Duration::ZERO);
    admin.simple_query("RESUME read_write").await.unwrap();
    assert_eq!(
        sql_value(&direct, "SELECT count(*) FROM paused_in_sync")
            .await
            .as_deref(),
        Some("1")
    );
}

/// A cancel request still on its way to the server when the client's query
/// ends must not cancel the next client's query on that server: the server
/// goes back to the pool only once the request is delivered. The relay
/// holds the forwarded request (a slow postmaster) while the first query
/// ends and the next client asks for the server; advisory locks held by a
/// direct connection decide when each query may end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_cancel_request_does_not_cancel_the_next_clients_query() {
    let c = TestCluster::builder().replicas(0).start();
    let (relay, _e, p) = behind_relay(&c, pool(1, WAIT)).await;
    let direct = c.conninfo(0);
    let locks = client(&direct).await.unwrap();
    locks
        .batch_execute("SELECT pg_advisory_lock(1), pg_advisory_lock(2)")
        .await
        .unwrap();
    let a = client(&via(&p, "read_write")).await.unwrap();
    let b = client(&via(&p, "read_write")).await.unwrap();
    let blocked = |query: &'static str| {
        let direct = direct.clone();
        async move {
            let q = format!(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query = '{query}'"
            );
            sql_value(&direct, &q).await.as_deref() == Some("1")
        }
    };
    let token = a.cancel_token();
    const A: &str = "SELECT pg_advisory_xact_lock(1)";
    const B: &str = "SELECT pg_advisory_xact_lock(2)";
    let first = tokio::spawn(async move { a.simple_query(A).await.map(|_| ()) });
    pgwarden_testkit::eventually("a's query runs", WAIT, || async {
        if blocked(A).await {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;
    relay.set_hold_new(true);
    let before = relay.connections();
    let cancel = tokio::spawn(async move { token.cancel_query(tokio_postgres::NoTls).await });
    pgwarden_testkit::eventually("the cancel request reaches the relay", WAIT, || async {
        if relay.connections() > before {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;
    // The request is held: a's query ends on its own.
    locks
        .batch_execute("SELECT pg_advisory_unlock(1)")
        .await
        .unwrap();
    first.await.unwrap().expect("a's query was not cancelled");
    let second = tokio::spawn(async move { b.simple_query(B).await.map(|_| ()) });
    let http = p.http_addr().unwrap();
    let waiting = || common::metric_sample(http, "pgwarden_pool_clients_waiting{");
    pgwarden_testkit::eventually("b waits for the server, or runs on it", WAIT, || async {
        if waiting().await == 1.0 || blocked(B).await {
            Ok(())
        } else {
            Err("neither yet".into())
        }
    })
    .await;
    // The server is held back while the request is on its way.
    assert!(
        !blocked(B).await,
        "b runs on the server the request is headed for"
    );
    assert_eq!(waiting().await, 1.0);
    relay.set_hold_new(false);
    cancel.await.unwrap().unwrap();
    locks
        .batch_execute("SELECT pg_advisory_unlock(2)")
        .await
        .unwrap();
    let r = tokio::time::timeout(WAIT, second).await.unwrap().unwrap();
    assert!(r.is_ok(), "b's query was cancelled: {r:?}");
}

/// A cancel request for a client that waits for a server (the pool is
/// busy) cancels the statement it queued: the client gets 57014 at once,
/// as from PostgreSQL, and the statement never runs; the client goes on
/// normally. (PgBouncer drops such a request; the statement runs later.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_request_cancels_a_statement_waiting_for_a_server() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 1).await;
    let direct = c.conninfo(0);
    common::sql(&direct, "CREATE TABLE queued (v int)").await;
    let addr = p.service_addrs()["read_write"];
    let http = p.http_addr().unwrap();
    let waiting = |n: f64| {
        pgwarden_testkit::eventually("clients waiting", WAIT, move || async move {
            let w = common::metric_sample(http, "pgwarden_pool_clients_waiting{").await;
            if w == n {
                Ok(())
            } else {
                Err(format!("{w} waiting"))
            }
        })
    };
    let cancel = |key: (i32, i32)| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut m = vec![0, 0, 0, 16, 4, 210, 22, 46];
        m.extend_from_slice(&key.0.to_be_bytes());
        m.extend_from_slice(&key.1.to_be_bytes());
        tokio::io::AsyncWriteExt::write_all(&mut s, &m)
            .await
            .unwrap();
        let mut end = Vec::new();
        let _ = tokio::io::AsyncReadExt::read_to_end(&mut s, &mut end).await;
    };
    let holder = client(&via(&p, "read_write")).await.unwrap();
    let a = std::sync::Arc::new(client(&via(&p, "read_write")).await.unwrap());
    let mut raw = RawClient::connect(addr, "UTF8");
    holder.batch_execute("BEGIN").await.unwrap();

    // Simple protocol, then extended (tokio-postgres prepares, then binds).
    for (round, extended) in [(1, false), (2, true)] {
        let token = a.cancel_token();
        let a2 = a.clone();
        let q = tokio::spawn(async move {
            if extended {
                a2.execute("INSERT INTO queued VALUES ($1)", &[&round])
                    .await
                    .map(|_| ())
            } else {
                a2.batch_execute("INSERT INTO queued VALUES (1)").await
            }
        });
        waiting(1.0).await;
        token.cancel_query(tokio_postgres::NoTls).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(10), q)
            .await
            .expect("the cancelled client is answered while the pool is still busy")
            .unwrap();
        let err = r.expect_err("cancelled");
        assert_eq!(sqlstate(&err).as_deref(), Some("57014"), "{err}");
        waiting(0.0).await;
    }

    // A batch whose Sync comes after the cancel (asyncpg prepares with
    // Parse, Describe, Flush): the error comes at once, the rest of the
    // batch is skipped, and its Sync gets ReadyForQuery.
    use std::io::Write;
    let mut batch = msg_parse(b"", b"INSERT INTO queued VALUES (3)");
    batch.extend_from_slice(&[b'D', 0, 0, 0, 6, b'S', 0]);
    batch.extend_from_slice(MSG_FLUSH);
    raw.0.write_all(&batch).unwrap();
    waiting(1.0).await;
    cancel(raw.1).await;
    raw.0.write_all(&msg_bind_execute(b"")).unwrap();
    let r = raw.send(MSG_SYNC);
    let tags: Vec<u8> = r.iter().map(|(t, _)| *t).collect();
    assert_eq!(tags, b"EZ", "{r:?}");
    assert_eq!(error_code(&r).as_deref(), Some("57014"));

    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        sql_value(&direct, "SELECT count(*) FROM queued")
            .await
            .as_deref(),
        Some("0"),
        "a cancelled statement ran"
    );
    assert_eq!(one(&a, "SELECT 7").await, "7");
    let r = raw.simple(b"SELECT 8");
    assert_eq!(error_code(&r), None, "{r:?}");
}

/// Real drivers in numbers on a pool of two: psycopg 3 (pipelines with a
/// failing statement, DISCARD ALL, server-side statements from the first
/// use) and asyncpg (its statement cache on, cursors, COPY, timeouts that
/// cancel), eighteen clients at once. An error no client asked for, or a
/// hang, fails the run (tests/clients/pool_mix.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg_and_asyncpg_clients_share_a_pool_of_two() {
    on_a_pool_of_two(
        |port| common::python_client("pool_mix.py", vec![port.to_string()]),
        None,
    )
    .await;
}

/// Runs a driver program against a transaction pool of two on a fresh
/// one-node cluster (`run` gets the read-write port), then, given
/// `asked_for`, fails unless every ERROR in the server's log is one of
/// those.
async fn on_a_pool_of_two<F, Fut>(run: F, asked_for: Option<&[&str]>)
where
    F: FnOnce(u16) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 2).await;
    run(p.service_addrs()["read_write"].port()).await;
    if let Some(asked_for) = asked_for {
        server_errors_only(&mut c, asked_for);
    }
}

/// The PostgreSQL JDBC driver with its defaults (statements become named
/// server-side statements after five uses) and with server-side statements
/// from the first use, twelve clients on a pool of two: batches (many
/// Bind/Execute, one Sync) committed, rolled back and failing part way,
/// savepoints, cursors read through a named portal in several round trips,
/// query timeouts (cancel requests), read-only transactions, generated
/// keys, DISCARD ALL / DEALLOCATE ALL and metadata queries. An error no
/// client asked for, a wrong count, or a hang fails the run
/// (tests/clients/JdbcMix.java). The driver quietly prepares a statement
/// again when the server says it does not exist, so the server's log is
/// read too: the only errors in it are the ones the clients caused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jdbc_clients_share_a_pool_of_two() {
    on_a_pool_of_two(
        |port| common::java_client("JdbcMix.java", vec![port.to_string(), "12".into()]),
        Some(&[
            "duplicate key value violates unique constraint",
            "division by zero",
            "canceling statement due to user request",
            "cannot execute INSERT in a read-only transaction",
        ]),
    )
    .await;
}

/// Fails unless every ERROR in the server log of node 0 contains one of
/// `asked_for`.
fn server_errors_only(c: &mut TestCluster, asked_for: &[&str]) {
    let log = std::fs::read_to_string(c.node(0).log_path()).unwrap();
    let unexpected: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("ERROR:") && !asked_for.iter().any(|a| l.contains(a)))
        .collect();
    assert!(
        unexpected.is_empty(),
        "errors no client asked for:\n{}",
        unexpected.join("\n")
    );
}

/// PHP clients on a pool of two, one process each: PDO with native
/// prepares (a statement per object, dropped with DEALLOCATE when the
/// object goes, also after its table is gone), transactions with errors,
/// DISCARD ALL / DEALLOCATE ALL; and the pgsql extension reusing a
/// statement name for another query after DEALLOCATE, SQL-level PREPARE,
/// DEALLOCATE of unknown names, and cancelled asynchronous queries
/// (tests/clients/php_mix.php). As with JDBC, the server's log must hold
/// only the errors the clients caused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_clients_share_a_pool_of_two() {
    on_a_pool_of_two(
        |port| common::php_client("php_mix.php", vec![port.to_string(), "12".into()]),
        Some(&[
            "duplicate key value violates unique constraint",
            "canceling statement due to user request",
            "prepared statement \"never_prepared_",
        ]),
    )
    .await;
}

/// node-postgres clients on a pool of two: named statements (parsed once
/// per connection, then only bound, wherever the client lands),
/// transactions with errors, `statement_timeout` from the start-up packet
/// (it must follow the client to every server), several statements in one
/// simple Query, values of 100-200 kB (tests/clients/node_mix.js). As with
/// JDBC, the server's log must hold only the errors the clients caused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_postgres_clients_share_a_pool_of_two() {
    on_a_pool_of_two(
        |port| common::node_client("node_mix.js", vec![port.to_string(), "12".into()]),
        Some(&[
            "duplicate key value violates unique constraint",
            "current transaction is aborted",
            "canceling statement due to statement timeout",
            "division by zero",
        ]),
    )
    .await;
}

/// All four driver programs at once on one pool of two (fewer clients
/// each): one driver's DISCARD ALL, DEALLOCATE or cancel lands on servers
/// that the others' statements live on, and none of them may notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_driver_at_once_on_a_pool_of_two() {
    on_a_pool_of_two(
        |port| async move {
            let args = || vec![port.to_string(), "4".into()];
            tokio::join!(
                common::python_client("pool_mix.py", vec![port.to_string()]),
                common::java_client("JdbcMix.java", args()),
                common::php_client("php_mix.php", args()),
                common::node_client("node_mix.js", args()),
            );
        },
        Some(&[
            "duplicate key value violates unique constraint",
            "division by zero",
            "canceling statement due to user request",
            "canceling statement due to statement timeout",
            "current transaction is aborted",
            "cannot execute INSERT in a read-only transaction",
            "prepared statement \"never_prepared_",
        ]),
    )
    .await;
}

/// Start-up settings beyond the tracked parameters (`options=-c ...`, or
/// parameters such as `extra_float_digits`, which JDBC sends) follow the
/// client from server to server in transaction pooling and never reach
/// clients that did not ask for them; one PostgreSQL refuses, or one
/// pooling cannot honour, refuses the login.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_settings_follow_the_client_and_stay_its_own() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 1).await;
    let direct = c.conninfo(0);
    common::sql(
        &direct,
        "CREATE SCHEMA s1; CREATE TABLE s1.t (v int); CREATE TABLE public.t (v int)",
    )
    .await;
    let default = |name: &'static str| {
        let direct = direct.clone();
        async move { sql_value(&direct, &format!("SHOW {name}")).await.unwrap() }
    };
    let url = via(&p, "read_write");
    let a = client(&format!(
        "{url} options='-c search_path=s1,public -c work_mem=7MB'"
    ))
    .await
    .unwrap();
    let b = client(&url).await.unwrap();
    let mut raw = RawClient::connect_with(
        p.service_addrs()["read_write"],
        &[
            ("user", "postgres"),
            ("database", "postgres"),
            ("extra_float_digits", "-1"),
        ],
    );
    // One server: each client's turn finds the previous one's settings.
    for _ in 0..2 {
        assert_eq!(one(&a, "SHOW search_path").await, "s1,public");
        assert_eq!(one(&a, "SHOW work_mem").await, "7MB");
        a.batch_execute("INSERT INTO t VALUES (1)").await.unwrap();
        assert_eq!(value(&raw.simple(b"SHOW extra_float_digits")), "-1");
        assert_eq!(
            one(&b, "SHOW search_path").await,
            default("search_path").await
        );
        assert_eq!(one(&b, "SHOW work_mem").await, default("work_mem").await);
        assert_eq!(
            one(&b, "SHOW extra_float_digits").await,
            default("extra_float_digits").await
        );
    }
    assert_eq!(
        sql_value(&direct, "SELECT count(*) FROM s1.t")
            .await
            .as_deref(),
        Some("2")
    );
    assert_eq!(
        sql_value(&direct, "SELECT count(*) FROM public.t")
            .await
            .as_deref(),
        Some("0")
    );
    // Refused as PostgreSQL refuses it...
    let err = client(&format!("{url} options='-c no_such_setting=1'"))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("42704"), "{err}");
    // ...or because pooling cannot honour it.
    let err = client(&format!("{url} options='-B 100'"))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("0A000"), "{err}");
    assert_eq!(one(&b, "SELECT 1").await, "1");
    assert_eq!(one(&a, "SHOW search_path").await, "s1,public");
}

/// Start-up values reach a shared server as values, never as SQL. A
/// client may turn `standard_conforming_strings` off; a backslash in one
/// of its values must not then end pgwarden's quoted literal early and run
/// the rest, here to make the read-only service's server read-write for
/// this client and the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_values_stay_values_whatever_the_quoting_rules() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 1).await;
    common::sql(&c.conninfo(0), "CREATE TABLE w (v int)").await;
    // No replica: the read-only service falls back to the primary.
    let ro = p.service_addrs()["read_only"];
    let setting = r"\', false); SET default_transaction_read_only TO off; --";
    let app = r"a\'; SET default_transaction_read_only TO off; --";
    // The first client leaves the one server with backslash escapes on;
    // the second's values are then set on it (set_config for its own
    // setting, SET for its application_name).
    for (i, name) in ["plain", app].into_iter().enumerate() {
        let mut raw = RawClient::connect_with(
            ro,
            &[
                ("user", "postgres"),
                ("database", "postgres"),
                ("standard_conforming_strings", "off"),
                ("application_name", name),
                ("pgw.setting", setting),
            ],
        );
        assert_eq!(
            value(&raw.simple(b"SHOW pgw.setting")),
            setting,
            "client {i}"
        );
        assert_eq!(
            value(&raw.simple(b"SHOW application_name")),
            name,
            "client {i}"
        );
        assert_eq!(
            error_code(&raw.simple(b"INSERT INTO w VALUES (1)")).as_deref(),
            Some("25006"),
            "client {i}"
        );
    }
    let next = client(&via(&p, "read_only")).await.unwrap();
    assert_eq!(one(&next, "SHOW default_transaction_read_only").await, "on");
    let err = next
        .simple_query("INSERT INTO w VALUES (2)")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("25006"), "{err}");
}

/// The ParameterStatus values among `replies`, by name.
fn parameter_statuses(replies: &[(u8, Vec<u8>)]) -> Vec<(String, String)> {
    replies
        .iter()
        .filter(|(t, _)| *t == b'S')
        .map(|(_, b)| {
            let mut parts = b.split(|c| *c == 0);
            let mut next = || String::from_utf8_lossy(parts.next().unwrap()).into_owned();
            (next(), next())
        })
        .collect()
}

/// A tracked parameter given at start-up under another spelling (libpq
/// sends `timezone` and `datestyle` for PGTZ and PGDATESTYLE, pgx sends
/// `timezone`) or in `options` is the client's for its whole session, as
/// on PostgreSQL: the greeting reports what PostgreSQL's reports, and
/// every transaction runs with it, on whichever server it lands, with
/// other clients' transactions in between; so does a value it SETs
/// later. A value PostgreSQL refuses refuses the login, as there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracked_parameters_in_any_spelling_or_in_options_stay_the_clients() {
    let c = TestCluster::builder().replicas(0).start();
    // One worker: idle servers are reused most recent first, so that the
    // holders below send each turn to another server.
    WORKERS.with(|w| w.set(1));
    let (_e, p) = pooled(&c, 3).await;
    let rw = p.service_addrs()["read_write"];
    let direct: std::net::SocketAddr = c.addr(0).parse().unwrap();
    let others = [
        client(&via(&p, "read_write")).await.unwrap(),
        client(&via(&p, "read_write")).await.unwrap(),
    ];
    let zone = one(&others[0], "SHOW TimeZone").await;
    let base = [("user", "postgres"), ("database", "postgres")];
    let lower = [("timezone", "Asia/Tokyo"), ("datestyle", "German")];
    let options = [(
        "options",
        "-c TimeZone=America/Lima -c intervalstyle=iso_8601",
    )];
    const SHOWN: [&str; 3] = ["TimeZone", "DateStyle", "IntervalStyle"];
    let mut clients = Vec::new();
    for asked in [&lower[..], &options[..]] {
        let params: Vec<(&str, &str)> = base.iter().chain(asked).copied().collect();
        let (_, postgres) = RawClient::greeted(direct, &params);
        let (client, pooled) = RawClient::greeted(rw, &params);
        assert_eq!(error_code(&pooled), None, "{pooled:?}");
        // The values PostgreSQL reports (`German, DMY` for `German`).
        let mut expected: Vec<(String, String)> = parameter_statuses(&postgres)
            .into_iter()
            .filter(|(k, _)| SHOWN.contains(&k.as_str()))
            .collect();
        expected.sort();
        assert_ne!(
            expected.iter().find(|(k, _)| k == "TimeZone").unwrap().1,
            zone
        );
        let mut greeted: Vec<(String, String)> = parameter_statuses(&pooled)
            .into_iter()
            .filter(|(k, _)| SHOWN.contains(&k.as_str()))
            .collect();
        greeted.sort();
        assert_eq!(greeted, expected, "{asked:?}");
        clients.push((client, expected));
    }
    let servers = tracked_turns(&mut clients, &others, &zone, 6).await;
    assert!(servers.len() > 1, "one server for all: {servers:?}");
    // A SET of a parameter the client gave in `options` lasts too.
    let (opts, expected) = &mut clients[1];
    let r = opts.simple(b"SET TimeZone = 'Africa/Lagos'");
    assert_eq!(error_code(&r), None, "{r:?}");
    expected
        .iter_mut()
        .find(|(k, _)| k == "TimeZone")
        .unwrap()
        .1 = "Africa/Lagos".into();
    let servers = tracked_turns(&mut clients, &others, &zone, 3).await;
    assert!(servers.len() > 1, "one server for all: {servers:?}");
    // Refused as PostgreSQL refuses it.
    for bad in [
        ("timezone", "No/Such_Zone"),
        ("options", "-c TimeZone=No/Such_Zone"),
    ] {
        let params: Vec<(&str, &str)> = base.iter().chain([&bad]).copied().collect();
        let (_, postgres) = RawClient::greeted(direct, &params);
        let (_, pooled) = RawClient::greeted(rw, &params);
        assert_eq!(
            error_code(&postgres).as_deref(),
            Some("22023"),
            "{postgres:?}"
        );
        assert_eq!(error_code(&pooled), error_code(&postgres), "{pooled:?}");
        assert_eq!(error_message(&pooled), error_message(&postgres));
    }
}

/// `rounds` turns of each of `clients`, two transactions each, checking
/// that they see the TimeZone, DateStyle and IntervalStyle the client
/// expects and get no ParameterStatus; before each turn, 0, 1 or 2 of
/// `others` hold a server, so that with servers reused most recent first
/// the turns land on different ones. `others` must see `zone`. The
/// servers (backend pids) the clients' transactions ran on.
async fn tracked_turns(
    clients: &mut [(RawClient, Vec<(String, String)>)],
    others: &[tokio_postgres::Client],
    zone: &str,
    rounds: usize,
) -> std::collections::HashSet<String> {
    let query = b"SELECT current_setting('TimeZone') UNION ALL SELECT current_setting('DateStyle') \
                  UNION ALL SELECT current_setting('IntervalStyle') \
                  UNION ALL SELECT pg_backend_pid()::text" as &[u8];
    let mut servers = std::collections::HashSet::new();
    for round in 0..rounds {
        for (client, expected) in clients.iter_mut() {
            let held = &others[..round % 3];
            for other in held {
                other.batch_execute("BEGIN").await.unwrap();
            }
            let want: Vec<&str> = ["TimeZone", "DateStyle", "IntervalStyle"]
                .iter()
                .map(|name| {
                    expected
                        .iter()
                        .find(|(k, _)| k == name)
                        .map_or("", |(_, v)| v.as_str())
                })
                .collect();
            // Two in a row: the second most likely on the server the
            // first left with the client's settings.
            for _ in 0..2 {
                let r = client.simple(query);
                let got = values(&r);
                assert_eq!(got[..3], want[..], "round {round}: {r:?}");
                assert!(parameter_statuses(&r).is_empty(), "round {round}: {r:?}");
                servers.insert(got[3].clone());
            }
            for other in held {
                other.batch_execute("COMMIT").await.unwrap();
                // Theirs are the server's defaults all along.
                assert_eq!(one(other, "SHOW TimeZone").await, zone);
            }
        }
    }
    servers
}

/// A client asking for a newer protocol minor version (libpq 18 can ask
/// for 3.2) or for protocol options learns, as from PostgreSQL, that the
/// pool speaks 3.0 and knows none of them (NegotiateProtocolVersion before
/// the login), instead of believing it got them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_clients_asking_for_a_newer_protocol_are_told_3_0() {
    use std::io::Write;
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 2).await;
    for (minor, option) in [(2u16, None), (0, Some("_pq_.foo")), (2, Some("_pq_.foo"))] {
        let mut body = 3u16.to_be_bytes().to_vec();
        body.extend_from_slice(&minor.to_be_bytes());
        for (k, v) in [("user", "postgres"), ("database", "postgres")]
            .into_iter()
            .chain(option.map(|o| (o, "1")))
        {
            body.extend_from_slice(k.as_bytes());
            body.push(0);
            body.extend_from_slice(v.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut s = std::net::TcpStream::connect(p.service_addrs()["read_write"]).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(&((body.len() + 4) as u32).to_be_bytes())
            .unwrap();
        s.write_all(&body).unwrap();
        let mut c = RawClient(s, (0, 0));
        let greeting = c.until_ready();
        let (tag, v) = &greeting[0];
        assert_eq!(*tag, b'v', "{greeting:?}");
        // Protocol 3.0, written as PostgreSQL writes it.
        let mut want = vec![0, 3, 0, 0];
        want.extend_from_slice(&(option.is_some() as u32).to_be_bytes());
        if let Some(o) = option {
            want.extend_from_slice(o.as_bytes());
            want.push(0);
        }
        assert_eq!(v, &want);
        assert!(greeting.iter().all(|(t, _)| *t != b'E'), "{greeting:?}");
        assert_eq!(value(&c.simple(b"SELECT 1")), "1");
    }
}

/// An idle pooled server connection whose backend went away (here
/// `pg_terminate_backend`; `idle_session_timeout` or a restart alike) is
/// noticed when a client next borrows a server: the client's statement runs
/// on a live connection instead of getting the dead one's FATAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_server_that_went_away_is_not_handed_out() {
    let c = TestCluster::builder().replicas(0).start();
    let (_engine, p) = pooled(&c, 1).await;
    let direct = c.conninfo(0);
    let a = client(&via(&p, "read_write")).await.unwrap();
    for round in 0..2 {
        let pid = one(&a, "SELECT pg_backend_pid()").await;
        let q = format!("SELECT pg_terminate_backend({pid})");
        assert_eq!(sql_value(&direct, &q).await.as_deref(), Some("t"));
        let gone = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}");
        pgwarden_testkit::eventually("the backend exits", WAIT, || {
            let (direct, gone) = (direct.clone(), gone.clone());
            async move {
                match sql_value(&direct, &gone).await.as_deref() {
                    Some("0") => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        })
        .await;
        let next = a
            .simple_query("SELECT pg_backend_pid()")
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let new_pid = next.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0),
            _ => None,
        });
        assert_ne!(new_pid, Some(pid.as_str()), "round {round}");
    }
}

/// A result of more than 64 MiB streams through the transaction pool
/// while the pool's other client keeps being served, pipelined queries
/// included: the session loop leaves a socket unpolled only while its
/// waker is registered there with nothing to read, and must read on as
/// soon as bytes come (a stall here shows as a time-out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_results_stream_through_the_pool_while_others_are_served() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled(&c, 2).await;
    let big = client(&via(&p, "read_write")).await.unwrap();
    let small = std::sync::Arc::new(client(&via(&p, "read_write")).await.unwrap());
    let streaming = async {
        for round in 0..2 {
            let msgs = big
                .simple_query("SELECT g, repeat('x', 1000) FROM generate_series(1, 70000) g")
                .await
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            let mut rows = 0usize;
            let mut bytes = 0usize;
            for m in &msgs {
                if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                    rows += 1;
                    assert_eq!(r.get(0), Some(rows.to_string().as_str()));
                    bytes += r.get(1).map_or(0, str::len);
                }
            }
            assert_eq!((rows, bytes), (70_000, 70_000_000), "round {round}");
        }
    };
    let served = async {
        for batch in 0..20i32 {
            let tasks: Vec<_> = (0..25i32)
                .map(|i| {
                    let small = small.clone();
                    tokio::spawn(async move {
                        let n = batch * 100 + i;
                        let row = small.query_one("SELECT $1::int4 * 2", &[&n]).await.unwrap();
                        assert_eq!(row.get::<_, i32>(0), n * 2);
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            assert_eq!(one(&small, "SELECT 'simple'").await, "simple");
        }
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        tokio::join!(streaming, served)
    })
    .await
    .expect("the big result and the other client's queries finish");
}

/// The first column of every row among `replies`, in order.
fn values(replies: &[(u8, Vec<u8>)]) -> Vec<String> {
    replies
        .iter()
        .filter(|(t, _)| *t == b'D')
        .map(|(_, row)| {
            let len = i32::from_be_bytes(row[2..6].try_into().unwrap());
            String::from_utf8_lossy(&row[6..6 + len as usize]).into_owned()
        })
        .collect()
}

/// The message of the first ErrorResponse among `replies`.
fn error_message(replies: &[(u8, Vec<u8>)]) -> Option<String> {
    let (_, body) = replies.iter().find(|(t, _)| *t == b'E')?;
    body.split(|b| *b == 0)
        .find(|f| f.first() == Some(&b'M'))
        .map(|f| String::from_utf8_lossy(&f[1..]).into_owned())
}

/// Bind of statement `name` and Execute, then Sync.
fn msg_run(name: &[u8]) -> Vec<u8> {
    let mut m = msg_bind_execute(name);
    m.extend_from_slice(MSG_SYNC);
    m
}

/// A client that did not ask for a DateStyle or TimeZone has the server's
/// defaults, not the values the last client of its server connection set:
/// with a DateStyle of `DMY` left behind, '03/04/2026' would be read as
/// the 3rd of April. In the transaction pool, and with session pooling,
/// where server connections used to start with the first client's own
/// start-up values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gets_the_servers_defaults_not_the_last_clients_settings() {
    let c = TestCluster::builder().replicas(0).start();
    let direct = format!("host=127.0.0.1 port={} user=postgres", c.port(0));
    let zone = sql_value(&direct, "SHOW TimeZone").await.unwrap();
    assert_ne!(zone, "Pacific/Kiritimati");
    let check = |r: &[(u8, Vec<u8>)], what: &str| {
        assert_eq!(
            values(r),
            ["2026-03-04", "ISO, MDY", zone.as_str()],
            "{what}: {r:?}"
        );
    };
    let query = b"SELECT '03/04/2026'::date::text UNION ALL SELECT current_setting('DateStyle') \
                  UNION ALL SELECT current_setting('TimeZone')" as &[u8];
    for session_pooling in [false, true] {
        let (_e, p) = if session_pooling {
            session_pooling_proxy(
                &c,
                PoolSettings {
                    size: 1,
                    query_wait_timeout: WAIT,
                    ..PoolSettings::default()
                },
            )
            .await
        } else {
            pooled(&c, 1).await
        };
        let rw = p.service_addrs()["read_write"];
        // One server connection: every client lands on it.
        let mut a = RawClient::connect_with(
            rw,
            &[
                ("user", "postgres"),
                ("database", "postgres"),
                ("DateStyle", "German"),
                ("TimeZone", "Asia/Tokyo"),
            ],
        );
        let r = a.simple(b"SET DateStyle = 'ISO, DMY'; SET TimeZone = 'Pacific/Kiritimati'");
        assert_eq!(error_code(&r), None, "{r:?}");
        drop(a);
        let mut b = RawClient::connect(rw, "UTF8");
        check(&b.simple(query), "a new client");
        // A DISCARD ALL (RESET ALL) returns to the same defaults.
        let r = b.simple(b"SET DateStyle = 'ISO, DMY'");
        assert_eq!(error_code(&r), None, "{r:?}");
        let r = b.simple(b"DISCARD ALL");
        assert_eq!(error_code(&r), None, "{r:?}");
        check(&b.simple(query), "after DISCARD ALL");
    }
}

/// The unnamed statement is the client's own: one parsed in an earlier
/// transaction is still there when bound later, whichever server the
/// Bind lands on, and a client that parsed none gets 26000, never
/// another client's statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unnamed_statement_never_crosses_clients() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled(&c, 1).await;
    let rw = p.service_addrs()["read_write"];
    let (mut a, mut b, mut other) = (
        RawClient::connect(rw, "UTF8"),
        RawClient::connect(rw, "UTF8"),
        RawClient::connect(rw, "UTF8"),
    );
    let mut parse = msg_parse(b"", b"SELECT 'a-secret'");
    parse.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&a.send(&parse)), None);
    // The one server's unnamed statement is now this client's.
    let mut parse = msg_parse(b"", b"SELECT 'other'");
    parse.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&other.send(&parse)), None);
    assert_eq!(values(&a.send(&msg_run(b""))), ["a-secret"]);
    let r = b.send(&msg_run(b""));
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
    assert_eq!(values(&other.send(&msg_run(b""))), ["other"]);
    // Described, too.
    let mut describe = vec![b'D', 0, 0, 0, 6, b'S', 0];
    describe.extend_from_slice(MSG_SYNC);
    let r = b.send(&describe);
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
    let r = a.send(&describe);
    assert_eq!(error_code(&r), None, "{r:?}");
    // A failed unnamed Parse leaves the client none, as on PostgreSQL.
    let mut bad = msg_parse(b"", b"SELEC 1");
    bad.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&a.send(&bad)).as_deref(), Some("42601"));
    let r = a.send(&msg_run(b""));
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
    // A simple Query drops the unnamed statement, as PostgreSQL's does:
    // not parsed again for a later Bind.
    let mut parse = msg_parse(b"", b"SELECT 'dropped'");
    parse.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&a.send(&parse)), None);
    assert_eq!(error_code(&a.send(&msg_query(b"SELECT 1"))), None);
    let r = a.send(&msg_run(b""));
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
}

/// Named statements answer as PostgreSQL does: a name in use is refused
/// (42P05) and keeps its statement; a statement whose Parse failed does
/// not exist (26000, under the client's name); a Close that an earlier
/// error made the server skip leaves the statement in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_names_are_refused_and_kept_as_postgres_does() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled(&c, 2).await;
    let rw = p.service_addrs()["read_write"];
    let mut a = RawClient::connect(rw, "UTF8");
    let holder = client(&via(&p, "read_write")).await.unwrap();
    assert_eq!(value(&a.extended(b"s1", b"SELECT 1")), "1");
    for elsewhere in [false, true] {
        if elsewhere {
            // s1 is not prepared on the other server yet.
            holder.batch_execute("BEGIN").await.unwrap();
            one(&holder, "SELECT 1").await;
        }
        let mut again = msg_parse(b"s1", b"SELECT 2");
        again.extend_from_slice(MSG_SYNC);
        let r = a.send(&again);
        assert_eq!(error_code(&r).as_deref(), Some("42P05"), "{r:?}");
        assert_eq!(
            error_message(&r).as_deref(),
            Some("prepared statement \"s1\" already exists")
        );
        assert_eq!(values(&a.send(&msg_run(b"s1"))), ["1"]);
        if elsewhere {
            holder.batch_execute("COMMIT").await.unwrap();
        }
    }
    let mut bad = msg_parse(b"s3", b"SELEC 3");
    bad.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&a.send(&bad)).as_deref(), Some("42601"));
    let r = a.send(&msg_run(b"s3"));
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
    assert_eq!(
        error_message(&r).as_deref(),
        Some("prepared statement \"s3\" does not exist")
    );
    // An error first: the server skips the Close of s1.
    let mut batch = msg_parse(b"", b"SELECT 1/0");
    batch.extend(msg_bind_execute(b""));
    batch.extend_from_slice(&[b'C', 0, 0, 0, 8, b'S', b's', b'1', 0]);
    batch.extend_from_slice(MSG_SYNC);
    assert_eq!(error_code(&a.send(&batch)).as_deref(), Some("22012"));
    assert_eq!(values(&a.send(&msg_run(b"s1"))), ["1"]);
    // And a Close that runs closes it.
    let r = a.send(&[b'C', 0, 0, 0, 8, b'S', b's', b'1', 0, b'S', 0, 0, 0, 4]);
    assert_eq!(error_code(&r), None, "{r:?}");
    let r = a.send(&msg_run(b"s1"));
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
}

/// `COPY ... FROM STDIN` through the extended protocol, as libpq's
/// PQexecParams sends it: PostgreSQL ignores the Sync after the Execute
/// and answers only the one after CopyDone. The server goes back to the
/// pool when the COPY's transaction ends, with the rows committed: on a
/// pool of one, the next client is served at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extended_protocol_copy_gives_its_server_back() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_for(&c, 1, Duration::from_secs(5)).await;
    let other = client(&via(&p, "read_write")).await.unwrap();
    other
        .batch_execute("CREATE TABLE copied (x int, y text)")
        .await
        .unwrap();
    let mut a = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    for round in 0..3 {
        let mut start = msg_parse(b"", b"COPY copied FROM STDIN");
        start.extend(msg_bind_execute(b""));
        start.extend_from_slice(MSG_SYNC);
        std::io::Write::write_all(&mut a.0, &start).unwrap();
        let r = a.until(b'G');
        assert_eq!(error_code(&r), None, "{r:?}");
        let mut data = Vec::new();
        for row in [b"1\tx\n" as &[u8], b"2\ty\n"] {
            data.push(b'd');
            data.extend_from_slice(&((4 + row.len()) as u32).to_be_bytes());
            data.extend_from_slice(row);
        }
        if round == 2 {
            // Rows that fail: the COPY ends with an error, its Sync is
            // answered and nothing of it stays.
            data.extend_from_slice(&[b'd', 0, 0, 0, 8, b'n', b'o', b'\t', b'\n']);
        }
        data.extend_from_slice(&[b'c', 0, 0, 0, 4]);
        data.extend_from_slice(MSG_SYNC);
        let r = a.send(&data);
        if round == 2 {
            assert_eq!(error_code(&r).as_deref(), Some("22P02"), "{r:?}");
        } else {
            assert_eq!(error_code(&r), None, "{r:?}");
        }
        assert_eq!(
            one(&other, "SELECT count(*) FROM copied").await,
            if round == 0 { "2" } else { "4" },
            "round {round}"
        );
    }
    assert_eq!(values(&a.simple(b"SELECT count(*) FROM copied")), ["4"]);
}

/// A message type PostgreSQL does not know ends the client's session with
/// 08P01, as PostgreSQL does, and never reaches a server: forwarded, it
/// would end that server's session, and the pool would lend the dead
/// connection to the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_message_type_ends_only_its_own_client() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled(&c, 1).await;
    let rw = p.service_addrs()["read_write"];
    let b = client(&via(&p, "read_write")).await.unwrap();
    for round in 0..5 {
        let mut a = RawClient::connect(rw, "UTF8");
        assert_eq!(values(&a.simple(b"SELECT 1")), ["1"]);
        std::io::Write::write_all(&mut a.0, &[b'y', 0, 0, 0, 4]).unwrap();
        let r = a.until_error();
        assert_eq!(error_code(&r).as_deref(), Some("08P01"), "{r:?}");
        assert_eq!(
            error_message(&r).as_deref(),
            Some("invalid frontend message type 121")
        );
        // Closed after the error.
        let mut rest = Vec::new();
        let n = std::io::Read::read_to_end(&mut a.0, &mut rest).unwrap();
        assert_eq!(n, 0, "{rest:?}");
        assert_eq!(one(&b, "SELECT 2").await, "2", "round {round}");
    }
    // The admin console too, rather than ignoring every later query.
    let mut admin = RawClient::connect_with(rw, &[("user", "postgres"), ("database", "pgwarden")]);
    std::io::Write::write_all(&mut admin.0, &[b'y', 0, 0, 0, 4]).unwrap();
    let r = admin.until_error();
    assert_eq!(error_code(&r).as_deref(), Some("08P01"), "{r:?}");
    assert_eq!(
        error_message(&r).as_deref(),
        Some("invalid frontend message type 121")
    );
    let mut rest = Vec::new();
    let n = std::io::Read::read_to_end(&mut admin.0, &mut rest).unwrap();
    assert_eq!(n, 0, "{rest:?}");
}

/// `UPDATE pg_settings` is a session-level SET: the client keeps its
/// server, and the next client does not inherit the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_of_pg_settings_pins_the_client() {
    let c = TestCluster::builder().replicas(0).start();
    // One worker: idle servers are reused most recent first.
    WORKERS.with(|w| w.set(1));
    let (_e, p) = pooled(&c, 2).await;
    let a = client(&via(&p, "read_write")).await.unwrap();
    a.batch_execute("UPDATE pg_settings SET setting = '50' WHERE name = 'statement_timeout'")
        .await
        .unwrap();
    for _ in 0..3 {
        let b = client(&via(&p, "read_write")).await.unwrap();
        assert_eq!(one(&b, "SHOW statement_timeout").await, "0");
    }
    assert_eq!(one(&a, "SHOW statement_timeout").await, "50ms");
}

/// Without `[auth]`, pgwarden checks no password itself, so an admin
/// user proves who they are to the primary before the console serves
/// them: the server's authentication exchange is relayed, and its refusal
/// reaches the client. A console that anyone could `SHUTDOWN` would be a
/// hole in a setup that trusts PostgreSQL's pg_hba.conf.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_auth_the_admin_console_asks_the_server_who_you_are() {
    let mut c = TestCluster::builder().replicas(0).start();
    common::sql(
        &format!("host=127.0.0.1 port={} user=postgres", c.port(0)),
        "ALTER ROLE postgres PASSWORD 'console-pw'; CREATE ROLE outsider LOGIN PASSWORD 'outsider-pw'",
    )
    .await;
    // The probe and ordinary sessions stay trusted; the console's database
    // name needs the password.
    c.set_hba(
        0,
        "local all all trust\n\
         host pgwarden all 127.0.0.1/32 scram-sha-256\n\
         host all all 127.0.0.1/32 trust\n",
    );
    let (e, p) = common::proxy(&c.addrs(), Duration::from_secs(3)).await;
    ready(&e, 1).await;
    let console = |password: Option<&str>| {
        let mut conninfo = format!(
            "host=127.0.0.1 port={} user=postgres dbname=pgwarden",
            p.service_addrs()["read_write"].port()
        );
        if let Some(pw) = password {
            conninfo.push_str(&format!(" password={pw}"));
        }
        async move { client(&conninfo).await }
    };
    assert!(console(None).await.is_err(), "no password");
    let Err(wrong) = console(Some("nope")).await else {
        panic!("a wrong password was taken");
    };
    assert_eq!(sqlstate(&wrong).as_deref(), Some("28P01"), "{wrong}");
    let Ok(admin) = console(Some("console-pw")).await else {
        panic!("the right password was refused");
    };
    let rows = admin.simple_query("SHOW VERSION").await.unwrap();
    assert!(
        rows.iter()
            .any(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(_))),
        "{rows:?}"
    );
    // A role that is no admin user is asked the same, so the answer does
    // not tell who the admin users are; only once the server has vouched
    // for it is it turned away.
    let outsider = |password: &str| {
        let conninfo = format!(
            "host=127.0.0.1 port={} user=outsider dbname=pgwarden password={password}",
            p.service_addrs()["read_write"].port()
        );
        async move { client(&conninfo).await }
    };
    let Err(wrong) = outsider("nope").await else {
        panic!("a wrong password was taken");
    };
    assert_eq!(sqlstate(&wrong).as_deref(), Some("28P01"), "{wrong}");
    let Err(refused) = outsider("outsider-pw").await else {
        panic!("a role that is no admin user got in");
    };
    assert_eq!(sqlstate(&refused).as_deref(), Some("28000"), "{refused}");
    // Ordinary sessions are untouched.
    assert_eq!(
        one(&client(&via(&p, "read_write")).await.unwrap(), "SELECT 1").await,
        "1"
    );
}

/// A pooled client whose host refuses a new server connection while the
/// probes still call it up is not left waiting for a topology change that
/// does not come: the host is tried again within `query_wait_timeout`, and
/// the transaction runs once it accepts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_client_is_served_when_its_host_accepts_again() {
    use pgwarden_testkit::Listener;
    let c = TestCluster::builder().replicas(0).start();
    let (relay, _e, p) = behind_relay(&c, pool(2, Duration::from_secs(20))).await;
    relay.set_listener(Listener::Closed);
    let conninfo = via(&p, "read_write");
    let pending = tokio::spawn(async move {
        let db = client(&conninfo).await?;
        db.simple_query("SELECT 41 + 1").await.map(|m| {
            m.into_iter()
                .find_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
                    _ => None,
                })
                .unwrap_or_default()
        })
    });
    let got = common::served_once_open(&relay, pending)
        .await
        .expect("the transaction ran");
    assert_eq!(got, "42");
}

/// `POST /pause` with `wait_ms` waits for the transactions of the paused
/// service's pools only: pausing the read-only service answers at once
/// while a read-write transaction is open, and pausing the writers waits
/// for that transaction, not for one open on the read-only service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_waits_for_its_own_services_transactions_only() {
    let c = TestCluster::builder().replicas(1).start();
    let (e, p) = proxy_with(&c.addrs(), Duration::from_secs(10), pool(2, WAIT), 10_000).await;
    ready(&e, 2).await;
    let http = p.http_addr().unwrap();
    let post = |path: &'static str| async move {
        tokio::task::spawn_blocking(move || common::http_post(http, path))
            .await
            .unwrap()
    };
    let writer = client(&via(&p, "read_write")).await.unwrap();
    writer.batch_execute("BEGIN; SELECT 1").await.unwrap();
    assert_eq!(
        post("/pause?service=read_only&wait_ms=2000").await,
        (
            200,
            "paused read_only; no transaction in flight\n".to_string()
        )
    );
    assert_eq!(
        post("/pause?service=read_write&wait_ms=300").await,
        (
            503,
            "paused read_write; 1 transactions still in flight\n".to_string()
        )
    );
    writer.batch_execute("COMMIT").await.unwrap();
    post("/resume?service=read_write").await;
    post("/resume?service=read_only").await;
    let reader = client(&via(&p, "read_only")).await.unwrap();
    reader.batch_execute("BEGIN; SELECT 1").await.unwrap();
    assert_eq!(
        post("/pause?service=read_write&wait_ms=2000").await,
        (
            200,
            "paused read_write; no transaction in flight\n".to_string()
        )
    );
    assert_eq!(
        post("/pause?service=read_only&wait_ms=300").await,
        (
            503,
            "paused read_only; 1 transactions still in flight\n".to_string()
        )
    );
    // A resume while a pause waits ends the wait with 409: the service is
    // not paused, whatever the count of transactions does next. (The
    // pause above is lifted first, so that the pause seen below is this
    // one.)
    post("/resume?service=read_only").await;
    let waiting = tokio::spawn(post("/pause?service=read_only&wait_ms=20000"));
    pgwarden_testkit::eventually("the pause", WAIT, || async {
        let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/cluster"))
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        let ro = v["services"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["name"] == "read_only"));
        match ro.and_then(|s| s["paused"].as_bool()) {
            Some(true) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    post("/resume?service=read_only").await;
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the pause kept waiting after a resume")
            .unwrap(),
        (409, "read_only was resumed while waiting\n".to_string())
    );
    // Of two services paused together, resuming one ends the wait too.
    let mut spec = p.spec().clone();
    let mut second = spec
        .services
        .iter()
        .find(|s| s.name == "read_write")
        .unwrap()
        .clone();
    second.name = "second_writer".into();
    second.listen = format!("127.0.0.1:{}", pgwarden_testkit::free_port())
        .parse()
        .unwrap();
    spec.services.push(second);
    let mut p = p;
    p.apply(spec).await.unwrap();
    post("/resume?service=read_write").await;
    writer.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let waiting = tokio::spawn(post("/pause?service=%2Awriters&wait_ms=20000"));
    pgwarden_testkit::eventually("the writers' pause", WAIT, || async {
        let (_, body) = tokio::task::spawn_blocking(move || common::http_get(http, "/cluster"))
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        let paused = v["services"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|s| s["paused"] == true && s["read_only"] == false)
                    .count()
            })
            .unwrap_or(0);
        (paused == 2)
            .then_some(())
            .ok_or(format!("{paused} paused"))
    })
    .await;
    post("/resume?service=second_writer").await;
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the pause kept waiting after a resume")
            .unwrap(),
        (409, "*writers was resumed while waiting\n".to_string())
    );
    post("/resume?service=read_write").await;
    writer.batch_execute("COMMIT").await.unwrap();
    reader.batch_execute("COMMIT").await.unwrap();
}

/// A pooled client that shuts only its sending side after a query gets
/// its replies, in transaction and in session pooling: its server is
/// shown the end of input too (and is not reused), so the session ends
/// even when the replies owed cannot be counted exactly, as after an
/// extended-protocol COPY whose first Sync the server ignores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_client_that_half_closes_still_gets_its_replies() {
    let c = TestCluster::builder().replicas(0).start();
    sql_value(&c.conninfo(0), "CREATE TABLE half_copied (x int); SELECT 1").await;
    let (_e1, txn) = pooled(&c, 1).await;
    let (_e2, session) = session_pooling_proxy(
        &c,
        PoolSettings {
            size: 1,
            ..PoolSettings::default()
        },
    )
    .await;
    // Logs in, runs a statement (so that a server is in the pool: a
    // client whose input ends while it waits for one has left the line,
    // as with PgBouncer, and its statement does not run), sends `bytes`,
    // shuts its sending side and reads to the end, which must come.
    async fn half_close(addr: std::net::SocketAddr, bytes: Vec<u8>) -> Vec<u8> {
        tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut raw =
                RawClient::connect_with(addr, &[("user", "postgres"), ("database", "postgres")]);
            raw.simple(b"SELECT 1");
            raw.0.write_all(&bytes).unwrap();
            raw.0.shutdown(std::net::Shutdown::Write).unwrap();
            let mut out = Vec::new();
            raw.0.read_to_end(&mut out).expect("the session ends");
            out
        })
        .await
        .unwrap()
    }
    let has = |out: &[u8], text: &[u8]| out.windows(text.len()).any(|w| w == text);
    for (mode, p) in [("transaction", &txn), ("session", &session)] {
        let addr = p.service_addrs()["read_write"];
        for round in 0..2 {
            let out = half_close(
                addr,
                msg_query(b"SELECT pg_sleep(0.5), 'answered after the end of input'"),
            )
            .await;
            assert!(
                has(&out, b"answered after the end of input"),
                "{mode} round {round}: {}",
                String::from_utf8_lossy(&out)
            );
            assert_eq!(out.last(), Some(&b'I'), "{mode} round {round}");
        }
        // COPY, its data and a second Sync, all sent at once: the Sync
        // sent during the COPY gets no ReadyForQuery.
        let mut m = msg_parse(b"", b"COPY half_copied FROM STDIN");
        m.extend(msg_bind_execute(b""));
        m.extend_from_slice(MSG_SYNC);
        m.extend_from_slice(&[b'd', 0, 0, 0, 6, b'7', b'\n']);
        m.extend_from_slice(&[b'c', 0, 0, 0, 4]);
        m.extend_from_slice(MSG_SYNC);
        let out = half_close(addr, m).await;
        assert!(
            has(&out, b"COPY 1"),
            "{mode}: {}",
            String::from_utf8_lossy(&out)
        );
    }
    assert_eq!(
        sql_value(&c.conninfo(0), "SELECT count(*) FROM half_copied")
            .await
            .as_deref(),
        Some("2")
    );
}

/// A pooled server shown the end of a client's input is never lent again,
/// also when the client is gone before its replies are (the write of the
/// last of them fails): it is closed, not left idle in the pool with its
/// backend gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_shown_the_end_of_input_is_not_lent_again() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled(&c, 1).await;
    let addr = p.service_addrs()["read_write"];
    let http = p.http_addr().unwrap();
    let idle = || common::metric_sample(http, "pgwarden_pool_servers_idle{");
    let direct = c.conninfo(0);
    const BACKENDS: &str = "SELECT count(*) FROM pg_stat_activity \
        WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() \
        AND application_name <> 'pgwarden-probe'";
    for size in [100, 20_000, 40_000, 70_000] {
        for round in 0..5 {
            tokio::task::spawn_blocking(move || {
                use std::io::Write;
                let mut raw = RawClient::connect_with(
                    addr,
                    &[("user", "postgres"), ("database", "postgres")],
                );
                raw.simple(b"SELECT 1");
                raw.0
                    .write_all(&msg_query(format!("SELECT repeat('x', {size})").as_bytes()))
                    .unwrap();
                raw.0.shutdown(std::net::Shutdown::Write).unwrap();
                // Gone before the replies come.
            })
            .await
            .unwrap();
            // A server idle in the pool has its backend: one shown the end
            // of input ends its backend, and must be closed, not idle.
            // (A reply that came before the end of input was read leaves
            // the server idle, and rightly so.)
            pgwarden_testkit::eventually(
                &format!("size {size} round {round}: every idle server has its backend"),
                WAIT,
                || async {
                    let idle = idle().await;
                    let backends = sql_value(&direct, BACKENDS).await;
                    let backends: f64 = backends.as_deref().unwrap_or("-1").parse().unwrap();
                    (idle == backends)
                        .then_some(())
                        .ok_or(format!("{idle} idle, {backends} backends"))
                },
            )
            .await;
        }
    }
}

/// Close of statement `name`.
fn msg_close_statement(name: &[u8]) -> Vec<u8> {
    let mut m = msg_describe_statement(name);
    m[0] = b'C';
    m
}

/// Statements follow the server's word when a batch fails: a Close skipped
/// after an error leaves the statement as PostgreSQL leaves it (there for the
/// client, prepared again where the server lacks it), and a Close of a
/// statement whose Parse failed brings nothing back. Each is checked on the
/// server that ran it and, after another client's `DISCARD ALL` empties that
/// server, where it must be prepared again from pgwarden's copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_follow_skipped_closes_and_failed_parses() {
    let c = TestCluster::builder().replicas(0).start();
    // One server: every client shares it.
    let (_e, p) = pooled(&c, 1).await;
    let rw = p.service_addrs()["read_write"];
    let mut a = RawClient::connect(rw, "UTF8");
    let mut other = RawClient::connect(rw, "UTF8");
    let mut discard = || assert_eq!(tags(&other.simple(b"DISCARD ALL")), ["DISCARD ALL"]);

    // A Close skipped after an error, of a statement pgwarden prepared on
    // this server in the same batch.
    let r = a.send(&[msg_parse(b"s1", b"SELECT 1"), MSG_SYNC.to_vec()].concat());
    assert_eq!(error_code(&r), None, "{r:?}");
    discard();
    let mut m = msg_parse(b"", b"SELECT 1/0");
    m.extend(msg_bind_execute(b""));
    m.extend(msg_bind_execute(b"s1"));
    m.extend(msg_close_statement(b"s1"));
    m.extend_from_slice(MSG_SYNC);
    let r = a.send(&m);
    assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    // On PostgreSQL s1 is still there.
    assert_eq!(values(&a.send(&msg_run(b"s1"))), ["1"]);
    discard();
    assert_eq!(values(&a.send(&msg_run(b"s1"))), ["1"]);

    // A Close of a statement whose Parse failed: no such statement.
    let mut m = msg_parse(b"s2", b"SELEC 2");
    m.extend(msg_close_statement(b"s2"));
    m.extend_from_slice(MSG_SYNC);
    let r = a.send(&m);
    assert_eq!(error_code(&r).as_deref(), Some("42601"), "{r:?}");
    let r = a.send(&[msg_parse(b"s2", b"SELECT 2"), msg_run(b"s2")].concat());
    assert_eq!(values(&r), ["2"], "{r:?}");
    discard();
    assert_eq!(values(&a.send(&msg_run(b"s2"))), ["2"]);

    // Statements dropped where no check can see it (SQL run at run time)
    // fail once, under the client's name, and are prepared again after.
    assert_eq!(values(&a.send(&msg_run(b"s1"))), ["1"]);
    let r = other.simple(b"DO $$BEGIN EXECUTE 'DEALLOCATE ALL'; END$$");
    assert_eq!(error_code(&r), None, "{r:?}");
    let r = a.send(&msg_run(b"s1"));
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
    assert_eq!(
        error_message(&r).as_deref(),
        Some("prepared statement \"s1\" does not exist")
    );
    assert_eq!(values(&a.send(&msg_run(b"s1"))), ["1"]);

    // DEALLOCATE of a quoted name with a blank, behind a comment.
    let r = a.send(&[msg_parse(b"my stmt", b"SELECT 4"), msg_run(b"my stmt")].concat());
    assert_eq!(values(&r), ["4"], "{r:?}");
    let r = a.simple(b"DEALLOCATE /* done */ \"my stmt\";");
    assert_eq!(tags(&r), ["DEALLOCATE"], "{r:?}");
    let r = a.send(&msg_run(b"my stmt"));
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
}

/// A FunctionCall inside an extended batch that failed is skipped by the
/// server, as a Query there is: a Bind pipelined behind it, of a statement
/// pgwarden prepared in that batch, does not wait for a ReadyForQuery
/// that only the Sync behind the Bind can bring.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_call_in_a_failed_batch_holds_nothing_up() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled(&c, 1).await;
    // s1 is gone from the server: pgwarden prepares it again in the batch.
    let (mut a, _other) = s1_gone_from_the_server(&p);
    let oid: u32 = value(&a.simple(b"SELECT 'pg_backend_pid'::regproc::oid"))
        .parse()
        .unwrap();
    let mut call = vec![b'F'];
    call.extend_from_slice(&14u32.to_be_bytes());
    call.extend_from_slice(&oid.to_be_bytes());
    call.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    let mut m = msg_parse(b"", b"SELECT 1/0");
    m.extend(msg_bind_execute(b""));
    m.extend(msg_bind_execute(b"s1"));
    m.extend(call);
    m.extend(msg_bind_execute(b"s1"));
    m.extend_from_slice(MSG_SYNC);
    let r = a.send(&m);
    assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    assert_eq!(values(&a.send(&msg_run(b"s1"))), ["1"]);
}

/// With a bound of one statement per server, a batch that fails before
/// pgwarden's Closes and Parses of it leaves the server as it was: the
/// statement closed and prepared again in the skipped part is still
/// there, and the next use finds it rather than preparing it again over
/// itself (`42P05` for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_that_evicted_and_prepared_again_leaves_the_cache_true() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_bounded(&c, 1).await;
    let mut a = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    for (name, sql) in [(&b"s2"[..], &b"SELECT 2"[..]), (b"s1", b"SELECT 1/0")] {
        let r = a.send(&[msg_parse(name, sql), MSG_SYNC.to_vec()].concat());
        assert_eq!(error_code(&r), None, "{r:?}");
    }
    // The server has s1 only. s1 fails at once; s2 is prepared (s1
    // closed to make room) and s1 again (s2 closed): all skipped.
    let mut m = msg_bind_execute(b"s1");
    m.extend(msg_bind_execute(b"s2"));
    m.extend(msg_bind_execute(b"s1"));
    m.extend_from_slice(MSG_SYNC);
    let r = a.send(&m);
    assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    assert_eq!(values(&a.send(&msg_run(b"s2"))), ["2"]);
    for _ in 0..2 {
        let r = a.send(&msg_run(b"s1"));
        assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    }
}

/// A DEALLOCATE and a Parse of the same name in a batch that fails before
/// them change nothing: the statement keeps its text and runs at the
/// next use, prepared again where the server lacks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_deallocate_and_parse_of_a_name_leave_its_statement() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled(&c, 1).await;
    let (mut a, _other) = s1_gone_from_the_server(&p);
    // As psycopg pipelines a cache eviction: an extended DEALLOCATE, then
    // the name prepared anew.
    let mut m = msg_parse(b"", b"SELECT 1/0");
    m.extend(msg_bind_execute(b""));
    m.extend(msg_parse(b"", b"DEALLOCATE s1"));
    m.extend(msg_bind_execute(b""));
    m.extend(msg_parse(b"s1", b"SELECT 5"));
    m.extend(msg_bind_execute(b"s1"));
    m.extend_from_slice(MSG_SYNC);
    let r = a.send(&m);
    assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    assert_eq!(values(&a.send(&msg_run(b"s1"))), ["1"]);
}

/// Two raw clients of one server connection; the first has prepared
/// `s1` as `SELECT 1`, which the second's `DISCARD ALL` has then dropped
/// from the server, so that pgwarden prepares it again at its next use.
fn s1_gone_from_the_server(p: &pgwarden_proxy::Proxy) -> (RawClient, RawClient) {
    let rw = p.service_addrs()["read_write"];
    let mut a = RawClient::connect(rw, "UTF8");
    let mut other = RawClient::connect(rw, "UTF8");
    let r = a.send(&[msg_parse(b"s1", b"SELECT 1"), MSG_SYNC.to_vec()].concat());
    assert_eq!(error_code(&r), None, "{r:?}");
    assert_eq!(tags(&other.simple(b"DISCARD ALL")), ["DISCARD ALL"]);
    (a, other)
}

/// Statements and Closes skipped in one batch and a batch pipelined
/// behind it: with a bound of one statement, a Bind whose statement
/// pgwarden closed in the failed batch waits for that batch's end and
/// finds the statement still there, rather than preparing it over itself
/// (42P05); and a statement whose Parse failed stays gone after a Close
/// of it that a later failed batch skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_behind_a_failed_one_see_what_it_left() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled_bounded(&c, 1).await;
    let mut a = RawClient::connect(p.service_addrs()["read_write"], "UTF8");
    for (name, sql) in [(&b"s2"[..], &b"SELECT 2"[..]), (b"s1", b"SELECT 1")] {
        let r = a.send(&[msg_parse(name, sql), MSG_SYNC.to_vec()].concat());
        assert_eq!(error_code(&r), None, "{r:?}");
    }
    // The server has s1. The failed batch prepares s2 and closes s1 to
    // make room (both skipped); the next uses s1.
    let mut m = msg_parse(b"", b"SELECT 1/0");
    m.extend(msg_bind_execute(b""));
    m.extend(msg_bind_execute(b"s2"));
    m.extend_from_slice(MSG_SYNC);
    m.extend(msg_run(b"s1"));
    std::io::Write::write_all(&mut a.0, &m).unwrap();
    let r = a.until_ready();
    assert_eq!(error_code(&r).as_deref(), Some("22012"), "{r:?}");
    let r = a.until_ready();
    assert_eq!(values(&r), ["1"], "{r:?}");
    assert_eq!(values(&a.send(&msg_run(b"s2"))), ["2"]);
    assert_eq!(values(&a.send(&msg_run(b"s1"))), ["1"]);

    // A failed Parse, then (pipelined) a failed batch with a Close of it.
    let mut m = msg_parse(b"s3", b"SELEC 3");
    m.extend_from_slice(MSG_SYNC);
    m.extend(msg_parse(b"", b"SELECT 1/0"));
    m.extend(msg_bind_execute(b""));
    m.extend(msg_close_statement(b"s3"));
    m.extend_from_slice(MSG_SYNC);
    std::io::Write::write_all(&mut a.0, &m).unwrap();
    assert_eq!(error_code(&a.until_ready()).as_deref(), Some("42601"));
    assert_eq!(error_code(&a.until_ready()).as_deref(), Some("22012"));
    for _ in 0..2 {
        let r = a.send(&msg_run(b"s3"));
        assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
    }
    let r = a.send(&[msg_parse(b"s3", b"SELECT 3"), msg_run(b"s3")].concat());
    assert_eq!(values(&r), ["3"], "{r:?}");
}

/// What one client does to a shared server connection does not cost the
/// others their statements: a `DISCARD ALL` bound and never run leaves
/// the server closed rather than lent with statements pgwarden no longer
/// lists (42P05 for the next client that prepares one there), and an
/// error any client can raise that names another client's statement does
/// not make pgwarden think it gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_spoil_the_statements_of_another() {
    let c = TestCluster::builder().replicas(0).start();
    let (_e, p) = pooled(&c, 1).await;
    let rw = p.service_addrs()["read_write"];
    let mut a = RawClient::connect(rw, "UTF8");
    let mut b = RawClient::connect(rw, "UTF8");
    let r = b.send(&[msg_parse(b"sb", b"SELECT 7"), msg_run(b"sb")].concat());
    assert_eq!(values(&r), ["7"], "{r:?}");
    // Bound, never executed.
    let mut m = msg_parse(b"", b"DISCARD ALL");
    m.extend_from_slice(&[b'B', 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 0]);
    m.extend_from_slice(MSG_SYNC);
    let r = a.send(&m);
    assert_eq!(error_code(&r), None, "{r:?}");
    assert_eq!(values(&b.send(&msg_run(b"sb"))), ["7"]);
    // A 26000 raised by a naming b's statement as the server knows it.
    let sname =
        value(&b.simple(b"SELECT name FROM pg_prepared_statements WHERE statement = 'SELECT 7'"));
    let fake = format!(
        "DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '26000', \
         MESSAGE = 'prepared statement \"{sname}\" does not exist'; END$$"
    );
    let r = a.simple(fake.as_bytes());
    assert_eq!(error_code(&r).as_deref(), Some("26000"), "{r:?}");
    for _ in 0..2 {
        assert_eq!(values(&b.send(&msg_run(b"sb"))), ["7"]);
    }
}

/// A server lost while a pooled client is in the middle of one of its
/// messages (a long row) ends the client's connection without a word:
/// an ErrorResponse written there would be read as the rest of the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_lost_mid_row_closes_the_client_without_a_message() {
    use std::io::{Read, Write};
    let c = TestCluster::builder().replicas(0).start();
    let relay = pgwarden_testkit::Relay::start(c.addr(0).parse().unwrap()).unwrap();
    let (e, p) = proxy_with(&[relay.addr().to_string()], WAIT, pool(2, WAIT), 10_000).await;
    ready(&e, 1).await;
    let rw = p.service_addrs()["read_write"];
    let mut raw = tokio::task::spawn_blocking(move || RawClient::connect(rw, "UTF8"))
        .await
        .unwrap();
    // Far more than the sockets and the relay hold, so the server is still
    // sending the row when its connection is cut.
    raw.0
        .write_all(&msg_query(b"SELECT repeat('x', 50000000)"))
        .unwrap();
    let mut got = vec![0u8; 1 << 20];
    raw.0.read_exact(&mut got).unwrap();
    relay.reset_all();
    let rest = tokio::task::spawn_blocking(move || {
        let mut rest = Vec::new();
        let mut chunk = vec![0u8; 1 << 16];
        loop {
            match raw.0.read(&mut chunk) {
                Ok(0) | Err(_) => break rest,
                Ok(n) => rest.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .unwrap();
    got.extend_from_slice(&rest);
    // RowDescription, then the DataRow that was cut short.
    assert_eq!(got[0], b'T');
    let t_len = u32::from_be_bytes(got[1..5].try_into().unwrap()) as usize;
    let row = &got[1 + t_len..];
    assert_eq!(row[0], b'D');
    let row_len = u32::from_be_bytes(row[1..5].try_into().unwrap()) as usize;
    assert!(row.len() < 1 + row_len, "the whole row came: {}", row.len());
    let tail = &row[row.len().saturating_sub(4096)..];
    assert!(
        tail.iter().all(|&b| b == b'x'),
        "bytes that are not the row's follow it: {:?}",
        String::from_utf8_lossy(&tail[tail.len().saturating_sub(200)..])
    );
}
