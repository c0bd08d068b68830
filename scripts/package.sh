#!/usr/bin/env bash
# Makes the Debian package of vmon (vmon and envd, the systemd units, /etc/vmon, the maintainer
# scripts: [package.metadata.deb] in crates/vmon/Cargo.toml, files in deploy/) with cargo-deb,
# and prints the .deb's path.
#
#   scripts/package.sh                 # release build, then the package
#   scripts/package.sh --out DIR       # where the .deb goes (default <target dir>/debian)
#
# VMON_DEB_PROFILE=dev packages the debug binaries already built (`cargo build --workspace
# --bins`) without building again, stripped: what CI's package test does, within its budget.
set -euo pipefail
cd "$(dirname "$0")/.."
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out)
      out=$2
      shift 2
      ;;
    *)
      echo "usage: scripts/package.sh [--out DIR]" >&2
      exit 2
      ;;
  esac
done
deb=$(scripts/install-cargo-deb.sh)
# gzip by the system tool: cargo-deb's own (zopfli) took minutes for a debug binary.
args=(-p vmon --locked --compress-type gzip --compress-system)
profile=${VMON_DEB_PROFILE:-release}
if [ "$profile" = release ]; then
  cargo build --release --locked -p vmon -p vmon-envd --bins
else
  args+=(--profile "$profile" --fast --strip)
fi
# Both binaries are built beforehand (envd is another crate of the workspace).
args+=(--no-build)
[ -n "$out" ] && args+=(--output "$out")
# cargo-deb prints the package's path last.
"$deb" deb "${args[@]}" | tail -n 1
