//! The command line: `recado sub`, `pub`, `rr` and `bench`, with mosquitto_sub / mosquitto_pub
//! / mosquitto_rr's flags and meanings. Where a flag differs on purpose, its help says so.

use std::path::PathBuf;

use clap::{ArgAction, Args, Parser, Subcommand};

use crate::exit::EXIT_CODES_HELP;

const ABOUT: &str =
    "The MQTT command line client of Mercurio, for any MQTT 3.1, 3.1.1 or 5.0 broker.";

const LONG_ABOUT: &str = "\
The MQTT command line client of Mercurio, for any MQTT 3.1, 3.1.1 or 5.0 broker.

  recado sub -t 'sensors/#' -v                 print every message (as mosquitto_sub)
  recado pub -t sensors/t1 -m 21.5 -q 1        publish one message (as mosquitto_pub)
  recado rr -t service/req -e service/resp -m ping   request and wait for the response
  recado sub -t '$SYS/broker/#' -T             watch a broker: latest value of each topic
  recado bench -s fan-in -P 4                  load generator (see docs/BENCHMARKS.md)

The flags are mosquitto_sub's, mosquitto_pub's and mosquitto_rr's, with their meanings. On
purpose, -h is the host (as mosquitto): help is --help only; -T is --table (mosquitto_sub's
-T, hide topics, is --filter-out); -V is the protocol version: the version is --version.
See docs/recado.md.";

/// The top-level command line.
#[derive(Debug, Parser)]
#[command(
    name = "recado",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_help = EXIT_CODES_HELP,
    disable_help_flag = true,
    disable_version_flag = true,
    subcommand_required = true,
    arg_required_else_help = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Print help (-h is the host, as in mosquitto's clients).
    #[arg(long, global = true, action = ArgAction::Help)]
    pub help: Option<bool>,
    /// Print the version.
    #[arg(long, action = ArgAction::Version)]
    pub version: Option<bool>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Subscribe and print the messages received (mosquitto_sub). A lost connection is
    /// opened again, as mosquitto_sub does.
    #[command(disable_help_flag = true, after_help = EXIT_CODES_HELP)]
    Sub(SubArgs),
    /// Publish one message, a file, standard input or one message per line (mosquitto_pub).
    #[command(disable_help_flag = true, after_help = EXIT_CODES_HELP)]
    Pub(PubArgs),
    /// Publish a request with Response Topic and Correlation Data, print the response
    /// (mosquitto_rr; MQTT 5).
    #[command(disable_help_flag = true, after_help = EXIT_CODES_HELP)]
    Rr(RrArgs),
    /// Load generator: fan-in, fan-out, pairs, idle connections, persistent sessions
    /// (loopback only; see docs/BENCHMARKS.md).
    #[command(disable_help_flag = true, after_help = EXIT_CODES_HELP)]
    Bench(crate::bench::Args),
}

/// How to reach the broker and what to put in CONNECT: shared by `sub`, `pub` and `rr`.
#[derive(Debug, Args, Clone)]
#[command(next_help_heading = "Connection")]
pub struct ConnArgs {
    /// Broker host name or address [default: localhost]. -h is the host as in mosquitto's
    /// clients; help is --help only.
    #[arg(short = 'h', long, value_name = "HOST")]
    pub host: Option<String>,
    /// Broker port [default: 1883, 8883 with TLS, 80 with ws://, 443 with wss://].
    #[arg(short = 'p', long, value_name = "PORT")]
    pub port: Option<u16>,
    /// The broker as a URL: mqtt(s)://[user[:password]@]host[:port]/topic or
    /// ws(s)://[user[:password]@]host[:port]/path (the path is the WebSocket path, default
    /// /mqtt; give the topic with -t). Replaces -h, -p, -u, -P (and -t for mqtt URLs).
    #[arg(short = 'L', long = "url", value_name = "URL")]
    pub url: Option<String>,
    /// MQTT protocol version: mqttv31 (or 31, 3.1), mqttv311 (311, 3.1.1) or mqttv5 (5, 5.0)
    /// [default: mqttv311, as mosquitto's clients]. -V is not --version here.
    #[arg(short = 'V', long = "protocol-version", value_name = "VERSION")]
    pub protocol_version: Option<String>,
    /// Client identifier [default: recado-<command>-<process id>].
    #[arg(short = 'i', long = "id", value_name = "ID")]
    pub id: Option<String>,
    /// Client identifier prefix: the identifier is the prefix followed by the process id.
    #[arg(
        short = 'I',
        long = "id-prefix",
        value_name = "PREFIX",
        conflicts_with = "id"
    )]
    pub id_prefix: Option<String>,
    /// User name.
    #[arg(short = 'u', long, value_name = "USER")]
    pub username: Option<String>,
    /// Password.
    #[arg(short = 'P', long = "pw", value_name = "PASSWORD")]
    pub password: Option<String>,
    /// Keep Alive in seconds: a PINGREQ after this long without sending; 0 turns it off.
    #[arg(short = 'k', long, value_name = "SECONDS", default_value_t = 60)]
    pub keepalive: u16,
    /// Disable clean session / clean start: resume the session of this client identifier
    /// (needs -i or -I). In MQTT 5 the session then never expires unless -x says otherwise.
    #[arg(short = 'c', long = "disable-clean-session")]
    pub disable_clean_session: bool,
    /// MQTT 5 Session Expiry Interval in seconds: 0 to 4294967294, or -1, 4294967295 or ∞
    /// for a session that never expires.
    #[arg(
        short = 'x',
        long = "session-expiry-interval",
        value_name = "SECONDS",
        allow_hyphen_values = true
    )]
    pub session_expiry: Option<String>,
    /// MQTT 5 property, as mosquitto: -D COMMAND PROPERTY VALUE (user-property takes a name
    /// and a value). Commands: connect, publish, subscribe, unsubscribe, disconnect, will.
    /// Properties: content-type, correlation-data, maximum-packet-size,
    /// message-expiry-interval, payload-format-indicator, receive-maximum,
    /// request-problem-information, request-response-information, response-topic,
    /// session-expiry-interval, subscription-identifier, topic-alias, topic-alias-maximum,
    /// user-property, will-delay-interval. Repeatable; needs -V mqttv5.
    #[arg(
        short = 'D',
        long = "property",
        num_args = 3..=4,
        value_names = ["COMMAND", "PROPERTY", "VALUE"],
        action = ArgAction::Append
    )]
    pub property: Vec<String>,
    /// Connect from this local address.
    #[arg(short = 'A', long = "bind-address", value_name = "ADDRESS")]
    pub bind_address: Option<std::net::IpAddr>,
    /// Disable Nagle's algorithm: recado always does, the flag is accepted for mosquitto's
    /// scripts.
    #[arg(long)]
    pub nodelay: bool,
    /// MQTT over WebSocket to -h and -p (path /mqtt), as a ws:// URL would.
    #[arg(long)]
    pub ws: bool,
    // The flattened groups set their own headings, which stay in force for the fields
    // after them: the Connection fields come first.
    #[command(flatten)]
    pub will: WillArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Print every packet sent and received on standard error.
    #[arg(short = 'd', long, help_heading = "Output")]
    pub debug: bool,
    /// Print no error message (the exit code still tells).
    #[arg(long, help_heading = "Output")]
    pub quiet: bool,
}

/// The will (`--will-*`): part of [`ConnArgs`].
#[derive(Debug, Args, Clone)]
#[command(next_help_heading = "Will")]
pub struct WillArgs {
    /// Will topic: the broker publishes the will there if the connection ends without
    /// DISCONNECT.
    #[arg(long, value_name = "TOPIC")]
    pub will_topic: Option<String>,
    /// Will payload [default: empty].
    #[arg(long, value_name = "PAYLOAD", requires = "will_topic")]
    pub will_payload: Option<String>,
    /// Will QoS: 0, 1 or 2.
    #[arg(
        long,
        value_name = "QOS",
        default_value_t = 0,
        value_parser = clap::value_parser!(u8).range(0..=2)
    )]
    pub will_qos: u8,
    /// Will retained.
    #[arg(long, requires = "will_topic")]
    pub will_retain: bool,
}

/// TLS (`--tls`, `--cafile`, ...): part of [`ConnArgs`].
#[derive(Debug, Args, Clone)]
#[command(next_help_heading = "TLS")]
pub struct TlsArgs {
    /// Use TLS (implied by mqtts://, wss://, --cafile, --capath, --cert, --insecure and the
    /// other TLS flags). Without --cafile or --capath the system's trusted CA certificates
    /// verify the broker.
    #[arg(long)]
    pub tls: bool,
    /// PEM file of the CA certificate(s) that verify the broker's certificate.
    #[arg(long, value_name = "FILE")]
    pub cafile: Option<PathBuf>,
    /// PEM client certificate (chain) to present; needs --key.
    #[arg(long, value_name = "FILE", requires = "key")]
    pub cert: Option<PathBuf>,
    /// PEM private key of --cert.
    #[arg(long, value_name = "FILE", requires = "cert")]
    pub key: Option<PathBuf>,
    /// Accept a broker certificate issued for another name (the chain is still verified),
    /// as mosquitto's --insecure.
    #[arg(long)]
    pub insecure: bool,
    /// The name the broker's certificate must be valid for (and SNI) [default: the host].
    #[arg(long, value_name = "NAME")]
    pub tls_server_name: Option<String>,
    /// A directory of PEM CA certificates (every *.pem and *.crt file in it), as --cafile.
    #[arg(long, value_name = "DIR")]
    pub capath: Option<PathBuf>,
    /// Trust the system's CA certificates too (they are used anyway without --cafile and
    /// --capath).
    #[arg(long)]
    pub tls_use_os_certs: bool,
    /// The TLS version: tlsv1.3 or tlsv1.2 [default: either]; tlsv1.1 and older are not
    /// supported.
    #[arg(long, value_name = "VERSION")]
    pub tls_version: Option<String>,
}

/// How a received message is printed: shared by `sub` and `rr`.
#[derive(Debug, Args, Clone)]
pub struct OutputArgs {
    /// Print the topic before the payload, separated by a space.
    #[arg(short = 'v', long, help_heading = "Output")]
    pub verbose: bool,
    /// Do not add a newline after each message.
    #[arg(short = 'N', help_heading = "Output")]
    pub no_newline: bool,
    /// Output format, as mosquitto_sub's -F: %t topic, %p payload, %x/%X payload in hex,
    /// %l length, %q QoS, %r retain, %m message id, %I ISO 8601 time, %U Unix time with
    /// nanoseconds, %j/%J JSON (payload quoted / as JSON), %A topic alias, %C content type,
    /// %D correlation data, %E message expiry interval, %F payload format indicator, %P user
    /// properties (name:value), %R response topic, %S subscription identifier, %% a %;
    /// flags 0 and -, a width and a maximum width (%-10.10t); @X is strftime's %X and @N the
    /// nanoseconds, @@ an @; \n \t \0 \a \e \\ escapes. A newline follows, unless -N.
    #[arg(
        short = 'F',
        long,
        value_name = "FORMAT",
        conflicts_with = "json",
        help_heading = "Output"
    )]
    pub format: Option<String>,
    /// One JSON object per line for each message: topic, payload (UTF-8 text, else base64,
    /// named by payload_encoding), qos, retain, every MQTT 5 property present, received_at
    /// (RFC 3339, UTC).
    #[arg(long, help_heading = "Output")]
    pub json: bool,
    /// Pretty-print JSON (--json, -F %j / %J) over several lines.
    #[arg(long, help_heading = "Output")]
    pub pretty: bool,
}

/// `recado sub`.
#[derive(Debug, Args)]
pub struct SubArgs {
    #[command(flatten)]
    pub conn: ConnArgs,
    #[command(flatten)]
    pub output: OutputArgs,
    /// Topic filter to subscribe to; repeatable.
    #[arg(
        short = 't',
        long = "topic",
        value_name = "FILTER",
        help_heading = "Subscription"
    )]
    pub topics: Vec<String>,
    /// Do not print messages whose topic matches this filter (mosquitto_sub's -T); repeatable.
    #[arg(long, value_name = "FILTER", help_heading = "Subscription")]
    pub filter_out: Vec<String>,
    /// Unsubscribe from this filter before subscribing (with -c: clean up a persistent
    /// session); repeatable. With no -t, recado exits once unsubscribed.
    #[arg(
        short = 'U',
        long = "unsubscribe",
        value_name = "FILTER",
        help_heading = "Subscription"
    )]
    pub unsubscribe: Vec<String>,
    /// Maximum QoS of the subscriptions: 0, 1 or 2.
    #[arg(short = 'q', long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2), help_heading = "Subscription")]
    pub qos: u8,
    /// MQTT 5: do not receive the messages this client publishes (No Local).
    #[arg(long, help_heading = "Subscription")]
    pub no_local: bool,
    /// MQTT 5: keep the retain flag as published on forwarded messages (Retain As
    /// Published).
    #[arg(long, help_heading = "Subscription")]
    pub retain_as_published: bool,
    /// MQTT 5 Retain Handling: always (send retained messages at subscribe), new (only for a
    /// subscription that did not exist) or never [default: always].
    #[arg(long, value_name = "WHEN", value_parser = ["always", "new", "never"], help_heading = "Subscription")]
    pub retain_handling: Option<String>,
    /// MQTT 5: where the readers of streams (-t '$stream/<name>') start: earliest, latest, an
    /// offset, a Unix time in milliseconds or an RFC 3339 time (2026-01-31T08:00:00Z); sent as
    /// the SUBSCRIBE user property stream-offset. With MQTT 3.1.1, write it in the filter:
    /// -t '$stream/<name>/@<VALUE>'. -v prints each message's offset after its topic.
    #[arg(long, value_name = "VALUE", help_heading = "Subscription")]
    pub stream_offset: Option<String>,
    /// Exit after this many messages (those printed).
    #[arg(short = 'C', long, value_name = "COUNT", help_heading = "Ending")]
    pub count: Option<u64>,
    /// Exit after this many seconds: exit code 5, except with -T (the table is the output).
    #[arg(short = 'W', long, value_name = "SECONDS", help_heading = "Ending")]
    pub timeout: Option<f64>,
    /// Exit as soon as the subscriptions are acknowledged (e.g. to create a persistent
    /// session with -c).
    #[arg(short = 'E', help_heading = "Ending")]
    pub exit_after_subscribe: bool,
    /// Do not print retained (stale) messages.
    #[arg(short = 'R', help_heading = "Ending")]
    pub no_retained: bool,
    /// Print only retained messages: exit at the first message that is not retained.
    #[arg(long, help_heading = "Ending")]
    pub retained_only: bool,
    /// Clear each retained message received (publish an empty retained message to its
    /// topic).
    #[arg(long, help_heading = "Ending")]
    pub remove_retained: bool,
    /// The latest message of every topic as a table, sorted by topic: refreshed in place on
    /// a terminal; printed once when the command ends (-W, -C, Ctrl+C) if standard output is
    /// not a terminal. (mosquitto_sub's -T is --filter-out here.)
    #[arg(short = 'T', long, conflicts_with_all = ["json", "format", "verbose"], help_heading = "Output")]
    pub table: bool,
}

/// Where a message comes from: -m, -f, -l, -s or -n (exactly one).
#[derive(Debug, Args, Clone)]
#[group(required = false, multiple = false)]
pub struct MessageArgs {
    /// The message to publish.
    #[arg(
        short = 'm',
        long = "message",
        value_name = "MESSAGE",
        help_heading = "Message"
    )]
    pub message: Option<String>,
    /// Publish the contents of a file as one message.
    #[arg(
        short = 'f',
        long = "file",
        value_name = "FILE",
        help_heading = "Message"
    )]
    pub file: Option<PathBuf>,
    /// Publish each line read from standard input as a message (newline not included).
    #[arg(short = 'l', long = "stdin-line", help_heading = "Message")]
    pub lines: bool,
    /// Publish all of standard input as one message.
    #[arg(short = 's', long = "stdin-file", help_heading = "Message")]
    pub stdin: bool,
    /// Publish an empty (zero length) message.
    #[arg(short = 'n', long = "null-message", help_heading = "Message")]
    pub null: bool,
}

/// `recado pub`.
#[derive(Debug, Args)]
pub struct PubArgs {
    #[command(flatten)]
    pub conn: ConnArgs,
    #[command(flatten)]
    pub message: MessageArgs,
    /// Topic to publish to.
    #[arg(
        short = 't',
        long = "topic",
        value_name = "TOPIC",
        help_heading = "Message"
    )]
    pub topic: Option<String>,
    /// QoS of the message: 0, 1 or 2; recado waits for its acknowledgement.
    #[arg(short = 'q', long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2), help_heading = "Message")]
    pub qos: u8,
    /// Retain the message (an empty retained message clears the topic's retained message).
    #[arg(short = 'r', long, help_heading = "Message")]
    pub retain: bool,
    /// Publish the message this many times.
    #[arg(
        long,
        value_name = "COUNT",
        default_value_t = 1,
        help_heading = "Message"
    )]
    pub repeat: u64,
    /// Seconds between repeated messages.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 0.0,
        help_heading = "Message"
    )]
    pub repeat_delay: f64,
}

/// `recado rr`.
#[derive(Debug, Args)]
pub struct RrArgs {
    #[command(flatten)]
    pub conn: ConnArgs,
    #[command(flatten)]
    pub message: MessageArgs,
    #[command(flatten)]
    pub output: OutputArgs,
    /// Request topic: where the request is published.
    #[arg(
        short = 't',
        long = "topic",
        value_name = "TOPIC",
        help_heading = "Message"
    )]
    pub topic: String,
    /// Response topic: subscribed to before the request is published and sent as its
    /// Response Topic.
    #[arg(
        short = 'e',
        long = "response-topic",
        value_name = "TOPIC",
        help_heading = "Message"
    )]
    pub response_topic: String,
    /// QoS of the request and the subscription: 0, 1 or 2.
    #[arg(short = 'q', long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2), help_heading = "Message")]
    pub qos: u8,
    /// Correlation Data of the request [default: a unique value; -D publish
    /// correlation-data also sets it]. A message on the response topic with other
    /// Correlation Data is not the response (one without any is).
    #[arg(long, value_name = "DATA", help_heading = "Message")]
    pub correlation_data: Option<String>,
    /// Seconds to wait for the response (exit code 5 when it expires) [default: forever].
    #[arg(short = 'W', long, value_name = "SECONDS", help_heading = "Ending")]
    pub timeout: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn mosquittos_spellings_parse() {
        let args = [
            "recado",
            "sub",
            "-h",
            "broker",
            "-p",
            "1884",
            "-t",
            "a",
            "-t",
            "b/#",
            "-V",
            "mqttv5",
            "-D",
            "subscribe",
            "user-property",
            "k",
            "v",
            "-D",
            "connect",
            "session-expiry-interval",
            "60",
            "-C",
            "3",
            "-W",
            "2.5",
            "-v",
        ];
        let cli = Cli::try_parse_from(args.iter().chain(&["-T"]));
        assert!(cli.is_err(), "-T and -v conflict");
        let cli = Cli::try_parse_from(args).unwrap();
        let Command::Sub(s) = cli.command else {
            panic!("sub")
        };
        assert_eq!(s.conn.host.as_deref(), Some("broker"));
        assert_eq!(s.topics, vec!["a", "b/#"]);
        assert_eq!(s.conn.property.len(), 7);
        assert_eq!(s.count, Some(3));
        assert!(s.output.verbose);
    }
}
