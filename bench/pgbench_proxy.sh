#!/usr/bin/env bash
# Session-mode overhead: pgbench against one PostgreSQL 15 primary directly,
# through `pgwarden run` (read-write port) as a session relay and with session
# pooling (`reuse_session_servers`, the counterpart of PgBouncer's session
# mode), through HAProxy (mode tcp) and through PgBouncer (pool_mode=session),
# all on 127.0.0.1.
#
#   bench/pgbench_proxy.sh                 (DUR=10 R=1)
#   DUR=10 R=3 bench/pgbench_proxy.sh
#
# Env: DUR  seconds per pgbench run (default 10)
#      R    repetitions of the whole interleaved set; the table shows medians (default 1)
#      SCALE pgbench -i scale factor (default 10)
#
# Workloads (each row runs direct, pgwarden, pgwarden-pool, haproxy, pgbouncer
# one after the other, then the next row; the whole set is repeated R times):
#   -S -M simple   at 1, 16, 64 clients
#   -S -M prepared at 1, 16, 64 clients
#   -S -C          at 16 clients (a new connection per transaction)
# All with -j min(2, clients), -n, -T DUR. TPS is pgbench's "without initial
# connection time" figure, or with -C the "including reconnection times" one.
# Proxy CPU is utime+stime of the proxy process (all threads) from
# /proc/PID/stat, sampled right before and after the pgbench run, shown as CPU
# ms per 1,000 transactions.
#
# PostgreSQL's max_connections is raised to 300 (ALTER SYSTEM + pg_ctl
# restart): pgwarden-pool keeps up to 64 idle server connections between runs.
#
# Needs root (apt-get, and the proxies run as the postgres user).
set -euo pipefail
cd "$(dirname "$0")/.."

DUR=${DUR:-10}
R=${R:-1}
SCALE=${SCALE:-10}
# shellcheck source=bench/lib.sh
. bench/lib.sh

bench_deps pgbench:postgresql-client-15 pgbouncer:pgbouncer haproxy:haproxy
bench_build

# --- temp dir, processes, cleanup -------------------------------------------
bench_tmpdir pgbench-proxy
demo="" pgw="" pgp="" hap="" pgb="" datadir=""
CLEANUP_STOPS=(pgb:INT hap:TERM pgp:INT pgw:INT demo:INT)
CLEANUP_LOGS=(demo.log pgwarden.log pgwarden-pool.log haproxy.log pgb/pgbouncer.log pgb/postgres.log)
bench_traps

read -r PG_PORT RW_PORT RO_PORT HTTP_PORT HAP_PORT PGB_PORT PP_RW PP_RO PP_HTTP < <(free_ports 9)

# --- PostgreSQL --------------------------------------------------------------
start_demo "$PG_PORT" "$tmp/demo"
raise_max_connections "$PG_PORT" 300
max_conn=$(psql -h $HOST -p "$PG_PORT" -U postgres -Atqc 'show max_connections')
log "pgbench -i -s $SCALE (max_connections=$max_conn)"
pgbench -i -q -s "$SCALE" -h $HOST -p "$PG_PORT" -U postgres postgres >"$tmp/init.log" 2>&1

# --- pgwarden ----------------------------------------------------------------
cat >"$tmp/pgwarden.toml" <<EOF
[cluster]
hosts = ["$HOST:$PG_PORT"]
user = "postgres"
# pgbench, the proxies and PostgreSQL oversubscribe the cores many times;
# an idle connection's query then waits up to a second or two for CPU, and
# the default 2 s would mark the only host down mid-run.
query_timeout = "10s"
connect_timeout = "10s"
[listen]
read_write = "$HOST:$RW_PORT"
read_only = "$HOST:$RO_PORT"
http = "$HOST:$HTTP_PORT"
EOF
RUST_LOG=warn "$bin" run --config "$tmp/pgwarden.toml" >"$tmp/pgwarden.log" 2>&1 &
pgw=$!
# Session pooling: server connections reset with DISCARD ALL and reused.
cat >"$tmp/pgwarden-pool.toml" <<EOF
[cluster]
hosts = ["$HOST:$PG_PORT"]
user = "postgres"
# pgbench, the proxies and PostgreSQL oversubscribe the cores many times;
# an idle connection's query then waits up to a second or two for CPU, and
# the default 2 s would mark the only host down mid-run.
query_timeout = "10s"
connect_timeout = "10s"
[listen]
read_write = "$HOST:$PP_RW"
read_only = "$HOST:$PP_RO"
http = "$HOST:$PP_HTTP"
[pool]
reuse_session_servers = true
size = 100
EOF
RUST_LOG=warn "$bin" run --config "$tmp/pgwarden-pool.toml" >"$tmp/pgwarden-pool.log" 2>&1 &
pgp=$!

# --- HAProxy: plain TCP relay -------------------------------------------------
cat >"$tmp/haproxy.cfg" <<EOF
global
    maxconn 4000
defaults
    mode tcp
    timeout connect 5s
    timeout client 1h
    timeout server 1h
listen pg
    bind $HOST:$HAP_PORT
    server pg1 $HOST:$PG_PORT
EOF
# setpriv execs (no fork), so \$! is the proxy's own PID.
setpriv --reuid postgres --regid postgres --init-groups \
  haproxy -db -q -f "$tmp/haproxy.cfg" >"$tmp/haproxy.log" 2>&1 &
hap=$!

# --- PgBouncer: session mode --------------------------------------------------
echo '"postgres" ""' >"$tmp/pgb/userlist.txt"
start_pgbouncer "$PGB_PORT" "auth_type = trust
admin_users = postgres
pool_mode = session
default_pool_size = 100
max_client_conn = 1000"

wait_sql "$RW_PORT" pgwarden
wait_sql "$PP_RW" pgwarden-pool
wait_sql "$HAP_PORT" HAProxy
wait_sql "$PGB_PORT" PgBouncer
for p in "$pgw" "$pgp" "$hap" "$pgb"; do kill -0 "$p" || { log "a proxy died"; exit 1; }; done

# --- runs ----------------------------------------------------------------------
targets=(direct pgwarden pgwarden-pool haproxy pgbouncer)
declare -A port=([direct]=$PG_PORT [pgwarden]=$RW_PORT [pgwarden-pool]=$PP_RW [haproxy]=$HAP_PORT [pgbouncer]=$PGB_PORT)
declare -A pid=([direct]="" [pgwarden]=$pgw [pgwarden-pool]=$pgp [haproxy]=$hap [pgbouncer]=$pgb)
workloads=(
  "-S -M simple -c 1"
  "-S -M simple -c 16"
  "-S -M simple -c 64"
  "-S -M prepared -c 1"
  "-S -M prepared -c 16"
  "-S -M prepared -c 64"
  "-S -C -c 16"
)
# Before each run, wait until the previous run's backends are gone (besides
# the up to 64 idle ones pgwarden-pool keeps), and make PgBouncer drop its
# idle server connections after its runs, so every PgBouncer run starts with
# a cold pool (pgwarden-pool's stays warm).

results=$tmp/results.tsv
: >"$results"
total=$((R * ${#workloads[@]} * ${#targets[@]}))
i=0
for rep in $(seq 1 "$R"); do
  for w in "${workloads[@]}"; do
    clients=${w##*-c }
    jobs=$((clients < 2 ? clients : 2))
    for t in "${targets[@]}"; do
      i=$((i + 1))
      settle "$PG_PORT" 68
      p=${pid[$t]}
      [ -n "$p" ] && { kill -0 "$p" || { log "$t died"; exit 1; }; c0=$(cpu "$p"); }
      # shellcheck disable=SC2086
      out=$(pgbench -n $w -j "$jobs" -T "$DUR" -h $HOST -p "${port[$t]}" -U postgres postgres 2>&1) \
        || { echo "$out" >&2; log "pgbench failed against $t"; exit 1; }
      [ -n "$p" ] && c1=$(cpu "$p")
      if [[ $w == *-C* ]]; then
        tps=$(awk '/^tps = .*including/ {print $3; exit}' <<<"$out")
      else
        tps=$(awk '/^tps = .*without/ {print $3; exit}' <<<"$out")
      fi
      [ -n "$tps" ] || tps=$(awk '/^tps = / {print $3; exit}' <<<"$out")
      lat=$(awk '/^latency average = / {print $4; exit}' <<<"$out")
      tx=$(awk -F': ' '/^number of transactions actually processed/ {print $2; exit}' <<<"$out")
      if [ -n "$p" ] && [ "${tx:-0}" -gt 0 ]; then
        cpuk=$(awk -v a="$c0" -v b="$c1" -v hz="$ticks" -v tx="$tx" 'BEGIN {printf "%.3f", (b - a) * 1000 / hz / tx * 1000}')
      else
        cpuk=-
      fi
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$w" "$t" "$rep" "$tps" "$lat" "$cpuk" "$tx" >>"$results"
      log "[$i/$total] rep $rep  pgbench $w  $t: tps=$tps lat=${lat}ms cpu/1k=$cpuk tx=$tx"
      if [ "$t" = pgbouncer ]; then
        psql -h $HOST -p "$PGB_PORT" -U postgres -d pgbouncer -qc 'KILL postgres' >/dev/null 2>&1 || true
        psql -h $HOST -p "$PGB_PORT" -U postgres -d pgbouncer -qc 'RESUME postgres' >/dev/null 2>&1 || true
      fi
    done
  done
done

# --- table (medians over R) -----------------------------------------------------
echo
echo "pgbench -T $DUR, -j min(2, clients), scale $SCALE, R=$R (median of $R); $(nproc) cores; $(date -u +%F)"
echo
python3 - "$results" <<'EOF'
import sys, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
order, data = [], {}
for w, t, rep, tps, lat, cpuk, tx in rows:
    if (w, t) not in data:
        order.append((w, t)); data[(w, t)] = []
    data[(w, t)].append((float(tps), float(lat), None if cpuk == "-" else float(cpuk)))
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
print("| workload | target | TPS | ratio to direct | avg latency ms | proxy CPU ms / 1k tx |")
print("|---|---|---:|---:|---:|---:|")
for w, t in order:
    v = data[(w, t)]
    tps, lat, cpu = med([x[0] for x in v]), med([x[1] for x in v]), med([x[2] for x in v])
    d = med([x[0] for x in data[(w, "direct")]])
    wl = "`" + w.replace("-c ", "-c") + "`"
    print(f"| {wl} | {t} | {tps:,.0f} | {tps / d:.2f}× | {lat:.3f} | {'—' if cpu is None else f'{cpu:.1f}'} |")
EOF
