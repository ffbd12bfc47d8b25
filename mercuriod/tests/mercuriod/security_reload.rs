//! mercuriod and its security files as a process: SIGHUP reloads the ACL (a client whose
//! permissions shrank loses what it may no longer read, and stays connected); a malformed file
//! on SIGHUP keeps the old rules and logs the file and line; at start it exits with 78.
//! Derived passwords: the secret file's mode is warned about, and SIGHUP reads a new secret.
#![cfg(unix)]

use std::process::Command;

use mercurio_testkit::{mosquitto_clients, Daemon, Proc};

fn publish(port: &str, topic: &str, message: &str) {
    let st = Command::new("mosquitto_pub")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            port,
            "-u",
            "u",
            "-t",
            topic,
            "-m",
            message,
            "-q",
            "1",
        ])
        .status()
        .expect("run mosquitto_pub");
    assert!(st.success());
}

#[test]
fn sighup_reloads_the_acl_file() {
    if !mosquitto_clients("sighup_reloads_the_acl_file") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "user u\ntopic readwrite a/#\ntopic readwrite b/#\n").unwrap();
    let mut daemon = Daemon::with_config(&format!(
        "[auth]\nallow_anonymous = true\nacl_file = \"{}\"\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n",
        acl.display()
    ))
    .start();
    let port = daemon.port().to_string();

    let mut sub = Proc::spawn(
        "mosquitto_sub",
        // Line-buffered: mosquitto_sub's debug lines are not flushed into a pipe otherwise.
        Command::new("stdbuf").args([
            "-oL",
            "mosquitto_sub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-u",
            "u",
            "-i",
            "reloaded",
            "-t",
            "a/#",
            "-t",
            "b/#",
            "-v",
            "-d",
        ]),
    );
    let has = |what: &'static str| move |l: &str| l.contains(what);
    sub.wait_for("SUBACK", has("received SUBACK"));
    publish(&port, "b/1", "before");
    sub.wait_for("b/1", has("b/1 before"));

    // A malformed file: logged with its line, the old rules stay.
    std::fs::write(&acl, "user u\ntopic readwrite a/#\nsubscribe b/#\n").unwrap();
    daemon.signal(libc::SIGHUP);
    let at = format!("{}:3: ", acl.display());
    let line = daemon.wait_line("the file and line", |l| l.contains(&at));
    assert!(line.contains("unknown keyword"), "{line}");
    publish(&port, "b/2", "old rules");
    sub.wait_for("b/2", has("b/2 old rules"));

    // Permissions shrink: b/# may no longer be read.
    std::fs::write(&acl, "user u\ntopic readwrite a/#\ntopic write b/#\n").unwrap();
    daemon.signal(libc::SIGHUP);
    daemon.wait_line("reloaded", |l| l.contains("reloaded"));
    publish(&port, "b/3", "new rules");
    publish(&port, "a/1", "kept");
    let before = sub.seen.len();
    sub.wait_for("a/1", has("a/1 kept"));
    let skipped = &sub.seen[before..];
    assert!(
        !skipped.iter().any(|l| l.contains("b/3")),
        "b/3 delivered after the reload: {skipped:#?}"
    );

    assert_eq!(daemon.stop(libc::SIGTERM), Some(0));
}

#[test]
fn malformed_password_file_exits_78_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let passwd = dir.path().join("passwd");
    std::fs::write(&passwd, "alice:$7$101$c2FsdA==$aGFzaA==\nbob:$5$nope\n").unwrap();
    let mut daemon = Daemon::with_config(&format!(
        "[auth]\npassword_file = \"{}\"\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n",
        passwd.display()
    ))
    .spawn();
    assert_eq!(daemon.wait_exit(), Some(78));
    let stderr = daemon.stderr();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!("{}:2: ", passwd.display())),
        "{stderr}"
    );
}

/// mosquitto_pub with `user` and `password` (QoS 1); true when the broker accepted it.
fn publish_as(port: &str, user: &str, password: &str) -> bool {
    Command::new("mosquitto_pub")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            port,
            "-u",
            user,
            "-P",
            password,
            "-t",
            "t",
            "-m",
            "m",
            "-q",
            "1",
        ])
        .output()
        .expect("run mosquitto_pub")
        .status
        .success()
}

/// Derived passwords through mercuriod: the secret file readable by others is warned about
/// at start; mosquitto_pub connects with the derived password; SIGHUP reads
/// a new secret, after which the old password is refused and the new one accepted.
#[test]
fn derived_passwords_warn_connect_and_reload() {
    if !mosquitto_clients("derived_passwords_warn_connect_and_reload") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "first secret\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut daemon = Daemon::with_config(&format!(
        "[auth]\nallow_anonymous = false\nderived_password_secret_file = \"{}\"\nderived_user_pattern = \"tenant-*\"\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n",
        secret.display()
    ))
    .start();
    daemon.wait_logged("the mode warning", |l| {
        l.contains("WARN") && l.contains("can be read by others")
    });
    let port = daemon.port().to_string();
    // The derived password as python3's hmac module computes it (independent of the broker).
    let derive = || {
        let out = Command::new("python3")
            .args([
                "-c",
                "import hmac, hashlib, sys\n\
                 k = open(sys.argv[1], 'rb').read()\n\
                 k = k[:-1] if k.endswith(b'\\n') else k\n\
                 print(hmac.new(k, b'tenant-1', hashlib.sha256).hexdigest())",
                secret.to_str().unwrap(),
            ])
            .output()
            .expect("run python3");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let first = derive();
    assert!(publish_as(&port, "tenant-1", &first));
    assert!(!publish_as(&port, "tenant-1", "wrong"));
    std::fs::write(&secret, "second secret\n").unwrap();
    daemon.signal(libc::SIGHUP);
    daemon.wait_line("reloaded", |l| l.contains("certificates reloaded"));
    let second = derive();
    assert_ne!(first, second);
    assert!(!publish_as(&port, "tenant-1", &first));
    assert!(publish_as(&port, "tenant-1", &second));
}
