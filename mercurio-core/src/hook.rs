//! Running the embedding application's hooks (authenticators, authorizers, publish
//! interceptors) so that a panic in one costs only the answer it was asked for.
//!
//! The hooks run on a connection's task. A panic left to unwind would end that task between
//! two of its steps: its session would stay tied to a connection that no longer exists, and
//! every later CONNECT with that client identifier would wait for that connection to close.
//! Instead the panic is caught where the hook is called, logged once at error level with the
//! client identifier, and the caller answers as for a refusal. The hooks hold none of the
//! broker's locks while they run, so nothing is left half changed.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;

/// Awaits `hook`, a call of the application's `what` (e.g. "publish interceptor") for
/// `client_id`; `None` when it panicked (logged).
pub(crate) async fn guard<F: Future>(what: &str, client_id: &str, hook: F) -> Option<F::Output> {
    match AssertUnwindSafe(hook).catch_unwind().await {
        Ok(answer) => Some(answer),
        Err(panic) => {
            log(what, client_id, &*panic);
            None
        }
    }
}

/// Calls `hook`, a call of the application's `what` that does not wait, for `client_id`;
/// `None` when it panicked (logged).
pub(crate) fn guard_now<T>(what: &str, client_id: &str, hook: impl FnOnce() -> T) -> Option<T> {
    match std::panic::catch_unwind(AssertUnwindSafe(hook)) {
        Ok(answer) => Some(answer),
        Err(panic) => {
            log(what, client_id, &*panic);
            None
        }
    }
}

fn log(what: &str, client_id: &str, panic: &(dyn Any + Send)) {
    let message = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    tracing::error!(
        client_id,
        "{what} panicked: {message}; answered as a refusal"
    );
}

#[cfg(test)]
mod tests {
    use super::{guard, guard_now};

    #[tokio::test]
    async fn a_panic_becomes_none() {
        assert_eq!(guard("hook", "c", async { 7 }).await, Some(7));
        let panicked: Option<u8> = guard("hook", "c", async { panic!("boom") }).await;
        assert_eq!(panicked, None);
        assert_eq!(guard_now("hook", "c", || 7), Some(7));
        let panicked: Option<u8> = guard_now("hook", "c", || panic!("{}", String::from("boom")));
        assert_eq!(panicked, None);
    }
}
