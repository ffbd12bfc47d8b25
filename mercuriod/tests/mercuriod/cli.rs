//! mercuriod and mercurioctl as processes: the command line and configuration errors.
//! (Tests that start the broker and connect to it live with the broker's tests.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use mercurio_testkit::mercuriod_bin;

fn mercuriod(args: &[&str]) -> Output {
    Command::new(mercuriod_bin())
        .args(args)
        .output()
        .expect("run mercuriod")
}

/// Writes `text` to a configuration file in a temp dir kept alive by the returned guard.
fn config_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("mercuriod.toml");
    std::fs::write(&path, text).expect("write config");
    (dir, path)
}

/// Runs `mercuriod -c FILE --check-config` on `text`; returns (status, stderr).
fn check(text: &str) -> (Option<i32>, String, PathBuf, tempfile::TempDir) {
    let (dir, path) = config_file(text);
    let out = Command::new(mercuriod_bin())
        .arg("-c")
        .arg(&path)
        .arg("--check-config")
        .output()
        .expect("run mercuriod");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), stderr, path, dir)
}

/// The one error line: `mercuriod: FILE:LINE: KEY: ...`.
fn assert_config_error(text: &str, line: usize, key: &str, words: &str) {
    let (code, stderr, path, _dir) = check(text);
    assert_eq!(code, Some(78), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    let prefix = format!("mercuriod: {}:{line}: {key}: ", path.display());
    assert!(
        stderr.starts_with(&prefix),
        "expected {prefix:?}, got {stderr:?}"
    );
    assert!(stderr.contains(words), "expected {words:?} in {stderr:?}");
}

#[test]
fn unknown_key_names_key_and_line() {
    assert_config_error(
        "[server]\nmax_qos = 1\nmax_conections = 10\n",
        3,
        "server.max_conections",
        "unknown field `max_conections`",
    );
    assert_config_error(
        "# a comment\n[logging]\nlevel = \"info\"\n\n[sever]\n",
        5,
        "sever",
        "unknown field",
    );
}

#[test]
fn bad_value_names_key_and_line() {
    assert_config_error(
        "[server]\nsys_interval = 5\nmax_qos = 3\n",
        3,
        "server.max_qos",
        "must be 0, 1 or 2",
    );
    assert_config_error(
        "[[listeners]]\nport = 1884\n\n[[listeners]]\nport = 1884\n",
        5,
        "listeners[1].port",
        "already used",
    );
}

#[test]
fn wrong_type_names_key_and_line() {
    assert_config_error(
        "[server]\n\nmax_packet_size = \"1MB\"\n",
        3,
        "server.max_packet_size",
        "invalid type",
    );
}

#[test]
fn postgres_backend_is_accepted() {
    let (code, stderr, _path, _dir) = check(
        "[storage]\nbackend = \"postgres\"\nurl = \"postgres://localhost/mercurio\"\n\
         standby = true\n",
    );
    assert_eq!(code, Some(0), "{stderr}");
}

#[test]
fn syntax_error_is_one_line_with_status_78() {
    let (code, stderr, path, _dir) = check("[server\nmax_qos = 1\n");
    assert_eq!(code, Some(78), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("mercuriod: {}:1: ", path.display())),
        "{stderr}"
    );
}

/// A newcomer's `mercuriod -c /etc/mosquitto/mosquitto.conf` is told how to convert it.
#[test]
fn a_mosquitto_conf_is_recognised_and_the_conversion_named() {
    let (code, stderr, path, _dir) = check(
        "# Place your local configuration in /etc/mosquitto/conf.d/\n\
         pid_file /run/mosquitto/mosquitto.pid\n\npersistence true\n\
         persistence_location /var/lib/mosquitto/\n\nlog_dest file /var/log/mosquitto/mosquitto.log\n",
    );
    assert_eq!(code, Some(78), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "mercurioctl config import-mosquitto {} > mercuriod.toml",
            path.display()
        )),
        "{stderr}"
    );
}

/// `-p PORT` with a file: only for a file without [[listeners]] (whose default listener it
/// replaces); with listeners it is an error naming the file's line.
#[test]
fn port_option_with_a_file() {
    let (dir, path) = config_file("[[listeners]]\nport = 1884\n");
    let out = Command::new(mercuriod_bin())
        .arg("-c")
        .arg(&path)
        .args(["-p", "1885", "--check-config"])
        .output()
        .expect("run mercuriod");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "mercuriod: {}:1: listeners: -p/--port",
            path.display()
        )),
        "{stderr}"
    );
    drop(dir);
    let (_dir, path) = config_file("[auth]\nallow_anonymous = true\n");
    let out = Command::new(mercuriod_bin())
        .arg("-c")
        .arg(&path)
        .args(["-p", "1885", "--check-config"])
        .output()
        .expect("run mercuriod");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = mercuriod(&["-p", "70000", "--check-config"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn missing_file_is_a_configuration_error() {
    let out = mercuriod(&["-c", "/nonexistent/mercuriod.toml", "--check-config"]);
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/mercuriod.toml"), "{stderr}");
}

#[test]
fn example_configuration_is_valid() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/mercuriod.toml");
    let out = Command::new(mercuriod_bin())
        .arg("--config")
        .arg(&example)
        .arg("--check-config")
        .output()
        .expect("run mercuriod");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("configuration OK"));
}

#[test]
fn check_config_without_file_and_with_a_valid_file() {
    let out = mercuriod(&["--check-config"]);
    assert_eq!(out.status.code(), Some(0));

    let (code, stderr, _, _dir) = check(
        "[server]\nmax_qos = 1\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
         [auth]\nallow_anonymous = true\n\n[logging]\nlevel = \"info,mercurio::connections=warn\"\n",
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.is_empty(), "no warning expected: {stderr}");
}

#[test]
fn check_config_warns_when_no_client_can_connect() {
    let (code, stderr, _, _dir) = check("[server]\nmax_qos = 1\n");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("allow_anonymous"), "{stderr}");
}

#[test]
fn help_describes_the_no_file_mode_and_the_storage_backends() {
    let out = mercuriod(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for words in [
        "--config",
        "--verbose",
        "--check-config",
        "--port",
        "import-mosquitto",
        "127.0.0.1:1883",
        "standby = true",
        "cert_file",
        "password_file",
        "syslog",
        "SIGHUP",
        "mercuriod.sock",
        "0x8B",
        "78",
    ] {
        assert!(help.contains(words), "{words:?} missing from:\n{help}");
    }
}

#[test]
fn version() {
    let out = mercuriod(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("mercuriod {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn unknown_option_is_a_usage_error() {
    let out = mercuriod(&["--no-such-option"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `--check-config` also reads what the file names: a malformed ACL line, a missing
/// certificate, an `http_dir` that is not a directory are each exit 78 with the path.
#[test]
fn check_config_reads_the_files_it_names() {
    let dir = tempfile::tempdir().expect("temp dir");
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "topic read a/#\nfrobnicate b\n").expect("write acl");
    let cases = [
        (
            format!("[auth]\nallow_anonymous = true\nacl_file = \"{}\"\n", acl.display()),
            format!("{}:2", acl.display()),
        ),
        (
            "[[listeners]]\nport = 8883\ncert_file = \"/nonexistent/cert.pem\"\nkey_file = \"/nonexistent/key.pem\"\n".to_string(),
            "/nonexistent/cert.pem".to_string(),
        ),
        (
            "[[listeners]]\nport = 8080\nprotocol = \"websocket\"\nhttp_dir = \"/nonexistent/www\"\n".to_string(),
            "/nonexistent/www".to_string(),
        ),
    ];
    for (text, names) in cases {
        let (code, stderr, _path, _dir) = check(&text);
        assert_eq!(code, Some(78), "{text}: {stderr}");
        assert!(stderr.contains(&names), "{text}: {stderr}");
    }
}

/// A capitalised or spelled-out boolean (`True`, `yes`) and an unquoted string are TOML syntax
/// errors: the message names the key and line and says what to write.
#[test]
fn unquoted_values_say_what_to_write() {
    assert_config_error(
        "[auth]\nallow_anonymous = True\n",
        2,
        "auth.allow_anonymous",
        "booleans are lowercase and unquoted, write allow_anonymous = true",
    );
    assert_config_error(
        "[[listeners]]\nport = 1883\n\n[auth]\nallow_anonymous = no # off\n",
        5,
        "auth.allow_anonymous",
        "`no` is not a TOML value: booleans are lowercase and unquoted, write allow_anonymous = false",
    );
    assert_config_error(
        "[[listeners]]\nport = 1883\n[[listeners]]\nport = 8080\nprotocol = websocket\n",
        5,
        "listeners[1].protocol",
        "a string is quoted, write protocol = \"websocket\"",
    );
}

/// A mistyped key or value gets the closest known one of its table.
#[test]
fn a_mistyped_key_gets_a_suggestion() {
    assert_config_error(
        "[server]\nmax_inflights = 10\n",
        2,
        "server.max_inflights",
        "unknown field `max_inflights`; did you mean `max_inflight`?",
    );
    assert_config_error(
        "[auth]\nallow_anonymus = true\n",
        2,
        "auth.allow_anonymus",
        "did you mean `allow_anonymous`?",
    );
    assert_config_error(
        "[sever]\nmax_qos = 1\n",
        1,
        "sever",
        "did you mean `server`?",
    );
    assert_config_error(
        "[[listeners]]\nport = 1\nprotocol = \"websockets\"\n",
        3,
        "listeners[0].protocol",
        "did you mean `websocket`?",
    );
    // Nothing close: no suggestion.
    let (_, stderr, _, _dir) = check("[server]\nfrobnicate = 1\n");
    assert!(!stderr.contains("did you mean"), "{stderr}");
}

/// A file the configuration names that cannot be read is an error naming the key and its
/// line (then the file), for each key that names a file.
#[test]
fn an_unreadable_named_file_names_key_and_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pem = dir.path().join("present.pem");
    std::fs::write(&pem, "").expect("write");
    let pem = pem.display();
    let missing = "/nonexistent/missing";
    let cases = [
        (format!("[auth]\nallow_anonymous = false\npassword_file = \"{missing}\"\n"), 3, "auth.password_file"),
        (format!("[auth]\nallow_anonymous = true\n\nacl_file = \"{missing}\"\n"), 4, "auth.acl_file"),
        (format!("[[listeners]]\nport = 1883\n[[listeners]]\nport = 8883\ncert_file = \"{missing}\"\nkey_file = \"{pem}\"\n"), 5, "listeners[1].cert_file"),
        (format!("[[listeners]]\nport = 8883\ncert_file = \"{pem}\"\nkey_file = \"{missing}\"\n"), 4, "listeners[0].key_file"),
        (format!("[[listeners]]\nport = 8883\ncert_file = \"{pem}\"\nkey_file = \"{pem}\"\nca_file = \"{missing}\"\n"), 5, "listeners[0].ca_file"),
        (format!("[[listeners]]\nport = 8883\ncert_file = \"{pem}\"\nkey_file = \"{pem}\"\nca_file = \"{pem}\"\ncrl_file = \"{missing}\"\n"), 6, "listeners[0].crl_file"),
        (format!("[[listeners]]\nport = 1883\npassword_file = \"{missing}\"\n"), 3, "listeners[0].password_file"),
    ];
    for (text, line, key) in cases {
        assert_config_error(&text, line, key, &format!("cannot read {missing}: "));
    }
}
