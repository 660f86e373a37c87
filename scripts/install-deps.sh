#!/usr/bin/env bash
# Installs the system packages pgwarden's demo and tests need on Debian 12:
# the PostgreSQL 15 server binaries (initdb, postgres, pg_basebackup, pgbench)
# psycopg 3 for the driver tests, and (install-etcd.sh) etcd and protoc.
# Idempotent: does nothing when everything is already there.
set -euo pipefail

packages=(postgresql-15 postgresql-client-15)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

# psycopg 3: the non-Rust driver the integration tests use.
if ! python3 -c "import psycopg" 2>/dev/null; then
  python3 -m pip install -q "psycopg[binary]" 2>/dev/null \
    || python3 -m pip install -q --break-system-packages "psycopg[binary]"
fi

# etcd, protoc and the protobuf well-known types: the DCS crate and its tests.
"$(dirname "$0")/install-etcd.sh"

[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
echo "installing: ${missing[*]}" >&2
$sudo apt-get update -qq
# The package would start a cluster of its own on 5432; pgwarden manages its
# own clusters, so keep services from starting during the install.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
  $sudo chmod +x /usr/sbin/policy-rc.d
  trap '$sudo rm -f /usr/sbin/policy-rc.d' EXIT
fi
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
