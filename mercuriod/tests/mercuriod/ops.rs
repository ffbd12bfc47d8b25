//! mercuriod's operations as a process: logging (level at runtime and on SIGHUP, connection
//! messages, file, syslog), the admin socket, systemd notifications, graceful shutdown.
#![cfg(unix)]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use mercurio_testkit::{config_text, mercuriod_bin, wait_until, Daemon, Mqtt, DEADLINE};

/// Started, not yet waited for: each test waits for what it checks first.
fn start(extra: &str) -> Daemon {
    Daemon::with(extra).spawn()
}

fn ok(answer: &serde_json::Value) -> &serde_json::Value {
    assert_eq!(answer["ok"], true, "{answer}");
    &answer["result"]
}

#[test]
fn log_level_changes_at_runtime_and_on_sighup() {
    let mut d = start("[logging]\nlevel = \"info\"\n");
    d.wait_listening();
    // At info, an admin request logs no debug line; the marker is the info line of the
    // level change, which comes after it.
    ok(&d.admin(r#"{"command":"broker.status"}"#));
    let answer = d.admin(r#"{"command":"broker.log-level","level":"debug"}"#);
    assert_eq!(ok(&answer)["level"], "debug");
    d.wait_line("level set", |l| l.contains("log level set to \"debug\""));
    assert!(d.seen(|l| l.contains("DEBUG")).is_empty(), "{:#?}", d.log());

    // Now the next request is logged at debug.
    ok(&d.admin(r#"{"command":"client.list"}"#));
    d.wait_line("debug request", |l| {
        l.contains("DEBUG") && l.contains("ClientList")
    });

    // Per-module directives, with the project's module paths.
    let answer = d.admin(r#"{"command":"broker.log-level","level":"warn,mercuriod=info"}"#);
    assert_eq!(ok(&answer)["level"], "warn,mercuriod=info");

    // An invalid level is refused and changes nothing.
    let answer = d.admin(r#"{"command":"broker.log-level","level":"loud"}"#);
    assert_eq!(answer["ok"], false);
    assert!(
        answer["error"].as_str().unwrap().contains("loud"),
        "{answer}"
    );
    let status = d.admin(r#"{"command":"broker.status"}"#);
    assert_eq!(ok(&status)["log_level"], "warn,mercuriod=info");

    // SIGHUP rereads the file's level.
    std::fs::write(
        &d.config,
        config_text(&d.socket, "[logging]\nlevel = \"debug\"\n"),
    )
    .expect("rewrite config");
    d.signal(libc::SIGHUP);
    d.wait_line("reload report", |l| {
        l.contains("SIGHUP: log level: debug (was warn,mercuriod=info)")
    });
    // The report comes before the switch: wait until the status shows it done.
    wait_until("level applied", || {
        d.admin(r#"{"command":"broker.status"}"#)["result"]["log_level"] == "debug"
    });
    let _ = d.admin(r#"{"command":"client.show","client_id":"x"}"#);
    d.wait_line("debug after SIGHUP", |l| {
        l.contains("DEBUG") && l.contains("ClientShow")
    });

    // A file that no longer loads changes nothing.
    std::fs::write(&d.config, "[server]\nmax_qos = 7\n").expect("rewrite config");
    d.signal(libc::SIGHUP);
    d.wait_line("reload error", |l| {
        l.contains("SIGHUP") && l.contains("keeping the running configuration")
    });
    let status = d.admin(r#"{"command":"broker.status"}"#);
    assert_eq!(ok(&status)["log_level"], "debug");

    d.signal(libc::SIGTERM);
    assert_eq!(d.wait_exit(), Some(0));
}

#[test]
fn invalid_level_in_the_file_means_info_with_a_warning() {
    let mut d = start("[logging]\nlevel = \"chatty\"\n");
    d.wait_line("warning", |l| {
        l.contains("WARN") && l.contains("chatty") && l.contains("logging at info")
    });
    d.wait_listening();
    let status = d.admin(r#"{"command":"broker.status"}"#);
    assert_eq!(ok(&status)["log_level"], "info");
}

#[test]
fn connection_messages_off_and_back_on() {
    let mut d = start("[logging]\nconnection_messages = false\n");
    let port = d.wait_listening();
    let connected = |id: &'static str| {
        move |l: &str| l.contains("client connected") && l.contains(&format!("client_id={id}"))
    };

    // Connect and disconnect. The connected line would be logged before the broker reads
    // DISCONNECT, so before the session is gone.
    Mqtt::connect(port, 5, "quiet", true).disconnect();
    wait_until("session gone", || {
        d.admin(r#"{"command":"client.list"}"#)["result"]["clients"]
            .as_array()
            .is_some_and(|c| c.is_empty())
    });
    // A level naming the target turns them back on.
    let level = r#"{"command":"broker.log-level","level":"info,mercurio::connections=info"}"#;
    ok(&d.admin(level));
    d.wait_line("level set", |l| l.contains("log level set to"));
    Mqtt::connect(port, 5, "again", true).disconnect();
    d.wait_line("client connected", connected("again"));
    d.wait_line("client disconnected", |l| {
        l.contains("client disconnected") && l.contains("again")
    });
    assert!(d.seen(connected("quiet")).is_empty(), "{:#?}", d.log());
}

#[test]
fn connection_messages_on_by_default() {
    let mut d = start("");
    let port = d.wait_listening();
    let _client = Mqtt::connect(port, 4, "loud", true);
    d.wait_line("client connected", |l| {
        l.contains("mercurio::connections") && l.contains("client connected") && l.contains("loud")
    });
}

#[test]
fn log_file_appends_and_survives_copytruncate() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("mercuriod.log");
    std::fs::write(&file, "earlier line\n").expect("write");
    let mut d = start(&format!(
        "[logging]\nfile = {:?}\n",
        file.display().to_string()
    ));
    let read = || std::fs::read_to_string(&file).unwrap_or_default();
    wait_until("listening in the file", || read().contains("listening on"));
    assert!(read().starts_with("earlier line\n"), "{}", read());
    // Nothing on standard output: the file replaces it.
    wait_until("admin socket", || d.socket.exists());
    assert!(d.seen(|l| l.contains("listening")).is_empty());

    // logrotate's copytruncate: the next line goes to the start of the emptied file.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .expect("open")
        .set_len(0)
        .expect("truncate");
    ok(&d.admin(r#"{"command":"broker.log-level","level":"info"}"#));
    wait_until("a line after truncation", || {
        read().contains("log level set")
    });
    let text = read();
    assert!(!text.starts_with('\0'), "holes after truncation: {text:?}");
    assert!(!text.contains("earlier line"), "{text}");
}

#[test]
fn log_file_that_cannot_be_opened_is_a_config_error() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("missing-dir").join("m.log");
    let mut d = start(&format!(
        "[logging]\nfile = {:?}\n",
        file.display().to_string()
    ));
    let line = d.wait_line("error", |l| l.contains("cannot open"));
    assert!(line.contains("logging.file"), "{line}");
    assert_eq!(d.wait_exit(), Some(78));
}

#[test]
fn syslog_lines_reach_the_socket() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("log.sock");
    let syslog = UnixDatagram::bind(&path).expect("bind");
    syslog.set_read_timeout(Some(DEADLINE)).expect("timeout");
    // An empty level: info, and a warning (severity 4).
    let d = Daemon::with("[logging]\nsyslog = true\nlevel = \"\"\n")
        .env("MERCURIO_SYSLOG_SOCKET", &path)
        .spawn();
    let pid = d.pid();
    let mut got = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    while !got
        .iter()
        .any(|l: &String| l.contains("listening on 127.0.0.1:"))
    {
        assert!(Instant::now() < deadline, "{got:#?}");
        let mut buf = [0u8; 9000];
        let n =
            mercurio_testkit::uninterrupted(|| syslog.recv(&mut buf)).expect("a syslog datagram");
        got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    let warning = got
        .iter()
        .find(|l| l.contains("logging at info"))
        .unwrap_or_else(|| panic!("{got:#?}"));
    assert!(
        warning.starts_with(&format!("<28>mercuriod[{pid}]: ")),
        "{warning}"
    );
    let listening = got.iter().find(|l| l.contains("listening on")).unwrap();
    assert!(
        listening.starts_with(&format!("<30>mercuriod[{pid}]: ")),
        "{listening}"
    );
    assert!(!listening.ends_with('\n'));
}

#[test]
fn shutdown_sends_0x8b_and_exits_0() {
    let mut d = start("");
    let port = d.wait_listening();
    let mut v5 = Mqtt::connect(port, 5, "five", true);
    let mut v311 = Mqtt::connect(port, 4, "three", true);
    let sent = Instant::now();
    d.signal(libc::SIGTERM);
    let (kind, body) = v5.read().expect("DISCONNECT");
    assert_eq!(kind, 0xe0, "DISCONNECT expected");
    assert_eq!(body[0], 0x8b, "Server shutting down");
    assert!(
        v311.read().is_none(),
        "3.1.1 client closed without a packet"
    );
    assert_eq!(d.wait_exit(), Some(0));
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "{:?}",
        sent.elapsed()
    );
    d.wait_line("stopped", |l| l.contains("stopped"));
    assert!(!d.socket.exists(), "admin socket removed at exit");
}

#[test]
fn ctrl_c_stops_with_0_even_with_a_client_that_ignores_disconnect() {
    let mut d = start("");
    let port = d.wait_listening();
    // A client that never reads: the broker still closes it and exits.
    let _client = Mqtt::connect(port, 5, "deaf", true);
    d.signal(libc::SIGINT);
    assert_eq!(d.wait_exit(), Some(0));
}

#[test]
fn admin_socket_is_0600_and_answers_bad_requests() {
    let mut d = start("");
    d.wait_listening();
    let mode = std::fs::metadata(&d.socket)
        .expect("socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");

    for bad in [
        "not json",
        "{}",
        r#"{"command":"nope"}"#,
        r#"{"command":"client.show"}"#,
        r#"{"command":"broker.status","extra":1}"#,
        "[1,2]",
    ] {
        let answer = d.admin(bad);
        assert_eq!(answer["ok"], false, "{bad}: {answer}");
        assert!(answer["error"].is_string(), "{answer}");
    }
    // A very long line gets an error and the connection is closed; the broker goes on.
    {
        use std::io::{BufRead, BufReader, Write};
        let stream = std::os::unix::net::UnixStream::connect(&d.socket).expect("connect");
        stream.set_read_timeout(Some(DEADLINE)).expect("timeout");
        let long = vec![b'x'; 70 * 1024];
        let _ = (&stream).write_all(&long);
        let mut line = String::new();
        BufReader::new(&stream)
            .read_line(&mut line)
            .expect("answer");
        assert!(line.contains("longer than"), "{line}");
    }
    let status = d.admin(r#"{"command":"broker.status"}"#);
    let status = ok(&status);
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(status["storage"]["backend"], "memory");
    assert!(d.is_running());
}

#[test]
fn admin_socket_path_refused() {
    // A path that is a plain file.
    let dir = tempfile::tempdir().expect("dir");
    let socket = dir.path().join("plain");
    std::fs::write(&socket, "not a socket").expect("write");
    let text = config_text(&socket, "");
    let mut d = Daemon::with_config(&text)
        .in_dir(dir)
        .socket(&socket)
        .spawn();
    d.wait_line("refusal", |l| l.contains("not a socket"));
    assert_eq!(d.wait_exit(), Some(1));
    assert_eq!(
        std::fs::read_to_string(&socket).expect("left alone"),
        "not a socket"
    );
}

/// A second broker on the same host, started with the first one's configuration file, gets
/// its own admin socket from --admin-socket instead of finding the first one's taken.
#[test]
fn admin_socket_option_overrides_the_configuration() {
    let mut first = start("");
    first.wait_listening();
    let text = config_text(&first.socket, "");
    let dir = tempfile::tempdir().expect("dir");
    let own = dir.path().join("second.sock");
    let mut second = Daemon::with_config(&text)
        .arg("--admin-socket")
        .arg(&own)
        .socket(&own)
        .in_dir(dir)
        .spawn();
    second.wait_listening();
    ok(&second.admin(r#"{"command":"broker.status"}"#));
    ok(&first.admin(r#"{"command":"broker.status"}"#));
}

#[test]
fn second_broker_on_the_same_socket_is_refused_and_stale_socket_replaced() {
    let mut first = start("");
    first.wait_listening();
    let text = config_text(&first.socket, "");
    let dir = tempfile::tempdir().expect("dir");
    let mut second = Daemon::with_config(&text)
        .in_dir(dir)
        .socket(&first.socket)
        .spawn();
    second.wait_line("refusal", |l| l.contains("another mercuriod answers"));
    assert_eq!(second.wait_exit(), Some(1));
    // The first one still answers.
    ok(&first.admin(r#"{"command":"broker.status"}"#));

    // A stale socket (nobody listening) is replaced.
    first.signal(libc::SIGKILL);
    first.wait_exit();
    let _ = std::os::unix::net::UnixListener::bind(&first.socket); // may already exist
    assert!(first.socket.exists());
    let dir = tempfile::tempdir().expect("dir");
    let mut third = Daemon::with_config(&text)
        .in_dir(dir)
        .socket(&first.socket)
        .spawn();
    third.wait_listening();
    ok(&third.admin(r#"{"command":"broker.status"}"#));
}

#[test]
fn systemd_readiness_and_stopping() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&path).expect("bind");
    notify.set_read_timeout(Some(DEADLINE)).expect("timeout");
    // systemd sets WATCHDOG_PID to the service's pid: a wrapper that execs keeps its own.
    let wrapper = dir.path().join("under-systemd");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nWATCHDOG_PID=$$ exec {} \"$@\"\n",
            mercuriod_bin().display()
        ),
    )
    .expect("write wrapper");
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut d = Daemon::with("")
        .exe(&wrapper)
        .env("NOTIFY_SOCKET", &path)
        .env("WATCHDOG_USEC", "200000")
        .spawn();
    let recv = || {
        let mut buf = [0u8; 1024];
        let n = mercurio_testkit::uninterrupted(|| notify.recv(&mut buf)).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let ready = recv();
    assert!(ready.contains("READY=1"), "{ready}");
    // The listeners and the admin socket are up once READY=1 is sent.
    assert!(d.socket.exists());
    // Watchdog pings every 100 ms.
    let mut seen = recv();
    while !seen.contains("WATCHDOG=1") {
        seen = recv();
    }
    d.signal(libc::SIGTERM);
    while !seen.contains("STOPPING=1") {
        seen = recv();
    }
    assert_eq!(d.wait_exit(), Some(0));
}

#[test]
fn under_systemd_stdout_lines_carry_their_severity() {
    let mut d = Daemon::with("[logging]\nlevel = \"bogus\"\n")
        .env("JOURNAL_STREAM", "8:12345")
        .spawn();
    let warning = d.wait_line("warning", |l| l.contains("logging at info"));
    assert!(warning.starts_with("<4>"), "{warning}");
    let listening = d.wait_line("listening", |l| l.contains("listening on"));
    // No timestamp: the journal adds its own.
    assert!(listening.starts_with("<6> INFO mercuriod:"), "{listening}");
}

/// `broker status` names the storage backend and its state, from the storage writer's
/// counters ("ok" while storage takes writes, nothing waits to be written again and no
/// session was set aside), with the bytes waiting for storage and the failed writes.
#[test]
fn status_reports_the_storage_state() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("m.db");
    let mut d = start(&format!(
        "[storage]\nbackend = \"sqlite\"\npath = {:?}\n",
        db.display().to_string()
    ));
    d.wait_listening();
    let status = d.admin(r#"{"command":"broker.status"}"#);
    let storage = &ok(&status)["storage"];
    assert_eq!(
        (
            &storage["backend"],
            &storage["state"],
            &storage["writes_failed"]
        ),
        (
            &serde_json::json!("sqlite"),
            &serde_json::json!("ok"),
            &serde_json::json!(0)
        )
    );
    assert!(storage["pending_bytes"].is_u64(), "{storage}");
}
