#!/usr/bin/env python3
"""Storage back pressure: 20 offline persistent subscribers (SQLite), then 11 MiB of QoS 1
publishes with 60 KB topics from one paho publisher (20 in flight). Prints how long the
publisher took to get every PUBACK and the broker's peak RSS (VmHWM). docs/BENCHMARKS.md,
"Storage back pressure". Needs paho-mqtt 2. Not part of `cargo test`.

usage: benches/storage_fanout.py path/to/mercuriod WORKDIR   (WORKDIR is emptied)"""
import os, subprocess, sys, time, re
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

exe, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
db = os.path.join(work, "m.db")
for f in os.listdir(work):
    os.remove(os.path.join(work, f))
conf = os.path.join(work, "m.toml")
open(conf, "w").write(f"""[auth]
allow_anonymous = true
[[listeners]]
host = "127.0.0.1"
port = 0
[storage]
backend = "sqlite"
path = "{db}"
""")
p = subprocess.Popen([exe, "-c", conf], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
port = None
for line in p.stdout:
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if m:
        port = int(m.group(1)); break

def hwm():
    for l in open(f"/proc/{p.pid}/status"):
        if l.startswith("VmHWM"): return int(l.split()[1]) // 1024
    return -1

N = 20
for i in range(N):
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sub{i}", clean_session=False)
    c.connect("127.0.0.1", port); c.loop_start()
    r = c.subscribe("#", 1); time.sleep(0.05)
    c.disconnect(); c.loop_stop()

base = hwm()
topic_len = 60 * 1024
count = (11 * 1024 * 1024) // topic_len
acked = 0
def on_publish(c, u, mid, rc, props):
    global acked
    acked += 1
pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pub")
pub.on_publish = on_publish
pub.max_inflight_messages_set(20)
pub.connect("127.0.0.1", port); pub.loop_start()
t0 = time.time()
for i in range(count):
    pub.publish(("t%05d" % i) + "x" * (topic_len - 6), b"p", qos=1)
while acked < count and time.time() - t0 < 300:
    time.sleep(0.01)
t1 = time.time()
peak_at_ack = hwm()
time.sleep(3)
print(f"messages {count} (topic {topic_len} B) x {N} offline subs: acked {acked} in {t1-t0:.2f} s; "
      f"peak RSS {peak_at_ack} MiB (base {base} MiB), after 3 s {hwm()} MiB")
pub.disconnect(); pub.loop_stop()
p.terminate(); p.wait()
