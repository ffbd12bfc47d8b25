//! The numeric keys whose valid values are narrower than their type's, each written once:
//! [`Config::validate`](super::Config::validate) checks a value against its [`KeyRange`], and
//! the configuration file reader says the same range in words when the value is not even of
//! the key's type (`max_qos = "two"`, `busy_poll = -1`), so that fixing one error does not lead
//! to a second one about the same key.

use super::{
    ConfigError, MAX_BUSY_POLL, MAX_PACKET_SIZE_LIMIT, MIN_PACKET_SIZE_LIMIT,
    MIN_PUBLISH_BYTES_RATE, MIN_QUEUED_MEMORY, MIN_RETAINED_BYTES,
};

/// The valid values of one numeric key: `min..=max`, and 0 besides when `zero` says what 0
/// means (unlimited, no limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRange {
    /// The key's path in the file: `server.max_qos`; `bridges[].keepalive` stands for the key
    /// of every entry of an array of tables.
    pub key: &'static str,
    /// Smallest valid value (0 aside, see `zero`).
    pub min: u64,
    /// Largest valid value; `u64::MAX` for no upper bound but the type's.
    pub max: u64,
    /// What 0 means when it is valid outside `min..=max` (`"unlimited"`), else `None`.
    pub zero: Option<&'static str>,
    /// The unit, plural (`"seconds"`, `"bytes"`), or `""` for a count.
    pub unit: &'static str,
}

/// `[server] max_packet_size`: 0 (no limit), or from the smallest CONNECT to the MQTT limit.
pub const MAX_PACKET_SIZE: KeyRange = KeyRange {
    key: "server.max_packet_size",
    min: MIN_PACKET_SIZE_LIMIT as u64,
    max: MAX_PACKET_SIZE_LIMIT as u64,
    zero: Some("no limit"),
    unit: "bytes",
};
/// `[server] queue_high_water`.
pub const QUEUE_HIGH_WATER: KeyRange = at_least_one("server.queue_high_water", "");
/// `[server] queue_high_water_bytes`.
pub const QUEUE_HIGH_WATER_BYTES: KeyRange = at_least_one("server.queue_high_water_bytes", "");
/// `[server] stall_time`.
pub const STALL_TIME: KeyRange = at_least_one("server.stall_time", "seconds");
/// `[server] busy_poll`: at most one second.
pub const BUSY_POLL: KeyRange = KeyRange {
    key: "server.busy_poll",
    min: 0,
    max: MAX_BUSY_POLL as u64,
    zero: None,
    unit: "microseconds",
};
/// `[server] max_retained_bytes`: 0 (unlimited) or at least 1 KiB.
pub const MAX_RETAINED_BYTES: KeyRange = KeyRange {
    key: "server.max_retained_bytes",
    min: MIN_RETAINED_BYTES,
    max: u64::MAX,
    zero: Some("unlimited"),
    unit: "bytes",
};
/// `[server] max_queued_memory`: 0 (no limit) or at least 64 KiB.
pub const MAX_QUEUED_MEMORY: KeyRange = KeyRange {
    key: "server.max_queued_memory",
    min: MIN_QUEUED_MEMORY,
    max: u64::MAX,
    zero: Some("no limit"),
    unit: "bytes",
};
/// `[storage] stream_memory_bytes`: at least 64 KiB.
pub const STREAM_MEMORY_BYTES: KeyRange = KeyRange {
    key: "storage.stream_memory_bytes",
    min: 64 * 1024,
    max: u64::MAX,
    zero: None,
    unit: "bytes",
};
/// `[server] max_publish_bytes_rate`: 0 (unlimited) or at least 1 KiB per second.
pub const MAX_PUBLISH_BYTES_RATE: KeyRange = KeyRange {
    key: "server.max_publish_bytes_rate",
    min: MIN_PUBLISH_BYTES_RATE as u64,
    max: u64::MAX,
    zero: Some("unlimited"),
    unit: "bytes per second",
};
/// `[server] max_qos`.
pub const MAX_QOS: KeyRange = qos("server.max_qos");
/// `[server] connect_timeout`.
pub const CONNECT_TIMEOUT: KeyRange = at_least_one("server.connect_timeout", "seconds");
/// `[[bridges]] keepalive`: at least 5 seconds, at most MQTT's two bytes.
pub const BRIDGE_KEEPALIVE: KeyRange = KeyRange {
    key: "bridges[].keepalive",
    min: 5,
    max: u16::MAX as u64,
    zero: None,
    unit: "seconds",
};
/// `[[bridges]] max_inflight`.
pub const BRIDGE_MAX_INFLIGHT: KeyRange = KeyRange {
    key: "bridges[].max_inflight",
    min: 1,
    max: u16::MAX as u64,
    zero: None,
    unit: "",
};
/// `[[bridges]] max_packet_size`: as `[server] max_packet_size`.
pub const BRIDGE_MAX_PACKET_SIZE: KeyRange = KeyRange {
    key: "bridges[].max_packet_size",
    ..MAX_PACKET_SIZE
};
/// `[[bridges.topics]] qos`.
pub const BRIDGE_TOPIC_QOS: KeyRange = qos("bridges[].topics[].qos");

/// Every range [`Config::validate`](super::Config::validate) checks.
pub const RANGES: &[KeyRange] = &[
    MAX_PACKET_SIZE,
    QUEUE_HIGH_WATER,
    QUEUE_HIGH_WATER_BYTES,
    STALL_TIME,
    BUSY_POLL,
    MAX_RETAINED_BYTES,
    MAX_QUEUED_MEMORY,
    MAX_PUBLISH_BYTES_RATE,
    STREAM_MEMORY_BYTES,
    MAX_QOS,
    CONNECT_TIMEOUT,
    BRIDGE_KEEPALIVE,
    BRIDGE_MAX_INFLIGHT,
    BRIDGE_MAX_PACKET_SIZE,
    BRIDGE_TOPIC_QOS,
];

const fn at_least_one(key: &'static str, unit: &'static str) -> KeyRange {
    KeyRange {
        key,
        min: 1,
        max: u64::MAX,
        zero: None,
        unit,
    }
}

const fn qos(key: &'static str) -> KeyRange {
    KeyRange {
        key,
        min: 0,
        max: 2,
        zero: None,
        unit: "",
    }
}

impl KeyRange {
    /// Whether `value` is valid.
    pub fn contains(&self, value: u64) -> bool {
        (self.min..=self.max).contains(&value) || (value == 0 && self.zero.is_some())
    }

    /// The valid values in words, as an error message says them after "must be" or
    /// "expected": `0, 1 or 2`, `a whole number of seconds, 1 or more`, `a whole number of
    /// microseconds from 0 to 1000000`, `a whole number of bytes, 0 (unlimited) or 1024 or
    /// more`.
    pub fn words(&self) -> String {
        if self.zero.is_none() && self.max - self.min <= 2 && self.unit.is_empty() {
            let values: Vec<String> = (self.min..=self.max).map(|v| v.to_string()).collect();
            return match values.split_last() {
                Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
                _ => values.concat(),
            };
        }
        let mut base = String::from("a whole number");
        if !self.unit.is_empty() {
            base.push_str(" of ");
            base.push_str(self.unit);
        }
        match (self.max == u64::MAX, self.zero) {
            (true, Some(zero)) => format!("{base}, 0 ({zero}) or {} or more", self.min),
            (true, None) => format!("{base}, {} or more", self.min),
            (false, Some(zero)) => {
                format!("{base} from {} to {}, or 0 ({zero})", self.min, self.max)
            }
            (false, None) => format!("{base} from {} to {}", self.min, self.max),
        }
    }

    /// `Ok` when `value` is valid, else an error about this key: `must be WORDS, not VALUE`.
    pub fn check(&self, value: impl Into<u64>) -> Result<(), ConfigError> {
        self.check_at(self.key, value)
    }

    /// [`KeyRange::check`] for the key at `path`, this key with its indices
    /// (`bridges[1].keepalive`).
    pub fn check_at(
        &self,
        path: impl Into<String>,
        value: impl Into<u64>,
    ) -> Result<(), ConfigError> {
        let value = value.into();
        if self.contains(value) {
            return Ok(());
        }
        Err(ConfigError::new(
            path,
            format!("must be {}, not {value}", self.words()),
        ))
    }
}

/// The range of the key at `path` (`server.max_qos`, `bridges[2].keepalive`), if it has one
/// narrower than its type's.
pub fn range_of(path: &str) -> Option<&'static KeyRange> {
    let mut pattern = String::with_capacity(path.len());
    let mut in_index = false;
    for c in path.chars() {
        match c {
            '[' => {
                in_index = true;
                pattern.push('[');
            }
            ']' => {
                in_index = false;
                pattern.push(']');
            }
            _ if in_index => {}
            _ => pattern.push(c),
        }
    }
    RANGES.iter().find(|r| r.key == pattern)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_of_each_shape() {
        assert_eq!(MAX_QOS.words(), "0, 1 or 2");
        assert_eq!(STALL_TIME.words(), "a whole number of seconds, 1 or more");
        assert_eq!(QUEUE_HIGH_WATER.words(), "a whole number, 1 or more");
        assert_eq!(
            BUSY_POLL.words(),
            "a whole number of microseconds from 0 to 1000000"
        );
        assert_eq!(
            MAX_RETAINED_BYTES.words(),
            "a whole number of bytes, 0 (unlimited) or 1024 or more"
        );
        assert_eq!(
            MAX_PACKET_SIZE.words(),
            "a whole number of bytes from 14 to 268435455, or 0 (no limit)"
        );
    }

    #[test]
    fn keys_with_indices_find_their_range() {
        assert_eq!(range_of("server.max_qos"), Some(&MAX_QOS));
        assert_eq!(range_of("bridges[3].keepalive"), Some(&BRIDGE_KEEPALIVE));
        assert_eq!(
            range_of("bridges[0].topics[12].qos"),
            Some(&BRIDGE_TOPIC_QOS)
        );
        assert_eq!(range_of("server.max_inflight"), None);
    }

    #[test]
    fn zero_is_valid_only_when_it_means_something() {
        assert!(MAX_RETAINED_BYTES.contains(0));
        assert!(!MAX_RETAINED_BYTES.contains(1023));
        assert!(MAX_RETAINED_BYTES.contains(1024));
        assert!(!STALL_TIME.contains(0));
        assert!(!BUSY_POLL.contains(1_000_001));
    }
}
