//! What can go wrong talking to the store.

use std::time::Duration;

use crate::LeaseId;

/// An error from a DCS operation.
///
/// The HA agent treats every variant of a failed lease renewal the same way
/// (the renewal did not happen), but logs and the API report the variant, so
/// "etcd down" and "lease already gone" stay distinguishable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DcsError {
    /// A namespace, cluster or member name that cannot be part of a key.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        /// Which name it was: "namespace", "cluster" or "member".
        what: &'static str,
        /// The rejected name.
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// No etcd endpoint was given.
    #[error("no etcd endpoints given")]
    NoEndpoints,
    /// A lease TTL etcd cannot represent (zero, or beyond `i64` seconds).
    #[error("invalid lease ttl {0:?}")]
    InvalidTtl(Duration),
    /// The operation did not complete within the configured bound; etcd may
    /// or may not have applied it.
    #[error("etcd {op} timed out after {after:?}")]
    Timeout {
        /// The operation that timed out.
        op: &'static str,
        /// The bound that was exceeded.
        after: Duration,
    },
    /// etcd or the transport to it reported an error.
    #[error("etcd {op} failed")]
    Etcd {
        /// The operation that failed.
        op: &'static str,
        /// The client library's error.
        #[source]
        source: etcd_client::Error,
    },
    /// The lease has expired or was revoked; keys bound to it are gone.
    #[error("lease {0} not found (expired or revoked)")]
    LeaseNotFound(LeaseId),
    /// A value to be written could not be encoded, or a value read back that
    /// the operation depends on could not be decoded.
    #[error("malformed JSON in {key}")]
    Malformed {
        /// The key involved.
        key: String,
        /// The decoding error.
        #[source]
        source: serde_json::Error,
    },
    /// A read-modify-write lost the compare-and-set race too many times in a
    /// row; the caller may retry later.
    #[error("{key} changed concurrently {attempts} times in a row")]
    Conflict {
        /// The contended key.
        key: String,
        /// How many attempts were made.
        attempts: u32,
    },
}

impl DcsError {
    /// Whether the error means etcd could not be reached or answered too late,
    /// as opposed to a definite answer or a caller's mistake.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, DcsError::Timeout { .. } | DcsError::Etcd { .. })
    }
}

/// Result of a DCS operation.
pub type Result<T, E = DcsError> = std::result::Result<T, E>;
