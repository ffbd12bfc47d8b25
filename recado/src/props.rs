//! `-D COMMAND PROPERTY VALUE`: MQTT 5 properties as mosquitto's clients take them, sorted
//! into the packets they go in.

use bytes::Bytes;
use mercurio_core::codec::Properties;

/// The properties given with -D, per packet.
#[derive(Debug, Default, Clone)]
pub struct PacketProperties {
    pub connect: Properties,
    pub publish: Properties,
    pub subscribe: Properties,
    pub unsubscribe: Properties,
    pub disconnect: Properties,
    pub will: Properties,
    /// True when any -D was given.
    pub any: bool,
}

/// Which packets a command sends, so that -D for another one is refused.
pub const SUB_COMMANDS: &[&str] = &["connect", "subscribe", "unsubscribe", "disconnect", "will"];
/// See [`SUB_COMMANDS`].
pub const PUB_COMMANDS: &[&str] = &["connect", "publish", "disconnect", "will"];
/// See [`SUB_COMMANDS`].
pub const RR_COMMANDS: &[&str] = &["connect", "publish", "subscribe", "disconnect", "will"];

/// Parses the flat list of -D values (3 per property, 4 for user-property) for a command
/// that sends the packets `allowed`. Errors are one-line usage messages.
pub fn parse(values: &[String], allowed: &[&str]) -> Result<PacketProperties, String> {
    let mut out = PacketProperties::default();
    let mut i = 0;
    while i < values.len() {
        let (Some(command), Some(name), Some(value)) =
            (values.get(i), values.get(i + 1), values.get(i + 2))
        else {
            return Err("-D needs a command, a property and a value".into());
        };
        i += 3;
        let command = command.to_ascii_lowercase();
        if !allowed.contains(&command.as_str()) {
            return Err(format!(
                "-D {command}: not a packet this command sends (one of: {})",
                allowed.join(", ")
            ));
        }
        let props = match command.as_str() {
            "connect" => &mut out.connect,
            "publish" => &mut out.publish,
            "subscribe" => &mut out.subscribe,
            "unsubscribe" => &mut out.unsubscribe,
            "disconnect" => &mut out.disconnect,
            _ => &mut out.will,
        };
        let name = name.to_ascii_lowercase();
        if name == "user-property" {
            let Some(v) = values.get(i) else {
                return Err("-D ... user-property needs a name and a value".into());
            };
            i += 1;
            props.user_properties.push((value.clone(), v.clone()));
        } else {
            set(props, &command, &name, value)?;
        }
        out.any = true;
    }
    Ok(out)
}

/// Which commands each property may be given for (MQTT 5.0 section 2.2.2.2).
fn allowed_in(name: &str) -> &'static [&'static str] {
    match name {
        "content-type"
        | "correlation-data"
        | "message-expiry-interval"
        | "payload-format-indicator"
        | "response-topic" => &["publish", "will"],
        "topic-alias" => &["publish"],
        "will-delay-interval" => &["will"],
        "session-expiry-interval" => &["connect", "disconnect"],
        "maximum-packet-size"
        | "receive-maximum"
        | "request-problem-information"
        | "request-response-information"
        | "topic-alias-maximum" => &["connect"],
        "subscription-identifier" => &["subscribe"],
        _ => &[],
    }
}

fn set(props: &mut Properties, command: &str, name: &str, value: &str) -> Result<(), String> {
    let allowed = allowed_in(name);
    if allowed.is_empty() {
        return Err(format!("-D: unknown property {name}"));
    }
    if !allowed.contains(&command) {
        return Err(format!(
            "-D {command} {name}: {name} goes in {}",
            allowed.join(" or ")
        ));
    }
    let int = |max: u64| -> Result<u64, String> {
        match value.parse::<u64>() {
            Ok(v) if v <= max => Ok(v),
            _ => Err(format!(
                "-D {command} {name} {value}: a number from 0 to {max} is expected"
            )),
        }
    };
    let flag = || -> Result<u8, String> {
        match value {
            "0" => Ok(0),
            "1" => Ok(1),
            _ => Err(format!("-D {command} {name} {value}: 0 or 1 is expected")),
        }
    };
    match name {
        "content-type" => props.content_type = Some(value.to_string()),
        "correlation-data" => props.correlation_data = Some(Bytes::from(value.to_string())),
        "response-topic" => props.response_topic = Some(value.to_string()),
        "message-expiry-interval" => {
            props.message_expiry_interval = Some(int(u32::MAX as u64)? as u32)
        }
        "payload-format-indicator" => props.payload_format_indicator = Some(flag()?),
        "topic-alias" => {
            let v = int(u16::MAX as u64)? as u16;
            if v == 0 {
                return Err("-D publish topic-alias 0: a topic alias is 1 or more".into());
            }
            props.topic_alias = Some(v)
        }
        "will-delay-interval" => props.will_delay_interval = Some(int(u32::MAX as u64)? as u32),
        "session-expiry-interval" => {
            props.session_expiry_interval = Some(int(u32::MAX as u64)? as u32)
        }
        "maximum-packet-size" => {
            let v = int(u32::MAX as u64)? as u32;
            if v == 0 {
                return Err("-D connect maximum-packet-size 0: 1 or more is expected".into());
            }
            props.maximum_packet_size = Some(v)
        }
        "receive-maximum" => {
            let v = int(u16::MAX as u64)? as u16;
            if v == 0 {
                return Err("-D connect receive-maximum 0: 1 or more is expected".into());
            }
            props.receive_maximum = Some(v)
        }
        "request-problem-information" => props.request_problem_information = Some(flag()?),
        "request-response-information" => props.request_response_information = Some(flag()?),
        "topic-alias-maximum" => props.topic_alias_maximum = Some(int(u16::MAX as u64)? as u16),
        "subscription-identifier" => {
            let v = int(268_435_455)? as u32;
            if v == 0 {
                return Err("-D subscribe subscription-identifier 0: 1 or more is expected".into());
            }
            props.subscription_identifiers = vec![v]
        }
        _ => return Err(format!("-D: unknown property {name}")),
    }
    Ok(())
}

/// Parses -x: seconds, or -1 / 4294967295 / ∞ for a session that never expires.
pub fn parse_session_expiry(value: &str) -> Result<u32, String> {
    match value {
        "-1" | "∞" | "inf" | "infinity" => Ok(u32::MAX),
        _ => value
            .parse::<u32>()
            .map_err(|_| format!("-x {value}: seconds from 0 to 4294967295, or -1 or ∞ for never")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn sorts_properties_into_their_packets() {
        let p = parse(
            &strings(&[
                "publish",
                "user-property",
                "k",
                "v",
                "connect",
                "session-expiry-interval",
                "60",
                "publish",
                "content-type",
                "text/plain",
            ]),
            PUB_COMMANDS,
        )
        .unwrap();
        assert_eq!(p.publish.user_properties, vec![("k".into(), "v".into())]);
        assert_eq!(p.publish.content_type.as_deref(), Some("text/plain"));
        assert_eq!(p.connect.session_expiry_interval, Some(60));
        assert!(p.any);
    }

    #[test]
    fn refuses_a_property_in_the_wrong_packet_or_a_packet_not_sent() {
        assert!(parse(&strings(&["connect", "topic-alias", "1"]), PUB_COMMANDS).is_err());
        assert!(parse(
            &strings(&["subscribe", "user-property", "a", "b"]),
            PUB_COMMANDS
        )
        .is_err());
        assert!(parse(&strings(&["publish", "receive-maximum", "0"]), PUB_COMMANDS).is_err());
        assert!(parse(&strings(&["publish", "nope", "0"]), PUB_COMMANDS).is_err());
    }

    #[test]
    fn session_expiry_spellings() {
        assert_eq!(parse_session_expiry("-1"), Ok(u32::MAX));
        assert_eq!(parse_session_expiry("∞"), Ok(u32::MAX));
        assert_eq!(parse_session_expiry("60"), Ok(60));
        assert!(parse_session_expiry("x").is_err());
    }
}
