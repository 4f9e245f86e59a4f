//! Redis failover on the owner shard (DESIGN.md section 11): Redis replication is
//! asynchronous, so a promoted replica — or a node restarted without its data — may have lost
//! acknowledged writes. Every [`POLL_MS`] this task asks each master its `run_id` and feeds
//! what serves each owned SKU into `logic::failover::FailoverWatch`; a SKU that failed over is
//! closed (`SUBMIT_CLOSED`, reason `REDIS_FAILOVER`) by its partition, and then recovered:
//!
//! 1. a Redis that lost the SKU altogether (no `meta`) is preheated again from PostgreSQL's
//!    truth: its configuration, and as stock the units PostgreSQL can still sell
//!    (`pg_worker::sku::sellable_units`) — never the initial stock, which would sell again
//!    what PostgreSQL already sold;
//! 2. the SKU reopens after a reconcile against PostgreSQL passes (its report lists every
//!    reservation PostgreSQL has and Redis lost);
//! 3. or after an operator's signed mode snapshot (SKU, activity or global scope, `NORMAL` or
//!    `RECOVERING`) issued after the failover was seen — the explicit "I have looked" when
//!    a reconcile cannot pass (a loss without replica fencing).
//!
//! With fencing on (`min_replica_acks` ≥ 1) no promised reservation can be lost, the promoted
//! replica is consistent with itself, and step 2 passes within a round or two.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use flashsale_io::redis::layout::{ActivityStatus, SkuMember};
use flashsale_io::redis::script::{PreheatArgs, PreheatReply};
use flashsale_pg_worker::sku;

use super::state::Shard;
use crate::logic::clock::now_ms;
use crate::logic::failover::FailoverWatch;
use crate::logic::modes::{Mode, Scope};
use crate::logic::placement::SkuKey;

/// How often masters are asked their `run_id`.
const POLL_MS: u64 = 1_000;
/// How long a SKU stays closed at least: writes the old master answered just before it died
/// are still arriving (redis-sync, the scanner), and the slot map settles.
const SETTLE_MS: u64 = 2_000;
/// SKUs watched per shard.
const WATCHED_SKUS_MAX: usize = 4_096;

pub fn spawn(shard: &Rc<Shard>) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        let mut watch = FailoverWatch::new(WATCHED_SKUS_MAX);
        while !shard.shared.stopping.load(Ordering::Relaxed) {
            glommio::timer::sleep(Duration::from_millis(POLL_MS)).await;
            observe(&shard, &mut watch).await;
            recover(&shard).await;
        }
    })
    .detach();
}

/// One look at who serves each SKU this shard owns (the active-SKU set, and any SKU with
/// local state), so a SKU that lost everything before its first buyer is caught too.
async fn observe(shard: &Shard, watch: &mut FailoverWatch) {
    let mut tracked = shard.owner.borrow().tracked_skus();
    if let Ok(active) = shard.store.functions.active_skus().await {
        let owned = active
            .into_iter()
            .map(|m| SkuKey::new(m.activity_id, m.sku_id))
            .filter(|key| shard.shared.table.owner(*key) == shard.id);
        let known: std::collections::HashSet<SkuKey> = tracked.iter().copied().collect();
        tracked.extend(owned.filter(|key| !known.contains(key)).take(WATCHED_SKUS_MAX));
    }
    if tracked.is_empty() {
        return;
    }
    let router = shard.store.functions.router();
    let masters = router.masters();
    let mut run_ids = HashMap::with_capacity(masters.len());
    for master in &masters {
        run_ids.insert(*master, shard.store.functions.run_id_of(*master).await.ok().flatten());
    }
    let now = now_ms();
    for key in tracked {
        let keys = shard.store.sku_keys(key);
        let Some(node) = router.node_of(keys.slot()) else { continue };
        let run_id = run_ids.get(&node).cloned().flatten();
        if watch.observe(key, node, run_id.as_deref(), &masters) {
            shard.owner.borrow_mut().mark_failover(key, now);
            shard.metrics().redis_failovers.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                activity_id = key.activity_id,
                sku_id = key.sku_id,
                %node,
                "redis failover: the SKU is closed until a reconcile against PostgreSQL passes"
            );
        }
    }
}

/// Tries to reopen every SKU closed by a failover (module documentation, steps 1-3).
async fn recover(shard: &Rc<Shard>) {
    let closed = shard.owner.borrow().failed_over();
    shard.metrics().skus_closed_by_failover.store(closed.len() as u64, Ordering::Relaxed);
    let now = now_ms();
    for (key, since_ms) in closed {
        if now.saturating_sub(since_ms) < SETTLE_MS {
            continue;
        }
        if let Some(version) = forced(shard, key, since_ms) {
            shard.owner.borrow_mut().clear_failover(key);
            tracing::warn!(
                activity_id = key.activity_id,
                sku_id = key.sku_id,
                version,
                "redis failover: SKU reopened by a signed mode snapshot"
            );
            continue;
        }
        let keys = shard.store.sku_keys(key);
        if let Ok(None) = shard.store.functions.read_meta(&keys).await {
            rebuild(shard, key).await;
        }
        let report = super::reconcile::reconcile(&shard.shared, &shard.store, key).await;
        if report.ok {
            shard.owner.borrow_mut().clear_failover(key);
            tracing::warn!(
                activity_id = key.activity_id,
                sku_id = key.sku_id,
                "redis failover: SKU reopened after a passing reconcile"
            );
        } else {
            tracing::warn!(activity_id = key.activity_id, sku_id = key.sku_id,
                took_ms = report.took_ms, deltas = ?report.deltas.values(),
                problems = ?report.problems,
                "redis failover: reconcile not passing yet (GET .../reconcile lists the ids)");
        }
    }
}

/// The version of a signed snapshot issued after `since_ms` that reopens `key`, if any.
fn forced(shard: &Shard, key: SkuKey, since_ms: u64) -> Option<u64> {
    let scopes =
        [Scope::Sku(key.activity_id, key.sku_id), Scope::Activity(key.activity_id), Scope::Global];
    scopes.into_iter().find_map(|scope| {
        let signed = shard.shared.modes.describe(scope)?;
        let snapshot = &signed.snapshot;
        let opens = matches!(snapshot.mode, Mode::Normal | Mode::Recovering { .. });
        (opens && snapshot.issued_at_ms > since_ms).then_some(snapshot.version)
    })
}

/// Preheats a SKU Redis lost from PostgreSQL's configuration and sellable units.
async fn rebuild(shard: &Shard, key: SkuKey) {
    let (activity_id, sku_id) = (key.activity_id as i64, key.sku_id as i64);
    let read = shard
        .shared
        .durable
        .pg(move |client| async move {
            let config = sku::sku_config(&client, activity_id, sku_id).await?;
            let units = sku::sellable_units(&client, activity_id, sku_id).await?;
            Ok(config.zip(units))
        })
        .await;
    let Ok(Some((config, units))) = read else {
        tracing::warn!(activity_id, sku_id, "redis failover: cannot read PostgreSQL to rebuild");
        return;
    };
    let Some(status) = ActivityStatus::parse(&config.status) else { return };
    let args = PreheatArgs {
        status,
        start_ms: config.start_at_ms.max(0) as u64,
        end_ms: config.end_at_ms.max(0) as u64,
        version: config.version.max(1) as u64,
        reservation_ttl_ms: config.reservation_ttl_ms.max(1) as u64,
        stock: units.max(0) as u64,
    };
    let keys = shard.store.sku_keys(key);
    match shard.store.functions.preheat(&keys, &args).await {
        Ok(PreheatReply::Applied { .. }) => {
            tracing::warn!(
                activity_id,
                sku_id,
                stock = units,
                "redis failover: SKU rebuilt from PostgreSQL (stock = its sellable units)"
            );
            let member = SkuMember { activity_id: key.activity_id, sku_id: key.sku_id };
            let _ = shard.store.functions.add_active_sku(member).await;
        }
        Ok(PreheatReply::Stale { .. }) => {}
        Err(e) => tracing::warn!(activity_id, sku_id, error = %e, "redis failover: rebuild failed"),
    }
}
