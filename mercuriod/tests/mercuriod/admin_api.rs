//! The remote admin API (docs/admin-api.md) of a running mercuriod: authentication, the
//! operations shared with the admin socket, and the OpenAPI file against the real routes.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use base64::Engine;
use mercurio_testkit::http::{self, HttpResponse};
use mercurio_testkit::{prerequisite, Daemon, Mqtt};

const TOKEN: &str = "0123456789abcdef-test-token";

/// A daemon with an MQTT listener and a WebSocket listener serving the admin API, whose
/// password file has alice (an admin) and bob (not one); its token file holds [`TOKEN`].
/// `listener` adds keys to the WebSocket listener, `extra` sections to the file. `None`
/// (skipped) without mosquitto_passwd.
pub(crate) fn daemon(
    test: &str,
    listener: &str,
    extra: &str,
) -> Option<(Daemon, SocketAddr, SocketAddr)> {
    let have = Command::new("mosquitto_passwd")
        .arg("-h")
        .output()
        .map(|_| ())
        .map_err(|e| format!("cannot run mosquitto_passwd (mosquitto package): {e}"));
    if !prerequisite(test, have) {
        return None;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let passwd = dir.path().join("passwd");
    for (i, (user, password)) in [("alice", "wonderland"), ("bob", "builder")]
        .iter()
        .enumerate()
    {
        let mut cmd = Command::new("mosquitto_passwd");
        if i == 0 {
            cmd.arg("-c");
        }
        let status = cmd
            .args(["-b", &passwd.display().to_string(), user, password])
            .status()
            .expect("mosquitto_passwd");
        assert!(status.success(), "mosquitto_passwd {user}");
    }
    let token = dir.path().join("admin.token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token file");
    let config = format!(
        "[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\nprotocol = \"websocket\"\n\
         admin_api = true\nadmin_token_file = {:?}\nadmin_users = [\"alice\"]\n\
         password_file = {:?}\n{listener}\n\n{extra}",
        token.display().to_string(),
        passwd.display().to_string()
    );
    let mut d = Daemon::with(&config).in_dir(dir).start();
    let addrs = d.wait_listeners(2).to_vec();
    Some((d, addrs[0], addrs[1]))
}

fn bearer() -> String {
    format!("Authorization: Bearer {TOKEN}")
}

fn basic(user: &str, password: &str) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    format!("Authorization: Basic {b64}")
}

fn call(api: SocketAddr, method: &str, path: &str, auth: &str, body: &str) -> HttpResponse {
    http::request(api, method, path, &[auth], body)
}

#[test]
fn no_credentials_401_non_admin_403_token_and_admin_user_200() {
    let Some((_d, mqtt, api)) = daemon("admin API authentication", "", "") else {
        return;
    };
    // A connected client whose identifier must not show in any refusal.
    let _c = Mqtt::connect(mqtt.port(), 5, "secret-client", true);

    let none = http::get(api, "/api/v1/clients");
    assert_eq!(none.status, 401, "{none:?}");
    assert!(none.header("www-authenticate").is_some(), "{none:?}");
    for auth in [
        "Authorization: Bearer wrong-token-of-some-length".to_string(),
        format!("Authorization: Bearer {TOKEN}x"),
        basic("alice", "wrong"),
        basic("nobody", "wonderland"),
        "Authorization: Basic !!!".to_string(),
        "Authorization: Digest x".to_string(),
    ] {
        let r = call(api, "GET", "/api/v1/clients", &auth, "");
        assert_eq!(r.status, 401, "{auth}: {r:?}");
        assert!(!r.body.contains("secret-client"), "{auth}: {r:?}");
    }
    let bob = call(api, "GET", "/api/v1/clients", &basic("bob", "builder"), "");
    assert_eq!(bob.status, 403, "{bob:?}");
    assert!(!bob.body.contains("secret-client"), "{bob:?}");
    // Refused before routing: an unknown route tells nothing either.
    assert_eq!(http::get(api, "/api/v1/nothing").status, 401);

    for auth in [bearer(), basic("alice", "wonderland")] {
        let r = call(api, "GET", "/api/v1/clients", &auth, "");
        assert_eq!(r.status, 200, "{auth}: {r:?}");
        assert_eq!(r.header("content-type"), Some("application/json"));
        let clients = r.json();
        assert!(
            clients["clients"]
                .as_array()
                .expect("clients")
                .iter()
                .any(|c| c["client_id"] == "secret-client" && c["connected"] == true),
            "{clients}"
        );
    }
    let status = call(api, "GET", "/api/v1/status", &bearer(), "").json();
    assert_eq!(status["clients_connected"], 1, "{status}");
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"), "{status}");
}

#[test]
fn disconnect_through_the_api_sends_administrative_action() {
    let Some((mut d, mqtt, api)) = daemon("admin API disconnect", "", "") else {
        return;
    };
    let mut victim = Mqtt::connect(mqtt.port(), 5, "victim/1", false);
    let shown = call(api, "GET", "/api/v1/clients/victim%2F1", &bearer(), "");
    assert_eq!(shown.status, 200, "{shown:?}");
    assert_eq!(shown.json()["connected"], true);

    let r = call(
        api,
        "POST",
        "/api/v1/clients/victim%2F1/disconnect",
        &bearer(),
        "",
    );
    assert_eq!(r.status, 200, "{r:?}");
    // [MQTT-3.14.2-1] DISCONNECT from the server with a reason code: 0x98 Administrative action.
    let (kind, body) = victim.read().expect("DISCONNECT before the close");
    assert_eq!(kind, 0xe0, "DISCONNECT expected, got {kind:#x} {body:?}");
    assert_eq!(body.first(), Some(&0x98), "reason code: {body:?}");
    assert!(victim.read().is_none(), "the connection is closed");
    d.wait_logged("the disconnect's log line", |l| {
        l.contains("disconnected by the admin API")
    });

    // Now not connected: 409; its session is kept (expiry 3600 s) until deleted.
    let again = call(
        api,
        "POST",
        "/api/v1/clients/victim%2F1/disconnect",
        &bearer(),
        "",
    );
    assert_eq!(again.status, 409, "{again:?}");
    assert!(again.json()["error"]
        .as_str()
        .unwrap_or("")
        .contains("not connected"));
    let deleted = call(api, "DELETE", "/api/v1/sessions/victim%2F1", &bearer(), "");
    assert_eq!(deleted.status, 200, "{deleted:?}");
    let gone = call(api, "GET", "/api/v1/clients/victim%2F1", &bearer(), "");
    assert_eq!(gone.status, 404, "{gone:?}");
    let unknown = call(
        api,
        "POST",
        "/api/v1/clients/nobody/disconnect",
        &bearer(),
        "",
    );
    assert_eq!(unknown.status, 404, "{unknown:?}");

    // The log level, as mercurioctl sets it; a bad one is a 400 with the reason.
    let level = call(
        api,
        "PUT",
        "/api/v1/log-level",
        &bearer(),
        r#"{"level":"debug"}"#,
    );
    assert_eq!(level.status, 200, "{level:?}");
    assert_eq!(level.json()["level"], "debug");
    let bad = call(
        api,
        "PUT",
        "/api/v1/log-level",
        &bearer(),
        r#"{"level":"=("}"#,
    );
    assert_eq!(bad.status, 400, "{bad:?}");
    let no_body = call(api, "PUT", "/api/v1/log-level", &bearer(), "");
    assert_eq!(no_body.status, 400, "{no_body:?}");
    let wrong_method = call(api, "DELETE", "/api/v1/status", &bearer(), "");
    assert_eq!(wrong_method.status, 405, "{wrong_method:?}");
    assert_eq!(wrong_method.header("allow"), Some("GET"));
}

/// The (method, path) pairs of docs/admin-api.json.
fn openapi_routes() -> BTreeSet<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/admin-api.json");
    let text = std::fs::read_to_string(&path).expect("docs/admin-api.json");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("admin-api.json is JSON");
    assert_eq!(
        doc["openapi"].as_str().map(|v| &v[..2]),
        Some("3."),
        "OpenAPI 3"
    );
    let mut routes = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("path item").keys() {
            if ["get", "put", "post", "delete", "patch", "head", "options"]
                .contains(&method.as_str())
            {
                routes.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    routes
}

#[test]
fn the_openapi_file_lists_exactly_the_routes_served() {
    let served: BTreeSet<(String, String)> = mercurio_core::ADMIN_ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    let documented = openapi_routes();
    assert_eq!(
        documented, served,
        "docs/admin-api.json and the router differ"
    );

    // Every documented route answers on a running broker (not 404/405): with a client that
    // exists, a bridge that exists, the operations in an order that lets each succeed.
    let bridge = "[[bridges]]\nname = \"cloud\"\naddresses = [\"127.0.0.1:9\"]\n\
                  [[bridges.topics]]\npattern = \"q/#\"\ndirection = \"out\"\n\
                  [[streams]]\nname = \"cloud\"\nfilter = \"q/#\"\n";
    let Some((_d, mqtt, api)) = daemon("admin API routes", "", bridge) else {
        return;
    };
    let _client = Mqtt::connect(mqtt.port(), 5, "probe", false);
    let order = [
        "/api/v1/clients/{client_id}",
        "/api/v1/clients/{client_id}/disconnect",
        "/api/v1/sessions/{client_id}",
    ];
    let mut routes: Vec<&(String, String)> = documented.iter().collect();
    routes.sort_by_key(|(_, p)| order.iter().position(|o| o == p));
    for (method, template) in routes {
        let path = template
            .replace("{client_id}", "probe")
            .replace("{name}", "cloud");
        let body = if method == "PUT" {
            r#"{"level":"info"}"#
        } else {
            ""
        };
        // The session is deleted only once the disconnection is through.
        let r = if template == "/api/v1/sessions/{client_id}" {
            let mut r = call(api, method, &path, &bearer(), body);
            mercurio_testkit::wait_until("the session to be deletable", || {
                if r.status == 409 {
                    r = call(api, method, &path, &bearer(), body);
                }
                r.status != 409
            });
            r
        } else {
            call(api, method, &path, &bearer(), body)
        };
        if template == "/api/v1/cluster" {
            // Cluster mode is off here: the route answers that, with 404.
            assert!(
                r.status == 404 && r.body.contains("cluster mode is off"),
                "{method} {path}: {r:?}"
            );
            continue;
        }
        assert!(
            r.status != 404 && r.status != 405 && r.status < 500,
            "{method} {path}: {r:?}"
        );
    }
}
