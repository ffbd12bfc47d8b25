//! `mercuriod`, the Mercurio MQTT broker daemon: a thin shell over `mercurio-core` that reads
//! the configuration file, sets up logging and signals, starts the broker and stops it
//! gracefully. It holds no broker logic: an embedding application can do all of this through
//! the library.
//!
//! Dependencies, and why:
//! - `mercurio-core`: the broker itself (`Broker`, `BrokerHandle`) and the `Config` struct.
//! - `tokio`: the runtime the broker runs on; `tokio::signal` for SIGTERM and Ctrl+C.
//! - `clap` (derive): the command line, `--help` and `--version` for free.
//! - `toml`: the configuration file into `Config` through serde, errors with byte spans.
//! - `toml_edit`: the same file as a document with spans, to name the key and line of an error
//!   found after parsing (already in the tree as `toml`'s parser).
//! - `tracing`, `tracing-subscriber` (env-filter, fmt): logs to stdout, per-module levels.
//! - `serde`, `thiserror`, `mercurio-storage`: not used yet; kept for the admin socket and the
//!   storage options of later versions.
//! - `tempfile` (tests only): configuration files written by the tests.

mod cli;
mod config_file;
mod logging;

use std::path::Path;
use std::process::ExitCode;

use clap::Parser;
use mercurio_core::config::Config;
use mercurio_core::{Broker, BrokerHandle};
use tracing::{error, info, warn};

use crate::cli::Cli;

/// Exit status of a configuration error (sysexits.h EX_CONFIG); the systemd unit lists it in
/// RestartPreventExitStatus.
const EX_CONFIG: u8 = 78;

/// Exit status when the broker cannot start or stops on an error.
const EX_FAILURE: u8 = 1;

fn main() -> ExitCode {
    limit_malloc_arenas();
    let cli = Cli::parse();

    let config = match &cli.config {
        Some(path) => match config_file::load(path) {
            Ok(config) => config,
            Err(e) => {
                eprintln!("mercuriod: {e}");
                return ExitCode::from(EX_CONFIG);
            }
        },
        None => {
            let config = Config::default();
            if let Err(e) = config.validate() {
                eprintln!("mercuriod: default configuration: {e}");
                return ExitCode::from(EX_CONFIG);
            }
            config
        }
    };

    if cli.check_config {
        return check_config(&config, cli.config.as_deref(), cli.verbose);
    }

    logging::init(&config.logging, cli.verbose);
    for warning in config_file::warnings(&config) {
        warn!("{warning}");
    }

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("mercuriod: cannot start the runtime: {e}");
            return ExitCode::from(EX_FAILURE);
        }
    };
    runtime.block_on(serve(config, cli.config.as_deref()))
}

/// `--check-config`: the configuration is valid (errors were reported before); print the
/// warnings and a one-line verdict.
fn check_config(config: &Config, path: Option<&Path>, verbose: bool) -> ExitCode {
    let (_, level_warning) = logging::filter(&config.logging, verbose);
    for warning in level_warning
        .into_iter()
        .chain(config_file::warnings(config))
    {
        eprintln!("mercuriod: warning: {warning}");
    }
    match path {
        Some(path) => println!("mercuriod: {}: configuration OK", path.display()),
        None => println!("mercuriod: no configuration file: defaults OK"),
    }
    ExitCode::SUCCESS
}

/// Starts the broker, waits for SIGTERM or SIGINT, stops it.
async fn serve(config: Config, path: Option<&Path>) -> ExitCode {
    info!("mercuriod {} starting", env!("CARGO_PKG_VERSION"));
    match path {
        Some(path) => info!("configuration: {}", path.display()),
        None => info!("no configuration file: defaults (127.0.0.1:1883, anonymous clients)"),
    }

    // Before the broker starts, so that a signal during startup is not lost.
    let mut signals = match Signals::new() {
        Ok(signals) => signals,
        Err(e) => {
            eprintln!("mercuriod: cannot listen for signals: {e}");
            return ExitCode::from(EX_FAILURE);
        }
    };

    let handle = match start_broker(config).await {
        Ok(handle) => handle,
        Err(e @ mercurio_core::Error::File(_)) => {
            // A password, ACL, certificate or key file: a configuration error (path, line).
            eprintln!("mercuriod: cannot start: {e}");
            return ExitCode::from(EX_CONFIG);
        }
        Err(e) => {
            eprintln!("mercuriod: cannot start: {e}");
            return ExitCode::from(EX_FAILURE);
        }
    };
    for addr in handle.local_addrs() {
        info!("listening on {addr}");
    }

    let signal = loop {
        match signals.recv().await {
            "SIGHUP" => reload(&handle),
            signal => break signal,
        }
    };
    info!("{signal} received: disconnecting clients and stopping");
    tokio::select! {
        () = handle.shutdown() => {
            info!("stopped");
            ExitCode::SUCCESS
        }
        signal = signals.recv() => {
            warn!("{signal} received again: exiting without waiting for clients");
            ExitCode::from(EX_FAILURE)
        }
    }
}

/// SIGHUP: the password file, the ACL file and the TLS certificates are read again; connected
/// clients stay. A file that cannot be used keeps its previous contents.
fn reload(handle: &BrokerHandle) {
    info!("SIGHUP received: reloading the password file, the ACL file and the certificates");
    match handle.reload() {
        Ok(()) => info!("reloaded"),
        Err(errors) => {
            for e in errors {
                error!("reload: {e} (the previous contents stay in force)");
            }
        }
    }
}

/// The broker's start, behind one function: the daemon's only call into the broker's
/// construction (the embedding API of DESIGN.md section 5).
async fn start_broker(config: Config) -> Result<BrokerHandle, mercurio_core::Error> {
    Broker::builder(config).start().await
}

/// SIGTERM and SIGINT (stop), SIGHUP (reload).
struct Signals {
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    #[cfg(unix)]
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }

    #[cfg(not(unix))]
    fn new() -> std::io::Result<Self> {
        Ok(Signals {})
    }

    /// Waits for the next signal and names it.
    #[cfg(unix)]
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.hangup.recv() => "SIGHUP",
        }
    }

    #[cfg(not(unix))]
    async fn recv(&mut self) -> &'static str {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl+C"
    }
}

/// On glibc, at most two malloc arenas: with one per thread (the default), memory freed under
/// load stays with its thread and the process grows and stays high (the manual, "Memory").
/// `MALLOC_ARENA_MAX` in the environment still wins.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn limit_malloc_arenas() {
    extern "C" {
        fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
    }
    /// glibc's `M_ARENA_MAX` from malloc.h.
    const M_ARENA_MAX: std::ffi::c_int = -8;
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; called before any thread starts.
        unsafe {
            mallopt(M_ARENA_MAX, 2);
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn limit_malloc_arenas() {}
