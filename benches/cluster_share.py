#!/usr/bin/env python3
"""A shared subscription group on one cluster node, fed by a publisher on another.

Usage: benches/cluster_share.py PUB_PORT SUB_PORT [--qos Q] [--rate R] [--seconds S] [--members K]

K members (MQTT 5.0, default 2) subscribe to `$share/bench/share/#` on SUB_PORT; one
publisher (MQTT 3.1.1, at most 64 messages unacknowledged) publishes 64-byte messages on
share/0 on PUB_PORT at R messages/s (default 2000) for S seconds (default 5), each stamped
with its number and the time it was sent. Before the measured window the publisher repeats a
warm-up message until a member has one (the group's interest has reached the publisher's
node). After it, the members get up to 5 s for the last messages. Prints one JSON line:
messages acknowledged to the publisher and delivered per second, the latency from publish to
delivery (p50, p99, ms), acknowledged messages no member received (lost) and copies
received beyond the first (duplicates). Used by benches/cluster.sh ("share" path). Needs
paho-mqtt.
"""
import json
import sys
import threading
import time

import paho.mqtt.client as mqtt


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    pub_port, sub_port = int(args[0]), int(args[1])
    opts = {"--qos": 1, "--rate": 2000, "--seconds": 5, "--members": 2}
    rest = args[2:]
    while rest:
        key = rest.pop(0)
        if key not in opts or not rest:
            print(f"unknown option {key}", file=sys.stderr)
            sys.exit(2)
        opts[key] = float(rest.pop(0))
    qos, rate = int(opts["--qos"]), opts["--rate"]
    seconds, members = opts["--seconds"], int(opts["--members"])

    lock = threading.Lock()
    got = {}  # number -> copies
    latencies = []
    warm = threading.Event()

    def on_message(_c, _u, m):
        now = time.monotonic_ns()
        text = m.payload.split(b" ", 2)
        if text[0] == b"warm":
            warm.set()
            return
        n, sent = int(text[0]), int(text[1])
        with lock:
            got[n] = got.get(n, 0) + 1
            if got[n] == 1:
                latencies.append((now - sent) / 1e6)

    subs = []
    for i in range(members):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"share-member-{i}",
                        protocol=mqtt.MQTTv5)
        c.on_message = on_message
        c.connect("127.0.0.1", sub_port, keepalive=60)
        c.subscribe("$share/bench/share/#", qos=qos)
        c.loop_start()
        subs.append(c)

    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="share-publisher",
                      protocol=mqtt.MQTTv311)
    pub.max_inflight_messages_set(64)
    pub.max_queued_messages_set(0)
    acked = set()
    numbers = {}  # mid -> number
    early = set()  # mids acknowledged before their number was noted
    room = threading.Semaphore(64)

    def on_publish(_c, _u, mid, _rc, _p):
        with lock:
            n = numbers.pop(mid, None)
            if n is None:
                early.add(mid)
            else:
                acked.add(n)
        room.release()

    pub.on_publish = on_publish
    pub.connect("127.0.0.1", pub_port, keepalive=60)
    pub.loop_start()
    deadline = time.monotonic() + 20
    while not warm.is_set():
        if time.monotonic() > deadline:
            print(json.dumps({"error": "the group never received the warm-up message"}))
            sys.exit(1)
        room.acquire()
        pub.publish("share/0", b"warm", qos=qos)
        warm.wait(0.2)

    with lock:
        early.clear()
    pad = b"x" * 64
    start = time.monotonic()
    n = 0
    while True:
        now = time.monotonic()
        if now - start >= seconds:
            break
        due = start + n / rate
        if due > now:
            time.sleep(due - now)
        room.acquire()
        payload = f"{n} {time.monotonic_ns()} ".encode()
        # (Not under `lock`: paho calls on_publish under a lock of its own that publish takes.)
        info = pub.publish("share/0", (payload + pad)[:64], qos=qos)
        with lock:
            if info.mid in early:
                early.discard(info.mid)
                acked.add(n)
            else:
                numbers[info.mid] = n
        n += 1
    if qos == 0:
        with lock:
            acked.update(range(n))
    # The last acknowledgements, then the last deliveries.
    wait_until = time.monotonic() + 5
    while time.monotonic() < wait_until:
        with lock:
            if len(acked) >= n and all(k in got for k in acked):
                break
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    with lock:
        lat = sorted(latencies)
        lost = sum(1 for k in acked if k not in got)
        dup = sum(c - 1 for c in got.values())
        delivered = len(got)
        result = {
            "sent": n,
            "acked_per_s": round(len(acked) / seconds),
            "delivered_per_s": round(delivered / seconds),
            "p50_ms": round(lat[len(lat) // 2], 2) if lat else None,
            "p99_ms": round(lat[min(len(lat) - 1, len(lat) * 99 // 100)], 2) if lat else None,
            "lost": lost,
            "duplicates": dup,
            "elapsed_s": round(elapsed, 1),
        }
    print(json.dumps(result), flush=True)
    pub.loop_stop()
    for c in subs:
        c.loop_stop()


if __name__ == "__main__":
    main()
