//! recado: the MQTT command line client of Mercurio, for any MQTT 3.1, 3.1.1 or 5.0 broker.
//!
//! `recado sub`, `recado pub` and `recado rr` take mosquitto_sub's, mosquitto_pub's and
//! mosquitto_rr's flags with their meanings; `recado bench` is the load generator. Every packet
//! goes through mercurio-core's codec. Exit codes: see [`exit::Exit`] and docs/recado.md.

mod bench;
mod cli;
mod clock;
mod exit;
mod format;
mod output;
mod props;
mod publish;
mod rr;
mod session;
mod stream;
mod sub;
mod table;
mod target;
mod tls;
mod transport;

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::exit::{Exit, Failure};

fn main() {
    let cli = Cli::parse();
    clock::init();
    let (result, quiet) = match cli.command {
        Command::Bench(args) => (bench::main(args), false),
        Command::Sub(args) => {
            let quiet = args.conn.quiet;
            (block_on(sub::run(args)), quiet)
        }
        Command::Pub(args) => {
            let quiet = args.conn.quiet;
            (block_on(publish::run(args)), quiet)
        }
        Command::Rr(args) => {
            let quiet = args.conn.quiet;
            (block_on(rr::run(args)), quiet)
        }
    };
    match result {
        Ok(()) => std::process::exit(Exit::Ok as i32),
        Err(f) => {
            if !quiet {
                eprintln!("recado: {}", f.message);
            }
            std::process::exit(f.exit as i32);
        }
    }
}

/// Runs a command on a single-threaded runtime (one connection needs no more).
fn block_on<F: std::future::Future<Output = Result<(), Failure>>>(f: F) -> Result<(), Failure> {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(f),
        Err(e) => Err(Failure::error(format!("cannot start the runtime: {e}"))),
    }
}
