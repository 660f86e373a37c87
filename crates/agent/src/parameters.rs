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

/// What to write into the settings file to go from the dynamic parameters
/// `old` to `new`: each changed setting with its new value, or `None` to
/// remove it. Keys in `local` are left alone; a key leaving the dynamic
/// configuration falls back to `defaults`.
pub fn changes(
    defaults: &BTreeMap<String, String>,
    local: &BTreeMap<String, String>,
    old: &BTreeMap<String, String>,
    new: &BTreeMap<String, String>,
) -> Vec<(String, Option<String>)> {
    let mut keys: Vec<&String> = old.keys().chain(new.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| !local.contains_key(*k))
        .filter_map(|k| {
            let was = old.get(k).or_else(|| defaults.get(k));
            let will = new.get(k).or_else(|| defaults.get(k));
            (was != will).then(|| (k.clone(), will.cloned()))
        })
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
    fn changes_respect_local_settings_and_fall_back_to_defaults() {
        let defaults = map(&[("wal_keep_size", "128MB")]);
        let local = map(&[("shared_buffers", "16MB")]);
        let old = map(&[("work_mem", "8MB"), ("wal_keep_size", "1GB")]);
        let new = map(&[
            ("work_mem", "16MB"),
            ("shared_buffers", "1GB"),
            ("jit", "off"),
        ]);
        assert_eq!(
            changes(&defaults, &local, &old, &new),
            vec![
                ("jit".to_string(), Some("off".to_string())),
                ("wal_keep_size".to_string(), Some("128MB".to_string())),
                ("work_mem".to_string(), Some("16MB".to_string())),
            ]
        );
        assert_eq!(
            changes(&defaults, &local, &new, &BTreeMap::new()),
            vec![("jit".to_string(), None), ("work_mem".to_string(), None)]
        );
        assert!(changes(&defaults, &local, &new, &new).is_empty());
    }
}
