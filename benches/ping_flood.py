#!/usr/bin/env python3
"""A client that floods PINGREQ and never reads its socket, beside a client that pings.

Usage: benches/ping_flood.py PORT [--mib N] [--seconds S]

Connects (MQTT 3.1.1) with a small receive buffer, then writes up to N MiB (default 256) of
PINGREQ packets without ever reading, for at most S seconds (default 20), while a second
connection sends one PINGREQ every 100 ms and times its PINGRESP. A broker that bounds what
it owes a client stops reading the flooder (its writes block) and may close it; one that
does not keeps buffering PINGRESPs it cannot write. Prints one JSON line: MiB written,
whether the broker closed the flooder, and the bystander's pings (answered, lost, worst
round trip). Run the broker's RSS sampling around it (benches/compare.sh does).
"""
import json
import socket
import sys
import threading
import time

def connect(port, client_id, rcvbuf=None):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.connect(("127.0.0.1", port))
    cid = client_id.encode()
    body = bytes([0x00, 0x04]) + b"MQTT" + bytes([0x04, 0x02, 0x00, 0x3C]) + len(cid).to_bytes(2, "big") + cid
    s.sendall(bytes([0x10, len(body)]) + body)
    ack = b""
    while len(ack) < 4:
        chunk = s.recv(4 - len(ack))
        if not chunk:
            raise SystemExit(f"{client_id}: closed before CONNACK")
        ack += chunk
    if ack[0] != 0x20 or ack[3] != 0:
        raise SystemExit(f"{client_id}: refused {ack!r}")
    return s


def main():
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return
    port = int(args[0])
    mib = 256
    seconds = 20.0
    i = 1
    while i < len(args):
        if args[i] == "--mib":
            mib = int(args[i + 1])
            i += 2
        elif args[i] == "--seconds":
            seconds = float(args[i + 1])
            i += 2
        else:
            raise SystemExit(f"unknown option {args[i]}")

    flooder = connect(port, "ping-flooder", rcvbuf=4096)
    bystander = connect(port, "ping-bystander")
    bystander.settimeout(2.0)
    stop = threading.Event()
    pings = {"answered": 0, "lost": 0, "worst_ms": 0.0}

    def ping_loop():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                bystander.sendall(bytes([0xC0, 0x00]))
                got = bystander.recv(2)
                if got != bytes([0xD0, 0x00]):
                    pings["lost"] += 1
                    return
                pings["answered"] += 1
                pings["worst_ms"] = max(pings["worst_ms"], (time.monotonic() - t0) * 1000)
            except OSError:
                pings["lost"] += 1
            time.sleep(0.1)

    t = threading.Thread(target=ping_loop, daemon=True)
    t.start()
    chunk = bytes([0xC0, 0x00]) * (512 * 1024)
    flooder.settimeout(0.5)
    written = 0
    closed = False
    start = time.monotonic()
    while written < mib << 20 and time.monotonic() - start < seconds:
        try:
            n = flooder.send(chunk)
            written += n
        except socket.timeout:
            continue
        except OSError:
            closed = True
            break
    elapsed = time.monotonic() - start
    if not closed:
        # A broker that stopped reading may still close it: look a little longer.
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            try:
                flooder.send(chunk)
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
    stop.set()
    t.join(timeout=3)
    print(json.dumps({
        "flood": {
            "mib_written": round(written / (1 << 20), 1),
            "seconds": round(elapsed, 2),
            "closed": closed,
            "pings_answered": pings["answered"],
            "pings_lost": pings["lost"],
            "ping_worst_ms": round(pings["worst_ms"], 1),
        }
    }))


if __name__ == "__main__":
    main()
