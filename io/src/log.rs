//! The JetStream side of the replicated log (CONTRACT.md section 6, DESIGN.md sections 2–5):
//! its configuration, the three streams and two durable consumers, publishing with
//! `Nats-Msg-Id`, pulling and settling deliveries, the dead-letter path and the lag observer.
//!
//! What it is:
//! - [`LogConfig`]: every knob spelled out (replicas, duplicate window, ack wait, deliveries,
//!   backoff, publish timeout, the bound on outstanding publish acks), validated against the
//!   server's and the client's limits ([`LogConfig::validate`]).
//! - [`Log`]: a connection plus a JetStream context built from the config;
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
//! Read next: `wire.rs` (message bodies), `pg-worker/src/worker.rs` (the consumer loop).

mod consumer;
mod dlq;
mod lag;
mod publisher;

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};

/// The client crate, for callers (tests, tools) that inspect streams directly.
pub use async_nats;
pub use consumer::header_text;
pub use consumer::{Delivery, PullSource};
pub use dlq::{DeadLetter, DeadLetterPage, Replay, DLQ_SCAN_MAX};
pub use lag::{record_placement, LagSample, LogLag, StreamPlacement};
pub use publisher::{event_msg_id, PublishAck, Publisher};

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

/// The JetStream KV bucket of degradation-mode snapshots (engine `control.rs`).
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

/// The contract's floor for the publish dedup window (CONTRACT.md section 6): a republish by
/// the scanner within it is dropped by JetStream; after it, by the PostgreSQL inbox.
pub const DUPLICATE_WINDOW_MIN_MS: u64 = 10 * 60 * 1000;

/// async-nats blocks (or fails) publishing once this many publish acks are outstanding on one
/// context (its default `max_ack_inflight`, FIELD-NOTES.md). Our own bound must stay below it.
pub const CLIENT_ACKS_OUTSTANDING_LIMIT: usize = 5_000;

/// Every failure of the log client.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A configuration that the server or client would refuse or silently change.
    #[error("invalid log configuration: {0}")]
    Config(String),
    #[error("cannot connect to NATS at {url}: {message}")]
    Connect { url: String, message: String },
    /// No ack within the publish timeout: the message may or may not be in the stream
    /// ("unknown is a state"); republishing with the same `Nats-Msg-Id` is safe.
    #[error("publish to {subject}: no ack within {timeout_ms} ms (outcome unknown)")]
    PublishTimeout { subject: String, timeout_ms: u64 },
    /// No stream answered for the subject until the deadline (a leader change that outlasted
    /// the publish timeout, or the streams were never created).
    #[error("publish to {subject}: no stream found (retried until the deadline)")]
    NoStream { subject: String },
    #[error("publish to {subject} failed: {message}")]
    Publish { subject: String, message: String, transient: bool },
    /// A JetStream API call (stream/consumer management, info) failed.
    #[error("jetstream {op}: {message}")]
    Api { op: &'static str, message: String, transient: bool },
    /// Pulling messages failed (connection trouble, consumer deleted).
    #[error("fetch from {consumer}: {message}")]
    Fetch { consumer: &'static str, message: String },
    /// Sending an ack/NAK/TERM failed. The server redelivers after `ack_wait`.
    #[error("{kind} failed: {message}")]
    Ack { kind: &'static str, message: String },
}

impl LogError {
    /// Worth retrying later with the same input.
    pub fn is_transient(&self) -> bool {
        match self {
            LogError::Config(_) => false,
            LogError::Connect { .. }
            | LogError::PublishTimeout { .. }
            | LogError::NoStream { .. }
            | LogError::Fetch { .. }
            | LogError::Ack { .. } => true,
            LogError::Publish { transient, .. } | LogError::Api { transient, .. } => *transient,
        }
    }

    /// True when a publish may have succeeded although we got no ack.
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, LogError::PublishTimeout { .. })
    }
}

/// The log client's configuration. `Default` is the production setting for one machine; every
/// field is spelled out so the caller sees what it gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    /// `nats://host:port`, comma-separated for a cluster.
    pub url: String,
    /// Stream replicas: 1 on one machine, 3 in a cluster (`log.replicas`).
    pub replicas: usize,
    /// JetStream's publish dedup window for `Nats-Msg-Id`; at least
    /// [`DUPLICATE_WINDOW_MIN_MS`].
    pub duplicate_window_ms: u64,
    /// How long the server waits for an ack before redelivering a message.
    pub ack_wait_ms: u64,
    /// Deliveries per message before the server stops redelivering; the worker dead-letters a
    /// message that fails on its last delivery.
    pub max_deliver: u32,
    /// Server-side redelivery schedule after unacknowledged deliveries (JetStream `BackOff`):
    /// entry `i` is the ack wait of delivery `i + 1`, the last entry repeats. Empty: every
    /// delivery waits `ack_wait_ms`. The server replaces `ack_wait` by the first entry, so a
    /// non-empty list must start with `ack_wait_ms`; it must be shorter than `max_deliver`.
    pub backoff_ms: Vec<u64>,
    /// Most unacknowledged deliveries per consumer; the server stops delivering past it.
    pub max_ack_pending: u32,
    /// Longest a publish waits for its ack, retries included.
    pub publish_timeout_ms: u64,
    /// First pause before retrying a publish that found no stream; doubles per retry, bounded
    /// by the publish timeout.
    pub no_stream_retry_ms: u64,
    /// Most publish acks outstanding on one [`Log`] at a time (below
    /// [`CLIENT_ACKS_OUTSTANDING_LIMIT`]); a publish beyond it waits for a free slot within its
    /// timeout.
    pub publish_acks_outstanding_max: usize,
    /// Bound on JetStream API requests (stream/consumer management and info).
    pub request_timeout_ms: u64,
    /// Bound on establishing the connection.
    pub connect_timeout_ms: u64,
    /// `SECKILL_ORDERS` is a work queue: acked messages leave it, so these bound the backlog.
    /// A full stream refuses publishes (the edge then answers `QUEUED_PENDING` / closes
    /// submissions) instead of dropping queued reservations.
    pub orders_max_bytes: i64,
    pub orders_max_messages: i64,
    /// Age after which an unprocessed order-create message is dropped by the server; the
    /// republish scanner and the reconcile report cover anything that old.
    pub orders_max_age_ms: u64,
    /// How long events stay in `SECKILL_EVENTS` (kept after `redis-sync` acks them, for
    /// replay and debugging).
    pub events_max_age_ms: u64,
    /// How long dead letters stay in `SECKILL_DLQ`.
    pub dlq_max_age_ms: u64,
}

impl Default for LogConfig {
    fn default() -> LogConfig {
        LogConfig {
            url: "nats://127.0.0.1:4222".to_owned(),
            replicas: 1,
            duplicate_window_ms: 15 * 60 * 1000,
            ack_wait_ms: 30_000,
            max_deliver: 20,
            backoff_ms: vec![30_000, 60_000, 120_000],
            max_ack_pending: 10_000,
            publish_timeout_ms: 2_000,
            no_stream_retry_ms: 25,
            publish_acks_outstanding_max: 4_096,
            request_timeout_ms: 5_000,
            connect_timeout_ms: 5_000,
            orders_max_bytes: 1 << 30,
            orders_max_messages: 2_000_000,
            orders_max_age_ms: 24 * 3600 * 1000,
            events_max_age_ms: 7 * 24 * 3600 * 1000,
            dlq_max_age_ms: 30 * 24 * 3600 * 1000,
        }
    }
}

// The defaults themselves respect the limits validate() checks.
const _: () = assert!(CLIENT_ACKS_OUTSTANDING_LIMIT > 4_096);

impl LogConfig {
    /// Refuses what the server would refuse or silently change, and what would break a
    /// contract: a dedup window under 10 minutes, outstanding acks at the client's limit,
    /// a backoff list the server would turn into a different ack wait.
    pub fn validate(&self) -> Result<(), LogError> {
        let bad = |message: String| Err(LogError::Config(message));
        if server_urls(&self.url).is_empty() {
            return bad("url: no server given".into());
        }
        for url in server_urls(&self.url) {
            if url.parse::<async_nats::ServerAddr>().is_err() {
                return bad(format!("url: cannot parse {url:?}"));
            }
        }
        if !(1..=5).contains(&self.replicas) {
            return bad(format!("replicas {} must be within 1..=5", self.replicas));
        }
        if self.duplicate_window_ms < DUPLICATE_WINDOW_MIN_MS {
            return bad(format!(
                "duplicate_window_ms {} is below the contract's 10 minutes ({DUPLICATE_WINDOW_MIN_MS})",
                self.duplicate_window_ms
            ));
        }
        for (name, max_age_ms) in [
            ("orders_max_age_ms", self.orders_max_age_ms),
            ("events_max_age_ms", self.events_max_age_ms),
            ("dlq_max_age_ms", self.dlq_max_age_ms),
        ] {
            // The server refuses a dedup window longer than the stream's max age.
            if max_age_ms < self.duplicate_window_ms {
                return bad(format!("{name} {max_age_ms} is below duplicate_window_ms"));
            }
        }
        if self.ack_wait_ms < 100 {
            return bad(format!("ack_wait_ms {} is below 100", self.ack_wait_ms));
        }
        if self.max_deliver < 1 {
            return bad("max_deliver must be at least 1".into());
        }
        if let Some(&first) = self.backoff_ms.first() {
            if first != self.ack_wait_ms {
                return bad(format!(
                    "backoff_ms starts with {first} but ack_wait_ms is {}: the server would \
                     replace ack_wait by the first backoff entry",
                    self.ack_wait_ms
                ));
            }
            if self.backoff_ms.len() >= self.max_deliver as usize {
                return bad(format!(
                    "backoff_ms has {} entries; the server requires fewer than max_deliver ({})",
                    self.backoff_ms.len(),
                    self.max_deliver
                ));
            }
            if self.backoff_ms.contains(&0) {
                return bad("backoff_ms entries must be positive".into());
            }
        }
        if self.max_ack_pending < 1 {
            return bad("max_ack_pending must be at least 1".into());
        }
        if self.publish_timeout_ms == 0 || self.request_timeout_ms == 0 {
            return bad("publish_timeout_ms and request_timeout_ms must be positive".into());
        }
        if self.connect_timeout_ms == 0 || self.no_stream_retry_ms == 0 {
            return bad("connect_timeout_ms and no_stream_retry_ms must be positive".into());
        }
        if self.publish_acks_outstanding_max == 0
            || self.publish_acks_outstanding_max >= CLIENT_ACKS_OUTSTANDING_LIMIT
        {
            return bad(format!(
                "publish_acks_outstanding_max {} must be within 1..{CLIENT_ACKS_OUTSTANDING_LIMIT}",
                self.publish_acks_outstanding_max
            ));
        }
        if self.orders_max_bytes < 1 || self.orders_max_messages < 1 {
            return bad("orders_max_bytes and orders_max_messages must be positive".into());
        }
        Ok(())
    }
}

fn server_urls(url: &str) -> Vec<&str> {
    url.split(',').map(str::trim).filter(|u| !u.is_empty()).collect()
}

fn ms(value: u64) -> Duration {
    Duration::from_millis(value)
}

/// `SECKILL_ORDERS`: a work queue (acked messages leave it, so the stream IS the backlog and
/// its limits bound the backlog), discard-new (a full backlog refuses publishes rather than
/// dropping queued reservations), file storage.
pub fn orders_stream_config(config: &LogConfig) -> stream::Config {
    stream::Config {
        name: ORDERS_STREAM.to_owned(),
        subjects: vec![ORDER_CREATE_SUBJECT.to_owned()],
        retention: stream::RetentionPolicy::WorkQueue,
        discard: stream::DiscardPolicy::New,
        storage: stream::StorageType::File,
        num_replicas: config.replicas,
        duplicate_window: ms(config.duplicate_window_ms),
        max_bytes: config.orders_max_bytes,
        max_messages: config.orders_max_messages,
        max_age: ms(config.orders_max_age_ms),
        ..Default::default()
    }
}

/// `SECKILL_EVENTS`: kept by age after `redis-sync` acks them (replay, debugging).
pub fn events_stream_config(config: &LogConfig) -> stream::Config {
    stream::Config {
        name: EVENTS_STREAM.to_owned(),
        subjects: vec![EVENTS_SUBJECTS.to_owned()],
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        storage: stream::StorageType::File,
        num_replicas: config.replicas,
        duplicate_window: ms(config.duplicate_window_ms),
        max_age: ms(config.events_max_age_ms),
        ..Default::default()
    }
}

/// `SECKILL_DLQ`: kept by age for an operator.
pub fn dlq_stream_config(config: &LogConfig) -> stream::Config {
    stream::Config {
        name: DLQ_STREAM.to_owned(),
        subjects: vec![DLQ_SUBJECTS.to_owned()],
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        storage: stream::StorageType::File,
        num_replicas: config.replicas,
        duplicate_window: ms(config.duplicate_window_ms),
        max_age: ms(config.dlq_max_age_ms),
        ..Default::default()
    }
}

/// The mode bucket's stream (`KV_flashsale_modes`) with the KV layout `get_key_value` binds
/// to, replicated like the log's streams.
pub fn modes_stream_config(config: &LogConfig) -> stream::Config {
    stream::Config {
        name: MODES_STREAM.to_owned(),
        description: Some("flashsale degradation-mode snapshots, one key per scope".into()),
        subjects: vec![format!("$KV.{MODES_BUCKET}.>")],
        max_messages_per_subject: 5,
        max_message_size: 8 * 1024,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        num_replicas: config.replicas,
        ..Default::default()
    }
}

/// The lease bucket's stream (`KV_flashsale_leases`): the KV layout, one message per key,
/// messages expiring after `lease_ms` (the lease period; the same on every instance).
pub fn leases_stream_config(config: &LogConfig, lease_ms: u64) -> stream::Config {
    stream::Config {
        name: LEASES_STREAM.to_owned(),
        description: Some("flashsale leases among engine instances, one key per job".into()),
        subjects: vec![format!("$KV.{LEASES_BUCKET}.>")],
        max_messages_per_subject: 1,
        max_message_size: 1024,
        max_age: ms(lease_ms),
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        num_replicas: config.replicas,
        ..Default::default()
    }
}

/// Refuses a configured replica count below what an existing stream has.
fn refuse_lowering(stream: &str, current: usize, configured: usize) -> Result<(), LogError> {
    if configured < current {
        return Err(LogError::Config(format!(
            "log replicas = {configured} ([log] replicas / FLASHSALE_LOG_REPLICAS) is below \
             stream {stream}'s current {current} replicas: an existing stream is never lowered; \
             set replicas = {current} (or lower the stream by hand, knowingly)"
        )));
    }
    Ok(())
}

fn is_stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

/// A durable pull consumer with explicit acks and the config's delivery policy.
pub fn pull_consumer_config(config: &LogConfig, durable: &str) -> pull::Config {
    pull::Config {
        durable_name: Some(durable.to_owned()),
        deliver_policy: jetstream::consumer::DeliverPolicy::All,
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: ms(config.ack_wait_ms),
        max_deliver: i64::from(config.max_deliver),
        backoff: config.backoff_ms.iter().copied().map(ms).collect(),
        max_ack_pending: i64::from(config.max_ack_pending),
        ..Default::default()
    }
}

/// One connection to NATS and a JetStream context built from a validated [`LogConfig`].
/// Cheap to clone (the client and context are handles).
#[derive(Clone)]
pub struct Log {
    client: async_nats::Client,
    context: jetstream::Context,
    config: LogConfig,
}

impl Log {
    /// Validates the config and connects (bounded by `connect_timeout_ms`). Must run on a
    /// tokio runtime: async-nats spawns its connection task there.
    pub async fn connect(config: &LogConfig) -> Result<Log, LogError> {
        config.validate()?;
        let urls = server_urls(&config.url);
        let options = async_nats::ConnectOptions::new()
            .name("flashsale")
            .connection_timeout(ms(config.connect_timeout_ms))
            .request_timeout(Some(ms(config.request_timeout_ms)));
        let client = tokio::time::timeout(
            // One connect attempt per server, each bounded by the connection timeout.
            ms(config.connect_timeout_ms.saturating_mul(urls.len() as u64 + 1)),
            async_nats::connect_with_options(urls.as_slice(), options),
        )
        .await
        .map_err(|_| LogError::Connect { url: config.url.clone(), message: "timed out".into() })?
        .map_err(|e| LogError::Connect { url: config.url.clone(), message: e.to_string() })?;
        let context = jetstream::ContextBuilder::new()
            .timeout(ms(config.publish_timeout_ms.max(config.request_timeout_ms)))
            .max_ack_inflight(config.publish_acks_outstanding_max)
            // Past the bound a publish waits for a slot (within its own timeout) instead of
            // failing: the bound is a queue limit, not an error.
            .backpressure_on_inflight(true)
            .build(client.clone());
        Ok(Log { client, context, config: config.clone() })
    }

    pub fn config(&self) -> &LogConfig {
        &self.config
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    pub fn context(&self) -> &jetstream::Context {
        &self.context
    }

    /// Creates the three streams, or updates them to this config (idempotent: the same config
    /// again is a no-op). Immutable settings that differ (e.g. retention) are reported as
    /// errors for an operator rather than silently kept; so is a `replicas` below an existing
    /// stream's (see [`Log::ensure_stream`]).
    pub async fn ensure_streams(&self) -> Result<(), LogError> {
        for stream_config in [
            orders_stream_config(&self.config),
            events_stream_config(&self.config),
            dlq_stream_config(&self.config),
        ] {
            self.ensure_stream(stream_config).await?;
        }
        Ok(())
    }

    /// Creates one stream or updates it to `config`. An existing stream is never lowered: a
    /// config with fewer replicas than the stream has is refused, naming the setting and the
    /// stream's current replicas (lowering R3 to R1 on a restart with a stale setting would
    /// silently drop the copies that let the log survive a node). Raising is an ordinary
    /// update; nats-server 2.9 applies it (checked by `tests/tests/ha_log.rs`).
    pub async fn ensure_stream(&self, config: stream::Config) -> Result<(), LogError> {
        let api = |op, e: &dyn std::fmt::Display, transient| LogError::Api {
            op,
            message: e.to_string(),
            transient,
        };
        match self.context.get_stream(&config.name).await {
            Ok(existing) => {
                let current = existing.cached_info().config.num_replicas;
                refuse_lowering(&config.name, current, config.num_replicas)?;
            }
            Err(e) if is_stream_not_found(&e) => {}
            Err(e) => return Err(api("ensure stream", &e, true)),
        }
        self.context.create_or_update_stream(config).await.map_err(|e| {
            let transient = matches!(
                e.kind(),
                jetstream::context::CreateStreamErrorKind::TimedOut
                    | jetstream::context::CreateStreamErrorKind::JetStreamUnavailable
            );
            api("ensure stream", &e, transient)
        })?;
        Ok(())
    }

    /// Where each replicated stream's copies stand now ([`REPLICATED_STREAMS`], the mode
    /// bucket included): configured replicas and the peers current per the stream info's
    /// cluster section. A stream that does not answer (no leader) reports 0 current peers.
    pub async fn poll_placement(&self) -> Vec<StreamPlacement> {
        let mut placements = Vec::with_capacity(REPLICATED_STREAMS.len());
        for stream in REPLICATED_STREAMS {
            let placement = lag::placement(&self.context, stream, self.config.replicas).await;
            placements.push(placement);
        }
        placements
    }

    /// Creates `order-writer` on `SECKILL_ORDERS` and `redis-sync` on `SECKILL_EVENTS`, or
    /// updates them to this config (idempotent).
    pub async fn ensure_consumers(&self) -> Result<(), LogError> {
        for (stream, durable) in
            [(ORDERS_STREAM, ORDER_WRITER_CONSUMER), (EVENTS_STREAM, REDIS_SYNC_CONSUMER)]
        {
            let config = pull_consumer_config(&self.config, durable);
            self.context.create_consumer_on_stream(config, stream).await.map_err(|e| {
                LogError::Api { op: "ensure consumer", message: e.to_string(), transient: false }
            })?;
        }
        Ok(())
    }

    /// A publisher sharing this connection and its outstanding-ack bound.
    pub fn publisher(&self) -> Publisher {
        Publisher::new(self.context.clone(), &self.config)
    }

    /// The `order-writer` consumer (created by [`Log::ensure_consumers`]).
    pub async fn order_writer(&self) -> Result<PullSource, LogError> {
        PullSource::bind(&self.context, ORDERS_STREAM, ORDER_WRITER_CONSUMER).await
    }

    /// The `redis-sync` consumer (created by [`Log::ensure_consumers`]).
    pub async fn redis_sync(&self) -> Result<PullSource, LogError> {
        PullSource::bind(&self.context, EVENTS_STREAM, REDIS_SYNC_CONSUMER).await
    }

    /// Polls the `order-writer` backlog once (see [`LogLag`]).
    pub async fn poll_order_writer_lag(&self, now_ms: u64) -> Result<LagSample, LogError> {
        lag::poll(&self.context, ORDERS_STREAM, ORDER_WRITER_CONSUMER, now_ms).await
    }

    /// The degradation-mode bucket (one key per scope; created on first use). A KV bucket is a
    /// JetStream stream, replicated like the others, and it is not the Redis whose failure a
    /// mode change may be about. The stream is created here with the KV layout rather than
    /// through `create_key_value`, whose account query does not parse nats-server 2.9's answer.
    pub async fn mode_store(&self) -> Result<jetstream::kv::Store, LogError> {
        let api = |e: &dyn std::fmt::Display| LogError::Api {
            op: "mode bucket",
            message: e.to_string(),
            transient: true,
        };
        self.ensure_stream(modes_stream_config(&self.config)).await?;
        self.context.get_key_value(MODES_BUCKET).await.map_err(|e| api(&e))
    }

    /// The lease bucket (created or updated to `lease_ms` on first use; see
    /// [`leases_stream_config`]).
    pub async fn lease_store(&self, lease_ms: u64) -> Result<jetstream::kv::Store, LogError> {
        self.ensure_stream(leases_stream_config(&self.config, lease_ms)).await?;
        self.context.get_key_value(LEASES_BUCKET).await.map_err(|e| LogError::Api {
            op: "lease bucket",
            message: e.to_string(),
            transient: true,
        })
    }

    /// Sends everything buffered (acks included) to the server; call before dropping the
    /// connection in a graceful shutdown.
    pub async fn flush(&self) -> Result<(), LogError> {
        self.client
            .flush()
            .await
            .map_err(|e| LogError::Ack { kind: "flush", message: e.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_is_valid() {
        LogConfig::default().validate().expect("default is valid");
    }

    #[test]
    fn validation_refuses_what_the_server_or_the_contract_would() {
        type Mutation = Box<dyn Fn(&mut LogConfig)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("duplicate_window_ms", Box::new(|c| c.duplicate_window_ms = 599_999)),
            ("publish_acks_outstanding_max", Box::new(|c| c.publish_acks_outstanding_max = 5_000)),
            ("publish_acks_outstanding_max", Box::new(|c| c.publish_acks_outstanding_max = 0)),
            ("backoff_ms starts", Box::new(|c| c.backoff_ms = vec![1_000, 2_000])),
            ("fewer than max_deliver", Box::new(|c| c.max_deliver = 3)),
            ("url", Box::new(|c| c.url = " , ".into())),
            ("replicas", Box::new(|c| c.replicas = 0)),
            ("events_max_age_ms", Box::new(|c| c.events_max_age_ms = 1_000)),
            ("ack_wait_ms", Box::new(|c| c.ack_wait_ms = 10)),
        ];
        for (needle, mutate) in cases {
            let mut config = LogConfig::default();
            mutate(&mut config);
            match config.validate() {
                Err(e @ LogError::Config(_)) => {
                    assert!(e.to_string().contains(needle), "{needle}: {e}");
                    assert!(!e.is_transient());
                }
                other => panic!("{needle}: expected a config error, got {other:?}"),
            }
        }
        // The exact floor is allowed.
        let config =
            LogConfig { duplicate_window_ms: DUPLICATE_WINDOW_MIN_MS, ..Default::default() };
        config.validate().expect("10 minutes is enough");
        let config = LogConfig { backoff_ms: vec![], ..Default::default() };
        config.validate().expect("no backoff list");
    }

    #[test]
    fn stream_configs_match_the_contract() {
        let config = LogConfig { replicas: 3, ..Default::default() };
        let orders = orders_stream_config(&config);
        assert_eq!(orders.name, "SECKILL_ORDERS");
        assert_eq!(orders.subjects, vec!["seckill.order.create".to_owned()]);
        assert_eq!(orders.storage, stream::StorageType::File);
        assert_eq!(orders.num_replicas, 3);
        assert_eq!(orders.duplicate_window, Duration::from_secs(15 * 60));
        assert_eq!(orders.retention, stream::RetentionPolicy::WorkQueue);
        let events = events_stream_config(&config);
        assert_eq!(events.subjects, vec!["seckill.event.>".to_owned()]);
        let dlq = dlq_stream_config(&config);
        assert_eq!(dlq.subjects, vec!["seckill.dlq.>".to_owned()]);
        let consumer = pull_consumer_config(&config, ORDER_WRITER_CONSUMER);
        assert_eq!(consumer.durable_name.as_deref(), Some("order-writer"));
        assert_eq!(consumer.ack_policy, jetstream::consumer::AckPolicy::Explicit);
        assert_eq!(consumer.max_deliver, 20);
        assert_eq!(consumer.backoff.len(), 3);
        assert!(consumer.filter_subject.is_empty(), "2.9 servers: no filter subject");
    }

    #[test]
    fn lowering_replicas_is_refused_naming_the_setting_and_the_current_count() {
        let e = refuse_lowering(ORDERS_STREAM, 3, 1).unwrap_err();
        let text = e.to_string();
        for needle in ["[log] replicas", "FLASHSALE_LOG_REPLICAS", "SECKILL_ORDERS", "current 3"] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
        assert!(!e.is_transient());
        refuse_lowering(ORDERS_STREAM, 1, 3).expect("raising is an update");
        refuse_lowering(ORDERS_STREAM, 3, 3).expect("the same is a no-op");
        let modes = modes_stream_config(&LogConfig { replicas: 3, ..Default::default() });
        assert_eq!((modes.name.as_str(), modes.num_replicas), (MODES_STREAM, 3));
        assert_eq!(format!("KV_{MODES_BUCKET}"), MODES_STREAM);
    }

    #[test]
    fn transient_classification() {
        assert!(LogError::PublishTimeout { subject: "s".into(), timeout_ms: 1 }.is_transient());
        assert!(
            LogError::PublishTimeout { subject: "s".into(), timeout_ms: 1 }.is_outcome_unknown()
        );
        assert!(LogError::NoStream { subject: "s".into() }.is_transient());
        assert!(!LogError::NoStream { subject: "s".into() }.is_outcome_unknown());
        assert!(!LogError::Config("x".into()).is_transient());
        assert!(!LogError::Publish { subject: "s".into(), message: "m".into(), transient: false }
            .is_transient());
    }
}
