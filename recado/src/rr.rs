//! `recado rr`: request / response (mosquitto_rr, MQTT 5.0 section 4.10). Subscribes to the
//! response topic, publishes the request with Response Topic and Correlation Data, and prints
//! the first response: a message on the response topic with the same Correlation Data, or
//! none (a responder that does not echo it).

use std::time::Duration;

use bytes::Bytes;
use mercurio_core::codec::{
    Packet, ProtocolVersion, QoS, Subscribe, SubscribeFilter, SubscriptionOptions,
};
use mercurio_core::topic;
use tokio::time::Instant;

use crate::cli::RrArgs;
use crate::clock::Moment;
use crate::exit::{Exit, Failure};
use crate::format::{Printer, Received};
use crate::output;
use crate::props::RR_COMMANDS;
use crate::publish::{publish_all, Outgoing, Source};
use crate::session::{Event, Session};
use crate::sub::{parse_timeout, sleep_until};
use crate::target::settings;

/// Runs `recado rr` (MQTT 5 only; the version defaults to it).
pub async fn run(mut a: RrArgs) -> Result<(), Failure> {
    if a.conn.protocol_version.is_none() {
        a.conn.protocol_version = Some("mqttv5".into());
    }
    let mut s = settings(&a.conn, "rr", RR_COMMANDS)?;
    if s.connect.protocol != ProtocolVersion::V5 {
        return Err(Failure::usage(
            "request / response needs MQTT 5 (Response Topic, Correlation Data): -V mqttv5",
        ));
    }
    topic::validate_topic_name(&a.topic)
        .map_err(|e| Failure::usage(format!("-t {}: not a valid topic name: {e}", a.topic)))?;
    topic::validate_subscription_filter(&a.response_topic)
        .map_err(|e| Failure::usage(format!("-e {}: not a valid topic: {e}", a.response_topic)))?;
    let printer = Printer::new(&a.output).map_err(Failure::usage)?;
    let deadline = parse_timeout(a.timeout)?.map(|t| Instant::now() + t);
    let correlation = match (&a.correlation_data, &s.properties.publish.correlation_data) {
        (Some(c), _) => Bytes::from(c.clone()),
        (None, Some(c)) => c.clone(),
        (None, None) => Bytes::from(format!(
            "recado-{}-{}",
            std::process::id(),
            Moment::now().unix()
        )),
    };
    let mut request_props = s.properties.publish.clone();
    request_props.response_topic = Some(a.response_topic.clone());
    request_props.correlation_data = Some(correlation.clone());
    let mut source = Source::from_args(&a.message, 1, Duration::ZERO).await?;
    let qos = QoS::from_u8(a.qos).unwrap_or_default();
    let timed_out = || Failure::new(Exit::Timeout, "no response before the timeout (-W)");

    let mut session = tokio::select! {
        r = Session::open(&s.target, s.connect.clone(), s.debug) => r?,
        () = sleep_until(deadline) => return Err(timed_out()),
    };
    let sub_id = session.next_packet_id();
    session
        .send(&Packet::Subscribe(Subscribe {
            packet_id: sub_id,
            filters: vec![SubscribeFilter {
                filter: a.response_topic.clone(),
                options: SubscriptionOptions {
                    qos,
                    ..SubscriptionOptions::default()
                },
            }],
            properties: std::mem::take(&mut s.properties.subscribe),
        }))
        .await?;
    // The request goes once the subscription is in place, or the response could be missed.
    let mut pending: Vec<Event> = Vec::new();
    let response = loop {
        let event = match pending.pop() {
            Some(e) => e,
            None => tokio::select! {
                e = session.next() => e?,
                () = sleep_until(deadline) => return Err(timed_out()),
            },
        };
        match event {
            Event::SubAck(ack) if ack.packet_id == sub_id => {
                if ack.reason_codes.iter().any(|c| c.is_failure()) {
                    let c = ack.reason_codes.first().copied().unwrap_or_default();
                    return Err(Failure::new(
                        Exit::Rejected,
                        format!(
                            "the broker refused the subscription to {}: 0x{:02X} {}",
                            a.response_topic,
                            c.0,
                            c.name()
                        ),
                    ));
                }
                let out = Outgoing {
                    topic: &a.topic,
                    qos,
                    retain: false,
                    properties: &request_props,
                    quiet: s.quiet,
                };
                let mut others = Vec::new();
                let sent = tokio::select! {
                    r = publish_all(&mut session, &mut source, &out, &mut others) => r,
                    () = sleep_until(deadline) => return Err(timed_out()),
                };
                sent?;
                others.reverse();
                pending = others;
            }
            Event::Publish(p) => {
                let same = match &p.properties.correlation_data {
                    Some(c) => *c == correlation,
                    None => true,
                };
                if same && topic::matches(&a.response_topic, &p.topic) {
                    break p;
                }
            }
            _ => {}
        }
    };
    let m = Received {
        publish: response,
        at: Moment::now(),
    };
    let _ = session.disconnect(s.properties.disconnect.clone()).await;
    match printer.render(&m) {
        Ok(bytes) => output::write(&bytes).map(|_| ()),
        Err(warning) => Err(Failure::error(warning)),
    }
}
