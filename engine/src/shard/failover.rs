//! Redis failover and data loss on the owner shard (DESIGN.md sections 7 and 11): Redis
//! replication is asynchronous, so a promoted replica — or a node restarted without its data —
//! may have lost acknowledged writes, and a node can lose everything at once (FLUSHALL, a
//! restart without persistence, a master lost with its replica). Every [`POLL_MS`] this task
//! asks each master its `run_id` and feeds what serves each owned SKU into
//! `logic::failover::FailoverWatch`; a SKU that failed over is closed (`SUBMIT_CLOSED`, reason
//! `REDIS_FAILOVER`). A SKU whose keys are gone is closed with reason `REDIS_DATA_LOST`, seen
//! by whichever comes first: `reserve` answering "no meta" or the activity refresh finding no
//! `meta` for a SKU whose activity the owner knew (`logic::submit`, `refresh.rs`), this task
//! finding no `meta` while recovering a failover, or PostgreSQL naming a SKU on sale whose
//! `meta` is missing (`rebuild::find_lost`: every [`LOST_POLL_MS`] all of them, and every
//! [`POLL_MS`] those `reserve` found without `meta` before the owner knew them — a loss
//! before the owner ever read the SKU, an engine restarted onto an empty Redis). Then it is
//! recovered:
//!
//! 1. a SKU without `meta` is rebuilt from PostgreSQL (`rebuild.rs`) once the order log has
//!    settled what was published before the loss; nothing reopens it before (a reservation
//!    would find it gone again);
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

use super::rebuild::{self, DrainTarget, Look};
use super::state::Shard;
use crate::logic::clock::now_ms;
use crate::logic::failover::FailoverWatch;
use crate::logic::modes::{Mode, Scope};
use crate::logic::placement::SkuKey;

/// How often masters are asked their `run_id`.
const POLL_MS: u64 = 1_000;
/// How often PostgreSQL is asked which SKUs are on sale (to find one whose `meta` is gone).
const LOST_POLL_MS: u64 = 5_000;
/// How long a SKU stays closed at least: writes the old master answered just before it died
/// are still arriving (redis-sync, the scanner), and the slot map settles.
const SETTLE_MS: u64 = 2_000;
/// SKUs watched per shard.
const WATCHED_SKUS_MAX: usize = 4_096;

pub fn spawn(shard: &Rc<Shard>) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        let mut watch = FailoverWatch::new(WATCHED_SKUS_MAX);
        let mut drains: HashMap<SkuKey, Option<DrainTarget>> = HashMap::new();
        let mut lost_polled_ms = 0;
        while !shard.shared.stopping.load(Ordering::Relaxed) {
            glommio::timer::sleep(Duration::from_millis(POLL_MS)).await;
            observe(&shard, &mut watch).await;
            let look = if now_ms().saturating_sub(lost_polled_ms) >= LOST_POLL_MS {
                lost_polled_ms = now_ms();
                Some(Look::Everything)
            } else {
                let suspects = shard.owner.borrow_mut().suspects();
                (!suspects.is_empty()).then_some(Look::Suspects(suspects))
            };
            if let Some(look) = look {
                for key in rebuild::find_lost(&shard, look).await {
                    data_lost(&shard, key, "PostgreSQL has it on sale and its meta is gone");
                }
            }
            recover(&shard, &mut drains).await;
        }
    })
    .detach();
}

/// Closes `key` as lost (`REDIS_DATA_LOST`), once: its events held until it is rebuilt.
pub fn data_lost(shard: &Shard, key: SkuKey, seen: &'static str) {
    if !shard.owner.borrow_mut().mark_data_lost(key, now_ms()) {
        return;
    }
    shard.metrics().redis_data_losses.fetch_add(1, Ordering::Relaxed);
    tracing::error!(
        activity_id = key.activity_id,
        sku_id = key.sku_id,
        seen,
        "redis data lost: the SKU's keys are gone; closed until rebuilt from PostgreSQL \
        and reconciled"
    );
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

/// Tries to reopen every SKU closed by a failover or a loss (module documentation, steps
/// 1-3). `drains`: each lost SKU's drain target, kept across rounds.
async fn recover(shard: &Rc<Shard>, drains: &mut HashMap<SkuKey, Option<DrainTarget>>) {
    let closed = shard.owner.borrow().failed_over();
    shard.metrics().skus_closed_by_failover.store(closed.len() as u64, Ordering::Relaxed);
    drains.retain(|key, _| closed.iter().any(|(k, _)| k == key));
    let now = now_ms();
    for (key, since_ms) in closed {
        if now.saturating_sub(since_ms) < SETTLE_MS {
            continue;
        }
        // Without meta nothing can reopen it (a reserve would find the SKU gone again): step 1.
        match shard.store.functions.read_meta(&shard.store.sku_keys(key)).await {
            Ok(None) => {
                data_lost(shard, key, "no meta while recovering a failover");
                let target = drains.entry(key).or_default();
                if rebuild::drained(shard, target, since_ms, SETTLE_MS, now) {
                    rebuild::rebuild(shard, key).await;
                }
                continue;
            }
            Ok(Some(_)) => shard.owner.borrow_mut().release_events(key),
            Err(_) => continue,
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
        reconcile(shard, key).await;
    }
}

/// Step 2: reopens `key` when a reconcile against PostgreSQL passes.
async fn reconcile(shard: &Shard, key: SkuKey) {
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
