//! Reading the configuration file: TOML into [`Config`], with every error located at a line.
//!
//! The file is parsed twice: by `toml` into the typed [`Config`] (unknown keys, wrong types and
//! bad enum values are refused there) and by `toml_edit` into a document that keeps the spans,
//! which turns an error's byte offset into a key path and a line, and a
//! [`ConfigError`](crate::config::ConfigError)'s key path into a line.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::config::ranges::range_of;
use crate::config::{Config, ListenerConfig, DAEMON_BUSY_POLL};
use toml_edit::{Array, ArrayOfTables, ImDocument, Item, TableLike, Value};

/// A configuration that cannot be used. Its `Display` is one line:
/// `FILE:LINE: KEY: MESSAGE`, where the line and the key are left out when unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub key: Option<String>,
    pub message: String,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ": {key}")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for LoadError {}

/// Reads and checks the configuration file at `path`, for a SIGHUP reload: the files it
/// names are not opened here (one that cannot be read keeps its previous contents in force,
/// and the broker's reload says so).
pub fn load(path: &Path) -> Result<Config, LoadError> {
    let text = read(path)?;
    parse_with_ports(path, &text, &[])
}

/// Reads and checks the configuration file at `path` to start the broker (or for
/// `--check-config`); `ports` (`mercuriod -p`), when not empty, replace the default listener
/// of a file without `[[listeners]]` by one on 127.0.0.1 per port, and are refused for a file
/// with listeners. Each file the configuration names (see [`named_files`]) must be readable:
/// one that is not is an error naming its key and line.
pub fn load_with_ports(path: &Path, ports: &[u16]) -> Result<Config, LoadError> {
    let text = read(path)?;
    let config = parse_with_ports(path, &text, ports)?;
    check_named_files(path, &text, &config)?;
    Ok(config)
}

fn read(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|e| LoadError {
        file: path.to_path_buf(),
        line: None,
        key: None,
        message: format!("cannot read: {e}"),
    })
}

/// The files a configuration names, with their key paths (`auth.password_file`,
/// `listeners[1].cert_file`, `bridges[0].cafile`...), and whether each is a directory.
pub fn named_files<'a>(config: &'a Config) -> Vec<(String, &'a Path, bool)> {
    let mut files = Vec::new();
    let mut add = |key: String, path: &'a Option<PathBuf>, dir: bool| {
        if let Some(p) = path {
            files.push((key, p.as_path(), dir));
        }
    };
    add(
        "auth.password_file".into(),
        &config.auth.password_file,
        false,
    );
    add("auth.acl_file".into(), &config.auth.acl_file, false);
    for (i, l) in config.listeners.iter().enumerate() {
        for (name, path) in [
            ("cert_file", &l.cert_file),
            ("key_file", &l.key_file),
            ("ca_file", &l.ca_file),
            ("crl_file", &l.crl_file),
            ("password_file", &l.password_file),
            ("acl_file", &l.acl_file),
        ] {
            add(format!("listeners[{i}].{name}"), path, false);
        }
        add(format!("listeners[{i}].http_dir"), &l.http_dir, true);
    }
    for (i, b) in config.bridges.iter().enumerate() {
        for (name, path) in [
            ("cafile", &b.cafile),
            ("certfile", &b.certfile),
            ("keyfile", &b.keyfile),
            ("password_file", &b.password_file),
        ] {
            add(format!("bridges[{i}].{name}"), path, false);
        }
    }
    add("storage.url_file".into(), &config.storage.url_file, false);
    let c = &config.cluster;
    for (name, path) in [
        ("credentials_file", &c.credentials_file),
        ("password_file", &c.password_file),
        ("token_file", &c.token_file),
        ("ca_file", &c.ca_file),
        ("cert_file", &c.cert_file),
        ("key_file", &c.key_file),
    ] {
        add(format!("cluster.{name}"), path, false);
    }
    files
}

/// Credentials that users other than the broker's may read, one warning each: the
/// configuration file `path` itself when it is readable by others (mode & 0o004) and holds a
/// bridge's `password`, or a `[storage] url` or `[cluster] peer_storage` URL with a password, and each `password_file` or
/// `url_file` readable by others. mercuriod logs them once at start; `--check-config` prints
/// them.
pub fn credential_warnings(path: &Path, config: &Config) -> Vec<String> {
    use crate::credentials::readable_by_others;
    let mut warnings = Vec::new();
    let mut inline = Vec::new();
    for (i, b) in config.bridges.iter().enumerate() {
        if b.password.is_some() {
            inline.push(format!("bridges[{i}].password"));
        }
    }
    if config.storage.url.as_deref().is_some_and(url_has_password) {
        inline.push("storage.url".to_string());
    }
    for (node, url) in &config.cluster.peer_storage {
        if url_has_password(url) {
            inline.push(format!("cluster.peer_storage.{node}"));
        }
    }
    if !inline.is_empty() && readable_by_others(path) {
        warnings.push(format!(
            "{} is readable by every user and holds a credential ({}): move it to a file only \
             the broker can read (password_file, url_file; chmod 600)",
            path.display(),
            inline.join(", ")
        ));
    }
    let mut files = Vec::new();
    for (i, b) in config.bridges.iter().enumerate() {
        if let Some(f) = &b.password_file {
            files.push((format!("bridges[{i}].password_file"), f));
        }
    }
    if let Some(f) = &config.storage.url_file {
        files.push(("storage.url_file".to_string(), f));
    }
    let c = &config.cluster;
    for (name, path) in [
        ("credentials_file", &c.credentials_file),
        ("password_file", &c.password_file),
        ("token_file", &c.token_file),
    ] {
        if let Some(f) = path {
            files.push((format!("cluster.{name}"), f));
        }
    }
    for (key, file) in files {
        if readable_by_others(file) {
            warnings.push(format!(
                "{key}: {} is readable by every user: make it readable by the broker only \
                 (chmod 600, owned by the broker's user)",
                file.display()
            ));
        }
    }
    warnings
}

/// Whether a PostgreSQL connection string carries a password: `postgres://user:PASSWORD@...`
/// or `password=...` in the key-value form.
fn url_has_password(url: &str) -> bool {
    match url.split_once("://") {
        Some((_, rest)) => rest
            .split(['/', '?'])
            .next()
            .and_then(|authority| authority.rsplit_once('@'))
            .is_some_and(|(userinfo, _)| userinfo.contains(':')),
        None => url
            .split_whitespace()
            .any(|pair| pair.trim_start().starts_with("password=")),
    }
}

/// Each file of [`named_files`] can be opened (a directory read): an error names the key,
/// its line in `text` and the file.
fn check_named_files(path: &Path, text: &str, config: &Config) -> Result<(), LoadError> {
    for (key, file, dir) in named_files(config) {
        let opened = if dir {
            std::fs::read_dir(file).map(drop)
        } else {
            std::fs::File::open(file).and_then(|f| {
                if f.metadata()?.is_dir() {
                    Err(std::io::Error::other("is a directory, not a file"))
                } else {
                    Ok(())
                }
            })
        };
        if let Err(e) = opened {
            let root = match ImDocument::parse(text) {
                Ok(doc) => locate(Node::Table(doc.as_table()), &key),
                Err(_) => None,
            };
            return Err(LoadError {
                file: path.to_path_buf(),
                line: root.map(|s| line_of(text, s.start)),
                key: Some(key),
                message: format!("cannot read {}: {e}", file.display()),
            });
        }
    }
    Ok(())
}

/// Parses and checks `text`, the contents of the file `path` (used in messages only).
///
/// Rules of the file mode: `[auth] allow_anonymous` unset means false, `[server] busy_poll`
/// unset means [`DAEMON_BUSY_POLL`] (0, as the library's), and a file without
/// `[[listeners]]` gets the default listener (127.0.0.1:1883). Then [`Config::validate`].
pub fn parse(path: &Path, text: &str) -> Result<Config, LoadError> {
    parse_with_ports(path, text, &[])
}

/// [`parse`], with the ports of `mercuriod -p` (see [`load_with_ports`]).
pub fn parse_with_ports(path: &Path, text: &str, ports: &[u16]) -> Result<Config, LoadError> {
    let error = |span: Option<Range<usize>>, key: Option<String>, message: &str| LoadError {
        file: path.to_path_buf(),
        line: span.map(|s| line_of(text, s.start)),
        key,
        message: one_line(message),
    };

    let doc = ImDocument::parse(text).map_err(|e| {
        if looks_like_mosquitto(text) {
            LoadError {
                file: path.to_path_buf(),
                line: None,
                key: None,
                message: format!(
                    "this is a mosquitto.conf, not a mercuriod TOML file; convert it with: \
                     mercurioctl config import-mosquitto {} > mercuriod.toml",
                    path.display()
                ),
            }
        } else if let Some((key, message)) =
            e.span().and_then(|span| unquoted_word(text, span.start))
        {
            error(e.span(), Some(key), &message)
        } else {
            error(e.span(), None, e.message())
        }
    })?;
    let root = Node::Table(doc.as_table());

    let mut config: Config = toml::from_str(text).map_err(|e| {
        let key = e.span().and_then(|s| key_at(root, s.start, String::new()));
        let message = match &key {
            // `[bridges]` where `[[bridges]]` was meant: serde's words do not say so.
            Some(k)
                if e.message()
                    .starts_with("invalid type: map, expected a sequence") =>
            {
                format!("write [[{k}]], not [{k}]: each entry is a table of its own")
            }
            _ => with_suggestion(&in_plain_words(e.message(), key.as_deref())),
        };
        error(e.span(), key, &message)
    })?;

    if !is_set(root, "auth.allow_anonymous") {
        config.auth.allow_anonymous = Some(false);
    }
    if !is_set(root, "server.busy_poll") {
        config.server.busy_poll = DAEMON_BUSY_POLL;
    }
    if !ports.is_empty() {
        if let Some(span) = locate(root, "listeners") {
            return Err(error(
                Some(span),
                Some("listeners".into()),
                "-p/--port sets the port of a configuration without [[listeners]]; set port in \
                 this file's listeners instead",
            ));
        }
        config.listeners = ports
            .iter()
            .map(|&port| ListenerConfig {
                port,
                ..ListenerConfig::default()
            })
            .collect();
    }
    if config.listeners.is_empty() {
        return Err(error(
            locate(root, "listeners"),
            Some("listeners".into()),
            "no listener: leave `listeners` out for the default 127.0.0.1:1883, or add a [[listeners]] table",
        ));
    }
    config.validate().map_err(|e| {
        let span = locate(root, &e.key);
        error(span, Some(e.key), &e.message)
    })?;
    Ok(config)
}

/// Whether `text`, which is not valid TOML, reads like a mosquitto.conf: `key value` lines
/// with keys of mosquitto's, and no `[table]`.
fn looks_like_mosquitto(text: &str) -> bool {
    const KEYS: [&str; 24] = [
        "listener",
        "port",
        "allow_anonymous",
        "password_file",
        "acl_file",
        "per_listener_settings",
        "persistence",
        "persistence_location",
        "persistence_file",
        "log_dest",
        "log_type",
        "include_dir",
        "pid_file",
        "user",
        "connection",
        "address",
        "protocol",
        "certfile",
        "keyfile",
        "cafile",
        "max_inflight_messages",
        "max_queued_messages",
        "bind_address",
        "autosave_interval",
    ];
    let mut lines = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'));
    // A TOML file with a typo still has its [tables].
    if lines.clone().any(|l| l.starts_with('[')) {
        return false;
    }
    lines.any(|l| {
        let mut words = l.split_whitespace();
        let key = words.next().unwrap_or("");
        KEYS.contains(&key)
            && words
                .next()
                .is_some_and(|w| w != "=" && !w.starts_with('='))
    })
}

/// A value written without quotes on the line at `offset` (`allow_anonymous = True`,
/// `protocol = websocket`), which TOML refuses with "invalid string; expected `"`, `'`":
/// the key path and what to write instead.
fn unquoted_word(text: &str, offset: usize) -> Option<(String, String)> {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next()?;
    let (key, value) = line.split_once('=')?;
    let key = key.trim();
    let value = value.split('#').next()?.trim();
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.';
    if key.is_empty()
        || !value.starts_with(|c: char| c.is_ascii_alphabetic())
        || !value.chars().all(word)
    {
        return None;
    }
    let path = match table_path(&text[..start]) {
        Some(table) => format!("{table}.{key}"),
        None => key.to_string(),
    };
    let message = match value.to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" => format!(
            "`{value}` is not a TOML value: booleans are lowercase and unquoted, write {key} = true"
        ),
        "false" | "no" | "off" => format!(
            "`{value}` is not a TOML value: booleans are lowercase and unquoted, write {key} = false"
        ),
        _ => format!("`{value}` is not a TOML value: a string is quoted, write {key} = \"{value}\""),
    };
    Some((path, message))
}

/// Path of the table the text `before` ends in (`server`, `listeners[1]`,
/// `bridges[0].topics[2]`), from its `[table]` and `[[array]]` headers; `None` at the root.
fn table_path(before: &str) -> Option<String> {
    // Entries seen so far of each array of tables, by its dotted name.
    let mut counts: Vec<(String, usize)> = Vec::new();
    let mut current = None;
    for line in before.lines().map(str::trim) {
        let (name, array) = if let Some(rest) = line.strip_prefix("[[") {
            (rest.split("]]").next().unwrap_or("").trim(), true)
        } else if let Some(rest) = line.strip_prefix('[') {
            (rest.split(']').next().unwrap_or("").trim(), false)
        } else {
            continue;
        };
        if array {
            let nested = format!("{name}.");
            counts.retain(|(n, _)| !n.starts_with(&nested));
            match counts.iter_mut().find(|(n, _)| n == name) {
                Some((_, count)) => *count += 1,
                None => counts.push((name.to_string(), 1)),
            }
        }
        let mut path = String::new();
        let mut prefix = String::new();
        for part in name.split('.').map(str::trim) {
            if !prefix.is_empty() {
                prefix.push('.');
                path.push('.');
            }
            prefix.push_str(part);
            path.push_str(part);
            if let Some((_, count)) = counts.iter().find(|(n, _)| *n == prefix) {
                path.push_str(&format!("[{}]", count - 1));
            }
        }
        current = Some(path);
    }
    current
}

/// The word of `candidates` closest to `word` (edit distance), when it is close enough to be a
/// likely typo: at most a third of the word's length, and at least 1.
fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let most = (word.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|&(d, _)| d <= most)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Levenshtein distance between `a` and `b`, in characters (a small function rather than a
/// dependency for the one "did you mean" hint).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant") with the
/// closest expected word suggested: "unknown field `max_conections`; did you mean
/// `max_connections`? expected one of ...".
fn with_suggestion(message: &str) -> String {
    let Some((what, expected)) = message.split_once(", expected ") else {
        return message.to_string();
    };
    if !(what.starts_with("unknown field `") || what.starts_with("unknown variant `")) {
        return message.to_string();
    }
    let Some(word) = what.split('`').nth(1) else {
        return message.to_string();
    };
    let candidates = expected.split('`').skip(1).step_by(2);
    match closest(word, candidates) {
        Some(best) => format!("{what}; did you mean `{best}`? expected {expected}"),
        None => message.to_string(),
    }
}

/// Warnings about a valid configuration, one line each, for the log and `--check-config`.
pub fn warnings(config: &Config) -> Vec<String> {
    let mut warnings = Vec::new();
    if config.auth.allow_anonymous != Some(true)
        && config.auth.password_file.is_none()
        && config.auth.derived_password_secret_file.is_none()
        && config.auth.backend != crate::config::AuthBackend::Storage
    {
        warnings.push(
            "auth.allow_anonymous is not true and there is no password file: every client will be \
             refused (set allow_anonymous = true in [auth] to accept clients)"
                .to_string(),
        );
    }
    for (i, s) in config.streams.iter().enumerate() {
        if s.max_bytes == 0 {
            warnings.push(format!(
                "streams[{i}].max_bytes: stream {:?} has no byte limit: it grows {} with what \
                 is published to {:?}{}; set max_bytes to bound it",
                s.name,
                if config.storage.backend == crate::config::StorageBackend::Memory {
                    "in memory"
                } else {
                    "in storage"
                },
                s.filter,
                if s.max_age == 0 {
                    " for ever"
                } else {
                    " for max_age"
                }
            ));
        }
    }
    warnings
}

/// 1-based line of the byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// A place in the parsed document.
#[derive(Clone, Copy)]
enum Node<'a> {
    Table(&'a dyn TableLike),
    TableArray(&'a ArrayOfTables),
    Array(&'a Array),
    Leaf,
}

impl<'a> Node<'a> {
    fn of_item(item: &'a Item) -> Self {
        match item {
            Item::Table(t) => Node::Table(t),
            Item::ArrayOfTables(a) => Node::TableArray(a),
            Item::Value(v) => Node::of_value(v),
            Item::None => Node::Leaf,
        }
    }

    fn of_value(value: &'a Value) -> Self {
        match value {
            Value::InlineTable(t) => Node::Table(t),
            Value::Array(a) => Node::Array(a),
            _ => Node::Leaf,
        }
    }
}

fn contains(span: Option<Range<usize>>, offset: usize) -> bool {
    span.is_some_and(|s| s.start <= offset && offset < s.end.max(s.start + 1))
}

/// Path (`server.max_qos`, `listeners[0].port`) of the innermost key or value at `offset`.
fn key_at(node: Node<'_>, offset: usize, prefix: String) -> Option<String> {
    match node {
        Node::Table(table) => {
            for (name, item) in table.iter() {
                let path = if prefix.is_empty() {
                    name.to_string()
                } else {
                    format!("{prefix}.{name}")
                };
                if let Some((key, _)) = table.get_key_value(name) {
                    if contains(key.span(), offset) {
                        return Some(path);
                    }
                }
                if let Some(found) = key_at(Node::of_item(item), offset, path.clone()) {
                    return Some(found);
                }
                let span = match item {
                    Item::Table(t) => t.span(),
                    other => other.span(),
                };
                if contains(span, offset) {
                    return Some(path);
                }
            }
            None
        }
        Node::TableArray(tables) => {
            for (i, table) in tables.iter().enumerate() {
                let path = format!("{prefix}[{i}]");
                if let Some(found) = key_at(Node::Table(table), offset, path.clone()) {
                    return Some(found);
                }
                if contains(table.span(), offset) {
                    return Some(path);
                }
            }
            None
        }
        Node::Array(values) => {
            for (i, value) in values.iter().enumerate() {
                let path = format!("{prefix}[{i}]");
                if let Some(found) = key_at(Node::of_value(value), offset, path.clone()) {
                    return Some(found);
                }
                if contains(value.span(), offset) {
                    return Some(path);
                }
            }
            None
        }
        Node::Leaf => None,
    }
}

/// One step of a key path.
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

fn steps(path: &str) -> Vec<Step<'_>> {
    let mut steps = Vec::new();
    for part in path.split('.') {
        let (name, mut rest) = match part.find('[') {
            Some(i) => part.split_at(i),
            None => (part, ""),
        };
        if !name.is_empty() {
            steps.push(Step::Key(name));
        }
        while let Some(inner) = rest.strip_prefix('[') {
            let Some(close) = inner.find(']') else { break };
            if let Ok(i) = inner[..close].parse() {
                steps.push(Step::Index(i));
            }
            rest = &inner[close + 1..];
        }
    }
    steps
}

/// Span of the key at `path`, or of its innermost ancestor present in the file; `None` when
/// not even the first step is in the file.
/// Whether the file sets the key at `path` itself ([`locate`] also answers with the nearest
/// table when only that is there: `[server]` without `busy_poll`).
fn is_set(root: Node<'_>, path: &str) -> bool {
    let mut node = root;
    for step in steps(path) {
        node = match (step, node) {
            (Step::Key(name), Node::Table(table)) => match table.get(name) {
                Some(item) => Node::of_item(item),
                None => return false,
            },
            (Step::Index(i), Node::TableArray(tables)) => match tables.get(i) {
                Some(table) => Node::Table(table),
                None => return false,
            },
            (Step::Index(i), Node::Array(values)) => match values.get(i) {
                Some(value) => Node::of_value(value),
                None => return false,
            },
            _ => return false,
        };
    }
    true
}

fn locate(root: Node<'_>, path: &str) -> Option<Range<usize>> {
    let mut node = root;
    let mut best = None;
    for step in steps(path) {
        match (step, node) {
            (Step::Key(name), Node::Table(table)) => {
                let Some((key, item)) = table.get_key_value(name) else {
                    break;
                };
                best = key.span().or_else(|| item.span()).or(best);
                node = Node::of_item(item);
            }
            (Step::Index(i), Node::TableArray(tables)) => {
                let Some(table) = tables.get(i) else { break };
                best = table.span().or(best);
                node = Node::Table(table);
            }
            (Step::Index(i), Node::Array(values)) => {
                let Some(value) = values.get(i) else { break };
                best = value.span().or(best);
                node = Node::of_value(value);
            }
            _ => break,
        }
    }
    best
}

/// serde's message with its Rust type names said in words: "invalid value: integer `-1`,
/// expected u64" becomes "`-1` is out of range: expected a whole number, 0 or more" (or the
/// key's own range, [`range_of`], the one `Config::validate` checks, so that fixing it does
/// not lead to a second error).
fn in_plain_words(message: &str, key: Option<&str>) -> String {
    const TYPES: [(&str, &str); 8] = [
        ("u8", "a whole number from 0 to 255"),
        ("u16", "a whole number from 0 to 65535"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("u64", "a whole number, 0 or more"),
        ("usize", "a whole number, 0 or more"),
        ("i64", "a whole number"),
        ("f64", "a number"),
        ("a boolean", "true or false"),
    ];
    let Some((what, expected)) = message.rsplit_once(", expected ") else {
        return message.to_string();
    };
    let expected = match key.and_then(range_of) {
        Some(range) => range.words(),
        None => TYPES
            .iter()
            .find(|(t, _)| *t == expected)
            .map_or(expected, |(_, words)| words)
            .to_string(),
    };
    match what.strip_prefix("invalid value: integer ") {
        Some(value) => format!("{value} is out of range: expected {expected}"),
        None => format!("{what}, expected {expected}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> LoadError {
        match parse(Path::new("m.toml"), text) {
            Err(e) => e,
            Ok(c) => panic!("parsed: {c:?}"),
        }
    }

    #[test]
    fn streams_are_read_and_checked_with_their_line() {
        let text = "[auth]\nallow_anonymous = true\n[[streams]]\nname = \"a\"\nfilter = \"t/#\"\n\
                    max_bytes = 1024\n[[streams]]\nname = \"b\"\nfilter = \"u/#\"\n";
        let c = parse(Path::new("m.toml"), text).expect("parse");
        assert_eq!(c.streams.len(), 2);
        assert_eq!(c.streams[0].max_bytes, 1024);
        let w = warnings(&c);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("streams[1].max_bytes: stream \"b\""),
            "{w:?}"
        );
        let e = err("[[streams]]\nname = \"a\"\nfilter = \"t/#/x\"\n").to_string();
        assert!(e.contains("streams[0].filter"), "{e}");
        assert!(e.starts_with("m.toml:3: streams[0].filter"), "{e}");
        let e = err("[[streams]]\nname = \"a\"\nfilter = \"t\"\nmax_bites = 1\n").to_string();
        assert!(e.contains("max_bites"), "{e}");
    }

    #[test]
    fn empty_file_is_the_file_mode_default() {
        let c = parse(Path::new("m.toml"), "").expect("empty file");
        assert_eq!(c.listeners, Config::default().listeners);
        assert_eq!(c.auth.allow_anonymous, Some(false));
        let c = parse(Path::new("m.toml"), "[auth]\nallow_anonymous = true\n").expect("parse");
        assert_eq!(c.auth.allow_anonymous, Some(true));
    }

    #[test]
    fn busy_poll_is_the_daemons_own_default_unless_set() {
        assert_eq!(Config::default().server.busy_poll, 0);
        let c = parse(Path::new("m.toml"), "").expect("empty file");
        assert_eq!(c.server.busy_poll, DAEMON_BUSY_POLL);
        assert_eq!(DAEMON_BUSY_POLL, 0);
        let c = parse(Path::new("m.toml"), "[server]\nbusy_poll = 0\n").expect("parse");
        assert_eq!(c.server.busy_poll, 0);
        // A [server] table without the key is still "unset".
        let c = parse(Path::new("m.toml"), "[server]\nsys_interval = 10\n").expect("parse");
        assert_eq!(c.server.busy_poll, DAEMON_BUSY_POLL);
        let c = parse(Path::new("m.toml"), "[auth]\npassword_file = \"p\"\n").expect("parse");
        assert_eq!(c.auth.allow_anonymous, Some(false));
    }

    #[test]
    fn unknown_key() {
        let e = err("[server]\nmax_qos = 1\nmax_qoss = 2\n");
        assert_eq!(e.line, Some(3));
        assert_eq!(e.key.as_deref(), Some("server.max_qoss"));
        assert!(e.message.contains("unknown field"), "{e}");
        assert_eq!(e.to_string().lines().count(), 1);
    }

    #[test]
    fn unknown_section() {
        let e = err("[server]\n\n[sever]\nmax_qos = 1\n");
        assert_eq!(e.key.as_deref(), Some("sever"));
        assert_eq!(e.line, Some(3));
    }

    #[test]
    fn wrong_type() {
        let e = err("[server]\nmax_qos = \"two\"\n");
        assert_eq!(e.key.as_deref(), Some("server.max_qos"));
        assert_eq!(e.line, Some(2));
    }

    #[test]
    fn rust_type_names_are_said_in_words() {
        let e = err("[server]\npark_after = -1\n");
        assert_eq!(e.key.as_deref(), Some("server.park_after"));
        assert_eq!(
            e.message,
            "`-1` is out of range: expected a whole number, 0 or more"
        );
        let e = err("[server]\nmax_inflight = \"many\"\n");
        assert!(
            e.message
                .ends_with("expected a whole number from 0 to 65535"),
            "{e}"
        );
    }

    #[test]
    fn a_type_error_names_the_range_the_key_takes() {
        let e = err("[server]\nbusy_poll = -1\n");
        assert_eq!(
            e.message,
            "`-1` is out of range: expected a whole number of microseconds from 0 to 1000000"
        );
        let e = err("[server]\nmax_retained_bytes = -1\n");
        assert_eq!(
            e.message,
            "`-1` is out of range: expected a whole number of bytes, 0 (unlimited) or 1024 or more"
        );
        let e = err("[server]\nqueue_high_water = \"deep\"\n");
        assert!(
            e.message.ends_with("expected a whole number, 1 or more"),
            "{e}"
        );
    }

    /// Every key whose values `Config::validate` checks against a range (found by probing
    /// each numeric key of `[server]`, `[storage]`, `[[bridges]]` and `[[bridges.topics]]`, as serde lists
    /// them, with values from 0 to the largest TOML integer) has its entry in
    /// `config::ranges::RANGES`: the out-of-range error and the type error say the same words.
    /// And every entry of the table is such a key.
    #[test]
    fn every_range_checked_key_has_its_words() {
        use crate::config::ranges::RANGES;
        const BRIDGE: &str = "[[bridges]]\nname = \"b\"\naddresses = [\"h:1\"]\n";
        const TOPIC: &str = "[[bridges.topics]]\npattern = \"t/#\"\n";
        // (the key path of the probe's error, the text before the key, the text after it)
        let tables: [(&str, String, &str); 4] = [
            ("server.", "[server]\n".into(), ""),
            ("storage.", "[storage]\n".into(), ""),
            ("bridges[0].", BRIDGE.into(), TOPIC),
            ("bridges[0].topics[0].", format!("{BRIDGE}{TOPIC}"), ""),
        ];
        let mut hit = Vec::new();
        for (prefix, before, after) in &tables {
            // serde lists the table's keys when it refuses an unknown one.
            let listed = err(&format!("{before}zzz = 1\n{after}")).message;
            let keys: Vec<&str> = listed
                .split_once("expected one of ")
                .map(|(_, k)| k.split('`').skip(1).step_by(2).collect())
                .unwrap_or_default();
            assert!(keys.len() > 3, "{listed}");
            for name in keys {
                let key = format!("{prefix}{name}");
                let text = |value: &str| format!("{before}{name} = {value}\n{after}");
                for value in [0, 1, 2, 3, 4, 255, 65535, 4294967295, i64::MAX as u64] {
                    let text = text(&value.to_string());
                    // Only values of the key's type reach validate.
                    let typed = toml::from_str::<Config>(&text).is_ok();
                    let Err(e) = parse(Path::new("m.toml"), &text) else {
                        continue;
                    };
                    if !typed || e.key.as_deref() != Some(key.as_str()) {
                        continue;
                    }
                    let Some(range) = range_of(&key) else {
                        panic!("{key} = {value} is refused ({e}) but has no range in RANGES");
                    };
                    assert_eq!(e.message, format!("must be {}, not {value}", range.words()));
                    // A value of the wrong type is refused with the same words.
                    let e = err(&format!("{before}{name} = \"x\"\n{after}"));
                    assert!(
                        e.message.ends_with(&format!("expected {}", range.words())),
                        "{e}"
                    );
                    hit.push(range.key);
                }
            }
        }
        for range in RANGES {
            assert!(
                hit.contains(&range.key),
                "{} is never range-checked",
                range.key
            );
        }
    }

    #[test]
    fn bad_value_in_second_listener() {
        let e = err(
            "[[listeners]]\nport = 1883\n\n[[listeners]]\nhost = \"::1\"\nport = 1884\n\
             protocol = \"tcp\"\n",
        );
        assert_eq!(e.key.as_deref(), Some("listeners[1].protocol"));
        assert_eq!(e.line, Some(7));
    }

    // Without the feature a `[cluster]` table is refused as a whole, before these checks.
    #[cfg(feature = "cluster")]
    #[test]
    fn cluster_errors_are_located() {
        let e = err("[cluster]\nnats_urls = [\"nats://n:4222\"]\n");
        assert_eq!(e.key.as_deref(), Some("cluster.node_name"));
        assert!(e.message.contains("required"), "{e}");
        let e = err("[cluster]\nnats_urls = [\"nats://n:4222\"]\nnode_name = \"a.b\"\n");
        assert_eq!(e.key.as_deref(), Some("cluster.node_name"));
        assert_eq!(e.line, Some(3));
        let e = err("[cluster]\nnode_name = \"a\"\nsubject_prefix = \"x..y\"\n");
        assert_eq!(e.key.as_deref(), Some("cluster.subject_prefix"));
        assert_eq!(e.line, Some(3));
        let e = err("[cluster]\nnode_name = \"a\"\n");
        assert_eq!(e.key.as_deref(), Some("cluster.nats_urls"));
        let e = err("[cluster]\nnats_urls = [\"n:1\"]\nnode_name = \"a\"\nusername = \"u\"\n");
        assert_eq!(e.key.as_deref(), Some("cluster.username"));
        assert!(e.message.contains("password_file"), "{e}");
        let e = err("[cluster]\nnats_url = [\"n:1\"]\n");
        assert!(e.message.contains("nats_url"), "{e}");
        let e =
            err("[cluster]\nnats_urls = [\"n:1\"]\nnode_name = \"a\"\njetstream_replicas = 7\n");
        assert_eq!(e.key.as_deref(), Some("cluster.jetstream_replicas"));
        assert_eq!(e.line, Some(4));
        assert!(e.message.contains("1 to 5"), "{e}");
        let e = err("[cluster]\njetstream = false\n");
        assert_eq!(e.key.as_deref(), Some("cluster.nats_urls"));
        let c = parse(
            Path::new("m.toml"),
            "[cluster]\nnats_urls = [\"nats://n:4222\"]\nnode_name = \"node-1\"\n",
        )
        .expect("a valid [cluster]");
        assert!(c.cluster.enabled());
        assert_eq!(c.cluster.prefix(), "mercurio");
        assert!(c.cluster.jetstream_on());
        assert_eq!(c.cluster.jetstream_ack_timeout().as_secs(), 30);
    }

    #[test]
    fn validation_error_is_located() {
        let e = err("# limits\n[server]\nsys_interval = 5\nmax_qos = 3\n");
        assert_eq!(
            e.to_string(),
            "m.toml:4: server.max_qos: must be 0, 1 or 2, not 3"
        );

        let e = err("[[listeners]]\nport = 1\n[[listeners]]\nport = 1\n");
        assert_eq!(e.key.as_deref(), Some("listeners[1].port"));
        assert_eq!(e.line, Some(4));

        let e = err("[[listeners]]\nport = 2\ncert_file = \"/c.pem\"\nkey_file = \"/k.pem\"\nrequire_certificate = true\n");
        assert_eq!(e.key.as_deref(), Some("listeners[0].require_certificate"));
        assert_eq!(e.line, Some(5));
        assert!(e.message.contains("needs ca_file"), "{e}");
    }

    #[test]
    fn max_retained_bytes_is_read_and_checked() {
        let c = parse(
            Path::new("m.toml"),
            "[server]\nmax_retained_bytes = 1048576\n",
        )
        .expect("parse");
        assert_eq!(c.server.max_retained_bytes, 1_048_576);
        let c = parse(Path::new("m.toml"), "[server]\nmax_retained_bytes = 0\n").expect("parse");
        assert_eq!(c.server.max_retained_bytes, 0, "0 = unlimited");
        let e = err("[server]\nsys_interval = 5\nmax_retained_bytes = 64\n");
        assert_eq!(
            e.to_string(),
            "m.toml:3: server.max_retained_bytes: must be a whole number of bytes, 0 (unlimited) or 1024 or more, not 64"
        );
    }

    #[test]
    fn max_queued_memory_is_read_and_checked() {
        let c = parse(
            Path::new("m.toml"),
            "[server]\nmax_queued_memory = 16777216\n",
        )
        .expect("parse");
        assert_eq!(c.server.max_queued_memory, 16 << 20);
        let c = parse(Path::new("m.toml"), "[server]\nmax_queued_memory = 0\n").expect("parse");
        assert_eq!(c.server.max_queued_memory, 0, "0 = no limit");
        let e = err("[server]\nsys_interval = 5\nmax_queued_memory = 16\n");
        assert_eq!(
            e.to_string(),
            "m.toml:3: server.max_queued_memory: must be a whole number of bytes, 0 (no limit) or 65536 or more, not 16"
        );
        let e = err("[server]\nmax_queued_memory = -1\n");
        assert_eq!(
            e.message,
            "`-1` is out of range: expected a whole number of bytes, 0 (no limit) or 65536 or more"
        );
    }

    #[test]
    fn stream_memory_bytes_is_at_least_64_kib() {
        let c = parse(
            Path::new("m.toml"),
            "[storage]\nstream_memory_bytes = 65536\n",
        )
        .expect("parse");
        assert_eq!(c.storage.stream_memory_bytes, 64 << 10);
        let e = err("[storage]\nstream_memory_bytes = 0\n");
        assert_eq!(
            e.to_string(),
            "m.toml:2: storage.stream_memory_bytes: must be a whole number of bytes, 65536 or more, not 0"
        );
    }

    #[test]
    fn publish_rates_are_read_and_checked() {
        let c = parse(
            Path::new("m.toml"),
            "[server]\nmax_publish_rate = 200\nmax_publish_bytes_rate = 65536\n",
        )
        .expect("parse");
        assert_eq!(c.server.max_publish_rate, 200);
        assert_eq!(c.server.max_publish_bytes_rate, 65_536);
        let e = err("[server]\nsys_interval = 5\nmax_publish_bytes_rate = 64\n");
        assert_eq!(
            e.to_string(),
            "m.toml:3: server.max_publish_bytes_rate: must be a whole number of bytes per second, 0 (unlimited) or 1024 or more, not 64"
        );
        let e = err("[server]\nmax_publish_rate = -5\n");
        assert_eq!(e.key.as_deref(), Some("server.max_publish_rate"));
        assert_eq!(e.line, Some(2));
        let e = err("[server]\n\nmax_publish_bytes_rate = -1\n");
        assert_eq!(e.line, Some(3));
        assert!(e.message.contains("0 (unlimited) or 1024 or more"), "{e}");
        let e = err("[server]\nmax_publish_rate = \"fast\"\n");
        assert_eq!(e.key.as_deref(), Some("server.max_publish_rate"));
    }

    #[test]
    fn missing_key_falls_back_to_its_table() {
        let e = err("[storage]\nstandby = true\n");
        assert_eq!(e.key.as_deref(), Some("storage.standby"));
        assert_eq!(e.line, Some(2));
        // Two listeners left at 127.0.0.1:1883: the second listener's header.
        let e = err("[[listeners]]\n\n[[listeners]]\n");
        assert_eq!(e.key.as_deref(), Some("listeners[1].port"));
        assert_eq!(e.line, Some(3));
    }

    #[test]
    fn inline_and_dotted_forms() {
        let e = err("server.max_qos = 3\n");
        assert_eq!(
            (e.key.as_deref(), e.line),
            (Some("server.max_qos"), Some(1))
        );
        let e = err("listeners = [\n  { port = 1 },\n  { port = 2, metrics = true },\n]\n");
        assert_eq!(e.key.as_deref(), Some("listeners[1].metrics"));
        assert_eq!(e.line, Some(3));
        let e = err("listeners = []\n");
        assert_eq!((e.key.as_deref(), e.line), (Some("listeners"), Some(1)));
    }

    #[test]
    fn syntax_error() {
        let e = err("[server]\nmax_qos = = 1\n");
        assert_eq!(e.line, Some(2));
        assert_eq!(e.key, None);
        assert_eq!(e.to_string().lines().count(), 1);
    }

    #[test]
    fn a_single_table_for_an_array_of_tables_says_how_to_write_it() {
        let e = err("[server]\nmax_qos = 1\n[bridges]\nname = \"a\"\n");
        assert_eq!(e.key.as_deref(), Some("bridges"));
        assert!(
            e.to_string().contains("write [[bridges]], not [bridges]"),
            "{e}"
        );
    }

    #[test]
    fn a_mosquitto_conf_is_recognised() {
        let e =
            err("# mosquitto\npid_file /run/mosquitto.pid\nlistener 1883\nallow_anonymous true\n");
        assert_eq!((e.line, e.key.as_deref()), (None, None));
        assert!(
            e.message
                .contains("mercurioctl config import-mosquitto m.toml > mercuriod.toml"),
            "{e}"
        );
        // A TOML file with a syntax error is not taken for one.
        let e = err("[server]\nport 1883\n");
        assert!(!e.message.contains("mosquitto"), "{e}");
    }

    #[test]
    fn ports_replace_the_default_listener() {
        let c = parse_with_ports(
            Path::new("m.toml"),
            "[auth]\nallow_anonymous = true\n",
            &[1884, 1885],
        )
        .expect("parse");
        let got: Vec<(&str, u16)> = c
            .listeners
            .iter()
            .map(|l| (l.host.as_str(), l.port))
            .collect();
        assert_eq!(got, [("127.0.0.1", 1884), ("127.0.0.1", 1885)]);
        let e = parse_with_ports(Path::new("m.toml"), "[[listeners]]\nport = 1\n", &[1884])
            .expect_err("listeners and -p");
        assert_eq!((e.key.as_deref(), e.line), (Some("listeners"), Some(1)));
        assert!(e.message.contains("-p/--port"), "{e}");
    }

    #[test]
    fn edit_distance_and_suggestions() {
        assert_eq!(edit_distance("sever", "server"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(
            closest("max_qoss", ["max_qos", "max_inflight"]),
            Some("max_qos")
        );
        assert_eq!(closest("frobnicate", ["max_qos", "port"]), None);
    }

    #[test]
    fn table_paths_of_headers() {
        assert_eq!(table_path("a = 1\n"), None);
        assert_eq!(table_path("[server]\nx = 1\n").as_deref(), Some("server"));
        let text = "[[bridges]]\n[[bridges.topics]]\n[[bridges]]\n[[bridges.topics]]\n[[bridges.topics]]\n";
        assert_eq!(table_path(text).as_deref(), Some("bridges[1].topics[1]"));
    }

    #[test]
    fn passwords_in_urls() {
        assert!(url_has_password("postgres://u:p@db/mercurio"));
        assert!(url_has_password(
            "postgresql://u:p@db:5432/m?sslmode=require"
        ));
        assert!(!url_has_password("postgres://u@db/mercurio"));
        assert!(!url_has_password(
            "postgres://db/mercurio?application_name=a:b"
        ));
        assert!(url_has_password("host=db user=u password=p dbname=m"));
        assert!(!url_has_password("host=db user=u dbname=m"));
    }

    #[test]
    fn key_paths() {
        let s = steps("listeners[12].cert_file");
        assert!(matches!(
            s[..],
            [
                Step::Key("listeners"),
                Step::Index(12),
                Step::Key("cert_file")
            ]
        ));
    }
}
