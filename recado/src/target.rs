//! From the connection flags (and -L URL) to where to connect and the CONNECT packet.

use std::sync::Arc;

use bytes::Bytes;
use mercurio_core::codec::{Connect, LastWill, ProtocolVersion, QoS};

use crate::cli::ConnArgs;
use crate::exit::Failure;
use crate::props::{self, PacketProperties};
use crate::tls::{Tls, TlsOptions};

/// Where and how to connect.
#[derive(Clone)]
pub struct Target {
    pub host: String,
    pub port: u16,
    pub tls: Option<Arc<Tls>>,
    /// The WebSocket path (ws:// or wss://), `None` for MQTT over TCP.
    pub websocket: Option<String>,
    /// The local address to connect from (-A).
    pub bind: Option<std::net::IpAddr>,
}

impl Target {
    /// "host:port" for messages.
    pub fn display(&self) -> String {
        let scheme = match (&self.websocket, &self.tls) {
            (Some(_), Some(_)) => "wss://",
            (Some(_), None) => "ws://",
            (None, Some(_)) => "mqtts://",
            (None, None) => "",
        };
        if self.host.contains(':') {
            format!("{scheme}[{}]:{}", self.host, self.port)
        } else {
            format!("{scheme}{}:{}", self.host, self.port)
        }
    }
}

/// Everything a command needs to open its connection.
pub struct Settings {
    pub target: Target,
    pub connect: Connect,
    pub properties: PacketProperties,
    /// The topic of an mqtt(s):// URL, if any.
    pub url_topic: Option<String>,
    pub debug: bool,
    pub quiet: bool,
}

/// Parses -V: mosquitto's spellings and short forms.
pub fn parse_version(v: &str) -> Result<ProtocolVersion, String> {
    match v.to_ascii_lowercase().as_str() {
        "mqttv31" | "31" | "3.1" => Ok(ProtocolVersion::V31),
        "mqttv311" | "311" | "3.1.1" => Ok(ProtocolVersion::V311),
        "mqttv5" | "5" | "5.0" => Ok(ProtocolVersion::V5),
        _ => Err(format!(
            "-V {v}: the protocol version is mqttv31, mqttv311 or mqttv5 (or 31, 311, 5)"
        )),
    }
}

/// A parsed -L URL.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Url {
    pub tls: bool,
    pub websocket: bool,
    pub username: Option<String>,
    pub password: Option<String>,
    pub host: String,
    pub port: Option<u16>,
    /// After the host: the topic (mqtt) or the path (ws), without the leading `/`.
    pub path: String,
}

/// Parses mqtt(s)://[user[:password]@]host[:port][/rest] and ws(s)://... .
pub fn parse_url(url: &str) -> Result<Url, String> {
    let bad = |why: &str| format!("-L {url}: {why}");
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| bad("expected mqtt://, mqtts://, ws:// or wss://"))?;
    let (tls, websocket) = match scheme.to_ascii_lowercase().as_str() {
        "mqtt" | "tcp" => (false, false),
        "mqtts" | "ssl" => (true, false),
        "ws" => (false, true),
        "wss" => (true, true),
        _ => return Err(bad("the scheme is mqtt, mqtts, ws or wss")),
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, ""),
    };
    let (userinfo, hostport) = match authority.rfind('@') {
        Some(i) => (Some(&authority[..i]), &authority[i + 1..]),
        None => (None, authority),
    };
    let (username, password) = match userinfo {
        None => (None, None),
        Some(u) => match u.split_once(':') {
            Some((user, pass)) => (Some(decode(user)), Some(decode(pass))),
            None => (Some(decode(u)), None),
        },
    };
    let (host, port) = if let Some(inner) = hostport.strip_prefix('[') {
        let (h, after) = inner
            .split_once(']')
            .ok_or_else(|| bad("unclosed [ in the host"))?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p.parse::<u16>().map_err(|_| bad("bad port"))?),
            None if after.is_empty() => None,
            None => return Err(bad("unexpected text after the host")),
        };
        (h.to_string(), port)
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (
                h.to_string(),
                Some(p.parse::<u16>().map_err(|_| bad("bad port"))?),
            ),
            None => (hostport.to_string(), None),
        }
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    Ok(Url {
        tls,
        websocket,
        username,
        password,
        host,
        port,
        path: decode(path),
    })
}

/// Percent-decoding of URL parts (%2F, %23, ...); invalid escapes are kept as written.
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(v) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Builds the connection settings of `command` ("sub", "pub", "rr") from its flags; every
/// error is a usage error.
pub fn settings(
    a: &ConnArgs,
    command: &str,
    allowed_properties: &[&str],
) -> Result<Settings, Failure> {
    let version = match &a.protocol_version {
        Some(v) => parse_version(v).map_err(Failure::usage)?,
        None => ProtocolVersion::V311,
    };
    let mut properties = props::parse(&a.property, allowed_properties).map_err(Failure::usage)?;
    if properties.any && !version.is_v5() {
        return Err(Failure::usage("-D gives MQTT 5 properties: add -V mqttv5"));
    }
    let url = a
        .url
        .as_deref()
        .map(parse_url)
        .transpose()
        .map_err(Failure::usage)?;
    let (mut host, mut port, mut username, mut password) = (
        a.host.clone(),
        a.port,
        a.username.clone(),
        a.password.clone(),
    );
    let mut url_topic = None;
    let mut websocket = None;
    let mut url_tls = false;
    if let Some(u) = url {
        host = Some(u.host);
        port = u.port.or(port);
        username = u.username.or(username);
        password = u.password.or(password);
        url_tls = u.tls;
        if u.websocket || a.ws {
            websocket = Some(format!(
                "/{}",
                if u.path.is_empty() { "mqtt" } else { &u.path }
            ));
        } else if !u.path.is_empty() {
            url_topic = Some(u.path);
        }
    }
    if a.ws && websocket.is_none() {
        websocket = Some("/mqtt".to_string());
    }
    let use_tls = url_tls
        || a.tls.tls
        || a.tls.cafile.is_some()
        || a.tls.cert.is_some()
        || a.tls.insecure
        || a.tls.tls_server_name.is_some()
        || a.tls.capath.is_some()
        || a.tls.tls_use_os_certs
        || a.tls.tls_version.is_some();
    let host = host.unwrap_or_else(|| "localhost".to_string());
    let port = port.unwrap_or(match (&websocket, use_tls) {
        (None, false) => 1883,
        (None, true) => 8883,
        (Some(_), false) => 80,
        (Some(_), true) => 443,
    });
    let tls = if use_tls {
        let server_name = a
            .tls
            .tls_server_name
            .clone()
            .unwrap_or_else(|| host.clone());
        Some(Arc::new(
            Tls::new(&TlsOptions {
                cafile: a.tls.cafile.as_deref(),
                capath: a.tls.capath.as_deref(),
                os_roots: a.tls.tls_use_os_certs,
                version: a.tls.tls_version.as_deref(),
                server_name: &server_name,
                cert: a.tls.cert.as_deref(),
                key: a.tls.key.as_deref(),
                insecure: a.tls.insecure,
                resume: true,
            })
            .map_err(Failure::usage)?,
        ))
    } else {
        None
    };
    let client_id = match (&a.id, &a.id_prefix) {
        (Some(id), _) => id.clone(),
        (None, Some(prefix)) => format!("{prefix}{}", std::process::id()),
        (None, None) => {
            if a.disable_clean_session {
                return Err(Failure::usage(
                    "-c resumes the session of a client identifier: give one with -i or -I",
                ));
            }
            format!("recado-{command}-{}", std::process::id())
        }
    };
    if version == ProtocolVersion::V31 && (client_id.is_empty() || client_id.len() > 23) {
        return Err(Failure::usage(
            "MQTT 3.1 client identifiers are 1 to 23 characters (-i)",
        ));
    }
    if let Some(x) = &a.session_expiry {
        let seconds = props::parse_session_expiry(x).map_err(Failure::usage)?;
        if !version.is_v5() {
            return Err(Failure::usage("-x is an MQTT 5 setting: add -V mqttv5"));
        }
        properties.connect.session_expiry_interval = Some(seconds);
    } else if a.disable_clean_session
        && version.is_v5()
        && properties.connect.session_expiry_interval.is_none()
    {
        // As mosquitto: -c in MQTT 5 keeps the session, which with no Session Expiry
        // Interval would end with the connection.
        properties.connect.session_expiry_interval = Some(u32::MAX);
    }
    if password.is_some() && username.is_none() && !version.is_v5() {
        return Err(Failure::usage(
            "a password needs a user name in MQTT 3.x (-u)",
        ));
    }
    let will = match &a.will.will_topic {
        None => {
            if !properties.will.is_empty() {
                return Err(Failure::usage("-D will ... needs --will-topic"));
            }
            None
        }
        Some(topic) => {
            if topic.is_empty() || topic.contains(['+', '#']) {
                return Err(Failure::usage(format!(
                    "--will-topic {topic}: a topic name, without wildcards"
                )));
            }
            Some(LastWill {
                topic: topic.clone(),
                payload: Bytes::from(a.will.will_payload.clone().unwrap_or_default()),
                qos: QoS::from_u8(a.will.will_qos).unwrap_or_default(),
                retain: a.will.will_retain,
                properties: properties.will.clone(),
            })
        }
    };
    let connect = Connect {
        protocol: version,
        clean_start: !a.disable_clean_session,
        keep_alive: a.keepalive,
        client_id,
        will,
        username,
        password: password.map(Bytes::from),
        properties: properties.connect.clone(),
    };
    Ok(Settings {
        target: Target {
            host,
            port,
            tls,
            websocket,
            bind: a.bind_address,
        },
        connect,
        properties,
        url_topic,
        debug: a.debug,
        quiet: a.quiet,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_in_mosquittos_shape() {
        let u = parse_url("mqtts://alice:s%40cret@broker.example:8884/a/b%2Fc").unwrap();
        assert!(u.tls && !u.websocket);
        assert_eq!(u.username.as_deref(), Some("alice"));
        assert_eq!(u.password.as_deref(), Some("s@cret"));
        assert_eq!(u.host, "broker.example");
        assert_eq!(u.port, Some(8884));
        assert_eq!(u.path, "a/b/c");
        let u = parse_url("ws://[::1]:9001/mqtt").unwrap();
        assert!(u.websocket && !u.tls);
        assert_eq!(u.host, "::1");
        assert_eq!(u.port, Some(9001));
        let u = parse_url("mqtt://localhost").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("localhost", None, "")
        );
        assert!(parse_url("http://x").is_err());
        assert!(parse_url("mqtt://x:notaport").is_err());
    }

    #[test]
    fn protocol_version_spellings() {
        assert_eq!(parse_version("mqttv31"), Ok(ProtocolVersion::V31));
        assert_eq!(parse_version("311"), Ok(ProtocolVersion::V311));
        assert_eq!(parse_version("mqttv5"), Ok(ProtocolVersion::V5));
        assert_eq!(parse_version("5"), Ok(ProtocolVersion::V5));
        assert!(parse_version("4").is_err());
    }
}
