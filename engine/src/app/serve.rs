//! `flashsale serve`: starts the durable side (tokio threads) and one glommio executor per
//! shard, and returns a handle that knows the bound addresses and stops everything. Tests run
//! the engine in-process through [`start`] on port 0.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use flashsale_io::jetstream::LogConfig;
use flashsale_io::redis::RedisConfig;
use glommio::channels::channel_mesh::MeshBuilder;
use glommio::{ExecutorJoinHandle, LocalExecutorBuilder, Placement};

use crate::durable::{Durable, DurableConfig};
use crate::logic::auth::PassKeys;
use crate::logic::metrics::EdgeMetrics;
use crate::logic::placement::PartitionTable;
use crate::shard::{self, EdgeConfig, EdgeShared, ShardStart};

/// Each shard's ends of the durable side's queues: `redis-sync`'s events and the
/// stock-returned notices.
type ShardReceivers = Vec<(
    tokio::sync::mpsc::Receiver<crate::durable::sync::SyncRequest>,
    tokio::sync::mpsc::Receiver<crate::logic::placement::SkuKey>,
)>;

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
    pub pins: Vec<(crate::logic::placement::SkuKey, usize)>,
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
    /// Trace export (`[tracing]`; off without an endpoint): one sink for the shards and the
    /// in-process worker, exported by the durable side.
    pub tracing: flashsale_io::trace::TraceConfig,
    /// The order-writer and outbox publisher in this process (`None`: `--no-worker`, run
    /// `flashsale worker` separately).
    pub worker: Option<flashsale_pg_worker::worker::WorkerConfig>,
}

impl ServeConfig {
    /// What this configuration needs from a host whose process may run on `allowed` CPUs:
    /// shard `i` is pinned to `startup::shard_cpus`'s `i`th CPU when pinned (see [`start`]).
    pub fn host_needs(&self, allowed: Option<&[usize]>) -> crate::app::startup::Needs {
        let pinned_cpus = match self.pinning {
            Pinning::PinPerCore => crate::app::startup::shard_cpus(self.shards, allowed),
            Pinning::Unpinned => Vec::new(),
        };
        crate::app::startup::Needs {
            shards: self.shards,
            pinned_cpus,
            io_memory_bytes: self.io_memory_bytes as u64,
            listen_backlog: crate::app::startup::GLOMMIO_LISTEN_BACKLOG,
            connections_per_shard_max: self.edge.connections_per_shard_max as u64,
            admin_connections_max: (self.edge.admin_connections_max
                + crate::shard::conn::ADMIN_PROBE_SLOTS) as u64,
        }
    }

    /// The start-up host check (`startup::warn_about_host`): logs what the host lacks and
    /// lowers the connection bounds to what the open-file limit holds.
    pub fn check_host(&mut self) -> Vec<crate::app::startup::Warning> {
        let this = &*self;
        let needs = |allowed: Option<&[usize]>| this.host_needs(allowed);
        let (mut per_shard, mut per_address) =
            (self.edge.connections_per_shard_max, self.edge.connections_per_address_max);
        let warnings =
            crate::app::startup::warn_about_host(needs, &mut per_shard, &mut per_address);
        self.edge.connections_per_shard_max = per_shard;
        self.edge.connections_per_address_max = per_address;
        warnings
    }
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

/// The durable side's configuration for a loaded [`crate::app::config::Config`]: its one
/// [`LogConfig`] (URL and replicas) by value, the rest as [`default_durable_config`].
pub fn durable_config(config: &crate::app::config::Config) -> DurableConfig {
    DurableConfig {
        log: config.log.clone(),
        ..default_durable_config(&config.pg_url, &config.nats_url)
    }
}

/// The worker's configuration for a loaded [`crate::app::config::Config`] (`serve` in-process
/// and `flashsale worker`): the same [`LogConfig`] as the durable side, so every stream and
/// the mode bucket get the same replicas whichever process creates them first.
pub fn worker_config(
    config: &crate::app::config::Config,
) -> flashsale_pg_worker::worker::WorkerConfig {
    let mut worker = default_worker_config(&config.pg_url, &config.nats_url);
    worker.log = config.log.clone();
    // `[worker]` / FLASHSALE_PG_CORES: writers sized for PostgreSQL's cores, the batch bounds.
    config.worker.apply(&mut worker);
    // `[payments] status_url`: the closer asks the provider before closing (the key was
    // checked with the URL by `Config::load`).
    let key =
        config.payment_key.as_deref().and_then(|k| flashsale_io::key::HmacKey::from_hex(k).ok());
    worker.closer.provider = key.and_then(|key| config.payments.provider(&key));
    // Without one, due orders are held PAYMENT_UNKNOWN unless the operator opted in.
    worker.closer.without_provider = config.payments.without_provider;
    // `flashsale worker` exports its own spans; in `serve`, `start` hands it the edge's sink.
    if config.tracing.endpoint.is_some() {
        let mut tracing = config.tracing.clone();
        tracing.service_instance_id = match &config.instance_id {
            Some(id) => id.to_string(),
            None => crate::logic::ids::InstanceId::from_random(rand::random()).to_string(),
        };
        worker.tracing = flashsale_pg_worker::worker::WorkerTracing::Export(tracing);
    }
    worker
}

/// The edge's configuration for this `Config`: the defaults, with Redis' seeds (standalone or
/// cluster) and the replica-fencing setting from the configuration.
pub fn edge_config(config: &crate::app::config::Config) -> anyhow::Result<EdgeConfig> {
    let url = flashsale_io::redis::url::RedisUrl::parse(&config.redis_url)?;
    let first = *url.seeds.first().context("FLASHSALE_REDIS_URL names no seed")?;
    let mut edge = default_edge_config(first);
    edge.redis_seeds = url.seeds;
    edge.min_replica_acks = config.redis_min_replica_acks;
    edge.redis_eviction = config.redis_eviction;
    if let Some(instance_id) = &config.instance_id {
        edge.instance_id = instance_id.clone();
    }
    // `[http]`: connection bounds, deadlines, the health path, trusted PROXY sources.
    config.http.apply(&mut edge);
    // `[admission]` and `[overload]` (validated when the file was read).
    edge.admission = config.admission;
    edge.overload = config.overload;
    // `[metrics]`: the SKUs with funnel series of their own.
    edge.sku_funnel = config.sku_funnel.clone();
    Ok(edge)
}

/// Resolves `redis://host:port[/db]` to the address of its first node (the load generator's
/// `--redis-url`, for its own reads).
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
        // A mobile carrier's NAT puts many buyers behind one address; a thousand connections
        // per shard is far above one client's needs and far below what exhausts a shard.
        // Behind a balancer without PROXY protocol every connection has the balancer's
        // address: set it to connections_per_shard_max there (README, Operations).
        connections_per_address_max: 1_024,
        admin_connections_max: 64,
        // An operator's CLI, a dashboard and a scraper need a few each; a silent flood from
        // one address then leaves the rest of the budget to everyone else.
        admin_connections_per_address_max: 16,
        header_read_timeout_ms: 5_000,
        // Bodies are at most 4 KiB: anything slower than this is not a buyer.
        body_read_timeout_ms: 5_000,
        // Answers are a few hundred bytes that the kernel's buffers absorb; a write blocked
        // this long means the peer stopped reading.
        write_timeout_ms: 10_000,
        idle_timeout_ms: 60_000,
        proxy_protocol_from: crate::http::proxy::TrustedSources::default(),
        health_path: None,
        redis: default_redis_config(redis),
        redis_seeds: vec![redis],
        min_replica_acks: flashsale_io::redis::fence::MinReplicaAcks::Auto,
        redis_eviction: crate::logic::redis_settings::EvictionCheck::Enforce,
        pending_grace_ms: 3_000,
        order_deadline_ms: 10_000,
        publish_wait_ms: 500,
        query_fallback_wait_ms: 500,
        mesh_capacity: 1_024,
        partition: crate::logic::partition::PartitionLimits::for_stock(100_000),
        skus_tracked_max: 4_096,
        // ~115 MB per shard at ~570 bytes per entry: 20 hot SKUs of 10,000 units each keep
        // every replay local.
        accepted_per_shard_max: 200_000,
        overloaded_retry_ms: 200,
        busy_retry_ms: 1_000,
        // A buyer retries a few times a second at most; 20 in a burst covers a pipelined
        // client's retries of one intent.
        user_rate: crate::logic::limiter::Rate { per_s: 10, burst: 20 },
        ip_rate: crate::logic::limiter::Rate { per_s: 2_000, burst: 4_000 },
        // A client polling its result a few times a second, with room for a burst of order
        // reads after the answer; each read can cost a PostgreSQL transaction.
        read_user_rate: crate::logic::limiter::Rate { per_s: 20, burst: 40 },
        limiter_slots: 1 << 16,
        scanner: crate::shard::scanner::ScannerConfig::default(),
        reconcile: crate::logic::reconcile::ReconcileConfig::default(),
        publish_circuit: crate::logic::circuit::CircuitConfig::default(),
        redis_circuit: crate::logic::circuit::CircuitConfig::default(),
        // Set from FLASHSALE_PAYMENT_KEY by `main`; none: payment callbacks refused.
        payment_key: None,
        idempotent_retry: IDEMPOTENT_RETRY,
        admission: crate::logic::admission::Budgets::default(),
        // Above every SKU's own bound (partition.in_flight_max) times a few hot SKUs, below
        // the Redis connection's bound: a shard full of slow submits answers OVERLOADED.
        submit_in_flight_max: 4_096,
        // Off by default (`[overload] enabled`): on a box the edge shares, the limit reads CPU
        // starvation as a slow path and prolongs the sale (README "Admission").
        overload: crate::logic::overload::OverloadConfig::default().pinned(),
        // The budgets assume a sample at most two polls old (admission.rs, SloBasis).
        health_poll_ms: crate::logic::admission::SloBasis::MEASURED.lag_poll_ms,
        control: crate::durable::modes::ControlConfig::default(),
        // `[metrics]` (and the pinned SKUs) replace it (`main`).
        sku_funnel: crate::logic::sku_funnel::SkuFunnelConfig::default(),
        // `[engine] instance_id` / FLASHSALE_INSTANCE_ID replaces it (`main`).
        instance_id: crate::logic::ids::InstanceId::from_random(rand::random()),
    }
}

/// A shard's Redis connection.
fn default_redis_config(redis: SocketAddr) -> RedisConfig {
    RedisConfig {
        // Every SKU's admission bound (partition.in_flight_max, 1,024) fits under it with
        // room for queries, mark_sent and the scanner, so a full SKU answers OVERLOADED
        // before the shared connection would answer Full (SYSTEM_BUSY). The queueing
        // delay this allows, 4,096 × ~20 µs ≈ 82 ms, stays well under the 250 ms deadline.
        in_flight_max: 4_096,
        ..RedisConfig::new(redis)
    }
}

/// Retries of an idempotent Redis call: three attempts within 100 ms, so a blip is absorbed
/// and an outage is not waited out (the circuit and the scanner handle those).
const IDEMPOTENT_RETRY: crate::logic::circuit::RetryPolicy = crate::logic::circuit::RetryPolicy {
    attempts_max: 3,
    base_delay_ms: 10,
    delay_max_ms: 50,
    budget_ms: 100,
};

pub fn default_durable_config(pg_url: &str, nats_url: &str) -> DurableConfig {
    DurableConfig {
        pg_url: pg_url.to_owned(),
        pg_pool_size: 8,
        log: LogConfig { url: nats_url.to_owned(), ..LogConfig::default() },
        queue_max: 8_192,
        in_flight_max: 4_096,
        pg_timeout_ms: 2_000,
        threads: 1,
        // `serve::start` sets it from `ServeConfig::tracing`.
        trace_export: None,
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

/// Every bound of the configuration, checked before anything starts.
fn validate(config: &ServeConfig) -> anyhow::Result<()> {
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
    config.tracing.validate().map_err(|e| anyhow::anyhow!("[tracing]: {e}"))?;
    Ok(())
}

pub fn start(mut config: ServeConfig) -> anyhow::Result<ServeHandle> {
    validate(&config)?;
    let traces = with_tracing(&mut config);
    let instance_id = &config.edge.instance_id;
    tracing::info!(instance = %instance_id, pid = std::process::id(), "engine instance starting");
    let shard_count = config.shards;
    let table = PartitionTable::new(shard_count, &config.pins)?;
    let (targets, receivers) = sync_mesh(&table, shard_count, config.edge.mesh_capacity);
    let state = ControlState::new(&config.edge);
    let control = state.control(&config.edge);
    let (durable, durable_handle) = Durable::start(config.durable.clone(), Some(targets), control)?;
    let worker = match config.worker.clone() {
        Some(worker_config) => Some(
            flashsale_pg_worker::worker::start(worker_config)
                .map_err(|e| anyhow::anyhow!("start the order worker: {e}"))?,
        ),
        None => None,
    };
    let plan = ShardPlan {
        shards: shard_count,
        mesh_capacity: config.edge.mesh_capacity,
        pinning: config.pinning,
        http_addr: config.http_addr,
        admin_addr: config.admin_addr,
        io_memory_bytes: config.io_memory_bytes,
    };
    let (http_addr, admin_addr) = (config.http_addr, config.admin_addr);
    let health = Arc::clone(&state.health);
    let shared = edge_shared(config, table, durable_handle, state, traces);
    let executors = match spawn_shards(&plan, &shared, receivers) {
        Ok(executors) => executors,
        Err(e) => {
            shared.stopping.store(true, Ordering::Relaxed);
            return Err(e);
        }
    };
    let mut handle = ServeHandle {
        http_addr,
        admin_addr,
        shared: Arc::clone(&shared),
        executors,
        durable: Some(durable),
        worker,
    };
    if let Err(e) = wait_started(&shared, &health) {
        handle.stop();
        return Err(e);
    }
    if let Some((http_port, admin_port)) = shared.ports.get() {
        handle.http_addr.set_port(*http_port);
        handle.admin_addr.set_port(*admin_port);
    }
    Ok(handle)
}

/// The one trace sink of this process (disabled without an endpoint), handed to the durable
/// side's exporter and to the in-process worker; the spans' resource names this instance.
fn with_tracing(config: &mut ServeConfig) -> flashsale_io::trace::TraceSink {
    if config.tracing.service_instance_id.is_empty() {
        config.tracing.service_instance_id = config.edge.instance_id.to_string();
    }
    let sink = config.tracing.sink();
    config.durable.trace_export = sink.is_enabled().then(|| crate::durable::TraceExport {
        sink: sink.clone(),
        config: config.tracing.clone(),
    });
    if let Some(worker) = config.worker.as_mut() {
        worker.tracing = flashsale_pg_worker::worker::WorkerTracing::Shared(sink.clone());
    }
    sink
}

/// The queues from the durable side to each shard: `redis-sync`'s events and the
/// stock-returned notices (the senders, by the partition table, for the durable side; the
/// receivers, one pair per shard, for the shards).
fn sync_mesh(
    table: &PartitionTable,
    shard_count: usize,
    capacity: usize,
) -> (crate::durable::sync::SyncTargets, ShardReceivers) {
    let (sync_senders, sync_receivers): (Vec<_>, Vec<_>) =
        (0..shard_count).map(|_| tokio::sync::mpsc::channel(capacity)).unzip();
    let (notice_senders, notice_receivers): (Vec<_>, Vec<_>) =
        (0..shard_count).map(|_| tokio::sync::mpsc::channel(capacity)).unzip();
    let targets = crate::durable::sync::SyncTargets {
        table: table.clone(),
        shards: sync_senders,
        notices: notice_senders,
    };
    (targets, sync_receivers.into_iter().zip(notice_receivers).collect())
}

/// What the durable side keeps current and every shard reads: the mode table, the
/// dependencies' health, the reconcile lease.
struct ControlState {
    modes: Arc<crate::durable::modes::ModeState>,
    health: Arc<crate::durable::health::Health>,
    lease: Arc<crate::durable::lease::Lease>,
}

impl ControlState {
    fn new(edge: &EdgeConfig) -> ControlState {
        let modes = Arc::new(crate::durable::modes::ModeState::load(&edge.control));
        let health = Arc::new(crate::durable::health::Health::default());
        // PostgreSQL answered the durable side's start-up check; the poller keeps this current.
        health.pg_ok_at_ms.store(crate::logic::clock::now_ms(), Ordering::Relaxed);
        let lease = Arc::new(crate::durable::lease::Lease::default());
        ControlState { modes, health, lease }
    }

    /// The durable side's handles on it, with the poll period and the reconcile lease this
    /// instance asks for (none when the periodic reconcile is off).
    fn control(&self, edge: &EdgeConfig) -> crate::durable::Control {
        let reconcile = edge.reconcile;
        crate::durable::Control {
            modes: Arc::clone(&self.modes),
            health: Arc::clone(&self.health),
            health_poll_ms: edge.health_poll_ms,
            reconcile_lease: (reconcile.interval_ms > 0)
                .then(|| (edge.instance_id.clone(), Duration::from_millis(reconcile.lease_ms))),
            lease: Arc::clone(&self.lease),
        }
    }
}

/// What every shard shares: the edge's configuration and tables, the durable side's handle,
/// the metrics, the flags of a stop, and the control state.
fn edge_shared(
    config: ServeConfig,
    table: PartitionTable,
    durable: crate::durable::DurableHandle,
    state: ControlState,
    traces: flashsale_io::trace::TraceSink,
) -> Arc<EdgeShared> {
    let shard_count = config.shards;
    let sku_funnel = crate::logic::sku_funnel::SkuFunnel::new(&config.edge.sku_funnel, shard_count);
    Arc::new(EdgeShared {
        config: config.edge,
        table,
        pass_keys: config.pass_keys,
        admin_token: config.admin_token,
        metrics: EdgeMetrics::new(shard_count),
        sku_funnel,
        durable,
        draining: AtomicBool::new(false),
        stopping: AtomicBool::new(false),
        heartbeats: (0..shard_count)
            .map(|_| AtomicU64::new(crate::logic::clock::now_ms()))
            .collect(),
        started: (0..shard_count).map(|_| AtomicBool::new(false)).collect(),
        ports: std::sync::OnceLock::new(),
        redis_facts: std::sync::OnceLock::new(),
        start_error: std::sync::OnceLock::new(),
        modes: state.modes,
        health: state.health,
        reconcile_lease: state.lease,
        traces,
        render_extra: config.render_extra,
    })
}

/// What starting the shards needs of the configuration.
struct ShardPlan {
    shards: usize,
    mesh_capacity: usize,
    pinning: Pinning,
    http_addr: SocketAddr,
    admin_addr: SocketAddr,
    io_memory_bytes: usize,
}

/// One glommio executor per shard; pinned shards take the CPUs the process may run on, in
/// order (CPUAffinity= respected).
fn spawn_shards(
    config: &ShardPlan,
    shared: &Arc<EdgeShared>,
    receivers: ShardReceivers,
) -> anyhow::Result<Vec<ExecutorJoinHandle<()>>> {
    let shard_count = config.shards;
    let mesh = MeshBuilder::full(shard_count, config.mesh_capacity);
    let mut executors = Vec::with_capacity(shard_count);
    let cpus = crate::app::startup::shard_cpus(
        shard_count,
        crate::app::startup::allowed_cpus().as_deref(),
    );
    for (id, (sync_rx, notice_rx)) in receivers.into_iter().enumerate() {
        let placement = match config.pinning {
            Pinning::PinPerCore => Placement::Fixed(cpus[id]),
            Pinning::Unpinned => Placement::Unbound,
        };
        let start = ShardStart {
            id,
            shared: Arc::clone(shared),
            mesh: mesh.clone(),
            http_addr: config.http_addr,
            admin_addr: config.admin_addr,
            id_seed: rand::random(),
            sync_rx: Some(sync_rx),
            notice_rx: Some(notice_rx),
        };
        let pinning = config.pinning;
        let instance = shared.config.instance_id.clone();
        let handle = LocalExecutorBuilder::new(placement)
            .name(&format!("shard-{id}"))
            .io_memory(config.io_memory_bytes)
            .ring_depth(256)
            .spawn(move || {
                // Every task of this executor is this shard's: the span stays entered for the
                // executor's life, so each log line carries the instance and the shard.
                let span = tracing::info_span!("shard", instance = %instance, shard = id);
                async move {
                    let _entered = span.enter();
                    shard::run(start).await;
                }
            })
            .map_err(|e| anyhow::anyhow!("start shard {id} (pinning {pinning:?}): {e}"))?;
        executors.push(handle);
    }
    Ok(executors)
}

/// Waits until every shard listens and the backlog has been read once (until then admission
/// cannot tell an empty backlog from an unknown one and closes submissions), or one failed.
fn wait_started(
    shared: &EdgeShared,
    health: &crate::durable::health::Health,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if shared.stopping.load(Ordering::Relaxed) {
            match shared.start_error.get() {
                Some(why) => anyhow::bail!("{why}"),
                None => anyhow::bail!("a shard failed to start (see the log)"),
            }
        }
        if shared.started.iter().all(|s| s.load(Ordering::Relaxed))
            && health.lag.polled_at_ms() != 0
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "shards did not start, or the first backlog poll did not answer, within 10 s"
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `flashsale migrate` (also run by `serve`, `worker` and `demo`): the schema through the
/// failing-over connector (each host within a whole-connect deadline, the writable one on the
/// newest timeline: a hung or revived old primary is never migrated).
pub fn migrate(config: &crate::app::config::Config) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let pool_config = flashsale_pg_worker::pool::PgPoolConfig {
            url: config.pg_url.clone(),
            ..Default::default()
        };
        let connector = flashsale_pg_worker::pool::Connector::new(&pool_config)?;
        let (mut client, driver) = connector
            .connect()
            .await
            .with_context(|| format!("connect to PostgreSQL at {}", config.pg_url))?;
        let report = flashsale_pg_worker::migrate(&mut client).await?;
        println!(
            "migrate: schema at version {} (applied now: {:?})",
            report.current_version, report.applied
        );
        drop(client);
        let _ = driver.await;
        Ok(())
    })
}
