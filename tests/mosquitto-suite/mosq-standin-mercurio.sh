#!/usr/bin/env python3
# mosq-standin-mercurio.sh — stand-in for ../../src/mosquitto in eclipse/mosquitto's broker tests
# (test/broker), running Mercurio's mercuriod instead. Used by run-mosq-broker-tests.sh beside it
# (BROKER_STANDIN=this file). Written in Python (the name keeps .sh for the runner's docs).
#
#   mosquitto [-v] [-p PORT]... [-c FILE]
#
# Translates the mosquitto.conf keys the tests use into a temporary mercuriod TOML file
# (/tmp/mosq-standin/<first port>.toml), prints to stderr the keys it could not map, then
# exec()s mercuriod (same process, so the test's SIGTERM reaches it) with its stdout (the log)
# sent to stderr, which is where the tests read a broker's log.
#
# Environment: MERCURIOD (the mercuriod binary; default: mercuriod on PATH);
#              MOSQ_STANDIN_LOG_LEVEL (default: "debug" with -v, else "info"; -v is not passed on).
#
# Mapping (mosquitto 2.0.11 semantics -> mercuriod):
#   port P / listener P [host]     -> [[listeners]] host = "127.0.0.1", port = P
#                                     (the tests connect to "localhost", which is 127.0.0.1 only
#                                     on this host, and mosq_test.do_client_connect uses AF_INET)
#   -p P without -c                -> that listener, allow_anonymous = true (mosquitto's
#                                     no-config mode); with -c, allow_anonymous defaults to false
#   allow_anonymous, password_file, acl_file  -> [auth] (paths made absolute); with
#                                     per_listener_settings true, each listener's own keys in
#                                     its [[listeners]] table (allow_anonymous false when unset,
#                                     as in mosquitto)
#   allow_zero_length_clientid B   -> server.allow_zero_length_clientid (global in Mercurio: false
#                                     on any listener applies to all, reported when they differ)
#   mount_point P (per listener)   -> listeners[i].mount_point
#   message_size_limit N           -> server.message_size_limit
#   max_connections N (per listener) -> listeners[i].max_connections (-1 -> 0 = unlimited)
#   (defaults: mosquitto's, where Mercurio's differ: max_packet_size 268435455 (unlimited),
#    max_queued_messages = max_queued_qos0_messages = 1000, max_inflight = receive_maximum = 20)
#   max_inflight_messages N        -> server.max_inflight and server.receive_maximum (mosquitto
#                                     sends it as Receive Maximum too; 0 = unlimited -> 65535)
#   max_queued_messages N          -> server.max_queued_messages and max_queued_qos0_messages
#                                     (mosquitto has one limit for every QoS; 0 = unlimited)
#   max_queued_bytes N             -> server.max_queued_bytes (0 = unlimited in both)
#   max_keepalive N                -> server.max_keepalive
#   max_packet_size N              -> server.max_packet_size (0 = unlimited -> 268435455)
#   maximum_qos / max_qos N        -> server.max_qos (per listener in mosquitto, global here)
#   retain_available B             -> server.retain_available
#   check_retain_source B          -> server.check_retain_source
#   upgrade_outgoing_qos B         -> server.upgrade_outgoing_qos
#   persistent_client_expiration D -> server.persistent_client_expiration (seconds; h d w m y)
#   sys_interval N                 -> server.sys_interval (0 = off -> 1e9)
#   clientid_prefixes S            -> server.clientid_prefixes = [S]
#   persistence true + persistence_file F [+ persistence_location D]
#                                  -> [storage] backend = "sqlite", path = D/F (absolute; default
#                                     F = mosquitto.db, relative to the current directory as in
#                                     mosquitto), so the tests' own os.remove(F) resets the state.
#                                     When F does not exist, stale F-wal/F-shm are removed first.
#   connection_messages B          -> [logging] connection_messages
#   protocol websockets            -> listeners[i].protocol = "websocket"
#   log_type, log_dest, log_timestamp*, autosave_*  -> ignored (logging / save timing only)
#   [admin] socket = /tmp/mosq-standin-<first port>.sock (one per instance)
# Not mapped (reported on stderr; the broker still starts): max_inflight_bytes, and any
#   other key.

import os
import sys

MERCURIOD = os.environ.get("MERCURIOD", "mercuriod")
STATE_DIR = "/tmp/mosq-standin"

SECURITY_KEYS = {"allow_anonymous", "password_file", "acl_file", "allow_zero_length_clientid",
                 "auto_id_prefix", "psk_file", "auth_plugin", "plugin"}
IGNORED = {"log_type", "log_dest", "log_timestamp", "log_timestamp_format", "autosave_interval",
           "autosave_on_changes", "log_facility", "websockets_log_level"}


def note(msg):
    sys.stderr.write("mosq-standin: " + msg + "\n")


def usage_error(msg):
    note(msg)
    sys.exit(3)


def parse_bool(key, v):
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    usage_error("%s: not a boolean: %r" % (key, v))


def parse_duration(v):
    units = {"h": 3600, "d": 86400, "w": 7 * 86400, "m": 30 * 86400, "y": 365 * 86400}
    if v and v[-1] in units:
        return int(v[:-1]) * units[v[-1]]
    return int(v)


def toml_str(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(argv):
    ports_cli = []
    conf = None
    verbose = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-v", "--verbose"):
            verbose = True
        elif a in ("-p", "--port"):
            i += 1
            ports_cli.append(int(argv[i]))
        elif a in ("-c", "--config-file"):
            i += 1
            conf = argv[i]
        elif a in ("-d", "--daemon"):
            usage_error("-d (daemon) is not supported by the stand-in")
        else:
            usage_error("unknown option %r" % a)
        i += 1

    listeners = []            # dicts: port, protocol, max_connections, security{}
    default = {"port": None, "protocol": None, "max_connections": None, "security": {},
               "mount_point": None}
    glob_security = {}
    # mosquitto 2.0.11's defaults where Mercurio's differ: max_packet_size unlimited (Mercurio:
    # 1 MiB, and it then tells MQTT 5 clients in CONNACK), max_queued_messages 1000 for every QoS
    # (Mercurio: 10000, QoS 0 1000), Receive Maximum = max_inflight_messages = 20 (Mercurio: 1024).
    server = {"max_packet_size": 268435455, "max_queued_messages": 1000,
              "max_queued_qos0_messages": 1000, "max_inflight": 20, "receive_maximum": 20}
    storage = {"persistence": False, "file": "mosquitto.db", "location": None}
    logging_keys = {}
    unmapped = []
    per_listener = False
    cur = default             # listener that listener-scoped keys go to

    if conf is not None:
        with open(conf) as f:
            lines = f.read().splitlines()
        # per_listener_settings applies to the whole file, wherever it is written.
        for line in lines:
            t = line.strip().split()
            if len(t) >= 2 and t[0] == "per_listener_settings":
                per_listener = parse_bool(t[0], t[1])
        for n, line in enumerate(lines, 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            key, _, rest = s.partition(" ")
            rest = rest.strip()
            toks = rest.split()
            if key == "per_listener_settings":
                continue
            if key == "port":
                default["port"] = int(toks[0])
            elif key == "listener":
                cur = {"port": int(toks[0]), "protocol": None, "max_connections": None,
                       "security": {}, "mount_point": None}
                if len(toks) > 1 and toks[1] not in ("localhost", "127.0.0.1", "0.0.0.0", "::"):
                    note("line %d: listener bind address %s replaced by 127.0.0.1" % (n, toks[1]))
                listeners.append(cur)
            elif key in SECURITY_KEYS:
                target = cur["security"] if per_listener else glob_security
                target[key] = rest
            elif key == "max_connections":
                cur["max_connections"] = int(toks[0])
            elif key == "mount_point":
                cur["mount_point"] = rest
            elif key == "message_size_limit":
                server["message_size_limit"] = max(0, int(toks[0]))
            elif key == "protocol":
                if toks[0] == "websockets":
                    cur["protocol"] = "websocket"
                elif toks[0] != "mqtt":
                    unmapped.append("line %d: protocol %s" % (n, rest))
            elif key == "max_inflight_messages":
                v = int(toks[0])
                v = 65535 if v <= 0 or v >= 65535 else v
                server["max_inflight"] = v
                server["receive_maximum"] = v
            elif key == "max_queued_messages":
                v = int(toks[0])
                v = 1_000_000_000 if v <= 0 else v
                server["max_queued_messages"] = v
                server["max_queued_qos0_messages"] = v
            elif key == "max_queued_bytes":
                server["max_queued_bytes"] = max(0, int(toks[0]))
            elif key == "max_keepalive":
                server["max_keepalive"] = int(toks[0])
            elif key == "max_packet_size":
                v = int(toks[0])
                server["max_packet_size"] = 268435455 if v <= 0 else v
            elif key in ("maximum_qos", "max_qos"):
                server["max_qos"] = int(toks[0])
            elif key in ("retain_available", "check_retain_source", "upgrade_outgoing_qos"):
                server[key] = parse_bool(key, toks[0])
            elif key == "persistent_client_expiration":
                server["persistent_client_expiration"] = parse_duration(toks[0])
            elif key == "sys_interval":
                v = int(toks[0])
                server["sys_interval"] = 1_000_000_000 if v <= 0 else v
            elif key == "clientid_prefixes":
                server["clientid_prefixes"] = [rest]
            elif key == "persistence":
                storage["persistence"] = parse_bool(key, toks[0])
            elif key == "persistence_file":
                storage["file"] = rest
            elif key == "persistence_location":
                storage["location"] = rest
            elif key == "connection_messages":
                logging_keys["connection_messages"] = parse_bool(key, toks[0])
            elif key in IGNORED:
                note("line %d: %s ignored (logging or save timing only)" % (n, s))
            else:
                unmapped.append("line %d: %s" % (n, s))

    # Listeners: "port" (or -p) makes the default listener; "listener" lines add more.
    all_listeners = []
    for p in ports_cli:
        d = dict(default, port=p)
        all_listeners.append(d)
    if not ports_cli and default["port"] is not None:
        all_listeners.append(default)
    all_listeners += listeners
    if not all_listeners:
        all_listeners.append(dict(default, port=1883))
    if conf is None:
        glob_security["allow_anonymous"] = "true"

    def auth_keys(security, into):
        for key, val in security.items():
            if key == "allow_anonymous":
                into["allow_anonymous"] = parse_bool(key, val)
            elif key in ("password_file", "acl_file"):
                into[key] = os.path.abspath(val)
            elif key == "allow_zero_length_clientid":
                zero.append(parse_bool(key, val))
            else:
                unmapped.append("%s %s" % (key, val))

    # Security options: global, or per listener (each [[listeners]] table then has its own).
    auth = {}
    zero = []
    if per_listener:
        for l in all_listeners:
            l["auth"] = {}
            auth_keys(l["security"], l["auth"])
            if conf is None:
                l["auth"]["allow_anonymous"] = True
        if len(set(zero)) > 1:
            unmapped.append("allow_zero_length_clientid differs between listeners; false for all")
    else:
        auth_keys(glob_security, auth)
    if conf is None:
        auth["allow_anonymous"] = True
    if False in zero:
        server["allow_zero_length_clientid"] = False

    first_port = all_listeners[0]["port"]
    os.makedirs(STATE_DIR, exist_ok=True)
    out = []
    if server:
        out.append("[server]")
        for k, v in server.items():
            if isinstance(v, bool):
                out.append("%s = %s" % (k, "true" if v else "false"))
            elif isinstance(v, list):
                out.append("%s = [%s]" % (k, ", ".join(toml_str(x) for x in v)))
            else:
                out.append("%s = %d" % (k, v))
        out.append("")
    seen = set()
    for l in all_listeners:
        if l["port"] in seen:
            continue
        seen.add(l["port"])
        out.append("[[listeners]]")
        out.append('host = "127.0.0.1"')
        out.append("port = %d" % l["port"])
        if l["protocol"]:
            out.append("protocol = %s" % toml_str(l["protocol"]))
        if l["max_connections"] is not None:
            out.append("max_connections = %d" % max(0, l["max_connections"]))
        if l.get("mount_point"):
            out.append("mount_point = %s" % toml_str(l["mount_point"]))
        if per_listener:
            out.append("allow_anonymous = %s"
                       % ("true" if l["auth"].get("allow_anonymous") else "false"))
            for k in ("password_file", "acl_file"):
                if k in l["auth"]:
                    out.append("%s = %s" % (k, toml_str(l["auth"][k])))
        out.append("")
    out.append("[auth]")
    out.append("allow_anonymous = %s" % ("true" if auth.get("allow_anonymous") else "false"))
    for k in ("password_file", "acl_file"):
        if k in auth:
            out.append("%s = %s" % (k, toml_str(auth[k])))
    out.append("")
    if storage["persistence"]:
        path = storage["file"]
        if storage["location"]:
            path = os.path.join(storage["location"], path)
        path = os.path.abspath(path)
        if not os.path.exists(path):
            # A fresh start: drop what a killed broker may have left beside a removed file.
            for suffix in ("-wal", "-shm", "-journal"):
                try:
                    os.remove(path + suffix)
                except FileNotFoundError:
                    pass
        out.append("[storage]")
        out.append('backend = "sqlite"')
        out.append("path = %s" % toml_str(path))
        out.append("")
    level = os.environ.get("MOSQ_STANDIN_LOG_LEVEL", "debug" if verbose else "info")
    out.append("[logging]")
    out.append("level = %s" % toml_str(level))
    for k, v in logging_keys.items():
        out.append("%s = %s" % (k, "true" if v else "false"))
    out.append("")
    out.append("[admin]")
    out.append("socket = %s" % toml_str("/tmp/mosq-standin-%d.sock" % first_port))
    out.append("")

    toml_path = os.path.join(STATE_DIR, "%d.toml" % first_port)
    with open(toml_path, "w") as f:
        f.write("\n".join(out))
    for u in unmapped:
        note("not mapped: " + u)
    note("config %s -> %s" % (conf or "(none, -p)", toml_path))

    os.dup2(2, 1)             # the log (stdout) goes where the tests read it: stderr
    os.execvp(MERCURIOD, [MERCURIOD, "-c", toml_path])


if __name__ == "__main__":
    main(sys.argv[1:])
