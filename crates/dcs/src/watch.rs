//! Following single keys as they change: the leader key, so a replica
//! learns that the leader's lease expired or was released when etcd deletes
//! the key, not on its next loop; and the `failover` key, so the leader
//! learns of a switchover request written through another member's API.

use std::time::Duration;

use etcd_client::{EventType, KeyValue, WatchOptions};
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

/// A change of the `failover` key (a switchover or failover request).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestEvent {
    /// A request was written.
    Put {
        /// The key's modification revision.
        revision: i64,
    },
    /// The request was consumed or withdrawn.
    Deleted,
}

/// Changes of one key, from an etcd watch that re-establishes itself after
/// errors.
///
/// The first event, and the first after every reconnection whose state
/// differs from the last event delivered, describes the key as it is (so a
/// missing key is reported as deleted); after that, every change etcd
/// reports. Changes that happen while the watch is broken are coalesced
/// into that one catch-up event. Events are hints to re-read the cluster,
/// never a replacement for reading it. Dropping the value stops the watch.
#[derive(Debug)]
pub struct KeyWatch<E> {
    rx: mpsc::Receiver<E>,
    task: JoinHandle<()>,
}

/// Changes of the leader key; see [`KeyWatch`].
pub type LeaderWatch = KeyWatch<LeaderEvent>;

/// Changes of the `failover` key; see [`KeyWatch`].
pub type RequestWatch = KeyWatch<RequestEvent>;

impl<E> KeyWatch<E> {
    /// The next change; `None` only if the watch task has ended, which
    /// happens when the runtime shuts down.
    pub async fn next(&mut self) -> Option<E> {
        self.rx.recv().await
    }

    /// A change already received, without waiting.
    pub fn try_next(&mut self) -> Option<E> {
        self.rx.try_recv().ok()
    }
}

impl<E> Drop for KeyWatch<E> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a key's value (or its absence) means to a watcher.
type Decode<E> = fn(Option<&KeyValue>) -> E;

fn leader_event(kv: Option<&KeyValue>) -> LeaderEvent {
    match kv {
        Some(kv) => LeaderEvent::Put {
            name: String::from_utf8_lossy(kv.value()).into_owned(),
            generation: kv.create_revision(),
        },
        None => LeaderEvent::Deleted,
    }
}

fn request_event(kv: Option<&KeyValue>) -> RequestEvent {
    match kv {
        Some(kv) => RequestEvent::Put {
            revision: kv.mod_revision(),
        },
        None => RequestEvent::Deleted,
    }
}

pub(crate) fn spawn_leader(dcs: EtcdDcs) -> LeaderWatch {
    let key = dcs.keys().leader();
    spawn(dcs, key, leader_event)
}

pub(crate) fn spawn_request(dcs: EtcdDcs) -> RequestWatch {
    let key = dcs.keys().failover();
    spawn(dcs, key, request_event)
}

fn spawn<E>(dcs: EtcdDcs, key: String, decode: Decode<E>) -> KeyWatch<E>
where
    E: Clone + PartialEq + Send + 'static,
{
    let (tx, rx) = mpsc::channel(16);
    let task = tokio::spawn(async move {
        let mut last = None;
        // While etcd is out of reach every retry fails the same way: the
        // first failure is a warning, the rest wait for the one that
        // works (the HA loop reports the outage itself).
        let mut failing = false;
        loop {
            match follow(&dcs, &key, decode, &tx, &mut last, &mut failing).await {
                Ok(()) => return,
                Err(e) if !failing => {
                    tracing::warn!(key = %key, error = %e, "watch broken; re-establishing");
                    failing = true;
                }
                Err(e) => tracing::debug!(key = %key, error = %e, "watch still broken"),
            }
            tokio::select! {
                _ = tokio::time::sleep(RETRY_DELAY) => {}
                _ = tx.closed() => return,
            }
        }
    });
    KeyWatch { rx, task }
}

/// Reads the key, then watches it from just after that read so no change
/// falls between the two (clearing `failing` once it watches). `Ok` when
/// the receiver has gone away.
async fn follow<E: Clone + PartialEq>(
    dcs: &EtcdDcs,
    key: &str,
    decode: Decode<E>,
    tx: &mpsc::Sender<E>,
    last: &mut Option<E>,
    failing: &mut bool,
) -> Result<()> {
    const OP: &str = "watch";
    let mut client = dcs.client();
    let (current, revision) = dcs
        .bounded(OP, async {
            let resp = client.get(key, None).await.map_err(etcd(OP))?;
            let revision = resp.header().map_or(0, |h| h.revision());
            Ok((decode(resp.kvs().first()), revision))
        })
        .await?;
    if last.as_ref() != Some(&current) && !deliver(tx, last, current).await {
        return Ok(());
    }
    let options = WatchOptions::new().with_start_revision(revision + 1);
    let mut stream = dcs
        .bounded(OP, async {
            client.watch(key, Some(options)).await.map_err(etcd(OP))
        })
        .await?;
    if std::mem::take(failing) {
        tracing::info!(key = %key, "watch re-established");
    }
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
                EventType::Put => decode(ev.kv()),
                EventType::Delete => decode(None),
            };
            if !deliver(tx, last, event).await {
                return Ok(());
            }
        }
    }
}

async fn deliver<E: Clone>(tx: &mpsc::Sender<E>, last: &mut Option<E>, event: E) -> bool {
    *last = Some(event.clone());
    tx.send(event).await.is_ok()
}

fn closed(why: &str) -> DcsError {
    etcd("watch")(etcd_client::Error::WatchError(why.into()))
}
