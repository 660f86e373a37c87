//! The HA agent: runs beside one PostgreSQL node, keeps the cluster's leader
//! lease in etcd, and makes the local server follow the decisions of
//! [`pgwarden_ha::decide`].
//!
//! * [`record`]: what a member publishes in etcd, and the decision's view
//!   of a DCS snapshot.
//! * [`status`]: the agent's state as the API and the router read it.

pub mod api;
pub mod http_client;
pub mod record;
pub mod status;

pub use record::MemberRecord;
pub use status::{AgentStatus, Command, StatusHandle};
