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
mod alloc;
mod auth;
mod bufcache;
mod cancel;
mod http;
mod metrics;
mod pool;
mod proxy;
mod relay;
mod session;
mod sock;
mod stats;
mod stream;
mod timer;
mod txn;
mod workers;

pub use alloc::Allocator;
pub use auth::AuthSpec;
pub use metrics::Metrics;
pub use pool::PoolSettings;
pub use proxy::{
    check_spec, ClientTlsMode, ConnLimits, CredentialSource, PoolOverrides, Proxy, ProxyError,
    ProxySpec, RefusalSwitch, ReloadReply, ServiceSpec, TlsSpec, WRITERS,
};
pub use stream::{tls_acceptor, ClientTls, ServerStream, ServerTls, ServerTlsMode, TcpTimings};

/// Tunes the C allocator for the connection manager; call once at
/// start-up, before any thread is spawned.
///
/// Each new client allocates a few blocks of a kilobyte or more (its task,
/// its start-up state), and glibc merges every "fast bin" of small freed
/// blocks before it serves a request of that size. Without fast bins the
/// small blocks still come from glibc's per-thread cache, and setting a
/// client up runs about 3 % fewer instructions (docs/benchmarks.md).
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: mallopt only sets a parameter of the allocator, and M_MXFAST
    // = 0 is a documented value (fast bins off).
    unsafe {
        libc::mallopt(libc::M_MXFAST, 0);
    }
}
