//! Pausing the connection managers around a switchover, so that
//! transaction-pooled clients do not notice it: every node's read-write
//! pools stop starting transactions (those in flight finish) before the old
//! leader stops, and start again once the new leader takes writes.
//!
//! An immediate switchover is wrapped by the REST API that receives it; a
//! scheduled one by the leader's loop when its time comes, since nobody
//! waits on the API by then.

use std::time::{Duration, Instant};

use pgwarden_dcs::EtcdDcs;
use pgwarden_ha::MemberRole;

use crate::record;

/// How long a switchover waits for transactions in flight to finish on
/// the paused pools before it goes ahead anyway.
pub(crate) const SWITCHOVER_DRAIN: Duration = Duration::from_secs(5);

/// How long the pools stay paused, once the key has moved, for the new
/// leader to report itself a running primary.
pub(crate) const WRITABLE_WAIT: Duration = Duration::from_secs(10);

/// Pauses the services that write to the primary (`read_write` and the
/// named services selecting it) of every connection manager that answers;
/// returns those paused.
pub(crate) async fn pause_proxies(
    urls: &[String],
    credentials: &crate::api::Credentials,
) -> Vec<String> {
    // The connection managers take this agent's API credentials: they are
    // the cluster's, and their HTTP ports refuse pauses from elsewhere
    // without them.
    let auth = credentials.get();
    let auth = auth.as_ref().map(|(u, p)| (u.as_str(), p.as_str()));
    // Each connection manager once, however many members name it.
    let mut urls: Vec<&String> = urls.iter().collect();
    urls.sort();
    urls.dedup();
    let calls = urls.into_iter().map(|u| async move {
        let url = format!(
            "{u}/pause?service=%2Awriters&wait_ms={}",
            SWITCHOVER_DRAIN.as_millis()
        );
        match crate::http_client::request(
            "POST",
            &url,
            None,
            auth,
            SWITCHOVER_DRAIN + Duration::from_secs(2),
        )
        .await
        {
            Ok(r) if r.status == 200 => Some(u.clone()),
            Ok(r) => {
                // Still paused, with transactions that would not finish.
                tracing::warn!(proxy = %u, status = r.status, body = %r.body.trim(), "pause before switchover incomplete");
                Some(u.clone())
            }
            Err(e) => {
                tracing::warn!(proxy = %u, error = %e, "cannot pause a connection manager before switchover");
                None
            }
        }
    });
    crate::join_all(calls).await.into_iter().flatten().collect()
}

/// Resumes the services paused by [`pause_proxies`].
pub(crate) async fn resume_proxies(urls: &[String], credentials: &crate::api::Credentials) {
    let auth = credentials.get();
    let auth = auth.as_ref().map(|(u, p)| (u.as_str(), p.as_str()));
    // Each connection manager once, however many members name it.
    let mut urls: Vec<&String> = urls.iter().collect();
    urls.sort();
    urls.dedup();
    let calls = urls.into_iter().map(|u| async move {
        let url = format!("{u}/resume?service=%2Awriters");
        match crate::http_client::request("POST", &url, None, auth, Duration::from_secs(5)).await
        {
            Ok(r) if r.status == 200 => {}
            Ok(r) => {
                tracing::error!(proxy = %u, status = r.status, body = %r.body.trim(), "cannot resume a connection manager after switchover")
            }
            Err(e) => {
                tracing::error!(proxy = %u, error = %e, "cannot resume a connection manager after switchover")
            }
        }
    });
    crate::join_all(calls).await;
}

/// Waits, at most `within`, until the leader key names a member other than
/// `other_than` (any member when `None`) that reports itself a running
/// primary, so resumed transactions find it ready. In a standby cluster,
/// where nobody takes writes, a running standby leader is as ready as it
/// gets.
pub(crate) async fn wait_for_writable_leader(
    dcs: &EtcdDcs,
    other_than: Option<&str>,
    within: Duration,
) {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(snap) = dcs.read_cluster().await {
            let leader = snap
                .leader
                .as_ref()
                .map(|l| l.name.clone())
                .filter(|l| Some(l.as_str()) != other_than);
            let standby = record::standby_cluster(&snap).is_some();
            let ready = record::records(&snap).into_iter().any(|r| {
                Some(&r.state.name) == leader.as_ref()
                    && r.state.running
                    && (r.state.role == MemberRole::Primary
                        || (standby && r.state.role == MemberRole::Replica))
            });
            if ready {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
