//! `redis-sync`'s consumer (DESIGN.md section 6): pulls `SECKILL_EVENTS` on the durable side
//! and hands each event to the owner shard of its SKU — the only writer of that SKU's Redis
//! keys in this instance — through one bounded queue per shard ([`SyncRequest`]: the events
//! of one fetch for one shard travel together, one crossing each way). A delivery is acked
//! only after the shard applied its event; a Redis error NAKs it for redelivery (every step
//! is idempotent); an undecodable event is dead-lettered.
//!
//! Not here: what applying an event means (`shard/sync.rs`, on the owner shard), which Redis
//! effects a rejection undoes (`flashsale_pg_worker::compensation`).

use std::time::Duration;

use flashsale_io::jetstream::{Delivery, Log, Publisher, REDIS_SYNC_CONSUMER};
use flashsale_io::wire::{decode_event, ReservationEvent};
use futures::channel::oneshot;
use tokio::sync::mpsc;

use crate::logic::placement::{PartitionTable, SkuKey};

/// Events pulled per fetch.
const FETCH_MAX: usize = 256;
/// Long-poll wait of an empty fetch.
const FETCH_WAIT: Duration = Duration::from_millis(500);
/// Longest a shard may take to apply one fetch's events before their deliveries are NAKed.
const APPLY_WAIT: Duration = Duration::from_secs(5);
/// Redelivery delay after a failed apply.
const NAK_DELAY: Duration = Duration::from_millis(500);
/// Redelivery delay of an event whose SKU is being rebuilt from PostgreSQL: with the
/// consumer's `max_deliver` (20 by default) an event can wait ~100 s this way, more than a
/// rebuild waits for the order log to drain (`shard/rebuild.rs`, `DRAIN_WAIT_MAX_MS`).
const HELD_NAK_DELAY: Duration = Duration::from_secs(5);

/// Events on their way to their owner shard, answered together: one result per event, in
/// order.
pub struct SyncRequest {
    pub events: Vec<ReservationEvent>,
    pub reply: oneshot::Sender<Vec<Result<(), NotApplied>>>,
}

/// Why an event was not applied; its delivery is NAKed either way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotApplied {
    /// Redis refused it or did not answer: redelivered soon.
    Failed(String),
    /// Its SKU's keys were lost and are not rebuilt yet: redelivered after a longer pause.
    Held,
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
        settle(deliveries, &publisher, &targets).await;
    }
}

/// Dead-letters what cannot be decoded and hands the rest to their owner shards, one request
/// per shard; acks each delivery whose event was applied, NAKs the others.
async fn settle(deliveries: Vec<Delivery>, publisher: &Publisher, targets: &SyncTargets) {
    let mut per_shard: Vec<Vec<(Delivery, ReservationEvent)>> =
        targets.shards.iter().map(|_| Vec::new()).collect();
    let mut undecodable = Vec::new();
    for delivery in deliveries {
        match decode_event(delivery.payload()) {
            Ok(event) => {
                let owner = targets.table.owner(SkuKey::new(event.activity_id, event.sku_id));
                per_shard[owner].push((delivery, event));
            }
            Err(e) => undecodable.push((delivery, e)),
        }
    }
    let dead = undecodable.into_iter().map(|(delivery, e)| async move {
        // Undecodable or from a newer schema: no retry can fix it.
        tracing::error!(error = %e, "redis-sync: dead-lettering an event");
        if publisher.dead_letter(&delivery, REDIS_SYNC_CONSUMER, &e.to_string()).await.is_ok() {
            let _ = delivery.term().await;
        }
    });
    let applied = per_shard
        .into_iter()
        .enumerate()
        .filter(|(_, batch)| !batch.is_empty())
        .map(|(owner, batch)| apply_on(&targets.shards[owner], batch));
    futures::future::join(futures::future::join_all(dead), futures::future::join_all(applied))
        .await;
}

async fn apply_on(shard: &mpsc::Sender<SyncRequest>, batch: Vec<(Delivery, ReservationEvent)>) {
    let (deliveries, events): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
    let (tx, rx) = oneshot::channel();
    let sent = shard.send(SyncRequest { events, reply: tx }).await.is_ok();
    let results = match tokio::time::timeout(APPLY_WAIT, rx).await {
        Ok(Ok(results)) if sent => results,
        _ => Vec::new(),
    };
    let settled = deliveries.into_iter().enumerate().map(|(i, delivery)| {
        let result = results.get(i).cloned();
        async move {
            let _ = match result {
                Some(Ok(())) => delivery.ack().await,
                Some(Err(NotApplied::Held)) => delivery.nak(HELD_NAK_DELAY).await,
                _ => delivery.nak(NAK_DELAY).await,
            };
        }
    });
    futures::future::join_all(settled).await;
}
