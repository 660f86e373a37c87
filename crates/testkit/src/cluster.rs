//! Real PostgreSQL clusters for tests.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pgwarden_pgctl::{
    ClusterSpec, Instance, LocalCluster, PgBinaries, PgCtlError, RunAs, SyncSpec,
};

/// Prefix of every directory the kit creates under the temp dir; the
/// creating process id follows, so leftovers of dead runs can be found.
pub(crate) const DIR_PREFIX: &str = "pgwarden-test-";

/// A free TCP port on 127.0.0.1, reserved for this test process.
///
/// Ports come from below the kernel's ephemeral range, so no outgoing
/// connection takes them, and each is reserved with a file created
/// exclusively under the temp dir, so two test processes running at once
/// never get the same port (asking the kernel for port 0 and closing it
/// again lets the next process get the same one). Reservations of dead
/// processes are taken over.
pub fn free_port() -> u16 {
    let dir = std::env::temp_dir().join("pgwarden-test-ports");
    let _ = std::fs::create_dir_all(&dir);
    let hi = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768)
        .saturating_sub(1);
    let lo = 10_000u16.min(hi.saturating_sub(1000));
    let mut x = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        ^ (u64::from(std::process::id()) << 32)
        | 1;
    for _ in 0..10_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let port = lo + (x % u64::from(hi - lo)) as u16;
        let path = dir.join(port.to_string());
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(mut f) => {
                use std::io::Write;
                let _ = write!(f, "{}", std::process::id());
                if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                    return port;
                }
                // In use outside the tests: leave it reserved, try another.
            }
            Err(_) => {
                let owner = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok());
                let dead = owner.is_none_or(|pid| !PathBuf::from(format!("/proc/{pid}")).exists());
                if dead && owner.is_some() {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }
    // Fall back to the kernel's choice.
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Builder of a [`TestCluster`]: `TestCluster::builder().replicas(2).start()`.
#[derive(Debug, Default)]
pub struct TestClusterBuilder {
    replicas: usize,
    sync: Option<SyncSpec>,
    delayed: Option<Duration>,
    settings: BTreeMap<String, String>,
}

impl TestClusterBuilder {
    /// Number of streaming replicas besides the primary.
    pub fn replicas(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }

    /// Synchronous replication over the non-delayed replicas.
    pub fn sync(mut self, spec: SyncSpec) -> Self {
        self.sync = Some(spec);
        self
    }

    /// Makes the last replica a delayed replica.
    pub fn delayed(mut self, delay: Duration) -> Self {
        self.delayed = Some(delay);
        self
    }

    /// An extra `postgresql.conf` setting on every node.
    pub fn setting(mut self, key: &str, value: &str) -> Self {
        self.settings.insert(key.into(), value.into());
        self
    }

    /// Creates and starts the cluster, retrying with new ports if another
    /// process took one of ours in the meantime.
    pub fn start(self) -> TestCluster {
        sweep_leftovers();
        let bins = PgBinaries::discover().expect("PostgreSQL server binaries");
        let run_as = RunAs::unprivileged().expect("an unprivileged user for PostgreSQL");
        let mut last_err = None;
        for _attempt in 0..3 {
            let dir = tempfile::Builder::new()
                .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
                .tempdir()
                .expect("temp dir");
            // The servers run as another user, who must reach the data dirs.
            std::fs::set_permissions(
                dir.path(),
                std::os::unix::fs::PermissionsExt::from_mode(0o755),
            )
            .expect("chmod temp dir");
            let ports = (0..=self.replicas).map(|_| free_port()).collect();
            let mut spec = ClusterSpec::new(dir.path().join("c"), ports);
            spec.sync = self.sync.clone();
            spec.delayed = self.delayed;
            spec.die_with_parent = true;
            spec.settings = test_settings();
            spec.settings.extend(self.settings.clone());
            match LocalCluster::start(spec, &bins, &run_as) {
                Ok(cluster) => {
                    return TestCluster {
                        cluster: Some(cluster),
                        dir,
                    }
                }
                Err(e @ PgCtlError::Exited { .. }) | Err(e @ PgCtlError::Timeout { .. })
                    if e.to_string().contains("could not bind")
                        || e.to_string().contains("Address already in use") =>
                {
                    last_err = Some(e);
                }
                Err(e) => panic!("starting the test cluster failed: {e}"),
            }
        }
        panic!(
            "starting the test cluster failed: {}",
            last_err.expect("set")
        );
    }
}

fn test_settings() -> BTreeMap<String, String> {
    [
        // Durability of test data does not matter; speed does.
        ("fsync", "off"),
        ("full_page_writes", "off"),
        ("shared_buffers", "16MB"),
        ("max_connections", "50"),
        ("wal_keep_size", "128MB"),
        ("log_min_messages", "warning"),
        ("log_line_prefix", "%m [%p] "),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// A running cluster: node 0 is the initial primary, then the replicas.
/// Dropping it stops every server and removes every directory, also when
/// the test panicked; should the test process be killed outright, the
/// servers die with it (parent-death signal) and the next run removes the
/// directory.
#[derive(Debug)]
pub struct TestCluster {
    cluster: Option<LocalCluster>,
    dir: tempfile::TempDir,
}

impl TestCluster {
    /// Starts describing a cluster.
    pub fn builder() -> TestClusterBuilder {
        TestClusterBuilder::default()
    }

    fn inner(&self) -> &LocalCluster {
        self.cluster.as_ref().expect("cluster present until drop")
    }

    fn inner_mut(&mut self) -> &mut LocalCluster {
        self.cluster.as_mut().expect("cluster present until drop")
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.inner().nodes().len()
    }

    /// Whether the cluster has no nodes (never, but clippy likes a pair).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Node `i` for stop/start/kill/promote.
    pub fn node(&mut self, i: usize) -> &mut Instance {
        self.inner_mut().node(i)
    }

    /// Port of node `i`.
    pub fn port(&self, i: usize) -> u16 {
        self.inner().nodes()[i].port()
    }

    /// `127.0.0.1:port` of node `i`.
    pub fn addr(&self, i: usize) -> String {
        self.inner().nodes()[i].addr()
    }

    /// Every node's `host:port`.
    pub fn addrs(&self) -> Vec<String> {
        self.inner().addrs()
    }

    /// The temp directory holding the data directories.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A libpq connection string for node `i`.
    pub fn conninfo(&self, i: usize) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port(i)
        )
    }

    /// Replaces node `i`'s pg_hba.conf and reloads it.
    pub fn set_hba(&mut self, i: usize, text: &str) {
        let node = self.node(i);
        let path = node.datadir().join("pg_hba.conf");
        std::fs::write(&path, text).expect("write pg_hba.conf");
        node.reload().expect("reload");
    }

    /// Sets `synchronous_standby_names` on node 0 and reloads it.
    pub fn set_sync_standby_names(&mut self, value: &str) {
        self.inner_mut()
            .set_sync_standby_names(value)
            .expect("set synchronous_standby_names");
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        // Servers first (Instance::drop), then the directory (TempDir::drop).
        drop(self.cluster.take());
    }
}

/// Removes directories left by test processes that no longer exist (a run
/// killed by a time-out cannot clean up after itself).
pub(crate) fn sweep_leftovers() {
    if let Ok(run_as) = RunAs::unprivileged() {
        remove_orphaned_shm(run_as.uid());
    }
    let tmp = std::env::temp_dir();
    let Ok(entries) = std::fs::read_dir(&tmp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if !PathBuf::from(format!("/proc/{pid}")).exists() {
            // Servers of HA tests outlive their agents by design.
            if let Ok(dirs) = std::fs::read_dir(e.path()) {
                for d in dirs.flatten() {
                    crate::agents::kill_postmaster(&d.path());
                }
            }
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Removes the System V shared memory segments of dead servers.
///
/// Each PostgreSQL server keeps a small System V segment and removes it at
/// a clean shutdown only. The servers the tests kill leave theirs behind,
/// with their data directories gone, and over many runs the kernel's table
/// (`kernel.shmmni`, 4,096 by default) fills until initdb fails with "could
/// not create shared memory segment: No space left on device". A segment
/// owned by `uid` (the servers' user), attached by no process, small (the
/// server's header; PostgreSQL's own memory is not System V) and whose
/// creator has exited is such a leftover: a server attaches its segment for
/// its whole life, and checking the creator spares one that a server is
/// attaching this instant.
fn remove_orphaned_shm(uid: u32) {
    let Ok(table) = std::fs::read_to_string("/proc/sysvipc/shm") else {
        return;
    };
    let orphans = orphaned_shm(&table, uid, |pid| {
        PathBuf::from(format!("/proc/{pid}")).exists()
    });
    if orphans.is_empty() {
        return;
    }
    let mut cmd = std::process::Command::new("ipcrm");
    for id in &orphans {
        cmd.arg("-m").arg(id.to_string());
    }
    let _ = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

/// The ids of the leftover segments in `table` (the text of
/// `/proc/sysvipc/shm`), see [`remove_orphaned_shm`].
fn orphaned_shm(table: &str, uid: u32, alive: impl Fn(u32) -> bool) -> Vec<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            // key shmid perms size cpid lpid nattch uid ...
            let f: Vec<&str> = line.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
            let orphan = num(3)? <= 4096
                && num(6)? == 0
                && num(7)? == u64::from(uid)
                && !alive(u32::try_from(num(4)?).ok()?);
            orphan.then_some(num(1)?)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_small_unattached_segments_of_dead_servers_of_the_user_are_leftovers() {
        let table =
            "       key      shmid perms  size  cpid  lpid nattch   uid   gid  cuid  cgid\n\
                     10046320 851968 600 56 30791 30804 0 101 104 101 104\n\
                     10046321 851969 600 56 30792 30804 1 101 104 101 104\n\
                     10046322 851970 600 56 30793 30804 0 0 0 0 0\n\
                     10046323 851971 600 1048576 30794 30804 0 101 104 101 104\n\
                     10046324 851972 600 56 30795 0 0 101 104 101 104\n";
        // 30795 is still running: a server attaching its segment.
        let alive = |pid: u32| pid == 30795;
        assert_eq!(orphaned_shm(table, 101, alive), [851968]);
        assert!(orphaned_shm("", 101, alive).is_empty());
    }
}
