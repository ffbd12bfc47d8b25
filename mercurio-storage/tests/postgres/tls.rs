//! The PostgreSQL backend over TLS, as `sslmode` asks (libpq's meanings): `require` encrypts,
//! `verify-full` also checks the certificate against `sslrootcert` and the host name. Runs on a
//! throwaway cluster with `ssl = on`; without PostgreSQL it prints why it skips (and fails with
//! `CI=true`).

use mercurio_storage::postgres::testing::TestPostgres;
use mercurio_storage::postgres::{PostgresOptions, PostgresStorage};
use mercurio_storage::Storage;

/// A self-signed certificate for 127.0.0.1 (PEM certificate, PEM key).
fn certificate(name: &str) -> (String, String) {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).expect("params");
    params.subject_alt_names = vec![rcgen::SanType::IpAddress("127.0.0.1".parse().expect("ip"))];
    let cert = params.self_signed(&key).expect("certificate");
    (cert.pem(), key.serialize_pem())
}

#[tokio::test]
async fn sslmode_require_and_verify_full() {
    let (cert, key) = certificate("db.test");
    let Some(pg) = TestPostgres::start_tls("postgres_tls", &cert, &key) else {
        return;
    };
    let db = pg.database("tls", None).await;
    let dir = tempfile_dir();
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, &cert).expect("write ca");

    // require: encrypted, certificate not checked (libpq's behaviour).
    let url = format!("{}?sslmode=require", pg.url(&db));
    let storage = PostgresStorage::open(PostgresOptions::new(&url))
        .await
        .expect("open with sslmode=require");
    storage.load().await.expect("load over TLS");
    storage.close().await.expect("close");
    let encrypted = pg_ssl_in_use(&pg, &db).await;
    assert!(encrypted, "the broker's connections used TLS");

    // verify-full with the right root: the chain and the address match.
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        pg.url(&db),
        ca.display()
    );
    let storage = PostgresStorage::open(PostgresOptions::new(&url))
        .await
        .expect("open with verify-full");
    storage.load().await.expect("load over verified TLS");
    storage.close().await.expect("close");

    // verify-full against another root: refused, with a reason.
    let (other, _) = certificate("other.test");
    let wrong = dir.join("other.pem");
    std::fs::write(&wrong, other).expect("write other");
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        pg.url(&db),
        wrong.display()
    );
    match PostgresStorage::open(PostgresOptions::new(&url)).await {
        Ok(_) => panic!("a certificate from another root was accepted"),
        Err(e) => assert!(e.to_string().to_lowercase().contains("certificate"), "{e}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether every client connection to `db` seen by the server used TLS (pg_stat_ssl), checked
/// while a fresh verified connection is open.
async fn pg_ssl_in_use(pg: &TestPostgres, db: &str) -> bool {
    let url = format!("{}?sslmode=require", pg.url(db));
    let storage = PostgresStorage::open(PostgresOptions::new(&url))
        .await
        .expect("reopen");
    let (client, connection) = tokio_postgres_connect(&pg.admin_url()).await;
    let rows = client
        .query(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.datname = $1 AND a.application_name = 'mercurio'",
            &[&db],
        )
        .await
        .expect("pg_stat_ssl");
    drop(client);
    connection.abort();
    storage.close().await.expect("close");
    !rows.is_empty() && rows.iter().all(|r| r.get::<_, bool>(0))
}

async fn tokio_postgres_connect(
    url: &str,
) -> (tokio_postgres::Client, tokio::task::JoinHandle<()>) {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("admin connection");
    let task = tokio::spawn(async move {
        let _ = connection.await;
    });
    (client, task)
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mercurio-pg-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}
