//! Health, metrics and drain on the admin plane (DESIGN.md section 7): `/livez` checks only
//! that every shard's event loop ticks; `/readyz` only local state (started, not draining);
//! `/startupz` that every shard listens and the backlog was read once. Dependency health
//! never decides liveness.
//!
//! Not here: the public port's health path (`routes.rs`), who may call these (`mod.rs`).

use std::sync::atomic::Ordering;

use serde_json::json;

use super::modes::render_mode;
use crate::http::Status;
use crate::logic::clock::now_ms;
use crate::shard::shared::EdgeShared;

/// A shard whose loop has not ticked for this long is not live.
const HEARTBEAT_STALE_MS: u64 = 2_000;

/// `GET /livez`
pub fn livez(shared: &EdgeShared) -> (Status, String) {
    let now = now_ms();
    let live = shared
        .heartbeats
        .iter()
        .all(|h| now.saturating_sub(h.load(Ordering::Relaxed)) < HEARTBEAT_STALE_MS);
    health(live, "live")
}

/// `GET /startupz`: listening everywhere, and the backlog read once (admission needs it).
pub fn startupz(shared: &EdgeShared) -> (Status, String) {
    let started = shared.started.iter().all(|s| s.load(Ordering::Relaxed))
        && shared.health.lag.polled_at_ms() != 0;
    health(started, "started")
}

/// `GET /readyz`, with Redis' settings as read at start in `redis` (each master's
/// `maxmemory_policy`, `appendonly`, `appendfsync`, `save`, and whether the eviction check is
/// overridden) and the `order-writer` backlog with its drain-time estimate in `backlog`
/// (`logic::drain`): facts for the operator, never a reason to be unready.
pub fn readyz(shared: &EdgeShared) -> (Status, String) {
    let ready = shared.is_ready();
    let status = if ready { Status::Ok } else { Status::ServiceUnavailable };
    let redis = shared.redis_facts.get().map(|f| f.readyz_detail());
    let backlog = shared.health.drain_detail();
    (status, json!({ "ready": ready, "redis": redis, "backlog": backlog }).to_string())
}

/// `GET /metrics`: every shard's counters, the mode and lease gauges, the durable side's.
pub fn metrics(shared: &EdgeShared) -> (Status, String) {
    let mut text = String::with_capacity(16 * 1024);
    shared.metrics.render(&mut text);
    shared.sku_funnel.promote();
    shared.sku_funnel.render(&mut text);
    render_mode(shared, &mut text);
    shared.health.render_drain(&mut text);
    shared.health.deps.render(&mut text);
    shared.traces.stats().render(&mut text);
    if let Some(facts) = shared.redis_facts.get() {
        facts.render_metrics(&mut text);
    }
    if let Some(extra) = &shared.render_extra {
        text.push_str(&extra());
    }
    (Status::Ok, text)
}

/// `POST /internal/drain`: readiness false, the public listeners stop accepting.
pub fn drain(shared: &EdgeShared) -> (Status, String) {
    shared.draining.store(true, Ordering::Relaxed);
    tracing::info!("drain requested: readiness false, public listeners stop accepting");
    (Status::Ok, json!({"draining": true}).to_string())
}

fn health(ok: bool, what: &str) -> (Status, String) {
    let status = if ok { Status::Ok } else { Status::ServiceUnavailable };
    (status, json!({ what: ok }).to_string())
}
