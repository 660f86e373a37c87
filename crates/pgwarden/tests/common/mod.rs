//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use pgwarden_probe::{Engine, ProbeConfig, Snapshot};
use pgwarden_topology::{HostAddr, HostConfig, TopologyConfig};

/// Probe settings for tests: short rounds so tests are quick, time-outs
/// that still tolerate a loaded CI machine.
pub fn fast_probe() -> ProbeConfig {
    ProbeConfig {
        interval: Duration::from_millis(250),
        connect_timeout: Duration::from_millis(1500),
        query_timeout: Duration::from_millis(1500),
        ..ProbeConfig::default()
    }
}

pub fn hosts(addrs: &[String]) -> Vec<HostConfig> {
    addrs
        .iter()
        .map(|a| HostConfig::new(a.parse::<HostAddr>().expect("host:port")))
        .collect()
}

pub fn engine(addrs: &[String], topo: TopologyConfig) -> Engine {
    Engine::start(hosts(addrs), topo, fast_probe())
}

/// Waits (bounded) until the snapshot satisfies `check`.
pub async fn until<F>(
    engine: &Engine,
    what: &str,
    within: Duration,
    check: F,
) -> std::sync::Arc<Snapshot>
where
    F: Fn(&Snapshot) -> Result<(), String>,
{
    pgwarden_testkit::eventually(what, within, || {
        let snap = engine.snapshot();
        let r = check(&snap).map(|_| snap.clone());
        async move { r }
    })
    .await
}

/// Runs one SQL command on `conninfo` (simple protocol).
pub async fn sql(conninfo: &str, query: &str) -> Vec<tokio_postgres::SimpleQueryMessage> {
    let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {conninfo}: {e}"));
    let task = tokio::spawn(conn);
    let rows = client
        .simple_query(query)
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"));
    drop(client);
    let _ = task.await;
    rows
}

/// The first column of the first row of `query`.
pub async fn sql_value(conninfo: &str, query: &str) -> Option<String> {
    sql(conninfo, query)
        .await
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).map(str::to_string)),
            _ => None,
        })?
}
