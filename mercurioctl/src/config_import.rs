//! `mercurioctl config import-mosquitto FILE`: reads a mosquitto.conf (`mosquitto_conf`),
//! converts it (`import_mosquitto`), checks the result with mercuriod's own configuration
//! reader (`config_file`, shared with mercuriod) and prints it. Needs no running broker.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;

use crate::import_mosquitto;
use crate::mosquitto_conf;
use mercurio_core::config_file;

/// The input cannot be used: unreadable, or a value mosquitto refuses too (EX_CONFIG).
const EXIT_INPUT: u8 = 78;
/// Converted, but the result does not pass mercuriod's check (printed anyway).
const EXIT_INVALID: u8 = 1;

/// Print a mosquitto.conf as an equivalent mercuriod TOML configuration.
#[derive(Debug, Args)]
pub struct ImportMosquitto {
    /// The mosquitto.conf to convert (its include_dir files are read too).
    pub file: PathBuf,
}

impl ImportMosquitto {
    pub fn run(&self) -> ExitCode {
        let lines = match mosquitto_conf::read(&self.file) {
            Ok(lines) => lines,
            Err(e) => {
                eprintln!("mercurioctl config import-mosquitto: {e}");
                return ExitCode::from(EXIT_INPUT);
            }
        };
        let converted = match import_mosquitto::convert(&self.file, &lines, bridges_supported()) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("mercurioctl config import-mosquitto: {e}");
                return ExitCode::from(EXIT_INPUT);
            }
        };
        print!("{}", converted.toml);
        if converted.not_carried > 0 {
            eprintln!(
                "mercurioctl config import-mosquitto: {} line(s) not carried over, each explained in a comment at the top",
                converted.not_carried
            );
        }
        match check(&converted.toml) {
            Ok(warnings) => {
                for w in warnings {
                    eprintln!("mercurioctl config import-mosquitto: warning: {w}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!(
                    "mercurioctl config import-mosquitto: the result does not pass mercuriod --check-config: {e}"
                );
                ExitCode::from(EXIT_INVALID)
            }
        }
    }
}

/// Checks converted TOML as `mercuriod -c FILE --check-config` does (except that the files it
/// names need not exist yet); returns its warnings.
pub fn check(toml: &str) -> Result<Vec<String>, String> {
    let config =
        config_file::parse(Path::new("converted.toml"), toml).map_err(|e| e.to_string())?;
    Ok(config_file::warnings(&config))
}

/// Whether this version's configuration has `[[bridges]]`.
fn bridges_supported() -> bool {
    match toml::from_str::<mercurio_core::config::Config>("[[bridges]]\n") {
        Ok(_) => true,
        Err(e) => !e.message().contains("unknown field `bridges`"),
    }
}
