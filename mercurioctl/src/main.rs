//! `mercurioctl`, the admin CLI of a running mercuriod: one request over the admin Unix socket
//! (one JSON object per line: `mercurio_core::admin`'s `Request`, serialised), the answer printed
//! for people or, with `--json`, as JSON for scripts.
//!
//! `mercurioctl passwd FILE USER` works on a password file, `mercurioctl auth derive USER`
//! prints a derived password and `mercurioctl config import-mosquitto FILE` converts a
//! mosquitto.conf; none needs a running broker.
//!
//! Dependencies, and why:
//! - `clap` (derive): the command line, usage errors, `--help` and `--version`.
//! - `serde_json`: the admin socket's JSON answers.
//! - `toml`: `-c FILE` reads `[admin] socket` from the broker's configuration file.
//! - `libc` (tests only): signals to the test's broker.
//! - `tempfile` (tests only): sockets and configuration files in temp dirs.
//! - `mercurio-core`: the admin protocol (`admin::Request`, `admin::Answer`) and the default
//!   socket path with its owner check (`admin::socket_path`), shared with mercuriod; the
//!   password file format and its argon2id hashing (`passwd`); mercuriod's configuration reader
//!   (`config_file`), which checks what `config import-mosquitto` converts with mercuriod's own
//!   messages; the log targets `broker log-level --help` lists (`config::log_targets`).
//! - `rpassword`: reads a password from the terminal without echo (`passwd`).

mod access;
mod config_import;
mod derive;
mod import_mosquitto;
mod mosquitto_conf;
mod passwd;

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use mercurio_core::admin::{socket_path, Answer, ErrorCode, Request};
use mercurio_core::config::log_targets;
use serde_json::Value;

/// How long to wait for the broker's answer.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The broker refused the request (no such client, invalid level...).
const EXIT_REFUSED: u8 = 1;
/// The broker could not be reached: not running, stale socket, no answer (EX_UNAVAILABLE).
const EXIT_UNAVAILABLE: u8 = 69;
/// Permission denied, or a socket path refused: not a socket, another user's (EX_NOPERM).
const EXIT_NOPERM: u8 = 77;
/// `-c FILE` cannot be read or has no valid `[admin] socket` (EX_CONFIG).
const EXIT_CONFIG: u8 = 78;

const AFTER_HELP: &str = "\
The socket: --socket PATH, else [admin] socket of the broker's configuration file given with
-c FILE, else the default, as mercuriod picks it: $RUNTIME_DIRECTORY/mercuriod.sock (under
systemd), /run/mercurio/mercuriod.sock as root, $XDG_RUNTIME_DIR/mercurio/mercuriod.sock,
/tmp/mercurio-$UID/mercuriod.sock. The socket has mode 0600: run mercurioctl as the broker's
user or as root. A socket that belongs to another user is refused (except by root).

Exit status: 0 on success; 1 when the broker refuses (no such client, invalid level, client
connected); 2 for a usage error; 69 when the broker is not running, does not answer or does
not serve yet (starting, or a standby waiting); 77 for permission denied or a refused socket
path; 78 when -c FILE cannot be used. Errors are one line on standard error.

Examples:
  mercurioctl broker status
  mercurioctl broker log-level 'info,mercurio::connections=off'
  mercurioctl --json client list
  mercurioctl client disconnect sensor-12
  mercurioctl client delete-session sensor-12
  mercurioctl bridge list
  mercurioctl bridge show cloud
  mercurioctl user add sensor-12
  mercurioctl role create sensors; mercurioctl acl add sensors readwrite 'sensors/%u/#'
  mercurioctl group create fleet; mercurioctl group add-role fleet sensors
  mercurioctl group add-user fleet sensor-12

mercurioctl passwd FILE USER adds a user to a password file or changes its password (argon2id;
no running broker needed); then send mercuriod SIGHUP to reload it.

mercurioctl user add USER asks for a password (or reads it from standard input with --stdin)
and adds USER to the running broker's storage ([auth] backend = \"storage\"): groups, roles and
acl rules are managed the same way (group create|add-user|add-role, role create, acl add ROLE
read|write|readwrite|deny TOPIC) and apply at once, to connected clients too. auth import
--password-file FILE --acl-file FILE loads mosquitto's files into it.

mercurioctl auth derive USER prints USER's derived password ([auth] derived_user_pattern) from
the secret file given with --secret-file FILE or named by -c FILE (no running broker needed).

mercurioctl config import-mosquitto /etc/mosquitto/mosquitto.conf > mercuriod.toml converts a
mosquitto configuration (include_dir files too); lines it cannot carry over are listed, with
the reason, in a comment at the top, except security settings: one that cannot be carried over
(it would make a TLS bridge plaintext, or let in clients mosquitto refused) fails the
conversion, naming the line.";

/// mercurioctl, the admin CLI of a running mercuriod (Mercurio MQTT broker).
#[derive(Debug, Parser)]
#[command(name = "mercurioctl", version, about, after_help = AFTER_HELP)]
struct Cli {
    /// The admin socket of the broker.
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,

    /// Read the socket path from the broker's configuration file ([admin] socket).
    #[arg(
        short = 'c',
        long = "config",
        global = true,
        value_name = "FILE",
        conflicts_with = "socket"
    )]
    config: Option<PathBuf>,

    /// Print the answer as JSON (for scripts).
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The broker as a whole.
    #[command(subcommand)]
    Broker(BrokerCommand),
    /// Clients and their sessions.
    #[command(subcommand)]
    Client(ClientCommand),
    /// Bridges to other brokers: state, queue and counters.
    #[command(subcommand)]
    Bridge(BridgeCommand),
    /// Streams ([[streams]]): messages and bytes held, offsets, readers, what retention removed.
    #[command(subcommand)]
    Stream(StreamCommand),
    /// Cluster mode ([cluster]): the nodes as this one sees them.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Add a user to a password file or change its password (needs no running broker).
    Passwd(passwd::Passwd),
    /// Configuration files (need no running broker).
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Authentication helpers: derive needs no running broker; import loads files into the
    /// running broker's storage.
    #[command(subcommand)]
    Auth(AuthCommand),
    /// Users kept in the broker's storage ([auth] backend = "storage").
    #[command(subcommand)]
    User(access::UserCommand),
    /// Groups of users: each gives its users its roles.
    #[command(subcommand)]
    Group(access::GroupCommand),
    /// Roles: named lists of access rules, given to users and groups.
    #[command(subcommand)]
    Role(access::RoleCommand),
    /// The access rules of a role.
    #[command(subcommand)]
    Acl(access::AclCommand),
    /// `broker status` under the name people try first (hidden from --help).
    #[command(hide = true)]
    Status,
}

#[derive(Debug, Subcommand)]
enum AuthCommand {
    /// Print USER's derived password ([auth] derived_user_pattern): lowercase hex of
    /// HMAC-SHA256 keyed with the secret file (--secret-file, else [auth]
    /// derived_password_secret_file of -c FILE) without one trailing newline.
    Derive(derive::Derive),
    /// Load a password file and an ACL file (mosquitto's formats) into the running broker's
    /// storage ([auth] backend = "storage"); running it again changes nothing more.
    Import(access::Import),
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Print a mosquitto.conf as an equivalent mercuriod TOML configuration, with a comment
    /// for each line that cannot be carried over and why. Exit status 0 when the result passes
    /// mercuriod --check-config (the files it names aside), 1 when it does not (printed
    /// anyway), 78 when FILE cannot be read, holds a value mosquitto refuses too, or holds a
    /// security setting that cannot be carried over (a TLS-PSK listener or bridge,
    /// bridge_capath, an authentication plugin...: nothing is printed, the error names the
    /// line and what to write instead).
    ImportMosquitto(config_import::ImportMosquitto),
}

#[derive(Debug, Subcommand)]
enum BrokerCommand {
    /// Version, uptime, clients connected, sessions, storage, log level.
    Status,
    /// Change the running broker's log level until it restarts (or SIGHUP rereads the file),
    /// e.g. debug, or info,mercurio::connections=off. A directive naming a target none of
    /// those below is applied with a warning.
    #[command(after_help = log_targets::help())]
    LogLevel {
        /// A level or per-module directives, as [logging] level.
        level: String,
    },
}

#[derive(Debug, Subcommand)]
enum ClientCommand {
    /// Every session, connected or not.
    List,
    /// One session in detail: state, subscriptions, queue, expiry.
    Show {
        /// Client identifier.
        client_id: String,
    },
    /// Close a client's connection (MQTT 5 clients get DISCONNECT 0x98, Administrative
    /// action); its session stays as its expiry says.
    Disconnect {
        /// Client identifier.
        client_id: String,
    },
    /// End the session of a client that is not connected (its queue and subscriptions are
    /// dropped, a pending will is published). Refused for a connected client: disconnect it
    /// first.
    DeleteSession {
        /// Client identifier.
        client_id: String,
    },
}

#[derive(Debug, Subcommand)]
enum BridgeCommand {
    /// Every configured bridge: connected or not, queued messages, messages forwarded.
    List,
    /// One bridge in detail: addresses, last error, counters.
    Show {
        /// The bridge's name ([[bridges]] name).
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Every node known (this one first): its state (connected or degraded for this node, up
    /// or gone for the others), clients, sessions, version, when it connected to NATS and
    /// when its last heartbeat came; then the totals over the nodes up. Fails (exit 1) when
    /// cluster mode is off.
    Status,
}

#[derive(Debug, Subcommand)]
enum StreamCommand {
    /// Every stream: messages and bytes held, first and last offsets, readers.
    List,
    /// One stream in detail: filter, bounds, what it holds, what retention removed.
    Show {
        /// The stream's name ([[streams]] name).
        name: String,
    },
    /// Create a stream while the broker runs, kept across restarts when the broker has
    /// storage (SQLite, PostgreSQL); it takes the messages published from now on.
    Create {
        /// The stream's name: letters, digits, '_', '-', '.'.
        name: String,
        /// The MQTT topic filter of the messages it takes, e.g. 'tenants/a/#'.
        filter: String,
        /// Seconds a message stays; 0 = no limit.
        #[arg(long, value_name = "SECONDS", default_value_t = 0)]
        max_age: u64,
        /// Bytes the stream holds at most (the oldest messages go first); 0 = no limit.
        #[arg(long, value_name = "BYTES", default_value_t = 0)]
        max_bytes: u64,
        /// Keep only the newest message of each topic.
        #[arg(long)]
        last_value: bool,
    },
    /// Delete a stream created with `stream create` (with its messages); a stream of the
    /// configuration file is removed there instead.
    Delete {
        /// The stream's name.
        name: String,
    },
}

/// A failure: the exit status and its one-line reason.
struct Failure(u8, String);

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Passwd(p) = &cli.command {
        return p.run();
    }
    if let Command::Config(ConfigCommand::ImportMosquitto(i)) = &cli.command {
        return i.run();
    }
    if let Command::Auth(AuthCommand::Derive(d)) = &cli.command {
        return d.run(cli.config.as_deref());
    }
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(code, message)) => {
            eprintln!("mercurioctl: {message}");
            ExitCode::from(code)
        }
    }
}

fn run(cli: &Cli) -> Result<(), Failure> {
    let socket = socket(cli)?;
    let request = match &cli.command {
        Command::Broker(BrokerCommand::Status) | Command::Status => Request::Status,
        Command::Broker(BrokerCommand::LogLevel { level }) => Request::LogLevel {
            level: level.clone(),
        },
        Command::Client(ClientCommand::List) => Request::ClientList,
        Command::Bridge(BridgeCommand::List) => Request::BridgeList,
        Command::Bridge(BridgeCommand::Show { name }) => Request::BridgeShow { name: name.clone() },
        Command::Stream(StreamCommand::List) => Request::StreamList,
        Command::Stream(StreamCommand::Show { name }) => Request::StreamShow { name: name.clone() },
        Command::Stream(StreamCommand::Create {
            name,
            filter,
            max_age,
            max_bytes,
            last_value,
        }) => Request::StreamCreate {
            name: name.clone(),
            filter: filter.clone(),
            max_age: *max_age,
            max_bytes: *max_bytes,
            last_value: *last_value,
        },
        Command::Stream(StreamCommand::Delete { name }) => {
            Request::StreamDelete { name: name.clone() }
        }
        Command::Cluster(ClusterCommand::Status) => Request::ClusterStatus,
        Command::Client(ClientCommand::Show { client_id }) => Request::ClientShow {
            client_id: client_id.clone(),
        },
        Command::Client(ClientCommand::Disconnect { client_id }) => Request::ClientDisconnect {
            client_id: client_id.clone(),
        },
        Command::Client(ClientCommand::DeleteSession { client_id }) => {
            Request::ClientDeleteSession {
                client_id: client_id.clone(),
            }
        }
        Command::User(c) => access::user_request(c).map_err(|e| Failure(EXIT_REFUSED, e))?,
        Command::Group(c) => access::group_request(c),
        Command::Role(c) => access::role_request(c),
        Command::Acl(c) => access::acl_request(c),
        Command::Auth(AuthCommand::Import(i)) => return import(cli, &socket, i),
        // Handled in main: they need no broker.
        Command::Passwd(_) | Command::Config(_) | Command::Auth(_) => return Ok(()),
    };
    let result = ask(&socket, &request)?;
    if cli.json {
        println!("{result}");
        return Ok(());
    }
    match &cli.command {
        Command::User(_) | Command::Group(_) | Command::Role(_) | Command::Acl(_) => {
            print!("{}", access::human(&request, &result))
        }
        _ => print!("{}", human(&cli.command, &result, &socket)),
    }
    Ok(())
}

/// `auth import`: the requests one by one; what exists already is kept (a user gets the
/// file's hash), a rule for a user that is not stored is skipped with a warning.
fn import(cli: &Cli, socket: &Path, i: &access::Import) -> Result<(), Failure> {
    let (steps, warnings) = access::import_steps(i).map_err(|e| Failure(EXIT_CONFIG, e))?;
    for w in &warnings {
        eprintln!("mercurioctl: warning: {w}");
    }
    let (mut done, mut kept, mut skipped) = (0u32, 0u32, 0u32);
    for step in steps {
        match exchange(socket, &step.request)? {
            Answer::Ok(_) => done += 1,
            Answer::Refused {
                code: ErrorCode::Conflict,
                ..
            } => match &step.on_conflict {
                Some(again) => match exchange(socket, again)? {
                    Answer::Ok(_) => done += 1,
                    Answer::Refused { error, code } => return Err(refusal(code, error)),
                },
                None => kept += 1,
            },
            Answer::Refused {
                code: ErrorCode::NotFound,
                error,
            } => {
                eprintln!("mercurioctl: warning: skipped: {error}");
                skipped += 1;
            }
            Answer::Refused { error, code } => return Err(refusal(code, error)),
        }
    }
    if cli.json {
        println!(
            "{}",
            serde_json::json!({"changed": done, "kept": kept, "skipped": skipped})
        );
    } else {
        println!("imported: {done} applied, {kept} already stored, {skipped} skipped");
    }
    Ok(())
}

/// The socket path: `--socket`, `-c FILE`'s `[admin] socket`, or the default.
fn socket(cli: &Cli) -> Result<PathBuf, Failure> {
    if let Some(path) = &cli.socket {
        return Ok(path.clone());
    }
    if let Some(file) = &cli.config {
        return socket_from_config(file).map_err(|e| Failure(EXIT_CONFIG, e));
    }
    Ok(socket_path::default_socket_path())
}

/// `[admin] socket` in the broker's configuration file, or the default when it has none.
fn socket_from_config(file: &Path) -> Result<PathBuf, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("{}: cannot read: {e}", file.display()))?;
    let doc: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| format!("{}: {}", file.display(), e.message()))?;
    match doc.get("admin").and_then(|a| a.get("socket")) {
        None => Ok(socket_path::default_socket_path()),
        Some(toml::Value::String(s)) => Ok(PathBuf::from(s)),
        Some(_) => Err(format!(
            "{}: admin.socket: must be a string (a path)",
            file.display()
        )),
    }
}

/// Sends one request, returns the answer's result or the broker's reason as a failure.
fn ask(path: &Path, request: &Request) -> Result<Value, Failure> {
    match exchange(path, request)? {
        Answer::Ok(result) => Ok(result),
        Answer::Refused { error, code } => Err(refusal(code, error)),
    }
}

/// The failure of a refused request: exit status 1, or 69 when the broker does not serve
/// yet (starting, or a standby waiting), as when no broker answers.
fn refusal(code: ErrorCode, error: String) -> Failure {
    match code {
        ErrorCode::Unavailable => Failure(EXIT_UNAVAILABLE, error),
        _ => Failure(EXIT_REFUSED, error),
    }
}

/// Sends one request, returns the broker's answer.
fn exchange(path: &Path, request: &Request) -> Result<Answer, Failure> {
    let shown = path.display();
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Err(Failure(
                EXIT_UNAVAILABLE,
                format!("mercuriod is not running (no socket at {shown})"),
            ))
        }
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            return Err(Failure(
                EXIT_NOPERM,
                format!("permission denied: {shown} (run as the broker's user or root)"),
            ))
        }
        Err(e) => return Err(Failure(EXIT_UNAVAILABLE, format!("{shown}: {e}"))),
        Ok(_) => {}
    }
    socket_path::check_existing(path, true).map_err(|e| Failure(EXIT_NOPERM, e))?;
    let stream = UnixStream::connect(path).map_err(|e| match e.kind() {
        ErrorKind::ConnectionRefused => Failure(
            EXIT_UNAVAILABLE,
            format!("mercuriod is not running ({shown} refuses connections: a stale socket)"),
        ),
        ErrorKind::PermissionDenied => Failure(
            EXIT_NOPERM,
            format!("permission denied: {shown} (run as the broker's user or root)"),
        ),
        _ => Failure(EXIT_UNAVAILABLE, format!("cannot connect to {shown}: {e}")),
    })?;
    let unavailable = |e: std::io::Error| {
        let why = if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            format!("no answer within {} s", TIMEOUT.as_secs())
        } else {
            e.to_string()
        };
        Failure(EXIT_UNAVAILABLE, format!("mercuriod on {shown}: {why}"))
    };
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(unavailable)?;
    stream
        .set_write_timeout(Some(TIMEOUT))
        .map_err(unavailable)?;
    let mut line = request.to_line();
    line.push('\n');
    (&stream).write_all(line.as_bytes()).map_err(unavailable)?;
    let mut answer = String::new();
    BufReader::new(&stream)
        .read_line(&mut answer)
        .map_err(unavailable)?;
    if answer.is_empty() {
        return Err(Failure(
            EXIT_UNAVAILABLE,
            format!("mercuriod on {shown} closed the connection without answering"),
        ));
    }
    let answer: Value = serde_json::from_str(&answer).map_err(|e| {
        Failure(
            EXIT_UNAVAILABLE,
            format!("mercuriod on {shown}: unreadable answer: {e}"),
        )
    })?;
    Ok(Answer::from_json(&answer))
}

/// The answer for people.
fn human(command: &Command, result: &Value, socket: &Path) -> String {
    match command {
        Command::Broker(BrokerCommand::Status) | Command::Status => status(result, socket),
        Command::Broker(BrokerCommand::LogLevel { .. }) => match result["warning"].as_str() {
            Some(w) => format!("log level: {}\nwarning: {w}\n", text(&result["level"])),
            None => format!("log level: {}\n", text(&result["level"])),
        },
        Command::Client(ClientCommand::List) => list(result),
        Command::Bridge(BridgeCommand::List) => bridge_list(result),
        Command::Bridge(BridgeCommand::Show { .. }) => bridge_show(result),
        Command::Stream(StreamCommand::List) => stream_list(result),
        Command::Stream(StreamCommand::Show { .. }) => stream_show(result),
        Command::Stream(StreamCommand::Create {
            max_bytes,
            last_value,
            ..
        }) => {
            let mut out = stream_show(result);
            // As mercuriod warns for such a stream of its configuration file.
            if *max_bytes == 0 && !*last_value {
                out.push_str(
                    "warning: no --max-bytes: the stream grows with what is published to its \
                     filter (on disk with storage, in memory without)\n",
                );
            }
            out
        }
        Command::Stream(StreamCommand::Delete { name }) => format!("deleted the stream {name}\n"),
        Command::Cluster(ClusterCommand::Status) => cluster_status(result),
        Command::Client(ClientCommand::Show { .. }) => show(result),
        Command::Client(ClientCommand::Disconnect { client_id }) => {
            format!("disconnected {client_id}\n")
        }
        Command::Client(ClientCommand::DeleteSession { client_id }) => {
            format!("deleted the session of {client_id}\n")
        }
        Command::Passwd(_)
        | Command::Config(_)
        | Command::Auth(_)
        | Command::User(_)
        | Command::Group(_)
        | Command::Role(_)
        | Command::Acl(_) => String::new(),
    }
}

/// A JSON value as text: strings without quotes.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_string(),
        other => other.to_string(),
    }
}

/// "1 message", "2 messages" (`-` when the broker did not say).
fn messages(v: &Value) -> String {
    v.as_u64()
        .map_or_else(|| "-".to_string(), |n| counted(n, "message"))
}

/// `1 node`, `2 nodes`: a count with its noun.
fn counted(n: u64, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        n => format!("{n} {noun}s"),
    }
}

fn duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m {s}s"),
        _ => format!("{d}d {h}h {m}m {s}s"),
    }
}

/// `broker status` for people; the socket asked comes last, since the default one is shared
/// by every mercuriod of the same user on the host.
fn status(r: &Value, socket: &Path) -> String {
    let listeners: Vec<String> = r["listeners"]
        .as_array()
        .map(|a| a.iter().map(text).collect())
        .unwrap_or_default();
    format!(
        "version     {}\nuptime      {}\nclients     {} connected (peak {})\nsessions    {} ({} disconnected)\nstorage     {} ({})\nlog level   {}\nlisteners   {}\nsocket      {}\n",
        text(&r["version"]),
        duration(r["uptime_secs"].as_u64().unwrap_or(0)),
        text(&r["clients_connected"]),
        text(&r["clients_maximum"]),
        text(&r["sessions"]),
        text(&r["sessions_disconnected"]),
        text(&r["storage"]["backend"]),
        text(&r["storage"]["state"]),
        text(&r["log_level"]),
        listeners.join(", "),
        socket.display(),
    )
}

fn state(connected: &Value) -> &'static str {
    if connected.as_bool() == Some(true) {
        "connected"
    } else {
        "disconnected"
    }
}

fn protocol(level: &Value) -> &'static str {
    match level.as_u64() {
        Some(3) => "3.1",
        Some(4) => "3.1.1",
        Some(5) => "5.0",
        _ => "?",
    }
}

fn list(r: &Value) -> String {
    let clients = r["clients"].as_array().cloned().unwrap_or_default();
    if clients.is_empty() {
        return "no sessions\n".to_string();
    }
    let width = clients
        .iter()
        .map(|c| text(&c["client_id"]).chars().count())
        .max()
        .unwrap_or(0)
        .max("CLIENT ID".len());
    let mut out = format!(
        "{:<width$}  {:<12}  {:<8}  {:>13}  {:>6}  {:>8}\n",
        "CLIENT ID", "STATE", "PROTOCOL", "SUBSCRIPTIONS", "QUEUED", "INFLIGHT"
    );
    for c in &clients {
        out.push_str(&format!(
            "{:<width$}  {:<12}  {:<8}  {:>13}  {:>6}  {:>8}\n",
            text(&c["client_id"]),
            state(&c["connected"]),
            protocol(&c["protocol_level"]),
            text(&c["subscriptions"]),
            text(&c["queued"]),
            text(&c["inflight"]),
        ));
    }
    out
}

fn bridge_list(r: &Value) -> String {
    let bridges = r["bridges"].as_array().cloned().unwrap_or_default();
    if bridges.is_empty() {
        return "no bridges\n".to_string();
    }
    let width = bridges
        .iter()
        .map(|b| text(&b["name"]).chars().count())
        .max()
        .unwrap_or(0)
        .max("NAME".len());
    let mut out = format!(
        "{:<width$}  {:<12}  {:>7}  {:>8}  {:>9}  {:>8}  {:>10}  ADDRESS\n",
        "NAME", "STATE", "QUEUED", "DROPPED", "SENT", "RECEIVED", "RECONNECTS"
    );
    for b in &bridges {
        out.push_str(&format!(
            "{:<width$}  {:<12}  {:>7}  {:>8}  {:>9}  {:>8}  {:>10}  {}\n",
            text(&b["name"]),
            state(&b["connected"]),
            text(&b["queued"]),
            text(&b["dropped"]),
            text(&b["forwarded_out"]),
            text(&b["forwarded_in"]),
            text(&b["reconnects"]),
            text(&b["address"]),
        ));
    }
    out
}

/// `cluster status` for people: one line per node, then the totals.
fn cluster_status(r: &Value) -> String {
    use mercurio_core::admin::NodeState;
    let status: mercurio_core::admin::ClusterStatus = match serde_json::from_value(r.clone()) {
        Ok(s) => s,
        Err(e) => return format!("an answer this version cannot read ({e}):\n{r}\n"),
    };
    let width = status
        .members
        .iter()
        .map(|n| n.node.chars().count() + 2)
        .max()
        .unwrap_or(0)
        .max("NODE".len());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut out = format!(
        "{:<width$}  {:<9}  {:>8}  {:>8}  {:<10}  {:>15}  {:>10}\n",
        "NODE", "STATE", "CLIENTS", "SESSIONS", "VERSION", "NATS FOR", "HEARTBEAT"
    );
    for n in &status.members {
        let name = if n.this {
            format!("{} *", n.node)
        } else {
            n.node.clone()
        };
        let nats_for = match n.connected_since {
            Some(t) if matches!(n.state, NodeState::Connected | NodeState::Up) => {
                format!("{} s", now.saturating_sub(t))
            }
            _ => "-".to_string(),
        };
        let heartbeat = match n.last_heartbeat_ms {
            Some(ms) => format!("{:.1} s ago", ms as f64 / 1000.0),
            None => "-".to_string(),
        };
        out.push_str(&format!(
            "{:<width$}  {:<9}  {:>8}  {:>8}  {:<10}  {:>15}  {:>10}\n",
            name,
            n.state.as_str(),
            n.clients,
            n.sessions,
            n.version,
            nats_for,
            heartbeat,
        ));
    }
    out.push_str(&format!(
        "\n* this node ({}), {}\n{} up, {} on {}\n",
        status.node,
        if status.state == NodeState::Degraded {
            "degraded: NATS unreachable; it serves its own clients, messages for other nodes wait"
        } else {
            "connected to NATS"
        },
        counted(status.nodes as u64, "node"),
        counted(status.clients as u64, "client"),
        if status.nodes == 1 { "it" } else { "them" },
    ));
    out.push_str(&format!(
        "waiting for JetStream: {} ({} bytes)\n",
        counted(status.jetstream_pending_messages, "message"),
        status.jetstream_pending_bytes,
    ));
    match status.registry_sessions {
        Some(n) => out.push_str(&format!(
            "session registry: {} owned by this node\n",
            counted(n, "session")
        )),
        None => out.push_str("session registry: off (jetstream = false)\n"),
    }
    out
}

fn stream_list(r: &Value) -> String {
    let streams = r["streams"].as_array().cloned().unwrap_or_default();
    if streams.is_empty() {
        return "no streams\n".to_string();
    }
    let width = streams
        .iter()
        .map(|s| text(&s["name"]).chars().count())
        .max()
        .unwrap_or(0)
        .max("NAME".len());
    let mut out = format!(
        "{:<width$}  {:>9}  {:>11}  {:>12}  {:>12}  {:>7}  FILTER\n",
        "NAME", "MESSAGES", "BYTES", "FIRST", "LAST", "READERS"
    );
    for s in &streams {
        out.push_str(&format!(
            "{:<width$}  {:>9}  {:>11}  {:>12}  {:>12}  {:>7}  {}\n",
            text(&s["name"]),
            text(&s["messages"]),
            text(&s["bytes"]),
            text(&s["first_offset"]),
            text(&s["last_offset"]),
            text(&s["readers"]),
            text(&s["filter"]),
        ));
    }
    out
}

fn stream_show(r: &Value) -> String {
    let bound = |v: &Value, unit: &str| match v.as_u64() {
        Some(0) | None => "no limit".to_string(),
        Some(n) => format!("{n} {unit}"),
    };
    format!(
        "stream          {}\nfilter          {}\ndefined         {}\nmax age         {}\nmax bytes       {}\nlast value      {}\nmessages        {}\nbytes           {}\nin memory       {} messages\nfirst offset    {}\nlast offset     {}\nreaders         {}\ntrimmed         {}, {} bytes\n",
        text(&r["name"]),
        text(&r["filter"]),
        if r["runtime"] == true {
            "at run time (mercurioctl stream create)"
        } else {
            "in the configuration file"
        },
        bound(&r["max_age"], "s"),
        bound(&r["max_bytes"], "bytes"),
        text(&r["last_value"]),
        text(&r["messages"]),
        text(&r["bytes"]),
        text(&r["in_memory"]),
        text(&r["first_offset"]),
        text(&r["last_offset"]),
        text(&r["readers"]),
        messages(&r["trimmed_messages"]),
        text(&r["trimmed_bytes"]),
    )
}

fn bridge_show(r: &Value) -> String {
    let addresses: Vec<String> = r["addresses"]
        .as_array()
        .map(|a| a.iter().map(text).collect())
        .unwrap_or_default();
    let mut out = format!(
        "bridge          {}\nclient id       {}\nstate           {}\naddresses       {}\naddress         {}\n",
        text(&r["name"]),
        text(&r["client_id"]),
        state(&r["connected"]),
        addresses.join(", "),
        text(&r["address"]),
    );
    if let Some(secs) = r["connected_secs"].as_u64() {
        out.push_str(&format!("connected for   {}\n", duration(secs)));
    }
    out.push_str(&format!(
        "last error      {}\nqueued          {}, {} bytes\ndropped         {}\nforwarded out   {}\nforwarded in    {}\nreconnects      {}\n",
        text(&r["last_error"]),
        messages(&r["queued"]),
        text(&r["queued_bytes"]),
        text(&r["dropped"]),
        text(&r["forwarded_out"]),
        text(&r["forwarded_in"]),
        text(&r["reconnects"]),
    ));
    out
}

fn show(r: &Value) -> String {
    let expiry = match r["expiry_interval"].as_u64() {
        Some(0) => "0 (ends with the connection)".to_string(),
        Some(n) if n == u64::from(u32::MAX) => "never".to_string(),
        Some(n) => format!("{n} s"),
        None => "-".to_string(),
    };
    let mut out = format!(
        "client id       {}\nstate           {}\nprotocol        MQTT {}\nsession expiry  {}\n",
        text(&r["client_id"]),
        state(&r["connected"]),
        protocol(&r["protocol_level"]),
        expiry,
    );
    if let Some(address) = r["address"].as_str() {
        out.push_str(&format!("address         {address}\n"));
    }
    if let Some(thread) = r["thread"].as_u64() {
        out.push_str(&format!("thread          {thread}\n"));
    }
    if let Some(secs) = r["disconnected_secs"].as_u64() {
        out.push_str(&format!("disconnected    {} ago\n", duration(secs)));
    }
    // Bytes of a queue left in storage are known only once it is read.
    let in_storage = match r["queued_in_storage"].as_u64() {
        Some(n) if n > 0 => format!(" in memory; {n} of them in storage until the client returns"),
        _ => String::new(),
    };
    out.push_str(&format!(
        "queued          {}, {} bytes{in_storage}\ninflight        {}\nwill            {}\n",
        messages(&r["queued"]),
        text(&r["queued_bytes"]),
        text(&r["inflight"]),
        if r["will"].as_bool() == Some(true) {
            "pending"
        } else {
            "none"
        },
    ));
    let subscriptions = r["subscriptions"].as_array().cloned().unwrap_or_default();
    if subscriptions.is_empty() {
        out.push_str("subscriptions   none\n");
    } else {
        out.push_str("subscriptions\n");
        for s in &subscriptions {
            out.push_str(&format!(
                "  {} (QoS {})\n",
                text(&s["filter"]),
                text(&s["qos"])
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bridge_table() {
        let r = json!({"bridges": [{"name": "cloud", "connected": true, "queued": 3,
            "dropped": 0, "forwarded_out": 10, "forwarded_in": 2, "reconnects": 1,
            "address": "broker.example.com:8883"}]});
        let out = bridge_list(&r);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("NAME "), "{out}");
        assert!(lines[1].starts_with("cloud  connected"), "{out}");
        assert!(lines[1].ends_with("broker.example.com:8883"), "{out}");
        assert_eq!(bridge_list(&json!({"bridges": []})), "no bridges\n");
    }

    #[test]
    fn client_show_says_what_is_in_storage() {
        let client = |in_storage: u64| {
            json!({"client_id": "sensor-12", "connected": false, "protocol_level": 5,
                "expiry_interval": 3600, "queued": 100, "queued_bytes": 0,
                "queued_in_storage": in_storage, "inflight": 0, "will": false,
                "subscriptions": []})
        };
        let stored = show(&client(100));
        assert!(
            stored.contains("queued          100 messages, 0 bytes in memory; 100 of them in storage until the client returns\n"),
            "{stored}"
        );
        let held = show(&client(0));
        assert!(
            held.contains("queued          100 messages, 0 bytes\n"),
            "{held}"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(duration(5), "5s");
        assert_eq!(duration(65), "1m 5s");
        assert_eq!(duration(3723), "1h 2m 3s");
        assert_eq!(duration(90061), "1d 1h 1m 1s");
    }

    #[test]
    fn config_socket() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("m.toml");
        std::fs::write(&file, "[admin]\nsocket = \"/x/y.sock\"\n").expect("write");
        assert_eq!(
            socket_from_config(&file).expect("path"),
            Path::new("/x/y.sock")
        );
        std::fs::write(&file, "[server]\n").expect("write");
        assert_eq!(
            socket_from_config(&file).expect("path"),
            socket_path::default_socket_path()
        );
        std::fs::write(&file, "[admin]\nsocket = 3\n").expect("write");
        assert!(socket_from_config(&file).is_err());
        assert!(socket_from_config(&dir.path().join("none.toml")).is_err());
    }
}
