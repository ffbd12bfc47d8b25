//! SIGHUP: reread the configuration file and apply what can change while the broker runs.
//!
//! Each reload action is one method called from [`Reloader::reload`]; it gets the new
//! configuration and logs what it changed. A file that no longer loads changes nothing.

use std::path::PathBuf;

use mercurio_core::config::Config;
use mercurio_core::BrokerHandle;
use tracing::{error, info};

use crate::logging::LogControl;
use mercurio_core::config_file;

/// What SIGHUP can change.
pub struct Reloader {
    path: Option<PathBuf>,
    log: LogControl,
    handle: BrokerHandle,
}

impl Reloader {
    pub fn new(path: Option<PathBuf>, log: LogControl, handle: BrokerHandle) -> Reloader {
        Reloader { path, log, handle }
    }

    /// Rereads the file and applies each reloadable part, logging what it reloaded.
    pub async fn reload(&self) {
        let Some(path) = &self.path else {
            info!("SIGHUP: no configuration file, nothing to reload");
            return;
        };
        let config = match config_file::load(path) {
            Ok(config) => config,
            Err(e) => {
                error!("SIGHUP: {e}: keeping the running configuration");
                return;
            }
        };
        info!("SIGHUP: reloading {}", path.display());
        // One call per reloadable part.
        self.logging(&config);
        self.security();
        self.bridges(&config).await;
        self.streams(&config);
    }

    /// `[[streams]]` is read at start only: a change is logged, not applied (the streams
    /// keep their messages and readers).
    fn streams(&self, config: &Config) {
        if self.handle.config().streams != config.streams {
            tracing::warn!(
                "SIGHUP: [[streams]] changed in the file; streams are set at start: the change \
                 takes effect at the next start"
            );
        }
    }

    /// `[[bridges]]`: added, removed and changed bridges start, stop or restart alone; the
    /// others keep their connections.
    async fn bridges(&self, config: &Config) {
        let (report, errors) = self.handle.reload_bridges(&config.bridges).await;
        for e in errors {
            error!("SIGHUP: bridge: {e} (the bridge keeps running as it was)");
        }
        for (what, names) in [
            ("removed", &report.removed),
            ("restarted", &report.restarted),
            ("added", &report.added),
        ] {
            for name in names {
                info!("SIGHUP: bridge {name} {what}");
            }
        }
    }

    /// The password file, the ACL file and the TLS certificates, from the paths the broker
    /// started with; a file that fails keeps its previous contents in force.
    fn security(&self) {
        match self.handle.reload() {
            Ok(()) => info!("SIGHUP: password file, ACL file and certificates reloaded"),
            Err(errors) => {
                for e in errors {
                    error!("SIGHUP: {e} (the previous contents stay in force)");
                }
            }
        }
    }

    /// `[logging] level` and `connection_messages`.
    fn logging(&self, config: &Config) {
        self.log
            .apply(&config.logging, |line| info!("SIGHUP: {line}"));
    }
}
