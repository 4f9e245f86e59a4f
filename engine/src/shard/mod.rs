//! One shard: a glommio executor pinned to a core, owning its listener, its connections, its
//! slice of SKU partitions, its pipelined Redis connection and its replicas of every SKU's
//! sold-out flag (DESIGN.md section 3). Shards share nothing mutable; they talk through a
//! bounded glommio channel mesh ([`MeshMsg`]).
//!
//! - [`conn`]: the HTTP/1.1 connection loop (limits, pipelining, timeouts) and routing.
//! - [`submit`]: reservation and query flows.
//! - [`admin`]: the admin plane (shard 0 only).
//!
//! Not here: decisions that need no I/O (`partition`, `router`, `outcome`), the durable side
//! (`durable`).

pub mod admin;
pub mod conn;
pub mod orders;
pub mod submit;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flashsale_io::redis::script::{Functions, SkuKeys};
use flashsale_io::redis::{RedisClient, RedisConfig};
use glommio::channels::channel_mesh::{Receivers, Senders};
use glommio::net::TcpListener;

use crate::auth::PassKeys;
use crate::durable::DurableHandle;
use crate::http::Limits;
use crate::ids::IdGenerator;
use crate::limiter::{Limiter, Rate};
use crate::metrics::{EdgeMetrics, ShardMetrics};
use crate::partition::{PartitionLimits, ReplicaUpdate, SkuPartition, SkuReplica};
use crate::router::{PartitionTable, SkuKey};

/// Configuration of the edge, identical on every shard.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    pub http: Limits,
    /// Connections one shard serves at once; beyond it new connections are closed at once.
    pub connections_per_shard_max: usize,
    /// A request's head must arrive within this (slowloris bound).
    pub header_read_timeout_ms: u64,
    /// A keep-alive connection with no request for this long is closed.
    pub idle_timeout_ms: u64,
    pub redis: RedisConfig,
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
    /// Reservation TTL used when a SKU's `meta` cannot be read.
    pub reservation_ttl_ms_default: u64,
    pub overloaded_retry_ms: u64,
    pub busy_retry_ms: u64,
    /// Per user (from the pass), per shard.
    pub user_rate: Rate,
    /// Per client address, per shard; loopback peers are exempt (health checks, a load
    /// generator on the same host).
    pub ip_rate: Rate,
    /// Buckets per limiter table (fixed memory; colliding keys share a bucket).
    pub limiter_slots: usize,
    pub scanner: crate::scanner::ScannerConfig,
    /// The reconcile report and its periodic job (shard 0).
    pub reconcile: crate::reconcile::ReconcileConfig,
    pub publish_circuit: crate::circuit::CircuitConfig,
    pub redis_circuit: crate::circuit::CircuitConfig,
    /// `FLASHSALE_PAYMENT_KEY`: verifies payment callbacks; `None` refuses them (503).
    pub payment_key: Option<orders::PaymentKey>,
    /// Retries of idempotent calls only (`mark_sent`, the query's Redis read and PostgreSQL
    /// fallback): bounded attempts within a time budget, full jitter.
    pub idempotent_retry: crate::circuit::RetryPolicy,
    /// `decide_submit`'s thresholds (defaults derived from the 3 s order SLO, admission.rs).
    pub admission: crate::admission::Budgets,
    /// Submissions one shard works on at once (owner side); beyond it `OVERLOADED`.
    pub submit_in_flight_max: u32,
    /// How often the durable side polls the `order-writer` backlog and pings PostgreSQL.
    pub health_poll_ms: u64,
    /// The control key, where accepted mode snapshots persist, the mode rules.
    pub control: crate::control::ControlConfig,
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
    pub modes: Arc<crate::control::ModeState>,
    /// The backlog and PostgreSQL contact, as polled by the durable side.
    pub health: Arc<crate::control::Health>,
    /// Renders the durable side's `metrics` crate recorder, if one is installed.
    pub render_extra: Option<Box<dyn Fn() -> String + Send + Sync>>,
}

/// Messages between shards. Everything in them is `Send`.
pub enum MeshMsg {
    Submit(Box<submit::ForwardedSubmit>),
    Replica(ReplicaUpdate),
}

/// Wall-clock milliseconds (business timestamps; `now_ms` arguments everywhere below).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The key used for SKUs without local state: one shared admission bucket per shard.
const UNTRACKED: SkuKey = SkuKey { activity_id: 0, sku_id: 0 };

pub struct Shard {
    pub id: usize,
    pub shared: Arc<EdgeShared>,
    pub functions: Functions,
    mesh: Senders<MeshMsg>,
    partitions: RefCell<HashMap<SkuKey, SkuPartition>>,
    replicas: RefCell<HashMap<SkuKey, SkuReplica>>,
    keys: RefCell<HashMap<SkuKey, Rc<SkuKeys>>>,
    /// Per SKU: `meta.reservation_ttl_ms`, read once.
    pub ttl_cache: RefCell<HashMap<SkuKey, u64>>,
    ids: RefCell<IdGenerator>,
    request_seq: Cell<u64>,
    pub user_limiter: RefCell<Limiter>,
    pub ip_limiter: RefCell<Limiter>,
    /// The log-publish circuit of this shard: open → new submissions get SUBMIT_CLOSED before
    /// anything is reserved (reservations already made stay safe: the scanner republishes).
    pub publish_circuit: RefCell<crate::circuit::Circuit>,
    /// The Redis circuit of this shard: open → SYSTEM_BUSY without a call (fail closed).
    pub redis_circuit: RefCell<crate::circuit::Circuit>,
    /// This shard's copy of the mode table.
    pub modes: RefCell<crate::control::ShardModes>,
    /// Submissions this shard works on as owner (admission's local in-flight).
    pub submits_in_flight: Cell<u32>,
    /// What is left of `accepted_per_shard_max`.
    pub accepted_budget: RefCell<crate::partition::AcceptedBudget>,
}

impl Shard {
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
    pub fn next_request_id(&self) -> crate::ids::GeneratedRequestId {
        let n = self.request_seq.get() + 1;
        self.request_seq.set(n);
        crate::ids::GeneratedRequestId::new(self.id, n)
    }

    /// Runs `f` on this SKU's owner state (created on first use, or the shared untracked
    /// bucket when the shard already tracks `skus_tracked_max` SKUs).
    pub fn with_partition<T>(&self, key: SkuKey, f: impl FnOnce(&mut SkuPartition) -> T) -> T {
        let mut partitions = self.partitions.borrow_mut();
        let tracked =
            partitions.contains_key(&key) || partitions.len() < self.config().skus_tracked_max;
        let slot = if tracked { key } else { UNTRACKED };
        let limits = self.config().partition;
        let partition =
            partitions.entry(slot).or_insert_with(|| SkuPartition::new(slot, limits, now_ms()));
        f(partition)
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

    pub fn next_ids(&self, now_ms: u64) -> (crate::ids::BusinessId, crate::ids::BusinessId) {
        let mut ids = self.ids.borrow_mut();
        (
            ids.next(crate::ids::IdKind::Reservation, now_ms),
            ids.next(crate::ids::IdKind::Message, now_ms),
        )
    }

    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::Relaxed)
    }
}

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
    pub sync_rx: Option<tokio::sync::mpsc::Receiver<crate::sync::SyncRequest>>,
}

/// The body of each shard's executor: connect, bind, serve until stopped.
pub async fn run(start: ShardStart) {
    let ShardStart { id, shared, mesh, http_addr, admin_addr, id_seed, sync_rx } = start;
    let Ok((senders, receivers)) = mesh.join().await else {
        tracing::error!(shard = id, "mesh join failed");
        return;
    };
    let client = RedisClient::new(shared.config.redis.clone());
    let shard = Rc::new(Shard {
        id,
        shared: Arc::clone(&shared),
        functions: Functions::new(client),
        mesh: senders,
        partitions: RefCell::new(HashMap::new()),
        replicas: RefCell::new(HashMap::new()),
        keys: RefCell::new(HashMap::new()),
        ttl_cache: RefCell::new(HashMap::new()),
        ids: RefCell::new(IdGenerator::new(id_seed)),
        request_seq: Cell::new(0),
        user_limiter: RefCell::new(Limiter::new(
            shared.config.user_rate,
            shared.config.limiter_slots,
        )),
        ip_limiter: RefCell::new(Limiter::new(shared.config.ip_rate, shared.config.limiter_slots)),
        publish_circuit: RefCell::new(crate::circuit::Circuit::new(shared.config.publish_circuit)),
        redis_circuit: RefCell::new(crate::circuit::Circuit::new(shared.config.redis_circuit)),
        modes: RefCell::new(crate::control::ShardModes::new(&shared.modes)),
        submits_in_flight: Cell::new(0),
        accepted_budget: RefCell::new(crate::partition::AcceptedBudget::new(
            shared.config.accepted_per_shard_max,
        )),
    });
    spawn_mesh_receivers(&shard, receivers);
    if let Some(rx) = sync_rx {
        crate::sync::spawn_receiver(&shard, rx);
    }
    spawn_heartbeat(&shard);
    spawn_stock_recheck(&shard);
    spawn_activity_refresh(&shard);
    crate::scanner::spawn(&shard, shared.config.scanner);
    crate::reconcile::spawn(&shard);

    // Shard 0 binds first and publishes the ports (port 0 in tests resolves to one port that
    // every shard then shares through SO_REUSEPORT).
    let (http_port, admin_port) = if id == 0 {
        let listener = match TcpListener::bind(http_addr) {
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
        let ports = (
            listener.local_addr().map_or(0, |a| a.port()),
            admin.local_addr().map_or(0, |a| a.port()),
        );
        let _ = shared.ports.set(ports);
        let admin_shard = Rc::clone(&shard);
        glommio::spawn_local(conn::accept_loop(admin_shard, admin, conn::Plane::Admin)).detach();
        shared.started[id].store(true, Ordering::Relaxed);
        conn::accept_loop(Rc::clone(&shard), listener, conn::Plane::Public).await;
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
    match TcpListener::bind(addr) {
        Ok(listener) => {
            shared.started[id].store(true, Ordering::Relaxed);
            conn::accept_loop(Rc::clone(&shard), listener, conn::Plane::Public).await;
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
    policy: &crate::circuit::RetryPolicy,
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

/// Graceful stop: the listeners are closed; answer every request already being worked on —
/// on every shard, since this shard may own SKUs whose submits others still forward — before
/// the executor (and every task on it) ends. Idle keep-alive connections are simply closed.
async fn finish_in_flight(shard: &Shard) {
    let deadline = std::time::Instant::now() + Duration::from_millis(STOP_WAIT_MS);
    while shard.shared.metrics.requests_in_flight() > 0 {
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
            shard.shared.heartbeats[shard.id].store(now_ms(), Ordering::Relaxed);
            glommio::timer::sleep(Duration::from_millis(100)).await;
        }
    })
    .detach();
}

/// How often the owner re-reads each tracked SKU's `meta` into its activity snapshot.
const ACTIVITY_REFRESH_MS: u64 = 1_000;

/// Keeps each owned SKU's activity snapshot (status, window, version) close to Redis' `meta`,
/// so a SKU whose activity ended or was terminated is answered on the owner without a call.
fn spawn_activity_refresh(shard: &Rc<Shard>) {
    use crate::partition::{ActivitySnapshot, ActivityStatus};
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        while !shard.shared.stopping.load(Ordering::Relaxed) {
            glommio::timer::sleep(Duration::from_millis(ACTIVITY_REFRESH_MS)).await;
            let keys: Vec<SkuKey> =
                shard.partitions.borrow().keys().filter(|k| **k != UNTRACKED).copied().collect();
            for key in keys {
                let sku_keys = shard.sku_keys(key);
                let reply = shard
                    .functions
                    .client()
                    .command(&[
                        b"HMGET",
                        sku_keys.meta().as_bytes(),
                        b"status",
                        b"start_ms",
                        b"end_ms",
                        b"version",
                    ])
                    .await;
                let Ok(reply) = reply else { continue };
                let Some(fields) = reply.as_array() else { continue };
                let text = |i: usize| fields.get(i).and_then(|f| f.as_str());
                let num = |i: usize| text(i).and_then(|t| t.parse::<u64>().ok());
                let status = match text(0) {
                    Some("PENDING") => ActivityStatus::Pending,
                    Some("ACTIVE") => ActivityStatus::Active,
                    Some("ENDED") => ActivityStatus::Ended,
                    Some("TERMINATED") => ActivityStatus::Terminated,
                    _ => continue, // no meta (yet): Redis answers per request
                };
                let (Some(start_ms), Some(end_ms), Some(version)) = (num(1), num(2), num(3)) else {
                    continue;
                };
                let snapshot = ActivitySnapshot { status, start_ms, end_ms, version };
                shard.with_partition(key, |p| {
                    if p.key() == key {
                        p.set_activity(snapshot);
                    }
                });
            }
        }
    })
    .detach();
}

/// While a SKU is sold out, re-read its stock now and then: another instance may have
/// returned stock (compensation) that this instance's flag does not know about.
fn spawn_stock_recheck(shard: &Rc<Shard>) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        while !shard.shared.stopping.load(Ordering::Relaxed) {
            glommio::timer::sleep(Duration::from_millis(200)).await;
            let now = now_ms();
            let due: Vec<SkuKey> = shard
                .partitions
                .borrow()
                .iter()
                .filter(|(k, p)| **k != UNTRACKED && p.stock_check_due(now))
                .map(|(k, _)| *k)
                .collect();
            for key in due {
                let keys = shard.sku_keys(key);
                let reply =
                    shard.functions.client().command(&[b"GET", keys.stock().as_bytes()]).await;
                let stock = match reply {
                    Ok(reply) => reply
                        .as_bytes()
                        .and_then(|b| std::str::from_utf8(b).ok())
                        .and_then(|s| s.parse::<i64>().ok())
                        .unwrap_or(0),
                    Err(_) => continue,
                };
                if let Some(update) = shard.with_partition(key, |p| p.on_stock_observed(stock, now))
                {
                    shard.broadcast(update);
                }
            }
        }
    })
    .detach();
}
