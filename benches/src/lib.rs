//! Helpers shared by the benches: a private `redis-server` on a free loopback port, and the
//! glommio executor (with a Redis client) the Redis benches run on.
//!
//! `flashsale-tests` (the integration-test support) is deliberately not a dependency of the
//! benches, so this is a minimal launcher of its own: one process, no persistence, killed
//! (and reaped) on drop. It never touches the machine's shared server on 6379.
//!
//! The open-loop load generator lives in [`loadgen`] (binary `flashsale-loadgen`); private
//! PostgreSQL databases for the order-path benches in [`pg`]; the submit path's steps, shared by
//! the sold-out and owner path benches, in [`submit_path`]; the bench thread's CPU clock in
//! [`cpu_clock`].
//!
//! Not here: the benches themselves (`benches/benches/`).

pub mod cpu_clock;
pub mod loadgen;
pub mod pg;
pub mod submit_path;

use std::future::Future;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flashsale_io::redis::layout::ActivityStatus;
use flashsale_io::redis::script::{Functions, PreheatArgs, ReserveArgs, ReserveReply, SkuKeys};
use flashsale_io::redis::{RedisClient, RedisConfig};

/// The Redis benches' clock: their SKUs open at T0 for an hour.
pub const T0: u64 = 1_750_000_000_000;

/// An ACTIVE SKU of `stock` units, one per buyer, open from [`T0`] for an hour.
pub fn preheat_args(stock: u64) -> PreheatArgs {
    PreheatArgs {
        status: ActivityStatus::Active,
        start_ms: T0,
        end_ms: T0 + 3_600_000,
        version: 1,
        reservation_ttl_ms: 300_000,
        stock,
        max_per_buyer: 1,
    }
}

/// Buyer `n` reserves one unit (request `req_n`, reservation `resv_n`, message `msg_n`) with
/// the engine's `reserve`; panics unless it is created.
pub async fn reserve_one(functions: &Functions, keys: &SkuKeys, n: u64) {
    let (request_id, reservation_id, message_id) =
        (format!("req_{n}"), format!("resv_{n}"), format!("msg_{n}"));
    let args = ReserveArgs {
        request_id: &request_id,
        user_id: n,
        payload_hash: "h",
        reservation_id: &reservation_id,
        message_id: &message_id,
        now_ms: T0 + 10,
        pending_grace_ms: 3_000,
        quantity: 1,
    };
    let reply = functions.reserve(keys, &args).await.expect("reserve");
    assert!(matches!(reply, ReserveReply::Created { .. }), "{reply:?}");
}

/// Runs `f` on a fresh unpinned glommio executor (the benches share the cores with the
/// servers) and returns what it returns.
pub fn on_glommio<T, Fut>(f: impl FnOnce() -> Fut + Send + 'static) -> T
where
    T: Send + 'static,
    Fut: Future<Output = T> + 'static,
{
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .name("bench")
        // Small io memory: the default does not fit the 8 MiB memlock limit here.
        .io_memory(512 << 10)
        .ring_depth(128)
        .spawn(f)
        .expect("spawn glommio executor")
        .join()
        .expect("glommio executor")
}

/// [`on_glommio`] with a client of the redis-server at `addr` (128 commands in flight, each
/// bounded by `command_timeout`).
pub fn with_client<T, Fut>(
    addr: SocketAddr,
    command_timeout: Duration,
    f: impl FnOnce(RedisClient) -> Fut + Send + 'static,
) -> T
where
    T: Send + 'static,
    Fut: Future<Output = T> + 'static,
{
    on_glommio(move || async move {
        let mut config = RedisConfig::new(addr);
        config.in_flight_max = 128;
        config.command_timeout = command_timeout;
        let client = RedisClient::connect(config).await.expect("connect to bench redis");
        f(client).await
    })
}

/// A redis-server started for one bench run; killed when dropped.
pub struct BenchRedis {
    child: Child,
    addr: SocketAddr,
}

impl BenchRedis {
    /// Starts `redis-server --port <free> --save '' --appendonly no` on 127.0.0.1 and waits
    /// (at most 5 s) until it accepts connections.
    ///
    /// # Panics
    /// If redis-server is missing or does not come up: a bench cannot run without it.
    pub fn start() -> BenchRedis {
        let port = free_port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let dir = std::env::temp_dir();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "yes"])
            .arg("--dir")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn redis-server: {e}"));
        let mut redis = BenchRedis { child, addr };
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(addr).is_err() {
            if Instant::now() > deadline {
                redis.stop();
                panic!("redis-server on {addr} did not accept connections within 5 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        redis
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's process id (its CPU is read from /proc by the benches that price a call).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for BenchRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port that was free a moment ago (the usual bind-to-0 trick; the short race is fine for
/// a bench on a quiet machine).
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local_addr").port()
}
