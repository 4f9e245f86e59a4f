//! Two periodic re-reads that keep the owner's local state close to Redis (DESIGN.md section
//! 3.1), each a typed read of `io::redis` fed into the owner state in one call:
//!
//! - every [`ACTIVITY_REFRESH_MS`], each tracked SKU's `meta` becomes its activity snapshot,
//!   so a SKU whose activity ended or was terminated is answered on the owner without a call;
//! - every [`STOCK_RECHECK_TICK_MS`], each sold-out SKU whose re-check is due re-reads
//!   `stock`: another instance may have returned stock (compensation) that this instance's flag
//!   does not know about. Positive stock clears the flag on every shard.
//!
//! - on a stock-returned notice from any instance (`durable/notice.rs`), the same re-read at
//!   once for that SKU when it is sold out here: other instances' flags clear within the
//!   notice's delivery time instead of the re-check period.
//!
//! A failed read changes nothing: local state only saves work, Redis stays the authority.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::logic::clock::now_ms;
use crate::logic::partition::ActivitySnapshot;
use crate::logic::placement::SkuKey;

use super::state::Shard;

/// How often the owner re-reads each tracked SKU's `meta`.
const ACTIVITY_REFRESH_MS: u64 = 1_000;
/// How often due stock re-checks are looked for (each SKU's own period is
/// `PartitionLimits::stock_recheck_ms`).
const STOCK_RECHECK_TICK_MS: u64 = 200;

pub fn spawn(shard: &Rc<Shard>) {
    let activity = Rc::clone(shard);
    glommio::spawn_local(async move {
        while !activity.shared.stopping.load(Ordering::Relaxed) {
            glommio::timer::sleep(Duration::from_millis(ACTIVITY_REFRESH_MS)).await;
            refresh_activities(&activity).await;
        }
    })
    .detach();
    let stock = Rc::clone(shard);
    glommio::spawn_local(async move {
        while !stock.shared.stopping.load(Ordering::Relaxed) {
            glommio::timer::sleep(Duration::from_millis(STOCK_RECHECK_TICK_MS)).await;
            recheck_stock(&stock).await;
        }
    })
    .detach();
}

async fn refresh_activities(shard: &Shard) {
    let tracked = shard.owner.borrow().tracked_skus();
    for key in tracked {
        let keys = shard.store.sku_keys(key);
        // No meta (yet) or a failed read: Redis answers per request meanwhile — unless the
        // SKU had meta before: then its keys are lost (`failover.rs` rebuilds it).
        let meta = match shard.store.functions.read_meta(&keys).await {
            Ok(Some(meta)) => meta,
            Ok(None) => {
                closed_if_lost(shard, key);
                continue;
            }
            Err(_) => continue,
        };
        let snapshot = ActivitySnapshot {
            status: meta.status,
            start_ms: meta.start_ms,
            end_ms: meta.end_ms,
            version: meta.version,
        };
        shard.owner.borrow_mut().set_activity(key, snapshot);
    }
}

/// A SKU whose activity the owner knew and whose `meta` is gone lost its keys (a FLUSHALL keeps
/// the node's run id, so the failover watch cannot see it): closed until rebuilt.
fn closed_if_lost(shard: &Shard, key: SkuKey) {
    if shard.owner.borrow().knew_activity(key) {
        super::failover::data_lost(shard, key, "the activity refresh found no meta");
    }
}

/// Re-reads the stock of each SKU a notice names, when this owner's flag says sold out.
pub fn spawn_notices(
    shard: &Rc<Shard>,
    mut rx: tokio::sync::mpsc::Receiver<crate::logic::placement::SkuKey>,
) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        while let Some(key) = rx.recv().await {
            if !shard.owner.borrow_mut().is_sold_out(key) {
                continue;
            }
            let keys = shard.store.sku_keys(key);
            let Ok(stock) = shard.store.functions.read_stock(&keys).await else { continue };
            let update =
                shard.owner.borrow_mut().on_stock_observed(key, stock.unwrap_or(0), now_ms());
            if let Some(update) = update {
                shard.mesh.broadcast(update);
            }
        }
    })
    .detach();
}

/// Re-reads `stock` of each SKU whose sold-out flag is due; a SKU that stays sold out gets
/// its replay load retried when the last one failed (`replays.rs`).
async fn recheck_stock(shard: &Rc<Shard>) {
    let due = shard.owner.borrow().stock_checks_due(now_ms());
    for key in due {
        let keys = shard.store.sku_keys(key);
        let Ok(stock) = shard.store.functions.read_stock(&keys).await else { continue };
        let update = shard.owner.borrow_mut().on_stock_observed(key, stock.unwrap_or(0), now_ms());
        match update {
            Some(update) => shard.mesh.broadcast(update),
            None => super::replays::ensure_loaded(&shard.owner, &shard.store, &shard.mesh, key),
        }
    }
}
