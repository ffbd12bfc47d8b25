//! `recado sub`: subscribe and print what arrives (mosquitto_sub).

use std::time::Duration;

use bytes::Bytes;
use mercurio_core::codec::{
    Packet, Properties, ProtocolVersion, Publish, QoS, Subscribe, SubscribeFilter,
    SubscriptionOptions, Unsubscribe,
};
use mercurio_core::topic;
use tokio::time::Instant;

use crate::cli::SubArgs;
use crate::clock::Moment;
use crate::exit::{Exit, Failure};
use crate::format::{Printer, Received};
use crate::output::{self, Written};
use crate::props::SUB_COMMANDS;
use crate::session::{Event, Session};
use crate::table::Table;
use crate::target::settings;

/// Parses -W: seconds, more than 0.
pub fn parse_timeout(w: Option<f64>) -> Result<Option<Duration>, Failure> {
    match w {
        None => Ok(None),
        Some(s) if s > 0.0 && s.is_finite() && s <= 31_536_000.0 => {
            Ok(Some(Duration::from_secs_f64(s)))
        }
        Some(s) => Err(Failure::usage(format!(
            "-W {s}: the timeout is a number of seconds, more than 0"
        ))),
    }
}

/// Waits until `deadline` (forever when `None`).
pub async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// The first wait before connecting again after a lost connection; it doubles up to
/// [`RETRY_MAX`] while the broker stays unreachable.
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two connection attempts.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// How a subscription run ends.
enum End {
    /// Done (-C reached, -E, --retained-only, Ctrl+C, output closed).
    Done,
    /// -W expired.
    TimedOut,
}

/// Runs `recado sub` until -C, -W, -E, --retained-only, Ctrl+C or a closed output ends it.
pub async fn run(a: SubArgs) -> Result<(), Failure> {
    let mut s = settings(&a.conn, "sub", SUB_COMMANDS)?;
    let version = s.connect.protocol;
    let mut filters = a.topics.clone();
    if let Some(t) = s.url_topic.take() {
        filters.push(t);
    }
    if filters.is_empty() && a.unsubscribe.is_empty() {
        return Err(Failure::usage(
            "give a topic filter to subscribe to with -t",
        ));
    }
    for f in filters.iter().chain(&a.unsubscribe).chain(&a.filter_out) {
        topic::validate_subscription_filter(f)
            .map_err(|e| Failure::usage(format!("{f}: not a valid topic filter: {e}")))?;
    }
    if (a.no_local || a.retain_as_published || a.retain_handling.is_some()) && !version.is_v5() {
        return Err(Failure::usage(
            "--no-local, --retain-as-published and --retain-handling are MQTT 5 options: add -V mqttv5",
        ));
    }
    let mut sub_properties = s.properties.subscribe.clone();
    if let Some(v) = &a.stream_offset {
        if !version.is_v5() {
            return Err(Failure::usage(format!(
                "--stream-offset is an MQTT 5 user property: add -V mqttv5, or write the offset \
                 in the filter: -t '$stream/<name>/@{v}'"
            )));
        }
        mercurio_core::streams::StartAt::parse(v)
            .map_err(|e| Failure::usage(format!("--stream-offset: {e}")))?;
        if !filters.iter().any(|f| f.starts_with("$stream/")) {
            return Err(Failure::usage(format!(
                "--stream-offset {v}: only a stream reader has an offset; subscribe to \
                 -t '$stream/<name>' (docs/streams.md)"
            )));
        }
        sub_properties.user_properties.push((
            mercurio_core::streams::OFFSET_PROPERTY.to_string(),
            v.clone(),
        ));
    }
    let retain_handling = match a.retain_handling.as_deref() {
        Some("new") => 1,
        Some("never") => 2,
        _ => 0,
    };
    if a.count == Some(0) {
        return Err(Failure::usage("-C: the count is 1 or more"));
    }
    let printer = Printer::new(&a.output).map_err(Failure::usage)?;
    let timeout = parse_timeout(a.timeout)?;
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut table = a.table.then(Table::new);
    let mut out = output::Batched::default();

    let qos = QoS::from_u8(a.qos).unwrap_or_default();
    let subscribe = Subscribe {
        packet_id: 0,
        filters: filters
            .iter()
            .map(|f| SubscribeFilter {
                filter: f.clone(),
                options: SubscriptionOptions {
                    qos,
                    no_local: a.no_local,
                    retain_as_published: a.retain_as_published,
                    retain_handling,
                },
            })
            .collect(),
        properties: sub_properties,
    };
    // A stream reader (one filter, --stream-offset) that connects again resumes after the
    // last message it received, not at its --stream-offset again (which would print the
    // same messages twice, or with `latest` skip those appended meanwhile).
    let resumable = a.stream_offset.is_some() && filters.len() == 1;
    let mut resume_at: Option<u64> = None;
    let mut count = 0u64;
    let mut redraw = tokio::time::interval(Duration::from_millis(200));
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    let mut first = true;
    let mut retry_delay = RETRY_FIRST;
    // As mosquitto_sub: a lost connection is opened again (and the filters subscribed
    // again) until -W, -C or Ctrl+C ends the command.
    let end = loop {
        if !first {
            tokio::select! {
                () = tokio::time::sleep(retry_delay) => {}
                () = sleep_until(deadline) => break End::TimedOut,
                _ = &mut ctrl_c => break End::Done,
            }
            retry_delay = (retry_delay * 2).min(RETRY_MAX);
        }
        let opened = tokio::select! {
            r = Session::open(&s.target, s.connect.clone(), s.debug) => r,
            () = sleep_until(deadline) => break End::TimedOut,
            _ = &mut ctrl_c => break End::Done,
        };
        let mut session = match opened {
            Ok(session) => session,
            Err(f) if !first && f.exit == Exit::Unreachable => {
                if !s.quiet {
                    eprintln!("recado: {}; trying again", f.message);
                }
                continue;
            }
            Err(f) => return Err(f),
        };
        if !first && !s.quiet {
            eprintln!("recado: connected again to {}", s.target.display());
        }
        let was_first = std::mem::replace(&mut first, false);
        retry_delay = RETRY_FIRST;
        let result: Result<End, Failure> = 'session: {
            // -U once only: a resumed session does not need it again.
            let mut unsubscribe_id = None;
            if was_first && !a.unsubscribe.is_empty() {
                let id = session.next_packet_id();
                unsubscribe_id = Some(id);
                let sent = session
                    .send(&Packet::Unsubscribe(Unsubscribe {
                        packet_id: id,
                        filters: a.unsubscribe.clone(),
                        properties: s.properties.unsubscribe.clone(),
                    }))
                    .await;
                if let Err(f) = sent {
                    break 'session Err(f);
                }
            }
            let mut subscribe_id = None;
            if !filters.is_empty() {
                let id = session.next_packet_id();
                subscribe_id = Some(id);
                let mut again = Subscribe {
                    packet_id: id,
                    ..subscribe.clone()
                };
                if let Some(next) = resume_at {
                    for (key, value) in &mut again.properties.user_properties {
                        if key == mercurio_core::streams::OFFSET_PROPERTY {
                            *value = next.to_string();
                        }
                    }
                }
                let sent = session.send(&Packet::Subscribe(again)).await;
                if let Err(f) = sent {
                    break 'session Err(f);
                }
            }
            loop {
                // What was printed goes out before the wait for more: the messages of one
                // read together, each as soon as no other came with it.
                if !session.packet_buffered() || out.bytes_waiting() >= output::BATCH {
                    match out.flush() {
                        Ok(Written::Ok) => {}
                        Ok(Written::Closed) => break 'session Ok(End::Done),
                        Err(f) => break 'session Err(f),
                    }
                }
                let event = tokio::select! {
                    e = session.next() => match e {
                        Ok(e) => e,
                        Err(f) => break 'session Err(f),
                    },
                    () = sleep_until(deadline) => break 'session Ok(End::TimedOut),
                    _ = &mut ctrl_c => break 'session Ok(End::Done),
                    _ = redraw.tick(), if table.as_ref().is_some_and(|t| t.live()) => {
                        if let Some(t) = table.as_mut() {
                            if let Err(f) = t.draw_live() {
                                break 'session Err(f);
                            }
                        }
                        continue;
                    }
                };
                match event {
                    // Only -U: done once unsubscribed.
                    Event::UnsubAck(ack)
                        if Some(ack.packet_id) == unsubscribe_id && subscribe_id.is_none() =>
                    {
                        break 'session Ok(End::Done);
                    }
                    Event::SubAck(ack) if Some(ack.packet_id) == subscribe_id => {
                        if let Err(f) = check_suback(&filters, &ack.reason_codes, version, s.quiet)
                        {
                            break 'session Err(f);
                        }
                        if a.exit_after_subscribe {
                            break 'session Ok(End::Done);
                        }
                    }
                    Event::Publish(p) => {
                        let at = Moment::now();
                        if resumable {
                            let offset = p.properties.user_properties.iter().find_map(|(k, v)| {
                                (k == mercurio_core::streams::OFFSET_PROPERTY)
                                    .then(|| v.parse::<u64>().ok())
                                    .flatten()
                            });
                            if let Some(offset) = offset {
                                resume_at = Some(offset + 1);
                            }
                        }
                        if a.filter_out.iter().any(|f| topic::matches(f, &p.topic)) {
                            continue;
                        }
                        if a.remove_retained && p.retain && !p.payload.is_empty() {
                            // An empty retained message clears the topic's [MQTT-3.3.1-6].
                            let sent = session
                                .send(&Packet::Publish(Publish {
                                    dup: false,
                                    qos: QoS::AtMostOnce,
                                    retain: true,
                                    topic: p.topic.clone(),
                                    packet_id: 0,
                                    properties: Properties::default(),
                                    payload: Bytes::new(),
                                }))
                                .await;
                            if let Err(f) = sent {
                                break 'session Err(f);
                            }
                        }
                        if a.retained_only && !p.retain {
                            break 'session Ok(End::Done);
                        }
                        if a.no_retained && p.retain {
                            continue;
                        }
                        let m = Received { publish: p, at };
                        if let Some(t) = table.as_mut() {
                            t.update(&m);
                        } else {
                            match printer.render(&m) {
                                Ok(bytes) => out.push(&bytes),
                                Err(warning) => {
                                    if !s.quiet {
                                        eprintln!("{warning}");
                                    }
                                    continue;
                                }
                            }
                        }
                        count += 1;
                        if a.count.is_some_and(|c| count >= c) {
                            break 'session Ok(End::Done);
                        }
                    }
                    _ => {}
                }
            }
        };
        // What the session's last read brought (-C reached, the connection lost, ...).
        out.flush()?;
        match result {
            Ok(end) => {
                let _ = session.disconnect(s.properties.disconnect.clone()).await;
                break end;
            }
            Err(f) if f.lost => {
                if !s.quiet {
                    eprintln!("recado: {}; connecting again", f.message);
                }
            }
            Err(f) => return Err(f),
        }
    };
    match end {
        End::Done => {
            if let Some(t) = table.as_mut() {
                t.finish()?;
            }
            Ok(())
        }
        End::TimedOut => finish_timeout(a.timeout, table.as_mut()),
    }
}

/// -W expired: with -T the table is the output (success); otherwise exit code 5.
fn finish_timeout(w: Option<f64>, table: Option<&mut Table>) -> Result<(), Failure> {
    if let Some(t) = table {
        return t.finish();
    }
    Err(Failure::new(
        Exit::Timeout,
        format!("timed out after {} seconds (-W)", w.unwrap_or_default()),
    ))
}

/// A refused subscription is a warning; all refused is a failure (exit code 6).
fn check_suback(
    filters: &[String],
    codes: &[mercurio_core::codec::ReasonCode],
    version: ProtocolVersion,
    quiet: bool,
) -> Result<(), Failure> {
    let refused: Vec<String> = filters
        .iter()
        .zip(codes)
        .filter(|(_, c)| c.is_failure())
        .map(|(f, c)| {
            // 3.x has one refusal code, 0x80, named Failure (MQTT 3.1.1 section 3.9.3).
            let name = if version.is_v5() { c.name() } else { "Failure" };
            format!("{f} (0x{:02X} {name})", c.0)
        })
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    if refused.len() == filters.len() {
        return Err(Failure::new(
            Exit::Rejected,
            format!(
                "the broker refused every subscription: {}",
                refused.join(", ")
            ),
        ));
    }
    if !quiet {
        eprintln!("Warning: the broker refused {}", refused.join(", "));
    }
    Ok(())
}
