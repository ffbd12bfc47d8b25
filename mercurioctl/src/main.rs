//! `mercurioctl`, the admin CLI of a running mercuriod.
//!
//! This first version has no commands: they talk to mercuriod over its admin socket, which
//! mercuriod does not have yet. It answers `--help` and `--version` only.
//!
//! `mercurioctl passwd FILE USER` works on a password file and needs no running broker.
//!
//! Dependencies, and why:
//! - `clap` (derive): the command line, `--help` and `--version`.
//! - `mercurio-core`: the password file format and its argon2id hashing (`passwd`).
//! - `rpassword`: reads a password from the terminal without echo (`passwd`).

mod passwd;

use std::process::ExitCode;

use clap::Parser;

const AFTER_HELP: &str = "\
The admin commands are not available yet (client sessions, log level, statistics of a
running broker): they need mercuriod's admin socket, which this version of mercuriod does not
have. Until then, watch a broker with its logs and its $SYS/broker/# topics, e.g.
  mosquitto_sub -t '$SYS/broker/#' -v

mercurioctl passwd FILE USER adds a user to a password file or changes its password; then
send mercuriod SIGHUP to reload it.";

/// mercurioctl, the admin CLI of a running mercuriod (Mercurio MQTT broker).
#[derive(Debug, Parser)]
#[command(name = "mercurioctl", version, about, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    Passwd(passwd::Passwd),
}

fn main() -> ExitCode {
    let Cli { command } = Cli::parse();
    match command {
        Some(Command::Passwd(p)) => p.run(),
        None => {
            eprintln!(
                "mercurioctl: the admin commands are not available yet (mercuriod has no admin socket yet)"
            );
            ExitCode::FAILURE
        }
    }
}
