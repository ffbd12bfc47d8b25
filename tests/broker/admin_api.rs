//! The remote admin API as an embedding application gets it (docs/admin-api.md): without an
//! admin handler only `/api/v1/stats` answers; HTTP Basic needs something that checks
//! passwords. mercuriod's own handler is tested with the daemon (mercuriod's tests).
use crate::common;

use common::*;
use mercurio::{Authentication, Authenticator, Broker, ConnectInfo};

const TOKEN: &str = "an-embedded-admin-token";

fn basic(user: &str, password: &str) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    format!("Basic {b64}")
}

async fn get(addr: std::net::SocketAddr, path: &str, auth: &str) -> HttpResponse {
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n"
    );
    http_raw(addr, req.as_bytes()).await.expect("a response")
}

/// Accepts alice with password "pw" and nobody else.
struct Alice;

#[async_trait::async_trait]
impl Authenticator for Alice {
    async fn authenticate(&self, info: &ConnectInfo) -> Authentication {
        match (info.username.as_deref(), info.password.as_deref()) {
            (Some("alice"), Some(b"pw")) => Authentication::Allow { username: None },
            _ => Authentication::NoOpinion,
        }
    }
}

#[tokio::test]
async fn without_a_handler_only_stats_answer_and_basic_needs_a_password_check() {
    let dir = tempfile::tempdir().expect("temp dir");
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).expect("token file");
    let mut config = tcp_and_websocket_config();
    config.admin.token_file = Some(token);
    config.admin.users = vec!["alice".into()];
    config.listeners[1].admin_api = true;

    // Anonymous clients, no password file: any password would do for "alice", so Basic is
    // refused outright; the token works.
    let (handle, tcp) = start_with(config.clone()).await;
    let api = handle.local_addrs()[1];
    let r = get(api, "/api/v1/stats", &basic("alice", "anything")).await;
    assert_eq!(r.status, 401, "{}", r.text());
    let bearer = format!("Bearer {TOKEN}");
    let client = Client::connect(tcp, mercurio::codec::ProtocolVersion::V5, "counted").await;
    let r = get(api, "/api/v1/stats", &bearer).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let stats: serde_json::Value = serde_json::from_slice(&r.body).expect("JSON");
    assert_eq!(stats["clients_connected"], 1, "{stats}");
    assert!(stats["dropped"]["queue_full"].is_u64(), "{stats}");
    // The daemon's operations need a handler: none here.
    let r = get(api, "/api/v1/status", &bearer).await;
    assert_eq!(r.status, 404, "{}", r.text());
    client.disconnect().await;
    handle.shutdown().await;

    // With an application authenticator, Basic works for the users it accepts.
    let handle = Broker::builder(config)
        .authenticator(Alice)
        .start()
        .await
        .expect("start");
    let api = handle.local_addrs()[1];
    let r = get(api, "/api/v1/stats", &basic("alice", "pw")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = get(api, "/api/v1/stats", &basic("alice", "nope")).await;
    assert_eq!(r.status, 401, "{}", r.text());
    handle.shutdown().await;
}
