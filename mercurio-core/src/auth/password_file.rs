//! Password files in mosquitto_passwd's format, `user:hash` per line, so that an existing
//! mosquitto file works unchanged:
//!
//! - `$6$SALT$HASH`: SHA-512 of the password followed by the salt (mosquitto 1.x);
//! - `$7$ITERATIONS$SALT$HASH`: PBKDF2-HMAC-SHA512 (mosquitto 2.0's default);
//! - `$argon2id$v=19$m=..,t=..,p=..$SALT$HASH`: argon2id in the PHC format (mosquitto 2.1's
//!   default, and what `mercurioctl passwd` writes).
//!
//! SALT and HASH of `$6$` and `$7$` are standard base64. Empty lines and lines starting with
//! `#` are ignored. Hashes are compared in constant time; checks run on the blocking pool,
//! at most a few at once (see [`FileAuthenticator`]).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use parking_lot::RwLock;
use sha2::{Digest, Sha512};
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;

use super::hooks::{Authentication, Authenticator, ConnectInfo, DenyReason};
use super::FileError;

/// One stored password hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PasswordHash {
    /// `$6$`: SHA-512(password || salt).
    Sha512 { salt: Vec<u8>, hash: Vec<u8> },
    /// `$7$`: PBKDF2-HMAC-SHA512.
    Pbkdf2Sha512 {
        iterations: u32,
        salt: Vec<u8>,
        hash: Vec<u8>,
    },
    /// `$argon2id$...`, the whole PHC string.
    Argon2(String),
}

impl PasswordHash {
    /// Parses the part after `user:`.
    pub fn parse(s: &str) -> Result<PasswordHash, String> {
        let b64 = |what: &str, v: &str| {
            STANDARD
                .decode(v)
                .map_err(|e| format!("the {what} is not base64: {e}"))
        };
        if let Some(rest) = s.strip_prefix("$6$") {
            let (salt, hash) = rest.split_once('$').ok_or("a $6$ hash needs $SALT$HASH")?;
            let hash = b64("hash", hash)?;
            if hash.len() != 64 {
                return Err("a $6$ hash must be 64 bytes (SHA-512)".into());
            }
            return Ok(PasswordHash::Sha512 {
                salt: b64("salt", salt)?,
                hash,
            });
        }
        if let Some(rest) = s.strip_prefix("$7$") {
            let mut parts = rest.splitn(3, '$');
            let (Some(iterations), Some(salt), Some(hash)) =
                (parts.next(), parts.next(), parts.next())
            else {
                return Err("a $7$ hash needs $ITERATIONS$SALT$HASH".into());
            };
            let iterations: u32 = iterations
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or("the iteration count of a $7$ hash must be a positive number")?;
            let hash = b64("hash", hash)?;
            if hash.is_empty() {
                return Err("empty hash".into());
            }
            return Ok(PasswordHash::Pbkdf2Sha512 {
                iterations,
                salt: b64("salt", salt)?,
                hash,
            });
        }
        if s.starts_with("$argon2id$") {
            let phc = password_hash::PasswordHash::new(s)
                .map_err(|e| format!("bad argon2id hash: {e}"))?;
            argon2::Params::try_from(&phc).map_err(|e| format!("bad argon2id parameters: {e}"))?;
            return Ok(PasswordHash::Argon2(s.to_string()));
        }
        Err("unknown hash type (expected $6$, $7$ or $argon2id$)".into())
    }

    /// True when `password` matches. CPU-bound (PBKDF2, argon2): call it on a blocking thread.
    pub fn verify(&self, password: &[u8]) -> bool {
        match self {
            PasswordHash::Sha512 { salt, hash } => {
                let mut h = Sha512::new();
                h.update(password);
                h.update(salt);
                h.finalize().as_slice().ct_eq(hash).into()
            }
            PasswordHash::Pbkdf2Sha512 {
                iterations,
                salt,
                hash,
            } => {
                let mut out = vec![0u8; hash.len()];
                pbkdf2::pbkdf2_hmac::<Sha512>(password, salt, *iterations, &mut out);
                out.as_slice().ct_eq(hash).into()
            }
            PasswordHash::Argon2(phc) => {
                use password_hash::PasswordVerifier;
                match password_hash::PasswordHash::new(phc) {
                    Ok(parsed) => argon2::Argon2::default()
                        .verify_password(password, &parsed)
                        .is_ok(),
                    Err(_) => false,
                }
            }
        }
    }
}

/// The hash as a password file writes it after `user:` (what [`PasswordHash::parse`] reads).
impl std::fmt::Display for PasswordHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PasswordHash::Sha512 { salt, hash } => {
                write!(f, "$6${}${}", STANDARD.encode(salt), STANDARD.encode(hash))
            }
            PasswordHash::Pbkdf2Sha512 {
                iterations,
                salt,
                hash,
            } => write!(
                f,
                "$7${iterations}${}${}",
                STANDARD.encode(salt),
                STANDARD.encode(hash)
            ),
            PasswordHash::Argon2(phc) => f.write_str(phc),
        }
    }
}

/// A new argon2id hash of `password` (PHC string, argon2's default parameters, random salt).
pub fn hash_password(password: &[u8]) -> String {
    use password_hash::{PasswordHasher, SaltString};
    let salt = SaltString::generate(&mut password_hash::rand_core::OsRng);
    argon2::Argon2::default()
        .hash_password(password, &salt)
        .expect("argon2 with default parameters")
        .to_string()
}

/// The users of a password file.
#[derive(Debug, Clone, Default)]
pub struct PasswordFile {
    users: HashMap<String, Arc<PasswordHash>>,
}

impl PasswordFile {
    /// Reads and parses the file at `path`.
    pub fn load(path: &Path) -> Result<PasswordFile, FileError> {
        let text = std::fs::read_to_string(path).map_err(|e| FileError::io(path, &e))?;
        PasswordFile::parse(path, &text)
    }

    /// Parses `text`, the contents of `path` (used in errors only).
    pub fn parse(path: &Path, text: &str) -> Result<PasswordFile, FileError> {
        let mut users = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let err = |m: String| FileError::at(path, i + 1, m);
            let (user, hash) = line
                .split_once(':')
                .ok_or_else(|| err("expected user:hash".into()))?;
            if user.is_empty() {
                return Err(err("empty user name".into()));
            }
            let hash = PasswordHash::parse(hash).map_err(err)?;
            users.insert(user.to_string(), Arc::new(hash));
        }
        Ok(PasswordFile { users })
    }

    /// The hash stored for `user`.
    pub fn get(&self, user: &str) -> Option<&Arc<PasswordHash>> {
        self.users.get(user)
    }

    /// Every user and its hash, in no particular order.
    pub fn users(&self) -> impl Iterator<Item = (&str, &PasswordHash)> {
        self.users.iter().map(|(u, h)| (u.as_str(), &**h))
    }

    /// A hash of the file to check unknown users against (the same work as a real check).
    fn decoy(&self) -> Option<&Arc<PasswordHash>> {
        self.users.values().next()
    }

    pub fn len(&self) -> usize {
        self.users.len()
    }

    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }
}

/// Adds `user` to the password file at `path` or changes its password, keeping every other
/// line as it is. The file is created (mode 0600) when missing and replaced atomically.
pub fn set_password(path: &Path, user: &str, password: &[u8]) -> Result<(), FileError> {
    if user.is_empty() || user.contains(':') || user.contains('\n') {
        return Err(FileError::new(
            path,
            "a user name must be non-empty, without ':' or a line break",
        ));
    }
    let old = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(FileError::io(path, &e)),
    };
    let entry = format!("{user}:{}", hash_password(password));
    let mut out = String::with_capacity(old.len() + entry.len() + 1);
    let mut replaced = false;
    for line in old.lines() {
        if !replaced && line.split_once(':').is_some_and(|(u, _)| u == user) {
            out.push_str(&entry);
            replaced = true;
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    if !replaced {
        out.push_str(&entry);
        out.push('\n');
    }
    write_replacing(path, out.as_bytes()).map_err(|e| FileError::io(path, &e))
}

/// Writes `contents` to a new file next to `path`, then renames it over `path` (a reader sees
/// the old file or the new one, whole). The temporary file is created with O_EXCL and
/// O_NOFOLLOW, mode 0600 (then the mode of the file it replaces, set through the open file):
/// a file or symbolic link planted at its name is never written through, the next name is
/// tried instead.
fn write_replacing(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    let mut last = None;
    for attempt in 0..16u32 {
        let tmp = if attempt == 0 {
            path.with_extension("mercurio-tmp")
        } else {
            path.with_extension(format!("mercurio-tmp.{}.{attempt}", std::process::id()))
        };
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600).custom_flags(libc::O_NOFOLLOW);
        }
        let mut f = match opts.open(&tmp) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                last = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        let written = (|| {
            f.write_all(contents)?;
            #[cfg(unix)]
            if let Ok(meta) = std::fs::metadata(path) {
                // Keep the mode of an existing file.
                f.set_permissions(meta.permissions())?;
            }
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        return written;
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no temporary file name left")))
}

/// Checks passwords at most this many at once; others wait their turn.
fn max_concurrent_checks() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 16)
}

/// The `[auth]` section as an [`Authenticator`]: `allow_anonymous` and `password_file`.
///
/// - a client without a user name: allowed when `allow_anonymous`, else "not authorized";
/// - with a user name and a password file: the password must match the file's hash
///   (else "not authorized");
/// - with a user name and no password file: allowed when `allow_anonymous` (nothing to check
///   against), else "not authorized";
/// - a user name taken from a verified client certificate: allowed.
///
/// Every refusal is "not authorized" (MQTT 5 CONNACK 0x87, 3.x return code 5), the answer
/// mosquitto gives with the same file, so clients moving between the two see the same code.
/// 3.1.1 keeps return code 4 for user name or password data that is malformed (section
/// 3.2.2.3); 5.0 allows either code. An [`Authenticator`] of the application may still answer
/// [`DenyReason::BadCredentials`] (0x86 / 4).
pub struct FileAuthenticator {
    allow_anonymous: bool,
    path: Option<PathBuf>,
    file: RwLock<Arc<PasswordFile>>,
    checks: Arc<Semaphore>,
    /// Checks waiting for a permit; over [`MAX_WAITING_CHECKS`] a client is refused at once
    /// (CONNACK "server busy") rather than queued without bound.
    waiting: std::sync::atomic::AtomicUsize,
}

impl FileAuthenticator {
    /// Whether a password file is configured (without one, a user name is taken unchecked).
    pub(crate) fn has_file(&self) -> bool {
        self.path.is_some()
    }
}

/// Most password checks waiting for their turn.
const MAX_WAITING_CHECKS: usize = 1024;

impl FileAuthenticator {
    /// Reads the password file, if any.
    pub fn new(allow_anonymous: bool, path: Option<PathBuf>) -> Result<Self, FileError> {
        let file = match &path {
            Some(p) => PasswordFile::load(p)?,
            None => PasswordFile::default(),
        };
        Ok(FileAuthenticator {
            allow_anonymous,
            path,
            file: RwLock::new(Arc::new(file)),
            checks: Arc::new(Semaphore::new(max_concurrent_checks())),
            waiting: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Reads the password file again. On error the old users stay.
    pub fn reload(&self) -> Result<(), FileError> {
        if let Some(p) = &self.path {
            let file = PasswordFile::load(p)?;
            tracing::info!(path = %p.display(), users = file.len(), "password file reloaded");
            *self.file.write() = Arc::new(file);
        }
        Ok(())
    }
}

#[async_trait]
impl Authenticator for FileAuthenticator {
    async fn authenticate(&self, info: &ConnectInfo) -> Authentication {
        if info.username_from_certificate {
            return Authentication::Allow { username: None };
        }
        let Some(user) = &info.username else {
            return if self.allow_anonymous {
                Authentication::Allow { username: None }
            } else {
                Authentication::Deny(DenyReason::NotAuthorized)
            };
        };
        if self.path.is_none() {
            return if self.allow_anonymous {
                Authentication::Allow { username: None }
            } else {
                Authentication::Deny(DenyReason::NotAuthorized)
            };
        }
        // An unknown user (or no password) costs a check like a wrong password: against
        // another user's hash (the file's own kind and cost), whose answer is ignored, so the
        // time to refuse does not tell which user names exist.
        let (hash, known) = {
            let file = self.file.read();
            match file.get(user) {
                Some(h) => (Some(Arc::clone(h)), info.password.is_some()),
                None => (file.decoy().cloned(), false),
            }
        };
        let Some(hash) = hash else {
            return Authentication::Deny(DenyReason::NotAuthorized);
        };
        let password = info.password.clone().unwrap_or_default();
        let verified = match self.run_check(user, move || hash.verify(&password)).await {
            Ok(v) => v,
            Err(reason) => return Authentication::Deny(reason),
        };
        if verified && known {
            Authentication::Allow { username: None }
        } else {
            Authentication::Deny(DenyReason::NotAuthorized)
        }
    }
}

impl FileAuthenticator {
    /// True when `user` is listed in the password file.
    pub(crate) fn lists(&self, user: &str) -> bool {
        self.file.read().get(user).is_some()
    }

    /// Runs another authenticator's check `work` for `user` (the derived passwords') the way
    /// this one runs its own: on the blocking pool, at most a few at once, refused with
    /// [`DenyReason::Busy`] over [`MAX_WAITING_CHECKS`] waiting; and followed by a check
    /// against a hash of the file (answer ignored) when it has one, so that it costs what a
    /// listed user's check costs.
    pub(crate) async fn check(
        &self,
        user: &str,
        work: impl FnOnce() -> bool + Send + 'static,
    ) -> Result<bool, DenyReason> {
        let decoy = self.file.read().decoy().cloned();
        self.run_check(user, move || {
            let ok = work();
            if let Some(decoy) = decoy {
                let _ = std::hint::black_box(decoy.verify(b"derived"));
            }
            ok
        })
        .await
    }

    /// Runs `work` on the blocking pool, at most [`max_concurrent_checks`] at once.
    async fn run_check(
        &self,
        user: &str,
        work: impl FnOnce() -> bool + Send + 'static,
    ) -> Result<bool, DenyReason> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        /// Counts a check as waiting until dropped (also when the CONNECT gives up waiting).
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let waiting = Waiting(&self.waiting);
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= MAX_WAITING_CHECKS {
            tracing::warn!(user = %user, "{MAX_WAITING_CHECKS} password checks waiting: refusing");
            return Err(DenyReason::Busy);
        }
        let permit = Arc::clone(&self.checks).acquire_owned().await;
        drop(waiting);
        let Ok(_permit) = permit else {
            return Err(DenyReason::NotAuthorized);
        };
        Ok(tokio::task::spawn_blocking(work).await.unwrap_or(false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mosquitto_hashes() {
        // Made by mosquitto_passwd 2.0.11 (-H sha512, and the default).
        let six = PasswordHash::parse("$6$EY5EWi0kwhbYnp1q$WAG5ypL7rmY8C2Y6Z1xSmHwDu8ySXMmgi9LQ1qvZlHuvOPPX5/OuFvn9vtIxpsH67cTjRLv4/kQnNcpmYe1c2w==").unwrap();
        assert!(six.verify(b"hunter2"));
        assert!(!six.verify(b"hunter3"));
        let seven = PasswordHash::parse("$7$101$DaiYoUCbawXbF5Tu$OzUOiEA9V392uv2PYkwFTMmZCaKjMyuCSbsrd5CMfzz7cVTCLJ902CFGw5t1tsdUEdvRczgsNGgm93uGtmaedg==").unwrap();
        // Written back as read (the form `mercurioctl auth import` stores).
        assert_eq!(PasswordHash::parse(&seven.to_string()).unwrap(), seven);
        assert_eq!(PasswordHash::parse(&six.to_string()).unwrap(), six);
        assert!(seven.verify(b"secret"));
        assert!(!seven.verify(b"Secret"));
    }

    #[test]
    fn argon2id_round_trip() {
        let h = hash_password(b"pw");
        assert!(h.starts_with("$argon2id$"), "{h}");
        let parsed = PasswordHash::parse(&h).unwrap();
        assert!(parsed.verify(b"pw"));
        assert!(!parsed.verify(b"pW"));
    }

    #[test]
    fn errors_name_the_line() {
        let e = PasswordFile::parse(Path::new("/etc/p"), "# c\n\nalice:$6$x\n").unwrap_err();
        assert_eq!(e.line, Some(3));
        assert!(e.to_string().starts_with("/etc/p:3: "), "{e}");
        let e = PasswordFile::parse(Path::new("/etc/p"), "bob\n").unwrap_err();
        assert_eq!(e.line, Some(1));
        assert!(PasswordFile::parse(Path::new("/etc/p"), "bob:plain\n").is_err());
    }

    #[test]
    fn set_password_adds_and_changes() {
        let dir = std::env::temp_dir().join(format!("mercurio-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("passwd");
        let _ = std::fs::remove_file(&path);
        set_password(&path, "a", b"1").unwrap();
        set_password(&path, "b", b"2").unwrap();
        set_password(&path, "a", b"3").unwrap();
        let f = PasswordFile::load(&path).unwrap();
        assert_eq!(f.len(), 2);
        assert!(f.get("a").unwrap().verify(b"3"));
        assert!(f.get("b").unwrap().verify(b"2"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
