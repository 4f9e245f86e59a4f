//! `redis-sync`'s consumer (DESIGN.md section 6): pulls `SECKILL_EVENTS` on the durable side
//! and hands each event to the owner shard of its SKU — the only writer of that SKU's Redis
//! keys in this instance — through one bounded queue per shard ([`SyncRequest`]). The delivery
//! is acked only after the shard applied it; a Redis error NAKs it for redelivery (every step
//! is idempotent); an undecodable event is dead-lettered.
//!
//! Not here: what applying an event means (`shard/sync.rs`, on the owner shard), which Redis
//! effects a rejection undoes (`io::wire::RejectReason::compensation`).

use std::time::Duration;

use flashsale_io::log::{Delivery, Log, Publisher, REDIS_SYNC_CONSUMER};
use flashsale_io::wire::{decode_event, ReservationEvent};
use futures::channel::oneshot;
use tokio::sync::mpsc;

use crate::logic::router::{PartitionTable, SkuKey};

/// Events pulled per fetch.
const FETCH_MAX: usize = 256;
/// Long-poll wait of an empty fetch.
const FETCH_WAIT: Duration = Duration::from_millis(500);
/// Longest a shard may take to apply one event before the delivery is NAKed.
const APPLY_WAIT: Duration = Duration::from_secs(5);
/// Redelivery delay after a failed apply.
const NAK_DELAY: Duration = Duration::from_millis(500);

/// One event on its way to the owner shard.
pub struct SyncRequest {
    pub event: ReservationEvent,
    pub reply: oneshot::Sender<Result<(), String>>,
}

/// Where events go: the partition table and one bounded queue per shard; and where the
/// stock-returned notices of every instance go (one bounded queue per shard, `notice.rs`).
#[derive(Clone)]
pub struct SyncTargets {
    pub table: PartitionTable,
    pub shards: Vec<mpsc::Sender<SyncRequest>>,
    pub notices: Vec<mpsc::Sender<SkuKey>>,
}

/// The durable side's consumer loop; returns when `stop` fires.
pub async fn run(
    log: Log,
    publisher: Publisher,
    targets: SyncTargets,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let source = loop {
        match log.redis_sync().await {
            Ok(source) => break source,
            Err(e) => {
                tracing::warn!(error = %e, "redis-sync: consumer not available yet");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = stop.changed() => return,
                }
            }
        }
    };
    loop {
        let fetched = tokio::select! {
            fetched = source.fetch(FETCH_MAX, FETCH_WAIT) => fetched,
            _ = stop.changed() => return,
        };
        let deliveries = match fetched {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "redis-sync: fetch failed");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let work = deliveries.into_iter().map(|d| settle(d, &publisher, &targets));
        futures::future::join_all(work).await;
    }
}

async fn settle(delivery: Delivery, publisher: &Publisher, targets: &SyncTargets) {
    let event = match decode_event(delivery.payload()) {
        Ok(event) => event,
        Err(e) => {
            // Undecodable or from a newer schema: no retry can fix it.
            tracing::error!(error = %e, "redis-sync: dead-lettering an event");
            if publisher.dead_letter(&delivery, REDIS_SYNC_CONSUMER, &e.to_string()).await.is_ok() {
                let _ = delivery.term().await;
            }
            return;
        }
    };
    let key = SkuKey::new(event.activity_id, event.sku_id);
    let owner = targets.table.owner(key);
    let (tx, rx) = oneshot::channel();
    let sent = targets.shards[owner].send(SyncRequest { event, reply: tx }).await.is_ok();
    let applied = sent && matches!(tokio::time::timeout(APPLY_WAIT, rx).await, Ok(Ok(Ok(()))));
    if applied {
        let _ = delivery.ack().await;
    } else {
        let _ = delivery.nak(NAK_DELAY).await;
    }
}
