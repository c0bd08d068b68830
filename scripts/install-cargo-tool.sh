#!/usr/bin/env bash
# Builds a cargo tool (a crates.io crate with a binary of its name) at one version into a
# version-keyed cache outside the clone, once: nothing happens when the binary is already
# there. Prints the binary's path. scripts/install-cargo-deny.sh and
# scripts/install-cargo-deb.sh name the tools and versions vmon uses.
#   usage: scripts/install-cargo-tool.sh CRATE VERSION
#   VMON_TOOLS_DIR   cache root (default /var/tmp/vmon-tools)
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 CRATE VERSION" >&2
  exit 2
fi
CRATE=$1
VERSION=$2
TOOLS=${VMON_TOOLS_DIR:-/var/tmp/vmon-tools}
ROOT=$TOOLS/$CRATE-$VERSION
BIN=$ROOT/bin/$CRATE
LOG=$TOOLS/$CRATE-build.log
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q "$VERSION"; then
  echo "$BIN"
  exit 0
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is needed to build $CRATE (install a Rust toolchain first)" >&2
  exit 1
fi
mkdir -p "$TOOLS"
echo "building $CRATE $VERSION into $ROOT (log: $LOG)" >&2
# Its own target dir, so a repeated build after a failure reuses what was compiled.
CARGO_TARGET_DIR=$TOOLS/$CRATE-target \
  cargo install "$CRATE" --version "$VERSION" --locked --root "$ROOT" \
  >"$LOG" 2>&1 || {
  tail -n 30 "$LOG" >&2
  echo "error: building $CRATE failed (log: $LOG)" >&2
  exit 1
}
"$BIN" --version >/dev/null
# The build tree is only for a retry after a failure.
rm -rf "$TOOLS/$CRATE-target"
echo "$BIN"
