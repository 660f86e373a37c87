#!/usr/bin/env bash
# Installs what pgwarden's demo and tests need on Debian 12, idempotently:
# - the PostgreSQL 15 server binaries (initdb, postgres, pg_basebackup, pgbench);
# - etcd (the HA store the demo and the test kit start), and protoc with the
#   protobuf well-known types, which the etcd client's build compiles the
#   API with;
# - with --tests, the non-Rust drivers the integration tests use: psycopg 3,
#   asyncpg, the PostgreSQL JDBC driver (with a JDK to run the test client
#   from source), PHP's PDO pgsql and pgsql extensions and node-postgres;
# - a C compiler (ring and the fuzz targets' libFuzzer build C and C++),
#   and, where no cargo is found, a Rust toolchain from rustup (Debian's
#   own rustc is older than the workspace's rust-version).
#
#   scripts/install-deps.sh [--tests]
set -euo pipefail

tests=false
[ "${1:-}" = "--tests" ] && tests=true

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"

packages=(postgresql-15 postgresql-client-15 etcd-server protobuf-compiler libprotobuf-dev
  build-essential pkg-config ca-certificates curl)
if $tests; then
  packages+=(openjdk-17-jdk-headless libpostgresql-jdbc-java php-cli php-pgsql python3-pip)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

install_python_drivers() {
  $tests || return 0
  python3 -c "import psycopg, asyncpg" 2>/dev/null && return 0
  python3 -m pip install -q "psycopg[binary]" asyncpg 2>/dev/null \
    || python3 -m pip install -q --break-system-packages "psycopg[binary]" asyncpg
}

# rustup installs into the invoking user's home; the scripts put
# ~/.cargo/bin on PATH.
install_rust() {
  export PATH="$HOME/.cargo/bin:$PATH"
  command -v cargo >/dev/null 2>&1 && return 0
  echo "installing the Rust toolchain (rustup)" >&2
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
    | sh -s -- -y --quiet --profile minimal --component clippy,rustfmt
}

# node-postgres, from the npm registry, into npm's global modules (the
# tests point NODE_PATH there). Node.js itself from Debian where missing.
if $tests && ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi

install_node_pg() {
  $tests || return 0
  command -v npm >/dev/null 2>&1 || return 0
  NODE_PATH=$(npm root -g) node -e 'require("pg")' 2>/dev/null \
    || $sudo npm install -g --silent --no-audit --no-fund pg@8
}

if [ ${#missing[@]} -eq 0 ]; then
  install_python_drivers
  install_node_pg
  install_rust
  exit 0
fi

echo "installing: ${missing[*]}" >&2
$sudo apt-get update -qq
# The packages would start a PostgreSQL cluster on 5432 and an etcd member
# on 2379; pgwarden and its tests start their own, so keep services from
# starting during the install.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
  $sudo chmod +x /usr/sbin/policy-rc.d
  trap '$sudo rm -f /usr/sbin/policy-rc.d' EXIT
fi
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_python_drivers
install_node_pg
install_rust
