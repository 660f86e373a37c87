//! Cluster topology for pgwarden: what each PostgreSQL server is, which one
//! is primary, how far replicas lag, and which server a new client should
//! be sent to.
//!
//! This crate is deliberately pure. It performs no I/O and never reads the
//! clock: probe results and the current [`std::time::Instant`] are passed in,
//! so every decision can be reproduced in a unit test from synthetic input.
//!
//! * [`model`]: plain data exchanged with the prober and the configuration.
//! * [`ssn`]: a faithful parser of `synchronous_standby_names`.
//! * [`ewma`]: round-trip time smoothing.
//! * [`state`]: the [`Topology`] that turns probe results into a cluster view.
//! * [`select`]: the [`Selector`] that picks a host for a client.

pub mod ewma;
pub mod model;
pub mod select;
pub mod ssn;
pub mod state;
pub mod view;

pub use ewma::Ewma;
pub use model::{
    parse_lsn, AddrParseError, HostAddr, HostConfig, InstanceId, LagLimit, Observation,
    ProbeResult, ReplicationRow, Role, SyncState, TopologyConfig,
};
pub use select::{
    NoTarget, ParseValueError, Peeked, SelectPolicy, Selector, Strategy, Want, FENCED_TAG,
};
pub use ssn::{SsnError, SsnErrorKind, SyncMethod, SyncStandbyNames};
pub use state::{HostState, PrimaryGate, Topology, TopologyEvent};
