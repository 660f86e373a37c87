//! What an agent publishes under `members/<name>`, and how a DCS snapshot
//! becomes the [`ClusterView`] the HA decision reads.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pgwarden_dcs::ClusterSnapshot;
use pgwarden_ha::{ClusterView, FailoverRequest, LeaderInfo, MemberRole, MemberState, SyncState};
use serde::{Deserialize, Serialize};

/// One member's published record: the fields the election reads
/// ([`MemberState`]) plus what operators, routers and `pgwarden ctl` need.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemberRecord {
    /// Role, positions, tags and API URL, as the election reads them.
    #[serde(flatten)]
    pub state: MemberState,
    /// Where clients and other members reach its PostgreSQL (`host:port`).
    pub pg_address: String,
    /// What the agent is doing with PostgreSQL: `running`, `starting`,
    /// `start failed`, `stopped`, `rewinding`, `cloning`, `initializing`,
    /// `restoring`, `reinitializing`.
    pub status: String,
    /// Wall-clock time of publication, Unix milliseconds; the age of a
    /// record is what makes a silent member ineligible.
    pub updated_ms: u64,
    /// Something that needs an operator, e.g. a failed rewind.
    pub problem: Option<String>,
    /// The leader generation this member's connection manager routes by
    /// (the leader key's create revision); 0 before it has seen a leader.
    pub routing_generation: i64,
    /// Bytes behind the leader's last published WAL position (replicas).
    pub lag_bytes: Option<u64>,
    /// Base URL of this node's connection manager's HTTP port, which a
    /// planned switchover pauses and resumes.
    pub proxy_url: Option<String>,
    /// The agent's last decision, as logged: why a member does not take
    /// over when no failover happens.
    pub decision: String,
    /// PostgreSQL has settings changed that take effect only at a restart.
    pub pending_restart: bool,
    /// A restart scheduled through the API, not yet carried out.
    pub scheduled_restart: Option<RestartOrder>,
    /// When the running postmaster started (UTC, ISO 8601): a restart
    /// changes it.
    pub postmaster_start_time: Option<String>,
    /// The replication slot it streams through as a replica
    /// (`agent.use_slots`), which its upstream keeps for it.
    pub slot: Option<String>,
    /// The member it streams from as a replica: the leader, or the one its
    /// `replicatefrom` tag names.
    pub upstream: Option<String>,
    /// As a replica: its copies of the permanent logical slots, each with
    /// whether it is safe to decode from after a failover
    /// ([`crate::slots::copy_ready`]).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub logical_slots: std::collections::BTreeMap<String, bool>,
    /// As a running standby, as Patroni reports it: `streaming` while its
    /// WAL receiver streams, else `in archive recovery` (replaying what the
    /// archive or its own `pg_wal` holds, or waiting for a source).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replication_state: Option<String>,
}

impl MemberRecord {
    /// The state `/cluster` and `ctl list` show, as Patroni does: a running
    /// standby's replication state, else what the agent is doing.
    pub fn shown_state(&self) -> &str {
        match (&self.replication_state, self.status.as_str()) {
            (Some(r), "running") => r,
            (_, s) => s,
        }
    }
}

/// A restart asked for through the API (`POST /restart`): at once or at a
/// time, and only if its conditions hold then.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RestartOrder {
    /// When, as an ISO 8601 timestamp in UTC; `None`: at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// The same instant, Unix milliseconds.
    #[serde(skip)]
    pub at_ms: Option<u64>,
    /// Only if the member is then `primary`, `standby_leader` or
    /// `replica`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Only if PostgreSQL then has settings waiting for a restart.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub restart_pending: bool,
}

impl RestartOrder {
    /// Why the order's conditions do not hold for a member in `role` (a
    /// standby cluster's leader when `standby_leader`, whatever its server
    /// reports) with (or without) `pending_restart`; `None` when they do.
    pub fn unmet(
        &self,
        role: MemberRole,
        standby_leader: bool,
        pending_restart: bool,
    ) -> Option<String> {
        if let Some(want) = &self.role {
            let role = if standby_leader {
                "standby_leader".to_string()
            } else {
                role.to_string()
            };
            if *want != role {
                return Some(format!("the member is {role}, not {want}"));
            }
        }
        if self.restart_pending && !pending_restart {
            return Some("no setting is waiting for a restart".into());
        }
        None
    }
}

/// Unix time in milliseconds.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Whether the dynamic `config` key has maintenance mode on.
pub fn paused(snapshot: &ClusterSnapshot) -> bool {
    snapshot
        .config
        .as_ref()
        .and_then(|c| c.get("pause"))
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false)
}

/// How far the consumers of the permanent logical slots have confirmed,
/// as the leader last published it (`status.slots`).
pub fn logical_positions(snapshot: &ClusterSnapshot) -> std::collections::BTreeMap<String, u64> {
    snapshot
        .status
        .as_ref()
        .and_then(|s| s.get("slots"))
        .and_then(|v| v.as_object())
        .map(|o| {
            o.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_u64()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// The dynamic configuration's `standby_cluster`, when set (and not
/// `null`): the remote source, or why it cannot be read. An unreadable one
/// still makes the cluster a standby cluster, so that a typo never
/// promotes the standby leader.
pub fn standby_cluster(
    snapshot: &ClusterSnapshot,
) -> Option<Result<pgwarden_ha::StandbyCluster, String>> {
    let v = snapshot
        .config
        .as_ref()?
        .get("standby_cluster")
        .filter(|v| !v.is_null())?;
    Some(pgwarden_ha::StandbyCluster::from_json(v))
}

/// The members the dynamic configuration fences: `"fenced": {"n3": true}`
/// (`pgwarden ctl fence n3`). A fenced member is never promoted nor made a
/// synchronous standby, and takes no read traffic; an error names what is
/// malformed.
pub fn fenced_in(config: Option<&serde_json::Value>) -> Result<BTreeSet<String>, String> {
    let Some(f) = config
        .and_then(|c| c.get("fenced"))
        .filter(|v| !v.is_null())
    else {
        return Ok(BTreeSet::new());
    };
    let serde_json::Value::Object(f) = f else {
        return Err("fenced: must be an object of member names, e.g. {\"n3\": true}".into());
    };
    let mut out = BTreeSet::new();
    for (name, v) in f {
        match v {
            serde_json::Value::Bool(true) => {
                out.insert(name.clone());
            }
            serde_json::Value::Bool(false) | serde_json::Value::Null => {}
            _ => return Err(format!("fenced.{name}: must be true or false")),
        }
    }
    Ok(out)
}

/// [`fenced_in`] of the snapshot's configuration; a malformed entry fences
/// nobody.
pub fn fenced(snapshot: &ClusterSnapshot) -> BTreeSet<String> {
    fenced_in(snapshot.config.as_ref()).unwrap_or_default()
}

/// The members' published records, skipping any that do not decode.
pub fn records(snapshot: &ClusterSnapshot) -> Vec<MemberRecord> {
    snapshot
        .members
        .iter()
        .filter_map(|(name, v)| {
            let mut r: MemberRecord = serde_json::from_value(v.clone()).ok()?;
            r.state.name = name.clone();
            Some(r)
        })
        .collect()
}

/// The HA decision's view of a snapshot read at wall-clock `now_ms`.
pub fn cluster_view(snapshot: &ClusterSnapshot, now_ms: u64) -> ClusterView {
    let sync = sync_state(snapshot);
    let claim = sync
        .as_ref()
        .map_or_else(pgwarden_ha::Claim::none, SyncState::claim);
    let fenced = fenced(snapshot);
    let members = records(snapshot)
        .into_iter()
        .map(|r| {
            let mut m = r.state;
            m.last_seen_ms_ago = now_ms.saturating_sub(r.updated_ms);
            m.streaming = r.replication_state.as_deref().map(|s| s == "streaming");
            // Whatever the member has published so far.
            m.fenced |= fenced.contains(&m.name);
            m
        })
        .collect();
    ClusterView {
        leader: snapshot.leader.as_ref().map(|l| LeaderInfo {
            name: l.name.clone(),
            lease_ttl_left: l.ttl_left,
        }),
        members,
        last_leader_lsn: snapshot
            .status
            .as_ref()
            .and_then(|s| s.get("lsn"))
            .and_then(serde_json::Value::as_u64),
        paused: paused(snapshot),
        failover_request: snapshot
            .failover
            .as_ref()
            .and_then(|v| serde_json::from_value::<FailoverRequest>(v.clone()).ok())
            .map(|r| FailoverRequest {
                age: r
                    .requested_ms
                    .map(|t| std::time::Duration::from_millis(now_ms.saturating_sub(t))),
                ..r
            }),
        // The claim's members: a key claiming nothing lets nobody be
        // promoted while it restricts promotion.
        sync_members: claim.members,
        sync_restricted: sync.as_ref().is_some_and(SyncState::restricts_promotion),
        sync_quorum: Some(claim.quorum),
        standby_cluster: standby_cluster(snapshot).map(|s| match s {
            Ok(s) => s.address(),
            Err(_) => "(unreadable standby_cluster)".to_string(),
        }),
    }
}

/// The `sync` key, if present and readable.
pub fn sync_state(snapshot: &ClusterSnapshot) -> Option<SyncState> {
    snapshot
        .sync
        .as_ref()
        .and_then(|v| serde_json::from_value(v.clone()).ok())
}

/// A duration in whole milliseconds, for JSON.
pub fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgwarden_dcs::{LeaderKey, LeaseId};
    use pgwarden_ha::MemberRole;
    use serde_json::json;

    #[test]
    fn a_running_standby_shows_its_replication_state() {
        let mut r = MemberRecord {
            status: "running".into(),
            ..MemberRecord::default()
        };
        assert_eq!(r.shown_state(), "running");
        r.replication_state = Some("streaming".into());
        assert_eq!(r.shown_state(), "streaming");
        // What the agent is doing comes first.
        r.status = "rewinding".into();
        assert_eq!(r.shown_state(), "rewinding");
        // Left out of the record when there is none, as before.
        let v = serde_json::to_value(MemberRecord::default()).unwrap();
        assert!(v.get("replication_state").is_none(), "{v}");
    }

    #[test]
    fn fenced_members_come_from_the_dynamic_configuration() {
        let got = fenced_in(Some(
            &json!({"fenced": {"n2": true, "n3": false, "n4": null}}),
        ))
        .unwrap();
        assert_eq!(got.into_iter().collect::<Vec<_>>(), ["n2"]);
        assert!(fenced_in(None).unwrap().is_empty());
        assert!(fenced_in(Some(&json!({"fenced": ["n2"]}))).is_err());
        let e = fenced_in(Some(&json!({"fenced": {"n2": "yes"}}))).unwrap_err();
        assert!(e.starts_with("fenced.n2:"), "{e}");
        // In the view, whatever the member published.
        let mut snap = ClusterSnapshot {
            config: Some(json!({"fenced": {"n2": true}})),
            ..Default::default()
        };
        let rec = MemberRecord {
            state: MemberState {
                name: "n2".into(),
                ..MemberState::default()
            },
            ..MemberRecord::default()
        };
        snap.members
            .push(("n2".into(), serde_json::to_value(&rec).unwrap()));
        assert!(cluster_view(&snap, 0).members[0].fenced);
        snap.config = None;
        assert!(!cluster_view(&snap, 0).members[0].fenced);
    }

    #[test]
    fn a_record_round_trips_and_feeds_the_view() {
        let mut state = MemberState::new("n2");
        state.received_lsn = Some(1000);
        state.timeline = 3;
        let rec = MemberRecord {
            state,
            pg_address: "127.0.0.1:5433".into(),
            status: "running".into(),
            updated_ms: 10_000,
            ..MemberRecord::default()
        };
        let v = serde_json::to_value(&rec).unwrap();
        assert_eq!(v["received_lsn"], 1000);
        assert_eq!(v["pg_address"], "127.0.0.1:5433");
        let snap = ClusterSnapshot {
            leader: Some(LeaderKey {
                name: "n1".into(),
                lease: LeaseId(7),
                ttl_left: Some(Duration::from_secs(4)),
                generation: 12,
            }),
            members: vec![("n2".into(), v), ("bad".into(), json!(42))],
            config: Some(json!({"pause": true})),
            status: Some(json!({"lsn": 2000})),
            failover: Some(json!({"candidate": "n2", "from_leader": "n1"})),
            ..ClusterSnapshot::default()
        };
        let view = cluster_view(&snap, 12_500);
        assert_eq!(view.members.len(), 1, "undecodable records are skipped");
        let m = &view.members[0];
        assert_eq!((m.name.as_str(), m.role), ("n2", MemberRole::Replica));
        assert_eq!(m.last_seen_ms_ago, 2_500);
        assert_eq!(view.last_leader_lsn, Some(2000));
        assert!(view.paused);
        assert_eq!(view.leader.unwrap().name, "n1");
        let req = view.failover_request.unwrap();
        assert_eq!(req.candidate.as_deref(), Some("n2"));
        assert_eq!(req.from_leader.as_deref(), Some("n1"));
    }
}
