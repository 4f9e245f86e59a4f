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
//! instance and is announced to the other instances (`durable/notice.rs`), and recorded as a
//! span under the context its event carries (`spans.rs`).

use std::rc::Rc;
use std::sync::atomic::Ordering;

use flashsale_io::redis::script::{
    ApplyResultArgs, ApplyResultReply, CompensateArgs, CompensateReply, FinalOutcome, ScriptError,
};
use flashsale_io::wire::{Compensation, EventAction, ReservationEvent, ORDER_CANCELLED_REASON};
use tokio::sync::mpsc;

use super::spans;
use super::state::Shard;
use crate::durable::sync::{NotApplied, SyncRequest};
use crate::durable::DurableRequest;
use crate::logic::clock::now_ms;
use crate::logic::placement::SkuKey;
use crate::logic::sku_funnel::Stage;

/// Whose events [`apply_all`] applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applying {
    /// redis-sync's: each a new fact, counted in the metrics.
    Live,
    /// A rebuild's replay of history (`rebuild.rs`): the same writes, counted nowhere (they
    /// were counted when they happened).
    Replay,
}

/// Applies the events of one request to Redis and the local flags; one result per event, in
/// order. The final outcomes go first, one `apply_results` call per SKU (a fetch's events for
/// a SKU in one round trip), then the compensations, each after its event's outcome.
pub async fn apply_all(
    shard: &Shard,
    events: &[ReservationEvent],
    applying: Applying,
) -> Vec<Result<(), String>> {
    let actions: Vec<Option<EventAction<'_>>> = events
        .iter()
        .map(|event| {
            #[cfg(feature = "failpoints")]
            fail::fail_point!("sync_before_apply");
            // decode_event validated it; an event that lost its fields here is ignored.
            event.action().ok()
        })
        .collect();
    let mut results: Vec<Result<(), String>> = vec![Ok(()); events.len()];
    let outcomes = actions.iter().enumerate().filter_map(|(i, action)| {
        let outcome = match (*action)? {
            EventAction::OrderCreated { order_id } => FinalOutcome::OrderCreated { order_id },
            EventAction::Failed { reason } | EventAction::Compensate { reason, .. } => {
                FinalOutcome::Failed { reason_code: reason.reason_code() }
            }
            EventAction::OrderReleased { .. } | EventAction::Other(_) => return None,
        };
        Some((i, outcome))
    });
    apply_results(shard, events, outcomes.collect(), &mut results, applying).await;
    let compensations = actions.iter().enumerate().filter_map(|(i, action)| {
        let (reason_code, compensation) = match (*action)? {
            EventAction::Compensate { reason, compensation } => {
                (reason.reason_code(), compensation)
            }
            EventAction::OrderReleased { compensation } => (ORDER_CANCELLED_REASON, compensation),
            _ => return None,
        };
        // A compensation follows its event's outcome, never precedes it.
        results[i].is_ok().then_some((i, reason_code, compensation))
    });
    let compensated = compensations
        .map(|(i, reason_code, compensation)| async move {
            (i, compensate(shard, &events[i], reason_code, compensation, applying).await)
        })
        .collect::<Vec<_>>();
    for (i, result) in futures::future::join_all(compensated).await {
        results[i] = result.map_err(|e| logged(&events[i], &e));
    }
    results
}

/// The final outcomes (`(event index, outcome)`) of every SKU they name, one call per SKU,
/// the SKUs at once; each event's result goes into `results`.
async fn apply_results(
    shard: &Shard,
    events: &[ReservationEvent],
    outcomes: Vec<(usize, FinalOutcome<'_>)>,
    results: &mut [Result<(), String>],
    applying: Applying,
) {
    let mut per_sku: Vec<(SkuKey, Vec<(usize, ApplyResultArgs<'_>)>)> = Vec::new();
    let now = now_ms();
    for (i, outcome) in outcomes {
        let event = &events[i];
        assert_final(event, outcome);
        let key = SkuKey::new(event.activity_id, event.sku_id);
        let args = ApplyResultArgs {
            request_id: &event.request_id,
            reservation_id: &event.reservation_id,
            outcome,
            now_ms: now,
            payload_hash: &event.payload_hash,
            message_id: &event.message_id,
            user_id: event.user_id,
        };
        match per_sku.iter_mut().find(|(k, _)| *k == key) {
            Some((_, batch)) => batch.push((i, args)),
            None => per_sku.push((key, vec![(i, args)])),
        }
    }
    let calls = per_sku.into_iter().map(|(key, batch)| async move {
        let keys = shard.store.sku_keys(key);
        let args: Vec<ApplyResultArgs<'_>> = batch.iter().map(|(_, a)| *a).collect();
        (batch, shard.store.functions.apply_results(&keys, &args).await)
    });
    for (batch, applied) in futures::future::join_all(calls).await {
        match applied {
            Ok(replies) => {
                for ((i, args), reply) in batch.iter().zip(replies) {
                    results[*i] = match reply {
                        Ok(applied) => {
                            if applying == Applying::Live {
                                count_order(shard, &events[*i], args.outcome, applied);
                            }
                            // Its outcome is in Redis now: no mark of its message is needed.
                            shard.publish.outcome_recorded(args.reservation_id);
                            Ok(())
                        }
                        Err(e) => Err(logged(&events[*i], &e)),
                    };
                }
            }
            Err(e) => {
                for (i, _) in &batch {
                    results[*i] = Err(logged(&events[*i], &e));
                }
            }
        }
    }
}

/// An order's outcome recorded for the first time counts in the SKU's funnel (a repeat of the
/// same event answers `Already` and is not counted again).
fn count_order(
    shard: &Shard,
    event: &ReservationEvent,
    outcome: FinalOutcome<'_>,
    applied: ApplyResultReply,
) {
    if matches!(outcome, FinalOutcome::OrderCreated { .. }) && applied == ApplyResultReply::Applied
    {
        let key = SkuKey::new(event.activity_id, event.sku_id);
        shard.shared.sku_funnel.count(shard.id, key, Stage::Orders);
    }
}

fn logged(event: &ReservationEvent, e: &ScriptError) -> String {
    tracing::warn!(error = %e, reservation_id = %event.reservation_id, "redis-sync apply failed");
    e.to_string()
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
    applying: Applying,
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
        units: event.quantity,
    };
    let started = std::time::SystemTime::now();
    let reply = shard.store.functions.compensate(&keys, &args).await;
    if applying == Applying::Live {
        let traces = &shard.shared.traces;
        spans::compensation(traces, event, reason_code, compensation, started, &reply);
    }
    let CompensateReply::Applied { stock_after } = reply? else { return Ok(()) };
    if applying == Applying::Live {
        shard.metrics().compensations.fetch_add(1, Ordering::Relaxed);
        shard.shared.sku_funnel.count(shard.id, key, Stage::Compensations);
    }
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

/// The shard's receiving end: applies each request's events together, one task per request
/// (bounded by the queue), and answers with every event's result.
pub fn spawn_receiver(shard: &Rc<Shard>, mut rx: mpsc::Receiver<SyncRequest>) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        // tokio's mpsc receiver is runtime-agnostic: it only needs a waker.
        while let Some(request) = rx.recv().await {
            let shard = Rc::clone(&shard);
            glommio::spawn_local(async move {
                let _ = request.reply.send(apply_unless_held(&shard, request.events).await);
            })
            .detach();
        }
    })
    .detach();
}

/// [`apply_all`] for the events whose SKU is not held; the others answer
/// [`NotApplied::Held`]: their SKU lost its keys and is not rebuilt yet (`rebuild.rs` replays
/// what PostgreSQL committed; an event applied meanwhile could be wiped or overwritten).
async fn apply_unless_held(
    shard: &Shard,
    events: Vec<ReservationEvent>,
) -> Vec<Result<(), NotApplied>> {
    let held: Vec<bool> = {
        let owner = shard.owner.borrow();
        events.iter().map(|e| owner.holds_events(SkuKey::new(e.activity_id, e.sku_id))).collect()
    };
    let (held_events, applied): (Vec<_>, Vec<_>) =
        events.into_iter().zip(&held).partition(|(_, held)| **held);
    drop(held_events);
    let applied: Vec<ReservationEvent> = applied.into_iter().map(|(e, _)| e).collect();
    let mut results = apply_all(shard, &applied, Applying::Live).await.into_iter();
    held.iter()
        .map(|held| match held {
            true => Err(NotApplied::Held),
            false => match results.next() {
                Some(Ok(())) => Ok(()),
                Some(Err(e)) => Err(NotApplied::Failed(e)),
                None => Err(NotApplied::Failed("no result".into())),
            },
        })
        .collect()
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
