//! The documented, stable JSON shape of a topology (`pgwarden topology
//! --json`, and the HTTP `/cluster` document). Field names here are a
//! public interface: add fields, never rename or remove them.

use serde::Serialize;

use crate::{Role, SyncState, Topology};

/// One host as reported to operators.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct HostView {
    /// Host name or address, as configured.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// `primary`, `replica` or `unknown`; a dead host shows its last known role.
    pub role: Role,
    /// Whether the host counts as up: false once `down_after_failures`
    /// probes in a row failed (at once for a refused connection), true
    /// again at the next success.
    pub alive: bool,
    /// `sync`, `quorum`, `potential`, `async`, or null (primary, dead, or not
    /// streaming from the primary).
    pub sync_state: Option<SyncState>,
    /// Bytes of WAL the replica has yet to replay, relative to the
    /// primary's current position.
    pub lag_bytes: Option<u64>,
    /// Time lag in milliseconds: how long the primary had been past the
    /// replica's replay position, i.e. the age of the oldest change the
    /// replica lacks.
    pub replay_delay_ms: Option<u64>,
    /// Whether the replica applies WAL with a configured delay.
    pub delayed: bool,
    /// Smoothed round-trip time of the probe query, in milliseconds.
    pub rtt_ms: Option<f64>,
    /// The timeline the host is on.
    pub timeline: Option<u32>,
    /// Whether replica selection skips the host for exceeding `max_replica_lag`.
    pub lag_excluded: bool,
    /// Why the replica is not following the primary (an older timeline, or
    /// streaming from a server that is not the primary); null when it is.
    /// Such a replica takes no reads.
    pub off_primary: Option<String>,
    /// `host:port` of the entry this one duplicates: both reach the same
    /// server (same system identifier, start time and port), which counts
    /// once, as that entry. Null otherwise.
    pub duplicate_of: Option<String>,
    /// Tags from the configuration.
    pub tags: Vec<String>,
    /// The last probe error: while the host is dead, or while it is up
    /// but its recent probes failed (`failed_probes` > 0).
    pub error: Option<String>,
    /// Probes failed in a row since the last answer. A host that was up
    /// stays up until `down_after_failures` doubtful failures.
    pub failed_probes: u32,
}

/// The whole cluster as reported to operators.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopologyView {
    /// Number of completed probe rounds.
    pub round: u64,
    /// Every configured host, in configuration order.
    pub hosts: Vec<HostView>,
    /// `host:port` of the selectable primary, or null.
    pub primary: Option<String>,
    /// Whether the primary commits with a quorum (`ANY n (...)`).
    pub quorum_commit: bool,
    /// Whether several hosts claim to be primary on the same timeline (no
    /// primary is selectable until this resolves).
    pub conflict: bool,
    /// The primary's `synchronous_standby_names` could not be parsed: why.
    pub sync_config_error: Option<String>,
}

impl TopologyView {
    /// Builds the report of `topology` after `round` rounds.
    pub fn new(topology: &Topology, round: u64) -> Self {
        let hosts = topology
            .hosts()
            .iter()
            .map(|h| HostView {
                host: h.config.addr.host.clone(),
                port: h.config.addr.port,
                role: h.role,
                alive: h.alive,
                sync_state: h.sync_state,
                lag_bytes: h.lag_bytes,
                replay_delay_ms: h.replay_delay.map(|d| d.as_millis() as u64),
                delayed: h.delayed,
                rtt_ms: h.rtt.get().map(|ms| (ms * 1000.0).round() / 1000.0),
                timeline: h.timeline,
                lag_excluded: h.lag_excluded,
                off_primary: h.off_primary.clone(),
                duplicate_of: h
                    .duplicate_of
                    .and_then(|of| topology.host(of))
                    .map(|of| of.config.addr.to_string()),
                tags: h.config.tags.clone(),
                error: h.error.clone(),
                failed_probes: h.failed_probes,
            })
            .collect();
        Self {
            round,
            hosts,
            primary: topology
                .primary()
                .and_then(|i| topology.host(i))
                .map(|h| h.config.addr.to_string()),
            quorum_commit: topology.quorum_commit(),
            conflict: topology.conflict(),
            sync_config_error: topology.ssn_error().map(str::to_string),
        }
    }

    /// A fixed-width table for terminals.
    pub fn to_table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "round {}  primary: {}{}{}",
            self.round,
            self.primary.as_deref().unwrap_or("none"),
            if self.quorum_commit {
                "  quorum commit"
            } else {
                ""
            },
            if self.conflict {
                "  CONFLICT: several primaries"
            } else {
                ""
            },
        );
        let _ = writeln!(
            out,
            "{:<22} {:<8} {:<5} {:<9} {:>12} {:>10} {:>9} {:>4}  ERROR",
            "HOST", "ROLE", "ALIVE", "SYNC", "LAG_BYTES", "DELAY_MS", "RTT_MS", "TL"
        );
        let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        for h in &self.hosts {
            let mut role = h.role.to_string();
            if h.delayed {
                role.push('*');
            }
            let _ = writeln!(
                out,
                "{:<22} {:<8} {:<5} {:<9} {:>12} {:>10} {:>9} {:>4}  {}",
                crate::HostAddr::new(h.host.as_str(), h.port).to_string(),
                role,
                if h.alive { "yes" } else { "no" },
                dash(h.sync_state.map(|s| s.to_string())),
                dash(h.lag_bytes.map(|v| v.to_string())),
                dash(h.replay_delay_ms.map(|v| v.to_string())),
                dash(h.rtt_ms.map(|v| format!("{v:.3}"))),
                dash(h.timeline.map(|v| v.to_string())),
                h.error.as_deref().unwrap_or(""),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::state::tests::primary_obs;
    use crate::{HostAddr, HostConfig, ProbeResult, TopologyConfig};

    #[test]
    fn table_brackets_ipv6_hosts() {
        let mut t = Topology::new(
            vec![
                HostConfig::new(HostAddr::new("::1", 21100)),
                HostConfig::new(HostAddr::new("db1", 5432)),
            ],
            TopologyConfig::default(),
        );
        t.apply(0, ProbeResult::Ok(primary_obs(1, 1)), Instant::now());
        let view = TopologyView::new(&t, 1);
        let table = view.to_table();
        assert!(table.contains("primary: [::1]:21100"), "{table}");
        let rows: Vec<&str> = table.lines().skip(2).collect();
        assert!(rows[0].starts_with("[::1]:21100 "), "{table}");
        assert!(rows[1].starts_with("db1:5432 "), "{table}");
        // The JSON fields keep the parts apart, unbracketed.
        assert_eq!(view.hosts[0].host, "::1");
    }
}
