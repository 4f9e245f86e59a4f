//! The republish scanner (DESIGN.md section 6): on each owner shard, claims the due entries of
//! each owned SKU's `resv:pending` with `claim_due` (bounded batch, backoff, attempt count) and
//! republishes their order-create messages with the SAME message id — JetStream dedups inside
//! its window, the PostgreSQL inbox after it. It covers messages never confirmed
//! (`QUEUED_PENDING`) and confirmed ones whose outcome has not reached Redis by the order
//! deadline (a message or event lost after its ack; these go out under a per-attempt
//! `Nats-Msg-Id`, see `MsgIdentity::Attempt` in `shard/publish.rs`). Entries past the
//! recovery deadline go to `resv:stuck` (counted, logged, reported by reconcile) — never
//! dropped silently.
//!
//! Every republish goes through the one publish path (`shard/publish.rs`: the publish
//! circuit, the publish metrics, `mark_sent`), like a first publish.
//!
//! Which SKUs exist survives restarts in Redis: activity creation adds each SKU to the
//! active-SKU set (`io::redis::layout::ACTIVE_SKUS_KEY`), which every shard reads to find the
//! SKUs it owns.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use flashsale_io::redis::layout::{PendingEntry, PendingStatus};
use flashsale_io::redis::script::ClaimDueArgs;
use flashsale_io::wire::{OrderCreate, ReservationFacts};

use super::publish::{publish_order, MsgIdentity, Origin};
use super::state::Shard;
use crate::logic::clock::now_ms;
use crate::logic::placement::SkuKey;

pub use super::config::ScannerConfig;

pub fn spawn(shard: &Rc<Shard>, config: ScannerConfig) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        let mut owned: Vec<SkuKey> = Vec::new();
        let mut refreshed_ms = 0u64;
        while !shard.shared.stopping.load(Ordering::Relaxed) {
            glommio::timer::sleep(Duration::from_millis(config.interval_ms)).await;
            let now = now_ms();
            if now.saturating_sub(refreshed_ms) >= config.sku_refresh_ms {
                if let Some(skus) = read_owned_skus(&shard).await {
                    owned = skus;
                }
                refreshed_ms = now;
                sample_pending(&shard, &owned, now).await;
            }
            for key in &owned {
                sweep(&shard, *key, &config).await;
            }
        }
    })
    .detach();
}

async fn read_owned_skus(shard: &Shard) -> Option<Vec<SkuKey>> {
    let members = shard.store.functions.active_skus().await.ok()?;
    let owned = members
        .into_iter()
        .map(|m| SkuKey::new(m.activity_id, m.sku_id))
        .filter(|key| shard.shared.table.owner(*key) == shard.id);
    Some(owned.collect())
}

/// The `flashsale_reservations_pending` and oldest-pending-age gauges of this shard: the size
/// of each owned SKU's `resv:pending`, and the age of its most overdue entry (lowest score:
/// scores are next-retry times). A failed read leaves the last sample.
async fn sample_pending(shard: &Shard, owned: &[SkuKey], now: u64) {
    let mut pending = 0u64;
    let mut oldest_ms = 0u64;
    for key in owned {
        let keys = shard.store.sku_keys(*key);
        let Ok(sample) = shard.store.functions.sample_pending(&keys).await else { return };
        pending += sample.pending;
        if let Some(at) = sample.most_overdue_reserved_at_ms {
            oldest_ms = oldest_ms.max(now.saturating_sub(at));
        }
    }
    let metrics = shard.metrics();
    metrics.reservations_pending.store(pending, Ordering::Relaxed);
    metrics.oldest_pending_age_ms.store(oldest_ms, Ordering::Relaxed);
}

/// Claims and republishes one SKU's due entries until none is due (bounded per sweep).
async fn sweep(shard: &Rc<Shard>, key: SkuKey, config: &ScannerConfig) {
    // Negative control (tests/tests/negative_controls.rs): the scanner claims and republishes
    // nothing, so the drills must see the buyers it would have saved go unanswered.
    #[cfg(feature = "failpoints")]
    fail::fail_point!("negctl.scanner_off", |_| ());
    let keys = shard.store.sku_keys(key);
    // At most a few batches per sweep so one SKU cannot starve the others.
    for _ in 0..4 {
        let args = ClaimDueArgs {
            now_ms: now_ms(),
            batch_max: config.batch_max,
            backoff_base_ms: config.backoff_base_ms,
            backoff_max_ms: config.backoff_max_ms,
            recovery_deadline_ms: config.recovery_deadline_ms,
        };
        let reply = match shard.store.functions.claim_due(&keys, &args).await {
            Ok(reply) => reply,
            Err(e) => {
                tracing::warn!(error = %e, activity_id = key.activity_id, sku_id = key.sku_id, "scanner: claim_due failed");
                return;
            }
        };
        for id in &reply.stuck {
            shard.metrics().stuck_reservations.fetch_add(1, Ordering::Relaxed);
            tracing::error!(reservation_id = %id, activity_id = key.activity_id, sku_id = key.sku_id,
                "reservation past the recovery deadline moved to stuck (reconcile reports it)");
        }
        let claimed = reply.claimed.len();
        let publishes = reply.claimed.into_iter().map(|entry| {
            let message = message_of(key, &entry);
            // Acknowledged before and overdue: under a per-attempt Nats-Msg-Id (publish.rs).
            let identity = match entry.status {
                PendingStatus::MessageSent => MsgIdentity::Attempt,
                PendingStatus::PendingMessage => MsgIdentity::Original,
            };
            let keys = &keys;
            async move {
                publish_order(&shard.publish, keys, message, identity, Origin::Scanner).await;
            }
        });
        futures::future::join_all(publishes).await;
        if claimed < config.batch_max as usize {
            return;
        }
    }
}

/// The order-create message of a pending reservation, identical in every id to the first one
/// (also an operator's republish or compensation of a stuck one, `stuck.rs`).
pub(super) fn message_of(key: SkuKey, entry: &PendingEntry) -> OrderCreate {
    let facts = ReservationFacts {
        message_id: &entry.message_id,
        reservation_id: &entry.reservation_id,
        request_id: &entry.request_id,
        activity_id: key.activity_id,
        sku_id: key.sku_id,
        user_id: entry.user_id,
        quantity: entry.quantity,
        reserved_at_ms: entry.reserved_at_ms,
        expires_at_ms: entry.expires_at_ms,
        payload_hash: &entry.payload_hash,
        traceparent: None,
        send_attempts: entry.send_attempts,
    };
    OrderCreate::for_reservation(&facts, now_ms())
}
