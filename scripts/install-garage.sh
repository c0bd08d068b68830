#!/usr/bin/env bash
# Builds garage (the S3 server the object-store tests and `scripts/garage-dev.sh` start) from
# crates.io into a version-keyed cache outside the clone, once: nothing happens when the binary
# is already there. Prints the binary's path.
#   VMON_TOOLS_DIR   cache root (default /var/tmp/vmon-tools)
set -euo pipefail
GARAGE_VERSION=2.5.0
TOOLS=${VMON_TOOLS_DIR:-/var/tmp/vmon-tools}
ROOT=$TOOLS/garage-$GARAGE_VERSION
BIN=$ROOT/bin/garage
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q "$GARAGE_VERSION"; then
  echo "$BIN"
  exit 0
fi
# garage's bundled-libs feature compiles LMDB, SQLite and zstd from C: a C toolchain.
missing=()
command -v cc >/dev/null 2>&1 || missing+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing (garage build): ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is needed to build garage (install a Rust toolchain first)" >&2
  exit 1
fi
mkdir -p "$TOOLS"
echo "building garage $GARAGE_VERSION into $ROOT (takes a while; log: $TOOLS/garage-build.log)" >&2
# Its own target dir, so a repeated build after a failure reuses what was compiled.
CARGO_TARGET_DIR=$TOOLS/garage-target \
  cargo install garage --version "$GARAGE_VERSION" --locked --root "$ROOT" \
  >"$TOOLS/garage-build.log" 2>&1 || {
  tail -n 30 "$TOOLS/garage-build.log" >&2
  echo "error: building garage failed (log: $TOOLS/garage-build.log)" >&2
  exit 1
}
"$BIN" --version >/dev/null
echo "$BIN"
