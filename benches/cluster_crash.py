#!/usr/bin/env python3
"""Persistent sessions on a cluster node that is then killed, and their CONNECTs on another
node, over raw sockets (docs/BENCHMARKS.md, "Sessions across cluster nodes").

  cluster_crash.py setup N PORT     N sessions crash-0..N-1 on PORT (Clean Start 0, Session
                                    Expiry Interval 300), each subscribed to crash/I at QoS 1
                                    and given Q=10 QoS 1 messages while away
  cluster_crash.py connect N PORT   each session's CONNECT on PORT in turn: the time from the
                                    CONNECT written to the CONNACK read, then the messages it
                                    gets within 2 s. Prints "median_ms=... p90_ms=...
                                    max_ms=... present=P/N messages=M".
"""

import socket
import struct
import sys
import time

from cluster_connect import read_packet
from cluster_connect import remaining_length as varint
from mqtt_probe import packet, utf8

QUEUED = 10


def connect_packet(client_id):
    props = bytes([0x11]) + struct.pack("!I", 300)  # Session Expiry Interval
    body = utf8("MQTT") + bytes([5, 0x00]) + struct.pack("!H", 60) + varint(len(props)) + props
    return packet(0x10, body + utf8(client_id))


def open_session(port, client_id):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    start = time.perf_counter()
    s.sendall(connect_packet(client_id))
    kind, body = read_packet(s)
    took = (time.perf_counter() - start) * 1000
    if kind != 0x20 or body[1] != 0:
        sys.exit(f"{client_id}: CONNACK {kind:#x} {body!r}")
    return s, took, body[0] & 1


def close(s):
    s.sendall(b"\xe0\x00")
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
    s.close()


def setup(n, port):
    for i in range(n):
        s, _, _ = open_session(port, f"crash-{i}")
        sub = struct.pack("!H", 1) + b"\x00" + utf8(f"crash/{i}") + b"\x01"
        s.sendall(packet(0x82, sub))
        kind, _ = read_packet(s)
        assert kind == 0x90, kind
        close(s)
    pub = socket.create_connection(("127.0.0.1", port))
    pub.sendall(packet(0x10, utf8("MQTT") + bytes([5, 0x02]) + struct.pack("!H", 60) + b"\x00" + utf8("crash-pub")))
    read_packet(pub)
    pid = 0
    for i in range(n):
        for _ in range(QUEUED):
            pid += 1
            body = utf8(f"crash/{i}") + struct.pack("!H", pid) + b"\x00" + b"queued"
            pub.sendall(packet(0x32, body))
            kind, _ = read_packet(pub)
            assert kind == 0x40, kind
    close(pub)


def connect_all(n, port):
    times, present, messages = [], 0, 0
    for i in range(n):
        s, took, p = open_session(port, f"crash-{i}")
        times.append(took)
        present += p
        s.settimeout(2)
        got = 0
        try:
            while got < QUEUED:
                kind, body = read_packet(s)
                if kind >> 4 == 3:
                    got += 1
                    if kind & 0x06:
                        tlen = struct.unpack("!H", body[:2])[0]
                        s.sendall(packet(0x40, body[2 + tlen:4 + tlen]))
        except (socket.timeout, EOFError):
            pass
        messages += got
        s.settimeout(None)
        close(s)
    times.sort()
    print(
        f"median_ms={times[len(times) // 2]:.1f} p90_ms={times[len(times) * 9 // 10]:.1f} "
        f"max_ms={times[-1]:.1f} present={present}/{n} messages={messages}/{n * QUEUED}"
    )


def main():
    what, n, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if what == "setup":
        setup(n, port)
    else:
        connect_all(n, port)


main()
