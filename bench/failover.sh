#!/usr/bin/env bash
# Failover benchmark: builds pgwarden and the benchmark in release, then
# runs bench/failover (one 3-node `pgwarden agent` cluster per timing
# setting, real etcd and PostgreSQL 15 on 127.0.0.1) and prints the table.
# Every argument goes to the benchmark, e.g.
#
#   bench/failover.sh --rto fast,8 --k 3
#   bench/failover.sh --rto norm --fault passive --k 2
#
# (`--rto` presets or targets in seconds, `--fault passive,active,partition,
# switchover`, `--k` repetitions, `--logs DIR` keeps the agents' logs and
# every write attempt). LOGS=DIR is the same as `--logs DIR`. Prints the
# load (`uptime`) before and after. Needs root or the postgres user
# (PostgreSQL 15 and etcd from scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

scripts/install-deps.sh
log "building pgwarden and the benchmark (release)"
cargo build --release --quiet -p pgwarden -p pgwarden-bench-failover
target=${CARGO_TARGET_DIR:-$PWD/target}
extra=()
[ -n "${LOGS:-}" ] && extra=(--logs "$LOGS")

echo "start: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); uptime: $(uptime)"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
rc=0
"$target/release/pgwarden-bench-failover" --bin "$target/release/pgwarden" "${extra[@]}" "$@" || rc=$?
echo "end: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); uptime: $(uptime)"
exit "$rc"
