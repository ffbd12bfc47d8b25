#!/usr/bin/env bash
# Persistence benchmark: QoS 1 messages/s into an offline persistent session, then drained,
# for mercuriod with memory, SQLite, PostgreSQL (each file backend with and without
# durable_ack), and mosquitto with persistence. Each broker is pinned to core 0, the load
# generator to core 1 (when there are two). PostgreSQL: MERCURIO_TEST_POSTGRES_URL, or a
# throwaway cluster (benches/pg_cluster.sh; fsync on), pinned to the broker's core; skipped
# when there is neither. Not part of `cargo test`.
#
#   benches/persistence.sh [messages] [payload bytes]
set -euo pipefail

N=${1:-10000}
SIZE=${2:-64}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=$(mktemp -d)
. "$ROOT/benches/pg_cluster.sh"
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  pg_stop
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cd "$ROOT"
# Copied at once: a target directory shared with other checkouts may overwrite them.
cargo build --release -q -p mercuriod && cp "$TARGET/release/mercuriod" "$WORK/mercuriod"
cargo build --release -q -p mercurio --example persistence_load &&
  cp "$TARGET/release/examples/persistence_load" "$WORK/persistence_load"
MERCURIOD=$WORK/mercuriod
LOAD=$WORK/persistence_load
PIN_BROKER="taskset -c 0"
PIN_LOAD="taskset -c 1"
[ "$(nproc)" -ge 2 ] || PIN_LOAD=""
command -v taskset >/dev/null || { PIN_BROKER=""; PIN_LOAD=""; }

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_port() {
  for _ in $(seq 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "broker did not listen on $1" >&2; return 1
}

run() { # name, command...
  local name=$1; shift
  local p; p=$(port)
  "$@" "$p" &
  local pid=$!
  wait_port "$p"
  local result; result=$($PIN_LOAD "$LOAD" "127.0.0.1:$p" "$N" "$SIZE")
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
  printf '%-30s %s\n' "$name" "$result"
}

mercurio() { # backend, durable_ack, port
  local cfg=$WORK/m-$1-$2.toml
  rm -f "$WORK"/m.db*
  {
    echo "[server]"; echo "max_queued_messages = $((N * 2))"
    echo "[auth]"; echo "allow_anonymous = true"
    echo "[logging]"; echo 'level = "warn"'
    echo "[[listeners]]"; echo 'host = "127.0.0.1"'; echo "port = $3"
    echo "[admin]"; echo "socket = \"$WORK/m.sock\""
    echo "[storage]"; echo "backend = \"$1\""
    if [ "$1" = sqlite ]; then echo "path = \"$WORK/m.db\""; echo "durable_ack = $2"; fi
    if [ "$1" = postgres ]; then
      echo "url = \"$(pg_database "bench_${2}_$3")\""; echo "durable_ack = $2"
    fi
  } > "$cfg"
  exec $PIN_BROKER "$MERCURIOD" -c "$cfg" > "$WORK/m.log" 2>&1
}
mercurio_memory() { mercurio memory false "$1"; }
mercurio_sqlite() { mercurio sqlite false "$1"; }
mercurio_durable() { mercurio sqlite true "$1"; }
mercurio_postgres() { mercurio postgres false "$1"; }
mercurio_postgres_durable() { mercurio postgres true "$1"; }

mosquitto_persist() {
  local cfg=$WORK/mosquitto.conf
  mkdir -p "$WORK/mosq"
  rm -f "$WORK"/mosq/*
  {
    echo "listener $1 127.0.0.1"; echo "allow_anonymous true"
    echo "persistence true"; echo "persistence_location $WORK/mosq/"
    echo "max_queued_messages $((N * 2))"; echo "log_dest none"
  } > "$cfg"
  exec $PIN_BROKER /usr/sbin/mosquitto -c "$cfg"
}

echo "QoS 1, $N messages of $SIZE bytes into an offline persistent session, then drained"
run "mercurio memory" mercurio_memory
run "mercurio sqlite" mercurio_sqlite
run "mercurio sqlite+durable_ack" mercurio_durable
mkdir "$WORK/pg"
# The database server shares the broker's core, as SQLite's thread does.
if PG_PIN=$PIN_BROKER pg_start "$WORK/pg"; then
  run "mercurio postgres" mercurio_postgres
  run "mercurio postgres+durable_ack" mercurio_postgres_durable
else
  echo "PostgreSQL unavailable: skipped"
fi
if [ -x /usr/sbin/mosquitto ]; then
  run "mosquitto persistence" mosquitto_persist
else
  echo "mosquitto not installed: skipped"
fi
