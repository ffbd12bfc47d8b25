//! The write plan: a batch of changes reduced to what it leaves in the database, per client and
//! table, as few statements as that takes, then written as one pipelined transaction under the
//! fence lock.

use std::collections::{BTreeMap, HashMap};

use tokio_postgres::types::ToSql;
use tokio_postgres::Statement;

use super::schema::CHUNK_MAX;
use super::statements::Statements;
use super::{classify, WriteConnection};
use crate::change::{refused, Change};
use crate::error::StorageError;
use crate::records::{
    DeliveryRecord, InflightRecord, MessageRecord, RetainedRecord, SessionHeader, StoredMessage,
    StreamEntryRecord, SubscriptionRecord, WillRecord,
};
use crate::refs::Refs;
use crate::rows::encode_ids;

type Param = Box<dyn ToSql + Sync + Send>;

/// One statement of a batch: which change it serves, whether it must touch a row (an
/// addition to a session that must be stored).
struct Op<'a> {
    index: usize,
    statement: &'a Statement,
    params: Vec<Param>,
    must_touch: bool,
}

fn int(v: impl Into<i64>) -> Param {
    Box::new(v.into())
}

fn big(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn text(v: &str) -> Param {
    Box::new(v.to_string())
}

fn header_params(h: &SessionHeader) -> Vec<Param> {
    vec![
        text(&h.client_id),
        int(h.protocol_level),
        int(h.session_expiry_interval),
        Box::new(h.disconnected_at.map(big)),
        Box::new(h.username.clone()),
        Box::new(h.certificate.clone()),
    ]
}

fn will_params(id: &str, will: Option<&WillRecord>) -> Vec<Param> {
    let m = will.map(|w| &w.message);
    vec![
        text(id),
        Box::new(m.map(|m| m.topic.clone())),
        Box::new(m.map(|m| m.payload.to_vec())),
        Box::new(m.map(|m| i64::from(m.qos))),
        Box::new(m.map(|m| m.retain)),
        Box::new(m.map(|m| m.properties.to_vec())),
        Box::new(m.and_then(|m| m.expires_at.map(big))),
        Box::new(m.and_then(|m| m.publisher.clone())),
        Box::new(will.map(|w| i64::from(w.delay_interval))),
    ]
}

fn subscription_params(id: &str, s: &SubscriptionRecord) -> Vec<Param> {
    vec![
        text(id),
        text(&s.filter),
        int(s.qos),
        Box::new(s.no_local),
        Box::new(s.retain_as_published),
        int(s.retain_handling),
        Box::new(s.subscription_identifier.map(i64::from)),
    ]
}

fn delivery_params(d: &DeliveryRecord) -> Vec<Param> {
    vec![
        Box::new(big(d.message_id)),
        int(d.qos),
        Box::new(d.retain),
        Box::new(encode_ids(&d.subscription_ids)),
        Box::new(d.share.clone()),
    ]
}

fn inflight_params(id: &str, f: &InflightRecord) -> Vec<Param> {
    let mut params = vec![text(id), int(f.packet_id), text(f.state.as_str())];
    params.extend(delivery_params(&f.delivery));
    params
}

/// The statement storing `messages` (ids stored already are left as they are).
fn store_op<'a>(
    s: &'a Statements,
    index: usize,
    messages: &[&StoredMessage],
    out: &mut Vec<Op<'a>>,
) {
    if messages.is_empty() {
        return;
    }
    let mut c = StoredColumns::default();
    for m in messages {
        c.push(m);
    }
    out.push(Op {
        index,
        statement: &s.store_many,
        params: c.into_params(),
        must_touch: false,
    });
}

/// The statements of a session change (`SessionSaved`, `SessionWritten`, `SessionDeleted`),
/// in order.
fn ops_of<'a>(
    s: &'a Statements,
    index: usize,
    change: &Change,
    refs: &mut Refs,
    out: &mut Vec<Op<'a>>,
) {
    match change {
        Change::SessionSaved(h) => out.push(Op {
            index,
            statement: &s.save_header,
            params: header_params(h),
            must_touch: false,
        }),
        Change::SessionWritten(r, messages) => {
            let messages: Vec<&StoredMessage> = messages.iter().collect();
            store_op(s, index, &messages, out);
            let mut push = |statement: &'a Statement, params: Vec<Param>, must_touch: bool| {
                out.push(Op {
                    index,
                    statement,
                    params,
                    must_touch,
                })
            };
            for statement in &s.delete_children {
                push(statement, vec![text(&r.client_id)], false);
            }
            push(&s.delete_session, vec![text(&r.client_id)], false);
            push(&s.save_header, header_params(&r.header()), false);
            push(
                &s.set_will,
                will_params(&r.client_id, r.will.as_ref()),
                false,
            );
            for sub in &r.subscriptions {
                push(
                    &s.add_subscription,
                    subscription_params(&r.client_id, sub),
                    false,
                );
            }
            if !r.queued.is_empty() {
                let mut queued: Vec<(u64, &DeliveryRecord)> =
                    r.queued.iter().map(|q| (q.seq, &q.delivery)).collect();
                queued.sort_by_key(|(seq, _)| *seq);
                queued.dedup_by_key(|(seq, _)| *seq);
                let mut q = QueueColumns::default();
                for (_, delivery) in &queued {
                    refs.add(delivery.message_id, index);
                }
                q.push_client(&r.client_id, queued);
                push(&s.queue_chunks, q.into_params(), false);
            }
            for f in &r.inflight {
                push(&s.set_inflight, inflight_params(&r.client_id, f), false);
            }
            for id in &r.inbound_qos2 {
                push(&s.add_inbound, vec![text(&r.client_id), int(*id)], false);
            }
        }
        Change::SessionDeleted { client_id } => {
            for statement in s.delete_children.iter().chain([&s.delete_session]) {
                out.push(Op {
                    index,
                    statement,
                    params: vec![text(client_id)],
                    must_touch: false,
                });
            }
        }
        _ => unreachable!("planned with the other changes of its run, see `plan`"),
    }
}

/// The statements of `batch`, fewer than one per change: what the batch leaves in the
/// database, not every step to it.
///
/// The changes of different clients touch different rows (and those of the retained set
/// rows of their own), so each client's changes are planned apart, in order. For one client,
/// a session change (`SessionSaved`, `SessionWritten`, `SessionDeleted`) is written as it
/// comes; between two of them (a "run"), each table gets what the run leaves for each key
/// (the last change of a queued seq, of a packet identifier, of a filter; the will) as at
/// most one multi-row DELETE and one multi-row INSERT. So a message queued then dequeued, or
/// an in-flight entry set then removed, in the same batch costs only the DELETE (which finds
/// nothing if the row was never stored), and a drained message costs no in-flight row when
/// its acknowledgement is in the same batch.
///
/// Queues are stored in chunks (`mercurio_queue_chunks`, schema version 7): what a run
/// leaves in a queue is one `unqueue` of every position it touches (the chunks holding them
/// rewritten without them) and one `queue_chunks` of what it queues (new chunks); the clients
/// whose only changes are deliveries queued (a fan-out) share one of each, so a fan-out to N
/// sessions writes about N chunk rows per batch, not a row per delivery. Each message counts
/// its queued references (`refs`): a removal counts its own down, and the batch adds what it
/// queued with one statement at the end, which also refuses a reference to a message that
/// is not stored (the foreign key of schema 6 did).
///
/// What the database refuses is unchanged: a run with an addition (subscription, will,
/// message, in-flight entry, inbound identifier) for a session that is not stored is refused
/// even when a later change of the run cancels it (a `SELECT` that must find the session),
/// and the batch is one transaction as before.
fn plan<'a>(s: &'a Statements, batch: &[Change], out: &mut Vec<Op<'a>>) {
    // The messages stored by the batch go first: the references to them come later in the
    // batch (a message is stored before its first reference). Releases go last: nothing
    // refers to a message again once it is released.
    // A stream segment's messages too, each released at once (its entry is its only
    // reference, and the release keeps it while the entry is there).
    let mut stored = StoredColumns::default();
    let mut first_stored = None;
    let mut released: Vec<i64> = Vec::new();
    let mut first_release = None;
    for (index, change) in batch.iter().enumerate() {
        match change {
            Change::MessageStored { message } => {
                first_stored.get_or_insert(index);
                stored.push(message);
            }
            Change::StreamSegment { entries, .. } => {
                for a in entries {
                    first_stored.get_or_insert(index);
                    first_release.get_or_insert(index);
                    stored.push_record(a.entry.message_id, &a.message);
                    released.push(big(a.entry.message_id));
                }
            }
            _ => {}
        }
    }
    if let Some(index) = first_stored {
        out.push(Op {
            index,
            statement: &s.store_many,
            params: stored.into_params(),
            must_touch: false,
        });
    }
    let mut removes = None;
    let mut appends = Appends::default();
    // Each client's changes (None: the retained set), in order of first appearance.
    let mut groups: Vec<(Option<&str>, Vec<usize>)> = Vec::new();
    let mut position: HashMap<Option<&str>, usize> = HashMap::new();
    for (index, change) in batch.iter().enumerate() {
        match change {
            Change::MessageStored { .. } => continue,
            Change::MessageReleased { id } => {
                released.push(big(*id));
                first_release.get_or_insert(index);
                continue;
            }
            Change::SessionWritten(..)
            | Change::SessionDeleted { .. }
            | Change::MessageQueued { .. }
            | Change::MessageDequeued { .. }
            | Change::InflightSet { .. }
            | Change::InflightRemoved { .. } => {
                removes.get_or_insert(index);
            }
            Change::StreamAppended { stream, entry } => {
                // A stream's appends in a row are one statement each way.
                if !appends.add(index, stream, entry) {
                    appends.plan(s, out);
                    appends.add(index, stream, entry);
                }
                continue;
            }
            Change::StreamSegment { stream, entries } => {
                for a in entries {
                    if !appends.add(index, stream, &a.entry) {
                        appends.plan(s, out);
                        appends.add(index, stream, &a.entry);
                    }
                }
                continue;
            }
            Change::StreamDefined { .. }
            | Change::StreamTrimmed { .. }
            | Change::StreamEntryRemoved { .. }
            | Change::StreamDeleted { .. } => {
                // In batch order, after the messages they refer to (stored first). Removals
                // delete the released messages they leave unreferenced themselves (no sweep
                // over every released message, a long stream's included).
                appends.plan(s, out);
                stream_ops(s, index, change, out);
                continue;
            }
            _ => {}
        }
        let key = change.client_id();
        let at = *position.entry(key).or_insert_with(|| {
            groups.push((key, Vec::new()));
            groups.len() - 1
        });
        groups[at].1.push(index);
    }
    appends.plan(s, out);
    // Clients whose changes in the batch are deliveries queued and nothing else (a
    // fan-out): one statement for all of them, and one check that their sessions are stored.
    let mut fanout = Fanout::default();
    // The queued references the batch adds, per message.
    let mut refs = Refs::default();
    for (client_id, indices) in groups {
        let Some(client_id) = client_id else {
            plan_retained(s, batch, &indices, out);
            continue;
        };
        if fanout.take(client_id, batch, &indices) {
            continue;
        }
        // Whether the session is stored for sure: created earlier in this batch.
        let mut created = false;
        let mut run = Run::default();
        for index in indices {
            let change = &batch[index];
            match change {
                Change::SessionSaved(_)
                | Change::SessionWritten(..)
                | Change::SessionDeleted { .. } => {
                    std::mem::take(&mut run).plan(s, client_id, created, &mut refs, out);
                    ops_of(s, index, change, &mut refs, out);
                    created = change.creates_session();
                }
                _ => run.add(index, change),
            }
        }
        run.plan(s, client_id, created, &mut refs, out);
    }
    fanout.plan(s, &mut refs, out);
    // Each message's count of queued references goes up by what the batch queued (the
    // removals counted theirs down as they ran); refused if one of them is not stored.
    let added = refs.take();
    if let Some(index) = added.values().filter_map(|d| d.first_addition).min() {
        let ids: Vec<i64> = added.keys().map(|id| big(*id)).collect();
        let counts: Vec<i64> = added.values().map(|d| d.net).collect();
        out.push(Op {
            index,
            statement: &s.add_refs,
            params: vec![Box::new(ids), Box::new(counts)],
            must_touch: true,
        });
    }
    if let Some(index) = first_release {
        for statement in [&s.release_unreferenced, &s.mark_released] {
            out.push(Op {
                index,
                statement,
                params: vec![Box::new(released.clone())],
                must_touch: false,
            });
        }
    }
    if let Some(index) = removes {
        out.push(Op {
            index,
            statement: &s.delete_released,
            params: Vec::new(),
            must_touch: false,
        });
    }
}

/// Appends to one stream in a row of the batch: one `stream_next` and one multi-row
/// `stream_append` for all of them, instead of two statements per message.
#[derive(Default)]
struct Appends<'b> {
    /// The batch index of the first append, and its stream.
    first: Option<(usize, &'b str)>,
    /// Offset -> (time_ms, message id): an offset appended twice keeps its last entry, as
    /// two statements in a row would (one statement may not write a row twice).
    entries: BTreeMap<u64, (u64, u64)>,
}

impl<'b> Appends<'b> {
    /// Adds the append at `index`; false (nothing added) when the run holds another stream's.
    fn add(&mut self, index: usize, stream: &'b str, entry: &StreamEntryRecord) -> bool {
        match self.first {
            Some((_, other)) if other != stream => return false,
            Some(_) => {}
            None => self.first = Some((index, stream)),
        }
        self.entries
            .insert(entry.offset, (entry.time_ms, entry.message_id));
        true
    }

    /// The run's statements, and a new run.
    fn plan<'a>(&mut self, s: &'a Statements, out: &mut Vec<Op<'a>>) {
        let Some((index, stream)) = self.first.take() else {
            return;
        };
        let entries = std::mem::take(&mut self.entries);
        let next = entries
            .keys()
            .next_back()
            .map_or(0, |o| big(*o).saturating_add(1));
        let offsets: Vec<i64> = entries.keys().map(|o| big(*o)).collect();
        let times: Vec<i64> = entries.values().map(|(t, _)| big(*t)).collect();
        let ids: Vec<i64> = entries.values().map(|(_, id)| big(*id)).collect();
        out.push(Op {
            index,
            statement: &s.stream_next,
            params: vec![text(stream), int(next)],
            must_touch: false,
        });
        out.push(Op {
            index,
            statement: &s.stream_append,
            params: vec![
                text(stream),
                Box::new(offsets),
                Box::new(times),
                Box::new(ids),
            ],
            must_touch: false,
        });
    }
}

/// A stream's change as its statements.
fn stream_ops<'a>(s: &'a Statements, index: usize, change: &Change, out: &mut Vec<Op<'a>>) {
    let mut op = |statement: &'a Statement, params: Vec<Param>| {
        out.push(Op {
            index,
            statement,
            params,
            must_touch: false,
        })
    };
    match change {
        Change::StreamDefined {
            stream,
            definition: d,
        } => op(
            &s.stream_define,
            vec![
                text(stream),
                text(&d.filter),
                int(big(d.max_age)),
                int(big(d.max_bytes)),
                Box::new(d.last_value),
            ],
        ),
        // Planned by `Appends`, a run of them at a time.
        Change::StreamAppended { .. } => {}
        Change::StreamTrimmed { stream, below } => {
            op(&s.stream_trim, vec![text(stream), int(big(*below))]);
            op(&s.stream_next, vec![text(stream), int(big(*below))]);
        }
        Change::StreamEntryRemoved { stream, offset } => {
            op(
                &s.stream_remove_entry,
                vec![text(stream), int(big(*offset))],
            );
        }
        Change::StreamDeleted { stream } => {
            op(&s.stream_delete_entries, vec![text(stream)]);
            op(&s.stream_delete, vec![text(stream)]);
        }
        _ => {}
    }
}

/// What the last change of a key in a run leaves: `Some` stored, `None` removed; with the
/// index of the first change of the run on that key (for error messages).
type Last<'c, T> = (usize, Option<&'c T>);

/// The changes of one client between two session changes, reduced to what they leave.
#[derive(Default)]
struct Run<'c> {
    /// The first addition of the run, if any: the session must be stored.
    first_addition: Option<usize>,
    will: Option<Last<'c, WillRecord>>,
    subscriptions: BTreeMap<&'c str, Last<'c, SubscriptionRecord>>,
    queued: BTreeMap<u64, Last<'c, DeliveryRecord>>,
    inflight: BTreeMap<u16, InflightLast<'c>>,
    inbound: BTreeMap<u16, Last<'c, ()>>,
}

struct InflightLast<'c> {
    /// The first change of the run on this packet identifier.
    index: usize,
    /// Removed at some point of the run: a stored entry is deleted, and a later set makes a
    /// new entry (it goes last).
    removed: bool,
    /// Set after the last removal, if any.
    last: Option<&'c InflightRecord>,
    /// The position of the first set after the last removal: the order of new entries.
    rank: usize,
}

fn keep<'c, K: Ord, T>(map: &mut BTreeMap<K, Last<'c, T>>, key: K, index: usize, v: Option<&'c T>) {
    map.entry(key).or_insert((index, None)).1 = v;
}

impl<'c> Run<'c> {
    fn add(&mut self, index: usize, change: &'c Change) {
        let addition = matches!(
            change,
            Change::SubscriptionAdded { .. }
                | Change::WillSet { .. }
                | Change::MessageQueued { .. }
                | Change::InflightSet { .. }
                | Change::InboundQos2Added { .. }
        );
        if addition && self.first_addition.is_none() {
            self.first_addition = Some(index);
        }
        match change {
            Change::SubscriptionAdded { subscription, .. } => keep(
                &mut self.subscriptions,
                &subscription.filter,
                index,
                Some(subscription),
            ),
            Change::SubscriptionRemoved { filter, .. } => {
                keep(&mut self.subscriptions, filter, index, None)
            }
            Change::WillSet { will, .. } => {
                let first = self.will.map_or(index, |(first, _)| first);
                self.will = Some((first, Some(will)));
            }
            Change::WillCleared { .. } => {
                let first = self.will.map_or(index, |(first, _)| first);
                self.will = Some((first, None));
            }
            Change::MessageQueued { seq, delivery, .. } => {
                keep(&mut self.queued, *seq, index, Some(delivery))
            }
            Change::MessageDequeued { seq, .. } => keep(&mut self.queued, *seq, index, None),
            Change::InflightSet { inflight, .. } => {
                let entry = self
                    .inflight
                    .entry(inflight.packet_id)
                    .or_insert(InflightLast {
                        index,
                        removed: false,
                        last: None,
                        rank: index,
                    });
                if entry.last.is_none() {
                    entry.rank = index;
                }
                entry.last = Some(inflight);
            }
            Change::InflightRemoved { packet_id, .. } => {
                let entry = self.inflight.entry(*packet_id).or_insert(InflightLast {
                    index,
                    removed: false,
                    last: None,
                    rank: index,
                });
                entry.removed = true;
                entry.last = None;
            }
            Change::InboundQos2Added { packet_id, .. } => {
                keep(&mut self.inbound, *packet_id, index, Some(&()))
            }
            Change::InboundQos2Removed { packet_id, .. } => {
                keep(&mut self.inbound, *packet_id, index, None)
            }
            Change::SessionSaved(_)
            | Change::SessionWritten(..)
            | Change::SessionDeleted { .. }
            | Change::RetainedSet(_)
            | Change::RetainedDeleted { .. }
            | Change::MessageStored { .. }
            | Change::MessageReleased { .. }
            | Change::StreamDefined { .. }
            | Change::StreamAppended { .. }
            | Change::StreamSegment { .. }
            | Change::StreamTrimmed { .. }
            | Change::StreamEntryRemoved { .. }
            | Change::StreamDeleted { .. } => unreachable!("not part of a run"),
        }
    }

    /// The statements of the run; `created`: the session was created earlier in the batch.
    fn plan<'a>(
        self,
        s: &'a Statements,
        client_id: &str,
        created: bool,
        refs: &mut Refs,
        out: &mut Vec<Op<'a>>,
    ) {
        let mut push = |index: usize, statement: &'a Statement, params: Vec<Param>, must_touch| {
            out.push(Op {
                index,
                statement,
                params,
                must_touch,
            })
        };
        if let Some(index) = self.first_addition.filter(|_| !created) {
            push(index, &s.exists, vec![text(client_id)], true);
        }
        if let Some((index, will)) = self.will {
            push(index, &s.set_will, will_params(client_id, will), false);
        }
        // Deletions first: they and the insertions of the same table have no key in common.
        let Split {
            removed,
            set,
            first_set,
        } = split(&self.subscriptions);
        if let Some(index) = removed.first().map(|(index, _)| *index) {
            let filters: Vec<String> = removed.iter().map(|(_, f)| f.to_string()).collect();
            push(
                index,
                &s.remove_subscriptions,
                vec![text(client_id), Box::new(filters)],
                false,
            );
        }
        if !set.is_empty() {
            let index = first_set;
            let mut c = SubscriptionColumns::default();
            for (_, sub) in &set {
                c.push(sub);
            }
            let mut params = vec![text(client_id)];
            params.extend(c.into_params());
            push(index, &s.add_subscriptions, params, false);
        }
        // Every position the run leaves is removed from the chunks holding it (a dequeue, or
        // the delivery it held replaced), then what the run queues is stored as new chunks.
        if let Some(index) = self.queued.values().map(|(index, _)| *index).min() {
            let mut positions = Positions::default();
            positions.push(client_id, self.queued.keys().copied());
            push(index, &s.unqueue, positions.into_params(), false);
        }
        let Split { set, first_set, .. } = split(&self.queued);
        if !set.is_empty() {
            let mut q = QueueColumns::default();
            for (_, delivery) in &set {
                refs.add(delivery.message_id, first_set);
            }
            q.push_client(client_id, set.iter().map(|(seq, d)| (**seq, *d)));
            push(first_set, &s.queue_chunks, q.into_params(), false);
        }
        let removed: Vec<(usize, i64)> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.removed)
            .map(|(id, f)| (f.index, i64::from(*id)))
            .collect();
        if let Some(index) = removed.iter().map(|(index, _)| *index).min() {
            let ids: Vec<i64> = removed.iter().map(|(_, id)| *id).collect();
            push(
                index,
                &s.remove_inflight_many,
                vec![text(client_id), Box::new(ids)],
                false,
            );
        }
        let mut set: Vec<(usize, usize, &InflightRecord)> = self
            .inflight
            .values()
            .filter_map(|f| f.last.map(|r| (f.rank, f.index, r)))
            .collect();
        set.sort_by_key(|(rank, _, _)| *rank);
        if let Some(index) = set.iter().map(|(_, index, _)| *index).min() {
            let mut ids = Vec::with_capacity(set.len());
            let mut states = Vec::with_capacity(set.len());
            let mut c = DeliveryColumns::default();
            for (_, _, f) in &set {
                ids.push(i64::from(f.packet_id));
                states.push(f.state.as_str().to_string());
                c.push(&f.delivery);
            }
            let mut params = vec![text(client_id), Box::new(ids) as Param, Box::new(states)];
            params.extend(c.into_params());
            push(index, &s.set_inflight_many, params, false);
        }
        let Split {
            removed,
            set,
            first_set,
        } = split(&self.inbound);
        if let Some(index) = removed.first().map(|(index, _)| *index) {
            let ids: Vec<i64> = removed.iter().map(|(_, id)| i64::from(**id)).collect();
            push(
                index,
                &s.remove_inbound_many,
                vec![text(client_id), Box::new(ids)],
                false,
            );
        }
        if !set.is_empty() {
            let index = first_set;
            let ids: Vec<i64> = set.iter().map(|(id, _)| i64::from(**id)).collect();
            push(
                index,
                &s.add_inbound_many,
                vec![text(client_id), Box::new(ids)],
                false,
            );
        }
    }
}

/// The deliveries queued for clients that have no other change in the batch, written with
/// one statement for all of them.
#[derive(Default)]
struct Fanout {
    /// The first change queued, for error messages.
    first: Option<usize>,
    clients: Vec<String>,
    positions: Positions,
    queued: QueueColumns,
    /// Each delivery's change, for the count of references.
    indices: Vec<(u64, usize)>,
}

impl Fanout {
    /// Takes the changes of `client_id` (`indices` into `batch`) if they are all deliveries
    /// queued; false (nothing taken) otherwise.
    fn take(&mut self, client_id: &str, batch: &[Change], indices: &[usize]) -> bool {
        let mut last: BTreeMap<u64, (usize, &DeliveryRecord)> = BTreeMap::new();
        for &index in indices {
            match &batch[index] {
                Change::MessageQueued { seq, delivery, .. } => {
                    last.insert(*seq, (index, delivery));
                }
                _ => return false,
            }
        }
        if let Some(&first) = indices.first() {
            self.first = Some(self.first.map_or(first, |f| f.min(first)));
        }
        self.clients.push(client_id.to_string());
        self.positions.push(client_id, last.keys().copied());
        for (index, delivery) in last.values() {
            self.indices.push((delivery.message_id, *index));
        }
        self.queued
            .push_client(client_id, last.iter().map(|(seq, (_, d))| (*seq, *d)));
        true
    }

    /// The check that the clients' sessions are stored, the removal of the positions queued
    /// (found at once when they follow every stored one, as a fan-out's do), and the new
    /// chunks; each delivery counted in `refs`.
    fn plan<'a>(self, s: &'a Statements, refs: &mut Refs, out: &mut Vec<Op<'a>>) {
        let Some(index) = self.first else { return };
        out.push(Op {
            index,
            statement: &s.all_exist,
            params: vec![Box::new(self.clients)],
            must_touch: true,
        });
        for (id, index) in self.indices {
            refs.add(id, index);
        }
        out.push(Op {
            index,
            statement: &s.unqueue,
            params: self.positions.into_params(),
            must_touch: false,
        });
        out.push(Op {
            index,
            statement: &s.queue_chunks,
            params: self.queued.into_params(),
            must_touch: false,
        });
    }
}

/// What a run leaves for the keys of one table: the keys removed (with the index of their
/// first change, smallest first) and the keys set, with the smallest index of those.
struct Split<'m, 'c, K, T> {
    removed: Vec<(usize, &'m K)>,
    set: Vec<(&'m K, &'c T)>,
    first_set: usize,
}

fn split<'m, 'c, K, T>(map: &'m BTreeMap<K, Last<'c, T>>) -> Split<'m, 'c, K, T> {
    let mut removed = Vec::new();
    let mut set = Vec::new();
    let mut first_set = usize::MAX;
    for (key, (index, value)) in map {
        match value {
            None => removed.push((*index, key)),
            Some(v) => {
                first_set = first_set.min(*index);
                set.push((key, *v));
            }
        }
    }
    removed.sort_by_key(|(index, _)| *index);
    Split {
        removed,
        set,
        first_set,
    }
}

/// The retained set's changes: the last one for each topic.
fn plan_retained<'a>(
    s: &'a Statements,
    batch: &[Change],
    indices: &[usize],
    out: &mut Vec<Op<'a>>,
) {
    let mut last: BTreeMap<&str, Last<'_, RetainedRecord>> = BTreeMap::new();
    for &index in indices {
        match &batch[index] {
            Change::RetainedSet(r) => keep(&mut last, r.message.topic.as_str(), index, Some(r)),
            Change::RetainedDeleted { topic } => keep(&mut last, topic.as_str(), index, None),
            _ => unreachable!("a change of the retained set"),
        }
    }
    let Split {
        removed,
        set,
        first_set,
    } = split(&last);
    if let Some(index) = removed.first().map(|(index, _)| *index) {
        let topics: Vec<String> = removed.iter().map(|(_, t)| t.to_string()).collect();
        out.push(Op {
            index,
            statement: &s.delete_retained_many,
            params: vec![Box::new(topics)],
            must_touch: false,
        });
    }
    if !set.is_empty() {
        let index = first_set;
        let mut c = MessageColumns::default();
        for (_, r) in &set {
            c.push(&r.message);
            c.publisher_username.push(r.publisher_username.clone());
            c.publisher_listener
                .push(r.publisher_listener.map(i64::from));
        }
        out.push(Op {
            index,
            statement: &s.set_retained_many,
            params: c.into_params(),
            must_touch: false,
        });
    }
}

/// Retained messages as one array per column, for `unnest`.
#[derive(Default)]
struct MessageColumns {
    topic: Vec<String>,
    payload: Vec<Vec<u8>>,
    qos: Vec<i64>,
    retain: Vec<bool>,
    properties: Vec<Vec<u8>>,
    expires_at: Vec<Option<i64>>,
    publisher: Vec<Option<String>>,
    share: Vec<Option<String>>,
    publisher_username: Vec<Option<String>>,
    publisher_listener: Vec<Option<i64>>,
}

impl MessageColumns {
    fn push(&mut self, m: &MessageRecord) {
        self.topic.push(m.topic.clone());
        self.payload.push(m.payload.to_vec());
        self.qos.push(i64::from(m.qos));
        self.retain.push(m.retain);
        self.properties.push(m.properties.to_vec());
        self.expires_at.push(m.expires_at.map(big));
        self.publisher.push(m.publisher.clone());
        self.share.push(m.share.clone());
    }

    fn into_params(self) -> Vec<Param> {
        vec![
            Box::new(self.topic),
            Box::new(self.payload),
            Box::new(self.qos),
            Box::new(self.retain),
            Box::new(self.properties),
            Box::new(self.expires_at),
            Box::new(self.publisher),
            Box::new(self.share),
            Box::new(self.publisher_username),
            Box::new(self.publisher_listener),
        ]
    }
}

/// Queued deliveries as the chunks they are stored in: each client's deliveries, by position,
/// cut every [`CHUNK_MAX`]. One array per chunk column (client id, first and last position,
/// the range of its deliveries in the delivery arrays, from 1) and one per delivery column
/// (position, message id, QoS, RETAIN), from which `queue_chunks` slices each chunk's
/// arrays; the subscription identifiers and shared subscriptions only for the chunks where
/// a delivery has one (with the chunk's number from 1 and the delivery's place in it), a
/// chunk without any storing none.
#[derive(Default)]
struct QueueColumns {
    clients: Vec<String>,
    first: Vec<i64>,
    last: Vec<i64>,
    from: Vec<i32>,
    to: Vec<i32>,
    seqs: Vec<i64>,
    message_ids: Vec<i64>,
    qos: Vec<i64>,
    retains: Vec<bool>,
    extra_chunk: Vec<i64>,
    extra_place: Vec<i64>,
    extra_ids: Vec<Vec<u8>>,
    extra_shares: Vec<Option<String>>,
}

impl QueueColumns {
    /// Adds the deliveries of `client_id`, ordered by position, each position once.
    fn push_client<'d>(
        &mut self,
        client_id: &str,
        deliveries: impl IntoIterator<Item = (u64, &'d DeliveryRecord)>,
    ) {
        let deliveries: Vec<(u64, &DeliveryRecord)> = deliveries.into_iter().collect();
        for chunk in deliveries.chunks(CHUNK_MAX) {
            let (Some((first, _)), Some((last, _))) = (chunk.first(), chunk.last()) else {
                continue;
            };
            self.clients.push(client_id.to_string());
            self.first.push(big(*first));
            self.last.push(big(*last));
            self.from.push(place(self.seqs.len() + 1));
            let number = i64::try_from(self.clients.len()).unwrap_or(i64::MAX);
            let extras = chunk
                .iter()
                .any(|(_, d)| !d.subscription_ids.is_empty() || d.share.is_some());
            for (n, (seq, d)) in chunk.iter().enumerate() {
                self.seqs.push(big(*seq));
                self.message_ids.push(big(d.message_id));
                self.qos.push(i64::from(d.qos));
                self.retains.push(d.retain);
                if extras {
                    self.extra_chunk.push(number);
                    self.extra_place.push(i64::try_from(n).unwrap_or(i64::MAX));
                    self.extra_ids.push(encode_ids(&d.subscription_ids));
                    self.extra_shares.push(d.share.clone());
                }
            }
            self.to.push(place(self.seqs.len()));
        }
    }

    fn into_params(self) -> Vec<Param> {
        vec![
            Box::new(self.clients),
            Box::new(self.first),
            Box::new(self.last),
            Box::new(self.from),
            Box::new(self.to),
            Box::new(self.seqs),
            Box::new(self.message_ids),
            Box::new(self.qos),
            Box::new(self.retains),
            Box::new(self.extra_chunk),
            Box::new(self.extra_place),
            Box::new(self.extra_ids),
            Box::new(self.extra_shares),
        ]
    }
}

/// An index into an array parameter (PostgreSQL's `int`; a batch holds far fewer
/// deliveries).
fn place(index: usize) -> i32 {
    i32::try_from(index).unwrap_or(i32::MAX)
}

/// Positions to remove from the stored queues: each one (client id, position), and each
/// client's smallest and largest, by which `unqueue` finds the chunks that may hold them.
#[derive(Default)]
struct Positions {
    clients: Vec<String>,
    seqs: Vec<i64>,
    span_clients: Vec<String>,
    lo: Vec<i64>,
    hi: Vec<i64>,
}

impl Positions {
    /// Adds positions of `client_id`, in increasing order.
    fn push(&mut self, client_id: &str, seqs: impl IntoIterator<Item = u64>) {
        let start = self.seqs.len();
        for seq in seqs {
            self.clients.push(client_id.to_string());
            self.seqs.push(big(seq));
        }
        if let (Some(lo), Some(hi)) = (self.seqs.get(start), self.seqs.last()) {
            let (lo, hi) = (*lo, *hi);
            self.span_clients.push(client_id.to_string());
            self.lo.push(lo);
            self.hi.push(hi);
        }
    }

    fn into_params(self) -> Vec<Param> {
        vec![
            Box::new(self.clients),
            Box::new(self.seqs),
            Box::new(self.span_clients),
            Box::new(self.lo),
            Box::new(self.hi),
        ]
    }
}

/// Deliveries as one array per column, for `unnest`.
#[derive(Default)]
struct DeliveryColumns {
    message_id: Vec<i64>,
    qos: Vec<i64>,
    retain: Vec<bool>,
    subscription_ids: Vec<Vec<u8>>,
    share: Vec<Option<String>>,
}

impl DeliveryColumns {
    fn push(&mut self, d: &DeliveryRecord) {
        self.message_id.push(big(d.message_id));
        self.qos.push(i64::from(d.qos));
        self.retain.push(d.retain);
        self.subscription_ids.push(encode_ids(&d.subscription_ids));
        self.share.push(d.share.clone());
    }

    fn into_params(self) -> Vec<Param> {
        vec![
            Box::new(self.message_id),
            Box::new(self.qos),
            Box::new(self.retain),
            Box::new(self.subscription_ids),
            Box::new(self.share),
        ]
    }
}

/// Stored messages as one array per column, for `unnest`.
#[derive(Default)]
struct StoredColumns {
    id: Vec<i64>,
    topic: Vec<String>,
    payload: Vec<Vec<u8>>,
    qos: Vec<i64>,
    retain: Vec<bool>,
    properties: Vec<Vec<u8>>,
    expires_at: Vec<Option<i64>>,
    publisher: Vec<Option<String>>,
}

impl StoredColumns {
    fn push(&mut self, stored: &StoredMessage) {
        self.push_record(stored.id, &stored.message);
    }

    fn push_record(&mut self, id: u64, m: &MessageRecord) {
        self.id.push(big(id));
        self.topic.push(m.topic.clone());
        self.payload.push(m.payload.to_vec());
        self.qos.push(i64::from(m.qos));
        self.retain.push(m.retain);
        self.properties.push(m.properties.to_vec());
        self.expires_at.push(m.expires_at.map(big));
        self.publisher.push(m.publisher.clone());
    }

    fn into_params(self) -> Vec<Param> {
        vec![
            Box::new(self.id),
            Box::new(self.topic),
            Box::new(self.payload),
            Box::new(self.qos),
            Box::new(self.retain),
            Box::new(self.properties),
            Box::new(self.expires_at),
            Box::new(self.publisher),
        ]
    }
}

/// Subscriptions as one array per column, for `unnest`.
#[derive(Default)]
struct SubscriptionColumns {
    filter: Vec<String>,
    qos: Vec<i64>,
    no_local: Vec<bool>,
    retain_as_published: Vec<bool>,
    retain_handling: Vec<i64>,
    identifier: Vec<Option<i64>>,
}

impl SubscriptionColumns {
    fn push(&mut self, s: &SubscriptionRecord) {
        self.filter.push(s.filter.clone());
        self.qos.push(i64::from(s.qos));
        self.no_local.push(s.no_local);
        self.retain_as_published.push(s.retain_as_published);
        self.retain_handling.push(i64::from(s.retain_handling));
        self.identifier
            .push(s.subscription_identifier.map(i64::from));
    }

    fn into_params(self) -> Vec<Param> {
        vec![
            Box::new(self.filter),
            Box::new(self.qos),
            Box::new(self.no_local),
            Box::new(self.retain_as_published),
            Box::new(self.retain_handling),
            Box::new(self.identifier),
        ]
    }
}

pub(super) enum WriteError {
    /// The epoch in the database is this one, newer than ours.
    Fenced(i64),
    Storage(StorageError),
}

impl From<StorageError> for WriteError {
    fn from(e: StorageError) -> WriteError {
        WriteError::Storage(e)
    }
}

/// One transaction: the epoch check, then every change, pipelined; committed only when the
/// epoch is ours and every statement succeeded.
///
/// `start`: a new broker starts serving (before it loads): the messages nothing refers to
/// are deleted, and it holds every other one (none is released) but those only stream
/// entries refer to.
pub(super) async fn write_batch(
    writer: &mut WriteConnection,
    batch: &[Change],
    epoch: i64,
    start: bool,
) -> Result<(), WriteError> {
    if writer.statements.is_none() {
        let prepared = Statements::prepare(&writer.client)
            .await
            .map_err(|e| classify(e, "cannot prepare the statements"))?;
        writer.statements = Some(prepared);
    }
    let WriteConnection { client, statements } = writer;
    let statements = statements.as_ref().expect("prepared above");
    let tx = client
        .transaction()
        .await
        .map_err(|e| classify(e, "cannot begin a transaction"))?;
    let mut ops = Vec::new();
    plan(statements, batch, &mut ops);
    if start {
        for statement in [
            &statements.delete_unreferenced,
            &statements.hold_all,
            &statements.release_streamed,
        ] {
            ops.push(Op {
                index: 0,
                statement,
                params: Vec::new(),
                must_touch: false,
            });
        }
    }
    let refs: Vec<Vec<&(dyn ToSql + Sync)>> = ops
        .iter()
        .map(|op| {
            op.params
                .iter()
                .map(|p| p.as_ref() as &(dyn ToSql + Sync))
                .collect()
        })
        .collect();
    // In this order on the server: the fence lock (held until commit, so a takeover waits
    // for this transaction), then the epoch, read after the lock (READ COMMITTED: each
    // statement sees what was committed before it started), then the writes.
    let fence = tx.execute(&statements.fence, &[]);
    let check = tx.query_opt(&statements.epoch, &[]);
    let writes = futures_util::future::join_all(
        ops.iter()
            .zip(&refs)
            .map(|(op, params)| tx.execute(op.statement, params)),
    );
    let (fenced, current, results) = tokio::join!(fence, check, writes);
    fenced.map_err(|e| classify(e, "cannot take the fence lock"))?;
    let current = current.map_err(|e| classify(e, "cannot check the leader epoch"))?;
    let current: i64 = current.map(|row| row.get(0)).unwrap_or(0);
    if current != epoch {
        drop(tx);
        return Err(WriteError::Fenced(current));
    }
    for (op, result) in ops.iter().zip(results) {
        let Some(change) = batch.get(op.index) else {
            // The start's statements.
            result.map_err(|e| classify(e, "cannot clean the message store"))?;
            continue;
        };
        match result {
            Ok(0) if op.must_touch => {
                let reason = if std::ptr::eq(op.statement, &statements.add_refs) {
                    "a queued delivery refers to a message that is not stored"
                } else {
                    "no session is stored for the client"
                };
                return Err(refused(op.index, change, reason).into());
            }
            Ok(_) => {}
            Err(e) => {
                let e = classify(e, "");
                return Err(StorageError::new(
                    e.kind(),
                    format!(
                        "change {} ({}) for {}{}",
                        op.index,
                        change.kind(),
                        match change {
                            Change::MessageStored { .. } | Change::MessageReleased { .. } =>
                                "the message store",
                            Change::StreamDefined { .. }
                            | Change::StreamAppended { .. }
                            | Change::StreamSegment { .. }
                            | Change::StreamTrimmed { .. }
                            | Change::StreamEntryRemoved { .. }
                            | Change::StreamDeleted { .. } => "the streams",
                            _ => change.client_id().unwrap_or("the retained set"),
                        },
                        e.message()
                    ),
                )
                .into());
            }
        }
    }
    tx.commit()
        .await
        .map_err(|e| classify(e, "cannot commit").into())
}

/// Writes access record changes in one transaction under the fence lock, as
/// [`write_batch`] writes a batch: refused with [`WriteError::Fenced`] when another broker
/// took over.
pub(super) async fn write_access(
    writer: &mut WriteConnection,
    changes: &[crate::access::AccessChange],
    epoch: i64,
) -> Result<(), WriteError> {
    use crate::access::AccessChange;
    if writer.statements.is_none() {
        let prepared = Statements::prepare(&writer.client)
            .await
            .map_err(|e| classify(e, "cannot prepare the statements"))?;
        writer.statements = Some(prepared);
    }
    let WriteConnection { client, statements } = writer;
    let statements = statements.as_ref().expect("prepared above");
    let tx = client
        .transaction()
        .await
        .map_err(|e| classify(e, "cannot begin a transaction"))?;
    tx.execute(&statements.fence, &[])
        .await
        .map_err(|e| classify(e, "cannot take the fence lock"))?;
    let current: i64 = tx
        .query_opt(&statements.epoch, &[])
        .await
        .map_err(|e| classify(e, "cannot check the leader epoch"))?
        .map(|row| row.get(0))
        .unwrap_or(0);
    if current != epoch {
        drop(tx);
        return Err(WriteError::Fenced(current));
    }
    for change in changes {
        let written = match change {
            AccessChange::Put(r) => {
                tx.execute(
                    "INSERT INTO mercurio_access (kind, name, body) VALUES ($1, $2, $3) \
                     ON CONFLICT (kind, name) DO UPDATE SET body = excluded.body",
                    &[&r.kind.as_str(), &r.name, &r.body],
                )
                .await
            }
            AccessChange::Deleted { kind, name } => {
                tx.execute(
                    "DELETE FROM mercurio_access WHERE kind = $1 AND name = $2",
                    &[&kind.as_str(), name],
                )
                .await
            }
        };
        written.map_err(|e| classify(e, "cannot write the access records"))?;
    }
    tx.commit()
        .await
        .map_err(|e| classify(e, "cannot commit").into())
}
