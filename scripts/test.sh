#!/usr/bin/env bash
# Runs every test from a fresh machine: installs what the tests need, then
# the unit and integration tests (real PostgreSQL clusters on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo clippy --workspace --all-targets --quiet -- -D warnings
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi
