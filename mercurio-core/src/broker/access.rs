//! Access checks of the broker's operations: whether a session may publish to a topic,
//! subscribe to a filter or receive a message, asked of the authorization chain
//! ([`crate::auth::Auth`]) with the session's [`Identity`]; and what a reload of the password
//! and ACL files takes away from the sessions.

use std::sync::Arc;

use super::BrokerState;
use crate::auth::hooks::{AccessRequest, Action};
use crate::auth::{Auth, FileError, Identity};
use crate::message::{Message, Source};
use crate::session::Session;
use crate::stats::DropCause;

/// The filter a SUBSCRIBE check is about: without `$share/group/`.
pub(crate) fn subscription_topic(filter: &str) -> &str {
    match crate::topic::parse_shared(filter) {
        Ok(Some(shared)) => shared.filter,
        _ => filter,
    }
}

impl BrokerState {
    /// The chain that decides for a client of `listener` (`None`: `[auth]`'s).
    pub(crate) fn auth_of(&self, listener: Option<usize>) -> &Auth {
        listener
            .and_then(|i| self.listener_auth.get(i))
            .and_then(Option::as_ref)
            .unwrap_or(&self.auth)
    }

    /// Whether any authorizer is configured (`[auth]`'s or a listener's): when false, every
    /// access is allowed and no check costs more than this field read.
    #[inline]
    pub(crate) fn checks_access(&self) -> bool {
        self.checks_access
    }

    /// Whether `session` may receive a message published to `topic` (checked at delivery;
    /// never waits). Costs one field read when no authorizer is configured.
    #[inline]
    pub(crate) fn may_read(&self, session: &Session, topic: &str) -> bool {
        if !self.checks_access {
            return true;
        }
        self.check_now(session, topic, Action::Read)
    }

    /// The check without waiting, for `session`'s identity.
    pub(crate) fn check_now(&self, session: &Session, topic: &str, action: Action) -> bool {
        let identity = session.identity.read();
        let (username, listener) = match &*identity {
            Identity::Trusted => return true,
            Identity::Client { username, listener } => {
                (username.as_deref(), listener.map(|l| l as usize))
            }
        };
        self.auth_of(listener).authorize_now(&AccessRequest {
            client_id: &session.client_id,
            username,
            topic,
            action,
        })
    }

    /// `session`'s identity as a retained message keeps it for `check_retain_source`;
    /// `None` for the broker's own sessions (trusted).
    pub(crate) fn source_of(&self, session: &Session) -> Option<Box<Source>> {
        match &*session.identity.read() {
            Identity::Trusted => None,
            Identity::Client { username, listener } => Some(Box::new(Source {
                username: username.clone(),
                listener: *listener,
            })),
        }
    }

    /// With `check_retain_source`, whether the publisher of the retained message `msg` may
    /// still publish it: the access rules are asked for a write as its publisher (client
    /// identifier, user name, listener) at each delivery on subscribe, as mosquitto does,
    /// so a retained message left by a client whose rights were taken away is not
    /// delivered. Always true without the option, without authorizers, and for the
    /// broker's and the application's own messages. A message kept before the option was
    /// on (or from another cluster node) knows only its publisher's client identifier: it
    /// is checked as that client without a user name, under `[auth]`'s rules.
    pub(crate) fn source_may_publish(&self, msg: &Message) -> bool {
        if !self.config.server.check_retain_source || !self.checks_access {
            return true;
        }
        let Some(client_id) = msg.publisher.as_deref() else {
            return true;
        };
        if client_id.starts_with(super::INTERNAL_PREFIX) {
            return true;
        }
        let (username, listener) = msg
            .source
            .as_deref()
            .map_or((None, None), |s| (s.username.as_deref(), s.listener));
        self.auth_of(listener.map(|l| l as usize))
            .authorize_now(&AccessRequest {
                client_id,
                username,
                topic: &msg.topic,
                action: Action::Write,
            })
    }

    /// Whether handling a client's PUBLISH may wait: for an authorizer or an interceptor
    /// (both fixed for the broker's lifetime).
    #[inline]
    pub(crate) fn publish_waits(&self) -> bool {
        self.checks_access || !self.interceptors.is_empty()
    }

    /// Whether a client may publish to `topic` or subscribe to `filter`: asks every
    /// authorizer, waiting for those that need to. Always true without authorizers.
    pub(crate) async fn may(&self, session: &Session, topic: &str, action: Action) -> bool {
        if !self.checks_access {
            return true;
        }
        let (username, listener) = match &*session.identity.read() {
            Identity::Trusted => return true,
            Identity::Client { username, listener } => {
                (username.clone(), listener.map(|l| l as usize))
            }
        };
        self.auth_of(listener)
            .authorize(&AccessRequest {
                client_id: &session.client_id,
                username: username.as_deref(),
                topic,
                action,
            })
            .await
    }

    /// Reloads the password and ACL files, then removes the subscriptions their clients may
    /// no longer hold, and the queued messages they may no longer read (counted
    /// `not_authorized`, as a delivery refused at routing would be). Returns the files that
    /// could not be read (their old contents stay).
    pub(crate) fn reload_auth(&self) -> Vec<FileError> {
        let mut errors = self.auth.reload();
        for auth in self.listener_auth.iter().flatten() {
            errors.extend(auth.reload());
        }
        self.revoke_unauthorized();
        errors
    }

    /// Removes the subscriptions the clients may no longer hold, and the queued messages
    /// they may no longer read (counted `not_authorized`): after a reload of the access
    /// rules, and after the restore at start (rules changed while the broker was down).
    pub(crate) fn revoke_unauthorized(&self) {
        if !self.checks_access {
            return;
        }
        let sessions: Vec<Arc<Session>> = self.sessions.lock().values().cloned().collect();
        // In-process subscriptions and bridges are the broker's own: always trusted.
        for session in sessions.into_iter().filter(|s| !s.is_internal()) {
            let filters = session.filters();
            for filter in filters {
                if !self.check_now(&session, subscription_topic(&filter), Action::Subscribe) {
                    tracing::info!(client_id = %session.client_id, %filter, "subscription removed: no longer authorized");
                    self.unsubscribe(&session, &filter);
                }
            }
            self.drop_unreadable_queued(&session);
        }
    }

    /// Removes from `session`'s queue the messages its client may no longer read.
    fn drop_unreadable_queued(&self, session: &Session) {
        let mut st = session.state.lock();
        if st.queue().is_empty() {
            return;
        }
        let mut topics = Vec::new();
        let removed = st.remove_queued(&session.client_id, |q| {
            let keep = self.check_now(session, &q.msg.topic, Action::Read);
            if !keep {
                topics.push(Arc::clone(&q.msg));
            }
            keep
        });
        // Counted (and told to the application) with the session's lock released.
        drop(st);
        for msg in &topics {
            self.dropped(
                Some(&session.client_id),
                &msg.topic,
                DropCause::NotAuthorized,
            );
        }
        if removed > 0 {
            tracing::info!(client_id = %session.client_id, removed, "queued messages removed: no longer authorized");
        }
    }
}
