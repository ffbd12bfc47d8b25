//! The admin protocol: the requests an administrator sends a running broker and the answer
//! envelope, defined once for every transport. mercuriod's admin socket (one JSON object per
//! line each way), the remote admin API's routes ([`AdminHandler`](crate::AdminHandler),
//! docs/admin-api.md) and mercurioctl all use these types, so the JSON on the wire has one
//! definition.
//!
//! A request is a JSON object naming its `command` and exactly its arguments:
//!
//! | request | result |
//! |---|---|
//! | `{"command":"broker.status"}` | version, uptime, clients, sessions, storage, log level |
//! | `{"command":"broker.log-level","level":"debug"}` | `{"level": directives in force}`, plus `"warning"` when a directive names no module of Mercurio |
//! | `{"command":"client.list"}` | `{"clients":[{client_id, connected, protocol_level, ...}]}` |
//! | `{"command":"client.show","client_id":"x"}` | the session in detail |
//! | `{"command":"client.disconnect","client_id":"x"}` | `{}` |
//! | `{"command":"client.delete-session","client_id":"x"}` | `{}`; refused while connected |
//! | `{"command":"bridge.list"}` | `{"bridges":[{name, client_id, connected, queued, ...}]}` |
//! | `{"command":"bridge.show","name":"x"}` | one bridge in detail |
//! | `{"command":"user.add","username":"u","credentials":{"password_hash":"h","scram":[]}}` | `{}`; `conflict` when the user exists |
//! | `{"command":"user.passwd","username":"u","credentials":{"password_hash":"h","scram":[]}}` | `{}` |
//! | `{"command":"user.remove","username":"u"}` | `{"disconnected": clients of the user cut off}` |
//! | `{"command":"user.list"}` | `{"users":[{username, groups, roles, scram}]}` |
//! | `{"command":"user.show","username":"u"}` | `{username, groups, roles, scram, rules}` |
//! | `{"command":"user.add-role","username":"u","role":"r"}` | `{}` |
//! | `{"command":"user.remove-role","username":"u","role":"r"}` | `{}` |
//! | `{"command":"group.create","group":"g"}` | `{}`; `conflict` when the group exists |
//! | `{"command":"group.delete","group":"g"}` | `{}` |
//! | `{"command":"group.list"}` | `{"groups":[{group, roles, users}]}` |
//! | `{"command":"group.show","group":"g"}` | `{group, roles, users}` |
//! | `{"command":"group.add-user","group":"g","username":"u"}` | `{}` |
//! | `{"command":"group.remove-user","group":"g","username":"u"}` | `{}` |
//! | `{"command":"group.add-role","group":"g","role":"r"}` | `{}` |
//! | `{"command":"group.remove-role","group":"g","role":"r"}` | `{}` |
//! | `{"command":"role.create","role":"r"}` | `{}`; `conflict` when the role exists |
//! | `{"command":"role.delete","role":"r"}` | `{}` |
//! | `{"command":"role.list"}` | `{"roles":[{role, rules}]}` |
//! | `{"command":"role.show","role":"r"}` | `{role, rules: [{access, topic}], users, groups}` |
//! | `{"command":"acl.add","role":"r","access":"read","topic":"t/#"}` | `{}` |
//! | `{"command":"acl.remove","role":"r","access":"read","topic":"t/#"}` | `{}` |
//! | `{"command":"stream.list"}` | `{"streams":[{name, filter, messages, bytes, first_offset, last_offset, readers, ...}]}` |
//! | `{"command":"stream.show","name":"x"}` | one stream in detail |
//! | `{"command":"stream.create","name":"x","filter":"t/#","max_age":0,"max_bytes":0,"last_value":false}` | the new stream (the bounds optional, 0 / false by default) |
//! | `{"command":"stream.delete","name":"x"}` | `{}`; refused for a stream of the configuration file |
//! | `{"command":"cluster.status"}` | [`ClusterStatus`]: `{node, state, nodes, clients, retained_stamps, retained_out, retained_in, members: [{node, state, this, clients, ...}]}`; `unsupported` when cluster mode is off |
//!
//! The `user.*`, `group.*`, `role.*` and `acl.*` requests change the access rules kept in
//! storage (`[auth] backend = "storage"`, docs/access.md); another broker answers them with
//! `unsupported`. `credentials` is what `mercurioctl` computes from a password, which never
//! travels: `password_hash` (argon2id in the PHC format, or mosquitto_passwd's `$7$`/`$6$`)
//! and `scram`, the SCRAM keys per mechanism
//! (`{"mechanism":"SCRAM-SHA-256","iterations":4096,"salt":..,"stored_key":..,"server_key":..}`,
//! base64).
//!
//! The answer ([`Answer`]) is `{"ok":true,"result":...}` or
//! `{"ok":false,"error":"one line","code":...}`; the code ([`ErrorCode`]) says why, and the
//! remote admin API turns it into the HTTP status.
//!
//! [`socket_path`]: where the admin socket is when the configuration does not say.

mod cluster;
pub mod socket_path;

pub use cluster::{ClusterNode, ClusterStatus, Heartbeat, NodeState};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// One admin request. Serialised with serde as a JSON object whose `command` names the
/// variant (the table of the [module](self) shows each one's exact JSON); a request with an
/// unknown command, a missing argument or an argument of another command is refused by
/// [`Request::parse`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", deny_unknown_fields)]
pub enum Request {
    /// `broker.status`: version, uptime, clients, sessions, storage state, log level, listeners.
    #[serde(rename = "broker.status")]
    Status,
    /// `broker.log-level`: replaces the log filter until the broker restarts or a SIGHUP
    /// rereads the file. `level` is a level or per-module directives, as `[logging] level`.
    #[serde(rename = "broker.log-level")]
    LogLevel {
        /// The directives, e.g. `debug` or `info,mercurio::connections=off`.
        level: String,
    },
    /// `client.list`: every session, connected or not.
    #[serde(rename = "client.list")]
    ClientList,
    /// `client.show`: one session in detail; `not_found` when there is none.
    #[serde(rename = "client.show")]
    ClientShow {
        /// The client identifier.
        client_id: String,
    },
    /// `client.disconnect`: closes a client's connection (an MQTT 5.0 client gets DISCONNECT
    /// 0x98, Administrative action); `conflict` when it is not connected.
    #[serde(rename = "client.disconnect")]
    ClientDisconnect {
        /// The client identifier.
        client_id: String,
    },
    /// `client.delete-session`: ends the session of a client that is not connected;
    /// `conflict` while it is.
    #[serde(rename = "client.delete-session")]
    ClientDeleteSession {
        /// The client identifier.
        client_id: String,
    },
    /// `bridge.list`: every configured bridge with its state and counters.
    #[serde(rename = "bridge.list")]
    BridgeList,
    /// `bridge.show`: one bridge in detail; `not_found` when no bridge has this name.
    #[serde(rename = "bridge.show")]
    BridgeShow {
        /// The bridge's name (`[[bridges]] name`).
        name: String,
    },
    /// `user.add`: a new user in storage with its credentials; `conflict` when it exists.
    #[serde(rename = "user.add")]
    UserAdd {
        /// The user name.
        username: String,
        /// `{"password_hash": .., "scram": [..]}` (see the [module](self)).
        credentials: Value,
    },
    /// `user.passwd`: replaces a stored user's credentials; `not_found` when there is none.
    #[serde(rename = "user.passwd")]
    UserPasswd {
        /// The user name.
        username: String,
        /// `{"password_hash": .., "scram": [..]}` (see the [module](self)).
        credentials: Value,
    },
    /// `user.remove`: deletes a stored user and disconnects its clients.
    #[serde(rename = "user.remove")]
    UserRemove {
        /// The user name.
        username: String,
    },
    /// `user.list`: every stored user.
    #[serde(rename = "user.list")]
    UserList,
    /// `user.show`: one stored user, with the rules it gets.
    #[serde(rename = "user.show")]
    UserShow {
        /// The user name.
        username: String,
    },
    /// `user.add-role`: gives a user a role of its own.
    #[serde(rename = "user.add-role")]
    UserAddRole {
        /// The user name.
        username: String,
        /// The role.
        role: String,
    },
    /// `user.remove-role`: takes a role of its own from a user.
    #[serde(rename = "user.remove-role")]
    UserRemoveRole {
        /// The user name.
        username: String,
        /// The role.
        role: String,
    },
    /// `group.create`: a new, empty group.
    #[serde(rename = "group.create")]
    GroupCreate {
        /// The group's name.
        group: String,
    },
    /// `group.delete`: deletes a group (its users leave it).
    #[serde(rename = "group.delete")]
    GroupDelete {
        /// The group's name.
        group: String,
    },
    /// `group.list`: every group.
    #[serde(rename = "group.list")]
    GroupList,
    /// `group.show`: one group, its roles and users.
    #[serde(rename = "group.show")]
    GroupShow {
        /// The group's name.
        group: String,
    },
    /// `group.add-user`: puts a user in a group.
    #[serde(rename = "group.add-user")]
    GroupAddUser {
        /// The group's name.
        group: String,
        /// The user name.
        username: String,
    },
    /// `group.remove-user`: takes a user out of a group.
    #[serde(rename = "group.remove-user")]
    GroupRemoveUser {
        /// The group's name.
        group: String,
        /// The user name.
        username: String,
    },
    /// `group.add-role`: gives a group's users a role.
    #[serde(rename = "group.add-role")]
    GroupAddRole {
        /// The group's name.
        group: String,
        /// The role.
        role: String,
    },
    /// `group.remove-role`: takes a role from a group.
    #[serde(rename = "group.remove-role")]
    GroupRemoveRole {
        /// The group's name.
        group: String,
        /// The role.
        role: String,
    },
    /// `role.create`: a new role without rules.
    #[serde(rename = "role.create")]
    RoleCreate {
        /// The role's name.
        role: String,
    },
    /// `role.delete`: deletes a role (users and groups lose it).
    #[serde(rename = "role.delete")]
    RoleDelete {
        /// The role's name.
        role: String,
    },
    /// `role.list`: every role with its rules.
    #[serde(rename = "role.list")]
    RoleList,
    /// `role.show`: one role, its rules, and who has it.
    #[serde(rename = "role.show")]
    RoleShow {
        /// The role's name.
        role: String,
    },
    /// `acl.add`: adds a rule to a role (at its end; kept once).
    #[serde(rename = "acl.add")]
    AclAdd {
        /// The role's name.
        role: String,
        /// `read`, `write`, `readwrite` or `deny`, as in an ACL file.
        access: String,
        /// A topic filter; `%c` and `%u` stand for the client identifier and the user name.
        topic: String,
    },
    /// `acl.remove`: removes a rule from a role.
    #[serde(rename = "acl.remove")]
    AclRemove {
        /// The role's name.
        role: String,
        /// `read`, `write`, `readwrite` or `deny`.
        access: String,
        /// The rule's topic filter.
        topic: String,
    },
    /// `stream.list`: every stream (`[[streams]]`) with what it holds and its readers.
    #[serde(rename = "stream.list")]
    StreamList,
    /// `stream.show`: one stream in detail; `not_found` when no stream has this name.
    #[serde(rename = "stream.show")]
    StreamShow {
        /// The stream's name (`[[streams]] name`).
        name: String,
    },
    /// `stream.create`: creates a stream while the broker runs, kept across restarts with
    /// storage; `conflict` when the name is in use, `bad_request` for a bad name or filter.
    #[serde(rename = "stream.create")]
    StreamCreate {
        /// The new stream's name (letters, digits, `_`, `-`, `.`).
        name: String,
        /// The topic filter of the messages it takes.
        filter: String,
        /// Seconds a message stays; 0 (default) = no limit.
        #[serde(default)]
        max_age: u64,
        /// Bytes it holds at most; 0 (default) = no limit.
        #[serde(default)]
        max_bytes: u64,
        /// Keep only the newest message of each topic (default false).
        #[serde(default)]
        last_value: bool,
    },
    /// `stream.delete`: deletes a stream created at run time; `not_found`, or `conflict` for
    /// a stream of the configuration file.
    #[serde(rename = "stream.delete")]
    StreamDelete {
        /// The stream's name.
        name: String,
    },
    /// `cluster.status`: the nodes of the cluster as this node sees them ([`ClusterStatus`]);
    /// `unsupported` when cluster mode is off.
    #[serde(rename = "cluster.status")]
    ClusterStatus,
}

impl Request {
    /// The request a JSON value holds: an object with a known `command` and exactly that
    /// command's arguments. Errors: one line saying what is wrong (`a request is a JSON
    /// object`, serde's `unknown variant ...` or `missing field ...`, `unknown field ...`).
    ///
    /// serde's `deny_unknown_fields` does not apply to the unit variants of a tagged enum, so
    /// the fields of the object are checked against [`Request::arguments`] here.
    pub fn parse(value: Value) -> Result<Request, String> {
        let Some(object) = value.as_object() else {
            return Err("a request is a JSON object".into());
        };
        let keys: Vec<String> = object.keys().cloned().collect();
        let request: Request = serde_json::from_value(value).map_err(|e| e.to_string())?;
        let arguments = request.arguments();
        match keys
            .iter()
            .find(|k| *k != "command" && !arguments.contains(&k.as_str()))
        {
            Some(key) => Err(format!("unknown field `{key}`")),
            None => Ok(request),
        }
    }

    /// The request as JSON text on one line, `command` first, then its arguments in the
    /// order of the [module](self)'s table: what mercurioctl writes on the admin socket
    /// (followed by a newline).
    pub fn to_line(&self) -> String {
        // A derived Serialize of an enum of strings cannot fail; the fallback is never used.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// True for the requests about the access rules kept in storage: `user.*`, `group.*`,
    /// `role.*`, `acl.*`.
    pub fn is_access(&self) -> bool {
        // Named one by one, so that a request added later is not taken for one of them.
        matches!(
            self,
            Request::UserAdd { .. }
                | Request::UserPasswd { .. }
                | Request::UserRemove { .. }
                | Request::UserList
                | Request::UserShow { .. }
                | Request::UserAddRole { .. }
                | Request::UserRemoveRole { .. }
                | Request::GroupCreate { .. }
                | Request::GroupDelete { .. }
                | Request::GroupList
                | Request::GroupShow { .. }
                | Request::GroupAddUser { .. }
                | Request::GroupRemoveUser { .. }
                | Request::GroupAddRole { .. }
                | Request::GroupRemoveRole { .. }
                | Request::RoleCreate { .. }
                | Request::RoleDelete { .. }
                | Request::RoleList
                | Request::RoleShow { .. }
                | Request::AclAdd { .. }
                | Request::AclRemove { .. }
        )
    }

    /// The names of the arguments this request's command takes, besides `command`.
    pub fn arguments(&self) -> &'static [&'static str] {
        match self {
            Request::Status
            | Request::ClientList
            | Request::BridgeList
            | Request::UserList
            | Request::GroupList
            | Request::RoleList
            | Request::StreamList
            | Request::ClusterStatus => &[],
            Request::UserAdd { .. } | Request::UserPasswd { .. } => &["username", "credentials"],
            Request::UserRemove { .. } | Request::UserShow { .. } => &["username"],
            Request::UserAddRole { .. } | Request::UserRemoveRole { .. } => &["username", "role"],
            Request::GroupCreate { .. }
            | Request::GroupDelete { .. }
            | Request::GroupShow { .. } => &["group"],
            Request::GroupAddUser { .. } | Request::GroupRemoveUser { .. } => {
                &["group", "username"]
            }
            Request::GroupAddRole { .. } | Request::GroupRemoveRole { .. } => &["group", "role"],
            Request::RoleCreate { .. } | Request::RoleDelete { .. } | Request::RoleShow { .. } => {
                &["role"]
            }
            Request::AclAdd { .. } | Request::AclRemove { .. } => &["role", "access", "topic"],
            Request::LogLevel { .. } => &["level"],
            Request::BridgeShow { .. }
            | Request::StreamShow { .. }
            | Request::StreamDelete { .. } => &["name"],
            Request::StreamCreate { .. } => {
                &["name", "filter", "max_age", "max_bytes", "last_value"]
            }
            Request::ClientShow { .. }
            | Request::ClientDisconnect { .. }
            | Request::ClientDeleteSession { .. } => &["client_id"],
        }
    }
}

/// Why a request was refused: an answer's `code`, which the remote admin API turns into the
/// HTTP status (in parentheses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// No such client, bridge or stream (404).
    NotFound,
    /// The client's state does not allow it: disconnecting a client that is not connected,
    /// deleting the session of one that is (409).
    Conflict,
    /// A malformed request or a bad argument, such as an invalid log level (400). An answer
    /// with no code, or one this version does not know, reads as this one.
    BadRequest,
    /// The broker could not do it, e.g. storage failed (500).
    Failed,
    /// This broker does not offer the operation (404).
    Unsupported,
    /// Not serving yet: starting (restoring from storage), or a standby waiting for the
    /// serving broker (503). Ask again once it serves.
    Unavailable,
}

impl ErrorCode {
    /// The code as it is written in an answer: `not_found`, `conflict`, `bad_request`,
    /// `failed`, `unsupported`, `unavailable`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Failed => "failed",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Unavailable => "unavailable",
        }
    }
}

/// The answer to one request: the envelope around its result or its refusal.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// `{"ok":true,"result":...}`: the command's result (the table of the [module](self)).
    Ok(Value),
    /// `{"ok":false,"error":"one line","code":"..."}`.
    Refused {
        /// Why, in one line.
        error: String,
        /// What kind of refusal.
        code: ErrorCode,
    },
}

impl Answer {
    /// A refusal with `code`.
    pub fn refused(code: ErrorCode, error: impl Into<String>) -> Answer {
        Answer::Refused {
            error: error.into(),
            code,
        }
    }

    /// A refusal of a malformed request or bad argument ([`ErrorCode::BadRequest`]).
    pub fn bad_request(error: impl Into<String>) -> Answer {
        Answer::refused(ErrorCode::BadRequest, error)
    }

    /// The answer as its JSON object.
    pub fn to_json(&self) -> Value {
        match self {
            Answer::Ok(result) => json!({"ok": true, "result": result}),
            Answer::Refused { error, code } => {
                json!({"ok": false, "error": error, "code": code.as_str()})
            }
        }
    }

    /// The answer a JSON object holds. `"ok": true` is a result (`null` when it has none);
    /// anything else is a refusal, its `error` defaulting to "refused without a reason" and an
    /// unknown or missing `code` read as [`ErrorCode::BadRequest`].
    pub fn from_json(answer: &Value) -> Answer {
        if answer.get("ok") == Some(&Value::Bool(true)) {
            return Answer::Ok(answer.get("result").cloned().unwrap_or(Value::Null));
        }
        let error = answer
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("refused without a reason");
        let code = answer
            .get("code")
            .cloned()
            .and_then(|c| serde_json::from_value(c).ok())
            .unwrap_or(ErrorCode::BadRequest);
        Answer::refused(code, error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each request serialises to exactly the JSON of the module's table, and that JSON
    /// parses back to the same request.
    #[test]
    fn each_request_is_the_json_of_the_table() {
        let table = include_str!("mod.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//! | `{"))
            .map(|l| format!("{{{}", l.split('`').next().unwrap_or_default()))
            .collect::<Vec<_>>();
        let requests = [
            Request::Status,
            Request::LogLevel {
                level: "debug".into(),
            },
            Request::ClientList,
            Request::ClientShow {
                client_id: "x".into(),
            },
            Request::ClientDisconnect {
                client_id: "x".into(),
            },
            Request::ClientDeleteSession {
                client_id: "x".into(),
            },
            Request::BridgeList,
            Request::BridgeShow { name: "x".into() },
            Request::UserAdd {
                username: "u".into(),
                credentials: json!({"password_hash": "h", "scram": []}),
            },
            Request::UserPasswd {
                username: "u".into(),
                credentials: json!({"password_hash": "h", "scram": []}),
            },
            Request::UserRemove {
                username: "u".into(),
            },
            Request::UserList,
            Request::UserShow {
                username: "u".into(),
            },
            Request::UserAddRole {
                username: "u".into(),
                role: "r".into(),
            },
            Request::UserRemoveRole {
                username: "u".into(),
                role: "r".into(),
            },
            Request::GroupCreate { group: "g".into() },
            Request::GroupDelete { group: "g".into() },
            Request::GroupList,
            Request::GroupShow { group: "g".into() },
            Request::GroupAddUser {
                group: "g".into(),
                username: "u".into(),
            },
            Request::GroupRemoveUser {
                group: "g".into(),
                username: "u".into(),
            },
            Request::GroupAddRole {
                group: "g".into(),
                role: "r".into(),
            },
            Request::GroupRemoveRole {
                group: "g".into(),
                role: "r".into(),
            },
            Request::RoleCreate { role: "r".into() },
            Request::RoleDelete { role: "r".into() },
            Request::RoleList,
            Request::RoleShow { role: "r".into() },
            Request::AclAdd {
                role: "r".into(),
                access: "read".into(),
                topic: "t/#".into(),
            },
            Request::AclRemove {
                role: "r".into(),
                access: "read".into(),
                topic: "t/#".into(),
            },
            Request::StreamList,
            Request::StreamShow { name: "x".into() },
            Request::StreamCreate {
                name: "x".into(),
                filter: "t/#".into(),
                max_age: 0,
                max_bytes: 0,
                last_value: false,
            },
            Request::StreamDelete { name: "x".into() },
            Request::ClusterStatus,
        ];
        assert_eq!(table.len(), requests.len(), "{table:?}");
        for (request, json) in requests.iter().zip(&table) {
            assert_eq!(&request.to_line(), json);
            let value: Value = serde_json::from_str(json).expect("the table's JSON");
            assert_eq!(&Request::parse(value).expect("parses"), request);
        }
    }

    #[test]
    fn malformed_requests_are_refused() {
        let e = |v: Value| Request::parse(v).expect_err("refused");
        assert_eq!(e(json!([1])), "a request is a JSON object");
        assert!(e(json!({"command": "client.list", "client_id": "x"}))
            .contains("unknown field `client_id`"));
        assert!(e(json!({"command": "client.show"})).contains("missing field `client_id`"));
        assert!(e(json!({"command": "broker.reboot"})).contains("unknown variant"));
        assert!(e(json!({"command": "bridge.show", "name": "a", "x": 1})).contains("unknown field"));
    }

    #[test]
    fn answers_round_trip() {
        let ok = Answer::Ok(json!({"level": "debug"}));
        assert_eq!(
            ok.to_json().to_string(),
            r#"{"ok":true,"result":{"level":"debug"}}"#
        );
        assert_eq!(Answer::from_json(&ok.to_json()), ok);
        let refused = Answer::refused(ErrorCode::NotFound, "no such client: x");
        assert_eq!(
            refused.to_json().to_string(),
            r#"{"code":"not_found","error":"no such client: x","ok":false}"#
        );
        assert_eq!(Answer::from_json(&refused.to_json()), refused);
        assert_eq!(
            Answer::from_json(&json!({"ok": false, "error": "e", "code": "teapot"})),
            Answer::bad_request("e")
        );
    }

    #[test]
    fn only_user_group_role_and_acl_requests_are_access_requests() {
        for command in ["user.list", "group.list", "role.list"] {
            let request: Request = serde_json::from_value(json!({ "command": command })).unwrap();
            assert!(request.is_access(), "{command}");
        }
        for request in [
            Request::Status,
            Request::BridgeList,
            Request::StreamList,
            Request::StreamShow { name: "s".into() },
            Request::StreamDelete { name: "s".into() },
            Request::ClusterStatus,
        ] {
            assert!(!request.is_access(), "{request:?}");
        }
    }
}
