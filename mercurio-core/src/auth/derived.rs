//! Derived passwords (`[auth] derived_password_secret_file` and `derived_user_pattern`): a
//! fleet's devices share no table with the broker. A user whose name matches the pattern is
//! accepted when its password is the lowercase hex of HMAC-SHA256(key = the secret file's
//! bytes without one trailing newline, message = the user name), 64 characters. A control
//! plane computes the same value (`mercurioctl auth derive USER`) when it provisions a device.
//!
//! Order with the password file: a user listed in the password file is checked against it
//! only; a user not listed whose name matches the pattern is checked here; any other user is
//! the password file's to refuse. A derived password is compared in constant time, on the
//! password file's bounded blocking pool, and each check (right or wrong) also costs one check
//! against a hash of the password file when there is one, so that neither the answer's time
//! nor its path tells a derived user name from a listed or unknown one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use hmac::{Hmac, Mac};
use parking_lot::RwLock;
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::hooks::{Authentication, Authenticator, ConnectInfo, DenyReason};
use super::password_file::FileAuthenticator;
use super::FileError;

/// The key of derived passwords, read from its file.
#[derive(Clone)]
pub struct DerivedSecret {
    key: Vec<u8>,
}

impl std::fmt::Debug for DerivedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DerivedSecret(..)")
    }
}

impl DerivedSecret {
    /// Reads the key from `path`: its bytes without one trailing `\n`. Errors: the file cannot
    /// be read, or the key is empty. Logs a warning when the file's mode lets its group or
    /// others read it.
    pub fn load(path: &Path) -> Result<DerivedSecret, FileError> {
        let bytes = std::fs::read(path).map_err(|e| FileError::io(path, &e))?;
        #[cfg(unix)]
        if let Ok(meta) = std::fs::metadata(path) {
            use std::os::unix::fs::PermissionsExt;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o044 != 0 {
                tracing::warn!(
                    path = %path.display(),
                    "the derived password secret file can be read by others (mode {mode:o}): make it readable by the broker only (chmod 600)"
                );
            }
        }
        DerivedSecret::from_bytes(bytes).ok_or_else(|| FileError::new(path, "the secret is empty"))
    }

    /// The key of a secret file's contents (one trailing `\n` removed); `None` when empty.
    pub fn from_bytes(mut bytes: Vec<u8>) -> Option<DerivedSecret> {
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
        }
        (!bytes.is_empty()).then_some(DerivedSecret { key: bytes })
    }

    fn mac(&self, user: &str) -> [u8; 32] {
        // HMAC takes a key of any length: `new_from_slice` cannot fail for it.
        let mut mac = match Hmac::<Sha256>::new_from_slice(&self.key) {
            Ok(m) => m,
            Err(_) => return [0; 32],
        };
        mac.update(user.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// The password of `user`: lowercase hex of HMAC-SHA256(key, user name), 64 characters.
    pub fn derive(&self, user: &str) -> String {
        use std::fmt::Write;
        let mut s = String::with_capacity(64);
        for b in self.mac(user) {
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    /// True when `password` is `user`'s derived password (compared in constant time).
    pub fn verify(&self, user: &str, password: &[u8]) -> bool {
        self.derive(user).as_bytes().ct_eq(password).into()
    }
}

/// True when `name` matches the glob `pattern`: `*` stands for any run of characters
/// (also none), `?` for one character; every other character stands for itself.
pub fn glob_matches(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // Iterative matching with one backtrack point (the last `*`): linear in practice,
    // never exponential.
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || (p[pi] != '*' && p[pi] == n[ni])) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// Derived passwords as an [`Authenticator`], asked before the password file's
/// ([`FileAuthenticator`]), whose bounded pool and decoy check it shares.
///
/// - no user name, a user name from a certificate, a user listed in the password file, or a
///   name not matching the pattern: no opinion (the password file decides);
/// - otherwise the password must be the derived one: allowed, else "not authorized" (MQTT 5
///   CONNACK 0x87, 3.x return code 5), the password file's answer, so that a refusal does not
///   tell a prober which user names are derived.
pub struct DerivedAuthenticator {
    path: PathBuf,
    pattern: String,
    secret: RwLock<Arc<DerivedSecret>>,
    file: Arc<FileAuthenticator>,
}

impl DerivedAuthenticator {
    /// Reads the secret file (see [`DerivedSecret::load`]).
    pub fn new(
        path: PathBuf,
        pattern: String,
        file: Arc<FileAuthenticator>,
    ) -> Result<Self, FileError> {
        let secret = DerivedSecret::load(&path)?;
        Ok(DerivedAuthenticator {
            path,
            pattern,
            secret: RwLock::new(Arc::new(secret)),
            file,
        })
    }

    /// Reads the secret file again. On error the old key stays.
    pub fn reload(&self) -> Result<(), FileError> {
        let secret = DerivedSecret::load(&self.path)?;
        *self.secret.write() = Arc::new(secret);
        Ok(())
    }
}

#[async_trait]
impl Authenticator for DerivedAuthenticator {
    async fn authenticate(&self, info: &ConnectInfo) -> Authentication {
        if info.username_from_certificate {
            return Authentication::NoOpinion;
        }
        let Some(user) = &info.username else {
            return Authentication::NoOpinion;
        };
        if !glob_matches(&self.pattern, user) || self.file.lists(user) {
            return Authentication::NoOpinion;
        }
        let secret = Arc::clone(&self.secret.read());
        let password = info.password.clone();
        let name = user.clone();
        let checked = self
            .file
            .check(user, move || {
                password.is_some_and(|p| secret.verify(&name, &p))
            })
            .await;
        match checked {
            Ok(true) => Authentication::Allow { username: None },
            Ok(false) => Authentication::Deny(DenyReason::NotAuthorized),
            Err(reason) => Authentication::Deny(reason),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc_4231_vector_and_newline() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let s = DerivedSecret::from_bytes(b"Jefe\n".to_vec()).unwrap();
        assert_eq!(
            s.derive("what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Only one trailing newline is removed.
        let two = DerivedSecret::from_bytes(b"Jefe\n\n".to_vec()).unwrap();
        assert_ne!(two.derive("u"), s.derive("u"));
        assert!(s.verify("u", s.derive("u").as_bytes()));
        assert!(!s.verify("u", s.derive("v").as_bytes()));
        assert!(!s.verify("u", s.derive("u").to_uppercase().as_bytes()));
        assert!(DerivedSecret::from_bytes(b"\n".to_vec()).is_none());
    }

    #[test]
    fn globs() {
        assert!(glob_matches("tenant-*", "tenant-1"));
        assert!(glob_matches("tenant-*", "tenant-"));
        assert!(!glob_matches("tenant-*", "tenant"));
        assert!(!glob_matches("tenant-*", "xtenant-1"));
        assert!(glob_matches("*-dev-?", "a-b-dev-7"));
        assert!(!glob_matches("*-dev-?", "a-b-dev-77"));
        assert!(glob_matches("*", ""));
        assert!(glob_matches("a*b*c", "aXXbYYc"));
        assert!(!glob_matches("a*b*c", "aXXbYY"));
        assert!(glob_matches("exact", "exact"));
        // No exponential blow-up.
        assert!(!glob_matches(&"*a".repeat(30), &"a".repeat(29)));
    }
}
