//! PostgreSQL parameters from the dynamic configuration: the
//! `postgresql.parameters` object of etcd's `config` key, which
//! `PATCH /config` (and `pgwarden ctl edit-config`) changes for every
//! member at once.
//!
//! A member's own `agent.parameters` win over the dynamic ones (an explicit
//! choice for that node), and the dynamic ones over pgwarden's defaults.
//! Settings that the agent manages, or that differ from node to node,
//! cannot be set this way.

use std::collections::BTreeMap;

use serde_json::Value;

/// Settings the dynamic configuration may not set: the agent writes them
/// itself (replication, synchronous standbys) or they belong to one node
/// (addresses, files).
pub const MANAGED: [&str; 11] = [
    "listen_addresses",
    "port",
    "unix_socket_directories",
    "cluster_name",
    "primary_conninfo",
    "primary_slot_name",
    "synchronous_standby_names",
    "data_directory",
    "config_file",
    "hba_file",
    "ident_file",
];

/// The dynamic parameters in `config` (the whole `config` value), as
/// PostgreSQL reads them: strings as written, numbers in decimal, booleans
/// as `on`/`off`. An error names the offending key.
pub fn dynamic(config: Option<&Value>) -> Result<BTreeMap<String, String>, String> {
    let Some(params) = config
        .and_then(|c| c.get("postgresql"))
        .and_then(|p| p.get("parameters"))
    else {
        return Ok(BTreeMap::new());
    };
    let Value::Object(params) = params else {
        return Err("postgresql.parameters must be an object".into());
    };
    let mut out = BTreeMap::new();
    for (k, v) in params {
        let key = format!("postgresql.parameters.{k}");
        let valid_name = k
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.');
        if !valid_name {
            return Err(format!("{key}: not a PostgreSQL parameter name"));
        }
        let lower = k.to_ascii_lowercase();
        if MANAGED.contains(&lower.as_str()) {
            return Err(format!(
                "{key}: managed by the agent or set per node, not in the dynamic configuration"
            ));
        }
        let text = match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => if *b { "on" } else { "off" }.to_string(),
            _ => return Err(format!("{key}: must be a string, number or boolean")),
        };
        if text.contains(['\n', '\r', '\0']) {
            return Err(format!("{key}: line breaks are not allowed"));
        }
        out.insert(lower, text);
    }
    Ok(out)
}

/// The settings in force for a node: pgwarden's `defaults`, overridden by
/// the `dynamic` parameters, overridden by the node's own `local` ones.
/// Keys are compared case-insensitively (as PostgreSQL does), and come out
/// in lower case.
pub fn effective(
    defaults: &BTreeMap<String, String>,
    dynamic: &BTreeMap<String, String>,
    local: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for layer in [defaults, dynamic, local] {
        for (k, v) in layer {
            out.insert(k.to_ascii_lowercase(), v.clone());
        }
    }
    out
}

/// What to write into the settings file to go from the settings `before`
/// to `after`: each changed one with its new value, or `None` to remove it.
pub fn changes(
    before: &BTreeMap<String, String>,
    after: &BTreeMap<String, String>,
) -> Vec<(String, Option<String>)> {
    let mut keys: Vec<&String> = before.keys().chain(after.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| before.get(*k) != after.get(*k))
        .map(|k| (k.clone(), after.get(k).cloned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn values_read_as_postgresql_reads_them() {
        let c = json!({"pause": true, "postgresql": {"parameters": {
            "work_mem": "8MB", "max_connections": 200, "jit": false, "Log_Statement": "ddl"
        }}});
        assert_eq!(
            dynamic(Some(&c)).unwrap(),
            map(&[
                ("jit", "off"),
                ("log_statement", "ddl"),
                ("max_connections", "200"),
                ("work_mem", "8MB")
            ])
        );
        assert!(dynamic(None).unwrap().is_empty());
        assert!(dynamic(Some(&json!({"pause": false}))).unwrap().is_empty());
    }

    #[test]
    fn bad_parameters_are_refused_by_key() {
        for (bad, why) in [
            (json!({"port": 5433}), "postgresql.parameters.port: managed"),
            (
                json!({"Synchronous_Standby_Names": "*"}),
                "Synchronous_Standby_Names: managed",
            ),
            (json!({"work_mem": {"a": 1}}), "work_mem: must be"),
            (json!({"work_mem": null}), "work_mem: must be"),
            (json!({"1abc": "x"}), "not a PostgreSQL parameter name"),
            (json!({"a b": "x"}), "not a PostgreSQL parameter name"),
            (json!({"work_mem": "1MB\nport = 1"}), "line breaks"),
        ] {
            let c = json!({"postgresql": {"parameters": bad}});
            let e = dynamic(Some(&c)).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let e = dynamic(Some(&json!({"postgresql": {"parameters": [1]}}))).unwrap_err();
        assert!(e.contains("must be an object"), "{e}");
    }

    #[test]
    fn local_settings_win_and_removed_ones_fall_back_to_defaults() {
        let defaults = map(&[("wal_keep_size", "128MB")]);
        let local = map(&[("Shared_Buffers", "16MB")]);
        let old = map(&[("work_mem", "8MB"), ("wal_keep_size", "1GB")]);
        let new = map(&[
            ("work_mem", "16MB"),
            ("shared_buffers", "1GB"),
            ("jit", "off"),
        ]);
        let before = effective(&defaults, &old, &local);
        let after = effective(&defaults, &new, &local);
        assert_eq!(after["shared_buffers"], "16MB");
        assert_eq!(
            changes(&before, &after),
            vec![
                ("jit".to_string(), Some("off".to_string())),
                ("wal_keep_size".to_string(), Some("128MB".to_string())),
                ("work_mem".to_string(), Some("16MB".to_string())),
            ]
        );
        let none = effective(&defaults, &BTreeMap::new(), &local);
        assert_eq!(
            changes(&after, &none),
            vec![("jit".to_string(), None), ("work_mem".to_string(), None)]
        );
        assert!(changes(&after, &after).is_empty());
        // A local setting dropped from the node's file: the dynamic one
        // takes over.
        let after_reload = effective(&defaults, &new, &BTreeMap::new());
        assert_eq!(
            changes(&after, &after_reload),
            vec![("shared_buffers".to_string(), Some("1GB".to_string()))]
        );
    }
}
