//! Broker behaviour as a client sees it, through real sockets: one test binary (one link
//! step) for all of it, one module per concern. `tests/idle_memory.rs` stays apart: it
//! installs its own counting allocator.

#[path = "../common/mod.rs"]
mod common;

mod admin_api;
mod bad_input;
mod bridge;
mod connect;
mod durable_client;
mod embedding;
mod events;
mod flow_control;
mod hooks;
mod http;
mod interop_rumqttc;
mod limits;
mod mosquitto_options;
mod one_entry;
mod park;
mod persistence_pressure;
mod persistence_sqlite;
mod persistence_writer;
mod publish_subscribe;
mod queued_memory;
mod retain;
mod security_acl;
mod security_auth;
mod security_tls;
mod session;
mod shard_moves;
mod shared_subscriptions;
mod smoke;
mod streams;
mod sys;
mod topics;
mod websocket;
mod will;
