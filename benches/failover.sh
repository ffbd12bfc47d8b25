#!/usr/bin/env bash
# Failover benchmark: two mercuriod processes (release build) on one PostgreSQL database, one
# serving and one standby (`standby = true`), on different ports. A persistent session
# (clean session 0) holds queued QoS 1 messages. Then, ROUNDS times: publish a few more
# messages to the serving broker (durable_ack, so a PUBACK means committed), SIGKILL it,
# and measure the time from the kill until the other broker answers a CONNECT of that session
# with a CONNACK with session present (benches/mqtt_probe.py polls every millisecond); then
# restart the killed broker as the new standby and wait until it is blocked on the lock. At
# the end the session is drained: every message published must be there.
# PostgreSQL: MERCURIO_TEST_POSTGRES_URL or a throwaway cluster (benches/pg_cluster.sh).
# Not part of `cargo test`.
#
#   benches/failover.sh [rounds] [messages queued at the start]
set -euo pipefail

ROUNDS=${1:-10}
QUEUED=${2:-1000}
PER_ROUND=100
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
PROBE="python3 $ROOT/benches/mqtt_probe.py"
WORK=$(mktemp -d)
. "$ROOT/benches/pg_cluster.sh"
cleanup() {
  kill -KILL $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  pg_stop
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cd "$ROOT"
if [ -z "${MERCURIOD:-}" ]; then
  # Copied at once: a target directory shared with other checkouts may overwrite it.
  cargo build --release -q -p mercuriod && cp "$TARGET/release/mercuriod" "$WORK/mercuriod"
  MERCURIOD=$WORK/mercuriod
fi

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Polls `cmd...` every 20 ms until it succeeds, for up to $1 seconds.
poll() {
  local seconds=$1; shift
  local deadline=$((SECONDS + seconds))
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.02
  done
}

mkdir "$WORK/pg"
pg_start "$WORK/pg"
URL=$(pg_database bench_failover)

# Broker i (0 or 1): its port, config and log; PID[i] while it runs.
PORT=("$(port)" "$(port)")
PID=(0 0)
start() { # broker, standby (true/false)
  local i=$1 log=$WORK/b$1.log
  cat > "$WORK/b$i.toml" <<EOF
[auth]
allow_anonymous = true
[logging]
level = "info"
connection_messages = false
[[listeners]]
host = "127.0.0.1"
port = ${PORT[$i]}
[admin]
socket = "$WORK/b$i.sock"
[storage]
backend = "postgres"
url = "$URL"
standby = $2
durable_ack = true
EOF
  : > "$log"
  "$MERCURIOD" -c "$WORK/b$i.toml" >> "$log" 2>&1 &
  PID[i]=$!
}

listening() { grep -q "listening on 127.0.0.1:${PORT[$1]}" "$WORK/b$1.log"; }
# A standby logs this line before it asks for the lock, so the lock wait itself is checked too.
waiting() {
  grep -q "waiting for the serving broker to stop" "$WORK/b$1.log" &&
    [ "$(pg_sql "$URL" "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")" = 1 ]
}
alive() { kill -0 "${PID[$1]}" 2>/dev/null || { echo "broker $1 exited:" >&2; cat "$WORK/b$1.log" >&2; exit 1; }; }

start 0 false
poll 30 listening 0 || { alive 0; echo "broker 0 did not listen" >&2; exit 1; }
start 1 true
poll 30 waiting 1 || { alive 1; echo "broker 1 did not wait as a standby" >&2; exit 1; }

$PROBE subscribe "${PORT[0]}" bench-sub bench/t
$PROBE publish "${PORT[0]}" bench-pub bench/t 0 "$QUEUED"
published=$QUEUED
echo "failover: SIGKILL of the serving broker until CONNACK with session present from the standby"
echo "($QUEUED QoS 1 messages queued, $PER_ROUND more before each kill; durable_ack)"

serving=0
times=()
for round in $(seq "$ROUNDS"); do
  $PROBE publish "${PORT[$serving]}" bench-pub bench/t "$published" "$PER_ROUND"
  published=$((published + PER_ROUND))
  other=$((1 - serving))
  alive "$other"
  ms=$($PROBE failover "${PID[$serving]}" "${PORT[$other]}" bench-sub 30)
  wait "${PID[$serving]}" 2>/dev/null || true
  times+=("$ms")
  printf 'round %2d: %5s ms\n' "$round" "$ms"
  start "$serving" true
  poll 30 waiting "$serving" || { alive "$serving"; echo "broker $serving did not wait" >&2; exit 1; }
  serving=$other
done

python3 - "${times[@]}" <<'EOF'
import statistics, sys
t = [int(x) for x in sys.argv[1:]]
print(f"times ms: {' '.join(map(str, t))}")
print(f"median {statistics.median(t):g} ms, max {max(t)} ms, min {min(t)} ms")
EOF

result=$($PROBE drain "${PORT[$serving]}" bench-sub "$published")
echo "queued messages after $ROUNDS failovers: $result (published $published)"
case $result in "distinct=$published "*) ;; *) echo "MESSAGES LOST" >&2; exit 1 ;; esac
