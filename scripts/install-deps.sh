#!/usr/bin/env bash
# Installs what building and running `vmon up` needs on a fresh Debian machine (QEMU, image tools,
# networking, protoc and its well-known .proto files for etcd-client's build script) in one
# apt transaction, then checks that every program vmon runs is there. Test-only servers and the
# SDK venv come from scripts/install-test-deps.sh. Safe to run again: it only adds what is
# missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each program vmon runs, and the Debian package that ships it.
BINS=(
  qemu-system-x86_64:qemu-system-x86
  qemu-img:qemu-utils
  debootstrap:debootstrap
  mkfs.ext4:e2fsprogs
  nft:nftables
  ip:iproute2
  ps:procps
  curl:curl
  protoc:protobuf-compiler
  # from_image(...) template builds: pull, unpack, give envd its own libraries, and take the
  # guest kernel's modules out of the image's rootfs.
  skopeo:skopeo
  umoci:umoci
  patchelf:patchelf
  debugfs:e2fsprogs
)
# Packages with no program of their own to check. libprotobuf-dev ships the well-known types
# (google/protobuf/descriptor.proto, struct.proto) that etcd-client's .proto files import; apt
# only recommends it beside protobuf-compiler, and recommends are not installed here.
EXTRA=(ca-certificates libnss-myhostname libprotobuf-dev)

installed_version() {
  # dpkg-query fails for a package it has never seen: that is "not installed", not an error.
  { dpkg-query -W -f='${Status} ${Version}\n' "$1" 2>/dev/null || true; } |
    awk '$1 == "install" && $3 == "installed" { print $4 }'
}
candidate_version() {
  { apt-cache policy "$1" 2>/dev/null || true; } | awk '$1 == "Candidate:" { print $2 }'
}

missing=()
for entry in "${BINS[@]}"; do
  pkg=${entry#*:}
  [ -n "$(installed_version "$pkg")" ] || missing+=("$pkg")
done
for pkg in "${EXTRA[@]}"; do
  [ -n "$(installed_version "$pkg")" ] || missing+=("$pkg")
done

# QEMU's packages must come from one version: a machine image may ship qemu-utils from a newer
# suite, and installing Debian's qemu-system-x86 beside it removes it as a conflict (a first
# `vmon up` then died without qemu-img). Pin every QEMU package to the system emulator's
# version, in the same transaction as the rest.
qemu_sys=$(installed_version qemu-system-x86)
qemu_utils=$(installed_version qemu-utils)
pins=()
if [ -z "$qemu_sys" ] || [ "$qemu_sys" != "$qemu_utils" ]; then
  if [ ${#missing[@]} -gt 0 ] || [ -z "$qemu_sys" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
  fi
  want=${qemu_sys:-$(candidate_version qemu-system-x86)}
  if [ -z "$want" ] || [ "$want" = "(none)" ]; then
    echo "error: no qemu-system-x86 package is available from apt; check /etc/apt/sources.list" >&2
    exit 1
  fi
  # qemu-system-common and -data follow from qemu-system-x86's exact-version dependencies.
  pins=("qemu-system-x86=$want" "qemu-utils=$want")
  rest=()
  for pkg in "${missing[@]}"; do
    case "$pkg" in qemu-system-x86 | qemu-utils) ;; *) rest+=("$pkg") ;; esac
  done
  missing=(${rest[@]+"${rest[@]}"})
elif [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
fi

if [ ${#missing[@]} -gt 0 ] || [ ${#pins[@]} -gt 0 ]; then
  echo "installing: ${missing[*]+${missing[*]}} ${pins[*]+${pins[*]}}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends --allow-downgrades \
    ${missing[@]+"${missing[@]}"} ${pins[@]+"${pins[@]}"} >/dev/null
fi

# Every program vmon runs must be there now; say which package brings it if not.
failed=0
for entry in "${BINS[@]}"; do
  bin=${entry%%:*}
  pkg=${entry#*:}
  if ! command -v "$bin" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$bin" ] && [ ! -x "/sbin/$bin" ]; then
    echo "error: '$bin' is missing after install (apt-get install $pkg)" >&2
    failed=1
  fi
done
if [ ! -f /usr/include/google/protobuf/descriptor.proto ]; then
  echo "error: protoc's well-known types are missing (apt-get install libprotobuf-dev)" >&2
  failed=1
fi
if command -v qemu-img >/dev/null 2>&1 && ! qemu-img --version >/dev/null 2>&1; then
  echo "error: qemu-img does not run (apt-get install --reinstall qemu-utils)" >&2
  failed=1
fi
if command -v qemu-system-x86_64 >/dev/null 2>&1 && ! qemu-system-x86_64 --version >/dev/null 2>&1; then
  echo "error: qemu-system-x86_64 does not run (apt-get install --reinstall qemu-system-x86)" >&2
  failed=1
fi
# Volumes are served by QEMU 7.2's virtiofsd (qemu-system-common); newer QEMUs dropped it.
if [ ! -x /usr/lib/qemu/virtiofsd ] && [ -z "${VMON_VIRTIOFSD:-}" ]; then
  echo "note: /usr/lib/qemu/virtiofsd is missing (Debian 12's qemu-system-common has it); volume mounts will fail" >&2
fi
[ "$failed" = 0 ] || exit 1

# `sandbox.get_host(port)` names `{port}-{id}.localhost:<proxy port>`: names under `localhost`
# are loopback (RFC 6761); nss-myhostname resolves them for every program, not only for curl
# and browsers. Looked up before DNS, so they never wait for a resolver.
if ! grep -qE '^hosts:.*[[:space:]]myhostname([[:space:]]|$)' /etc/nsswitch.conf 2>/dev/null; then
  if grep -qE '^hosts:[[:space:]]*files' /etc/nsswitch.conf 2>/dev/null; then
    sed -i -E 's/^(hosts:[[:space:]]*files)/\1 myhostname/' /etc/nsswitch.conf ||
      echo "note: could not add 'myhostname' to /etc/nsswitch.conf; *.localhost names may not resolve" >&2
  else
    echo "note: add 'myhostname' to the hosts line of /etc/nsswitch.conf for *.localhost names" >&2
  fi
fi
