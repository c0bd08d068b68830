#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the platform: installs packages, builds vmon
# and envd, then `vmon up` (api + proxy + one node). It prints the E2B_* variables to export.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# VMON_QEMU_VERSION=10.0: run QEMU 10.0 from bookworm-backports, unpacked beside the system's
# 7.2 (scripts/install-qemu.sh; nothing on the system is upgraded), unless VMON_QEMU names one.
if [ -n "${VMON_QEMU_VERSION:-}" ] && [ -z "${VMON_QEMU:-}" ]; then
  VMON_QEMU=$(scripts/install-qemu.sh "$VMON_QEMU_VERSION")
  export VMON_QEMU
fi
cargo build --release -p vmon -p vmon-envd --bins
exec target/release/vmon up "$@"
