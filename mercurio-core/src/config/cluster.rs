//! `[cluster]`: cluster mode, nodes routing messages to each other through NATS
//! (docs/cluster.md).

use std::path::PathBuf;

use serde::Deserialize;

use super::ConfigError;

/// `[cluster]`: this node's place in a cluster of nodes that meet on NATS. Off while
/// `nats_urls` is empty (the default).
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// The NATS servers to connect to (`nats://host:4222`, `tls://host:4222`), tried in
    /// turn; the client also learns the other servers of a NATS cluster from them. Empty:
    /// cluster mode off.
    pub nats_urls: Vec<String>,
    /// This node's name, unique in the cluster (letters, digits, `-`, `_`; 1 to 64
    /// characters): its NATS connection is named `mercurio {node_name}`, and the log names it
    /// at start. Required with `nats_urls`.
    pub node_name: String,
    /// The first tokens of every subject the cluster uses (default `mercurio`): clusters
    /// sharing one NATS account keep apart with different prefixes.
    pub subject_prefix: Option<String>,
    /// A NATS credentials file (`.creds`: a user JWT and its NKey seed).
    pub credentials_file: Option<PathBuf>,
    /// A NATS user name; its password in `password_file`.
    pub username: Option<String>,
    /// The file holding the password of `username` (one trailing newline dropped).
    pub password_file: Option<PathBuf>,
    /// A file holding a NATS authentication token.
    pub token_file: Option<PathBuf>,
    /// PEM certificates of the authorities that sign the NATS servers' certificates; TLS is
    /// then required.
    pub ca_file: Option<PathBuf>,
    /// This node's PEM client certificate for NATS servers that verify clients (with
    /// `key_file`).
    pub cert_file: Option<PathBuf>,
    /// The private key of `cert_file`, PEM.
    pub key_file: Option<PathBuf>,
    /// Seconds between this node's heartbeats (1 to 300; default 2): each node announces
    /// itself to the others this often, and a node that misses three is shown as gone
    /// (docs/cluster.md, "Status"). Give every node the same.
    pub heartbeat_interval: Option<u64>,
    /// Seconds a CONNECT waits for the other nodes to answer whether they have its client
    /// identifier's session (1 to 60; default 2): a node that does not answer in time (one
    /// that crashed and is not yet seen as gone) keeps its copy, and the client gets what
    /// the others hand over, or a new session (docs/cluster.md, "Sessions across nodes").
    /// Also the longest wait for each call to the session registry, and for the wills due
    /// at start to be checked against it ("One owner per session").
    pub takeover_timeout: Option<u64>,
    /// QoS 1 and 2 messages between nodes at least once, through a JetStream stream
    /// (default `true`; the NATS servers need JetStream on): the publisher's PUBACK / PUBREC
    /// follows JetStream's acknowledgement when another node wants the message. `false`:
    /// at most once over NATS core. Give every node the same (docs/cluster.md, "QoS across
    /// nodes").
    pub jetstream: Option<bool>,
    /// Seconds a message waits in the stream for a node at most (1 to 31,536,000; default
    /// 86,400, one day): a node away longer loses what was older.
    pub jetstream_max_age: Option<u64>,
    /// Bytes the stream holds at most (1 MiB to 1 TiB; default 1 GiB); when full, JetStream
    /// refuses new messages and their publishers wait (never a silent drop).
    pub jetstream_max_bytes: Option<u64>,
    /// Copies of the stream on the NATS servers (1 to 5; default 1); 3 in a NATS cluster of
    /// three or more JetStream servers keeps it through the loss of one. Read when the
    /// stream is created or updated, at each node's start.
    pub jetstream_replicas: Option<usize>,
    /// Seconds a publisher's PUBACK / PUBREC waits for JetStream at most (1 to 3,600;
    /// default 30): past it the connection is closed (5.0: DISCONNECT 0x89 Server busy) and
    /// the message is still sent once JetStream takes it.
    pub jetstream_ack_timeout: Option<u64>,
    /// Bytes of messages handed to JetStream and not yet acknowledged, at most (64 KiB to
    /// 16 GiB; default 64 MiB): over it, publishers whose messages other nodes want are
    /// not read until JetStream catches up.
    pub jetstream_max_pending_bytes: Option<u64>,
    /// The PostgreSQL databases of the other nodes, by node name (`{ b =
    /// "postgres://mercurio@db/node_b" }`; default none): a CONNECT whose session the
    /// registry names one of them the owner of, and that node gone (silent for
    /// `takeover_timeout`), takes the session out of that node's database, fencing it
    /// (docs/cluster.md, "A crashed node's sessions"). Needs `jetstream` on and this build's
    /// PostgreSQL storage; a node not listed keeps its sessions until it is back.
    pub peer_storage: std::collections::BTreeMap<String, String>,
}

/// Checks a NATS URL's shape: `[scheme://][user[:password]@]host[:port]`, the scheme one of
/// `nats`, `tls`, `ws`, `wss`.
fn check_url(url: &str) -> Result<(), String> {
    let rest = match url.split_once("://") {
        Some((scheme, rest)) => {
            if !matches!(scheme, "nats" | "tls" | "ws" | "wss") {
                return Err(format!(
                    "{url:?}: the scheme must be nats://, tls://, ws:// or wss://"
                ));
            }
            rest
        }
        None => url,
    };
    let host_port = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let host_port = host_port.split('/').next().unwrap_or("");
    let (host, port) = match host_port.rsplit_once(':') {
        Some((h, _)) if !h.ends_with(']') && h.contains(':') => (host_port, None),
        Some((h, p)) => (h, Some(p)),
        None => (host_port, None),
    };
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(format!("{url:?}: no host"));
    }
    if let Some(p) = port {
        if p.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(format!("{url:?}: the port must be 1 to 65535"));
        }
    }
    Ok(())
}

/// The heartbeat interval when `heartbeat_interval` is not set, in seconds.
pub const DEFAULT_HEARTBEAT_INTERVAL: u64 = 2;

/// The takeover timeout when `takeover_timeout` is not set, in seconds.
pub const DEFAULT_TAKEOVER_TIMEOUT: u64 = 2;

/// `jetstream_max_age` when not set, in seconds: one day.
pub const DEFAULT_JETSTREAM_MAX_AGE: u64 = 86_400;

/// `jetstream_max_bytes` when not set: 1 GiB.
pub const DEFAULT_JETSTREAM_MAX_BYTES: u64 = 1 << 30;

/// `jetstream_ack_timeout` when not set, in seconds.
pub const DEFAULT_JETSTREAM_ACK_TIMEOUT: u64 = 30;

/// `jetstream_max_pending_bytes` when not set: 64 MiB.
pub const DEFAULT_JETSTREAM_MAX_PENDING_BYTES: u64 = 64 << 20;

/// The subject prefix when `subject_prefix` is not set.
pub const DEFAULT_SUBJECT_PREFIX: &str = "mercurio";

impl ClusterConfig {
    /// Whether cluster mode is on (`nats_urls` not empty).
    pub fn enabled(&self) -> bool {
        !self.nats_urls.is_empty()
    }

    /// The subject prefix: `subject_prefix`, or [`DEFAULT_SUBJECT_PREFIX`].
    pub fn prefix(&self) -> &str {
        self.subject_prefix
            .as_deref()
            .unwrap_or(DEFAULT_SUBJECT_PREFIX)
    }

    /// The time between two heartbeats: `heartbeat_interval`, or
    /// [`DEFAULT_HEARTBEAT_INTERVAL`] seconds.
    pub fn heartbeat(&self) -> std::time::Duration {
        std::time::Duration::from_secs(
            self.heartbeat_interval
                .unwrap_or(DEFAULT_HEARTBEAT_INTERVAL),
        )
    }

    /// How long a CONNECT waits for the other nodes' answers about its session:
    /// `takeover_timeout`, or [`DEFAULT_TAKEOVER_TIMEOUT`] seconds.
    pub fn takeover(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.takeover_timeout.unwrap_or(DEFAULT_TAKEOVER_TIMEOUT))
    }

    /// Whether QoS 1 and 2 messages cross between nodes through JetStream (`jetstream`,
    /// default true).
    pub fn jetstream_on(&self) -> bool {
        self.jetstream.unwrap_or(true)
    }

    /// `jetstream_max_age`, or [`DEFAULT_JETSTREAM_MAX_AGE`].
    pub fn jetstream_max_age(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.jetstream_max_age.unwrap_or(DEFAULT_JETSTREAM_MAX_AGE))
    }

    /// `jetstream_max_bytes`, or [`DEFAULT_JETSTREAM_MAX_BYTES`].
    pub fn jetstream_max_bytes(&self) -> u64 {
        self.jetstream_max_bytes
            .unwrap_or(DEFAULT_JETSTREAM_MAX_BYTES)
    }

    /// `jetstream_replicas`, or 1.
    pub fn jetstream_replicas(&self) -> usize {
        self.jetstream_replicas.unwrap_or(1)
    }

    /// `jetstream_ack_timeout`, or [`DEFAULT_JETSTREAM_ACK_TIMEOUT`].
    pub fn jetstream_ack_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(
            self.jetstream_ack_timeout
                .unwrap_or(DEFAULT_JETSTREAM_ACK_TIMEOUT),
        )
    }

    /// `jetstream_max_pending_bytes`, or [`DEFAULT_JETSTREAM_MAX_PENDING_BYTES`].
    pub fn jetstream_max_pending_bytes(&self) -> u64 {
        self.jetstream_max_pending_bytes
            .unwrap_or(DEFAULT_JETSTREAM_MAX_PENDING_BYTES)
    }

    /// `peer_storage`: other nodes' names, PostgreSQL URLs, JetStream on, the backend built.
    fn validate_peer_storage(&self) -> Result<(), ConfigError> {
        if self.peer_storage.is_empty() {
            return Ok(());
        }
        if !cfg!(feature = "postgres") {
            return Err(ConfigError::new(
                "cluster.peer_storage",
                "needs the PostgreSQL storage, which this build does not have (cargo feature \
                 postgres)",
            ));
        }
        if !self.jetstream_on() {
            return Err(ConfigError::new(
                "cluster.peer_storage",
                "needs jetstream = true: the session registry names the node a session is \
                 taken from",
            ));
        }
        for (node, url) in &self.peer_storage {
            let key = format!("cluster.peer_storage.{node}");
            if *node == self.node_name {
                return Err(ConfigError::new(
                    key,
                    "names this node: list the other nodes' databases",
                ));
            }
            if !(url.starts_with("postgres://")
                || url.starts_with("postgresql://")
                || url.contains("dbname="))
            {
                return Err(ConfigError::new(
                    key,
                    "must be a PostgreSQL connection URL (postgres://user@host/database)",
                ));
            }
        }
        Ok(())
    }

    /// Checks the section's values and combinations; the files are checked when opened.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if let Some(p) = &self.subject_prefix {
            let plain = |t: &str| {
                !t.is_empty()
                    && t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            };
            if !p.split('.').all(plain) {
                return Err(ConfigError::new(
                    "cluster.subject_prefix",
                    "must be dot-separated words of letters, digits, '-' and '_'",
                ));
            }
        }
        let has_settings = self.subject_prefix.is_some()
            || !self.node_name.is_empty()
            || self.credentials_file.is_some()
            || self.username.is_some()
            || self.password_file.is_some()
            || self.token_file.is_some()
            || self.ca_file.is_some()
            || self.cert_file.is_some()
            || self.key_file.is_some()
            || self.heartbeat_interval.is_some()
            || self.takeover_timeout.is_some()
            || self.jetstream.is_some()
            || self.jetstream_max_age.is_some()
            || self.jetstream_max_bytes.is_some()
            || self.jetstream_replicas.is_some()
            || self.jetstream_ack_timeout.is_some()
            || self.jetstream_max_pending_bytes.is_some()
            || !self.peer_storage.is_empty();
        if !self.enabled() {
            if has_settings {
                return Err(ConfigError::new(
                    "cluster.nats_urls",
                    "is empty: list the NATS servers (e.g. [\"nats://127.0.0.1:4222\"]) or \
                     remove [cluster]",
                ));
            }
            return Ok(());
        }
        for (i, url) in self.nats_urls.iter().enumerate() {
            check_url(url).map_err(|m| ConfigError::new(format!("cluster.nats_urls[{i}]"), m))?;
        }
        if self.node_name.is_empty() {
            return Err(ConfigError::new(
                "cluster.node_name",
                "is required with nats_urls: a name unique in the cluster",
            ));
        }
        if self.node_name.len() > 64
            || !self
                .node_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(ConfigError::new(
                "cluster.node_name",
                "must be 1 to 64 letters, digits, '-' or '_'",
            ));
        }
        self.validate_peer_storage()?;
        if self
            .heartbeat_interval
            .is_some_and(|s| !(1..=300).contains(&s))
        {
            return Err(ConfigError::new(
                "cluster.heartbeat_interval",
                "must be 1 to 300 seconds",
            ));
        }
        if self
            .takeover_timeout
            .is_some_and(|s| !(1..=60).contains(&s))
        {
            return Err(ConfigError::new(
                "cluster.takeover_timeout",
                "must be 1 to 60 seconds",
            ));
        }
        let ranges: [(&str, Option<u64>, u64, u64, &str); 5] = [
            (
                "cluster.jetstream_max_age",
                self.jetstream_max_age,
                1,
                31_536_000,
                "1 to 31536000 seconds",
            ),
            (
                "cluster.jetstream_max_bytes",
                self.jetstream_max_bytes,
                1 << 20,
                1 << 40,
                "1048576 (1 MiB) to 1099511627776 (1 TiB) bytes",
            ),
            (
                "cluster.jetstream_replicas",
                self.jetstream_replicas.map(|r| r as u64),
                1,
                5,
                "1 to 5",
            ),
            (
                "cluster.jetstream_ack_timeout",
                self.jetstream_ack_timeout,
                1,
                3600,
                "1 to 3600 seconds",
            ),
            (
                "cluster.jetstream_max_pending_bytes",
                self.jetstream_max_pending_bytes,
                1 << 16,
                1 << 34,
                "65536 (64 KiB) to 17179869184 (16 GiB) bytes",
            ),
        ];
        for (key, value, min, max, what) in ranges {
            if value.is_some_and(|v| !(min..=max).contains(&v)) {
                return Err(ConfigError::new(key, format!("must be {what}")));
            }
        }
        if self.username.is_some() != self.password_file.is_some() {
            return Err(ConfigError::new(
                if self.username.is_some() {
                    "cluster.username"
                } else {
                    "cluster.password_file"
                },
                "username and password_file go together",
            ));
        }
        let methods = usize::from(self.credentials_file.is_some())
            + usize::from(self.username.is_some())
            + usize::from(self.token_file.is_some());
        if methods > 1 {
            return Err(ConfigError::new(
                "cluster.credentials_file",
                "choose one of credentials_file, username/password_file and token_file",
            ));
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(ConfigError::new(
                if self.cert_file.is_some() {
                    "cluster.cert_file"
                } else {
                    "cluster.key_file"
                },
                "cert_file and key_file go together",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{check_url, ClusterConfig};

    #[test]
    fn peer_storage_names_other_nodes_postgresql_databases() {
        let mut c = ClusterConfig {
            nats_urls: vec!["nats://127.0.0.1:4222".into()],
            node_name: "a".into(),
            ..ClusterConfig::default()
        };
        c.peer_storage
            .insert("b".into(), "postgres://mercurio@db/node_b".into());
        assert_eq!(c.validate().is_ok(), cfg!(feature = "postgres"));
        if !cfg!(feature = "postgres") {
            return;
        }
        c.peer_storage.insert("c".into(), "/var/lib/c.db".into());
        let e = c.validate().unwrap_err();
        assert_eq!(e.key, "cluster.peer_storage.c");
        c.peer_storage.remove("c");
        c.peer_storage.insert("a".into(), "postgres://db/a".into());
        assert_eq!(c.validate().unwrap_err().key, "cluster.peer_storage.a");
        c.peer_storage.remove("a");
        c.jetstream = Some(false);
        assert_eq!(c.validate().unwrap_err().key, "cluster.peer_storage");
    }

    #[test]
    fn takeover_timeout_is_1_to_60_seconds_and_2_by_default() {
        let mut c = ClusterConfig {
            nats_urls: vec!["nats://127.0.0.1:4222".into()],
            node_name: "a".into(),
            ..ClusterConfig::default()
        };
        assert_eq!(c.takeover(), std::time::Duration::from_secs(2));
        for (value, ok) in [(0, false), (1, true), (60, true), (61, false)] {
            c.takeover_timeout = Some(value);
            let checked = c.validate();
            assert_eq!(checked.is_ok(), ok, "{value}");
            if let Err(e) = checked {
                assert_eq!(e.key, "cluster.takeover_timeout");
            }
        }
        assert_eq!(c.takeover(), std::time::Duration::from_secs(61));
    }

    #[test]
    fn urls() {
        for ok in [
            "nats://10.0.0.5:4222",
            "tls://nats.example.com",
            "nats://user:pw@host:4222",
            "host:4222",
            "ws://[::1]:8080",
        ] {
            assert_eq!(check_url(ok), Ok(()), "{ok}");
        }
        for bad in [
            "http://h:1",
            "nats://:4222",
            "nats://h:0",
            "nats://h:x",
            "",
            " ",
        ] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
    }
}
