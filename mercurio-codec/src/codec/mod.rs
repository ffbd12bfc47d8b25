//! The MQTT codec: every packet of MQTT 3.1, 3.1.1 and 5.0, decoded incrementally from a
//! buffer and encoded into one.
//!
//! Written here rather than taken from a crate: none covers 3.1 + 3.1.1 + complete 5.0
//! strictly (malformed input is a protocol error, MQTT 5.0 section 4.13).
//!
//! - [`check_frame`]: is a whole packet buffered? (fixed header only; size limit enforced
//!   before the body arrives);
//! - [`decode()`] / [`decode_packet`]: parse one packet, strictly;
//! - [`encode()`] / [`encode_publish`] / [`publish_encoded_len`]: write packets;
//! - [`encode_properties`] / [`decode_properties`]: a property block on its own, for storage.

pub mod decode;
pub mod encode;
pub mod error;
pub mod packet;
pub mod properties;
pub mod reason;
mod wire;

pub use decode::*;
pub use encode::*;
pub use error::*;
pub use packet::*;
pub use properties::Properties;
pub use reason::ReasonCode;
pub use wire::{MAX_STRING_LEN, MAX_VARIABLE_BYTE_INTEGER};
