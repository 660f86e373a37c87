//! Standby clusters: a whole cluster that replicates from a PostgreSQL
//! outside it (another data centre's primary, typically), as Patroni's
//! `standby_cluster` does.
//!
//! The member holding the leader key is the *standby leader*: it stays in
//! recovery and streams from the remote source, and the other members
//! stream from it. Elections, switchovers and failovers work as usual, but
//! nobody is promoted; taking `standby_cluster` out of the dynamic
//! configuration promotes the standby leader, which turns the standby
//! cluster into an ordinary one.

use serde::{Deserialize, Serialize};

/// Where a standby cluster's leader streams from, or reads the archive of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandbyCluster {
    /// Host name or address of the remote source; `None` for a cluster
    /// that follows the source's WAL archive alone (`restore_command`),
    /// where the sites share no network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Its port.
    #[serde(default = "default_port")]
    pub port: u16,
    /// A physical slot on the source for the standby leader to stream
    /// through, created there by the first clone when missing. Without one
    /// the source may recycle WAL the standby cluster still needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary_slot_name: Option<String>,
    /// The standby leader's `restore_command`: how it fetches the source's
    /// archived WAL when streaming fails or falls behind what the source
    /// still keeps. Only the standby leader uses it; replicas stream from
    /// it, and a promoted standby leader drops it, so that no member ever
    /// replays another cluster's archive after its own history forked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_command: Option<String>,
    /// The standby leader's `archive_cleanup_command` (e.g.
    /// `pg_archivecleanup`), run at every restart point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive_cleanup_command: Option<String>,
    /// How the standby leader gets its data from the source, tried in order
    /// (Patroni's key of the same name): `basebackup`, or the names of the
    /// members' `replica_methods` (a backup tool's restore, which spares a
    /// base backup over the link between sites). By default `basebackup`
    /// with a `host`, else the member's own methods other than it. The
    /// cluster's other members clone the standby leader with their own
    /// `create_replica_methods`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_replica_methods: Option<Vec<String>>,
}

fn default_port() -> u16 {
    5432
}

impl StandbyCluster {
    /// Reads and checks the dynamic configuration's (or the node file's)
    /// `standby_cluster`; the error names the field and what is wrong.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, String> {
        let s: StandbyCluster =
            serde_json::from_value(value.clone()).map_err(|e| format!("standby_cluster: {e}"))?;
        s.check()?;
        Ok(s)
    }

    /// The rules serde cannot express: a source to follow, a usable host
    /// and slot name.
    pub fn check(&self) -> Result<(), String> {
        match &self.host {
            None if self.restore_command.is_none() => {
                return Err(
                    "standby_cluster: needs a host to stream from, or a restore_command \
                            to read the source's archive with"
                        .into(),
                )
            }
            None => {}
            Some(h) if h.trim().is_empty() => {
                return Err("standby_cluster.host: is empty".into());
            }
            Some(h) if h.contains(|c: char| c.is_whitespace() || c == '\'') => {
                return Err(format!(
                    "standby_cluster.host: {h:?} holds a space or a quote"
                ));
            }
            Some(_) => {}
        }
        if self.port == 0 {
            return Err("standby_cluster.port: must be 1 to 65535".into());
        }
        if let Some(slot) = &self.primary_slot_name {
            if !valid_slot_name(slot) {
                return Err(format!(
                    "standby_cluster.primary_slot_name: {slot:?} is not a slot name \
                     (1 to 63 lower-case letters, digits and '_')"
                ));
            }
        }
        if let Some(methods) = &self.create_replica_methods {
            if methods.is_empty() {
                return Err(
                    "standby_cluster.create_replica_methods: names no method; leave it out for the default"
                        .into(),
                );
            }
            for (i, m) in methods.iter().enumerate() {
                if m.trim().is_empty() {
                    return Err("standby_cluster.create_replica_methods: a name is empty".into());
                }
                if methods[..i].contains(m) {
                    return Err(format!(
                        "standby_cluster.create_replica_methods: {m:?} is listed twice"
                    ));
                }
                if m == "basebackup" && self.host.is_none() {
                    return Err(
                        "standby_cluster.create_replica_methods: basebackup needs a host to copy"
                            .into(),
                    );
                }
            }
        }
        for (key, command) in [
            ("restore_command", &self.restore_command),
            ("archive_cleanup_command", &self.archive_cleanup_command),
        ] {
            let Some(command) = command else { continue };
            if command.trim().is_empty() {
                return Err(format!("standby_cluster.{key}: is empty"));
            }
            if command.contains(['\n', '\r', '\0']) {
                return Err(format!(
                    "standby_cluster.{key}: line breaks are not allowed"
                ));
            }
        }
        Ok(())
    }

    /// The recovery settings that belong to following this source, beyond
    /// `primary_conninfo` and `primary_slot_name`.
    pub fn recovery_settings(&self) -> std::collections::BTreeMap<String, String> {
        [
            ("restore_command", &self.restore_command),
            ("archive_cleanup_command", &self.archive_cleanup_command),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_string(), v.clone()?)))
        .collect()
    }

    /// The server to stream from, if any.
    pub fn upstream(&self) -> Option<(&str, u16)> {
        self.host.as_deref().map(|h| (h, self.port))
    }

    /// `host:port`, or what stands for the source without one, for logs
    /// and decisions.
    pub fn address(&self) -> String {
        match &self.host {
            None => "(its WAL archive)".to_string(),
            Some(h) if h.contains(':') => format!("[{h}]:{}", self.port),
            Some(h) => format!("{h}:{}", self.port),
        }
    }
}

/// PostgreSQL's rule for replication slot names.
pub fn valid_slot_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_patroni_s_form_with_a_default_port() {
        let s = StandbyCluster::from_json(&json!({"host": "10.0.0.5"})).unwrap();
        assert_eq!(s.port, 5432);
        assert_eq!(s.address(), "10.0.0.5:5432");
        let s = StandbyCluster::from_json(
            &json!({"host": "db.dc1", "port": 6543, "primary_slot_name": "dc2"}),
        )
        .unwrap();
        assert_eq!(s.primary_slot_name.as_deref(), Some("dc2"));
        assert!(s.recovery_settings().is_empty());
        assert_eq!(s.create_replica_methods, None);
        let s = StandbyCluster::from_json(
            &json!({"host": "db.dc1", "create_replica_methods": ["pgbackrest", "basebackup"]}),
        )
        .unwrap();
        assert_eq!(
            s.create_replica_methods.as_deref(),
            Some(&["pgbackrest".to_string(), "basebackup".to_string()][..])
        );
        // The archive alone.
        let s = StandbyCluster::from_json(&json!({"restore_command": "cp /a/%f %p"})).unwrap();
        assert_eq!(s.upstream(), None);
        assert_eq!(s.address(), "(its WAL archive)");
        let s = StandbyCluster::from_json(&json!({
            "host": "db.dc1",
            "restore_command": "cp /archive/%f %p",
            "archive_cleanup_command": "pg_archivecleanup /archive %r",
        }))
        .unwrap();
        assert_eq!(
            s.recovery_settings().into_iter().collect::<Vec<_>>(),
            [
                (
                    "archive_cleanup_command".to_string(),
                    "pg_archivecleanup /archive %r".to_string()
                ),
                (
                    "restore_command".to_string(),
                    "cp /archive/%f %p".to_string()
                ),
            ]
        );
    }

    #[test]
    fn bad_values_are_named() {
        for (v, want) in [
            (
                json!({"port": 5432}),
                "needs a host to stream from, or a restore_command",
            ),
            (json!({"host": ""}), "standby_cluster.host"),
            (json!({"host": "a b"}), "standby_cluster.host"),
            (json!({"host": "h", "port": 0}), "standby_cluster.port"),
            (json!({"host": "h", "port": 70000}), "standby_cluster"),
            (
                json!({"host": "h", "primary_slot_name": "Bad-Slot"}),
                "primary_slot_name",
            ),
            (
                json!({"host": "h", "restore_command": ""}),
                "restore_command",
            ),
            (
                json!({"host": "h", "archive_cleanup_command": "a\nb"}),
                "archive_cleanup_command: line breaks",
            ),
            (
                json!({"host": "h", "recovery_target": "x"}),
                "unknown field",
            ),
            (
                json!({"host": "h", "create_replica_methods": []}),
                "create_replica_methods: names no method",
            ),
            (
                json!({"host": "h", "create_replica_methods": ["a", "a"]}),
                "\"a\" is listed twice",
            ),
            (
                json!({"restore_command": "x", "create_replica_methods": ["basebackup"]}),
                "basebackup needs a host",
            ),
        ] {
            let e = StandbyCluster::from_json(&v).unwrap_err();
            assert!(e.contains(want), "{v}: {e}");
        }
    }
}
