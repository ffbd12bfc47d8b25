//! `mercurioctl auth derive USER`: prints the derived password of USER (the broker's
//! `[auth] derived_password_secret_file` and `derived_user_pattern`): lowercase hex of
//! HMAC-SHA256(key = the secret file's bytes without one trailing newline, message = USER).
//! Needs no running broker.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use mercurio_core::auth::derived::{glob_matches, DerivedSecret};

/// Print the derived password of a user (needs no running broker).
#[derive(Debug, Args)]
pub struct Derive {
    /// The user name.
    pub user: String,
    /// The secret file (else `[auth] derived_password_secret_file` of the configuration
    /// file given with -c).
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
}

impl Derive {
    /// `config` is the global `-c FILE`.
    pub fn run(&self, config: Option<&Path>) -> ExitCode {
        match self.password(config) {
            Ok(p) => {
                println!("{p}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("mercurioctl auth derive: {e}");
                ExitCode::FAILURE
            }
        }
    }

    fn password(&self, config: Option<&Path>) -> Result<String, String> {
        let (path, pattern) = match (&self.secret_file, config) {
            (Some(f), _) => (f.clone(), None),
            (None, Some(c)) => {
                let cfg = mercurio_core::config_file::load(c).map_err(|e| e.to_string())?;
                let path = cfg.auth.derived_password_secret_file.ok_or_else(|| {
                    format!(
                        "{}: [auth] has no derived_password_secret_file",
                        c.display()
                    )
                })?;
                (path, cfg.auth.derived_user_pattern)
            }
            (None, None) => {
                return Err(
                    "give the secret file with --secret-file FILE or the broker's configuration with -c FILE"
                        .into(),
                )
            }
        };
        let secret = DerivedSecret::load(&path).map_err(|e| e.to_string())?;
        if let Some(p) = pattern.filter(|p| !glob_matches(p, &self.user)) {
            eprintln!(
                "mercurioctl auth derive: warning: {:?} does not match derived_user_pattern {p:?}: the broker will not derive its password",
                self.user
            );
        }
        Ok(secret.derive(&self.user))
    }
}
