//! The reader: decodes the client's packets and runs the inbound state machines (MQTT 5.0
//! section 4.3): PUBLISH and its acknowledgements, SUBSCRIBE, UNSUBSCRIBE, PINGREQ and
//! DISCONNECT. What it answers is encoded into the link's control buffer for the writer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::{Close, LazyMap, Shared, IDLE_BUFFER_LIMIT, TOPIC_ALIAS_MAXIMUM};
use crate::auth::hooks::{Action, AuthContinuation, AuthStep, ConnectInfo, DenyReason};
use crate::broker::access::subscription_topic;
use crate::broker::{message_of, BrokerState};
use crate::cluster_qos::Outcome;
use crate::codec::{
    self, DecodeError, Disconnect, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS,
    ReasonCode, SubAck, Subscribe, UnsubAck, Unsubscribe,
};
use crate::events::{Event, SubscribedFilter};
use crate::link::{DisconnectReason, Link};
use crate::session::{Granted, OutboundState, Session};
use crate::stats::Counters;
use crate::topic;

/// Packets a reader handles before it yields to the scheduler, so that the writers its
/// routing woke get to run. Each yield costs every woken writer a write (a system call, and a
/// wake-up of its client): in a fan-out to 10 subscribers, yielding every 64 packets made
/// writes of 64 messages, and 256 raised the deliveries per second by about a fifth
/// (docs/BENCHMARKS.md, "Fewer, larger writes"). Latency stays bounded by the queues'
/// high-water mark, which stops the reader sooner when a subscriber falls behind.
const READER_BATCH: u32 = 256;

/// Bytes a read buffer gets when a read starts without one (more once it has grown).
pub(super) const READ_ROOM: usize = 256;

/// Reads into `buf` as `read_buf` does, but an empty `buf` holds no memory while the read
/// waits, so an idle connection holds no read buffer: each attempt gets `room` bytes (the
/// capacity the buffer had last, at most `IDLE_BUFFER_LIMIT`), released again when nothing
/// came. (Not an `async fn`: its future would hold its arguments twice.)
fn read_lean<'a, R: AsyncRead + Unpin>(
    rd: &'a mut R,
    buf: &'a mut BytesMut,
    room: &'a mut usize,
) -> impl Future<Output = std::io::Result<usize>> + 'a {
    std::future::poll_fn(move |cx| {
        if buf.capacity() == 0 {
            buf.reserve(*room);
        }
        let read = {
            let read = rd.read_buf(buf);
            tokio::pin!(read);
            read.poll(cx)
        };
        if read.is_pending() && buf.is_empty() {
            *room = buf.capacity().clamp(READ_ROOM, IDLE_BUFFER_LIMIT);
            *buf = BytesMut::new();
        }
        read
    })
}

/// Sends PUBACK, PUBREC or PUBCOMP on `link`: with durable_ack, once storage has committed
/// what the packet acknowledges (and everything before it).
fn acknowledge(broker: &BrokerState, link: &Arc<Link>, version: ProtocolVersion, packet: Packet) {
    match broker.persist.get().filter(|p| p.durable_ack()) {
        Some(p) => {
            let link = Arc::clone(link);
            p.after_commit(Box::new(move |held| {
                if held {
                    link.send(&packet, version);
                } else {
                    // Closed instead, so that the client sends it again.
                    link.kill(DisconnectReason::NotStored, ReasonCode::UNSPECIFIED_ERROR);
                }
            }));
        }
        None => link.send(&packet, version),
    }
}

/// The answer to a PUBLISH whose message JetStream can never take for the other nodes: 5.0
/// gets 0x83 (Implementation specific error) instead of success, and a PUBREC with it ends
/// the QoS 2 flow (no PUBREL follows), so its packet identifier is free again; 3.x keeps
/// its acknowledgement (it cannot be told otherwise).
fn refused(packet: Packet, version: ProtocolVersion, session: &Session) -> Packet {
    if !version.is_v5() {
        return packet;
    }
    let code = ReasonCode::IMPLEMENTATION_SPECIFIC_ERROR;
    match packet {
        Packet::PubAck(a) => Packet::PubAck(PubAck {
            reason_code: code,
            ..a
        }),
        Packet::PubRec(a) => {
            session
                .state
                .lock()
                .release_qos2(&session.client_id, a.packet_id);
            Packet::PubRec(PubAck {
                reason_code: code,
                ..a
            })
        }
        other => other,
    }
}

/// The close for a packet that cannot be decoded.
fn undecodable(e: DecodeError, client_id: &str) -> Close {
    let mut why = e.to_string();
    if let DecodeError::PacketTooLarge { .. } = e {
        why.push_str(" (max_packet_size)");
    }
    Close::violation(e.reason_code(), &why, client_id)
}

/// The inbound half: decodes packets and runs their state machines.
pub(super) struct Reader<'a> {
    /// What the reader shares with the writer.
    pub(super) c: &'a Shared,
    /// Topic aliases the client set, alias -> topic (MQTT 5.0 section 3.3.2.3.4).
    pub(super) aliases: LazyMap<u16, String>,
    /// Sessions the last PUBLISH left at their high-water mark: waited on before the next
    /// packet (back pressure).
    pub(super) congested: Vec<Arc<Session>>,
    /// The last PUBLISH left the queues over `max_queued_memory`: waited on before the next
    /// packet, with `congested` (only after a PUBLISH: an acknowledgement that lets a queue
    /// drain is never held up).
    pub(super) memory_congested: bool,
    /// `max_publish_rate` and `max_publish_bytes_rate`; `None` when both are 0.
    pub(super) rate: Option<Box<super::rate::PublishRate>>,
    /// A re-authentication under way: what takes the client's next AUTH 0x18 (a thin
    /// pointer: rare).
    pub(super) reauth: Option<Box<Box<dyn AuthContinuation>>>,
}

impl<'a> Reader<'a> {
    /// Reads and handles packets until the connection must close.
    // Not an `async fn`: its future would keep room for its arguments twice (as arguments
    // and as locals of its body), and an idle connection holds it all the time.
    #[allow(clippy::manual_async_fn)] // the point: see above
    pub(super) fn run<'r, R: AsyncRead + Unpin>(
        &'r mut self,
        rd: &'r mut R,
        buf: &'r mut BytesMut,
    ) -> impl Future<Output = Close> + use<'a, 'r, R> {
        async move {
            // Few locals: this future is held by every connection, idle ones too (the grace
            // and the packet size limit are looked up again, not kept).
            // Served again after a park: the deadline armed before goes on (it moves only
            // when packets come).
            let mut deadline = if self.c.link.take_resumed() {
                let armed = self
                    .c
                    .broker
                    .keep_alive
                    .armed_deadline(&self.c.link)
                    .or_else(|| self.keep_alive_deadline());
                // The deadline runs only while the read waits: not while the packets the
                // resume read are handled, which may wait (back pressure, publish rate).
                self.c.link.disarm_keep_alive();
                armed
            } else {
                self.keep_alive_deadline()
            };
            let mut handled = 0u32;
            // The room the read buffer is given back when a read starts with it released.
            let mut room = READ_ROOM;
            loop {
                // The keep alive deadline moves once per read that brought packets, not per packet:
                // one clock reading for a whole buffer of them.
                let before = handled;
                loop {
                    let total = match codec::check_frame(buf, self.max_packet_size()) {
                        Ok(Some(total)) => total,
                        Ok(None) => break,
                        Err(e) => return undecodable(e, &self.c.session.client_id),
                    };
                    // The publish rate limits: a PUBLISH over them waits for its turn before
                    // it is handled, the socket not read meanwhile (TCP slows the client).
                    if let Some(rate) = &mut self.rate {
                        if codec::is_publish_frame(buf) {
                            if let Some(wait) = rate.charge(total) {
                                Box::pin(self.held_by_rate(wait)).await;
                                // The client was silent because it was not read.
                                deadline = self.keep_alive_deadline();
                            }
                        }
                    }
                    // A future holds room for the largest state it can be in, and this one lives
                    // as long as the connection (idle ones too). A PUBLISH without access checks
                    // or interceptors (fixed for the broker's lifetime) never waits: it is decoded
                    // straight from its frame, without a `Packet` around it, and handled in a
                    // plain function (the hot path). Any other packet is decoded and dispatched in
                    // one expression, so that no packet is held in the future while a handler
                    // waits (`dispatch` boxes those).
                    if codec::is_publish_frame(buf) && !self.c.broker.publish_waits() {
                        let handled = self.publish_frame(&buf[..total]);
                        buf.advance(total);
                        if let Err(close) = handled {
                            return close;
                        }
                    } else {
                        // Only the boxed handler is kept while it runs: awaited in the match on
                        // the decoding's result, or into a variable declared before the wait,
                        // it would keep room for those too (a moved-from or not yet assigned
                        // variable in scope still takes room in the future).
                        let waiting = match codec::decode_from_client(
                            buf,
                            self.c.version,
                            self.max_packet_size(),
                        )
                        .map_err(|e| undecodable(e, &self.c.session.client_id))
                        .map(|packet| packet.map(|packet| self.dispatch(packet)))
                        {
                            Ok(Some(Ok(waiting))) => waiting,
                            Ok(Some(Err(close))) | Err(close) => return close,
                            Ok(None) => break,
                        };
                        if let Some(waiting) = waiting {
                            if let Err(close) = waiting.await {
                                return close;
                            }
                        }
                    }
                    // Back pressure: nothing more is read while a session this
                    // connection published into is at its high-water mark and its client
                    // takes messages, or the queues together are over max_queued_memory;
                    // nor while the answers owed to this client are over their limit (it
                    // does not read its socket).
                    if !self.congested.is_empty() || std::mem::take(&mut self.memory_congested) {
                        let broker = &self.c.broker;
                        Box::pin(broker.wait_congested(Some(&self.c.session), &mut self.congested))
                            .await;
                        deadline = self.keep_alive_deadline();
                    }
                    // Storage back pressure, per packet: a PUBLISH can queue copies
                    // for many persistent sessions, owed by this client until stored.
                    if let Some(p) = self.c.broker.persist.get() {
                        if p.must_wait(&self.c.session.client_id) {
                            Box::pin(p.wait_room(&self.c.session.client_id)).await;
                            deadline = self.keep_alive_deadline();
                        }
                    }
                    if self.c.link.control_full() {
                        let patience = self.c.broker.limits.stall_time;
                        if !Box::pin(self.c.link.wait_control_room(patience)).await {
                            tracing::info!(client_id = %self.c.session.client_id, "closing connection: the client does not read its socket (answers pending for stall_time)");
                            return Close::lost(DisconnectReason::Io(
                                "the client does not read its socket".into(),
                            ));
                        }
                        deadline = self.keep_alive_deadline();
                    }
                    // A fast publisher's buffer can hold thousands of packets: let the
                    // subscribers' writers this routing woke run (tokio keeps the last
                    // woken task in this worker's unstealable LIFO slot), or their
                    // queues fill up and drop while the consumers are idle.
                    handled += 1;
                    if handled.is_multiple_of(READER_BATCH) {
                        tokio::task::yield_now().await;
                    }
                }
                if handled != before {
                    deadline = self.keep_alive_deadline();
                }
                if buf.is_empty() && buf.capacity() > IDLE_BUFFER_LIMIT {
                    *buf = BytesMut::with_capacity(256);
                }
                if let Some(p) = self.c.broker.persist.get() {
                    if p.must_wait(&self.c.session.client_id) {
                        Box::pin(p.wait_room(&self.c.session.client_id)).await;
                        // The keep alive restarts: the client was silent because it was not read.
                        deadline = self.keep_alive_deadline();
                    }
                }
                // The deadline runs only while the read waits; past it, the broker's keep alive
                // sweep kills the link (`keep_alive`: no timer per connection).
                let armed = deadline.map(|d| self.c.broker.keep_alive.arm(&self.c.link, d));
                // At rest (the connection may park) only with nothing in hand: no partial
                // packet, no congestion, no re-authentication under way (its state is here).
                let at_rest = buf.is_empty() && self.congested.is_empty() && self.reauth.is_none();
                self.c.link.set_rest(crate::link::READER_AT_REST, at_rest);
                let read = read_lean(rd, buf, &mut room).await;
                self.c.link.set_rest(crate::link::READER_AT_REST, false);
                drop(armed);
                match read {
                    Ok(0) => return Close::lost(DisconnectReason::ConnectionLost),
                    Ok(n) => {
                        self.c.link.active();
                        self.c.broker.busy_poll.note();
                        Counters::add(&self.c.broker.stats.bytes_received, n as u64);
                        // A read that filled all the room there was: the client sends more than
                        // reads of this size take in (a 256-byte buffer is about three small
                        // PUBLISH packets per system call). The buffer doubles, up to
                        // IDLE_BUFFER_LIMIT (beyond which an emptied one is released), so a busy
                        // connection reads up to 16 KiB per call; an idle one still holds none
                        // (`read_lean`), and gets this size back when data comes.
                        if buf.len() == buf.capacity() && buf.capacity() < IDLE_BUFFER_LIMIT {
                            let want = (2 * buf.capacity()).min(IDLE_BUFFER_LIMIT);
                            buf.reserve(want.saturating_sub(buf.len()));
                        }
                    }
                    Err(e) => return Close::lost(DisconnectReason::Io(e.to_string())),
                }
            }
        }
    }

    /// When the connection closes if no packet comes: one and a half times the keep alive
    /// from now [MQTT-3.1.2-24]; `None` for a keep alive of 0 (never).
    fn keep_alive_deadline(&self) -> Option<tokio::time::Instant> {
        let keep_alive = u64::from(self.c.keep_alive);
        (keep_alive > 0)
            .then(|| tokio::time::Instant::now() + Duration::from_millis(keep_alive * 1500))
    }

    /// Waits `wait` for the publish rate limits, counted in `clients_rate_limited` and
    /// `clients_rate_limited_ms`. The keep alive does not run meanwhile (it runs only while
    /// the read waits).
    async fn held_by_rate(&self, wait: Duration) {
        let start = tokio::time::Instant::now();
        tokio::time::sleep(wait).await;
        let stats = &self.c.broker.stats;
        Counters::add(&stats.clients_rate_limited, 1);
        let held = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        Counters::add(&stats.clients_rate_limited_us, held);
    }

    fn max_packet_size(&self) -> u32 {
        self.c.broker.config.server.max_packet_size
    }

    /// Handles `packet`, or returns its handler boxed when it may wait (SUBSCRIBE; PUBLISH
    /// under access checks or interceptors). A PUBLISH without access checks (fixed for the
    /// broker's lifetime) never waits, so it runs to completion here, its state on the stack
    /// (the reader's hot path takes such a PUBLISH before, straight from its frame).
    #[allow(clippy::type_complexity)]
    fn dispatch(
        &mut self,
        packet: Packet,
    ) -> Result<Option<Pin<Box<dyn Future<Output = Result<(), Close>> + Send + '_>>>, Close> {
        match packet {
            Packet::Publish(p) if !self.c.broker.publish_waits() => {
                self.on_publish_now(p).map(|()| None)
            }
            Packet::Publish(_) | Packet::Subscribe(_) | Packet::Auth(_) => {
                Ok(Some(Box::pin(self.handle(packet))))
            }
            other => self.handle_other(other).map(|()| None),
        }
    }

    fn send(&self, packet: Packet) {
        self.c.link.send(&packet, self.c.version);
    }

    fn violation(&self, rc: ReasonCode, why: &str) -> Close {
        Close::violation(rc, why, &self.c.session.client_id)
    }

    async fn handle(&mut self, packet: Packet) -> Result<(), Close> {
        match packet {
            Packet::Publish(p) => self.on_publish(p).await,
            Packet::Subscribe(s) => self.on_subscribe(s).await,
            Packet::Auth(a) => self.on_auth(a).await,
            other => self.handle_other(other),
        }
    }

    /// AUTH after the CONNACK: a re-authentication (MQTT 5.0 section 4.12.1), started by the
    /// client's AUTH 0x19 with CONNECT's method, then AUTH 0x18 both ways, ended by the
    /// server's AUTH 0x00 (success) or DISCONNECT (failure [MQTT-4.12.1-2]). The client stays
    /// connected, and keeps its user, meanwhile; a re-authentication as another user fails
    /// (0x87).
    async fn on_auth(&mut self, a: codec::Auth) -> Result<(), Close> {
        let Some((owned, peer)) = self.c.link.auth_method() else {
            return Err(self.violation(
                ReasonCode::PROTOCOL_ERROR,
                "AUTH without an authentication method in CONNECT [MQTT-3.1.2-30]",
            ));
        };
        let method = owned.as_str();
        if a.properties.authentication_method.as_deref() != Some(method) {
            return Err(self.violation(
                ReasonCode::PROTOCOL_ERROR,
                "AUTH with another authentication method than CONNECT's [MQTT-4.12.1-1]",
            ));
        }
        let client_id = self.c.session.client_id.to_string();
        let (username, listener) = match &*self.c.session.identity.read() {
            crate::auth::Identity::Client { username, listener } => {
                (username.clone(), listener.map(|l| l as usize))
            }
            crate::auth::Identity::Trusted => (None, None),
        };
        let data = a.properties.authentication_data;
        let refused = || AuthStep::Deny(DenyReason::NotAuthorized);
        let step = match (a.reason_code, self.reauth.take()) {
            (ReasonCode::RE_AUTHENTICATE, None) => {
                let Some(e) = self
                    .c
                    .broker
                    .auth_of(listener)
                    .enhanced_for(method)
                    .cloned()
                else {
                    return Err(self.violation(
                        ReasonCode::BAD_AUTHENTICATION_METHOD,
                        "the authentication method is no longer supported",
                    ));
                };
                let info = ConnectInfo {
                    client_id: client_id.clone(),
                    username: username.as_deref().map(str::to_string),
                    password: None,
                    peer,
                    protocol: self.c.version,
                    certificate_cn: None,
                    username_from_certificate: false,
                };
                crate::hook::guard(
                    "enhanced authenticator",
                    &client_id,
                    e.start(method, &info, data),
                )
                .await
                .unwrap_or_else(refused)
            }
            (ReasonCode::CONTINUE_AUTHENTICATION, Some(next)) => {
                crate::hook::guard("enhanced authenticator", &client_id, (*next).step(data))
                    .await
                    .unwrap_or_else(refused)
            }
            (rc, _) => {
                return Err(self.violation(
                    ReasonCode::PROTOCOL_ERROR,
                    &format!("AUTH with reason code {rc} out of turn (MQTT 5.0 section 4.12.1)"),
                ))
            }
        };
        let auth = |reason_code, data| {
            Packet::Auth(codec::Auth {
                reason_code,
                properties: Properties {
                    authentication_method: Some(method.to_string()),
                    authentication_data: data,
                    ..Properties::default()
                },
            })
        };
        match step {
            AuthStep::Continue { data, next } => {
                self.reauth = Some(Box::new(next));
                self.send(auth(ReasonCode::CONTINUE_AUTHENTICATION, Some(data)));
                Ok(())
            }
            AuthStep::Success {
                username: now,
                data,
            } => {
                if now.is_some() && now.as_deref() != username.as_deref() {
                    return Err(self.violation(
                        ReasonCode::NOT_AUTHORIZED,
                        "re-authenticated as another user",
                    ));
                }
                tracing::debug!(%client_id, "re-authenticated");
                self.send(auth(ReasonCode::SUCCESS, data));
                Ok(())
            }
            AuthStep::Deny(reason) => {
                // DISCONNECT has no 0x86 (section 3.14.2.1): a wrong secret is 0x87 here.
                let rc = match reason {
                    DenyReason::BadCredentials | DenyReason::NotAuthorized => {
                        ReasonCode::NOT_AUTHORIZED
                    }
                    DenyReason::Busy => ReasonCode::SERVER_BUSY,
                };
                Err(self.violation(rc, "re-authentication failed [MQTT-4.12.1-2]"))
            }
        }
    }

    /// Every packet but PUBLISH and SUBSCRIBE.
    fn handle_other(&mut self, packet: Packet) -> Result<(), Close> {
        match packet {
            Packet::PubAck(a) => self.on_ack(a.packet_id, OutboundState::AwaitingPubAck),
            Packet::PubRec(a) => self.on_pubrec(a),
            Packet::PubComp(a) => self.on_ack(a.packet_id, OutboundState::AwaitingPubComp),
            Packet::PubRel(a) => {
                // Release of an inbound QoS 2 message [MQTT-4.3.3-9..11]. An unknown
                // identifier is answered with Success too, as mosquitto does: it is a PUBREL
                // resent after a reconnect whose PUBCOMP was lost [MQTT-4.4.0-1], for a
                // message already complete, and some clients (rumqttc) drop the connection
                // on a PUBCOMP error code such as 0x92.
                let known = {
                    let mut st = self.c.session.state.lock();
                    st.release_qos2(&self.c.session.client_id, a.packet_id)
                };
                if !known {
                    tracing::debug!(client_id = %self.c.session.client_id, packet_id = a.packet_id, "PUBREL for a completed or unknown packet identifier");
                }
                // With durable_ack, after the removal is committed: a PUBCOMP for a release
                // storage still lacks would, after a crash, leave the identifier "awaiting
                // release" and swallow the client's next QoS 2 message that reuses it.
                self.send_acknowledgement(Packet::PubComp(PubAck {
                    packet_id: a.packet_id,
                    reason_code: ReasonCode::SUCCESS,
                    properties: Properties::default(),
                }));
                Ok(())
            }
            Packet::Unsubscribe(u) => {
                self.on_unsubscribe(u);
                Ok(())
            }
            Packet::PingReq => {
                self.send(Packet::PingResp);
                Ok(())
            }
            Packet::Disconnect(d) => Err(self.on_disconnect(d)),
            Packet::Connect(_) => {
                Err(self.violation(ReasonCode::PROTOCOL_ERROR, "second CONNECT [MQTT-3.1.0-2]"))
            }
            other => Err(self.violation(
                ReasonCode::PROTOCOL_ERROR,
                &format!("{} is sent by servers only", other.name()),
            )),
        }
    }

    fn ack_publish(&self, qos: QoS, packet_id: u16, reason_code: ReasonCode) {
        if let Some(packet) = self.publish_answer(qos, packet_id, reason_code) {
            self.send_acknowledgement(packet);
        }
    }

    /// [`Reader::ack_publish`] once `gate` is resolved: JetStream holds the message for the
    /// other nodes that want it. When it does not within `jetstream_ack_timeout`, the
    /// connection is closed instead (5.0: DISCONNECT 0x89 Server busy), so that the client
    /// learns it and sends it again; the message is still sent once JetStream takes it.
    fn ack_publish_after(
        &self,
        qos: QoS,
        packet_id: u16,
        reason_code: ReasonCode,
        gate: Arc<crate::cluster_qos::Gate>,
    ) {
        let Some(packet) = self.publish_answer(qos, packet_id, reason_code) else {
            return;
        };
        let (broker, link, version) = (
            Arc::clone(&self.c.broker),
            Arc::clone(&self.c.link),
            self.c.version,
        );
        let session = Arc::clone(&self.c.session);
        gate.on_done(Box::new(move |outcome| {
            let packet = match outcome {
                Outcome::Held => packet,
                Outcome::TimedOut => {
                    tracing::warn!(client_id = %session.client_id, "closing connection: JetStream did not take a message for another node within jetstream_ack_timeout (NATS or JetStream unavailable?)");
                    link.kill(DisconnectReason::ClusterBusy, ReasonCode::SERVER_BUSY);
                    return;
                }
                // Never to be carried (logged where found): as for message_size_limit, 5.0
                // is told 0x83 (Implementation specific error), 3.x acknowledged.
                Outcome::Refused => refused(packet, version, &session),
            };
            acknowledge(&broker, &link, version, packet);
        }));
    }

    /// The PUBACK or PUBREC answering a PUBLISH (`None` at QoS 0); a PUBREC records the
    /// packet identifier as received.
    fn publish_answer(&self, qos: QoS, packet_id: u16, reason_code: ReasonCode) -> Option<Packet> {
        if qos == QoS::AtMostOnce {
            return None;
        }
        let ack = PubAck {
            packet_id,
            reason_code,
            properties: Properties::default(),
        };
        Some(match qos {
            QoS::AtMostOnce => return None,
            QoS::AtLeastOnce => Packet::PubAck(ack),
            QoS::ExactlyOnce => {
                if !reason_code.is_failure() {
                    let mut st = self.c.session.state.lock();
                    st.receive_qos2(&self.c.session.client_id, packet_id);
                }
                Packet::PubRec(ack)
            }
        })
    }

    /// Sends PUBACK, PUBREC or PUBCOMP: with durable_ack, once storage has committed what
    /// the packet acknowledges (and everything before it).
    fn send_acknowledgement(&self, packet: Packet) {
        acknowledge(&self.c.broker, &self.c.link, self.c.version, packet);
    }

    /// A PUBLISH frame when neither access checks nor interceptors are configured: decoded
    /// and handled at once (a plain function, so the decoded packet is not kept in the
    /// reader's future).
    fn publish_frame(&mut self, frame: &[u8]) -> Result<(), Close> {
        match codec::decode_publish_from_client(frame, self.c.version) {
            Ok(p) => self.on_publish_now(p),
            Err(e) => Err(undecodable(e, &self.c.session.client_id)),
        }
    }

    /// A PUBLISH when neither access checks nor interceptors are configured: nothing can
    /// make it wait, so it is handled synchronously (the hot path).
    fn on_publish_now(&mut self, mut p: Publish) -> Result<(), Close> {
        if self.publish_checks(&mut p)? {
            self.publish_accepted(p);
        }
        Ok(())
    }

    /// A PUBLISH that may wait: the checks, then the entry's authorizers and interceptors
    /// ([`BrokerState::admit`](crate::broker::BrokerState::admit)), then routing.
    async fn on_publish(&mut self, mut p: Publish) -> Result<(), Close> {
        if !self.publish_checks(&mut p)? {
            return Ok(());
        }
        match self.c.broker.admit(Some(&self.c.session), &mut p).await {
            Ok(()) => {}
            Err(Some(rc)) => {
                // 3.x has no way to say it: acknowledged and dropped.
                let rc = if self.c.version.is_v5() {
                    rc
                } else {
                    ReasonCode::SUCCESS
                };
                self.ack_publish(p.qos, p.packet_id, rc);
                return Ok(());
            }
            // An interceptor panicked: that PUBLISH is lost, and the client must know. A 5.0
            // QoS 1/2 publisher is told in its PUBACK / PUBREC (0x80 Unspecified error); a
            // 3.x or QoS 0 publisher has no way to be told but the close (5.0: DISCONNECT
            // 0x80), and can connect again at once.
            Err(None) if self.c.version.is_v5() && p.qos != QoS::AtMostOnce => {
                self.ack_publish(p.qos, p.packet_id, ReasonCode::UNSPECIFIED_ERROR);
                return Ok(());
            }
            Err(None) => {
                return Err(Close {
                    reason: DisconnectReason::HookPanicked,
                    send: Some(ReasonCode::UNSPECIFIED_ERROR),
                    publish_will: true,
                });
            }
        }
        self.publish_accepted(p);
        Ok(())
    }

    /// The checks of a PUBLISH before access control: `Ok(false)` when it was answered
    /// here and goes no further, `Err` when it closes the connection.
    fn publish_checks(&mut self, p: &mut Publish) -> Result<bool, Close> {
        let broker = &self.c.broker;
        Counters::add(&broker.stats.messages_received, 1);
        let server = &broker.config.server;
        if p.qos as u8 > server.max_qos {
            return Err(self.violation(
                ReasonCode::QOS_NOT_SUPPORTED,
                "PUBLISH above max_qos [MQTT-3.2.2-11]",
            ));
        }
        if p.retain && !server.retain_available {
            return Err(self.violation(
                ReasonCode::RETAIN_NOT_SUPPORTED,
                "retained PUBLISH but retain_available = false",
            ));
        }
        // Topic alias (MQTT 5.0 section 3.3.2.3.4).
        if let Some(alias) = p.properties.topic_alias.take() {
            if alias == 0 || alias > TOPIC_ALIAS_MAXIMUM {
                return Err(self.violation(
                    ReasonCode::TOPIC_ALIAS_INVALID,
                    "topic alias out of range [MQTT-3.3.2-8]",
                ));
            }
            if p.topic.is_empty() {
                match self.aliases.get(&alias) {
                    Some(t) => p.topic = t.clone(),
                    None => {
                        return Err(
                            self.violation(ReasonCode::PROTOCOL_ERROR, "unknown topic alias")
                        )
                    }
                }
            } else {
                self.aliases.insert(alias, p.topic.clone());
            }
        }
        // A topic shorter than the limit cannot have more levels than it (each level but
        // the first costs a '/'): the count is skipped for the usual short topic.
        let max_levels = server.max_topic_levels;
        if p.topic.len() >= max_levels && topic::level_count(&p.topic) > max_levels {
            // As an invalid topic name, as mosquitto treats a topic over its level limit.
            return Err(self.violation(
                ReasonCode::TOPIC_NAME_INVALID,
                "topic name over max_topic_levels",
            ));
        }
        if p.topic.is_empty() {
            return Err(self.violation(ReasonCode::PROTOCOL_ERROR, "empty topic name"));
        }
        if let Some(mount) = self.c.mount() {
            p.topic.insert_str(0, mount);
        }
        // Flow control (5.0 sections 3.3.4 and 4.9): QoS 1 messages whose PUBACK is not
        // written yet and QoS 2 messages awaiting PUBREL count against receive_maximum.
        if p.qos > QoS::AtMostOnce {
            let st = self.c.session.state.lock();
            if p.qos == QoS::ExactlyOnce && st.awaits_release(p.packet_id) {
                // A resent QoS 2 PUBLISH already received: acknowledge, never deliver twice;
                // while its first copy waits for JetStream, its PUBREC waits as well.
                drop(st);
                let cluster_qos = &self.c.broker.cluster_qos;
                match cluster_qos.receipt(&self.c.session.client_id, p.packet_id) {
                    Some(gate) => {
                        self.ack_publish_after(p.qos, p.packet_id, ReasonCode::SUCCESS, gate)
                    }
                    None => self.ack_publish(p.qos, p.packet_id, ReasonCode::SUCCESS),
                }
                return Ok(false);
            }
            let unanswered = st.awaiting_release() + self.c.link.unanswered_qos1();
            drop(st);
            if unanswered >= usize::from(self.c.broker.config.server.receive_maximum) {
                return Err(self.violation(
                    ReasonCode::RECEIVE_MAXIMUM_EXCEEDED,
                    "more QoS 1 and 2 messages unacknowledged than receive_maximum",
                ));
            }
            if p.qos == QoS::AtLeastOnce {
                // Counted until its PUBACK is written (every path below answers it).
                self.c.link.qos1_received();
            }
        }
        let size_limit = server.message_size_limit;
        if size_limit > 0 && p.payload.len() > size_limit as usize {
            // mosquitto's message_size_limit: acknowledged, not delivered, the connection
            // kept. 5.0: 0x83 Implementation specific error, as mosquitto's manual says
            // (mosquitto 2.0 sends 0x95, which PUBACK and PUBREC may not carry, 5.0 sections
            // 3.4.2.1 and 3.5.2.1); 3.x: as usual, the answer 3.1.1 allows for a message the
            // server does not forward [MQTT-3.3.5-2].
            tracing::debug!(client_id = %self.c.session.client_id, topic = %p.topic, size = p.payload.len(), "PUBLISH over message_size_limit dropped");
            let rc = if self.c.version.is_v5() {
                ReasonCode::IMPLEMENTATION_SPECIFIC_ERROR
            } else {
                ReasonCode::SUCCESS
            };
            self.ack_publish(p.qos, p.packet_id, rc);
            return Ok(false);
        }
        if p.topic.starts_with("$SYS")
            && (p.topic != super::connect::bridge_state_topic(&self.c.session.client_id)
                || self.c.broker.is_own_bridge_state(&p.topic))
        {
            tracing::debug!(client_id = %self.c.session.client_id, topic = %p.topic, "PUBLISH to $SYS refused");
            self.ack_publish(p.qos, p.packet_id, ReasonCode::NOT_AUTHORIZED);
            return Ok(false);
        }
        if p.properties.payload_format_indicator == Some(1)
            && std::str::from_utf8(&p.payload).is_err()
        {
            self.ack_publish(p.qos, p.packet_id, ReasonCode::PAYLOAD_FORMAT_INVALID);
            return Ok(false);
        }
        Ok(true)
    }

    /// Builds the message of an accepted PUBLISH, routes it and acknowledges it.
    fn publish_accepted(&mut self, p: Publish) {
        let broker = &self.c.broker;
        let (qos, packet_id) = (p.qos, p.packet_id);
        let mut msg = message_of(p, Some(Arc::clone(&self.c.session.client_id)));
        if msg.retain && broker.config.server.check_retain_source {
            msg.source = broker.source_of(&self.c.session);
        }
        if self.c.bridge && !crate::bridge::queue::is_bridged(&msg.properties) {
            // From another broker's bridge (try_private): it crossed a bridge already, so it
            // crosses no other of this broker's, as a message with the hop marker
            // (docs/bridges.md, Loops). MQTT 3.1.1 cannot carry the marker: it is added here.
            msg.properties.user_properties.push((
                crate::bridge::HOP_PROPERTY.to_string(),
                self.c.session.client_id.to_string(),
            ));
        }
        let msg = Arc::new(msg);
        let (matched, gate) = broker.publish_gated(msg, &mut self.congested);
        self.memory_congested =
            broker.memory_congested() || (gate.is_some() && broker.cluster_qos.over());
        // 5.0: a QoS 1 message no subscription matched is acknowledged with 0x10 (No matching
        // subscribers), which the Server MAY use (MQTT 5.0 section 3.4.2.1), as mosquitto does;
        // PUBREC stays 0x00, as in mosquitto.
        let rc = if !matched && qos == QoS::AtLeastOnce && self.c.version.is_v5() {
            ReasonCode::NO_MATCHING_SUBSCRIBERS
        } else {
            ReasonCode::SUCCESS
        };
        match gate {
            // Another node wants it: acknowledged once JetStream holds it (docs/cluster.md,
            // "QoS across nodes").
            Some(gate) => {
                if qos == QoS::ExactlyOnce {
                    let client_id = &self.c.session.client_id;
                    broker
                        .cluster_qos
                        .await_receipt(client_id, packet_id, &gate);
                }
                self.ack_publish_after(qos, packet_id, rc, gate)
            }
            None => self.ack_publish(qos, packet_id, rc),
        }
    }

    /// PUBACK or PUBCOMP: the outbound message leaves flight and frees a slot of the window.
    /// One for an identifier in flight at another step of its flow (PUBCOMP for a QoS 1
    /// message, PUBACK for a QoS 2 one, PUBCOMP before PUBREC) is a Protocol Error, as in
    /// mosquitto: a QoS 1 message is answered by PUBACK [MQTT-4.3.2-4], a QoS 2 message by
    /// PUBREC then, after PUBREL, PUBCOMP [MQTT-4.3.3-9]. An unknown identifier (a late
    /// duplicate) is ignored.
    fn on_ack(&self, packet_id: u16, expected: OutboundState) -> Result<(), Close> {
        let mut st = self.c.session.state.lock();
        match st.inflight_state(packet_id) {
            Some(state) if state == expected => {
                let done = st.take_inflight(&self.c.session.client_id, packet_id);
                drop(st);
                self.c.link.wake();
                if let Some(q) = done {
                    let observers = &self.c.broker.observers;
                    observers.completed(&self.c.session.client_id, &q.msg, q.qos);
                }
                Ok(())
            }
            Some(state) => {
                drop(st);
                let sent = if expected == OutboundState::AwaitingPubAck {
                    "PUBACK"
                } else {
                    "PUBCOMP"
                };
                Err(self.violation(
                    ReasonCode::PROTOCOL_ERROR,
                    &format!("{sent} for packet identifier {packet_id}, which is {state:?}"),
                ))
            }
            None => {
                tracing::debug!(client_id = %self.c.session.client_id, packet_id, "acknowledgement for an unknown packet identifier");
                Ok(())
            }
        }
    }

    fn on_pubrec(&self, a: PubAck) -> Result<(), Close> {
        let mut st = self.c.session.state.lock();
        if st.inflight_state(a.packet_id) == Some(OutboundState::AwaitingPubAck) {
            drop(st);
            return Err(self.violation(
                ReasonCode::PROTOCOL_ERROR,
                &format!(
                    "PUBREC for packet identifier {}, a QoS 1 message",
                    a.packet_id
                ),
            ));
        }
        let client_id = &self.c.session.client_id;
        let reason_code = if a.reason_code.is_failure() {
            if st.take_inflight(client_id, a.packet_id).is_some() {
                drop(st);
                self.c.link.wake();
                return Ok(());
            }
            ReasonCode::PACKET_IDENTIFIER_NOT_FOUND
        } else if st.inflight_received(client_id, a.packet_id) {
            ReasonCode::SUCCESS
        } else {
            ReasonCode::PACKET_IDENTIFIER_NOT_FOUND
        };
        drop(st);
        self.send(Packet::PubRel(PubAck {
            packet_id: a.packet_id,
            reason_code,
            properties: Properties::default(),
        }));
        Ok(())
    }

    async fn on_subscribe(&mut self, s: Subscribe) -> Result<(), Close> {
        let broker = &self.c.broker;
        let max_qos = QoS::from_u8(broker.config.server.max_qos).unwrap_or(QoS::ExactlyOnce);
        let identifier = s.properties.subscription_identifiers.first().copied();
        let mut codes = Vec::with_capacity(s.filters.len());
        let mut granted_now = broker.events.listening().then(Vec::new);
        let mut retained = Vec::new();
        let mut readers = Vec::new();
        for f in &s.filters {
            let shared = match topic::parse_shared(&f.filter) {
                Ok(shared) => shared.is_some(),
                Err(_) => {
                    codes.push(self.filter_failure(ReasonCode::TOPIC_FILTER_INVALID));
                    continue;
                }
            };
            if !shared && topic::validate_topic_filter(&f.filter).is_err() {
                codes.push(self.filter_failure(ReasonCode::TOPIC_FILTER_INVALID));
                continue;
            }
            if topic::level_count(&f.filter) > broker.config.server.max_topic_levels {
                tracing::debug!(client_id = %self.c.session.client_id, "SUBSCRIBE filter over max_topic_levels");
                codes.push(self.filter_failure(ReasonCode::TOPIC_FILTER_INVALID));
                continue;
            }
            if let Some(parsed) = crate::streams::parse_read_filter(&f.filter) {
                match self
                    .stream_reader(parsed, f, &s.properties, identifier)
                    .await
                {
                    Ok(start) => {
                        codes.push(ReasonCode(start.granted.options.qos as u8));
                        readers.push(start);
                    }
                    Err(rc) => codes.push(self.filter_failure(rc)),
                }
                continue;
            }
            if shared && f.options.no_local {
                return Err(self.violation(
                    ReasonCode::PROTOCOL_ERROR,
                    "No Local on a shared subscription [MQTT-3.8.3-4]",
                ));
            }
            let filter = super::mounted(self.c.mount(), &f.filter);
            if broker.checks_access()
                && !broker
                    .may(
                        &self.c.session,
                        subscription_topic(&filter),
                        Action::Subscribe,
                    )
                    .await
            {
                tracing::debug!(client_id = %self.c.session.client_id, %filter, "SUBSCRIBE not authorized");
                codes.push(self.filter_failure(ReasonCode::NOT_AUTHORIZED));
                continue;
            }
            let mut options = f.options;
            options.qos = options.qos.min(max_qos);
            let (filter, shared, reported) = if broker.subscribe_interceptors.is_empty() {
                (filter, shared, None)
            } else {
                let username = self.c.session.username();
                let asked = filter.clone();
                match crate::intercept::intercept_subscribe(
                    &broker.subscribe_interceptors,
                    &self.c.session.client_id,
                    username.as_deref(),
                    filter,
                    &mut options.qos,
                    options.no_local,
                )
                .await
                {
                    Ok(filter) if filter == asked => (filter, shared, None),
                    Ok(filter) => {
                        let shared = matches!(topic::parse_shared(&filter), Ok(Some(_)));
                        let reported = filter.clone();
                        (filter, shared, Some(reported))
                    }
                    Err(rc) => {
                        codes.push(self.filter_failure(rc));
                        continue;
                    }
                }
            };
            if self.c.bridge && !shared {
                options.no_local = true;
                options.retain_as_published = true;
            }
            let granted = Granted {
                options,
                identifier,
            };
            let max = broker.config.server.max_subscriptions_per_client;
            let Some(existed) = broker.subscribe_within(&self.c.session, &filter, granted, max)
            else {
                tracing::debug!(client_id = %self.c.session.client_id, filter = %f.filter, "SUBSCRIBE over max_subscriptions_per_client");
                codes.push(self.filter_failure(ReasonCode::QUOTA_EXCEEDED));
                continue;
            };
            if let Some(list) = &mut granted_now {
                list.push(SubscribedFilter {
                    filter: reported.unwrap_or_else(|| f.filter.clone()),
                    options,
                    identifier,
                });
            }
            codes.push(ReasonCode(options.qos as u8));
            let send = match options.retain_handling {
                0 => true,
                1 => !existed,
                _ => false,
            };
            if send && !shared {
                retained.push((filter, granted));
            }
        }
        self.send(Packet::SubAck(SubAck {
            packet_id: s.packet_id,
            reason_codes: codes,
            properties: Properties::default(),
        }));
        if let Some(subscriptions) = granted_now.filter(|l| !l.is_empty()) {
            broker.events.fire(|| Event::Subscribed {
                client_id: self.c.session.client_id.to_string(),
                subscriptions,
            });
        }
        for (filter, granted) in retained {
            broker.send_retained(&self.c.session, &filter, &granted);
        }
        for start in readers {
            broker.start_stream_reader(&self.c.session, Arc::clone(&self.c.link), start);
        }
        Ok(())
    }

    /// A SUBSCRIBE to `$stream/<name>[/@<offset>][/<filter>]` (docs/streams.md): the stream,
    /// the access check (read access to the stream's filter, or to the part asked for), and
    /// where the reader starts (the `@` level, else the `stream-offset` user property, else
    /// `latest`); the reason code of the refusal otherwise.
    async fn stream_reader(
        &self,
        parsed: Result<crate::streams::ReadFilter<'_>, String>,
        f: &codec::SubscribeFilter,
        properties: &Properties,
        identifier: Option<u32>,
    ) -> Result<crate::broker::ReaderStart, ReasonCode> {
        use crate::streams::{StartAt, OFFSET_PROPERTY};
        let broker = &self.c.broker;
        let client_id = &self.c.session.client_id;
        let parsed = parsed.map_err(|why| {
            tracing::debug!(%client_id, filter = %f.filter, "SUBSCRIBE to a stream refused: {why}");
            ReasonCode::TOPIC_FILTER_INVALID
        })?;
        let Some(stream) = broker.streams.get(parsed.name) else {
            tracing::debug!(%client_id, filter = %f.filter, "SUBSCRIBE to a stream refused: no stream is named {:?}", parsed.name);
            return Err(ReasonCode::TOPIC_FILTER_INVALID);
        };
        let readable = parsed.filter.unwrap_or(&stream.config.filter);
        if broker.checks_access()
            && !broker
                .may(&self.c.session, readable, Action::Subscribe)
                .await
        {
            tracing::debug!(%client_id, filter = %f.filter, "SUBSCRIBE to a stream not authorized");
            return Err(ReasonCode::NOT_AUTHORIZED);
        }
        let at = match parsed.at {
            Some(at) => at,
            None => match properties
                .user_properties
                .iter()
                .rev()
                .find(|(k, _)| k == OFFSET_PROPERTY)
            {
                Some((_, v)) => StartAt::parse(v).map_err(|e| {
                    tracing::debug!(%client_id, filter = %f.filter, "SUBSCRIBE to a stream refused: {e}");
                    ReasonCode::IMPLEMENTATION_SPECIFIC_ERROR
                })?,
                None => StartAt::Latest,
            },
        };
        let max_qos = QoS::from_u8(broker.config.server.max_qos).unwrap_or(QoS::ExactlyOnce);
        let mut options = f.options;
        options.qos = options.qos.min(max_qos);
        let (from, from_time_ms) = stream.resolve(at);
        Ok(crate::broker::ReaderStart {
            from,
            from_time_ms,
            stream: Arc::clone(&stream),
            filter: f.filter.clone(),
            sub_filter: parsed.filter.map(str::to_string),
            granted: Granted {
                options,
                identifier,
            },
        })
    }

    fn filter_failure(&self, rc: ReasonCode) -> ReasonCode {
        if self.c.version.is_v5() {
            rc
        } else {
            ReasonCode::UNSPECIFIED_ERROR
        }
    }

    fn on_unsubscribe(&mut self, u: Unsubscribe) {
        let mut removed = self.c.broker.events.listening().then(Vec::new);
        let codes = u
            .filters
            .iter()
            .map(|f| {
                let existed = if f.starts_with(crate::streams::STREAM_PREFIX) {
                    self.c.broker.streams.stop(&self.c.session.client_id, f)
                } else {
                    self.c
                        .broker
                        .unsubscribe(&self.c.session, &super::mounted(self.c.mount(), f))
                };
                if existed {
                    if let Some(list) = &mut removed {
                        list.push(f.clone());
                    }
                    ReasonCode::SUCCESS
                } else {
                    ReasonCode::NO_SUBSCRIPTION_EXISTED
                }
            })
            .collect();
        if let Some(filters) = removed.filter(|l| !l.is_empty()) {
            self.c.broker.events.fire(|| Event::Unsubscribed {
                client_id: self.c.session.client_id.to_string(),
                filters,
            });
        }
        self.send(Packet::UnsubAck(UnsubAck {
            packet_id: u.packet_id,
            reason_codes: codes,
            properties: Properties::default(),
        }));
    }

    fn on_disconnect(&mut self, d: Disconnect) -> Close {
        if let Some(expiry) = d.properties.session_expiry_interval {
            let mut st = self.c.session.state.lock();
            if st.expiry_interval() == 0 && expiry != 0 {
                drop(st);
                return self.violation(
                    ReasonCode::PROTOCOL_ERROR,
                    "session expiry set at DISCONNECT after 0 at CONNECT [MQTT-3.14.2-2]",
                );
            }
            st.set_expiry_interval(expiry);
        }
        // Only DISCONNECT with 0x04 keeps the will [MQTT-3.14.4-3].
        let publish_will = d.reason_code == ReasonCode::DISCONNECT_WITH_WILL_MESSAGE;
        Close {
            reason: DisconnectReason::ClientDisconnect,
            send: None,
            publish_will,
        }
    }
}
