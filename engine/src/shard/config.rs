//! The edge's configuration, identical on every shard: HTTP bounds and deadlines, the Redis
//! and log waits, partition and admission bounds, limiter rates, the repair jobs' settings.
//! Built and validated once in `app` (`app::serve::default_edge_config`, `app::config`), then
//! read-only.
//!
//! Not here: what a shard owns at run time (`state.rs`).

use crate::http::Limits;
use crate::logic::limiter::Rate;
use crate::logic::partition::PartitionLimits;
use crate::logic::submit::OwnerLimits;
use flashsale_io::redis::RedisConfig;

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
    pub min_replica_acks: flashsale_io::redis::fence::MinReplicaAcks,
    /// A master without `maxmemory-policy noeviction` refuses the start, unless overridden
    /// (`[redis] allow_eviction`; `logic::redis_settings`).
    pub redis_eviction: crate::logic::redis_settings::EvictionCheck,
    /// `reserve`'s `pending_grace_ms`: how long a fresh reservation waits before the scanner
    /// may republish it (3 s by default: a message the log acknowledged gets its mark only if
    /// its outcome has not reached Redis three quarters of this after the reservation, so on
    /// a busy box most units need none; an unacknowledged one is republished after it).
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
    pub scanner: ScannerConfig,
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
    /// The expensive path's adaptive limit and the readiness it drives (`logic::overload`).
    pub overload: crate::logic::overload::OverloadConfig,
    /// How often the durable side polls the `order-writer` backlog and pings PostgreSQL.
    pub health_poll_ms: u64,
    /// The control key, where accepted mode snapshots persist, the mode rules.
    pub control: crate::durable::modes::ControlConfig,
    /// Which SKUs have funnel series of their own (`[metrics]`, the pinned SKUs first).
    pub sku_funnel: crate::logic::sku_funnel::SkuFunnelConfig,
    /// This process among the instances on one set of stores (generated request ids, the
    /// shards' log lines, the reconcile lease).
    pub instance_id: crate::logic::ids::InstanceId,
}

/// Redis nodes with a circuit of their own per shard (a cluster of up to 64 masters).
const REDIS_NODES_MAX: usize = 64;

impl EdgeConfig {
    /// The owner state's bounds (`logic::submit::OwnerState`).
    pub fn owner_limits(&self) -> OwnerLimits {
        OwnerLimits {
            partition: self.partition,
            skus_tracked_max: self.skus_tracked_max,
            accepted_per_shard_max: self.accepted_per_shard_max,
            in_flight_max: self.submit_in_flight_max,
            budgets: self.admission,
            redis_circuit: self.redis_circuit,
            redis_nodes_max: REDIS_NODES_MAX,
            busy_retry_ms: self.busy_retry_ms,
            overload: self.overload,
        }
    }
}

/// The republish scanner's settings (`scanner.rs`).
#[derive(Debug, Clone, Copy)]
pub struct ScannerConfig {
    /// Pause between sweeps of a shard's SKUs.
    pub interval_ms: u64,
    /// Entries claimed per `claim_due` call (≤ 512, the function's bound).
    pub batch_max: u32,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    /// A reservation older than this goes to `stuck` instead of being republished.
    pub recovery_deadline_ms: u64,
    /// How often the set of active SKUs is re-read.
    pub sku_refresh_ms: u64,
}

impl Default for ScannerConfig {
    fn default() -> ScannerConfig {
        ScannerConfig {
            interval_ms: 500,
            batch_max: 128,
            backoff_base_ms: 1_000,
            backoff_max_ms: 30_000,
            // Reservation TTL (5 min) + the 10 min JetStream dedup window: beyond that a
            // republish could no longer be deduplicated by the log, only by the inbox.
            recovery_deadline_ms: 15 * 60 * 1000,
            sku_refresh_ms: 2_000,
        }
    }
}
