//! Replication slots: the members' physical ones (`agent.use_slots`), and
//! permanent slots for consumers outside the cluster, physical or logical.
//!
//! Every member keeps a slot for each member that streams from it (the
//! leader for most, a replica for one that cascades from it with
//! `replicatefrom`), so WAL a replica has not received yet stays upstream
//! while the replica lags behind or reconnects, instead of being recycled
//! once `wal_keep_size` is exceeded (which would leave the replica needing
//! a new clone). Each replica streams through its own slot
//! (`primary_slot_name`) and publishes it with its upstream; a new member
//! creates it when it clones the leader (`pg_basebackup --create-slot`).
//!
//! Only slots named with [`PREFIX`] are pgwarden's: an operator's own
//! slots (a backup tool's, say) are never touched. A slot of ours that no
//! member needs, and that nothing streams from, is dropped once it has
//! been so for a grace period: WAL kept for a member that will not come
//! back would fill the leader's disk.
//!
//! Permanent logical slots (a CDC tool's) survive a failover: the leader
//! creates them and publishes how far each consumer has confirmed; each
//! replica gets a copy of the slot's state file from the leader (PostgreSQL
//! 15 cannot create a logical slot on a standby, but loads one it finds at
//! start-up), then moves it forward to the published position with
//! `pg_replication_slot_advance`. `hot_standby_feedback` keeps the catalog
//! rows the slot still needs on the leader. After a promotion the consumer
//! continues from the copy, receiving again at most what it received since
//! the last published position.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// The prefix of every slot pgwarden manages.
pub const PREFIX: &str = "pgwarden_";

/// The slot of member `name`: [`PREFIX`], then the name in lower case with
/// every character a slot name cannot hold (`-`, `.`) as `_`, at most 63
/// bytes in all. Names that differ only there share a slot name.
pub fn slot_name(member: &str) -> String {
    let mut s = String::from(PREFIX);
    for c in member.chars() {
        let c = c.to_ascii_lowercase();
        s.push(if c.is_ascii_lowercase() || c.is_ascii_digit() {
            c
        } else {
            '_'
        });
    }
    s.truncate(63);
    s
}

/// The permanent slots of the dynamic configuration, Patroni's form:
/// `"slots": {"name": {"type": "physical"}}` (the type may be left out).
/// The leader keeps them, whoever leads, for consumers outside the cluster
/// (`pg_receivewal`, a backup tool). An error names the offending slot.
pub fn permanent(config: Option<&serde_json::Value>) -> Result<BTreeSet<String>, String> {
    let Some(slots) = config.and_then(|c| c.get("slots")).filter(|v| !v.is_null()) else {
        return Ok(BTreeSet::new());
    };
    let serde_json::Value::Object(slots) = slots else {
        return Err("slots: must be an object of slot names".into());
    };
    let mut out = BTreeSet::new();
    for (name, spec) in slots {
        let valid = !name.is_empty()
            && name.len() <= 63
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !valid {
            return Err(format!(
                "slots.{name}: a slot name is 1 to 63 lower-case letters, digits and _"
            ));
        }
        if name.starts_with(PREFIX) {
            return Err(format!(
                "slots.{name}: names starting with {PREFIX} are the members' slots"
            ));
        }
        match spec.get("type").and_then(|t| t.as_str()) {
            None | Some("physical") if spec.is_object() || spec.is_null() => {}
            Some("logical") => {
                logical_slot(name, spec)?;
                continue;
            }
            _ => {
                return Err(format!(
                    "slots.{name}: must be an object such as {{\"type\": \"physical\"}}"
                ))
            }
        }
        out.insert(name.clone());
    }
    Ok(out)
}

/// A permanent logical slot: the database it decodes and its output
/// plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogicalSlot {
    /// The database the slot belongs to.
    pub database: String,
    /// The output plugin (`pgoutput`, `wal2json`, `test_decoding`, ...).
    pub plugin: String,
}

/// The permanent logical slots of the dynamic configuration, Patroni's
/// form: `"slots": {"cdc": {"type": "logical", "database": "app",
/// "plugin": "pgoutput"}}`. Physical ones are [`permanent`]'s.
pub fn permanent_logical(
    config: Option<&serde_json::Value>,
) -> Result<BTreeMap<String, LogicalSlot>, String> {
    permanent(config)?;
    let mut out = BTreeMap::new();
    if let Some(serde_json::Value::Object(slots)) = config.and_then(|c| c.get("slots")) {
        for (name, spec) in slots {
            if spec.get("type").and_then(|t| t.as_str()) == Some("logical") {
                out.insert(name.clone(), logical_slot(name, spec)?);
            }
        }
    }
    Ok(out)
}

fn logical_slot(name: &str, spec: &serde_json::Value) -> Result<LogicalSlot, String> {
    let field = |key: &str| {
        spec.get(key)
            .and_then(|v| v.as_str())
            .filter(|v| !v.is_empty())
            .map(str::to_string)
            .ok_or_else(|| format!("slots.{name}.{key}: a logical slot needs one (a string)"))
    };
    let (database, plugin) = (field("database")?, field("plugin")?);
    // Both go into SQL as literals and the plugin names a library.
    if database.contains(['\'', '\0']) {
        return Err(format!("slots.{name}.database: {database:?} holds a quote"));
    }
    if !plugin
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(format!(
            "slots.{name}.plugin: {plugin:?} is not a plugin name (letters, digits, _ and -)"
        ));
    }
    if let Some(extra) = spec.as_object().and_then(|o| {
        o.keys()
            .find(|k| !["type", "database", "plugin"].contains(&k.as_str()))
    }) {
        return Err(format!("slots.{name}.{extra}: unknown key"));
    }
    Ok(LogicalSlot { database, plugin })
}

/// What a replica does about the permanent logical slots this loop.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogicalPlan {
    /// Slots to copy from the leader (missing here, published there).
    pub copy: Vec<String>,
    /// Slots to move forward: name, its database, and the position.
    pub advance: Vec<(String, String, u64)>,
}

/// Compares the replica's `local` logical slots (name → confirmed
/// position) with the `wanted` ones and the positions the leader
/// `published`. A slot is copied only once the leader has published it
/// (it exists there), and advanced no further than this replica has
/// `replayed`, since a slot cannot point past the WAL it has.
pub fn logical_plan(
    wanted: &BTreeMap<String, LogicalSlot>,
    local: &BTreeMap<String, Option<u64>>,
    published: &BTreeMap<String, u64>,
    replayed: Option<u64>,
) -> LogicalPlan {
    let mut out = LogicalPlan::default();
    for (name, slot) in wanted {
        let Some(&at) = published.get(name) else {
            continue;
        };
        match local.get(name) {
            None => out.copy.push(name.clone()),
            Some(confirmed) => {
                let target = replayed.map_or(at, |r| at.min(r));
                if confirmed.is_none_or(|c| c < target) {
                    out.advance
                        .push((name.clone(), slot.database.clone(), target));
                }
            }
        }
    }
    out
}

/// Whether transaction id `a` is `b` or older, wraparound included, as
/// PostgreSQL compares them.
fn xid_not_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) <= 0
}

/// Whether a replica's copy of a logical slot is safe to decode from after
/// a failover: the catalog rows it needs are kept on the leader. That holds
/// once the leader's slot for this replica carries the replica's
/// `catalog_xmin` (`hot_standby_feedback` arrived: `physical`), that value
/// has overtaken what the leader's own slot needed when it first arrived
/// (`leader_then`, remembered by the caller), and the copy needs nothing
/// older than it (`copy`). Patroni checks the same.
pub fn copy_ready(leader_then: u32, physical: Option<u32>, copy: Option<u32>) -> bool {
    match (physical, copy) {
        (Some(p), Some(c)) => xid_not_after(leader_then, p) && xid_not_after(p, c),
        _ => false,
    }
}

/// Whether `name` is a member's slot name as [`slot_name`] makes them: a
/// name read from another member's record goes into SQL only then.
pub fn is_member_slot(name: &str) -> bool {
    name.len() <= 63
        && name.len() > PREFIX.len()
        && name.starts_with(PREFIX)
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// What to change: slots to create and to drop.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotPlan {
    /// Missing slots that a member needs.
    pub create: Vec<String>,
    /// Our slots that nobody has needed for the grace period.
    pub drop: Vec<String>,
}

/// Compares our `existing` slots (name, whether something streams from it)
/// with the `wanted` ones. `unwanted` records since when each slot has
/// been neither wanted nor active; it is updated here.
pub fn plan(
    existing: &[(String, bool)],
    wanted: &BTreeSet<String>,
    unwanted: &mut HashMap<String, Instant>,
    now: Instant,
    grace: Duration,
) -> SlotPlan {
    let mut out = SlotPlan::default();
    let have: BTreeSet<&str> = existing.iter().map(|(n, _)| n.as_str()).collect();
    out.create = wanted
        .iter()
        .filter(|w| !have.contains(w.as_str()))
        .cloned()
        .collect();
    let idle: BTreeSet<&str> = existing
        .iter()
        .filter(|(n, active)| !active && !wanted.contains(n) && n.starts_with(PREFIX))
        .map(|(n, _)| n.as_str())
        .collect();
    unwanted.retain(|n, _| idle.contains(n.as_str()));
    for n in idle {
        let since = *unwanted.entry(n.to_string()).or_insert(now);
        if now.saturating_duration_since(since) >= grace {
            out.drop.push(n.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_names_become_slot_names() {
        assert_eq!(slot_name("n1"), "pgwarden_n1");
        assert_eq!(slot_name("DB-2.east"), "pgwarden_db_2_east");
        let long = "a".repeat(63);
        assert_eq!(slot_name(&long).len(), 63);
        assert!(slot_name(&long).starts_with(PREFIX));
        for n in ["n1", "DB-2.east", &long] {
            assert!(is_member_slot(&slot_name(n)), "{n}");
        }
        for bad in ["pgwarden_", "other", "pgwarden_x'; DROP", "pgwarden_A"] {
            assert!(!is_member_slot(bad), "{bad}");
        }
    }

    #[test]
    fn permanent_slots_in_patronis_form() {
        use serde_json::json;
        let got = permanent(Some(&json!({
            "slots": {"archiver": {"type": "physical"}, "backup_2": {}},
        })))
        .unwrap();
        assert_eq!(
            got.into_iter().collect::<Vec<_>>(),
            ["archiver", "backup_2"]
        );
        assert!(permanent(None).unwrap().is_empty());
        assert!(permanent(Some(&json!({"slots": null}))).unwrap().is_empty());
        for (bad, says) in [
            (json!({"slots": ["a"]}), "slots:"),
            (json!({"slots": {"Archiver": {}}}), "slots.Archiver:"),
            (json!({"slots": {"pgwarden_n1": {}}}), "members' slots"),
            (
                json!({"slots": {"l": {"type": "logical"}}}),
                "slots.l.database",
            ),
            (json!({"slots": {"x": {"type": "other"}}}), "slots.x:"),
            (json!({"slots": {"x": 1}}), "slots.x:"),
        ] {
            let e = permanent(Some(&bad)).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn logical_slots_in_patronis_form() {
        use serde_json::json;
        let config = json!({"slots": {
            "archiver": {"type": "physical"},
            "cdc": {"type": "logical", "database": "app", "plugin": "pgoutput"},
        }});
        assert_eq!(
            permanent(Some(&config))
                .unwrap()
                .into_iter()
                .collect::<Vec<_>>(),
            ["archiver"]
        );
        let l = permanent_logical(Some(&config)).unwrap();
        assert_eq!(
            l["cdc"],
            LogicalSlot {
                database: "app".into(),
                plugin: "pgoutput".into()
            }
        );
        for (bad, says) in [
            (
                json!({"type": "logical", "plugin": "p"}),
                "slots.l.database",
            ),
            (
                json!({"type": "logical", "database": "a"}),
                "slots.l.plugin",
            ),
            (
                json!({"type": "logical", "database": "a'b", "plugin": "p"}),
                "quote",
            ),
            (
                json!({"type": "logical", "database": "a", "plugin": "p; x"}),
                "plugin name",
            ),
            (
                json!({"type": "logical", "database": "a", "plugin": "p", "x": 1}),
                "slots.l.x: unknown key",
            ),
        ] {
            let e = permanent_logical(Some(&json!({"slots": {"l": bad}}))).unwrap_err();
            assert!(e.contains(says), "{e}");
            assert!(permanent(Some(&json!({"slots": {"l": bad}}))).is_err());
        }
    }

    #[test]
    fn replicas_copy_published_slots_and_advance_them_to_what_they_replayed() {
        let slot = |db: &str| LogicalSlot {
            database: db.into(),
            plugin: "pgoutput".into(),
        };
        let wanted: BTreeMap<String, LogicalSlot> = [
            ("a".to_string(), slot("app")),
            ("b".to_string(), slot("app")),
            ("c".to_string(), slot("crm")),
            ("d".to_string(), slot("app")),
        ]
        .into();
        let local: BTreeMap<String, Option<u64>> =
            [("a".to_string(), Some(100)), ("c".to_string(), Some(500))].into();
        // b exists on the leader only; d not even there yet.
        let published: BTreeMap<String, u64> = [
            ("a".to_string(), 300),
            ("b".to_string(), 200),
            ("c".to_string(), 400),
        ]
        .into();
        let p = logical_plan(&wanted, &local, &published, Some(250));
        assert_eq!(p.copy, ["b"]);
        // a only as far as replayed; c is ahead already.
        assert_eq!(p.advance, [("a".to_string(), "app".to_string(), 250)]);
        let p = logical_plan(&wanted, &local, &published, None);
        assert_eq!(p.advance, [("a".to_string(), "app".to_string(), 300)]);
    }

    #[test]
    fn a_copy_is_ready_once_feedback_protects_what_it_needs() {
        // No feedback yet, or the copy has no catalog_xmin: not ready.
        assert!(!copy_ready(100, None, Some(120)));
        assert!(!copy_ready(100, Some(110), None));
        // Feedback holds rows from 110 on; the copy needs 120 on; the
        // leader's slot needed 100 on when feedback arrived.
        assert!(copy_ready(100, Some(110), Some(120)));
        assert!(copy_ready(110, Some(110), Some(110)));
        // Feedback behind what the leader's slot needed then, or ahead of
        // what the copy needs: rows may be gone.
        assert!(!copy_ready(115, Some(110), Some(120)));
        assert!(!copy_ready(100, Some(130), Some(120)));
        // Across wraparound.
        assert!(copy_ready(u32::MAX - 5, Some(3), Some(10)));
        assert!(!copy_ready(3, Some(u32::MAX - 5), Some(10)));
    }

    #[test]
    fn missing_slots_are_created_and_idle_ones_dropped_after_the_grace() {
        let grace = Duration::from_secs(10);
        let t0 = Instant::now();
        let wanted: BTreeSet<String> = ["pgwarden_n2", "pgwarden_n3"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let existing = vec![
            ("pgwarden_n2".to_string(), true),
            ("pgwarden_gone".to_string(), false),
            // Still streaming: kept whatever its name.
            ("pgwarden_busy".to_string(), true),
            // Not ours.
            ("barman".to_string(), false),
        ];
        let mut unwanted = HashMap::new();
        let p = plan(&existing, &wanted, &mut unwanted, t0, grace);
        assert_eq!(p.create, ["pgwarden_n3"]);
        assert!(p.drop.is_empty(), "not before the grace");
        let p = plan(&existing, &wanted, &mut unwanted, t0 + grace, grace);
        assert_eq!(p.drop, ["pgwarden_gone"]);
        // A slot that is wanted again, or streamed from, starts over.
        let mut existing = existing;
        existing[1].1 = true;
        let p = plan(&existing, &wanted, &mut unwanted, t0 + grace * 2, grace);
        assert!(p.drop.is_empty());
        existing[1].1 = false;
        let p = plan(&existing, &wanted, &mut unwanted, t0 + grace * 3, grace);
        assert!(p.drop.is_empty(), "the grace runs again");
    }
}
