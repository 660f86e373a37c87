//! The fence: a small process that outlives the agent and stops a leader's
//! PostgreSQL the moment the agent dies.
//!
//! A leader whose agent is killed (while its PostgreSQL keeps running)
//! renews nothing; after the ttl another member is promoted, and without a
//! fence the orphaned server would still take writes from any client
//! connected to it directly. The agent starts a fence whenever it becomes
//! leader and stops it (SIGTERM, no action) when it stops leading or shuts
//! down cleanly. If the agent disappears first, the fence shuts PostgreSQL
//! down at once (immediate mode), within a fraction of a second and long
//! before the lease can expire.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// How often the fence looks for its agent.
const POLL: Duration = Duration::from_millis(50);

/// A running fence, owned by the agent.
#[derive(Debug)]
pub struct Fence {
    child: Child,
}

impl Fence {
    /// Starts `exe fence --agent-pid PID --data-dir DIR` in its own process
    /// group, so that neither the agent's death nor a signal to the agent's
    /// group takes it down.
    pub fn start(exe: &Path, data_dir: &Path) -> std::io::Result<Fence> {
        let mut cmd = Command::new(exe);
        cmd.arg("fence")
            .arg("--agent-pid")
            .arg(std::process::id().to_string())
            .arg("--data-dir")
            .arg(data_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        Ok(Fence {
            child: cmd.spawn()?,
        })
    }

    /// Stops the fence without it touching PostgreSQL.
    pub fn disarm(mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        let _ = self.child.wait();
    }
}

/// The start time of a live process (field 22 of `/proc/PID/stat`), which
/// tells the agent from another process that got its pid; `None` once it
/// is gone.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    live_start_time(&stat)
}

/// [`start_time`] from the text of `/proc/PID/stat`. A killed agent whose
/// parent has not reaped it yet (a supervisor that waits late, or never)
/// stays listed as a zombie (`Z`, then `X`) with its start time: it is
/// dead all the same, and its PostgreSQL must stop.
fn live_start_time(stat: &str) -> Option<u64> {
    // The command name may contain spaces; fields resume after its ')'.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    if matches!(fields.next()?, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// The fence's main loop (`pgwarden fence`): waits for the agent `agent_pid`
/// to disappear, then shuts down the postmaster of `data_dir` immediately.
/// Returns when the agent is gone (after acting) or when told to stop.
pub fn run(agent_pid: i32, data_dir: PathBuf) {
    let Some(started) = start_time(agent_pid) else {
        return;
    };
    loop {
        std::thread::sleep(POLL);
        if start_time(agent_pid) == Some(started) {
            continue;
        }
        if let Some(pm) = postmaster_pid(&data_dir) {
            // SIGQUIT: immediate shutdown, no new transaction commits.
            let _ = kill(Pid::from_raw(pm), Signal::SIGQUIT);
            eprintln!("pgwarden fence: the agent {agent_pid} is gone; PostgreSQL {pm} shut down");
        }
        return;
    }
}

fn postmaster_pid(data_dir: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
    let pid: i32 = text.lines().next()?.trim().parse().ok()?;
    kill(Pid::from_raw(pid), None).ok().map(|_| pid)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_zombie_is_dead() {
        let stat = |state: &str| {
            format!("4242 (pgwarden (x)) {state} 1 4242 4242 0 -1 4194560 1 0 0 0 5 3 0 0 20 0 9 0 123456 0 0")
        };
        assert_eq!(super::live_start_time(&stat("S")), Some(123456));
        assert_eq!(super::live_start_time(&stat("R")), Some(123456));
        assert_eq!(super::live_start_time(&stat("Z")), None);
        assert_eq!(super::live_start_time(&stat("X")), None);
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(super::live_start_time(&own).is_some());
    }
}
