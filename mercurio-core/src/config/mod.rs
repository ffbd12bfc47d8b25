//! The broker's configuration, as the daemon reads it from TOML and as an embedding
//! application builds it in code (docs/configuration.md).
//!
//! Every struct denies unknown keys, so a misspelt key is an error naming it (the daemon adds
//! the line). Defaults are those of the no-file mode: one MQTT listener on 127.0.0.1:1883 and
//! anonymous clients allowed. [`Config::validate`] checks ranges and combinations.

use std::path::PathBuf;

use serde::Deserialize;

mod bridges;
mod cidr;
mod cluster;
pub mod log_targets;
pub mod ranges;
mod streams;
pub use bridges::{
    parse_address, BridgeConfig, BridgeDirection, BridgeProtocol, BridgeTopic,
    DEFAULT_BRIDGE_QUEUED_BYTES, DEFAULT_BRIDGE_QUEUED_MESSAGES,
};
pub use cidr::Cidr;
pub use cluster::{ClusterConfig, DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_SUBJECT_PREFIX};
pub use streams::{valid_name as valid_stream_name, StreamConfig};

/// The whole configuration: `[server]`, `[[listeners]]`, `[[bridges]]`, `[[streams]]`,
/// `[auth]`, `[storage]`, `[logging]`, `[admin]`, `[cluster]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub listeners: Vec<ListenerConfig>,
    /// Bridges to other brokers (none by default); see [`BridgeConfig`].
    pub bridges: Vec<BridgeConfig>,
    /// Streams, named logs of the messages matching a filter (none by default); see
    /// [`StreamConfig`] and docs/streams.md.
    pub streams: Vec<StreamConfig>,
    pub auth: AuthConfig,
    pub storage: StorageConfig,
    pub logging: LoggingConfig,
    pub admin: AdminConfig,
    /// Cluster mode (off by default); see [`ClusterConfig`].
    pub cluster: ClusterConfig,
}

impl Default for Config {
    /// The no-file mode: 127.0.0.1:1883, anonymous clients allowed, memory storage.
    fn default() -> Self {
        Config {
            server: ServerConfig::default(),
            listeners: vec![ListenerConfig::default()],
            bridges: Vec::new(),
            streams: Vec::new(),
            auth: AuthConfig {
                allow_anonymous: Some(true),
                ..AuthConfig::default()
            },
            storage: StorageConfig::default(),
            logging: LoggingConfig::default(),
            admin: AdminConfig::default(),
            cluster: ClusterConfig::default(),
        }
    }
}

/// `[server]`: limits and protocol options that apply to every listener.
///
/// Every limit's 0 means unlimited, as in mosquitto: the largest value the limit can take
/// ([`ServerConfig::resolved`] says which), never "nothing allowed".
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Most clients connected at once over all listeners; 0 = unlimited (default).
    pub max_connections: u32,
    /// Seconds a new connection has to send CONNECT (and finish TLS); default 10.
    pub connect_timeout: u64,
    /// Seconds a plain TCP connection may stay idle (no byte read or written) before it is
    /// parked: its task ends and the broker keeps only its socket and a small record until
    /// the client sends, a message is due or the connection must close. A new connection
    /// parks as soon as it has answered its CONNECT, without waiting. 0 = never (new
    /// connections included); default 10.
    pub park_after: u64,
    /// Largest packet accepted, in bytes, 14 (the smallest CONNECT) to 268,435,455, or 0 for
    /// the protocol's limit (268,435,455); default 1,048,576.
    pub max_packet_size: u32,
    /// Longest keep alive granted, in seconds; 0 = unlimited (default). When set, a keep alive
    /// above it or of 0 (none) is over the limit: 5.0 clients are told this one (Server Keep
    /// Alive), 3.x clients are refused with "identifier rejected", as mosquitto 2.0.12+ does.
    pub max_keepalive: u16,
    /// QoS 1/2 PUBLISH a client may have unacknowledged towards the broker (5.0 Receive
    /// Maximum), 1 to 65,535, or 0 for 65,535; default 1024.
    pub receive_maximum: u16,
    /// Outbound QoS 1/2 messages in flight per client, 1 to 65,535, or 0 for 65,535; default 20.
    pub max_inflight: u16,
    /// Highest QoS accepted and granted, 0 to 2; default 2.
    pub max_qos: u8,
    /// Whether retained messages are kept; default true.
    pub retain_available: bool,
    /// Whether a retained message is delivered to a new subscription only if its publisher
    /// may still publish it (mosquitto's option of that name): its client identifier, user
    /// name and listener are kept with it (in storage too) and the access rules are asked
    /// again, for a write, at each delivery on subscribe. Default false: only the
    /// subscriber's read access is checked. Read at start.
    pub check_retain_source: bool,
    /// Whether a message goes out at the QoS of the subscription it matched even when it was
    /// published at a lower one (mosquitto's option of that name). Default false: it goes out
    /// at the lower of the two, as MQTT requires ([MQTT-3.8.4-6], 5.0 section 3.8.4); true
    /// departs from the specification. Read at start.
    pub upgrade_outgoing_qos: bool,
    /// Allowed client identifier prefixes; empty (default) allows any.
    pub clientid_prefixes: Vec<String>,
    /// Messages queued per session before any is dropped; 0 = unlimited; default 10,000.
    pub max_queued_messages: usize,
    /// QoS 0 messages are dropped once a queue holds this many messages; 0 = unlimited;
    /// default 1,000.
    pub max_queued_qos0_messages: usize,
    /// Bytes queued per session (topic, properties and payload of each message) before any
    /// is dropped; 0 = unlimited. Default 16 MiB.
    pub max_queued_bytes: u64,
    /// Bytes all sessions' queues may hold in memory together (each queued delivery counted
    /// as `max_queued_bytes` counts it: a message queued for 3 sessions counts 3 times);
    /// 0 = no limit (default), else at least [`MIN_QUEUED_MEMORY`]. Over it, publishers are
    /// slowed as for a queue at its high-water mark; with the memory backend, past
    /// `stall_time`, queued QoS 0 messages, then the oldest queued messages of offline
    /// sessions (the longest offline first) are dropped until the total is back under it;
    /// with a storage backend, offline sessions' queues are left in storage instead (read
    /// back when their clients return), and nothing is dropped.
    pub max_queued_memory: u64,
    /// Back pressure: a session with this many queued messages is over its high-water mark,
    /// and publishers routing into it wait (stop reading) until it is back under half of it,
    /// unless it is stalled. QoS 0 messages count a quarter each (fewer when
    /// `max_queued_qos0_messages` is below 8 times the mark). Capped at half of
    /// `max_queued_messages` and of `max_queued_qos0_messages`. At least 1; default 100.
    pub queue_high_water: usize,
    /// Back pressure by size: the high-water mark in queued bytes (counted as for
    /// `max_queued_bytes`, and capped at half of it). At least 1; default 1 MiB.
    pub queue_high_water_bytes: u64,
    /// Seconds a client with queued messages may take none before it counts as stalled: a
    /// stalled session no longer holds publishers back (its queue drops at its limits), and a
    /// connection whose client stopped reading its socket while its answers pile up is
    /// closed after this long. At least 1; default 2.
    pub stall_time: u64,
    /// Seconds a 3.x persistent session (clean session 0) outlives its connection; 0 = forever
    /// (default).
    pub persistent_client_expiration: u64,
    /// Most retained messages kept; 0 = unlimited (default).
    pub max_retained_messages: usize,
    /// Most bytes all retained messages take together (the topic, payload and properties of
    /// each, as `max_queued_bytes` counts them); 0 = unlimited, else at least
    /// [`MIN_RETAINED_BYTES`]. A retained message that would take the total over it is
    /// delivered but not kept. Default 64 MiB.
    pub max_retained_bytes: u64,
    /// Seconds between `$SYS` updates; 0 turns `$SYS` off (as in mosquitto); default 10.
    pub sys_interval: u64,
    /// Most levels in a topic name or filter (`a/b/c` has 3); 0 = unlimited; default 201, the
    /// most mosquitto accepts (it refuses more than 200 `/` separators), so a client that
    /// works with mosquitto never meets it. A PUBLISH or will over it is refused as an invalid
    /// topic name (0x90), a SUBSCRIBE filter gets 0x8F (3.x: 0x80).
    pub max_topic_levels: usize,
    /// Most subscriptions one session holds; 0 = unlimited; default 10,000. A SUBSCRIBE
    /// filter over it gets 0x97 Quota exceeded (3.x: 0x80); replacing a subscription always
    /// works.
    pub max_subscriptions_per_client: usize,
    /// Whether a client may connect with an empty client identifier (then assigned one in
    /// 5.0, as 3.1.1 allows with clean session); false refuses it with CONNACK 0x85 (5.0) /
    /// 2 "identifier rejected" (3.x). Default true (mosquitto's key).
    pub allow_zero_length_clientid: bool,
    /// Largest PUBLISH payload accepted, in bytes; a larger one is acknowledged as usual and
    /// dropped (mosquitto's `message_size_limit`). 0 = no limit beyond `max_packet_size`
    /// (default).
    pub message_size_limit: u32,
    /// PUBLISH packets per second one connection may send; 0 = unlimited (default). A token
    /// bucket of one second's worth: a client that was quiet may send that many at once.
    /// Above it the broker stops reading the client's socket until it is back under (TCP
    /// slows the client, its QoS 1/2 acknowledgements come later): nothing is dropped and
    /// the client is not disconnected, nor does its keep alive run out while it waits.
    /// Counted in `$SYS/broker/clients/rate_limited` (`Stats::clients_rate_limited`).
    pub max_publish_rate: u32,
    /// Bytes of PUBLISH packets (whole packets) per second one connection may send, as
    /// `max_publish_rate` (a bucket of one second's worth); 0 = unlimited (default), else at
    /// least [`MIN_PUBLISH_BYTES_RATE`]. A PUBLISH larger than a second's worth passes once
    /// the time it needs at the rate has gone by.
    pub max_publish_bytes_rate: u32,
    /// Microseconds the event loop keeps polling its sockets, instead of sleeping, after
    /// network activity that came within this long of the activity before (a busy stretch);
    /// 0 = always sleep at once. Trades CPU time while busy for latency: each round trip of a
    /// QoS 1/2 window then skips a CPU wake-up. A loop busy less than half the time while it
    /// polls rests from polling (5 ms, doubling to 200 ms). Applies on the current-thread runtime
    /// (mercuriod's default, `--threads 1`). At most 1,000,000 (one second). Default 0 for
    /// an embedding application and for mercuriod ([`DAEMON_BUSY_POLL`]): measured by an
    /// independent generator at fixed rates below saturation, polling cost 1.4 to 1.9 times
    /// the CPU of sleeping (docs/BENCHMARKS.md, "Busy polling off by default").
    pub busy_poll: u32,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_connections: 0,
            connect_timeout: 10,
            park_after: 10,
            max_packet_size: 1_048_576,
            max_keepalive: 0,
            receive_maximum: 1024,
            max_inflight: 20,
            max_qos: 2,
            retain_available: true,
            check_retain_source: false,
            upgrade_outgoing_qos: false,
            clientid_prefixes: Vec::new(),
            max_queued_messages: 10_000,
            max_queued_qos0_messages: 1_000,
            max_queued_bytes: 16 * 1024 * 1024,
            max_queued_memory: 0,
            queue_high_water: 100,
            queue_high_water_bytes: 1024 * 1024,
            stall_time: 2,
            persistent_client_expiration: 0,
            max_retained_messages: 0,
            max_retained_bytes: 64 * 1024 * 1024,
            sys_interval: 10,
            max_topic_levels: 201,
            max_subscriptions_per_client: 10_000,
            allow_zero_length_clientid: true,
            message_size_limit: 0,
            max_publish_rate: 0,
            max_publish_bytes_rate: 0,
            busy_poll: 0,
        }
    }
}

/// The PROXY protocol header a listener reads (its `proxy_protocol`).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ProxyProtocol {
    /// The text header, version 1 (`PROXY TCP4 ...\r\n`), required.
    V1,
    /// The binary header, version 2, required.
    V2,
    /// Either version, or none (told apart by the first bytes).
    Optional,
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
    /// Connections accepted per second on this listener (a token bucket in its accept loop,
    /// `admission`); above it, accepting waits and sockets wait in the kernel's listen
    /// backlog. 0 (default): unlimited.
    pub max_connection_rate: u32,
    /// Connections accepted at once above `max_connection_rate` after a quiet spell (the
    /// bucket's size); 0 (default) means 1. Only with `max_connection_rate`.
    pub max_connection_burst: u32,
    /// The PROXY protocol header this listener reads before anything else (TLS, HTTP,
    /// MQTT), from a load balancer: its client's address replaces the connection's
    /// (`proxy_protocol` module). `None` (default): no header is read.
    pub proxy_protocol: Option<ProxyProtocol>,
    /// The peers allowed to send the PROXY header (`ADDRESS/PREFIX` blocks, or single
    /// addresses); empty (default): loopback only (127.0.0.0/8, ::1).
    pub proxy_from: Vec<String>,
    /// PEM certificate chain; setting it turns TLS on.
    pub cert_file: Option<PathBuf>,
    /// PEM private key for `cert_file`.
    pub key_file: Option<PathBuf>,
    /// PEM CA certificates that client certificates are checked against.
    pub ca_file: Option<PathBuf>,
    /// PEM certificate revocation lists (of the CAs of `ca_file`): a client certificate they
    /// revoke is refused in the handshake. Only the client's own certificate is checked (as
    /// mosquitto's `crlfile`), and a CRL must be given for the CA that issued it. Needs
    /// `ca_file`; reread at reload.
    pub crl_file: Option<PathBuf>,
    /// Refuse clients without a valid certificate; default false.
    pub require_certificate: bool,
    /// The client certificate's common name becomes the user name (and the password file is
    /// not consulted for it); needs `require_certificate`. Default false.
    pub use_identity_as_username: bool,
    /// Answer GET /healthz (websocket only); default false.
    pub health: bool,
    /// Answer GET /metrics (websocket only); default false.
    pub metrics: bool,
    /// Directory of static files served over HTTP (websocket only).
    pub http_dir: Option<PathBuf>,
    /// Overrides `[auth] allow_anonymous` for this listener's clients.
    pub allow_anonymous: Option<bool>,
    /// Overrides `[auth] password_file` for this listener's clients.
    pub password_file: Option<PathBuf>,
    /// Overrides `[auth] acl_file` for this listener's clients.
    pub acl_file: Option<PathBuf>,
    /// Topic prefix of this listener's clients (mosquitto's `mount_point`): prepended to the
    /// topics and filters they send, removed from the topics delivered to them.
    pub mount_point: Option<String>,
    /// Serve the remote admin API under `/api/v1/` (websocket only; docs/admin-api.md);
    /// default false. Needs `admin_token_file` or `admin_users` (here or in `[admin]`).
    pub admin_api: bool,
    /// Serve the web console under `/console/` (websocket only, needs `admin_api`;
    /// docs/console.md); default false.
    pub console: bool,
    /// Overrides `[admin] token_file` for this listener's admin API.
    pub admin_token_file: Option<PathBuf>,
    /// Overrides `[admin] users` for this listener's admin API.
    pub admin_users: Option<Vec<String>>,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        ListenerConfig {
            host: "127.0.0.1".to_string(),
            port: 1883,
            protocol: ListenerProtocol::Mqtt,
            max_connections: 0,
            max_connection_rate: 0,
            max_connection_burst: 0,
            proxy_protocol: None,
            proxy_from: Vec::new(),
            cert_file: None,
            key_file: None,
            ca_file: None,
            crl_file: None,
            require_certificate: false,
            use_identity_as_username: false,
            health: false,
            metrics: false,
            http_dir: None,
            allow_anonymous: None,
            password_file: None,
            acl_file: None,
            mount_point: None,
            admin_api: false,
            console: false,
            admin_token_file: None,
            admin_users: None,
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
    /// File holding the key of derived passwords (its bytes without one trailing newline;
    /// readable by the broker only). Set together with `derived_user_pattern`.
    pub derived_password_secret_file: Option<PathBuf>,
    /// Glob over user names (`*` any run of characters, `?` one) whose password is derived:
    /// lowercase hex of HMAC-SHA256(key, user name) (`auth::derived`).
    pub derived_user_pattern: Option<String>,
    /// Where users, groups, roles and their rules come from besides the files: `files`
    /// (default: only `password_file` / `acl_file`) or `storage` (also the ones kept in the
    /// `[storage]` backend and managed at runtime with `mercurioctl user|group|role|acl`,
    /// asked before the files; `auth::stored`).
    pub backend: AuthBackend,
}

/// `[auth] backend`: where the access rules come from.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum AuthBackend {
    /// The `password_file` and `acl_file` only (default).
    #[default]
    Files,
    /// Users, groups and roles kept in storage first, then the files.
    Storage,
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
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    pub backend: StorageBackend,
    /// SQLite database file.
    pub path: Option<PathBuf>,
    /// PostgreSQL connection URL.
    pub url: Option<String>,
    /// A file holding the PostgreSQL connection URL instead (its contents without one
    /// trailing newline), so that the main configuration file need not hold the database
    /// password; read with the broker's permissions at start. Exclusive with `url`.
    pub url_file: Option<PathBuf>,
    /// Wait as a standby for the serving broker (PostgreSQL); default false.
    pub standby: bool,
    /// Acknowledge QoS 1/2 only after the commit; default false.
    pub durable_ack: bool,
    /// Back pressure from storage, in bytes of changes not yet stored (the topic, payload
    /// and properties of each stored message copy, plus its client identifier), charged to
    /// the client whose PUBLISH produced them (a message queued for 20 offline persistent
    /// sessions costs its publisher 20 copies). A client over it is not read until storage
    /// has caught up below it, so its PUBACK / PUBREC stop coming. 0 = unlimited; default
    /// 8 MiB.
    pub max_pending_bytes: u64,
    /// The same bound for the whole broker: while more bytes than this wait for storage,
    /// every client with changes of its own waiting is not read; clients with none (QoS 0
    /// between non-persistent sessions) go on. 0 = unlimited; default 64 MiB.
    pub max_pending_bytes_total: u64,
    /// What each stream keeps in memory at most, in bytes: its newest messages (each
    /// counted as its topic, payload and properties plus 512 bytes for the shared message
    /// and the entry), the older ones read back from storage. Entries not yet committed and
    /// `last_value` streams are held whatever it says. At least 64 KiB; default 8 MiB.
    /// Without storage (`backend = "memory"`) a stream is held whole.
    pub stream_memory_bytes: u64,
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            backend: StorageBackend::Memory,
            path: None,
            url: None,
            url_file: None,
            standby: false,
            durable_ack: false,
            max_pending_bytes: 8 * 1024 * 1024,
            max_pending_bytes_total: 64 * 1024 * 1024,
            stream_memory_bytes: 8 * 1024 * 1024,
        }
    }
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
    /// File holding the bearer token of the remote admin API (docs/admin-api.md): its
    /// content, surrounding white space removed, at least 16 bytes. Read at start.
    pub token_file: Option<PathBuf>,
    /// Broker users (authenticated by the listener's password file or the application's
    /// authenticator, over HTTP Basic) allowed to use the remote admin API and the console.
    pub users: Vec<String>,
}

/// A configuration value that is out of range, a combination of keys that does not fit, or a
/// key whose feature this version does not have.
///
/// `key` is the key's path in the TOML file: `server.max_qos`, `listeners[1].port` (listeners
/// counted from 0), `storage.backend`. The daemon turns it into a line of the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    /// Path of the offending key, e.g. `listeners[0].cert_file`.
    pub key: String,
    /// What is wrong, e.g. `must be between 1 and 268435455, not 0`.
    pub message: String,
}

impl ConfigError {
    /// An error about `key`.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// Largest packet the MQTT specifications allow (the Remaining Length's limit).
pub const MAX_PACKET_SIZE_LIMIT: u32 = 268_435_455;

/// Smallest `max_packet_size` that lets a client connect: a 3.1.1 CONNECT with an empty client
/// identifier takes 14 bytes.
pub const MIN_PACKET_SIZE_LIMIT: u32 = 14;

/// Smallest `max_retained_bytes` other than 0: 1 KiB. The limit is in bytes; a smaller value
/// is taken for a unit mistake (64 meant as MiB) and refused.
pub const MIN_RETAINED_BYTES: u64 = 1024;

/// Smallest `max_queued_memory` other than 0: 64 KiB. The bound is in bytes; a smaller value
/// is taken for a unit mistake (512 meant as MiB) and refused.
pub const MIN_QUEUED_MEMORY: u64 = 64 * 1024;

/// Smallest `max_publish_bytes_rate` other than 0: 1 KiB per second. The rate is in bytes; a
/// smaller value is taken for a unit mistake (64 meant as KiB) and refused.
pub const MIN_PUBLISH_BYTES_RATE: u32 = 1024;

/// mercuriod's `busy_poll` when its configuration does not set one, in microseconds: 0, as
/// the library's (off; a deployment that runs at saturation may set 50).
pub const DAEMON_BUSY_POLL: u32 = 0;

/// Largest `busy_poll`, in microseconds: one second. Polling longer after the last packet only
/// spends CPU; a larger value is taken for a unit mistake and refused.
pub const MAX_BUSY_POLL: u32 = 1_000_000;

impl ServerConfig {
    /// The limits with 0 ("unlimited") replaced by the largest value each can take:
    /// `max_packet_size` 268,435,455, `receive_maximum` and `max_inflight` 65,535,
    /// `max_queued_messages`, `max_queued_qos0_messages`, `max_topic_levels` and
    /// `max_subscriptions_per_client` `usize::MAX`. The limits whose 0
    /// the broker reads as such (`max_connections`, `max_keepalive`, `max_queued_bytes`,
    /// `max_retained_messages`, `max_retained_bytes`, `persistent_client_expiration`) and `sys_interval` (0: off)
    /// are left as they are.
    pub fn resolved(mut self) -> ServerConfig {
        if self.max_packet_size == 0 {
            self.max_packet_size = MAX_PACKET_SIZE_LIMIT;
        }
        if self.receive_maximum == 0 {
            self.receive_maximum = u16::MAX;
        }
        if self.max_inflight == 0 {
            self.max_inflight = u16::MAX;
        }
        if self.max_queued_messages == 0 {
            self.max_queued_messages = usize::MAX;
        }
        if self.max_queued_qos0_messages == 0 {
            self.max_queued_qos0_messages = usize::MAX;
        }
        if self.max_topic_levels == 0 {
            self.max_topic_levels = usize::MAX;
        }
        if self.max_subscriptions_per_client == 0 {
            self.max_subscriptions_per_client = usize::MAX;
        }
        self
    }
}

impl Config {
    /// Checks ranges and combinations of keys, then refuses keys whose feature this version of
    /// the broker does not have yet (rather than ignoring them). Returns the first problem found,
    /// in the order of the file's sections.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_values()?;
        self.validate_supported()
    }

    fn validate_values(&self) -> Result<(), ConfigError> {
        match (
            &self.auth.derived_password_secret_file,
            &self.auth.derived_user_pattern,
        ) {
            (Some(_), None) => {
                return Err(ConfigError::new(
                    "auth.derived_password_secret_file",
                    "needs derived_user_pattern (the user names whose password is derived)",
                ))
            }
            (None, Some(_)) => {
                return Err(ConfigError::new(
                    "auth.derived_user_pattern",
                    "needs derived_password_secret_file (the key of derived passwords)",
                ))
            }
            (Some(_), Some(p)) if p.is_empty() => {
                return Err(ConfigError::new(
                    "auth.derived_user_pattern",
                    "must not be empty (\"*\" derives every user name)",
                ))
            }
            _ => {}
        }
        let s = &self.server;
        ranges::MAX_PACKET_SIZE.check(s.max_packet_size)?;
        ranges::QUEUE_HIGH_WATER.check(s.queue_high_water as u64)?;
        ranges::QUEUE_HIGH_WATER_BYTES.check(s.queue_high_water_bytes)?;
        ranges::STALL_TIME.check(s.stall_time)?;
        ranges::BUSY_POLL.check(s.busy_poll)?;
        ranges::MAX_RETAINED_BYTES.check(s.max_retained_bytes)?;
        ranges::MAX_QUEUED_MEMORY.check(s.max_queued_memory)?;
        ranges::MAX_PUBLISH_BYTES_RATE.check(s.max_publish_bytes_rate)?;
        ranges::STREAM_MEMORY_BYTES.check(self.storage.stream_memory_bytes)?;
        ranges::MAX_QOS.check(s.max_qos)?;
        ranges::CONNECT_TIMEOUT.check(s.connect_timeout)?;
        for (i, prefix) in s.clientid_prefixes.iter().enumerate() {
            if prefix.is_empty() {
                return Err(ConfigError::new(
                    format!("server.clientid_prefixes[{i}]"),
                    "must not be empty (leave the list empty to allow any client identifier)",
                ));
            }
        }

        for (i, l) in self.listeners.iter().enumerate() {
            let key = |name: &str| format!("listeners[{i}].{name}");
            if l.host.trim().is_empty() {
                return Err(ConfigError::new(key("host"), "must not be empty"));
            }
            if let Some(j) = self.listeners[..i]
                .iter()
                .position(|o| o.host == l.host && o.port == l.port && l.port != 0)
            {
                return Err(ConfigError::new(
                    key("port"),
                    format!("{}:{} is already used by listeners[{j}]", l.host, l.port),
                ));
            }
            for block in &l.proxy_from {
                Cidr::parse(block).map_err(|e| ConfigError::new(key("proxy_from"), e))?;
            }
            if !l.proxy_from.is_empty() && l.proxy_protocol.is_none() {
                return Err(ConfigError::new(
                    key("proxy_from"),
                    "needs proxy_protocol (\"v1\", \"v2\" or \"optional\")",
                ));
            }
            if l.max_connection_burst > 0 && l.max_connection_rate == 0 {
                return Err(ConfigError::new(
                    key("max_connection_burst"),
                    "needs max_connection_rate (connections accepted per second)",
                ));
            }
            if let Some(mount) = &l.mount_point {
                if mount.is_empty() || mount.contains(['+', '#', '\0']) {
                    return Err(ConfigError::new(
                        key("mount_point"),
                        "must be a non-empty topic prefix without wildcards (+, #)",
                    ));
                }
            }
            if l.protocol != ListenerProtocol::Websocket {
                for (set, name) in [
                    (l.health, "health"),
                    (l.metrics, "metrics"),
                    (l.http_dir.is_some(), "http_dir"),
                    (l.admin_api, "admin_api"),
                    (l.console, "console"),
                ] {
                    if set {
                        return Err(ConfigError::new(
                            key(name),
                            "needs protocol = \"websocket\"",
                        ));
                    }
                }
            }
            if l.console && !l.admin_api {
                return Err(ConfigError::new(
                    key("console"),
                    "needs admin_api = true (the console reads the admin API)",
                ));
            }
            if l.admin_api {
                let token = l.admin_token_file.is_some() || self.admin.token_file.is_some();
                let users = l.admin_users.as_ref().unwrap_or(&self.admin.users);
                if !token && users.is_empty() {
                    return Err(ConfigError::new(
                        key("admin_api"),
                        "needs admin_token_file or admin_users (here or in [admin]): nobody could use it",
                    ));
                }
            }
            match (&l.cert_file, &l.key_file) {
                (Some(_), None) => {
                    return Err(ConfigError::new(key("cert_file"), "needs key_file as well"))
                }
                (None, Some(_)) => {
                    return Err(ConfigError::new(key("key_file"), "needs cert_file as well"))
                }
                _ => {}
            }
            if l.cert_file.is_none() {
                if l.ca_file.is_some() {
                    return Err(ConfigError::new(
                        key("ca_file"),
                        "needs cert_file and key_file (TLS)",
                    ));
                }
                if l.crl_file.is_some() {
                    return Err(ConfigError::new(
                        key("crl_file"),
                        "needs cert_file and key_file (TLS)",
                    ));
                }
                if l.require_certificate {
                    return Err(ConfigError::new(
                        key("require_certificate"),
                        "needs cert_file and key_file (TLS)",
                    ));
                }
                let balancer_tls = matches!(
                    l.proxy_protocol,
                    Some(ProxyProtocol::V2 | ProxyProtocol::Optional)
                ) && l.protocol == ListenerProtocol::Mqtt;
                if l.use_identity_as_username && !balancer_tls {
                    return Err(ConfigError::new(
                        key("use_identity_as_username"),
                        "needs cert_file and key_file (TLS), or proxy_protocol = \"v2\" on an MQTT listener (the common name a load balancer verified)",
                    ));
                }
            } else if l.crl_file.is_some() && l.ca_file.is_none() {
                return Err(ConfigError::new(
                    key("crl_file"),
                    "needs ca_file (the CAs whose revocations it lists)",
                ));
            } else if l.require_certificate && l.ca_file.is_none() {
                return Err(ConfigError::new(
                    key("require_certificate"),
                    "needs ca_file to check client certificates against",
                ));
            } else if l.use_identity_as_username && !l.require_certificate {
                return Err(ConfigError::new(
                    key("use_identity_as_username"),
                    "needs require_certificate = true",
                ));
            }
        }

        for (i, b) in self.bridges.iter().enumerate() {
            b.validate(i, &self.bridges[..i])?;
        }
        self.cluster.validate()?;
        for (i, s) in self.streams.iter().enumerate() {
            s.validate(i, &self.streams[..i])?;
        }

        let st = &self.storage;
        match st.backend {
            StorageBackend::Memory => {
                if st.path.is_some() {
                    return Err(ConfigError::new(
                        "storage.path",
                        "is only used with backend = \"sqlite\"",
                    ));
                }
                if st.url.is_some() {
                    return Err(ConfigError::new(
                        "storage.url",
                        "is only used with backend = \"postgres\"",
                    ));
                }
                if st.url_file.is_some() {
                    return Err(ConfigError::new(
                        "storage.url_file",
                        "is only used with backend = \"postgres\"",
                    ));
                }
                if st.durable_ack {
                    return Err(ConfigError::new(
                        "storage.durable_ack",
                        "needs backend = \"sqlite\" or \"postgres\"",
                    ));
                }
            }
            StorageBackend::Sqlite => {
                if st.path.is_none() {
                    return Err(ConfigError::new(
                        "storage.backend",
                        "backend = \"sqlite\" needs path (the database file)",
                    ));
                }
                if st.url.is_some() {
                    return Err(ConfigError::new(
                        "storage.url",
                        "is only used with backend = \"postgres\"",
                    ));
                }
                if st.url_file.is_some() {
                    return Err(ConfigError::new(
                        "storage.url_file",
                        "is only used with backend = \"postgres\"",
                    ));
                }
            }
            StorageBackend::Postgres => {
                if st.url.is_some() && st.url_file.is_some() {
                    return Err(ConfigError::new(
                        "storage.url_file",
                        "set url or url_file, not both",
                    ));
                }
                if st.url_file.is_none()
                    && !matches!(st.url.as_deref(), Some(u) if !u.trim().is_empty())
                {
                    return Err(ConfigError::new(
                        "storage.backend",
                        "backend = \"postgres\" needs url (the connection URL) or url_file",
                    ));
                }
                if st.path.is_some() {
                    return Err(ConfigError::new(
                        "storage.path",
                        "is only used with backend = \"sqlite\"",
                    ));
                }
            }
        }
        if st.standby && st.backend != StorageBackend::Postgres {
            return Err(ConfigError::new(
                "storage.standby",
                "needs backend = \"postgres\"",
            ));
        }
        Ok(())
    }

    /// Keys whose feature this version of the broker does not have. Each is refused when set,
    /// so that a configuration never silently runs without TLS, authentication or storage it
    /// asks for. Remove an entry when its feature lands.
    fn validate_supported(&self) -> Result<(), ConfigError> {
        #[cfg(not(feature = "cluster"))]
        if self.cluster.enabled() {
            return Err(ConfigError::new(
                "cluster.nats_urls",
                "cluster mode is not supported by this version of Mercurio (a build without \
                 the cluster feature)",
            ));
        }
        #[allow(dead_code)] // unused when every optional backend is built in
        fn unsupported(key: String, feature: &str) -> ConfigError {
            ConfigError::new(
                key,
                format!("{feature} is not supported by this version of Mercurio"),
            )
        }
        match self.storage.backend {
            StorageBackend::Memory => {}
            #[cfg(feature = "sqlite")]
            StorageBackend::Sqlite => {}
            #[cfg(not(feature = "sqlite"))]
            StorageBackend::Sqlite => {
                return Err(unsupported(
                    "storage.backend".into(),
                    "backend = \"sqlite\" (a build without the sqlite feature)",
                ))
            }
            #[cfg(feature = "postgres")]
            StorageBackend::Postgres => {}
            #[cfg(not(feature = "postgres"))]
            StorageBackend::Postgres => {
                return Err(unsupported(
                    "storage.backend".into(),
                    "backend = \"postgres\" (a build without the postgres feature)",
                ))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(c: &Config) -> ConfigError {
        match c.validate() {
            Err(e) => e,
            Ok(()) => panic!("{c:?} validated"),
        }
    }

    #[test]
    fn default_is_valid() {
        assert_eq!(Config::default().validate(), Ok(()));
    }

    #[test]
    fn ranges() {
        let mut c = Config::default();
        c.server.max_packet_size = MIN_PACKET_SIZE_LIMIT - 1;
        assert_eq!(err(&c).key, "server.max_packet_size");
        c.server.max_packet_size = MAX_PACKET_SIZE_LIMIT + 1;
        assert_eq!(err(&c).key, "server.max_packet_size");
        c.server.max_packet_size = MAX_PACKET_SIZE_LIMIT;
        assert_eq!(c.validate(), Ok(()));
        c.server.max_retained_bytes = MIN_RETAINED_BYTES;
        assert_eq!(c.validate(), Ok(()));
        c.server.max_queued_memory = MIN_QUEUED_MEMORY;
        assert_eq!(c.validate(), Ok(()));
        c.server.max_publish_bytes_rate = MIN_PUBLISH_BYTES_RATE;
        c.server.max_publish_rate = 1;
        assert_eq!(c.validate(), Ok(()));

        for (f, key) in [
            (
                (|c: &mut Config| c.server.max_qos = 3) as fn(&mut Config),
                "server.max_qos",
            ),
            (|c| c.server.queue_high_water = 0, "server.queue_high_water"),
            (
                |c| c.server.queue_high_water_bytes = 0,
                "server.queue_high_water_bytes",
            ),
            (|c| c.server.stall_time = 0, "server.stall_time"),
            (|c| c.server.busy_poll = 1_000_001, "server.busy_poll"),
            (|c| c.server.connect_timeout = 0, "server.connect_timeout"),
            (
                |c| c.server.max_retained_bytes = 64,
                "server.max_retained_bytes",
            ),
            (
                |c| c.server.max_retained_bytes = MIN_RETAINED_BYTES - 1,
                "server.max_retained_bytes",
            ),
            (
                |c| c.server.max_publish_bytes_rate = 100,
                "server.max_publish_bytes_rate",
            ),
            (
                |c| c.server.max_queued_memory = MIN_QUEUED_MEMORY - 1,
                "server.max_queued_memory",
            ),
        ] {
            let mut c = Config::default();
            f(&mut c);
            assert_eq!(err(&c).key, key);
        }
    }

    /// Every limit's 0 is accepted and means unlimited; `sys_interval = 0` means `$SYS` off.
    #[test]
    fn zero_means_unlimited() {
        let mut c = Config::default();
        let s = &mut c.server;
        s.max_packet_size = 0;
        s.receive_maximum = 0;
        s.max_inflight = 0;
        s.max_queued_messages = 0;
        s.max_queued_qos0_messages = 0;
        s.max_keepalive = 0;
        s.sys_interval = 0;
        s.max_topic_levels = 0;
        s.max_subscriptions_per_client = 0;
        s.max_retained_bytes = 0;
        assert_eq!(c.validate(), Ok(()));
        let r = c.server.clone().resolved();
        assert_eq!(r.max_packet_size, MAX_PACKET_SIZE_LIMIT);
        assert_eq!((r.receive_maximum, r.max_inflight), (u16::MAX, u16::MAX));
        assert_eq!(r.max_queued_messages, usize::MAX);
        assert_eq!(r.max_queued_qos0_messages, usize::MAX);
        assert_eq!((r.max_keepalive, r.sys_interval), (0, 0));
        assert_eq!(r.max_topic_levels, usize::MAX);
        assert_eq!(r.max_subscriptions_per_client, usize::MAX);
        assert_eq!(
            r.max_retained_bytes, 0,
            "0 stays: the broker reads it as unlimited"
        );
        // Values that are not 0 are kept.
        let d = ServerConfig::default();
        assert_eq!(d.clone().resolved(), d);
    }

    #[test]
    fn duplicate_listeners() {
        let mut c = Config::default();
        c.listeners.push(ListenerConfig::default());
        let e = err(&c);
        assert_eq!(e.key, "listeners[1].port");
        assert!(e.message.contains("127.0.0.1:1883"), "{e}");
        // Port 0 picks a free port each time: never a duplicate.
        c.listeners[0].port = 0;
        c.listeners[1].port = 0;
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn admin_api_keys() {
        let mut c = Config::default();
        c.listeners[0].admin_api = true;
        assert_eq!(err(&c).key, "listeners[0].admin_api");
        c.listeners[0].protocol = ListenerProtocol::Websocket;
        let e = err(&c);
        assert_eq!(e.key, "listeners[0].admin_api");
        assert!(e.message.contains("admin_token_file or admin_users"), "{e}");
        c.admin.users = vec!["alice".into()];
        assert_eq!(c.validate(), Ok(()));
        // A listener's own empty list overrides [admin]'s.
        c.listeners[0].admin_users = Some(Vec::new());
        assert_eq!(err(&c).key, "listeners[0].admin_api");
        c.listeners[0].admin_token_file = Some("/etc/mercurio/admin.token".into());
        assert_eq!(c.validate(), Ok(()));
        c.listeners[0].admin_api = false;
        c.listeners[0].console = true;
        let e = err(&c);
        assert_eq!(e.key, "listeners[0].console");
        assert!(e.message.contains("admin_api"), "{e}");
    }

    #[test]
    fn http_keys_need_websocket() {
        let mut c = Config::default();
        c.listeners[0].metrics = true;
        let e = err(&c);
        assert_eq!(e.key, "listeners[0].metrics");
        assert!(e.message.contains("websocket"));
    }

    #[test]
    fn tls_pairs() {
        let mut c = Config::default();
        c.listeners[0].cert_file = Some("c.pem".into());
        assert_eq!(err(&c).key, "listeners[0].cert_file");
        c.listeners[0].cert_file = None;
        c.listeners[0].key_file = Some("k.pem".into());
        assert_eq!(err(&c).key, "listeners[0].key_file");
        c.listeners[0].cert_file = Some("c.pem".into());
        assert_eq!(c.validate(), Ok(()));
        c.listeners[0].use_identity_as_username = true;
        assert_eq!(err(&c).key, "listeners[0].use_identity_as_username");
        c.listeners[0].require_certificate = true;
        assert_eq!(err(&c).key, "listeners[0].require_certificate");
        c.listeners[0].ca_file = Some("ca.pem".into());
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn storage_combinations() {
        let mut c = Config::default();
        c.storage.backend = StorageBackend::Sqlite;
        assert_eq!(err(&c).key, "storage.backend");
        c.storage.path = Some("/tmp/m.db".into());
        c.storage.durable_ack = true;
        assert_eq!(c.validate().is_ok(), cfg!(feature = "sqlite"));

        let mut c = Config::default();
        c.storage.backend = StorageBackend::Postgres;
        assert!(err(&c).message.contains("needs url"));

        let mut c = Config::default();
        c.listeners[0].proxy_from = vec!["10.0.0.0/8".into()];
        assert_eq!(err(&c).key, "listeners[0].proxy_from");
        c.listeners[0].proxy_protocol = Some(ProxyProtocol::V2);
        assert!(c.validate().is_ok());
        c.listeners[0].proxy_from = vec!["10.0.0.0/40".into()];
        let e = err(&c);
        assert_eq!(e.key, "listeners[0].proxy_from");
        assert!(e.message.contains("10.0.0.0/40"), "{e}");
        c.listeners[0].proxy_from = Vec::new();
        c.listeners[0].use_identity_as_username = true;
        assert!(c.validate().is_ok(), "the balancer's certificate name");
        c.listeners[0].proxy_protocol = Some(ProxyProtocol::V1);
        assert_eq!(err(&c).key, "listeners[0].use_identity_as_username");

        let mut c = Config::default();
        c.listeners[0].max_connection_burst = 10;
        assert_eq!(err(&c).key, "listeners[0].max_connection_burst");
        c.listeners[0].max_connection_rate = 100;
        assert!(c.validate().is_ok());

        let mut c = Config::default();
        c.auth.derived_user_pattern = Some("tenant-*".into());
        assert_eq!(err(&c).key, "auth.derived_user_pattern");
        c.auth.derived_password_secret_file = Some("/etc/mercurio/secret".into());
        assert!(c.validate().is_ok());
        c.auth.derived_user_pattern = None;
        assert_eq!(err(&c).key, "auth.derived_password_secret_file");

        let mut c = Config::default();
        c.storage.standby = true;
        assert_eq!(err(&c).key, "storage.standby");
    }

    #[test]
    fn unsupported_keys() {
        let mut c = Config::default();
        c.storage.backend = StorageBackend::Postgres;
        c.storage.url = Some("postgres://localhost/mercurio".into());
        #[cfg(not(feature = "postgres"))]
        {
            let e = err(&c);
            assert_eq!(e.key, "storage.backend");
            assert!(e.message.contains("not supported by this version"), "{e}");
        }
        #[cfg(feature = "postgres")]
        {
            c.storage.standby = true;
            assert_eq!(c.validate(), Ok(()));
        }

        let mut c = Config::default();
        c.auth.password_file = Some("/etc/mercurio/passwd".into());
        c.auth.acl_file = Some("/etc/mercurio/acl".into());
        assert_eq!(c.validate(), Ok(()));

        let mut c = Config::default();
        c.logging.syslog = true;
        c.logging.file = Some("/var/log/mercurio/mercuriod.log".into());
        c.admin.socket = Some("/run/mercurio/mercuriod.sock".into());
        assert!(c.validate().is_ok());
    }

    #[test]
    fn bridges() {
        let mut c = Config::default();
        c.bridges.push(crate::bridge::tests::example());
        assert_eq!(c.validate(), Ok(()));
        for (f, key) in [
            (
                (|b: &mut BridgeConfig| b.name = "a b".into()) as fn(&mut BridgeConfig),
                "bridges[0].name",
            ),
            (|b| b.addresses.clear(), "bridges[0].addresses"),
            (
                |b| b.addresses = vec!["host:0".into()],
                "bridges[0].addresses[0]",
            ),
            (|b| b.keepalive = 1, "bridges[0].keepalive"),
            (|b| b.max_inflight = 0, "bridges[0].max_inflight"),
            (|b| b.password = Some("p".into()), "bridges[0].password"),
            (|b| b.certfile = Some("c.pem".into()), "bridges[0].certfile"),
            (|b| b.topics.clear(), "bridges[0].topics"),
            (|b| b.topics[0].qos = 3, "bridges[0].topics[0].qos"),
            (
                |b| b.topics[0].pattern = "a/#/b".into(),
                "bridges[0].topics[0].pattern",
            ),
            (
                |b| b.topics[0].remote_prefix = "+/".into(),
                "bridges[0].topics[0].remote_prefix",
            ),
            (|b| b.client_id = Some("a/b".into()), "bridges[0].client_id"),
        ] {
            let mut c = Config::default();
            let mut b = crate::bridge::tests::example();
            f(&mut b);
            c.bridges.push(b);
            assert_eq!(err(&c).key, key);
        }
        let mut c = Config::default();
        c.bridges.push(crate::bridge::tests::example());
        c.bridges.push(crate::bridge::tests::example());
        assert_eq!(err(&c).key, "bridges[1].name");
        c.bridges[1].name = "other".into();
        c.bridges[1].client_id = Some("b".into());
        assert_eq!(err(&c).key, "bridges[1].client_id");
    }

    #[test]
    fn addresses() {
        assert_eq!(parse_address("h:1", 1883), Ok(("h".into(), 1)));
        assert_eq!(parse_address("h", 8883), Ok(("h".into(), 8883)));
        assert_eq!(parse_address("[::1]:2", 1883), Ok(("::1".into(), 2)));
        assert!(parse_address(":1", 1883).is_err());
        assert!(parse_address("h:x", 1883).is_err());
    }
}
