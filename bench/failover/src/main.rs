//! The failover benchmark: how long writes stop, how many fail and how many
//! acknowledged ones are lost when the leader of a 3-node `pgwarden agent`
//! cluster fails.
//!
//! For each timing setting (a preset such as `fast`, or an RTO target in
//! seconds) it starts one cluster with the test kit ([`AgentCluster`]: real
//! etcd, one agent process per node, all on 127.0.0.1, a relay between each
//! agent and etcd) and injects each fault K times, reusing the cluster
//! once it is healthy again (one primary, two streaming replicas):
//!
//! - `passive`: SIGKILL of the leader's agent and PostgreSQL (node loss);
//! - `active`: SIGKILL of the leader's PostgreSQL only; its agent restarts it;
//! - `partition`: the leader's relay to etcd drops every byte;
//! - `switchover`: `POST /switchover` to the leader's REST API, naming a
//!   replica as the candidate.
//!
//! A client tries one write every 100 ms through the read-write port of a
//! node that survives the fault, each on a NEW connection, bounded by 1 s
//! for connect + insert (`INSERT INTO probe (id) VALUES (n) RETURNING
//! inet_server_port()`). An attempt that does not finish within 100 ms
//! delays the next one to the following 100 ms tick. Measured per fault:
//! RTO (from the fault to the acknowledgement of the first write after the
//! last failed one), the write pause (from the start of the first failed
//! attempt to that acknowledgement), the failed attempts, and the
//! acknowledged writes missing on the leader afterwards.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, ValueEnum};
use pgwarden_ha::{RtoSetting, Timing, TimingOverrides};
use pgwarden_testkit::AgentCluster;

/// Command-line arguments.
#[derive(Parser, Debug)]
#[command(
    name = "pgwarden-bench-failover",
    about = "Failover benchmark of pgwarden's HA agent"
)]
struct Args {
    /// The `pgwarden` binary the agents run (build it in release).
    #[arg(long)]
    bin: PathBuf,
    /// Timing settings: presets (`fast`, `norm`, `safe`, `wide`) or RTO
    /// targets in seconds (`8`); repeat or separate with commas.
    #[arg(long, value_delimiter = ',', default_values = ["fast", "norm", "8"])]
    rto: Vec<String>,
    /// Faults to inject; repeat or separate with commas.
    #[arg(long, value_enum, value_delimiter = ',',
          default_values = ["passive", "active", "partition", "switchover"])]
    fault: Vec<Fault>,
    /// Repetitions of each fault per setting.
    #[arg(long, default_value_t = 5)]
    k: usize,
    /// Keeps the agents' and PostgreSQL's logs, every write attempt and the
    /// per-repetition results under this directory.
    #[arg(long)]
    logs: Option<PathBuf>,
}

/// A fault injected into the leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Fault {
    /// SIGKILL of the leader's agent and PostgreSQL.
    Passive,
    /// SIGKILL of the leader's PostgreSQL; the agent restarts it.
    Active,
    /// The leader's connection to etcd drops every byte.
    Partition,
    /// A switchover to a replica through the REST API.
    Switchover,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Passive => "passive",
            Fault::Active => "active",
            Fault::Partition => "partition",
            Fault::Switchover => "switchover",
        }
    }
}

/// One write attempt of the client.
#[derive(Clone, Debug)]
struct Attempt {
    id: i64,
    start: Instant,
    end: Instant,
    /// The PostgreSQL port that acknowledged the write, or why it failed.
    result: Result<u16, String>,
}

/// The client: one write every 100 ms on a new connection each time.
struct Writer {
    stop: Arc<AtomicBool>,
    attempts: Arc<Mutex<Vec<Attempt>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    fn start(conninfo: String, next_id: Arc<AtomicI64>) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let (s, a) = (stop.clone(), attempts.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            while !s.load(Ordering::SeqCst) {
                tick.tick().await;
                let id = next_id.fetch_add(1, Ordering::SeqCst);
                let start = Instant::now();
                let result = write_once(&conninfo, id).await;
                let attempt = Attempt {
                    id,
                    start,
                    end: Instant::now(),
                    result,
                };
                a.lock().expect("attempts").push(attempt);
            }
        });
        Writer {
            stop,
            attempts,
            task,
        }
    }

    fn snapshot(&self) -> Vec<Attempt> {
        self.attempts.lock().expect("attempts").clone()
    }

    async fn finish(self) -> Vec<Attempt> {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.task.await;
        let attempts = self.attempts.lock().expect("attempts").clone();
        attempts
    }
}

/// One write on a new connection, within 1 s in all.
async fn write_once(conninfo: &str, id: i64) -> Result<u16, String> {
    let work = async {
        let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("connect: {}", pg_error(&e)))?;
        tokio::spawn(conn);
        let q = format!("INSERT INTO probe (id) VALUES ({id}) RETURNING inet_server_port()");
        let rows = client
            .simple_query(&q)
            .await
            .map_err(|e| format!("insert: {}", pg_error(&e)))?;
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0)?.parse().ok(),
                _ => None,
            })
            .ok_or_else(|| "insert: no row".to_string())
    };
    tokio::time::timeout(Duration::from_secs(1), work)
        .await
        .unwrap_or_else(|_| Err("timed out after 1 s".to_string()))
}

fn pg_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{} {}", d.code().code(), d.message()),
        None => e.to_string(),
    }
}

/// The first column of every row of `q`, or the error as text.
async fn query(conninfo: &str, q: &str) -> Result<Vec<String>, String> {
    let (client, conn) = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_postgres::connect(conninfo, tokio_postgres::NoTls),
    )
    .await
    .map_err(|_| "connect timed out".to_string())?
    .map_err(|e| pg_error(&e))?;
    tokio::spawn(conn);
    let msgs = tokio::time::timeout(Duration::from_secs(10), client.simple_query(q))
        .await
        .map_err(|_| "query timed out".to_string())?
        .map_err(|e| pg_error(&e))?;
    Ok(msgs
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap_or("").to_string()),
            _ => None,
        })
        .collect())
}

/// Waits until exactly one node is primary and two replicas stream from
/// it; returns the primary's index.
async fn healthy(c: &AgentCluster, within: Duration) -> Result<usize, String> {
    let deadline = Instant::now() + within;
    loop {
        let mut primaries = Vec::new();
        for (i, n) in c.nodes().iter().enumerate() {
            let r = query(&n.pg_conninfo(), "SELECT pg_is_in_recovery()").await;
            if r.as_deref().map(|v| v.first().map(String::as_str)) == Ok(Some("f")) {
                primaries.push(i);
            }
        }
        let last = match primaries[..] {
            [p] => {
                let n = query(
                    &c.node(p).pg_conninfo(),
                    "SELECT count(*) FROM pg_stat_replication \
                     WHERE state = 'streaming' AND application_name ~ '^n[0-9]+$'",
                )
                .await
                .map(|v| v.concat());
                if n.as_deref() == Ok("2") {
                    return Ok(p);
                }
                format!("node {p} primary, streaming: {n:?}")
            }
            _ => format!("primaries: {primaries:?}"),
        };
        if Instant::now() >= deadline {
            return Err(format!("not healthy within {within:?}: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What one repetition measured.
#[derive(Clone, Debug, Default)]
struct Outcome {
    /// From the fault to the first acknowledged write after the last failed
    /// one (zero when no write failed).
    rto: Duration,
    /// From the start of the first failed attempt to that acknowledgement.
    pause: Duration,
    failed: usize,
    acked: usize,
    lost: Vec<i64>,
    /// Writes that failed on the client but are on the leader.
    in_doubt_committed: usize,
    /// The last acknowledgement by the old leader, after the fault.
    old_leader_last_ack: Option<Duration>,
    new_leader: String,
    recovered: bool,
    note: String,
}

/// The analysis of the attempts so far, relative to the fault at `t0`.
struct Analysis {
    failed: usize,
    rto: Duration,
    pause: Duration,
    other_node_acked: bool,
    /// The successes since the last failure: count and time span.
    tail: (usize, Duration),
    old_leader_last_ack: Option<Duration>,
}

fn analyse(attempts: &[Attempt], t0: Instant, old_port: u16) -> Analysis {
    let after: Vec<&Attempt> = attempts.iter().filter(|a| a.end >= t0).collect();
    let last_fail = after.iter().rposition(|a| a.result.is_err());
    let first_fail = after.iter().position(|a| a.result.is_err());
    let failed = after.iter().filter(|a| a.result.is_err()).count();
    let tail_from = last_fail.map_or(0, |i| i + 1);
    let tail = &after[tail_from..];
    let (rto, pause) = match (first_fail, tail.first()) {
        (Some(f), Some(ok)) => (
            ok.end.saturating_duration_since(t0),
            ok.end.saturating_duration_since(after[f].start),
        ),
        _ => (Duration::ZERO, Duration::ZERO),
    };
    let span = match (tail.first(), tail.last()) {
        (Some(a), Some(b)) => b.end.saturating_duration_since(a.start),
        _ => Duration::ZERO,
    };
    Analysis {
        failed,
        rto,
        pause,
        other_node_acked: after
            .iter()
            .any(|a| matches!(a.result, Ok(p) if p != old_port)),
        tail: (tail.len(), span),
        old_leader_last_ack: after
            .iter()
            .rev()
            .find(|a| a.result == Ok(old_port))
            .map(|a| a.end.saturating_duration_since(t0)),
    }
}

/// A small pseudo-random number for the fault's offset in the loop.
fn jitter(max: Duration) -> Duration {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64 ^ d.as_secs());
    let mut x = nanos
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    x ^= x >> 33;
    let ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX).max(1);
    Duration::from_millis(x % ms)
}

/// Wall-clock time of day, UTC, as the agents' logs print it.
fn wall() -> String {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let s = d.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}Z",
        s / 3600,
        s / 60 % 60,
        s % 60,
        d.subsec_millis()
    )
}

fn secs(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64())
}

/// One timing setting under test.
struct Setting {
    label: String,
    toml: String,
    timing: Timing,
    reference: Option<pgwarden_ha::ReferenceRto>,
}

impl Setting {
    fn parse(s: &str) -> Result<Setting, String> {
        let setting: RtoSetting = s.parse().map_err(|e| format!("{e}"))?;
        let timing = setting
            .resolve(&TimingOverrides::default())
            .map_err(|e| format!("{e}"))?;
        let (label, reference) = match setting {
            RtoSetting::Preset(p) => (p.name().to_string(), Some(p.reference_rto())),
            RtoSetting::Target(_) => (format!("rto = {}", s.trim()), None),
        };
        Ok(Setting {
            label,
            toml: format!("rto = \"{}\"", s.trim()),
            timing,
            reference,
        })
    }
}

/// Everything one setting and fault produced.
struct Row {
    setting: String,
    fault: Fault,
    outcomes: Vec<Outcome>,
    timing: Timing,
    reference: Option<pgwarden_ha::ReferenceRto>,
}

/// The run's shared state.
struct Bench {
    bin: PathBuf,
    k: usize,
    logs: Option<PathBuf>,
    next_id: Arc<AtomicI64>,
    results_csv: String,
}

impl Bench {
    fn log_file(&self, name: &str, text: &str) {
        if let Some(dir) = &self.logs {
            let _ = std::fs::create_dir_all(dir);
            let _ = std::fs::write(dir.join(name), text);
        }
    }

    fn save_cluster_logs(&self, c: &AgentCluster, label: &str) {
        let Some(dir) = &self.logs else { return };
        let dest = dir.join(label.replace([' ', '='], ""));
        let _ = std::fs::create_dir_all(&dest);
        if let Ok(entries) = std::fs::read_dir(c.dir()) {
            for e in entries.flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "log") {
                    let _ = std::fs::copy(&p, dest.join(e.file_name()));
                }
            }
        }
    }

    /// Runs every fault K times on one cluster with `setting`.
    async fn run_setting(&mut self, setting: &Setting, faults: &[Fault]) -> Vec<Row> {
        eprintln!(
            "[{}] {}: starting a 3-node cluster (ttl {} s, loop_wait {} s, retry_timeout {} s, primary_start_timeout {} s)",
            wall(),
            setting.label,
            secs(setting.timing.ttl),
            secs(setting.timing.loop_wait),
            secs(setting.timing.retry_timeout),
            secs(setting.timing.primary_start_timeout),
        );
        let mut c = AgentCluster::builder(&self.bin)
            .etcd_relays()
            .agent_settings(&setting.toml)
            .start();
        let mut rows = Vec::new();
        let mut all_acked: BTreeSet<i64> = BTreeSet::new();
        let mut broken = false;
        match healthy(&c, Duration::from_secs(180)).await {
            Ok(p) => {
                if let Err(e) = query(
                    &c.node(p).pg_conninfo(),
                    "CREATE TABLE IF NOT EXISTS probe (id bigint PRIMARY KEY, \
                     t timestamptz NOT NULL DEFAULT now())",
                )
                .await
                {
                    eprintln!("creating the probe table: {e}");
                    broken = true;
                }
            }
            Err(e) => {
                eprintln!("[{}] {}: bootstrap failed: {e}", wall(), setting.label);
                broken = true;
            }
        }
        for &fault in faults {
            let mut outcomes = Vec::new();
            for rep in 1..=self.k {
                if broken {
                    break;
                }
                match self.one(&mut c, setting, fault, rep).await {
                    Ok((o, acked)) => {
                        all_acked.extend(acked);
                        outcomes.push(o);
                    }
                    Err(e) => {
                        eprintln!(
                            "[{}] {} {} #{rep}: aborted: {e}",
                            wall(),
                            setting.label,
                            fault.name()
                        );
                        broken = true;
                    }
                }
            }
            rows.push(Row {
                setting: setting.label.clone(),
                fault,
                outcomes,
                timing: setting.timing,
                reference: setting.reference,
            });
        }
        // A last look, once the cluster has settled: is every write ever
        // acknowledged on the final leader?
        if let Ok(p) = healthy(&c, Duration::from_secs(120)).await {
            let present = present_ids(&c.node(p).pg_conninfo(), &all_acked).await;
            match present {
                Ok(present) => {
                    let missing = all_acked.difference(&present).count();
                    eprintln!(
                        "[{}] {}: final check on {}: {} acknowledged writes, {missing} missing",
                        wall(),
                        setting.label,
                        c.node(p).name,
                        all_acked.len()
                    );
                }
                Err(e) => eprintln!("final check failed: {e}"),
            }
        }
        self.save_cluster_logs(&c, &setting.label);
        rows
    }

    /// One repetition of one fault; restores the fault afterwards.
    async fn one(
        &mut self,
        c: &mut AgentCluster,
        setting: &Setting,
        fault: Fault,
        rep: usize,
    ) -> Result<(Outcome, BTreeSet<i64>), String> {
        let t = setting.timing;
        let p = healthy(c, Duration::from_secs(180)).await?;
        let candidate = (p + 1) % c.len();
        let via = (p + 2) % c.len();
        let old_port = c.node(p).pg_port;
        let old_name = c.node(p).name.clone();
        let writer = Writer::start(c.node(via).rw_conninfo(), self.next_id.clone());
        // Warm up: ten writes in a row through the client's node.
        let warm_deadline = Instant::now() + Duration::from_secs(60);
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let a = writer.snapshot();
            let ok_tail = a.iter().rev().take_while(|a| a.result.is_ok()).count();
            if ok_tail >= 10 {
                break;
            }
            if Instant::now() > warm_deadline {
                let last = a.last().map(|a| a.result.clone());
                writer.finish().await;
                return Err(format!(
                    "no writes through {} before the fault: {last:?}",
                    c.node(via).name
                ));
            }
        }
        // The fault lands at a random point of the leader's loop.
        tokio::time::sleep(jitter(t.loop_wait)).await;
        let fault_wall = wall();
        let t0 = Instant::now();
        let old_pid = c.node(p).postmaster_pid();
        let mut switchover = None;
        match fault {
            Fault::Passive => c.kill_node(p),
            Fault::Active => c.kill_postgres(p),
            Fault::Partition => c.etcd_relay(p).set_blackhole(true),
            Fault::Switchover => {
                let url = format!("{}/switchover", c.node(p).api_url());
                let body = serde_json::json!({
                    "leader": old_name,
                    "candidate": c.node(candidate).name,
                });
                switchover = Some(tokio::spawn(async move {
                    let r = pgwarden_agent::http_client::request(
                        "POST",
                        &url,
                        Some(&body),
                        Some(("pgwarden", "secret")),
                        Duration::from_secs(60),
                    )
                    .await;
                    let took = t0.elapsed();
                    match r {
                        Ok(r) => format!("{} {:?} after {} s", r.status, r.body.trim(), secs(took)),
                        Err(e) => format!("error {e} after {} s", secs(took)),
                    }
                }));
            }
        }
        eprintln!(
            "[{fault_wall}] {} {} #{rep}: fault on leader {old_name} (postmaster {old_pid:?}); client via {}",
            setting.label,
            fault.name(),
            c.node(via).name
        );
        let hard = t.ttl * 3 + Duration::from_secs(60);
        let mut recovered = false;
        let mut switchover_answer = String::new();
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let a = writer.snapshot();
            let an = analyse(&a, t0, old_port);
            let fault_done = match fault {
                Fault::Active => an.failed > 0 || t0.elapsed() > Duration::from_secs(20),
                _ => an.other_node_acked,
            };
            let api_done = match &switchover {
                Some(h) => h.is_finished(),
                None => true,
            };
            let settled = an.tail.0 >= 25 && an.tail.1 >= Duration::from_secs(3);
            if fault_done && api_done && settled {
                recovered = true;
                break;
            }
            if t0.elapsed() > hard {
                break;
            }
        }
        if let Some(h) = switchover {
            switchover_answer = if h.is_finished() {
                h.await.unwrap_or_else(|e| format!("task failed: {e}"))
            } else {
                h.abort();
                "no answer".to_string()
            };
        }
        let attempts = writer.finish().await;
        let an = analyse(&attempts, t0, old_port);
        let acked: BTreeSet<i64> = attempts
            .iter()
            .filter(|a| a.result.is_ok())
            .map(|a| a.id)
            .collect();
        let all_ids: BTreeSet<i64> = attempts.iter().map(|a| a.id).collect();
        let final_port = attempts.iter().rev().find_map(|a| a.result.clone().ok());
        let final_node =
            final_port.and_then(|port| c.nodes().iter().position(|n| n.pg_port == port));
        let mut o = Outcome {
            rto: an.rto,
            pause: an.pause,
            failed: an.failed,
            acked: acked.len(),
            old_leader_last_ack: an.old_leader_last_ack,
            new_leader: final_node.map_or("?".into(), |i| c.node(i).name.clone()),
            recovered,
            ..Outcome::default()
        };
        if !recovered {
            o.note = format!("writes did not recover within {} s", secs(hard));
        }
        if let Some(i) = final_node {
            match present_ids(&c.node(i).pg_conninfo(), &all_ids).await {
                Ok(present) => {
                    o.lost = acked.difference(&present).copied().collect();
                    o.in_doubt_committed = present.difference(&acked).count();
                }
                Err(e) => o.note.push_str(&format!(" lost-write check failed: {e}")),
            }
        }
        if !switchover_answer.is_empty() {
            o.note
                .push_str(&format!(" switchover answer: {switchover_answer}"));
        }
        eprintln!(
            "[{}] {} {} #{rep}: RTO {} s, pause {} s, failed {}, acked {}, lost {:?}, in doubt committed {}, old leader's last ack {:?}, leader now {}{}",
            wall(),
            setting.label,
            fault.name(),
            secs(o.rto),
            secs(o.pause),
            o.failed,
            o.acked,
            o.lost,
            o.in_doubt_committed,
            o.old_leader_last_ack.map(secs),
            o.new_leader,
            if o.note.is_empty() { String::new() } else { format!("; {}", o.note.trim()) },
        );
        let _ = writeln!(
            self.results_csv,
            "{},{},{rep},{fault_wall},{old_name},{},{:.3},{:.3},{},{},{},{},{},\"{}\"",
            setting.label,
            fault.name(),
            o.new_leader,
            o.rto.as_secs_f64(),
            o.pause.as_secs_f64(),
            o.failed,
            o.acked,
            o.lost.len(),
            o.in_doubt_committed,
            o.old_leader_last_ack
                .map_or(String::new(), |d| format!("{:.3}", d.as_secs_f64())),
            o.note.trim().replace('"', "'"),
        );
        self.log_file("results.csv", &self.results_csv);
        let mut raw = String::from("id,start_s,end_s,result\n");
        for a in &attempts {
            let rel = |i: Instant| {
                if i >= t0 {
                    i.duration_since(t0).as_secs_f64()
                } else {
                    -t0.duration_since(i).as_secs_f64()
                }
            };
            let _ = writeln!(
                raw,
                "{},{:.3},{:.3},\"{}\"",
                a.id,
                rel(a.start),
                rel(a.end),
                match &a.result {
                    Ok(p) => format!("ok {p}"),
                    Err(e) => e.replace('"', "'"),
                }
            );
        }
        self.log_file(
            &format!(
                "attempts-{}-{}-{rep}.csv",
                setting.label.replace([' ', '='], ""),
                fault.name()
            ),
            &raw,
        );
        // Undo the fault; the next repetition waits until healthy.
        match fault {
            Fault::Passive => c.start_agent(p),
            Fault::Partition => c.etcd_relay(p).set_blackhole(false),
            Fault::Active | Fault::Switchover => {}
        }
        if !recovered {
            self.save_cluster_logs(c, &format!("{}-unrecovered", setting.label));
        }
        Ok((o, acked))
    }
}

/// The ids of `ids` present in the node's probe table.
async fn present_ids(conninfo: &str, ids: &BTreeSet<i64>) -> Result<BTreeSet<i64>, String> {
    let (Some(lo), Some(hi)) = (ids.first(), ids.last()) else {
        return Ok(BTreeSet::new());
    };
    let rows = query(
        conninfo,
        &format!("SELECT id FROM probe WHERE id BETWEEN {lo} AND {hi}"),
    )
    .await?;
    Ok(rows.iter().filter_map(|r| r.parse().ok()).collect())
}

fn min_avg_max(v: &[f64]) -> Option<(f64, f64, f64)> {
    if v.is_empty() {
        return None;
    }
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Some((min, v.iter().sum::<f64>() / v.len() as f64, max))
}

fn table(rows: &[Row]) -> String {
    let mut s = String::new();
    s.push_str(
        "| setting | fault | K | RTO min / avg / max (s) | write pause avg (s) | failed writes min / avg / max | acknowledged writes lost (total) | pgwarden expected (s) | reference model min / avg / max (s) |\n\
         |---|---|---:|---|---:|---|---:|---|---|\n",
    );
    for r in rows {
        let rto: Vec<f64> = r.outcomes.iter().map(|o| o.rto.as_secs_f64()).collect();
        let pause: Vec<f64> = r.outcomes.iter().map(|o| o.pause.as_secs_f64()).collect();
        let failed: Vec<f64> = r.outcomes.iter().map(|o| o.failed as f64).collect();
        let lost: usize = r.outcomes.iter().map(|o| o.lost.len()).sum();
        let unrecovered = r.outcomes.iter().filter(|o| !o.recovered).count();
        let fmt3 = |v: Option<(f64, f64, f64)>, d: usize| {
            v.map_or("—".to_string(), |(a, b, c)| {
                format!("{a:.d$} / {b:.d$} / {c:.d$}")
            })
        };
        let t = &r.timing;
        let expected = match r.fault {
            Fault::Passive | Fault::Partition => format!(
                "{} avg / {} worst",
                secs(t.expected_passive_rto()),
                secs(t.worst_passive_rto())
            ),
            Fault::Active => format!(
                "≤ 3 (restart); {} if it fails",
                secs(t.expected_active_rto())
            ),
            Fault::Switchover => "pause < 1".to_string(),
        };
        let reference = match (r.reference, r.fault) {
            (Some(rf), Fault::Passive) => format!(
                "{} / {} / {}",
                rf.passive.min.as_secs(),
                rf.passive.avg.as_secs(),
                rf.passive.max.as_secs()
            ),
            (Some(rf), Fault::Active) => format!(
                "{} / {} / {}",
                rf.active.min.as_secs(),
                rf.active.avg.as_secs(),
                rf.active.max.as_secs()
            ),
            (Some(rf), Fault::Partition) => format!(
                "— (≈ passive: {} / {} / {})",
                rf.passive.min.as_secs(),
                rf.passive.avg.as_secs(),
                rf.passive.max.as_secs()
            ),
            _ => "—".to_string(),
        };
        let k = if unrecovered > 0 {
            format!("{} ({unrecovered} unrecovered)", r.outcomes.len())
        } else {
            r.outcomes.len().to_string()
        };
        let _ = writeln!(
            s,
            "| {} | {} | {k} | {} | {} | {} | {lost} | {expected} | {reference} |",
            r.setting,
            r.fault.name(),
            fmt3(min_avg_max(&rto), 1),
            min_avg_max(&pause).map_or("—".into(), |(_, a, _)| format!("{a:.1}")),
            min_avg_max(&failed).map_or("—".into(), |(a, b, c)| format!(
                "{a:.0} / {b:.1} / {c:.0}"
            )),
        );
    }
    s
}

fn per_repetition(rows: &[Row]) -> String {
    let mut s = String::new();
    for r in rows {
        let rtos: Vec<String> = r.outcomes.iter().map(|o| secs(o.rto)).collect();
        let failed: Vec<String> = r.outcomes.iter().map(|o| o.failed.to_string()).collect();
        let _ = writeln!(
            s,
            "- {} {}: RTO {} s; failed {}",
            r.setting,
            r.fault.name(),
            rtos.join(", "),
            failed.join(", ")
        );
    }
    s
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let settings: Vec<Setting> = args
        .rto
        .iter()
        .map(|s| Setting::parse(s).unwrap_or_else(|e| panic!("--rto {s}: {e}")))
        .collect();
    let mut bench = Bench {
        bin: args.bin.clone(),
        k: args.k,
        logs: args.logs.clone(),
        next_id: Arc::new(AtomicI64::new(1)),
        results_csv: "setting,fault,rep,fault_at_utc,old_leader,new_leader,rto_s,pause_s,failed,acked,lost,in_doubt_committed,old_leader_last_ack_s,note\n".to_string(),
    };
    let mut rows = Vec::new();
    for s in &settings {
        // Clusters (etcd, agents) are started from this thread: they die
        // with the thread that started them.
        rows.extend(bench.run_setting(s, &args.fault).await);
        println!("{}", table(&rows));
    }
    let out = format!("{}\n{}", table(&rows), per_repetition(&rows));
    println!("\n{out}");
    bench.log_file("table.md", &out);
    if let Some(d) = &args.logs {
        eprintln!("logs in {}", Path::new(d).display());
    }
}
