//! A crashed node's sessions, taken from its storage (docs/cluster.md, "A crashed node's
//! sessions"): a CONNECT whose session the registry names another node the owner of, that
//! node silent (gone, or not answering within `takeover_timeout`), and its PostgreSQL
//! database listed in `[cluster] peer_storage`.
//!
//! - The database is fenced and the session read from it (`mercurio_storage::postgres::peer`);
//!   the records are adopted as a hand-over's would be, without the crashed connection's
//!   will (the new connection brings its own).
//! - Once this node's storage holds the session and its claim is confirmed, the session is
//!   deleted from the node's database and its lock released ([`take`]'s confirmation).
//!   Then the crashed connection's will is published here if it is due ([`due_will`]): the
//!   node gone can no longer publish it (its copy is deleted, and the registry names this
//!   node the owner), and a take that fails leaves it in that database.
//! - What the node gone was sent through JetStream and never took (its durable consumer's
//!   messages, acknowledged to their publishers) is read from the stream without being
//!   consumed, and given to the session taken ([`redeliver`]); the node takes the messages
//!   when it is back, for the sessions it still has.

use std::sync::Arc;
#[cfg(feature = "postgres")]
use std::sync::Weak;
use std::time::Duration;

use crate::broker::handover::Taken;
use crate::broker::BrokerState;

/// What [`take`] needs of the node's NATS side.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(super) struct Nodes<'a> {
    /// The connection the node asks the others on.
    pub client: &'a async_nats::Client,
    /// `subject_prefix`.
    pub prefix: &'a str,
    /// This node's name, recorded in the fenced database as the taker.
    pub node: &'a str,
    /// `takeover_timeout`: the longest wait for the database's lock.
    pub timeout: Duration,
}

/// How long after the session is taken the stream is read for what the node gone was sent:
/// the time for the other nodes to hear of this node's subscriptions, after which they send
/// the session's messages here rather than to the node gone.
#[cfg(feature = "postgres")]
const INTEREST_SPREAD: Duration = Duration::from_secs(1);

/// Takes the session of `client_id` from the storage of `owner`, a node gone: its records
/// for the CONNECT ([`Taken::Session`]), [`Taken::None`] when `owner`'s storage is not
/// listed in `peer_storage`, holds no such session or cannot be reached (logged), and
/// [`Taken::Unavailable`] while `owner` still serves its database (a node cut off from
/// NATS, or stalled for less than the storage's stale heartbeat).
pub(super) async fn take(
    broker: &Arc<BrokerState>,
    nodes: &Nodes<'_>,
    client_id: &str,
    owner: &str,
) -> Taken {
    #[cfg(feature = "postgres")]
    {
        take_from_postgres(broker, nodes, client_id, owner).await
    }
    #[cfg(not(feature = "postgres"))]
    {
        let _ = (broker, nodes, client_id, owner);
        Taken::None
    }
}

#[cfg(feature = "postgres")]
async fn take_from_postgres(
    broker: &Arc<BrokerState>,
    nodes: &Nodes<'_>,
    client_id: &str,
    owner: &str,
) -> Taken {
    use mercurio_storage::postgres::{peer, HEARTBEAT_STALE};
    use mercurio_storage::ErrorKind;

    use crate::broker::handover::HandedOver;

    let Some(url) = broker.config.cluster.peer_storage.get(owner) else {
        return Taken::None;
    };
    let started = std::time::Instant::now();
    let host = format!("{}{}", peer::TAKER_HOST_PREFIX, nodes.node);
    let taken = peer::take_session(url, client_id, &host, nodes.timeout, HEARTBEAT_STALE).await;
    let (mut record, messages, hold) = match taken {
        Ok(Some(taken)) => taken,
        Ok(None) => {
            tracing::info!(%client_id, %owner, "cluster: the storage of the node gone holds no session of this client: a new session");
            return Taken::None;
        }
        Err(e) if e.kind() == ErrorKind::Fenced => {
            return Taken::Unavailable(format!(
                "node {owner} does not answer but still serves its database: {e}"
            ));
        }
        Err(e) => {
            tracing::warn!(%client_id, %owner, "cluster: the session cannot be taken from the storage of the node gone, a new session is started (the old one stays in that storage and ends, its queued messages with it, when its node is back and finds the session owned here): {e}");
            return Taken::None;
        }
    };
    // The crashed connection's will: published once the take is confirmed, if due.
    let will = due_will(&mut record, hold.silent_for());
    tracing::info!(
        %client_id,
        %owner,
        epoch = hold.epoch(),
        queued = record.queued.len(),
        inflight = record.inflight.len(),
        will_due = will.is_some(),
        ms = started.elapsed().as_millis() as u64,
        "cluster: session taken from the storage of a node gone, its database fenced"
    );
    let js = super::jetstream::context(nodes.client.clone());
    let names = super::jetstream::Names::new(nodes.prefix);
    let subject = names.node_subject(owner);
    let broker = Arc::downgrade(broker);
    let (client_id, owner) = (client_id.to_string(), owner.to_string());
    let confirm = Box::new(move || {
        tokio::spawn(async move {
            match hold.finish().await {
                Ok(()) => {
                    if let (Some(will), Some(broker)) = (will, broker.upgrade()) {
                        tracing::info!(%client_id, %owner, topic = %will.msg.topic, "cluster: the will of the connection that ended with the node gone, published");
                        broker.publish_will(&client_id, will);
                    }
                }
                Err(e) => {
                    tracing::warn!(%client_id, %owner, will_left = will.is_some(), "cluster: the session taken is still in the storage of the node gone, with its will; that copy ends when the node starts again (the registry names this node the owner): {e}");
                }
            }
            tokio::time::sleep(INTEREST_SPREAD).await;
            redeliver(broker, js, names.stream, subject, client_id).await;
        });
    });
    Taken::Session(Box::new(HandedOver {
        record,
        messages,
        stale: false,
        confirm,
    }))
}

/// Takes the crashed connection's will out of `record`, and returns it when it is due now
/// (`mercurio_storage::postgres::peer::will_wait`): a 3.1.1 will or one without a Will
/// Delay Interval [MQTT-3.1.2-8], or one whose delay (or the session's expiry, if sooner)
/// has passed since the connection ended, at the node's last heartbeat in its database
/// (`silent_for` before now). A will not yet due is dropped: its client has connected
/// again [MQTT-3.1.3-9].
#[cfg(feature = "postgres")]
fn due_will(
    record: &mut mercurio_storage::SessionRecord,
    silent_for: Option<Duration>,
) -> Option<crate::session::Will> {
    let now_ms = crate::persist::records::unix_ms();
    let left = mercurio_storage::postgres::peer::will_wait(record, silent_for, now_ms)?;
    let stored = record.will.take()?;
    if !left.is_zero() {
        tracing::info!(client_id = %record.client_id, delay = stored.delay_interval, "cluster: the will of the connection that ended with the node gone is not due: not published, its client connected again");
        return None;
    }
    will_of(&record.client_id, &stored)
}

/// The will `stored` of `client_id`'s session, to publish now; `None` (logged) when it
/// cannot be read.
#[cfg(feature = "postgres")]
pub(super) fn will_of(
    client_id: &str,
    stored: &mercurio_storage::WillRecord,
) -> Option<crate::session::Will> {
    let now_ms = crate::persist::records::unix_ms();
    match crate::persist::records::will_from(stored, std::time::Instant::now(), now_ms) {
        Ok(will) => Some(will),
        Err(e) => {
            tracing::warn!(%client_id, "cluster: the will of a connection that ended with a node gone cannot be read, not published: {e}");
            None
        }
    }
}

/// Gives the session `client_id` what the stream holds on `subject` (a node gone's), up to
/// its last message now, without consuming it: the node's durable consumer keeps it for
/// the node's other sessions.
#[cfg(feature = "postgres")]
async fn redeliver(
    broker: Weak<BrokerState>,
    js: async_nats::jetstream::Context,
    stream: String,
    subject: String,
    client_id: String,
) {
    let mut stream = match js.get_stream(&stream).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%client_id, "cluster: what the node gone was sent for the session taken cannot be read: {e}");
            return;
        }
    };
    let last = match stream.info().await {
        Ok(info) => info.state.last_sequence,
        Err(e) => {
            tracing::warn!(%client_id, "cluster: what the node gone was sent for the session taken cannot be read: {e}");
            return;
        }
    };
    let publisher: Arc<str> = Arc::from(super::CLUSTER_CLIENT_ID);
    let mut seen = super::dedup::Seen::default();
    let mut warned = super::Throttle::default();
    let (mut next, mut given) = (1, 0u64);
    while next <= last {
        let m = match stream
            .get_first_raw_message_by_subject(&subject, next)
            .await
        {
            Ok(m) if m.sequence <= last => m,
            // None left (or only newer ones).
            _ => break,
        };
        next = m.sequence + 1;
        let Some(broker) = broker.upgrade() else {
            return;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let age = u32::try_from(now - m.time.unix_timestamp()).ok();
        let Some(msg) = super::jetstream::receive(
            &broker,
            &publisher,
            &mut seen,
            &mut warned,
            &m.subject,
            &m.payload,
            age,
        ) else {
            continue;
        };
        if broker.deliver_to_client(&client_id, &Arc::new(msg)) {
            given += 1;
        }
        // As fast as the client takes them, as a publisher's: the backlog of a node stalled
        // or gone for seconds is more than a session's queue holds (its limit drops).
        let session = broker.sessions.lock().get(client_id.as_str()).cloned();
        if let Some(session) = session {
            session.wait_room(&broker.limits, &broker.stats).await;
        }
    }
    tracing::info!(%client_id, given, "cluster: messages the node gone was sent and never took, given to the session taken from its storage");
}
