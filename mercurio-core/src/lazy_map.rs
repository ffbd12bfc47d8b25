//! [`LazyMap`]: a hash map that takes no room until its first entry.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;

/// A map that takes no room until its first entry, and gives it back when its last entry is
/// removed: one pointer (8 bytes) instead of an empty `HashMap`'s 48, for the tables most
/// connections and sessions never fill (topic aliases, subscriptions of a client that only
/// publishes). The methods are `HashMap`'s.
#[derive(Debug, Clone)]
#[allow(clippy::box_collection)] // the point: one pointer while empty
pub(crate) struct LazyMap<K, V>(Option<Box<HashMap<K, V>>>);

impl<K, V> Default for LazyMap<K, V> {
    fn default() -> Self {
        LazyMap(None)
    }
}

impl<K: Eq + Hash, V> LazyMap<K, V> {
    pub(crate) fn new() -> Self {
        LazyMap(None)
    }

    pub(crate) fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        self.0.as_ref()?.get(key)
    }

    pub(crate) fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        self.get(key).is_some()
    }

    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.0
            .get_or_insert_with(Default::default)
            .insert(key, value)
    }

    /// Removes `key`; the map's room goes with its last entry.
    pub(crate) fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        let map = self.0.as_mut()?;
        let removed = map.remove(key);
        if map.is_empty() {
            self.0 = None;
        }
        removed
    }

    pub(crate) fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |m| m.len())
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.0.iter().flat_map(|m| m.iter())
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &K> {
        self.0.iter().flat_map(|m| m.keys())
    }

    /// Every entry, taken: the map is left empty, without room.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = (K, V)> {
        self.0.take().into_iter().flat_map(|m| *m)
    }
}
