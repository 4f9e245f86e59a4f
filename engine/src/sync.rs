//! `redis-sync` (DESIGN.md section 6): consumes `SECKILL_EVENTS` on the durable side and hands
//! each event to the owner shard of its SKU, which is the only writer of that SKU's Redis keys
//! in this instance: `apply_result` writes the query result (the reservation leaves
//! `pending`), `compensate` undoes what the rejection says (once per reservation), and a
//! returned unit clears the sold-out flag on every shard. The delivery is acked only after the
//! shard applied it; a Redis error NAKs it for redelivery (every step is idempotent).
//!
//! Not here: which Redis effects a rejection undoes (`io::wire::RejectReason::compensation`,
//! decided when the event was written).

use std::rc::Rc;
use std::time::Duration;

use flashsale_io::log::{Delivery, Log, Publisher, REDIS_SYNC_CONSUMER};
use flashsale_io::redis::script::{
    ApplyResultArgs, CompensateArgs, CompensateReply, FinalOutcome, ScriptError,
};
use flashsale_io::wire::{decode_event, EventAction, ReservationEvent};
use futures::channel::oneshot;
use tokio::sync::mpsc;

use crate::router::{PartitionTable, SkuKey};
use crate::shard::{now_ms, Shard};

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

/// Where events go: the partition table and one bounded queue per shard.
#[derive(Clone)]
pub struct SyncTargets {
    pub table: PartitionTable,
    pub shards: Vec<mpsc::Sender<SyncRequest>>,
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

/// The owner shard's side: applies one event to Redis and its local flags.
pub async fn apply(shard: &Rc<Shard>, event: &ReservationEvent) -> Result<(), ScriptError> {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("sync_before_apply");
    let key = SkuKey::new(event.activity_id, event.sku_id);
    let keys = shard.sku_keys(key);
    let action = match event.action() {
        Ok(action) => action,
        // decode_event validated it; an event that lost its fields here is ignored.
        Err(_) => return Ok(()),
    };
    let now = now_ms();
    let result_args = |outcome| ApplyResultArgs {
        request_id: &event.request_id,
        reservation_id: &event.reservation_id,
        outcome,
        now_ms: now,
        payload_hash: &event.payload_hash,
        message_id: &event.message_id,
        user_id: event.user_id,
    };
    match action {
        EventAction::OrderCreated { order_id } => {
            shard
                .functions
                .apply_result(&keys, &result_args(FinalOutcome::OrderCreated { order_id }))
                .await?;
        }
        EventAction::Failed { reason } => {
            let outcome = FinalOutcome::Failed { reason_code: reason.reason_code() };
            shard.functions.apply_result(&keys, &result_args(outcome)).await?;
        }
        EventAction::Compensate { reason, compensation } => {
            let outcome = FinalOutcome::Failed { reason_code: reason.reason_code() };
            shard.functions.apply_result(&keys, &result_args(outcome)).await?;
            let args = CompensateArgs {
                reservation_id: &event.reservation_id,
                request_id: &event.request_id,
                user_id: event.user_id,
                return_stock: compensation.return_stock,
                release_user: compensation.release_user,
                reason_code: reason.reason_code(),
                now_ms: now,
            };
            let reply = shard.functions.compensate(&keys, &args).await?;
            if matches!(reply, CompensateReply::Applied { .. }) {
                shard.metrics().compensations.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            if matches!(reply, CompensateReply::Applied { stock_after } if stock_after > 0)
                && compensation.return_stock
            {
                if let Some(update) = shard.with_partition(key, |p| {
                    if p.key() == key {
                        p.on_stock_returned()
                    } else {
                        None
                    }
                }) {
                    shard.broadcast(update);
                }
            }
        }
        EventAction::Other(flashsale_io::wire::EventType::OrderCancelled) => {
            crate::shard::orders::apply_order_cancelled(shard, event).await?;
        }
        EventAction::Other(_) => {}
    }
    Ok(())
}

/// The shard's receiving end: applies events one task each (bounded by the queue).
pub fn spawn_receiver(shard: &Rc<Shard>, mut rx: mpsc::Receiver<SyncRequest>) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        // tokio's mpsc receiver is runtime-agnostic: it only needs a waker.
        while let Some(request) = rx.recv().await {
            let shard = Rc::clone(&shard);
            glommio::spawn_local(async move {
                let result = apply(&shard, &request.event).await.map_err(|e| e.to_string());
                if let Err(e) = &result {
                    tracing::warn!(error = %e, reservation_id = %request.event.reservation_id, "redis-sync apply failed");
                }
                let _ = request.reply.send(result);
            })
            .detach();
        }
    })
    .detach();
}
