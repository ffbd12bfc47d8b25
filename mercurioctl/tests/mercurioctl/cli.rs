//! Every mercurioctl subcommand against a live mercuriod and against none.
//!
//! mercuriod runs through mercurio-testkit's `Daemon` (found next to mercurioctl in the target
//! directory, built first when missing, as with `cargo test -p mercurioctl`).
#![cfg(unix)]

use std::process::{Command, Output};

use mercurio_testkit::{wait_until, Daemon, Mqtt};
use serde_json::Value;

/// The mercurioctl binary under test.
const MERCURIOCTL: &str = env!("CARGO_BIN_EXE_mercurioctl");

fn ctl(args: &[&str]) -> Output {
    Command::new(MERCURIOCTL)
        .args(args)
        .env_remove("RUNTIME_DIRECTORY")
        .output()
        .expect("run mercurioctl")
}

/// Runs mercurioctl with `--socket` of `d`; returns (status, stdout, stderr).
fn run(d: &Daemon, args: &[&str]) -> (Option<i32>, String, String) {
    let mut all = vec!["--socket", d.socket.to_str().expect("utf-8")];
    all.extend_from_slice(args);
    let out = ctl(&all);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs with `--json`, expects success, parses standard output.
fn json(d: &Daemon, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let (code, out, err) = run(d, &all);
    assert_eq!(code, Some(0), "{args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"))
}

/// Expects a failure with `code` and one line on stderr containing `words`.
fn fails(d: &Daemon, args: &[&str], code: i32, words: &str) {
    let (got, out, err) = run(d, args);
    assert_eq!(got, Some(code), "{args:?}: {err}");
    assert!(out.is_empty(), "{out}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains(words), "{args:?}: {err}");
}

const EVERY_COMMAND: [&[&str]; 6] = [
    &["broker", "status"],
    &["broker", "log-level", "debug"],
    &["client", "list"],
    &["client", "show", "c1"],
    &["client", "disconnect", "c1"],
    &["client", "delete-session", "c1"],
];

#[test]
fn every_command_against_no_broker() {
    let dir = tempfile::tempdir().expect("dir");
    let missing = dir.path().join("mercuriod.sock");
    // A stale socket: the file is there, nobody listens.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let plain = dir.path().join("plain");
    std::fs::write(&plain, "").expect("write");
    for args in EVERY_COMMAND {
        for (socket, code, words) in [
            (&missing, 69, "mercuriod is not running"),
            (&stale, 69, "mercuriod is not running"),
            (&plain, 77, "is not a socket"),
        ] {
            let mut all = vec!["--socket", socket.to_str().expect("utf-8")];
            all.extend_from_slice(args);
            let out = ctl(&all);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(code), "{all:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{err}");
            assert!(err.contains(words), "{all:?}: {err}");
            assert!(out.stdout.is_empty());
        }
    }
}

/// A broker that does not serve yet (starting, or a standby waiting for the serving broker)
/// answers `unavailable`: mercurioctl prints its reason and exits 69, as for no broker.
#[test]
fn a_broker_not_serving_yet_is_unavailable() {
    use std::io::{BufRead, BufReader, Write};
    let dir = tempfile::tempdir().expect("dir");
    let socket = dir.path().join("m.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
    const WHY: &str =
        "mercuriod is a standby waiting for the serving broker: it does not serve yet";
    let server = std::thread::spawn(move || {
        for _ in EVERY_COMMAND {
            let (stream, _) = listener.accept().expect("accept");
            let mut request = String::new();
            BufReader::new(&stream)
                .read_line(&mut request)
                .expect("request");
            assert!(request.contains("\"command\""), "{request}");
            let answer = serde_json::json!({"ok": false, "error": WHY, "code": "unavailable"});
            (&stream)
                .write_all(format!("{answer}\n").as_bytes())
                .expect("answer");
        }
    });
    for args in EVERY_COMMAND {
        let mut all = vec!["--socket", socket.to_str().expect("utf-8")];
        all.extend_from_slice(args);
        let out = ctl(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(69), "{all:?}: {err}");
        assert_eq!(err.trim(), format!("mercurioctl: {WHY}"), "{all:?}");
        assert!(out.stdout.is_empty());
    }
    server.join().expect("the fake broker");
}

#[test]
fn usage_errors() {
    for args in [
        &["frobnicate"][..],
        &["broker"],
        &["broker", "stop"],
        &["client", "show"],
        &["client", "list", "--bogus"],
        &["--socket", "/a", "-c", "/b", "broker", "status"],
    ] {
        let out = ctl(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("Usage"));
    }
    let help = ctl(&["--help"]);
    assert_eq!(help.status.code(), Some(0));
    let help = String::from_utf8_lossy(&help.stdout);
    for words in ["broker", "client", "--socket", "--json", "Exit status"] {
        assert!(help.contains(words), "{words}: {help}");
    }
    // broker log-level --help lists the targets a directive may name.
    let help = ctl(&["broker", "log-level", "--help"]);
    assert_eq!(help.status.code(), Some(0));
    let help = String::from_utf8_lossy(&help.stdout);
    for target in [
        "mercurio::connections",
        "mercurio_core::session",
        "mercurio_core::connection",
        "mercurio_storage::sqlite",
        "mercuriod::admin",
    ] {
        assert!(help.lines().any(|l| l.trim() == target), "{target}: {help}");
    }
}

#[test]
fn config_file_names_the_socket() {
    let d = Daemon::start("");
    let config = d.config.to_str().expect("utf-8");
    let out = ctl(&["-c", config, "broker", "status"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = ctl(&["-c", "/nonexistent/mercuriod.toml", "broker", "status"]);
    assert_eq!(out.status.code(), Some(78), "{out:?}");
}

#[test]
fn every_command_against_a_live_broker() {
    let mut d = Daemon::start("");
    let port = d.port();

    // broker status
    let (code, out, err) = run(&d, &["broker", "status"]);
    assert_eq!(code, Some(0), "{err}");
    for words in [
        env!("CARGO_PKG_VERSION"),
        "uptime",
        "0 connected",
        "memory",
        "log level   info",
    ] {
        assert!(out.contains(words), "{words}: {out}");
    }
    // The socket asked: the default one is shared by every mercuriod of the same user.
    let asked = format!("socket      {}\n", d.socket.display());
    assert!(out.ends_with(&asked), "{out}");
    // `status`, the name people try first, is `broker status`.
    let (code, short, err) = run(&d, &["status"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        short.contains("0 connected") && short.ends_with(&asked),
        "{short}"
    );
    let status = json(&d, &["broker", "status"]);
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(status["sessions"], 0);
    assert_eq!(status["storage"]["backend"], "memory");

    // broker log-level
    let (code, out, _) = run(&d, &["broker", "log-level", "debug"]);
    assert_eq!(code, Some(0));
    assert_eq!(out, "log level: debug\n");
    d.wait_line("level set", |l| l.contains("log level set to \"debug\""));
    fails(&d, &["broker", "log-level", "verbose"], 1, "not a level");
    fails(&d, &["broker", "log-level", ""], 1, "empty");
    assert_eq!(json(&d, &["broker", "status"])["log_level"], "debug");
    // A module that does not exist (the old crate name): applied, with a warning naming it
    // and the real targets, here and in the broker's log.
    let (code, out, _) = run(
        &d,
        &[
            "broker",
            "log-level",
            "debug,mercurio_server::session=trace",
        ],
    );
    assert_eq!(code, Some(0));
    assert!(
        out.starts_with("log level: debug,mercurio_server::session=trace\nwarning: "),
        "{out}"
    );
    assert!(
        out.contains("no module of Mercurio: mercurio_server::session"),
        "{out}"
    );
    assert!(out.contains("mercurio_core::session"), "{out}");
    d.wait_line("unknown target warning", |l| {
        l.contains("WARN") && l.contains("mercurio_server::session")
    });
    let (code, out, _) = run(&d, &["broker", "log-level", "debug"]);
    assert_eq!((code, out.as_str()), (Some(0), "log level: debug\n"));

    // client list, empty
    let (code, out, _) = run(&d, &["client", "list"]);
    assert_eq!((code, out.as_str()), (Some(0), "no sessions\n"));

    // A 5.0 client connected, a 3.1.1 client with a kept session, disconnected.
    let mut five = Mqtt::connect(port, 5, "five", true);
    let mut kept = Mqtt::connect(port, 4, "kept", false);
    kept.subscribe(4, "sensors/+/temp", 1);
    kept.disconnect();
    wait_until("kept disconnected", || {
        json(&d, &["client", "list"])["clients"]
            .as_array()
            .expect("clients")
            .iter()
            .any(|c| c["client_id"] == "kept" && c["connected"] == false)
    });
    let (code, out, _) = run(&d, &["client", "list"]);
    assert_eq!(code, Some(0));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[0].starts_with("CLIENT ID"), "{out}");
    assert!(
        lines[1].starts_with("five ") && lines[1].contains("connected") && lines[1].contains("5.0"),
        "{out}"
    );
    assert!(
        lines[2].starts_with("kept ")
            && lines[2].contains("disconnected")
            && lines[2].contains("3.1.1"),
        "{out}"
    );

    // client show
    let (code, out, _) = run(&d, &["client", "show", "kept"]);
    assert_eq!(code, Some(0));
    for words in [
        "kept",
        "disconnected",
        "MQTT 3.1.1",
        "never",
        "sensors/+/temp (QoS 1)",
    ] {
        assert!(out.contains(words), "{words}: {out}");
    }
    let shown = json(&d, &["client", "show", "kept"]);
    assert_eq!(shown["subscriptions"][0]["filter"], "sensors/+/temp");
    assert_eq!(shown["subscriptions"][0]["qos"], 1);
    assert_eq!(shown["connected"], false);
    assert_eq!(
        shown["address"],
        Value::Null,
        "no address once disconnected"
    );
    // A connected client's address and port, as the socket shows them.
    let five_addr = five.0.local_addr().expect("local address").to_string();
    let (code, out, _) = run(&d, &["client", "show", "five"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains(&format!("address         {five_addr}\n")),
        "{out}"
    );
    assert_eq!(json(&d, &["client", "show", "five"])["address"], five_addr);
    fails(
        &d,
        &["client", "show", "nobody"],
        1,
        "no such client: nobody",
    );

    // client delete-session: refused while connected, done when not.
    fails(
        &d,
        &["client", "delete-session", "five"],
        1,
        "is connected: disconnect it first",
    );
    fails(
        &d,
        &["client", "delete-session", "nobody"],
        1,
        "no such client",
    );
    let (code, out, _) = run(&d, &["client", "delete-session", "kept"]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "deleted the session of kept\n")
    );
    fails(&d, &["client", "show", "kept"], 1, "no such client: kept");

    // client disconnect: the 5.0 client gets DISCONNECT 0x98 (Administrative action).
    let (code, out, _) = run(&d, &["client", "disconnect", "five"]);
    assert_eq!((code, out.as_str()), (Some(0), "disconnected five\n"));
    let (kind, body) = five.read().expect("DISCONNECT");
    assert_eq!((kind, body[0]), (0xe0, 0x98));
    fails(
        &d,
        &["client", "disconnect", "nobody"],
        1,
        "no such client: nobody",
    );
    wait_until("five gone", || {
        json(&d, &["client", "list"])["clients"]
            .as_array()
            .is_some_and(|c| c.is_empty())
    });

    // After the broker stops: not running.
    d.signal(libc::SIGTERM);
    assert_eq!(d.wait_exit(), Some(0));
    fails(&d, &["broker", "status"], 69, "mercuriod is not running");
}

#[test]
fn version() {
    let out = ctl(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("mercurioctl {}", env!("CARGO_PKG_VERSION"))
    );
}
#[test]
fn passwd_adds_and_changes_users() {
    use std::io::Write;
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("passwd");
    for (user, password) in [("alice", "one"), ("bob", "two"), ("alice", "three")] {
        let mut child = Command::new(MERCURIOCTL)
            .args(["passwd", "--stdin"])
            .arg(&file)
            .arg(user)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("run mercurioctl");
        writeln!(child.stdin.take().unwrap(), "{password}").unwrap();
        assert!(child.wait().unwrap().success());
    }
    let text = std::fs::read_to_string(&file).unwrap();
    assert_eq!(text.lines().count(), 2, "{text}");
    let users = mercurio_core::auth::password_file::PasswordFile::load(&file).unwrap();
    assert!(users.get("alice").unwrap().verify(b"three"));
    assert!(users.get("bob").unwrap().verify(b"two"));
    assert!(text.lines().all(|l| l.contains(":$argon2id$")), "{text}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    // An empty password is refused.
    let out = Command::new(MERCURIOCTL)
        .args(["passwd", "--stdin"])
        .arg(&file)
        .arg("carol")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("empty password"));
}

/// `auth derive USER` prints what python3's hmac module computes: lowercase hex of
/// HMAC-SHA256(key = the secret file without one trailing newline, message = USER), from
/// `--secret-file` or from the configuration given with `-c`, without a running broker.
#[test]
fn auth_derive_prints_the_hmac() {
    let python = if mercurio_testkit::have("python3") {
        Ok(())
    } else {
        Err("python3 (the independent HMAC) is not installed".to_string())
    };
    if !mercurio_testkit::prerequisite("auth_derive_prints_the_hmac", python) {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, b"s3cret \xff bytes\n").unwrap();
    let python = Command::new("python3")
        .args([
            "-c",
            "import hmac, hashlib, sys\n\
             k = open(sys.argv[1], 'rb').read()\n\
             k = k[:-1] if k.endswith(b'\\n') else k\n\
             print(hmac.new(k, sys.argv[2].encode(), hashlib.sha256).hexdigest())",
            secret.to_str().unwrap(),
            "tenant-42",
        ])
        .output()
        .expect("run python3");
    assert!(python.status.success(), "{python:?}");
    let expected = String::from_utf8(python.stdout).unwrap();
    assert_eq!(expected.trim().len(), 64, "{expected}");

    let out = ctl(&[
        "auth",
        "derive",
        "--secret-file",
        secret.to_str().unwrap(),
        "tenant-42",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);

    let config = dir.path().join("mercuriod.toml");
    std::fs::write(
        &config,
        format!(
            "[auth]\nderived_password_secret_file = {:?}\nderived_user_pattern = \"tenant-*\"\n",
            secret.to_str().unwrap()
        ),
    )
    .unwrap();
    let out = ctl(&[
        "-c",
        config.to_str().unwrap(),
        "auth",
        "derive",
        "tenant-42",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    assert!(out.stderr.is_empty(), "{out:?}");
    // A name the pattern does not match: printed, with a warning that the broker will not
    // derive it.
    let out = ctl(&["-c", config.to_str().unwrap(), "auth", "derive", "device-1"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not match derived_user_pattern"),
        "{out:?}"
    );
    // Neither --secret-file nor -c; a missing file.
    let out = ctl(&["auth", "derive", "tenant-42"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--secret-file"));
    let out = ctl(&[
        "auth",
        "derive",
        "--secret-file",
        "/nonexistent/secret",
        "x",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/secret"));
}

/// The temporary file passwd writes through is created with O_EXCL and O_NOFOLLOW: a symbolic
/// link planted at its name (by someone who can write the directory) is never followed, so
/// the file it points to is left alone and the password file stays a regular file.
#[cfg(unix)]
#[test]
fn passwd_never_writes_through_a_planted_symlink() {
    use std::io::Write;
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("passwd");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    std::os::unix::fs::symlink(&victim, dir.path().join("passwd.mercurio-tmp")).unwrap();
    let mut child = Command::new(MERCURIOCTL)
        .args(["passwd", "--stdin"])
        .arg(&file)
        .arg("alice")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("run mercurioctl");
    writeln!(child.stdin.take().unwrap(), "secret").unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    let meta = std::fs::symlink_metadata(&file).unwrap();
    assert!(meta.file_type().is_file(), "{meta:?}");
    let users = mercurio_core::auth::password_file::PasswordFile::load(&file).unwrap();
    assert!(users.get("alice").unwrap().verify(b"secret"));
}

#[test]
fn bridge_list_and_show() {
    // A bridge to a port nobody listens on: configured, not connected, its error shown.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let d = Daemon::start(&format!(
        "[[bridges]]\nname = \"cloud\"\naddresses = [\"{dead}\"]\nclient_id = \"site1\"\n\
         [[bridges.topics]]\npattern = \"sensors/#\"\nqos = 1\n"
    ));
    wait_until("the first attempt failed", || {
        json(&d, &["bridge", "show", "cloud"])["last_error"].is_string()
    });
    let (code, out, err) = run(&d, &["bridge", "list"]);
    assert_eq!(code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("NAME"), "{out}");
    assert!(lines[1].starts_with("cloud  disconnected"), "{out}");
    let (code, out, err) = run(&d, &["bridge", "show", "cloud"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("client id       site1"), "{out}");
    assert!(out.contains(&format!("last error      {dead}: ")), "{out}");
    fails(&d, &["bridge", "show", "nope"], 1, "no such bridge: nope");
}

#[test]
fn stream_list_and_show() {
    let d = Daemon::start(
        "[[streams]]\nname = \"tenant-a\"\nfilter = \"tenants/a/#\"\nmax_bytes = 1048576\n",
    );
    let mut publisher = Mqtt::connect(d.port(), 4, "pub", true);
    for id in 1..=3u16 {
        publisher.send(&mercurio_testkit::publish_packet(
            "tenants/a/x",
            1,
            id,
            b"hello",
        ));
        let (kind, _) = publisher.read().expect("PUBACK");
        assert_eq!(kind, 0x40);
    }
    // A 3.1.1 reader, from offset 2 (the `@` level of its filter).
    let mut reader = Mqtt::connect(d.port(), 4, "reader", true);
    reader.subscribe(4, "$stream/tenant-a/@2", 0);
    reader.read().expect("the message at offset 2");
    wait_until("the reader counted", || {
        json(&d, &["stream", "show", "tenant-a"])["readers"] == 1
    });
    let shown = json(&d, &["stream", "show", "tenant-a"]);
    assert_eq!(shown["messages"], 3);
    assert_eq!(shown["bytes"], 3 * (11 + 5));
    assert_eq!(
        (&shown["first_offset"], &shown["last_offset"]),
        (&1.into(), &3.into())
    );
    let (code, out, err) = run(&d, &["stream", "list"]);
    assert_eq!(code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("NAME"), "{out}");
    assert!(lines[1].starts_with("tenant-a"), "{out}");
    assert!(lines[1].ends_with("tenants/a/#"), "{out}");
    let (code, out, err) = run(&d, &["stream", "show", "tenant-a"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("max bytes       1048576 bytes"), "{out}");
    assert!(out.contains("max age         no limit"), "{out}");
    assert!(out.contains("last offset     3"), "{out}");
    fails(&d, &["stream", "show", "nope"], 1, "no such stream: nope");
}

#[test]
fn stream_create_and_delete_at_run_time() {
    let d = Daemon::start("[[streams]]\nname = \"file\"\nfilter = \"f/#\"\n");
    let created = json(
        &d,
        &[
            "stream",
            "create",
            "made",
            "m/#",
            "--max-age",
            "60",
            "--last-value",
        ],
    );
    assert_eq!(created["runtime"], true);
    assert_eq!(created["max_age"], 60);
    assert_eq!(created["last_value"], true);
    let mut publisher = Mqtt::connect(d.port(), 4, "pub", true);
    publisher.send(&mercurio_testkit::publish_packet("m/x", 1, 1, b"hello"));
    let (kind, _) = publisher.read().expect("PUBACK");
    assert_eq!(kind, 0x40);
    assert_eq!(json(&d, &["stream", "show", "made"])["messages"], 1);
    let (code, out, err) = run(&d, &["stream", "show", "made"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("defined         at run time"), "{out}");
    fails(
        &d,
        &["stream", "create", "made", "x/#"],
        1,
        "a stream named made exists",
    );
    fails(&d, &["stream", "create", "a/b", "x/#"], 1, "name: \"a/b\"");
    fails(
        &d,
        &["stream", "create", "bad", "x/#/y"],
        1,
        "filter: \"x/#/y\"",
    );
    fails(
        &d,
        &["stream", "delete", "file"],
        1,
        "in the configuration file",
    );
    // Without a byte limit: created, with the warning mercuriod gives for the file's.
    let (code, out, err) = run(&d, &["stream", "create", "open", "o/#"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("warning: no --max-bytes"), "{out}");
    let (code, out, err) = run(
        &d,
        &[
            "stream",
            "create",
            "capped",
            "c/#",
            "--max-bytes",
            "1048576",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("warning"), "{out}");
    let (code, out, err) = run(&d, &["stream", "delete", "made"]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "deleted the stream made\n"),
        "{err}"
    );
    fails(&d, &["stream", "delete", "made"], 1, "no such stream: made");
}

#[test]
fn cluster_status() {
    const TEST: &str = "cluster_status";
    // Cluster mode off: refused, exit 1, one line saying so.
    let off = Daemon::start("");
    fails(&off, &["cluster", "status"], 1, "cluster mode is off");
    // No broker: exit 69.
    let dir = tempfile::tempdir().expect("dir");
    let missing = dir.path().join("mercuriod.sock");
    let out = ctl(&[
        "--socket",
        missing.to_str().expect("utf-8"),
        "cluster",
        "status",
    ]);
    assert_eq!(out.status.code(), Some(69));
    assert!(String::from_utf8_lossy(&out.stderr).contains("mercuriod is not running"));

    let Some(nats) = mercurio_testkit::NatsServer::start(TEST) else {
        return;
    };
    let node = |name: &str| {
        let mut d = Daemon::start(&format!(
            "[cluster]\nnats_urls = [\"{}\"]\nnode_name = \"{name}\"\nheartbeat_interval = 1\njetstream_max_bytes = 67108864\n",
            nats.url()
        ));
        d.wait_listeners(1);
        d
    };
    let a = node("a");
    let b = node("b");
    let _client = Mqtt::connect(b.port(), 4, "on-b", true);
    wait_until("A sees B up with its client", || {
        let s = json(&a, &["cluster", "status"]);
        s["nodes"] == 2 && s["clients"] == 1
    });
    let s = json(&a, &["cluster", "status"]);
    assert_eq!(s["node"], "a");
    assert_eq!(s["state"], "connected");
    let members = s["members"].as_array().expect("members");
    assert_eq!(members.len(), 2, "{s}");
    assert_eq!(
        (&members[0]["node"], &members[0]["this"]),
        (&"a".into(), &true.into())
    );
    assert_eq!(
        (&members[1]["node"], &members[1]["state"]),
        (&"b".into(), &"up".into())
    );
    assert_eq!(members[1]["clients"], 1);
    assert_eq!(members[1]["version"], env!("CARGO_PKG_VERSION"));
    // Sessions as `broker status` counts them: A, with no client, has none (its own cluster
    // session is not one); B has its client's, as A hears from B's heartbeat.
    assert_eq!(members[0]["sessions"], 0, "{s}");
    assert_eq!(members[1]["sessions"], 1, "{s}");
    assert_eq!(json(&a, &["broker", "status"])["sessions"], 0);
    let (code, out, err) = run(&a, &["cluster", "status"]);
    assert_eq!(code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("NODE"), "{out}");
    assert!(
        lines[1].starts_with("a *") && lines[1].contains("connected"),
        "{out}"
    );
    assert!(
        lines[2].starts_with("b ") && lines[2].contains(" up "),
        "{out}"
    );
    assert!(out.contains("2 nodes up, 1 client on them"), "{out}");
    // Nothing waits for JetStream here (no QoS 1/2 message for another node).
    assert!(
        out.contains("waiting for JetStream: 0 messages (0 bytes)"),
        "{out}"
    );
    assert_eq!(s["jetstream_pending_bytes"], 0);

    // B stops: its last heartbeat says so, and A shows it as gone at once.
    drop(b);
    wait_until("B gone, as A sees it", || {
        let s = json(&a, &["cluster", "status"]);
        s["nodes"] == 1 && s["members"][1]["state"] == "gone"
    });
}
