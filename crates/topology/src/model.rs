//! Plain data types shared by the probe side and the topology logic.
//!
//! Everything here is a value type: the prober fills in an [`Observation`]
//! and the [`crate::Topology`] interprets it. Keeping these free of behaviour
//! lets the probe crate depend on them without pulling in any policy.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A network endpoint of one PostgreSQL server.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostAddr {
    /// Host name or IP literal, without brackets for IPv6.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl HostAddr {
    /// Builds an address from its parts.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        HostAddr {
            host: host.into(),
            port,
        }
    }
}

impl fmt::Display for HostAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A bare IPv6 literal would make the port separator ambiguous.
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Why a `host:port` string was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddrParseError {
    /// The input was empty (after trimming whitespace).
    Empty,
    /// No `:port` suffix was present.
    MissingPort,
    /// The host part was empty.
    EmptyHost,
    /// A `[` was not closed, or text other than `:port` followed the `]`.
    BadBrackets,
    /// An IPv6 literal was given without brackets, so the port cannot be told apart.
    UnbracketedIpv6,
    /// The port was not an integer in `1..=65535`.
    InvalidPort(String),
    /// The host was a path (a Unix-domain socket directory), which the
    /// connection manager cannot reach servers through.
    SocketPath,
}

impl fmt::Display for AddrParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddrParseError::Empty => f.write_str("empty address, expected host:port"),
            AddrParseError::MissingPort => f.write_str("missing port, expected host:port"),
            AddrParseError::EmptyHost => f.write_str("empty host name, expected host:port"),
            AddrParseError::BadBrackets => {
                f.write_str("malformed bracketed host, expected [ipv6]:port")
            }
            AddrParseError::UnbracketedIpv6 => {
                f.write_str("IPv6 address must be written in brackets, as [addr]:port")
            }
            AddrParseError::InvalidPort(p) => {
                write!(f, "invalid port {p:?}, expected an integer from 1 to 65535")
            }
            AddrParseError::SocketPath => f.write_str(
                "a Unix-domain socket directory is not supported, expected a host name or IP address and port",
            ),
        }
    }
}

impl std::error::Error for AddrParseError {}

impl FromStr for HostAddr {
    type Err = AddrParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() {
            return Err(AddrParseError::Empty);
        }
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let close = rest.find(']').ok_or(AddrParseError::BadBrackets)?;
            let host = &rest[..close];
            let after = &rest[close + 1..];
            let port = match after.strip_prefix(':') {
                Some(p) => p,
                None if after.is_empty() => return Err(AddrParseError::MissingPort),
                None => return Err(AddrParseError::BadBrackets),
            };
            (host, port)
        } else {
            let (host, port) = s.rsplit_once(':').ok_or(AddrParseError::MissingPort)?;
            if host.contains(':') {
                return Err(AddrParseError::UnbracketedIpv6);
            }
            if host.contains('[') || host.contains(']') {
                return Err(AddrParseError::BadBrackets);
            }
            (host, port)
        };
        if host.is_empty() {
            return Err(AddrParseError::EmptyHost);
        }
        // libpq reads a host beginning with `/` as a socket directory; the
        // probe would follow it while sessions and pools, which speak TCP,
        // could not, so a cluster would look healthy and serve no one.
        if host.contains('/') {
            return Err(AddrParseError::SocketPath);
        }
        // u16::from_str accepts a leading '+', which is not a port anyone writes.
        let port_num = if port.bytes().all(|b| b.is_ascii_digit()) {
            port.parse::<u16>().ok()
        } else {
            None
        };
        match port_num {
            Some(p) if p != 0 => Ok(HostAddr::new(host, p)),
            _ => Err(AddrParseError::InvalidPort(port.to_string())),
        }
    }
}

/// The role a server reported for itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Not in recovery: accepts writes.
    Primary,
    /// In recovery: a streaming or archive replica.
    Replica,
    /// Never successfully probed.
    #[default]
    Unknown,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Primary => "primary",
            Role::Replica => "replica",
            Role::Unknown => "unknown",
        })
    }
}

/// A standby's synchronous-replication status as the primary reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncState {
    /// Currently one of the priority-based synchronous standbys.
    Sync,
    /// A candidate in quorum-based (`ANY`) synchronous replication.
    Quorum,
    /// Would become synchronous if a current synchronous standby went away.
    Potential,
    /// Not taking part in synchronous replication.
    Async,
}

impl SyncState {
    /// Interprets the `sync_state` column of `pg_stat_replication`.
    pub fn parse(s: &str) -> Option<SyncState> {
        let s = s.trim();
        [
            ("sync", SyncState::Sync),
            ("quorum", SyncState::Quorum),
            ("potential", SyncState::Potential),
            ("async", SyncState::Async),
        ]
        .into_iter()
        .find(|(name, _)| s.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
    }
}

impl fmt::Display for SyncState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SyncState::Sync => "sync",
            SyncState::Quorum => "quorum",
            SyncState::Potential => "potential",
            SyncState::Async => "async",
        })
    }
}

/// One row of `pg_stat_replication`, as read on the primary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplicationRow {
    /// The standby's `application_name`.
    pub application_name: String,
    /// The walsender state (`streaming`, `catchup`, ...).
    pub state: String,
    /// The raw `sync_state` text.
    pub sync_state: String,
    /// The standby's replay position, if reported.
    pub replay_lsn: Option<u64>,
    /// The replication slot the standby streams through, if any. Slot
    /// names are unique on a server, so unlike `application_name` this
    /// ties the row to one standby.
    pub slot_name: Option<String>,
}

/// What tells one running PostgreSQL server apart from every other,
/// whatever name or address it was reached under.
///
/// The system identifier alone is not enough: initdb sets it once and a
/// primary shares it with all its physical replicas (and with any copy of
/// its data directory). The postmaster's start time, to the microsecond,
/// separates the servers of one lineage, and the port separates servers of
/// one machine in the unlikely event that two started in the same
/// microsecond. All three are readable by any role, unlike
/// `data_directory`, which needs `pg_read_all_settings`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InstanceId {
    /// `pg_control_system().system_identifier`, as PostgreSQL shows it (a
    /// signed `bigint`).
    pub system_identifier: i64,
    /// `pg_postmaster_start_time()`, in microseconds since the Unix epoch.
    /// It changes when the server restarts.
    pub started_us: i64,
    /// The server's `port` setting.
    pub port: u16,
}

impl InstanceId {
    /// Whether `other` could be this server after a restart: same data
    /// lineage and port, another start time.
    pub fn restarted_as(&self, other: &InstanceId) -> bool {
        self.system_identifier == other.system_identifier
            && self.port == other.port
            && self.started_us != other.started_us
    }
}

/// Everything one successful probe of one server returned.
///
/// Fields that only make sense for one role are `None` (or empty) for the other.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observation {
    /// `pg_is_in_recovery()`.
    pub in_recovery: bool,
    /// Round-trip time of the probe query.
    pub rtt: Duration,
    /// Current timeline ID.
    pub timeline: Option<u32>,
    /// Primary only: `pg_current_wal_lsn()`.
    pub current_lsn: Option<u64>,
    /// Replica only: last WAL position received from upstream.
    pub receive_lsn: Option<u64>,
    /// Replica only: last WAL position replayed.
    pub replay_lsn: Option<u64>,
    /// Replica only: the replica's own estimate of its replay delay (the
    /// time since its last replayed commit while replay trails receipt).
    /// For display by callers that want it; the topology measures delay
    /// against the primary's positions instead, because this estimate is
    /// zero for a replica that receives nothing and grows with the time
    /// an idle primary wrote nothing.
    pub replay_delay: Option<Duration>,
    /// Replica only: `recovery_min_apply_delay`; non-zero marks a deliberately delayed replica.
    pub min_apply_delay: Duration,
    /// Replica only: the `application_name` its WAL receiver presents upstream,
    /// i.e. the name it has in the primary's `pg_stat_replication`.
    pub wal_receiver_name: Option<String>,
    /// Replica only: the replication slot its WAL receiver streams through
    /// (`primary_slot_name`), matched against the slots of the primary's
    /// `pg_stat_replication` rows.
    pub wal_receiver_slot: Option<String>,
    /// Replica only: the server its WAL receiver is connected to
    /// (`pg_stat_wal_receiver.sender_host` and `sender_port`), as that
    /// replica names it.
    pub upstream: Option<HostAddr>,
    /// Replica only: the addresses `upstream`'s host stands for, as the
    /// prober resolved it (the literal itself for an IP address; empty when
    /// it could not be resolved or is a Unix-socket directory). Names are
    /// resolved from the prober's side, where a loopback address means the
    /// prober's machine, not the replica's.
    pub upstream_ips: Vec<IpAddr>,
    /// Which server this is, whatever it was reached as; `None` when the
    /// server did not say.
    pub instance: Option<InstanceId>,
    /// `inet_server_addr()`: the address the server accepted the probe's
    /// connection on, i.e. the address of its machine as seen from the
    /// prober.
    pub server_ip: Option<IpAddr>,
    /// Primary only: raw `synchronous_standby_names` text.
    pub synchronous_standby_names: Option<String>,
    /// Primary only: the rows of `pg_stat_replication`.
    pub replication: Vec<ReplicationRow>,
}

/// Outcome of probing one server.
// One result per probe, moved once into the topology: boxing the large
// variant would add an allocation per probe and save nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum ProbeResult {
    /// The server answered.
    Ok(Observation),
    /// The probe failed in a way that may pass (a time-out, a broken
    /// connection, an unexpected answer); the text says why. A host that
    /// was up is marked down only after
    /// [`TopologyConfig::down_after_failures`] of these in a row.
    Err(String),
    /// The server certainly does not serve: nothing listens at its address,
    /// or it says it is starting up or shutting down. The host is marked
    /// down at once.
    Down(String),
}

/// Parses PostgreSQL's textual LSN form `XXXXXXXX/XXXXXXXX` (two hex halves).
///
/// Mirrors `pg_lsn_in`: each half has 1 to 8 hex digits and nothing else is allowed.
pub fn parse_lsn(s: &str) -> Option<u64> {
    let (hi, lo) = s.split_once('/')?;
    let half = |h: &str| -> Option<u64> {
        if h.is_empty() || h.len() > 8 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(h, 16).ok()
    };
    Some((half(hi)? << 32) | half(lo)?)
}

/// Static configuration of one managed server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// Where to connect.
    pub addr: HostAddr,
    /// Name to look for in the primary's `pg_stat_replication` when this host
    /// is a replica; when unset, the name the replica itself reports is used.
    pub application_name: Option<String>,
    /// Free-form labels; `offline` and `noloadbalance` keep a replica out of
    /// load balancing.
    pub tags: Vec<String>,
}

impl HostConfig {
    /// A host with no name override and no tags.
    pub fn new(addr: HostAddr) -> Self {
        HostConfig {
            addr,
            application_name: None,
            tags: Vec::new(),
        }
    }

    /// Whether the host carries `tag`; tags compare ASCII case-insensitively
    /// so that hand-written configuration does not trip over capitalisation.
    pub fn has_tag(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t.eq_ignore_ascii_case(tag))
    }
}

/// How far behind a replica may fall before it stops receiving read traffic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LagLimit {
    /// Maximum WAL distance from the primary, in bytes.
    pub bytes: Option<u64>,
    /// Maximum replay delay.
    pub time: Option<Duration>,
}

impl LagLimit {
    /// Whether the given lag breaks the limit. Unknown values never do, so a
    /// replica is not punished for information the probe could not obtain.
    pub fn exceeded(&self, lag_bytes: Option<u64>, replay_delay: Option<Duration>) -> bool {
        let over_bytes = matches!((self.bytes, lag_bytes), (Some(max), Some(v)) if v > max);
        let over_time = matches!((self.time, replay_delay), (Some(max), Some(v)) if v > max);
        over_bytes || over_time
    }

    /// Whether the given lag is known to be within the limit: every bound
    /// set has a value at or below it. An excluded replica is readmitted
    /// only on such evidence, not while its lag is unknown (no primary to
    /// measure against, say).
    pub fn within(&self, lag_bytes: Option<u64>, replay_delay: Option<Duration>) -> bool {
        let bytes_ok = match (self.bytes, lag_bytes) {
            (None, _) => true,
            (Some(max), Some(v)) => v <= max,
            (Some(_), None) => false,
        };
        let time_ok = match (self.time, replay_delay) {
            (None, _) => true,
            (Some(max), Some(v)) => v <= max,
            (Some(_), None) => false,
        };
        bytes_ok && time_ok
    }
}

/// Tunables of the topology view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyConfig {
    /// Lag beyond which replicas are excluded; `None` disables exclusion.
    pub max_replica_lag: Option<LagLimit>,
    /// How long an excluded replica must stay within the limit before it is
    /// readmitted, so that a replica hovering at the limit does not flap.
    pub lag_hold: Duration,
    /// How many doubtful probe failures ([`ProbeResult::Err`]) in a row
    /// mark a host that was up as down; at least 1. Until then the host
    /// keeps its role and its sessions: one slow answer under load must
    /// not end every session on a healthy server.
    pub down_after_failures: u32,
}

impl Default for TopologyConfig {
    fn default() -> Self {
        TopologyConfig {
            max_replica_lag: None,
            lag_hold: Duration::from_secs(10),
            down_after_failures: 3,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_addr_round_trip() {
        for (input, host, port, shown) in [
            ("db1:5432", "db1", 5432, "db1:5432"),
            ("10.0.0.1:6432", "10.0.0.1", 6432, "10.0.0.1:6432"),
            ("[::1]:5432", "::1", 5432, "[::1]:5432"),
            ("[fe80::1%eth0]:1", "fe80::1%eth0", 1, "[fe80::1%eth0]:1"),
            (" db:65535 ", "db", 65535, "db:65535"),
        ] {
            let a: HostAddr = input.parse().unwrap();
            assert_eq!(a, HostAddr::new(host, port), "{input}");
            assert_eq!(a.to_string(), shown);
            assert_eq!(shown.parse::<HostAddr>().unwrap(), a);
        }
    }

    #[test]
    fn host_addr_rejects() {
        use AddrParseError::*;
        for (input, err) in [
            ("", Empty),
            ("db", MissingPort),
            (":5432", EmptyHost),
            ("db:", InvalidPort(String::new())),
            ("db:0", InvalidPort("0".into())),
            ("db:65536", InvalidPort("65536".into())),
            ("db:+5", InvalidPort("+5".into())),
            ("db:x", InvalidPort("x".into())),
            ("::1:5432", UnbracketedIpv6),
            ("[::1]", MissingPort),
            ("[::1:5432", BadBrackets),
            ("[::1]x:5432", BadBrackets),
            ("[]:5432", EmptyHost),
            ("a]:5", BadBrackets),
            ("/var/run/postgresql:5432", SocketPath),
        ] {
            assert_eq!(input.parse::<HostAddr>(), Err(err), "{input}");
        }
        // Every error renders as readable text.
        assert!(InvalidPort("x".into()).to_string().contains("65535"));
    }

    #[test]
    fn role_and_sync_state_text() {
        assert_eq!(Role::Primary.to_string(), "primary");
        assert_eq!(Role::Unknown.to_string(), "unknown");
        for s in ["sync", "quorum", "potential", "async"] {
            assert_eq!(SyncState::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(SyncState::parse("SYNC"), Some(SyncState::Sync));
        assert_eq!(SyncState::parse("bogus"), None);
    }

    #[test]
    fn lsn_parsing() {
        assert_eq!(parse_lsn("0/0"), Some(0));
        assert_eq!(parse_lsn("0/16B3748"), Some(0x16B3748));
        assert_eq!(parse_lsn("1/0"), Some(1 << 32));
        assert_eq!(parse_lsn("FFFFFFFF/FFFFFFFF"), Some(u64::MAX));
        assert_eq!(parse_lsn("ab/cd"), Some((0xab << 32) | 0xcd));
        for bad in [
            "",
            "/",
            "0/",
            "/0",
            "1",
            "123456789/0",
            "0/x",
            "0/1/2",
            " 0/1",
            "+1/0",
        ] {
            assert_eq!(parse_lsn(bad), None, "{bad}");
        }
    }

    #[test]
    fn lag_limit() {
        let l = LagLimit {
            bytes: Some(100),
            time: Some(Duration::from_secs(5)),
        };
        assert!(!l.exceeded(None, None));
        assert!(!l.exceeded(Some(100), Some(Duration::from_secs(5))));
        assert!(l.exceeded(Some(101), None));
        assert!(l.exceeded(None, Some(Duration::from_millis(5001))));
        assert!(!LagLimit::default().exceeded(Some(u64::MAX), Some(Duration::MAX)));
    }

    #[test]
    fn tags_ignore_case() {
        let mut h = HostConfig::new(HostAddr::new("a", 1));
        h.tags.push("NoLoadBalance".into());
        assert!(h.has_tag("noloadbalance"));
        assert!(!h.has_tag("offline"));
    }
}
