//! The republish scanner (DESIGN.md section 6): on each owner shard, claims the due entries of
//! each owned SKU's `resv:pending` with `claim_due` (bounded batch, backoff, attempt count) and
//! republishes their order-create messages with the SAME message id — JetStream dedups inside
//! its window, the PostgreSQL inbox after it. It covers messages never confirmed
//! (`QUEUED_PENDING`) and confirmed ones whose outcome has not reached Redis by the order
//! deadline (a message or event lost after its ack; these go out under a per-attempt
//! `Nats-Msg-Id`, see `republish_acked`). Entries past the recovery deadline go to
//! `resv:stuck` (counted, logged, reported by reconcile) — never dropped silently.
//!
//! Which SKUs exist survives restarts in Redis: the admin preheat adds each SKU to the
//! [`ACTIVE_SKUS_KEY`] set, which every shard reads to find the SKUs it owns.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use flashsale_io::redis::script::{ClaimDueArgs, PendingEntry, PendingStatus};
use flashsale_io::wire::{OrderCreate, ORDER_CREATE_EVENT_TYPE, SCHEMA_VERSION};

use crate::durable::DurableRequest;
use crate::router::SkuKey;
use crate::shard::{now_ms, submit, Shard};

/// A plain Redis SET of `activity:sku` members (outside any SKU's hash slot on purpose: it is
/// read by every shard of every instance, written only at preheat).
pub const ACTIVE_SKUS_KEY: &str = "seckill:active-skus";

/// Scanner settings.
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
    let reply =
        shard.functions.client().command(&[b"SMEMBERS", ACTIVE_SKUS_KEY.as_bytes()]).await.ok()?;
    let members = reply.as_array()?;
    Some(
        members
            .iter()
            .filter_map(|m| {
                let (a, s) = m.as_str()?.split_once(':')?;
                Some(SkuKey::new(a.parse().ok()?, s.parse().ok()?))
            })
            .filter(|key| shard.shared.table.owner(*key) == shard.id)
            .collect(),
    )
}

/// The `flashsale_reservations_pending` and oldest-pending-age gauges of this shard: `ZCARD`
/// of each owned SKU's `resv:pending`, and `reserved_at` of its entry with the lowest score
/// (the most overdue: scores are next-retry times). A failed read leaves the last sample.
async fn sample_pending(shard: &Shard, owned: &[SkuKey], now: u64) {
    let client = shard.functions.client();
    let mut pending = 0u64;
    let mut oldest_ms = 0u64;
    for key in owned {
        let keys = shard.sku_keys(*key);
        let pending_key = keys.pending().as_bytes();
        let Ok(count) = client.command(&[b"ZCARD", pending_key]).await else { return };
        pending += count.as_int().map_or(0, |n| n.max(0) as u64);
        let Ok(head) = client.command(&[b"ZRANGE", pending_key, b"0", b"0"]).await else {
            return;
        };
        let Some(id) = head.as_array().and_then(|a| a.first()).and_then(|r| r.as_str()) else {
            continue;
        };
        let Ok(resv_key) = keys.resv(id) else { continue };
        let reserved_at = client
            .command(&[b"HGET", resv_key.as_bytes(), b"reserved_at"])
            .await
            .ok()
            .and_then(|r| r.as_str().and_then(|t| t.parse::<u64>().ok()));
        if let Some(at) = reserved_at {
            oldest_ms = oldest_ms.max(now.saturating_sub(at));
        }
    }
    let metrics = shard.metrics();
    metrics.reservations_pending.store(pending, Ordering::Relaxed);
    metrics.oldest_pending_age_ms.store(oldest_ms, Ordering::Relaxed);
}

/// Claims and republishes one SKU's due entries until none is due (bounded per sweep).
async fn sweep(shard: &Shard, key: SkuKey, config: &ScannerConfig) {
    let keys = shard.sku_keys(key);
    // At most a few batches per sweep so one SKU cannot starve the others.
    for _ in 0..4 {
        let args = ClaimDueArgs {
            now_ms: now_ms(),
            batch_max: config.batch_max,
            backoff_base_ms: config.backoff_base_ms,
            backoff_max_ms: config.backoff_max_ms,
            recovery_deadline_ms: config.recovery_deadline_ms,
        };
        let reply = match shard.functions.claim_due(&keys, &args).await {
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
            let keys = &keys;
            async move {
                let ok = if entry.status == PendingStatus::MessageSent {
                    republish_acked(shard, message).await
                } else {
                    submit::publish_and_mark(shard, keys, message).await
                };
                shard.metrics().republished.fetch_add(u64::from(ok), Ordering::Relaxed);
            }
        });
        futures::future::join_all(publishes).await;
        if claimed < config.batch_max as usize {
            return;
        }
    }
}

/// Republishes a message the log already acknowledged (`MESSAGE_SENT`) whose outcome is
/// overdue: the message or its outcome event was lost after the ack. Under its own message id
/// JetStream's duplicate window (at least 10 minutes, past the recovery deadline's reach)
/// would drop it as a duplicate of the lost original, so it goes out under
/// `<message_id>-r<attempt>`; the body keeps every business id, and the PostgreSQL inbox,
/// keyed by the body's message id, turns a copy into a duplicate that re-emits the recorded
/// outcome. True when the log acknowledged it in time.
async fn republish_acked(shard: &Shard, message: OrderCreate) -> bool {
    let msg_id = format!("{}-r{}", message.message_id, message.retry_count);
    let (tx, rx) = futures::channel::oneshot::channel();
    let request = DurableRequest::PublishAs { message: Box::new(message), msg_id, reply: tx };
    if shard.shared.durable.try_send(request).is_err() {
        return false;
    }
    let wait = Duration::from_millis(shard.config().publish_wait_ms);
    matches!(glommio::timer::timeout(wait, async { Ok(rx.await) }).await, Ok(Ok(Ok(_))))
}

/// The order-create message of a pending reservation, identical in every id to the first one.
fn message_of(key: SkuKey, entry: &PendingEntry) -> OrderCreate {
    OrderCreate {
        schema_version: SCHEMA_VERSION,
        event_type: ORDER_CREATE_EVENT_TYPE.to_owned(),
        message_id: entry.message_id.clone(),
        message_key: entry.reservation_id.clone(),
        request_id: entry.request_id.clone(),
        reservation_id: entry.reservation_id.clone(),
        activity_id: key.activity_id,
        sku_id: key.sku_id,
        user_id: entry.user_id,
        quantity: 1,
        reserved_at_ms: entry.reserved_at_ms,
        reservation_expires_at_ms: entry.expires_at_ms,
        retry_count: entry.send_attempts,
        payload_hash: entry.payload_hash.clone(),
        traceparent: None,
        created_at_ms: now_ms(),
    }
}
