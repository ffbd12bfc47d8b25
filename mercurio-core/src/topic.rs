//! Topic names, topic filters and shared-subscription filters: their validation and matching
//! live in [`mercurio_codec::topic`] and are re-exported here; what only the router needs
//! stays here.

pub use mercurio_codec::topic::*;

/// Splits off the first level of a topic: `("a", Some("b/c"))` for `"a/b/c"`, `("a", None)`
/// for `"a"`, `("", Some(""))` for `"/"`. Used by the tries of the router.
#[inline]
pub(crate) fn split_level(s: &str) -> (&str, Option<&str>) {
    match s.find('/') {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    }
}
