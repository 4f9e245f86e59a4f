//! The durable pipeline's process part: the worker pool on its own tokio runtime and threads
//! (DESIGN.md section 3), used in-process by `flashsale serve` and alone by `flashsale worker`.
//!
//! What it is: [`WorkerConfig`] (every knob spelled out), [`start`] and [`WorkerHandle`].
//! `start` builds a multi-thread tokio runtime of its own, connects to NATS, creates or
//! updates the streams and consumers, builds the PostgreSQL pool (checking one connection),
//! and spawns:
//!
//! - `order_writers` order-writer tasks: pull deliveries (as many as are waiting, up to the
//!   adaptive ask of [`crate::batching::FetchSizer`]: `fetch_min` growing to `fetch_max` under
//!   a backlog), decode them, write them ([`crate::order_writer::write_batch_with`]: the whole
//!   pull in ONE set-based transaction, or on the per-message path in transactions of at most
//!   `batch_max`), and only after COMMIT settle each delivery as
//!   [`crate::classify::classify`] says (ack, NAK with a delay, or dead-letter then TERM);
//! - `outbox_publishers` outbox tasks ([`crate::outbox::publish_once`] in a loop);
//! - one lag task: the `order-writer` pending count and oldest pending age from JetStream
//!   (into [`LogLag`], read by the edge's admission, and gauges) and the outbox backlog.
//!
//! Every transaction (an order batch, an outbox round, a closer round, the backlog count) is
//! bounded client-side by `pg.transaction_deadline_ms` (`within_deadline`): a hung server
//! never answers `statement_timeout`. Past it the connection is discarded and the batch is
//! held and retried like any other unavailability; the next connection comes from the pool's
//! failover connector (`pool.rs`).
//!
//! Concurrency is bounded by the PostgreSQL connection budget (`pg.pool_size`), not by the
//! backlog: at most `order_writers` batch transactions are open at once.
//!
//! Graceful shutdown ([`WorkerHandle::shutdown`]): the writers stop pulling, finish the batch
//! in hand (commit, then settle), and exit; then the outbox publishes what was committed;
//! then everything buffered is flushed to NATS and the runtime stops. A committed but unacked
//! message is redelivered later and found in the inbox (I7).
//!
//! What it is not: the CLI (the lead wires `flashsale worker` / `serve`), migrations (run by
//! `main` before `start`), or Redis (`redis-sync` lives in the edge).
//!
//! Metrics (DESIGN.md section 9, no ids as labels): `flashsale_order_create_latency_seconds`
//! (reserved_at → commit), `flashsale_token_claim_latency_seconds`,
//! `flashsale_token_claim_empty_total{result=exhausted|contended}`,
//! `flashsale_inbox_conflicts_total`, `flashsale_unique_conflicts_total`,
//! `flashsale_dlq_total{consumer}`, `flashsale_outbox_backlog`,
//! `flashsale_order_writer_pending`, `flashsale_order_writer_oldest_pending_age_seconds`,
//! `flashsale_order_writer_outcomes_total{outcome}`, `flashsale_order_writer_batch_failures_total`,
//! `flashsale_pg_transaction_deadlines_total`,
//! `flashsale_order_writer_batch_messages` (messages per transaction attempt),
//! `flashsale_order_writer_set_fallbacks_total{reason}` (set-based batches written per message).
//!
//! Sizing (measured with `benches/benches/order_pipeline.rs`, see `WorkerConfig::default`):
//! PostgreSQL's CPU bounds order writing; [`order_writers_for_pg_cores`] gives two writers per
//! core (one in PostgreSQL while another pulls and acks; measured in its documentation).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_postgres::Pool;
use flashsale_io::jetstream::{
    Delivery, Log, LogConfig, LogLag, Publisher, PullSource, ORDER_WRITER_CONSUMER,
};
use flashsale_io::wire::{decode_order_create, DecodeError, OrderCreate, RejectReason};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::batching::FetchSizer;
use crate::classify::{classify, Action, Attempt, RetryPolicy, WriteOutcome};
use crate::error::PgError;
use crate::order_writer::{write_batch_with, OrderPath, BATCH_MAX, SET_BATCH_MAX};
use crate::outbox;
use crate::pool::{build_pool, PgPoolConfig};

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
    /// Pause after a failed pull, pool checkout or outbox round.
    pub error_pause_ms: u64,
    /// Bound on each phase of a graceful shutdown.
    pub shutdown_timeout_ms: u64,
    /// The order timeout closer (`payments::close_due_orders`), one task beside the outbox;
    /// it borrows a pooled connection per round, like the lag task.
    pub closer: crate::payments::CloserConfig,
}

impl Default for WorkerConfig {
    fn default() -> WorkerConfig {
        WorkerConfig {
            pg: PgPoolConfig::default(),
            log: LogConfig::default(),
            runtime_threads: 2,
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
            error_pause_ms: 200,
            shutdown_timeout_ms: 10_000,
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
    /// Refuses settings that cannot work, with a message naming the knob.
    pub fn validate(&self) -> Result<(), PgError> {
        self.pg.validate()?;
        self.log.validate()?;
        self.closer.validate()?;
        let bad = |message: String| Err(PgError::Config(message));
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

    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            max_deliver: self.log.max_deliver,
            nak_backoff_ms: self.nak_backoff_ms.clone(),
            contended_nak_ms: self.contended_nak_ms,
        }
    }
}

/// A running worker. Dropping it without [`WorkerHandle::shutdown`] stops it abruptly (like a
/// crash: committed but unsettled messages are redelivered and deduplicated).
pub struct WorkerHandle {
    runtime: Option<tokio::runtime::Runtime>,
    writers_stop: watch::Sender<bool>,
    others_stop: Option<watch::Sender<bool>>,
    writers: Vec<JoinHandle<()>>,
    others: Vec<JoinHandle<()>>,
    lag: LogLag,
    log: Log,
    shutdown_timeout: Duration,
}

/// State shared by the worker's tasks.
struct Shared {
    config: WorkerConfig,
    policy: RetryPolicy,
    pool: Pool,
    log: Log,
    publisher: Publisher,
    lag: LogLag,
}

/// Starts the worker (see the module documentation). Blocks the calling thread until the
/// worker is connected and its streams, consumers and pool are ready, or returns why not.
/// Safe to call from any thread, including one that runs another async runtime.
pub fn start(config: WorkerConfig) -> Result<WorkerHandle, PgError> {
    config.validate()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.runtime_threads)
        .thread_name("flashsale-worker")
        .enable_all()
        .build()
        .map_err(|e| PgError::Runtime(format!("build the worker runtime: {e}")))?;
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let init_config = config.clone();
    runtime.spawn(async move {
        let _ = ready_tx.send(init(init_config).await);
    });
    let shared = match ready_rx.recv() {
        Ok(Ok(shared)) => Arc::new(shared),
        Ok(Err(e)) => {
            runtime.shutdown_background();
            return Err(e);
        }
        Err(_) => {
            runtime.shutdown_background();
            return Err(PgError::Runtime("worker start-up task vanished".into()));
        }
    };
    let (writers_stop, writers_stop_rx) = watch::channel(false);
    let (others_stop, others_stop_rx) = watch::channel(false);
    let mut writers = Vec::with_capacity(config.order_writers);
    for index in 0..config.order_writers {
        let shared = shared.clone();
        let stop = writers_stop_rx.clone();
        writers.push(runtime.spawn(async move {
            match shared.log.order_writer().await {
                Ok(source) => order_writer_task(&shared, source, stop).await,
                Err(e) => {
                    tracing::error!(index, error = %e, "order-writer cannot bind its consumer")
                }
            }
        }));
    }
    let mut others = Vec::with_capacity(config.outbox_publishers + 1);
    for _ in 0..config.outbox_publishers {
        let (shared, stop) = (shared.clone(), others_stop_rx.clone());
        others.push(runtime.spawn(async move { outbox_task(&shared, stop).await }));
    }
    let (closer_shared, closer_stop) = (shared.clone(), others_stop_rx.clone());
    others.push(runtime.spawn(async move { closer_task(&closer_shared, closer_stop).await }));
    let lag_shared = shared.clone();
    others.push(runtime.spawn(async move { lag_task(&lag_shared, others_stop_rx).await }));
    tracing::info!(
        order_writers = config.order_writers,
        order_path = ?config.order_path,
        fetch_min = config.fetch_min,
        fetch_max = config.fetch_max,
        batch_max = config.batch_max,
        pool_size = config.pg.pool_size,
        "worker started"
    );
    Ok(WorkerHandle {
        runtime: Some(runtime),
        writers_stop,
        others_stop: Some(others_stop),
        writers,
        others,
        lag: shared.lag.clone(),
        log: shared.log.clone(),
        shutdown_timeout: Duration::from_millis(config.shutdown_timeout_ms),
    })
}

async fn init(config: WorkerConfig) -> Result<Shared, PgError> {
    let log = Log::connect(&config.log).await?;
    log.ensure_streams().await?;
    log.ensure_consumers().await?;
    let pool = build_pool(&config.pg)?;
    // Fail start-up, not the first batch, when PostgreSQL is unreachable or not migrated.
    let client = pool.get().await?;
    client.prepare_cached(crate::sql::ORDER_CREATE_SQL).await?;
    client.prepare_cached(crate::sql::ORDER_FACTS_SQL).await?;
    drop(client);
    Ok(Shared {
        policy: config.retry_policy(),
        publisher: log.publisher(),
        lag: LogLag::default(),
        config,
        pool,
        log,
    })
}

impl WorkerHandle {
    /// The `order-writer` backlog as last polled (cheap; for the edge's admission).
    pub fn lag(&self) -> LogLag {
        self.lag.clone()
    }

    /// A publisher on the worker's NATS connection (the edge's order-create publishes in
    /// `serve` can share it and its outstanding-ack bound).
    pub fn publisher(&self) -> Publisher {
        self.log.publisher()
    }

    /// The worker's runtime, to run more tokio work beside it (e.g. the edge's publisher).
    pub fn runtime_handle(&self) -> Option<tokio::runtime::Handle> {
        self.runtime.as_ref().map(|r| r.handle().clone())
    }

    /// Graceful shutdown (see the module documentation); blocks the calling thread. `Err`
    /// when a phase outlasted `shutdown_timeout_ms` (the rest was stopped abruptly).
    pub fn shutdown(mut self) -> Result<(), PgError> {
        let Some(runtime) = self.runtime.take() else { return Ok(()) };
        self.writers_stop.send_replace(true);
        let writers = std::mem::take(&mut self.writers);
        let others = std::mem::take(&mut self.others);
        let others_stop = self.others_stop.take();
        let log = self.log.clone();
        let timeout = self.shutdown_timeout;
        // A runtime may be neither blocked on nor dropped from inside another runtime's
        // thread, and our caller may be one: do both on a thread of our own.
        let joined = std::thread::Builder::new()
            .name("flashsale-worker-shutdown".into())
            .spawn(move || {
                let graceful = runtime.block_on(async move {
                    let writers_done =
                        tokio::time::timeout(timeout, futures::future::join_all(writers)).await;
                    if let Some(stop) = others_stop {
                        stop.send_replace(true);
                    }
                    let others_done =
                        tokio::time::timeout(timeout, futures::future::join_all(others)).await;
                    // Bounded: with NATS unreachable a flush never completes, and a stop
                    // must not hang on it (unflushed acks mean redeliveries, which the inbox
                    // absorbs).
                    match tokio::time::timeout(timeout, log.flush()).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "flushing NATS at shutdown failed")
                        }
                        Err(_) => tracing::warn!("flushing NATS at shutdown timed out"),
                    }
                    writers_done.is_ok() && others_done.is_ok()
                });
                runtime.shutdown_timeout(timeout);
                graceful
            })
            .map_err(|e| PgError::Runtime(format!("spawn the shutdown thread: {e}")))?
            .join();
        match joined {
            Ok(true) => {
                tracing::info!("worker stopped");
                Ok(())
            }
            Ok(false) => Err(PgError::Runtime("graceful shutdown timed out".into())),
            Err(_) => Err(PgError::Runtime("the shutdown thread panicked".into())),
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Abrupt: no waiting, allowed from inside another runtime.
            self.writers_stop.send_replace(true);
            runtime.shutdown_background();
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn ms(value: u64) -> Duration {
    Duration::from_millis(value)
}

/// Sleeps `duration` unless `stop` turns true first; returns whether to stop.
async fn pause(duration: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(duration) => *stop.borrow(),
        changed = stop.changed() => changed.is_err() || *stop.borrow(),
    }
}

// ---------------------------------------------------------------------------------------------
// order-writer
// ---------------------------------------------------------------------------------------------

async fn order_writer_task(shared: &Shared, source: PullSource, mut stop: watch::Receiver<bool>) {
    let config = &shared.config;
    let mut sizer = FetchSizer::new(config.fetch_min, config.fetch_max);
    // The per-message path writes a pull in transactions of `batch_max`; the set-based path
    // writes the whole pull (at most fetch_max <= SET_BATCH_MAX) in one.
    let transaction_max = match config.order_path {
        OrderPath::SetBased => config.fetch_max,
        OrderPath::PerMessage => config.batch_max,
    };
    // Checked between pulls only: a batch in hand is always written and settled.
    while !*stop.borrow() {
        let deliveries = match source.fetch(sizer.ask(), ms(config.fetch_wait_ms)).await {
            Ok(deliveries) => deliveries,
            Err(e) => {
                tracing::warn!(error = %e, "order-writer pull failed");
                pause(ms(config.error_pause_ms), &mut stop).await;
                continue;
            }
        };
        sizer.observe(deliveries.len());
        for batch in deliveries.chunks(transaction_max) {
            let span = tracing::debug_span!("order_batch", size = batch.len());
            process_batch(shared, batch, &mut stop).instrument(span).await;
        }
    }
}

/// Decodes, writes and settles one batch of deliveries.
async fn process_batch(shared: &Shared, deliveries: &[Delivery], stop: &mut watch::Receiver<bool>) {
    let decoded: Vec<Result<OrderCreate, DecodeError>> =
        deliveries.iter().map(|d| decode_order_create(d.payload())).collect();
    // Writable messages, by SKU: concurrent batches then take ROW allocator rows (and the
    // order index entries of one SKU) in one order, which avoids lock-order deadlocks.
    let mut writable: Vec<usize> = (0..deliveries.len()).filter(|&i| decoded[i].is_ok()).collect();
    writable.sort_by_key(|&i| match &decoded[i] {
        Ok(m) => (m.activity_id, m.sku_id),
        Err(_) => (0, 0),
    });
    let messages: Vec<&OrderCreate> =
        writable.iter().filter_map(|&i| decoded[i].as_ref().ok()).collect();
    let written = if messages.is_empty() {
        Ok(Vec::new())
    } else {
        write_holding(shared, &messages, deliveries, stop).await
    };
    let commit_ms = now_ms();
    let mut outcome_of: Vec<Option<usize>> = vec![None; deliveries.len()];
    for (k, &i) in writable.iter().enumerate() {
        outcome_of[i] = Some(k);
    }
    let batch_error = match &written {
        Ok(outcomes) => {
            record(&messages, outcomes, commit_ms);
            String::new()
        }
        Err(e) => {
            metrics::counter!("flashsale_order_writer_batch_failures_total").increment(1);
            tracing::warn!(error = %e, size = messages.len(), "order batch not committed");
            e.to_string()
        }
    };
    let settles = deliveries.iter().enumerate().map(|(i, delivery)| {
        let attempt = match (&decoded[i], &written, outcome_of[i]) {
            (Err(e), _, _) => Attempt::Undecodable(e),
            (Ok(_), Ok(outcomes), Some(k)) => Attempt::Written(&outcomes[k]),
            (Ok(_), Err(e), _) => {
                Attempt::BatchFailed { transient: e.is_transient(), error: &batch_error }
            }
            // Cannot happen: every decoded message was written.
            (Ok(_), Ok(_), None) => Attempt::BatchFailed { transient: true, error: "not written" },
        };
        let action = classify(attempt, delivery.delivered(), &shared.policy);
        settle(shared, delivery, action)
    });
    futures::future::join_all(settles).await;
}

/// Writes the batch; while PostgreSQL is unavailable, holds it (its messages marked in
/// progress, so the server neither redelivers them nor counts deliveries) and retries with
/// full-jitter backoff up to `error_pause_ms × 5`, until it commits, fails otherwise, or the
/// worker stops. The write is idempotent (the inbox), so a retry after an unknown commit is
/// safe. Holding beats NAK-with-backoff here: the backlog drains the moment the database is
/// back instead of on each message's redelivery schedule, and the held batch is what the
/// writer would do next anyway (nothing else can commit either).
async fn write_holding(
    shared: &Shared,
    messages: &[&OrderCreate],
    deliveries: &[Delivery],
    stop: &mut watch::Receiver<bool>,
) -> Result<Vec<WriteOutcome>, PgError> {
    let pause_max_ms = shared.config.error_pause_ms.saturating_mul(5).max(1);
    let mut pause_ms = shared.config.error_pause_ms.max(1);
    loop {
        match write(shared, messages).await {
            Err(e) if e.is_unavailable() && !*stop.borrow() => {
                metrics::counter!("flashsale_order_writer_held_retries_total").increment(1);
                tracing::debug!(error = %e, size = messages.len(), "postgres unavailable: holding");
                for delivery in deliveries {
                    let _ = delivery.in_progress().await;
                }
                let jittered = rand::random::<u64>() % pause_ms + 1;
                if pause(ms(jittered), stop).await {
                    return Err(e);
                }
                pause_ms = (pause_ms * 2).min(pause_max_ms);
            }
            other => return other,
        }
    }
}

/// One transaction on a pooled connection; a connection whose transaction failed is
/// discarded (it may still be inside that transaction).
async fn write(shared: &Shared, messages: &[&OrderCreate]) -> Result<Vec<WriteOutcome>, PgError> {
    let waited = std::time::Instant::now();
    let client = shared.pool.get().await?;
    metrics::histogram!("flashsale_pg_pool_wait_seconds").record(waited.elapsed().as_secs_f64());
    metrics::histogram!("flashsale_order_writer_batch_messages").record(messages.len() as f64);
    let path = shared.config.order_path;
    let written = within_deadline(
        shared,
        "order batch",
        write_batch_with(&client, ORDER_WRITER_CONSUMER, messages, now_ms(), path),
    )
    .await;
    match written {
        Ok(outcomes) => {
            #[cfg(feature = "failpoints")]
            fail::fail_point!("worker_after_commit");
            Ok(outcomes)
        }
        Err(e) => {
            drop(deadpool_postgres::Object::take(client));
            Err(e)
        }
    }
}

/// Bounds one transaction (or round) on a pooled connection by `pg.transaction_deadline_ms`,
/// client-side: `statement_timeout` cannot fire on a server that does not run (SIGSTOPped,
/// or a machine gone without a reset), and the commit's outcome is then unknown. The caller
/// discards the connection on any error (it may still be inside the transaction); every
/// round here is idempotent (the inbox, SKIP LOCKED claims, conditional transitions), so the
/// retry that follows is safe. The error reads as unavailable (`TimedOut`).
async fn within_deadline<T>(
    shared: &Shared,
    what: &str,
    work: impl std::future::Future<Output = Result<T, PgError>>,
) -> Result<T, PgError> {
    let deadline_ms = shared.config.pg.transaction_deadline_ms;
    match tokio::time::timeout(ms(deadline_ms), work).await {
        Ok(result) => result,
        Err(_) => {
            metrics::counter!("flashsale_pg_transaction_deadlines_total").increment(1);
            let message = format!(
                "{what} outlasted the client-side transaction deadline of {deadline_ms} ms \
                 (outcome unknown; the retry is idempotent)"
            );
            Err(PgError::Db(crate::pool::minted_error(std::io::ErrorKind::TimedOut, message).await))
        }
    }
}

async fn settle(shared: &Shared, delivery: &Delivery, action: Action) {
    let result = match action {
        Action::Ack => delivery.ack().await,
        Action::Nak { delay_ms } => delivery.nak(ms(delay_ms)).await,
        Action::DeadLetter { error } => {
            match shared.publisher.dead_letter(delivery, ORDER_WRITER_CONSUMER, &error).await {
                Ok(_) => {
                    metrics::counter!("flashsale_dlq_total", "consumer" => ORDER_WRITER_CONSUMER)
                        .increment(1);
                    tracing::error!(
                        stream_sequence = delivery.stream_sequence(),
                        message_id = delivery.msg_id().unwrap_or(""),
                        deliveries = delivery.delivered(),
                        %error,
                        "order-create message dead-lettered"
                    );
                    delivery.term().await
                }
                Err(e) => {
                    // Not TERMed without its dead letter: redelivered and retried.
                    tracing::error!(error = %e, "dead-letter publish failed; NAK instead");
                    delivery.nak(ms(shared.policy.nak_delay_ms(delivery.delivered()))).await
                }
            }
        }
    };
    if let Err(e) = result {
        // The server redelivers after the ack wait; the inbox absorbs the repeat.
        tracing::warn!(error = %e, "settling a delivery failed");
    }
}

/// Metrics and trace events of a committed batch.
fn record(messages: &[&OrderCreate], outcomes: &[WriteOutcome], commit_ms: u64) {
    for (message, outcome) in messages.iter().zip(outcomes) {
        let label = match outcome {
            WriteOutcome::Created { order_id, claim_us, .. } => {
                let latency_ms = commit_ms.saturating_sub(message.reserved_at_ms);
                metrics::histogram!("flashsale_order_create_latency_seconds")
                    .record(latency_ms as f64 / 1000.0);
                record_claim(*claim_us);
                tracing::debug!(
                    message_id = %message.message_id,
                    reservation_id = %message.reservation_id,
                    order_id = %order_id,
                    "order created"
                );
                "created"
            }
            WriteOutcome::Rejected { reason, claim_us } => {
                record_claim(*claim_us);
                match reason {
                    RejectReason::NoFinalStock => {
                        metrics::counter!("flashsale_token_claim_empty_total", "result" => "exhausted")
                            .increment(1);
                    }
                    RejectReason::DuplicateUser => {
                        metrics::counter!("flashsale_unique_conflicts_total").increment(1);
                    }
                    RejectReason::Expired | RejectReason::ActivityTerminated => {}
                }
                tracing::debug!(
                    message_id = %message.message_id,
                    reservation_id = %message.reservation_id,
                    reason = reason.reason_code(),
                    "reservation rejected"
                );
                reason.reservation_status()
            }
            WriteOutcome::Duplicate { .. } => {
                metrics::counter!("flashsale_inbox_conflicts_total").increment(1);
                "duplicate"
            }
            WriteOutcome::Contended => {
                metrics::counter!("flashsale_token_claim_empty_total", "result" => "contended")
                    .increment(1);
                "contended"
            }
            WriteOutcome::Failed { error, .. } => {
                tracing::warn!(message_id = %message.message_id, %error, "order-create message failed");
                "failed"
            }
        };
        metrics::counter!("flashsale_order_writer_outcomes_total", "outcome" => label).increment(1);
    }
}

fn record_claim(claim_us: Option<i64>) {
    if let Some(us) = claim_us {
        metrics::histogram!("flashsale_token_claim_latency_seconds").record(us as f64 / 1e6);
    }
}

// ---------------------------------------------------------------------------------------------
// outbox and lag
// ---------------------------------------------------------------------------------------------

async fn outbox_task(shared: &Shared, mut stop: watch::Receiver<bool>) {
    let config = &shared.config;
    loop {
        // Read before the round: the round after the stop signal is the final drain.
        let stopping = *stop.borrow();
        let round = async {
            let mut client = shared.pool.get().await?;
            let batch_max = config.outbox_batch_max;
            let round = within_deadline(
                shared,
                "outbox round",
                outbox::publish_once(&mut client, &shared.publisher, batch_max),
            )
            .await;
            if round.is_err() {
                drop(deadpool_postgres::Object::take(client));
            }
            round
        }
        .await;
        match round {
            Ok(round) if round.claimed == config.outbox_batch_max && round.failed == 0 => {}
            Ok(_) if stopping => return,
            Ok(_) => {
                pause(ms(config.outbox_idle_ms), &mut stop).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "outbox round failed");
                if stopping {
                    return;
                }
                pause(ms(config.error_pause_ms), &mut stop).await;
            }
        }
    }
}

/// The order timeout closer (DESIGN.md section 6): a bounded round, then the next one at once
/// if it was full, else after `closer.interval_ms`. With a payment provider configured each
/// round asks it before closing (`payments::close_due_orders_verified`); without one, orders
/// with no callback are closed unverified, which is logged once here.
async fn closer_task(shared: &Shared, mut stop: watch::Receiver<bool>) {
    let closer = &shared.config.closer;
    let provider = match &closer.provider {
        None => {
            tracing::warn!(
                "no payment provider configured ([payments] status_url): the closer closes \
                 orders past their pay timeout without asking the provider (closes are not \
                 verified)"
            );
            None
        }
        Some(config) => match crate::provider::Provider::new(config.clone()) {
            Ok(provider) => {
                tracing::info!(status_url = %config.status_url, "the closer asks the payment provider before closing");
                Some(provider)
            }
            Err(e) => {
                // validate() refused this config before start; keep today's behaviour visibly.
                tracing::error!(error = %e, "payment provider unusable: closes are not verified");
                None
            }
        },
    };
    loop {
        let round = closer_round(shared, provider.as_ref()).await;
        let pause_ms = match round {
            Ok((candidates, acted)) if candidates == closer.batch_max && acted => 0,
            Ok(_) => closer.interval_ms,
            Err(e) => {
                tracing::warn!(error = %e, "closer round failed");
                shared.config.error_pause_ms.max(closer.interval_ms)
            }
        };
        if pause(ms(pause_ms), &mut stop).await {
            return;
        }
    }
}

/// One closer round on a pooled connection: (candidates, whether any order moved on).
async fn closer_round(
    shared: &Shared,
    provider: Option<&crate::provider::Provider>,
) -> Result<(usize, bool), PgError> {
    let closer = &shared.config.closer;
    let client = shared.pool.get().await?;
    let round = match provider {
        None => within_deadline(
            shared,
            "closer round",
            crate::payments::close_due_orders(&client, closer.batch_max, now_ms()),
        )
        .await
        .map(|r| (r.candidates, !r.closed.is_empty())),
        Some(provider) => {
            // The asks' own bound on top of the database's: waves of `concurrency` asks,
            // each at most attempts x timeout plus the pauses between attempts.
            let c = provider.config();
            let waves = closer.batch_max.div_ceil(c.concurrency) as u64;
            let ask_ms = u64::from(c.attempts) * c.timeout_ms
                + u64::from(c.attempts.saturating_sub(1)) * c.retry_pause_ms;
            let bound_ms = shared.config.pg.transaction_deadline_ms + waves * ask_ms;
            let work = crate::payments::close_due_orders_verified(
                &client,
                provider,
                closer.batch_max,
                now_ms(),
            );
            match tokio::time::timeout(ms(bound_ms), work).await {
                Ok(r) => r.map(|r| {
                    let acted = !r.round.closed.is_empty() || !r.paid.is_empty();
                    (r.round.candidates, acted || !r.unknown.is_empty())
                }),
                Err(_) => Err(PgError::Runtime(format!(
                    "verified closer round outlasted its bound of {bound_ms} ms"
                ))),
            }
        }
    };
    if round.is_err() {
        drop(deadpool_postgres::Object::take(client));
    }
    round
}

async fn lag_task(shared: &Shared, mut stop: watch::Receiver<bool>) {
    loop {
        let now = now_ms();
        match shared.log.poll_order_writer_lag(now).await {
            Ok(sample) => {
                shared.lag.store(sample, now);
                metrics::gauge!("flashsale_order_writer_pending").set(sample.pending as f64);
                metrics::gauge!("flashsale_order_writer_oldest_pending_age_seconds")
                    .set(sample.oldest_pending_age_ms as f64 / 1000.0);
            }
            Err(e) => tracing::debug!(error = %e, "order-writer lag poll failed"),
        }
        match shared.pool.get().await {
            Ok(client) => {
                match within_deadline(shared, "outbox backlog", outbox::backlog(&client)).await {
                    Ok(backlog) => metrics::gauge!("flashsale_outbox_backlog").set(backlog as f64),
                    Err(e) => {
                        drop(deadpool_postgres::Object::take(client));
                        tracing::debug!(error = %e, "outbox backlog poll failed")
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "no connection for the backlog poll"),
        }
        if pause(ms(shared.config.lag_poll_ms), &mut stop).await {
            return;
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
