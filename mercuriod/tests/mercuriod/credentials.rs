//! Credentials in files of their own: a bridge's `password_file` authenticating to a
//! mosquitto with a password file, `[storage] url_file` for PostgreSQL, and the start-up
//! warning for a credential other users can read (and none for a file only the broker reads).
#![cfg(unix)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use mercurio_storage::postgres::testing::TestPostgres;
use mercurio_testkit::{program, Daemon, Mosquitto};

fn write_with_mode(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// The bridge's configuration: user `bridge`, its password in `password_file`, one topic out.
/// `mercuriod -c CONFIG --check-config`: its exit status and output.
fn check_config(config: &Path) -> std::process::Output {
    Command::new(mercurio_testkit::mercuriod_bin())
        .arg("-c")
        .arg(config)
        .arg("--check-config")
        .output()
        .expect("run mercuriod")
}

fn bridge_config(port: u16, password_file: &Path) -> String {
    format!(
        "[[bridges]]\nname = \"cloud\"\naddresses = [\"127.0.0.1:{port}\"]\n\
         username = \"bridge\"\npassword_file = \"{}\"\n\
         [[bridges.topics]]\npattern = \"q/#\"\ndirection = \"out\"\nqos = 1\n",
        password_file.display()
    )
}

/// A mosquitto that lets in only user `bridge` with password `s3cret` (mosquitto_passwd),
/// in `dir` (readable by mosquitto's own user).
fn mosquitto_with_password(test: &str, dir: &Path) -> Option<Mosquitto> {
    if !program(test, "mosquitto_passwd", "apt-get install mosquitto") {
        return None;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let passwd = dir.join("passwd");
    let status = Command::new("mosquitto_passwd")
        .args(["-c", "-b"])
        .arg(&passwd)
        .args(["bridge", "s3cret"])
        .status()
        .expect("mosquitto_passwd");
    assert!(status.success());
    std::fs::set_permissions(&passwd, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    Mosquitto::start(
        test,
        0,
        &format!(
            "allow_anonymous false\npassword_file {}\n",
            passwd.display()
        ),
    )
}

/// A bridge whose password sits in `password_file` (0600, written by `echo`: one trailing
/// newline) connects to a mosquitto that requires it; no warning about the file. The same
/// password in a file every user may read: the bridge connects, and mercuriod warns once,
/// naming the key and the file. A wrong password in the file is refused by the remote, and
/// SIGHUP after the file is mended reads it again.
#[test]
fn bridge_password_file_authenticates_and_a_readable_one_is_warned_about() {
    const TEST: &str = "bridge_password_file_authenticates_and_a_readable_one_is_warned_about";
    let dir = tempfile::tempdir().expect("temp dir");
    let Some(remote) = mosquitto_with_password(TEST, dir.path()) else {
        return;
    };
    let secret = dir.path().join("bridge-password");
    write_with_mode(&secret, "s3cret\n", 0o600);
    let mut daemon = Daemon::start(&bridge_config(remote.port, &secret));
    daemon.wait_logged("the bridge's connection", |l| {
        l.contains("bridge connected")
    });
    let warned = daemon.seen(|l| l.contains("readable by every user"));
    assert!(warned.is_empty(), "{warned:?}");
    drop(daemon);

    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let mut daemon = Daemon::start(&bridge_config(remote.port, &secret));
    let line = daemon.wait_logged("the warning", |l| l.contains("readable by every user"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("bridges[0].password_file"), "{line}");
    assert!(line.contains(&secret.display().to_string()), "{line}");
    daemon.wait_logged("the bridge's connection", |l| {
        l.contains("bridge connected")
    });
    let warnings = daemon.seen(|l| l.contains("readable by every user"));
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    drop(daemon);

    // The remote does check it: another password in the file is refused.
    write_with_mode(&secret, "wrong\n", 0o600);
    let mut daemon = Daemon::start(&bridge_config(remote.port, &secret));
    let line = daemon.wait_logged("the refusal", |l| l.contains("cannot connect"));
    // 3.1.1: return code 5, not authorized.
    assert!(
        line.contains("refused by the remote: CONNACK return code 5 (not authorized)"),
        "{line}"
    );

    // SIGHUP reads the file again: the right password restarts the bridge, which connects.
    write_with_mode(&secret, "s3cret\n", 0o600);
    daemon.signal(libc::SIGHUP);
    daemon.wait_logged("the bridge's restart", |l| {
        l.contains("SIGHUP: bridge cloud restarted")
    });
    daemon.wait_logged("the bridge's connection", |l| {
        l.contains("bridge connected")
    });
}

/// A missing password file stops the start (exit 78), naming the key, its line and the file;
/// `password` and `password_file` together are refused.
#[test]
fn bridge_password_file_errors_name_key_and_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("missing-password");
    let config = dir.path().join("mercuriod.toml");
    std::fs::write(
        &config,
        format!(
            "[auth]\nallow_anonymous = true\n\n{}",
            bridge_config(1883, &missing)
        ),
    )
    .expect("write");
    let out = check_config(&config);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "mercuriod.toml:8: bridges[0].password_file: cannot read {}",
            missing.display()
        )),
        "{stderr}"
    );
    std::fs::write(
        &config,
        format!(
            "[auth]\nallow_anonymous = true\n\n{}",
            bridge_config(1883, &missing).replace(
                "[[bridges.topics]]\n",
                "password = \"x\"\n[[bridges.topics]]\n"
            )
        ),
    )
    .expect("write");
    let out = check_config(&config);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("bridges[0].password_file: set password or password_file, not both"),
        "{stderr}"
    );
}

/// `--check-config` warns about a configuration file every user may read that holds a bridge
/// password or a PostgreSQL URL with a password, and not when the file is 0600.
#[test]
fn check_config_warns_about_inline_credentials_in_a_readable_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("mercuriod.toml");
    let text = "[auth]\nallow_anonymous = true\n\n[storage]\nbackend = \"postgres\"\n\
                url = \"postgres://mercurio:pw@127.0.0.1/mercurio\"\n\n\
                [[bridges]]\nname = \"cloud\"\naddresses = [\"127.0.0.1:1883\"]\n\
                username = \"u\"\npassword = \"p\"\n\
                [[bridges.topics]]\npattern = \"q/#\"\n";
    let check = || {
        let out = check_config(&config);
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    write_with_mode(&config, text, 0o644);
    let stderr = check();
    assert!(
        stderr.contains(&format!(
            "mercuriod: warning: {} is readable by every user and holds a credential \
             (bridges[0].password, storage.url)",
            config.display()
        )),
        "{stderr}"
    );
    write_with_mode(&config, text, 0o600);
    let stderr = check();
    assert!(!stderr.contains("readable by every user"), "{stderr}");
}

/// A `[cluster] peer_storage` URL with a password is a credential too: `--check-config` warns
/// about it in a file every user may read.
#[test]
fn check_config_warns_about_a_password_in_peer_storage() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("mercuriod.toml");
    let text = "[auth]\nallow_anonymous = true\n\n[storage]\nbackend = \"postgres\"\n\
                url = \"postgres://mercurio@127.0.0.1/node_a\"\n\n\
                [cluster]\nnats_urls = [\"nats://127.0.0.1:4222\"]\nnode_name = \"a\"\n\
                peer_storage = { b = \"postgres://mercurio:pw@127.0.0.1/node_b\" }\n";
    write_with_mode(&config, text, 0o644);
    let out = check_config(&config);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "mercuriod: warning: {} is readable by every user and holds a credential \
             (cluster.peer_storage.b)",
            config.display()
        )),
        "{stderr}"
    );
}

/// `[storage] url_file`: the PostgreSQL URL read from a file (with a trailing newline);
/// the broker starts on that database.
#[test]
fn storage_url_file_reaches_postgres() {
    let Some(pg) = TestPostgres::start("storage_url_file_reaches_postgres") else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let url = runtime.block_on(async { pg.url(&pg.database("urlfile", None).await) });
    let dir = tempfile::tempdir().expect("temp dir");
    let url_file = dir.path().join("database-url");
    write_with_mode(&url_file, &format!("{url}\n"), 0o600);
    let _daemon = Daemon::start(&format!(
        "[storage]\nbackend = \"postgres\"\nurl_file = \"{}\"\n",
        url_file.display()
    ));
    // The broker made its tables in that database.
    let tables: i64 = runtime.block_on(async {
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        client
            .query_one(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'",
                &[],
            )
            .await
            .expect("query")
            .get(0)
    });
    assert!(tables > 0, "no tables made through url_file");
}
