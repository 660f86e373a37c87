//! Whether a member's data directory holds the cluster's database.
//!
//! The DCS's `initialize` key records the system identifier of the
//! database the cluster was created with: the number PostgreSQL writes into
//! `pg_control` at initdb and that every physical copy (a base backup, a
//! streaming replica) keeps. A data directory with another identifier is
//! another database, restored from the wrong backup or pointed at the wrong
//! cluster. It can neither follow the leader (streaming refuses it) nor be
//! allowed to lead (the cluster's endpoints would serve a different
//! database), so its agent must refuse to start it.
//!
//! While the cluster is being created, the key holds a claim placeholder
//! (see [`claim`]) until the member that runs initdb knows the identifier.

/// How the `initialize` key's value starts while a member creates the
/// cluster.
pub const CLAIM_PREFIX: &str = "claim:";

/// The `initialize` value with which `member` claims the right to create
/// the cluster.
pub fn claim(member: &str) -> String {
    format!("{CLAIM_PREFIX}{member}")
}

/// The outcome of comparing the recorded identifier with the local one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The data directory holds the cluster's database.
    Matches,
    /// Nothing usable is recorded (no key, an empty value, or this member's
    /// own claim from a creation it did not finish): this member records
    /// its identifier, replacing `previous` atomically.
    Record {
        /// The value to replace; `None` when the key does not exist.
        previous: Option<String>,
    },
    /// Another member is creating the cluster; its identifier is not known
    /// yet.
    Pending {
        /// The member that holds the claim.
        member: String,
    },
    /// The local identifier could not be read, so nothing can be compared.
    Unreadable,
    /// The data directory holds another database.
    Mismatch {
        /// The data directory's identifier.
        local: String,
        /// The cluster's identifier.
        recorded: String,
    },
}

/// Compares the `initialize` key's value `recorded` with the system
/// identifier `local` read from `member`'s data directory.
pub fn check(recorded: Option<&str>, local: Option<&str>, member: &str) -> Identity {
    let Some(local) = local.map(str::trim).filter(|l| !l.is_empty()) else {
        return Identity::Unreadable;
    };
    let Some(value) = recorded else {
        return Identity::Record { previous: None };
    };
    let trimmed = value.trim();
    if trimmed.is_empty() {
        return Identity::Record {
            previous: Some(value.to_string()),
        };
    }
    if let Some(claimant) = trimmed.strip_prefix(CLAIM_PREFIX) {
        return if claimant == member {
            Identity::Record {
                previous: Some(value.to_string()),
            }
        } else {
            Identity::Pending {
                member: claimant.to_string(),
            }
        };
    }
    if trimmed == local {
        Identity::Matches
    } else {
        Identity::Mismatch {
            local: local.to_string(),
            recorded: trimmed.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "7301234567890123456";
    const B: &str = "7309876543210987654";

    #[test]
    fn the_same_identifier_matches() {
        assert_eq!(check(Some(A), Some(A), "n1"), Identity::Matches);
        // pg_controldata pads its values; etcd values are written trimmed.
        assert_eq!(
            check(Some(A), Some(&format!("  {A}\n")), "n1"),
            Identity::Matches
        );
    }

    #[test]
    fn another_identifier_is_another_database() {
        assert_eq!(
            check(Some(A), Some(B), "n1"),
            Identity::Mismatch {
                local: B.into(),
                recorded: A.into()
            }
        );
    }

    #[test]
    fn nothing_recorded_is_recorded_by_the_member_with_data() {
        assert_eq!(
            check(None, Some(A), "n1"),
            Identity::Record { previous: None }
        );
        assert_eq!(
            check(Some(""), Some(A), "n1"),
            Identity::Record {
                previous: Some(String::new())
            }
        );
    }

    #[test]
    fn a_claim_waits_unless_it_is_this_members_own() {
        assert_eq!(
            check(Some(&claim("n2")), Some(A), "n1"),
            Identity::Pending {
                member: "n2".into()
            }
        );
        assert_eq!(
            check(Some(&claim("n1")), Some(A), "n1"),
            Identity::Record {
                previous: Some(claim("n1"))
            }
        );
    }

    #[test]
    fn an_unreadable_local_identifier_cannot_be_compared() {
        assert_eq!(check(Some(A), None, "n1"), Identity::Unreadable);
        assert_eq!(check(Some(A), Some(" "), "n1"), Identity::Unreadable);
        assert_eq!(check(None, None, "n1"), Identity::Unreadable);
    }
}
