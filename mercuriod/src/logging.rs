//! Logging: a `tracing` subscriber writing to standard output, filtered by `[logging] level`.

use std::io::IsTerminal;

use mercurio_core::config::LoggingConfig;
use tracing_subscriber::EnvFilter;

/// Target of the lines logged for each connection and disconnection.
pub const CONNECTIONS_TARGET: &str = "mercurio::connections";

/// Level names a directive without `=` may be.
const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// The filter for `config`, or `debug` with `-v`, and a warning when the level had to be
/// replaced by `info`. `connection_messages = false` turns [`CONNECTIONS_TARGET`] off unless
/// the level names it.
pub fn filter(config: &LoggingConfig, verbose: bool) -> (EnvFilter, Option<String>) {
    let level = if verbose {
        "debug"
    } else {
        config.level.trim()
    };
    let (mut directives, warning) = match check(level) {
        Ok(()) => (level.to_string(), None),
        Err(why) => (
            "info".to_string(),
            Some(format!(
                "logging.level {:?} {why}: logging at info",
                config.level
            )),
        ),
    };
    if !config.connection_messages && !directives.contains(CONNECTIONS_TARGET) {
        directives.push_str(&format!(",{CONNECTIONS_TARGET}=off"));
    }
    let filter = EnvFilter::try_new(&directives).unwrap_or_else(|_| EnvFilter::new("info"));
    (filter, warning)
}

/// Whether `level` is usable: not empty, and each directive parses, with a bare word being a
/// level name (EnvFilter would read "verbose" as a target and silence everything else).
fn check(level: &str) -> Result<(), String> {
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

/// Installs the subscriber; returns the warning of [`filter`], already logged.
pub fn init(config: &LoggingConfig, verbose: bool) -> Option<String> {
    let (filter, warning) = filter(config, verbose);
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout)
        .with_ansi(std::io::stdout().is_terminal())
        .try_init();
    if installed.is_ok() {
        if let Some(warning) = &warning {
            tracing::warn!("{warning}");
        }
    }
    warning
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
