//! Shared subscriptions (MQTT 5.0 section 4.8.2): one member of a group receives each message,
//! and the messages a member leaves unacknowledged when it leaves go to another member.
//!
//! A delivery made through a group remembers the group's full filter (`Delivery::share`,
//! stored with it). When the member's session ends (expiry, Clean Start, DISCONNECT with a
//! Session Expiry Interval of 0, an administrative delete) its queued deliveries of every group,
//! and those in flight whose acknowledgement has not come back (a QoS 2 message whose PUBREC
//! came back was received, and is not sent again), are offered to another current member, at
//! their QoS capped by the receiving subscription's. When it unsubscribes from a group, its
//! queued deliveries of that group are; the ones in flight stay with the client, which may
//! still acknowledge them [MQTT-3.10.4-3]. Each one passed on is counted
//! (`Stats::shared_passed_on`); one no member takes is dropped (`no_share_member`), as is
//! one that has expired meanwhile (`expired`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::{BrokerState, SubEntry};
use crate::codec::QoS;
use crate::message::Message;
use crate::router::SharedMatch;
use crate::session::{Delivery, Enqueued, Session};
use crate::stats::DropCause;

impl BrokerState {
    /// Gives `msg` to one member of the shared subscription group `full`
    /// (`$share/{ShareName}/{filter}`), as routing would: cluster mode's delivery to a group,
    /// which NATS chose this node for. A group left without members counts a drop.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn deliver_to_group(
        &self,
        full: &str,
        msg: &Arc<Message>,
        congested: &mut Vec<Arc<Session>>,
    ) {
        if !self.give_to_group(full, msg, congested) {
            self.dropped(None, &msg.topic, DropCause::NoShareMember);
        }
    }

    /// [`BrokerState::deliver_to_group`] without counting a drop: false when no member here
    /// took it (cluster mode then lets JetStream give it to another node).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn give_to_group(
        &self,
        full: &str,
        msg: &Arc<Message>,
        congested: &mut Vec<Arc<Session>>,
    ) -> bool {
        let group = self.index.read().shared_group(full);
        group
            .filter(|sm| !sm.members.is_empty())
            .is_some_and(|sm| self.deliver_shared(&sm, msg, msg.qos, congested))
    }

    /// Gives `msg` to one member of the group `sm`, in turn (MQTT 5.0 section 4.8.2): a
    /// connected one that takes it; when nobody connected does, one member's persistent
    /// session keeps it (QoS 1 and 2). `qos` is the QoS before the member's subscription caps
    /// it. Sessions now at their high-water mark go to `congested`. False when no member took
    /// it (the caller counts the drop).
    pub(crate) fn deliver_shared(
        &self,
        sm: &SharedMatch<SubEntry>,
        msg: &Arc<Message>,
        qos: QoS,
        congested: &mut Vec<Arc<Session>>,
    ) -> bool {
        let readable = |e: &SubEntry| self.may_read(&e.session, &msg.topic);
        let delivery = |e: &SubEntry| {
            let o = &e.granted.options;
            Delivery {
                msg: Arc::clone(msg),
                qos: super::outgoing_qos(qos, o.qos, self.config.server.upgrade_outgoing_qos),
                retain: o.retain_as_published && msg.retain,
                subscription_ids: e.granted.identifier.into_iter().collect(),
                seq: 0,
                share: Some(Arc::clone(&sm.filter)),
            }
        };
        let taken = sm
            .pick(|_, e| {
                if !readable(e) || !e.session.is_connected() {
                    return false;
                }
                match e.session.enqueue(delivery(e), &self.limits) {
                    Enqueued::Queued => true,
                    Enqueued::QueuedOverHighWater => {
                        congested.push(Arc::clone(&e.session));
                        true
                    }
                    Enqueued::Skipped | Enqueued::Dropped(_) => false,
                }
            })
            .is_some();
        taken
            || (qos > QoS::AtMostOnce
                && sm
                    .pick(|_, e| {
                        readable(e) && e.session.enqueue(delivery(e), &self.limits).is_queued()
                    })
                    .is_some())
    }

    /// Passes the deliveries of shared subscriptions that `from`'s session left behind
    /// (ended, or left the group) on to another current member of each one's group. Call it
    /// once `from` is out of the index, with no lock held.
    pub(crate) fn pass_on(&self, from: &str, deliveries: Vec<Delivery>) {
        if deliveries.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut passed = 0u64;
        for q in deliveries {
            let Some(filter) = q.share.as_deref() else {
                continue;
            };
            if q.msg.is_expired(now) {
                self.dropped(Some(from), &q.msg.topic, DropCause::Expired);
                continue;
            }
            let group = self.index.read().shared_group(filter);
            let taken =
                group.is_some_and(|sm| self.deliver_shared(&sm, &q.msg, q.qos, &mut Vec::new()));
            if taken {
                passed += 1;
            } else {
                self.dropped(None, &q.msg.topic, DropCause::NoShareMember);
            }
        }
        if passed > 0 {
            self.stats
                .shared_passed_on
                .fetch_add(passed, Ordering::Relaxed);
            tracing::debug!(
                client_id = from,
                passed,
                "shared subscription messages passed on to other members"
            );
        }
    }
}
