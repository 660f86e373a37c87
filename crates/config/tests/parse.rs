//! The file format as an operator sees it: what parses, what the defaults
//! are, and what the error messages point at.

use std::net::SocketAddr;
use std::time::Duration;

use pgwarden_config::{
    parse, ConfigError, LogFormat, PoolMode, ServiceKind, READ_ONLY, READ_WRITE,
};
use pgwarden_topology::{HostAddr, LagLimit, Strategy, Want};

const FILE: &str = "pgwarden.toml";

const MINIMAL: &str = r#"[cluster]
hosts = ["127.0.0.1:5432", "127.0.0.1:5433", "127.0.0.1:5434"]
user = "postgres"              # the probe connects as this user

[listen]
read_write = "127.0.0.1:6432"
read_only = "127.0.0.1:6433"
http = "127.0.0.1:6434"

[services.standby]
listen = "127.0.0.1:6435"
select = "standby"
"#;

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Parses `text`, which must fail, and checks that the message names the
/// file, the line and the key, so an operator can find the mistake.
#[track_caller]
fn fails(text: &str, line: usize, key: &str, why: &str) -> String {
    let err = parse(text, FILE).expect_err("configuration should be rejected");
    let msg = err.to_string();
    assert_eq!(err.line(), Some(line), "wrong line in:\n{msg}");
    assert!(msg.starts_with(FILE), "no file name in:\n{msg}");
    assert!(
        msg.contains(&format!("{FILE}:{line}:")) || msg.contains(&format!("at line {line},")),
        "no line {line} in:\n{msg}"
    );
    assert!(msg.contains(key), "no key {key:?} in:\n{msg}");
    assert!(msg.contains(why), "no {why:?} in:\n{msg}");
    msg
}

/// A valid file with `extra` appended.
fn with(extra: &str) -> String {
    format!("[cluster]\nhosts = [\"db1:5432\", \"db2:5432\"]\n{extra}")
}

#[test]
fn minimal_file() {
    let c = parse(MINIMAL, FILE).unwrap();
    let addrs: Vec<_> = c.cluster.hosts.iter().map(|h| h.addr.clone()).collect();
    assert_eq!(
        addrs,
        [5432, 5433, 5434].map(|p| HostAddr::new("127.0.0.1", p))
    );
    assert_eq!(c.cluster.user, "postgres");
    assert_eq!(c.listen.read_write, sa("127.0.0.1:6432"));
    assert_eq!(c.listen.read_only, sa("127.0.0.1:6433"));
    assert_eq!(c.listen.http, sa("127.0.0.1:6434"));

    let services = c.services();
    let names: Vec<_> = services.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, [READ_WRITE, READ_ONLY, "standby"]);

    let rw = &services[0];
    assert_eq!(rw.kind, ServiceKind::Primary);
    assert_eq!(rw.want, Want::Primary);
    assert!(!rw.read_only);
    assert!(!rw.policy.fallback_to_primary);

    let ro = &services[1];
    assert_eq!(ro.want, Want::Replica);
    assert_eq!(ro.listen, sa("127.0.0.1:6433"));
    assert!(ro.read_only);
    assert!(ro.policy.fallback_to_primary);

    let sb = c.service("standby").unwrap();
    assert_eq!(sb.kind, ServiceKind::Standby);
    assert_eq!(sb.want, Want::SyncStandby);
    assert_eq!(sb.listen, sa("127.0.0.1:6435"));
    assert!(sb.read_only);
    assert!(sb.policy.fallback_to_primary);
    assert_eq!(sb.policy.strategy, Strategy::RoundRobin);
    assert_eq!(sb.policy.rtt_threshold, ms(20));
    assert!(sb.policy.rtt_threshold_enabled);
    assert_eq!(sb.pool_mode, PoolMode::Session);
    assert_eq!(sb.connect_wait_timeout, Duration::from_secs(5));

    // Later additions to the same file.
    let c = parse(
        &format!("{MINIMAL}\n[pool]\nmode = \"transaction\"\nsize = 20\n"),
        FILE,
    )
    .unwrap();
    assert_eq!(c.pool.mode, PoolMode::Transaction);
    assert_eq!(
        c.service("standby").unwrap().pool_mode,
        PoolMode::Transaction
    );

    // The `default` service bypasses the pool, as administrators expect,
    // unless it asks for a pool mode of its own.
    let c = parse(
        &format!(
            "{MINIMAL}\n[pool]\nmode = \"transaction\"\n\n[services.admin]\nlisten = \"127.0.0.1:6440\"\nselect = \"default\"\n\n[services.admin_pooled]\nlisten = \"127.0.0.1:6441\"\nselect = \"default\"\npool_mode = \"transaction\"\n"
        ),
        FILE,
    )
    .unwrap();
    let admin = c.service("admin").unwrap();
    assert_eq!((admin.pool_mode, admin.direct), (PoolMode::Session, true));
    let pooled = c.service("admin_pooled").unwrap();
    assert_eq!(
        (pooled.pool_mode, pooled.direct),
        (PoolMode::Transaction, false)
    );
    assert!(!c.service(READ_WRITE).unwrap().direct);
}

#[test]
fn defaults() {
    let c = parse("[cluster]\nhosts = [\"db1:5432\"]\n", FILE).unwrap();
    let cl = &c.cluster;
    assert_eq!(cl.user, "postgres");
    assert_eq!(cl.dbname, "postgres");
    assert_eq!(cl.password, None);
    assert_eq!(cl.password_file, None);
    assert_eq!(cl.probe_interval, Duration::from_secs(1));
    assert_eq!(cl.connect_timeout, Duration::from_secs(2));
    assert_eq!(cl.query_timeout, Duration::from_secs(2));
    assert_eq!(cl.down_after_failures, 3);
    assert_eq!(cl.topology_config().down_after_failures, 3);
    assert_eq!(cl.rtt_threshold, ms(20));
    assert!(cl.rtt_threshold_enabled);
    assert_eq!(cl.max_replica_lag_bytes, None);
    assert_eq!(cl.max_replica_lag, None);
    assert_eq!(cl.lag_hold, Duration::from_secs(10));
    assert_eq!(cl.topology_config().max_replica_lag, None);
    assert_eq!(cl.host_configs(), cl.hosts);

    // Derived from the first host's port.
    assert_eq!(c.listen.read_write, sa("127.0.0.1:6432"));
    assert_eq!(c.listen.read_only, sa("127.0.0.1:6433"));
    assert_eq!(c.listen.http, sa("127.0.0.1:6434"));
    assert_eq!(c.services().len(), 2);

    assert_eq!(c.engine.worker_threads, None);
    assert_eq!(c.engine.worker_fill, 8);
    assert_eq!(c.engine.connect_wait_timeout, Duration::from_secs(5));
    assert_eq!(c.engine.server_connect_timeout, Duration::from_secs(2));
    assert_eq!(c.engine.shutdown_timeout, Duration::from_secs(30));
    for (cores, threads) in [(1, 2), (8, 2), (12, 3), (32, 8), (128, 8)] {
        assert_eq!(c.engine.effective_worker_threads(cores), threads, "{cores}");
    }

    let p = &c.pool;
    assert_eq!(p.mode, PoolMode::Session);
    assert_eq!((p.size, p.min_size, p.max_client_conn), (20, 0, 10_000));
    assert_eq!(p.server_idle_timeout, Some(Duration::from_secs(600)));
    assert_eq!(p.server_lifetime, Some(Duration::from_secs(3600)));
    assert_eq!(p.query_wait_timeout, Some(Duration::from_secs(120)));
    assert_eq!(p.client_idle_timeout, None);
    assert!(p.databases.is_empty() && p.users.is_empty());

    assert_eq!(c.log.level, "info");
    assert_eq!(c.log.format, LogFormat::Text);
}

#[test]
fn derived_ports_follow_the_first_host() {
    let c = parse("[cluster]\nhosts = [\"db1:6000\", \"db2:5432\"]\n", FILE).unwrap();
    assert_eq!(c.listen.read_write, sa("127.0.0.1:7000"));
    assert_eq!(c.listen.read_only, sa("127.0.0.1:7001"));
    assert_eq!(c.listen.http, sa("127.0.0.1:7002"));
    // Only the missing ones are derived.
    let c = parse(&with("[listen]\nread_only = \"0.0.0.0:7777\"\n"), FILE).unwrap();
    assert_eq!(c.listen.read_write, sa("127.0.0.1:6432"));
    assert_eq!(c.listen.read_only, sa("0.0.0.0:7777"));
}

#[test]
fn full_example_parses() {
    let c = parse(
        include_str!("../pgwarden.example.toml"),
        "pgwarden.example.toml",
    )
    .unwrap();
    let cl = &c.cluster;
    assert_eq!(cl.hosts.len(), 4);
    assert_eq!(cl.hosts[2].application_name.as_deref(), Some("n3"));
    assert!(cl.hosts[2].has_tag("offline"));
    assert_eq!(cl.hosts[3].addr, HostAddr::new("fd00::14", 5432));
    assert_eq!(
        cl.password_file.as_deref(),
        Some(std::path::Path::new("/etc/pgwarden/password"))
    );
    let topo = cl.topology_config();
    assert_eq!(
        topo.max_replica_lag,
        Some(LagLimit {
            bytes: Some(16 << 20),
            time: Some(Duration::from_secs(30)),
        })
    );
    assert_eq!(c.engine.effective_worker_threads(64), 4);
    assert_eq!(c.engine.worker_fill, 16);
    assert_eq!(c.pool.min_size, 2);
    assert_eq!(c.pool.client_idle_timeout, None);
    assert_eq!(c.pool.idle_transaction_timeout, None);
    assert_eq!(c.pool.reserve_size, 0);
    assert_eq!(c.pool.reserve_timeout, Duration::from_secs(5));
    assert_eq!(c.pool.stats_period, Duration::from_secs(60));
    assert_eq!(c.pool.size_for("analytics", "app"), 5);
    assert_eq!(c.pool.size_for("other", "app"), 20);
    assert_eq!(
        c.pool
            .mode_for(PoolMode::Transaction, "analytics", "migrator"),
        PoolMode::Session
    );
    assert_eq!(c.log.format, LogFormat::Json);

    let names: Vec<_> = c.services().into_iter().map(|s| s.name).collect();
    assert_eq!(
        names,
        [READ_WRITE, READ_ONLY, "admin", "audit", "reports", "standby"]
    );
    let ro = c.service(READ_ONLY).unwrap();
    assert_eq!(ro.policy.strategy, Strategy::Nearest);
    assert_eq!(ro.policy.rtt_threshold, ms(5));
    assert_eq!(ro.listen, sa("0.0.0.0:6433"));
    let reports = c.service("reports").unwrap();
    assert_eq!(reports.want, Want::Tagged("offline".into()));
    assert!(!reports.policy.fallback_to_primary);
    assert_eq!(reports.pool_mode, PoolMode::Transaction);
    assert_eq!(reports.connect_wait_timeout, Duration::from_secs(30));
    let audit = c.service("audit").unwrap();
    assert_eq!(audit.want, Want::Delayed);
    assert!(!audit.policy.fallback_to_primary);
    let admin = c.service("admin").unwrap();
    assert_eq!(
        (admin.kind, admin.want.clone()),
        (ServiceKind::Default, Want::Primary)
    );
    assert!(!admin.read_only);
    assert_eq!(admin.pool_mode, PoolMode::Session);
}

#[test]
fn host_forms() {
    let c = parse(
        "[cluster]\nhosts = [\"DB1:5432\", { addr = \"db2:5433\" }, { addr = \"db3:5434\", tags = [\"x\"], application_name = \"n3\" }]\n",
        FILE,
    )
    .unwrap();
    let h = &c.cluster.hosts;
    assert_eq!(h[0].addr, HostAddr::new("DB1", 5432));
    assert!(h[1].tags.is_empty() && h[1].application_name.is_none());
    assert_eq!(h[2].tags, ["x"]);
}

#[test]
fn durations_everywhere() {
    let c = parse(
        &with("probe_interval = 250\nrtt_threshold = 0\nlag_hold = \"1.5min\"\nmax_replica_lag = \"1h\"\n"),
        FILE,
    )
    .unwrap();
    assert_eq!(c.cluster.probe_interval, ms(250));
    assert_eq!(c.cluster.rtt_threshold, Duration::ZERO);
    assert_eq!(c.cluster.lag_hold, Duration::from_secs(90));
    assert_eq!(c.cluster.max_replica_lag, Some(Duration::from_secs(3600)));
    // Zero turns pool timeouts off.
    let c = parse(
        &format!(
            "{}\n[pool]\nserver_lifetime = \"0s\"\nclient_idle_timeout = \"5min\"\nidle_transaction_timeout = \"30s\"\nreserve_size = 3\nreserve_timeout = \"250ms\"\n",
            with("")
        ),
        FILE,
    )
    .unwrap();
    assert_eq!(c.pool.server_lifetime, None);
    assert_eq!(c.pool.client_idle_timeout, Some(Duration::from_secs(300)));
    assert_eq!(
        c.pool.idle_transaction_timeout,
        Some(Duration::from_secs(30))
    );
    assert_eq!(c.pool.reserve_size, 3);
    assert_eq!(c.pool.reserve_timeout, Duration::from_millis(250));
    assert!(!c.pool.reuse_session_servers, "off unless asked for");
    let c = parse(
        &format!("{}\n[pool]\nstats_period = \"15s\"\n", with("")),
        FILE,
    )
    .unwrap();
    assert_eq!(c.pool.stats_period, Duration::from_secs(15));
    let c = parse(
        &format!("{}\n[pool]\nreuse_session_servers = true\n", with("")),
        FILE,
    )
    .unwrap();
    assert!(c.pool.reuse_session_servers);
}

#[test]
fn service_overrides() {
    let text = with(
        "rtt_threshold = \"7ms\"\nrtt_threshold_enabled = false\n\
         [engine]\nconnect_wait_timeout = \"9s\"\n\
         [services.read_write]\nlisten = \"127.0.0.1:7000\"\nselect = \"default\"\n\
         [services.fast]\nlisten = \"127.0.0.1:7001\"\nselect = \"replica\"\nstrategy = \"nearest\"\n\
         rtt_threshold_enabled = true\nconnect_wait_timeout = \"1s\"\nfallback_to_primary = false\n\
         [services.writer]\nlisten = \"127.0.0.1:7002\"\nselect = \"primary\"\nread_only = true\n",
    );
    let c = parse(&text, FILE).unwrap();
    assert_eq!(c.listen.read_write, sa("127.0.0.1:7000"));
    let rw = c.service(READ_WRITE).unwrap();
    assert_eq!(rw.kind, ServiceKind::Default);
    assert_eq!(rw.listen, sa("127.0.0.1:7000"));
    assert_eq!(rw.connect_wait_timeout, Duration::from_secs(9));
    assert!(!rw.policy.rtt_threshold_enabled);
    let fast = c.service("fast").unwrap();
    assert_eq!(fast.policy.strategy, Strategy::Nearest);
    assert_eq!(fast.policy.rtt_threshold, ms(7));
    assert!(fast.policy.rtt_threshold_enabled);
    assert!(!fast.policy.fallback_to_primary);
    assert_eq!(fast.connect_wait_timeout, Duration::from_secs(1));
    let writer = c.service("writer").unwrap();
    assert!(writer.read_only);
    assert_eq!(writer.want, Want::Primary);
}

#[test]
fn password_is_not_debug_printed() {
    let c = parse(&with("password = \"hunter2\"\n"), FILE).unwrap();
    assert_eq!(c.cluster.password.as_deref(), Some("hunter2"));
    let shown = format!("{c:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("redacted"));
}

#[test]
fn unknown_keys_in_every_section() {
    for (text, line, key) in [
        ("[cluster]\nhosts = [\"db:1\"]\nhost = \"x\"\n", 3, "host"),
        (
            "[cluster]\nhosts = [{ addr = \"db:1\", tag = \"x\" }]\n",
            2,
            "tag",
        ),
        (
            &with("[listen]\nreadwrite = \"127.0.0.1:1\"\n"),
            4,
            "readwrite",
        ),
        (
            &with("[services.a]\nlisten = \"127.0.0.1:1\"\nselect = \"replica\"\nmode = \"x\"\n"),
            6,
            "mode",
        ),
        (&with("[engine]\nthreads = 4\n"), 4, "threads"),
        (&with("[pool]\npool_size = 4\n"), 4, "pool_size"),
        (&with("[pool.users.app]\nmin_size = 4\n"), 4, "min_size"),
        (&with("[log]\nlevl = \"info\"\n"), 4, "levl"),
        (&with("[logging]\nlevel = \"info\"\n"), 3, "logging"),
    ] {
        fails(text, line, key, "unknown field");
    }
}

#[test]
fn bad_values() {
    fails(
        &with("probe_interval = \"5 parsecs\"\n"),
        3,
        "probe_interval",
        "unknown unit \"parsecs\"",
    );
    fails(
        &with("probe_interval = \"0s\"\n"),
        3,
        "probe_interval",
        "greater than zero",
    );
    fails(&with("lag_hold = -5\n"), 3, "lag_hold", "negative");
    fails(&with("lag_hold = 1.5\n"), 3, "lag_hold", "\"1.5s\"");
    fails(
        &with("[engine]\nshutdown_timeout = \"5m\"\n"),
        4,
        "shutdown_timeout",
        "ambiguous",
    );
    fails(
        &with("[listen]\nhttp = \"localhost:8080\"\n"),
        4,
        "http",
        "invalid listen address",
    );
    fails(
        &with("[listen]\nhttp = \"127.0.0.1:70000\"\n"),
        4,
        "http",
        "invalid listen",
    );
    fails(
        &with("[listen]\nhttp = \"127.0.0.1:0\"\n"),
        4,
        "http",
        "port 0",
    );
    fails(
        "[cluster]\nhosts = [\"db1:5432\", \"db2\"]\n",
        2,
        "hosts",
        "missing port",
    );
    // The excerpt of an item in a multi-line array shows no key, so the
    // message names it.
    let msg = fails(
        "[cluster]\nhosts = [\n  \"db1:5432\",\n  \"db2\",\n]\n",
        4,
        "cluster.hosts[1]: ",
        "missing port",
    );
    assert!(
        msg.starts_with("pgwarden.toml: cluster.hosts[1]: "),
        "{msg}"
    );
    fails(
        "[cluster]\nhosts = [{ addr = \"db1:99999\" }]\n",
        2,
        "hosts",
        "invalid port",
    );
    fails("[cluster]\nhosts = []\n", 2, "hosts", "at least one");
    fails(
        "[cluster]\nhosts = [\"/var/run/postgresql:5432\"]\n",
        2,
        "hosts",
        "Unix-domain socket directory is not supported",
    );
    fails(&with("user = \"\"\n"), 3, "user", "must not be empty");
    fails(
        &with("[services.x]\nlisten = \"127.0.0.1:7000\"\nselect = \"leader\"\n"),
        5,
        "select",
        "unknown value `leader`",
    );
    fails(
        &with("[services.x]\nlisten = \"127.0.0.1:7000\"\nselect = \"replica\"\nstrategy = \"fastest\"\n"),
        6,
        "strategy",
        "unknown value",
    );
    fails(
        &with("[pool]\nmode = \"statement\"\n"),
        4,
        "mode",
        "unknown value",
    );
    fails(
        &with("[pool]\nsize = -1\n"),
        4,
        "size",
        "expected a whole number from 0 to 4294967295",
    );
    fails(
        &with("[log]\nformat = \"xml\"\n"),
        4,
        "format",
        "unknown value",
    );
}

/// Type mistakes are told in the file's terms (whole numbers, tables,
/// arrays), never with the names of the Rust types behind them.
#[test]
fn type_mistakes_name_no_rust_type() {
    for (extra, line, key, why) in [
        (
            "[pool]\nsize = 2.5\n",
            4,
            "pool.size",
            "expected a whole number from 0",
        ),
        (
            "[pool]\nsize = [1]\n",
            4,
            "pool.size",
            "invalid type: array",
        ),
        ("[pool]\nmode = 3\n", 4, "pool.mode", "expected a string"),
        (
            "[pool]\ndatabases = 3\n",
            4,
            "pool.databases",
            "expected a table",
        ),
        ("[services]\na = 3\n", 4, "services.a", "expected a table"),
        (
            "[engine]\nworker_threads = \"4\"\n",
            4,
            "worker_threads",
            "whole number",
        ),
    ] {
        let msg = fails(&with(extra), line, key, why);
        for rust in [
            "u32", "usize", "u64", "struct", "Raw", "sequence", "a map", "variant",
        ] {
            assert!(!msg.contains(rust), "{rust:?} in:\n{msg}");
        }
    }
    let msg = fails(
        "pool = 3\n[cluster]\nhosts = [\"db1:5432\"]\n",
        1,
        "pool",
        "expected a table",
    );
    assert!(!msg.contains("struct"), "{msg}");
    let msg = fails(
        "[cluster]\nhosts = \"db1:5432\"\n",
        2,
        "hosts",
        "expected an array",
    );
    assert!(!msg.contains("sequence"), "{msg}");
}

#[test]
fn missing_required_keys() {
    let err = parse("[listen]\nhttp = \"127.0.0.1:1\"\n", FILE).unwrap_err();
    assert!(
        err.to_string().contains("cluster.hosts: is required"),
        "{err}"
    );
    let err = parse("[cluster]\nuser = \"x\"\n", FILE).unwrap_err();
    assert_eq!(err.key(), Some("cluster.hosts"));
    fails("[cluster]\nuser = \"x\"\n", 1, "hosts", "is required");
    fails(
        &with("[services.x]\nselect = \"replica\"\n"),
        3,
        "services.x.listen",
        "is required",
    );
    fails(
        &with("[services.x]\nlisten = \"127.0.0.1:7000\"\n"),
        3,
        "services.x.select",
        "is required",
    );
}

#[test]
fn duplicate_listen_addresses() {
    let mut text = MINIMAL.replace("127.0.0.1:6435", "127.0.0.1:6432");
    fails(
        &text,
        11,
        "services.standby.listen",
        "127.0.0.1:6432 is already used by listen.read_write",
    );
    text = MINIMAL.replace(
        "read_only = \"127.0.0.1:6433\"",
        "read_only = \"0.0.0.0:6434\"",
    );
    fails(
        &text,
        8,
        "listen.http",
        "overlaps 0.0.0.0:6434 of listen.read_only",
    );
    // Against a derived address the error points at the written key.
    fails(
        &with("[listen]\nhttp = \"127.0.0.1:6433\"\n"),
        4,
        "listen.http",
        "already used by listen.read_only (derived from the first host's port)",
    );
    fails(
        &with("[listen]\nread_write = \"127.0.0.1:6433\"\n"),
        4,
        "listen.read_write",
        "already used by listen.read_only",
    );
    fails(
        &with("[listen]\nread_write = \"127.0.0.1:7000\"\n[services.read_write]\nlisten = \"127.0.0.1:7001\"\n"),
        6,
        "services.read_write.listen",
        "keep only one",
    );
    // Of two services on one address, the one further down the file is
    // blamed, whatever their names.
    fails(
        &with("[services.zeta]\nlisten = \"127.0.0.1:7000\"\nselect = \"replica\"\n[services.alpha]\nlisten = \"127.0.0.1:7000\"\nselect = \"replica\"\n"),
        7,
        "services.alpha.listen",
        "already used by services.zeta.listen",
    );
}

#[test]
fn ipv4_mapped_addresses_are_their_ipv4_address() {
    fails(
        &MINIMAL.replace("127.0.0.1:6435", "[::ffff:127.0.0.1]:6432"),
        11,
        "services.standby.listen",
        "overlaps 127.0.0.1:6432 of listen.read_write",
    );
    fails(
        &MINIMAL.replace(
            "read_only = \"127.0.0.1:6433\"",
            "read_only = \"[::ffff:0.0.0.0]:6434\"",
        ),
        8,
        "listen.http",
        "overlaps",
    );
}

#[test]
fn numbers_too_large_for_any_integer_name_their_key() {
    fails(
        &with("[pool]\nmax_client_conn = 9223372036854775808\n"),
        4,
        "pool.max_client_conn",
        "number too large",
    );
    fails(
        &with("[cluster.probe]\n\"interval\" = 99999999999999999999\n"),
        4,
        "cluster.probe.interval",
        "",
    );
}

#[test]
fn a_file_that_is_not_utf8_is_refused_with_its_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("latin.toml");
    let mut text = MINIMAL.as_bytes().to_vec();
    // "user = "postgres" # é" in Latin-1 on line 3.
    let at = text.iter().position(|&b| b == b'#').unwrap();
    text.splice(at..at + 1, b"# caf\xe9 ".iter().copied());
    std::fs::write(&path, &text).unwrap();
    let err = pgwarden_config::load(&path).unwrap_err();
    let msg = err.to_string();
    assert_eq!(err.line(), Some(3), "{msg}");
    assert!(
        msg.starts_with(&format!("{}:3: not valid UTF-8 at column", path.display())),
        "{msg}"
    );
    assert!(msg.contains("cluster.user"), "{msg}");
}

#[test]
fn derived_port_overflow() {
    fails(
        "[cluster]\nhosts = [\n  \"db1:64536\",\n  \"db2:5432\",\n]\n",
        3,
        "listen.read_write",
        "65536",
    );
    // Only the keys that are actually derived can overflow.
    fails(
        "[cluster]\nhosts = [\"db1:64534\"]\n[listen]\nread_write = \"127.0.0.1:1\"\nread_only = \"127.0.0.1:2\"\n",
        2,
        "listen.http",
        "65536",
    );
    parse(
        "[cluster]\nhosts = [\"db1:65535\"]\n[listen]\nread_write = \"127.0.0.1:1\"\nread_only = \"127.0.0.1:2\"\nhttp = \"127.0.0.1:3\"\n",
        FILE,
    )
    .unwrap();
}

#[test]
fn replica_services_cannot_be_writable() {
    fails(
        &with(
            "[services.r]\nlisten = \"127.0.0.1:7000\"\nselect = \"replica\"\nread_only = false\n",
        ),
        6,
        "services.r.read_only",
        "a replica cannot take writes",
    );
    fails(
        &with("[services.read_only]\nselect = \"delayed\"\nread_only = false\n"),
        5,
        "services.read_only.read_only",
        "cannot take writes",
    );
    fails(
        &with("[services.read_write]\nselect = \"replica\"\n"),
        4,
        "services.read_write.select",
        "primary or default",
    );
    fails(
        &with("[services.read_write]\nread_only = true\n"),
        4,
        "services.read_write.read_only",
        "cannot be read-only",
    ); // The read-only port stays read-only when pointed at the primary.
    for select in ["primary", "default"] {
        fails(
            &with(&format!(
                "[services.read_only]\nselect = \"{select}\"\nread_only = false\n"
            )),
            5,
            "services.read_only.read_only",
            "cannot be made writable",
        );
    }
}

#[test]
fn absurd_durations_are_rejected_with_their_key() {
    // Values that would overflow the clock when first used.
    fails(
        &with("probe_interval = \"106751991167300d\"\n"),
        3,
        "cluster.probe_interval",
        "maximum",
    );
    fails(
        &with("[engine]\nconnect_wait_timeout = \"18446744073709551615s\"\n"),
        4,
        "engine.connect_wait_timeout",
        "maximum",
    );
    fails(
        &with("[engine]\nshutdown_timeout = 9223372036854775807\n"),
        4,
        "engine.shutdown_timeout",
        "maximum",
    );
    let ok = parse(&with("[engine]\nshutdown_timeout = \"36500d\"\n"), FILE).unwrap();
    assert_eq!(
        ok.engine.shutdown_timeout,
        Duration::from_secs(36500 * 86_400)
    );
}

#[test]
fn cluster_cross_checks() {
    fails(
        "[cluster]\nhosts = [\"db1:5432\", \"DB1:5432\"]\n",
        2,
        "cluster.hosts",
        "db1:5432 is listed more than once",
    );
    fails(
        "[cluster]\nhosts = [\n  { addr = \"a:1\", application_name = \"n\" },\n  { addr = \"b:1\", application_name = \"n\" },\n]\n",
        4,
        "cluster.hosts",
        "application_name \"n\" of b:1 is already used by a:1",
    );
    // The primary's rows are matched without regard to case, so a name
    // differing only in case is the same name.
    fails(
        "[cluster]\nhosts = [\n  { addr = \"a:1\", application_name = \"Node\" },\n  { addr = \"b:1\", application_name = \"nODE\" },\n]\n",
        4,
        "cluster.hosts",
        "application_name \"nODE\" of b:1 is already used by a:1",
    );
    fails(
        &with("password = \"x\"\npassword_file = \"/p\"\n"),
        4,
        "cluster.password_file",
        "keep only one",
    );
}

#[test]
fn connection_limits_per_database_and_user() {
    let c = parse(
        &with(
            "[pool]\nmax_db_connections = 10\nmax_user_connections = 8\n\
             [pool.databases.analytics]\nmax_db_connections = 3\n\
             [pool.users.etl]\nmax_user_connections = 0\n",
        ),
        FILE,
    )
    .unwrap();
    assert_eq!(c.pool.db_limit("analytics"), 3);
    assert_eq!(c.pool.db_limit("app"), 10);
    assert_eq!(c.pool.user_limit("etl"), 0);
    assert_eq!(c.pool.user_limit("app"), 8);
    let d = parse(MINIMAL, FILE).unwrap();
    assert_eq!((d.pool.db_limit("x"), d.pool.user_limit("x")), (0, 0));
    // Each limit lives in its own table, as in PgBouncer.
    fails(
        &with("[pool.users.etl]\nmax_db_connections = 3\n"),
        4,
        "pool.users.etl.max_db_connections",
        "belongs in [pool.databases.NAME] or [pool]",
    );
    fails(
        &with("[pool.databases.app]\nmax_user_connections = 3\n"),
        4,
        "pool.databases.app.max_user_connections",
        "belongs in [pool.users.NAME] or [pool]",
    );
}

#[test]
fn pool_and_engine_checks() {
    fails(&with("[pool]\nsize = 0\n"), 4, "pool.size", "at least 1");
    fails(
        &with("[pool]\nsize = 5\nmin_size = 6\n"),
        5,
        "pool.min_size",
        "larger than pool.size (5)",
    );
    fails(&with("[pool]\nmin_size = 21\n"), 4, "pool.min_size", "(20)");
    fails(
        &with("[pool]\nadmin_users = [\"admin\", \"\"]\n"),
        4,
        "pool.admin_users[1]",
        "must not be empty",
    );
    // An override table with no key in it overrides nothing: its keys went
    // elsewhere.
    fails(
        &with("[pool.databases.app]\n[pool.users.alice]\nsize = 5\n"),
        3,
        "pool.databases.app",
        "sets nothing: give it mode, size or max_db_connections",
    );
    fails(
        &with("[pool.users.alice]\n"),
        3,
        "pool.users.alice",
        "mode, size or max_user_connections",
    );
    fails(
        &with("[pool]\nmin_size = 3\n[pool.databases.\"my.db\"]\nsize = 2\n"),
        6,
        "pool.databases.\"my.db\".size",
        "smaller than pool.min_size (3)",
    );
    fails(
        &with("[pool]\nstats_period = \"0s\"\n"),
        4,
        "pool.stats_period",
        "greater than zero",
    );
    fails(
        &with("[pool]\nmax_client_conn = 0\n"),
        4,
        "pool.max_client_conn",
        "at least 1",
    );
    fails(
        &with("down_after_failures = 0\n"),
        3,
        "cluster.down_after_failures",
        "out of range",
    );
    fails(
        &with("down_after_failures = -1\n"),
        3,
        "cluster.down_after_failures",
        "invalid value",
    );
    let c = parse(&with("down_after_failures = 1\n"), FILE).unwrap();
    assert_eq!(c.cluster.topology_config().down_after_failures, 1);
    fails(
        &with("[engine]\nworker_threads = 0\n"),
        4,
        "engine.worker_threads",
        "out of range",
    );
    fails(
        &with("[log]\nlevel = \"verbose\"\n"),
        4,
        "log.level",
        "unknown level",
    );
    let c = parse(
        &with("[log]\nlevel = \"info,pgwarden_probe=debug\"\n"),
        FILE,
    )
    .unwrap();
    assert_eq!(c.log.level, "info,pgwarden_probe=debug");
    // A typo inside a filter would silence everything else: refused.
    for (bad, why) in [
        ("inof,pgwarden_probe=debug", "unknown level \"inof\""),
        ("info,pgwarden_probe=debgu", "unknown level \"debgu\""),
        ("info,=debug", "no target"),
        ("info,pgwarden_probe[x]y", "malformed directive"),
    ] {
        fails(
            &with(&format!("[log]\nlevel = \"{bad}\"\n")),
            4,
            "log.level",
            why,
        );
    }
    for good in [
        "WARN",
        "info,pgwarden_proxy=trace,",
        "warn,pgwarden_proxy[session{service=rw}]=debug",
        "off",
    ] {
        let c = parse(&with(&format!("[log]\nlevel = \"{good}\"\n")), FILE)
            .unwrap_or_else(|e| panic!("{good}: {e}"));
        assert_eq!(c.log.level, good);
    }
}

#[test]
fn service_names() {
    fails(
        &with("[services.\"my service\"]\nlisten = \"127.0.0.1:7000\"\nselect = \"replica\"\n"),
        3,
        "services.\"my service\"",
        "invalid service name",
    );
    fails(
        &with("[services.2nd]\nlisten = \"127.0.0.1:7000\"\nselect = \"replica\"\n"),
        3,
        "services.2nd",
        "invalid service name",
    );
}

#[test]
fn missing_file() {
    let path = std::path::Path::new("/nonexistent/pgwarden.toml");
    let err = pgwarden_config::load(path).unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }));
    assert!(
        err.to_string().starts_with("/nonexistent/pgwarden.toml: "),
        "{err}"
    );
}

/// The snippets the pooling and security documentation promise work as
/// written on top of the minimal file.
#[test]
fn pool_tls_and_auth_snippets_parse_as_written() {
    let text = r#"
[cluster]
hosts = ["127.0.0.1:5432", "127.0.0.1:5433", "127.0.0.1:5434"]
user = "postgres"              # the probe connects as this user

[listen]
read_write = "127.0.0.1:6432"
read_only = "127.0.0.1:6433"
http = "127.0.0.1:6434"

[services.standby]
listen = "127.0.0.1:6435"
select = "standby"

[pool]
mode = "transaction"
size = 20

[tls]
cert = "server.crt"
key = "server.key"
client_tls = "allow"

[auth]
hba_file = "pg_hba.conf"
auth_user = "pgwarden_auth"     # runs the auth query; its own password from PGWARDEN_AUTH_PASSWORD or a file
"#;
    let c = pgwarden_config::parse(text, "pgwarden.toml").expect("parses");
    assert_eq!(c.pool.mode, pgwarden_config::PoolMode::Transaction);
    assert_eq!(c.tls.client_tls, pgwarden_config::ClientTls::Allow);
    let auth = c.auth.expect("[auth]");
    assert_eq!(auth.auth_user, "pgwarden_auth");
    assert_eq!(auth.auth_query, pgwarden_config::DEFAULT_AUTH_QUERY);
    let err = pgwarden_config::parse(
        &text.replace("client_tls = \"allow\"", "client_tls = \"maybe\""),
        "pgwarden.toml",
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("pgwarden.toml") && err.to_string().contains("client_tls"),
        "{err}"
    );
}

/// `server_tls` defaults to `disable`; the verifying modes need `server_ca`.
#[test]
fn server_tls_modes_and_their_ca() {
    let base =
        "[cluster]\nhosts = [\"127.0.0.1:5432\"]\n\n[listen]\nread_write = \"127.0.0.1:6432\"\n";
    let c = pgwarden_config::parse(base, "pgwarden.toml").expect("parses");
    assert_eq!(c.tls.server_tls, pgwarden_config::ServerTls::Disable);
    assert_eq!(c.tls.server_ca, None);
    let full =
        format!("{base}\n[tls]\nserver_tls = \"verify-full\"\nserver_ca = \"servers-ca.pem\"\n");
    let c = pgwarden_config::parse(&full, "pgwarden.toml").expect("parses");
    assert_eq!(c.tls.server_tls, pgwarden_config::ServerTls::VerifyFull);
    assert_eq!(
        c.tls.server_ca.as_deref(),
        Some(std::path::Path::new("servers-ca.pem"))
    );
    // No client certificate is needed for TLS towards the servers.
    assert_eq!(c.tls.client_tls, pgwarden_config::ClientTls::Disable);
    let c = pgwarden_config::parse(
        &format!("{base}\n[tls]\nserver_tls = \"require\"\n"),
        "pgwarden.toml",
    )
    .expect("require needs no CA");
    assert_eq!(c.tls.server_tls, pgwarden_config::ServerTls::Require);
    let err = pgwarden_config::parse(
        &format!("{base}\n[tls]\nserver_tls = \"verify-ca\"\n"),
        "pgwarden.toml",
    )
    .unwrap_err();
    assert!(err.to_string().contains("server_ca"), "{err}");
    let err = pgwarden_config::parse(
        &format!("{base}\n[tls]\nserver_tls = \"verify\"\n"),
        "pgwarden.toml",
    )
    .unwrap_err();
    assert!(err.to_string().contains("server_tls"), "{err}");
    // A CA that no mode uses is refused rather than left looking like a
    // check, with its key and line.
    for mode in ["disable", "prefer", "require"] {
        let err = pgwarden_config::parse(
            &format!("{base}\n[tls]\nserver_tls = \"{mode}\"\nserver_ca = \"ca.pem\"\n"),
            "pgwarden.toml",
        )
        .unwrap_err();
        assert_eq!(err.key(), Some("tls.server_ca"), "{err}");
        assert_eq!(err.line(), Some(9), "{err}");
        assert!(err.to_string().contains(mode), "{err}");
    }
}

/// The node file of the HA issue, as written, with the `[listen]` section
/// of the connection-manager issue.
const AGENT_MINIMAL: &str = r#"[agent]
name = "n1"
data_dir = "/var/lib/pgwarden/n1"   # PostgreSQL data directory the agent manages
pg_listen = "127.0.0.1:5432"
api = "127.0.0.1:8008"
rto = "fast"

[etcd]
endpoints = ["127.0.0.1:2379"]
cluster = "demo"

[listen]
read_write = "127.0.0.1:6432"
read_only = "127.0.0.1:6433"
http = "127.0.0.1:6434"
"#;

#[test]
fn agent_replicatefrom_names_another_member() {
    let with = |v: &str| {
        AGENT_MINIMAL.replace(
            "rto = \"fast\"",
            &format!("rto = \"fast\"\nreplicatefrom = {v}"),
        )
    };
    let c = parse(&with("\"n2\""), FILE).unwrap();
    let a = c.agent.unwrap();
    assert_eq!(a.tags.replicatefrom.as_deref(), Some("n2"));
    assert!(a.use_slots, "slots are on by default");
    for bad in ["\"n1\"", "\"no such!\""] {
        fails(&with(bad), 7, "agent.replicatefrom", "another member");
    }
    // Two places for one password: the line of the file's name.
    let both = AGENT_MINIMAL.replace(
        "rto = \"fast\"",
        "rto = \"fast\"\napi_password = \"x\"\napi_password_file = \"pw\"",
    );
    fails(&both, 8, "agent.api_password_file", "keep only one");
}

#[test]
fn agent_standby_cluster_is_a_table_checked_like_the_dynamic_one() {
    let with = |t: &str| {
        AGENT_MINIMAL.replace(
            "\n[etcd]",
            &format!("\n[agent.standby_cluster]\n{t}\n\n[etcd]"),
        )
    };
    let c = parse(
        &with("host = \"10.0.0.5\"\nprimary_slot_name = \"dc2\""),
        FILE,
    )
    .unwrap();
    let s = c.agent.unwrap().standby_cluster.expect("standby_cluster");
    assert_eq!((s.host.as_deref(), s.port), (Some("10.0.0.5"), 5432));
    assert_eq!(s.primary_slot_name.as_deref(), Some("dc2"));
    let c = parse(
        &with("host = \"h\"\nrestore_command = \"cp /a/%f %p\""),
        FILE,
    )
    .unwrap();
    let s = c.agent.unwrap().standby_cluster.expect("standby_cluster");
    assert_eq!(s.restore_command.as_deref(), Some("cp /a/%f %p"));
    assert!(parse(AGENT_MINIMAL, FILE)
        .unwrap()
        .agent
        .unwrap()
        .standby_cluster
        .is_none());
    for (bad, key) in [
        ("host = \"\"", "agent.standby_cluster.host"),
        (
            "host = \"h\"\nprimary_slot_name = \"No\"",
            "agent.standby_cluster.primary_slot_name",
        ),
        ("host = \"h\"\nrestore = \"x\"", "restore"),
        (
            "host = \"h\"\nrestore_command = \" \"",
            "agent.standby_cluster.restore_command",
        ),
        ("port = 5432", "host"),
    ] {
        let e = parse(&with(bad), FILE).unwrap_err().to_string();
        assert!(e.contains(key), "{bad}: {e}");
    }
}

#[test]
fn agent_replica_methods_are_tried_in_the_order_given() {
    use pgwarden_config::ReplicaMethod;
    let a = parse(AGENT_MINIMAL, FILE).unwrap().agent.unwrap();
    assert_eq!(a.create_replica, [ReplicaMethod::Basebackup]);
    let with = |t: &str| AGENT_MINIMAL.replace("\n[etcd]", &format!("\n{t}\n\n[etcd]"));
    let c = parse(
        &with(
            "create_replica_methods = [\"pgbackrest\", \"basebackup\"]\n\
             [agent.replica_methods.pgbackrest]\n\
             command = \"pgbackrest --stanza=main --delta restore\"\n\
             keep_data = true\n\
             no_params = true",
        ),
        FILE,
    )
    .unwrap();
    assert_eq!(
        c.agent.unwrap().create_replica,
        [
            ReplicaMethod::Command {
                name: "pgbackrest".into(),
                command: "pgbackrest --stanza=main --delta restore".into(),
                keep_data: true,
                no_params: true,
            },
            ReplicaMethod::Basebackup,
        ]
    );
    // A standby cluster's own list may name a method the members' list
    // leaves out.
    let a = parse(
        &with(
            "standby_cluster = { host = \"dc1\", create_replica_methods = [\"wal_g\", \"basebackup\"] }\n\
             [agent.replica_methods.wal_g]\n\
             command = \"wal-g backup-fetch\"",
        ),
        FILE,
    )
    .unwrap()
    .agent
    .unwrap();
    assert_eq!(a.create_replica, [ReplicaMethod::Basebackup]);
    assert_eq!(
        a.replica_methods.keys().collect::<Vec<_>>(),
        ["wal_g"],
        "{:?}",
        a.replica_methods
    );
    assert_eq!(
        a.standby_cluster.unwrap().create_replica_methods.unwrap(),
        ["wal_g", "basebackup"]
    );
    for (bad, key, why) in [
        (
            "create_replica_methods = [\"wal_g\"]",
            "agent.create_replica_methods",
            "[agent.replica_methods.wal_g]",
        ),
        (
            "create_replica_methods = []",
            "agent.create_replica_methods",
            "names no method",
        ),
        (
            "[agent.replica_methods.basebackup]\ncommand = \"x\"",
            "agent.replica_methods.basebackup",
            "built in",
        ),
        (
            "create_replica_methods = [\"r\"]\n[agent.replica_methods.r]\ncomand = \"x\"",
            "comand",
            "unknown field",
        ),
        (
            "standby_cluster = { host = \"h\", create_replica_methods = [\"wal_g\"] }",
            "agent.standby_cluster.create_replica_methods",
            "[agent.replica_methods.wal_g]",
        ),
        (
            "standby_cluster = { host = \"h\", create_replica_methods = [] }",
            "agent.standby_cluster.create_replica_methods",
            "names no method",
        ),
    ] {
        let e = parse(&with(bad), FILE).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains(why), "{bad}: {e}");
    }
}

#[test]
fn agent_bootstrap_from_a_backup() {
    let with = |t: &str| AGENT_MINIMAL.replace("\n[etcd]", &format!("\n{t}\n\n[etcd]"));
    assert!(parse(AGENT_MINIMAL, FILE)
        .unwrap()
        .agent
        .unwrap()
        .bootstrap
        .is_none());
    let c = parse(
        &with(
            "[agent.bootstrap]\n\
             command = \"restore-latest\"\n\
             [agent.bootstrap.recovery]\n\
             restore_command = \"cp /archive/%f %p\"\n\
             recovery_target_time = \"2026-12-05 12:00:00+00\"\n\
             recovery_target_inclusive = false",
        ),
        FILE,
    )
    .unwrap();
    let b = c.agent.unwrap().bootstrap.expect("bootstrap");
    assert_eq!(b.command, "restore-latest");
    assert!(!b.no_params);
    assert_eq!(
        b.recovery.into_iter().collect::<Vec<_>>(),
        [
            ("recovery_target_inclusive".to_string(), "off".to_string()),
            (
                "recovery_target_time".to_string(),
                "2026-12-05 12:00:00+00".to_string()
            ),
            (
                "restore_command".to_string(),
                "cp /archive/%f %p".to_string()
            ),
        ]
    );
    for (bad, key, why) in [
        (
            "[agent.bootstrap]\ncommand = \"x\"\nrecovery = { recovery_target_action = \"pause\" }",
            "agent.bootstrap.recovery.recovery_target_action",
            "only \"promote\"",
        ),
        (
            "[agent.bootstrap]\ncommand = \"x\"\nrecovery = { \"bad name\" = 1 }",
            "agent.bootstrap.recovery.bad name",
            "not a PostgreSQL parameter name",
        ),
        (
            "[agent.bootstrap]\nno_params = true",
            "command",
            "missing field",
        ),
        (
            "[agent.bootstrap]\ncommand = \"\"",
            "agent.bootstrap.command",
            "",
        ),
    ] {
        let e = parse(&with(bad), FILE).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains(why), "{bad}: {e}");
    }
}

#[test]
fn agent_minimal_file() {
    let c = parse(AGENT_MINIMAL, FILE).unwrap();
    let a = c.agent.as_ref().expect("agent section");
    assert_eq!(a.name, "n1");
    assert_eq!(a.pg_listen, HostAddr::new("127.0.0.1", 5432));
    assert_eq!(a.pg_connect_address, a.pg_listen);
    assert_eq!(a.api, sa("127.0.0.1:8008"));
    assert_eq!(a.api_url, "http://127.0.0.1:8008");
    // The fast preset of the reference table.
    let t = a.timing;
    assert_eq!(
        (t.ttl, t.loop_wait, t.retry_timeout, t.primary_start_timeout),
        (ms(20_000), ms(5_000), ms(5_000), ms(15_000))
    );
    assert_eq!(a.maximum_lag_on_failover, 1024 * 1024);
    assert!(!a.tags.nofailover);
    assert_eq!(a.replication_user, "postgres");
    assert!(a.reclone_on_rewind_failure);
    let e = c.etcd.as_ref().expect("etcd section");
    assert_eq!(e.endpoints, ["127.0.0.1:2379"]);
    assert_eq!(
        (e.namespace.as_str(), e.cluster.as_str()),
        ("pgwarden", "demo")
    );
    // Without [cluster], the node's own server is the one known host.
    assert_eq!(c.cluster.hosts.len(), 1);
    assert_eq!(c.cluster.hosts[0].addr, HostAddr::new("127.0.0.1", 5432));
    assert_eq!(c.cluster.hosts[0].application_name.as_deref(), Some("n1"));
    assert_eq!(c.listen.read_write, sa("127.0.0.1:6432"));
}

#[test]
fn agent_ports_derive_from_pg_listen() {
    let text = AGENT_MINIMAL.split("[listen]").next().unwrap();
    let c = parse(text, FILE).unwrap();
    assert_eq!(c.listen.read_write, sa("127.0.0.1:6432"));
    assert_eq!(c.listen.read_only, sa("127.0.0.1:6433"));
    assert_eq!(c.listen.http, sa("127.0.0.1:6434"));
}

#[test]
fn agent_timing_overrides_and_targets() {
    let text = AGENT_MINIMAL.replace(
        "rto = \"fast\"",
        "rto = \"norm\"\nttl = 12\nloop_wait = \"2s\"\nretry_timeout = 4\nprimary_start_timeout = \"1500ms\"\nnofailover = true\nfailover_priority = 3\n[agent.parameters]\nshared_buffers = \"64MB\"\nmax_connections = 50\nhot_standby = true",
    );
    let c = parse(&text, FILE).unwrap();
    let a = c.agent.unwrap();
    assert_eq!(
        (a.timing.ttl, a.timing.loop_wait, a.timing.retry_timeout),
        (ms(12_000), ms(2_000), ms(4_000))
    );
    assert_eq!(a.timing.primary_start_timeout, ms(1_500));
    assert!(a.tags.nofailover);
    assert_eq!(a.tags.failover_priority, 3);
    assert_eq!(a.parameters["shared_buffers"], "64MB");
    assert_eq!(a.parameters["max_connections"], "50");
    assert_eq!(a.parameters["hot_standby"], "on");

    let c = parse(&AGENT_MINIMAL.replace("rto = \"fast\"", "rto = 8"), FILE).unwrap();
    let t = c.agent.unwrap().timing;
    assert!(t.loop_wait + t.retry_timeout * 2 <= t.ttl);
    assert!(t.ttl <= ms(8_000));
}

#[test]
fn agent_lease_constraint_is_refused_with_the_key() {
    // loop_wait + 2 × retry_timeout = 5 + 20 > 20.
    let msg = fails(
        &AGENT_MINIMAL.replace("rto = \"fast\"", "rto = \"fast\"\nretry_timeout = 10"),
        6,
        "agent.ttl",
        "ttl",
    );
    assert!(msg.contains("retry_timeout"), "{msg}");
    // A target no consistent set of timers can reach.
    fails(
        &AGENT_MINIMAL.replace("rto = \"fast\"", "rto = 1"),
        6,
        "agent.rto",
        "rto",
    );
}

#[test]
fn agent_api_over_https() {
    let agent = |extra: &str| {
        AGENT_MINIMAL.replace("rto = \"fast\"\n", &format!("rto = \"fast\"\n{extra}"))
    };
    let c = parse(
        &agent(
            "api_cert_file = \"api.crt\"\napi_key_file = \"api.key\"\napi_ca_file = \"ca.pem\"\n",
        ),
        FILE,
    )
    .unwrap();
    let a = c.agent.unwrap();
    assert_eq!(a.api_url, "https://127.0.0.1:8008");
    fails(
        &agent("api_ca_file = \"a\"\napi_verify_client = \"optional\"\n"),
        8,
        "agent.api_verify_client",
        "api_cert_file",
    );
    assert_eq!(
        a.api_cert_file.as_deref(),
        Some(std::path::Path::new("api.crt"))
    );
    assert_eq!(
        a.api_key_file.as_deref(),
        Some(std::path::Path::new("api.key"))
    );
    assert_eq!(
        a.api_ca_file.as_deref(),
        Some(std::path::Path::new("ca.pem"))
    );
    assert_eq!(a.api_verify_client, pgwarden_config::VerifyClient::None);
    let a = parse(
        &agent("api_cert_file = \"c\"\napi_key_file = \"k\"\napi_ca_file = \"a\"\napi_verify_client = \"required\"\n"),
        FILE,
    )
    .unwrap()
    .agent
    .unwrap();
    assert_eq!(a.api_verify_client, pgwarden_config::VerifyClient::Required);
    // The CA alone: a member (or ctl) calling HTTPS APIs, serving plain.
    let a = parse(&agent("api_ca_file = \"ca.pem\"\n"), FILE)
        .unwrap()
        .agent
        .unwrap();
    assert_eq!(a.api_url, "http://127.0.0.1:8008");

    fails(
        &agent("api_cert_file = \"c\"\napi_ca_file = \"a\"\n"),
        7,
        "agent.api_cert_file",
        "api_key_file",
    );
    fails(
        &agent("api_key_file = \"k\"\n"),
        7,
        "agent.api_key_file",
        "api_cert_file",
    );
    fails(
        &agent("api_cert_file = \"c\"\napi_key_file = \"k\"\n"),
        7,
        "agent.api_cert_file",
        "api_ca_file",
    );
    fails(
        &agent("api_cert_file = \"c\"\napi_key_file = \"k\"\napi_ca_file = \"a\"\napi_url = \"http://db1:8008\"\n"),
        10,
        "agent.api_url",
        "https://",
    );
    fails(
        &agent("api_url = \"https://db1:8008\"\n"),
        7,
        "agent.api_url",
        "http://",
    );
}

#[test]
fn etcd_tls_and_authentication() {
    let etcd = |extra: &str| {
        AGENT_MINIMAL.replace(
            "cluster = \"demo\"\n",
            &format!("cluster = \"demo\"\n{extra}"),
        )
    };
    let c = parse(
        &etcd("ca_file = \"etcd/ca.pem\"\ncert_file = \"etcd/n1.crt\"\nkey_file = \"etcd/n1.key\"\nusername = \"pgwarden\"\npassword_file = \"etcd/password\"\n"),
        FILE,
    )
    .unwrap();
    let e = c.etcd.unwrap();
    assert!(e.tls());
    assert_eq!(
        e.ca_file.as_deref(),
        Some(std::path::Path::new("etcd/ca.pem"))
    );
    assert_eq!(
        e.cert_file.as_deref(),
        Some(std::path::Path::new("etcd/n1.crt"))
    );
    assert_eq!(
        e.key_file.as_deref(),
        Some(std::path::Path::new("etcd/n1.key"))
    );
    assert_eq!(e.username.as_deref(), Some("pgwarden"));
    assert_eq!(
        e.password_file.as_deref(),
        Some(std::path::Path::new("etcd/password"))
    );
    let e = parse(AGENT_MINIMAL, FILE).unwrap().etcd.unwrap();
    assert!(!e.tls() && e.username.is_none() && e.cert_file.is_none());

    fails(
        &etcd("cert_file = \"c\"\nca_file = \"a\"\n"),
        11,
        "etcd.cert_file",
        "key_file",
    );
    fails(
        &etcd("key_file = \"k\"\nca_file = \"a\"\n"),
        11,
        "etcd.key_file",
        "cert_file",
    );
    fails(
        &etcd("cert_file = \"c\"\nkey_file = \"k\"\n"),
        11,
        "etcd.cert_file",
        "ca_file",
    );
    fails(
        &etcd("ca_file = \"a\"\n").replace("\"127.0.0.1:2379\"", "\"http://127.0.0.1:2379\""),
        9,
        "etcd.endpoints",
        "plain http",
    );
    fails(
        &AGENT_MINIMAL.replace("\"127.0.0.1:2379\"", "\"https://127.0.0.1:2379\""),
        9,
        "etcd.endpoints",
        "ca_file",
    );
    fails(&etcd("password = \"p\"\n"), 11, "etcd.password", "username");
    fails(
        &etcd("password_file = \"p\"\n"),
        11,
        "etcd.password_file",
        "username",
    );
    fails(&etcd("username = \"u\"\n"), 11, "etcd.username", "password");
    fails(
        &etcd("username = \"u\"\npassword = \"p\"\npassword_file = \"f\"\n"),
        13,
        "etcd.password_file",
        "keep only one",
    );
    fails(
        &etcd("username = \"u\"\npassword = \"\"\n"),
        12,
        "etcd.password",
        "empty",
    );
    fails(&etcd("ca_file = \"\"\n"), 11, "ca_file", "");
}

#[test]
fn agent_and_etcd_come_together() {
    let no_etcd = AGENT_MINIMAL.replace(
        "[etcd]\nendpoints = [\"127.0.0.1:2379\"]\ncluster = \"demo\"\n",
        "",
    );
    let err = parse(&no_etcd, FILE).unwrap_err();
    assert_eq!(err.key(), Some("etcd"), "{err}");
    let no_agent = format!(
        "{}\n[etcd]\nendpoints = [\"127.0.0.1:2379\"]\ncluster = \"demo\"\n",
        MINIMAL
    );
    let err = parse(&no_agent, FILE).unwrap_err();
    assert_eq!(err.key(), Some("agent"), "{err}");
    fails(
        &AGENT_MINIMAL.replace("name = \"n1\"", "name = \"n 1\""),
        2,
        "agent.name",
        "invalid member name",
    );
    fails(
        &AGENT_MINIMAL.replace("cluster = \"demo\"", "cluster = \"a/b\""),
        10,
        "etcd.cluster",
        "invalid cluster name",
    );
    fails(
        &AGENT_MINIMAL.replace("endpoints = [\"127.0.0.1:2379\"]", "endpoints = []"),
        9,
        "etcd.endpoints",
        "is empty",
    );
    fails(
        &AGENT_MINIMAL.replace("api = \"127.0.0.1:8008\"", "api = \"localhost:8008\""),
        5,
        "api",
        "invalid listen address",
    );
    fails(
        &AGENT_MINIMAL.replace("rto = \"fast\"", "rto = \"fast\"\nbogus = 1"),
        7,
        "bogus",
        "unknown field",
    );
}

/// `client_ca` is a path like the other TLS files, and needs the TLS
/// termination it takes part in.
#[test]
fn client_ca_needs_tls_towards_clients() {
    let base =
        "[cluster]\nhosts = [\"127.0.0.1:5432\"]\n\n[listen]\nread_write = \"127.0.0.1:6432\"\n";
    let c = pgwarden_config::parse(base, "pgwarden.toml").expect("parses");
    assert_eq!(c.tls.client_ca, None);
    let with = format!(
        "{base}\n[tls]\ncert = \"server.crt\"\nkey = \"server.key\"\nclient_ca = \"clients-ca.pem\"\n"
    );
    let c = pgwarden_config::parse(&with, "pgwarden.toml").expect("parses");
    assert_eq!(
        c.tls.client_ca.as_deref(),
        Some(std::path::Path::new("clients-ca.pem"))
    );
    assert_eq!(c.tls.client_tls, pgwarden_config::ClientTls::Allow);
    let err = pgwarden_config::parse(
        &format!("{base}\n[tls]\nclient_ca = \"clients-ca.pem\"\n"),
        "pgwarden.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("pgwarden.toml:8: tls.client_ca: ") && err.contains("tls.cert and tls.key"),
        "{err}"
    );
    let err = pgwarden_config::parse(
        &with.replace("[tls]\n", "[tls]\nclient_tls = \"disable\"\n"),
        "pgwarden.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("pgwarden.toml:11: tls.client_ca: ") && err.contains("disable"),
        "{err}"
    );
}

#[test]
fn unix_socket_dir() {
    let c = parse(
        &with("[listen]\nunix_socket_dir = \"/run/pgwarden\"\n"),
        FILE,
    )
    .unwrap();
    assert_eq!(
        c.listen.unix_socket_dir.as_deref(),
        Some(std::path::Path::new("/run/pgwarden"))
    );
    assert_eq!(parse(MINIMAL, FILE).unwrap().listen.unix_socket_dir, None);
    fails(
        &with("[listen]\nunix_socket_dir = \"run/pgwarden\"\n"),
        4,
        "listen.unix_socket_dir",
        "must be an absolute path",
    );
    fails(
        &with(&format!(
            "[listen]\nunix_socket_dir = \"/{}\"\n",
            "d".repeat(100)
        )),
        4,
        "listen.unix_socket_dir",
        "would exceed 107 bytes",
    );
}

#[test]
fn with_unix_sockets_two_services_may_not_share_a_port() {
    // Different addresses, so TCP has no clash; the sockets would.
    let text = MINIMAL
        .replace(
            "read_only = \"127.0.0.1:6433\"",
            "read_only = \"127.0.0.2:6432\"",
        )
        .replace(
            "[listen]\n",
            "[listen]\nunix_socket_dir = \"/run/pgwarden\"\n",
        );
    fails(
        &text,
        8,
        "listen.read_only",
        "also the port of listen.read_write",
    );
    // Without sockets the same addresses are fine, and HTTP's port never
    // gets a socket.
    let text = MINIMAL.replace(
        "read_only = \"127.0.0.1:6433\"",
        "read_only = \"127.0.0.2:6432\"",
    );
    assert!(parse(&text, FILE).is_ok());
    let text = MINIMAL
        .replace("http = \"127.0.0.1:6434\"", "http = \"127.0.0.2:6432\"")
        .replace(
            "[listen]\n",
            "[listen]\nunix_socket_dir = \"/run/pgwarden\"\n",
        );
    assert!(parse(&text, FILE).is_ok());
}

#[test]
fn listeners_may_not_overlap_the_agents_own_addresses() {
    let text = AGENT_MINIMAL.replace("http = \"127.0.0.1:6434\"", "http = \"0.0.0.0:8008\"");
    fails(
        &text,
        15,
        "listen.http",
        "overlaps agent.api (127.0.0.1:8008)",
    );
    let text = AGENT_MINIMAL.replace(
        "read_only = \"127.0.0.1:6433\"",
        "read_only = \"127.0.0.1:5432\"",
    );
    fails(&text, 14, "listen.read_only", "overlaps agent.pg_listen");
}

#[test]
fn wildcard_agent_addresses_are_advertised_at_the_connect_address() {
    let text = AGENT_MINIMAL.replace(
        "pg_listen = \"127.0.0.1:5432\"",
        "pg_listen = \"0.0.0.0:5432\"",
    );
    fails(&text, 4, "agent.pg_listen", "set agent.pg_connect_address");
    let text = text
        .replace(
            "pg_listen = \"0.0.0.0:5432\"",
            "pg_listen = \"0.0.0.0:5432\"\npg_connect_address = \"db1.example:5432\"",
        )
        .replace("api = \"127.0.0.1:8008\"", "api = \"0.0.0.0:8008\"")
        .replace("http = \"127.0.0.1:6434\"", "http = \"0.0.0.0:6434\"");
    let c = parse(&text, FILE).unwrap();
    let a = c.agent.unwrap();
    assert_eq!(a.api_url, "http://db1.example:8008");
    assert_eq!(
        a.advertised_proxy_url(c.listen.http),
        "http://db1.example:6434"
    );
    // A listener on one address is called there; an explicit URL wins.
    assert_eq!(
        a.advertised_proxy_url(sa("10.0.0.5:6434")),
        "http://10.0.0.5:6434"
    );
    let text = text.replace(
        "rto = \"fast\"",
        "rto = \"fast\"\nproxy_url = \"http://lb.example:6434/\"",
    );
    let a = parse(&text, FILE).unwrap().agent.unwrap();
    assert_eq!(
        a.advertised_proxy_url(sa("0.0.0.0:6434")),
        "http://lb.example:6434"
    );
    let text = text.replace("http://lb.example:6434/", "lb.example:6434");
    fails(&text, 8, "agent.proxy_url", "must start with http://");
}

/// TLS settings that need another key name the line they were set on.
#[test]
fn tls_modes_that_need_more_name_their_line() {
    fails(
        &with("[tls]\nclient_tls = \"require\"\n"),
        4,
        "tls.client_tls",
        "needs tls.cert and tls.key",
    );
    fails(
        &with("[tls]\n\nserver_tls = \"verify-full\"\n"),
        5,
        "tls.server_ca",
        "need the CA",
    );
}

#[test]
fn tcp_timings_take_postgresqls_names_and_zero_keeps_the_systems() {
    let c = parse(&with("[engine]\n"), FILE).unwrap();
    assert_eq!(c.engine.tcp, pgwarden_config::TcpTimings::default());
    let c = parse(
        &with(
            "[engine]\ntcp_keepalives_idle = \"60s\"\ntcp_keepalives_interval = \"10s\"\n\
             tcp_keepalives_count = 6\ntcp_user_timeout = \"30s\"\n",
        ),
        FILE,
    )
    .unwrap();
    assert_eq!(
        c.engine.tcp,
        pgwarden_config::TcpTimings {
            keepalives_idle: Some(Duration::from_secs(60)),
            keepalives_interval: Some(Duration::from_secs(10)),
            keepalives_count: Some(6),
            user_timeout: Some(Duration::from_secs(30)),
        }
    );
    let c = parse(
        &with(
            "[engine]\ntcp_keepalives_idle = 0\ntcp_keepalives_count = 0\ntcp_user_timeout = \"0s\"\n",
        ),
        FILE,
    )
    .unwrap();
    assert_eq!(c.engine.tcp, pgwarden_config::TcpTimings::default());
    fails(
        &with("[engine]\ntcp_keepalives_idle = \"1500ms\"\n"),
        4,
        "engine.tcp_keepalives_idle",
        "whole seconds",
    );
    // A bare integer counts milliseconds, as for every duration.
    fails(
        &with("[engine]\ntcp_keepalives_interval = 10\n"),
        4,
        "engine.tcp_keepalives_interval",
        "whole seconds",
    );
    fails(
        &with("[engine]\n\ntcp_keepalives_interval = \"10h\"\n"),
        5,
        "engine.tcp_keepalives_interval",
        "32767",
    );
    fails(
        &with("[engine]\ntcp_keepalives_count = 128\n"),
        4,
        "engine.tcp_keepalives_count",
        "out of range",
    );
    fails(
        &with("[engine]\ntcp_user_timeout = \"25d\"\n"),
        4,
        "engine.tcp_user_timeout",
        "too long",
    );
}
