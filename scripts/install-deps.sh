#!/usr/bin/env bash
# Installs what vmon needs on a fresh Debian machine: QEMU, image tools, networking, the
# servers the cluster backends' tests start (etcd, PostgreSQL), and the Python venv with the
# pinned E2B SDK the end-to-end tests drive. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(qemu-system-x86 qemu-utils debootstrap e2fsprogs nftables iproute2 procps protobuf-compiler
      etcd-server postgresql python3-venv ca-certificates curl libnss-myhostname)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# `sandbox.get_host(port)` names `{port}-{id}.localhost:<proxy port>`: names under `localhost`
# are loopback (RFC 6761); nss-myhostname resolves them for every program, not only for curl
# and browsers. Looked up before DNS, so they never wait for a resolver.
if ! grep -qE '^hosts:.*[[:space:]]myhostname([[:space:]]|$)' /etc/nsswitch.conf 2>/dev/null; then
  if grep -qE '^hosts:[[:space:]]*files' /etc/nsswitch.conf 2>/dev/null; then
    sed -i -E 's/^(hosts:[[:space:]]*files)/\1 myhostname/' /etc/nsswitch.conf ||
      echo "note: could not add 'myhostname' to /etc/nsswitch.conf; *.localhost names may not resolve" >&2
  else
    echo "note: add 'myhostname' to the hosts line of /etc/nsswitch.conf for *.localhost names" >&2
  fi
fi
# Debian starts a default PostgreSQL cluster and etcd on install; tests run their own.
systemctl disable --now etcd >/dev/null 2>&1 || true

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import e2b, pytest' 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -r tests/requirements.txt
fi
