#!/usr/bin/env bash
# Soak: no false failover under load. Runs the HA demo (etcd and three
# agents) with a tight recovery target, saturates both cores with a CPU hog
# and pgbench through a read-write port for DURATION seconds, then counts
# the promotions the cluster recorded. Every one of them would be a false
# failover: nothing failed.
#
#   DURATION=1800 RTO=8 bench/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh

DURATION=${DURATION:-1800}
RTO=${RTO:-8}
CLIENTS=${CLIENTS:-8}

bench_deps
bench_build
bench_tmpdir pgwarden-soak
demo="" hog1="" hog2=""
CLEANUP_STOPS=(hog1:KILL hog2:KILL demo:INT)
CLEANUP_LOGS=(demo.log)
bench_traps

read -r PORT < <(free_ports 1)
API=http://$HOST:8008
RW_PORT=$((PORT + 1000))
log "HA demo: rto = $RTO, PostgreSQL on $PORT.., read-write port $RW_PORT, API $API"
"$bin" demo --quiet --rto "$RTO" --port "$PORT" --dir "$tmp/demo" >"$tmp/demo.log" 2>&1 &
demo=$!
for _ in $(seq 1 600); do
  kill -0 "$demo" 2>/dev/null || { log "demo exited"; exit 1; }
  n=$( (curl -s "$API/cluster" || true) | python3 -c 'import json,sys
try: print(sum(1 for m in json.load(sys.stdin)["members"] if m["state"] == "running"))
except Exception: print(0)')
  [ "$n" = 3 ] && break
  sleep 0.5
done
[ "$n" = 3 ] || { log "cluster not ready"; exit 1; }
conn="host=$HOST port=$RW_PORT user=postgres dbname=postgres"
pgbench -i -q -s 10 "$conn" >/dev/null 2>&1
leader_before=$(curl -s "$API/cluster" | python3 -c 'import json,sys; print(json.load(sys.stdin)["leader"])')
log "leader $leader_before; CPU hog on both cores and pgbench -c $CLIENTS for ${DURATION}s"
(while :; do :; done) & hog1=$!
(while :; do :; done) & hog2=$!
start=$(date +%s)
pgbench -n -c "$CLIENTS" -j 2 -T "$DURATION" -P 300 "$conn" >"$tmp/pgbench.out" 2>&1 || true
end=$(date +%s)
stop "$hog1" KILL; hog1=""
stop "$hog2" KILL; hog2=""
leader_after=$(curl -s "$API/cluster" | python3 -c 'import json,sys; print(json.load(sys.stdin)["leader"])')
promotions=$(curl -s "$API/history" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')
tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$tmp/pgbench.out" | head -1)
failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$tmp/pgbench.out")
echo
echo "| rto | duration | load | leader before / after | promotions (false failovers) | pgbench tps | failed tx |"
echo "|---|---|---|---|---|---|---|"
echo "| $RTO s | $((end - start)) s | 2 busy loops + pgbench -c $CLIENTS | $leader_before / $leader_after | $promotions | ${tps:-?} | ${failed:-?} |"
