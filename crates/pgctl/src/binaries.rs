use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{PgCtlError, Result};

/// Where the PostgreSQL server binaries live.
#[derive(Debug, Clone)]
pub struct PgBinaries {
    bindir: PathBuf,
}

impl PgBinaries {
    /// Finds the server binaries: `$PGWARDEN_PG_BINDIR`, then `pg_config
    /// --bindir`, then Debian's `/usr/lib/postgresql/<newest>/bin` (Debian
    /// keeps `initdb` and `postgres` off `PATH`).
    pub fn discover() -> Result<Self> {
        let mut tried = Vec::new();
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(dir) = std::env::var_os("PGWARDEN_PG_BINDIR") {
            candidates.push(dir.into());
        }
        if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
            if out.status.success() {
                let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
                if !s.is_empty() {
                    candidates.push(s.into());
                }
            }
        }
        if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
            let mut versions: Vec<(u32, PathBuf)> = entries
                .flatten()
                .filter_map(|e| {
                    let v = e.file_name().to_str()?.parse::<u32>().ok()?;
                    Some((v, e.path().join("bin")))
                })
                .collect();
            versions.sort_by_key(|v| std::cmp::Reverse(v.0));
            candidates.extend(versions.into_iter().map(|(_, p)| p));
        }
        for dir in candidates {
            if dir.join("postgres").is_file() && dir.join("initdb").is_file() {
                return Ok(Self { bindir: dir });
            }
            tried.push(dir.display().to_string());
        }
        Err(PgCtlError::BinariesNotFound(if tried.is_empty() {
            "no candidate directory".into()
        } else {
            format!("looked in {}", tried.join(", "))
        }))
    }

    /// Uses the binaries of an explicit directory.
    pub fn at(bindir: impl Into<PathBuf>) -> Self {
        Self {
            bindir: bindir.into(),
        }
    }

    /// The directory holding the binaries.
    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    /// Full path of one binary, e.g. `initdb`.
    pub fn path(&self, program: &str) -> PathBuf {
        self.bindir.join(program)
    }
}
