#!/usr/bin/env bash
# Builds cargo-deb (scripts/package.sh makes the Debian package with it) from crates.io into a
# version-keyed cache outside the clone, once: nothing happens when the binary is already
# there. Prints the binary's path.
#   VMON_TOOLS_DIR   cache root (default /var/tmp/vmon-tools)
set -euo pipefail
DEB_VERSION=3.8.0
TOOLS=${VMON_TOOLS_DIR:-/var/tmp/vmon-tools}
ROOT=$TOOLS/cargo-deb-$DEB_VERSION
BIN=$ROOT/bin/cargo-deb
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q "$DEB_VERSION"; then
  echo "$BIN"
  exit 0
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is needed to build cargo-deb (install a Rust toolchain first)" >&2
  exit 1
fi
mkdir -p "$TOOLS"
echo "building cargo-deb $DEB_VERSION into $ROOT (log: $TOOLS/cargo-deb-build.log)" >&2
# Its own target dir, so a repeated build after a failure reuses what was compiled.
CARGO_TARGET_DIR=$TOOLS/cargo-deb-target \
  cargo install cargo-deb --version "$DEB_VERSION" --locked --root "$ROOT" \
  >"$TOOLS/cargo-deb-build.log" 2>&1 || {
  tail -n 30 "$TOOLS/cargo-deb-build.log" >&2
  echo "error: building cargo-deb failed (log: $TOOLS/cargo-deb-build.log)" >&2
  exit 1
}
"$BIN" --version >/dev/null
# The build tree is only for a retry after a failure.
rm -rf "$TOOLS/cargo-deb-target"
echo "$BIN"
