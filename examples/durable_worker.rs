//! A durable in-process client (docs/embedding.md, "Durable in-process clients"): a worker
//! that takes jobs from the broker it embeds, with SQLite storage, and acknowledges each job
//! once it is done. Jobs it did not acknowledge before it stopped (even killed with SIGKILL)
//! are handed to it again, DUP set, when it starts again.
//!
//! ```sh
//! # Publishes jobs/0..999, acknowledges the first 500, then waits (Ctrl-C, or kill -9).
//! cargo run --example durable_worker -- /tmp/worker.db 1000 500
//! # Started again: publishes nothing, acknowledges what it gets (the other 500) and waits.
//! cargo run --example durable_worker -- /tmp/worker.db 0 500
//! ```
//!
//! Prints `resumed=<bool>` (whether the stored session was resumed), `acked <topic>
//! dup=<bool>` for each job, then `done acked=<n>` once its acknowledgements are stored.
//!
//! With a PostgreSQL URL instead of the file (`postgres://user@host/db`, built with
//! `--features postgres`), workers on other machines share the session: one serves, and one
//! started with `DURABLE_WORKER_STANDBY=1` waits as a standby, then takes over (with what
//! the first one left unacknowledged) when it stops.

use mercurio::codec::QoS;
use mercurio::config::{Config, StorageBackend};
use mercurio::{Broker, ClientOptions};

fn usage(why: &str) -> ! {
    eprintln!("durable_worker: {why}\nusage: durable_worker DB_PATH|POSTGRES_URL PUBLISH ACK");
    std::process::exit(2);
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 3 {
        usage("three arguments");
    }
    let number = |s: &str| {
        s.parse::<usize>()
            .unwrap_or_else(|_| usage(&format!("{s:?} is not a number")))
    };
    let (publish, ack) = (number(&args[1]), number(&args[2]));
    let mut config = Config {
        // No network listener: the application is the only client.
        listeners: Vec::new(),
        ..Config::default()
    };
    let db = &args[0];
    if db.starts_with("postgres://") || db.starts_with("postgresql://") {
        // Needs the `postgres` feature. Several workers may share the database: one serves,
        // the others (DURABLE_WORKER_STANDBY set) wait as standbys and take over.
        config.storage.backend = StorageBackend::Postgres;
        config.storage.url = Some(db.clone());
        config.storage.standby = std::env::var_os("DURABLE_WORKER_STANDBY").is_some();
    } else {
        config.storage.backend = StorageBackend::Sqlite;
        config.storage.path = Some(db.into());
    }
    let broker = match Broker::builder(config).start().await {
        Ok(broker) => broker,
        Err(e) => {
            eprintln!("durable_worker: {e}");
            std::process::exit(1);
        }
    };
    let options = ClientOptions::default().receive_maximum(100);
    let mut worker = match broker.client("worker", options) {
        Ok(worker) => worker,
        Err(e) => {
            eprintln!("durable_worker: {e}");
            std::process::exit(1);
        }
    };
    println!("resumed={}", worker.resumed());
    if let Err(e) = worker.subscribe("jobs/#", QoS::AtLeastOnce) {
        eprintln!("durable_worker: {e}");
        std::process::exit(1);
    }
    // The jobs, published while the worker takes them (a full queue holds the publisher
    // back until the worker catches up).
    let publisher = {
        let broker = broker.clone();
        tokio::spawn(async move {
            for i in 0..publish {
                let topic = format!("jobs/{i}");
                if let Err(e) = broker
                    .publish(&topic, format!("job {i}"), QoS::AtLeastOnce, false)
                    .await
                {
                    eprintln!("durable_worker: publishing {topic}: {e}");
                }
            }
        })
    };
    let mut acked = 0;
    while acked < ack {
        let Some(job) = worker.recv().await else {
            break;
        };
        println!("acked {} dup={}", job.message.topic, job.dup);
        job.ack();
        acked += 1;
    }
    let _ = publisher.await;
    broker.flush_storage().await;
    println!("done acked={acked}");
    let _ = tokio::signal::ctrl_c().await;
    drop(worker);
    broker.shutdown().await;
}
