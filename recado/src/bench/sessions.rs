//! The sessions scenario: a reconnect storm of persistent sessions, as after a broker
//! restart. Phase `create` opens N sessions (clean session 0 in 3.1.1, clean start 0 and a
//! session expiry of one hour in 5.0), each subscribing at the run's QoS to its own topic,
//! and closes them with DISCONNECT; phase `reconnect` connects the same N client
//! identifiers again with clean start 0, `--connect-concurrency` at a time, and times from
//! the first attempt until every CONNACK is in, counting those with session present 1
//! (MQTT 3.1.1 section 3.2.2.2, 5.0 section 3.2.2.1.1). Between the two phases the broker
//! can be restarted (benches/compare.sh does, to measure a persistent store's reload).
//! Phase `both` runs one after the other against the same broker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch, Semaphore};

use super::client::{Client, ConnectOptions, Target};
use super::hist::Histogram;
use super::report::SessionsReport;
use super::traffic::RunConfig;

/// Which part of the scenario to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Phase {
    /// Create the sessions, each with its subscription, then disconnect them.
    Create,
    /// Reconnect the sessions and time it.
    Reconnect,
    /// Create, then reconnect, against the same broker.
    Both,
}

/// The scenario's own settings (the rest is the run's [`RunConfig`]).
pub struct SessionsConfig {
    pub sessions: usize,
    pub phase: Phase,
    /// Client identifiers are `PREFIX-0` to `PREFIX-(N-1)`: the same in both phases, which
    /// may be two runs of recado.
    pub prefix: String,
    pub connect_concurrency: usize,
}

/// Longest the connections of one phase may take altogether.
const PHASE_LIMIT: Duration = Duration::from_secs(300);

/// What one connection reports to the phase: its CONNACK's session present and how long
/// it took, or an error.
type Outcome = Result<(bool, u64), String>;

/// Runs the phases asked and returns the report of the last one.
pub async fn run(cfg: &RunConfig, s: &SessionsConfig, errors: &mut Vec<String>) -> SessionsReport {
    let (nofile, note) = super::fleet::raise_nofile(s.sessions as u64 + 64);
    if let Some(n) = note {
        if s.phase != Phase::Create {
            errors.push(n);
        }
    }
    let mut report = SessionsReport::default();
    if matches!(s.phase, Phase::Create | Phase::Both) {
        report = phase(cfg, s, Phase::Create, errors).await;
        eprintln!(
            "sessions: {} created in {:.2} s, {} failed",
            report.connected, report.connect_s, report.failed
        );
    }
    if matches!(s.phase, Phase::Reconnect | Phase::Both) {
        report = phase(cfg, s, Phase::Reconnect, errors).await;
    }
    // The phase these figures are from: with `both`, the reconnect one.
    let last = if s.phase == Phase::Create {
        Phase::Create
    } else {
        Phase::Reconnect
    };
    report.phase = format!("{last:?}").to_lowercase();
    report.nofile_limit = nofile;
    report
}

/// One phase: N connections, `connect_concurrency` handshakes at a time. In `create` each
/// subscribes and disconnects; in `reconnect` each stays up until all are in, then
/// disconnects.
async fn phase(
    cfg: &RunConfig,
    s: &SessionsConfig,
    which: Phase,
    errors: &mut Vec<String>,
) -> SessionsReport {
    let sem = Arc::new(Semaphore::new(s.connect_concurrency.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let (up_tx, mut up_rx) = mpsc::unbounded_channel::<Outcome>();
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(s.sessions);
    for i in 0..s.sessions {
        let sem = Arc::clone(&sem);
        let target: Target = cfg.target.clone();
        let up = up_tx.clone();
        let mut stop = stop_rx.clone();
        let id = format!("{}-{i}", s.prefix);
        let topic = format!("bench/sessions/{}/{i}", s.prefix);
        let (version, keep_alive, qos) = (cfg.version, cfg.keep_alive, cfg.qos);
        tasks.push(tokio::spawn(async move {
            let Ok(permit) = sem.acquire_owned().await else {
                return;
            };
            let t0 = Instant::now();
            let opts = ConnectOptions {
                client_id: &id,
                clean_start: false,
                keep_alive,
                session_expiry: 3600,
            };
            let (mut c, ack) = match Client::connect(&target, version, &opts).await {
                Ok(x) => x,
                Err(e) => {
                    let _ = up.send(Err(format!("{id}: {e}")));
                    return;
                }
            };
            let took = t0.elapsed().as_nanos() as u64;
            if which == Phase::Create {
                // Not timed: the subscription the session keeps, then away.
                let r = match c.subscribe(std::slice::from_ref(&topic), qos).await {
                    Ok(()) => c.disconnect().await.map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                drop(permit);
                let _ = up.send(
                    r.map(|()| (ack.session_present, took))
                        .map_err(|e| format!("{id}: {e}")),
                );
                return;
            }
            drop(permit);
            let _ = up.send(Ok((ack.session_present, took)));
            // Reconnected: hold the connection until every other one is in.
            let _ = stop.changed().await;
            let _ = c.disconnect().await;
        }));
    }
    drop(up_tx);
    let mut connect = Histogram::default();
    let mut present = 0usize;
    let deadline = Instant::now() + PHASE_LIMIT;
    let (ok, failed) =
        super::tally_connects(&mut up_rx, s.sessions, deadline, errors, |(p, ns)| {
            present += usize::from(p);
            connect.record(ns);
        })
        .await;
    let connect_s = start.elapsed().as_secs_f64();
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    SessionsReport {
        sessions: s.sessions,
        phase: String::new(),
        connected: ok,
        session_present: present,
        failed,
        connect_s,
        connect_per_s: ok as f64 / connect_s,
        connect_p50_us: connect.quantile(0.5) / 1000,
        connect_p99_us: connect.quantile(0.99) / 1000,
        nofile_limit: 0,
    }
}
