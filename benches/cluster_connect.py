#!/usr/bin/env python3
"""CONNECT latency of a persistent MQTT 5 session on cluster nodes, over raw sockets (no
client library between an event and its time stamp).

  cluster_connect.py N PORT [PORT...]

Connects the client `probe` N times (Clean Start 0, Session Expiry Interval 300), the ports
taken in turn, and DISCONNECTs each time; the time is from the CONNECT written to the
CONNACK read. Prints "median_ms=... p90_ms=... present=P/N".
"""

import socket
import struct
import sys
import time


def remaining_length(n):
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def connect_packet(client_id):
    cid = client_id.encode()
    props = bytes([0x11]) + struct.pack("!I", 300)  # Session Expiry Interval
    body = (
        struct.pack("!H", 4) + b"MQTT" + bytes([5, 0x00]) + struct.pack("!H", 60)
        + remaining_length(len(props)) + props
        + struct.pack("!H", len(cid)) + cid
    )
    return bytes([0x10]) + remaining_length(len(body)) + body


def read_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError("closed")
        buf += chunk
    return buf


def read_packet(s):
    kind = read_exact(s, 1)[0]
    mult, length = 1, 0
    while True:
        b = read_exact(s, 1)[0]
        length += (b & 0x7F) * mult
        mult *= 128
        if not b & 0x80:
            break
    return kind, read_exact(s, length)


def main():
    n = int(sys.argv[1])
    ports = [int(p) for p in sys.argv[2:]]
    connect = connect_packet("probe")
    times, present = [], 0
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", ports[i % len(ports)]))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        s.sendall(connect)
        kind, body = read_packet(s)
        times.append((time.perf_counter() - start) * 1000)
        if kind != 0x20 or body[1] != 0:
            sys.exit(f"CONNACK {kind:#x} {body!r}")
        present += body[0] & 1
        s.sendall(b"\xe0\x00")
        # The broker closes after DISCONNECT: the session is detached before the next CONNECT.
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass
        s.close()
    times.sort()
    print(
        f"median_ms={times[len(times) // 2]:.3f} p90_ms={times[len(times) * 9 // 10]:.3f} "
        f"present={present}/{n}"
    )


if __name__ == "__main__":
    main()
