//! The store against a real etcd started by the test kit.

use std::time::{Duration, Instant};

use pgwarden_dcs::{DcsError, EtcdDcs, HistoryEntry, LeaderEvent, LeaseId, RequestEvent};
use pgwarden_testkit::etcd::EtcdServer;
use pgwarden_testkit::eventually;
use serde_json::json;

const OP_TIMEOUT: Duration = Duration::from_secs(2);

async fn dcs(etcd: &EtcdServer, cluster: &str) -> EtcdDcs {
    EtcdDcs::connect(&[etcd.endpoint()], "pgwarden", cluster, OP_TIMEOUT)
        .await
        .expect("connect")
}

/// The next leader event, failing the test if none comes within `within`.
async fn next_event(w: &mut pgwarden_dcs::LeaderWatch, within: Duration) -> LeaderEvent {
    tokio::time::timeout(within, w.next())
        .await
        .expect("a leader event in time")
        .expect("watch still running")
}

#[tokio::test]
async fn exactly_one_client_wins_the_bootstrap_race() {
    let etcd = EtcdServer::start();
    let (a, b) = (dcs(&etcd, "c").await, dcs(&etcd, "c").await);
    let (ra, rb) = tokio::join!(a.initialize_race("sys-a"), b.initialize_race("sys-b"));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert!(ra ^ rb, "exactly one winner: {ra} {rb}");
    let winner = if ra { "sys-a" } else { "sys-b" };
    assert_eq!(
        a.read_cluster().await.unwrap().initialize.as_deref(),
        Some(winner)
    );
    // Losing again later changes nothing; a loser cannot cancel the winner's.
    assert!(!a.initialize_race("sys-c").await.unwrap());
    let loser = if ra { "sys-b" } else { "sys-a" };
    assert!(!b.cancel_initialize(loser).await.unwrap());
    assert!(b.cancel_initialize(winner).await.unwrap());
    assert!(b.initialize_race("sys-d").await.unwrap());
    // The winner's placeholder becomes the system identifier, once.
    assert!(!a.finish_initialize("sys-x", "7301").await.unwrap());
    assert!(b.finish_initialize("sys-d", "7301").await.unwrap());
    assert!(!b.finish_initialize("sys-d", "7302").await.unwrap());
    assert_eq!(
        a.read_cluster().await.unwrap().initialize.as_deref(),
        Some("7301")
    );
}

#[tokio::test]
async fn exactly_one_client_acquires_the_leader_key_and_the_loser_sees_it() {
    let etcd = EtcdServer::start();
    let (a, b) = (dcs(&etcd, "c").await, dcs(&etcd, "c").await);
    let la = a.grant_lease(Duration::from_secs(10)).await.unwrap();
    let lb = b.grant_lease(Duration::from_secs(10)).await.unwrap();
    let (ra, rb) = tokio::join!(a.acquire_leader("a", la), b.acquire_leader("b", lb));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert!(ra ^ rb, "exactly one winner: {ra} {rb}");
    let (winner, wlease, loser, llease, loser_dcs) = if ra {
        ("a", la, "b", lb, &b)
    } else {
        ("b", lb, "a", la, &a)
    };
    let snap = loser_dcs.read_cluster().await.unwrap();
    let leader = snap.leader.expect("leader key");
    assert_eq!((leader.name.as_str(), leader.lease), (winner, wlease));
    let left = leader.ttl_left.expect("ttl reported");
    assert!(
        left > Duration::ZERO && left <= Duration::from_secs(10),
        "{left:?}"
    );
    // The loser can neither renew nor take the winner's key.
    assert!(!loser_dcs.renew_leader(loser, llease).await.unwrap());
    assert!(!loser_dcs.acquire_leader(loser, llease).await.unwrap());
    // The winner renews; a key naming it but bound to another lease is not
    // its own.
    let winner_dcs = if ra { &a } else { &b };
    assert!(winner_dcs.renew_leader(winner, wlease).await.unwrap());
    assert!(!winner_dcs.renew_leader(winner, llease).await.unwrap());
}

#[tokio::test]
async fn an_expired_lease_frees_the_key_and_the_watcher_sees_it_at_once() {
    let etcd = EtcdServer::start();
    let (a, b) = (dcs(&etcd, "c").await, dcs(&etcd, "c").await);
    let mut watch = b.watch_leader().await;
    assert_eq!(
        next_event(&mut watch, OP_TIMEOUT).await,
        LeaderEvent::Deleted
    );

    let ttl = Duration::from_secs(2);
    let lease = a.grant_lease(ttl).await.unwrap();
    assert!(a.acquire_leader("a", lease).await.unwrap());
    let LeaderEvent::Put {
        name,
        generation: first,
    } = next_event(&mut watch, OP_TIMEOUT).await
    else {
        panic!("expected the key to be written");
    };
    assert_eq!(name, "a");
    assert_eq!(
        b.read_cluster().await.unwrap().leader.map(|l| l.generation),
        Some(first),
        "the snapshot numbers the leadership as the watch does"
    );
    let left = a.keep_alive_once(lease).await.unwrap();
    let renewed = Instant::now();
    assert!(left > Duration::ZERO && left <= ttl, "{left:?}");

    // No more renewals: etcd deletes the key once the TTL has run out, and
    // the watcher hears of it without polling.
    assert_eq!(
        next_event(&mut watch, ttl + Duration::from_secs(3)).await,
        LeaderEvent::Deleted
    );
    let gone_after = renewed.elapsed();
    assert!(
        gone_after >= ttl - Duration::from_millis(200),
        "{gone_after:?}"
    );
    assert!(b.read_cluster().await.unwrap().leader.is_none());
    assert!(matches!(
        a.keep_alive_once(lease).await,
        Err(DcsError::LeaseNotFound(l)) if l == lease
    ));
    assert!(!a.renew_leader("a", lease).await.unwrap());

    // The freed key can be taken by another member.
    let lb = b.grant_lease(ttl).await.unwrap();
    assert!(b.acquire_leader("b", lb).await.unwrap());
    assert!(matches!(
        next_event(&mut watch, OP_TIMEOUT).await,
        LeaderEvent::Put { name, generation } if name == "b" && generation > first
    ));
}

#[tokio::test]
async fn only_the_owner_releases_the_key() {
    let etcd = EtcdServer::start();
    let (a, b) = (dcs(&etcd, "c").await, dcs(&etcd, "c").await);
    let mut watch = b.watch_leader().await;
    assert_eq!(
        next_event(&mut watch, OP_TIMEOUT).await,
        LeaderEvent::Deleted
    );
    let la = a.grant_lease(Duration::from_secs(30)).await.unwrap();
    assert!(a.acquire_leader("a", la).await.unwrap());
    assert!(matches!(
        next_event(&mut watch, OP_TIMEOUT).await,
        LeaderEvent::Put { name, .. } if name == "a"
    ));
    assert!(!b.release_leader("b").await.unwrap());
    assert_eq!(
        b.read_cluster().await.unwrap().leader.map(|l| l.name),
        Some("a".into())
    );
    let released = Instant::now();
    assert!(a.release_leader("a").await.unwrap());
    assert_eq!(
        next_event(&mut watch, OP_TIMEOUT).await,
        LeaderEvent::Deleted
    );
    assert!(released.elapsed() < Duration::from_secs(1));
    assert!(!a.release_leader("a").await.unwrap());
    assert!(!a.renew_leader("a", la).await.unwrap());
}

#[tokio::test]
async fn switchover_hands_the_key_to_the_named_candidate_only() {
    let etcd = EtcdServer::start();
    let (a, b, c) = (
        dcs(&etcd, "c").await,
        dcs(&etcd, "c").await,
        dcs(&etcd, "c").await,
    );
    let ttl = Duration::from_secs(30);
    let (la, lb, lc) = (
        a.grant_lease(ttl).await.unwrap(),
        b.grant_lease(ttl).await.unwrap(),
        c.grant_lease(ttl).await.unwrap(),
    );
    assert!(a.acquire_leader("a", la).await.unwrap());
    // No request: nothing to take over.
    assert!(!b.take_over_leader("a", "b", lb).await.unwrap());
    a.put_failover(&json!({"from_leader": "a", "candidate": "b"}))
        .await
        .unwrap();
    // The old leader has not let go yet.
    assert!(!b.take_over_leader("a", "b", lb).await.unwrap());
    assert!(a.release_leader("a").await.unwrap());
    // Someone other than the candidate, or a wrong old leader, is refused.
    assert!(!c.take_over_leader("a", "c", lc).await.unwrap());
    assert!(!b.take_over_leader("x", "b", lb).await.unwrap());
    assert!(b.take_over_leader("a", "b", lb).await.unwrap());
    let snap = c.read_cluster().await.unwrap();
    let leader = snap.leader.unwrap();
    assert_eq!((leader.name.as_str(), leader.lease), ("b", lb));
    assert!(snap.failover.is_none(), "the request is consumed");
    assert!(b.renew_leader("b", lb).await.unwrap());
    // A malformed request is reported, not guessed at.
    b.put_failover(&json!("garbage")).await.unwrap();
    assert!(!c.take_over_leader("b", "c", lc).await.unwrap());
    b.delete_failover().await.unwrap();
    assert!(c.read_cluster().await.unwrap().failover.is_none());
}

/// The next request event, failing the test if none comes in time.
async fn next(w: &mut pgwarden_dcs::RequestWatch) -> RequestEvent {
    tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .expect("a request event in time")
        .expect("watch still running")
}

#[tokio::test]
async fn a_request_is_withdrawn_only_as_it_was_read_and_its_changes_are_watched() {
    let etcd = EtcdServer::start();
    let (a, b) = (dcs(&etcd, "c").await, dcs(&etcd, "c").await);
    let mut watch = b.watch_failover().await;
    assert_eq!(next(&mut watch).await, RequestEvent::Deleted, "none yet");
    a.put_failover(&json!({"candidate": "b", "scheduled_at": "2030-01-01T00:00:00Z"}))
        .await
        .unwrap();
    let RequestEvent::Put { revision: first } = next(&mut watch).await else {
        panic!("expected a put");
    };
    let snap = a.read_cluster().await.unwrap();
    assert_eq!(snap.failover_revision, first);
    // Replaced meanwhile: the withdrawal of the old one must not delete it.
    a.put_failover(&json!({"candidate": "c"})).await.unwrap();
    assert!(matches!(next(&mut watch).await, RequestEvent::Put { revision } if revision > first));
    assert!(!a.delete_failover_if(snap.failover_revision).await.unwrap());
    let snap = a.read_cluster().await.unwrap();
    assert_eq!(snap.failover.as_ref().unwrap()["candidate"], "c");
    assert!(a.delete_failover_if(snap.failover_revision).await.unwrap());
    assert_eq!(next(&mut watch).await, RequestEvent::Deleted);
    assert!(!a.delete_failover_if(snap.failover_revision).await.unwrap());
    assert_eq!(a.read_cluster().await.unwrap().failover_revision, 0);
}

#[tokio::test]
async fn a_member_key_disappears_with_its_lease() {
    let etcd = EtcdServer::start();
    let (a, b) = (dcs(&etcd, "c").await, dcs(&etcd, "c").await);
    let la = a.grant_lease(Duration::from_secs(2)).await.unwrap();
    let lb = b.grant_lease(Duration::from_secs(60)).await.unwrap();
    a.publish_member("a", &json!({"role": "replica"}), la)
        .await
        .unwrap();
    b.publish_member("b", &json!({"role": "primary"}), lb)
        .await
        .unwrap();
    let snap = b.read_cluster().await.unwrap();
    assert_eq!(snap.members.len(), 2);
    assert_eq!(snap.member("a").unwrap()["role"], "replica");
    eventually("member a to vanish", Duration::from_secs(6), || async {
        let snap = b.read_cluster().await.map_err(|e| e.to_string())?;
        match snap
            .members
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()[..]
        {
            ["b"] => Ok(()),
            ref other => Err(format!("{other:?}")),
        }
    })
    .await;
    // Revoking deletes at once, for a clean shutdown.
    b.revoke_lease(lb).await.unwrap();
    assert!(b.read_cluster().await.unwrap().members.is_empty());
    b.revoke_lease(lb).await.unwrap();
}

#[tokio::test]
async fn clusters_sharing_one_etcd_do_not_see_each_other() {
    let etcd = EtcdServer::start();
    // "c1" is a prefix of "c10": the layout must not let one read the other.
    let (c1, c10) = (dcs(&etcd, "c1").await, dcs(&etcd, "c10").await);
    let l1 = c1.grant_lease(Duration::from_secs(30)).await.unwrap();
    let l10 = c10.grant_lease(Duration::from_secs(30)).await.unwrap();
    assert!(c1.initialize_race("one").await.unwrap());
    assert!(c10.initialize_race("ten").await.unwrap());
    assert!(c1.acquire_leader("n1", l1).await.unwrap());
    assert!(c10.acquire_leader("n1", l10).await.unwrap());
    c1.publish_member("n1", &json!({"c": 1}), l1).await.unwrap();
    c10.publish_member("n2", &json!({"c": 10}), l10)
        .await
        .unwrap();
    c1.put_config(&json!({"ttl": 30})).await.unwrap();
    let s1 = c1.read_cluster().await.unwrap();
    let s10 = c10.read_cluster().await.unwrap();
    assert_eq!(s1.initialize.as_deref(), Some("one"));
    assert_eq!(s10.initialize.as_deref(), Some("ten"));
    assert_eq!(s1.leader.as_ref().unwrap().lease, l1);
    assert_eq!(s10.leader.as_ref().unwrap().lease, l10);
    assert_eq!(s1.members.len(), 1);
    assert_eq!(s10.member("n2").unwrap()["c"], 10);
    assert!(s1.config.is_some() && s10.config.is_none());
    // Another namespace is another world too.
    let other = EtcdDcs::connect(&[etcd.endpoint()], "/other/", "c1", OP_TIMEOUT)
        .await
        .unwrap();
    assert!(other.read_cluster().await.unwrap().initialize.is_none());
}

#[tokio::test]
async fn settings_history_and_leader_only_keys() {
    let etcd = EtcdServer::start();
    let (a, b) = (dcs(&etcd, "c").await, dcs(&etcd, "c").await);
    // Config: compare-and-set against the revision read.
    assert!(a
        .compare_and_put_config(&json!({"ttl": 30}), 0)
        .await
        .unwrap());
    let rev = a.read_cluster().await.unwrap().config_revision;
    assert!(rev > 0);
    assert!(b
        .compare_and_put_config(&json!({"ttl": 20}), rev)
        .await
        .unwrap());
    assert!(!a
        .compare_and_put_config(&json!({"ttl": 10}), rev)
        .await
        .unwrap());
    assert_eq!(a.read_cluster().await.unwrap().config.unwrap()["ttl"], 20);

    // History: concurrent appends are all kept.
    let entry = |timeline| HistoryEntry {
        timeline,
        lsn: u64::from(timeline) * 100,
        reason: "test".into(),
        time_ms: 1,
        leader: "a".into(),
    };
    let mut appends = tokio::task::JoinSet::new();
    for t in 1..=4 {
        let d = if t % 2 == 0 { a.clone() } else { b.clone() };
        appends.spawn(async move { d.append_history(&entry(t)).await });
    }
    while let Some(r) = appends.join_next().await {
        r.unwrap().unwrap();
    }
    let mut timelines: Vec<u32> = a
        .read_cluster()
        .await
        .unwrap()
        .history
        .iter()
        .map(|h| h.timeline)
        .collect();
    timelines.sort_unstable();
    assert_eq!(timelines, [1, 2, 3, 4]);

    // Status and sync: only while holding the key.
    let la = a.grant_lease(Duration::from_secs(30)).await.unwrap();
    assert!(!a.put_status("a", &json!({"optime": 1})).await.unwrap());
    assert!(a.acquire_leader("a", la).await.unwrap());
    assert!(a.put_status("a", &json!({"optime": 2})).await.unwrap());
    assert!(a
        .put_sync("a", &json!({"sync_standby": "b"}))
        .await
        .unwrap());
    assert!(!b.put_status("b", &json!({"optime": 3})).await.unwrap());
    let snap = b.read_cluster().await.unwrap();
    assert_eq!(snap.status.unwrap()["optime"], 2);
    assert_eq!(snap.sync.unwrap()["sync_standby"], "b");
    assert!(snap.malformed.is_empty());

    // Bad names never reach etcd.
    assert!(matches!(
        a.acquire_leader("a/b", la).await,
        Err(DcsError::InvalidName { .. })
    ));
    assert!(matches!(
        a.grant_lease(Duration::ZERO).await,
        Err(DcsError::InvalidTtl(_))
    ));
}

/// A short bound for the fault tests, which wait it out once per operation.
const FAULT_OP_TIMEOUT: Duration = Duration::from_millis(700);

async fn fault_dcs(etcd: &EtcdServer) -> EtcdDcs {
    EtcdDcs::connect(&[etcd.endpoint()], "pgwarden", "c", FAULT_OP_TIMEOUT)
        .await
        .expect("connect")
}

/// Every operation, run against `d`, must fail within the bound. Against a
/// frozen etcd that is mostly a time-out, but the connection's own ping
/// time-out may notice first and fail the call as a transport error.
async fn every_op_fails_in_bounded_time(d: &EtcdDcs, lease: LeaseId) {
    let bound = FAULT_OP_TIMEOUT + Duration::from_millis(300);
    macro_rules! check {
        ($what:expr, $op:expr) => {{
            let t0 = Instant::now();
            let r = tokio::time::timeout(bound * 2, $op)
                .await
                .unwrap_or_else(|_| panic!("{} not bounded", $what));
            let took = t0.elapsed();
            let e = r.err().unwrap_or_else(|| panic!("{} succeeded", $what));
            assert!(took <= bound, "{} took {took:?}", $what);
            assert!(e.is_unavailable(), "{}: {e}", $what);
        }};
    }
    check!("initialize_race", d.initialize_race("s"));
    check!("grant_lease", d.grant_lease(Duration::from_secs(5)));
    check!("keep_alive_once", d.keep_alive_once(lease));
    check!("acquire_leader", d.acquire_leader("a", lease));
    check!("renew_leader", d.renew_leader("a", lease));
    check!("release_leader", d.release_leader("a"));
    check!("take_over_leader", d.take_over_leader("a", "b", lease));
    check!("publish_member", d.publish_member("a", &json!({}), lease));
    check!("read_cluster", d.read_cluster());
    check!("put_config", d.put_config(&json!({})));
    check!("append_history", d.append_history(&HistoryEntry::default()));
    check!("put_failover", d.put_failover(&json!({})));
    check!("delete_failover", d.delete_failover());
    check!("delete_failover_if", d.delete_failover_if(1));
    check!("put_status", d.put_status("a", &json!({})));
    check!("revoke_lease", d.revoke_lease(lease));
}

#[tokio::test]
async fn every_op_is_bounded_when_etcd_is_killed() {
    let mut etcd = EtcdServer::start();
    let a = fault_dcs(&etcd).await;
    let lease = a.grant_lease(Duration::from_secs(30)).await.unwrap();
    assert!(a.acquire_leader("a", lease).await.unwrap());
    a.keep_alive_once(lease).await.unwrap();
    let mut watch = a.watch_leader().await;
    assert!(matches!(
        next_event(&mut watch, OP_TIMEOUT).await,
        LeaderEvent::Put { name, .. } if name == "a"
    ));
    etcd.kill();
    every_op_fails_in_bounded_time(&a, lease).await;

    // Back on the same data: the same client recovers, the lease survived
    // (etcd restarts lease timers on recovery), and the watch reconnects.
    etcd.start_again();
    eventually(
        "the client to reconnect",
        Duration::from_secs(10),
        || async { a.renew_leader("a", lease).await.map_err(|e| e.to_string()) },
    )
    .await;
    assert!(a.release_leader("a").await.unwrap());
    // Depending on when the watch re-established itself, it reports the key
    // as it found it on reconnecting, then the deletion.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if next_event(&mut watch, left).await == LeaderEvent::Deleted {
            break;
        }
    }
}

#[tokio::test]
async fn every_op_times_out_when_etcd_is_frozen() {
    let etcd = EtcdServer::start();
    let a = fault_dcs(&etcd).await;
    let lease = a.grant_lease(Duration::from_secs(30)).await.unwrap();
    a.keep_alive_once(lease).await.unwrap();
    etcd.freeze();
    every_op_fails_in_bounded_time(&a, lease).await;
    // A client that never reached etcd is bounded too.
    let b = fault_dcs(&etcd).await;
    every_op_fails_in_bounded_time(&b, lease).await;
    etcd.thaw();
    // The revoke sent while frozen may or may not be applied now, so ask
    // something that does not depend on the lease.
    eventually("etcd to answer again", Duration::from_secs(10), || async {
        a.read_cluster().await.map_err(|e| e.to_string())
    })
    .await;
}

#[tokio::test]
async fn a_three_member_etcd_survives_the_loss_of_one_member() {
    let mut etcd = pgwarden_testkit::etcd::EtcdCluster::start(3);
    let a = EtcdDcs::connect(&etcd.endpoints(), "pgwarden", "c", OP_TIMEOUT)
        .await
        .unwrap();
    let lease = a.grant_lease(Duration::from_secs(30)).await.unwrap();
    assert!(a.acquire_leader("a", lease).await.unwrap());
    etcd.kill(0);
    // Requests already routed to the dead member may fail once; the client
    // then uses the survivors, which still form a quorum.
    eventually(
        "renewal through the survivors",
        Duration::from_secs(10),
        || async {
            match a.renew_leader("a", lease).await {
                Ok(true) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    // Reads too may hit the dead member's channel once before the client
    // moves on; each call stays bounded by the op time-out.
    let leader = eventually(
        "read through the survivors",
        Duration::from_secs(10),
        || async {
            match a.read_cluster().await {
                Ok(c) => Ok(c.leader),
                Err(e) => Err(format!("{e:?}")),
            }
        },
    )
    .await;
    assert_eq!(leader.unwrap().name, "a");
    etcd.start_again(0);
}

#[tokio::test]
async fn the_leader_key_moves_to_a_new_lease_without_being_released() {
    let etcd = EtcdServer::start();
    let (a, b) = (dcs(&etcd, "c").await, dcs(&etcd, "c").await);
    let short = a.grant_lease(Duration::from_secs(3)).await.unwrap();
    assert!(a.acquire_leader("a", short).await.unwrap());
    let first = b.read_cluster().await.unwrap().leader.unwrap().generation;

    let long = a.grant_lease(Duration::from_secs(30)).await.unwrap();
    assert!(a.rebind_leader("a", short, long).await.unwrap());
    // Again, as after a lost answer: already done.
    assert!(a.rebind_leader("a", short, long).await.unwrap());
    let leader = b.read_cluster().await.unwrap().leader.unwrap();
    assert_eq!((leader.lease, leader.generation), (long, first));
    assert!(a.renew_leader("a", long).await.unwrap());
    assert!(!a.renew_leader("a", short).await.unwrap());
    // The short lease ends and takes nothing with it.
    let mut watch = b.watch_leader().await;
    assert!(matches!(
        next_event(&mut watch, OP_TIMEOUT).await,
        LeaderEvent::Put { generation, .. } if generation == first
    ));
    a.revoke_lease(short).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_secs(4), watch.next())
            .await
            .is_err(),
        "the key must not change"
    );
    assert!(b.read_cluster().await.unwrap().leader.is_some());
    // Nobody else's key can be moved, nor one bound to another lease.
    let lb = b.grant_lease(Duration::from_secs(30)).await.unwrap();
    assert!(!b.rebind_leader("b", long, lb).await.unwrap());
    assert!(!a.rebind_leader("a", short, lb).await.unwrap());
    assert_eq!(b.read_cluster().await.unwrap().leader.unwrap().lease, long);
}

#[tokio::test]
async fn a_reconnect_moves_every_clone_and_keeps_the_leader_key() {
    let etcd = EtcdServer::start();
    let relay =
        pgwarden_testkit::Relay::start(etcd.endpoint().parse().expect("addr")).expect("relay");
    let a = EtcdDcs::connect(&[relay.addr().to_string()], "pgwarden", "r", OP_TIMEOUT)
        .await
        .expect("connect");
    let clone = a.clone();
    let lease = a.grant_lease(Duration::from_secs(10)).await.unwrap();
    assert!(a.acquire_leader("n1", lease).await.unwrap());

    // Nobody listens there: refused, and the relay's connection stays.
    let closed = format!("127.0.0.1:{}", pgwarden_testkit::free_port());
    let e = a
        .reconnect(&[closed], &Default::default())
        .await
        .unwrap_err();
    assert!(
        matches!(e, DcsError::Etcd { .. } | DcsError::Timeout { .. }),
        "{e}"
    );
    assert!(clone.renew_leader("n1", lease).await.unwrap());

    // etcd itself: afterwards every clone works with the relay cut, and the
    // lease and the leader key are the same.
    a.reconnect(&[etcd.endpoint()], &Default::default())
        .await
        .unwrap();
    relay.set_blackhole(true);
    assert!(clone.renew_leader("n1", lease).await.unwrap());
    clone.keep_alive_once(lease).await.unwrap();
    let snap = clone.read_cluster().await.unwrap();
    assert_eq!(snap.leader.map(|l| l.name).as_deref(), Some("n1"));
}

/// A leader busy with work that must end before anyone else leads (a
/// switchover's CHECKPOINT and shutdown) keeps its key for as long as the
/// work takes, however much longer than the lease's TTL that is.
#[tokio::test]
async fn the_leader_key_is_kept_while_its_holder_is_busy() {
    let etcd = EtcdServer::start();
    let (a, b) = (dcs(&etcd, "busy").await, dcs(&etcd, "busy").await);
    let ttl = Duration::from_secs(2);
    let lease = a.grant_lease(ttl).await.unwrap();
    assert!(a.acquire_leader("a", lease).await.unwrap());
    let key = || async {
        b.read_cluster()
            .await
            .unwrap()
            .leader
            .map(|l| (l.name, l.generation))
    };
    let before = key().await;
    let mut renewals = 0;
    // The work: three TTLs, while another member keeps trying to lead.
    let taken = a
        .hold_leader_while("a", lease, ttl / 4, |_| renewals += 1, async {
            let lb = b.grant_lease(ttl).await.unwrap();
            let until = Instant::now() + 3 * ttl;
            while Instant::now() < until {
                if b.acquire_leader("b", lb).await.unwrap() {
                    return true;
                }
                tokio::time::sleep(ttl / 8).await;
            }
            false
        })
        .await;
    assert!(
        !taken,
        "another member took the key while its holder was busy"
    );
    assert!(renewals >= 4, "{renewals} renewals");
    assert_eq!(key().await, before, "the key was never rewritten");
}
