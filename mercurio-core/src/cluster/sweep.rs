//! The wills of a crashed node's sessions whose clients do not come back (docs/cluster.md,
//! "A crashed node's sessions"): when a node whose database is listed in `[cluster]
//! peer_storage` is declared gone, this node sweeps that database: under the same fencing
//! as a take (`mercurio_storage::postgres::peer::sweep_wills`), the wills due are cleared
//! there (committed), then published here. The lock serialises the sweepers (and takers),
//! so a will is published once in the cluster; cleared before it is published, a will is
//! lost, not doubled, when this node stops in between. Wills not yet due are swept again
//! when the first of them is, while the node is still gone; a session taken meanwhile is
//! no longer there, its will decided by its taker (`recovery.rs`).

use std::sync::Arc;
#[cfg(feature = "postgres")]
use std::time::Duration;

use crate::broker::BrokerState;

/// How long after a sweep that failed (the database unreachable, or its lock still held by
/// a node whose heartbeat there is recent) it is tried again.
#[cfg(feature = "postgres")]
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// How many times in a row a failed sweep is tried again before this node gives up (logged;
/// the wills stay in the database, for a taker or for their node when it is back).
#[cfg(feature = "postgres")]
const RETRIES: u32 = 24;

/// A margin after a will's due time before the sweep that publishes it: the sweep's clock
/// must see it due.
#[cfg(feature = "postgres")]
const DUE_MARGIN: Duration = Duration::from_millis(100);

/// Starts sweeping the database of `node`, just declared gone, if `peer_storage` lists it;
/// the sweeps run on a task of their own until no will is left there to wait for, or the
/// node is back.
pub(super) fn start(broker: &Arc<BrokerState>, node: &str) {
    #[cfg(feature = "postgres")]
    if let Some(url) = broker.config.cluster.peer_storage.get(node) {
        tokio::spawn(sweeps(
            Arc::downgrade(broker),
            node.to_string(),
            url.clone(),
        ));
    }
    #[cfg(not(feature = "postgres"))]
    let _ = (broker, node);
}

/// Whether `node` is heard again.
#[cfg(feature = "postgres")]
fn is_up(broker: &BrokerState, node: &str) -> bool {
    let now = std::time::Instant::now();
    broker
        .cluster
        .peers
        .lock()
        .get(node)
        .is_some_and(|p| p.up(now))
}

#[cfg(feature = "postgres")]
async fn sweeps(broker: std::sync::Weak<BrokerState>, node: String, url: String) {
    use mercurio_storage::postgres::{peer, HEARTBEAT_STALE};

    let mut failures = 0u32;
    loop {
        let (host, wait) = match broker.upgrade() {
            Some(b) if !is_up(&b, &node) => (
                format!("{}{}", peer::TAKER_HOST_PREFIX, b.config.cluster.node_name),
                b.config.cluster.takeover(),
            ),
            Some(_) => {
                tracing::info!(%node, "cluster: the node gone is back: its wills are its own again, no sweep of its storage");
                return;
            }
            None => return,
        };
        let swept = match peer::sweep_wills(&url, &host, wait, HEARTBEAT_STALE).await {
            Ok(swept) => swept,
            Err(e) => {
                failures += 1;
                if failures > RETRIES {
                    tracing::warn!(%node, "cluster: the wills of the node gone cannot be swept from its storage, given up (they stay there): {e}");
                    return;
                }
                tracing::warn!(%node, retry_s = RETRY_AFTER.as_secs(), "cluster: the wills of the node gone cannot be swept from its storage now: {e}");
                tokio::time::sleep(RETRY_AFTER).await;
                continue;
            }
        };
        failures = 0;
        // Cleared there: published now, or lost if this node is stopping.
        let Some(b) = broker.upgrade() else { return };
        for (client_id, cause) in &swept.unreadable {
            tracing::warn!(%node, %client_id, "cluster: a session in the storage of the node gone cannot be read, its will left there: {cause}");
        }
        let published = swept.due.len();
        for record in swept.due {
            let will = record
                .will
                .as_ref()
                .and_then(|w| super::recovery::will_of(&record.client_id, w));
            if let Some(will) = will {
                tracing::info!(%node, client_id = %record.client_id, topic = %will.msg.topic, "cluster: the will of the connection that ended with the node gone, published");
                b.publish_will(&record.client_id, will);
            }
        }
        drop(b);
        tracing::info!(
            %node,
            published,
            next_s = swept.next.map(|d| d.as_secs()),
            "cluster: the wills due in the storage of the node gone swept"
        );
        match swept.next {
            Some(left) => tokio::time::sleep(left + DUE_MARGIN).await,
            None => return,
        }
    }
}
