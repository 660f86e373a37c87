//! Prometheus metrics. Every metric is documented in
//! `docs/configuration.md#metrics`; names are part of the interface.

use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pgwarden_probe::Snapshot;
use pgwarden_topology::Role;

/// The histogram of waits for a pooled server connection: observed on
/// every transaction, so it counts with atomic additions where the
/// library's histogram takes a lock, and a transaction that did not wait
/// costs one addition.
#[derive(Debug, Clone)]
pub struct WaitHistogram(Arc<WaitCounts>);

#[derive(Debug)]
struct WaitCounts {
    /// Upper bounds in seconds, the last one infinite.
    bounds: Vec<f64>,
    /// Observations per bucket, not cumulative.
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
}

/// The wait histogram's finite bucket bounds (seconds): 10 µs times powers
/// of 3, rounded to the nanosecond so that their labels read `0.00003`
/// rather than `0.000030000000000000005`.
fn wait_bounds() -> impl Iterator<Item = f64> {
    exponential_buckets(0.000_01, 3.0, 13).map(|b| (b * 1e9).round() / 1e9)
}

impl WaitHistogram {
    /// Buckets from 10 µs to about 5 s.
    pub fn new() -> WaitHistogram {
        let bounds: Vec<f64> = wait_bounds().chain(std::iter::once(f64::MAX)).collect();
        WaitHistogram(Arc::new(WaitCounts {
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            bounds,
            sum_ns: AtomicU64::new(0),
        }))
    }

    /// Records one wait.
    pub fn observe(&self, waited: std::time::Duration) {
        let secs = waited.as_secs_f64();
        let i = self
            .0
            .bounds
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(self.0.bounds.len() - 1);
        self.0.counts[i].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        if ns > 0 {
            self.0.sum_ns.fetch_add(ns, Ordering::Relaxed);
        }
    }
}

impl WaitHistogram {
    /// Each bucket's upper bound in seconds (the last is `f64::MAX`, shown
    /// as `+Inf`) with its count, not cumulative; and the sum in seconds.
    fn snapshot(&self) -> (Vec<(f64, u64)>, f64) {
        let buckets = self
            .0
            .bounds
            .iter()
            .zip(&self.0.counts)
            .map(|(b, c)| (*b, c.load(Ordering::Relaxed)))
            .collect();
        (buckets, self.0.sum_ns.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

impl Default for WaitHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl TypedMetric for WaitHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for WaitHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (buckets, sum) = self.snapshot();
        let count = buckets.iter().map(|(_, c)| c).sum();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Label set naming a service.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabel {
    /// Service name, e.g. `read_write`.
    pub service: String,
}

/// Label set naming a worker thread.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    /// The worker's number, from 0.
    pub worker: String,
}

/// Label set naming a host.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HostLabel {
    /// `host:port`.
    pub host: String,
}

/// Label set of a connection error.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    /// Service name.
    pub service: String,
    /// Short reason, e.g. `no_host`, `server_connect`, `protocol`.
    pub reason: String,
}

/// Label set of an authentication failure.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why: `bad_password`, `hba_no_match`, `hba_reject`, `auth_query`, `auth_timeout`, …
    pub reason: String,
}

/// Label set of a routing decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    /// Service name.
    pub service: String,
    /// Chosen `host:port`.
    pub host: String,
}

/// The proxy's metrics. Handles to individual series are cloned into
/// sessions once, so the per-message path only does atomic adds.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// Open client connections per service.
    pub client_connections: Family<ServiceLabel, Gauge>,
    /// Open server connections per host.
    pub server_connections: Family<HostLabel, Gauge>,
    /// Bytes received from clients per service.
    pub bytes_from_clients: Family<ServiceLabel, Counter>,
    /// Bytes sent to clients per service.
    pub bytes_to_clients: Family<ServiceLabel, Counter>,
    /// Failed or refused client connections by reason.
    pub connection_errors: Family<ErrorLabel, Counter>,
    /// New sessions routed, per service and chosen host.
    pub routing_decisions: Family<RouteLabel, Counter>,
    /// Sessions ended by pgwarden because their host changed role or died.
    pub sessions_terminated: Family<ErrorLabel, Counter>,
    /// Statements refused on read-only services.
    pub read_only_refusals: Family<ServiceLabel, Counter>,
    /// Failed client authentications by reason.
    pub auth_failures: Family<ReasonLabel, Counter>,
    /// How long clients waited for a pooled server connection.
    pub pool_wait: Family<ServiceLabel, WaitHistogram, fn() -> WaitHistogram>,
    /// Pooled clients moved after login to the worker thread of their
    /// pool (`engine.pool_affinity`).
    pub client_moves: Counter,
    /// Clients placed on each worker thread and still connected; set
    /// when scraped.
    pub worker_clients: Family<WorkerLabel, Gauge>,
    /// 1 while a service is paused; set when scraped.
    pub service_paused: Family<ServiceLabel, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let m = Metrics {
            registry: Mutex::new(Registry::with_prefix("pgwarden")),
            client_connections: Family::default(),
            server_connections: Family::default(),
            bytes_from_clients: Family::default(),
            bytes_to_clients: Family::default(),
            connection_errors: Family::default(),
            routing_decisions: Family::default(),
            sessions_terminated: Family::default(),
            read_only_refusals: Family::default(),
            auth_failures: Family::default(),
            pool_wait: Family::new_with_constructor(WaitHistogram::new),
            client_moves: Counter::default(),
            worker_clients: Family::default(),
            service_paused: Family::default(),
        };
        {
            let mut r = m.registry.lock().expect("metrics registry");
            r.register(
                "client_connections",
                "Open client connections",
                m.client_connections.clone(),
            );
            r.register(
                "server_connections",
                "Open server connections",
                m.server_connections.clone(),
            );
            r.register(
                "client_received_bytes",
                "Bytes received from clients",
                m.bytes_from_clients.clone(),
            );
            r.register(
                "client_sent_bytes",
                "Bytes sent to clients",
                m.bytes_to_clients.clone(),
            );
            r.register(
                "connection_errors",
                "Client connections that failed, by reason",
                m.connection_errors.clone(),
            );
            r.register(
                "routing_decisions",
                "New sessions routed, by service and host",
                m.routing_decisions.clone(),
            );
            r.register(
                "sessions_terminated",
                "Sessions ended because their host changed role or died",
                m.sessions_terminated.clone(),
            );
            r.register(
                "read_only_refusals",
                "Statements refused on read-only services",
                m.read_only_refusals.clone(),
            );
            r.register(
                "auth_failures",
                "Failed client authentications, by reason",
                m.auth_failures.clone(),
            );
            r.register(
                "pool_wait_seconds",
                "Time clients waited for a pooled server connection",
                m.pool_wait.clone(),
            );
            r.register(
                "client_moves",
                "Pooled clients moved after login to the worker thread of their pool",
                m.client_moves.clone(),
            );
            r.register(
                "worker_clients",
                "Clients placed on each worker thread and still connected",
                m.worker_clients.clone(),
            );
            r.register(
                "service_paused",
                "1 while the service is paused (new transactions or sessions wait for a resume)",
                m.service_paused.clone(),
            );
        }
        m
    }

    /// The byte counters of one service, resolved once per session so the
    /// message path only does atomic adds.
    pub fn byte_counters(&self, service: &str) -> (Counter, Counter) {
        let label = ServiceLabel {
            service: service.into(),
        };
        (
            self.bytes_from_clients.get_or_create(&label).clone(),
            self.bytes_to_clients.get_or_create(&label).clone(),
        )
    }

    /// Counts a connection error.
    pub fn error(&self, service: &str, reason: &str) {
        self.connection_errors
            .get_or_create(&ErrorLabel {
                service: service.into(),
                reason: reason.into(),
            })
            .inc();
    }

    /// The Prometheus text exposition: the proxy's own series plus one
    /// gauge set per host from the current topology snapshot.
    pub fn render(
        &self,
        snapshot: &Snapshot,
        pools: &[std::sync::Arc<crate::pool::Pool>],
    ) -> String {
        let mut open_metrics = String::new();
        {
            let r = self.registry.lock().expect("metrics registry");
            let _ = encode(&mut open_metrics, &r);
        }
        let mut out = String::with_capacity(open_metrics.len() * 2);
        as_text_format(&open_metrics, &mut out);
        let hosts = snapshot.topology.hosts();
        let primary = snapshot.topology.primary();
        let gauges: [(&str, &str, &str); 6] = [
            (
                "pgwarden_host_up",
                "gauge",
                "1 while the host counts as up (down after down_after_failures failed probes in a row)",
            ),
            (
                "pgwarden_host_primary",
                "gauge",
                "1 if the host is the selectable primary",
            ),
            (
                "pgwarden_host_replica",
                "gauge",
                "1 if the host last reported itself a replica",
            ),
            (
                "pgwarden_host_rtt_seconds",
                "gauge",
                "Smoothed probe round-trip time",
            ),
            (
                "pgwarden_host_lag_bytes",
                "gauge",
                "WAL bytes the replica has yet to replay",
            ),
            (
                "pgwarden_host_failed_probes",
                "gauge",
                "Probes of the host failed in a row since its last answer",
            ),
        ];
        for (i, (name, kind, help)) in gauges.iter().enumerate() {
            out.push_str(&format!("# HELP {name} {help}.\n# TYPE {name} {kind}\n"));
            for (idx, h) in hosts.iter().enumerate() {
                let value = match i {
                    0 => Some(f64::from(u8::from(h.alive))),
                    1 => Some(f64::from(u8::from(primary == Some(idx)))),
                    2 => Some(f64::from(u8::from(h.role == Role::Replica))),
                    3 => h.rtt.get().map(|ms| ms / 1000.0),
                    4 => h.lag_bytes.map(|b| b as f64),
                    _ => Some(f64::from(h.failed_probes)),
                };
                if let Some(v) = value {
                    out.push_str(&format!(
                        "{name}{{host=\"{}\"}} {v}\n",
                        escape_label(&h.config.addr.to_string())
                    ));
                }
            }
        }
        let pool_series: [(&str, &str, &str); 14] = [
            (
                "pgwarden_pool_clients_waiting",
                "gauge",
                "Clients waiting for a server connection",
            ),
            (
                "pgwarden_pool_clients_active",
                "gauge",
                "Clients holding one of the pool's server connections",
            ),
            (
                "pgwarden_pool_servers_active",
                "gauge",
                "Server connections lent to clients",
            ),
            (
                "pgwarden_pool_servers_idle",
                "gauge",
                "Idle server connections",
            ),
            (
                "pgwarden_pool_servers_open",
                "gauge",
                "Server connections open",
            ),
            (
                "pgwarden_pool_transactions_total",
                "counter",
                "Transactions served by the pool",
            ),
            (
                "pgwarden_pool_waited_seconds_total",
                "counter",
                "Time clients spent waiting for a server connection",
            ),
            (
                "pgwarden_pool_wait_max_seconds",
                "gauge",
                "How long the client waiting longest now has waited for a server connection (PgBouncer's maxwait)",
            ),
            (
                "pgwarden_pool_server_moves_total",
                "counter",
                "Server connections moved to another worker thread with the client that borrowed them",
            ),
            (
                "pgwarden_pool_queries_total",
                "counter",
                "Queries and extended-protocol batches completed (one per ReadyForQuery)",
            ),
            (
                "pgwarden_pool_received_bytes_total",
                "counter",
                "Bytes from clients sent to the pool's servers",
            ),
            (
                "pgwarden_pool_sent_bytes_total",
                "counter",
                "Bytes from the pool's servers sent to clients",
            ),
            (
                "pgwarden_pool_transaction_seconds_total",
                "counter",
                "Time spent in transactions on the pool's servers, from the message that began each to its end",
            ),
            (
                "pgwarden_pool_query_seconds_total",
                "counter",
                "Time the pool's servers spent on queries, from sending one to its ReadyForQuery",
            ),
        ];
        for (i, (name, kind, help)) in pool_series.iter().enumerate() {
            out.push_str(&format!("# HELP {name} {help}.\n# TYPE {name} {kind}\n"));
            for p in pools {
                let st = &p.stats;
                let o = std::sync::atomic::Ordering::Relaxed;
                let v: f64 = match i {
                    0 => (st.waiting.load(o) + st.capped.load(o)) as f64,
                    1 | 2 => st.active.load(o) as f64,
                    3 => p.idle_count() as f64,
                    4 => st.total.load(o) as f64,
                    5 => st.transactions.load(o) as f64,
                    6 => st.wait_us.load(o) as f64 / 1e6,
                    7 => p.oldest_wait().as_secs_f64(),
                    8 => st.moves.load(o) as f64,
                    9 => st.queries.load(o) as f64,
                    10 => st.received.load(o) as f64,
                    11 => st.sent.load(o) as f64,
                    12 => st.xact_us.load(o) as f64 / 1e6,
                    _ => st.query_us.load(o) as f64 / 1e6,
                };
                // Database and user names come from clients' start-up
                // packets: escaped, or a quote or newline in one would
                // break the page (or forge series).
                out.push_str(&format!(
                    "{name}{{host=\"{}\",database=\"{}\",user=\"{}\",read_only=\"{}\"}} {v}\n",
                    escape_label(&p.key.host.to_string()),
                    escape_label(&p.key.database),
                    escape_label(&p.key.user),
                    p.key.read_only
                ));
            }
        }
        // The same wait, per pool: the service's histogram mixes the pools
        // of all its hosts, databases and users.
        let name = "pgwarden_pool_checkout_wait_seconds";
        out.push_str(&format!(
            "# HELP {name} Time each client waited for one of the pool's server connections.\n# TYPE {name} histogram\n"
        ));
        for p in pools {
            let labels = format!(
                "host=\"{}\",database=\"{}\",user=\"{}\",read_only=\"{}\"",
                escape_label(&p.key.host.to_string()),
                escape_label(&p.key.database),
                escape_label(&p.key.user),
                p.key.read_only
            );
            let (buckets, sum) = p.stats.wait.snapshot();
            let mut cumulative = 0;
            for (bound, n) in buckets {
                cumulative += n;
                let le = if bound == f64::MAX {
                    "+Inf".to_string()
                } else {
                    bound.to_string()
                };
                out.push_str(&format!(
                    "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}\n"
                ));
            }
            out.push_str(&format!("{name}_sum{{{labels}}} {sum}\n"));
            out.push_str(&format!("{name}_count{{{labels}}} {cumulative}\n"));
        }
        out.push_str(&format!(
            "# HELP pgwarden_topology_rounds_total Completed probe rounds.\n# TYPE pgwarden_topology_rounds_total counter\npgwarden_topology_rounds_total {}\n",
            snapshot.round
        ));
        out
    }
}

/// prometheus-client writes OpenMetrics, where a counter family `x` has
/// samples named `x_total` and the page ends with `# EOF`. The page is
/// served in Prometheus' text format 0.0.4 (what every scraper reads),
/// where HELP and TYPE name the samples themselves: a counter's lines are
/// renamed to `x_total` (else its type is lost to strict parsers and
/// metadata), and the EOF marker goes.
fn as_text_format(open_metrics: &str, out: &mut String) {
    let counters: std::collections::HashSet<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    for line in open_metrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        if let Some((prefix, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            if counters.contains(name) && !name.ends_with("_total") {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total ");
                out.push_str(tail);
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
}

/// A label value in the text exposition format: backslash, double quote
/// and newline escaped.
fn escape_label(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return std::borrow::Cow::Borrowed(v);
    }
    let mut out = String::with_capacity(v.len() + 8);
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::histogram::Histogram;

    /// Every sample is declared under its own name (a histogram's under
    /// its family's), once, as the 0.0.4 text format wants.
    #[test]
    fn the_page_is_valid_text_format() {
        let m = Metrics::new();
        m.error("read_write", "no_host");
        m.byte_counters("read_write").0.inc_by(7);
        m.pool_wait
            .get_or_create(&ServiceLabel {
                service: "read_write".into(),
            })
            .observe(Duration::from_millis(3));
        m.client_moves.inc();
        let topology = pgwarden_topology::Topology::new(
            vec![pgwarden_topology::HostConfig::new(
                pgwarden_topology::HostAddr::new("db", 5432),
            )],
            pgwarden_topology::TopologyConfig::default(),
        );
        let page = m.render(&Snapshot { topology, round: 4 }, &[]);
        assert!(!page.contains("# EOF"), "{page}");
        let mut types: std::collections::HashMap<&str, &str> = Default::default();
        let mut helps = std::collections::HashSet::new();
        for line in page.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(
                    types.insert(name, kind).is_none(),
                    "two TYPE lines for {name}"
                );
            } else if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap();
                assert!(helps.insert(name), "two HELP lines for {name}");
            }
        }
        let mut samples = 0;
        for line in page
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let name = line.split(['{', ' ']).next().unwrap();
            let declared = types.get(name).copied().or_else(|| {
                ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| types.get(name.strip_suffix(s)?).copied())
                    .filter(|k| *k == "histogram")
            });
            assert!(declared.is_some(), "{name} has no TYPE line:\n{page}");
            if declared == Some("counter") {
                assert!(name.ends_with("_total"), "{name}");
            }
            samples += 1;
        }
        assert!(samples > 10, "{page}");
        assert!(
            page.contains("# TYPE pgwarden_connection_errors_total counter"),
            "{page}"
        );
        assert!(page.contains("pgwarden_topology_rounds_total 4"), "{page}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("plain"), "plain");
        assert_eq!(
            escape_label("x\"} 1\nfake{a=\"\\"),
            "x\\\"} 1\\nfake{a=\\\"\\\\"
        );
    }
    use std::time::Duration;

    /// The lock-free histogram reads exactly as the library's would.
    #[test]
    fn wait_histogram_encodes_like_the_librarys() {
        let text = |f: &dyn Fn(&mut Registry)| {
            let mut r = Registry::default();
            f(&mut r);
            let mut out = String::new();
            encode(&mut out, &r).unwrap();
            out
        };
        let waits = [0, 0, 5, 10, 11, 250_000, 3_000_000, 9_000_000_000u64];
        let ours = text(&|r| {
            let h = WaitHistogram::new();
            for w in waits {
                h.observe(Duration::from_nanos(w));
            }
            r.register("wait", "waits", h);
        });
        let theirs = text(&|r| {
            let h = Histogram::new(wait_bounds());
            for w in waits {
                h.observe(Duration::from_nanos(w).as_secs_f64());
            }
            r.register("wait", "waits", h);
        });
        assert_eq!(ours, theirs);
        assert!(ours.contains("wait_count 8"), "{ours}");
        // Bounds read as written.
        assert!(ours.contains("le=\"0.00003\""), "{ours}");
        assert!(ours.contains("le=\"0.00243\""), "{ours}");
    }
}
