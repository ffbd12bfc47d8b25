//! QoS 1 and 2 between nodes, at least once (docs/cluster.md, "QoS across nodes"): the
//! publishing side's hand-off of a message to the cluster's JetStream stream. Below both
//! `broker` (which offers each QoS 1/2 message it routes: [`ClusterQos::offer`]) and
//! `cluster` (whose JetStream task takes what was offered, publishes it and resolves each
//! [`Gate`]), so that neither imports the other.
//!
//! - Destinations: which other nodes want a topic, from the filters each announces
//!   (`cluster/remote.rs` keeps them here through [`ClusterQos::want`] and
//!   [`ClusterQos::replace`]), in a [`SubscriptionIndex`] whose clients are node names, kept
//!   for a node gone until it is back or for `jetstream_max_age`; shared groups apart, with
//!   the nodes that have members of each: a QoS 1/2 message of a group with members on
//!   another node gets one copy for the group ([`Plan`]), which one of those nodes takes.
//! - A [`Gate`] per message handed off: resolved once JetStream has acknowledged the copy of
//!   every destination node (or when `jetstream_ack_timeout` runs out); the publisher's
//!   PUBACK / PUBREC waits for it.
//! - Bounded: the bytes handed off and not yet acknowledged are counted; over
//!   `jetstream_max_pending_bytes` publishers wait ([`ClusterQos::wait_room`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tokio::sync::{mpsc, Notify};

use crate::codec::QoS;
use crate::message::Message;
use crate::router::SubscriptionIndex;

/// A message handed to the JetStream task: its copy for each destination node and group.
pub(crate) struct Outgoing {
    pub msg: Arc<Message>,
    /// The nodes whose clients want it (each gets its own copy on its own subject).
    pub nodes: Vec<Arc<str>>,
    /// The shared groups (full filters) with members on other nodes that its topic matches:
    /// one copy each, on the group's subject.
    pub groups: Vec<Arc<str>>,
    /// Resolved once JetStream holds every copy.
    pub gate: Arc<Gate>,
    /// What it counts against `jetstream_max_pending_bytes` until then.
    pub cost: u64,
}

/// What became of a handed-off message, as its publisher is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// JetStream acknowledged every copy.
    Held,
    /// `jetstream_ack_timeout` ran out first (the message is still sent when JetStream
    /// takes it).
    TimedOut,
    /// JetStream can never take it (larger than the NATS servers' `max_payload`, properties
    /// that cannot be encoded): counted and logged.
    Refused,
}

/// A QoS 2 message received and not answered yet: its publisher, its packet identifier.
type Receipt = (Arc<str>, u16);

/// What waits for a handed-off message's [`Outcome`].
type Waiter = Box<dyn FnOnce(Outcome) + Send>;

/// One handed-off message's outcome, told to whoever waits for it (the publisher's
/// acknowledgement), once.
pub(crate) struct Gate {
    state: Mutex<GateState>,
    /// When it was handed off, for `jetstream_ack_timeout`.
    pub since: Instant,
}

enum GateState {
    Pending(Vec<Waiter>),
    Done(Outcome),
}

impl Gate {
    fn new() -> Gate {
        Gate {
            state: Mutex::new(GateState::Pending(Vec::new())),
            since: Instant::now(),
        }
    }

    /// Calls `f` with the outcome: now if it is known, else when it is.
    pub(crate) fn on_done(&self, f: Waiter) {
        let mut st = self.state.lock();
        match &mut *st {
            GateState::Pending(waiters) => waiters.push(f),
            GateState::Done(outcome) => {
                let outcome = *outcome;
                drop(st);
                f(outcome);
            }
        }
    }

    /// The outcome, awaited.
    pub(crate) async fn wait(&self) -> Outcome {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.on_done(Box::new(move |outcome| {
            let _ = tx.send(outcome);
        }));
        rx.await.unwrap_or(Outcome::TimedOut)
    }

    /// Sets the outcome (the first one set stays) and tells the waiters, with no lock held.
    pub(crate) fn resolve(&self, outcome: Outcome) {
        let waiters = {
            let mut st = self.state.lock();
            match std::mem::replace(&mut *st, GateState::Done(outcome)) {
                GateState::Pending(w) => w,
                done @ GateState::Done(_) => {
                    *st = done;
                    return;
                }
            }
        };
        for f in waiters {
            f(outcome);
        }
    }

    /// Whether the outcome is known.
    pub(crate) fn is_done(&self) -> bool {
        matches!(*self.state.lock(), GateState::Done(_))
    }
}

/// Where a QoS 1 or 2 message published on this node goes besides its own subscribers,
/// decided once, before it is routed ([`ClusterQos::plan`]).
#[derive(Default)]
pub(crate) struct Plan {
    /// The other nodes whose filters match it.
    nodes: Vec<Arc<str>>,
    /// The shared groups (full filters) matching it with members on another node: one copy
    /// each through JetStream, for whichever node with members takes it; this node's members
    /// of those groups get it only that way.
    groups: Vec<Arc<str>>,
}

impl Plan {
    /// Whether the group `full` gets the message through JetStream (not straight from
    /// routing on this node).
    pub(crate) fn crosses(&self, full: &str) -> bool {
        self.groups.iter().any(|g| &**g == full)
    }

    fn is_empty(&self) -> bool {
        self.nodes.is_empty() && self.groups.is_empty()
    }
}

/// A shared group, as every node announces it.
struct Group {
    /// Its filter (after `$share/{ShareName}/`).
    filter: String,
    /// The nodes with members (`""`: this node).
    nodes: HashSet<Arc<str>>,
}

/// The other nodes' filters, and every node's shared groups.
#[derive(Default)]
struct Destinations {
    /// Filters, by node (the index's "clients" are node names).
    index: SubscriptionIndex<()>,
    /// Each node's filters and shared groups, as announced.
    keys: HashMap<Arc<str>, HashSet<String>>,
    /// Shared groups (full filters) of every node, this one's included.
    groups: HashMap<Arc<str>, Group>,
    /// Nodes gone, since when.
    gone: HashMap<Arc<str>, Instant>,
}

impl Destinations {
    fn change(&mut self, node: &str, key: &str, present: bool) {
        let node: Arc<str> = match self.keys.get_key_value(node) {
            Some((n, _)) => Arc::clone(n),
            None => Arc::from(node),
        };
        let keys = self.keys.entry(Arc::clone(&node)).or_default();
        let changed = if present {
            keys.insert(key.to_string())
        } else {
            keys.remove(key)
        };
        if keys.is_empty() {
            self.keys.remove(&node);
        }
        if !changed {
            return;
        }
        if let Ok(Some(shared)) = crate::topic::parse_shared(key) {
            if present {
                self.groups
                    .entry(Arc::from(key))
                    .or_insert_with(|| Group {
                        filter: shared.filter.to_string(),
                        nodes: HashSet::new(),
                    })
                    .nodes
                    .insert(node);
            } else if let Some(g) = self.groups.get_mut(key) {
                g.nodes.remove(&node);
                if g.nodes.is_empty() {
                    self.groups.remove(key);
                }
            }
            return;
        }
        if node.is_empty()
            || crate::topic::validate_topic_filter(key).is_err()
            || key.starts_with('$')
        {
            return;
        }
        if present {
            self.index.insert(key, node, ());
        } else {
            self.index.remove(key, &node);
        }
    }
}

/// The publishing side of QoS 1 and 2 between nodes; off (hands nothing off) until the
/// cluster's JetStream task starts it.
#[derive(Default)]
pub(crate) struct ClusterQos {
    out: OnceLock<mpsc::UnboundedSender<Outgoing>>,
    /// Which nodes want which topics. Lock: a leaf.
    destinations: RwLock<Destinations>,
    /// Bytes handed off, not yet acknowledged by JetStream.
    pending: AtomicU64,
    /// Messages handed off, not yet acknowledged by JetStream.
    pending_messages: AtomicU64,
    max_pending: AtomicU64,
    /// Publishers waiting for `pending` to go under `max_pending` set it first.
    waiting: AtomicBool,
    room: Notify,
    timeout: OnceLock<Duration>,
    /// The gates of the messages handed off, oldest first, for `jetstream_ack_timeout`
    /// ([`ClusterQos::expire`]). Lock: a leaf.
    gates: Mutex<VecDeque<Arc<Gate>>>,
    /// The gates of QoS 2 messages received (PUBREC owed), by publisher and packet
    /// identifier, until resolved: a resent PUBLISH's PUBREC waits for its first copy's
    /// gate ([`ClusterQos::receipt`]). Pruned by [`ClusterQos::expire`]; at most
    /// `receive_maximum` a publisher. Lock: a leaf.
    receipts: Mutex<HashMap<Receipt, Arc<Gate>>>,
}

impl ClusterQos {
    /// Starts handing off: messages go to `out`; `max_pending` bytes at most wait for
    /// JetStream before publishers wait; a publisher's acknowledgement waits `timeout` at
    /// most.
    pub(crate) fn start(
        &self,
        out: mpsc::UnboundedSender<Outgoing>,
        max_pending: u64,
        timeout: Duration,
    ) {
        self.max_pending.store(max_pending, Ordering::Relaxed);
        let _ = self.timeout.set(timeout);
        let _ = self.out.set(out);
    }

    /// `jetstream_ack_timeout`.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
            .get()
            .copied()
            .unwrap_or(Duration::from_secs(30))
    }

    /// Node `node` wants (`present`) or no longer wants the filter or shared group `key`
    /// (`""`: this node's own shared groups).
    pub(crate) fn want(&self, node: &str, key: &str, present: bool) {
        let mut d = self.destinations.write();
        d.gone.remove(node);
        d.change(node, key, present);
    }

    /// Node `node`'s whole set of filters and shared groups, replacing what was known.
    pub(crate) fn replace(&self, node: &str, keys: &HashSet<String>) {
        let mut d = self.destinations.write();
        d.gone.remove(node);
        let known = d.keys.get(node).cloned().unwrap_or_default();
        for k in keys.difference(&known) {
            d.change(node, k, true);
        }
        for k in known.difference(keys) {
            d.change(node, k, false);
        }
    }

    /// Node `node` is gone (stopped, crashed, or cut off): its filters stay destinations, so
    /// that what its persistent sessions want waits in JetStream for its return, for
    /// `max_age` (the stream's `jetstream_max_age`: what is older is gone from the stream
    /// anyway), then go ([`ClusterQos::forget_gone`]).
    pub(crate) fn gone(&self, node: &str) {
        let mut d = self.destinations.write();
        if d.keys.contains_key(node) {
            d.gone.entry(Arc::from(node)).or_insert_with(Instant::now);
        }
    }

    /// Forgets the filters of the nodes gone for longer than `max_age`.
    pub(crate) fn forget_gone(&self, max_age: Duration) {
        if self.destinations.read().gone.is_empty() {
            return;
        }
        let mut d = self.destinations.write();
        let now = Instant::now();
        let old: Vec<Arc<str>> = d
            .gone
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= max_age)
            .map(|(n, _)| Arc::clone(n))
            .collect();
        for node in old {
            d.gone.remove(&node);
            let keys = d.keys.get(&*node).cloned().unwrap_or_default();
            for k in &keys {
                d.change(&node, k, false);
            }
        }
    }

    /// Whether handing off is on.
    pub(crate) fn is_on(&self) -> bool {
        self.out.get().is_some()
    }

    /// Where `msg`, published on this node, goes through JetStream: `None` when nothing
    /// does (off, QoS 0, a `$` topic), else the other nodes whose filters match it and the
    /// shared groups matching it with members on another node (a node gone included: the
    /// message waits for it, or for another node with members). Decided once per message:
    /// routing delivers to this node's members of the other groups ([`Plan::crosses`]),
    /// [`ClusterQos::offer`] hands off the rest.
    pub(crate) fn plan(&self, msg: &Message) -> Option<Plan> {
        self.out.get()?;
        if msg.qos == QoS::AtMostOnce || msg.topic.starts_with('$') {
            return None;
        }
        let d = self.destinations.read();
        let mut plan = Plan::default();
        if !d.index.is_empty() {
            plan.nodes = d
                .index
                .matches(&msg.topic)
                .clients
                .iter()
                .map(|c| Arc::clone(&c.client))
                .collect();
        }
        for (full, g) in &d.groups {
            if g.nodes.iter().any(|n| !n.is_empty()) && crate::topic::matches(&g.filter, &msg.topic)
            {
                plan.groups.push(Arc::clone(full));
            }
        }
        Some(plan)
    }

    /// Hands `msg` (published on this node) to JetStream as `plan` ([`ClusterQos::plan`])
    /// says; the gate tells when JetStream holds every copy. `None`: nothing handed off
    /// (no plan, or no other node or group wants it), and nothing to wait for.
    pub(crate) fn offer(&self, msg: &Arc<Message>, plan: Option<Plan>) -> Option<Arc<Gate>> {
        let out = self.out.get()?;
        let plan = plan.filter(|p| !p.is_empty())?;
        let gate = Arc::new(Gate::new());
        let cost = (msg.size() * (plan.nodes.len() + plan.groups.len())) as u64;
        self.pending.fetch_add(cost, Ordering::SeqCst);
        self.pending_messages.fetch_add(1, Ordering::Relaxed);
        let outgoing = Outgoing {
            msg: Arc::clone(msg),
            nodes: plan.nodes,
            groups: plan.groups,
            gate: Arc::clone(&gate),
            cost,
        };
        self.gates.lock().push_back(Arc::clone(&gate));
        if out.send(outgoing).is_err() {
            // The task is gone (shutting down): nothing will hold it.
            self.pending.fetch_sub(cost, Ordering::SeqCst);
            self.pending_messages.fetch_sub(1, Ordering::Relaxed);
            gate.resolve(Outcome::TimedOut);
        }
        Some(gate)
    }

    /// The QoS 2 message `packet_id` of `client_id` waits for `gate` before its PUBREC.
    pub(crate) fn await_receipt(&self, client_id: &Arc<str>, packet_id: u16, gate: &Arc<Gate>) {
        if !gate.is_done() {
            let key = (Arc::clone(client_id), packet_id);
            self.receipts.lock().insert(key, Arc::clone(gate));
        }
    }

    /// The gate the QoS 2 message `packet_id` of `client_id` still waits for, if any: a
    /// resent copy's PUBREC waits for it too.
    pub(crate) fn receipt(&self, client_id: &str, packet_id: u16) -> Option<Arc<Gate>> {
        let key: Receipt = (Arc::from(client_id), packet_id);
        let mut receipts = self.receipts.lock();
        match receipts.get(&key) {
            Some(g) if !g.is_done() => Some(Arc::clone(g)),
            Some(_) => {
                receipts.remove(&key);
                None
            }
            None => None,
        }
    }

    /// A handed-off message of `cost` bytes left the pending set (acknowledged by
    /// JetStream, or dropped at stop).
    pub(crate) fn settled(&self, cost: u64) {
        self.pending_messages.fetch_sub(1, Ordering::Relaxed);
        let before = self.pending.fetch_sub(cost, Ordering::SeqCst);
        let max = self.max_pending.load(Ordering::Relaxed);
        if before.saturating_sub(cost) <= max && self.waiting.load(Ordering::SeqCst) {
            self.waiting.store(false, Ordering::SeqCst);
            self.room.notify_waiters();
        }
    }

    /// Resolves as [`Outcome::TimedOut`] the gates handed off more than
    /// `jetstream_ack_timeout` ago and still pending, and forgets the resolved ones; their
    /// messages are still sent. Returns how many timed out.
    pub(crate) fn expire(&self) -> usize {
        let timeout = self.timeout();
        let now = Instant::now();
        let mut late = Vec::new();
        {
            let mut gates = self.gates.lock();
            while let Some(g) = gates.front() {
                if g.is_done() {
                    gates.pop_front();
                } else if now.duration_since(g.since) >= timeout {
                    late.extend(gates.pop_front());
                } else {
                    break;
                }
            }
        }
        // Told with no lock held: a waiter closes a connection.
        for g in &late {
            g.resolve(Outcome::TimedOut);
        }
        {
            let mut receipts = self.receipts.lock();
            if !receipts.is_empty() {
                receipts.retain(|_, g| !g.is_done());
            }
        }
        late.len()
    }

    /// What waits for JetStream's acknowledgement now: (bytes, messages). A message's bytes
    /// are its size once per destination node and group (what `jetstream_max_pending_bytes`
    /// bounds).
    pub(crate) fn pending(&self) -> (u64, u64) {
        (
            self.pending.load(Ordering::Relaxed),
            self.pending_messages.load(Ordering::Relaxed),
        )
    }

    /// Whether more than `jetstream_max_pending_bytes` wait for JetStream.
    pub(crate) fn over(&self) -> bool {
        self.is_on()
            && self.pending.load(Ordering::Relaxed) > self.max_pending.load(Ordering::Relaxed)
    }

    /// Waits while more than `jetstream_max_pending_bytes` wait for JetStream, for
    /// `jetstream_ack_timeout` at most (the acknowledgements the publisher is owed have
    /// timed out by then, and its connection is closed).
    pub(crate) async fn wait_room(&self) {
        let deadline = tokio::time::Instant::now() + self.timeout();
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            self.waiting.store(true, Ordering::SeqCst);
            if !self.over() {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn message(topic: &str, qos: QoS) -> Arc<Message> {
        Arc::new(Message::for_test(topic, Bytes::from_static(b"x"), qos))
    }

    /// A message published here, planned and offered.
    fn offer(qos: &ClusterQos, m: Arc<Message>) -> Option<Arc<Gate>> {
        let plan = qos.plan(&m);
        qos.offer(&m, plan)
    }

    fn started() -> (ClusterQos, mpsc::UnboundedReceiver<Outgoing>) {
        let qos = ClusterQos::default();
        let (tx, rx) = mpsc::unbounded_channel();
        qos.start(tx, 1000, Duration::from_secs(30));
        (qos, rx)
    }

    #[test]
    fn a_gate_tells_its_first_outcome_to_every_waiter_once() {
        let gate = Gate::new();
        let told = Arc::new(Mutex::new(Vec::new()));
        let t = Arc::clone(&told);
        gate.on_done(Box::new(move |o| t.lock().push(o)));
        assert!(!gate.is_done());
        gate.resolve(Outcome::Held);
        gate.resolve(Outcome::TimedOut);
        let t = Arc::clone(&told);
        gate.on_done(Box::new(move |o| t.lock().push(o)));
        assert_eq!(*told.lock(), [Outcome::Held, Outcome::Held]);
    }

    #[test]
    fn only_qos_1_and_2_messages_other_nodes_want_are_handed_off() {
        let (qos, mut rx) = started();
        qos.want("b", "a/+", true);
        qos.want("c", "a/x", true);
        qos.want("c", "$share/g/z/#", true);
        qos.want("", "$share/h/y", true);
        // Off, QoS 0, `$` topics, topics nobody else wants, a group with members here only:
        // nothing to wait for.
        assert!(offer(&ClusterQos::default(), message("a/x", QoS::AtLeastOnce)).is_none());
        assert!(offer(&qos, message("a/x", QoS::AtMostOnce)).is_none());
        assert!(offer(&qos, message("$x/a", QoS::AtLeastOnce)).is_none());
        assert!(offer(&qos, message("w", QoS::AtLeastOnce)).is_none());
        let local = message("y", QoS::ExactlyOnce);
        let plan = qos.plan(&local).expect("planned");
        assert!(!plan.crosses("$share/h/y"), "delivered here by routing");
        assert!(qos.offer(&local, Some(plan)).is_none());
        let gate = offer(&qos, message("a/x", QoS::ExactlyOnce)).expect("handed off");
        let out = rx.try_recv().expect("queued");
        let mut nodes: Vec<&str> = out.nodes.iter().map(|n| &**n).collect();
        nodes.sort();
        assert_eq!(nodes, ["b", "c"]);
        assert!(out.groups.is_empty());
        assert_eq!(out.cost, 2 * message("a/x", QoS::ExactlyOnce).size() as u64);
        assert!(!gate.is_done());
        qos.settled(out.cost);
        // A group with members on another node: one copy for the group, whatever the number
        // of its nodes, this one's members taking it through JetStream too.
        qos.want("b", "$share/h/y", true);
        qos.want("", "$share/g/z/#", true);
        let plan = qos
            .plan(&message("z/1", QoS::AtLeastOnce))
            .expect("planned");
        assert!(plan.crosses("$share/g/z/#") && !plan.crosses("$share/h/y"));
        offer(&qos, message("z/1", QoS::AtLeastOnce)).expect("for g");
        let out = rx.try_recv().expect("queued");
        assert!(out.nodes.is_empty());
        assert_eq!(out.groups, [Arc::from("$share/g/z/#")]);
        offer(&qos, message("y", QoS::AtLeastOnce)).expect("for h");
        assert_eq!(rx.try_recv().expect("queued").groups.len(), 1);
        // A node's whole set replaces what was known: c leaves g, which stays on this node
        // alone.
        qos.replace("c", &HashSet::from(["q".to_string()]));
        assert!(offer(&qos, message("z/1", QoS::AtLeastOnce)).is_none());
        offer(&qos, message("a/x", QoS::AtLeastOnce)).expect("b");
        assert_eq!(rx.try_recv().expect("queued").nodes.len(), 1);
        offer(&qos, message("q", QoS::AtLeastOnce)).expect("c");
    }

    #[test]
    fn a_node_gone_stays_a_destination_until_max_age() {
        let (qos, _rx) = started();
        qos.want("b", "t", true);
        qos.gone("b");
        qos.forget_gone(Duration::from_secs(3600));
        assert!(offer(&qos, message("t", QoS::AtLeastOnce)).is_some());
        // Back: no longer gone.
        qos.want("b", "u", true);
        qos.forget_gone(Duration::ZERO);
        assert!(offer(&qos, message("t", QoS::AtLeastOnce)).is_some());
        qos.gone("b");
        qos.forget_gone(Duration::ZERO);
        assert!(offer(&qos, message("t", QoS::AtLeastOnce)).is_none());
        assert!(offer(&qos, message("u", QoS::AtLeastOnce)).is_none());
    }

    #[test]
    fn pending_bytes_over_the_bound_hold_publishers_until_settled() {
        let (qos, mut rx) = started();
        qos.want("b", "#", true);
        let mut costs = 0;
        while !qos.over() {
            offer(&qos, message("t", QoS::AtLeastOnce)).expect("handed off");
            costs += rx.try_recv().expect("queued").cost;
        }
        assert!(costs > 1000);
        let (bytes, messages) = qos.pending();
        assert_eq!(bytes, costs);
        for _ in 1..messages {
            qos.settled(0);
        }
        qos.settled(costs);
        assert!(!qos.over());
        assert_eq!(qos.pending(), (0, 0));
    }

    #[test]
    fn gates_older_than_the_timeout_are_told_timed_out() {
        let qos = ClusterQos::default();
        let (tx, _rx) = mpsc::unbounded_channel();
        qos.start(tx, 1000, Duration::ZERO);
        qos.want("b", "t", true);
        let held = offer(&qos, message("t", QoS::AtLeastOnce)).expect("a");
        held.resolve(Outcome::Held);
        let late = offer(&qos, message("t", QoS::AtLeastOnce)).expect("b");
        assert_eq!(qos.expire(), 1);
        assert!(late.is_done());
        let told = Arc::new(Mutex::new(None));
        let t = Arc::clone(&told);
        late.on_done(Box::new(move |o| *t.lock() = Some(o)));
        assert_eq!(*told.lock(), Some(Outcome::TimedOut));
        assert_eq!(qos.expire(), 0);
    }
}
