//! Credentials kept in files of their own (`[[bridges]] password_file`, `[storage]
//! url_file`), so that the main configuration file, which the packaged service leaves
//! readable by every user, need not hold them.
//!
//! A credential file is read whole with the broker's own permissions; one trailing newline
//! (`\n`, or `\r\n`) is not part of the credential, so a file written by `echo` works.

use std::path::Path;

use crate::auth::FileError;
use crate::config::{BridgeConfig, StorageConfig};

/// The credential in the file at `path`: its contents without one trailing newline. `key`
/// (`bridges[0].password_file`, `storage.url_file`) names the setting in the error, which
/// also names the file.
pub fn read_secret(path: &Path, key: &str) -> Result<String, FileError> {
    let mut text = std::fs::read_to_string(path)
        .map_err(|e| FileError::new(path, format!("{key}: cannot read: {e}")))?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

/// Whether users other than the file's owner and group may read the file at `path` (its
/// mode has 0o004); false when it cannot be read at all.
pub fn readable_by_others(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o004 != 0)
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        false
    }
}

/// `cfg` with `password` read from its `password_file`, when it has one (the
/// configuration as the bridge uses it: a changed file makes a changed bridge on reload).
pub(crate) fn with_bridge_password(cfg: &BridgeConfig) -> Result<BridgeConfig, FileError> {
    let mut cfg = cfg.clone();
    if let Some(path) = &cfg.password_file {
        let key = format!("bridge {} password_file", cfg.name);
        cfg.password = Some(read_secret(path, &key)?);
    }
    Ok(cfg)
}

/// The PostgreSQL connection URL: `url`, or the contents of `url_file`; `None` when neither
/// is set. An empty file is an error.
pub(crate) fn storage_url(config: &StorageConfig) -> Result<Option<String>, FileError> {
    match &config.url_file {
        Some(path) => {
            let url = read_secret(path, "storage.url_file")?;
            if url.trim().is_empty() {
                return Err(FileError::new(
                    path,
                    "storage.url_file: empty, expected the connection URL",
                ));
            }
            Ok(Some(url))
        }
        None => Ok(config.url.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_trailing_newline_is_not_part_of_the_secret() {
        let dir = std::env::temp_dir().join(format!("mercurio-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        for (text, want) in [
            ("s3cret\n", "s3cret"),
            ("s3cret\r\n", "s3cret"),
            ("s3cret", "s3cret"),
            ("s3cret\n\n", "s3cret\n"),
            (" spaced \n", " spaced "),
        ] {
            std::fs::write(&path, text).unwrap();
            assert_eq!(read_secret(&path, "k").unwrap(), want, "{text:?}");
        }
        let e = read_secret(&dir.join("missing"), "bridges[0].password_file").unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            e.to_string()
                .contains("missing: bridges[0].password_file: cannot read"),
            "{e}"
        );
    }
}
