//! A PostgreSQL server for tests (feature `conformance`): `MERCURIO_TEST_POSTGRES_URL`, or a
//! throwaway cluster started from the machine's binaries (`initdb`, `pg_ctl` on `PATH`, in
//! `/usr/local/bin` or Debian's `/usr/lib/postgresql/NN/bin`), run as the `postgres` user when
//! the tests run as root, on a private port and socket directory, removed when dropped.
//!
//! [`TestPostgres::start`] returns `None` when neither is there, after printing why; with
//! `CI=true` it panics instead (a missing prerequisite is a failure there).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A PostgreSQL server for one test, which creates a database per call of
/// [`database`](TestPostgres::database).
pub struct TestPostgres {
    /// `postgres://user@host:port`, without a database name.
    base: String,
    /// The throwaway cluster, stopped and removed on drop; `None` with an external server.
    cluster: Option<Cluster>,
}

struct Cluster {
    pg_ctl: PathBuf,
    dir: PathBuf,
    as_postgres: Option<(u32, u32)>,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn find_binaries() -> Option<(PathBuf, PathBuf)> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.push("/usr/local/bin".into());
    dirs.push("/usr/local/pgsql/bin".into());
    let mut debian: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| rd.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    debian.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    debian.reverse();
    dirs.extend(debian);
    dirs.into_iter().find_map(|d| {
        let (initdb, pg_ctl) = (d.join("initdb"), d.join("pg_ctl"));
        (initdb.is_file() && pg_ctl.is_file()).then_some((initdb, pg_ctl))
    })
}

fn unavailable(test: &str, why: &str) -> Option<TestPostgres> {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test}: PostgreSQL is required in CI: {why}");
    }
    // The prerequisite rule of mercurio-testkit (which sits above this crate), in its words:
    // written straight to standard error, past the test harness's capture.
    let line = format!(
        "SKIPPED {test}: {why}; install: apt-get install postgresql (or set \
         MERCURIO_TEST_POSTGRES_URL) (CI=true makes this a failure)\n"
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    None
}

/// The uid and gid of `postgres`, created if missing.
fn postgres_user() -> Result<(u32, u32), String> {
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").args([flag, "postgres"]).output().ok()?;
        out.status.success().then_some(())?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    if id("-u").is_none() {
        let status = Command::new("useradd")
            .args(["--system", "--user-group", "--no-create-home", "postgres"])
            .status()
            .map_err(|e| format!("useradd: {e}"))?;
        if !status.success() {
            return Err("useradd postgres failed".into());
        }
    }
    match (id("-u"), id("-g")) {
        (Some(u), Some(g)) => Ok((u, g)),
        _ => Err("no postgres user".into()),
    }
}

fn run(mut command: Command, as_postgres: Option<(u32, u32)>, what: &str) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    if let Some((uid, gid)) = as_postgres {
        command.uid(uid).gid(gid);
    }
    let out = command.output().map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

impl TestPostgres {
    /// A server for `test`, or `None` (after printing why) when there is none.
    pub fn start(test: &str) -> Option<TestPostgres> {
        if let Ok(url) = std::env::var("MERCURIO_TEST_POSTGRES_URL") {
            let base = url
                .rsplit_once('/')
                .map(|(b, _)| b.to_string())
                .unwrap_or(url);
            return Some(TestPostgres {
                base,
                cluster: None,
            });
        }
        let Some((initdb, pg_ctl)) = find_binaries() else {
            return unavailable(test, "no MERCURIO_TEST_POSTGRES_URL and no initdb/pg_ctl");
        };
        match Self::start_cluster(test, &initdb, &pg_ctl, None) {
            Ok(pg) => Some(pg),
            Err(e) => unavailable(test, &e),
        }
    }

    /// A throwaway cluster serving TLS with this PEM certificate and key (`ssl = on`), or
    /// `None` (after printing why). Ignores `MERCURIO_TEST_POSTGRES_URL`, whose TLS setup is
    /// unknown.
    pub fn start_tls(test: &str, cert_pem: &str, key_pem: &str) -> Option<TestPostgres> {
        let Some((initdb, pg_ctl)) = find_binaries() else {
            return unavailable(test, "no initdb/pg_ctl found");
        };
        match Self::start_cluster(test, &initdb, &pg_ctl, Some((cert_pem, key_pem))) {
            Ok(pg) => Some(pg),
            Err(e) => unavailable(test, &e),
        }
    }

    fn start_cluster(
        test: &str,
        initdb: &Path,
        pg_ctl: &Path,
        tls: Option<(&str, &str)>,
    ) -> Result<TestPostgres, String> {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let as_postgres = if root { Some(postgres_user()?) } else { None };
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "mercurio-pg-{}-{}-{n}",
            test.replace(|c: char| !c.is_ascii_alphanumeric(), "_"),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let cluster = Cluster {
            pg_ctl: pg_ctl.to_path_buf(),
            dir: dir.clone(),
            as_postgres,
        };
        if let Some((uid, gid)) = as_postgres {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
        }
        let data = dir.join("data");
        let mut init = Command::new(initdb);
        init.arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .env("LC_ALL", "C");
        run(init, as_postgres, "initdb")?;
        let mut ssl = String::new();
        if let Some((cert, key)) = tls {
            for (name, pem) in [("server.crt", cert), ("server.key", key)] {
                let path = data.join(name);
                std::fs::write(&path, pem).map_err(|e| format!("{}: {e}", path.display()))?;
                std::fs::set_permissions(
                    &path,
                    std::os::unix::fs::PermissionsExt::from_mode(0o600),
                )
                .map_err(|e| e.to_string())?;
                if let Some((uid, gid)) = as_postgres {
                    std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                        .map_err(|e| e.to_string())?;
                }
            }
            ssl = " -c ssl=on".to_string();
        }
        let mut last = String::new();
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| e.to_string())?
                .port();
            let mut start = Command::new(pg_ctl);
            start
                .arg("-D")
                .arg(&data)
                .arg("-l")
                .arg(dir.join("log"))
                .args(["-w", "-t", "60", "-o"])
                .arg(format!(
                    "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off \
                     -c max_connections=200{ssl}",
                    dir.display()
                ))
                .arg("start");
            match run(start, as_postgres, "pg_ctl start") {
                Ok(()) => {
                    return Ok(TestPostgres {
                        base: format!("postgres://postgres@127.0.0.1:{port}"),
                        cluster: Some(cluster),
                    })
                }
                Err(e) => {
                    last = format!(
                        "{e}\n{}",
                        std::fs::read_to_string(dir.join("log")).unwrap_or_default()
                    )
                }
            }
        }
        Err(last)
    }

    /// The URL of database `name` (which [`database`](Self::database) creates).
    pub fn url(&self, name: &str) -> String {
        format!("{}/{name}", self.base)
    }

    /// The administrator's URL (database `postgres`).
    pub fn admin_url(&self) -> String {
        self.url("postgres")
    }

    /// Creates a new empty database named after `prefix`, owned by `owner` (the
    /// administrator when `None`), and returns its name.
    pub async fn database(&self, prefix: &str, owner: Option<&str>) -> String {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{prefix}_{}_{n}", std::process::id());
        let owner = owner.map(|o| format!(" OWNER {o}")).unwrap_or_default();
        self.admin(&format!("CREATE DATABASE {name}{owner}")).await;
        name
    }

    /// Runs `sql` as the administrator on database `postgres`.
    pub async fn admin(&self, sql: &str) {
        self.execute(&self.admin_url(), sql).await;
    }

    /// Runs `sql` on the database at `url`.
    pub async fn execute(&self, url: &str, sql: &str) {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("connect {url}: {e}"));
        let task = tokio::spawn(connection);
        client
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {}", super::describe(&e)));
        drop(client);
        let _ = task.await;
    }
}

impl TestPostgres {
    /// Runs `sql` on the database at `url` and returns the first column of its first row,
    /// as text (`None` for no row or NULL).
    pub async fn scalar(&self, url: &str, sql: &str) -> Option<String> {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("connect {url}: {e}"));
        let task = tokio::spawn(connection);
        let messages = client
            .simple_query(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {}", super::describe(&e)));
        drop(client);
        let _ = task.await;
        messages.into_iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
            _ => None,
        })
    }
}

impl Drop for TestPostgres {
    fn drop(&mut self) {
        if let Some(cluster) = &self.cluster {
            let mut stop = Command::new(&cluster.pg_ctl);
            stop.arg("-D")
                .arg(cluster.dir.join("data"))
                .args(["-m", "immediate", "-w", "stop"]);
            let _ = run(stop, cluster.as_postgres, "pg_ctl stop");
            let _ = std::fs::remove_dir_all(&cluster.dir);
        }
    }
}

/// The SQL of schema version 3 (before the message store), to build a database as an older
/// broker left it and check its upgrade.
pub const SCHEMA_VERSION_3_SQL: &str = super::schema::SCHEMA_V3;

/// The SQL of schema version 6 (a row of `mercurio_queued` per queued delivery, no
/// `mercurio_messages.refs`), to build a database as the previous broker left it and check
/// its upgrade; the caller records the version (`mercurio_meta`).
pub fn schema_version_6_sql() -> String {
    super::schema::schema_v6()
}
