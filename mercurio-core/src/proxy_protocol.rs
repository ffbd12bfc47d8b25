//! The PROXY protocol (HAProxy's, versions 1 and 2) on a listener with `proxy_protocol`: a
//! load balancer in front of the broker sends, before anything else on the connection, a
//! header with its client's address, which then stands for the connection's peer address
//! everywhere (logs, events, authentication hooks' `ConnectInfo::peer`).
//!
//! The header is read from the TCP socket before TLS, HTTP or MQTT, within the connection's
//! `connect_timeout`, and only from peers in `proxy_from` (default loopback): from any other
//! peer a `v1`/`v2` listener closes the connection (one warning per listener every
//! [`WARN_EVERY`], with the count of those not logged), and an `optional` listener serves it
//! without reading a header (a header it sends anyway is then not MQTT and closes the
//! connection). A header is at most [`MAX_HEADER`] bytes (version 1's are at most 107; a
//! longer version 2 header is refused); it is peeked at, and only its own bytes are consumed,
//! so what follows it (a TLS ClientHello, CONNECT) is read by the next layer as usual.
//!
//! Version 2's `PP2_TYPE_SSL` TLV (TLS terminated at the balancer) gives the verified client
//! certificate's common name (`PP2_SUBTYPE_SSL_CN`) when the balancer says the client sent a
//! certificate and it was verified; a listener with `use_identity_as_username` then takes it
//! as the user name, as for a certificate the broker verifies itself.
//!
//! Our own parser (no crate): the two formats are small and fully specified, and the reader
//! is bounded and tested against malformed input.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::config::{Cidr, ListenerConfig, ProxyProtocol};

/// The longest header read: version 1 headers are at most 107 bytes; version 2 allows
/// 16 + 65,535, of which a balancer sends at most a few hundred (addresses and TLVs).
pub(crate) const MAX_HEADER: usize = 4096;

/// At most one warning per listener this often about refused headers.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(10);

/// Version 2's 12-byte signature.
const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// Version 1's start.
const V1_PREFIX: &[u8] = b"PROXY ";
/// Version 1's longest line, CRLF included.
const V1_MAX: usize = 107;

/// What a header says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Header {
    /// The balancer's client (`None`: LOCAL, UNKNOWN or an address family other than TCP over
    /// IPv4/IPv6: the connection's own peer address stands).
    pub source: Option<SocketAddr>,
    /// The common name of a client certificate the balancer verified (version 2,
    /// `PP2_SUBTYPE_SSL_CN` with `PP2_CLIENT_SSL`, `PP2_CLIENT_CERT_CONN` and `verify` 0).
    pub ssl_cn: Option<String>,
}

/// What the bytes so far are.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Parsed {
    /// A header of this many bytes.
    Header(usize, Header),
    /// Not a PROXY header (first bytes of something else).
    NotProxy,
    /// Could be a header: more bytes needed.
    Incomplete,
    /// A header, but a broken one.
    Invalid(String),
}

/// Parses the start of a connection (either version).
pub(crate) fn parse(buf: &[u8]) -> Parsed {
    let n = buf.len().min(V2_SIGNATURE.len());
    if buf[..n] == V2_SIGNATURE[..n] && n > 0 {
        return if n < V2_SIGNATURE.len() {
            Parsed::Incomplete
        } else {
            parse_v2(buf)
        };
    }
    let n = buf.len().min(V1_PREFIX.len());
    if buf[..n] == V1_PREFIX[..n] && n > 0 {
        return if n < V1_PREFIX.len() {
            Parsed::Incomplete
        } else {
            parse_v1(buf)
        };
    }
    if buf.is_empty() {
        Parsed::Incomplete
    } else {
        Parsed::NotProxy
    }
}

fn parse_v1(buf: &[u8]) -> Parsed {
    let window = &buf[..buf.len().min(V1_MAX)];
    let Some(end) = window.windows(2).position(|w| w == b"\r\n") else {
        return if buf.len() >= V1_MAX {
            Parsed::Invalid(format!("a version 1 header longer than {V1_MAX} bytes"))
        } else {
            Parsed::Incomplete
        };
    };
    let len = end + 2;
    let Ok(line) = std::str::from_utf8(&buf[V1_PREFIX.len()..end]) else {
        return Parsed::Invalid("a version 1 header that is not ASCII".into());
    };
    let parts: Vec<&str> = line.split(' ').collect();
    match parts.as_slice() {
        ["UNKNOWN", ..] => Parsed::Header(len, Header::default()),
        [family @ ("TCP4" | "TCP6"), src, _dst, sport, _dport] => {
            let ip: Option<IpAddr> = match *family {
                "TCP4" => src.parse::<Ipv4Addr>().ok().map(IpAddr::V4),
                _ => src.parse::<Ipv6Addr>().ok().map(IpAddr::V6),
            };
            let port = sport
                .parse::<u16>()
                .ok()
                .filter(|_| !sport.starts_with('0') || *sport == "0");
            match (ip, port) {
                (Some(ip), Some(port)) => Parsed::Header(
                    len,
                    Header {
                        source: Some(SocketAddr::new(ip, port)),
                        ssl_cn: None,
                    },
                ),
                _ => Parsed::Invalid(format!("a version 1 header with a bad address: {line:?}")),
            }
        }
        _ => Parsed::Invalid(format!("a version 1 header not understood: {line:?}")),
    }
}

fn parse_v2(buf: &[u8]) -> Parsed {
    if buf.len() < 16 {
        return Parsed::Incomplete;
    }
    let version = buf[12] >> 4;
    let command = buf[12] & 0x0f;
    if version != 2 {
        return Parsed::Invalid(format!("a version 2 signature with version {version}"));
    }
    let body = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    let len = 16 + body;
    if len > MAX_HEADER {
        return Parsed::Invalid(format!(
            "a version 2 header of {len} bytes (at most {MAX_HEADER} are read)"
        ));
    }
    if buf.len() < len {
        return Parsed::Incomplete;
    }
    let body = &buf[16..len];
    match command {
        // LOCAL: the balancer's own connection (a health check): its own address stands.
        0 => return Parsed::Header(len, Header::default()),
        1 => {}
        c => return Parsed::Invalid(format!("a version 2 header with command {c}")),
    }
    let (source, addresses) = match buf[13] {
        // TCP over IPv4.
        0x11 => {
            if body.len() < 12 {
                return Parsed::Invalid("a version 2 IPv4 header too short".into());
            }
            let ip = Ipv4Addr::new(body[0], body[1], body[2], body[3]);
            let port = u16::from_be_bytes([body[8], body[9]]);
            (Some(SocketAddr::new(IpAddr::V4(ip), port)), 12)
        }
        // TCP over IPv6.
        0x21 => {
            if body.len() < 36 {
                return Parsed::Invalid("a version 2 IPv6 header too short".into());
            }
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&body[..16]);
            let port = u16::from_be_bytes([body[32], body[33]]);
            (
                Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(octets)), port)),
                36,
            )
        }
        // UNSPEC, UDP, Unix sockets: nothing to use; the connection's address stands.
        0x00 => (None, 0),
        0x12 | 0x22 => (None, if buf[13] == 0x12 { 12 } else { 36 }),
        0x31 | 0x32 => (None, 216),
        f => return Parsed::Invalid(format!("a version 2 header with address family {f:#04x}")),
    };
    if body.len() < addresses {
        return Parsed::Invalid("a version 2 header too short for its addresses".into());
    }
    let ssl_cn = match ssl_cn(&body[addresses..]) {
        Ok(cn) => cn,
        Err(e) => return Parsed::Invalid(e),
    };
    Parsed::Header(len, Header { source, ssl_cn })
}

/// `PP2_TYPE_SSL`.
const PP2_TYPE_SSL: u8 = 0x20;
/// `PP2_SUBTYPE_SSL_CN`, inside `PP2_TYPE_SSL`.
const PP2_SUBTYPE_SSL_CN: u8 = 0x22;
/// `PP2_CLIENT_SSL` and `PP2_CLIENT_CERT_CONN`: TLS, with a client certificate on this
/// connection.
const PP2_CLIENT_SSL_CERT: u8 = 0x01 | 0x02;

/// The TLVs after the addresses: `(type, value)` pairs. Errors when one overruns.
fn tlvs(mut b: &[u8]) -> Result<Vec<(u8, &[u8])>, String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        if b.len() < 3 {
            return Err("a version 2 TLV cut short".into());
        }
        let len = usize::from(u16::from_be_bytes([b[1], b[2]]));
        if b.len() < 3 + len {
            return Err("a version 2 TLV longer than its header".into());
        }
        out.push((b[0], &b[3..3 + len]));
        b = &b[3 + len..];
    }
    Ok(out)
}

/// The verified client certificate's common name from the TLVs, if the balancer gives one.
fn ssl_cn(b: &[u8]) -> Result<Option<String>, String> {
    for (kind, value) in tlvs(b)? {
        if kind != PP2_TYPE_SSL {
            continue;
        }
        if value.len() < 5 {
            return Err("a PP2_TYPE_SSL TLV too short".into());
        }
        let client = value[0];
        let verify = u32::from_be_bytes([value[1], value[2], value[3], value[4]]);
        let verified = client & PP2_CLIENT_SSL_CERT == PP2_CLIENT_SSL_CERT && verify == 0;
        for (sub, v) in tlvs(&value[5..])? {
            if sub == PP2_SUBTYPE_SSL_CN && verified {
                return std::str::from_utf8(v)
                    .map(|s| Some(s.to_string()))
                    .map_err(|_| "a PP2_SUBTYPE_SSL_CN that is not UTF-8".into());
            }
        }
    }
    Ok(None)
}

/// Why a connection is not served.
#[derive(Debug)]
pub(crate) enum Refused {
    /// Closed, or no header before the deadline: nothing to log.
    Quiet,
    /// A header refused (or missing where one is required): worth a warning.
    Warn(String),
}

/// A listener's PROXY protocol settings and its warning limiter.
pub(crate) struct ProxyListener {
    /// `host:port` of the listener, for the warnings.
    name: String,
    mode: ProxyProtocol,
    from: Vec<Cidr>,
    /// When the last warning was logged (ms since `started`), and the ones not logged since.
    last_warn: AtomicU64,
    unlogged: AtomicU64,
    started: Instant,
}

impl ProxyListener {
    /// The settings of `cfg`; `None` without `proxy_protocol`. (`proxy_from` was checked by
    /// `Config::validate`; an entry that does not parse is skipped.)
    /// `local`: the address the listener is bound to, which names it in the warnings.
    pub(crate) fn new(cfg: &ListenerConfig, local: Option<SocketAddr>) -> Option<ProxyListener> {
        let mode = cfg.proxy_protocol?;
        let mut from: Vec<Cidr> = cfg
            .proxy_from
            .iter()
            .filter_map(|s| Cidr::parse(s).ok())
            .collect();
        if from.is_empty() {
            from.extend(Cidr::loopback());
        }
        Some(ProxyListener {
            name: match local {
                Some(a) => a.to_string(),
                None => format!("{}:{}", cfg.host, cfg.port),
            },
            mode,
            from,
            last_warn: AtomicU64::new(0),
            unlogged: AtomicU64::new(0),
            started: Instant::now(),
        })
    }

    /// Reads the header a connection from `peer` must (or may) start with, by `deadline`.
    /// `Ok` carries the header (`None`: none read, the connection's own address stands).
    pub(crate) async fn read(
        &self,
        stream: &mut TcpStream,
        peer: SocketAddr,
        deadline: Instant,
    ) -> Result<Option<Header>, Refused> {
        if !self.from.iter().any(|c| c.contains(peer.ip())) {
            return match self.mode {
                ProxyProtocol::Optional => Ok(None),
                _ => Err(Refused::Warn(format!(
                    "{peer} is not in proxy_from: closed (only the balancers listed there may send the PROXY header)"
                ))),
            };
        }
        match tokio::time::timeout_at(deadline, self.read_header(stream)).await {
            Ok(r) => r,
            Err(_) => Err(Refused::Warn(format!(
                "{peer} sent no PROXY header within connect_timeout: closed"
            ))),
        }
    }

    async fn read_header(&self, stream: &mut TcpStream) -> Result<Option<Header>, Refused> {
        let mut buf = vec![0u8; MAX_HEADER];
        loop {
            let n = stream.peek(&mut buf).await.map_err(|_| Refused::Quiet)?;
            if n == 0 {
                return Err(Refused::Quiet);
            }
            let parsed = parse(&buf[..n]);
            let parsed = match (self.mode, parsed) {
                (ProxyProtocol::V1, Parsed::Header(_, _)) if buf[0] != b'P' => Parsed::Invalid(
                    "a version 2 header on a proxy_protocol = \"v1\" listener".into(),
                ),
                (ProxyProtocol::V2, Parsed::Header(_, _)) if buf[0] == b'P' => Parsed::Invalid(
                    "a version 1 header on a proxy_protocol = \"v2\" listener".into(),
                ),
                (ProxyProtocol::V1 | ProxyProtocol::V2, Parsed::NotProxy) => {
                    Parsed::Invalid("no PROXY header where the listener requires one".into())
                }
                (_, p) => p,
            };
            match parsed {
                Parsed::Header(len, header) => {
                    let mut consumed = vec![0u8; len];
                    stream
                        .read_exact(&mut consumed)
                        .await
                        .map_err(|_| Refused::Quiet)?;
                    return Ok(Some(header));
                }
                Parsed::NotProxy => return Ok(None),
                Parsed::Invalid(why) => return Err(Refused::Warn(why)),
                Parsed::Incomplete => {
                    // Part of a header: the rest comes in another segment, rarely. Peeking
                    // again at once would return the same bytes, so wait a moment (the
                    // caller's deadline bounds it).
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
    }

    /// Logs `why` at warn, at most once per [`WARN_EVERY`] for this listener (with the count
    /// of those not logged since).
    pub(crate) fn warn(&self, why: &str) {
        let now = self.started.elapsed().as_millis() as u64 + 1;
        let last = self.last_warn.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < WARN_EVERY.as_millis() as u64 {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if self
            .last_warn
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let unlogged = self.unlogged.swap(0, Ordering::Relaxed);
        tracing::warn!(
            listener = %self.name,
            "PROXY protocol: {why} ({unlogged} more refused since the last warning)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v2(command: u8, family: u8, body: &[u8]) -> Vec<u8> {
        let mut b = V2_SIGNATURE.to_vec();
        b.push(0x20 | command);
        b.push(family);
        b.extend_from_slice(&(body.len() as u16).to_be_bytes());
        b.extend_from_slice(body);
        b
    }

    #[test]
    fn version_1() {
        let h = b"PROXY TCP4 192.0.2.5 127.0.0.1 40000 1883\r\n\x10\x0c";
        assert_eq!(
            parse(h),
            Parsed::Header(
                h.len() - 2,
                Header {
                    source: Some("192.0.2.5:40000".parse().unwrap()),
                    ssl_cn: None
                }
            )
        );
        let h = b"PROXY TCP6 2001:db8::7 ::1 5 1883\r\n";
        match parse(h) {
            Parsed::Header(n, hd) => {
                assert_eq!(n, h.len());
                assert_eq!(hd.source, Some("[2001:db8::7]:5".parse().unwrap()));
            }
            p => panic!("{p:?}"),
        }
        assert_eq!(
            parse(b"PROXY UNKNOWN\r\n"),
            Parsed::Header(15, Header::default())
        );
        for partial in [&b"P"[..], b"PROX", b"PROXY ", b"PROXY TCP4 1.2.3.4"] {
            assert_eq!(parse(partial), Parsed::Incomplete, "{partial:?}");
        }
        for bad in [
            &b"PROXY TCP4 1.2.3 4.5.6.7 1 2\r\n"[..],
            b"PROXY TCP4 ::1 ::1 1 2\r\n",
            b"PROXY TCP4 1.2.3.4 1.2.3.4 70000 2\r\n",
            b"PROXY TCP4 1.2.3.4 1.2.3.4 01 2\r\n",
            b"PROXY UDP4 1.2.3.4 1.2.3.4 1 2\r\n",
            b"PROXY TCP4 1.2.3.4  1.2.3.4 1 2\r\n",
        ] {
            assert!(matches!(parse(bad), Parsed::Invalid(_)), "{bad:?}");
        }
        // No CRLF within 107 bytes.
        let long = [b"PROXY TCP4 ".as_slice(), &[b'1'; 120]].concat();
        assert!(matches!(parse(&long), Parsed::Invalid(_)));
        // Not a header: MQTT, TLS, HTTP (POST shares the first letter).
        for other in [
            &b"\x10\x0c\x00\x04MQTT"[..],
            b"\x16\x03\x01",
            b"GET / HTTP/1.1",
            b"POST /",
        ] {
            assert_eq!(parse(other), Parsed::NotProxy, "{other:?}");
        }
    }

    #[test]
    fn version_2() {
        let mut body = vec![203, 0, 113, 9, 127, 0, 0, 1];
        body.extend_from_slice(&40001u16.to_be_bytes());
        body.extend_from_slice(&1883u16.to_be_bytes());
        let h = v2(1, 0x11, &body);
        assert_eq!(
            parse(&[h.as_slice(), b"\x10"].concat()),
            Parsed::Header(
                h.len(),
                Header {
                    source: Some("203.0.113.9:40001".parse().unwrap()),
                    ssl_cn: None
                }
            )
        );
        for cut in 1..h.len() {
            assert_eq!(parse(&h[..cut]), Parsed::Incomplete, "{cut}");
        }
        // LOCAL: no address.
        assert_eq!(parse(&v2(0, 0, &[])), Parsed::Header(16, Header::default()));
        // IPv6.
        let mut body6 = vec![0u8; 36];
        body6[0] = 0x20;
        body6[1] = 0x01;
        body6[15] = 9;
        body6[32..34].copy_from_slice(&7u16.to_be_bytes());
        match parse(&v2(1, 0x21, &body6)) {
            Parsed::Header(_, hd) => {
                assert_eq!(hd.source, Some("[2001::9]:7".parse().unwrap()))
            }
            p => panic!("{p:?}"),
        }
        // Too long, bad version, short addresses, a TLV overrunning.
        let mut big = v2(1, 0x11, &body);
        big[14..16].copy_from_slice(&5000u16.to_be_bytes());
        assert!(matches!(parse(&big), Parsed::Invalid(_)));
        let mut v3 = h.clone();
        v3[12] = 0x31;
        assert!(matches!(parse(&v3), Parsed::Invalid(_)));
        assert!(matches!(
            parse(&v2(1, 0x11, &body[..6])),
            Parsed::Invalid(_)
        ));
        let with_bad_tlv = [body.as_slice(), &[0x20, 0, 9, 1]].concat();
        assert!(matches!(
            parse(&v2(1, 0x11, &with_bad_tlv)),
            Parsed::Invalid(_)
        ));
    }

    #[test]
    fn ssl_common_name() {
        let mut body = vec![198, 51, 100, 1, 127, 0, 0, 1, 0, 1, 0, 2];
        let cn = b"device-7";
        let mut ssl = vec![0x07, 0, 0, 0, 0]; // SSL | CERT_CONN | CERT_SESS, verify 0
        ssl.extend_from_slice(&[0x21, 0, 7]);
        ssl.extend_from_slice(b"TLSv1.3");
        ssl.extend_from_slice(&[PP2_SUBTYPE_SSL_CN, 0, cn.len() as u8]);
        ssl.extend_from_slice(cn);
        body.extend_from_slice(&[0x04, 0, 2, 0, 0]); // an unrelated TLV (NOOP) first
        body.push(PP2_TYPE_SSL);
        body.extend_from_slice(&(ssl.len() as u16).to_be_bytes());
        body.extend_from_slice(&ssl);
        match parse(&v2(1, 0x11, &body)) {
            Parsed::Header(_, hd) => assert_eq!(hd.ssl_cn.as_deref(), Some("device-7")),
            p => panic!("{p:?}"),
        }
        // Not verified (verify != 0): no name.
        let at = body.len() - ssl.len();
        body[at + 4] = 1;
        match parse(&v2(1, 0x11, &body)) {
            Parsed::Header(_, hd) => assert_eq!(hd.ssl_cn, None),
            p => panic!("{p:?}"),
        }
    }

    /// Arbitrary bytes never panic and never claim more bytes than given.
    #[test]
    fn arbitrary_input() {
        use proptest::prelude::*;
        proptest!(|(tail in proptest::collection::vec(any::<u8>(), 0..300), v in 0u8..3)| {
            let head: &[u8] = match v {
                0 => &V2_SIGNATURE,
                1 => V1_PREFIX,
                _ => b"",
            };
            let buf = [head, tail.as_slice()].concat();
            if let Parsed::Header(n, _) = parse(&buf) {
                prop_assert!(n <= buf.len() && n <= MAX_HEADER);
            }
        });
    }
}
