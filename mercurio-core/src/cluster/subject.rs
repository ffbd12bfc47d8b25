//! MQTT topics and filters as NATS subjects (docs/cluster.md, "Topics as subjects").
//!
//! A topic `a/b/c` is published on the subject `{prefix}.msg.a.b.c`: one NATS token per MQTT
//! level. NATS tokens may not be empty and may not hold `.`, `*`, `>` or white space, where an
//! MQTT level may hold anything but `+`, `#` and NUL, and may be empty. So each level is
//! escaped, reversibly:
//!
//! - the bytes `A`-`Z`, `a`-`z`, `0`-`9`, `-` and `_` stand for themselves;
//! - every other byte of the level's UTF-8 (`.`, `*`, `>`, space, `~`, `$`, `/`... and each
//!   byte of a non-ASCII character) is written `~` followed by two upper-case hexadecimal
//!   digits (`.` is `~2E`, space `~20`, `é` `~C3~A9`);
//! - an empty level is the token `~` alone.
//!
//! A filter maps to the subjects that match the same topics: `+` is the token `*`, and a
//! trailing `#` (which also matches its parent level [MQTT-4.7.1-2]) is two subjects, the
//! parent itself and the parent followed by `>`; a filter that is `#` alone is `{prefix}.msg.>`.
//! Every escaped token is non-empty and never `*` or `>`, so a literal level never acts as a
//! wildcard. NATS wildcards do not know MQTT's rule that a filter starting with a wildcard
//! does not match topics starting with `$` [MQTT-4.7.2-1]: such topics never leave their node
//! (the cluster forwards no `$` topic), and the receiving node matches each message against
//! its own subscriptions again anyway.

use std::fmt::Write as _;

/// The NATS token of an empty MQTT level.
const EMPTY_LEVEL: &str = "~";

/// The escape character of a token.
const ESCAPE: u8 = b'~';

/// The token of the subjects that carry routed messages, after the prefix.
pub const MESSAGES: &str = "msg";

/// Whether `b` stands for itself in a token.
fn plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'_'
}

/// Appends the NATS token of one MQTT level to `out`.
fn push_level(level: &str, out: &mut String) {
    if level.is_empty() {
        out.push_str(EMPTY_LEVEL);
        return;
    }
    for &b in level.as_bytes() {
        if plain(b) {
            out.push(char::from(b));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(out, "~{b:02X}");
        }
    }
}

/// The subject a message on `topic` is published on: `{prefix}.msg.` and one escaped token
/// per level. `topic` should be a valid MQTT topic name (any string maps, reversibly).
pub fn topic_subject(prefix: &str, topic: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + MESSAGES.len() + 2 + topic.len() * 2);
    out.push_str(prefix);
    out.push('.');
    out.push_str(MESSAGES);
    for level in topic.split('/') {
        out.push('.');
        push_level(level, &mut out);
    }
    out
}

/// The subjects that match what the MQTT topic filter `filter` matches (one, or two for a
/// filter ending in `/#`), for a node to subscribe to. `filter` must be a valid filter
/// without `$share/{ShareName}/`.
pub fn filter_subjects(prefix: &str, filter: &str) -> Vec<String> {
    let mut out = String::with_capacity(prefix.len() + MESSAGES.len() + 2 + filter.len() * 2);
    out.push_str(prefix);
    out.push('.');
    out.push_str(MESSAGES);
    let mut levels = filter.split('/').peekable();
    while let Some(level) = levels.next() {
        match level {
            "#" => {
                if out.len() == prefix.len() + MESSAGES.len() + 1 {
                    // `#` alone: every topic.
                    out.push_str(".>");
                    return vec![out];
                }
                // `a/#` matches `a` itself and everything below it [MQTT-4.7.1-2].
                let parent = out.clone();
                out.push_str(".>");
                return vec![parent, out];
            }
            "+" => out.push_str(".*"),
            _ => {
                out.push('.');
                push_level(level, &mut out);
            }
        }
        if levels.peek().is_none() {
            break;
        }
    }
    vec![out]
}

/// The NATS queue group of a shared subscription group, from its full filter
/// `$share/{ShareName}/{filter}`: the whole of it escaped as one token (`/` too), so that
/// groups of one name on different filters are different queue groups, as they are different
/// groups in MQTT.
pub fn queue_group(full_filter: &str) -> String {
    let mut out = String::with_capacity(full_filter.len() * 2);
    push_level(full_filter, &mut out);
    out
}

/// Why a subject is not one [`topic_subject`] made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    #[error("the subject does not start with {0:?}")]
    Prefix(String),
    #[error("bad escape in token {0:?}")]
    Escape(String),
    #[error("the escaped bytes are not UTF-8")]
    NotUtf8,
}

/// The topic a subject made by [`topic_subject`] with this `prefix` carries: the inverse of
/// [`topic_subject`].
///
/// Errors: a subject not under `{prefix}.msg.`, a token with a byte that is neither plain nor
/// a well-formed `~XX` escape, escaped bytes that are not UTF-8.
pub fn subject_topic(prefix: &str, subject: &str) -> Result<String, SubjectError> {
    let rest = subject
        .strip_prefix(prefix)
        .and_then(|s| s.strip_prefix('.'))
        .and_then(|s| s.strip_prefix(MESSAGES))
        .and_then(|s| s.strip_prefix('.'))
        .ok_or_else(|| SubjectError::Prefix(format!("{prefix}.{MESSAGES}.")))?;
    let mut bytes = Vec::with_capacity(rest.len());
    for (i, token) in rest.split('.').enumerate() {
        if i > 0 {
            bytes.push(b'/');
        }
        if token == EMPTY_LEVEL {
            continue;
        }
        let t = token.as_bytes();
        let bad = || SubjectError::Escape(token.to_string());
        if t.is_empty() {
            return Err(bad());
        }
        let mut j = 0;
        while j < t.len() {
            if t[j] == ESCAPE {
                let hex = t.get(j + 1..j + 3).ok_or_else(bad)?;
                let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
                // Upper case only, so that each topic has exactly one subject.
                if hex.bytes().any(|h| h.is_ascii_lowercase()) {
                    return Err(bad());
                }
                let b = u8::from_str_radix(hex, 16).map_err(|_| bad())?;
                if plain(b) {
                    return Err(bad());
                }
                bytes.push(b);
                j += 3;
            } else if plain(t[j]) {
                bytes.push(t[j]);
                j += 1;
            } else {
                return Err(bad());
            }
        }
    }
    String::from_utf8(bytes).map_err(|_| SubjectError::NotUtf8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: &str = "mercurio";

    /// NATS subject matching: `*` one token, `>` one or more trailing tokens.
    fn nats_matches(pattern: &str, subject: &str) -> bool {
        let mut s = subject.split('.');
        for p in pattern.split('.') {
            if p == ">" {
                return s.next().is_some();
            }
            match s.next() {
                Some(t) if p == "*" || p == t => {}
                _ => return false,
            }
        }
        s.next().is_none()
    }

    /// A token NATS accepts in a subject: non-empty, no white space, no `.`, not a wildcard.
    fn nats_literal_token(t: &str) -> bool {
        !t.is_empty()
            && t != "*"
            && t != ">"
            && !t.contains(['.', ' ', '\t', '\r', '\n'])
            && t.is_ascii()
    }

    #[test]
    fn examples() {
        assert_eq!(topic_subject(P, "a/b"), "mercurio.msg.a.b");
        assert_eq!(topic_subject(P, "a.b/c d"), "mercurio.msg.a~2Eb.c~20d");
        assert_eq!(topic_subject(P, "/x//"), "mercurio.msg.~.x.~.~");
        assert_eq!(topic_subject(P, "*/>"), "mercurio.msg.~2A.~3E");
        assert_eq!(topic_subject(P, "$SYS/é~"), "mercurio.msg.~24SYS.~C3~A9~7E");
        assert_eq!(filter_subjects(P, "#"), ["mercurio.msg.>"]);
        assert_eq!(
            filter_subjects(P, "a/+/#"),
            ["mercurio.msg.a.*", "mercurio.msg.a.*.>"]
        );
        assert_eq!(filter_subjects(P, "+"), ["mercurio.msg.*"]);
        assert_eq!(filter_subjects(P, "/+"), ["mercurio.msg.~.*"]);
        assert_eq!(queue_group("$share/g/a/#"), "~24share~2Fg~2Fa~2F~23");
    }

    #[test]
    fn bad_subjects_are_errors() {
        for s in [
            "other.msg.a",
            "mercurio.msg.a~2",
            "mercurio.msg.a~2e",
            "mercurio.msg.~41",
            "mercurio.msg.a..b",
            "mercurio.msg.a*",
            "mercurio.msg.~FF",
        ] {
            assert!(subject_topic(P, s).is_err(), "{s}");
        }
    }

    /// MQTT levels: any characters but `/`, `+`, `#` and NUL, often empty or NATS-hostile.
    fn level() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            "[a-c]{1,3}",
            "[.*> ~$\t é中a-z0-9_-]{1,6}",
            "[^/+#\u{0}]{1,8}",
        ]
    }

    fn topic() -> impl Strategy<Value = String> {
        prop::collection::vec(level(), 1..6).prop_map(|l| l.join("/"))
    }

    /// Filters over the same small alphabet as `small_topic`, so that some match.
    fn filter() -> impl Strategy<Value = String> {
        let lvl = prop_oneof![Just(String::new()), "[a-b.]{1,2}", Just("+".to_string())];
        (prop::collection::vec(lvl, 1..4), any::<bool>()).prop_map(|(mut l, hash)| {
            if hash {
                l.push("#".into());
            }
            l.join("/")
        })
    }

    fn small_topic() -> impl Strategy<Value = String> {
        let lvl = prop_oneof![Just(String::new()), "[a-b.]{1,2}"];
        prop::collection::vec(lvl, 1..5).prop_map(|l| l.join("/"))
    }

    proptest! {
        /// Escaping is reversible, and every token is one NATS accepts as a literal.
        #[test]
        fn topic_round_trips(t in topic()) {
            let s = topic_subject(P, &t);
            prop_assert!(s.split('.').all(nats_literal_token), "{}", s);
            prop_assert_eq!(subject_topic(P, &s), Ok(t));
        }

        /// Distinct topics have distinct subjects.
        #[test]
        fn distinct_topics_distinct_subjects(a in topic(), b in topic()) {
            prop_assume!(a != b);
            prop_assert_ne!(topic_subject(P, &a), topic_subject(P, &b));
        }

        /// A filter's subjects match a topic's subject exactly when the MQTT filter matches
        /// the topic (MQTT 5.0 section 4.7), for topics not starting with `$`.
        #[test]
        fn filter_subjects_match_as_mqtt(f in filter(), t in small_topic()) {
            let subject = topic_subject(P, &t);
            let nats = filter_subjects(P, &f).iter().any(|p| nats_matches(p, &subject));
            prop_assert_eq!(nats, crate::topic::matches(&f, &t), "{} {} {}", f, t, subject);
        }
    }
}
