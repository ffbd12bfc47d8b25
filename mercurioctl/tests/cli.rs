//! mercurioctl as a process.

use std::process::Command;

const MERCURIOCTL: &str = env!("CARGO_BIN_EXE_mercurioctl");

#[test]
fn version() {
    let out = Command::new(MERCURIOCTL)
        .arg("--version")
        .output()
        .expect("run mercurioctl");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("mercurioctl {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn help_says_the_admin_commands_are_not_available_yet() {
    let out = Command::new(MERCURIOCTL)
        .arg("--help")
        .output()
        .expect("run mercurioctl");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("not available yet"), "{help}");
}

#[test]
fn no_subcommands() {
    let out = Command::new(MERCURIOCTL)
        .arg("client")
        .output()
        .expect("run mercurioctl");
    assert_eq!(out.status.code(), Some(2), "a usage error");
}

#[test]
fn without_arguments_says_why_and_fails() {
    let out = Command::new(MERCURIOCTL).output().expect("run mercurioctl");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("not available yet"), "{stderr}");
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
