#!/usr/bin/env bash
# A single-node garage for development and tests: starts it on DIR (config, metadata, data,
# log and pidfile all under DIR) with its RPC, S3 and admin APIs on loopback, applies a
# one-node layout, creates a bucket and an access key, and prints the VMON_S3_* settings a
# node reads as shell exports. Run again on the same DIR: reuses the running server (or starts
# it again) and prints the same settings.
#
#   scripts/garage-dev.sh start DIR [S3_PORT [RPC_PORT [ADMIN_PORT]]]   (defaults 3900 3901 3903)
#   scripts/garage-dev.sh stop DIR
#   eval "$(scripts/garage-dev.sh start /var/tmp/garage-dev)"
#
#   VMON_GARAGE      the garage binary (default: what scripts/install-garage.sh builds)
#   VMON_S3_BUCKET   the bucket to create (default vmon)
set -euo pipefail
cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
pidfile=$dir/garage.pid

running() {
  [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

if [ "$cmd" = stop ]; then
  if running; then
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
  exit 0
fi
if [ "$cmd" != start ]; then
  echo "unknown command $cmd (start or stop)" >&2
  exit 2
fi

s3_port=${3:-3900}
rpc_port=${4:-3901}
admin_port=${5:-3903}
bucket=${VMON_S3_BUCKET:-vmon}
garage=${VMON_GARAGE:-${VMON_TOOLS_DIR:-/var/tmp/vmon-tools}/garage-2.5.0/bin/garage}
if [ ! -x "$garage" ]; then
  echo "error: no garage at $garage: run scripts/install-garage.sh" >&2
  exit 1
fi
hex() { head -c "$1" /dev/urandom | od -An -tx1 | tr -d ' \n'; }

config=$dir/garage.toml
if [ ! -f "$config" ]; then
  umask 077
  cat >"$config" <<TOML
metadata_dir = "$dir/meta"
data_dir = "$dir/data"
db_engine = "lmdb"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$rpc_port"
rpc_public_addr = "127.0.0.1:$rpc_port"
rpc_secret = "$(hex 32)"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$s3_port"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:$admin_port"
admin_token = "$(hex 32)"
TOML
  printf 'GK%s %s\n' "$(hex 12)" "$(hex 32)" >"$dir/key"
fi
g() { "$garage" -c "$config" "$@"; }

if ! running; then
  nohup "$garage" -c "$config" server >>"$dir/garage.log" 2>&1 &
  echo $! >"$pidfile"
fi
ready=0
for _ in $(seq 100); do
  if g status >/dev/null 2>&1; then
    ready=1
    break
  fi
  running || break
  sleep 0.2
done
if [ "$ready" != 1 ]; then
  tail -n 20 "$dir/garage.log" >&2
  echo "error: garage did not come up (log: $dir/garage.log)" >&2
  exit 1
fi

if [ ! -f "$dir/layout.done" ]; then
  node=$(g node id -q 2>/dev/null | cut -d@ -f1)
  g layout assign -z dc1 -c 10G "$node" >/dev/null
  g layout apply --version 1 >/dev/null
  touch "$dir/layout.done"
fi
read -r key_id secret <"$dir/key"
if [ ! -f "$dir/bucket.done" ]; then
  g key import --yes -n vmon "$key_id" "$secret" >/dev/null
  g bucket create "$bucket" >/dev/null
  g bucket allow --read --write --owner "$bucket" --key "$key_id" >/dev/null
  g key allow --create-bucket "$key_id" >/dev/null
  echo "$bucket" >"$dir/bucket.done"
fi
bucket=$(cat "$dir/bucket.done")
# The S3 API answers once the layout is in effect.
for _ in $(seq 50); do
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$s3_port/" || true)
  [ "$code" != 000 ] && break
  sleep 0.2
done
echo "export VMON_S3_ENDPOINT=http://127.0.0.1:$s3_port"
echo "export VMON_S3_BUCKET=$bucket"
echo "export VMON_S3_REGION=garage"
echo "export VMON_S3_ACCESS_KEY_ID=$key_id"
echo "export VMON_S3_SECRET_ACCESS_KEY=$secret"
