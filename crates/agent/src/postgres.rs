//! The local PostgreSQL as the agent sees and drives it: process control
//! through [`pgwarden_pgctl::Instance`] (blocking, so run off the runtime's
//! worker threads) and observation over one SQL connection.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgwarden_ha::LocalPg;
use pgwarden_pgctl::{Instance, PgCtlError, StopMode};
use pgwarden_topology::HostAddr;
use tokio::sync::Notify;
use tokio_postgres::NoTls;

/// How often the postmaster's pid is checked, so a crash is seen well within
/// a second rather than on the next loop.
const PID_POLL: Duration = Duration::from_millis(100);

/// The one query an observation needs. The timeline of a primary comes
/// from its current WAL file name, because `pg_control_checkpoint()` lags
/// behind a promotion until the next checkpoint. A replica reports the
/// newest of the timeline it receives, its last restartpoint's, and the
/// newest timeline history file it holds: the receiver's row vanishes
/// whenever its upstream goes away, and restartpoints can be several
/// promotions old, but a history file arrives with every timeline switch.
const OBSERVE: &str = "SELECT pg_is_in_recovery(), \
 CASE WHEN pg_is_in_recovery() THEN greatest(\
   coalesce((SELECT received_tli FROM pg_stat_wal_receiver), 0), \
   (SELECT timeline_id FROM pg_control_checkpoint()), \
   coalesce((SELECT max(('x' || substr(name, 1, 8))::bit(32)::int) FROM pg_ls_waldir() \
     WHERE name ~ '^[0-9A-F]{8}\\.history$'), 0))::int8 \
 ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8 END, \
 pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn() \
   ELSE pg_current_wal_lsn() END, '0/0')::int8, \
 pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
   ELSE pg_current_wal_lsn() END, '0/0')::int8, \
 (SELECT status FROM pg_stat_wal_receiver) = 'streaming', \
 EXISTS (SELECT 1 FROM pg_settings WHERE pending_restart), \
 to_char(pg_postmaster_start_time() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')";

/// What one observation found, beyond [`LocalPg`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observation {
    /// Role, timeline and positions for the decision.
    pub pg: LocalPg,
    /// A postmaster process exists (it may still be starting up).
    pub process: bool,
    /// A replica's WAL receiver is streaming.
    pub streaming: bool,
    /// Settings have changed that take effect only at a restart.
    pub pending_restart: bool,
    /// When the postmaster started (UTC, ISO 8601).
    pub postmaster_start_time: Option<String>,
}

/// The local PostgreSQL.
pub struct LocalPostgres {
    instance: Arc<Mutex<Instance>>,
    addr: HostAddr,
    superuser: String,
    password: Option<String>,
    replication_user: String,
    client: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
    crashed: Arc<Notify>,
}

impl LocalPostgres {
    /// Wraps an instance; `addr` is where the agent connects to observe it.
    pub fn new(
        instance: Instance,
        addr: HostAddr,
        superuser: String,
        password: Option<String>,
        replication_user: String,
    ) -> Self {
        LocalPostgres {
            instance: Arc::new(Mutex::new(instance)),
            addr,
            superuser,
            password,
            replication_user,
            client: tokio::sync::Mutex::new(None),
            crashed: Arc::new(Notify::new()),
        }
    }

    /// Notified when the postmaster disappears or the observation
    /// connection breaks: the loop runs at once instead of after
    /// `loop_wait`.
    pub fn crashes(&self) -> Arc<Notify> {
        self.crashed.clone()
    }

    /// Watches the postmaster's pid in the background for as long as the
    /// runtime runs.
    pub fn supervise(&self) {
        let instance = self.instance.clone();
        let crashed = self.crashed.clone();
        tokio::spawn(async move {
            let mut was_running = false;
            loop {
                tokio::time::sleep(PID_POLL).await;
                // A long operation (start, rewind) holds the lock; its
                // outcome is observed by the loop anyway.
                let Ok(mut i) = instance.try_lock() else {
                    continue;
                };
                let running = i.postmaster_pid().is_some();
                drop(i);
                if was_running && !running {
                    tracing::warn!("the local postmaster is gone");
                    crashed.notify_one();
                }
                was_running = running;
            }
        });
    }

    /// Runs a blocking operation on the instance off the worker threads.
    pub async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Instance) -> Result<T, PgCtlError> + Send + 'static,
    ) -> Result<T, PgCtlError> {
        let instance = self.instance.clone();
        tokio::task::spawn_blocking(move || {
            let mut i = instance.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut i)
        })
        .await
        .unwrap_or_else(|e| {
            Err(PgCtlError::CommandFailed {
                program: "agent task".into(),
                status: "panicked".into(),
                output: e.to_string(),
            })
        })
    }

    /// Whether a data directory exists.
    pub async fn has_data(&self) -> bool {
        self.with(|i| Ok(i.has_data())).await.unwrap_or(false)
    }

    /// The replication role used for streaming, basebackup and rewind.
    pub fn replication_user(&self) -> &str {
        &self.replication_user
    }

    /// Changes the replication role (a reloaded node file); the caller
    /// rewrites a standby's `primary_conninfo`.
    pub fn set_replication_user(&mut self, user: String) {
        self.replication_user = user;
    }

    /// The superuser the agent connects as.
    pub fn superuser(&self) -> &str {
        &self.superuser
    }

    /// Starts the postmaster and waits up to `wait` for it to accept
    /// connections; a server still starting after that keeps starting.
    pub async fn start(&self, wait: Duration) -> Result<(), PgCtlError> {
        self.with(move |i| {
            i.spawn()?;
            i.wait_ready(wait)
        })
        .await
    }

    /// Stops the postmaster and forgets the observation connection.
    pub async fn stop(&self, mode: StopMode) -> Result<(), PgCtlError> {
        *self.client.lock().await = None;
        self.with(move |i| i.stop(mode)).await
    }

    /// Promotes a standby (`pg_ctl promote -w`) on a task of its own, so
    /// that the caller can go on renewing its lease while a server that is
    /// still recovering takes its time.
    pub fn promote(&self) -> tokio::task::JoinHandle<Result<(), PgCtlError>> {
        let instance = self.instance.clone();
        tokio::task::spawn_blocking(move || {
            instance.lock().unwrap_or_else(|e| e.into_inner()).promote()
        })
    }

    /// Observes the server: is a postmaster there, does it answer, and in
    /// which role, on which timeline, at which WAL positions.
    pub async fn observe(&self, timeout: Duration) -> Observation {
        let process = self
            .with(|i| Ok(i.postmaster_pid().is_some()))
            .await
            .unwrap_or(false);
        if !process {
            *self.client.lock().await = None;
            return Observation::default();
        }
        let mut guard = self.client.lock().await;
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            *guard = self.connect(timeout).await;
        }
        let Some(client) = guard.as_ref() else {
            return Observation {
                process,
                ..Observation::default()
            };
        };
        match tokio::time::timeout(timeout, client.query_one(OBSERVE, &[])).await {
            Ok(Ok(row)) => {
                let lsn = |i: usize| row.get::<_, Option<i64>>(i).map(|v| v.max(0) as u64);
                Observation {
                    pg: LocalPg {
                        running: true,
                        in_recovery: row.get(0),
                        timeline: row.get::<_, Option<i64>>(1).unwrap_or(0) as u32,
                        received_lsn: lsn(2),
                        replayed_lsn: lsn(3),
                        start_failed_for: None,
                    },
                    process,
                    streaming: row.get::<_, Option<bool>>(4).unwrap_or(false),
                    pending_restart: row.get::<_, Option<bool>>(5).unwrap_or(false),
                    postmaster_start_time: row.get(6),
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "observation query failed");
                *guard = None;
                Observation {
                    process,
                    ..Observation::default()
                }
            }
            Err(_) => Observation {
                process,
                ..Observation::default()
            },
        }
    }

    /// Runs `sql` on the observation connection (simple protocol) and
    /// returns every row's columns as text.
    pub async fn query(
        &self,
        sql: &str,
        timeout: Duration,
    ) -> Result<Vec<Vec<Option<String>>>, String> {
        let mut guard = self.client.lock().await;
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            *guard = self.connect(timeout).await;
        }
        let client = guard.as_ref().ok_or("not connected")?;
        let msgs = tokio::time::timeout(timeout, client.simple_query(sql))
            .await
            .map_err(|_| "timed out".to_string())?
            .map_err(|e| e.to_string())?;
        Ok(text_rows(msgs))
    }

    /// Runs `sql` in database `dbname` over a connection of its own, on the
    /// local server or, given `at`, on another member's: logical slots are
    /// created and advanced from within their database.
    pub async fn query_in(
        &self,
        at: Option<&HostAddr>,
        dbname: &str,
        sql: &str,
        timeout: Duration,
    ) -> Result<Vec<Vec<Option<String>>>, String> {
        let addr = at.unwrap_or(&self.addr);
        let mut cfg = tokio_postgres::Config::new();
        cfg.host(&addr.host)
            .port(addr.port)
            .user(&self.superuser)
            .dbname(dbname)
            .application_name("pgwarden-agent")
            .connect_timeout(timeout);
        if let Some(p) = &self.password {
            cfg.password(p);
        }
        let work = async {
            let (client, conn) = cfg.connect(NoTls).await.map_err(|e| e.to_string())?;
            let conn = tokio::spawn(conn);
            let msgs = client.simple_query(sql).await.map_err(|e| {
                e.as_db_error()
                    .map_or_else(|| e.to_string(), |d| d.message().to_string())
            });
            drop(client);
            let _ = conn.await;
            msgs
        };
        let msgs = tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| "timed out".to_string())??;
        Ok(text_rows(msgs))
    }

    async fn connect(&self, timeout: Duration) -> Option<tokio_postgres::Client> {
        let mut cfg = tokio_postgres::Config::new();
        cfg.host(&self.addr.host)
            .port(self.addr.port)
            .user(&self.superuser)
            .dbname("postgres")
            .application_name("pgwarden-agent")
            .connect_timeout(timeout);
        if let Some(p) = &self.password {
            cfg.password(p);
        }
        let (client, conn) = tokio::time::timeout(timeout, cfg.connect(NoTls))
            .await
            .ok()?
            .ok()?;
        let crashed = self.crashed.clone();
        tokio::spawn(async move {
            // The connection ends when the server goes away: wake the loop.
            if conn.await.is_err() {
                crashed.notify_one();
            }
        });
        Some(client)
    }

    /// A connection string for this process to reach another member as
    /// the superuser, password included.
    pub fn source_conninfo(&self, addr: &HostAddr) -> String {
        let mut s = self.tool_conninfo(addr);
        if let Some(p) = &self.password {
            s.push_str(&format!(" password={}", pgwarden_pgctl::conninfo_value(p)));
        }
        s
    }

    /// The same without the password, for a program run here (`pg_rewind`):
    /// its command line is visible to every local user, so the password
    /// ([`Self::password`]) goes through its environment.
    pub fn tool_conninfo(&self, addr: &HostAddr) -> String {
        format!(
            "host={} port={} user={} dbname=postgres connect_timeout=5",
            addr.host,
            addr.port,
            pgwarden_pgctl::conninfo_value(&self.superuser)
        )
    }

    /// The superuser's password, if one is configured.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }
}

/// The rows of a simple query, each column as text (`None` for NULL).
fn text_rows(msgs: Vec<tokio_postgres::SimpleQueryMessage>) -> Vec<Vec<Option<String>>> {
    msgs.into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_string)).collect())
            }
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgwarden_pgctl::{InstanceSpec, PgBinaries, RunAs};

    /// A superuser name or password with spaces, quotes and backslashes
    /// reaches the server as written, in this process's connections as in
    /// the tools' (which get the password apart, out of their command
    /// line).
    #[test]
    fn connection_strings_carry_names_and_passwords_as_written() {
        let instance = Instance::new(
            InstanceSpec::new("n1", "/nonexistent", 5432),
            PgBinaries::at("/nonexistent"),
            RunAs::current(),
        );
        let password = r"p\a'ss w\";
        let pg = LocalPostgres::new(
            instance,
            HostAddr::new("127.0.0.1", 5432),
            "super user".into(),
            Some(password.into()),
            "replicator".into(),
        );
        let to = HostAddr::new("10.0.0.2", 5433);
        let cfg: tokio_postgres::Config = pg.source_conninfo(&to).parse().unwrap();
        assert_eq!(cfg.get_user(), Some("super user"));
        assert_eq!(cfg.get_password(), Some(password.as_bytes()));
        assert_eq!(cfg.get_ports(), [5433]);
        let tool: tokio_postgres::Config = pg.tool_conninfo(&to).parse().unwrap();
        assert_eq!(tool.get_user(), Some("super user"));
        assert_eq!(tool.get_password(), None);
        assert!(!pg.tool_conninfo(&to).contains("ss w"));
    }
}
