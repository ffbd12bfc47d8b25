#!/usr/bin/env bash
# Cluster benchmark: latency between two nodes of a cluster on one nats-server (JetStream on),
# at a fixed rate, QoS 0 and QoS 1, publishers and subscriber on one node ("same node") or
# the publishers on node a and the subscriber on node b ("cross node", recado bench
# --sub-port), for two mercuriod binaries side by side in the same run (before / after a
# change). recado bench fan-in: 4 publishers, 1 subscriber, 64-byte payloads, --rate in all.
# Path "share" (QoS 1): a publisher on node a, a shared subscription group of two members on
# node b (benches/cluster_share.py, paho-mqtt; --share-rate msg/s, 2000 by default).
# Both nodes are pinned to core 0, nats-server and the load to core 1 (when there are two);
# the configurations alternate within each round, the order reversed every other round.
# Loopback only; temporary configs, ports and JetStream directory; not part of `cargo test`.
#
#   benches/cluster.sh BEFORE_MERCURIOD AFTER_MERCURIOD [--rate R] [--duration S] [--rounds N]
#                      [--share-rate R] [--only-share]
# Environment: RECADO (default: target/release/recado), NATS_SERVER (default: nats-server).
set -euo pipefail

[ $# -ge 2 ] || { sed -n "2,15p" "$0"; exit 2; }
BEFORE=$1 AFTER=$2
shift 2
RATE=10000
DURATION=5
ROUNDS=3
SHARE_RATE=2000
ONLY_SHARE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --share-rate) SHARE_RATE=$2; shift 2 ;;
    --only-share) ONLY_SHARE=1; shift ;;
    --rate) RATE=$2; shift 2 ;;
    --duration) DURATION=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
NATS_SERVER=${NATS_SERVER:-nats-server}
WORK=$(mktemp -d)
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Copied at once: a target directory shared with other checkouts may overwrite them.
cp "$BEFORE" "$WORK/before"
cp "$AFTER" "$WORK/after"
cp "${RECADO:-$TARGET/release/recado}" "$WORK/recado"
PIN_NODES="taskset -c 0"
PIN_OTHER="taskset -c 1"
[ "$(nproc)" -ge 2 ] || PIN_OTHER="taskset -c 0"
command -v taskset >/dev/null || { PIN_NODES=""; PIN_OTHER=""; }

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_log() { # file, text
  for _ in $(seq 400); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  echo "no '$2' in $1" >&2; cat "$1" >&2; return 1
}

NATS_PORT=$(port)
$PIN_OTHER "$NATS_SERVER" -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$WORK/js" > "$WORK/nats.log" 2>&1 &
wait_log "$WORK/nats.log" "Server is ready"

node() { # binary, name, port
  {
    echo "[auth]"; echo "allow_anonymous = true"
    echo "[logging]"; echo 'level = "info"'
    echo "[[listeners]]"; echo 'host = "127.0.0.1"'; echo "port = $3"
    echo "[admin]"; echo "socket = \"$WORK/$2.sock\""
    echo "[cluster]"; echo "nats_urls = [\"nats://127.0.0.1:$NATS_PORT\"]"
    echo "node_name = \"$2\""; echo 'subject_prefix = "bench"'
  } > "$WORK/$2.toml"
  exec $PIN_NODES "$WORK/$1" -c "$WORK/$2.toml" > "$WORK/$2.log" 2>&1
}

run() { # binary, qos, path (same | cross)
  local pa pb
  pa=$(port); pb=$(port)
  node "$1" a "$pa" & local apid=$!
  node "$1" b "$pb" & local bpid=$!
  wait_log "$WORK/a.log" "connected to NATS"
  wait_log "$WORK/b.log" "connected to NATS"
  if [ "$1" = after ]; then wait_log "$WORK/a.log" "JetStream stream ready"; fi
  local sub=()
  [ "$3" = cross ] && sub=(--sub-port "$pb")
  local json
  if [ "$3" = share ]; then
    json=$($PIN_OTHER python3 "$ROOT/benches/cluster_share.py" "$pa" "$pb" --qos "$2" \
      --rate "$SHARE_RATE" --seconds "$DURATION" 2>/dev/null | tail -1 || true)
  else
    json=$($PIN_OTHER "$WORK/recado" bench -s fan-in -P 4 -q "$2" -r "$RATE" -d "$DURATION" \
      --port "$pa" "${sub[@]}" 2>/dev/null | tail -1)
  fi
  kill "$apid" "$bpid" 2>/dev/null || true
  wait "$apid" "$bpid" 2>/dev/null || true
  python3 - "$1" "$2" "$3" "$json" <<'PY'
import json, sys
binary, qos, path, rep = sys.argv[1:5]
try:
    r = json.loads(rep)
except Exception:
    r = {}
if path == "share":
    # cluster_share.py: milliseconds already; lost among the messages sent.
    lat = {"p50": 1000 * (r.get("p50_ms") or 0), "p99": 1000 * (r.get("p99_ms") or 0)}
    r["expected"] = r.get("sent", 0)
else:
    lat = r.get("latency_us", {})
print(f"{binary:<7} {path:<6} {qos:>3} {r.get('delivered_per_s', 0):>10.0f} "
      f"{lat.get('p50', 0)/1000:>8.2f} {lat.get('p99', 0)/1000:>8.2f} "
      f"{100*r.get('lost', 0)/max(r.get('expected', 0), 1):>6.2f}", flush=True)
PY
}

echo "Two nodes on one nats-server (JetStream on); fan-in, 4 publishers, ${RATE} msg/s offered, ${DURATION} s"
printf '%-7s %-6s %3s %10s %8s %8s %6s\n' binary path qos "msg/s" "p50 ms" "p99 ms" "loss%"
for round in $(seq "$ROUNDS"); do
  configs=()
  if [ "$ONLY_SHARE" = 0 ]; then
    for qos in 0 1; do
      for path in same cross; do
        configs+=("before $qos $path" "after $qos $path")
      done
    done
  fi
  configs+=("before 1 share" "after 1 share")
  if [ $((round % 2)) = 0 ]; then
    for ((i = ${#configs[@]} - 1; i >= 0; i--)); do run ${configs[$i]}; done
  else
    for c in "${configs[@]}"; do run $c; done
  fi
done
