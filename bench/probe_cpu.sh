#!/usr/bin/env bash
# CPU cost of probing: a primary and 9 replicas (10 hosts) probed at the
# default 1 s interval by `pgwarden topology --watch`, measured from
# /proc/PID/stat (user + system time) over DURATION seconds after a warm-up.
#
#   bench/probe_cpu.sh [DURATION]      (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-60}
scripts/install-deps.sh
cargo build --release --quiet
bin=target/release/pgwarden
log=$(mktemp)
$bin demo --standalone --quiet --replicas 9 >"$log" 2>&1 &
demo=$!
cleanup() { kill -INT "$demo" 2>/dev/null || true; wait "$demo" 2>/dev/null || true; rm -f "$log"; }
trap cleanup EXIT
for _ in $(seq 1 600); do
  grep -q "topology --watch --hosts" "$log" && break
  kill -0 "$demo" 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.2
done
hosts=$(grep "topology --watch --hosts" "$log" | sed "s/.*--hosts //")
RUST_LOG=warn $bin topology --watch --hosts "$hosts" >/dev/null &
probe=$!
sleep 5
ticks=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
c0=$(cpu $probe); t0=$(date +%s.%N)
sleep "$duration"
c1=$(cpu $probe); t1=$(date +%s.%N)
rss=$(awk '/VmRSS/ {print $2}' /proc/$probe/status)
kill -INT $probe; wait $probe 2>/dev/null || true
awk -v c0="$c0" -v c1="$c1" -v t0="$t0" -v t1="$t1" -v hz="$ticks" -v rss="$rss" 'BEGIN {
  cpu = (c1 - c0) / hz; wall = t1 - t0;
  printf "hosts=10 interval=1s wall=%.1fs cpu=%.3fs share_of_one_core=%.3f%% rss=%d KiB\n", wall, cpu, 100 * cpu / wall, rss
}'
