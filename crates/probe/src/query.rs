//! The probe query and the parsing of its one row.

use std::net::IpAddr;
use std::time::Duration;

use pgwarden_topology::{parse_lsn, HostAddr, InstanceId, Observation, ReplicationRow};

/// The statement whose round trip is the host's RTT sample: as close to
/// nothing as SQL gets, so the sample measures the path, not the server.
pub const RTT_QUERY: &str = "SELECT 1";

/// One round trip tells everything the topology engine needs: role, WAL
/// positions, replay delay, timeline, the synchronous configuration and,
/// on a primary, its replication connections. Functions that fail during
/// recovery sit behind `CASE` so the same text works on every role. Only
/// functions readable by `pg_monitor` members are used. The last columns
/// identify the server itself (system identifier, postmaster start time,
/// port), so that one server listed under
/// two names is recognised; any role may read them.
pub const PROBE_QUERY: &str = "SELECT pg_is_in_recovery(), \
 CASE WHEN NOT pg_is_in_recovery() THEN pg_current_wal_lsn() END, \
 pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn(), \
 CASE WHEN pg_is_in_recovery() THEN \
   CASE WHEN pg_last_wal_receive_lsn() IS NOT DISTINCT FROM pg_last_wal_replay_lsn() THEN 0 \
   WHEN pg_last_xact_replay_timestamp() IS NULL THEN NULL \
   ELSE greatest(0, floor(extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp()) * 1000)::bigint) END END, \
 current_setting('recovery_min_apply_delay'), \
 CASE WHEN NOT pg_is_in_recovery() \
   THEN ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int \
   ELSE (SELECT received_tli FROM pg_stat_wal_receiver) END, \
 current_setting('synchronous_standby_names'), \
 current_setting('cluster_name'), \
 (SELECT conninfo FROM pg_stat_wal_receiver), \
 CASE WHEN NOT pg_is_in_recovery() THEN (SELECT string_agg(concat_ws(E'\\t', \
   coalesce(r.application_name, ''), coalesce(r.state, ''), coalesce(r.sync_state, ''), \
   coalesce(r.replay_lsn::text, ''), coalesce(s.slot_name::text, '')), E'\\n') \
   FROM pg_stat_replication r LEFT JOIN pg_replication_slots s ON s.active_pid = r.pid) END, \
 (SELECT slot_name FROM pg_stat_wal_receiver), \
 (SELECT sender_host FROM pg_stat_wal_receiver), \
 (SELECT sender_port FROM pg_stat_wal_receiver), \
 (SELECT system_identifier FROM pg_control_system()), \
 floor(extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint, \
 current_setting('port'), \
 inet_server_addr()";

/// Number of columns of [`PROBE_QUERY`].
const COLUMNS: usize = 18;

/// Builds an [`Observation`] from the text columns of the probe query's
/// row (`None` = SQL NULL). Unparseable values become "unknown" rather than
/// errors: a monitoring probe must not fail a host over a surprise format.
pub fn parse_observation_row(cols: &[Option<&str>], rtt: Duration) -> Result<Observation, String> {
    if cols.len() < COLUMNS {
        return Err(format!(
            "probe query returned {} columns, expected {COLUMNS}",
            cols.len()
        ));
    }
    let in_recovery = match cols[0] {
        Some("t") => true,
        Some("f") => false,
        other => return Err(format!("pg_is_in_recovery() returned {other:?}")),
    };
    let lsn = |i: usize| cols[i].and_then(parse_lsn);
    let replay_delay = cols[4]
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_millis);
    let min_apply_delay = cols[5].and_then(parse_pg_duration).unwrap_or_default();
    let timeline = cols[6].and_then(|s| s.parse::<u32>().ok());
    let wal_receiver_name = if in_recovery {
        Some(walreceiver_name(cols[9], cols[8]))
    } else {
        None
    };
    let replication = cols[10]
        .map(|text| text.lines().filter_map(parse_replication_line).collect())
        .unwrap_or_default();
    Ok(Observation {
        in_recovery,
        rtt,
        timeline,
        current_lsn: lsn(1),
        receive_lsn: lsn(2),
        replay_lsn: lsn(3),
        replay_delay,
        min_apply_delay,
        wal_receiver_name,
        wal_receiver_slot: cols[11].filter(|s| !s.is_empty()).map(str::to_string),
        upstream: cols[12]
            .filter(|h| !h.is_empty())
            .zip(cols[13].and_then(|p| p.parse::<u16>().ok()))
            .map(|(h, p)| HostAddr::new(h, p)),
        // Resolved by the prober, which may do IO.
        upstream_ips: Vec::new(),
        instance: instance_id(cols[14], cols[15], cols[16]),
        server_ip: cols[17].and_then(parse_inet),
        synchronous_standby_names: if in_recovery {
            None
        } else {
            cols[7].map(str::to_string)
        },
        replication,
    })
}

/// The server's identity from its three columns; `None` unless all parse,
/// since a partial identity could make two servers look alike.
fn instance_id(
    sysid: Option<&str>,
    started: Option<&str>,
    port: Option<&str>,
) -> Option<InstanceId> {
    Some(InstanceId {
        system_identifier: sysid?.parse().ok()?,
        started_us: started?.parse().ok()?,
        port: port?.parse().ok()?,
    })
}

/// An `inet` value as PostgreSQL prints it; a host address may carry a
/// `/32` or `/128` suffix, which says nothing about the address.
fn parse_inet(s: &str) -> Option<IpAddr> {
    s.split('/').next()?.parse().ok()
}

/// The name a standby's WAL receiver reports to the primary: the
/// `application_name` of `primary_conninfo`, else `cluster_name`, else
/// `walreceiver` (PostgreSQL's own fallback order).
fn walreceiver_name(conninfo: Option<&str>, cluster_name: Option<&str>) -> String {
    conninfo
        .and_then(|ci| conninfo_value(ci, "application_name"))
        .filter(|s| !s.is_empty())
        .or_else(|| cluster_name.filter(|s| !s.is_empty()).map(str::to_string))
        .unwrap_or_else(|| "walreceiver".to_string())
}

/// The value of `key` in a connection string as `pg_stat_wal_receiver`
/// shows it.
///
/// PostgreSQL renders that column as `key=value` pairs joined by spaces
/// without quoting the values, so `application_name='node 3'` comes back
/// as `application_name=node 3 fallback_application_name=...`. A value
/// therefore runs up to the next space followed by a keyword and `=`. A
/// value that does start with a quote is read as libpq reads a quoted one
/// (`\'` and `\\` escapes), so a conninfo in libpq's own syntax works as
/// well. (tokio-postgres parses libpq syntax, but refuses keywords it does
/// not know and cannot read the unquoted form.)
fn conninfo_value(conninfo: &str, key: &str) -> Option<String> {
    let mut rest = conninfo.trim_start();
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let (kw, after) = (rest[..eq].trim_end(), rest[eq + 1..].trim_start());
        let (value, next) = if let Some(quoted) = after.strip_prefix('\'') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let mut end = quoted.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next().map(|(_, c)| c)),
                    '\'' => {
                        end = i + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            (value, &quoted[end..])
        } else {
            let end = next_keyword(after).unwrap_or(after.len());
            (after[..end].trim_end().to_string(), &after[end..])
        };
        if kw == key {
            return Some(value);
        }
        rest = next.trim_start();
    }
    None
}

/// Where, in an unquoted value, the next `keyword=` starts: after
/// whitespace, a run of letters and `_` followed by `=` (libpq allows
/// spaces around it).
fn next_keyword(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    (1..bytes.len()).find(|&i| {
        if !bytes[i - 1].is_ascii_whitespace() || bytes[i].is_ascii_whitespace() {
            return false;
        }
        let word = bytes[i..]
            .iter()
            .take_while(|b| b.is_ascii_alphabetic() || **b == b'_')
            .count();
        let gap = bytes[i + word..]
            .iter()
            .take_while(|b| b.is_ascii_whitespace())
            .count();
        word > 0 && bytes.get(i + word + gap) == Some(&b'=')
    })
}

/// Parses a time setting as `current_setting()` shows it: a number with
/// an optional unit (`0`, `250ms`, `5s`, `10min`, `2h`, `1d`); milliseconds
/// when there is no unit, as for `recovery_min_apply_delay`.
fn parse_pg_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "" | "ms" => 1,
        "s" => 1_000,
        "min" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "us" => return Some(Duration::from_micros(n)),
        _ => return None,
    };
    n.checked_mul(ms).map(Duration::from_millis)
}

fn parse_replication_line(line: &str) -> Option<ReplicationRow> {
    let mut f = line.split('\t');
    Some(ReplicationRow {
        application_name: f.next()?.to_string(),
        state: f.next().unwrap_or_default().to_string(),
        sync_state: f.next().unwrap_or_default().to_string(),
        replay_lsn: f.next().and_then(parse_lsn),
        slot_name: f.next().filter(|s| !s.is_empty()).map(str::to_string),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(v: &[Option<&'static str>]) -> Vec<Option<&'static str>> {
        v.to_vec()
    }

    #[test]
    fn primary_row() {
        let cols = row(&[
            Some("f"),
            Some("0/3000148"),
            None,
            None,
            None,
            Some("0"),
            Some("3"),
            Some("ANY 1 (node2, node3)"),
            Some("node1"),
            None,
            Some("node2\tstreaming\tquorum\t0/3000148\tslot2\nnode3\tcatchup\tquorum\t\t"),
            None,
            None,
            None,
            Some("-7715986735846115607"),
            Some("1796518162822928"),
            Some("5432"),
            Some("::1/128"),
        ]);
        let o = parse_observation_row(&cols, Duration::from_millis(2)).unwrap();
        assert!(!o.in_recovery);
        assert_eq!(o.current_lsn, Some(0x3000148));
        assert_eq!(o.timeline, Some(3));
        assert_eq!(
            o.synchronous_standby_names.as_deref(),
            Some("ANY 1 (node2, node3)")
        );
        assert_eq!(o.replication.len(), 2);
        assert_eq!(o.replication[1].state, "catchup");
        assert_eq!(o.replication[1].replay_lsn, None);
        assert_eq!(o.replication[0].slot_name.as_deref(), Some("slot2"));
        assert_eq!(o.replication[1].slot_name, None);
        assert_eq!(o.wal_receiver_name, None);
        assert_eq!(
            o.instance,
            Some(InstanceId {
                system_identifier: -7715986735846115607,
                started_us: 1796518162822928,
                port: 5432,
            })
        );
        assert_eq!(o.server_ip, Some("::1".parse().unwrap()));
    }

    #[test]
    fn replica_row_names_its_walreceiver() {
        let cols = row(&[
            Some("t"),
            None,
            Some("0/5000000"),
            Some("0/4000000"),
            Some("1500"),
            Some("1min"),
            Some("1"),
            Some(""),
            Some("node2"),
            Some("user=postgres host=127.0.0.1 port=5432 application_name=fast_one"),
            None,
            Some("node2_slot"),
            Some("127.0.0.1"),
            Some("5432"),
            Some("7715986735846115607"),
            None,
            Some("5433"),
            Some("10.0.0.2"),
        ]);
        let o = parse_observation_row(&cols, Duration::ZERO).unwrap();
        assert!(o.in_recovery);
        assert_eq!(o.replay_lsn, Some(0x4000000));
        assert_eq!(o.replay_delay, Some(Duration::from_millis(1500)));
        assert_eq!(o.min_apply_delay, Duration::from_secs(60));
        assert_eq!(o.wal_receiver_name.as_deref(), Some("fast_one"));
        assert_eq!(o.wal_receiver_slot.as_deref(), Some("node2_slot"));
        assert_eq!(o.upstream, Some(HostAddr::new("127.0.0.1", 5432)));
        assert_eq!(o.synchronous_standby_names, None);
        // Part of the identity missing: no identity at all.
        assert_eq!(o.instance, None);
        assert_eq!(o.server_ip, Some("10.0.0.2".parse().unwrap()));
    }

    #[test]
    fn time_settings_with_units() {
        assert_eq!(parse_pg_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_pg_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_pg_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_pg_duration("10min"), Some(Duration::from_secs(600)));
        assert_eq!(parse_pg_duration("1d"), Some(Duration::from_secs(86_400)));
        assert_eq!(parse_pg_duration("5 parsecs"), None);
        assert_eq!(parse_pg_duration(""), None);
    }

    #[test]
    fn walreceiver_name_with_spaces_and_quotes() {
        // As PostgreSQL shows it: values unquoted.
        let shown = "user=postgres passfile=/tmp/.pgpass dbname=replication host=127.0.0.1 \
                     port=5432 application_name=node 3 fallback_application_name=node2 \
                     sslmode=prefer";
        assert_eq!(walreceiver_name(Some(shown), Some("c")), "node 3");
        assert_eq!(
            conninfo_value(shown, "fallback_application_name").as_deref(),
            Some("node2")
        );
        assert_eq!(
            walreceiver_name(Some("host=a application_name=last one"), None),
            "last one"
        );
        // libpq's own syntax: quoted values with escapes, spaces around '='.
        let quoted = r"host=a application_name = 'it\'s a \\ name' port=1";
        assert_eq!(walreceiver_name(Some(quoted), None), r"it's a \ name");
        assert_eq!(conninfo_value(quoted, "port").as_deref(), Some("1"));
        assert_eq!(
            conninfo_value("application_name='open", "application_name").as_deref(),
            Some("open")
        );
        assert_eq!(conninfo_value("garbage", "application_name"), None);
        assert_eq!(conninfo_value("", "application_name"), None);
        // A name that merely contains the key is not the key.
        assert_eq!(
            walreceiver_name(Some("fallback_application_name=x"), Some("c")),
            "c"
        );
    }

    #[test]
    fn walreceiver_name_falls_back_like_postgres() {
        assert_eq!(walreceiver_name(Some("host=x"), Some("c")), "c");
        assert_eq!(walreceiver_name(None, Some("")), "walreceiver");
    }

    #[test]
    fn bad_rows_are_errors_not_panics() {
        assert!(parse_observation_row(&[], Duration::ZERO).is_err());
        let mut cols = vec![None; COLUMNS];
        assert!(parse_observation_row(&cols, Duration::ZERO).is_err());
        cols[0] = Some("t");
        cols[4] = Some("garbage");
        assert!(parse_observation_row(&cols, Duration::ZERO).is_ok());
    }
}
