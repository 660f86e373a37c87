//! Client authentication for pgwarden, the PostgreSQL side of it.
//!
//! Like the topology and wire crates, this one is pure: no sockets, no
//! clock, no randomness of its own (nonces and salts are parameters). The
//! one exception is [`hba::Hba::load`], a convenience that reads a
//! `pg_hba.conf` and its `@` includes from disk; [`hba::Hba::parse`] takes
//! the file reader as a parameter instead.
//!
//! * [`scram`]: SCRAM-SHA-256 as PostgreSQL speaks it, with channel binding
//!   (SCRAM-SHA-256-PLUS), server side towards clients and client side
//!   towards PostgreSQL, able to log in upstream with the key proven by the
//!   client instead of a stored password.
//! * [`md5`]: the legacy `md5` password method.
//! * [`hba`]: `pg_hba.conf` parsing and rule matching, as in PostgreSQL 15.
//! * [`cert`]: the client certificate's common name, which `cert`
//!   authentication compares with the user name, and the hash of the
//!   server certificate that channel binding uses.
//! * [`basic`]: HTTP basic authentication of the HTTP endpoints.
//!
//! No function here panics, whatever bytes a peer or a configuration file
//! contains.

pub mod basic;
pub mod cert;
pub mod hba;
pub mod md5;
pub mod scram;

pub use basic::basic_auth_matches;
pub use cert::{
    end_point_hash, subject_common_name, tls_server_end_point, CertNameError, EndPointHash,
};
pub use hba::{AuthMethod, ConnType, Hba, HbaContext, HbaError, HbaRule};
pub use md5::{is_md5_secret, md5_response, md5_secret, verify_md5};
pub use scram::{
    ClientKey, Nonce, ScramClient, ScramError, ScramSecret, ScramServer, ServerVerification,
};
