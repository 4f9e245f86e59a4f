//! Every name the other side of the log relies on (CONTRACT.md section 6): the streams, their
//! subjects, the durable consumers and where they dead-letter, the KV buckets and their
//! streams, the stock-returned notice subject, and the message headers flashsale writes.
//!
//! What it is: constants, nothing else. Other programs (operators' tools, the PostgreSQL
//! inbox's consumer group, a newer engine next to an older one) use these exact strings, so
//! they change only with CONTRACT.md.
//!
//! What it is not: how the streams are configured (`streams.rs`) or used (`client.rs`,
//! `publisher.rs`, `consumer.rs`, `dlq.rs`).
//!
//! Read next: `streams.rs`, which turns these names and a `LogConfig` into stream and consumer
//! configurations.

/// Stream of order-create messages.
pub const ORDERS_STREAM: &str = "SECKILL_ORDERS";
/// The one subject of [`ORDERS_STREAM`].
pub const ORDER_CREATE_SUBJECT: &str = "seckill.order.create";
/// Stream of outbox events.
pub const EVENTS_STREAM: &str = "SECKILL_EVENTS";
/// Subjects of [`EVENTS_STREAM`] (`seckill.event.<event_type>`, see `wire::EventType::subject`).
pub const EVENTS_SUBJECTS: &str = "seckill.event.>";
/// Stream of dead letters.
pub const DLQ_STREAM: &str = "SECKILL_DLQ";
/// Subjects of [`DLQ_STREAM`] (`seckill.dlq.<consumer>`).
pub const DLQ_SUBJECTS: &str = "seckill.dlq.>";
/// The durable pull consumer of [`ORDERS_STREAM`] (also the PostgreSQL inbox's consumer group).
pub const ORDER_WRITER_CONSUMER: &str = "order-writer";
/// Where `order-writer` dead-letters.
pub const ORDER_WRITER_DLQ_SUBJECT: &str = "seckill.dlq.order-writer";
/// The durable pull consumer of [`EVENTS_STREAM`].
pub const REDIS_SYNC_CONSUMER: &str = "redis-sync";
/// Where `redis-sync` dead-letters.
pub const REDIS_SYNC_DLQ_SUBJECT: &str = "seckill.dlq.redis-sync";

/// The JetStream KV bucket of degradation-mode snapshots (engine `durable/modes.rs`).
pub const MODES_BUCKET: &str = "flashsale_modes";
/// The stream behind [`MODES_BUCKET`] (JetStream names a bucket's stream `KV_<bucket>`).
pub const MODES_STREAM: &str = "KV_flashsale_modes";
/// The JetStream KV bucket of leases among engine instances (engine `durable/lease.rs`): one
/// key per job, the holder's instance id as the value; an entry not renewed within the
/// bucket's `max_age` is gone, and the next `create` takes the lease.
pub const LEASES_BUCKET: &str = "flashsale_leases";
/// The stream behind [`LEASES_BUCKET`].
pub const LEASES_STREAM: &str = "KV_flashsale_leases";
/// Core NATS (not JetStream) subject prefix of the "stock returned" notice every engine
/// instance subscribes to: `seckill.notice.stock_returned.<activity>.<sku>`, empty body.
pub const STOCK_RETURNED_PREFIX: &str = "seckill.notice.stock_returned";
/// Every stream created with `replicas` copies, as the placement metrics name them.
pub const REPLICATED_STREAMS: [&str; 4] = [ORDERS_STREAM, EVENTS_STREAM, DLQ_STREAM, MODES_STREAM];
/// Header carrying W3C trace context from HTTP into messages and events.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// Dead letters: the error that sent the message there.
pub const DLQ_ERROR_HEADER: &str = "Flashsale-Dlq-Error";
/// Dead letters: the consumer that gave up.
pub const DLQ_CONSUMER_HEADER: &str = "Flashsale-Dlq-Consumer";
/// Dead letters: how often the consumer had received the message.
pub const DLQ_DELIVERIES_HEADER: &str = "Flashsale-Dlq-Deliveries";
/// Dead letters: the message's sequence in its source stream.
pub const DLQ_STREAM_SEQUENCE_HEADER: &str = "Flashsale-Dlq-Stream-Sequence";
/// Dead letters: the source message's `Nats-Msg-Id`, when it had one.
pub const DLQ_ORIGINAL_MSG_ID_HEADER: &str = "Flashsale-Dlq-Original-Msg-Id";
/// Dead letters: the subject the message was consumed from (where a replay publishes it).
pub const DLQ_SUBJECT_HEADER: &str = "Flashsale-Dlq-Subject";
