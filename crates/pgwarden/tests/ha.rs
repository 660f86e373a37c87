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

/// Waits until every running replica has replayed all the WAL the
/// primary `p` has written, so a failover that follows loses nothing.
async fn replicated(c: &AgentCluster, p: usize) {
    let lsn = one(&c.node(p).pg_conninfo(), "SELECT pg_current_wal_lsn()")
        .await
        .unwrap();
    let q = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn");
    for i in (0..c.len()).filter(|&i| i != p) {
        let conninfo = c.node(i).pg_conninfo();
        eventually(
            &format!("node {i} replayed {lsn}"),
            Duration::from_secs(20),
            || async {
                (one(&conninfo, &q).await? == "t")
                    .then_some(())
                    .ok_or("behind".to_string())
            },
        )
        .await;
    }
}

/// Waits until node `i`'s API lists `n` members: the membership a failsafe
/// leader asks to acknowledge it.
async fn knows_members(c: &AgentCluster, i: usize, n: usize) {
    let url = format!("{}/cluster", c.node(i).api_url());
    eventually(
        &format!("node {i} knows {n} members"),
        Duration::from_secs(10),
        || async {
            let v = pgwarden_agent::http_client::get_json(&url, Duration::from_secs(2))
                .await
                .map_err(|e| e.to_string())?;
            let seen = v["members"].as_array().map_or(0, Vec::len);
            (seen == n).then_some(()).ok_or(format!("{seen} members"))
        },
    )
    .await;
}

/// Waits until every agent has logged that maintenance mode is on.
async fn all_see_the_pause(c: &AgentCluster) {
    eventually(
        "every agent sees the pause",
        Duration::from_secs(10),
        || async {
            (0..c.len())
                .all(|i| c.node(i).agent_log().contains("paused:"))
                .then_some(())
                .ok_or("not yet".to_string())
        },
    )
    .await;
}

/// Switches over from `leader` to `candidate` through node 0's API; a
/// refusal (412 until the candidate's published state shows it running)
/// is tried again.
async fn switch_over(c: &AgentCluster, leader: &str, candidate: &str) {
    let url = format!("{}/switchover", c.node(0).api_url());
    eventually(
        &format!("a switchover to {candidate}"),
        Duration::from_secs(60),
        || async {
            let r = pgwarden_agent::http_client::request(
                "POST",
                &url,
                Some(&serde_json::json!({"leader": leader, "candidate": candidate})),
                Some(("pgwarden", "secret")),
                Duration::from_secs(40),
            )
            .await;
            if let Ok(r) = &r {
                if r.status == 200 {
                    return Ok(());
                }
            }
            // A request given up on (a time-out, a 503 while the new
            // leader was still starting) may have gone through all the
            // same: asked again, it would be refused for ever, as the
            // leader it names no longer leads.
            let leader = read_cluster(c).await.leader.map(|l| l.name);
            if leader.as_deref() == Some(candidate) {
                return Ok(());
            }
            Err(match r {
                Ok(r) => r.body,
                Err(e) => e.to_string(),
            })
        },
    )
    .await;
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
    let events = tempfile::NamedTempFile::new().unwrap();
    let path = events.path().display().to_string();
    let mut c = cluster()
        .agent_settings(&format!(
            "on_start = \"echo >> {path}\"\non_role_change = \"echo >> {path}\""
        ))
        .start();
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
    // Callbacks ran with the action, the new role and the cluster name.
    let cluster_name = c.cluster_name().to_string();
    eventually("callbacks", Duration::from_secs(10), || async {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let promoted = format!("on_role_change primary {cluster_name}");
        let started = format!("on_start replica {cluster_name}");
        (text.contains(&promoted) && text.contains(&started))
            .then_some(())
            .ok_or(text)
    })
    .await;
    // Every surviving connection manager acknowledged the new leadership.
    let dcs = cluster_dcs(&c).await;
    let snap = dcs.read_cluster().await.unwrap();
    let generation = snap.leader.as_ref().unwrap().generation;
    for (name, rec) in &snap.members {
        assert_eq!(
            rec["routing_generation"].as_i64(),
            Some(generation),
            "{name} routes by the current leadership"
        );
    }
}

/// Writes to every member directly, all at once, every 50 ms, and fails if
/// two members ever accept a write in the same round: the split brain the
/// agent must rule out.
struct SplitBrainChecker {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<Result<u64, String>>,
}

impl SplitBrainChecker {
    /// `ha_checker (node int)` must exist on the primary.
    fn start(c: &AgentCluster) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let conninfos: Vec<String> = c.nodes().iter().map(|n| n.pg_conninfo()).collect();
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut clients: Vec<Option<tokio_postgres::Client>> =
                conninfos.iter().map(|_| None).collect();
            let mut rounds = 0;
            while !flag.load(Ordering::SeqCst) {
                rounds += 1;
                let attempts = clients.iter_mut().enumerate().map(|(i, slot)| {
                    let conninfo = conninfos[i].clone();
                    async move {
                        if slot.as_ref().is_none_or(|c| c.is_closed()) {
                            *slot = tokio::time::timeout(
                                Duration::from_millis(500),
                                tokio_postgres::connect(&conninfo, tokio_postgres::NoTls),
                            )
                            .await
                            .ok()
                            .and_then(Result::ok)
                            .map(|(c, conn)| {
                                tokio::spawn(conn);
                                c
                            });
                        }
                        let client = slot.as_ref()?;
                        let q = format!("INSERT INTO ha_checker VALUES ({i})");
                        match tokio::time::timeout(
                            Duration::from_millis(500),
                            client.simple_query(&q),
                        )
                        .await
                        {
                            Ok(Ok(_)) => Some(i),
                            Ok(Err(_)) => None,
                            Err(_) => {
                                *slot = None;
                                None
                            }
                        }
                    }
                });
                let accepted: Vec<usize> =
                    futures_join(attempts).await.into_iter().flatten().collect();
                if accepted.len() > 1 {
                    return Err(format!(
                        "round {rounds}: nodes {accepted:?} accepted writes at once"
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(rounds)
        });
        SplitBrainChecker { stop, task }
    }

    /// Stops checking; panics if two writable members were seen.
    async fn finish(self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let rounds = self
            .task
            .await
            .expect("checker task")
            .unwrap_or_else(|e| panic!("split brain: {e}"));
        assert!(rounds > 10, "the checker ran only {rounds} rounds");
    }
}

async fn futures_join<F: std::future::Future>(futs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    let futs: Vec<_> = futs.map(Box::pin).collect();
    // Poll them together so one slow member does not serialise the round.
    let mut pending: Vec<_> = futs.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (i, f) in pending.iter_mut().enumerate() {
            if let Some(fut) = f {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        results[i] = Some(v);
                        *f = None;
                    }
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    for r in results {
        out.push(r.expect("ready"));
    }
    out
}

/// Waits for a healthy cluster led by node 0, creates the checker's table
/// and starts the split-brain checker once every replica has it.
async fn healthy_and_checked(c: &AgentCluster) -> SplitBrainChecker {
    healthy(c, 2, BOOTSTRAP).await;
    query(
        &c.node(0).pg_conninfo(),
        "CREATE TABLE ha_checker (node int)",
    )
    .await
    .unwrap();
    replicated(c, 0).await;
    SplitBrainChecker::start(c)
}

/// Stops (SIGSTOP) the WAL receivers of `nodes`, so that what their
/// primary writes next exists only there; their pids, for [`thaw`].
async fn freeze_wal_receivers(c: &AgentCluster, nodes: &[usize]) -> Vec<i32> {
    let mut receivers = Vec::new();
    for &i in nodes {
        let pid: i32 = one(
            &c.node(i).pg_conninfo(),
            "SELECT pid FROM pg_stat_wal_receiver",
        )
        .await
        .unwrap()
        .parse()
        .unwrap();
        signal(pid, nix::sys::signal::Signal::SIGSTOP);
        receivers.push(pid);
    }
    receivers
}

/// Lets processes stopped by [`freeze_wal_receivers`] go on.
fn thaw(pids: &[i32]) {
    for &pid in pids {
        signal(pid, nix::sys::signal::Signal::SIGCONT);
    }
}

/// Waits until a node other than `old` is the only writable one.
async fn new_primary(c: &AgentCluster, old: usize, within: Duration) -> usize {
    let r = tokio::time::timeout(within, async {
        loop {
            if let [n] = writable(c).await[..] {
                if n != old {
                    return n;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    r.unwrap_or_else(|_| panic!("no new primary within {within:?}\n{}", c.logs()))
}

fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).expect("signal");
}

async fn api_post(c: &AgentCluster, i: usize, path: &str) -> u16 {
    let url = format!("{}{path}", c.node(i).api_url());
    pgwarden_agent::http_client::request(
        "POST",
        &url,
        Some(&serde_json::json!({})),
        Some(("pgwarden", "secret")),
        Duration::from_secs(10),
    )
    .await
    .map(|r| r.status)
    .unwrap_or_else(|e| panic!("POST {url}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_off_from_etcd_demotes_before_anyone_is_promoted() {
    let c = cluster().etcd_relays().start();
    let checker = healthy_and_checked(&c).await;
    c.etcd_relay(0).set_blackhole(true);
    // The old leader stops taking writes on its own (loop_wait +
    // retry_timeout = 3 s after its last renewal), a replica takes over
    // once the lease has run out (ttl = 6 s).
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    assert_ne!(np, 0);
    let log = c.node(0).agent_log();
    assert!(
        log.contains("demoting: the leader lease was last renewed"),
        "the old leader demoted itself:\n{log}"
    );
    // Healed, it comes back as a replica of the new leader.
    c.etcd_relay(0).set_blackhole(false);
    healthy(&c, 2, Duration::from_secs(60)).await;
    checker.finish().await;
    assert_eq!(writable(&c).await, vec![np]);
}

/// A leader whose etcd refuses connections (its requests fail fast, not by
/// time-out) feeds its watchdog no more once its renewals fail, and demotes
/// once the lease is too old: the watchdog's time-out then runs from the
/// last renewal, as `ttl − safety_margin` promises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_refused_by_etcd_stops_feeding_its_watchdog_and_demotes() {
    let dir = tempfile::tempdir().unwrap();
    let dev = |i: usize| dir.path().join(format!("wd{i}"));
    let mut builder = cluster()
        .etcd_relays()
        .agent_settings("watchdog = \"automatic\"");
    for i in 0..3 {
        std::fs::write(dev(i), b"").unwrap();
        builder = builder.node_settings(i, &format!("watchdog_device = \"{}\"", dev(i).display()));
    }
    let c = builder.start();
    healthy(&c, 2, BOOTSTRAP).await;
    let leader = writable(&c).await[0];
    let ones = |i: usize| {
        std::fs::read(dev(i))
            .unwrap_or_default()
            .iter()
            .filter(|b| **b == b'1')
            .count()
    };
    eventually(
        "the leader feeds its watchdog",
        Duration::from_secs(20),
        || {
            let n = ones(leader);
            async move { (n >= 3).then_some(()).ok_or(format!("{n} keep-alives")) }
        },
    )
    .await;
    // From here no request of the leader's reaches etcd: every renewal
    // fails. A round that renewed just before may still feed once.
    c.etcd_relay(leader).set_refuse(true);
    c.etcd_relay(leader).reset_all();
    let fed = ones(leader) + 1;
    eventually("the leader demotes", Duration::from_secs(20), || {
        let log = c.node(leader).agent_log();
        async move {
            log.contains("demoting: the leader lease was last renewed")
                .then_some(())
                .ok_or("not yet".to_string())
        }
    })
    .await;
    assert!(
        ones(leader) <= fed,
        "{} keep-alives, {fed} at most: fed after its last renewal",
        ones(leader)
    );
    c.etcd_relay(leader).set_refuse(false);
    healthy(&c, 2, Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_postgres_is_restarted_in_place_and_handed_over_when_it_cannot_start() {
    // Crash recovery counts against primary_start_timeout (as in Patroni);
    // on a loaded machine it can take seconds, so give it room.
    let mut c = AgentCluster::builder(env!("CARGO_BIN_EXE_pgwarden"))
        .agent_settings(
            "ttl = 6\nloop_wait = 1\nretry_timeout = 2\nprimary_start_timeout = 8\nsafety_margin = 1",
        )
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    query(
        &c.node(0).pg_conninfo(),
        "CREATE TABLE ha_log (id serial PRIMARY KEY)",
    )
    .await
    .unwrap();
    replicated(&c, 0).await;
    // A crash the agent can repair: same leader, writable again.
    c.kill_postgres(0);
    routes_writes_to(&c, 0, 0, Duration::from_secs(20)).await;
    assert_eq!(
        writable(&c).await,
        vec![0],
        "no failover for a restartable crash"
    );

    // A crash it cannot repair: the configuration file is gone, so every
    // start fails; after primary_start_timeout (8 s) the agent releases the
    // key while its lease is still alive, and a replica takes over.
    replicated(&c, 0).await;
    let conf = c.node(0).data_dir.join("postgresql.conf");
    std::fs::rename(&conf, conf.with_extension("moved")).unwrap();
    c.kill_postgres(0);
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    assert!(
        c.node(0)
            .agent_log()
            .contains("releasing the leader key: PostgreSQL did not start within 8 s"),
        "the key was released, not left to expire:\n{}",
        c.node(0).log_tail()
    );
    for i in [1, 2] {
        routes_writes_to(&c, i, np, Duration::from_secs(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_automatic_failover_to_a_lagging_or_nofailover_member_but_a_forced_one_works() {
    let mut c = cluster().node_settings(1, "nofailover = true").start();
    healthy(&c, 2, BOOTSTRAP).await;
    // n3 stops receiving WAL (its WAL receiver frozen) while n1 writes more
    // than maximum_lag_on_failover (1 MiB).
    let wr_pid = one(
        &c.node(2).pg_conninfo(),
        "SELECT pid FROM pg_stat_wal_receiver",
    )
    .await
    .unwrap();
    let wr_pid: i32 = wr_pid.parse().unwrap();
    signal(wr_pid, nix::sys::signal::Signal::SIGSTOP);
    query(
        &c.node(0).pg_conninfo(),
        "CREATE TABLE big AS SELECT repeat('x', 1000) AS t FROM generate_series(1, 4000)",
    )
    .await
    .unwrap();
    let target: u64 = one(
        &c.node(0).pg_conninfo(),
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8",
    )
    .await
    .unwrap()
    .parse()
    .unwrap();
    // The leader publishes its position with every renewal; wait for one
    // that covers the writes.
    let api = c.node(0).api_url();
    eventually(
        "n3's published lag exceeds 1 MiB",
        Duration::from_secs(20),
        || {
            let url = format!("{api}/cluster");
            async move {
                let v = pgwarden_agent::http_client::get_json(&url, Duration::from_secs(2))
                    .await
                    .map_err(|e| e.to_string())?;
                let lag = v["members"]
                    .as_array()
                    .and_then(|m| m.iter().find(|m| m["name"] == "n3"))
                    .and_then(|m| m["lag"].as_u64())
                    .unwrap_or(0);
                (lag > 1024 * 1024)
                    .then_some(())
                    .ok_or(format!("n3 lag {lag}, target {target}"))
            }
        },
    )
    .await;
    c.kill_node(0);
    // Nobody qualifies: n2 is tagged, n3 lags. Wait past the lease (6 s)
    // and a few loops for the reasons to be logged.
    eventually(
        "both survivors say why they do not take over",
        Duration::from_secs(30),
        || async {
            let (l2, l3) = (c.node(1).agent_log(), c.node(2).agent_log());
            (l2.contains("not eligible (tagged nofailover)")
                && l3.contains("not eligible (lagging"))
            .then_some(())
            .ok_or("not yet".to_string())
        },
    )
    .await;
    assert_eq!(
        writable(&c).await,
        Vec::<usize>::new(),
        "no automatic failover"
    );
    // /cluster (and so pgwarden ctl list) says why, too, once the dead
    // leader's key is gone.
    let api = c.node(1).api_url();
    eventually(
        "pgwarden ctl list says why",
        Duration::from_secs(20),
        || async {
            let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
                .args(["ctl", "--api", &api, "list"])
                .output()
                .await
                .map_err(|e| e.to_string())?;
            let list = String::from_utf8_lossy(&out.stdout).to_string();
            (list.contains(
                "n2: waiting for a leader: this node is not eligible (tagged nofailover)",
            ) && list.contains("n3: waiting for a leader: this node is not eligible (lagging"))
            .then_some(())
            .ok_or(list)
        },
    )
    .await;
    signal(wr_pid, nix::sys::signal::Signal::SIGCONT);
    // An operator can still force one.
    let url = format!("{}/failover", c.node(2).api_url());
    let r = pgwarden_agent::http_client::request(
        "POST",
        &url,
        Some(&serde_json::json!({"candidate": "n3", "force": true})),
        Some(("pgwarden", "secret")),
        Duration::from_secs(40),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    // 200 means the key moved; the promotion follows in the same loop.
    assert_eq!(new_primary(&c, 0, Duration::from_secs(30)).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_mode_suppresses_failover_until_resumed() {
    let mut c = cluster().start();
    healthy(&c, 2, BOOTSTRAP).await;
    assert_eq!(api_post(&c, 1, "/pause").await, 200);
    all_see_the_pause(&c).await;
    c.kill_node(0);
    // Well past the lease (6 s): still nobody promoted.
    let quiet = tokio::time::Instant::now() + Duration::from_secs(12);
    while tokio::time::Instant::now() < quiet {
        assert_eq!(
            writable(&c).await,
            Vec::<usize>::new(),
            "failover while paused"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The operator fails over by hand, still paused: the other running
    // replica follows the new leader (its primary_conninfo is rewritten
    // and reloaded), as Patroni's replicas do in maintenance mode.
    let r = pgwarden_agent::http_client::request(
        "POST",
        &format!("{}/failover", c.node(1).api_url()),
        Some(&serde_json::json!({"candidate": "n2"})),
        Some(("pgwarden", "secret")),
        Duration::from_secs(40),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    gives(
        &c.node(1).pg_conninfo(),
        "SELECT string_agg(application_name, ',') FROM pg_stat_replication WHERE state = 'streaming'",
        "n3",
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(writable(&c).await, vec![1]);
    assert_eq!(api_post(&c, 1, "/resume").await, 200);
    new_primary(&c, 0, Duration::from_secs(30)).await;
}

/// In maintenance mode a leader is never demoted, so an etcd outage past
/// its lease leaves it primary and still answering `/primary` (as Patroni's
/// does); once etcd is back it reads and renews again, and a key that ran
/// out is taken back by the running primary, not left for an election
/// beside it at the resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_outlives_an_etcd_outage_and_keeps_the_key() {
    let mut c = cluster().nodes(2).start();
    healthy(&c, 1, BOOTSTRAP).await;
    assert_eq!(api_post(&c, 0, "/pause").await, 200);
    all_see_the_pause(&c).await;
    c.etcd().stop(0);
    // Well past the lease (demotion is due 3 s after the last renewal).
    let quiet = tokio::time::Instant::now() + Duration::from_secs(8);
    while tokio::time::Instant::now() < quiet {
        assert_eq!(writable(&c).await, vec![0], "{}", c.logs());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(c.api_status(0, "/primary"), Some(200));
    assert_eq!(c.api_status(1, "/primary"), Some(503));
    c.etcd().start_again(0);
    eventually(
        "n1 reads etcd again and holds the key",
        Duration::from_secs(30),
        || n1_reads_etcd_and_holds_the_key(&c),
    )
    .await;
    // The key gone (its lease ran out in the outage, or removed by hand):
    // the running primary takes it back while paused.
    let dcs = cluster_dcs(&c).await;
    assert!(dcs.release_leader("n1").await.unwrap());
    eventually(
        "n1 takes the free key back",
        Duration::from_secs(30),
        || n1_reads_etcd_and_holds_the_key(&c),
    )
    .await;
    assert_eq!(api_post(&c, 0, "/resume").await, 200);
    let quiet = tokio::time::Instant::now() + Duration::from_secs(4);
    while tokio::time::Instant::now() < quiet {
        assert_eq!(writable(&c).await, vec![0], "{}", c.logs());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(
        read_cluster(&c).await.leader.map(|l| l.name).as_deref(),
        Some("n1")
    );
}

/// Whether n1's agent reads etcd and the leader key names n1.
async fn n1_reads_etcd_and_holds_the_key(c: &AgentCluster) -> Result<(), String> {
    let status: serde_json::Value =
        serde_json::from_str(&api_get_text(c, 0, "/patroni").await).unwrap();
    let leader = read_cluster(c).await.leader.map(|l| l.name);
    (status["dcs_reachable"] == true && leader.as_deref() == Some("n1"))
        .then_some(())
        .ok_or(format!("leader {leader:?}, n1 {status}"))
}

/// An ordered restart restarts a server that runs, in its role: it never
/// starts one that is stopped, such as a leader a switchover stopped in
/// maintenance mode, which would come back as a second primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_order_never_starts_a_stopped_member() {
    let c = cluster().start();
    healthy(&c, 2, BOOTSTRAP).await;
    // Pausing a connection manager's services takes the API's credentials
    // in agent mode (switchovers send them), from this machine too.
    let pause = format!(
        "http://127.0.0.1:{}/pause?service=read_write",
        c.node(1).http_port
    );
    let post = |auth| {
        let pause = pause.clone();
        async move {
            pgwarden_agent::http_client::request("POST", &pause, None, auth, Duration::from_secs(5))
                .await
                .unwrap()
                .status
        }
    };
    assert_eq!(post(None).await, 401);
    assert_eq!(post(Some(("pgwarden", "wrong"))).await, 401);
    assert_eq!(post(Some(("pgwarden", "secret"))).await, 200);
    let resume = pause.replace("/pause", "/resume");
    let r = pgwarden_agent::http_client::request(
        "POST",
        &resume,
        None,
        Some(("pgwarden", "secret")),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(api_post(&c, 1, "/pause").await, 200);
    all_see_the_pause(&c).await;
    switch_over(&c, "n1", "n2").await;
    eventually(
        "n1 stopped, n2 the only primary",
        Duration::from_secs(30),
        || async {
            let w = writable(&c).await;
            let stopped = one(&c.node(0).pg_conninfo(), "SELECT 1").await.is_err();
            (w == vec![1] && stopped)
                .then_some(())
                .ok_or(format!("writable {w:?}, n1 stopped: {stopped}"))
        },
    )
    .await;
    // The published state may be a loop old: the API or the loop refuses.
    let r = api_call(&c, 0, "POST", "/restart", serde_json::json!({})).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("not running"), "{}", r.body);
    let quiet = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < quiet {
        assert_eq!(writable(&c).await, vec![1], "{}", c.logs());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn former_primary_rejoins_as_a_replica_after_a_rewind() {
    let mut c = cluster().start();
    healthy(&c, 2, BOOTSTRAP).await;
    query(
        &c.node(0).pg_conninfo(),
        "CREATE TABLE ha_log (id serial PRIMARY KEY)",
    )
    .await
    .unwrap();
    // Freeze the replicas' WAL receivers so the old primary's last writes
    // exist only there: its history forks from the new leader's.
    let receivers = freeze_wal_receivers(&c, &[1, 2]).await;
    query(
        &c.node(0).pg_conninfo(),
        "INSERT INTO ha_log SELECT FROM generate_series(1, 100)",
    )
    .await
    .unwrap();
    c.kill_node(0);
    thaw(&receivers);
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    query(
        &c.node(np).pg_conninfo(),
        "INSERT INTO ha_log DEFAULT VALUES",
    )
    .await
    .unwrap();
    c.start_agent(0);
    healthy(&c, 2, Duration::from_secs(60)).await;
    assert_eq!(
        writable(&c).await,
        vec![np],
        "the old primary came back as a replica"
    );
    let r = (0..3).find(|&i| i != np && i != 0).unwrap();
    // The other replica followed the new timeline by streaming, so its
    // control file may still name the old one. Cut off from the leader's
    // WAL while the leader answers, it is left as it is: nothing to rewind.
    let leader = c.node(np).pg_conninfo();
    let hba_path = c.node(np).data_dir.join("pg_hba.conf");
    let hba = std::fs::read_to_string(&hba_path).unwrap();
    std::fs::write(
        &hba_path,
        format!("host replication all 127.0.0.1/32 reject\n{hba}"),
    )
    .unwrap();
    query(
        &leader,
        "SELECT pg_reload_conf(); SELECT pg_terminate_backend(pid) FROM pg_stat_replication",
    )
    .await
    .unwrap();
    gives(
        &leader,
        "SELECT count(*) FROM pg_stat_replication",
        "0",
        Duration::from_secs(20),
    )
    .await;
    rounds_since(&c, r, pgwarden_agent::record::unix_ms(), 3).await;
    std::fs::write(&hba_path, &hba).unwrap();
    query(&leader, "SELECT pg_reload_conf()").await.unwrap();
    healthy(&c, 2, Duration::from_secs(30)).await;
    let log = c.node(r).agent_log();
    assert!(!log.contains("it must rewind"), "{log}");
    // A replica's agent restarted over its data directory keeps it: no
    // clone, still a streaming replica.
    c.kill_agent(r);
    c.start_agent(r);
    eventually(
        "the restarted agent reports its replica",
        Duration::from_secs(20),
        || async {
            let log = c.node(r).agent_log();
            (log.matches("starting the HA agent").count() == 2
                && log.contains("existing data directory"))
            .then_some(())
            .ok_or("not yet".to_string())
        },
    )
    .await;
    healthy(&c, 2, Duration::from_secs(30)).await;
    assert_eq!(
        c.node(r).agent_log().matches("cloning the leader").count(),
        1
    );
    let log = c.node(0).agent_log();
    assert!(
        log.contains("rewound onto the history of the leader"),
        "{log}"
    );
}

/// An archive that refuses every WAL file until `open` exists, and the
/// settings that archive into it; like the archive commands PostgreSQL's
/// documentation shows, it refuses to overwrite a file.
struct RefusingArchive {
    scratch: tempfile::TempDir,
    parameters: String,
}

impl RefusingArchive {
    fn new() -> RefusingArchive {
        use std::os::unix::fs::PermissionsExt;
        let scratch = tempfile::tempdir().unwrap();
        let archive = scratch.path().join("archive");
        std::fs::create_dir(&archive).unwrap();
        std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&archive, std::fs::Permissions::from_mode(0o777)).unwrap();
        let command = format!(
            "test -f {} && test ! -f {dir}/%f && cp %p {dir}/%f",
            scratch.path().join("open").display(),
            dir = archive.display()
        );
        RefusingArchive {
            parameters: format!("archive_mode = \"on\", archive_command = \"{command}\""),
            scratch,
        }
    }

    fn open(&self) {
        std::fs::write(self.scratch.path().join("open"), "").unwrap();
    }

    fn holds(&self, name: &str) -> bool {
        self.scratch.path().join("archive").join(name).exists()
    }
}

/// Writes two WAL segments on node `i` and waits until it has at least two
/// waiting for the archive; their names.
async fn unarchived_segments(c: &AgentCluster, i: usize) -> Vec<String> {
    let conninfo = c.node(i).pg_conninfo();
    for _ in 0..2 {
        query(
            &conninfo,
            "CREATE TABLE IF NOT EXISTS archived (id int); \
             INSERT INTO archived SELECT generate_series(1, 1000); SELECT pg_switch_wal()",
        )
        .await
        .unwrap();
    }
    let status = c.node(i).data_dir.join("pg_wal/archive_status");
    eventually(
        "segments wait for the archive",
        Duration::from_secs(20),
        || async {
            let names: Vec<String> = std::fs::read_dir(&status)
                .map_err(|e| e.to_string())?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter_map(|n| n.strip_suffix(".ready").map(str::to_string))
                .collect();
            (names.len() >= 2)
                .then_some(names)
                .ok_or("not yet".to_string())
        },
    )
    .await
}

/// A former primary whose archiving lagged hands the archive what it still
/// held before its rewind: crash recovery, pg_rewind and a standby's
/// restart points would remove those WAL files unarchived, and the archive
/// would have a gap no point-in-time recovery crosses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_former_primary_archives_its_waiting_wal_before_it_rewinds() {
    let archive = RefusingArchive::new();
    let mut c = cluster().pg_parameters(&archive.parameters).start();
    healthy(&c, 2, BOOTSTRAP).await;
    let receivers = freeze_wal_receivers(&c, &[1, 2]).await;
    // Segments only the old primary has, completed and waiting.
    let waiting = unarchived_segments(&c, 0).await;
    c.kill_node(0);
    thaw(&receivers);
    new_primary(&c, 0, Duration::from_secs(30)).await;
    archive.open();
    c.start_agent(0);
    healthy(&c, 2, Duration::from_secs(60)).await;
    let log = c.node(0).agent_log();
    assert!(
        log.contains("rewound onto the history of the leader"),
        "{log}"
    );
    // Only its own files, each once: what the new leader's archiver has to
    // send (its history file, say) came over with pg_rewind and is not
    // sent from here, and what was archived before the crash recovery is
    // not sent again after it.
    let sent: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("archiving WAL the server had not archived"))
        .filter_map(|l| l.split("file=").nth(1)?.split_whitespace().next())
        .collect();
    assert!(!log.contains("archive_command failed"), "{log}");
    for (i, f) in sent.iter().enumerate() {
        assert!(f.starts_with("00000001"), "{f} is the new leader's\n{log}");
        assert!(!sent[..i].contains(f), "{f} sent twice\n{log}");
    }
    for name in &waiting {
        assert!(
            archive.holds(name),
            "{name} never reached the archive\n{log}"
        );
    }
}

/// A primary handed over cleanly with its archive down keeps its waiting
/// WAL as a standby, whose restart points would remove it unarchived: the
/// next start archives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_start_archives_wal_its_primary_days_left_waiting() {
    let archive = RefusingArchive::new();
    let mut c = cluster().pg_parameters(&archive.parameters).start();
    healthy(&c, 2, BOOTSTRAP).await;
    let waiting = unarchived_segments(&c, 0).await;
    let (n1, n2) = (c.node(0).name.clone(), c.node(1).name.clone());
    switch_over(&c, &n1, &n2).await;
    healthy(&c, 2, Duration::from_secs(60)).await;
    assert_eq!(writable(&c).await, vec![1]);
    // Still waiting, and still there: the archive refused them at the
    // shutdown and at the start as a standby, and no restart point has
    // removed them yet.
    let wal = c.node(0).data_dir.join("pg_wal");
    for name in &waiting {
        assert!(!archive.holds(name), "{name}");
        assert!(wal.join(name).exists(), "{name} removed");
        assert!(
            wal.join(format!("archive_status/{name}.ready")).exists(),
            "{name} not waiting"
        );
    }
    c.kill_node(0);
    archive.open();
    c.start_agent(0);
    healthy(&c, 2, Duration::from_secs(60)).await;
    let log = c.node(0).agent_log();
    for name in &waiting {
        assert!(
            archive.holds(name),
            "{name} never reached the archive\n{log}"
        );
    }
}

/// Waits until node `i`'s agent has published its record at least `n`
/// loop waits (1 s here) after `since_ms`: rounds of its loop ran in
/// between.
async fn rounds_since(c: &AgentCluster, i: usize, since_ms: u64, n: u64) {
    let name = c.node(i).name.clone();
    eventually(
        &format!("{name} runs {n} more rounds"),
        Duration::from_secs(n * 5 + 10),
        || async {
            let snapshot = read_cluster(c).await;
            let updated = pgwarden_agent::record::records(&snapshot)
                .into_iter()
                .find(|m| m.state.name == name)
                .map_or(0, |m| m.updated_ms);
            (updated >= since_ms + n * 1000)
                .then_some(())
                .ok_or(format!("last published at {updated}"))
        },
    )
    .await;
}

/// The system identifier of the database in `data_dir`, from
/// pg_controldata.
fn system_identifier(data_dir: &std::path::Path) -> String {
    let mut spec = pgwarden_pgctl::InstanceSpec::new("probe", data_dir, 1);
    spec.host = "127.0.0.1".into();
    let instance = pgwarden_pgctl::Instance::new(
        spec,
        pgwarden_pgctl::PgBinaries::discover().unwrap(),
        pgwarden_pgctl::RunAs::current(),
    );
    instance
        .controldata()
        .unwrap()
        .remove("Database system identifier")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_directory_of_another_database_is_never_started() {
    let mut c = cluster().nodes(2).hold_back(1).start();
    healthy(&c, 0, BOOTSTRAP).await;
    let ours = system_identifier(&c.node(0).data_dir);
    assert_eq!(read_cluster(&c).await.initialize.as_deref(), Some(&*ours));
    // Another database where n2's data directory goes: the wrong backup
    // restored, or a node pointed at the wrong cluster.
    let data_dir = c.node(1).data_dir.clone();
    let mut spec = pgwarden_pgctl::InstanceSpec::new("n2", &data_dir, c.node(1).pg_port);
    spec.host = "127.0.0.1".into();
    let run_as = if nix::unistd::geteuid().is_root() {
        pgwarden_pgctl::RunAs::unprivileged().unwrap()
    } else {
        pgwarden_pgctl::RunAs::current()
    };
    pgwarden_pgctl::Instance::new(
        spec,
        pgwarden_pgctl::PgBinaries::discover().unwrap(),
        run_as,
    )
    .initdb("postgres")
    .unwrap();
    let theirs = system_identifier(&data_dir);
    assert_ne!(theirs, ours);

    c.start_agent(1);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = c.agent_exit(1) {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent of n2 kept running\n{}",
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let log = c.node(1).agent_log();
    assert!(!status.success(), "{status}\n{log}");
    assert!(
        log.contains("holds another database")
            && log.contains(&format!("system identifier {theirs}"))
            && log.contains(&format!("system identifier {ours}")),
        "{log}"
    );
    // Never started: a postmaster writes postmaster.opts at every start.
    assert_eq!(c.node(1).postmaster_pid(), None);
    assert!(!data_dir.join("postmaster.opts").exists(), "{log}");
    assert_eq!(system_identifier(&data_dir), theirs);
    // The cluster is as it was: same identifier, n2 never a member, n1
    // leads and takes writes.
    let snap = read_cluster(&c).await;
    assert_eq!(snap.initialize.as_deref(), Some(&*ours));
    assert!(
        snap.members.iter().all(|(name, _)| name != "n2"),
        "{:?}",
        snap.members
    );
    assert_eq!(snap.leader.map(|l| l.name).as_deref(), Some("n1"));
    assert_eq!(writable(&c).await, vec![0]);
}

/// Waits until etcd's `initialize` key holds `id`.
async fn identifier_recorded(c: &AgentCluster, id: &str, within: Duration) {
    eventually("the identifier recorded", within, || async {
        let now = read_cluster(c).await.initialize;
        (now.as_deref() == Some(id))
            .then_some(())
            .ok_or(format!("{now:?}"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_without_a_recorded_identifier_gets_its_leaders() {
    let mut c = cluster().nodes(1).start();
    healthy(&c, 0, BOOTSTRAP).await;
    let ours = system_identifier(&c.node(0).data_dir);
    // etcd lost the key (restored from an old snapshot, or the cluster was
    // made by hand and then put under an agent).
    c.stop_agent(0);
    let dcs = cluster_dcs(&c).await;
    assert!(dcs.cancel_initialize(&ours).await.unwrap());
    assert_eq!(read_cluster(&c).await.initialize, None);
    c.start_agent(0);
    healthy(&c, 0, Duration::from_secs(60)).await;
    assert_eq!(read_cluster(&c).await.initialize.as_deref(), Some(&*ours));
    let log = c.node(0).agent_log();
    assert!(log.contains("recorded this data directory's"), "{log}");
    // Lost while the agent runs, it is put back too.
    assert!(dcs.cancel_initialize(&ours).await.unwrap());
    identifier_recorded(&c, &ours, Duration::from_secs(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_member_clones_the_leader_when_etcd_lost_the_identifier() {
    let mut c = AgentCluster::builder(env!("CARGO_BIN_EXE_pgwarden"))
        .agent_settings("ttl = 30\nloop_wait = 10\nretry_timeout = 10")
        .nodes(2)
        .hold_back(1)
        .etcd_relays()
        .start();
    healthy(&c, 0, BOOTSTRAP).await;
    let ours = system_identifier(&c.node(0).data_dir);
    // The leader cannot put the key back while cut off; its key and record
    // stay for the ttl.
    c.etcd_relay(0).set_blackhole(true);
    let dcs = cluster_dcs(&c).await;
    assert!(dcs.cancel_initialize(&ours).await.unwrap());
    c.launch_held_back(1);
    eventually(
        "n2 has a data directory",
        Duration::from_secs(60),
        || async {
            (c.node(1).postmaster_pid().is_some())
                .then_some(())
                .ok_or("no postmaster yet".to_string())
        },
    )
    .await;
    let log = c.node(1).agent_log();
    assert!(
        log.contains("cloning the leader") && !log.contains("won the initialize race"),
        "{log}"
    );
    assert_eq!(system_identifier(&c.node(1).data_dir), ours);
    c.etcd_relay(0).set_blackhole(false);
    healthy(&c, 1, BOOTSTRAP).await;
    identifier_recorded(&c, &ours, Duration::from_secs(30)).await;
}

/// A member that finds its own claim on a cluster without data (its race
/// won, but etcd's answer lost on the way back, or the agent stopped
/// before initdb) creates the cluster: no one else will while the claim
/// stands, and waiting for a leader would wait for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_holds_the_claim_creates_the_cluster() {
    let mut c = cluster().nodes(2).hold_back(0).hold_back(1).start();
    let dcs = cluster_dcs(&c).await;
    let claim = pgwarden_ha::identity::claim("n1");
    assert!(dcs.initialize_race(&claim).await.unwrap());
    c.launch_held_back(0);
    c.launch_held_back(1);
    healthy(&c, 1, BOOTSTRAP).await;
    assert_eq!(writable(&c).await, vec![0]);
    let ours = system_identifier(&c.node(0).data_dir);
    identifier_recorded(&c, &ours, Duration::from_secs(30)).await;
    assert_eq!(system_identifier(&c.node(1).data_dir), ours);
}

/// A CA, a certificate naming 127.0.0.1 for etcd, and a client
/// certificate (files), all in `dir`.
fn etcd_certs(
    dir: &std::path::Path,
) -> (
    pgwarden_testkit::etcd::EtcdTls,
    (std::path::PathBuf, std::path::PathBuf),
) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "pgwarden test etcd CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let ca_file = write("etcd-ca.pem", ca.pem());
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let client_key = KeyPair::generate().unwrap();
    let client = CertificateParams::new(vec!["pgwarden-agent".to_string()])
        .unwrap()
        .signed_by(&client_key, &issuer)
        .unwrap();
    let tls = pgwarden_testkit::etcd::EtcdTls {
        ca_file,
        cert_file: write("etcd.crt", server.pem()),
        key_file: write("etcd.key", server_key.serialize_pem()),
        client_cert_auth: true,
    };
    let client = (
        write("agent.crt", client.pem()),
        write("agent.key", client_key.serialize_pem()),
    );
    (tls, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_reach_etcd_over_tls_with_a_client_certificate_and_a_password() {
    let certs = tempfile::tempdir().unwrap();
    let (tls, (cert, key)) = etcd_certs(certs.path());
    let mut c = cluster()
        .nodes(3)
        .hold_back(2)
        .etcd_tls(tls.clone(), Some((cert.clone(), key.clone())))
        .etcd_auth("pgwarden", "s3cret")
        .start();
    healthy(&c, 1, BOOTSTRAP).await;
    let read = |p: &std::path::Path| std::fs::read(p).unwrap();
    let security = pgwarden_dcs::EtcdSecurity {
        ca_pem: Some(read(&tls.ca_file)),
        identity: Some((read(&cert), read(&key))),
        user: Some(("pgwarden".into(), "s3cret".into())),
    };
    let connect = |s: pgwarden_dcs::EtcdSecurity| {
        let endpoint = c.etcd_endpoint();
        let cluster = c.cluster_name().to_string();
        async move {
            pgwarden_dcs::EtcdDcs::connect_with(
                &[endpoint],
                "pgwarden",
                &cluster,
                Duration::from_secs(2),
                &s,
            )
            .await
        }
    };
    let dcs = connect(security.clone()).await.unwrap();
    // A new replica streams a moment before its agent publishes its record.
    eventually("both members in etcd", Duration::from_secs(10), || async {
        let snap = dcs.read_cluster().await.map_err(|e| e.to_string())?;
        let leader = snap.leader.map(|l| l.name);
        (leader.as_deref() == Some("n1") && snap.members.len() == 2)
            .then_some(())
            .ok_or(format!("leader {leader:?}, members {:?}", snap.members))
    })
    .await;
    // Idle for longer than a token lives (2 s here): the next request logs
    // in again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(dcs.read_cluster().await.is_ok());
    // etcd takes neither a client without the password, nor one without
    // a certificate.
    let anonymous = pgwarden_dcs::EtcdSecurity {
        user: None,
        ..security.clone()
    };
    if let Ok(d) = connect(anonymous).await {
        assert!(d.read_cluster().await.is_err());
    }
    let no_certificate = pgwarden_dcs::EtcdSecurity {
        identity: None,
        ..security.clone()
    };
    if let Ok(d) = connect(no_certificate).await {
        assert!(d.read_cluster().await.is_err());
    }
    // An agent with a wrong password says why it cannot go on, and starts
    // nothing.
    let config = c.node(2).config.clone();
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"s3cret\"", "\"wrong\"")).unwrap();
    c.start_agent(2);
    eventually(
        "n2 reports the refused password",
        Duration::from_secs(30),
        || async {
            let log = c.node(2).agent_log();
            log.contains("authentication failed")
                .then_some(())
                .ok_or(log)
        },
    )
    .await;
    assert_eq!(c.node(2).postmaster_pid(), None);
    assert!(!c.node(2).data_dir.exists());
    c.kill_agent(2);
    // A failover, which needs the lease to lapse and the watch to see it.
    c.kill_node(0);
    assert_eq!(new_primary(&c, 0, Duration::from_secs(30)).await, 1);
}

/// Kills the only etcd member and checks that node 0, the leader, keeps
/// taking writes well past the lease (6 s) and the demotion deadline
/// (3 s): with failsafe on, while every member acknowledges it.
async fn leader_stands_through_an_etcd_outage(c: &mut AgentCluster) {
    c.etcd().kill(0);
    let until = tokio::time::Instant::now() + Duration::from_secs(12);
    while tokio::time::Instant::now() < until {
        assert!(takes_writes(c, 0).await, "the leader demoted\n{}", c.logs());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(c
        .node(0)
        .agent_log()
        .contains("every member acknowledges this leader"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewed_api_certificates_take_effect_on_a_reload() {
    let certs = tempfile::tempdir().unwrap();
    let (tls, _) = etcd_certs(certs.path());
    let mut c = cluster()
        .nodes(2)
        .agent_settings("failsafe = true")
        .api_tls(pgwarden_testkit::agents::ApiTls {
            cert_file: tls.cert_file.clone(),
            key_file: tls.key_file.clone(),
            ca_file: tls.ca_file.clone(),
            verify_client: "none",
        })
        .start();
    let p = healthy(&c, 1, BOOTSTRAP).await;
    assert_eq!(p, 0, "node 0 bootstraps the cluster");
    assert_eq!(c.api_status(0, "/health"), Some(200));
    // Renewal: a new CA and certificates at the same paths. Until the
    // agents reload, they still present the old ones, which the new CA
    // does not sign.
    let fresh = tempfile::tempdir().unwrap();
    let (new, _) = etcd_certs(fresh.path());
    for (from, to) in [
        (&new.ca_file, &tls.ca_file),
        (&new.cert_file, &tls.cert_file),
        (&new.key_file, &tls.key_file),
    ] {
        std::fs::copy(from, to).unwrap();
    }
    assert_eq!(c.api_status(0, "/health"), None);
    for i in 0..2 {
        c.reload_agent(i);
    }
    for i in 0..2 {
        eventually(
            "the API presents the renewed certificate",
            Duration::from_secs(20),
            || async {
                (c.api_status(i, "/health") == Some(200))
                    .then_some(())
                    .ok_or(format!("node {i}"))
            },
        )
        .await;
    }
    // The members trust the new CA too: their failsafe acknowledgements
    // keep the leader through an etcd outage.
    leader_stands_through_an_etcd_outage(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rest_api_over_https_carries_failsafe_acknowledgements_and_ctl() {
    let certs = tempfile::tempdir().unwrap();
    // A certificate naming 127.0.0.1, as every member's API needs here.
    let (tls, _) = etcd_certs(certs.path());
    let ca = tls.ca_file.clone();
    let mut c = cluster()
        .agent_settings("failsafe = true")
        .api_tls(pgwarden_testkit::agents::ApiTls {
            cert_file: tls.cert_file.clone(),
            key_file: tls.key_file.clone(),
            ca_file: ca.clone(),
            verify_client: "none",
        })
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    pgwarden_agent::http_client::trust(&ca).unwrap();
    assert!(c.node(0).api_url().starts_with("https://"));
    // Plain HTTP gets no answer.
    assert_eq!(
        pgwarden_testkit::agents::http_status(c.node(0).api_port, "/health"),
        None
    );
    let url = format!("{}/cluster", c.node(0).api_url());
    eventually(
        "the leader knows all three members, at https:// URLs",
        Duration::from_secs(10),
        || async {
            let v = pgwarden_agent::http_client::get_json(&url, Duration::from_secs(2))
                .await
                .map_err(|e| e.to_string())?;
            let urls: Vec<&str> = v["members"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["api_url"].as_str())
                .collect();
            (urls.len() == 3 && urls.iter().all(|u| u.starts_with("https://")))
                .then_some(())
                .ok_or(format!("{urls:?}"))
        },
    )
    .await;
    let ctl = |extra: &[&str]| {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"));
        cmd.arg("ctl").arg("--api").arg(c.node(0).api_url());
        cmd.args(extra).arg("list");
        cmd.env_remove("PGWARDEN_API_CA");
        cmd.output()
    };
    let out = ctl(&["--cacert", ca.to_str().unwrap()]).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && ["n1", "n2", "n3"].iter().all(|n| text.contains(n)),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl(&[]).await.unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--cacert"));
    // In an etcd outage the leader stands only while every member
    // acknowledges it through its API: over HTTPS here.
    leader_stands_through_an_etcd_outage(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_restart_happens_at_its_time_when_its_conditions_hold() {
    let events = tempfile::NamedTempFile::new().unwrap();
    let path = events.path().display().to_string();
    let c = cluster()
        .nodes(2)
        .agent_settings(&format!(
            "on_stop = \"echo >> {path}\"\non_restart = \"echo >> {path}\"\non_reload = \"echo >> {path}\""
        ))
        .start();
    healthy(&c, 1, BOOTSTRAP).await;
    let write = |i: usize, method: &'static str, body: serde_json::Value| {
        let url = format!("{}/restart", c.node(i).api_url());
        async move {
            pgwarden_agent::http_client::request(
                method,
                &url,
                Some(&body),
                Some(("pgwarden", "secret")),
                Duration::from_secs(10),
            )
            .await
            .unwrap()
        }
    };
    let patroni = |i: usize| member_status(&c, i);
    // A setting that takes effect only at a restart, on the replica alone.
    let replica = c.node(1).pg_conninfo();
    query(&replica, "ALTER SYSTEM SET max_prepared_transactions = 7")
        .await
        .unwrap();
    query(&replica, "SELECT pg_reload_conf()").await.unwrap();
    eventually(
        "n2 reports a pending restart",
        Duration::from_secs(20),
        || async {
            let v = patroni(1).await?;
            (v["pending_restart"] == true)
                .then_some(())
                .ok_or(v.to_string())
        },
    )
    .await;
    // Nothing is pending on the leader: a conditional restart is refused.
    let r = write(0, "POST", serde_json::json!({"restart_pending": true})).await;
    assert_eq!(r.status, 503, "{}", r.body);

    let at = |secs: u64| {
        pgwarden_ha::format_timestamp((pgwarden_agent::record::unix_ms() + secs * 1000) as i64)
    };
    let order =
        |t: &str| serde_json::json!({"schedule": t, "role": "replica", "restart_pending": true});
    let first = at(60);
    assert_eq!(write(1, "POST", order(&first)).await.status, 202);
    eventually(
        "n2 shows the scheduled restart",
        Duration::from_secs(10),
        || async {
            let v = patroni(1).await?;
            (v["scheduled_restart"]["schedule"] == first.as_str())
                .then_some(())
                .ok_or(v.to_string())
        },
    )
    .await;
    assert_eq!(write(1, "POST", order(&at(90))).await.status, 409);
    assert_eq!(write(1, "DELETE", serde_json::json!({})).await.status, 200);
    eventually("the restart withdrawn", Duration::from_secs(10), || async {
        let v = patroni(1).await?;
        v["scheduled_restart"]
            .is_null()
            .then_some(())
            .ok_or(v.to_string())
    })
    .await;
    // `ctl restart --all --scheduled`: an order for every member.
    let later = at(600);
    let (ok, text, err) = ctl_restart(&c, &["--all", "--scheduled", &later]).await;
    assert!(ok, "{text}{err}");
    for i in 0..2 {
        eventually("the restart scheduled", Duration::from_secs(10), || async {
            let v = patroni(i).await?;
            (v["scheduled_restart"]["schedule"] == later.as_str())
                .then_some(())
                .ok_or(v.to_string())
        })
        .await;
        assert_eq!(write(i, "DELETE", serde_json::json!({})).await.status, 200);
    }

    let pid = c.node(1).postmaster_pid().unwrap();
    let due_ms = pgwarden_agent::record::unix_ms() + 8000;
    let second = pgwarden_ha::format_timestamp(due_ms as i64);
    assert_eq!(write(1, "POST", order(&second)).await.status, 202);
    // Two seconds before its time (by the clock, whatever the request
    // took), nothing has happened yet.
    let early = due_ms.saturating_sub(2000);
    let now = pgwarden_agent::record::unix_ms();
    tokio::time::sleep(Duration::from_millis(early.saturating_sub(now))).await;
    let looked_at = pgwarden_agent::record::unix_ms();
    let seen = c.node(1).postmaster_pid();
    if looked_at < due_ms {
        assert_eq!(seen, Some(pid), "restarted early");
    }
    eventually("n2 restarted", Duration::from_secs(30), || async {
        let v = patroni(1).await?;
        let restarted = c.node(1).postmaster_pid().is_some_and(|p| p != pid);
        // While its server is down the member says so ("stopped").
        (restarted
            && v["state"] == "running"
            && v["pending_restart"] == false
            && v["scheduled_restart"].is_null())
        .then_some(())
        .ok_or(v.to_string())
    })
    .await;
    assert!(pgwarden_agent::record::unix_ms() >= due_ms);
    assert_eq!(
        one(&replica, "SHOW max_prepared_transactions")
            .await
            .unwrap(),
        "7"
    );
    let log = c.node(1).agent_log();
    assert!(
        log.contains("restart scheduled") && log.contains("scheduled restart cancelled"),
        "{log}"
    );
    // The restart ran on_restart (and not on_stop); a reload runs on_reload.
    let cluster_name = c.cluster_name().to_string();
    let r = api_call(&c, 1, "POST", "/reload", serde_json::json!({})).await;
    assert_eq!(r.status, 202, "{}", r.body);
    eventually("the callbacks ran", Duration::from_secs(10), || async {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        (text.contains(&format!("on_restart replica {cluster_name}"))
            && text.contains(&format!("on_reload replica {cluster_name}")))
        .then_some(())
        .ok_or(text)
    })
    .await;
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains("on_stop"), "{text}");
}

/// Node `i`'s `GET /patroni`.
async fn member_status(c: &AgentCluster, i: usize) -> Result<serde_json::Value, String> {
    let url = format!("{}/patroni", c.node(i).api_url());
    pgwarden_agent::http_client::get_json(&url, Duration::from_secs(2))
        .await
        .map_err(|e| e.to_string())
}

/// A write request to node `i`'s API, with the kit's credentials.
async fn api_call(
    c: &AgentCluster,
    i: usize,
    method: &str,
    path: &str,
    body: serde_json::Value,
) -> pgwarden_agent::http_client::Response {
    let url = format!("{}{path}", c.node(i).api_url());
    pgwarden_agent::http_client::request(
        method,
        &url,
        Some(&body),
        Some(("pgwarden", "secret")),
        Duration::from_secs(10),
    )
    .await
    .unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}

/// `PATCH /config` through node `i`'s API, which must take it.
async fn patch_config_ok(c: &AgentCluster, i: usize, patch: serde_json::Value) {
    let r = api_call(c, i, "PATCH", "/config", patch).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A member that joins after a setting was raised that a standby must
/// hold at no less than its primary's value (here
/// `max_locks_per_transaction`) starts with the primary's value, which its
/// cloned control file records: with its own lower default PostgreSQL
/// would refuse to start in recovery, and the clone would be made again
/// for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_member_starts_with_the_primarys_raised_standby_minimums() {
    let mut c = cluster().nodes(3).hold_back(2).start();
    healthy(&c, 1, BOOTSTRAP).await;
    patch_config_ok(
        &c,
        0,
        serde_json::json!({"postgresql": {"parameters": {"max_locks_per_transaction": 128}}}),
    )
    .await;
    restart_pending_on(&c, 2).await;
    let (ok, text, err) = ctl_restart(&c, &["--all", "--pending"]).await;
    assert!(ok, "{text}{err}");
    gives(
        &c.node(0).pg_conninfo(),
        "SHOW max_locks_per_transaction",
        "128",
        Duration::from_secs(30),
    )
    .await;
    // The primary's control file records 128 after a checkpoint.
    query(&c.node(0).pg_conninfo(), "CHECKPOINT").await.unwrap();
    c.launch_held_back(2);
    healthy(&c, 2, BOOTSTRAP).await;
    gives(
        &c.node(2).pg_conninfo(),
        "SHOW max_locks_per_transaction",
        "128",
        Duration::from_secs(30),
    )
    .await;
    let log = c.node(2).agent_log();
    assert!(!log.contains("insufficient parameter settings"), "{log}");
}

/// Runs `pgwarden ctl restart ARGS` through node 0's API; its success,
/// and what it printed on its output and on its error output.
async fn ctl_restart(c: &AgentCluster, args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["ctl", "--api", &c.node(0).api_url(), "--password", "secret"])
        .arg("restart")
        .args(args)
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits until each of nodes `0..n` reports settings waiting for a restart.
async fn restart_pending_on(c: &AgentCluster, n: usize) {
    for i in 0..n {
        eventually("a pending restart", Duration::from_secs(20), || async {
            let v = member_status(c, i).await?;
            (v["pending_restart"] == true)
                .then_some(())
                .ok_or(v.to_string())
        })
        .await;
    }
}

/// Waits until `SHOW name` on every node gives `want`.
async fn everywhere(c: &AgentCluster, name: &str, want: &str) {
    for i in 0..c.len() {
        let conninfo = c.node(i).pg_conninfo();
        let q = format!("SHOW {name}");
        eventually(
            &format!("{name} = {want} on node {i}"),
            Duration::from_secs(30),
            || async {
                let v = one(&conninfo, &q).await?;
                (v == want).then_some(()).ok_or(v)
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_parameters_reach_every_member() {
    let c = cluster().nodes(2).start();
    healthy(&c, 1, BOOTSTRAP).await;
    let params = |p: serde_json::Value| serde_json::json!({"postgresql": {"parameters": p}});
    let patroni = |i: usize| member_status(&c, i);
    // For every member; shared_buffers is also in each node's own file,
    // which wins.
    patch_config_ok(
        &c,
        0,
        params(serde_json::json!({"work_mem": "8MB", "shared_buffers": "32MB"})),
    )
    .await;
    everywhere(&c, "work_mem", "8MB").await;
    everywhere(&c, "shared_buffers", "16MB").await;
    for i in 0..2 {
        assert_eq!(patroni(i).await.unwrap()["pending_restart"], false);
    }
    // One that takes a restart: pending on each member until it restarts.
    patch_config_ok(
        &c,
        0,
        params(serde_json::json!({"max_prepared_transactions": 5})),
    )
    .await;
    restart_pending_on(&c, 2).await;
    // `ctl restart --all --pending`: one member after the other, replicas
    // first, each back before the next.
    let (ok, text, err) = ctl_restart(&c, &["--all", "--pending"]).await;
    assert!(ok, "{text}{err}");
    let (n2, n1) = (
        text.find("n2: restarted").expect(&text),
        text.find("n1: restarted").expect(&text),
    );
    assert!(n2 < n1, "{text}");
    everywhere(&c, "max_prepared_transactions", "5").await;
    for i in 0..2 {
        assert_eq!(patroni(i).await.unwrap()["pending_restart"], false);
    }
    // Straight after the change, before any member's loop has applied
    // it: every member still restarts, or a replica would stay below its
    // primary's value and PostgreSQL would pause its replay.
    patch_config_ok(
        &c,
        0,
        params(serde_json::json!({"max_prepared_transactions": 7})),
    )
    .await;
    let (ok, text, err) = ctl_restart(&c, &["--all", "--pending"]).await;
    assert!(ok, "{text}{err}");
    assert!(
        text.contains("n2: restarted") && text.contains("n1: restarted"),
        "{text}"
    );
    everywhere(&c, "max_prepared_transactions", "7").await;

    // A value PostgreSQL refuses: each member says so, keeps its settings,
    // and refuses an ordered restart, which would not start again.
    patch_config_ok(
        &c,
        0,
        params(serde_json::json!({"max_prepared_transactions": "banana"})),
    )
    .await;
    for i in 0..2 {
        eventually(
            "the refused value is reported",
            Duration::from_secs(20),
            || async {
                let v = patroni(i).await?;
                let p = v["problem"].as_str().unwrap_or_default().to_string();
                (p.contains("refuses its configuration") && p.contains("max_prepared_transactions"))
                    .then_some(())
                    .ok_or(v.to_string())
            },
        )
        .await;
    }
    let (_, text, _) = ctl_restart(&c, &["--all"]).await;
    assert!(!text.contains("restarted"), "{text}");
    assert!(text.contains("fix the setting first"), "{text}");
    assert_eq!(writable(&c).await, vec![0]);
    everywhere(&c, "max_prepared_transactions", "7").await;
    patch_config_ok(
        &c,
        0,
        params(serde_json::json!({"max_prepared_transactions": 7})),
    )
    .await;
    for i in 0..2 {
        eventually("the problem is gone", Duration::from_secs(20), || async {
            let v = patroni(i).await?;
            v["problem"].is_null().then_some(()).ok_or(v.to_string())
        })
        .await;
    }

    // Removed: back to the default.
    patch_config_ok(&c, 1, params(serde_json::json!({"work_mem": null}))).await;
    everywhere(&c, "work_mem", "4MB").await;
    // What the agent manages, and values that are not scalars, are refused.
    for bad in [
        serde_json::json!({"port": 1}),
        serde_json::json!({"work_mem": [1]}),
    ] {
        let r = api_call(&c, 0, "PATCH", "/config", params(bad.clone())).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
    assert!(c
        .node(1)
        .agent_log()
        .contains("parameters applied: work_mem = 8MB"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_timing_reaches_every_member_and_the_leader_lease() {
    let mut c = cluster().nodes(2).start();
    let p = healthy(&c, 1, BOOTSTRAP).await;
    let generation = read_cluster(&c).await.leader.unwrap().generation;
    let timing_is = |ttl: f64, loop_wait: f64, lag: u64| {
        let c = &c;
        async move {
            for i in 0..2 {
                eventually(
                    &format!("node {i} runs ttl {ttl}, loop_wait {loop_wait}"),
                    Duration::from_secs(20),
                    || async {
                        let t = member_status(c, i).await?["settings"].clone();
                        (t["ttl"] == ttl
                            && t["loop_wait"] == loop_wait
                            && t["maximum_lag_on_failover"] == lag)
                            .then_some(())
                            .ok_or(t.to_string())
                    },
                )
                .await;
            }
        }
    };
    // Longer than the nodes' own ttl (6 s): the leader moves its key to a
    // lease of 14 s, which only the new ttl explains, without letting go
    // of it.
    patch_config_ok(
        &c,
        0,
        serde_json::json!({"ttl": 14, "loop_wait": 2, "maximum_lag_on_failover": 2097152}),
    )
    .await;
    timing_is(14.0, 2.0, 2097152).await;
    eventually(
        "the leader key on a lease of the new ttl",
        Duration::from_secs(20),
        || async {
            let l = read_cluster(&c).await.leader.ok_or("no leader")?;
            let left = l.ttl_left.unwrap_or_default();
            (left > Duration::from_secs(8) && l.generation == generation)
                .then_some(())
                .ok_or(format!("{left:?}, generation {}", l.generation))
        },
    )
    .await;

    // Timers that do not fit together are refused by the API, and ignored
    // by the agents when written to etcd directly.
    let r = api_call(&c, 1, "PATCH", "/config", serde_json::json!({"ttl": 3})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("exceeds ttl"), "{}", r.body);
    let dcs = cluster_dcs(&c).await;
    let mut config = read_cluster(&c).await.config.unwrap();
    config["ttl"] = serde_json::json!(3);
    dcs.put_config(&config).await.unwrap();
    for i in 0..2 {
        eventually("the bad timing logged", Duration::from_secs(20), || async {
            c.node(i)
                .agent_log()
                .contains("dynamic configuration not applied")
                .then_some(())
                .ok_or(String::new())
        })
        .await;
    }
    timing_is(14.0, 2.0, 2097152).await;

    // Shorter again; the key keeps its leadership throughout.
    patch_config_ok(
        &c,
        0,
        serde_json::json!({"ttl": 10, "loop_wait": 1, "maximum_lag_on_failover": null}),
    )
    .await;
    timing_is(10.0, 1.0, 1048576).await;
    eventually(
        "the leader key on a lease of 10 s",
        Duration::from_secs(20),
        || async {
            let l = read_cluster(&c).await.leader.ok_or("no leader")?;
            let left = l.ttl_left.unwrap_or_default();
            (left <= Duration::from_secs(10) && l.generation == generation)
                .then_some(())
                .ok_or(format!("{left:?}, generation {}", l.generation))
        },
    )
    .await;
    assert_eq!(
        read_cluster(&c).await.leader.unwrap().name,
        c.node(p).name,
        "no failover on the way"
    );

    // The moved lease still ends with its holder: the other member takes
    // over.
    c.kill_node(p);
    let other = c.node(1 - p).name.clone();
    leads(&c, &other, Duration::from_secs(40)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_protection_mode_and_failsafe_change_for_the_whole_cluster_at_run_time() {
    let mut c = cluster().nodes(2).start();
    let p = healthy(&c, 1, BOOTSTRAP).await;
    let (leader, replica) = (c.node(p).name.clone(), c.node(1 - p).name.clone());
    let direct = c.node(p).pg_conninfo();
    let protection_is = |want: &'static str| {
        let c = &c;
        async move {
            for i in 0..2 {
                eventually(
                    &format!("node {i} in {want}"),
                    Duration::from_secs(20),
                    || async {
                        let s = member_status(c, i).await?["settings"].clone();
                        (s["protection"] == want).then_some(()).ok_or(s.to_string())
                    },
                )
                .await;
            }
        }
    };
    // Patroni's switch: the leader lists the replica and the key claims it.
    patch_config_ok(&c, 1 - p, serde_json::json!({"synchronous_mode": true})).await;
    protection_is("maximum_availability").await;
    eventually(
        "the replica acknowledges commits",
        Duration::from_secs(30),
        || async {
            let names = one(&direct, "SHOW synchronous_standby_names").await?;
            let key = sync_key(&c).await;
            let ok = names == format!("FIRST 1 (\"{replica}\")")
                && key["leader"] == leader.as_str()
                && key["synchronous"] == true
                && key["members"] == serde_json::json!([replica]);
            ok.then_some(()).ok_or(format!("{names} / {key}"))
        },
    )
    .await;
    // pgwarden's own name, and back: with the key set to null each node's
    // own mode (maximum performance) returns, the key first claiming
    // nothing, then PostgreSQL no longer waiting.
    patch_config_ok(
        &c,
        0,
        serde_json::json!({"synchronous_mode": null, "protection": "maximum_protection"}),
    )
    .await;
    protection_is("maximum_protection").await;
    let r = api_call(
        &c,
        0,
        "PATCH",
        "/config",
        serde_json::json!({"protection": "maximum", "synchronous_mode": true}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    patch_config_ok(&c, 0, serde_json::json!({"protection": null})).await;
    protection_is("maximum_performance").await;
    eventually(
        "asynchronous replication",
        Duration::from_secs(30),
        || async {
            let names = one(&direct, "SHOW synchronous_standby_names").await?;
            let key = sync_key(&c).await;
            let ok = names.is_empty()
                && key["synchronous"] == false
                && key["members"] == serde_json::json!([]);
            ok.then_some(()).ok_or(format!("{names} / {key}"))
        },
    )
    .await;
    assert_eq!(read_cluster(&c).await.leader.unwrap().name, leader);

    // Failsafe, which no node's file turns on here: the leader then stands
    // through an etcd outage.
    patch_config_ok(&c, 0, serde_json::json!({"failsafe_mode": true})).await;
    for i in 0..2 {
        eventually("failsafe on", Duration::from_secs(20), || async {
            let s = member_status(&c, i).await?["settings"].clone();
            (s["failsafe_mode"] == true)
                .then_some(())
                .ok_or(s.to_string())
        })
        .await;
    }
    assert_eq!(p, 0, "node 0 bootstraps the cluster");
    leader_stands_through_an_etcd_outage(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_tagged_replicatefrom_cascades_and_falls_back_to_the_leader() {
    let mut c = cluster().node_settings(2, "replicatefrom = \"n2\"").start();
    let p = healthy(&c, 1, BOOTSTRAP).await;
    assert_eq!(p, 0, "node 0 bootstraps the cluster");
    let conninfos: Vec<String> = (0..3).map(|i| c.node(i).pg_conninfo()).collect();
    let streams_from = |i: usize| {
        let conninfo = conninfos[i].clone();
        async move {
            query(
                &conninfo,
                "SELECT application_name FROM pg_stat_replication \
                 WHERE state = 'streaming' ORDER BY 1",
            )
            .await
        }
    };
    // n3 streams from n2, through a slot that n2 keeps for it; the leader
    // keeps only n2's (the one n3's clone created goes after the grace).
    eventually("n3 streams from n2", Duration::from_secs(40), || async {
        let (a, b) = (streams_from(0).await?, streams_from(1).await?);
        (a == ["n2"] && b == ["n3"])
            .then_some(())
            .ok_or(format!("n1 feeds {a:?}, n2 feeds {b:?}"))
    })
    .await;
    slots_are(&c, 1, vec!["pgwarden_n3:true".into()]).await;
    slots_are(&c, 0, vec!["pgwarden_n2:true".into()]).await;
    let leader = c.node(0).pg_conninfo();
    query(
        &leader,
        "CREATE TABLE cascade_t (x int); INSERT INTO cascade_t VALUES (1)",
    )
    .await
    .unwrap();
    let n3 = c.node(2).pg_conninfo();
    gives(
        &n3,
        "SELECT count(*) FROM cascade_t",
        "1",
        Duration::from_secs(20),
    )
    .await;
    // ctl topology shows the chain.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["ctl", "--api", &c.node(0).api_url(), "topology"])
        .output()
        .unwrap();
    let tree = String::from_utf8_lossy(&out.stdout);
    let names: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.strip_prefix("| "))
        .filter_map(|l| l.split(" |").next())
        .map(str::trim_end)
        .collect();
    assert_eq!(names, ["Member", "n1", "+ n2", "  + n3"], "{tree}");

    // n2 is gone: n3 streams from the leader, which keeps its slot.
    c.kill_node(1);
    eventually(
        "n3 streams from the leader",
        Duration::from_secs(40),
        || async {
            let a = streams_from(0).await?;
            (a == ["n3"]).then_some(()).ok_or(format!("{a:?}"))
        },
    )
    .await;
    slots_are(&c, 0, vec!["pgwarden_n3:true".into()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_member_takes_no_reads_and_is_never_promoted() {
    let mut c = cluster().nodes(2).start();
    let p = healthy(&c, 1, BOOTSTRAP).await;
    let r = 1 - p;
    let (leader, replica) = (c.node(p).name.clone(), c.node(r).name.clone());
    let urls: Vec<String> = (0..2).map(|i| c.node(i).api_url()).collect();
    let ctl = |i: usize, args: Vec<String>| {
        let url = urls[i].clone();
        async move {
            tokio::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
                .args(["ctl", "--api", &url, "--password", "secret"])
                .args(args)
                .output()
                .await
                .unwrap()
        }
    };
    // Not the leader: switch over first.
    let out = ctl(r, vec!["fence".into(), leader.clone()]).await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("switch over"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl(p, vec!["fence".into(), replica.clone()]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eventually("the replica fenced", Duration::from_secs(20), || async {
        let v = member_status(&c, r).await?;
        (v["fenced"] == true && c.api_status(r, "/replica") == Some(503))
            .then_some(())
            .ok_or(v.to_string())
    })
    .await;
    // The read-only port no longer reaches it: reads fall back to the
    // primary.
    let ro = c.node(p).ro_conninfo();
    gives(
        &ro,
        "SELECT pg_is_in_recovery()",
        "f",
        Duration::from_secs(20),
    )
    .await;
    // The leader dies: the fenced replica does not take over.
    c.kill_node(p);
    eventually(
        "the fenced replica stays out",
        Duration::from_secs(30),
        || async {
            let v = member_status(&c, r).await?;
            let d = v["last_decision"].as_str().unwrap_or_default().to_string();
            (d.contains("not eligible (fenced)") && v["leader"].is_null())
                .then_some(())
                .ok_or(d)
        },
    )
    .await;
    // Unfenced, it leads.
    let out = ctl(r, vec!["unfence".into(), replica.clone()]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    leads(&c, &replica, Duration::from_secs(30)).await;
}

/// The replication slots of node `i`'s server, as `name:active`, sorted.
async fn slots_of(c: &AgentCluster, i: usize) -> Result<Vec<String>, String> {
    query(
        &c.node(i).pg_conninfo(),
        "SELECT slot_name || ':' || active FROM pg_replication_slots ORDER BY 1",
    )
    .await
}

/// Waits until node `i`'s slots are `want` ([`slots_of`]).
async fn slots_are(c: &AgentCluster, i: usize, want: Vec<String>) {
    eventually(
        &format!("node {i} has slots {want:?}"),
        Duration::from_secs(40),
        || async {
            let have = slots_of(c, i).await?;
            (have == want).then_some(()).ok_or(format!("{have:?}"))
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_stream_through_slots_that_the_leader_keeps_for_them() {
    let mut c = cluster().start();
    let p = healthy(&c, 2, BOOTSTRAP).await;
    let others: Vec<usize> = (0..3).filter(|&i| i != p).collect();
    let names: Vec<String> = (0..3).map(|i| c.node(i).name.clone()).collect();
    let slot = |i: usize| format!("pgwarden_{}", names[i]);
    // Each replica streams through its slot on the leader.
    slots_are(
        &c,
        p,
        others
            .iter()
            .map(|&i| format!("{}:true", slot(i)))
            .collect(),
    )
    .await;
    for &i in &others {
        assert_eq!(
            one(&c.node(i).pg_conninfo(), "SHOW primary_slot_name")
                .await
                .unwrap(),
            slot(i)
        );
    }
    // An operator's own slot is none of pgwarden's business.
    one(
        &c.node(p).pg_conninfo(),
        "SELECT slot_name FROM pg_create_physical_replication_slot('backup_tool')",
    )
    .await
    .unwrap();
    // A permanent slot of the dynamic configuration is kept by whoever
    // leads; the members' names and logical slots are refused.
    for bad in [
        serde_json::json!({"slots": {"pgwarden_x": {"type": "physical"}}}),
        serde_json::json!({"slots": {"decoder": {"type": "logical"}}}),
    ] {
        let r = api_call(&c, 0, "PATCH", "/config", bad.clone()).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
    patch_config_ok(
        &c,
        0,
        serde_json::json!({"slots": {"archiver": {"type": "physical"}}}),
    )
    .await;

    // A member gone for good: its slot goes once its key has expired and
    // the grace (two ttls) has passed, so its WAL does not pile up.
    let (gone, stays) = (others[0], others[1]);
    c.kill_node(gone);
    slots_are(
        &c,
        p,
        vec![
            "archiver:false".into(),
            "backup_tool:false".into(),
            format!("{}:true", slot(stays)),
        ],
    )
    .await;

    // A switchover: the new leader keeps a slot for the old one, which
    // streams through it and drops the slots of its own time as leader.
    let body = serde_json::json!({"leader": names[p], "candidate": names[stays]});
    let r = api_write(&c, stays, "POST", "/switchover", Some(body)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    slots_are(
        &c,
        stays,
        vec!["archiver:false".into(), format!("{}:true", slot(p))],
    )
    .await;
    slots_are(
        &c,
        p,
        vec!["archiver:false".into(), "backup_tool:false".into()],
    )
    .await;
    assert_eq!(
        one(&c.node(p).pg_conninfo(), "SHOW primary_slot_name")
            .await
            .unwrap(),
        slot(p)
    );
}

/// Waits until node `via`'s `/cluster` shows member `name` in `state`.
async fn shown_as(c: &AgentCluster, via: usize, name: &str, state: &str) {
    let url = format!("{}/cluster", c.node(via).api_url());
    eventually(
        &format!("{name} shown as {state}"),
        Duration::from_secs(30),
        || async {
            let v = pgwarden_agent::http_client::get_json(&url, Duration::from_secs(2))
                .await
                .map_err(|e| e.to_string())?;
            let shown = v["members"]
                .as_array()
                .and_then(|m| m.iter().find(|m| m["name"] == name))
                .and_then(|m| m["state"].as_str())
                .unwrap_or_default()
                .to_string();
            (shown == state).then_some(()).ok_or(shown)
        },
    )
    .await;
}

/// A switchover stops the leader first: only a standby that streams
/// receives its last WAL on the way down. One that does not is refused as
/// a candidate, and the leader keeps leading, until it streams again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_candidate_must_be_streaming() {
    let c = cluster().nodes(2).start();
    let p = healthy(&c, 1, BOOTSTRAP).await;
    let r = 1 - p;
    let names = ["n1", "n2"];
    let replica = c.node(r).pg_conninfo();
    let leader = c.node(p).pg_conninfo();
    query(&leader, "CREATE TABLE kept (v int)").await.unwrap();
    // The replica's WAL receiver points nowhere (ALTER SYSTEM outranks
    // the agent's own setting, which it leaves alone).
    let set = |sql: &'static str| {
        let replica = replica.clone();
        async move {
            for q in [sql, "SELECT pg_reload_conf()"] {
                query(&replica, q).await.unwrap();
            }
        }
    };
    set("ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port=1'").await;
    shown_as(&c, p, names[r], "in archive recovery").await;
    // Written now, this would be lost if the replica were promoted.
    one(&leader, "INSERT INTO kept VALUES (1) RETURNING v")
        .await
        .unwrap();
    let body = serde_json::json!({"leader": names[p], "candidate": names[r]});
    let res = api_write(&c, r, "POST", "/switchover", Some(body.clone())).await;
    assert_eq!(res.status, 412, "{}", res.body);
    assert!(res.body.contains("not streaming"), "{}", res.body);
    // Without a candidate there is no one to name either.
    let any = serde_json::json!({"leader": names[p]});
    let res = api_write(&c, p, "POST", "/switchover", Some(any)).await;
    assert_eq!(res.status, 412, "{}", res.body);
    assert_eq!(writable(&c).await, vec![p]);

    // The leader does not act on a request written past the API either.
    let dcs = cluster_dcs(&c).await;
    dcs.put_failover(&serde_json::json!({"from_leader": names[p], "candidate": names[r]}))
        .await
        .unwrap();
    rounds_since(&c, p, pgwarden_agent::record::unix_ms(), 3).await;
    assert_eq!(writable(&c).await, vec![p]);
    dcs.delete_failover().await.unwrap();

    // Streaming again, it is taken, and has every row.
    set("ALTER SYSTEM RESET primary_conninfo").await;
    shown_as(&c, p, names[r], "streaming").await;
    let res = api_write(&c, r, "POST", "/switchover", Some(body)).await;
    assert_eq!(res.status, 200, "{}", res.body);
    assert_eq!(writable(&c).await, vec![r]);
    assert_eq!(
        one(&replica, "SELECT count(*) FROM kept").await.unwrap(),
        "1"
    );
}

/// A candidate whose stream breaks as the leader stops never receives the
/// leader's last WAL. The leader, which still has it, does not hand over:
/// it keeps the key and starts again as the primary (in maintenance mode
/// too), and the switchover is reported as not carried out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_whose_candidate_misses_the_last_wal_is_abandoned() {
    let c = cluster().nodes(2).start();
    let p = healthy(&c, 1, BOOTSTRAP).await;
    let r = 1 - p;
    let names = ["n1", "n2"];
    let replica = c.node(r).pg_conninfo();
    let leader = c.node(p).pg_conninfo();
    query(&leader, "CREATE TABLE kept (v int)").await.unwrap();
    // The replica streams through a relay the test can silence (ALTER
    // SYSTEM outranks the agent's own setting, which it leaves alone).
    let relay =
        pgwarden_testkit::Relay::start(format!("127.0.0.1:{}", c.node(p).pg_port).parse().unwrap())
            .unwrap();
    let conninfo = one(&replica, "SHOW primary_conninfo").await.unwrap();
    let port = format!("port={}", c.node(p).pg_port);
    assert!(conninfo.contains(&port), "{conninfo}");
    let through = conninfo.replace(&port, &format!("port={}", relay.addr().port()));
    for q in [
        format!(
            "ALTER SYSTEM SET primary_conninfo = '{}'",
            through.replace('\'', "''")
        ),
        "SELECT pg_reload_conf()".to_string(),
    ] {
        query(&replica, &q).await.unwrap();
    }
    eventually(
        "the replica streams through the relay",
        Duration::from_secs(30),
        || async {
            let n = one(
                &replica,
                "SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'",
            )
            .await?;
            (relay.connections() > 0 && n == "1")
                .then_some(())
                .ok_or(format!("{n} streaming, {} relayed", relay.connections()))
        },
    )
    .await;
    // A silent stream still looks like one: the replica shows as streaming
    // until its receiver times out (a minute); the leader's sender gives up
    // on it soon, so its shutdown does not wait a minute for it.
    for q in [
        "ALTER SYSTEM SET wal_sender_timeout = '2s'",
        "SELECT pg_reload_conf()",
    ] {
        query(&leader, q).await.unwrap();
    }
    let body = serde_json::json!({"leader": names[p], "candidate": names[r]});
    let url = format!("{}/switchover", c.node(r).api_url());
    for (row, paused) in [(1, false), (2, true)] {
        if paused {
            // In maintenance mode the loop starts nothing by itself: the
            // leader that abandons a switchover starts its PostgreSQL
            // again all the same.
            assert_eq!(api_post(&c, p, "/pause").await, 200);
            all_see_the_pause(&c).await;
        }
        relay.set_blackhole(true);
        one(
            &leader,
            &format!("INSERT INTO kept VALUES ({row}) RETURNING v"),
        )
        .await
        .unwrap();
        shown_as(&c, p, names[r], "streaming").await;
        // The answer comes after the stop, the check and the API's grace
        // for a withdrawn request.
        let res = pgwarden_agent::http_client::request(
            "POST",
            &url,
            Some(&body),
            Some(("pgwarden", "secret")),
            Duration::from_secs(40),
        )
        .await
        .unwrap();
        assert_eq!(res.status, 503, "{paused}: {}", res.body);
        assert!(res.body.contains("withdrawn"), "{paused}: {}", res.body);
        eventually(
            "the old leader takes writes again",
            Duration::from_secs(30),
            || async {
                let w = writable(&c).await;
                (w == vec![p]).then_some(()).ok_or(format!("{w:?}"))
            },
        )
        .await;
        let count = row.to_string();
        assert_eq!(
            one(&leader, "SELECT count(*) FROM kept").await.unwrap(),
            count
        );
        let holder = cluster_dcs(&c).await.read_cluster().await.unwrap().leader;
        assert_eq!(holder.map(|l| l.name).as_deref(), Some(names[p]));
        // Heard again, the replica catches up.
        relay.set_blackhole(false);
        relay.reset_all();
        gives(
            &replica,
            "SELECT count(*) FROM kept",
            &count,
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(writable(&c).await, vec![p]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_node_file_changes_tags_parameters_and_timing_in_place() {
    let c = cluster().nodes(2).start();
    healthy(&c, 1, BOOTSTRAP).await;
    query(
        &c.node(0).pg_conninfo(),
        "CREATE ROLE replicator REPLICATION LOGIN",
    )
    .await
    .unwrap();
    let pid = c.node(1).postmaster_pid().unwrap();
    let file = c.node(1).config.clone();
    let text = std::fs::read_to_string(&file).unwrap();
    let missing = c.dir().join("no-such-watchdog");
    let edited = text
        .replacen(
            "[agent]\n",
            &format!(
                "[agent]\nnofailover = true\nuse_slots = false\nreplication_user = \"replicator\"\n\
                 watchdog = \"required\"\nwatchdog_device = {:?}\n",
                missing.display().to_string()
            ),
            1,
        )
        // Not reloadable: logged as waiting for a restart.
        .replace("op_timeout = \"1s\"", "op_timeout = \"1500ms\"")
        .replace(
            "max_connections = 50 }",
            "max_connections = 50, work_mem = \"6MB\" }",
        )
        .replace("loop_wait = 1", "loop_wait = 2")
        .replace("api_password = \"secret\"", "api_password = \"rotated\"");
    assert_ne!(edited, text);
    std::fs::write(&file, edited).unwrap();
    c.reload_agent(1);
    let url = format!("{}/cluster", c.node(0).api_url());
    eventually(
        "every member sees n2 tagged nofailover",
        Duration::from_secs(20),
        || async {
            let v = pgwarden_agent::http_client::get_json(&url, Duration::from_secs(2))
                .await
                .map_err(|e| e.to_string())?;
            let n2 = v["members"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|m| m["name"] == "n2")
                .cloned()
                .unwrap_or_default();
            (n2["tags"]["nofailover"] == true)
                .then_some(())
                .ok_or(n2.to_string())
        },
    )
    .await;
    let conninfo = c.node(1).pg_conninfo();
    gives(&conninfo, "SHOW work_mem", "6MB", Duration::from_secs(20)).await;
    assert_eq!(
        c.node(1).postmaster_pid(),
        Some(pid),
        "PostgreSQL restarted"
    );
    assert_eq!(
        one(&c.node(0).pg_conninfo(), "SHOW work_mem")
            .await
            .unwrap(),
        "4MB"
    );
    // The node's own timing is reloaded too (no dynamic one replaces it);
    // the watchdog's device waits for a restart.
    eventually(
        "loop_wait reloaded on n2",
        Duration::from_secs(20),
        || async {
            let v = member_status(&c, 1).await?["settings"]["loop_wait"].clone();
            (v == 2.0).then_some(()).ok_or(v.to_string())
        },
    )
    .await;
    assert_eq!(
        member_status(&c, 0).await.unwrap()["settings"]["loop_wait"],
        1.0
    );
    // n2 now streams without a slot, and the leader drops the one it kept
    // for it once the grace has passed.
    gives(
        &conninfo,
        "SHOW primary_slot_name",
        "",
        Duration::from_secs(20),
    )
    .await;
    slots_are(&c, 0, vec![]).await;
    // The API takes the new password, and no longer the old one.
    let url = format!("{}/reload", c.node(1).api_url());
    let post = |password: &'static str| {
        let url = url.clone();
        async move {
            pgwarden_agent::http_client::request(
                "POST",
                &url,
                None,
                Some(("pgwarden", password)),
                Duration::from_secs(10),
            )
            .await
            .unwrap()
            .status
        }
    };
    assert_eq!(post("secret").await, 401);
    assert_eq!(post("rotated").await, 202);
    let log = c.node(1).agent_log();
    assert!(log.contains("take effect at the next restart"), "{log}");
    // n2 streams as the new replication user, without a restart; its new
    // watchdog is required but missing, which it reports.
    let leader = c.node(0).pg_conninfo();
    eventually(
        "n2 streams as replicator",
        Duration::from_secs(20),
        || async {
            let v = one(
                &leader,
                "SELECT usename FROM pg_stat_replication WHERE application_name = 'n2' \
                 AND state = 'streaming'",
            )
            .await?;
            (v == "replicator").then_some(()).ok_or(v)
        },
    )
    .await;
    let problem = member_status(&c, 1).await.unwrap()["problem"].clone();
    assert!(
        problem
            .as_str()
            .is_some_and(|p| p.contains("watchdog required but unusable")),
        "{problem}"
    );
    assert_eq!(
        c.node(1).postmaster_pid(),
        Some(pid),
        "PostgreSQL restarted"
    );

    // A file the agent would read that does not load (the CA it would
    // trust the other members' API with) refuses the reload whole: the
    // timing beside it stays.
    let text = std::fs::read_to_string(&file).unwrap();
    let broken = text
        .replacen(
            "[agent]\n",
            "[agent]\napi_ca_file = \"missing-ca.pem\"\n",
            1,
        )
        .replace("loop_wait = 2", "loop_wait = 1");
    assert_ne!(broken, text);
    std::fs::write(&file, broken).unwrap();
    c.reload_agent(1);
    eventually(
        "the reload is rejected",
        Duration::from_secs(20),
        || async {
            let log = c.node(1).agent_log();
            (log.contains("reload rejected") && log.contains("missing-ca.pem"))
                .then_some(())
                .ok_or_else(|| log[log.len().saturating_sub(3000)..].to_string())
        },
    )
    .await;
    assert_eq!(
        member_status(&c, 1).await.unwrap()["settings"]["loop_wait"],
        2.0
    );
    assert_eq!(post("rotated").await, 202);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_that_asks_for_client_certificates_takes_only_the_members_and_ctl_with_one() {
    let certs = tempfile::tempdir().unwrap();
    let (tls, (client_cert, client_key)) = etcd_certs(certs.path());
    let ca = tls.ca_file.clone();
    let mut c = cluster()
        .nodes(2)
        .agent_settings("failsafe = true")
        .api_tls(pgwarden_testkit::agents::ApiTls {
            cert_file: tls.cert_file.clone(),
            key_file: tls.key_file.clone(),
            ca_file: ca.clone(),
            verify_client: "required",
        })
        .start();
    healthy(&c, 1, BOOTSTRAP).await;
    let port = c.node(0).api_port;
    // Trusting the CA is not enough: the handshake wants a certificate.
    assert_eq!(
        pgwarden_testkit::agents::https_status(port, "/health", &ca, None),
        None
    );
    assert_eq!(
        pgwarden_testkit::agents::https_status(
            port,
            "/health",
            &ca,
            Some((client_cert.as_path(), client_key.as_path()))
        ),
        Some(200)
    );
    let ctl = |extra: Vec<String>| {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"));
        cmd.arg("ctl")
            .arg("--api")
            .arg(c.node(0).api_url())
            .arg("--cacert")
            .arg(&ca)
            .args(extra)
            .arg("list");
        cmd.env_remove("PGWARDEN_API_CERT")
            .env_remove("PGWARDEN_API_KEY");
        cmd.output()
    };
    let out = ctl(vec![]).await.unwrap();
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let with = vec![
        "--cert".to_string(),
        client_cert.display().to_string(),
        "--key".to_string(),
        client_key.display().to_string(),
    ];
    // A new replica streams a moment before its record is published.
    eventually(
        "ctl lists both members",
        Duration::from_secs(10),
        || async {
            let out = ctl(with.clone()).await.map_err(|e| e.to_string())?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            (out.status.success() && text.contains("n2"))
                .then_some(())
                .ok_or(format!("{text}{}", String::from_utf8_lossy(&out.stderr)))
        },
    )
    .await;
    // The members present their own certificates to each other: the
    // failsafe acknowledgements get through an etcd outage.
    leader_stands_through_an_etcd_outage(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reinitialize_clones_a_replica_afresh_and_is_refused_on_the_leader() {
    let c = cluster().nodes(2).start();
    healthy(&c, 1, BOOTSTRAP).await;
    query(
        &c.node(0).pg_conninfo(),
        "CREATE TABLE ha_log (id serial PRIMARY KEY)",
    )
    .await
    .unwrap();
    // Something only the replica's data directory has.
    let marker = c.node(1).data_dir.join("left-behind");
    std::fs::write(&marker, "x").unwrap();
    let pid = c.node(1).postmaster_pid().unwrap();
    let r = api_call(&c, 0, "POST", "/reinitialize", serde_json::json!({})).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("leader"), "{}", r.body);
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args([
            "ctl",
            "--api",
            &c.node(1).api_url(),
            "--password",
            "secret",
            "reinit",
        ])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eventually("n2 cloned afresh", Duration::from_secs(60), || async {
        let fresh = !marker.exists() && c.node(1).postmaster_pid().is_some_and(|p| p != pid);
        let table = one(
            &c.node(1).pg_conninfo(),
            "SELECT count(*) FROM pg_class WHERE relname = 'ha_log'",
        )
        .await?;
        (fresh && table == "1")
            .then_some(())
            .ok_or(format!("marker {}, table {table}", marker.exists()))
    })
    .await;
    // Streaming from the leader again.
    healthy(&c, 1, Duration::from_secs(60)).await;
    let log = c.node(1).agent_log();
    assert!(
        log.contains("reinitializing: wiping the data directory"),
        "{log}"
    );
    assert_eq!(writable(&c).await, vec![0]);
}

/// A member whose data directory is being replaced is no candidate: while
/// it re-clones, its record and its API show it stopped with no WAL, not
/// the running replica it was (an election would count that, perhaps as
/// the best candidate, for as long as the clone takes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_being_recloned_is_shown_stopped_without_wal() {
    let tools = shared_dir();
    let dir = tools.path().display().to_string();
    // Clones at once, unless told to hold.
    let script = backup_tool(
        &tools,
        "held.sh",
        &format!(
            "i=0; while [ -e {dir}/hold ] && [ $i -lt 900 ]; do sleep 0.1; i=$((i+1)); done\n"
        ),
    );
    let c = cluster()
        .nodes(2)
        .node_settings(
            1,
            &format!(
                "create_replica_methods = [\"held\"]\n\
                 replica_methods = {{ held = {{ command = \"{}\" }} }}",
                script.display()
            ),
        )
        .start();
    healthy(&c, 1, BOOTSTRAP).await;
    let n2_record = || async {
        let snapshot = read_cluster(&c).await;
        pgwarden_agent::record::records(&snapshot)
            .into_iter()
            .find(|m| m.state.name == "n2")
    };
    let published_running = |what: &'static str| {
        eventually(what, Duration::from_secs(20), move || async move {
            match n2_record().await {
                Some(r) if r.state.running && r.state.wal_position().is_some() => Ok(()),
                r => Err(format!("{r:?}")),
            }
        })
    };
    published_running("n2 is published running").await;
    std::fs::write(tools.path().join("hold"), "").unwrap();
    let r = api_call(&c, 1, "POST", "/reinitialize", serde_json::json!({})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let record = eventually("n2 is listed as reinitializing", BOOTSTRAP, || async {
        match n2_record().await {
            Some(r) if r.status == "reinitializing" => Ok(r),
            r => Err(format!("{r:?}")),
        }
    })
    .await;
    assert!(
        !record.state.running
            && record.state.role == pgwarden_ha::MemberRole::Stopped
            && record.state.wal_position().is_none(),
        "{record:?}"
    );
    // What the other members ask for during an election says the same.
    let patroni: serde_json::Value =
        serde_json::from_str(&api_get_text(&c, 1, "/patroni").await).unwrap();
    assert!(
        patroni
            .get("received_lsn")
            .and_then(|v| v.as_u64())
            .is_none()
            && patroni
                .get("replayed_lsn")
                .and_then(|v| v.as_u64())
                .is_none(),
        "{patroni}"
    );
    std::fs::remove_file(tools.path().join("hold")).unwrap();
    healthy(&c, 1, Duration::from_secs(60)).await;
    published_running("n2 is published running again").await;
}

#[test]
fn a_lease_too_short_for_the_retry_window_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[listen]\nread_write = \"127.0.0.1:1\"\nread_only = \"127.0.0.1:2\"\nhttp = \"127.0.0.1:3\"\n\
         [agent]\nname = \"n1\"\ndata_dir = \"d\"\npg_listen = \"127.0.0.1:5999\"\napi = \"127.0.0.1:4\"\n\
         ttl = 20\nloop_wait = 5\nretry_timeout = 10\n\
         [etcd]\nendpoints = [\"127.0.0.1:1\"]\ncluster = \"demo\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["agent", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("agent.ttl") && err.contains("retry_timeout"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_read_etcd_for_a_ttl_stops_routing_writes() {
    let c = cluster().etcd_relays().start();
    healthy(&c, 2, BOOTSTRAP).await;
    query(
        &c.node(0).pg_conninfo(),
        "CREATE TABLE ha_log (id serial PRIMARY KEY)",
    )
    .await
    .unwrap();
    replicated(&c, 0).await;
    routes_writes_to(&c, 1, 0, Duration::from_secs(20)).await;
    // n2 loses etcd: it cannot know whether n1 still leads, so once the
    // ttl (6 s) has passed its read-write port refuses rather than guess.
    c.etcd_relay(1).set_blackhole(true);
    let rw = c.node(1).rw_conninfo();
    eventually(
        "n2's read-write port refuses writes",
        Duration::from_secs(30),
        || async {
            match one(&rw, "INSERT INTO ha_log DEFAULT VALUES RETURNING id").await {
                Err(e) if e.contains("57P03") || e.contains("no ") || e.contains("primary") => {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    // The leader itself is unaffected.
    routes_writes_to(&c, 0, 0, Duration::from_secs(5)).await;
    c.etcd_relay(1).set_blackhole(false);
    routes_writes_to(&c, 1, 0, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_agent_hands_over_without_waiting_for_its_lease() {
    // A lease long enough that only a release explains a quick takeover.
    let mut c = AgentCluster::builder(env!("CARGO_BIN_EXE_pgwarden"))
        .agent_settings("ttl = 60\nloop_wait = 1\nretry_timeout = 2\nsafety_margin = 1")
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    c.stop_agent(0);
    assert!(
        c.node(0).postmaster_pid().is_none(),
        "a stopped agent stops its PostgreSQL"
    );
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    assert!(c.node(0).agent_log().contains("released the leader key"));
    survivors_route_to(&c, np).await;
}

/// Waits until every running node's read-write port reaches `primary`.
async fn survivors_route_to(c: &AgentCluster, primary: usize) {
    let want = c.node(primary).pg_port.to_string();
    for i in (0..c.len()).filter(|&i| i != 0) {
        let rw = c.node(i).rw_conninfo();
        eventually(
            "writes routed to the new leader",
            Duration::from_secs(20),
            || async {
                let port = one(&rw, "SELECT inet_server_port()").await?;
                (port == want).then_some(()).ok_or(format!("port {port}"))
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_watchdog_is_fed_while_leading_and_members_without_one_never_lead() {
    // Plain files stand in for /dev/watchdog: the agent's writes to them are
    // what the kernel driver would see (the time-out ioctl is refused and
    // only logged).
    let dir = tempfile::tempdir().unwrap();
    let dev = |n: &str| dir.path().join(n);
    std::fs::write(dev("wd1"), b"").unwrap();
    std::fs::write(dev("wd3"), b"").unwrap();
    let setting = |n: &str| format!("watchdog_device = \"{}\"", dev(n).display());
    let mut c = cluster()
        .agent_settings("watchdog = \"required\"")
        .node_settings(0, &setting("wd1"))
        .node_settings(1, &setting("missing"))
        .node_settings(2, &setting("wd3"))
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    let fed = |n: &str| {
        let path = dev(n);
        move || {
            let bytes = std::fs::read(&path).unwrap_or_default();
            let n = bytes.iter().filter(|b| **b == b'1').count();
            async move { (n >= 3).then_some(()).ok_or(format!("{n} keep-alives")) }
        }
    };
    eventually("n1 feeds its watchdog", Duration::from_secs(20), fed("wd1")).await;
    c.stop_agent(0);
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    assert_eq!(
        np, 2,
        "n2, which ranks first by name, has no watchdog and may not lead"
    );
    assert!(
        std::fs::read(dev("wd1")).unwrap().ends_with(b"V"),
        "n1 disarmed its watchdog with the magic close"
    );
    eventually("n3 feeds its watchdog", Duration::from_secs(20), fed("wd3")).await;
    // Disarmed once, by the start-up check: the round that took the key
    // left the watchdog armed. (The file cannot tell: each opening writes
    // from its start again.)
    let log = std::fs::read_to_string(&c.node(2).log).unwrap();
    assert_eq!(
        log.matches("watchdog disarmed").count(),
        1,
        "n3 disarmed its watchdog while leading"
    );
    assert!(c
        .node(1)
        .agent_log()
        .contains("watchdog required but unusable"));
    // A new device in n3's file, reloaded: it is armed before the old one
    // is let go with the magic close; n3 keeps leading.
    std::fs::write(dev("wd3b"), b"").unwrap();
    let file = c.node(2).config.clone();
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, text.replace(&setting("wd3"), &setting("wd3b"))).unwrap();
    c.reload_agent(2);
    eventually(
        "n3 feeds its new watchdog",
        Duration::from_secs(20),
        fed("wd3b"),
    )
    .await;
    assert!(
        std::fs::read(dev("wd3")).unwrap().ends_with(b"V"),
        "the old device was closed with the magic close"
    );
    assert_eq!(writable(&c).await, [2], "n3 still leads");
}

/// The `sync` key as the agents last wrote it.
async fn sync_key(c: &AgentCluster) -> serde_json::Value {
    let dcs = cluster_dcs(c).await;
    dcs.read_cluster()
        .await
        .unwrap()
        .sync
        .unwrap_or(serde_json::Value::Null)
}

/// Waits until writes land on `conninfo` again: the row count of `acked`
/// grows past what it was when the server first answered.
/// Waits until the read-write port at `rw` refuses new transactions
/// because commits wait for a synchronous standby (`on_sync_blocked =
/// reject`).
async fn refuses_while_sync_blocked(rw: &str) {
    eventually(
        "the read-write port refuses",
        Duration::from_secs(10),
        || async {
            match one(rw, "SELECT 1").await {
                Err(e) if e.contains("waits for a synchronous standby") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
}

/// Waits until the writer's table on `conninfo` holds more than `n` rows.
async fn acknowledged_over(conninfo: &str, n: i64) {
    eventually(
        "writes are acknowledged",
        Duration::from_secs(10),
        || async {
            let rows = one(conninfo, "SELECT count(*) FROM acked").await?;
            (rows.parse::<i64>().unwrap_or(0) > n)
                .then_some(())
                .ok_or(rows)
        },
    )
    .await;
}

/// The first member of the published synchronous set, once there is one.
async fn listed_standby(c: &AgentCluster) -> String {
    eventually(
        "a synchronous standby is listed",
        Duration::from_secs(20),
        || async {
            let key = sync_key(c).await;
            key["members"]
                .as_array()
                .and_then(|m| m.first())
                .and_then(|m| m.as_str())
                .map(str::to_string)
                .ok_or(key.to_string())
        },
    )
    .await
}

async fn writes_resume(conninfo: &str) {
    let count = || async {
        one(conninfo, "SELECT count(*) FROM acked")
            .await?
            .parse::<i64>()
            .map_err(|e| e.to_string())
    };
    let base = eventually("the new leader answers", Duration::from_secs(30), count).await;
    eventually("writes resume", Duration::from_secs(30), || async {
        let n = count().await?;
        (n > base)
            .then_some(())
            .ok_or(format!("{n} rows, {base} before"))
    })
    .await;
}

/// Stops the writer and checks that every id whose insert it saw
/// acknowledged is on `conninfo`.
async fn assert_no_acknowledged_write_lost(
    conninfo: &str,
    stop: &std::sync::atomic::AtomicBool,
    writer: tokio::task::JoinHandle<Vec<i64>>,
) {
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let acked = writer.await.unwrap();
    let present: std::collections::HashSet<i64> = query(conninfo, "SELECT id FROM acked")
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.parse().unwrap())
        .collect();
    let lost: Vec<&i64> = acked.iter().filter(|id| !present.contains(id)).collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged writes lost: {lost:?}",
        lost.len(),
        acked.len()
    );
}

/// Inserts ids through `conninfo` one by one until stopped, keeping the
/// ids whose commit was acknowledged.
fn start_writer(
    conninfo: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<Vec<i64>> {
    tokio::spawn(async move {
        let mut acked = Vec::new();
        let mut id = 0i64;
        let mut client: Option<tokio_postgres::Client> = None;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = tokio::time::timeout(
                    Duration::from_secs(2),
                    tokio_postgres::connect(&conninfo, tokio_postgres::NoTls),
                )
                .await
                .ok()
                .and_then(Result::ok)
                .map(|(c, conn)| {
                    tokio::spawn(conn);
                    c
                });
                if client.is_none() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
            id += 1;
            let q = format!("INSERT INTO acked VALUES ({id})");
            let c = client.as_ref().expect("connected");
            match tokio::time::timeout(Duration::from_secs(5), c.simple_query(&q)).await {
                Ok(Ok(_)) => acked.push(id),
                Ok(Err(_)) => client = None,
                Err(_) => client = None,
            }
        }
        acked
    })
}

/// In maintenance mode the leader still manages its synchronous standbys:
/// after a switchover by hand, the new leader lists its own, so the
/// connection managers route writes to it (they wait for its key), and
/// commits are acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_in_maintenance_mode_keeps_synchronous_writes_flowing() {
    let c = cluster()
        .nodes(2)
        .agent_settings("protection = \"maximum_availability\"")
        .start();
    healthy(&c, 1, BOOTSTRAP).await;
    query(
        &c.node(0).pg_conninfo(),
        "CREATE TABLE ha_log (id serial PRIMARY KEY)",
    )
    .await
    .unwrap();
    routes_writes_to(&c, 1, 0, Duration::from_secs(30)).await;
    assert_eq!(api_post(&c, 0, "/pause").await, 200);
    all_see_the_pause(&c).await;
    switch_over(&c, "n1", "n2").await;
    eventually(
        "n2 lists its synchronous standby",
        Duration::from_secs(30),
        || async {
            let key = sync_key(&c).await;
            (key["leader"] == "n2")
                .then_some(())
                .ok_or(format!("{key}"))
        },
    )
    .await;
    routes_writes_to(&c, 0, 1, Duration::from_secs(30)).await;
}

/// A primary that outlives its agent (its fence gone too) keeps waiting
/// for its synchronous standby when a new agent takes it over: the
/// settings file the agent rewrites (here for a dynamic parameter) keeps
/// what the last run set, so no commit is acknowledged without the
/// standby the sync key names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_agent_keeps_the_synchronous_standbys_of_the_primary_it_adopts() {
    let mut c = cluster()
        .nodes(2)
        .agent_settings("protection = \"maximum_availability\"")
        .start();
    healthy(&c, 1, BOOTSTRAP).await;
    query(
        &c.node(0).pg_conninfo(),
        "CREATE TABLE ha_log (id serial PRIMARY KEY)",
    )
    .await
    .unwrap();
    let conninfo = c.node(0).pg_conninfo();
    let names = || async { one(&conninfo, "SHOW synchronous_standby_names").await };
    let want = "FIRST 1 (\"n2\")";
    eventually(
        "n2 is the synchronous standby",
        Duration::from_secs(20),
        || async {
            let now = names().await?;
            (now == want).then_some(()).ok_or(now)
        },
    )
    .await;
    patch_config_ok(
        &c,
        0,
        serde_json::json!({"postgresql": {"parameters": {"work_mem": "8MB"}}}),
    )
    .await;
    everywhere(&c, "work_mem", "8MB").await;
    // The agent dies with its fence: PostgreSQL runs on alone.
    let data_dir = c.node(0).data_dir.display().to_string();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(" fence ") && cmdline.contains(&data_dir) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    let pid = c.node(0).postmaster_pid().unwrap();
    c.kill_agent(0);
    c.start_agent(0);
    // Through the new agent's first rounds: never without the standby.
    let watch = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::time::Instant::now() < watch {
        if let Ok(now) = names().await {
            assert_eq!(now, want, "{}", c.node(0).agent_log());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        c.node(0).postmaster_pid(),
        Some(pid),
        "the same server ran on"
    );
    let log = c.node(0).agent_log();
    assert!(log.contains("taken over from the last run"), "{log}");
    routes_writes_to(&c, 1, 0, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maximum_availability_loses_no_acknowledged_write_and_degrades_without_standbys() {
    let mut c = cluster()
        .agent_settings("protection = \"maximum_availability\"")
        .node_settings(2, "nosync = true")
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    query(&c.node(0).pg_conninfo(), "CREATE TABLE acked (id int8)")
        .await
        .unwrap();
    // n3 is tagged nosync: n2 is the one synchronous standby.
    eventually(
        "n2 is the synchronous standby",
        Duration::from_secs(20),
        || async {
            let names = one(&c.node(0).pg_conninfo(), "SHOW synchronous_standby_names").await?;
            let key = sync_key(&c).await;
            (names == "FIRST 1 (\"n2\")" && key["members"] == serde_json::json!(["n2"]))
                .then_some(())
                .ok_or(format!("{names} / {key}"))
        },
    )
    .await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Through n3's read-write port, which routes to whoever leads.
    let writer = start_writer(c.node(2).rw_conninfo(), stop.clone());
    acknowledged_over(&c.node(0).pg_conninfo(), 50).await;
    c.kill_node(0);
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    assert_eq!(np, 1, "only the synchronous standby may be promoted");
    // Writes resume on the new leader, which has no synchronous standby
    // left (n3 is nosync): it degrades to asynchronous and keeps serving.
    let conninfo = c.node(1).pg_conninfo();
    writes_resume(&conninfo).await;
    assert_no_acknowledged_write_lost(&conninfo, &stop, writer).await;
    let key = sync_key(&c).await;
    assert_eq!(key["leader"], "n2");
    assert!(
        key["degraded_since_ms"].is_u64(),
        "degradation is recorded: {key}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maximum_protection_makes_commits_wait_until_a_standby_is_back() {
    let mut c = cluster()
        .agent_settings("protection = \"maximum_protection\"\non_sync_blocked = \"reject\"")
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    // A new cluster in strict mode takes its first commit once a standby
    // is listed.
    listed_standby(&c).await;
    let key = sync_key(&c).await;
    assert_eq!(key["members"].as_array().map(Vec::len), Some(1), "{key}");
    query(&c.node(0).pg_conninfo(), "CREATE TABLE acked (id int8)")
        .await
        .unwrap();
    c.kill_node(1);
    c.kill_node(2);
    // A commit now waits for a standby that is not there.
    let (client, conn) = tokio_postgres::connect(&c.node(0).pg_conninfo(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let insert =
        tokio::spawn(async move { client.simple_query("INSERT INTO acked VALUES (1)").await });
    eventually("the wait is reported", Duration::from_secs(20), || async {
        let key = sync_key(&c).await;
        key["blocked_since_ms"]
            .is_u64()
            .then_some(())
            .ok_or(key.to_string())
    })
    .await;
    assert!(
        !insert.is_finished(),
        "strict mode never drops to asynchronous"
    );
    // The state is explicit: pgwarden ctl list and the agent's /metrics.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["ctl", "--api", &c.node(0).api_url(), "list"])
        .output()
        .unwrap();
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.contains("Writes blocked: no synchronous standby"),
        "{list}"
    );
    let metrics = api_get_text(&c, 0, "/metrics").await;
    assert!(
        metrics.contains("pgwarden_ha_sync_blocked_seconds"),
        "{metrics}"
    );
    assert!(
        metrics.contains("pgwarden_ha_sync_degraded_seconds 0"),
        "{metrics}"
    );
    // on_sync_blocked = reject: new transactions through the read-write
    // port fail at once, saying why, instead of hanging too.
    let rw = c.node(0).rw_conninfo();
    refuses_while_sync_blocked(&rw).await;
    assert_eq!(
        sync_key(&c).await["degraded_since_ms"],
        serde_json::Value::Null
    );
    // A standby comes back: the commit completes.
    c.start_agent(1);
    let done = tokio::time::timeout(Duration::from_secs(60), insert)
        .await
        .unwrap_or_else(|_| panic!("the commit still waits\n{}", c.logs()));
    done.unwrap().unwrap();
    eventually(
        "the read-write port serves again",
        Duration::from_secs(20),
        || async { one(&rw, "SELECT 1").await.map(|_| ()) },
    )
    .await;
}

/// A caller that hangs up in the middle of a switchover (Ctrl-C on
/// `ctl switchover`, a client time-out) does not leave every node's
/// read-write pools paused: the switchover runs to its end and resumes
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_whose_caller_hangs_up_still_resumes_the_pools() {
    let c = cluster()
        .tables("[pool]\nmode = \"transaction\"\nsize = 4\nquery_wait_timeout = \"3s\"")
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    let api = c
        .node(0)
        .api_url()
        .trim_start_matches("http://")
        .to_string();
    // The request is accepted only once n2's record shows it streaming
    // (records are written once per loop).
    eventually(
        "n2's record shows it streaming",
        Duration::from_secs(30),
        || async {
            let v: serde_json::Value = serde_json::from_str(&api_get_text(&c, 0, "/cluster").await)
                .map_err(|e| e.to_string())?;
            let n2 = v["members"]
                .as_array()
                .and_then(|m| m.iter().find(|m| m["name"] == "n2"))
                .cloned()
                .unwrap_or_default();
            (n2["state"] == "streaming")
                .then_some(())
                .ok_or(format!("{n2}"))
        },
    )
    .await;
    // A transaction in flight through n1's pool holds the switchover in
    // its drain, so the caller surely hangs up in the middle of it.
    let (tx, conn) = tokio_postgres::connect(&c.node(0).rw_conninfo(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    tx.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let mut caller = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let body = r#"{"leader": "n1", "candidate": "n2"}"#;
        let mut s = std::net::TcpStream::connect(&api).unwrap();
        write!(
            s,
            "POST /switchover HTTP/1.1\r\nHost: x\r\nAuthorization: Basic cGd3YXJkZW46c2VjcmV0\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        s
    })
    .await
    .unwrap();
    let proxy = format!("http://127.0.0.1:{}/cluster", c.node(0).http_port);
    eventually(
        "n1's read-write pool is paused",
        Duration::from_secs(20),
        || async {
            let r = pgwarden_agent::http_client::request(
                "GET",
                &proxy,
                None,
                None,
                Duration::from_secs(5),
            )
            .await
            .map_err(|e| e.to_string())?;
            let v: serde_json::Value = serde_json::from_str(&r.body).map_err(|e| e.to_string())?;
            let rw = v["services"]
                .as_array()
                .and_then(|s| s.iter().find(|s| s["name"] == "read_write"))
                .map(|s| s["paused"].clone());
            (rw == Some(serde_json::json!(true)))
                .then_some(())
                .ok_or(format!("{rw:?}"))
        },
    )
    .await;
    let paused_at = std::time::Instant::now();
    // Nothing answered yet: the drain still waits for the transaction (up
    // to five seconds, after which it goes ahead without it).
    caller.set_nonblocking(true).unwrap();
    let mut answer = [0u8; 1];
    let unanswered = matches!(
        std::io::Read::read(&mut caller, &mut answer),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
    );
    assert!(
        unanswered || paused_at.elapsed() > Duration::from_secs(4),
        "the switchover answered while a transaction was in flight"
    );
    caller.shutdown(std::net::Shutdown::Both).unwrap();
    drop(caller);
    // Ended by the switchover if the drain gave up on it meanwhile.
    let _ = tx.batch_execute("COMMIT").await;
    eventually("n2 leads", Duration::from_secs(60), || async {
        let w = writable(&c).await;
        (w == [1]).then_some(()).ok_or(format!("{w:?}"))
    })
    .await;
    for i in 0..3 {
        let rw = c.node(i).rw_conninfo();
        eventually(
            "the read-write pool serves after the switchover",
            Duration::from_secs(30),
            || {
                let rw = rw.clone();
                async move { one(&rw, "SELECT 1").await.map(|_| ()) }
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_is_invisible_to_transaction_pooled_clients() {
    let c = cluster()
        .tables("[pool]\nmode = \"transaction\"\nsize = 4\nquery_wait_timeout = \"20s\"")
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    let direct = c.node(0).pg_conninfo();
    let init = tokio::process::Command::new("pgbench")
        .args(["-i", "-q", "-s", "1", &direct])
        .output()
        .await
        .unwrap();
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    replicated(&c, 0).await;
    // pgbench through n3's read-write port, which follows the leader; a
    // client that gets an error aborts, and pgbench then exits non-zero.
    let rw = c.node(2).rw_conninfo();
    let bench = tokio::process::Command::new("pgbench")
        .args(["-n", "-c", "8", "-j", "2", "-T", "12", "-M", "simple", &rw])
        .output();
    let bench = tokio::spawn(bench);
    eventually(
        "pgbench is running through n3",
        Duration::from_secs(10),
        || async {
            let n = one(
                &c.node(0).pg_conninfo(),
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgbench'",
            )
            .await?;
            (n != "0").then_some(()).ok_or(n)
        },
    )
    .await;
    let r = pgwarden_agent::http_client::request(
        "POST",
        &format!("{}/switchover", c.node(0).api_url()),
        Some(&serde_json::json!({"leader": "n1", "candidate": "n2"})),
        Some(("pgwarden", "secret")),
        Duration::from_secs(40),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let out = bench.await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "pgbench failed:\n{stdout}\n{stderr}\n{}",
        c.logs()
    );
    assert!(
        stdout.contains("number of failed transactions: 0"),
        "{stdout}"
    );
    assert_eq!(writable(&c).await, vec![1], "n2 leads after the switchover");
    // The old leader rejoins as a replica.
    healthy(&c, 2, Duration::from_secs(60)).await;
    // And back, twice more. The candidate received each old leader's
    // shutdown checkpoint, so the old leader follows the new timeline as
    // it is: it is never rewound onto a leader still promoting (which
    // ruins its data directory), nor cloned again.
    for (from, to) in [(1usize, 0usize), (0, 2)] {
        // The candidate may stream on the new timeline before its member
        // record says so (records are written once per loop): until then
        // the switchover is refused with 412, and asked for again.
        switch_over(&c, &format!("n{}", from + 1), &format!("n{}", to + 1)).await;
        healthy(&c, 2, Duration::from_secs(60)).await;
        assert_eq!(writable(&c).await, vec![to]);
    }
    for i in 0..3 {
        let log = c.node(i).agent_log();
        assert!(!log.contains("pg_rewind failed"), "n{}: {log}", i + 1);
        assert!(
            log.matches("cloning the leader").count() <= 1,
            "n{}: {log}",
            i + 1
        );
    }
    for i in [0, 1] {
        let log = c.node(i).agent_log();
        assert!(log.contains("no rewind needed"), "n{}: {log}", i + 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_agent_dies_stops_taking_writes_before_anyone_is_promoted() {
    let mut c = cluster().start();
    let checker = healthy_and_checked(&c).await;
    // Only the agent dies; its PostgreSQL would keep running on its own.
    // Left unreaped, it is a zombie with its pid and start time: dead all
    // the same.
    c.kill_agent_unreaped(0);
    let orphan = c.node(0).pg_conninfo();
    eventually(
        "the orphaned primary stops taking writes",
        Duration::from_secs(15),
        || async {
            match one(&orphan, "SELECT pg_is_in_recovery()").await {
                Err(_) => Ok(()),
                Ok(v) => Err(format!("still up, in recovery: {v}")),
            }
        },
    )
    .await;
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    checker.finish().await;
    assert_ne!(np, 0);
}

/// Whether node `i` takes a write right now.
async fn takes_writes(c: &AgentCluster, i: usize) -> bool {
    one(&c.node(i).pg_conninfo(), "SELECT pg_is_in_recovery()")
        .await
        .as_deref()
        == Ok("f")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_failsafe_losing_etcd_demotes_the_leader() {
    let mut c = cluster().start();
    healthy(&c, 2, BOOTSTRAP).await;
    c.etcd().kill(0);
    eventually("the leader demotes", Duration::from_secs(20), || async {
        (!takes_writes(&c, 0).await)
            .then_some(())
            .ok_or("still writable".to_string())
    })
    .await;
    // Its health checks say so at once, not after the round's etcd
    // time-outs.
    eventually(
        "the demoted leader's health checks fail",
        Duration::from_secs(6),
        || async {
            let s = (c.api_status(0, "/primary"), c.api_status(0, "/health"));
            (s == (Some(503), Some(503)))
                .then_some(())
                .ok_or(format!("{s:?}"))
        },
    )
    .await;
    assert_eq!(writable(&c).await, Vec::<usize>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_failsafe_an_etcd_outage_is_no_outage_while_every_member_answers() {
    let mut c = cluster().agent_settings("failsafe = true").start();
    healthy(&c, 2, BOOTSTRAP).await;
    query(
        &c.node(0).pg_conninfo(),
        "CREATE TABLE ha_log (id serial PRIMARY KEY)",
    )
    .await
    .unwrap();
    replicated(&c, 0).await;
    // The membership the leader knows is what it will ask.
    knows_members(&c, 0, 3).await;
    c.etcd().kill(0);
    // Well past the lease (6 s) and the demotion deadline (3 s): the leader
    // stands, and every node's read-write port still reaches it.
    let until = tokio::time::Instant::now() + Duration::from_secs(12);
    while tokio::time::Instant::now() < until {
        assert!(
            takes_writes(&c, 0).await,
            "the leader demoted\n{}",
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for i in 0..3 {
        routes_writes_to(&c, i, 0, Duration::from_secs(5)).await;
    }
    assert!(c
        .node(0)
        .agent_log()
        .contains("every member acknowledges this leader"));
    // One member stops answering: the leader can no longer be sure and
    // demotes.
    c.kill_node(2);
    eventually("the leader demotes", Duration::from_secs(20), || async {
        (!takes_writes(&c, 0).await)
            .then_some(())
            .ok_or("still writable".to_string())
    })
    .await;
    assert!(c
        .node(0)
        .agent_log()
        .contains("not every member acknowledges"));
}

/// The lease of a leader that stood through an etcd outage on its
/// members' word has run out when etcd answers again, and its key is gone:
/// it is still the best candidate and takes the key back, without a
/// demotion or a new timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_failsafe_the_leader_takes_its_key_back_when_etcd_returns() {
    let mut c = cluster().agent_settings("failsafe = true").start();
    healthy(&c, 2, BOOTSTRAP).await;
    // n3 leads: every replica's name sorts before the leader's, so a tie
    // in position broken by name alone would crown one of them.
    switch_over(&c, "n1", "n3").await;
    assert_eq!(healthy(&c, 2, Duration::from_secs(60)).await, 2);
    knows_members(&c, 2, 3).await;
    let timeline = one(
        &c.node(2).pg_conninfo(),
        "SELECT timeline_id FROM pg_control_checkpoint()",
    )
    .await
    .unwrap();
    // Frozen, etcd lets every lease run out the moment it wakes: what a
    // partition that heals looks like from etcd's side.
    c.etcd().freeze(0);
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < until {
        assert!(
            takes_writes(&c, 2).await,
            "the leader demoted\n{}",
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    c.etcd().thaw(0);
    let mut holds_key = false;
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < until {
        assert!(
            takes_writes(&c, 2).await,
            "the leader demoted after etcd came back\n{}",
            c.logs()
        );
        if c.api_status(2, "/leader") == Some(200) {
            holds_key = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        holds_key,
        "the leader never took its key back\n{}",
        c.logs()
    );
    assert_eq!(healthy(&c, 2, Duration::from_secs(30)).await, 2);
    let after = one(
        &c.node(2).pg_conninfo(),
        "SELECT timeline_id FROM pg_control_checkpoint()",
    )
    .await
    .unwrap();
    assert_eq!(after, timeline, "a new timeline: someone was promoted");
    assert!(!c.node(2).agent_log().contains("demoting"), "{}", c.logs());
}

/// etcd comes back for the replicas first: they find no leader key, but
/// the leader they vouched for still runs as primary until it learns they
/// no longer vouch for it, so they wait for it to demote instead of
/// promoting beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_failsafe_the_replicas_wait_for_the_leader_they_vouched_for() {
    let c = cluster()
        .agent_settings("failsafe = true")
        .etcd_relays()
        .start();
    let checker = healthy_and_checked(&c).await;
    knows_members(&c, 0, 3).await;
    for i in 0..3 {
        c.etcd_relay(i).set_blackhole(true);
    }
    // Past the lease (6 s): etcd deletes the leader key, the leader stands.
    let until = tokio::time::Instant::now() + Duration::from_secs(9);
    while tokio::time::Instant::now() < until {
        assert!(
            takes_writes(&c, 0).await,
            "the leader demoted\n{}",
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for i in [1, 2] {
        c.etcd_relay(i).set_blackhole(false);
        c.etcd_relay(i).reset_all();
    }
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    c.etcd_relay(0).set_blackhole(false);
    c.etcd_relay(0).reset_all();
    assert_eq!(healthy(&c, 2, Duration::from_secs(60)).await, np);
    checker.finish().await;
    assert!(
        c.logs()
            .contains("the leader acknowledged while etcd was out of reach still runs as primary"),
        "{}",
        c.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_one_of_three_etcd_members_changes_nothing() {
    // Timings in the proportions of the presets: requests that went to the
    // dead member time out (op_timeout = 1 s) and are retried within the
    // leader's retry window, which the test's usual 2 s would make tight.
    let mut c = AgentCluster::builder(env!("CARGO_BIN_EXE_pgwarden"))
        .agent_settings("ttl = 20\nloop_wait = 2\nretry_timeout = 6\nsafety_margin = 1")
        .etcd_members(3)
        .start();
    let checker = healthy_and_checked(&c).await;
    c.etcd().kill(0);
    // Past the lease (20 s): the same leader, still taking writes.
    let until = tokio::time::Instant::now() + Duration::from_secs(24);
    while tokio::time::Instant::now() < until {
        assert_eq!(writable(&c).await, vec![0], "{}", c.logs());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    checker.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_restarting_during_an_election_elect_exactly_one_leader() {
    let mut c = cluster().start();
    let checker = healthy_and_checked(&c).await;
    c.kill_node(0);
    // While the lease runs out and the survivors elect, both of their
    // agents restart (their servers keep running).
    c.kill_agent(1);
    c.start_agent(1);
    // Fault timing, not a wait for a condition: the second restart lands
    // while the first agent is coming back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.kill_agent(2);
    c.start_agent(2);
    let np = new_primary(&c, 0, Duration::from_secs(40)).await;
    healthy(&c, 1, Duration::from_secs(30)).await;
    checker.finish().await;
    assert_eq!(writable(&c).await, vec![np]);
}

/// A leader that finds its key bound to a lease it does not hold (a lease
/// change whose answer was lost leaves it so) takes the key back at once,
/// bound to its own lease, in place: the key is never deleted (the same
/// leadership), no failover happens and the primary is never demoted. It
/// waited for that lease to run out, leading meanwhile with no lease held
/// and no deadline to stop by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_takes_back_its_key_bound_to_a_lease_it_does_not_hold() {
    let c = cluster().start();
    let checker = healthy_and_checked(&c).await;
    let dcs = cluster_dcs(&c).await;
    let before = dcs.read_cluster().await.unwrap().leader.expect("a leader");
    assert_eq!(before.name, c.node(0).name);
    let stray = dcs.grant_lease(Duration::from_secs(6)).await.unwrap();
    assert!(dcs
        .rebind_leader(&before.name, before.lease, stray)
        .await
        .unwrap());
    eventually(
        "the key bound to the leader's own lease again",
        Duration::from_secs(20),
        || async {
            let now = dcs
                .read_cluster()
                .await
                .map_err(|e| e.to_string())?
                .leader
                .ok_or("no leader key")?;
            assert_eq!(
                now.generation, before.generation,
                "a new leadership: {now:?}"
            );
            (now.lease != stray)
                .then_some(())
                .ok_or(format!("still the stray lease: {now:?}"))
        },
    )
    .await;
    let log = c.node(0).agent_log();
    assert!(
        log.contains("the key names this primary under a lease it no longer holds"),
        "{log}"
    );
    // Past the time the stray lease would have run out: still the same
    // leadership, never two writable members.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let now = dcs.read_cluster().await.unwrap().leader.expect("a leader");
    assert_eq!(now.generation, before.generation, "{now:?}");
    checker.finish().await;
    assert_eq!(writable(&c).await, vec![0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_its_replicas_but_not_from_etcd_keeps_leading_alone() {
    let c = cluster().start();
    let checker = healthy_and_checked(&c).await;
    // Replication stops reaching the replicas (their WAL receivers frozen),
    // while every agent still reaches etcd: the leader keeps its lease,
    // so nobody may take over, however far the replicas fall behind.
    let receivers = freeze_wal_receivers(&c, &[1, 2]).await;
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < until {
        assert_eq!(writable(&c).await, vec![0]);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    thaw(&receivers);
    checker.finish().await;
    healthy(&c, 2, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maximum_protection_loses_no_acknowledged_write_on_failover() {
    let mut c = cluster()
        .agent_settings("protection = \"maximum_protection\"")
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    let listed = listed_standby(&c).await;
    // A new cluster in strict mode takes its first commit once a standby
    // is listed.
    query(&c.node(0).pg_conninfo(), "CREATE TABLE acked (id int8)")
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = start_writer(c.node(2).rw_conninfo(), stop.clone());
    acknowledged_over(&c.node(0).pg_conninfo(), 50).await;
    c.kill_node(0);
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    assert_eq!(
        c.node(np).name,
        listed,
        "only the synchronous standby may be promoted"
    );
    // The other survivor becomes the new leader's synchronous standby and
    // writes resume.
    let conninfo = c.node(np).pg_conninfo();
    writes_resume(&conninfo).await;
    assert_no_acknowledged_write_lost(&conninfo, &stop, writer).await;
    let key = sync_key(&c).await;
    assert_eq!(
        key["degraded_since_ms"],
        serde_json::Value::Null,
        "strict mode never degrades"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_replayed_past_the_new_leaders_fork_rewinds_and_follows() {
    use nix::sys::signal::Signal;
    let mut c = cluster()
        .agent_settings("protection = \"maximum_protection\"")
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    let listed = listed_standby(&c).await;
    let sync = (1..3).find(|&i| c.node(i).name == listed).unwrap();
    let other = 3 - sync;
    query(&c.node(0).pg_conninfo(), "CREATE TABLE forked (id int8)")
        .await
        .unwrap();
    // Freeze the synchronous standby's WAL receiver: the next commit waits
    // for it, while the other replica receives and replays the commit.
    let receiver: i32 = one(
        &c.node(sync).pg_conninfo(),
        "SELECT pid FROM pg_stat_wal_receiver",
    )
    .await
    .unwrap()
    .parse()
    .unwrap();
    signal(receiver, Signal::SIGSTOP);
    let leader = c.node(0).pg_conninfo();
    let waiting = tokio::spawn(async move {
        let _ = query(&leader, "INSERT INTO forked VALUES (1)").await;
    });
    // The commit itself, not just any later WAL record (a running-xacts
    // record would do for a position check), must be on the other replica.
    let other_conninfo = c.node(other).pg_conninfo();
    eventually(
        "the other replica replays the unacknowledged commit",
        Duration::from_secs(20),
        || async {
            let n = one(&other_conninfo, "SELECT count(*) FROM forked").await?;
            (n == "1").then_some(()).ok_or(format!("{n} rows"))
        },
    )
    .await;
    c.kill_node(0);
    // The frozen receiver's socket still holds what the old leader sent
    // (a continued receiver would read it): kill it, and its PostgreSQL
    // restarts without that WAL.
    signal(receiver, Signal::SIGKILL);
    waiting.abort();
    // Only the synchronous standby may be promoted; the other replica has
    // a commit the new timeline does not, so it must rewind to follow.
    assert_eq!(new_primary(&c, 0, Duration::from_secs(30)).await, sync);
    eventually(
        "the other replica streams from the new leader",
        Duration::from_secs(60),
        || async {
            // On the new leader's timeline: 2, or later if it was promoted
            // again meanwhile.
            let status = one(
                &c.node(other).pg_conninfo(),
                "SELECT status || ' ' || (received_tli >= 2) FROM pg_stat_wal_receiver",
            )
            .await?;
            (status == "streaming true").then_some(()).ok_or(status)
        },
    )
    .await;
    let log = c.node(other).agent_log();
    assert!(log.contains("the leader's timeline does not have; it must rewind"));
    // Rewound once, and started from there: a second rejoin would have
    // run crash recovery on what pg_rewind left, as a primary.
    assert_eq!(log.matches("rewound onto the history").count(), 1, "{log}");
    let rows = one(&c.node(other).pg_conninfo(), "SELECT count(*) FROM forked")
        .await
        .unwrap();
    assert_eq!(rows, "0", "the unacknowledged commit is rewound away");
    // And it becomes the synchronous standby: commits go through again.
    let new_leader = c.node(sync).pg_conninfo();
    eventually("commits go through", Duration::from_secs(30), || async {
        query(&new_leader, "INSERT INTO forked VALUES (2)").await
    })
    .await;
}

/// A write request to node `i`'s API.
async fn api_write(
    c: &AgentCluster,
    i: usize,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> pgwarden_agent::http_client::Response {
    let url = format!("{}{path}", c.node(i).api_url());
    pgwarden_agent::http_client::request(
        method,
        &url,
        body.as_ref(),
        Some(("pgwarden", "secret")),
        Duration::from_secs(10),
    )
    .await
    .unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}

/// A client of the cluster's keys in the kit's (plain) etcd.
async fn cluster_dcs(c: &AgentCluster) -> pgwarden_dcs::EtcdDcs {
    pgwarden_dcs::EtcdDcs::connect(
        &[c.etcd_endpoint()],
        "pgwarden",
        c.cluster_name(),
        Duration::from_secs(2),
    )
    .await
    .unwrap()
}

/// Waits until the leader key names `member`.
async fn leads(c: &AgentCluster, member: &str, within: Duration) {
    eventually(&format!("{member} leads"), within, || async {
        let l = read_cluster(c).await.leader;
        (l.as_ref().map(|l| l.name.as_str()) == Some(member))
            .then_some(())
            .ok_or(format!("{l:?}"))
    })
    .await;
}

/// The cluster as stored in etcd right now.
async fn read_cluster(c: &AgentCluster) -> pgwarden_dcs::ClusterSnapshot {
    let dcs = cluster_dcs(c).await;
    dcs.read_cluster().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_switchover_happens_at_its_time_and_a_cancelled_one_never() {
    use pgwarden_agent::record::unix_ms;
    use pgwarden_ha::format_timestamp;
    let c = cluster().start();
    healthy(&c, 2, BOOTSTRAP).await;
    let holder = |s: &pgwarden_dcs::ClusterSnapshot| s.leader.as_ref().map(|l| l.name.clone());
    eventually(
        "every member publishes a running server",
        Duration::from_secs(20),
        || async {
            let snap = read_cluster(&c).await;
            let running = snap
                .members
                .iter()
                .filter(|(_, m)| m["running"] == true)
                .count();
            (running == 3)
                .then_some(())
                .ok_or(format!("{running} running"))
        },
    )
    .await;

    // Scheduled through a replica's API, then withdrawn: nothing happens,
    // not at its time and not once it would be overdue. (Far enough ahead
    // that both requests surely land before it.)
    let at = unix_ms() as i64 + 8_000;
    let body = serde_json::json!({"leader": "n1", "candidate": "n2", "scheduled_at": format_timestamp(at)});
    let r = api_write(&c, 2, "POST", "/switchover", Some(body)).await;
    assert_eq!((r.status, r.body.trim()), (202, "Switchover scheduled"));
    let r = api_write(&c, 1, "DELETE", "/switchover", None).await;
    assert_eq!(
        (r.status, r.body.trim()),
        (200, "scheduled switchover deleted")
    );
    // Observing a window, not waiting for a condition: its time plus the
    // grace (1.5 loops) plus a loop.
    while (unix_ms() as i64) < at + 3_500 {
        let snap = read_cluster(&c).await;
        assert_eq!(holder(&snap).as_deref(), Some("n1"), "{}", c.logs());
        assert!(snap.failover.is_none());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(writable(&c).await, vec![0]);

    // Scheduled through a replica's API again: the leader learns of it from
    // the watch, keeps leading until the time, then hands over.
    let at = unix_ms() as i64 + 8_000;
    let stamp = format_timestamp(at);
    let body = serde_json::json!({"leader": "n1", "candidate": "n2", "scheduled_at": stamp});
    let r = api_write(&c, 2, "POST", "/switchover", Some(body)).await;
    assert_eq!(r.status, 202, "{}", r.body);
    // The leader's own view shows it as soon as it has read it.
    let shown = format!("Switchover scheduled at {stamp}: from n1 to n2");
    // Before its time comes.
    let shown_within = Duration::from_millis((at - unix_ms() as i64 - 1_000).max(1_000) as u64);
    eventually("ctl list shows it", shown_within, || async {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
            .args(["ctl", "--api", &c.node(0).api_url(), "list"])
            .output()
            .await
            .map_err(|e| e.to_string())?;
        let list = String::from_utf8_lossy(&out.stdout).to_string();
        list.contains(&shown).then_some(()).ok_or(list)
    })
    .await;
    let moved_at = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let snap = read_cluster(&c).await;
            let now = unix_ms() as i64;
            match holder(&snap).as_deref() {
                Some("n1") => {}
                other => {
                    assert!(
                        now >= at,
                        "the key left n1 ({other:?}) {} ms before its time",
                        at - now
                    );
                    if other == Some("n2") {
                        return now;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the switchover did not happen\n{}", c.logs()));
    eprintln!(
        "the key moved {} ms after the scheduled time",
        moved_at - at
    );
    // A loop's wait, the checkpoint and the stop, with room for a loaded
    // machine.
    assert!(
        moved_at - at < 20_000,
        "the switchover happened {} ms after its time",
        moved_at - at
    );
    assert!(c
        .node(0)
        .agent_log()
        .contains(&format!("awaiting the switchover scheduled at {stamp}")));
    assert_eq!(new_primary(&c, 0, Duration::from_secs(20)).await, 1);
    // The history entry and the consumed request are two writes.
    let promoted = eventually(
        "the promotion is recorded and the request consumed",
        Duration::from_secs(10),
        || async {
            let snap = read_cluster(&c).await;
            match (snap.history.last(), &snap.failover) {
                (Some(h), None) => Ok(h.clone()),
                (None, _) => Err("no history".to_string()),
                (Some(_), Some(f)) => Err(format!("the request is still there: {f:?}")),
            }
        },
    )
    .await;
    assert_eq!(promoted.leader, "n2");
    assert!(
        promoted.time_ms as i64 >= at,
        "promoted {} ms before its time",
        at - promoted.time_ms as i64
    );
    // The old leader rejoins as a replica.
    healthy(&c, 2, Duration::from_secs(60)).await;
}

/// The number of sessions on `conninfo`'s server waiting for a synchronous
/// standby to confirm their commit.
async fn waiting_for_sync_rep(conninfo: &str) -> Result<i64, String> {
    one(
        conninfo,
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
    )
    .await?
    .parse()
    .map_err(|e: std::num::ParseIntError| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maximum_protection_takes_no_write_before_its_first_standby_is_listed() {
    let mut c = cluster()
        .agent_settings("protection = \"maximum_protection\"\non_sync_blocked = \"reject\"")
        .hold_back(1)
        .hold_back(2)
        .start();
    // n1 leads a new cluster alone: PostgreSQL waits for a standby no
    // member can be, and the key says commits are blocked.
    let direct = c.node(0).pg_conninfo();
    eventually(
        "the new leader blocks commits",
        Duration::from_secs(20),
        || async {
            let names = one(&direct, "SHOW synchronous_standby_names").await?;
            let key = sync_key(&c).await;
            let ok = names == "FIRST 1 (\"pgwarden/none\")"
                && key["leader"] == "n1"
                && key["synchronous"] == true
                && key["members"] == serde_json::json!([])
                && key["degraded_since_ms"].is_null()
                && key["blocked_since_ms"].is_u64();
            ok.then_some(()).ok_or(format!("{names} / {key}"))
        },
    )
    .await;
    // The very first commit waits.
    let (client, conn) = tokio_postgres::connect(&direct, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let first = tokio::spawn(async move {
        client
            .simple_query("CREATE TABLE acked (id int8); INSERT INTO acked VALUES (0)")
            .await
    });
    eventually(
        "the first commit waits for a standby",
        Duration::from_secs(10),
        || async {
            let n = waiting_for_sync_rep(&direct).await?;
            (n >= 1).then_some(()).ok_or(format!("{n} waiting"))
        },
    )
    .await;
    assert!(!first.is_finished(), "a commit acknowledged by nobody");
    // The state is explicit, and the read-write port refuses at once.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["ctl", "--api", &c.node(0).api_url(), "list"])
        .output()
        .unwrap();
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.contains("Writes blocked: no synchronous standby") && list.contains("none"),
        "{list}"
    );
    let rw = c.node(0).rw_conninfo();
    refuses_while_sync_blocked(&rw).await;
    assert!(!first.is_finished());

    // The first replica joins (cloning the blocked primary) and is listed:
    // the commit completes, and the read-write port serves.
    c.launch_held_back(1);
    eventually("n2 is listed", BOOTSTRAP, || async {
        let key = sync_key(&c).await;
        (key["members"] == serde_json::json!(["n2"]))
            .then_some(())
            .ok_or(key.to_string())
    })
    .await;
    tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .unwrap_or_else(|_| panic!("the first commit still waits\n{}", c.logs()))
        .unwrap()
        .unwrap();
    eventually(
        "the read-write port serves",
        Duration::from_secs(20),
        || async { one(&rw, "INSERT INTO acked VALUES (-1) RETURNING 1").await },
    )
    .await;

    // Nothing acknowledged is lost when the leader dies now, and the new
    // leader, alone, blocks commits in turn until the last node joins.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = start_writer(c.node(1).rw_conninfo(), stop.clone());
    acknowledged_over(&direct, 20).await;
    c.kill_node(0);
    assert_eq!(new_primary(&c, 0, Duration::from_secs(30)).await, 1);
    let n2 = c.node(1).pg_conninfo();
    eventually(
        "the new leader blocks commits",
        Duration::from_secs(20),
        || async {
            let names = one(&n2, "SHOW synchronous_standby_names").await?;
            let key = sync_key(&c).await;
            let ok = names == "FIRST 1 (\"pgwarden/none\")"
                && key["leader"] == "n2"
                && key["blocked_since_ms"].is_u64();
            ok.then_some(()).ok_or(format!("{names} / {key}"))
        },
    )
    .await;
    c.launch_held_back(2);
    eventually("n3 is listed", BOOTSTRAP, || async {
        let key = sync_key(&c).await;
        (key["leader"] == "n2" && key["members"] == serde_json::json!(["n3"]))
            .then_some(())
            .ok_or(key.to_string())
    })
    .await;
    writes_resume(&n2).await;
    assert_no_acknowledged_write_lost(&n2, &stop, writer).await;
    let rows: Vec<String> = query(&n2, "SELECT id FROM acked WHERE id <= 0 ORDER BY id")
        .await
        .unwrap();
    assert_eq!(rows, ["-1", "0"], "the first commits are on the new leader");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_commit_lists_every_standby_and_loses_no_acknowledged_write_on_failover() {
    let mut c = cluster()
        .agent_settings(
            "protection = \"maximum_protection\"\nsync_method = \"quorum\"\nsynchronous_node_count = 1",
        )
        .start();
    healthy(&c, 2, BOOTSTRAP).await;
    // Both replicas are listed; each commit waits for any one of them.
    eventually(
        "both standbys are listed, one of them needed",
        Duration::from_secs(30),
        || async {
            let names = one(&c.node(0).pg_conninfo(), "SHOW synchronous_standby_names").await?;
            let key = sync_key(&c).await;
            let ok = names == "ANY 1 (\"n2\", \"n3\")"
                && key["members"] == serde_json::json!(["n2", "n3"])
                && key["quorum"] == 1;
            ok.then_some(()).ok_or(format!("{names} / {key}"))
        },
    )
    .await;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgwarden"))
        .args(["ctl", "--api", &c.node(0).api_url(), "list"])
        .output()
        .unwrap();
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.contains("Quorum Standby")
            && list.contains("Synchronous standbys: n2, n3 (each commit on any 1)"),
        "{list}"
    );
    // The leader's /patroni lists its standbys as Patroni's does.
    eventually(
        "the leader lists its quorum standbys",
        Duration::from_secs(20),
        || async {
            let v = member_status(&c, 0).await?;
            let rows: Vec<String> = v["replication"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|r| {
                            format!(
                                "{} {} {} {} {}",
                                r["application_name"].as_str().unwrap_or("?"),
                                r["usename"].as_str().unwrap_or("?"),
                                r["client_addr"].as_str().unwrap_or("?"),
                                r["state"].as_str().unwrap_or("?"),
                                r["sync_state"].as_str().unwrap_or("?"),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let mut rows = rows;
            rows.sort();
            (rows
                == [
                    "n2 postgres 127.0.0.1 streaming quorum",
                    "n3 postgres 127.0.0.1 streaming quorum",
                ])
            .then_some(())
            .ok_or(format!("{rows:?}"))
        },
    )
    .await;
    let replica = member_status(&c, 1).await.unwrap();
    assert!(replica.get("replication").is_none(), "{replica}");
    query(&c.node(0).pg_conninfo(), "CREATE TABLE acked (id int8)")
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = start_writer(c.node(2).rw_conninfo(), stop.clone());
    acknowledged_over(&c.node(0).pg_conninfo(), 50).await;
    // kill -9 of the whole node while the writer runs: the survivor that
    // holds every acknowledged commit must be the one promoted.
    c.kill_node(0);
    let np = new_primary(&c, 0, Duration::from_secs(30)).await;
    let conninfo = c.node(np).pg_conninfo();
    writes_resume(&conninfo).await;
    assert_no_acknowledged_write_lost(&conninfo, &stop, writer).await;
    // The new leader lists the other survivor.
    let other = if np == 1 { "n3" } else { "n2" };
    eventually(
        "the new leader lists the other survivor",
        Duration::from_secs(20),
        || async {
            let key = sync_key(&c).await;
            let ok = key["leader"] == c.node(np).name.as_str()
                && key["members"] == serde_json::json!([other])
                && key["quorum"] == 1;
            ok.then_some(()).ok_or(key.to_string())
        },
    )
    .await;
}

/// Waits until `q` gives `want` on every node in `nodes`.
async fn reads_on(c: &AgentCluster, nodes: &[usize], q: &str, want: &str) {
    for &i in nodes {
        gives(&c.node(i).pg_conninfo(), q, want, Duration::from_secs(40)).await;
    }
}

/// Waits up to `within` until `q` at `conninfo` answers `want`.
async fn gives(conninfo: &str, q: &str, want: &str, within: Duration) {
    eventually(&format!("{q:?} gives {want:?}"), within, || async {
        let v = one(conninfo, q).await?;
        (v == want).then_some(()).ok_or(v)
    })
    .await;
}

/// The "other data centre" of a standby cluster: a primary and
/// `replicas` replicas that no agent manages, with a table `dr` holding
/// one row. Members clone the standby leader, a standby: PostgreSQL allows
/// that only with full-page writes on the primary.
async fn remote_site(replicas: usize) -> pgwarden_testkit::TestCluster {
    let remote = pgwarden_testkit::TestCluster::builder()
        .replicas(replicas)
        .setting("full_page_writes", "on")
        .start();
    query(
        &remote.conninfo(0),
        "CREATE TABLE dr (x int); INSERT INTO dr VALUES (1)",
    )
    .await
    .unwrap();
    remote
}

/// Waits until n1 streams from the remote source at `remote_port` and
/// n2 from n1.
async fn chain_from_remote(c: &AgentCluster, remote_port: &str) {
    eventually("the chain remote → n1 → n2", BOOTSTRAP, || async {
        let (a, b) = (
            streams_from_port(c, 0).await?,
            streams_from_port(c, 1).await?,
        );
        (a == remote_port && b == c.node(0).pg_port.to_string())
            .then_some(())
            .ok_or(format!("n1 from {a}, n2 from {b}"))
    })
    .await;
}

/// The replication slots of the server at `conninfo`, `name:active`.
async fn slots_on(conninfo: &str) -> String {
    one(
        conninfo,
        "SELECT string_agg(slot_name || ':' || active, ',') FROM pg_replication_slots",
    )
    .await
    .unwrap()
}

/// Each member in node `i`'s `GET /cluster`, as `name:` followed by the
/// given fields joined by `:`.
async fn cluster_members(
    c: &AgentCluster,
    i: usize,
    fields: &[&str],
) -> Result<Vec<String>, String> {
    let url = format!("{}/cluster", c.node(i).api_url());
    let v = pgwarden_agent::http_client::get_json(&url, Duration::from_secs(2))
        .await
        .map_err(|e| e.to_string())?;
    let text = |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
    Ok(v["members"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|m| {
                    let mut parts = vec![text(&m["name"])];
                    parts.extend(fields.iter().map(|f| text(&m[*f])));
                    parts.join(":")
                })
                .collect()
        })
        .unwrap_or_default())
}

/// The body of a `GET` of `path` on node `i`'s API.
async fn api_get_text(c: &AgentCluster, i: usize, path: &str) -> String {
    let url = format!("{}{path}", c.node(i).api_url());
    let r = pgwarden_agent::http_client::request("GET", &url, None, None, Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    r.body
}

/// The port node `i`'s WAL receiver streams from.
async fn streams_from_port(c: &AgentCluster, i: usize) -> Result<String, String> {
    one(
        &c.node(i).pg_conninfo(),
        "SELECT sender_port FROM pg_stat_wal_receiver WHERE status = 'streaming'",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_cluster_follows_its_remote_primary_until_it_is_promoted() {
    let remote = remote_site(0).await;
    let source = remote.conninfo(0);
    let port = remote.port(0);
    // Only the member that creates the cluster reads its file's
    // standby_cluster; it puts it in the dynamic configuration.
    let mut c = cluster()
        .nodes(2)
        .node_settings(
            0,
            &format!(
                "standby_cluster = {{ host = \"127.0.0.1\", port = {port}, \
                 primary_slot_name = \"dr_site\" }}"
            ),
        )
        .start();
    let remote_port = port.to_string();
    let standby_leader = |c: &AgentCluster, i: usize| {
        (
            c.api_status(i, "/standby-leader"),
            c.api_status(i, "/leader"),
            c.api_status(i, "/primary"),
            c.api_status(i, "/replica"),
        )
    };
    eventually("n1 leads the standby cluster", BOOTSTRAP, || async {
        let s = standby_leader(&c, 0);
        (s == (Some(200), Some(200), Some(503), Some(503)))
            .then_some(())
            .ok_or(format!("{s:?}"))
    })
    .await;
    let config = pgwarden_agent::http_client::get_json(
        &format!("{}/config", c.node(0).api_url()),
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    assert_eq!(
        config["standby_cluster"],
        serde_json::json!({"host": "127.0.0.1", "port": port, "primary_slot_name": "dr_site"})
    );
    // n1 streams from the remote through the named slot, n2 from n1
    // through the slot n1 keeps for it; nobody takes writes.
    chain_from_remote(&c, &remote_port).await;
    assert_eq!(slots_on(&source).await, "dr_site:true");
    // Both stream, which ctl shows as their state, as Patroni 3 does.
    eventually("ctl's roles", Duration::from_secs(20), || async {
        let roles = cluster_members(&c, 1, &["role", "state"]).await?;
        (roles == ["n1:standby_leader:streaming", "n2:replica:streaming"])
            .then_some(())
            .ok_or(format!("{roles:?}"))
    })
    .await;
    slots_are(&c, 0, vec!["pgwarden_n2:true".into()]).await;
    query(&source, "INSERT INTO dr VALUES (2)").await.unwrap();
    reads_on(&c, &[0, 1], "SELECT count(*) FROM dr", "2").await;
    assert!(
        writable(&c).await.is_empty(),
        "a standby cluster takes no writes"
    );
    let refused = one(&c.node(0).rw_conninfo(), "INSERT INTO dr VALUES (0)").await;
    assert!(
        refused.is_err(),
        "the read-write port took a write: {refused:?}"
    );

    // A switchover moves the standby leadership to n2, which follows the
    // remote; n1 then streams from n2, without a rewind.
    let body = serde_json::json!({"leader": "n1", "candidate": "n2"});
    let r = api_call(&c, 0, "POST", "/switchover", body).await;
    assert_eq!(
        (r.status, r.body.trim()),
        (200, "Successfully switched over to n2")
    );
    let n2_port = c.node(1).pg_port.to_string();
    eventually(
        "the chain remote → n2 → n1",
        Duration::from_secs(60),
        || async {
            let s = standby_leader(&c, 1);
            let a = streams_from_port(&c, 1).await.unwrap_or_default();
            let b = streams_from_port(&c, 0).await.unwrap_or_default();
            (s == (Some(200), Some(200), Some(503), Some(503)) && a == remote_port && b == n2_port)
                .then_some(())
                .ok_or(format!("n2: {s:?}, from {a:?}; n1 from {b:?}"))
        },
    )
    .await;
    assert!(
        !c.node(0).agent_log().contains("rewound"),
        "a standby leader has nothing to rewind"
    );
    query(&source, "INSERT INTO dr VALUES (3)").await.unwrap();
    reads_on(&c, &[0, 1], "SELECT count(*) FROM dr", "3").await;
    assert!(writable(&c).await.is_empty(), "nobody was promoted");

    // Losing the standby leader: n1 takes over and follows the remote,
    // still without promoting.
    c.kill_node(1);
    eventually(
        "n1 leads the standby cluster",
        Duration::from_secs(60),
        || async {
            let s = standby_leader(&c, 0);
            let from = streams_from_port(&c, 0).await.unwrap_or_default();
            (s == (Some(200), Some(200), Some(503), Some(503)) && from == remote_port)
                .then_some(())
                .ok_or(format!("{s:?}, streaming from {from:?}"))
        },
    )
    .await;
    query(&source, "INSERT INTO dr VALUES (4)").await.unwrap();
    reads_on(&c, &[0], "SELECT count(*) FROM dr", "4").await;
    assert!(writable(&c).await.is_empty(), "nobody was promoted");

    // Taking standby_cluster out of the configuration promotes it.
    patch_config_ok(&c, 0, serde_json::json!({"standby_cluster": null})).await;
    eventually("n1 is promoted", Duration::from_secs(40), || async {
        let w = writable(&c).await;
        (w == [0] && c.api_status(0, "/primary") == Some(200))
            .then_some(())
            .ok_or(format!("writable: {w:?}"))
    })
    .await;
    query(&c.node(0).pg_conninfo(), "INSERT INTO dr VALUES (5)")
        .await
        .unwrap();
    reads_on(&c, &[0], "SELECT count(*) FROM dr", "5").await;

    // Made a standby cluster again, the primary stops taking writes and
    // leads as a standby of the remote. Its history forked from the
    // remote's when it was promoted, so it is rewound onto the remote's,
    // losing the row written meanwhile, and streams again.
    let checkpoints = "SELECT checkpoints_req FROM pg_stat_bgwriter";
    let requested = one(&source, checkpoints).await.unwrap();
    patch_config_ok(
        &c,
        0,
        serde_json::json!({"standby_cluster": {"host": "127.0.0.1", "port": port}}),
    )
    .await;
    eventually(
        "n1 is a standby leader that streams from the remote again",
        Duration::from_secs(60),
        || async {
            let w = writable(&c).await;
            let s = c.api_status(0, "/standby-leader");
            let from = streams_from_port(&c, 0).await.unwrap_or_default();
            (w.is_empty() && s == Some(200) && from == remote_port)
                .then_some(())
                .ok_or(format!(
                    "writable: {w:?}, /standby-leader {s:?}, from {from:?}"
                ))
        },
    )
    .await;
    assert!(c
        .node(0)
        .agent_log()
        .contains("its source's history does not have; it must rewind"));
    query(&source, "INSERT INTO dr VALUES (6)").await.unwrap();
    reads_on(
        &c,
        &[0],
        "SELECT string_agg(x::text, ',' ORDER BY x) FROM dr",
        "1,2,3,4,6",
    )
    .await;
    let p = member_status(&c, 0).await.unwrap()["problem"].clone();
    assert!(p.is_null(), "problem after the rewind: {p}");
    // The remote, whose control file was current, was spared a CHECKPOINT.
    assert_eq!(one(&source, checkpoints).await.unwrap(), requested);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_leader_rewinds_onto_its_source_only_when_their_histories_forked() {
    use nix::sys::signal::Signal;
    use pgwarden_pgctl::StopMode;
    // The other site: a primary and two replicas.
    let mut remote = remote_site(2).await;
    let sources: Vec<String> = (0..3).map(|i| remote.conninfo(i)).collect();
    let port = remote.port(0);
    let c = cluster()
        .nodes(1)
        .node_settings(
            0,
            &format!("standby_cluster = {{ host = \"127.0.0.1\", port = {port} }}"),
        )
        .start();
    let rows = "SELECT string_agg(x::text, ',' ORDER BY x) FROM dr";
    reads_on(&c, &[0], rows, "1").await;
    let ports: Vec<u16> = (0..3).map(|i| remote.port(i)).collect();
    let streams_from = |i: usize| {
        let want = ports[i].to_string();
        let c = &c;
        async move {
            eventually(
                &format!("n1 streams from remote node {i}"),
                Duration::from_secs(40),
                || async {
                    let from = streams_from_port(c, 0).await?;
                    (from == want).then_some(()).ok_or(from)
                },
            )
            .await
        }
    };
    streams_from(0).await;
    let rewinds = |c: &AgentCluster| {
        c.node(0)
            .agent_log()
            .matches("its source's history does not have; it must rewind")
            .count()
    };

    // A clean switchover at the remote site: its primary stops after
    // sending all its WAL, replica 1 is promoted. n1 follows the new
    // timeline as it is, without a rewind.
    remote.node(0).stop(StopMode::Fast).unwrap();
    remote.node(1).promote().unwrap();
    query(&sources[1], "INSERT INTO dr VALUES (2)")
        .await
        .unwrap();
    let to =
        |i: usize| serde_json::json!({"standby_cluster": {"host": "127.0.0.1", "port": ports[i]}});
    patch_config_ok(&c, 0, to(1)).await;
    streams_from(1).await;
    reads_on(&c, &[0], rows, "1,2").await;
    // Cut off from the source's WAL while the source still answers, it
    // compares histories, finds them one, and leaves its data alone.
    let hba_path = remote.node(1).datadir().join("pg_hba.conf");
    let hba = std::fs::read_to_string(&hba_path).unwrap();
    remote.set_hba(
        1,
        &format!("host replication all 127.0.0.1/32 reject\n{hba}"),
    );
    query(
        &sources[1],
        "SELECT pg_terminate_backend(pid) FROM pg_stat_replication",
    )
    .await
    .unwrap();
    eventually(
        "n1 reports that it does not stream",
        Duration::from_secs(40),
        || async {
            let p = member_status(&c, 0).await?["problem"].clone();
            p.as_str()
                .is_some_and(|p| p.contains("not streaming from the remote source"))
                .then_some(())
                .ok_or(p.to_string())
        },
    )
    .await;
    assert_eq!(
        rewinds(&c),
        0,
        "a standby leader on its source's history was rewound"
    );
    remote.set_hba(1, &hba);
    streams_from(1).await;

    // Replica 2 follows the new primary; its WAL receiver stops, so the
    // standby leader gets a row that replica 2 never will.
    let new_primary = remote.port(1);
    let replica = remote.node(2);
    replica
        .follow("127.0.0.1", new_primary, "postgres")
        .unwrap();
    replica.reload().unwrap();
    eventually(
        "replica 2 streams from the new primary and has its rows",
        Duration::from_secs(30),
        || async {
            let s = one(&sources[2], "SELECT status FROM pg_stat_wal_receiver").await?;
            let r = one(&sources[2], rows).await?;
            (s == "streaming" && r == "1,2")
                .then_some(())
                .ok_or(format!("{s}, rows {r}"))
        },
    )
    .await;
    let receiver: i32 = one(&sources[2], "SELECT pid FROM pg_stat_wal_receiver")
        .await
        .unwrap()
        .parse()
        .unwrap();
    signal(receiver, Signal::SIGSTOP);
    query(&sources[1], "INSERT INTO dr VALUES (3)")
        .await
        .unwrap();
    reads_on(&c, &[0], rows, "1,2,3").await;
    // The remote site fails over to replica 2, losing that row.
    remote.node(1).stop(StopMode::Immediate).unwrap();
    signal(receiver, Signal::SIGKILL);
    eventually(
        "replica 2 is back after its receiver's crash",
        Duration::from_secs(30),
        || async { one(&sources[2], "SELECT pg_is_in_recovery()").await },
    )
    .await;
    remote.node(2).promote().unwrap();
    query(&sources[2], "INSERT INTO dr VALUES (4)")
        .await
        .unwrap();
    assert_eq!(one(&sources[2], rows).await.unwrap(), "1,2,4");
    // Pointed at the new remote primary, the standby leader cannot stream
    // from it until it is rewound onto the new timeline.
    patch_config_ok(&c, 0, to(2)).await;
    reads_on(&c, &[0], rows, "1,2,4").await;
    streams_from(2).await;
    assert_eq!(rewinds(&c), 1);
    assert!(writable(&c).await.is_empty(), "nobody was promoted");
    query(&sources[2], "INSERT INTO dr VALUES (5)")
        .await
        .unwrap();
    reads_on(&c, &[0], rows, "1,2,4,5").await;
}

/// A directory that PostgreSQL's user, and the commands the agents run as
/// it, may write to: a shared WAL archive, a backup tool's files.
/// A "backup tool" for `replica_methods`: a script `name` in `tools` that
/// reads `--datadir` and `--connstring` as Patroni passes them (into `$d`
/// and `$c`), runs `middle` (shell lines), then clones with pg_basebackup.
fn backup_tool(tools: &tempfile::TempDir, name: &str, middle: &str) -> std::path::PathBuf {
    let pg_basebackup = pgwarden_pgctl::PgBinaries::discover()
        .unwrap()
        .path("pg_basebackup");
    let script = tools.path().join(name);
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             for a in \"$@\"; do case $a in --datadir=*) d=${{a#--datadir=}};; --connstring=*) c=${{a#--connstring=}};; esac; done\n\
             {middle}\
             exec {} -D \"$d\" -d \"$c\" -X stream -c fast --no-sync\n",
            pg_basebackup.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    script
}

fn shared_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    dir
}

/// A primary no agent manages that archives its WAL into `archive`.
fn archiving_primary(archive: &str) -> pgwarden_testkit::TestCluster {
    pgwarden_testkit::TestCluster::builder()
        .setting("archive_mode", "on")
        .setting("archive_command", &format!("cp %p {archive}/%f"))
        .start()
}

/// Ends the current WAL segment of `source` and waits until it is
/// archived.
async fn archive_current_segment(source: &str) {
    let segment = one(source, "SELECT pg_walfile_name(pg_switch_wal())")
        .await
        .unwrap();
    eventually(
        "the segment is archived",
        Duration::from_secs(30),
        || async {
            let archived = one(source, "SELECT last_archived_wal FROM pg_stat_archiver").await?;
            (archived >= segment).then_some(()).ok_or(archived)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_leader_replays_the_remote_archive_while_it_cannot_stream() {
    // The remote archives its WAL into a directory both servers' user can
    // reach, as a shared archive (or object storage) would be.
    let archive = shared_dir();
    let dir = archive.path().display().to_string();
    let remote = archiving_primary(&dir);
    let source = remote.conninfo(0);
    query(&source, "CREATE TABLE dr (x int)").await.unwrap();
    // Streaming goes through a relay, which the test then cuts.
    let relay = pgwarden_testkit::Relay::start(remote.addr(0).parse().unwrap()).unwrap();
    let relay_port = relay.addr().port();
    let restore = format!("cp {dir}/%f %p");
    let cleanup = format!("echo %r > {dir}/cleaned_up_to");
    let c = cluster()
        .nodes(1)
        .node_settings(
            0,
            &format!(
                "standby_cluster = {{ host = \"127.0.0.1\", port = {relay_port}, \
                 restore_command = \"{restore}\", archive_cleanup_command = \"{cleanup}\" }}"
            ),
        )
        .start();
    let n1 = c.node(0).pg_conninfo();
    eventually("n1 streams as standby leader", BOOTSTRAP, || async {
        let from = streams_from_port(&c, 0).await?;
        (from == relay_port.to_string() && c.api_status(0, "/standby-leader") == Some(200))
            .then_some(())
            .ok_or(from)
    })
    .await;
    assert_eq!(one(&n1, "SHOW restore_command").await.unwrap(), restore);
    assert_eq!(
        one(&n1, "SHOW archive_cleanup_command").await.unwrap(),
        cleanup
    );

    // No streaming from here on: rows written now reach n1 only through
    // the archive.
    relay.set_refuse(true);
    relay.reset_all();
    eventually("n1 no longer streams", Duration::from_secs(30), || async {
        match streams_from_port(&c, 0).await {
            Err(e) if e == "no row" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    query(
        &source,
        "INSERT INTO dr SELECT generate_series(1, 100); CHECKPOINT",
    )
    .await
    .unwrap();
    archive_current_segment(&source).await;
    reads_on(&c, &[0], "SELECT count(*) FROM dr", "100").await;
    // A restart point on n1 (after the remote's checkpoint it replayed)
    // runs the cleanup command with the oldest segment it still needs.
    eventually(
        "the archive cleanup runs",
        Duration::from_secs(30),
        || async {
            query(&n1, "CHECKPOINT").await?;
            let got = std::fs::read_to_string(archive.path().join("cleaned_up_to"))
                .map_err(|e| e.to_string())?;
            (got.trim().len() == 24).then_some(()).ok_or(got)
        },
    )
    .await;

    // Taking the commands out of the configuration takes them off n1.
    patch_config_ok(
        &c,
        0,
        serde_json::json!({"standby_cluster": {"restore_command": null, "archive_cleanup_command": null}}),
    )
    .await;
    gives(&n1, "SHOW restore_command", "", Duration::from_secs(30)).await;
    assert_eq!(one(&n1, "SHOW archive_cleanup_command").await.unwrap(), "");
    assert!(writable(&c).await.is_empty(), "n1 was not promoted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_etcd_section_moves_the_leader_to_new_endpoints_without_a_restart() {
    let c = cluster().nodes(2).etcd_relays().start();
    let p = healthy(&c, 1, BOOTSTRAP).await;
    assert_eq!(p, 0, "node 0 bootstraps the cluster");
    let relay = c.etcd_relay(0).addr().to_string();
    let file = c.node(0).config.clone();
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains(&relay), "{text}");
    let reloaded = |n: usize, what: &'static str| {
        let node = c.node(0);
        move || {
            let seen = node.agent_log().matches(what).count();
            async move { (seen >= n).then_some(()).ok_or(format!("{seen} times")) }
        }
    };

    // An endpoint where nobody answers is refused; the old connection stays.
    let closed = pgwarden_testkit::free_port();
    std::fs::write(&file, text.replace(&relay, &format!("127.0.0.1:{closed}"))).unwrap();
    c.reload_agent(0);
    eventually(
        "the bad endpoint is refused",
        Duration::from_secs(20),
        reloaded(1, "etcd settings not reloaded, the old connection stays"),
    )
    .await;

    // etcd itself, without the relay: once reloaded, cutting the relay
    // costs the leader nothing.
    std::fs::write(&file, text.replace(&relay, &c.etcd_endpoint())).unwrap();
    c.reload_agent(0);
    eventually(
        "the new endpoint is taken",
        Duration::from_secs(20),
        reloaded(1, "etcd connection reloaded"),
    )
    .await;
    let leader = member_status(&c, 0).await.unwrap()["leader"].clone();
    c.etcd_relay(0).set_blackhole(true);
    // Past the point where a leader cut off from etcd demotes (loop_wait +
    // retry_timeout = 3 s) and its lease runs out (ttl = 6 s).
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(writable(&c).await, [0], "the leader kept leading");
    let st = member_status(&c, 0).await.unwrap();
    assert_eq!(st["dcs_reachable"], true, "{st}");
    assert_eq!(st["leader"], leader);
    assert!(!c.node(0).agent_log().contains("demoting"));
}

/// The changes a consumer of logical slot `slot` receives now on node
/// `i` (test_decoding's lines for the inserts), consuming them.
async fn consume(c: &AgentCluster, i: usize, slot: &str) -> Result<Vec<String>, String> {
    query(
        &c.node(i).pg_conninfo(),
        &format!(
            "SELECT data FROM pg_logical_slot_get_changes('{slot}', NULL, NULL) \
             WHERE data LIKE 'table public.cdc_t: INSERT%'"
        ),
    )
    .await
}

/// Waits until node `i` holds slot `cdc` at `confirmed` or further.
async fn slot_reaches(c: &AgentCluster, i: usize, confirmed: &str, within: Duration) {
    let conninfo = c.node(i).pg_conninfo();
    let q = format!(
        "SELECT coalesce(bool_or(confirmed_flush_lsn >= '{confirmed}'), false) \
         FROM pg_replication_slots WHERE slot_name = 'cdc'"
    );
    eventually(
        &format!("node {i}'s slot cdc reaches {confirmed}"),
        within,
        || async {
            let v = one(&conninfo, &q).await?;
            (v == "t").then_some(()).ok_or(v)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_logical_slot_survives_a_failover_where_its_consumer_left_off() {
    let mut c = cluster()
        .nodes(2)
        .pg_parameters("wal_level = \"logical\"")
        .start();
    let p = healthy(&c, 1, BOOTSTRAP).await;
    assert_eq!(p, 0, "node 0 bootstraps the cluster");
    patch_config_ok(
        &c,
        0,
        serde_json::json!({"slots": {"cdc": {
            "type": "logical", "database": "postgres", "plugin": "test_decoding"
        }}}),
    )
    .await;
    let logical = |i: usize| {
        let conninfo = c.node(i).pg_conninfo();
        async move {
            one(
                &conninfo,
                "SELECT coalesce(string_agg(slot_name || ':' || plugin, ','), '') \
                 FROM pg_replication_slots WHERE slot_type = 'logical'",
            )
            .await
        }
    };
    eventually(
        "the leader creates the slot",
        Duration::from_secs(30),
        || async {
            let v = logical(0).await?;
            (v == "cdc:test_decoding").then_some(()).ok_or(v)
        },
    )
    .await;
    everywhere(&c, "hot_standby_feedback", "on").await;
    eventually(
        "the replica has a copy",
        Duration::from_secs(60),
        || async {
            let v = logical(1).await?;
            (v == "cdc:test_decoding").then_some(()).ok_or(v)
        },
    )
    .await;

    // The consumer reads the first row on the leader; the replica's copy
    // follows the consumer's position.
    let leader = c.node(0).pg_conninfo();
    query(
        &leader,
        "CREATE TABLE cdc_t (x int); INSERT INTO cdc_t VALUES (1)",
    )
    .await
    .unwrap();
    let got = consume(&c, 0, "cdc").await.unwrap();
    assert_eq!(got, ["table public.cdc_t: INSERT: x[integer]:1"]);
    let confirmed = one(
        &leader,
        "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'cdc'",
    )
    .await
    .unwrap();
    let replica = c.node(1).pg_conninfo();
    slot_reaches(&c, 1, &confirmed, Duration::from_secs(60)).await;

    // The leader keeps the catalog rows the copy needs (hot_standby_feedback
    // through the replica's physical slot): the replica says its copy is
    // safe to use after a failover.
    eventually(
        "the replica's copy is safe after a failover",
        Duration::from_secs(30),
        || async {
            let v = member_status(&c, 1).await?["logical_slots"].clone();
            (v == serde_json::json!({"cdc": true}))
                .then_some(())
                .ok_or(v.to_string())
        },
    )
    .await;

    // A row the consumer has not read yet, then the leader is lost.
    query(&leader, "INSERT INTO cdc_t VALUES (2)")
        .await
        .unwrap();
    replicated(&c, 0).await;
    c.kill_node(0);
    let np = new_primary(&c, 0, Duration::from_secs(60)).await;
    assert_eq!(np, 1);
    query(&replica, "INSERT INTO cdc_t VALUES (3)")
        .await
        .unwrap();
    // The consumer continues on the new leader where it left off: row 2
    // (never confirmed) and row 3, not row 1 again.
    let got = consume(&c, 1, "cdc").await.unwrap();
    assert_eq!(
        got,
        [
            "table public.cdc_t: INSERT: x[integer]:2",
            "table public.cdc_t: INSERT: x[integer]:3"
        ]
    );

    // The former leader rejoins: pg_rewind takes its own slot, from the
    // history it left, and it copies the new leader's at the consumer's
    // position.
    let confirmed = one(
        &replica,
        "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'cdc'",
    )
    .await
    .unwrap();
    c.start_agent(0);
    slot_reaches(&c, 0, &confirmed, Duration::from_secs(90)).await;
    assert!(
        c.node(0)
            .agent_log()
            .contains("copying logical slots from the leader"),
        "the former leader took a copy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_created_by_the_first_method_that_works() {
    // A "backup tool" that clones with pg_basebackup by the connection
    // string it is given, and records what it was called with and what it
    // found in the data directory; and one that fails.
    let tools = shared_dir();
    let dir = tools.path().display().to_string();
    let script = backup_tool(
        &tools,
        "restore.sh",
        &format!(
            "echo \"$*\" > {dir}/restore.args\n\
             ls -A \"$d\" | wc -l > {dir}/restore.found\n\
             i=0; while [ ! -e {dir}/gate ] && [ $i -lt 900 ]; do sleep 0.1; i=$((i+1)); done\n"
        ),
    );
    // A tool that refreshes an existing copy (as a delta restore does),
    // so it fails on an empty data directory; `keep_data` hands it the
    // old one.
    let delta = backup_tool(
        &tools,
        "delta.sh",
        &format!(
            "n=$(ls -A \"$d\" | wc -l)\n\
             [ \"$n\" -gt 0 ] || exit 1\n\
             test -f \"$d/PG_VERSION\" && echo \"$n\" > {dir}/delta.found\n\
             find \"$d\" -mindepth 1 -delete\n"
        ),
    );
    let c = cluster()
        .nodes(2)
        .node_settings(
            1,
            &format!(
                "create_replica_methods = [\"delta\", \"broken\", \"restore\", \"basebackup\"]\n\
                 replica_methods = {{ broken = {{ command = \"echo ran > {dir}/broken.ran; false\" }}, \
                 restore = {{ command = \"{}\" }}, delta = {{ command = \"{}\", keep_data = true }} }}",
                script.display(),
                delta.display()
            ),
        )
        .start();
    // A restore takes long: the member is listed as cloning meanwhile,
    // for longer than a ttl (6 s), and the leader keeps its slot ready.
    let n2_record = || async {
        let snapshot = read_cluster(&c).await;
        pgwarden_agent::record::records(&snapshot)
            .into_iter()
            .find(|m| m.state.name == "n2")
    };
    let first = eventually("n2 is listed as cloning", BOOTSTRAP, || async {
        match n2_record().await {
            Some(r) if r.status == "cloning" => Ok(r.updated_ms),
            r => Err(format!("{r:?}")),
        }
    })
    .await;
    eventually(
        "n2 stays listed as cloning over a ttl",
        Duration::from_secs(20),
        || async {
            match n2_record().await {
                Some(r) if r.status == "cloning" && r.updated_ms > first + 7_000 => Ok(()),
                r => Err(format!("{r:?}")),
            }
        },
    )
    .await;
    assert_eq!(
        cluster_members(&c, 0, &["state"]).await.unwrap(),
        ["n1:running", "n2:cloning"]
    );
    std::fs::write(tools.path().join("gate"), "").unwrap();
    eventually("n2 streams from n1", BOOTSTRAP, || async {
        let from = streams_from_port(&c, 1).await?;
        (from == c.node(0).pg_port.to_string())
            .then_some(())
            .ok_or(from)
    })
    .await;
    // The failing method ran first, then the restore, into an empty data
    // directory, with Patroni's arguments; basebackup was not needed.
    assert_eq!(
        std::fs::read_to_string(tools.path().join("broken.ran")).unwrap(),
        "ran\n"
    );
    let args = std::fs::read_to_string(tools.path().join("restore.args")).unwrap();
    let n1 = c.node(0);
    assert_eq!(
        args.trim(),
        format!(
            "--scope={} --datadir={} --role=replica --connstring=host=127.0.0.1 port={} user=postgres dbname=postgres",
            c.cluster_name(),
            c.node(1).data_dir.display(),
            n1.pg_port
        )
    );
    assert_eq!(
        std::fs::read_to_string(tools.path().join("restore.found"))
            .unwrap()
            .trim(),
        "0"
    );
    let log = c.node(1).agent_log();
    assert!(
        log.lines()
            .any(|l| l.contains("replica created") && l.contains("restore")),
        "{log}"
    );
    // A working replica: rows written on the leader arrive, through the
    // slot the leader keeps for it.
    query(
        &n1.pg_conninfo(),
        "CREATE TABLE restored (x int); INSERT INTO restored VALUES (1)",
    )
    .await
    .unwrap();
    reads_on(&c, &[1], "SELECT count(*) FROM restored", "1").await;
    slots_are(&c, 0, vec!["pgwarden_n2:true".into()]).await;
    assert!(!tools.path().join("delta.found").exists());

    // Reinitialized, the replica keeps its data directory for the method
    // that asks for it, which now works first.
    let r = api_call(&c, 1, "POST", "/reinitialize", serde_json::json!({})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let found = tools.path().join("delta.found");
    eventually(
        "the delta method refreshed n2's old copy",
        Duration::from_secs(60),
        || async {
            let n = std::fs::read_to_string(&found).map_err(|e| e.to_string())?;
            (n.trim().parse::<u32>().unwrap_or(0) > 10)
                .then_some(())
                .ok_or(n)
        },
    )
    .await;
    query(&n1.pg_conninfo(), "INSERT INTO restored VALUES (2)")
        .await
        .unwrap();
    reads_on(&c, &[1], "SELECT count(*) FROM restored", "2").await;
    let log = c.node(1).agent_log();
    assert!(
        log.lines()
            .any(|l| l.contains("replica created") && l.contains("delta")),
        "{log}"
    );
}

/// A base backup of `remote`'s first node in `dir`, readable by
/// PostgreSQL's user (it is taken as root).
fn base_backup(
    remote: &pgwarden_testkit::TestCluster,
    dir: &std::path::Path,
) -> std::path::PathBuf {
    let backup = dir.join("backup");
    let bins = pgwarden_pgctl::PgBinaries::discover().unwrap();
    let status = std::process::Command::new(bins.path("pg_basebackup"))
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &remote.port(0).to_string(),
            "-U",
            "postgres",
        ])
        .arg("-D")
        .arg(&backup)
        .args(["-X", "fetch", "-c", "fast", "--no-sync"])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(std::process::Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(&backup)
        .status()
        .unwrap()
        .success());
    backup
}

/// A script standing in for a backup tool's restore: copies `backup` into
/// the `--datadir` it is given and writes its arguments to `args_file` in
/// `dir`.
fn copy_script(
    dir: &std::path::Path,
    backup: &std::path::Path,
    args_file: &str,
) -> std::path::PathBuf {
    let script = dir.join("restore.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             for a in \"$@\"; do case $a in --datadir=*) d=${{a#--datadir=}};; esac; done\n\
             echo \"$*\" > {}/{args_file}\n\
             cp -R {}/. \"$d\"/\n",
            dir.display(),
            backup.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    script
}

/// A database elsewhere whose primary archives its WAL to a shared
/// directory, with a table holding one row and a base backup taken after
/// it. The directories live as long as the value.
struct ArchivedSite {
    tools: tempfile::TempDir,
    _archive: tempfile::TempDir,
    archive_dir: String,
    remote: pgwarden_testkit::TestCluster,
    source: String,
    backup: std::path::PathBuf,
}

async fn archived_site(table: &str) -> ArchivedSite {
    let tools = shared_dir();
    let archive = shared_dir();
    let archive_dir = archive.path().display().to_string();
    let remote = archiving_primary(&archive_dir);
    let source = remote.conninfo(0);
    query(
        &source,
        &format!("CREATE TABLE {table} (x int); INSERT INTO {table} VALUES (1)"),
    )
    .await
    .unwrap();
    let backup = base_backup(&remote, tools.path());
    ArchivedSite {
        tools,
        _archive: archive,
        archive_dir,
        remote,
        source,
        backup,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_cluster_is_restored_from_a_backup_and_its_archive() {
    // A database elsewhere, with a base backup and a WAL archive that goes
    // on past it.
    let ArchivedSite {
        tools,
        _archive,
        archive_dir,
        remote,
        source,
        backup,
    } = archived_site("restored").await;
    query(&source, "INSERT INTO restored VALUES (2), (3)")
        .await
        .unwrap();
    archive_current_segment(&source).await;
    let sysid = one(&source, "SELECT system_identifier FROM pg_control_system()")
        .await
        .unwrap();
    drop(remote);

    let script = copy_script(tools.path(), &backup, "bootstrap.args");
    let bootstrap = format!(
        "bootstrap = {{ command = \"{}\", recovery = {{ restore_command = \"cp {archive_dir}/%f %p\" }} }}",
        script.display()
    );
    // Every member has the section; whichever wins the race restores.
    let c = cluster()
        .nodes(2)
        .node_settings(0, &bootstrap)
        .node_settings(1, &bootstrap)
        .start();
    let leader = eventually("one writable member", BOOTSTRAP, || async {
        let w = writable(&c).await;
        (w.len() == 1).then(|| w[0]).ok_or(format!("{w:?}"))
    })
    .await;
    let other = 1 - leader;
    let at = c.node(leader).pg_conninfo();
    // The rows written after the backup came from the archive; it is the
    // same database, on a new timeline, and the recovery settings are gone.
    assert_eq!(
        one(&at, "SELECT count(*) FROM restored").await.unwrap(),
        "3"
    );
    assert_eq!(
        one(&at, "SELECT system_identifier FROM pg_control_system()")
            .await
            .unwrap(),
        sysid
    );
    let wal = one(&at, "SELECT pg_walfile_name(pg_current_wal_lsn())")
        .await
        .unwrap();
    assert_ne!(&wal[..8], "00000001", "promoted onto a new timeline");
    gives(&at, "SHOW restore_command", "", Duration::from_secs(30)).await;
    let args = std::fs::read_to_string(tools.path().join("bootstrap.args")).unwrap();
    assert_eq!(
        args.trim(),
        format!(
            "--scope={} --datadir={}",
            c.cluster_name(),
            c.node(leader).data_dir.display()
        )
    );
    // The other member joins the restored cluster as usual.
    reads_on(&c, &[other], "SELECT count(*) FROM restored", "3").await;
    query(&at, "INSERT INTO restored VALUES (4)").await.unwrap();
    reads_on(&c, &[other], "SELECT count(*) FROM restored", "4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_cluster_can_follow_its_source_through_the_archive_alone() {
    // Sites that share no network, only an archive: the standby leader is
    // restored from a backup and replays what the source archives.
    let ArchivedSite {
        tools,
        _archive,
        archive_dir,
        remote: _remote,
        source,
        backup,
    } = archived_site("dr").await;
    let script = copy_script(tools.path(), &backup, "restore.args");
    let restore = format!("cp {archive_dir}/%f %p");
    let c = cluster()
        .nodes(1)
        .node_settings(
            0,
            &format!(
                "create_replica_methods = [\"restore\", \"basebackup\"]\n\
                 replica_methods = {{ restore = {{ command = \"{}\" }} }}\n\
                 standby_cluster = {{ restore_command = \"{restore}\" }}",
                script.display()
            ),
        )
        .start();
    let n1 = c.node(0).pg_conninfo();
    eventually("n1 leads the standby cluster", BOOTSTRAP, || async {
        let s = (
            c.api_status(0, "/standby-leader"),
            c.api_status(0, "/primary"),
        );
        (s == (Some(200), Some(503)))
            .then_some(())
            .ok_or(format!("{s:?}"))
    })
    .await;
    assert_eq!(one(&n1, "SHOW primary_conninfo").await.unwrap(), "");
    // Replaying the archive, not streaming: Patroni's word for it.
    let status = member_status(&c, 0).await.unwrap();
    assert_eq!(status["replication_state"], "in archive recovery");
    let metrics = api_get_text(&c, 0, "/metrics").await;
    assert!(
        metrics.contains("pgwarden_ha_in_archive_recovery 1")
            && metrics.contains("pgwarden_ha_streaming 0"),
        "{metrics}"
    );
    assert_eq!(one(&n1, "SHOW restore_command").await.unwrap(), restore);
    let args = std::fs::read_to_string(tools.path().join("restore.args")).unwrap();
    assert!(
        args.contains("--role=replica") && !args.contains("--connstring"),
        "{args}"
    );
    // Rows written on the source after the backup arrive as the source
    // archives them; nobody takes writes, and no problem is reported for
    // a source that is never streamed from.
    query(&source, "INSERT INTO dr VALUES (2), (3)")
        .await
        .unwrap();
    archive_current_segment(&source).await;
    reads_on(&c, &[0], "SELECT count(*) FROM dr", "3").await;
    assert!(
        writable(&c).await.is_empty(),
        "a standby cluster takes no writes"
    );
    // A standby leader that streams nothing for a ttl (6 s here) reports
    // it when it has a host to stream from; following the archive alone,
    // it must not.
    let watch_until = std::time::Instant::now() + Duration::from_secs(9);
    while std::time::Instant::now() < watch_until {
        let p = member_status(&c, 0).await.unwrap()["problem"].clone();
        assert!(p.is_null(), "{p}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_leader_is_created_by_its_own_methods_then_streams_from_its_source() {
    // A large database is restored from the other site's backups rather
    // than copied over the link; the standby leader then streams.
    let remote = remote_site(0).await;
    let source = remote.conninfo(0);
    let tools = shared_dir();
    let backup = base_backup(&remote, tools.path());
    let script = copy_script(tools.path(), &backup, "restore.args");
    query(&source, "INSERT INTO dr VALUES (2)").await.unwrap();
    let port = remote.port(0);
    // The method is the standby cluster's own; the members' list stays
    // pg_basebackup alone, which n2 uses to clone n1.
    let c = cluster()
        .nodes(2)
        .node_settings(
            0,
            &format!(
                "replica_methods = {{ restore = {{ command = \"{}\" }} }}\n\
                 standby_cluster = {{ host = \"127.0.0.1\", port = {port}, \
                 primary_slot_name = \"dr_site\", create_replica_methods = [\"restore\", \"basebackup\"] }}",
                script.display()
            ),
        )
        .start();
    let remote_port = port.to_string();
    chain_from_remote(&c, &remote_port).await;
    let args = std::fs::read_to_string(tools.path().join("restore.args")).unwrap();
    assert_eq!(
        args.trim(),
        format!(
            "--scope={} --datadir={} --role=replica --connstring=host=127.0.0.1 port={port} user=postgres dbname=postgres",
            c.cluster_name(),
            c.node(0).data_dir.display(),
        )
    );
    let log = c.node(0).agent_log();
    assert!(
        log.lines().any(
            |l| l.contains("standby leader created from the remote source")
                && l.contains("restore")
        ),
        "{log}"
    );
    // Through the slot made for it before the restore; a row written after
    // the backup, and one written now, reach both members.
    assert_eq!(slots_on(&source).await, "dr_site:true");
    query(&source, "INSERT INTO dr VALUES (3)").await.unwrap();
    reads_on(&c, &[0, 1], "SELECT count(*) FROM dr", "3").await;
    assert!(
        writable(&c).await.is_empty(),
        "a standby cluster takes no writes"
    );
    let config = pgwarden_agent::http_client::get_json(
        &format!("{}/config", c.node(1).api_url()),
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    assert_eq!(
        config["standby_cluster"]["create_replica_methods"],
        serde_json::json!(["restore", "basebackup"])
    );
}
