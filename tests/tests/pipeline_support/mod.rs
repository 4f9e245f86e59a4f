//! Helpers shared by the durable-pipeline tests (`order_writer.rs`, `pipeline_log.rs`): a
//! private NATS + a fresh migrated database per test, SKU seeding with SQL and
//! `generate_tokens`, order-create messages, polling, and readers for streams, the outbox and
//! consumer state. Every helper asserts what it relies on, so a broken setup fails loudly.
#![allow(dead_code)]

use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use flashsale_io::jetstream::async_nats::jetstream;
use flashsale_io::jetstream::{Log, LogConfig};
use flashsale_io::wire::{decode_event, OrderCreate, ReservationEvent, ORDER_CREATE_EVENT_TYPE};
use flashsale_pg_worker::{generate_tokens, migrate, OrderPath, PgPoolConfig, WorkerConfig};
use flashsale_tests::{nats, pg_database, PrivateNats, TestDb};
use tokio_postgres::{Client, NoTls};

pub const ACTIVITY: i64 = 10001;
pub const SKU: i64 = 20001;

/// One test's servers: its own nats-server, its own database, a plain connection for
/// assertions, and a log client with the streams and consumers created.
pub struct Stack {
    pub nats: PrivateNats,
    pub db: TestDb,
    pub client: Client,
    pub log: Log,
}

/// A log configuration for tests: 1 s ack wait, 5 deliveries, no server backoff list.
pub fn log_config(url: String) -> LogConfig {
    LogConfig {
        url,
        ack_wait_ms: 1_000,
        max_deliver: 5,
        backoff_ms: vec![],
        max_ack_pending: 1_000,
        publish_timeout_ms: 3_000,
        ..LogConfig::default()
    }
}

pub async fn connect(url: &str) -> Client {
    let (client, connection) =
        tokio_postgres::connect(url, NoTls).await.unwrap_or_else(|e| panic!("connect {url}: {e}"));
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// Fresh servers; `tweak` adjusts the log config before the streams are created.
pub async fn stack_with(tweak: impl FnOnce(&mut LogConfig)) -> Stack {
    let nats = nats();
    let db = pg_database().await;
    let mut client = connect(&db.url).await;
    migrate(&mut client).await.expect("migrate");
    let mut config = log_config(nats.url());
    tweak(&mut config);
    let log = Log::connect(&config).await.expect("connect to NATS");
    log.ensure_streams().await.expect("streams");
    log.ensure_consumers().await.expect("consumers");
    Stack { nats, db, client, log }
}

pub async fn stack() -> Stack {
    stack_with(|_| {}).await
}

impl Stack {
    /// A worker configuration for this stack: small pool, short waits.
    pub fn worker_config(&self, batch_max: usize) -> WorkerConfig {
        WorkerConfig {
            pg: PgPoolConfig { url: self.db.url.clone(), pool_size: 5, ..PgPoolConfig::default() },
            log: self.log.config().clone(),
            runtime_threads: 2,
            nice: 0,
            order_writers: 2,
            order_path: OrderPath::SetBased,
            batch_max,
            fetch_min: batch_max,
            fetch_max: batch_max,
            fetch_wait_ms: 50,
            nak_backoff_ms: vec![50, 100, 200],
            contended_nak_ms: 20,
            outbox_publishers: 1,
            outbox_batch_max: 128,
            outbox_idle_ms: 10,
            lag_poll_ms: 100,
            stranded_repair_ms: 1_000,
            error_pause_ms: 50,
            shutdown_timeout_ms: 10_000,
            closer: Default::default(),
            tracing: Default::default(),
        }
    }

    pub fn pool_config(&self) -> PgPoolConfig {
        PgPoolConfig { url: self.db.url.clone(), pool_size: 4, ..PgPoolConfig::default() }
    }

    pub async fn count(&self, sql: &str) -> i64 {
        count(&self.client, sql).await
    }

    /// Publishes every message with its message id (asserting each was new to the stream).
    pub async fn publish_all(&self, messages: &[OrderCreate]) {
        let publisher = self.log.publisher();
        for m in messages {
            let ack = publisher.publish_order(m).await.expect("publish");
            assert!(!ack.duplicate, "{} published twice", m.message_id);
        }
    }

    /// (num_pending, num_ack_pending) of a consumer.
    pub async fn consumer_state(&self, stream: &str, consumer: &str) -> (u64, usize) {
        let stream = self.log.context().get_stream(stream).await.expect("stream");
        let info = stream.consumer_info(consumer).await.expect("consumer info");
        (info.num_pending, info.num_ack_pending)
    }

    /// Every message still stored in `stream`, oldest first.
    pub async fn stream_messages(&self, stream: &str) -> Vec<jetstream::message::StreamMessage> {
        let stream = self.log.context().get_stream(stream).await.expect("stream");
        let state = stream.get_info().await.expect("stream info").state;
        let mut out = Vec::new();
        if state.messages == 0 {
            return out;
        }
        for sequence in state.first_sequence..=state.last_sequence {
            // Work-queue streams have holes where messages were acked.
            if let Ok(message) = stream.get_raw_message(sequence).await {
                out.push(message);
            }
        }
        out
    }

    /// The outbox rows: (event_id, aggregate_id, published?, decoded payload), by event id.
    pub async fn outbox(&self) -> Vec<(i64, String, bool, ReservationEvent)> {
        let rows = self
            .client
            .query(
                "SELECT event_id, aggregate_id, published_at IS NOT NULL, payload::text, event_type \
                 FROM event_outbox ORDER BY event_id",
                &[],
            )
            .await
            .expect("read outbox");
        rows.iter()
            .map(|row| {
                let payload: String = row.get(3);
                let event = decode_event(payload.as_bytes())
                    .unwrap_or_else(|e| panic!("outbox payload {payload} does not decode: {e}"));
                let event_type: String = row.get(4);
                assert_eq!(event.event_type.as_str(), event_type, "column and payload agree");
                (row.get(0), row.get(1), row.get(2), event)
            })
            .collect()
    }

    pub async fn reservation_status(&self, reservation_id: &str) -> Option<String> {
        self.client
            .query_opt(
                "SELECT status FROM inventory_reservation WHERE reservation_id = $1",
                &[&reservation_id],
            )
            .await
            .expect("read reservation")
            .map(|row| row.get(0))
    }

    /// Runs the shared invariant checker and fails the test on any violation.
    pub async fn assert_invariants(
        &self,
        activity_id: i64,
        sku_id: i64,
    ) -> flashsale_pg_worker::InvariantReport {
        let report = flashsale_pg_worker::check_invariants(&self.client, activity_id, sku_id)
            .await
            .expect("invariant query");
        assert!(report.ok(), "invariants violated: {:#?}", report);
        report
    }
}

pub async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}")).get(0)
}

/// An ACTIVE activity (if missing) with one SKU of `stock` units: `TOKEN` gets its tokens,
/// `ROW` its counter.
pub async fn seed_sku(client: &Client, activity_id: i64, sku_id: i64, stock: i64, allocator: &str) {
    seed_activity(client, activity_id, "ACTIVE").await;
    let available: Option<i64> = (allocator == "ROW").then_some(stock);
    client
        .execute(
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator, available_stock) \
             VALUES ($1, $2, $3, $4, $5)",
            &[&activity_id, &sku_id, &stock, &allocator, &available],
        )
        .await
        .expect("insert sku_inventory");
    if allocator == "TOKEN" {
        let created = generate_tokens(client, activity_id, sku_id, stock).await.expect("tokens");
        assert_eq!(created, stock as u64);
    }
}

pub async fn seed_activity(client: &Client, activity_id: i64, status: &str) {
    client
        .execute(
            "INSERT INTO activity (activity_id, status, start_at, end_at, reservation_ttl_ms, \
             pay_timeout_ms) VALUES ($1, $2, now() - interval '1 hour', now() + interval '1 hour', \
             300000, 900000) ON CONFLICT DO NOTHING",
            &[&activity_id, &status],
        )
        .await
        .expect("insert activity");
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_millis() as u64
}

/// An order-create message for `user_id`; `tag` makes the ids (`resv_<tag>`, `msg_<tag>`).
pub fn message(activity_id: i64, sku_id: i64, user_id: u64, tag: &str) -> OrderCreate {
    let now = now_ms();
    OrderCreate {
        schema_version: 1,
        event_type: ORDER_CREATE_EVENT_TYPE.to_owned(),
        message_id: format!("msg_{tag}"),
        message_key: format!("resv_{tag}"),
        request_id: format!("req_{tag}"),
        reservation_id: format!("resv_{tag}"),
        activity_id: activity_id as u64,
        sku_id: sku_id as u64,
        user_id,
        quantity: 1,
        reserved_at_ms: now,
        reservation_expires_at_ms: now + 300_000,
        retry_count: 0,
        payload_hash: format!("sha256:{tag}"),
        traceparent: Some(format!("00-{:032x}-{:016x}-01", user_id, user_id)),
        created_at_ms: now,
    }
}

/// The same message, already expired.
pub fn expired(mut m: OrderCreate) -> OrderCreate {
    m.reserved_at_ms -= 600_000;
    m.reservation_expires_at_ms = m.reserved_at_ms + 300_000;
    m
}

/// Polls `probe` every 20 ms until it is true; panics with `what` after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if probe().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fresh migrated database with a plain client and a small pool (the PostgreSQL-level
/// payment tests).
pub struct Db {
    pub db: TestDb,
    pub client: Client,
    pub pool: flashsale_pg_worker::deadpool_postgres::Pool,
}

pub async fn db() -> Db {
    let db = pg_database().await;
    let mut client = connect(&db.url).await;
    migrate(&mut client).await.expect("migrate");
    let pool = flashsale_pg_worker::build_pool(&PgPoolConfig {
        url: db.url.clone(),
        pool_size: 4,
        ..Default::default()
    })
    .expect("pool");
    Db { db, client, pool }
}

// ---- payments --------------------------------------------------------------------------------

/// Orders for users `users` through the real order-create transaction; their order ids.
pub async fn orders(
    db: &Db,
    activity: i64,
    sku: i64,
    users: std::ops::Range<u64>,
    tag: &str,
) -> Vec<String> {
    let messages: Vec<_> = users.map(|u| message(activity, sku, u, &format!("{tag}{u}"))).collect();
    let refs: Vec<_> = messages.iter().collect();
    let client = db.pool.get().await.expect("pooled connection");
    let outcomes = flashsale_pg_worker::write_batch(
        &client,
        flashsale_io::jetstream::ORDER_WRITER_CONSUMER,
        &refs,
        now_ms(),
    )
    .await
    .expect("write batch");
    outcomes
        .into_iter()
        .map(|o| match o {
            flashsale_pg_worker::WriteOutcome::Created { order_id, .. } => order_id,
            other => panic!("expected an order, got {other:?}"),
        })
        .collect()
}

/// A provider's callback.
pub fn cb(
    payment_id: &str,
    order_id: &str,
    status: &str,
    amount_cents: i64,
) -> flashsale_pg_worker::payments::PaymentCallback {
    flashsale_pg_worker::payments::PaymentCallback {
        payment_id: payment_id.into(),
        order_id: order_id.into(),
        status: status.into(),
        amount_cents,
    }
}

/// (order status, its token's status).
pub async fn status_and_token(c: &Client, order_id: &str) -> (String, String) {
    let row = c
        .query_one(
            "SELECT o.status, t.status FROM orders o JOIN inventory_token t \
             ON t.token_id = o.inventory_token_id WHERE o.order_id = $1",
            &[&order_id],
        )
        .await
        .expect("order");
    (row.get(0), row.get(1))
}

/// Submits for `user` through the engine and waits for the order; its id.
pub fn order_for(
    engine: &flashsale_tests::Engine,
    c: &mut flashsale_tests::HttpClient,
    user: u64,
    activity: u64,
    sku: u64,
) -> String {
    use flashsale_tests::state;
    let request_id = format!("pay-{user}");
    let (status, queued) = engine.submit(c, user, activity, sku, &request_id);
    assert_eq!((status, state(&queued)), (202, "QUEUED"), "{queued}");
    let mut order_id = String::new();
    flashsale_tests::wait_for_ms("order created", 10_000, || {
        let (_, v) = engine.query(c, user, activity, sku, &request_id);
        order_id = v["order_id"].as_str().unwrap_or("").to_string();
        state(&v) == "SUCCEEDED"
    });
    order_id
}
