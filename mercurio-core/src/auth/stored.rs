//! Users, groups, roles and their access rules kept in storage (`[auth] backend =
//! "storage"`), changed at runtime through the admin protocol (`mercurioctl user|group|role|
//! acl`), after mosquitto's dynamic security plugin:
//!
//! - a **user** has credentials (a password hash in mosquitto_passwd's `$7$` / `$6$` format
//!   or argon2id, and SCRAM keys per mechanism, see [`scram`](super::scram)), roles of its own
//!   and groups;
//! - a **group** has roles; the group named `anonymous` gives its roles to clients without a
//!   user name;
//! - a **role** has rules, each an access (`read`, `write`, `readwrite`, `deny`) and a topic
//!   filter where `%c` and `%u` stand for the client identifier and the user name, decided as
//!   the lines of an ACL file are (a `deny` that matches wins; what no rule allows is denied).
//!
//! As an [`Authenticator`] ([`StoredPasswords`]), it decides for the users it holds (their password
//! must match; a user without a password hash connects only through SCRAM) and has no opinion
//! on other user names (the password file decides next). As an [`Authorizer`] it decides for
//! its users, and for anonymous clients when the `anonymous` group exists; for other clients
//! the ACL file decides next, and without one they are denied (the chain's default,
//! [`Auth`](super::Auth)).
//!
//! The records are stored through [`Storage::apply_access`] before a change is answered, and
//! read at start ([`Storage::load_access`]): a PostgreSQL standby reads them when it takes
//! over. Records are JSON in storage ([`UserRecord`], [`GroupRecord`], [`RoleRecord`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use mercurio_storage::{AccessChange, AccessKind, AccessRecord, Storage, StorageError};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::acl::{self, Access, Rule};
use super::hooks::{
    AccessRequest, AuthContinuation, AuthStep, Authentication, Authenticator, Authorizer,
    ConnectInfo, Decision, DenyReason, EnhancedAuthenticator,
};
use super::password_file::{FileAuthenticator, PasswordHash};
use super::scram::{Mechanism, ScramError, ScramKeys, ScramServer};
use crate::admin::{Answer, ErrorCode, Request};

/// The group whose roles apply to clients without a user name.
pub const ANONYMOUS_GROUP: &str = "anonymous";

/// What `user.add` / `user.passwd` carry: made from a password by
/// [`Credentials::from_password`] (mercurioctl), so the password itself never travels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    /// argon2id (PHC string) or mosquitto_passwd's `$7$` / `$6$`; `None`: SCRAM only.
    #[serde(default)]
    pub password_hash: Option<String>,
    /// SCRAM keys, one per mechanism.
    #[serde(default)]
    pub scram: Vec<ScramKeys>,
}

impl Credentials {
    /// An argon2id hash and SCRAM-SHA-256 and SCRAM-SHA-512 keys of `password` (random
    /// salts). CPU-bound: tens of milliseconds.
    ///
    /// Errors: the operating system's random source failed.
    pub fn from_password(password: &[u8]) -> Result<Credentials, String> {
        let scram = Mechanism::ALL
            .into_iter()
            .map(|m| ScramKeys::derive(m, password))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Credentials {
            password_hash: Some(super::password_file::hash_password(password)),
            scram,
        })
    }

    /// Checks the hash's format and the SCRAM keys, one per mechanism at most.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(h) = &self.password_hash {
            PasswordHash::parse(h).map_err(|e| format!("password_hash: {e}"))?;
        }
        let mut seen = BTreeSet::new();
        for k in &self.scram {
            k.validate()?;
            if !seen.insert(k.mechanism.name()) {
                return Err(format!("two sets of {} keys", k.mechanism));
            }
        }
        if self.password_hash.is_none() && self.scram.is_empty() {
            return Err("no password hash and no SCRAM keys".into());
        }
        Ok(())
    }
}

/// A user as stored (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct UserRecord {
    /// Its credentials.
    #[serde(flatten)]
    pub credentials: Credentials,
    /// Its groups, by name.
    pub groups: Vec<String>,
    /// Its own roles, by name.
    pub roles: Vec<String>,
}

/// A group as stored (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct GroupRecord {
    /// Its roles, by name.
    pub roles: Vec<String>,
}

/// One rule of a role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleRecord {
    /// `read`, `write`, `readwrite` or `deny`.
    pub access: String,
    /// A topic filter, `%c` / `%u` substituted.
    pub topic: String,
}

/// A role as stored (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct RoleRecord {
    /// Its rules, in order.
    pub rules: Vec<RuleRecord>,
}

/// Everything stored, and what the checks read from it.
#[derive(Debug, Clone, Default)]
struct Model {
    users: BTreeMap<String, UserRecord>,
    groups: BTreeMap<String, GroupRecord>,
    roles: BTreeMap<String, RoleRecord>,
    /// Parsed password hashes, by user.
    hashes: HashMap<String, Arc<PasswordHash>>,
    /// The rules each user gets (its roles', then its groups' roles').
    rules: HashMap<String, Vec<Rule>>,
    /// The rules of clients without a user name (the `anonymous` group's roles), when the
    /// group exists.
    anonymous: Option<Vec<Rule>>,
}

impl Model {
    /// Recomputes the parsed hashes and the rules.
    fn index(&mut self) {
        self.hashes = self
            .users
            .iter()
            .filter_map(|(name, u)| {
                let h = PasswordHash::parse(u.credentials.password_hash.as_deref()?).ok()?;
                Some((name.clone(), Arc::new(h)))
            })
            .collect();
        let role_rules = |role: &str, out: &mut Vec<Rule>| {
            if let Some(r) = self.roles.get(role) {
                for rule in &r.rules {
                    if let Some(access) = acl::parse_access(&rule.access) {
                        out.push(Rule::pattern(access, rule.topic.clone()));
                    }
                }
            }
        };
        let group_rules = |group: &str, out: &mut Vec<Rule>| {
            if let Some(g) = self.groups.get(group) {
                for role in &g.roles {
                    role_rules(role, out);
                }
            }
        };
        self.rules = self
            .users
            .iter()
            .map(|(name, u)| {
                let mut out = Vec::new();
                for role in &u.roles {
                    role_rules(role, &mut out);
                }
                for group in &u.groups {
                    group_rules(group, &mut out);
                }
                (name.clone(), out)
            })
            .collect();
        self.anonymous = self.groups.contains_key(ANONYMOUS_GROUP).then(|| {
            let mut out = Vec::new();
            group_rules(ANONYMOUS_GROUP, &mut out);
            out
        });
    }

    /// Builds the model from stored records. A record that cannot be read is skipped with a
    /// warning (a newer version's, a damaged one), naming it.
    fn from_records(records: Vec<AccessRecord>) -> Model {
        let mut m = Model::default();
        for r in records {
            let read = match r.kind {
                AccessKind::User => serde_json::from_str(&r.body).map(|u| {
                    m.users.insert(r.name.clone(), u);
                }),
                AccessKind::Group => serde_json::from_str(&r.body).map(|g| {
                    m.groups.insert(r.name.clone(), g);
                }),
                AccessKind::Role => serde_json::from_str(&r.body).map(|x| {
                    m.roles.insert(r.name.clone(), x);
                }),
            };
            if let Err(e) = read {
                tracing::warn!(kind = r.kind.as_str(), name = %r.name, "stored access record skipped: {e}");
            }
        }
        m.index();
        m
    }
}

/// The stored users, groups and roles of one broker: an authenticator, an authorizer, the
/// SCRAM enhanced authenticator, and the admin requests that change them.
pub struct StoredAccess {
    storage: RwLock<Option<Arc<dyn Storage>>>,
    model: RwLock<Arc<Model>>,
    /// Serializes changes: each reads the model, stores, then swaps the model.
    changing: tokio::sync::Mutex<()>,
    /// Runs password checks on the blocking pool, bounded (no file of its own).
    checks: FileAuthenticator,
    /// Random key of the salts shown for user names without SCRAM keys.
    decoy_key: [u8; 32],
}

impl StoredAccess {
    /// Empty, until [`attach`](Self::attach)ed to its storage.
    pub(crate) fn new() -> StoredAccess {
        let mut decoy_key = [0u8; 32];
        if getrandom::fill(&mut decoy_key).is_err() {
            tracing::warn!(
                "no random key for SCRAM decoy salts: using the process's address space layout"
            );
            let here = &decoy_key as *const _ as usize;
            decoy_key[..8].copy_from_slice(&here.to_le_bytes());
        }
        StoredAccess {
            storage: RwLock::new(None),
            model: RwLock::new(Arc::new(Model::default())),
            changing: tokio::sync::Mutex::new(()),
            checks: FileAuthenticator::new(false, None).unwrap_or_else(|_| unreachable!()),
            decoy_key,
        }
    }

    /// Reads the stored records and keeps `storage` for changes.
    pub(crate) async fn attach(&self, storage: Arc<dyn Storage>) -> Result<(), StorageError> {
        let records = storage.load_access().await?;
        let model = Model::from_records(records);
        tracing::info!(
            users = model.users.len(),
            groups = model.groups.len(),
            roles = model.roles.len(),
            "access rules loaded from storage"
        );
        *self.model.write() = Arc::new(model);
        *self.storage.write() = Some(storage);
        Ok(())
    }

    /// Whether a user of this name is stored.
    #[cfg(test)]
    pub(crate) fn has_user(&self, name: &str) -> bool {
        self.model.read().users.contains_key(name)
    }

    fn snapshot(&self) -> Arc<Model> {
        Arc::clone(&self.model.read())
    }

    fn decoy_salt(&self, user: &str) -> Vec<u8> {
        Mechanism::Sha256.hmac(&self.decoy_key, user.as_bytes())[..16].to_vec()
    }
}

/// What a change did, for the broker to act on.
#[derive(Debug, Default)]
pub(crate) struct Effect {
    /// The rules changed: revoke what clients may no longer hold.
    pub(crate) rules_changed: bool,
    /// This user was removed: disconnect its clients.
    pub(crate) removed_user: Option<String>,
}

fn not_found(what: &str, name: &str) -> Answer {
    Answer::refused(ErrorCode::NotFound, format!("no such {what}: {name}"))
}

fn check_name(what: &str, name: &str) -> Result<(), Answer> {
    if name.is_empty() || name.contains('\0') || name.len() > 65_535 {
        return Err(Answer::bad_request(format!(
            "a {what} name must be 1 to 65,535 bytes, without NUL"
        )));
    }
    Ok(())
}

fn rule_json(r: &RuleRecord) -> Value {
    json!({"access": r.access, "topic": r.topic})
}

impl StoredAccess {
    /// Answers one `user.*`, `group.*`, `role.*` or `acl.*` request: the change stored, then
    /// in force. Other requests are `None`.
    pub(crate) async fn answer(&self, request: &Request) -> Option<(Answer, Effect)> {
        let read_only = matches!(
            request,
            Request::UserList
                | Request::UserShow { .. }
                | Request::GroupList
                | Request::GroupShow { .. }
                | Request::RoleList
                | Request::RoleShow { .. }
        );
        if read_only {
            return Some((self.read(request)?, Effect::default()));
        }
        let _changing = self.changing.lock().await;
        let mut model = (*self.snapshot()).clone();
        let mut effect = Effect::default();
        let changes = match self.change(&mut model, request, &mut effect)? {
            Ok(changes) => changes,
            Err(refusal) => return Some((refusal, Effect::default())),
        };
        let Some(storage) = self.storage.read().clone() else {
            return Some((
                Answer::refused(ErrorCode::Failed, "the access rules' storage is not open"),
                Effect::default(),
            ));
        };
        if !changes.is_empty() {
            if let Err(e) = storage.apply_access(&changes).await {
                return Some((
                    Answer::refused(ErrorCode::Failed, format!("storage: {e}")),
                    Effect::default(),
                ));
            }
        }
        model.index();
        *self.model.write() = Arc::new(model);
        tracing::info!(request = %request_name(request), "access rules changed");
        Some((Answer::Ok(json!({})), effect))
    }

    fn read(&self, request: &Request) -> Option<Answer> {
        let m = self.snapshot();
        let user_json = |name: &str, u: &UserRecord| {
            json!({
                "username": name,
                "groups": u.groups,
                "roles": u.roles,
                "password": u.credentials.password_hash.is_some(),
                "scram": u.credentials.scram.iter().map(|k| k.mechanism.name()).collect::<Vec<_>>(),
            })
        };
        let group_json = |name: &str, g: &GroupRecord| {
            let users: Vec<&String> = m
                .users
                .iter()
                .filter(|(_, u)| u.groups.iter().any(|x| x == name))
                .map(|(n, _)| n)
                .collect();
            json!({"group": name, "roles": g.roles, "users": users})
        };
        let role_json = |name: &str, r: &RoleRecord| json!({"role": name, "rules": r.rules.iter().map(rule_json).collect::<Vec<_>>()});
        Some(match request {
            Request::UserList => Answer::Ok(json!({
                "users": m.users.iter().map(|(n, u)| user_json(n, u)).collect::<Vec<_>>()
            })),
            Request::UserShow { username } => match m.users.get(username) {
                Some(u) => {
                    let mut v = user_json(username, u);
                    let rules: Vec<Value> = m.rules.get(username).map_or(Vec::new(), |rs| {
                        rs.iter()
                            .map(|r| json!({"access": r.access.as_str(), "topic": r.filter}))
                            .collect()
                    });
                    v["rules"] = Value::Array(rules);
                    Answer::Ok(v)
                }
                None => not_found("user", username),
            },
            Request::GroupList => Answer::Ok(json!({
                "groups": m.groups.iter().map(|(n, g)| group_json(n, g)).collect::<Vec<_>>()
            })),
            Request::GroupShow { group } => match m.groups.get(group) {
                Some(g) => Answer::Ok(group_json(group, g)),
                None => not_found("group", group),
            },
            Request::RoleList => Answer::Ok(json!({
                "roles": m.roles.iter().map(|(n, r)| role_json(n, r)).collect::<Vec<_>>()
            })),
            Request::RoleShow { role } => match m.roles.get(role) {
                Some(r) => {
                    let mut v = role_json(role, r);
                    let users: Vec<&String> = m
                        .users
                        .iter()
                        .filter(|(_, u)| u.roles.iter().any(|x| x == role))
                        .map(|(n, _)| n)
                        .collect();
                    let groups: Vec<&String> = m
                        .groups
                        .iter()
                        .filter(|(_, g)| g.roles.iter().any(|x| x == role))
                        .map(|(n, _)| n)
                        .collect();
                    v["users"] = json!(users);
                    v["groups"] = json!(groups);
                    Answer::Ok(v)
                }
                None => not_found("role", role),
            },
            _ => return None,
        })
    }

    /// Applies `request` to `m`; the records to store, or the refusal. `None` for a request
    /// that is not about access rules.
    #[allow(clippy::type_complexity)]
    fn change(
        &self,
        m: &mut Model,
        request: &Request,
        effect: &mut Effect,
    ) -> Option<Result<Vec<AccessChange>, Answer>> {
        fn put<T: Serialize>(kind: AccessKind, name: &str, body: &T) -> AccessChange {
            AccessChange::Put(AccessRecord {
                kind,
                name: name.to_string(),
                // Serializing plain data into a string cannot fail.
                body: serde_json::to_string(body).unwrap_or_default(),
            })
        }
        fn deleted(kind: AccessKind, name: &str) -> AccessChange {
            AccessChange::Deleted {
                kind,
                name: name.to_string(),
            }
        }
        fn credentials(v: &Value) -> Result<Credentials, Answer> {
            let c: Credentials = serde_json::from_value(v.clone())
                .map_err(|e| Answer::bad_request(format!("credentials: {e}")))?;
            c.validate()
                .map_err(|e| Answer::bad_request(format!("credentials: {e}")))?;
            Ok(c)
        }
        fn add(list: &mut Vec<String>, item: &str) {
            if !list.iter().any(|x| x == item) {
                list.push(item.to_string());
            }
        }
        let result = (|| -> Result<Vec<AccessChange>, Answer> {
            match request {
                Request::UserAdd {
                    username,
                    credentials: c,
                } => {
                    check_name("user", username)?;
                    if m.users.contains_key(username) {
                        return Err(Answer::refused(
                            ErrorCode::Conflict,
                            format!("user {username} exists (user passwd changes its password)"),
                        ));
                    }
                    let user = UserRecord {
                        credentials: credentials(c)?,
                        ..Default::default()
                    };
                    let change = put(AccessKind::User, username, &user);
                    m.users.insert(username.clone(), user);
                    Ok(vec![change])
                }
                Request::UserPasswd {
                    username,
                    credentials: c,
                } => {
                    let c = credentials(c)?;
                    let user = m
                        .users
                        .get_mut(username)
                        .ok_or_else(|| not_found("user", username))?;
                    user.credentials = c;
                    Ok(vec![put(AccessKind::User, username, user)])
                }
                Request::UserRemove { username } => {
                    if m.users.remove(username).is_none() {
                        return Err(not_found("user", username));
                    }
                    effect.removed_user = Some(username.clone());
                    effect.rules_changed = true;
                    Ok(vec![deleted(AccessKind::User, username)])
                }
                Request::UserAddRole { username, role }
                | Request::UserRemoveRole { username, role } => {
                    if !m.roles.contains_key(role) {
                        return Err(not_found("role", role));
                    }
                    let user = m
                        .users
                        .get_mut(username)
                        .ok_or_else(|| not_found("user", username))?;
                    if matches!(request, Request::UserAddRole { .. }) {
                        add(&mut user.roles, role);
                    } else {
                        user.roles.retain(|r| r != role);
                    }
                    effect.rules_changed = true;
                    Ok(vec![put(AccessKind::User, username, user)])
                }
                Request::GroupCreate { group } => {
                    check_name("group", group)?;
                    if m.groups.contains_key(group) {
                        return Err(Answer::refused(
                            ErrorCode::Conflict,
                            format!("group {group} exists"),
                        ));
                    }
                    let g = GroupRecord::default();
                    let change = put(AccessKind::Group, group, &g);
                    m.groups.insert(group.clone(), g);
                    effect.rules_changed = true;
                    Ok(vec![change])
                }
                Request::GroupDelete { group } => {
                    if m.groups.remove(group).is_none() {
                        return Err(not_found("group", group));
                    }
                    let mut changes = vec![deleted(AccessKind::Group, group)];
                    for (name, u) in m.users.iter_mut() {
                        if u.groups.iter().any(|g| g == group) {
                            u.groups.retain(|g| g != group);
                            changes.push(put(AccessKind::User, name, u));
                        }
                    }
                    effect.rules_changed = true;
                    Ok(changes)
                }
                Request::GroupAddUser { group, username }
                | Request::GroupRemoveUser { group, username } => {
                    if !m.groups.contains_key(group) {
                        return Err(not_found("group", group));
                    }
                    let user = m
                        .users
                        .get_mut(username)
                        .ok_or_else(|| not_found("user", username))?;
                    if matches!(request, Request::GroupAddUser { .. }) {
                        add(&mut user.groups, group);
                    } else {
                        user.groups.retain(|g| g != group);
                    }
                    effect.rules_changed = true;
                    Ok(vec![put(AccessKind::User, username, user)])
                }
                Request::GroupAddRole { group, role }
                | Request::GroupRemoveRole { group, role } => {
                    if !m.roles.contains_key(role) {
                        return Err(not_found("role", role));
                    }
                    let g = m
                        .groups
                        .get_mut(group)
                        .ok_or_else(|| not_found("group", group))?;
                    if matches!(request, Request::GroupAddRole { .. }) {
                        add(&mut g.roles, role);
                    } else {
                        g.roles.retain(|r| r != role);
                    }
                    effect.rules_changed = true;
                    Ok(vec![put(AccessKind::Group, group, g)])
                }
                Request::RoleCreate { role } => {
                    check_name("role", role)?;
                    if m.roles.contains_key(role) {
                        return Err(Answer::refused(
                            ErrorCode::Conflict,
                            format!("role {role} exists"),
                        ));
                    }
                    let r = RoleRecord::default();
                    let change = put(AccessKind::Role, role, &r);
                    m.roles.insert(role.clone(), r);
                    Ok(vec![change])
                }
                Request::RoleDelete { role } => {
                    if m.roles.remove(role).is_none() {
                        return Err(not_found("role", role));
                    }
                    let mut changes = vec![deleted(AccessKind::Role, role)];
                    for (name, u) in m.users.iter_mut() {
                        if u.roles.iter().any(|r| r == role) {
                            u.roles.retain(|r| r != role);
                            changes.push(put(AccessKind::User, name, u));
                        }
                    }
                    for (name, g) in m.groups.iter_mut() {
                        if g.roles.iter().any(|r| r == role) {
                            g.roles.retain(|r| r != role);
                            changes.push(put(AccessKind::Group, name, g));
                        }
                    }
                    effect.rules_changed = true;
                    Ok(changes)
                }
                Request::AclAdd {
                    role,
                    access,
                    topic,
                }
                | Request::AclRemove {
                    role,
                    access,
                    topic,
                } => {
                    let Some(a) = acl::parse_access(access) else {
                        return Err(Answer::bad_request(format!(
                            "access {access:?}: expected read, write, readwrite or deny"
                        )));
                    };
                    crate::topic::validate_topic_filter(topic).map_err(|e| {
                        Answer::bad_request(format!("invalid topic filter {topic:?}: {e}"))
                    })?;
                    let r = m
                        .roles
                        .get_mut(role)
                        .ok_or_else(|| not_found("role", role))?;
                    let rule = RuleRecord {
                        access: Access::as_str(a).to_string(),
                        topic: topic.clone(),
                    };
                    if matches!(request, Request::AclAdd { .. }) {
                        if !r.rules.contains(&rule) {
                            r.rules.push(rule);
                        }
                    } else {
                        let before = r.rules.len();
                        r.rules.retain(|x| x != &rule);
                        if r.rules.len() == before {
                            return Err(Answer::refused(
                                ErrorCode::NotFound,
                                format!("role {role} has no rule {} {topic}", a.as_str()),
                            ));
                        }
                    }
                    effect.rules_changed = true;
                    Ok(vec![put(AccessKind::Role, role, r)])
                }
                _ => Err(Answer::bad_request("not an access request")),
            }
        })();
        match request {
            Request::UserAdd { .. }
            | Request::UserPasswd { .. }
            | Request::UserRemove { .. }
            | Request::UserAddRole { .. }
            | Request::UserRemoveRole { .. }
            | Request::GroupCreate { .. }
            | Request::GroupDelete { .. }
            | Request::GroupAddUser { .. }
            | Request::GroupRemoveUser { .. }
            | Request::GroupAddRole { .. }
            | Request::GroupRemoveRole { .. }
            | Request::RoleCreate { .. }
            | Request::RoleDelete { .. }
            | Request::AclAdd { .. }
            | Request::AclRemove { .. } => Some(result),
            _ => None,
        }
    }
}

/// The command a request names, for the log.
fn request_name(request: &Request) -> String {
    let line = request.to_line();
    serde_json::from_str::<Value>(&line)
        .ok()
        .and_then(|v| v["command"].as_str().map(str::to_string))
        .unwrap_or_default()
}

impl StoredAccess {
    /// The password check of a stored user; `NoOpinion` for a name it does not hold. With
    /// `decoy_unknown` (no password file follows, which would check an unknown name against
    /// one of its hashes), an unknown name, or a user without a password hash, costs a check
    /// against a stored hash too, answer ignored: the time to refuse does not tell which
    /// users exist.
    async fn check_password(&self, info: &ConnectInfo, decoy_unknown: bool) -> Authentication {
        if info.username_from_certificate {
            return Authentication::NoOpinion;
        }
        let Some(user) = &info.username else {
            return Authentication::NoOpinion;
        };
        let (known, hash, decoy) = {
            let m = self.model.read();
            (
                m.users.contains_key(user),
                m.hashes.get(user).cloned(),
                m.hashes.values().next().cloned(),
            )
        };
        let password = info.password.clone().unwrap_or_default();
        let verified = match (&hash, info.password.is_some()) {
            (Some(h), true) => {
                let h = Arc::clone(h);
                self.checks.check(user, move || h.verify(&password)).await
            }
            // A user without a password hash connects through SCRAM only.
            _ if known || decoy_unknown => match decoy {
                Some(d) => {
                    self.checks
                        .check(user, move || {
                            let _ = std::hint::black_box(d.verify(&password));
                            false
                        })
                        .await
                }
                None => Ok(false),
            },
            _ => Ok(false),
        };
        match verified {
            _ if !known => Authentication::NoOpinion,
            Ok(true) => Authentication::Allow { username: None },
            Ok(false) => Authentication::Deny(DenyReason::NotAuthorized),
            Err(reason) => Authentication::Deny(reason),
        }
    }
}

/// The stored users as one chain's [`Authenticator`]: `decoy_unknown` when no password file
/// follows in that chain (see [`StoredAccess::check_password`]).
pub(crate) struct StoredPasswords {
    pub(crate) access: Arc<StoredAccess>,
    pub(crate) decoy_unknown: bool,
}

#[async_trait]
impl Authenticator for StoredPasswords {
    async fn authenticate(&self, info: &ConnectInfo) -> Authentication {
        self.access.check_password(info, self.decoy_unknown).await
    }
}

#[async_trait]
impl Authorizer for StoredAccess {
    async fn authorize(&self, request: &AccessRequest<'_>) -> Decision {
        self.authorize_now(request).unwrap_or(Decision::NoOpinion)
    }

    fn authorize_now(&self, request: &AccessRequest<'_>) -> Option<Decision> {
        let m = self.model.read();
        let rules = match request.username {
            Some(u) => m.rules.get(u),
            None => m.anonymous.as_ref(),
        };
        let allowed = match rules {
            Some(rules) => acl::decide(rules.iter(), request),
            None => return Some(Decision::NoOpinion),
        };
        Some(if allowed {
            Decision::Allow
        } else {
            Decision::Deny
        })
    }
}

/// SCRAM-SHA-256 / SCRAM-SHA-512 against the stored users' keys.
#[async_trait]
impl EnhancedAuthenticator for StoredAccess {
    fn supports(&self, method: &str) -> bool {
        Mechanism::from_name(method).is_some()
    }

    async fn start(&self, method: &str, info: &ConnectInfo, data: Option<Bytes>) -> AuthStep {
        let Some(mechanism) = Mechanism::from_name(method) else {
            return AuthStep::Deny(DenyReason::NotAuthorized);
        };
        let data = data.unwrap_or_default();
        let user = match super::scram::client_first_user(&data) {
            Ok(u) => u,
            Err(e) => {
                tracing::info!(client_id = %info.client_id, "{method}: {e}");
                return AuthStep::Deny(DenyReason::NotAuthorized);
            }
        };
        let keys = {
            let m = self.model.read();
            m.users.get(&user).and_then(|u| {
                u.credentials
                    .scram
                    .iter()
                    .find(|k| k.mechanism == mechanism)
                    .cloned()
            })
        };
        let salt = self.decoy_salt(&user);
        match ScramServer::start(mechanism, &data, keys.as_ref(), &salt) {
            Ok((server, first)) => AuthStep::Continue {
                data: Bytes::from(first),
                next: Box::new(ScramStep {
                    server,
                    client_id: info.client_id.clone(),
                }),
            },
            Err(e) => {
                tracing::info!(client_id = %info.client_id, "{method}: {e}");
                AuthStep::Deny(DenyReason::NotAuthorized)
            }
        }
    }
}

/// The second half of a SCRAM exchange: the client's final message.
struct ScramStep {
    server: ScramServer,
    client_id: String,
}

#[async_trait]
impl AuthContinuation for ScramStep {
    async fn step(self: Box<Self>, data: Option<Bytes>) -> AuthStep {
        let user = self.server.user().to_string();
        let client_id = self.client_id;
        match self.server.finish(&data.unwrap_or_default()) {
            Ok(final_message) => AuthStep::Success {
                username: Some(user),
                data: Some(Bytes::from(final_message)),
            },
            Err(ScramError::BadProof) => {
                tracing::info!(%client_id, username = %user, "SCRAM: wrong password or unknown user");
                AuthStep::Deny(DenyReason::BadCredentials)
            }
            Err(e) => {
                tracing::info!(%client_id, username = %user, "SCRAM: {e}");
                AuthStep::Deny(DenyReason::NotAuthorized)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::hooks::Action;

    fn req<'a>(user: Option<&'a str>, topic: &'a str, action: Action) -> AccessRequest<'a> {
        AccessRequest {
            client_id: "c1",
            username: user,
            topic,
            action,
        }
    }

    #[tokio::test]
    async fn users_groups_roles_and_rules() {
        let s = StoredAccess::new();
        s.attach(Arc::new(mercurio_storage::MemoryStorage::new()))
            .await
            .unwrap();
        let c = serde_json::to_value(Credentials::from_password(b"pw").unwrap()).unwrap();
        let run = |r: Request| {
            let s = &s;
            async move {
                let (a, _) = s.answer(&r).await.expect("an access request");
                a
            }
        };
        let ok = |a: Answer| assert!(matches!(a, Answer::Ok(_)), "{a:?}");
        ok(run(Request::UserAdd {
            username: "u".into(),
            credentials: c.clone(),
        })
        .await);
        assert!(matches!(
            run(Request::UserAdd {
                username: "u".into(),
                credentials: c
            })
            .await,
            Answer::Refused {
                code: ErrorCode::Conflict,
                ..
            }
        ));
        ok(run(Request::RoleCreate { role: "r".into() }).await);
        ok(run(Request::AclAdd {
            role: "r".into(),
            access: "read".into(),
            topic: "t/%c/#".into(),
        })
        .await);
        ok(run(Request::GroupCreate { group: "g".into() }).await);
        ok(run(Request::GroupAddRole {
            group: "g".into(),
            role: "r".into(),
        })
        .await);
        assert_eq!(
            s.authorize_now(&req(Some("u"), "t/c1/x", Action::Read)),
            Some(Decision::Deny)
        );
        ok(run(Request::GroupAddUser {
            group: "g".into(),
            username: "u".into(),
        })
        .await);
        assert_eq!(
            s.authorize_now(&req(Some("u"), "t/c1/x", Action::Read)),
            Some(Decision::Allow)
        );
        assert_eq!(
            s.authorize_now(&req(Some("u"), "t/c2/x", Action::Read)),
            Some(Decision::Deny)
        );
        assert_eq!(
            s.authorize_now(&req(Some("u"), "t/c1/x", Action::Write)),
            Some(Decision::Deny)
        );
        // Others: no opinion (the ACL file, or the chain's default, decides).
        assert_eq!(
            s.authorize_now(&req(Some("x"), "t/c1/x", Action::Read)),
            Some(Decision::NoOpinion)
        );
        // Anonymous clients: the `anonymous` group's roles.
        ok(run(Request::GroupCreate {
            group: ANONYMOUS_GROUP.into(),
        })
        .await);
        assert_eq!(
            s.authorize_now(&req(None, "t/c1/x", Action::Read)),
            Some(Decision::Deny)
        );
        ok(run(Request::GroupAddRole {
            group: ANONYMOUS_GROUP.into(),
            role: "r".into(),
        })
        .await);
        assert_eq!(
            s.authorize_now(&req(None, "t/c1/x", Action::Read)),
            Some(Decision::Allow)
        );
        ok(run(Request::RoleDelete { role: "r".into() }).await);
        assert_eq!(
            s.authorize_now(&req(Some("u"), "t/c1/x", Action::Read)),
            Some(Decision::Deny)
        );
        // What was stored comes back.
        let again = StoredAccess::new();
        let storage = s.storage.read().clone().unwrap();
        again.attach(storage).await.unwrap();
        assert!(again.has_user("u"));
        assert_eq!(again.snapshot().users["u"].groups, ["g"]);
        assert!(again.snapshot().roles.is_empty());
    }
}
