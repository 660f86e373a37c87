//! Control of local PostgreSQL instances.
//!
//! This crate is product code, shared by the HA agent (which manages the
//! PostgreSQL of its node), `pgwarden demo` (a local cluster for newcomers)
//! and the test kit. It wraps the server binaries of the installed
//! PostgreSQL (`initdb`, `postgres`, `pg_basebackup`, `pg_ctl`,
//! `pg_isready`) and never talks SQL itself, so it stays free of an async
//! runtime: every call blocks until the operation is done or its deadline
//! passes.
//!
//! PostgreSQL refuses to run as root. When this process is root, every
//! server binary runs as an unprivileged [`RunAs`] user (`postgres` when it
//! exists, otherwise a `pgwarden` system user that is created on demand).

mod binaries;
mod cluster;
mod instance;
mod run_as;

pub use binaries::PgBinaries;
pub use cluster::{node_name, ClusterSpec, LocalCluster, SyncSpec};
pub use instance::{conninfo_value, Instance, InstanceSpec, StopMode};
pub use run_as::RunAs;

use std::path::PathBuf;

/// Everything that can go wrong while controlling a PostgreSQL instance.
#[derive(Debug, thiserror::Error)]
pub enum PgCtlError {
    /// No PostgreSQL server binaries were found.
    #[error("PostgreSQL server binaries not found ({0}); install postgresql-15 or set PGWARDEN_PG_BINDIR")]
    BinariesNotFound(String),
    /// A command could not be started at all.
    #[error("could not run {program}: {source}")]
    Spawn {
        /// The program that failed to start.
        program: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A command ran and failed.
    #[error("{program} failed ({status}): {output}")]
    CommandFailed {
        /// The program that failed.
        program: String,
        /// Its exit status.
        status: String,
        /// The tail of its output, for the operator.
        output: String,
    },
    /// The server did not reach the expected state in time.
    #[error("{what} did not happen within {secs} s; server log tail:\n{log_tail}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The deadline in seconds.
        secs: u64,
        /// The end of the server log, which usually says why.
        log_tail: String,
    },
    /// The postmaster exited while it was expected to run.
    #[error("postgres exited unexpectedly ({status}); server log tail:\n{log_tail}")]
    Exited {
        /// Its exit status.
        status: String,
        /// The end of the server log.
        log_tail: String,
    },
    /// A file of the data directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The unprivileged user could not be found or created.
    #[error("cannot run PostgreSQL as an unprivileged user: {0}")]
    User(String),
    /// A step that rewrites the data directory was asked for while its
    /// postmaster still runs (a stop that did not finish in time).
    #[error("{what}: the postmaster (pid {pid}) of {} still runs", datadir.display())]
    StillRunning {
        /// The step refused.
        what: String,
        /// The running postmaster.
        pid: i32,
        /// Its data directory.
        datadir: PathBuf,
    },
}

/// Result alias of this crate.
pub type Result<T, E = PgCtlError> = std::result::Result<T, E>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> PgCtlError {
    let path = path.into();
    move |source| PgCtlError::Io { path, source }
}
