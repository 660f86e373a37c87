//! PostgreSQL frontend/backend protocol (version 3) for pgwarden's proxy.
//!
//! Like the topology crate, this one is pure: it never touches a socket or
//! the clock. The proxy reads bytes into a [`bytes::BytesMut`] and asks this
//! crate where messages begin and end, what a few of them say, and how to
//! build the handful of messages the proxy originates itself.
//!
//! Everything here sits on the per-message hot path, so framing works on
//! borrowed slices and splits buffers instead of copying them, and no parser
//! panics, whatever bytes a client or server sends.
//!
//! * [`sqlstate`]: the error codes the proxy reports.
//! * [`startup`]: the untagged first packet of a connection (startup, SSL,
//!   GSSAPI encryption and cancel requests).
//! * [`message`]: framing of tagged messages and read access to their bodies.
//! * [`encode`]: builders for the messages the proxy sends on its own.
//! * [`readonly`]: the SQL check that keeps a read-only session read-only.
//! * [`readonly_pipeline`]: which of a read-only session's pipelined
//!   messages must wait for the server's ReadyForQuery, or are refused.
//! * [`effects`]: what a query does to a pooled server session (state that
//!   outlives its transaction, prepared statements dropped).

pub mod effects;
pub mod encode;
pub mod message;
pub mod readonly;
pub mod readonly_pipeline;
pub mod sqlstate;
pub mod startup;

pub use encode::Severity;
pub use message::{peek_header, split_message, BodyError, FrameError, Header, TxStatus};
pub use readonly::{blank_comments, check_read_only, options_set_read_only_guc, ReadOnlyViolation};
pub use sqlstate::SqlState;
pub use startup::{parse_startup, StartupError, StartupFrame, StartupMessage};
