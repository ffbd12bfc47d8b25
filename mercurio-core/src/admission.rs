//! `AcceptRate`: a listener's `max_connection_rate` and `max_connection_burst`, a token bucket
//! asked by its accept loop (`listener::run`) after each accept. Over the rate the loop
//! waits before it accepts the next socket, so the clients beyond it wait in the kernel's
//! listen backlog ([`LISTEN_BACKLOG`]) with nothing allocated, and their `connect_timeout`
//! starts only when their socket is served. A reconnect storm (after a takeover, a network
//! cut) is paced at the rate instead of arriving at storage all at once.

use std::time::Duration;

use tokio::time::Instant;

/// The listen backlog asked of the kernel for every listener: room for this many completed
/// connections waiting to be accepted (Linux caps it at `net.core.somaxconn`, 4096 by
/// default since 5.4; raise that to use all of it). A connection arriving while the backlog
/// is full is not refused: its SYN is dropped and the client retries it (after 1 s, then 3 s).
pub(crate) const LISTEN_BACKLOG: u32 = 8192;

/// Seconds the kernel holds a new connection back from `accept` until its first bytes
/// arrive (`TCP_DEFER_ACCEPT` on plain MQTT over TCP listeners without
/// `max_connection_rate`, Linux): the client sends CONNECT first [MQTT-3.1.0-1], so a
/// connection is accepted with it already in and answered in the same turn, where
/// accepting it at the handshake costs the broker a second wake-up (the empty first read,
/// the wait for the CONNECT) and the client the cost of waking it. A connection that sends nothing is accepted when this runs out (at the
/// kernel's first SYN-ACK retransmission, about 1 s): only then does it take a
/// `max_connections` place and its `connect_timeout` start. TLS, WebSocket and PROXY
/// listeners accept at the handshake as before: their `connect_timeout`, shared with a TLS
/// handshake or a header, keeps counting from there.
#[cfg(target_os = "linux")]
pub(crate) const DEFER_ACCEPT_SECS: libc::c_int = 1;

/// A token bucket: `burst` tokens at most, refilled at `rate` per second; one per accepted
/// connection (a connection's reader also paces its PUBLISH packets with it,
/// `connection::rate`, one per packet or one per byte).
#[derive(Debug)]
pub(crate) struct AcceptRate {
    /// Tokens per second.
    rate: f64,
    /// The bucket's size, at least 1.
    burst: f64,
    tokens: f64,
    refilled: Instant,
}

impl AcceptRate {
    /// The bucket of a listener; `None` when `rate` is 0 (unlimited). `burst` 0 means 1.
    /// Starts full.
    pub(crate) fn new(rate: u32, burst: u32) -> Option<AcceptRate> {
        if rate == 0 {
            return None;
        }
        let burst = f64::from(burst.max(1));
        Some(AcceptRate {
            rate: f64::from(rate),
            burst,
            tokens: burst,
            refilled: Instant::now(),
        })
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.refilled = now;
    }

    /// Takes a token for a connection accepted now: `None` when there was one, else how long
    /// to wait before serving it (the token is taken in advance: the caller waits that long).
    pub(crate) fn take(&mut self, now: Instant) -> Option<Duration> {
        self.take_n(now, 1.0)
    }

    /// Takes `n` tokens now, as [`take`](Self::take) takes one. More than the bucket holds
    /// is taken all the same, in advance: the wait is then what the rate needs to refill
    /// them (a PUBLISH larger than a second's worth of bytes passes, once its time is paid).
    pub(crate) fn take_n(&mut self, now: Instant, n: f64) -> Option<Duration> {
        self.refill(now);
        self.tokens -= n;
        if self.tokens >= 0.0 {
            return None;
        }
        Some(Duration::from_secs_f64(-self.tokens / self.rate))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over any window of `t` seconds at most `burst + rate * t` connections are served.
    #[test]
    fn bucket_paces_at_the_rate_after_the_burst() {
        let start = Instant::now();
        let mut b = AcceptRate::new(10, 3).unwrap();
        // The burst passes at once.
        for _ in 0..3 {
            assert_eq!(b.take(start), None);
        }
        // Then one every 100 ms, each waiting for its turn.
        let mut served = Vec::new();
        for _ in 0..20 {
            let wait = b.take(start).unwrap_or_default();
            served.push(wait);
        }
        for (i, w) in served.iter().enumerate() {
            let expected = Duration::from_millis(100 * (i as u64 + 1));
            assert!(
                w.abs_diff(expected) < Duration::from_millis(1),
                "{i}: {w:?}"
            );
        }
        // After a quiet spell the bucket is full again, never fuller.
        let later = start + Duration::from_secs(60);
        for _ in 0..3 {
            assert_eq!(b.take(later), None);
        }
        assert!(b.take(later).is_some());
        assert!(AcceptRate::new(0, 5).is_none());
        // Burst 0 is 1.
        let mut one = AcceptRate::new(1, 0).unwrap();
        assert_eq!(one.take(start), None);
        assert!(one.take(start).is_some());
    }
}
