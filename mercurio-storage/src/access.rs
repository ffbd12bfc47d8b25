//! The access rules a broker keeps in storage (`[auth] backend = "storage"`): users, groups
//! and roles, each one [`AccessRecord`] under its kind and name.
//!
//! As with MQTT 5 properties elsewhere in this crate, storage does not read what a record
//! holds: its [`body`](AccessRecord::body) is the broker's own text (JSON), stored and
//! returned as it is. Backends only keep records by kind and name, change them in
//! transactions ([`Storage::apply_access`](crate::Storage::apply_access)) and return them all
//! ([`Storage::load_access`](crate::Storage::load_access)), so that every broker on the same
//! database (a PostgreSQL standby taking over) sees the same users and rules.

use crate::error::StorageError;

/// What an access record describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AccessKind {
    /// A user: its password hashes, SCRAM keys, groups and roles.
    User,
    /// A group of users: its roles.
    Group,
    /// A role: its access rules.
    Role,
}

impl AccessKind {
    /// The kind as stored: `user`, `group`, `role`.
    pub fn as_str(self) -> &'static str {
        match self {
            AccessKind::User => "user",
            AccessKind::Group => "group",
            AccessKind::Role => "role",
        }
    }

    /// The kind a stored name stands for; `None` for an unknown one (a newer version's).
    pub fn parse(s: &str) -> Option<AccessKind> {
        Some(match s {
            "user" => AccessKind::User,
            "group" => AccessKind::Group,
            "role" => AccessKind::Role,
            _ => return None,
        })
    }
}

/// One user, group or role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessRecord {
    /// What it describes.
    pub kind: AccessKind,
    /// Its name, unique within its kind (a user name, a group's or a role's name).
    pub name: String,
    /// What it holds, in the broker's own text; opaque to storage.
    pub body: String,
}

/// One change of the access records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessChange {
    /// Store the record, replacing the one of the same kind and name.
    Put(AccessRecord),
    /// Delete the record of this kind and name; nothing when there is none.
    Deleted {
        /// Its kind.
        kind: AccessKind,
        /// Its name.
        name: String,
    },
}

/// Refuses a change no backend can store: an empty name, or a name or body holding a NUL
/// character (which PostgreSQL's text refuses); checked by every backend before it writes.
pub fn validate_access(changes: &[AccessChange]) -> Result<(), StorageError> {
    for change in changes {
        let (name, body) = match change {
            AccessChange::Put(r) => (&r.name, Some(&r.body)),
            AccessChange::Deleted { name, .. } => (name, None),
        };
        if name.is_empty() {
            return Err(StorageError::refused("an access record needs a name"));
        }
        if name.contains('\0') || body.is_some_and(|b| b.contains('\0')) {
            return Err(StorageError::refused(
                "an access record's name and body may not hold a NUL character",
            ));
        }
    }
    Ok(())
}
