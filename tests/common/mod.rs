//! Shared test support: an in-process broker on port 0 and a raw MQTT client built on the
//! broker's own codec, which can send anything (including what a well-behaved client library
//! never would) and waits for packets with deadlines, never with sleeps.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use mercurio::codec::{
    self, Connect, LastWill, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, ReasonCode,
    Subscribe, SubscribeFilter, SubscriptionOptions, Unsubscribe,
};
use mercurio::config::{Config, ListenerConfig};
use mercurio::{Broker, BrokerHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a test waits for an expected event before failing.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// A configuration with one listener on 127.0.0.1, port 0, anonymous clients allowed.
pub fn test_config() -> Config {
    let mut config = Config::default();
    config.listeners = vec![ListenerConfig {
        port: 0,
        ..ListenerConfig::default()
    }];
    config
}

/// Starts a broker with `config`; returns its handle and the address of its first listener.
pub async fn start_with(config: Config) -> (BrokerHandle, SocketAddr) {
    let handle = Broker::builder(config)
        .start()
        .await
        .expect("broker starts");
    let addr = handle.local_addrs()[0];
    (handle, addr)
}

/// Starts a broker with [`test_config`].
pub async fn start() -> (BrokerHandle, SocketAddr) {
    start_with(test_config()).await
}

/// A CONNECT with clean start, keep alive 60 s and no will.
pub fn connect_packet(version: ProtocolVersion, client_id: &str) -> Connect {
    Connect {
        protocol: version,
        clean_start: true,
        keep_alive: 60,
        client_id: client_id.to_string(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    }
}

/// A will for [`Connect::will`].
pub fn will(topic: &str, payload: &str, qos: QoS, retain: bool) -> LastWill {
    LastWill {
        topic: topic.to_string(),
        payload: Bytes::from(payload.to_string()),
        qos,
        retain,
        properties: Properties::default(),
    }
}

/// A raw MQTT client.
pub struct Client {
    pub stream: TcpStream,
    pub version: ProtocolVersion,
    buf: BytesMut,
    next_id: u16,
}

impl Client {
    /// Opens a TCP connection without sending anything.
    pub async fn open(addr: SocketAddr, version: ProtocolVersion) -> Client {
        let stream = TcpStream::connect(addr).await.expect("tcp connect");
        stream.set_nodelay(true).ok();
        Client {
            stream,
            version,
            buf: BytesMut::new(),
            next_id: 1,
        }
    }

    /// Connects with `connect` and returns the CONNACK (whatever its code).
    pub async fn connect_with(addr: SocketAddr, connect: Connect) -> (Client, codec::ConnAck) {
        let mut c = Client::open(addr, connect.protocol).await;
        c.send(Packet::Connect(Box::new(connect))).await;
        match c.recv().await {
            Some(Packet::ConnAck(ack)) => (c, ack),
            other => panic!("expected CONNACK, got {other:?}"),
        }
    }

    /// Connects with clean start and asserts success.
    pub async fn connect(addr: SocketAddr, version: ProtocolVersion, client_id: &str) -> Client {
        let (c, ack) = Client::connect_with(addr, connect_packet(version, client_id)).await;
        assert_eq!(
            ack.reason_code,
            ReasonCode::SUCCESS,
            "CONNACK for {client_id}"
        );
        c
    }

    pub fn next_packet_id(&mut self) -> u16 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        id
    }

    pub async fn send(&mut self, packet: Packet) {
        let mut out = BytesMut::new();
        codec::encode(&packet, self.version, &mut out).expect("encode");
        self.stream.write_all(&out).await.expect("write");
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// The next packet, or `None` when the broker closed the connection. Panics after
    /// [`DEADLINE`].
    pub async fn recv(&mut self) -> Option<Packet> {
        self.recv_within(DEADLINE)
            .await
            .expect("a packet or a close before the deadline")
    }

    /// `Err(())` when nothing (no packet, no close) came within `wait`.
    pub async fn recv_within(&mut self, wait: Duration) -> Result<Option<Packet>, ()> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match codec::decode(&mut self.buf, self.version, u32::MAX) {
                Ok(Some(p)) => return Ok(Some(p)),
                Ok(None) => {}
                Err(e) => panic!("broker sent a packet we cannot decode: {e}"),
            }
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Err(_) => return Err(()),
                Ok(Ok(0)) | Ok(Err(_)) => return Ok(None),
                Ok(Ok(_)) => {}
            }
        }
    }

    /// Asserts that nothing arrives within `wait` (used only to check an absence).
    pub async fn expect_nothing(&mut self, wait: Duration) {
        if let Ok(p) = self.recv_within(wait).await {
            panic!("expected nothing, got {p:?}");
        }
    }

    /// Waits until the broker closes the connection, returning the packets seen before.
    pub async fn expect_closed(&mut self) -> Vec<Packet> {
        let mut seen = Vec::new();
        loop {
            match self.recv().await {
                None => return seen,
                Some(p) => seen.push(p),
            }
        }
    }

    /// The next PUBLISH, answering nothing. Panics on any other packet.
    pub async fn expect_publish(&mut self) -> Publish {
        match self.recv().await {
            Some(Packet::Publish(p)) => p,
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }

    pub async fn subscribe_with(
        &mut self,
        filters: &[(&str, SubscriptionOptions)],
        properties: Properties,
    ) -> Vec<ReasonCode> {
        let packet_id = self.next_packet_id();
        let filters = filters
            .iter()
            .map(|(f, o)| SubscribeFilter {
                filter: f.to_string(),
                options: *o,
            })
            .collect();
        self.send(Packet::Subscribe(Subscribe {
            packet_id,
            filters,
            properties,
        }))
        .await;
        match self.recv().await {
            Some(Packet::SubAck(ack)) => {
                assert_eq!(ack.packet_id, packet_id);
                ack.reason_codes
            }
            other => panic!("expected SUBACK, got {other:?}"),
        }
    }

    /// Subscribes to one filter at `qos` and returns the SUBACK code.
    pub async fn subscribe(&mut self, filter: &str, qos: QoS) -> ReasonCode {
        let o = SubscriptionOptions {
            qos,
            ..Default::default()
        };
        self.subscribe_with(&[(filter, o)], Properties::default())
            .await[0]
    }

    pub async fn unsubscribe(&mut self, filters: &[&str]) -> Vec<ReasonCode> {
        let packet_id = self.next_packet_id();
        let filters = filters.iter().map(|f| f.to_string()).collect();
        self.send(Packet::Unsubscribe(Unsubscribe {
            packet_id,
            filters,
            properties: Properties::default(),
        }))
        .await;
        match self.recv().await {
            Some(Packet::UnsubAck(ack)) => ack.reason_codes,
            other => panic!("expected UNSUBACK, got {other:?}"),
        }
    }

    /// Sends a PUBLISH; for QoS 1 waits for PUBACK, for QoS 2 runs PUBREC/PUBREL/PUBCOMP.
    /// Returns the reason code of PUBACK/PUBREC (success for QoS 0).
    pub async fn publish(
        &mut self,
        topic: &str,
        payload: &[u8],
        qos: QoS,
        retain: bool,
    ) -> ReasonCode {
        self.publish_with(topic, payload, qos, retain, Properties::default())
            .await
    }

    pub async fn publish_with(
        &mut self,
        topic: &str,
        payload: &[u8],
        qos: QoS,
        retain: bool,
        properties: Properties,
    ) -> ReasonCode {
        let packet_id = if qos == QoS::AtMostOnce {
            0
        } else {
            self.next_packet_id()
        };
        self.send(Packet::Publish(Publish {
            dup: false,
            qos,
            retain,
            topic: topic.to_string(),
            packet_id,
            properties,
            payload: Bytes::copy_from_slice(payload),
        }))
        .await;
        match qos {
            QoS::AtMostOnce => ReasonCode::SUCCESS,
            QoS::AtLeastOnce => match self.recv().await {
                Some(Packet::PubAck(a)) if a.packet_id == packet_id => a.reason_code,
                other => panic!("expected PUBACK {packet_id}, got {other:?}"),
            },
            QoS::ExactlyOnce => {
                let rc = match self.recv().await {
                    Some(Packet::PubRec(a)) if a.packet_id == packet_id => a.reason_code,
                    other => panic!("expected PUBREC {packet_id}, got {other:?}"),
                };
                if rc.is_failure() {
                    return rc;
                }
                self.send(Packet::PubRel(PubAck {
                    packet_id,
                    ..PubAck::default()
                }))
                .await;
                match self.recv().await {
                    Some(Packet::PubComp(a)) if a.packet_id == packet_id => {}
                    other => panic!("expected PUBCOMP {packet_id}, got {other:?}"),
                }
                rc
            }
        }
    }

    /// Acknowledges a received PUBLISH as the protocol wants (PUBACK, or PUBREC + PUBREL/PUBCOMP).
    pub async fn ack(&mut self, p: &Publish) {
        match p.qos {
            QoS::AtMostOnce => {}
            QoS::AtLeastOnce => {
                self.send(Packet::PubAck(PubAck {
                    packet_id: p.packet_id,
                    ..PubAck::default()
                }))
                .await
            }
            QoS::ExactlyOnce => {
                self.send(Packet::PubRec(PubAck {
                    packet_id: p.packet_id,
                    ..PubAck::default()
                }))
                .await;
                match self.recv().await {
                    Some(Packet::PubRel(r)) if r.packet_id == p.packet_id => {}
                    other => panic!("expected PUBREL {}, got {other:?}", p.packet_id),
                }
                self.send(Packet::PubComp(PubAck {
                    packet_id: p.packet_id,
                    ..PubAck::default()
                }))
                .await;
            }
        }
    }

    pub async fn disconnect(mut self) {
        self.send(Packet::Disconnect(Default::default())).await;
        let _ = self.stream.shutdown().await;
    }
}

/// Whether an external program (mosquitto_pub, mosquitto_passwd...) is installed. Missing, it
/// prints why the test skips, or fails the test when `CI=true` (DESIGN.md section 9).
pub fn have_program(name: &str) -> bool {
    let found = std::process::Command::new(name)
        .arg("--help")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok();
    if !found {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("{name} is not installed (CI=true: a missing prerequisite is a failure)");
        }
        eprintln!("skipping: {name} is not installed");
    }
    found
}

/// A CONNECT with a user name and password.
pub fn connect_as(
    version: ProtocolVersion,
    client_id: &str,
    username: Option<&str>,
    password: Option<&str>,
) -> Connect {
    let mut c = connect_packet(version, client_id);
    c.username = username.map(str::to_string);
    c.password = password.map(|p| Bytes::from(p.to_string()));
    c
}

/// Waits until `cond` holds, polling; panics after [`DEADLINE`].
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
