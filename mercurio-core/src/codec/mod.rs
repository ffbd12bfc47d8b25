//! The MQTT codec: every packet of MQTT 3.1, 3.1.1 and 5.0, decoded incrementally from a
//! buffer and encoded into one.
//!
//! Written here rather than taken from a crate: none covers 3.1 + 3.1.1 + complete 5.0
//! strictly (see DESIGN.md section 2).

pub mod packet;
pub mod properties;
pub mod reason;

pub use packet::*;
pub use properties::Properties;
pub use reason::ReasonCode;
