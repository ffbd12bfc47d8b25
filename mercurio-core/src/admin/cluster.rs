//! `cluster.status` (`mercurioctl cluster status`, `GET /api/v1/cluster`): the nodes of a
//! cluster as one node sees them, and the heartbeat each node announces itself with
//! (docs/cluster.md, "Status").

use serde::{Deserialize, Serialize};

/// What a node announces every `[cluster] heartbeat_interval` on the subject
/// `{prefix}.node.{node_name}`, as JSON, to every node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The node's name (`[cluster] node_name`).
    pub node: String,
    /// The Mercurio version it runs.
    pub version: String,
    /// Clients connected to it now.
    pub clients: u64,
    /// Its clients' sessions now, connected or not (the broker's own left out, as in
    /// `broker.status`).
    pub sessions: u64,
    /// When it last connected to NATS, in seconds since the Unix epoch.
    pub connected_since: u64,
    /// When it started, in seconds since the Unix epoch.
    pub started: u64,
    /// Milliseconds until its next heartbeat: after three such intervals without one, the
    /// others show it as gone.
    pub interval_ms: u64,
    /// True in the last heartbeat of a node that stops: the others show it as gone at once.
    #[serde(default)]
    pub leaving: bool,
    /// The incarnation (random at each start) whose interest changes it numbers.
    #[serde(default)]
    pub interest_incarnation: u64,
    /// The number of its last interest change (docs/cluster.md, "Interest"): a node that
    /// knows an older one asks for the whole set.
    #[serde(default)]
    pub interest_version: u64,
}

/// A node's state as `cluster.status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// The answering node, connected to NATS.
    Connected,
    /// The answering node, cluster mode on but NATS unreachable: it serves its own clients;
    /// what its clients publish for other nodes waits (docs/cluster.md, "Failures").
    Degraded,
    /// Another node whose heartbeats arrive.
    Up,
    /// Another node that missed three heartbeats, or said it was leaving. Shown until it is
    /// back, or for an hour.
    Gone,
}

impl NodeState {
    /// The state as written in JSON: `connected`, `degraded`, `up`, `gone`.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Connected => "connected",
            NodeState::Degraded => "degraded",
            NodeState::Up => "up",
            NodeState::Gone => "gone",
        }
    }
}

/// One node in [`ClusterStatus::members`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterNode {
    /// Its name.
    pub node: String,
    /// `connected` or `degraded` for the answering node, `up` or `gone` for the others.
    pub state: NodeState,
    /// True for the answering node.
    pub this: bool,
    /// Clients connected to it (the answering node's now; another's in its last heartbeat).
    pub clients: u64,
    /// Its clients' sessions, connected or not (the same way; the broker's own left out).
    pub sessions: u64,
    /// The Mercurio version it runs.
    pub version: String,
    /// When it last connected to NATS, in seconds since the Unix epoch; `null` for the
    /// answering node while it never has.
    pub connected_since: Option<u64>,
    /// Milliseconds since its last heartbeat arrived; `null` for the answering node.
    pub last_heartbeat_ms: Option<u64>,
    /// The filters and shared groups its clients subscribe to (outside `$` topics), as the
    /// answering node knows them; `null` for another node whose set is not known yet.
    pub interest: Option<u64>,
}

/// The result of `cluster.status`: the answering node, the totals over the nodes up, and every
/// node known, the answering one first, then by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The answering node's name.
    pub node: String,
    /// The answering node's state: `connected` or `degraded`.
    pub state: NodeState,
    /// Nodes up, the answering one included.
    pub nodes: u64,
    /// Clients connected to the nodes up.
    pub clients: u64,
    /// Retained topics the answering node holds a stamp for (retained messages and recent
    /// clears; docs/cluster.md, "Retained messages").
    pub retained_stamps: u64,
    /// Retained changes made on the answering node and sent to the others.
    pub retained_out: u64,
    /// Retained changes from other nodes the answering node applied.
    pub retained_in: u64,
    /// Bytes the answering node handed to JetStream for other nodes and JetStream has not
    /// acknowledged yet (a message counts once per destination node; docs/cluster.md, "QoS
    /// across nodes"). 0 with `jetstream = false`.
    #[serde(default)]
    pub jetstream_pending_bytes: u64,
    /// The messages of `jetstream_pending_bytes`.
    #[serde(default)]
    pub jetstream_pending_messages: u64,
    /// Persistent sessions the session registry names the answering node the owner of, as
    /// far as it knows (its claims since its start, and those it found its own at its
    /// connection to NATS; docs/cluster.md, "Sessions across nodes"). `None` without the
    /// registry (`jetstream = false`).
    #[serde(default)]
    pub registry_sessions: Option<u64>,
    /// Every node known.
    pub members: Vec<ClusterNode>,
}
