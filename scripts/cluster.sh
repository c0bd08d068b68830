#!/usr/bin/env bash
# A vmon cluster on this one machine, for trying the cluster and for its tests: a 3-member etcd,
# PostgreSQL, an S3 store (garage, when scripts/install-garage.sh has installed it), 2 nodes
# (own data dirs and slot blocks), 2 api replicas and a proxy. Every part is its own process,
# as it would be on separate hosts.
#
#   scripts/cluster.sh up            # installs what is missing, builds, starts, prints E2B_* exports
#   scripts/cluster.sh up --detach   # the same, then returns and leaves the cluster running
#   scripts/cluster.sh down          # stops every part (and the nodes' VMs)
#   scripts/cluster.sh start NAME    # (re)starts one part: etcd1..3 pg garage node1 node2 api1 api2 proxy proxy2
#   scripts/cluster.sh kill NAME     # kill -9 of one part (chaos tests)
#   scripts/cluster.sh cut PART SECS # (faults on) PART (node1 node2 api1 api2) loses etcd and
#                                    # PostgreSQL for SECS seconds (packets dropped, no refusal)
#   scripts/cluster.sh heal PART     # ends PART's cut now
#
# VMON_CLUSTER_DIR (default /var/tmp/vmon-cluster) keeps every part's state and log
# (logs/NAME.log) and pid (pids/NAME.pid); VMON_CLUSTER_PORT (default 3300) is the first of the
# ports it uses (api1 = PORT, proxy = PORT+1, api2 = PORT+10, nodes PORT+21/22, etcd PORT+31..36,
# PostgreSQL PORT+40, garage PORT+50..52); VMON_IMAGES_DIR shares a guest image cache
# (default DIR/images); VMON_BIN uses a vmon binary already built.
#
# The two nodes pose as two hosts (host-1, host-2), each with its own ingress proxy (proxy on
# PORT+1 for host-1, proxy2 on PORT+2 for host-2): E2B_SANDBOX_URL is host-1's proxy, which
# hands traffic for sandboxes on host-2 to proxy2, as proxies on separate machines would.
#
# The cluster's parts authenticate each other, always: `vmon cert` makes the cluster's CA in
# DIR/tls and a certificate per process. etcd speaks TLS only, between its members and to its
# clients, and takes only clients with a certificate of the CA (--client-cert-auth: the nodes,
# the api replicas, and DIR/tls/client.pem for the operator's tools and tests). Node RPC is TLS
# only; each node's certificate names its id (node1.node.vmon), which the api replicas and the
# other nodes check against the registry entry's id (vmon_node::tls::node_name), so an entry
# pointing elsewhere gets neither calls nor the node token.
#
# VMON_CLUSTER_FAULTS=1 (given to `up`, remembered like VMON_CLUSTER_TLS) lets the harness
# partition a part from the cluster's stores on this one loopback: each client part (node1,
# node2, api1, api2) reaches etcd and PostgreSQL through ports of its own (PORT+60+10*c+m,
# c = 0..3 in that order, m = 1..3 the etcd members, 4 PostgreSQL) that an nft table
# (`ip vmon-cluster-PORT`) maps to the real ones; `cut` drops the part's packets to them for a
# bounded time (set elements with a timeout: the kernel undoes the cut even if the harness
# dies), and `down` deletes the table.
#
# VMON_CLUSTER_TLS=1 (given to `up`, remembered for later commands; `up` with 0 turns it off)
# also runs the api replicas (and with them the admin token the proxy presents) and
# PostgreSQL over TLS: the api replicas serve https and verify PostgreSQL
# (sslmode=verify-full) against the CA, PostgreSQL takes only TLS connections over TCP, the
# proxy verifies its api. The printed exports then say https and trust the CA
# (SSL_CERT_FILE, REQUESTS_CA_BUNDLE: the system's CAs plus the cluster's).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DIR=${VMON_CLUSTER_DIR:-/var/tmp/vmon-cluster}
P=${VMON_CLUSTER_PORT:-3300}
IMAGES=${VMON_IMAGES_DIR:-$DIR/images}
PG_BIN=/usr/lib/postgresql/15/bin
GARAGE=${VMON_GARAGE:-${VMON_TOOLS_DIR:-/var/tmp/vmon-tools}/garage-2.5.0/bin/garage}

api_port() { if [ "$1" = 1 ]; then echo "$P"; else echo $((P + 10)); fi; }
PROXY_PORT=$((P + 1))
proxy_port() { echo $((P + $1)); }
PG_PORT=$((P + 40))
TLS_DIR=$DIR/tls
if [ -n "${VMON_CLUSTER_TLS:-}" ]; then TLS=$VMON_CLUSTER_TLS; elif [ -f "$TLS_DIR/on" ]; then TLS=1; else TLS=0; fi
[ "$TLS" = 1 ] && SCHEME=https || SCHEME=http
if [ -n "${VMON_CLUSTER_FAULTS:-}" ]; then FAULTS=$VMON_CLUSTER_FAULTS; elif [ -f "$DIR/faults-on" ]; then FAULTS=1; else FAULTS=0; fi
NFT_TABLE="vmon-cluster-$P"
ETCD_ENDPOINTS="https://127.0.0.1:$((P + 31)),https://127.0.0.1:$((P + 33)),https://127.0.0.1:$((P + 35))"

vmon_bin() {
  if [ -n "${VMON_BIN:-}" ]; then echo "$VMON_BIN"; else echo "$ROOT/target/release/vmon"; fi
}

install_parts() {
  scripts/install-deps.sh
  local missing=()
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  [ -x "$PG_BIN/postgres" ] || missing+=(postgresql)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing (cluster): ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # The S3 store: built once with cargo and cached outside the clone (a while on a fresh machine).
  if [ ! -x "$GARAGE" ]; then
    VMON_TOOLS_DIR=${VMON_TOOLS_DIR:-/var/tmp/vmon-tools} scripts/install-garage.sh >&2
  fi
  # Debian starts its own etcd and PostgreSQL on their default ports; the cluster runs its own.
  if [ -z "${VMON_BIN:-}" ]; then
    cargo build --release -p vmon -p vmon-envd --bins
  fi
}

# run NAME CMD...: starts CMD in its own session, logs and pid under DIR.
run() {
  local name=$1
  shift
  mkdir -p "$DIR/logs" "$DIR/pids"
  setsid "$@" >>"$DIR/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$DIR/pids/$name.pid"
}

alive() {
  local f="$DIR/pids/$1.pid"
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

# wait_ready PORT SECS: waits until the api there answers GET /health 200 (the base template
# is built), over http or https as the cluster runs: `vmon up --print-env` does the waiting.
wait_ready() {
  VMON_API_URL="$SCHEME://127.0.0.1:$1" VMON_API_CA_FILE=$(api_ca) \
    "$(vmon_bin)" --data-dir "$DIR/api" up --print-env --wait-secs "$2" >/dev/null
}

# The CA file clients verify the cluster's https with (empty without TLS).
api_ca() { if [ "$TLS" = 1 ]; then echo "$TLS_DIR/ca.pem"; fi; }

# make_certs: the cluster's CA and a certificate (127.0.0.1, localhost) per process, valid
# for client TLS too (etcd's members and clients); a node's also names its id.
make_certs() {
  local part names
  "$(vmon_bin)" cert ca --dir "$TLS_DIR" >/dev/null
  # Certificates of an older layout (no client use, no node names) are made again.
  if [ ! -f "$TLS_DIR/v2" ]; then
    rm -f "$TLS_DIR"/{node1,node2,api1,api2,pg}.{pem,key}
    touch "$TLS_DIR/v2"
  fi
  for part in etcd1 etcd2 etcd3 node1 node2 api1 api2 pg client; do
    [ -s "$TLS_DIR/$part.pem" ] && [ -s "$TLS_DIR/$part.key" ] && continue
    names=(127.0.0.1 localhost)
    case "$part" in node[12]) names+=("$part.node.vmon") ;; esac
    "$(vmon_bin)" cert issue --client --dir "$TLS_DIR" --out "$TLS_DIR/$part" "${names[@]}" >/dev/null
  done
  # PostgreSQL reads its key as its own user and wants it owner-only.
  chown postgres:postgres "$TLS_DIR/pg.key"
}

# client_index PART: a client part's place in the fault ports (empty for other parts).
client_index() {
  case "$1" in node1) echo 0 ;; node2) echo 1 ;; api1) echo 2 ;; api2) echo 3 ;; esac
}

# store_port PART M REAL: the port PART reaches store M (1..3 etcd members, 4 PostgreSQL) at:
# its own fault port with faults on, else REAL.
store_port() {
  local c
  c=$(client_index "$1")
  if [ "$FAULTS" = 1 ] && [ -n "$c" ]; then echo $((P + 60 + 10 * c + $2)); else echo "$3"; fi
}

# etcd_client PART: the environment of a process that is a client of the cluster's etcd.
etcd_client() {
  local eps="" m
  for m in 1 2 3; do
    eps+="https://127.0.0.1:$(store_port "$1" "$m" $((P + 29 + 2 * m))),"
  done
  echo "VMON_ETCD_ENDPOINTS=${eps%,}" "VMON_ETCD_CA_FILE=$TLS_DIR/ca.pem" \
    "VMON_ETCD_CERT_FILE=$TLS_DIR/$1.pem" "VMON_ETCD_KEY_FILE=$TLS_DIR/$1.key"
}

# store_url PART: the PostgreSQL URL of PART.
store_url() {
  local url
  url="postgres://postgres@127.0.0.1:$(store_port "$1" 4 "$PG_PORT")/postgres"
  if [ "$TLS" = 1 ]; then url+="?sslmode=verify-full&sslrootcert=$TLS_DIR/ca.pem"; fi
  echo "$url"
}

# faults_table: the nft table that maps every client part's fault ports to the real ones and
# drops what `cut` put in its set (made anew: no cut survives it).
faults_table() {
  local c m real rules=""
  for c in 0 1 2 3; do
    for m in 1 2 3 4; do
      if [ "$m" = 4 ]; then real=$PG_PORT; else real=$((P + 29 + 2 * m)); fi
      rules+="    ip daddr 127.0.0.1 tcp dport $((P + 60 + 10 * c + m)) dnat to 127.0.0.1:$real"$'\n'
    done
  done
  nft delete table ip "$NFT_TABLE" 2>/dev/null || true
  nft -f - <<EOF
table ip $NFT_TABLE {
  set cut {
    type inet_service
    flags timeout
  }
  chain drop_cut {
    type filter hook output priority -150; policy accept;
    ip daddr 127.0.0.1 tcp dport @cut drop
  }
  chain to_stores {
    type nat hook output priority -100; policy accept;
$rules  }
}
EOF
}

# cut_part PART SECS: PART's packets to etcd and PostgreSQL are dropped for SECS seconds.
cut_part() {
  local c m elems=""
  c=$(client_index "$1")
  if [ "$FAULTS" != 1 ] || [ -z "$c" ]; then
    echo "cut: faults are off (VMON_CLUSTER_FAULTS=1 at up) or $1 is not node1 node2 api1 api2" >&2
    return 2
  fi
  for m in 1 2 3 4; do elems+="$((P + 60 + 10 * c + m)) timeout ${2}s, "; done
  nft add element ip "$NFT_TABLE" cut "{ ${elems%, } }"
}

heal_part() {
  local c m
  c=$(client_index "$1")
  [ -n "$c" ] || return 2
  for m in 1 2 3 4; do
    nft delete element ip "$NFT_TABLE" cut "{ $((P + 60 + 10 * c + m)) }" 2>/dev/null || true
  done
}

wait_port() {
  local port=$1 what=$2 tries=${3:-300}
  for _ in $(seq "$tries"); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "error: $what did not listen on port $port (see $DIR/logs)" >&2
  return 1
}

node_token() {
  if [ ! -s "$DIR/node-token" ]; then
    mkdir -p "$DIR"
    (umask 077 && head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/node-token")
  fi
  cat "$DIR/node-token"
}

# etcd: TLS only, to clients and between members, each side with a certificate of the CA.
start_etcd() {
  local i=$1 initial="" n
  for n in 1 2 3; do
    initial+="etcd$n=https://127.0.0.1:$((P + 30 + 2 * n)),"
  done
  run "etcd$i" etcd --name "etcd$i" --data-dir "$DIR/etcd$i" \
    --listen-client-urls "https://127.0.0.1:$((P + 29 + 2 * i))" \
    --advertise-client-urls "https://127.0.0.1:$((P + 29 + 2 * i))" \
    --listen-peer-urls "https://127.0.0.1:$((P + 30 + 2 * i))" \
    --initial-advertise-peer-urls "https://127.0.0.1:$((P + 30 + 2 * i))" \
    --initial-cluster "${initial%,}" --initial-cluster-state new \
    --initial-cluster-token vmon-local \
    --cert-file "$TLS_DIR/etcd$i.pem" --key-file "$TLS_DIR/etcd$i.key" \
    --trusted-ca-file "$TLS_DIR/ca.pem" --client-cert-auth \
    --peer-cert-file "$TLS_DIR/etcd$i.pem" --peer-key-file "$TLS_DIR/etcd$i.key" \
    --peer-trusted-ca-file "$TLS_DIR/ca.pem" --peer-client-cert-auth
}

start_pg() {
  if [ ! -d "$DIR/pg/data" ]; then
    mkdir -p "$DIR/pg"
    chown postgres:postgres "$DIR/pg"
    runuser -u postgres -- "$PG_BIN/initdb" --auth=trust --username=postgres -D "$DIR/pg/data" >/dev/null
  fi
  mkdir -p "$DIR/logs"
  touch "$DIR/logs/pg.log"
  chown postgres:postgres "$DIR/logs/pg.log"
  # Local socket connections as before; TCP ones only over TLS when the cluster runs TLS.
  local hba="$DIR/pg/hba.conf" ssl=()
  if [ "$TLS" = 1 ]; then
    printf 'local all all trust\nhostssl all all 127.0.0.1/32 trust\n' >"$hba"
    ssl=(-c ssl=on -c "ssl_cert_file=$TLS_DIR/pg.pem" -c "ssl_key_file=$TLS_DIR/pg.key")
  else
    printf 'local all all trust\nhost all all 127.0.0.1/32 trust\n' >"$hba"
  fi
  chmod 644 "$hba"
  run pg runuser -u postgres -- "$PG_BIN/postgres" -D "$DIR/pg/data" -p "$PG_PORT" \
    -k "$DIR/pg" -c listen_addresses=127.0.0.1 -c max_connections=100 -c "hba_file=$hba" \
    "${ssl[@]}"
}

start_garage() {
  if [ -x "$GARAGE" ]; then
    VMON_GARAGE=$GARAGE scripts/garage-dev.sh start "$DIR/garage" $((P + 50)) $((P + 51)) $((P + 52)) >"$DIR/s3.env.tmp"
    mv "$DIR/s3.env.tmp" "$DIR/s3.env"
  else
    echo "vmon cluster: no garage at $GARAGE, so no object store (scripts/install-garage.sh builds it)" >&2
    rm -f "$DIR/s3.env"
  fi
}

start_node() {
  local i=$1
  local d="$DIR/node$i"
  mkdir -p "$d"
  [ -e "$d/images" ] || ln -s "$IMAGES" "$d/images"
  if [ -f "$DIR/s3.env" ]; then
    # shellcheck disable=SC1091
    . "$DIR/s3.env"
  fi
  # TLS only (a certificate naming node$i); it advertises https://<listen> in the registry.
  # The CA verifies the other nodes when this one sends them a live migration.
  # shellcheck disable=SC2046
  run "node$i" env VMON_NODE_TOKEN="$(node_token)" $(etcd_client "node$i") "$(vmon_bin)" \
    --data-dir "$d" node --listen "127.0.0.1:$((P + 20 + i))" --node-id "node$i" \
    --host "host-$i" --ingress "http://127.0.0.1:$(proxy_port "$i")" \
    --tls-cert "$TLS_DIR/node$i.pem" --tls-key "$TLS_DIR/node$i.key" --node-ca "$TLS_DIR/ca.pem"
}

start_api() {
  local i=$1 port
  port=$(api_port "$i")
  mkdir -p "$DIR/api"
  local cert="" key="" vstore=local s3mounts=""
  if [ "$TLS" = 1 ]; then
    cert="$TLS_DIR/api$i.pem" key="$TLS_DIR/api$i.key"
  fi
  # With the S3 store, volumes live in it (each node caches what it mounts): no shared dir.
  # Sandboxes may mount buckets of that store too (vmonS3Mounts: the operator's endpoint).
  if [ -f "$DIR/s3.env" ]; then
    vstore=s3
    s3mounts=$(sed -n 's/^export VMON_S3_ENDPOINT=//p' "$DIR/s3.env")
  fi
  # shellcheck disable=SC2046
  run "api$i" env VMON_API_LISTEN="127.0.0.1:$port" VMON_API_URL="$SCHEME://127.0.0.1:$port" \
    VMON_API_TLS_CERT="$cert" VMON_API_TLS_KEY="$key" VMON_VOLUME_STORE="$vstore" \
    VMON_S3_MOUNT_ENDPOINTS="$s3mounts" \
    VMON_PROXY_LISTEN="127.0.0.1:$PROXY_PORT" VMON_CLIENT_ID="api$i" \
    VMON_STORE_URL="$(store_url "api$i")" VMON_NODE_TOKEN="$(node_token)" $(etcd_client "api$i") \
    "$(vmon_bin)" --data-dir "$DIR/api" api --node-ca "$TLS_DIR/ca.pem"
}

start_proxy() {
  local i=$1 name=proxy
  [ "$i" = 1 ] || name="proxy$i"
  local other=2
  [ "$i" = 1 ] || other=1
  VMON_PROXY_LISTEN="127.0.0.1:$(proxy_port "$i")" VMON_API_URL="$SCHEME://127.0.0.1:$(api_port "$i")" \
    VMON_PROXY_API_URLS="$SCHEME://127.0.0.1:$(api_port "$i"),$SCHEME://127.0.0.1:$(api_port "$other")" \
    VMON_API_CA_FILE=$(api_ca) VMON_PROXY_HOST="host-$i" run "$name" "$(vmon_bin)" --data-dir "$DIR/api" proxy
}

start() {
  check_dirs
  case "$1" in
    etcd[123]) start_etcd "${1#etcd}" ;;
    pg) start_pg ;;
    garage) start_garage ;;
    node[12]) start_node "${1#node}" ;;
    api[12]) start_api "${1#api}" ;;
    proxy) start_proxy 1 ;;
    proxy2) start_proxy 2 ;;
    *) echo "unknown part $1" >&2; return 2 ;;
  esac
}

stop_all() {
  local f pid
  for f in "$DIR"/pids/*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  for f in "$DIR"/pids/*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$f"
  done
  nft delete table ip "$NFT_TABLE" 2>/dev/null || true
  if [ -x scripts/garage-dev.sh ]; then
    scripts/garage-dev.sh stop "$DIR/garage" 2>/dev/null || true
  fi
  # The nodes' VMs outlive a node by design (a restarted node re-adopts them): not here.
  pkill -KILL -f -- "$DIR/node[12]/" 2>/dev/null || true
}

exports() {
  cat <<EOF
export E2B_API_URL=$SCHEME://127.0.0.1:$(api_port 1)
export E2B_SANDBOX_URL=http://127.0.0.1:$PROXY_PORT
export E2B_API_KEY=$(cat "$DIR/api/api-key")
export E2B_VOLUME_API_URL=$SCHEME://127.0.0.1:$(api_port 1)
# the second api replica (any replica answers any request):
export VMON_API_URL_B=$SCHEME://127.0.0.1:$(api_port 2)
# etcd (TLS only, client certificate required), for the operator's tools:
export VMON_ETCD_ENDPOINTS=$ETCD_ENDPOINTS
export VMON_ETCD_CA_FILE=$TLS_DIR/ca.pem
export VMON_ETCD_CERT_FILE=$TLS_DIR/client.pem
export VMON_ETCD_KEY_FILE=$TLS_DIR/client.key
EOF
  if [ "$TLS" = 1 ]; then
    cat <<EOF
# the cluster's CA (https of the api replicas and nodes): the system's CAs plus it
export SSL_CERT_FILE=$TLS_DIR/bundle.pem
export REQUESTS_CA_BUNDLE=$TLS_DIR/bundle.pem
export NODE_EXTRA_CA_CERTS=$TLS_DIR/ca.pem
export VMON_API_CA_FILE=$TLS_DIR/ca.pem
EOF
  fi
}

# check_dirs: the cluster's directories must be reachable by the users its parts run as:
# PostgreSQL runs as `postgres` (initdb writes DIR/pg), and each node's QEMUs run under
# unprivileged ids that must pass through DIR to reach the node's files. A directory whose
# parents a user other than root cannot traverse (root's home, mode 0700) fails deep inside
# initdb with "Permission denied"; say so before anything starts.
check_dirs() {
  local path p blocked="" mode
  for path in "$DIR" "$IMAGES"; do
    p=$(realpath -m -- "$path")
    # Each existing directory from the path up to /: "other" users need to search it.
    while :; do
      if [ -d "$p" ]; then
        mode=$(stat -c '%a' -- "$p")
        if [ $((8#$mode & 1)) -eq 0 ]; then
          blocked="$p (mode $mode, owner $(stat -c '%U' -- "$p"))"
        fi
      fi
      [ "$p" = / ] && break
      p=$(dirname -- "$p")
    done
    if [ -n "$blocked" ]; then
      cat >&2 <<EOF
error: $path is under $blocked, which users other than its owner cannot pass through.
  PostgreSQL runs as the postgres user (initdb would fail with "Permission denied") and the
  nodes' QEMUs run under unprivileged ids; both need to reach their files there.
  Use a directory everyone can traverse, e.g. VMON_CLUSTER_DIR=/var/tmp/vmon-cluster (the
  default), or let others pass through: chmod o+x ${blocked%% (*}
EOF
      return 1
    fi
  done
}

up() {
  local detach=$1
  check_dirs
  install_parts
  mkdir -p "$DIR" "$IMAGES"
  if [ ! -e "$DIR/build/images" ]; then
    mkdir -p "$DIR/build"
    ln -s "$IMAGES" "$DIR/build/images"
  fi
  make_certs
  if [ "$TLS" = 1 ]; then touch "$TLS_DIR/on"; else rm -f "$TLS_DIR/on"; fi
  if [ "$FAULTS" = 1 ]; then
    touch "$DIR/faults-on"
    faults_table
  else
    rm -f "$DIR/faults-on"
  fi
  echo "vmon cluster: guest image (cached in $IMAGES)" >&2
  "$(vmon_bin)" --data-dir "$DIR/build" image build >&2
  for i in 1 2 3; do alive "etcd$i" || start_etcd "$i"; done
  alive pg || start_pg
  start_garage
  wait_port $((P + 31)) etcd1
  wait_port "$PG_PORT" PostgreSQL
  for i in 1 2; do alive "node$i" || start_node "$i"; done
  wait_port $((P + 21)) node1 900
  wait_port $((P + 22)) node2 900
  # api1 first: it makes the default team and its key; api2 then finds them.
  alive api1 || start_api 1
  wait_port "$(api_port 1)" api1 900
  alive api2 || start_api 2
  alive proxy || start_proxy 1
  alive proxy2 || start_proxy 2
  wait_port "$(api_port 2)" api2 900
  wait_port "$PROXY_PORT" proxy
  wait_port "$(proxy_port 2)" proxy2
  echo "vmon cluster: waiting for the base template (built on one node; logs in $DIR/logs)" >&2
  if ! wait_ready "$(api_port 1)" 3600; then
    echo "error: the cluster did not become ready (see $DIR/logs)" >&2
    return 1
  fi
  exports
  if [ "$detach" = 0 ]; then
    trap 'stop_all; exit 0' INT TERM
    echo "vmon cluster: running; Ctrl-C stops it" >&2
    while true; do sleep 3600; done
  fi
}

case "${1:-up}" in
  up) up "$([ "${2:-}" = --detach ] && echo 1 || echo 0)" ;;
  down) stop_all ;;
  start) start "$2" ;;
  kill)
    if alive "$2"; then kill -KILL -- "-$(cat "$DIR/pids/$2.pid")" 2>/dev/null || true; fi
    ;;
  env) exports ;;
  cut) cut_part "$2" "$3" ;;
  heal) heal_part "$2" ;;
  *) echo "usage: $0 up [--detach] | down | start NAME | kill NAME | cut PART SECS | heal PART | env" >&2; exit 2 ;;
esac
