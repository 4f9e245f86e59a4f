//! Test support: private real servers for the integration tests in `tests/tests/`.
//!
//! Every server is started by the same code as `flashsale stack up` ([`flashsale_engine::app::stack`]):
//! - Redis and NATS: one fresh instance per call, on a free 127.0.0.1 port, data in its own
//!   temporary directory, stopped on drop. They start in milliseconds, so no test ever sees
//!   another test's keys or streams, and a drill may kill or flush its own instance.
//! - PostgreSQL: one private cluster per checkout (initdb takes seconds), shared by the test
//!   binaries through the stack's idempotent `ensure` under a lock; each call to
//!   [`pg_database`] creates a fresh database in it.
//!
//! - A Redis Cluster (3 masters + 3 replicas): one per test binary, shared by its tests,
//!   with the drills' levers ([`cluster`]).
//! - A sale under way and the end checks of a fault drill ([`sale`]).
//! - An OTLP/HTTP trace receiver decoding real export requests ([`otlp`]).
//!
//! Nothing here touches the machine's own servers on the standard ports.

pub mod cluster;
pub mod otlp;
pub mod sale;

pub use cluster::{redis_cluster, SharedCluster};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use flashsale_engine::app::serve::{self, Pinning, ServeConfig, ServeHandle};
use flashsale_engine::app::stack::balancer::Balancer;
use flashsale_engine::app::stack::nats_cluster::NatsCluster;
use flashsale_engine::app::stack::pg_standbys::PgStandbys;
use flashsale_engine::app::stack::{self, Kind, Server};
use flashsale_engine::logic::auth::PassKeys;
use flashsale_engine::logic::ids::{ActivityId, UserId};

/// A server private to one test; stopped when dropped.
pub struct Private {
    server: Server,
    // Holds the data directory; deleted after the server stops (field order: server first).
    _dir: tempfile::TempDir,
}

pub type PrivateRedis = Private;
pub type PrivateNats = Private;

impl Private {
    fn start(kind: Kind) -> Private {
        let dir = tempfile::Builder::new()
            .prefix(&format!("flashsale-test-{}-", kind.name()))
            .tempdir()
            .expect("create temp dir for a private server");
        if kind == Kind::Postgres {
            // Run as root, PostgreSQL runs as `postgres`, which must traverse to its data.
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
                .expect("open the private cluster's directory to the postgres user");
        }
        let server = Server::start(kind, dir.path(), None)
            .unwrap_or_else(|e| panic!("start private {}: {e}", kind.name()));
        Private { server, _dir: dir }
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    pub fn port(&self) -> u16 {
        self.server.port
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    /// The server's own directory (data, logs, pid and port files; a nats-server's store is
    /// `store/` in it).
    pub fn dir(&self) -> &std::path::Path {
        &self.server.dir
    }

    /// A graceful stop (SIGTERM; PostgreSQL's fast shutdown): the server flushes its state;
    /// the port stays reserved for [`Private::restart`].
    pub fn stop(&mut self) {
        let name = self.server.kind.name();
        self.server.stop().unwrap_or_else(|e| panic!("stop private {name}: {e}"));
    }

    /// kill -9: no shutdown; the port stays reserved for [`Private::restart`]. Panics when
    /// the stack refused (the recorded pid is not this server) or the process outlived it.
    pub fn kill(&mut self) {
        let (name, pid) = (self.server.kind.name(), self.server.pid);
        self.server.kill().unwrap_or_else(|e| panic!("kill -9 of private {name} refused: {e}"));
        assert_gone(name, pid);
    }

    /// SIGSTOP: the server hangs (connections are accepted by the kernel, nothing answers),
    /// as a stalled host or a network partition without resets looks; [`Private::thaw`]
    /// resumes it. Returns once the server is stopped (`T` in `/proc/PID/stat`).
    pub fn freeze(&self) {
        self.signal("-STOP");
        self.wait_state("stopped", |state| state == 'T');
    }

    /// SIGCONT; returns once the server runs again.
    pub fn thaw(&self) {
        self.signal("-CONT");
        self.wait_state("running", |state| state != 'T');
    }

    /// Signals the server and its direct children (PostgreSQL's backends each lead a session
    /// of their own, so the process group would miss them), after checking that the recorded
    /// pid is still this server.
    fn signal(&self, signal: &str) {
        let name = self.server.kind.name();
        self.server.check().unwrap_or_else(|e| panic!("kill {signal} of private {name}: {e}"));
        let pid = self.server.pid.to_string();
        // pkill exits 1 when there is no child: not an error here.
        let _ = std::process::Command::new("pkill").args([signal, "-P", &pid]).status();
        let status =
            std::process::Command::new("kill").args([signal, &pid]).status().expect("run kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// Waits (5 s at most) until the server's `/proc/PID/stat` state satisfies `want`.
    fn wait_state(&self, what: &str, want: impl Fn(char) -> bool) {
        let (name, pid) = (self.server.kind.name(), self.server.pid);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let state = stack::process_state(pid);
            if state.is_some_and(&want) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "private {name} (pid {pid}) not {what} 5 s after the signal: state {state:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Starts the server again on the same port and data directory (after `kill`, or
    /// stops it first if it is still running).
    pub fn restart(&mut self) {
        self.server.stop().expect("stop before restart");
        let kind = self.server.kind;
        let dir = self.server.dir.clone();
        let port = self.server.port;
        // The old socket may linger briefly in the kernel; retry for a moment.
        let mut last = None;
        for _ in 0..50 {
            match Server::start(kind, &dir, Some(port)) {
                Ok(server) => {
                    self.server = server;
                    return;
                }
                Err(e) => last = Some(e),
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("restart {} on port {port}: {:?}", kind.name(), last);
    }
}

impl Drop for Private {
    fn drop(&mut self) {
        let _ = self.server.stop();
    }
}

/// Panics unless `pid` is gone (no process, or a zombie nobody has reaped yet).
pub fn assert_gone(name: &str, pid: u32) {
    let state = stack::process_state(pid);
    assert!(matches!(state, None | Some('Z')), "{name} (pid {pid}) still there: state {state:?}");
}

/// A fresh redis-server on a free loopback port.
pub fn redis() -> PrivateRedis {
    Private::start(Kind::Redis)
}

/// A fresh `nats-server -js` on a free loopback port.
pub fn nats() -> PrivateNats {
    Private::start(Kind::Nats)
}

/// A database of its own in the suite's PostgreSQL cluster.
#[derive(Debug, Clone)]
pub struct TestDb {
    pub url: String,
    pub name: String,
}

/// The suite's cluster lives under the system temp dir, keyed by this checkout's path so two
/// checkouts never share one (and the `postgres` user can traverse to it, unlike a checkout
/// under a private home directory).
fn suite_pg_dir() -> PathBuf {
    let checkout = env!("CARGO_MANIFEST_DIR");
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325; // FNV-1a: stable across runs, no dependency.
    for b in checkout.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    std::env::temp_dir().join(format!("flashsale-test-pg-{hash:016x}"))
}

static DB_COUNTER: AtomicU32 = AtomicU32::new(0);

/// Creates a fresh, empty database in the suite's private PostgreSQL cluster (started on
/// first use, reused afterwards by every test binary).
pub async fn pg_database() -> TestDb {
    let dir = suite_pg_dir();
    let server = tokio::task::spawn_blocking(move || stack::ensure(Kind::Postgres, &dir))
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("start the suite's PostgreSQL: {e}"));
    let admin_url = server.url();
    let (client, connection) = tokio_postgres::connect(&admin_url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {admin_url}: {e}"));
    let driver = tokio::spawn(connection);
    let name = format!(
        "t_{}_{}_{}",
        std::process::id(),
        DB_COUNTER.fetch_add(1, Ordering::Relaxed),
        rand::random::<u32>()
    );
    client.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create database");
    drop(client);
    let _ = driver.await;
    let url = format!("postgres://postgres@127.0.0.1:{}/{name}", server.port);
    TestDb { url, name }
}

/// [`pg_database`] with the schema migrated (blocking: for tests without a runtime of their
/// own running).
pub fn migrated_database() -> TestDb {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let db = runtime.block_on(pg_database());
    migrate_database(&db);
    db
}

/// Migrates `db` (blocking).
pub fn migrate_database(db: &TestDb) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let (mut client, conn) =
            tokio_postgres::connect(&db.url, tokio_postgres::NoTls).await.unwrap();
        let driver = tokio::spawn(conn);
        flashsale_pg_worker::migrate(&mut client).await.unwrap();
        drop(client);
        let _ = driver.await;
    });
}

/// Runs `f` on a fresh glommio executor (unpinned, small io memory so several executors fit
/// in the 8 MiB memlock limit) and returns its output.
pub fn glommio<T, F>(f: impl FnOnce() -> F + Send + 'static) -> T
where
    T: Send + 'static,
    F: std::future::Future<Output = T> + 'static,
{
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .name("test")
        .io_memory(512 << 10)
        .ring_depth(128)
        .spawn(f)
        .expect("spawn glommio executor")
        .join()
        .expect("glommio executor panicked")
}

/// A parsed HTTP/1.1 response (test client side).
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("response body is not JSON ({e}): {:?}", self.body))
    }
}

/// A minimal blocking HTTP/1.1 client over one keep-alive connection: enough to drive the
/// engine with exact bytes (limits, pipelining, smuggling attempts) from tests.
pub struct HttpClient {
    stream: std::net::TcpStream,
    buf: Vec<u8>,
}

impl HttpClient {
    pub fn connect(addr: SocketAddr) -> HttpClient {
        let stream = std::net::TcpStream::connect(addr).expect("connect to the engine");
        stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).expect("timeout");
        stream.set_nodelay(true).expect("nodelay");
        HttpClient { stream, buf: Vec::new() }
    }

    /// A connection, or None when the engine refuses it (stopped listening).
    pub fn try_connect(addr: SocketAddr) -> Option<HttpClient> {
        let stream = std::net::TcpStream::connect(addr).ok()?;
        stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).ok()?;
        stream.set_nodelay(true).ok()?;
        Some(HttpClient { stream, buf: Vec::new() })
    }

    /// [`HttpClient::request`] that answers None when the connection breaks (drills).
    pub fn try_request(
        &mut self,
        method: &str,
        path: &str,
        bearer: Option<&str>,
        body: Option<&str>,
    ) -> Option<HttpResponse> {
        use std::io::Write;
        let raw = request_bytes(method, path, bearer, body);
        self.stream.write_all(raw.as_bytes()).ok()?;
        self.read_response()
    }

    /// Writes raw bytes (one or several requests).
    pub fn send_raw(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.stream.write_all(bytes).expect("write request");
    }

    /// Reads one response; `None` when the server closed the connection first.
    pub fn read_response(&mut self) -> Option<HttpResponse> {
        use std::io::Read;
        loop {
            if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..end]).to_string();
                let mut lines = head.split("\r\n");
                let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
                let headers: Vec<(String, String)> = lines
                    .filter_map(|l| l.split_once(':'))
                    .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
                    .collect();
                let len: usize = headers
                    .iter()
                    .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                    .and_then(|(_, v)| v.parse().ok())
                    .unwrap_or(0);
                while self.buf.len() < end + 4 + len {
                    let mut chunk = [0u8; 4096];
                    let n = self.stream.read(&mut chunk).ok()?;
                    if n == 0 {
                        return None;
                    }
                    self.buf.extend_from_slice(&chunk[..n]);
                }
                let body = String::from_utf8_lossy(&self.buf[end + 4..end + 4 + len]).to_string();
                self.buf.drain(..end + 4 + len);
                return Some(HttpResponse { status, headers, body });
            }
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).ok()?;
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// True when the server has closed the connection (reads EOF).
    pub fn is_closed(&mut self) -> bool {
        use std::io::Read;
        let mut byte = [0u8; 1];
        matches!(self.stream.read(&mut byte), Ok(0) | Err(_))
    }

    /// One request with an optional bearer token and JSON body; reads its response.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        bearer: Option<&str>,
        body: Option<&str>,
    ) -> HttpResponse {
        self.send_raw(request_bytes(method, path, bearer, body).as_bytes());
        self.read_response().expect("a response before the connection closed")
    }
}

fn request_bytes(method: &str, path: &str, bearer: Option<&str>, body: Option<&str>) -> String {
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: test\r\n");
    if let Some(token) = bearer {
        raw.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    if let Some(body) = body {
        raw.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ));
    } else {
        raw.push_str("\r\n");
    }
    raw
}

// ---- the engine in-process ---------------------------------------------------------------

/// The pass key list every in-process engine of the suite uses.
pub const KEYS: &str = "k1:0123456789abcdef0123456789abcdef";

/// The engine in-process (2 unpinned shards, ports 0) against its own private Redis and NATS
/// and its own database, as `flashsale serve` runs it. Stopped on drop.
pub struct Engine {
    handle: Option<ServeHandle>,
    pub redis: PrivateRedis,
    pub nats: PrivateNats,
    pub db: TestDb,
    pub keys: PassKeys,
}

impl Engine {
    pub fn start() -> Engine {
        Engine::start_with(|_| {})
    }

    pub fn start_with(tune: impl FnOnce(&mut ServeConfig)) -> Engine {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let db = runtime.block_on(crate::pg_database());
        Engine::start_on(db, tune)
    }

    /// An engine over the database `db` (migrated here), with its own Redis and NATS.
    pub fn start_on(db: TestDb, tune: impl FnOnce(&mut ServeConfig)) -> Engine {
        let redis = crate::redis();
        let nats = crate::nats();
        migrate_database(&db);
        let mut config = serve_config(redis.addr(), &nats.url(), &db.url);
        tune(&mut config);
        let handle = serve::start(config).expect("engine starts");
        let keys = PassKeys::parse(KEYS).unwrap();
        Engine { handle: Some(handle), redis, nats, db, keys }
    }

    pub fn http(&self) -> SocketAddr {
        self.handle.as_ref().unwrap().http_addr
    }

    pub fn admin(&self) -> SocketAddr {
        self.handle.as_ref().unwrap().admin_addr
    }

    pub fn pass(&self, user: u64, activity: u64) -> String {
        let exp =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
                + 3600;
        self.keys.mint("k1", UserId(user), ActivityId(activity), exp).unwrap()
    }

    pub fn create_activity(&self, activity: u64, sku: u64, stock: u64) {
        self.create_activity_with(&format!(
            r#"{{"activity_id":{activity},"sku_id":{sku},"stock":{stock}}}"#
        ));
    }

    /// `POST /admin/v1/activities` with this body (optional fields set); asserts 201.
    pub fn create_activity_with(&self, body: &str) {
        crate::sale::create_activity_with(self.admin(), body);
    }

    pub fn submit(
        &self,
        client: &mut HttpClient,
        user: u64,
        activity: u64,
        sku: u64,
        request_id: &str,
    ) -> (u16, serde_json::Value) {
        self.submit_units(client, (user, request_id), (activity, sku), 1)
    }

    /// [`Engine::submit`] for `quantity` units.
    pub fn submit_units(
        &self,
        client: &mut HttpClient,
        (user, request_id): (u64, &str),
        (activity, sku): (u64, u64),
        quantity: u32,
    ) -> (u16, serde_json::Value) {
        let pass = self.pass(user, activity);
        let body = format!(
            r#"{{"activity_id":{activity},"sku_id":{sku},"request_id":"{request_id}","quantity":{quantity}}}"#
        );
        let resp = client.request("POST", "/v1/reservations", Some(&pass), Some(&body));
        (resp.status, resp.json())
    }

    pub fn query(
        &self,
        client: &mut HttpClient,
        user: u64,
        activity: u64,
        sku: u64,
        request_id: &str,
    ) -> (u16, serde_json::Value) {
        let pass = self.pass(user, activity);
        let path = format!("/v1/reservations/{request_id}?activity_id={activity}&sku_id={sku}");
        let resp = client.request("GET", &path, Some(&pass), None);
        (resp.status, resp.json())
    }

    pub fn metrics(&self) -> String {
        HttpClient::connect(self.admin()).request("GET", "/metrics", None, None).body
    }

    /// What `flashsale serve` does on SIGTERM: drain (readiness false, listeners stop
    /// accepting), wait `grace`, shut down (shards finish in-flight requests, the worker
    /// commits then acks, connections close). The stores stay up.
    pub fn terminate(&mut self, grace: std::time::Duration) {
        if let Some(handle) = self.handle.take() {
            handle.drain();
            std::thread::sleep(grace);
            handle.shutdown();
        }
    }

    /// Serves again on the same stores (after [`Engine::terminate`], or a crash drill).
    pub fn restart_with(&mut self, tune: impl FnOnce(&mut ServeConfig)) {
        self.terminate(std::time::Duration::ZERO);
        let mut config = serve_config(self.redis.addr(), &self.nats.url(), &self.db.url);
        tune(&mut config);
        self.handle = Some(serve::start(config).expect("engine restarts"));
    }

    /// Another engine instance over this engine's Redis, NATS and database (DESIGN.md
    /// section 11: several `flashsale serve` behind an L4 balancer), on ports of its own.
    pub fn start_peer(&self, tune: impl FnOnce(&mut ServeConfig)) -> Peer {
        let mut config = serve_config(self.redis.addr(), &self.nats.url(), &self.db.url);
        tune(&mut config);
        Peer { handle: Some(serve::start(config).expect("peer engine starts")) }
    }

    /// `flashsale admin <args>` against this engine, through `admin_cli::run` (what `main`
    /// calls): (exit status or the error, what it printed as JSON, or as text).
    pub fn admin_cli(&self, args: &[&str]) -> (Result<u8, String>, serde_json::Value) {
        let addr = self.admin().to_string();
        let mut argv = vec!["admin", "--admin-addr", &addr, "--stack-dir", "/nonexistent"];
        argv.extend_from_slice(args);
        let parsed = flashsale_engine::app::admin_cli::parse_from(argv).unwrap();
        let mut out = Vec::new();
        let status = flashsale_engine::app::admin_cli::run(parsed, &Default::default(), &mut out)
            .map_err(|e| e.to_string());
        let out = String::from_utf8(out).unwrap();
        let json = serde_json::from_str(&out).unwrap_or(serde_json::Value::String(out));
        (status, json)
    }

    /// Messages in the log's stream `stream` (e.g. `SECKILL_ORDERS`).
    pub fn stream_messages(&self, stream: &str) -> u64 {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let client = async_nats::connect(self.nats.url()).await.unwrap();
            let js = async_nats::jetstream::new(client);
            let mut s = js.get_stream(stream).await.unwrap();
            s.info().await.unwrap().state.messages
        })
    }

    /// The SKU's Redis `stock` (panics when it is missing or not a number).
    pub fn redis_stock(&self, activity: u64, sku: u64) -> i64 {
        let key = format!("seckill:{{{activity}:{sku}}}:stock");
        let text = redis_cmd(&self.redis, &["GET", &key]);
        text.parse().unwrap_or_else(|_| panic!("{key} is {text:?}"))
    }

    /// The one integer (`count(*)`, ...) that `sql` selects from this engine's database.
    pub fn pg_count(&self, sql: &str) -> i64 {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let (client, conn) =
                tokio_postgres::connect(&self.db.url, tokio_postgres::NoTls).await.unwrap();
            let driver = tokio::spawn(conn);
            let n: i64 =
                client.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}")).get(0);
            drop(client);
            let _ = driver.await;
            n
        })
    }

    /// Checks DESIGN.md section 8's PostgreSQL invariants of one SKU; panics with the report.
    pub fn assert_invariants(&self, activity: u64, sku: u64) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let (client, conn) =
                tokio_postgres::connect(&self.db.url, tokio_postgres::NoTls).await.unwrap();
            let driver = tokio::spawn(conn);
            let report =
                flashsale_pg_worker::audit::check_invariants(&client, activity as i64, sku as i64)
                    .await
                    .unwrap();
            assert!(report.ok(), "invariants violated: {report:#?}");
            drop(client);
            let _ = driver.await;
        });
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            handle.shutdown();
        }
    }
}

/// A second engine instance on another [`Engine`]'s stores ([`Engine::start_peer`]); stopped
/// on drop or by [`Peer::terminate`].
pub struct Peer {
    handle: Option<ServeHandle>,
}

impl Peer {
    pub fn http(&self) -> SocketAddr {
        self.handle.as_ref().expect("peer running").http_addr
    }

    pub fn admin(&self) -> SocketAddr {
        self.handle.as_ref().expect("peer running").admin_addr
    }

    pub fn metrics(&self) -> String {
        HttpClient::connect(self.admin()).request("GET", "/metrics", None, None).body
    }

    /// Drain, then shut down (the stores stay up).
    pub fn terminate(&mut self) {
        if let Some(handle) = self.handle.take() {
            handle.drain();
            handle.shutdown();
        }
    }
}

/// The test engine's configuration over the given stores: two unpinned shards on port 0, the
/// test pass keys, no admin token, the edge alone (`worker: None`: outcomes are injected as
/// events where a test needs them; `small_worker` adds one).
pub fn serve_config(redis: SocketAddr, nats_url: &str, pg_url: &str) -> ServeConfig {
    let mut edge = serve::default_edge_config(redis);
    // Without a worker nothing drains the log, so its backlog only ages: lift the backlog
    // budgets (the degradation drills that exercise them set `Budgets::default()` back).
    edge.admission.oldest_pending_age_max_ms = u64::MAX / 4;
    edge.admission.pending_count_max = u64::MAX / 4;
    // The same for the adaptive limit's backlog signal; and the limit itself pinned, so that a
    // debug build's bursts on a busy box are not shed (tests/tests/overload.rs sets it).
    edge.overload = flashsale_engine::logic::overload::OverloadConfig {
        backlog_age_soft_ms: u64::MAX / 4,
        ..edge.overload
    }
    .pinned();
    ServeConfig {
        shards: 2,
        pins: Vec::new(),
        pinning: Pinning::Unpinned,
        http_addr: "127.0.0.1:0".parse().unwrap(),
        admin_addr: "127.0.0.1:0".parse().unwrap(),
        pass_keys: PassKeys::parse(KEYS).unwrap(),
        admin_token: None,
        edge,
        durable: serve::default_durable_config(pg_url, nats_url),
        io_memory_bytes: 256 << 10,
        render_extra: None,
        tracing: Default::default(),
        worker: None,
    }
}

/// A private PostgreSQL cluster of its own (initdb: seconds), for drills that stop it; the
/// suite's shared cluster must never be stopped. Connect as `postgres` to database `postgres`.
pub fn postgres() -> Private {
    Private::start(Kind::Postgres)
}

/// A small order worker for an in-process engine (its pool and runtime sized for tests).
pub fn small_worker(config: &ServeConfig) -> flashsale_pg_worker::worker::WorkerConfig {
    let mut worker = serve::default_worker_config(&config.durable.pg_url, &config.durable.log.url);
    worker.pg.pool_size = 8;
    worker.runtime_threads = 1;
    worker.order_writers = 2;
    worker.fetch_wait_ms = 50;
    // A test box is saturated by the tests themselves: a worker at the lowest priority would
    // be starved past the deadlines the tests check (the demo measures the niceness).
    worker.nice = 0;
    worker
}

/// The `state` field of an answer (`""` when absent).
pub fn state(v: &serde_json::Value) -> &str {
    v["state"].as_str().unwrap_or("")
}

/// The value of the first line of a Prometheus exposition that starts with `prefix`; panics
/// when there is none.
pub fn metric_f64(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {prefix} missing"))
}

/// [`metric_f64`] of a counter or an integer gauge.
pub fn metric(text: &str, prefix: &str) -> u64 {
    metric_f64(text, prefix) as u64
}

/// Polls `f` every 50 ms until it holds; panics naming `what` after `timeout_ms`.
pub fn wait_for_ms(what: &str, timeout_ms: u64, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms);
    while std::time::Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("timed out after {timeout_ms} ms waiting for {what}");
}

/// A synchronous Redis command through redis-cli (test-only inspection of a private Redis).
pub fn redis_cmd(redis: &PrivateRedis, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port().to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

// ---- multi-node topologies ---------------------------------------------------------------

fn open_tempdir(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().expect("create temp dir");
    // PostgreSQL runs as `postgres` when we are root and must traverse to its data.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("open the temp dir to the postgres user");
    dir
}

/// A 3-node JetStream cluster of its own (`stack::nats_cluster`); stopped when dropped.
pub struct PrivateNatsCluster {
    pub cluster: NatsCluster,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for PrivateNatsCluster {
    type Target = NatsCluster;
    fn deref(&self) -> &NatsCluster {
        &self.cluster
    }
}

impl std::ops::DerefMut for PrivateNatsCluster {
    fn deref_mut(&mut self) -> &mut NatsCluster {
        &mut self.cluster
    }
}

impl Drop for PrivateNatsCluster {
    fn drop(&mut self) {
        self.cluster.stop();
    }
}

pub fn nats_cluster() -> PrivateNatsCluster {
    let dir = open_tempdir("flashsale-test-nats-cluster-");
    let cluster = NatsCluster::up(dir.path()).unwrap_or_else(|e| panic!("NATS cluster: {e}"));
    PrivateNatsCluster { cluster, _dir: dir }
}

/// A PostgreSQL primary with two streaming standbys of its own (`stack::pg_standbys`);
/// every node stopped (thawed first) when dropped.
pub struct PrivatePgStandbys {
    pub set: PgStandbys,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for PrivatePgStandbys {
    type Target = PgStandbys;
    fn deref(&self) -> &PgStandbys {
        &self.set
    }
}

impl std::ops::DerefMut for PrivatePgStandbys {
    fn deref_mut(&mut self) -> &mut PgStandbys {
        &mut self.set
    }
}

impl Drop for PrivatePgStandbys {
    fn drop(&mut self) {
        self.set.stop_all();
    }
}

pub fn pg_standbys() -> PrivatePgStandbys {
    let dir = open_tempdir("flashsale-test-pg-ha-");
    let set = PgStandbys::up(dir.path()).unwrap_or_else(|e| panic!("PostgreSQL standbys: {e}"));
    PrivatePgStandbys { set, _dir: dir }
}

/// The renderer of this test process's `metrics` registry (installed once), for an
/// in-process engine's `render_extra`, as `flashsale serve` installs it.
pub fn prometheus_render() -> Box<dyn Fn() -> String + Send + Sync> {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    let handle = HANDLE
        .get_or_init(|| {
            metrics_exporter_prometheus::PrometheusBuilder::new()
                .install_recorder()
                .expect("install the Prometheus recorder")
        })
        .clone();
    Box::new(move || handle.render())
}

// ---- HAProxy in front of an engine ----------------------------------------------------------

/// A private HAProxy in TCP mode on a free loopback port, relaying to `backend` with the
/// given `server` line options (e.g. `send-proxy-v2`); its generated configuration and log
/// live in a temporary directory. Stopped on drop.
/// HAProxy in TCP mode in front of the engine (`stack::balancer`), configured in a temporary
/// directory of its own; stopped on drop.
pub struct Haproxy {
    balancer: Balancer,
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Haproxy {
    /// One backend with HAProxy `server` options (e.g. `send-proxy-v2`).
    pub fn start(backend: SocketAddr, server_options: &str) -> Haproxy {
        let dir = open_tempdir("flashsale-test-haproxy-");
        let balancer = Balancer::single(dir.path(), backend, server_options)
            .unwrap_or_else(|e| panic!("haproxy: {e}"));
        Haproxy { addr: balancer.addr, balancer, _dir: dir }
    }

    /// Connections balanced round robin over `backends` (several engine instances behind one
    /// L4 balancer, DESIGN.md section 11), with health checks.
    pub fn round_robin(backends: &[SocketAddr]) -> Haproxy {
        let dir = open_tempdir("flashsale-test-haproxy-");
        let balancer =
            Balancer::round_robin(dir.path(), backends).unwrap_or_else(|e| panic!("haproxy: {e}"));
        Haproxy { addr: balancer.addr, balancer, _dir: dir }
    }

    /// What HAProxy wrote to stdout and stderr.
    pub fn log(&self) -> String {
        self.balancer.log()
    }
}

/// A TCP connection to `to` from the local address `from` (e.g. another 127.0.0.0/8 address,
/// so that a proxy in between reports a client address of the test's choosing).
pub fn connect_from(from: std::net::IpAddr, to: SocketAddr) -> HttpClient {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(to),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )
    .unwrap();
    socket.bind(&SocketAddr::new(from, 0).into()).expect("bind the client address");
    socket.connect(&to.into()).expect("connect");
    let stream: std::net::TcpStream = socket.into();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    stream.set_nodelay(true).unwrap();
    HttpClient { stream, buf: Vec::new() }
}

// ---- end-of-drill invariant checks ---------------------------------------------------------

impl Engine {
    /// The end of every drill that sells (DESIGN.md section 8 across the stores): the reconcile
    /// report of the SKU (Redis cross-checked against PostgreSQL: conservation, one per buyer,
    /// nothing lost; reservations still in flight counted as such) is ok, and PostgreSQL's own
    /// invariants ([`Engine::assert_invariants`]) hold. Panics with the report.
    pub fn assert_reconciled(&self, activity: u64, sku: u64) {
        let path = format!("/admin/v1/activities/{activity}/skus/{sku}/reconcile");
        let resp = HttpClient::connect(self.admin()).request("GET", &path, None, None);
        let report = resp.json();
        assert_eq!(resp.status, 200, "reconcile {activity}/{sku}: {report:#}");
        assert_eq!(report["ok"], true, "reconcile {activity}/{sku} not ok: {report:#}");
        self.assert_invariants(activity, sku);
    }
}

impl Engine {
    /// Publishes one outbox event the way the outbox publisher does (for `redis-sync` tests).
    pub fn publish_event(&self, event_id: i64, event: &flashsale_io::wire::ReservationEvent) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let config = flashsale_io::jetstream::LogConfig {
                url: self.nats.url(),
                ..flashsale_io::jetstream::LogConfig::default()
            };
            let log = flashsale_io::jetstream::Log::connect(&config).await.unwrap();
            log.publisher()
                .publish_event(event_id, event.event_type, bytes::Bytes::from(event.encode()), None)
                .await
                .unwrap();
        });
    }

    /// The reservation as Redis recorded it, as an order-create message would carry it.
    pub fn order_create_of(
        &self,
        activity: u64,
        sku: u64,
        resv: &str,
        user: u64,
        request_id: &str,
    ) -> flashsale_io::wire::OrderCreate {
        let key = format!("seckill:{{{activity}:{sku}}}:resv:{resv}");
        let field = |f: &str| redis_cmd(&self.redis, &["HGET", &key, f]);
        flashsale_io::wire::OrderCreate {
            schema_version: 1,
            event_type: flashsale_io::wire::ORDER_CREATE_EVENT_TYPE.to_string(),
            message_id: field("message_id"),
            message_key: resv.to_string(),
            request_id: request_id.to_string(),
            reservation_id: resv.to_string(),
            activity_id: activity,
            sku_id: sku,
            user_id: user,
            quantity: field("quantity").parse().unwrap_or(1),
            reserved_at_ms: field("reserved_at").parse().unwrap(),
            reservation_expires_at_ms: field("expires_at").parse().unwrap(),
            retry_count: 0,
            payload_hash: field("payload_hash"),
            traceparent: None,
            created_at_ms: 0,
        }
    }
}

/// Kills the servers whose pid files lie anywhere under `root` and deletes it once this
/// process is gone (a test killed or panicking leaves no server behind).
pub fn watchdog(root: &std::path::Path) {
    use std::os::unix::process::CommandExt;
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; \
         for f in $(find {root} -name pid 2>/dev/null); do kill -9 $(cat $f) 2>/dev/null; done; \
         sleep 1; rm -rf {root}",
        pid = std::process::id(),
        root = root.display()
    );
    // Never waited for on purpose: it must outlive this process (it exits once we are gone).
    #[allow(clippy::zombie_processes)]
    let _watchdog = std::process::Command::new("sh")
        .args(["-c", &script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn the watchdog");
}
