//! The order transaction: several order-create messages in ONE PostgreSQL transaction, every
//! message's outcome preserved, committed before anything is acked (DESIGN.md section 5).
//!
//! What it is: [`write_batch`] and its two ways of writing a batch ([`OrderPath`]):
//!
//! - **set-based** (the default; `set_writer.rs`, migration 0004): a fixed number of statements
//!   per batch, whatever its size — the batch's facts read and its units locked in one call,
//!   every outcome decided in Rust (`plan.rs`, sans I/O), the rows written in one call, the
//!   events in one INSERT, COMMIT. Up to [`SET_BATCH_MAX`] messages. A batch it cannot write
//!   (a message that fails a constraint, a buyer raced by a concurrent transaction) is rolled
//!   back and written the per-message way, which isolates the failing message;
//! - **per message** ([`write_batch_per_message`], migration 0002): one `flashsale_order_create`
//!   call per message, up to [`BATCH_MAX`] per transaction. The fallback above, and the
//!   reference the set-based path is tested against (tests/tests/order_writer.rs compares the
//!   rows both produce for the same message sequences).
//!
//! The per-message path: each message is one call of `flashsale_order_create`
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
//! What it is not: the consumer loop, the acks or the metrics (`worker.rs`), the outcome rules
//! (`classify.rs`, `plan.rs`).
//!
//! Read next: `set_writer.rs`, `plan.rs`, `classify.rs`, `worker.rs`.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_postgres::ClientWrapper;
use flashsale_io::wire::{OrderCreate, RejectReason};
use futures::future::{maybe_done, MaybeDone};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Statement};

use crate::classify::{event_for, Recorded, WriteOutcome};
use crate::error::PgError;
use crate::sql;

/// Most messages in one transaction. Bounds the work a failed message makes the batch redo
/// (O(n) per failure), the row locks one transaction holds, and the unit pool's text.
pub const BATCH_MAX: usize = 64;

/// Most messages in one set-based transaction (its arrays, the rows and token locks it holds,
/// and what a fallback to the per-message path redoes). The worker's `fetch_max` is bounded
/// by it.
pub const SET_BATCH_MAX: usize = 1024;

/// Parameters of `flashsale_order_create`.
const ORDER_CREATE_PARAMS: usize = 12;

/// How a batch is written (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OrderPath {
    /// Migration 0004: a fixed number of statements per batch (up to [`SET_BATCH_MAX`]);
    /// a batch it cannot write goes the per-message way.
    #[default]
    SetBased,
    /// Migration 0002: one function call per message (up to [`BATCH_MAX`] per transaction).
    PerMessage,
}

/// Writes `messages` for `consumer_group` (the inbox key) the set-based way and returns each
/// message's outcome, in input order, after COMMIT. `now_ms` is the clock reading expiry is
/// judged against. See the module documentation for errors.
pub async fn write_batch(
    client: &ClientWrapper,
    consumer_group: &str,
    messages: &[&OrderCreate],
    now_ms: u64,
) -> Result<Vec<WriteOutcome>, PgError> {
    write_batch_with(client, consumer_group, messages, now_ms, OrderPath::SetBased).await
}

/// [`write_batch`] by the given path. `PerMessage` with more than [`BATCH_MAX`] messages
/// writes them in consecutive transactions of at most `BATCH_MAX`.
pub async fn write_batch_with(
    client: &ClientWrapper,
    consumer_group: &str,
    messages: &[&OrderCreate],
    now_ms: u64,
    path: OrderPath,
) -> Result<Vec<WriteOutcome>, PgError> {
    match path {
        OrderPath::SetBased => {
            crate::set_writer::write_set(client, consumer_group, messages, now_ms).await
        }
        OrderPath::PerMessage => {
            write_per_message_chunks(client, consumer_group, messages, now_ms).await
        }
    }
}

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
        let owned: Vec<OwnedParams> = batch
            .iter()
            .zip(pool_sizes(&batch))
            .map(|(m, pool)| OwnedParams::new(m, pool))
            .collect();
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
                    &o.reserved_at,
                    &o.expires_at,
                    &now,
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
        let mut written: Vec<WriteOutcome> = Vec::with_capacity(batch.len());
        let mut failed: Option<(usize, WriteOutcome)> = None;
        for position in 0..batch.len() {
            match results.next() {
                Some(Ok(Some(row))) => written.push(outcome_from_row(&row)?),
                Some(Err(error)) => {
                    if error.code().is_none() {
                        // Not the server refusing a statement: the connection is in doubt.
                        return Err(error.into());
                    }
                    failed = Some((position, outcome_from_error(&error)));
                    break;
                }
                Some(Ok(None)) | None => {
                    return Err(PgError::InvalidArgument("pipeline returned no row for a call"))
                }
            }
        }
        if let Some((position, outcome)) = failed {
            // Everything after the failure failed unexecuted: undo, and redo without it.
            pg.execute(&statements.rollback, &[]).await?;
            let index = attempt.remove(position);
            outcomes[index] = Some(outcome);
            continue;
        }
        finish(pg, &statements, &batch, &written, now_ms).await?;
        for (index, outcome) in attempt.iter().zip(written) {
            outcomes[*index] = Some(outcome);
        }
        break;
    }
    outcomes
        .into_iter()
        .map(|o| o.ok_or(PgError::InvalidArgument("a message of the batch got no outcome")))
        .collect()
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

/// The outbox rows of a batch's committed outcomes, as the three parallel arrays
/// `INSERT_EVENTS_SQL` takes, in message order (so event ids follow it).
pub(crate) struct EventColumns<'a> {
    aggregate_ids: Vec<&'a str>,
    event_types: Vec<&'static str>,
    payloads: Vec<String>,
}

impl<'a> EventColumns<'a> {
    pub(crate) fn new(
        messages: &[&'a OrderCreate],
        outcomes: &[WriteOutcome],
        now_ms: u64,
    ) -> Result<EventColumns<'a>, PgError> {
        let mut columns = EventColumns {
            aggregate_ids: Vec::with_capacity(messages.len()),
            event_types: Vec::with_capacity(messages.len()),
            payloads: Vec::with_capacity(messages.len()),
        };
        for (message, outcome) in messages.iter().zip(outcomes) {
            if let Some(event) = event_for(message, outcome, now_ms) {
                columns.aggregate_ids.push(&message.reservation_id);
                columns.event_types.push(event.event_type.as_str());
                columns.payloads.push(
                    serde_json::to_string(&event)
                        .map_err(|_| PgError::InvalidArgument("event does not serialize"))?,
                );
            }
        }
        Ok(columns)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.payloads.is_empty()
    }

    pub(crate) fn args(&self) -> [&(dyn ToSql + Sync); 3] {
        [&self.aggregate_ids, &self.event_types, &self.payloads]
    }
}

/// Every statement a batch may send, prepared once per connection.
pub(crate) struct Statements {
    pub(crate) begin: Statement,
    pub(crate) commit: Statement,
    pub(crate) rollback: Statement,
    pub(crate) order_create: Statement,
    pub(crate) insert_events: Statement,
    pub(crate) return_units: Statement,
    pub(crate) order_facts: Statement,
    pub(crate) order_apply: Statement,
}

impl Statements {
    /// Cache hits after a connection's first batch (no round trip).
    pub(crate) async fn prepare(client: &ClientWrapper) -> Result<Statements, PgError> {
        Ok(Statements {
            begin: client.prepare_cached(sql::BEGIN_SQL).await?,
            commit: client.prepare_cached(sql::COMMIT_SQL).await?,
            rollback: client.prepare_cached(sql::ROLLBACK_SQL).await?,
            order_create: client.prepare_cached(sql::ORDER_CREATE_SQL).await?,
            insert_events: client.prepare_cached(sql::INSERT_EVENTS_SQL).await?,
            return_units: client.prepare_cached(sql::RETURN_UNITS_SQL).await?,
            order_facts: client.prepare_cached(sql::ORDER_FACTS_SQL).await?,
            order_apply: client.prepare_cached(sql::ORDER_APPLY_SQL).await?,
        })
    }
}

/// The per-message parameters that are not borrowed from the message.
struct OwnedParams {
    activity_id: i64,
    sku_id: i64,
    user_id: i64,
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
            reserved_at: system_time(message.reserved_at_ms),
            expires_at: system_time(message.reservation_expires_at_ms),
            order_id: message.order_id(),
            pool_size,
        }
    }
}

/// For each message, how many messages of its SKU remain in the batch from it on (itself
/// included): the units its call takes if it finds the transaction's pool of that SKU empty
/// (see `migrations/0002_order_create.sql`, "Batch unit pools"). O(n²) over at most
/// BATCH_MAX messages, no allocation per pair.
fn pool_sizes(messages: &[&OrderCreate]) -> Vec<i32> {
    (0..messages.len())
        .map(|i| {
            let key = (messages[i].activity_id, messages[i].sku_id);
            let same = messages[i..].iter().filter(|m| (m.activity_id, m.sku_id) == key).count();
            // At most BATCH_MAX.
            i32::try_from(same).unwrap_or(i32::MAX)
        })
        .collect()
}

pub(crate) fn system_time(unix_ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(unix_ms)
}

fn outcome_from_row(row: &Row) -> Result<WriteOutcome, PgError> {
    let outcome: &str = row.try_get(0)?;
    let recorded: Option<&str> = row.try_get(1)?;
    let order_id: Option<String> = row.try_get(2)?;
    let token_id: Option<String> = row.try_get(3)?;
    let claim_us: Option<i64> = row.try_get(4)?;
    let missing_order = PgError::InvalidArgument("ORDER_CREATED without an order id");
    Ok(match outcome {
        "CONTENDED" => WriteOutcome::Contended,
        "ORDER_CREATED" => {
            WriteOutcome::Created { order_id: order_id.ok_or(missing_order)?, token_id, claim_us }
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

/// "SQLSTATE 40P01: deadlock detected" for server errors, the driver's text otherwise.
pub fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("SQLSTATE {}: {}", db.code().code(), db.message()),
        None => error.to_string(),
    }
}

pub(crate) fn next_result(
    results: &mut impl Iterator<Item = Result<Option<Row>, tokio_postgres::Error>>,
) -> Result<Option<Row>, PgError> {
    match results.next() {
        Some(result) => Ok(result?),
        None => Err(PgError::InvalidArgument("pipeline returned fewer results than requests")),
    }
}

pub(crate) type Pending<'a> =
    Pin<Box<dyn Future<Output = Result<Option<Row>, tokio_postgres::Error>> + Send + 'a>>;

pub(crate) fn exec<'a>(pg: &'a tokio_postgres::Client, statement: &'a Statement) -> Pending<'a> {
    Box::pin(async move { pg.execute(statement, &[]).await.map(|_| None) })
}

pub(crate) fn call<'a>(
    pg: &'a tokio_postgres::Client,
    statement: &'a Statement,
    args: &'a [&'a (dyn ToSql + Sync)],
) -> Pending<'a> {
    Box::pin(async move { pg.query_one(statement, args).await.map(Some) })
}

/// Runs `requests` pipelined: tokio-postgres sends a request when its future is first polled,
/// so polling every future once, in order, puts them on the wire back-to-back in that order;
/// the server executes them in that order and the responses come back in it.
pub(crate) async fn pipeline(
    requests: Vec<Pending<'_>>,
) -> Vec<Result<Option<Row>, tokio_postgres::Error>> {
    let mut slots: Vec<MaybeDone<Pending<'_>>> = requests.into_iter().map(maybe_done).collect();
    for slot in slots.iter_mut() {
        // Sends the request; the result (if already there) stays in the slot.
        let _ = futures::poll!(&mut *slot);
    }
    for slot in slots.iter_mut() {
        (&mut *slot).await;
    }
    slots
        .iter_mut()
        .map(|slot| match Pin::new(slot).take_output() {
            Some(result) => result,
            // Every slot was awaited to completion just above.
            None => unreachable!("pipelined request without an output"),
        })
        .collect()
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
    }
}
