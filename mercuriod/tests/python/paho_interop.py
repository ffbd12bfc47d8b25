#!/usr/bin/env python3
"""Interoperability checks of a Mercurio broker with Python's paho-mqtt 2.x.

Usage: paho_interop.py HOST PORT VERSION   (VERSION: 31, 311 or 5)

Runs connect, subscribe, publish at QoS 0/1/2, retained messages, a will on an abnormal
disconnect (socket closed without DISCONNECT) and, in 5.0, the forwarding of publish
properties. Every wait has a deadline. The last line printed is one JSON object:
{"version": ..., "passed": [check names], "failed": [{"check", "expected", "observed"}]}
which the Rust test (interop_paho.rs) asserts on. Exit status 0 unless the script itself
broke.
"""

import json
import queue
import socket
import sys
import time

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

WAIT = 10.0  # seconds, for each expected event

HOST = sys.argv[1]
PORT = int(sys.argv[2])
VERSION = sys.argv[3]
PROTOCOL = {"31": mqtt.MQTTv31, "311": mqtt.MQTTv311, "5": mqtt.MQTTv5}[VERSION]
V5 = PROTOCOL == mqtt.MQTTv5
PREFIX = "paho/" + VERSION

passed = []
failed = []


def check(name, expected, observed):
    if expected == observed:
        passed.append(name)
    else:
        failed.append({"check": name, "expected": expected, "observed": observed})


def rc_value(rc):
    """A reason code (paho 2.x ReasonCode or int) as an int."""
    return rc.value if hasattr(rc, "value") else int(rc)


class Peer:
    """A paho client with its events in queues, its network loop in a thread."""

    def __init__(self, client_id, clean=True, will=None, loop=True, session_expiry=None, keepalive=60):
        kwargs = {}
        if not V5:
            kwargs["clean_session"] = clean
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=PROTOCOL,
            **kwargs,
        )
        self.connacks = queue.Queue()
        self.subacks = queue.Queue()
        self.messages = queue.Queue()
        self.session_present = None

        def on_connect(c, u, flags, rc, props):
            self.session_present = bool(flags.session_present)
            self.connacks.put(rc_value(rc))

        self.client.on_connect = on_connect
        self.client.on_subscribe = lambda c, u, mid, rcs, props: self.subacks.put(
            [rc_value(r) for r in rcs]
        )
        self.client.on_message = lambda c, u, msg: self.messages.put(msg)
        if will is not None:
            topic, payload, qos = will[:3]
            retain = len(will) > 3 and will[3]
            self.client.will_set(topic, payload, qos=qos, retain=retain)
        connect_kwargs = {}
        if V5:
            connect_kwargs["clean_start"] = clean
            if session_expiry is not None:
                props = Properties(PacketTypes.CONNECT)
                props.SessionExpiryInterval = session_expiry
                connect_kwargs["properties"] = props
        self.client.connect(HOST, PORT, keepalive=keepalive, **connect_kwargs)
        self.looping = loop
        if loop:
            self.client.loop_start()
        else:
            # Drive the loop by hand until the CONNACK is in (for the abnormal close).
            deadline = time.monotonic() + WAIT
            while self.connacks.empty() and time.monotonic() < deadline:
                self.client.loop(timeout=0.1)
        self.connack = self.connacks.get(timeout=WAIT)

    def subscribe(self, topic, qos, options=None):
        if options is not None:
            self.client.subscribe(topic, options=options)
        else:
            self.client.subscribe(topic, qos)
        return self.subacks.get(timeout=WAIT)

    def publish(self, topic, payload, qos=0, retain=False, properties=None):
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        info.wait_for_publish(timeout=WAIT)
        return info.is_published()

    def message(self, wait=WAIT):
        try:
            return self.messages.get(timeout=wait)
        except queue.Empty:
            return None

    def close(self):
        self.client.disconnect()
        if self.looping:
            self.client.loop_stop()


def summary(msg):
    if msg is None:
        return None
    return [msg.topic, msg.payload.decode("utf-8", "replace"), msg.qos, bool(msg.retain)]


def main():
    # Connect, subscribe.
    sub = Peer("paho-sub-" + VERSION)
    check("connect", 0, sub.connack)
    check("subscribe", [2], sub.subscribe(PREFIX + "/qos/#", 2))
    pub = Peer("paho-pub-" + VERSION)

    # QoS 0, 1, 2 round trip.
    for qos in (0, 1, 2):
        topic = "%s/qos/%d" % (PREFIX, qos)
        check("published qos %d" % qos, True, pub.publish(topic, "qos %d" % qos, qos=qos))
        check("received qos %d" % qos, [topic, "qos %d" % qos, qos, False], summary(sub.message()))

    # Retained: a later subscriber gets it with the retain flag; an empty one deletes it.
    retained_topic = PREFIX + "/retained"
    check("publish retained", True, pub.publish(retained_topic, "kept", qos=1, retain=True))
    later = Peer("paho-later-" + VERSION)
    check("subscribe retained", [1], later.subscribe(retained_topic, 1))
    check("retained delivered", [retained_topic, "kept", 1, True], summary(later.message()))
    check("delete retained", True, pub.publish(retained_topic, b"", qos=1, retain=True))
    check("empty retained forwarded", [retained_topic, "", 1, False], summary(later.message()))
    later.close()
    after = Peer("paho-after-" + VERSION)
    check("subscribe after delete", [1], after.subscribe(retained_topic, 1))
    pub.publish(retained_topic, "marker", qos=1)
    check("nothing retained after delete", [retained_topic, "marker", 1, False], summary(after.message()))
    after.close()

    # Will on an abnormal disconnect: the socket is closed without DISCONNECT.
    will_topic = PREFIX + "/will"
    watcher = Peer("paho-watch-" + VERSION)
    check("subscribe will", [1], watcher.subscribe(will_topic, 1))
    doomed = Peer("paho-doomed-" + VERSION, will=(will_topic, "gone", 1), loop=False)
    check("connect with will", 0, doomed.connack)
    sock = doomed.client.socket()
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    check("will published", [will_topic, "gone", 1, False], summary(watcher.message()))
    # A client that disconnects normally has its will discarded.
    polite = Peer("paho-polite-" + VERSION, will=(will_topic, "not sent", 1))
    polite.close()
    pub.publish(will_topic, "marker", qos=1)
    check("no will after DISCONNECT", [will_topic, "marker", 1, False], summary(watcher.message()))
    watcher.close()

    # Keep alive: a client that goes silent (no PINGREQ, socket left open) is disconnected
    # after one and a half times its keep alive, and its will is published.
    ka_topic = PREFIX + "/will/keepalive"
    ka_watch = Peer("paho-kawatch-" + VERSION)
    ka_watch.subscribe(ka_topic, 1)
    silent = Peer("paho-silent-" + VERSION, will=(ka_topic, "silent", 1), loop=False, keepalive=1)
    silent_since = time.monotonic()
    check("keep alive will", [ka_topic, "silent", 1, False], summary(ka_watch.message()))
    waited = time.monotonic() - silent_since
    check("keep alive honoured", True, 1.0 <= waited <= 5.0)
    ka_watch.close()
    silent.client.socket().close()

    # A retained will is kept for later subscribers.
    retained_will = PREFIX + "/will/retained"
    live_watch = Peer("paho-lwatch-" + VERSION)
    live_watch.subscribe(retained_will, 1)
    doomed = Peer("paho-doomed-r-" + VERSION, will=(retained_will, "gone retained", 1, True), loop=False)
    sock = doomed.client.socket()
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    check("retained will, live", [retained_will, "gone retained", 1, False], summary(live_watch.message()))
    live_watch.close()
    later_watch = Peer("paho-rwatch-" + VERSION)
    later_watch.subscribe(retained_will, 1)
    check("retained will, later", [retained_will, "gone retained", 1, True], summary(later_watch.message()))
    pub.publish(retained_will, b"", qos=1, retain=True)
    later_watch.close()

    # Persistent session: QoS 1 messages published while away are delivered on return.
    away_id = "paho-away-" + VERSION
    away_topic = PREFIX + "/away"
    persistent = dict(clean=False, session_expiry=300)
    away = Peer(away_id, **persistent)
    check("new session not present", False, away.session_present)
    check("subscribe away", [1], away.subscribe(away_topic, 1))
    away.close()
    for i in range(3):
        pub.publish(away_topic, "away %d" % i, qos=1)
    back = Peer(away_id, **persistent)
    # MQTT 3.1's CONNACK has no session present flag (the byte is reserved, 0).
    check("session present", VERSION != "31", back.session_present)
    check(
        "queued while away",
        [[away_topic, "away %d" % i, 1, False] for i in range(3)],
        [summary(back.message()) for _ in range(3)],
    )
    back.close()
    Peer(away_id).close()  # a clean session ends it

    # 5.0: publish properties forwarded unchanged, user properties in order.
    if V5:
        props_topic = PREFIX + "/props"
        receiver = Peer("paho-props-" + VERSION)
        check("subscribe props", [1], receiver.subscribe(props_topic, 1))
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = [("k", "v"), ("a", "b"), ("k", "v2")]
        props.ResponseTopic = PREFIX + "/reply"
        props.CorrelationData = b"\x00\x01corr"
        props.MessageExpiryInterval = 3600
        props.ContentType = "application/json"
        props.PayloadFormatIndicator = 1
        check("publish props", True, pub.publish(props_topic, "{}", qos=1, properties=props))
        msg = receiver.message()
        if msg is None:
            check("props message", "a message", None)
        else:
            p = msg.properties
            check("user properties", [["k", "v"], ["a", "b"], ["k", "v2"]],
                  [list(kv) for kv in getattr(p, "UserProperty", [])])
            check("response topic", PREFIX + "/reply", getattr(p, "ResponseTopic", None))
            check("correlation data", "0001636f7272", getattr(p, "CorrelationData", b"").hex())
            check("content type", "application/json", getattr(p, "ContentType", None))
            check("payload format indicator", 1, getattr(p, "PayloadFormatIndicator", None))
            expiry = getattr(p, "MessageExpiryInterval", None)
            check("message expiry", True, expiry is not None and 3590 <= expiry <= 3600)
        receiver.close()

        # Subscription options: no local, retain handling, retain as published.
        opts_topic = PREFIX + "/opts"
        pub.publish(opts_topic, "retained", qos=1, retain=True)
        me = Peer("paho-opts-" + VERSION)
        check("subscribe no local", [1],
              me.subscribe(opts_topic, 1, SubscribeOptions(qos=1, noLocal=True, retainHandling=2)))
        me.publish(opts_topic, "mine", qos=1)
        pub.publish(opts_topic, "theirs", qos=1)
        check("no local", [opts_topic, "theirs", 1, False], summary(me.message()))
        other = Peer("paho-opts2-" + VERSION)
        check("subscribe rh1", [1],
              other.subscribe(opts_topic, 1, SubscribeOptions(qos=1, retainHandling=1, retainAsPublished=True)))
        check("retain handling 1, new", [opts_topic, "retained", 1, True], summary(other.message()))
        check("subscribe rh1 again", [1],
              other.subscribe(opts_topic, 1, SubscribeOptions(qos=1, retainHandling=1, retainAsPublished=True)))
        pub.publish(opts_topic, "live", qos=1, retain=True)
        # Not the retained message again (retain handling 1, existing subscription); the live
        # one keeps its retain flag (retain as published).
        check("retain as published", [opts_topic, "live", 1, True], summary(other.message()))
        pub.publish(opts_topic, b"", qos=1, retain=True)
        me.close()
        other.close()

        # Message expiry of a message queued for a client that is away: the one that expired
        # is dropped, the other arrives with what is left of its interval. (Waiting for an
        # expiry is waiting for time itself: 1 s.)
        exp_id = "paho-exp-" + VERSION
        exp_topic = PREFIX + "/expiry"
        exp = Peer(exp_id, clean=False, session_expiry=300)
        exp.subscribe(exp_topic, 1)
        exp.close()
        short = Properties(PacketTypes.PUBLISH)
        short.MessageExpiryInterval = 1
        pub.publish(exp_topic, "short", qos=1, properties=short)
        long_ = Properties(PacketTypes.PUBLISH)
        long_.MessageExpiryInterval = 100
        pub.publish(exp_topic, "long", qos=1, properties=long_)
        time.sleep(2.1)
        exp = Peer(exp_id, clean=False, session_expiry=300)
        msg = exp.message()
        check("expired message dropped", [exp_topic, "long", 1, False], summary(msg))
        remaining = getattr(msg.properties, "MessageExpiryInterval", None) if msg else None
        check("expiry counts down", True, remaining is not None and 90 <= remaining <= 98)
        exp.close()
        Peer(exp_id).close()

    pub.close()
    sub.close()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # report, so the Rust test shows what broke
        failed.append({"check": "script", "expected": "no exception", "observed": repr(e)})
    print(json.dumps({"version": VERSION, "passed": passed, "failed": failed}))
    sys.stdout.flush()
