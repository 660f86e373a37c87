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

use std::collections::VecDeque;

use crate::message::frontend;
use crate::readonly::{ends_transaction, Violation};

/// The state of one session's pipeline on a read-only service.
///
/// What the server holds is known only from its replies: a Parse that
/// reuses a name, or one skipped after an error earlier in its batch,
/// leaves the old statement in place. So statements are recorded as the
/// server confirms them (ParseComplete, CloseComplete), and until then a
/// statement counts as ending a transaction if either its old or its new
/// text does.
#[derive(Debug, Default)]
pub struct ReadOnlyPipeline {
    /// Replies the server still owes, oldest first.
    owed: VecDeque<Owed>,
    /// An Execute of a statement that may end a transaction has been sent
    /// since the last Sync.
    ended_in_batch: bool,
    /// A Parse, Bind, Describe, Execute or Close has been sent since the
    /// last Sync: an error there makes the server skip what follows, up
    /// to the Sync.
    in_batch: bool,
    /// Statements the server holds that end a transaction, by name (the
    /// unnamed one as `""`); rarely any.
    statements: Vec<Box<[u8]>>,
    /// Portals bound to a statement that may end a transaction. A portal
    /// ends with its transaction, and a Bind or Close of one that the
    /// server skips after an error leaves a transaction that ends before
    /// anything else runs: recorded as sent.
    portals: Vec<Box<[u8]>>,
}

/// A reply the server owes for a message sent.
#[derive(Debug)]
enum Owed {
    /// ParseComplete for a Parse of this statement, and whether its text
    /// ends a transaction.
    Parse { name: Box<[u8]>, ends: bool },
    /// CloseComplete for a Close of this statement (`None`: of a portal).
    Close { statement: Option<Box<[u8]>> },
    /// ReadyForQuery, for a Query or FunctionCall (`query`) or a Sync.
    Ready { query: bool },
    /// CloseComplete for the proxy's batch marker
    /// ([`crate::encode::batch_marker`]), sent just before the Query or
    /// FunctionCall whose `Ready` follows: should the server skip the
    /// marker, it skips that Query too.
    Marker,
}

/// What to do with a client message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Send it on (and record it with [`ReadOnlyPipeline::sent`]).
    Send,
    /// Hold it, and everything after it, until the server's ReadyForQuery
    /// messages still owed have been read.
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
    /// A session whose server has yet to answer its startup packet (the
    /// relay passes the login through): the login's ReadyForQuery is owed.
    pub fn logging_in() -> Self {
        let mut p = ReadOnlyPipeline::default();
        p.owed.push_back(Owed::Ready { query: true });
        p
    }

    /// Whether the message with this tag may be sent now.
    pub fn admit(&self, tag: u8) -> Admission {
        if runs_sql(tag) && self.awaiting_ready() {
            Admission::Wait
        } else {
            Admission::Send
        }
    }

    /// Whether a Query or FunctionCall sent now goes inside an unfinished
    /// extended-protocol batch, and so needs the batch marker
    /// ([`crate::encode::batch_marker`], recorded with
    /// [`ReadOnlyPipeline::marker_sent`]) ahead of it.
    pub fn in_batch(&self) -> bool {
        self.in_batch
    }

    /// Records the batch marker sent just before the Query or FunctionCall
    /// about to be recorded with [`ReadOnlyPipeline::sent`].
    pub fn marker_sent(&mut self) {
        self.owed.push_back(Owed::Marker);
    }

    /// Whether a ReadyForQuery is owed.
    pub fn awaiting_ready(&self) -> bool {
        self.owed.iter().any(|o| matches!(o, Owed::Ready { .. }))
    }

    /// Whether statement `name` may end a transaction: as the server
    /// holds it, or as a Parse not yet answered would make it.
    fn statement_may_end(&self, name: &[u8]) -> bool {
        self.statements.iter().any(|s| **s == *name)
            || self
                .owed
                .iter()
                .any(|o| matches!(o, Owed::Parse { name: n, ends: true } if **n == *name))
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
                if self.ended_in_batch {
                    return Err(Violation::AfterTransactionEndInBatch);
                }
                self.owed.push_back(Owed::Ready { query: true });
            }
            frontend::SYNC => {
                self.owed.push_back(Owed::Ready { query: false });
                self.ended_in_batch = false;
                self.in_batch = false;
            }
            frontend::PARSE => {
                self.in_batch = true;
                // Recorded as the server gets it: one the strict reading
                // refuses goes out as a Parse of the unnamed statement
                // with SQL that only refuses (the statement check's
                // replacement), which ends nothing. Recording the
                // client's name would forget that statement's old text.
                let owed = match crate::message::parse_message(body) {
                    Ok(p) => Owed::Parse {
                        name: server_key(p.name).into(),
                        ends: ends_transaction(p.query),
                    },
                    Err(_) => Owed::Parse {
                        name: Box::default(),
                        ends: false,
                    },
                };
                self.owed.push_back(owed);
            }
            frontend::BIND => {
                self.in_batch = true;
                if let Some([portal, statement]) = cstrs(body) {
                    let ends = self.statement_may_end(server_key(statement));
                    mark(&mut self.portals, server_key(portal), ends);
                }
            }
            frontend::CLOSE => {
                self.in_batch = true;
                if let Some((&kind, rest)) = body.split_first() {
                    if let Some([name]) = cstrs(rest) {
                        let name = server_key(name);
                        let statement = match kind {
                            b'S' => Some(name.into()),
                            _ => {
                                mark(&mut self.portals, name, false);
                                None
                            }
                        };
                        self.owed.push_back(Owed::Close { statement });
                    }
                }
            }
            frontend::DESCRIBE => self.in_batch = true,
            frontend::EXECUTE => {
                if self.ended_in_batch {
                    return Err(Violation::AfterTransactionEndInBatch);
                }
                self.in_batch = true;
                if let Some([portal]) = cstrs(body) {
                    let portal = server_key(portal);
                    self.ended_in_batch = self.portals.iter().any(|p| **p == *portal);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The server confirmed the oldest Parse not yet answered.
    pub fn parse_complete(&mut self) {
        if let Some(i) = self
            .owed
            .iter()
            .position(|o| matches!(o, Owed::Parse { .. }))
        {
            if let Some(Owed::Parse { name, ends }) = self.owed.remove(i) {
                mark(&mut self.statements, &name, ends);
            }
        }
    }

    /// The server confirmed the oldest Close not yet answered; true when
    /// that was the batch marker's, which the client must not see.
    pub fn close_complete(&mut self) -> bool {
        let Some(i) = self
            .owed
            .iter()
            .position(|o| matches!(o, Owed::Close { .. } | Owed::Marker))
        else {
            return false;
        };
        match self.owed.remove(i) {
            Some(Owed::Close {
                statement: Some(name),
            }) => mark(&mut self.statements, &name, false),
            Some(Owed::Marker) => return true,
            _ => {}
        }
        false
    }

    /// The server reported an error. It skips what is left of the batch
    /// up to its Sync: the Parse and Close messages of it not yet answered
    /// change nothing, and a Query behind a batch marker not yet answered
    /// is skipped too, with no ReadyForQuery.
    pub fn error(&mut self) {
        while let Some(front) = self.owed.front() {
            match front {
                Owed::Parse { .. } | Owed::Close { .. } => {}
                Owed::Marker => {
                    self.owed.pop_front();
                    // Its Query's Ready, which will not come.
                    if !matches!(self.owed.front(), Some(Owed::Ready { query: true })) {
                        continue;
                    }
                }
                Owed::Ready { .. } => break,
            }
            self.owed.pop_front();
        }
    }

    /// The server answered with ReadyForQuery (read, and the
    /// ParameterStatus messages before it checked, before anything held
    /// is sent).
    pub fn ready(&mut self) {
        if let Some(i) = self
            .owed
            .iter()
            .position(|o| matches!(o, Owed::Ready { .. }))
        {
            // Whatever is owed before it was not answered and will not be.
            self.owed.drain(..=i);
        }
    }

    /// The server began a COPY FROM STDIN. While it takes data it ignores
    /// Sync messages, so those sent since the COPY's Execute get no
    /// ReadyForQuery; a Query's COPY ends with the Query's.
    pub fn copy_in(&mut self) {
        let mut first = true;
        self.owed.retain(|o| match o {
            // A Query in the batch of an extended-protocol COPY is not
            // valid protocol; its marker is not waited for.
            Owed::Marker => false,
            Owed::Ready { query } => {
                let keep = first && *query;
                first = false;
                keep
            }
            _ => true,
        });
    }
}

/// A statement or portal name as the server keys it: PostgreSQL's tables
/// of both compare only the first 63 bytes (`NAMEDATALEN` - 1), so a Bind
/// of `P…2` finds the portal `P…1` when they differ only after that.
fn server_key(name: &[u8]) -> &[u8] {
    &name[..name.len().min(63)]
}

/// Adds `name` to `names` or takes it out.
fn mark(names: &mut Vec<Box<[u8]>>, name: &[u8], on: bool) {
    names.retain(|n| **n != *name);
    if on {
        names.push(name.into());
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

    /// Parse, Bind to the unnamed portal, Execute, as one would send it.
    fn run(p: &mut ReadOnlyPipeline, sql: &str) -> Result<(), Violation> {
        p.sent(frontend::PARSE, &parse("", sql))?;
        p.sent(frontend::BIND, &bind("", ""))?;
        p.sent(frontend::EXECUTE, &execute(""))
    }

    #[test]
    fn sql_behind_a_ready_for_query_waits_for_every_one_owed() {
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
        // Bare Syncs sent meanwhile are owed a ReadyForQuery each: the
        // first reply must not release what waits behind the last.
        p.sent(frontend::SYNC, b"").unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        p.ready();
        assert_eq!(p.admit(frontend::QUERY), Admission::Wait);
        p.ready();
        assert_eq!(p.admit(frontend::QUERY), Admission::Wait);
        p.ready();
        assert_eq!(p.admit(frontend::QUERY), Admission::Send);
        // A FunctionCall ends with a ReadyForQuery too.
        p.sent(frontend::FUNCTION_CALL, b"").unwrap();
        assert_eq!(p.admit(frontend::EXECUTE), Admission::Wait);
        p.ready();
        // Extended-protocol messages before their Sync do not wait.
        run(&mut p, "SELECT 1").unwrap();
        assert_eq!(p.admit(frontend::EXECUTE), Admission::Send);
    }

    /// The batch marker (see `encode::batch_marker`) tells a Query that
    /// the server skips after an error earlier in its batch, which gets
    /// no ReadyForQuery, from one that runs and gets its own.
    #[test]
    fn a_query_skipped_after_an_error_in_its_batch_is_owed_nothing() {
        for skipped in [true, false] {
            let mut p = ReadOnlyPipeline::default();
            assert!(!p.in_batch());
            run(&mut p, "SELECT 1/0").unwrap();
            assert!(p.in_batch());
            p.marker_sent();
            p.sent(frontend::QUERY, b"SELECT 1\0").unwrap();
            p.sent(frontend::CLOSE, &close(b'P', "c")).unwrap();
            p.sent(frontend::SYNC, b"").unwrap();
            assert!(!p.in_batch());
            p.parse_complete();
            if skipped {
                // The Execute failed; the server answers only the Sync.
                p.error();
            } else {
                assert!(p.close_complete(), "the marker's CloseComplete");
                p.ready();
                assert!(!p.close_complete(), "the client's Close");
            }
            p.ready();
            assert!(!p.awaiting_ready(), "skipped {skipped}: {p:?}");
            assert_eq!(p.admit(frontend::QUERY), Admission::Send);
        }
        // An error in the Query itself (its marker answered) skips
        // nothing: its ReadyForQuery and the Sync's both come.
        let mut p = ReadOnlyPipeline::default();
        run(&mut p, "SELECT 1").unwrap();
        p.marker_sent();
        p.sent(frontend::QUERY, b"SELECT 1/0\0").unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        p.parse_complete();
        assert!(p.close_complete());
        p.error();
        p.ready();
        assert!(p.awaiting_ready(), "the Sync's is still owed");
        p.ready();
        assert!(!p.awaiting_ready());
    }

    #[test]
    fn a_login_passed_through_is_waited_for() {
        let mut p = ReadOnlyPipeline::logging_in();
        assert_eq!(p.admit(frontend::QUERY), Admission::Wait);
        p.ready();
        assert_eq!(p.admit(frontend::QUERY), Admission::Send);
    }

    #[test]
    fn syncs_ignored_during_copy_in_are_not_waited_for() {
        // Extended protocol: the Sync after the Execute gets no reply.
        let mut p = ReadOnlyPipeline::default();
        run(&mut p, "COPY t FROM STDIN").unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        p.parse_complete();
        p.copy_in();
        assert_eq!(p.admit(frontend::QUERY), Admission::Send);
        p.sent(frontend::COPY_DONE, b"").unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        assert_eq!(p.admit(frontend::QUERY), Admission::Wait);
        p.ready();
        assert_eq!(p.admit(frontend::QUERY), Admission::Send);
        // A Query's COPY ends with the Query's own ReadyForQuery.
        p.sent(frontend::QUERY, b"COPY t FROM STDIN\0").unwrap();
        p.copy_in();
        assert_eq!(p.admit(frontend::QUERY), Admission::Wait);
        p.ready();
        assert_eq!(p.admit(frontend::QUERY), Admission::Send);
    }

    #[test]
    fn nothing_runs_after_a_commit_in_the_same_batch() {
        let mut p = ReadOnlyPipeline::default();
        run(&mut p, "commit").unwrap();
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
        for _ in 0..2 {
            p.parse_complete();
        }
        p.ready();
        run(&mut p, "SELECT 1").unwrap();
        run(&mut p, "SELECT 2").unwrap();
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
        p.parse_complete();
        p.parse_complete();
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
        p.error();
        p.ready();
        // Closed (as the server confirms), the names mean nothing any more.
        p.sent(frontend::CLOSE, &close(b'S', "c")).unwrap();
        p.sent(frontend::PARSE, &parse("c", "SELECT 1")).unwrap();
        p.close_complete();
        p.parse_complete();
        p.sent(frontend::BIND, &bind("p3", "c")).unwrap();
        p.sent(frontend::CLOSE, &close(b'P', "p2")).unwrap();
        p.sent(frontend::BIND, &bind("p2", "c")).unwrap();
        for portal in ["p2", "p3", "p2"] {
            p.sent(frontend::EXECUTE, &execute(portal)).unwrap();
        }
    }

    /// A session whose server holds statement `name` as `COMMIT`.
    fn with_commit(name: &str) -> ReadOnlyPipeline {
        let mut p = ReadOnlyPipeline::default();
        p.sent(frontend::PARSE, &parse(name, "COMMIT")).unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        p.parse_complete();
        p.ready();
        p
    }

    /// Names that differ only after their 63rd byte are one name to the
    /// server, for statements and portals alike.
    #[test]
    fn names_are_compared_as_the_server_cuts_them() {
        let (long1, long2) = (
            format!("{}1", "P".repeat(63)),
            format!("{}2", "P".repeat(63)),
        );
        // A portal bound to COMMIT, executed under a longer spelling.
        let mut p = with_commit("c");
        p.sent(frontend::BIND, &bind(&long1, "c")).unwrap();
        p.sent(frontend::EXECUTE, &execute(&long2)).unwrap();
        assert!(run(&mut p, "INSERT INTO t VALUES (1)").is_err());
        // A statement of COMMIT, bound under a longer spelling.
        let mut p = with_commit(&format!("{}x", "S".repeat(63)));
        assert_commit_still_runs(&mut p, &format!("{}y", "S".repeat(63)));
    }

    /// A Parse the strict reading refuses reaches the server as a Parse of
    /// the unnamed statement: the named statement keeps its old text.
    #[test]
    fn a_malformed_parse_leaves_the_named_statement_as_it_was() {
        let mut p = with_commit("x");
        let mut broken = parse("x", "SELECT 1");
        // One parameter type announced, none given.
        let n = broken.len();
        broken[n - 1] = 1;
        p.sent(frontend::PARSE, &broken).unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        p.parse_complete();
        p.ready();
        assert_commit_still_runs(&mut p, "x");
    }

    /// Statement `name` run in a batch still counts as COMMIT: nothing
    /// may run after it.
    fn assert_commit_still_runs(p: &mut ReadOnlyPipeline, name: &str) {
        p.sent(frontend::BIND, &bind("", name)).unwrap();
        p.sent(frontend::EXECUTE, &execute("")).unwrap();
        assert!(run(p, "INSERT INTO t VALUES (1)").is_err());
    }

    #[test]
    fn statements_change_only_as_the_server_confirms() {
        // A Parse reusing a name fails (42P05): the old statement stays.
        let mut p = with_commit("c");
        p.sent(frontend::PARSE, &parse("c", "SELECT 1")).unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        p.error();
        p.ready();
        assert_commit_still_runs(&mut p, "c");

        // A Close skipped after an error leaves the statement too.
        let mut p = with_commit("c");
        run(&mut p, "SELECT 1/0").unwrap();
        p.sent(frontend::CLOSE, &close(b'S', "c")).unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        p.parse_complete();
        p.error();
        p.ready();
        assert_commit_still_runs(&mut p, "c");

        // So does an unnamed Parse skipped after an error.
        let mut p = with_commit("");
        // (A portal that does not exist.)
        p.sent(frontend::EXECUTE, &execute("none")).unwrap();
        p.sent(frontend::PARSE, &parse("", "SELECT 1")).unwrap();
        p.sent(frontend::SYNC, b"").unwrap();
        p.error();
        p.ready();
        assert_commit_still_runs(&mut p, "");

        // Until the server answers, either text counts.
        let mut p = ReadOnlyPipeline::default();
        p.sent(frontend::PARSE, &parse("", "SELECT 1")).unwrap();
        p.sent(frontend::PARSE, &parse("", "COMMIT")).unwrap();
        p.sent(frontend::PARSE, &parse("", "SELECT 2")).unwrap();
        p.sent(frontend::BIND, &bind("", "")).unwrap();
        p.sent(frontend::EXECUTE, &execute("")).unwrap();
        assert!(p.sent(frontend::EXECUTE, &execute("x")).is_err());
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
