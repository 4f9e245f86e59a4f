//! The plan of a SKU's rebuild from PostgreSQL after Redis lost it (DESIGN.md section 11),
//! sans-I/O: PostgreSQL's reservations and the events it announced about them, merged into
//! the order they happened in, so that replaying them onto the SKU's total stock through the
//! library's own functions (`restore` for a reservation, then `apply_results` and
//! `compensate` for its events, exactly as redis-sync applied them the first time) gives back
//! what the sale would have left in Redis: stock = total − units still held, a user marker for
//! every buyer holding a reservation or an order, a request record for every request (a
//! same-id retry returns its reservation or order), the compensation markers.
//!
//! Time order matters for the user markers only (a buyer whose first order was cancelled may
//! reserve again): a reservation is replayed at its `reserved_at`, an event at its commit
//! time; at equal times the reservation first (an event always follows its reservation).
//!
//! What it is not: I/O (`shard/failover.rs` runs the plan), or the proof: a reconcile against
//! PostgreSQL after the rebuild decides whether the SKU reopens.
//!
//! Read next: `pg-worker/src/redis_rebuild.rs` (what is read), `lua/seckill.lua::restore`.

use std::collections::HashMap;

use flashsale_io::wire::{decode_event, ReservationEvent};
use flashsale_pg_worker::redis_rebuild::{RebuildSource, RebuiltReservation};

use crate::logic::api::payload_hash;
use crate::logic::ids::{ActivityId, SkuId, UserId};
use crate::logic::placement::SkuKey;

/// One step of the replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<'a> {
    /// Write the reservation as `reserve` did (its payload hash beside it).
    Reserve { reservation: &'a RebuiltReservation, payload_hash: String },
    /// Apply these events (consecutive in time) as redis-sync does.
    Events(Vec<ReservationEvent>),
}

/// What the plan found beside the steps: the operator's anomalies (seed ch9 §11.5 stage 4,
/// "reservations whose state cannot be proven").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanNotes {
    /// Reservations PostgreSQL is still processing: restored as pending (their outcome comes
    /// through redis-sync as usual).
    pub in_flight: Vec<String>,
    /// Final in PostgreSQL without an event to replay (its outcome cannot reach Redis).
    pub without_events: Vec<String>,
    /// Outbox payloads that do not decode (skipped).
    pub undecodable: usize,
}

/// The steps of `source`'s replay, and its notes.
pub fn plan(key: SkuKey, source: &RebuildSource) -> (Vec<Step<'_>>, PlanNotes) {
    let mut notes = PlanNotes::default();
    let mut events: Vec<(u64, ReservationEvent)> = Vec::with_capacity(source.events.len());
    for e in &source.events {
        match decode_event(e.payload.as_bytes()) {
            Ok(event) => events.push((e.created_at_ms, event)),
            Err(_) => notes.undecodable += 1,
        }
    }
    let mut hashes: HashMap<&str, &str> = HashMap::with_capacity(events.len());
    for (_, event) in &events {
        hashes.entry(event.reservation_id.as_str()).or_insert(event.payload_hash.as_str());
    }
    for r in &source.reservations {
        if r.status == "PROCESSING" {
            notes.in_flight.push(r.reservation_id.clone());
        } else if !hashes.contains_key(r.reservation_id.as_str()) {
            notes.without_events.push(r.reservation_id.clone());
        }
    }
    let reserves = source.reservations.iter().map(|r| {
        let hash = hashes.get(r.reservation_id.as_str()).map(|h| (*h).to_owned());
        let hash = hash.unwrap_or_else(|| computed_hash(key, r.user_id, r.quantity));
        (r.reserved_at_ms, r, hash)
    });
    let mut reserves: Vec<_> = reserves.collect();
    reserves.sort_by_key(|(at, r, _)| (*at, r.reservation_id.clone()));
    (merge(reserves, events), notes)
}

/// The two lists, each in its own order, merged by time (a reservation before an event at the
/// same millisecond); consecutive events in one step.
fn merge(
    reserves: Vec<(u64, &RebuiltReservation, String)>,
    events: Vec<(u64, ReservationEvent)>,
) -> Vec<Step<'_>> {
    let mut steps = Vec::with_capacity(reserves.len() + 1);
    let mut events = events.into_iter().peekable();
    for (at, reservation, payload_hash) in reserves {
        push_events_before(&mut steps, &mut events, at);
        steps.push(Step::Reserve { reservation, payload_hash });
    }
    push_events_before(&mut steps, &mut events, u64::MAX);
    if let Some((_, last)) = events.next() {
        // Only events at u64::MAX are left: never a real commit time, kept for completeness.
        let mut rest = vec![last];
        rest.extend(events.map(|(_, e)| e));
        steps.push(Step::Events(rest));
    }
    steps
}

fn push_events_before(
    steps: &mut Vec<Step<'_>>,
    events: &mut std::iter::Peekable<std::vec::IntoIter<(u64, ReservationEvent)>>,
    before_ms: u64,
) {
    let mut run = Vec::new();
    while let Some((_, event)) = events.next_if(|(at, _)| *at < before_ms) {
        run.push(event);
    }
    if !run.is_empty() {
        steps.push(Step::Events(run));
    }
}

/// The payload hash a reservation of `quantity` units has (a reservation PostgreSQL announced
/// nothing about yet has no event to copy it from).
fn computed_hash(key: SkuKey, user_id: u64, quantity: u32) -> String {
    let ids = (ActivityId::new(key.activity_id), SkuId::new(key.sku_id), UserId::new(user_id));
    match ids {
        (Some(a), Some(s), Some(u)) => payload_hash(a, s, u, quantity).as_str().to_owned(),
        // PostgreSQL's ids are positive bigints; a row outside them is written under a hash
        // no request can match, so a retry gets IDEMPOTENCY_CONFLICT, never a second unit.
        _ => "unmatchable".to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use flashsale_io::wire::{EventType, RejectReason};
    use flashsale_pg_worker::redis_rebuild::RebuiltEvent;

    const KEY: SkuKey = SkuKey { activity_id: 7, sku_id: 8 };

    fn reservation(id: &str, user: u64, at: u64, status: &str) -> RebuiltReservation {
        RebuiltReservation {
            reservation_id: id.into(),
            request_id: format!("q-{id}"),
            message_id: format!("m-{id}"),
            user_id: user,
            reserved_at_ms: at,
            expires_at_ms: at + 60_000,
            status: status.into(),
            quantity: 1,
        }
    }

    fn event(id: i64, at: u64, of: &RebuiltReservation, kind: EventType) -> RebuiltEvent {
        let event = ReservationEvent {
            schema_version: 1,
            event_type: kind,
            reservation_id: of.reservation_id.clone(),
            request_id: of.request_id.clone(),
            message_id: of.message_id.clone(),
            payload_hash: format!("h-{}", of.reservation_id),
            activity_id: KEY.activity_id,
            sku_id: KEY.sku_id,
            user_id: of.user_id,
            order_id: matches!(kind, EventType::OrderCreated | EventType::OrderCancelled)
                .then(|| format!("o-{}", of.reservation_id)),
            reason_code: matches!(kind, EventType::Compensate)
                .then_some(RejectReason::NoFinalStock),
            return_stock: false,
            release_user: matches!(kind, EventType::Compensate | EventType::OrderCancelled),
            traceparent: None,
            occurred_at_ms: at,
            quantity: 1,
        };
        RebuiltEvent {
            event_id: id,
            created_at_ms: at,
            payload: String::from_utf8(event.encode()).unwrap(),
        }
    }

    fn shape(steps: &[Step<'_>]) -> Vec<String> {
        steps
            .iter()
            .map(|s| match s {
                Step::Reserve { reservation, .. } => format!("R {}", reservation.reservation_id),
                Step::Events(events) => {
                    let ids: Vec<_> = events.iter().map(|e| e.reservation_id.as_str()).collect();
                    format!("E {}", ids.join(","))
                }
            })
            .collect()
    }

    #[test]
    fn a_buyer_who_reserved_again_after_a_cancel_is_replayed_in_that_order() {
        let first = reservation("r1", 5, 100, "ORDER_CREATED");
        let second = reservation("r2", 5, 400, "ORDER_CREATED");
        let other = reservation("r3", 6, 150, "REJECTED_NO_FINAL_STOCK");
        let source = RebuildSource {
            total_stock: 2,
            reservations: vec![first.clone(), other.clone(), second.clone()],
            events: vec![
                event(1, 120, &first, EventType::OrderCreated),
                event(2, 160, &other, EventType::Compensate),
                event(3, 300, &first, EventType::OrderCancelled),
                event(4, 450, &second, EventType::OrderCreated),
            ],
        };
        let (steps, notes) = plan(KEY, &source);
        assert_eq!(shape(&steps), ["R r1", "E r1", "R r3", "E r3,r1", "R r2", "E r2"]);
        assert_eq!(notes, PlanNotes::default());
        // The payload hash is the one the events carry.
        let Step::Reserve { payload_hash, .. } = &steps[0] else { panic!() };
        assert_eq!(payload_hash, "h-r1");
    }

    #[test]
    fn in_flight_and_unannounced_reservations_are_noted_and_still_replayed() {
        let processing = reservation("r1", 5, 100, "PROCESSING");
        let silent = reservation("r2", 6, 100, "ORDER_CREATED");
        let source = RebuildSource {
            total_stock: 2,
            reservations: vec![processing, silent],
            events: vec![RebuiltEvent { event_id: 1, created_at_ms: 5, payload: "{".into() }],
        };
        let (steps, notes) = plan(KEY, &source);
        assert_eq!(shape(&steps), ["R r1", "R r2"]);
        assert_eq!(notes.in_flight, ["r1"]);
        assert_eq!(notes.without_events, ["r2"]);
        assert_eq!(notes.undecodable, 1);
        // Without an event, the hash a one-unit request of that buyer has.
        let Step::Reserve { payload_hash, .. } = &steps[0] else { panic!() };
        let expected = payload_hash_of(5);
        assert_eq!(payload_hash, &expected);
    }

    fn payload_hash_of(user: u64) -> String {
        let (a, s, u) = (ActivityId(7), SkuId(8), UserId(user));
        payload_hash(a, s, u, 1).as_str().to_owned()
    }
}
