//! Users, groups, roles and rules kept in storage (`[auth] backend = "storage"`), managed
//! with `mercurioctl user|group|role|acl` against a live mercuriod, and SCRAM through MQTT 5
//! AUTH packets: clients over real sockets see each change at once.
#![cfg(unix)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use mercurio_core::codec::{self, Connect, Packet, Properties, ProtocolVersion, QoS, ReasonCode};
use mercurio_testkit::{Client, Daemon, DEADLINE};
use serde_json::Value;

const MERCURIOCTL: &str = env!("CARGO_BIN_EXE_mercurioctl");

/// A mercuriod keeping its access rules in storage (`storage`: the `[storage]` section),
/// anonymous clients refused.
fn broker(storage: &str) -> Daemon {
    let dir = tempfile::tempdir().expect("dir");
    let socket = dir.path().join("run").join("m.sock");
    let text = format!(
        "[auth]\nbackend = \"storage\"\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
         [admin]\nsocket = {:?}\n\n{}",
        socket.display().to_string(),
        storage.replace("DIR", &dir.path().display().to_string())
    );
    Daemon::with_config(&text)
        .in_dir(dir)
        .socket(socket)
        .start()
}

/// Runs mercurioctl on `d`'s socket with `stdin`; returns (status, stdout, stderr).
fn ctl_in(d: &Daemon, args: &[&str], stdin: &str) -> (Option<i32>, String, String) {
    let mut child = Command::new(MERCURIOCTL)
        .arg("--socket")
        .arg(&d.socket)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run mercurioctl");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    let out = child.wait_with_output().expect("mercurioctl ends");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs mercurioctl, expecting success.
fn ok(d: &Daemon, args: &[&str]) -> String {
    let (code, out, err) = ctl_in(d, args, "");
    assert_eq!(code, Some(0), "{args:?}: {err}");
    out
}

/// CONNECT as `user` with `password` (MQTT 5); the CONNACK's reason code, and the connection
/// when accepted.
fn connect(addr: SocketAddr, id: &str, user: &str, password: &str) -> (u8, Option<Client>) {
    let rc = connack(addr, id, user, password);
    if rc != 0 {
        return (rc, None);
    }
    // Accepted: connected again through the testkit's client.
    let (client, _) = Client::connect(addr, connect_packet(id, user, password));
    (rc, Some(client))
}

fn connect_packet(id: &str, user: &str, password: &str) -> Connect {
    Connect {
        protocol: ProtocolVersion::V5,
        clean_start: true,
        keep_alive: 60,
        client_id: id.into(),
        will: None,
        username: Some(user.into()),
        password: Some(Bytes::copy_from_slice(password.as_bytes())),
        properties: Properties::default(),
    }
}

/// The CONNACK reason code for `user` and `password` (MQTT 5).
fn connack(addr: SocketAddr, id: &str, user: &str, password: &str) -> u8 {
    let c = connect_packet(id, user, password);
    let mut stream = TcpStream::connect(addr).expect("connect");
    let mut out = BytesMut::new();
    codec::encode(&Packet::Connect(Box::new(c)), ProtocolVersion::V5, &mut out).expect("encode");
    stream.write_all(&out).expect("write");
    let mut buf = BytesMut::new();
    stream.set_read_timeout(Some(DEADLINE)).ok();
    let rc = loop {
        if let Some(p) = codec::decode(&mut buf, ProtocolVersion::V5, 1 << 20).expect("decode") {
            match p {
                Packet::ConnAck(a) => break a.reason_code.0,
                other => panic!("expected CONNACK, got {other:?}"),
            }
        }
        let mut chunk = [0u8; 1024];
        match mercurio_testkit::uninterrupted(|| stream.read(&mut chunk)) {
            Ok(0) => panic!("closed before CONNACK"),
            Err(e) => panic!("no CONNACK: {e}"),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    rc
}

/// A user added with mercurioctl connects within a second of the command; a rule change cuts
/// what a connected client reads, as an ACL reload does; a removed user is disconnected and
/// refused.
#[test]
fn users_and_rules_apply_at_once() {
    let d = broker("");
    let addr = d.addr();
    // Unknown: refused, not authorized (0x87), as the password file refuses.
    assert_eq!(connect(addr, "a1", "alice", "s3cret").0, 0x87);

    let (code, _, err) = ctl_in(&d, &["user", "add", "alice", "--stdin"], "s3cret\n");
    assert_eq!(code, Some(0), "{err}");
    let added = Instant::now();
    let rc = connack(addr, "a1", "alice", "s3cret");
    assert_eq!(rc, 0, "alice connects at the first attempt once added");
    let took = added.elapsed();
    // Within a second, beyond what checking an argon2id hash costs (seconds in a debug
    // build), measured with a wrong password.
    let wrong = Instant::now();
    assert_eq!(connack(addr, "a1", "alice", "wrong"), 0x87);
    let check = wrong.elapsed();
    assert!(
        took < check + Duration::from_secs(1),
        "{took:?} (a check: {check:?})"
    );
    // Adding again is refused, and says why.
    let (code, _, err) = ctl_in(&d, &["user", "add", "alice", "--stdin"], "x\n");
    assert_eq!(code, Some(1));
    assert!(err.contains("exists"), "{err}");

    // No role yet: every access is denied (no ACL file follows the stored rules).
    ok(&d, &["role", "create", "sensors"]);
    ok(&d, &["acl", "add", "sensors", "readwrite", "t/#"]);
    ok(&d, &["group", "create", "fleet"]);
    ok(&d, &["group", "add-role", "fleet", "sensors"]);
    ok(&d, &["group", "add-user", "fleet", "alice"]);
    let show: Value =
        serde_json::from_str(&ok(&d, &["--json", "user", "show", "alice"])).expect("json");
    assert_eq!(show["groups"], serde_json::json!(["fleet"]));
    assert_eq!(show["rules"][0]["topic"], "t/#");
    assert_eq!(
        show["scram"],
        serde_json::json!(["SCRAM-SHA-256", "SCRAM-SHA-512"])
    );

    let (_, sub) = connect(addr, "sub", "alice", "s3cret");
    let mut sub = sub.expect("connected");
    sub.subscribe("t/#", QoS::AtMostOnce);
    let (_, publisher) = connect(addr, "pub", "alice", "s3cret");
    let mut publisher = publisher.expect("connected");
    publisher.publish("t/1", b"one", QoS::AtLeastOnce, false);
    assert_eq!(&sub.expect_publish().payload[..], b"one");

    // alice may write but no longer read t/#: its subscription goes at once.
    ok(&d, &["acl", "add", "sensors", "deny", "t/secret/#"]);
    ok(&d, &["acl", "remove", "sensors", "readwrite", "t/#"]);
    ok(&d, &["acl", "add", "sensors", "write", "t/#"]);
    let shown = d.admin(r#"{"command":"client.show","client_id":"sub"}"#);
    assert_eq!(
        shown["result"]["subscriptions"],
        serde_json::json!([]),
        "{shown}"
    );
    publisher.publish("t/2", b"two", QoS::AtLeastOnce, false);
    sub.send(Packet::PingReq);
    assert_eq!(sub.recv(), Some(Packet::PingResp), "nothing more for sub");

    // Removed: its clients are disconnected (Administrative action), and it is refused.
    let out = ok(&d, &["user", "remove", "alice"]);
    assert!(out.contains("2 client(s) disconnected"), "{out}");
    match sub.recv() {
        Some(Packet::Disconnect(dis)) => {
            assert_eq!(dis.reason_code, ReasonCode::ADMINISTRATIVE_ACTION)
        }
        other => panic!("expected DISCONNECT, got {other:?}"),
    }
    assert_eq!(connect(addr, "a1", "alice", "s3cret").0, 0x87);
    let list: Value = serde_json::from_str(&ok(&d, &["--json", "user", "list"])).expect("json");
    assert_eq!(list["users"], serde_json::json!([]));
}

/// The records survive a restart with SQLite, and `auth import` loads mosquitto's files.
#[test]
fn sqlite_keeps_users_and_import_loads_files() {
    let dir = tempfile::tempdir().expect("dir");
    let db = dir.path().join("m.db");
    let storage = format!(
        "[storage]\nbackend = \"sqlite\"\npath = {:?}\n",
        db.display().to_string()
    );
    let files = tempfile::tempdir().expect("dir");
    let passwd = files.path().join("passwd");
    let acl = files.path().join("acl");
    mercurio_core::auth::password_file::set_password(&passwd, "dave", b"pw1").expect("passwd");
    std::fs::write(&acl, "user dave\ntopic readwrite d/#\npattern read p/%u\n").expect("acl");
    {
        let mut d = broker(&storage);
        let addr = d.addr();
        let args = [
            "auth",
            "import",
            "--password-file",
            passwd.to_str().expect("utf-8"),
            "--acl-file",
            acl.to_str().expect("utf-8"),
        ];
        let out = ok(&d, &args);
        assert!(out.contains("imported"), "{out}");
        // Again: nothing new, and no error.
        ok(&d, &args);
        let (rc, c) = connect(addr, "d1", "dave", "pw1");
        assert_eq!(rc, 0);
        let mut c = c.expect("connected");
        c.subscribe("d/x", QoS::AtMostOnce);
        c.subscribe("p/dave", QoS::AtMostOnce);
        d.stop(libc::SIGTERM);
    }
    let d = broker(&storage);
    let addr = d.addr();
    assert_eq!(
        connect(addr, "d1", "dave", "pw1").0,
        0,
        "dave is still stored"
    );
    let roles: Value = serde_json::from_str(&ok(&d, &["--json", "role", "list"])).expect("json");
    let names: Vec<&str> = roles["roles"]
        .as_array()
        .expect("roles")
        .iter()
        .filter_map(|r| r["role"].as_str())
        .collect();
    assert_eq!(names, ["patterns", "user:dave"]);
}

/// The SCRAM client of the test, in Python (hashlib, hmac): SCRAM-SHA-256 over raw MQTT 5
/// packets, then a re-authentication on the same connection. Prints one JSON object.
const SCRAM_CLIENT: &str = r#"
import base64, hashlib, hmac, json, os, socket, sys

host, port, user, password, method = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
H = {"SCRAM-SHA-256": hashlib.sha256, "SCRAM-SHA-512": hashlib.sha512}.get(method, hashlib.sha256)

def varint(n):
    out = b""
    while True:
        b = n % 128; n //= 128
        out += bytes([b | (0x80 if n else 0)])
        if not n: return out

def s(b): return len(b).to_bytes(2, "big") + b

def props(auth_data):
    p = b"\x15" + s(method.encode())
    if auth_data is not None: p += b"\x16" + s(auth_data)
    return varint(len(p)) + p

def packet(first, body): return bytes([first]) + varint(len(body)) + body

def read_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk: raise EOFError("closed")
        data += chunk
    return data

def read_packet(sock):
    first = read_exact(sock, 1)[0]
    n, mult = 0, 1
    while True:
        b = read_exact(sock, 1)[0]
        n += (b & 0x7F) * mult; mult *= 128
        if not b & 0x80: break
    return first, read_exact(sock, n)

def parse_props(body):
    n, mult, i = 0, 1, 0
    while True:
        b = body[i]; i += 1
        n += (b & 0x7F) * mult; mult *= 128
        if not b & 0x80: break
    end, out = i + n, {}
    while i < end:
        pid = body[i]; i += 1
        if pid in (0x15, 0x16, 0x1F, 0x12):
            ln = int.from_bytes(body[i:i+2], "big"); out[pid] = body[i+2:i+2+ln]; i += 2 + ln
        elif pid in (0x21, 0x22, 0x13): i += 2
        elif pid in (0x11, 0x27): i += 4
        elif pid in (0x24, 0x25, 0x28, 0x29, 0x2A): i += 1
        elif pid == 0x26:
            for _ in range(2):
                ln = int.from_bytes(body[i:i+2], "big"); i += 2 + ln
        else: raise ValueError("property %x" % pid)
    return out

def hmac_(k, m): return hmac.new(k, m, H).digest()

def first_message():
    nonce = base64.b64encode(os.urandom(18)).decode()
    bare = "n=%s,r=%s" % (user.replace("=", "=3D").replace(",", "=2C"), nonce)
    return "n,," + bare, bare

def final_message(bare, server_first):
    attrs = dict(a.split("=", 1) for a in server_first.split(","))
    salted = hashlib.pbkdf2_hmac(H().name, password.encode(), base64.b64decode(attrs["s"]), int(attrs["i"]))
    client_key = hmac_(salted, b"Client Key")
    stored_key = H(client_key).digest()
    without_proof = "c=biws,r=" + attrs["r"]
    auth_message = ",".join([bare, server_first, without_proof]).encode()
    signature = hmac_(stored_key, auth_message)
    proof = bytes(a ^ b for a, b in zip(client_key, signature))
    server_signature = hmac_(hmac_(salted, b"Server Key"), auth_message)
    return without_proof + ",p=" + base64.b64encode(proof).decode(), server_signature

result = {}
sock = socket.create_connection((host, port), timeout=20)
first, bare = first_message()
connect = s(b"MQTT") + b"\x05\x02\x00\x3c" + props(first.encode()) + s(b"scram-py")
sock.sendall(packet(0x10, connect))
kind, body = read_packet(sock)
if kind == 0x20:
    result["connack"] = body[1]
    print(json.dumps(result)); sys.exit(0)
assert kind == 0xF0, kind
result["auth"] = body[0]
server_first = parse_props(body[1:])[0x16].decode()
final, expected = final_message(bare, server_first)
sock.sendall(packet(0xF0, b"\x18" + props(final.encode())))
kind, body = read_packet(sock)
assert kind == 0x20, kind
result["connack"] = body[1]
if body[1] == 0:
    p = parse_props(body[2:])
    result["method"] = p[0x15].decode()
    result["verified"] = p[0x16] == b"v=" + base64.b64encode(expected)
    # Re-authentication on the same connection (MQTT 5.0 section 4.12.1).
    first, bare = first_message()
    sock.sendall(packet(0xF0, b"\x19" + props(first.encode())))
    kind, body = read_packet(sock)
    assert kind == 0xF0 and body[0] == 0x18, (kind, body)
    final, expected = final_message(bare, parse_props(body[1:])[0x16].decode())
    sock.sendall(packet(0xF0, b"\x18" + props(final.encode())))
    kind, body = read_packet(sock)
    result["reauth_packet"] = kind
    result["reauth_code"] = body[0]
    if kind == 0xF0 and body[0] == 0:
        result["reauth_verified"] = parse_props(body[1:])[0x16] == b"v=" + base64.b64encode(expected)
    # Still connected: PINGREQ, PINGRESP.
    sock.sendall(b"\xc0\x00")
    result["ping"] = read_packet(sock)[0]
print(json.dumps(result))
"#;

fn scram_client(addr: SocketAddr, user: &str, password: &str, method: &str) -> Value {
    let dir = tempfile::tempdir().expect("dir");
    let script = dir.path().join("scram.py");
    std::fs::write(&script, SCRAM_CLIENT).expect("script");
    let out = Command::new("python3")
        .arg(&script)
        .args([
            &addr.ip().to_string(),
            &addr.port().to_string(),
            user,
            password,
            method,
        ])
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

/// SCRAM-SHA-256 with a Python client: the exchange succeeds with the right password (the
/// server's signature checks out), a re-authentication on the same connection succeeds; a
/// wrong password gets CONNACK 0x86, an unknown method 0x8C.
#[test]
fn scram_sha256_with_a_python_client() {
    if !mercurio_testkit::program(
        "scram_sha256_with_a_python_client",
        "python3",
        "apt-get install python3",
    ) {
        return;
    }
    let d = broker("");
    let addr = d.addr();
    let (code, _, err) = ctl_in(&d, &["user", "add", "carol", "--stdin"], "pencil\n");
    assert_eq!(code, Some(0), "{err}");

    // [MQTT-4.12.0-2]: AUTH 0x18 carries the server's challenge; CONNACK 0 ends it.
    let good = scram_client(addr, "carol", "pencil", "SCRAM-SHA-256");
    assert_eq!(good["auth"], 0x18, "{good}");
    assert_eq!(good["connack"], 0, "{good}");
    assert_eq!(good["method"], "SCRAM-SHA-256", "{good}");
    assert_eq!(
        good["verified"], true,
        "the server proved it knows the keys: {good}"
    );
    // Re-authentication: AUTH 0x19, 0x18 both ways, AUTH 0x00 (section 4.12.1).
    assert_eq!(good["reauth_packet"], 0xF0, "{good}");
    assert_eq!(good["reauth_code"], 0, "{good}");
    assert_eq!(good["reauth_verified"], true, "{good}");
    assert_eq!(good["ping"], 0xD0, "{good}");

    let sha512 = scram_client(addr, "carol", "pencil", "SCRAM-SHA-512");
    assert_eq!(sha512["connack"], 0, "{sha512}");

    let wrong = scram_client(addr, "carol", "pencil!", "SCRAM-SHA-256");
    assert_eq!(wrong["connack"], 0x86, "wrong password: {wrong}");
    let unknown = scram_client(addr, "nobody", "pencil", "SCRAM-SHA-256");
    assert_eq!(
        unknown["auth"], 0x18,
        "an unknown user is not told at once: {unknown}"
    );
    assert_eq!(unknown["connack"], 0x86, "{unknown}");
    let other = scram_client(addr, "carol", "pencil", "KERBEROS");
    assert_eq!(other["connack"], 0x8C, "unsupported method: {other}");
    // A new password applies to SCRAM at once.
    let (code, _, err) = ctl_in(&d, &["user", "passwd", "carol", "--stdin"], "quill\n");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        scram_client(addr, "carol", "pencil", "SCRAM-SHA-256")["connack"],
        0x86
    );
    assert_eq!(
        scram_client(addr, "carol", "quill", "SCRAM-SHA-256")["connack"],
        0
    );
}
