//! Authentication and access control: who may connect, and what each client may publish,
//! subscribe to and receive.
//!
//! [`hooks`] holds the traits of the embedding API; [`password_file`], [`derived`] and
//! [`acl`] are the file-based implementations the `[auth]` section configures. [`Auth`] is the chain the
//! broker asks: the application's hooks first, then the file-based ones; the first opinion
//! wins. Without any authorizer (no `acl_file`, no hook) access checks cost nothing: every
//! check starts with `Auth::checks_access`, a plain field read.

pub mod acl;
pub mod derived;
pub mod hooks;
pub mod password_file;
pub mod scram;
pub mod stored;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::config::Config;
use hooks::{
    AccessRequest, Authentication, Authenticator, Authorizer, ConnectInfo, EnhancedAuthenticator,
};
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

/// `[auth]`'s derived password settings: the secret file and the user name pattern, when set.
fn derived_settings(config: &Config) -> Option<(PathBuf, String)> {
    let a = &config.auth;
    Some((
        a.derived_password_secret_file.clone()?,
        a.derived_user_pattern.clone()?,
    ))
}

/// The embedding application's hooks, in the order added.
#[derive(Clone, Default)]
pub(crate) struct Hooks {
    pub(crate) authenticators: Vec<Arc<dyn Authenticator>>,
    pub(crate) authorizers: Vec<Arc<dyn Authorizer>>,
    pub(crate) enhanced: Vec<Arc<dyn EnhancedAuthenticator>>,
}

/// Who a session belongs to, for access checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Identity {
    /// The embedding application's own in-process subscriptions: never checked.
    Trusted,
    /// A network client, with the user name it authenticated as, and the listener whose own
    /// authentication settings apply to it (`None`: `[auth]`'s; a `u32`, which packs with
    /// the variant's tag: every session holds an identity).
    Client {
        username: Option<Arc<str>>,
        listener: Option<u32>,
    },
}

impl Default for Identity {
    fn default() -> Self {
        Identity::Client {
            username: None,
            listener: None,
        }
    }
}

/// The authentication and authorization chain of one broker.
pub(crate) struct Auth {
    authenticators: Vec<Arc<dyn Authenticator>>,
    authorizers: Vec<Arc<dyn Authorizer>>,
    file_authenticator: Option<Arc<password_file::FileAuthenticator>>,
    derived: Option<Arc<derived::DerivedAuthenticator>>,
    acl: Option<Arc<acl::AclAuthorizer>>,
    /// Enhanced authentication methods: the application's, then SCRAM with stored users.
    enhanced: Vec<Arc<dyn EnhancedAuthenticator>>,
    checks_access: bool,
    /// The decision when no authorizer has an opinion: allowed, except with stored rules and
    /// no ACL file after them (whatever they do not allow is denied).
    default_allow: bool,
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
            derived: None,
            acl: None,
            enhanced: Vec::new(),
            checks_access: false,
            default_allow: true,
            reloading: RwLock::new(()),
        }
    }

    /// The application's hooks, then the stored users and rules (`stored`, with
    /// `[auth] backend = "storage"`), then the `[auth]` section's files (read now).
    pub(crate) fn from_config(
        config: &Config,
        hooks: &Hooks,
        stored: Option<&Arc<stored::StoredAccess>>,
    ) -> Result<Auth, FileError> {
        let a = &config.auth;
        Auth::from_files(
            a.allow_anonymous.unwrap_or(false),
            a.password_file.clone(),
            a.acl_file.clone(),
            derived_settings(config),
            hooks,
            stored,
        )
    }

    /// One chain per listener that sets `allow_anonymous`, `password_file` or `acl_file`
    /// (mosquitto's `per_listener_settings`): its keys over `[auth]`'s, the same hooks first.
    /// `None` for a listener that sets none of them: `[auth]`'s chain applies.
    pub(crate) fn for_listeners(
        config: &Config,
        hooks: &Hooks,
        stored: Option<&Arc<stored::StoredAccess>>,
    ) -> Result<Vec<Option<Auth>>, FileError> {
        let a = &config.auth;
        config
            .listeners
            .iter()
            .map(|l| {
                if l.allow_anonymous.is_none() && l.password_file.is_none() && l.acl_file.is_none()
                {
                    return Ok(None);
                }
                Auth::from_files(
                    l.allow_anonymous.or(a.allow_anonymous).unwrap_or(false),
                    l.password_file.clone().or_else(|| a.password_file.clone()),
                    l.acl_file.clone().or_else(|| a.acl_file.clone()),
                    derived_settings(config),
                    hooks,
                    stored,
                )
                .map(Some)
            })
            .collect()
    }

    fn from_files(
        allow_anonymous: bool,
        password_file: Option<PathBuf>,
        acl_file: Option<PathBuf>,
        derived: Option<(PathBuf, String)>,
        hooks: &Hooks,
        stored: Option<&Arc<stored::StoredAccess>>,
    ) -> Result<Auth, FileError> {
        let mut authenticators = hooks.authenticators.clone();
        let mut authorizers = hooks.authorizers.clone();
        let mut enhanced = hooks.enhanced.clone();
        if let Some(s) = stored {
            authenticators.push(Arc::new(stored::StoredPasswords {
                access: Arc::clone(s),
                decoy_unknown: password_file.is_none(),
            }) as Arc<dyn Authenticator>);
            authorizers.push(Arc::clone(s) as Arc<dyn Authorizer>);
            enhanced.push(Arc::clone(s) as Arc<dyn EnhancedAuthenticator>);
        }
        let file = Arc::new(password_file::FileAuthenticator::new(
            allow_anonymous,
            password_file,
        )?);
        // Derived passwords before the password file, which they consult (a listed user
        // is the file's to check).
        let derived = match derived {
            Some((path, pattern)) => {
                let d = Arc::new(derived::DerivedAuthenticator::new(
                    path,
                    pattern,
                    Arc::clone(&file),
                )?);
                authenticators.push(Arc::clone(&d) as Arc<dyn Authenticator>);
                Some(d)
            }
            None => None,
        };
        authenticators.push(Arc::clone(&file) as Arc<dyn Authenticator>);
        let acl = match &acl_file {
            Some(p) => {
                let acl = Arc::new(acl::AclAuthorizer::new(p.clone())?);
                authorizers.push(Arc::clone(&acl) as Arc<dyn Authorizer>);
                Some(acl)
            }
            None => None,
        };
        Ok(Auth {
            checks_access: !authorizers.is_empty(),
            default_allow: stored.is_none() || acl.is_some(),
            authenticators,
            authorizers,
            file_authenticator: Some(file),
            derived,
            acl,
            enhanced,
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
            // A panic refuses the client, as not authorized (`hook`).
            let answer = crate::hook::guard("authenticator", &info.client_id, a.authenticate(info))
                .await
                .unwrap_or(Authentication::Deny(DenyReason::NotAuthorized));
            match answer {
                Authentication::Allow { username } => {
                    return Ok(username.or_else(|| info.username.clone()))
                }
                Authentication::Deny(reason) => return Err(reason),
                Authentication::NoOpinion => {}
            }
        }
        Err(DenyReason::NotAuthorized)
    }

    /// The user name `info` (a user name and a password) authenticates as when something
    /// checked the password: an application authenticator's `Allow`, or the password file's
    /// (when one is configured). `None` otherwise: a refusal, or nothing that checks passwords
    /// (without a password file, `allow_anonymous` takes any password for any user name, which
    /// an admin login must never do). For the admin API's HTTP Basic (docs/admin-api.md).
    pub(crate) async fn check_password(&self, info: &ConnectInfo) -> Option<String> {
        for a in &self.authenticators {
            if let Some(file) = &self.file_authenticator {
                let same =
                    std::ptr::eq(Arc::as_ptr(a) as *const (), Arc::as_ptr(file) as *const ());
                if same && !file.has_file() {
                    return None;
                }
            }
            match a.authenticate(info).await {
                Authentication::Allow { username } => {
                    return username.or_else(|| info.username.clone())
                }
                Authentication::Deny(_) => return None,
                Authentication::NoOpinion => {}
            }
        }
        None
    }

    /// True when any authorizer is configured; when false, every access is allowed.
    #[inline]
    pub(crate) fn checks_access(&self) -> bool {
        self.checks_access
    }

    /// Asks the authorizers in turn, awaiting those that cannot decide at once.
    pub(crate) async fn authorize(&self, req: &AccessRequest<'_>) -> bool {
        for a in &self.authorizers {
            // A panic denies the access (`hook`).
            let d = match crate::hook::guard_now("authorizer", req.client_id, || {
                a.authorize_now(req)
            }) {
                Some(Some(d)) => d,
                Some(None) => crate::hook::guard("authorizer", req.client_id, a.authorize(req))
                    .await
                    .unwrap_or(Decision::Deny),
                None => Decision::Deny,
            };
            match d {
                Decision::Allow => return true,
                Decision::Deny => return false,
                Decision::NoOpinion => {}
            }
        }
        self.default_allow
    }

    /// The enhanced authenticator for `method` (the first that supports it), if any.
    pub(crate) fn enhanced_for(&self, method: &str) -> Option<&Arc<dyn EnhancedAuthenticator>> {
        self.enhanced.iter().find(|e| e.supports(method))
    }

    /// The decision without waiting: authorizers that cannot decide at once have no opinion.
    pub(crate) fn authorize_now(&self, req: &AccessRequest<'_>) -> bool {
        for a in &self.authorizers {
            // A panic denies the access (`hook`).
            let d = crate::hook::guard_now("authorizer", req.client_id, || a.authorize_now(req))
                .unwrap_or(Some(Decision::Deny));
            match d {
                Some(Decision::Allow) => return true,
                Some(Decision::Deny) => return false,
                _ => {}
            }
        }
        self.default_allow
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
        if let Some(d) = &self.derived {
            if let Err(e) = d.reload() {
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
