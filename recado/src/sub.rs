//! `recado sub`: subscribe and print what arrives (mosquitto_sub).

use std::time::Duration;

use bytes::Bytes;
use mercurio_core::codec::{
    Packet, Properties, Publish, QoS, Subscribe, SubscribeFilter, SubscriptionOptions, Unsubscribe,
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

/// How a subscription run ends.
enum End {
    /// Done (-C reached, -E, --retained-only, Ctrl+C, output closed).
    Done,
    /// -W expired.
    TimedOut,
}

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
    if (a.no_local || a.retain_as_published) && !version.is_v5() {
        return Err(Failure::usage(
            "--no-local and --retain-as-published are MQTT 5 options: add -V mqttv5",
        ));
    }
    if a.count == Some(0) {
        return Err(Failure::usage("-C: the count is 1 or more"));
    }
    let printer = Printer::new(&a.output).map_err(Failure::usage)?;
    let timeout = parse_timeout(a.timeout)?;
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut table = a.table.then(Table::new);

    let mut session = tokio::select! {
        r = Session::open(&s.target, s.connect.clone(), s.debug) => r?,
        () = sleep_until(deadline) => return finish_timeout(a.timeout, table.as_mut()),
    };
    let mut unsubscribe_id = None;
    if !a.unsubscribe.is_empty() {
        let id = session.next_packet_id();
        unsubscribe_id = Some(id);
        session
            .send(&Packet::Unsubscribe(Unsubscribe {
                packet_id: id,
                filters: a.unsubscribe.clone(),
                properties: s.properties.unsubscribe.clone(),
            }))
            .await?;
    }
    let mut subscribe_id = None;
    if !filters.is_empty() {
        let id = session.next_packet_id();
        subscribe_id = Some(id);
        let qos = QoS::from_u8(a.qos).unwrap_or_default();
        session
            .send(&Packet::Subscribe(Subscribe {
                packet_id: id,
                filters: filters
                    .iter()
                    .map(|f| SubscribeFilter {
                        filter: f.clone(),
                        options: SubscriptionOptions {
                            qos,
                            no_local: a.no_local,
                            retain_as_published: a.retain_as_published,
                            retain_handling: 0,
                        },
                    })
                    .collect(),
                properties: s.properties.subscribe.clone(),
            }))
            .await?;
    }

    let mut count = 0u64;
    let mut redraw = tokio::time::interval(Duration::from_millis(200));
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    let end = loop {
        let event = tokio::select! {
            e = session.next() => e?,
            () = sleep_until(deadline) => break End::TimedOut,
            _ = &mut ctrl_c => break End::Done,
            _ = redraw.tick(), if table.as_ref().is_some_and(|t| t.live()) => {
                if let Some(t) = table.as_mut() {
                    t.draw_live()?;
                }
                continue;
            }
        };
        match event {
            // Only -U: done once unsubscribed.
            Event::UnsubAck(ack)
                if Some(ack.packet_id) == unsubscribe_id && subscribe_id.is_none() =>
            {
                break End::Done;
            }
            Event::SubAck(ack) if Some(ack.packet_id) == subscribe_id => {
                check_suback(&filters, &ack.reason_codes, s.quiet)?;
                if a.exit_after_subscribe {
                    break End::Done;
                }
            }
            Event::Publish(p) => {
                let at = Moment::now();
                if a.filter_out.iter().any(|f| topic::matches(f, &p.topic)) {
                    continue;
                }
                if a.remove_retained && p.retain && !p.payload.is_empty() {
                    // An empty retained message clears the topic's [MQTT-3.3.1-6].
                    session
                        .send(&Packet::Publish(Publish {
                            dup: false,
                            qos: QoS::AtMostOnce,
                            retain: true,
                            topic: p.topic.clone(),
                            packet_id: 0,
                            properties: Properties::default(),
                            payload: Bytes::new(),
                        }))
                        .await?;
                }
                if a.retained_only && !p.retain {
                    break End::Done;
                }
                if a.no_retained && p.retain {
                    continue;
                }
                let m = Received { publish: p, at };
                if let Some(t) = table.as_mut() {
                    t.update(&m);
                } else {
                    match printer.render(&m) {
                        Ok(bytes) => {
                            if let Written::Closed = output::write(&bytes)? {
                                break End::Done;
                            }
                        }
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
                    break End::Done;
                }
            }
            _ => {}
        }
    };
    let _ = session.disconnect(s.properties.disconnect.clone()).await;
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
    quiet: bool,
) -> Result<(), Failure> {
    let refused: Vec<String> = filters
        .iter()
        .zip(codes)
        .filter(|(_, c)| c.is_failure())
        .map(|(f, c)| format!("{f} (0x{:02X} {})", c.0, c.name()))
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
