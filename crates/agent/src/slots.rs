//! Physical replication slots for the members (`agent.use_slots`).
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

use std::collections::{BTreeSet, HashMap};
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
                return Err(format!(
                    "slots.{name}: logical slots are not kept by pgwarden, only physical ones"
                ))
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
            (json!({"slots": {"l": {"type": "logical"}}}), "logical"),
            (json!({"slots": {"x": {"type": "other"}}}), "slots.x:"),
            (json!({"slots": {"x": 1}}), "slots.x:"),
        ] {
            let e = permanent(Some(&bad)).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
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
