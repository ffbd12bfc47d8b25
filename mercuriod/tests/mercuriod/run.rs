//! mercuriod as a process: start errors and signals. (Connecting clients is tested with the
//! broker.)
#![cfg(unix)]

use std::net::TcpListener;

use mercurio_testkit::Daemon;

fn config_file(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("mercuriod.toml");
    // Each broker's admin socket in its own dir (the default one is shared by every broker).
    let socket = dir.path().join("mercuriod.sock");
    let text = text.replace("ADMIN_SOCKET", &socket.display().to_string());
    std::fs::write(&path, text).expect("write config");
    (dir, path)
}

#[test]
fn port_in_use_exits_1_with_one_line() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let (_dir, path) = config_file(&format!(
        "[auth]\nallow_anonymous = true\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = {port}\n\n\
         [admin]\nsocket = \"ADMIN_SOCKET\"\n"
    ));
    let mut daemon = Daemon::with_file(&path).spawn();
    assert_eq!(daemon.wait_exit(), Some(1));
    let stderr = daemon.stderr();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(&port.to_string()), "{stderr}");
}

#[test]
fn sigterm_stops_with_status_0() {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let mut daemon = Daemon::start("");
        let log = daemon.log();
        assert!(log[0].contains(env!("CARGO_PKG_VERSION")), "{log:#?}");

        daemon.signal(signal);
        let (status, rest) = daemon.finish();
        assert_eq!(status.code(), Some(0), "after {signal}");
        assert!(
            rest.iter().any(|l| l.contains("received")),
            "{signal}: {rest:#?}"
        );
    }
}
