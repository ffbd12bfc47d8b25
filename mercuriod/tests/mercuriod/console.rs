//! The web console (docs/console.md) in a real browser: headless chromium driven by selenium
//! (tests/python/console_browser.py) against a running mercuriod. Screenshots go to
//! `<target>/tmp/console-screenshots/`.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mercurio_testkit::http;
use mercurio_testkit::{prerequisite, Mqtt, Proc};

use crate::admin_api::daemon;

/// chromium, chromedriver and python3 with selenium 4.
fn browser(test: &str) -> bool {
    let check = (|| {
        for program in ["chromium", "chromedriver"] {
            let out = Command::new(program)
                .arg("--version")
                .output()
                .map_err(|e| {
                    format!("cannot run {program} (Debian: chromium chromium-driver): {e}")
                })?;
            if !out.status.success() {
                return Err(format!("{program} --version failed"));
            }
        }
        let out = Command::new("python3")
            .args(["-c", "import selenium"])
            .output()
            .map_err(|e| format!("cannot run python3: {e}"))?;
        if !out.status.success() {
            return Err("python3 cannot import selenium (pip install 'selenium>=4,<5')".into());
        }
        Ok(())
    })();
    prerequisite(test, check)
}

#[test]
fn the_console_serves_its_files_only_when_configured() {
    let Some((_d, _mqtt, api)) = daemon("console files", "console = true", "") else {
        return;
    };
    let page = http::get(api, "/console/");
    assert_eq!(page.status, 200, "{page:?}");
    assert!(page.body.contains("<title>Mercurio console</title>"));
    assert!(page
        .header("content-security-policy")
        .is_some_and(|v| v.contains("default-src 'self'")));
    for (path, kind) in [
        ("/console/app.js", "text/javascript"),
        ("/console/style.css", "text/css"),
    ] {
        let r = http::get(api, path);
        assert_eq!(r.status, 200, "{path}");
        assert!(
            r.header("content-type")
                .is_some_and(|v| v.starts_with(kind)),
            "{path}: {r:?}"
        );
    }
    assert_eq!(
        http::get(api, "/console").header("location"),
        Some("/console/")
    );
    assert_eq!(http::get(api, "/console/nothing.js").status, 404);

    // admin_api alone: no console.
    let Some((_d, _mqtt, api)) = daemon("console files", "", "") else {
        return;
    };
    assert_eq!(http::get(api, "/console/").status, 404);
}

#[test]
fn the_console_in_a_browser_logs_in_lists_disconnects_and_graphs() {
    if !browser("console in a browser") {
        return;
    }
    let bridge = "[[bridges]]\nname = \"cloud\"\naddresses = [\"127.0.0.1:9\"]\n\
                  [[bridges.topics]]\npattern = \"q/#\"\ndirection = \"out\"\n";
    // alice's ACL on the console's listener (the message viewer's MQTT connection).
    let acl_dir = tempfile::tempdir().expect("temp dir");
    let acl = acl_dir.path().join("acl");
    std::fs::write(&acl, "user alice\ntopic read load/#\n").expect("acl file");
    let listener = format!("console = true\nacl_file = {:?}", acl.display().to_string());
    let Some((_d, mqtt, api)) = daemon("console in a browser", &listener, bridge) else {
        return;
    };
    let victim_id = "victim-in-the-table";
    let mut victim = Mqtt::connect(mqtt.port(), 5, victim_id, true);
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    let _ = std::fs::remove_dir_all(&shots);
    eprintln!("console screenshots: {}", shots.display());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/console_browser.py");
    let mut browser = Proc::spawn_merged(
        "console_browser.py",
        Command::new("python3")
            .arg(script)
            .arg(format!("http://{api}"))
            .arg(&shots)
            .arg(victim_id),
    );
    let step = |b: &mut Proc, name: &str| {
        b.wait_for(name, |l| l.starts_with(name) || l.starts_with("FAIL"));
        let last = b.seen.last().cloned().unwrap_or_default();
        assert!(!last.starts_with("FAIL"), "{last}\n{:#?}", b.seen);
        last
    };
    step(&mut browser, "REFUSED");
    step(&mut browser, "LOGGED_IN");
    step(&mut browser, "CLIENT_LISTED");
    step(&mut browser, "DISCONNECTED");
    // [MQTT-3.14.2-1] The server's DISCONNECT carries the reason: 0x98 Administrative action.
    let (kind, body) = victim.read().expect("DISCONNECT before the close");
    assert_eq!(kind, 0xe0, "DISCONNECT expected, got {kind:#x} {body:?}");
    assert_eq!(body.first(), Some(&0x98), "reason code: {body:?}");

    step(&mut browser, "PUBLISH_NOW");
    let running = Arc::new(AtomicBool::new(true));
    let publisher = {
        let running = Arc::clone(&running);
        let port = mqtt.port();
        std::thread::spawn(move || {
            let mut p = Mqtt::connect(port, 4, "console-load", true);
            let load = mercurio_testkit::publish_packet("load/x", 0, 0, b"tick");
            let secret = mercurio_testkit::publish_packet("secret/x", 0, 0, b"hidden");
            while running.load(Ordering::Relaxed) {
                p.send(&load);
                p.send(&secret);
                // A steady rate, not a synchronisation: the graph needs messages over time.
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            p.disconnect();
        })
    };
    let moved = step(&mut browser, "GRAPH_MOVED");
    step(&mut browser, "VIEWER_SAW");
    running.store(false, Ordering::Relaxed);
    publisher.join().expect("publisher");
    step(&mut browser, "DONE");
    let (status, rest) = browser.finish();
    assert!(status.success(), "{status}: {:#?} {rest:#?}", browser.seen);
    eprintln!("{moved}; screenshots in {}", shots.display());
    for name in [
        "01-login-refused.png",
        "02-clients.png",
        "04-overview-under-load.png",
        "05-messages.png",
    ] {
        assert!(shots.join(name).is_file(), "{name} missing");
    }
}
