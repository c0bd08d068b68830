#!/usr/bin/env bash
# Puts a QEMU from another Debian suite beside the system's, without installing it:
#
#   scripts/install-qemu.sh [VERSION]        # VERSION: upstream major.minor, default 10.0
#
# The .debs (qemu-system-x86, its -common and -data, the firmware it needs, qemu-utils, and
# whichever libraries this machine lacks at the versions it needs) are fetched with a private
# apt configuration (its own sources, lists and cache under the tools directory), so the
# system's apt never sees the extra suite and nothing on the machine is installed, upgraded or
# removed. They are unpacked with `dpkg -x` into
#
#   $VMON_TOOLS_DIR/qemu-VERSION/root          (default VMON_TOOLS_DIR=/var/tmp/vmon-tools)
#
# and two wrappers are written beside it, bin/qemu-system-x86_64 and bin/qemu-img, that run the
# unpacked binaries with their libraries, modules and firmware (`-L`). Point vmon at it with
# `VMON_QEMU=$VMON_TOOLS_DIR/qemu-VERSION/bin/qemu-system-x86_64` (or `--qemu`), and check it
# with `vmon doctor --qemu ...`. The last line printed is that path.
#
# Safe to run again: a complete install whose wrapper runs is kept as it is (REFRESH=1 fetches
# again); an interrupted one is replaced. Needs root only for `apt-get download`'s own sandbox
# user; the result is readable by every user (vmon runs QEMU as unprivileged users).
set -euo pipefail

VERSION=${1:-10.0}
case "$VERSION" in
  [0-9]*.[0-9]*) ;;
  *)
    echo "usage: $0 [MAJOR.MINOR] (e.g. 10.0)" >&2
    exit 2
    ;;
esac
TOOLS=${VMON_TOOLS_DIR:-/var/tmp/vmon-tools}
MIRROR=${VMON_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${VMON_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
# The suite that has this version for Debian 12 (bookworm): backports carries the next
# stable release's QEMU, rebuilt against bookworm's libraries.
SUITE=${VMON_QEMU_SUITE:-bookworm-backports}
DEST=$TOOLS/qemu-$VERSION
WRAPPER=$DEST/bin/qemu-system-x86_64
ARCH_LIB=usr/lib/x86_64-linux-gnu
# Some of bookworm's libraries (libfuse3, libnl) are still shipped in /lib, not /usr/lib.
OLD_LIB=lib/x86_64-linux-gnu

if [ -f "$DEST/.complete" ] && [ -z "${REFRESH:-}" ] && "$WRAPPER" --version >/dev/null 2>&1; then
  echo "QEMU $(cat "$DEST/.complete") is in $DEST already (REFRESH=1 to fetch again)" >&2
  echo "$WRAPPER"
  exit 0
fi

umask 022
mkdir -p "$TOOLS"
chmod 755 "$TOOLS"

# A private apt: its own sources, lists, cache and preferences; the system's dpkg status, so
# that it fetches only what this machine lacks. The system's sources.list.d is never read.
APT=$TOOLS/apt
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/preferences.d" "$APT/sources.list.d"
cat >"$APT/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY bookworm-security main
deb $MIRROR $SUITE main
EOF
APT_OPTS=(
  -o "Dir::Etc::SourceList=$APT/sources.list"
  -o "Dir::Etc::SourceParts=$APT/sources.list.d"
  -o "Dir::Etc::Preferences=$APT/preferences"
  -o "Dir::Etc::PreferencesParts=$APT/preferences.d"
  -o "Dir::State::Lists=$APT/lists"
  -o "Dir::Cache=$APT/cache"
  -o "Debug::NoLocking=1"
  -o "APT::Get::List-Cleanup=0"
)
export DEBIAN_FRONTEND=noninteractive
echo "fetching the package lists of bookworm and $SUITE (private to $APT)" >&2
apt-get "${APT_OPTS[@]}" -qq update

# The suite's QEMU must be the version asked for (backports moves on).
# In `apt-cache policy`, a version line ("[***] VERSION PRIORITY") precedes its sources
# ("PRIORITY URI SUITE/main ARCH Packages").
have=$(apt-cache "${APT_OPTS[@]}" policy qemu-system-x86 |
  awk -v s="$SUITE" '$1 == "***" { v = $2; next }
    NF == 2 && $1 !~ /^[0-9]+$/ { v = $1; next }
    index($0, " " s "/main ") { print v; exit }')
upstream=${have#*:}
case "$upstream" in
  "$VERSION" | "$VERSION".* | "$VERSION"+*) ;;
  *)
    echo "error: $SUITE has qemu-system-x86 '${have:-none}', not QEMU $VERSION" >&2
    exit 1
    ;;
esac

# What installing it would bring onto this machine: every package a simulated install lists
# (QEMU's own, the firmware, and libraries missing or too old here). Nothing is installed.
# `-t`: the suite's versions are preferred for what has to be installed (a `pkg/suite` alone
# would take a missing dependency such as seabios from bookworm, too old for this QEMU).
sim=$(apt-get "${APT_OPTS[@]}" -s -t "$SUITE" --no-install-recommends install \
  "qemu-system-x86=$have" "qemu-utils=$have" 2>&1) || {
  echo "$sim" >&2
  echo "error: apt cannot resolve qemu-system-x86=$have from $SUITE" >&2
  exit 1
}
# QEMU's own packages always (the system may have this version installed already), then
# what the simulation adds.
mapfile -t wanted < <({
  for p in qemu-system-x86 qemu-system-common qemu-system-data qemu-utils; do echo "$p=$have"; done
  echo "$sim" | awk '$1 == "Inst" {
    v = $3; if (v ~ /^\[/) v = $4; sub(/^\(/, "", v); print $2 "=" v }'
} | awk -F= '!seen[$1]++')
for w in "${wanted[@]}"; do
  case "${w%%=*}" in
    libc6 | libc-bin | libgcc-s1 | libstdc++6)
      # Under LD_LIBRARY_PATH a second libc beside the system's loader breaks every program.
      echo "error: QEMU $VERSION from $SUITE needs a newer ${w%%=*} than this machine has" >&2
      exit 1
      ;;
  esac
done

# Fetch into a fresh directory and unpack into a fresh tree; move into place only when done.
work=$(mktemp -d "$TOOLS/.qemu-$VERSION.XXXXXX")
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"
mkdir -p "$work/debs" "$work/root" "$work/bin"
echo "downloading ${#wanted[@]} packages: ${wanted[*]}" >&2
# apt-get download drops privileges to _apt, which must be able to write here.
if id _apt >/dev/null 2>&1; then chown _apt "$work/debs"; fi
(cd "$work/debs" && apt-get "${APT_OPTS[@]}" -qq download "${wanted[@]}")
for deb in "$work"/debs/*.deb; do
  dpkg -x "$deb" "$work/root"
done
rm -rf "$work/debs"

# Absolute symbolic links in the tree are made to point into it when it has their target, so
# what QEMU loads is the version it was built with, not the system's.
while IFS= read -r -d '' link; do
  target=$(readlink "$link")
  case "$target" in
    /*)
      if [ -e "$work/root$target" ]; then
        rel=$(realpath -s --relative-to="$(dirname "$link")" "$work/root$target")
        ln -sfn "$rel" "$link"
      fi
      ;;
  esac
done < <(find "$work/root" -type l -print0)

for b in usr/bin/qemu-system-x86_64 usr/bin/qemu-img usr/share/seabios/bios-256k.bin; do
  [ -e "$work/root/$b" ] || {
    echo "error: the packages have no $b" >&2
    exit 1
  }
done

# The wrappers find the tree beside them, so they work before and after the move into place.
# Debian's QEMU looks for firmware in /usr/share/qemu, /usr/share/seabios and
# /usr/lib/ipxe/qemu; `-L` puts the tree's copies first (the system's stay the fallback: an
# unversioned dependency such as ipxe-qemu is fetched only where the system lacks it).
write_wrapper() { # NAME EXTRA-ARGS
  cat >"$work/bin/$1" <<EOF
#!/bin/sh
# QEMU $have from $SUITE, unpacked by scripts/install-qemu.sh (not installed).
root=\$(cd "\$(dirname "\$0")/../root" && pwd) || exit 127
LD_LIBRARY_PATH=\$root/$ARCH_LIB:\$root/$OLD_LIB\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
QEMU_MODULE_DIR=\$root/$ARCH_LIB/qemu
export LD_LIBRARY_PATH QEMU_MODULE_DIR
exec "\$root/usr/bin/$1" $2"\$@"
EOF
  chmod 755 "$work/bin/$1"
}
fw=
for d in usr/share/qemu usr/share/seabios usr/lib/ipxe/qemu; do
  if [ -d "$work/root/$d" ]; then fw+="-L \"\$root/$d\" "; fi
done
write_wrapper qemu-system-x86_64 "$fw"
write_wrapper qemu-img ''
echo "$have" >"$work/VERSION"

# It must run, and a pc machine must find its firmware (QEMU loads the BIOS when it creates
# the machine, so a bare machine that answers QMP and quits has it).
fail() {
  echo "$1" >&2
  LD_LIBRARY_PATH=$work/root/$ARCH_LIB:$work/root/$OLD_LIB ldd "$work/root/usr/bin/qemu-system-x86_64" | grep 'not found' >&2 || true
  exit 1
}
out=$("$work/bin/qemu-system-x86_64" --version 2>&1) || fail "$out"$'\nerror: the unpacked QEMU does not run'
"$work/bin/qemu-img" --version >/dev/null 2>&1 || fail "error: the unpacked qemu-img does not run"
qmp=$(printf '%s\n' '{"execute":"qmp_capabilities"}' '{"execute":"quit"}' |
  timeout 60 "$work/bin/qemu-system-x86_64" -M pc -accel tcg -m 64 -nodefaults -display none \
    -S -qmp stdio 2>&1) || fail "$qmp"$'\nerror: the unpacked QEMU cannot start a pc machine'

# Swap it in; an older copy goes only once the new one is in place.
old=
if [ -e "$DEST" ]; then
  old=$(mktemp -d "$TOOLS/.qemu-$VERSION.old.XXXXXX")
  mv "$DEST" "$old/"
fi
mv "$work" "$DEST"
trap - EXIT
[ -z "$old" ] || rm -rf "$old"
echo "$have" >"$DEST/.complete"
rm -f "$APT"/cache/archives/*.deb
echo "$(echo "$out" | head -1) in $DEST" >&2
echo "$WRAPPER"
