# Shared by the bench/*.sh scripts: dependencies,
# release build, temporary directory, free ports, the demo primary, cleanup.
# Source it after `cd` to the repository root, with `set -euo pipefail`.
# Needs root (apt-get, and the proxies and PostgreSQL run as the postgres user).

HOST=127.0.0.1
PG_BIN=/usr/lib/postgresql/15/bin

log() { echo "[$(date +%T)] $*" >&2; }

# bench_deps [COMMAND:PACKAGE]...: installs PostgreSQL 15 (scripts/install-deps.sh)
# and the packages whose command is missing, without starting their services.
bench_deps() {
  scripts/install-deps.sh
  local need=() spec
  for spec in "$@"; do
    command -v "${spec%%:*}" >/dev/null || need+=("${spec#*:}")
  done
  [ ${#need[@]} -gt 0 ] || return 0
  log "installing: ${need[*]}"
  # Keep the packages' own services from starting (we run our own instances).
  local created_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    created_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  [ "$created_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

# Sets $bin.
bench_build() {
  log "building pgwarden (release)"
  cargo build --release --quiet
  bin=${CARGO_TARGET_DIR:-$PWD/target}/release/pgwarden
}

# bench_tmpdir PREFIX: sets $tmp (mode 755) with $tmp/pgb owned by postgres.
bench_tmpdir() {
  tmp=$(mktemp -d "/tmp/$1.XXXXXX")
  chmod 755 "$tmp"
  mkdir "$tmp/pgb"
  chown postgres: "$tmp/pgb"
}

as_postgres() { setpriv --reuid postgres --regid postgres --init-groups "$@"; }

stop() { # pid signal
  [ -n "$1" ] || return 0
  kill "-$2" "$1" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

# On exit: bench_cleanup_hook (if defined), then stop the processes named in
# CLEANUP_STOPS ("VARIABLE:SIGNAL", in order; the variable holds the PID at
# exit time), bench_cleanup_after (if defined), print the tails of CLEANUP_LOGS (relative to $tmp) on failure,
# remove $tmp.
CLEANUP_STOPS=()
CLEANUP_LOGS=()
cleanup() {
  local rc=$? s v f
  trap - EXIT INT TERM
  if declare -F bench_cleanup_hook >/dev/null; then bench_cleanup_hook || true; fi
  for s in "${CLEANUP_STOPS[@]}"; do
    v=${s%%:*}
    stop "${!v:-}" "${s#*:}"
  done
  if declare -F bench_cleanup_after >/dev/null; then bench_cleanup_after || true; fi
  # The demo stops PostgreSQL through its pidfile (also after a pg_ctl
  # restart); a script that set $datadir gets it stopped here in case the
  # demo died first.
  if [ -n "${datadir:-}" ] && [ -e "$datadir/postmaster.pid" ]; then
    as_postgres "$PG_BIN/pg_ctl" stop -D "$datadir" -m fast -w >/dev/null 2>&1 || true
  fi
  wait 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    for f in "${CLEANUP_LOGS[@]}"; do
      [ -s "$tmp/$f" ] && { echo "--- $f (tail)" >&2; tail -20 "$tmp/$f" >&2; }
    done
  fi
  [ -n "${tmp:-}" ] && rm -rf "$tmp"
  exit "$rc"
}
# raise_max_connections PORT N: ALTER SYSTEM and a pg_ctl restart of the
# demo's PostgreSQL on PORT (started with --dir, so the data directory stays
# until $tmp goes); sets $datadir.
raise_max_connections() {
  datadir=$(psql -h $HOST -p "$1" -U postgres -Atqc 'show data_directory')
  log "raising max_connections to $2 (pg_ctl restart of $datadir)"
  psql -h $HOST -p "$1" -U postgres -Atqc "alter system set max_connections = $2" >/dev/null
  if ! as_postgres "$PG_BIN/pg_ctl" restart -D "$datadir" -m fast -w -t 60 \
    -l "$tmp/pgb/postgres.log" >/dev/null 2>&1; then
    log "warning: pg_ctl restart failed"
  fi
  wait_sql "$1" PostgreSQL
}

bench_traps() {
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

# free_ports N: N distinct free TCP ports on 127.0.0.1, taken below the
# kernel's ephemeral range so that outgoing connections (ours or other jobs')
# cannot grab them between this check and the bind. The first one is meant
# for `pgwarden demo --port P`, whose own connection manager also listens on
# P+1000..P+1002: those are checked free and distinct from the others too.
free_ports() {
  python3 - "$1" <<'EOF'
import random, socket, sys
n = int(sys.argv[1])
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
def free(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
    finally:
        s.close()
while True:
    ports = []
    while len(ports) < n:
        p = random.randrange(max(1024, lo - 12000), lo - 1010)
        if p not in ports and free(p):
            ports.append(p)
    demo = [ports[0] + 1000 + i for i in range(3)]
    if not set(demo) & set(ports) and all(free(p) for p in demo):
        break
print(" ".join(map(str, ports)))
EOF
}

wait_sql() { # port what
  for _ in $(seq 1 300); do
    psql -h $HOST -p "$1" -U postgres -d postgres -Atqc 'select 1' >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  log "$2 on port $1 did not answer"
  return 1
}

# start_demo PORT [DIR]: one PostgreSQL 15 primary from `pgwarden demo`
# (its output in $tmp/demo.log); sets $demo. With DIR the data directories
# stay under DIR (removed with $tmp), else the demo removes its own.
start_demo() {
  log "starting PostgreSQL 15 (pgwarden demo) on $1"
  local dir=()
  [ -n "${2:-}" ] && dir=(--dir "$2")
  "$bin" demo --standalone --quiet --replicas 0 --port "$1" "${dir[@]}" >"$tmp/demo.log" 2>&1 &
  demo=$!
  for _ in $(seq 1 600); do
    psql -h $HOST -p "$1" -U postgres -d postgres -Atqc 'select 1' >/dev/null 2>&1 && return 0
    kill -0 "$demo" 2>/dev/null || { log "demo exited"; return 1; }
    sleep 0.2
  done
  log "PostgreSQL on port $1 did not answer"
  return 1
}

ticks=$(getconf CLK_TCK)
# utime + stime of a process (all threads), in clock ticks.
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# Resident set size in KiB.
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

# start_pgbouncer PORT LINES: PgBouncer (as the postgres user, no logging of
# connections) on PORT in front of PostgreSQL on $PG_PORT, with LINES (its
# pool mode, auth and limits) added to [pgbouncer]; the auth file
# $tmp/pgb/userlist.txt must exist. Sets $pgb to its PID: setpriv execs, so
# no subshell stands in between.
start_pgbouncer() {
  cat >"$tmp/pgb/pgbouncer.ini" <<EOF
[databases]
* = host=$HOST port=$PG_PORT
[pgbouncer]
listen_addr = $HOST
listen_port = $1
unix_socket_dir =
auth_file = $tmp/pgb/userlist.txt
logfile = $tmp/pgb/pgbouncer.log
pidfile = $tmp/pgb/pgbouncer.pid
log_connections = 0
log_disconnections = 0
$2
EOF
  chown -R postgres: "$tmp/pgb"
  setpriv --reuid postgres --regid postgres --init-groups pgbouncer "$tmp/pgb/pgbouncer.ini" >/dev/null 2>&1 &
  pgb=$!
}

# settle PORT MAX: wait until PostgreSQL has at most MAX client backends
# besides our own (the previous run's backends are gone).
settle() {
  local n
  for _ in $(seq 1 100); do
    n=$(psql -h $HOST -p "$1" -U postgres -Atqc \
      "select count(*) from pg_stat_activity where backend_type = 'client backend' and pid <> pg_backend_pid()")
    [ "$n" -le "$2" ] && return 0
    sleep 0.1
  done
  log "warning: $n client backends still connected"
}
