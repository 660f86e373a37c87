//! The distributed configuration store (DCS): where pgwarden's HA agents
//! keep the leader lease, their published state and the cluster's dynamic
//! settings, in etcd v3.
//!
//! # Layout
//!
//! Each cluster owns the keys under `/{namespace}/{cluster}/` (see
//! [`KeyLayout`]), so one etcd can serve many clusters:
//!
//! | key | holds | lifetime |
//! | --- | --- | --- |
//! | `initialize` | database system identifier | written once, by the bootstrap race winner |
//! | `leader` | the leader's member name | bound to the leader's lease |
//! | `members/{name}` | the member's state (JSON) | bound to that member's lease |
//! | `config` | dynamic settings (JSON) | permanent |
//! | `history` | promotions (JSON array of [`HistoryEntry`]) | permanent |
//! | `failover` | a pending switchover/failover request (JSON) | until consumed or cancelled |
//! | `sync` | synchronous replication state (JSON) | written by the leader |
//! | `status` | the leader's last WAL position (JSON) | written by the leader |
//!
//! # Atomicity
//!
//! Every decision that two agents could race on is a single etcd
//! transaction (compare-and-set); each method's documentation says which
//! comparison guards it. Everything else is a plain write of a key that only
//! one writer owns. Each method is bounded by one time-out; a time-out
//! leaves a write's outcome unknown, so callers learn the truth from the
//! next [`EtcdDcs::read_cluster`], never by assuming.
//!
//! # Leases
//!
//! An agent grants one lease ([`EtcdDcs::grant_lease`]) and binds both its
//! member key and, while leader, the leader key to it. Renewing it
//! ([`EtcdDcs::keep_alive_once`], or [`EtcdDcs::renew_leader`] for the
//! leader) every loop keeps both; when the agent dies or is cut off, etcd
//! deletes both when the TTL runs out, and [`EtcdDcs::watch_leader`] tells
//! every replica at once. [`EtcdDcs::watch_failover`] does the same for
//! switchover requests.

mod client;
mod error;
mod keys;
mod snapshot;
mod watch;

pub use client::{EtcdDcs, EtcdSecurity};
pub use error::{DcsError, Result};
pub use keys::{KeyLayout, DEFAULT_NAMESPACE};
pub use snapshot::{ClusterSnapshot, HistoryEntry, LeaderKey, LeaseId};
pub use watch::{KeyWatch, LeaderEvent, LeaderWatch, RequestEvent, RequestWatch};
