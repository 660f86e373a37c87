//! `pgwarden ctl`: operate an HA cluster through any member's REST API,
//! the way `patronictl` does.

use std::time::Duration;

use anyhow::{bail, Context};
use pgwarden_agent::http_client::{self, Response};
use serde_json::{json, Map, Value};

/// Bound on the simple requests.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Bound on a switchover or failover, which the API answers only once the
/// leader has moved (or after its own wait of 30 s).
const MOVE_TIMEOUT: Duration = Duration::from_secs(60);
/// A restart order may wait for the member's HA loop to apply settings
/// changed a moment ago before it is answered.
const RESTART_TIMEOUT: Duration = Duration::from_secs(30);

/// Options of `pgwarden ctl`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Base URL of a member's API; any member can serve every command.
    #[arg(
        long,
        global = true,
        env = "PGWARDEN_API",
        default_value = "http://127.0.0.1:8008",
        value_name = "URL"
    )]
    api: String,
    /// PEM CA certificates an `https://` API's certificate must chain to
    /// (the members' `agent.api_ca_file`).
    #[arg(long, global = true, env = "PGWARDEN_API_CA", value_name = "FILE")]
    cacert: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for an API with `agent.api_verify_client`.
    #[arg(
        long,
        global = true,
        env = "PGWARDEN_API_CERT",
        value_name = "FILE",
        requires = "key"
    )]
    cert: Option<std::path::PathBuf>,
    /// Its private key (PEM).
    #[arg(
        long,
        global = true,
        env = "PGWARDEN_API_KEY",
        value_name = "FILE",
        requires = "cert"
    )]
    key: Option<std::path::PathBuf>,
    /// User name for the write commands.
    #[arg(long, global = true, default_value = "pgwarden")]
    username: String,
    /// Password for the write commands (`agent.api_password` of the member).
    #[arg(
        long,
        global = true,
        env = "PGWARDEN_API_PASSWORD",
        hide_env_values = true
    )]
    password: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Show the members, their roles, states and lag.
    List,
    /// As `list`, with each replica under the member it streams from.
    Topology,
    /// Move leadership from the healthy leader to another member.
    Switchover {
        /// The member to become leader.
        #[arg(long)]
        candidate: String,
        /// The current leader, checked before anything is changed.
        #[arg(long)]
        leader: Option<String>,
        /// When to switch over: an ISO 8601 timestamp with a UTC offset
        /// (`2030-01-01T03:00:00+01:00`), or `now`. The leader carries it
        /// out at that time; `pgwarden ctl cancel-switchover` withdraws it.
        #[arg(long, value_name = "TIME")]
        scheduled: Option<String>,
    },
    /// Withdraw a pending or scheduled switchover.
    CancelSwitchover,
    /// Make a member leader of a cluster that has none.
    Failover {
        /// The member to become leader.
        #[arg(long)]
        candidate: String,
        /// Skip the candidate's health checks, and depose a healthy leader.
        /// Can lose data.
        #[arg(long)]
        force: bool,
    },
    /// Maintenance mode on: the agents stop all automatic actions.
    Pause,
    /// Maintenance mode off.
    Resume,
    /// Show the promotions the cluster went through.
    History,
    /// Show the dynamic configuration.
    ShowConfig,
    /// Change the dynamic configuration.
    EditConfig {
        /// `KEY=VALUE`, KEY a dotted path (`postgresql.parameters.work_mem`),
        /// VALUE JSON or else a string; `null` removes the key.
        #[arg(long = "set", value_name = "KEY=VALUE", required = true)]
        set: Vec<String>,
    },
    /// Restart the member's PostgreSQL in its current role.
    Restart {
        /// When: an ISO 8601 timestamp with a UTC offset. The member
        /// restarts then, if the conditions still hold.
        #[arg(long, value_name = "TIME")]
        scheduled: Option<String>,
        /// Only if the member is `primary`, `standby_leader` or `replica`
        /// (then).
        #[arg(long)]
        role: Option<String>,
        /// Only if settings are waiting for a restart (then).
        #[arg(long)]
        pending: bool,
        /// Every member, one after the other: replicas first, the leader
        /// last, each through its own API.
        #[arg(long)]
        all: bool,
    },
    /// Withdraw the member's scheduled restart.
    FlushRestart,
    /// Throw the member's data away and clone the leader again (replicas
    /// only).
    Reinit,
    /// Make the member's PostgreSQL re-read its configuration.
    Reload,
    /// Fence a member: it is never promoted nor made a synchronous
    /// standby, and takes no read traffic, until unfenced.
    Fence {
        /// The member.
        member: String,
    },
    /// Lift a member's fence.
    Unfence {
        /// The member.
        member: String,
    },
}

/// Runs one `pgwarden ctl` command.
pub async fn run(args: Args) -> anyhow::Result<()> {
    match &args.cacert {
        Some(ca) => http_client::trust_with(ca, args.cert.as_deref().zip(args.key.as_deref()))
            .map_err(|e| anyhow::anyhow!("--cacert/--cert/--key: {e}"))?,
        None if args.api.starts_with("https://") => {
            bail!("--api is https://: give --cacert, the CA of the members' API certificates")
        }
        None => {}
    }
    let api = Api {
        base: args.api.trim_end_matches('/').to_string(),
        auth: args.password.map(|p| (args.username, p)),
    };
    match args.command {
        Command::List => {
            let cluster = api.get("/cluster").await?;
            print!("{}", render_list(&cluster));
        }
        Command::Topology => {
            let cluster = api.get("/cluster").await?;
            print!("{}", render_topology(&cluster));
        }
        Command::Switchover {
            candidate,
            leader,
            scheduled,
        } => {
            let mut body = json!({ "candidate": candidate });
            if let Some(l) = leader {
                body["leader"] = json!(l);
            }
            if let Some(at) = scheduled.filter(|t| !t.trim().eq_ignore_ascii_case("now")) {
                body["scheduled_at"] = json!(at);
            }
            println!(
                "{}",
                api.write("POST", "/switchover", Some(body), MOVE_TIMEOUT)
                    .await?
            );
        }
        Command::Failover { candidate, force } => {
            let body = json!({ "candidate": candidate, "force": force });
            println!(
                "{}",
                api.write("POST", "/failover", Some(body), MOVE_TIMEOUT)
                    .await?
            );
        }
        Command::CancelSwitchover => {
            println!(
                "{}",
                api.write("DELETE", "/switchover", None, TIMEOUT).await?
            )
        }
        Command::Pause => println!("{}", api.write("POST", "/pause", None, TIMEOUT).await?),
        Command::Resume => println!("{}", api.write("POST", "/resume", None, TIMEOUT).await?),
        Command::History => print!("{}", render_history(&api.get("/history").await?)),
        Command::ShowConfig => {
            println!(
                "{}",
                serde_json::to_string_pretty(&api.get("/config").await?)?
            );
        }
        Command::EditConfig { set } => {
            let patch = config_patch(&set)?;
            for (key, hint) in unread_keys(&patch) {
                match hint {
                    Some(h) => eprintln!("warning: pgwarden reads no dynamic setting \"{key}\" (did you mean \"{h}\"?); it is stored all the same"),
                    None => eprintln!("warning: pgwarden reads no dynamic setting \"{key}\"; it is stored all the same"),
                }
            }
            let config = api.write("PATCH", "/config", Some(patch), TIMEOUT).await?;
            // The API answers with the whole new config; pretty-print it.
            match serde_json::from_str::<Value>(&config) {
                Ok(v) => println!("{}", serde_json::to_string_pretty(&v)?),
                Err(_) => println!("{config}"),
            }
        }
        Command::Restart {
            scheduled,
            role,
            pending,
            all,
        } => {
            let body = json!({ "schedule": scheduled, "role": role, "restart_pending": pending });
            if all {
                restart_all(&api, &body).await?;
            } else {
                println!(
                    "{}",
                    api.write("POST", "/restart", Some(body), RESTART_TIMEOUT)
                        .await?
                );
            }
        }
        Command::Reinit => println!(
            "{}",
            api.write("POST", "/reinitialize", None, TIMEOUT).await?
        ),
        Command::FlushRestart => {
            // The API answers once the loop has withdrawn it.
            println!(
                "{}",
                api.write("DELETE", "/restart", None, RESTART_TIMEOUT)
                    .await?
            )
        }
        Command::Reload => println!("{}", api.write("POST", "/reload", None, TIMEOUT).await?),
        Command::Fence { member } => fence(&api, &member, true).await?,
        Command::Unfence { member } => fence(&api, &member, false).await?,
    }
    Ok(())
}

/// `fence` and `unfence`: one entry of the dynamic configuration's
/// `fenced` object.
async fn fence(api: &Api, member: &str, on: bool) -> anyhow::Result<()> {
    // A member that is down has no record: fencing it keeps it from
    // leading when it comes back, so the name is taken, with a word in
    // case it is a typo.
    if on {
        let known = api.get("/cluster").await.ok().is_some_and(|c| {
            c["members"]
                .as_array()
                .is_some_and(|ms| ms.iter().any(|m| m["name"] == member))
        });
        if !known {
            eprintln!("warning: {member} is not a member of the cluster now; fenced all the same");
        }
    }
    let mut fenced = serde_json::Map::new();
    fenced.insert(
        member.to_string(),
        if on { json!(true) } else { Value::Null },
    );
    let patch = json!({ "fenced": fenced });
    api.write("PATCH", "/config", Some(patch), TIMEOUT).await?;
    println!("{member}: {}", if on { "fenced" } else { "unfenced" });
    Ok(())
}

/// `restart --all`: restarts every member in turn, replicas before the
/// leader, waiting for each to be back (its postmaster start time changed)
/// before the next, so the cluster never has more than one member down. A
/// member whose conditions do not hold is reported and skipped. Any other
/// failure (a member that cannot be asked, or does not come back) stops
/// the command there: going on could take a second member down, and a
/// setting that keeps one from starting would keep them all down.
async fn restart_all(api: &Api, body: &Value) -> anyhow::Result<()> {
    let cluster = api.get("/cluster").await?;
    let mut members = cluster["members"].as_array().cloned().unwrap_or_default();
    members.sort_by_key(|m| m["role"] == "leader" || m["role"] == "standby_leader");
    let names: Vec<&str> = members
        .iter()
        .map(|m| m["name"].as_str().unwrap_or("?"))
        .collect();
    for (i, m) in members.iter().enumerate() {
        let name = names[i];
        let stop = |why: String| {
            let rest = &names[i + 1..];
            if rest.is_empty() {
                anyhow::anyhow!("{name}: {why}")
            } else {
                anyhow::anyhow!("{name}: {why}; stopped, not restarted: {}", rest.join(", "))
            }
        };
        let Some(url) = m["api_url"].as_str().filter(|u| !u.is_empty()) else {
            return Err(stop("no API URL published".into()));
        };
        let member = Api {
            base: url.trim_end_matches('/').to_string(),
            auth: api.auth.clone(),
        };
        let started = |v: &Value| v["postmaster_start_time"].as_str().map(str::to_string);
        let before = member.get("/patroni").await.ok().and_then(|v| started(&v));
        match member
            .send(
                "POST",
                "/restart",
                Some(body.clone()),
                true,
                RESTART_TIMEOUT,
            )
            .await
        {
            // Scheduled: every member gets its order, as patronictl does.
            Ok(r) if r.status == 202 => println!("{name}: {}", r.body.trim()),
            Ok(r) if r.status == 200 => {
                let deadline = tokio::time::Instant::now() + MOVE_TIMEOUT;
                loop {
                    let now = member.get("/patroni").await.ok();
                    let back = now.as_ref().is_some_and(|v| {
                        v["state"] == "running" && started(v).is_some() && started(v) != before
                    });
                    if back {
                        println!("{name}: restarted");
                        break;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        let problem = now
                            .as_ref()
                            .and_then(|v| v["problem"].as_str())
                            .map(|p| format!(" ({p})"))
                            .unwrap_or_default();
                        return Err(stop(format!("not back within {MOVE_TIMEOUT:?}{problem}")));
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            }
            Ok(r) => return Err(stop(r.body.trim().to_string())),
            Err(e) if format!("{e:#}").contains("restart conditions are not satisfied") => {
                println!("{name}: skipped, {e:#}");
            }
            Err(e) => return Err(stop(format!("{e:#}"))),
        }
    }
    Ok(())
}

struct Api {
    base: String,
    auth: Option<(String, String)>,
}

impl Api {
    async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        auth: bool,
        timeout: Duration,
    ) -> anyhow::Result<Response> {
        let url = format!("{}{path}", self.base);
        let auth = if auth {
            self.auth.as_ref().map(|(u, p)| (u.as_str(), p.as_str()))
        } else {
            None
        };
        let resp = http_client::request(method, &url, body.as_ref(), auth, timeout)
            .await
            .with_context(|| format!("{method} {url}"))?;
        if !resp.is_success() {
            let mut msg = format!(
                "{method} {path} failed ({}): {}",
                resp.status,
                resp.body.trim()
            );
            if resp.status == 401 && self.auth.is_none() {
                msg.push_str(" (give --password or set PGWARDEN_API_PASSWORD)");
            }
            bail!(msg);
        }
        Ok(resp)
    }

    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        let resp = self.send("GET", path, None, false, TIMEOUT).await?;
        serde_json::from_str(&resp.body).with_context(|| format!("GET {path}: invalid JSON"))
    }

    /// A write; returns the answer's text.
    async fn write(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> anyhow::Result<String> {
        let resp = self.send(method, path, body, true, timeout).await?;
        Ok(resp.body.trim_end().to_string())
    }
}

/// The JSON merge patch for `KEY=VALUE` settings.
/// The dynamic configuration's keys that the agents act on: the cluster
/// settings, Patroni's synchronous-mode keys, `postgresql.parameters`,
/// permanent slots, standby clusters, maintenance mode and fencing.
const DYNAMIC_KEYS: &[&str] = &[
    "ttl",
    "loop_wait",
    "retry_timeout",
    "primary_start_timeout",
    "safety_margin",
    "maximum_lag_on_failover",
    "protection",
    "synchronous_mode",
    "synchronous_mode_strict",
    "synchronous_node_count",
    "sync_method",
    "sync_degrade_timeout",
    "failsafe_mode",
    "postgresql",
    "slots",
    "standby_cluster",
    "pause",
    "fenced",
];

/// The top-level keys of `patch` no agent reads, each with a known key
/// it may be a slip for (a file key under its dynamic name, a typo).
/// Patroni keeps unknown keys silently; they are kept here too (a
/// configuration carried over from Patroni may hold some), but named.
fn unread_keys(patch: &Value) -> Vec<(String, Option<&'static str>)> {
    let Some(map) = patch.as_object() else {
        return Vec::new();
    };
    map.keys()
        .filter(|k| !DYNAMIC_KEYS.contains(&k.as_str()))
        .map(|k| {
            let hint = DYNAMIC_KEYS
                .iter()
                .find(|known| known.starts_with(k.as_str()) || k.starts_with(**known))
                .copied();
            (k.clone(), hint)
        })
        .collect()
}

fn config_patch(settings: &[String]) -> anyhow::Result<Value> {
    let mut patch = Map::new();
    for s in settings {
        let Some((key, value)) = s.split_once('=') else {
            bail!("--set {s:?}: expected KEY=VALUE");
        };
        let path: Vec<&str> = key.trim().split('.').collect();
        if path.iter().any(|p| p.is_empty()) {
            bail!("--set {s:?}: empty key or path segment");
        }
        // `3`, `true`, `null`, `{"a":1}` are JSON; `4MB` and `on` are meant
        // as strings, and quoting them on a shell command line is a chore.
        let value =
            serde_json::from_str(value.trim()).unwrap_or_else(|_| Value::String(value.to_string()));
        let (last, parents) = path.split_last().expect("split yields one segment");
        let mut node = &mut patch;
        for p in parents {
            let entry = node
                .entry(p.to_string())
                .or_insert_with(|| Value::Object(Map::new()));
            if !entry.is_object() {
                bail!("--set {s:?}: {p} is set to a value and also used as a section");
            }
            node = entry.as_object_mut().expect("checked above");
        }
        node.insert(last.to_string(), value);
    }
    Ok(Value::Object(patch))
}

fn role_title(role: &str) -> String {
    match role {
        "leader" => "Leader".into(),
        "standby_leader" => "Standby Leader".into(),
        "sync_standby" => "Sync Standby".into(),
        "quorum_standby" => "Quorum Standby".into(),
        other => {
            let mut c = other.chars();
            c.next()
                .map(|f| f.to_uppercase().chain(c).collect())
                .unwrap_or_default()
        }
    }
}

/// A text table: `right` marks right-aligned columns.
fn table(header: &[&str], right: &[bool], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let rule: String = widths
        .iter()
        .map(|w| format!("+{}", "-".repeat(w + 2)))
        .collect::<String>()
        + "+\n";
    let line = |cells: Vec<&str>| -> String {
        let mut s = String::new();
        for ((cell, w), r) in cells.iter().zip(&widths).zip(right) {
            if *r {
                s += &format!("| {cell:>w$} ");
            } else {
                s += &format!("| {cell:<w$} ");
            }
        }
        s + "|\n"
    };
    let mut out = rule.clone();
    out += &line(header.to_vec());
    out += &rule;
    for row in rows {
        out += &line(row.iter().map(String::as_str).collect());
    }
    out + &rule
}

/// `pgwarden ctl topology`: the list with each member under the one it
/// streams from (`upstream`), as Patroni's does: `+ ` before a replica's
/// name, two spaces more per level. Members whose upstream is not listed
/// (the leader, a stopped member, a standby leader fed from elsewhere)
/// stand at the top, in the list's order.
pub(crate) fn render_topology(cluster: &Value) -> String {
    let members = cluster["members"].as_array().cloned().unwrap_or_default();
    let name = |m: &Value| m["name"].as_str().unwrap_or_default().to_string();
    let names: Vec<String> = members.iter().map(name).collect();
    let upstream = |m: &Value| {
        m["upstream"]
            .as_str()
            .filter(|u| *u != name(m) && names.iter().any(|n| n == u))
            .map(str::to_string)
    };
    let mut ordered = Vec::with_capacity(members.len());
    let mut placed = vec![false; members.len()];
    // Depth first from each top-level member; `placed` also stops a
    // cycle (two members naming each other, a moment after a change).
    fn place(
        members: &[Value],
        at: usize,
        depth: usize,
        placed: &mut [bool],
        ordered: &mut Vec<Value>,
        children: &dyn Fn(&str) -> Vec<usize>,
    ) {
        if placed[at] {
            return;
        }
        placed[at] = true;
        let mut m = members[at].clone();
        let own = m["name"].as_str().unwrap_or_default().to_string();
        if depth > 0 {
            m["display"] = format!("{}+ {own}", "  ".repeat(depth - 1)).into();
        }
        ordered.push(m);
        for c in children(&own) {
            place(members, c, depth + 1, placed, ordered, children);
        }
    }
    let children = |of: &str| -> Vec<usize> {
        members
            .iter()
            .enumerate()
            .filter(|(_, m)| upstream(m).as_deref() == Some(of))
            .map(|(i, _)| i)
            .collect()
    };
    for (i, m) in members.iter().enumerate() {
        if upstream(m).is_none() {
            place(&members, i, 0, &mut placed, &mut ordered, &children);
        }
    }
    // Whatever a cycle left out, at the top.
    for i in 0..members.len() {
        place(&members, i, 0, &mut placed, &mut ordered, &children);
    }
    let mut shown = cluster.clone();
    shown["members"] = Value::Array(ordered);
    render_list(&shown)
}

/// `pgwarden ctl list`, from the JSON of `GET /cluster`.
pub(crate) fn render_list(cluster: &Value) -> String {
    let str_of = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let members = cluster["members"].as_array().cloned().unwrap_or_default();
    let rows: Vec<Vec<String>> = members
        .iter()
        .map(|m| {
            let role = str_of(&m["role"]);
            let lag = match (&m["lag"], role.as_str()) {
                (_, "leader" | "standby_leader") => String::new(),
                (Value::Number(n), _) => {
                    let mb = n.as_f64().unwrap_or(0.0) / (1024.0 * 1024.0);
                    format!("{}", mb.round() as u64)
                }
                _ => "unknown".into(),
            };
            vec![
                // `topology` shows a member's place in the tree.
                m["display"]
                    .as_str()
                    .map_or_else(|| str_of(&m["name"]), str::to_string),
                str_of(&m["pg_address"]),
                role_title(&role),
                str_of(&m["state"]),
                m["timeline"]
                    .as_u64()
                    .map(|t| t.to_string())
                    .unwrap_or_default(),
                lag,
            ]
        })
        .collect();
    let leader = cluster["leader"].as_str().unwrap_or("none");
    let mut out = format!(
        "Cluster: {} (leader: {leader})\n",
        cluster["scope"].as_str().unwrap_or("?")
    );
    out += &table(
        &["Member", "Host", "Role", "State", "TL", "Lag in MB"],
        &[false, false, false, false, true, true],
        &rows,
    );
    if cluster["paused"].as_bool() == Some(true) {
        out += "Maintenance mode: on\n";
    }
    let fenced: Vec<&str> = members
        .iter()
        .filter(|m| m["fenced"] == true)
        .filter_map(|m| m["name"].as_str())
        .collect();
    if !fenced.is_empty() {
        out += &format!("Fenced: {}\n", fenced.join(", "));
    }
    if let Some(sync) = cluster.get("sync").filter(|s| s["synchronous"] == true) {
        let since = |k: &str| sync[k].as_u64().map(utc_timestamp);
        if let Some(t) = since("blocked_since_ms") {
            out += &format!(
                "Writes blocked: no synchronous standby acknowledges commits (since {t})
"
            );
        }
        match since("degraded_since_ms") {
            Some(t) => {
                out += &format!(
                    "Durability degraded: asynchronous replication since {t}
"
                )
            }
            None => {
                let members: Vec<String> = sync["members"]
                    .as_array()
                    .map(|m| {
                        m.iter()
                            .filter_map(|v| v.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default();
                let list = if members.is_empty() {
                    "none".to_string()
                } else {
                    members.join(", ")
                };
                // Under quorum commit each commit is on some of them.
                match sync["quorum"].as_u64().map(|q| q as usize) {
                    Some(q) if q > 0 && q < members.len() => {
                        out += &format!("Synchronous standbys: {list} (each commit on any {q})\n")
                    }
                    _ => out += &format!("Synchronous standbys: {list}\n"),
                }
            }
        }
    }
    if let Some(s) = cluster.get("scheduled_switchover").filter(|s| !s.is_null()) {
        out += &format!(
            "Switchover scheduled at {}: from {} to {}\n",
            str_of(&s["at"]),
            str_of(&s["from"]),
            str_of(&s["to"])
        );
    } else if let Some(f) = cluster.get("failover").filter(|f| !f.is_null()) {
        out += &format!("Pending failover request: {f}\n");
    }
    for m in &members {
        if let Some(p) = m["problem"].as_str() {
            out += &format!("Problem on {}: {p}\n", str_of(&m["name"]));
        }
        if m["pending_restart"] == true {
            out += &format!("Pending restart on {}\n", str_of(&m["name"]));
        }
        if let Some(at) = m["scheduled_restart"]["schedule"].as_str() {
            out += &format!("Restart of {} scheduled at {at}\n", str_of(&m["name"]));
        }
    }
    // With no leader, say why each member does not take over.
    if cluster["leader"].is_null() {
        for m in &members {
            if let Some(d) = m["decision"].as_str().filter(|d| !d.is_empty()) {
                out += &format!("{}: {d}\n", str_of(&m["name"]));
            }
        }
    }
    out
}

/// `pgwarden ctl history`, from the JSON of `GET /history`.
fn render_history(history: &Value) -> String {
    let rows: Vec<Vec<String>> = history
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|h| {
            vec![
                h["timeline"].to_string(),
                h["lsn"].to_string(),
                h["reason"].as_str().unwrap_or_default().to_string(),
                h["time_ms"].as_u64().map(utc_timestamp).unwrap_or_default(),
                h["leader"].as_str().unwrap_or_default().to_string(),
            ]
        })
        .collect();
    table(
        &["TL", "LSN", "Reason", "Timestamp", "New Leader"],
        &[true, true, false, false, false],
        &rows,
    )
}

/// Unix milliseconds as `YYYY-MM-DDTHH:MM:SSZ` (whole seconds: a listing
/// needs no more).
fn utc_timestamp(ms: u64) -> String {
    pgwarden_ha::format_timestamp(i64::try_from(ms / 1000 * 1000).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_no_agent_reads_are_named_with_a_likely_meaning() {
        let p = config_patch(&[
            "failsafe=true".into(),
            "ttl=20".into(),
            "postgresql.parameters.work_mem=4MB".into(),
            "check_timeline=true".into(),
        ])
        .unwrap();
        let mut unread = unread_keys(&p);
        unread.sort();
        assert_eq!(
            unread,
            vec![
                ("check_timeline".to_string(), None),
                ("failsafe".to_string(), Some("failsafe_mode")),
            ]
        );
    }

    #[test]
    fn settings_become_a_nested_merge_patch() {
        let p = config_patch(&[
            "ttl=20".into(),
            "postgresql.parameters.work_mem=4MB".into(),
            "postgresql.parameters.max_connections=200".into(),
            "pause=null".into(),
            "tags={\"a\":true}".into(),
        ])
        .unwrap();
        assert_eq!(
            p,
            json!({
                "ttl": 20,
                "postgresql": {"parameters": {"work_mem": "4MB", "max_connections": 200}},
                "pause": null,
                "tags": {"a": true},
            })
        );
        assert!(config_patch(&["ttl".into()]).is_err());
        assert!(config_patch(&["a..b=1".into()]).is_err());
        assert!(config_patch(&["a=1".into(), "a.b=2".into()]).is_err());
    }

    #[test]
    fn list_shows_members_maintenance_and_problems() {
        let cluster = json!({
            "scope": "c",
            "leader": "n1",
            "paused": true,
            "failover": null,
            "members": [
                {"name": "n1", "role": "leader", "state": "running", "pg_address": "10.0.0.1:5432",
                 "timeline": 3, "lag": null, "problem": null},
                {"name": "n2", "role": "sync_standby", "state": "running", "pg_address": "10.0.0.2:5432",
                 "timeline": 3, "lag": 3_500_000, "problem": null, "pending_restart": true,
                 "scheduled_restart": {"schedule": "2030-01-01T01:00:00Z", "restart_pending": true}},
                {"name": "n3", "role": "stopped", "state": "stopped", "pg_address": "10.0.0.3:5432",
                 "timeline": 2, "lag": null, "problem": "rewind failed", "fenced": true},
            ],
        });
        let out = render_list(&cluster);
        let want = "\
Cluster: c (leader: n1)
+--------+---------------+--------------+---------+----+-----------+
| Member | Host          | Role         | State   | TL | Lag in MB |
+--------+---------------+--------------+---------+----+-----------+
| n1     | 10.0.0.1:5432 | Leader       | running |  3 |           |
| n2     | 10.0.0.2:5432 | Sync Standby | running |  3 |         3 |
| n3     | 10.0.0.3:5432 | Stopped      | stopped |  2 |   unknown |
+--------+---------------+--------------+---------+----+-----------+
Maintenance mode: on
Fenced: n3
Pending restart on n2
Restart of n2 scheduled at 2030-01-01T01:00:00Z
Problem on n3: rewind failed
";
        assert_eq!(out, want, "\n{out}");
    }

    #[test]
    fn topology_puts_each_replica_under_its_upstream() {
        let member = |name: &str, role: &str, upstream: Option<&str>| {
            json!({"name": name, "role": role, "state": "streaming", "pg_address": format!("h:{}", &name[1..]),
                   "timeline": 1, "lag": 0, "upstream": upstream})
        };
        let cluster = json!({
            "scope": "c",
            "leader": "n1",
            "members": [
                // In name order, as /cluster lists them.
                member("n1", "leader", None),
                member("n2", "replica", Some("n1")),
                member("n3", "replica", Some("n4")),
                member("n4", "replica", Some("n2")),
                // Gone from the list: shown at the top.
                member("n5", "replica", Some("n9")),
                // Two that name each other are still shown, once each.
                member("n6", "replica", Some("n7")),
                member("n7", "replica", Some("n6")),
            ],
        });
        let out = render_topology(&cluster);
        let names: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| Member"))
            .map(|l| l.split('|').nth(1).unwrap().trim_end())
            .collect();
        assert_eq!(
            names,
            [
                " n1",
                " + n2",
                "   + n4",
                "     + n3",
                " n5",
                " n6",
                " + n7",
            ],
            "\n{out}"
        );
    }

    #[test]
    fn list_shows_a_scheduled_switchover_or_a_pending_request() {
        let mut cluster = json!({
            "scope": "c",
            "leader": "n1",
            "members": [],
            "failover": {"from_leader": "n1", "candidate": "n2", "scheduled_at": "2030-01-01T03:00:00Z"},
            "scheduled_switchover": {"at": "2030-01-01T03:00:00Z", "from": "n1", "to": "n2"},
        });
        let out = render_list(&cluster);
        assert!(
            out.ends_with("Switchover scheduled at 2030-01-01T03:00:00Z: from n1 to n2\n"),
            "{out}"
        );
        assert!(!out.contains("Pending"), "{out}");
        cluster["scheduled_switchover"] = Value::Null;
        cluster["failover"] = json!({"candidate": "n2"});
        let out = render_list(&cluster);
        assert!(
            out.ends_with("Pending failover request: {\"candidate\":\"n2\"}\n"),
            "{out}"
        );
    }

    #[test]
    fn history_timestamps_are_utc() {
        assert_eq!(utc_timestamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_timestamp(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc_timestamp(1_700_000_000_123), "2023-11-14T22:13:20Z");
        let out = render_history(&json!([
            {"timeline": 1, "lsn": 100, "reason": "switchover", "time_ms": 0, "leader": "n2"}
        ]));
        assert!(out.contains("| 1  |") || out.contains("|  1 |"), "{out}");
        assert!(
            out.contains("1970-01-01T00:00:00Z") && out.contains("n2"),
            "{out}"
        );
    }
}
