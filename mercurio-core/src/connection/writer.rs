//! The writer: sleeps until its link is woken, then drains the control buffer (the reader's
//! answers), the in-flight messages to resend and the session's queue into one buffer and one
//! write, within the window and the limits the client set.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::{Close, LazyMap, Shared, IDLE_BUFFER_LIMIT};
use crate::codec::{self, Packet, Properties, ProtocolVersion, PubAck, PublishRef, QoS};
use crate::link::DisconnectReason;
use crate::session::{Delivery, OutboundState, Session};
use crate::stats::{DropCause, Stats};

/// A writer writes at most about this many bytes per system call before draining again.
const WRITE_CHUNK: usize = 64 * 1024;
/// Most topic aliases the broker sets towards a client, whatever its Topic Alias Maximum.
const OUTBOUND_ALIASES: u16 = 100;
/// Longest topic the broker gives an alias to (the alias table holds the topics).
const OUTBOUND_ALIAS_TOPIC: usize = 256;

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
                    Stats::add(&self.c.broker.stats.bytes_sent, len);
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

    /// Encodes into `buf` the pending control packets, then in-flight messages not yet sent on
    /// this connection (resent with DUP [MQTT-4.4.0-1]), then queued messages while the window
    /// allows. Returns whether more is waiting (the chunk limit was reached) and how many
    /// PUBACKs it took from the control buffer. Records the client's progress (back pressure)
    /// and wakes the publishers waiting for room.
    fn fill(&mut self, buf: &mut BytesMut) -> (bool, usize) {
        let pubacks = self.c.link.drain_control_into(buf);
        let stats = &self.c.broker.stats;
        // Looked up once per fill, not per message.
        let mount = self.c.mount();
        let now = Instant::now();
        let mut st = self.c.session.state.lock();
        let st = &mut *st;
        let mut sent = 0u64;
        // Resent PUBLISH packets count against this connection's window like new ones: a
        // client that reconnects with a smaller Receive Maximum gets no more unacknowledged
        // QoS 1 and 2 PUBLISH packets than it allows [MQTT-3.3.4-9] [MQTT-4.9.0-2]; the rest
        // are resent as acknowledgements free the window. (PUBREL uses no send quota, but is
        // counted too: the window never overflows, whatever the mix.)
        let mut window = st.inflight_sent();
        // In-flight messages now larger than this connection's Maximum Packet Size (a client
        // back with a smaller one): discarded as if sent and acknowledged [MQTT-3.1.2-25].
        let mut too_large = Vec::new();
        // And those its client may no longer read (the access rules were reloaded, or
        // changed while the broker was down): a resend is a delivery, checked like one
        // (`may_read`), and dropped as if acknowledged when refused.
        let mut refused = Vec::new();
        st.resend_unsent(|f| {
            if f.state != OutboundState::AwaitingPubComp {
                if window >= usize::from(self.c.limits.inflight) {
                    return false;
                }
                if !self
                    .c
                    .broker
                    .may_read(&self.c.session, &f.delivery.msg.topic)
                {
                    refused.push(f.packet_id);
                    return false;
                }
            }
            window += 1;
            match f.state {
                OutboundState::AwaitingPubComp => {
                    let rel = Packet::PubRel(PubAck {
                        packet_id: f.packet_id,
                        ..PubAck::default()
                    });
                    let _ = codec::encode(&rel, self.c.version, buf);
                }
                _ => {
                    if encode_delivery_within(
                        self.c.version,
                        mount,
                        &f.delivery,
                        f.packet_id,
                        true,
                        None,
                        now,
                        &mut self.scratch,
                        self.c.limits.max_packet_size as usize,
                        buf,
                    )
                    .is_err()
                    {
                        // Marked sent, and dropped below.
                        too_large.push(f.packet_id);
                        window -= 1;
                        return true;
                    }
                    sent += 1;
                }
            }
            true
        });
        let dropped = too_large
            .into_iter()
            .map(|id| (id, DropCause::TooLarge))
            .chain(refused.into_iter().map(|id| (id, DropCause::NotAuthorized)));
        for (packet_id, cause) in dropped {
            if st.take_inflight(&self.c.session.client_id, packet_id) {
                stats.dropped(cause);
            }
        }
        let mut more = false;
        let mut took = 0;
        loop {
            if buf.len() >= WRITE_CHUNK {
                more = !st.queue().is_empty();
                break;
            }
            let Some(head) = st.queue().front() else {
                break;
            };
            if head.qos > QoS::AtMostOnce
                && st.inflight().len() >= usize::from(self.c.limits.inflight)
            {
                break;
            }
            let Some(q) = st.pop_queued(&self.c.session.client_id) else {
                break;
            };
            took += 1;
            if q.msg.is_expired(now) {
                self.c.broker.dropped(
                    Some(&self.c.session.client_id),
                    &q.msg.topic,
                    DropCause::Expired,
                );
                st.persist_dequeued(&self.c.session.client_id, &q);
                if q.qos > QoS::AtMostOnce {
                    // Its packet identifier is used up, as in mosquitto, which numbers a
                    // message when it queues it: the next message's number shows the gap.
                    let _ = st.allocate_packet_id();
                }
                continue;
            }
            let alias = self.alias_for(&q.msg.topic);
            let packet_id = if q.qos > QoS::AtMostOnce {
                match st.allocate_packet_id() {
                    Some(id) => id,
                    None => {
                        st.requeue_front(q);
                        took -= 1;
                        break;
                    }
                }
            } else {
                0
            };
            // Sized once, checked and written (an identifier taken for a packet that is then
            // dropped is simply skipped); or copied, when encoded already for another session.
            let max_packet_size = self.c.limits.max_packet_size as usize;
            let written = match self.shared_encoding(&q, mount.is_some()) {
                Some(bytes) if bytes.len() <= max_packet_size => {
                    buf.extend_from_slice(bytes);
                    true
                }
                _ => encode_delivery_within(
                    self.c.version,
                    mount,
                    &q,
                    packet_id,
                    false,
                    alias,
                    now,
                    &mut self.scratch,
                    max_packet_size,
                    buf,
                )
                .is_ok(),
            };
            if !written {
                // [MQTT-3.1.2-25]: never send a packet above the client's Maximum Packet Size.
                self.c.broker.dropped(
                    Some(&self.c.session.client_id),
                    &q.msg.topic,
                    DropCause::TooLarge,
                );
                st.persist_dequeued(&self.c.session.client_id, &q);
                continue;
            }
            let new_alias = alias.filter(|(_, known)| !known).is_some();
            if new_alias {
                if let Some((a, _)) = alias {
                    self.aliases.insert(q.msg.topic.clone(), a);
                }
            }
            sent += 1;
            if q.qos > QoS::AtMostOnce {
                st.send_inflight(&self.c.session.client_id, packet_id, q);
            }
        }
        if sent > 0 {
            Stats::add(&stats.messages_sent, sent);
        }
        if Session::progressed(st, took, now, &self.c.broker.limits) {
            self.c.session.release_waiters();
        }
        (more, pubacks)
    }

    /// The encoding `q` shares with the other deliveries of its message
    /// ([`Message::shared_v3_qos0`](crate::message::Message::shared_v3_qos0)), when the client
    /// gets that form (3.x, QoS 0, no RETAIN, no mount point to remove) and the message goes
    /// to others too (a fan-out: another holder, or encoded already). A message only this
    /// session holds (a fan-in) is encoded straight into the write buffer instead, and a
    /// retained one is never given a copy it would keep while it stays retained.
    fn shared_encoding<'q>(&self, q: &'q Delivery, mounted: bool) -> Option<&'q Bytes> {
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
