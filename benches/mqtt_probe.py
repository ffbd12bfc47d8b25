#!/usr/bin/env python3
"""A minimal MQTT 3.1.1 client over raw sockets for benches/failover.sh (no dependencies, so
that no client library's threads or timers sit between an event and its time stamp).

  mqtt_probe.py subscribe PORT CLIENT FILTER        persistent session CLIENT subscribes at QoS 1
  mqtt_probe.py publish PORT CLIENT TOPIC FIRST N   QoS 1 payloads FIRST..FIRST+N-1, all acked
  mqtt_probe.py failover PID PORT CLIENT [SECONDS]  SIGKILL PID, then poll PORT until a CONNECT
                                                    of persistent session CLIENT gets a CONNACK
                                                    with session present; prints milliseconds
  mqtt_probe.py drain PORT CLIENT EXPECTED          receive and acknowledge CLIENT's queue until
                                                    EXPECTED distinct payloads (or 30 s);
                                                    prints "distinct=D received=R"
"""

import os
import signal
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


def packet(kind, body):
    return bytes([kind]) + remaining_length(len(body)) + body


def utf8(s):
    b = s.encode()
    return struct.pack("!H", len(b)) + b


class Conn:
    def __init__(self, port, client, clean, timeout=10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        flags = 0x02 if clean else 0x00
        body = utf8("MQTT") + bytes([4, flags]) + struct.pack("!H", 600) + utf8(client)
        self.sock.sendall(packet(0x10, body))
        kind, body = self.recv()
        if kind != 0x20 or len(body) != 2 or body[1] != 0:
            raise RuntimeError(f"CONNACK: {kind:#x} {body!r}")
        self.session_present = bool(body[0] & 1)

    def recv(self):
        """One packet: (first byte, body), or None when the connection closes."""
        while True:
            if len(self.buf) >= 2:
                n, mult, i = 0, 1, 1
                while i < len(self.buf):
                    n += (self.buf[i] & 0x7F) * mult
                    mult *= 128
                    i += 1
                    if not self.buf[i - 1] & 0x80:
                        if len(self.buf) >= i + n:
                            first, body = self.buf[0], self.buf[i : i + n]
                            self.buf = self.buf[i + n :]
                            return first, body
                        break
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk

    def disconnect(self):
        try:
            self.sock.sendall(packet(0xE0, b""))
            self.sock.shutdown(socket.SHUT_WR)
            while self.sock.recv(65536):
                pass
        except OSError:
            pass
        self.sock.close()


def subscribe(port, client, topic_filter):
    Conn(port, client, True).disconnect()
    c = Conn(port, client, False)
    c.sock.sendall(packet(0x82, struct.pack("!H", 1) + utf8(topic_filter) + b"\x01"))
    kind, body = c.recv()
    if kind != 0x90 or body[2:] != b"\x01":
        raise RuntimeError(f"SUBACK: {kind:#x} {body!r}")
    c.disconnect()


def publish(port, client, topic, first, n):
    c = Conn(port, client, True)
    for i in range(n):
        pid = i % 65535 + 1
        body = utf8(topic) + struct.pack("!H", pid) + str(first + i).encode()
        c.sock.sendall(packet(0x32, body))
    acked = 0
    while acked < n:
        p = c.recv()
        if p is None:
            raise RuntimeError(f"closed after {acked} PUBACKs")
        if p[0] == 0x40:
            acked += 1
    c.disconnect()


def failover(pid, port, client, seconds):
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + seconds
    last = None
    while time.monotonic() < deadline:
        try:
            c = Conn(port, client, False, timeout=max(0.01, deadline - time.monotonic()))
        except (OSError, RuntimeError) as e:
            last = e
            time.sleep(0.001)
            continue
        elapsed = time.monotonic() - killed
        present = c.session_present
        c.disconnect()
        if not present:
            raise SystemExit(f"CONNACK after {elapsed * 1000:.0f} ms without session present")
        print(f"{elapsed * 1000:.0f}")
        return
    raise SystemExit(f"no CONNACK within {seconds} s: {last}")


def drain(port, client, expected):
    c = Conn(port, client, False)
    c.sock.settimeout(0.5)
    seen, received = set(), 0
    deadline = time.monotonic() + 30
    while len(seen) < expected and time.monotonic() < deadline:
        try:
            p = c.recv()
        except socket.timeout:
            continue
        if p is None:
            break
        first, body = p
        if first >> 4 != 3:
            continue
        tlen = struct.unpack("!H", body[:2])[0]
        at = 2 + tlen
        if first & 0x06:
            pid = body[at : at + 2]
            at += 2
            c.sock.sendall(packet(0x40, pid))
        received += 1
        seen.add(body[at:])
    c.disconnect()
    print(f"distinct={len(seen)} received={received}")


def main(argv):
    cmd, args = argv[1], argv[2:]
    if cmd == "subscribe":
        subscribe(int(args[0]), args[1], args[2])
    elif cmd == "publish":
        publish(int(args[0]), args[1], args[2], int(args[3]), int(args[4]))
    elif cmd == "failover":
        failover(int(args[0]), int(args[1]), args[2], float(args[3]) if len(args) > 3 else 30)
    elif cmd == "drain":
        drain(int(args[0]), args[1], int(args[2]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
