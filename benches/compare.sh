#!/usr/bin/env bash
# Load benchmark: Mercurio (mercuriod, release) side by side with mosquitto (and rumqttd when
# installed), driven by `recado bench`. Each broker is pinned to CPU 0 and the load generator
# to CPU 1 (taskset); every scenario runs against each broker in alternation, fresh broker
# process per run, for several rounds; the table shows medians, [min-max] and ratios to
# mosquitto. Loopback only; each broker runs with its own temporary config on its own port
# (never a system service). Every run's clients connect from a loopback network of their own
# (127.A.B.0/24, recado's --source-net), so no run meets the local ports the run before left
# in TIME_WAIT. The ratio column is the median [min-max] of the rounds' own ratios (each
# round's brokers ran back to back), the spread a comparison's stability is judged by.
#
# Usage: benches/compare.sh [--rounds N] [--duration S] [--only REGEX] [--no-build] [--out DIR]
#   --rounds N     rounds (default 3)
#   --duration S   seconds of publishing per saturation run (default 4)
#   --fleet-devices N   devices of the fleet scenarios (default 10000)
#   --fleet-interval S  seconds between two messages of a device (default 2)
#   --fleet-window S    measured window of the fleet scenarios (default 30)
#   --storms N     connect storms per broker and round in the storm scenarios (default 7)
#   --only REGEX   run only the scenarios whose name matches (e.g. 'fanin|pairs')
#   --no-build     use the binaries already built
#   --out DIR      keep raw results there (default: a temporary directory, printed)
#   --table DIR    only print the table of the results kept in DIR (from --out)
#   --nice N       run brokers and the load generator at this nice level (e.g. -10 on a machine
#                  where other jobs compete for the CPUs; needs root for a negative level)
# Environment: CARGO_TARGET_DIR (where the release binaries are), MERCURIOD and RECADO
# (binaries to use instead of those of CARGO_TARGET_DIR), MOSQUITTO (default
# /usr/sbin/mosquitto), RUMQTTD (default: rumqttd on PATH), BROKER_CPU (0), BENCH_CPU (1),
# MERCURIO_SERVER_EXTRA (TOML lines added to mercuriod's [server] table, e.g. to run an
# older build with the settings it had).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
ROUNDS=3
DURATION=4
ONLY=.
BUILD=1
OUT=
NICE=0
TABLE_ONLY=
FLEET_DEVICES=10000
FLEET_INTERVAL=2
FLEET_WINDOW=30
STORMS=7
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS=$2; shift 2 ;;
        --duration) DURATION=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --out) OUT=$2; shift 2 ;;
        --nice) NICE=$2; shift 2 ;;
        --table) TABLE_ONLY=$2; shift 2 ;;
        --fleet-devices) FLEET_DEVICES=$2; shift 2 ;;
        --fleet-interval) FLEET_INTERVAL=$2; shift 2 ;;
        --fleet-window) FLEET_WINDOW=$2; shift 2 ;;
        --storms) STORMS=$2; shift 2 ;;
        -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done

print_table() {
    python3 - "$@" <<'PY'
import glob, json, os, re, statistics, sys

work, brokers = sys.argv[1], sys.argv[2:]
runs = {}  # (scenario, broker) -> list of (report, meta, round)
order = []
for path in sorted(glob.glob(os.path.join(work, "*.json"))):
    scn, broker, rnd = os.path.basename(path)[:-5].rsplit(".", 2)
    try:
        rep = json.load(open(path))
    except Exception:
        rep = {}
    try:
        meta = json.loads(re.sub(r':\s*(-?)\.', r': \g<1>0.', open(path[:-5] + ".meta").read()))
    except Exception:
        meta = {}
    runs.setdefault((scn, broker), []).append((rep, meta, rnd))
    if scn not in order:
        order.append(scn)

def kind(scn):
    return ("storm" if scn.startswith("storm") else "flood" if scn.startswith("pingflood") else "idle" if scn.startswith("idle")
            else "sessions" if scn.startswith("sessions") else "persist" if scn.startswith("persistent")
            else "sweep" if scn.startswith("sweep") else "rate" if scn.startswith("lat")
            else "fleet" if scn.startswith("fleet") else "sat")

def metrics(scn, rep, meta):
    k = kind(scn)
    lat = rep.get("latency_us", {})
    m = {}
    if not rep:
        return m
    if k == "storm":
        s = rep.get("storm", {})
        m["connects/s, median storm"] = s.get("median_per_s", 0)
        m["connects/s, best storm"] = s.get("best_per_s", 0)
        m["connect p99 us, median storm"] = s.get("median_p99_us", 0)
        m["broker CPU us per connect, median storm"] = s.get("median_cpu_us_per_connect", 0)
        m["failed connects"] = s.get("failed", 0)
        return m
    if k == "sat":
        m["delivered msg/s"] = rep.get("delivered_per_s", 0)
        m["acknowledged but lost"] = rep.get("lost", 0)
        m["loss %"] = 100 * rep.get("lost", 0) / max(rep.get("expected", 0), 1)
        m["duplicates"] = rep.get("duplicates", 0)
        m["latency p50 us"] = lat.get("p50", 0)
        m["latency p99 us"] = lat.get("p99", 0)
    elif k == "flood":
        f = rep.get("flood", {})
        m["MiB of PINGREQ written"] = f.get("mib_written", 0)
        m["flooder closed (1 = yes)"] = 1 if f.get("closed") else 0
        m["bystander pings lost"] = f.get("pings_lost", 0)
        m["bystander worst ping ms"] = f.get("ping_worst_ms", 0)
        m["broker RSS growth MiB"] = (meta.get("rss_peak_kb", 0) - meta.get("rss_base_kb", 0)) / 1024
    elif k == "rate":
        m["latency p50 us"] = lat.get("p50", 0)
        m["latency p99 us"] = lat.get("p99", 0)
        m["latency p99.9 us"] = lat.get("p999", 0)
        m["latency max us"] = lat.get("max", 0)
        m["loss %"] = 100 * rep.get("lost", 0) / max(rep.get("expected", 0), 1)
    elif k == "idle":
        i = rep.get("idle", {})
        m["connects/s"] = i.get("connect_per_s", 0)
        m["connect p99 us"] = i.get("connect_p99_us", 0)
        n = max(i.get("connected", 0), 1)
        m["broker KiB/connection"] = (meta.get("rss_peak_kb", 0) - meta.get("rss_base_kb", 0)) / n
    elif k == "sessions":
        s = rep.get("sessions", {})
        m["restart to listening s"] = meta.get("restart_s", 0)
        m["reconnect s"] = s.get("connect_s", 0)
        m["restart to all connected s"] = meta.get("restart_s", 0) + s.get("connect_s", 0)
        m["reconnects/s"] = s.get("connect_per_s", 0)
        m["session present"] = s.get("session_present", 0)
        m["failed"] = s.get("failed", 0)
        # The reconnect run's: the reconnects, then every client's DISCONNECT.
        m["broker CPU s"] = meta.get("cpu_s", 0)
    elif k == "persist":
        p = rep.get("persistent", {})
        m["drain msg/s"] = p.get("drain_per_s", 0)
        m["publish msg/s (acked)"] = rep.get("sent_per_s", 0)
        m["lost"] = rep.get("lost", 0)
        m["duplicates"] = rep.get("duplicates", 0)
    elif k == "fleet":
        f = rep.get("fleet", {})
        m["offered msg/s"] = f.get("offered_per_s", 0)
        m["delivered msg/s"] = rep.get("delivered_per_s", 0)
        m["acknowledged but lost"] = rep.get("lost", 0)
        m["latency p50 us"] = lat.get("p50", 0)
        m["latency p99 us"] = lat.get("p99", 0)
        m["latency max us"] = lat.get("max", 0)
        # Over the measured window only (recado reads /proc/PID/stat), not the connects.
        if f.get("broker_cpu_pct") is not None:
            m["broker CPU % (window)"] = f["broker_cpu_pct"]
        m["broker RSS MiB (end)"] = (f.get("broker_rss_kib") or 0) / 1024
    elif k == "sweep":
        m["max rate msg/s"] = rep.get("sweep", {}).get("max_rate", 0)
        m["latency p99 us at max"] = lat.get("p99", 0)
    if meta.get("wall_s") and k != "fleet":
        m["broker CPU %"] = 100 * meta.get("cpu_s", 0) / meta["wall_s"]
    m["broker peak RSS MiB"] = meta.get("rss_peak_kb", 0) / 1024
    return m

def fmt(v):
    if v >= 100000: return f"{v/1e6:.2f}M" if v >= 1e6 else f"{v/1e3:.0f}k"
    if v >= 1000: return f"{v/1e3:.1f}k"
    if v == int(v): return str(int(v))
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"

cols = brokers
head = "| scenario | metric | " + " | ".join(f"{b} median [min-max]" for b in cols)
ratios = [b for b in cols if b != "mosquitto"]
head += "".join(f" | {b}/mosquitto, per round: median [min-max]" for b in ratios) + " |"
print(head)
print("|" + "---|" * (2 + len(cols) + len(ratios)))
for scn in order:
    per = {b: [metrics(scn, r, m) for r, m, _ in runs.get((scn, b), [])] for b in cols}
    rounds = {b: [rnd for _, _, rnd in runs.get((scn, b), [])] for b in cols}
    names = []
    for b in cols:
        for m in per[b]:
            for n in m:
                if n not in names:
                    names.append(n)
    for n in names:
        cells, med = [], {}
        for b in cols:
            vals = [m[n] for m in per[b] if n in m]
            if not vals:
                cells.append("-"); continue
            med[b] = statistics.median(vals)
            cells.append(f"{fmt(med[b])} [{fmt(min(vals))}-{fmt(max(vals))}]" if len(vals) > 1 else fmt(med[b]))
        rs = []
        mosq = {r: m[n] for r, m in zip(rounds["mosquitto"], per["mosquitto"]) if n in m} if "mosquitto" in per else {}
        for b in ratios:
            # Each round's own ratio (its brokers ran back to back): median [min-max].
            own = [m[n] / mosq[r] for r, m in zip(rounds[b], per[b]) if n in m and mosq.get(r)]
            if len(own) > 1:
                rs.append(f"{statistics.median(own):.2f}x [{min(own):.2f}-{max(own):.2f}]")
            elif b in med and med.get("mosquitto"):
                rs.append(f"{med[b] / med['mosquitto']:.2f}x")
            else:
                rs.append("-")
        print(f"| {scn} | {n} | " + " | ".join(cells) + "".join(f" | {r}" for r in rs) + " |")
    if kind(scn) == "storm":
        # Storm k of one broker and storm k of the other ran seconds apart: the ratio of each
        # such pair, over every round, is the steadiest comparison a shared machine allows.
        rates = {b: {(rnd, k): v for r, _, rnd in runs.get((scn, b), [])
                     for k, v in enumerate(r.get("storm", {}).get("rates_per_s", [])) if v} for b in cols}
        cells = [fmt(statistics.median(rates[b].values())) if rates[b] else "-" for b in cols]
        rs = []
        for b in ratios:
            own = sorted(v / rates["mosquitto"][key] for key, v in rates[b].items()
                         if rates["mosquitto"].get(key))
            if len(own) >= 4:
                q = statistics.quantiles(own, n=4)
                rs.append(f"{statistics.median(own):.2f}x [{q[0]:.2f}-{q[2]:.2f}], {len(own)} pairs")
            else:
                rs.append("-")
        print(f"| {scn} | connects/s, every storm; ratio: median [quartiles] of paired storms | "
              + " | ".join(cells) + "".join(f" | {r}" for r in rs) + " |")
PY
}

if [ -n "$TABLE_ONLY" ]; then
    brokers=(mosquitto mercurio)
    ls "$TABLE_ONLY"/*.rumqttd.*.json >/dev/null 2>&1 && brokers+=(rumqttd)
    print_table "$TABLE_ONLY" "${brokers[@]}"
    exit 0
fi

BROKER_CPU=${BROKER_CPU:-0}
BENCH_CPU=${BENCH_CPU:-1}
MOSQUITTO=${MOSQUITTO:-/usr/sbin/mosquitto}
RUMQTTD=${RUMQTTD:-$(command -v rumqttd || true)}

if [ "$BUILD" = 1 ]; then
    (cd "$ROOT" && cargo build --release -q -p mercuriod -p recado)
fi
RECADO=${RECADO:-$TARGET/release/recado}
MERCURIOD=${MERCURIOD:-$TARGET/release/mercuriod}
for b in "$RECADO" "$MERCURIOD"; do
    [ -x "$b" ] || { echo "missing $b (build with cargo build --release)" >&2; exit 1; }
done

BROKERS=(mosquitto mercurio)
if [ ! -x "$MOSQUITTO" ]; then
    echo "mosquitto not found at $MOSQUITTO: apt-get install mosquitto" >&2
    exit 1
fi
if [ -n "$RUMQTTD" ] && [ -x "$RUMQTTD" ]; then
    BROKERS+=(rumqttd)
else
    echo "rumqttd is not installed (cargo install rumqttd): skipping it" >&2
fi

WORK=${OUT:-$(mktemp -d /tmp/mercurio-compare.XXXXXX)}
mkdir -p "$WORK"
echo "results in $WORK" >&2
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# Below the ephemeral range: a port in it can still be held by a client socket of the run
# before (the generator's thousands of connections), and the broker then fails to bind.
read -r EPH_LO _ </proc/sys/net/ipv4/ip_local_port_range
PORT_SPAN=$((EPH_LO > 13000 ? EPH_LO - 13000 : 10000))
PORT_BASE=$((10000 + RANDOM % PORT_SPAN))
declare -A PORT=([mosquitto]=$PORT_BASE [mercurio]=$((PORT_BASE + 1)) [rumqttd]=$((PORT_BASE + 2)))

# Equivalent settings: loopback listener, anonymous, no persistence to disk, 20
# outbound messages in flight per client, 1,000,000 queued messages per session (any QoS), quiet
# logs, TCP_NODELAY (Mercurio always sets it; mosquitto's default, Nagle on, adds 20-40 ms
# to its p99 latency even at 150 msg/s).
cat > "$WORK/mosquitto.conf" <<CONF
listener ${PORT[mosquitto]} 127.0.0.1
allow_anonymous true
persistence false
max_inflight_messages 20
max_queued_messages 1000000
set_tcp_nodelay true
log_dest none
CONF
cat > "$WORK/mercuriod.toml" <<CONF
[server]
max_inflight = 20
max_queued_messages = 1000000
max_queued_qos0_messages = 1000000
${MERCURIO_SERVER_EXTRA:-}

[[listeners]]
host = "127.0.0.1"
port = ${PORT[mercurio]}

[auth]
allow_anonymous = true

[logging]
level = "warn"
connection_messages = false
CONF
cat > "$WORK/rumqttd.toml" <<CONF
id = 0

[router]
id = 0
max_connections = 100010
max_outgoing_packet_count = 200
max_segment_size = 104857600
max_segment_count = 10

[v4.1]
name = "v4-1"
listen = "127.0.0.1:${PORT[rumqttd]}"
next_connection_delay_ms = 0
    [v4.1.connections]
    connection_timeout_ms = 60000
    max_payload_size = 1048576
    max_inflight_count = 100
    dynamic_filters = true
CONF

# The same settings with persistence to disk, in DIR (the sessions scenario): mosquitto's
# persistence file (written when it stops), Mercurio's SQLite database.
persistent_configs() { # DIR
    local dir=$1
    mkdir -p "$dir"
    { cat "$WORK/mosquitto.conf"; printf 'persistence true\npersistence_location %s/\n' "$dir"; } \
        | grep -v '^persistence false' >"$dir/mosquitto.conf"
    { cat "$WORK/mercuriod.toml"; printf '\n[storage]\nbackend = "sqlite"\npath = "%s/mercurio.db"\n' "$dir"; } \
        >"$dir/mercuriod.toml"
    # mosquitto started as root runs as the user mosquitto: let it write its file there.
    if [ "$(id -u)" = 0 ] && id mosquitto >/dev/null 2>&1; then
        chmod a+x "$WORK"
        chown mosquitto "$dir"
    fi
}

start_broker() { # name [configuration directory] -> sets BPID, and START_S (seconds to listen)
    local name=$1 dir=${2:-$WORK}
    local t0; t0=$(date +%s.%N)
    case "$name" in
        mosquitto) nice -n "$NICE" taskset -c "$BROKER_CPU" "$MOSQUITTO" -c "$dir/mosquitto.conf" >>"$WORK/$name.log" 2>&1 & ;;
        mercurio) nice -n "$NICE" taskset -c "$BROKER_CPU" "$MERCURIOD" -c "$dir/mercuriod.toml" >>"$WORK/$name.log" 2>&1 & ;;
        rumqttd) nice -n "$NICE" taskset -c "$BROKER_CPU" "$RUMQTTD" -c "$dir/rumqttd.toml" >>"$WORK/$name.log" 2>&1 & ;;
    esac
    BPID=$!
    for _ in $(seq 1 3000); do
        if (exec 3<>"/dev/tcp/127.0.0.1/${PORT[$name]}") 2>/dev/null; then
            START_S=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }')
            return 0
        fi
        kill -0 "$BPID" 2>/dev/null || { echo "$name did not start:" >&2; tail -n 20 "$WORK/$name.log" >&2; return 1; }
        sleep 0.01
    done
    echo "$name: port ${PORT[$name]} not open" >&2
    return 1
}

stop_broker() {
    kill -TERM "$BPID" 2>/dev/null || true
    # Up to 30 s: a broker with persistence writes its state as it stops.
    for _ in $(seq 1 600); do kill -0 "$BPID" 2>/dev/null || break; sleep 0.05; done
    kill -KILL "$BPID" 2>/dev/null || true
    wait "$BPID" 2>/dev/null || true
}

BPID=
STORM_PIDS=()
trap '[ -n "$BPID" ] && stop_broker; for p in "${STORM_PIDS[@]}"; do BPID=$p; stop_broker; done' EXIT

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# CPU time of a process's live threads in nanoseconds (schedstat: finer than the ticks of stat).
# %.0f, not %d: awk's %d stops at 2^31 - 1, 2.1 s of CPU, which a broker passes within a round.
cpu_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { printf "%.0f\n", s }'; }

# The storm kind: every broker up at once, each on the broker CPU and idle but in its turn;
# then STORMS connect storms per broker (recado's idle scenario, each from fresh source
# addresses, held 0.1 s), the brokers taking turns and the order swapping from storm to storm.
# Two brokers' storms seconds apart share the machine's condition of those seconds, where runs
# minutes apart on a shared machine do not. Per broker and round: the median and best storm.
run_storms() { # name, recado arguments, round
    local name=$1 args=$2 round=$3 broker k
    declare -A spid=()
    STORM_PIDS=()
    for broker in "${BROKERS[@]}"; do
        start_broker "$broker" || return 1
        spid[$broker]=$BPID
        STORM_PIDS+=("$BPID")
    done
    BPID=
    sleep 0.2
    mkdir -p "$WORK/storms"
    for k in $(seq 1 "$STORMS"); do
        local order=("${BROKERS[@]}")
        if [ $(((round + k) % 2)) = 0 ]; then
            order=(); for ((i=${#BROKERS[@]}-1; i>=0; i--)); do order+=("${BROKERS[$i]}"); done
        fi
        for broker in "${order[@]}"; do
            local out="$WORK/storms/$name.$broker.$round.$k"
            next_source_net
            local c0; c0=$(cpu_ns "${spid[$broker]}")
            # shellcheck disable=SC2086
            nice -n "$NICE" taskset -c "$BENCH_CPU" "$RECADO" bench $args -d 0.1 -p "${PORT[$broker]}" --label "$broker" \
                --source-net "$SOURCE_NET" >"$out.out" 2>"$out.err" || true
            echo $(($(cpu_ns "${spid[$broker]}") - c0)) >"$out.cpu_ns"
        done
    done
    for broker in "${BROKERS[@]}"; do
        BPID=${spid[$broker]}
        stop_broker
        python3 - "$WORK/storms" "$name.$broker.$round" >"$WORK/$name.$broker.$round.json" <<'PY'
import glob, json, statistics, sys
d, stem = sys.argv[1], sys.argv[2]
rates, by_storm, p99s, cpu, failed = [], [], [], [], 0
# Storm by storm in the order they ran (None for one that reported nothing), so that storm k
# of one broker is compared with storm k of the other.
for out in sorted(glob.glob(f"{d}/{stem}.*.out"), key=lambda p: int(p.rsplit(".", 2)[1])):
    try:
        i = json.loads(open(out).read().strip().splitlines()[-1])["idle"]
    except Exception:
        by_storm.append(None)
        continue
    by_storm.append(i["connect_per_s"])
    failed += i["failed"]
    rates.append(i["connect_per_s"])
    p99s.append(i["connect_p99_us"])
    ns = int(open(out[:-4] + ".cpu_ns").read() or 0)
    # The CPU of the whole storm (connects, the 0.1 s hold, the disconnects) per connection.
    cpu.append(ns / 1000 / max(i["connected"], 1))
print(json.dumps({"storm": {"storms": len(rates), "rates_per_s": by_storm, "failed": failed,
    "median_per_s": statistics.median(rates) if rates else 0, "best_per_s": max(rates, default=0),
    "median_p99_us": statistics.median(p99s) if p99s else 0,
    "median_cpu_us_per_connect": statistics.median(cpu) if cpu else 0}}))
PY
        echo '{}' >"$WORK/$name.$broker.$round.meta"
        printf '%-16s %-10s round %s: %s\n' "$name" "$broker" "$round" "$(cat "$WORK/$name.$broker.$round.json")" >&2
    done
    STORM_PIDS=()
    BPID=
}
rss_kb() { awk '/^VmRSS/{print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }

# name | kind | recado bench arguments
SCENARIOS=(
    "fanin-q0|sat|-s fan-in -P 4 -q 0"
    "fanin-q1|sat|-s fan-in -P 4 -q 1"
    "fanin-q2|sat|-s fan-in -P 4 -q 2"
    "fanin-q0-4k|sat|-s fan-in -P 4 -q 0 --payload 4096"
    "fanout-q0|sat|-s fan-out -K 10 -q 0"
    "pairs-q1|sat|-s pairs -P 8 -q 1"
    "pingflood|flood|--mib 256 --seconds 20"
    "lat-20k-q0|rate|-s fan-in -P 4 -q 0 -r 20000"
    "idle-5000|idle|-s idle -C 5000"
    "idle-10000|idle|-s idle -C 10000"
    "storm-10000|storm|-s idle -C 10000 --connect-concurrency 100"
    "sessions-10000|sessions|-s sessions -N 10000 -q 1 --connect-concurrency 100"
    "persistent-q1|persist|-s persistent -q 1 --max-messages 50000"
    "sweep-fanin-q0|sweep|-s fan-in -P 4 -q 0 --sweep --sweep-step 2 --sweep-start 10000"
    "fleet-q1|fleet|-s fleet -q 1 -N $FLEET_DEVICES -T $FLEET_INTERVAL"
    "fleet-shared10-q1|fleet|-s fleet -q 1 -N $FLEET_DEVICES -T $FLEET_INTERVAL --backends 10"
)

CLK_TCK=$(getconf CLK_TCK)
# Each run's clients come from 127.NET_A.NET_B.0/24, NET_B counting the runs: fresh addresses,
# so no local port is still in TIME_WAIT from a run before (of this invocation, or of one
# started less than a minute ago with another NET_A).
NET_A=$((1 + RANDOM % 250))
NET_B=0
next_source_net() {
    NET_B=$((NET_B + 1))
    if [ "$NET_B" -gt 255 ]; then NET_B=1; NET_A=$((NET_A % 250 + 1)); fi
    SOURCE_NET="127.$NET_A.$NET_B.0/24"
}
for round in $(seq 1 "$ROUNDS"); do
    for entry in "${SCENARIOS[@]}"; do
        IFS='|' read -r name kind args <<<"$entry"
        [[ "$name" =~ $ONLY ]] || continue
        if [ "$kind" = storm ]; then
            run_storms "$name" "$args" "$round" || echo "$name: a broker did not start" >&2
            continue
        fi
        # Alternate the order of brokers from round to round.
        order=("${BROKERS[@]}")
        if [ $((round % 2)) = 0 ]; then
            order=(); for ((i=${#BROKERS[@]}-1; i>=0; i--)); do order+=("${BROKERS[$i]}"); done
        fi
        for broker in "${order[@]}"; do
            base="$WORK/$name.$broker.$round"
            restart_s=
            run_args=$args
            if [ "$kind" = sessions ]; then
                # Not measured: the sessions created, the broker stopped (persisting them) and
                # started again on the same files; the time it takes to listen is reported.
                pdir="$WORK/$name.$broker.$round.data"
                persistent_configs "$pdir"
                start_broker "$broker" "$pdir" || { echo "{}" >"$base.json"; continue; }
                next_source_net
                # shellcheck disable=SC2086
                nice -n "$NICE" taskset -c "$BENCH_CPU" "$RECADO" bench $args --phase create -p "${PORT[$broker]}" \
                    --source-net "$SOURCE_NET" >"$base.create.out" 2>"$base.create.err" || true
                stop_broker
                start_broker "$broker" "$pdir" || { echo "{}" >"$base.json"; continue; }
                restart_s=$START_S
                run_args="$args --phase reconnect"
            else
                start_broker "$broker" || { echo "{}" >"$base.json"; continue; }
                sleep 0.2
            fi
            rss0=$(rss_kb "$BPID"); c0=$(cpu_ticks "$BPID"); t0=$(date +%s.%N)
            ( peak=$rss0; while kill -0 "$BPID" 2>/dev/null; do
                  r=$(rss_kb "$BPID"); [ "${r:-0}" -gt "$peak" ] && peak=$r
                  echo "$peak" >"$base.peak.tmp"; mv "$base.peak.tmp" "$base.peak"; sleep 0.1; done ) &
            SAMPLER=$!
            d=$DURATION
            extra=()
            if [ "$kind" = fleet ]; then
                d=$FLEET_WINDOW
                extra=(--broker-pid "$BPID")
            fi
            if [ "$kind" = flood ]; then
                # shellcheck disable=SC2086
                nice -n "$NICE" taskset -c "$BENCH_CPU" python3 "$ROOT/benches/ping_flood.py" "${PORT[$broker]}" $args \
                    >"$base.out" 2>"$base.err" || true
            else
                next_source_net
                # shellcheck disable=SC2086
                nice -n "$NICE" taskset -c "$BENCH_CPU" "$RECADO" bench $run_args -d "$d" --drain 15 -p "${PORT[$broker]}" --label "$broker" \
                    --source-net "$SOURCE_NET" "${extra[@]}" >"$base.out" 2>"$base.err" || true
            fi
            t1=$(date +%s.%N); c1=$(cpu_ticks "$BPID")
            kill "$SAMPLER" 2>/dev/null || true; wait "$SAMPLER" 2>/dev/null || true
            stop_broker
            peak=$(cat "$base.peak" 2>/dev/null || echo "$rss0")
            tail -n 1 "$base.out" >"$base.json"
            awk -v r0="$rss0" -v pk="${peak:-0}" -v c0="$c0" -v c1="$c1" -v hz="$CLK_TCK" -v t0="$t0" -v t1="$t1" -v rs="${restart_s:-0}" \
                'BEGIN { printf "{\"rss_base_kb\": %d, \"rss_peak_kb\": %d, \"cpu_s\": %.3f, \"wall_s\": %.3f, \"restart_s\": %.3f}\n", r0, pk, (c1 - c0) / hz, t1 - t0, rs }' >"$base.meta"
            printf '%-16s %-10s round %s: %s\n' "$name" "$broker" "$round" "$(grep -v '^{' "$base.err" | tail -n 2 | tr '\n' ' ')" >&2
        done
    done
done

print_table "$WORK" "${BROKERS[@]}" | tee "$WORK/table.md"
