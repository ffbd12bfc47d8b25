//! MQTT over WebSocket (`protocol = "websocket"` listeners): every protocol version from a Rust
//! WebSocket client on our codec and from Python's paho-mqtt, packets spanning frames and
//! frames holding several packets, the `mqtt` subprotocol, text frames, and the connection
//! limits a WebSocket listener shares with TCP.
use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use common::*;
use futures_util::SinkExt;
use mercurio::codec::{self, Packet, ProtocolVersion, QoS, ReasonCode};
use mercurio_codec::client::WebSocket;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

/// A raw MQTT client over WebSocket: the tests' [`Client`] on the shared WebSocket
/// transport, with the WebSocket at hand for frames of its own ([`WsClient::ws`]).
type WsClient = ClientOver<WebSocket<TcpStream>>;

impl WsClient {
    /// Opens the WebSocket (subprotocol `mqtt`) without sending any MQTT packet.
    async fn open(addr: SocketAddr, version: ProtocolVersion) -> WsClient {
        WsClient::open_with(addr, version, "mqtt").await
    }

    /// Opens the WebSocket offering only `subprotocol`, and checks the broker chose it.
    async fn open_with(addr: SocketAddr, version: ProtocolVersion, subprotocol: &str) -> WsClient {
        let tcp = TcpStream::connect(addr).await.expect("tcp connect");
        WsClient::open_on(tcp, addr, version, subprotocol).await
    }

    /// [`WsClient::open_with`] on a TCP connection already open (a PROXY header sent on it).
    async fn open_on(
        tcp: TcpStream,
        addr: SocketAddr,
        version: ProtocolVersion,
        subprotocol: &str,
    ) -> WsClient {
        let mut req = format!("ws://{addr}/mqtt").into_client_request().unwrap();
        req.headers_mut()
            .insert("Sec-WebSocket-Protocol", subprotocol.parse().unwrap());
        let (ws, resp) = tokio::time::timeout(DEADLINE, tokio_tungstenite::client_async(req, tcp))
            .await
            .expect("handshake before the deadline")
            .expect("WebSocket handshake");
        assert_eq!(
            resp.headers()
                .get("sec-websocket-protocol")
                .map(|v| v.to_str().unwrap()),
            Some(subprotocol)
        );
        ClientOver(Client::on(WebSocket::new(ws), version))
    }

    async fn connect(addr: SocketAddr, version: ProtocolVersion, client_id: &str) -> WsClient {
        let mut c = WsClient::open(addr, version).await;
        c.send(Packet::Connect(Box::new(connect_packet(
            version, client_id,
        ))))
        .await;
        match c.recv().await {
            Some(Packet::ConnAck(ack)) => assert_eq!(ack.reason_code, ReasonCode::SUCCESS),
            other => panic!("expected CONNACK, got {other:?}"),
        }
        c
    }

    /// The WebSocket, for frames that are not one binary message of MQTT bytes.
    fn ws(&mut self) -> &mut WebSocketStream<TcpStream> {
        self.stream_mut().get_mut()
    }

    /// The close frame's code, once the broker sent one.
    fn close_code(&self) -> Option<CloseCode> {
        self.stream().close_frame().map(|f| f.code)
    }

    fn encode(&self, packet: &Packet) -> Vec<u8> {
        let mut out = BytesMut::new();
        codec::encode(packet, self.version, &mut out).expect("encode");
        out.to_vec()
    }

    /// Sends `bytes` in one binary frame, as they are.
    async fn send_frame(&mut self, bytes: Vec<u8>) {
        self.send_raw(&bytes).await;
    }

    async fn subscribe(&mut self, filter: &str, qos: QoS) {
        let code = self.0.subscribe(filter, qos).await;
        assert!(!code.is_failure(), "{code:?}");
    }

    fn publish_packet(&mut self, topic: &str, payload: &[u8], qos: QoS) -> Packet {
        let packet_id = if qos == QoS::AtMostOnce {
            0
        } else {
            self.next_packet_id()
        };
        publish_packet(topic, payload, qos, false, packet_id, Default::default())
    }

    async fn expect_publish(&mut self) -> codec::Publish {
        loop {
            match self.recv().await {
                Some(Packet::Publish(p)) => return p,
                Some(Packet::PubAck(_)) => continue,
                other => panic!("expected PUBLISH, got {other:?}"),
            }
        }
    }
}

/// A WebSocket listener with connect_timeout = `connect_timeout`.
async fn start_ws(connect_timeout: u64) -> (mercurio::BrokerHandle, SocketAddr, SocketAddr) {
    let mut config = tcp_and_websocket_config();
    config.server.connect_timeout = connect_timeout;
    let (handle, tcp) = start_with(config).await;
    let ws = handle.local_addrs()[1];
    (handle, tcp, ws)
}

#[tokio::test]
async fn pubsub_over_websocket_every_version() {
    let (handle, tcp, ws) = start_ws(10).await;
    for version in [
        ProtocolVersion::V31,
        ProtocolVersion::V311,
        ProtocolVersion::V5,
    ] {
        let topic = format!("ws/{}/t", version.level());
        let mut sub = WsClient::connect(ws, version, &format!("ws-sub-{}", version.level())).await;
        sub.subscribe(&topic, QoS::AtLeastOnce).await;

        // WebSocket to WebSocket, QoS 1 with PUBACK.
        let mut publ = WsClient::connect(ws, version, &format!("ws-pub-{}", version.level())).await;
        let p = publ.publish_packet(&topic, b"over websocket", QoS::AtLeastOnce);
        publ.send(p).await;
        match publ.recv().await {
            Some(Packet::PubAck(a)) => assert!(!a.reason_code.is_failure()),
            other => panic!("expected PUBACK, got {other:?}"),
        }
        let got = sub.expect_publish().await;
        assert_eq!(&got.payload[..], b"over websocket");
        assert_eq!(got.topic, topic);

        // TCP to WebSocket and back.
        let mut tcp_client =
            Client::connect(tcp, version, &format!("tcp-{}", version.level())).await;
        tcp_client
            .subscribe(&format!("{topic}/back"), QoS::AtMostOnce)
            .await;
        tcp_client
            .publish(&topic, b"from tcp", QoS::AtMostOnce, false)
            .await;
        assert_eq!(&sub.expect_publish().await.payload[..], b"from tcp");
        let p = publ.publish_packet(&format!("{topic}/back"), b"to tcp", QoS::AtMostOnce);
        publ.send(p).await;
        assert_eq!(&tcp_client.expect_publish().await.payload[..], b"to tcp");

        // A clean DISCONNECT over WebSocket ends the session like over TCP.
        let d = Packet::Disconnect(Default::default());
        publ.send(d).await;
        assert!(publ.recv().await.is_none(), "closed after DISCONNECT");
    }
    handle.shutdown().await;
}

#[tokio::test]
async fn packets_span_frames_and_frames_hold_packets() {
    let (handle, _tcp, ws) = start_ws(10).await;
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let mut c = WsClient::open(ws, version).await;
        // CONNECT in one-byte and three-byte frames.
        let connect = c.encode(&Packet::Connect(Box::new(connect_packet(
            version,
            &format!("split-{}", version.level()),
        ))));
        let (a, rest) = connect.split_at(1);
        let (b, rest) = rest.split_at(3);
        for part in [a, b, rest] {
            c.send_frame(part.to_vec()).await;
        }
        match c.recv().await {
            Some(Packet::ConnAck(ack)) => assert_eq!(ack.reason_code, ReasonCode::SUCCESS),
            other => panic!("expected CONNACK, got {other:?}"),
        }
        // SUBSCRIBE, two PUBLISHes and half of a third in one frame, the rest in another.
        let topic = format!("frames/{}", version.level());
        let mut frame = c.encode(&Packet::Subscribe(codec::Subscribe {
            packet_id: 7,
            filters: vec![codec::SubscribeFilter {
                filter: topic.clone(),
                options: Default::default(),
            }],
            properties: Default::default(),
        }));
        for payload in [&b"one"[..], b"two"] {
            let p = c.publish_packet(&topic, payload, QoS::AtMostOnce);
            frame.extend(c.encode(&p));
        }
        let p = c.publish_packet(&topic, &[b'x'; 300], QoS::AtMostOnce);
        let third = c.encode(&p);
        frame.extend_from_slice(&third[..100]);
        c.send_frame(frame).await;
        c.send_frame(third[100..].to_vec()).await;
        match c.recv().await {
            Some(Packet::SubAck(a)) => assert_eq!(a.packet_id, 7),
            other => panic!("expected SUBACK, got {other:?}"),
        }
        assert_eq!(&c.expect_publish().await.payload[..], b"one");
        assert_eq!(&c.expect_publish().await.payload[..], b"two");
        assert_eq!(&c.expect_publish().await.payload[..], &[b'x'; 300][..]);
    }
    handle.shutdown().await;
}

/// A handshake request with these extra header lines.
fn upgrade_request(extra: &str) -> String {
    format!(
        "GET /mqtt HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n{extra}\r\n"
    )
}

#[tokio::test]
async fn upgrade_needs_the_mqtt_subprotocol() {
    let (handle, tcp, ws) = start_ws(10).await;
    let mut bystander = Client::connect(tcp, ProtocolVersion::V311, "bystander").await;

    let r = http_raw(
        ws,
        upgrade_request("Sec-WebSocket-Version: 13\r\n").as_bytes(),
    )
    .await
    .expect("a response");
    assert_eq!(r.status, 400, "no subprotocol: {r:?}");
    assert!(r.text().contains("mqtt"), "{}", r.text());

    let r = http_raw(
        ws,
        upgrade_request("Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: chat, MQTT\r\n")
            .as_bytes(),
    )
    .await
    .expect("a response");
    assert_eq!(r.status, 400, "other subprotocols only: {r:?}");

    let r = http_raw(
        ws,
        upgrade_request("Sec-WebSocket-Version: 8\r\nSec-WebSocket-Protocol: mqtt\r\n").as_bytes(),
    )
    .await
    .expect("a response");
    assert_eq!(r.status, 426, "{r:?}");
    assert_eq!(r.header("sec-websocket-version"), Some("13"));

    let post = upgrade_request("Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n")
        .replacen("GET", "POST", 1);
    let r = http_raw(ws, post.as_bytes()).await.expect("a response");
    assert_eq!(r.status, 405, "{r:?}");

    // Offered among others, mqtt is chosen and echoed (RFC 6455's sample key and answer).
    let mut s = TcpStream::connect(ws).await.unwrap();
    s.write_all(
        upgrade_request("Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: chat, mqtt\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let r = read_http_response(&mut s, false).await.expect("a response");
    assert_eq!(r.status, 101, "{r:?}");
    assert_eq!(r.header("sec-websocket-protocol"), Some("mqtt"));
    assert_eq!(
        r.header("sec-websocket-accept"),
        Some("s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
    );

    bystander
        .publish("still", b"fine", QoS::AtLeastOnce, false)
        .await;
    handle.shutdown().await;
}

/// The informal `mqttv3.1` subprotocol, which MQTT 3.1 clients (Paho JavaScript, old MQTT.js)
/// offer alone, is accepted and echoed, as mosquitto, RabbitMQ and aedes do (RabbitMQ issue
/// 15001); `mqtt` stays the one chosen whenever it is offered [MQTT-6.0.0-4] (checked in
/// `upgrade_needs_the_mqtt_subprotocol`).
#[tokio::test]
async fn upgrade_accepts_the_mqttv31_subprotocol() {
    let (handle, _tcp, ws) = start_ws(10).await;
    let mut sub = WsClient::open_with(ws, ProtocolVersion::V31, "mqttv3.1").await;
    sub.send(Packet::Connect(Box::new(connect_packet(
        ProtocolVersion::V31,
        "v31-ws",
    ))))
    .await;
    match sub.recv().await {
        Some(Packet::ConnAck(ack)) => assert_eq!(ack.reason_code, ReasonCode::SUCCESS),
        other => panic!("expected CONNACK, got {other:?}"),
    }
    sub.subscribe("v31/t", QoS::AtMostOnce).await;
    let mut other = WsClient::connect(ws, ProtocolVersion::V311, "v311-ws").await;
    let p = other.publish_packet("v31/t", b"hello", QoS::AtMostOnce);
    other.send(p).await;
    assert_eq!(&sub.expect_publish().await.payload[..], b"hello");
    handle.shutdown().await;
}

#[tokio::test]
async fn text_frame_closes_the_connection() {
    let (handle, _tcp, ws) = start_ws(10).await;
    let mut other = WsClient::connect(ws, ProtocolVersion::V311, "other").await;
    other.subscribe("t", QoS::AtMostOnce).await;

    let mut c = WsClient::connect(ws, ProtocolVersion::V5, "texter").await;
    c.ws().send(Message::text("PUBLISH t hello")).await.unwrap();
    assert!(c.recv().await.is_none(), "closed after a text frame");
    assert_eq!(c.close_code(), Some(CloseCode::Unsupported));

    let p = other.publish_packet("t", b"unaffected", QoS::AtMostOnce);
    other.send(p).await;
    assert_eq!(&other.expect_publish().await.payload[..], b"unaffected");
    handle.shutdown().await;
}

#[tokio::test]
async fn silent_connections_are_closed_after_connect_timeout() {
    let (handle, tcp, ws) = start_ws(1).await;
    // 100 sockets that never send a byte, and one WebSocket that never sends CONNECT.
    let mut silent = Vec::new();
    for _ in 0..100 {
        silent.push(TcpStream::connect(ws).await.expect("connect"));
    }
    let mut no_connect = WsClient::open(ws, ProtocolVersion::V311).await;

    // Meanwhile, other clients work.
    let mut a = WsClient::connect(ws, ProtocolVersion::V5, "busy-a").await;
    a.subscribe("busy", QoS::AtLeastOnce).await;
    let mut b = Client::connect(tcp, ProtocolVersion::V311, "busy-b").await;
    b.publish("busy", b"while idle sockets wait", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(
        &a.expect_publish().await.payload[..],
        b"while idle sockets wait"
    );

    for s in &mut silent {
        let seen = expect_eof(s, DEADLINE).await;
        assert!(
            seen.is_empty() || seen.starts_with(b"HTTP/1.1 408"),
            "{:?}",
            String::from_utf8_lossy(&seen)
        );
    }
    assert!(no_connect.recv().await.is_none(), "no CONNECT: closed");

    // The connected clients were not touched.
    let p = a.publish_packet("busy", b"after", QoS::AtMostOnce);
    a.send(p).await;
    assert_eq!(&a.expect_publish().await.payload[..], b"after");
    handle.shutdown().await;
}

#[tokio::test]
async fn max_connections_applies_to_websocket_listeners() {
    let mut config = websocket_config();
    config.listeners[0].max_connections = 2;
    let (handle, ws) = start_with(config).await;
    let mut a = WsClient::connect(ws, ProtocolVersion::V311, "max-a").await;
    let _b = WsClient::connect(ws, ProtocolVersion::V311, "max-b").await;
    let mut third = TcpStream::connect(ws).await.unwrap();
    let seen = expect_eof(&mut third, DEADLINE).await;
    assert!(seen.is_empty(), "refused without an answer");
    a.subscribe("x", QoS::AtMostOnce).await;
    drop(_b);
    handle.shutdown().await;
}

#[tokio::test]
async fn shutdown_disconnects_websocket_clients_and_the_listener_refuses() {
    let (handle, _tcp, ws) = start_ws(10).await;
    let mut c = WsClient::connect(ws, ProtocolVersion::V5, "stopping").await;
    handle.shutdown().await;
    match c.recv().await {
        Some(Packet::Disconnect(d)) => {
            assert_eq!(d.reason_code, ReasonCode::SERVER_SHUTTING_DOWN)
        }
        other => panic!("expected DISCONNECT, got {other:?}"),
    }
    assert!(
        TcpStream::connect(ws).await.is_err(),
        "a stopped listener refuses connections"
    );
}

const PAHO_SCRIPT: &str = r#"
import sys, threading
import paho.mqtt.client as mqtt

port, version = int(sys.argv[1]), sys.argv[2]
protocol = {"3.1.1": mqtt.MQTTv311, "5": mqtt.MQTTv5, "3.1": mqtt.MQTTv31}[version]
topic = "paho/ws/" + version
got = threading.Event()
received = []

c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="paho-ws-" + version,
                protocol=protocol, transport="websockets")
c.ws_set_options(path="/mqtt")

def on_connect(client, userdata, flags, reason_code, properties):
    client.subscribe(topic, qos=1)

def on_subscribe(client, userdata, mid, reason_codes, properties):
    client.publish(topic, b"hello from paho over websocket", qos=1)

def on_message(client, userdata, msg):
    received.append(msg.payload)
    got.set()

c.on_connect, c.on_subscribe, c.on_message = on_connect, on_subscribe, on_message
c.connect("127.0.0.1", port, keepalive=30)
c.loop_start()
ok = got.wait(10)
c.disconnect()
c.loop_stop()
print(received[0].decode() if ok else "TIMEOUT")
"#;

#[tokio::test]
async fn paho_mqtt_over_websocket() {
    let Some(python) = python_with("paho_mqtt_over_websocket", &["paho.mqtt.client"]) else {
        return;
    };
    let (handle, _tcp, ws) = start_ws(10).await;
    let mut sub = handle.subscribe("paho/ws/#", QoS::AtLeastOnce).unwrap();
    for version in ["3.1.1", "5", "3.1"] {
        let out = run_python(
            python,
            PAHO_SCRIPT,
            &[ws.port().to_string(), version.into()],
            b"",
        )
        .await;
        assert_eq!(
            out.trim(),
            "hello from paho over websocket",
            "paho {version}"
        );
        let m = tokio::time::timeout(DEADLINE, sub.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.topic, format!("paho/ws/{version}"));
    }
    let _ = Duration::ZERO;
    handle.shutdown().await;
}

/// A WebSocket listener with `proxy_protocol = "v2"`: the binary header comes before the HTTP
/// upgrade, and its address is the client's (`Connected` event).
#[tokio::test]
async fn proxy_header_before_the_upgrade() {
    let mut config = tcp_and_websocket_config();
    config.listeners[1].proxy_protocol = Some(mercurio::config::ProxyProtocol::V2);
    let (handle, _tcp) = start_with(config).await;
    let mut events = handle.events();
    let ws = handle.local_addrs()[1];
    let mut tcp = TcpStream::connect(ws).await.unwrap();
    // Version 2, PROXY, TCP over IPv6: [2001:db8::42]:5151 to [::1]:80.
    let mut header = b"\r\n\r\n\0\r\nQUIT\n\x21\x21\x00\x24".to_vec();
    header.extend_from_slice(
        &"2001:db8::42"
            .parse::<std::net::Ipv6Addr>()
            .unwrap()
            .octets(),
    );
    header.extend_from_slice(&std::net::Ipv6Addr::LOCALHOST.octets());
    header.extend_from_slice(&5151u16.to_be_bytes());
    header.extend_from_slice(&80u16.to_be_bytes());
    tcp.write_all(&header).await.unwrap();
    let mut c = WsClient::open_on(tcp, ws, ProtocolVersion::V311, "mqtt").await;
    let peer = c.connect_and_wait_connected(&mut events, "ws-behind").await;
    assert_eq!(peer, "[2001:db8::42]:5151".parse::<SocketAddr>().unwrap());
    handle.shutdown().await;
}
