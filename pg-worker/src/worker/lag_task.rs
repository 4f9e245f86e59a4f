//! The lag task: how far the durable pipeline is behind, polled for the edge and the gauges.
//!
//! What it is: [`run`]: every `lag_poll_ms`, the `order-writer` consumer's pending count and
//! oldest pending age from JetStream (into [`flashsale_io::jetstream::LogLag`], which the edge's
//! admission reads, and gauges) and the outbox backlog from PostgreSQL (a gauge). The same
//! sample feeds the [`StrandWatch`]: messages the work queue holds below the consumer's floor
//! for `stranded_repair_ms` get the consumer recreated (counted in
//! `flashsale_log_consumer_recreated_total{consumer}`).
//!
//! What it is not: a decision about the lag: admission reads it (`engine`), alerts read the
//! gauges.
//!
//! Read next: `../outbox.rs` (`backlog`), `flashsale_io::jetstream` (`poll_order_writer_lag`).

use flashsale_io::jetstream::{StrandWatch, ORDER_WRITER_CONSUMER, RECREATION_LOG};
use tokio::sync::watch;

use super::shared::{ms, now_ms, pause, within_deadline, Shared};
use crate::outbox;

/// Polls the lag and the backlog until `stop`.
pub(super) async fn run(shared: &Shared, mut stop: watch::Receiver<bool>) {
    let mut strands = StrandWatch::new(shared.config.stranded_repair_ms);
    loop {
        let now = now_ms();
        match shared.log.poll_order_writer_lag(now).await {
            Ok(sample) => {
                shared.lag.store(sample, now);
                metrics::gauge!("flashsale_order_writer_pending").set(sample.pending as f64);
                metrics::gauge!("flashsale_order_writer_oldest_pending_age_seconds")
                    .set(sample.oldest_pending_age_ms as f64 / 1000.0);
                if strands.observe(&sample, now) {
                    repair_strands(shared, sample.stranded, sample.first_sequence).await;
                }
            }
            Err(e) => tracing::debug!(error = %e, "order-writer lag poll failed"),
        }
        match shared.pool.get().await {
            Ok(client) => {
                match within_deadline(shared, "outbox backlog", outbox::backlog(&client)).await {
                    Ok(backlog) => metrics::gauge!("flashsale_outbox_backlog").set(backlog as f64),
                    Err(e) => {
                        drop(deadpool_postgres::Object::take(client));
                        tracing::debug!(error = %e, "outbox backlog poll failed")
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "no connection for the backlog poll"),
        }
        if pause(ms(shared.config.lag_poll_ms), &mut stop).await {
            return;
        }
    }
}

/// Recreates `order-writer` over messages stranded below its floor (`StrandWatch`).
async fn repair_strands(shared: &Shared, stranded: u64, first_sequence: u64) {
    tracing::error!(stranded, first_sequence, "{RECREATION_LOG}");
    metrics::counter!("flashsale_log_consumer_recreated_total", "consumer" => ORDER_WRITER_CONSUMER)
        .increment(1);
    if let Err(e) = shared.log.recreate_order_writer().await {
        tracing::warn!(error = %e, "order-writer recreation failed; the watch tries again");
    }
}
