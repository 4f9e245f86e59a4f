//! The JetStream client of the replicated log (CONTRACT.md section 6, DESIGN.md sections 2–5):
//! its configuration, the three streams and two durable consumers, publishing with
//! `Nats-Msg-Id`, pulling and settling deliveries, the dead-letter path and the lag observer.
//!
//! What it is:
//! - `names.rs`: every stream, subject, consumer, bucket and header name (CONTRACT.md).
//! - [`LogError`] (`error.rs`): the one error type, with `is_transient` and
//!   `is_outcome_unknown`.
//! - [`LogConfig`] (`config.rs`): every knob spelled out (replicas, duplicate window, ack wait,
//!   deliveries, backoff, publish timeout, the bound on outstanding publish acks), validated
//!   against the server's and the client's limits ([`LogConfig::validate`]).
//! - `streams.rs`: the streams, buckets and consumers as configuration values, and the rule
//!   that an existing stream's replicas are never lowered.
//! - [`Log`] (`client.rs`): a connection plus a JetStream context built from the config;
//!   [`Log::ensure_streams`] / [`Log::ensure_consumers`] create or update
//!   `SECKILL_ORDERS`, `SECKILL_EVENTS`, `SECKILL_DLQ`, `order-writer` and `redis-sync`
//!   idempotently (a second call with the same config changes nothing).
//! - [`Publisher`] (`publisher.rs`): publishes with `Nats-Msg-Id` and `traceparent`, awaits the
//!   ack within a timeout, retries "no stream found" (a stream leader change), and never has
//!   more acks outstanding than the config allows.
//! - [`PullSource`] / [`Delivery`] (`consumer.rs`): pulling a batch, ack / NAK-with-delay /
//!   TERM, and [`Publisher::dead_letter`].
//! - `dlq.rs`: dead letters listed, replayed to their source subject, or discarded
//!   ([`Log::dead_letters`], [`Log::replay_dead_letter`], [`Log::discard_dead_letter`]).
//! - [`LogLag`] (`lag.rs`): the `order-writer` pending count and oldest pending age, polled
//!   from JetStream and readable through a cheap shared handle (the edge's admission);
//!   [`Log::poll_placement`]: each replicated stream's configured and current replicas
//!   (gauges `flashsale_log_stream_replicas{stream}` / `..._current{stream}`).
//! - [`StrandWatch`] (`strand.rs`): messages the work queue holds below `order-writer`'s
//!   floor (a stream store that lost its sequence), seen from the lag samples, and
//!   [`Log::recreate_order_writer`], the repair.
//! - `stats.rs` — [`Log::poll_stats`]: each stream's messages, bytes, byte limit and leader,
//!   its consumers' pending counts (the edge's dependency metrics).
//!
//! Replicas: every stream and the mode bucket get `LogConfig::replicas` copies (`[log]
//! replicas`, 1 on one machine, 3 on a cluster); an existing stream is never lowered.
//!
//! What it is not: a business decision. Whether a delivery is acked, NAKed or dead-lettered is
//! the worker's sans-I/O classification (`pg-worker/src/classify.rs`); this module only does
//! what it is told and reports what the server said. It never talks to Redis or PostgreSQL.
//!
//! Server compatibility: nats-server 2.9.10 (FIELD-NOTES.md). async-nats is built without the
//! `server_2_10+` features, so no config field a 2.9 server does not know is ever sent; no
//! filter subjects on consumers (the 2.9 extended create API is used without one).
//!
//! Layout: this file only declares the children and re-exports what callers use; no child
//! imports it (each takes what it shares from its sibling: the error from `error.rs`, the names
//! from `names.rs`, the config from `config.rs`), so the folder has no import circle.
//!
//! Read next: `wire/` (message bodies), `pg-worker/src/worker/order_writer_task.rs` (the consumer loop).

mod client;
mod config;
mod consumer;
mod dlq;
mod error;
mod lag;
mod names;
mod publisher;
mod stats;
mod strand;
mod streams;

/// The client crate, for callers (tests, tools) that inspect streams directly.
pub use async_nats;
pub use client::Log;
pub use config::{LogConfig, CLIENT_ACKS_OUTSTANDING_LIMIT, DUPLICATE_WINDOW_MIN_MS};
pub use consumer::header_text;
pub use consumer::{Delivery, PullSource};
pub use dlq::{DeadLetter, DeadLetterPage, Replay, DLQ_SCAN_MAX};
pub use error::LogError;
pub use lag::{record_placement, LagSample, LogLag, StreamPlacement};
pub use names::{
    DLQ_CONSUMER_HEADER, DLQ_DELIVERIES_HEADER, DLQ_ERROR_HEADER, DLQ_ORIGINAL_MSG_ID_HEADER,
    DLQ_STREAM, DLQ_STREAM_SEQUENCE_HEADER, DLQ_SUBJECTS, DLQ_SUBJECT_HEADER, EVENTS_STREAM,
    EVENTS_SUBJECTS, LEASES_BUCKET, LEASES_STREAM, MODES_BUCKET, MODES_STREAM, ORDERS_STREAM,
    ORDER_CREATE_SUBJECT, ORDER_WRITER_CONSUMER, ORDER_WRITER_DLQ_SUBJECT, REDIS_SYNC_CONSUMER,
    REDIS_SYNC_DLQ_SUBJECT, REPLICATED_STREAMS, STOCK_RETURNED_PREFIX, TRACEPARENT_HEADER,
};
pub use publisher::{event_msg_id, PublishAck, Publisher};
pub use stats::{ConsumerStats, StreamStats};
pub use strand::{StrandWatch, RECREATION_LOG};
pub use streams::{
    dlq_stream_config, events_stream_config, leases_stream_config, modes_stream_config,
    orders_stream_config, pull_consumer_config,
};
