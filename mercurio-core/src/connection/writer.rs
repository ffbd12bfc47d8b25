//! The writer: sleeps until its link is woken, then drains the control buffer (the reader's
//! answers), the in-flight messages to resend and the session's queue into one buffer and one
//! write, within the window and the limits the client set.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::{Close, LazyMap, Shared, IDLE_BUFFER_LIMIT};
use crate::broker::drain::{encode_pubrel, Outlet, Unsent, WRITE_CHUNK};
use crate::codec::{self, Properties, ProtocolVersion, PublishRef, QoS};
use crate::link::DisconnectReason;
use crate::session::Delivery;
use crate::stats::Counters;

/// Most topic aliases the broker sets towards a client, whatever its Topic Alias Maximum.
const OUTBOUND_ALIASES: u16 = 100;
/// Longest topic the broker gives an alias to (the alias table holds the topics).
const OUTBOUND_ALIAS_TOPIC: usize = 256;

/// How often a writer held by a lapsed storage lease ([`mercurio_storage::Storage::lapsed`])
/// looks again.
const LAPSED_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// Waits while `storage`'s lease is lapsed ([`mercurio_storage::Storage::lapsed`]).
async fn until_renewed(storage: &dyn mercurio_storage::Storage) {
    while storage.lapsed() {
        tokio::time::sleep(LAPSED_POLL).await;
    }
}

/// What the client asked for that bounds what the broker sends it.
#[derive(Debug, Clone, Copy)]
pub(super) struct ClientLimits {
    /// Outbound QoS 1/2 window: the lower of `max_inflight` and the client's Receive Maximum.
    pub(super) inflight: u16,
    /// The client's Maximum Packet Size, bytes.
    pub(super) max_packet_size: u32,
    /// The client's Topic Alias Maximum.
    pub(super) topic_alias_maximum: u16,
}

/// The outbound half: drains the control buffer and the session's queue.
pub(super) struct Writer<'a> {
    /// What the writer shares with the reader.
    pub(super) c: &'a Shared,
    /// Topic aliases the broker set towards the client, topic -> alias.
    pub(super) aliases: LazyMap<String, u16>,
    /// Delivery properties built per message (5.0 only), allocated on first use.
    pub(super) scratch: Option<Box<Properties>>,
    /// What is being written. What an interrupted write left stays here, so that the final
    /// packets of the connection go out after whole packets, never after half of one.
    pub(super) out: BytesMut,
}

impl<'a> Writer<'a> {
    /// Writes what the link is woken for, until a write fails.
    // Not an `async fn`: its future would keep room for its arguments twice (as arguments
    // and as locals of its body), and an idle connection holds it all the time.
    #[allow(clippy::manual_async_fn)] // the point: see above
    pub(super) fn run<'w, W: AsyncWrite + Unpin>(
        &'w mut self,
        wr: &'w mut W,
    ) -> impl std::future::Future<Output = Close> + use<'a, 'w, W> {
        async move {
            // The write buffer is released while the writer sleeps (an idle connection holds
            // none) and given back the room it had at the next wake-up, in one allocation.
            let mut room = 0;
            loop {
                // At rest (the connection may park): nothing is left to write.
                self.c.link.set_rest(crate::link::WRITER_AT_REST, true);
                self.c.link.wait_woken().await;
                self.c.link.set_rest(crate::link::WRITER_AT_REST, false);
                // Stalled long enough for another node or broker to take the database (and
                // the sessions in it): nothing goes out until the next heartbeat says this
                // broker still serves; fenced instead, it stops and the connection is closed.
                // (Boxed: the wait takes no room in the future every connection holds.)
                if let Some(p) = self.c.broker.persist.get() {
                    if p.storage().lapsed() {
                        Box::pin(until_renewed(p.storage().as_ref())).await;
                    }
                }
                // Below saturation, PUBACKs go out after the deliveries of the same turn: the
                // subscribers' writers, woken by the same PUBLISH packets, write first, and the
                // subscribers' own PUBACKs, a round trip away, more often arrive before the
                // loop sleeps (one wake-up less). The publisher waits one turn of the loop. Not
                // while the loop is busy enough to be polled: there the turns are full anyway
                // (docs/BENCHMARKS.md, "Below saturation, against mosquitto").
                if self.c.link.unanswered_qos1() > 0 && !self.c.broker.busy_poll.polling() {
                    tokio::task::yield_now().await;
                }
                if self.out.capacity() == 0 {
                    self.out.reserve(room);
                }
                loop {
                    // In a block: a moved-from variable in scope at the write's wait would
                    // still take room in this future, which every connection holds.
                    let (more, pubacks) = {
                        let mut out = std::mem::take(&mut self.out);
                        let filled = self.fill(&mut out);
                        self.out = out;
                        filled
                    };
                    if self.out.is_empty() {
                        break;
                    }
                    let len = self.out.len() as u64;
                    if let Err(e) = wr.write_all_buf(&mut self.out).await {
                        return Close::lost(DisconnectReason::Io(e.to_string()));
                    }
                    Counters::add(&self.c.broker.stats.bytes_sent, len);
                    self.c.link.active();
                    self.out.clear();
                    self.c.link.wrote(pubacks);
                    if !more {
                        break;
                    }
                }
                if self.out.is_empty() {
                    room = self.out.capacity().min(IDLE_BUFFER_LIMIT);
                    self.out = BytesMut::new();
                }
            }
        }
    }

    /// Encodes into `buf` the pending control packets, then what the session's drain
    /// ([`BrokerState::drain`](crate::broker::BrokerState::drain)) hands over: in-flight
    /// messages not yet sent on this connection (resent with DUP), then queued messages while
    /// the window allows, up to [`WRITE_CHUNK`] bytes. Returns whether more is waiting (the
    /// chunk limit was reached) and how many PUBACKs it took from the control buffer.
    fn fill(&mut self, buf: &mut BytesMut) -> (bool, usize) {
        let pubacks = self.c.link.drain_control_into(buf);
        let c = self.c;
        let mut outlet = Socket {
            c,
            // Looked up once per fill, not per message.
            mount: c.mount(),
            aliases: &mut self.aliases,
            scratch: &mut self.scratch,
            buf,
        };
        let drained = c.broker.drain(&c.session, &mut outlet);
        if drained.sent > 0 {
            Counters::add(&c.broker.stats.messages_sent, drained.sent);
        }
        (drained.more, pubacks)
    }
}

/// The network connection as the drain's [`Outlet`]: PUBLISH packets encoded into the write
/// buffer (a 3.x QoS 0 delivery of a fan-out copied from the encoding its message shares),
/// within the client's Maximum Packet Size, with the topic aliases the broker set.
struct Socket<'w, 'c> {
    c: &'c Shared,
    mount: Option<&'c str>,
    aliases: &'w mut LazyMap<String, u16>,
    scratch: &'w mut Option<Box<Properties>>,
    buf: &'w mut BytesMut,
}

impl Outlet for Socket<'_, '_> {
    fn window(&self) -> Option<usize> {
        Some(usize::from(self.c.limits.inflight))
    }

    fn has_room(&self) -> bool {
        self.buf.len() < WRITE_CHUNK
    }

    fn send(&mut self, q: &Delivery, id: u16, dup: bool, now: Instant) -> Result<(), Unsent> {
        let max_packet_size = self.c.limits.max_packet_size as usize;
        if dup {
            // A resend names its topic in full: aliases belong to one connection.
            return encode_delivery_within(
                self.c.version,
                self.mount,
                q,
                id,
                true,
                None,
                now,
                self.scratch,
                max_packet_size,
                self.buf,
            )
            .map_err(|_| Unsent::TooLarge);
        }
        // Sized once, checked and written (an identifier taken for a packet that is then
        // dropped is simply skipped); or copied, when encoded already for another session.
        if let Some(bytes) = self.shared_encoding(q) {
            if bytes.len() <= max_packet_size {
                self.buf.extend_from_slice(bytes);
                return Ok(());
            }
        }
        let alias = self.alias_for(&q.msg.topic);
        // [MQTT-3.1.2-25]: never send a packet above the client's Maximum Packet Size.
        encode_delivery_within(
            self.c.version,
            self.mount,
            q,
            id,
            false,
            alias,
            now,
            self.scratch,
            max_packet_size,
            self.buf,
        )
        .map_err(|_| Unsent::TooLarge)?;
        if let Some((a, false)) = alias {
            self.aliases.insert(q.msg.topic.clone(), a);
        }
        Ok(())
    }

    fn release(&mut self, packet_id: u16) {
        encode_pubrel(packet_id, self.c.version, self.buf);
    }
}

impl Socket<'_, '_> {
    /// The encoding `q` shares with the other deliveries of its message
    /// ([`Message::shared_v3_qos0`](crate::message::Message::shared_v3_qos0)), when the client
    /// gets that form (3.x, QoS 0, no RETAIN, no mount point to remove) and the message goes
    /// to others too (a fan-out: another holder, or encoded already). A message only this
    /// session holds (a fan-in) is encoded straight into the write buffer instead, and a
    /// retained one is never given a copy it would keep while it stays retained.
    fn shared_encoding<'q>(&self, q: &'q Delivery) -> Option<&'q Bytes> {
        let mounted = self.mount.is_some();
        if self.c.version.is_v5() || q.qos != QoS::AtMostOnce || q.retain || q.msg.retain || mounted
        {
            return None;
        }
        if q.msg.encoded.get().is_none() && Arc::strong_count(&q.msg) < 2 {
            return None;
        }
        q.msg.shared_v3_qos0()
    }

    /// The topic alias to use for `topic`: (alias, already known to the client).
    fn alias_for(&self, topic: &str) -> Option<(u16, bool)> {
        if !self.c.version.is_v5() || self.c.limits.topic_alias_maximum == 0 {
            return None;
        }
        if let Some(&a) = self.aliases.get(topic) {
            return Some((a, true));
        }
        // Bounded: the table holds the topics themselves. Counted in usize, so an alias
        // number never wraps to 0.
        let next = self.aliases.len() + 1;
        let max = usize::from(self.c.limits.topic_alias_maximum.min(OUTBOUND_ALIASES));
        (next <= max && topic.len() <= OUTBOUND_ALIAS_TOPIC).then_some((next as u16, false))
    }
}

/// The properties a delivery carries: the message's, plus what this delivery adds (the
/// remaining expiry [MQTT-3.3.2-6], subscription identifiers, a topic alias).
fn delivery_properties<'p>(
    q: &'p Delivery,
    alias: Option<(u16, bool)>,
    now: Instant,
    scratch: &'p mut Option<Box<Properties>>,
) -> &'p Properties {
    if q.msg.expires_at.is_none() && q.subscription_ids.is_empty() && alias.is_none() {
        return &q.msg.properties;
    }
    let scratch: &mut Properties = scratch.get_or_insert_with(Default::default);
    scratch.clone_from(&q.msg.properties);
    scratch.message_expiry_interval = q.msg.remaining_expiry(now);
    scratch
        .subscription_identifiers
        .clone_from(&q.subscription_ids);
    scratch.topic_alias = alias.map(|(a, _)| a);
    scratch
}

/// Encodes a delivery unless it is larger than `max_packet_size` bytes (or cannot be
/// encoded at all): then nothing is written.
#[allow(clippy::too_many_arguments)]
fn encode_delivery_within(
    version: ProtocolVersion,
    mount: Option<&str>,
    q: &Delivery,
    packet_id: u16,
    dup: bool,
    alias: Option<(u16, bool)>,
    now: Instant,
    scratch: &mut Option<Box<Properties>>,
    max_packet_size: usize,
    buf: &mut BytesMut,
) -> Result<(), codec::EncodeError> {
    let properties = delivery_properties(q, alias, now, scratch);
    let topic = if alias.is_some_and(|(_, known)| known) {
        ""
    } else {
        // A client of a mounted listener only subscribes under its mount point.
        let topic = q.msg.topic.as_str();
        mount.and_then(|m| topic.strip_prefix(m)).unwrap_or(topic)
    };
    let p = PublishRef {
        dup,
        qos: q.qos,
        retain: q.retain,
        topic,
        packet_id,
        properties,
        payload: &q.msg.payload,
    };
    codec::encode_publish_within(&p, version, max_packet_size, buf)
}
