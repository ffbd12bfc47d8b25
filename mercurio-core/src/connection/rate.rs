//! `PublishRate`: a connection's `[server] max_publish_rate` and `max_publish_bytes_rate`,
//! two token buckets (`admission::AcceptRate`) its reader charges before each PUBLISH it
//! handles. Over either rate the reader waits before it handles the packet and reads
//! nothing meanwhile: TCP slows the client down and its QoS 1/2 acknowledgements come later.
//! Nothing is dropped and the client is not disconnected. Each bucket holds one second's
//! worth (the burst a client that was quiet may send at once).

use std::time::Duration;

use tokio::time::Instant;

use crate::admission::AcceptRate;
use crate::config::ServerConfig;

/// The buckets of one connection. Absent (`None` in the reader, one branch per packet) when
/// both limits are 0.
#[derive(Debug)]
pub(super) struct PublishRate {
    /// PUBLISH packets per second (`max_publish_rate`).
    packets: Option<AcceptRate>,
    /// Bytes of PUBLISH packets per second, fixed header included (`max_publish_bytes_rate`).
    bytes: Option<AcceptRate>,
}

impl PublishRate {
    /// The buckets for `server`'s limits, full; `None` when both are 0 (unlimited).
    pub(super) fn of(server: &ServerConfig) -> Option<Box<PublishRate>> {
        let (rate, bytes_rate) = (server.max_publish_rate, server.max_publish_bytes_rate);
        if rate == 0 && bytes_rate == 0 {
            return None;
        }
        Some(Box::new(PublishRate {
            packets: AcceptRate::new(rate, rate),
            bytes: AcceptRate::new(bytes_rate, bytes_rate),
        }))
    }

    /// Charges one PUBLISH of `size` bytes (its whole packet) now: `None` when both buckets
    /// had room, else how long the reader must wait before handling it.
    pub(super) fn charge(&mut self, size: usize) -> Option<Duration> {
        let now = Instant::now();
        let by_count = self.packets.as_mut().and_then(|b| b.take(now));
        let by_size = self.bytes.as_mut().and_then(|b| b.take_n(now, size as f64));
        by_count.max(by_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(rate: u32, bytes_rate: u32) -> ServerConfig {
        ServerConfig {
            max_publish_rate: rate,
            max_publish_bytes_rate: bytes_rate,
            ..ServerConfig::default()
        }
    }

    #[test]
    fn none_without_limits() {
        assert!(PublishRate::of(&ServerConfig::default()).is_none());
    }

    /// A second's worth passes at once, then the packet count or the bytes make it wait.
    #[test]
    fn waits_past_a_seconds_worth() {
        let mut r = PublishRate::of(&server(10, 0)).expect("limited");
        for _ in 0..10 {
            assert_eq!(r.charge(1_000_000), None);
        }
        assert!(r.charge(10).is_some_and(|w| w > Duration::from_millis(90)));

        let mut r = PublishRate::of(&server(0, 10_000)).expect("limited");
        assert_eq!(r.charge(6_000), None);
        assert_eq!(r.charge(4_000), None);
        let wait = r.charge(5_000).expect("over the bytes rate");
        assert!(wait > Duration::from_millis(490), "{wait:?}");
        // A packet larger than a second's worth passes once its time is paid.
        let mut r = PublishRate::of(&server(0, 1_000)).expect("limited");
        assert!(r
            .charge(3_000)
            .is_some_and(|w| w > Duration::from_millis(1990)));
    }
}
