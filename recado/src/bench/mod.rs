//! `recado bench`: a load generator for MQTT brokers. It only speaks MQTT (3.1.1, or 5.0 with
//! `--mqtt 5`), over loopback, so it measures Mercurio, mosquitto or rumqttd alike.
//!
//! Scenarios: `fan-in` (P publishers, one wildcard subscriber), `fan-out` (one publisher, K
//! subscribers), `pairs` (P publisher/subscriber pairs), `idle` (C connections held with keep
//! alive; connect rate), `persistent` (QoS 1 into an offline persistent session, then
//! drained), `fleet` (N devices each publishing every few seconds, one backend subscriber or
//! K sharing a subscription; broker CPU % and RSS), `sessions` (N persistent sessions
//! created, then reconnected: the reconnect storm after a broker restart). Every run is bounded by `--duration` and `--max-messages`. The report ends with
//! one JSON line. `--sweep` searches the highest offered rate that passes (no loss, the rate
//! sustained, p99 under 10 ms). `--tls --cafile CA.pem` connects over TLS (every scenario).
//! `--source-net 127.0.R.0/24` makes every connection come from its own loopback addresses,
//! untouched by the runs before (see [`source`]).

mod client;
mod fleet;
mod hist;
mod procstat;
mod report;
mod sessions;
mod source;
mod tracker;
mod traffic;

use std::io::IsTerminal;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use mercurio_core::codec::{ProtocolVersion, QoS};
use tokio::sync::{watch, Semaphore};

use self::client::{Client, ConnectOptions, Target};
use self::hist::Histogram;
use self::report::{IdleReport, Latency, PersistentReport, Report, SweepReport, SweepStep};
use self::traffic::{RunConfig, Shared, SubResult};
use crate::exit::{Exit, Failure};
use crate::tls::{Tls, TlsOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// P publishers on their own topics, 1 subscriber to a `+` wildcard over all of them.
    FanIn,
    /// 1 publisher, K subscribers to its topic.
    FanOut,
    /// P independent publisher/subscriber pairs, one topic each.
    Pairs,
    /// C connections held open with keep alive; measures the connect rate.
    Idle,
    /// Messages published into an offline persistent session, then drained on reconnect.
    Persistent,
    /// N devices each publishing every T seconds (jittered), 1 backend subscriber or K
    /// sharing `$share/backend/FILTER`.
    Fleet,
    /// N persistent sessions with a subscription each (`--phase create`), then the same N
    /// reconnecting with clean start 0 (`--phase reconnect`), as after a broker restart;
    /// measures the reconnect rate and counts session present.
    Sessions,
}

/// The options of `recado bench` (see docs/BENCHMARKS.md).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Scenario to run.
    #[arg(long, short, value_enum, default_value = "fan-in")]
    scenario: Scenario,
    /// Broker host (must resolve to a loopback address).
    #[arg(long, short = 'h', default_value = "127.0.0.1")]
    host: String,
    /// Broker port.
    #[arg(long, short, default_value_t = 1883)]
    port: u16,
    /// Subscribers connect to this port instead (same host, no TLS): measures a path between
    /// two brokers, e.g. over a bridge (fan-in, fan-out, pairs).
    #[arg(long)]
    sub_port: Option<u16>,
    /// MQTT version: 3 (3.1.1) or 5.
    #[arg(long, default_value_t = 3)]
    mqtt: u8,
    /// Publishers (fan-in, pairs).
    #[arg(long, short = 'P', default_value_t = 4)]
    publishers: usize,
    /// Subscribers (fan-out).
    #[arg(long, short = 'K', default_value_t = 10)]
    subscribers: usize,
    /// QoS of publications and subscriptions: 0, 1 or 2 (fleet: 0 or 1) [default: 0; fleet: 1].
    #[arg(long, short)]
    qos: Option<u8>,
    /// Payload bytes (at least 20: the time stamp, publisher and sequence number).
    #[arg(long, default_value_t = 64)]
    payload: usize,
    /// Seconds of publishing (idle: seconds to hold the connections once all are up; fleet:
    /// the measured window, after the connections are up).
    #[arg(long, short, default_value_t = 10.0)]
    duration: f64,
    /// Most messages per publisher (persistent: messages queued for the offline session).
    #[arg(long, default_value_t = 50_000_000)]
    max_messages: u64,
    /// Total offered publish rate in messages/s over all publishers; 0 = open loop
    /// (saturation: publish as fast as the broker reads).
    #[arg(long, short, default_value_t = 0.0)]
    rate: f64,
    /// QoS 1/2 messages a publisher keeps unacknowledged at most.
    #[arg(long, default_value_t = 100)]
    inflight: u16,
    /// Seconds to wait for the last deliveries once publishing stops.
    #[arg(long, default_value_t = 5.0)]
    drain: f64,
    /// Seconds without any delivery after which the wait for the last ones stops.
    #[arg(long, default_value_t = 1.0)]
    quiet: f64,
    /// Connections (idle).
    #[arg(long, short = 'C', default_value_t = 1000)]
    connections: usize,
    /// Connection attempts in progress at once (idle, fleet, sessions).
    #[arg(long, default_value_t = 64)]
    connect_concurrency: usize,
    /// Keep alive in seconds of every connection.
    #[arg(long, default_value_t = 60)]
    keep_alive: u16,
    /// Phase of the sessions scenario: create, reconnect, or both against one broker.
    #[arg(long, value_enum, default_value = "both")]
    phase: sessions::Phase,
    /// Client identifier prefix of the sessions scenario (PREFIX-0 .. PREFIX-(N-1)); the
    /// same in the create and reconnect runs.
    #[arg(long, default_value = "recado-bench-session")]
    session_prefix: String,
    /// Devices (fleet) or sessions (sessions): one connection each.
    #[arg(long, short = 'N', default_value_t = 10_000)]
    devices: usize,
    /// Mean seconds between two messages of a device (fleet).
    #[arg(long, short = 'T', default_value_t = 2.0)]
    interval: f64,
    /// Each interval is drawn within interval * (1 +- jitter); each device starts at a random
    /// phase (fleet).
    #[arg(long, default_value_t = 0.1)]
    jitter: f64,
    /// Backend subscribers (fleet): 1 subscribes to --filter, K > 1 share
    /// `$share/backend/FILTER`.
    #[arg(long, default_value_t = 1)]
    backends: usize,
    /// The backend's topic filter (fleet); devices publish on fleet/RUN/DEVICE.
    #[arg(long, default_value = "#")]
    filter: String,
    /// Connections opened per second before the measured window (fleet).
    #[arg(long, default_value_t = 1000.0)]
    connect_rate: f64,
    /// The broker's process id, for its CPU % over the window and its RSS (fleet); by
    /// default the process listening on --port, when this user can see it.
    #[arg(long)]
    broker_pid: Option<u32>,
    /// Search the highest passing rate instead of one run (not for idle / persistent).
    #[arg(long)]
    sweep: bool,
    /// First rate of the sweep, messages/s.
    #[arg(long, default_value_t = 5000.0)]
    sweep_start: f64,
    /// Highest rate the sweep tries, messages/s.
    #[arg(long, default_value_t = 4_000_000.0)]
    sweep_max: f64,
    /// Seconds of each sweep step.
    #[arg(long, default_value_t = 3.0)]
    sweep_step: f64,
    /// The sweep stops when the highest pass and lowest failure are this close (fraction).
    #[arg(long, default_value_t = 0.1)]
    sweep_precision: f64,
    /// p99 latency limit of a passing sweep step, milliseconds.
    #[arg(long, default_value_t = 10.0)]
    sweep_p99_ms: f64,
    /// Runtime threads (1 = a single-threaded runtime, best when pinned to one core).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// A label for the report (e.g. the broker's name).
    #[arg(long, default_value = "")]
    label: String,
    /// Connect from the addresses of this loopback network, in turn (e.g. 127.0.5.0/24: 254
    /// addresses), each connection binding one and letting the kernel pick the port. A run
    /// from its own network reuses no local port of a run before still in TIME_WAIT.
    /// Default: the system's choice (127.0.0.1).
    #[arg(long, value_name = "A.B.C.D/LEN")]
    source_net: Option<String>,
    /// Connect over TLS (1.3 or 1.2, rustls with ring); needs --cafile.
    #[arg(long, requires = "cafile")]
    tls: bool,
    /// PEM CA certificate(s) the broker's certificate is verified against (with --tls).
    #[arg(long, value_name = "PATH", requires = "tls")]
    cafile: Option<PathBuf>,
    /// Name the broker's certificate must be valid for (SNI too, unless an IP address).
    #[arg(
        long,
        value_name = "NAME",
        default_value = "localhost",
        requires = "tls"
    )]
    tls_server_name: String,
    /// PEM client certificate chain to present (with --key).
    #[arg(long, value_name = "PATH", requires_all = ["tls", "key"])]
    cert: Option<PathBuf>,
    /// PEM private key of --cert.
    #[arg(long, value_name = "PATH", requires_all = ["tls", "cert"])]
    key: Option<PathBuf>,
    /// Let TLS connections resume earlier sessions (tickets); by default every connection
    /// makes a full handshake.
    #[arg(long, requires = "tls")]
    tls_resume: bool,
}

/// Runs `recado bench`: the report on standard output (ending with one JSON line), progress
/// on standard error. Errors: bad options ([`Exit::Usage`]), a run where nothing could be
/// delivered ([`Exit::Error`]).
pub fn main(args: Args) -> Result<(), Failure> {
    let target = check(&args)
        .and_then(|()| target(&args))
        .map_err(|e| Failure::new(Exit::Usage, e))?;
    let rt = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads)
            .enable_all()
            .build()
    }
    .map_err(|e| Failure::new(Exit::Error, format!("cannot start the runtime: {e}")))?;
    let report = rt.block_on(run(args, target));
    let failed = !report.errors.is_empty()
        && report.delivered == 0
        && report.idle.is_none()
        && report.sessions.is_none();
    match serde_json::to_string(&report) {
        Ok(line) => println!("{line}"),
        Err(e) => return Err(Failure::new(Exit::Error, format!("report: {e}"))),
    }
    if failed {
        return Err(Failure::new(
            Exit::Error,
            format!("nothing was delivered: {}", report.errors.join("; ")),
        ));
    }
    Ok(())
}

fn check(a: &Args) -> Result<(), String> {
    let addr = resolve(a)?;
    if !addr.ip().is_loopback() {
        return Err(format!(
            "{addr} is not a loopback address: recado bench runs on loopback only"
        ));
    }
    if a.source_net.is_some() && !addr.is_ipv4() {
        return Err("--source-net needs an IPv4 broker address".into());
    }
    if a.scenario == Scenario::Sessions && (a.devices == 0 || a.session_prefix.is_empty()) {
        return Err("--devices must be at least 1 and --session-prefix not empty".into());
    }
    if a.scenario == Scenario::Fleet {
        if qos(a) > 1 {
            return Err("--qos must be 0 or 1 in the fleet scenario".into());
        }
        if a.devices == 0 || a.backends == 0 {
            return Err("--devices and --backends must be at least 1".into());
        }
        if !(a.interval > 0.0 && a.interval <= 3600.0) {
            return Err("--interval must be between 0 and 3600 seconds".into());
        }
        if !(0.0..1.0).contains(&a.jitter) {
            return Err("--jitter must be at least 0 and below 1".into());
        }
        if a.connect_rate.is_nan() || a.connect_rate <= 0.0 {
            return Err("--connect-rate must be above 0".into());
        }
        if a.filter.is_empty() {
            return Err("--filter must not be empty".into());
        }
    }
    if qos(a) > 2 {
        return Err("--qos must be 0, 1 or 2".into());
    }
    if a.mqtt != 3 && a.mqtt != 5 {
        return Err("--mqtt must be 3 (3.1.1) or 5".into());
    }
    if a.payload < traffic::STAMP {
        return Err(format!(
            "--payload must be at least {} bytes",
            traffic::STAMP
        ));
    }
    if !(a.duration > 0.0 && a.duration <= 3600.0) {
        return Err("--duration must be between 0 and 3600 seconds".into());
    }
    if a.publishers == 0 || a.subscribers == 0 || a.connections == 0 || a.inflight == 0 {
        return Err(
            "--publishers, --subscribers, --connections and --inflight must be at least 1".into(),
        );
    }
    if a.sweep
        && matches!(
            a.scenario,
            Scenario::Idle | Scenario::Persistent | Scenario::Fleet | Scenario::Sessions
        )
    {
        return Err("--sweep applies to fan-in, fan-out and pairs".into());
    }
    Ok(())
}

/// The QoS asked, or the scenario's default: 1 for fleet, else 0.
fn qos(a: &Args) -> u8 {
    a.qos
        .unwrap_or(if a.scenario == Scenario::Fleet { 1 } else { 0 })
}

fn resolve(a: &Args) -> Result<SocketAddr, String> {
    (a.host.as_str(), a.port)
        .to_socket_addrs()
        .map_err(|e| format!("{}: {e}", a.host))?
        .next()
        .ok_or_else(|| format!("{}: no address", a.host))
}

/// The broker's address and, with `--tls`, the TLS client configuration.
fn target(a: &Args) -> Result<Target, String> {
    let tls = match (&a.tls, &a.cafile) {
        (true, Some(cafile)) => Some(Arc::new(Tls::new(&TlsOptions {
            cafile: Some(cafile),
            capath: None,
            os_roots: false,
            version: None,
            server_name: &a.tls_server_name,
            cert: a.cert.as_deref(),
            key: a.key.as_deref(),
            insecure: false,
            resume: a.tls_resume,
        })?)),
        (true, None) => return Err("--tls needs --cafile".into()),
        _ => None,
    };
    let source = match &a.source_net {
        Some(net) => Some(Arc::new(source::SourceAddrs::parse(net)?)),
        None => None,
    };
    Ok(Target {
        addr: resolve(a)?,
        tls,
        source,
    })
}

fn run_config(a: &Args, target: &Target, rate: f64, duration: f64, token: String) -> RunConfig {
    RunConfig {
        target: target.clone(),
        version: if a.mqtt == 5 {
            ProtocolVersion::V5
        } else {
            ProtocolVersion::V311
        },
        qos: QoS::from_u8(qos(a)).expect("checked"),
        payload: a.payload,
        duration: Duration::from_secs_f64(duration),
        max_messages: a.max_messages,
        rate,
        inflight: a.inflight,
        drain: Duration::from_secs_f64(a.drain),
        quiet: Duration::from_secs_f64(a.quiet),
        keep_alive: a.keep_alive,
        token,
    }
}

fn base_report(a: &Args) -> Report {
    Report {
        scenario: format!("{:?}", a.scenario)
            .replace("FanIn", "fan-in")
            .replace("FanOut", "fan-out")
            .to_lowercase(),
        label: a.label.clone(),
        mqtt: if a.mqtt == 5 { "5.0" } else { "3.1.1" }.into(),
        tls: a.tls,
        qos: qos(a),
        payload: a.payload,
        ..Report::default()
    }
}

async fn run(a: Args, target: Target) -> Report {
    let mut report = base_report(&a);
    let token = format!("mb{}", std::process::id());
    match a.scenario {
        Scenario::Idle => {
            report.idle = Some(idle(&a, &target, &token, &mut report.errors).await);
        }
        Scenario::Persistent => {
            let cfg = run_config(&a, &target, a.rate, a.duration, token);
            persistent(&cfg, &mut report).await;
        }
        Scenario::Sessions => {
            let cfg = run_config(&a, &target, a.rate, a.duration, token);
            let s = sessions::SessionsConfig {
                sessions: a.devices,
                phase: a.phase,
                prefix: a.session_prefix.clone(),
                connect_concurrency: a.connect_concurrency,
            };
            report.sessions = Some(sessions::run(&cfg, &s, &mut report.errors).await);
        }
        Scenario::Fleet => {
            let cfg = run_config(&a, &target, a.rate, a.duration, token);
            let f = fleet::FleetConfig {
                devices: a.devices,
                interval: a.interval,
                jitter: a.jitter,
                backends: a.backends,
                filter: a.filter.clone(),
                connect_rate: a.connect_rate,
                connect_concurrency: a.connect_concurrency,
                broker_pid: a.broker_pid,
            };
            fleet::run(&cfg, &f, &mut report).await;
        }
        _ if a.sweep => {
            let mut steps = Vec::new();
            let mut best: Option<Report> = None;
            let (mut pass, mut fail) = (0.0f64, f64::INFINITY);
            let mut rate = a.sweep_start;
            for step in 0..40 {
                if rate > a.sweep_max || (fail - pass) / fail.min(a.sweep_max) < a.sweep_precision {
                    break;
                }
                let cfg = run_config(&a, &target, rate, a.sweep_step, format!("{token}s{step}"));
                let mut r = base_report(&a);
                traffic_run(&a, &cfg, &mut r).await;
                let sustained = r.sent_per_s >= 0.99 * rate;
                let ok = r.lost == 0
                    && r.duplicates == 0
                    && sustained
                    && r.errors.is_empty()
                    && (r.latency_us.p99 as f64) < a.sweep_p99_ms * 1000.0;
                eprintln!(
                    "sweep {:>10.0} msg/s offered: sent {:>10.0}/s delivered {:>10.0}/s lost {} p99 {} us -> {}",
                    rate,
                    r.sent_per_s,
                    r.delivered_per_s,
                    r.lost,
                    r.latency_us.p99,
                    if ok { "pass" } else { "FAIL" }
                );
                steps.push(SweepStep {
                    rate,
                    sent_per_s: r.sent_per_s,
                    delivered_per_s: r.delivered_per_s,
                    lost: r.lost,
                    p99_us: r.latency_us.p99,
                    pass: ok,
                });
                if ok {
                    pass = rate;
                    best = Some(r);
                } else {
                    fail = fail.min(rate);
                }
                rate = if fail.is_infinite() {
                    rate * 2.0
                } else {
                    (pass + fail) / 2.0
                };
                if pass == 0.0 && !fail.is_infinite() {
                    // Even the first rate failed: halve.
                    rate = fail / 2.0;
                    if rate < a.sweep_start / 8.0 {
                        break;
                    }
                }
            }
            if let Some(b) = best {
                report = b;
            }
            report.rate = pass;
            report.sweep = Some(SweepReport {
                max_rate: pass,
                p99_limit_ms: a.sweep_p99_ms,
                steps,
            });
        }
        _ => {
            let cfg = run_config(&a, &target, a.rate, a.duration, token);
            traffic_run(&a, &cfg, &mut report).await;
        }
    }
    report::print_summary(&report);
    report
}

/// Runs fan-in, fan-out or pairs once.
async fn traffic_run(a: &Args, cfg: &RunConfig, report: &mut Report) {
    let t = &cfg.token;
    // (publisher topics, subscribers: (filters, publishers they hear))
    type Subscribers = Vec<(Vec<String>, Vec<u32>)>;
    let (topics, subs): (Vec<String>, Subscribers) = match a.scenario {
        Scenario::FanIn => (
            (0..a.publishers)
                .map(|i| format!("bench/{t}/in/{i}"))
                .collect(),
            vec![(
                vec![format!("bench/{t}/in/+")],
                (0..a.publishers as u32).collect(),
            )],
        ),
        Scenario::FanOut => (
            vec![format!("bench/{t}/out")],
            (0..a.subscribers)
                .map(|_| (vec![format!("bench/{t}/out")], vec![0]))
                .collect(),
        ),
        Scenario::Pairs => (
            (0..a.publishers)
                .map(|i| format!("bench/{t}/pair/{i}"))
                .collect(),
            (0..a.publishers)
                .map(|i| (vec![format!("bench/{t}/pair/{i}")], vec![i as u32]))
                .collect(),
        ),
        _ => unreachable!(),
    };
    report.publishers = topics.len();
    report.subscribers = subs.len();
    report.rate = cfg.rate;
    report.duration_s = cfg.duration.as_secs_f64();

    let shared = Shared::new();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut sub_tasks = Vec::new();
    let mut sub_cfg = cfg.clone();
    if let Some(port) = a.sub_port {
        sub_cfg.target.addr.set_port(port);
        sub_cfg.target.tls = None;
    }
    for (i, (filters, _)) in subs.iter().enumerate() {
        match traffic::connect_subscriber(&sub_cfg, &format!("{t}-sub-{i}"), filters, true).await {
            Ok((c, _)) => sub_tasks.push(tokio::spawn(traffic::subscribe_loop(
                c,
                Arc::clone(&shared),
                stop_rx.clone(),
                SubResult::default(),
            ))),
            Err(e) => {
                report.errors.push(format!("subscriber {i}: {e}"));
                return;
            }
        }
    }
    let mut pubs = Vec::new();
    for i in 0..topics.len() {
        match traffic::connect_publisher(cfg, &format!("{t}-pub-{i}")).await {
            Ok(c) => pubs.push(c),
            Err(e) => {
                report.errors.push(format!("publisher {i}: {e}"));
                return;
            }
        }
    }
    let per_rate = cfg.rate / topics.len() as f64;
    let start = Instant::now();
    let pub_tasks: Vec<_> = pubs
        .into_iter()
        .zip(topics)
        .enumerate()
        .map(|(i, (c, topic))| {
            tokio::spawn(traffic::publish(
                cfg.clone(),
                c,
                i as u32,
                topic,
                per_rate,
                start,
                Arc::clone(&shared),
            ))
        })
        .collect();
    let progress = tokio::spawn(progress(
        Arc::clone(&shared),
        cfg.duration,
        report.scenario.clone(),
    ));
    let mut pub_results = Vec::new();
    for task in pub_tasks {
        pub_results.push(task.await.unwrap_or_default());
    }
    progress.abort();
    let _ = progress.await;
    if std::io::stderr().is_terminal() && cfg.duration >= PROGRESS_FROM {
        eprint!("\r\x1b[K");
    }
    let publish_end = Instant::now();
    let sent_by: Vec<u64> = pub_results.iter().map(|p| p.sent).collect();
    let expected: u64 = subs
        .iter()
        .map(|(_, hears)| hears.iter().map(|&p| sent_by[p as usize]).sum::<u64>())
        .sum();
    traffic::wait_deliveries(&shared, expected, cfg.drain, cfg.quiet).await;
    let _ = stop_tx.send(true);
    let mut latency = Histogram::default();
    let (mut unique, mut dups, mut reordered) = (0, 0, 0);
    for task in sub_tasks {
        let r = task.await.unwrap_or_default();
        latency.merge(&r.latency);
        unique += r.tracker.unique;
        dups += r.tracker.duplicates;
        reordered += r.tracker.reordered;
        if let Some(e) = r.error {
            report.errors.push(e);
        }
    }
    for (i, p) in pub_results.iter().enumerate() {
        if let Some(e) = &p.error {
            report.errors.push(format!("publisher {i}: {e}"));
        }
    }
    let publish_secs = (publish_end - start).as_secs_f64();
    let last = shared.last_delivery_ns.load(Ordering::Relaxed);
    let first = start.duration_since(shared.epoch).as_nanos() as u64;
    let delivery_secs = (last.saturating_sub(first) as f64 / 1e9).max(publish_secs.min(1e-3));
    report.sent = sent_by.iter().sum();
    report.acked = pub_results.iter().map(|p| p.completed).sum();
    report.expected = expected;
    report.delivered = unique;
    report.lost = expected.saturating_sub(unique);
    report.duplicates = dups;
    report.reordered = reordered;
    report.delivered_ratio = if expected > 0 {
        unique as f64 / expected as f64
    } else {
        0.0
    };
    report.publish_s = publish_secs;
    report.delivery_s = delivery_secs;
    report.sent_per_s = report.sent as f64 / publish_secs;
    report.delivered_per_s = if last > 0 {
        unique as f64 / delivery_secs
    } else {
        0.0
    };
    report.latency_us = Latency::from(&latency);
}

/// Runs from this long on get a progress line on standard error.
const PROGRESS_FROM: Duration = Duration::from_secs(5);

/// The progress line of a long run, on standard error: elapsed time and deliveries so far,
/// rewritten in place every second on a terminal, else a line every 5 seconds.
async fn progress(shared: Arc<Shared>, duration: Duration, scenario: String) {
    if duration < PROGRESS_FROM {
        return;
    }
    let terminal = std::io::stderr().is_terminal();
    let every = Duration::from_secs(if terminal { 1 } else { 5 });
    let start = Instant::now();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tick.tick().await;
        let line = format!(
            "bench {scenario}: {:.0}/{:.0} s, {} delivered",
            start.elapsed().as_secs_f64(),
            duration.as_secs_f64(),
            shared.delivered.load(Ordering::Relaxed)
        );
        if terminal {
            eprint!("\r\x1b[K{line}");
        } else {
            eprintln!("{line}");
        }
    }
}

/// The persistent scenario: subscribe with a persistent session, go offline, have one
/// publisher send `--max-messages` (capped at 100,000 unless given) at the QoS asked, then
/// reconnect and drain.
async fn persistent(cfg: &RunConfig, report: &mut Report) {
    let t = &cfg.token;
    let id = format!("{t}-persist");
    let topic = format!("bench/{t}/persist");
    let count = cfg.max_messages.min(1_000_000);
    report.publishers = 1;
    report.subscribers = 1;
    report.rate = cfg.rate;
    // A clean slate, then the persistent subscription, then offline.
    let setup = async {
        let (c, _) = traffic::connect_subscriber(cfg, &id, &[], true).await?;
        c.disconnect().await?;
        let (c, _) =
            traffic::connect_subscriber(cfg, &id, std::slice::from_ref(&topic), false).await?;
        c.disconnect().await?;
        // Give the broker a moment to register the disconnect (a takeover would be wrong).
        tokio::time::sleep(Duration::from_millis(200)).await;
        traffic::connect_publisher(cfg, &format!("{t}-ppub")).await
    };
    let publisher = match setup.await {
        Ok(c) => c,
        Err(e) => {
            report.errors.push(format!("setup: {e}"));
            return;
        }
    };
    let shared = Shared::new();
    let mut pcfg = cfg.clone();
    pcfg.max_messages = count;
    pcfg.duration = cfg.duration.max(Duration::from_secs(60));
    let start = Instant::now();
    let p = traffic::publish(
        pcfg,
        publisher,
        0,
        topic.clone(),
        cfg.rate,
        start,
        Arc::clone(&shared),
    )
    .await;
    report.publish_s = start.elapsed().as_secs_f64();
    report.sent = p.sent;
    report.acked = p.completed;
    report.sent_per_s = p.sent as f64 / report.publish_s;
    if let Some(e) = p.error {
        report.errors.push(format!("publisher: {e}"));
    }
    // Messages at QoS 0 are not queued for offline sessions by default; count every one
    // the broker accepted as expected.
    let expected = p.completed;
    let reconnect = Instant::now();
    let (c, present) = match traffic::connect_subscriber(cfg, &id, &[], false).await {
        Ok(x) => x,
        Err(e) => {
            report.errors.push(format!("reconnect: {e}"));
            return;
        }
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let task = tokio::spawn(traffic::subscribe_loop(
        c,
        Arc::clone(&shared),
        stop_rx,
        SubResult::default(),
    ));
    traffic::wait_deliveries(
        &shared,
        expected,
        cfg.drain.max(Duration::from_secs(10)),
        cfg.quiet,
    )
    .await;
    let _ = stop_tx.send(true);
    let r = task.await.unwrap_or_default();
    let last = shared.last_delivery_ns.load(Ordering::Relaxed);
    let drain_s = (last.saturating_sub(reconnect.duration_since(shared.epoch).as_nanos() as u64))
        as f64
        / 1e9;
    if let Some(e) = r.error {
        report.errors.push(e);
    }
    report.expected = expected;
    report.delivered = r.tracker.unique;
    report.lost = expected.saturating_sub(r.tracker.unique);
    report.duplicates = r.tracker.duplicates;
    report.reordered = r.tracker.reordered;
    report.delivered_ratio = if expected > 0 {
        r.tracker.unique as f64 / expected as f64
    } else {
        0.0
    };
    report.delivery_s = drain_s;
    report.delivered_per_s = if drain_s > 0.0 {
        r.tracker.unique as f64 / drain_s
    } else {
        0.0
    };
    report.latency_us = Latency::from(&r.latency);
    report.persistent = Some(PersistentReport {
        queued: expected,
        session_present: present,
        drain_s,
        drain_per_s: report.delivered_per_s,
    });
    // Leave no session behind.
    if let Ok((c, _)) = traffic::connect_subscriber(cfg, &id, &[], true).await {
        let _ = c.disconnect().await;
    }
}

/// The idle scenario: opens `--connections` connections (`--connect-concurrency` at a time),
/// holds them for `--duration` seconds with PINGREQ every keep alive, then closes them.
async fn idle(a: &Args, target: &Target, token: &str, errors: &mut Vec<String>) -> IdleReport {
    let version = if a.mqtt == 5 {
        ProtocolVersion::V5
    } else {
        ProtocolVersion::V311
    };
    let sem = Arc::new(Semaphore::new(a.connect_concurrency.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let (up_tx, mut up_rx) = tokio::sync::mpsc::unbounded_channel::<Result<u64, String>>();
    let start = Instant::now();
    let keep_alive = a.keep_alive;
    let mut tasks = Vec::new();
    for i in 0..a.connections {
        let sem = Arc::clone(&sem);
        let target = target.clone();
        let up = up_tx.clone();
        let mut stop = stop_rx.clone();
        let id = format!("{token}-idle-{i}");
        tasks.push(tokio::spawn(async move {
            let permit = sem.acquire_owned().await.expect("semaphore");
            let t0 = Instant::now();
            let opts = ConnectOptions {
                client_id: &id,
                clean_start: true,
                keep_alive,
                session_expiry: 0,
            };
            let mut c: Client = match Client::connect(&target, version, &opts).await {
                Ok((c, _)) => c,
                Err(e) => {
                    let _ = up.send(Err(e.to_string()));
                    return;
                }
            };
            drop(permit);
            let _ = up.send(Ok(t0.elapsed().as_nanos() as u64));
            let ping = Duration::from_secs(u64::from(keep_alive.max(2)) * 3 / 4);
            loop {
                tokio::select! {
                    _ = stop.changed() => break,
                    _ = tokio::time::sleep(ping) => {
                        if c.send(&mercurio_core::codec::Packet::PingReq).await.is_err() {
                            break;
                        }
                    }
                    r = c.recv() => match r {
                        Ok(Some(_)) => {}
                        _ => break,
                    },
                }
            }
            let _ = c.disconnect().await;
        }));
    }
    drop(up_tx);
    let mut connect = Histogram::default();
    let deadline = Instant::now() + Duration::from_secs(120);
    let (ok, failed) = tally_connects(&mut up_rx, a.connections, deadline, errors, |ns| {
        connect.record(ns)
    })
    .await;
    let connect_s = start.elapsed().as_secs_f64();
    eprintln!("idle: {ok} connections up in {connect_s:.2} s, {failed} failed; holding");
    tokio::time::sleep(Duration::from_secs_f64(a.duration)).await;
    // Count the connections still up before closing them.
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    IdleReport {
        connections: a.connections,
        connected: ok,
        failed,
        connect_s,
        connect_per_s: ok as f64 / connect_s,
        connect_p50_us: connect.quantile(0.5) / 1000,
        connect_p99_us: connect.quantile(0.99) / 1000,
        hold_s: a.duration,
    }
}

/// Reads up to `n` connection outcomes from `up` until `deadline` (or until every sender is
/// gone): each success is given to `each`, each failure counted, the first 5 failures' words
/// kept in `errors`. Returns the successes and the failures counted.
pub(crate) async fn tally_connects<T>(
    up: &mut tokio::sync::mpsc::UnboundedReceiver<Result<T, String>>,
    n: usize,
    deadline: Instant,
    errors: &mut Vec<String>,
    mut each: impl FnMut(T),
) -> (usize, usize) {
    let (mut ok, mut failed) = (0usize, 0usize);
    while ok + failed < n {
        match tokio::time::timeout_at(deadline.into(), up.recv()).await {
            Ok(Some(Ok(t))) => {
                ok += 1;
                each(t);
            }
            Ok(Some(Err(e))) => {
                failed += 1;
                if errors.len() < 5 {
                    errors.push(e);
                }
            }
            _ => break,
        }
    }
    (ok, failed)
}
