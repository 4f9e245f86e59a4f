//! The message schemas of the replicated log (CONTRACT.md section 6): the order-create message
//! the edge publishes to `seckill.order.create`, and the reservation events the outbox
//! publishes to `seckill.event.<type>` for `redis-sync`.
//!
//! What it is: serde types, their validation, the decode errors the worker routes to the DLQ
//! ([`DecodeError`]: all permanent), the RFC 3339 timestamp text both schemas use, and ONE
//! business mapping: which of a reservation's Redis effects a rejection undoes
//! ([`RejectReason::compensation`]).
//!
//! What it is not: I/O. Nothing here publishes, reads a clock or touches a store; times are
//! milliseconds since the Unix epoch passed in by the caller. Publishing with `Nats-Msg-Id` is
//! [`crate::jetstream`]; deciding an outcome is the PostgreSQL worker's.
//!
//! Compatibility: unknown JSON fields are ignored (a newer producer may add fields); a
//! `schema_version` higher than [`SCHEMA_VERSION`] is a distinct error
//! ([`DecodeError::UnknownSchema`]) so that a consumer never half-understands a message it
//! cannot read: the worker dead-letters it instead.
//!
//! Read next: `jetstream/` (subjects, headers, publishing), `pg-worker/src/order_writer.rs` (who
//! decodes order-create messages and builds the events), `lua/seckill.lua` (`apply_result` and
//! `compensate`, which consume the events' fields).

use std::fmt;

use serde::{Deserialize, Serialize};

/// The schema version this build writes and the highest it reads.
pub const SCHEMA_VERSION: u32 = 1;

/// `event_type` of every order-create message.
pub const ORDER_CREATE_EVENT_TYPE: &str = "SECKILL_ORDER_CREATE_REQUESTED";

/// Longest id accepted in a message (the Redis library's bound, `io::redis::script::ID_LEN_MAX`,
/// so every id that passes here can also be written to Redis by `redis-sync`).
pub const ID_LEN_MAX: usize = crate::redis::script::ID_LEN_MAX;

/// Largest order-create body accepted. A real one is about 500 bytes; anything much larger is
/// not ours, and bounding it bounds what a poisoned message can cost the worker.
pub const ORDER_CREATE_BODY_MAX: usize = 4096;

/// Largest event body accepted (same reasoning).
pub const EVENT_BODY_MAX: usize = 4096;

/// The prefix every reservation id carries (CONTRACT.md section 7). The worker derives the
/// order id from it (`resv_X` → `ord_X`), which is only injective if every id has it.
pub const RESERVATION_ID_PREFIX: &str = "resv_";

/// Prefix of order ids.
pub const ORDER_ID_PREFIX: &str = "ord_";

/// Largest id a PostgreSQL `bigint` holds; activity, SKU and user ids must fit.
const PG_BIGINT_MAX: u64 = i64::MAX as u64;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a body is not a message this build can act on. Every variant is permanent: the same
/// bytes fail the same way on every delivery, so the worker dead-letters them at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("body of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    /// Not JSON, or a required field missing or of the wrong type.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// A `schema_version` newer than this build understands.
    #[error("unknown schema_version {version} (this build reads up to {SCHEMA_VERSION})")]
    UnknownSchema { version: u64 },
    /// Well-formed JSON whose field violates the contract.
    #[error("invalid field {field}: {reason}")]
    Invalid { field: &'static str, reason: &'static str },
}

impl DecodeError {
    /// Always false: see the type's documentation. Present so callers can treat every error
    /// of the pipeline alike.
    pub fn is_transient(&self) -> bool {
        false
    }
}

// ---------------------------------------------------------------------------------------------
// Order-create message
// ---------------------------------------------------------------------------------------------

/// The order-create message (CONTRACT.md section 6). Times are milliseconds since the Unix
/// epoch in memory and RFC 3339 text (`2026-06-25T19:00:00.123Z`) on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCreate {
    pub schema_version: u32,
    /// Always [`ORDER_CREATE_EVENT_TYPE`].
    pub event_type: String,
    /// `msg_…`; the `Nats-Msg-Id` of every (re)publish and the inbox key.
    pub message_id: String,
    /// The partitioning key (the reservation id).
    pub message_key: String,
    pub request_id: String,
    /// `resv_…`.
    pub reservation_id: String,
    pub activity_id: u64,
    pub sku_id: u64,
    pub user_id: u64,
    /// Must be 1 (CONTRACT.md 3.2).
    pub quantity: u32,
    #[serde(rename = "reserved_at", with = "rfc3339_ms")]
    pub reserved_at_ms: u64,
    #[serde(rename = "reservation_expires_at", with = "rfc3339_ms")]
    pub reservation_expires_at_ms: u64,
    /// How often the scanner republished it (observation only).
    pub retry_count: u32,
    /// `sha256:…` of the request payload; `redis-sync` needs it to recreate a lost `req`.
    pub payload_hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(rename = "created_at", with = "rfc3339_ms")]
    pub created_at_ms: u64,
}

/// Everything a reservation fixed when it was made, from which its order-create message is
/// built: on the first publish from `reserve`'s answer, on a republish from the `resv`
/// record. The same facts give the same message in every business id.
#[derive(Debug, Clone, Copy)]
pub struct ReservationFacts<'a> {
    pub message_id: &'a str,
    pub reservation_id: &'a str,
    pub request_id: &'a str,
    pub activity_id: u64,
    pub sku_id: u64,
    pub user_id: u64,
    pub reserved_at_ms: u64,
    pub expires_at_ms: u64,
    pub payload_hash: &'a str,
    pub traceparent: Option<&'a str>,
    /// How often it was sent before (0 on the first publish).
    pub send_attempts: u32,
}

impl OrderCreate {
    /// THE constructor of the order-create message (first publish and every republish).
    pub fn for_reservation(facts: &ReservationFacts<'_>, now_ms: u64) -> OrderCreate {
        OrderCreate {
            schema_version: SCHEMA_VERSION,
            event_type: ORDER_CREATE_EVENT_TYPE.to_owned(),
            message_id: facts.message_id.to_owned(),
            message_key: facts.reservation_id.to_owned(),
            request_id: facts.request_id.to_owned(),
            reservation_id: facts.reservation_id.to_owned(),
            activity_id: facts.activity_id,
            sku_id: facts.sku_id,
            user_id: facts.user_id,
            quantity: 1,
            reserved_at_ms: facts.reserved_at_ms,
            reservation_expires_at_ms: facts.expires_at_ms,
            retry_count: facts.send_attempts,
            payload_hash: facts.payload_hash.to_owned(),
            traceparent: facts.traceparent.map(str::to_owned),
            created_at_ms: now_ms,
        }
    }

    /// The JSON body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        self.encode_into(&mut out);
        out
    }

    /// Appends the JSON body to `out` (reuse one buffer per publisher).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        // Serializing a struct of strings and integers into a Vec cannot fail.
        if let Err(e) = serde_json::to_writer(&mut *out, self) {
            unreachable!("serializing OrderCreate into memory failed: {e}");
        }
    }

    /// Checks every field against the contract. [`decode_order_create`] calls it; a producer
    /// should call it before publishing.
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.schema_version == 0 {
            return Err(invalid("schema_version", "must be at least 1"));
        }
        if self.event_type != ORDER_CREATE_EVENT_TYPE {
            return Err(invalid("event_type", "must be SECKILL_ORDER_CREATE_REQUESTED"));
        }
        check_id(&self.message_id, "message_id")?;
        check_id(&self.message_key, "message_key")?;
        check_id(&self.request_id, "request_id")?;
        check_id(&self.reservation_id, "reservation_id")?;
        if !self.reservation_id.starts_with(RESERVATION_ID_PREFIX)
            || self.reservation_id.len() == RESERVATION_ID_PREFIX.len()
        {
            return Err(invalid("reservation_id", "must be resv_ followed by an id"));
        }
        check_bigint(self.activity_id, "activity_id")?;
        check_bigint(self.sku_id, "sku_id")?;
        check_bigint(self.user_id, "user_id")?;
        if self.quantity != 1 {
            return Err(invalid("quantity", "must be 1"));
        }
        if self.reservation_expires_at_ms <= self.reserved_at_ms {
            return Err(invalid("reservation_expires_at", "must be after reserved_at"));
        }
        check_id(&self.payload_hash, "payload_hash")?;
        if let Some(traceparent) = &self.traceparent {
            check_id(traceparent, "traceparent")?;
        }
        Ok(())
    }

    /// The id of the order this reservation becomes: `resv_X` → `ord_X`. Deterministic, so a
    /// retried transaction never mints a second business id for one reservation (DESIGN.md
    /// section 2), and injective because every reservation id carries the `resv_` prefix
    /// (checked by [`OrderCreate::validate`]).
    pub fn order_id(&self) -> String {
        let suffix =
            self.reservation_id.strip_prefix(RESERVATION_ID_PREFIX).unwrap_or(&self.reservation_id);
        let mut id = String::with_capacity(ORDER_ID_PREFIX.len() + suffix.len());
        id.push_str(ORDER_ID_PREFIX);
        id.push_str(suffix);
        id
    }
}

/// Decodes and validates an order-create body. Errors are permanent (see [`DecodeError`]).
pub fn decode_order_create(body: &[u8]) -> Result<OrderCreate, DecodeError> {
    if body.len() > ORDER_CREATE_BODY_MAX {
        return Err(DecodeError::TooLarge { len: body.len(), max: ORDER_CREATE_BODY_MAX });
    }
    match serde_json::from_slice::<OrderCreate>(body) {
        Ok(message) => {
            if u64::from(message.schema_version) > u64::from(SCHEMA_VERSION) {
                return Err(DecodeError::UnknownSchema {
                    version: u64::from(message.schema_version),
                });
            }
            message.validate()?;
            Ok(message)
        }
        Err(e) => Err(newer_schema(body).unwrap_or_else(|| DecodeError::Malformed(e.to_string()))),
    }
}

/// A newer schema may have changed the shape so much that the full decode fails; look at
/// `schema_version` alone so that such a message is reported as "unknown schema", not as
/// garbage.
fn newer_schema(body: &[u8]) -> Option<DecodeError> {
    #[derive(Deserialize)]
    struct Probe {
        schema_version: u64,
    }
    let probe: Probe = serde_json::from_slice(body).ok()?;
    (probe.schema_version > u64::from(SCHEMA_VERSION))
        .then_some(DecodeError::UnknownSchema { version: probe.schema_version })
}

// ---------------------------------------------------------------------------------------------
// Reservation events (the outbox)
// ---------------------------------------------------------------------------------------------

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

    /// THE mapping from a rejection to the Redis effects it undoes (DESIGN.md section 5). The
    /// reservation took one unit of Redis stock and set the buyer's user marker; which of the
    /// two to give back depends on why PostgreSQL said no:
    ///
    /// - expired / activity terminated: the unit is sellable again and the buyer may try
    ///   again: return stock, release the user.
    /// - no final stock: PostgreSQL has nothing left, so the Redis unit must stay taken (the
    ///   SKU stays sold out); the buyer got nothing and may try again: release the user only.
    /// - duplicate user: the buyer already holds an order, so the user marker is right and
    ///   stays; this reservation's unit was never used: return stock only.
    pub fn compensation(self) -> Compensation {
        match self {
            RejectReason::Expired | RejectReason::ActivityTerminated => {
                Compensation { return_stock: true, release_user: true }
            }
            RejectReason::NoFinalStock => Compensation { return_stock: false, release_user: true },
            RejectReason::DuplicateUser => Compensation { return_stock: true, release_user: false },
        }
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

    /// `compensate` for a rejected reservation, its flags from [`RejectReason::compensation`].
    pub fn rejected(message: &OrderCreate, reason: RejectReason, now_ms: u64) -> ReservationEvent {
        let mut event = ReservationEvent::base(message, EventType::Compensate, now_ms);
        let compensation = reason.compensation();
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
        self.action().map(|_| ())
    }
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

// ---------------------------------------------------------------------------------------------
// Field checks
// ---------------------------------------------------------------------------------------------

fn invalid(field: &'static str, reason: &'static str) -> DecodeError {
    DecodeError::Invalid { field, reason }
}

/// 1..=[`ID_LEN_MAX`] bytes of visible ASCII. Control characters and NUL would be refused by
/// PostgreSQL `text` or break a NATS header line; non-ASCII ids are not ours.
fn check_id(id: &str, field: &'static str) -> Result<(), DecodeError> {
    if id.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    if id.len() > ID_LEN_MAX {
        return Err(invalid(field, "longer than ID_LEN_MAX"));
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(field, "must be visible ASCII"));
    }
    Ok(())
}

fn check_bigint(value: u64, field: &'static str) -> Result<(), DecodeError> {
    if value == 0 || value > PG_BIGINT_MAX {
        return Err(invalid(field, "must be within 1..=i64::MAX"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// RFC 3339 timestamps
// ---------------------------------------------------------------------------------------------

/// Length of the text [`format_rfc3339_ms`] writes: `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub const RFC3339_MS_LEN: usize = 24;

/// Latest time representable in the four-digit-year text: 9999-12-31T23:59:59.999Z.
pub const RFC3339_MS_MAX: u64 = 253_402_300_799_999;

/// Writes `unix_ms` as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC, millisecond precision) into a stack
/// buffer. Times past [`RFC3339_MS_MAX`] are clamped to it.
pub fn format_rfc3339_ms(unix_ms: u64) -> Rfc3339 {
    let unix_ms = unix_ms.min(RFC3339_MS_MAX);
    let millis = unix_ms % 1000;
    let secs = unix_ms / 1000;
    // Bounded by RFC3339_MS_MAX, so the day count fits an i64 trivially.
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let second_of_day = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let mut bytes = *b"0000-00-00T00:00:00.000Z";
    let put = |bytes: &mut [u8; RFC3339_MS_LEN], at: usize, width: usize, mut value: u64| {
        for i in (0..width).rev() {
            bytes[at + i] = b'0' + (value % 10) as u8;
            value /= 10;
        }
    };
    put(&mut bytes, 0, 4, u64::try_from(year).unwrap_or(0));
    put(&mut bytes, 5, 2, u64::from(month));
    put(&mut bytes, 8, 2, u64::from(day));
    put(&mut bytes, 11, 2, second_of_day / 3600);
    put(&mut bytes, 14, 2, second_of_day / 60 % 60);
    put(&mut bytes, 17, 2, second_of_day % 60);
    put(&mut bytes, 20, 3, millis);
    Rfc3339 { bytes }
}

/// A formatted timestamp on the stack; derefs to `&str`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Rfc3339 {
    bytes: [u8; RFC3339_MS_LEN],
}

impl Rfc3339 {
    pub fn as_str(&self) -> &str {
        // Only ASCII digits and separators are ever written.
        std::str::from_utf8(&self.bytes).unwrap_or("1970-01-01T00:00:00.000Z")
    }
}

impl std::ops::Deref for Rfc3339 {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Debug for Rfc3339 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parses an RFC 3339 date-time (`2026-06-25T19:00:00.123Z`, `…T19:00:00Z`,
/// `…T21:00:00+02:00`; `t`/space separators and a lowercase `z` accepted) into milliseconds
/// since the Unix epoch. Digits past milliseconds are truncated. `None` for anything else,
/// including times before 1970, leap seconds and impossible dates.
pub fn parse_rfc3339_ms(text: &str) -> Option<u64> {
    let b = text.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let num = |range: std::ops::Range<usize>| -> Option<u32> {
        let digits = b.get(range)?;
        let mut value = 0u32;
        for &d in digits {
            if !d.is_ascii_digit() {
                return None;
            }
            value = value * 10 + u32::from(d - b'0');
        }
        Some(value)
    };
    let year = num(0..4)?;
    let month = num(5..7)?;
    let day = num(8..10)?;
    let hour = num(11..13)?;
    let minute = num(14..16)?;
    let second = num(17..19)?;
    if b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    if !(1..=12).contains(&month) || day == 0 || day > days_in_month(year, month) {
        return None;
    }
    if hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let mut at = 19;
    let mut millis = 0u32;
    if b.get(at) == Some(&b'.') {
        at += 1;
        let start = at;
        while at < b.len() && b[at].is_ascii_digit() {
            if at - start < 3 {
                millis = millis * 10 + u32::from(b[at] - b'0');
            }
            at += 1;
        }
        let digits = at - start;
        if digits == 0 {
            return None;
        }
        for _ in digits..3 {
            millis *= 10;
        }
    }
    let offset_secs: i64 = match b.get(at)? {
        b'Z' | b'z' if at + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if at + 6 == b.len() && b[at + 3] == b':' => {
            let oh = num(at + 1..at + 3)?;
            let om = num(at + 4..at + 6)?;
            if oh > 23 || om > 59 {
                return None;
            }
            let magnitude = i64::from(oh * 3600 + om * 60);
            if *sign == b'+' {
                magnitude
            } else {
                -magnitude
            }
        }
        _ => return None,
    };
    let days = days_from_civil(i64::from(year), month, day);
    let local = days * 86_400 + i64::from(hour * 3600 + minute * 60 + second);
    let utc_secs = local - offset_secs;
    let ms = utc_secs.checked_mul(1000)?.checked_add(i64::from(millis))?;
    u64::try_from(ms).ok()
}

fn is_leap(year: u32) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        2 => 28,
        _ => 0,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `#[serde(with = "rfc3339_ms")]` for `u64` milliseconds carried as RFC 3339 text.
pub mod rfc3339_ms {
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(unix_ms: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(super::format_rfc3339_ms(*unix_ms).as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        struct Text;
        impl Visitor<'_> for Text {
            type Value = u64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an RFC 3339 timestamp at or after 1970-01-01T00:00:00Z")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<u64, E> {
                super::parse_rfc3339_ms(text)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(text), &self))
            }
        }
        deserializer.deserialize_str(Text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-06-25T19:00:00.123Z
    const T0: u64 = 1_782_414_000_123;

    fn sample() -> OrderCreate {
        OrderCreate {
            schema_version: 1,
            event_type: ORDER_CREATE_EVENT_TYPE.to_owned(),
            message_id: "msg_01J0Z3Q8YB3W5M2N7K4T9R6P1C".to_owned(),
            message_key: "resv_01J0Z3Q8YB3W5M2N7K4T9R6P1D".to_owned(),
            request_id: "req_1".to_owned(),
            reservation_id: "resv_01J0Z3Q8YB3W5M2N7K4T9R6P1D".to_owned(),
            activity_id: 10001,
            sku_id: 20001,
            user_id: 30001,
            quantity: 1,
            reserved_at_ms: T0,
            reservation_expires_at_ms: T0 + 300_000,
            retry_count: 0,
            payload_hash: "sha256:abc".to_owned(),
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            created_at_ms: T0 + 1,
        }
    }

    #[test]
    fn the_contract_example_decodes() {
        let body = br#"{"schema_version":1, "event_type":"SECKILL_ORDER_CREATE_REQUESTED",
 "message_id":"msg_1", "message_key":"resv_1", "request_id":"r1", "reservation_id":"resv_1",
 "activity_id":10001, "sku_id":20001, "user_id":30001, "quantity":1,
 "reserved_at":"2026-06-25T19:00:00.123Z", "reservation_expires_at":"2026-06-25T19:05:00Z",
 "retry_count":0, "payload_hash":"sha256:00", "traceparent":"00-ab-cd-01",
 "created_at":"2026-06-25T19:00:00.124Z", "a_field_from_the_future": {"x": [1, 2]}}"#;
        let m = decode_order_create(body).expect("decodes");
        assert_eq!(m.reserved_at_ms, T0);
        assert_eq!(m.reservation_expires_at_ms, T0 - 123 + 300_000);
        assert_eq!(m.created_at_ms, T0 + 1);
        assert_eq!(m.user_id, 30001);
        assert_eq!(m.order_id(), "ord_1");
    }

    #[test]
    fn encode_decode_round_trip() {
        let m = sample();
        let body = m.encode();
        assert_eq!(decode_order_create(&body), Ok(m.clone()));
        let text = String::from_utf8(body).expect("utf8");
        assert!(text.contains(r#""reserved_at":"2026-06-25T19:00:00.123Z""#), "{text}");
        let mut no_trace = m;
        no_trace.traceparent = None;
        let body = no_trace.encode();
        assert!(!String::from_utf8_lossy(&body).contains("traceparent"));
        assert_eq!(decode_order_create(&body), Ok(no_trace));
    }

    #[test]
    fn a_newer_schema_is_its_own_error() {
        let mut m = sample();
        m.schema_version = 2;
        assert_eq!(
            decode_order_create(&m.encode()),
            Err(DecodeError::UnknownSchema { version: 2 })
        );
        // Even when the new schema changed the shape beyond recognition.
        assert_eq!(
            decode_order_create(br#"{"schema_version": 7, "entirely": "different"}"#),
            Err(DecodeError::UnknownSchema { version: 7 })
        );
        // A version the probe cannot read is plain garbage.
        assert!(matches!(
            decode_order_create(br#"{"schema_version": "two"}"#),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn malformed_and_invalid_bodies_are_refused() {
        assert!(matches!(decode_order_create(b"not json"), Err(DecodeError::Malformed(_))));
        assert!(matches!(decode_order_create(b"{}"), Err(DecodeError::Malformed(_))));
        let big = vec![b' '; ORDER_CREATE_BODY_MAX + 1];
        assert!(matches!(decode_order_create(&big), Err(DecodeError::TooLarge { .. })));

        type Mutation = Box<dyn Fn(&mut OrderCreate)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("schema_version", Box::new(|m| m.schema_version = 0)),
            ("event_type", Box::new(|m| m.event_type = "OTHER".into())),
            ("message_id", Box::new(|m| m.message_id.clear())),
            ("reservation_id", Box::new(|m| m.reservation_id = "r_1".into())),
            ("reservation_id", Box::new(|m| m.reservation_id = "resv_".into())),
            ("request_id", Box::new(|m| m.request_id = "a b".into())),
            ("request_id", Box::new(|m| m.request_id = "x".repeat(ID_LEN_MAX + 1))),
            ("activity_id", Box::new(|m| m.activity_id = 0)),
            ("user_id", Box::new(|m| m.user_id = u64::MAX)),
            ("quantity", Box::new(|m| m.quantity = 2)),
            ("reservation_expires_at", Box::new(|m| m.reservation_expires_at_ms = T0)),
            ("payload_hash", Box::new(|m| m.payload_hash = "nul\0".into())),
        ];
        for (field, mutate) in cases {
            let mut m = sample();
            mutate(&mut m);
            match decode_order_create(&m.encode()) {
                Err(DecodeError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: expected Invalid, got {other:?}"),
            }
        }
        let bad_time = String::from_utf8(sample().encode())
            .expect("utf8")
            .replace("2026-06-25T19:00:00.123Z", "2026-02-30T19:00:00Z");
        assert!(matches!(decode_order_create(bad_time.as_bytes()), Err(DecodeError::Malformed(_))));
    }

    #[test]
    fn every_decode_error_is_permanent() {
        for e in [
            DecodeError::TooLarge { len: 1, max: 0 },
            DecodeError::Malformed("x".into()),
            DecodeError::UnknownSchema { version: 2 },
            DecodeError::Invalid { field: "f", reason: "r" },
        ] {
            assert!(!e.is_transient(), "{e}");
        }
    }

    // One test per branch of THE compensation mapping.

    #[test]
    fn expired_returns_stock_and_releases_the_user() {
        let c = RejectReason::Expired.compensation();
        assert_eq!(c, Compensation { return_stock: true, release_user: true });
    }

    #[test]
    fn activity_terminated_returns_stock_and_releases_the_user() {
        let c = RejectReason::ActivityTerminated.compensation();
        assert_eq!(c, Compensation { return_stock: true, release_user: true });
    }

    #[test]
    fn no_final_stock_releases_the_user_and_keeps_sold_out() {
        let c = RejectReason::NoFinalStock.compensation();
        assert_eq!(c, Compensation { return_stock: false, release_user: true });
    }

    #[test]
    fn duplicate_user_returns_stock_and_keeps_the_user_marker() {
        let c = RejectReason::DuplicateUser.compensation();
        assert_eq!(c, Compensation { return_stock: true, release_user: false });
    }

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

        let rejected = ReservationEvent::rejected(&m, RejectReason::NoFinalStock, T0 + 5);
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

    #[test]
    fn order_id_is_derived_from_the_reservation_id() {
        let m = sample();
        assert_eq!(m.order_id(), "ord_01J0Z3Q8YB3W5M2N7K4T9R6P1D");
    }

    #[test]
    fn rfc3339_known_values() {
        assert_eq!(format_rfc3339_ms(0).as_str(), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_rfc3339_ms(T0).as_str(), "2026-06-25T19:00:00.123Z");
        assert_eq!(format_rfc3339_ms(951_782_400_000).as_str(), "2000-02-29T00:00:00.000Z");
        assert_eq!(format_rfc3339_ms(u64::MAX).as_str(), "9999-12-31T23:59:59.999Z");
        assert_eq!(parse_rfc3339_ms("2026-06-25T19:00:00.123Z"), Some(T0));
        assert_eq!(parse_rfc3339_ms("2026-06-25T19:00:00.123456789Z"), Some(T0));
        assert_eq!(parse_rfc3339_ms("2026-06-25t19:00:00.1z"), Some(T0 - 23));
        assert_eq!(parse_rfc3339_ms("2026-06-25T21:00:00.123+02:00"), Some(T0));
        assert_eq!(parse_rfc3339_ms("2026-06-25T18:30:00.123-00:30"), Some(T0));
        assert_eq!(parse_rfc3339_ms("2000-02-29T00:00:00Z"), Some(951_782_400_000));
        for bad in [
            "",
            "2026-06-25",
            "2026-06-25T19:00:00",
            "2026-06-25T19:00:00.Z",
            "2026-13-01T00:00:00Z",
            "2026-02-29T00:00:00Z",
            "1900-02-29T00:00:00Z",
            "2026-06-25T24:00:00Z",
            "2026-06-25T23:59:60Z",
            "2026-06-25T19:00:00+0200",
            "1969-12-31T23:59:59Z",
            "2026-06-25T19:00:00Zjunk",
        ] {
            assert_eq!(parse_rfc3339_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn rfc3339_round_trips_over_the_range() {
        // Every day boundary of four centuries (covers leap-year rules) plus odd offsets.
        let mut ms = 0u64;
        while ms < 13_000_000_000_000 {
            let text = format_rfc3339_ms(ms);
            assert_eq!(parse_rfc3339_ms(&text), Some(ms), "{text}");
            ms += 86_400_000 + 3_600_123;
        }
        assert_eq!(parse_rfc3339_ms(&format_rfc3339_ms(RFC3339_MS_MAX)), Some(RFC3339_MS_MAX));
    }
}
