#!/bin/bash
# The CONNECTs of a crashed node's persistent sessions on another node, for two mercuriod
# builds side by side (docs/BENCHMARKS.md, "Sessions across cluster nodes").
#
#   benches/cluster_crash.sh BEFORE_BIN AFTER_BIN [ROUNDS] [SESSIONS]
#
# Per round and per build (the order reversed every other round): a fresh PostgreSQL server
# (benches/pg_cluster.sh) and nats-server (JetStream on, a fresh store) on CPU 1, nodes a and
# b on CPU 0, each on its own database, with `durable_ack`; the after build's nodes list each
# other's database (`peer_storage`). SESSIONS sessions are made on b, each given 10 QoS 1
# messages while away (benches/cluster_crash.py setup); b is killed (SIGKILL) and, once a has
# seen it gone (three heartbeats of 1 s), each session CONNECTs to a in turn.
set -eu
before=$1 after=$2 rounds=${3:-3} n=${4:-50}
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d)
trap 'kill $(cat "$dir"/*.pid 2>/dev/null) 2>/dev/null || true; pg_stop >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
# shellcheck source=benches/pg_cluster.sh
. "$here/pg_cluster.sh"
# shellcheck source=benches/ports.sh
. "$here/ports.sh"

run() { # LABEL BIN
    mkdir -p "$dir/pg"
    PG_PIN="taskset -c 1" pg_start "$dir/pg"
    declare -A db
    db[a]=$(pg_database "node_a") db[b]=$(pg_database "node_b")
    nats=$(free_port); pa=$(free_port); pb=$(free_port)
    rm -rf "$dir/js"
    taskset -c 1 nats-server -a 127.0.0.1 -p "$nats" -js -sd "$dir/js" >/dev/null 2>&1 & echo $! > "$dir/nats.pid"
    wait_port "$nats"
    for node in a:$pa:b b:$pb:a; do
        IFS=: read -r name port other <<< "$node"
        peers=""
        [ "$1" = after ] && peers="peer_storage = { $other = \"${db[$other]}\" }"
        cat > "$dir/$name.toml" <<CONF
[auth]
allow_anonymous = true
[[listeners]]
host = "127.0.0.1"
port = $port
[admin]
socket = "$dir/$name.sock"
[logging]
level = "warn"
[storage]
backend = "postgres"
url = "${db[$name]}"
durable_ack = true
[cluster]
nats_urls = ["nats://127.0.0.1:$nats"]
node_name = "$name"
heartbeat_interval = 1
$peers
CONF
        taskset -c 0 "$2" -c "$dir/$name.toml" >"$dir/$name.log" 2>&1 & echo $! > "$dir/$name.pid"
        wait_port "$port"
    done
    sleep 3 # three heartbeats: each node hears the other
    taskset -c 1 python3 "$here/cluster_crash.py" setup "$n" "$pb"
    b=$(cat "$dir/b.pid"); rm -f "$dir/b.pid"
    kill -9 "$b"; { wait "$b"; } 2>/dev/null || true
    sleep 4 # a sees b gone after three missed heartbeats
    echo "$1 $(taskset -c 1 python3 "$here/cluster_crash.py" connect "$n" "$pa")"
    kill $(cat "$dir"/a.pid "$dir"/nats.pid); wait 2>/dev/null || true
    rm -f "$dir"/*.pid "$dir"/*.sock
    pg_stop >/dev/null
    rm -rf "$dir/pg"
}

for r in $(seq "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then run before "$before"; run after "$after"
    else run after "$after"; run before "$before"; fi
done
