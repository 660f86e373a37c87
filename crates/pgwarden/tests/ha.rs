//! The HA agent against real etcd and real PostgreSQL: `pgwarden agent`
//! processes, one per node, killed and cut off as real nodes would be.

use std::time::Duration;

use pgwarden_testkit::{eventually, AgentCluster};

/// Fast timings so a failover takes seconds: `loop_wait + 2 × retry_timeout
/// = 5 ≤ ttl = 6`.
const FAST: &str =
    "ttl = 6\nloop_wait = 1\nretry_timeout = 2\nprimary_start_timeout = 3\nsafety_margin = 1";

/// Long enough for initdb, two clones and the first elections on a busy
/// two-core machine.
const BOOTSTRAP: Duration = Duration::from_secs(120);

fn cluster() -> pgwarden_testkit::agents::AgentClusterBuilder {
    AgentCluster::builder(env!("CARGO_BIN_EXE_pgwarden")).agent_settings(FAST)
}

/// The first column of every row of `q`, or the error as text.
async fn query(conninfo: &str, q: &str) -> Result<Vec<String>, String> {
    let (client, conn) = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_postgres::connect(conninfo, tokio_postgres::NoTls),
    )
    .await
    .map_err(|_| "connect timed out".to_string())?
    .map_err(|e| format!("{e:?}"))?;
    tokio::spawn(conn);
    let msgs = tokio::time::timeout(Duration::from_secs(5), client.simple_query(q))
        .await
        .map_err(|_| "query timed out".to_string())?
        .map_err(|e| format!("{e}: {}", e.as_db_error().map_or("", |d| d.message())))?;
    Ok(msgs
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap_or("").to_string()),
            _ => None,
        })
        .collect())
}

async fn one(conninfo: &str, q: &str) -> Result<String, String> {
    query(conninfo, q)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| "no row".to_string())
}

/// Indexes of the nodes whose PostgreSQL accepts writes right now.
async fn writable(c: &AgentCluster) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, n) in c.nodes().iter().enumerate() {
        let r = one(&n.pg_conninfo(), "SELECT pg_is_in_recovery()").await;
        if r.as_deref() == Ok("f") {
            out.push(i);
        }
    }
    out
}

/// Waits until exactly one node is primary and `replicas` replicas stream
/// from it; returns the primary's index.
async fn healthy(c: &AgentCluster, replicas: usize, within: Duration) -> usize {
    let r = tokio::time::timeout(
        within + Duration::from_secs(5),
        eventually("one primary with streaming replicas", within, || async {
            let w = writable(c).await;
            let [p] = w[..] else {
                return Err(format!("writable nodes: {w:?}"));
            };
            let n = one(
                &c.node(p).pg_conninfo(),
                // pg_basebackup streams too while it clones; count members.
                "SELECT count(*) FROM pg_stat_replication \
                 WHERE state = 'streaming' AND application_name ~ '^n[0-9]+$'",
            )
            .await?;
            (n == replicas.to_string())
                .then_some(p)
                .ok_or(format!("node {p} primary, {n} streaming"))
        }),
    )
    .await;
    r.unwrap_or_else(|_| panic!("cluster not healthy\n{}", c.logs()))
}

/// Waits until node `via`'s read-write port reaches `primary` and takes a
/// write there.
async fn routes_writes_to(c: &AgentCluster, via: usize, primary: usize, within: Duration) {
    let want = c.node(primary).pg_port.to_string();
    let rw = c.node(via).rw_conninfo();
    eventually(
        &format!("the read-write port of node {via} reaches node {primary}"),
        within,
        || async {
            let port = one(
                &rw,
                "INSERT INTO ha_log VALUES (DEFAULT) RETURNING inet_server_port()",
            )
            .await?;
            (port == want).then_some(()).ok_or(format!("port {port}"))
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_then_passive_failover_moves_writes_on_every_node() {
    let mut c = cluster().start();
    let p = healthy(&c, 2, BOOTSTRAP).await;
    query(
        &c.node(p).pg_conninfo(),
        "CREATE TABLE ha_log (id serial PRIMARY KEY)",
    )
    .await
    .unwrap();
    for i in 0..c.len() {
        routes_writes_to(&c, i, p, Duration::from_secs(20)).await;
    }
    let before = one(&c.node(p).pg_conninfo(), "SELECT count(*) FROM ha_log")
        .await
        .unwrap();

    // Passive failure: the whole node is gone, agent and PostgreSQL.
    c.kill_node(p);
    let survivors: Vec<usize> = (0..c.len()).filter(|&i| i != p).collect();
    let np = tokio::time::timeout(Duration::from_secs(40), async {
        loop {
            let w = writable(&c).await;
            if let [n] = w[..] {
                if n != p {
                    return n;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no new primary\n{}", c.logs()));
    assert!(survivors.contains(&np));
    for &i in &survivors {
        routes_writes_to(&c, i, np, Duration::from_secs(20)).await;
    }
    let after: i64 = one(&c.node(np).pg_conninfo(), "SELECT count(*) FROM ha_log")
        .await
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        after > before.parse::<i64>().unwrap(),
        "rows written before the failover survive and new ones are added"
    );
    // The other survivor follows the new leader.
    healthy(&c, 1, Duration::from_secs(30)).await;
}
