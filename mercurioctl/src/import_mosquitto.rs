//! `mercurioctl config import-mosquitto FILE`: a mosquitto 2.0 configuration as an equivalent
//! mercuriod TOML file.
//!
//! The conversion follows mosquitto's own reading of the file: listener-scoped keys go to the
//! listener last opened in the same file (before any, to the `port` listener), security keys
//! are global unless `per_listener_settings true`, a file without `listener`/`port` is
//! mosquitto's local-only mode (loopback, anonymous clients), and mosquitto's defaults are
//! written out where a TOML file without the key would behave otherwise (`allow_anonymous`,
//! bridges). Every key that cannot be carried over is listed in a comment at the top of the
//! output with its file, line and the reason, except security settings: one that cannot be
//! carried over fails the conversion (`refused`), since leaving it out would let in what
//! mosquitto kept out. The result is checked with mercuriod's own
//! configuration reader (`config_file`), so it passes `mercuriod --check-config` as long as
//! the files it names exist.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::mosquitto_conf::Line;

/// A value mosquitto itself would refuse (an invalid port, boolean, number or duration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportError(pub String);

impl std::fmt::Display for ImportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the conversion produced.
#[derive(Debug, Clone)]
pub struct Converted {
    /// The TOML configuration, comments included.
    pub toml: String,
    /// Keys that could not be carried over (each also a comment in `toml`).
    pub not_carried: usize,
}

/// Converts the lines of a mosquitto.conf (read with [`crate::mosquitto_conf::read`]).
/// `source` names the file in the header comment; `bridges` says whether this version's
/// configuration has `[[bridges]]` (without, bridges are written commented out).
pub fn convert(source: &Path, lines: &[Line], bridges: bool) -> Result<Converted, ImportError> {
    let per_listener = lines
        .iter()
        .rev()
        .find(|l| l.key == "per_listener_settings")
        .map(parse_bool)
        .transpose()?
        .unwrap_or(false);
    let mut c = Conversion {
        per_listener,
        ..Conversion::default()
    };
    for line in lines {
        if line.starts_file {
            c.current_listener = None;
            c.current_bridge = None;
        }
        c.line(line)?;
    }
    Ok(c.finish(source, bridges))
}

/// One TOML key with its value (already written as TOML) and the mosquitto line it came from.
#[derive(Debug, Clone)]
struct Entry {
    key: String,
    value: String,
    from: String,
}

#[derive(Debug, Clone, Default)]
struct Table {
    entries: Vec<Entry>,
}

impl Table {
    /// Sets `key`, replacing an earlier value (the later line wins, as in mosquitto).
    fn set(&mut self, key: &str, value: String, from: String) {
        match self.entries.iter_mut().find(|e| e.key == key) {
            Some(e) => {
                e.value = value;
                e.from = from;
            }
            None => self.entries.push(Entry {
                key: key.to_string(),
                value,
                from,
            }),
        }
    }

    fn get(&self, key: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.key == key)
    }

    fn remove(&mut self, key: &str) -> Option<Entry> {
        let i = self.entries.iter().position(|e| e.key == key)?;
        Some(self.entries.remove(i))
    }

    fn write(&self, out: &mut String, prefix: &str) {
        for e in &self.entries {
            if e.from.is_empty() {
                let _ = writeln!(out, "{prefix}{} = {}", e.key, e.value);
            } else {
                let _ = writeln!(out, "{prefix}{} = {}  # {}", e.key, e.value, e.from);
            }
        }
    }
}

/// Security options: global, or one set per listener with `per_listener_settings true`.
#[derive(Debug, Clone, Default)]
struct Security {
    table: Table,
    /// `allow_zero_length_clientid`, which Mercurio has in `[server]`.
    zero_length: Option<(bool, String)>,
}

#[derive(Debug, Clone, Default)]
struct Listener {
    /// Where it was opened (`listener` line), or empty for the default listener.
    from: String,
    port: Option<u16>,
    /// `listener PORT ADDRESS` or `bind_address`.
    host: Option<(String, String)>,
    /// `socket_domain ipv4|ipv6`, and where.
    ipv6: Option<(bool, String)>,
    table: Table,
    security: Security,
    max_qos: Option<(u8, String)>,
    /// Whether any listener-scoped key was set (mosquitto then creates the default listener).
    used: bool,
    capath: Option<(String, String)>,
}

#[derive(Debug, Clone, Default)]
struct Bridge {
    table: Table,
    topics: Vec<Table>,
}

#[derive(Default)]
struct Conversion {
    per_listener: bool,
    /// `listener`/`port` seen: otherwise mosquitto runs in local-only mode.
    configured_listener: bool,
    default_listener: Listener,
    listeners: Vec<Listener>,
    current_listener: Option<usize>,
    bridges: Vec<Bridge>,
    current_bridge: Option<usize>,
    security: Security,
    server: Table,
    storage: Option<String>,
    persistence_location: Option<(String, String)>,
    logging: Table,
    log_types: Vec<(String, String)>,
    log_dests: Vec<(String, String)>,
    /// Lines not carried over, with the reason.
    notes: Vec<String>,
    /// Lines carried over that still need a look (paths, listeners widened or narrowed).
    cautions: Vec<String>,
    /// Lines that need no key: Mercurio behaves so already.
    same: Vec<String>,
}

/// TOML string literal.
fn string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn from(line: &Line) -> String {
    format!("{} {}", line.place(), shown(line))
}

/// The line as shown in comments, with secrets hidden.
fn shown(line: &Line) -> String {
    if line.key.contains("password") || (line.key.contains("psk") && line.key != "psk_file") {
        format!("`{} ...`", line.key)
    } else {
        format!("`{}`", line.text())
    }
}

fn invalid(line: &Line, what: &str) -> ImportError {
    ImportError(format!(
        "{}: {}: {what} (mosquitto refuses this line too)",
        line.place(),
        line.text()
    ))
}

/// A security setting Mercurio cannot carry over: converting without it would let in what
/// mosquitto kept out (a plaintext bridge from a TLS one, a revoked or unchecked certificate,
/// clients an authentication plugin refused), so the import fails naming the line, why, and
/// what to do instead.
fn refused(line: &Line, why: &str) -> ImportError {
    ImportError(format!(
        "{} {}: cannot be carried over, and leaving it out would weaken security: {why}",
        line.place(),
        shown(line)
    ))
}

/// Security keys with no Mercurio equivalent (see [`refused`]): the reason and what to do.
/// `None` for keys whose value decides (see `Conversion::line`) and for every other key.
fn refused_key(key: &str) -> Option<&'static str> {
    Some(match key {
        "auth_plugin" | "plugin" | "global_plugin" => {
            "mosquitto plugins are C libraries Mercurio cannot load, and without this one its \
             clients' authentication or access control is lost; use password_file and \
             acl_file, or an application embedding Mercurio with Rust Authenticator/Authorizer \
             hooks (examples/auth_hook.rs), then remove the line"
        }
        "psk_file" | "psk_hint" => {
            "TLS with pre-shared keys is not offered (rustls has no PSK cipher suites) and the \
             listener would accept plain connections; give it certfile and keyfile instead, \
             then remove the psk lines"
        }
        "bridge_identity" | "bridge_psk" => {
            "TLS with pre-shared keys is not offered (rustls has no PSK cipher suites) and the \
             bridge would connect in plaintext; give the remote's CA certificate in \
             bridge_cafile instead, then remove the bridge_identity and bridge_psk lines"
        }
        "bridge_capath" => {
            "Mercurio bridges have no CA directory and the bridge would connect in plaintext, \
             sending its credentials in clear; put the CA certificates in one PEM file \
             (cat DIR/*.crt > bridge-ca.pem) and name it with bridge_cafile instead"
        }
        _ => return None,
    })
}

fn parse_bool(line: &Line) -> Result<bool, ImportError> {
    match line.words().first().copied() {
        Some("true") => Ok(true),
        Some("false") => Ok(false),
        _ => Err(invalid(line, "not true or false")),
    }
}

fn parse_int(line: &Line) -> Result<i64, ImportError> {
    line.words()
        .first()
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| invalid(line, "not a whole number"))
}

fn parse_port(line: &Line, word: Option<&str>) -> Result<u16, ImportError> {
    word.and_then(|w| w.parse::<u16>().ok())
        .filter(|&p| p > 0)
        .ok_or_else(|| invalid(line, "not a port from 1 to 65535"))
}

/// A mosquitto duration (`persistent_client_expiration`): a number and one of h, d, w, m
/// (30 days), y (365 days), in seconds.
pub fn parse_duration(text: &str) -> Option<u64> {
    let unit = match text.chars().last()? {
        'h' => 3600,
        'd' => 86_400,
        'w' => 7 * 86_400,
        'm' => 30 * 86_400,
        'y' => 365 * 86_400,
        _ => return None,
    };
    let n: u64 = text[..text.len() - 1].parse().ok()?;
    (n > 0).then(|| n.checked_mul(unit)).flatten()
}

/// Keys with no Mercurio equivalent, and why.
fn no_equivalent(key: &str) -> Option<&'static str> {
    Some(match key {
        "auth_plugin_deny_special_chars" => "no plugins (see auth_plugin)",
        "autosave_interval" | "autosave_on_changes" => {
            "Mercurio writes every change to its database within milliseconds (group commit), \
             there is no snapshot interval"
        }
        "persistence_file" => {
            "mosquitto's database format cannot be read: Mercurio keeps its own SQLite file, \
             mercurio.db, in persistence_location; retained messages and sessions start empty"
        }
        "pid_file" => {
            "mercuriod writes no pid file: systemd tracks it (Type=notify), or use $! in scripts"
        }
        "user" => {
            "mercuriod does not change user: the systemd unit runs it as a dynamic user \
             (docs/operations.md, \"Run as a service\")"
        }
        "set_tcp_nodelay" => "Mercurio always sets TCP_NODELAY",
        "memory_limit" => {
            "no global memory limit: every per-client buffer is bounded (max_queued_messages, \
             max_queued_bytes, max_packet_size)"
        }
        "max_inflight_bytes" => {
            "messages in flight are limited by count only (max_inflight, the client's Receive \
             Maximum)"
        }
        "allow_duplicate_messages" => {
            "Mercurio always sends one copy per client for overlapping subscriptions (what \
             allow_duplicate_messages false did; mosquitto 2 deprecated the option)"
        }
        "log_facility" => "syslog lines use facility daemon",
        "log_timestamp" | "log_timestamp_format" => {
            "log lines carry RFC 3339 timestamps, left out under systemd where the journal adds \
             its own"
        }
        "websockets_log_level" => "WebSocket events log under the Mercurio levels of [logging]",
        "websockets_headers_size" => "WebSocket listeners read request heads of up to 8 KiB",
        "bind_interface" => {
            "bind to the interface's address with host (listener PORT ADDRESS) instead"
        }
        "ciphers" | "ciphers_tls1.3" => {
            "rustls offers its own safe TLS 1.2 and 1.3 cipher suites, not configurable"
        }
        "dhparamfile" => "rustls has no finite-field Diffie-Hellman; ECDHE is used",
        "tls_engine" | "tls_keyform" => "keys are read from PEM files only",
        "max_topic_alias" => "Mercurio offers MQTT 5 clients 10 topic aliases, not configurable",
        "queue_qos0_messages" => {
            "QoS 0 messages are never queued for a disconnected client (mosquitto's default)"
        }
        "retry_interval" | "store_clean_interval" => "removed in mosquitto 2, which ignores it too",
        "auto_id_prefix" => {
            "assigned client identifiers are always auto- and a UUID, mosquitto's default form"
        }
        _ => return None,
    })
}

/// Bridge keys with no place in `[[bridges]]`, and why.
fn bridge_no_equivalent(key: &str) -> Option<&'static str> {
    Some(match key {
        "local_clientid" | "local_username" | "local_password" | "local_cleansession" => {
            "a Mercurio bridge runs inside the broker, not as a local client"
        }
        "start_type" | "threshold" | "idle_timeout" => {
            "a bridge starts with the broker and stays connected (start_type automatic)"
        }
        "restart_timeout" => "reconnect delays are the bridge's own (back-off with jitter)",
        "notifications_local_only" => "notifications are published on both sides",
        "bridge_attempt_unsubscribe" | "bridge_outgoing_retain" | "bridge_max_packet_size" => {
            "not configurable"
        }
        "bridge_bind_address" => "outgoing connections use the system's source address",
        "bridge_alpn" => "rustls chooses (no ALPN is sent)",
        _ => return None,
    })
}

/// Keys that belong to the current bridge.
fn is_bridge_key(key: &str) -> bool {
    matches!(
        key,
        "address"
            | "addresses"
            | "round_robin"
            | "remote_clientid"
            | "clientid"
            | "bridge_protocol_version"
            | "cleansession"
            | "keepalive_interval"
            | "remote_username"
            | "username"
            | "remote_password"
            | "password"
            | "bridge_cafile"
            | "bridge_certfile"
            | "bridge_keyfile"
            | "bridge_capath"
            | "bridge_insecure"
            | "bridge_require_ocsp"
            | "bridge_tls_version"
            | "bridge_identity"
            | "bridge_psk"
            | "notifications"
            | "notification_topic"
            | "try_private"
            | "topic"
    ) || bridge_no_equivalent(key).is_some()
}

impl Conversion {
    fn note(&mut self, line: &Line, why: &str) {
        self.notes
            .push(format!("{} {}: {why}", line.place(), shown(line)));
    }

    fn same(&mut self, line: &Line, why: &str) {
        self.same
            .push(format!("{} {}: {why}", line.place(), shown(line)));
    }

    /// The listener that listener-scoped keys go to.
    fn listener(&mut self) -> &mut Listener {
        match self.current_listener {
            Some(i) => &mut self.listeners[i],
            None => &mut self.default_listener,
        }
    }

    /// The security options that security keys go to.
    fn security(&mut self) -> &mut Security {
        if self.per_listener {
            &mut self.listener().security
        } else {
            &mut self.security
        }
    }

    fn line(&mut self, line: &Line) -> Result<(), ImportError> {
        let key = line.key.as_str();
        let words = line.words();
        let f = from(line);
        if let Some(why) = refused_key(key) {
            return Err(refused(line, why));
        }
        if is_bridge_key(key) && key != "topic" || key == "topic" && self.current_bridge.is_some() {
            return self.bridge_line(line);
        }
        match key {
            "per_listener_settings" => {
                if self.per_listener {
                    self.same(
                        line,
                        "each listener's allow_anonymous, password_file and acl_file are written \
                         in its [[listeners]] table",
                    );
                } else {
                    self.same(line, "[auth] applies to every listener");
                }
            }
            "include_dir" => {
                if line.included {
                    self.note(line, "mosquitto reads include_dir in the main file only");
                }
            }
            // Security options.
            "allow_anonymous" => {
                let v = parse_bool(line)?;
                self.security().table.set(key, v.to_string(), f);
            }
            "password_file" | "acl_file" => {
                if line.value.is_empty() {
                    return Err(invalid(line, "empty path"));
                }
                let v = string(&line.value);
                self.security().table.set(key, v, f);
                if self.per_listener && self.current_listener.is_none() && key == "password_file" {
                    self.default_listener.used = true;
                }
            }
            "allow_zero_length_clientid" => {
                let v = parse_bool(line)?;
                self.security().zero_length = Some((v, f));
                if self.per_listener && self.current_listener.is_none() && !v {
                    self.default_listener.used = true;
                }
            }
            "auto_id_prefix" if line.value == "auto-" => {
                self.same(line, "assigned client identifiers start with auto-")
            }
            k if k.starts_with("auth_opt_") || k.starts_with("plugin_opt_") => {
                self.note(line, "an option of a mosquitto plugin (see auth_plugin)");
            }
            // Listeners.
            "listener" => {
                let port = parse_port(line, words.first().copied())?;
                let mut l = Listener {
                    from: f.clone(),
                    port: Some(port),
                    used: true,
                    ..Listener::default()
                };
                match words.get(1) {
                    Some(addr) if addr.starts_with('#') => {}
                    Some(addr) if addr.starts_with('/') => {
                        self.note(line, "Unix socket listeners are not offered; listening on TCP 127.0.0.1 instead");
                        l.host = Some(("127.0.0.1".into(), f));
                    }
                    Some(addr) => l.host = Some((addr.to_string(), f)),
                    None => {}
                }
                self.configured_listener = true;
                self.listeners.push(l);
                self.current_listener = Some(self.listeners.len() - 1);
            }
            "port" => {
                let port = parse_port(line, words.first().copied())?;
                self.configured_listener = true;
                self.default_listener.port = Some(port);
                self.default_listener.used = true;
                if self.default_listener.from.is_empty() {
                    self.default_listener.from = f;
                }
            }
            "bind_address" => {
                if words.is_empty() {
                    return Err(invalid(line, "empty address"));
                }
                self.default_listener.host = Some((words[0].to_string(), f));
                self.default_listener.used = true;
            }
            "socket_domain" => {
                let v = match words.first().copied() {
                    Some("ipv4") => false,
                    Some("ipv6") => true,
                    _ => return Err(invalid(line, "not ipv4 or ipv6")),
                };
                let l = self.listener();
                l.ipv6 = Some((v, f));
                l.used = true;
            }
            "max_connections" => {
                let n = parse_int(line)?;
                let v = if n < 0 { 0 } else { n.min(i64::from(u32::MAX)) };
                let l = self.listener();
                l.table.set(key, v.to_string(), f);
                l.used = true;
            }
            "protocol" => {
                let v = match words.first().copied() {
                    Some("mqtt") => "mqtt",
                    Some("websockets") => "websocket",
                    Some("mqttsn") => {
                        self.note(line, "MQTT-SN is not offered");
                        return Ok(());
                    }
                    _ => return Err(invalid(line, "not mqtt or websockets")),
                };
                let l = self.listener();
                l.table.set(key, string(v), f);
                l.used = true;
            }
            "max_qos" | "maximum_qos" => {
                let n = parse_int(line)?;
                if !(0..=2).contains(&n) {
                    return Err(invalid(line, "not 0, 1 or 2"));
                }
                let l = self.listener();
                l.max_qos = Some((n as u8, f));
                l.used = true;
            }
            "mount_point" => {
                let l = self.listener();
                l.table.set(key, string(&line.value), f);
                l.used = true;
            }
            "http_dir" => {
                let l = self.listener();
                l.table.set(key, string(&line.value), f);
                l.used = true;
            }
            "certfile" | "keyfile" | "cafile" => {
                let name = match key {
                    "certfile" => "cert_file",
                    "keyfile" => "key_file",
                    _ => "ca_file",
                };
                let l = self.listener();
                l.table.set(name, string(&line.value), f);
                l.used = true;
            }
            "capath" => {
                let l = self.listener();
                l.capath = Some((line.value.clone(), f));
                l.used = true;
            }
            "crlfile" => {
                if line.value.is_empty() {
                    return Err(invalid(line, "empty path"));
                }
                let l = self.listener();
                l.table.set("crl_file", string(&line.value), f);
                l.used = true;
            }
            "use_username_as_clientid" => {
                if parse_bool(line)? {
                    return Err(refused(
                        line,
                        "Mercurio keeps the client identifier a client sends, so without this \
                         line a client could take another's identifier, and with it the ACL \
                         patterns written with %c and that client's session; write the ACL \
                         with %u patterns (or clientid_prefixes) instead, then remove the line",
                    ));
                }
                self.same(line, "a client keeps the identifier it sends");
            }
            "use_subject_as_username" => {
                if parse_bool(line)? {
                    return Err(refused(
                        line,
                        "only the certificate's common name can be the user name in Mercurio \
                         (use_identity_as_username); without it clients would be known by the \
                         user name they send, not by their certificate's subject, which the \
                         ACL and password file name; use use_identity_as_username true with \
                         ACL and password entries by common name instead",
                    ));
                }
                self.same(line, "the user name is never the certificate's subject");
            }
            "tls_version" => {
                match words.first().copied() {
                    Some("tlsv1.2") | Some("tlsv1.1") => self.same(
                        line,
                        "TLS 1.2 and 1.3 are offered, older versions never (a higher minimum)",
                    ),
                    Some("tlsv1.3") => return Err(refused(
                        line,
                        "Mercurio listeners offer TLS 1.2 and 1.3 and cannot be limited to 1.3; \
                         remove the line to accept TLS 1.2 clients too",
                    )),
                    _ => return Err(invalid(line, "not tlsv1.3, tlsv1.2 or tlsv1.1")),
                }
            }
            "require_certificate" | "use_identity_as_username" => {
                let v = parse_bool(line)?;
                let l = self.listener();
                l.table.set(key, v.to_string(), f);
                l.used = true;
            }
            // [server]
            "max_inflight_messages" => {
                let n = parse_int(line)?;
                let v = if n <= 0 || n > 65_535 { 65_535 } else { n };
                self.server.set("max_inflight", v.to_string(), f.clone());
                // mosquitto also tells MQTT 5 clients this as its Receive Maximum.
                self.server.set("receive_maximum", v.to_string(), f);
            }
            "max_queued_messages" => {
                // 0 (or less, which mosquitto accepts alike): no count limit, in both
                // (max_queued_bytes still bounds each queue).
                let n = parse_int(line)?.max(0);
                self.server.set(key, n.to_string(), f.clone());
                // One limit for every QoS in mosquitto.
                self.server
                    .set("max_queued_qos0_messages", n.to_string(), f.clone());
                if n == 0 {
                    self.cautions.push(format!(
                        "{f}: no limit on the number of queued messages (0, as in mosquitto); \
                         max_queued_bytes (16 MiB by default) still bounds each queue"
                    ));
                }
            }
            "max_queued_bytes" => {
                let n = parse_int(line)?.max(0);
                self.server.set(key, n.to_string(), f);
            }
            "max_keepalive" => {
                let n = parse_int(line)?;
                if !(0..=65_535).contains(&n) {
                    return Err(invalid(line, "not from 0 to 65535"));
                }
                if n == 0 {
                    self.note(
                        line,
                        "keep alive 0 (none) cannot be required: Mercurio grants at most 65535 s",
                    );
                } else {
                    self.server.set(key, n.to_string(), f);
                }
            }
            "max_packet_size" => {
                let n = parse_int(line)?;
                let v = if n <= 0 || n > 268_435_455 {
                    268_435_455
                } else {
                    n
                };
                self.server.set(key, v.to_string(), f);
            }
            "message_size_limit" => {
                let n = parse_int(line)?;
                if n > 0 {
                    let v = n.min(268_435_455);
                    self.server.set(key, v.to_string(), f);
                }
            }
            "retain_available" | "check_retain_source" | "upgrade_outgoing_qos" => {
                let v = parse_bool(line)?;
                self.server.set(key, v.to_string(), f);
            }
            "persistent_client_expiration" => {
                let secs = parse_duration(&line.value).ok_or_else(|| {
                    invalid(
                        line,
                        "not a duration: a number and h, d, w, m (30 days) or y (365 days)",
                    )
                })?;
                self.server.set(key, secs.to_string(), f);
            }
            "sys_interval" => {
                let n = parse_int(line)?;
                if !(0..=65_535).contains(&n) {
                    return Err(invalid(line, "not from 0 to 65535"));
                }
                // 0 turns $SYS off, in both.
                self.server.set(key, n.to_string(), f);
            }
            "clientid_prefixes" => {
                self.server
                    .set(key, format!("[{}]", string(&line.value)), f);
            }
            // [storage]
            "persistence" | "retained_persistence" => {
                if parse_bool(line)? {
                    self.storage = Some(f);
                } else {
                    self.storage = None;
                }
            }
            "persistence_location" => self.persistence_location = Some((line.value.clone(), f)),
            // [logging]
            "connection_messages" => {
                let v = parse_bool(line)?;
                self.logging.set(key, v.to_string(), f);
            }
            "log_type" => self.log_types.push((line.value.clone(), f)),
            "log_dest" => self.log_dests.push((line.value.clone(), f)),
            "connection" => {
                let name = line.value.clone();
                if name.is_empty() {
                    return Err(invalid(line, "a bridge needs a name"));
                }
                let mut b = Bridge::default();
                b.table.set("name", string(&name), f.clone());
                self.bridges.push(b);
                self.current_bridge = Some(self.bridges.len() - 1);
            }
            "topic" => return Err(invalid(line, "topic outside a bridge (connection)")),
            _ => match no_equivalent(key) {
                Some(why) => self.note(line, why),
                None => self.note(line, "not a mosquitto 2.0 option (mosquitto refuses it)"),
            },
        }
        Ok(())
    }

    fn bridge_line(&mut self, line: &Line) -> Result<(), ImportError> {
        let Some(i) = self.current_bridge else {
            return Err(invalid(line, "a bridge option before any connection line"));
        };
        let key = line.key.as_str();
        let words = line.words();
        let f = from(line);
        if let Some(why) = bridge_no_equivalent(key) {
            self.note(line, why);
            return Ok(());
        }
        match key {
            "bridge_insecure" => {
                if parse_bool(line)? {
                    return Err(refused(
                        line,
                        "a Mercurio bridge always checks that the remote's certificate names \
                         the host it connects to; set the name the certificate carries with \
                         tls_server_name in the converted [[bridges]] table, then remove the line",
                    ));
                }
                self.same(line, "the remote certificate's host name is always checked");
                return Ok(());
            }
            "bridge_require_ocsp" => {
                if parse_bool(line)? {
                    return Err(refused(
                        line,
                        "Mercurio bridges do not check the remote certificate's OCSP status; \
                         remove the line to bridge without it",
                    ));
                }
                self.same(line, "OCSP is not asked for");
                return Ok(());
            }
            "bridge_tls_version" => {
                match words.first().copied() {
                    Some("tlsv1.2") => self.same(
                        line,
                        "the bridge speaks TLS 1.2 or 1.3, whichever the remote prefers",
                    ),
                    Some("tlsv1.3") | Some("tlsv1.1") => {
                        return Err(refused(
                            line,
                            "a Mercurio bridge speaks TLS 1.2 or 1.3, whichever the remote \
                             prefers, and cannot be held to one version; use tlsv1.2 or remove \
                             the line",
                        ))
                    }
                    _ => return Err(invalid(line, "not tlsv1.3, tlsv1.2 or tlsv1.1")),
                }
                return Ok(());
            }
            _ => {}
        }
        let b = &mut self.bridges[i];
        match key {
            "address" | "addresses" => {
                let mut list = Vec::new();
                for w in words.iter().take_while(|w| !w.starts_with('#')) {
                    let with_port = match w.rsplit_once(':') {
                        Some((_, port)) if port.parse::<u16>().is_ok_and(|p| p > 0) => {
                            w.to_string()
                        }
                        Some(_) if w.matches(':').count() == 1 => {
                            return Err(invalid(line, "not a port from 1 to 65535"))
                        }
                        // A bare IPv6 address needs a port in mosquitto too.
                        _ => format!("{w}:1883"),
                    };
                    list.push(string(&with_port));
                }
                if list.is_empty() {
                    return Err(invalid(line, "no address"));
                }
                b.table
                    .set("addresses", format!("[{}]", list.join(", ")), f);
            }
            "notification_topic" => b.table.set(key, string(&line.value), f),
            "round_robin" | "cleansession" | "notifications" | "try_private" => {
                let v = parse_bool(line)?;
                let name = if key == "cleansession" {
                    "clean_start"
                } else {
                    key
                };
                b.table.set(name, v.to_string(), f);
            }
            "remote_clientid" | "clientid" => b.table.set("client_id", string(&line.value), f),
            "remote_username" | "username" => b.table.set("username", string(&line.value), f),
            "remote_password" | "password" => {
                b.table.set("password", string(&line.value), f.clone());
                self.cautions.push(format!(
                    "{f}: the bridge password is written in this file, which the packaged \
                     service leaves readable by every user: move it to a file of its own \
                     (chmod 600) named by password_file"
                ));
            }
            "bridge_cafile" => b.table.set("cafile", string(&line.value), f),
            "bridge_certfile" => b.table.set("certfile", string(&line.value), f),
            "bridge_keyfile" => b.table.set("keyfile", string(&line.value), f),
            "keepalive_interval" => {
                let n = parse_int(line)?;
                if !(5..=65_535).contains(&n) {
                    return Err(invalid(line, "not from 5 to 65535"));
                }
                b.table.set("keepalive", n.to_string(), f);
            }
            "bridge_protocol_version" => {
                let v = match words.first().copied() {
                    Some("mqttv50") => "mqttv5",
                    Some("mqttv311") => "mqttv311",
                    Some("mqttv31") => {
                        self.bridges[i]
                            .table
                            .set("protocol_version", string("mqttv311"), f);
                        self.note(line, "bridges speak MQTT 5.0 or 3.1.1: 3.1.1 is used");
                        return Ok(());
                    }
                    _ => return Err(invalid(line, "not mqttv50, mqttv311 or mqttv31")),
                };
                b.table.set("protocol_version", string(v), f);
            }
            "topic" => {
                let mut t = Table::default();
                let unquote = |w: &str| {
                    if w == "\"\"" {
                        String::new()
                    } else {
                        w.to_string()
                    }
                };
                // The pattern may be `#`; a `#` word after it starts a comment.
                let Some(pattern) = words.first() else {
                    return Err(invalid(line, "empty topic"));
                };
                let words: Vec<&str> = std::iter::once(*pattern)
                    .chain(
                        words[1..]
                            .iter()
                            .copied()
                            .take_while(|w| !w.starts_with('#')),
                    )
                    .collect();
                t.set("pattern", string(&unquote(pattern)), f.clone());
                let f = String::new();
                let direction = match words.get(1).map(|w| w.to_ascii_lowercase()) {
                    None => "out".to_string(),
                    Some(d) if ["in", "out", "both"].contains(&d.as_str()) => d,
                    Some(_) => return Err(invalid(line, "direction not in, out or both")),
                };
                t.set("direction", string(&direction), f.clone());
                let qos = match words.get(2) {
                    None => 0,
                    Some(q) => match q.parse::<u8>() {
                        Ok(q) if q <= 2 => q,
                        _ => return Err(invalid(line, "QoS not 0, 1 or 2")),
                    },
                };
                t.set("qos", qos.to_string(), f.clone());
                if let Some(p) = words.get(3).map(|w| unquote(w)).filter(|p| !p.is_empty()) {
                    t.set("local_prefix", string(&p), f.clone());
                }
                if let Some(p) = words.get(4).map(|w| unquote(w)).filter(|p| !p.is_empty()) {
                    t.set("remote_prefix", string(&p), f.clone());
                }
                if pattern == &"\"\"" && words.len() < 4 {
                    return Err(invalid(line, "an empty pattern needs a prefix"));
                }
                b.topics.push(t);
            }
            _ => {}
        }
        Ok(())
    }

    /// The logging level for mosquitto's `log_type` lines (the most verbose wins; mosquitto's
    /// default is error, warning, notice and information: `info`).
    fn logging_level(&mut self) {
        let types = std::mem::take(&mut self.log_types);
        let mut best: Option<(usize, String)> = None;
        const LEVELS: [&str; 5] = ["off", "error", "warn", "info", "debug"];
        for (value, f) in &types {
            for t in value.split_whitespace() {
                let level = match t {
                    "none" => 0,
                    "error" => 1,
                    "warning" => 2,
                    "notice" | "information" => 3,
                    "subscribe" | "unsubscribe" | "websockets" => {
                        self.notes.push(format!(
                            "{f}: `{t}` is no separate type in Mercurio; such events are \
                             logged at debug level"
                        ));
                        3
                    }
                    "debug" | "all" => 4,
                    _ => {
                        self.notes
                            .push(format!("{f}: `{t}` is not a mosquitto log type"));
                        continue;
                    }
                };
                if best.as_ref().is_none_or(|(b, _)| level > *b) {
                    best = Some((level, f.clone()));
                }
            }
        }
        if let Some((level, f)) = best {
            if level != 3 {
                self.logging.set("level", string(LEVELS[level]), f);
            }
        }
        // Every log_type line is named: by the level it set, or here.
        for (_, f) in &types {
            let named = self.logging.get("level").is_some_and(|e| &e.from == f)
                || self.notes.iter().any(|n| n.starts_with(f.as_str()));
            if !named {
                self.same.push(format!(
                    "{f}: within [logging] level = \"info\" (Mercurio's default)"
                ));
            }
        }
    }

    /// `[logging] file` and `syslog` from `log_dest` lines.
    fn logging_dest(&mut self) {
        let dests = std::mem::take(&mut self.log_dests);
        let mut console = false;
        for (value, f) in &dests {
            let (kind, rest) = match value.split_once(char::is_whitespace) {
                Some((k, r)) => (k, r.trim()),
                None => (value.as_str(), ""),
            };
            match kind {
                "stdout" => {
                    console = true;
                    self.same
                        .push(format!("{f}: mercuriod logs to standard output by default"));
                }
                "stderr" => {
                    console = true;
                    self.notes
                        .push(format!("{f}: mercuriod logs to standard output"));
                }
                "file" => {
                    self.logging.set("file", string(rest), f.clone());
                    if !rest.starts_with("/var/log/mercurio/") {
                        self.cautions.push(format!(
                            "{f}: under the provided systemd unit mercuriod may write only \
                             under /var/log/mercurio"
                        ));
                    }
                }
                "syslog" => self.logging.set("syslog", "true".into(), f.clone()),
                "topic" => self
                    .notes
                    .push(format!("{f}: the log is not published on $SYS/broker/log")),
                "dlt" => self
                    .notes
                    .push(format!("{f}: no Diagnostic Log and Trace output")),
                "none" => self.logging.set("level", string("off"), f.clone()),
                _ => self.notes.push(format!("{f}: not a mosquitto destination")),
            }
        }
        let elsewhere = self.logging.get("file").is_some() || self.logging.get("syslog").is_some();
        if console && elsewhere {
            self.cautions.push(
                "log_dest stdout with file or syslog: mercuriod writes to the file and/or \
                 syslog instead of standard output"
                    .to_string(),
            );
        }
    }

    /// The listeners mosquitto would open, in its order: command line and `port` first, then
    /// each `listener`.
    fn final_listeners(&mut self) -> Vec<Listener> {
        let mut all = Vec::new();
        let d = std::mem::take(&mut self.default_listener);
        if d.used {
            let mut d = d;
            if d.port.is_none() {
                d.port = Some(1883);
            }
            all.push(d);
        } else if self.per_listener && !d.security.table.entries.is_empty() {
            for e in &d.security.table.entries {
                self.notes.push(format!(
                    "{}: before any listener with per_listener_settings true, for a default \
                     listener mosquitto does not open: ignored, as by mosquitto",
                    e.from
                ));
            }
        }
        all.append(&mut self.listeners);
        all
    }

    fn finish(mut self, source: &Path, bridges_supported: bool) -> Converted {
        self.logging_level();
        self.logging_dest();
        let local_only = !self.configured_listener;
        let mut listeners = self.final_listeners();

        let mut out = String::new();
        let _ = writeln!(
            out,
            "# mercuriod configuration converted from {} by mercurioctl config import-mosquitto.",
            source.display()
        );
        let _ = writeln!(
            out,
            "# Each key names the mosquitto line it comes from. Check it with:\n#   mercuriod -c FILE --check-config"
        );

        // [server]
        let mut server = std::mem::take(&mut self.server);
        let qos: Vec<(u8, String)> = listeners.iter().filter_map(|l| l.max_qos.clone()).collect();
        if let Some((lowest, f)) = qos.iter().min_by_key(|(q, _)| *q).cloned() {
            if qos.len() < listeners.len() || qos.iter().any(|(q, _)| *q != lowest) {
                self.notes.push(format!(
                    "{f}: max_qos applies to every listener in Mercurio: the lowest, {lowest}, \
                     is used for all"
                ));
            }
            server.set("max_qos", lowest.to_string(), f);
        }
        // allow_zero_length_clientid: global in Mercurio.
        let zero: Vec<(bool, String)> = if self.per_listener {
            listeners
                .iter()
                .filter_map(|l| l.security.zero_length.clone())
                .collect()
        } else {
            self.security.zero_length.clone().into_iter().collect()
        };
        if let Some((_, f)) = zero
            .iter()
            .find(|(v, _)| *v)
            .filter(|_| zero.iter().all(|(v, _)| *v))
        {
            server.set("allow_zero_length_clientid", "true".into(), f.clone());
        }
        if let Some((_, f)) = zero.iter().find(|(v, _)| !v) {
            if self.per_listener && (zero.len() < listeners.len() || zero.iter().any(|(v, _)| *v)) {
                self.notes.push(format!(
                    "{f}: allow_zero_length_clientid applies to every listener in Mercurio: \
                     false is used for all"
                ));
            }
            server.set("allow_zero_length_clientid", "false".into(), f.clone());
        }
        if server.get("message_size_limit").is_some() {
            // Written as given; a payload over it is dropped as mosquitto does.
        }

        let mut defaults = Vec::new();
        for (key, value, why) in [
            (
                "max_packet_size",
                "268435455",
                "mosquitto accepts packets of any size by default; Mercurio 1 MiB",
            ),
            (
                "receive_maximum",
                "20",
                "mosquitto lets a client send 20 unacknowledged QoS 1/2 messages; Mercurio 1024",
            ),
            (
                "max_queued_messages",
                "1000",
                "mosquitto queues 1000 messages per client; Mercurio 10000 (QoS 0: 1000)",
            ),
        ] {
            if server.get(key).is_none() {
                defaults.push(format!("# {key} = {value}  # {why}"));
            }
        }
        if !server.entries.is_empty() || !defaults.is_empty() {
            out.push_str("\n[server]\n");
            server.write(&mut out, "");
            if !defaults.is_empty() {
                out.push_str("# mosquitto's defaults where Mercurio's differ (uncomment to keep mosquitto's):\n");
                for d in defaults {
                    out.push_str(&d);
                    out.push('\n');
                }
            }
        }

        // [[listeners]]
        if local_only && listeners.is_empty() {
            out.push_str(
                "\n# No listener or port line: mosquitto's local-only mode (loopback, port 1883).\n",
            );
            out.push_str("[[listeners]]\nhost = \"127.0.0.1\"\nport = 1883\n");
            self.cautions.push(
                "(no listener or port line): mosquitto's local-only mode also listens on ::1; \
                 add a listener with host = \"::1\" for IPv6 clients"
                    .to_string(),
            );
        }
        for l in &mut listeners {
            out.push_str("\n[[listeners]]\n");
            let from = if l.from.is_empty() {
                "the default listener of mosquitto (port 1883)".to_string()
            } else {
                l.from.clone()
            };
            let host = match (&l.host, &l.ipv6) {
                (Some((h, f)), _) => format!("host = {}  # {f}", string(h)),
                (None, Some((true, f))) => format!("host = \"::\"  # {from}, {f}"),
                (None, Some((false, f))) => format!("host = \"0.0.0.0\"  # {from}, {f}"),
                (None, None) => format!(
                    "host = \"0.0.0.0\"  # {from}: every IPv4 interface (mosquitto also listened on IPv6: use host = \"::\" for both where the system maps IPv4 into IPv6)"
                ),
            };
            out.push_str(&host);
            out.push('\n');
            let _ = writeln!(out, "port = {}", l.port.unwrap_or(1883));
            let websocket = l
                .table
                .get("protocol")
                .is_some_and(|e| e.value == "\"websocket\"");
            if !websocket {
                if let Some(e) = l.table.remove("http_dir") {
                    self.notes.push(format!(
                        "{}: http_dir is served by websockets listeners only (mosquitto ignores it here too)",
                        e.from
                    ));
                }
            }
            if let Some((capath, f)) = l.capath.take() {
                if l.table.get("ca_file").is_none() {
                    let bundle = format!("{}.pem", capath.trim_end_matches('/'));
                    l.table.set("ca_file", string(&bundle), f.clone());
                    self.notes.push(format!(
                        "{f}: capath: Mercurio reads CA certificates from one PEM file; create it with: cat {}/*.crt {}/*.pem > {bundle}",
                        capath.trim_end_matches('/'),
                        capath.trim_end_matches('/'),
                    ));
                } else {
                    self.notes.push(format!(
                        "{f}: capath: the cafile of this listener is used; add the certificates of capath to it"
                    ));
                }
            }
            if l.table.get("cert_file").is_none() || l.table.get("key_file").is_none() {
                for key in [
                    "cert_file",
                    "key_file",
                    "ca_file",
                    "crl_file",
                    "require_certificate",
                    "use_identity_as_username",
                ] {
                    if let Some(e) = l.table.remove(key) {
                        self.notes.push(format!(
                            "{}: TLS needs both certfile and keyfile on the listener (mosquitto refuses one without the other)",
                            e.from
                        ));
                    }
                }
            }
            l.table.write(&mut out, "");
            if self.per_listener {
                let sec = &l.security.table;
                if sec.get("allow_anonymous").is_none() {
                    let _ = writeln!(
                        out,
                        "allow_anonymous = {}  # mosquitto's default for a listener with per_listener_settings",
                        local_only
                    );
                }
                sec.write(&mut out, "");
            }
        }

        // [auth]
        out.push_str("\n[auth]\n");
        if self.per_listener {
            out.push_str(
                "# per_listener_settings true: each listener has its own allow_anonymous, password_file and acl_file.\nallow_anonymous = false\n",
            );
        } else {
            if self.security.table.get("allow_anonymous").is_none() {
                if local_only {
                    out.push_str("allow_anonymous = true  # mosquitto's local-only mode\n");
                } else {
                    out.push_str(
                        "allow_anonymous = false  # mosquitto 2's default once a listener is configured\n",
                    );
                }
            }
            self.security.table.write(&mut out, "");
        }

        // [storage]
        if let Some(f) = self.storage.take() {
            let (dir, dir_from) = self.persistence_location.clone().unwrap_or_else(|| {
                (
                    String::new(),
                    "no persistence_location: the directory mercuriod runs in".into(),
                )
            });
            let path = PathBuf::from(&dir).join("mercurio.db");
            let path = path.to_string_lossy();
            out.push_str("\n[storage]\n");
            let _ = writeln!(out, "backend = \"sqlite\"  # {f}");
            let _ = writeln!(
                out,
                "path = {}  # {dir_from}; Mercurio's own file (mosquitto.db cannot be read)",
                string(&path),
            );
            if !path.starts_with("/var/lib/mercurio/") && !dir.is_empty() {
                self.cautions.push(format!(
                    "{f}: the database is {path}; under the provided systemd unit mercuriod may write only under /var/lib/mercurio"
                ));
            }
        }

        // [logging]
        if !self.logging.entries.is_empty() {
            out.push_str("\n[logging]\n");
            self.logging.write(&mut out, "");
        }

        // [[bridges]]
        if !self.bridges.is_empty() {
            let prefix = if bridges_supported { "" } else { "# " };
            if !bridges_supported {
                out.push_str(
                    "\n# This version of Mercurio has no bridges: the bridges below are commented out.\n",
                );
                self.notes.push(format!(
                    "connection: {} bridge(s) written commented out (no bridges in this version)",
                    self.bridges.len()
                ));
            }
            for b in &mut self.bridges {
                for (key, value) in [
                    ("round_robin", "false"),
                    ("protocol_version", "\"mqttv311\""),
                    ("clean_start", "false"),
                    ("keepalive", "60"),
                    ("notifications", "true"),
                ] {
                    if b.table.get(key).is_none() {
                        b.table
                            .set(key, value.to_string(), "mosquitto's default".to_string());
                    }
                }
                let _ = writeln!(out, "\n{prefix}[[bridges]]");
                b.table.write(&mut out, prefix);
                for t in &b.topics {
                    let _ = writeln!(out, "\n{prefix}[[bridges.topics]]");
                    t.write(&mut out, prefix);
                }
            }
        }

        let not_carried = self.notes.len();
        let mut head = String::new();
        for (title, list) in [
            ("Not carried over", &self.notes),
            ("Carried over, but check", &self.cautions),
            ("Nothing to write (Mercurio behaves so already)", &self.same),
        ] {
            if !list.is_empty() {
                let _ = writeln!(head, "#\n# {title}:");
                for n in list {
                    let _ = writeln!(head, "#   {n}");
                }
            }
        }
        if !head.is_empty() {
            // After the two header lines.
            let at = out
                .match_indices('\n')
                .nth(2)
                .map(|(i, _)| i + 1)
                .unwrap_or(out.len());
            out.insert_str(at, &head);
        }
        Converted {
            toml: out,
            not_carried,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_as_mosquitto() {
        assert_eq!(parse_duration("1h"), Some(3600));
        assert_eq!(parse_duration("2d"), Some(172_800));
        assert_eq!(parse_duration("1w"), Some(604_800));
        assert_eq!(parse_duration("1m"), Some(2_592_000));
        assert_eq!(parse_duration("1y"), Some(31_536_000));
        // mosquitto refuses a number without unit, 0, and anything else.
        assert_eq!(parse_duration("3600"), None);
        assert_eq!(parse_duration("0d"), None);
        assert_eq!(parse_duration("d"), None);
        assert_eq!(parse_duration("1s"), None);
    }
}
