//! The stock-returned notice among engine instances (DESIGN.md section 11). `redis-sync` is
//! one shared durable consumer: an event is applied by whichever instance pulled it, so a
//! compensation that returns a unit to Redis clears the sold-out flag only on that
//! instance's shards. Every other instance learns it from this notice, a core NATS message
//! (no JetStream: a lost notice costs a few buyers SOLD_OUT until the periodic stock
//! re-check, `shard/refresh.rs`, never a wrong sale) on
//! `seckill.notice.stock_returned.<activity>.<sku>` ([`STOCK_RETURNED_PREFIX`]), empty body.
//!
//! Each instance subscribes to all of them and hands each SKU to its owner shard's queue;
//! the owner re-reads `stock` when its flag says sold out (the flag is never cleared on the
//! notice's word alone: Redis stays the authority) and broadcasts the flip to its shards.

use flashsale_io::jetstream::async_nats;
use flashsale_io::jetstream::STOCK_RETURNED_PREFIX;
use futures::StreamExt as _;

use crate::durable::sync::SyncTargets;
use crate::logic::placement::SkuKey;

/// The notice's subject for a SKU.
pub fn subject(key: SkuKey) -> String {
    format!("{STOCK_RETURNED_PREFIX}.{}.{}", key.activity_id, key.sku_id)
}

/// The SKU a notice's subject names (None: not a notice of this format).
pub fn parse_subject(subject: &str) -> Option<SkuKey> {
    let rest = subject.strip_prefix(STOCK_RETURNED_PREFIX)?.strip_prefix('.')?;
    let (activity, sku) = rest.split_once('.')?;
    Some(SkuKey::new(activity.parse().ok()?, sku.parse().ok()?))
}

/// Publishes the notice (fire and forget: the client buffers and flushes it).
pub async fn publish(client: &async_nats::Client, key: SkuKey) {
    if let Err(e) = client.publish(subject(key), bytes::Bytes::new()).await {
        tracing::debug!(error = %e, "stock-returned notice not sent");
    }
}

/// Until `stop`: every notice goes to its owner shard's queue (a full queue drops it; the
/// periodic re-check covers it). The client re-subscribes by itself after a reconnect.
pub async fn subscribe(
    client: async_nats::Client,
    targets: SyncTargets,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut notices = loop {
        match client.subscribe(format!("{STOCK_RETURNED_PREFIX}.>")).await {
            Ok(subscriber) => break subscriber,
            Err(e) => tracing::warn!(error = %e, "stock-returned notices: subscribe failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            _ = stop.changed() => return,
        }
    };
    loop {
        let message = tokio::select! {
            message = notices.next() => message,
            _ = stop.changed() => return,
        };
        let Some(message) = message else { return };
        let Some(key) = parse_subject(message.subject.as_str()) else { continue };
        if let Some(queue) = targets.notices.get(targets.table.owner(key)) {
            let _ = queue.try_send(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_round_trip() {
        let key = SkuKey::new(10_001, 20_002);
        assert_eq!(subject(key), "seckill.notice.stock_returned.10001.20002");
        assert_eq!(parse_subject(&subject(key)), Some(key));
        for bad in ["seckill.notice.stock_returned", "seckill.notice.stock_returned.1", "x.1.2"] {
            assert_eq!(parse_subject(bad), None, "{bad}");
        }
    }
}
