#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the platform: installs packages, builds vmon
# and envd, then `vmon up` (api + proxy + one node). It prints the E2B_* variables to export.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo build --release -p vmon -p vmon-envd --bins
exec target/release/vmon up "$@"
