//! Slow-consumer memory benchmark (not a test): runs `mercuriod` (release) with
//! `max_queued_bytes` set, floods a subscriber that never reads its socket, and prints the
//! broker's resident memory (VmRSS, /proc/PID/status) every second. With the limit, the
//! stalled subscriber's queue stops at `max_queued_bytes` and RSS levels off instead of
//! growing with the flood. A second subscriber that reads everything shows the broker keeps
//! serving the others.
//!
//! Usually run through `benches/slow_consumer.sh`, which builds what it needs:
//!
//! ```sh
//! cargo run --release --example slow_consumer -- \
//!     --mercuriod target/release/mercuriod --seconds 30 --max-queued-bytes 8388608 --payload 16384
//! ```
//!
//! Linux only (it reads /proc).

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use mercurio::codec::{
    self, Connect, Packet, Properties, ProtocolVersion, Publish, QoS, Subscribe, SubscribeFilter,
    SubscriptionOptions,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

struct Args {
    mercuriod: String,
    seconds: u64,
    max_queued_bytes: u64,
    payload: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        mercuriod: "target/release/mercuriod".into(),
        seconds: 30,
        max_queued_bytes: 8 * 1024 * 1024,
        payload: 16 * 1024,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it
            .next()
            .unwrap_or_else(|| usage(&format!("{k} needs a value")));
        let num = |v: &str| {
            v.parse::<u64>()
                .unwrap_or_else(|_| usage(&format!("{k}: {v}")))
        };
        match k.as_str() {
            "--mercuriod" => a.mercuriod = v,
            "--seconds" => a.seconds = num(&v),
            "--max-queued-bytes" => a.max_queued_bytes = num(&v),
            "--payload" => a.payload = num(&v) as usize,
            _ => usage(&format!("unknown argument {k}")),
        }
    }
    a
}

fn usage(why: &str) -> ! {
    eprintln!("slow_consumer: {why}");
    eprintln!(
        "usage: slow_consumer [--mercuriod PATH] [--seconds N] [--max-queued-bytes N] [--payload N]"
    );
    std::process::exit(2);
}

fn encode(p: Packet) -> BytesMut {
    let mut out = BytesMut::new();
    codec::encode(&p, ProtocolVersion::V311, &mut out).expect("encode");
    out
}

fn connect(client_id: &str) -> BytesMut {
    encode(Packet::Connect(Box::new(Connect::new(
        ProtocolVersion::V311,
        client_id,
    ))))
}

fn subscribe(filter: &str) -> BytesMut {
    encode(Packet::Subscribe(Subscribe {
        packet_id: 1,
        filters: vec![SubscribeFilter {
            filter: filter.into(),
            options: SubscriptionOptions::default(),
        }],
        properties: Properties::default(),
    }))
}

/// Reads one packet (blocking until whole) from `s` into `buf`.
async fn read_packet(s: &mut TcpStream, buf: &mut BytesMut) -> Packet {
    loop {
        if let Some(p) = codec::decode(buf, ProtocolVersion::V311, u32::MAX).expect("decode") {
            return p;
        }
        if s.read_buf(buf).await.expect("read") == 0 {
            panic!("broker closed the connection");
        }
    }
}

/// Connects (and subscribes to `filter` if given) with a receive buffer of `rcvbuf` bytes.
async fn client(
    addr: SocketAddr,
    id: &str,
    filter: Option<&str>,
    rcvbuf: Option<u32>,
) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    if let Some(n) = rcvbuf {
        socket.set_recv_buffer_size(n).expect("SO_RCVBUF");
    }
    let mut s = socket.connect(addr).await.expect("connect");
    s.set_nodelay(true).ok();
    let mut buf = BytesMut::new();
    s.write_all(&connect(id)).await.unwrap();
    match read_packet(&mut s, &mut buf).await {
        Packet::ConnAck(a) if a.reason_code.0 == 0 => {}
        other => panic!("{id}: expected CONNACK 0, got {other:?}"),
    }
    if let Some(f) = filter {
        s.write_all(&subscribe(f)).await.unwrap();
        match read_packet(&mut s, &mut buf).await {
            Packet::SubAck(_) => {}
            other => panic!("{id}: expected SUBACK, got {other:?}"),
        }
    }
    s
}

fn vm_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

struct Broker(Child);

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let dir = tempfile::tempdir().expect("temp dir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let config = dir.path().join("mercuriod.toml");
    let mut f = std::fs::File::create(&config).unwrap();
    // Message counts high enough that max_queued_bytes is the limit that binds.
    writeln!(
        f,
        "[server]\nmax_queued_bytes = {}\nmax_queued_messages = 10000000\n\
         max_queued_qos0_messages = 10000000\n\n[auth]\nallow_anonymous = true\n\n\
         [logging]\nlevel = \"warn\"\nconnection_messages = false\n\n\
         [[listeners]]\nhost = \"127.0.0.1\"\nport = {port}",
        args.max_queued_bytes
    )
    .unwrap();
    drop(f);
    let log_path = dir.path().join("mercuriod.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let child = Command::new(&args.mercuriod)
        .arg("-c")
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| usage(&format!("cannot run {}: {e}", args.mercuriod)));
    let broker = Broker(child);
    let pid = broker.0.id();
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "mercuriod did not listen on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss_idle = vm_rss_kib(pid).unwrap_or(0);

    // The stalled subscriber: subscribes, then never reads (small receive buffer).
    let _stalled = client(addr, "stalled", Some("bench/#"), Some(4096)).await;
    // The fast subscriber reads and counts everything.
    let mut fast = client(addr, "fast", Some("bench/#"), None).await;
    let fast_bytes = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&fast_bytes);
    tokio::spawn(async move {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            match fast.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => counted.fetch_add(n as u64, Ordering::Relaxed),
            };
        }
    });
    // The publisher floods QoS 0 messages.
    let mut publisher = client(addr, "publisher", None, None).await;
    let stop = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicU64::new(0));
    let (stop2, published2) = (Arc::clone(&stop), Arc::clone(&published));
    let payload = Bytes::from(vec![b'm'; args.payload]);
    let flood = tokio::spawn(async move {
        let one = encode(Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: "bench/flood".into(),
            packet_id: 0,
            properties: Properties::default(),
            payload,
        }));
        // 64 messages per write.
        let batch: Vec<u8> = one.iter().copied().cycle().take(one.len() * 64).collect();
        while !stop2.load(Ordering::Relaxed) {
            if publisher.write_all(&batch).await.is_err() {
                break;
            }
            published2.fetch_add(64, Ordering::Relaxed);
        }
    });

    println!(
        "# mercuriod pid {pid}, max_queued_bytes = {}, payload {} B, {} s; idle VmRSS {} KiB",
        args.max_queued_bytes, args.payload, args.seconds, rss_idle
    );
    println!("# t_s  vmrss_kib  published_msgs  fast_received_mib");
    let start = Instant::now();
    let mut series = Vec::new();
    for t in 1..=args.seconds {
        let next = start + Duration::from_secs(t);
        tokio::time::sleep_until(next.into()).await;
        let rss = vm_rss_kib(pid).expect("mercuriod still running");
        series.push(rss);
        println!(
            "{t:5}  {rss:9}  {:14}  {:17.1}",
            published.load(Ordering::Relaxed),
            fast_bytes.load(Ordering::Relaxed) as f64 / (1024.0 * 1024.0)
        );
    }
    stop.store(true, Ordering::Relaxed);
    let _ = flood.await;
    let max = series.iter().copied().max().unwrap_or(0);
    let last10 = &series[series.len().saturating_sub(10)..];
    let tail_spread = last10.iter().max().unwrap_or(&0) - last10.iter().min().unwrap_or(&0);
    println!(
        "# VmRSS KiB: idle {rss_idle}, max {max}, final {}, spread over the last 10 s {tail_spread}",
        series.last().copied().unwrap_or(0)
    );
    println!(
        "# published {} messages ({:.0} MiB); fast subscriber received {:.0} MiB",
        published.load(Ordering::Relaxed),
        published.load(Ordering::Relaxed) as f64 * args.payload as f64 / (1024.0 * 1024.0),
        fast_bytes.load(Ordering::Relaxed) as f64 / (1024.0 * 1024.0)
    );
    drop(broker);
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let per_client = |id: &str| {
        log.lines()
            .filter(|l| l.contains("dropping") && l.contains(&format!("client_id={id} ")))
            .count()
    };
    println!(
        "# broker log: {} lines; queue-full warnings: stalled {}, fast {}",
        log.lines().count(),
        per_client("stalled"),
        per_client("fast")
    );
    for l in log
        .lines()
        .filter(|l| l.contains("client_id=stalled"))
        .take(2)
    {
        println!("#   {l}");
    }
}
