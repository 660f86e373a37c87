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
    #[error("{origin}: {}{}", key.as_ref().map(|k| format!("{k}: ")).unwrap_or_default(), in_toml_terms(error))]
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

/// The TOML error's text with the words serde takes from Rust types
/// (`expected u32`, `expected struct RawPool`, `unknown variant`) put in the
/// terms of the file an operator wrote: whole numbers and their range,
/// tables, arrays, values.
fn in_toml_terms(error: &toml::de::Error) -> String {
    let rendered = error.to_string();
    let message = error.message();
    let plain = plain_message(message);
    match rendered.rfind(message) {
        Some(at) if plain != message => {
            format!(
                "{}{plain}{}",
                &rendered[..at],
                &rendered[at + message.len()..]
            )
        }
        _ => rendered,
    }
}

/// [`in_toml_terms`] for the message alone.
pub(crate) fn plain_message(message: &str) -> String {
    const WORDS: &[(&str, &str)] = &[
        ("expected u8", "expected a whole number from 0 to 255"),
        ("expected u16", "expected a whole number from 0 to 65535"),
        (
            "expected u32",
            "expected a whole number from 0 to 4294967295",
        ),
        ("expected u64", "expected a whole number of 0 or more"),
        ("expected usize", "expected a whole number of 0 or more"),
        (
            "expected i32",
            "expected a whole number from -2147483648 to 2147483647",
        ),
        ("expected i64", "expected a whole number"),
        ("expected f32", "expected a number"),
        ("expected f64", "expected a number"),
        ("expected a map", "expected a table"),
        ("expected a sequence", "expected an array"),
        ("invalid type: sequence", "invalid type: array"),
        ("invalid type: map", "invalid type: table"),
        ("floating point", "floating-point number"),
        ("unknown variant", "unknown value"),
        ("wanted string or table", "invalid type: expected a string"),
    ];
    let mut out = message.to_string();
    // `expected struct RawPool` and the like: the Rust name means nothing
    // in the file, where the value must be a table.
    while let Some(at) = out.find("expected struct ") {
        let name_at = at + "expected struct ".len();
        let end = out[name_at..]
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(out.len(), |i| name_at + i);
        out.replace_range(at..end, "expected a table");
    }
    for (rust, toml) in WORDS {
        let mut from = 0;
        while let Some(i) = out[from..].find(rust) {
            let at = from + i;
            let end = at + rust.len();
            // `expected u32` must not rewrite `expected u320`, nor
            // `expected a map` the start of a longer word.
            if out[end..].starts_with(|c: char| c.is_alphanumeric() || c == '_') {
                from = end;
                continue;
            }
            out.replace_range(at..end, toml);
            from = at + toml.len();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::plain_message;

    #[test]
    fn rust_type_names_become_toml_terms() {
        for (serde, plain) in [
            (
                "invalid value: integer `-3`, expected u32",
                "invalid value: integer `-3`, expected a whole number from 0 to 4294967295",
            ),
            (
                "invalid type: floating point `2.5`, expected u16",
                "invalid type: floating-point number `2.5`, expected a whole number from 0 to 65535",
            ),
            (
                "invalid type: integer `3`, expected struct RawCluster",
                "invalid type: integer `3`, expected a table",
            ),
            (
                "invalid type: sequence, expected usize",
                "invalid type: array, expected a whole number of 0 or more",
            ),
            (
                "invalid type: string \"x\", expected a sequence",
                "invalid type: string \"x\", expected an array",
            ),
            (
                "invalid type: integer `3`, expected a map",
                "invalid type: integer `3`, expected a table",
            ),
            (
                "unknown variant `txn`, expected `session` or `transaction`",
                "unknown value `txn`, expected `session` or `transaction`",
            ),
            ("wanted string or table", "invalid type: expected a string"),
            // Already in the file's terms: left alone.
            (
                "invalid type: string \"x\", expected a string",
                "invalid type: string \"x\", expected a string",
            ),
            ("expected u320", "expected u320"),
        ] {
            assert_eq!(plain_message(serde), plain, "{serde}");
        }
    }
}
