#!/usr/bin/env bash
# Transaction pooling: pgbench against one PostgreSQL 15 primary directly,
# through PgBouncer (pool_mode=transaction) and through `pgwarden run` with
# [pool] mode = "transaction" (read-write port), all on 127.0.0.1; plus the
# memory each proxy needs per idle client connection.
#
#   bench/pgbench_pool.sh                  (DUR=10 R=3)
#   DUR=10 R=3 bench/pgbench_pool.sh
#
# Env: DUR    seconds per pgbench run (default 10)
#      R      repetitions of the whole interleaved set; the table shows medians (default 3)
#      SCALE  pgbench -i scale factor (default 10)
#      POOL   server connections per pool, both proxies (default 20)
#      IDLE   idle client connections for the memory test (default 5000; 0 skips it)
#      SAMPLE pgbench --sampling-rate of the per-transaction logs used for p50/p99 (default 0.1)
#
# Workloads (each row runs direct, PgBouncer, pgwarden one after the other,
# then the next row; the whole set is repeated R times):
#   -S -M simple   at 16, 64, 256 clients
#   -S -M prepared at 64 clients
#   TPC-B (pgbench's default script) -M simple at 16 clients
#   -S -C          at 16 clients (a new connection per transaction)
# All with -n -j 2 -T DUR. TPS is pgbench's "without initial connection time"
# figure, or with -C the "including reconnection times" one. p50/p99 come from
# pgbench's per-transaction log (--log, sampled at SAMPLE). Proxy CPU is
# utime+stime of the proxy process (all threads) from /proc/PID/stat, sampled
# right before and after the pgbench run, shown as CPU ms per 1,000
# transactions. Both proxies keep their (warm) pools across runs.
#
# PostgreSQL's max_connections is raised to 400 (ALTER SYSTEM + pg_ctl
# restart) so that 256 direct clients fit next to both idle pools.
#
# Memory: before the pgbench rows, IDLE client connections (each through
# startup to ReadyForQuery, then idle; bench/idle_clients.py) are opened to
# each proxy in turn; the proxy's VmRSS is read before, while they are held,
# and after they are closed.
#
# A pgbench run that fails (exit status != 0, aborted clients) does not stop
# the benchmark: the row is marked and the distinct error lines are printed
# after the table.
#
# Needs root (apt-get, and the proxies and PostgreSQL run as the postgres user).
set -euo pipefail
cd "$(dirname "$0")/.."

DUR=${DUR:-10}
R=${R:-3}
SCALE=${SCALE:-10}
POOL=${POOL:-20}
IDLE=${IDLE:-5000}
SAMPLE=${SAMPLE:-0.1}
MAX_CONN=400
# shellcheck source=bench/lib.sh
. bench/lib.sh

# Thousands of sockets: for the proxies (inherited) and the idle-client holder.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

bench_deps pgbench:postgresql-client-15 pgbouncer:pgbouncer
bench_build

# --- temp dir, processes, cleanup -------------------------------------------
bench_tmpdir pgbench-pool
demo="" pgw="" pgb="" holder="" datadir=""
bench_cleanup_hook() {
  exec 7>&- 2>/dev/null || true
  [ -n "$holder" ] && kill "$holder" 2>/dev/null
  return 0
}
CLEANUP_STOPS=(pgb:INT pgw:INT demo:INT)
CLEANUP_LOGS=(demo.log pgwarden.log pgb/pgbouncer.log pgb/postgres.log)
bench_traps

read -r PG_PORT RW_PORT RO_PORT HTTP_PORT PGB_PORT < <(free_ports 5)
log "ports: postgres $PG_PORT, pgwarden $RW_PORT (http $HTTP_PORT), pgbouncer $PGB_PORT; ulimit -n $(ulimit -n)"
load_start=$(cut -d' ' -f1-3 /proc/loadavg)

# --- PostgreSQL --------------------------------------------------------------
start_demo "$PG_PORT" "$tmp/demo"
raise_max_connections "$PG_PORT" "$MAX_CONN"
max_conn=$(psql -h $HOST -p "$PG_PORT" -U postgres -Atqc 'show max_connections')
log "pgbench -i -s $SCALE (max_connections=$max_conn)"
pgbench -i -q -s "$SCALE" -h $HOST -p "$PG_PORT" -U postgres postgres >"$tmp/init.log" 2>&1

# --- pgwarden: transaction pooling --------------------------------------------
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
[pool]
mode = "transaction"
size = $POOL
max_client_conn = 20000
EOF
RUST_LOG=warn "$bin" run --config "$tmp/pgwarden.toml" >"$tmp/pgwarden.log" 2>&1 &
pgw=$!

# --- PgBouncer: transaction mode ----------------------------------------------
pgb_version=$(pgbouncer --version | awk '/^PgBouncer/ {print $2; exit}')
# Protocol-level prepared statements in transaction mode came with 1.21.
if [ "$(printf '%s\n1.21\n' "$pgb_version" | sort -V | head -1)" = 1.21 ]; then
  pgb_prepared="max_prepared_statements = 200"
else
  pgb_prepared="; max_prepared_statements needs PgBouncer >= 1.21 (this is $pgb_version)"
fi
echo '"postgres" ""' >"$tmp/pgb/userlist.txt"
start_pgbouncer "$PGB_PORT" "auth_type = trust
admin_users = postgres
pool_mode = transaction
default_pool_size = $POOL
max_client_conn = 20000
$pgb_prepared"

wait_sql "$RW_PORT" pgwarden
wait_sql "$PGB_PORT" PgBouncer
for p in "$pgw" "$pgb"; do kill -0 "$p" || { log "a proxy died"; exit 1; }; done

targets=(direct pgbouncer pgwarden)
declare -A port=([direct]=$PG_PORT [pgwarden]=$RW_PORT [pgbouncer]=$PGB_PORT)
declare -A pid=([direct]="" [pgwarden]=$pgw [pgbouncer]=$pgb)
backends() {
  psql -h $HOST -p "$PG_PORT" -U postgres -Atqc \
    "select count(*) from pg_stat_activity where backend_type = 'client backend' and pid <> pg_backend_pid()"
}
pool_metrics() {
  curl -fsS "http://$HOST:$HTTP_PORT/metrics" 2>/dev/null |
    grep -E '^pgwarden_pool_(clients_waiting|servers_open|transactions_total|wait_max_seconds)' |
    sed -E 's/\{[^}]*\}//' | awk '{printf "%s=%s ", substr($1, 15), $2}'
}
warn_lines=0
pgwarden_warnings() { # new lines in pgwarden's log since the last call
  local n
  n=$(wc -l <"$tmp/pgwarden.log")
  [ "$n" -gt "$warn_lines" ] && sed -n "$((warn_lines + 1)),${n}p" "$tmp/pgwarden.log"
  warn_lines=$n
  return 0
}

# --- memory per idle client ----------------------------------------------------
mem=$tmp/memory.tsv
: >"$mem"
idle_test() { # target
  local t=$1 p=${pid[$1]} before after closed line="" srv
  psql -h $HOST -p "${port[$t]}" -U postgres -d postgres -Atqc 'select 1' >/dev/null
  sleep 1
  before=$(rss_kib "$p")
  rm -f "$tmp/holder.in" "$tmp/holder.out"
  mkfifo "$tmp/holder.in"
  python3 bench/idle_clients.py $HOST "${port[$t]}" "$IDLE" <"$tmp/holder.in" >"$tmp/holder.out" 2>"$tmp/holder.err" &
  holder=$!
  exec 7>"$tmp/holder.in"
  for _ in $(seq 1 1200); do
    [ -s "$tmp/holder.out" ] && break
    kill -0 "$holder" 2>/dev/null || break
    sleep 0.1
  done
  line=$(head -1 "$tmp/holder.out" 2>/dev/null || true)
  [ -n "$line" ] || line="holder gave no result: $(tail -3 "$tmp/holder.err" 2>/dev/null | tr '\n' ' ')"
  sleep 2
  after=$(rss_kib "$p")
  srv=$(backends)
  exec 7>&-
  wait "$holder" 2>/dev/null || true
  holder=""
  sleep 2
  closed=$(rss_kib "$p")
  printf '%s\t%s\t%s\t%s\t%s\n' "$t" "$before" "$after" "$closed" "$line" >>"$mem"
  log "idle $IDLE -> $t: RSS ${before} -> ${after} -> ${closed} KiB (held, closed); PostgreSQL backends while held: $srv; $line"
}
if [ "$IDLE" -gt 0 ]; then
  for t in pgbouncer pgwarden; do idle_test "$t"; done
  pgwarden_warnings >"$tmp/warn-idle.txt"
fi

# --- pgbench runs -----------------------------------------------------------------
workloads=(
  "-S -M simple -c 16"
  "-S -M simple -c 64"
  "-S -M simple -c 256"
  "-S -M prepared -c 64"
  "-M simple -c 16"
  "-S -C -c 16"
)
results=$tmp/results.tsv
errors=$tmp/errors.tsv
: >"$results"
: >"$errors"
mkdir "$tmp/lat"
total=$((R * ${#workloads[@]} * ${#targets[@]}))
i=0
for rep in $(seq 1 "$R"); do
  for w in "${workloads[@]}"; do
    clients=${w##*-c }
    for t in "${targets[@]}"; do
      i=$((i + 1))
      if [ "$t" = direct ] && [ $((clients + 2 * POOL + 10)) -gt "$max_conn" ]; then
        printf '%s\t%s\t%s\tna\t\t\t\t\t\t\t0\n' "$w" "$t" "$rep" >>"$results"
        log "[$i/$total] rep $rep  pgbench $w  $t: skipped (max_connections=$max_conn)"
        continue
      fi
      # The previous run's direct backends are gone; the proxies' pools stay.
      settle "$PG_PORT" $((2 * POOL + 6))
      p=${pid[$t]}
      [ -n "$p" ] && { kill -0 "$p" || { log "$t died"; exit 1; }; c0=$(cpu "$p"); }
      rm -f "$tmp"/lat/*
      rc=0
      # shellcheck disable=SC2086
      out=$(cd "$tmp/lat" && timeout $((DUR + 60)) pgbench -n $w -j 2 -T "$DUR" \
        --log --sampling-rate "$SAMPLE" --log-prefix "$tmp/lat/tx" \
        -h $HOST -p "${port[$t]}" -U postgres postgres 2>&1) || rc=$?
      [ -n "$p" ] && c1=$(cpu "$p")
      if [[ $w == *-C* ]]; then
        tps=$(awk '/^tps = .*including/ {print $3; exit}' <<<"$out")
      else
        tps=$(awk '/^tps = .*without/ {print $3; exit}' <<<"$out")
      fi
      [ -n "$tps" ] || tps=$(awk '/^tps = / {print $3; exit}' <<<"$out")
      lat=$(awk '/^latency average = / {print $4; exit}' <<<"$out")
      tx=$(awk -F': ' '/^number of transactions actually processed/ {print $2; exit}' <<<"$out")
      tx=${tx%%/*}
      aborted=$(grep -c 'aborted in command\|aborted while\|client .* aborted' <<<"$out" || true)
      read -r p50 p99 < <(python3 - "$tmp/lat" <<'EOF'
import os, sys
lat = []
for f in os.listdir(sys.argv[1]):
    for line in open(os.path.join(sys.argv[1], f)):
        parts = line.split()
        if len(parts) > 2 and parts[2].isdigit():
            lat.append(int(parts[2]))
lat.sort()
q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] / 1000
print(f"{q(0.5):.3f} {q(0.99):.3f}" if lat else "- -")
EOF
      )
      if [ -n "$p" ] && [ "${tx:-0}" -gt 0 ]; then
        cpuk=$(awk -v a="$c0" -v b="$c1" -v hz="$ticks" -v tx="$tx" 'BEGIN {printf "%.3f", (b - a) * 1000 / hz / tx * 1000}')
      else
        cpuk=-
      fi
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
        "$w" "$t" "$rep" "$rc" "${tps:-0}" "${lat:-0}" "$p50" "$p99" "$cpuk" "${tx:-0}" "$aborted" >>"$results"
      extra=""
      if [ "$rc" -ne 0 ] || [ "$aborted" -gt 0 ] || grep -qiE 'error|fatal' <<<"$out"; then
        extra="  FAILED rc=$rc aborted=$aborted"
        grep -iE 'error|fatal|abort' <<<"$out" | sed -E 's/client [0-9]+/client N/g' | sort | uniq -c | sort -rn | head -5 |
          while read -r line; do printf '%s\t%s\t%s\t%s\n' "$w" "$t" "$rep" "$line" >>"$errors"; done
      fi
      [ "$t" = pgwarden ] && extra="$extra  [$(pool_metrics)]"
      log "[$i/$total] rep $rep  pgbench $w  $t: tps=$tps lat=${lat}ms p50=$p50 p99=$p99 cpu/1k=$cpuk tx=$tx$extra"
      if [ "$t" = pgwarden ]; then
        pgwarden_warnings | sed "s|^|$w rep $rep: |" >>"$tmp/warn-runs.txt"
      fi
    done
  done
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

# --- tables (medians over R) -------------------------------------------------------
echo
echo "pgbench -n -T $DUR -j 2, scale $SCALE, pool size $POOL, R=$R (median of $R); $(nproc) cores;" \
  "PgBouncer $pgb_version; max_connections $max_conn; load average $load_start at start, $load_end at end; $(date -u '+%F %H:%M UTC')"
echo
python3 - "$results" <<'EOF'
import sys, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
order, data = [], {}
for w, t, rep, rc, tps, lat, p50, p99, cpuk, tx, aborted in rows:
    if (w, t) not in data:
        order.append((w, t)); data[(w, t)] = []
    if rc == "na":
        continue
    f = lambda x: None if x in ("", "-") else float(x)
    data[(w, t)].append(dict(rc=int(rc), tps=f(tps), lat=f(lat), p50=f(p50), p99=f(p99), cpu=f(cpuk), aborted=int(aborted)))
def med(key, v):
    xs = [x[key] for x in v if x[key] is not None]
    return statistics.median(xs) if xs else None
def ok(v):  # runs that completed without errors
    return [x for x in v if x["rc"] == 0 and x["aborted"] == 0]
def name(w):
    w = w.replace("-c ", "-c")
    return f"`{w}`" if "-S" in w else f"TPC-B `{w}`"
print("| workload | target | TPS (median) | TPS per run | × direct | pgwarden / PgBouncer | avg latency ms | p50 ms | p99 ms | proxy CPU ms / 1k tx |")
print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
fmt = lambda x, s="{:.2f}": "—" if x is None else s.format(x)
for w, t in order:
    v = data[(w, t)]
    if not v:
        print(f"| {name(w)} | {t} | N/A (max_connections) | | | | | | | |")
        continue
    good = ok(v)
    failed = len(v) - len(good)
    runs = " / ".join(f"{x['tps']:,.0f}" + ("✗" if x in v and x not in good else "") for x in v)
    if not good:
        print(f"| {name(w)} | {t} | **failed** ({failed}/{len(v)} runs) | {runs} | | | | | | |")
        continue
    tps = med("tps", good)
    d = ok(data.get((w, "direct"), []))
    ratio = fmt(tps / med("tps", d), "{:.2f}×") if d else "—"
    vs = "—"
    if t == "pgwarden":
        b = ok(data.get((w, "pgbouncer"), []))
        vs = f"**{tps / med('tps', b):.2f}×**" if b else "PgBouncer failed"
    note = f" ({failed} failed run{'s' if failed > 1 else ''})" if failed else ""
    print(f"| {name(w)} | {t} | {tps:,.0f}{note} | {runs} | {ratio} | {vs} | {fmt(med('lat', good), '{:.3f}')} "
          f"| {fmt(med('p50', good), '{:.3f}')} | {fmt(med('p99', good), '{:.3f}')} | {fmt(med('cpu', good), '{:.1f}')} |")
EOF
if [ -s "$mem" ]; then
  echo
  echo "Memory per idle client ($IDLE client connections through startup, then idle; VmRSS of the proxy):"
  echo
  python3 - "$mem" "$IDLE" <<'EOF'
import sys
n = int(sys.argv[2])
print("| proxy | RSS before | RSS with idle clients | KiB per idle client | RSS after they closed | clients |")
print("|---|---:|---:|---:|---:|---|")
for line in open(sys.argv[1]):
    t, before, after, closed, res = line.rstrip("\n").split("\t")
    b, a, c = int(before), int(after), int(closed)
    print(f"| {t} | {b:,} KiB | {a:,} KiB | **{(a - b) / n:.2f}** | {c:,} KiB | {res} |")
EOF
fi
if [ -s "$errors" ]; then
  echo
  echo "Errors seen (count, de-duplicated per run; client numbers replaced by N):"
  echo
  sed 's/^/    /' "$errors"
fi
if [ -s "$tmp/warn-idle.txt" ] || [ -s "$tmp/warn-runs.txt" ]; then
  echo
  echo "pgwarden log lines (RUST_LOG=warn), first 30:"
  echo
  # Either file may be missing (IDLE=0 skips the idle clients' run).
  { cat "$tmp/warn-idle.txt" 2>/dev/null || true; cat "$tmp/warn-runs.txt" 2>/dev/null || true; } |
    head -30 | sed -E 's/\x1b\[[0-9;]*m//g; s/^/    /'
fi
echo
echo "pgwarden pool metrics at the end: $(pool_metrics)"
