//! The writer: sleeps until its link is woken, then drains the control buffer (the reader's
//! answers), the in-flight messages to resend and the session's queue into one buffer and one
//! write, within the window and the limits the client set.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::{Close, IDLE_BUFFER_LIMIT};
use crate::broker::BrokerState;
use crate::codec::{self, Packet, Properties, ProtocolVersion, PubAck, PublishRef, QoS};
use crate::link::{DisconnectReason, Link};
use crate::session::{Delivery, Inflight, OutboundState, Session};
use crate::stats::{DropCause, Stats};

/// A writer writes at most about this many bytes per system call before draining again.
const WRITE_CHUNK: usize = 64 * 1024;

/// What the client asked for that bounds what the broker sends it.
#[derive(Debug, Clone, Copy)]
pub(super) struct ClientLimits {
    /// Outbound QoS 1/2 window: the lower of `max_inflight` and the client's Receive Maximum.
    pub(super) inflight: usize,
    /// The client's Maximum Packet Size, bytes.
    pub(super) max_packet_size: u32,
    /// The client's Topic Alias Maximum.
    pub(super) topic_alias_maximum: u16,
}

/// The outbound half: drains the control buffer and the session's queue.
pub(super) struct Writer<'a> {
    pub(super) broker: &'a Arc<BrokerState>,
    pub(super) session: &'a Arc<Session>,
    pub(super) link: &'a Arc<Link>,
    pub(super) version: ProtocolVersion,
    pub(super) limits: ClientLimits,
    /// Topic aliases the broker set towards the client, topic -> alias.
    pub(super) aliases: HashMap<String, u16>,
    /// Delivery properties built per message (5.0 only), allocated on first use.
    pub(super) scratch: Option<Box<Properties>>,
    /// The listener's `mount_point`, removed from the topics delivered.
    pub(super) mount: Option<&'a str>,
}

impl Writer<'_> {
    pub(super) async fn run<W: AsyncWrite + Unpin>(&mut self, wr: &mut W) -> Close {
        let mut buf = BytesMut::new();
        loop {
            self.link.wait_woken().await;
            loop {
                let more = self.fill(&mut buf);
                if buf.is_empty() {
                    break;
                }
                if let Err(e) = wr.write_all(&buf).await {
                    return Close::lost(DisconnectReason::Io(e.to_string()));
                }
                Stats::add(&self.broker.stats.bytes_sent, buf.len() as u64);
                buf.clear();
                if !more {
                    break;
                }
            }
            if buf.capacity() > IDLE_BUFFER_LIMIT {
                buf = BytesMut::new();
            }
        }
    }

    /// Encodes into `buf` the pending control packets, then in-flight messages not yet sent on
    /// this connection (resent with DUP [MQTT-4.4.0-1]), then queued messages while the window
    /// allows. Returns true when more is waiting (the chunk limit was reached).
    fn fill(&mut self, buf: &mut BytesMut) -> bool {
        self.link.drain_control_into(buf);
        let stats = &self.broker.stats;
        let now = Instant::now();
        let mut st = self.session.state.lock();
        let st = &mut *st;
        let mut sent = 0u64;
        // Resent PUBLISH packets count against this connection's window like new ones: a
        // client that reconnects with a smaller Receive Maximum gets no more unacknowledged
        // QoS 1 and 2 PUBLISH packets than it allows [MQTT-3.3.4-9] [MQTT-4.9.0-2]; the rest
        // are resent as acknowledgements free the window. (PUBREL uses no send quota, but is
        // counted too: the window never overflows, whatever the mix.)
        let mut window = st.inflight.iter().filter(|f| f.sent).count();
        for f in st.inflight.iter_mut().filter(|f| !f.sent) {
            if f.state != OutboundState::AwaitingPubComp && window >= self.limits.inflight {
                continue;
            }
            f.sent = true;
            window += 1;
            match f.state {
                OutboundState::AwaitingPubComp => {
                    let rel = Packet::PubRel(PubAck {
                        packet_id: f.packet_id,
                        ..PubAck::default()
                    });
                    let _ = codec::encode(&rel, self.version, buf);
                }
                _ => {
                    encode_delivery(
                        self.version,
                        self.mount,
                        &f.delivery,
                        f.packet_id,
                        true,
                        None,
                        now,
                        &mut self.scratch,
                        buf,
                    );
                    sent += 1;
                }
            }
        }
        let mut more = false;
        loop {
            if buf.len() >= WRITE_CHUNK {
                more = !st.queue.is_empty();
                break;
            }
            let Some(head) = st.queue.front() else { break };
            if head.qos > QoS::AtMostOnce && st.inflight.len() >= self.limits.inflight {
                break;
            }
            let Some(q) = st.pop_queued() else { break };
            if q.msg.is_expired(now) {
                stats.dropped(DropCause::Expired);
                st.persist_dequeued(&self.session.client_id, &q);
                continue;
            }
            let alias = self.alias_for(&q.msg.topic);
            let packet_id = if q.qos > QoS::AtMostOnce {
                match st.allocate_packet_id() {
                    Some(id) => id,
                    None => {
                        st.queue.push_front(q);
                        break;
                    }
                }
            } else {
                0
            };
            // Sized once, checked and written (an identifier taken for a packet that is then
            // dropped is simply skipped).
            if encode_delivery_within(
                self.version,
                self.mount,
                &q,
                packet_id,
                false,
                alias,
                now,
                &mut self.scratch,
                self.limits.max_packet_size as usize,
                buf,
            )
            .is_err()
            {
                // [MQTT-3.1.2-25]: never send a packet above the client's Maximum Packet Size.
                stats.dropped(DropCause::TooLarge);
                st.persist_dequeued(&self.session.client_id, &q);
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
                let state = if q.qos == QoS::AtLeastOnce {
                    OutboundState::AwaitingPubAck
                } else {
                    OutboundState::AwaitingPubRec
                };
                st.inflight.push_back(Inflight {
                    packet_id,
                    state,
                    delivery: q,
                    sent: true,
                });
                st.persist_sent(&self.session.client_id);
            }
        }
        if sent > 0 {
            Stats::add(&stats.messages_sent, sent);
        }
        more
    }

    /// The topic alias to use for `topic`: (alias, already known to the client).
    fn alias_for(&self, topic: &str) -> Option<(u16, bool)> {
        if !self.version.is_v5() || self.limits.topic_alias_maximum == 0 {
            return None;
        }
        if let Some(&a) = self.aliases.get(topic) {
            return Some((a, true));
        }
        let next = self.aliases.len() as u16 + 1;
        (next <= self.limits.topic_alias_maximum).then_some((next, false))
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

#[allow(clippy::too_many_arguments)]
fn encode_delivery(
    version: ProtocolVersion,
    mount: Option<&str>,
    q: &Delivery,
    packet_id: u16,
    dup: bool,
    alias: Option<(u16, bool)>,
    now: Instant,
    scratch: &mut Option<Box<Properties>>,
    buf: &mut BytesMut,
) {
    let r = encode_delivery_within(
        version,
        mount,
        q,
        packet_id,
        dup,
        alias,
        now,
        scratch,
        usize::MAX,
        buf,
    );
    if let Err(e) = r {
        tracing::error!(topic = %q.msg.topic, "cannot encode PUBLISH: {e}");
    }
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
