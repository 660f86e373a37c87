//! The one error type of this crate.

use std::path::PathBuf;

/// Why a configuration could not be loaded.
///
/// Every message starts with the file it is about and, where one is known,
/// the line, so that an operator can go straight to the mistake. The
/// underlying TOML or I/O error is part of the message rather than a
/// separate `source`, so that error reporters that print the whole chain do
/// not repeat it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{}: {error}", path.display())]
    Read {
        /// The file that was asked for.
        path: PathBuf,
        /// What the operating system said.
        error: std::io::Error,
    },
    /// The text is not valid TOML, or a key or value is not one the schema
    /// accepts. The TOML error already shows the line, column and the
    /// offending text.
    #[error("{origin}: {}{error}", key.as_ref().map(|k| format!("{k}: ")).unwrap_or_default())]
    Syntax {
        /// The file name given to [`crate::parse`].
        origin: String,
        /// 1-based line the TOML error points at, if it points anywhere.
        line: Option<usize>,
        /// Dotted path of the key the error is about, e.g.
        /// `cluster.hosts[1]`, when it can be worked out.
        key: Option<String>,
        /// The error as reported by the TOML parser; boxed because it is
        /// large and errors travel through every `?` of the loader.
        error: Box<toml::de::Error>,
    },
    /// The file is not UTF-8, as TOML must be.
    #[error("{origin}:{line}: not valid UTF-8 at column {column} (TOML files are UTF-8){}", key.as_ref().map(|k| format!(", in {k}")).unwrap_or_default())]
    Encoding {
        /// The file.
        origin: String,
        /// 1-based line of the first byte that is not UTF-8.
        line: usize,
        /// 1-based byte column of it.
        column: usize,
        /// Dotted path of the key on that line, when it can be told.
        key: Option<String>,
    },
    /// Each value is fine on its own but the combination is not, e.g. two
    /// listeners on one address.
    #[error("{origin}:{}{key}: {message}", line.map(|l| format!("{l}: ")).unwrap_or_else(|| " ".into()))]
    Invalid {
        /// The file name given to [`crate::parse`].
        origin: String,
        /// 1-based line of the key at fault; `None` when the value was
        /// derived rather than written.
        line: Option<usize>,
        /// Dotted path of the key at fault, e.g. `services.standby.listen`.
        key: String,
        /// What is wrong with it.
        message: String,
    },
}

impl ConfigError {
    /// Dotted path of the key at fault, when known.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Syntax { key, .. } | ConfigError::Encoding { key, .. } => key.as_deref(),
            ConfigError::Invalid { key, .. } => Some(key),
        }
    }

    /// The 1-based line the error points at, when it points at one.
    pub fn line(&self) -> Option<usize> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Syntax { line, .. } | ConfigError::Invalid { line, .. } => *line,
            ConfigError::Encoding { line, .. } => Some(*line),
        }
    }
}
