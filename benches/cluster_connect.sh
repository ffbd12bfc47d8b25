#!/bin/sh
# CONNECT latency of a persistent session on a two-node cluster, for two mercuriod builds side
# by side (docs/BENCHMARKS.md, "Sessions across cluster nodes").
#
#   benches/cluster_connect.sh BEFORE_BIN AFTER_BIN [ROUNDS] [CONNECTS]
#
# Per round and per build (the order reversed every other round): nats-server (JetStream on,
# a fresh store) on CPU 1, nodes a and b (memory storage) on CPU 0, then
# benches/cluster_connect.py on CPU 1: CONNECTS connections to node a only ("same"), then as
# many alternating a and b ("alternate").
set -eu
before=$1 after=$2 rounds=${3:-5} n=${4:-400}
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d)
trap 'kill $(cat "$dir"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$dir"' EXIT
# shellcheck source=benches/ports.sh
. "$here/ports.sh"

run() { # LABEL BIN
    nats=$(free_port); pa=$(free_port); pb=$(free_port)
    # JetStream on (as by default in cluster mode): the stream, and the session registry.
    rm -rf "$dir/js"
    taskset -c 1 nats-server -a 127.0.0.1 -p "$nats" -js -sd "$dir/js" >/dev/null 2>&1 & echo $! > "$dir/nats.pid"
    wait_port "$nats"
    for node in a:$pa b:$pb; do
        name=${node%:*} port=${node#*:}
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
[cluster]
nats_urls = ["nats://127.0.0.1:$nats"]
node_name = "$name"
heartbeat_interval = 1
CONF
        taskset -c 0 "$2" -c "$dir/$name.toml" >"$dir/$name.log" 2>&1 & echo $! > "$dir/$name.pid"
        wait_port "$port"
    done
    sleep 3 # three heartbeats: each node hears the other
    echo "$1 same      $(taskset -c 1 python3 "$here/cluster_connect.py" "$n" "$pa")"
    echo "$1 alternate $(taskset -c 1 python3 "$here/cluster_connect.py" "$n" "$pa" "$pb")"
    kill $(cat "$dir"/a.pid "$dir"/b.pid "$dir"/nats.pid); wait 2>/dev/null || true
    rm -f "$dir"/*.pid "$dir"/*.sock
}

for r in $(seq "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then run before "$before"; run after "$after"
    else run after "$after"; run before "$before"; fi
done
