#!/usr/bin/env bash
# Builds cargo-deny (the dependency policy scripts/test.sh checks: licences, bans, sources,
# advisories when a database is at hand) from crates.io into a version-keyed cache outside the
# clone, once: nothing happens when the binary is already there. Prints the binary's path.
#   VMON_TOOLS_DIR   cache root (default /var/tmp/vmon-tools)
set -euo pipefail
DENY_VERSION=0.20.2
TOOLS=${VMON_TOOLS_DIR:-/var/tmp/vmon-tools}
ROOT=$TOOLS/cargo-deny-$DENY_VERSION
BIN=$ROOT/bin/cargo-deny
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q "$DENY_VERSION"; then
  echo "$BIN"
  exit 0
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is needed to build cargo-deny (install a Rust toolchain first)" >&2
  exit 1
fi
mkdir -p "$TOOLS"
echo "building cargo-deny $DENY_VERSION into $ROOT (log: $TOOLS/cargo-deny-build.log)" >&2
# Its own target dir, so a repeated build after a failure reuses what was compiled.
CARGO_TARGET_DIR=$TOOLS/cargo-deny-target \
  cargo install cargo-deny --version "$DENY_VERSION" --locked --root "$ROOT" \
  >"$TOOLS/cargo-deny-build.log" 2>&1 || {
  tail -n 30 "$TOOLS/cargo-deny-build.log" >&2
  echo "error: building cargo-deny failed (log: $TOOLS/cargo-deny-build.log)" >&2
  exit 1
}
"$BIN" --version >/dev/null
# The build tree is only for a retry after a failure.
rm -rf "$TOOLS/cargo-deny-target"
echo "$BIN"
