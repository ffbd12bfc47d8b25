//! mercuriod as a process, with clients connected: the listening line, the no-file mode,
//! SIGTERM with clients (DISCONNECT 0x8B, exit 0 within 6 s) and a bad file at start.
//! (Command-line and --check-config errors are in cli.rs; start errors and bare signals in
//! run.rs.)
#![cfg(unix)]

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use mercurio_testkit::{parse_listening, skip, Daemon, Mqtt, DEADLINE};

/// Connects with MQTT `level` (clean start) and asserts a successful CONNACK.
fn connect(addr: SocketAddr, level: u8, client_id: &str) -> Mqtt {
    Mqtt::connect_to(addr, level, client_id, true)
}

#[test]
fn listening_line_names_the_bound_port() {
    let daemon = Daemon::start("");
    assert_eq!(daemon.addrs().len(), 1, "{:#?}", daemon.log());
    assert_eq!(daemon.addr().ip().to_string(), "127.0.0.1");
    assert_ne!(daemon.port(), 0, "the real port, not the configured 0");
    for level in [3, 4, 5] {
        connect(daemon.addr(), level, &format!("listening-{level}"));
    }
}

#[test]
fn two_listeners_are_both_reported() {
    let config = "[auth]\nallow_anonymous = true\n\n\
                  [[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
                  [[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n";
    let mut daemon = Daemon::with_config(config).start();
    let addrs = daemon.wait_listeners(2).to_vec();
    assert_ne!(addrs[0], addrs[1]);
    for (i, addr) in addrs.iter().enumerate() {
        connect(*addr, 4, &format!("two-listeners-{i}"));
    }
}

#[test]
fn sigterm_disconnects_clients_with_0x8b_and_exits_0_within_6_s() {
    let mut daemon = Daemon::start("");
    let mut v5 = connect(daemon.addr(), 5, "sigterm-v5");
    let mut v311 = connect(daemon.addr(), 4, "sigterm-v311");

    let started = Instant::now();
    daemon.signal(libc::SIGTERM);

    // 5.0: DISCONNECT with reason code 0x8B (server shutting down), then the close.
    let (header, body) = v5.read().expect("DISCONNECT before the close");
    assert_eq!(
        header, 0xE0,
        "DISCONNECT expected, got {header:#x} {body:?}"
    );
    assert_eq!(body.first(), Some(&0x8B), "reason code: {body:?}");
    assert!(v5.read().is_none(), "closed after DISCONNECT");
    // 3.1.1 has no server DISCONNECT: the connection is just closed.
    assert!(v311.read().is_none(), "3.1.1 client closed");

    let status = daemon
        .proc
        .wait_exit_within(Duration::from_secs(6).saturating_sub(started.elapsed()))
        .unwrap_or_else(|| panic!("still running 6 s after SIGTERM: {:#?}", daemon.log()));
    assert_eq!(status.code(), Some(0), "{}", daemon.proc.stderr());
}

#[test]
fn sigterm_exits_within_6_s_even_if_a_client_never_reads() {
    let mut daemon = Daemon::start("");
    // Connected, then silent: it never reads the DISCONNECT nor closes its end.
    let _idle = connect(daemon.addr(), 5, "sigterm-idle");
    let started = Instant::now();
    daemon.signal(libc::SIGTERM);
    let status = daemon
        .wait_exit_within(Duration::from_secs(6))
        .unwrap_or_else(|| panic!("still running 6 s after SIGTERM: {:#?}", daemon.log()));
    assert!(started.elapsed() <= Duration::from_secs(6));
    assert_eq!(status.code(), Some(0), "{}", daemon.proc.stderr());
}

#[test]
fn verbose_wins_over_the_level_of_the_file() {
    // The file says warn; -v means debug, so the info lines (the listening line that
    // Daemon::start waits for, a client's connection) are logged.
    let mut daemon = Daemon::with("[logging]\nlevel = \"warn\"\n")
        .arg("-v")
        .start();
    assert!(
        daemon.log().iter().any(|l| l.contains(" INFO ")),
        "{:#?}",
        daemon.log()
    );
    let client = connect(daemon.addr(), 4, "verbose");
    drop(client);
    daemon.wait_line("the client's connection line", |l| l.contains("verbose"));
}

#[test]
fn a_bad_file_at_start_exits_78_without_listening() {
    let mut daemon = Daemon::with_config(
        "[auth]\nallow_anonymous = true\n[[listeners]]\nport = 0\nmax_conections = 3\n",
    )
    .spawn();
    let proc = &mut daemon.proc;
    let (status, out) = proc.finish();
    assert_eq!(status.code(), Some(78), "{}", proc.stderr());
    assert!(
        !out.iter().any(|l| l.contains("listening on")),
        "nothing may listen: {out:#?}"
    );
    let stderr = proc.stderr();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(":5: listeners[0].max_conections"),
        "{stderr}"
    );
}

/// The no-file mode listens on 127.0.0.1:1883 and lets anonymous clients in. It needs that
/// port: when something else holds it, the test says so and returns (whatever CI says: a
/// busy port is not a missing prerequisite the test could install).
#[test]
fn no_file_mode_listens_on_127_0_0_1_1883_for_anonymous_clients() {
    match TcpListener::bind("127.0.0.1:1883") {
        Ok(probe) => drop(probe),
        Err(e) => {
            skip(
                "no_file_mode_listens_on_127_0_0_1_1883_for_anonymous_clients",
                &format!("127.0.0.1:1883 is not free ({e})"),
            );
            return;
        }
    }
    let mut daemon = Daemon::without_file().spawn();
    let proc = &mut daemon.proc;
    let deadline = Instant::now() + DEADLINE;
    let mut listening = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match proc.next_line_within(left) {
            Some(line) if line.contains("listening on ") => {
                listening.push(parse_listening(&line));
                break;
            }
            Some(_) => {}
            None => {
                // Lost the race for the port to another process between probe and bind.
                let stderr = proc.stderr();
                if stderr.contains("1883") {
                    skip(
                        "no_file_mode_listens_on_127_0_0_1_1883_for_anonymous_clients",
                        &format!("1883 taken meanwhile: {stderr}"),
                    );
                    return;
                }
                panic!("mercuriod exited: {stderr}; {:#?}", proc.seen);
            }
        }
    }
    assert_eq!(listening, vec!["127.0.0.1:1883".parse().unwrap()]);
    // Anonymous clients are allowed (CONNECT without user name).
    connect("127.0.0.1:1883".parse().unwrap(), 5, "no-file-mode");
    proc.signal(libc::SIGTERM);
    let (status, _) = proc.finish();
    assert_eq!(status.code(), Some(0), "{}", proc.stderr());
    assert!(
        !proc
            .seen
            .iter()
            .skip(1)
            .any(|l| l.contains("listening on ") && !l.contains("127.0.0.1:1883")),
        "one listener only: {:#?}",
        proc.seen
    );
}
