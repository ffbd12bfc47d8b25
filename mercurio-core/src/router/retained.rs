//! Retained messages (MQTT 5.0 section 3.3.1.3), keyed by topic name in a trie of levels.
//!
//! A SUBSCRIBE looks up every retained message its filter matches ([`RetainedStore::matching`]);
//! a PUBLISH with the RETAIN flag replaces the topic's message, and one with an empty payload
//! removes it [MQTT-3.3.1-6] [MQTT-3.3.1-7] (the broker decides which call to make). Nodes left
//! empty by a removal are freed; nothing recurses per level.

use super::children::Children;
use crate::topic::split_level;

/// One level of the trie: its children (without a map while there is one) and the retained
/// message of the topic ending here.
struct Node<T> {
    children: Children<Node<T>>,
    value: Option<T>,
}

impl<T> Default for Node<T> {
    fn default() -> Self {
        Node {
            children: Children::default(),
            value: None,
        }
    }
}

impl<T> Node<T> {
    fn is_empty(&self) -> bool {
        self.value.is_none() && self.children.is_empty()
    }
}

impl<T> Drop for Node<T> {
    /// Drops the subtree without recursing per level.
    fn drop(&mut self) {
        if self.children.is_empty() {
            return;
        }
        let mut stack: Vec<Node<T>> = Vec::new();
        self.children.take_into(&mut stack);
        while let Some(mut node) = stack.pop() {
            node.children.take_into(&mut stack);
        }
    }
}

/// The retained messages of the broker, one per topic name.
///
/// `T` is the stored message (typically a PUBLISH whose payload is a shared `Bytes`); it is
/// cloned into [`matching`](Self::matching) results. A store made with
/// [`weighed`](Self::weighed) also keeps the total size of its messages
/// ([`bytes`](Self::bytes)). Not internally locked: wrap it in a `parking_lot::RwLock`.
pub struct RetainedStore<T: Clone> {
    root: Node<T>,
    len: usize,
    /// The sum of `weigh` over the stored messages.
    bytes: usize,
    weigh: fn(&T) -> usize,
}

impl<T: Clone> Default for RetainedStore<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Clone> std::fmt::Debug for RetainedStore<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetainedStore")
            .field("len", &self.len)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

enum Work<'n, 'f, T> {
    /// Match the rest of the filter (`None`: the filter is used up) from this node.
    Match(&'n Node<T>, Option<&'f str>),
    /// Take every value of this subtree (after a `#`).
    All(&'n Node<T>),
}

impl<T: Clone> RetainedStore<T> {
    /// An empty store that does not weigh its messages ([`bytes`](Self::bytes) stays 0).
    pub fn new() -> Self {
        Self::weighed(|_| 0)
    }

    /// An empty store that keeps the total of `weigh` (a message's size in bytes) over the
    /// messages it holds, for [`bytes`](Self::bytes).
    pub fn weighed(weigh: fn(&T) -> usize) -> Self {
        RetainedStore {
            root: Node::default(),
            len: 0,
            bytes: 0,
            weigh,
        }
    }

    /// The total size of the retained messages, as the store's `weigh` function counts it
    /// (0 for a store made with [`new`](Self::new)).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many retained messages the store holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the store holds no retained message.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Retains `value` for the topic name `topic`, replacing and returning the previous one
    /// [MQTT-3.3.1-5]. `topic` should be a valid topic name (see
    /// [`validate_topic_name`](crate::topic::validate_topic_name)).
    pub fn insert(&mut self, topic: &str, value: T) -> Option<T> {
        let mut node = &mut self.root;
        let mut rest = Some(topic);
        while let Some(s) = rest {
            let (level, next) = split_level(s);
            node = node.children.get_or_insert(level);
            rest = next;
        }
        self.bytes += (self.weigh)(&value);
        let old = node.value.replace(value);
        match &old {
            Some(old) => self.bytes -= (self.weigh)(old),
            None => self.len += 1,
        }
        old
    }

    fn node(&self, topic: &str) -> Option<&Node<T>> {
        let mut node = &self.root;
        let mut rest = Some(topic);
        while let Some(s) = rest {
            let (level, next) = split_level(s);
            node = node.children.get(level)?;
            rest = next;
        }
        Some(node)
    }

    /// The message retained for the topic name `topic`, if any.
    pub fn get(&self, topic: &str) -> Option<&T> {
        self.node(topic)?.value.as_ref()
    }

    /// Removes and returns the message retained for `topic`, freeing the nodes left empty.
    pub fn remove(&mut self, topic: &str) -> Option<T> {
        let mut node = &mut self.root;
        let mut rest = Some(topic);
        while let Some(s) = rest {
            let (level, next) = split_level(s);
            node = node.children.get_mut(level)?;
            rest = next;
        }
        let old = node.value.take()?;
        self.len -= 1;
        self.bytes -= (self.weigh)(&old);
        self.prune(topic);
        Some(old)
    }

    /// Cuts the topmost part of `topic`'s path that leads to nothing but the path.
    fn prune(&mut self, topic: &str) {
        // Pass 1: find the first level from which the path holds nothing else.
        let mut cut = None;
        {
            let mut node = &self.root;
            let mut rest = Some(topic);
            let mut i = 0usize;
            while let Some(s) = rest {
                let (level, next) = split_level(s);
                let Some(child) = node.children.get(level) else {
                    return;
                };
                let prunable = match next {
                    None => child.is_empty(),
                    Some(_) => child.value.is_none() && child.children.len() == 1,
                };
                if prunable {
                    cut.get_or_insert(i);
                } else {
                    cut = None;
                }
                node = child;
                rest = next;
                i += 1;
            }
        }
        let Some(cut) = cut else {
            return;
        };
        // Pass 2: walk to the parent of that level and cut.
        let mut node = &mut self.root;
        let mut rest = Some(topic);
        let mut i = 0usize;
        while let Some(s) = rest {
            let (level, next) = split_level(s);
            if i == cut {
                node.children.remove(level);
                return;
            }
            let Some(child) = node.children.get_mut(level) else {
                return;
            };
            node = child;
            rest = next;
            i += 1;
        }
    }

    /// Calls `f` with every retained message whose topic matches the topic filter `filter`
    /// (MQTT 5.0 section 4.7): `+` matches one level, `#` the parent level and every level
    /// below, and a filter starting with a wildcard skips topics starting with `$`
    /// [MQTT-4.7.2-1]. `filter` is an ordinary filter (retained messages are not sent for
    /// shared subscriptions, MQTT 5.0 section 4.8.2). Order is unspecified.
    pub fn for_each_matching(&self, filter: &str, mut f: impl FnMut(&T)) {
        let mut stack = vec![Work::Match(&self.root, Some(filter))];
        let mut at_root = true;
        while let Some(work) = stack.pop() {
            let root_level = std::mem::replace(&mut at_root, false);
            match work {
                Work::All(node) => {
                    if let Some(value) = &node.value {
                        f(value);
                    }
                    stack.extend(node.children.values().map(Work::All));
                }
                Work::Match(node, None) => {
                    if let Some(value) = &node.value {
                        f(value);
                    }
                }
                Work::Match(node, Some(rest)) => {
                    let (level, next) = split_level(rest);
                    match level {
                        "#" => {
                            // "sport/#" also matches "sport" [MQTT-4.7.1-2].
                            if let Some(value) = &node.value {
                                f(value);
                            }
                            stack.extend(
                                node.children
                                    .iter()
                                    .filter(|(k, _)| !(root_level && k.starts_with('$')))
                                    .map(|(_, n)| Work::All(n)),
                            );
                        }
                        "+" => stack.extend(
                            node.children
                                .iter()
                                .filter(|(k, _)| !(root_level && k.starts_with('$')))
                                .map(|(_, n)| Work::Match(n, next)),
                        ),
                        literal => {
                            if let Some(child) = node.children.get(literal) {
                                stack.push(Work::Match(child, next));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every retained message whose topic matches `filter`, cloned; see
    /// [`for_each_matching`](Self::for_each_matching) for the rules.
    pub fn matching(&self, filter: &str) -> Vec<T> {
        let mut out = Vec::new();
        self.for_each_matching(filter, |v| out.push(v.clone()));
        out
    }

    /// Removes every retained message.
    pub fn clear(&mut self) {
        self.root = Node::default();
        self.len = 0;
        self.bytes = 0;
    }

    /// How many trie nodes exist, the root included: a measure of memory, and a way to check
    /// that removal frees what insertion built.
    pub fn node_count(&self) -> usize {
        let mut count = 0;
        let mut stack = vec![&self.root];
        while let Some(node) = stack.pop() {
            count += 1;
            stack.extend(node.children.values());
        }
        count
    }
}

#[cfg(test)]
mod tests {
    use super::RetainedStore;

    /// A weighed store keeps the total of its messages' sizes through inserts, replacements,
    /// removals and clear.
    #[test]
    fn bytes_follow_inserts_replacements_and_removals() {
        let mut store = RetainedStore::<String>::weighed(String::len);
        store.insert("a/b", "12345".to_string());
        store.insert("a/c", "123".to_string());
        assert_eq!(store.bytes(), 8);
        store.insert("a/b", "1".to_string());
        assert_eq!(store.bytes(), 4);
        assert_eq!(store.remove("a/c").as_deref(), Some("123"));
        assert_eq!(store.bytes(), 1);
        assert_eq!(store.remove("a/c"), None);
        assert_eq!(store.bytes(), 1);
        store.clear();
        assert_eq!((store.len(), store.bytes()), (0, 0));
        let mut plain = RetainedStore::<String>::new();
        plain.insert("t", "payload".to_string());
        assert_eq!(plain.bytes(), 0);
    }
}
