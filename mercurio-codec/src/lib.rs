//! Mercurio's MQTT codec and topic rules, free of any broker state.
//!
//! - [`codec`]: every packet of MQTT 3.1, 3.1.1 and 5.0, decoded strictly and incrementally
//!   from a buffer and encoded into one, with properties and reason codes;
//! - [`topic`]: topic names, topic filters and shared-subscription filters: validation and
//!   matching (MQTT 5.0 sections 4.7 and 4.8.2).
//!
//! - [`client`] (feature `client`): an async MQTT client on the codec, over any byte stream.
//!
//! The broker (`mercurio-core`) re-exports both as `mercurio_core::codec` and
//! `mercurio_core::topic`.
//!
//! Dependencies, one line each:
//! - bytes: payloads and buffers shared without copies (`Bytes`, `BytesMut`), as the broker
//!   holds them;
//! - thiserror: the `Display` of the error enums ([`codec::DecodeError`],
//!   [`codec::EncodeError`], [`topic::TopicError`], `client::ClientError`);
//! - tokio (feature `client` only): the `AsyncRead` / `AsyncWrite` traits a transport is,
//!   the timers of the keep alive and the CONNACK wait, and `select!`; no runtime is started.

#[cfg(feature = "client")]
pub mod client;
pub mod codec;
pub mod topic;

pub use codec::*;
