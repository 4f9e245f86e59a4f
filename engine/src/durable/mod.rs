//! The durable side of `flashsale serve` (DESIGN.md section 3): a tokio runtime on its own
//! threads holding the JetStream publisher and a small PostgreSQL pool for the edge's needs
//! (query fallback, admin activity creation). The glommio shards reach it only through
//! [`DurableHandle`]: a bounded queue (`try_send`, never blocking a shard) and a oneshot
//! completion per request, awaited on the shard (a glommio task woken from a foreign thread,
//! ~30 µs per round trip on this machine, FIELD-NOTES.md).
//!
//! It never talks to Redis: Redis writes belong to the owner shard of each SKU.
//!
//! It also runs the trace exporter (`flashsale_io::trace::export`): the shards and the
//! in-process worker only push finished spans into a bounded sink; sending them to the
//! collector, and waiting on a slow one, happens here, never on a shard.
//!
//! Not here: the order-writer and outbox publisher (`flashsale_pg_worker`, started beside it
//! unless `--no-worker`).

pub mod dependencies;
pub mod error;
pub mod health;
pub mod lease;
pub mod modes;
pub mod notice;
pub mod sync;
pub mod wait;

pub use error::DurableError;

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use deadpool_postgres::Pool;
use flashsale_io::jetstream::async_nats::jetstream;
use flashsale_io::jetstream::{Log, LogConfig, LogError, PublishAck, Publisher};
use flashsale_io::wire::OrderCreate;
use flashsale_pg_worker::PgError;
use futures::channel::oneshot;
use tokio::sync::{mpsc, Semaphore};

/// Everything the durable side needs, spelled out.
#[derive(Debug, Clone)]
pub struct DurableConfig {
    pub pg_url: String,
    /// Connections of the edge's pool (query fallback, admin); the order-writer has its own.
    pub pg_pool_size: usize,
    pub log: LogConfig,
    /// Requests queued from all shards at once; full → the shard answers at once
    /// (`QUEUED_PENDING` for a publish, `UNKNOWN` for a query).
    pub queue_max: usize,
    /// Requests being worked on at once (a shard's batch of publishes awaiting acks counts
    /// once, a query once).
    pub in_flight_max: usize,
    /// Bound on one PostgreSQL call of the edge.
    pub pg_timeout_ms: u64,
    /// tokio worker threads.
    pub threads: usize,
    /// The trace exporter's sink and settings (None: no trace export; `serve::start` sets
    /// it when an OTLP endpoint is configured).
    pub trace_export: Option<TraceExport>,
}

/// What the exporter task drains and where it sends it.
#[derive(Debug, Clone)]
pub struct TraceExport {
    pub sink: flashsale_io::trace::TraceSink,
    pub config: flashsale_io::trace::TraceConfig,
}

/// What the shards can ask for, each answered through its own oneshot.
pub enum DurableRequest {
    /// Order-create messages for the log, published at once and answered together, one
    /// ack or error per message in order (a shard's poll, `shard/publish.rs`); a message's
    /// `msg_id` overrides its `Nats-Msg-Id` (a republish of a message acknowledged before).
    Publish {
        messages: Vec<(OrderCreate, Option<String>)>,
        reply: oneshot::Sender<Vec<Result<PublishAck, LogError>>>,
    },
    /// Puts a signed mode snapshot of `version` into the replicated mode bucket by
    /// compare-and-set on the entry's revision ([`modes::put_mode`]).
    PutMode {
        key: String,
        value: String,
        version: u64,
        reply: oneshot::Sender<Result<u64, DurableError>>,
    },
    /// Tells every instance that compensation returned stock of this SKU to Redis (a core
    /// NATS notice, [`notice`]); fire and forget.
    StockReturned { key: crate::logic::placement::SkuKey },
    /// Any PostgreSQL work of the edge (see [`DurableHandle::pg`]): a pooled connection,
    /// bounded by `pg_timeout_ms`. The SQL itself lives in `flashsale_pg_worker`.
    Pg(PgJob),
    /// Any other work against the log (see [`DurableHandle::log`]), e.g. the admin plane's
    /// dead-letter calls; bounded by `pg_timeout_ms` like a PostgreSQL job. The JetStream
    /// calls themselves live in `flashsale_io::jetstream`.
    Log(LogJob),
}

/// A boxed log job run on the durable side; it replies through its own channel.
pub type LogJob = Box<
    dyn FnOnce(
            Log,
            Publisher,
            Duration,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send,
>;

/// A boxed PostgreSQL job run on the durable side; it replies through its own channel.
pub type PgJob = Box<
    dyn FnOnce(PgSide, Duration) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send,
>;

/// The edge's PostgreSQL side: its pool and the connector behind it.
#[derive(Clone)]
pub struct PgSide {
    pool: Pool,
    connector: flashsale_pg_worker::pool::Connector,
}

/// The shards' end of the crossing. `Send + Clone`: one clone per shard.
#[derive(Clone)]
pub struct DurableHandle {
    tx: mpsc::Sender<DurableRequest>,
}

impl DurableHandle {
    /// Queues a request without blocking; a full queue hands the request back.
    pub fn try_send(&self, request: DurableRequest) -> Result<(), DurableError> {
        self.tx.try_send(request).map_err(|_| DurableError::Unavailable)
    }

    /// Queues `make(reply)` and awaits the answer (from any runtime).
    pub async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, DurableError>>) -> DurableRequest,
    ) -> Result<T, DurableError> {
        let (tx, rx) = oneshot::channel();
        self.try_send(make(tx))?;
        rx.await.map_err(|_| DurableError::Unavailable)?
    }

    /// Runs `f` with a pooled PostgreSQL connection on the durable side and awaits its result
    /// (bounded by `pg_timeout_ms`). New PostgreSQL calls of the edge use this instead of a
    /// request variant of their own.
    pub async fn pg<T, F, Fut>(&self, f: F) -> Result<T, DurableError>
    where
        T: Send + 'static,
        F: FnOnce(deadpool_postgres::Object) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, PgError>> + Send + 'static,
    {
        self.pg_bounded(None, f).await
    }

    /// [`DurableHandle::pg`] bounded by `timeout` instead of `pg_timeout_ms`: work that is
    /// not a buyer's and may take longer, e.g. a reconcile report of a large SKU.
    pub async fn pg_within<T, F, Fut>(&self, timeout: Duration, f: F) -> Result<T, DurableError>
    where
        T: Send + 'static,
        F: FnOnce(deadpool_postgres::Object) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, PgError>> + Send + 'static,
    {
        self.pg_bounded(Some(timeout), f).await
    }

    async fn pg_bounded<T, F, Fut>(
        &self,
        timeout: Option<Duration>,
        f: F,
    ) -> Result<T, DurableError>
    where
        T: Send + 'static,
        F: FnOnce(deadpool_postgres::Object) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, PgError>> + Send + 'static,
    {
        self.call(|reply| {
            DurableRequest::Pg(Box::new(move |pg, default| {
                Box::pin(async move {
                    let _ = reply.send(with_pg(&pg, timeout.unwrap_or(default), f).await);
                })
            }))
        })
        .await
    }

    /// Runs `f` with the log client and publisher on the durable side and awaits its result
    /// (bounded by `pg_timeout_ms`).
    pub async fn log<T, F, Fut>(&self, f: F) -> Result<T, DurableError>
    where
        T: Send + 'static,
        F: FnOnce(Log, Publisher) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, LogError>> + Send + 'static,
    {
        self.call(|reply| {
            DurableRequest::Log(Box::new(move |log, publisher, timeout| {
                Box::pin(async move {
                    let work = tokio::time::timeout(timeout, f(log, publisher));
                    let result = match work.await {
                        Ok(result) => result.map_err(DurableError::from),
                        Err(_) => Err(DurableError::Timeout),
                    };
                    let _ = reply.send(result);
                })
            }))
        })
        .await
    }
}

/// The control-plane state the durable side keeps current for the shards.
#[derive(Clone)]
pub struct Control {
    pub modes: Arc<modes::ModeState>,
    pub health: Arc<health::Health>,
    pub health_poll_ms: u64,
    /// The reconcile lease this instance keeps current (`lease.rs`), and who it is; None:
    /// no periodic reconcile here, no lease sought.
    pub reconcile_lease: Option<(crate::logic::ids::InstanceId, Duration)>,
    pub lease: Arc<crate::durable::lease::Lease>,
}

/// The running durable side: its thread and the handle to stop it.
pub struct Durable {
    thread: Option<JoinHandle<()>>,
    stop: Option<tokio::sync::watch::Sender<bool>>,
}

impl Durable {
    /// Connects to NATS (ensuring streams and consumers) and PostgreSQL, then serves requests
    /// on its own runtime. Fails when a dependency cannot be reached at start.
    /// `sync` = where `redis-sync` hands events (None: no `redis-sync` in this process).
    /// `control` = the mode table and the health cells this side keeps current (the mode
    /// bucket watcher and the backlog / PostgreSQL poller run here).
    pub fn start(
        config: DurableConfig,
        sync: Option<crate::durable::sync::SyncTargets>,
        control: Control,
    ) -> anyhow::Result<(Durable, DurableHandle)> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads.max(1))
            .thread_name("durable")
            .enable_all()
            .build()?;
        let (tx, rx) = mpsc::channel(config.queue_max);
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name("durable-main".into()).spawn(move || {
            runtime.block_on(run_side(config, sync, control, rx, stop_rx, ready_tx));
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => anyhow::bail!("durable side exited during start-up"),
        }
        Ok((Durable { thread: Some(thread), stop: Some(stop_tx) }, DurableHandle { tx }))
    }

    /// Stops taking requests, lets those in flight finish (bounded by their own timeouts) and
    /// joins the thread.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Durable {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// The durable side's life on its runtime: connect (reporting the outcome to `start`), run
/// its tasks, serve the shards' requests until stopped, then wait for the tasks.
async fn run_side(
    config: DurableConfig,
    sync: Option<crate::durable::sync::SyncTargets>,
    control: Control,
    rx: mpsc::Receiver<DurableRequest>,
    stop_rx: tokio::sync::watch::Receiver<bool>,
    ready_tx: std::sync::mpsc::Sender<anyhow::Result<()>>,
) {
    let (log, publisher, pg, modes_store) = match connect(&config).await {
        Ok(connected) => connected,
        Err(e) => {
            let _ = ready_tx.send(Err(e));
            return;
        }
    };
    let _ = ready_tx.send(Ok(()));
    let tasks = spawn_tasks(&config, &log, &publisher, &modes_store, sync, &control, &stop_rx);
    let client = log.client().clone();
    let stores = Stores { log, publisher, pg, modes_store, client };
    serve(config, stores, rx, stop_rx).await;
    for task in tasks {
        let _ = task.await;
    }
}

/// The side's own tasks, each until `stop`: `redis-sync` (when this process has shards), the
/// mode bucket watcher, the backlog and PostgreSQL poller, the stock-returned notices, the
/// reconcile lease.
fn spawn_tasks(
    config: &DurableConfig,
    log: &Log,
    publisher: &Publisher,
    modes_store: &jetstream::kv::Store,
    sync: Option<crate::durable::sync::SyncTargets>,
    control: &Control,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    if let Some(targets) = sync {
        let notices = notice::subscribe(log.client().clone(), targets.clone(), stop.clone());
        tasks.push(tokio::spawn(notices));
        tasks.push(tokio::spawn(sync::run(log.clone(), publisher.clone(), targets, stop.clone())));
    }
    let watcher = modes::watch(modes_store.clone(), Arc::clone(&control.modes), stop.clone());
    tasks.push(tokio::spawn(watcher));
    let every = Duration::from_millis(control.health_poll_ms.max(1));
    let poller = health::poll_health(
        log.clone(),
        config.pg_url.clone(),
        Arc::clone(&control.health),
        every,
        stop.clone(),
    );
    tasks.push(tokio::spawn(poller));
    let dependencies = dependencies::poll(
        log.clone(),
        config.pg_url.clone(),
        Arc::clone(&control.health.deps),
        Duration::from_millis(dependencies::DEPENDENCY_POLL_MS),
        stop.clone(),
    );
    tasks.push(tokio::spawn(dependencies));
    if let Some(export) = &config.trace_export {
        let (sink, settings) = (export.sink.clone(), export.config.clone());
        tasks.push(tokio::spawn(flashsale_io::trace::export::run(sink, settings, stop.clone())));
    }
    if let Some((id, period)) = control.reconcile_lease.clone() {
        let lease = Arc::clone(&control.lease);
        let run = lease::run(log.clone(), lease::RECONCILE_LEASE, id, period, lease, stop.clone());
        tasks.push(tokio::spawn(run));
    }
    tasks
}

async fn connect(
    config: &DurableConfig,
) -> anyhow::Result<(Log, Publisher, PgSide, jetstream::kv::Store)> {
    let log = Log::connect(&config.log).await?;
    log.ensure_streams().await?;
    log.ensure_consumers().await?;
    let modes_store = log.mode_store().await?;
    // The same pool code as the worker's: multi-host failover with a whole-connect deadline
    // per host, the fencing rule, keepalives, and the worker's statement/lock timeouts.
    let settings = flashsale_pg_worker::PgPoolConfig {
        url: config.pg_url.clone(),
        pool_size: config.pg_pool_size,
        wait_timeout_ms: config.pg_timeout_ms,
        application_name: "flashsale-edge".to_owned(),
        ..flashsale_pg_worker::PgPoolConfig::default()
    };
    let connector = flashsale_pg_worker::pool::Connector::new(&settings)?;
    let pool = flashsale_pg_worker::pool::build_pool_with(&settings, connector.clone())?;
    // Prove the database answers now rather than on the first buyer's query.
    let client = pool.get().await.map_err(|e| anyhow::anyhow!("postgres: {e}"))?;
    client.simple_query("SELECT 1").await?;
    let publisher = log.publisher();
    Ok((log, publisher, PgSide { pool, connector }, modes_store))
}

/// What the requests are served with.
#[derive(Clone)]
struct Stores {
    log: Log,
    publisher: Publisher,
    pg: PgSide,
    modes_store: jetstream::kv::Store,
    client: flashsale_io::jetstream::async_nats::Client,
}

async fn serve(
    config: DurableConfig,
    stores: Stores,
    mut rx: mpsc::Receiver<DurableRequest>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(config.in_flight_max));
    let pg_timeout = Duration::from_millis(config.pg_timeout_ms);
    loop {
        let request = tokio::select! {
            request = rx.recv() => match request { Some(r) => r, None => break },
            _ = stop.changed() => break,
        };
        // Bounded concurrency: waiting here backs the queue up, and a full queue is an
        // immediate answer on the shard.
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else { break };
        let stores = stores.clone();
        tokio::spawn(async move {
            handle(request, &stores, pg_timeout).await;
            drop(permit);
        });
    }
    // Let in-flight requests finish: each is bounded by its own timeout.
    let _ = permits.acquire_many(config.in_flight_max as u32).await;
}

async fn handle(request: DurableRequest, stores: &Stores, timeout: Duration) {
    let Stores { log, publisher, pg, modes_store, client } = stores;
    match request {
        DurableRequest::PutMode { key, value, version, reply } => {
            let put = modes::put_mode(modes_store, &key, &value, version);
            let put = tokio::time::timeout(timeout, put).await;
            let _ = reply.send(put.unwrap_or(Err(DurableError::Timeout)));
        }
        DurableRequest::Publish { messages, reply } => {
            let acks = messages.iter().map(|(message, msg_id)| async move {
                match msg_id {
                    None => publisher.publish_order(message).await,
                    Some(msg_id) => publisher.publish_order_as(message, msg_id).await,
                }
            });
            let _ = reply.send(futures::future::join_all(acks).await);
        }
        DurableRequest::StockReturned { key } => notice::publish(client, key).await,
        DurableRequest::Pg(job) => job(pg.clone(), timeout).await,
        DurableRequest::Log(job) => job(log.clone(), publisher.clone(), timeout).await,
    }
}

/// One edge PostgreSQL call within `timeout`. A call that outlives it leaves its connection
/// mid-statement, and dropped here that connection would go back to the pool with the
/// statement still running: the next call would queue behind it on a host that may be hung
/// or failed over, and once such a host came back writable on an old timeline the edge would
/// read and write there (the mid-sale drill of `tests/tests/ha_pg.rs` under load: the edge's
/// reconcile read the thawed old primary). So on a timeout the pool's idle connections are
/// closed (the timed-out one is among them by then) and the connector surveys every host
/// before its next connect, learning the newest timeline and fencing the old primary.
async fn with_pg<T, F, Fut>(pg: &PgSide, timeout: Duration, f: F) -> Result<T, DurableError>
where
    F: FnOnce(deadpool_postgres::Object) -> Fut,
    Fut: std::future::Future<Output = Result<T, PgError>>,
{
    let work = async {
        let client = pg.pool.get().await.map_err(|e| DurableError::Pool(e.to_string()))?;
        f(client).await.map_err(DurableError::from)
    };
    // Bound first, so the timed-out call (and its connection) is dropped before the clean-up.
    let outcome = tokio::time::timeout(timeout, work).await;
    match outcome {
        Ok(result) => result,
        Err(_) => {
            pg.connector.suspect();
            pg.pool.retain(|_, _| false);
            Err(DurableError::Timeout)
        }
    }
}
