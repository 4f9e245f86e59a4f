//! The durable pipeline's process part: the worker pool on its own tokio runtime and threads
//! (DESIGN.md section 3), used in-process by `flashsale serve` and alone by `flashsale worker`.
//!
//! What it is: [`start`] and [`WorkerHandle`], the runtime part. `start` validates its
//! [`WorkerConfig`] (`config.rs`: every knob spelled out), builds a multi-thread tokio runtime
//! of its own, connects to NATS, creates or updates the streams and consumers, builds the
//! PostgreSQL pool (checking one connection), and spawns the tasks, one file each:
//!
//! - `order_writers` order-writer tasks (`order_writer_task.rs`): pull deliveries (as many as
//!   are waiting, up to the adaptive ask of [`crate::batching::FetchSizer`]: `fetch_min`
//!   growing to `fetch_max` under a backlog), decode them, write them
//!   ([`crate::order_path::write_batch_with`]: the whole pull in ONE set-based transaction, or
//!   on the per-message path in transactions of at most `batch_max`), and only after COMMIT
//!   settle each delivery as [`crate::classify::classify`] says (ack, NAK with a delay, or
//!   dead-letter then TERM);
//! - `outbox_publishers` outbox tasks (`outbox_task.rs`: [`crate::outbox::publish_once`] in a
//!   loop);
//! - one closer task (`closer_task.rs`): orders past their pay timeout closed;
//! - one lag task (`lag_task.rs`): the `order-writer` pending count and oldest pending age
//!   from JetStream (into [`LogLag`], read by the edge's admission, and gauges) and the outbox
//!   backlog.
//!
//! What the tasks share (the pool, the log, the clock reading, the pause and the transaction
//! deadline) is `shared.rs`.
//!
//! Every transaction (an order batch, an outbox round, a closer round, the backlog count) is
//! bounded client-side by `pg.transaction_deadline_ms` (`shared::within_deadline`): a hung server
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
//!
//! Read next: `config.rs`, `order_writer_task.rs`, `../order_path.rs`.

mod closer_task;
mod config;
mod lag_task;
mod order_trace;
mod order_writer_task;
mod outbox_task;
mod shared;

use std::sync::Arc;
use std::time::Duration;

use flashsale_io::jetstream::{Log, LogLag, Publisher};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::{
    order_writers_for_pg_cores, WorkerConfig, WorkerTracing, FETCH_MAX, ORDER_WRITERS_MAX,
    ORDER_WRITERS_PER_PG_CORE,
};
use shared::Shared;

use crate::error::PgError;
use crate::pool::{build_pool_with, Connector};

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

/// The calling thread's niceness raised to `nice` (Linux: per thread). Failing is harmless
/// (the worker only yields less), so it is logged, never fatal.
#[allow(unsafe_code)]
fn lower_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    // SAFETY: gettid and setpriority take and return plain integers; they touch no memory.
    let done = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
    };
    if done != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(nice, error = %e, "worker thread keeps its priority");
    }
}

/// Starts the worker (see the module documentation). Blocks the calling thread until the
/// worker is connected and its streams, consumers and pool are ready, or returns why not.
/// Safe to call from any thread, including one that runs another async runtime.
pub fn start(config: WorkerConfig) -> Result<WorkerHandle, PgError> {
    config.validate()?;
    let nice = config.nice;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.runtime_threads)
        .thread_name("flashsale-worker")
        .on_thread_start(move || lower_priority(nice))
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
                Ok(source) => order_writer_task::run(&shared, source, stop).await,
                Err(e) => {
                    tracing::error!(index, error = %e, "order-writer cannot bind its consumer")
                }
            }
        }));
    }
    let others = spawn_others(&runtime, &shared, &config, &others_stop_rx);
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

/// The tasks stopped after the writers: the outbox publishers, the closer, the lag poll, and
/// for `flashsale worker` the trace exporter (so the writers' last spans still go out).
fn spawn_others(
    runtime: &tokio::runtime::Runtime,
    shared: &Arc<Shared>,
    config: &WorkerConfig,
    stop: &watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    let mut others = Vec::with_capacity(config.outbox_publishers + 3);
    for _ in 0..config.outbox_publishers {
        let (shared, stop) = (shared.clone(), stop.clone());
        others.push(runtime.spawn(async move { outbox_task::run(&shared, stop).await }));
    }
    let (closer_shared, closer_stop) = (shared.clone(), stop.clone());
    others.push(runtime.spawn(async move { closer_task::run(&closer_shared, closer_stop).await }));
    let (lag_shared, lag_stop) = (shared.clone(), stop.clone());
    others.push(runtime.spawn(async move { lag_task::run(&lag_shared, lag_stop).await }));
    if let WorkerTracing::Export(tracing) = &config.tracing {
        let sink = shared.traces.clone();
        let run = flashsale_io::trace::export::run(sink, tracing.clone(), stop.clone());
        others.push(runtime.spawn(run));
    }
    others
}

async fn init(config: WorkerConfig) -> Result<Shared, PgError> {
    let log = Log::connect(&config.log).await?;
    log.ensure_streams().await?;
    log.ensure_consumers().await?;
    let connector = Connector::new(&config.pg)?;
    let pool = build_pool_with(&config.pg, connector.clone())?;
    // Fail start-up, not the first batch, when PostgreSQL is unreachable or not migrated.
    let client = pool.get().await?;
    client.prepare_cached(crate::sql::ORDER_CREATE_SQL).await?;
    client.prepare_cached(crate::sql::ORDER_FACTS_SQL).await?;
    drop(client);
    let traces = match &config.tracing {
        WorkerTracing::Off => flashsale_io::trace::TraceSink::disabled(),
        WorkerTracing::Shared(sink) => sink.clone(),
        WorkerTracing::Export(tracing) => tracing.sink(),
    };
    Ok(Shared {
        traces,
        policy: config.retry_policy(),
        publisher: log.publisher(),
        lag: LogLag::default(),
        config,
        pool,
        connector,
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
