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
    user: Option<Account>,
}

/// An unprivileged account to switch to.
#[derive(Debug, Clone)]
struct Account {
    name: String,
    uid: Uid,
    gid: Gid,
    /// Every group of the account, its supplementary ones included (on
    /// Debian `postgres` reads the snakeoil TLS key through `ssl-cert`).
    groups: Vec<Gid>,
    /// Its home directory, where tools look for `.pgpass`.
    home: Option<std::path::PathBuf>,
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
        self.user.as_ref().map(|a| a.name.as_str())
    }

    /// The uid processes run with.
    pub fn uid(&self) -> u32 {
        self.user
            .as_ref()
            .map_or_else(|| Uid::effective().as_raw(), |a| a.uid.as_raw())
    }

    /// Prepares a command to run as this user, with all its groups.
    #[allow(unsafe_code)]
    pub fn apply(&self, cmd: &mut Command) {
        if let Some(a) = &self.user {
            if Uid::effective().is_root() {
                // Command::uid would drop every supplementary group.
                let (uid, gid, groups) = (a.uid, a.gid, a.groups.clone());
                // SAFETY: runs between fork and exec and makes only the
                // async-signal-safe setgroups, setgid and setuid system
                // calls, on memory prepared before the fork.
                unsafe {
                    cmd.pre_exec(move || {
                        nix::unistd::setgroups(&groups)?;
                        nix::unistd::setgid(gid)?;
                        nix::unistd::setuid(uid)?;
                        Ok(())
                    });
                }
            } else {
                cmd.uid(a.uid.as_raw()).gid(a.gid.as_raw());
            }
            cmd.env("USER", &a.name).env("LOGNAME", &a.name);
            // Not root's HOME, which the user cannot read: its own, where
            // tools look for ~/.pgpass.
            let home = a.home.as_deref().filter(|h| h.is_dir());
            cmd.env("HOME", home.unwrap_or(Path::new("/tmp")));
        }
    }

    /// Gives a directory (not recursively) to this user, so the server can
    /// write below it.
    pub fn own(&self, path: &Path) -> Result<()> {
        if let Some(a) = &self.user {
            std::os::unix::fs::chown(path, Some(a.uid.as_raw()), Some(a.gid.as_raw()))
                .map_err(io_err(path))?;
        }
        Ok(())
    }
}

fn lookup(name: &str) -> Result<Option<RunAs>> {
    match User::from_name(name) {
        Ok(Some(u)) => {
            let groups = std::ffi::CString::new(u.name.clone())
                .ok()
                .and_then(|n| nix::unistd::getgrouplist(&n, u.gid).ok())
                .unwrap_or_else(|| vec![u.gid]);
            Ok(Some(RunAs {
                user: Some(Account {
                    name: u.name,
                    uid: u.uid,
                    gid: u.gid,
                    groups,
                    home: Some(u.dir),
                }),
            }))
        }
        Ok(None) => Ok(None),
        Err(e) => Err(PgCtlError::User(format!("looking up {name}: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Started as root for a user, a program runs with the user's ids and
    /// every one of its groups.
    #[test]
    fn programs_run_with_every_group_of_their_user() {
        if !Uid::effective().is_root() {
            return;
        }
        let Ok(Some(user)) = lookup("postgres") else {
            return;
        };
        let a = user.user.as_ref().unwrap();
        let mut cmd = Command::new("id");
        user.apply(&mut cmd);
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(text.starts_with(&format!("uid={}(", a.uid)), "{text}");
        for g in &a.groups {
            assert!(text.contains(&format!("{g}(")), "group {g} missing: {text}");
        }
    }
}
