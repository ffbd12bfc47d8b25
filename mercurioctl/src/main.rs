//! `mercurioctl`, the admin CLI of a running mercuriod.
//!
//! This first version has no commands: they talk to mercuriod over its admin socket, which
//! mercuriod does not have yet. It answers `--help` and `--version` only.
//!
//! Dependencies, and why:
//! - `clap` (derive): the command line, `--help` and `--version`.

use std::process::ExitCode;

use clap::Parser;

const AFTER_HELP: &str = "\
The admin commands are not available yet (client sessions, log level, statistics of a
running broker): they need mercuriod's admin socket, which this version of mercuriod does not
have. Until then, watch a broker with its logs and its $SYS/broker/# topics, e.g.
  mosquitto_sub -t '$SYS/broker/#' -v";

/// mercurioctl, the admin CLI of a running mercuriod (Mercurio MQTT broker).
#[derive(Debug, Parser)]
#[command(name = "mercurioctl", version, about, after_help = AFTER_HELP)]
struct Cli {}

fn main() -> ExitCode {
    let Cli {} = Cli::parse();
    eprintln!(
        "mercurioctl: the admin commands are not available yet (mercuriod has no admin socket yet)"
    );
    ExitCode::FAILURE
}
