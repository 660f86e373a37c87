//! The topology engine's IO half.
//!
//! One dedicated connection per host, marked with its own
//! `application_name` so operators can see it in `pg_stat_activity` and
//! exclude it. Every `probe_interval` a round starts: every host whose
//! previous probe has finished is probed concurrently, each under its own
//! connect and query time-outs, so a slow or black-holed host never delays
//! the others. Results feed the pure [`pgwarden_topology::Topology`]; the
//! resulting view is published as an immutable [`Snapshot`] through an
//! `ArcSwap`, so readers on the traffic path never lock or await.

mod engine;
mod pgpass;
mod query;

pub use engine::{Engine, ProbeConfig, Snapshot};
pub use pgpass::pgpass_lookup;
pub use query::{parse_observation_row, PROBE_QUERY, RTT_QUERY};
