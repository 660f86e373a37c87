//! The admin console: database `pgwarden` on the read-write port, with
//! PgBouncer's command names and, where a counterpart exists, its column
//! names, so dashboards and habits carry over.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::stream::ClientStream;
use bytes::{BufMut, BytesMut};
use pgwarden_wire::encode::{self, Severity};
use pgwarden_wire::message::{self, frontend, TxStatus};
use pgwarden_wire::sqlstate;
use pgwarden_wire::startup::StartupMessage;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::proxy::Shared;

/// The database name that reaches the console instead of a server.
pub const ADMIN_DATABASE: &str = "pgwarden";

/// Serves one admin session until the client leaves.
pub(crate) async fn run(shared: &Arc<Shared>, client: &mut ClientStream, startup: &StartupMessage) {
    let user = startup.user().unwrap_or_default();
    let mut out = BytesMut::new();
    if !shared
        .admin_users
        .lock()
        .expect("poisoned")
        .iter()
        .any(|u| u == user)
    {
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
    loop {
        let (tag, msg) = loop {
            match message::split_message(&mut buf, 1 << 20) {
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
            frontend::QUERY => {
                let text = message::query_text(&msg[5..]).unwrap_or("");
                if text.trim().trim_matches(';').trim().is_empty() {
                    encode::empty_query_response(&mut out);
                } else {
                    command(shared, text, &mut out);
                }
                encode::ready_for_query(&mut out, TxStatus::Idle);
            }
            frontend::SYNC => {
                skipping = false;
                encode::ready_for_query(&mut out, TxStatus::Idle);
            }
            frontend::FLUSH => {}
            _ if skipping => {}
            _ => {
                skipping = true;
                encode::error_response(
                    &mut out,
                    Severity::Error,
                    sqlstate::FEATURE_NOT_SUPPORTED.code(),
                    "the admin console speaks the simple query protocol only",
                    None,
                    None,
                );
            }
        }
        if client.write_all(&out).await.is_err() {
            return;
        }
    }
}

fn command(shared: &Arc<Shared>, text: &str, out: &mut BytesMut) {
    let words: Vec<String> = text
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .map(str::to_ascii_uppercase)
        .collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    match words.as_slice() {
        ["SHOW", "POOLS"] => show_pools(shared, out),
        ["SHOW", "CLIENTS"] => show_clients(shared, out),
        ["SHOW", "SERVERS"] => show_servers(shared, out),
        ["SHOW", "STATS"] => show_stats(shared, out),
        ["SHOW", "CONFIG"] => {
            let rows: Vec<Vec<String>> = shared
                .settings_view
                .lock()
                .expect("poisoned")
                .iter()
                .map(|(k, v)| vec![k.clone(), v.clone(), "yes".into()])
                .collect();
            table(out, &["key", "value", "changeable"], &rows, "SHOW");
        }
        ["PAUSE"] | ["RESUME"] | ["PAUSE", _] | ["RESUME", _] => {
            let on = words[0] == "PAUSE";
            let names: Vec<String> = match words.get(1) {
                Some(_) => vec![text.split_whitespace().nth(1).unwrap_or("").trim_end_matches(';').to_string()],
                None => shared.services.lock().expect("poisoned").keys().cloned().collect(),
            };
            for n in &names {
                if !shared.set_paused(n, on) {
                    encode::error_response(out, Severity::Error, sqlstate::INVALID_PARAMETER_VALUE.code(), &format!("no service named \"{n}\""), None, None);
                    return;
                }
            }
            encode::command_complete(out, words[0]);
        }
        ["RELOAD"] => {
            shared.reload.notify_one();
            encode::command_complete(out, "RELOAD");
        }
        _ => encode::error_response(
            out,
            Severity::Error,
            sqlstate::FEATURE_NOT_SUPPORTED.code(),
            &format!("unknown admin command: {text}"),
            Some("SHOW POOLS|CLIENTS|SERVERS|STATS|CONFIG, PAUSE [service], RESUME [service], RELOAD"),
            None,
        ),
    }
}

fn show_pools(shared: &Shared, out: &mut BytesMut) {
    let o = Ordering::Relaxed;
    let rows: Vec<Vec<String>> = shared
        .pools
        .lock()
        .expect("poisoned")
        .values()
        .map(|p| {
            let s = &p.stats;
            let max_us = s.max_wait_us.load(o);
            vec![
                p.key.database.clone(),
                p.key.user.clone(),
                p.key.host.to_string(),
                s.active.load(o).to_string(),
                s.waiting.load(o).to_string(),
                s.active.load(o).to_string(),
                p.idle_count().to_string(),
                s.total.load(o).to_string(),
                (max_us / 1_000_000).to_string(),
                (max_us % 1_000_000).to_string(),
                "transaction".into(),
            ]
        })
        .collect();
    table(
        out,
        &[
            "database",
            "user",
            "host",
            "cl_active",
            "cl_waiting",
            "sv_active",
            "sv_idle",
            "sv_total",
            "maxwait",
            "maxwait_us",
            "pool_mode",
        ],
        &rows,
        "SHOW",
    );
}

fn show_clients(shared: &Shared, out: &mut BytesMut) {
    let rows: Vec<Vec<String>> = shared
        .sessions
        .lock()
        .expect("poisoned")
        .values()
        .map(|e| {
            vec![
                "C".into(),
                e.user.to_string(),
                e.database.to_string(),
                if e.host.is_some() {
                    "active".into()
                } else {
                    "idle".into()
                },
                e.client.ip().to_string(),
                e.client.port().to_string(),
                e.service.to_string(),
                e.host.as_ref().map(|h| h.to_string()).unwrap_or_default(),
            ]
        })
        .collect();
    table(
        out,
        &[
            "type", "user", "database", "state", "addr", "port", "service", "server",
        ],
        &rows,
        "SHOW",
    );
}

fn show_servers(shared: &Shared, out: &mut BytesMut) {
    let o = Ordering::Relaxed;
    let mut rows = Vec::new();
    for p in shared.pools.lock().expect("poisoned").values() {
        for (state, n) in [("active", p.stats.active.load(o)), ("idle", p.idle_count())] {
            for _ in 0..n {
                rows.push(vec![
                    "S".into(),
                    p.key.user.clone(),
                    p.key.database.clone(),
                    state.into(),
                    p.key.host.host.clone(),
                    p.key.host.port.to_string(),
                ]);
            }
        }
    }
    table(
        out,
        &["type", "user", "database", "state", "addr", "port"],
        &rows,
        "SHOW",
    );
}

fn show_stats(shared: &Shared, out: &mut BytesMut) {
    let o = Ordering::Relaxed;
    let rows: Vec<Vec<String>> = shared
        .pools
        .lock()
        .expect("poisoned")
        .values()
        .map(|p| {
            vec![
                p.key.database.clone(),
                p.key.user.clone(),
                p.key.host.to_string(),
                p.stats.transactions.load(o).to_string(),
                p.stats.wait_us.load(o).to_string(),
            ]
        })
        .collect();
    table(
        out,
        &[
            "database",
            "user",
            "host",
            "total_xact_count",
            "total_wait_time",
        ],
        &rows,
        "SHOW",
    );
}

/// RowDescription (all text), DataRows, CommandComplete.
fn table(out: &mut BytesMut, columns: &[&str], rows: &[Vec<String>], tag: &str) {
    let mut desc = BytesMut::new();
    desc.put_u16(columns.len() as u16);
    for c in columns {
        desc.put_slice(c.as_bytes());
        desc.put_u8(0);
        desc.put_u32(0); // table oid
        desc.put_u16(0); // column number
        desc.put_u32(25); // text
        desc.put_i16(-1);
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
