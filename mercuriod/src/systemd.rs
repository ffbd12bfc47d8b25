//! systemd's notification protocol (`Type=notify`): readiness once the listeners and the admin
//! socket are bound, the watchdog while the runtime answers, stopping at shutdown. Without
//! `NOTIFY_SOCKET` (not under systemd) every call does nothing.

use std::time::Duration;

use sd_notify::NotifyState;

/// Tells systemd the broker serves, with a status line.
pub fn ready(status: &str) {
    let _ = sd_notify::notify(false, &[NotifyState::Ready, NotifyState::Status(status)]);
}

/// Tells systemd the broker is stopping.
pub fn stopping() {
    let _ = sd_notify::notify(false, &[NotifyState::Stopping]);
}

/// When the unit sets `WatchdogSec=`, pings systemd at half the interval from a runtime task,
/// so that a runtime that stops answering gets the broker restarted.
pub fn spawn_watchdog() {
    let mut usec = 0;
    if !sd_notify::watchdog_enabled(false, &mut usec) || usec == 0 {
        return;
    }
    let period = Duration::from_micros(usec / 2);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            let _ = sd_notify::notify(false, &[NotifyState::Watchdog]);
        }
    });
}
