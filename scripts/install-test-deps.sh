#!/usr/bin/env bash
# Installs what the test suite needs beyond `vmon up`'s own packages: the servers the backends'
# tests start (etcd, PostgreSQL, garage), tools the tests run (shellcheck, headless Chromium and its
# driver for the dashboard's browser tests), the Python venv with the pinned E2B SDKs and
# selenium, and the unprivileged user envd's tests run commands as. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

# Each program the tests run, and the Debian package that ships it.
BINS=(
  etcd:etcd-server
  pg_ctl:postgresql
  shellcheck:shellcheck
  node:nodejs
  npm:npm
  chromium:chromium
  chromedriver:chromium-driver
  # The desktop tests' Chromium trusts vmon's local CA through an NSS database they make.
  certutil:libnss3-tools
  # The OCI template tests: a registry of their own, its htpasswd, and the static programs the
  # tests' tiny image is made of.
  docker-registry:docker-registry
  htpasswd:apache2-utils
  busybox:busybox-static
  bash-static:bash-static
  # The cluster's forged-node test makes a self-signed certificate.
  openssl:openssl
  # The disk-full test: a small ext4 (mkfs.ext4 comes with vmon's own packages) on a loop mount.
  fallocate:util-linux
  mount:mount
  # The deployment's tests (tests/deploy, tests/e2e/test_prometheus.py): Prometheus and
  # promtool run the alert rules against a real vmon; systemd-analyze verifies the units the
  # package installs (a machine without systemd as init has no systemd-analyze); unshare and
  # chroot install the package into a fresh root.
  prometheus:prometheus
  promtool:prometheus
  systemd-analyze:systemd
  unshare:util-linux
  # The code-interpreter server's R contexts run on the host in tests/code_interpreter: R and
  # its Jupyter kernel (checked below by its package), as in the guest image.
  R:r-base-core
  # ... and its TypeScript contexts strip a cell's types with esbuild, as in the guest image.
  esbuild:esbuild
)
have_pkg() {
  { dpkg-query -W -f='${Status}\n' "$1" 2>/dev/null || true; } | grep -q "install ok installed"
}
pg_bin() {
  find /usr/lib/postgresql -maxdepth 3 -name "$1" -type f 2>/dev/null | sort -V | tail -n 1
}
found() {
  case "$1" in
    pg_ctl) [ -n "$(pg_bin pg_ctl)" ] ;;
    # The dynamically linked busybox has the same name; the tests' image needs the static one.
    busybox) have_pkg busybox-static ;;
    *) command -v "$1" >/dev/null 2>&1 ;;
  esac
}
missing=()
for entry in "${BINS[@]}"; do
  bin=${entry%%:*}
  pkg=${entry#*:}
  found "$bin" || missing+=("$pkg")
done
have_pkg python3-venv || missing+=(python3-venv)
have_pkg r-cran-irkernel || missing+=(r-cran-irkernel)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing (tests): ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
failed=0
for entry in "${BINS[@]}"; do
  bin=${entry%%:*}
  pkg=${entry#*:}
  if ! found "$bin"; then
    echo "error: '$bin' is missing after install (apt-get install $pkg)" >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
# The S3 server the object-store tests start (built from source once, cached outside the clone).
scripts/install-garage.sh >/dev/null
# The dependency policy checker scripts/test.sh runs (the same cache, keyed by version).
scripts/install-cargo-deny.sh >/dev/null
# The Debian package's builder (scripts/package.sh; the same cache).
scripts/install-cargo-deb.sh >/dev/null

# Debian starts a default etcd on install; tests run their own.
systemctl disable --now etcd >/dev/null 2>&1 || true
# The same for the registry (the OCI tests start their own on a free port).
systemctl disable --now docker-registry >/dev/null 2>&1 || true
# And for Prometheus (tests/e2e/test_prometheus.py starts its own).
systemctl disable --now prometheus >/dev/null 2>&1 || true
# (A host without systemd as init ran its init script, unless policy-rc.d forbade it.)
if [ ! -d /run/systemd/system ] && [ -x /etc/init.d/prometheus ]; then
  /etc/init.d/prometheus stop >/dev/null 2>&1 || true
  update-rc.d prometheus disable >/dev/null 2>&1 || true
fi

# envd's tests run commands as this user; made once here, before any test runs, so that tests
# running in parallel never race on useradd. A home left owned by another uid (a user deleted
# and made again) is given back.
TEST_USER=vmontest
if ! id "$TEST_USER" >/dev/null 2>&1; then
  useradd -m -s /bin/bash "$TEST_USER"
fi
home=$(getent passwd "$TEST_USER" | cut -d: -f6)
uid=$(id -u "$TEST_USER")
mkdir -p "$home"
if [ "$(stat -c %u "$home")" != "$uid" ]; then
  chown -R "$TEST_USER:" "$home"
fi

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import e2b, e2b_code_interpreter, pytest, selenium, schemathesis, ipykernel, jupyter_client, matplotlib, pandas, yaml' 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -r tests/requirements.txt
fi
