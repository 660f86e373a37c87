#!/usr/bin/env bash
# Runs every test from a fresh machine: installs what the tests need, then
# clippy, a type-check of the fuzz targets, and the unit and integration
# tests (real PostgreSQL clusters on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
# Where rustup puts cargo, if install-deps.sh installed it.
export PATH="$HOME/.cargo/bin:$PATH"
scripts/install-deps.sh --tests
cargo clippy --workspace --all-targets --quiet -- -D warnings
# The fuzz targets (fuzz/, outside the workspace) are run by hand with
# cargo-fuzz; type-checking them here keeps them compiling as the parsers'
# API changes, at a fraction of the cost of installing cargo-fuzz for a full
# build. Nightly is what they are fuzzed with; stable checks them as well.
if cargo +nightly --version >/dev/null 2>&1; then
  cargo +nightly check --quiet --manifest-path fuzz/Cargo.toml --bins
else
  echo "fuzz targets: no nightly toolchain, checking them with the default one instead" >&2
  cargo check --quiet --manifest-path fuzz/Cargo.toml --bins
fi
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi
