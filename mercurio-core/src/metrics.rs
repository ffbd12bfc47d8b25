//! `GET /metrics` (docs/operations.md, "Health and metrics"): the counters of `$SYS` with
//! the metric names and types of docs/http.md, read from the broker's state at the time of the request whatever
//! `sys_interval` is. Served in the Prometheus text format 0.0.4 (counters named with
//! `_total` in their `# HELP` and `# TYPE` lines), or in OpenMetrics 1.0 when the request's
//! `Accept` header prefers it ([`wants_openmetrics`]), as Prometheus itself asks.
//!
//! The values come from the same sources as `$SYS/broker/...` ([`Snapshot::take`]): the
//! [`Stats`](crate::stats::Counters) counters and the session, subscription and retained stores.
//! Each broker has a [`prometheus_client`] registry of its own (nothing global, so several
//! embedded brokers never mix their numbers) holding one collector that takes a snapshot per
//! scrape.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::broker::BrokerState;
use crate::stats::DropCause;

/// The content type of the OpenMetrics exposition.
pub(crate) const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the Prometheus text exposition (format 0.0.4), the default.
pub(crate) const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a request's `Accept` header asks for OpenMetrics rather than the Prometheus text
/// format: `application/openmetrics-text` is listed with a quality above 0 and at least that
/// of `text/plain` (Prometheus sends both, OpenMetrics first). Without the header, or with
/// only `*/*` or `text/plain`, the answer is the text format.
pub(crate) fn wants_openmetrics(accept: Option<&str>) -> bool {
    let Some(accept) = accept else {
        return false;
    };
    let (mut openmetrics, mut text) = (0.0f32, 0.0f32);
    for range in accept.split(',') {
        let mut parts = range.split(';');
        let media = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.trim().strip_prefix("q="))
            .find_map(|q| q.trim().parse::<f32>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => openmetrics = openmetrics.max(q),
            "text/plain" | "text/*" | "*/*" => text = text.max(q),
            _ => {}
        }
    }
    openmetrics > 0.0 && openmetrics >= text
}

/// The `$SYS` statistics at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub clients_connected: u64,
    pub clients_maximum: u64,
    pub sessions: u64,
    pub sessions_disconnected: u64,
    pub sessions_expired: u64,
    pub clients_stalled: u64,
    pub clients_rate_limited: u64,
    pub clients_rate_limited_ms: u64,
    pub connections_delayed: u64,
    pub clients_parked: u64,
    pub clients_moved: u64,
    pub shared_passed_on: u64,
    pub messages_received: u64,
    pub messages_sent: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub retained_messages: u64,
    pub retained_bytes: u64,
    pub retained_not_kept_count: u64,
    pub retained_not_kept_bytes: u64,
    pub subscriptions: u64,
    pub dropped: [(DropCause, u64); 7],
    /// Bytes held by the messages in every session's queue (`queued_memory`).
    pub queued_bytes: u64,
    pub storage_batches_retried: u64,
    pub storage_batches_dropped: u64,
    pub storage_dirty_clients: u64,
    pub storage_pending_bytes: u64,
    pub storage_waiting_clients: u64,
    pub storage_writes_failed: u64,
    pub storage_unwritable: u64,
    pub connections_total: u64,
    pub uptime_seconds: u64,
    /// The cluster link's values, in cluster mode.
    pub cluster: Option<crate::cluster_status::ClusterInfo>,
}

impl Snapshot {
    /// Reads every value as `$SYS` does (`sys.rs`), without publishing anything.
    pub(crate) fn take(broker: &BrokerState) -> Snapshot {
        let s = &broker.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let (sessions, connected) = broker.session_counts();
        let (sessions, connected) = (sessions as u64, connected as u64);
        let (retained_messages, retained_bytes) = {
            let store = broker.retained.lock();
            (store.len() as u64, store.bytes() as u64)
        };
        Snapshot {
            clients_connected: connected,
            clients_maximum: get(&s.clients_maximum),
            sessions,
            sessions_disconnected: sessions - connected.min(sessions),
            sessions_expired: get(&s.sessions_expired),
            clients_stalled: get(&s.clients_stalled),
            clients_rate_limited: get(&s.clients_rate_limited),
            clients_rate_limited_ms: get(&s.clients_rate_limited_us) / 1000,
            connections_delayed: get(&s.connections_delayed),
            clients_parked: get(&s.clients_parked),
            clients_moved: get(&s.clients_moved),
            shared_passed_on: get(&s.shared_passed_on),
            messages_received: get(&s.messages_received),
            messages_sent: get(&s.messages_sent),
            bytes_received: get(&s.bytes_received),
            bytes_sent: get(&s.bytes_sent),
            retained_messages,
            retained_bytes,
            retained_not_kept_count: get(&s.retained_not_kept_count),
            retained_not_kept_bytes: get(&s.retained_not_kept_bytes),
            subscriptions: broker.index.read().len() as u64,
            dropped: DropCause::ALL.map(|c| (c, s.dropped_count(c))),
            queued_bytes: broker.queued_memory.bytes(),
            storage_batches_retried: get(&s.storage_batches_retried),
            storage_batches_dropped: get(&s.storage_batches_dropped),
            storage_dirty_clients: get(&s.storage_clients_dirty),
            storage_pending_bytes: get(&s.storage_pending_bytes),
            storage_waiting_clients: get(&s.storage_clients_waiting),
            storage_writes_failed: get(&s.storage_writes_failed),
            storage_unwritable: get(&s.storage_unwritable),
            connections_total: get(&s.connections_total),
            uptime_seconds: broker.started.elapsed().as_secs(),
            cluster: broker.cluster_info(),
        }
    }
}

/// A broker's metrics registry.
pub(crate) struct Metrics {
    registry: Registry,
    broker: Arc<BrokerState>,
}

impl Metrics {
    /// A registry whose one collector reads `broker` at each scrape.
    pub(crate) fn new(broker: Arc<BrokerState>) -> Metrics {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(BrokerCollector {
            broker: Arc::clone(&broker),
        }));
        Metrics { registry, broker }
    }

    /// The exposition served by `GET /metrics` and its content type: OpenMetrics when
    /// `openmetrics`, the Prometheus text format 0.0.4 otherwise.
    pub(crate) fn render(&self, openmetrics: bool) -> (String, &'static str) {
        let mut out = String::with_capacity(4096);
        if openmetrics {
            // Writing to a String cannot fail; an error would leave a partial exposition.
            let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
            (out, OPENMETRICS_CONTENT_TYPE)
        } else {
            for f in families(
                &Snapshot::take(&self.broker),
                &bridge_infos(&self.broker),
                &stream_infos(&self.broker),
            ) {
                f.write_text(&mut out);
            }
            (out, TEXT_CONTENT_TYPE)
        }
    }
}

/// One metric family: its name (without `_total`), help text, type and samples (a label
/// `(name, value)` or none, and the value).
struct Family {
    name: &'static str,
    help: &'static str,
    counter: bool,
    samples: Vec<(Option<(&'static str, String)>, u64)>,
}

impl Family {
    fn gauge(name: &'static str, help: &'static str, value: u64) -> Family {
        Family {
            name,
            help,
            counter: false,
            samples: vec![(None, value)],
        }
    }

    fn counter(name: &'static str, help: &'static str, value: u64) -> Family {
        Family {
            name,
            help,
            counter: true,
            samples: vec![(None, value)],
        }
    }

    /// The family in the Prometheus text format 0.0.4: a counter's `# HELP`, `# TYPE` and
    /// samples all carry the `_total` suffix.
    fn write_text(&self, out: &mut String) {
        use std::fmt::Write;
        let (suffix, kind) = if self.counter {
            ("_total", "counter")
        } else {
            ("", "gauge")
        };
        let help = self.help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(out, "# HELP {}{suffix} {help}", self.name);
        let _ = writeln!(out, "# TYPE {}{suffix} {kind}", self.name);
        for (label, value) in &self.samples {
            match label {
                Some((k, v)) => {
                    let v = v
                        .replace('\\', "\\\\")
                        .replace('"', "\\\"")
                        .replace('\n', "\\n");
                    let _ = writeln!(out, "{}{suffix}{{{k}=\"{v}\"}} {value}", self.name);
                }
                None => {
                    let _ = writeln!(out, "{}{suffix} {value}", self.name);
                }
            }
        }
    }

    /// The family through prometheus-client's OpenMetrics encoder (which appends `_total` to
    /// a counter's samples).
    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let kind = if self.counter {
            MetricType::Counter
        } else {
            MetricType::Gauge
        };
        let mut m = encoder.encode_descriptor(self.name, self.help, None, kind)?;
        let metric = |value: u64| -> Box<dyn EncodeMetric> {
            if self.counter {
                Box::new(ConstCounter::new(value))
            } else {
                Box::new(ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)))
            }
        };
        if let [(None, value)] = self.samples[..] {
            return metric(value).encode(m);
        }
        for (label, value) in &self.samples {
            let labels: Vec<(&str, &str)> = label.iter().map(|(k, v)| (*k, v.as_str())).collect();
            metric(*value).encode(m.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The bridges' counters, for their `/metrics` series.
fn bridge_infos(broker: &BrokerState) -> Vec<crate::bridge_status::BridgeInfo> {
    broker.bridges.lock().iter().map(|b| b.info()).collect()
}

/// Per-bridge series, labelled `bridge="<name>"` (none without bridges).
fn bridge_families(bridges: &[crate::bridge_status::BridgeInfo]) -> Vec<Family> {
    if bridges.is_empty() {
        return Vec::new();
    }
    type Pick = fn(&crate::bridge_status::BridgeInfo) -> u64;
    let families: [(&'static str, &'static str, bool, Pick); 7] = [
        (
            "mercurio_bridge_connected",
            "1 while the bridge is connected to its remote, else 0",
            false,
            |b| u64::from(b.connected),
        ),
        (
            "mercurio_bridge_queued_messages",
            "Messages waiting for the remote, in flight included",
            false,
            |b| b.queued as u64,
        ),
        (
            "mercurio_bridge_messages_dropped",
            "Messages for the remote dropped by the queue's limits",
            true,
            |b| b.dropped,
        ),
        (
            "mercurio_bridge_reconnects",
            "Connections to the remote made after the first",
            true,
            |b| b.reconnects,
        ),
        (
            "mercurio_bridge_packets_too_large",
            "Connections closed for a packet from the remote over the bridge's max_packet_size",
            true,
            |b| b.packets_too_large,
        ),
        (
            "mercurio_bridge_messages_forwarded_in",
            "Messages from the remote published here",
            true,
            |b| b.forwarded_in,
        ),
        (
            "mercurio_bridge_messages_forwarded_out",
            "Messages the remote acknowledged (QoS 1/2) or was sent (QoS 0)",
            true,
            |b| b.forwarded_out,
        ),
    ];
    families
        .into_iter()
        .map(|(name, help, counter, pick)| Family {
            name,
            help,
            counter,
            samples: bridges
                .iter()
                .map(|b| (Some(("bridge", b.name.clone())), pick(b)))
                .collect(),
        })
        .collect()
}

/// Every family of `/metrics`, in the order served, from one snapshot.
fn families(
    s: &Snapshot,
    bridges: &[crate::bridge_status::BridgeInfo],
    streams: &[crate::streams::StreamInfo],
) -> Vec<Family> {
    let mut all = vec![
        Family::gauge(
            "mercurio_clients_connected",
            "Clients connected now",
            s.clients_connected,
        ),
        Family::gauge(
            "mercurio_clients_connected_max",
            "Most clients connected at once",
            s.clients_maximum,
        ),
        Family::gauge(
            "mercurio_clients_parked",
            "Connections parked now (idle for park_after, held without a task)",
            s.clients_parked,
        ),
        Family::gauge(
            "mercurio_sessions",
            "Sessions, connected or not",
            s.sessions,
        ),
        Family::gauge(
            "mercurio_sessions_disconnected",
            "Sessions kept for clients that are not connected",
            s.sessions_disconnected,
        ),
        Family::counter(
            "mercurio_sessions_expired",
            "Sessions ended by their expiry",
            s.sessions_expired,
        ),
        Family::counter(
            "mercurio_clients_moved",
            "Connections served again on another thread than before (--threads above 1)",
            s.clients_moved,
        ),
        Family::counter(
            "mercurio_clients_stalled",
            "Times a client with queued messages took none for stall_time and stopped holding publishers back",
            s.clients_stalled,
        ),
        Family::counter(
            "mercurio_clients_rate_limited",
            "Times a client's PUBLISH waited for max_publish_rate or max_publish_bytes_rate (its socket not read meanwhile)",
            s.clients_rate_limited,
        ),
        Family::counter(
            "mercurio_clients_rate_limited_milliseconds",
            "Milliseconds clients' PUBLISH packets waited for the publish rate limits, in total",
            s.clients_rate_limited_ms,
        ),
        Family::counter(
            "mercurio_connections_delayed",
            "Accepted connections that waited for their listener's max_connection_rate",
            s.connections_delayed,
        ),
        Family::counter(
            "mercurio_shared_passed_on",
            "Messages a shared subscription's member left unacknowledged that another member of the group took",
            s.shared_passed_on,
        ),
        Family::counter(
            "mercurio_messages_received",
            "PUBLISH packets received",
            s.messages_received,
        ),
        Family::counter(
            "mercurio_messages_sent",
            "PUBLISH packets sent",
            s.messages_sent,
        ),
        Family::counter(
            "mercurio_bytes_received",
            "Bytes received",
            s.bytes_received,
        ),
        Family::counter("mercurio_bytes_sent", "Bytes sent", s.bytes_sent),
        Family::gauge(
            "mercurio_retained_messages",
            "Retained messages stored, $SYS ones not counted",
            s.retained_messages,
        ),
        Family::gauge(
            "mercurio_retained_bytes",
            "Bytes the retained messages take (topic, payload and properties), $SYS ones not counted",
            s.retained_bytes,
        ),
        Family {
            name: "mercurio_retained_not_kept",
            help: "Retained messages delivered but not kept, by the limit they met",
            counter: true,
            samples: vec![
                (
                    Some(("limit", "max_retained_messages".to_string())),
                    s.retained_not_kept_count,
                ),
                (
                    Some(("limit", "max_retained_bytes".to_string())),
                    s.retained_not_kept_bytes,
                ),
            ],
        },
        Family::gauge("mercurio_subscriptions", "Subscriptions", s.subscriptions),
        Family::gauge(
            "mercurio_queued_bytes",
            "Bytes the messages waiting in sessions' queues hold in memory (topic, payload and properties, once per queue), what max_queued_memory bounds",
            s.queued_bytes,
        ),
        Family {
            name: "mercurio_messages_dropped",
            help: "Messages lost before reaching a subscriber, by cause",
            counter: true,
            samples: s
                .dropped
                .iter()
                .map(|(cause, n)| (Some(("cause", cause.name().to_string())), *n))
                .collect(),
        },
        Family::counter(
            "mercurio_storage_batches_retried",
            "Batches of session changes written again after a storage error",
            s.storage_batches_retried,
        ),
        Family::counter(
            "mercurio_storage_batches_dropped",
            "Batches of session changes storage refused for good",
            s.storage_batches_dropped,
        ),
        Family::gauge(
            "mercurio_storage_dirty_clients",
            "Clients whose stored state differs from the broker's until written whole again",
            s.storage_dirty_clients,
        ),
        Family::gauge(
            "mercurio_storage_pending_bytes",
            "Bytes of session and retained changes not yet stored",
            s.storage_pending_bytes,
        ),
        Family::gauge(
            "mercurio_storage_waiting_clients",
            "Connections not read until storage catches up with what their client owes",
            s.storage_waiting_clients,
        ),
        Family::counter(
            "mercurio_storage_writes_failed",
            "Attempts to write a batch of changes that storage failed",
            s.storage_writes_failed,
        ),
        Family::gauge(
            "mercurio_storage_unwritable",
            "1 while storage has taken no write for a second or more (full disk, database down)",
            s.storage_unwritable,
        ),
        Family::counter(
            "mercurio_connections",
            "Connections accepted",
            s.connections_total,
        ),
        Family::gauge(
            "mercurio_uptime_seconds",
            "Seconds since the broker started",
            s.uptime_seconds,
        ),
    ];
    all.extend(bridge_families(bridges));
    all.extend(s.cluster.map(cluster_families).into_iter().flatten());
    all.extend(stream_families(streams));
    all
}

/// What each stream holds, for its `/metrics` series.
fn stream_infos(broker: &BrokerState) -> Vec<crate::streams::StreamInfo> {
    broker.streams.all().iter().map(|s| s.info()).collect()
}

/// Per-stream series, labelled `stream="<name>"` (none without streams).
fn stream_families(streams: &[crate::streams::StreamInfo]) -> Vec<Family> {
    if streams.is_empty() {
        return Vec::new();
    }
    type Pick = fn(&crate::streams::StreamInfo) -> u64;
    let families: [(&'static str, &'static str, bool, Pick); 8] = [
        (
            "mercurio_stream_messages",
            "Messages the stream holds",
            false,
            |s| s.messages,
        ),
        (
            "mercurio_stream_bytes",
            "Bytes the stream holds (topic, payload and properties of each message)",
            false,
            |s| s.bytes,
        ),
        (
            "mercurio_stream_in_memory_messages",
            "Messages of the stream held in memory (the newest; with storage, the others are read back from it)",
            false,
            |s| s.in_memory,
        ),
        (
            "mercurio_stream_first_offset",
            "Offset of the oldest message the stream holds (the next offset when empty)",
            false,
            |s| s.first_offset,
        ),
        (
            "mercurio_stream_last_offset",
            "Offset of the newest message appended (0 before the first)",
            false,
            |s| s.last_offset,
        ),
        (
            "mercurio_stream_readers",
            "Readers reading the stream now",
            false,
            |s| s.readers,
        ),
        (
            "mercurio_stream_trimmed_messages",
            "Messages retention removed (max_age, max_bytes, last_value)",
            true,
            |s| s.trimmed_messages,
        ),
        (
            "mercurio_stream_trimmed_bytes",
            "Bytes retention removed",
            true,
            |s| s.trimmed_bytes,
        ),
    ];
    families
        .into_iter()
        .map(|(name, help, counter, pick)| Family {
            name,
            help,
            counter,
            samples: streams
                .iter()
                .map(|s| (Some(("stream", s.name.clone())), pick(s)))
                .collect(),
        })
        .collect()
}

/// The cluster link's series (none outside cluster mode).
fn cluster_families(c: crate::cluster_status::ClusterInfo) -> Vec<Family> {
    vec![
        Family::gauge(
            "mercurio_cluster_connected",
            "1 while connected to a NATS server, else 0",
            u64::from(c.connected),
        ),
        Family::gauge(
            "mercurio_cluster_degraded",
            "1 while cluster mode is on and NATS is unreachable (local clients served, messages for other nodes waiting), else 0",
            u64::from(c.degraded),
        ),
        Family::gauge(
            "mercurio_cluster_nodes",
            "Nodes up (their heartbeats arriving), this one included",
            c.nodes,
        ),
        Family::gauge(
            "mercurio_cluster_clients",
            "Clients connected to the nodes up, this node's included",
            c.clients,
        ),
        Family::counter(
            "mercurio_cluster_retained_out",
            "Retained changes (set or cleared) made here and sent to the other nodes",
            c.retained_out,
        ),
        Family::counter(
            "mercurio_cluster_retained_in",
            "Retained changes from other nodes applied here",
            c.retained_in,
        ),
        Family::counter(
            "mercurio_cluster_reconnects",
            "Connections to NATS made after the first",
            c.reconnects,
        ),
        Family::gauge(
            "mercurio_cluster_subscriptions",
            "NATS subscriptions of this node (its interest, shared groups included)",
            c.subscriptions,
        ),
        Family::counter(
            "mercurio_cluster_messages_out",
            "Messages sent to NATS for other nodes",
            c.messages_out,
        ),
        Family::counter(
            "mercurio_cluster_bytes_out",
            "Payload bytes of the messages sent to NATS",
            c.bytes_out,
        ),
        Family::counter(
            "mercurio_cluster_messages_in",
            "Messages from other nodes routed here",
            c.messages_in,
        ),
        Family::counter(
            "mercurio_cluster_bytes_in",
            "Payload bytes of the messages from other nodes",
            c.bytes_in,
        ),
        Family::counter(
            "mercurio_cluster_duplicates",
            "Copies of a message taken already (it matched several of this node's subjects)",
            c.duplicates,
        ),
        Family::counter(
            "mercurio_cluster_errors",
            "Messages not sent to NATS (too large, closed) or unreadable from NATS",
            c.errors,
        ),
        Family::counter(
            "mercurio_cluster_slow_consumer",
            "Times NATS dropped messages for this node as a slow consumer",
            c.slow_consumer,
        ),
        Family::counter(
            "mercurio_cluster_jetstream_out",
            "QoS 1/2 messages JetStream took for other nodes",
            c.jetstream_out,
        ),
        Family::counter(
            "mercurio_cluster_jetstream_in",
            "QoS 1/2 messages from other nodes taken from JetStream and routed here",
            c.jetstream_in,
        ),
        Family::counter(
            "mercurio_cluster_jetstream_retries",
            "Copies published to JetStream again after it did not acknowledge them",
            c.jetstream_retries,
        ),
        Family::counter(
            "mercurio_cluster_jetstream_timeouts",
            "Messages JetStream did not take within jetstream_ack_timeout",
            c.jetstream_timeouts,
        ),
        Family::counter(
            "mercurio_cluster_jetstream_settings_differ",
            "Times the JetStream stream was found with other settings than this node's (kept)",
            c.jetstream_settings_differ,
        ),
        Family::gauge(
            "mercurio_cluster_jetstream_pending_bytes",
            "Bytes handed to JetStream for other nodes and not yet acknowledged (a message counts once per node)",
            c.jetstream_pending_bytes,
        ),
        Family::gauge(
            "mercurio_cluster_jetstream_pending_messages",
            "Messages handed to JetStream for other nodes and not yet acknowledged",
            c.jetstream_pending_messages,
        ),
    ]
}

/// Reads the broker's statistics at each scrape (for the OpenMetrics encoder).
struct BrokerCollector {
    broker: Arc<BrokerState>,
}

impl std::fmt::Debug for BrokerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BrokerCollector")
    }
}

impl Collector for BrokerCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in families(
            &Snapshot::take(&self.broker),
            &bridge_infos(&self.broker),
            &stream_infos(&self.broker),
        ) {
            f.encode(&mut e)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::wants_openmetrics;

    #[test]
    fn accept_negotiation() {
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(wants_openmetrics(Some("application/openmetrics-text")));
        // What Prometheus 2.x/3.x sends.
        assert!(wants_openmetrics(Some(
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        )));
        assert!(!wants_openmetrics(Some(
            "text/plain;version=0.0.4,application/openmetrics-text;q=0.5"
        )));
        assert!(!wants_openmetrics(Some("application/openmetrics-text;q=0")));
    }
}
