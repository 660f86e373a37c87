//! Following the leader key as it changes, so a replica learns that the
//! leader's lease expired or was released when etcd deletes the key, not on
//! its next loop.

use std::time::Duration;

use etcd_client::{EventType, WatchOptions};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::client::{etcd, EtcdDcs};
use crate::error::{DcsError, Result};

/// Pause before re-establishing a broken watch, so an etcd that is down is
/// not hammered; short against any sensible lease TTL.
const RETRY_DELAY: Duration = Duration::from_millis(500);

/// A change of the leader key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaderEvent {
    /// The key was written.
    Put {
        /// The member name it now names.
        name: String,
        /// The key's create revision: new with every acquisition, the same
        /// for every renewal, so it numbers leaderships.
        generation: i64,
    },
    /// The key was deleted: released, or its lease expired.
    Deleted,
}

/// Changes of the leader key, from an etcd watch that re-establishes itself
/// after errors.
///
/// The first event, and the first after every reconnection whose state
/// differs from the last event delivered, describes the key as it is (so a
/// missing key is reported as [`LeaderEvent::Deleted`]); after that, every
/// change etcd reports. Changes that happen while the watch is broken are
/// coalesced into that one catch-up event. Events are hints to re-read the
/// cluster, never a replacement for reading it. Dropping the value stops the
/// watch.
#[derive(Debug)]
pub struct LeaderWatch {
    rx: mpsc::Receiver<LeaderEvent>,
    task: JoinHandle<()>,
}

impl LeaderWatch {
    /// The next change; `None` only if the watch task has ended, which
    /// happens when the runtime shuts down.
    pub async fn next(&mut self) -> Option<LeaderEvent> {
        self.rx.recv().await
    }

    /// A change already received, without waiting.
    pub fn try_next(&mut self) -> Option<LeaderEvent> {
        self.rx.try_recv().ok()
    }
}

impl Drop for LeaderWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(crate) fn spawn(dcs: EtcdDcs) -> LeaderWatch {
    let (tx, rx) = mpsc::channel(16);
    let task = tokio::spawn(async move {
        let mut last = None;
        loop {
            match follow(&dcs, &tx, &mut last).await {
                Ok(()) => return,
                Err(e) => tracing::warn!(error = %e, "leader watch broken; re-establishing"),
            }
            tokio::select! {
                _ = tokio::time::sleep(RETRY_DELAY) => {}
                _ = tx.closed() => return,
            }
        }
    });
    LeaderWatch { rx, task }
}

/// Reads the key, then watches it from just after that read so no change
/// falls between the two. `Ok` when the receiver has gone away.
async fn follow(
    dcs: &EtcdDcs,
    tx: &mpsc::Sender<LeaderEvent>,
    last: &mut Option<LeaderEvent>,
) -> Result<()> {
    const OP: &str = "watch leader";
    let key = dcs.keys().leader();
    let mut client = dcs.client().clone();
    let (current, revision) = dcs
        .bounded(OP, async {
            let resp = client.get(key.as_str(), None).await.map_err(etcd(OP))?;
            let revision = resp.header().map_or(0, |h| h.revision());
            let current = match resp.kvs().first() {
                Some(kv) => LeaderEvent::Put {
                    name: String::from_utf8_lossy(kv.value()).into_owned(),
                    generation: kv.create_revision(),
                },
                None => LeaderEvent::Deleted,
            };
            Ok((current, revision))
        })
        .await?;
    if last.as_ref() != Some(&current) && !deliver(tx, last, current).await {
        return Ok(());
    }
    let options = WatchOptions::new().with_start_revision(revision + 1);
    let mut stream = dcs
        .bounded(OP, async {
            client
                .watch(key.as_str(), Some(options))
                .await
                .map_err(etcd(OP))
        })
        .await?;
    loop {
        let msg = tokio::select! {
            msg = stream.message() => msg.map_err(etcd(OP))?,
            _ = tx.closed() => return Ok(()),
        };
        let Some(resp) = msg else {
            return Err(closed("watch stream ended"));
        };
        if resp.canceled() {
            return Err(closed("watch cancelled by etcd"));
        }
        for ev in resp.events() {
            let event = match ev.event_type() {
                EventType::Put => LeaderEvent::Put {
                    name: ev
                        .kv()
                        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
                        .unwrap_or_default(),
                    generation: ev.kv().map_or(0, |kv| kv.create_revision()),
                },
                EventType::Delete => LeaderEvent::Deleted,
            };
            if !deliver(tx, last, event).await {
                return Ok(());
            }
        }
    }
}

async fn deliver(
    tx: &mpsc::Sender<LeaderEvent>,
    last: &mut Option<LeaderEvent>,
    event: LeaderEvent,
) -> bool {
    *last = Some(event.clone());
    tx.send(event).await.is_ok()
}

fn closed(why: &str) -> DcsError {
    etcd("watch leader")(etcd_client::Error::WatchError(why.into()))
}
