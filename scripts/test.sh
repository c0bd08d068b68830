#!/usr/bin/env bash
# The whole test suite: unit and integration tests of every crate (real VMs under QEMU, real
# etcd and PostgreSQL started by the tests), envd driven by the official Python SDK, and the
# end-to-end SDK tests against `vmon up`. Run as root (network namespaces, QEMU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

# Guest images and builds are cached here across runs (keyed by recipe hash).
export VMON_TEST_DATA_DIR="${VMON_TEST_DATA_DIR:-/var/tmp/vmon-ci}"
mkdir -p "$VMON_TEST_DATA_DIR"

cargo build --workspace --bins
cargo test --workspace --no-fail-fast -- --test-threads 2

.venv/bin/python -m pytest -q tests/envd tests/code_interpreter
if [ -d tests/e2e ] && ls tests/e2e/test_*.py >/dev/null 2>&1; then
  .venv/bin/python -m pytest -q tests/e2e
fi
