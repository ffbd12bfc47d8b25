//! The command line.

use std::path::PathBuf;

use clap::Parser;
use mercurio_core::Placement;

/// Text after the options in `mercuriod --help`.
const AFTER_HELP: &str = "\
Without --config, mercuriod listens on 127.0.0.1:1883 only (-p PORT for another port), allows
anonymous clients and keeps everything in memory. With a file, [auth] allow_anonymous must be set to true for clients
without credentials to connect (as in mosquitto 2), and a file without [[listeners]] listens on
127.0.0.1:1883 (or -p PORT). A mosquitto.conf is recognised and refused: convert it with
mercurioctl config import-mosquitto mosquitto.conf > mercuriod.toml.

TLS: a listener with cert_file and key_file (PEM) speaks MQTT over TLS 1.2 and 1.3; ca_file
checks client certificates, require_certificate refuses clients without one, and
use_identity_as_username makes the certificate's common name the user name. [auth]
password_file is a mosquitto_passwd file ($6$, $7$ and argon2id hashes; mercurioctl passwd
adds users), acl_file a mosquitto ACL file; derived_password_secret_file with
derived_user_pattern accepts matching user names whose password is hex(HMAC-SHA256(secret,
user)) (mercurioctl auth derive USER prints it). SIGHUP reloads the password file, the ACL
file, the secret and the certificates without disconnecting clients; a file that cannot be read
keeps its previous contents and the error is logged.

Fleets: a listener's proxy_protocol (\"v1\", \"v2\", \"optional\") reads a load balancer's
PROXY header (from proxy_from, default loopback) for the client's address;
max_connection_rate and max_connection_burst pace reconnect storms. Health listeners answer
/livez and /readyz for orchestrators' probes.

CPU: the event loop sleeps between packets. [server] busy_poll (microseconds, 0 = off, the
default) makes it poll its sockets instead while packets come close together and it is busy
at least half the time: CPU time for latency near saturation. See docs/operations.md, \"CPU\".

Storage: [storage] backend = \"memory\" (default), \"sqlite\" (path) or \"postgres\" (url; one
broker serves a database, standby = true waits and takes over when it stops).

Bridges: each [[bridges]] table connects to another broker as a client (addresses tried in
order, TLS with cafile/certfile/keyfile, protocol_version \"mqttv311\" or \"mqttv5\") and
forwards its [[bridges.topics]] out, in or both ways; what waits for the remote is kept in
[storage]. $SYS/broker/connection/<client_id>/state says 1 or 0; mercurioctl bridge list.

Logging: to standard output (the journal under systemd), or to [logging] file (appended; rotate
with logrotate's copytruncate) and/or syslog (/dev/log, facility daemon). [logging] level takes
per-module directives, e.g. \"info,mercurio::connections=off\".

Admin socket: --admin-socket PATH, else [admin] socket, else $RUNTIME_DIRECTORY/mercuriod.sock under systemd,
/run/mercurio/mercuriod.sock as root, $XDG_RUNTIME_DIR/mercurio/mercuriod.sock, or
/tmp/mercurio-$UID/mercuriod.sock; mode 0600. See mercurioctl --help.

Signals: SIGTERM or Ctrl+C disconnects every client (MQTT 5: DISCONNECT 0x8B, server shutting
down), waits up to 5 s for connections to close and exits 0; a second one exits at once (1).
SIGHUP rereads the configuration file and applies the log level, connection_messages, the
password, ACL and TLS files, and the bridges (added, removed or changed ones start, stop or
restart; the others keep running).
Under systemd (Type=notify) readiness is reported once the listeners are bound.

Exit status: 0 after a clean stop or a valid --check-config, 1 when the broker cannot start
(e.g. a port in use), 2 for a command line error, 78 (EX_CONFIG) for a configuration error (including a password, ACL,
certificate or key file that cannot be used).

Every configuration key: docs/configuration.md. Running the broker: docs/operations.md.";

/// mercuriod, the Mercurio MQTT broker (MQTT 3.1, 3.1.1 and 5.0).
#[derive(Debug, Parser)]
#[command(name = "mercuriod", version, about, after_help = AFTER_HELP)]
pub struct Cli {
    /// Configuration file (TOML). Without it: 127.0.0.1:1883, anonymous clients allowed.
    #[arg(short, long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Listen on 127.0.0.1:PORT instead of 127.0.0.1:1883 (as mosquitto -p; 0 picks a free
    /// port, logged); may be repeated. With --config, only for a file without [[listeners]].
    #[arg(short, long, value_name = "PORT")]
    pub port: Vec<u16>,

    /// Admin socket for mercurioctl (its --socket), over [admin] socket: a second broker on
    /// the same host needs its own.
    #[arg(long, value_name = "PATH")]
    pub admin_socket: Option<PathBuf>,

    /// Log at debug level, whatever [logging] level says.
    #[arg(short, long)]
    pub verbose: bool,

    /// Check the configuration, print the result and exit: 0 if valid, 78 if not.
    #[arg(long)]
    pub check_config: bool,

    /// Threads serving clients (1 to 256). 1 (the default): one event loop, which handles
    /// sockets in the order their data arrived, as mosquitto does. More: that many event
    /// loops, one per thread, each connection served by one of them (see
    /// --thread-placement); packets that arrive together on connections of different loops
    /// may be handled in either order, and [server] busy_poll does not apply.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,

    /// With --threads above 1, where connections go. fill (the default): to the first thread
    /// that is not busy (under 60 % of a core), so that a load one core carries stays on one
    /// thread and costs what it costs with --threads 1; a thread over 85 % hands connections
    /// on to one under 50 %, one at a time. spread: to each thread in turn, every thread
    /// serving from the start, at the cost of messages crossing threads (more CPU per
    /// message below saturation).
    #[arg(long, value_name = "fill|spread", default_value = "fill", value_parser = parse_placement)]
    pub thread_placement: Placement,
}

/// `--thread-placement`: `fill` or `spread`.
fn parse_placement(s: &str) -> Result<Placement, String> {
    match s {
        "fill" => Ok(Placement::Fill),
        "spread" => Ok(Placement::Spread),
        _ => Err(format!("`{s}`: fill or spread")),
    }
}
