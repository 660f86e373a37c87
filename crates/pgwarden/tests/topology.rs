//! The topology engine against real PostgreSQL clusters.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{engine, fast_probe, sql, sql_value, until};
use pgwarden_probe::Engine;
use pgwarden_testkit::{Relay, StopMode, SyncSpec, TestCluster};
use pgwarden_topology::{
    LagLimit, NoTarget, PrimaryGate, Role, SelectPolicy, Selector, Strategy, SyncState, Topology,
    TopologyConfig, Want,
};

const WAIT: Duration = Duration::from_secs(30);

async fn all_alive(e: &Engine) {
    until(e, "every host alive", WAIT, |s| {
        let dead: Vec<_> = s
            .topology
            .hosts()
            .iter()
            .filter(|h| !h.alive)
            .map(|h| h.addr().to_string())
            .collect();
        dead.is_empty()
            .then_some(())
            .ok_or(format!("dead: {dead:?}"))
    })
    .await;
}

fn roles(t: &Topology) -> Vec<(Role, bool)> {
    t.hosts().iter().map(|h| (h.role, h.alive)).collect()
}

fn picks(sel: &Selector, t: &Topology, want: &Want, n: usize) -> Vec<usize> {
    (0..n)
        .map(|_| sel.select(t, want).expect("a host"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_probe_marking_and_dead_detection_after_kill9() {
    let mut c = TestCluster::builder().replicas(2).start();
    let e = engine(&c.addrs(), TopologyConfig::default());
    let snap = until(&e, "primary and two replicas", WAIT, |s| {
        let r = roles(&s.topology);
        (r == [
            (Role::Primary, true),
            (Role::Replica, true),
            (Role::Replica, true),
        ])
        .then_some(())
        .ok_or(format!("{r:?}"))
    })
    .await;
    assert_eq!(snap.topology.primary(), Some(0));
    assert!(snap.topology.hosts().iter().all(|h| h.timeline == Some(1)));

    // One probe connection per host, recognisable by its application_name.
    for i in 0..3 {
        let n = sql_value(
            &c.conninfo(i),
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgwarden-probe'",
        )
        .await;
        assert_eq!(n.as_deref(), Some("1"), "probe connections on node {i}");
    }

    // kill -9 of a replica: dead within two probe rounds, keeps its role,
    // shows the error, and is no longer selected.
    // Counted once the kill is done: a whole round after it.
    c.node(2).kill9();
    let before = e.snapshot().round;
    e.wait_round(before + 2).await;
    let snap = e.snapshot();
    let h = &snap.topology.hosts()[2];
    assert!(!h.alive, "replica still alive two rounds after kill -9");
    assert_eq!(h.role, Role::Replica, "a dead host keeps its last role");
    assert!(h.error.is_some());
    let sel = Selector::default();
    assert!(picks(&sel, &snap.topology, &Want::Replica, 6)
        .iter()
        .all(|&i| i == 1));

    // kill -9 of the primary: no primary is selectable any more.
    c.node(0).kill9();
    let before = e.snapshot().round;
    e.wait_round(before + 2).await;
    let snap = e.snapshot();
    assert!(!snap.topology.hosts()[0].alive);
    assert_eq!(snap.topology.hosts()[0].role, Role::Primary);
    assert_eq!(
        sel.select(&snap.topology, &Want::Primary),
        Err(NoTarget::NoPrimary)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_and_quorum_marking() {
    let mut c = TestCluster::builder()
        .replicas(2)
        .sync(SyncSpec::First(1))
        .start();
    let e = engine(&c.addrs(), TopologyConfig::default());
    let sync_states = |s: &pgwarden_probe::Snapshot| -> Vec<Option<SyncState>> {
        s.topology.hosts().iter().map(|h| h.sync_state).collect()
    };
    let snap = until(&e, "FIRST 1: one sync, one potential", WAIT, |s| {
        let st = sync_states(s);
        (st == [None, Some(SyncState::Sync), Some(SyncState::Potential)])
            .then_some(())
            .ok_or(format!("{st:?}"))
    })
    .await;
    assert!(!snap.topology.quorum_commit());
    let sel = Selector::default();
    assert!(picks(&sel, &snap.topology, &Want::SyncStandby, 4)
        .iter()
        .all(|&i| i == 1));

    c.set_sync_standby_names("ANY 1 (node2, node3)");
    let snap = until(&e, "ANY 1: both quorum", WAIT, |s| {
        let st = sync_states(s);
        (st == [None, Some(SyncState::Quorum), Some(SyncState::Quorum)]
            && s.topology.quorum_commit())
        .then_some(())
        .ok_or(format!("{st:?} quorum={}", s.topology.quorum_commit()))
    })
    .await;
    let got: BTreeSet<usize> = picks(&sel, &snap.topology, &Want::SyncStandby, 4)
        .into_iter()
        .collect();
    assert_eq!(
        got,
        BTreeSet::from([1, 2]),
        "{:?}",
        snap.topology
            .hosts()
            .iter()
            .map(|h| (h.rtt.get(), h.sync_state))
            .collect::<Vec<_>>()
    );

    c.set_sync_standby_names("");
    until(&e, "no sync config: async", WAIT, |s| {
        let st = sync_states(s);
        (st == [None, Some(SyncState::Async), Some(SyncState::Async)]
            && !s.topology.quorum_commit())
        .then_some(())
        .ok_or(format!("{st:?}"))
    })
    .await;
}

/// A cluster whose second replica sits behind a relay adding `delay` each way.
fn relayed_cluster(delay: Duration) -> (TestCluster, Relay, Vec<String>) {
    let c = TestCluster::builder().replicas(2).start();
    let target: SocketAddr = c.addr(2).parse().unwrap();
    let relay = Relay::start(target).expect("relay");
    relay.set_delay(delay, delay);
    let addrs = vec![c.addr(0), c.addr(1), relay.addr().to_string()];
    (c, relay, addrs)
}

async fn rtts_settled(e: &Engine) -> std::sync::Arc<pgwarden_probe::Snapshot> {
    until(e, "fast and slow replica measured", WAIT, |s| {
        let rtt = |i: usize| s.topology.hosts()[i].rtt.get();
        match (rtt(1), rtt(2)) {
            (Some(fast), Some(slow))
                if slow >= 30.0 && s.topology.hosts().iter().all(|h| h.alive) =>
            {
                let _ = fast;
                Ok(())
            }
            other => Err(format!("rtt {other:?}")),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rtt_window_prefers_fast_replica_then_slow_then_primary() {
    let (mut c, _relay, addrs) = relayed_cluster(Duration::from_millis(15));
    let e = engine(&addrs, TopologyConfig::default());
    let snap = rtts_settled(&e).await;
    let sel = Selector::default();
    assert!(
        picks(&sel, &snap.topology, &Want::Replica, 20)
            .iter()
            .all(|&i| i == 1),
        "the replica 30 ms slower is outside the default 20 ms window"
    );
    // Without the window both replicas take turns.
    let open = Selector::new(SelectPolicy {
        rtt_threshold_enabled: false,
        ..SelectPolicy::default()
    });
    let got: BTreeSet<usize> = picks(&open, &snap.topology, &Want::Replica, 4)
        .into_iter()
        .collect();
    assert_eq!(got, BTreeSet::from([1, 2]));
    // The same through the dynamic switch, without a new selector.
    sel.set_rtt_threshold_enabled_override(Some(false));
    let got: BTreeSet<usize> = picks(&sel, &snap.topology, &Want::Replica, 4)
        .into_iter()
        .collect();
    assert_eq!(got, BTreeSet::from([1, 2]));
    sel.set_rtt_threshold_enabled_override(None);

    // The fast replica stops: the slow one is used, before the primary.
    c.node(1).stop(StopMode::Fast).unwrap();
    let snap = until(&e, "fast replica dead", WAIT, |s| {
        (!s.topology.hosts()[1].alive)
            .then_some(())
            .ok_or("alive".into())
    })
    .await;
    assert!(snap.topology.hosts()[2].alive);
    assert!(picks(&sel, &snap.topology, &Want::Replica, 10)
        .iter()
        .all(|&i| i == 2));

    // No replica left: fall back to the primary (unless told not to).
    c.node(2).stop(StopMode::Fast).unwrap();
    let snap = until(&e, "slow replica dead", WAIT, |s| {
        (!s.topology.hosts()[2].alive)
            .then_some(())
            .ok_or("alive".into())
    })
    .await;
    assert_eq!(sel.select(&snap.topology, &Want::Replica), Ok(0));
    let strict = Selector::new(SelectPolicy {
        fallback_to_primary: false,
        ..SelectPolicy::default()
    });
    assert!(matches!(
        strict.select(&snap.topology, &Want::Replica),
        Err(NoTarget::NoCandidate { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nearest_picks_the_lowest_rtt() {
    let (_c, relay, addrs) = relayed_cluster(Duration::from_millis(15));
    let e = engine(&addrs, TopologyConfig::default());
    let snap = rtts_settled(&e).await;
    let nearest = Selector::new(SelectPolicy {
        strategy: Strategy::Nearest,
        // Nearest ignores the window, even a huge one.
        rtt_threshold: Duration::from_secs(10),
        ..SelectPolicy::default()
    });
    assert!(picks(&nearest, &snap.topology, &Want::Replica, 5)
        .iter()
        .all(|&i| i == 1));

    // Make the direct replica the slow one: put the relayed one at 0 delay
    // and compare against the EWMA the engine reports.
    relay.set_delay(Duration::ZERO, Duration::ZERO);
    // Below the 2 × 15 ms the delay alone cost: the delay is gone from the
    // average. How far below depends on the machine's load.
    let snap = until(&e, "relayed replica fast again", WAIT, |s| {
        let r = s.topology.hosts()[2].rtt.get().unwrap_or(f64::MAX);
        (r < 30.0).then_some(()).ok_or(format!("{r}"))
    })
    .await;
    let h = snap.topology.hosts();
    let lowest = if h[1].rtt.get() <= h[2].rtt.get() {
        1
    } else {
        2
    };
    assert_eq!(nearest.select(&snap.topology, &Want::Replica), Ok(lowest));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn black_holed_host_is_dead_within_timeout_without_stalling_others() {
    let c = TestCluster::builder().replicas(1).start();
    let relay = Relay::start(c.addr(1).parse().unwrap()).unwrap();
    let addrs = vec![c.addr(0), relay.addr().to_string()];
    let e = engine(&addrs, TopologyConfig::default());
    all_alive(&e).await;

    let probe = fast_probe();
    relay.set_blackhole(true);
    let start = Instant::now();
    let round0 = e.snapshot().round;
    let snap = until(&e, "black-holed host dead", WAIT, |s| {
        (!s.topology.hosts()[1].alive)
            .then_some(())
            .ok_or("alive".into())
    })
    .await;
    let took = start.elapsed();
    // Time-outs may pass: the host is dead at the third in a row. Each
    // probe (the one in flight, then reconnections) runs into a time-out,
    // and the next starts at most an interval later.
    let limit = TopologyConfig::default().down_after_failures;
    assert_eq!(snap.topology.hosts()[1].failed_probes, limit);
    let each = probe.query_timeout.max(probe.connect_timeout) + probe.interval;
    // With room for a loaded machine's late wake-ups.
    assert!(
        took <= each * limit + Duration::from_secs(2),
        "dead after {took:?}"
    );
    assert!(snap.topology.hosts()[1]
        .error
        .as_deref()
        .unwrap_or("")
        .contains("timed out"));
    // Meanwhile the other host's rounds went on at the normal pace.
    let rounds = snap.round - round0;
    let expected = (took.as_millis() / probe.interval.as_millis()) as u64;
    // A stalled engine would manage one round per time-out (3 here, of
    // some 20); late ticks on a loaded machine cost a few.
    assert!(
        rounds * 10 >= expected * 7,
        "{rounds} rounds in {took:?}: the hung host stalled the others"
    );
    let last_ok = snap.topology.hosts()[0].last_ok.expect("primary probed");
    assert!(
        last_ok.elapsed() < probe.interval * 3 + Duration::from_secs(1),
        "primary not probed recently"
    );
    assert!(snap.topology.hosts()[0].alive);

    relay.set_blackhole(false);
    until(&e, "host back after the partition", WAIT, |s| {
        s.topology.hosts()[1]
            .alive
            .then_some(())
            .ok_or("dead".into())
    })
    .await;
}

/// A stopped server is dead at its first failed probe, whatever
/// `down_after_failures` says: its connections are refused. A probe
/// connection that breaks, between probes or in the middle of one, is no
/// failure at all: the probe reconnects at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_is_dead_at_once_a_broken_probe_connection_is_not_a_failure() {
    let mut c = TestCluster::builder().replicas(1).start();
    let relay = Relay::start(c.addr(1).parse().unwrap()).unwrap();
    let e = engine(
        &[c.addr(0), relay.addr().to_string()],
        TopologyConfig {
            down_after_failures: 1,
            ..TopologyConfig::default()
        },
    );
    all_alive(&e).await;
    // Watched closely for three rounds: a failure, even one, would mark
    // the replica dead until its next probe.
    let steady = |what: &'static str| {
        let e = &e;
        async move {
            let r0 = e.snapshot().round;
            while e.snapshot().round < r0 + 3 {
                let snap = e.snapshot();
                let h = &snap.topology.hosts()[1];
                assert!(h.alive && h.failed_probes == 0, "{what}: {:?}", h.error);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    // Ended between probes.
    sql_value(
        &c.conninfo(1),
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = 'pgwarden-probe'",
    )
    .await;
    steady("after the session ended").await;
    // Broken in the middle of a probe: the partition holds the next
    // probe's query (two rounds, well within its time-out), then the
    // connection is reset and the partition lifted.
    relay.set_blackhole(true);
    let r0 = e.snapshot().round;
    e.wait_round(r0 + 2).await;
    relay.reset_all();
    relay.set_blackhole(false);
    steady("after a reset mid-probe").await;

    // Stopped: dead at the first failed probe even with a limit of 1000.
    let e = engine(
        &c.addrs(),
        TopologyConfig {
            down_after_failures: 1000,
            ..TopologyConfig::default()
        },
    );
    all_alive(&e).await;
    c.node(1).stop(StopMode::Fast).unwrap();
    let snap = until(&e, "the stopped replica is dead", WAIT, |s| {
        let h = &s.topology.hosts()[1];
        (!h.alive)
            .then_some(())
            .ok_or(format!("{} failed", h.failed_probes))
    })
    .await;
    let h = &snap.topology.hosts()[1];
    assert_eq!(h.failed_probes, 1, "{:?}", h.error);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_reconnects_after_a_reset() {
    let c = TestCluster::builder().replicas(1).start();
    let relay = Relay::start(c.addr(1).parse().unwrap()).unwrap();
    let addrs = vec![c.addr(0), relay.addr().to_string()];
    let e = engine(&addrs, TopologyConfig::default());
    all_alive(&e).await;
    relay.reset_all();
    let r0 = e.snapshot().round;
    e.wait_round(r0 + 3).await;
    let snap = e.snapshot();
    assert!(snap.topology.hosts()[1].alive, "probe did not reconnect");
    assert_eq!(relay.connections(), 1, "exactly one probe connection");
}

/// Setting the hosts the engine already has (a reload that changes none,
/// such as a log rotation's SIGHUP) keeps the probes' connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_hosts_again_keep_the_probe_connections() {
    let c = TestCluster::builder().replicas(0).start();
    let addrs = vec![c.addr(0)];
    let e = engine(&addrs, TopologyConfig::default());
    all_alive(&e).await;
    let probe_pid = || async {
        sql_value(
            &c.conninfo(0),
            "SELECT string_agg(pid::text, ',') FROM pg_stat_activity WHERE application_name = 'pgwarden-probe'",
        )
        .await
    };
    let before = probe_pid().await;
    assert!(before.is_some(), "no probe connection");
    e.set_hosts(common::hosts(&addrs));
    let r0 = e.snapshot().round;
    e.wait_round(r0 + 3).await;
    assert_eq!(probe_pid().await, before, "the probe reconnected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lagging_replica_is_skipped_and_readmitted_after_hold() {
    let c = TestCluster::builder().replicas(2).start();
    let hold = Duration::from_millis(1500);
    let e = engine(
        &c.addrs(),
        TopologyConfig {
            max_replica_lag: Some(LagLimit {
                bytes: Some(1 << 20),
                time: None,
            }),
            lag_hold: hold,
            ..TopologyConfig::default()
        },
    );
    all_alive(&e).await;
    // A replayed commit first, so the replica has a replay timestamp to
    // measure its delay against.
    sql(&c.conninfo(0), "CREATE TABLE first_commit (x int)").await;
    until(&e, "replicas caught up", WAIT, |s| {
        let lags: Vec<_> = s.topology.hosts()[1..]
            .iter()
            .map(|h| h.lag_bytes)
            .collect();
        (lags == [Some(0), Some(0)])
            .then_some(())
            .ok_or(format!("{lags:?}"))
    })
    .await;
    let replayed = c.conninfo(1);
    pgwarden_testkit::eventually("node2 replayed a commit", WAIT, || {
        let ci = replayed.clone();
        async move {
            match sql_value(&ci, "SELECT pg_last_xact_replay_timestamp() IS NOT NULL").await {
                Some(v) if v == "t" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    sql(&c.conninfo(1), "SELECT pg_wal_replay_pause()").await;
    sql(
        &c.conninfo(0),
        "CREATE TABLE filler AS SELECT g, repeat('x', 200) AS pad FROM generate_series(1, 40000) g",
    )
    .await;
    let snap = until(&e, "node2 excluded for lag, node3 not", WAIT, |s| {
        let h = s.topology.hosts();
        (h[1].lag_excluded
            && !h[2].lag_excluded
            && h[1].replay_delay.is_some_and(|d| d > Duration::ZERO))
        .then_some(())
        .ok_or(format!(
            "lag {:?} {:?} delay {:?}",
            h[1].lag_bytes, h[2].lag_bytes, h[1].replay_delay
        ))
    })
    .await;
    assert!(snap.topology.hosts()[1].lag_bytes.unwrap() > 1 << 20);
    assert!(snap.topology.hosts()[1].alive, "lagging is not dead");
    let sel = Selector::default();
    assert!(picks(&sel, &snap.topology, &Want::Replica, 6)
        .iter()
        .all(|&i| i == 2));

    sql(&c.conninfo(1), "SELECT pg_wal_replay_resume()").await;
    let caught_up = until(&e, "node2 within the limit", WAIT, |s| {
        let h = &s.topology.hosts()[1];
        (h.lag_bytes.is_some_and(|l| l <= 1 << 20))
            .then_some(())
            .ok_or(format!("{:?}", h.lag_bytes))
    })
    .await;
    let seen_under = Instant::now();
    if caught_up.topology.hosts()[1].lag_excluded {
        let snap = until(&e, "node2 readmitted", WAIT, |s| {
            (!s.topology.hosts()[1].lag_excluded)
                .then_some(())
                .ok_or("excluded".into())
        })
        .await;
        // Not before it stayed under the limit for the hold time (the
        // first under-limit probe may precede our observation by a round).
        assert!(seen_under.elapsed() + fast_probe().interval * 2 >= hold);
        let got: BTreeSet<usize> = picks(&sel, &snap.topology, &Want::Replica, 4)
            .into_iter()
            .collect();
        assert_eq!(got, BTreeSet::from([1, 2]));
    } else {
        panic!("readmitted at once, without the hold time");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_primaries_higher_timeline_wins_equal_timelines_conflict() {
    let mut c = TestCluster::builder().replicas(1).start();
    let other = TestCluster::builder().replicas(0).start();
    // A promoted replica moves to timeline 2 while the old primary still runs.
    c.node(1).promote().unwrap();
    let e = engine(&c.addrs(), TopologyConfig::default());
    let snap = until(&e, "both primaries seen", WAIT, |s| {
        let r = roles(&s.topology);
        (r == [(Role::Primary, true), (Role::Primary, true)])
            .then_some(())
            .ok_or(format!("{r:?}"))
    })
    .await;
    assert_eq!(snap.topology.hosts()[1].timeline, Some(2));
    assert_eq!(snap.topology.primary(), Some(1));
    assert!(!snap.topology.conflict());

    // Two unrelated primaries on timeline 1: nobody is selectable.
    let e2 = engine(&[c.addr(0), other.addr(0)], TopologyConfig::default());
    let snap = until(&e2, "conflict", WAIT, |s| {
        s.topology
            .conflict()
            .then_some(())
            .ok_or(format!("{:?}", roles(&s.topology)))
    })
    .await;
    assert_eq!(snap.topology.primary(), None);
    assert_eq!(
        Selector::default().select(&snap.topology, &Want::Primary),
        Err(NoTarget::PrimaryConflict)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_replica_is_flagged_and_kept_out_of_replica_reads() {
    let c = TestCluster::builder()
        .replicas(2)
        .delayed(Duration::from_secs(600))
        .start();
    let e = engine(&c.addrs(), TopologyConfig::default());
    // The other hosts measured too, or the pick below would be made among
    // whichever had answered first.
    let snap = until(&e, "delayed replica flagged", WAIT, |s| {
        let h = s.topology.hosts();
        let measured = h.iter().all(|h| h.alive && h.rtt.get().is_some());
        (measured && h[2].delayed && h[1].lag_bytes.is_some())
            .then_some(())
            .ok_or(format!("{h:?}"))
    })
    .await;
    assert!(!snap.topology.hosts()[1].delayed);
    let sel = Selector::default();
    let picked = picks(&sel, &snap.topology, &Want::Replica, 4);
    assert!(
        picked.iter().all(|&i| i == 1),
        "{picked:?} from {:?}",
        snap.topology.hosts()
    );
    assert_eq!(sel.select(&snap.topology, &Want::Delayed), Ok(2));
    // A commit reaches the delayed replica but is not applied: it lags in
    // bytes, and its delay is unknown (nothing replayed since it started)
    // rather than a misleading zero.
    sql(&c.conninfo(0), "CREATE TABLE t_delay (x int)").await;
    // Lag is computed from the primary's probe; the delay comes from the
    // replica's own, which must have seen the commit arrive unapplied.
    let snap = until(&e, "delayed replica lags", WAIT, |s| {
        let h = &s.topology.hosts()[2];
        let unapplied = h
            .observation()
            .is_some_and(|o| matches!((o.receive_lsn, o.replay_lsn), (Some(r), Some(a)) if r > a));
        (h.lag_bytes.is_some_and(|l| l > 0) && unapplied)
            .then_some(())
            .ok_or(format!("{:?} {:?}", h.lag_bytes, h.observation()))
    })
    .await;
    assert_ne!(snap.topology.hosts()[2].replay_delay, Some(Duration::ZERO));
}

/// Points replica `i`'s WAL receiver at the primary under `conninfo_extra`
/// (e.g. an `application_name`) and reloads it.
fn restream(c: &mut TestCluster, i: usize, conninfo_extra: &str) {
    let port = c.port(0);
    let node = c.node(i);
    node.set_setting(
        "primary_conninfo",
        &format!("host=127.0.0.1 port={port} user=postgres {conninfo_extra}"),
    )
    .unwrap();
    node.reload().unwrap();
}

/// A WAL receiver name longer than 63 bytes and not ASCII: the primary
/// shows it cut and cleaned, and the replica is still found in its rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_non_ascii_application_name_is_matched() {
    let mut c = TestCluster::builder().replicas(1).start();
    let name = format!("nœud-{}", "x".repeat(70));
    restream(&mut c, 1, &format!("application_name='{name}'"));
    c.set_sync_standby_names("FIRST 1 (*)");
    pgwarden_testkit::eventually("PostgreSQL shows the name cut", WAIT, || {
        let c = &c;
        async move {
            let got = replication_rows(c).await;
            // PostgreSQL 15 marks each byte outside printable ASCII.
            let shown = format!("n??ud-{}", "x".repeat(57));
            (got == format!("{shown}:sync:")).then_some(()).ok_or(got)
        }
    })
    .await;
    let e = engine(&c.addrs(), TopologyConfig::default());
    let snap = until(&e, "the replica known as sync", WAIT, |s| {
        let h = &s.topology.hosts()[1];
        (h.sync_state == Some(SyncState::Sync))
            .then_some(())
            .ok_or(format!("{:?} {:?}", h.replication_name(), h.sync_state))
    })
    .await;
    assert_eq!(
        snap.topology.hosts()[1].replication_name(),
        Some(name.as_str())
    );
}

/// The primary's `pg_stat_replication` as `name:sync_state:slot` lines, sorted.
async fn replication_rows(c: &TestCluster) -> String {
    sql_value(
        &c.conninfo(0),
        "SELECT coalesce(string_agg(r.application_name || ':' || r.sync_state || ':' \
         || coalesce(s.slot_name::text, ''), ',' ORDER BY r.sync_state, s.slot_name), '') \
         FROM pg_stat_replication r LEFT JOIN pg_replication_slots s ON s.active_pid = r.pid",
    )
    .await
    .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standbys_sharing_a_name_are_told_apart_by_slot_or_not_at_all() {
    let mut c = TestCluster::builder().replicas(2).start();
    for i in [1, 2] {
        restream(&mut c, i, "application_name=twin");
    }
    c.set_sync_standby_names("FIRST 1 (twin)");
    let primary = c.conninfo(0);
    let rows = |want: &'static str| {
        let c = &c;
        async move {
            let got = replication_rows(c).await;
            (got == want).then_some(()).ok_or(got)
        }
    };
    pgwarden_testkit::eventually("one twin sync, one potential", WAIT, || {
        rows("twin:potential:,twin:sync:")
    })
    .await;
    let e = engine(&c.addrs(), TopologyConfig::default());
    let sync_states = |s: &pgwarden_probe::Snapshot| -> Vec<Option<SyncState>> {
        s.topology.hosts().iter().map(|h| h.sync_state).collect()
    };
    let snap = until(&e, "both twins probed", WAIT, |s| {
        let h = s.topology.hosts();
        let named = h[1..]
            .iter()
            .all(|h| h.alive && h.replication_name() == Some("twin"));
        let rows = h[0].observation().map_or(0, |o| o.replication.len());
        (named && rows == 2)
            .then_some(())
            .ok_or(format!("{:?}", sync_states(s)))
    })
    .await;
    // PostgreSQL calls one of them sync, and nothing it reports says which.
    assert_eq!(sync_states(&snap), [None, None, None]);
    let sel = Selector::default();
    assert_eq!(sel.eligible(&snap.topology, &Want::SyncStandby), [0]);

    // With a slot each, the rows can be told apart.
    sql(
        &primary,
        "SELECT pg_create_physical_replication_slot('slot_a'), \
         pg_create_physical_replication_slot('slot_b')",
    )
    .await;
    for (i, slot) in [(1, "slot_a"), (2, "slot_b")] {
        let node = c.node(i);
        node.set_setting("primary_slot_name", slot).unwrap();
        node.reload().unwrap();
    }
    let pg_sync = pgwarden_testkit::eventually("both twins on their slots", WAIT, || {
        let c = &c;
        async move {
            let got = replication_rows(c).await;
            match got.as_str() {
                "twin:potential:slot_b,twin:sync:slot_a" => Ok(1),
                "twin:potential:slot_a,twin:sync:slot_b" => Ok(2),
                _ => Err(got),
            }
        }
    })
    .await;
    let snap = until(&e, "the twins attributed by slot", WAIT, |s| {
        let st = sync_states(s);
        let mut want = vec![None, Some(SyncState::Potential), Some(SyncState::Potential)];
        want[pg_sync] = Some(SyncState::Sync);
        (st == want).then_some(()).ok_or(format!("{st:?}"))
    })
    .await;
    assert_eq!(sel.eligible(&snap.topology, &Want::SyncStandby), [pg_sync]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cascading_replica_sharing_a_name_leaves_the_sync_standby_known() {
    let mut c = TestCluster::builder().replicas(2).start();
    restream(&mut c, 1, "application_name=twin");
    // node3 streams from node2, under the same name: the primary lists
    // node2 alone.
    let upstream = c.port(1);
    let node = c.node(2);
    node.set_setting(
        "primary_conninfo",
        &format!("host=127.0.0.1 port={upstream} user=postgres application_name=twin"),
    )
    .unwrap();
    node.reload().unwrap();
    c.set_sync_standby_names("FIRST 1 (twin)");
    let c = &c;
    pgwarden_testkit::eventually("node2 sync, node3 streaming from it", WAIT, || async move {
        let primary = replication_rows(c).await;
        let cascade = sql_value(
            &c.conninfo(1),
            "SELECT string_agg(application_name || ':' || state, ',') FROM pg_stat_replication",
        )
        .await
        .unwrap_or_default();
        (primary == "twin:sync:" && cascade == "twin:streaming")
            .then_some(())
            .ok_or(format!("primary {primary:?}, node2 {cascade:?}"))
    })
    .await;
    let e = engine(&c.addrs(), TopologyConfig::default());
    // Every host probed (a round may end before node3's first answer,
    // and an unanswered host has no sync state either).
    let snap = until(&e, "node2 sync, node3 no row of the primary's", WAIT, |s| {
        let hosts = s.topology.hosts();
        let st: Vec<_> = hosts.iter().map(|h| h.sync_state).collect();
        (st == [None, Some(SyncState::Sync), None] && hosts.iter().all(|h| h.alive))
            .then_some(())
            .ok_or(format!("{st:?}"))
    })
    .await;
    let h = snap.topology.hosts();
    assert_eq!(h[2].replication_name(), Some("twin"));
    assert_eq!(h[2].off_primary, None, "a cascade is no stray");
    assert_eq!(
        Selector::default().eligible(&snap.topology, &Want::SyncStandby),
        [1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_left_on_the_old_timeline_gets_no_reads() {
    let mut c = TestCluster::builder().replicas(2).start();
    // node2 is promoted while node1 keeps running as a primary, and node3
    // keeps streaming from node1 on timeline 1.
    c.node(1).promote().unwrap();
    sql(&c.conninfo(1), "CREATE TABLE only_on_new (x int)").await;
    sql(&c.conninfo(0), "CREATE TABLE only_on_old AS SELECT 1 AS x").await;
    let e = engine(&c.addrs(), TopologyConfig::default());
    let snap = until(&e, "node3 flagged as off the primary", WAIT, |s| {
        let h = s.topology.hosts();
        (s.topology.primary() == Some(1) && h[2].alive && h[2].off_primary.is_some())
            .then_some(())
            .ok_or(format!(
                "primary {:?}, node3 {:?} tl {:?}",
                s.topology.primary(),
                h[2].off_primary,
                h[2].timeline
            ))
    })
    .await;
    let h = &snap.topology.hosts()[2];
    assert_eq!(h.timeline, Some(1));
    assert!(
        h.off_primary.as_deref().unwrap().contains("timeline 1"),
        "{:?}",
        h.off_primary
    );
    assert_eq!(h.lag_bytes, None);
    // Reads go to the new primary, not to the replica that lacks its data.
    let sel = Selector::default();
    assert!(picks(&sel, &snap.topology, &Want::Replica, 4)
        .iter()
        .all(|&i| i == 1));
    let view = pgwarden_topology::view::TopologyView::new(&snap.topology, snap.round);
    assert!(view.hosts[2].off_primary.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_that_receives_nothing_falls_behind_in_time() {
    let mut c = TestCluster::builder().replicas(1).start();
    let e = engine(
        &c.addrs(),
        TopologyConfig {
            max_replica_lag: Some(LagLimit {
                bytes: None,
                time: Some(Duration::from_secs(2)),
            }),
            lag_hold: Duration::from_millis(500),
            ..TopologyConfig::default()
        },
    );
    all_alive(&e).await;
    // Its WAL receiver now knocks at a port nobody listens on.
    let dead = pgwarden_testkit::free_port();
    let node = c.node(1);
    node.set_setting(
        "primary_conninfo",
        &format!("host=127.0.0.1 port={dead} user=postgres"),
    )
    .unwrap();
    node.reload().unwrap();
    pgwarden_testkit::eventually("the WAL receiver gone", WAIT, || {
        let ci = c.conninfo(1);
        async move {
            match sql_value(
                &ci,
                "SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'",
            )
            .await
            {
                Some(v) if v == "0" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let writer = c.conninfo(0);
    let write = tokio::spawn(async move {
        for i in 0..40 {
            sql(
                &writer,
                &format!("CREATE TABLE w{i} AS SELECT generate_series(1, 1000) x"),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let snap = until(&e, "the starved replica excluded for time lag", WAIT, |s| {
        let h = &s.topology.hosts()[1];
        (h.lag_excluded && h.replay_delay.is_some_and(|d| d > Duration::from_secs(2)))
            .then_some(())
            .ok_or(format!("delay {:?} lag {:?}", h.replay_delay, h.lag_bytes))
    })
    .await;
    let h = &snap.topology.hosts()[1];
    assert!(h.alive);
    // The replica itself sees nothing to replay.
    let own = h.observation().unwrap();
    assert_eq!(own.receive_lsn, own.replay_lsn);
    assert!(h.lag_bytes.is_some_and(|b| b > 0));
    write.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_name_with_a_space_is_matched() {
    let mut c = TestCluster::builder().replicas(1).start();
    restream(&mut c, 1, "application_name='node 3'");
    c.set_sync_standby_names(r#"FIRST 1 ("node 3")"#);
    pgwarden_testkit::eventually("PostgreSQL sees the name", WAIT, || {
        let c = &c;
        async move {
            let got = replication_rows(c).await;
            (got == "node 3:sync:").then_some(()).ok_or(got)
        }
    })
    .await;
    let shown = sql_value(&c.conninfo(1), "SELECT conninfo FROM pg_stat_wal_receiver").await;
    let e = engine(&c.addrs(), TopologyConfig::default());
    let snap = until(&e, "the replica known as sync", WAIT, |s| {
        let h = &s.topology.hosts()[1];
        (h.sync_state == Some(SyncState::Sync))
            .then_some(())
            .ok_or(format!(
                "{:?} {:?} from {shown:?}",
                h.replication_name(),
                h.sync_state
            ))
    })
    .await;
    assert_eq!(snap.topology.hosts()[1].replication_name(), Some("node 3"));
}

/// `localhost:PORT` for node `i`: the same server as `127.0.0.1:PORT`
/// under another name.
fn alias(c: &TestCluster, i: usize) -> String {
    format!("localhost:{}", c.port(i))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_listed_under_two_names_counts_once() {
    let c = TestCluster::builder().replicas(1).start();
    let addrs = vec![c.addr(0), alias(&c, 0), c.addr(1), alias(&c, 1)];
    let e = engine(&addrs, TopologyConfig::default());
    let snap = until(&e, "each server's second name recognised", WAIT, |s| {
        let h = s.topology.hosts();
        let dups: Vec<_> = h.iter().map(|h| h.duplicate_of).collect();
        (dups == [None, Some(0), None, Some(2)] && h.iter().all(|h| h.alive))
            .then_some(())
            .ok_or(format!("{dups:?} {:?}", roles(&s.topology)))
    })
    .await;
    // Routed to normally, not refused as two primaries.
    assert!(!snap.topology.conflict());
    assert_eq!(snap.topology.primary(), Some(0));
    let sel = Selector::default();
    assert_eq!(sel.select(&snap.topology, &Want::Primary), Ok(0));
    // The replica takes its share of reads once, not twice.
    assert_eq!(sel.eligible(&snap.topology, &Want::Replica), [2]);
    // The replica follows the primary, whichever name it is reached by.
    assert_eq!(snap.topology.hosts()[2].off_primary, None);
    let view = pgwarden_topology::view::TopologyView::new(&snap.topology, snap.round);
    let json = serde_json::to_value(&view).unwrap();
    assert_eq!(json["hosts"][1]["duplicate_of"], c.addr(0).as_str());
    assert_eq!(json["hosts"][3]["duplicate_of"], c.addr(1).as_str());
    assert!(json["hosts"][0]["duplicate_of"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_primaries_of_one_lineage_are_still_a_conflict() {
    let mut c = TestCluster::builder().replicas(2).start();
    // Both replicas promoted: two servers with the primary's system
    // identifier, each on timeline 2.
    c.node(1).promote().unwrap();
    c.node(2).promote().unwrap();
    let sysid = "SELECT system_identifier FROM pg_control_system()";
    assert_eq!(
        sql_value(&c.conninfo(1), sysid).await,
        sql_value(&c.conninfo(2), sysid).await
    );
    let addrs = vec![c.addr(1), alias(&c, 1), c.addr(2)];
    let e = engine(&addrs, TopologyConfig::default());
    let snap = until(&e, "the two promoted replicas in conflict", WAIT, |s| {
        let t = &s.topology;
        (t.conflict_hosts() == [0, 2] && t.hosts()[1].duplicate_of == Some(0))
            .then_some(())
            .ok_or(format!(
                "conflict {:?}, {:?}",
                t.conflict_hosts(),
                t.hosts()
                    .iter()
                    .map(|h| (h.role, h.timeline, h.duplicate_of))
                    .collect::<Vec<_>>()
            ))
    })
    .await;
    assert!(snap.topology.hosts().iter().all(|h| h.timeline == Some(2)));
    assert_eq!(
        Selector::default().select(&snap.topology, &Want::Primary),
        Err(NoTarget::PrimaryConflict)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_of_a_rogue_primary_is_found_under_another_name() {
    let mut c = TestCluster::builder().replicas(2).start();
    // node3 streams from node2, which it calls localhost; node2 is then
    // promoted outside the leader key's say, and node3 follows it onto
    // timeline 2 (so its timeline alone does not give it away).
    let port = c.port(1);
    let node = c.node(2);
    node.set_setting(
        "primary_conninfo",
        &format!("host=localhost port={port} user=postgres application_name=node3"),
    )
    .unwrap();
    node.reload().unwrap();
    let upstream = "SELECT sender_host || ':' || sender_port FROM pg_stat_wal_receiver \
                    WHERE status = 'streaming'";
    pgwarden_testkit::eventually("node3 streaming from localhost", WAIT, || {
        let ci = c.conninfo(2);
        async move {
            let got = sql_value(&ci, upstream).await;
            (got == Some(format!("localhost:{port}")))
                .then_some(())
                .ok_or(format!("{got:?}"))
        }
    })
    .await;
    c.node(1).promote().unwrap();
    let leader = PrimaryGate::Leader(Some(c.addr(0).parse().unwrap()));

    // Found twice over: node2's pg_stat_replication lists node3, and
    // node3's sender_host, localhost, is the machine node2 was reached at.
    // The second engine knows node3 by a name node2 does not list, so
    // only the address can tell.
    let mut renamed = common::hosts(&c.addrs());
    renamed[2].application_name = Some("elsewhere".into());
    for (hosts, how) in [
        (common::hosts(&c.addrs()), " (in its pg_stat_replication)"),
        (renamed, ""),
    ] {
        let e = Engine::start(hosts, TopologyConfig::default(), common::fast_probe());
        e.set_primary_gate(leader.clone());
        let expected = format!(
            "streams from {}{how}, which is not the primary {}",
            c.addr(1),
            c.addr(0)
        );
        // Until node2 has been probed, node3's later timeline is all
        // that is known against it: flagged for that first, then for its
        // upstream.
        let snap = until(&e, "node3 flagged as fed by node2", WAIT, |s| {
            let h = s.topology.hosts();
            (s.topology.primary() == Some(0)
                && h[2].alive
                && h[2].off_primary.as_deref() == Some(expected.as_str()))
            .then_some(())
            .ok_or(format!(
                "primary {:?}, node3 {:?} tl {:?} upstream {:?}",
                s.topology.primary(),
                h[2].off_primary,
                h[2].timeline,
                h[2].observation().map(|o| (&o.upstream, &o.upstream_ips)),
            ))
        })
        .await;
        let h = &snap.topology.hosts()[2];
        assert_eq!(h.timeline, Some(2));
        // No reads for it: only the primary, as the fallback.
        assert_eq!(
            Selector::default().eligible(&snap.topology, &Want::Replica),
            [0]
        );
    }
}
