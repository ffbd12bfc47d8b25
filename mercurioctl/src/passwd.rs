//! `mercurioctl passwd FILE USER`: adds a user to a mosquitto_passwd-format password file or
//! changes its password (argon2id). Needs no running broker; send mercuriod SIGHUP afterwards.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

/// Add a user to a password file, or change its password (argon2id).
#[derive(Debug, Args)]
pub struct Passwd {
    /// The password file (mosquitto_passwd's format); created, mode 0600, when missing.
    pub file: PathBuf,
    /// The user name.
    pub user: String,
    /// Read the password from the first line of standard input instead of asking for it.
    #[arg(long)]
    pub stdin: bool,
}

impl Passwd {
    pub fn run(&self) -> ExitCode {
        let password = match read_password(self.stdin) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("mercurioctl passwd: {e}");
                return ExitCode::FAILURE;
            }
        };
        match mercurio_core::auth::password_file::set_password(
            &self.file,
            &self.user,
            password.as_bytes(),
        ) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("mercurioctl passwd: {e}");
                ExitCode::FAILURE
            }
        }
    }
}

/// A password from the first line of standard input (`stdin`), or asked twice on the
/// terminal without echo; never from the command line. Errors: one line (no terminal,
/// different answers, empty).
pub fn read_password(stdin: bool) -> Result<String, String> {
    let password = if stdin {
        let mut line = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut line)
            .map_err(|e| format!("cannot read standard input: {e}"))?;
        line.trim_end_matches(['\n', '\r']).to_string()
    } else {
        let first = rpassword::prompt_password("Password: ")
                .map_err(|e| format!("cannot read the password from a terminal ({e}): use --stdin to read it from standard input"))?;
        let again = rpassword::prompt_password("Reenter password: ")
            .map_err(|e| format!("cannot read the password: {e}"))?;
        if first != again {
            return Err("the passwords do not match".into());
        }
        first
    };
    if password.is_empty() {
        return Err("empty password".into());
    }
    Ok(password)
}
