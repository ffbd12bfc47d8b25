//! packaging/mercuriod.toml shows every key with its default: uncommenting all of it gives
//! the defaults back (sample paths aside), and no key is missing.

use mercurio_core::config::{
    Config, ListenerConfig, ListenerProtocol, LoggingConfig, ServerConfig, StorageBackend,
};

fn uncommented() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/mercuriod.toml");
    let text = std::fs::read_to_string(path).expect("read packaging/mercuriod.toml");
    text.lines()
        .map(|line| match line.strip_prefix('#') {
            Some(rest)
                if rest.starts_with("[[")
                    || rest.split_once(" = ").is_some_and(|(k, _)| {
                        k.chars()
                            .all(|c| c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit())
                    }) =>
            {
                rest
            }
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn commented_values_are_the_defaults() {
    let text = uncommented();
    let config: Config = toml::from_str(&text).expect("uncommented example parses");
    // mercuriod's own default for busy_poll (the library's is 0).
    let daemon_default = ServerConfig {
        busy_poll: mercurio_core::config::DAEMON_BUSY_POLL,
        ..ServerConfig::default()
    };
    assert_eq!(config.server, daemon_default);

    assert_eq!(config.listeners.len(), 1);
    let l = &config.listeners[0];
    let d = ListenerConfig::default();
    assert_eq!((&l.host, l.port), (&d.host, d.port));
    assert_eq!(l.protocol, ListenerProtocol::Mqtt);
    assert_eq!(l.max_connections, d.max_connections);
    assert_eq!(
        (l.require_certificate, l.health, l.metrics),
        (false, false, false)
    );

    assert_eq!(config.auth.allow_anonymous, Some(false));
    assert_eq!(config.storage.backend, StorageBackend::Memory);
    assert!(!config.storage.standby && !config.storage.durable_ack);
    assert_eq!(
        (
            config.storage.max_pending_bytes,
            config.storage.max_pending_bytes_total,
            config.storage.stream_memory_bytes
        ),
        (8 << 20, 64 << 20, 8 << 20)
    );
    let d = LoggingConfig::default();
    assert_eq!(config.logging.level, d.level);
    assert_eq!(config.logging.syslog, d.syslog);
    assert_eq!(config.logging.connection_messages, d.connection_messages);
    assert!(!config.cluster.enabled());
    assert_eq!(config.cluster.node_name, "");
    assert_eq!(config.cluster.prefix(), "mercurio");
    let d = mercurio_core::config::ClusterConfig::default();
    assert_eq!(config.cluster.jetstream_on(), d.jetstream_on());
    assert_eq!(config.cluster.jetstream_replicas(), d.jetstream_replicas());
    assert_eq!(config.cluster.jetstream_max_age(), d.jetstream_max_age());
    assert_eq!(
        config.cluster.jetstream_max_bytes(),
        d.jetstream_max_bytes()
    );
    assert_eq!(
        config.cluster.jetstream_ack_timeout(),
        d.jetstream_ack_timeout()
    );
    assert_eq!(
        config.cluster.jetstream_max_pending_bytes(),
        d.jetstream_max_pending_bytes()
    );
}

#[test]
fn every_key_is_shown() {
    let table: toml::Table = toml::from_str(&uncommented()).expect("parses");
    let len = |section: &str| match &table[section] {
        toml::Value::Table(t) => t.len(),
        toml::Value::Array(a) => match &a[0] {
            toml::Value::Table(t) => t.len(),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    };
    // Field counts of the structs in mercurio_core::config.
    assert_eq!(len("server"), 28);
    assert_eq!(len("listeners"), 17);
    assert_eq!(len("auth"), 4);
    assert_eq!(len("storage"), 9);
    assert_eq!(len("logging"), 4);
    assert_eq!(len("admin"), 1);
    assert_eq!(len("bridges"), 19);
    assert_eq!(len("cluster"), 19);
    let bridges = table["bridges"].as_array().expect("bridges");
    let topics = bridges[0]["topics"].as_array().expect("bridges.topics");
    assert_eq!(topics[0].as_table().map(|t| t.len()), Some(5));
}
