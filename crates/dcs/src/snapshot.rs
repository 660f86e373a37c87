//! The cluster as read from the store in one request, and the values kept
//! in its keys.
//!
//! Decoding is separate from IO so that it can be tested without etcd, and
//! it never fails as a whole: one member publishing garbage must not blind
//! every agent to the rest of the cluster, so a key that does not decode is
//! skipped and named in [`ClusterSnapshot::malformed`].

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::keys::KeyLayout;

/// An etcd lease, the liveness token keys are bound to: when it is not
/// renewed within its TTL, etcd deletes every key attached to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // etcdctl prints lease ids in hex; matching it makes logs greppable
        // against `etcdctl lease list`.
        write!(f, "{:x}", self.0)
    }
}

/// The leader key as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderKey {
    /// The member name stored in the key.
    pub name: String,
    /// The lease the key is bound to; an agent holds leadership only if this
    /// is its own current lease, not merely if the name is its own.
    pub lease: LeaseId,
    /// Time left on that lease at the time of the read, at etcd's one-second
    /// granularity; `None` when the key has no lease (written by hand) or the
    /// lease is unknown to etcd. Zero means the key is about to vanish.
    pub ttl_left: Option<Duration>,
    /// The key's create revision, which numbers leaderships: every
    /// acquisition creates the key anew, renewals leave it unchanged.
    pub generation: i64,
}

/// One promotion, as kept in the `history` key.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HistoryEntry {
    /// The timeline the promotion ended (the new one is one higher).
    pub timeline: u32,
    /// The WAL position at which the old timeline ended.
    pub lsn: u64,
    /// Why it happened, in words, e.g. "switchover requested by operator".
    pub reason: String,
    /// When it happened, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The member promoted.
    pub leader: String,
}

/// Everything stored for one cluster, read at one etcd revision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterSnapshot {
    /// The etcd revision the keys were read at; every value in the snapshot
    /// is from this one point in time.
    pub revision: i64,
    /// The database system identifier, once a bootstrap has claimed the
    /// cluster.
    pub initialize: Option<String>,
    /// The leader key, if present.
    pub leader: Option<LeaderKey>,
    /// Published member states, ordered by name.
    pub members: Vec<(String, Value)>,
    /// Dynamic settings.
    pub config: Option<Value>,
    /// The `config` key's modification revision (zero when absent), for
    /// [`EtcdDcs::compare_and_put_config`](crate::EtcdDcs::compare_and_put_config).
    pub config_revision: i64,
    /// Promotions, oldest first.
    pub history: Vec<HistoryEntry>,
    /// A pending switchover or failover request.
    pub failover: Option<Value>,
    /// The `failover` key's modification revision (zero when absent), for
    /// [`EtcdDcs::delete_failover_if`](crate::EtcdDcs::delete_failover_if).
    pub failover_revision: i64,
    /// Synchronous replication state.
    pub sync: Option<Value>,
    /// The leader's last published WAL position.
    pub status: Option<Value>,
    /// Keys that were present but could not be decoded, and were left out.
    pub malformed: Vec<String>,
}

/// One key as returned by a range read: key, value, lease, mod revision.
pub(crate) struct RawKv<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub lease: i64,
    pub mod_revision: i64,
    pub create_revision: i64,
}

impl ClusterSnapshot {
    /// Builds a snapshot from the keys of a prefix read. The leader's lease
    /// TTL is not part of the keys and is left `None`.
    pub(crate) fn from_kvs<'a>(
        layout: &KeyLayout,
        revision: i64,
        kvs: impl IntoIterator<Item = RawKv<'a>>,
    ) -> Self {
        let mut s = ClusterSnapshot {
            revision,
            ..ClusterSnapshot::default()
        };
        for kv in kvs {
            let key = String::from_utf8_lossy(kv.key);
            let Some(rel) = layout.relative(&key) else {
                continue;
            };
            let ok = match rel {
                "initialize" => text(kv.value).map(|t| s.initialize = Some(t)),
                "leader" => text(kv.value).map(|name| {
                    s.leader = Some(LeaderKey {
                        name,
                        lease: LeaseId(kv.lease),
                        ttl_left: None,
                        generation: kv.create_revision,
                    })
                }),
                "config" => json(kv.value).map(|v| {
                    s.config = Some(v);
                    s.config_revision = kv.mod_revision;
                }),
                "history" => serde_json::from_slice(kv.value).ok().map(|h| s.history = h),
                "failover" => json(kv.value).map(|v| {
                    s.failover = Some(v);
                    s.failover_revision = kv.mod_revision;
                }),
                "sync" => json(kv.value).map(|v| s.sync = Some(v)),
                "status" => json(kv.value).map(|v| s.status = Some(v)),
                other => match other.strip_prefix("members/") {
                    Some(name) if !name.is_empty() && !name.contains('/') => {
                        json(kv.value).map(|v| s.members.push((name.to_string(), v)))
                    }
                    // Keys of ours we do not know (a newer version's, or
                    // written by hand) are none of this version's business.
                    _ => Some(()),
                },
            };
            if ok.is_none() {
                tracing::warn!(key = %key, "skipping malformed DCS key");
                s.malformed.push(key.into_owned());
            }
        }
        s.members.sort_by(|a, b| a.0.cmp(&b.0));
        s
    }

    /// The published state of one member.
    pub fn member(&self, name: &str) -> Option<&Value> {
        self.members.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

fn text(v: &[u8]) -> Option<String> {
    String::from_utf8(v.to_vec()).ok()
}

fn json(v: &[u8]) -> Option<Value> {
    serde_json::from_slice(v).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv<'a>(key: &'a str, value: &'a str, lease: i64) -> RawKv<'a> {
        RawKv {
            key: key.as_bytes(),
            value: value.as_bytes(),
            lease,
            mod_revision: 7,
            create_revision: 3,
        }
    }

    #[test]
    fn decodes_every_known_key() {
        let l = KeyLayout::new("pgwarden", "c").unwrap();
        let s = ClusterSnapshot::from_kvs(
            &l,
            42,
            [
                kv("/pgwarden/c/initialize", "7301", 0),
                kv("/pgwarden/c/leader", "n1", 99),
                kv("/pgwarden/c/members/n2", r#"{"role":"replica"}"#, 5),
                kv("/pgwarden/c/members/n1", r#"{"role":"primary"}"#, 99),
                kv("/pgwarden/c/config", r#"{"ttl":30}"#, 0),
                kv(
                    "/pgwarden/c/history",
                    r#"[{"timeline":1,"lsn":100,"reason":"x"}]"#,
                    0,
                ),
                kv("/pgwarden/c/failover", r#"{"candidate":"n2"}"#, 0),
                kv("/pgwarden/c/sync", r#"{"leader":"n1"}"#, 0),
                kv("/pgwarden/c/status", r#"{"optime":5}"#, 0),
                kv("/pgwarden/c/something-new", "whatever", 0),
            ],
        );
        assert_eq!(s.revision, 42);
        assert_eq!(s.initialize.as_deref(), Some("7301"));
        let leader = s.leader.as_ref().unwrap();
        assert_eq!((leader.name.as_str(), leader.lease), ("n1", LeaseId(99)));
        let names: Vec<_> = s.members.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["n1", "n2"]);
        assert_eq!(s.member("n2").unwrap()["role"], "replica");
        assert_eq!(s.config.as_ref().unwrap()["ttl"], 30);
        assert_eq!(s.config_revision, 7);
        assert_eq!(s.history[0].lsn, 100);
        assert_eq!(s.history[0].leader, "");
        assert!(s.failover.is_some() && s.sync.is_some() && s.status.is_some());
        assert_eq!(s.failover_revision, 7);
        assert!(s.malformed.is_empty());
    }

    #[test]
    fn garbage_in_one_key_leaves_the_rest_readable() {
        let l = KeyLayout::new("pgwarden", "c").unwrap();
        let s = ClusterSnapshot::from_kvs(
            &l,
            1,
            [
                kv("/pgwarden/c/members/bad", "{not json", 1),
                kv("/pgwarden/c/members/good", "{}", 1),
                kv("/pgwarden/c/history", r#"{"not":"a list"}"#, 0),
                RawKv {
                    key: b"/pgwarden/c/leader",
                    value: &[0xff, 0xfe],
                    lease: 1,
                    mod_revision: 1,
                    create_revision: 1,
                },
                kv("/pgwarden/other/leader", "n9", 1),
            ],
        );
        assert_eq!(s.members.len(), 1);
        assert!(s.leader.is_none());
        assert!(s.history.is_empty());
        assert_eq!(
            s.malformed,
            [
                "/pgwarden/c/members/bad",
                "/pgwarden/c/history",
                "/pgwarden/c/leader"
            ]
        );
    }

    #[test]
    fn lease_ids_print_like_etcdctl() {
        assert_eq!(
            LeaseId(0x694d_7a3c_1f2b_0a11).to_string(),
            "694d7a3c1f2b0a11"
        );
    }
}
