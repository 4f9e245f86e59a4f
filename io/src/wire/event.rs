//! The reservation events (CONTRACT.md section 6) the outbox publishes to
//! `seckill.event.<type>` for `redis-sync`: [`EventType`], [`RejectReason`] (why PostgreSQL
//! said no, with its reason code and reservation status), [`Compensation`] (which of a
//! reservation's Redis effects `compensate` undoes), [`ReservationEvent`] with its
//! constructors, and [`ReservationEvent::action`], what the event asks `redis-sync` to do.
//!
//! What it is not: I/O, nor a decision. Which outcome a reservation gets is the PostgreSQL
//! worker's (`classify.rs`), and so is which effects each rejection undoes
//! (`pg-worker/src/compensation.rs`): this file carries the flags it is given.
//!
//! Read next: `pg-worker/src/classify.rs` (who builds these events), `engine/src/shard/sync.rs`
//! (who applies them), `lua/seckill.lua` (`apply_result` and `compensate`, which consume their
//! fields).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::decode::{check_bigint, check_id, invalid, newer_schema, DecodeError, SCHEMA_VERSION};
use super::order_create::OrderCreate;
use super::rfc3339::rfc3339_ms;

/// Largest event body accepted. A real one is a few hundred bytes; bounding it bounds what a
/// poisoned event can cost `redis-sync`.
pub const EVENT_BODY_MAX: usize = 4096;

/// The event types of `SECKILL_EVENTS` (CONTRACT.md section 6); also `event_outbox.event_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventType {
    /// The reservation became an order: `redis-sync` calls `apply_result(ORDER_CREATED)`.
    OrderCreated,
    /// The reservation ended without an order and nothing in Redis is to be undone.
    ReservationFailed,
    /// The reservation ended without an order: `redis-sync` calls `apply_result(FAILED)` and
    /// `compensate` with the event's flags.
    Compensate,
    OrderCancelled,
    OrderPaid,
    /// Money arrived for an order that no longer takes it (a payment recorded REFUND_NEEDED):
    /// for the refund job; nothing for Redis. Besides the usual fields its payload carries
    /// `payment_id` and `amount_cents`.
    RefundRequested,
}

impl EventType {
    pub const ALL: [EventType; 6] = [
        EventType::OrderCreated,
        EventType::ReservationFailed,
        EventType::Compensate,
        EventType::OrderCancelled,
        EventType::OrderPaid,
        EventType::RefundRequested,
    ];

    /// The text in `event_outbox.event_type` and the last subject token.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::OrderCreated => "order_created",
            EventType::ReservationFailed => "reservation_failed",
            EventType::Compensate => "compensate",
            EventType::OrderCancelled => "order_cancelled",
            EventType::OrderPaid => "order_paid",
            EventType::RefundRequested => "refund_requested",
        }
    }

    /// The subject the outbox publishes it to.
    pub fn subject(self) -> &'static str {
        match self {
            EventType::OrderCreated => "seckill.event.order_created",
            EventType::ReservationFailed => "seckill.event.reservation_failed",
            EventType::Compensate => "seckill.event.compensate",
            EventType::OrderCancelled => "seckill.event.order_cancelled",
            EventType::OrderPaid => "seckill.event.order_paid",
            EventType::RefundRequested => "seckill.event.refund_requested",
        }
    }

    pub fn parse(text: &str) -> Option<EventType> {
        EventType::ALL.into_iter().find(|t| t.as_str() == text)
    }
}

/// Why PostgreSQL refused to turn a reservation into an order. Serialized as the query API's
/// `reason_code` (CONTRACT.md 3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RejectReason {
    /// No inventory token (or ROW stock) left in PostgreSQL.
    NoFinalStock,
    /// The buyer already has an order for this SKU.
    DuplicateUser,
    /// The message arrived after `reservation_expires_at`.
    Expired,
    /// The activity was terminated (or is unknown to PostgreSQL).
    ActivityTerminated,
}

/// Which of a reservation's Redis effects `compensate` undoes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compensation {
    /// `INCR stock` (and clear sold-out).
    pub return_stock: bool,
    /// Delete the user marker, so the buyer may reserve again.
    pub release_user: bool,
}

impl RejectReason {
    pub const ALL: [RejectReason; 4] = [
        RejectReason::NoFinalStock,
        RejectReason::DuplicateUser,
        RejectReason::Expired,
        RejectReason::ActivityTerminated,
    ];

    /// The query API's `reason_code` and the `compensate` function's `reason_code` argument.
    pub fn reason_code(self) -> &'static str {
        match self {
            RejectReason::NoFinalStock => "NO_FINAL_STOCK",
            RejectReason::DuplicateUser => "DUPLICATE_USER",
            RejectReason::Expired => "EXPIRED",
            RejectReason::ActivityTerminated => "ACTIVITY_TERMINATED",
        }
    }

    /// `inventory_reservation.status` of a reservation rejected for this reason.
    pub fn reservation_status(self) -> &'static str {
        match self {
            RejectReason::NoFinalStock => "REJECTED_NO_FINAL_STOCK",
            RejectReason::DuplicateUser => "REJECTED_DUPLICATE_USER",
            RejectReason::Expired => "REJECTED_EXPIRED",
            RejectReason::ActivityTerminated => "REJECTED_ACTIVITY",
        }
    }

    pub fn from_reservation_status(status: &str) -> Option<RejectReason> {
        RejectReason::ALL.into_iter().find(|r| r.reservation_status() == status)
    }

    pub fn from_reason_code(code: &str) -> Option<RejectReason> {
        RejectReason::ALL.into_iter().find(|r| r.reason_code() == code)
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason_code())
    }
}

/// One outbox event about one reservation: everything `redis-sync` needs to call
/// `apply_result` and `compensate` (KEYS are built from activity_id, sku_id, request_id,
/// reservation_id and user_id; `payload_hash`/`message_id` recreate a `req` hash Redis lost).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationEvent {
    pub schema_version: u32,
    pub event_type: EventType,
    pub reservation_id: String,
    pub request_id: String,
    pub message_id: String,
    pub payload_hash: String,
    pub activity_id: u64,
    pub sku_id: u64,
    pub user_id: u64,
    /// The reservation's units (what a compensation with `return_stock` gives back); 1 in an
    /// event written before quantities.
    #[serde(default = "one_unit")]
    pub quantity: u32,
    /// Set for `order_created` (and order events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_id: Option<String>,
    /// Set for `compensate` / `reservation_failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason_code: Option<RejectReason>,
    /// `compensate` flags (false elsewhere).
    #[serde(default)]
    pub return_stock: bool,
    #[serde(default)]
    pub release_user: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(rename = "occurred_at", with = "rfc3339_ms")]
    pub occurred_at_ms: u64,
}

/// What an event asks `redis-sync` to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventAction<'a> {
    /// `apply_result(ORDER_CREATED, order_id)`.
    OrderCreated { order_id: &'a str },
    /// `apply_result(FAILED, reason)` and then `compensate(reason, flags)`.
    Compensate { reason: RejectReason, compensation: Compensation },
    /// `apply_result(FAILED, reason)` only.
    Failed { reason: RejectReason },
    /// `order_cancelled` (a buyer's cancel or the pay-timeout closer): the order existed, so
    /// no `apply_result`; `compensate` once with [`ORDER_CANCELLED_REASON`] and the event's
    /// flags (whether the unit returns to sale is the activity's release policy).
    OrderReleased { compensation: Compensation },
    /// Nothing for Redis (`order_paid`, `refund_requested`).
    Other(EventType),
}

/// The `reason_code` a released (cancelled or closed) order's reservation gets in Redis: the
/// query answers `FAILED` with it (CONTRACT.md 3.4).
pub const ORDER_CANCELLED_REASON: &str = "ORDER_CANCELLED";

impl ReservationEvent {
    fn base(message: &OrderCreate, event_type: EventType, now_ms: u64) -> ReservationEvent {
        ReservationEvent {
            schema_version: SCHEMA_VERSION,
            event_type,
            reservation_id: message.reservation_id.clone(),
            request_id: message.request_id.clone(),
            message_id: message.message_id.clone(),
            payload_hash: message.payload_hash.clone(),
            activity_id: message.activity_id,
            sku_id: message.sku_id,
            user_id: message.user_id,
            quantity: message.quantity,
            order_id: None,
            reason_code: None,
            return_stock: false,
            release_user: false,
            traceparent: message.traceparent.clone(),
            occurred_at_ms: now_ms,
        }
    }

    /// `order_created` for the reservation of `message`.
    pub fn order_created(message: &OrderCreate, order_id: &str, now_ms: u64) -> ReservationEvent {
        let mut event = ReservationEvent::base(message, EventType::OrderCreated, now_ms);
        event.order_id = Some(order_id.to_owned());
        event
    }

    /// `compensate` for a reservation rejected for `reason`, with the flags its caller decided
    /// (which effects a rejection undoes is the worker's rule: `flashsale_pg_worker::compensation`,
    /// whose `ReservationEvent::rejected` calls this).
    pub fn compensate(
        message: &OrderCreate,
        reason: RejectReason,
        compensation: Compensation,
        now_ms: u64,
    ) -> ReservationEvent {
        let mut event = ReservationEvent::base(message, EventType::Compensate, now_ms);
        event.reason_code = Some(reason);
        event.return_stock = compensation.return_stock;
        event.release_user = compensation.release_user;
        event
    }

    pub fn encode(&self) -> Vec<u8> {
        // A struct of strings, integers and booleans always serializes.
        match serde_json::to_vec(self) {
            Ok(body) => body,
            Err(e) => unreachable!("serializing ReservationEvent into memory failed: {e}"),
        }
    }

    /// What `redis-sync` must do, after checking the fields the action needs.
    pub fn action(&self) -> Result<EventAction<'_>, DecodeError> {
        match self.event_type {
            EventType::OrderCreated => {
                let order_id = self
                    .order_id
                    .as_deref()
                    .ok_or(invalid("order_id", "required for order_created"))?;
                check_id(order_id, "order_id")?;
                Ok(EventAction::OrderCreated { order_id })
            }
            EventType::Compensate => {
                let reason =
                    self.reason_code.ok_or(invalid("reason_code", "required for compensate"))?;
                let compensation = Compensation {
                    return_stock: self.return_stock,
                    release_user: self.release_user,
                };
                Ok(EventAction::Compensate { reason, compensation })
            }
            EventType::ReservationFailed => {
                let reason = self
                    .reason_code
                    .ok_or(invalid("reason_code", "required for reservation_failed"))?;
                Ok(EventAction::Failed { reason })
            }
            EventType::OrderCancelled => {
                let compensation = Compensation {
                    return_stock: self.return_stock,
                    release_user: self.release_user,
                };
                Ok(EventAction::OrderReleased { compensation })
            }
            other @ (EventType::OrderPaid | EventType::RefundRequested) => {
                Ok(EventAction::Other(other))
            }
        }
    }

    pub fn validate(&self) -> Result<(), DecodeError> {
        check_id(&self.reservation_id, "reservation_id")?;
        check_id(&self.request_id, "request_id")?;
        check_id(&self.message_id, "message_id")?;
        check_id(&self.payload_hash, "payload_hash")?;
        check_bigint(self.activity_id, "activity_id")?;
        check_bigint(self.sku_id, "sku_id")?;
        check_bigint(self.user_id, "user_id")?;
        if !(1..=crate::bounds::QUANTITY_MAX).contains(&self.quantity) {
            return Err(invalid("quantity", "must be 1..=QUANTITY_MAX"));
        }
        self.action().map(|_| ())
    }
}

fn one_unit() -> u32 {
    1
}

/// Decodes and validates an event body (for `redis-sync`).
pub fn decode_event(body: &[u8]) -> Result<ReservationEvent, DecodeError> {
    if body.len() > EVENT_BODY_MAX {
        return Err(DecodeError::TooLarge { len: body.len(), max: EVENT_BODY_MAX });
    }
    match serde_json::from_slice::<ReservationEvent>(body) {
        Ok(event) => {
            if u64::from(event.schema_version) > u64::from(SCHEMA_VERSION) {
                return Err(DecodeError::UnknownSchema {
                    version: u64::from(event.schema_version),
                });
            }
            if event.schema_version == 0 {
                return Err(invalid("schema_version", "must be at least 1"));
            }
            event.validate()?;
            Ok(event)
        }
        Err(e) => Err(newer_schema(body).unwrap_or_else(|| DecodeError::Malformed(e.to_string()))),
    }
}

#[cfg(test)]
mod tests {
    use super::super::order_create::tests::{sample, T0};
    use super::*;

    #[test]
    fn reason_names_round_trip() {
        for r in RejectReason::ALL {
            assert_eq!(RejectReason::from_reason_code(r.reason_code()), Some(r));
            assert_eq!(RejectReason::from_reservation_status(r.reservation_status()), Some(r));
            let json = serde_json::to_string(&r).expect("json");
            assert_eq!(json, format!("\"{}\"", r.reason_code()));
        }
        for t in EventType::ALL {
            assert_eq!(EventType::parse(t.as_str()), Some(t));
            assert_eq!(t.subject(), format!("seckill.event.{}", t.as_str()));
            assert_eq!(serde_json::to_string(&t).expect("json"), format!("\"{}\"", t.as_str()));
        }
    }

    #[test]
    fn events_carry_what_redis_sync_needs() {
        let m = sample();
        let created = ReservationEvent::order_created(&m, "ord_1", T0 + 5);
        let decoded = decode_event(&created.encode()).expect("decodes");
        assert_eq!(decoded, created);
        assert_eq!(decoded.action(), Ok(EventAction::OrderCreated { order_id: "ord_1" }));
        assert_eq!(decoded.payload_hash, m.payload_hash);
        assert_eq!(decoded.message_id, m.message_id);
        assert_eq!(decoded.request_id, m.request_id);
        assert_eq!(decoded.traceparent, m.traceparent);

        let flags = Compensation { return_stock: false, release_user: true };
        let rejected = ReservationEvent::compensate(&m, RejectReason::NoFinalStock, flags, T0 + 5);
        let text = String::from_utf8(rejected.encode()).expect("utf8");
        assert!(text.contains(r#""event_type":"compensate""#), "{text}");
        assert!(text.contains(r#""reason_code":"NO_FINAL_STOCK""#), "{text}");
        assert!(text.contains(r#""return_stock":false"#), "{text}");
        assert!(text.contains(r#""release_user":true"#), "{text}");
        let decoded = decode_event(text.as_bytes()).expect("decodes");
        assert_eq!(
            decoded.action(),
            Ok(EventAction::Compensate {
                reason: RejectReason::NoFinalStock,
                compensation: Compensation { return_stock: false, release_user: true },
            })
        );

        let mut broken = created;
        broken.order_id = None;
        assert!(matches!(decode_event(&broken.encode()), Err(DecodeError::Invalid { .. })));
    }
}
