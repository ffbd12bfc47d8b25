//! `GET /metrics` (docs/operations.md, "Health and metrics"): the counters of `$SYS` in the
//! Prometheus text format, with the metric names and types of docs/http.md, read from the broker's state at the
//! time of the request whatever `sys_interval` is.
//!
//! The values come from the same sources as `$SYS/broker/...` ([`Snapshot::take`]): the
//! [`Stats`](crate::stats::Stats) counters and the session, subscription and retained stores.
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

/// The content type of [`Metrics::render`]'s output (OpenMetrics text, which Prometheus
/// scrapes natively and every Prometheus text parser reads).
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `$SYS` statistics at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub clients_connected: u64,
    pub clients_maximum: u64,
    pub sessions: u64,
    pub sessions_disconnected: u64,
    pub sessions_expired: u64,
    pub messages_received: u64,
    pub messages_sent: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub retained_messages: u64,
    pub subscriptions: u64,
    pub dropped: [(DropCause, u64); 6],
    pub storage_batches_retried: u64,
    pub storage_batches_dropped: u64,
    pub storage_dirty_clients: u64,
    pub connections_total: u64,
    pub uptime_seconds: u64,
}

impl Snapshot {
    /// Reads every value as `$SYS` does (`sys.rs`), without publishing anything.
    pub(crate) fn take(broker: &BrokerState) -> Snapshot {
        let s = &broker.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let (sessions, connected) = broker.session_counts();
        let (sessions, connected) = (sessions as u64, connected as u64);
        Snapshot {
            clients_connected: connected,
            clients_maximum: get(&s.clients_maximum),
            sessions,
            sessions_disconnected: sessions - connected.min(sessions),
            sessions_expired: get(&s.sessions_expired),
            messages_received: get(&s.messages_received),
            messages_sent: get(&s.messages_sent),
            bytes_received: get(&s.bytes_received),
            bytes_sent: get(&s.bytes_sent),
            retained_messages: broker.retained.lock().len() as u64,
            subscriptions: broker.index.read().len() as u64,
            dropped: DropCause::ALL.map(|c| (c, s.dropped_count(c))),
            storage_batches_retried: get(&s.storage_batches_retried),
            storage_batches_dropped: get(&s.storage_batches_dropped),
            storage_dirty_clients: get(&s.storage_clients_dirty),
            connections_total: get(&s.connections_total),
            uptime_seconds: broker.started.elapsed().as_secs(),
        }
    }
}

/// A broker's metrics registry.
pub(crate) struct Metrics {
    registry: Registry,
}

impl Metrics {
    /// A registry whose one collector reads `broker` at each scrape.
    pub(crate) fn new(broker: Arc<BrokerState>) -> Metrics {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(BrokerCollector { broker }));
        Metrics { registry }
    }

    /// The exposition, as served by `GET /metrics`.
    pub(crate) fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Reads the broker's statistics at each scrape.
struct BrokerCollector {
    broker: Arc<BrokerState>,
}

impl std::fmt::Debug for BrokerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BrokerCollector")
    }
}

/// Counters are named without `_total` here: the encoder appends it to the sample name, so the
/// scraped series are docs/http.md's `mercurio_..._total`.
fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(value);
    let m = encoder.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(m)
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
    let m = encoder.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(m)
}

impl Collector for BrokerCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = Snapshot::take(&self.broker);
        let e = &mut e;
        gauge(
            e,
            "mercurio_clients_connected",
            "Clients connected now",
            s.clients_connected,
        )?;
        gauge(
            e,
            "mercurio_clients_connected_max",
            "Most clients connected at once",
            s.clients_maximum,
        )?;
        gauge(
            e,
            "mercurio_sessions",
            "Sessions, connected or not",
            s.sessions,
        )?;
        gauge(
            e,
            "mercurio_sessions_disconnected",
            "Sessions kept for clients that are not connected",
            s.sessions_disconnected,
        )?;
        counter(
            e,
            "mercurio_sessions_expired",
            "Sessions ended by their expiry",
            s.sessions_expired,
        )?;
        counter(
            e,
            "mercurio_messages_received",
            "PUBLISH packets received",
            s.messages_received,
        )?;
        counter(
            e,
            "mercurio_messages_sent",
            "PUBLISH packets sent",
            s.messages_sent,
        )?;
        counter(
            e,
            "mercurio_bytes_received",
            "Bytes received",
            s.bytes_received,
        )?;
        counter(e, "mercurio_bytes_sent", "Bytes sent", s.bytes_sent)?;
        gauge(
            e,
            "mercurio_retained_messages",
            "Retained messages stored, $SYS ones not counted",
            s.retained_messages,
        )?;
        gauge(
            e,
            "mercurio_subscriptions",
            "Subscriptions",
            s.subscriptions,
        )?;
        {
            let mut m = e.encode_descriptor(
                "mercurio_messages_dropped",
                "Messages lost before reaching a subscriber, by cause",
                None,
                MetricType::Counter,
            )?;
            for (cause, n) in s.dropped {
                let labels = [("cause", cause.name())];
                ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
            }
        }
        counter(
            e,
            "mercurio_storage_batches_retried",
            "Batches of session changes written again after a storage error",
            s.storage_batches_retried,
        )?;
        counter(
            e,
            "mercurio_storage_batches_dropped",
            "Batches of session changes storage refused for good",
            s.storage_batches_dropped,
        )?;
        gauge(
            e,
            "mercurio_storage_dirty_clients",
            "Clients whose stored state differs from the broker's until written whole again",
            s.storage_dirty_clients,
        )?;
        counter(
            e,
            "mercurio_connections",
            "Connections accepted",
            s.connections_total,
        )?;
        gauge(
            e,
            "mercurio_uptime_seconds",
            "Seconds since the broker started",
            s.uptime_seconds,
        )?;
        bridges(e, &self.broker)
    }
}

/// Per-bridge series, labelled `bridge="<name>"` (none without bridges).
fn bridges(e: &mut DescriptorEncoder, broker: &BrokerState) -> Result<(), std::fmt::Error> {
    let list: Vec<_> = broker.bridges.lock().iter().map(|b| b.info()).collect();
    if list.is_empty() {
        return Ok(());
    }
    type Pick = fn(&crate::bridge::BridgeInfo) -> u64;
    let families: [(&str, &str, MetricType, Pick); 5] = [
        (
            "mercurio_bridge_connected",
            "1 while the bridge is connected to its remote, else 0",
            MetricType::Gauge,
            |b| u64::from(b.connected),
        ),
        (
            "mercurio_bridge_queued_messages",
            "Messages waiting for the remote, in flight included",
            MetricType::Gauge,
            |b| b.queued as u64,
        ),
        (
            "mercurio_bridge_messages_dropped",
            "Messages for the remote dropped by the queue's limits",
            MetricType::Counter,
            |b| b.dropped,
        ),
        (
            "mercurio_bridge_reconnects",
            "Connections to the remote made after the first",
            MetricType::Counter,
            |b| b.reconnects,
        ),
        (
            "mercurio_bridge_messages_forwarded_in",
            "Messages from the remote published here",
            MetricType::Counter,
            |b| b.forwarded_in,
        ),
    ];
    for (name, help, kind, pick) in families {
        let mut m = e.encode_descriptor(name, help, None, kind.clone())?;
        for b in &list {
            let labels = [("bridge", b.name.as_str())];
            let v = pick(b);
            match kind {
                MetricType::Counter => ConstCounter::new(v).encode(m.encode_family(&labels)?)?,
                _ => ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
                    .encode(m.encode_family(&labels)?)?,
            }
        }
    }
    let mut m = e.encode_descriptor(
        "mercurio_bridge_messages_forwarded_out",
        "Messages the remote acknowledged (QoS 1/2) or was sent (QoS 0)",
        None,
        MetricType::Counter,
    )?;
    for b in &list {
        let labels = [("bridge", b.name.as_str())];
        ConstCounter::new(b.forwarded_out).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}
