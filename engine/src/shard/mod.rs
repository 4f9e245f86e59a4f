//! One shard: a glommio executor pinned to a core, owning its listener, its connections, its
//! slice of SKU partitions, its pipelined Redis connection and its replicas of every SKU's
//! sold-out flag (DESIGN.md section 3). Shards share nothing mutable; they talk through a
//! bounded glommio channel mesh ([`MeshMsg`]).
//!
//! Every task that runs on a shard lives in this folder:
//! - [`conn`]: the HTTP/1.1 connection loop (limits, pipelining, timeouts) and routing;
//! - [`submit`] and [`query`]: the reservation and query flows; [`orders`]: orders and
//!   payments; [`admin`]: the admin plane (shard 0 only);
//! - [`publish`]: THE path an order-create message takes to the log (submit and scanner);
//! - [`scanner`]: the republish scanner; [`sync`]: the owner's side of `redis-sync`;
//!   [`refresh`]: the activity snapshot and stale sold-out re-reads; [`replays`]: the replay
//!   map completed from Redis after sell-out; [`reconcile`]: the
//!   reconcile report's reads and its periodic job; [`failover`]: Redis failovers close
//!   their SKUs until a reconcile passes.
//!
//! Not here: decisions that need no I/O (`logic`), the tokio side (`durable`, reached only
//! through [`DurableHandle`]).

pub mod admin;
pub mod conn;
pub mod dlq;
pub mod failover;
pub mod lifecycle;
pub mod orders;
pub mod publish;
pub mod query;
pub mod reconcile;
pub mod refresh;
pub mod replays;
pub mod scanner;
pub mod stuck;
pub mod submit;
pub mod sync;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flashsale_io::redis::script::{Functions, SkuKeys};
use flashsale_io::redis::RedisConfig;
use glommio::channels::channel_mesh::{Receivers, Senders};
use glommio::net::TcpListener;

use crate::durable::DurableHandle;
use crate::http::Limits;
use crate::logic::auth::PassKeys;
use crate::logic::limiter::{Limiter, Rate};
use crate::logic::metrics::{EdgeMetrics, ShardMetrics};
use crate::logic::partition::{PartitionLimits, ReplicaUpdate, SkuReplica};
use crate::logic::placement::{PartitionTable, SkuKey};
use crate::logic::submit::{OwnerLimits, OwnerState};

/// Configuration of the edge, identical on every shard.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    pub http: Limits,
    /// Public connections one shard serves at once; beyond it new connections are closed at
    /// once. The start-up check lowers it to fit the open-file limit (`app::startup`).
    pub connections_per_shard_max: usize,
    /// Public connections one client address (IPv6: its /64; behind a trusted balancer the
    /// address its PROXY header carries) holds on one shard; beyond it new ones are closed.
    pub connections_per_address_max: usize,
    /// Admin-plane connections (shard 0) at once: few, so that descriptors stay for clients.
    /// `conn::ADMIN_PROBE_SLOTS` more are kept for health probes.
    pub admin_connections_max: usize,
    /// Admin-plane connections one client address holds (loopback included): a flood from
    /// one address cannot take the operators' budget.
    pub admin_connections_per_address_max: usize,
    /// A request's head must be complete this long after its first byte, however slowly it
    /// trickles in (slowloris bound); then 408 and close. Also bounds the arrival of a
    /// trusted balancer's PROXY header after the accept.
    pub header_read_timeout_ms: u64,
    /// A request's body must be complete this long after the end of its head; then 408.
    pub body_read_timeout_ms: u64,
    /// Each batch of answers must be taken by the peer within this; a peer that does not
    /// read is closed.
    pub write_timeout_ms: u64,
    /// A keep-alive connection with no request for this long is closed.
    pub idle_timeout_ms: u64,
    /// Balancers whose PROXY protocol header is required and believed (CONTRACT.md section
    /// 2, `FLASHSALE_PROXY_PROTOCOL_FROM`); empty: every PROXY header refused.
    pub proxy_protocol_from: crate::http::proxy::TrustedSources,
    /// `[http] health_path`: answered on the public port, 200 when ready, 503 while
    /// draining or starting (for balancers that check over HTTP); `None`: no such route.
    pub health_path: Option<String>,
    /// Template of every Redis connection (its `addr` is the first seed).
    pub redis: RedisConfig,
    /// `FLASHSALE_REDIS_URL`'s seeds: one standalone server, or any nodes of a cluster.
    pub redis_seeds: Vec<std::net::SocketAddr>,
    /// `FLASHSALE_REDIS_MIN_REPLICA_ACKS`: replicas that must hold a new reservation before it
    /// is promised (one `WAIT` per pipeline flush).
    pub min_replica_acks: flashsale_io::redis::router::MinReplicaAcks,
    /// `reserve`'s `pending_grace_ms`: how long a fresh reservation waits before the scanner
    /// may republish it.
    pub pending_grace_ms: u64,
    /// `mark_sent`'s `order_deadline_ms`: when a confirmed message's outcome is overdue.
    pub order_deadline_ms: u64,
    /// How long a shard waits for the log's publish ack before answering `QUEUED_PENDING`.
    pub publish_wait_ms: u64,
    /// How long a query waits for the PostgreSQL fallback before answering `UNKNOWN`.
    pub query_fallback_wait_ms: u64,
    /// Submits queued towards one other shard; full → `OVERLOADED` at once.
    pub mesh_capacity: usize,
    pub partition: PartitionLimits,
    /// SKUs a shard keeps local state for; others share one admission bucket.
    pub skus_tracked_max: usize,
    /// Accepted-map entries (local replays) one shard keeps over all its SKUs (~570 bytes
    /// each); beyond it replays are answered by Redis.
    pub accepted_per_shard_max: usize,
    pub overloaded_retry_ms: u64,
    pub busy_retry_ms: u64,
    /// Per user (from the pass), per shard.
    pub user_rate: Rate,
    /// Per client address, per shard; loopback peers are exempt (health checks, a load
    /// generator on the same host).
    pub ip_rate: Rate,
    /// Per user, per shard, for reads and order changes (queries, order reads, cancels):
    /// apart from `user_rate` so that polling never eats a buyer's submit allowance.
    pub read_user_rate: Rate,
    /// Buckets per limiter table (fixed memory; colliding keys share a bucket).
    pub limiter_slots: usize,
    pub scanner: crate::shard::scanner::ScannerConfig,
    /// The reconcile report and its periodic job (shard 0).
    pub reconcile: crate::logic::reconcile::ReconcileConfig,
    pub publish_circuit: crate::logic::circuit::CircuitConfig,
    pub redis_circuit: crate::logic::circuit::CircuitConfig,
    /// `FLASHSALE_PAYMENT_KEY`: verifies payment callbacks; `None` refuses them (503).
    pub payment_key: Option<flashsale_io::key::HmacKey>,
    /// Retries of idempotent calls only (`mark_sent`, the query's Redis read and PostgreSQL
    /// fallback): bounded attempts within a time budget, full jitter.
    pub idempotent_retry: crate::logic::circuit::RetryPolicy,
    /// `decide_submit`'s thresholds (defaults derived from the 3 s order SLO, admission.rs).
    pub admission: crate::logic::admission::Budgets,
    /// Submissions one shard works on at once (owner side); beyond it `OVERLOADED`.
    pub submit_in_flight_max: u32,
    /// How often the durable side polls the `order-writer` backlog and pings PostgreSQL.
    pub health_poll_ms: u64,
    /// The control key, where accepted mode snapshots persist, the mode rules.
    pub control: crate::durable::control::ControlConfig,
    /// This process among the instances on one set of stores (generated request ids, the
    /// shards' log lines, the reconcile lease).
    pub instance_id: crate::logic::ids::InstanceId,
}

/// What all shards share read-only (plus a few flags and the metrics).
pub struct EdgeShared {
    pub config: EdgeConfig,
    pub table: PartitionTable,
    pub pass_keys: PassKeys,
    pub admin_token: Option<String>,
    pub metrics: EdgeMetrics,
    pub durable: DurableHandle,
    pub draining: AtomicBool,
    pub stopping: AtomicBool,
    /// Per shard: ms timestamp of the last event-loop tick (liveness).
    pub heartbeats: Box<[AtomicU64]>,
    /// Per shard: listener bound and Redis connected (startup).
    pub started: Box<[AtomicBool]>,
    /// Set by shard 0 once bound: the public and admin ports (port 0 resolves here).
    pub ports: std::sync::OnceLock<(u16, u16)>,
    /// The accepted degradation modes (shards read their own copy, `Shard::modes`).
    pub modes: Arc<crate::durable::control::ModeState>,
    /// The backlog and PostgreSQL contact, as polled by the durable side.
    pub health: Arc<crate::durable::control::Health>,
    /// Whether this instance holds the reconcile lease (kept by the durable side).
    pub reconcile_lease: Arc<crate::durable::lease::Lease>,
    /// Renders the durable side's `metrics` crate recorder, if one is installed.
    pub render_extra: Option<Box<dyn Fn() -> String + Send + Sync>>,
}

/// Messages between shards. Everything in them is `Send`.
pub enum MeshMsg {
    Submit(Box<submit::ForwardedSubmit>),
    Replica(ReplicaUpdate),
}

pub struct Shard {
    pub id: usize,
    pub shared: Arc<EdgeShared>,
    pub functions: Functions,
    mesh: Senders<MeshMsg>,
    /// What this shard decides submissions with as owner (partitions, accepted budget, the
    /// Redis circuit, ids, in-flight): one borrow per decision, never held across an await.
    pub owner: RefCell<OwnerState>,
    replicas: RefCell<HashMap<SkuKey, SkuReplica>>,
    keys: RefCell<HashMap<SkuKey, Rc<SkuKeys>>>,
    request_seq: Cell<u64>,
    pub user_limiter: RefCell<Limiter>,
    pub ip_limiter: RefCell<Limiter>,
    pub read_limiter: RefCell<Limiter>,
    /// One log line a second for bad payment-callback signatures (the rest are counted).
    pub bad_signature_log: Cell<crate::logic::limiter::Throttle>,
    /// The log-publish circuit of this shard: open → new submissions get SUBMIT_CLOSED before
    /// anything is reserved (reservations already made stay safe: the scanner republishes).
    pub publish_circuit: RefCell<crate::logic::circuit::Circuit>,
    /// This shard's copy of the mode table.
    pub modes: RefCell<crate::durable::control::ShardModes>,
    /// Messages on their way to the log, crossing to the durable side together
    /// (`publish.rs`).
    pub outgoing: publish::Outgoing,
    /// Acknowledged reservations whose `mark_sent` is still to be made (`publish.rs`).
    pub marks: publish::Marks,
}

impl Shard {
    /// A shard's state before its tasks start.
    fn new(
        id: usize,
        shared: &Arc<EdgeShared>,
        functions: Functions,
        mesh: Senders<MeshMsg>,
        id_seed: [u8; 32],
    ) -> Shard {
        Shard {
            id,
            shared: Arc::clone(shared),
            functions,
            mesh,
            owner: RefCell::new(OwnerState::new(owner_limits(&shared.config), id_seed)),
            replicas: RefCell::new(HashMap::new()),
            keys: RefCell::new(HashMap::new()),
            request_seq: Cell::new(0),
            user_limiter: RefCell::new(Limiter::new(
                shared.config.user_rate,
                shared.config.limiter_slots,
            )),
            ip_limiter: RefCell::new(Limiter::new(
                shared.config.ip_rate,
                shared.config.limiter_slots,
            )),
            read_limiter: RefCell::new(Limiter::new(
                shared.config.read_user_rate,
                shared.config.limiter_slots,
            )),
            bad_signature_log: Cell::new(crate::logic::limiter::Throttle::new(1_000)),
            publish_circuit: RefCell::new(crate::logic::circuit::Circuit::new(
                shared.config.publish_circuit,
            )),
            modes: RefCell::new(crate::durable::control::ShardModes::new(&shared.modes)),
            outgoing: publish::Outgoing::default(),
            marks: publish::Marks::default(),
        }
    }

    pub fn metrics(&self) -> &ShardMetrics {
        self.shared.metrics.shard(self.id)
    }

    pub fn config(&self) -> &EdgeConfig {
        &self.shared.config
    }

    /// The Redis key names of a SKU, built once per shard.
    pub fn sku_keys(&self, key: SkuKey) -> Rc<SkuKeys> {
        let mut keys = self.keys.borrow_mut();
        if let Some(k) = keys.get(&key) {
            return Rc::clone(k);
        }
        let k = Rc::new(SkuKeys::new(key.activity_id, key.sku_id));
        if keys.len() < self.config().skus_tracked_max {
            keys.insert(key, Rc::clone(&k));
        }
        k
    }

    /// A request id for responses whose request carried none (`x-request-id`).
    pub fn next_request_id(&self) -> crate::logic::ids::GeneratedRequestId {
        let n = self.request_seq.get() + 1;
        self.request_seq.set(n);
        crate::logic::ids::GeneratedRequestId::new(&self.shared.config.instance_id, self.id, n)
    }

    /// The replica's local answer for a SKU owned elsewhere (or here).
    pub fn with_replica<T>(&self, key: SkuKey, f: impl FnOnce(Option<&SkuReplica>) -> T) -> T {
        f(self.replicas.borrow().get(&key))
    }

    /// Applies an owner's update locally and sends it to every other shard. A full mesh
    /// queue drops the update for that shard: replicas only save work, and the next flip
    /// (or the owner answering forwarded requests) corrects it.
    pub fn broadcast(&self, update: ReplicaUpdate) {
        self.apply_replica(&update);
        for peer in 0..self.shared.table.shard_count() {
            if peer != self.id {
                let _ = self.mesh.try_send_to(peer, MeshMsg::Replica(update.clone()));
            }
        }
    }

    fn apply_replica(&self, update: &ReplicaUpdate) {
        let mut replicas = self.replicas.borrow_mut();
        if replicas.contains_key(&update.key) || replicas.len() < self.config().skus_tracked_max {
            replicas.entry(update.key).or_default().apply(update);
        }
    }

    /// Forwards a submit to its owner; a full queue hands it back.
    pub fn forward(
        &self,
        owner: usize,
        forwarded: Box<submit::ForwardedSubmit>,
    ) -> Result<(), Box<submit::ForwardedSubmit>> {
        match self.mesh.try_send_to(owner, MeshMsg::Submit(forwarded)) {
            Ok(()) => Ok(()),
            Err(glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(
                MeshMsg::Submit(f),
            )))
            | Err(glommio::GlommioError::Closed(glommio::ResourceType::Channel(
                MeshMsg::Submit(f),
            ))) => Err(f),
            Err(_) => {
                // Other errors (invalid peer) cannot carry the message back; the caller
                // answers from what it knows.
                unreachable_forward()
            }
        }
    }

    /// The address limit (before any HMAC: it is what protects the CPU); loopback is exempt.
    pub fn check_address(&self, peer_ip: Option<std::net::IpAddr>, now_ms: u64) -> Result<(), u64> {
        match peer_ip.filter(|ip| !ip.is_loopback()) {
            Some(ip) => {
                self.ip_limiter.borrow_mut().check(crate::logic::limiter::ip_key(ip), now_ms)
            }
            None => Ok(()),
        }
    }

    /// The per-user limit of reads and order changes.
    pub fn check_reader(&self, user_id: u64, now_ms: u64) -> Result<(), u64> {
        self.read_limiter.borrow_mut().check(user_id, now_ms)
    }

    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::Relaxed)
    }
}

/// Longest a shard tries to reach Redis at start (a dependency, like the log and PostgreSQL,
/// that must answer once before the engine serves).
const REDIS_START_WAIT_MS: u64 = 5_000;

/// The Redis router of this shard (standalone or cluster, decided by asking a seed) with the
/// function library loaded on every master; `None` when no seed answered in time.
async fn connect_redis(id: usize, shared: &EdgeShared) -> Option<Functions> {
    use flashsale_io::redis::router::{Router, RouterConfig};
    let config = &shared.config;
    let router_config = RouterConfig {
        min_replica_acks: config.min_replica_acks,
        ..RouterConfig::new(config.redis_seeds.clone(), config.redis.clone())
    };
    let deadline = std::time::Instant::now() + Duration::from_millis(REDIS_START_WAIT_MS);
    let router = loop {
        match Router::connect(router_config.clone()).await {
            Ok(router) => break router,
            Err(e) if std::time::Instant::now() < deadline => {
                tracing::debug!(shard = id, error = %e, "redis not reachable yet");
                glommio::timer::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => {
                tracing::error!(shard = id, error = %e, seeds = ?config.redis_seeds, "redis not reachable at start");
                return None;
            }
        }
    };
    if let (0, Some(warning)) = (id, router.fence_warning()) {
        tracing::warn!("{warning}");
    }
    let functions = Functions::over(router);
    // "Function not found" reloads the library on the node that says so; loading it here
    // only saves the first calls that round trip.
    if let Err(e) = functions.load_everywhere().await {
        tracing::warn!(shard = id, error = %e, "redis: loading the function library failed");
    }
    Some(functions)
}

/// The owner state's bounds, from the edge configuration.
fn owner_limits(config: &EdgeConfig) -> OwnerLimits {
    OwnerLimits {
        partition: config.partition,
        skus_tracked_max: config.skus_tracked_max,
        accepted_per_shard_max: config.accepted_per_shard_max,
        in_flight_max: config.submit_in_flight_max,
        budgets: config.admission,
        redis_circuit: config.redis_circuit,
        redis_nodes_max: REDIS_NODES_MAX,
        busy_retry_ms: config.busy_retry_ms,
    }
}

/// Redis nodes with a circuit of their own per shard (a cluster of up to 64 masters).
const REDIS_NODES_MAX: usize = 64;

#[cold]
fn unreachable_forward() -> Result<(), Box<submit::ForwardedSubmit>> {
    // try_send_to only fails with WouldBlock/Closed for a valid peer index, and the owner
    // index comes from the partition table built for this shard count.
    panic!("mesh send to an invalid peer: partition table and shard count disagree")
}

/// Everything a shard needs to start, moved into its executor.
pub struct ShardStart {
    pub id: usize,
    pub shared: Arc<EdgeShared>,
    pub mesh: glommio::channels::channel_mesh::MeshBuilder<
        MeshMsg,
        glommio::channels::channel_mesh::Full,
    >,
    pub http_addr: std::net::SocketAddr,
    pub admin_addr: std::net::SocketAddr,
    pub id_seed: [u8; 32],
    /// Events from `redis-sync` for the SKUs this shard owns.
    pub sync_rx: Option<tokio::sync::mpsc::Receiver<crate::durable::sync::SyncRequest>>,
    /// SKUs this shard owns whose stock another instance returned (`durable/notice.rs`).
    pub notice_rx: Option<tokio::sync::mpsc::Receiver<SkuKey>>,
}

/// The body of each shard's executor: connect, bind, serve until stopped.
pub async fn run(start: ShardStart) {
    let ShardStart { id, shared, mesh, http_addr, admin_addr, id_seed, sync_rx, notice_rx } = start;
    let Ok((senders, receivers)) = mesh.join().await else {
        tracing::error!(shard = id, "mesh join failed");
        return;
    };
    let Some(functions) = connect_redis(id, &shared).await else {
        shared.stopping.store(true, Ordering::Relaxed);
        return;
    };
    let shard = Rc::new(Shard::new(id, &shared, functions, senders, id_seed));
    spawn_mesh_receivers(&shard, receivers);
    if let Some(rx) = sync_rx {
        sync::spawn_receiver(&shard, rx);
    }
    if let Some(rx) = notice_rx {
        refresh::spawn_notices(&shard, rx);
    }
    spawn_heartbeat(&shard);
    refresh::spawn(&shard);
    failover::spawn(&shard);
    scanner::spawn(&shard, shared.config.scanner);
    reconcile::spawn(&shard);

    // Shard 0 binds first and publishes the ports (port 0 in tests resolves to one port that
    // every shard then shares through SO_REUSEPORT).
    let (http_port, admin_port) = if id == 0 {
        let public = match conn::bind_public(http_addr) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(shard = id, error = %e, addr = %http_addr, "bind failed");
                shared.stopping.store(true, Ordering::Relaxed);
                return;
            }
        };
        let admin = match TcpListener::bind(admin_addr) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(shard = id, error = %e, addr = %admin_addr, "admin bind failed");
                shared.stopping.store(true, Ordering::Relaxed);
                return;
            }
        };
        let ports = (public.local_addr.port(), admin.local_addr().map_or(0, |a| a.port()));
        let _ = shared.ports.set(ports);
        let admin_shard = Rc::clone(&shard);
        glommio::spawn_local(conn::accept_loop(admin_shard, admin, conn::Plane::Admin)).detach();
        shared.started[id].store(true, Ordering::Relaxed);
        conn::serve_public(Rc::clone(&shard), public).await;
        finish_in_flight(&shard).await;
        return;
    } else {
        loop {
            if let Some(ports) = shared.ports.get() {
                break *ports;
            }
            if shared.stopping.load(Ordering::Relaxed) {
                return;
            }
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
    };
    let _ = admin_port;
    let addr = std::net::SocketAddr::new(http_addr.ip(), http_port);
    match conn::bind_public(addr) {
        Ok(public) => {
            shared.started[id].store(true, Ordering::Relaxed);
            // Until stopping: a drain only shuts the listener (connections still answered).
            conn::serve_public(Rc::clone(&shard), public).await;
            finish_in_flight(&shard).await;
        }
        Err(e) => {
            tracing::error!(shard = id, error = %e, %addr, "bind failed");
            shared.stopping.store(true, Ordering::Relaxed);
        }
    }
}

/// Runs the idempotent `op` up to `policy.attempts_max` times while it fails, waiting a
/// full-jitter delay between attempts and starting none past `policy.budget_ms`. Only for
/// operations whose repetition is harmless (reads, `mark_sent`).
pub async fn retry_idempotent<T, E, F, Fut>(
    policy: &crate::logic::circuit::RetryPolicy,
    mut op: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let started = std::time::Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        match op().await {
            Ok(value) => return Ok(value),
            Err(e) => {
                let elapsed_ms = started.elapsed().as_millis() as u64;
                match policy.next_delay_ms(attempts, elapsed_ms, rand::random()) {
                    Some(delay_ms) => {
                        glommio::timer::sleep(Duration::from_millis(delay_ms)).await;
                    }
                    None => return Err(e),
                }
            }
        }
    }
}

/// Longest a stopping shard waits for requests in flight (each is bounded by its own Redis
/// and publish deadlines, well under this).
const STOP_WAIT_MS: u64 = 5_000;

/// Graceful stop: the listeners are closed; answer every request already being worked on (a
/// connection counts its requests until their answers are written) and the marks of acks
/// already answered —
/// on every shard, since this shard may own SKUs whose submits others still forward — before
/// the executor (and every task on it) ends. Idle keep-alive connections are simply closed.
async fn finish_in_flight(shard: &Shard) {
    let deadline = std::time::Instant::now() + Duration::from_millis(STOP_WAIT_MS);
    while shard.shared.metrics.requests_in_flight() > 0 || !shard.marks.is_idle() {
        if std::time::Instant::now() > deadline {
            tracing::warn!(
                shard = shard.id,
                in_flight = shard.shared.metrics.requests_in_flight(),
                "stopping with requests still in flight"
            );
            return;
        }
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
}

fn spawn_mesh_receivers(shard: &Rc<Shard>, receivers: Receivers<MeshMsg>) {
    let receivers = Rc::new(receivers);
    for peer in 0..shard.shared.table.shard_count() {
        if peer == shard.id {
            continue;
        }
        let shard = Rc::clone(shard);
        let receivers = Rc::clone(&receivers);
        glommio::spawn_local(async move {
            while let Ok(Some(message)) = receivers.recv_from(peer).await {
                match message {
                    MeshMsg::Replica(update) => shard.apply_replica(&update),
                    MeshMsg::Submit(forwarded) => {
                        let shard = Rc::clone(&shard);
                        let in_flight = &shard.metrics().requests_in_flight;
                        in_flight.fetch_add(1, Ordering::Relaxed);
                        glommio::spawn_local(async move {
                            submit::owner_forwarded(&shard, *forwarded).await;
                            shard.metrics().requests_in_flight.fetch_sub(1, Ordering::Relaxed);
                        })
                        .detach();
                    }
                }
            }
        })
        .detach();
    }
}

fn spawn_heartbeat(shard: &Rc<Shard>) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        while !shard.shared.stopping.load(Ordering::Relaxed) {
            shard.shared.heartbeats[shard.id]
                .store(crate::logic::clock::now_ms(), Ordering::Relaxed);
            glommio::timer::sleep(Duration::from_millis(100)).await;
        }
    })
    .detach();
}
