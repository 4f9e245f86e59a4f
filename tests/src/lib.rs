//! Test support: private real servers for the integration tests in `tests/tests/`.
//!
//! Every server is started by the same code as `flashsale stack up` ([`flashsale_engine::stack`]):
//! - Redis and NATS: one fresh instance per call, on a free 127.0.0.1 port, data in its own
//!   temporary directory, stopped on drop. They start in milliseconds, so no test ever sees
//!   another test's keys or streams, and a drill may kill or flush its own instance.
//! - PostgreSQL: one private cluster per checkout (initdb takes seconds), shared by the test
//!   binaries through the stack's idempotent `ensure` under a lock; each call to
//!   [`pg_database`] creates a fresh database in it.
//!
//! Nothing here touches the machine's own servers on the standard ports.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use flashsale_engine::stack::{self, Kind, Server};

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

    /// kill -9: no shutdown; the port stays reserved for [`Private::restart`].
    pub fn kill(&mut self) {
        self.server.kill();
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
