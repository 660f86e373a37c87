//! The pgwarden configuration file.
//!
//! The file is TOML. [`load`] reads and checks it in one step and returns a
//! [`Config`] in which every default is filled in and every derived value
//! (listen ports, per-service policies) is worked out, so the rest of
//! pgwarden never needs to know which keys were actually written.
//!
//! Mistakes are reported with the file name, the line and the key: values
//! that can be judged alone are checked while the TOML is deserialised, so
//! the parser's own position information applies; checks that combine
//! several keys recover positions from `toml::Spanned` values.
//!
//! * [`sections`]: one resolved type per section.
//! * [`service`]: services and what they select.
//! * [`duration`]: the duration syntax shared by all time-valued keys.

mod agent;
pub mod duration;
mod error;
mod keypath;
mod raw;
mod resolve;
pub mod sections;
pub mod service;

use std::path::Path;

pub use agent::{
    AgentConfig, BootstrapMethod, Callbacks, EtcdConfig, HaTimer, OnSyncBlocked, ReplicaMethod,
    VerifyClient, WatchdogConfig, WatchdogMode, DEFAULT_ETCD_NAMESPACE,
};
pub use duration::{format_duration, parse_duration, DurationError};
pub use error::ConfigError;
pub use sections::{
    AuthConfig, ClientTls, ClusterConfig, EngineConfig, ListenConfig, LogConfig, LogFormat,
    PoolConfig, PoolMode, PoolOverride, ServerTls, TcpTimings, TlsConfig, DEFAULT_AUTH_QUERY,
};
pub use service::{ServiceConfig, ServiceKind, READ_ONLY, READ_WRITE};

/// A complete, checked configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `[cluster]`.
    pub cluster: ClusterConfig,
    /// `[listen]`, with absent addresses derived.
    pub listen: ListenConfig,
    /// `[engine]`.
    pub engine: EngineConfig,
    /// `[pool]`.
    pub pool: PoolConfig,
    /// `[log]`.
    pub log: LogConfig,
    /// `[tls]`.
    pub tls: TlsConfig,
    /// `[auth]`; `None` when pgwarden leaves authentication to the servers.
    pub auth: Option<AuthConfig>,
    /// `[agent]`: set when this node runs the HA agent.
    pub agent: Option<AgentConfig>,
    /// `[etcd]`: present exactly when `agent` is.
    pub etcd: Option<EtcdConfig>,
    /// Resolved services; private so that the listener checks made at load
    /// time cannot be bypassed.
    services: Vec<ServiceConfig>,
}

impl Config {
    /// Every service: `read_write`, then `read_only`, then the
    /// `[services.NAME]` tables in name order.
    pub fn services(&self) -> Vec<ServiceConfig> {
        self.services.clone()
    }

    /// The service called `name`, if there is one.
    pub fn service(&self, name: &str) -> Option<&ServiceConfig> {
        self.services.iter().find(|s| s.name == name)
    }
}

/// Reads and checks the configuration file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = read_text(path)?;
    parse(&text, &path.display().to_string())
}

/// The file at `path` as text; one that is not UTF-8 is refused with the
/// line and column of the first byte that is not.
fn read_text(path: &Path) -> Result<String, ConfigError> {
    let bytes = std::fs::read(path).map_err(|error| ConfigError::Read {
        path: path.to_path_buf(),
        error,
    })?;
    String::from_utf8(bytes).map_err(|e| {
        let bytes = e.as_bytes();
        let at = e.utf8_error().valid_up_to();
        let line_start = bytes[..at]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        // The valid part, to name the key the bad byte belongs to.
        let before = String::from_utf8_lossy(&bytes[..at]);
        ConfigError::Encoding {
            origin: path.display().to_string(),
            line: bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1,
            column: at - line_start + 1,
            key: keypath::key_on_line(&before, at),
        }
    })
}

/// Checks configuration text; `origin` names it in error messages, and is
/// normally the file name.
pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let src = resolve::Source { text, origin };
    let raw: raw::RawFile = toml::from_str(text).map_err(|error| ConfigError::Syntax {
        origin: origin.to_string(),
        line: error.span().map(|s| src.line_of(s.start)),
        key: error.span().and_then(|s| {
            keypath::key_at(text, &s).or_else(|| keypath::key_on_line(text, s.start))
        }),
        error: Box::new(error),
    })?;
    resolve::resolve(raw, &src)
}
