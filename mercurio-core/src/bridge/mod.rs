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
use crate::codec::{
    self, Disconnect, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, ReasonCode,
    Subscribe, SubscribeFilter, SubscriptionOptions,
};
use crate::config::{BridgeConfig, BridgeProtocol};
use crate::message::Message;
use crate::session::Session;

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

    /// Checks the TLS files of every bridge (what start and reload would load).
    pub(crate) fn check(configs: &[BridgeConfig]) -> Result<(), FileError> {
        for c in configs {
            remote::tls_connector(c)?;
        }
        Ok(())
    }

    /// Starts every configured bridge, and ends the stored sessions of bridges no longer
    /// configured (their queues would otherwise grow forever).
    pub(crate) async fn start(&self, configs: &[BridgeConfig]) -> Result<(), FileError> {
        Self::check(configs)?;
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
            inbound_qos2: HashSet::new(),
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
    /// QoS 2 packet identifiers from the remote awaiting PUBREL.
    inbound_qos2: HashSet<u16>,
}

impl Task {
    async fn run(mut self) {
        if self.cfg.addresses.is_empty() {
            tracing::error!(bridge = %self.cfg.name, "bridge without addresses: not started");
            return;
        }
        let out = Outgoing::attach(&self.broker, &self.cfg.name, &self.map);
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
        let stop = loop {
            let stop = *self.stop.borrow();
            if stop != Stop::Run {
                break stop;
            }
            let address = self.cfg.addresses[index % self.cfg.addresses.len()].clone();
            let attempt = tokio::select! {
                r = Remote::connect(&self.cfg, self.tls.as_ref(), &address, private, timeout) => r,
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
            backoff.reset();
            tracing::info!(bridge = %self.cfg.name, %address, session_present = remote.connack.session_present, "bridge connected");
            *self.status.address.lock() = Some(address.clone());
            *self.status.since.lock() = Some(Instant::now());
            self.status.connected.store(true, Ordering::Relaxed);
            self.set_state(true);
            let ended = self.serve(&mut remote, &out).await;
            self.status.connected.store(false, Ordering::Relaxed);
            *self.status.since.lock() = None;
            out.unsent();
            self.set_state(false);
            match ended {
                Ended::Stop(stop) => {
                    self.goodbye(&mut remote, &out).await;
                    break stop;
                }
                Ended::Lost(why) => {
                    tracing::warn!(bridge = %self.cfg.name, %address, "bridge connection lost: {why}");
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
        self.broker.publish_sys(Message {
            topic: self.cfg.state_topic(),
            payload: Bytes::from_static(if connected { b"1" } else { b"0" }),
            qos: QoS::AtMostOnce,
            retain: true,
            properties: Properties::default(),
            expires_at: None,
            publisher: None,
            encoded: Default::default(),
        });
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
                published |= matches!(packet, Packet::Publish(_));
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
                if persist.is_some_and(|p| p.durable_ack()) || !congested.is_empty() {
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
                if out.acknowledged(a.packet_id) {
                    self.status.forwarded_out.fetch_add(1, Ordering::Relaxed);
                }
            }
            Packet::PubRec(a) => {
                if a.reason_code.0 >= 0x80 {
                    // Refused by the remote: the exchange ends there (5.0 section 4.3.3).
                    out.acknowledged(a.packet_id);
                } else {
                    out.received(a.packet_id);
                    ack(Packet::PubRel, a.packet_id, buf);
                }
            }
            Packet::Publish(p) => {
                let (qos, packet_id) = (p.qos, p.packet_id);
                let duplicate = qos == QoS::ExactlyOnce && !self.inbound_qos2.insert(packet_id);
                let mut reason_code = ReasonCode::SUCCESS;
                if !duplicate {
                    reason_code = self.publish_locally(p, &out.session, congested).await;
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
                        if reason_code.0 >= 0x80 {
                            // No PUBREL follows a refusing PUBREC (5.0 section 4.3.3).
                            self.inbound_qos2.remove(&packet_id);
                        }
                        let _ = codec::encode(&Packet::PubRec(answer(packet_id)), version, buf);
                    }
                }
            }
            Packet::PubRel(a) => {
                self.inbound_qos2.remove(&a.packet_id);
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
    /// before the remote is read again. Returns the reason code of a refusal (else success).
    async fn publish_locally(
        &self,
        mut p: Publish,
        session: &Session,
        congested: &mut Vec<Arc<Session>>,
    ) -> ReasonCode {
        let Some((topic, _)) = self.map.incoming(&p.topic) else {
            tracing::debug!(bridge = %self.cfg.name, topic = %p.topic, "message from the remote matches no in rule: dropped");
            return ReasonCode::SUCCESS;
        };
        if topic.starts_with("$SYS") {
            return ReasonCode::SUCCESS;
        }
        if queue::is_bridged(&p.properties) {
            // It crossed a bridge into the remote already: in a mesh, it reaches this broker
            // over the link from where it was published.
            return ReasonCode::SUCCESS;
        }
        p.topic = topic;
        if let Err(rc) = self.broker.admit(Some(session), &mut p).await {
            tracing::debug!(bridge = %self.cfg.name, topic = %p.topic, reason = %rc, "message from the remote refused");
            return rc;
        }
        p.properties.user_properties.push((
            HOP_PROPERTY.to_string(),
            self.cfg.remote_client_id().to_string(),
        ));
        let msg = message_of(p, Some(Arc::clone(&session.client_id)));
        self.broker.publish_from(Arc::new(msg), congested);
        self.status.forwarded_in.fetch_add(1, Ordering::Relaxed);
        ReasonCode::SUCCESS
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
            cafile: None,
            certfile: None,
            keyfile: None,
            tls_server_name: None,
            try_private: true,
            notifications: true,
            notification_topic: None,
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
