#!/usr/bin/env bash
# run-mosq-broker-tests.sh — run eclipse/mosquitto's own broker tests (test/broker/NN-*.py)
# against any broker, by putting a stand-in executable where the tests expect mosquitto.
#
# Usage:
#   MOSQ_TREE=/tmp/mosquitto-v2.0.11 [BROKER_STANDIN=path/to/standin] tests/mosquitto-suite/run-mosq-broker-tests.sh
#
# Obtaining the tests (never committed here; keep them in a temp folder):
#   1. clone eclipse/mosquitto somewhere: git clone --bare https://github.com/eclipse/mosquitto G
#   2. Take the tests at the tag matching the reference binary (Debian 12 ships 2.0.11):
#        mkdir -p /tmp/mosquitto-v2.0.11
#        git --git-dir="$G" archive v2.0.11 test | tar -x -C /tmp/mosquitto-v2.0.11
#   Only test/ is needed; nothing is built. The tests need python3 and nothing else.
#
# How the tests start a broker: each test (run from test/broker with its port as argument)
# starts "../../src/mosquitto -v -p PORT" or "../../src/mosquitto -v -c NN-name.conf" (a
# config it has just written into test/broker), waits until localhost:PORT accepts a TCP
# connection, talks raw MQTT to it, then sends SIGTERM and reads the broker's stderr.
# This script copies BROKER_STANDIN to MOSQ_TREE/src/mosquitto. A stand-in must:
#   - accept -v, -p PORT and -c FILE (mosquitto.conf syntax: at least "listener PORT [host]"
#     and "port PORT"; map the other keys it can; mosq-standin-mercurio.sh beside this file does it for mercuriod);
#   - run the broker in the foreground as the same process (exec), listening on localhost:PORT,
#     so that SIGTERM stops it; write logs to stderr;
#   - start from empty state unless the config enables persistence (restart tests rely on it).
# Without BROKER_STANDIN, a stand-in that execs the system mosquitto is used (reference run).
#
# MOSQ_LENIENT_CONNACK=1 runs each test through a small shim that reads a whole MQTT 5 CONNACK
# and compares it by meaning: flags, reason code and every property the test expects must
# match, except Receive Maximum and Topic Alias Maximum (the server's own choice); properties
# the test does not expect are allowed. Without it the tests demand mosquitto's exact bytes
# (Topic Alias Maximum 10 then Receive Maximum 20), which no other broker sends by accident.
#
# Other env vars:
#   MOSQ_CATEGORIES   file-number prefixes to run, default "01 02 03 04 05 07 10 11 12 13"
#                     (06 bridge, 08 TLS, 09 auth plugins, 14 dynsec are mosquitto features)
#   MOSQ_ONLY         space-separated file names to run instead (e.g. "02-subpub-qos1.py")
#   MOSQ_TEST_TIMEOUT seconds per test file, default 60
#   MOSQ_BASE_PORT    first port handed to tests, default 1888 (tests need up to 2 ports)
#   MOSQ_LOG_DIR      per-test logs, default a new folder under ${TMPDIR:-/tmp}
#   PYTHON            interpreter, default python3
#
# Output: one line per test file (PASS/FAIL/TIMEOUT/MISSING), then "mosqbroker failing: ..." and
# last "mosqbroker: N passed, M failed[, K skipped]" (skipped = listed in test.py but absent).
# Exit 0 when none failed, 1 otherwise, 2 on usage errors.

set -u

MOSQ_TREE=${MOSQ_TREE:-${1:-/tmp/mosquitto-v2.0.11}}
MOSQ_CATEGORIES=${MOSQ_CATEGORIES:-"01 02 03 04 05 07 10 11 12 13"}
MOSQ_ONLY=${MOSQ_ONLY:-}
MOSQ_TEST_TIMEOUT=${MOSQ_TEST_TIMEOUT:-60}
MOSQ_BASE_PORT=${MOSQ_BASE_PORT:-1888}
MOSQ_LENIENT_CONNACK=${MOSQ_LENIENT_CONNACK:-0}
PYTHON=${PYTHON:-python3}

BROKER_DIR="$MOSQ_TREE/test/broker"
if [ ! -f "$BROKER_DIR/test.py" ] || [ ! -f "$MOSQ_TREE/test/mosq_test.py" ]; then
  echo "run-mosq-broker-tests: no test/broker/test.py under '$MOSQ_TREE' (see header)" >&2
  exit 2
fi
MOSQ_TREE=$(cd "$MOSQ_TREE" && pwd)
BROKER_DIR="$MOSQ_TREE/test/broker"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/run-mosq-tests.XXXXXX")
LOG_DIR=${MOSQ_LOG_DIR:-$WORK/logs}
mkdir -p "$LOG_DIR" "$MOSQ_TREE/src"

if [ -n "${BROKER_STANDIN:-}" ]; then
  [ -x "$BROKER_STANDIN" ] || { echo "run-mosq-broker-tests: BROKER_STANDIN '$BROKER_STANDIN' is not executable" >&2; exit 2; }
  cp "$BROKER_STANDIN" "$MOSQ_TREE/src/mosquitto"
else
  real=$(command -v mosquitto) || { echo "run-mosq-broker-tests: no mosquitto on PATH for the reference run (Debian puts it in an sbin folder)" >&2; exit 2; }
  printf '#!/bin/sh\nexec %s "$@"\n' "$real" > "$MOSQ_TREE/src/mosquitto"
fi
chmod +x "$MOSQ_TREE/src/mosquitto"
# mosquitto started as root drops to its own user; let it write persistence files here.
[ "$(id -u)" = 0 ] && chmod a+rwx "$BROKER_DIR"

# Shim for MOSQ_LENIENT_CONNACK=1: our own code; it wraps the harness' packet check at run time.
SHIM="$WORK/lenient_connack.py"
cat > "$SHIM" <<'PYEOF'
import os, runpy, sys
script = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.dirname(script))
sys.path.insert(0, os.path.dirname(os.path.dirname(script)))
import mosq_test

def read_packet(sock):
    head = sock.recv(1)
    if not head:
        return b""
    lenbytes, value, mult = b"", 0, 1
    while True:
        b = sock.recv(1)
        if not b:
            return head + lenbytes
        lenbytes += b
        value += (b[0] & 127) * mult
        mult *= 128
        if not b[0] & 128:
            break
    body = b""
    while len(body) < value:
        part = sock.recv(value - len(body))
        if not part:
            break
        body += part
    return head + lenbytes + body

SIZES = {0x01: 1, 0x17: 1, 0x19: 1, 0x24: 1, 0x25: 1, 0x28: 1, 0x29: 1, 0x2A: 1,
         0x13: 2, 0x21: 2, 0x22: 2, 0x23: 2, 0x02: 4, 0x11: 4, 0x18: 4, 0x27: 4}

def properties(buf):
    i, mult, length = 0, 1, 0
    while True:
        b = buf[i]; i += 1
        length += (b & 127) * mult; mult *= 128
        if not b & 128:
            break
    end, found = min(i + length, len(buf)), []
    while i < end:
        pid = buf[i]; i += 1
        if pid in SIZES:
            n = SIZES[pid]
        elif pid == 0x0B:                      # variable byte integer
            n = 1
            while buf[i + n - 1] & 128:
                n += 1
        elif pid == 0x26:                      # string pair
            k = int.from_bytes(buf[i:i + 2], "big")
            n = 4 + k + int.from_bytes(buf[i + 2 + k:i + 4 + k], "big")
        else:                                  # string or binary data
            n = 2 + int.from_bytes(buf[i:i + 2], "big")
        # A test may truncate its expected packet (e.g. to check only the start of an assigned
        # client id); a cut-off property is returned with value None = "must be present".
        found.append((pid, bytes(buf[i:i + n]) if i + n <= len(buf) else None)); i += n
    return found

SERVER_CHOICE = {0x21, 0x22}                   # Receive Maximum, Topic Alias Maximum
strict_expect = mosq_test.expect_packet

def expect_packet(sock, name, expected):
    if len(expected) >= 5 and expected[0] == 0x20 and expected[1] != 2:   # MQTT 5 CONNACK
        got = read_packet(sock)
        ok = len(got) >= 5 and got[0] == 0x20 and got[2:4] == expected[2:4]
        if ok:
            have = dict(properties(got[4:]))
            ok = all((pid in have) if val is None else have.get(pid) == val
                     for pid, val in properties(expected[4:]) if pid not in SERVER_CHOICE)
        if not ok:
            mosq_test.packet_matches(name, got, expected)
            raise mosq_test.TestError
        return True
    return strict_expect(sock, name, expected)

mosq_test.expect_packet = expect_packet
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
PYEOF

# The test list and port counts come from the suite's own test.py table: "(ports, './file.py')".
mapfile -t entries < <(sed -nE "s/^[[:space:]]*\(([0-9]+), *'\.\/([^']+)'\).*/\1 \2/p" "$BROKER_DIR/test.py")
selected=()
for e in "${entries[@]}"; do
  name=${e#* }
  if [ -n "$MOSQ_ONLY" ]; then
    case " $MOSQ_ONLY " in *" $name "*) selected+=("$e");; esac
  else
    case " $MOSQ_CATEGORIES " in *" ${name:0:2} "*) selected+=("$e");; esac
  fi
done

echo "== mosqbroker: ${#selected[@]} test files from $MOSQ_TREE (lenient CONNACK: $MOSQ_LENIENT_CONNACK, logs in $LOG_DIR)"
passed=0
failed=()
missing=()
cd "$BROKER_DIR" || exit 2
for e in "${selected[@]}"; do
  nports=${e%% *}; name=${e#* }
  if [ ! -f "$name" ]; then
    echo "   MISSING $name (listed in test.py but absent at this version; counted as skipped)"
    missing+=("$name"); continue
  fi
  ports=$(seq "$MOSQ_BASE_PORT" $((MOSQ_BASE_PORT + nports - 1)))
  start=$(date +%s)
  if [ "$MOSQ_LENIENT_CONNACK" = 1 ]; then runner=("$PYTHON" "$SHIM" "./$name"); else runner=("$PYTHON" "./$name"); fi
  # Own session per test: when a test is killed on timeout, the broker it started is killed too.
  setsid timeout -k 5 "$MOSQ_TEST_TIMEOUT" "${runner[@]}" $ports > "$LOG_DIR/$name.log" 2>&1 &
  pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null
  if [ $rc -eq 0 ]; then outcome=PASS; passed=$((passed + 1))
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then outcome=TIMEOUT; failed+=("$name")
  else outcome=FAIL; failed+=("$name"); fi
  echo "   $outcome $name ($(( $(date +%s) - start ))s)"
done

[ ${#failed[@]} -gt 0 ] && echo "mosqbroker failing: ${failed[*]}"
line="mosqbroker: $passed passed, ${#failed[@]} failed"
[ ${#missing[@]} -gt 0 ] && line="$line, ${#missing[@]} skipped"
echo "$line"
[ ${#failed[@]} -eq 0 ]
