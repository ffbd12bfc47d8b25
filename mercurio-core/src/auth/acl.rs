//! ACL files in mosquitto's format:
//!
//! ```text
//! # lines before any `user` line apply to anonymous clients
//! topic read $SYS/#
//! user alice
//! topic readwrite tenants/alice/#
//! topic deny tenants/alice/secret
//! # every client; %c is its client identifier, %u its user name
//! pattern write devices/%c/status
//! ```
//!
//! `topic` and `pattern` take an optional access (`read`, `write`, `readwrite` (the default)
//! or `deny`) and a topic filter (the rest of the line). Once a file is set, whatever no line
//! allows is denied. A `deny` line that matches wins over any line that allows. A pattern
//! whose `%u` meets an anonymous client, or whose `%c`/`%u` would insert `/`, `+` or `#`, does
//! not match. A subscription is allowed when every topic it can match is readable by one
//! line; a filter starting with a wildcard never covers `$` topics (so `$SYS` is readable
//! only where a line names it).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::RwLock;

use super::hooks::{AccessRequest, Action, Authorizer, Decision};
use super::FileError;

/// What a line grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    ReadWrite,
    Deny,
}

impl Access {
    /// The word an ACL line writes: `read`, `write`, `readwrite`, `deny`.
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
            Access::ReadWrite => "readwrite",
            Access::Deny => "deny",
        }
    }

    fn grants(self, action: Action) -> bool {
        matches!(
            (self, action),
            (Access::ReadWrite, _)
                | (Access::Read, Action::Read | Action::Subscribe)
                | (Access::Write, Action::Write)
        )
    }
}

/// One `topic` or `pattern` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rule {
    pub(crate) access: Access,
    pub(crate) filter: String,
    /// A `pattern` line: `%c` and `%u` are substituted.
    pattern: bool,
}

/// A parsed ACL file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Acl {
    anonymous: Vec<Rule>,
    users: HashMap<String, Vec<Rule>>,
    patterns: Vec<Rule>,
}

impl Acl {
    /// Reads and parses the file at `path`.
    pub fn load(path: &Path) -> Result<Acl, FileError> {
        let text = std::fs::read_to_string(path).map_err(|e| FileError::io(path, &e))?;
        Acl::parse(path, &text)
    }

    /// Parses `text`, the contents of `path` (used in errors only).
    pub fn parse(path: &Path, text: &str) -> Result<Acl, FileError> {
        let mut acl = Acl::default();
        let mut user: Option<String> = None;
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let err = |m: &str| FileError::at(path, i + 1, m.to_string());
            let (keyword, rest) = match line.split_once(char::is_whitespace) {
                Some((k, r)) => (k, r.trim()),
                None => (line, ""),
            };
            match keyword {
                "user" => {
                    if rest.is_empty() {
                        return Err(err("`user` needs a user name"));
                    }
                    acl.users.entry(rest.to_string()).or_default();
                    user = Some(rest.to_string());
                }
                "topic" | "pattern" => {
                    let (access, filter) = match rest.split_once(char::is_whitespace) {
                        Some((a, f)) => match parse_access(a) {
                            Some(access) => (access, f.trim()),
                            None => (Access::ReadWrite, rest),
                        },
                        None => match parse_access(rest) {
                            Some(_) => return Err(err("missing topic after the access")),
                            None => (Access::ReadWrite, rest),
                        },
                    };
                    if filter.is_empty() {
                        return Err(err(&format!("`{keyword}` needs a topic")));
                    }
                    if let Err(e) = crate::topic::validate_topic_filter(filter) {
                        return Err(err(&format!("invalid topic filter {filter:?}: {e}")));
                    }
                    let rule = Rule {
                        access,
                        filter: filter.to_string(),
                        pattern: keyword == "pattern",
                    };
                    if rule.pattern {
                        acl.patterns.push(rule);
                    } else {
                        match &user {
                            Some(u) => acl.users.entry(u.clone()).or_default().push(rule),
                            None => acl.anonymous.push(rule),
                        }
                    }
                }
                other => {
                    return Err(err(&format!(
                        "unknown keyword {other:?} (expected user, topic or pattern)"
                    )))
                }
            }
        }
        Ok(acl)
    }

    /// The lines before any `user` line (anonymous clients): access and topic filter each.
    pub fn anonymous_rules(&self) -> Vec<(Access, &str)> {
        self.anonymous
            .iter()
            .map(|r| (r.access, r.filter.as_str()))
            .collect()
    }

    /// Each `user` section's `topic` lines, sorted by user name.
    pub fn user_rules(&self) -> Vec<(&str, Vec<(Access, &str)>)> {
        let mut users: Vec<_> = self
            .users
            .iter()
            .map(|(u, rules)| {
                let rules = rules
                    .iter()
                    .map(|r| (r.access, r.filter.as_str()))
                    .collect();
                (u.as_str(), rules)
            })
            .collect();
        users.sort_by(|a, b| a.0.cmp(b.0));
        users
    }

    /// The `pattern` lines.
    pub fn pattern_rules(&self) -> Vec<(Access, &str)> {
        self.patterns
            .iter()
            .map(|r| (r.access, r.filter.as_str()))
            .collect()
    }

    /// Whether the request is allowed. Never allocates.
    pub fn check(&self, req: &AccessRequest<'_>) -> bool {
        let own: &[Rule] = match req.username {
            Some(u) => self.users.get(u).map(Vec::as_slice).unwrap_or(&[]),
            None => &self.anonymous,
        };
        decide(own.iter().chain(self.patterns.iter()), req)
    }
}

/// The ACL's decision over `rules`: denied when a `deny` rule matches, else allowed when a
/// rule grants the action, else denied. Never allocates.
pub(crate) fn decide<'a>(
    rules: impl Iterator<Item = &'a Rule> + Clone,
    req: &AccessRequest<'_>,
) -> bool {
    if rules
        .clone()
        .any(|r| r.access == Access::Deny && matches(r, req))
    {
        return false;
    }
    rules
        .into_iter()
        .any(|r| r.access.grants(req.action) && matches(r, req))
}

impl Rule {
    /// A `pattern` line: `%c` and `%u` in `filter` stand for the client identifier and the
    /// user name.
    pub(crate) fn pattern(access: Access, filter: String) -> Rule {
        Rule {
            access,
            filter,
            pattern: true,
        }
    }
}

fn matches(rule: &Rule, req: &AccessRequest<'_>) -> bool {
    let subst = if rule.pattern {
        let bad = |s: &str| s.contains(['/', '+', '#']);
        if rule.filter.contains("%c") && bad(req.client_id) {
            return false;
        }
        if rule.filter.contains("%u") {
            match req.username {
                Some(u) if !bad(u) => {}
                _ => return false,
            }
        }
        Some((req.client_id, req.username))
    } else {
        None
    };
    covers(&rule.filter, req.topic, subst)
}

/// The access a word names: `read`, `write`, `readwrite`, `deny`.
pub(crate) fn parse_access(s: &str) -> Option<Access> {
    Some(match s {
        "read" => Access::Read,
        "write" => Access::Write,
        "readwrite" => Access::ReadWrite,
        "deny" => Access::Deny,
        _ => return None,
    })
}

/// True when every topic that `target` (a topic name, or a filter) matches is matched by the
/// ACL filter `acl`. With `subst`, `%c` and `%u` in `acl` stand for the client identifier and
/// the user name.
fn covers(acl: &str, target: &str, subst: Option<(&str, Option<&str>)>) -> bool {
    let mut a = acl.split('/');
    let mut t = target.split('/');
    let mut first = true;
    loop {
        match (a.next(), t.next()) {
            (Some("#"), tl) => {
                // `#` covers the parent level too ("x/#" matches "x"), never `$` topics at the
                // first level [MQTT-4.7.2-1].
                return !(first && tl.is_some_and(|l| l.starts_with('$')));
            }
            (Some(_), None) => return false,
            (None, Some(_)) => return false,
            (None, None) => return true,
            (Some("+"), Some(tl)) => {
                if tl == "#" || (first && tl.starts_with('$')) {
                    return false;
                }
            }
            (Some(al), Some(tl)) => {
                if tl == "+" || tl == "#" || !level_eq(al, tl, subst) {
                    return false;
                }
            }
        }
        first = false;
    }
}

/// `acl_level == level`, with `%c` / `%u` substituted when `subst` is given.
fn level_eq(acl_level: &str, level: &str, subst: Option<(&str, Option<&str>)>) -> bool {
    let Some((c, u)) = subst else {
        return acl_level == level;
    };
    if !acl_level.contains('%') {
        return acl_level == level;
    }
    let mut p = acl_level;
    let mut rest = level;
    while !p.is_empty() {
        if let Some(r) = p.strip_prefix("%c") {
            let Some(x) = rest.strip_prefix(c) else {
                return false;
            };
            rest = x;
            p = r;
        } else if let Some(r) = p.strip_prefix("%u") {
            let Some(x) = u.and_then(|u| rest.strip_prefix(u)) else {
                return false;
            };
            rest = x;
            p = r;
        } else {
            let ch = p.chars().next().expect("not empty");
            let Some(x) = rest.strip_prefix(ch) else {
                return false;
            };
            rest = x;
            p = &p[ch.len_utf8()..];
        }
    }
    rest.is_empty()
}

/// An ACL file as an [`Authorizer`]: always has an opinion, and never waits.
pub struct AclAuthorizer {
    path: PathBuf,
    acl: RwLock<Arc<Acl>>,
}

impl AclAuthorizer {
    /// Reads the ACL file.
    pub fn new(path: PathBuf) -> Result<Self, FileError> {
        let acl = Acl::load(&path)?;
        Ok(AclAuthorizer {
            path,
            acl: RwLock::new(Arc::new(acl)),
        })
    }

    /// Reads the file again. On error the old rules stay.
    pub fn reload(&self) -> Result<(), FileError> {
        let acl = Acl::load(&self.path)?;
        tracing::info!(path = %self.path.display(), "ACL file reloaded");
        *self.acl.write() = Arc::new(acl);
        Ok(())
    }
}

#[async_trait]
impl Authorizer for AclAuthorizer {
    async fn authorize(&self, request: &AccessRequest<'_>) -> Decision {
        self.authorize_now(request).unwrap_or(Decision::Deny)
    }

    fn authorize_now(&self, request: &AccessRequest<'_>) -> Option<Decision> {
        Some(if self.acl.read().check(request) {
            Decision::Allow
        } else {
            Decision::Deny
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(text: &str) -> Acl {
        Acl::parse(Path::new("acl"), text).expect("parses")
    }

    fn ok(acl: &Acl, client: &str, user: Option<&str>, topic: &str, action: Action) -> bool {
        acl.check(&AccessRequest {
            client_id: client,
            username: user,
            topic,
            action,
        })
    }

    #[test]
    fn sections_and_access() {
        let a = acl("topic read public/#\n\nuser alice\ntopic readwrite a/#\ntopic deny a/secret\nuser bob\ntopic write b/in\ntopic b/both\n");
        assert!(ok(&a, "c", None, "public/x", Action::Read));
        assert!(!ok(&a, "c", None, "public/x", Action::Write));
        assert!(!ok(&a, "c", Some("alice"), "public/x", Action::Read));
        assert!(ok(&a, "c", Some("alice"), "a/x/y", Action::Write));
        assert!(ok(&a, "c", Some("alice"), "a", Action::Read));
        assert!(!ok(&a, "c", Some("alice"), "a/secret", Action::Read));
        assert!(ok(&a, "c", Some("alice"), "a/+", Action::Subscribe));
        assert!(ok(&a, "c", Some("bob"), "b/in", Action::Write));
        assert!(!ok(&a, "c", Some("bob"), "b/in", Action::Read));
        assert!(!ok(&a, "c", Some("bob"), "b/in", Action::Subscribe));
        assert!(ok(&a, "c", Some("bob"), "b/both", Action::Read));
        assert!(!ok(&a, "c", Some("carol"), "b/both", Action::Read));
    }

    #[test]
    fn subscriptions_must_fit() {
        let a = acl("user u\ntopic read t/+/x\ntopic read s/#\n");
        let sub = |f: &str| ok(&a, "c", Some("u"), f, Action::Subscribe);
        assert!(sub("t/1/x"));
        assert!(sub("t/+/x"));
        assert!(!sub("t/#"));
        assert!(!sub("t/+/#"));
        assert!(!sub("#"));
        assert!(sub("s/#"));
        assert!(sub("s/+/z"));
        assert!(sub("s"));
    }

    #[test]
    fn dollar_topics_need_a_line() {
        let a = acl("topic read #\ntopic read $SYS/broker/#\n");
        assert!(!ok(&a, "c", None, "$SYS/x", Action::Read));
        assert!(ok(&a, "c", None, "$SYS/broker/uptime", Action::Read));
        assert!(!ok(&a, "c", None, "$SYS/#", Action::Subscribe));
        assert!(ok(&a, "c", None, "$SYS/broker/#", Action::Subscribe));
        assert!(ok(&a, "c", None, "x", Action::Read));
    }

    #[test]
    fn patterns() {
        let a =
            acl("pattern readwrite devices/%c/#\npattern read users/%u\npattern write x/%u-%c\n");
        assert!(ok(&a, "d1", None, "devices/d1/status", Action::Write));
        assert!(!ok(&a, "d1", None, "devices/d2/status", Action::Write));
        assert!(ok(&a, "d1", Some("bob"), "users/bob", Action::Read));
        assert!(!ok(&a, "d1", None, "users/bob", Action::Read));
        assert!(!ok(&a, "d1", Some("bob"), "users/alice", Action::Read));
        assert!(ok(&a, "d1", Some("bob"), "x/bob-d1", Action::Write));
        assert!(!ok(&a, "d1", Some("bob"), "x/bob-d2", Action::Write));
        // A client identifier with a wildcard or a separator never fits a pattern.
        assert!(!ok(&a, "+", None, "devices/+/status", Action::Subscribe));
        assert!(!ok(&a, "a/b", None, "devices/a/b/status", Action::Write));
    }

    #[test]
    fn errors_name_the_line() {
        for (text, line) in [
            ("topic read a\nbogus x\n", 2),
            ("user\n", 1),
            ("\n\ntopic read\n", 3),
            ("topic read a/#/b\n", 1),
        ] {
            let e = Acl::parse(Path::new("/etc/acl"), text).unwrap_err();
            assert_eq!(e.line, Some(line), "{text:?}: {e}");
            assert!(e.to_string().starts_with(&format!("/etc/acl:{line}: ")));
        }
    }
}
