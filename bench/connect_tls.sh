#!/usr/bin/env bash
# Connection set-up rate with SCRAM-SHA-256 over TLS: pgbench -C (a new
# connection for every transaction) against one PostgreSQL 15 primary
# directly, through PgBouncer in transaction mode, through `pgwarden run` in
# session mode (with and without TLS to the server), and through pgwarden
# with [pool] mode = "transaction", all on 127.0.0.1.
#
#   bench/connect_tls.sh                   (DUR=10 R=3)
#   DUR=10 R=3 bench/connect_tls.sh
#
# Env: DUR   seconds per pgbench run (default 10)
#      R     repetitions of the interleaved set; the table shows medians (default 3)
#      POOL  server connections of the transaction pools (default 20)
#
# Every run is `pgbench -n -S -C -c 16 -j 2 -T DUR` as the role `bench`
# (SCRAM verifier, password in PGPASSWORD) with sslmode=require:
#   direct    PostgreSQL terminates TLS (ssl = on, a self-signed RSA 2048
#             certificate) and runs SCRAM (`host all bench 127.0.0.1/32
#             scram-sha-256` first in its pg_hba.conf);
#   pgbouncer PgBouncer (Debian's package) terminates TLS
#             (client_tls_sslmode = require, same certificate) and runs SCRAM
#             with bench's verifier copied from pg_authid into its auth_file,
#             pool_mode = transaction, default_pool_size = POOL; it logs in
#             to the server with SCRAM too (the verifiers are identical), over
#             plain TCP;
#   session   pgwarden terminates TLS ([tls] client_tls = "require", same
#             certificate) and runs SCRAM itself ([auth], pg_hba.conf
#             `hostssl all all 127.0.0.1/32 scram-sha-256`), then opens a
#             server connection per client and logs in to it with SCRAM as
#             `bench` (with the key the client proved) over plain TCP;
#   session-tls  the same with server_tls = "require": the server leg is
#             TLS as well, so PostgreSQL does the handshake it does direct;
#   pooled    pgwarden as in `session` with [pool] mode = "transaction":
#             server connections are reused, so PostgreSQL forks no backend
#             per client; the fair comparison for PgBouncer.
# The targets run one after the other and the set is repeated R times.
#
# TPS with -C is the connection rate (pgbench's "including reconnection
# times" figure). CPU columns are ms per 1,000 connections, from /proc:
# the proxy's process (all threads); PostgreSQL's postmaster with its
# children (live ones from /proc/PID/stat, exited backends through the
# postmaster's cutime/cstime); pgbench itself (the shell's children times),
# which pays for the client's PBKDF2 (4096 iterations) and TLS handshakes.
# Client, proxy and server share the machine's cores.
#
# Needs root (apt-get, and PostgreSQL runs as the postgres user).
set -euo pipefail
cd "$(dirname "$0")/.."

DUR=${DUR:-10}
R=${R:-3}
POOL=${POOL:-20}
CLIENTS=16
# shellcheck source=bench/lib.sh
. bench/lib.sh

bench_deps pgbench:postgresql-client-15 openssl:openssl pgbouncer:pgbouncer
bench_build

# --- temp dir, processes, cleanup -------------------------------------------
bench_tmpdir connect-tls
demo="" pgw_session="" pgw_stls="" pgw_pooled="" pgb="" datadir=""
CLEANUP_STOPS=(pgw_session:INT pgw_stls:INT pgw_pooled:INT pgb:INT demo:INT)
CLEANUP_LOGS=(demo.log pgwarden-session.log pgwarden-session-tls.log pgwarden-pooled.log pgb/pgbouncer.log)
bench_traps

read -r PG_PORT S_RW S_RO S_HTTP T_RW T_RO T_HTTP P_RW P_RO P_HTTP PGB_PORT < <(free_ports 11)
log "ports: postgres $PG_PORT, pgwarden session $S_RW, session with server TLS $T_RW, pooled $P_RW, pgbouncer $PGB_PORT"
load_start=$(cut -d' ' -f1-3 /proc/loadavg)

# A random password: it only has to be the same on both sides.
password=$(openssl rand -hex 16)

# --- certificate ---------------------------------------------------------------
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=localhost \
  -keyout "$tmp/pgb/server.key" -out "$tmp/pgb/server.crt" >/dev/null 2>&1
chown postgres: "$tmp/pgb/server.key" "$tmp/pgb/server.crt"
chmod 600 "$tmp/pgb/server.key"

# --- PostgreSQL: TLS, SCRAM, the role and pgbench's tables --------------------------
start_demo "$PG_PORT" "$tmp/demo"
sql() { psql -h $HOST -p "$PG_PORT" -U postgres -d postgres -Atqc "$1"; }
datadir=$(sql 'show data_directory')
hba=$(sql 'show hba_file')
# First line, so it wins over the demo's own lines; `host` (not `hostssl`)
# so that the proxies' plain-TCP server logins run SCRAM as well.
{ echo "host all bench 127.0.0.1/32 scram-sha-256"; cat "$hba"; } >"$tmp/hba.new"
cat "$tmp/hba.new" >"$hba"
sql "alter system set ssl_cert_file = '$tmp/pgb/server.crt'" >/dev/null
sql "alter system set ssl_key_file = '$tmp/pgb/server.key'" >/dev/null
sql "alter system set ssl = on" >/dev/null
sql "alter system set password_encryption = 'scram-sha-256'" >/dev/null
sql "select pg_reload_conf()" >/dev/null
sleep 1
[ "$(sql 'show ssl')" = on ] || { log "PostgreSQL did not turn ssl on"; exit 1; }
sql "set password_encryption = 'scram-sha-256'; create role bench login password '$password'" >/dev/null
log "pgbench -i -s 1"
pgbench -i -q -s 1 -h $HOST -p "$PG_PORT" -U postgres postgres >"$tmp/init.log" 2>&1
sql "grant select on pgbench_accounts, pgbench_branches to bench" >/dev/null
pm=$(head -1 "$datadir/postmaster.pid")

# --- pgwarden: session and transaction pooling -----------------------------------------
echo "hostssl all all 127.0.0.1/32 scram-sha-256" >"$tmp/pg_hba.conf"
pgwarden_config() { # rw ro http [pool section]
  cat <<EOF
[cluster]
hosts = ["$HOST:$PG_PORT"]
user = "postgres"
[listen]
read_write = "$HOST:$1"
read_only = "$HOST:$2"
http = "$HOST:$3"
[tls]
cert = "pgb/server.crt"
key = "pgb/server.key"
client_tls = "require"
[auth]
hba_file = "pg_hba.conf"
auth_user = "postgres"
${4:-}
EOF
}
pgwarden_config "$S_RW" "$S_RO" "$S_HTTP" >"$tmp/session.toml"
pgwarden_config "$T_RW" "$T_RO" "$T_HTTP" >"$tmp/session-tls.toml"
# server_tls belongs to the [tls] table, which is not the file's last.
sed -i 's/^client_tls = "require"$/client_tls = "require"\nserver_tls = "require"/' "$tmp/session-tls.toml"
grep -q '^server_tls = "require"$' "$tmp/session-tls.toml" || { log "server_tls not set"; exit 1; }
pgwarden_config "$P_RW" "$P_RO" "$P_HTTP" "$(printf '[pool]\nmode = "transaction"\nsize = %s' "$POOL")" >"$tmp/pooled.toml"
# The auth user logs in through the demo's trust lines; the variable is set
# anyway, as a deployment would.
PGWARDEN_AUTH_PASSWORD=unused RUST_LOG=warn "$bin" run --config "$tmp/session.toml" >"$tmp/pgwarden-session.log" 2>&1 &
pgw_session=$!
PGWARDEN_AUTH_PASSWORD=unused RUST_LOG=warn "$bin" run --config "$tmp/session-tls.toml" >"$tmp/pgwarden-session-tls.log" 2>&1 &
pgw_stls=$!
PGWARDEN_AUTH_PASSWORD=unused RUST_LOG=warn "$bin" run --config "$tmp/pooled.toml" >"$tmp/pgwarden-pooled.log" 2>&1 &
pgw_pooled=$!

# --- PgBouncer: TLS to clients, SCRAM with the server's own verifier ---------------
# Identical verifiers let PgBouncer log in to the server with the key the
# client proved, as pgwarden does.
secret=$(sql "select rolpassword from pg_authid where rolname = 'bench'")
case $secret in SCRAM-SHA-256*) ;; *) log "bench has no SCRAM verifier"; exit 1 ;; esac
printf '"bench" "%s"\n' "$secret" >"$tmp/pgb/userlist.txt"
start_pgbouncer "$PGB_PORT" "auth_type = scram-sha-256
client_tls_sslmode = require
client_tls_cert_file = $tmp/pgb/server.crt
client_tls_key_file = $tmp/pgb/server.key
pool_mode = transaction
default_pool_size = $POOL
max_client_conn = 1000"

targets=(direct pgbouncer session session-tls pooled)
declare -A port=([direct]=$PG_PORT [pgbouncer]=$PGB_PORT [session]=$S_RW [session-tls]=$T_RW [pooled]=$P_RW)
declare -A pid=([direct]="" [pgbouncer]=$pgb [session]=$pgw_session [session-tls]=$pgw_stls [pooled]=$pgw_pooled)

# --- sanity: every target insists on TLS and on the password ----------------------------
conn() { # port sslmode
  echo "host=$HOST port=$1 user=bench dbname=postgres sslmode=$2 connect_timeout=10"
}
for t in "${targets[@]}"; do
  p=${port[$t]}
  for _ in $(seq 1 100); do
    PGPASSWORD=$password psql "$(conn "$p" require)" -Atqc 'select 1' >/dev/null 2>&1 && break
    sleep 0.2
  done
  got=$(PGPASSWORD=$password psql "$(conn "$p" require)" -Atqc \
    "select ssl from pg_stat_ssl where pid = pg_backend_pid()" 2>&1) ||
    { log "$t: login over TLS failed: $got"; exit 1; }
  if PGPASSWORD=wrong psql "$(conn "$p" require)" -Atqc 'select 1' >/dev/null 2>&1; then
    log "$t: a wrong password was accepted"
    exit 1
  fi
  # pg_stat_ssl shows the server leg: TLS direct and with server_tls, plain
  # TCP behind the other proxies, which must refuse a client without TLS.
  case $t in direct | session-tls) want=t ;; *) want=f ;; esac
  [ "$got" = "$want" ] || { log "$t: server leg TLS is '$got', expected '$want'"; exit 1; }
  if [ "$t" != direct ] && PGPASSWORD=$password psql "$(conn "$p" disable)" -Atqc 'select 1' >/dev/null 2>&1; then
    log "$t: a connection without TLS was accepted"
    exit 1
  fi
  log "$t: TLS and SCRAM enforced"
done

# --- CPU accounting -----------------------------------------------------------------
# PostgreSQL: the postmaster, its exited children and its live children.
server_cpu() {
  local total c
  total=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$pm/stat")
  for c in $(ps -o pid= --ppid "$pm"); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$c/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}
# The shell's children times (pgbench is the only child in between), in ms.
# `times` must run in this shell, not in a command substitution's subshell,
# which has no children of its own.
child_ms() {
  times >"$tmp/times"
  awk 'NR == 2 {
    split($1, u, /[ms]/); split($2, s, /[ms]/)
    printf "%d", (u[1] * 60 + u[2] + s[1] * 60 + s[2]) * 1000
  }' "$tmp/times"
}

per_k() { # milliseconds, per 1,000 of the run's connections ($tx)
  awk -v d="$1" -v tx="${tx:-0}" 'BEGIN { if (tx > 0) printf "%.1f", d / tx * 1000; else print "-" }'
}

# --- pgbench runs -----------------------------------------------------------------
results=$tmp/results.tsv
: >"$results"
total=$((R * ${#targets[@]}))
i=0
for rep in $(seq 1 "$R"); do
  for t in "${targets[@]}"; do
    i=$((i + 1))
    # Pooled server connections stay (two pools); the others are gone.
    settle "$PG_PORT" $((2 * POOL + 4))
    p=${pid[$t]}
    c0=""
    [ -n "$p" ] && { kill -0 "$p" || { log "$t died"; exit 1; }; c0=$(cpu "$p"); }
    s0=$(server_cpu)
    child_ms >"$tmp/b0"
    rc=0
    out=$(PGPASSWORD=$password PGSSLMODE=require timeout $((DUR + 60)) \
      pgbench -n -S -C -c $CLIENTS -j 2 -T "$DUR" -h $HOST -p "${port[$t]}" -U bench postgres 2>&1) || rc=$?
    child_ms >"$tmp/b1"
    b0=$(<"$tmp/b0") b1=$(<"$tmp/b1")
    s1=$(server_cpu)
    c1=""
    [ -n "$p" ] && c1=$(cpu "$p")
    tps=$(awk '/^tps = .*including/ {print $3; exit}' <<<"$out")
    [ -n "$tps" ] || tps=$(awk '/^tps = / {print $3; exit}' <<<"$out")
    lat=$(awk '/^latency average = / {print $4; exit}' <<<"$out")
    tx=$(awk -F': ' '/^number of transactions actually processed/ {print $2; exit}' <<<"$out")
    tx=${tx%%/*}
    failed=$(awk -F': ' '/^number of failed transactions/ {print $2 + 0; exit}' <<<"$out")
    pcpu=-
    [ -n "$c0" ] && pcpu=$(per_k "$(((c1 - c0) * 1000 / ticks))")
    scpu=$(per_k "$(((s1 - s0) * 1000 / ticks))")
    bcpu=$(per_k "$((b1 - b0))")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
      "$t" "$rep" "$rc" "${tps:-0}" "${lat:-0}" "${tx:-0}" "$pcpu" "$scpu" "$bcpu" >>"$results"
    extra=""
    if [ "$rc" -ne 0 ] || [ "${failed:-0}" -gt 0 ] || grep -qiE 'error|fatal|abort' <<<"$out"; then
      extra="  FAILED rc=$rc"
      grep -iE 'error|fatal|abort' <<<"$out" | sed -E 's/client [0-9]+/client N/g' | sort | uniq -c | sort -rn | head -3 >&2 || true
    fi
    log "[$i/$total] rep $rep  $t: conn/s=$tps lat=${lat}ms conns=$tx proxy=$pcpu server=$scpu pgbench=$bcpu (CPU ms/1k)$extra"
  done
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

# --- table (medians over R) ---------------------------------------------------------
echo
echo "pgbench -n -S -C -c $CLIENTS -j 2 -T $DUR, sslmode=require, SCRAM-SHA-256 (4096 iterations), RSA 2048," \
  "pool size $POOL, R=$R (median of $R); $(nproc) cores; load average $load_start at start, $load_end at end;" \
  "$(date -u '+%F %H:%M UTC')"
echo
python3 - "$results" <<'EOF'
import sys, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
data = {}
for t, rep, rc, tps, lat, tx, pcpu, scpu, bcpu in rows:
    f = lambda x: None if x in ("", "-") else float(x)
    data.setdefault(t, []).append(dict(ok=rc == "0", tps=f(tps), lat=f(lat), p=f(pcpu), s=f(scpu), b=f(bcpu)))
def med(v, k):
    xs = [x[k] for x in v if x["ok"] and x[k] is not None]
    return statistics.median(xs) if xs else None
fmt = lambda x, s="{:.1f}": "—" if x is None else s.format(x)
names = {"direct": "direct to PostgreSQL", "pgbouncer": "PgBouncer, transaction pool",
         "session": "pgwarden, session", "session-tls": "pgwarden, session, TLS to the server",
         "pooled": "pgwarden, transaction pool"}
direct = med(data.get("direct", []), "tps")
print("| target | connections/s (median) | per run | × direct | avg latency ms | proxy CPU ms / 1k conn | PostgreSQL CPU ms / 1k conn | pgbench CPU ms / 1k conn |")
print("|---|---:|---|---:|---:|---:|---:|---:|")
for t in ("direct", "pgbouncer", "session", "session-tls", "pooled"):
    v = data.get(t, [])
    runs = " / ".join(f"{x['tps']:,.0f}" + ("" if x["ok"] else "✗") for x in v)
    tps = med(v, "tps")
    ratio = fmt(tps / direct, "{:.2f}×") if tps and direct else "—"
    print(f"| {names[t]} | {fmt(tps, '{:,.0f}')} | {runs} | {ratio} | {fmt(med(v, 'lat'), '{:.2f}')} "
          f"| {fmt(med(v, 'p'))} | {fmt(med(v, 's'))} | {fmt(med(v, 'b'))} |")
pgb_tps = med(data.get("pgbouncer", []), "tps")
pooled = med(data.get("pooled", []), "tps")
if pgb_tps and pooled:
    print(f"\npgwarden's transaction pool / PgBouncer: {pooled / pgb_tps:.2f}×")
EOF
for t in session session-tls pooled; do
  if grep -qE 'WARN|ERROR' "$tmp/pgwarden-$t.log"; then
    echo
    echo "pgwarden ($t) log lines (RUST_LOG=warn), first 10:"
    grep -E 'WARN|ERROR' "$tmp/pgwarden-$t.log" | head -10 | sed -E 's/\x1b\[[0-9;]*m//g; s/^/    /'
  fi
done
