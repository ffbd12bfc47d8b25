//! The memory backend's test facilities and the error kinds. The conformance checks run on
//! it from `src/memory.rs`'s unit tests.

use std::time::Duration;

use mercurio_storage::{
    Change, ErrorKind, MemoryStorage, MessageRecord, SessionHeader, Storage, StorageError,
    REFUSED_ATTEMPTS,
};

fn saved(client_id: &str) -> Change {
    Change::SessionSaved(SessionHeader {
        client_id: client_id.to_string(),
        protocol_level: 5,
        session_expiry_interval: 0,
        disconnected_at: None,
        username: None,
        certificate: None,
    })
}

#[tokio::test]
async fn name_is_memory() {
    assert_eq!(MemoryStorage::new().name(), "memory");
}

#[tokio::test]
async fn injected_failures_apply_nothing_then_clear() {
    let storage = MemoryStorage::new();
    storage.fail_next(ErrorKind::Transient, 2);
    storage.fail_next(ErrorKind::Refused, 1);
    let batch = [saved("a")];
    let first = storage.apply(&batch).await;
    assert!(matches!(first, Err(ref e) if e.is_transient()));
    assert!(
        storage.apply(&[]).await.is_ok(),
        "empty batches skip injection"
    );
    assert!(matches!(storage.apply(&batch).await, Err(ref e) if e.is_transient()));
    assert!(matches!(storage.apply(&batch).await, Err(ref e) if e.is_refused()));
    assert!(storage.snapshot().sessions.is_empty());
    assert_eq!(storage.applied_batches(), 0);
    assert!(storage.apply(&batch).await.is_ok());
    assert_eq!(storage.snapshot().sessions.len(), 1);
    assert_eq!(storage.applied_batches(), 1);
}

#[tokio::test]
async fn clones_share_state() {
    let storage = MemoryStorage::new();
    let other = storage.clone();
    storage
        .apply(&[
            saved("a"),
            Change::RetainedSet(mercurio_storage::RetainedRecord::new(MessageRecord::new(
                "t", "p", 0,
            ))),
        ])
        .await
        .unwrap();
    let loaded = other.load().await.unwrap();
    assert_eq!(loaded.sessions.len(), 1);
    assert_eq!(loaded.retained.len(), 1);
    assert!(format!("{other:?}").contains("sessions: 1"));
}

#[tokio::test]
async fn set_aside_without_data_is_listed_and_deleted() {
    let storage = MemoryStorage::new();
    storage.set_aside("ghost", "unknown schema");
    let loaded = storage.load().await.unwrap();
    assert_eq!(loaded.set_aside.len(), 1);
    assert_eq!(loaded.set_aside[0].cause, "unknown schema");
    assert!(storage.delete_session("ghost").await.unwrap());
    assert!(storage.load().await.unwrap().set_aside.is_empty());
}

#[tokio::test]
async fn wait_until_sees_later_batches() {
    let storage = MemoryStorage::new();
    let writer = storage.clone();
    let task = tokio::spawn(async move {
        for i in 0..10 {
            writer.apply(&[saved(&format!("c{i}"))]).await.unwrap();
            tokio::task::yield_now().await;
        }
    });
    tokio::time::timeout(
        Duration::from_secs(10),
        storage.wait_until(|state| state.sessions.len() == 10),
    )
    .await
    .expect("ten sessions stored within the deadline");
    task.await.unwrap();
}

#[test]
fn error_kind_predicates() {
    let cases = [
        (StorageError::transient("busy"), ErrorKind::Transient),
        (StorageError::refused("constraint"), ErrorKind::Refused),
        (StorageError::fenced("epoch 3 > 2"), ErrorKind::Fenced),
        (
            StorageError::incompatible("schema 9"),
            ErrorKind::Incompatible,
        ),
        (StorageError::fatal("broken"), ErrorKind::Fatal),
    ];
    for (error, kind) in cases {
        assert_eq!(error.kind(), kind);
        assert_eq!(error.is_transient(), kind == ErrorKind::Transient);
        assert_eq!(error.is_refused(), kind == ErrorKind::Refused);
        assert_eq!(error.is_fenced(), kind == ErrorKind::Fenced);
        assert_eq!(error.is_incompatible(), kind == ErrorKind::Incompatible);
        assert_eq!(error.is_fatal(), kind == ErrorKind::Fatal);
        assert_eq!(
            error.must_stop(),
            matches!(
                kind,
                ErrorKind::Fenced | ErrorKind::Incompatible | ErrorKind::Fatal
            )
        );
        assert!(error.to_string().contains(kind.as_str()));
        assert!(error.to_string().contains(error.message()));
    }
    assert_eq!(REFUSED_ATTEMPTS, 5);
}

#[test]
fn error_source_is_kept() {
    use std::error::Error;
    let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused by peer");
    let error = StorageError::transient("database unreachable").with_source(io);
    let source = error.source().expect("a source");
    assert_eq!(source.to_string(), "refused by peer");
    assert_eq!(
        error.to_string(),
        "storage error (transient): database unreachable"
    );
}
