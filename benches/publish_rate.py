#!/usr/bin/env python3
"""A publisher held by max_publish_rate, beside a client whose latency is timed.

Usage: benches/publish_rate.py PORT [--seconds S] [--flood]

The probe (a raw socket, TCP_NODELAY) publishes one QoS 0 message every 10 ms to its own
subscription and times each from its PUBLISH to its delivery. With --flood, a second client publishes QoS 1
messages as fast as the broker acknowledges them (64 in flight) to a topic nobody
subscribes to, for the same S seconds (default 10). Prints one JSON line: the flooder's
acknowledged messages per second, and the probe's median, 99th percentile and worst
latency in milliseconds. Run it against a broker with and without `max_publish_rate`
(docs/BENCHMARKS.md, "Publish rate limits"). Needs paho-mqtt.
"""
import json
import socket
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


def raw_connect(port, client_id):
    """A raw MQTT 3.1.1 connection with TCP_NODELAY (paho's own loop adds tens of ms)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(cid).to_bytes(2, "big") + cid
    s.sendall(bytes([0x10, len(body)]) + body)
    read_exact(s, 4)
    return s


def read_exact(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise SystemExit("probe: closed by the broker")
        data += chunk
    return data


def read_packet(s):
    """One packet: (first byte, body); remaining length below 128 bytes here."""
    head = read_exact(s, 2)
    return head[0], read_exact(s, head[1])


def probe(port, seconds, result):
    """QoS 0 to its own subscription, one message in flight, every 10 ms: the round trip."""
    s = raw_connect(port, "probe")
    topic = b"probe/t"
    sub = b"\x00\x01" + len(topic).to_bytes(2, "big") + topic + b"\x00"
    s.sendall(bytes([0x82, len(sub)]) + sub)
    while read_packet(s)[0] != 0x90:
        pass
    lat = []
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        payload = str(n).encode()
        body = len(topic).to_bytes(2, "big") + topic + payload
        t = time.monotonic()
        s.sendall(bytes([0x30, len(body)]) + body)
        while True:
            first, got = read_packet(s)
            if first >> 4 == 3 and got.endswith(payload):
                break
        lat.append((time.monotonic() - t) * 1000)
        n += 1
        time.sleep(0.01)
    s.close()
    lat.sort()
    result["probe_messages"] = n
    result["probe_ms_median"] = round(lat[len(lat) // 2], 3)
    result["probe_ms_p99"] = round(lat[int(len(lat) * 0.99)], 3)
    result["probe_ms_max"] = round(lat[-1], 3)


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
