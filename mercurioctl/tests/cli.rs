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
