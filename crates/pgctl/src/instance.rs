use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::{io_err, PgBinaries, PgCtlError, Result, RunAs};

/// The settings file pgwarden owns inside each data directory; included
/// from `postgresql.conf` so the operator's own file stays untouched.
const SETTINGS_FILE: &str = "pgwarden.conf";

/// How long start-up, shutdown and promotion may take before we give up.
const DEFAULT_DEADLINE: Duration = Duration::from_secs(60);

/// How long an immediate stop waits for the postmaster before killing it
/// and its children (SIGKILL).
pub const IMMEDIATE_DEADLINE: Duration = Duration::from_secs(5);

/// PostgreSQL's shutdown modes (`pg_ctl stop -m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Wait for clients to disconnect (SIGTERM).
    Smart,
    /// Roll back open transactions and shut down cleanly (SIGINT).
    Fast,
    /// Quit without a shutdown checkpoint; recovery runs at next start (SIGQUIT).
    Immediate,
}

impl StopMode {
    fn signal(self) -> Signal {
        match self {
            StopMode::Smart => Signal::SIGTERM,
            StopMode::Fast => Signal::SIGINT,
            StopMode::Immediate => Signal::SIGQUIT,
        }
    }
}

/// Where and how one instance runs.
#[derive(Debug, Clone)]
pub struct InstanceSpec {
    /// Member name; also its `cluster_name` and the `application_name` of
    /// its WAL receiver, so the primary's `pg_stat_replication` names it.
    pub name: String,
    /// The data directory.
    pub datadir: PathBuf,
    /// Listen address (an IP address).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Extra `postgresql.conf` settings, written to `pgwarden.conf`.
    pub settings: BTreeMap<String, String>,
    /// Ask the kernel to stop the postmaster (SIGQUIT) when the thread that
    /// started it exits, so a crashed test never leaves servers behind. The
    /// HA agent leaves this off: its PostgreSQL must outlive an agent restart.
    pub die_with_parent: bool,
    /// Skip the fsync of initdb, pg_basebackup and pg_rewind: for throwaway
    /// clusters (tests, demos) only, since a crash soon after could leave
    /// a corrupt data directory.
    pub no_sync: bool,
    /// The replication slot this node streams through as a standby
    /// (`primary_slot_name`), created on the source when cloning; `None`
    /// streams without one.
    pub primary_slot: Option<String>,
}

impl InstanceSpec {
    /// A spec with the defaults used for local clusters.
    pub fn new(name: impl Into<String>, datadir: impl Into<PathBuf>, port: u16) -> Self {
        Self {
            name: name.into(),
            datadir: datadir.into(),
            host: "127.0.0.1".into(),
            port,
            settings: BTreeMap::new(),
            die_with_parent: false,
            no_sync: false,
            primary_slot: None,
        }
    }
}

/// One local PostgreSQL instance (a data directory and, while running, its
/// postmaster).
#[derive(Debug)]
pub struct Instance {
    spec: InstanceSpec,
    bins: PgBinaries,
    run_as: RunAs,
    child: Option<Child>,
    upstream: Option<(String, u16)>,
    /// Recovery settings that come with the source being followed (a
    /// standby cluster's archive commands). They win over `spec.settings`
    /// while this instance follows that source, and go when it follows
    /// another or stops following.
    source_settings: BTreeMap<String, String>,
    /// Values raised to what the primary had ([`STANDBY_MINIMUMS`]) for a
    /// start in recovery; they win over both maps above.
    standby_floors: BTreeMap<String, String>,
}

/// Settings a server in recovery must hold at no less than the primary's
/// values, which its control file records (with the `pg_controldata`
/// field): below them PostgreSQL 15 refuses to start ("recovery aborted
/// because of insufficient parameter settings"). A new replica of a
/// primary whose `max_connections` was raised, or a replica restarted
/// before its primary when the value is lowered, would never start.
const STANDBY_MINIMUMS: [(&str, &str); 5] = [
    ("max_connections", "max_connections setting"),
    ("max_worker_processes", "max_worker_processes setting"),
    ("max_wal_senders", "max_wal_senders setting"),
    ("max_prepared_transactions", "max_prepared_xacts setting"),
    ("max_locks_per_transaction", "max_locks_per_xact setting"),
];

impl Instance {
    /// Describes an instance; nothing is created or started yet.
    pub fn new(spec: InstanceSpec, bins: PgBinaries, run_as: RunAs) -> Self {
        Self {
            spec,
            bins,
            run_as,
            child: None,
            upstream: None,
            source_settings: BTreeMap::new(),
            standby_floors: BTreeMap::new(),
        }
    }

    /// Member name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Listen address.
    pub fn host(&self) -> &str {
        &self.spec.host
    }

    /// TCP port.
    pub fn port(&self) -> u16 {
        self.spec.port
    }

    /// `host:port`.
    pub fn addr(&self) -> String {
        format!("{}:{}", self.spec.host, self.spec.port)
    }

    /// The data directory.
    pub fn datadir(&self) -> &Path {
        &self.spec.datadir
    }

    /// The server log (the postmaster's stderr).
    pub fn log_path(&self) -> PathBuf {
        let mut p = self.spec.datadir.clone().into_os_string();
        p.push(".log");
        p.into()
    }

    /// Changes the port used from the next start on.
    pub fn set_port(&mut self, port: u16) -> Result<()> {
        self.spec.port = port;
        self.write_settings()
    }

    /// Creates a new cluster in the data directory with `initdb`, with data
    /// checksums so that `pg_rewind` can later resynchronise a former primary.
    pub fn initdb(&mut self, superuser: &str) -> Result<()> {
        self.make_datadir()?;
        let mut cmd = self.command("initdb");
        cmd.arg("-D")
            .arg(&self.spec.datadir)
            .args([
                "-U",
                superuser,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
            ])
            .args(["--data-checksums", "--no-instructions"]);
        if self.spec.no_sync {
            cmd.arg("--no-sync");
        }
        run(cmd, "initdb")?;
        let conf = self.spec.datadir.join("postgresql.conf");
        let mut text = fs::read_to_string(&conf).map_err(io_err(&conf))?;
        let _ = write!(text, "\ninclude_if_exists = '{SETTINGS_FILE}'\n");
        fs::write(&conf, text).map_err(io_err(&conf))?;
        self.write_settings()
    }

    /// Clones a running primary with `pg_basebackup` and configures this
    /// instance as its streaming standby.
    pub fn basebackup(&mut self, source_host: &str, source_port: u16, user: &str) -> Result<()> {
        self.make_datadir()?;
        let mut cmd = self.command("pg_basebackup");
        cmd.arg("-D")
            .arg(&self.spec.datadir)
            .args([
                "-h",
                source_host,
                "-p",
                &source_port.to_string(),
                "-U",
                user,
            ])
            .args(["-X", "stream", "-c", "fast"]);
        if self.spec.no_sync {
            cmd.arg("--no-sync");
        }
        match self.spec.primary_slot.clone() {
            None => run(cmd, "pg_basebackup")?,
            Some(slot) => {
                // The slot keeps the WAL from the backup's start until this
                // standby streams. One left from an earlier clone is reused.
                let mut again = self.command("pg_basebackup");
                again.args(cmd.get_args());
                cmd.args(["--create-slot", "--slot", &slot]);
                match run(cmd, "pg_basebackup") {
                    Err(PgCtlError::CommandFailed { output, .. })
                        if output.contains("already exists") =>
                    {
                        self.wipe()?;
                        self.make_datadir()?;
                        again.args(["--slot", &slot]);
                        run(again, "pg_basebackup")?;
                    }
                    other => other?,
                }
            }
        }
        self.set_upstream(Some((source_host, source_port)));
        self.write_standby(user)
    }

    /// Fills the data directory with an operator's command instead of
    /// `pg_basebackup` (a restore from a backup tool, typically), then
    /// configures this instance as a standby of `source`, or, without one,
    /// as a standby that replays what its settings' `restore_command`
    /// fetches.
    pub fn create_replica_with(
        &mut self,
        method: &str,
        command: &str,
        args: &[String],
        source: Option<(&str, u16)>,
        user: &str,
    ) -> Result<()> {
        self.fill_with(method, command, args)?;
        self.set_standby(source, user)
    }

    /// Fills the data directory with an operator's command (a restore from
    /// a backup) and sets it up to recover with `recovery` (an archive's
    /// `restore_command`, a recovery target) and end its recovery as a
    /// primary: the start of a cluster from a backup. The recovery settings
    /// are the source's (see `source_settings`), so that the caller can
    /// drop them once the server is out of recovery and leave the node's
    /// own settings of the same names as they were.
    pub fn restore_with(
        &mut self,
        method: &str,
        command: &str,
        args: &[String],
        recovery: &BTreeMap<String, String>,
    ) -> Result<()> {
        self.fill_with(method, command, args)?;
        // A backup of a standby may bring its signal file along.
        let _ = fs::remove_file(self.spec.datadir.join("standby.signal"));
        self.set_upstream(None);
        self.spec.settings.remove("primary_conninfo");
        self.spec.settings.remove("primary_slot_name");
        self.source_settings = recovery.clone();
        let signal = self.spec.datadir.join("recovery.signal");
        fs::write(&signal, b"").map_err(io_err(&signal))?;
        self.run_as.own(&signal)?;
        self.write_settings()
    }

    /// Runs an operator's command that must fill the data directory, as
    /// the server's user through `sh -c` with `args` appended; settings
    /// pgwarden owns are included even if the backup it restored came from
    /// elsewhere.
    fn fill_with(&mut self, method: &str, command: &str, args: &[String]) -> Result<()> {
        self.make_datadir()?;
        let mut cmd = Command::new("/bin/sh");
        // "$@" passes the arguments through unsplit; the method's name is
        // the script's $0, which shows in its messages.
        cmd.arg("-c")
            .arg(format!("{command} \"$@\""))
            .arg(method)
            .args(args)
            .env("LC_ALL", "C")
            .env_remove("PGDATA");
        self.run_as.apply(&mut cmd);
        run(cmd, method)?;
        if !self.has_data() {
            return Err(PgCtlError::CommandFailed {
                program: method.into(),
                status: "exit status: 0".into(),
                output: format!("left no data directory in {}", self.spec.datadir.display()),
            });
        }
        // A copy of a running server (a snapshot, rsync) brings along what
        // waited there for its archiver, which sends it itself: sent from
        // here as well, it would reach the archive twice, and an archive
        // command that refuses to overwrite would fail on one of the two
        // for ever. Done here, as pg_basebackup marks the WAL it copies.
        self.mark_archived(&self.archive_status_names(".ready"));
        let conf = self.spec.datadir.join("postgresql.conf");
        let text = fs::read_to_string(&conf).map_err(io_err(&conf))?;
        if !text.contains(SETTINGS_FILE) {
            let text = format!("{text}\ninclude_if_exists = '{SETTINGS_FILE}'\n");
            fs::write(&conf, text).map_err(io_err(&conf))?;
        }
        Ok(())
    }

    /// Points this standby at another upstream (takes effect on reload in
    /// PostgreSQL 13+).
    pub fn follow(&mut self, host: &str, port: u16, user: &str) -> Result<()> {
        self.set_upstream(Some((host, port)));
        self.write_standby(user)
    }

    /// Records the upstream; the source's own settings go with a change of
    /// source.
    fn set_upstream(&mut self, upstream: Option<(&str, u16)>) {
        if self.upstream() != upstream {
            self.source_settings.clear();
        }
        self.upstream = upstream.map(|(h, p)| (h.to_string(), p));
    }

    /// Sets the recovery settings that belong to the current upstream (see
    /// `source_settings`), written at once; a running server needs a
    /// reload.
    pub fn set_source_settings(&mut self, settings: BTreeMap<String, String>) -> Result<()> {
        self.source_settings = settings;
        self.write_settings()
    }

    /// The recovery settings of the current upstream.
    pub fn source_settings(&self) -> &BTreeMap<String, String> {
        &self.source_settings
    }

    fn write_standby(&mut self, user: &str) -> Result<()> {
        let (h, p) = self
            .upstream
            .clone()
            .expect("upstream set before write_standby");
        self.spec.settings.insert(
            "primary_conninfo".into(),
            format!(
                "host={h} port={p} user={} application_name={}",
                conninfo_value(user),
                conninfo_value(&self.spec.name)
            ),
        );
        match &self.spec.primary_slot {
            Some(slot) => {
                self.spec
                    .settings
                    .insert("primary_slot_name".into(), slot.clone());
            }
            None => {
                self.spec.settings.remove("primary_slot_name");
            }
        }
        let signal = self.spec.datadir.join("standby.signal");
        fs::write(&signal, b"").map_err(io_err(&signal))?;
        self.run_as.own(&signal)?;
        self.write_settings()
    }

    /// Configures this data directory to start in recovery: streaming from
    /// `upstream` when given, otherwise replaying only what it has (a
    /// former primary that must not take writes while no leader is known).
    pub fn set_standby(&mut self, upstream: Option<(&str, u16)>, user: &str) -> Result<()> {
        match upstream {
            Some((h, p)) => {
                self.set_upstream(Some((h, p)));
                self.write_standby(user)
            }
            None => {
                self.set_upstream(None);
                self.spec.settings.remove("primary_conninfo");
                self.spec.settings.remove("primary_slot_name");
                let signal = self.spec.datadir.join("standby.signal");
                fs::write(&signal, b"").map_err(io_err(&signal))?;
                self.run_as.own(&signal)?;
                self.write_settings()
            }
        }
    }

    /// Changes the slot this node streams through as a standby; written at
    /// once if it is one (`primary_slot_name` is reloadable).
    pub fn set_primary_slot(&mut self, slot: Option<String>) -> Result<()> {
        self.spec.primary_slot = slot;
        if self.upstream.is_none() {
            return Ok(());
        }
        match &self.spec.primary_slot {
            Some(s) => {
                self.spec
                    .settings
                    .insert("primary_slot_name".into(), s.clone());
            }
            None => {
                self.spec.settings.remove("primary_slot_name");
            }
        }
        self.write_settings()
    }

    /// Puts a replication slot's state file, as read from another server
    /// (`pg_replslot/<name>/state`), into this stopped server's data
    /// directory, where PostgreSQL loads it at its next start: the only way
    /// a standby of PostgreSQL 15 gets a logical slot. Written to a
    /// temporary directory, synced, then renamed into place, so a crash
    /// leaves either no slot or a whole one.
    pub fn install_slot_state(&mut self, name: &str, state: &[u8]) -> Result<()> {
        use std::io::Write as _;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let slots = self.spec.datadir.join("pg_replslot");
        let dir = slots.join(name);
        let tmp = slots.join(format!("{name}.tmp"));
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
        }
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&tmp)
            .map_err(io_err(&tmp))?;
        self.run_as.own(&tmp)?;
        let file = tmp.join("state");
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&file)
            .map_err(io_err(&file))?;
        f.write_all(state)
            .and_then(|()| f.sync_all())
            .map_err(io_err(&file))?;
        self.run_as.own(&file)?;
        fs::File::open(&tmp)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&tmp))?;
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }
        fs::rename(&tmp, &dir).map_err(io_err(&dir))?;
        fs::File::open(&slots)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&slots))
    }

    /// The slot this node streams through as a standby, if any.
    pub fn primary_slot(&self) -> Option<&str> {
        self.spec.primary_slot.as_deref()
    }

    /// The upstream this standby was last pointed at.
    pub fn upstream(&self) -> Option<(&str, u16)> {
        self.upstream.as_ref().map(|(h, p)| (h.as_str(), *p))
    }

    /// Configures this data directory to start as a primary.
    pub fn clear_standby(&mut self) -> Result<()> {
        let signal = self.spec.datadir.join("standby.signal");
        let _ = fs::remove_file(signal);
        self.set_upstream(None);
        self.spec.settings.remove("primary_conninfo");
        self.spec.settings.remove("primary_slot_name");
        self.write_settings()
    }

    /// Whether a data directory has been created here.
    pub fn has_data(&self) -> bool {
        self.spec.datadir.join("PG_VERSION").exists()
    }

    /// Removes the data directory's contents, so it can be cloned afresh.
    /// The directory itself stays: it may be a mount point (a volume of
    /// its own) or a symbolic link to one, which removing and creating
    /// again would break or bypass. Refused while a postmaster runs there.
    pub fn wipe(&mut self) -> Result<()> {
        self.refuse_while_running("wiping the data directory")?;
        let dir = &self.spec.datadir;
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.set_upstream(None);
                return Ok(());
            }
            Err(e) => return Err(io_err(dir)(e)),
        };
        for entry in entries {
            let path = entry.map_err(io_err(dir))?.path();
            let is_dir = fs::symlink_metadata(&path).map_err(io_err(&path))?.is_dir();
            if is_dir {
                fs::remove_dir_all(&path).map_err(io_err(&path))?;
            } else {
                fs::remove_file(&path).map_err(io_err(&path))?;
            }
        }
        self.set_upstream(None);
        Ok(())
    }

    /// An error if a postmaster runs in the data directory: `what` would
    /// rewrite files under a live server.
    fn refuse_while_running(&mut self, what: &str) -> Result<()> {
        match self.postmaster_pid() {
            Some(pid) => Err(PgCtlError::StillRunning {
                what: what.to_string(),
                pid,
                datadir: self.spec.datadir.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Fields of `pg_controldata`, e.g. "Database cluster state" or
    /// "Database system identifier".
    pub fn controldata(&self) -> Result<BTreeMap<String, String>> {
        let mut cmd = self.command("pg_controldata");
        cmd.arg("-D").arg(&self.spec.datadir);
        let out = cmd.output().map_err(|source| PgCtlError::Spawn {
            program: "pg_controldata".into(),
            source,
        })?;
        if !out.status.success() {
            return Err(PgCtlError::CommandFailed {
                program: "pg_controldata".into(),
                status: out.status.to_string(),
                output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect())
    }

    /// Reads the configuration files as a server start would and fails
    /// with PostgreSQL's own message when it refuses them: a value a reload
    /// only logs (and keeps the old one for) would stop a restart. Safe
    /// while the server runs.
    pub fn check_config(&self) -> Result<()> {
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(&self.spec.datadir)
            .args(["-C", "data_directory"])
            .stdin(Stdio::null());
        run(cmd, "postgres -C")
    }

    /// Finishes crash recovery without accepting connections (single-user
    /// mode), leaving a cleanly shut down data directory, which `pg_rewind`
    /// requires.
    pub fn recover_single_user(&mut self) -> Result<()> {
        self.refuse_while_running("crash recovery in single-user mode")?;
        self.archive_ready_wal();
        // The end of crash recovery removes or recycles the segments before
        // its checkpoint (with archiving off, those still waiting for the
        // archive too), and pg_rewind may have to read them back to where
        // the histories forked: every one is kept.
        let mut cmd = self.command("postgres");
        cmd.arg("--single")
            .arg("-F")
            .arg("-D")
            .arg(&self.spec.datadir)
            .args(["-c", "archive_mode=off"])
            .args(["-c", &format!("wal_keep_size={}", i32::MAX)])
            .arg("postgres")
            .stdin(Stdio::null());
        run(cmd, "postgres --single")
    }

    /// `pg_wal/archive_status`.
    fn archive_status_dir(&self) -> PathBuf {
        self.spec.datadir.join("pg_wal").join("archive_status")
    }

    /// The WAL files whose archive status file ends in `suffix` (`.ready`
    /// or `.done`).
    fn archive_status_names(&self, suffix: &str) -> Vec<String> {
        fs::read_dir(self.archive_status_dir())
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter_map(|n| n.strip_suffix(suffix).map(str::to_string))
                    .filter(|n| is_archivable_wal_name(n))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Marks `names`, waiting for the archive, archived (`.done`).
    fn mark_archived(&self, names: &[String]) {
        let dir = self.archive_status_dir();
        for name in names {
            let done = dir.join(format!("{name}.done"));
            let ready = dir.join(format!("{name}.ready"));
            if let Err(e) = fs::rename(&ready, &done) {
                tracing::warn!(file = %done.display(), error = %e, "cannot mark a WAL file archived");
            }
        }
    }

    /// Hands the archive the WAL files this (stopped) data directory still
    /// holds for it (`.ready` in `pg_wal/archive_status`), running the
    /// configured `archive_command` as PostgreSQL's archiver would. A
    /// former primary whose archiving lagged is about to lose them: to
    /// `pg_rewind`, to the end of single-user crash recovery, or to a
    /// standby's restart points, which remove them unarchived unless
    /// `archive_mode = always`; the archive would then have a gap no
    /// point-in-time recovery can cross. Failures are logged and leave the
    /// file waiting, as the archiver leaves it. Returns how many files
    /// went to the archive.
    pub fn archive_ready_wal(&self) -> usize {
        self.archive_waiting_wal(false)
    }

    /// [`Instance::archive_ready_wal`]; with `unless_always`, nothing when
    /// `archive_mode = always`, under which a standby keeps what waits and
    /// its own archiver sends it.
    fn archive_waiting_wal(&self, unless_always: bool) -> usize {
        let status_dir = self.archive_status_dir();
        let mut ready = self.archive_status_names(".ready");
        if ready.is_empty() {
            return 0;
        }
        // Segments in the order the archiver takes them; a timeline's
        // history file before the segments of that timeline.
        ready.sort_by_cached_key(|n| (!n.ends_with(".history"), n.clone()));
        let setting = |name: &str| {
            let mut cmd = self.command("postgres");
            cmd.arg("-D")
                .arg(&self.spec.datadir)
                .args(["-C", name])
                .stdin(Stdio::null());
            cmd.output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        };
        let mode = setting("archive_mode");
        if !matches!(mode.as_deref(), Some("on" | "always"))
            || (unless_always && mode.as_deref() == Some("always"))
        {
            return 0;
        }
        if setting("archive_library").is_some_and(|l| !l.is_empty()) {
            tracing::warn!(
                name = %self.spec.name,
                waiting = ready.len(),
                "WAL files still wait for the archive, and archive_library cannot be run outside the server: they may be removed unarchived"
            );
            return 0;
        }
        let Some(command) = setting("archive_command").filter(|c| !c.is_empty()) else {
            return 0;
        };
        let mut archived = 0;
        let budget = Instant::now() + ARCHIVE_BUDGET;
        for name in &ready {
            let segment = self.spec.datadir.join("pg_wal").join(name);
            let flag = status_dir.join(format!("{name}.ready"));
            if !segment.exists() || !flag.exists() {
                continue;
            }
            if Instant::now() >= budget {
                tracing::warn!(
                    name = %self.spec.name,
                    archived,
                    waiting = ready.len() - archived,
                    "stopped archiving the WAL the server had not archived after {}s: the rest may be removed unarchived",
                    ARCHIVE_BUDGET.as_secs()
                );
                break;
            }
            let line = archive_command_line(&command, &format!("pg_wal/{name}"), name);
            tracing::info!(name = %self.spec.name, file = %name, command = %line, "archiving WAL the server had not archived");
            match self.run_archive_command(&line) {
                Ok(()) => {
                    if let Err(e) = fs::rename(&flag, status_dir.join(format!("{name}.done"))) {
                        tracing::warn!(file = %name, error = %e, "archived, but cannot mark it done");
                    }
                    archived += 1;
                }
                Err(why) => {
                    // As the archiver does: the next file waits for this
                    // one, and a failing archive fails again at once.
                    tracing::warn!(name = %self.spec.name, file = %name, waiting = ready.len() - archived, "archive_command failed: {why}; the WAL still waiting may be removed unarchived");
                    break;
                }
            }
        }
        archived
    }

    /// Runs one archive command line through the shell in the data
    /// directory, as the archiver does. One that hangs is asked to stop
    /// (SIGTERM) after [`ARCHIVE_COMMAND_TIMEOUT`] and killed a little
    /// later.
    fn run_archive_command(&self, line: &str) -> std::result::Result<(), String> {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(line)
            .current_dir(&self.spec.datadir)
            .env("LC_ALL", "C")
            .env_remove("PGDATA")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        self.run_as.apply(&mut cmd);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn().map_err(|e| e.to_string())?;
        // Read while it runs: a command that writes more than a pipe holds
        // would otherwise wait on it. Through a channel, not a join: a
        // child the command left running in the background may hold the
        // pipe open long after.
        let (tx, rx) = std::sync::mpsc::channel();
        if let Some(mut e) = child.stderr.take() {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                let _ = e.read_to_end(&mut bytes);
                let _ = tx.send(String::from_utf8_lossy(&bytes).into_owned());
            });
        }
        let group = Pid::from_raw(-(child.id() as i32));
        let started = Instant::now();
        let mut asked_to_stop = false;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Ok(status),
                Ok(None) => {
                    let waited = started.elapsed();
                    if waited >= ARCHIVE_COMMAND_TIMEOUT + Duration::from_secs(10) {
                        let _ = kill(group, Signal::SIGKILL);
                    } else if waited >= ARCHIVE_COMMAND_TIMEOUT && !asked_to_stop {
                        let _ = kill(group, Signal::SIGTERM);
                        asked_to_stop = true;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => break Err(e.to_string()),
            }
        };
        let err = rx
            .recv_timeout(Duration::from_millis(500))
            .unwrap_or_default();
        match status? {
            s if s.success() => Ok(()),
            _ if asked_to_stop => Err(format!(
                "still running after {}s, stopped",
                ARCHIVE_COMMAND_TIMEOUT.as_secs()
            )),
            s => {
                let tail = err.trim();
                let from = (tail.len().saturating_sub(500)..tail.len())
                    .find(|&i| tail.is_char_boundary(i))
                    .unwrap_or(0);
                Err(format!("{s}: {}", &tail[from..]))
            }
        }
    }

    /// Resynchronises this (stopped) data directory with `source`, a
    /// libpq connection string of the new primary, after timelines forked.
    /// `password`, if any, goes through the environment: on the command
    /// line every local user could read it (`ps`).
    pub fn rewind(&mut self, source: &str, password: Option<&str>) -> Result<()> {
        self.refuse_while_running("pg_rewind")?;
        // pg_rewind removes WAL the source does not have.
        self.archive_ready_wal();
        let own = self.archive_status_names(".ready");
        let mut cmd = self.command("pg_rewind");
        if let Some(p) = password {
            cmd.env("PGPASSWORD", p);
        }
        cmd.arg("-D")
            .arg(&self.spec.datadir)
            .arg(format!("--source-server={source}"));
        if self.spec.no_sync {
            cmd.arg("--no-sync");
        }
        let res = run(cmd, "pg_rewind");
        // The source's archive status files come along: what waits there
        // is its archiver's to send (sent from here too, it would reach
        // the archive twice, and a command that refuses to overwrite would
        // fail on the source for ever), done here as a standby's received
        // WAL is. After a rewind that went through, this server's own
        // files that could not be archived just before may have been
        // replaced by the source's copies: done too. After one that
        // failed (often before touching anything: the source out of
        // reach), they are still this server's, and still wait.
        let after = self.archive_status_names(".ready");
        let done: Vec<String> = if res.is_ok() {
            after
        } else {
            after.into_iter().filter(|n| !own.contains(n)).collect()
        };
        self.mark_archived(&done);
        res?;
        // pg_rewind copies the source's files, ours included.
        self.write_settings()
    }

    /// Sets one `postgresql.conf` setting in pgwarden's settings file. A
    /// running server sees it after [`Instance::reload`] (or a restart for
    /// settings that need one).
    pub fn set_setting(&mut self, key: &str, value: &str) -> Result<()> {
        self.spec.settings.insert(key.into(), value.into());
        self.write_settings()
    }

    /// Takes `key` back from the settings file a previous run left in the
    /// data directory, as that run wrote it, so that the next write keeps
    /// it; its value, if the file has one. The file is not rewritten.
    pub fn adopt_written_setting(&mut self, key: &str) -> Option<String> {
        let text = fs::read_to_string(self.spec.datadir.join(SETTINGS_FILE)).ok()?;
        let prefix = format!("{key} = '");
        let quoted = text
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix(&prefix)?.strip_suffix('\''))?;
        // Undoes write_settings' escapes.
        let mut value = String::with_capacity(quoted.len());
        let mut chars = quoted.chars().peekable();
        while let Some(c) = chars.next() {
            if matches!(c, '\\' | '\'') && chars.peek() == Some(&c) {
                chars.next();
            }
            value.push(c);
        }
        self.spec.settings.insert(key.into(), value.clone());
        Some(value)
    }

    /// Removes a setting from pgwarden's settings file.
    pub fn remove_setting(&mut self, key: &str) -> Result<()> {
        self.spec.settings.remove(key);
        self.write_settings()
    }

    fn write_settings(&self) -> Result<()> {
        let mut text = String::from("# Written by pgwarden; edits are overwritten.\n");
        let _ = writeln!(text, "listen_addresses = '{}'", self.spec.host);
        let _ = writeln!(text, "port = {}", self.spec.port);
        // The probe and clients use TCP; a socket directory would tie the
        // instance to a path of this machine.
        let _ = writeln!(text, "unix_socket_directories = ''");
        let _ = writeln!(text, "cluster_name = '{}'", self.spec.name);
        let mut all: BTreeMap<&String, String> = self
            .spec
            .settings
            .iter()
            .chain(self.source_settings.iter())
            .map(|(k, v)| (k, v.clone()))
            .collect();
        // The primary's minimums hold only for a start in recovery, and
        // never lower a value configured higher since (which then shows
        // as pending a restart, as it should).
        let in_recovery = ["standby.signal", "recovery.signal"]
            .iter()
            .any(|f| self.spec.datadir.join(f).exists());
        if in_recovery {
            for (k, floor) in &self.standby_floors {
                let own = all.get(k).and_then(|v| v.parse::<i64>().ok());
                let floor_n = floor.parse::<i64>().ok();
                if own.is_none() || own < floor_n {
                    all.insert(k, floor.clone());
                }
            }
        }
        for (k, v) in all {
            // The configuration file reads a backslash in a quoted value
            // as an escape.
            let v = v.replace('\\', "\\\\").replace('\'', "''");
            let _ = writeln!(text, "{k} = '{v}'");
        }
        let path = self.spec.datadir.join(SETTINGS_FILE);
        fs::write(&path, text).map_err(io_err(&path))?;
        self.run_as.own(&path)
    }

    fn make_datadir(&self) -> Result<()> {
        let dir = &self.spec.datadir;
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io_err(dir))?;
        self.run_as.own(dir)
    }

    /// Starts the postmaster and waits until it accepts connections.
    pub fn start(&mut self) -> Result<()> {
        self.spawn()?;
        self.wait_ready(DEFAULT_DEADLINE)
    }

    /// Starts the postmaster without waiting for it to accept connections.
    pub fn spawn(&mut self) -> Result<()> {
        if self.is_running() {
            return Ok(());
        }
        let in_recovery = ["standby.signal", "recovery.signal"]
            .iter()
            .any(|f| self.spec.datadir.join(f).exists());
        if in_recovery {
            // A former primary starting as a standby: its restart points
            // would remove what it never archived.
            self.archive_waiting_wal(true);
        }
        let floors = self.floors_for_start();
        if floors != self.standby_floors {
            for (k, v) in &floors {
                tracing::info!(name = %self.spec.name, setting = %k, value = %v, "starting in recovery with the primary's value, which is higher");
            }
            self.standby_floors = floors;
            self.write_settings()?;
        }
        let log = self.log_path();
        // The server log holds failed statements' text (an ALTER ROLE's
        // password, say): for its owner only.
        let log_file = std::os::unix::fs::OpenOptionsExt::mode(
            fs::OpenOptions::new().create(true).append(true),
            0o600,
        )
        .open(&log)
        .map_err(io_err(&log))?;
        let log_err = log_file.try_clone().map_err(io_err(&log))?;
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(&self.spec.datadir)
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_err);
        // Own process group: a Ctrl-C in the terminal reaches us, and we
        // decide how the server stops.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        if self.spec.die_with_parent {
            crate::instance::die_with_parent(&mut cmd);
        }
        tracing::debug!(name = %self.spec.name, port = self.spec.port, "starting postgres");
        let child = cmd.spawn().map_err(|source| PgCtlError::Spawn {
            program: "postgres".into(),
            source,
        })?;
        self.child = Some(child);
        Ok(())
    }

    /// What [`STANDBY_MINIMUMS`] must be raised to for a start: nothing
    /// outside recovery, or where the configured value is high enough.
    fn floors_for_start(&self) -> BTreeMap<String, String> {
        let dir = &self.spec.datadir;
        let mut floors = BTreeMap::new();
        if !dir.join("standby.signal").exists() && !dir.join("recovery.signal").exists() {
            return floors;
        }
        let Ok(control) = self.controldata() else {
            return floors;
        };
        for (setting, field) in STANDBY_MINIMUMS {
            let Some(needed) = control.get(field).and_then(|v| v.parse::<i64>().ok()) else {
                continue;
            };
            // The files' value, unless it is the one raised here before
            // (the settings file holds it until the next write).
            let own = self
                .source_settings
                .get(setting)
                .or_else(|| self.spec.settings.get(setting))
                .and_then(|v| v.parse::<i64>().ok())
                .or_else(|| {
                    (!self.standby_floors.contains_key(setting))
                        .then(|| self.config_value(setting))
                        .flatten()
                });
            if own.is_none_or(|v| v < needed) {
                floors.insert(setting.to_string(), needed.to_string());
            }
        }
        floors
    }

    /// An integer setting as the configuration files give it
    /// (`postgres -C`).
    fn config_value(&self, setting: &str) -> Option<i64> {
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(&self.spec.datadir)
            .args(["-C", setting])
            .stdin(Stdio::null());
        let out = cmd.output().ok()?;
        if !out.status.success() {
            return None;
        }
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    }

    /// Waits until the server accepts connections (`pg_isready`), failing
    /// early if the postmaster exits.
    pub fn wait_ready(&mut self, deadline: Duration) -> Result<()> {
        let until = Instant::now() + deadline;
        loop {
            if let Some(child) = &mut self.child {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(PgCtlError::Exited {
                        status: status.to_string(),
                        log_tail: self.log_tail(),
                    });
                }
            }
            let mut cmd = Command::new(self.bins.path("pg_isready"));
            cmd.args([
                "-h",
                &self.spec.host,
                "-p",
                &self.spec.port.to_string(),
                "-t",
                "1",
            ])
            .args(["-d", "postgres", "-U", "postgres"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
            if cmd.status().map(|s| s.success()).unwrap_or(false) {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(self.timeout("server start", deadline));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The postmaster's pid: our child's, or the one in `postmaster.pid`
    /// when the server was started by someone else.
    pub fn postmaster_pid(&mut self) -> Option<i32> {
        if let Some(child) = &mut self.child {
            match child.try_wait() {
                Ok(None) => return Some(child.id() as i32),
                _ => self.child = None,
            }
        }
        let pidfile = self.spec.datadir.join("postmaster.pid");
        let text = fs::read_to_string(pidfile).ok()?;
        let pid: i32 = text.lines().next()?.trim().parse().ok()?;
        kill(Pid::from_raw(pid), None).ok()?;
        let file_start = text.lines().nth(2).and_then(|l| l.trim().parse().ok());
        postmaster_of(pid, &self.spec.datadir, file_start).then_some(pid)
    }

    /// Whether a postmaster runs for this data directory.
    ///
    /// A `postmaster.pid` left by a server that did not stop (a power loss)
    /// may name a pid that now belongs to another process: such a file
    /// does not count, or the server would never be started again and the
    /// other process would be signalled in its place.
    pub fn is_running(&mut self) -> bool {
        self.postmaster_pid().is_some()
    }

    /// Stops the server and waits for the postmaster to exit.
    ///
    /// An immediate stop is what an HA agent uses when the server must stop
    /// taking writes now; a postmaster that has not exited within
    /// [`IMMEDIATE_DEADLINE`] (frozen, say, by SIGSTOP or a stuck disk) is
    /// killed with its children, so the stop is certain and bounded.
    pub fn stop(&mut self, mode: StopMode) -> Result<()> {
        let Some(pid) = self.postmaster_pid() else {
            return Ok(());
        };
        let _ = kill(Pid::from_raw(pid), mode.signal());
        if mode == StopMode::Immediate {
            if !self.wait_exit(pid, IMMEDIATE_DEADLINE) {
                self.kill9();
            }
            return Ok(());
        }
        if self.wait_exit(pid, DEFAULT_DEADLINE) {
            Ok(())
        } else {
            Err(self.timeout("server stop", DEFAULT_DEADLINE))
        }
    }

    /// Kills the postmaster and all its children with SIGKILL, as a node
    /// crash would. The postmaster is frozen first so it cannot fork while
    /// its children are collected.
    pub fn kill9(&mut self) {
        let Some(pid) = self.postmaster_pid() else {
            return;
        };
        let pm = Pid::from_raw(pid);
        let _ = kill(pm, Signal::SIGSTOP);
        for c in children_of(pid) {
            let _ = kill(Pid::from_raw(c), Signal::SIGKILL);
        }
        let _ = kill(pm, Signal::SIGKILL);
        self.wait_exit(pid, Duration::from_secs(10));
    }

    /// Sends a signal to the postmaster (e.g. SIGSTOP to freeze it).
    pub fn signal(&mut self, sig: Signal) -> Result<()> {
        if let Some(pid) = self.postmaster_pid() {
            let _ = kill(Pid::from_raw(pid), sig);
        }
        Ok(())
    }

    /// Makes the server re-read its configuration (SIGHUP).
    pub fn reload(&mut self) -> Result<()> {
        self.signal(Signal::SIGHUP)
    }

    /// Promotes a standby and waits until it accepts writes (`pg_ctl
    /// promote -w`).
    pub fn promote(&mut self) -> Result<()> {
        let mut cmd = self.command("pg_ctl");
        cmd.arg("promote").arg("-D").arg(&self.spec.datadir).args([
            "-w",
            "-t",
            &DEFAULT_DEADLINE.as_secs().to_string(),
        ]);
        run(cmd, "pg_ctl promote")?;
        let signal = self.spec.datadir.join("standby.signal");
        let _ = fs::remove_file(signal);
        self.spec.settings.remove("primary_conninfo");
        self.spec.settings.remove("primary_slot_name");
        self.set_upstream(None);
        self.write_settings()
    }

    /// The last lines of the server log.
    pub fn log_tail(&self) -> String {
        tail(&self.log_path(), 4096)
    }

    fn wait_exit(&mut self, pid: i32, deadline: Duration) -> bool {
        let until = Instant::now() + deadline;
        loop {
            let gone = match &mut self.child {
                Some(child) if child.id() as i32 == pid => match child.try_wait() {
                    Ok(Some(_)) | Err(_) => {
                        self.child = None;
                        true
                    }
                    Ok(None) => false,
                },
                _ => kill(Pid::from_raw(pid), None).is_err(),
            };
            if gone {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn timeout(&self, what: &str, deadline: Duration) -> PgCtlError {
        PgCtlError::Timeout {
            what: what.into(),
            secs: deadline.as_secs(),
            log_tail: self.log_tail(),
        }
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bins.path(program));
        cmd.env("LC_ALL", "C").env_remove("PGDATA");
        self.run_as.apply(&mut cmd);
        cmd
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // Only a server we started ourselves is ours to stop.
        if let Some(child) = &mut self.child {
            if let Ok(None) = child.try_wait() {
                let pid = child.id() as i32;
                let _ = kill(Pid::from_raw(pid), Signal::SIGQUIT);
                if !self.wait_exit(pid, Duration::from_secs(10)) {
                    self.kill9();
                }
            }
        }
    }
}

#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only makes the
    // async-signal-safe prctl system call.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGQUIT).map_err(std::io::Error::from)
        });
    }
}

/// How long one `archive_command` run by the agent may take.
const ARCHIVE_COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the agent goes on archiving what a server left waiting before
/// it gives up on the rest: a start or a rewind waits for it.
const ARCHIVE_BUDGET: Duration = Duration::from_secs(120);

/// Whether `name` is a WAL file the archiver takes: a segment, a segment's
/// `.partial` remainder, a timeline history file or a backup history file.
fn is_archivable_wal_name(name: &str) -> bool {
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_lowercase())
    };
    if let Some(tli) = name.strip_suffix(".history") {
        return hex(tli, 8);
    }
    if let Some(seg) = name.strip_suffix(".partial") {
        return hex(seg, 24);
    }
    if let Some(rest) = name.strip_suffix(".backup") {
        return rest
            .split_once('.')
            .is_some_and(|(seg, off)| hex(seg, 24) && hex(off, 8));
    }
    hex(name, 24)
}

/// `archive_command` with its placeholders filled in as PostgreSQL's
/// archiver fills them: `%p` the file's path from the data directory, `%f`
/// its name, `%%` a percent sign; any other `%` stays as it is.
fn archive_command_line(command: &str, path: &str, file: &str) -> String {
    let mut out = String::with_capacity(command.len() + path.len());
    let mut chars = command.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('p') => {
                out.push_str(path);
                chars.next();
            }
            Some('f') => {
                out.push_str(file);
                chars.next();
            }
            Some('%') => {
                out.push('%');
                chars.next();
            }
            _ => out.push('%'),
        }
    }
    out
}

fn run(mut cmd: Command, program: &str) -> Result<()> {
    let out = cmd.output().map_err(|source| PgCtlError::Spawn {
        program: program.into(),
        source,
    })?;
    if out.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stdout));
    let start = text.len().saturating_sub(2000);
    let start = (start..text.len())
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(0);
    Err(PgCtlError::CommandFailed {
        program: program.into(),
        status: out.status.to_string(),
        output: text[start..].trim().to_string(),
    })
}

fn children_of(pid: i32) -> Vec<i32> {
    fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect()
}

fn tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// `value` as a libpq connection string takes it: as it is when it holds
/// nothing special, else in single quotes with backslashes and single
/// quotes escaped, so that a password or a name with spaces, quotes or
/// backslashes reaches the server as written.
pub fn conninfo_value(value: &str) -> String {
    let plain = !value.is_empty()
        && !value
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '\'' | '\\' | '='));
    if plain {
        return value.to_string();
    }
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Whether `pid` is a postmaster of `datadir`, whose `postmaster.pid`
/// gives `file_start` as its start time (Unix seconds): not this process
/// or its parent (PostgreSQL ignores those in a lock file too), and see
/// [`judge_postmaster`].
fn postmaster_of(pid: i32, datadir: &Path, file_start: Option<i64>) -> bool {
    if pid <= 0 || pid as u32 == std::process::id() || pid == nix::unistd::getppid().as_raw() {
        return false;
    }
    let seen = SeenProcess {
        cwd: fs::read_link(format!("/proc/{pid}/cwd")),
        name_and_start: process_name_and_start(pid),
    };
    judge_postmaster(&seen, fs::canonicalize(datadir).ok().as_deref(), file_start)
}

/// What can be read of a process in `/proc`.
struct SeenProcess {
    /// Its working directory; unreadable (`EACCES`) for another user's
    /// process without `CAP_SYS_PTRACE`, which containers often lack.
    cwd: std::io::Result<PathBuf>,
    /// Its executable's name and start time (Unix seconds), readable by all.
    name_and_start: Option<(String, i64)>,
}

/// How far a postmaster's start time in its `postmaster.pid` may be from
/// its process's (the file is written a moment after the start).
const START_TIME_SLACK: i64 = 5;

/// Whether the process seen is the postmaster of the data directory
/// `datadir`: one working there, where a postmaster changes to at start;
/// where that cannot be read, a `postgres` process started when the file
/// says. A process that cannot be judged at all counts as one: taking a
/// live server for none would start a second on its data directory, or
/// rewrite it under the first.
fn judge_postmaster(seen: &SeenProcess, datadir: Option<&Path>, file_start: Option<i64>) -> bool {
    match &seen.cwd {
        Ok(cwd) => datadir.is_some_and(|d| d == cwd),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(_) => match (&seen.name_and_start, file_start) {
            (Some((name, started)), Some(file)) => {
                name == "postgres" && (started - file).abs() <= START_TIME_SLACK
            }
            (Some((name, _)), None) => name == "postgres",
            (None, _) => true,
        },
    }
}

/// `pid`'s executable name and start time in Unix seconds, from
/// `/proc/PID/stat` (clock ticks since boot) and `/proc/stat` (boot time).
fn process_name_and_start(pid: i32) -> Option<(String, i64)> {
    // Linux reports process times in USER_HZ, 100 on every architecture
    // pgwarden runs on.
    const TICKS_PER_SECOND: i64 = 100;
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_string();
    // Field 22, starttime; `rest` begins with field 3.
    let ticks: i64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let boot: i64 = fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some((name, boot + ticks / TICKS_PER_SECOND))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_commands_are_filled_in_as_the_archiver_fills_them() {
        assert_eq!(
            archive_command_line("cp %p /a/%f && echo 100%% %x%", "pg_wal/F", "F"),
            "cp pg_wal/F /a/F && echo 100% %x%"
        );
        for ok in [
            "000000010000000000000003",
            "000000010000000000000003.partial",
            "00000002.history",
            "000000010000000000000003.00000028.backup",
        ] {
            assert!(is_archivable_wal_name(ok), "{ok}");
        }
        for not in [
            "00000001000000000000000",
            "000000010000000000000003.tmp",
            "0000000a0000000000000003",
            "xlogtemp.123",
            "0000002.history",
        ] {
            assert!(!is_archivable_wal_name(not), "{not}");
        }
    }

    /// A data directory whose fake `postgres -C` answers with `settings`,
    /// and WAL files: `ready` wait for the archive, `done` are archived.
    fn archiving_rig(
        settings: &[(&str, &str)],
        ready: &[&str],
        done: &[&str],
    ) -> (tempfile::TempDir, Instance) {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        fs::create_dir(&bin).unwrap();
        // Single-user mode notes its arguments; pg_rewind brings over a
        // file waiting for the source's archiver, then exits with the
        // status in ../rewind_status.
        let mut script = String::from(
            "#!/bin/sh\nif [ \"$1\" = --single ]; then echo \"$@\" > \"$4/../during\"; exit 0; fi\ncase \"$4\" in\n",
        );
        for (k, v) in settings {
            script.push_str(&format!("{k}) printf '%s\\n' '{v}' ;;\n"));
        }
        script.push_str("*) exit 1 ;;\nesac\n");
        let postgres = bin.join("postgres");
        fs::write(&postgres, script).unwrap();
        let rewind = bin.join("pg_rewind");
        fs::write(
            &rewind,
            "#!/bin/sh\nd=$2\necho source > $d/pg_wal/00000002.history\n\
             touch $d/pg_wal/archive_status/00000002.history.ready\nexit $(cat $d/../rewind_status)\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        for f in [&postgres, &rewind] {
            fs::set_permissions(f, fs::Permissions::from_mode(0o755)).unwrap();
        }
        let data = dir.path().join("data");
        let status = data.join("pg_wal/archive_status");
        fs::create_dir_all(&status).unwrap();
        fs::create_dir(dir.path().join("archive")).unwrap();
        for (names, flag) in [(ready, "ready"), (done, "done")] {
            for n in names {
                fs::write(data.join("pg_wal").join(n), format!("wal {n}")).unwrap();
                fs::write(status.join(format!("{n}.{flag}")), "").unwrap();
            }
        }
        let spec = InstanceSpec::new("n1", &data, 5432);
        (
            dir,
            Instance::new(spec, PgBinaries::at(bin), RunAs::current()),
        )
    }

    #[test]
    fn wal_waiting_for_the_archive_is_archived_and_marked_done() {
        let ready = [
            "000000010000000000000004",
            "000000010000000000000003",
            "00000002.history",
        ];
        let (dir, i) = archiving_rig(
            &[
                ("archive_mode", "on"),
                ("archive_library", ""),
                (
                    "archive_command",
                    "test ! -f ../archive/%f && cp %p ../archive/%f",
                ),
            ],
            &ready,
            &["000000010000000000000002"],
        );
        // A flag without its file (removed by hand) is left alone.
        let status = dir.path().join("data/pg_wal/archive_status");
        fs::write(status.join("000000010000000000000009.ready"), "").unwrap();
        assert_eq!(i.archive_ready_wal(), 3);
        for n in ready {
            assert_eq!(
                fs::read_to_string(dir.path().join("archive").join(n)).unwrap(),
                format!("wal {n}")
            );
            assert!(status.join(format!("{n}.done")).exists(), "{n}");
            assert!(!status.join(format!("{n}.ready")).exists(), "{n}");
        }
        assert!(!dir.path().join("archive/000000010000000000000002").exists());
        assert!(status.join("000000010000000000000009.ready").exists());
        // Nothing left to do.
        assert_eq!(i.archive_ready_wal(), 0);
    }

    const ARCHIVING: [(&str, &str); 3] = [
        ("archive_mode", "on"),
        ("archive_library", ""),
        (
            "archive_command",
            "test ! -f ../archive/%f && cp %p ../archive/%f",
        ),
    ];

    #[test]
    fn crash_recovery_keeps_every_segment_and_archives_what_waits_first() {
        let (dir, mut i) = archiving_rig(
            &ARCHIVING,
            &["000000010000000000000003"],
            &["000000010000000000000002"],
        );
        i.recover_single_user().unwrap();
        assert!(dir.path().join("archive/000000010000000000000003").exists());
        // Archiving off (nothing is sent from single-user mode), and no
        // segment removed or recycled at the end of recovery.
        let during = fs::read_to_string(dir.path().join("during")).unwrap();
        assert!(
            during.contains("-c archive_mode=off -c wal_keep_size=2147483647"),
            "{during}"
        );
        let status = dir.path().join("data/pg_wal/archive_status");
        assert!(status.join("000000010000000000000002.done").exists());
        assert!(status.join("000000010000000000000003.done").exists());
    }

    #[test]
    fn a_rewind_archives_what_waits_and_never_sends_what_the_source_brought() {
        for exit in [0, 1] {
            let (dir, mut i) = archiving_rig(&ARCHIVING, &["000000010000000000000003"], &[]);
            fs::write(dir.path().join("rewind_status"), exit.to_string()).unwrap();
            assert_eq!(i.rewind("host=x", None).is_ok(), exit == 0);
            assert!(dir.path().join("archive/000000010000000000000003").exists());
            // The source's history file, still waiting for its archiver,
            // came along: done here, done or not the rewind.
            let status = dir.path().join("data/pg_wal/archive_status");
            assert!(status.join("00000002.history.done").exists(), "exit {exit}");
            assert_eq!(i.archive_ready_wal(), 0);
            assert!(!dir.path().join("archive/00000002.history").exists());
        }
    }

    #[test]
    fn a_failed_rewind_leaves_what_could_not_be_archived_waiting() {
        let mut settings = ARCHIVING;
        settings[2] = ("archive_command", "exit 1");
        let (dir, mut i) = archiving_rig(&settings, &["000000010000000000000003"], &[]);
        fs::write(dir.path().join("rewind_status"), "1").unwrap();
        assert!(i.rewind("host=x", None).is_err());
        let status = dir.path().join("data/pg_wal/archive_status");
        assert!(status.join("000000010000000000000003.ready").exists());
        assert!(status.join("00000002.history.done").exists());
    }

    #[test]
    fn an_archive_command_leaving_a_child_behind_does_not_hold_the_agent() {
        let mut settings = ARCHIVING;
        settings[2] = (
            "archive_command",
            "sleep 30 & echo $! > ../background; cp %p ../archive/%f",
        );
        let (dir, i) = archiving_rig(&settings, &["000000010000000000000003"], &[]);
        let started = Instant::now();
        assert_eq!(i.archive_ready_wal(), 1);
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        assert!(dir.path().join("archive/000000010000000000000003").exists());
        let pid: i32 = fs::read_to_string(dir.path().join("background"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }

    #[test]
    fn a_directory_filled_by_a_command_sends_nothing_its_source_had_waiting() {
        let (dir, mut i) = archiving_rig(&ARCHIVING, &[], &[]);
        let data = dir.path().join("data");
        fs::remove_dir_all(&data).unwrap();
        let fill = "d=$1; mkdir -p $d/pg_wal/archive_status; echo 15 > $d/PG_VERSION; \
                    touch $d/postgresql.conf $d/pg_wal/000000010000000000000005 \
                    $d/pg_wal/archive_status/000000010000000000000005.ready";
        i.restore_with(
            "snapshot",
            fill,
            &[data.display().to_string()],
            &BTreeMap::new(),
        )
        .unwrap();
        assert!(data
            .join("pg_wal/archive_status/000000010000000000000005.done")
            .exists());
        assert_eq!(i.archive_ready_wal(), 0);
    }

    #[test]
    fn archiving_stops_at_the_first_failure_as_the_archiver_does() {
        let (dir, i) = archiving_rig(
            &[
                ("archive_mode", "on"),
                ("archive_library", ""),
                // Fails on the first, with more output than a pipe holds.
                (
                    "archive_command",
                    "if [ %f = 000000010000000000000003 ]; then head -c 200000 /dev/zero | tr '\\0' x >&2; exit 3; fi; cp %p ../archive/%f",
                ),
            ],
            &["000000010000000000000003", "000000010000000000000004"],
            &[],
        );
        assert_eq!(i.archive_ready_wal(), 0);
        assert!(!dir.path().join("archive/000000010000000000000004").exists());
        let status = dir.path().join("data/pg_wal/archive_status");
        assert!(status.join("000000010000000000000004.ready").exists());
    }

    #[test]
    fn a_standby_start_leaves_what_waits_to_its_own_archiver_under_always() {
        let mut settings = ARCHIVING;
        settings[0] = ("archive_mode", "always");
        let (dir, i) = archiving_rig(&settings, &["000000010000000000000003"], &[]);
        assert_eq!(i.archive_waiting_wal(true), 0);
        assert!(!dir.path().join("archive/000000010000000000000003").exists());
        assert_eq!(i.archive_waiting_wal(false), 1);
    }

    #[test]
    fn wal_stays_waiting_when_the_archive_fails_or_archiving_is_off() {
        let seg = "000000010000000000000003";
        let ready = |dir: &tempfile::TempDir| {
            dir.path()
                .join("data/pg_wal/archive_status")
                .join(format!("{seg}.ready"))
                .exists()
        };
        let (dir, i) = archiving_rig(
            &[
                ("archive_mode", "on"),
                ("archive_library", ""),
                ("archive_command", "exit 1"),
            ],
            &[seg],
            &[],
        );
        assert_eq!(i.archive_ready_wal(), 0);
        assert!(ready(&dir));
        let (dir, i) = archiving_rig(
            &[
                ("archive_mode", "off"),
                ("archive_library", ""),
                ("archive_command", "cp %p ../archive/%f"),
            ],
            &[seg],
            &[],
        );
        assert_eq!(i.archive_ready_wal(), 0);
        assert!(ready(&dir) && !dir.path().join("archive").join(seg).exists());
        // A library cannot be run from here.
        let (dir, i) = archiving_rig(
            &[
                ("archive_mode", "always"),
                ("archive_library", "basic_archive"),
                ("archive_command", ""),
            ],
            &[seg],
            &[],
        );
        assert_eq!(i.archive_ready_wal(), 0);
        assert!(ready(&dir));
    }

    /// A `postmaster.pid` naming a process that is not this directory's
    /// postmaster (its pid reused after a power loss) is no server: it is
    /// neither adopted nor signalled.
    #[test]
    fn a_stale_pid_file_naming_another_process_is_no_server() {
        let dir = tempfile::tempdir().unwrap();
        let spec = InstanceSpec::new("n1", dir.path(), 5432);
        let mut i = Instance::new(spec, PgBinaries::at("/nonexistent"), RunAs::current());
        let mut other = Command::new("sleep").arg("60").spawn().unwrap();
        fs::write(
            dir.path().join("postmaster.pid"),
            format!("{}\n{}\n", other.id(), dir.path().display()),
        )
        .unwrap();
        assert_eq!(i.postmaster_pid(), None);
        assert!(!i.is_running());
        i.stop(StopMode::Immediate).unwrap();
        assert_eq!(
            other.try_wait().unwrap(),
            None,
            "the other process was signalled"
        );
        // Nor this process itself.
        fs::write(
            dir.path().join("postmaster.pid"),
            format!("{}\n", std::process::id()),
        )
        .unwrap();
        assert_eq!(i.postmaster_pid(), None);
        // A process working in the directory, as a postmaster does, is one.
        let mut inside = Command::new("sleep")
            .arg("60")
            .current_dir(dir.path())
            .spawn()
            .unwrap();
        fs::write(
            dir.path().join("postmaster.pid"),
            format!("{}\n", inside.id()),
        )
        .unwrap();
        assert_eq!(i.postmaster_pid(), Some(inside.id() as i32));
        let _ = other.kill();
        let _ = inside.kill();
        let _ = other.wait();
        let _ = inside.wait();
    }

    /// Wiping empties the data directory but keeps it, and the symbolic
    /// link it may be (a volume mounted elsewhere); never under a live
    /// postmaster.
    #[test]
    fn wiping_keeps_the_directory_and_never_runs_under_a_server() {
        let dir = tempfile::tempdir().unwrap();
        let volume = dir.path().join("volume");
        fs::create_dir_all(volume.join("base/1")).unwrap();
        fs::write(volume.join("PG_VERSION"), "15\n").unwrap();
        std::os::unix::fs::symlink(volume.join("base"), volume.join("linked")).unwrap();
        let data = dir.path().join("data");
        std::os::unix::fs::symlink(&volume, &data).unwrap();
        let spec = InstanceSpec::new("n1", &data, 5432);
        let mut i = Instance::new(spec, PgBinaries::at("/nonexistent"), RunAs::current());
        // A server running there: nothing is touched.
        let mut server = Command::new("sleep")
            .arg("60")
            .current_dir(&volume)
            .spawn()
            .unwrap();
        fs::write(volume.join("postmaster.pid"), format!("{}\n", server.id())).unwrap();
        let e = i.wipe().unwrap_err();
        assert!(matches!(e, PgCtlError::StillRunning { .. }), "{e}");
        assert!(volume.join("PG_VERSION").exists());
        assert!(matches!(
            i.rewind("host=x", None).unwrap_err(),
            PgCtlError::StillRunning { .. }
        ));
        let _ = server.kill();
        let _ = server.wait();
        i.wipe().unwrap();
        assert!(fs::symlink_metadata(&data)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(fs::read_dir(&volume).unwrap().count(), 0);
        // Emptied or missing alike.
        i.wipe().unwrap();
        let gone = InstanceSpec::new("n2", dir.path().join("none"), 5432);
        Instance::new(gone, PgBinaries::at("/nonexistent"), RunAs::current())
            .wipe()
            .unwrap();
    }

    /// Where a process's working directory cannot be read (another user's,
    /// without CAP_SYS_PTRACE), its name and start time decide; where
    /// nothing can be read, it counts as the server.
    #[test]
    fn a_postmaster_is_judged_by_what_can_be_read_of_it() {
        use std::io::{Error, ErrorKind};
        let dir = Path::new("/data/n1");
        let seen = |cwd: std::io::Result<PathBuf>, name: Option<(&str, i64)>| SeenProcess {
            cwd,
            name_and_start: name.map(|(n, s)| (n.to_string(), s)),
        };
        let denied = || Err(Error::from(ErrorKind::PermissionDenied));
        let gone = || Err(Error::from(ErrorKind::NotFound));
        assert!(judge_postmaster(
            &seen(Ok(dir.into()), None),
            Some(dir),
            None
        ));
        assert!(!judge_postmaster(
            &seen(Ok("/".into()), None),
            Some(dir),
            None
        ));
        assert!(!judge_postmaster(
            &seen(gone(), Some(("postgres", 100))),
            Some(dir),
            Some(100)
        ));
        assert!(judge_postmaster(
            &seen(denied(), Some(("postgres", 102))),
            Some(dir),
            Some(100)
        ));
        // A pid reused after a reboot: started long after the file says.
        assert!(!judge_postmaster(
            &seen(denied(), Some(("postgres", 9_000))),
            Some(dir),
            Some(100)
        ));
        assert!(!judge_postmaster(
            &seen(denied(), Some(("sshd", 100))),
            Some(dir),
            Some(100)
        ));
        assert!(judge_postmaster(
            &seen(denied(), None),
            Some(dir),
            Some(100)
        ));
        // The time this process reads of itself is its start.
        let (name, started) = process_name_and_start(std::process::id() as i32).unwrap();
        assert!(!name.is_empty());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        assert!(
            started <= now + 1 && started > now - 3600,
            "{started} vs {now}"
        );
    }

    fn settings_lines(i: &Instance, key: &str) -> Vec<String> {
        let text = fs::read_to_string(i.datadir().join(SETTINGS_FILE)).unwrap();
        text.lines()
            .filter(|l| l.starts_with(&format!("{key} = ")))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn a_restore_fills_the_directory_and_recovers_with_settings_it_can_drop() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let spec = InstanceSpec::new("n1", &data, 5432);
        let mut i = Instance::new(spec, PgBinaries::at("/nonexistent"), RunAs::current());
        fs::create_dir(&data).unwrap();
        i.set_setting("restore_command", "cp /own/%f %p").unwrap();
        let recovery = BTreeMap::from([
            (
                "restore_command".to_string(),
                "cp /backup/%f %p".to_string(),
            ),
            (
                "recovery_target_time".to_string(),
                "2026-12-05 12:00:00+00".to_string(),
            ),
        ]);
        let args = [data.display().to_string()];
        // A command that fails, and one that succeeds without leaving a
        // data directory, are both errors.
        let e = i
            .restore_with("bootstrap", "false", &args, &recovery)
            .unwrap_err();
        assert!(e.to_string().contains("bootstrap"), "{e}");
        let e = i
            .restore_with("bootstrap", "true", &args, &recovery)
            .unwrap_err();
        assert!(e.to_string().contains("left no data directory"), "{e}");
        // A "backup" of a standby: PG_VERSION, a postgresql.conf that does
        // not include pgwarden's file, and a standby.signal.
        let fake = "d=$1; echo 15 > $d/PG_VERSION; echo \"port = 1\" > $d/postgresql.conf; touch $d/standby.signal; true";
        i.restore_with("bootstrap", fake, &args, &recovery).unwrap();
        assert!(data.join("recovery.signal").exists());
        assert!(!data.join("standby.signal").exists());
        let conf = fs::read_to_string(data.join("postgresql.conf")).unwrap();
        assert!(
            conf.contains("include_if_exists = 'pgwarden.conf'"),
            "{conf}"
        );
        assert_eq!(
            settings_lines(&i, "restore_command"),
            ["restore_command = 'cp /backup/%f %p'"]
        );
        assert_eq!(settings_lines(&i, "recovery_target_time").len(), 1);
        // Out of recovery: the node's own settings are back.
        i.set_source_settings(BTreeMap::new()).unwrap();
        assert_eq!(
            settings_lines(&i, "restore_command"),
            ["restore_command = 'cp /own/%f %p'"]
        );
        assert!(settings_lines(&i, "recovery_target_time").is_empty());
    }

    #[test]
    fn a_setting_written_by_an_earlier_run_is_taken_back_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let spec = InstanceSpec::new("n1", dir.path(), 5432);
        let mut i = Instance::new(
            spec.clone(),
            PgBinaries::at("/nonexistent"),
            RunAs::current(),
        );
        let names = r#"FIRST 1 ("n2", "it's \ odd")"#;
        i.set_setting("synchronous_standby_names", names).unwrap();
        i.set_setting("work_mem", "4MB").unwrap();
        // A new run knows nothing of it, and would write the file without
        // it, until it takes it back.
        let mut next = Instance::new(spec, PgBinaries::at("/nonexistent"), RunAs::current());
        assert_eq!(next.adopt_written_setting("missing"), None);
        assert_eq!(
            next.adopt_written_setting("synchronous_standby_names")
                .as_deref(),
            Some(names)
        );
        next.set_setting("shared_buffers", "16MB").unwrap();
        let mut again = Instance::new(
            InstanceSpec::new("n1", dir.path(), 5432),
            PgBinaries::at("/nonexistent"),
            RunAs::current(),
        );
        assert_eq!(
            again
                .adopt_written_setting("synchronous_standby_names")
                .as_deref(),
            Some(names)
        );
        assert_eq!(again.adopt_written_setting("work_mem"), None);
    }

    /// A primary's minimum raised for a start in recovery never lowers a
    /// value configured higher since, and goes once out of recovery.
    #[test]
    fn raised_minimums_hold_only_below_the_configured_value_and_in_recovery() {
        let dir = tempfile::tempdir().unwrap();
        let spec = InstanceSpec::new("n1", dir.path(), 5432);
        let mut i = Instance::new(spec, PgBinaries::at("/nonexistent"), RunAs::current());
        fs::write(dir.path().join("standby.signal"), "").unwrap();
        i.standby_floors =
            BTreeMap::from([("max_locks_per_transaction".to_string(), "128".to_string())]);
        let locks = |i: &Instance| settings_lines(i, "max_locks_per_transaction");
        i.set_setting("work_mem", "4MB").unwrap();
        assert_eq!(locks(&i), ["max_locks_per_transaction = '128'"]);
        i.set_setting("max_locks_per_transaction", "256").unwrap();
        assert_eq!(locks(&i), ["max_locks_per_transaction = '256'"]);
        i.set_setting("max_locks_per_transaction", "64").unwrap();
        assert_eq!(locks(&i), ["max_locks_per_transaction = '128'"]);
        fs::remove_file(dir.path().join("standby.signal")).unwrap();
        i.set_setting("work_mem", "8MB").unwrap();
        assert_eq!(locks(&i), ["max_locks_per_transaction = '64'"]);
    }

    #[test]
    fn a_source_s_settings_win_while_it_is_followed_and_go_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let spec = InstanceSpec::new("n1", dir.path(), 5432);
        let mut i = Instance::new(spec, PgBinaries::at("/nonexistent"), RunAs::current());
        i.set_setting("restore_command", "cp /own/%f %p").unwrap();
        i.follow("10.0.0.5", 5432, "replicator").unwrap();
        let remote = BTreeMap::from([
            (
                "restore_command".to_string(),
                "cp /remote/%f %p".to_string(),
            ),
            ("archive_cleanup_command".to_string(), "true".to_string()),
        ]);
        i.set_source_settings(remote.clone()).unwrap();
        assert_eq!(
            settings_lines(&i, "restore_command"),
            ["restore_command = 'cp /remote/%f %p'"]
        );
        assert_eq!(
            settings_lines(&i, "archive_cleanup_command"),
            ["archive_cleanup_command = 'true'"]
        );
        // Following the same source again (a new replication user, say)
        // keeps them.
        i.follow("10.0.0.5", 5432, "other").unwrap();
        assert_eq!(i.source_settings(), &remote);
        assert_eq!(
            settings_lines(&i, "restore_command"),
            ["restore_command = 'cp /remote/%f %p'"]
        );
        // Another source: the node's own setting is back.
        i.follow("10.0.0.6", 5432, "replicator").unwrap();
        assert!(i.source_settings().is_empty());
        assert_eq!(
            settings_lines(&i, "restore_command"),
            ["restore_command = 'cp /own/%f %p'"]
        );
        assert!(settings_lines(&i, "archive_cleanup_command").is_empty());
        // Nor do they outlive the end of recovery.
        i.set_source_settings(remote).unwrap();
        i.clear_standby().unwrap();
        assert_eq!(
            settings_lines(&i, "restore_command"),
            ["restore_command = 'cp /own/%f %p'"]
        );
    }
}
