//! `SessionState`'s methods: reading it, changing it (each change an operation of the
//! protocol, storage or restore, reported to storage when it must be), and restoring it.

use super::*;

impl SessionState {
    /// The will, taken out of its box.
    pub(crate) fn take_will(&mut self) -> Option<Will> {
        self.will.take().map(|w| *w)
    }

    /// The next free packet identifier for an outbound message, skipping those in flight
    /// [MQTT-2.2.1-4]. `None` when all 65,535 are taken.
    pub(crate) fn allocate_packet_id(&mut self) -> Option<u16> {
        for _ in 0..u16::MAX {
            let id = self.next_packet_id;
            self.next_packet_id = if id == u16::MAX { 1 } else { id + 1 };
            if !self.inflight.iter().any(|f| f.packet_id == id) {
                return Some(id);
            }
        }
        None
    }

    /// Takes the head of the queue (of `client_id`'s session), logging "room again" as soon
    /// as a dropping queue is back to half its limits.
    pub(crate) fn pop_queued(&mut self, client_id: &str) -> Option<Delivery> {
        let head = self.queue.pop_front();
        self.note_room(client_id);
        head
    }

    /// Ends a dropping period once the queue is back to half its limits: one line with the
    /// count of messages dropped.
    pub(super) fn note_room(&mut self, client_id: &str) {
        let Some(d) = self.rare.as_ref().and_then(|r| r.dropping.as_ref()) else {
            return;
        };
        if self.queue.len() <= d.room_messages && self.queue.bytes() <= d.room_bytes {
            tracing::warn!(
                client_id,
                dropped = d.dropped,
                "session queue has room again"
            );
            self.set_rare(|r| r.dropping = None);
        }
    }

    /// Changes the rare part, dropping its box when nothing is left in it.
    fn set_rare(&mut self, change: impl FnOnce(&mut super::Rare)) {
        change(self.rare.get_or_insert_default());
        if self.rare.as_ref().is_some_and(|r| {
            r.dropping.is_none() && r.own_limits.is_none() && r.certificate.is_none()
        }) {
            self.rare = None;
        }
    }

    /// This session's own queue limits, if it has them (a bridge's queue).
    pub(super) fn own_limits(&self) -> Option<&QueueLimits> {
        self.rare.as_ref().and_then(|r| r.own_limits.as_ref())
    }

    /// Back under the low-water mark: half the high-water mark, in messages (as
    /// [`Queue::pressure`](super::queue::Queue::pressure) counts them) and in bytes.
    pub(super) fn under_low_water(&self, limits: &QueueLimits) -> bool {
        let limits = self.own_limits().unwrap_or(limits);
        self.queue.pressure(limits.qos0_share) <= limits.high_water_messages / 2
            && self.queue.bytes() <= limits.high_water_bytes / 2
    }

    /// Gives this session queue limits of its own in place of the broker's (`None`: the
    /// broker's again). A bridge's queue uses it.
    pub(crate) fn set_own_limits(&mut self, limits: Option<QueueLimits>) {
        self.set_rare(|r| r.own_limits = limits);
    }

    /// Records whether the connection serving the session is another broker's bridge
    /// (mosquitto's `try_private`), at each CONNECT.
    pub(crate) fn set_remote_bridge(&mut self, bridge: bool) {
        self.remote_bridge = bridge;
    }

    /// Whether the last connection was another broker's bridge (`try_private`).
    pub(crate) fn remote_bridge(&self) -> bool {
        self.remote_bridge
    }

    /// Removes the QoS 0 deliveries: they are not kept for a client that is away.
    pub(crate) fn drop_qos0(&mut self) {
        self.queue.retain(|q| q.qos != QoS::AtMostOnce);
    }

    /// Removes the deliveries `keep` refuses, reporting them to storage. Returns how many.
    pub(crate) fn remove_queued(
        &mut self,
        client_id: &str,
        keep: impl FnMut(&Delivery) -> bool,
    ) -> usize {
        let removed = self.queue.retain(keep);
        for q in &removed {
            self.persist_dequeued(client_id, q);
        }
        self.note_room(client_id);
        removed.len()
    }

    /// Position of the in-flight message with this packet identifier.
    pub(super) fn inflight_position(&self, packet_id: u16) -> Option<usize> {
        self.inflight.iter().position(|f| f.packet_id == packet_id)
    }

    /// An inbound QoS 2 PUBLISH is answered with PUBREC: its packet identifier awaits
    /// PUBREL [MQTT-4.3.3-9], reported to storage. False when it already did (a resend).
    pub(crate) fn receive_qos2(&mut self, client_id: &str, packet_id: u16) -> bool {
        let added = self.inbound_qos2.insert(packet_id, ()).is_none();
        if added {
            self.persist_inbound_qos2(client_id, packet_id, true);
        }
        added
    }

    /// PUBREL for `packet_id`: the identifier is released, reported to storage. False when
    /// it was not awaiting PUBREL.
    pub(crate) fn release_qos2(&mut self, client_id: &str, packet_id: u16) -> bool {
        let known = self.inbound_qos2.remove(&packet_id).is_some();
        if known {
            self.persist_inbound_qos2(client_id, packet_id, false);
        }
        known
    }

    /// Whether `packet_id` is an inbound QoS 2 message awaiting PUBREL.
    pub(crate) fn awaits_release(&self, packet_id: u16) -> bool {
        self.inbound_qos2.contains_key(&packet_id)
    }

    /// How many inbound QoS 2 messages await PUBREL.
    pub(crate) fn awaiting_release(&self) -> usize {
        self.inbound_qos2.len()
    }

    /// The inbound QoS 2 packet identifiers awaiting PUBREL, in increasing order (as stored).
    pub(crate) fn inbound_qos2_ids(&self) -> Vec<u16> {
        let mut ids: Vec<u16> = self.inbound_qos2.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Restore: the identifiers awaiting PUBREL as storage had them (not reported again).
    pub(crate) fn restore_inbound_qos2(&mut self, ids: &[u16]) {
        self.inbound_qos2 = LazyMap::new();
        for &id in ids {
            self.inbound_qos2.insert(id, ());
        }
    }

    /// Restore: numbers the next queued message after `seq`.
    pub(crate) fn restored_seq(&mut self, seq: u64) {
        self.next_seq = self.next_seq.max(seq + 1);
    }
}

/// Reading the session's state: what connections, storage, statistics and the
/// administration API look at (changes go through the methods below).
impl SessionState {
    /// The protocol version of the last connection.
    pub(crate) fn protocol(&self) -> ProtocolVersion {
        self.protocol
    }

    /// The subscriptions, by full filter (with `$share/...`).
    pub(crate) fn subscriptions(&self) -> &LazyMap<String, Granted> {
        &self.subscriptions
    }

    /// The deliveries waiting for the client (changed through `pop_queued`,
    /// `requeue_front`, `remove_queued`, so that storage and the drop log follow).
    pub(crate) fn queue(&self) -> &Queue {
        &self.queue
    }

    /// The outbound QoS 1/2 messages in flight, oldest first.
    pub(crate) fn inflight(&self) -> &VecDeque<Inflight> {
        &self.inflight
    }

    /// Session Expiry Interval in seconds; `u32::MAX` = never.
    pub(crate) fn expiry_interval(&self) -> u32 {
        self.expiry_interval
    }

    /// The will waiting for the end of the connection (or for its delay), if any.
    pub(crate) fn will(&self) -> Option<&Will> {
        self.will.as_deref()
    }

    /// True while a connection serves the session.
    pub(crate) fn is_connected(&self) -> bool {
        self.link.is_some()
    }

    /// True once the session has ended (expired, cleaned, taken over by a clean start).
    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    /// Messages this session's queue dropped since it was made (a bridge reports it).
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// When the last connection ended; `None` while connected.
    pub(crate) fn disconnected_at(&self) -> Option<Instant> {
        self.disconnected_at
    }

    /// The user name of the last connection.
    pub(crate) fn username(&self) -> Option<&Arc<str>> {
        self.username.as_ref()
    }

    /// The client certificate's name of the last connection.
    pub(crate) fn certificate(&self) -> Option<&Arc<str>> {
        self.rare.as_ref().and_then(|r| r.certificate.as_ref())
    }
}

/// Changing the session's state from outside this module: each method is one operation of
/// the protocol, storage or restore, and reports to storage what it changes, if it must.
impl SessionState {
    /// Records who the connection that took the session belongs to (stored with the session
    /// so that access checks made while it is offline use it).
    pub(crate) fn set_owner(&mut self, username: Option<Arc<str>>, certificate: Option<Arc<str>>) {
        self.username = username;
        if certificate.is_some() || self.certificate().is_some() {
            self.set_rare(|r| r.certificate = certificate);
        }
    }

    /// DISCONNECT changed the Session Expiry Interval (MQTT 5.0).
    pub(crate) fn set_expiry_interval(&mut self, expiry: u32) {
        self.expiry_interval = expiry;
    }

    /// Drops the will without reporting it to storage: the session ends next, or a new
    /// connection for its client identifier opened before its delay elapsed.
    pub(crate) fn discard_will(&mut self) {
        self.will = None;
    }

    /// Reports changes to `changes` from now on, unless a reporter is set already.
    pub(crate) fn report_changes_to(&mut self, changes: Arc<dyn SessionChanges>) {
        if self.changes.is_none() {
            self.changes = Some(changes);
        }
    }

    /// Puts back at the head of the queue a delivery just taken by `pop_queued` and not sent
    /// (no packet identifier was free).
    pub(crate) fn requeue_front(&mut self, q: Delivery) {
        self.queue.push_front(q);
    }

    /// The state of the in-flight message with this packet identifier, if there is one.
    pub(crate) fn inflight_state(&self, packet_id: u16) -> Option<OutboundState> {
        self.inflight
            .iter()
            .find(|f| f.packet_id == packet_id)
            .map(|f| f.state)
    }

    /// How many in-flight messages were sent on this connection (the window they take).
    pub(crate) fn inflight_sent(&self) -> usize {
        self.inflight.iter().filter(|f| f.sent).count()
    }

    /// A message taken from the queue was sent with `packet_id`: it is in flight, awaiting
    /// PUBACK (QoS 1) or PUBREC (QoS 2), reported to storage (which dequeues it).
    pub(crate) fn send_inflight(&mut self, client_id: &str, packet_id: u16, delivery: Delivery) {
        let state = if delivery.qos == QoS::AtLeastOnce {
            OutboundState::AwaitingPubAck
        } else {
            OutboundState::AwaitingPubRec
        };
        self.inflight.push_back(Inflight {
            packet_id,
            state,
            delivery,
            sent: true,
        });
        self.persist_sent(client_id);
    }

    /// Offers each in-flight message not yet sent on this connection to `resend`, oldest
    /// first; those for which it returns true are marked sent.
    pub(crate) fn resend_unsent(&mut self, mut resend: impl FnMut(&Inflight) -> bool) {
        for f in self.inflight.iter_mut().filter(|f| !f.sent) {
            if resend(f) {
                f.sent = true;
            }
        }
    }

    /// The connection ended: every in-flight message is to be sent again on the next one.
    pub(crate) fn mark_inflight_unsent(&mut self) {
        for f in self.inflight.iter_mut() {
            f.sent = false;
        }
    }

    /// The in-flight message `packet_id` was acknowledged (or refused, or dropped): it leaves
    /// flight, reported to storage. Returns its delivery; `None` when it was not in flight.
    pub(crate) fn take_inflight(&mut self, client_id: &str, packet_id: u16) -> Option<Delivery> {
        let i = self.inflight_position(packet_id)?;
        let taken = self.inflight.remove(i).map(|f| f.delivery);
        self.persist_acked(client_id, packet_id);
        taken
    }

    /// True while the connection (or in-process client) of `link` serves this session.
    pub(crate) fn served_by(&self, link: &Arc<Link>) -> bool {
        self.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link))
    }

    /// PUBREC for the in-flight message `packet_id`: it now awaits PUBCOMP, reported to
    /// storage. False when it was not in flight.
    pub(crate) fn inflight_received(&mut self, client_id: &str, packet_id: u16) -> bool {
        let Some(i) = self.inflight_position(packet_id) else {
            return false;
        };
        self.inflight[i].state = OutboundState::AwaitingPubComp;
        self.persist_inflight(client_id, i);
        true
    }
}

/// Restore: the state storage had, set before the session reports changes (not reported).
impl SessionState {
    /// The disconnection time and the owner of the stored session.
    pub(crate) fn restore_header(
        &mut self,
        disconnected_at: Instant,
        username: Option<Arc<str>>,
        certificate: Option<Arc<str>>,
    ) {
        self.disconnected_at = Some(disconnected_at);
        self.set_owner(username, certificate);
    }

    /// A queued delivery, at the end of the queue.
    pub(crate) fn restore_queued(&mut self, q: Delivery) {
        self.queue.push_back(q);
    }

    /// An in-flight message, after those restored already.
    pub(crate) fn restore_inflight(&mut self, f: Inflight) {
        self.inflight.push_back(f);
    }

    /// The will waiting for its delay.
    pub(crate) fn restore_will(&mut self, will: Will) {
        self.will = Some(Box::new(will));
    }
}

/// The mutation points: each reports the change that mirrors it, when the session is stored
/// (a storage writer, a session expiry interval above 0). Called with the session locked.
impl SessionState {
    pub(super) fn stored(&self) -> Option<&Arc<dyn SessionChanges>> {
        self.changes.as_ref().filter(|_| self.expiry_interval > 0)
    }

    /// A message was pushed on the queue.
    pub(crate) fn persist_queued(&self, client_id: &Arc<str>, q: &Delivery) {
        if q.qos == QoS::AtMostOnce {
            return;
        }
        if let Some(c) = self.stored() {
            c.queued(client_id, q);
        }
    }

    /// A message left the queue without being sent (expired, too large).
    pub(crate) fn persist_dequeued(&self, client_id: &str, q: &Delivery) {
        if q.qos == QoS::AtMostOnce {
            return;
        }
        if let Some(c) = self.stored() {
            c.dequeued(client_id, q.seq);
        }
    }

    /// The last in-flight message was just sent, taken from the queue.
    pub(super) fn persist_sent(&self, client_id: &str) {
        let Some(c) = self.stored() else { return };
        let Some(f) = self.inflight.back() else {
            return;
        };
        c.dequeued(client_id, f.delivery.seq);
        c.inflight_set(client_id, f);
    }

    /// The in-flight message at `index` changed state (PUBREC received).
    pub(super) fn persist_inflight(&self, client_id: &str, index: usize) {
        let Some(c) = self.stored() else { return };
        if let Some(f) = self.inflight.get(index) {
            c.inflight_set(client_id, f);
        }
    }

    /// An in-flight message was acknowledged (or refused) and removed.
    pub(super) fn persist_acked(&self, client_id: &str, packet_id: u16) {
        if let Some(c) = self.stored() {
            c.inflight_removed(client_id, packet_id);
        }
    }

    /// An inbound QoS 2 packet identifier was added (`true`) or released.
    pub(super) fn persist_inbound_qos2(&self, client_id: &str, packet_id: u16, added: bool) {
        if let Some(c) = self.stored() {
            c.inbound_qos2(client_id, packet_id, added);
        }
    }

    /// A subscription was added or replaced (`Some`), or removed.
    pub(crate) fn persist_subscription(
        &self,
        client_id: &str,
        filter: &str,
        granted: Option<&Granted>,
    ) {
        if let Some(c) = self.stored() {
            c.subscription(client_id, filter, granted);
        }
    }

    /// The will was published or dropped.
    pub(crate) fn persist_will_cleared(&self, client_id: &str) {
        if let Some(c) = self.stored() {
            c.will_cleared(client_id);
        }
    }

    /// The connection ended: the header with its disconnection time, and the will if gone.
    pub(crate) fn persist_detached(&self, client_id: &str) {
        if let Some(c) = self.stored() {
            c.detached(client_id, self);
        }
    }

    /// The session ended (expired, cleaned, taken over by a clean start).
    pub(crate) fn persist_ended(&self, client_id: &str) {
        if let Some(c) = &self.changes {
            c.ended(client_id);
        }
    }
}
