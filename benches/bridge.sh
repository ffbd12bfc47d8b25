#!/usr/bin/env bash
# Bridge benchmark: one bridge carrying QoS 1 messages from a local broker to a remote one,
# Mercurio's bridge (memory and SQLite storage) side by side with mosquitto's bridge in the
# same run, toward the same remote (mosquitto). Two numbers per local broker:
#   - forwarding: mercurio-bench fan-in (4 publishers on the local broker, QoS 1, one
#     subscriber on the remote, --sub-port), delivered messages/s and latency through the bridge;
#   - drain: the remote is frozen (SIGSTOP), N QoS 1 messages are published into the local
#     broker (they queue for the bridge), the remote is thawed (SIGCONT): messages/s until the
#     remote's subscriber has all N.
# The local broker is pinned to core 0, the remote and the load to core 1 (when there are
# two). Loopback only; temporary configs and ports; not part of `cargo test`.
#
#   benches/bridge.sh [--duration S] [--messages N] [--rounds R] [--no-build]
# Environment: MERCURIOD (the mercuriod binary to use), MOSQUITTO (default /usr/sbin/mosquitto).
set -euo pipefail

DURATION=5
N=20000
ROUNDS=3
BUILD=1
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION=$2; shift 2 ;;
    --messages) N=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    -h|--help) sed -n "2,16p" "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
MOSQUITTO=${MOSQUITTO:-/usr/sbin/mosquitto}
WORK=$(mktemp -d)
cleanup() {
  kill -CONT $(jobs -p) 2>/dev/null || true
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cd "$ROOT"
if [ "$BUILD" = 1 ]; then
  cargo build --release -q -p mercuriod -p mercurio-bench
fi
# Copied at once: a target directory shared with other checkouts may overwrite them.
cp "${MERCURIOD:-$TARGET/release/mercuriod}" "$WORK/mercuriod"
cp "$TARGET/release/mercurio-bench" "$WORK/mercurio-bench"
PIN_LOCAL="taskset -c 0"
PIN_OTHER="taskset -c 1"
[ "$(nproc)" -ge 2 ] || PIN_OTHER="taskset -c 0"
command -v taskset >/dev/null || { PIN_LOCAL=""; PIN_OTHER=""; }

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "broker did not listen on $1" >&2; return 1
}

remote() { # port
  printf 'listener %s 127.0.0.1\nallow_anonymous true\nmax_queued_messages %s\nlog_dest none\n' \
    "$1" "$((N * 2))" > "$WORK/remote.conf"
  exec $PIN_OTHER "$MOSQUITTO" -c "$WORK/remote.conf"
}

local_mercurio() { # backend, port, remote port
  rm -f "$WORK"/m.db*
  {
    echo "[server]"; echo "max_queued_messages = $((N * 2))"
    echo "[auth]"; echo "allow_anonymous = true"
    echo "[logging]"; echo 'level = "warn"'
    echo "[[listeners]]"; echo 'host = "127.0.0.1"'; echo "port = $2"
    echo "[admin]"; echo "socket = \"$WORK/m.sock\""
    echo "[storage]"; echo "backend = \"$1\""
    [ "$1" = sqlite ] && echo "path = \"$WORK/m.db\""
    echo "[[bridges]]"; echo 'name = "bench"'; echo "addresses = [\"127.0.0.1:$3\"]"
    echo "[[bridges.topics]]"; echo 'pattern = "bench/#"'; echo 'direction = "out"'; echo "qos = 1"
  } > "$WORK/local.toml"
  exec $PIN_LOCAL "$WORK/mercuriod" -c "$WORK/local.toml" > "$WORK/local.log" 2>&1
}
local_mercurio_memory() { local_mercurio memory "$@"; }
local_mercurio_sqlite() { local_mercurio sqlite "$@"; }

local_mosquitto() { # port, remote port
  printf 'listener %s 127.0.0.1\nallow_anonymous true\nmax_queued_messages %s\nlog_dest none\n' \
    "$1" "$((N * 2))" > "$WORK/local.conf"
  printf 'connection bench\naddress 127.0.0.1:%s\ntopic bench/# out 1\nrestart_timeout 1\n' \
    "$2" >> "$WORK/local.conf"
  exec $PIN_LOCAL "$MOSQUITTO" -c "$WORK/local.conf"
}

# Waits until a message published on the local broker reaches the remote (bridge up).
wait_bridge() { # local port, remote port
  for _ in $(seq 100); do
    mosquitto_sub -p "$2" -t bench/probe -C 1 -W 1 > /dev/null 2>&1 &
    local sub=$!
    sleep 0.2
    mosquitto_pub -p "$1" -t bench/probe -m x -q 1 > /dev/null 2>&1 || true
    if wait "$sub"; then return 0; fi
  done
  echo "bridge did not come up" >&2; return 1
}

now() { date +%s.%N; }

run() { # name, local function
  local name=$1 fn=$2
  local pr pl
  pr=$(port); pl=$(port)
  remote "$pr" & local rpid=$!
  wait_port "$pr"
  "$fn" "$pl" "$pr" & local lpid=$!
  wait_port "$pl"
  wait_bridge "$pl" "$pr"
  local json
  json=$($PIN_OTHER "$WORK/mercurio-bench" -s fan-in -P 4 -q 1 --port "$pl" --sub-port "$pr" \
    -d "$DURATION" --label "$name" 2>/dev/null | tail -1)
  # Drain: freeze the remote, queue N messages in the local broker, thaw, time the delivery.
  mosquitto_sub -p "$pr" -t 'bench/drain' -q 1 -C "$N" > /dev/null &
  local sub=$!
  sleep 0.3
  kill -STOP "$rpid"
  seq 1 "$N" | mosquitto_pub -p "$pl" -t bench/drain -q 1 -l
  local t0 t1
  t0=$(now)
  kill -CONT "$rpid"
  wait "$sub"
  t1=$(now)
  kill "$lpid" "$rpid" 2>/dev/null || true
  wait "$lpid" "$rpid" 2>/dev/null || true
  python3 - "$name" "$N" "$t0" "$t1" "$json" <<'PY'
import json, sys
name, n, t0, t1, rep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
try:
    r = json.loads(rep)
except Exception:
    r = {}
lat = r.get("latency_us", {})
print(f"{name:<22} {r.get('delivered_per_s', 0):>12.0f} {lat.get('p50', 0)/1000:>9.2f} "
      f"{lat.get('p99', 0)/1000:>9.2f} {100*r.get('lost',0)/max(r.get('expected',0),1):>6.2f} "
      f"{n/(t1-t0):>12.0f}")
PY
}

echo "One bridge, QoS 1, remote: mosquitto; forwarding over ${DURATION}s (4 publishers), drain of $N messages"
printf '%-22s %12s %9s %9s %6s %12s\n' "local broker" "fwd msg/s" "p50 ms" "p99 ms" "loss%" "drain msg/s"
for round in $(seq "$ROUNDS"); do
  run "mercurio memory" local_mercurio_memory
  run "mercurio sqlite" local_mercurio_sqlite
  run "mosquitto" local_mosquitto
done
