//! The fleet scenario: many devices, each connected and publishing now and then, as a real
//! fleet is (15,000 devices every few seconds is a few thousand messages a second, far from
//! saturation). N devices each publish one message every T seconds on `fleet/TOKEN/DEVICE`,
//! with a random phase and every interval drawn within T +- jitter; one backend subscriber on
//! a filter (default `#`), or K backend subscribers sharing it as `$share/backend/FILTER`.
//!
//! The connections are opened first, at a paced rate (not measured); then the measured window
//! runs for `--duration` seconds. The report: messages/s offered and delivered, end-to-end
//! latency (the send time is in the payload), messages acknowledged but never delivered
//! (must be 0), and the broker's CPU % over the window and its RSS when its process is known.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use mercurio_core::codec::{self, Packet, PublishRef, QoS};
use tokio::sync::{mpsc, watch, Semaphore};

use super::client::Client;
use super::hist::Histogram;
use super::procstat;
use super::report::{FleetReport, Latency, Report};
use super::tracker::Tracker;
use super::traffic::{self, RunConfig, Shared, SubResult, STAMP};

/// The fleet's own settings (the rest is the run's [`RunConfig`]).
pub struct FleetConfig {
    /// Devices, one connection each.
    pub devices: usize,
    /// Mean seconds between two messages of a device.
    pub interval: f64,
    /// Each interval is drawn uniformly within `interval * (1 +- jitter)`.
    pub jitter: f64,
    /// Backend subscribers: 1 = a plain subscription to `filter`, more = that many sharing
    /// `$share/backend/FILTER`.
    pub backends: usize,
    /// The backend's filter; `#` by default.
    pub filter: String,
    /// Connections opened per second before the window.
    pub connect_rate: f64,
    /// Connection attempts in progress at once.
    pub connect_concurrency: usize,
    /// The broker's process, for CPU % and RSS; found from the port when `None`.
    pub broker_pid: Option<u32>,
}

/// A small, fast, seedable generator (SplitMix64): the phases and intervals only need to be
/// spread, not unpredictable.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What one device did in the window.
#[derive(Default)]
struct DeviceResult {
    /// Messages sent: sequence numbers 1..=sent.
    sent: u64,
    /// Sequence numbers sent at QoS 1 and never acknowledged (not counted as lost).
    unacked: Vec<u64>,
    error: Option<String>,
}

/// Raises the soft limit of open files to the hard limit if `needed` is above it. Returns the
/// limit in force and, when it stays below `needed`, a sentence saying so.
// `rlim_t` is u64 on 64-bit Linux but not everywhere: the casts are for the others.
#[allow(clippy::unnecessary_cast)]
pub(super) fn raise_nofile(needed: u64) -> (u64, Option<String>) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return (0, Some("cannot read the open files limit".into()));
    }
    if lim.rlim_cur as u64 >= needed {
        return (lim.rlim_cur as u64, None);
    }
    let want = lim.rlim_max;
    let raised = libc::rlimit {
        rlim_cur: want,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit reads the struct it is given.
    let cur = if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        want as u64
    } else {
        lim.rlim_cur as u64
    };
    if cur >= needed {
        (cur, None)
    } else {
        (
            cur,
            Some(format!(
                "the open files limit is {cur} (hard limit {}), below the {needed} this run needs: \
                 connections beyond it fail (raise it with ulimit -n as root)",
                lim.rlim_max as u64
            )),
        )
    }
}

/// Runs the fleet scenario and fills `report` (and its `fleet` part).
pub async fn run(cfg: &RunConfig, fleet: &FleetConfig, report: &mut Report) {
    let t = &cfg.token;
    let (nofile, nofile_note) = raise_nofile(fleet.devices as u64 + fleet.backends as u64 + 64);
    let mut notes = Vec::new();
    if let Some(n) = nofile_note {
        eprintln!("fleet: {n}");
        notes.push(n);
    }
    let shared_sub = fleet.backends > 1;
    let filter = if shared_sub {
        format!("$share/backend/{}", fleet.filter)
    } else {
        fleet.filter.clone()
    };
    report.publishers = fleet.devices;
    report.subscribers = fleet.backends;
    report.rate = fleet.devices as f64 / fleet.interval;
    report.duration_s = cfg.duration.as_secs_f64();
    let broker_pid = fleet
        .broker_pid
        .or_else(|| procstat::listener_pid(cfg.target.addr.port()));
    let mut fr = FleetReport {
        devices: fleet.devices,
        interval_s: fleet.interval,
        jitter: fleet.jitter,
        backends: fleet.backends,
        filter: filter.clone(),
        offered_per_s: report.rate,
        nofile_limit: nofile,
        broker_pid,
        ..FleetReport::default()
    };

    // The backend first, so that it hears every message.
    let shared = Shared::new();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut sub_tasks = Vec::new();
    for i in 0..fleet.backends {
        let id = format!("{t}-backend-{i}");
        match traffic::connect_subscriber(cfg, &id, std::slice::from_ref(&filter), true).await {
            Ok((c, _)) => sub_tasks.push(tokio::spawn(traffic::subscribe_loop(
                c,
                Arc::clone(&shared),
                stop_rx.clone(),
                SubResult::default(),
            ))),
            Err(e) => {
                report.errors.push(format!("backend subscriber {i}: {e}"));
                report.fleet = Some(fr);
                return;
            }
        }
    }

    // The devices, at a paced rate; each waits for the window.
    let (go_tx, go_rx) = watch::channel::<Option<Instant>>(None);
    let (up_tx, mut up_rx) = mpsc::unbounded_channel::<Result<(), String>>();
    let sem = Arc::new(Semaphore::new(fleet.connect_concurrency.max(1)));
    let connect_start = Instant::now();
    let seed = u64::from(std::process::id()) ^ connect_start.elapsed().as_nanos() as u64;
    let mut devices = Vec::with_capacity(fleet.devices);
    for i in 0..fleet.devices {
        let at = connect_start + Duration::from_secs_f64(i as f64 / fleet.connect_rate);
        tokio::time::sleep_until(at.into()).await;
        let permit = match Arc::clone(&sem).acquire_owned().await {
            Ok(p) => p,
            Err(_) => break,
        };
        let cfg = cfg.clone();
        let up = up_tx.clone();
        let go = go_rx.clone();
        let rng = SplitMix(seed ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407));
        let (interval, jitter) = (fleet.interval, fleet.jitter);
        let shared = Arc::clone(&shared);
        devices.push(tokio::spawn(async move {
            let id = format!("{}-dev-{i}", cfg.token);
            let topic = format!("fleet/{}/{i}", cfg.token);
            let c = match traffic::connect_publisher(&cfg, &id).await {
                Ok(c) => c,
                Err(e) => {
                    drop(permit);
                    let _ = up.send(Err(e.to_string()));
                    return DeviceResult {
                        error: Some(e.to_string()),
                        ..DeviceResult::default()
                    };
                }
            };
            drop(permit);
            let _ = up.send(Ok(()));
            drop(up);
            let dev = Device {
                index: i as u32,
                topic,
                interval,
                jitter,
                rng,
            };
            dev.run(c, &cfg, go, shared).await
        }));
    }
    drop(up_tx);
    let (mut connected, mut failed) = (0usize, 0usize);
    let up_deadline = Instant::now() + Duration::from_secs(120);
    while connected + failed < devices.len() {
        match tokio::time::timeout_at(up_deadline.into(), up_rx.recv()).await {
            Ok(Some(Ok(()))) => connected += 1,
            Ok(Some(Err(e))) => {
                failed += 1;
                if report.errors.len() < 5 {
                    report.errors.push(format!("device: {e}"));
                }
            }
            _ => break,
        }
    }
    fr.connected = connected;
    fr.connect_failed = fleet.devices - connected;
    fr.connect_s = connect_start.elapsed().as_secs_f64();
    eprintln!(
        "fleet: {connected} devices connected in {:.1} s ({} failed); measuring {:.0} s",
        fr.connect_s,
        fr.connect_failed,
        cfg.duration.as_secs_f64()
    );

    // The measured window.
    let cpu0 = broker_pid.and_then(procstat::cpu_seconds);
    let start = Instant::now();
    let _ = go_tx.send(Some(start));
    let window_end = start + cfg.duration;
    tokio::time::sleep_until(window_end.into()).await;
    let window_s = start.elapsed().as_secs_f64();
    let cpu1 = broker_pid.and_then(procstat::cpu_seconds);
    if let (Some(a), Some(b)) = (cpu0, cpu1) {
        fr.broker_cpu_pct = Some(100.0 * (b - a) / window_s);
    }
    if let Some((rss, peak)) = broker_pid.and_then(procstat::rss_kib) {
        fr.broker_rss_kib = Some(rss);
        fr.broker_peak_rss_kib = Some(peak);
    }
    if broker_pid.is_some() && fr.broker_cpu_pct.is_none() {
        notes.push("the broker's /proc/PID/stat could not be read: no CPU %".into());
    } else if broker_pid.is_none() {
        notes.push(
            "the broker's process was not found from the port (give --broker-pid): no CPU %".into(),
        );
    }

    let mut results = Vec::with_capacity(devices.len());
    for d in devices {
        results.push(d.await.unwrap_or_default());
    }
    let publish_end = Instant::now();
    let sent: u64 = results.iter().map(|r| r.sent).sum();
    let unacked: u64 = results.iter().map(|r| r.unacked.len() as u64).sum();
    let acked = sent - unacked;
    traffic::wait_deliveries(&shared, acked, cfg.drain, cfg.quiet).await;
    let _ = stop_tx.send(true);
    let mut latency = Histogram::default();
    let mut trackers: Vec<Tracker> = Vec::new();
    for task in sub_tasks {
        let r = task.await.unwrap_or_default();
        latency.merge(&r.latency);
        if let Some(e) = r.error {
            report.errors.push(e);
        }
        trackers.push(r.tracker);
    }
    for (i, r) in results.iter().enumerate() {
        if let Some(e) = &r.error {
            if report.errors.len() < 10 {
                report.errors.push(format!("device {i}: {e}"));
            }
        }
    }
    // Acknowledged (or, at QoS 0, sent) and heard by no backend subscriber: lost.
    let mut lost = 0u64;
    let mut delivered = 0u64;
    for (i, r) in results.iter().enumerate() {
        for seq in 1..=r.sent {
            let heard = trackers.iter().any(|t| t.seen(i as u32, seq));
            if heard {
                delivered += 1;
            } else if !r.unacked.contains(&seq) {
                lost += 1;
            }
        }
    }
    // A message two backend subscribers both heard counts as a duplicate too.
    let heard: u64 = trackers.iter().map(|t| t.unique).sum();
    let duplicates = trackers.iter().map(|t| t.duplicates).sum::<u64>() + (heard - delivered);
    report.sent = sent;
    report.acked = acked;
    report.expected = acked;
    report.delivered = delivered;
    report.lost = lost;
    report.duplicates = duplicates;
    report.reordered = trackers.iter().map(|t| t.reordered).sum();
    report.delivered_ratio = if acked > 0 {
        delivered as f64 / acked as f64
    } else {
        0.0
    };
    report.publish_s = window_s;
    report.delivery_s = (publish_end - start).as_secs_f64();
    report.sent_per_s = sent as f64 / window_s;
    report.delivered_per_s = delivered as f64 / window_s;
    report.latency_us = Latency::from(&latency);
    fr.window_s = window_s;
    fr.notes = notes;
    report.fleet = Some(fr);
}

/// One device of the fleet.
struct Device {
    index: u32,
    topic: String,
    interval: f64,
    jitter: f64,
    rng: SplitMix,
}

impl Device {
    /// Waits for the window (answering keep alive meanwhile), then publishes one message every
    /// interval until the window ends, then waits up to `cfg.drain` for the last PUBACKs.
    async fn run(
        mut self,
        mut c: Client,
        cfg: &RunConfig,
        mut go: watch::Receiver<Option<Instant>>,
        shared: Arc<Shared>,
    ) -> DeviceResult {
        let mut result = DeviceResult::default();
        let ping = Duration::from_secs(u64::from(cfg.keep_alive.max(2)) * 3 / 4);
        let start = loop {
            if let Some(s) = *go.borrow_and_update() {
                break s;
            }
            tokio::select! {
                r = go.changed() => if r.is_err() { return result },
                _ = tokio::time::sleep(ping) => {
                    if let Err(e) = c.send(&Packet::PingReq).await {
                        result.error = Some(format!("ping: {e}"));
                        return result;
                    }
                }
                r = c.recv() => match r {
                    Ok(Some(_)) => {}
                    Ok(None) => { result.error = Some("connection closed by the broker".into()); return result; }
                    Err(e) => { result.error = Some(e.to_string()); return result; }
                },
            }
        };
        let end = start + cfg.duration;
        let mut next = start + Duration::from_secs_f64(self.interval * self.rng.unit());
        let qos = cfg.qos;
        let mut payload = vec![0x5Au8; cfg.payload.max(STAMP)];
        let mut out = BytesMut::with_capacity(64 + payload.len());
        // Packet identifier -> sequence number, of the messages not yet acknowledged.
        let mut pending: Vec<(u16, u64)> = Vec::new();
        let mut seq = 0u64;
        let mut drain_until = None;
        loop {
            let wake = match drain_until {
                Some(d) => d,
                None if next < end => next,
                None => {
                    let d = Instant::now() + cfg.drain;
                    drain_until = Some(d);
                    d
                }
            };
            if drain_until.is_some() && pending.is_empty() {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(wake.into()) => {
                    if drain_until.is_some() {
                        break;
                    }
                    seq += 1;
                    let packet_id = if qos == QoS::AtMostOnce {
                        0
                    } else {
                        (seq % u64::from(u16::MAX)) as u16 + 1
                    };
                    payload[0..8].copy_from_slice(&shared.now_ns().to_le_bytes());
                    payload[8..12].copy_from_slice(&self.index.to_le_bytes());
                    payload[12..20].copy_from_slice(&seq.to_le_bytes());
                    out.clear();
                    let p = PublishRef {
                        dup: false,
                        qos,
                        retain: false,
                        topic: &self.topic,
                        packet_id,
                        properties: &Default::default(),
                        payload: &payload,
                    };
                    if let Err(e) = codec::encode_publish(&p, c.version, &mut out) {
                        result.error = Some(format!("encode: {e}"));
                        seq -= 1;
                        break;
                    }
                    if let Err(e) = crate::stream::write_flush(c.conn.parts_mut().0, &out).await {
                        result.error = Some(format!("publish: {e}"));
                        pending.push((packet_id, seq));
                        break;
                    }
                    if qos != QoS::AtMostOnce {
                        pending.push((packet_id, seq));
                    }
                    let f = 1.0 + self.jitter * (2.0 * self.rng.unit() - 1.0);
                    next += Duration::from_secs_f64(self.interval * f);
                }
                r = c.recv() => match r {
                    Ok(Some(Packet::PubAck(a))) => pending.retain(|(id, _)| *id != a.packet_id),
                    Ok(Some(Packet::Disconnect(d))) => {
                        result.error = Some(format!("broker sent DISCONNECT {:?}", d.reason_code));
                        break;
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => { result.error = Some("connection closed by the broker".into()); break; }
                    Err(e) => { result.error = Some(e.to_string()); break; }
                },
            }
        }
        result.sent = seq;
        result.unacked = pending.into_iter().map(|(_, s)| s).collect();
        if result.error.is_none() {
            let _ = c.disconnect().await;
        }
        result
    }
}
