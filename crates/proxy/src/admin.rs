//! The admin console: database `pgwarden` on the read-write port, with
//! PgBouncer's command names and, where a counterpart exists, its column
//! names, so dashboards and habits carry over.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::stream::ClientStream;
use bytes::{BufMut, BytesMut};
use pgwarden_wire::encode::{self, Severity};
use pgwarden_wire::message::{self, backend, frontend, TxStatus};
use pgwarden_wire::sqlstate::{self, SqlState};
use pgwarden_wire::startup::StartupMessage;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::proxy::{Kill, Shared};
use crate::stats::{Averages, Totals};

/// The database name that reaches the console instead of a server.
pub const ADMIN_DATABASE: &str = "pgwarden";

/// Bytes a console client may have sent and not yet had read as commands
/// (while a command waits): one message of the largest size taken.
const MAX_PENDING: usize = 1 << 20;

/// The `SHOW CONFIG` keys a `RELOAD` does not change (the worker threads
/// are made once): `changeable` says `no` for them, and their value stays
/// the one in force, whatever the reloaded file says.
pub(crate) const RESTART_ONLY: [&str; 3] = [
    "engine.worker_threads",
    "engine.worker_fill",
    "engine.pool_affinity",
];

/// Whether `user` is one of `pool.admin_users`.
pub(crate) fn is_admin_user(shared: &Shared, user: Option<&str>) -> bool {
    user.is_some_and(|user| {
        shared
            .admin_users
            .lock()
            .expect("poisoned")
            .iter()
            .any(|u| u == user)
    })
}

/// Serves one admin session until the client leaves.
pub(crate) async fn run(
    shared: &Arc<Shared>,
    client: &mut ClientStream,
    startup: &StartupMessage,
    peer: std::net::SocketAddr,
    service: &Arc<str>,
) {
    let user = startup.user().unwrap_or_default();
    let mut out = BytesMut::new();
    if !is_admin_user(shared, Some(user)) {
        encode::error_response(
            &mut out,
            Severity::Fatal,
            sqlstate::INVALID_AUTHORIZATION_SPECIFICATION.code(),
            &format!(
                "role \"{user}\" is not allowed into the pgwarden admin console (pool.admin_users)"
            ),
            None,
            None,
        );
        let _ = client.write_all(&out).await;
        return;
    }
    // Listed in SHOW CLIENTS, as PgBouncer lists its console's clients.
    let _listed = ConsoleGuard::register(
        shared,
        Console {
            user: Arc::from(user),
            client: peer,
            connected_s: crate::proxy::unix_now_s(),
            service: service.clone(),
        },
    );
    encode::authentication_ok(&mut out);
    for (k, v) in [
        ("server_version", "15.0 (pgwarden admin console)"),
        ("server_encoding", "UTF8"),
        ("client_encoding", "UTF8"),
        ("DateStyle", "ISO, MDY"),
        ("integer_datetimes", "on"),
        ("standard_conforming_strings", "on"),
        (
            "application_name",
            startup.get("application_name").unwrap_or(""),
        ),
    ] {
        encode::parameter_status(&mut out, k, v);
    }
    encode::backend_key_data(&mut out, 0, 0);
    encode::ready_for_query(&mut out, TxStatus::Idle);
    if client.write_all(&out).await.is_err() {
        return;
    }
    let mut buf = BytesMut::with_capacity(1024);
    // After an error in an extended-protocol batch, messages up to its
    // Sync are skipped, as PostgreSQL does: one ErrorResponse per batch.
    let mut skipping = false;
    // The extended protocol (drivers such as JDBC use it for everything):
    // statement and portal names to command text.
    let mut statements: HashMap<String, String> = HashMap::new();
    let mut portals: HashMap<String, String> = HashMap::new();
    loop {
        let (tag, msg) = loop {
            match message::split_message(&mut buf, MAX_PENDING) {
                Ok(Some(m)) => break m,
                Ok(None) => {}
                Err(_) => return,
            }
            match client.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        };
        let mut out = BytesMut::new();
        match tag {
            frontend::TERMINATE => return,
            frontend::SYNC => {
                skipping = false;
                encode::ready_for_query(&mut out, TxStatus::Idle);
            }
            frontend::FLUSH => {}
            // A type PostgreSQL does not know ends the session, as there:
            // the stream cannot be trusted to be framed any more.
            _ if !matches!(
                tag,
                frontend::QUERY
                    | frontend::PARSE
                    | frontend::BIND
                    | frontend::DESCRIBE
                    | frontend::EXECUTE
                    | frontend::CLOSE
                    | frontend::FUNCTION_CALL
                    | frontend::COPY_DATA
                    | frontend::COPY_DONE
                    | frontend::COPY_FAIL
            ) =>
            {
                let out = encode::fatal(
                    sqlstate::PROTOCOL_VIOLATION.code(),
                    &format!("invalid frontend message type {tag}"),
                );
                let _ = client.write_all(&out).await;
                return;
            }
            // As PostgreSQL does: after an error in an extended batch
            // everything up to its Sync is skipped, a Query too; and copy
            // messages outside a COPY (what a client still sends after a
            // failed one) are ignored.
            _ if skipping => {}
            frontend::COPY_DATA | frontend::COPY_DONE | frontend::COPY_FAIL => {}
            frontend::QUERY => {
                let text = message::query_text(&msg[5..]).unwrap_or("");
                if text.trim().trim_matches(';').trim().is_empty() {
                    encode::empty_query_response(&mut out);
                } else {
                    let Ok(reloaded) = before_command(shared, text, client, &mut buf).await else {
                        return;
                    };
                    command(shared, text, reloaded, &mut out);
                    if !after_pause(shared, text, &out, client, &mut buf).await {
                        return;
                    }
                }
                encode::ready_for_query(&mut out, TxStatus::Idle);
            }
            frontend::FUNCTION_CALL => {
                // A cycle of its own, like a Query: the client waits for
                // ReadyForQuery after the error.
                encode::error_response(
                    &mut out,
                    Severity::Error,
                    sqlstate::FEATURE_NOT_SUPPORTED.code(),
                    "the admin console has no functions to call",
                    None,
                    None,
                );
                encode::ready_for_query(&mut out, TxStatus::Idle);
            }
            _ => {
                let mut reloaded = None;
                if tag == frontend::EXECUTE {
                    let portal = msg[5..].split(|b| *b == 0).next().unwrap_or_default();
                    if let Some(text) = portals.get(String::from_utf8_lossy(portal).as_ref()) {
                        let Ok(r) = before_command(shared, text, client, &mut buf).await else {
                            return;
                        };
                        reloaded = r;
                    }
                }
                let ok = extended(
                    shared,
                    tag,
                    &msg[5..],
                    reloaded,
                    &mut statements,
                    &mut portals,
                    &mut out,
                );
                skipping = !ok;
                if ok && tag == frontend::EXECUTE {
                    let portal = msg[5..].split(|b| *b == 0).next().unwrap_or_default();
                    let text = portals
                        .get(String::from_utf8_lossy(portal).as_ref())
                        .cloned()
                        .unwrap_or_default();
                    if !after_pause(shared, &text, &out, client, &mut buf).await {
                        return;
                    }
                }
            }
        }
        if client.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// One message of the extended protocol; false after an ErrorResponse
/// (the rest of the batch is then skipped up to its Sync).
fn extended(
    shared: &Arc<Shared>,
    tag: u8,
    body: &[u8],
    reloaded: Option<Result<(), String>>,
    statements: &mut HashMap<String, String>,
    portals: &mut HashMap<String, String>,
    out: &mut BytesMut,
) -> bool {
    let fail = |out: &mut BytesMut, code: SqlState, text: &str| {
        encode::error_response(out, Severity::Error, code.code(), text, None, None);
        false
    };
    match tag {
        frontend::PARSE => {
            let Ok(p) = message::parse_message(body) else {
                return fail(out, sqlstate::PROTOCOL_VIOLATION, "invalid Parse message");
            };
            if p.param_type_count > 0 {
                return fail(
                    out,
                    sqlstate::FEATURE_NOT_SUPPORTED,
                    "admin commands take no parameters",
                );
            }
            let (Ok(name), Ok(text)) = (std::str::from_utf8(p.name), std::str::from_utf8(p.query))
            else {
                return fail(out, sqlstate::CHARACTER_NOT_IN_REPERTOIRE, "invalid UTF-8");
            };
            if !name.is_empty() && statements.contains_key(name) {
                return fail(
                    out,
                    sqlstate::DUPLICATE_PREPARED_STATEMENT,
                    &format!("prepared statement \"{name}\" already exists"),
                );
            }
            statements.insert(name.to_string(), text.to_string());
            out.put_slice(&[b'1', 0, 0, 0, 4]);
        }
        frontend::BIND => {
            let Ok((portal, statement)) = message::bind_names(body) else {
                return fail(out, sqlstate::PROTOCOL_VIOLATION, "invalid Bind message");
            };
            let Some(text) = statements.get(statement) else {
                return fail(
                    out,
                    sqlstate::INVALID_SQL_STATEMENT_NAME,
                    &format!("prepared statement \"{statement}\" does not exist"),
                );
            };
            portals.insert(portal.to_string(), text.clone());
            out.put_slice(&[b'2', 0, 0, 0, 4]);
        }
        frontend::DESCRIBE => {
            let Ok((kind, name)) = message::describe_target(body) else {
                return fail(
                    out,
                    sqlstate::PROTOCOL_VIOLATION,
                    "invalid Describe message",
                );
            };
            let text = if kind == b'S' {
                statements.get(name)
            } else {
                portals.get(name)
            };
            let Some(text) = text else {
                let what = if kind == b'S' {
                    "prepared statement"
                } else {
                    "portal"
                };
                let code = if kind == b'S' {
                    sqlstate::INVALID_SQL_STATEMENT_NAME
                } else {
                    sqlstate::INVALID_CURSOR_NAME
                };
                return fail(out, code, &format!("{what} \"{name}\" does not exist"));
            };
            if kind == b'S' {
                // No parameters.
                out.put_slice(&[b't', 0, 0, 0, 6, 0, 0]);
            }
            // Only SHOW returns rows; running it to learn its columns
            // changes nothing.
            let mut result = BytesMut::new();
            if is_show(text) {
                command(shared, text, None, &mut result);
            }
            match result.first() {
                Some(b'T') => {
                    let len = u32::from_be_bytes([result[1], result[2], result[3], result[4]]);
                    // Rows go out in text format only, while a driver may
                    // ask for integers in binary: every column is text here.
                    let desc = &mut result[..1 + len as usize];
                    all_text(desc);
                    out.put_slice(desc);
                }
                Some(b'E') => {
                    out.put_slice(&result);
                    return false;
                }
                _ => out.put_slice(&[b'n', 0, 0, 0, 4]),
            }
        }
        frontend::EXECUTE => {
            let portal = body.split(|b| *b == 0).next().unwrap_or_default();
            let max_rows = body
                .get(portal.len() + 1..portal.len() + 5)
                .map_or(0, |b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]));
            let portal = String::from_utf8_lossy(portal);
            let Some(text) = portals.get(portal.as_ref()) else {
                return fail(
                    out,
                    sqlstate::INVALID_CURSOR_NAME,
                    &format!("portal \"{portal}\" does not exist"),
                );
            };
            if text.trim().trim_matches(';').trim().is_empty() {
                encode::empty_query_response(out);
                return true;
            }
            let mut result = BytesMut::new();
            command(shared, text, reloaded, &mut result);
            // Execute sends no RowDescription (Describe does).
            if result.first() == Some(&b'T') {
                let len = u32::from_be_bytes([result[1], result[2], result[3], result[4]]);
                let _ = result.split_to(1 + len as usize);
            }
            let failed = result.first() == Some(&b'E');
            // A result is made whole, not kept to be fetched in parts: a
            // row limit it fits in is PostgreSQL's answer too, one it
            // does not is refused rather than ignored.
            let rows = data_rows(&result);
            if max_rows > 0 && rows > max_rows as usize {
                encode::error_response(
                    out,
                    Severity::Error,
                    sqlstate::FEATURE_NOT_SUPPORTED.code(),
                    &format!(
                        "the admin console returns all rows at once: Execute asked for at most {max_rows} of {rows} rows"
                    ),
                    None,
                    Some("Execute with no row limit (JDBC: a fetch size of 0)."),
                );
                return false;
            }
            out.put_slice(&result);
            return !failed;
        }
        frontend::CLOSE => {
            let Ok((kind, name)) = message::close_target(body) else {
                return fail(out, sqlstate::PROTOCOL_VIOLATION, "invalid Close message");
            };
            if kind == b'S' {
                statements.remove(name);
            } else {
                portals.remove(name);
            }
            out.put_slice(&[b'3', 0, 0, 0, 4]);
        }
        _ => {
            return fail(
                out,
                sqlstate::PROTOCOL_VIOLATION,
                &format!("unexpected message type 0x{tag:02x}"),
            )
        }
    }
    true
}

/// The DataRows in the messages `result`.
fn data_rows(mut result: &[u8]) -> usize {
    let mut rows = 0;
    while result.len() >= 5 {
        let len = u32::from_be_bytes([result[1], result[2], result[3], result[4]]) as usize;
        rows += usize::from(result[0] == b'D');
        result = result.get(1 + len..).unwrap_or_default();
    }
    rows
}

/// Whether `text` holds more than one statement: a semicolon outside
/// quotes with more than blanks after it.
fn several_statements(text: &str) -> bool {
    let mut quote = None;
    for (i, c) in text.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, ';') if !text[i + 1..].trim().trim_matches(';').trim().is_empty() => {
                return true;
            }
            _ => {}
        }
    }
    false
}

fn is_show(text: &str) -> bool {
    text.split_whitespace()
        .next()
        .is_some_and(|w| w.eq_ignore_ascii_case("show"))
}

/// Session settings drivers send when they connect (JDBC sends
/// `SET extra_float_digits = 3`): accepted and ignored, since the console's
/// answers are all text; anything else is refused, so that nobody takes a
/// SET for a change of pgwarden's settings (which come from its file, with
/// RELOAD).
const DRIVER_SETTINGS: &[&str] = &[
    "application_name",
    "client_encoding",
    "datestyle",
    "extra_float_digits",
    "intervalstyle",
    "lock_timeout",
    "search_path",
    "statement_timeout",
    "timezone",
    "idle_in_transaction_session_timeout",
    "bytea_output",
];

/// `SET [SESSION|LOCAL] name {=|TO} value` and `RESET name|ALL`: the
/// setting's name, lower-cased, or `None` when `words` is neither.
fn setting_name(words: &[&str]) -> Option<String> {
    let rest = match words {
        ["SET", "SESSION" | "LOCAL", rest @ ..] | ["SET", rest @ ..] => rest,
        ["RESET", name] => return Some(name.to_ascii_lowercase()),
        _ => return None,
    };
    let first = rest.first()?;
    // `SET name=value` arrives as one word.
    let name = first.split('=').next().unwrap_or(first);
    Some(name.to_ascii_lowercase())
}

/// `reloaded`: how the reload a RELOAD asked for went (see
/// [`before_command`]).
fn command(
    shared: &Arc<Shared>,
    text: &str,
    reloaded: Option<Result<(), String>>,
    out: &mut BytesMut,
) {
    if several_statements(text) {
        encode::error_response(
            out,
            Severity::Error,
            sqlstate::FEATURE_NOT_SUPPORTED.code(),
            &format!("the admin console runs one command per query: {text}"),
            None,
            Some("Send the commands one by one."),
        );
        return;
    }
    let words: Vec<String> = text
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .map(str::to_ascii_uppercase)
        .collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    if let Some(name) = setting_name(&words) {
        if name == "all" || DRIVER_SETTINGS.contains(&name.as_str()) {
            encode::command_complete(out, words[0]);
        } else {
            encode::error_response(
                out,
                Severity::Error,
                sqlstate::FEATURE_NOT_SUPPORTED.code(),
                &format!("the admin console does not set \"{name}\""),
                None,
                Some("pgwarden's settings come from its configuration file: edit it and RELOAD."),
            );
        }
        return;
    }
    match words.as_slice() {
        ["SHOW", "POOLS"] => show_pools(shared, out),
        ["SHOW", "CLIENTS"] => show_clients(shared, out),
        ["SHOW", "SERVERS"] => show_servers(shared, out),
        ["SHOW", "STATS"] => show_stats(shared, out, StatsColumns::Both),
        ["SHOW", "STATS_TOTALS"] => show_stats(shared, out, StatsColumns::Totals),
        ["SHOW", "STATS_AVERAGES"] => show_stats(shared, out, StatsColumns::Averages),
        ["SHOW", "TOTALS"] => show_totals(shared, out),
        ["SHOW", "USERS"] => show_users(shared, out),
        ["SHOW", "VERSION"] => table(
            out,
            &["version"],
            &[vec![format!("pgwarden {}", env!("CARGO_PKG_VERSION"))]],
            "SHOW",
        ),
        ["SHOW", "DATABASES"] => show_databases(shared, out),
        ["SHOW", "LISTS"] => show_lists(shared, out),
        ["SHOW", "CONFIG"] => {
            let rows: Vec<Vec<String>> = shared
                .settings_view
                .lock()
                .expect("poisoned")
                .iter()
                .map(|(k, v, d)| {
                    let changeable = if RESTART_ONLY.contains(&k.as_str()) {
                        "no"
                    } else {
                        "yes"
                    };
                    vec![k.clone(), v.clone(), d.clone(), changeable.into()]
                })
                .collect();
            table(
                out,
                &["key", "value", "default", "changeable"],
                &rows,
                "SHOW",
            );
        }
        ["PAUSE"] | ["RESUME"] | ["PAUSE", _] | ["RESUME", _] => {
            let on = words[0] == "PAUSE";
            let names: Vec<String> = match words.get(1) {
                Some(_) => vec![argument(text).unwrap_or_default().to_string()],
                None => shared.services.lock().expect("poisoned").keys().cloned().collect(),
            };
            for n in &names {
                if !shared.set_paused(n, on) {
                    // PgBouncer pauses a database; pgwarden pauses services.
                    let services = {
                        let mut v: Vec<String> = shared.services.lock().expect("poisoned").keys().cloned().collect();
                        v.sort();
                        v.join(", ")
                    };
                    let hint = format!("PAUSE and RESUME take a service name (pgwarden pauses per service, not per database): {services}");
                    encode::error_response(out, Severity::Error, sqlstate::INVALID_PARAMETER_VALUE.code(), &format!("no service named \"{n}\""), None, Some(&hint));
                    return;
                }
            }
            encode::command_complete(out, words[0]);
        }
        ["RECONNECT"] | ["RECONNECT", _] => {
            let database = argument(text);
            let pools = shared.pools.lock().expect("poisoned");
            let mut found = false;
            for p in pools.values() {
                if database.is_none_or(|d| p.key.database == d) {
                    p.reconnect();
                    found = true;
                }
            }
            match database {
                Some(d) if !found => unknown_database(out, d),
                _ => encode::command_complete(out, "RECONNECT"),
            }
        }
        ["KILL", _] => {
            let database = argument(text).unwrap_or_default();
            let mut found = false;
            for e in shared.sessions.lock().expect("poisoned").values() {
                if &*e.database == database {
                    found = true;
                    if !e.is_killed() {
                        e.kill(Kill::Admin);
                    }
                }
            }
            for p in shared.pools.lock().expect("poisoned").values() {
                if p.key.database == database {
                    found = true;
                    p.reconnect();
                }
            }
            if !found {
                unknown_database(out, database);
                return;
            }
            tracing::info!(database, "admin console: KILL");
            encode::command_complete(out, "KILL");
        }
        ["RELOAD"] => match reloaded {
            Some(Ok(())) => encode::command_complete(out, "RELOAD"),
            Some(Err(why)) => encode::error_response(
                out,
                Severity::Error,
                sqlstate::CONFIG_FILE_ERROR.code(),
                &why,
                None,
                None,
            ),
            None => encode::error_response(
                out,
                Severity::Error,
                sqlstate::FEATURE_NOT_SUPPORTED.code(),
                "nothing to reload: this pgwarden runs without a configuration file, or is shutting down",
                None,
                None,
            ),
        },
        // The wait itself happened before (`wait_close`).
        ["WAIT_CLOSE"] | ["WAIT_CLOSE", _] => match argument(text) {
            Some(d) if !shared.pools.lock().expect("poisoned").values().any(|p| p.key.database == d) => {
                unknown_database(out, d)
            }
            _ => encode::command_complete(out, "WAIT_CLOSE"),
        },
        ["SHUTDOWN"] => {
            tracing::info!("admin console: SHUTDOWN requested");
            shared.shutdown.notify_one();
            encode::command_complete(out, "SHUTDOWN");
        }
        ["DISABLE", _] | ["ENABLE", _] => {
            let database = argument(text).unwrap_or_default();
            if database == ADMIN_DATABASE {
                encode::error_response(out, Severity::Error, sqlstate::INVALID_PARAMETER_VALUE.code(), "the admin console cannot be disabled", None, None);
                return;
            }
            let mut disabled = shared.disabled.lock().expect("poisoned");
            if words[0] == "DISABLE" {
                disabled.insert(database.to_string());
            } else {
                disabled.remove(database);
            }
            shared.any_disabled.store(!disabled.is_empty(), Ordering::Relaxed);
            tracing::info!(database, "admin console: {}", words[0]);
            encode::command_complete(out, words[0]);
        }
        ["SUSPEND"] => encode::error_response(
            out,
            Severity::Error,
            sqlstate::FEATURE_NOT_SUPPORTED.code(),
            "SUSPEND is not supported: it prepares PgBouncer's online restart, which pgwarden does not do",
            None,
            Some("PAUSE holds new transactions while in-flight ones finish."),
        ),
        _ => encode::error_response(
            out,
            Severity::Error,
            sqlstate::FEATURE_NOT_SUPPORTED.code(),
            &format!("unknown admin command: {text}"),
            Some("SHOW POOLS|CLIENTS|SERVERS|STATS|STATS_TOTALS|STATS_AVERAGES|TOTALS|USERS|CONFIG|DATABASES|LISTS|VERSION, PAUSE [service], RESUME [service], RECONNECT [database], WAIT_CLOSE [database], KILL database, DISABLE database, ENABLE database, RELOAD, SHUTDOWN"),
            None,
        ),
    }
}

/// One row per (database, user), as PgBouncer has, summed over the pools
/// that pgwarden keeps per server and per read-only or read-write use:
/// monitoring tools key their series by these two columns and refuse
/// duplicates. The longest wait is the longest of any of them; the mode
/// is `mixed` where services pool the pair differently.
fn show_pools(shared: &Shared, out: &mut BytesMut) {
    let o = Ordering::Relaxed;
    #[derive(Default)]
    struct Row {
        clients: usize,
        lent: usize,
        cl_waiting: usize,
        sv_idle: usize,
        sv_login: usize,
        sv_total: usize,
        max_us: u64,
        mode: Option<&'static str>,
    }
    let mut by_pair: std::collections::BTreeMap<(String, String), Row> = Default::default();
    // PgBouncer counts a connected client that is not waiting as active,
    // whether or not it holds a server now: dashboards add cl_active and
    // cl_waiting up to the clients connected.
    for e in shared.sessions.lock().expect("poisoned").values() {
        if e.pooled.is_some() {
            by_pair
                .entry((e.database.to_string(), e.user.to_string()))
                .or_default()
                .clients += 1;
        }
    }
    for p in shared.pools.lock().expect("poisoned").values() {
        let s = &p.stats;
        let r = by_pair
            .entry((p.key.database.clone(), p.key.user.clone()))
            .or_default();
        r.lent += s.active.load(o);
        r.cl_waiting += s.waiting.load(o) + s.capped.load(o);
        r.sv_idle += p.idle_count();
        r.sv_login += p.opening();
        r.sv_total += s.total.load(o);
        r.max_us = r.max_us.max(p.oldest_wait().as_micros() as u64);
        r.mode = match r.mode {
            None => Some(pool_mode(p)),
            Some(m) if m == pool_mode(p) => Some(m),
            Some(_) => Some("mixed"),
        };
    }
    let rows: Vec<Vec<String>> = by_pair
        .into_iter()
        .map(|((database, user), r)| {
            // Cancel requests are forwarded at once, not queued per
            // pool, and servers are not tested before reuse: those
            // columns are 0.
            vec![
                database,
                user,
                r.clients.saturating_sub(r.cl_waiting).to_string(),
                r.cl_waiting.to_string(),
                "0".into(),
                "0".into(),
                r.lent.to_string(),
                "0".into(),
                "0".into(),
                r.sv_idle.to_string(),
                "0".into(),
                "0".into(),
                r.sv_login.to_string(),
                (r.max_us / 1_000_000).to_string(),
                (r.max_us % 1_000_000).to_string(),
                r.mode.unwrap_or_default().into(),
                r.sv_total.to_string(),
            ]
        })
        .collect();
    table(
        out,
        &[
            "database",
            "user",
            "cl_active",
            "cl_waiting",
            "cl_active_cancel_req",
            "cl_waiting_cancel_req",
            "sv_active",
            "sv_active_cancel",
            "sv_being_canceled",
            "sv_idle",
            "sv_used",
            "sv_tested",
            "sv_login",
            "maxwait",
            "maxwait_us",
            "pool_mode",
            "sv_total",
        ],
        &rows,
        "SHOW",
    );
}

/// After a PAUSE that worked, the wait before it answers, as PgBouncer's
/// PAUSE waits: until no pooled client of the paused services is in a
/// transaction, so that the operator's next step (a restart of the
/// server, say) cuts none. A client that keeps its server between
/// transactions (pinned by session state) is not waited for while it is
/// between two: its next transaction waits for the resume. Relayed
/// sessions go on and are not waited for. False when the console's
/// own client left meanwhile (the pause stays). Bytes the client sends
/// while it waits are kept in `buf` for the next command.
async fn after_pause(
    shared: &Shared,
    text: &str,
    out: &[u8],
    client: &mut ClientStream,
    buf: &mut BytesMut,
) -> bool {
    let words: Vec<&str> = text
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .collect();
    let paused = match words.as_slice() {
        [w] | [w, _] if w.eq_ignore_ascii_case("PAUSE") => argument(text),
        _ => return true,
    };
    // The command's own answer: an ErrorResponse (no such service) ends
    // it without a wait.
    if out.first() != Some(&backend::COMMAND_COMPLETE) {
        return true;
    }
    let services = shared.pause_targets(paused);
    let mut closed = false;
    // Until the transactions are done, or a RESUME (from another console,
    // the HTTP port, a switchover) has made the wait pointless.
    while shared.in_transaction(&services) > 0
        && services.iter().any(|s| *shared.paused(s).borrow())
    {
        // Rare, operator-driven: polled rather than signalled, to keep the
        // release of a connection free of it.
        tokio::select! {
            () = crate::timer::sleep(std::time::Duration::from_millis(20)) => {}
            r = client.read_buf(buf), if buf.len() < MAX_PENDING => {
                if matches!(r, Ok(0) | Err(_)) {
                    closed = true;
                    break;
                }
            }
        }
    }
    !closed
}

/// The waiting a command does before it answers: WAIT_CLOSE's (see
/// [`wait_close`]), and RELOAD's, which asks whoever owns the configuration
/// file to reload it and returns how that went (`None`: nobody to ask).
/// Err when the console's client left while it waited.
async fn before_command(
    shared: &Shared,
    text: &str,
    client: &mut ClientStream,
    buf: &mut BytesMut,
) -> Result<Option<Result<(), String>>, ()> {
    // Only a command [`command`] accepts as written: `RELOAD; SHOW POOLS`
    // or `RELOAD now` is refused there, and must not reload first.
    if several_statements(text) {
        return Ok(None);
    }
    let words: Vec<&str> = text
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .collect();
    match words.as_slice() {
        [w] | [w, _] if w.eq_ignore_ascii_case("WAIT_CLOSE") => {
            // Only the console's own client ends the wait early: the
            // operator asked to wait.
            tokio::select! {
                () = wait_close(shared, text) => Ok(None),
                () = client_left(client, buf) => Err(()),
            }
        }
        [w] if w.eq_ignore_ascii_case("RELOAD") => {
            let (reply, answer) = tokio::sync::oneshot::channel();
            if shared.reload.send(reply).await.is_err() {
                return Ok(None);
            }
            Ok(answer.await.ok())
        }
        _ => Ok(None),
    }
}

/// Resolves once the client has closed its connection; bytes it sends
/// meanwhile are kept in `buf` (for the next command), read only while
/// there is room, so a client that keeps sending cannot grow it.
async fn client_left(client: &mut ClientStream, buf: &mut BytesMut) {
    loop {
        if buf.len() >= MAX_PENDING {
            std::future::pending::<()>().await;
        }
        if matches!(client.read_buf(buf).await, Ok(0) | Err(_)) {
            return;
        }
    }
}

/// The word after the command (a service or database name), as typed.
/// WAIT_CLOSE [database]: returns once no server connection of the
/// database's pools (all pools without one) that a RECONNECT or KILL
/// marked is still lent out; idle ones were closed by the command.
async fn wait_close(shared: &Shared, text: &str) {
    let mut words = text.split_whitespace();
    if !words
        .next()
        .is_some_and(|w| w.trim_end_matches(';').eq_ignore_ascii_case("WAIT_CLOSE"))
    {
        return;
    }
    let database = argument(text);
    loop {
        let pending = shared
            .pools
            .lock()
            .expect("poisoned")
            .values()
            .any(|p| database.is_none_or(|d| p.key.database == d) && p.stale_count() > 0);
        if !pending {
            return;
        }
        // Rare, operator-driven and short: polled rather than signalled,
        // to keep the release of a connection free of it.
        crate::timer::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Read from the words [`command`] reads: `PAUSE svc;`, `PAUSE svc ;` and
/// `PAUSE` followed by `;` on a line of its own all name what they look
/// like they name.
fn argument(text: &str) -> Option<&str> {
    text.trim().trim_end_matches(';').split_whitespace().nth(1)
}

fn unknown_database(out: &mut BytesMut, database: &str) {
    encode::error_response(
        out,
        Severity::Error,
        sqlstate::INVALID_CATALOG_NAME.code(),
        &format!("no client or pool of database \"{database}\""),
        None,
        None,
    );
}

/// PgBouncer's name for how the pool lends its servers.
fn pool_mode(p: &crate::pool::Pool) -> &'static str {
    if p.settings().hold_session {
        "session"
    } else {
        "transaction"
    }
}

/// One row per database and host that a pool serves, with PgBouncer's
/// columns (monitoring tools read it); the columns pgwarden has no
/// counterpart for are 0 or empty.
fn show_databases(shared: &Shared, out: &mut BytesMut) {
    let o = Ordering::Relaxed;
    let disabled = shared.disabled.lock().expect("poisoned").clone();
    // pgwarden keeps a read-only and a read-write pool where services use
    // a server both ways; monitoring tools key rows by database, server
    // and user, so those pools make one row, their sizes summed.
    #[derive(Default)]
    struct Row {
        size: usize,
        min_size: usize,
        reserve: usize,
        mode: Option<&'static str>,
        db_max: usize,
        current: usize,
    }
    let mut by_key: std::collections::BTreeMap<(String, String, u16, String), Row> =
        Default::default();
    for p in shared.pools.lock().expect("poisoned").values() {
        let settings = p.settings();
        let db_limit = p
            .limits()
            .iter()
            .find(|l| l.kind == crate::pool::LimitKind::Database);
        let r = by_key
            .entry((
                p.key.database.clone(),
                p.key.host.host.clone(),
                p.key.host.port,
                p.key.user.clone(),
            ))
            .or_default();
        r.size += settings.size;
        r.min_size += settings.min_size;
        r.reserve += settings.reserve_size;
        r.mode = match r.mode {
            None => Some(pool_mode(p)),
            Some(m) if m == pool_mode(p) => Some(m),
            Some(_) => Some("mixed"),
        };
        // PgBouncer's max_db_connections, and the connections counted
        // against it (all of the database's pools on that server).
        match db_limit {
            Some(l) => {
                r.db_max = l.max();
                r.current = l.open();
            }
            None => r.current += p.stats.total.load(o),
        }
    }
    let rows: Vec<Vec<String>> = by_key
        .into_iter()
        .map(|((database, host, port, user), r)| {
            let off = u8::from(disabled.contains(&database));
            vec![
                database.clone(),
                host,
                port.to_string(),
                database,
                user,
                r.size.to_string(),
                r.min_size.to_string(),
                r.reserve.to_string(),
                r.mode.unwrap_or_default().into(),
                r.db_max.to_string(),
                r.current.to_string(),
                "0".into(),
                off.to_string(),
            ]
        })
        .collect();
    table(
        out,
        &[
            "name",
            "host",
            "port",
            "database",
            "force_user",
            "pool_size",
            "min_pool_size",
            "reserve_pool",
            "pool_mode",
            "max_connections",
            "current_connections",
            "paused",
            "disabled",
        ],
        &rows,
        "SHOW",
    );
}

/// PgBouncer's internal lists, by the same names, where pgwarden has a
/// counterpart (the rest are 0).
fn show_lists(shared: &Shared, out: &mut BytesMut) {
    let o = Ordering::Relaxed;
    let (pools, databases, users, servers) = {
        let pools = shared.pools.lock().expect("poisoned");
        let databases: std::collections::BTreeSet<&str> =
            pools.values().map(|p| p.key.database.as_str()).collect();
        let users: std::collections::BTreeSet<&str> =
            pools.values().map(|p| p.key.user.as_str()).collect();
        let servers: usize = pools.values().map(|p| p.stats.total.load(o)).sum();
        (pools.len(), databases.len(), users.len(), servers)
    };
    let clients = shared.sessions.lock().expect("poisoned").len();
    let rows: Vec<Vec<String>> = [
        ("databases", databases),
        ("users", users),
        ("pools", pools),
        ("free_clients", 0),
        ("used_clients", clients),
        ("login_clients", 0),
        ("free_servers", 0),
        ("used_servers", servers),
        ("dns_names", 0),
        ("dns_zones", 0),
        ("dns_queries", 0),
        ("dns_pending", 0),
    ]
    .iter()
    .map(|(k, v)| vec![k.to_string(), v.to_string()])
    .collect();
    table(out, &["list", "items"], &rows, "SHOW");
}

/// An admin console session, as SHOW CLIENTS lists it.
pub(crate) struct Console {
    pub user: Arc<str>,
    pub client: std::net::SocketAddr,
    /// When it logged in, Unix seconds.
    pub connected_s: u64,
    /// The service whose port it came in on.
    pub service: Arc<str>,
}

/// Keeps a console session in [`Shared::consoles`] while it lives.
struct ConsoleGuard<'a>(&'a Shared, u64);

impl<'a> ConsoleGuard<'a> {
    fn register(shared: &'a Shared, console: Console) -> Self {
        let id = shared.next_session.fetch_add(1, Ordering::Relaxed);
        shared
            .consoles
            .lock()
            .expect("poisoned")
            .insert(id, console);
        Self(shared, id)
    }
}

impl Drop for ConsoleGuard<'_> {
    fn drop(&mut self) {
        self.0
            .consoles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.1);
    }
}

/// A client's address as SHOW CLIENTS shows it.
fn client_addr(client: std::net::SocketAddr) -> String {
    if client == crate::session::LOCAL_PEER {
        "unix".to_string()
    } else {
        client.ip().to_string()
    }
}

/// SHOW CLIENTS' and SHOW SERVERS' columns: PgBouncer's (1.18), in its
/// order, so that tools reading them by position work; pgwarden's own
/// (the service, the server a client uses) after them.
const CONNECTION_COLUMNS: [&str; 20] = [
    "type",
    "user",
    "database",
    "state",
    "addr",
    "port",
    "local_addr",
    "local_port",
    "connect_time",
    "request_time",
    "wait",
    "wait_us",
    "close_needed",
    "ptr",
    "link",
    "remote_pid",
    "tls",
    "application_name",
    "service",
    "server",
];

/// A time as PgBouncer's SHOW CLIENTS prints it (`2026-12-07 15:04:05
/// UTC`), from Unix seconds; empty for none.
fn show_time(unix_s: u64) -> String {
    if unix_s == 0 {
        return String::new();
    }
    // Days to a civil date (Howard Hinnant's algorithm).
    let days = (unix_s / 86_400) as i64;
    let secs = unix_s % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        secs / 3_600,
        secs / 60 % 60,
        secs % 60
    )
}

/// The local and the remote end of a session's socket (the client's, or
/// a relayed session's server socket), as SHOW CLIENTS and SHOW SERVERS
/// show them.
fn socket_ends(
    fd: std::os::fd::RawFd,
) -> (Option<std::net::SocketAddr>, Option<std::net::SocketAddr>) {
    // SAFETY: called with the sessions lock held, while the entry, and so
    // the socket (see SessionGuard), lives.
    #[allow(unsafe_code)]
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let sock = socket2::SockRef::from(&fd);
    (
        sock.local_addr().ok().and_then(|a| a.as_socket()),
        sock.peer_addr().ok().and_then(|a| a.as_socket()),
    )
}

/// An address as the `addr` and `port` columns show it; empty for none.
fn addr_cells(a: Option<std::net::SocketAddr>) -> (String, String) {
    a.map_or((String::new(), String::new()), |a| {
        (a.ip().to_string(), a.port().to_string())
    })
}

fn show_clients(shared: &Shared, out: &mut BytesMut) {
    let mut rows: Vec<Vec<String>> = shared
        .sessions
        .lock()
        .expect("poisoned")
        .iter()
        .map(|(id, e)| {
            // A pooled client is active while it holds a server.
            let (lent, since) = e.pooled.as_ref().map_or((None, None), |s| s.state());
            let waiting = since.is_some();
            let waited = since.map_or(std::time::Duration::ZERO, |t| t.elapsed());
            let server = match (&e.host, &lent) {
                (Some(h), _) => h.to_string(),
                (None, Some(b)) => b.server.to_string(),
                (None, None) => String::new(),
            };
            let state = if !server.is_empty() {
                "active"
            } else if waiting {
                "waiting"
            } else {
                "idle"
            };
            let (local_addr, local_port) = addr_cells(socket_ends(e.client_fd).0);
            let connected = show_time(e.connected_s);
            vec![
                "C".into(),
                e.user.to_string(),
                e.database.to_string(),
                state.into(),
                client_addr(e.client),
                e.client.port().to_string(),
                local_addr,
                local_port,
                connected.clone(),
                connected,
                waited.as_secs().to_string(),
                waited.subsec_micros().to_string(),
                "0".into(),
                format!("{id:x}"),
                match (&lent, &e.host) {
                    (Some(b), _) => server_ptr(b.server, b.pid),
                    (None, Some(_)) => relayed_server_ptr(*id),
                    (None, None) => String::new(),
                },
                lent.as_ref().map_or("0".into(), |b| b.pid.to_string()),
                if e.tls { "TLS".into() } else { String::new() },
                e.application_name
                    .as_deref()
                    .unwrap_or_default()
                    .to_string(),
                e.service.to_string(),
                server,
            ]
        })
        .collect();
    // Console sessions, this one among them, are active and use no
    // server.
    rows.extend(
        shared
            .consoles
            .lock()
            .expect("poisoned")
            .iter()
            .map(|(id, c)| {
                let connected = show_time(c.connected_s);
                vec![
                    "C".into(),
                    c.user.to_string(),
                    ADMIN_DATABASE.into(),
                    "active".into(),
                    client_addr(c.client),
                    c.client.port().to_string(),
                    String::new(),
                    String::new(),
                    connected.clone(),
                    connected,
                    "0".into(),
                    "0".into(),
                    "0".into(),
                    format!("c{id:x}"),
                    String::new(),
                    "0".into(),
                    String::new(),
                    String::new(),
                    c.service.to_string(),
                    String::new(),
                ]
            }),
    );
    table(out, &CONNECTION_COLUMNS, &rows, "SHOW");
}

/// A server connection's `ptr` in SHOW SERVERS, and the `link` of the
/// client that holds it in SHOW CLIENTS: the backend, which is unique.
fn server_ptr(server: std::net::SocketAddr, pid: i32) -> String {
    format!("{server}/{pid}")
}

/// The same for a relayed session's server connection, whose backend the
/// session table does not know: named after its client.
fn relayed_server_ptr(client_id: u64) -> String {
    format!("r{client_id:x}")
}

/// One SHOW SERVERS row; what is not known stays empty.
#[derive(Default)]
struct ServerRow<'a> {
    user: &'a str,
    database: &'a str,
    state: &'static str,
    peer: Option<std::net::SocketAddr>,
    local: Option<std::net::SocketAddr>,
    connected_s: u64,
    used_s: u64,
    ptr: String,
    link: String,
    pid: i32,
    tls: bool,
    application_name: &'a str,
    service: &'a str,
    server: String,
}

impl ServerRow<'_> {
    fn cells(self) -> Vec<String> {
        let ((addr, port), (local_addr, local_port)) =
            (addr_cells(self.peer), addr_cells(self.local));
        vec![
            "S".into(),
            self.user.into(),
            self.database.into(),
            self.state.into(),
            addr,
            port,
            local_addr,
            local_port,
            show_time(self.connected_s),
            show_time(self.used_s),
            "0".into(),
            "0".into(),
            "0".into(),
            self.ptr,
            self.link,
            self.pid.to_string(),
            if self.tls {
                "TLS".into()
            } else {
                String::new()
            },
            self.application_name.into(),
            self.service.into(),
            self.server,
        ]
    }
}

/// Every server connection: those lent to clients and relayed sessions'
/// own, found from the clients that hold them (`link` names the client),
/// then each pool's idle ones.
fn show_servers(shared: &Shared, out: &mut BytesMut) {
    let mut rows = Vec::new();
    for (id, e) in shared.sessions.lock().expect("poisoned").iter() {
        let base = ServerRow {
            user: &e.user,
            database: &e.database,
            state: "active",
            link: format!("{id:x}"),
            service: &e.service,
            ..ServerRow::default()
        };
        match (&e.host, &e.pooled, e.server_fd) {
            (Some(host), _, Some(fd)) => rows.push({
                let (local, peer) = socket_ends(fd);
                ServerRow {
                    peer,
                    local,
                    connected_s: e.connected_s,
                    used_s: e.connected_s,
                    ptr: relayed_server_ptr(*id),
                    application_name: e.application_name.as_deref().unwrap_or_default(),
                    server: host.to_string(),
                    ..base
                }
                .cells()
            }),
            (None, Some(slot), _) => {
                if let (Some(b), _) = slot.state() {
                    rows.push(
                        ServerRow {
                            peer: Some(b.server),
                            ptr: server_ptr(b.server, b.pid),
                            pid: b.pid,
                            server: b.server.to_string(),
                            ..base
                        }
                        .cells(),
                    );
                }
            }
            _ => {}
        }
    }
    for p in shared.pools.lock().expect("poisoned").values() {
        let service = p.service.get().map_or("", |s| &**s);
        for c in p.idle_servers() {
            rows.push(
                ServerRow {
                    user: &p.key.user,
                    database: &p.key.database,
                    state: "idle",
                    peer: Some(c.peer),
                    local: c.local,
                    connected_s: c.opened_s,
                    used_s: c.used_s,
                    ptr: server_ptr(c.peer, c.pid),
                    pid: c.pid,
                    tls: c.tls,
                    application_name: c.application_name.as_deref().unwrap_or_default(),
                    service,
                    server: p.key.host.to_string(),
                    ..ServerRow::default()
                }
                .cells(),
            );
        }
    }
    table(out, &CONNECTION_COLUMNS, &rows, "SHOW");
}

/// Which of a pool's figures a `SHOW STATS` variant lists.
#[derive(Clone, Copy, PartialEq)]
enum StatsColumns {
    /// `SHOW STATS`: totals, then averages, PgBouncer's `total_*` and
    /// `avg_*` names.
    Both,
    /// `SHOW STATS_TOTALS`: the totals under plain names.
    Totals,
    /// `SHOW STATS_AVERAGES`: the averages under the same plain names.
    Averages,
}

/// The counters' names in `SHOW STATS_TOTALS` and `SHOW STATS_AVERAGES`.
const STATS_NAMES: [&str; 7] = [
    "xact_count",
    "query_count",
    "bytes_received",
    "bytes_sent",
    "xact_time",
    "query_time",
    "wait_time",
];

fn totals_row(t: &Totals) -> [u64; 7] {
    [
        t.xact_count,
        t.query_count,
        t.received,
        t.sent,
        t.xact_us,
        t.query_us,
        t.wait_us,
    ]
}

fn averages_row(a: &Averages) -> [u64; 7] {
    [
        a.xact_count,
        a.query_count,
        a.received,
        a.sent,
        a.xact_time,
        a.query_time,
        a.wait_time,
    ]
}

/// One row per database, as PgBouncer has (monitoring tools key their
/// series by it): the totals now and the averages over the last complete
/// stats period of all its pools, under PgBouncer's column names.
fn show_stats(shared: &Shared, out: &mut BytesMut, columns: StatsColumns) {
    let span = *shared.stats_span.lock().expect("poisoned");
    let mut by_database: std::collections::BTreeMap<String, [Totals; 3]> = Default::default();
    // The pools' lock first, and the totals of the pools gone under it, as
    // a pool leaving the table moves its totals under it: otherwise a pool
    // removed between the two reads would count in neither, and the totals
    // would go down for one look.
    let pools = shared.pools.lock().expect("poisoned");
    for (database, gone) in shared
        .gone_totals
        .lock()
        .expect("poisoned")
        .by_database
        .iter()
    {
        by_database.entry(database.clone()).or_default()[0].add(gone);
    }
    for p in pools.values() {
        let [now, older, newer] = by_database.entry(p.key.database.clone()).or_default();
        let [o, n] = p.stats.last_period();
        now.add(&p.stats.totals());
        older.add(&o);
        newer.add(&n);
    }
    drop(pools);
    let rows: Vec<Vec<String>> = by_database
        .into_iter()
        .map(|(database, [now, older, newer])| {
            let averages = newer.averages_since(&older, span);
            let figures: Vec<u64> = match columns {
                StatsColumns::Both => totals_row(&now)
                    .into_iter()
                    .chain(averages_row(&averages))
                    .collect(),
                StatsColumns::Totals => totals_row(&now).to_vec(),
                StatsColumns::Averages => averages_row(&averages).to_vec(),
            };
            std::iter::once(database)
                .chain(figures.iter().map(u64::to_string))
                .collect()
        })
        .collect();
    let names: Vec<&str> = match columns {
        StatsColumns::Both => vec![
            "total_xact_count",
            "total_query_count",
            "total_received",
            "total_sent",
            "total_xact_time",
            "total_query_time",
            "total_wait_time",
            "avg_xact_count",
            "avg_query_count",
            "avg_recv",
            "avg_sent",
            "avg_xact_time",
            "avg_query_time",
            "avg_wait_time",
        ],
        StatsColumns::Totals | StatsColumns::Averages => STATS_NAMES.to_vec(),
    };
    let header: Vec<&str> = std::iter::once("database").chain(names).collect();
    table(out, &header, &rows, "SHOW");
}

/// `SHOW TOTALS`: every pool's figures summed, as name/value rows.
fn show_totals(shared: &Shared, out: &mut BytesMut) {
    let span = *shared.stats_span.lock().expect("poisoned");
    let (mut now, mut older, mut newer) = (Totals::default(), Totals::default(), Totals::default());
    // Both under the pools' lock, as in `show_stats`.
    let pools = shared.pools.lock().expect("poisoned");
    let gone = shared.gone_totals.lock().expect("poisoned");
    for t in gone.by_database.values().chain([&gone.unlisted]) {
        now.add(t);
    }
    drop(gone);
    for p in pools.values() {
        now.add(&p.stats.totals());
        let [o, n] = p.stats.last_period();
        older.add(&o);
        newer.add(&n);
    }
    drop(pools);
    // PgBouncer's names here, which differ from SHOW STATS's for bytes.
    let names = [
        "xact_count",
        "query_count",
        "client_bytes",
        "server_bytes",
        "xact_time",
        "query_time",
        "wait_time",
    ];
    let rows: Vec<Vec<String>> = names
        .iter()
        .zip(totals_row(&now))
        .map(|(n, v)| vec![format!("total_{n}"), v.to_string()])
        .chain(
            names
                .iter()
                .zip(averages_row(&newer.averages_since(&older, span)))
                .map(|(n, v)| vec![format!("avg_{n}"), v.to_string()]),
        )
        .collect();
    table(out, &["name", "value"], &rows, "SHOW");
}

/// `SHOW USERS`: the users with a pool or a `[pool.users]` exception, and
/// the pool mode an exception sets (empty: the service's).
fn show_users(shared: &Shared, out: &mut BytesMut) {
    let mut users: std::collections::BTreeMap<String, String> = shared
        .pools
        .lock()
        .expect("poisoned")
        .keys()
        .map(|k| (k.user.clone(), String::new()))
        .collect();
    for (user, (transaction, _)) in &shared.pool_overrides.lock().expect("poisoned").users {
        let mode = match transaction {
            Some(true) => "transaction",
            Some(false) => "session",
            None => "",
        };
        users.insert(user.clone(), mode.to_string());
    }
    let rows: Vec<Vec<String>> = users.into_iter().map(|(u, m)| vec![u, m]).collect();
    table(out, &["name", "pool_mode"], &rows, "SHOW");
}

/// RowDescription (all text), DataRows, CommandComplete.
fn table(out: &mut BytesMut, columns: &[&str], rows: &[Vec<String>], tag: &str) {
    let mut desc = BytesMut::new();
    desc.put_u16(columns.len() as u16);
    for (i, c) in columns.iter().enumerate() {
        desc.put_slice(c.as_bytes());
        desc.put_u8(0);
        desc.put_u32(0); // table oid
        desc.put_u16(0); // column number
                         // Counts and times as integers, as PgBouncer sends them, so that
                         // drivers hand scripts numbers (`row["cl_waiting"] > 0`); always
                         // in text format.
        let numeric = !TEXT_COLUMNS.contains(c)
            && !rows.is_empty()
            && rows
                .iter()
                .all(|r| r.get(i).is_some_and(|v| v.parse::<i64>().is_ok()));
        if numeric {
            desc.put_u32(20); // int8
            desc.put_i16(8);
        } else {
            desc.put_u32(25); // text
            desc.put_i16(-1);
        }
        desc.put_i32(-1);
        desc.put_u16(0); // text format
    }
    out.put_u8(b'T');
    out.put_u32((4 + desc.len()) as u32);
    out.put_slice(&desc);
    for r in rows {
        let mut row = BytesMut::new();
        row.put_u16(r.len() as u16);
        for v in r {
            row.put_i32(v.len() as i32);
            row.put_slice(v.as_bytes());
        }
        out.put_u8(b'D');
        out.put_u32((4 + row.len()) as u32);
        out.put_slice(&row);
    }
    encode::command_complete(out, tag);
}

/// Marks every column of a RowDescription (`T` message) as text: the
/// type the extended protocol's results are described as here, since the
/// console writes every value in text format whatever a Bind asks for.
fn all_text(desc: &mut [u8]) {
    let Some(count) = desc.get(5..7).map(|b| u16::from_be_bytes([b[0], b[1]])) else {
        return;
    };
    let mut at = 7;
    for _ in 0..count {
        let Some(nul) = desc.get(at..).and_then(|d| d.iter().position(|b| *b == 0)) else {
            return;
        };
        at += nul + 1 + 4 + 2;
        let Some(field) = desc.get_mut(at..at + 6) else {
            return;
        };
        field[..4].copy_from_slice(&25u32.to_be_bytes());
        field[4..6].copy_from_slice(&(-1i16).to_be_bytes());
        at += 4 + 2 + 4 + 2;
    }
}

/// Columns that are text whatever their values look like: names,
/// addresses and settings (`SHOW CONFIG`'s `value` of `20` is a setting's
/// text, as in PgBouncer).
const TEXT_COLUMNS: &[&str] = &[
    "database",
    "user",
    "name",
    "host",
    "addr",
    "local_addr",
    "key",
    "value",
    "default",
    "changeable",
    "list",
    "type",
    "state",
    "application_name",
    "force_user",
    "ptr",
    "link",
    "version",
    "pool_mode",
    "tls",
    "connect_time",
    "request_time",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_is_read_as_the_command_is() {
        assert_eq!(argument("PAUSE"), None);
        assert_eq!(argument("PAUSE;"), None);
        assert_eq!(argument("PAUSE\n;"), None);
        assert_eq!(argument("  PAUSE ;  "), None);
        assert_eq!(argument("PAUSE svc;"), Some("svc"));
        assert_eq!(argument("PAUSE svc ;"), Some("svc"));
        assert_eq!(argument("WAIT_CLOSE db\n;\n"), Some("db"));
    }

    #[test]
    fn counts_go_out_as_integers_names_and_settings_as_text() {
        let mut out = BytesMut::new();
        table(
            &mut out,
            &["database", "cl_waiting", "value", "note"],
            &[
                vec!["123".into(), "4".into(), "20".into(), "x".into()],
                vec!["db".into(), "0".into(), "on".into(), "7".into()],
            ],
            "SHOW",
        );
        // RowDescription: per column, name NUL, table oid, column, type oid.
        let body = &out[7..];
        let mut types = Vec::new();
        let mut at = 0;
        for _ in 0..4 {
            let nul = body[at..].iter().position(|b| *b == 0).unwrap();
            at += nul + 1 + 4 + 2;
            types.push(u32::from_be_bytes(body[at..at + 4].try_into().unwrap()));
            at += 4 + 2 + 4 + 2;
        }
        assert_eq!(types, [25, 20, 25, 25]);
        // What the extended protocol describes: text throughout.
        let len = u32::from_be_bytes([out[1], out[2], out[3], out[4]]) as usize;
        all_text(&mut out[..1 + len]);
        let body = &out[7..];
        let mut at = 0;
        for _ in 0..4 {
            let nul = body[at..].iter().position(|b| *b == 0).unwrap();
            at += nul + 1 + 4 + 2;
            assert_eq!(u32::from_be_bytes(body[at..at + 4].try_into().unwrap()), 25);
            assert_eq!(
                i16::from_be_bytes(body[at + 4..at + 6].try_into().unwrap()),
                -1
            );
            at += 4 + 2 + 4 + 2;
        }
    }

    fn name(sql: &str) -> Option<String> {
        let words: Vec<String> = sql
            .split_whitespace()
            .map(str::to_ascii_uppercase)
            .collect();
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        setting_name(&words)
    }

    #[test]
    fn set_and_reset_name_their_setting() {
        assert_eq!(
            name("SET extra_float_digits = 3").as_deref(),
            Some("extra_float_digits")
        );
        assert_eq!(
            name("set session TimeZone TO 'UTC'").as_deref(),
            Some("timezone")
        );
        assert_eq!(
            name("SET LOCAL search_path=public").as_deref(),
            Some("search_path")
        );
        assert_eq!(
            name("SET application_name='a b'").as_deref(),
            Some("application_name")
        );
        assert_eq!(name("RESET ALL").as_deref(), Some("all"));
        assert_eq!(name("reset DateStyle").as_deref(), Some("datestyle"));
        assert_eq!(name("SHOW POOLS"), None);
        assert_eq!(name("SET"), None);
        assert_eq!(name("RESET"), None);
    }
}
