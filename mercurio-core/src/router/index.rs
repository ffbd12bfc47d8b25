//! The subscription index: a topic trie with a bounded cache of match results.
//!
//! The model is NATS's `sublist`. Each node is one level of a topic
//! filter and holds a map of literal tokens to child nodes, one slot for `+` (a child node) and
//! one for `#` (a leaf: `#` is always the last level). The subscriptions of a filter live on the
//! node of its last level: the ordinary ones keyed by client, and the shared-subscription groups
//! of `$share/{ShareName}/{filter}` (MQTT 5.0 section 4.8.2), each with its members and a
//! round-robin cursor.
//!
//! Matching a topic walks the trie level by level without recursion and without allocating per
//! level; the results are grouped per client (the broker sends a client one copy of a message
//! however many of its subscriptions match, MQTT 5.0 section 3.3.4) and cached for up to
//! [`DEFAULT_CACHE_TOPICS`] topics. Any insert or remove that changes the index clears the cache.
//!
//! Deep filters are safe: no operation recurses per level (dropping the trie included), so a
//! 65,535-byte filter of empty levels cannot overflow a task's stack.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ahash::RandomState;
use parking_lot::RwLock;

use super::children::Children;
use crate::topic::{parse_shared, split_level, validate_subscription_filter, TopicError};

/// A client, keyed by its client identifier. Cheap to clone; compared by content.
pub type ClientKey = Arc<str>;

/// How many topics the match cache holds by default.
pub const DEFAULT_CACHE_TOPICS: usize = 4096;

/// How many subscriptions (client entries plus shared-group members) the cached results may
/// hold together by default. A single result larger than an eighth of this is not cached.
pub const DEFAULT_CACHE_SUBSCRIPTIONS: usize = 1 << 18;

/// Topics longer than this many bytes are matched but not cached, so that the cache's keys stay
/// small (at most [`DEFAULT_CACHE_TOPICS`] x 1 KiB).
pub const MAX_CACHED_TOPIC_LEN: usize = 1024;

/// The ordinary subscriptions of one client that match a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientMatch<T> {
    /// The subscribing client.
    pub client: ClientKey,
    /// The value of each of its matching subscriptions, one per matching filter (in no
    /// particular order). The broker delivers one copy at the highest QoS, with every
    /// subscription identifier (MQTT 5.0 section 3.3.4).
    pub subscriptions: Vec<T>,
}

/// One shared-subscription group whose filter matches a topic (MQTT 5.0 section 4.8.2).
///
/// Groups of the same ShareName on different filters are different groups; each receives one
/// copy.
#[derive(Debug, Clone)]
pub struct SharedMatch<T> {
    /// The ShareName.
    pub group: Arc<str>,
    /// The group's full filter, `$share/{ShareName}/{filter}`: what a delivery made through
    /// the group remembers, to find the group again ([`SubscriptionIndex::shared_group`]).
    pub filter: Arc<str>,
    /// Every member of the group with the value of its subscription, in subscription order.
    pub members: Vec<(ClientKey, T)>,
    /// The group's round-robin cursor. It lives in the index with the group, so it advances
    /// across messages and across cached results; see [`SharedMatch::pick`].
    pub next: Arc<AtomicUsize>,
}

impl<T> SharedMatch<T> {
    /// Chooses the member that receives the next message: the first member, starting at the
    /// cursor and wrapping around, for which `eligible` (typically "is connected") returns
    /// true. Advances the cursor past the chosen member. `None` when no member is eligible (or
    /// the group is empty).
    ///
    /// Concurrent publishers may pick the same member; the rotation is fair on average, not
    /// exact.
    pub fn pick(
        &self,
        mut eligible: impl FnMut(&ClientKey, &T) -> bool,
    ) -> Option<&(ClientKey, T)> {
        let n = self.members.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for offset in 0..n {
            let member = &self.members[start.wrapping_add(offset) % n];
            if eligible(&member.0, &member.1) {
                if offset > 0 {
                    self.next.fetch_add(offset, Ordering::Relaxed);
                }
                return Some(member);
            }
        }
        None
    }
}

/// Everything that matches one topic: ordinary subscriptions grouped per client, and one
/// entry per matching shared-subscription group.
#[derive(Debug, Clone)]
pub struct Matches<T> {
    /// One entry per client with at least one matching ordinary subscription, in no particular
    /// order.
    pub clients: Vec<ClientMatch<T>>,
    /// One entry per matching (ShareName, filter) group, in no particular order.
    pub shared: Vec<SharedMatch<T>>,
}

impl<T> Default for Matches<T> {
    fn default() -> Self {
        Matches {
            clients: Vec::new(),
            shared: Vec::new(),
        }
    }
}

impl<T> Matches<T> {
    /// True when nothing matches.
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty() && self.shared.is_empty()
    }

    /// How many entries the result holds: client entries plus shared-group members. The cache
    /// is bounded by the sum of these.
    fn weight(&self) -> usize {
        self.clients.len() + self.shared.iter().map(|g| g.members.len()).sum::<usize>() + 1
    }
}

type Map<K, V> = HashMap<K, V, RandomState>;

/// A shared-subscription group on the node of its filter.
#[derive(Debug)]
struct Group<T> {
    name: Arc<str>,
    /// `$share/{name}/{filter}`.
    filter: Arc<str>,
    members: Vec<(ClientKey, T)>,
    next: Arc<AtomicUsize>,
}

/// The subscriptions of one filter.
#[derive(Debug)]
struct Leaf<T> {
    plain: Map<ClientKey, T>,
    shared: Vec<Group<T>>,
}

impl<T> Default for Leaf<T> {
    fn default() -> Self {
        Leaf {
            plain: Map::default(),
            shared: Vec::new(),
        }
    }
}

impl<T> Leaf<T> {
    fn is_empty(&self) -> bool {
        self.plain.is_empty() && self.shared.is_empty()
    }

    /// Inserts or replaces; true when new. `full` is the filter as subscribed (with
    /// `$share/{group}/`).
    fn insert(&mut self, group: Option<&str>, full: &str, client: ClientKey, value: T) -> bool {
        let Some(group) = group else {
            return self.plain.insert(client, value).is_none();
        };
        let index = match self.shared.iter().position(|g| &*g.name == group) {
            Some(i) => i,
            None => {
                self.shared.push(Group {
                    name: Arc::from(group),
                    filter: Arc::from(full),
                    members: Vec::new(),
                    next: Arc::new(AtomicUsize::new(0)),
                });
                self.shared.len() - 1
            }
        };
        let members = &mut self.shared[index].members;
        match members.iter_mut().find(|(c, _)| *c == client) {
            Some(member) => {
                member.1 = value;
                false
            }
            None => {
                members.push((client, value));
                true
            }
        }
    }

    /// Removes; true when it was there. Drops a group left empty.
    fn remove(&mut self, group: Option<&str>, client: &str) -> bool {
        let Some(group) = group else {
            let removed = self.plain.remove(client).is_some();
            if removed && self.plain.capacity() > 16 && self.plain.len() < self.plain.capacity() / 4
            {
                self.plain.shrink_to_fit();
            }
            return removed;
        };
        let Some(gi) = self.shared.iter().position(|g| &*g.name == group) else {
            return false;
        };
        let members = &mut self.shared[gi].members;
        let Some(mi) = members.iter().position(|(c, _)| &**c == client) else {
            return false;
        };
        // Keep the order of the remaining members: the cursor rotates over it.
        members.remove(mi);
        if members.is_empty() {
            self.shared.swap_remove(gi);
        }
        true
    }

    fn get(&self, group: Option<&str>, client: &str) -> Option<&T> {
        match group {
            None => self.plain.get(client),
            Some(group) => self
                .shared
                .iter()
                .find(|g| &*g.name == group)?
                .members
                .iter()
                .find(|(c, _)| &**c == client)
                .map(|(_, v)| v),
        }
    }
}

/// One level of the trie. Small (four pointers) and holding nothing it does not use: a level
/// costs its node, its name's bytes and, once a second sibling exists, a map entry, so a
/// filter of many empty levels (`//////...`) costs tens of bytes per level, not hundreds.
#[derive(Debug)]
struct Node<T> {
    literal: Children<Node<T>>,
    plus: Option<Box<Node<T>>>,
    multi: Option<Box<Leaf<T>>>,
    leaf: Option<Box<Leaf<T>>>,
}

impl<T> Default for Node<T> {
    fn default() -> Self {
        Node {
            literal: Children::default(),
            plus: None,
            multi: None,
            leaf: None,
        }
    }
}

impl<T> Node<T> {
    fn children(&self) -> usize {
        self.literal.len() + usize::from(self.plus.is_some()) + usize::from(self.multi.is_some())
    }

    fn leaf_is_empty(&self) -> bool {
        self.leaf.as_ref().is_none_or(|l| l.is_empty())
    }

    fn is_empty(&self) -> bool {
        self.children() == 0 && self.leaf_is_empty()
    }

    /// Moves the child nodes out, for the iterative drop.
    fn take_children(&mut self, into: &mut Vec<Node<T>>) {
        self.literal.take_into(into);
        if let Some(p) = self.plus.take() {
            into.push(*p);
        }
    }
}

impl<T> Drop for Node<T> {
    /// Drops the subtree without recursing per level (a filter may have 65,536 levels).
    fn drop(&mut self) {
        if self.literal.is_empty() && self.plus.is_none() {
            return;
        }
        let mut stack = Vec::new();
        self.take_children(&mut stack);
        while let Some(mut node) = stack.pop() {
            node.take_children(&mut stack);
        }
    }
}

/// One level of a filter, as the trie sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step<'a> {
    Literal(&'a str),
    Plus,
    /// `#` as the last level. A `#` elsewhere (an invalid filter) is a literal token.
    Multi,
}

fn steps(filter: &str) -> impl Iterator<Item = Step<'_>> {
    let mut levels = filter.split('/').peekable();
    std::iter::from_fn(move || {
        let level = levels.next()?;
        Some(match level {
            "+" => Step::Plus,
            "#" if levels.peek().is_none() => Step::Multi,
            other => Step::Literal(other),
        })
    })
}

/// Splits `$share/{ShareName}/{filter}` into `(Some(ShareName), filter)`; anything else
/// (including a malformed shared filter) is `(None, filter)`.
fn split_shared(filter: &str) -> (Option<&str>, &str) {
    match parse_shared(filter) {
        Ok(Some(shared)) => (Some(shared.group), shared.filter),
        _ => (None, filter),
    }
}

/// The bounded cache of match results.
struct Cache<T> {
    map: Map<Box<str>, Arc<Matches<T>>>,
    weight: usize,
    max_topics: usize,
    max_weight: usize,
}

impl<T> Cache<T> {
    fn clear(&mut self) {
        if !self.map.is_empty() {
            self.map.clear();
            self.weight = 0;
        }
    }

    fn insert(&mut self, topic: &str, matches: &Arc<Matches<T>>) {
        let weight = matches.weight();
        if self.max_topics == 0
            || topic.len() > MAX_CACHED_TOPIC_LEN
            || weight > self.max_weight / 8
        {
            return;
        }
        if self.map.len() >= self.max_topics || self.weight + weight > self.max_weight {
            // Evict about an eighth of the entries, in the map's (arbitrary) order: amortised
            // O(1) per insert, like NATS's random eviction.
            let mut evict = self.map.len() / 8 + 1;
            let mut freed = 0;
            self.map.retain(|_, m| {
                if evict > 0 {
                    evict -= 1;
                    freed += m.weight();
                    false
                } else {
                    true
                }
            });
            self.weight -= freed;
        }
        if let Some(old) = self.map.insert(Box::from(topic), Arc::clone(matches)) {
            self.weight -= old.weight();
        }
        self.weight += weight;
    }
}

/// The index of every subscription of the broker: topic filter -> subscribers, with
/// shared-subscription groups (MQTT 5.0 sections 4.7 and 4.8).
///
/// `T` is what the broker keeps per subscription (typically its
/// [`SubscriptionOptions`](crate::codec::SubscriptionOptions) and subscription identifier); it
/// is cloned into match results, so keep it small.
///
/// Writes take `&mut self` and reads `&self`: wrap the index in a `parking_lot::RwLock`.
/// The index is `Send + Sync` when `T` is.
pub struct SubscriptionIndex<T: Clone> {
    root: Node<T>,
    len: usize,
    cache: RwLock<Cache<T>>,
}

impl<T: Clone> Default for SubscriptionIndex<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Clone> std::fmt::Debug for SubscriptionIndex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubscriptionIndex")
            .field("len", &self.len)
            .field("cached_topics", &self.cache.read().map.len())
            .finish_non_exhaustive()
    }
}

impl<T: Clone> SubscriptionIndex<T> {
    /// An empty index whose cache holds up to [`DEFAULT_CACHE_TOPICS`] topics and
    /// [`DEFAULT_CACHE_SUBSCRIPTIONS`] subscriptions.
    pub fn new() -> Self {
        Self::with_cache_limits(DEFAULT_CACHE_TOPICS, DEFAULT_CACHE_SUBSCRIPTIONS)
    }

    /// An empty index whose cache holds up to `max_topics` topics whose results hold
    /// `max_subscriptions` entries in all. `max_topics == 0` disables the cache.
    pub fn with_cache_limits(max_topics: usize, max_subscriptions: usize) -> Self {
        SubscriptionIndex {
            root: Node::default(),
            len: 0,
            cache: RwLock::new(Cache {
                map: Map::default(),
                weight: 0,
                max_topics,
                max_weight: max_subscriptions,
            }),
        }
    }

    /// How many subscriptions the index holds: one per (client, full filter), shared members
    /// included.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the index holds no subscription.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Subscribes `client` to `filter` with `value`; `filter` may be a shared filter
    /// `$share/{ShareName}/{filter}`.
    ///
    /// Replaces the value of the same client's subscription to the same full filter (MQTT 5.0
    /// [MQTT-3.8.4-3]: a SUBSCRIBE for an existing filter replaces that subscription) and then
    /// returns false; returns true when the subscription is new (for Retain Handling 1).
    ///
    /// The filter must have been validated (see
    /// [`validate_subscription_filter`](crate::topic::validate_subscription_filter) or
    /// [`try_insert`](Self::try_insert)). An invalid filter does no harm: a misplaced `#` or a
    /// malformed `$share/...` is kept as literal text, which no valid topic name matches.
    pub fn insert(&mut self, filter: &str, client: ClientKey, value: T) -> bool {
        let full = filter;
        let (group, filter) = split_shared(filter);
        self.cache.get_mut().clear();
        let mut node = &mut self.root;
        let mut leaf = None;
        for step in steps(filter) {
            match step {
                Step::Literal(level) => node = node.literal.get_or_insert(level),
                Step::Plus => node = node.plus.get_or_insert_with(Box::default),
                Step::Multi => {
                    leaf = Some(node.multi.get_or_insert_with(Box::default));
                    break;
                }
            }
        }
        let leaf = match leaf {
            Some(leaf) => &mut **leaf,
            None => node.leaf.get_or_insert_with(Box::default),
        };
        let new = leaf.insert(group, full, client, value);
        if new {
            self.len += 1;
        }
        new
    }

    /// Validates `filter` with
    /// [`validate_subscription_filter`](crate::topic::validate_subscription_filter), then
    /// [`insert`](Self::insert)s it.
    ///
    /// # Errors
    ///
    /// The filter's [`TopicError`]; the index is unchanged then.
    pub fn try_insert(
        &mut self,
        filter: &str,
        client: ClientKey,
        value: T,
    ) -> Result<bool, TopicError> {
        validate_subscription_filter(filter)?;
        Ok(self.insert(filter, client, value))
    }

    /// The leaf holding the subscriptions of `filter` (without `$share/...`), if any.
    fn leaf(&self, filter: &str) -> Option<&Leaf<T>> {
        let mut node = &self.root;
        for step in steps(filter) {
            match step {
                Step::Literal(level) => node = node.literal.get(level)?,
                Step::Plus => node = node.plus.as_deref()?,
                Step::Multi => return node.multi.as_deref(),
            }
        }
        node.leaf.as_deref()
    }

    /// The shared-subscription group of the full filter `$share/{ShareName}/{filter}`, with
    /// its members and its cursor, as [`matches`](Self::matches) would report it; `None` when
    /// the group has no member (or `filter` is not a shared filter).
    pub fn shared_group(&self, filter: &str) -> Option<SharedMatch<T>>
    where
        T: Clone,
    {
        let (Some(group), filter) = split_shared(filter) else {
            return None;
        };
        let g = self
            .leaf(filter)?
            .shared
            .iter()
            .find(|g| &*g.name == group)?;
        Some(SharedMatch {
            group: Arc::clone(&g.name),
            filter: Arc::clone(&g.filter),
            members: g.members.clone(),
            next: Arc::clone(&g.next),
        })
    }

    /// The value of `client`'s subscription to `filter` (which may be `$share/...`), if any.
    pub fn get(&self, filter: &str, client: &str) -> Option<&T> {
        let (group, filter) = split_shared(filter);
        self.leaf(filter)?.get(group, client)
    }

    /// Unsubscribes `client` from `filter` (which may be `$share/...`). Returns whether the
    /// subscription existed (MQTT 5.0 UNSUBACK: 0x11 "No subscription existed" otherwise).
    ///
    /// Nodes and groups left empty are freed.
    pub fn remove(&mut self, filter: &str, client: &str) -> bool {
        let (group, filter) = split_shared(filter);
        let removed = self.remove_from_leaf(filter, group, client);
        if removed {
            self.len -= 1;
            self.cache.get_mut().clear();
            self.prune(filter);
        }
        removed
    }

    fn remove_from_leaf(&mut self, filter: &str, group: Option<&str>, client: &str) -> bool {
        let mut node = &mut self.root;
        for step in steps(filter) {
            let next = match step {
                Step::Literal(level) => node.literal.get_mut(level),
                Step::Plus => node.plus.as_deref_mut(),
                Step::Multi => {
                    return match node.multi.as_deref_mut() {
                        Some(leaf) => leaf.remove(group, client),
                        None => false,
                    };
                }
            };
            match next {
                Some(n) => node = n,
                None => return false,
            }
        }
        let Some(leaf) = node.leaf.as_deref_mut() else {
            return false;
        };
        let removed = leaf.remove(group, client);
        if leaf.is_empty() {
            node.leaf = None;
        }
        removed
    }

    /// Frees the part of `filter`'s path that no longer leads to any subscription. Two passes
    /// (find the topmost prunable step, then cut it) so that nothing recurses per level.
    fn prune(&mut self, filter: &str) {
        let Some(cut) = self.prune_point(filter) else {
            return;
        };
        let mut node = &mut self.root;
        for (i, step) in steps(filter).enumerate() {
            if i == cut {
                match step {
                    Step::Literal(level) => node.literal.remove(level),
                    Step::Plus => node.plus = None,
                    Step::Multi => node.multi = None,
                }
                return;
            }
            let next = match step {
                Step::Literal(level) => node.literal.get_mut(level),
                Step::Plus => node.plus.as_deref_mut(),
                Step::Multi => None,
            };
            match next {
                Some(n) => node = n,
                None => return,
            }
        }
    }

    /// The index of the first step from which everything along `filter`'s path is empty but
    /// for the path itself.
    fn prune_point(&self, filter: &str) -> Option<usize> {
        let mut node = &self.root;
        let mut cut = None;
        let mut steps = steps(filter).enumerate().peekable();
        while let Some((i, step)) = steps.next() {
            let last = steps.peek().is_none();
            let child = match step {
                Step::Literal(level) => node.literal.get(level)?,
                Step::Plus => node.plus.as_deref()?,
                Step::Multi => {
                    let leaf = node.multi.as_deref()?;
                    if leaf.is_empty() {
                        cut.get_or_insert(i);
                    } else {
                        cut = None;
                    }
                    break;
                }
            };
            let prunable = if last {
                child.is_empty()
            } else {
                child.leaf_is_empty() && child.children() == 1
            };
            if prunable {
                cut.get_or_insert(i);
            } else {
                cut = None;
            }
            node = child;
        }
        cut
    }

    /// Unsubscribes `client` from each of `filters` (e.g. when its session ends); returns how
    /// many subscriptions were removed.
    pub fn remove_client<I>(&mut self, client: &str, filters: I) -> usize
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        filters
            .into_iter()
            .filter(|f| self.remove(f.as_ref(), client))
            .count()
    }

    /// Removes every subscription.
    pub fn clear(&mut self) {
        self.root = Node::default();
        self.len = 0;
        self.cache.get_mut().clear();
    }

    /// How many trie nodes exist (the root and `#` leaves included): a measure of memory, and
    /// a way to check that removal frees what insertion built.
    pub fn node_count(&self) -> usize {
        let mut count = 0;
        let mut stack = vec![&self.root];
        while let Some(node) = stack.pop() {
            count += 1 + usize::from(node.multi.is_some());
            stack.extend(node.literal.values());
            stack.extend(node.plus.as_deref());
        }
        count
    }

    /// How many topics the match cache currently holds.
    pub fn cached_topics(&self) -> usize {
        self.cache.read().map.len()
    }

    /// Everything subscribed to the topic name `topic` (MQTT 5.0 section 4.7): the ordinary
    /// subscriptions grouped per client, and one entry per matching shared-subscription group.
    /// Filters starting with a wildcard do not match topics starting with `$` [MQTT-4.7.2-1].
    ///
    /// Results are cached until the next change of the index; the same `Arc` may be returned
    /// to many callers. `topic` should be a valid topic name (wildcards in it are plain
    /// characters here).
    pub fn matches(&self, topic: &str) -> Arc<Matches<T>> {
        if let Some(hit) = self.cache.read().map.get(topic) {
            return Arc::clone(hit);
        }
        let result = Arc::new(self.collect(topic));
        if let Some(mut cache) = self.cache.try_write() {
            cache.insert(topic, &result);
        }
        result
    }

    /// Walks the trie for `topic`, without recursion: follows literal children directly and
    /// stacks the `+` branches for later.
    fn collect(&self, topic: &str) -> Matches<T> {
        let mut out = Collector {
            clients: Vec::new(),
            first: None,
            index: None,
            shared: Vec::new(),
        };
        let mut pending: Vec<(&Node<T>, Option<&str>)> = Vec::new();
        let dollar = topic.starts_with('$');
        let mut current = Some((&self.root, Some(topic)));
        let mut at_root = true;
        while let Some((start, rest)) = current {
            let mut node = start;
            let mut rest = rest;
            loop {
                let wildcards = !(at_root && dollar);
                at_root = false;
                if wildcards {
                    if let Some(multi) = node.multi.as_deref() {
                        out.add(multi);
                    }
                }
                let Some(remaining) = rest else {
                    if let Some(leaf) = node.leaf.as_deref() {
                        out.add(leaf);
                    }
                    break;
                };
                let (level, next) = split_level(remaining);
                if wildcards {
                    if let Some(plus) = node.plus.as_deref() {
                        pending.push((plus, next));
                    }
                }
                match node.literal.get(level) {
                    Some(child) => {
                        node = child;
                        rest = next;
                    }
                    None => break,
                }
            }
            current = pending.pop();
        }
        Matches {
            clients: out.clients,
            shared: out.shared,
        }
    }
}

/// Accumulates a match, grouping ordinary subscriptions per client. Grouping needs a map only
/// once a second filter contributes subscriptions: within one filter, clients are unique.
struct Collector<'a, T> {
    clients: Vec<ClientMatch<T>>,
    first: Option<&'a Map<ClientKey, T>>,
    index: Option<Map<&'a str, usize>>,
    shared: Vec<SharedMatch<T>>,
}

impl<'a, T: Clone> Collector<'a, T> {
    fn add(&mut self, leaf: &'a Leaf<T>) {
        if !leaf.plain.is_empty() {
            self.add_plain(&leaf.plain);
        }
        for group in &leaf.shared {
            self.shared.push(SharedMatch {
                group: Arc::clone(&group.name),
                filter: Arc::clone(&group.filter),
                members: group.members.clone(),
                next: Arc::clone(&group.next),
            });
        }
    }

    fn add_plain(&mut self, plain: &'a Map<ClientKey, T>) {
        let Some(first) = self.first else {
            self.first = Some(plain);
            self.clients.reserve(plain.len());
            for (client, value) in plain {
                self.clients.push(ClientMatch {
                    client: Arc::clone(client),
                    subscriptions: vec![value.clone()],
                });
            }
            return;
        };
        let index = self.index.get_or_insert_with(|| {
            let mut index =
                Map::with_capacity_and_hasher(first.len() + plain.len(), RandomState::new());
            // The same map iterated again, unmodified: the same order as `clients`.
            for (i, client) in first.keys().enumerate() {
                index.insert(&**client, i);
            }
            index
        });
        for (client, value) in plain {
            match index.get(&**client) {
                Some(&i) => self.clients[i].subscriptions.push(value.clone()),
                None => {
                    index.insert(&**client, self.clients.len());
                    self.clients.push(ClientMatch {
                        client: Arc::clone(client),
                        subscriptions: vec![value.clone()],
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<X: Send + Sync>() {}

    #[test]
    fn index_is_send_and_sync() {
        assert_send_sync::<SubscriptionIndex<u32>>();
        assert_send_sync::<Arc<Matches<u32>>>();
    }

    #[test]
    fn steps_of_filters() {
        let s: Vec<_> = steps("a/+/#").collect();
        assert_eq!(s, vec![Step::Literal("a"), Step::Plus, Step::Multi]);
        let s: Vec<_> = steps("#/a").collect();
        assert_eq!(s, vec![Step::Literal("#"), Step::Literal("a")]);
        let s: Vec<_> = steps("/").collect();
        assert_eq!(s, vec![Step::Literal(""), Step::Literal("")]);
    }

    #[test]
    fn deep_filters_do_not_overflow_the_stack() {
        let filter = "/".repeat(65_534);
        let mut index = SubscriptionIndex::new();
        let client: ClientKey = Arc::from("c");
        assert!(index.insert(&filter, client.clone(), 1u8));
        assert!(index.insert(&format!("{filter}+"), client.clone(), 2u8));
        assert_eq!(index.matches(&filter).clients.len(), 1);
        assert!(index.remove(&filter, "c"));
        assert_eq!(index.len(), 1);
        drop(index);
    }
}
