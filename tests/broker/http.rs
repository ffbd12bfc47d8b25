//! The HTTP side of WebSocket listeners (docs/operations.md, "Health and metrics"): `/healthz`, `/metrics`
//! parsed by a real Prometheus text parser and checked against `$SYS`, static files from
//! `http_dir` (traversal attempts refused), and every HTTP limit.
use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::*;
use mercurio::codec::{ProtocolVersion, QoS};
use mercurio::config::Config;
use mercurio::{Broker, HttpLimits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// An MQTT listener (first) and a WebSocket listener (second) with these HTTP settings.
fn config(health: bool, metrics: bool, http_dir: Option<&Path>) -> Config {
    let mut c = tcp_and_websocket_config();
    c.listeners[1].health = health;
    c.listeners[1].metrics = metrics;
    c.listeners[1].http_dir = http_dir.map(Path::to_path_buf);
    c
}

async fn start_http(config: Config) -> (mercurio::BrokerHandle, SocketAddr, SocketAddr) {
    let (handle, tcp) = start_with(config).await;
    let http = handle.local_addrs()[1];
    (handle, tcp, http)
}

#[tokio::test]
async fn healthz_ok_then_503_while_stopping_then_refused() {
    let (handle, _tcp, http) = start_http(config(true, false, None)).await;
    let r = http_get(http, "/healthz").await;
    assert_eq!((r.status, r.text().as_str()), (200, "ok\n"));
    let r = http_raw(
        http,
        b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);

    // A request whose head is still arriving when the broker starts stopping gets 503.
    let mut pending = TcpStream::connect(http).await.unwrap();
    pending
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let stopper = {
        let handle = handle.clone();
        tokio::spawn(async move { handle.shutdown().await })
    };
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while TcpStream::connect(http).await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the listener still accepts"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    pending.write_all(b"\r\n").await.unwrap();
    let r = read_http_response(&mut pending, false)
        .await
        .expect("a response");
    assert_eq!(r.status, 503, "{r:?}");
    expect_eof(&mut pending, DEADLINE).await;
    tokio::time::timeout(Duration::from_secs(10), stopper)
        .await
        .unwrap()
        .unwrap();
    assert!(
        TcpStream::connect(http).await.is_err(),
        "refused once stopped"
    );
}

/// Parses an exposition with prometheus_client's parser for the format named by argv[1]
/// (`text`: the Prometheus text format 0.0.4; `openmetrics`: the strict OpenMetrics parser)
/// and prints `TYPE family type` and `sample{labels} value` lines.
const PARSE_SCRIPT: &str = r#"
import sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics
from prometheus_client.parser import text_string_to_metric_families as prometheus_text

text = sys.stdin.read()
parse = openmetrics if sys.argv[1] == "openmetrics" else prometheus_text
for family in parse(text):
    print("TYPE", family.name, family.type)
    for s in family.samples:
        labels = ",".join('%s="%s"' % kv for kv in sorted(s.labels.items()))
        print("SAMPLE", s.name + ("{" + labels + "}" if labels else ""), repr(s.value))
"#;

/// What Prometheus sends: OpenMetrics preferred, the text format accepted.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// Samples (`name` or `name{cause="..."}`) and family types of a parsed exposition.
struct Parsed {
    samples: HashMap<String, f64>,
    types: HashMap<String, String>,
}

/// `GET /metrics`, with `Accept: accept` when given; the exposition parsed in the format its
/// content type announces.
async fn scrape_with(python: &str, http: SocketAddr, accept: Option<&str>) -> (Parsed, String) {
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    let req =
        format!("GET /metrics HTTP/1.1\r\nHost: localhost\r\n{accept}Connection: close\r\n\r\n");
    let r = http_raw(http, req.as_bytes()).await.expect("a response");
    assert_eq!(r.status, 200);
    let ct = r.header("content-type").unwrap_or_default().to_string();
    let format = if ct == "application/openmetrics-text; version=1.0.0; charset=utf-8" {
        "openmetrics"
    } else {
        assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8");
        "text"
    };
    let text = r.text();
    let out = run_python(python, PARSE_SCRIPT, &[format.to_string()], text.as_bytes()).await;
    let mut parsed = Parsed {
        samples: HashMap::new(),
        types: HashMap::new(),
    };
    for line in out.lines() {
        let mut f = line.split(' ');
        match f.next() {
            Some("TYPE") => {
                let name = f.next().unwrap().to_string();
                parsed.types.insert(name, f.next().unwrap().to_string());
            }
            Some("SAMPLE") => {
                let name = f.next().unwrap().to_string();
                parsed
                    .samples
                    .insert(name, f.next().unwrap().parse().unwrap());
            }
            _ => panic!("unexpected line {line}"),
        }
    }
    (parsed, text)
}

async fn scrape(python: &str, http: SocketAddr) -> (Parsed, String) {
    scrape_with(python, http, None).await
}

const CAUSES: [&str; 7] = [
    "queue_full_qos0",
    "queue_full",
    "expired",
    "too_large",
    "not_authorized",
    "no_share_member",
    "memory_full",
];

/// (metric sample name, its type, the `$SYS/broker/` topic it equals).
fn metric_table() -> Vec<(String, &'static str, String)> {
    let mut t: Vec<(String, &str, String)> = [
        ("mercurio_clients_connected", "gauge", "clients/connected"),
        ("mercurio_clients_connected_max", "gauge", "clients/maximum"),
        ("mercurio_sessions", "gauge", "clients/total"),
        (
            "mercurio_sessions_disconnected",
            "gauge",
            "clients/disconnected",
        ),
        (
            "mercurio_sessions_expired_total",
            "counter",
            "clients/expired",
        ),
        (
            "mercurio_messages_received_total",
            "counter",
            "messages/received",
        ),
        ("mercurio_messages_sent_total", "counter", "messages/sent"),
        ("mercurio_bytes_received_total", "counter", "bytes/received"),
        ("mercurio_bytes_sent_total", "counter", "bytes/sent"),
        (
            "mercurio_retained_messages",
            "gauge",
            "retained messages/count",
        ),
        (
            "mercurio_retained_bytes",
            "gauge",
            "retained messages/bytes",
        ),
        (
            "mercurio_retained_not_kept_total{limit=\"max_retained_messages\"}",
            "counter",
            "retained messages/not kept/max_retained_messages",
        ),
        (
            "mercurio_retained_not_kept_total{limit=\"max_retained_bytes\"}",
            "counter",
            "retained messages/not kept/max_retained_bytes",
        ),
        ("mercurio_subscriptions", "gauge", "subscriptions/count"),
        ("mercurio_queued_bytes", "gauge", "queued messages/bytes"),
        (
            "mercurio_storage_batches_retried_total",
            "counter",
            "storage/batches/retried",
        ),
        (
            "mercurio_storage_batches_dropped_total",
            "counter",
            "storage/batches/dropped",
        ),
        (
            "mercurio_storage_dirty_clients",
            "gauge",
            "storage/clients/dirty",
        ),
        (
            "mercurio_connections_delayed_total",
            "counter",
            "connections/delayed",
        ),
        (
            "mercurio_clients_rate_limited_total",
            "counter",
            "clients/rate_limited",
        ),
        (
            "mercurio_clients_rate_limited_milliseconds_total",
            "counter",
            "clients/rate_limited_ms",
        ),
    ]
    .into_iter()
    .map(|(m, ty, s)| (m.to_string(), ty, s.to_string()))
    .collect();
    for cause in CAUSES {
        t.push((
            format!("mercurio_messages_dropped_total{{cause=\"{cause}\"}}"),
            "counter",
            format!("publish/messages/dropped/{cause}"),
        ));
    }
    t
}

/// The family name a parser gives a sample (OpenMetrics counters drop `_total`).
fn family_of(sample: &str) -> &str {
    let name = sample.split('{').next().unwrap();
    name.strip_suffix("_total").unwrap_or(name)
}

#[tokio::test]
async fn metrics_equal_sys_after_known_traffic() {
    let Some(python) = python_with(
        "metrics_equal_sys_after_known_traffic",
        &["prometheus_client"],
    ) else {
        return;
    };
    let mut c = config(false, true, None);
    c.server.sys_interval = 1;
    let (handle, tcp, http) = start_http(c).await;
    let mut sys = handle.subscribe("$SYS/broker/#", QoS::AtMostOnce).unwrap();

    // Known traffic: an offline persistent session (its queue keeps what it misses), a
    // subscriber, a 5.0 subscriber with a small Maximum Packet Size (one message too large for
    // it is dropped), three messages of which one is retained.
    let mut offline = Client::connect_with(tcp, {
        let mut p = connect_packet(ProtocolVersion::V311, "metrics-offline");
        p.clean_start = false;
        p
    })
    .await
    .0;
    offline.subscribe("m/#", QoS::AtLeastOnce).await;
    offline.disconnect().await;
    let mut sub = Client::connect(tcp, ProtocolVersion::V5, "metrics-sub").await;
    sub.subscribe("m/#", QoS::AtLeastOnce).await;
    let mut small = Client::connect_with(tcp, {
        let mut p = connect_packet(ProtocolVersion::V5, "metrics-small");
        p.properties.maximum_packet_size = Some(64);
        p
    })
    .await
    .0;
    small.subscribe("m/#", QoS::AtMostOnce).await;
    let mut publ = Client::connect(tcp, ProtocolVersion::V311, "metrics-pub").await;
    for (i, payload) in [&b"payload"[..], b"payload", &[b'x'; 200]]
        .iter()
        .enumerate()
    {
        publ.publish(&format!("m/{i}"), payload, QoS::AtLeastOnce, i == 0)
            .await;
        let p = sub.expect_publish().await;
        sub.ack(&p).await;
        if payload.len() < 64 {
            small.expect_publish().await;
        }
    }
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while handle
        .sessions()
        .iter()
        .any(|s| s.connected && s.client_id == "metrics-offline")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "offline still connected"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // $SYS is published every second; /metrics is read now. Once quiescent they agree.
    let mut sys_values: HashMap<String, String> = HashMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let (parsed, text) = loop {
        let (parsed, text) = scrape(python, http).await;
        let mismatches: Vec<String> = metric_table()
            .iter()
            .filter(|(metric, _, topic)| {
                sys_values.get(topic).map(|v| v.parse::<f64>().unwrap())
                    != parsed.samples.get(metric).copied()
            })
            .map(|(metric, _, topic)| {
                format!(
                    "{metric}={:?} vs {topic}={:?}",
                    parsed.samples.get(metric),
                    sys_values.get(topic)
                )
            })
            .collect();
        if mismatches.is_empty() {
            break (parsed, text);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/metrics and $SYS disagree: {mismatches:?}"
        );
        // Take the $SYS updates of the next tick.
        let mut wait = Duration::from_millis(1500);
        while let Ok(Some(m)) = tokio::time::timeout(wait, sys.recv()).await {
            let name = m.topic.strip_prefix("$SYS/broker/").unwrap().to_string();
            sys_values.insert(name, String::from_utf8_lossy(&m.payload).into_owned());
            wait = Duration::from_millis(100);
        }
    };

    // Every metric of docs/http.md's table, with its type.
    for (metric, ty, _) in metric_table() {
        assert_eq!(
            parsed.types.get(family_of(&metric)).map(String::as_str),
            Some(ty),
            "type of {metric}"
        );
    }
    for (metric, ty) in [
        ("mercurio_connections_total", "counter"),
        ("mercurio_uptime_seconds", "gauge"),
    ] {
        assert_eq!(
            parsed.types.get(family_of(metric)).map(String::as_str),
            Some(ty),
            "type of {metric}"
        );
    }
    let s = &parsed.samples;
    // The known traffic.
    assert_eq!(s["mercurio_messages_received_total"], 3.0);
    assert_eq!(s["mercurio_messages_sent_total"], 5.0);
    assert_eq!(s["mercurio_retained_messages"], 1.0);
    // "m/0" and "payload": topic and payload, no properties in 3.1.1.
    assert_eq!(s["mercurio_retained_bytes"], 10.0);
    assert_eq!(s["mercurio_clients_connected"], 3.0);
    assert_eq!(s["mercurio_clients_connected_max"], 3.0);
    assert_eq!(s["mercurio_sessions"], 4.0);
    assert_eq!(s["mercurio_sessions_disconnected"], 1.0);
    assert_eq!(s["mercurio_connections_total"], 4.0);
    assert_eq!(
        s[r#"mercurio_messages_dropped_total{cause="too_large"}"#],
        1.0
    );
    let dropped_sum: f64 = CAUSES
        .iter()
        .map(|c| s[&format!("mercurio_messages_dropped_total{{cause=\"{c}\"}}")])
        .sum();
    assert_eq!(
        dropped_sum.to_string(),
        sys_values["publish/messages/dropped"],
        "the causes add up to publish/messages/dropped"
    );
    let sys_uptime: f64 = sys_values["uptime"]
        .trim_end_matches(" seconds")
        .parse()
        .unwrap();
    assert!((s["mercurio_uptime_seconds"] - sys_uptime).abs() <= 2.0);
    // Metrics name no clients and no topics.
    for secret in ["metrics-sub", "metrics-pub", "metrics-offline", "m/0"] {
        assert!(!text.contains(secret), "{secret} in /metrics");
    }
    handle.shutdown().await;
}

/// `/metrics` answers the Prometheus text format 0.0.4 by default (a counter's `# HELP` and
/// `# TYPE` name it with `_total`, as the manual's sample shows; no `# EOF`), and OpenMetrics
/// when the request's Accept prefers it, as Prometheus's does. Both parse with
/// prometheus_client and carry the same families.
#[tokio::test]
async fn metrics_format_follows_the_accept_header() {
    let Some(python) = python_with(
        "metrics_format_follows_the_accept_header",
        &["prometheus_client"],
    ) else {
        return;
    };
    let (handle, _tcp, http) = start_http(config(false, true, None)).await;

    for accept in [None, Some("text/plain;version=0.0.4"), Some("*/*")] {
        let r = {
            let a = accept
                .map(|a| format!("Accept: {a}\r\n"))
                .unwrap_or_default();
            let req = format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{a}Connection: close\r\n\r\n");
            http_raw(http, req.as_bytes()).await.expect("a response")
        };
        assert_eq!(
            r.header("content-type"),
            Some("text/plain; version=0.0.4; charset=utf-8"),
            "{accept:?}"
        );
        let text = r.text();
        let lines: Vec<&str> = text.lines().collect();
        for line in [
            "# HELP mercurio_messages_received_total PUBLISH packets received",
            "# TYPE mercurio_messages_received_total counter",
            "# TYPE mercurio_messages_dropped_total counter",
            "# TYPE mercurio_clients_connected gauge",
        ] {
            assert!(lines.contains(&line), "{line} missing from\n{text}");
        }
        assert!(!text.contains("# EOF"), "{text}");
    }
    let (text_parsed, _) = scrape(python, http).await;
    let (om_parsed, om) = scrape_with(python, http, Some(PROMETHEUS_ACCEPT)).await;
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(
        om.contains("# TYPE mercurio_messages_received counter\n"),
        "{om}"
    );
    let (om_only, _) = scrape_with(python, http, Some("application/openmetrics-text")).await;
    assert_eq!(text_parsed.types, om_parsed.types);
    assert_eq!(om_only.types, om_parsed.types);
    let mut names: Vec<_> = text_parsed.samples.keys().collect();
    let mut om_names: Vec<_> = om_parsed.samples.keys().collect();
    names.sort();
    om_names.sort();
    assert_eq!(names, om_names);
    assert!(names.len() >= 22, "{names:?}");
    handle.shutdown().await;
}

#[tokio::test]
async fn endpoints_are_off_by_default_and_independent() {
    // Neither health nor metrics nor http_dir: everything is 404, the upgrade still works.
    let (handle, _tcp, http) = start_http(config(false, false, None)).await;
    for path in ["/healthz", "/metrics", "/", "/index.html"] {
        assert_eq!(http_get(http, path).await.status, 404, "{path}");
    }
    handle.shutdown().await;

    let (handle, _tcp, http) = start_http(config(true, false, None)).await;
    assert_eq!(http_get(http, "/healthz").await.status, 200);
    assert_eq!(http_get(http, "/metrics").await.status, 404);
    handle.shutdown().await;

    let (handle, _tcp, http) = start_http(config(false, true, None)).await;
    assert_eq!(http_get(http, "/healthz").await.status, 404);
    let r = http_get(http, "/metrics").await;
    assert_eq!(r.status, 200);
    assert!(
        r.text().contains("mercurio_clients_connected 0"),
        "{}",
        r.text()
    );
    handle.shutdown().await;
}

/// `http_dir` with a few files, next to a secret outside it.
fn site() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("www");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(root.path().join("secret.txt"), "TOP SECRET").unwrap();
    std::fs::write(dir.join("index.html"), "<h1>mercurio</h1>").unwrap();
    std::fs::write(dir.join("app.js"), "console.log(1)").unwrap();
    std::fs::write(dir.join("style.css"), "h1{}").unwrap();
    std::fs::write(dir.join("logo.png"), [0x89, b'P', b'N', b'G']).unwrap();
    std::fs::write(dir.join("a b.txt"), "spaced").unwrap();
    std::fs::write(dir.join(".env"), "TOP SECRET").unwrap();
    std::fs::write(dir.join("sub/index.html"), "<p>sub</p>").unwrap();
    std::fs::write(dir.join("sub/data.json"), "{}").unwrap();
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(root.path().join("secret.txt"), dir.join("escape")).unwrap();
        std::os::unix::fs::symlink(root.path(), dir.join("up")).unwrap();
        std::os::unix::fs::symlink(dir.join("app.js"), dir.join("inner")).unwrap();
    }
    root
}

#[tokio::test]
async fn static_files_from_http_dir() {
    let root = site();
    let dir = root.path().join("www");
    let (handle, tcp, http) = start_http(config(false, false, Some(&dir))).await;
    let mut bystander = Client::connect(tcp, ProtocolVersion::V5, "bystander").await;

    for (path, ct, body) in [
        ("/", "text/html; charset=utf-8", "<h1>mercurio</h1>"),
        (
            "/index.html",
            "text/html; charset=utf-8",
            "<h1>mercurio</h1>",
        ),
        (
            "/app.js?v=3",
            "text/javascript; charset=utf-8",
            "console.log(1)",
        ),
        ("/style.css", "text/css; charset=utf-8", "h1{}"),
        ("/a%20b.txt", "text/plain; charset=utf-8", "spaced"),
        ("/sub/", "text/html; charset=utf-8", "<p>sub</p>"),
        ("/sub", "text/html; charset=utf-8", "<p>sub</p>"),
        ("/sub/data.json", "application/json", "{}"),
        // A link inside the directory is followed; the type is the target's.
        ("/inner", "text/javascript; charset=utf-8", "console.log(1)"),
    ] {
        let r = http_get(http, path).await;
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.header("content-type"), Some(ct), "{path}");
        assert_eq!(r.text(), body, "{path}");
    }
    let r = http_get(http, "/logo.png").await;
    assert_eq!(r.header("content-type"), Some("image/png"));
    assert_eq!(r.body, [0x89, b'P', b'N', b'G']);

    // HEAD: the headers of GET, no body.
    let mut s = TcpStream::connect(http).await.unwrap();
    s.write_all(b"HEAD /app.js HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let all = expect_eof(&mut s, DEADLINE).await;
    let all = String::from_utf8(all).unwrap();
    assert!(all.starts_with("HTTP/1.1 200"), "{all}");
    assert!(
        all.to_ascii_lowercase().contains("content-length: 14\r\n"),
        "{all}"
    );
    assert!(all.ends_with("\r\n\r\n"), "no body after HEAD: {all:?}");

    // Unknown paths and other methods.
    assert_eq!(http_get(http, "/missing.html").await.status, 404);
    assert_eq!(http_get(http, "/sub/missing/").await.status, 404);
    for method in ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"] {
        let req = format!(
            "{method} / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let r = http_raw(http, req.as_bytes()).await.expect("a response");
        assert_eq!(r.status, 405, "{method}");
        assert_eq!(r.header("allow"), Some("GET, HEAD"), "{method}");
    }

    // Traversal attempts: raw request targets, as curl --path-as-is would send them.
    for path in [
        "/../secret.txt",
        "/sub/../../secret.txt",
        "/%2e%2e/secret.txt",
        "/%2E%2E%2Fsecret.txt",
        "/..%2fsecret.txt",
        "/sub/%2e%2e%2f%2e%2e%2fsecret.txt",
        "/..%5csecret.txt",
        "/%252e%252e/secret.txt",
        "/%c0%ae%c0%ae/secret.txt",
        "/escape",
        "/up/secret.txt",
        "/.env",
        "/%2eenv",
        "/sub/./../.env",
        "/%00",
        "/%zz",
    ] {
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        // None: hyper refused the request target itself.
        if let Some(r) = http_raw(http, req.as_bytes()).await {
            assert!((400..500).contains(&r.status), "{path}: {}", r.status);
            assert!(!r.text().contains("TOP SECRET"), "{path} leaked");
        }
    }
    bystander
        .publish("still/here", b"1", QoS::AtLeastOnce, false)
        .await;
    handle.shutdown().await;
}

#[tokio::test]
async fn http_dir_must_be_a_directory() {
    let root = site();
    let c = config(false, false, Some(&root.path().join("missing")));
    match Broker::builder(c).start().await {
        Err(e) => assert!(e.to_string().contains("http_dir"), "{e}"),
        Ok(_) => panic!("started with a missing http_dir"),
    }
}

#[tokio::test]
async fn request_head_over_8_kib_gets_431() {
    let (handle, tcp, http) = start_http(config(true, false, None)).await;
    let mut bystander = Client::connect(tcp, ProtocolVersion::V311, "bystander").await;
    let big = "a".repeat(9 * 1024);
    let req = format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n");
    let mut s = TcpStream::connect(http).await.unwrap();
    let _ = s.write_all(req.as_bytes()).await;
    let seen = expect_eof(&mut s, DEADLINE).await;
    let seen = String::from_utf8_lossy(&seen);
    assert!(
        seen.is_empty() || seen.starts_with("HTTP/1.1 431"),
        "{seen}"
    );
    // Just under the limit is fine.
    let ok = "a".repeat(7 * 1024);
    let req =
        format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Ok: {ok}\r\nConnection: close\r\n\r\n");
    assert_eq!(http_raw(http, req.as_bytes()).await.unwrap().status, 200);
    bystander.publish("t", b"x", QoS::AtLeastOnce, false).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn slow_request_head_is_closed_after_connect_timeout() {
    let mut c = config(true, false, None);
    c.server.connect_timeout = 1;
    let (handle, tcp, http) = start_http(c).await;
    let mut bystander = Client::connect(tcp, ProtocolVersion::V311, "bystander").await;
    let mut s = TcpStream::connect(http).await.unwrap();
    let started = tokio::time::Instant::now();
    s.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
    // One header line every 200 ms: the head never completes within the second.
    let mut closed = false;
    for i in 0..20 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if s.write_all(format!("X-Slow-{i}: 1\r\n").as_bytes())
            .await
            .is_err()
        {
            closed = true;
            break;
        }
        let mut b = [0u8; 512];
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(1), s.read(&mut b)).await {
            let n = r.unwrap_or(0);
            let got = String::from_utf8_lossy(&b[..n]);
            assert!(n == 0 || got.starts_with("HTTP/1.1 408"), "{got}");
            closed = true;
            break;
        }
    }
    assert!(closed, "slow head still open after 4 s");
    assert!(started.elapsed() >= Duration::from_millis(900));
    bystander.publish("t", b"x", QoS::AtLeastOnce, false).await;
    handle.shutdown().await;
}

/// A connection that requests `path` and reads only the first bytes of the response, with a
/// small receive buffer so that the response stays in progress.
async fn stalled_get(http: SocketAddr, path: &str) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut s = sock.connect(http).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut first = [0u8; 12];
    tokio::time::timeout(DEADLINE, s.read_exact(&mut first))
        .await
        .expect("response started")
        .unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    s
}

fn big_site() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("big.bin"), vec![7u8; 16 << 20]).unwrap();
    root
}

#[tokio::test]
async fn at_most_32_responses_at_once() {
    let root = big_site();
    let (handle, tcp, http) = start_http(config(true, false, Some(root.path()))).await;
    let mut stalled = Vec::new();
    for _ in 0..32 {
        stalled.push(stalled_get(http, "/big.bin").await);
    }
    let r = http_get(http, "/healthz").await;
    assert_eq!(r.status, 503, "the 33rd response at once");
    // MQTT is not affected, nor is a WebSocket upgrade.
    let mut c = Client::connect(tcp, ProtocolVersion::V5, "bystander").await;
    c.publish("t", b"x", QoS::AtLeastOnce, false).await;
    // One slow reader goes away: its permit comes back.
    drop(stalled.pop());
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if http_get(http, "/healthz").await.status == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no permit back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(stalled);
    handle.shutdown().await;
}

#[tokio::test]
async fn a_response_that_takes_too_long_is_cut() {
    let root = big_site();
    let handle = Broker::builder(config(true, false, Some(root.path())))
        .http_limits(HttpLimits {
            max_responses: 1,
            response_timeout: Duration::from_secs(1),
            ..HttpLimits::default()
        })
        .start()
        .await
        .unwrap();
    let http = handle.local_addrs()[1];
    let mut s = stalled_get(http, "/big.bin").await;
    let started = tokio::time::Instant::now();
    assert_eq!(http_get(http, "/healthz").await.status, 503, "one at once");
    // The stalled response is cut after a second, which gives its permit back.
    let deadline = started + DEADLINE;
    loop {
        if http_get(http, "/healthz").await.status == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not cut");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(started.elapsed() >= Duration::from_millis(900));
    // What the kernel had buffered still arrives, then the end: never the whole file.
    let mut total = 0usize;
    let mut chunk = vec![0u8; 1 << 16];
    loop {
        match tokio::time::timeout(DEADLINE, s.read(&mut chunk)).await {
            Err(_) => panic!("still open after the response timeout"),
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => total += n,
        }
    }
    assert!(total < 16 << 20, "the whole file came through");
    handle.shutdown().await;
}

/// `/livez` and `/readyz` for orchestrators (docs/http.md): both 200 while the broker serves;
/// while storage takes no writes `/readyz` answers 503 with the reason and `/livez` stays 200
/// (a database outage must not get the broker restarted), and `/readyz` is 200 again once
/// storage recovers. Once stopping, `/readyz` is 503 `stopping`.
#[tokio::test]
async fn livez_and_readyz_follow_the_process_and_storage() {
    use mercurio::storage::{ErrorKind, MemoryStorage};
    let storage = MemoryStorage::new();
    let broker = Broker::builder(config(true, false, None))
        .storage(std::sync::Arc::new(storage.clone()))
        .start()
        .await
        .expect("broker starts");
    let tcp = broker.local_addrs()[0];
    let http = broker.local_addrs()[1];
    for path in ["/livez", "/readyz"] {
        let r = http_get(http, path).await;
        assert_eq!((r.status, r.text().as_str()), (200, "ok\n"), "{path}");
    }
    storage.fail_always(ErrorKind::Transient);
    // A persistent session's CONNECT is a change to store: it fails, and keeps failing.
    let (_c, _) = connect_persistent(tcp, ProtocolVersion::V5, "stored").await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut ready = http_get(http, "/readyz").await;
    while ready.status != 503 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz still {} while storage fails",
            ready.status
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        ready = http_get(http, "/readyz").await;
    }
    assert!(
        ready.text().starts_with("storage unwritable for ")
            && ready.text().contains("injected failure"),
        "{}",
        ready.text()
    );
    let live = http_get(http, "/livez").await;
    assert_eq!((live.status, live.text().as_str()), (200, "ok\n"));
    storage.stop_failing();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while http_get(http, "/readyz").await.status != 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz not 200 after storage recovered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A request whose head is still arriving when the broker starts stopping: /readyz 503.
    let mut pending = TcpStream::connect(http).await.unwrap();
    pending
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let stopper = {
        let broker = broker.clone();
        tokio::spawn(async move { broker.shutdown().await })
    };
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while TcpStream::connect(http).await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the listener still accepts"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    pending.write_all(b"\r\n").await.unwrap();
    let r = read_http_response(&mut pending, false)
        .await
        .expect("a response");
    assert_eq!((r.status, r.text().as_str()), (503, "stopping\n"));
    stopper.await.unwrap();
}
