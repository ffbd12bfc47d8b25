//! `[[streams]]`: named, retained logs of the messages matching a topic filter, which clients
//! replay from an offset or a time and then follow live (docs/streams.md).

use serde::Deserialize;

use super::ConfigError;

/// One `[[streams]]` entry: every message whose topic matches `filter` is appended to the
/// stream, whoever publishes it; a message may belong to several streams. The oldest
/// messages go first when a bound (`max_age`, `max_bytes`) is reached.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StreamConfig {
    /// Unique name (letters, digits, `_`, `-`, `.`): readers subscribe to `$stream/<name>`.
    pub name: String,
    /// The MQTT topic filter of the messages appended (wildcards allowed; not `$share/`).
    pub filter: String,
    /// Seconds a message stays in the stream; 0 (default) = no age limit.
    #[serde(default)]
    pub max_age: u64,
    /// Bytes the stream holds at most (the sum of each message's topic, payload and
    /// properties); 0 (default) = no limit. The newest message is always kept.
    #[serde(default)]
    pub max_bytes: u64,
    /// Keep only the newest message of each topic (default false).
    #[serde(default)]
    pub last_value: bool,
}

impl StreamConfig {
    /// The checks of one stream alone (name, filter), as one line: what a stream created at
    /// run time gets.
    pub fn check(&self) -> Result<(), String> {
        self.validate(0, &[])
            .map_err(|e| match e.key.strip_prefix("streams[0].") {
                Some(key) => format!("{key}: {}", e.message),
                None => e.message,
            })
    }

    /// Checks entry `index` against the entries before it: the name's characters and
    /// uniqueness, the filter.
    pub(super) fn validate(
        &self,
        index: usize,
        earlier: &[StreamConfig],
    ) -> Result<(), ConfigError> {
        let key = |name: &str| format!("streams[{index}].{name}");
        if !valid_name(&self.name) {
            return Err(ConfigError::new(
                key("name"),
                format!(
                    "{:?}: must be letters, digits, '_', '-' or '.', and not empty",
                    self.name
                ),
            ));
        }
        if let Some(j) = earlier.iter().position(|s| s.name == self.name) {
            return Err(ConfigError::new(
                key("name"),
                format!("{:?} is already used by streams[{j}]", self.name),
            ));
        }
        if self.filter.starts_with("$share/") || self.filter.starts_with("$stream/") {
            return Err(ConfigError::new(
                key("filter"),
                format!(
                    "{:?}: a stream's filter names the topics of published messages, not a \
                     shared subscription or another stream",
                    self.filter
                ),
            ));
        }
        if let Err(e) = crate::topic::validate_topic_filter(&self.filter) {
            return Err(ConfigError::new(
                key("filter"),
                format!("{:?} is not a valid topic filter: {e}", self.filter),
            ));
        }
        Ok(())
    }
}

/// True for a valid stream name: letters, digits, `_`, `-`, `.`, not empty.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> StreamConfig {
        StreamConfig {
            name: "tenant-a".into(),
            filter: "tenants/a/#".into(),
            max_age: 10_800,
            max_bytes: 10 << 20,
            last_value: false,
        }
    }

    #[test]
    fn checks_name_and_filter() {
        assert!(example().validate(0, &[]).is_ok());
        let mut s = example();
        s.name = "a/b".into();
        assert_eq!(s.validate(0, &[]).unwrap_err().key, "streams[0].name");
        s.name = String::new();
        assert_eq!(s.validate(0, &[]).unwrap_err().key, "streams[0].name");
        let e = example().validate(1, &[example()]).unwrap_err();
        assert_eq!(e.key, "streams[1].name");
        assert!(e.message.contains("streams[0]"));
        let mut s = example();
        s.filter = "a/#/b".into();
        assert_eq!(s.validate(0, &[]).unwrap_err().key, "streams[0].filter");
        s.filter = "$share/g/a".into();
        assert_eq!(s.validate(0, &[]).unwrap_err().key, "streams[0].filter");
    }
}
