//! `[[bridges]]`: a bridge to another broker as the configuration holds it, and its checks
//! (docs/bridges.md lists every key).

use std::path::PathBuf;

use serde::Deserialize;

use super::ConfigError;

/// The MQTT version a bridge speaks to its remote broker.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
pub enum BridgeProtocol {
    /// MQTT 5.0: No Local and the hop marker keep meshes loop-free.
    #[serde(rename = "mqttv5")]
    Mqttv5,
    /// MQTT 3.1.1 (default, as mosquitto's bridges), with `try_private` toward mosquitto.
    #[default]
    #[serde(rename = "mqttv311")]
    Mqttv311,
}

/// Which way a bridge topic's messages travel.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum BridgeDirection {
    /// Remote to local.
    In,
    /// Local to remote (default).
    #[default]
    Out,
    /// Both ways.
    Both,
}

impl BridgeDirection {
    /// True for `in` and `both`.
    pub fn is_in(self) -> bool {
        matches!(self, BridgeDirection::In | BridgeDirection::Both)
    }

    /// True for `out` and `both`.
    pub fn is_out(self) -> bool {
        matches!(self, BridgeDirection::Out | BridgeDirection::Both)
    }
}

/// One `[[bridges.topics]]` entry: which messages cross the bridge, and how their topics are
/// rewritten. The local topic `local_prefix + T` is the remote topic `remote_prefix + T`, for
/// every topic `T` matching `pattern`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BridgeTopic {
    /// Topic filter, without the prefixes (wildcards allowed), e.g. `sensors/#`.
    pub pattern: String,
    /// `in`, `out` (default) or `both`.
    #[serde(default)]
    pub direction: BridgeDirection,
    /// The highest QoS used across the bridge for this pattern, 0 to 2; default 0. A message
    /// crosses with the lower of its own QoS and this.
    #[serde(default)]
    pub qos: u8,
    /// Prepended to the pattern on this broker; default empty.
    #[serde(default)]
    pub local_prefix: String,
    /// Prepended to the pattern on the remote broker; default empty.
    #[serde(default)]
    pub remote_prefix: String,
}

/// One `[[bridges]]` entry: a connection to another broker, made by this broker as a client
/// (mosquitto's bridge concepts, under these names).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BridgeConfig {
    /// Unique name of the bridge (letters, digits, `-`, `_`, `.`): what `mercurioctl bridge`
    /// and the logs call it.
    pub name: String,
    /// `host:port` of the remote broker (port 1883 when left out, 8883 with TLS), tried in
    /// order.
    pub addresses: Vec<String>,
    /// After a connection to another address ends, go on with the next one (true) or start
    /// again from the first (false, default).
    #[serde(default)]
    pub round_robin: bool,
    /// The client identifier used on the remote broker; default the bridge's `name`. The
    /// `$SYS/broker/connection/<client_id>/state` topic uses it.
    #[serde(default)]
    pub client_id: Option<String>,
    /// `"mqttv311"` (default) or `"mqttv5"`.
    #[serde(default)]
    pub protocol_version: BridgeProtocol,
    /// Clean Start (clean session in 3.1.1) on the remote broker; default false.
    #[serde(default)]
    pub clean_start: bool,
    /// Keep alive on the remote connection, seconds, 5 to 65,535; default 60.
    #[serde(default = "default_bridge_keepalive")]
    pub keepalive: u16,
    /// QoS 1/2 messages sent to the remote and not yet acknowledged, at most, 1 to 65,535
    /// (the remote's Receive Maximum lowers it); default 100.
    #[serde(default = "default_bridge_inflight")]
    pub max_inflight: u16,
    /// User name on the remote broker.
    #[serde(default)]
    pub username: Option<String>,
    /// Password on the remote broker; needs `username`.
    #[serde(default)]
    pub password: Option<String>,
    /// A file holding the password on the remote broker instead (its contents without one
    /// trailing newline), so that the main configuration file need not hold it; read with
    /// the broker's permissions at start and at each SIGHUP reload. Needs `username`;
    /// exclusive with `password`.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// PEM CA certificates the remote's certificate is checked against; setting it turns TLS
    /// on.
    #[serde(default)]
    pub cafile: Option<PathBuf>,
    /// PEM client certificate chain presented to the remote; needs `cafile` and `keyfile`.
    #[serde(default)]
    pub certfile: Option<PathBuf>,
    /// PEM private key of `certfile`.
    #[serde(default)]
    pub keyfile: Option<PathBuf>,
    /// The name the remote's certificate must carry; default the host of the address.
    #[serde(default)]
    pub tls_server_name: Option<String>,
    /// Over MQTT 3.1.1, announce the connection as a bridge (protocol level with 0x80, as
    /// mosquitto's `try_private`), so that a mosquitto remote does not send the bridge's own
    /// messages back; a remote refusing it is connected to again without. Default true.
    #[serde(default = "default_true")]
    pub try_private: bool,
    /// Publish the bridge's state, retained `1` or `0`, on `notification_topic` (locally
    /// and on the remote, where it is also the bridge's will); default true.
    #[serde(default = "default_true")]
    pub notifications: bool,
    /// Where the remote gets the state; default `$SYS/broker/connection/<client_id>/state`
    /// (what mosquitto and Mercurio accept from a bridge; a remote that refuses `$SYS`
    /// publishes needs another topic here). Locally the state is always on that `$SYS` topic.
    #[serde(default)]
    pub notification_topic: Option<String>,
    /// Messages the bridge's outgoing queue holds (those in flight not counted) before any is
    /// dropped (counted in the bridge's `dropped`); 0 = unlimited. Default 1,000,000: six
    /// hours of an outage at 46 messages a second. The bridge's own limit, in place of
    /// `[server] max_queued_messages`, which stays that of the other sessions.
    #[serde(default = "default_bridge_queued_messages")]
    pub max_queued_messages: usize,
    /// Bytes the bridge's outgoing queue holds (topic, properties and payload of each
    /// message, as `[server] max_queued_bytes` counts them) before any is dropped; 0 =
    /// unlimited. Default 256 MiB: the default message count at about 270 bytes each. The
    /// bridge's own limit, in place of `[server] max_queued_bytes`.
    #[serde(default = "default_bridge_queued_bytes")]
    pub max_queued_bytes: u64,
    /// Largest packet accepted from the remote, bytes, fixed header included: 14 to
    /// 268,435,455, or 0 for the protocol's 268,435,455; default `[server] max_packet_size`.
    /// A larger packet closes the link from its fixed header, before its body is read (and
    /// the bridge connects again after its pause); an MQTT 5 remote is told the limit
    /// (Maximum Packet Size in CONNECT).
    #[serde(default)]
    pub max_packet_size: Option<u32>,
    /// What crosses the bridge, at least one entry.
    pub topics: Vec<BridgeTopic>,
}

/// Default of [`BridgeConfig::max_queued_messages`].
pub const DEFAULT_BRIDGE_QUEUED_MESSAGES: usize = 1_000_000;
/// Default of [`BridgeConfig::max_queued_bytes`], bytes.
pub const DEFAULT_BRIDGE_QUEUED_BYTES: u64 = 256 * 1024 * 1024;

fn default_bridge_queued_messages() -> usize {
    DEFAULT_BRIDGE_QUEUED_MESSAGES
}

fn default_bridge_queued_bytes() -> u64 {
    DEFAULT_BRIDGE_QUEUED_BYTES
}

fn default_bridge_keepalive() -> u16 {
    60
}

fn default_bridge_inflight() -> u16 {
    100
}

fn default_true() -> bool {
    true
}

impl BridgeConfig {
    /// The largest packet accepted from the remote, bytes: `max_packet_size` (0: the
    /// protocol's largest), or `server_max` (the broker's `[server] max_packet_size`, 0 read
    /// the same way).
    pub fn max_incoming_packet(&self, server_max: u32) -> u32 {
        match self.max_packet_size.unwrap_or(server_max) {
            0 => super::MAX_PACKET_SIZE_LIMIT,
            m => m,
        }
    }

    /// The client identifier on the remote: `client_id`, or the bridge's name.
    pub fn remote_client_id(&self) -> &str {
        self.client_id.as_deref().unwrap_or(&self.name)
    }

    /// The local state topic, `$SYS/broker/connection/<client_id>/state`.
    pub fn state_topic(&self) -> String {
        format!("$SYS/broker/connection/{}/state", self.remote_client_id())
    }

    /// Where the remote gets the state: `notification_topic` or the local state topic.
    pub fn remote_state_topic(&self) -> String {
        self.notification_topic
            .clone()
            .unwrap_or_else(|| self.state_topic())
    }

    /// True when TLS is used toward the remote (`cafile` set).
    pub fn tls(&self) -> bool {
        self.cafile.is_some()
    }

    /// Checks one bridge, `bridges[index]`, after those before it (`earlier`).
    pub(super) fn validate(
        &self,
        index: usize,
        earlier: &[BridgeConfig],
    ) -> Result<(), ConfigError> {
        let key = |name: &str| format!("bridges[{index}].{name}");
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(ConfigError::new(
                key("name"),
                format!(
                    "{:?}: must be letters, digits, '-', '_' or '.', and not empty",
                    self.name
                ),
            ));
        }
        if let Some(j) = earlier.iter().position(|b| b.name == self.name) {
            return Err(ConfigError::new(
                key("name"),
                format!("{:?} is already used by bridges[{j}]", self.name),
            ));
        }
        if let Some(j) = earlier
            .iter()
            .position(|b| b.remote_client_id() == self.remote_client_id())
        {
            return Err(ConfigError::new(
                key("client_id"),
                format!(
                    "{:?} is already used by bridges[{j}] (the $SYS state topic names it)",
                    self.remote_client_id()
                ),
            ));
        }
        let id = self.remote_client_id();
        if id.is_empty() || id.len() > 65_535 || id.contains(['+', '#', '/']) {
            return Err(ConfigError::new(
                key("client_id"),
                format!("{id:?}: must not be empty nor contain '/', '+' or '#'"),
            ));
        }
        if self.addresses.is_empty() {
            return Err(ConfigError::new(
                key("addresses"),
                "needs at least one \"host:port\"",
            ));
        }
        for (j, a) in self.addresses.iter().enumerate() {
            if let Err(e) = parse_address(a, 1883) {
                return Err(ConfigError::new(
                    format!("bridges[{index}].addresses[{j}]"),
                    e,
                ));
            }
        }
        use super::ranges::{BRIDGE_KEEPALIVE, BRIDGE_MAX_INFLIGHT, BRIDGE_MAX_PACKET_SIZE};
        BRIDGE_KEEPALIVE.check_at(key("keepalive"), self.keepalive)?;
        BRIDGE_MAX_INFLIGHT.check_at(key("max_inflight"), self.max_inflight)?;
        if let Some(m) = self.max_packet_size {
            BRIDGE_MAX_PACKET_SIZE.check_at(key("max_packet_size"), m)?;
        }
        if self.password.is_some() && self.username.is_none() {
            return Err(ConfigError::new(key("password"), "needs username as well"));
        }
        if self.password_file.is_some() {
            if self.password.is_some() {
                return Err(ConfigError::new(
                    key("password_file"),
                    "set password or password_file, not both",
                ));
            }
            if self.username.is_none() {
                return Err(ConfigError::new(
                    key("password_file"),
                    "needs username as well",
                ));
            }
        }
        if self.cafile.is_none() {
            for (set, name) in [
                (self.certfile.is_some(), "certfile"),
                (self.keyfile.is_some(), "keyfile"),
                (self.tls_server_name.is_some(), "tls_server_name"),
            ] {
                if set {
                    return Err(ConfigError::new(key(name), "needs cafile (TLS)"));
                }
            }
        }
        match (&self.certfile, &self.keyfile) {
            (Some(_), None) => {
                return Err(ConfigError::new(key("certfile"), "needs keyfile as well"))
            }
            (None, Some(_)) => {
                return Err(ConfigError::new(key("keyfile"), "needs certfile as well"))
            }
            _ => {}
        }
        if let Some(t) = &self.notification_topic {
            if crate::topic::validate_topic_name(t).is_err() {
                return Err(ConfigError::new(
                    key("notification_topic"),
                    format!("{t:?} is not a valid topic name"),
                ));
            }
        }
        if self.topics.is_empty() {
            return Err(ConfigError::new(
                key("topics"),
                "needs at least one [[bridges.topics]] entry",
            ));
        }
        for (j, t) in self.topics.iter().enumerate() {
            let key = |name: &str| format!("bridges[{index}].topics[{j}].{name}");
            super::ranges::BRIDGE_TOPIC_QOS.check_at(key("qos"), t.qos)?;
            for (prefix, name) in [
                (&t.local_prefix, "local_prefix"),
                (&t.remote_prefix, "remote_prefix"),
            ] {
                if prefix.contains(['+', '#']) {
                    return Err(ConfigError::new(
                        key(name),
                        format!("{prefix:?}: must not contain wildcards"),
                    ));
                }
            }
            for (prefix, name) in [
                (&t.local_prefix, "local_prefix"),
                (&t.remote_prefix, "remote_prefix"),
            ] {
                let filter = format!("{prefix}{}", t.pattern);
                if t.pattern.is_empty()
                    || crate::topic::validate_topic_filter(&filter).is_err()
                    || filter.starts_with("$share/")
                {
                    return Err(ConfigError::new(
                        key(if prefix.is_empty() { "pattern" } else { name }),
                        format!("{filter:?} is not a valid topic filter"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// `host:port` (or `[v6]:port`, or a host alone, meaning `default_port`) into its parts.
pub fn parse_address(address: &str, default_port: u16) -> Result<(String, u16), String> {
    let a = address.trim();
    let (host, port) = if let Some(rest) = a.strip_prefix('[') {
        match rest.split_once(']') {
            Some((h, "")) => (h, None),
            Some((h, p)) => match p.strip_prefix(':') {
                Some(p) => (h, Some(p)),
                None => return Err(format!("{address:?}: expected [address]:port")),
            },
            None => return Err(format!("{address:?}: missing ']'")),
        }
    } else {
        match a.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h, Some(p)),
            Some(_) => (a, None),
            None => (a, None),
        }
    };
    if host.is_empty() {
        return Err(format!("{address:?}: expected \"host:port\""));
    }
    let port = match port {
        None => default_port,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(format!("{address:?}: the port must be 1 to 65535")),
        },
    };
    Ok((host.to_string(), port))
}
