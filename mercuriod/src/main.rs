//! `mercuriod`, the Mercurio MQTT broker daemon: a thin shell over `mercurio-core` that reads
//! the configuration file, sets up logging, signals and the admin socket, starts the broker and
//! stops it gracefully. It holds no broker logic: an embedding application can do all of this
//! through the library.
//!
//! Dependencies, and why:
//! - `mercurio-core`: the broker itself (`Broker`, `BrokerHandle`) and the `Config` struct.
//! - `tokio`: the runtime the broker runs on; `tokio::signal` for SIGTERM, Ctrl+C and SIGHUP;
//!   the admin socket's Unix listener.
//! - `clap` (derive): the command line, `--help` and `--version` for free.
//! - `tracing`, `tracing-subscriber` (env-filter, fmt, reload): logs to stdout, a file or
//!   syslog, per-module levels, a filter replaced at runtime.
//! - `serde_json`: the admin socket's answers (the requests and the envelope are
//!   `mercurio_core::admin`'s); the configuration file is read by `mercurio_core::config_file`.
//! - `libc`: umask for the admin socket's bind; `mallopt`;
//!   `getrlimit`/`setrlimit` to raise the open files limit.
//! - `sd-notify`: systemd readiness, watchdog and stopping notifications (`Type=notify`).
//! - `tikv-jemallocator` (optional, feature `jemalloc`): jemalloc as the global allocator.
//! - `mercurio-storage`: the `sqlite` and `postgres` features (default) build the SQLite and
//!   PostgreSQL backends into the broker.
//! - `rusqlite`, `bytes` (tests only): reading the database a test's daemon writes; the test
//!   client's buffers.
//! - `tempfile` (tests only): configuration files and sockets in temp dirs.
//!
//! Not used, although they would fit: `syslog-tracing` (libc's syslog(3) always writes to
//! `/dev/log`; ours takes a test socket), `tracing-appender` (a blocking `O_APPEND` file is
//! enough and keeps each line whole), `tracing-journald` (under systemd standard output is the
//! journal; lines carry `<N>` severity prefixes).

mod admin;
mod cli;
mod line_output;
mod logging;
mod reload;
mod syslog;
mod systemd;

#[cfg(feature = "jemalloc")]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use mercurio_core::admin::socket_path;
use mercurio_core::config::{Config, ListenerConfig, ListenerProtocol};
use mercurio_core::config_file;
use mercurio_core::{Broker, BrokerHandle, Shards};
use tracing::{error, info, warn};

use crate::admin::{AdminSocket, Answering};
use crate::cli::Cli;
use crate::logging::LogControl;
use crate::reload::Reloader;

/// Exit status of a configuration error (sysexits.h EX_CONFIG); the systemd unit lists it in
/// RestartPreventExitStatus.
const EX_CONFIG: u8 = 78;

/// Exit status when the broker cannot start or stops on an error.
const EX_FAILURE: u8 = 1;

fn main() -> ExitCode {
    limit_malloc_arenas();
    let cli = Cli::parse();

    let config = match &cli.config {
        Some(path) => match config_file::load_with_ports(path, &cli.port) {
            Ok(config) => config,
            Err(e) => {
                eprintln!("mercuriod: {e}");
                return ExitCode::from(EX_CONFIG);
            }
        },
        None => {
            let mut config = Config::default();
            // The daemon polls by default; an embedding application's runtime does not.
            config.server.busy_poll = mercurio_core::config::DAEMON_BUSY_POLL;
            if !cli.port.is_empty() {
                config.listeners = cli
                    .port
                    .iter()
                    .map(|&port| ListenerConfig {
                        port,
                        ..ListenerConfig::default()
                    })
                    .collect();
            }
            if let Err(e) = config.validate() {
                eprintln!("mercuriod: default configuration: {e}");
                return ExitCode::from(EX_CONFIG);
            }
            config
        }
    };

    let mut config = config;
    if let Some(path) = &cli.admin_socket {
        config.admin.socket = Some(path.clone());
    }

    if cli.check_config {
        return check_config(&config, cli.config.as_deref(), cli.verbose);
    }

    let log = match logging::init(&config.logging, cli.verbose) {
        Ok(log) => log,
        Err(e) => {
            eprintln!("mercuriod: {e}");
            return ExitCode::from(EX_CONFIG);
        }
    };
    for warning in config_file::warnings(&config) {
        warn!("{warning}");
    }
    if let Some(path) = &cli.config {
        for warning in config_file::credential_warnings(path, &config) {
            warn!("{warning}");
        }
    }
    raise_open_files_limit();

    // One event loop by default: sockets are served in the order their data arrived. More
    // threads are more such loops (`Shards`), this one the first: a connection is served by
    // one loop at a time, and a message crosses threads only between connections on
    // different loops (a multi-threaded scheduler's workers woke each other for most messages).
    let built = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let runtime = match built {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("mercuriod: cannot start the runtime: {e}");
            return ExitCode::from(EX_FAILURE);
        }
    };
    let shards = if cli.threads > 1 {
        let _in_runtime = runtime.enter();
        match Shards::start(usize::from(cli.threads), cli.thread_placement) {
            Ok(shards) => Some(shards),
            Err(e) => {
                eprintln!("mercuriod: cannot start {} threads: {e}", cli.threads);
                return ExitCode::from(EX_FAILURE);
            }
        }
    } else {
        None
    };
    let code = runtime.block_on(serve(config, cli.config.clone(), log, shards.clone()));
    if let Some(shards) = shards {
        shards.stop();
    }
    // Tasks still running (a stopped broker's connections) are not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    code
}

/// `--check-config`: the configuration is valid (errors were reported before); print the
/// warnings and a one-line verdict.
fn check_config(config: &Config, path: Option<&Path>, verbose: bool) -> ExitCode {
    let (_, level_warning) = logging::filter(&config.logging, verbose);
    let credentials = path.map_or_else(Vec::new, |p| config_file::credential_warnings(p, config));
    for warning in level_warning
        .into_iter()
        .chain(config_file::warnings(config))
        .chain(credentials)
    {
        eprintln!("mercuriod: warning: {warning}");
    }
    if let Err(e) = mercurio_core::check_files(config) {
        eprintln!("mercuriod: {e}");
        return ExitCode::from(EX_CONFIG);
    }
    match path {
        Some(path) => println!("mercuriod: {}: configuration OK", path.display()),
        None => println!("mercuriod: no configuration file: defaults OK"),
    }
    ExitCode::SUCCESS
}

/// Starts the broker and the admin socket, reloads on SIGHUP, stops on SIGTERM or SIGINT.
async fn serve(
    config: Config,
    path: Option<PathBuf>,
    log: LogControl,
    shards: Option<Arc<Shards>>,
) -> ExitCode {
    info!("mercuriod {} starting", env!("CARGO_PKG_VERSION"));
    match &path {
        Some(path) => info!("configuration: {}", path.display()),
        None => {
            let addrs: Vec<String> = config
                .listeners
                .iter()
                .map(|l| format!("{}:{}", l.host, l.port))
                .collect();
            info!(
                "no configuration file: defaults ({}, anonymous clients)",
                addrs.join(", ")
            )
        }
    }

    // Before the broker starts, so that a signal during startup is not lost.
    let mut signals = match Signals::new() {
        Ok(signals) => signals,
        Err(e) => {
            eprintln!("mercuriod: cannot listen for signals: {e}");
            return ExitCode::from(EX_FAILURE);
        }
    };

    // An [admin] socket that cannot be bound stops the start; the default one only warns,
    // so that a second broker on the host (other ports, no [admin] socket) still runs.
    let admin = match &config.admin.socket {
        Some(path) => match AdminSocket::bind(path) {
            Ok(admin) => Some(admin),
            Err(e) => {
                error!("{e}");
                eprintln!("mercuriod: {e}");
                return ExitCode::from(EX_FAILURE);
            }
        },
        None => match AdminSocket::bind(&socket_path::default_socket_path()) {
            Ok(admin) => Some(admin),
            Err(e) => {
                warn!("{e}: running without an admin socket (give this broker its own: --admin-socket PATH or [admin] socket)");
                None
            }
        },
    };

    // What each listener speaks, for its "listening on" line (a plain client on a TLS port
    // gets no CONNACK; the log says which port is which).
    let kinds: Vec<String> = config
        .listeners
        .iter()
        .map(|l| {
            let protocol = match l.protocol {
                ListenerProtocol::Mqtt => "MQTT",
                ListenerProtocol::Websocket => "WebSocket",
            };
            let tls = if l.cert_file.is_some() {
                " over TLS"
            } else {
                ""
            };
            format!("{protocol}{tls}")
        })
        .collect();
    let standby = config.storage.standby;
    if standby {
        // A standby may wait long for the serving broker: systemd's start must not time out.
        systemd::ready("standby: waiting for the serving broker");
    }
    // Until the broker serves, mercurioctl is told so at once (instead of its 10 s wait).
    let not_yet: Arc<str> = if standby {
        Arc::from("mercuriod is a standby waiting for the serving broker: it does not serve yet")
    } else {
        Arc::from("mercuriod is starting: it does not serve yet")
    };
    let starting_answers = async {
        match &admin {
            Some(admin) => admin.serve(Answering::Starting(not_yet)).await,
            None => std::future::pending().await,
        }
    };
    let started = tokio::select! {
        started = start_broker(config, log.clone(), shards) => started,
        signal = wait_stop(&mut signals) => {
            info!("{signal} received while starting: stopping");
            return ExitCode::SUCCESS;
        }
        never = starting_answers => match never {},
    };
    let handle = match started {
        Ok(handle) => handle,
        Err(e @ (mercurio_core::Error::File(_) | mercurio_core::Error::Config(_))) => {
            // A password, ACL, certificate or key file, an http_dir, a storage path: a
            // configuration error (path, line), which restarting cannot mend.
            eprintln!("mercuriod: cannot start: {e}");
            return ExitCode::from(EX_CONFIG);
        }
        Err(e) => {
            eprintln!("mercuriod: cannot start: {e}");
            return ExitCode::from(EX_FAILURE);
        }
    };
    for (i, addr) in handle.local_addrs().into_iter().enumerate() {
        match kinds.get(i) {
            Some(kind) => info!("listening on {addr} ({kind})"),
            None => info!("listening on {addr}"),
        }
    }
    let admin_task = admin.map(|admin| {
        info!("admin socket: {}", admin.path().display());
        let (handle, log) = (handle.clone(), log.clone());
        tokio::spawn(async move { admin.serve(Answering::Broker(handle, log)).await })
    });
    systemd::ready("serving");
    systemd::spawn_watchdog();

    let reloader = Reloader::new(path, log, handle.clone());
    let signal = loop {
        tokio::select! {
            signal = signals.recv() => match signal {
                Signal::Reload => reloader.reload().await,
                Signal::Stop(name) => break name,
            },
            e = handle.failed() => {
                // Another broker took the database over, or it was unreachable too long: the
                // broker already stopped; exit at once, with an error (systemd restarts it,
                // as a standby with standby = true).
                error!("stopping at once: {e}");
                eprintln!("mercuriod: stopping at once: {e}");
                systemd::stopping();
                if let Some(task) = admin_task {
                    task.abort();
                    let _ = task.await;
                }
                return ExitCode::from(EX_FAILURE);
            }
        }
    };
    systemd::stopping();
    info!("{signal} received: disconnecting clients and stopping");
    let code = loop {
        tokio::select! {
            () = handle.shutdown() => {
                info!("stopped");
                break ExitCode::SUCCESS;
            }
            signal = signals.recv() => match signal {
                Signal::Reload => info!("SIGHUP ignored: stopping"),
                Signal::Stop(signal) => {
                    warn!("{signal} received again: exiting without waiting for clients");
                    break ExitCode::from(EX_FAILURE);
                }
            },
        }
    };
    // Dropping the task drops the socket, which removes its file.
    if let Some(task) = admin_task {
        task.abort();
        let _ = task.await;
    }
    code
}

/// The broker's start, behind one function: the daemon's only call into the broker's
/// construction (the embedding API, docs/embedding.md). The remote admin API answers through
/// the admin socket's code (`admin::Handler`).
///
/// The broker always logs the connection lines: `connection_messages = false` turns their
/// target off in the log filter instead, so that a level naming `mercurio::connections`, in the
/// file or from `mercurioctl broker log-level`, turns them back on (docs/operations.md, "Logging").
async fn start_broker(
    mut config: Config,
    log: LogControl,
    shards: Option<Arc<Shards>>,
) -> Result<BrokerHandle, mercurio_core::Error> {
    config.logging.connection_messages = true;
    let builder = Broker::builder(config).admin_handler(admin::Handler { log });
    match shards {
        Some(shards) => builder.shards(shards),
        None => builder,
    }
    .start()
    .await
}

/// Waits for SIGTERM or SIGINT (SIGHUP is ignored), naming it.
async fn wait_stop(signals: &mut Signals) -> &'static str {
    loop {
        if let Signal::Stop(name) = signals.recv().await {
            return name;
        }
    }
}

/// What a signal asks for.
enum Signal {
    /// SIGTERM, SIGINT (Ctrl+C): stop gracefully. Names the signal.
    Stop(&'static str),
    /// SIGHUP: reread what can change at runtime.
    Reload,
}

/// SIGTERM, SIGINT and SIGHUP.
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

    /// Waits for the next signal.
    #[cfg(unix)]
    async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.terminate.recv() => Signal::Stop("SIGTERM"),
            _ = self.interrupt.recv() => Signal::Stop("SIGINT"),
            _ = self.hangup.recv() => Signal::Reload,
        }
    }

    #[cfg(not(unix))]
    async fn recv(&mut self) -> Signal {
        let _ = tokio::signal::ctrl_c().await;
        Signal::Stop("Ctrl+C")
    }
}

/// On glibc, at most two malloc arenas: with one per thread (the default), memory freed under
/// load stays with its thread and the process grows and stays high (docs/operations.md, "Memory").
/// `MALLOC_ARENA_MAX` in the environment still wins. Not with the `jemalloc` feature.
#[cfg(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc")))]
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

#[cfg(not(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc"))))]
fn limit_malloc_arenas() {}

/// Raises the soft limit on open files to the hard one: each client holds a descriptor, and
/// the usual soft limit of 1,024 would refuse connections long before a fleet's 15,000
/// (accept fails with "too many open files"). The systemd unit sets `LimitNOFILE` too.
fn raise_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 || limit.rlim_cur >= limit.rlim_max
        {
            return;
        }
        let soft = limit.rlim_cur;
        limit.rlim_cur = limit.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
            tracing::debug!(
                from = soft,
                to = limit.rlim_max,
                "raised the open files limit"
            );
        }
    }
}
