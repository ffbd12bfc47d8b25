//! Local addresses the generator's connections come from (`--source-net`).
//!
//! A closed connection stays in TIME_WAIT for a minute on the side that closed first, its
//! addresses and ports taken. A run right after another then connects among thousands of
//! them: the generator's search for a free local port (when it closed first) or the broker's
//! TIME_WAIT entries for the same address and port pairs (when the broker did) slow its
//! connects, and the second of two runs measures the first one's leftovers. All of
//! 127.0.0.0/8 is loopback, so each run can come from its own addresses (e.g. 127.0.ROUND.1
//! to 127.0.ROUND.254), with which no connection was ever made.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};

/// A pool of IPv4 loopback addresses handed out in turn: the hosts of one network.
#[derive(Debug)]
pub struct SourceAddrs {
    /// The first host address (the network address + 1), as a number.
    first: u32,
    /// Hosts in the pool (the network's addresses less the network and broadcast ones; all
    /// of them for a /31 or /32).
    hosts: u32,
    next: AtomicU32,
}

impl SourceAddrs {
    /// Parses `A.B.C.D/LEN` (LEN from 8 to 32; a bare address is a /32). The network must be
    /// within 127.0.0.0/8. Errors: a malformed network, or one outside loopback.
    pub fn parse(net: &str) -> Result<SourceAddrs, String> {
        let (addr, len) = match net.split_once('/') {
            Some((a, l)) => (
                a,
                l.parse::<u32>()
                    .map_err(|_| format!("--source-net {net}: bad prefix length"))?,
            ),
            None => (net, 32),
        };
        let ip: Ipv4Addr = addr
            .parse()
            .map_err(|_| format!("--source-net {net}: not an IPv4 address"))?;
        if !(8..=32).contains(&len) {
            return Err(format!(
                "--source-net {net}: the prefix length must be from 8 to 32"
            ));
        }
        if !ip.is_loopback() {
            return Err(format!(
                "--source-net {net}: not within 127.0.0.0/8 (recado bench runs on loopback only)"
            ));
        }
        let size = 1u64 << (32 - len);
        let network = u32::from(ip) & !((size - 1) as u32);
        let (first, hosts) = if size <= 2 {
            (network, size as u32)
        } else {
            (network + 1, (size - 2).min(u64::from(u32::MAX)) as u32)
        };
        Ok(SourceAddrs {
            first,
            hosts,
            next: AtomicU32::new(0),
        })
    }

    /// The next local address to bind to, port 0 (the kernel picks the port).
    pub fn next(&self) -> SocketAddr {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.hosts;
        SocketAddr::from((Ipv4Addr::from(self.first + i), 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_the_hosts_of_the_network_in_turn() {
        let s = SourceAddrs::parse("127.0.3.9/30").unwrap();
        let got: Vec<String> = (0..3).map(|_| s.next().ip().to_string()).collect();
        assert_eq!(got, ["127.0.3.9", "127.0.3.10", "127.0.3.9"]);
        let s = SourceAddrs::parse("127.0.7.0/24").unwrap();
        let got: Vec<String> = (0..255).map(|_| s.next().to_string()).collect();
        assert_eq!(got[0], "127.0.7.1:0");
        assert_eq!(got[253], "127.0.7.254:0");
        assert_eq!(got[254], "127.0.7.1:0", "254 hosts, then the first again");
        let s = SourceAddrs::parse("127.1.2.3").unwrap();
        assert_eq!(s.next(), s.next());
        assert!(SourceAddrs::parse("10.0.0.0/24").is_err());
        assert!(SourceAddrs::parse("127.0.0.0/4").is_err());
        assert!(SourceAddrs::parse("127.0.0.0/x").is_err());
    }
}
