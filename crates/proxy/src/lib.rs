//! The connection manager.
//!
//! Clients connect to a service's listener (read-write, read-only, or a
//! named service); the service's selector picks a host from the topology
//! engine's current snapshot, and the session is relayed to that host.
//!
//! The traffic path never locks or awaits routing state: a session reads
//! the routing snapshot once, when it connects. Changes reach running
//! sessions the other way round: a router task, off the traffic path,
//! watches the topology and tells the sessions whose host is no longer
//! right (a demoted primary, a dead host) to end.

mod admin;
mod auth;
mod bufcache;
mod cancel;
mod http;
mod metrics;
mod pool;
mod proxy;
mod relay;
mod session;
mod stream;
mod timer;
mod txn;
mod workers;

pub use auth::AuthSpec;
pub use metrics::Metrics;
pub use pool::PoolSettings;
pub use proxy::{
    ClientTlsMode, ConnLimits, PoolOverrides, Proxy, ProxySpec, RefusalSwitch, ServiceSpec, TlsSpec,
};
pub use stream::{tls_acceptor, ServerStream, ServerTls, ServerTlsMode};
