//! What one member of the cluster publishes about itself under
//! `members/<name>`, as read back by every other agent.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The role a member's PostgreSQL reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberRole {
    /// Out of recovery and accepting writes.
    Primary,
    /// In recovery, streaming or replaying WAL.
    Replica,
    /// Running, but the agent could not ask it (e.g. a probe timed out).
    #[default]
    Unknown,
    /// Shut down, crashed, or not yet started.
    Stopped,
}

impl fmt::Display for MemberRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemberRole::Primary => "primary",
            MemberRole::Replica => "replica",
            MemberRole::Unknown => "unknown",
            MemberRole::Stopped => "stopped",
        })
    }
}

/// Operator-set tags that shape elections and routing.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct Tags {
    /// Never promote this member, e.g. a reporting replica on weak hardware.
    pub nofailover: bool,
    /// Preference among candidates, higher first; zero (or less) means this
    /// member is never promoted, which lets one knob express both.
    pub failover_priority: i32,
    /// Never choose this member as a synchronous standby.
    pub nosync: bool,
    /// Keep this member out of read-only load balancing.
    pub noloadbalance: bool,
    /// Stream from this member rather than the leader (cascading
    /// replication) while it is up, as Patroni's tag does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicatefrom: Option<String>,
}

impl Default for Tags {
    fn default() -> Self {
        Tags {
            nofailover: false,
            // Zero means "never", so an untagged member must start above it.
            failover_priority: 1,
            nosync: false,
            noloadbalance: false,
            replicatefrom: None,
        }
    }
}

/// One member as the rest of the cluster sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemberState {
    /// Unique member name, also the value written into the leader key.
    pub name: String,
    /// What its PostgreSQL reported on the last probe.
    pub role: MemberRole,
    /// Whether PostgreSQL accepts connections; a stopped member cannot be
    /// promoted no matter how much WAL it holds.
    pub running: bool,
    /// PostgreSQL timeline; positions are comparable only on one timeline.
    pub timeline: u32,
    /// WAL received from upstream (on a primary: written locally), the most
    /// a promotion can keep.
    pub received_lsn: Option<u64>,
    /// WAL replayed; lags the received position under heavy load, but a
    /// replica whose receiver restarted may report only this.
    pub replayed_lsn: Option<u64>,
    /// Operator tags.
    pub tags: Tags,
    /// Fenced members are kept out of elections and routing, as an operator
    /// does before maintenance.
    pub fenced: bool,
    /// Age of this member's latest published state; a member that stopped
    /// publishing may be partitioned away even though its key has not lapsed.
    pub last_seen_ms_ago: u64,
    /// Base URL of its HTTP API, for reading fresher state during a race.
    pub api_url: String,
    /// As a running standby, whether its WAL receiver streams (`None`: not
    /// known). Published beside the state, not in it.
    #[serde(skip)]
    pub streaming: Option<bool>,
}

impl MemberState {
    /// A running replica with default tags and nothing else known, the
    /// starting point for building a state field by field.
    pub fn new(name: impl Into<String>) -> Self {
        MemberState {
            name: name.into(),
            role: MemberRole::Replica,
            running: true,
            ..MemberState::default()
        }
    }

    /// The furthest WAL position this member is known to hold, whichever of
    /// the received and replayed positions was reported.
    pub fn wal_position(&self) -> Option<u64> {
        self.received_lsn.max(self.replayed_lsn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wal_position_takes_the_further_of_the_two() {
        let mut m = MemberState::new("n1");
        assert_eq!(m.wal_position(), None);
        m.replayed_lsn = Some(100);
        assert_eq!(m.wal_position(), Some(100));
        m.received_lsn = Some(150);
        assert_eq!(m.wal_position(), Some(150));
        m.received_lsn = Some(50);
        assert_eq!(m.wal_position(), Some(100));
    }

    #[test]
    fn missing_fields_take_safe_defaults() {
        let m: MemberState = serde_json::from_str(r#"{"name":"n2","role":"replica"}"#).unwrap();
        assert_eq!(m.tags.failover_priority, 1);
        assert!(!m.tags.nofailover && !m.fenced && !m.running);
        assert_eq!(m.role, MemberRole::Replica);
        let tags: Tags = serde_json::from_str(r#"{"nofailover":true}"#).unwrap();
        assert_eq!(tags.failover_priority, 1);
        assert!(tags.nofailover);
    }
}
