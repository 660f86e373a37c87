//! Cancel keys: each client gets its own BackendKeyData from pgwarden, and
//! a CancelRequest carrying it is forwarded to the right backend.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// Where a client's cancel key leads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendKey {
    /// The server the backend runs on.
    pub server: SocketAddr,
    /// The backend's process id.
    pub pid: i32,
    /// The backend's secret key.
    pub secret: i32,
}

/// Client key → backend. Touched once when a session starts, once when it
/// ends and once per cancel request; never per message.
#[derive(Debug, Default)]
pub struct CancelRegistry {
    keys: Mutex<HashMap<(i32, i32), Target>>,
}

/// A session's backend is fixed; a pooled client's changes with every
/// transaction (and is absent between transactions).
#[derive(Debug, Clone)]
enum Target {
    Fixed(BackendKey),
    Dynamic(Arc<Mutex<Option<BackendKey>>>),
}

impl CancelRegistry {
    /// Registers a backend and returns the fresh key to hand the client.
    pub fn register(&self, backend: BackendKey) -> (i32, i32) {
        self.insert(Target::Fixed(backend))
    }

    /// Registers a pooled client whose backend changes as it borrows
    /// server connections.
    pub fn register_dynamic(&self, backend: Arc<Mutex<Option<BackendKey>>>) -> (i32, i32) {
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

    /// The backend behind a client key; unknown keys give `None`.
    pub fn lookup(&self, key: (i32, i32)) -> Option<BackendKey> {
        match self
            .keys
            .lock()
            .expect("cancel registry poisoned")
            .get(&key)?
        {
            Target::Fixed(k) => Some(*k),
            Target::Dynamic(k) => *k.lock().expect("poisoned"),
        }
    }
}
