//! The broker's configuration, as the daemon reads it from TOML and as an embedding
//! application builds it in code (DESIGN.md section 4).
//!
//! Every struct denies unknown keys, so a misspelt key is an error naming it (the daemon adds
//! the line). Defaults are those of the no-file mode: one MQTT listener on 127.0.0.1:1883 and
//! anonymous clients allowed. [`Config::validate`] checks ranges and combinations.

use std::path::PathBuf;

use serde::Deserialize;

/// The whole configuration: `[server]`, `[[listeners]]`, `[auth]`, `[storage]`, `[logging]`,
/// `[admin]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub listeners: Vec<ListenerConfig>,
    pub auth: AuthConfig,
    pub storage: StorageConfig,
    pub logging: LoggingConfig,
    pub admin: AdminConfig,
}

impl Default for Config {
    /// The no-file mode: 127.0.0.1:1883, anonymous clients allowed, memory storage.
    fn default() -> Self {
        Config {
            server: ServerConfig::default(),
            listeners: vec![ListenerConfig::default()],
            auth: AuthConfig {
                allow_anonymous: Some(true),
                ..AuthConfig::default()
            },
            storage: StorageConfig::default(),
            logging: LoggingConfig::default(),
            admin: AdminConfig::default(),
        }
    }
}

/// `[server]`: limits and protocol options that apply to every listener.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Most clients connected at once over all listeners; 0 = unlimited (default).
    pub max_connections: u32,
    /// Seconds a new connection has to send CONNECT (and finish TLS); default 10.
    pub connect_timeout: u64,
    /// Largest packet accepted, in bytes, 1 to 268,435,455; default 1,048,576.
    pub max_packet_size: u32,
    /// Longest keep alive granted, in seconds (5.0: Server Keep Alive); default 65,535.
    pub max_keepalive: u16,
    /// QoS 1/2 PUBLISH a client may have unacknowledged towards the broker (5.0 Receive
    /// Maximum), 1 to 65,535; default 1024.
    pub receive_maximum: u16,
    /// Outbound QoS 1/2 messages in flight per client, 1 to 65,535; default 20.
    pub max_inflight: u16,
    /// Highest QoS accepted and granted, 0 to 2; default 2.
    pub max_qos: u8,
    /// Whether retained messages are kept; default true.
    pub retain_available: bool,
    /// Allowed client identifier prefixes; empty (default) allows any.
    pub clientid_prefixes: Vec<String>,
    /// Messages queued per session before any is dropped; default 10,000.
    pub max_queued_messages: usize,
    /// QoS 0 messages are dropped once a queue holds this many messages; default 1,000.
    pub max_queued_qos0_messages: usize,
    /// Payload bytes queued per session before any is dropped; 0 = unlimited (default).
    pub max_queued_bytes: u64,
    /// Seconds a 3.x persistent session (clean session 0) outlives its connection; 0 = forever
    /// (default).
    pub persistent_client_expiration: u64,
    /// Most retained messages kept; 0 = unlimited (default).
    pub max_retained_messages: usize,
    /// Seconds between `$SYS` updates; default 10.
    pub sys_interval: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_connections: 0,
            connect_timeout: 10,
            max_packet_size: 1_048_576,
            max_keepalive: 65_535,
            receive_maximum: 1024,
            max_inflight: 20,
            max_qos: 2,
            retain_available: true,
            clientid_prefixes: Vec::new(),
            max_queued_messages: 10_000,
            max_queued_qos0_messages: 1_000,
            max_queued_bytes: 0,
            persistent_client_expiration: 0,
            max_retained_messages: 0,
            sys_interval: 10,
        }
    }
}

/// The protocol a listener speaks.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ListenerProtocol {
    /// MQTT over TCP (default).
    #[default]
    Mqtt,
    /// MQTT over WebSocket, plus the HTTP endpoints.
    Websocket,
}

/// One `[[listeners]]` entry.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerConfig {
    /// Address to bind; default "127.0.0.1".
    pub host: String,
    /// Port to bind; 0 picks a free one. Default 1883.
    pub port: u16,
    pub protocol: ListenerProtocol,
    /// Most clients on this listener at once; 0 = unlimited (default).
    pub max_connections: u32,
    /// PEM certificate chain; setting it turns TLS on.
    pub cert_file: Option<PathBuf>,
    /// PEM private key for `cert_file`.
    pub key_file: Option<PathBuf>,
    /// PEM CA certificates that client certificates are checked against.
    pub ca_file: Option<PathBuf>,
    /// Refuse clients without a valid certificate; default false.
    pub require_certificate: bool,
    /// Answer GET /healthz (websocket only); default false.
    pub health: bool,
    /// Answer GET /metrics (websocket only); default false.
    pub metrics: bool,
    /// Directory of static files served over HTTP (websocket only).
    pub http_dir: Option<PathBuf>,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        ListenerConfig {
            host: "127.0.0.1".to_string(),
            port: 1883,
            protocol: ListenerProtocol::Mqtt,
            max_connections: 0,
            cert_file: None,
            key_file: None,
            ca_file: None,
            require_certificate: false,
            health: false,
            metrics: false,
            http_dir: None,
        }
    }
}

/// `[auth]`.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Whether clients without a user name may connect. Unset means true in the no-file mode
    /// and false when a configuration file is used (as mosquitto 2 does).
    pub allow_anonymous: Option<bool>,
    /// mosquitto_passwd file.
    pub password_file: Option<PathBuf>,
    /// mosquitto ACL file.
    pub acl_file: Option<PathBuf>,
}

/// Storage backends.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum StorageBackend {
    /// Everything in memory, lost at stop (default).
    #[default]
    Memory,
    Sqlite,
    Postgres,
}

/// `[storage]`.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    pub backend: StorageBackend,
    /// SQLite database file.
    pub path: Option<PathBuf>,
    /// PostgreSQL connection URL.
    pub url: Option<String>,
    /// Wait as a standby for the serving broker (PostgreSQL); default false.
    pub standby: bool,
    /// Acknowledge QoS 1/2 only after the commit; default false.
    pub durable_ack: bool,
}

/// `[logging]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingConfig {
    /// tracing filter directives, e.g. "info,mercurio::connections=warn"; default "info".
    pub level: String,
    /// Append log lines to this file.
    pub file: Option<PathBuf>,
    /// Send log lines to syslog (/dev/log, facility daemon); default false.
    pub syslog: bool,
    /// Log each connection and disconnection; default true.
    pub connection_messages: bool,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig {
            level: "info".to_string(),
            file: None,
            syslog: false,
            connection_messages: true,
        }
    }
}

/// `[admin]`.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Unix socket for mercurioctl.
    pub socket: Option<PathBuf>,
}
