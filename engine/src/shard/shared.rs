//! What every shard of the edge shares, read-only apart from a few flags and the metrics:
//! the configuration, the partition table, the pass keys, the durable side's handle, the
//! accepted modes, the health the durable side polls, the reconcile lease.
//!
//! Not here: what one shard owns (`state.rs` and the services it holds).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::config::EdgeConfig;
use crate::durable::DurableHandle;
use crate::logic::auth::PassKeys;
use crate::logic::metrics::{EdgeMetrics, ShardMetrics};
use crate::logic::placement::PartitionTable;

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
    /// Redis' eviction and persistence settings as shard 0 read them at start (`/readyz`'s
    /// `redis` detail, the `flashsale_redis_*` gauges).
    pub redis_facts: std::sync::OnceLock<crate::logic::redis_settings::RedisFacts>,
    /// Why the start was refused, when a shard knows (`serve::start` returns it).
    pub start_error: std::sync::OnceLock<String>,
    /// The accepted degradation modes (shards read their own copy, `Shard::modes`).
    pub modes: Arc<crate::durable::modes::ModeState>,
    /// The backlog and PostgreSQL contact, as polled by the durable side.
    pub health: Arc<crate::durable::health::Health>,
    /// Whether this instance holds the reconcile lease (kept by the durable side).
    pub reconcile_lease: Arc<crate::durable::lease::Lease>,
    /// The funnel per hot SKU (`logic::sku_funnel`): each shard counts into its own lines,
    /// `/metrics` promotes the top SKUs into free slots and renders it.
    pub sku_funnel: crate::logic::sku_funnel::SkuFunnel,
    /// Where finished spans go (disabled without an OTLP endpoint): the publish path records
    /// the reservation's, redis-sync the compensation's; the durable side exports them.
    pub traces: flashsale_io::trace::TraceSink,
    /// Renders the durable side's `metrics` crate recorder, if one is installed.
    pub render_extra: Option<Box<dyn Fn() -> String + Send + Sync>>,
}

impl EdgeShared {
    /// The metrics of shard `id` (each shard writes only its own).
    pub fn shard_metrics(&self, id: usize) -> &ShardMetrics {
        self.metrics.shard(id)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Ready for traffic (`/readyz`, the public health path): every shard listening, not
    /// draining, not in sustained overload (a shard's adaptive limit at its floor for
    /// `unready_after_ms`, until it has been off it for `ready_after_ms`: `logic::overload`).
    pub fn is_ready(&self) -> bool {
        self.started.iter().all(|s| s.load(Ordering::Relaxed))
            && !self.is_draining()
            && !self.metrics.overloaded()
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }
}
