//! `$SYS/broker/...` statistics (docs/operations.md, "$SYS"): published retained every
//! `sys_interval` seconds with mosquitto's topic names, kept in memory only, in a retained
//! store of their own so they never count as retained messages or against
//! `max_retained_messages` and `max_retained_bytes`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::broker::BrokerState;
use crate::message::Message;
use crate::stats::DropCause;

/// 1, 5 and 15 minute exponentially weighted averages of a per-minute rate, as mosquitto's
/// `load/...` topics report them.
#[derive(Debug, Default, Clone, Copy)]
struct Load {
    last: u64,
    avg: [f64; 3],
}

impl Load {
    const PERIODS: [f64; 3] = [60.0, 300.0, 900.0];

    /// Folds in the counter's value after `interval` seconds.
    fn update(&mut self, counter: u64, interval: f64) {
        let per_minute = counter.saturating_sub(self.last) as f64 * 60.0 / interval;
        self.last = counter;
        for (avg, period) in self.avg.iter_mut().zip(Self::PERIODS) {
            let decay = (-interval / period).exp();
            *avg = *avg * decay + per_minute * (1.0 - decay);
        }
    }
}

/// The `$SYS` publisher's state: load averages and the last value sent per topic (a value is
/// republished only when it changed, as mosquitto does).
pub(crate) struct SysPublisher {
    broker: Arc<BrokerState>,
    loads: [Load; 5],
    last_sent: HashMap<String, String>,
    last_tick: Instant,
}

impl SysPublisher {
    pub(crate) fn new(broker: Arc<BrokerState>) -> SysPublisher {
        SysPublisher {
            broker,
            loads: [Load::default(); 5],
            last_sent: HashMap::new(),
            last_tick: Instant::now(),
        }
    }

    /// Publishes every `sys_interval` seconds until the broker shuts down.
    pub(crate) async fn run(mut self) {
        let interval = Duration::from_secs(self.broker.config.server.sys_interval.max(1));
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.broker.is_shutting_down() {
                return;
            }
            self.publish_all();
        }
    }

    /// Computes every value and publishes those that changed. A topic of something gone (a
    /// stream deleted, a bridge removed) is cleared: its retained value deleted and an empty
    /// retained message sent to its subscribers, as a client deletes a retained message
    /// [MQTT-3.3.1-6], so that no one reads a stale value of it.
    pub(crate) fn publish_all(&mut self) {
        let values = self.values();
        let current: std::collections::HashSet<&str> =
            values.iter().map(|(topic, _)| topic.as_str()).collect();
        let gone: Vec<String> = self
            .last_sent
            .keys()
            .filter(|topic| !current.contains(topic.as_str()))
            .cloned()
            .collect();
        for topic in gone {
            self.last_sent.remove(&topic);
            self.broker
                .publish_sys(Message::broker_retained(topic, Bytes::new()));
        }
        for (topic, value) in values {
            if self.last_sent.get(&topic) == Some(&value) {
                continue;
            }
            self.last_sent.insert(topic.clone(), value.clone());
            self.broker
                .publish_sys(Message::broker_retained(topic, Bytes::from(value)));
        }
    }

    fn values(&mut self) -> Vec<(String, String)> {
        let b = &self.broker;
        let s = &b.stats;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let now = Instant::now();
        let interval = now.duration_since(self.last_tick).as_secs_f64().max(0.001);
        self.last_tick = now;
        let counters = [
            ("messages/received", get(&s.messages_received)),
            ("messages/sent", get(&s.messages_sent)),
            ("bytes/received", get(&s.bytes_received)),
            ("bytes/sent", get(&s.bytes_sent)),
            ("connections", get(&s.connections_total)),
        ];
        let (sessions, connected) = b.session_counts();
        let (retained, retained_bytes) = {
            let store = b.retained.lock();
            (store.len(), store.bytes())
        };
        let mut v: Vec<(String, String)> = vec![
            (
                "version".into(),
                format!("mercurio version {}", env!("CARGO_PKG_VERSION")),
            ),
            (
                "uptime".into(),
                format!("{} seconds", b.started.elapsed().as_secs()),
            ),
            ("clients/connected".into(), connected.to_string()),
            (
                "clients/disconnected".into(),
                (sessions - connected.min(sessions)).to_string(),
            ),
            ("clients/total".into(), sessions.to_string()),
            (
                "clients/maximum".into(),
                get(&s.clients_maximum).to_string(),
            ),
            (
                "clients/expired".into(),
                get(&s.sessions_expired).to_string(),
            ),
            ("clients/parked".into(), get(&s.clients_parked).to_string()),
            ("clients/moved".into(), get(&s.clients_moved).to_string()),
            (
                "clients/stalled".into(),
                get(&s.clients_stalled).to_string(),
            ),
            (
                "clients/rate_limited".into(),
                get(&s.clients_rate_limited).to_string(),
            ),
            (
                "clients/rate_limited_ms".into(),
                (get(&s.clients_rate_limited_us) / 1000).to_string(),
            ),
            (
                "connections/delayed".into(),
                get(&s.connections_delayed).to_string(),
            ),
            (
                "publish/messages/shared_passed_on".into(),
                get(&s.shared_passed_on).to_string(),
            ),
            (
                "queued messages/bytes".into(),
                b.queued_memory.bytes().to_string(),
            ),
            ("retained messages/count".into(), retained.to_string()),
            ("retained messages/bytes".into(), retained_bytes.to_string()),
            (
                "retained messages/not kept/max_retained_messages".into(),
                get(&s.retained_not_kept_count).to_string(),
            ),
            (
                "retained messages/not kept/max_retained_bytes".into(),
                get(&s.retained_not_kept_bytes).to_string(),
            ),
            (
                "subscriptions/count".into(),
                b.index.read().len().to_string(),
            ),
            (
                "publish/messages/dropped".into(),
                s.dropped_total().to_string(),
            ),
            (
                "storage/batches/retried".into(),
                get(&s.storage_batches_retried).to_string(),
            ),
            (
                "storage/batches/dropped".into(),
                get(&s.storage_batches_dropped).to_string(),
            ),
            (
                "storage/clients/dirty".into(),
                get(&s.storage_clients_dirty).to_string(),
            ),
            (
                "storage/sessions/set aside".into(),
                get(&s.storage_sessions_set_aside).to_string(),
            ),
            (
                "storage/pending/bytes".into(),
                get(&s.storage_pending_bytes).to_string(),
            ),
            (
                "storage/clients/waiting".into(),
                get(&s.storage_clients_waiting).to_string(),
            ),
            (
                "storage/writes/failed".into(),
                get(&s.storage_writes_failed).to_string(),
            ),
            (
                "storage/unwritable".into(),
                get(&s.storage_unwritable).to_string(),
            ),
        ];
        for (name, value) in &counters[..4] {
            v.push(((*name).into(), value.to_string()));
        }
        for cause in DropCause::ALL {
            v.push((
                format!("publish/messages/dropped/{}", cause.name()),
                s.dropped_count(cause).to_string(),
            ));
        }
        for ((name, value), load) in counters.iter().zip(self.loads.iter_mut()) {
            load.update(*value, interval);
            for (window, avg) in ["1min", "5min", "15min"].iter().zip(load.avg) {
                v.push((format!("load/{name}/{window}"), format!("{avg:.2}")));
            }
        }
        let bridges: Vec<_> = b.bridges.lock().iter().map(|x| x.info()).collect();
        for x in bridges {
            let c = &x.client_id;
            v.push((
                format!("connection/{c}/messages/forwarded/out"),
                x.forwarded_out.to_string(),
            ));
            v.push((
                format!("connection/{c}/messages/forwarded/in"),
                x.forwarded_in.to_string(),
            ));
            v.push((
                format!("connection/{c}/messages/queued"),
                x.queued.to_string(),
            ));
            v.push((
                format!("connection/{c}/messages/dropped"),
                x.dropped.to_string(),
            ));
            v.push((
                format!("connection/{c}/reconnects"),
                x.reconnects.to_string(),
            ));
            v.push((
                format!("connection/{c}/packets/too_large"),
                x.packets_too_large.to_string(),
            ));
        }
        if let Some(c) = b.cluster_info() {
            for (name, value) in [
                ("connected", u64::from(c.connected)),
                ("degraded", u64::from(c.degraded)),
                ("nodes", c.nodes),
                ("clients", c.clients),
                ("retained/out", c.retained_out),
                ("retained/in", c.retained_in),
                ("reconnects", c.reconnects),
                ("subscriptions", c.subscriptions),
                ("messages/out", c.messages_out),
                ("bytes/out", c.bytes_out),
                ("messages/in", c.messages_in),
                ("bytes/in", c.bytes_in),
                ("messages/duplicates", c.duplicates),
                ("messages/errors", c.errors),
                ("slow_consumer", c.slow_consumer),
                ("jetstream/out", c.jetstream_out),
                ("jetstream/in", c.jetstream_in),
                ("jetstream/retries", c.jetstream_retries),
                ("jetstream/timeouts", c.jetstream_timeouts),
                ("jetstream/settings_differ", c.jetstream_settings_differ),
                ("jetstream/pending_bytes", c.jetstream_pending_bytes),
                ("jetstream/pending_messages", c.jetstream_pending_messages),
            ] {
                v.push((format!("cluster/{name}"), value.to_string()));
            }
        }
        for stream in b.streams.all() {
            let x = stream.info();
            let n = &x.name;
            for (name, value) in [
                ("messages", x.messages),
                ("bytes", x.bytes),
                ("in_memory", x.in_memory),
                ("first_offset", x.first_offset),
                ("last_offset", x.last_offset),
                ("readers", x.readers),
                ("trimmed/messages", x.trimmed_messages),
                ("trimmed/bytes", x.trimmed_bytes),
            ] {
                v.push((format!("streams/{n}/{name}"), value.to_string()));
            }
        }
        for (topic, _) in v.iter_mut() {
            topic.insert_str(0, "$SYS/broker/");
        }
        v
    }
}
