//! Mercurio's broker core: the MQTT codec, sessions, routing, listeners and the embedding API.
//!
//! A message flows socket to socket like this: a [`connection`] task's reader decodes a
//! PUBLISH ([`codec`]), the broker finds matching subscriptions in the [`router`] index and
//! pushes one shared [`message::Message`] into each subscriber's [`session`] queue, which wakes
//! that subscriber's writer; the writer drains its queue into one buffer and one write.
//!
//! Dependencies: mercurio-codec (the packet codec and topic rules, re-exported as [`codec`]
//! and [`topic`]), tokio (runtime), bytes (shared payloads), parking_lot (short, uncontended
//! locks), ahash (fast hashing, randomly keyed, in the topic trie and the session table), thiserror (error enum), serde (the
//! configuration), tracing (logs), async-trait (hook traits), mercurio-storage (the `Storage`
//! trait and backends; its `sqlite` feature through ours).
//! hyper + hyper-util (HTTP/1.1 on WebSocket listeners, with upgrades), http-body (response
//! bodies), tokio-tungstenite (WebSocket framing after the upgrade),
//! futures-util (its Stream/Sink traits; `catch_unwind`, so that a panicking application hook
//! costs only its answer), prometheus-client (`/metrics`, a registry per broker).
//! rustls 0.23 with ring (pure Rust; TLS listeners on its unbuffered API, `tls_stream`) +
//! tokio-rustls (bridges' TLS connections), rustls-pki-types (PEM
//! certificates and keys), sha2 + pbkdf2 + argon2 + password-hash (mosquitto_passwd's $6$, $7$
//! and argon2id hashes; password-hash's getrandom for new salts), subtle (constant-time hash
//! comparison), base64 (the salts and hashes of password files), libc (O_NOFOLLOW for the
//! temporary file a password file is rewritten through), x509-cert (the validity dates of a
//! bridge remote's self-signed certificate, pinned from `cafile`; already built for
//! mercurio-storage's PostgreSQL TLS), getrandom (the operating system's random bytes behind
//! assigned client identifiers, so that nobody can guess one), toml + toml_edit (the
//! configuration file reader, `config_file`: the typed parse, then the document with spans that
//! names an error's key and line; shared by mercuriod and mercurioctl).
//! async-nats (feature `cluster`: the NATS project's own client, on tokio and rustls with
//! ring as the rest, which the nodes of a cluster meet through, `cluster`; with its `jetstream`
//! feature, the client's JetStream API, through which QoS 1 and 2 messages cross between nodes
//! at least once).

pub mod admin;
mod admin_api;
mod admission;
pub mod auth;
mod bridge;
mod bridge_status;
mod broker;
mod busy_poll;
#[cfg(feature = "cluster")]
mod cluster;
// Without the feature nothing hands messages off (`ClusterQos` stays off).
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
mod cluster_qos;
mod cluster_status;
/// The MQTT codec, from the `mercurio-codec` crate.
pub use mercurio_codec::codec;
pub mod config;
pub mod config_file;
mod connection;
mod console;
pub mod credentials;
mod error;
pub mod events;
mod handle;
mod hook;
mod http;
mod http_response;
pub mod intercept;
mod interest;
mod keep_alive;
mod lazy_map;
mod link;
mod listener;
pub mod message;
mod metrics;
pub mod observe;
mod parking;
pub(crate) mod persist;
mod proxy_protocol;
mod queued_memory;
pub mod router;
mod session;
mod shards;
pub mod stats;
pub mod streams;
mod sys;
mod tls;
mod tls_stream;
pub mod topic;
mod websocket;

pub use admin_api::{AdminHandler, ADMIN_ROUTES};
pub use auth::hooks::{
    AccessRequest, Action, AuthContinuation, AuthStep, Authentication, Authenticator, Authorizer,
    ConnectInfo, Decision, DenyReason, EnhancedAuthenticator,
};
pub use auth::FileError;
pub use bridge::{BridgeInfo, BridgeReload, HOP_PROPERTY};
pub use error::Error;
pub use events::{Event, EventStream, SubscribedFilter};
pub use handle::{
    check_files, Broker, BrokerBuilder, BrokerHandle, Client, ClientOptions, Delivered, Received,
    SessionDetail, SessionInfo, Subscription, SHUTDOWN_GRACE,
};
pub use http::HttpLimits;
pub use intercept::{
    InterceptedPublish, InterceptedSubscribe, PublishInterceptor, SubscribeInterceptor, Verdict,
};
pub use link::DisconnectReason;
/// The storage crate: the `Storage` trait, its records and backends.
pub use mercurio_storage as storage;
pub use message::Message;
pub use observe::{DeliveryCompleted, MessageDropped, RetainedChange, WillPublished};
pub use persist::WriteFailure;
pub use session::Session;
pub use shards::{Placement, Shards, Thresholds};
