//! Authentication and authorization hooks: an application decides who may connect and what
//! each client may do, in place of (or before) the password and ACL files.
//!
//! ```text
//! cargo run --example auth_hook -- 1884
//! mosquitto_sub -p 1884 -u acme -P acme-token -t 'tenants/acme/#' -v      # allowed
//! mosquitto_pub -p 1884 -u acme -P acme-token -t tenants/acme/t -m 1      # allowed
//! mosquitto_sub -p 1884 -u acme -P acme-token -t 'tenants/other/#'        # refused (0x80/0x87)
//! mosquitto_pub -p 1884 -u acme -P wrong -t x -m 1                        # bad credentials
//! ```
//!
//! Each tenant authenticates with a token (here a fixed table; a real application would ask
//! its database) and may only use `tenants/<tenant>/...`. Anything the hooks have no opinion
//! on falls through to the configuration (`[auth]`: no anonymous clients here).

use std::collections::HashMap;

use mercurio::codec::QoS;
use mercurio::config::{Config, ListenerConfig};
use mercurio::{
    AccessRequest, Authentication, Authenticator, Authorizer, Broker, ConnectInfo, Decision,
    DenyReason,
};

/// Tenants and their tokens.
struct TokenAuthenticator {
    tokens: HashMap<String, String>,
}

#[async_trait::async_trait]
impl Authenticator for TokenAuthenticator {
    async fn authenticate(&self, info: &ConnectInfo) -> Authentication {
        let Some(user) = &info.username else {
            return Authentication::NoOpinion; // the configuration decides
        };
        match (self.tokens.get(user), &info.password) {
            (Some(token), Some(given)) if token.as_bytes() == &given[..] => {
                Authentication::Allow { username: None }
            }
            _ => Authentication::Deny(DenyReason::BadCredentials),
        }
    }
}

/// A tenant may use `tenants/<its name>/...` only. Decides without waiting, so it is also
/// asked when messages are delivered.
struct TenantAuthorizer;

#[async_trait::async_trait]
impl Authorizer for TenantAuthorizer {
    async fn authorize(&self, request: &AccessRequest<'_>) -> Decision {
        self.authorize_now(request).unwrap_or(Decision::NoOpinion)
    }

    fn authorize_now(&self, request: &AccessRequest<'_>) -> Option<Decision> {
        let mut levels = request.topic.split('/');
        let decision = match (levels.next(), levels.next(), request.username) {
            (Some("tenants"), Some(tenant), Some(user)) if tenant == user => Decision::Allow,
            _ => Decision::Deny,
        };
        Some(decision)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port = match std::env::args().nth(1) {
        Some(p) => p.parse().map_err(|e| format!("port {p:?}: {e}"))?,
        None => 1883,
    };
    let mut config = Config {
        listeners: vec![ListenerConfig {
            port,
            ..ListenerConfig::default()
        }],
        ..Config::default()
    };
    config.auth.allow_anonymous = Some(false);
    let tokens = [("acme", "acme-token"), ("globex", "globex-token")]
        .into_iter()
        .map(|(u, t)| (u.to_string(), t.to_string()))
        .collect();
    let broker = Broker::builder(config)
        .authenticator(TokenAuthenticator { tokens })
        .authorizer(TenantAuthorizer)
        .start()
        .await?;
    println!("listening on {:?}", broker.local_addrs());
    // The application itself is trusted: its in-process publishes and subscriptions are
    // never checked.
    broker
        .publish("tenants/acme/welcome", "hello acme", QoS::AtLeastOnce, true)
        .await?;
    tokio::signal::ctrl_c().await?;
    broker.shutdown().await;
    Ok(())
}
