//! What the log looks like on the server, as configuration values: the three streams
//! (`SECKILL_ORDERS`, `SECKILL_EVENTS`, `SECKILL_DLQ`), the two KV buckets' streams (modes,
//! leases), the durable pull consumers, and the rule that a stream's replicas are never
//! lowered ([`refuse_lowering`]).
//!
//! What it is not: I/O. These functions build `async_nats` config structs from a
//! [`LogConfig`]; creating or updating them on the server is `client.rs` (`Log::ensure_*`).
//!
//! Read next: `client.rs`.

use async_nats::jetstream::{self, consumer::pull, stream};

use super::config::{ms, LogConfig};
use super::error::LogError;
use super::names::{
    DLQ_STREAM, DLQ_SUBJECTS, EVENTS_STREAM, EVENTS_SUBJECTS, LEASES_BUCKET, LEASES_STREAM,
    MODES_BUCKET, MODES_STREAM, ORDERS_STREAM, ORDER_CREATE_SUBJECT,
};

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
pub(super) fn refuse_lowering(
    stream: &str,
    current: usize,
    configured: usize,
) -> Result<(), LogError> {
    if configured < current {
        return Err(LogError::Config(format!(
            "log replicas = {configured} ([log] replicas / FLASHSALE_LOG_REPLICAS) is below \
             stream {stream}'s current {current} replicas: an existing stream is never lowered; \
             set replicas = {current} (or lower the stream by hand, knowingly)"
        )));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::jetstream::names::ORDER_WRITER_CONSUMER;

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
}
