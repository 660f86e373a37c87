//! Settings of the whole cluster from the dynamic configuration (etcd's
//! `config` key, changed for every member at once by `PATCH /config` and
//! `pgwarden ctl edit-config`), as Patroni keeps them there:
//!
//! - the timers `ttl`, `loop_wait`, `retry_timeout`, `primary_start_timeout`,
//!   `safety_margin`, and `maximum_lag_on_failover`;
//! - the protection mode: `protection`, `synchronous_node_count`,
//!   `sync_method`, `sync_degrade_timeout`, or Patroni's
//!   `synchronous_mode` (`true`, `false` or `"quorum"`) and
//!   `synchronous_mode_strict`;
//! - `failsafe_mode`.
//!
//! Each one set there replaces the node's own value: members that disagree
//! on the lease's length or on the protection mode misjudge each other. The
//! timers must pass [`Timing::validate`] together, or none of the settings
//! is used.

use std::time::Duration;

use pgwarden_ha::{Protection, SyncMethod, SyncSettings, Timing, TimingOverrides};
use serde_json::Value;

/// The timer keys, in the order they are reported.
pub const TIMERS: [&str; 5] = [
    "ttl",
    "loop_wait",
    "retry_timeout",
    "primary_start_timeout",
    "safety_margin",
];

/// Longest timer the dynamic configuration may set, as for `agent.rto`: a
/// longer one is far more likely a typo than a wish.
const MAX_TIMER: Duration = Duration::from_secs(3_600);

/// The settings in force on a node: its own, or what the dynamic
/// configuration sets instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClusterSettings {
    /// The HA timers.
    pub timing: Timing,
    /// Members further behind are not promoted automatically, bytes.
    pub maximum_lag_on_failover: u64,
    /// The protection mode and its synchronous standbys.
    pub sync: SyncSettings,
    /// Keep the leader through an etcd outage on the members'
    /// acknowledgements.
    pub failsafe: bool,
}

impl ClusterSettings {
    /// A node's own settings, from its file.
    pub fn of(cfg: &pgwarden_config::AgentConfig) -> ClusterSettings {
        ClusterSettings {
            timing: cfg.timing,
            maximum_lag_on_failover: cfg.maximum_lag_on_failover,
            sync: cfg.sync,
            failsafe: cfg.failsafe,
        }
    }

    /// The settings of a node whose own are `self`, with what the dynamic
    /// `config` (the whole value; absent or `null` keys are unset) sets on
    /// top. An error names the offending key or says why the timers do not
    /// fit together.
    pub fn with_dynamic(&self, config: Option<&Value>) -> Result<ClusterSettings, String> {
        let mut out = *self;
        let Some(config) = config else {
            return Ok(out);
        };
        let get = |key: &str| config.get(key).filter(|v| !v.is_null());
        let mut timers = TimingOverrides::default();
        for key in TIMERS {
            let Some(d) = get(key).map(|v| timer(key, v)).transpose()? else {
                continue;
            };
            let slot = match key {
                "ttl" => &mut timers.ttl,
                "loop_wait" => &mut timers.loop_wait,
                "retry_timeout" => &mut timers.retry_timeout,
                "primary_start_timeout" => &mut timers.primary_start_timeout,
                _ => &mut timers.safety_margin,
            };
            *slot = Some(d);
        }
        out.timing = self.timing.with_overrides(&timers);
        out.timing.validate().map_err(|e| e.to_string())?;
        if let Some(v) = get("maximum_lag_on_failover") {
            out.maximum_lag_on_failover = v
                .as_u64()
                .ok_or("maximum_lag_on_failover: must be a whole number of bytes, 0 or more")?;
        }
        let patroni = get("synchronous_mode").is_some() || get("synchronous_mode_strict").is_some();
        if let Some(v) = get("protection") {
            if patroni {
                return Err(
                    "protection: set either it or Patroni's synchronous_mode and \
                            synchronous_mode_strict, not both"
                        .into(),
                );
            }
            out.sync.protection =
                serde_json::from_value::<Protection>(v.clone()).map_err(|_| protection_error())?;
        }
        if let Some(v) = get("sync_method") {
            out.sync.method = serde_json::from_value::<SyncMethod>(v.clone())
                .map_err(|_| "sync_method: must be \"first\" or \"quorum\"".to_string())?;
        }
        if patroni {
            let strict = match get("synchronous_mode_strict") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err("synchronous_mode_strict: must be true or false".into()),
            };
            let (synchronous, quorum) = match get("synchronous_mode") {
                None | Some(Value::Bool(false)) => (false, false),
                Some(Value::Bool(true)) => (true, false),
                Some(Value::String(s)) if s == "quorum" => (true, true),
                Some(_) => return Err("synchronous_mode: must be true, false or \"quorum\"".into()),
            };
            if strict && !synchronous {
                return Err("synchronous_mode_strict: needs synchronous_mode".into());
            }
            out.sync.protection = match (synchronous, strict) {
                (false, _) => Protection::MaximumPerformance,
                (true, false) => Protection::MaximumAvailability,
                (true, true) => Protection::MaximumProtection,
            };
            if quorum {
                if get("sync_method").is_some_and(|m| m != "quorum") {
                    return Err("sync_method: synchronous_mode \"quorum\" means quorum".into());
                }
                out.sync.method = SyncMethod::Quorum;
            }
        }
        if let Some(v) = get("synchronous_node_count") {
            out.sync.count = v
                .as_u64()
                .filter(|n| (1..=1024).contains(n))
                .ok_or("synchronous_node_count: must be a whole number from 1 to 1024")?
                as usize;
        }
        if let Some(v) = get("sync_degrade_timeout") {
            out.sync.degrade_after = timer("sync_degrade_timeout", v)?;
        }
        if let Some(v) = get("failsafe_mode") {
            out.failsafe = v.as_bool().ok_or("failsafe_mode: must be true or false")?;
        }
        Ok(out)
    }

    /// As `/patroni` shows them: timers in seconds, by key.
    pub fn to_json(&self) -> Value {
        let s = |d: Duration| serde_json::json!(d.as_secs_f64());
        let t = &self.timing;
        serde_json::json!({
            "ttl": s(t.ttl),
            "loop_wait": s(t.loop_wait),
            "retry_timeout": s(t.retry_timeout),
            "primary_start_timeout": s(t.primary_start_timeout),
            "safety_margin": s(t.safety_margin),
            "maximum_lag_on_failover": self.maximum_lag_on_failover,
            "protection": self.sync.protection.to_string(),
            "synchronous_node_count": self.sync.count,
            "sync_method": self.sync.method,
            "sync_degrade_timeout": s(self.sync.degrade_after),
            "failsafe_mode": self.failsafe,
        })
    }
}

fn protection_error() -> String {
    "protection: must be \"maximum_performance\", \"maximum_availability\" or \
     \"maximum_protection\""
        .into()
}

fn timer(key: &str, v: &Value) -> Result<Duration, String> {
    let d = serde_json::from_value::<pgwarden_config::HaTimer>(v.clone())
        .map_err(|e| format!("{key}: {e}"))?
        .0;
    if d > MAX_TIMER {
        return Err(format!(
            "{key}: at most an hour ({} s)",
            MAX_TIMER.as_secs()
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node() -> ClusterSettings {
        ClusterSettings {
            timing: Timing {
                ttl: Duration::from_secs(6),
                loop_wait: Duration::from_secs(1),
                retry_timeout: Duration::from_secs(2),
                primary_start_timeout: Duration::from_secs(3),
                safety_margin: Duration::from_secs(1),
            },
            maximum_lag_on_failover: 1 << 20,
            sync: SyncSettings::default(),
            failsafe: false,
        }
    }

    fn with(config: Value) -> Result<ClusterSettings, String> {
        node().with_dynamic(Some(&config))
    }

    #[test]
    fn timers_are_read_as_seconds_or_durations() {
        let s = with(json!({
            "ttl": 12,
            "loop_wait": 1.5,
            "retry_timeout": "2500ms",
            "primary_start_timeout": 0,
            "safety_margin": null,
            "maximum_lag_on_failover": 1000,
            "pause": false,
        }))
        .unwrap();
        assert_eq!(s.timing.ttl, Duration::from_secs(12));
        assert_eq!(s.timing.loop_wait, Duration::from_millis(1500));
        assert_eq!(s.timing.retry_timeout, Duration::from_millis(2500));
        assert_eq!(s.timing.primary_start_timeout, Duration::ZERO);
        // Unset or null: the node's own.
        assert_eq!(s.timing.safety_margin, Duration::from_secs(1));
        assert_eq!(s.maximum_lag_on_failover, 1000);
        assert_eq!(node().with_dynamic(None).unwrap(), node());
        assert_eq!(with(json!({})).unwrap(), node());
    }

    #[test]
    fn bad_values_name_their_key() {
        for (config, key) in [
            (json!({"ttl": -1}), "ttl:"),
            (json!({"loop_wait": "soon"}), "loop_wait:"),
            (json!({"retry_timeout": [1]}), "retry_timeout:"),
            (json!({"ttl": 7200}), "ttl: at most an hour"),
            (
                json!({"maximum_lag_on_failover": -5}),
                "maximum_lag_on_failover:",
            ),
            (
                json!({"maximum_lag_on_failover": "1MB"}),
                "maximum_lag_on_failover:",
            ),
            (json!({"protection": "maximum"}), "protection:"),
            (json!({"sync_method": "all"}), "sync_method:"),
            (
                json!({"synchronous_node_count": 0}),
                "synchronous_node_count:",
            ),
            (json!({"synchronous_mode": "yes"}), "synchronous_mode:"),
            (
                json!({"synchronous_mode_strict": 1}),
                "synchronous_mode_strict:",
            ),
            (
                json!({"synchronous_mode_strict": true}),
                "synchronous_mode_strict:",
            ),
            (
                json!({"protection": "maximum_availability", "synchronous_mode": true}),
                "protection:",
            ),
            (
                json!({"sync_degrade_timeout": "x"}),
                "sync_degrade_timeout:",
            ),
            (json!({"failsafe_mode": "on"}), "failsafe_mode:"),
        ] {
            let e = with(config.clone()).unwrap_err();
            assert!(e.starts_with(key), "{config}: {e}");
        }
    }

    #[test]
    fn timers_must_fit_together() {
        let s = with(json!({"ttl": 12, "retry_timeout": 4})).unwrap();
        assert_eq!(s.timing.ttl, Duration::from_secs(12));
        assert_eq!(s.timing.loop_wait, Duration::from_secs(1));
        // 1 + 2 × 2 > 4: a cut-off leader would outlive its lease.
        let e = with(json!({"ttl": 4})).unwrap_err();
        assert!(e.contains("exceeds ttl"), "{e}");
        assert!(with(json!({"safety_margin": 6})).is_err());
        assert!(with(json!({"loop_wait": 0})).is_err());
        // A bad timer spoils the rest too.
        assert!(with(json!({"ttl": 4, "protection": "maximum_protection"})).is_err());
    }

    #[test]
    fn protection_by_pgwardens_names_or_patronis() {
        let s = with(json!({
            "protection": "maximum_protection",
            "synchronous_node_count": 2,
            "sync_method": "quorum",
            "sync_degrade_timeout": 5,
            "failsafe_mode": true,
        }))
        .unwrap();
        assert_eq!(
            s.sync,
            SyncSettings {
                protection: Protection::MaximumProtection,
                count: 2,
                method: SyncMethod::Quorum,
                degrade_after: Duration::from_secs(5),
            }
        );
        assert!(s.failsafe);
        for (config, protection, method) in [
            (
                json!({"synchronous_mode": false}),
                Protection::MaximumPerformance,
                SyncMethod::First,
            ),
            (
                json!({"synchronous_mode": true}),
                Protection::MaximumAvailability,
                SyncMethod::First,
            ),
            (
                json!({"synchronous_mode": true, "synchronous_mode_strict": true}),
                Protection::MaximumProtection,
                SyncMethod::First,
            ),
            (
                json!({"synchronous_mode": "quorum"}),
                Protection::MaximumAvailability,
                SyncMethod::Quorum,
            ),
        ] {
            let s = with(config.clone()).unwrap();
            assert_eq!(
                (s.sync.protection, s.sync.method),
                (protection, method),
                "{config}"
            );
        }
    }

    #[test]
    fn reported_in_seconds() {
        let v = node().to_json();
        assert_eq!(v["ttl"], 6.0);
        assert_eq!(v["maximum_lag_on_failover"], 1 << 20);
        assert_eq!(v["protection"], "maximum_performance");
        assert_eq!(v["sync_method"], "first");
        assert_eq!(v["failsafe_mode"], false);
    }
}
