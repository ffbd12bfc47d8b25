//! Mercurio, an embeddable MQTT 3.1/3.1.1/5.0 broker: this crate re-exports `mercurio-core`'s
//! public API (and `mercurio-storage` as [`storage`]).
//!
//! Features: `sqlite` (default) builds the SQLite storage backend in.
//!
//! Dev-dependencies: `rumqttc` (a client library against the broker), `tempfile` (databases
//! and files of tests), `rusqlite` (tests read, damage and lock the database the broker
//! writes; the same libsqlite3-sys as the backend); `mercurio-core` and `mercurio-storage`
//! again with their `postgres` features and the storage's `conformance` (its throwaway
//! PostgreSQL cluster), for the tests and examples on PostgreSQL (a durable in-process
//! client across a standby's takeover).
pub use mercurio_core::*;
