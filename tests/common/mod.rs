//! Shared test support: an in-process broker on port 0 and a raw MQTT client on the shared
//! client's [`Connection`] (`mercurio_codec::client`), which can send anything (including
//! what a well-behaved client library never would) and waits for packets with deadlines,
//! never with sleeps.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use mercurio::codec::{
    self, Connect, LastWill, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, ReasonCode,
    Subscribe, SubscribeFilter, SubscriptionOptions, Unsubscribe,
};
use mercurio::config::{Config, ListenerConfig};
use mercurio::{Broker, BrokerHandle};
use mercurio_codec::client::{ClientError, Connection, Transport, MAX_PACKET};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a test waits for an expected event before failing.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// A configuration with one listener on 127.0.0.1, port 0, anonymous clients allowed.
pub fn test_config() -> Config {
    Config {
        listeners: vec![ListenerConfig {
            port: 0,
            ..ListenerConfig::default()
        }],
        ..Config::default()
    }
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

/// A raw MQTT client: packets framed, read whole and encoded for its protocol version by a
/// [`Connection`], which acknowledges nothing by itself (the tests see every packet). Over TCP
/// by default; over TLS or WebSocket with that [`Transport`] ([`Client::on`]). Its transport
/// stays reachable ([`Client::stream`], [`Client::stream_mut`], [`Client::into_stream`]) for
/// what a test writes or reads beside the connection.
pub struct Client<T = TcpStream> {
    /// The protocol version the connection was opened with (its packets' encoding).
    pub version: ProtocolVersion,
    conn: Connection<T>,
    next_id: u16,
}

impl Client {
    /// Opens a TCP connection without sending anything.
    pub async fn open(addr: SocketAddr, version: ProtocolVersion) -> Client {
        let stream = TcpStream::connect(addr).await.expect("tcp connect");
        Client::over(stream, version)
    }

    /// A client over a connected socket (no delay set), nothing sent yet.
    fn over(stream: TcpStream, version: ProtocolVersion) -> Client {
        stream.set_nodelay(true).ok();
        Client::on(stream, version)
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
}

impl<T: Transport> Client<T> {
    /// A client over an open transport (TLS, WebSocket, ...), nothing sent yet. Packets as
    /// large as MQTT allows are accepted from the broker.
    pub fn on(transport: T, version: ProtocolVersion) -> Client<T> {
        Client {
            version,
            conn: Connection::new(transport, version, MAX_PACKET),
            next_id: 1,
        }
    }

    /// The transport, for what the connection does not do (its local address, a write that
    /// must not wait, the TLS session). Bytes read from it directly bypass [`Client::recv`].
    pub fn stream(&self) -> &T {
        self.conn.transport()
    }

    /// The transport, to read or write raw bytes beside the connection (bytes the client
    /// already buffered are not seen there).
    pub fn stream_mut(&mut self) -> &mut T {
        self.conn.parts_mut().0
    }

    /// The transport alone (to split it into halves); bytes buffered and not yet received as
    /// packets are dropped.
    pub fn into_stream(self) -> T {
        self.conn.into_parts().0
    }

    /// Sends CONNECT with `client_id`, asserts a successful CONNACK and returns the peer
    /// address of the broker's `Connected` event (the client's, or a PROXY header's).
    pub async fn connect_and_wait_connected(
        &mut self,
        events: &mut mercurio::EventStream,
        client_id: &str,
    ) -> SocketAddr {
        self.send(Packet::Connect(Box::new(connect_packet(
            self.version,
            client_id,
        ))))
        .await;
        match self.recv().await {
            Some(Packet::ConnAck(a)) => assert_eq!(a.reason_code, ReasonCode::SUCCESS),
            other => panic!("expected CONNACK, got {other:?}"),
        }
        loop {
            match tokio::time::timeout(DEADLINE, events.recv()).await {
                Ok(Some(mercurio::Event::Connected { peer, .. })) => break peer,
                Ok(Some(_)) => {}
                other => panic!("no Connected event: {other:?}"),
            }
        }
    }

    pub fn next_packet_id(&mut self) -> u16 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        id
    }

    /// Encodes `packet` for the client's version and writes it. Panics when it cannot be
    /// encoded or written.
    pub async fn send(&mut self, packet: Packet) {
        match self.try_send(packet).await {
            Ok(()) => {}
            Err(e @ ClientError::Encode { .. }) => panic!("encode: {e}"),
            Err(e) => panic!("write: {e}"),
        }
    }

    /// Encodes `packet` for the client's version and writes it; the error when it cannot.
    pub async fn try_send(&mut self, packet: Packet) -> Result<(), ClientError> {
        self.conn.send(&packet).await
    }

    /// Writes `bytes` as they are (malformed packets included). Panics when they cannot be
    /// written.
    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.conn.write_encoded(bytes).await.expect("write");
    }

    /// The next packet, or `None` when the broker closed the connection. Panics after
    /// [`DEADLINE`].
    pub async fn recv(&mut self) -> Option<Packet> {
        self.recv_within(DEADLINE)
            .await
            .expect("a packet or a close before the deadline")
    }

    /// `Err(())` when nothing (no packet, no close) came within `wait`.
    /// A packet already buffered is returned even when `wait` is zero. A connection closed
    /// or broken (reset) is `Ok(None)`; a malformed packet from the broker panics.
    pub async fn recv_within(&mut self, wait: Duration) -> Result<Option<Packet>, ()> {
        // `Connection::recv` is cancel safe (what was read stays buffered), and `timeout`
        // polls it before looking at the clock.
        match tokio::time::timeout(wait, self.conn.recv()).await {
            Err(_) => Err(()),
            Ok(Ok(p)) => Ok(Some(p)),
            Ok(Err(ClientError::Decode { error, .. })) => {
                panic!("broker sent a packet we cannot decode: {error}")
            }
            Ok(Err(_)) => Ok(None),
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
        self.send(publish_packet(
            topic, payload, qos, retain, packet_id, properties,
        ))
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
        self.conn.close().await;
    }
}

/// A test file's client over a transport of its own (TLS, WebSocket): a [`Client`] (which it
/// derefs to), with the file's constructors and variants of methods in an `impl` there.
pub struct ClientOver<T>(pub Client<T>);

impl<T> std::ops::Deref for ClientOver<T> {
    type Target = Client<T>;
    fn deref(&self) -> &Client<T> {
        &self.0
    }
}

impl<T> std::ops::DerefMut for ClientOver<T> {
    fn deref_mut(&mut self) -> &mut Client<T> {
        &mut self.0
    }
}

// ---- Helpers for the limits tests (tests/broker/limits.rs) ----

/// Waits until `cond` holds, checking every few milliseconds; panics after [`DEADLINE`]
/// naming `what`. For state with no event to wait on (counters, session lists).
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !cond() {
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

impl Client {
    /// Opens a TCP connection whose receive buffer is kept small (`SO_RCVBUF` before
    /// connecting), so a client that never reads stalls the broker's writes quickly.
    pub async fn open_small_buffer(addr: SocketAddr, version: ProtocolVersion) -> Client {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        }
        .expect("socket");
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        let stream = socket.connect(addr).await.expect("tcp connect");
        Client::over(stream, version)
    }
}

impl<T: Transport> Client<T> {
    /// PINGREQ, and asserts PINGRESP comes back: the connection is alive and served.
    pub async fn ping(&mut self) {
        self.send(Packet::PingReq).await;
        match self.recv().await {
            Some(Packet::PingResp) => {}
            other => panic!("expected PINGRESP, got {other:?}"),
        }
    }

    /// Waits for the broker to close the connection; returns the reason code of the
    /// DISCONNECT it sent first, if any (5.0), and asserts nothing else came.
    pub async fn expect_disconnect(&mut self) -> Option<ReasonCode> {
        let seen = self.expect_closed().await;
        match seen.as_slice() {
            [] => None,
            [Packet::Disconnect(d)] => Some(d.reason_code),
            other => panic!("expected at most a DISCONNECT before the close, got {other:?}"),
        }
    }
}

/// Log lines captured from the broker while the returned guard lives. Only works in a
/// current-thread runtime (`#[tokio::test]`'s default): the broker's tasks then run on the
/// test's thread, where the capturing subscriber is the default. Captures INFO and above.
pub struct Logs {
    buf: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    _guard: tracing::subscriber::DefaultGuard,
}

struct LogWriter(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Starts capturing log lines (see [`Logs`]).
pub fn capture_logs() -> Logs {
    let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let w = std::sync::Arc::clone(&buf);
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || LogWriter(std::sync::Arc::clone(&w)))
        .finish();
    Logs {
        buf,
        _guard: tracing::subscriber::set_default(subscriber),
    }
}

impl Logs {
    /// Every line captured so far.
    pub fn lines(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.buf.lock().unwrap())
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Lines containing every one of `needles`.
    pub fn matching(&self, needles: &[&str]) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .collect()
    }
}

/// A configuration with one WebSocket listener on 127.0.0.1, port 0 (no HTTP endpoints).
pub fn websocket_config() -> Config {
    let mut config = Config::default();
    config.listeners = vec![ListenerConfig {
        port: 0,
        protocol: mercurio::config::ListenerProtocol::Websocket,
        ..ListenerConfig::default()
    }];
    config
}

/// A configuration with an MQTT listener (first) and a WebSocket listener (second), both on
/// 127.0.0.1, port 0.
pub fn tcp_and_websocket_config() -> Config {
    let mut config = test_config();
    config.listeners.extend(websocket_config().listeners);
    config
}

/// A parsed HTTP/1.1 response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Reads one HTTP response from `stream` (`head`: the request was HEAD, no body). `None` when
/// the connection closed before a whole response came. Panics after [`DEADLINE`].
pub async fn read_http_response(stream: &mut TcpStream, head: bool) -> Option<HttpResponse> {
    let mut buf = Vec::new();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head_text = String::from_utf8_lossy(&buf[..end]).into_owned();
            let mut lines = head_text.split("\r\n");
            let status_line = lines.next().unwrap_or_default();
            let status: u16 = status_line.split(' ').nth(1)?.parse().ok()?;
            let headers: Vec<(String, String)> = lines
                .filter_map(|l| l.split_once(':'))
                .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
                .collect();
            let len: usize = if head || status == 101 || status == 304 {
                0
            } else {
                headers
                    .iter()
                    .find(|(n, _)| n == "content-length")
                    .map(|(_, v)| v.parse().expect("content-length"))
                    .expect("responses carry Content-Length")
            };
            let mut body = buf[end + 4..].to_vec();
            while body.len() < len {
                match tokio::time::timeout_at(deadline, stream.read(&mut chunk))
                    .await
                    .expect("HTTP body before the deadline")
                {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => body.extend_from_slice(&chunk[..n]),
                }
            }
            body.truncate(len);
            return Some(HttpResponse {
                status,
                headers,
                body,
            });
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut chunk))
            .await
            .expect("HTTP response before the deadline")
        {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Sends `request` (raw bytes) on a new connection and reads the response.
pub async fn http_raw(addr: SocketAddr, request: &[u8]) -> Option<HttpResponse> {
    let mut s = TcpStream::connect(addr).await.expect("tcp connect");
    s.write_all(request).await.expect("write request");
    let head = request.starts_with(b"HEAD ");
    read_http_response(&mut s, head).await
}

/// `GET path` on a new connection.
pub async fn http_get(addr: SocketAddr, path: &str) -> HttpResponse {
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    http_raw(addr, req.as_bytes())
        .await
        .unwrap_or_else(|| panic!("no response to GET {path}"))
}

/// Waits until the peer closes `stream` (reading and discarding), panicking after `wait`.
/// Returns what was read.
pub async fn expect_eof(stream: &mut TcpStream, wait: Duration) -> Vec<u8> {
    let mut seen = Vec::new();
    let mut chunk = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
            Err(_) => panic!("connection still open after {wait:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => return seen,
            Ok(Ok(n)) => seen.extend_from_slice(&chunk[..n]),
        }
    }
}

/// The python3 to run a test script with, when it can import `modules`; `None` when it
/// cannot: `test` skips, or fails under `CI=true` (`mercurio_testkit::python_modules`).
pub fn python_with(test: &str, modules: &[&str]) -> Option<&'static str> {
    mercurio_testkit::python_modules(test, modules).then_some("python3")
}

/// Runs `python3 -c script args...` with `stdin`, returning its standard output; panics with
/// its standard error when it fails.
pub async fn run_python(python: &str, script: &str, args: &[String], stdin: &[u8]) -> String {
    use std::process::Stdio;
    let mut child = tokio::process::Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn python3");
    let mut input = child.stdin.take().expect("stdin");
    input.write_all(stdin).await.expect("write stdin");
    drop(input);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("python3 finished within 30 s")
        .expect("python3 ran");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "python3 failed: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Subscription options with only a maximum QoS.
pub fn opts(qos: QoS) -> SubscriptionOptions {
    SubscriptionOptions {
        qos,
        ..Default::default()
    }
}

/// A PUBLISH packet (packet identifier `packet_id`, 0 for QoS 0) for [`Client::send`].
pub fn publish_packet(
    topic: &str,
    payload: &[u8],
    qos: QoS,
    retain: bool,
    packet_id: u16,
    properties: Properties,
) -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos,
        retain,
        topic: topic.to_string(),
        packet_id,
        properties,
        payload: Bytes::copy_from_slice(payload),
    })
}

/// Every protocol version, oldest first.
pub const VERSIONS: [ProtocolVersion; 3] = [
    ProtocolVersion::V31,
    ProtocolVersion::V311,
    ProtocolVersion::V5,
];

impl Client {
    /// Connects with a persistent session: 3.x clean session 0, 5.0 clean start 0 and a
    /// session expiry interval of one hour. Returns the client and the Session Present flag.
    pub async fn connect_persistent(
        addr: SocketAddr,
        version: ProtocolVersion,
        client_id: &str,
    ) -> (Client, bool) {
        let mut c = connect_packet(version, client_id);
        c.clean_start = false;
        if version.is_v5() {
            c.properties.session_expiry_interval = Some(3600);
        }
        let (client, ack) = Client::connect_with(addr, c).await;
        assert_eq!(
            ack.reason_code,
            ReasonCode::SUCCESS,
            "CONNACK for {client_id}"
        );
        (client, ack.session_present)
    }
}

impl<T: Transport> Client<T> {
    /// Waits for the close of a connection that broke the protocol: a 5.0 client must get
    /// DISCONNECT `rc` first, a 3.x client just sees the close.
    pub async fn expect_violation(&mut self, rc: ReasonCode) {
        let got = self.expect_disconnect().await;
        if self.version.is_v5() {
            assert_eq!(got, Some(rc), "DISCONNECT reason code");
        } else {
            assert_eq!(got, None, "3.x has no DISCONNECT from the server");
        }
    }

    /// The next packet, which must be `PUBACK`/`PUBREC`/... for a PUBLISH sent by hand.
    pub async fn expect_packet(&mut self) -> Packet {
        match self.recv().await {
            Some(p) => p,
            None => panic!("expected a packet, the broker closed the connection"),
        }
    }

    /// Closes the socket without DISCONNECT (an abnormal close: the will goes out).
    pub async fn drop_connection(self) {
        drop(self);
    }
}

/// Whether an external program (mosquitto_pub, mosquitto_passwd...) is installed; missing,
/// `test` skips, or fails under `CI=true` (`mercurio_testkit::program`, with the Debian
/// package to install).
pub fn have_program(test: &str, name: &str) -> bool {
    let install = match name {
        "mosquitto_pub" | "mosquitto_sub" => "apt-get install mosquitto-clients",
        "mosquitto" | "mosquitto_passwd" => "apt-get install mosquitto",
        _ => "install it with the system's package manager",
    };
    mercurio_testkit::program(test, name, install)
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

/// A persistent CONNECT: clean session 0 for 3.x, session expiry `expiry` for 5.0.
pub fn persistent(version: ProtocolVersion, client_id: &str, expiry: u32) -> Connect {
    let mut c = connect_packet(version, client_id);
    c.clean_start = false;
    if version == ProtocolVersion::V5 {
        c.properties.session_expiry_interval = Some(expiry);
    }
    c
}

pub async fn connect_persistent(
    addr: SocketAddr,
    version: ProtocolVersion,
    client_id: &str,
) -> (Client, bool) {
    let (c, ack) = Client::connect_with(addr, persistent(version, client_id, 300)).await;
    assert_eq!(
        ack.reason_code,
        ReasonCode::SUCCESS,
        "CONNACK for {client_id}"
    );
    (c, ack.session_present)
}
