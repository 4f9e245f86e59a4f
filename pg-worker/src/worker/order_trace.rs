//! The order writer's spans (`flashsale_io::trace`): one `order.write` per message and
//! delivery of a batch, from the start of the batch's write to its commit (or failure), under
//! the context the message carries — the reservation span, across the log — so one trace shows
//! the reservation, its publish and its order. A message that carries no context (published by
//! an edge without tracing) gets a root span in the trace its message id names, linked to the
//! reservation span.
//!
//! Attributes: the business ids (`order_id` once created; the user id hashed), `result_code`
//! (the reservation's status after the write: `ORDER_CREATED`, `REJECTED_*`, or `DUPLICATE`,
//! `CONTENDED`, `FAILED`, `NOT_COMMITTED`), the delivery count, `retry_count`, the batch size,
//! `messaging.*` and `db.system`.
//!
//! What it is not: the write (`order_writer_task.rs`), the context rule (`flashsale_io::trace`).

use std::time::SystemTime;

use flashsale_io::jetstream::{ORDER_CREATE_SUBJECT, ORDER_WRITER_CONSUMER};
use flashsale_io::trace::{BusinessIds, SpanName, SpanRecord, TraceSink};
use flashsale_io::wire::OrderCreate;

use crate::classify::{Recorded, WriteOutcome};
use crate::error::PgError;

/// What one batch's write was, for its spans.
pub(super) struct WrittenBatch<'a> {
    pub messages: &'a [&'a OrderCreate],
    /// Each message's delivery count, in the order of `messages`.
    pub delivered: &'a [u32],
    pub written: &'a Result<Vec<WriteOutcome>, PgError>,
    pub started: SystemTime,
    pub ended: SystemTime,
}

/// Records the batch's `order.write` spans (sampled ones only; nothing when disabled).
pub(super) fn record_batch(traces: &TraceSink, batch: &WrittenBatch<'_>) {
    let Some(ratio) = traces.ratio() else { return };
    for (k, message) in batch.messages.iter().enumerate() {
        let Some(mut span) = SpanRecord::downstream(
            SpanName::OrderWrite,
            message.traceparent.as_deref(),
            &message.message_id,
            ratio,
            batch.started,
            batch.ended,
        ) else {
            continue;
        };
        let (result_code, order_id, error) = match batch.written {
            Ok(outcomes) => outcomes.get(k).map_or(("NOT_COMMITTED", None, None), describe),
            Err(_) => ("NOT_COMMITTED", None, Some("the batch was not committed")),
        };
        span.error = error;
        span.ids(&BusinessIds {
            request_id: Some(&message.request_id),
            reservation_id: &message.reservation_id,
            message_id: &message.message_id,
            order_id,
            activity_id: message.activity_id,
            sku_id: message.sku_id,
            user_id: message.user_id,
        });
        span.attr("result_code", result_code);
        span.attr("retry_count", i64::from(message.retry_count));
        let delivered = batch.delivered.get(k).copied().unwrap_or(1);
        span.attr("messaging.delivery_count", i64::from(delivered));
        span.attr("messaging.batch.message_count", batch.messages.len() as i64);
        span.attr("messaging.system", "nats");
        span.attr("messaging.destination.name", ORDER_CREATE_SUBJECT);
        span.attr("messaging.consumer.group.name", ORDER_WRITER_CONSUMER);
        span.attr("db.system", "postgresql");
        traces.record(span);
    }
}

/// A message's outcome as its span says it: the result code, the order id, an error.
fn describe(outcome: &WriteOutcome) -> (&'static str, Option<&str>, Option<&'static str>) {
    match outcome {
        WriteOutcome::Created { order_id, .. } => ("ORDER_CREATED", Some(order_id), None),
        WriteOutcome::Rejected { reason, .. } => (reason.reservation_status(), None, None),
        WriteOutcome::Duplicate { recorded: Recorded::Created { order_id } } => {
            ("DUPLICATE", Some(order_id), None)
        }
        WriteOutcome::Duplicate { .. } => ("DUPLICATE", None, None),
        WriteOutcome::Contended => ("CONTENDED", None, None),
        WriteOutcome::Failed { .. } => ("FAILED", None, Some("the message's statement failed")),
    }
}
