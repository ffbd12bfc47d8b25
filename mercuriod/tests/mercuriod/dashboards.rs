//! packaging/grafana-dashboard.json and packaging/prometheus-alerts.yml against a running
//! broker: every metric they name is in its `/metrics`, and promtool accepts the rules.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use mercurio_testkit::{http, prerequisite, Daemon};

fn packaging(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../packaging")
        .join(name)
}

/// The `mercurio_*` names in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("mercurio_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

/// Every string under a key named `expr`, `query` or `definition` (panels, templating).
fn queries(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "query" | "definition", serde_json::Value::String(s)) => {
                        out.push(s.clone())
                    }
                    _ => queries(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

#[test]
fn the_dashboard_and_the_alerts_name_only_metrics_the_broker_serves() {
    // A bridge (to a closed port) so that the per-bridge series exist.
    let mut d = Daemon::start(
        "[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\nprotocol = \"websocket\"\nmetrics = true\n\n\
         [[bridges]]\nname = \"cloud\"\naddresses = [\"127.0.0.1:9\"]\n\
         [[bridges.topics]]\npattern = \"q/#\"\ndirection = \"out\"\n",
    );
    let http_addr = d.wait_listeners(2)[1];
    let exposition = http::get(http_addr, "/metrics");
    assert_eq!(exposition.status, 200, "{exposition:?}");
    let served: BTreeSet<String> = exposition
        .body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect();
    assert!(served.contains("mercurio_bridge_connected"), "{served:?}");

    let dashboard_text =
        std::fs::read_to_string(packaging("grafana-dashboard.json")).expect("the dashboard");
    let dashboard: serde_json::Value =
        serde_json::from_str(&dashboard_text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    queries(&dashboard, &mut exprs);
    let dashboard_names = metric_names(&exprs.join("\n"));
    let rules = std::fs::read_to_string(packaging("prometheus-alerts.yml")).expect("the rules");
    let rule_exprs: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr:"))
        .collect();
    assert!(rule_exprs.len() >= 5, "{rule_exprs:?}");
    let rule_names = metric_names(&rule_exprs.join("\n"));

    // What each must cover (task of the files: connections, rates, queues, drops, storage,
    // leadership, bridges).
    for name in [
        "mercurio_clients_connected",
        "mercurio_messages_received_total",
        "mercurio_messages_sent_total",
        "mercurio_messages_dropped_total",
        "mercurio_storage_pending_bytes",
        "mercurio_storage_unwritable",
        "mercurio_uptime_seconds",
        "mercurio_bridge_connected",
    ] {
        assert!(
            dashboard_names.contains(name),
            "the dashboard has no {name}"
        );
    }
    for name in [
        "mercurio_storage_unwritable",
        "mercurio_clients_stalled_total",
        "mercurio_messages_dropped_total",
        "mercurio_uptime_seconds",
        "mercurio_bridge_connected",
    ] {
        assert!(rule_names.contains(name), "the alerts have no {name}");
    }
    for (file, names) in [
        ("grafana-dashboard.json", &dashboard_names),
        ("prometheus-alerts.yml", &rule_names),
    ] {
        let unknown: Vec<&String> = names.difference(&served).collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics /metrics does not serve: {unknown:?}\nserved: {served:?}"
        );
    }

    let promtool = Command::new("promtool")
        .arg("--version")
        .output()
        .map(|_| ())
        .map_err(|e| format!("cannot run promtool (Debian: prometheus): {e}"));
    if prerequisite("promtool check rules", promtool) {
        let out = Command::new("promtool")
            .args(["check", "rules"])
            .arg(packaging("prometheus-alerts.yml"))
            .output()
            .expect("promtool");
        assert!(
            out.status.success(),
            "promtool check rules: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
