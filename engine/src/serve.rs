//! `flashsale serve`: starts the durable side (tokio threads) and one glommio executor per
//! shard, and returns a handle that knows the bound addresses and stops everything. Tests run
//! the engine in-process through [`start`] on port 0.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use flashsale_io::log::LogConfig;
use flashsale_io::redis::RedisConfig;
use glommio::channels::channel_mesh::MeshBuilder;
use glommio::{ExecutorJoinHandle, LocalExecutorBuilder, Placement};

use crate::auth::PassKeys;
use crate::durable::{Durable, DurableConfig};
use crate::metrics::EdgeMetrics;
use crate::router::PartitionTable;
use crate::shard::{self, EdgeConfig, EdgeShared, ShardStart};

/// Whether shards are pinned one per core (production) or float (shared machines, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pinning {
    PinPerCore,
    Unpinned,
}

/// Everything `serve` needs, validated by `main`.
pub struct ServeConfig {
    pub shards: usize,
    /// Hot SKUs pinned to shards; the rest round-robin by partition.
    pub pins: Vec<(crate::router::SkuKey, usize)>,
    pub pinning: Pinning,
    pub http_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub pass_keys: PassKeys,
    pub admin_token: Option<String>,
    pub edge: EdgeConfig,
    pub durable: DurableConfig,
    /// Memory glommio registers per executor for I/O (counts against `ulimit -l`).
    pub io_memory_bytes: usize,
    pub render_extra: Option<Box<dyn Fn() -> String + Send + Sync>>,
    /// The order-writer and outbox publisher in this process (`None`: `--no-worker`, run
    /// `flashsale worker` separately).
    pub worker: Option<flashsale_pg_worker::worker::WorkerConfig>,
}

/// The worker's configuration for this engine's stores (its own pool and runtime: a bulkhead
/// apart from the edge's).
pub fn default_worker_config(
    pg_url: &str,
    nats_url: &str,
) -> flashsale_pg_worker::worker::WorkerConfig {
    let mut config = flashsale_pg_worker::worker::WorkerConfig::default();
    config.pg.url = pg_url.to_owned();
    config.log.url = nats_url.to_owned();
    config
}

/// Resolves `redis://host:port[/db]` to the address of its (single) node.
pub fn redis_addr(url: &str) -> anyhow::Result<SocketAddr> {
    let rest =
        url.strip_prefix("redis://").context("FLASHSALE_REDIS_URL must start with redis://")?;
    let first = rest.split(',').next().unwrap_or(rest);
    let host_port = first.split('/').next().unwrap_or(first);
    let host_port = host_port.rsplit('@').next().unwrap_or(host_port);
    host_port
        .to_socket_addrs()
        .with_context(|| format!("resolve Redis address {host_port}"))?
        .next()
        .with_context(|| format!("no address for {host_port}"))
}

/// The defaults of the edge, each with its reason (see `EdgeConfig`).
pub fn default_edge_config(redis: SocketAddr) -> EdgeConfig {
    EdgeConfig {
        http: crate::http::Limits::DEFAULT,
        connections_per_shard_max: 16_384,
        header_read_timeout_ms: 5_000,
        idle_timeout_ms: 60_000,
        redis: RedisConfig {
            // Every SKU's admission bound (partition.in_flight_max, 1,024) fits under it with
            // room for queries, mark_sent and the scanner, so a full SKU answers OVERLOADED
            // before the shared connection would answer Full (SYSTEM_BUSY). The queueing
            // delay this allows, 4,096 × ~20 µs ≈ 82 ms, stays well under the 250 ms deadline.
            in_flight_max: 4_096,
            ..RedisConfig::new(redis)
        },
        pending_grace_ms: 2_000,
        order_deadline_ms: 10_000,
        publish_wait_ms: 500,
        query_fallback_wait_ms: 500,
        mesh_capacity: 1_024,
        partition: crate::partition::PartitionLimits::for_stock(100_000),
        skus_tracked_max: 4_096,
        // ~115 MB per shard at ~570 bytes per entry: 20 hot SKUs of 10,000 units each keep
        // every replay local.
        accepted_per_shard_max: 200_000,
        reservation_ttl_ms_default: 5 * 60 * 1000,
        overloaded_retry_ms: 200,
        busy_retry_ms: 1_000,
        // A buyer retries a few times a second at most; 20 in a burst covers a pipelined
        // client's retries of one intent.
        user_rate: crate::limiter::Rate { per_s: 10, burst: 20 },
        ip_rate: crate::limiter::Rate { per_s: 2_000, burst: 4_000 },
        limiter_slots: 1 << 16,
        scanner: crate::scanner::ScannerConfig::default(),
        reconcile: crate::reconcile::ReconcileConfig::default(),
        publish_circuit: crate::circuit::CircuitConfig::default(),
        redis_circuit: crate::circuit::CircuitConfig::default(),
        // Set from FLASHSALE_PAYMENT_KEY by `main`; none: payment callbacks refused.
        payment_key: None,
        // Three attempts within 100 ms: a blip is absorbed, an outage is not waited out
        // (the circuit and the scanner handle those).
        idempotent_retry: crate::circuit::RetryPolicy {
            attempts_max: 3,
            base_delay_ms: 10,
            delay_max_ms: 50,
            budget_ms: 100,
        },
        admission: crate::admission::Budgets::default(),
        // Above every SKU's own bound (partition.in_flight_max) times a few hot SKUs, below
        // the Redis connection's bound: a shard full of slow submits answers OVERLOADED.
        submit_in_flight_max: 4_096,
        // The budgets assume a sample at most two polls old (admission.rs, SloBasis).
        health_poll_ms: crate::admission::SloBasis::MEASURED.lag_poll_ms,
        control: crate::control::ControlConfig::default(),
    }
}

pub fn default_durable_config(pg_url: &str, nats_url: &str) -> DurableConfig {
    DurableConfig {
        pg_url: pg_url.to_owned(),
        pg_pool_size: 8,
        log: LogConfig { url: nats_url.to_owned(), ..LogConfig::default() },
        queue_max: 8_192,
        in_flight_max: 4_096,
        pg_timeout_ms: 2_000,
        threads: 1,
    }
}

/// A running engine.
pub struct ServeHandle {
    pub http_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    shared: Arc<EdgeShared>,
    executors: Vec<ExecutorJoinHandle<()>>,
    durable: Option<Durable>,
    worker: Option<flashsale_pg_worker::worker::WorkerHandle>,
}

impl ServeHandle {
    /// Readiness false and public listeners stop accepting (first step of a graceful stop).
    pub fn drain(&self) {
        self.shared.draining.store(true, Ordering::Relaxed);
    }

    /// Stops shards (in-flight requests finish within their own deadlines) and the durable
    /// side, and waits for them.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.draining.store(true, Ordering::Relaxed);
        self.shared.stopping.store(true, Ordering::Relaxed);
        // Wake every blocked accept with a connection of our own (the kernel spreads them
        // over the shards' SO_REUSEPORT listeners) until every shard has returned.
        let joined = Arc::new(AtomicBool::new(false));
        let waker = {
            let joined = Arc::clone(&joined);
            let addrs = [loopback(self.http_addr), loopback(self.admin_addr)];
            std::thread::spawn(move || {
                while !joined.load(Ordering::Relaxed) {
                    for addr in addrs {
                        let _ =
                            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(50));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        };
        for executor in self.executors.drain(..) {
            let _ = executor.join();
        }
        joined.store(true, Ordering::Relaxed);
        let _ = waker.join();
        // Stop pulling, finish the batch in hand (commit, then ack), then close.
        if let Some(worker) = self.worker.take() {
            if let Err(e) = worker.shutdown() {
                tracing::warn!(error = %e, "worker shutdown");
            }
        }
        if let Some(durable) = self.durable.take() {
            durable.shutdown();
        }
    }
}

/// A bound wildcard address (0.0.0.0 / ::) is reached through loopback.
pub fn loopback(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        let ip = if addr.is_ipv4() {
            std::net::IpAddr::from([127, 0, 0, 1])
        } else {
            std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
        };
        SocketAddr::new(ip, addr.port())
    } else {
        addr
    }
}

impl Drop for ServeHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn start(config: ServeConfig) -> anyhow::Result<ServeHandle> {
    let shard_count = config.shards;
    anyhow::ensure!(
        config.edge.partition.in_flight_max as usize <= config.edge.redis.in_flight_max,
        "a SKU's in-flight bound ({}) must not exceed the Redis connection's ({})",
        config.edge.partition.in_flight_max,
        config.edge.redis.in_flight_max
    );
    config.edge.http.validate().map_err(|e| anyhow::anyhow!("http limits: {e}"))?;
    config.edge.redis.validate().map_err(|e| anyhow::anyhow!("redis config: {e}"))?;
    config.edge.reconcile.validate().map_err(|e| anyhow::anyhow!("reconcile config: {e}"))?;
    config.edge.publish_circuit.validate().map_err(|e| anyhow::anyhow!("publish circuit: {e}"))?;
    config.edge.redis_circuit.validate().map_err(|e| anyhow::anyhow!("redis circuit: {e}"))?;
    config.edge.idempotent_retry.validate().map_err(|e| anyhow::anyhow!("retry policy: {e}"))?;
    config.edge.admission.validate().map_err(|e| anyhow::anyhow!("admission budgets: {e}"))?;
    config.edge.control.modes.validate().map_err(|e| anyhow::anyhow!("mode config: {e}"))?;
    let table = PartitionTable::new(shard_count, &config.pins)?;
    let (sync_senders, sync_receivers): (Vec<_>, Vec<_>) =
        (0..shard_count).map(|_| tokio::sync::mpsc::channel(config.edge.mesh_capacity)).unzip();
    let targets = crate::sync::SyncTargets { table: table.clone(), shards: sync_senders };
    let modes = Arc::new(crate::control::ModeState::load(&config.edge.control));
    let health = Arc::new(crate::control::Health::default());
    // PostgreSQL answered the durable side's start-up check; the poller keeps this current.
    health.pg_ok_at_ms.store(shard::now_ms(), Ordering::Relaxed);
    let control = crate::durable::Control {
        modes: Arc::clone(&modes),
        health: Arc::clone(&health),
        health_poll_ms: config.edge.health_poll_ms,
    };
    let (durable, durable_handle) = Durable::start(config.durable.clone(), Some(targets), control)?;
    let worker = match config.worker.clone() {
        Some(worker_config) => Some(
            flashsale_pg_worker::worker::start(worker_config)
                .map_err(|e| anyhow::anyhow!("start the order worker: {e}"))?,
        ),
        None => None,
    };
    let shared = Arc::new(EdgeShared {
        config: config.edge.clone(),
        table,
        pass_keys: config.pass_keys,
        admin_token: config.admin_token,
        metrics: EdgeMetrics::new(shard_count),
        durable: durable_handle,
        draining: AtomicBool::new(false),
        stopping: AtomicBool::new(false),
        heartbeats: (0..shard_count).map(|_| AtomicU64::new(shard::now_ms())).collect(),
        started: (0..shard_count).map(|_| AtomicBool::new(false)).collect(),
        ports: std::sync::OnceLock::new(),
        modes,
        health: Arc::clone(&health),
        render_extra: config.render_extra,
    });
    let mesh = MeshBuilder::full(shard_count, config.edge.mesh_capacity);
    let mut executors = Vec::with_capacity(shard_count);
    // Pinned shards take the CPUs the process may run on, in order (CPUAffinity= respected).
    let cpus = crate::startup::shard_cpus(shard_count, crate::startup::allowed_cpus().as_deref());
    for (id, sync_rx) in sync_receivers.into_iter().enumerate() {
        let placement = match config.pinning {
            Pinning::PinPerCore => Placement::Fixed(cpus[id]),
            Pinning::Unpinned => Placement::Unbound,
        };
        let start = ShardStart {
            id,
            shared: Arc::clone(&shared),
            mesh: mesh.clone(),
            http_addr: config.http_addr,
            admin_addr: config.admin_addr,
            id_seed: rand::random(),
            sync_rx: Some(sync_rx),
        };
        let handle = LocalExecutorBuilder::new(placement)
            .name(&format!("shard-{id}"))
            .io_memory(config.io_memory_bytes)
            .ring_depth(256)
            .spawn(move || shard::run(start))
            .map_err(|e| anyhow::anyhow!("start shard {id} (pinning {:?}): {e}", config.pinning))?;
        executors.push(handle);
    }
    let mut handle = ServeHandle {
        http_addr: config.http_addr,
        admin_addr: config.admin_addr,
        shared: Arc::clone(&shared),
        executors,
        durable: Some(durable),
        worker,
    };
    // Wait until every shard listens (or one failed).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if shared.stopping.load(Ordering::Relaxed) {
            handle.stop();
            anyhow::bail!("a shard failed to start (see the log)");
        }
        // Started: every shard listens and the backlog has been read once (until then
        // admission cannot tell an empty backlog from an unknown one and closes submissions).
        if shared.started.iter().all(|s| s.load(Ordering::Relaxed))
            && health.lag.polled_at_ms() != 0
        {
            break;
        }
        if Instant::now() > deadline {
            handle.stop();
            anyhow::bail!(
                "shards did not start, or the first backlog poll did not answer, within 10 s"
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if let Some((http_port, admin_port)) = shared.ports.get() {
        handle.http_addr.set_port(*http_port);
        handle.admin_addr.set_port(*admin_port);
    }
    Ok(handle)
}
