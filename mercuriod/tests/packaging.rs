//! packaging/mercuriod.service: what the daemon relies on.

#[test]
fn systemd_unit() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../packaging/mercuriod.service"
    );
    let unit = std::fs::read_to_string(path).expect("read packaging/mercuriod.service");
    let lines: Vec<&str> = unit.lines().map(str::trim).collect();
    for line in [
        "Type=notify",
        "Restart=on-failure",
        "RestartPreventExitStatus=78",
        "StateDirectory=mercurio",
        "RuntimeDirectory=mercurio",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "NoNewPrivileges=true",
        "ProtectSystem=strict",
    ] {
        assert!(lines.contains(&line), "{line} missing from {path}");
    }
    assert!(lines.iter().any(|l| l.starts_with("WatchdogSec=")));
}
