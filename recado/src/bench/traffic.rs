//! The traffic scenarios: publishers and subscribers, run for a bounded time and count, with
//! every message stamped (send time, publisher, sequence number) so that the subscribers
//! measure end-to-end latency, loss, duplicates and reordering.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use mercurio_core::codec::{self, Packet, ProtocolVersion, PubAck, PublishRef, QoS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{watch, Notify};

use super::client::{self, Client, ConnectOptions};
use super::hist::Histogram;
use super::tracker::Tracker;

/// Bytes at the start of each payload: send time (ns, u64), publisher (u32), sequence (u64).
pub const STAMP: usize = 20;

/// Messages encoded into one write at most.
const BATCH: u64 = 64;

/// Settings shared by every connection of a run.
#[derive(Clone)]
pub struct RunConfig {
    pub target: client::Target,
    pub version: ProtocolVersion,
    pub qos: QoS,
    pub payload: usize,
    /// Publishing time.
    pub duration: Duration,
    /// Most messages per publisher.
    pub max_messages: u64,
    /// Total offered publish rate (messages/s over all publishers); 0 = open loop.
    pub rate: f64,
    /// QoS 1/2 messages a publisher keeps unacknowledged at most.
    pub inflight: u16,
    /// Longest wait for the last deliveries after publishing stops.
    pub drain: Duration,
    /// Give up waiting for deliveries after this long without any.
    pub quiet: Duration,
    pub keep_alive: u16,
    /// Unique per run: goes into client identifiers and topics.
    pub token: String,
}

/// The clock and counters every task of a run shares.
pub struct Shared {
    pub epoch: Instant,
    pub delivered: AtomicU64,
    pub last_delivery_ns: AtomicU64,
}

impl Shared {
    pub fn new() -> Arc<Shared> {
        Arc::new(Shared {
            epoch: Instant::now(),
            delivered: AtomicU64::new(0),
            last_delivery_ns: AtomicU64::new(0),
        })
    }

    /// Nanoseconds since `epoch`: the time stamp of the payloads.
    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }
}

/// What a subscriber saw.
#[derive(Default)]
pub struct SubResult {
    pub latency: Histogram,
    pub tracker: Tracker,
    pub error: Option<String>,
}

/// What a publisher did.
#[derive(Default, Clone)]
pub struct PubResult {
    pub sent: u64,
    /// Acknowledged (PUBACK, or PUBCOMP for QoS 2); equals `sent` for QoS 0.
    pub completed: u64,
    pub first_ns: u64,
    pub last_ns: u64,
    pub error: Option<String>,
}

/// A subscriber's read loop over a connected client: parses PUBLISHes in place, answers
/// PUBACK / PUBREC / PUBCOMP (batched, one write per read), stops on `stop`.
pub async fn subscribe_loop(
    mut c: Client,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    mut result: SubResult,
) -> SubResult {
    let version = c.version;
    let mut out = BytesMut::with_capacity(16 * 1024);
    let (stream, rbuf) = c.conn.parts_mut();
    rbuf.reserve(256 * 1024);
    let err = loop {
        // Whatever is buffered (first: what the handshake left) is processed, then read more.
        {
            let now = shared.now_ns();
            let mut new = 0u64;
            let mut off = 0;
            loop {
                let frame_len = match codec::check_frame(&rbuf[off..], client::MAX_PACKET) {
                    Ok(Some(n)) => n,
                    Ok(None) => break,
                    Err(e) => return fail(result, format!("subscriber: {e}")),
                };
                let frame = &rbuf[off..off + frame_len];
                off += frame_len;
                if let Some(p) = client::parse_publish(frame, version) {
                    if p.payload.len() >= STAMP {
                        let mut s = p.payload;
                        let ts = s.get_u64_le();
                        let publisher = s.get_u32_le();
                        let seq = s.get_u64_le();
                        if result.tracker.mark(publisher, seq) {
                            new += 1;
                            result.latency.record(now.saturating_sub(ts));
                        }
                    }
                    let ack = PubAck {
                        packet_id: p.packet_id,
                        ..Default::default()
                    };
                    let ack = match p.qos {
                        1 => Some(Packet::PubAck(ack)),
                        2 => Some(Packet::PubRec(ack)),
                        _ => None,
                    };
                    if let Some(ack) = ack {
                        let _ = codec::encode(&ack, version, &mut out);
                    }
                    continue;
                }
                match codec::decode_packet(frame, version) {
                    Ok(Packet::PubRel(rel)) => {
                        let comp = PubAck {
                            packet_id: rel.packet_id,
                            ..Default::default()
                        };
                        let _ = codec::encode(&Packet::PubComp(comp), version, &mut out);
                    }
                    Ok(Packet::Disconnect(d)) => {
                        break_with(
                            &mut result,
                            format!("broker sent DISCONNECT {:?}", d.reason_code),
                        );
                    }
                    Ok(_) => {}
                    Err(e) => return fail(result, format!("subscriber decode: {e}")),
                }
            }
            rbuf.advance(off);
            if new > 0 {
                shared.delivered.fetch_add(new, Ordering::Relaxed);
                shared.last_delivery_ns.fetch_max(now, Ordering::Relaxed);
            }
            if !out.is_empty() {
                if let Err(e) = crate::stream::write_flush(stream, &out).await {
                    break Some(format!("subscriber write: {e}"));
                }
                out.clear();
            }
            if rbuf.capacity() - rbuf.len() < 64 * 1024 {
                rbuf.reserve(256 * 1024);
            }
        }
        tokio::select! {
            biased;
            _ = stop.changed() => break None,
            r = stream.read_buf(rbuf) => match r {
                Ok(0) => break Some("subscriber: connection closed by the broker".to_string()),
                Ok(_) => {}
                Err(e) => break Some(format!("subscriber read: {e}")),
            },
        }
    };
    if let Some(e) = err {
        result.error.get_or_insert(e);
    } else {
        let _ = c.disconnect().await;
    }
    result
}

fn fail(mut r: SubResult, e: String) -> SubResult {
    r.error.get_or_insert(e);
    r
}

fn break_with(r: &mut SubResult, e: String) {
    r.error.get_or_insert(e);
}

/// Connects a subscriber and subscribes it to `filters`.
pub async fn connect_subscriber(
    cfg: &RunConfig,
    client_id: &str,
    filters: &[String],
    clean_start: bool,
) -> io::Result<(Client, bool)> {
    let (mut c, ack) = Client::connect(
        &cfg.target,
        cfg.version,
        &ConnectOptions {
            client_id,
            clean_start,
            keep_alive: cfg.keep_alive,
            session_expiry: if clean_start { 0 } else { 3600 },
        },
    )
    .await?;
    if !filters.is_empty() {
        c.subscribe(filters, cfg.qos).await?;
    }
    Ok((c, ack.session_present))
}

struct AckState {
    free: Vec<u16>,
    pubrel: Vec<u16>,
    completed: u64,
    closed: Option<String>,
}

/// A publisher: connects, then publishes to `topic` at `rate` messages/s (0 = as fast as the
/// broker reads) until `deadline` or `cfg.max_messages`, keeping at most `cfg.inflight`
/// QoS 1/2 messages unacknowledged; then waits (up to `cfg.drain`) for the last
/// acknowledgements.
pub async fn publish(
    cfg: RunConfig,
    c: Client,
    publisher: u32,
    topic: String,
    rate: f64,
    start: Instant,
    shared: Arc<Shared>,
) -> PubResult {
    let version = c.version;
    let qos = cfg.qos;
    let (stream, mut rbuf) = c.conn.into_parts();
    let (mut rd, mut wr) = stream.split();
    let state = Arc::new((
        Mutex::new(AckState {
            free: (1..=cfg.inflight.max(1)).rev().collect(),
            pubrel: Vec::new(),
            completed: 0,
            closed: None,
        }),
        Notify::new(),
    ));
    let reader_state = Arc::clone(&state);
    let reader = tokio::spawn(async move {
        let (st, notify) = &*reader_state;
        loop {
            loop {
                match codec::decode(&mut rbuf, version, client::MAX_PACKET) {
                    Ok(Some(p)) => {
                        let mut s = st.lock().unwrap();
                        match p {
                            Packet::PubAck(a) | Packet::PubComp(a) => {
                                s.free.push(a.packet_id);
                                s.completed += 1;
                            }
                            Packet::PubRec(a) => s.pubrel.push(a.packet_id),
                            Packet::Disconnect(d) => {
                                s.closed =
                                    Some(format!("broker sent DISCONNECT {:?}", d.reason_code))
                            }
                            _ => {}
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        st.lock().unwrap().closed = Some(format!("publisher decode: {e}"));
                        notify.notify_one();
                        return;
                    }
                }
            }
            notify.notify_one();
            match rd.read_buf(&mut rbuf).await {
                Ok(0) | Err(_) => {
                    st.lock()
                        .unwrap()
                        .closed
                        .get_or_insert("connection closed".into());
                    notify.notify_one();
                    return;
                }
                Ok(_) => {}
            }
        }
    });

    let (st, notify) = &*state;
    let mut result = PubResult::default();
    let mut payload = vec![0x5Au8; cfg.payload.max(STAMP)];
    let mut out = BytesMut::with_capacity(256 * 1024);
    let deadline = start + cfg.duration;
    let mut seq: u64 = 0;
    let mut ids: Vec<u16> = Vec::with_capacity(BATCH as usize);
    let mut rels: Vec<u16> = Vec::new();
    result.first_ns = start.saturating_duration_since(shared.epoch).as_nanos() as u64;
    loop {
        let now = Instant::now();
        if now >= deadline || seq >= cfg.max_messages {
            break;
        }
        let mut n = BATCH.min(cfg.max_messages - seq);
        if rate > 0.0 {
            let due = (rate * (now - start).as_secs_f64()) as u64 + 1;
            if seq >= due {
                let at = start + Duration::from_secs_f64(seq as f64 / rate);
                tokio::time::sleep_until(at.min(deadline).into()).await;
                continue;
            }
            n = n.min(due - seq);
        }
        ids.clear();
        rels.clear();
        if qos != QoS::AtMostOnce {
            let closed = {
                let mut s = st.lock().unwrap();
                let take = (n as usize).min(s.free.len());
                let at = s.free.len() - take;
                ids.extend(s.free.drain(at..));
                rels.append(&mut s.pubrel);
                s.closed.clone()
            };
            if let Some(e) = closed {
                result.error = Some(e);
                break;
            }
            if ids.is_empty() && rels.is_empty() {
                let _ = tokio::time::timeout_at(deadline.into(), notify.notified()).await;
                continue;
            }
        }
        for &id in &rels {
            let rel = PubAck {
                packet_id: id,
                ..Default::default()
            };
            let _ = codec::encode(&Packet::PubRel(rel), version, &mut out);
        }
        let count = if qos == QoS::AtMostOnce {
            n as usize
        } else {
            ids.len()
        };
        let ts = shared.now_ns();
        // `count` is not `ids.len()` at QoS 0 (no identifiers are used then).
        #[allow(clippy::needless_range_loop)]
        for i in 0..count {
            seq += 1;
            payload[0..8].copy_from_slice(&ts.to_le_bytes());
            payload[8..12].copy_from_slice(&publisher.to_le_bytes());
            payload[12..20].copy_from_slice(&seq.to_le_bytes());
            let p = PublishRef {
                dup: false,
                qos,
                retain: false,
                topic: &topic,
                packet_id: if qos == QoS::AtMostOnce { 0 } else { ids[i] },
                properties: &Default::default(),
                payload: &payload,
            };
            if let Err(e) = codec::encode_publish(&p, version, &mut out) {
                result.error = Some(format!("encode: {e}"));
                break;
            }
        }
        if let Err(e) = crate::stream::write_flush(&mut wr, &out).await {
            result.error = Some(format!("publisher write: {e}"));
            break;
        }
        out.clear();
    }
    result.sent = seq;
    result.last_ns = shared.now_ns();
    // Wait for the last acknowledgements (answering PUBRECs).
    if qos != QoS::AtMostOnce && result.error.is_none() {
        let until = Instant::now() + cfg.drain;
        loop {
            let done = {
                let mut s = st.lock().unwrap();
                rels.clear();
                rels.append(&mut s.pubrel);
                s.completed >= seq || s.closed.is_some()
            };
            if done {
                break;
            }
            for &id in &rels {
                let rel = PubAck {
                    packet_id: id,
                    ..Default::default()
                };
                let _ = codec::encode(&Packet::PubRel(rel), version, &mut out);
            }
            if !out.is_empty() {
                if crate::stream::write_flush(&mut wr, &out).await.is_err() {
                    break;
                }
                out.clear();
            }
            if tokio::time::timeout_at(until.into(), notify.notified())
                .await
                .is_err()
            {
                break;
            }
        }
    }
    result.completed = if qos == QoS::AtMostOnce {
        seq
    } else {
        st.lock().unwrap().completed
    };
    out.clear();
    let _ = codec::encode(&Packet::Disconnect(Default::default()), version, &mut out);
    let _ = crate::stream::write_flush(&mut wr, &out).await;
    let _ = wr.shutdown().await;
    let _ = tokio::time::timeout(Duration::from_secs(2), reader).await;
    result
}

/// Connects a publisher.
pub async fn connect_publisher(cfg: &RunConfig, client_id: &str) -> io::Result<Client> {
    let (c, _) = Client::connect(
        &cfg.target,
        cfg.version,
        &ConnectOptions {
            client_id,
            clean_start: true,
            keep_alive: cfg.keep_alive,
            session_expiry: 0,
        },
    )
    .await?;
    Ok(c)
}

/// Waits until `expected` deliveries have arrived, or nothing arrived for `quiet`, or
/// `drain` has passed.
pub async fn wait_deliveries(shared: &Shared, expected: u64, drain: Duration, quiet: Duration) {
    let until = Instant::now() + drain;
    let mut last = shared.delivered.load(Ordering::Relaxed);
    let mut last_change = Instant::now();
    loop {
        let now = Instant::now();
        let got = shared.delivered.load(Ordering::Relaxed);
        if got >= expected || now >= until {
            return;
        }
        if got != last {
            last = got;
            last_change = now;
        } else if now - last_change > quiet {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
