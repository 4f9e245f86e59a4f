//! The per-message path of the order transaction (migration 0002): up to [`BATCH_MAX`]
//! order-create messages in ONE transaction, one `flashsale_order_create` call each, every
//! message's outcome preserved, committed before anything is acked (DESIGN.md section 5). The
//! set-based path's fallback, and the reference it is tested against (`order_path.rs` chooses).
//!
//! What it is: [`write_batch_per_message`]. Each message is one call of `flashsale_order_create`
//! (`migrations/0002_order_create.sql`: inbox, expiry/activity, claim, order, ledger,
//! reservation), told how many messages of its SKU follow it in the batch so that the first
//! claim of a SKU takes the units for all of them in one step (the transaction's "batch unit
//! pool", which keeps claims O(1) however large the batch). Then unused ROW units go back
//! (`flashsale_return_units`), the outbox events of every outcome go in with one INSERT, and
//! the transaction commits. The function returns each message's [`WriteOutcome`]; the caller
//! acks (or NAKs, or dead-letters) only after this returns `Ok`, i.e. after COMMIT.
//!
//! Pipelining: the calls of a batch do not depend on each other's results, only on each
//! other's success, so they are all sent back-to-back and the batch costs two round trips:
//!
//! ```text
//! BEGIN; SELECT f(msg1); SELECT f(msg2); ...        -- outcomes come back
//! SELECT flashsale_return_units(); INSERT INTO event_outbox ...; COMMIT;
//! ```
//!
//! One failing message must not hold the others back. Business outcomes (rejections,
//! duplicates, a contended claim) are values, not errors, so they never abort anything. When a
//! call does fail (a deadlock, a lock timeout, a poisoned row), everything after it in the
//! round fails too; the transaction is rolled back and redone without that message, which gets
//! its own `Failed` outcome. Savepoints would isolate it without the redo, but a subtransaction
//! per message doubled the per-message cost (two more statements, a subtransaction id each,
//! and MultiXact row locks where one subtransaction's lock meets another's update, which every
//! later reader of those rows pays for); failures are rare, so the redo is the cheaper design.
//!
//! Errors: `Err` means the transaction did not commit or its fate is unknown (the connection
//! broke, COMMIT failed). The connection may be left inside a transaction: the caller must
//! discard it (`deadpool_postgres::Object::take`), and NAK the batch; redelivery is safe
//! because a committed message is found in the inbox.
//!
//! What it is not: the choice of path or the set-based fallback (`order_path.rs`), the
//! statements' preparation and pipelining (`statements.rs`), the consumer loop, the acks or the
//! metrics (`worker/`), the outcome rules (`classify.rs`).
//!
//! Read next: `order_path.rs`, `statements.rs`, `classify.rs`, `set_writer.rs`.

use std::time::SystemTime;

use deadpool_postgres::ClientWrapper;
use flashsale_io::wire::{OrderCreate, RejectReason};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::batch_events::EventColumns;
use crate::classify::{Recorded, WriteOutcome};
use crate::error::PgError;
use crate::statements::{
    call, describe, exec, next_result, pipeline, system_time, Pending, Statements,
};

/// Most messages in one transaction. Bounds the work a failed message makes the batch redo
/// (O(n) per failure), the row locks one transaction holds, and the unit pool's text.
pub const BATCH_MAX: usize = 64;

/// Parameters of `flashsale_order_create`.
const ORDER_CREATE_PARAMS: usize = 13;

/// The per-message path over any number of messages, [`BATCH_MAX`] per transaction.
pub(crate) async fn write_per_message_chunks(
    client: &ClientWrapper,
    consumer_group: &str,
    messages: &[&OrderCreate],
    now_ms: u64,
) -> Result<Vec<WriteOutcome>, PgError> {
    if messages.is_empty() {
        return Err(PgError::InvalidArgument("a batch holds at least one message"));
    }
    let mut outcomes = Vec::with_capacity(messages.len());
    for chunk in messages.chunks(BATCH_MAX) {
        outcomes.extend(write_batch_per_message(client, consumer_group, chunk, now_ms).await?);
    }
    Ok(outcomes)
}

/// The per-message path: `messages` (1..=[`BATCH_MAX`]) in one transaction, one
/// `flashsale_order_create` call each (see the module documentation).
pub async fn write_batch_per_message(
    client: &ClientWrapper,
    consumer_group: &str,
    messages: &[&OrderCreate],
    now_ms: u64,
) -> Result<Vec<WriteOutcome>, PgError> {
    if messages.is_empty() || messages.len() > BATCH_MAX {
        return Err(PgError::InvalidArgument("a batch holds 1..=BATCH_MAX messages"));
    }
    let statements = Statements::prepare(client).await?;
    let pg: &tokio_postgres::Client = client;
    let now = system_time(now_ms);
    let mut outcomes: Vec<Option<WriteOutcome>> = vec![None; messages.len()];
    // The messages of the current attempt (indexes into `messages`).
    let mut attempt: Vec<usize> = (0..messages.len()).collect();
    while !attempt.is_empty() {
        let batch: Vec<&OrderCreate> = attempt.iter().map(|&i| messages[i]).collect();
        match call_round(pg, &statements, consumer_group, &batch, &now).await? {
            Round::Failed { position, outcome } => {
                // Everything after the failure failed unexecuted: undo, and redo without it.
                pg.execute(&statements.rollback, &[]).await?;
                let index = attempt.remove(position);
                outcomes[index] = Some(outcome);
            }
            Round::Answered(written) => {
                finish(pg, &statements, &batch, &written, now_ms).await?;
                for (index, outcome) in attempt.iter().zip(written) {
                    outcomes[*index] = Some(outcome);
                }
                break;
            }
        }
    }
    outcomes
        .into_iter()
        .map(|o| o.ok_or(PgError::InvalidArgument("a message of the batch got no outcome")))
        .collect()
}

/// What one round of `flashsale_order_create` calls answered (nothing committed yet).
enum Round {
    /// Every call answered: the outcomes, in batch order.
    Answered(Vec<WriteOutcome>),
    /// The call at `position` failed, and every call after it with it (unexecuted).
    Failed { position: usize, outcome: WriteOutcome },
}

/// BEGIN and one call per message of `batch`, pipelined (one round trip); the answers up to
/// the first call that failed.
async fn call_round(
    pg: &tokio_postgres::Client,
    statements: &Statements,
    consumer_group: &str,
    batch: &[&OrderCreate],
    now: &SystemTime,
) -> Result<Round, PgError> {
    let owned: Vec<OwnedParams> =
        batch.iter().zip(pool_sizes(batch)).map(|(m, pool)| OwnedParams::new(m, pool)).collect();
    let args: Vec<[&(dyn ToSql + Sync); ORDER_CREATE_PARAMS]> = batch
        .iter()
        .zip(&owned)
        .map(|(m, o)| -> [&(dyn ToSql + Sync); ORDER_CREATE_PARAMS] {
            [
                &consumer_group,
                &m.message_id,
                &m.reservation_id,
                &m.request_id,
                &o.activity_id,
                &o.sku_id,
                &o.user_id,
                &o.quantity,
                &o.reserved_at,
                &o.expires_at,
                now,
                &o.order_id,
                &o.pool_size,
            ]
        })
        .collect();
    let mut requests: Vec<Pending<'_>> = Vec::with_capacity(1 + batch.len());
    requests.push(exec(pg, &statements.begin));
    for message_args in &args {
        requests.push(call(pg, &statements.order_create, message_args));
    }
    let mut results = pipeline(requests).await.into_iter();
    next_result(&mut results)?; // BEGIN: fails only if the connection broke.
    read_round(&mut results, batch.len())
}

/// The answers of a round's `calls` (after BEGIN's), up to the first that failed.
fn read_round(
    results: &mut impl Iterator<Item = Result<Option<Row>, tokio_postgres::Error>>,
    calls: usize,
) -> Result<Round, PgError> {
    let mut written: Vec<WriteOutcome> = Vec::with_capacity(calls);
    for position in 0..calls {
        match results.next() {
            Some(Ok(Some(row))) => written.push(outcome_from_row(&row)?),
            Some(Err(error)) => {
                if error.code().is_none() {
                    // Not the server refusing a statement: the connection is in doubt.
                    return Err(error.into());
                }
                return Ok(Round::Failed { position, outcome: outcome_from_error(&error) });
            }
            Some(Ok(None)) | None => {
                return Err(PgError::InvalidArgument("pipeline returned no row for a call"))
            }
        }
    }
    Ok(Round::Answered(written))
}

/// Gives back unused ROW units, writes the events of the outcomes and commits, in one round
/// trip.
async fn finish(
    pg: &tokio_postgres::Client,
    statements: &Statements,
    messages: &[&OrderCreate],
    outcomes: &[WriteOutcome],
    now_ms: u64,
) -> Result<(), PgError> {
    let events = EventColumns::new(messages, outcomes, now_ms)?;
    let event_args = events.args();
    let mut requests: Vec<Pending<'_>> = Vec::with_capacity(3);
    requests.push(Box::pin(async move {
        pg.query_one(&statements.return_units, &[]).await.map(|_| None)
    }));
    if !events.is_empty() {
        requests.push(Box::pin(async move {
            pg.execute(&statements.insert_events, &event_args).await.map(|_| None)
        }));
    }
    requests.push(exec(pg, &statements.commit));
    // The first error is the one that counts: after it, COMMIT answers ROLLBACK (no error),
    // which must not be mistaken for success.
    for result in pipeline(requests).await {
        result?;
    }
    Ok(())
}

/// The per-message parameters that are not borrowed from the message.
struct OwnedParams {
    activity_id: i64,
    sku_id: i64,
    user_id: i64,
    quantity: i32,
    reserved_at: SystemTime,
    expires_at: SystemTime,
    order_id: String,
    pool_size: i32,
}

impl OwnedParams {
    fn new(message: &OrderCreate, pool_size: i32) -> OwnedParams {
        // wire::OrderCreate::validate bounds the ids by i64::MAX; saturate rather than wrap
        // if an unvalidated message slips through (the SQL then finds no such activity).
        let bigint = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        OwnedParams {
            activity_id: bigint(message.activity_id),
            sku_id: bigint(message.sku_id),
            user_id: bigint(message.user_id),
            // wire::OrderCreate::validate bounds it by QUANTITY_MAX.
            quantity: i32::try_from(message.quantity).unwrap_or(i32::MAX),
            reserved_at: system_time(message.reserved_at_ms),
            expires_at: system_time(message.reservation_expires_at_ms),
            order_id: message.order_id(),
            pool_size,
        }
    }
}

/// For each message, how many units the messages of its SKU ask for in the batch from it on
/// (itself included): what its call takes into the transaction's pool of that SKU when the
/// pool holds fewer than its own quantity (see `migrations/0002_order_create.sql`, "Batch unit
/// pools", and 0010). O(n²) over at most BATCH_MAX messages, no allocation per pair.
fn pool_sizes(messages: &[&OrderCreate]) -> Vec<i32> {
    (0..messages.len())
        .map(|i| {
            let key = (messages[i].activity_id, messages[i].sku_id);
            let same = messages[i..].iter().filter(|m| (m.activity_id, m.sku_id) == key);
            let units: u64 = same.map(|m| u64::from(m.quantity)).sum();
            // At most BATCH_MAX × QUANTITY_MAX.
            i32::try_from(units).unwrap_or(i32::MAX)
        })
        .collect()
}

fn outcome_from_row(row: &Row) -> Result<WriteOutcome, PgError> {
    let outcome: &str = row.try_get(0)?;
    let recorded: Option<&str> = row.try_get(1)?;
    let order_id: Option<String> = row.try_get(2)?;
    let token_ids: Option<Vec<String>> = row.try_get(3)?;
    let token_ids = token_ids.unwrap_or_default();
    let claim_us: Option<i64> = row.try_get(4)?;
    let missing_order = PgError::InvalidArgument("ORDER_CREATED without an order id");
    Ok(match outcome {
        "CONTENDED" => WriteOutcome::Contended,
        "ORDER_CREATED" => {
            WriteOutcome::Created { order_id: order_id.ok_or(missing_order)?, token_ids, claim_us }
        }
        "DUPLICATE" => WriteOutcome::Duplicate {
            recorded: match recorded {
                Some("ORDER_CREATED") => {
                    Recorded::Created { order_id: order_id.ok_or(missing_order)? }
                }
                Some(status) => RejectReason::from_reservation_status(status)
                    .map_or(Recorded::Unresolved, Recorded::Rejected),
                None => Recorded::Unresolved,
            },
        },
        other => match RejectReason::from_reservation_status(other) {
            Some(reason) => WriteOutcome::Rejected { reason, claim_us },
            None => {
                return Err(PgError::InvalidArgument("unknown outcome from flashsale_order_create"))
            }
        },
    })
}

fn outcome_from_error(error: &tokio_postgres::Error) -> WriteOutcome {
    WriteOutcome::Failed {
        transient: crate::error::sql_error_is_transient(error),
        error: describe(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsale_io::wire::ORDER_CREATE_EVENT_TYPE;

    fn message(sku_id: u64) -> OrderCreate {
        OrderCreate {
            schema_version: 1,
            event_type: ORDER_CREATE_EVENT_TYPE.into(),
            message_id: "msg_1".into(),
            message_key: "resv_1".into(),
            request_id: "req_1".into(),
            reservation_id: "resv_1".into(),
            activity_id: 1,
            sku_id,
            user_id: 3,
            quantity: 1,
            reserved_at_ms: 1_000,
            reservation_expires_at_ms: 2_000,
            retry_count: 0,
            payload_hash: "sha256:x".into(),
            traceparent: None,
            created_at_ms: 1_000,
        }
    }

    #[test]
    fn pool_sizes_count_the_rest_of_each_skus_messages() {
        let (a, b) = (message(1), message(2));
        assert_eq!(pool_sizes(&[&a, &a, &b, &a, &b]), vec![3, 2, 2, 1, 1]);
        assert_eq!(pool_sizes(&[&a]), vec![1]);
        let three = OrderCreate { quantity: 3, ..message(1) };
        assert_eq!(pool_sizes(&[&a, &three, &b, &three]), vec![7, 6, 1, 3]);
    }
}
