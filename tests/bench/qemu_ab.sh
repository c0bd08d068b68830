#!/usr/bin/env bash
# A `vmon bench` run against two QEMUs, interleaved A/B/A/B on this (shared) machine:
#
#   tests/bench/qemu_ab.sh ROUNDS OUT-DIR -- BENCH-ARGS...
#   e.g. tests/bench/qemu_ab.sh 2 /var/tmp/ab -- bench snapshot --runs 5
#
# A is QEMU_A (default the system's /usr/bin/qemu-system-x86_64), B is QEMU_B (default the
# 10.0 that scripts/install-qemu.sh unpacks). Each QEMU gets a data dir of its own under
# OUT-DIR (builds restore only under the QEMU that made them), whose `images` is a hard-linked
# copy of VMON_IMAGE_CACHE (default $VMON_TEST_DATA_DIR/images) when it has none. Every run's
# output goes to OUT-DIR/<a|b>-<round>.txt, preceded by the load average before it and followed
# by the load after it; `vmon bench api` keeps its server's data dir there too
# (VMON_BENCH_DATA). VMON=<binary> (default $CARGO_TARGET_DIR/release/vmon).
set -euo pipefail
ROUNDS=${1:?rounds}
OUT=${2:?out dir}
shift 2
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || {
  echo "usage: $0 ROUNDS OUT-DIR -- BENCH-ARGS..." >&2
  exit 2
}
QEMU_A=${QEMU_A:-/usr/bin/qemu-system-x86_64}
QEMU_B=${QEMU_B:-${VMON_TOOLS_DIR:-/var/tmp/vmon-tools}/qemu-10.0/bin/qemu-system-x86_64}
VMON=${VMON:-${CARGO_TARGET_DIR:-$(dirname "$0")/../../target}/release/vmon}
CACHE=${VMON_IMAGE_CACHE:-${VMON_TEST_DATA_DIR:-/var/tmp/vmon-ci}/images}
mkdir -p "$OUT"

for side in a b; do
  q=QEMU_${side^^}
  "${!q}" --version | head -1 >"$OUT/$side.qemu"
  mkdir -p "$OUT/data-$side"
  if [ ! -e "$OUT/data-$side/images" ] && [ -d "$CACHE" ]; then
    cp -al "$CACHE" "$OUT/data-$side/images"
  fi
done

for round in $(seq 1 "$ROUNDS"); do
  for side in a b; do
    q=QEMU_${side^^}
    f=$OUT/$side-$round.txt
    {
      echo "qemu: $(cat "$OUT/$side.qemu") ($side, round $round)"
      echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    } >"$f"
    echo "== $side round $round: $(cat "$OUT/$side.qemu")" >&2
    rc=0
    VMON_QEMU=${!q} VMON_DATA_DIR=$OUT/data-$side VMON_BENCH_DATA=$OUT/server-$side \
      VMON_TEST_DATA_DIR=$OUT/data-$side "$VMON" --data-dir "$OUT/data-$side" "$@" >>"$f" 2>"$OUT/$side-$round.log" || rc=$?
    echo "load after: $(cut -d' ' -f1-3 /proc/loadavg); exit $rc" >>"$f"
    [ "$rc" = 0 ] || echo "   failed ($rc): see $OUT/$side-$round.log" >&2
  done
done
