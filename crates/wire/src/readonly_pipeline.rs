//! When a read-only session's pipelined messages may reach the server.
//!
//! The statement check ([`crate::readonly`]) cannot see SQL that is
//! assembled while it runs (`query_to_xml('SELECT set_' || 'config(...)')`).
//! Such SQL may turn `default_transaction_read_only` off; the server reports
//! the change just before its next ReadyForQuery, and the proxy ends the
//! session when it sees that report. What the report cannot stop is a
//! statement that already reached the server behind the one that made the
//! change and runs in a new transaction, which takes the new default:
//!
//! * a message pipelined behind a Query, Sync or FunctionCall (each ends
//!   with a ReadyForQuery, and usually with the end of a transaction); and
//! * an Execute behind an Execute of `COMMIT` (or another statement that
//!   ends a transaction) in the same extended-protocol batch: the server
//!   commits there and starts a new transaction for the next Execute, with
//!   no ReadyForQuery, and so no report, in between.
//!
//! [`ReadOnlyPipeline`] follows a session's client messages and says which
//! ones must wait until the server's ReadyForQuery has been seen (and the
//! report before it, if any, acted upon), and which are refused: anything
//! run after a transaction ended in the same batch (legitimate clients
//! rarely put two transactions in one batch; those on a read-only service
//! end theirs with a Sync).
//!
//! Only messages that run SQL wait (Query, Execute, FunctionCall). Parse,
//! Bind, Describe, Close, Sync, Flush and COPY data pass at once, so a
//! server never waits for a message held back here before it can answer:
//! the wait always ends.

use crate::message::frontend;
use crate::readonly::{ends_transaction, Violation};

/// The state of one session's pipeline on a read-only service.
#[derive(Debug, Default)]
pub struct ReadOnlyPipeline {
    /// A Query, Sync or FunctionCall has been sent whose ReadyForQuery has
    /// not come back yet.
    awaiting_ready: bool,
    /// An Execute of a statement that ends a transaction has been sent
    /// since the last Sync.
    ended_in_batch: bool,
    /// The unnamed statement ends a transaction.
    unnamed_statement: bool,
    /// Named statements that end a transaction (rarely any).
    statements: Vec<Box<[u8]>>,
    /// The unnamed portal runs a statement that ends a transaction.
    unnamed_portal: bool,
    /// Named portals that do.
    portals: Vec<Box<[u8]>>,
}

/// What to do with a client message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Send it on (and record it with [`ReadOnlyPipeline::sent`]).
    Send,
    /// Hold it, and everything after it, until the server's next
    /// ReadyForQuery has been read.
    Wait,
}

/// Whether a client message runs SQL on the server.
fn runs_sql(tag: u8) -> bool {
    matches!(
        tag,
        frontend::QUERY | frontend::EXECUTE | frontend::FUNCTION_CALL
    )
}

impl ReadOnlyPipeline {
    /// Whether the message with this tag may be sent now.
    pub fn admit(&self, tag: u8) -> Admission {
        if self.awaiting_ready && runs_sql(tag) {
            Admission::Wait
        } else {
            Admission::Send
        }
    }

    /// Whether any message is held for a ReadyForQuery.
    pub fn awaiting_ready(&self) -> bool {
        self.awaiting_ready
    }

    /// Records a client message being sent to the server (`body`: the
    /// message without its 5-byte header). An error means it must not be
    /// sent: it would run in a transaction begun after one that ended in
    /// the same batch. No message can take its place and fail there with
    /// `25006` without the client seeing replies it did not ask for, so
    /// the caller ends the session with the error instead.
    pub fn sent(&mut self, tag: u8, body: &[u8]) -> Result<(), Violation> {
        match tag {
            frontend::QUERY | frontend::FUNCTION_CALL => {
                // Outside a batch, a Query or FunctionCall runs in a
                // transaction that began after a ReadyForQuery.
                self.awaiting_ready = true;
                if self.ended_in_batch {
                    return Err(Violation::AfterTransactionEndInBatch);
                }
            }
            frontend::SYNC => {
                self.awaiting_ready = true;
                self.ended_in_batch = false;
            }
            frontend::PARSE => {
                if let Some([name, text]) = cstrs(body) {
                    let ends = ends_transaction(text);
                    set(
                        &mut self.unnamed_statement,
                        &mut self.statements,
                        name,
                        ends,
                    );
                }
            }
            frontend::BIND => {
                if let Some([portal, statement]) = cstrs(body) {
                    let ends = if statement.is_empty() {
                        self.unnamed_statement
                    } else {
                        self.statements.iter().any(|s| **s == *statement)
                    };
                    set(&mut self.unnamed_portal, &mut self.portals, portal, ends);
                }
            }
            frontend::CLOSE => {
                if let Some((&kind, rest)) = body.split_first() {
                    if let Some([name]) = cstrs(rest) {
                        match kind {
                            b'S' => set(
                                &mut self.unnamed_statement,
                                &mut self.statements,
                                name,
                                false,
                            ),
                            b'P' => set(&mut self.unnamed_portal, &mut self.portals, name, false),
                            _ => {}
                        }
                    }
                }
            }
            frontend::EXECUTE => {
                if self.ended_in_batch {
                    return Err(Violation::AfterTransactionEndInBatch);
                }
                if let Some([portal]) = cstrs(body) {
                    self.ended_in_batch = if portal.is_empty() {
                        self.unnamed_portal
                    } else {
                        self.portals.iter().any(|p| **p == *portal)
                    };
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Records a ReadyForQuery from the server, read (and the
    /// ParameterStatus messages before it checked) before anything held
    /// is sent.
    pub fn ready(&mut self) {
        self.awaiting_ready = false;
    }
}

/// Marks the statement or portal `name` as ending a transaction or not.
fn set(unnamed: &mut bool, named: &mut Vec<Box<[u8]>>, name: &[u8], ends: bool) {
    if name.is_empty() {
        *unnamed = ends;
        return;
    }
    named.retain(|n| **n != *name);
    if ends {
        named.push(name.into());
    }
}

/// The first `N` NUL-terminated strings of a message body.
fn cstrs<const N: usize>(body: &[u8]) -> Option<[&[u8]; N]> {
    let mut out = [&body[..0]; N];
    let mut rest = body;
    for slot in &mut out {
        let end = rest.iter().position(|&b| b == 0)?;
        *slot = &rest[..end];
        rest = &rest[end + 1..];
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(name: &str, sql: &str) -> Vec<u8> {
        let mut b = Vec::new();
        for part in [name, sql] {
            b.extend_from_slice(part.as_bytes());
            b.push(0);
        }
        b.extend_from_slice(&[0, 0]);
        b
    }

    fn bind(portal: &str, statement: &str) -> Vec<u8> {
        let mut b = Vec::new();
        for part in [portal, statement] {
            b.extend_from_slice(part.as_bytes());
            b.push(0);
        }
        b.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        b
    }

    fn execute(portal: &str) -> Vec<u8> {
        let mut b = portal.as_bytes().to_vec();
        b.extend_from_slice(&[0, 0, 0, 0, 0]);
        b
    }

    fn close(kind: u8, name: &str) -> Vec<u8> {
        let mut b = vec![kind];
        b.extend_from_slice(name.as_bytes());
        b.push(0);
        b
    }

    #[test]
    fn sql_behind_a_ready_for_query_waits_for_it() {
        let mut p = ReadOnlyPipeline::default();
        for tag in [frontend::QUERY, frontend::EXECUTE, frontend::FUNCTION_CALL] {
            assert_eq!(p.admit(tag), Admission::Send);
        }
        p.sent(frontend::QUERY, b"SELECT 1\0").unwrap();
        for tag in [frontend::QUERY, frontend::EXECUTE, frontend::FUNCTION_CALL] {
            assert_eq!(p.admit(tag), Admission::Wait, "{}", tag as char);
        }
        // What runs no SQL passes: the server may need it (COPY data)
        // before it can answer.
        for tag in [
            frontend::PARSE,
            frontend::BIND,
            frontend::DESCRIBE,
            frontend::CLOSE,
            frontend::SYNC,
            frontend::FLUSH,
            frontend::COPY_DATA,
            frontend::COPY_DONE,
            frontend::COPY_FAIL,
        ] {
            assert_eq!(p.admit(tag), Admission::Send, "{}", tag as char);
        }
        p.ready();
        assert_eq!(p.admit(frontend::QUERY), Admission::Send);
        // A Sync and a FunctionCall end with a ReadyForQuery too.
        for tag in [frontend::SYNC, frontend::FUNCTION_CALL] {
            p.sent(tag, b"").unwrap();
            assert_eq!(p.admit(frontend::EXECUTE), Admission::Wait);
            p.ready();
        }
        // Extended-protocol messages before their Sync do not wait.
        p.sent(frontend::PARSE, &parse("", "SELECT 1")).unwrap();
        p.sent(frontend::BIND, &bind("", "")).unwrap();
        p.sent(frontend::EXECUTE, &execute("")).unwrap();
        assert_eq!(p.admit(frontend::EXECUTE), Admission::Send);
    }

    #[test]
    fn nothing_runs_after_a_commit_in_the_same_batch() {
        let mut p = ReadOnlyPipeline::default();
        p.sent(frontend::PARSE, &parse("", "commit")).unwrap();
        p.sent(frontend::BIND, &bind("", "")).unwrap();
        p.sent(frontend::EXECUTE, &execute("")).unwrap();
        p.sent(frontend::PARSE, &parse("", "INSERT INTO t VALUES (1)"))
            .unwrap();
        p.sent(frontend::BIND, &bind("", "")).unwrap();
        assert_eq!(
            p.sent(frontend::EXECUTE, &execute("")),
            Err(Violation::AfterTransactionEndInBatch)
        );
        assert_eq!(
            p.sent(frontend::QUERY, b"SELECT 1\0"),
            Err(Violation::AfterTransactionEndInBatch)
        );
        // A Sync starts a new batch.
        p.sent(frontend::SYNC, b"").unwrap();
        p.ready();
        p.sent(frontend::BIND, &bind("", "")).unwrap();
        p.sent(frontend::EXECUTE, &execute("")).unwrap();
    }

    #[test]
    fn statements_and_portals_are_followed_by_name() {
        let mut p = ReadOnlyPipeline::default();
        // Prepared in one batch, run in a later one.
        p.sent(frontend::PARSE, &parse("c", "/* x */ ROLLBACK"))
            .unwrap();
        p.sent(frontend::PARSE, &parse("s", "ROLLBACK TO SAVEPOINT a"))
            .unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        p.ready();
        // A savepoint's rollback does not end the transaction.
        p.sent(frontend::BIND, &bind("p1", "s")).unwrap();
        p.sent(frontend::EXECUTE, &execute("p1")).unwrap();
        p.sent(frontend::EXECUTE, &execute("p1")).unwrap();
        // Portals keep the statement they were bound to.
        p.sent(frontend::BIND, &bind("p2", "c")).unwrap();
        p.sent(frontend::BIND, &bind("", "s")).unwrap();
        p.sent(frontend::EXECUTE, &execute("")).unwrap();
        p.sent(frontend::EXECUTE, &execute("p2")).unwrap();
        assert!(p.sent(frontend::EXECUTE, &execute("")).is_err());
        p.sent(frontend::SYNC, b"").unwrap();
        p.ready();
        // Closed, the names mean nothing any more.
        p.sent(frontend::CLOSE, &close(b'S', "c")).unwrap();
        p.sent(frontend::PARSE, &parse("c", "SELECT 1")).unwrap();
        p.sent(frontend::BIND, &bind("p3", "c")).unwrap();
        p.sent(frontend::CLOSE, &close(b'P', "p2")).unwrap();
        p.sent(frontend::BIND, &bind("p2", "c")).unwrap();
        for portal in ["p2", "p3", "p2"] {
            p.sent(frontend::EXECUTE, &execute(portal)).unwrap();
        }
    }

    #[test]
    fn every_statement_that_ends_a_transaction_counts() {
        for sql in [
            "COMMIT",
            "commit and chain",
            "END",
            "ABORT",
            "ROLLBACK",
            "ROLLBACK TRANSACTION",
            "PREPARE TRANSACTION 'x'",
            "(COMMIT)",
            "SELECT 1; COMMIT",
            "COMMIT;",
        ] {
            assert!(ends_transaction(sql.as_bytes()), "{sql}");
        }
        for sql in [
            "SELECT 'commit'",
            "-- commit\nSELECT 1",
            "ROLLBACK TO a",
            "ROLLBACK TRANSACTION TO SAVEPOINT a",
            "SAVEPOINT a",
            "BEGIN",
            "SELECT commit FROM t",
        ] {
            assert!(!ends_transaction(sql.as_bytes()), "{sql}");
        }
    }
}
