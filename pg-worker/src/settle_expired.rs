//! An operator's settlement of an expired reservation (`flashsale admin stuck resolve
//! --compensate`), written through the order-writer's own path so that it can never be a second
//! outcome of the same message.
//!
//! What it is: [`settle_expired`] (the argument why it is safe is on it) and [`Settled`].
//!
//! What it is not: the stuck scan or the Redis side of the compensation
//! (`engine/src/shard/admin/stuck.rs`), or a way around the writer: it calls [`write_batch`] with the
//! message, under the order-writer's inbox key.
//!
//! Read next: `order_path.rs` (`write_batch`), `plan.rs` rule 3.

use deadpool_postgres::ClientWrapper;
use flashsale_io::wire::{OrderCreate, RejectReason};

use crate::classify::{Recorded, WriteOutcome};
use crate::error::PgError;
use crate::order_path::write_batch;

/// What [`settle_expired`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Recorded now: `REJECTED_EXPIRED`, with its `reservation_failed` event in the outbox
    /// (redis-sync returns the unit and releases the buyer from it, once).
    RejectedNow,
    /// The message had reached the order-writer before: what it recorded stands, and is
    /// announced again.
    AlreadyRecorded(Recorded),
}

/// Settles the order-create message of a reservation that has expired, now, without the log:
/// an operator's compensation of a stuck reservation (`flashsale admin stuck resolve
/// --compensate`).
///
/// Why this cannot create a second outcome, whatever is still in flight: the order-writer's
/// verdict on a message is decided by, in this order, its inbox row, a recorded row of its
/// reservation, and its expiry; an expired reservation is rejected before any unit is touched
/// (`flashsale_order_create` step 3; `plan.rs` rule 3). So every copy of this message that
/// may still arrive — the original in the stream, a republish under any `Nats-Msg-Id`,
/// after the duplicate window or inside it — would get `REJECTED_EXPIRED` too. This writes
/// that verdict through the writer's own path, under the consumer group's inbox key and the
/// reservation's primary key: a later copy finds the inbox row or the reservation row and is
/// a duplicate that re-announces the same verdict, and a copy being written concurrently
/// loses on one of those keys (its transaction fails and is retried as a duplicate). If the
/// message reached the writer first, its recorded outcome wins instead (`AlreadyRecorded`).
/// Nothing here waits for the duplicate window: the keys, not the window, are the proof.
///
/// `Err(InvalidArgument)` if the reservation has not expired at `now_ms` (then only a
/// republish may resolve it: the writer could still create its order). On any other `Err`
/// the connection may be mid-transaction and must be discarded, as for [`write_batch`].
pub async fn settle_expired(
    client: &ClientWrapper,
    message: &OrderCreate,
    now_ms: u64,
) -> Result<Settled, PgError> {
    if message.reservation_expires_at_ms > now_ms {
        return Err(PgError::InvalidArgument("the reservation has not expired"));
    }
    let outcomes =
        write_batch(client, flashsale_io::jetstream::ORDER_WRITER_CONSUMER, &[message], now_ms)
            .await?;
    match outcomes.into_iter().next() {
        Some(WriteOutcome::Rejected { reason: RejectReason::Expired, .. }) => {
            Ok(Settled::RejectedNow)
        }
        Some(WriteOutcome::Duplicate { recorded }) => Ok(Settled::AlreadyRecorded(recorded)),
        Some(WriteOutcome::Failed { error, .. }) => {
            tracing::warn!(reservation_id = %message.reservation_id, %error, "settling an expired reservation failed");
            Err(PgError::InvalidArgument("the order-writer's statement failed (see the log)"))
        }
        _ => Err(PgError::InvalidArgument("an expired reservation was not rejected as expired")),
    }
}
