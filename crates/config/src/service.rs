//! Services: one listener each, bound to one kind of target host.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use pgwarden_topology::{SelectPolicy, Want};
use serde::Deserialize;

use crate::sections::PoolMode;

/// Name of the implicit read-write service.
pub const READ_WRITE: &str = "read_write";
/// Name of the implicit read-only service.
pub const READ_ONLY: &str = "read_only";

/// What a service's `select` key asks for.
///
/// This is the configuration vocabulary; [`ServiceKind::want`] translates
/// it into the topology's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ServiceKind {
    /// The writable primary.
    Primary,
    /// A load-balanced, undelayed replica within the lag limits.
    Replica,
    /// A synchronous or quorum standby.
    Standby,
    /// A host tagged `offline`, for reporting and batch jobs that should
    /// not disturb production reads.
    Offline,
    /// A replica running with `recovery_min_apply_delay`.
    Delayed,
    /// The primary, for administrators: a separate service so that its
    /// listener can be firewalled apart from the application's.
    Default,
}

impl ServiceKind {
    /// The topology target this kind selects.
    pub fn want(self) -> Want {
        match self {
            ServiceKind::Primary | ServiceKind::Default => Want::Primary,
            ServiceKind::Replica => Want::Replica,
            ServiceKind::Standby => Want::SyncStandby,
            ServiceKind::Offline => Want::Tagged("offline".into()),
            ServiceKind::Delayed => Want::Delayed,
        }
    }

    /// Whether this kind always lands on the primary.
    pub fn is_primary(self) -> bool {
        matches!(self, ServiceKind::Primary | ServiceKind::Default)
    }

    /// The `fallback_to_primary` a service of this kind gets when the file
    /// does not say. Delayed replicas exist to serve old data, so silently
    /// serving current data instead would be wrong; for the others a
    /// working primary beats refusing the client.
    pub fn default_fallback(self) -> bool {
        matches!(
            self,
            ServiceKind::Replica | ServiceKind::Standby | ServiceKind::Offline
        )
    }
}

impl fmt::Display for ServiceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ServiceKind::Primary => "primary",
            ServiceKind::Replica => "replica",
            ServiceKind::Standby => "standby",
            ServiceKind::Offline => "offline",
            ServiceKind::Delayed => "delayed",
            ServiceKind::Default => "default",
        })
    }
}

/// One service with every setting resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceConfig {
    /// `read_write`, `read_only`, or the `NAME` of `[services.NAME]`.
    pub name: String,
    /// What the file's `select` said.
    pub kind: ServiceKind,
    /// Where clients connect.
    pub listen: SocketAddr,
    /// Which hosts qualify.
    pub want: Want,
    /// How to choose among them, with cluster-wide defaults applied.
    pub policy: SelectPolicy,
    /// Whether the service is meant for reads only. Always `true` for
    /// kinds other than primary and default.
    pub read_only: bool,
    /// Pool mode for this service's clients, before per-database and
    /// per-user exceptions (see [`crate::PoolConfig::mode_for`]).
    pub pool_mode: PoolMode,
    /// Never pooled, whatever `[pool]` says: a `default` service without a
    /// `pool_mode` of its own, the direct way in for administrators, who
    /// must bypass the pool (each client its own server connection).
    pub direct: bool,
    /// How long a client waits for an eligible host.
    pub connect_wait_timeout: Duration,
}
