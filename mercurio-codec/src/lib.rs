//! Mercurio's MQTT codec and topic rules, free of any broker state.
//!
//! - [`codec`]: every packet of MQTT 3.1, 3.1.1 and 5.0, decoded strictly and incrementally
//!   from a buffer and encoded into one, with properties and reason codes;
//! - [`topic`]: topic names, topic filters and shared-subscription filters: validation and
//!   matching (MQTT 5.0 sections 4.7 and 4.8.2).
//!
//! The broker (`mercurio-core`) re-exports both as `mercurio_core::codec` and
//! `mercurio_core::topic`.
//!
//! Dependencies, one line each:
//! - bytes: payloads and buffers shared without copies (`Bytes`, `BytesMut`), as the broker
//!   holds them;
//! - thiserror: the `Display` of the error enums ([`codec::DecodeError`],
//!   [`codec::EncodeError`], [`topic::TopicError`]).

pub mod codec;
pub mod topic;

pub use codec::*;
