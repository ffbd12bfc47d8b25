#!/usr/bin/env python3
"""A publisher held by max_publish_rate, beside a client whose latency is timed.

Usage: benches/publish_rate.py PORT [--seconds S] [--flood]

The probe publishes one QoS 1 message every 10 ms to its own subscription and times each
message from its PUBLISH to its delivery. With --flood, a second client publishes QoS 1
messages as fast as the broker acknowledges them (64 in flight) to a topic nobody
subscribes to, for the same S seconds (default 10). Prints one JSON line: the flooder's
acknowledged messages per second, and the probe's median, 99th percentile and worst
latency in milliseconds. Run it against a broker with and without `max_publish_rate`
(docs/BENCHMARKS.md, "Publish rate limits"). Needs paho-mqtt.
"""
import json
import sys
import threading
import time

import paho.mqtt.client as mqtt


def client(port, client_id):
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
    c.max_inflight_messages_set(64)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port, keepalive=60)
    return c


def flood(port, seconds, result):
    c = client(port, "flooder")
    acked = [0]
    room = threading.Semaphore(64)

    def on_publish(_c, _u, _mid, _rc, _p):
        acked[0] += 1
        room.release()

    c.on_publish = on_publish
    c.loop_start()
    payload = b"x" * 64
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if room.acquire(timeout=0.1):
            c.publish("flood/t", payload, qos=1)
    elapsed = time.monotonic() - start
    result["flood_acked_per_s"] = round(acked[0] / elapsed)
    c.disconnect()
    c.loop_stop()


def probe(port, seconds, result):
    c = client(port, "probe")
    sent = {}
    lat = []
    subscribed = threading.Event()
    c.on_subscribe = lambda *_a: subscribed.set()

    def on_message(_c, _u, m):
        t = sent.pop(m.payload, None)
        if t is not None:
            lat.append((time.monotonic() - t) * 1000)

    c.on_message = on_message
    c.loop_start()
    c.subscribe("probe/t", qos=1)
    subscribed.wait(5)
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        key = str(n).encode()
        sent[key] = time.monotonic()
        c.publish("probe/t", key, qos=1)
        n += 1
        time.sleep(0.01)
    time.sleep(0.5)
    c.disconnect()
    c.loop_stop()
    lat.sort()
    result["probe_sent"] = n
    result["probe_received"] = len(lat)
    if lat:
        result["probe_ms_median"] = round(lat[len(lat) // 2], 2)
        result["probe_ms_p99"] = round(lat[int(len(lat) * 0.99)], 2)
        result["probe_ms_max"] = round(lat[-1], 2)


def main():
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return
    port = int(args[0])
    seconds = float(args[args.index("--seconds") + 1]) if "--seconds" in args else 10.0
    result = {}
    threads = [threading.Thread(target=probe, args=(port, seconds, result))]
    if "--flood" in args:
        threads.append(threading.Thread(target=flood, args=(port, seconds, result)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
