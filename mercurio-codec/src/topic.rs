//! Topic names, topic filters and shared-subscription filters: their validation and matching.
//!
//! The rules are those of MQTT 5.0 section 4.7 (identical in MQTT 3.1.1 section 4.7) and,
//! for `$share/{ShareName}/{filter}`, MQTT 5.0 section 4.8.2:
//!
//! - a topic name or filter is at least one character long [MQTT-4.7.3-1], holds no U+0000
//!   [MQTT-4.7.3-2] and is at most 65,535 bytes of UTF-8 [MQTT-4.7.3-3];
//! - a topic name (what a PUBLISH carries) holds no wildcard [MQTT-3.3.2-2];
//! - in a filter, `#` is alone in the last level [MQTT-4.7.1-2] and `+` fills a whole level
//!   [MQTT-4.7.1-3]; empty levels (`a//b`, `/a`, `a/`) are valid;
//! - a filter starting with a wildcard does not match a topic name starting with `$`
//!   [MQTT-4.7.2-1].
//!
//! Levels are split on `/` only: a topic is compared level by level, byte for byte, with no
//! normalisation [MQTT-4.7.3-4].

use thiserror::Error;

/// The largest topic name or filter, in bytes of UTF-8: the length prefix of a UTF-8 encoded
/// string is two bytes [MQTT-4.7.3-3].
pub const MAX_TOPIC_LEN: usize = 65_535;

/// The prefix of a shared-subscription filter, `$share/` (MQTT 5.0 section 4.8.2).
pub const SHARED_PREFIX: &str = "$share/";

/// Why a topic name, topic filter or shared-subscription filter is invalid.
///
/// Each variant names the specification statement it breaks. At the protocol edge a bad topic
/// name in PUBLISH is a malformed packet / "Topic Name invalid" (0x90) and a bad filter in
/// SUBSCRIBE is "Topic Filter invalid" (0x8F) in MQTT 5.0.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TopicError {
    /// The name or filter is the empty string [MQTT-4.7.3-1].
    #[error("topic names and topic filters must be at least one character long [MQTT-4.7.3-1]")]
    Empty,
    /// The name or filter is longer than 65,535 bytes [MQTT-4.7.3-3].
    #[error("topic is {0} bytes long, more than the 65535 allowed [MQTT-4.7.3-3]")]
    TooLong(usize),
    /// The name or filter contains U+0000 [MQTT-4.7.3-2].
    #[error(
        "topic names and topic filters must not contain the null character U+0000 [MQTT-4.7.3-2]"
    )]
    NullCharacter,
    /// A topic name contains `+` or `#` [MQTT-3.3.2-2].
    #[error("a topic name must not contain the wildcard characters '+' or '#' [MQTT-3.3.2-2]")]
    WildcardInTopicName,
    /// `#` is not alone in the last level of a filter [MQTT-4.7.1-2].
    #[error("the multi-level wildcard '#' must be alone in the last level of a topic filter [MQTT-4.7.1-2]")]
    MisplacedMultiLevelWildcard,
    /// `+` shares a level of a filter with other characters [MQTT-4.7.1-3].
    #[error("the single-level wildcard '+' must occupy an entire level of a topic filter [MQTT-4.7.1-3]")]
    MisplacedSingleLevelWildcard,
    /// The ShareName of `$share/{ShareName}/{filter}` is empty, or not followed by `/`
    /// [MQTT-4.8.2-1] [MQTT-4.8.2-2].
    #[error("a shared subscription must have the form $share/{{ShareName}}/{{filter}} with a ShareName at least one character long [MQTT-4.8.2-1]")]
    MissingShareName,
    /// The ShareName contains `+` or `#` (`/` ends it) [MQTT-4.8.2-2].
    #[error("a ShareName must not contain the characters '/', '+' or '#' [MQTT-4.8.2-2]")]
    InvalidShareName,
    /// Nothing follows `$share/{ShareName}/` [MQTT-4.8.2-2].
    #[error("the ShareName of a shared subscription must be followed by '/' and a topic filter [MQTT-4.8.2-2]")]
    MissingSharedFilter,
}

/// A shared-subscription filter `$share/{ShareName}/{filter}` split into its parts, borrowed
/// from the original string (MQTT 5.0 section 4.8.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SharedFilter<'a> {
    /// The ShareName: at least one character, no `/`, `+` or `#`.
    pub group: &'a str,
    /// The topic filter the group subscribes to: a valid, non-empty topic filter.
    pub filter: &'a str,
}

/// Checks what every topic name and filter shares: non-empty, at most 65,535 bytes, no U+0000.
fn validate_common(s: &str) -> Result<(), TopicError> {
    if s.is_empty() {
        return Err(TopicError::Empty);
    }
    if s.len() > MAX_TOPIC_LEN {
        return Err(TopicError::TooLong(s.len()));
    }
    if s.as_bytes().contains(&0) {
        return Err(TopicError::NullCharacter);
    }
    Ok(())
}

/// Checks a topic name, as carried by PUBLISH or a will.
///
/// Valid: non-empty [MQTT-4.7.3-1], at most 65,535 bytes [MQTT-4.7.3-3], no U+0000
/// [MQTT-4.7.3-2] and no wildcard `+` or `#` [MQTT-3.3.2-2]. Empty levels are valid (`/`,
/// `a//b`). Names starting with `$` are valid here; whether a client may publish to `$SYS/...`
/// is the broker's policy, not a syntax rule.
///
/// # Errors
///
/// The first rule broken, in the order above: [`TopicError::Empty`], [`TopicError::TooLong`],
/// [`TopicError::NullCharacter`], [`TopicError::WildcardInTopicName`].
pub fn validate_topic_name(name: &str) -> Result<(), TopicError> {
    validate_common(name)?;
    if name.bytes().any(|b| b == b'+' || b == b'#') {
        return Err(TopicError::WildcardInTopicName);
    }
    Ok(())
}

/// Checks a topic filter, as carried by SUBSCRIBE or UNSUBSCRIBE, without the shared
/// subscription prefix (see [`validate_subscription_filter`] for the filter of a SUBSCRIBE
/// that may be `$share/...`).
///
/// Valid: non-empty [MQTT-4.7.3-1], at most 65,535 bytes [MQTT-4.7.3-3], no U+0000
/// [MQTT-4.7.3-2], `#` only alone in the last level [MQTT-4.7.1-2], `+` only as a whole level
/// [MQTT-4.7.1-3]. Empty levels (`a//b`, `/a`, `a/`) are valid.
///
/// # Errors
///
/// [`TopicError::Empty`], [`TopicError::TooLong`], [`TopicError::NullCharacter`],
/// [`TopicError::MisplacedMultiLevelWildcard`] or [`TopicError::MisplacedSingleLevelWildcard`].
pub fn validate_topic_filter(filter: &str) -> Result<(), TopicError> {
    validate_common(filter)?;
    let mut levels = filter.split('/').peekable();
    while let Some(level) = levels.next() {
        if level.len() > 1 || level.is_empty() {
            if level.contains('#') {
                return Err(TopicError::MisplacedMultiLevelWildcard);
            }
            if level.contains('+') {
                return Err(TopicError::MisplacedSingleLevelWildcard);
            }
        } else if level == "#" && levels.peek().is_some() {
            return Err(TopicError::MisplacedMultiLevelWildcard);
        }
    }
    Ok(())
}

/// Splits a shared-subscription filter `$share/{ShareName}/{filter}` (MQTT 5.0 section 4.8.2).
///
/// Returns `Ok(None)` when `filter` does not start with `$share/` (it is an ordinary filter,
/// not checked here), and `Ok(Some(..))` when it is a well-formed shared filter: a ShareName
/// at least one character long [MQTT-4.8.2-1] without `/`, `+` or `#`, followed by `/` and a
/// topic filter [MQTT-4.8.2-2] that itself passes [`validate_topic_filter`]. The whole string
/// must also be at most 65,535 bytes and free of U+0000.
///
/// # Errors
///
/// [`TopicError::MissingShareName`] for `$share/` or `$share//f`,
/// [`TopicError::InvalidShareName`] for a ShareName with `+` or `#`,
/// [`TopicError::MissingSharedFilter`] for `$share/group` or `$share/group/`, and any error of
/// [`validate_topic_filter`] for the filter part.
pub fn parse_shared(filter: &str) -> Result<Option<SharedFilter<'_>>, TopicError> {
    let Some(rest) = filter.strip_prefix(SHARED_PREFIX) else {
        return Ok(None);
    };
    validate_common(filter)?;
    let (group, inner) = match rest.split_once('/') {
        Some(parts) => parts,
        None if rest.is_empty() => return Err(TopicError::MissingShareName),
        None => {
            if rest.contains(['+', '#']) {
                return Err(TopicError::InvalidShareName);
            }
            return Err(TopicError::MissingSharedFilter);
        }
    };
    if group.is_empty() {
        return Err(TopicError::MissingShareName);
    }
    if group.contains(['+', '#']) {
        return Err(TopicError::InvalidShareName);
    }
    if inner.is_empty() {
        return Err(TopicError::MissingSharedFilter);
    }
    validate_topic_filter(inner)?;
    Ok(Some(SharedFilter {
        group,
        filter: inner,
    }))
}

/// Checks the topic filter of one SUBSCRIBE entry: either a shared filter
/// (`$share/{ShareName}/{filter}`, see [`parse_shared`]) or an ordinary topic filter (see
/// [`validate_topic_filter`]).
///
/// # Errors
///
/// Those of [`parse_shared`] and [`validate_topic_filter`].
pub fn validate_subscription_filter(filter: &str) -> Result<(), TopicError> {
    match parse_shared(filter)? {
        Some(_) => Ok(()),
        None => validate_topic_filter(filter),
    }
}

/// True when the topic filter `filter` matches the topic name `topic` (MQTT 5.0 section 4.7).
///
/// Levels are compared byte for byte; `+` matches exactly one level (which may be empty: `a/+`
/// matches `a/` but not `a`); `#` matches the parent level and any number of child levels
/// (`sport/#` matches `sport`, `sport/` and `sport/tennis/player1`) [MQTT-4.7.1-2]. A filter
/// whose first character is a wildcard does not match a topic name starting with `$`
/// [MQTT-4.7.2-1]: `#` and `+/monitor/Clients` do not match `$SYS/monitor/Clients`, while
/// `$SYS/#` does.
///
/// Both arguments are expected to be valid (see [`validate_topic_filter`],
/// [`validate_topic_name`]); on invalid input the answer is well defined but meaningless.
/// `filter` is an ordinary filter: strip `$share/{ShareName}/` first (see [`parse_shared`]).
pub fn matches(filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') && filter.starts_with(['+', '#']) {
        return false;
    }
    // Every other topic (a stream on `#` asks this for each message).
    if filter == "#" {
        return true;
    }
    let mut f = filter.split('/');
    let mut t = topic.split('/');
    loop {
        match (f.next(), t.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(fl), Some(tl)) => {
                if fl != tl {
                    return false;
                }
            }
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// How many levels a topic name or filter has: `a/b/c` 3, `/` 2, `a` 1 (MQTT 5.0 section
/// 4.7.1.1: levels are separated by `/`). A shared filter's `$share/{ShareName}/` counts.
pub fn level_count(s: &str) -> usize {
    s.bytes().filter(|&b| b == b'/').count() + 1
}
