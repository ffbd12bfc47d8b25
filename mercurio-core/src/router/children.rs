//! The children of a trie node, keyed by level name: none, one (the usual case deep in a topic
//! tree, kept without a map) or a map. A chain of single-child levels then costs a small
//! allocation per level rather than a hash table's, so a level's memory follows its bytes.

use std::collections::HashMap;

use ahash::RandomState;

type Map<K, V> = HashMap<K, V, RandomState>;

/// The children of one node.
#[derive(Debug, Default)]
pub(super) enum Children<N> {
    #[default]
    None,
    One(Box<(Box<str>, N)>),
    Many(Box<Map<Box<str>, N>>),
}

impl<N: Default> Children<N> {
    pub(super) fn len(&self) -> usize {
        match self {
            Children::None => 0,
            Children::One(_) => 1,
            Children::Many(m) => m.len(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        matches!(self, Children::None)
    }

    pub(super) fn get(&self, level: &str) -> Option<&N> {
        match self {
            Children::None => None,
            Children::One(one) => (&*one.0 == level).then_some(&one.1),
            Children::Many(m) => m.get(level),
        }
    }

    pub(super) fn get_mut(&mut self, level: &str) -> Option<&mut N> {
        match self {
            Children::None => None,
            Children::One(one) => (&*one.0 == level).then_some(&mut one.1),
            Children::Many(m) => m.get_mut(level),
        }
    }

    /// The child for `level`, created (default) when missing.
    pub(super) fn get_or_insert(&mut self, level: &str) -> &mut N {
        match self {
            Children::None => {
                *self = Children::One(Box::new((Box::from(level), N::default())));
            }
            Children::One(one) if &*one.0 != level => {
                if let Children::One(one) = std::mem::take(self) {
                    let (name, node) = *one;
                    let mut map = Map::default();
                    map.insert(name, node);
                    *self = Children::Many(Box::new(map));
                }
            }
            _ => {}
        }
        match self {
            Children::None => unreachable!("filled above"),
            Children::One(one) => &mut one.1,
            Children::Many(m) => m.entry(Box::from(level)).or_default(),
        }
    }

    /// Removes the child for `level`, if any; a map left mostly empty shrinks.
    pub(super) fn remove(&mut self, level: &str) {
        match self {
            Children::None => {}
            Children::One(one) => {
                if &*one.0 == level {
                    *self = Children::None;
                }
            }
            Children::Many(m) => {
                m.remove(level);
                if m.is_empty() {
                    *self = Children::None;
                } else if m.capacity() > 16 && m.len() < m.capacity() / 4 {
                    m.shrink_to_fit();
                }
            }
        }
    }

    pub(super) fn values(&self) -> Box<dyn Iterator<Item = &N> + '_> {
        match self {
            Children::None => Box::new(std::iter::empty()),
            Children::One(one) => Box::new(std::iter::once(&one.1)),
            Children::Many(m) => Box::new(m.values()),
        }
    }

    /// Every (level name, child) pair.
    pub(super) fn iter(&self) -> Box<dyn Iterator<Item = (&str, &N)> + '_> {
        match self {
            Children::None => Box::new(std::iter::empty()),
            Children::One(one) => Box::new(std::iter::once((&*one.0, &one.1))),
            Children::Many(m) => Box::new(m.iter().map(|(k, v)| (&**k, v))),
        }
    }

    /// Moves every child into `into` (for drops that do not recurse per level).
    pub(super) fn take_into(&mut self, into: &mut Vec<N>) {
        match std::mem::take(self) {
            Children::None => {}
            Children::One(one) => into.push(one.1),
            Children::Many(map) => into.extend(map.into_values()),
        }
    }
}
