//! nats-server as a process, for the cluster tests: a NATS server on free ports with its
//! monitoring endpoint, its subscriptions and connections read through it.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{prerequisite, Proc, DEADLINE};

/// nats-server listening on 127.0.0.1 (clients and monitoring on free ports, JetStream on in
/// a temporary directory); killed when dropped.
pub struct NatsServer {
    /// The process.
    pub proc: Proc,
    /// The client port.
    pub port: u16,
    /// The monitoring (HTTP) port.
    pub monitor_port: u16,
    _dir: tempfile::TempDir,
    // Last, so that it is released after the process is killed.
    _one_at_a_time: OneAtATime,
}

/// One test at a time runs NATS servers (and the cluster of brokers around them): a test
/// thread's first server waits for the other tests' servers to be gone; its further servers
/// (a NATS cluster, a partition's two sides) join it. Three brokers, three NATS servers and
/// PostgreSQL per test are as much as two cores keep within the cluster tests' timeouts.
struct OneAtATime;

/// The test thread whose servers run, and how many it has.
static RUNNING: std::sync::Mutex<Option<(std::thread::ThreadId, usize)>> =
    std::sync::Mutex::new(None);
static GONE: std::sync::Condvar = std::sync::Condvar::new();

impl OneAtATime {
    fn wait() -> OneAtATime {
        let me = std::thread::current().id();
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match running.as_mut() {
                None => {
                    *running = Some((me, 1));
                    return OneAtATime;
                }
                Some((thread, n)) if *thread == me => {
                    *n += 1;
                    return OneAtATime;
                }
                Some(_) => running = GONE.wait(running).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }
}

impl Drop for OneAtATime {
    fn drop(&mut self) {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, n)) = running.as_mut() {
            *n -= 1;
            if *n == 0 {
                *running = None;
                GONE.notify_all();
            }
        }
    }
}

/// The nats-server program: `$NATS_SERVER`, else `nats-server` on the PATH or in /usr/sbin.
pub fn nats_server_bin() -> Option<PathBuf> {
    let candidates: Vec<PathBuf> = match std::env::var_os("NATS_SERVER") {
        Some(p) => vec![PathBuf::from(p)],
        None => [
            "nats-server",
            "/usr/sbin/nats-server",
            "/usr/local/bin/nats-server",
        ]
        .iter()
        .map(PathBuf::from)
        .collect(),
    };
    candidates.into_iter().find(|p| {
        Command::new(p)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

impl NatsServer {
    /// Starts nats-server; returns once its client and monitoring ports accept connections,
    /// within [`DEADLINE`], else panics. `None` when nats-server is not installed: `test`
    /// then skips, or fails under `CI=true` ([`prerequisite`]).
    pub fn start(test: &str) -> Option<NatsServer> {
        NatsServer::start_on(test, 0)
    }

    /// [`NatsServer::start`] with its client port `port` (0: a free one), to start it again
    /// where clients expect it.
    pub fn start_on(test: &str, port: u16) -> Option<NatsServer> {
        NatsServer::launch(test, port, None, None)
    }

    /// A member of a NATS cluster (no JetStream, and not advertising the other members to its
    /// clients): clients on `port` (0: a free one), routes
    /// between servers on `cluster_port`, connecting to the members whose cluster ports are
    /// `routes`. Returns once its ports accept connections (the routes may come later: see
    /// [`NatsServer::routes`]). `None` as [`NatsServer::start`].
    pub fn start_clustered(
        test: &str,
        port: u16,
        cluster_port: u16,
        routes: &[u16],
    ) -> Option<NatsServer> {
        NatsServer::launch(test, port, Some((cluster_port, routes)), None)
    }

    /// A member of a NATS cluster whose routes change at run time: as
    /// [`NatsServer::start_clustered`], configured through a file that [`NatsServer::route_to`]
    /// rewrites. It starts with no route: a partition, until routes are added.
    pub fn start_partitioned(test: &str, cluster_port: u16) -> Option<NatsServer> {
        NatsServer::launch(test, 0, Some((cluster_port, &[])), None)
    }

    /// Rewrites this server's configuration with routes to the members whose cluster ports
    /// are `routes` and has it reread (SIGHUP): a partition heals without its clients
    /// reconnecting.
    pub fn route_to(&self, cluster_port: u16, routes: &[u16]) {
        std::fs::write(
            self._dir.path().join("nats.conf"),
            cluster_conf(cluster_port, routes),
        )
        .expect("write nats.conf");
        self.proc.signal(libc::SIGHUP);
    }

    /// Routes to other servers of its NATS cluster now (`/routez`'s `num_routes`).
    pub fn routes(&self) -> u64 {
        self.monitor("/routez")["num_routes"].as_u64().unwrap_or(0)
    }

    /// nats-server alone with JetStream (`cluster` `None`), or a member of a NATS cluster:
    /// without JetStream, or with it as the server `jetstream_member` names.
    fn launch(
        test: &str,
        port: u16,
        cluster: Option<(u16, &[u16])>,
        jetstream_member: Option<&str>,
    ) -> Option<NatsServer> {
        let Some(bin) = nats_server_bin() else {
            prerequisite(
                test,
                Err("nats-server is not installed; install: apt-get install nats-server".into()),
            );
            return None;
        };
        let one_at_a_time = OneAtATime::wait();
        let dir = tempfile::tempdir().expect("temp dir");
        // nats-server takes no port 0: free ports, found by binding port 0 first.
        let port = if port == 0 { free_port() } else { port };
        let monitor_port = free_port();
        let mut command = Command::new(bin);
        command
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .args(["-m", &monitor_port.to_string()]);
        match cluster {
            None => {
                command.args(["-js", "-sd"]).arg(dir.path());
            }
            Some((cluster_port, routes)) => {
                // The cluster's settings in a file, which `route_to` may rewrite and have
                // reread. Clients keep to the server they were given (`no_advertise`): a test
                // stopping it cuts them off NATS, rather than sending them to another member.
                let conf = dir.path().join("nats.conf");
                let mut text = String::new();
                if let Some(name) = jetstream_member {
                    // A JetStream cluster needs each server named.
                    text = format!(
                        "server_name: {name}\njetstream {{\n  store_dir: {:?}\n}}\n",
                        dir.path().join("js").display().to_string()
                    );
                }
                text.push_str(&cluster_conf(cluster_port, routes));
                std::fs::write(&conf, text).expect("nats.conf");
                command.arg("-c").arg(&conf);
            }
        }
        let proc = Proc::spawn_merged("nats-server", &mut command);
        let deadline = Instant::now() + DEADLINE;
        for p in [port, monitor_port] {
            while TcpStream::connect(("127.0.0.1", p)).is_err() {
                assert!(
                    Instant::now() < deadline,
                    "nats-server does not listen on port {p}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Some(NatsServer {
            proc,
            port,
            monitor_port,
            _dir: dir,
            _one_at_a_time: one_at_a_time,
        })
    }

    /// The URL clients connect to: `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// A monitoring endpoint's JSON (`/subsz`, `/connz?subs=1`...).
    pub fn monitor(&self, path: &str) -> serde_json::Value {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.monitor_port));
        let mut response = crate::http::get(addr, path);
        if response.header("transfer-encoding") == Some("chunked") {
            response.body = dechunk(&response.body);
        }
        response.json()
    }

    /// Subscriptions the server holds now (`/subsz`'s `num_subscriptions`), JetStream's own
    /// included.
    pub fn subscriptions(&self) -> u64 {
        self.monitor("/subsz")["num_subscriptions"]
            .as_u64()
            .expect("num_subscriptions")
    }

    /// The client connection named `name`, as `/connz?subs=1` reports it (`in_msgs`,
    /// `out_msgs`, `subscriptions_list`...); `None` when no such client is connected.
    pub fn connection(&self, name: &str) -> Option<serde_json::Value> {
        let connz = self.monitor("/connz?subs=1");
        connz["connections"]
            .as_array()?
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
    }
}

/// The `cluster` block of a member's configuration: its route port, routes to `routes`.
fn cluster_conf(cluster_port: u16, routes: &[u16]) -> String {
    let routes: Vec<String> = routes
        .iter()
        .map(|p| format!("\"nats://127.0.0.1:{p}\""))
        .collect();
    format!(
        "cluster {{\n  name: mercurio-test\n  listen: \"127.0.0.1:{cluster_port}\"\n  \
         no_advertise: true\n  routes: [{}]\n}}\n",
        routes.join(", ")
    )
}

/// A chunked body's data (RFC 9112 section 7.1): each chunk's size line dropped.
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .unwrap_or_else(|e| panic!("bad chunk size {size:?}: {e}"));
        if size == 0 || tail.len() < size {
            break;
        }
        out.push_str(&tail[..size]);
        rest = tail[size..].trim_start_matches("\r\n");
    }
    out
}

/// A port no one listens on now (bound, then released): where a NATS server will
/// be started later.
///
/// Below Linux's ephemeral range (32768 and up): a server a test stops and starts again on
/// its port could otherwise find it taken meanwhile by the source port of an outgoing
/// connection, a client's reconnecting to that very port among them (a socket connected to
/// itself).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const PORTS: u32 = 32_768 - FIRST;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id().wrapping_mul(2_654_435_761);
    for _ in 0..PORTS {
        let n = NEXT.fetch_add(1, Ordering::Relaxed).wrapping_add(seed) % PORTS;
        let Ok(port) = u16::try_from(FIRST + n) else {
            continue;
        };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address").port()
}

/// A NATS cluster of servers with JetStream, routed to each other on loopback, for the
/// tests of QoS 1 and 2 between nodes (docs/cluster.md, "QoS across nodes"); each server
/// killed when dropped.
pub struct NatsCluster {
    /// The servers, in the order started (named `n1`, `n2`, ...).
    pub servers: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts `n` servers with JetStream (each its own store directory), every one routed to
    /// every other; returns once every route is up and JetStream has elected its meta
    /// leader, within [`DEADLINE`], else panics. `None` when nats-server is not installed
    /// ([`NatsServer::start`]).
    pub fn start(test: &str, n: usize) -> Option<NatsCluster> {
        let cluster_ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let mut servers = Vec::with_capacity(n);
        for (i, port) in cluster_ports.iter().enumerate() {
            let routes: Vec<u16> = cluster_ports
                .iter()
                .copied()
                .filter(|p| p != port)
                .collect();
            let name = format!("n{}", i + 1);
            servers.push(NatsServer::launch(
                test,
                0,
                Some((*port, &routes)),
                Some(&name),
            )?);
        }
        let cluster = NatsCluster { servers };
        let deadline = Instant::now() + DEADLINE;
        for s in &cluster.servers {
            while s.routes() < (n - 1) as u64 || !s.jetstream_ready() {
                assert!(
                    Instant::now() < deadline,
                    "the NATS cluster did not form: routes {} of {}, JetStream ready: {}",
                    s.routes(),
                    n - 1,
                    s.jetstream_ready()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(cluster)
    }

    /// Every server's client URL.
    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(NatsServer::url).collect()
    }
}

impl NatsServer {
    /// The state of the JetStream stream `name` on this server (`/jsz?streams=true`:
    /// `messages`, `bytes`, `first_seq`, `last_seq`...); `None` when it holds no such stream.
    pub fn stream_state(&self, name: &str) -> Option<serde_json::Value> {
        let jsz = self.monitor("/jsz?streams=true");
        jsz["account_details"]
            .as_array()?
            .iter()
            .filter_map(|a| a["stream_detail"].as_array())
            .flatten()
            .find(|s| s["name"] == name)
            .map(|s| s["state"].clone())
    }

    /// Whether JetStream answers: on and, in a cluster, with a meta leader (`/jsz`).
    pub fn jetstream_ready(&self) -> bool {
        let jsz = self.monitor("/jsz");
        match jsz.get("meta_cluster") {
            Some(meta) => meta["leader"].as_str().is_some_and(|l| !l.is_empty()),
            None => jsz.get("config").is_some(),
        }
    }
}

/// Where a [`ClusterNode`] keeps its sessions, with `durable_ack` either way (every
/// acknowledgement after its commit).
#[derive(Clone, Debug)]
pub enum NodeStorage {
    /// An SQLite file in a temporary directory of the node's own.
    Sqlite,
    /// The PostgreSQL database at this URL (`postgres://user@host:port/database`), the
    /// node's own: the test starts the server and makes one database per node.
    Postgres(String),
}

/// A mercuriod node of a cluster, with storage of its own (SQLite or PostgreSQL,
/// `durable_ack`) that outlives its process: it can be killed and started again on the same
/// storage with the same `node_name`, as after a crash.
pub struct ClusterNode {
    /// Its `node_name`.
    pub name: String,
    /// The running process.
    pub daemon: crate::Daemon,
    /// The configuration text given to each start.
    extra: String,
    _storage: tempfile::TempDir,
}

impl ClusterNode {
    /// Starts node `name` on the NATS servers `urls`, on SQLite, with `extra` configuration
    /// (sections before `[storage]` and `[cluster]`; `[cluster]` keys may follow in
    /// `cluster_extra`); returns once it has connected to NATS. The JetStream stream is kept
    /// to 64 MiB (`jetstream_max_bytes`): JetStream refuses a stream larger than the free disk
    /// of its servers, and a test machine's disk may have less than the default 1 GiB free.
    pub fn start(name: &str, urls: &[String], extra: &str, cluster_extra: &str) -> ClusterNode {
        ClusterNode::start_on(name, urls, NodeStorage::Sqlite, extra, cluster_extra)
    }

    /// [`ClusterNode::start`] on `storage`.
    pub fn start_on(
        name: &str,
        urls: &[String],
        storage: NodeStorage,
        extra: &str,
        cluster_extra: &str,
    ) -> ClusterNode {
        let dir = tempfile::tempdir().expect("temp dir");
        let storage = match storage {
            NodeStorage::Sqlite => format!(
                "backend = \"sqlite\"\npath = {:?}",
                dir.path().join("mercurio.db").display().to_string()
            ),
            NodeStorage::Postgres(url) => format!("backend = \"postgres\"\nurl = {url:?}"),
        };
        let urls: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
        let extra = format!(
            "{extra}[storage]\n{storage}\ndurable_ack = true\n\n\
             [cluster]\nnats_urls = [{}]\nnode_name = \"{name}\"\njetstream_max_bytes = 67108864\n{cluster_extra}",
            urls.join(", ")
        );
        let daemon = ClusterNode::launch(&extra);
        ClusterNode {
            name: name.to_string(),
            daemon,
            extra,
            _storage: dir,
        }
    }

    fn launch(extra: &str) -> crate::Daemon {
        let mut d = crate::Daemon::start(extra);
        d.wait_logged("the connection to NATS", |l| {
            l.contains("cluster: connected to NATS")
        });
        d
    }

    /// Kills the process (SIGKILL: no last write, no goodbye to the other nodes) and waits
    /// for its end.
    pub fn kill(&mut self) {
        self.daemon.signal(libc::SIGKILL);
        let _ = self.daemon.wait_exit();
    }

    /// Stalls the process (SIGSTOP: a long pause, a frozen VM): its sockets stay open and
    /// silent until [`ClusterNode::resume`].
    pub fn stall(&self) {
        self.daemon.signal(libc::SIGSTOP);
    }

    /// Resumes a process [`ClusterNode::stall`] stalled (SIGCONT).
    pub fn resume(&self) {
        self.daemon.signal(libc::SIGCONT);
    }

    /// Starts the node again, on the same storage and with the same name (a new listening
    /// port: read it from `daemon`).
    pub fn restart(&mut self) {
        self.daemon = ClusterNode::launch(&self.extra);
    }
}
