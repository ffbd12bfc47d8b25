//! `Cidr`: an address block such as `10.0.0.0/8` or `fd00::/8` (a listener's `proxy_from`).

use std::net::IpAddr;

/// An IPv4 or IPv6 address block: an address and how many of its leading bits must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `ADDR/PREFIX` or a lone `ADDR` (one address: /32 or /128). Errors name what is
    /// wrong: an address that does not parse, a prefix longer than the address.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or ADDRESS/PREFIX block"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|&p| p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix length must be 0 to {max}"))?,
        };
        Ok(Cidr { addr, prefix })
    }

    /// The loopback blocks, 127.0.0.0/8 and ::1.
    pub fn loopback() -> [Cidr; 2] {
        [
            Cidr {
                addr: IpAddr::from([127, 0, 0, 0]),
                prefix: 8,
            },
            Cidr {
                addr: IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]),
                prefix: 128,
            },
        ]
    }

    /// True when `ip` lies in the block. An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`)
    /// counts as its IPv4 address.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let b = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(b.contains(ip("10.1.200.3")));
        assert!(!b.contains(ip("10.2.0.1")));
        assert!(b.contains(ip("::ffff:10.1.0.9")));
        assert!(Cidr::parse("0.0.0.0/0").unwrap().contains(ip("8.8.8.8")));
        assert!(!Cidr::parse("0.0.0.0/0").unwrap().contains(ip("::2")));
        let one = Cidr::parse("192.0.2.7").unwrap();
        assert!(one.contains(ip("192.0.2.7")) && !one.contains(ip("192.0.2.8")));
        let v6 = Cidr::parse("fd00::/8").unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        assert!(Cidr::parse("::/0").unwrap().contains(ip("2001:db8::1")));
        let [lo4, lo6] = Cidr::loopback();
        assert!(lo4.contains(ip("127.0.0.5")) && lo6.contains(ip("::1")));
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("fd00::/129").is_err());
        assert!(Cidr::parse("example.com/8").is_err());
        assert!(Cidr::parse("10.0.0.0/x").is_err());
    }
}
