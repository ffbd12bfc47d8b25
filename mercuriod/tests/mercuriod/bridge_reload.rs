//! Bridges under mercuriod's operations: `bridge.list` / `bridge.show` on the admin socket
//! (what `mercurioctl bridge` prints), and SIGHUP adding, removing and changing bridges while
//! the others keep their connections.
#![cfg(unix)]

use mercurio_testkit::{config_text, wait_until, Daemon};

fn bridge(name: &str, port: u16) -> String {
    format!(
        "[[bridges]]\nname = \"{name}\"\naddresses = [\"127.0.0.1:{port}\"]\n\
         protocol_version = \"mqttv5\"\nnotification_topic = \"bridges/{name}/state\"\n\
         [[bridges.topics]]\npattern = \"{name}/#\"\ndirection = \"out\"\nqos = 1\n\n"
    )
}

fn bridges(d: &Daemon) -> Vec<serde_json::Value> {
    let answer = d.admin(r#"{"command":"bridge.list"}"#);
    assert_eq!(answer["ok"], true, "{answer}");
    answer["result"]["bridges"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn connected(d: &Daemon, names: &[&str]) -> bool {
    let list = bridges(d);
    list.len() == names.len()
        && names.iter().all(|n| {
            list.iter()
                .any(|b| b["name"] == *n && b["connected"] == true)
        })
}

#[test]
fn sighup_starts_stops_and_restarts_only_the_bridges_that_changed() {
    let r1 = Daemon::start("");
    let p1 = r1.port();
    let r2 = Daemon::start("");
    let p2 = r2.port();

    let mut d = Daemon::start(&(bridge("one", p1) + &bridge("two", p2) + &bridge("moved", p1)));
    wait_until("three bridges connected", || {
        connected(&d, &["moved", "one", "two"])
    });
    let show = d.admin(r#"{"command":"bridge.show","name":"one"}"#);
    assert_eq!(
        show["result"]["address"],
        format!("127.0.0.1:{p1}"),
        "{show}"
    );
    assert_eq!(show["result"]["client_id"], "one");
    let missing = d.admin(r#"{"command":"bridge.show","name":"nope"}"#);
    assert_eq!(missing["ok"], false);
    assert!(missing["error"]
        .as_str()
        .unwrap_or("")
        .contains("no such bridge"));

    // one unchanged, two removed, moved now to the other remote, three added.
    std::fs::write(
        &d.config,
        config_text(
            &d.socket,
            &(bridge("one", p1) + &bridge("moved", p2) + &bridge("three", p2)),
        ),
    )
    .expect("rewrite config");
    d.signal(libc::SIGHUP);
    d.wait_line("two removed", |l| l.contains("SIGHUP: bridge two removed"));
    d.wait_line("moved restarted", |l| {
        l.contains("SIGHUP: bridge moved restarted")
    });
    d.wait_line("three added", |l| l.contains("SIGHUP: bridge three added"));
    wait_until("the new set connected", || {
        connected(&d, &["moved", "one", "three"])
    });
    let list = bridges(&d);
    let moved = list.iter().find(|b| b["name"] == "moved").expect("moved");
    assert_eq!(moved["address"], format!("127.0.0.1:{p2}"));
    // The unchanged bridge kept its one connection.
    let one = d.seen(|l| l.contains("bridge connected") && l.contains("bridge=one"));
    assert_eq!(one.len(), 1, "{one:#?}");
    drop(r1);
    drop(r2);
}

#[test]
fn a_bridge_restarted_by_sighup_keeps_its_counters() {
    const TEST: &str = "a_bridge_restarted_by_sighup_keeps_its_counters";
    if !mercurio_testkit::mosquitto_clients(TEST) {
        return;
    }
    let remote = Daemon::start("");
    let port = remote.port();
    let mut d = Daemon::start(&bridge("one", port));
    wait_until("the bridge connected", || connected(&d, &["one"]));
    let publish = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "seq 1 3 | mosquitto_pub -h 127.0.0.1 -p {} -V mqttv311 -q 1 -t one/n -l",
            d.port()
        ))
        .status()
        .expect("mosquitto_pub runs");
    assert!(publish.success());
    let out = |d: &Daemon| bridges(d)[0]["forwarded_out"].as_u64();
    wait_until("3 forwarded", || out(&d) == Some(3));

    // A changed setting restarts the bridge: its counters go on from where they were
    // (what /metrics reports as `_total` counters must never go back).
    std::fs::write(
        &d.config,
        config_text(
            &d.socket,
            &bridge("one", port).replace("protocol_version", "keepalive = 30\nprotocol_version"),
        ),
    )
    .expect("rewrite config");
    d.signal(libc::SIGHUP);
    d.wait_line("one restarted", |l| {
        l.contains("SIGHUP: bridge one restarted")
    });
    wait_until("connected again", || connected(&d, &["one"]));
    assert_eq!(out(&d), Some(3), "{:?}", bridges(&d));
}
