//! The worker's configuration: every knob spelled out ([`WorkerConfig`], whose `Default` is the
//! production setting for one 2-core machine), the bounds the knobs are held to, and
//! [`WorkerConfig::validate`], which refuses settings that cannot work with a message naming
//! the knob.
//!
//! What it is: data and its checks, sans I/O. `main` (through the engine's `app/config.rs`)
//! fills it from TOML, the environment and flags, validates it, and hands it to
//! [`super::start`] by value; nothing below reads the environment.
//!
//! What it is not: the runtime or the tasks that use the knobs (`mod.rs`, the `*_task.rs`
//! files), or the pool's and the log's own settings (`pool.rs::PgPoolConfig`,
//! `flashsale_io::jetstream::LogConfig`, validated by their owners and called from here).
//!
//! Read next: `mod.rs` (`start`), `order_writer_task.rs`, `../batching.rs`.

use flashsale_io::jetstream::LogConfig;

use crate::classify::RetryPolicy;
use crate::error::PgError;
use crate::order_path::OrderPath;
use crate::order_writer::BATCH_MAX;
use crate::pool::PgPoolConfig;
use crate::set_writer::SET_BATCH_MAX;

/// The worker threads' niceness unless configured: the lowest priority (measured in the demo,
/// README "The demo").
pub const WORKER_NICE_DEFAULT: i32 = 19;

/// Every knob of the worker. `Default` is the production setting for one 2-core machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// The PostgreSQL pool: URL, size (this process's connection budget), timeouts.
    pub pg: PgPoolConfig,
    /// NATS/JetStream: URL, streams, consumer delivery policy (ack wait, max deliver,
    /// backoff), publish timeout and outstanding-ack bound.
    pub log: LogConfig,
    /// Threads of the worker's own tokio runtime.
    pub runtime_threads: usize,
    /// Their scheduling niceness (0..=19; `[worker] nice`). The order path has a 3 s budget
    /// and the answering path none to spare: on a box the edge shares (the demo, small
    /// deployments) the worker yields the CPU to it (issue 24 item 5: p99 of all answers
    /// −40% in the demo, orders still 100% within 3 s). Alone on its host it changes nothing.
    pub nice: i32,
    /// Concurrent order-writer tasks, i.e. concurrent batch transactions; two per PostgreSQL
    /// core ([`order_writers_for_pg_cores`]).
    pub order_writers: usize,
    /// How batches are written: set-based (default) or one function call per message.
    pub order_path: OrderPath,
    /// Messages per transaction on the per-message path (1..=64), also the chunk a set-based
    /// batch is written in when PostgreSQL refuses it as a set.
    pub batch_max: usize,
    /// The smallest ask of a pull, and the first (1..=`fetch_max`); see `batching.rs`.
    pub fetch_min: usize,
    /// The largest ask of a pull (`batch_max`..=1024): on the set-based path the largest
    /// transaction; on the per-message path a pull of several batches writes them one after
    /// another, all within the ack wait.
    pub fetch_max: usize,
    /// How long an idle pull waits for the first message.
    pub fetch_wait_ms: u64,
    /// NAK delays after failed deliveries 1, 2, ... (the last repeats).
    pub nak_backoff_ms: Vec<u64>,
    /// NAK delay after a contended claim.
    pub contended_nak_ms: u64,
    /// Concurrent outbox publishers.
    pub outbox_publishers: usize,
    /// Events per outbox round (at most the log's outstanding-ack bound).
    pub outbox_batch_max: usize,
    /// Pause between outbox rounds when the last one was not full.
    pub outbox_idle_ms: u64,
    /// Interval of the lag and backlog polls.
    pub lag_poll_ms: u64,
    /// How long messages may sit stranded below `order-writer`'s floor before the consumer is
    /// recreated (`flashsale_io::jetstream::StrandWatch`); 0 turns the repair off.
    pub stranded_repair_ms: u64,
    /// Pause after a failed pull, pool checkout or outbox round.
    pub error_pause_ms: u64,
    /// Bound on each phase of a graceful shutdown.
    pub shutdown_timeout_ms: u64,
    /// Where the order writes' spans go (`flashsale_io::trace`).
    pub tracing: WorkerTracing,
    /// The order timeout closer (`payments::close_due_orders`), one task beside the outbox;
    /// it borrows a pooled connection per round, like the lag task.
    pub closer: crate::payments::CloserConfig,
}

/// Where the worker's spans go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum WorkerTracing {
    /// Recorded nowhere.
    #[default]
    Off,
    /// Into the sink of the process it runs in, exported by that process (`flashsale serve`:
    /// the durable side's exporter).
    Shared(flashsale_io::trace::TraceSink),
    /// Into a sink of its own, exported by a task on the worker's runtime (`flashsale
    /// worker`).
    Export(flashsale_io::trace::TraceConfig),
}

impl Default for WorkerConfig {
    fn default() -> WorkerConfig {
        WorkerConfig {
            pg: PgPoolConfig::default(),
            log: LogConfig::default(),
            runtime_threads: 2,
            nice: WORKER_NICE_DEFAULT,
            order_writers: order_writers_for_pg_cores(2),
            order_path: OrderPath::SetBased,
            batch_max: 32,
            // Set-based, 10,000 orders, 2 writers (order pipeline bench, medians of 5 on a
            // shared machine): batch bound 32 / 128 / 256 / 512 / 1024 took 2.49 / 1.86 /
            // 1.42 / 1.39 / 1.66 s at 131 / 102 / 95 / 92 / 108 us of PostgreSQL CPU per
            // order; growing the ask from 32 beat a fixed ask of 512 (1.39 vs 1.51 s).
            fetch_min: 32,
            fetch_max: 512,
            fetch_wait_ms: 250,
            nak_backoff_ms: vec![100, 500, 2_000, 5_000, 10_000],
            contended_nak_ms: 20,
            outbox_publishers: 1,
            outbox_batch_max: 256,
            outbox_idle_ms: 20,
            lag_poll_ms: 500,
            // Ten samples: an ack racing one sample's two requests is never mistaken for it,
            // and a stranded buyer waits seconds, well inside the 120 s the auditor allows.
            stranded_repair_ms: 5_000,
            error_pause_ms: 200,
            shutdown_timeout_ms: 10_000,
            tracing: WorkerTracing::Off,
            closer: crate::payments::CloserConfig::default(),
        }
    }
}

/// Largest `fetch_max`: deliveries held by one task must all be written within the ack wait,
/// and one pull is one set-based transaction.
pub const FETCH_MAX: usize = 1024;
const _: () = assert!(FETCH_MAX <= SET_BATCH_MAX, "a full pull must fit one set-based batch");
const _: () = assert!(BATCH_MAX <= FETCH_MAX);

/// Most order writers one process runs (each holds a connection and a transaction).
pub const ORDER_WRITERS_MAX: usize = 64;

/// Order writers per PostgreSQL core: each writer spends part of its loop outside PostgreSQL
/// (the pull, decoding, planning, the acks), so one writer per core leaves the cores idle in
/// those gaps, while every writer added also makes each SKIP LOCKED token scan walk past one
/// more batch of locked tokens. Measured with the order pipeline bench on 2 cores (10,000
/// orders, batch 512, medians of 5 interleaved runs, shared machine): 2 writers 2.01 s, 4
/// writers 1.80 s (0.89x), 6 writers 1.47 s (0.73x), PostgreSQL CPU per order 118 / 130 / 120
/// us; at a lighter load (first round) 1.27 / 1.04 / 1.15 s. Two per core is the middle of that
/// plateau; the per-message prototype's "2 beat 4" (FIELD-NOTES.md) paid a token scan per
/// message, not per batch.
pub const ORDER_WRITERS_PER_PG_CORE: usize = 2;

/// [`ORDER_WRITERS_PER_PG_CORE`] writers per core PostgreSQL has (1..=[`ORDER_WRITERS_MAX`];
/// 0 cores counts as 1).
pub const fn order_writers_for_pg_cores(pg_cores: usize) -> usize {
    let cores = if pg_cores == 0 { 1 } else { pg_cores };
    let writers = cores.saturating_mul(ORDER_WRITERS_PER_PG_CORE);
    if writers > ORDER_WRITERS_MAX {
        ORDER_WRITERS_MAX
    } else {
        writers
    }
}

impl WorkerConfig {
    /// Refuses settings that cannot work, with a message naming the knob (the first one found,
    /// in this order: the pool, the log, the closer, the tasks, the batches, the timings).
    pub fn validate(&self) -> Result<(), PgError> {
        if let WorkerTracing::Export(tracing) = &self.tracing {
            tracing.validate().map_err(|e| PgError::Config(format!("tracing: {e}")))?;
        }
        self.pg.validate()?;
        self.log.validate()?;
        self.closer.validate()?;
        self.validate_tasks()?;
        self.validate_batches()?;
        self.validate_timings()
    }

    /// Task counts, against each other and the connection budget.
    fn validate_tasks(&self) -> Result<(), PgError> {
        let bad = |message: String| Err(PgError::Config(message));
        if !(0..=19).contains(&self.nice) {
            return bad(format!("nice = {} must be within 0..=19", self.nice));
        }
        if self.runtime_threads == 0 || self.order_writers == 0 || self.outbox_publishers == 0 {
            return bad("runtime_threads, order_writers and outbox_publishers must be >= 1".into());
        }
        if self.order_writers > ORDER_WRITERS_MAX {
            return bad(format!(
                "order_writers {} must be within 1..={ORDER_WRITERS_MAX}",
                self.order_writers
            ));
        }
        // One connection per writer and publisher, one for the lag task.
        let needed = self.order_writers + self.outbox_publishers + 1;
        if needed > self.pg.pool_size {
            return bad(format!(
                "pg.pool_size {} is below order_writers + outbox_publishers + 1 = {needed}",
                self.pg.pool_size
            ));
        }
        Ok(())
    }

    /// Batch and pull sizes, against each other and the log's bounds.
    fn validate_batches(&self) -> Result<(), PgError> {
        let bad = |message: String| Err(PgError::Config(message));
        if !(1..=BATCH_MAX).contains(&self.batch_max) {
            return bad(format!("batch_max {} must be within 1..={BATCH_MAX}", self.batch_max));
        }
        if self.fetch_max < self.batch_max || self.fetch_max > FETCH_MAX {
            return bad(format!(
                "fetch_max {} must be within batch_max ({})..={FETCH_MAX}",
                self.fetch_max, self.batch_max
            ));
        }
        if !(1..=self.fetch_max).contains(&self.fetch_min) {
            return bad(format!(
                "fetch_min {} must be within 1..=fetch_max ({})",
                self.fetch_min, self.fetch_max
            ));
        }
        let in_hand = self.order_writers * self.fetch_max;
        if in_hand > self.log.max_ack_pending as usize {
            return bad(format!(
                "order_writers x fetch_max = {in_hand} exceeds log.max_ack_pending {}",
                self.log.max_ack_pending
            ));
        }
        if self.outbox_batch_max == 0
            || self.outbox_batch_max > self.log.publish_acks_outstanding_max
        {
            return bad(format!(
                "outbox_batch_max {} must be within 1..=log.publish_acks_outstanding_max ({})",
                self.outbox_batch_max, self.log.publish_acks_outstanding_max
            ));
        }
        Ok(())
    }

    /// Delays and intervals: positive, and an idle pull shorter than the ack wait.
    fn validate_timings(&self) -> Result<(), PgError> {
        let bad = |message: String| Err(PgError::Config(message));
        if self.nak_backoff_ms.contains(&0) {
            return bad("nak_backoff_ms entries must be positive".into());
        }
        for (name, value) in [
            ("fetch_wait_ms", self.fetch_wait_ms),
            ("contended_nak_ms", self.contended_nak_ms),
            ("outbox_idle_ms", self.outbox_idle_ms),
            ("lag_poll_ms", self.lag_poll_ms),
            ("error_pause_ms", self.error_pause_ms),
            ("shutdown_timeout_ms", self.shutdown_timeout_ms),
        ] {
            if value == 0 {
                return bad(format!("{name} must be positive"));
            }
        }
        if self.fetch_wait_ms >= self.log.ack_wait_ms {
            return bad("fetch_wait_ms must be below log.ack_wait_ms".into());
        }
        Ok(())
    }

    /// The delivery rules the order-writer settles by (`classify.rs`).
    pub(super) fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            max_deliver: self.log.max_deliver,
            nak_backoff_ms: self.nak_backoff_ms.clone(),
            contended_nak_ms: self.contended_nak_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_is_valid() {
        WorkerConfig::default().validate().expect("default");
    }

    #[test]
    fn the_adaptive_bounds_are_checked() {
        let cases: Vec<(&str, WorkerConfig)> = vec![
            ("fetch_min", WorkerConfig { fetch_min: 0, ..Default::default() }),
            ("fetch_min", WorkerConfig { fetch_min: 513, ..Default::default() }),
            ("fetch_max", WorkerConfig { fetch_max: FETCH_MAX + 1, ..Default::default() }),
            (
                "order_writers",
                WorkerConfig {
                    order_writers: ORDER_WRITERS_MAX + 1,
                    pg: PgPoolConfig { pool_size: 100, ..Default::default() },
                    ..Default::default()
                },
            ),
        ];
        for (needle, config) in cases {
            match config.validate() {
                Err(PgError::Config(message)) => {
                    assert!(message.contains(needle), "{needle}: {message}")
                }
                other => panic!("{needle}: expected a config error, got {other:?}"),
            }
        }
        assert_eq!(order_writers_for_pg_cores(0), ORDER_WRITERS_PER_PG_CORE);
        assert_eq!(order_writers_for_pg_cores(2), 2 * ORDER_WRITERS_PER_PG_CORE);
        assert_eq!(order_writers_for_pg_cores(1_000), ORDER_WRITERS_MAX);
        // The per-message path keeps its own bound whatever the set-based one is.
        let per_message = WorkerConfig { order_path: OrderPath::PerMessage, ..Default::default() };
        per_message.validate().expect("per-message default");
    }

    #[test]
    fn related_bounds_are_checked_against_each_other() {
        let cases: Vec<(&str, WorkerConfig)> = vec![
            ("pool_size", WorkerConfig { order_writers: 7, ..Default::default() }),
            ("batch_max", WorkerConfig { batch_max: 65, fetch_max: 65, ..Default::default() }),
            ("batch_max", WorkerConfig { batch_max: 0, ..Default::default() }),
            ("fetch_max", WorkerConfig { fetch_max: 16, ..Default::default() }),
            (
                "max_ack_pending",
                WorkerConfig {
                    log: LogConfig { max_ack_pending: 100, ..Default::default() },
                    ..Default::default()
                },
            ),
            ("outbox_batch_max", WorkerConfig { outbox_batch_max: 5_000, ..Default::default() }),
            ("nak_backoff_ms", WorkerConfig { nak_backoff_ms: vec![0], ..Default::default() }),
            ("fetch_wait_ms", WorkerConfig { fetch_wait_ms: 30_000, ..Default::default() }),
        ];
        for (needle, config) in cases {
            match config.validate() {
                Err(PgError::Config(message)) => {
                    assert!(message.contains(needle), "{needle}: {message}")
                }
                other => panic!("{needle}: expected a config error, got {other:?}"),
            }
        }
    }
}
