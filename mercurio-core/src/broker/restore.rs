//! The restore at start: rebuilds the broker's state from what storage loaded, before the
//! listeners serve. One step per kind of record: retained messages, sessions set aside, then
//! each session (its queue, in-flight messages, inbound QoS 2 identifiers, will and
//! subscriptions), with the timers of expiry and delayed wills. Storage loads the sessions
//! without their queues ([`Storage::load_without_queues`]): [`read_needed_queues`] reads those
//! of the sessions that need theirs now (the broker's own, members of shared subscriptions;
//! every one when access is checked), and every other one is restored with its backlog left
//! in storage (`backlog.rs`). Sessions that expired while the
//! broker was down are deleted, their wills published and the messages they held through
//! shared subscriptions passed on to other members of the groups. The access rules, which may
//! have changed while the broker was down, are then applied to what was restored, as after a
//! reload: subscriptions no longer allowed are removed, queued messages no longer readable
//! dropped (counted `not_authorized`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mercurio_storage::{
    Change, InflightState, LoadedState, RetainedRecord, SessionRecord, SetAside, Storage,
    StorageError, StoredMessage, StreamEntryRead, NEVER_EXPIRES,
};

use super::BrokerState;
use crate::auth::Identity;
use crate::message::Source;
use crate::persist::records::{
    delivery_from, granted_from, header, inflight_from, message_from, protocol_from_level, unix_ms,
    unix_to_instant, will_from, Restored,
};
use crate::persist::Persister;
use crate::session::{Backlog, Delivery, Session, SessionChanges, Will};

/// Whether the session of `record` gets its queue at the restore rather than when its client
/// comes back: the broker's own sessions (a bridge's, a durable in-process client's: attached
/// without a CONNECT) and members of shared subscriptions (a session that ends passes its
/// deliveries of a group on, and may end before its client comes back).
fn needs_queue_now(record: &SessionRecord) -> bool {
    record.client_id.starts_with(super::INTERNAL_PREFIX)
        || record
            .subscriptions
            .iter()
            .any(|s| s.filter.starts_with("$share/"))
}

/// Reads from `storage` the queues left there by [`Storage::load_without_queues`] that the
/// restore needs now ([`needs_queue_now`]); with `checks_access`, every one: the restore
/// applies the access rules of the restart to every queued message, dropping (and counting)
/// those no longer readable, as it did before queues were left in storage. A queue storage
/// cannot read sets its session aside, as [`Storage::load`] would. Errors are storage's, as
/// `load`'s.
pub(crate) async fn read_needed_queues(
    storage: &dyn Storage,
    loaded: &mut LoadedState,
    checks_access: bool,
) -> Result<(), StorageError> {
    let mut unreadable = Vec::new();
    for (i, record) in loaded.sessions.iter_mut().enumerate() {
        let now = checks_access || needs_queue_now(record);
        if !now || loaded.backlogs.remove(&record.client_id).is_none() {
            continue;
        }
        match storage.load_queue(&record.client_id).await {
            Ok(queued) => record.queued = queued,
            Err(e) if e.is_refused() => unreadable.push((i, e.to_string())),
            Err(e) => return Err(e),
        }
    }
    for (i, cause) in unreadable.into_iter().rev() {
        let record = loaded.sessions.remove(i);
        loaded.set_aside.push(SetAside {
            client_id: record.client_id,
            cause,
        });
    }
    Ok(())
}

/// The entries of the stored `last_value` streams (those of `configured` and those created
/// at run time), read back from storage in batches: such a stream holds one message per
/// topic, and is held whole in memory, like the retained messages. Other streams stay in
/// storage. Errors are storage's.
pub(crate) async fn read_last_value_streams(
    storage: &dyn Storage,
    loaded: &LoadedState,
    configured: &[crate::config::StreamConfig],
) -> Result<StreamEntries, StorageError> {
    const BATCH: usize = 1024;
    let mut out = StreamEntries::new();
    for record in &loaded.streams {
        let last_value = match configured.iter().find(|c| c.name == record.name) {
            Some(c) => c.last_value,
            None => record.definition.as_ref().is_some_and(|d| d.last_value),
        };
        if !last_value {
            continue;
        }
        let mut entries = Vec::new();
        let mut from = record.first_offset;
        loop {
            let batch = storage
                .read_stream(&record.name, from, 0, BATCH, u64::MAX)
                .await?;
            let full = batch.len() == BATCH;
            if let Some(last) = batch.last() {
                from = last.entry.offset + 1;
            }
            entries.extend(batch);
            if !full {
                break;
            }
        }
        out.insert(record.name.clone(), entries);
    }
    Ok(out)
}

/// Stream entries read back at start, by stream ([`read_last_value_streams`]).
pub(crate) type StreamEntries = std::collections::HashMap<String, Vec<StreamEntryRead>>;

/// Rebuilds the broker's state from `loaded` and the streams' entries read back (nothing
/// without a storage writer).
pub(crate) fn restore(broker: &Arc<BrokerState>, mut loaded: LoadedState, streamed: StreamEntries) {
    let Some(p) = broker.persist.get() else {
        return;
    };
    let (now, now_ms) = (Instant::now(), unix_ms());
    restore_retained(broker, p, &loaded.retained, now, now_ms);
    // Each stored message once, shared by every delivery that refers to it (dropped at the
    // end of the restore: those no restored session holds are then released).
    let messages = restore_messages(p, &loaded.messages, now, now_ms);
    p.seed_message_ids(loaded.max_message_id.saturating_add(1));
    restore_streams(broker, p, &loaded.streams, streamed, now, now_ms);
    for s in &loaded.set_aside {
        tracing::error!(
            client_id = %s.client_id,
            "stored session cannot be read, set aside (its client is refused until \
             `mercurioctl client delete-session`): {}",
            s.cause
        );
        p.set_aside_client(s.client_id.clone());
    }
    broker
        .stats
        .storage_sessions_set_aside
        .store(p.set_aside_count() as u64, Ordering::Relaxed);
    let mut wills_now: Vec<(String, Will)> = Vec::new();
    let mut left_shared: Vec<(String, Vec<Delivery>)> = Vec::new();
    let mut restored = 0usize;
    let mut backlogs = std::mem::take(&mut loaded.backlogs);
    let mut left_in_storage = 0usize;
    for record in loaded.sessions {
        let client_id = record.client_id.clone();
        if record.is_expired(now_ms) || record.session_expiry_interval == 0 {
            tracing::info!(client_id = %client_id, "stored session expired while the broker was down: discarded");
            broker
                .stats
                .sessions_expired
                .fetch_add(1, Ordering::Relaxed);
            p.emit(Change::SessionDeleted {
                client_id: client_id.clone(),
            });
            if let Some(Ok(will)) = record.will.as_ref().map(|w| will_from(w, now, now_ms)) {
                wills_now.push((client_id.clone(), will));
            }
            left_shared.push((client_id, shared_left(&messages, &record)));
            continue;
        }
        let backlog = backlogs.remove(&client_id).map(|b| Backlog {
            len: b.len,
            last_seq: b.last_seq,
            restored: true,
        });
        let has_backlog = backlog.is_some();
        match restore_session(broker, Some(p), &messages, record, backlog, now, now_ms) {
            Ok(will) => {
                left_in_storage += usize::from(has_backlog);
                if let Some(will) = will {
                    wills_now.push((client_id, will));
                }
            }
            Err(cause) => {
                tracing::error!(client_id = %client_id, "stored session cannot be restored, set aside: {cause}");
                let count = p.set_aside_client(client_id);
                broker
                    .stats
                    .storage_sessions_set_aside
                    .store(count as u64, Ordering::Relaxed);
                continue;
            }
        }
        restored += 1;
    }
    tracing::info!(
        sessions = restored,
        queues_left_in_storage = left_in_storage,
        messages = messages.len(),
        retained = loaded.retained.len(),
        set_aside = p.set_aside_count(),
        "restored from {} storage",
        p.storage_name()
    );
    // Held while backlogs are left in storage: they refer to them.
    broker.held.hold(messages, left_in_storage);
    broker.revoke_unauthorized();
    for (client_id, left) in left_shared {
        broker.pass_on(&client_id, left);
    }
    // In cluster mode they wait for the registry: another node may own the session now.
    for (client_id, will) in wills_now {
        if let Some((client_id, will)) = broker.held_wills.hold(client_id, will) {
            broker.publish_will(&client_id, will);
        }
    }
}

/// The streams' logs: a configured stream gets its counters back (its entries stay in
/// storage, but a `last_value` stream's, read back in `streamed`; an entry whose message
/// cannot be read is dropped and logged); a stored stream no longer configured is deleted.
fn restore_streams(
    broker: &BrokerState,
    p: &Persister,
    stored: &[mercurio_storage::StreamRecord],
    mut streamed: StreamEntries,
    now: Instant,
    now_ms: u64,
) {
    for record in stored {
        let stream = match (broker.streams.get(&record.name), &record.definition) {
            (Some(stream), _) => stream,
            (None, Some(d)) => {
                let config = crate::config::StreamConfig {
                    name: record.name.clone(),
                    filter: d.filter.clone(),
                    max_age: d.max_age,
                    max_bytes: d.max_bytes,
                    last_value: d.last_value,
                };
                match broker.streams.restore_created(config) {
                    Ok(stream) => stream,
                    Err(e) => {
                        tracing::error!(stream = %record.name, "stored stream cannot be restored, deleted: {e}");
                        p.stream_deleted(&record.name);
                        continue;
                    }
                }
            }
            (None, None) => {
                tracing::info!(
                    stream = %record.name,
                    entries = record.messages,
                    "stored stream no longer in [[streams]]: deleted"
                );
                p.stream_deleted(&record.name);
                continue;
            }
        };
        let entries = streamed.remove(&record.name).map(|read| {
            let mut entries = Vec::with_capacity(read.len());
            for e in read {
                match message_from(&e.message, now, now_ms) {
                    Ok((msg, _)) => entries.push(crate::streams::Entry {
                        offset: e.entry.offset,
                        time_ms: e.entry.time_ms,
                        msg: Arc::new(msg),
                    }),
                    Err(cause) => {
                        tracing::error!(
                            stream = %record.name,
                            offset = e.entry.offset,
                            "stored stream entry cannot be restored, dropped: message {}: {cause}",
                            e.entry.message_id
                        );
                        p.stream_entry_removed(&record.name, e.entry.offset);
                    }
                }
            }
            entries
        });
        tracing::info!(
            stream = %record.name,
            entries = record.messages,
            first_offset = record.first_offset,
            next_offset = record.next_offset,
            "stream restored"
        );
        stream.restore(record, entries);
    }
}

/// The stored messages, each once, marked as stored under their id (and the message ids
/// seeded above them).
fn restore_messages(
    p: &Persister,
    stored: &[StoredMessage],
    now: Instant,
    now_ms: u64,
) -> Restored {
    let next = stored.iter().map(|m| m.id).max().map_or(1, |id| id + 1);
    p.seed_message_ids(next);
    stored
        .iter()
        .map(|m| {
            let restored = message_from(&m.message, now, now_ms).map(|(msg, ids)| {
                p.restored_message(&msg, m.id);
                (Arc::new(msg), ids)
            });
            (m.id, restored)
        })
        .collect()
}

/// The deliveries an expired stored session held through shared subscriptions, oldest first:
/// in flight without an acknowledgement (a QoS 2 message whose PUBREC came back was
/// received), then queued. Those that cannot be read are left out.
fn shared_left(messages: &Restored, record: &SessionRecord) -> Vec<Delivery> {
    let queued = record.queued.iter().map(|q| &q.delivery);
    let inflight = record
        .inflight
        .iter()
        .filter(|f| f.state != InflightState::AwaitingPubComp)
        .map(|f| &f.delivery);
    inflight
        .chain(queued)
        .filter(|d| d.share.is_some())
        .filter_map(|d| delivery_from(messages, d, 0).ok())
        .collect()
}

/// The publisher of a stored retained message as `check_retain_source` checks it: its user
/// name, and the listener on its port that has access rules of its own (none: `[auth]`'s).
/// `None` without the option, or when neither was stored.
fn retained_source(broker: &BrokerState, r: &RetainedRecord) -> Option<Box<Source>> {
    if !broker.config.server.check_retain_source
        || (r.publisher_username.is_none() && r.publisher_listener.is_none())
    {
        return None;
    }
    let listener = r.publisher_listener.and_then(|port| {
        broker
            .config
            .listeners
            .iter()
            .enumerate()
            .position(|(i, l)| {
                l.port == port && broker.listener_auth.get(i).is_some_and(Option::is_some)
            })
            .and_then(|i| u32::try_from(i).ok())
    });
    Some(Box::new(Source {
        username: r.publisher_username.as_deref().map(Arc::from),
        listener,
    }))
}

/// The retained messages still valid; those that expired are deleted from storage.
fn restore_retained(
    broker: &BrokerState,
    p: &Persister,
    records: &[RetainedRecord],
    now: Instant,
    now_ms: u64,
) {
    let mut retained = broker.retained.lock();
    for r in records {
        match message_from(&r.message, now, now_ms) {
            Ok((mut msg, _)) if !msg.is_expired(now) => {
                msg.source = retained_source(broker, r);
                let msg = Arc::new(msg);
                retained.insert(&msg.topic, Arc::clone(&msg));
            }
            Ok(_) => p.emit(Change::RetainedDeleted {
                topic: r.topic().to_string(),
            }),
            Err(e) => tracing::error!(topic = r.topic(), "retained message not restored: {e}"),
        }
    }
}

/// Restores one session, with its `backlog` left in storage if any; returns its will when it
/// is due now. Without `p` (a session handed over by another node, written to this node's
/// storage afterwards: `handover.rs`) nothing is reported to storage.
pub(super) fn restore_session(
    broker: &Arc<BrokerState>,
    p: Option<&Arc<Persister>>,
    messages: &Restored,
    record: SessionRecord,
    backlog: Option<Backlog>,
    now: Instant,
    now_ms: u64,
) -> Result<Option<Will>, String> {
    let client_id: Arc<str> = Arc::from(record.client_id.as_str());
    let session = Arc::new(Session::new(
        Arc::clone(&client_id),
        protocol_from_level(record.protocol_level),
        record.session_expiry_interval,
        &broker.queued_memory,
    ));
    // The client was connected when the previous broker stopped: its connection ended now.
    let crashed = record.disconnected_at.is_none();
    // Access checks while the client is away use the user name it last connected with;
    // the broker's own sessions (a bridge's, a durable in-process client's) are trusted
    // before they are opened again too.
    let username: Option<Arc<str>> = record.username.as_deref().map(Arc::from);
    *session.identity.write() = if session.is_internal() {
        Identity::Trusted
    } else {
        Identity::Client {
            username: username.clone(),
            listener: None,
        }
    };
    let disconnected_ms = record.disconnected_at.unwrap_or(now_ms);
    {
        let mut st = session.state.lock();
        st.restore_header(
            unix_to_instant(disconnected_ms, now, now_ms),
            username,
            record.certificate.as_deref().map(Arc::from),
        );
        restore_queue(p, messages, &record, &mut st, now)?;
        if let Some(backlog) = backlog {
            st.restore_backlog(backlog);
        }
        for f in &record.inflight {
            st.restore_inflight(inflight_from(messages, f)?);
        }
        st.restore_inbound_qos2(&record.inbound_qos2);
        if let Some(w) = &record.will {
            st.restore_will(will_from(w, now, now_ms)?);
        }
    }
    // Before the storage writer is attached: what is restored is not written again.
    for s in &record.subscriptions {
        broker.subscribe(&session, &s.filter, granted_from(s)?);
    }
    let expiry = record.session_expiry_interval;
    let expires_at =
        (expiry != NEVER_EXPIRES).then(|| disconnected_ms.saturating_add(u64::from(expiry) * 1000));
    let mut will_due = None;
    {
        let mut st = session.state.lock();
        if let Some(p) = p {
            st.report_changes_to(Arc::clone(p) as Arc<dyn SessionChanges>);
            if crashed {
                p.emit(Change::SessionSaved(header(&client_id, &st)));
            }
        }
        // A will pending when the broker stopped: due after its delay, unless the session
        // ends first (then it goes out with the session's end).
        if let Some(w) = st.will() {
            let due = disconnected_ms.saturating_add(u64::from(w.delay) * 1000);
            if expires_at.is_none_or(|e| due < e) {
                if due <= now_ms {
                    will_due = st.take_will();
                    st.persist_will_cleared(&client_id);
                } else {
                    broker.arm_will(&session, 0, Duration::from_millis(due - now_ms));
                }
            }
        }
    }
    broker
        .sessions
        .lock()
        .insert(Arc::clone(&client_id), Arc::clone(&session));
    if let Some(at) = expires_at {
        broker.arm_expiry(
            &session,
            0,
            Duration::from_millis(at.saturating_sub(now_ms)),
        );
    }
    Ok(will_due)
}

/// The queued messages of `record` still valid, in order; those that expired are dequeued
/// from storage.
fn restore_queue(
    p: Option<&Arc<Persister>>,
    messages: &Restored,
    record: &SessionRecord,
    st: &mut crate::session::SessionState,
    now: Instant,
) -> Result<(), String> {
    for q in &record.queued {
        let delivery = delivery_from(messages, &q.delivery, q.seq)?;
        st.restored_seq(q.seq);
        if delivery.msg.is_expired(now) {
            if let Some(p) = p {
                p.emit(Change::MessageDequeued {
                    client_id: record.client_id.clone(),
                    seq: q.seq,
                });
            }
            continue;
        }
        st.restore_queued(delivery);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use mercurio_storage::{
        DeliveryRecord, InflightRecord, InflightState, LoadedState, MemoryStorage, MessageRecord,
        QueuedRecord, SessionHeader, SessionRecord, StoredMessage, NEVER_EXPIRES,
    };

    use super::super::BrokerState;
    use crate::config::Config;
    use crate::persist::{PendingLimits, Persister};

    fn session(client_id: &str) -> SessionRecord {
        SessionRecord::new(SessionHeader {
            client_id: client_id.into(),
            protocol_level: 5,
            session_expiry_interval: NEVER_EXPIRES,
            disconnected_at: Some(super::unix_ms()),
            username: None,
            certificate: None,
        })
    }

    /// The deliveries of one stored message to several sessions, queued or in flight, share
    /// one `Message` after the restore, as they did in the broker that stored them; and a
    /// message stored next gets an id above every restored one.
    #[tokio::test]
    async fn restored_deliveries_share_one_message() {
        let broker = Arc::new(BrokerState::new(Config::default()));
        let p = Persister::start(
            Arc::new(MemoryStorage::new()),
            false,
            PendingLimits {
                per_client: usize::MAX,
                total: usize::MAX,
            },
            Arc::clone(&broker.stats),
            Arc::downgrade(&broker.sessions),
        );
        let _ = broker.persist.set(Arc::clone(&p));
        let mut a = session("a");
        a.queued = vec![QueuedRecord {
            seq: 1,
            delivery: DeliveryRecord::new(7, 1),
        }];
        let mut b = session("b");
        b.inflight = vec![InflightRecord {
            packet_id: 3,
            delivery: DeliveryRecord::new(7, 1),
            state: InflightState::AwaitingPubAck,
        }];
        let loaded = LoadedState {
            sessions: vec![a, b],
            messages: vec![StoredMessage {
                id: 7,
                message: MessageRecord::new("fleet/all", "m", 1),
            }],
            ..LoadedState::default()
        };
        super::restore(&broker, loaded, super::StreamEntries::new());
        let sessions = broker.sessions.lock();
        let queued = sessions["a"]
            .state
            .lock()
            .queue()
            .iter()
            .next()
            .map(|q| Arc::clone(&q.msg));
        let inflight = sessions["b"]
            .state
            .lock()
            .inflight()
            .front()
            .map(|f| Arc::clone(&f.delivery.msg));
        let (Some(queued), Some(inflight)) = (queued, inflight) else {
            panic!("both deliveries restored");
        };
        assert!(Arc::ptr_eq(&queued, &inflight), "one Message for both");
        assert_eq!(queued.stored.get().map(|s| s.id), Some(7));
        let fresh = crate::message::Message::clone(&queued);
        assert_eq!(p.message_id(&fresh), 8);
    }
}
