//! JetStream's own figures for the dependency metrics (seed ch9 §12.4: consumer lag, storage,
//! the replica group's leader): each stream's messages, bytes and byte limit, its leader, and
//! each of its durable consumers' pending and unacknowledged counts. One stream info and one
//! consumer info request each, through the JetStream API of async-nats.
//!
//! What it is: [`poll`] and the plain record it returns. What it is not: the loop (the edge's
//! `durable/health.rs` samples it at a modest interval, off every request's path) or the
//! `order-writer` backlog admission reads (`lag.rs`).

use async_nats::jetstream;

use super::names::{
    DLQ_STREAM, EVENTS_STREAM, ORDERS_STREAM, ORDER_WRITER_CONSUMER, REDIS_SYNC_CONSUMER,
};

/// The streams sampled, with their durable consumers.
pub const SAMPLED: [(&str, &[&str]); 3] = [
    (ORDERS_STREAM, &[ORDER_WRITER_CONSUMER]),
    (EVENTS_STREAM, &[REDIS_SYNC_CONSUMER]),
    (DLQ_STREAM, &[]),
];

/// One durable consumer's counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerStats {
    pub consumer: &'static str,
    /// Messages not yet delivered to it.
    pub pending: u64,
    /// Delivered, not yet acknowledged.
    pub ack_pending: u64,
    /// Deliveries made so far, redeliveries included (the consumer sequence).
    pub delivered: u64,
    /// Messages delivered more than once.
    pub redelivered: u64,
}

/// One stream's figures; `error` set (and the numbers 0) when it did not answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStats {
    pub stream: &'static str,
    pub messages: u64,
    pub bytes: u64,
    /// Messages ever stored (the last sequence: publishes the duplicate window kept).
    pub stored_total: u64,
    /// The stream's `max_bytes` when it has one (None: unlimited by its own config).
    pub max_bytes: Option<u64>,
    /// The leader's server name; `None` on a server without clustering.
    pub leader: Option<String>,
    pub consumers: Vec<ConsumerStats>,
    pub error: Option<String>,
}

/// Samples every stream of [`SAMPLED`] once.
pub(super) async fn poll(context: &jetstream::Context) -> Vec<StreamStats> {
    let mut out = Vec::with_capacity(SAMPLED.len());
    for (stream, consumers) in SAMPLED {
        out.push(poll_stream(context, stream, consumers).await);
    }
    out
}

async fn poll_stream(
    context: &jetstream::Context,
    stream: &'static str,
    consumers: &[&'static str],
) -> StreamStats {
    let mut stats = StreamStats {
        stream,
        messages: 0,
        bytes: 0,
        stored_total: 0,
        max_bytes: None,
        leader: None,
        consumers: Vec::with_capacity(consumers.len()),
        error: None,
    };
    let handle = match context.get_stream(stream).await {
        Ok(handle) => handle,
        Err(e) => {
            stats.error = Some(e.to_string());
            return stats;
        }
    };
    let info = handle.cached_info();
    stats.messages = info.state.messages;
    stats.bytes = info.state.bytes;
    stats.stored_total = info.state.last_sequence;
    stats.max_bytes = u64::try_from(info.config.max_bytes).ok().filter(|b| *b > 0);
    stats.leader = info.cluster.as_ref().and_then(|c| c.leader.clone()).filter(|l| !l.is_empty());
    for consumer in consumers {
        match handle.consumer_info(consumer).await {
            Ok(c) => stats.consumers.push(ConsumerStats {
                consumer,
                pending: c.num_pending,
                ack_pending: c.num_ack_pending as u64,
                delivered: c.delivered.consumer_sequence,
                redelivered: c.num_redelivered as u64,
            }),
            Err(e) => {
                stats.error.get_or_insert_with(|| format!("consumer {consumer}: {e}"));
            }
        }
    }
    stats
}
