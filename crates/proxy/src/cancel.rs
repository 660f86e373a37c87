//! Cancel keys: each client gets its own BackendKeyData from pgwarden, and
//! a CancelRequest carrying it is forwarded to the right backend.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// Where a client's cancel key leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendKey {
    /// The server the backend runs on.
    pub server: SocketAddr,
    /// The backend's process id.
    pub pid: i32,
    /// The backend's secret key.
    pub secret: Secret,
}

/// A backend's secret key as its server sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Secret {
    /// Four bytes, as every server sends under protocol 3.0.
    Four(i32),
    /// Longer (up to 256 bytes), as PostgreSQL 18 sends under protocol
    /// 3.2, which a relayed client may ask for.
    Long(Arc<[u8]>),
}

impl BackendKey {
    /// The CancelRequest packet that cancels this backend's query.
    pub fn cancel_request(&self) -> Vec<u8> {
        match &self.secret {
            Secret::Four(s) => pgwarden_wire::encode::cancel_request(self.pid, *s).to_vec(),
            Secret::Long(s) => pgwarden_wire::encode::cancel_request_long(self.pid, s),
        }
    }
}

/// Client key → backend. Touched once when a session starts, once when it
/// ends and once per cancel request; never per message.
#[derive(Debug, Default)]
pub struct CancelRegistry {
    keys: Mutex<HashMap<(i32, i32), Target, foldhash::fast::RandomState>>,
}

/// A session's backend is fixed; a pooled client's changes with every
/// transaction (and is absent between transactions).
#[derive(Debug, Clone)]
enum Target {
    Fixed(BackendKey),
    Dynamic(Arc<CancelSlot>),
}

/// A pooled client's link to the backend it borrows, shared with the
/// cancel requests sent to that backend.
///
/// A cancel request still on its way when the client lets the server go
/// would land on whatever the next client runs there. So the server goes
/// back to its pool only once every cancel request sent to it has been
/// delivered, and is closed if delivery cannot be confirmed.
///
/// A request for a client that is waiting for a server cancels the wait
/// instead: the statement it queued never runs.
#[derive(Default)]
pub struct CancelSlot {
    state: Mutex<SlotState>,
}

/// A backend let go of while cancel requests to it were in flight.
struct Parked {
    attachment: u64,
    in_flight: u32,
    unconfirmed: bool,
    /// Called with whether the server may be reused.
    release: Box<dyn FnOnce(bool) + Send>,
}

#[derive(Default)]
struct SlotState {
    backend: Option<BackendKey>,
    /// Counts attachments: a cancel request is tied to the one it was
    /// sent for, whose server alone it may reach.
    attachment: u64,
    /// Cancel requests being forwarded to the current backend.
    in_flight: u32,
    /// A cancel request to the current backend was not confirmed
    /// delivered: it may still arrive.
    unconfirmed: bool,
    /// Backends the client let go of with cancel requests still in flight
    /// to them, each released once its own requests are done (rare: a
    /// cancel request crossing the end of a transaction).
    parked: Vec<Parked>,
    /// The client waits for a server, and whether it was cancelled.
    waiting: bool,
    /// Since when it waits (SHOW CLIENTS' `wait`); set only on the slow
    /// path, where a client has to wait.
    waiting_since: Option<std::time::Instant>,
    cancelled: bool,
    /// Wakes the waiting client when it is cancelled (one per client, so
    /// a waker, lighter than a `Notify`).
    waker: Option<std::task::Waker>,
}

impl std::fmt::Debug for CancelSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("CancelSlot")
            .field("waiting", &s.waiting)
            .field("backend", &s.backend)
            .field("in_flight", &s.in_flight)
            .finish()
    }
}

impl CancelSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The client starts waiting for a server.
    pub fn start_waiting(&self) {
        let mut s = self.lock();
        s.waiting = true;
        s.waiting_since = Some(std::time::Instant::now());
        s.cancelled = false;
    }

    /// The client stopped waiting; true if it was cancelled meanwhile.
    pub fn stop_waiting(&self) -> bool {
        let mut s = self.lock();
        s.waiting = false;
        s.waiting_since = None;
        s.waker = None;
        std::mem::take(&mut s.cancelled)
    }

    /// Resolves once a cancel request arrives for the waiting client.
    pub async fn cancelled(&self) {
        std::future::poll_fn(|cx| {
            let mut s = self.lock();
            if s.cancelled {
                return std::task::Poll::Ready(());
            }
            if !s.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                s.waker = Some(cx.waker().clone());
            }
            std::task::Poll::Pending
        })
        .await
    }

    /// The backend the client uses now, and since when it waits for one,
    /// if it does (for the admin console's `SHOW CLIENTS`).
    pub fn state(&self) -> (Option<BackendKey>, Option<std::time::Instant>) {
        let s = self.lock();
        (s.backend.clone(), s.waiting_since)
    }

    /// The client now uses `backend`.
    pub fn attach(&self, backend: BackendKey) {
        let mut s = self.lock();
        s.backend = Some(backend);
        s.attachment += 1;
        s.in_flight = 0;
        s.unconfirmed = false;
    }

    /// The client lets its backend go. `release(reusable)` runs now, or,
    /// with cancel requests to the backend in flight, when the last one is
    /// done; `reusable` is false if one may still arrive.
    pub fn detach(&self, release: impl FnOnce(bool) + Send + 'static) {
        let mut s = self.lock();
        s.backend = None;
        let in_flight = std::mem::take(&mut s.in_flight);
        let unconfirmed = std::mem::take(&mut s.unconfirmed);
        if in_flight == 0 {
            drop(s);
            release(!unconfirmed);
            return;
        }
        // Rare: the allocation is only paid here.
        let attachment = s.attachment;
        s.parked.push(Parked {
            attachment,
            in_flight,
            unconfirmed,
            release: Box::new(release),
        });
    }

    /// Starts forwarding a cancel request to the current backend, if any;
    /// cancels the client's wait if it is waiting for one.
    fn begin(self: &Arc<Self>) -> Option<(BackendKey, CancelGuard)> {
        let mut s = self.lock();
        // A client that waits (for a server, or with the server it keeps,
        // for a paused service to resume) has its statement held here: the
        // wait is what a cancel ends, not the backend, which runs nothing.
        if s.waiting {
            s.cancelled = true;
            let waker = s.waker.take();
            drop(s);
            if let Some(w) = waker {
                w.wake();
            }
            return None;
        }
        let backend = s.backend.clone()?;
        s.in_flight += 1;
        Some((
            backend,
            CancelGuard {
                slot: self.clone(),
                attachment: s.attachment,
                delivered: false,
            },
        ))
    }
}

/// A cancel request being forwarded to a pooled client's backend; see
/// [`CancelSlot`]. Dropping it ends the request.
#[derive(Debug)]
pub struct CancelGuard {
    slot: Arc<CancelSlot>,
    /// The attachment whose backend the request went to.
    attachment: u64,
    delivered: bool,
}

impl CancelGuard {
    /// The server confirmed it read the request.
    pub fn delivered(&mut self) {
        self.delivered = true;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        let mut s = self.slot.lock();
        if s.backend.is_some() && s.attachment == self.attachment {
            s.in_flight -= 1;
            s.unconfirmed |= !self.delivered;
            return;
        }
        // Its backend was let go of: the request may hold only that one's
        // release, never the server the client uses now.
        let Some(i) = s
            .parked
            .iter()
            .position(|p| p.attachment == self.attachment)
        else {
            return;
        };
        let p = &mut s.parked[i];
        p.in_flight -= 1;
        p.unconfirmed |= !self.delivered;
        if p.in_flight > 0 {
            return;
        }
        let p = s.parked.swap_remove(i);
        drop(s);
        (p.release)(!p.unconfirmed);
    }
}

impl CancelRegistry {
    /// Registers a backend and returns the fresh key to hand the client.
    pub fn register(&self, backend: BackendKey) -> (i32, i32) {
        self.insert(Target::Fixed(backend))
    }

    /// Registers a pooled client whose backend changes as it borrows
    /// server connections.
    pub fn register_dynamic(&self, backend: Arc<CancelSlot>) -> (i32, i32) {
        self.insert(Target::Dynamic(backend))
    }

    fn insert(&self, backend: Target) -> (i32, i32) {
        let mut keys = self.keys.lock().expect("cancel registry poisoned");
        loop {
            // Positive like real pids, so clients that print them are not surprised.
            let key = (rand::random::<i32>() & i32::MAX, rand::random::<i32>());
            if key.0 != 0 && !keys.contains_key(&key) {
                keys.insert(key, backend);
                return key;
            }
        }
    }

    /// Forgets a key when its session ends.
    pub fn remove(&self, key: (i32, i32)) {
        self.keys
            .lock()
            .expect("cancel registry poisoned")
            .remove(&key);
    }

    /// The backend behind a client key, with the guard a pooled client's
    /// server is held by until the request is done; unknown keys, and
    /// pooled clients between transactions, give `None`.
    pub fn lookup(&self, key: (i32, i32)) -> Option<(BackendKey, Option<CancelGuard>)> {
        let target = self
            .keys
            .lock()
            .expect("cancel registry poisoned")
            .get(&key)?
            .clone();
        match target {
            Target::Fixed(k) => Some((k, None)),
            Target::Dynamic(slot) => slot.begin().map(|(k, g)| (k, Some(g))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU8, Ordering};

    const BACKEND: BackendKey = BackendKey {
        server: SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 5432),
        pid: 7,
        secret: Secret::Four(9),
    };

    /// 0 = not released, 1 = released for reuse, 2 = released to close.
    fn recorder() -> (Arc<AtomicU8>, impl FnOnce(bool) + Send + 'static) {
        let state = Arc::new(AtomicU8::new(0));
        let s = state.clone();
        (state, move |safe| {
            s.store(if safe { 1 } else { 2 }, Ordering::SeqCst)
        })
    }

    #[test]
    fn a_server_waits_for_cancel_requests_in_flight() {
        let registry = CancelRegistry::default();
        let slot = Arc::new(CancelSlot::default());
        let key = registry.register_dynamic(slot.clone());
        // Between transactions there is nothing to cancel.
        assert!(registry.lookup(key).is_none());

        slot.attach(BACKEND);
        let (target, guard) = registry.lookup(key).unwrap();
        assert_eq!(target, BACKEND);
        let mut guard = guard.unwrap();
        let (state, release) = recorder();
        slot.detach(release);
        assert_eq!(
            state.load(Ordering::SeqCst),
            0,
            "held while the request is in flight"
        );
        guard.delivered();
        drop(guard);
        assert_eq!(state.load(Ordering::SeqCst), 1, "reusable once delivered");

        // Without a cancel request, released at once.
        slot.attach(BACKEND);
        let (state, release) = recorder();
        slot.detach(release);
        assert_eq!(state.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_unconfirmed_cancel_request_closes_the_server() {
        let slot = Arc::new(CancelSlot::default());
        // Given up before the transaction ended...
        slot.attach(BACKEND);
        drop(slot.begin().unwrap().1);
        let (state, release) = recorder();
        slot.detach(release);
        assert_eq!(state.load(Ordering::SeqCst), 2);
        // ...or after.
        slot.attach(BACKEND);
        let guard = slot.begin().unwrap().1;
        let (state, release) = recorder();
        slot.detach(release);
        drop(guard);
        assert_eq!(state.load(Ordering::SeqCst), 2);
        // The next transaction starts afresh.
        slot.attach(BACKEND);
        let (state, release) = recorder();
        slot.detach(release);
        assert_eq!(state.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_cancel_request_ends_a_wait_for_a_server() {
        let slot = Arc::new(CancelSlot::default());
        slot.start_waiting();
        assert!(slot.begin().is_none(), "nothing to forward");
        assert!(slot.stop_waiting());
        // The wake-up left from that wait does not end the next one.
        slot.start_waiting();
        tokio::select! {
            biased;
            () = slot.cancelled() => panic!("woken by an earlier request"),
            () = tokio::task::yield_now() => {}
        }
        assert!(slot.begin().is_none());
        slot.cancelled().await;
        assert!(slot.stop_waiting());
        // Between transactions a request does nothing.
        assert!(slot.begin().is_none());
        slot.start_waiting();
        assert!(!slot.stop_waiting());
    }

    #[test]
    fn releases_held_across_attachments_all_run() {
        let slot = Arc::new(CancelSlot::default());
        slot.attach(BACKEND);
        let mut guard = slot.begin().unwrap().1;
        let (first, release) = recorder();
        slot.detach(release);
        // The client borrows another server while the request is in
        // flight: that one, which no request went to, is not held.
        slot.attach(BACKEND);
        let (second, release) = recorder();
        slot.detach(release);
        assert_eq!(first.load(Ordering::SeqCst), 0);
        assert_eq!(second.load(Ordering::SeqCst), 1);
        guard.delivered();
        drop(guard);
        assert_eq!(first.load(Ordering::SeqCst), 1);
    }

    /// An unconfirmed request to the server a client uses now closes that
    /// server, even when a request to the one before is settled meanwhile
    /// (it may still reach the next client's statement there).
    #[test]
    fn each_attachment_answers_for_its_own_cancel_requests() {
        let slot = Arc::new(CancelSlot::default());
        slot.attach(BACKEND);
        let mut first_request = slot.begin().unwrap().1;
        let (first, release) = recorder();
        slot.detach(release);
        slot.attach(BACKEND);
        let second_request = slot.begin().unwrap().1;
        // Not confirmed: it may still arrive at the second server.
        drop(second_request);
        first_request.delivered();
        drop(first_request);
        assert_eq!(first.load(Ordering::SeqCst), 1, "the first server is safe");
        let (second, release) = recorder();
        slot.detach(release);
        assert_eq!(
            second.load(Ordering::SeqCst),
            2,
            "the second server must be closed"
        );

        // And the other way round: a failed request to the first server
        // closes it, not the second.
        slot.attach(BACKEND);
        let first_request = slot.begin().unwrap().1;
        let (first, release) = recorder();
        slot.detach(release);
        slot.attach(BACKEND);
        drop(first_request);
        assert_eq!(first.load(Ordering::SeqCst), 2);
        let (second, release) = recorder();
        slot.detach(release);
        assert_eq!(second.load(Ordering::SeqCst), 1);
    }
}
