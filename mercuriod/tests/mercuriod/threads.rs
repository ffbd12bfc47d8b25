//! mercuriod --threads 2: clients served on different threads exchange messages and take
//! sessions over as on one; a light load stays on one thread (`--thread-placement fill`).
#![cfg(unix)]

use mercurio_testkit::Daemon;
use mercurio_testkit::{publish_packet, Mqtt};

/// The thread serving `id`'s connection, as `client show` reports it.
fn thread_of(d: &Daemon, id: &str) -> serde_json::Value {
    let shown = d.admin(&format!(
        r#"{{"command":"client.show","client_id":"{id}"}}"#
    ));
    shown["result"]["thread"].clone()
}

/// Reads the next packet of `c`: a QoS 1 PUBLISH of `payload` to `topic`.
fn expect_publish(c: &mut Mqtt, topic: &str, payload: &[u8]) {
    let (kind, body) = c.read().expect("PUBLISH before the close");
    assert_eq!(
        kind & 0xf0,
        0x30,
        "PUBLISH expected, got {kind:#x} {body:?}"
    );
    let len = usize::from(u16::from_be_bytes([body[0], body[1]]));
    assert_eq!(&body[2..2 + len], topic.as_bytes());
    // The packet identifier follows the topic at QoS 1.
    assert_eq!(&body[2 + len + 2..], payload);
}

/// Reads the next packet of `c`: the PUBACK of packet identifier `id`.
fn expect_puback(c: &mut Mqtt, id: u16) {
    let (kind, body) = c.read().expect("PUBACK before the close");
    assert_eq!((kind, body), (0x40, id.to_be_bytes().to_vec()));
}

#[test]
fn spread_threads_exchange_and_take_over_across_threads() {
    let d = Daemon::with("")
        .args(["--threads", "2", "--thread-placement", "spread"])
        .start();
    let port = d.port();
    // Accepted in turn: "sub" on thread 0, "pub" on thread 1, and each stays there.
    let mut sub = Mqtt::connect(port, 4, "sub", false);
    sub.subscribe(4, "x/#", 1);
    let mut publ = Mqtt::connect(port, 4, "pub", false);
    publ.subscribe(4, "y/#", 1);
    assert_eq!(thread_of(&d, "sub"), 0);
    assert_eq!(thread_of(&d, "pub"), 1);

    // Thread 1 to thread 0 and back, QoS 1: the message delivered, the publisher's PUBACK.
    publ.send(&publish_packet("x/1", 1, 7, b"one to zero"));
    expect_puback(&mut publ, 7);
    expect_publish(&mut sub, "x/1", b"one to zero");
    sub.send(&publish_packet("y/1", 1, 8, b"zero to one"));
    expect_puback(&mut sub, 8);
    expect_publish(&mut publ, "y/1", b"zero to one");

    // A third connection (thread 0) takes "pub"'s session over from thread 1: the old
    // connection is closed [MQTT-3.1.4-2], the session goes on: the message left
    // unacknowledged is sent again [MQTT-4.4.0-1], and the subscription delivers.
    let mut again = Mqtt::connect(port, 4, "pub", false);
    assert_eq!(publ.read(), None, "the old connection is closed");
    assert_eq!(thread_of(&d, "pub"), 0);
    expect_publish(&mut again, "y/1", b"zero to one");
    sub.send(&publish_packet("y/2", 1, 9, b"after the takeover"));
    expect_puback(&mut sub, 9);
    expect_publish(&mut again, "y/2", b"after the takeover");
}

#[test]
fn fill_keeps_a_light_load_on_the_first_thread() {
    let d = Daemon::with("").args(["--threads", "2"]).start();
    let port = d.port();
    let mut sub = Mqtt::connect(port, 4, "sub", false);
    sub.subscribe(4, "x/#", 1);
    let mut publ = Mqtt::connect(port, 4, "pub", false);
    publ.send(&publish_packet("x/1", 1, 7, b"light"));
    expect_puback(&mut publ, 7);
    expect_publish(&mut sub, "x/1", b"light");
    assert_eq!(thread_of(&d, "sub"), 0);
    assert_eq!(thread_of(&d, "pub"), 0);
}
