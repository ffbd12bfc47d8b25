//! A full disk under SQLite storage, as an operator sees it (docs/operations.md,
//! "Persistence"): `mercurioctl broker status` says degraded with SQLite's error, `/healthz`
//! answers 503, QoS 0 between non-persistent clients goes on; once space is freed the broker
//! is ok again and every acknowledged message reaches the persistent session.
//!
//! The disk is a 2 MiB tmpfs mounted for the test, which needs root (CAP_SYS_ADMIN); without
//! it the test says why and skips.
#![cfg(unix)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;

use mercurio_testkit::{publish_packet as publish, wait_until, Daemon, Mqtt, DEADLINE};

/// The mercurioctl binary under test.
const MERCURIOCTL: &str = env!("CARGO_BIN_EXE_mercurioctl");

/// A tmpfs of `size` mounted on a directory, unmounted when dropped.
struct SmallDisk {
    dir: PathBuf,
}

impl SmallDisk {
    fn mount(test: &str, dir: &Path, size: &str) -> Option<SmallDisk> {
        std::fs::create_dir_all(dir).expect("mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallDisk {
                dir: dir.to_path_buf(),
            }),
            Ok(o) => {
                mercurio_testkit::skip(
                    test,
                    &format!(
                        "cannot mount a tmpfs (needs root): {}",
                        String::from_utf8_lossy(&o.stderr).trim()
                    ),
                );
                None
            }
            Err(e) => {
                mercurio_testkit::skip(test, &format!("cannot run mount: {e}"));
                None
            }
        }
    }

    /// Fills the disk with `filler` until it is full.
    fn fill(&self) -> PathBuf {
        let path = self.dir.join("filler");
        let mut f = std::fs::File::create(&path).expect("filler");
        let chunk = vec![0xa5u8; 16 * 1024];
        while f.write_all(&chunk).is_ok() {}
        // The last partial chunk, byte by byte.
        while f.write_all(&[0]).is_ok() {}
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// `GET /healthz` on `port`: the status code and the body.
fn healthz(port: u16) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(DEADLINE)).expect("timeout");
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// `mercurioctl broker status` against `d`: its standard output.
fn status(d: &Daemon) -> String {
    let out = Command::new(MERCURIOCTL)
        .args(["--socket", d.socket.to_str().expect("utf-8")])
        .args(["broker", "status"])
        .env_remove("RUNTIME_DIRECTORY")
        .output()
        .expect("run mercurioctl");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn storage_line(d: &Daemon) -> String {
    status(d)
        .lines()
        .find(|l| l.starts_with("storage"))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_full_disk_is_reported_and_what_needs_no_disk_goes_on() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(disk) = SmallDisk::mount(
        "a_full_disk_is_reported_and_what_needs_no_disk_goes_on",
        &dir.path().join("disk"),
        "2m",
    ) else {
        return;
    };
    let socket = dir.path().join("run").join("mercuriod.sock");
    let config = format!(
        "[auth]\nallow_anonymous = true\n\n\
         [[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
         [[listeners]]\nhost = \"127.0.0.1\"\nport = 0\nprotocol = \"websocket\"\nhealth = true\n\n\
         [admin]\nsocket = {:?}\n\n\
         [storage]\nbackend = \"sqlite\"\npath = {:?}\n",
        socket.display().to_string(),
        disk.dir.join("mercurio.db").display().to_string()
    );
    let home = tempfile::tempdir().expect("dir");
    let mut d = Daemon::with_config(&config)
        .in_dir(home)
        .socket(&socket)
        .start();
    let (mqtt, http) = {
        let addrs = d.wait_listeners(2);
        (addrs[0].port(), addrs[1].port())
    };
    assert_eq!(healthz(http).0, 200);
    assert!(storage_line(&d).contains("sqlite (ok)"), "{}", status(&d));

    // A persistent session, offline, subscribed at QoS 1.
    let mut keep = Mqtt::connect(mqtt, 4, "keep", false);
    keep.subscribe(4, "disk/t", 1);
    keep.disconnect();

    let filler = disk.fill();
    // Messages for the offline session: acknowledged (no durable_ack), kept in memory, and
    // not stored while the disk is full.
    let mut publisher = Mqtt::connect(mqtt, 4, "publisher", true);
    let payload = vec![0x5au8; 32 * 1024];
    const SENT: u16 = 8;
    for id in 1..=SENT {
        publisher.send(&publish("disk/t", 1, id, &payload));
        let (kind, body) = publisher.read().expect("PUBACK");
        assert_eq!((kind, &body[..2]), (0x40, &id.to_be_bytes()[..]));
    }
    let mut answer = (0, String::new());
    wait_until("/healthz 503 on a full disk", || {
        answer = healthz(http);
        answer.0 == 503
    });
    assert!(answer.1.contains("disk is full"), "{answer:?}");
    let line = storage_line(&d);
    assert!(
        line.contains("degraded") && line.contains("disk is full"),
        "{line}"
    );
    let result = &d.admin(r#"{"command":"broker.status"}"#)["result"];
    assert!(
        result["storage"]["writes_failed"].as_u64() > Some(0),
        "{result}"
    );

    // What needs no disk goes on: QoS 0 between non-persistent clients.
    let mut live = Mqtt::connect(mqtt, 4, "live", true);
    live.subscribe(4, "live/t", 0);
    publisher.send(&publish("live/t", 0, 0, b"still here"));
    let (kind, body) = live.read().expect("the QoS 0 message");
    assert_eq!(kind & 0xf0, 0x30);
    assert!(body.ends_with(b"still here"));

    // Space again: writes go through, the broker is ok.
    std::fs::remove_file(filler).expect("free the disk");
    wait_until("/healthz 200 once space is freed", || {
        healthz(http).0 == 200
    });
    assert!(storage_line(&d).contains("sqlite (ok)"), "{}", status(&d));

    // Every acknowledged message reaches the persistent session [MQTT-4.3.2-1]... after a
    // restart too: written to the disk once it had room.
    d.signal(libc::SIGTERM);
    assert_eq!(d.wait_exit(), Some(0));
    let home = tempfile::tempdir().expect("dir");
    let socket = d.socket.clone();
    drop(d);
    let d = Daemon::with_config(&config)
        .in_dir(home)
        .socket(&socket)
        .start();
    let mqtt = d.port();
    let mut keep = Mqtt::connect(mqtt, 4, "keep", false);
    for id in 1..=SENT {
        let (kind, body) = keep.read().expect("a kept message");
        assert_eq!(kind & 0xf6, 0x32, "QoS 1 PUBLISH");
        assert!(body.ends_with(&payload), "message {id}");
        let packet_id = [body[2 + "disk/t".len()], body[3 + "disk/t".len()]];
        keep.send(&[0x40, 2, packet_id[0], packet_id[1]]);
    }
    drop(d);
}
