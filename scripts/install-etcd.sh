#!/usr/bin/env bash
# Installs what the DCS crate and its tests need on Debian 12: the etcd
# server the test kit starts (and the demo will), and protoc with the
# well-known protobuf types, which the etcd client's build script compiles
# the etcd API with.
# Idempotent: does nothing when everything is already there.
set -euo pipefail

packages=(etcd-server protobuf-compiler libprotobuf-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
echo "installing: ${missing[*]}" >&2
$sudo apt-get update -qq
# etcd-server ships a service that would start a member of its own on 2379;
# the test kit starts its own servers on free ports, so keep services from
# starting during the install.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
  $sudo chmod +x /usr/sbin/policy-rc.d
  trap '$sudo rm -f /usr/sbin/policy-rc.d' EXIT
fi
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
