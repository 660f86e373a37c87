//! The Linux watchdog, armed while this node leads.
//!
//! A leader whose agent hangs renews nothing and demotes nothing; only its
//! lease running out protects the cluster, and its PostgreSQL keeps taking
//! writes until then. With a watchdog the kernel resets the node unless the
//! agent writes to the device in time, and the time-out is set to
//! `ttl − safety_margin`, so a hung leader is gone before any other member
//! can be promoted.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use pgwarden_config::{WatchdogConfig, WatchdogMode};

#[allow(unsafe_code)]
mod sys {
    // WDIOC_SETTIMEOUT from <linux/watchdog.h>: _IOWR('W', 6, int).
    nix::ioctl_readwrite!(wdioc_settimeout, b'W', 6, std::os::raw::c_int);
}
use sys::wdioc_settimeout;

/// The watchdog device as the HA loop uses it.
#[derive(Debug)]
pub struct Watchdog {
    mode: WatchdogMode,
    device: PathBuf,
    timeout: Duration,
    file: Option<File>,
}

impl Watchdog {
    /// A watchdog per `config`, firing `timeout` after the last keep-alive.
    pub fn new(config: &WatchdogConfig, timeout: Duration) -> Self {
        Watchdog {
            mode: config.mode,
            device: config.device.clone(),
            timeout,
            file: None,
        }
    }

    /// Whether leading requires an armed watchdog.
    pub fn required(&self) -> bool {
        self.mode == WatchdogMode::Required
    }

    /// Whether the watchdog is armed.
    pub fn armed(&self) -> bool {
        self.file.is_some()
    }

    /// Checks that the device can be opened, disarming it again at once:
    /// a member whose required watchdog is missing must not stand in
    /// elections.
    pub fn probe(&mut self) -> Result<(), String> {
        if self.mode == WatchdogMode::Off || self.armed() {
            return Ok(());
        }
        self.arm()?;
        self.disarm();
        Ok(())
    }

    /// Opens the device (starting the kernel's timer) if needed and sets
    /// the time-out; then a keep-alive. `Ok` with the watchdog off.
    pub fn arm(&mut self) -> Result<(), String> {
        if self.mode == WatchdogMode::Off {
            return Ok(());
        }
        if self.file.is_none() {
            let file = OpenOptions::new()
                .write(true)
                .open(&self.device)
                .map_err(|e| format!("cannot open {}: {e}", self.device.display()))?;
            let mut secs = self.timeout.as_secs().max(1) as std::os::raw::c_int;
            #[allow(unsafe_code)]
            // SAFETY: the descriptor is open for as long as `file` lives,
            // and the kernel reads and writes one int through the pointer.
            let set =
                unsafe { wdioc_settimeout(std::os::fd::AsRawFd::as_raw_fd(&file), &mut secs) };
            if let Err(e) = set {
                // Some drivers have a fixed time-out; say so, keep going.
                tracing::warn!(device = %self.device.display(), error = %e, "cannot set the watchdog time-out");
            }
            tracing::info!(device = %self.device.display(), timeout_s = secs, "watchdog armed");
            self.file = Some(file);
        }
        self.keepalive();
        Ok(())
    }

    /// Changes the time-out (a new `ttl` or `safety_margin`); an armed
    /// watchdog takes it at once.
    pub fn set_timeout(&mut self, timeout: Duration) {
        if timeout == self.timeout {
            return;
        }
        self.timeout = timeout;
        if let Some(f) = &self.file {
            let mut secs = timeout.as_secs().max(1) as std::os::raw::c_int;
            #[allow(unsafe_code)]
            // SAFETY: as in `arm`.
            let set = unsafe { wdioc_settimeout(std::os::fd::AsRawFd::as_raw_fd(f), &mut secs) };
            match set {
                Ok(_) => tracing::info!(timeout_s = secs, "watchdog time-out changed"),
                Err(e) => tracing::warn!(error = %e, "cannot change the watchdog time-out"),
            }
            self.keepalive();
        }
    }

    /// Takes a reloaded `[agent]` watchdog setting. An armed watchdog stays
    /// armed throughout: a new device is opened (and fed) before the old
    /// one is closed with the magic close, and one that cannot be opened
    /// leaves the old one in force (`Err`). A watchdog not armed is only
    /// probed, as at start.
    pub fn reconfigure(&mut self, config: &WatchdogConfig) -> Result<(), String> {
        if config.mode == self.mode && config.device == self.device {
            return Ok(());
        }
        if !self.armed() {
            self.mode = config.mode;
            self.device = config.device.clone();
            return self.probe();
        }
        if config.mode == WatchdogMode::Off {
            self.disarm();
            self.mode = config.mode;
            return Ok(());
        }
        if config.device != self.device {
            let mut next = Watchdog::new(config, self.timeout);
            next.arm()?;
            self.disarm();
            *self = next;
        }
        self.mode = config.mode;
        Ok(())
    }

    /// Postpones the reset.
    pub fn keepalive(&mut self) {
        if let Some(f) = &mut self.file {
            if let Err(e) = f.write_all(b"1").and_then(|_| f.flush()) {
                tracing::error!(error = %e, "watchdog keep-alive failed");
            }
        }
    }

    /// Disarms it with the magic close, so closing does not reset the node.
    pub fn disarm(&mut self) {
        if let Some(mut f) = self.file.take() {
            let _ = f.write_all(b"V").and_then(|_| f.flush());
            tracing::info!(device = %self.device.display(), "watchdog disarmed");
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.disarm();
    }
}
