//! How far `order-writer` is behind: the pending count and the age of the oldest message not
//! yet settled, polled from JetStream and shared through a cheap handle.
//!
//! What it is: [`poll`] (one sample: consumer info for the count, stream info for the age) and
//! [`LogLag`], an `Arc` of atomics written by the poller and read by anyone (the edge's
//! admission reads it per request: two relaxed loads, no locks, no I/O).
//!
//! Oldest pending age: `SECKILL_ORDERS` is a work queue (acked and terminated messages leave
//! it), so its first message IS the oldest unsettled one and the stream's `first_ts` gives the
//! age in one call. A stream with limits retention would need the consumer's ack floor
//! instead.
//!
//! What it is not: the poll loop or the metrics export; the worker runs the loop and sets the
//! gauges (`pg-worker/src/worker.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_nats::jetstream;

use super::LogError;

/// One observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LagSample {
    /// Messages not yet delivered plus delivered but not yet acked.
    pub pending: u64,
    /// Age of the oldest message still in the stream (0 when none).
    pub oldest_pending_age_ms: u64,
}

/// The last sample, shared. Clone freely.
#[derive(Debug, Clone, Default)]
pub struct LogLag {
    inner: Arc<LagInner>,
}

#[derive(Debug, Default)]
struct LagInner {
    pending: AtomicU64,
    oldest_pending_age_ms: AtomicU64,
    /// When the sample was taken (ms since the Unix epoch); 0 = never. Readers use it to tell
    /// a fresh "no backlog" from a poller that stopped answering.
    polled_at_ms: AtomicU64,
}

// Relaxed everywhere: each value is an independent observation; a reader that sees a new count
// with an old age is off by one poll interval, which admission tolerates by design.
impl LogLag {
    pub fn pending(&self) -> u64 {
        self.inner.pending.load(Ordering::Relaxed)
    }

    pub fn oldest_pending_age_ms(&self) -> u64 {
        self.inner.oldest_pending_age_ms.load(Ordering::Relaxed)
    }

    pub fn polled_at_ms(&self) -> u64 {
        self.inner.polled_at_ms.load(Ordering::Relaxed)
    }

    pub fn store(&self, sample: LagSample, now_ms: u64) {
        self.inner.pending.store(sample.pending, Ordering::Relaxed);
        self.inner.oldest_pending_age_ms.store(sample.oldest_pending_age_ms, Ordering::Relaxed);
        self.inner.polled_at_ms.store(now_ms.max(1), Ordering::Relaxed);
    }
}

/// Samples `durable` on `stream` once.
pub(super) async fn poll(
    context: &jetstream::Context,
    stream: &str,
    durable: &str,
    now_ms: u64,
) -> Result<LagSample, LogError> {
    let api = |e: &dyn std::fmt::Display| LogError::Api {
        op: "lag poll",
        message: e.to_string(),
        transient: true,
    };
    let stream = context.get_stream(stream).await.map_err(|e| api(&e))?;
    let consumer = stream.consumer_info(durable).await.map_err(|e| api(&e))?;
    let pending = consumer.num_pending + consumer.num_ack_pending as u64;
    let state = &stream.cached_info().state;
    let oldest_pending_age_ms = if state.messages == 0 || pending == 0 {
        0
    } else {
        let first_ms =
            u64::try_from(state.first_timestamp.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
        now_ms.saturating_sub(first_ms)
    };
    Ok(LagSample { pending, oldest_pending_age_ms })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handle_shares_the_last_sample() {
        let lag = LogLag::default();
        assert_eq!(lag.polled_at_ms(), 0);
        let reader = lag.clone();
        lag.store(LagSample { pending: 7, oldest_pending_age_ms: 1_500 }, 1_000);
        assert_eq!(reader.pending(), 7);
        assert_eq!(reader.oldest_pending_age_ms(), 1_500);
        assert_eq!(reader.polled_at_ms(), 1_000);
    }
}
