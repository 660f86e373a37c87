//! SQLSTATE codes used in the errors pgwarden reports to clients.
//!
//! Clients and drivers branch on these codes (for instance to decide whether
//! a failed connection is worth retrying), so the proxy must use exactly the
//! codes PostgreSQL would use for the same situation.

use std::fmt;

/// A five-character SQLSTATE error code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SqlState(&'static str);

impl SqlState {
    /// The code as it appears in the `C` field of an error response.
    pub const fn code(self) -> &'static str {
        self.0
    }
}

impl fmt::Display for SqlState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// Class 08: the peer broke the wire protocol.
pub const PROTOCOL_VIOLATION: SqlState = SqlState("08P01");
/// Class 08: the connection to the server was lost or could not be made.
pub const CONNECTION_FAILURE: SqlState = SqlState("08006");
/// Class 08: generic connection problem.
pub const CONNECTION_EXCEPTION: SqlState = SqlState("08000");
/// The server is starting up, shutting down or in recovery; retry later.
pub const CANNOT_CONNECT_NOW: SqlState = SqlState("57P03");
/// The session was terminated by an administrator or a shutdown.
pub const ADMIN_SHUTDOWN: SqlState = SqlState("57P01");
/// A connection limit was reached.
pub const TOO_MANY_CONNECTIONS: SqlState = SqlState("53300");
/// Authentication failed.
pub const INVALID_PASSWORD: SqlState = SqlState("28P01");
/// The role is missing, not allowed to log in, or was not given.
pub const INVALID_AUTHORIZATION_SPECIFICATION: SqlState = SqlState("28000");
/// The requested database does not exist.
pub const INVALID_CATALOG_NAME: SqlState = SqlState("3D000");
/// A write was attempted in a read-only transaction.
pub const READ_ONLY_SQL_TRANSACTION: SqlState = SqlState("25006");
/// The request is valid but not supported.
pub const FEATURE_NOT_SUPPORTED: SqlState = SqlState("0A000");
/// A statement was cancelled.
pub const QUERY_CANCELED: SqlState = SqlState("57014");
/// An internal error (a bug, or an invariant broken by the peer).
pub const INTERNAL_ERROR: SqlState = SqlState("XX000");
/// A parameter has an unacceptable value.
pub const INVALID_PARAMETER_VALUE: SqlState = SqlState("22023");
/// A size or count limit was exceeded.
pub const PROGRAM_LIMIT_EXCEEDED: SqlState = SqlState("54000");
/// The session was idle for too long.
pub const IDLE_SESSION_TIMEOUT: SqlState = SqlState("57P05");
/// The session was idle inside a transaction for too long.
pub const IDLE_IN_TRANSACTION_SESSION_TIMEOUT: SqlState = SqlState("25P03");
/// A prepared statement name is unknown.
pub const INVALID_SQL_STATEMENT_NAME: SqlState = SqlState("26000");
/// A prepared statement name is already in use.
pub const DUPLICATE_PREPARED_STATEMENT: SqlState = SqlState("42P05");
/// A portal (cursor) name is unknown.
pub const INVALID_CURSOR_NAME: SqlState = SqlState("34000");
/// Bytes that are not valid in the encoding.
pub const CHARACTER_NOT_IN_REPERTOIRE: SqlState = SqlState("22021");
/// The object is not in a state that allows this, such as a database
/// that does not accept connections.
pub const OBJECT_NOT_IN_PREREQUISITE_STATE: SqlState = SqlState("55000");
/// A configuration file could not be used.
pub const CONFIG_FILE_ERROR: SqlState = SqlState("F0000");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_five_characters() {
        let all = [
            PROTOCOL_VIOLATION,
            CONNECTION_FAILURE,
            CONNECTION_EXCEPTION,
            CANNOT_CONNECT_NOW,
            ADMIN_SHUTDOWN,
            TOO_MANY_CONNECTIONS,
            INVALID_PASSWORD,
            INVALID_AUTHORIZATION_SPECIFICATION,
            INVALID_CATALOG_NAME,
            READ_ONLY_SQL_TRANSACTION,
            FEATURE_NOT_SUPPORTED,
            QUERY_CANCELED,
            INTERNAL_ERROR,
            INVALID_PARAMETER_VALUE,
            PROGRAM_LIMIT_EXCEEDED,
            IDLE_SESSION_TIMEOUT,
            IDLE_IN_TRANSACTION_SESSION_TIMEOUT,
            INVALID_SQL_STATEMENT_NAME,
            DUPLICATE_PREPARED_STATEMENT,
            INVALID_CURSOR_NAME,
            CHARACTER_NOT_IN_REPERTOIRE,
            OBJECT_NOT_IN_PREREQUISITE_STATE,
            CONFIG_FILE_ERROR,
        ];
        for s in all {
            assert_eq!(s.code().len(), 5);
            assert!(s
                .code()
                .bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase()));
        }
        assert_eq!(READ_ONLY_SQL_TRANSACTION.to_string(), "25006");
    }
}
