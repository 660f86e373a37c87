use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use nix::unistd::{Gid, Uid, User};

use crate::{io_err, PgCtlError, Result};

/// The operating-system user PostgreSQL processes run as.
///
/// PostgreSQL refuses to start as root, so when this process is root the
/// server and its tools are started with the uid/gid of an unprivileged user.
#[derive(Debug, Clone)]
pub struct RunAs {
    user: Option<(String, Uid, Gid)>,
}

/// The system user created when no `postgres` user exists.
const FALLBACK_USER: &str = "pgwarden";

impl RunAs {
    /// Runs as the current user: right when this process is not root.
    pub fn current() -> Self {
        Self { user: None }
    }

    /// The current user when not root; otherwise `postgres` if it exists,
    /// else the `pgwarden` system user, created with `useradd` if missing.
    pub fn unprivileged() -> Result<Self> {
        if !Uid::effective().is_root() {
            return Ok(Self::current());
        }
        for name in ["postgres", FALLBACK_USER] {
            if let Some(u) = lookup(name)? {
                return Ok(u);
            }
        }
        let status = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
            ])
            .arg(FALLBACK_USER)
            .status()
            .map_err(|e| PgCtlError::User(format!("useradd: {e}")))?;
        // A concurrent test may have created it first; look again either way.
        match lookup(FALLBACK_USER)? {
            Some(u) => Ok(u),
            None => Err(PgCtlError::User(format!(
                "useradd {FALLBACK_USER} exited with {status} and the user does not exist"
            ))),
        }
    }

    /// A named user, which must exist.
    pub fn named(name: &str) -> Result<Self> {
        lookup(name)?.ok_or_else(|| PgCtlError::User(format!("no such user: {name}")))
    }

    /// The user's name, or `None` for the current user.
    pub fn name(&self) -> Option<&str> {
        self.user.as_ref().map(|(n, _, _)| n.as_str())
    }

    /// The uid processes run with.
    pub fn uid(&self) -> u32 {
        self.user
            .as_ref()
            .map_or_else(|| Uid::effective().as_raw(), |(_, u, _)| u.as_raw())
    }

    /// Prepares a command to run as this user.
    pub fn apply(&self, cmd: &mut Command) {
        if let Some((name, uid, gid)) = &self.user {
            cmd.uid(uid.as_raw()).gid(gid.as_raw());
            cmd.env("USER", name).env("LOGNAME", name);
            // HOME of root is unreadable for the user; tools read ~/.pgpass etc.
            cmd.env("HOME", "/tmp");
        }
    }

    /// Gives a directory (not recursively) to this user, so the server can
    /// write below it.
    pub fn own(&self, path: &Path) -> Result<()> {
        if let Some((_, uid, gid)) = &self.user {
            std::os::unix::fs::chown(path, Some(uid.as_raw()), Some(gid.as_raw()))
                .map_err(io_err(path))?;
        }
        Ok(())
    }
}

fn lookup(name: &str) -> Result<Option<RunAs>> {
    match User::from_name(name) {
        Ok(Some(u)) => Ok(Some(RunAs {
            user: Some((u.name, u.uid, u.gid)),
        })),
        Ok(None) => Ok(None),
        Err(e) => Err(PgCtlError::User(format!("looking up {name}: {e}"))),
    }
}
