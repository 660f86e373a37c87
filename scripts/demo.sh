#!/usr/bin/env bash
# The main job, from a fresh machine: install PostgreSQL if missing, build
# pgwarden, start a local cluster (a primary and two replicas) and watch its
# topology. Ctrl-C stops and removes everything.
set -euo pipefail
cd "$(dirname "$0")/.."
# Where rustup puts cargo, if install-deps.sh installed it.
export PATH="$HOME/.cargo/bin:$PATH"
scripts/install-deps.sh
cargo build --release --quiet
exec target/release/pgwarden demo "$@"
