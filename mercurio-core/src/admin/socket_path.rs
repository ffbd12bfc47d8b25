//! The admin socket's default path, and the checks on an existing one.
//!
//! mercuriod binds the socket here and mercurioctl connects to it, so that both find the same
//! socket without a configuration.

use std::path::{Path, PathBuf};

/// File name of the socket in its directory.
pub const SOCKET_NAME: &str = "mercuriod.sock";

/// The default admin socket, in the first of these that applies:
/// 1. `$RUNTIME_DIRECTORY/mercuriod.sock` (under systemd with `RuntimeDirectory=`);
/// 2. `/run/mercurio/mercuriod.sock` as root;
/// 3. `$XDG_RUNTIME_DIR/mercurio/mercuriod.sock`;
/// 4. `/tmp/mercurio-$UID/mercuriod.sock`.
pub fn default_socket_path() -> PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    default_socket_path_from(
        var("RUNTIME_DIRECTORY").as_deref().map(Path::new),
        euid(),
        var("XDG_RUNTIME_DIR").as_deref().map(Path::new),
    )
}

/// [`default_socket_path`] with its inputs given.
pub fn default_socket_path_from(
    runtime_directory: Option<&Path>,
    euid: u32,
    xdg_runtime_dir: Option<&Path>,
) -> PathBuf {
    if let Some(dir) = runtime_directory {
        // systemd separates several RuntimeDirectory= entries with colons: take the first.
        let first = dir
            .to_str()
            .and_then(|d| d.split(':').next())
            .map(PathBuf::from)
            .unwrap_or_else(|| dir.to_path_buf());
        return first.join(SOCKET_NAME);
    }
    if euid == 0 {
        return Path::new("/run/mercurio").join(SOCKET_NAME);
    }
    if let Some(dir) = xdg_runtime_dir {
        return dir.join("mercurio").join(SOCKET_NAME);
    }
    PathBuf::from(format!("/tmp/mercurio-{euid}")).join(SOCKET_NAME)
}

/// The effective user id of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Why an existing path cannot be used as the admin socket, if it cannot: it is not a socket,
/// or it belongs to another user than this process's (root may use any owner's socket when
/// `root_trusts_any_owner`, as mercurioctl does to talk to a broker running as a service user).
pub fn check_existing(path: &Path, root_trusts_any_owner: bool) -> Result<(), String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::symlink_metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.file_type().is_socket() {
        return Err(format!("{} exists and is not a socket", path.display()));
    }
    let me = euid();
    if meta.uid() != me && !(root_trusts_any_owner && me == 0) {
        return Err(format!(
            "{} belongs to uid {}, not to this user (uid {me}): refusing it",
            path.display(),
            meta.uid()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_paths() {
        let p = |rd: Option<&str>, uid, xdg: Option<&str>| {
            default_socket_path_from(rd.map(Path::new), uid, xdg.map(Path::new))
        };
        assert_eq!(
            p(Some("/run/mercurio"), 0, Some("/run/user/0")),
            Path::new("/run/mercurio/mercuriod.sock")
        );
        assert_eq!(
            p(Some("/run/a:/run/b"), 1000, None),
            Path::new("/run/a/mercuriod.sock")
        );
        assert_eq!(
            p(None, 0, Some("/run/user/0")),
            Path::new("/run/mercurio/mercuriod.sock")
        );
        assert_eq!(
            p(None, 1000, Some("/run/user/1000")),
            Path::new("/run/user/1000/mercurio/mercuriod.sock")
        );
        assert_eq!(
            p(None, 1000, None),
            Path::new("/tmp/mercurio-1000/mercuriod.sock")
        );
    }

    #[test]
    fn not_a_socket() {
        let dir = std::env::temp_dir().join(format!("mercurio-sp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("plain");
        std::fs::write(&file, "x").expect("write");
        let e = check_existing(&file, true).expect_err("a file");
        assert!(e.contains("not a socket"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn another_users_socket() {
        use std::os::unix::ffi::OsStrExt;
        if euid() != 0 {
            return; // only root can give a file to another user
        }
        let dir = std::env::temp_dir().join(format!("mercurio-sp2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("s.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path");
        // SAFETY: chown on a path we own, with a valid C string.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
        let e = check_existing(&path, false).expect_err("another user's");
        assert!(e.contains("belongs to uid 65534"), "{e}");
        // Root talking to a service user's broker (mercurioctl) accepts it.
        assert!(check_existing(&path, true).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
