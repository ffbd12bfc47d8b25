//! Lifecycle events and publish interception: an application that embeds the broker, prints
//! one line per event, refuses what clients publish under `blocked/`, and marks what it lets
//! through with a user property.
//!
//! ```text
//! cargo run --example events -- 1884
//! mosquitto_sub -p 1884 -V 5 -t 'demo/#' -F '%t %p %P'        # demo/t hello via:events-example
//! mosquitto_pub -p 1884 -V 5 -q 1 -t demo/t -m hello
//! mosquitto_pub -p 1884 -V 5 -q 1 -t blocked/t -m no          # refused: Not authorized (0x87)
//! ```
//!
//! Each event is one line, such as
//! `connected client_id=sub-1 user=- proto=5 peer=127.0.0.1:50912 clean_start=true session_present=false`.

use std::io::ErrorKind;

use mercurio::codec::ReasonCode;
use mercurio::config::{Config, ListenerConfig};
use mercurio::{
    Broker, Error, Event, InterceptedPublish, PublishInterceptor, SubscribedFilter, Verdict,
};

/// Refuses topics under `blocked/` with 0x87 (Not authorized); adds the user property
/// `via: events-example` to everything else.
struct BlockAndMark;

#[async_trait::async_trait]
impl PublishInterceptor for BlockAndMark {
    async fn intercept(&self, publish: &mut InterceptedPublish<'_>) -> Verdict {
        if publish.topic().starts_with("blocked/") {
            return Verdict::Refuse(ReasonCode::NOT_AUTHORIZED);
        }
        publish
            .properties_mut()
            .user_properties
            .push(("via".into(), "events-example".into()));
        Verdict::Accept
    }
}

/// One line for an event.
fn line(event: &Event) -> String {
    match event {
        Event::Connected {
            client_id,
            username,
            protocol,
            peer,
            clean_start,
            session_present,
        } => format!(
            "connected client_id={client_id} user={} proto={} peer={peer} clean_start={clean_start} session_present={session_present}",
            username.as_deref().unwrap_or("-"),
            protocol.level()
        ),
        Event::Disconnected { client_id, reason } => {
            format!("disconnected client_id={client_id} reason=\"{reason}\"")
        }
        Event::Subscribed {
            client_id,
            subscriptions,
        } => {
            let filters: Vec<String> = subscriptions.iter().map(subscription).collect();
            format!("subscribed client_id={client_id} {}", filters.join(" "))
        }
        Event::Unsubscribed { client_id, filters } => {
            format!("unsubscribed client_id={client_id} filters={}", filters.join(","))
        }
        Event::SessionExpired { client_id } => format!("session_expired client_id={client_id}"),
        Event::WillPublished {
            client_id,
            topic,
            qos,
            retain,
        } => format!(
            "will_published client_id={client_id} topic={topic} qos={} retain={retain}",
            *qos as u8
        ),
        Event::MessageDropped {
            client_id,
            topic,
            cause,
        } => format!(
            "message_dropped client_id={} topic={topic} cause={}",
            client_id.as_deref().unwrap_or("-"),
            cause.name()
        ),
        Event::Lagged { missed } => format!("lagged missed={missed}"),
        other => format!("{other:?}"),
    }
}

fn subscription(s: &SubscribedFilter) -> String {
    let o = &s.options;
    let mut out = format!(
        "filter={} qos={} no_local={} retain_as_published={} retain_handling={}",
        s.filter, o.qos as u8, o.no_local, o.retain_as_published, o.retain_handling
    );
    if let Some(id) = s.identifier {
        out.push_str(&format!(" id={id}"));
    }
    out
}

#[tokio::main]
async fn main() {
    if let Err(why) = run().await {
        eprintln!("events: {why}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), String> {
    let arg = std::env::args()
        .nth(1)
        .ok_or("usage: events PORT (the port to listen on, at 127.0.0.1)")?;
    let port: u16 = arg
        .parse()
        .map_err(|_| format!("{arg:?} is not a port number (0 to 65535)"))?;
    let mut config = Config {
        listeners: vec![ListenerConfig {
            host: "127.0.0.1".into(),
            port,
            ..ListenerConfig::default()
        }],
        ..Config::default()
    };
    config.auth.allow_anonymous = Some(true);
    let broker = match Broker::builder(config)
        .interceptor(BlockAndMark)
        .start()
        .await
    {
        Ok(broker) => broker,
        Err(Error::Bind { addr, source }) if source.kind() == ErrorKind::AddrInUse => {
            return Err(format!(
                "port {port} is busy: another program is listening on {addr}"
            ))
        }
        Err(e) => return Err(format!("the broker could not start: {e}")),
    };
    let mut events = broker.events();
    println!("listening on {}", broker.local_addrs()[0]);
    let printer = tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            println!("{}", line(&event));
        }
    });
    tokio::signal::ctrl_c()
        .await
        .map_err(|e| format!("cannot wait for Ctrl+C: {e}"))?;
    broker.shutdown().await;
    let _ = printer.await;
    Ok(())
}
