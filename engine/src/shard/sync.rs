//! The owner shard's side of `redis-sync` (DESIGN.md section 6): each event from
//! `durable/sync.rs` is applied to this SKU's Redis keys and local flags (the events of one
//! request at once), and the results go back so each delivery is acked or NAKed:
//!
//! - `order_created`: `apply_result(ORDER_CREATED)` (the reservation leaves `pending`);
//! - `reservation_failed`: `apply_result(FAILED)`;
//! - `compensate`: `apply_result(FAILED)`, then [`compensate`];
//! - `order_cancelled`: [`compensate`] only (the order existed), reason `ORDER_CANCELLED`.
//!
//! [`compensate`] is the one handler of a unit coming back: `compensate` once per reservation
//! (its marker), counted, and a returned unit clears the sold-out flag on every shard of this
//! instance and is announced to the other instances (`durable/notice.rs`).

use std::rc::Rc;
use std::sync::atomic::Ordering;

use flashsale_io::redis::script::{
    ApplyResultArgs, CompensateArgs, CompensateReply, FinalOutcome, ScriptError,
};
use flashsale_io::wire::{Compensation, EventAction, ReservationEvent, ORDER_CANCELLED_REASON};
use tokio::sync::mpsc;

use super::state::Shard;
use crate::durable::sync::SyncRequest;
use crate::durable::DurableRequest;
use crate::logic::clock::now_ms;
use crate::logic::placement::SkuKey;

/// Applies one event to Redis and the local flags.
pub async fn apply(shard: &Rc<Shard>, event: &ReservationEvent) -> Result<(), ScriptError> {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("sync_before_apply");
    let action = match event.action() {
        Ok(action) => action,
        // decode_event validated it; an event that lost its fields here is ignored.
        Err(_) => return Ok(()),
    };
    match action {
        EventAction::OrderCreated { order_id } => {
            apply_result(shard, event, FinalOutcome::OrderCreated { order_id }).await
        }
        EventAction::Failed { reason } => {
            let outcome = FinalOutcome::Failed { reason_code: reason.reason_code() };
            apply_result(shard, event, outcome).await
        }
        EventAction::Compensate { reason, compensation } => {
            let outcome = FinalOutcome::Failed { reason_code: reason.reason_code() };
            apply_result(shard, event, outcome).await?;
            compensate(shard, event, reason.reason_code(), compensation).await
        }
        EventAction::OrderReleased { compensation } => {
            compensate(shard, event, ORDER_CANCELLED_REASON, compensation).await
        }
        EventAction::Other(_) => Ok(()),
    }
}

async fn apply_result(
    shard: &Shard,
    event: &ReservationEvent,
    outcome: FinalOutcome<'_>,
) -> Result<(), ScriptError> {
    assert_final(event, outcome);
    let keys = shard.store.sku_keys(SkuKey::new(event.activity_id, event.sku_id));
    let args = ApplyResultArgs {
        request_id: &event.request_id,
        reservation_id: &event.reservation_id,
        outcome,
        now_ms: now_ms(),
        payload_hash: &event.payload_hash,
        message_id: &event.message_id,
        user_id: event.user_id,
    };
    shard.store.functions.apply_result(&keys, &args).await.map(|_| ())
}

/// INVARIANT (DESIGN.md section 4; kept in release): a reservation leaves `resv:pending` only
/// with its final outcome — an order with its id, or a rejection with its reason.
/// `apply_result` (and `compensate` after it) take it out of `pending`; an outcome without
/// what makes it final would lose the reservation silently (nothing would republish it), so
/// a breach stops the shard before any write (the delivery is then redelivered, not acked).
fn assert_final(event: &ReservationEvent, outcome: FinalOutcome<'_>) {
    let is_final = match outcome {
        FinalOutcome::OrderCreated { order_id } => !order_id.is_empty(),
        FinalOutcome::Failed { reason_code } => !reason_code.is_empty(),
    };
    assert!(
        is_final,
        "invariant breached: reservation {} (request {}, user {}, sku {}:{}) would leave \
         resv:pending without a final outcome ({outcome:?})",
        event.reservation_id, event.request_id, event.user_id, event.activity_id, event.sku_id
    );
}

/// Undoes a reservation's Redis effects once, as `compensation` says; a unit back in stock
/// clears the sold-out flag everywhere.
async fn compensate(
    shard: &Shard,
    event: &ReservationEvent,
    reason_code: &str,
    compensation: Compensation,
) -> Result<(), ScriptError> {
    let key = SkuKey::new(event.activity_id, event.sku_id);
    let keys = shard.store.sku_keys(key);
    let args = CompensateArgs {
        reservation_id: &event.reservation_id,
        request_id: &event.request_id,
        user_id: event.user_id,
        return_stock: compensation.return_stock,
        release_user: compensation.release_user,
        reason_code,
        now_ms: now_ms(),
    };
    let reply = shard.store.functions.compensate(&keys, &args).await?;
    let CompensateReply::Applied { stock_after } = reply else { return Ok(()) };
    shard.metrics().compensations.fetch_add(1, Ordering::Relaxed);
    if compensation.return_stock && stock_after > 0 {
        if let Some(update) = shard.owner.borrow_mut().on_stock_returned(key) {
            shard.mesh.broadcast(update);
        }
        // The other instances' flags (durable/notice.rs); a full queue drops the notice and
        // their periodic stock re-check covers it.
        let _ = shard.shared.durable.try_send(DurableRequest::StockReturned { key });
    }
    Ok(())
}

/// The shard's receiving end: applies each request's events at once, one task per request
/// (bounded by the queue), and answers with every event's result.
pub fn spawn_receiver(shard: &Rc<Shard>, mut rx: mpsc::Receiver<SyncRequest>) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        // tokio's mpsc receiver is runtime-agnostic: it only needs a waker.
        while let Some(request) = rx.recv().await {
            let shard = Rc::clone(&shard);
            glommio::spawn_local(async move {
                let applied = request.events.iter().map(|event| apply_logged(&shard, event));
                let _ = request.reply.send(futures::future::join_all(applied).await);
            })
            .detach();
        }
    })
    .detach();
}

async fn apply_logged(shard: &Rc<Shard>, event: &ReservationEvent) -> Result<(), String> {
    let result = apply(shard, event).await.map_err(|e| e.to_string());
    if let Err(e) = &result {
        tracing::warn!(error = %e, reservation_id = %event.reservation_id, "redis-sync apply failed");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> ReservationEvent {
        let body = br#"{"schema_version":1,"event_type":"order_created","event_id":7,"reservation_id":"resv_1","request_id":"req_1","message_id":"msg_1","activity_id":1,"sku_id":2,"user_id":3,"payload_hash":"h","order_id":"ord_1","occurred_at":"2026-12-02T00:00:00Z"}"#;
        flashsale_io::wire::decode_event(body).expect("a valid event")
    }

    #[test]
    fn a_final_outcome_passes() {
        assert_final(&event(), FinalOutcome::OrderCreated { order_id: "ord_1" });
        assert_final(&event(), FinalOutcome::Failed { reason_code: "EXPIRED" });
    }

    #[test]
    #[should_panic(expected = "would leave resv:pending without a final outcome")]
    fn an_order_without_its_id_stops_the_shard() {
        assert_final(&event(), FinalOutcome::OrderCreated { order_id: "" });
    }

    #[test]
    #[should_panic(expected = "invariant breached: reservation resv_1")]
    fn a_rejection_without_its_reason_stops_the_shard() {
        assert_final(&event(), FinalOutcome::Failed { reason_code: "" });
    }
}
