//! The order-writer task: pull deliveries from `SECKILL_ORDERS`, decode them, write them in
//! ONE transaction ([`crate::order_path::write_batch_with`]), and only after COMMIT settle each
//! delivery as [`crate::classify::classify`] says (ack, NAK with a delay, or dead-letter then
//! TERM). `order_writers` of these run at once, each with its own pull consumer binding.
//!
//! What it is: [`run`] (the pull loop, its size from [`crate::batching::FetchSizer`]), one
//! batch's decode, write and settle, the hold-and-retry while PostgreSQL is unavailable, and the
//! metrics of committed outcomes. The crash drills' failpoint `worker_after_commit` sits between
//! COMMIT and the acks.
//!
//! What it is not: the transaction (`order_path.rs` and the writers), the delivery rules
//! (`classify.rs`), its spans (`order_trace.rs`), or the other tasks (`outbox_task.rs`, `closer_task.rs`, `lag_task.rs`).
//!
//! Read next: `../order_path.rs`, `../classify.rs`, `../batching.rs`.

use flashsale_io::jetstream::{Delivery, PullSource, ORDER_WRITER_CONSUMER};
use flashsale_io::wire::{decode_order_create, DecodeError, OrderCreate, RejectReason};
use tokio::sync::watch;
use tracing::Instrument;

use super::order_trace::{record_batch, WrittenBatch};
use super::shared::{ms, now_ms, pause, within_deadline, Shared};
use crate::batching::FetchSizer;
use crate::classify::{classify, Action, Attempt, WriteOutcome};
use crate::error::PgError;
use crate::order_path::{write_batch_with, OrderPath};

/// Pulls, writes and settles until `stop` turns true; a batch in hand is always finished.
pub(super) async fn run(shared: &Shared, source: PullSource, mut stop: watch::Receiver<bool>) {
    let config = &shared.config;
    let mut sizer = FetchSizer::new(config.fetch_min, config.fetch_max);
    // The per-message path writes a pull in transactions of `batch_max`; the set-based path
    // writes the whole pull (at most fetch_max <= SET_BATCH_MAX) in one.
    let transaction_max = match config.order_path {
        OrderPath::SetBased => config.fetch_max,
        OrderPath::PerMessage => config.batch_max,
    };
    // Checked between pulls only: a batch in hand is always written and settled.
    while !*stop.borrow() {
        let deliveries = match source.fetch(sizer.ask(), ms(config.fetch_wait_ms)).await {
            Ok(deliveries) => deliveries,
            Err(e) => {
                tracing::warn!(error = %e, "order-writer pull failed");
                pause(ms(config.error_pause_ms), &mut stop).await;
                continue;
            }
        };
        sizer.observe(deliveries.len());
        for batch in deliveries.chunks(transaction_max) {
            let span = tracing::debug_span!("order_batch", size = batch.len());
            process_batch(shared, batch, &mut stop).instrument(span).await;
        }
    }
}

/// Decodes, writes and settles one batch of deliveries.
async fn process_batch(shared: &Shared, deliveries: &[Delivery], stop: &mut watch::Receiver<bool>) {
    let decoded: Vec<Result<OrderCreate, DecodeError>> =
        deliveries.iter().map(|d| decode_order_create(d.payload())).collect();
    // Writable messages, by SKU: concurrent batches then take ROW allocator rows (and the
    // order index entries of one SKU) in one order, which avoids lock-order deadlocks.
    let mut writable: Vec<usize> = (0..deliveries.len()).filter(|&i| decoded[i].is_ok()).collect();
    writable.sort_by_key(|&i| match &decoded[i] {
        Ok(m) => (m.activity_id, m.sku_id),
        Err(_) => (0, 0),
    });
    let messages: Vec<&OrderCreate> =
        writable.iter().filter_map(|&i| decoded[i].as_ref().ok()).collect();
    let started = std::time::SystemTime::now();
    let written = if messages.is_empty() {
        Ok(Vec::new())
    } else {
        write_holding(shared, &messages, deliveries, stop).await
    };
    let commit_ms = now_ms();
    if shared.traces.is_enabled() {
        let delivered: Vec<u32> = writable.iter().map(|&i| deliveries[i].delivered()).collect();
        let batch = WrittenBatch {
            messages: &messages,
            delivered: &delivered,
            written: &written,
            started,
            ended: std::time::SystemTime::now(),
        };
        record_batch(&shared.traces, &batch);
    }
    let mut outcome_of: Vec<Option<usize>> = vec![None; deliveries.len()];
    for (k, &i) in writable.iter().enumerate() {
        outcome_of[i] = Some(k);
    }
    let batch_error = match &written {
        Ok(outcomes) => {
            record(&messages, outcomes, commit_ms);
            String::new()
        }
        Err(e) => {
            metrics::counter!("flashsale_order_writer_batch_failures_total").increment(1);
            tracing::warn!(error = %e, size = messages.len(), "order batch not committed");
            e.to_string()
        }
    };
    let settles = deliveries.iter().enumerate().map(|(i, delivery)| {
        let attempt = match (&decoded[i], &written, outcome_of[i]) {
            (Err(e), _, _) => Attempt::Undecodable(e),
            (Ok(_), Ok(outcomes), Some(k)) => Attempt::Written(&outcomes[k]),
            (Ok(_), Err(e), _) => {
                Attempt::BatchFailed { transient: e.is_transient(), error: &batch_error }
            }
            // Cannot happen: every decoded message was written.
            (Ok(_), Ok(_), None) => Attempt::BatchFailed { transient: true, error: "not written" },
        };
        let action = classify(attempt, delivery.delivered(), &shared.policy);
        settle(shared, delivery, action)
    });
    futures::future::join_all(settles).await;
}

/// Writes the batch; while PostgreSQL is unavailable, holds it (its messages marked in
/// progress, so the server neither redelivers them nor counts deliveries) and retries with
/// full-jitter backoff up to `error_pause_ms × 5`, until it commits, fails otherwise, or the
/// worker stops. The write is idempotent (the inbox), so a retry after an unknown commit is
/// safe. Holding beats NAK-with-backoff here: the backlog drains the moment the database is
/// back instead of on each message's redelivery schedule, and the held batch is what the
/// writer would do next anyway (nothing else can commit either).
async fn write_holding(
    shared: &Shared,
    messages: &[&OrderCreate],
    deliveries: &[Delivery],
    stop: &mut watch::Receiver<bool>,
) -> Result<Vec<WriteOutcome>, PgError> {
    let pause_max_ms = shared.config.error_pause_ms.saturating_mul(5).max(1);
    let mut pause_ms = shared.config.error_pause_ms.max(1);
    loop {
        match write(shared, messages).await {
            Err(e) if e.is_unavailable() && !*stop.borrow() => {
                metrics::counter!("flashsale_order_writer_held_retries_total").increment(1);
                tracing::debug!(error = %e, size = messages.len(), "postgres unavailable: holding");
                for delivery in deliveries {
                    let _ = delivery.in_progress().await;
                }
                let jittered = rand::random::<u64>() % pause_ms + 1;
                if pause(ms(jittered), stop).await {
                    return Err(e);
                }
                pause_ms = (pause_ms * 2).min(pause_max_ms);
            }
            other => return other,
        }
    }
}

/// One transaction on a pooled connection; a connection whose transaction failed is
/// discarded (it may still be inside that transaction).
async fn write(shared: &Shared, messages: &[&OrderCreate]) -> Result<Vec<WriteOutcome>, PgError> {
    let waited = std::time::Instant::now();
    let client = shared.pool.get().await?;
    metrics::histogram!("flashsale_pg_pool_wait_seconds").record(waited.elapsed().as_secs_f64());
    metrics::histogram!("flashsale_order_writer_batch_messages").record(messages.len() as f64);
    let path = shared.config.order_path;
    let written = within_deadline(
        shared,
        "order batch",
        write_batch_with(&client, ORDER_WRITER_CONSUMER, messages, now_ms(), path),
    )
    .await;
    match written {
        Ok(outcomes) => {
            #[cfg(feature = "failpoints")]
            fail::fail_point!("worker_after_commit");
            Ok(outcomes)
        }
        Err(e) => {
            drop(deadpool_postgres::Object::take(client));
            Err(e)
        }
    }
}

async fn settle(shared: &Shared, delivery: &Delivery, action: Action) {
    let result = match action {
        Action::Ack => delivery.ack().await,
        Action::Nak { delay_ms } => delivery.nak(ms(delay_ms)).await,
        Action::DeadLetter { error } => {
            match shared.publisher.dead_letter(delivery, ORDER_WRITER_CONSUMER, &error).await {
                Ok(_) => {
                    metrics::counter!("flashsale_dlq_total", "consumer" => ORDER_WRITER_CONSUMER)
                        .increment(1);
                    tracing::error!(
                        stream_sequence = delivery.stream_sequence(),
                        message_id = delivery.msg_id().unwrap_or(""),
                        deliveries = delivery.delivered(),
                        %error,
                        "order-create message dead-lettered"
                    );
                    delivery.term().await
                }
                Err(e) => {
                    // Not TERMed without its dead letter: redelivered and retried.
                    tracing::error!(error = %e, "dead-letter publish failed; NAK instead");
                    delivery.nak(ms(shared.policy.nak_delay_ms(delivery.delivered()))).await
                }
            }
        }
    };
    if let Err(e) = result {
        // The server redelivers after the ack wait; the inbox absorbs the repeat.
        tracing::warn!(error = %e, "settling a delivery failed");
    }
}

/// Metrics and trace events of a committed batch.
fn record(messages: &[&OrderCreate], outcomes: &[WriteOutcome], commit_ms: u64) {
    for (message, outcome) in messages.iter().zip(outcomes) {
        let label = match outcome {
            WriteOutcome::Created { order_id, claim_us, .. } => {
                let latency_ms = commit_ms.saturating_sub(message.reserved_at_ms);
                metrics::histogram!("flashsale_order_create_latency_seconds")
                    .record(latency_ms as f64 / 1000.0);
                record_claim(*claim_us);
                tracing::debug!(
                    message_id = %message.message_id,
                    reservation_id = %message.reservation_id,
                    order_id = %order_id,
                    "order created"
                );
                "created"
            }
            WriteOutcome::Rejected { reason, claim_us } => {
                record_claim(*claim_us);
                match reason {
                    RejectReason::NoFinalStock => {
                        metrics::counter!("flashsale_token_claim_empty_total", "result" => "exhausted")
                            .increment(1);
                    }
                    RejectReason::DuplicateUser => {
                        metrics::counter!("flashsale_unique_conflicts_total").increment(1);
                    }
                    RejectReason::Expired | RejectReason::ActivityTerminated => {}
                }
                tracing::debug!(
                    message_id = %message.message_id,
                    reservation_id = %message.reservation_id,
                    reason = reason.reason_code(),
                    "reservation rejected"
                );
                reason.reservation_status()
            }
            WriteOutcome::Duplicate { .. } => {
                metrics::counter!("flashsale_inbox_conflicts_total").increment(1);
                "duplicate"
            }
            WriteOutcome::Contended => {
                metrics::counter!("flashsale_token_claim_empty_total", "result" => "contended")
                    .increment(1);
                "contended"
            }
            WriteOutcome::Failed { error, .. } => {
                tracing::warn!(message_id = %message.message_id, %error, "order-create message failed");
                "failed"
            }
        };
        metrics::counter!("flashsale_order_writer_outcomes_total", "outcome" => label).increment(1);
    }
}

fn record_claim(claim_us: Option<i64>) {
    if let Some(us) = claim_us {
        metrics::histogram!("flashsale_token_claim_latency_seconds").record(us as f64 / 1e6);
    }
}
