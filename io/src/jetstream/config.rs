//! The JetStream client's configuration ([`LogConfig`]): every knob spelled out (replicas,
//! duplicate window, ack wait, deliveries, backoff, publish timeout, the bound on outstanding
//! publish acks, the orders backlog's limits), and its validation against the contract's,
//! the server's and the client's limits ([`LogConfig::validate`]).
//!
//! What it is not: I/O. Validation reads no server; what an existing stream already has (its
//! replicas) is checked when the stream is ensured (`client.rs`, `streams::refuse_lowering`).
//!
//! Read next: `streams.rs` (what the config becomes on the server).

use std::time::Duration;

use super::error::LogError;

/// The contract's floor for the publish dedup window (CONTRACT.md section 6): a republish by
/// the scanner within it is dropped by JetStream; after it, by the PostgreSQL inbox.
pub const DUPLICATE_WINDOW_MIN_MS: u64 = 10 * 60 * 1000;

/// async-nats blocks (or fails) publishing once this many publish acks are outstanding on one
/// context (its default `max_ack_inflight`, FIELD-NOTES.md). Our own bound must stay below it.
pub const CLIENT_ACKS_OUTSTANDING_LIMIT: usize = 5_000;

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
    /// Most publish acks outstanding on one [`Log`](super::client::Log) at a time (below
    /// [`CLIENT_ACKS_OUTSTANDING_LIMIT`]); a publish beyond it waits for a free slot within its
    /// timeout.
    pub publish_acks_outstanding_max: usize,
    /// Bound on JetStream API requests (stream/consumer management and info).
    pub request_timeout_ms: u64,
    /// Bound on establishing the connection.
    pub connect_timeout_ms: u64,
    /// How often the client pings a server that has sent nothing; three pings in a row
    /// without a word from it and the connection is dropped and another node tried. A node
    /// cut off without a reset (a partition, a hung process) is left within about three of
    /// these, not the ~3 minutes of the client's 60 s default, while the other nodes serve.
    pub ping_interval_ms: u64,
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
            ping_interval_ms: 2_000,
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
    /// a backoff list the server would turn into a different ack wait. The first broken rule
    /// is reported, in the order of the steps below.
    pub fn validate(&self) -> Result<(), LogError> {
        self.check_servers()?;
        self.check_retention()?;
        self.check_delivery()?;
        self.check_client_bounds()
    }

    /// The servers (`url`) and the stream replicas.
    fn check_servers(&self) -> Result<(), LogError> {
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
        Ok(())
    }

    /// The dedup window against the contract's floor and against every stream's max age.
    fn check_retention(&self) -> Result<(), LogError> {
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
        Ok(())
    }

    /// The consumers' redelivery policy: ack wait, deliveries, backoff, unacknowledged bound.
    fn check_delivery(&self) -> Result<(), LogError> {
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
        Ok(())
    }

    /// The client's timeouts, its outstanding-ack bound and the orders backlog's limits.
    fn check_client_bounds(&self) -> Result<(), LogError> {
        if self.publish_timeout_ms == 0 || self.request_timeout_ms == 0 {
            return bad("publish_timeout_ms and request_timeout_ms must be positive".into());
        }
        if self.connect_timeout_ms == 0
            || self.no_stream_retry_ms == 0
            || self.ping_interval_ms == 0
        {
            return bad(
                "connect_timeout_ms, no_stream_retry_ms and ping_interval_ms must be positive"
                    .into(),
            );
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

/// A configuration error (the one kind validation reports).
fn bad(message: String) -> Result<(), LogError> {
    Err(LogError::Config(message))
}

/// The servers of a comma-separated `url`, blanks dropped.
pub(super) fn server_urls(url: &str) -> Vec<&str> {
    url.split(',').map(str::trim).filter(|u| !u.is_empty()).collect()
}

/// A config value in milliseconds as a [`Duration`].
pub(super) fn ms(value: u64) -> Duration {
    Duration::from_millis(value)
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
}
