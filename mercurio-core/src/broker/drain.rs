//! The one way a session's queue is drained, whoever takes the messages: a network
//! connection's writer, a bridge's connection to its remote, the pump of an in-process
//! subscription or of a durable in-process client. [`BrokerState::drain`] decides what leaves
//! the session and in what order (in-flight messages to resend, then the queue within the
//! window), and does everything that goes with it (expiry, packet identifiers, requeueing
//! when the window is full, the reports to storage, the drop counts and events, the progress
//! that back pressure reads); the [`Outlet`] only says whether it has room and puts each
//! message on its way (the writer encodes into its write buffer, the bridge under its remote
//! topic, a pump into its channel).

use std::sync::Arc;
use std::time::Instant;

use super::BrokerState;
use bytes::BytesMut;

use crate::codec::{self, Packet, ProtocolVersion, PubAck, QoS};
use crate::message::Message;
use crate::session::{Delivery, OutboundState, Session};
use crate::stats::DropCause;

/// An outlet that writes to a socket encodes at most about this many bytes per system call
/// before draining again (the network writer and a bridge alike).
pub(crate) const WRITE_CHUNK: usize = 64 * 1024;

/// Encodes PUBREL for `packet_id` (what [`Outlet::release`] sends on a connection).
pub(crate) fn encode_pubrel(packet_id: u16, version: ProtocolVersion, buf: &mut BytesMut) {
    let rel = Packet::PubRel(PubAck {
        packet_id,
        ..PubAck::default()
    });
    let _ = codec::encode(&rel, version, buf);
}

/// Why an outlet did not send a message it was handed: it leaves the session either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unsent {
    /// Larger than the receiver takes (its Maximum Packet Size [MQTT-3.1.2-25]): counted as
    /// dropped (`too_large`), with [`Event::MessageDropped`](crate::Event).
    TooLarge,
    /// Not for this receiver (a bridge whose rule for the topic is gone, a message that came
    /// over a bridge, an in-process subscription dropped meanwhile): left out, not counted.
    NotHere,
}

/// Where [`BrokerState::drain`] puts what leaves a session. Called with the session's state
/// locked: nothing here may wait or take another session's lock.
pub(crate) trait Outlet {
    /// The most QoS 1/2 messages in flight at once (the receiver's window), or `None` for a
    /// receiver that acknowledges nothing (an in-process subscription): then every message
    /// leaves the session when it is handed over, at its QoS, without a packet identifier.
    fn window(&self) -> Option<usize>;

    /// Whether the outlet takes another message now (a write buffer under [`WRITE_CHUNK`], a
    /// channel with room). Asked before each message leaves the queue.
    fn has_room(&self) -> bool;

    /// The QoS `q` leaves at, or `Err` when it is not for this receiver (it leaves the queue
    /// then, without being counted as dropped). By default, the delivery's own.
    fn admit(&mut self, q: &Delivery) -> Result<QoS, Unsent> {
        Ok(q.qos)
    }

    /// Puts `q` on its way at `q.qos` with packet identifier `id` (0 for QoS 0), `dup` for a resend of
    /// an in-flight message [MQTT-4.4.0-1]. `now` is the drain's clock (the remaining
    /// Message Expiry Interval is counted from it [MQTT-3.3.2-6]).
    fn send(&mut self, q: &Delivery, id: u16, dup: bool, now: Instant) -> Result<(), Unsent>;

    /// Sends PUBREL again for a QoS 2 message whose PUBREC came on an earlier connection.
    fn release(&mut self, packet_id: u16);
}

/// Why an in-flight message was dropped at its resend, and which message it was.
type Dropped = (DropCause, Arc<Message>);

/// What one [`BrokerState::drain`] did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Drained {
    /// PUBLISH packets sent (resends included).
    pub sent: u64,
    /// Of which QoS 0 (nothing acknowledges them: they are forwarded once sent).
    pub sent_qos0: u64,
    /// The outlet ran out of room with messages still queued: drain again once it has some.
    pub more: bool,
}

impl BrokerState {
    /// Drains `session` into `outlet`, under the session's lock:
    ///
    /// 1. in-flight messages not yet sent on this connection, oldest first, resent with DUP
    ///    (PUBREL for those awaiting PUBCOMP) within the window and while the outlet has
    ///    room: resends count against the window like new messages [MQTT-3.3.4-9]
    ///    [MQTT-4.9.0-2]. A resend is a delivery, checked like
    ///    one (`may_read`): one its client may no longer read, or now too large for the
    ///    receiver, leaves flight as if acknowledged, counted as dropped;
    /// 2. queued messages while the outlet has room and, for QoS 1/2, the window a slot:
    ///    an expired one is dropped (`expired`; its packet identifier is used up, as in
    ///    mosquitto, which numbers a message when it queues it); a QoS 1/2 one takes a packet
    ///    identifier and goes in flight (stored as sent), or goes back to the head of the
    ///    queue when none is free; the rest leave the queue (reported to storage).
    ///
    /// Then records the client's progress (back pressure: [`Session::progressed`]) and wakes
    /// the publishers waiting for room in this session.
    pub(crate) fn drain(&self, session: &Session, outlet: &mut impl Outlet) -> Drained {
        let now = Instant::now();
        let client_id = &*session.client_id;
        let mut done = Drained::default();
        // Counted (and told to the application) once the session's lock is released.
        let mut drops: Vec<Dropped> = Vec::new();
        let mut guard = session.state.lock();
        let st = &mut *guard;
        let window = outlet.window();
        // Resends left for want of room in the outlet: drain again once it has some.
        let mut resend_blocked = false;
        if let Some(window) = window {
            let mut taken = st.inflight_sent();
            // Leaving flight after the walk (it holds the in-flight list), with the cause
            // and message of those counted as dropped.
            let mut gone: Vec<(u16, Option<Dropped>)> = Vec::new();
            st.resend_unsent(|f| {
                if f.state == OutboundState::AwaitingPubComp {
                    // PUBREL uses no send quota, but is counted too: the window never
                    // overflows, whatever the mix.
                    taken += 1;
                    outlet.release(f.packet_id);
                    return true;
                }
                if taken >= window {
                    return false;
                }
                if !outlet.has_room() {
                    resend_blocked = true;
                    return false;
                }
                let msg = &f.delivery.msg;
                if !self.may_read(session, &msg.topic) {
                    gone.push((
                        f.packet_id,
                        Some((DropCause::NotAuthorized, Arc::clone(msg))),
                    ));
                    return false;
                }
                match outlet.send(&f.delivery, f.packet_id, true, now) {
                    Ok(()) => {
                        taken += 1;
                        done.sent += 1;
                    }
                    Err(Unsent::TooLarge) => {
                        gone.push((f.packet_id, Some((DropCause::TooLarge, Arc::clone(msg)))));
                    }
                    Err(Unsent::NotHere) => gone.push((f.packet_id, None)),
                }
                true
            });
            for (packet_id, dropped) in gone {
                if st.take_inflight(client_id, packet_id).is_some() {
                    drops.extend(dropped);
                }
            }
        }
        let mut took = 0;
        loop {
            if !outlet.has_room() {
                done.more = !st.queue().is_empty();
                break;
            }
            let Some(head) = st.queue().front() else {
                break;
            };
            if let Some(window) = window {
                if head.qos > QoS::AtMostOnce && st.inflight().len() >= window {
                    break;
                }
            }
            let Some(mut q) = st.pop_queued(client_id) else {
                break;
            };
            took += 1;
            if q.msg.is_expired(now) {
                drops.push((DropCause::Expired, Arc::clone(&q.msg)));
                st.persist_dequeued(client_id, &q);
                if window.is_some() && q.qos > QoS::AtMostOnce {
                    // Its packet identifier is used up, as in mosquitto: the next message's
                    // number shows the gap (any free identifier is valid [MQTT-2.2.1-3]).
                    let _ = st.allocate_packet_id();
                }
                continue;
            }
            let qos = match outlet.admit(&q) {
                Ok(qos) => qos,
                Err(why) => {
                    unsent(&mut drops, &q, why);
                    st.persist_dequeued(client_id, &q);
                    continue;
                }
            };
            if window.is_none() || qos == QoS::AtMostOnce {
                // Leaves the session once handed over: dequeued as stored (at the QoS it
                // was queued with), then sent at the outlet's.
                st.persist_dequeued(client_id, &q);
                q.qos = qos;
                match outlet.send(&q, 0, false, now) {
                    Ok(()) => {
                        done.sent += 1;
                        done.sent_qos0 += u64::from(qos == QoS::AtMostOnce);
                    }
                    Err(why) => unsent(&mut drops, &q, why),
                }
                continue;
            }
            let Some(packet_id) = st.allocate_packet_id() else {
                // All 65,535 identifiers in flight: it waits at the head of the queue.
                st.requeue_front(q);
                took -= 1;
                break;
            };
            q.qos = qos;
            match outlet.send(&q, packet_id, false, now) {
                Ok(()) => {
                    done.sent += 1;
                    st.send_inflight(client_id, packet_id, q);
                }
                Err(why) => {
                    unsent(&mut drops, &q, why);
                    st.persist_dequeued(client_id, &q);
                }
            }
        }
        done.more |= resend_blocked;
        let release = Session::progressed(st, took, now, &self.limits);
        drop(guard);
        if release {
            session.release_waiters();
        }
        for (cause, msg) in drops {
            self.dropped(Some(client_id), &msg.topic, cause);
        }
        done
    }
}

/// A message an outlet did not send: counted as dropped (after the drain) when it was too
/// large.
fn unsent(drops: &mut Vec<Dropped>, q: &Delivery, why: Unsent) {
    if why == Unsent::TooLarge {
        drops.push((DropCause::TooLarge, Arc::clone(&q.msg)));
    }
}
