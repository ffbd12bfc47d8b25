//! `Forwards`: where the QoS 1 and 2 messages of sessions this node handed over go
//! (docs/cluster.md, "Sessions across nodes").
//!
//! After a hand-over, this node's JetStream consumer still receives messages meant for the
//! session: the backlog JetStream kept for this node, redeliveries of what it took before a
//! crash, and what other nodes send until they hear of the taker's subscriptions. Each such
//! message matching a handed-over session's QoS 1/2 filter is published again on the taking
//! node's subject, with the `Nats-Msg-Id` the publishing node would have given that copy
//! (`{origin}-{seq}-{node}`: stored once if it sent one too) and the envelope unchanged (its
//! origin and sequence number let the taker's `dedup::Seen` drop a copy it already got); it
//! is acknowledged to JetStream only once JetStream acknowledged the forwarded copy. Until the
//! taker confirms the hand-over, such a message is given back to JetStream, delivered again
//! after [`RETRY_LATER`].
//!
//! Bounds: an entry lasts `jetstream_max_age` after its hand-over (no message older than that
//! is left in the stream for this node) and at most [`MAX_ENTRIES`] sessions are kept, the
//! oldest forgotten first (logged).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use parking_lot::Mutex;

use super::envelope::Envelope;
use super::jetstream::Names;
use crate::codec::QoS;

/// How soon JetStream delivers again a message held back during a hand-over.
pub(crate) const RETRY_LATER: Duration = Duration::from_millis(200);

/// Handed-over sessions remembered at most.
pub(crate) const MAX_ENTRIES: usize = 1024;

/// How long one forwarded copy is tried (each attempt waits for JetStream's acknowledgement
/// within the context's request timeout) before the message is given back to JetStream
/// undone, to be delivered again.
const PATIENCE: Duration = Duration::from_secs(10);

/// One session handed over.
struct Entry {
    client_id: String,
    node: String,
    /// Its QoS 1 and 2 filters, shared subscriptions left out.
    filters: Vec<String>,
    until: Instant,
    /// The taker confirmed it has the session (its subscriptions are in its index): until
    /// then a copy forwarded there could reach it before the session and go nowhere.
    confirmed: bool,
}

/// Where a message from JetStream goes besides this node's own subscriptions.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Forward {
    /// To these nodes (none: only here).
    To(Vec<String>),
    /// Back to JetStream, to be delivered again shortly: a session it is meant for is being
    /// handed over, not yet confirmed.
    Later,
}

/// The sessions this node handed over recently, and the nodes that took them.
#[derive(Default)]
pub(crate) struct Forwards {
    entries: Mutex<VecDeque<Entry>>,
}

impl Forwards {
    /// `client_id`'s session goes to `node`: messages matching one of `filters` (with their
    /// granted QoS) are forwarded there for `window`. Replaces an earlier entry of the same
    /// client identifier.
    pub(crate) fn record(
        &self,
        client_id: &str,
        node: &str,
        filters: impl IntoIterator<Item = (String, QoS)>,
        window: Duration,
    ) {
        let filters: Vec<String> = filters
            .into_iter()
            .filter(|(f, qos)| *qos != QoS::AtMostOnce && !f.starts_with("$share/"))
            .map(|(f, _)| f)
            .collect();
        let mut entries = self.entries.lock();
        entries.retain(|e| e.client_id != client_id);
        if filters.is_empty() {
            return;
        }
        if entries.len() >= MAX_ENTRIES {
            if let Some(old) = entries.pop_front() {
                tracing::warn!(client_id = %old.client_id, "cluster: more than {MAX_ENTRIES} sessions handed over within jetstream_max_age: messages still reaching this node for the oldest are no longer forwarded");
            }
        }
        entries.push_back(Entry {
            client_id: client_id.to_string(),
            node: node.to_string(),
            filters,
            until: Instant::now() + window,
            confirmed: false,
        });
    }

    /// The taker of `client_id`'s session confirmed it: messages are forwarded from now on.
    pub(crate) fn confirm(&self, client_id: &str) {
        for e in self.entries.lock().iter_mut() {
            if e.client_id == client_id {
                e.confirmed = true;
            }
        }
    }

    /// The session stays here after all (or came back): nothing forwarded for it.
    pub(crate) fn cancel(&self, client_id: &str) {
        self.entries.lock().retain(|e| e.client_id != client_id);
    }

    /// Where a message on `topic` goes: the nodes, each once, or [`Forward::Later`]. Entries
    /// past their window are forgotten.
    pub(crate) fn route(&self, topic: &str) -> Forward {
        let mut entries = self.entries.lock();
        if entries.is_empty() {
            return Forward::To(Vec::new());
        }
        let now = Instant::now();
        entries.retain(|e| e.until > now);
        let mut nodes: Vec<String> = Vec::new();
        for e in entries.iter() {
            if e.filters.iter().any(|f| crate::topic::matches(f, topic)) {
                if !e.confirmed {
                    return Forward::Later;
                }
                if !nodes.contains(&e.node) {
                    nodes.push(e.node.clone());
                }
            }
        }
        Forward::To(nodes)
    }
}

/// Publishes `payload` (an envelope as JetStream delivered it) on each of `nodes`' subjects
/// and waits for JetStream's acknowledgements, trying again for [`PATIENCE`]. False when a
/// copy was not acknowledged: the message must not be acknowledged to JetStream.
pub(super) async fn forward(
    js: &jetstream::Context,
    names: &Names,
    payload: &bytes::Bytes,
    nodes: &[String],
) -> bool {
    let (origin, seq) = match Envelope::decode(payload.clone()) {
        Ok(env) => (env.origin, env.seq),
        Err(_) => return false,
    };
    for node in nodes {
        let id = format!("{origin:016x}-{seq}-{node}");
        let deadline = Instant::now() + PATIENCE;
        let mut wait = Duration::from_millis(50);
        loop {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.as_str());
            let r = match js
                .publish_with_headers(names.node_subject(node), headers, payload.clone())
                .await
            {
                Ok(ack) => ack.await.map(drop).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match r {
                Ok(()) => break,
                Err(e) if Instant::now() + wait >= deadline => {
                    tracing::warn!(%node, "cluster: a message for a session handed over to another node could not be forwarded; JetStream delivers it here again: {e}");
                    return false;
                }
                Err(e) => {
                    tracing::debug!(%node, "cluster: forwarding to JetStream: {e}");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qos_1_and_2_filters_are_kept_for_their_window_and_count() {
        let f = Forwards::default();
        f.record(
            "a",
            "c",
            [
                ("x/#".to_string(), QoS::AtLeastOnce),
                ("y".to_string(), QoS::AtMostOnce),
                ("$share/g/z".to_string(), QoS::ExactlyOnce),
            ],
            Duration::from_secs(60),
        );
        let to = |nodes: &[&str]| Forward::To(nodes.iter().map(|n| n.to_string()).collect());
        assert_eq!(f.route("x/1"), Forward::Later, "until the taker confirms");
        f.confirm("a");
        assert_eq!(f.route("x/1"), to(&["c"]));
        assert_eq!(f.route("y"), to(&[]), "QoS 0 is not forwarded");
        assert_eq!(f.route("z"), to(&[]), "shared groups are not");
        f.cancel("a");
        assert_eq!(f.route("x/1"), to(&[]));
        f.record("b", "c", [("t".into(), QoS::AtLeastOnce)], Duration::ZERO);
        assert_eq!(f.route("t"), to(&[]), "past its window");
        for i in 0..(MAX_ENTRIES + 3) {
            let topic = format!("t/{i}");
            let client = format!("c{i}");
            f.record(
                &client,
                "d",
                [(topic, QoS::AtLeastOnce)],
                Duration::from_secs(60),
            );
            f.confirm(&client);
        }
        assert_eq!(f.entries.lock().len(), MAX_ENTRIES);
        assert_eq!(f.route("t/0"), to(&[]), "the oldest is forgotten");
        assert_eq!(f.route(&format!("t/{}", MAX_ENTRIES + 2)), to(&["d"]));
    }
}
