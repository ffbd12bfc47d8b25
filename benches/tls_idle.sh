#!/usr/bin/env bash
# TLS connections held: mercuriod (release) and mosquitto with the same certificates, each
# pinned to CPU 0, `recado bench`'s idle scenario over TLS pinned to CPU 1. For each broker:
# open C TLS connections (MQTT 3.1.1, keep alive 60 s, every one a full handshake), then hold
# them; reports the connect rate, the broker's RSS before and while holding them (RSS per
# connection), the broker's CPU per connect and its idle CPU while holding (% of one core).
# Brokers alternate, a fresh broker process and a fresh port per run. Loopback only.
#
# Usage: benches/tls_idle.sh [--connections N] [--rounds N] [--hold S] [--keep-alive S]
#                            [--key ec|rsa] [--client-cert] [--plain] [--nice N] [--no-build]
#                            [--out DIR]
#   --connections N  TLS connections per run (default 15000)
#   --rounds N       rounds, each one run per broker (default 2)
#   --hold S         seconds over which idle CPU is measured once all are up; default 3/4 of
#                    the keep alive, the generator's ping interval: one PINGREQ per connection
#   --keep-alive S   MQTT keep alive of every connection (default 60)
#   --key ec|rsa     server (and CA) key: ECDSA P-256 (default) or RSA 2048
#   --client-cert    brokers require a client certificate (signed by the same CA)
#   --concurrency N  handshakes in progress at once (default 64)
#   --plain          the same over plain TCP (no TLS): the baseline TLS adds to
#   --nice N         run brokers and generator at this nice level (e.g. -10 on a machine where
#                    other jobs compete for the CPUs; a negative level needs root)
#   --no-build       use the binaries already built
#   --out DIR        keep the certificates, configurations, logs and results there
# Environment: CARGO_TARGET_DIR, MERCURIOD, RECADO, MOSQUITTO (default
# /usr/sbin/mosquitto), BROKER_CPU (0), BENCH_CPU (1).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
CONNS=15000
ROUNDS=2
HOLD=
KEEPALIVE=60
KEY=ec
CLIENT_CERT=0
CONCURRENCY=64
BUILD=1
OUT=
PLAIN=0
NICE=0
while [ $# -gt 0 ]; do
    case "$1" in
        --connections) CONNS=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --hold) HOLD=$2; shift 2 ;;
        --keep-alive) KEEPALIVE=$2; shift 2 ;;
        --key) KEY=$2; shift 2 ;;
        --client-cert) CLIENT_CERT=1; shift ;;
        --concurrency) CONCURRENCY=$2; shift 2 ;;
        --plain) PLAIN=1; shift ;;
        --nice) NICE=$2; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --out) OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
[ -n "$HOLD" ] || HOLD=$((KEEPALIVE * 3 / 4))
case "$KEY" in ec|rsa) ;; *) echo "--key must be ec or rsa" >&2; exit 2 ;; esac

BROKER_CPU=${BROKER_CPU:-0}
BENCH_CPU=${BENCH_CPU:-1}
MOSQUITTO=${MOSQUITTO:-/usr/sbin/mosquitto}
[ -x "$MOSQUITTO" ] || { echo "mosquitto not found at $MOSQUITTO: apt-get install mosquitto" >&2; exit 1; }
command -v openssl >/dev/null || { echo "openssl is needed" >&2; exit 1; }

if [ "$BUILD" = 1 ]; then
    (cd "$ROOT" && cargo build --release -q -p mercuriod -p recado)
fi
RECADO=${RECADO:-$TARGET/release/recado}
MERCURIOD=${MERCURIOD:-$TARGET/release/mercuriod}
for b in "$RECADO" "$MERCURIOD"; do
    [ -x "$b" ] || { echo "missing $b (build with cargo build --release)" >&2; exit 1; }
done

# Descriptors: each side holds one per connection. Raise the soft limit as far as allowed.
NOFILE=65536
HARD=$(ulimit -Hn)
[ "$HARD" != unlimited ] && [ "$HARD" -lt "$NOFILE" ] && ulimit -Hn "$NOFILE" 2>/dev/null || true
HARD=$(ulimit -Hn)
[ "$HARD" != unlimited ] && [ "$HARD" -lt "$NOFILE" ] && NOFILE=$HARD
ulimit -n "$NOFILE"
if [ "$(ulimit -n)" -lt $((CONNS + 100)) ]; then
    echo "ulimit -n is $(ulimit -n) (hard $(ulimit -Hn)): too few descriptors for $CONNS connections" >&2
    exit 1
fi
echo "ulimit -n $(ulimit -n) (hard limit $(ulimit -Hn))" >&2

# Ephemeral ports: one port per run, so the TIME_WAIT sockets of a run never collide with the
# next one (the generator lets the broker close first, but gives up waiting after 2 s and
# closes itself); the range must still hold C.
read -r LO HI </proc/sys/net/ipv4/ip_local_port_range
echo "net.ipv4.ip_local_port_range = $LO $HI ($((HI - LO + 1)) ports); net.ipv4.tcp_tw_reuse = $(cat /proc/sys/net/ipv4/tcp_tw_reuse); net.core.somaxconn = $(cat /proc/sys/net/core/somaxconn)" >&2
if [ $((HI - LO + 1)) -lt $((CONNS + 1000)) ]; then
    if [ "$(id -u)" = 0 ]; then
        echo "sysctl -w net.ipv4.ip_local_port_range='1024 65535' (was $LO $HI)" >&2
        sysctl -q -w net.ipv4.ip_local_port_range='1024 65535'
    else
        echo "ip_local_port_range holds fewer than $CONNS ports; widen it (as root)" >&2
        exit 1
    fi
fi

WORK=${OUT:-$(mktemp -d /tmp/mercurio-tls-idle.XXXXXX)}
mkdir -p "$WORK"
BPID=
GPID=
cleanup() {
    [ -n "$GPID" ] && kill "$GPID" 2>/dev/null && wait "$GPID" 2>/dev/null
    [ -n "$BPID" ] && stop_broker
    [ -z "$OUT" ] && rm -rf "$WORK"
    return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Certificates: a CA, a server certificate for localhost and 127.0.0.1, a client certificate.
# mosquitto drops root privileges to its own user, so the files must be world-readable.
newkey() {
    if [ "$KEY" = ec ]; then
        openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
    else
        openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$1" 2>/dev/null
    fi
}
(
    cd "$WORK"
    newkey ca.key
    openssl req -x509 -new -key ca.key -sha256 -days 2 -subj "/CN=mercurio bench CA" \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
        -out ca.pem 2>/dev/null
    for who in server client; do
        newkey "$who.key"
        openssl req -new -key "$who.key" -subj "/CN=${who/server/localhost}" -out "$who.csr" 2>/dev/null
        if [ "$who" = server ]; then
            printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >"$who.ext"
        else
            printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n' >"$who.ext"
        fi
        openssl x509 -req -in "$who.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -sha256 \
            -extfile "$who.ext" -out "$who.pem" 2>/dev/null
    done
    chmod 755 . && chmod 644 ./*
)
echo "certificates ($KEY) in $WORK" >&2

TLS_ARGS=(--tls --cafile "$WORK/ca.pem")
[ "$CLIENT_CERT" = 1 ] && TLS_ARGS+=(--cert "$WORK/client.pem" --key "$WORK/client.key")
[ "$PLAIN" = 1 ] && TLS_ARGS=()

write_configs() { # port
    {
        echo "listener $1 127.0.0.1"
        if [ "$PLAIN" = 0 ]; then
            echo "certfile $WORK/server.pem"
            echo "keyfile $WORK/server.key"
        fi
        if [ "$CLIENT_CERT" = 1 ] && [ "$PLAIN" = 0 ]; then
            echo "cafile $WORK/ca.pem"
            echo "require_certificate true"
        fi
        echo "max_connections -1"
        echo "allow_anonymous true"
        echo "persistence false"
        echo "log_dest none"
    } >"$WORK/mosquitto.conf"
    {
        echo "[[listeners]]"
        echo "host = \"127.0.0.1\""
        echo "port = $1"
        if [ "$PLAIN" = 0 ]; then
            echo "cert_file = \"$WORK/server.pem\""
            echo "key_file = \"$WORK/server.key\""
        fi
        if [ "$CLIENT_CERT" = 1 ] && [ "$PLAIN" = 0 ]; then
            echo "ca_file = \"$WORK/ca.pem\""
            echo "require_certificate = true"
        fi
        echo
        echo "[auth]"
        echo "allow_anonymous = true"
        echo
        echo "[logging]"
        echo "level = \"warn\""
        echo "connection_messages = false"
    } >"$WORK/mercuriod.toml"
}

start_broker() { # name port -> sets BPID
    case "$1" in
        mosquitto) nice -n "$NICE" taskset -c "$BROKER_CPU" "$MOSQUITTO" -c "$WORK/mosquitto.conf" >"$WORK/$1.log" 2>&1 & ;;
        mercurio) nice -n "$NICE" taskset -c "$BROKER_CPU" "$MERCURIOD" -c "$WORK/mercuriod.toml" >"$WORK/$1.log" 2>&1 & ;;
    esac
    BPID=$!
    local deadline=$((SECONDS + 10))
    while [ $SECONDS -lt $deadline ]; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$2") 2>/dev/null; then return 0; fi
        kill -0 "$BPID" 2>/dev/null || { echo "$1 did not start:" >&2; cat "$WORK/$1.log" >&2; BPID=; return 1; }
        sleep 0.05
    done
    echo "$1: port $2 not open after 10 s" >&2
    return 1
}

stop_broker() {
    kill -TERM "$BPID" 2>/dev/null || true
    local deadline=$((SECONDS + 10))
    while [ $SECONDS -lt $deadline ] && kill -0 "$BPID" 2>/dev/null; do sleep 0.05; done
    kill -KILL "$BPID" 2>/dev/null || true
    wait "$BPID" 2>/dev/null || true
    BPID=
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
rss_kb() { awk '/^VmRSS/{print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
now() { date +%s.%N; }
established() { ss -Htn state established "( sport = :$1 )" 2>/dev/null | wc -l; }

CLK_TCK=$(getconf CLK_TCK)
BROKERS=(mosquitto mercurio)
PORT=$((20000 + RANDOM % 10000))
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
for round in $(seq 1 "$ROUNDS"); do
    order=("${BROKERS[@]}")
    [ $((round % 2)) = 0 ] && order=(mercurio mosquitto)
    for broker in "${order[@]}"; do
        PORT=$((PORT + 1))
        base="$WORK/$broker.$round"
        write_configs "$PORT"
        start_broker "$broker" "$PORT" || exit 1
        rss0=$(rss_kb "$BPID"); c_start=$(cpu_ticks "$BPID")
        nice -n "$NICE" taskset -c "$BENCH_CPU" "$RECADO" bench -s idle "${TLS_ARGS[@]}" \
            -C "$CONNS" --connect-concurrency "$CONCURRENCY" --keep-alive "$KEEPALIVE" \
            -d $((HOLD + 5)) -p "$PORT" --label "$broker" >"$base.out" 2>"$base.err" &
        GPID=$!
        # Wait until every connection is up (or failed): the generator says "holding".
        deadline=$((SECONDS + 300))
        while ! grep -q holding "$base.err" 2>/dev/null; do
            kill -0 "$GPID" 2>/dev/null || break
            [ $SECONDS -lt $deadline ] || { echo "$broker: connections not up after 300 s" >&2; break; }
            sleep 0.05
        done
        g_ticks=$(cpu_ticks "$GPID")
        rss1=$(rss_kb "$BPID"); c0=$(cpu_ticks "$BPID"); t0=$(now)
        sleep "$HOLD" # the measurement window
        c1=$(cpu_ticks "$BPID"); t1=$(now); rss2=$(rss_kb "$BPID"); held=$(established "$PORT")
        wait "$GPID" || true
        GPID=
        stop_broker
        tail -n 1 "$base.out" >"$base.json"
        python3 - "$base.json" "$broker" "$round" "$rss0" "$rss1" "$rss2" "$c_start" "$c0" "$c1" \
            "$t0" "$t1" "$CLK_TCK" "$g_ticks" "$held" >>"$RESULTS" <<'PY'
import json, sys
path, broker, rnd = sys.argv[1:4]
rss0, rss1, rss2, c_start, c0, c1 = map(int, sys.argv[4:10])
t0, t1 = float(sys.argv[10]), float(sys.argv[11])
hz, g_ticks, held = int(sys.argv[12]), int(sys.argv[13]), int(sys.argv[14])
try:
    idle = json.load(open(path)).get("idle", {})
except Exception:
    idle = {}
n = idle.get("connected", 0)
print(json.dumps({
    "broker": broker, "round": int(rnd), "connected": n, "failed": idle.get("failed", 0),
    "held_at_end": held, "connect_per_s": idle.get("connect_per_s", 0),
    "connect_s": idle.get("connect_s", 0), "connect_p99_ms": idle.get("connect_p99_us", 0) / 1000,
    "rss_before_kb": rss0, "rss_up_kb": rss1, "rss_held_kb": rss2,
    "kib_per_conn": (max(rss1, rss2) - rss0) / n if n else 0,
    "cpu_ms_per_connect": 1000 * (c0 - c_start) / hz / n if n else 0,
    "gen_cpu_pct_connecting": 100 * g_ticks / hz / idle["connect_s"] if idle.get("connect_s") else 0,
    "idle_cpu_pct": 100 * (c1 - c0) / hz / (t1 - t0),
}))
PY
        printf '%-9s round %s: %s\n' "$broker" "$round" "$(tail -n 1 "$RESULTS")" >&2
    done
done

python3 - "$RESULTS" "$CONNS" "$KEY" "$CLIENT_CERT" "$PLAIN" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
conns, key, cc, plain = sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5] == "1"
metrics = [
    ("connected (of %s)" % conns, "connected", "{:.0f}"),
    ("still established at the end", "held_at_end", "{:.0f}"),
    ("connect rate, connections/s", "connect_per_s", "{:.0f}"),
    ("connect p99, ms", "connect_p99_ms", "{:.1f}"),
    ("broker CPU per connect, ms", "cpu_ms_per_connect", "{:.3f}"),
    ("generator CPU while connecting, %", "gen_cpu_pct_connecting", "{:.0f}"),
    ("broker RSS before, MiB", "rss_before_kb", "{:.1f}", 1 / 1024),
    ("broker RSS holding, MiB", "rss_held_kb", "{:.1f}", 1 / 1024),
    ("broker RSS per connection, KiB", "kib_per_conn", "{:.1f}"),
    ("broker idle CPU holding, % of a core", "idle_cpu_pct", "{:.2f}"),
]
what = "plain TCP" if plain else f"TLS ({'ECDSA P-256' if key == 'ec' else 'RSA 2048'} server key{', client certificates' if cc else ''})"
print(f"{what}, {conns} connections, rounds: {max(r['round'] for r in rows) if rows else 0}")
print("| metric | mosquitto median [min-max] | mercurio median [min-max] | mercurio/mosquitto |")
print("|---|---|---|---|")
for m in metrics:
    name, key_, f = m[:3]
    scale = m[3] if len(m) > 3 else 1
    cells, med = [], {}
    for b in ("mosquitto", "mercurio"):
        v = [r[key_] * scale for r in rows if r["broker"] == b]
        if not v:
            cells.append("-"); continue
        med[b] = statistics.median(v)
        cells.append(f.format(med[b]) + (f" [{f.format(min(v))}-{f.format(max(v))}]" if len(v) > 1 else ""))
    ratio = f"{med['mercurio'] / med['mosquitto']:.2f}x" if med.get("mosquitto") and "mercurio" in med else "-"
    print(f"| {name} | {cells[0]} | {cells[1]} | {ratio} |")
PY
[ -n "$OUT" ] && echo "results in $WORK" >&2
exit 0
