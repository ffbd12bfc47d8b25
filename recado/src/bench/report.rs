//! The report: a few human-readable lines on standard error, then one JSON line on standard
//! output (the last line of a run).

use serde::Serialize;

use super::hist::Histogram;

/// End-to-end latency in microseconds.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Latency {
    pub count: u64,
    pub p50: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    pub mean: u64,
}

impl From<&Histogram> for Latency {
    fn from(h: &Histogram) -> Self {
        Latency {
            count: h.count(),
            p50: h.quantile(0.5) / 1000,
            p99: h.quantile(0.99) / 1000,
            p999: h.quantile(0.999) / 1000,
            max: h.max() / 1000,
            mean: h.mean() / 1000,
        }
    }
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct IdleReport {
    pub connections: usize,
    pub connected: usize,
    pub failed: usize,
    pub connect_s: f64,
    pub connect_per_s: f64,
    pub connect_p50_us: u64,
    pub connect_p99_us: u64,
    pub hold_s: f64,
}

/// The sessions scenario's figures, for its last phase.
#[derive(Debug, Default, Clone, Serialize)]
pub struct SessionsReport {
    /// Sessions asked (`-N`).
    pub sessions: usize,
    /// The phase these figures are from: `create` or `reconnect` (`--phase both`: the
    /// reconnect one).
    pub phase: String,
    /// Connections that got a successful CONNACK (create: and a SUBACK, then disconnected).
    pub connected: usize,
    /// CONNACKs with session present 1: all of them in a reconnect phase that found every
    /// session.
    pub session_present: usize,
    pub failed: usize,
    /// Seconds from the first attempt until the last CONNACK (create: the last DISCONNECT).
    pub connect_s: f64,
    pub connect_per_s: f64,
    pub connect_p50_us: u64,
    pub connect_p99_us: u64,
    /// The soft limit of open files during the run.
    pub nofile_limit: u64,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct PersistentReport {
    pub queued: u64,
    pub session_present: bool,
    pub drain_s: f64,
    pub drain_per_s: f64,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct SweepStep {
    pub rate: f64,
    pub sent_per_s: f64,
    pub delivered_per_s: f64,
    pub lost: u64,
    pub p99_us: u64,
    pub pass: bool,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct SweepReport {
    /// Highest offered publish rate that passed; 0 if none did.
    pub max_rate: f64,
    pub p99_limit_ms: f64,
    pub steps: Vec<SweepStep>,
}

/// The fleet scenario's own figures (the message counts and latency are the run's).
#[derive(Debug, Default, Clone, Serialize)]
pub struct FleetReport {
    pub devices: usize,
    /// Devices connected before the window.
    pub connected: usize,
    pub connect_failed: usize,
    /// Seconds the connections took to open (paced; not measured).
    pub connect_s: f64,
    /// Mean seconds between two messages of a device.
    pub interval_s: f64,
    /// Each interval within `interval_s * (1 +- jitter)`.
    pub jitter: f64,
    /// Backend subscribers (more than 1: sharing the filter).
    pub backends: usize,
    /// The backend's filter as subscribed.
    pub filter: String,
    /// Messages/s the fleet offers: devices / interval.
    pub offered_per_s: f64,
    /// Seconds of the measured window.
    pub window_s: f64,
    /// The soft limit of open files during the run.
    pub nofile_limit: u64,
    pub broker_pid: Option<u32>,
    /// The broker's CPU time over the window, in % of one core.
    pub broker_cpu_pct: Option<f64>,
    /// The broker's resident memory at the end of the window, KiB.
    pub broker_rss_kib: Option<u64>,
    /// The broker's peak resident memory (VmHWM), KiB.
    pub broker_peak_rss_kib: Option<u64>,
    /// What could not be measured, and why.
    pub notes: Vec<String>,
}

/// One run's result.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Report {
    pub scenario: String,
    pub label: String,
    pub mqtt: String,
    /// Connected over TLS.
    pub tls: bool,
    pub qos: u8,
    pub payload: usize,
    pub publishers: usize,
    pub subscribers: usize,
    /// Offered publish rate, messages/s; 0 = open loop.
    pub rate: f64,
    pub duration_s: f64,
    pub sent: u64,
    pub acked: u64,
    pub expected: u64,
    pub delivered: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub reordered: u64,
    pub delivered_ratio: f64,
    pub publish_s: f64,
    pub delivery_s: f64,
    pub sent_per_s: f64,
    pub delivered_per_s: f64,
    pub latency_us: Latency,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle: Option<IdleReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub persistent: Option<PersistentReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sessions: Option<SessionsReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweep: Option<SweepReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetReport>,
    pub errors: Vec<String>,
}

/// Prints the human-readable summary (standard error).
pub fn print_summary(r: &Report) {
    let l = &r.latency_us;
    if let Some(i) = &r.idle {
        eprintln!(
            "{} MQTT {}{}: {}/{} connections in {:.2} s ({:.0}/s), connect p50 {} us p99 {} us, held {:.0} s, {} failed",
            r.scenario, r.mqtt, if r.tls { " over TLS" } else { "" }, i.connected, i.connections, i.connect_s, i.connect_per_s,
            i.connect_p50_us, i.connect_p99_us, i.hold_s, i.failed
        );
    } else if let Some(s) = &r.sessions {
        eprintln!(
            "{} MQTT {}{} ({}): {}/{} sessions in {:.2} s ({:.0}/s), {} with session present, connect p50 {} us p99 {} us, {} failed",
            r.scenario, r.mqtt, if r.tls { " over TLS" } else { "" }, s.phase, s.connected, s.sessions, s.connect_s,
            s.connect_per_s, s.session_present, s.connect_p50_us, s.connect_p99_us, s.failed
        );
    } else {
        eprintln!(
            "{} MQTT {}{} QoS {} {} B, {} pub / {} sub, rate {}: sent {} ({:.0}/s), delivered {} ({:.0}/s), lost {}, duplicates {}, reordered {}",
            r.scenario, r.mqtt, if r.tls { " over TLS" } else { "" }, r.qos, r.payload, r.publishers, r.subscribers,
            if r.rate > 0.0 { format!("{:.0}/s", r.rate) } else { "open loop".into() },
            r.sent, r.sent_per_s, r.delivered, r.delivered_per_s, r.lost, r.duplicates, r.reordered
        );
        eprintln!(
            "latency us: p50 {} p99 {} p99.9 {} max {} mean {} ({} samples)",
            l.p50, l.p99, l.p999, l.max, l.mean, l.count
        );
    }
    if let Some(p) = &r.persistent {
        eprintln!(
            "persistent: {} queued, session present {}, drained in {:.3} s ({:.0}/s)",
            p.queued, p.session_present, p.drain_s, p.drain_per_s
        );
    }
    if let Some(f) = &r.fleet {
        let opt = |v: Option<f64>, unit: &str| {
            v.map_or("unknown".to_string(), |v| format!("{v:.1}{unit}"))
        };
        eprintln!(
            "fleet: {}/{} devices every {} s +-{:.0} %, {} backend ({}), offered {:.0}/s over {:.1} s; broker CPU {}, RSS {} (peak {})",
            f.connected, f.devices, f.interval_s, f.jitter * 100.0, f.backends, f.filter, f.offered_per_s, f.window_s,
            opt(f.broker_cpu_pct, " %"),
            opt(f.broker_rss_kib.map(|k| k as f64 / 1024.0), " MiB"),
            opt(f.broker_peak_rss_kib.map(|k| k as f64 / 1024.0), " MiB"),
        );
        for n in &f.notes {
            eprintln!("note: {n}");
        }
    }
    if let Some(s) = &r.sweep {
        eprintln!("sweep: highest passing rate {:.0} msg/s", s.max_rate);
    }
    for e in &r.errors {
        eprintln!("error: {e}");
    }
}
