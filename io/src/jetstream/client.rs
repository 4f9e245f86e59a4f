//! The connection to NATS ([`Log`]): one client and one JetStream context built from a
//! validated [`LogConfig`], and what is done with them as a whole: the streams, consumers and
//! KV buckets ensured idempotently (a second call with the same config changes nothing; an
//! existing stream's replicas are never lowered), the publisher and the two pull consumers
//! handed out, the lag and placement polled, buffered acks flushed.
//!
//! What it is not: publishing (`publisher.rs`), pulling and settling (`consumer.rs`), or the
//! dead-letter listing and replay (`dlq.rs`, which adds its calls to [`Log`]).
//!
//! Read next: `publisher.rs`.

use async_nats::jetstream::{self, stream};

use super::config::{ms, server_urls, LogConfig};
use super::consumer::PullSource;
use super::error::LogError;
use super::lag::{self, LagSample, StreamPlacement};
use super::names::{
    EVENTS_STREAM, LEASES_BUCKET, MODES_BUCKET, ORDERS_STREAM, ORDER_WRITER_CONSUMER,
    REDIS_SYNC_CONSUMER, REPLICATED_STREAMS,
};
use super::publisher::Publisher;
use super::streams::{
    dlq_stream_config, events_stream_config, leases_stream_config, modes_stream_config,
    orders_stream_config, pull_consumer_config, refuse_lowering,
};

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
            .ping_interval(ms(config.ping_interval_ms))
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
            self.ensure_consumer(stream, durable).await?;
        }
        Ok(())
    }

    async fn ensure_consumer(&self, stream: &str, durable: &str) -> Result<(), LogError> {
        let config = pull_consumer_config(&self.config, durable);
        self.context.create_consumer_on_stream(config, stream).await.map_err(|e| {
            LogError::Api { op: "ensure consumer", message: e.to_string(), transient: false }
        })?;
        Ok(())
    }

    /// Deletes `order-writer` and creates it again with the same config: the new consumer
    /// delivers every message `SECKILL_ORDERS` holds, the stranded ones included (`strand.rs`).
    /// Pulls bound to the old one fail until it is back, then reach the new one by name.
    pub async fn recreate_order_writer(&self) -> Result<(), LogError> {
        let api = |e: &dyn std::fmt::Display| LogError::Api {
            op: "recreate consumer",
            message: e.to_string(),
            transient: true,
        };
        let stream = self.context.get_stream(ORDERS_STREAM).await.map_err(|e| api(&e))?;
        // Gone already (another instance's repair) is as good as deleted.
        if let Err(e) = stream.delete_consumer(ORDER_WRITER_CONSUMER).await {
            tracing::debug!(error = %e, "order-writer delete before recreation failed");
        }
        self.ensure_consumer(ORDERS_STREAM, ORDER_WRITER_CONSUMER).await
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

    /// Each stream's messages, bytes, byte limit and leader, and its consumers' pending counts
    /// (the dependency metrics, `stats.rs`).
    pub async fn poll_stats(&self) -> Vec<super::stats::StreamStats> {
        super::stats::poll(&self.context).await
    }

    /// Polls the `order-writer` backlog once (see [`LogLag`](super::lag::LogLag)).
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

/// The server said the stream does not exist (a first start), as opposed to not answering.
fn is_stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}
