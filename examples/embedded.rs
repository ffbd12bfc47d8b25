//! Embedding Mercurio in an application: start a broker on 127.0.0.1:1883 (or the port given
//! as the first argument), subscribe in-process, and publish a heartbeat every second that
//! MQTT clients can read:
//!
//! ```text
//! cargo run --example embedded -- 1884
//! mosquitto_sub -p 1884 -t 'app/#' -v
//! mosquitto_pub -p 1884 -t app/commands -m ping
//! ```
//!
//! The application sees `app/commands` messages through its in-process subscription and
//! answers each on `app/replies`. Ctrl+C shuts the broker down gracefully. Errors are printed
//! as one sentence, and the process exits with status 1.

use std::process::ExitCode;
use std::time::Duration;

use mercurio::codec::QoS;
use mercurio::config::{Config, ListenerConfig};
use mercurio::Broker;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("embedded: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), String> {
    let port: u16 = match std::env::args().nth(1) {
        Some(p) => p
            .parse()
            .map_err(|_| format!("{p:?} is not a port (a number from 0 to 65535)."))?,
        None => 1883,
    };
    let config = Config {
        listeners: vec![ListenerConfig {
            port,
            ..ListenerConfig::default()
        }],
        ..Config::default()
    };
    let broker = Broker::builder(config).start().await.map_err(|e| {
        format!(
            "cannot start the broker: {e}. Is another broker on port {port}? Pass another port: \
             cargo run --example embedded -- 1884"
        )
    })?;
    for addr in broker.local_addrs() {
        println!(
            "broker listening on {addr}: mosquitto_sub -p {} -t 'app/#' -v",
            addr.port()
        );
    }

    let refused = |e: mercurio::Error| format!("the broker refused a request: {e}.");
    let mut commands = broker
        .subscribe("app/commands", QoS::AtLeastOnce)
        .map_err(refused)?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut beats = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                beats += 1;
                broker
                    .publish("app/heartbeat", beats.to_string(), QoS::AtMostOnce, true)
                    .await.map_err(refused)?;
            }
            Some(msg) = commands.recv() => {
                let text = String::from_utf8_lossy(&msg.payload).into_owned();
                println!("command: {text}");
                broker
                    .publish("app/replies", format!("done: {text}"), QoS::AtLeastOnce, false)
                    .await.map_err(refused)?;
            }
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    broker.shutdown().await;
    Ok(())
}
