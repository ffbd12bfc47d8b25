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
//! answers each on `app/replies`. Ctrl+C shuts the broker down gracefully.

use std::time::Duration;

use mercurio::codec::QoS;
use mercurio::config::{Config, ListenerConfig};
use mercurio::Broker;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port = match std::env::args().nth(1) {
        Some(p) => p.parse().map_err(|e| format!("port {p:?}: {e}"))?,
        None => 1883,
    };
    let mut config = Config::default();
    config.listeners = vec![ListenerConfig {
        port,
        ..ListenerConfig::default()
    }];
    let broker = Broker::builder(config).start().await?;
    println!("broker listening on {:?}", broker.local_addrs());

    let mut commands = broker.subscribe("app/commands", QoS::AtLeastOnce)?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut beats = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                beats += 1;
                broker.publish("app/heartbeat", beats.to_string(), QoS::AtMostOnce, true)?;
            }
            Some(msg) = commands.recv() => {
                let text = String::from_utf8_lossy(&msg.payload).into_owned();
                println!("command: {text}");
                broker.publish("app/replies", format!("done: {text}"), QoS::AtLeastOnce, false)?;
            }
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    broker.shutdown().await;
    Ok(())
}
