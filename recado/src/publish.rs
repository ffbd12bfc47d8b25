//! `recado pub`: publish a message, a file, standard input, or one message per line
//! (mosquitto_pub), waiting for the acknowledgement of every QoS 1 and 2 message.

use std::time::Duration;

use bytes::Bytes;
use mercurio_core::codec::{self, Properties, Publish, QoS};
use mercurio_core::topic;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader, Lines, Stdin};

use crate::cli::{MessageArgs, PubArgs};
use crate::exit::{Exit, Failure};
use crate::props::PUB_COMMANDS;
use crate::session::{Event, Session};
use crate::target::settings;

/// Where the messages come from.
pub enum Source {
    /// The same payload `remaining` more times, `delay` apart.
    Fixed {
        payload: Bytes,
        remaining: u64,
        delay: Duration,
        first: bool,
    },
    /// One message per line of standard input.
    Lines(Lines<BufReader<Stdin>>),
}

impl Source {
    /// The source -m, -f, -s, -n or -l names (exactly one must be given), repeated `repeat`
    /// times `delay` apart (not for -l).
    pub async fn from_args(
        m: &MessageArgs,
        repeat: u64,
        delay: Duration,
    ) -> Result<Source, Failure> {
        let given = [
            m.message.is_some(),
            m.file.is_some(),
            m.lines,
            m.stdin,
            m.null,
        ]
        .iter()
        .filter(|g| **g)
        .count();
        if given != 1 {
            return Err(Failure::usage(
                "give the message with one of -m, -f, -l, -s or -n",
            ));
        }
        let payload = if let Some(text) = &m.message {
            Bytes::from(text.clone())
        } else if let Some(path) = &m.file {
            let data = tokio::fs::read(path)
                .await
                .map_err(|e| Failure::error(format!("cannot read {}: {e}", path.display())))?;
            Bytes::from(data)
        } else if m.stdin {
            let mut data = Vec::new();
            tokio::io::stdin()
                .read_to_end(&mut data)
                .await
                .map_err(|e| Failure::error(format!("cannot read standard input: {e}")))?;
            Bytes::from(data)
        } else if m.lines {
            return Ok(Source::Lines(BufReader::new(tokio::io::stdin()).lines()));
        } else {
            Bytes::new()
        };
        Ok(Source::Fixed {
            payload,
            remaining: repeat,
            delay,
            first: true,
        })
    }

    /// The next payload; `None` when there are no more. Cancel safe.
    pub async fn next(&mut self) -> Result<Option<Bytes>, Failure> {
        match self {
            Source::Fixed {
                payload,
                remaining,
                delay,
                first,
            } => {
                if *remaining == 0 {
                    return Ok(None);
                }
                if !*first && !delay.is_zero() {
                    tokio::time::sleep(*delay).await;
                }
                *first = false;
                *remaining -= 1;
                Ok(Some(payload.clone()))
            }
            Source::Lines(lines) => lines
                .next_line()
                .await
                .map(|l| l.map(Bytes::from))
                .map_err(|e| Failure::error(format!("cannot read standard input: {e}"))),
        }
    }
}

/// What to publish and how.
pub struct Outgoing<'a> {
    pub topic: &'a str,
    pub qos: QoS,
    pub retain: bool,
    pub properties: &'a Properties,
    pub quiet: bool,
}

/// Publishes everything `source` gives, then waits for the last acknowledgements. A message
/// the broker refuses is a warning and exit code 6 at the end. Other events that arrive
/// meanwhile (messages for a subscription) are appended to `others`.
pub async fn publish_all(
    session: &mut Session,
    source: &mut Source,
    out: &Outgoing<'_>,
    others: &mut Vec<Event>,
) -> Result<(), Failure> {
    let Outgoing {
        topic,
        qos,
        retain,
        properties,
        quiet,
    } = *out;
    if qos as u8 > session.maximum_qos() {
        return Err(Failure::new(
            Exit::Rejected,
            format!(
                "the broker accepts QoS {} at most (Maximum QoS in CONNACK)",
                session.maximum_qos()
            ),
        ));
    }
    if retain && session.connack.properties.retain_available == Some(0) {
        return Err(Failure::new(
            Exit::Rejected,
            "the broker does not support retained messages (Retain Available 0 in CONNACK)",
        ));
    }
    if let Some(alias) = properties.topic_alias {
        let max = session.connack.properties.topic_alias_maximum.unwrap_or(0);
        if alias > max {
            return Err(Failure::new(
                Exit::Rejected,
                format!(
                    "the broker accepts Topic Aliases up to {max} (Topic Alias Maximum in CONNACK)"
                ),
            ));
        }
    }
    let window = usize::from(session.receive_maximum()).min(1000);
    let mut refused = 0u64;
    let mut source_done = false;
    let mut alias_set = false;
    loop {
        if source_done && session.in_flight() == 0 {
            break;
        }
        let can_send = !source_done && session.in_flight() < window;
        tokio::select! {
            next = source.next(), if can_send => {
                let Some(payload) = next? else {
                    source_done = true;
                    continue;
                };
                // With a Topic Alias, the topic goes once; then the alias stands for it.
                let topic = if alias_set { String::new() } else { topic.to_string() };
                alias_set = properties.topic_alias.is_some();
                let publish = Publish {
                    dup: false,
                    qos,
                    retain,
                    topic,
                    // Allocated by the session (QoS 1 and 2).
                    packet_id: 0,
                    properties: properties.clone(),
                    payload,
                };
                // The broker would close the connection on a larger packet [MQTT-3.1.2-24].
                if let Some(max) = session.connack.properties.maximum_packet_size {
                    let size = codec::publish_encoded_len(&codec::publish_ref(&publish), session.version);
                    if size > max as usize {
                        return Err(Failure::new(
                            Exit::Rejected,
                            format!("the message is {size} bytes, more than the broker's Maximum Packet Size of {max}"),
                        ));
                    }
                }
                session.publish(publish).await?;
            }
            event = session.next() => {
                match event? {
                    Event::Published { packet_id, reason } => {
                        if reason.is_failure() {
                            refused += 1;
                            if !quiet {
                                eprintln!(
                                    "Warning: Publish {packet_id} failed: 0x{:02X} {}.",
                                    reason.0,
                                    reason.name()
                                );
                            }
                        }
                    }
                    other => others.push(other),
                }
            }
        }
    }
    if refused > 0 {
        return Err(Failure::new(
            Exit::Rejected,
            format!("the broker refused {refused} message(s)"),
        ));
    }
    Ok(())
}

/// Runs `recado pub`: connects, publishes, waits for the acknowledgements, disconnects.
pub async fn run(a: PubArgs) -> Result<(), Failure> {
    let mut s = settings(&a.conn, "pub", PUB_COMMANDS)?;
    let topic = match (a.topic.clone(), s.url_topic.take()) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) => return Err(Failure::usage("give the topic to publish to with -t")),
    };
    topic::validate_topic_name(&topic)
        .map_err(|e| Failure::usage(format!("{topic}: not a valid topic name: {e}")))?;
    if a.repeat == 0 {
        return Err(Failure::usage("--repeat: the count is 1 or more"));
    }
    if !(a.repeat_delay >= 0.0 && a.repeat_delay.is_finite()) {
        return Err(Failure::usage("--repeat-delay: seconds, 0 or more"));
    }
    let mut source = Source::from_args(
        &a.message,
        a.repeat,
        Duration::from_secs_f64(a.repeat_delay),
    )
    .await?;
    let qos = QoS::from_u8(a.qos).unwrap_or_default();
    let mut session = Session::open(&s.target, s.connect.clone(), s.debug).await?;
    let out = Outgoing {
        topic: &topic,
        qos,
        retain: a.retain,
        properties: &s.properties.publish,
        quiet: s.quiet,
    };
    let result = publish_all(&mut session, &mut source, &out, &mut Vec::new()).await;
    let _ = session.disconnect(s.properties.disconnect.clone()).await;
    result
}
