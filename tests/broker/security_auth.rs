//! Authentication: allow_anonymous, mosquitto_passwd files ($6$, $7$, argon2id), and the
//! Authenticator / Authorizer hooks of the embedding API.
use crate::common;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use mercurio::auth::password_file::set_password;
use mercurio::codec::{ProtocolVersion, QoS, ReasonCode};
use mercurio::{
    AccessRequest, Authentication, Authenticator, Authorizer, Broker, ConnectInfo, Decision,
    DenyReason,
};

const V3_NOT_AUTHORIZED: ReasonCode = ReasonCode(5);

fn mosquitto_passwd(args: &[&str]) {
    let st = std::process::Command::new("mosquitto_passwd")
        .args(args)
        .status()
        .expect("run mosquitto_passwd");
    assert!(st.success(), "mosquitto_passwd {args:?}");
}

async fn code(
    addr: std::net::SocketAddr,
    v: ProtocolVersion,
    user: Option<&str>,
    pw: Option<&str>,
) -> ReasonCode {
    let (_c, ack) = Client::connect_with(addr, connect_as(v, "auth-client", user, pw)).await;
    ack.reason_code
}

/// mosquitto_passwd's files work as they are, and refuse as mosquitto does: a wrong or
/// missing password, or an unknown user, gets "not authorized" (5.0 CONNACK 0x87, 3.x return
/// code 5; 3.1.1 keeps 4 for malformed user name or password data, section 3.2.2.3).
#[tokio::test]
async fn mosquitto_passwd_file_works_unchanged() {
    if !have_program("mosquitto_passwd_file_works_unchanged", "mosquitto_passwd") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("passwd");
    let f = file.to_str().unwrap();
    mosquitto_passwd(&["-c", "-b", f, "seven", "pw7"]); // $7$ (mosquitto 2's default)
    mosquitto_passwd(&["-H", "sha512", "-b", f, "six", "pw6"]); // $6$
    set_password(&file, "argon", b"pw-argon").unwrap(); // argon2id, added to the same file
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.contains("seven:$7$") && text.contains("six:$6$") && text.contains("argon:$argon2id$"),
        "{text}"
    );

    let mut config = test_config();
    config.auth.allow_anonymous = Some(false);
    config.auth.password_file = Some(file.clone());
    let (broker, addr) = start_with(config).await;
    let v5 = ProtocolVersion::V5;
    for (user, pw) in [("seven", "pw7"), ("six", "pw6"), ("argon", "pw-argon")] {
        assert_eq!(
            code(addr, v5, Some(user), Some(pw)).await,
            ReasonCode::SUCCESS,
            "{user}"
        );
        assert_eq!(
            code(addr, ProtocolVersion::V311, Some(user), Some(pw)).await,
            ReasonCode::SUCCESS,
            "{user}"
        );
        assert_eq!(
            code(addr, v5, Some(user), Some("wrong")).await,
            ReasonCode::NOT_AUTHORIZED,
            "{user}"
        );
    }
    assert_eq!(
        code(addr, v5, Some("nobody"), Some("pw7")).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        code(addr, v5, Some("seven"), None).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        code(addr, ProtocolVersion::V311, Some("six"), Some("x")).await,
        V3_NOT_AUTHORIZED
    );
    assert_eq!(
        code(addr, ProtocolVersion::V31, Some("six"), Some("x")).await,
        V3_NOT_AUTHORIZED
    );
    // Anonymous clients: not authorized.
    assert_eq!(code(addr, v5, None, None).await, ReasonCode::NOT_AUTHORIZED);
    assert_eq!(
        code(addr, ProtocolVersion::V311, None, None).await,
        V3_NOT_AUTHORIZED
    );

    // A changed password file counts after a reload.
    set_password(&file, "six", b"new6").unwrap();
    assert_eq!(
        code(addr, v5, Some("six"), Some("new6")).await,
        ReasonCode::NOT_AUTHORIZED
    );
    broker.reload().expect("reload");
    assert_eq!(
        code(addr, v5, Some("six"), Some("new6")).await,
        ReasonCode::SUCCESS
    );
    assert_eq!(
        code(addr, v5, Some("six"), Some("pw6")).await,
        ReasonCode::NOT_AUTHORIZED
    );
    // A broken file on reload: the old users stay, the error names the file and line.
    std::fs::write(&file, "six:$6$broken\n").unwrap();
    let errors = broker.reload().unwrap_err();
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0]
            .to_string()
            .starts_with(&format!("{}:1: ", file.display())),
        "{}",
        errors[0]
    );
    assert_eq!(
        code(addr, v5, Some("six"), Some("new6")).await,
        ReasonCode::SUCCESS
    );
    broker.shutdown().await;
}

#[tokio::test]
async fn anonymous_with_and_without_allow_anonymous() {
    let mut config = test_config();
    config.auth.allow_anonymous = Some(false);
    let (broker, addr) = start_with(config).await;
    assert_eq!(
        code(addr, ProtocolVersion::V5, None, None).await,
        ReasonCode::NOT_AUTHORIZED
    );
    // No password file to check a user name against.
    assert_eq!(
        code(addr, ProtocolVersion::V5, Some("u"), Some("p")).await,
        ReasonCode::NOT_AUTHORIZED
    );
    broker.shutdown().await;

    // The no-file mode: anyone.
    let (broker, addr) = start().await;
    assert_eq!(
        code(addr, ProtocolVersion::V5, None, None).await,
        ReasonCode::SUCCESS
    );
    assert_eq!(
        code(addr, ProtocolVersion::V5, Some("u"), Some("p")).await,
        ReasonCode::SUCCESS
    );
    broker.shutdown().await;
}

#[tokio::test]
async fn bad_password_file_fails_start_with_path_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("passwd");
    std::fs::write(&file, "# users\nalice:$7$101$c2FsdA==$aGFzaA==\nbob\n").unwrap();
    let mut config = test_config();
    config.auth.password_file = Some(file.clone());
    let e = Broker::builder(config.clone())
        .start()
        .await
        .err()
        .expect("refused");
    assert_eq!(
        e.to_string(),
        format!("{}:3: expected user:hash", file.display())
    );

    config.auth.password_file = Some(dir.path().join("missing"));
    let e = Broker::builder(config)
        .start()
        .await
        .err()
        .expect("refused");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!(
            "{}: cannot read: ",
            Path::new(&dir.path().join("missing")).display()
        )),
        "{msg}"
    );
}

/// Lets in user "app" with password "token" as user "tenant-a"; no opinion otherwise.
struct TokenAuth {
    calls: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl Authenticator for TokenAuth {
    async fn authenticate(&self, info: &ConnectInfo) -> Authentication {
        self.calls.fetch_add(1, Ordering::Relaxed);
        match (info.username.as_deref(), info.password.as_deref()) {
            (Some("app"), Some(b"token")) => Authentication::Allow {
                username: Some("tenant-a".into()),
            },
            (Some("app"), _) => Authentication::Deny(DenyReason::BadCredentials),
            (Some("banned"), _) => Authentication::Deny(DenyReason::NotAuthorized),
            _ => Authentication::NoOpinion,
        }
    }
}

/// Tenants use only `tenants/<user name>/...`; no opinion about anything else.
struct TenantAuthz;

#[async_trait::async_trait]
impl Authorizer for TenantAuthz {
    async fn authorize(&self, r: &AccessRequest<'_>) -> Decision {
        // Pretend to ask a service.
        tokio::task::yield_now().await;
        self.authorize_now(r).unwrap()
    }

    fn authorize_now(&self, r: &AccessRequest<'_>) -> Option<Decision> {
        let Some(rest) = r.topic.strip_prefix("tenants/") else {
            return Some(Decision::NoOpinion);
        };
        let tenant = rest.split('/').next().unwrap_or("");
        Some(if Some(tenant) == r.username {
            Decision::Allow
        } else {
            Decision::Deny
        })
    }
}

#[tokio::test]
async fn hooks_decide_first() {
    let calls = Arc::new(AtomicUsize::new(0));
    let mut config = test_config();
    config.auth.allow_anonymous = Some(false);
    let broker = Broker::builder(config)
        .authenticator(TokenAuth {
            calls: Arc::clone(&calls),
        })
        .authorizer(TenantAuthz)
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    let v5 = ProtocolVersion::V5;
    assert_eq!(
        code(addr, v5, Some("app"), Some("nope")).await,
        ReasonCode::BAD_USER_NAME_OR_PASSWORD
    );
    assert_eq!(
        code(addr, v5, Some("banned"), Some("x")).await,
        ReasonCode::NOT_AUTHORIZED
    );
    // No opinion: the configuration decides (no anonymous clients).
    assert_eq!(code(addr, v5, None, None).await, ReasonCode::NOT_AUTHORIZED);
    assert!(calls.load(Ordering::Relaxed) >= 3);

    let (mut c, ack) = Client::connect_with(
        addr,
        connect_as(v5, "tenant-a-1", Some("app"), Some("token")),
    )
    .await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    // The hook renamed the user: it is tenant-a now.
    assert_eq!(
        c.subscribe("tenants/tenant-a/#", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    assert_eq!(
        c.subscribe("tenants/app/#", QoS::AtLeastOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    // No opinion anywhere: allowed.
    assert_eq!(
        c.subscribe("elsewhere", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    assert_eq!(
        c.publish("tenants/tenant-a/x", b"1", QoS::AtLeastOnce, false)
            .await,
        ReasonCode::SUCCESS
    );
    let p = c.expect_publish().await;
    assert_eq!(p.topic, "tenants/tenant-a/x");
    c.ack(&p).await;
    assert_eq!(
        c.publish("tenants/tenant-b/x", b"2", QoS::AtLeastOnce, false)
            .await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        c.publish("tenants/tenant-b/x", b"2", QoS::ExactlyOnce, false)
            .await,
        ReasonCode::NOT_AUTHORIZED
    );
    c.disconnect().await;
    broker.shutdown().await;
}

/// An authenticator that takes five seconds.
struct SlowAuth;

#[async_trait::async_trait]
impl Authenticator for SlowAuth {
    async fn authenticate(&self, _info: &ConnectInfo) -> Authentication {
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        Authentication::NoOpinion
    }
}

/// Authentication happens within connect_timeout: a check that takes longer closes the
/// connection without CONNACK when the timeout (counted from the accept) runs out.
#[tokio::test]
async fn authentication_is_bounded_by_connect_timeout() {
    let mut config = test_config();
    config.server.connect_timeout = 1;
    let broker = Broker::builder(config)
        .authenticator(SlowAuth)
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    let started = std::time::Instant::now();
    let mut c = Client::open(addr, ProtocolVersion::V5).await;
    c.send(mercurio::codec::Packet::Connect(Box::new(connect_packet(
        ProtocolVersion::V5,
        "slow",
    ))))
    .await;
    assert!(c.expect_closed().await.is_empty(), "no CONNACK");
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_millis(2500),
        "closed after {took:?}"
    );
    broker.shutdown().await;
}

/// A user name the password file does not know is refused in about the time a wrong
/// password takes (the password is checked against another user's hash), so the time of
/// the answer does not tell which user names exist.
#[tokio::test]
async fn an_unknown_user_costs_what_a_wrong_password_costs() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("passwd");
    // A PBKDF2-SHA512 hash (mosquitto_passwd's `$7$` format) of "hunter2" with 10,000
    // iterations: tens of milliseconds in a debug build, so the check, not the round trip
    // over loopback or a busy CI machine, sets both times. (A `$6$` hash is one SHA-512,
    // microseconds, and its difference would drown in scheduling noise.)
    std::fs::write(
        &file,
        "alice:$7$10000$bWVyY3VyaW8tdGVzdC1zYWx0$ftWyQWjc24bHxEYLar3uElx5MdtWjFIVG9ROfdrQFFX9RTl1zXW/q04pOKEHLbN6rldJTl7AjWi853Oqt+N/jg==\n",
    )
    .unwrap();
    let mut config = test_config();
    config.auth.allow_anonymous = Some(false);
    config.auth.password_file = Some(file);
    let (broker, addr) = start_with(config).await;
    let v5 = ProtocolVersion::V5;
    let time = |user: &'static str| async move {
        let started = std::time::Instant::now();
        let rc = code(addr, v5, Some(user), Some("wrong")).await;
        assert_eq!(rc, ReasonCode::NOT_AUTHORIZED);
        started.elapsed()
    };
    let mut known = Vec::new();
    let mut unknown = Vec::new();
    for _ in 0..5 {
        known.push(time("alice").await);
        unknown.push(time("mallory").await);
    }
    known.sort();
    unknown.sort();
    let (k, u) = (known[2], unknown[2]);
    eprintln!("medians: unknown user {u:?}, wrong password {k:?}");
    assert!(
        u * 2 >= k,
        "unknown user refused in {u:?}, wrong password in {k:?}"
    );
    broker.shutdown().await;
}

/// Panics for user name "panic"; no opinion otherwise.
struct PanickingAuth;

#[async_trait::async_trait]
impl Authenticator for PanickingAuth {
    async fn authenticate(&self, info: &ConnectInfo) -> Authentication {
        if info.username.as_deref() == Some("panic") {
            panic!("authenticator bug");
        }
        Authentication::NoOpinion
    }
}

/// Panics on topics under `panic/`, waiting first or at once; no opinion otherwise.
struct PanickingAuthz;

#[async_trait::async_trait]
impl Authorizer for PanickingAuthz {
    async fn authorize(&self, r: &AccessRequest<'_>) -> Decision {
        tokio::task::yield_now().await;
        if r.topic.starts_with("panic/wait") {
            panic!("authorizer bug");
        }
        Decision::NoOpinion
    }

    fn authorize_now(&self, r: &AccessRequest<'_>) -> Option<Decision> {
        if r.topic.starts_with("panic/now") {
            panic!("authorizer bug");
        }
        None
    }
}

/// A panicking authenticator refuses that CONNECT (not authorized) and a panicking
/// authorizer denies that access; each is logged at error level with the client
/// identifier, the client can connect again at once, and nobody else is affected.
#[tokio::test]
async fn panicking_hooks_refuse() {
    let broker = Broker::builder(test_config())
        .authenticator(PanickingAuth)
        .authorizer(PanickingAuthz)
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    let logs = capture_logs();
    let v5 = ProtocolVersion::V5;
    for version in [ProtocolVersion::V311, v5] {
        let (mut c, ack) =
            Client::connect_with(addr, connect_as(version, "panic-auth", Some("panic"), None))
                .await;
        let expected = if version.is_v5() {
            ReasonCode::NOT_AUTHORIZED
        } else {
            ReasonCode(5)
        };
        assert_eq!(ack.reason_code, expected, "{version:?}");
        c.expect_closed().await;
    }
    let (mut c, ack) = tokio::time::timeout(
        Duration::from_secs(1),
        Client::connect_with(addr, connect_as(v5, "panic-auth", Some("fine"), None)),
    )
    .await
    .expect("CONNACK within a second");
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    for topic in ["panic/wait", "panic/now"] {
        assert_eq!(
            c.subscribe(topic, QoS::AtLeastOnce).await,
            ReasonCode::NOT_AUTHORIZED,
            "{topic}"
        );
        assert_eq!(
            c.publish(topic, b"x", QoS::AtLeastOnce, false).await,
            ReasonCode::NOT_AUTHORIZED,
            "{topic}"
        );
    }
    c.ping().await;
    assert_eq!(
        c.subscribe("fine/t", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    let logged = logs.matching(&["ERROR", "panicked", "panic-auth"]);
    assert_eq!(logged.len(), 6, "{:?}", logs.lines());
    broker.shutdown().await;
}

/// What python3's hmac module makes of `secret_file` and `user`: the derived password
/// computed independently of the broker (the key is the file's bytes without one trailing
/// newline).
fn python_hmac(secret_file: &Path, user: &str) -> String {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import hmac, hashlib, sys\n\
             k = open(sys.argv[1], 'rb').read()\n\
             k = k[:-1] if k.endswith(b'\\n') else k\n\
             print(hmac.new(k, sys.argv[2].encode(), hashlib.sha256).hexdigest())",
            secret_file.to_str().unwrap(),
            user,
        ])
        .output()
        .expect("run python3");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// `[auth] derived_password_secret_file` and `derived_user_pattern`: a user matching the
/// pattern connects with HMAC-SHA256(secret, user name) in lowercase hex and no table; a
/// wrong or missing password gets "not authorized" (5.0 CONNACK 0x87, 3.1.1 return code 5),
/// as a wrong stored password does, so the answer does not tell which names are derived; a
/// user listed in the password file is checked against the file only; a name not matching
/// the pattern is not derived. The derived user's ACL comes from the ACL file (%u),
/// and a wrong derived password costs what a wrong stored password costs.
#[tokio::test]
async fn derived_passwords() {
    if !have_program("derived_passwords", "python3") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "fleet key, not shared\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let file = dir.path().join("passwd");
    // alice and tenant-listed: "hunter2", as PBKDF2-SHA512 with 10,000 iterations (see
    // an_unknown_user_costs_what_a_wrong_password_costs).
    let hunter2 = "$7$10000$bWVyY3VyaW8tdGVzdC1zYWx0$ftWyQWjc24bHxEYLar3uElx5MdtWjFIVG9ROfdrQFFX9RTl1zXW/q04pOKEHLbN6rldJTl7AjWi853Oqt+N/jg==";
    std::fs::write(&file, format!("alice:{hunter2}\ntenant-listed:{hunter2}\n")).unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "pattern readwrite tenants/%u/#\n").unwrap();
    let mut config = test_config();
    config.auth.allow_anonymous = Some(false);
    config.auth.password_file = Some(file);
    config.auth.acl_file = Some(acl);
    config.auth.derived_password_secret_file = Some(secret.clone());
    config.auth.derived_user_pattern = Some("tenant-*".into());
    let (broker, addr) = start_with(config).await;
    let (v5, v311) = (ProtocolVersion::V5, ProtocolVersion::V311);
    let derived = python_hmac(&secret, "tenant-1");
    assert_eq!(derived.len(), 64);
    for v in [v5, v311] {
        assert_eq!(
            code(addr, v, Some("tenant-1"), Some(&derived)).await,
            ReasonCode::SUCCESS,
            "{v:?}"
        );
    }
    // The password file's answer (docs/protocol.md): 0x87 Not authorized; 3.1.1 return code 5.
    let wrong = python_hmac(&secret, "tenant-2");
    assert_eq!(
        code(addr, v5, Some("tenant-1"), Some(&wrong)).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        code(addr, v311, Some("tenant-1"), Some(&wrong)).await,
        ReasonCode(5)
    );
    assert_eq!(
        code(addr, v5, Some("tenant-1"), Some(&derived.to_uppercase())).await,
        ReasonCode::NOT_AUTHORIZED,
        "lowercase hex only"
    );
    assert_eq!(
        code(addr, v5, Some("tenant-1"), None).await,
        ReasonCode::NOT_AUTHORIZED
    );
    // Not matching the pattern: not derived, the password file refuses it.
    let other = python_hmac(&secret, "device-1");
    assert_eq!(
        code(addr, v5, Some("device-1"), Some(&other)).await,
        ReasonCode::NOT_AUTHORIZED
    );
    // Listed in the password file: checked against the file only.
    let listed = python_hmac(&secret, "tenant-listed");
    assert_eq!(
        code(addr, v5, Some("tenant-listed"), Some(&listed)).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        code(addr, v5, Some("tenant-listed"), Some("hunter2")).await,
        ReasonCode::SUCCESS
    );
    assert_eq!(
        code(addr, v5, Some("alice"), Some("hunter2")).await,
        ReasonCode::SUCCESS
    );

    // The ACL file's pattern rules apply to a derived user as to any other.
    let (mut c, ack) = Client::connect_with(
        addr,
        connect_as(v5, "tenant-1-dev", Some("tenant-1"), Some(&derived)),
    )
    .await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    assert_eq!(
        c.subscribe("tenants/tenant-1/#", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    assert_eq!(
        c.subscribe("tenants/tenant-2/#", QoS::AtMostOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    c.disconnect().await;

    // A wrong derived password takes the password file's path: it costs what a wrong stored
    // password costs (medians of 5; the stored check is tens of milliseconds).
    let time = |user: &'static str, rc: ReasonCode| async move {
        let started = std::time::Instant::now();
        assert_eq!(code(addr, v5, Some(user), Some("wrong")).await, rc);
        started.elapsed()
    };
    let mut stored = Vec::new();
    let mut derived_wrong = Vec::new();
    for _ in 0..5 {
        stored.push(time("alice", ReasonCode::NOT_AUTHORIZED).await);
        derived_wrong.push(time("tenant-9", ReasonCode::NOT_AUTHORIZED).await);
    }
    stored.sort();
    derived_wrong.sort();
    let (s, d) = (stored[2], derived_wrong[2]);
    eprintln!("medians: wrong derived password {d:?}, wrong stored password {s:?}");
    assert!(
        d * 2 >= s,
        "wrong derived password refused in {d:?}, wrong stored password in {s:?}"
    );
    broker.shutdown().await;
}

/// An application's enhanced authentication: its method's challenge goes out in AUTH 0x18,
/// the client's answer comes back in AUTH 0x18, and the CONNACK carries the method and the
/// last data (MQTT 5.0 section 4.12); a wrong answer is refused with the hook's reason
/// (0x86), another method with 0x8C, a packet other than AUTH during the exchange with 0x82
/// [MQTT-4.12.0-5]. Re-authentication (AUTH 0x19) ends with AUTH 0x00, or, when refused, with
/// DISCONNECT and the close [MQTT-4.12.1-2].
#[tokio::test]
async fn enhanced_authenticator_hook() {
    use bytes::Bytes;
    use mercurio::codec::{Auth, Packet, Properties};
    use mercurio::{AuthContinuation, AuthStep, EnhancedAuthenticator};

    struct Echo;
    struct Answer;
    #[async_trait::async_trait]
    impl EnhancedAuthenticator for Echo {
        fn supports(&self, method: &str) -> bool {
            method == "ECHO"
        }
        async fn start(&self, _: &str, info: &ConnectInfo, data: Option<Bytes>) -> AuthStep {
            assert_eq!(data.as_deref(), Some(&b"hello"[..]), "{}", info.client_id);
            AuthStep::Continue {
                data: Bytes::from_static(b"challenge"),
                next: Box::new(Answer),
            }
        }
    }
    #[async_trait::async_trait]
    impl AuthContinuation for Answer {
        async fn step(self: Box<Self>, data: Option<Bytes>) -> AuthStep {
            if data.as_deref() == Some(&b"egnellahc"[..]) {
                AuthStep::Success {
                    username: Some("echoed".into()),
                    data: Some(Bytes::from_static(b"welcome")),
                }
            } else {
                AuthStep::Deny(DenyReason::BadCredentials)
            }
        }
    }
    fn auth(reason: u8, data: &'static [u8]) -> Packet {
        Packet::Auth(Auth {
            reason_code: ReasonCode(reason),
            properties: Properties {
                authentication_method: Some("ECHO".into()),
                authentication_data: Some(Bytes::from_static(data)),
                ..Properties::default()
            },
        })
    }
    fn challenge_of(p: Option<Packet>, reason: u8) -> Bytes {
        match p {
            Some(Packet::Auth(a)) => {
                assert_eq!(a.reason_code, ReasonCode(reason));
                assert_eq!(a.properties.authentication_method.as_deref(), Some("ECHO"));
                a.properties.authentication_data.unwrap_or_default()
            }
            other => panic!("expected AUTH, got {other:?}"),
        }
    }

    let mut config = test_config();
    config.auth.allow_anonymous = Some(false);
    let broker = Broker::builder(config)
        .enhanced_authenticator(Echo)
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    let v5 = ProtocolVersion::V5;
    let connect = |id: &str, method: &str| {
        let mut c = connect_as(v5, id, None, None);
        c.properties.authentication_method = Some(method.into());
        c.properties.authentication_data = Some(Bytes::from_static(b"hello"));
        c
    };

    let mut c = Client::open(addr, v5).await;
    c.send(Packet::Connect(Box::new(connect("e1", "ECHO"))))
        .await;
    assert_eq!(&challenge_of(c.recv().await, 0x18)[..], b"challenge");
    c.send(auth(0x18, b"egnellahc")).await;
    match c.recv().await {
        Some(Packet::ConnAck(ack)) => {
            assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
            assert_eq!(
                ack.properties.authentication_method.as_deref(),
                Some("ECHO")
            );
            assert_eq!(
                ack.properties.authentication_data.as_deref(),
                Some(&b"welcome"[..])
            );
        }
        other => panic!("expected CONNACK, got {other:?}"),
    }
    // Re-authentication, twice: the exchange again, ended by AUTH 0x00.
    for _ in 0..2 {
        c.send(auth(0x19, b"hello")).await;
        assert_eq!(&challenge_of(c.recv().await, 0x18)[..], b"challenge");
        c.send(auth(0x18, b"egnellahc")).await;
        assert_eq!(&challenge_of(c.recv().await, 0x00)[..], b"welcome");
    }
    c.ping().await;
    // A failed re-authentication: DISCONNECT 0x87 (DISCONNECT has no 0x86), then the close.
    c.send(auth(0x19, b"hello")).await;
    challenge_of(c.recv().await, 0x18);
    c.send(auth(0x18, b"wrong")).await;
    match c.expect_closed().await.as_slice() {
        [Packet::Disconnect(d)] => assert_eq!(d.reason_code, ReasonCode::NOT_AUTHORIZED),
        other => panic!("expected DISCONNECT 0x87, got {other:?}"),
    }

    // A wrong answer at CONNECT: the hook's 0x86.
    let mut c = Client::open(addr, v5).await;
    c.send(Packet::Connect(Box::new(connect("e2", "ECHO"))))
        .await;
    challenge_of(c.recv().await, 0x18);
    c.send(auth(0x18, b"no")).await;
    match c.expect_closed().await.as_slice() {
        [Packet::ConnAck(ack)] => {
            assert_eq!(ack.reason_code, ReasonCode::BAD_USER_NAME_OR_PASSWORD)
        }
        other => panic!("expected CONNACK 0x86, got {other:?}"),
    }
    // Something else than AUTH during the exchange: Protocol Error.
    let mut c = Client::open(addr, v5).await;
    c.send(Packet::Connect(Box::new(connect("e3", "ECHO"))))
        .await;
    challenge_of(c.recv().await, 0x18);
    c.send(Packet::PingReq).await;
    match c.expect_closed().await.as_slice() {
        [Packet::ConnAck(ack)] => assert_eq!(ack.reason_code, ReasonCode::PROTOCOL_ERROR),
        other => panic!("expected CONNACK 0x82, got {other:?}"),
    }
    // A method nobody supports: 0x8C.
    let (_c, ack) = Client::connect_with(addr, connect("e4", "OTHER")).await;
    assert_eq!(ack.reason_code, ReasonCode::BAD_AUTHENTICATION_METHOD);
    broker.shutdown().await;
}
