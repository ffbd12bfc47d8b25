//! Logging: a `tracing` subscriber with one reloadable filter (`[logging] level`) and the
//! outputs of `[logging]`: standard output (the journal under systemd), a file, syslog.
//!
//! Outputs: `file` and `syslog` replace standard output; with neither, lines go to standard
//! output. Under systemd (`JOURNAL_STREAM` set) standard output lines carry no timestamp (the
//! journal adds its own) and start with `<N>`, the syslog severity that journald reads.
//!
//! The filter can be replaced while the broker runs ([`LogControl::set_level`] for
//! `mercurioctl broker log-level`, [`LogControl::apply`] for SIGHUP).

use std::fs::OpenOptions;
use std::io::IsTerminal;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::{Arc, Mutex};

use mercurio_core::config::LoggingConfig;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Layer, Registry};

use crate::line_output::{Journal, PerEvent};
use crate::syslog::Syslog;
use mercurio_core::config::log_targets;

/// Target of the lines logged for each connection and disconnection.
pub const CONNECTIONS_TARGET: &str = "mercurio::connections";

/// Level names a directive without `=` may be.
const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// The filter directives for `config`, or `debug` with `-v`, and a warning when the level had
/// to be replaced by `info`. `connection_messages = false` turns [`CONNECTIONS_TARGET`] off
/// unless the level names it.
pub fn directives(config: &LoggingConfig, verbose: bool) -> (String, Option<String>) {
    let level = if verbose {
        "debug"
    } else {
        config.level.trim()
    };
    let (level, warning) = match check(level) {
        Ok(()) => (level.to_string(), unknown_targets_warning(level)),
        Err(why) => (
            "info".to_string(),
            Some(format!(
                "logging.level {:?} {why}: logging at info",
                config.level
            )),
        ),
    };
    (
        with_connections(&level, config.connection_messages),
        warning,
    )
}

/// A warning naming the targets of `level` no part of Mercurio logs under (the directive
/// still applies, and silences nothing), with the list of those that do.
pub fn unknown_targets_warning(level: &str) -> Option<String> {
    let unknown = log_targets::unknown(level);
    (!unknown.is_empty()).then(|| {
        format!(
            "logging.level {level:?} names no module of Mercurio: {} (known targets: {})",
            unknown.join(", "),
            log_targets::TARGETS.join(", ")
        )
    })
}

/// `directives` as the filter applies them: the NATS client library (cluster mode) at `warn`
/// unless they name it, as its INFO lines repeat per connection what the cluster's own lines
/// say.
fn quiet_libraries(directives: &str) -> String {
    if directives.contains("async_nats") {
        directives.to_string()
    } else {
        format!("{directives},async_nats=warn")
    }
}

/// `level`, with [`CONNECTIONS_TARGET`] turned off when `connection_messages` is false and
/// `level` does not name it.
fn with_connections(level: &str, connection_messages: bool) -> String {
    if !connection_messages && !level.contains(CONNECTIONS_TARGET) {
        format!("{level},{CONNECTIONS_TARGET}=off")
    } else {
        level.to_string()
    }
}

/// The filter of [`directives`], for `--check-config` and tests.
pub fn filter(config: &LoggingConfig, verbose: bool) -> (EnvFilter, Option<String>) {
    let (directives, warning) = directives(config, verbose);
    let filter =
        EnvFilter::try_new(quiet_libraries(&directives)).unwrap_or_else(|_| EnvFilter::new("info"));
    (filter, warning)
}

/// Whether `level` is usable: not empty, and each directive parses, with a bare word being a
/// level name (EnvFilter would read "verbose" as a target and silence everything else).
pub fn check(level: &str) -> Result<(), String> {
    let level = level.trim();
    if level.is_empty() {
        return Err("is empty".into());
    }
    for directive in level.split(',').map(str::trim) {
        if directive.is_empty() {
            continue;
        }
        if !directive.contains('=')
            && !directive.contains('[')
            && !LEVELS.contains(&directive.to_ascii_lowercase().as_str())
        {
            return Err(format!("is not a level ({directive:?})"));
        }
    }
    EnvFilter::try_new(level)
        .map(|_| ())
        .map_err(|e| format!("is not valid ({e})"))
}

/// What can be changed in the installed subscriber.
#[derive(Clone)]
pub struct LogControl {
    inner: Arc<Control>,
}

struct Control {
    handle: reload::Handle<EnvFilter, Registry>,
    verbose: bool,
    state: Mutex<State>,
}

struct State {
    /// The `[logging]` section the outputs were opened for.
    config: LoggingConfig,
    /// The directives in force.
    directives: String,
}

impl LogControl {
    /// The filter directives in force.
    pub fn level(&self) -> String {
        lock(&self.inner.state).directives.clone()
    }

    /// Replaces the level until the broker restarts (or SIGHUP rereads the file); refuses an
    /// empty or invalid level rather than falling back to info. `connection_messages = false`
    /// still applies unless `level` names [`CONNECTIONS_TARGET`]. Returns the directives now in
    /// force, and a warning when `level` names a target nothing logs under (it is applied
    /// all the same).
    pub fn set_level(&self, level: &str) -> Result<(String, Option<String>), String> {
        check(level).map_err(|why| format!("level {level:?} {why}"))?;
        let mut state = lock(&self.inner.state);
        let directives = with_connections(level.trim(), state.config.connection_messages);
        self.reload(&directives)?;
        state.directives = directives.clone();
        Ok((directives, unknown_targets_warning(level.trim())))
    }

    /// Applies a reread `[logging]` section (SIGHUP): the level and `connection_messages`.
    /// Says what it does through `report`, one line each, before the new level applies (so
    /// that the lines pass the old filter); a change of `file` or `syslog` needs a restart and
    /// is reported as such.
    pub fn apply(&self, config: &LoggingConfig, report: impl Fn(&str)) {
        let (directives, warning) = directives(config, self.inner.verbose);
        if let Some(warning) = warning {
            report(&warning);
        }
        let mut state = lock(&self.inner.state);
        if state.config.file != config.file || state.config.syslog != config.syslog {
            report(
                "logging.file and logging.syslog are read at start only: restart to change them",
            );
        }
        report(&format!(
            "log level: {directives} (was {})",
            state.directives
        ));
        match self.reload(&directives) {
            Ok(()) => {
                state.directives = directives;
                state.config.level = config.level.clone();
                state.config.connection_messages = config.connection_messages;
            }
            Err(e) => report(&e),
        }
    }

    fn reload(&self, directives: &str) -> Result<(), String> {
        let filter = EnvFilter::try_new(quiet_libraries(directives))
            .map_err(|e| format!("{directives:?}: {e}"))?;
        self.inner
            .handle
            .reload(filter)
            .map_err(|e| format!("cannot change the log level: {e}"))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type Boxed = Box<
    dyn Layer<tracing_subscriber::layer::Layered<reload::Layer<EnvFilter, Registry>, Registry>>
        + Send
        + Sync,
>;

/// Opens the outputs and installs the subscriber. Logs the level warning of [`directives`]
/// once installed. Errors: the log file cannot be opened (one line).
pub fn init(config: &LoggingConfig, verbose: bool) -> Result<LogControl, String> {
    let (directives, warning) = directives(config, verbose);
    let filter =
        EnvFilter::try_new(quiet_libraries(&directives)).unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = reload::Layer::new(filter);

    let mut outputs: Vec<Boxed> = Vec::new();
    if let Some(path) = &config.file {
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o640)
            .open(path)
            .map_err(|e| format!("logging.file {}: cannot open: {e}", path.display()))?;
        outputs.push(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(Mutex::new(file))
                .boxed(),
        );
    }
    if config.syslog {
        outputs.push(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .without_time()
                .with_writer(PerEvent(Syslog::from_env()))
                .boxed(),
        );
    }
    if outputs.is_empty() {
        if std::env::var_os("JOURNAL_STREAM").is_some() {
            outputs.push(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .without_time()
                    .with_writer(PerEvent(Journal))
                    .boxed(),
            );
        } else {
            outputs.push(
                tracing_subscriber::fmt::layer()
                    .with_ansi(std::io::stdout().is_terminal())
                    .with_writer(std::io::stdout)
                    .boxed(),
            );
        }
    }

    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(outputs)
        .try_init();
    if installed.is_ok() {
        if let Some(warning) = &warning {
            tracing::warn!("{warning}");
        }
    }
    Ok(LogControl {
        inner: Arc::new(Control {
            handle,
            verbose,
            state: Mutex::new(State {
                config: config.clone(),
                directives,
            }),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(level: &str) -> LoggingConfig {
        LoggingConfig {
            level: level.into(),
            ..LoggingConfig::default()
        }
    }

    #[test]
    fn levels() {
        assert!(filter(&level("info"), false).1.is_none());
        assert!(filter(&level("info,mercurio_core::session=warn"), false)
            .1
            .is_none());
        assert!(filter(&level("DEBUG"), false).1.is_none());
        assert!(filter(&level(""), false).1.is_some());
        assert!(filter(&level("  "), false).1.is_some());
        assert!(filter(&level("verbose"), false).1.is_some());
        assert!(filter(&level("info,x=loud"), false).1.is_some());
        assert!(filter(&level("verbose"), true).1.is_none());
        assert_eq!(directives(&level("verbose"), true).0, "debug");
        assert_eq!(directives(&level("bad level"), false).0, "info");
    }

    /// A directive naming a module that does not exist is applied with a warning listing the
    /// real targets, as an invalid level is; real crates and modules (and what lies under
    /// them) pass.
    #[test]
    fn unknown_targets_warn() {
        let (d, w) = directives(&level("info,mercurio_server::session=debug"), false);
        assert_eq!(d, "info,mercurio_server::session=debug");
        let w = w.expect("a warning");
        assert!(w.contains("mercurio_server::session"), "{w}");
        assert!(w.contains("mercurio_core::session"), "{w}");
        for ok in [
            "info,mercurio_core::session=debug",
            "mercurio=debug",
            "mercurio_core=trace,mercurio_storage::sqlite=debug",
            "mercurio_core::router::index=trace",
            "warn,mercurio::connections=off",
            "mercuriod[admin]=debug,[span]=info",
        ] {
            assert_eq!(directives(&level(ok), false).1, None, "{ok}");
        }
        for bad in [
            "mercurio_cor=debug",
            "info,hyper=debug",
            "mercurio_core::sessions=debug",
        ] {
            assert!(directives(&level(bad), false).1.is_some(), "{bad}");
        }
    }

    /// The targets list names every top-level module that logs, and nothing that does not
    /// exist.
    #[test]
    fn targets_match_the_sources() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for (krate, dir) in [
            ("mercurio_core", "mercurio-core/src"),
            ("mercurio_storage", "mercurio-storage/src"),
            ("mercuriod", "mercuriod/src"),
        ] {
            for e in std::fs::read_dir(root.join(dir)).unwrap() {
                let path = e.unwrap().path();
                let name = path.file_stem().unwrap().to_str().unwrap().to_string();
                if ["lib", "main"].contains(&name.as_str()) {
                    continue;
                }
                let text = if path.is_dir() {
                    std::fs::read_dir(&path)
                        .unwrap()
                        .map(|f| std::fs::read_to_string(f.unwrap().path()).unwrap_or_default())
                        .collect()
                } else {
                    std::fs::read_to_string(&path).unwrap()
                };
                let target = format!("{krate}::{name}");
                // A module logs when it calls one of tracing's event macros (importing
                // tracing's types, as the line outputs do, is not logging).
                let logs = ["error!(", "warn!(", "info!(", "debug!(", "trace!("]
                    .iter()
                    .any(|m| text.contains(m));
                if logs {
                    assert!(
                        log_targets::TARGETS.contains(&target.as_str()),
                        "{target} logs but is not in log_targets::TARGETS"
                    );
                }
            }
        }
        for t in log_targets::TARGETS {
            let Some((krate, module)) = t.split_once("::") else {
                continue;
            };
            let dir = match krate {
                "mercurio_core" => "mercurio-core/src",
                "mercurio_storage" => "mercurio-storage/src",
                "mercuriod" => "mercuriod/src",
                _ => continue,
            };
            let base = root.join(dir);
            assert!(
                base.join(format!("{module}.rs")).exists() || base.join(module).is_dir(),
                "{t} does not exist"
            );
        }
    }

    #[test]
    fn connection_messages_off() {
        let mut c = level("info");
        c.connection_messages = false;
        let (f, _) = filter(&c, false);
        assert!(f.to_string().contains("mercurio::connections=off"), "{f}");
        c.level = "info,mercurio::connections=info".into();
        let (f, _) = filter(&c, false);
        assert!(!f.to_string().contains("=off"), "{f}");
    }
}
