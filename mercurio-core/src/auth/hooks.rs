//! The authentication and authorization hooks of the embedding API (docs/embedding.md).
//!
//! An application adds its own with `Broker::builder(config).authenticator(..).authorizer(..)`.
//! Hooks are asked in the order they were added, before the file-based ones (the password
//! file and the ACL file are implementations of these same traits); the first opinion wins.

use std::net::SocketAddr;

use async_trait::async_trait;
use bytes::Bytes;

use crate::codec::ProtocolVersion;

/// What a CONNECT says about who the client is.
#[derive(Debug, Clone)]
pub struct ConnectInfo {
    /// The client identifier (assigned by the broker when the client sent an empty one).
    pub client_id: String,
    /// The user name of CONNECT, or the certificate's common name on a listener with
    /// `use_identity_as_username`.
    pub username: Option<String>,
    /// The password of CONNECT.
    pub password: Option<Bytes>,
    /// The client's address.
    pub peer: SocketAddr,
    pub protocol: ProtocolVersion,
    /// The subject common name of the client certificate, when one was presented and verified.
    pub certificate_cn: Option<String>,
    /// True when the user name is the verified certificate's common name
    /// (`use_identity_as_username`): the certificate has authenticated the client.
    pub username_from_certificate: bool,
}

/// Why a connection is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenyReason {
    /// Unknown user or wrong password: 5.0 CONNACK 0x86, 3.x return code 4. (The built-in
    /// password file answers `NotAuthorized` instead, as mosquitto does.)
    BadCredentials,
    /// Not allowed to connect (anonymous, banned...): 5.0 CONNACK 0x87, 3.x return code 5.
    NotAuthorized,
    /// Too many checks waiting already: 5.0 CONNACK 0x89 Server busy, 3.x return code 3
    /// (server unavailable).
    Busy,
}

/// An authenticator's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authentication {
    /// Let the client in, under this user name (`None`: anonymous, or keep CONNECT's).
    Allow { username: Option<String> },
    /// Refuse the client.
    Deny(DenyReason),
    /// Leave the decision to the next authenticator.
    NoOpinion,
}

/// Decides whether a client may connect.
///
/// Asked from the client's connection task during CONNECT, on the broker's runtime threads:
/// `authenticate` must not block the thread (a blocking call stalls every client that
/// thread serves, not only this one); run blocking work (a synchronous database, a slow
/// hash) with `tokio::task::spawn_blocking` and await it. A panic is caught and logged
/// (error level, with the client identifier) and refuses the client as
/// [`DenyReason::NotAuthorized`]; the client can connect again at once.
#[async_trait]
pub trait Authenticator: Send + Sync + 'static {
    async fn authenticate(&self, info: &ConnectInfo) -> Authentication;
}

/// What a client wants to do with a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Receive a message published to this topic name (checked at delivery).
    Read,
    /// Publish to this topic name.
    Write,
    /// Subscribe to this topic filter (without any `$share/group/` prefix).
    Subscribe,
}

/// One access check: who, what, on which topic.
#[derive(Debug, Clone, Copy)]
pub struct AccessRequest<'a> {
    pub client_id: &'a str,
    pub username: Option<&'a str>,
    /// A topic name (Read, Write) or a topic filter (Subscribe).
    pub topic: &'a str,
    pub action: Action,
}

/// An authorizer's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allow,
    Deny,
    /// Leave the decision to the next authorizer; when none has an opinion, the action is
    /// allowed.
    NoOpinion,
}

/// Decides what a client may do with a topic.
///
/// `authorize` is asked on SUBSCRIBE and PUBLISH, from the client's own task, and may wait
/// (a database, a service). Delivery to a subscriber happens on the publisher's task, where
/// nothing may wait: there only `authorize_now` is asked. An authorizer that can decide
/// without waiting (the ACL file can) answers `authorize_now` with `Some`, and is then never
/// awaited at all; `None` means "ask `authorize`" (and, at delivery, no opinion).
///
/// Both run on the broker's runtime threads and must not block the thread: a blocking call
/// stalls every client that thread serves, not only the one asked about. Run blocking work
/// with `tokio::task::spawn_blocking` inside `authorize` and await it. A panic in either is
/// caught and logged (error level, with the client identifier) and denies the access.
#[async_trait]
pub trait Authorizer: Send + Sync + 'static {
    async fn authorize(&self, request: &AccessRequest<'_>) -> Decision;

    /// The decision without waiting, when this authorizer can give one.
    ///
    /// Asked at delivery (`Action::Read`) on the publisher's task, and, when a message in
    /// flight is resent to a client back from a disconnection, while the broker holds that
    /// subscriber's session lock; also after a reload of the access rules. It must answer at
    /// once, without blocking the thread, and must not call back into the broker (a
    /// [`BrokerHandle`](crate::BrokerHandle) method that reads or changes sessions could
    /// wait for that very lock). Keep what it needs in the authorizer itself.
    fn authorize_now(&self, _request: &AccessRequest<'_>) -> Option<Decision> {
        None
    }
}

/// One step of an enhanced authentication exchange (MQTT 5.0 section 4.12).
pub enum AuthStep {
    /// Send `data` to the client in AUTH 0x18 (Continue authentication) and give its answer
    /// (the Authentication Data of its next AUTH 0x18) to `next`.
    Continue {
        /// The Authentication Data to send.
        data: Bytes,
        /// What handles the client's answer.
        next: Box<dyn AuthContinuation>,
    },
    /// The client is authenticated, as `username` (`None`: CONNECT's user name); `data`, when
    /// set, goes to the client in the CONNACK (or, on a re-authentication, in AUTH 0x00).
    Success {
        /// The user name the client is known by.
        username: Option<String>,
        /// The last Authentication Data for the client.
        data: Option<Bytes>,
    },
    /// Refused: CONNACK with the reason's code (a re-authentication: DISCONNECT 0x87, or 0x89
    /// for [`DenyReason::Busy`]: DISCONNECT has no 0x86).
    Deny(DenyReason),
}

/// The rest of an exchange, waiting for the client's next Authentication Data.
#[async_trait]
pub trait AuthContinuation: Send + Sync + 'static {
    /// The client's next AUTH 0x18 arrived with `data`.
    async fn step(self: Box<Self>, data: Option<Bytes>) -> AuthStep;
}

/// Enhanced authentication for an Authentication Method (MQTT 5.0 section 4.12): a
/// challenge and response exchange through AUTH packets, at CONNECT and on
/// re-authentication (AUTH 0x19). Added with `Broker::builder(config).enhanced_authenticator(..)`;
/// the built-in SCRAM-SHA-256 / SCRAM-SHA-512 one (`[auth] backend = "storage"`) is asked
/// after the application's. A method no authenticator supports is refused with CONNACK 0x8C
/// (Bad authentication method).
///
/// The same rules as for [`Authenticator`] apply: never block the thread; a step that waits
/// longer than `connect_timeout` at CONNECT closes the connection.
#[async_trait]
pub trait EnhancedAuthenticator: Send + Sync + 'static {
    /// Whether this authenticator handles `method` (the Authentication Method property).
    fn supports(&self, method: &str) -> bool;

    /// Starts an exchange for `method` with the Authentication Data of CONNECT (or of the
    /// client's AUTH 0x19). `info.password` is CONNECT's (none on a re-authentication).
    async fn start(&self, method: &str, info: &ConnectInfo, data: Option<Bytes>) -> AuthStep;
}
