//! Authentication and access control: who may connect, and what each client may publish,
//! subscribe to and receive.
//!
//! [`hooks`] holds the traits of the embedding API; [`password_file`] and [`acl`] are the
//! file-based implementations the `[auth]` section configures. [`Auth`] is the chain the
//! broker asks: the application's hooks first, then the file-based ones; the first opinion
//! wins. Without any authorizer (no `acl_file`, no hook) access checks cost nothing: every
//! check starts with `Auth::checks_access`, a plain field read.

pub mod acl;
pub mod hooks;
pub mod password_file;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::broker::BrokerInner;
use crate::config::Config;
use crate::session::Session;
use hooks::{AccessRequest, Action, Authentication, Authenticator, Authorizer, ConnectInfo};
pub use hooks::{Decision, DenyReason};

/// A file (password, ACL, certificate, key) that cannot be used: its path, the line when the
/// problem is on one, and the cause. Displays as `PATH:LINE: MESSAGE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    pub path: PathBuf,
    pub line: Option<usize>,
    pub message: String,
}

impl FileError {
    pub fn new(path: &Path, message: impl Into<String>) -> FileError {
        FileError {
            path: path.to_path_buf(),
            line: None,
            message: message.into(),
        }
    }

    pub fn at(path: &Path, line: usize, message: impl Into<String>) -> FileError {
        FileError {
            path: path.to_path_buf(),
            line: Some(line),
            message: message.into(),
        }
    }

    pub fn io(path: &Path, e: &std::io::Error) -> FileError {
        FileError::new(path, format!("cannot read: {e}"))
    }
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for FileError {}

/// Who a session belongs to, for access checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Identity {
    /// The embedding application's own in-process subscriptions: never checked.
    Trusted,
    /// A network client, with the user name it authenticated as.
    Client { username: Option<Arc<str>> },
}

impl Default for Identity {
    fn default() -> Self {
        Identity::Client { username: None }
    }
}

/// The authentication and authorization chain of one broker.
pub(crate) struct Auth {
    authenticators: Vec<Arc<dyn Authenticator>>,
    authorizers: Vec<Arc<dyn Authorizer>>,
    file_authenticator: Option<Arc<password_file::FileAuthenticator>>,
    acl: Option<Arc<acl::AclAuthorizer>>,
    checks_access: bool,
    /// Serializes reloads.
    reloading: RwLock<()>,
}

impl Auth {
    /// Anonymous clients allowed, user names accepted unchecked, every access allowed.
    pub(crate) fn allow_all() -> Auth {
        Auth {
            authenticators: Vec::new(),
            authorizers: Vec::new(),
            file_authenticator: None,
            acl: None,
            checks_access: false,
            reloading: RwLock::new(()),
        }
    }

    /// The application's hooks, then the `[auth]` section's files (read now).
    pub(crate) fn from_config(
        config: &Config,
        mut authenticators: Vec<Arc<dyn Authenticator>>,
        mut authorizers: Vec<Arc<dyn Authorizer>>,
    ) -> Result<Auth, FileError> {
        let a = &config.auth;
        let file = Arc::new(password_file::FileAuthenticator::new(
            a.allow_anonymous.unwrap_or(false),
            a.password_file.clone(),
        )?);
        authenticators.push(Arc::clone(&file) as Arc<dyn Authenticator>);
        let acl = match &a.acl_file {
            Some(p) => {
                let acl = Arc::new(acl::AclAuthorizer::new(p.clone())?);
                authorizers.push(Arc::clone(&acl) as Arc<dyn Authorizer>);
                Some(acl)
            }
            None => None,
        };
        Ok(Auth {
            checks_access: !authorizers.is_empty(),
            authenticators,
            authorizers,
            file_authenticator: Some(file),
            acl,
            reloading: RwLock::new(()),
        })
    }

    /// Asks the authenticators in turn. `Ok` carries the user name the client is known by.
    pub(crate) async fn authenticate(
        &self,
        info: &ConnectInfo,
    ) -> Result<Option<String>, DenyReason> {
        if self.authenticators.is_empty() {
            return Ok(info.username.clone());
        }
        for a in &self.authenticators {
            match a.authenticate(info).await {
                Authentication::Allow { username } => {
                    return Ok(username.or_else(|| info.username.clone()))
                }
                Authentication::Deny(reason) => return Err(reason),
                Authentication::NoOpinion => {}
            }
        }
        Err(DenyReason::NotAuthorized)
    }

    /// True when any authorizer is configured; when false, every access is allowed.
    #[inline]
    pub(crate) fn checks_access(&self) -> bool {
        self.checks_access
    }

    /// Asks the authorizers in turn, awaiting those that cannot decide at once.
    pub(crate) async fn authorize(&self, req: &AccessRequest<'_>) -> bool {
        for a in &self.authorizers {
            let d = match a.authorize_now(req) {
                Some(d) => d,
                None => a.authorize(req).await,
            };
            match d {
                Decision::Allow => return true,
                Decision::Deny => return false,
                Decision::NoOpinion => {}
            }
        }
        true
    }

    /// The decision without waiting: authorizers that cannot decide at once have no opinion.
    pub(crate) fn authorize_now(&self, req: &AccessRequest<'_>) -> bool {
        for a in &self.authorizers {
            match a.authorize_now(req) {
                Some(Decision::Allow) => return true,
                Some(Decision::Deny) => return false,
                _ => {}
            }
        }
        true
    }

    /// Reads the password and ACL files again. Each file that fails keeps its old contents;
    /// the errors are returned.
    pub(crate) fn reload(&self) -> Vec<FileError> {
        let _guard = self.reloading.write();
        let mut errors = Vec::new();
        if let Some(f) = &self.file_authenticator {
            if let Err(e) = f.reload() {
                errors.push(e);
            }
        }
        if let Some(a) = &self.acl {
            if let Err(e) = a.reload() {
                errors.push(e);
            }
        }
        errors
    }
}

/// The filter a SUBSCRIBE check is about: without `$share/group/`.
pub(crate) fn subscription_topic(filter: &str) -> &str {
    match crate::topic::parse_shared(filter) {
        Ok(Some(shared)) => shared.filter,
        _ => filter,
    }
}

impl BrokerInner {
    /// Whether `session` may receive a message published to `topic` (checked at delivery;
    /// never waits). Costs one field read when no authorizer is configured.
    #[inline]
    pub(crate) fn may_read(&self, session: &Session, topic: &str) -> bool {
        if !self.auth.checks_access() {
            return true;
        }
        self.check_now(session, topic, Action::Read)
    }

    /// The check without waiting, for `session`'s identity.
    pub(crate) fn check_now(&self, session: &Session, topic: &str, action: Action) -> bool {
        let identity = session.identity.read();
        let username = match &*identity {
            Identity::Trusted => return true,
            Identity::Client { username } => username.as_deref(),
        };
        self.auth.authorize_now(&AccessRequest {
            client_id: &session.client_id,
            username,
            topic,
            action,
        })
    }

    /// Whether a client may publish to `topic` or subscribe to `filter`: asks every
    /// authorizer, waiting for those that need to. Always true without authorizers.
    pub(crate) async fn may(&self, session: &Session, topic: &str, action: Action) -> bool {
        if !self.auth.checks_access() {
            return true;
        }
        let username = match &*session.identity.read() {
            Identity::Trusted => return true,
            Identity::Client { username } => username.clone(),
        };
        self.auth
            .authorize(&AccessRequest {
                client_id: &session.client_id,
                username: username.as_deref(),
                topic,
                action,
            })
            .await
    }

    /// Reloads the password and ACL files, then removes the subscriptions their clients may
    /// no longer hold, and the queued messages they may no longer read (counted
    /// `not_authorized`, as a delivery refused at routing would be). Returns the files that
    /// could not be read (their old contents stay).
    pub(crate) fn reload_auth(&self) -> Vec<FileError> {
        let errors = self.auth.reload();
        if !self.auth.checks_access() {
            return errors;
        }
        let sessions: Vec<Arc<Session>> = self.sessions.lock().values().cloned().collect();
        for session in sessions {
            let filters: Vec<String> = session.state.lock().subscriptions.keys().cloned().collect();
            for filter in filters {
                if !self.check_now(&session, subscription_topic(&filter), Action::Subscribe) {
                    tracing::info!(client_id = %session.client_id, %filter, "subscription removed: no longer authorized");
                    self.unsubscribe(&session, &filter);
                }
            }
            self.drop_unreadable_queued(&session);
        }
        errors
    }

    /// Removes from `session`'s queue the messages its client may no longer read.
    fn drop_unreadable_queued(&self, session: &Session) {
        let mut st = session.state.lock();
        if st.queue.is_empty() {
            return;
        }
        let queue = std::mem::take(&mut st.queue);
        let mut removed = 0u64;
        for q in queue {
            if self.check_now(session, &q.msg.topic, Action::Read) {
                st.queue.push_back(q);
            } else {
                st.queued_bytes = st.queued_bytes.saturating_sub(q.msg.payload.len() as u64);
                st.persist_dequeued(&session.client_id, &q);
                self.stats.dropped(crate::stats::DropCause::NotAuthorized);
                removed += 1;
            }
        }
        if removed > 0 {
            tracing::info!(client_id = %session.client_id, removed, "queued messages removed: no longer authorized");
        }
    }
}

/// The CONNECT checks of this module: authentication (with the TLS identity), then the will's
/// topic, which the client must be allowed to publish to. `Ok` carries the user name the
/// client is known by; `Err` the CONNACK reason code and why.
pub(crate) async fn connect_checks(
    broker: &BrokerInner,
    connect: &crate::codec::Connect,
    client_id: &str,
    peer: std::net::SocketAddr,
    tls: Option<crate::tls::TlsIdentity>,
) -> Result<Option<Arc<str>>, (crate::codec::ReasonCode, String)> {
    use crate::codec::ReasonCode;
    let tls = tls.unwrap_or_default();
    let mut username = connect.username.clone();
    if tls.use_as_username {
        match &tls.certificate_cn {
            Some(cn) => username = Some(cn.clone()),
            None => {
                return Err((
                    ReasonCode::NOT_AUTHORIZED,
                    "no client certificate common name to use as the user name".into(),
                ))
            }
        }
    }
    let info = ConnectInfo {
        client_id: client_id.to_string(),
        username,
        password: connect.password.clone(),
        peer,
        protocol: connect.protocol,
        certificate_cn: tls.certificate_cn,
        username_from_certificate: tls.use_as_username,
    };
    let username = broker.auth.authenticate(&info).await.map_err(|r| match r {
        DenyReason::BadCredentials => (
            ReasonCode::BAD_USER_NAME_OR_PASSWORD,
            "bad user name or password".to_string(),
        ),
        DenyReason::NotAuthorized => (ReasonCode::NOT_AUTHORIZED, "not authorized".to_string()),
    })?;
    if let Some(will) = &connect.will {
        if broker.auth.checks_access()
            && !broker
                .auth
                .authorize(&AccessRequest {
                    client_id,
                    username: username.as_deref(),
                    topic: &will.topic,
                    action: Action::Write,
                })
                .await
        {
            return Err((
                ReasonCode::NOT_AUTHORIZED,
                format!("may not publish the will to {:?}", will.topic),
            ));
        }
    }
    Ok(username.map(Arc::from))
}
