//! The message schemas of the replicated log (CONTRACT.md section 6): the order-create message
//! the edge publishes to `seckill.order.create`, and the reservation events the outbox
//! publishes to `seckill.event.<type>` for `redis-sync`.
//!
//! What it is, one file per concern:
//! - `order_create.rs`: [`OrderCreate`] (ONE constructor), its validation and decoding;
//! - `event.rs`: [`ReservationEvent`], its types and reasons, and what it asks `redis-sync`
//!   to do ([`EventAction`]);
//! - `decode.rs`: what both share when read: [`SCHEMA_VERSION`], [`DecodeError`] (all
//!   permanent, so the worker routes them to the DLQ) and the field checks;
//! - `rfc3339.rs`: the timestamp text both schemas use.
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
//! Layout: this file only declares the children and re-exports what callers use; no child
//! imports it.
//!
//! Read next: `jetstream/` (subjects, headers, publishing), `pg-worker/src/order_writer.rs` (who
//! decodes order-create messages and builds the events), `lua/seckill.lua` (`apply_result` and
//! `compensate`, which consume the events' fields).

mod decode;
mod event;
mod order_create;
mod rfc3339;

pub use decode::{DecodeError, ID_LEN_MAX, SCHEMA_VERSION};
pub use event::{
    decode_event, Compensation, EventAction, EventType, RejectReason, ReservationEvent,
    EVENT_BODY_MAX, ORDER_CANCELLED_REASON,
};
pub use order_create::{
    decode_order_create, OrderCreate, ReservationFacts, ORDER_CREATE_BODY_MAX,
    ORDER_CREATE_EVENT_TYPE, ORDER_ID_PREFIX, RESERVATION_ID_PREFIX,
};
pub use rfc3339::{
    format_rfc3339_ms, parse_rfc3339_ms, rfc3339_ms, Rfc3339, RFC3339_MS_LEN, RFC3339_MS_MAX,
};
