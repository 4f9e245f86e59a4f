//! The demo's log account (issue 25 item 3): JetStream's own counts once the sale's work is
//! done (the Redis account's end: every outcome applied), per sold unit — messages stored per
//! stream (the publishes its duplicate window kept: order-creates with their republishes, the
//! outbox's events) and deliveries per durable consumer, redeliveries apart.
//!
//! A sold unit needs one order-create and one `order_created` stored, each delivered once to
//! its consumer and settled once: six operations (two publishes, two deliveries, two acks) is
//! the floor. Settlements are counted as one per delivery (an ack, or a nak that brings a
//! redelivery, which is then counted as a delivery too); the pulls themselves (one request per
//! batch) are not counted.

use flashsale_io::jetstream::StreamStats;
use flashsale_io::jetstream::{Log, LogConfig};

/// Reads the streams' and consumers' counts through the JetStream API at `nats_url`.
pub fn account(nats_url: &str, sold: u64) -> anyhow::Result<serde_json::Value> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let stats = runtime.block_on(async {
        let log =
            Log::connect(&LogConfig { url: nats_url.to_owned(), ..LogConfig::default() }).await?;
        anyhow::Ok(log.poll_stats().await)
    })?;
    if let Some(error) = stats.iter().find_map(|s| s.error.as_deref()) {
        anyhow::bail!("stream stats: {error}");
    }
    Ok(summary(&stats, sold))
}

fn summary(stats: &[StreamStats], sold: u64) -> serde_json::Value {
    let per_unit = |n: u64| if sold == 0 { 0.0 } else { n as f64 / sold as f64 };
    let stored: u64 = stats.iter().map(|s| s.stored_total).sum();
    let delivered: u64 = stats.iter().flat_map(|s| &s.consumers).map(|c| c.delivered).sum();
    let redelivered: u64 = stats.iter().flat_map(|s| &s.consumers).map(|c| c.redelivered).sum();
    let streams: Vec<serde_json::Value> = stats
        .iter()
        .map(|s| {
            let consumers: Vec<serde_json::Value> = s
                .consumers
                .iter()
                .map(|c| {
                    serde_json::json!({
                        "consumer": c.consumer,
                        "delivered": c.delivered,
                        "redelivered": c.redelivered,
                        "delivered_per_sold_unit": per_unit(c.delivered),
                    })
                })
                .collect();
            serde_json::json!({
                "stream": s.stream,
                "stored": s.stored_total,
                "stored_per_sold_unit": per_unit(s.stored_total),
                "consumers": consumers,
            })
        })
        .collect();
    serde_json::json!({
        "sold_units": sold,
        "stored_per_sold_unit": per_unit(stored),
        "delivered_per_sold_unit": per_unit(delivered),
        "redelivered_per_sold_unit": per_unit(redelivered),
        "operations_per_sold_unit": per_unit(stored + 2 * delivered),
        "streams": streams,
    })
}

/// Prints the account in one line.
pub fn render(account: &serde_json::Value) -> String {
    let f = |k: &str| account[k].as_f64().unwrap_or(0.0);
    format!(
        "log per sold unit: {:.2} messages stored, {:.2} deliveries ({:.3} redelivered), \
         {:.2} operations counting one ack a delivery (the floor: 6)",
        f("stored_per_sold_unit"),
        f("delivered_per_sold_unit"),
        f("redelivered_per_sold_unit"),
        f("operations_per_sold_unit"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsale_io::jetstream::ConsumerStats;

    fn stream(
        name: &'static str,
        stored: u64,
        consumer: Option<(&'static str, u64, u64)>,
    ) -> StreamStats {
        StreamStats {
            stream: name,
            messages: 0,
            bytes: 0,
            stored_total: stored,
            max_bytes: None,
            leader: None,
            consumers: consumer
                .map(|(consumer, delivered, redelivered)| ConsumerStats {
                    consumer,
                    pending: 0,
                    ack_pending: 0,
                    delivered,
                    redelivered,
                })
                .into_iter()
                .collect(),
            error: None,
        }
    }

    #[test]
    fn a_unit_at_the_floor_is_six_operations() {
        let stats = [
            stream("SECKILL_ORDERS", 10, Some(("order-writer", 10, 0))),
            stream("SECKILL_EVENTS", 10, Some(("redis-sync", 10, 0))),
            stream("SECKILL_DLQ", 0, None),
        ];
        let account = summary(&stats, 10);
        assert_eq!(account["operations_per_sold_unit"].as_f64(), Some(6.0));
        let stats = [
            stream("SECKILL_ORDERS", 12, Some(("order-writer", 13, 1))),
            stream("SECKILL_EVENTS", 10, Some(("redis-sync", 10, 0))),
        ];
        let account = summary(&stats, 10);
        assert_eq!(account["stored_per_sold_unit"].as_f64(), Some(2.2));
        assert_eq!(account["delivered_per_sold_unit"].as_f64(), Some(2.3));
        assert_eq!(account["operations_per_sold_unit"].as_f64(), Some(6.8));
        assert!(render(&account).contains("6.80 operations"), "{}", render(&account));
    }
}
