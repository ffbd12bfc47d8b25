//! Bridges: this broker as a client of other brokers (`[[bridges]]`), forwarding `out`
//! topics to the remote and `in` topics from it.
//!
//! - [`queue`]: the outgoing queue, a persistent session of this broker (stored like any);
//! - [`remote`]: the connection to the remote broker on the project's own codec, TCP or TLS;
//! - [`topics`]: topic rules and prefixes; [`backoff`]: the pause between attempts;
//! - this module: one task per bridge (connect, fail over, forward both ways, state), the
//!   set of running bridges and their reload.
//!
//! State: `$SYS/broker/connection/<client_id>/state` is `1` while connected and `0`
//! otherwise, retained, locally (in memory, as every `$SYS` value) and, with notifications,
//! on the remote too, where `0` is also the bridge's will.

pub(crate) mod backoff;
pub(crate) mod queue;
pub(crate) mod remote;
pub(crate) mod topics;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::auth::FileError;
use crate::broker::{message_of, BrokerState};
use crate::cluster_qos::{Gate, Outcome};
use crate::codec::{
    self, Disconnect, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, ReasonCode,
    Subscribe, SubscribeFilter, SubscriptionOptions,
};
use crate::config::{BridgeConfig, BridgeProtocol};
use crate::credentials;
use crate::message::Message;
use crate::session::{QueueLimits, Session};

use backoff::Backoff;
use queue::{Outgoing, Sender};
use remote::Remote;
use topics::TopicMap;

pub use crate::bridge_status::BridgeInfo;
pub(crate) use crate::bridge_status::BridgeStatus;
pub use queue::HOP_PROPERTY;

/// What [`Bridges::reload`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BridgeReload {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub restarted: Vec<String>,
    pub unchanged: Vec<String>,
}

/// Why a bridge task stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Run,
    /// Broker shutdown, or a changed configuration: the session (queue) is kept.
    Keep,
    /// Removed from the configuration: the session and its queue end.
    Remove,
}

struct Running {
    cfg: BridgeConfig,
    stop: watch::Sender<Stop>,
    task: JoinHandle<()>,
}

/// The running bridges of one broker.
pub(crate) struct Bridges {
    broker: Arc<BrokerState>,
    running: tokio::sync::Mutex<HashMap<String, Running>>,
}

impl Bridges {
    pub(crate) fn new(broker: Arc<BrokerState>) -> Bridges {
        Bridges {
            broker,
            running: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Checks the TLS files and password files of every bridge (what start and reload
    /// would load).
    pub(crate) fn check(configs: &[BridgeConfig]) -> Result<(), FileError> {
        for c in configs {
            remote::tls_connector(c)?;
            credentials::with_bridge_password(c)?;
        }
        Ok(())
    }

    /// Starts every configured bridge, and ends the stored sessions of bridges no longer
    /// configured (their queues would otherwise grow forever).
    pub(crate) async fn start(&self, configs: &[BridgeConfig]) -> Result<(), FileError> {
        Self::check(configs)?;
        // Each password_file read once, here: the bridges run with what it held.
        let configs = configs
            .iter()
            .map(credentials::with_bridge_password)
            .collect::<Result<Vec<_>, _>>()?;
        let configs = &configs[..];
        let wanted: HashSet<String> = configs.iter().map(|c| queue::session_id(&c.name)).collect();
        let prefix = queue::session_id("");
        let orphans: Vec<Arc<Session>> = self
            .broker
            .sessions
            .lock()
            .values()
            .filter(|s| s.client_id.starts_with(&prefix) && !wanted.contains(&*s.client_id))
            .cloned()
            .collect();
        for s in orphans {
            tracing::info!(session = %s.client_id, "bridge no longer configured: its queue is deleted");
            self.broker.end_session(&s);
        }
        let mut running = self.running.lock().await;
        for c in configs {
            running.insert(c.name.clone(), self.spawn(c.clone())?);
        }
        Ok(())
    }

    fn spawn(&self, cfg: BridgeConfig) -> Result<Running, FileError> {
        let tls = remote::tls_connector(&cfg)?;
        let status = Arc::new(BridgeStatus::new(&cfg));
        {
            let mut list = self.broker.bridges.lock();
            if let Some(old) = list.iter().find(|s| s.name == cfg.name) {
                status.carry_counters(old);
            }
            list.retain(|s| s.name != cfg.name);
            list.push(Arc::clone(&status));
        }
        let (stop, stop_rx) = watch::channel(Stop::Run);
        let task = Task {
            broker: Arc::clone(&self.broker),
            map: TopicMap::new(&cfg.topics),
            cfg: cfg.clone(),
            tls,
            status,
            stop: stop_rx,
        };
        let task = tokio::spawn(task.run());
        Ok(Running { cfg, stop, task })
    }

    /// Applies a new list: added bridges start, removed ones stop (their queue deleted),
    /// changed ones restart (their queue kept); the others go on untouched. A bridge whose
    /// TLS files cannot be loaded is left as it was, and reported.
    pub(crate) async fn reload(&self, configs: &[BridgeConfig]) -> (BridgeReload, Vec<FileError>) {
        let mut report = BridgeReload::default();
        let mut errors = Vec::new();
        let mut running = self.running.lock().await;
        let names: Vec<String> = running.keys().cloned().collect();
        for name in names {
            if configs.iter().any(|c| c.name == name) {
                continue;
            }
            if let Some(r) = running.remove(&name) {
                let _ = r.stop.send(Stop::Remove);
                let _ = r.task.await;
                self.broker.bridges.lock().retain(|s| s.name != name);
                report.removed.push(name);
            }
        }
        for c in configs {
            // The password file read again: a changed password restarts the bridge.
            let c = &match credentials::with_bridge_password(c) {
                Ok(c) => c,
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            match running.get(&c.name) {
                Some(r) if r.cfg == *c => report.unchanged.push(c.name.clone()),
                Some(_) => {
                    if let Err(e) = remote::tls_connector(c) {
                        errors.push(e);
                        continue;
                    }
                    if let Some(r) = running.remove(&c.name) {
                        let _ = r.stop.send(Stop::Keep);
                        let _ = r.task.await;
                    }
                    match self.spawn(c.clone()) {
                        Ok(r) => {
                            running.insert(c.name.clone(), r);
                            report.restarted.push(c.name.clone());
                        }
                        Err(e) => errors.push(e),
                    }
                }
                None => match self.spawn(c.clone()) {
                    Ok(r) => {
                        running.insert(c.name.clone(), r);
                        report.added.push(c.name.clone());
                    }
                    Err(e) => errors.push(e),
                },
            }
        }
        (report, errors)
    }

    /// Stops every bridge (broker shutdown): state 0 on the remote, DISCONNECT, queues kept.
    pub(crate) async fn stop_all(&self) {
        let mut running = self.running.lock().await;
        for (_, r) in running.drain() {
            let _ = r.stop.send(Stop::Keep);
            if tokio::time::timeout(Duration::from_secs(2), r.task)
                .await
                .is_err()
            {
                tracing::warn!("bridge did not stop within 2 s");
            }
        }
    }
}

/// Resolves when the bridge is to stop: told so, its handle gone (the broker's handles were
/// dropped), or its session's link killed (shutdown, storage failure).
async fn stopped(stop: &mut watch::Receiver<Stop>, link: &crate::link::Link) -> Stop {
    loop {
        let now = *stop.borrow_and_update();
        if now != Stop::Run {
            return now;
        }
        tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() {
                    return Stop::Keep;
                }
            }
            _ = link.wait_killed() => return Stop::Keep,
        }
    }
}

/// The limits of a bridge's queue: `[server]`'s, with the bridge's `max_queued_messages`
/// and `max_queued_bytes` (0: unlimited) in place of the broker-wide ones.
fn queue_limits(server: &crate::config::ServerConfig, cfg: &BridgeConfig) -> QueueLimits {
    let mut server = server.clone();
    server.max_queued_messages = match cfg.max_queued_messages {
        0 => usize::MAX,
        n => n,
    };
    server.max_queued_bytes = cfg.max_queued_bytes;
    QueueLimits::new(&server)
}

/// How long a connection must stay up before the pause between attempts starts again from
/// the shortest (and a lost connection is logged as a warning again): 30 s, the longest pause.
const STABLE_LINK: Duration = Backoff::MAX;

/// How one connection to the remote ended.
enum Ended {
    Stop(Stop),
    Lost(String),
}

/// One bridge's task.
struct Task {
    broker: Arc<BrokerState>,
    cfg: BridgeConfig,
    map: TopicMap,
    tls: Option<tokio_rustls::TlsConnector>,
    status: Arc<BridgeStatus>,
    stop: watch::Receiver<Stop>,
}

impl Task {
    async fn run(mut self) {
        if self.cfg.addresses.is_empty() {
            tracing::error!(bridge = %self.cfg.name, "bridge without addresses: not started");
            return;
        }
        if self.cfg.protocol_version == crate::config::BridgeProtocol::Mqttv311
            && !self.cfg.try_private
            && self
                .cfg
                .topics
                .iter()
                .any(|t| t.direction != crate::config::BridgeDirection::Out)
        {
            // Without the mark a 3.1.1 remote cannot tell the bridge from a client: nothing
            // keeps what it brings in from going back (docs/bridges.md, Loops).
            tracing::warn!(bridge = %self.cfg.name, "try_private = false on an MQTT 3.1.1 bridge that takes messages in: the remote cannot tell it is a bridge, so it may send back what the bridge publishes there, and a remote that also bridges to this broker on the same topics loops messages for ever; keep try_private = true or use protocol_version = \"mqttv5\"");
        }
        if self.cfg.password.is_some() && !self.cfg.tls() {
            tracing::warn!(bridge = %self.cfg.name, "the bridge sends its password without TLS (no cafile): anyone on the way to the remote can read it");
        }
        let out = Outgoing::attach(&self.broker, &self.cfg.name, &self.map);
        out.session
            .state
            .lock()
            .set_own_limits(Some(queue_limits(&self.broker.config.server, &self.cfg)));
        self.status.set_session(Some(Arc::clone(&out.session)));
        self.set_state(false);
        let mut backoff = Backoff::new();
        let mut index = 0usize;
        let mut private =
            self.cfg.try_private && self.cfg.protocol_version == BridgeProtocol::Mqttv311;
        let mut connections = 0u64;
        let mut dropped_at_connect = 0u64;
        let timeout = Duration::from_secs(u64::from(self.cfg.keepalive).clamp(5, 30));
        let mut last_logged: Option<String> = None;
        let max_incoming = self
            .cfg
            .max_incoming_packet(self.broker.config.server.max_packet_size);
        // Connections lost in a row, each (after the first) within STABLE_LINK of being made.
        let mut lost_in_a_row = 0u64;
        let stop = loop {
            let stop = *self.stop.borrow();
            if stop != Stop::Run {
                break stop;
            }
            let address = self.cfg.addresses[index % self.cfg.addresses.len()].clone();
            let attempt = tokio::select! {
                r = Remote::connect(&self.cfg, self.tls.as_ref(), &address, private, timeout, max_incoming) => r,
                stop = stopped(&mut self.stop, &out.link) => break stop,
            };
            let mut remote = match attempt {
                Ok(remote) => remote,
                Err(e) => {
                    if private && remote::refuses_private(&e) {
                        tracing::info!(bridge = %self.cfg.name, %address, "remote refused the bridge protocol level (try_private): connecting as a plain client");
                        private = false;
                        continue;
                    }
                    let line = format!("{address}: {e}");
                    if last_logged.as_deref() != Some(&line) {
                        tracing::warn!(bridge = %self.cfg.name, "cannot connect to {line}");
                        last_logged = Some(line.clone());
                    }
                    *self.status.last_error.lock() = Some(line);
                    index += 1;
                    let delay = if index.is_multiple_of(self.cfg.addresses.len()) {
                        backoff.next_delay()
                    } else {
                        Duration::ZERO
                    };
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        stop = stopped(&mut self.stop, &out.link) => break stop,
                    }
                    continue;
                }
            };
            connections += 1;
            if connections > 1 {
                self.status.reconnects.fetch_add(1, Ordering::Relaxed);
            }
            // Retained messages: in step again after a start (QoS 0 ones were not stored) or
            // after the queue dropped messages while the link was down.
            let dropped = out.dropped();
            if connections == 1 || dropped > dropped_at_connect {
                let n = out.enqueue_retained(&self.broker, &self.map);
                tracing::debug!(bridge = %self.cfg.name, retained = n, "retained messages queued for the remote");
            }
            dropped_at_connect = dropped;
            last_logged = None;
            if !remote.connack.session_present {
                // A new session on the remote: nothing it sent before comes again, so the
                // QoS 2 identifiers awaiting its PUBREL are free for new messages.
                let id = &out.session.client_id;
                let mut st = out.session.state.lock();
                for packet_id in st.inbound_qos2_ids() {
                    st.release_qos2(id, packet_id);
                }
            }
            if lost_in_a_row <= 1 {
                tracing::info!(bridge = %self.cfg.name, %address, session_present = remote.connack.session_present, "bridge connected");
            } else {
                tracing::debug!(bridge = %self.cfg.name, %address, lost_in_a_row, "bridge connected");
            }
            let connected_at = Instant::now();
            *self.status.address.lock() = Some(address.clone());
            *self.status.since.lock() = Some(connected_at);
            self.status.connected.store(true, Ordering::Relaxed);
            self.set_state(true);
            let ended = self.serve(&mut remote, &out).await;
            self.status.connected.store(false, Ordering::Relaxed);
            *self.status.since.lock() = None;
            out.unsent();
            self.set_state(false);
            if remote.too_large {
                self.status.too_large.fetch_add(1, Ordering::Relaxed);
                if remote.version.is_v5() {
                    // MQTT 5.0 section 4.13: DISCONNECT 0x95 (Packet too large), then close.
                    let mut buf = BytesMut::new();
                    let _ = codec::encode(
                        &Packet::Disconnect(Disconnect {
                            reason_code: ReasonCode::PACKET_TOO_LARGE,
                            properties: Properties::default(),
                        }),
                        remote.version,
                        &mut buf,
                    );
                    let _ = tokio::time::timeout(Duration::from_secs(1), remote.write(&buf)).await;
                }
            }
            match ended {
                Ended::Stop(stop) => {
                    self.goodbye(&mut remote, &out).await;
                    break stop;
                }
                Ended::Lost(why) => {
                    // The pause starts again from the shortest only after a link that
                    // stayed up for STABLE_LINK: a remote that accepts the bridge and then
                    // drops it is retried ever more slowly, as one that refuses it is.
                    if connected_at.elapsed() >= STABLE_LINK {
                        backoff.reset();
                        lost_in_a_row = 0;
                    }
                    lost_in_a_row += 1;
                    if lost_in_a_row == 1 {
                        tracing::warn!(bridge = %self.cfg.name, %address, "bridge connection lost: {why}");
                    } else if [10, 100, 1000, 10_000].contains(&lost_in_a_row) {
                        tracing::warn!(bridge = %self.cfg.name, %address, lost_in_a_row, "bridge connection lost {lost_in_a_row} times in a row, each within {} s of connecting: {why}", STABLE_LINK.as_secs());
                    } else {
                        // Lost again soon after connecting: one warning, then the count.
                        tracing::debug!(bridge = %self.cfg.name, %address, lost_in_a_row, "bridge connection lost again within {} s of connecting: {why}", STABLE_LINK.as_secs());
                    }
                    *self.status.last_error.lock() = Some(format!("{address}: {why}"));
                    if self.cfg.round_robin {
                        index += 1;
                    } else {
                        index = 0;
                    }
                    let delay = backoff.next_delay();
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        stop = stopped(&mut self.stop, &out.link) => break stop,
                    }
                }
            }
        };
        match stop {
            Stop::Remove => out.end(&self.broker),
            _ => out.detach(),
        }
        self.status.set_session(None);
        self.set_state(false);
    }

    /// The local state topic, and the remote's when notifications are on (done by the
    /// caller for the remote).
    fn set_state(&self, connected: bool) {
        self.broker.publish_sys(Message::broker_retained(
            self.cfg.state_topic(),
            Bytes::from_static(if connected { b"1" } else { b"0" }),
        ));
    }

    /// On a stop while connected: the state 0 on the remote, then DISCONNECT (the will is
    /// then not published; the state says the same).
    async fn goodbye(&self, remote: &mut Remote, out: &Outgoing) {
        let mut buf = BytesMut::new();
        if self.cfg.notifications {
            self.state_publish(remote.version, out, false, &mut buf);
        }
        let _ = codec::encode(
            &Packet::Disconnect(Disconnect {
                reason_code: ReasonCode::SUCCESS,
                properties: Properties::default(),
            }),
            remote.version,
            &mut buf,
        );
        let _ = tokio::time::timeout(Duration::from_secs(1), remote.write(&buf)).await;
    }

    fn state_publish(
        &self,
        version: ProtocolVersion,
        out: &Outgoing,
        up: bool,
        buf: &mut BytesMut,
    ) {
        let packet_id = out.session.state.lock().allocate_packet_id().unwrap_or(1);
        let _ = codec::encode(
            &Packet::Publish(Publish {
                dup: false,
                qos: QoS::AtLeastOnce,
                retain: true,
                topic: self.cfg.remote_state_topic(),
                packet_id,
                properties: Properties::default(),
                payload: Bytes::from_static(if up { b"1" } else { b"0" }),
            }),
            version,
            buf,
        );
    }

    /// One connection: state, subscriptions, then forwarding both ways until it ends.
    async fn serve(&mut self, remote: &mut Remote, out: &Outgoing) -> Ended {
        let version = remote.version;
        let mut buf = BytesMut::with_capacity(64 * 1024);
        if self.cfg.notifications {
            self.state_publish(version, out, true, &mut buf);
        }
        let subscriptions = self.map.remote_subscriptions();
        if !subscriptions.is_empty() {
            let packet_id = out.session.state.lock().allocate_packet_id().unwrap_or(1);
            let subscribe = Subscribe {
                packet_id,
                filters: subscriptions
                    .into_iter()
                    .map(|(filter, qos)| SubscribeFilter {
                        filter,
                        options: SubscriptionOptions {
                            qos,
                            // Never our own messages back [MQTT-3.8.3-3], with the RETAIN
                            // flag they were published with [MQTT-3.3.1-12].
                            no_local: true,
                            retain_as_published: true,
                            retain_handling: 0,
                        },
                    })
                    .collect(),
                properties: Properties::default(),
            };
            if let Err(e) = codec::encode(&Packet::Subscribe(subscribe), version, &mut buf) {
                return Ended::Lost(format!("SUBSCRIBE: {e}"));
            }
        }
        let window = usize::from(remote.receive_maximum())
            .min(usize::from(self.cfg.max_inflight))
            .max(1);
        let max_packet_size = remote.maximum_packet_size();
        let keepalive = Duration::from_secs(u64::from(self.cfg.keepalive));
        let mut tick = tokio::time::interval(keepalive);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let mut last_in = Instant::now();
        let hop = self.cfg.remote_client_id().to_string();
        // The local sessions messages from the remote went to that are at their high-water
        // mark, waited for before the remote is read again.
        let mut congested = Vec::new();
        loop {
            {
                let map = &self.map;
                let mut sender = Sender {
                    broker: &self.broker,
                    map,
                    version,
                    window,
                    max_packet_size,
                    hop: &hop,
                };
                let sent0 = out.fill(&mut sender, &mut buf);
                if sent0 > 0 {
                    self.status
                        .forwarded_out
                        .fetch_add(sent0, Ordering::Relaxed);
                }
            }
            if !buf.is_empty() {
                match tokio::time::timeout(keepalive, remote.write(&buf)).await {
                    Ok(Ok(())) => buf.clear(),
                    Ok(Err(e)) => return Ended::Lost(format!("write: {e}")),
                    Err(_) => return Ended::Lost("write blocked for a keep alive period".into()),
                }
            }
            let packet = tokio::select! {
                biased;
                stop = stopped(&mut self.stop, &out.link) => return Ended::Stop(stop),
                p = remote.read() => match p {
                    Ok(p) => Some(p),
                    Err(e) => return Ended::Lost(e.to_string()),
                },
                _ = out.link.wait_woken() => None,
                _ = tick.tick() => {
                    if last_in.elapsed() >= keepalive + keepalive / 2 {
                        return Ended::Lost("no answer within 1.5 keep alive periods".into());
                    }
                    let _ = codec::encode(&Packet::PingReq, version, &mut buf);
                    None
                }
            };
            let Some(mut packet) = packet else { continue };
            last_in = Instant::now();
            // Everything already buffered, then one fill and one write.
            let mut published = false;
            loop {
                // A PUBREL's release, like a message, is stored before its PUBCOMP goes.
                published |= matches!(packet, Packet::Publish(_) | Packet::PubRel(_));
                if let Err(why) = self
                    .on_packet(packet, out, version, &mut buf, &mut congested)
                    .await
                {
                    return Ended::Lost(why);
                }
                if !congested.is_empty() {
                    // Back pressure: the rest waits in the buffer, read after the wait.
                    break;
                }
                match remote.buffered() {
                    Ok(Some(p)) => packet = p,
                    Ok(None) => break,
                    Err(e) => return Ended::Lost(e.to_string()),
                }
            }
            // Messages from the remote: with durable_ack, acknowledged once stored, as a
            // client's are. Then the entry's back pressure (ARCHITECTURE.md, "One entry for
            // every message"): nothing more is read from the remote while a local session
            // these messages went to is over its high-water mark and its client takes
            // messages, nor while storage is too far behind.
            if published {
                let persist = self.broker.persist.get();
                if persist.is_some_and(|p| p.durable_ack())
                    || !congested.is_empty()
                    || self.broker.memory_congested()
                {
                    if let Some(p) = persist.filter(|p| p.durable_ack()) {
                        p.flush().await;
                    }
                    if !buf.is_empty() {
                        if let Err(e) = remote.write(&buf).await {
                            return Ended::Lost(format!("write: {e}"));
                        }
                        buf.clear();
                    }
                }
                self.broker
                    .wait_congested(Some(&out.session), &mut congested)
                    .await;
                if let Some(p) = persist {
                    p.wait_room(&out.session.client_id).await;
                }
            }
        }
    }

    async fn on_packet(
        &mut self,
        packet: Packet,
        out: &Outgoing,
        version: ProtocolVersion,
        buf: &mut BytesMut,
        congested: &mut Vec<Arc<Session>>,
    ) -> Result<(), String> {
        let ack = |p: fn(PubAck) -> Packet, packet_id: u16, buf: &mut BytesMut| {
            let _ = codec::encode(
                &p(PubAck {
                    packet_id,
                    ..PubAck::default()
                }),
                version,
                buf,
            );
        };
        match packet {
            Packet::PubAck(a) | Packet::PubComp(a) => {
                if out.acknowledged(&self.broker, a.packet_id) {
                    self.status.forwarded_out.fetch_add(1, Ordering::Relaxed);
                }
            }
            Packet::PubRec(a) => {
                if a.reason_code.0 >= 0x80 {
                    // Refused by the remote: the exchange ends there (5.0 section 4.3.3).
                    out.refused(a.packet_id);
                } else {
                    out.received(a.packet_id);
                    ack(Packet::PubRel, a.packet_id, buf);
                }
            }
            Packet::Publish(p) => {
                let (qos, packet_id) = (p.qos, p.packet_id);
                // The QoS 2 identifiers awaiting PUBREL are kept in the bridge's session,
                // stored as a client's are: a PUBLISH sent again after a restart of this
                // broker is recognised, and not delivered twice (MQTT 5.0 section 4.3.3).
                let duplicate =
                    qos == QoS::ExactlyOnce && out.session.state.lock().awaits_release(packet_id);
                let id = &out.session.client_id;
                let mut reason_code = ReasonCode::SUCCESS;
                let gate = if duplicate {
                    // Its first copy may still wait for JetStream: so does this answer.
                    self.broker.cluster_qos.receipt(id, packet_id)
                } else {
                    let gate;
                    (reason_code, gate) = self.publish_locally(p, &out.session, congested).await;
                    // No PUBREL follows a refusing PUBREC (5.0 section 4.3.3): nothing to keep.
                    if qos == QoS::ExactlyOnce && reason_code.0 < 0x80 {
                        out.session.state.lock().receive_qos2(id, packet_id);
                        if let Some(g) = &gate {
                            self.broker.cluster_qos.await_receipt(id, packet_id, g);
                        }
                    }
                    gate
                };
                // Another node wants it: answered once JetStream holds it, as a client's
                // PUBLISH is (docs/cluster.md, "QoS across nodes"); the remote is not read
                // meanwhile.
                if let Some(gate) = gate {
                    match gate.wait().await {
                        Outcome::Held => {}
                        // Ended unanswered: the remote sends it again once connected again.
                        Outcome::TimedOut => {
                            return Err("JetStream did not take a message for another node \
                                        within jetstream_ack_timeout (NATS or JetStream \
                                        unavailable?)"
                                .into())
                        }
                        // Never to be carried: as a client's PUBLISH, 0x83 for 5.0.
                        Outcome::Refused if version.is_v5() => {
                            reason_code = ReasonCode::IMPLEMENTATION_SPECIFIC_ERROR;
                            if qos == QoS::ExactlyOnce {
                                out.session.state.lock().release_qos2(id, packet_id);
                            }
                        }
                        Outcome::Refused => {}
                    }
                }
                // A refusal is told to an MQTT 5 remote (3.x has no way to say it).
                let answer = |packet_id| PubAck {
                    packet_id,
                    reason_code: if version.is_v5() {
                        reason_code
                    } else {
                        ReasonCode::SUCCESS
                    },
                    ..PubAck::default()
                };
                match qos {
                    QoS::AtMostOnce => {}
                    QoS::AtLeastOnce => {
                        let _ = codec::encode(&Packet::PubAck(answer(packet_id)), version, buf);
                    }
                    QoS::ExactlyOnce => {
                        let _ = codec::encode(&Packet::PubRec(answer(packet_id)), version, buf);
                    }
                }
            }
            Packet::PubRel(a) => {
                let id = &out.session.client_id;
                out.session.state.lock().release_qos2(id, a.packet_id);
                ack(Packet::PubComp, a.packet_id, buf);
            }
            Packet::SubAck(s) => {
                for (rc, (filter, _)) in s.reason_codes.iter().zip(self.map.remote_subscriptions())
                {
                    if rc.0 >= 0x80 {
                        tracing::warn!(bridge = %self.cfg.name, %filter, "the remote refused the subscription: {rc:?}");
                    }
                }
            }
            Packet::PingResp | Packet::UnsubAck(_) => {}
            Packet::Disconnect(d) => {
                return Err(format!("DISCONNECT from the remote: {:?}", d.reason_code));
            }
            other => return Err(format!("unexpected {} from the remote", other.name())),
        }
        Ok(())
    }

    /// A message from the remote, published here under its local topic as the bridge's
    /// session, marked as bridged, through the entry every message takes (ARCHITECTURE.md,
    /// "One entry for every message"): the publish interceptors, then routing; the sessions
    /// now at their high-water mark are added to `congested`, waited for by the caller
    /// before the remote is read again. Returns the reason code of a refusal (else success),
    /// and the gate of its hand-off to JetStream when another node wants it at QoS 1 or 2.
    async fn publish_locally(
        &self,
        mut p: Publish,
        session: &Session,
        congested: &mut Vec<Arc<Session>>,
    ) -> (ReasonCode, Option<Arc<Gate>>) {
        let Some((topic, _)) = self.map.incoming(&p.topic) else {
            tracing::debug!(bridge = %self.cfg.name, topic = %p.topic, "message from the remote matches no in rule: dropped");
            return (ReasonCode::SUCCESS, None);
        };
        if topic.starts_with("$SYS") {
            return (ReasonCode::SUCCESS, None);
        }
        if queue::is_bridged(&p.properties) {
            // It crossed a bridge into the remote already: in a mesh, it reaches this broker
            // over the link from where it was published.
            return (ReasonCode::SUCCESS, None);
        }
        p.topic = topic;
        if let Err(rc) = self.broker.admit(Some(session), &mut p).await {
            // A panicking interceptor (logged) loses the message: 0x80 Unspecified error.
            let rc = rc.unwrap_or(ReasonCode::UNSPECIFIED_ERROR);
            tracing::debug!(bridge = %self.cfg.name, topic = %p.topic, reason = %rc, "message from the remote refused");
            return (rc, None);
        }
        p.properties.user_properties.push((
            HOP_PROPERTY.to_string(),
            self.cfg.remote_client_id().to_string(),
        ));
        let msg = message_of(p, Some(Arc::clone(&session.client_id)));
        let (_, gate) = self.broker.publish_gated(Arc::new(msg), congested);
        self.status.forwarded_in.fetch_add(1, Ordering::Relaxed);
        (ReasonCode::SUCCESS, gate)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::config::{BridgeConfig, BridgeDirection, BridgeProtocol, BridgeTopic};

    /// A bridge configuration for unit tests.
    pub(crate) fn example() -> BridgeConfig {
        BridgeConfig {
            name: "b".into(),
            addresses: vec!["localhost:1883".into()],
            round_robin: false,
            client_id: None,
            protocol_version: BridgeProtocol::Mqttv311,
            clean_start: false,
            keepalive: 60,
            max_inflight: 100,
            username: None,
            password: None,
            password_file: None,
            cafile: None,
            certfile: None,
            keyfile: None,
            tls_server_name: None,
            try_private: true,
            notifications: true,
            notification_topic: None,
            max_queued_messages: crate::config::DEFAULT_BRIDGE_QUEUED_MESSAGES,
            max_queued_bytes: crate::config::DEFAULT_BRIDGE_QUEUED_BYTES,
            max_packet_size: None,
            topics: vec![BridgeTopic {
                pattern: "a/#".into(),
                direction: BridgeDirection::Out,
                qos: 1,
                local_prefix: String::new(),
                remote_prefix: String::new(),
            }],
        }
    }
}
