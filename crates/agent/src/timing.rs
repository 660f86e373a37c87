//! HA timings from the dynamic configuration: `ttl`, `loop_wait`,
//! `retry_timeout`, `primary_start_timeout`, `safety_margin` and
//! `maximum_lag_on_failover` at the top of etcd's `config` key, which
//! `PATCH /config` (and `pgwarden ctl edit-config`) changes for every member
//! at once, as Patroni's do.
//!
//! Each one set there replaces the node's own value (its `rto` preset or
//! explicit key): timings are a property of the cluster, and members that
//! disagree on them misjudge each other. The result must pass
//! [`Timing::validate`] as a whole, or none of it is used.

use std::time::Duration;

use pgwarden_ha::{Timing, TimingOverrides};
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

/// What the dynamic configuration sets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dynamic {
    /// The timers it sets.
    pub timers: TimingOverrides,
    /// `maximum_lag_on_failover`, bytes.
    pub maximum_lag_on_failover: Option<u64>,
}

/// The timing settings in `config` (the whole `config` value; absent or
/// `null` keys are unset). An error names the offending key.
pub fn dynamic(config: Option<&Value>) -> Result<Dynamic, String> {
    let mut out = Dynamic::default();
    let Some(config) = config else {
        return Ok(out);
    };
    for key in TIMERS {
        let Some(v) = config.get(key).filter(|v| !v.is_null()) else {
            continue;
        };
        let d = serde_json::from_value::<pgwarden_config::HaTimer>(v.clone())
            .map_err(|e| format!("{key}: {e}"))?
            .0;
        if d > MAX_TIMER {
            return Err(format!(
                "{key}: at most an hour ({} s)",
                MAX_TIMER.as_secs()
            ));
        }
        let slot = match key {
            "ttl" => &mut out.timers.ttl,
            "loop_wait" => &mut out.timers.loop_wait,
            "retry_timeout" => &mut out.timers.retry_timeout,
            "primary_start_timeout" => &mut out.timers.primary_start_timeout,
            _ => &mut out.timers.safety_margin,
        };
        *slot = Some(d);
    }
    if let Some(v) = config
        .get("maximum_lag_on_failover")
        .filter(|v| !v.is_null())
    {
        out.maximum_lag_on_failover = Some(
            v.as_u64()
                .ok_or("maximum_lag_on_failover: must be a whole number of bytes, 0 or more")?,
        );
    }
    Ok(out)
}

/// The timing in force on a node whose own is `node`, with what the
/// dynamic configuration sets on top; an error says why the combination
/// cannot be used.
pub fn effective(node: &Timing, dynamic: &Dynamic) -> Result<Timing, String> {
    let t = node.with_overrides(&dynamic.timers);
    t.validate().map_err(|e| e.to_string())?;
    Ok(t)
}

/// The timing as `/patroni` shows it: seconds, by key.
pub fn to_json(t: &Timing, maximum_lag_on_failover: u64) -> Value {
    let s = |d: Duration| serde_json::json!(d.as_secs_f64());
    serde_json::json!({
        "ttl": s(t.ttl),
        "loop_wait": s(t.loop_wait),
        "retry_timeout": s(t.retry_timeout),
        "primary_start_timeout": s(t.primary_start_timeout),
        "safety_margin": s(t.safety_margin),
        "maximum_lag_on_failover": maximum_lag_on_failover,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node() -> Timing {
        Timing {
            ttl: Duration::from_secs(6),
            loop_wait: Duration::from_secs(1),
            retry_timeout: Duration::from_secs(2),
            primary_start_timeout: Duration::from_secs(3),
            safety_margin: Duration::from_secs(1),
        }
    }

    #[test]
    fn timers_are_read_as_seconds_or_durations() {
        let d = dynamic(Some(&json!({
            "ttl": 12,
            "loop_wait": 1.5,
            "retry_timeout": "2500ms",
            "primary_start_timeout": 0,
            "safety_margin": null,
            "maximum_lag_on_failover": 1048576,
            "pause": false,
        })))
        .unwrap();
        assert_eq!(d.timers.ttl, Some(Duration::from_secs(12)));
        assert_eq!(d.timers.loop_wait, Some(Duration::from_millis(1500)));
        assert_eq!(d.timers.retry_timeout, Some(Duration::from_millis(2500)));
        assert_eq!(d.timers.primary_start_timeout, Some(Duration::ZERO));
        assert_eq!(d.timers.safety_margin, None);
        assert_eq!(d.maximum_lag_on_failover, Some(1_048_576));
        assert_eq!(dynamic(None).unwrap(), Dynamic::default());
        assert_eq!(dynamic(Some(&json!({}))).unwrap(), Dynamic::default());
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
        ] {
            let e = dynamic(Some(&config)).unwrap_err();
            assert!(e.starts_with(key), "{config}: {e}");
        }
    }

    #[test]
    fn dynamic_timers_replace_the_nodes_and_must_fit_together() {
        let d = dynamic(Some(&json!({"ttl": 12, "retry_timeout": 4}))).unwrap();
        let t = effective(&node(), &d).unwrap();
        assert_eq!(t.ttl, Duration::from_secs(12));
        assert_eq!(t.retry_timeout, Duration::from_secs(4));
        // Unset keys keep the node's values.
        assert_eq!(t.loop_wait, Duration::from_secs(1));
        assert_eq!(t.safety_margin, Duration::from_secs(1));
        // 1 + 2 × 2 > 4: a cut-off leader would outlive its lease.
        let d = dynamic(Some(&json!({"ttl": 4}))).unwrap();
        let e = effective(&node(), &d).unwrap_err();
        assert!(e.contains("exceeds ttl"), "{e}");
        let d = dynamic(Some(&json!({"safety_margin": 6}))).unwrap();
        assert!(effective(&node(), &d).is_err());
        let d = dynamic(Some(&json!({"loop_wait": 0}))).unwrap();
        assert!(effective(&node(), &d).is_err());
    }

    #[test]
    fn reported_in_seconds() {
        let v = to_json(&node(), 5);
        assert_eq!(v["ttl"], 6.0);
        assert_eq!(v["maximum_lag_on_failover"], 5);
    }
}
