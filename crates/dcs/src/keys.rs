//! Where each piece of cluster state lives in etcd.
//!
//! Everything a cluster stores sits under one prefix,
//! `/{namespace}/{cluster}/`, so several clusters (and several products
//! using other namespaces) can share one etcd, and one range read returns a
//! whole cluster.

use crate::error::{DcsError, Result};

/// The namespace used when the configuration names none.
pub const DEFAULT_NAMESPACE: &str = "pgwarden";

/// The keys of one cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyLayout {
    /// `/{namespace}/{cluster}/`, always ending in a slash so that cluster
    /// `c1` never matches the keys of cluster `c10` in a prefix read.
    prefix: String,
}

impl KeyLayout {
    /// The layout for `cluster` under `namespace`. Surrounding slashes of the
    /// namespace are ignored, so Patroni-style `/service` works too.
    pub fn new(namespace: &str, cluster: &str) -> Result<Self> {
        let namespace = namespace.trim_matches('/');
        check_segment("namespace", namespace)?;
        check_segment("cluster", cluster)?;
        Ok(KeyLayout {
            prefix: format!("/{namespace}/{cluster}/"),
        })
    }

    /// The prefix every key of this cluster starts with.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The bootstrap race key; holds the database system identifier.
    pub fn initialize(&self) -> String {
        self.key("initialize")
    }

    /// The leader key; holds the leader's member name, bound to its lease.
    pub fn leader(&self) -> String {
        self.key("leader")
    }

    /// Dynamic cluster settings (JSON).
    pub fn config(&self) -> String {
        self.key("config")
    }

    /// Promotion history (JSON array).
    pub fn history(&self) -> String {
        self.key("history")
    }

    /// A pending switchover or failover request (JSON).
    pub fn failover(&self) -> String {
        self.key("failover")
    }

    /// Synchronous replication state (JSON).
    pub fn sync(&self) -> String {
        self.key("sync")
    }

    /// The leader's last published WAL position (JSON).
    pub fn status(&self) -> String {
        self.key("status")
    }

    /// The prefix of all member keys.
    pub fn members_prefix(&self) -> String {
        self.key("members/")
    }

    /// The key of one member's published state.
    pub fn member(&self, name: &str) -> Result<String> {
        check_member(name)?;
        Ok(format!("{}members/{name}", self.prefix))
    }

    /// The part of `key` after this cluster's prefix, if it is one of ours.
    pub fn relative<'k>(&self, key: &'k str) -> Option<&'k str> {
        key.strip_prefix(&self.prefix)
    }

    fn key(&self, rel: &str) -> String {
        format!("{}{rel}", self.prefix)
    }
}

/// Rejects member names that would not round-trip through a key: a slash
/// would nest the key below another member's and hide it from the listing.
pub(crate) fn check_member(name: &str) -> Result<()> {
    check_segment("member", name)
}

fn check_segment(what: &'static str, value: &str) -> Result<()> {
    let reason = if value.is_empty() {
        "must not be empty"
    } else if value.contains('/') {
        "must not contain '/'"
    } else if value.chars().any(char::is_control) {
        "must not contain control characters"
    } else {
        return Ok(());
    };
    Err(DcsError::InvalidName {
        what,
        value: value.into(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sit_under_namespace_and_cluster() {
        let k = KeyLayout::new(DEFAULT_NAMESPACE, "main").unwrap();
        assert_eq!(k.prefix(), "/pgwarden/main/");
        assert_eq!(k.leader(), "/pgwarden/main/leader");
        assert_eq!(k.initialize(), "/pgwarden/main/initialize");
        assert_eq!(k.member("n1").unwrap(), "/pgwarden/main/members/n1");
        assert_eq!(k.members_prefix(), "/pgwarden/main/members/");
        assert_eq!(k.relative("/pgwarden/main/sync"), Some("sync"));
        assert_eq!(k.relative("/pgwarden/main2/sync"), None);
    }

    #[test]
    fn patroni_style_namespace_is_accepted() {
        let k = KeyLayout::new("/service/", "c").unwrap();
        assert_eq!(k.status(), "/service/c/status");
    }

    #[test]
    fn names_that_break_the_layout_are_rejected() {
        for (ns, cluster) in [
            ("", "c"),
            ("a/b", "c"),
            ("ns", ""),
            ("ns", "c/d"),
            ("ns", "c\n"),
        ] {
            assert!(
                matches!(
                    KeyLayout::new(ns, cluster),
                    Err(DcsError::InvalidName { .. })
                ),
                "{ns:?} {cluster:?}"
            );
        }
        let k = KeyLayout::new("ns", "c").unwrap();
        assert!(k.member("").is_err());
        assert!(k.member("a/b").is_err());
    }
}
