//! The log targets Mercurio's lines carry, for `[logging] level` directives such as
//! `info,mercurio_core::session=debug`: mercuriod warns about a directive naming none of them
//! and mercurioctl's `broker log-level --help` lists them.

/// Every target a directive may name: the connection log lines' own target, then each crate
/// and its top-level modules (a directive for a crate or module covers everything under it).
pub const TARGETS: &[&str] = &[
    "mercurio::connections",
    "mercurio_core",
    "mercurio_core::auth",
    "mercurio_core::bridge",
    "mercurio_core::bridge_status",
    "mercurio_core::broker",
    "mercurio_core::busy_poll",
    "mercurio_core::cluster",
    "mercurio_core::config",
    "mercurio_core::connection",
    "mercurio_core::error",
    "mercurio_core::events",
    "mercurio_core::handle",
    "mercurio_core::hook",
    "mercurio_core::http",
    "mercurio_core::intercept",
    "mercurio_core::link",
    "mercurio_core::listener",
    "mercurio_core::message",
    "mercurio_core::metrics",
    "mercurio_core::parking",
    "mercurio_core::persist",
    "mercurio_core::proxy_protocol",
    "mercurio_core::queued_memory",
    "mercurio_core::router",
    "mercurio_core::session",
    "mercurio_core::stats",
    "mercurio_core::streams",
    "mercurio_core::sys",
    "mercurio_core::tls",
    "mercurio_core::topic",
    "mercurio_core::websocket",
    "mercurio_storage",
    "mercurio_storage::memory",
    "mercurio_storage::postgres",
    "mercurio_storage::sqlite",
    "mercuriod",
    "mercuriod::admin",
    "mercuriod::logging",
    "mercuriod::reload",
    "mercuriod::syslog",
    "mercuriod::systemd",
];

/// Whether a directive's `target` names something that logs: a prefix of a known target at a
/// `::` boundary or a whole one (`mercurio_core`, `mercurio_core::session`), or a module under
/// one of the top-level modules (`mercurio_core::router::index`). A target logs wherever its
/// name is a prefix of the line's target, so `mercurio` covers every crate as well.
pub fn is_known(target: &str) -> bool {
    TARGETS.iter().any(|t| {
        t.starts_with(target)
            && (t.len() == target.len()
                || target == "mercurio"
                || t[target.len()..].starts_with("::"))
            || target
                .strip_prefix(t)
                .is_some_and(|rest| rest.starts_with("::") && t.contains("::"))
    })
}

/// The targets that `directives` (a `[logging] level` value) names and no part of Mercurio
/// logs under; empty when every one is known. Level-only directives name no target.
pub fn unknown(directives: &str) -> Vec<String> {
    directives
        .split(',')
        .filter_map(|d| {
            let d = d.trim();
            let target = d.split_once('=').map_or("", |(t, _)| t);
            let target = target.split('[').next().unwrap_or_default().trim();
            (!target.is_empty() && !is_known(target)).then(|| target.to_string())
        })
        .collect()
}

/// One line per target, for mercurioctl's `--help`.
pub fn help() -> String {
    let mut out =
        String::from("Targets a directive may name (each covers the modules under it):\n");
    for t in TARGETS {
        out.push_str("  ");
        out.push_str(t);
        out.push('\n');
    }
    out
}
