//! How a received message is printed: the payload (default), topic and payload (-v),
//! mosquitto_sub's -F format strings, or one JSON object (--json).

use base64::Engine;
use mercurio_core::codec::{Properties, Publish};
use serde_json::{json, Map, Value};

use crate::cli::OutputArgs;
use crate::clock::Moment;

/// A message as received: the PUBLISH and when it arrived.
pub struct Received {
    pub publish: Publish,
    pub at: Moment,
}

/// One piece of a parsed -F format.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Literal(Vec<u8>),
    /// `%[flags][width][.max]X`.
    Param {
        conv: char,
        zero: bool,
        left: bool,
        width: usize,
        max: Option<usize>,
    },
    /// `@X`: strftime's `%X`.
    Time(char),
    /// `@N`: nanoseconds in the current second.
    Nanos,
}

enum Style {
    Payload,
    Verbose,
    Format(Vec<Piece>),
    Json,
}

/// Renders messages as the output flags say.
pub struct Printer {
    style: Style,
    newline: bool,
    pretty: bool,
}

impl Printer {
    /// Errors: a -F format that cannot be parsed (a usage error).
    pub fn new(o: &OutputArgs) -> Result<Printer, String> {
        let style = if o.json {
            Style::Json
        } else if let Some(f) = &o.format {
            Style::Format(parse_format(f)?)
        } else if o.verbose {
            Style::Verbose
        } else {
            Style::Payload
        };
        Ok(Printer {
            style,
            newline: !o.no_newline,
            pretty: o.pretty,
        })
    }

    /// The bytes to print for `m`, newline included. `Err` is a warning for standard error
    /// instead (-F %J with a payload that is not JSON, as mosquitto_sub).
    pub fn render(&self, m: &Received) -> Result<Vec<u8>, String> {
        let p = &m.publish;
        let mut out = Vec::with_capacity(p.payload.len() + 64);
        match &self.style {
            Style::Payload => out.extend_from_slice(&p.payload),
            Style::Verbose => {
                out.extend_from_slice(p.topic.as_bytes());
                out.push(b' ');
                // A stream reader's message: its offset in the stream after the topic.
                if let Some((_, offset)) = p
                    .properties
                    .user_properties
                    .iter()
                    .find(|(k, _)| k == mercurio_core::streams::OFFSET_PROPERTY)
                {
                    out.push(b'@');
                    out.extend_from_slice(offset.as_bytes());
                    out.push(b' ');
                }
                out.extend_from_slice(&p.payload);
            }
            Style::Json => {
                let v = to_json(m);
                out.extend_from_slice(self.json_text(&v).as_bytes());
            }
            Style::Format(pieces) => {
                for piece in pieces {
                    self.render_piece(piece, m, &mut out)?;
                }
            }
        }
        if self.newline {
            out.push(b'\n');
        }
        Ok(out)
    }

    fn json_text(&self, v: &Value) -> String {
        let text = if self.pretty {
            serde_json::to_string_pretty(v)
        } else {
            serde_json::to_string(v)
        };
        text.unwrap_or_default()
    }

    fn render_piece(&self, piece: &Piece, m: &Received, out: &mut Vec<u8>) -> Result<(), String> {
        let p = &m.publish;
        let props = &p.properties;
        match piece {
            Piece::Literal(b) => out.extend_from_slice(b),
            Piece::Time(c) => {
                out.extend_from_slice(m.at.strftime(&format!("%{c}"), true).as_bytes())
            }
            Piece::Nanos => out.extend_from_slice(format!("{:09}", m.at.nanos).as_bytes()),
            Piece::Param {
                conv,
                zero,
                left,
                width,
                max,
            } => {
                let numeric = |v: Option<u64>| v.map(|v| v.to_string().into_bytes());
                let (value, is_number): (Option<Vec<u8>>, bool) = match conv {
                    '%' => (Some(b"%".to_vec()), false),
                    't' => (Some(p.topic.as_bytes().to_vec()), false),
                    'p' => (Some(p.payload.to_vec()), false),
                    'x' => (Some(hex(&p.payload, false).into_bytes()), true),
                    'X' => (Some(hex(&p.payload, true).into_bytes()), true),
                    'l' => (numeric(Some(p.payload.len() as u64)), true),
                    'm' => (numeric(Some(p.packet_id.into())), true),
                    'q' => (numeric(Some(p.qos as u64)), false),
                    'r' => (numeric(Some(u64::from(p.retain))), false),
                    'I' => (Some(m.at.iso8601().into_bytes()), false),
                    'U' => (Some(m.at.unix().into_bytes()), false),
                    'A' => (numeric(props.topic_alias.map(u64::from)), true),
                    'C' => (
                        props.content_type.as_ref().map(|s| s.as_bytes().to_vec()),
                        false,
                    ),
                    'D' => (props.correlation_data.as_ref().map(|b| b.to_vec()), false),
                    'E' => (numeric(props.message_expiry_interval.map(u64::from)), true),
                    'F' => (numeric(props.payload_format_indicator.map(u64::from)), true),
                    'R' => (
                        props.response_topic.as_ref().map(|s| s.as_bytes().to_vec()),
                        false,
                    ),
                    'S' => (
                        (!props.subscription_identifiers.is_empty()).then(|| {
                            let ids: Vec<String> = props
                                .subscription_identifiers
                                .iter()
                                .map(|i| i.to_string())
                                .collect();
                            ids.join(",").into_bytes()
                        }),
                        true,
                    ),
                    'P' => (
                        (!props.user_properties.is_empty()).then(|| {
                            let pairs: Vec<String> = props
                                .user_properties
                                .iter()
                                .map(|(k, v)| format!("{k}:{v}"))
                                .collect();
                            pairs.join(" ").into_bytes()
                        }),
                        false,
                    ),
                    'j' | 'J' => {
                        let mut obj = Map::new();
                        obj.insert("tst".into(), Value::String(m.at.json_tst()));
                        obj.insert("topic".into(), Value::String(p.topic.clone()));
                        obj.insert("qos".into(), json!(p.qos as u8));
                        obj.insert("retain".into(), json!(u8::from(p.retain)));
                        obj.insert("payloadlen".into(), json!(p.payload.len()));
                        if *conv == 'J' {
                            match serde_json::from_slice::<Value>(&p.payload) {
                                Ok(v) => {
                                    obj.insert("payload".into(), v);
                                }
                                Err(_) => {
                                    return Err(format!(
                                        "Error: Message payload is not valid JSON on topic {}",
                                        p.topic
                                    ))
                                }
                            }
                        } else {
                            obj.insert(
                                "payload".into(),
                                Value::String(String::from_utf8_lossy(&p.payload).into_owned()),
                            );
                        }
                        add_properties(&mut obj, props);
                        (
                            Some(self.json_text(&Value::Object(obj)).into_bytes()),
                            false,
                        )
                    }
                    _ => (None, false),
                };
                let Some(mut value) = value else {
                    return Ok(());
                };
                if let Some(max) = max {
                    if matches!(conv, 'C' | 'I' | 'R' | 't') && value.len() > *max {
                        value.truncate(*max);
                    }
                }
                let pad = width.saturating_sub(value.len());
                if pad == 0 {
                    out.extend_from_slice(&value);
                } else if *left {
                    out.extend_from_slice(&value);
                    out.resize(out.len() + pad, b' ');
                } else {
                    let fill = if *zero && is_number { b'0' } else { b' ' };
                    out.resize(out.len() + pad, fill);
                    out.extend_from_slice(&value);
                }
            }
        }
        Ok(())
    }
}

fn hex(b: &[u8], upper: bool) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for byte in b {
        if upper {
            s.push_str(&format!("{byte:02X}"));
        } else {
            s.push_str(&format!("{byte:02x}"));
        }
    }
    s
}

/// Parses a -F format: % parameters, @ strftime sequences, \ escapes.
fn parse_format(f: &str) -> Result<Vec<Piece>, String> {
    let chars: Vec<char> = f.chars().collect();
    let mut pieces = Vec::new();
    let mut lit = Vec::new();
    let mut i = 0;
    let flush = |lit: &mut Vec<u8>, pieces: &mut Vec<Piece>| {
        if !lit.is_empty() {
            pieces.push(Piece::Literal(std::mem::take(lit)));
        }
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '%' => {
                i += 1;
                let (mut zero, mut left) = (false, false);
                while let Some(&f) = chars.get(i) {
                    match f {
                        '0' => zero = true,
                        '-' => left = true,
                        _ => break,
                    }
                    i += 1;
                }
                let mut width = 0usize;
                while let Some(d) = chars.get(i).and_then(|c| c.to_digit(10)) {
                    width = width.saturating_mul(10).saturating_add(d as usize);
                    i += 1;
                }
                let mut max = None;
                if chars.get(i) == Some(&'.') {
                    i += 1;
                    let mut m = 0usize;
                    while let Some(d) = chars.get(i).and_then(|c| c.to_digit(10)) {
                        m = m.saturating_mul(10).saturating_add(d as usize);
                        i += 1;
                    }
                    max = Some(m);
                }
                let Some(&conv) = chars.get(i) else {
                    return Err(format!(
                        "-F {f}: the format ends in the middle of a % sequence"
                    ));
                };
                i += 1;
                if !"%tpxXlmqrIUACDEFRSPjJ".contains(conv) {
                    return Err(format!("-F {f}: unknown parameter %{conv}"));
                }
                flush(&mut lit, &mut pieces);
                pieces.push(Piece::Param {
                    conv,
                    zero: zero && !left,
                    left,
                    width,
                    max,
                });
            }
            '@' => {
                i += 1;
                let Some(&t) = chars.get(i) else {
                    return Err(format!("-F {f}: the format ends with @"));
                };
                i += 1;
                match t {
                    '@' => lit.push(b'@'),
                    'N' => {
                        flush(&mut lit, &mut pieces);
                        pieces.push(Piece::Nanos);
                    }
                    _ => {
                        flush(&mut lit, &mut pieces);
                        pieces.push(Piece::Time(t));
                    }
                }
            }
            '\\' => {
                i += 1;
                let Some(&e) = chars.get(i) else {
                    return Err(format!("-F {f}: the format ends with \\"));
                };
                i += 1;
                let b = match e {
                    '\\' => b'\\',
                    '0' => 0,
                    'a' => 0x07,
                    'e' => 0x1B,
                    'n' => b'\n',
                    'r' => b'\r',
                    't' => b'\t',
                    'v' => 0x0B,
                    _ => return Err(format!("-F {f}: unknown escape \\{e}")),
                };
                lit.push(b);
            }
            _ => {
                let mut buf = [0u8; 4];
                lit.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                i += 1;
            }
        }
    }
    flush(&mut lit, &mut pieces);
    Ok(pieces)
}

/// Text when the bytes are UTF-8, else base64: the value and its encoding's name.
fn text_or_base64(b: &[u8]) -> (String, &'static str) {
    match std::str::from_utf8(b) {
        Ok(s) => (s.to_string(), "utf-8"),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(b),
            "base64",
        ),
    }
}

/// Adds every MQTT 5 property present to a JSON object, named in snake case.
fn add_properties(obj: &mut Map<String, Value>, p: &Properties) {
    if let Some(v) = p.payload_format_indicator {
        obj.insert("payload_format_indicator".into(), json!(v));
    }
    if let Some(v) = p.message_expiry_interval {
        obj.insert("message_expiry_interval".into(), json!(v));
    }
    if let Some(v) = &p.content_type {
        obj.insert("content_type".into(), json!(v));
    }
    if let Some(v) = &p.response_topic {
        obj.insert("response_topic".into(), json!(v));
    }
    if let Some(v) = &p.correlation_data {
        let (text, encoding) = text_or_base64(v);
        obj.insert("correlation_data".into(), json!(text));
        obj.insert("correlation_data_encoding".into(), json!(encoding));
    }
    if let Some(v) = p.topic_alias {
        obj.insert("topic_alias".into(), json!(v));
    }
    if !p.subscription_identifiers.is_empty() {
        obj.insert(
            "subscription_identifiers".into(),
            json!(p.subscription_identifiers),
        );
    }
    if !p.user_properties.is_empty() {
        let pairs: Vec<Value> = p
            .user_properties
            .iter()
            .map(|(k, v)| json!([k, v]))
            .collect();
        obj.insert("user_properties".into(), Value::Array(pairs));
    }
}

/// The --json object of a message: topic, payload (UTF-8 text or base64, said by
/// payload_encoding), qos, retain, dup, packet_id (QoS 1 and 2), every MQTT 5 property
/// present, received_at (RFC 3339, UTC).
pub fn to_json(m: &Received) -> Value {
    let p = &m.publish;
    let mut obj = Map::new();
    obj.insert("topic".into(), json!(p.topic));
    let (payload, encoding) = text_or_base64(&p.payload);
    obj.insert("payload".into(), json!(payload));
    obj.insert("payload_encoding".into(), json!(encoding));
    obj.insert("qos".into(), json!(p.qos as u8));
    obj.insert("retain".into(), json!(p.retain));
    obj.insert("dup".into(), json!(p.dup));
    if p.packet_id != 0 {
        obj.insert("packet_id".into(), json!(p.packet_id));
    }
    add_properties(&mut obj, &p.properties);
    obj.insert("received_at".into(), json!(m.at.rfc3339()));
    Value::Object(obj)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mercurio_core::codec::QoS;

    fn message(payload: &[u8]) -> Received {
        let properties = Properties {
            content_type: Some("text/plain".into()),
            user_properties: vec![("a".into(), "1".into()), ("b".into(), "2".into())],
            ..Properties::default()
        };
        Received {
            publish: Publish {
                dup: false,
                qos: QoS::AtLeastOnce,
                retain: true,
                topic: "sensors/t1".into(),
                packet_id: 7,
                properties,
                payload: Bytes::copy_from_slice(payload),
            },
            at: Moment {
                secs: 1_470_818_943,
                nanos: 786_368_637,
            },
        }
    }

    fn printer(format: &str) -> Printer {
        Printer {
            style: Style::Format(parse_format(format).unwrap()),
            newline: false,
            pretty: false,
        }
    }

    #[test]
    fn format_parameters_as_mosquitto_sub() {
        let m = message(b"hi");
        let out = printer("%t %p %x %X %l %q %r %m %C %P %%")
            .render(&m)
            .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "sensors/t1 hi 6869 6869 2 1 1 7 text/plain a:1 b:2 %"
        );
        let out = printer("[%-12t][%12t][%05l][%.3t]\\t@@%U")
            .render(&m)
            .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[sensors/t1  ][  sensors/t1][00002][sen]\t@1470818943.786368637"
        );
    }

    #[test]
    fn format_errors_and_json_payloads() {
        assert!(parse_format("%z").is_err());
        assert!(parse_format("%").is_err());
        assert!(parse_format("\\q").is_err());
        assert!(printer("%J").render(&message(b"not json")).is_err());
        let out = printer("%J").render(&message(b"{\"x\":1}")).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["payload"]["x"], 1);
        assert_eq!(v["topic"], "sensors/t1");
    }

    #[test]
    fn json_says_how_the_payload_is_encoded() {
        let v = to_json(&message(b"hello"));
        assert_eq!(v["payload"], "hello");
        assert_eq!(v["payload_encoding"], "utf-8");
        assert_eq!(v["user_properties"], json!([["a", "1"], ["b", "2"]]));
        assert_eq!(v["received_at"], "2016-08-10T08:49:03.786368Z");
        let v = to_json(&message(&[0xff, 0x00]));
        assert_eq!(v["payload"], "/wA=");
        assert_eq!(v["payload_encoding"], "base64");
    }
}
