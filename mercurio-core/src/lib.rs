//! Mercurio's broker core: the MQTT codec, sessions, routing, listeners and the embedding API.

pub mod codec;
pub mod config;
pub mod router;
pub mod topic;
