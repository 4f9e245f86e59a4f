//! The order transaction: several order-create messages in ONE PostgreSQL transaction, every
//! message's outcome preserved, committed before anything is acked (DESIGN.md section 5).
//!
//! What it is: [`write_batch`] and its two ways of writing a batch ([`OrderPath`]), the one
//! place that chooses between them:
//!
//! - **set-based** (the default; `set_writer.rs`, migration 0004): a fixed number of statements
//!   per batch, whatever its size — the batch's facts read and its units locked in one call,
//!   every outcome decided in Rust (`plan.rs`, sans I/O), the rows written in one call, the
//!   events in one INSERT, COMMIT. Up to [`SET_BATCH_MAX`] messages. A batch it cannot write
//!   (a message that fails a constraint, a buyer raced by a concurrent transaction — SQLSTATE
//!   FS001 —, a deadlock or lock timeout) is rolled back by the set writer, and written here
//!   the per-message way, which isolates the failing message: the rest commit, and only the
//!   failing one answers `Failed`. `flashsale_order_writer_set_fallbacks_total{reason}` counts
//!   these;
//! - **per message** (`order_writer.rs`, migration 0002): one `flashsale_order_create` call per
//!   message, up to `BATCH_MAX` per transaction. The fallback above, and the reference the
//!   set-based path is tested against (tests/tests/order_writer.rs compares the rows both
//!   produce for the same message sequences).
//!
//! Why the choice lives here, above both writers: the fallback needs both, and neither writer
//! needs the other; each stays one way of writing a batch, with the statements and pipelining
//! they share in `statements.rs` and the outbox rows in `batch_events.rs`.
//!
//! Errors: `Err` means the transaction did not commit or its fate is unknown (the connection
//! broke, COMMIT failed). The connection may be left inside a transaction: the caller must
//! discard it (`deadpool_postgres::Object::take`), and NAK the batch; redelivery is safe
//! because a committed message is found in the inbox.
//!
//! What it is not: either writer's statements (`set_writer.rs`, `order_writer.rs`), the
//! consumer loop, the acks or the metrics of outcomes (`worker/`), the outcome rules
//! (`classify.rs`, `plan.rs`).
//!
//! Read next: `set_writer.rs`, `plan.rs`, `order_writer.rs`, `worker/order_writer_task.rs`.

use deadpool_postgres::ClientWrapper;
use flashsale_io::wire::OrderCreate;

use crate::classify::WriteOutcome;
use crate::error::PgError;
use crate::order_writer::write_per_message_chunks;
use crate::set_writer::{write_set_once, Attempt, Refusal, SET_BATCH_MAX};

/// How a batch is written (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OrderPath {
    /// Migration 0004: a fixed number of statements per batch (up to [`SET_BATCH_MAX`]);
    /// a batch it cannot write goes the per-message way.
    #[default]
    SetBased,
    /// Migration 0002: one function call per message (up to `order_writer::BATCH_MAX` per
    /// transaction).
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

/// [`write_batch`] by the given path. `PerMessage` with more than `order_writer::BATCH_MAX`
/// messages writes them in consecutive transactions of at most `BATCH_MAX`.
pub async fn write_batch_with(
    client: &ClientWrapper,
    consumer_group: &str,
    messages: &[&OrderCreate],
    now_ms: u64,
    path: OrderPath,
) -> Result<Vec<WriteOutcome>, PgError> {
    match path {
        OrderPath::SetBased => write_set(client, consumer_group, messages, now_ms).await,
        OrderPath::PerMessage => {
            write_per_message_chunks(client, consumer_group, messages, now_ms).await
        }
    }
}

/// Writes `messages` (1..=[`SET_BATCH_MAX`]) set-based, or per message when PostgreSQL refuses
/// the set (see the module documentation). Outcomes in input order, after COMMIT.
async fn write_set(
    client: &ClientWrapper,
    consumer_group: &str,
    messages: &[&OrderCreate],
    now_ms: u64,
) -> Result<Vec<WriteOutcome>, PgError> {
    if messages.is_empty() || messages.len() > SET_BATCH_MAX {
        return Err(PgError::InvalidArgument("a set batch holds 1..=SET_BATCH_MAX messages"));
    }
    match write_set_once(client, consumer_group, messages, now_ms).await? {
        Attempt::Committed(outcomes) => Ok(outcomes),
        Attempt::Refused(refusal, error) => {
            metrics::counter!("flashsale_order_writer_set_fallbacks_total", "reason" => refusal.label())
                .increment(1);
            match refusal {
                Refusal::Inconsistent => {
                    tracing::error!(%error, size = messages.len(), "set batch refused: per message")
                }
                Refusal::BuyerRace | Refusal::Server => {
                    tracing::debug!(%error, size = messages.len(), "set batch refused: per message")
                }
            }
            write_per_message_chunks(client, consumer_group, messages, now_ms).await
        }
    }
}
