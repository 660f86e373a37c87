//! The test kit: real PostgreSQL clusters on 127.0.0.1, a TCP relay that
//! injects network faults, and waiting on conditions with deadlines.
//!
//! Clusters are built with the product's own process control
//! ([`pgwarden_pgctl`]); the kit adds what only tests need: free ports,
//! per-test temporary directories, servers that die with the test, and
//! clean-up of what a killed test run left behind.
//!
//! PostgreSQL refuses to run as root. When the tests run as root (as in
//! CI) the servers run as the `postgres` user if it exists, else as a
//! `pgwarden` system user the kit creates.

pub mod agents;
pub mod cluster;
pub mod etcd;
pub mod http;
pub mod relay;
pub mod wait;

pub use agents::{AgentCluster, AgentNode};
pub use cluster::{free_port, TestCluster, TestClusterBuilder};
pub use pgwarden_pgctl::{StopMode, SyncSpec};
pub use relay::{Listener, Relay};
pub use wait::{eventually, Deadline};
