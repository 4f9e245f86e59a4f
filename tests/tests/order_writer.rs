//! The order-writer against a real PostgreSQL and a real nats-server (DESIGN.md section 5).
//!
//! Two levels:
//! - the transaction (`write_batch` and the `flashsale_order_create` function, no NATS): every
//!   branch, in one batch and one message per transaction; a contended claim
//!   rolled back alone; the duplicate-user put-back and the inbox conflict under real
//!   concurrency (two connections, the second blocked on the first);
//! - the worker (`flashsale_pg_worker::start`, messages published to `SECKILL_ORDERS`): orders
//!   and events end to end, duplicates, a crash between commit and ack, expiry compensation,
//!   one order per buyer, dead letters (malformed, unknown schema, exhausted deliveries), a
//!   poisoned message inside a batch of 32, both allocators under oversubscription, NAK and
//!   retry, graceful shutdown.
//!
//! Every scenario ends with the shared invariant checker (`check_invariants`: DESIGN.md
//! section 8 items 1–3 and 7). Each test has its own nats-server and database.

mod pipeline_support;

use std::time::Duration;

use bytes::Bytes;
use flashsale_io::jetstream::{
    DLQ_DELIVERIES_HEADER, DLQ_ERROR_HEADER, DLQ_STREAM, EVENTS_STREAM, ORDERS_STREAM,
    ORDER_CREATE_SUBJECT, ORDER_WRITER_CONSUMER,
};
use flashsale_io::wire::{EventType, OrderCreate, RejectReason};
use flashsale_pg_worker::{build_pool, start, write_batch, Recorded, WorkerConfig, WriteOutcome};
use pipeline_support::*;
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(30);

fn created(m: &OrderCreate) -> String {
    m.order_id()
}

/// The outcome without the timing field, for exact comparison.
fn strip(outcome: &WriteOutcome) -> WriteOutcome {
    match outcome {
        WriteOutcome::Created { order_id, token_ids, .. } => WriteOutcome::Created {
            order_id: order_id.clone(),
            token_ids: token_ids.clone(),
            claim_us: None,
        },
        WriteOutcome::Rejected { reason, .. } => {
            WriteOutcome::Rejected { reason: *reason, claim_us: None }
        }
        other => other.clone(),
    }
}

fn rejected(reason: RejectReason) -> WriteOutcome {
    WriteOutcome::Rejected { reason, claim_us: None }
}

// ---------------------------------------------------------------------------------------------
// The transaction
// ---------------------------------------------------------------------------------------------

/// Every branch of DESIGN.md section 5, with exact outcomes, rows and events.
async fn every_branch(one_message_per_transaction: bool) {
    let stack = stack().await;
    const TERMINATED: i64 = 10002;
    seed_sku(&stack.client, ACTIVITY, SKU, 2, "TOKEN").await;
    seed_activity(&stack.client, TERMINATED, "TERMINATED").await;
    seed_sku(&stack.client, TERMINATED, SKU, 5, "TOKEN").await;

    let m1 = message(ACTIVITY, SKU, 1, "m1");
    let m2 = expired(message(ACTIVITY, SKU, 2, "m2"));
    let m3 = message(TERMINATED, SKU, 3, "m3");
    let m4 = message(ACTIVITY, SKU, 1, "m4"); // the same buyer as m1
    let m5 = message(ACTIVITY, SKU, 5, "m5");
    let m6 = message(ACTIVITY, SKU, 6, "m6"); // stock is 2: none left
    let m8 = message(999, SKU, 8, "m8"); // an activity PostgreSQL does not know
    let batch: Vec<&OrderCreate> = vec![&m1, &m2, &m3, &m4, &m5, &m6, &m1, &m8, &m2];

    let pool = build_pool(&stack.pool_config()).expect("pool");
    let client = pool.get().await.expect("connection");
    let outcomes: Vec<WriteOutcome> = if one_message_per_transaction {
        let mut all = Vec::new();
        for m in &batch {
            all.extend(
                write_batch(&client, ORDER_WRITER_CONSUMER, &[*m], now_ms()).await.expect("write"),
            );
        }
        all
    } else {
        write_batch(&client, ORDER_WRITER_CONSUMER, &batch, now_ms()).await.expect("write")
    };
    let token = |seq: u32| vec![format!("tok_{ACTIVITY}_{SKU}_{seq}")];
    let expected = vec![
        WriteOutcome::Created { order_id: created(&m1), token_ids: token(1), claim_us: None },
        rejected(RejectReason::Expired),
        rejected(RejectReason::ActivityTerminated),
        rejected(RejectReason::DuplicateUser),
        // m4 claimed token 2 and put it back, so m5 gets it.
        WriteOutcome::Created { order_id: created(&m5), token_ids: token(2), claim_us: None },
        rejected(RejectReason::NoFinalStock),
        WriteOutcome::Duplicate { recorded: Recorded::Created { order_id: created(&m1) } },
        rejected(RejectReason::ActivityTerminated),
        WriteOutcome::Duplicate { recorded: Recorded::Rejected(RejectReason::Expired) },
    ];
    assert_eq!(outcomes.iter().map(strip).collect::<Vec<_>>(), expected);
    // Claims were timed where a claim happened.
    assert!(matches!(outcomes[0], WriteOutcome::Created { claim_us: Some(_), .. }));
    assert!(matches!(outcomes[5], WriteOutcome::Rejected { claim_us: Some(_), .. }));
    assert!(matches!(outcomes[1], WriteOutcome::Rejected { claim_us: None, .. }));

    // Rows.
    for (m, status) in [
        (&m1, "ORDER_CREATED"),
        (&m2, "REJECTED_EXPIRED"),
        (&m3, "REJECTED_ACTIVITY"),
        (&m4, "REJECTED_DUPLICATE_USER"),
        (&m5, "ORDER_CREATED"),
        (&m6, "REJECTED_NO_FINAL_STOCK"),
        (&m8, "REJECTED_ACTIVITY"),
    ] {
        assert_eq!(
            stack.reservation_status(&m.reservation_id).await.as_deref(),
            Some(status),
            "{}",
            m.reservation_id
        );
    }
    assert_eq!(
        stack.count("SELECT count(*) FROM consumer_inbox").await,
        7,
        "one inbox row per distinct message"
    );
    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 2);
    assert_eq!(stack.count("SELECT count(*) FROM inventory_ledger WHERE kind = 'CLAIM'").await, 2);
    assert_eq!(
        stack.count("SELECT count(*) FROM inventory_token WHERE reservation_id = 'resv_m4'").await,
        0,
        "the duplicate buyer's token went back"
    );
    let order_token: String = stack
        .client
        .query_one("SELECT inventory_token_id FROM orders WHERE reservation_id = 'resv_m5'", &[])
        .await
        .expect("m5's order")
        .get(0);
    assert_eq!(vec![order_token], token(2));

    // One event per outcome, in message order, the compensation flags per reason.
    let events = stack.outbox().await;
    /// (reservation, type, reason, return_stock, release_user, order)
    type Summary = (String, EventType, Option<RejectReason>, bool, bool, Option<String>);
    let summary: Vec<Summary> = events
        .iter()
        .map(|(_, aggregate, published, e)| {
            assert!(!published, "nothing publishes in this test");
            assert_eq!(aggregate, &e.reservation_id);
            (
                e.reservation_id.clone(),
                e.event_type,
                e.reason_code,
                e.return_stock,
                e.release_user,
                e.order_id.clone(),
            )
        })
        .collect();
    let ev =
        |m: &OrderCreate,
         t: EventType,
         r: Option<RejectReason>,
         stock: bool,
         user: bool,
         order: Option<String>| { (m.reservation_id.clone(), t, r, stock, user, order) };
    use EventType::{Compensate, OrderCreated};
    assert_eq!(
        summary,
        vec![
            ev(&m1, OrderCreated, None, false, false, Some(created(&m1))),
            ev(&m2, Compensate, Some(RejectReason::Expired), true, true, None),
            ev(&m3, Compensate, Some(RejectReason::ActivityTerminated), true, true, None),
            ev(&m4, Compensate, Some(RejectReason::DuplicateUser), true, false, None),
            ev(&m5, OrderCreated, None, false, false, Some(created(&m5))),
            ev(&m6, Compensate, Some(RejectReason::NoFinalStock), false, true, None),
            ev(&m1, OrderCreated, None, false, false, Some(created(&m1))), // re-emitted
            ev(&m8, Compensate, Some(RejectReason::ActivityTerminated), true, true, None),
            ev(&m2, Compensate, Some(RejectReason::Expired), true, true, None), // re-emitted
        ]
    );
    // Events carry what redis-sync needs.
    let first = &events[0].3;
    assert_eq!(first.request_id, m1.request_id);
    assert_eq!(first.message_id, m1.message_id);
    assert_eq!(first.payload_hash, m1.payload_hash);
    assert_eq!(first.user_id, 1);
    assert_eq!(first.traceparent, m1.traceparent);

    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!((report.orders_live, report.tokens_claimed, report.tokens_available), (2, 2, 0));
    stack.assert_invariants(TERMINATED, SKU).await;
}

#[tokio::test]
async fn every_branch_in_one_batch_transaction() {
    every_branch(false).await;
}

#[tokio::test]
async fn every_branch_one_message_per_transaction() {
    every_branch(true).await;
}

/// ROW allocator in a batch: the first claim takes units for the SKU's remaining messages in
/// one conditional decrement; a duplicate buyer's unit is reused by a later message; a message
/// that fails is redone without, its unit back in the pool; unused units return before COMMIT.
#[tokio::test]
async fn the_row_batch_pool_reuses_and_returns_units() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 3, "ROW").await;
    // A poison that fails inside the transaction: its order id is taken by another SKU's order.
    seed_sku(&stack.client, ACTIVITY, 99, 1, "ROW").await;
    stack
        .client
        .execute(
            "INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, reservation_id) \
             VALUES ('ord_rpoison', $1, 99, 999999, 'req_other', 'resv_other')",
            &[&ACTIVITY],
        )
        .await
        .expect("the colliding order");
    let u1 = message(ACTIVITY, SKU, 1, "r1");
    let u1_again = message(ACTIVITY, SKU, 1, "r1again");
    let poison = message(ACTIVITY, SKU, 7, "rpoison");
    let late = expired(message(ACTIVITY, SKU, 8, "rlate"));
    let u2 = message(ACTIVITY, SKU, 2, "r2");
    let pool = build_pool(&stack.pool_config()).expect("pool");
    let client = pool.get().await.expect("connection");
    let outcomes = write_batch(
        &client,
        ORDER_WRITER_CONSUMER,
        &[&u1, &u1_again, &poison, &late, &u2],
        now_ms(),
    )
    .await
    .expect("write");
    assert_eq!(
        outcomes.iter().map(kind).collect::<Vec<_>>(),
        ["created", "rejected", "failed", "rejected", "created"]
    );
    assert!(matches!(&outcomes[2], WriteOutcome::Failed { error, .. } if error.contains("23505")));
    // Three units taken at the first claim; u1 and u2 used two; the rest came back.
    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!((report.orders_live, report.available_stock), (2, Some(1)));

    // The last unit goes to the next buyer, then the SKU is sold out for good.
    let (u3, u4) = (message(ACTIVITY, SKU, 3, "r3"), message(ACTIVITY, SKU, 4, "r4"));
    let outcomes =
        write_batch(&client, ORDER_WRITER_CONSUMER, &[&u3, &u4], now_ms()).await.expect("write");
    assert_eq!(
        outcomes.iter().map(strip).collect::<Vec<_>>(),
        vec![
            WriteOutcome::Created { order_id: u3.order_id(), token_ids: vec![], claim_us: None },
            rejected(RejectReason::NoFinalStock),
        ]
    );
    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!((report.orders_live, report.available_stock), (3, Some(0)));
}

/// Holds every token of a SKU locked in an open transaction on its own connection.
async fn lock_all_tokens(stack: &Stack, sku_id: i64) -> Client {
    let locker = connect(&stack.db.url).await;
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT token_id FROM inventory_token WHERE activity_id = {ACTIVITY} \
             AND sku_id = {sku_id} FOR UPDATE"
        ))
        .await
        .expect("lock tokens");
    locker
}

#[tokio::test]
async fn a_contended_claim_is_rolled_back_alone() {
    let stack = stack().await;
    const LOCKED: i64 = 1;
    const FREE: i64 = 2;
    seed_sku(&stack.client, ACTIVITY, LOCKED, 2, "TOKEN").await;
    seed_sku(&stack.client, ACTIVITY, FREE, 10, "TOKEN").await;
    let locker = lock_all_tokens(&stack, LOCKED).await;
    let pool = build_pool(&stack.pool_config()).expect("pool");
    let client = pool.get().await.expect("connection");

    // Contended in the middle of a batch, at its end, and alone.
    let (b1, a1, b2) = (
        message(ACTIVITY, FREE, 1, "b1"),
        message(ACTIVITY, LOCKED, 2, "a1"),
        message(ACTIVITY, FREE, 3, "b2"),
    );
    let outcomes = write_batch(&client, ORDER_WRITER_CONSUMER, &[&b1, &a1, &b2], now_ms())
        .await
        .expect("write");
    let kinds: Vec<&str> = outcomes.iter().map(kind).collect();
    assert_eq!(kinds, ["created", "contended", "created"]);
    let (b3, a2) = (message(ACTIVITY, FREE, 4, "b3"), message(ACTIVITY, LOCKED, 5, "a2"));
    let outcomes =
        write_batch(&client, ORDER_WRITER_CONSUMER, &[&b3, &a2], now_ms()).await.expect("write");
    assert_eq!(outcomes.iter().map(kind).collect::<Vec<_>>(), ["created", "contended"]);
    let outcomes =
        write_batch(&client, ORDER_WRITER_CONSUMER, &[&a1], now_ms()).await.expect("write");
    assert_eq!(outcomes, vec![WriteOutcome::Contended]);

    // Nothing of the contended messages was kept: no inbox row, no reservation, no event.
    for m in [&a1, &a2] {
        assert_eq!(stack.reservation_status(&m.reservation_id).await, None);
    }
    assert_eq!(stack.count("SELECT count(*) FROM consumer_inbox").await, 3);
    assert_eq!(stack.outbox().await.len(), 3);

    // Once the holder is gone the same messages succeed.
    locker.batch_execute("ROLLBACK").await.expect("release");
    let outcomes =
        write_batch(&client, ORDER_WRITER_CONSUMER, &[&a1, &a2], now_ms()).await.expect("write");
    assert_eq!(outcomes.iter().map(kind).collect::<Vec<_>>(), ["created", "created"]);
    stack.assert_invariants(ACTIVITY, LOCKED).await;
    stack.assert_invariants(ACTIVITY, FREE).await;
}

fn kind(outcome: &WriteOutcome) -> &'static str {
    match outcome {
        WriteOutcome::Created { .. } => "created",
        WriteOutcome::Rejected { .. } => "rejected",
        WriteOutcome::Duplicate { .. } => "duplicate",
        WriteOutcome::Contended => "contended",
        WriteOutcome::Failed { .. } => "failed",
    }
}

/// One call of the per-message function on a plain connection (inside its open transaction).
async fn call(
    client: &Client,
    m: &OrderCreate,
) -> (String, Option<String>, Option<String>, Option<String>) {
    let t = |ms: u64| std::time::UNIX_EPOCH + Duration::from_millis(ms);
    let row = client
        .query_one(
            "SELECT r_outcome, r_recorded, r_order_id, r_token_ids[1] FROM flashsale_order_create(\
             $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
            &[
                &ORDER_WRITER_CONSUMER,
                &m.message_id,
                &m.reservation_id,
                &m.request_id,
                &(m.activity_id as i64),
                &(m.sku_id as i64),
                &(m.user_id as i64),
                &(m.quantity as i32),
                &t(m.reserved_at_ms),
                &t(m.reservation_expires_at_ms),
                &t(now_ms()),
                &m.order_id(),
                &1i32,
            ],
        )
        .await
        .expect("flashsale_order_create");
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

/// Asserts that `task` is still blocked (waiting for a lock) after a short while.
async fn assert_blocked<T>(task: &tokio::task::JoinHandle<T>, stack: &Stack) {
    eventually("the second transaction waits for a lock", WAIT, || async {
        stack
            .count(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND datname = current_database()",
            )
            .await
            == 1
    })
    .await;
    assert!(!task.is_finished());
}

#[tokio::test]
async fn a_concurrent_duplicate_buyer_gets_the_token_put_back() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 5, "TOKEN").await;
    let first = connect(&stack.db.url).await;
    let second = connect(&stack.db.url).await;
    let (a, b) = (message(ACTIVITY, SKU, 7, "a"), message(ACTIVITY, SKU, 7, "b"));

    first.batch_execute("BEGIN").await.expect("begin");
    let (outcome, _, _, token_a) = call(&first, &a).await;
    assert_eq!(outcome, "ORDER_CREATED");
    assert_eq!(token_a.as_deref(), Some("tok_10001_20001_1"));
    // The second claims token 2 (SKIP LOCKED) and then waits on the buyer's unique key.
    let task = tokio::spawn(async move {
        second.batch_execute("BEGIN").await.expect("begin");
        let result = call(&second, &b).await;
        second.batch_execute("COMMIT").await.expect("commit");
        result
    });
    assert_blocked(&task, &stack).await;
    first.batch_execute("COMMIT").await.expect("commit");
    let (outcome, _, order, token_b) = task.await.expect("join");
    assert_eq!(outcome, "REJECTED_DUPLICATE_USER");
    assert_eq!((order, token_b), (None, None));
    let statuses: Vec<(String, String)> = stack
        .client
        .query("SELECT token_id, status FROM inventory_token ORDER BY seq LIMIT 2", &[])
        .await
        .expect("tokens")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        statuses,
        vec![
            ("tok_10001_20001_1".to_owned(), "CLAIMED".to_owned()),
            ("tok_10001_20001_2".to_owned(), "AVAILABLE".to_owned()),
        ]
    );
    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!((report.orders_live, report.tokens_available), (1, 4));
}

#[tokio::test]
async fn the_same_message_in_two_concurrent_transactions_makes_one_order() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 5, "TOKEN").await;
    let first = connect(&stack.db.url).await;
    let second = connect(&stack.db.url).await;
    let m = message(ACTIVITY, SKU, 9, "same");

    first.batch_execute("BEGIN").await.expect("begin");
    assert_eq!(call(&first, &m).await.0, "ORDER_CREATED");
    let copy = m.clone();
    let task = tokio::spawn(async move {
        second.batch_execute("BEGIN").await.expect("begin");
        let result = call(&second, &copy).await;
        second.batch_execute("COMMIT").await.expect("commit");
        result
    });
    // Waits on the inbox key of the first.
    assert_blocked(&task, &stack).await;
    first.batch_execute("COMMIT").await.expect("commit");
    let (outcome, recorded, order, _) = task.await.expect("join");
    assert_eq!(outcome, "DUPLICATE");
    assert_eq!(recorded.as_deref(), Some("ORDER_CREATED"));
    assert_eq!(order, Some(m.order_id()));
    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(stack.count("SELECT count(*) FROM consumer_inbox").await, 1);
    stack.assert_invariants(ACTIVITY, SKU).await;
}

// ---------------------------------------------------------------------------------------------
// The worker
// ---------------------------------------------------------------------------------------------

async fn wait_for_orders(stack: &Stack, expected: i64) {
    eventually(&format!("{expected} orders"), WAIT, || async {
        stack.count("SELECT count(*) FROM orders").await >= expected
    })
    .await;
    assert_eq!(stack.count("SELECT count(*) FROM orders").await, expected);
}

/// Waits until `order-writer` has nothing pending or unacked.
async fn wait_drained(stack: &Stack) {
    eventually("order-writer drained", WAIT, || async {
        stack.consumer_state(ORDERS_STREAM, ORDER_WRITER_CONSUMER).await == (0, 0)
    })
    .await;
}

/// Waits until every outbox row is published.
async fn wait_outbox_published(stack: &Stack) {
    eventually("outbox published", WAIT, || async {
        stack.count("SELECT count(*) FROM event_outbox WHERE published_at IS NULL").await == 0
    })
    .await;
}

#[tokio::test]
async fn the_worker_turns_queued_messages_into_orders_and_events() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 20, "TOKEN").await;
    let messages: Vec<OrderCreate> =
        (1..=20).map(|u| message(ACTIVITY, SKU, u, &format!("w{u}"))).collect();
    stack.publish_all(&messages).await;

    let worker = start(stack.worker_config(8)).expect("start worker");
    wait_for_orders(&stack, 20).await;
    wait_drained(&stack).await;
    wait_outbox_published(&stack).await;
    // The lag handle saw the drained consumer.
    let lag = worker.lag();
    eventually("lag polled as empty", WAIT, || {
        let lag = lag.clone();
        async move { lag.polled_at_ms() > 0 && lag.pending() == 0 }
    })
    .await;
    worker.shutdown().expect("graceful shutdown");

    // Each order's event is on SECKILL_EVENTS exactly once, keyed evt_<event_id>, with the
    // reservation's traceparent.
    let outbox = stack.outbox().await;
    assert_eq!(outbox.len(), 20);
    let wire = stack.stream_messages(EVENTS_STREAM).await;
    assert_eq!(wire.len(), 20);
    for (event_id, _, published, event) in &outbox {
        assert!(published);
        assert_eq!(event.event_type, EventType::OrderCreated);
        let on_wire = wire
            .iter()
            .find(|w| {
                w.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned())
                    == Some(format!("evt_{event_id}"))
            })
            .unwrap_or_else(|| panic!("event {event_id} not on the wire"));
        assert_eq!(on_wire.subject.as_str(), "seckill.event.order_created");
        assert_eq!(
            on_wire.headers.get("traceparent").map(|v| v.as_str().to_owned()),
            event.traceparent
        );
        let decoded = flashsale_io::wire::decode_event(&on_wire.payload).expect("decodes");
        assert_eq!(&decoded, event);
    }
    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!((report.orders_live, report.tokens_available), (20, 0));
}

#[tokio::test]
async fn the_same_message_delivered_twice_concurrently_makes_one_order() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 10, "TOKEN").await;
    // Three units: the loser must neither claim three more tokens nor write three more CLAIMs.
    let m = OrderCreate { quantity: 3, ..message(ACTIVITY, SKU, 3, "twice") };
    // Two deliveries of the same body: a republish after the dedup window carries the same
    // message_id in the body but passes JetStream's dedup (different Nats-Msg-Id here).
    let publisher = stack.log.publisher();
    for copy in ["a", "b"] {
        publisher
            .publish(
                ORDER_CREATE_SUBJECT,
                &format!("{}#{copy}", m.message_id),
                None,
                &[],
                Bytes::from(m.encode()),
            )
            .await
            .expect("publish copy");
    }
    // Two writers, one message per pull: the copies go to different transactions.
    let mut config = stack.worker_config(1);
    config.order_writers = 2;
    let worker = start(config).expect("start");
    wait_drained(&stack).await;
    wait_outbox_published(&stack).await;
    worker.shutdown().expect("shutdown");

    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(stack.count("SELECT count(*) FROM consumer_inbox").await, 1);
    assert_eq!(
        stack.count("SELECT count(*) FROM inventory_token WHERE status = 'CLAIMED'").await,
        3
    );
    assert_eq!(stack.count("SELECT count(*) FROM inventory_ledger WHERE kind = 'CLAIM'").await, 3);
    // The loser re-announced the recorded outcome: two identical order_created events.
    let events = stack.outbox().await;
    assert_eq!(events.len(), 2);
    for (_, _, _, e) in &events {
        assert_eq!(
            (e.event_type, e.order_id.clone()),
            (EventType::OrderCreated, Some(m.order_id()))
        );
    }
    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!((report.units_live, report.tokens_available), (3, 7));
}

#[tokio::test]
async fn a_worker_killed_between_commit_and_ack_loses_nothing_and_duplicates_nothing() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 10, "TOKEN").await;
    let messages: Vec<OrderCreate> =
        (1..=5).map(|u| message(ACTIVITY, SKU, u, &format!("k{u}"))).collect();
    stack.publish_all(&messages).await;

    // "The worker": pull, commit, and die before acking.
    {
        let source = stack.log.order_writer().await.expect("consumer");
        let deliveries = source.fetch(5, Duration::from_secs(1)).await.expect("fetch");
        assert_eq!(deliveries.len(), 5);
        let decoded: Vec<OrderCreate> = deliveries
            .iter()
            .map(|d| flashsale_io::wire::decode_order_create(d.payload()).expect("decode"))
            .collect();
        let pool = build_pool(&stack.pool_config()).expect("pool");
        let client = pool.get().await.expect("connection");
        let refs: Vec<&OrderCreate> = decoded.iter().collect();
        let outcomes =
            write_batch(&client, ORDER_WRITER_CONSUMER, &refs, now_ms()).await.expect("commit");
        assert!(outcomes.iter().all(|o| kind(o) == "created"));
        // Dropped here, unacked.
    }
    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 5);
    assert_eq!(stack.consumer_state(ORDERS_STREAM, ORDER_WRITER_CONSUMER).await, (0, 5));

    // After the ack wait the server redelivers to a fresh worker.
    let worker = start(stack.worker_config(8)).expect("start");
    wait_drained(&stack).await;
    wait_outbox_published(&stack).await;
    worker.shutdown().expect("shutdown");

    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 5, "no duplicate order");
    assert_eq!(stack.count("SELECT count(*) FROM consumer_inbox").await, 5);
    // Each reservation's outcome was announced by the commit and re-announced by the replay.
    let events = stack.outbox().await;
    assert_eq!(events.len(), 10);
    for m in &messages {
        let mine: Vec<_> = events.iter().filter(|(_, a, _, _)| a == &m.reservation_id).collect();
        assert_eq!(mine.len(), 2, "{}", m.reservation_id);
        for (_, _, _, e) in mine {
            assert_eq!(e.order_id, Some(m.order_id()));
        }
    }
    stack.assert_invariants(ACTIVITY, SKU).await;
}

/// A stream store that lost its sequence while the consumer's state survived: nats-server
/// 2.9.10's known defects can leave that (the suspected cause of seed 8's breach in an earlier
/// fault campaign; `flashsale_io::jetstream::StrandWatch`). Here the store's message files go while
/// the server is down, which leaves the same state: the stream numbers new messages from 1
/// again, below `order-writer`'s floor, acks every publish and delivers none. Without the
/// strand watch (the control) the queued buyers never get an order; with it, the consumer is
/// recreated and every one does, once.
#[tokio::test]
async fn messages_stranded_below_the_consumers_floor_get_their_orders_once_the_consumer_is_recreated(
) {
    let mut stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 10, "TOKEN").await;
    let before: Vec<OrderCreate> =
        (1..=5).map(|u| message(ACTIVITY, SKU, u, &format!("s{u}"))).collect();
    stack.publish_all(&before).await;
    let worker = start(stack.worker_config(8)).expect("start");
    wait_for_orders(&stack, 5).await;
    wait_drained(&stack).await;
    worker.shutdown().expect("shutdown");

    // The store loses its messages and their sequence; the consumer's state stays (stopped
    // gracefully so that its ack floor is on disk: after a kill -9 the floor can be older,
    // and the consumer then redelivers the new messages by chance as its "unacked" ones).
    stack.nats.stop();
    let msgs = stack.nats.dir().join("store/jetstream/$G/streams").join(ORDERS_STREAM).join("msgs");
    for file in std::fs::read_dir(&msgs).expect("the stream's message files") {
        std::fs::remove_file(file.expect("entry").path()).expect("remove a message file");
    }
    stack.nats.restart();
    eventually("SECKILL_ORDERS back", WAIT, || async {
        match stack.log.context().get_stream(ORDERS_STREAM).await {
            Ok(mut stream) => stream.info().await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    let after: Vec<OrderCreate> =
        (6..=8).map(|u| message(ACTIVITY, SKU, u, &format!("s{u}"))).collect();
    stack.publish_all(&after).await;
    let mut stream = stack.log.context().get_stream(ORDERS_STREAM).await.expect("stream");
    let state = stream.info().await.expect("stream info").state.clone();
    let consumer = stream.consumer_info(ORDER_WRITER_CONSUMER).await.expect("consumer info");
    assert_eq!((state.first_sequence, state.last_sequence), (1, 3), "the sequence restarted");
    assert_eq!(
        (consumer.delivered.stream_sequence, consumer.ack_floor.stream_sequence),
        (5, 5),
        "the consumer's floor survived"
    );

    // The control: a worker without the watch delivers nothing for 3 s (ten times its pull
    // wait, thirty lag polls).
    let blind =
        start(WorkerConfig { stranded_repair_ms: 0, ..stack.worker_config(8) }).expect("start");
    tokio::time::sleep(Duration::from_secs(3)).await;
    blind.shutdown().expect("shutdown");
    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 5, "stranded: no order");
    assert_eq!(stack.consumer_state(ORDERS_STREAM, ORDER_WRITER_CONSUMER).await, (0, 0));
    assert_eq!(stack.stream_messages(ORDERS_STREAM).await.len(), 3, "held, never delivered");

    // With the watch (1 s here): the consumer is recreated and the three are written once.
    let repairing = std::time::Instant::now();
    let worker = start(stack.worker_config(8)).expect("start");
    wait_for_orders(&stack, 8).await;
    eprintln!(
        "stranded orders written {:.1} s after the worker started",
        repairing.elapsed().as_secs_f64()
    );
    wait_drained(&stack).await;
    wait_outbox_published(&stack).await;
    worker.shutdown().expect("shutdown");
    assert!(stack.stream_messages(ORDERS_STREAM).await.is_empty());
    for m in before.iter().chain(&after) {
        let orders = stack
            .count(&format!("SELECT count(*) FROM orders WHERE user_id = {}", m.user_id))
            .await;
        assert_eq!(orders, 1, "buyer {}", m.user_id);
    }
    stack.assert_invariants(ACTIVITY, SKU).await;
}

#[tokio::test]
async fn an_expired_reservation_is_compensated_exactly_once() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 3, "TOKEN").await;
    let m = expired(message(ACTIVITY, SKU, 4, "late"));
    stack.publish_all(std::slice::from_ref(&m)).await;
    let worker = start(stack.worker_config(8)).expect("start");
    wait_drained(&stack).await;
    wait_outbox_published(&stack).await;
    worker.shutdown().expect("shutdown");

    assert_eq!(
        stack.reservation_status(&m.reservation_id).await.as_deref(),
        Some("REJECTED_EXPIRED")
    );
    let events = stack.outbox().await;
    assert_eq!(events.len(), 1, "exactly one event for the reservation");
    let e = &events[0].3;
    assert_eq!(e.event_type, EventType::Compensate);
    assert_eq!(e.reason_code, Some(RejectReason::Expired));
    assert!(e.return_stock && e.release_user, "expiry returns stock and releases the buyer");
    let wire = stack.stream_messages(EVENTS_STREAM).await;
    assert_eq!(wire.len(), 1);
    assert_eq!(wire[0].subject.as_str(), "seckill.event.compensate");
    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!((report.orders_live, report.tokens_available), (0, 3), "no token taken");
}

#[tokio::test]
async fn two_reservations_of_one_buyer_make_one_order_and_return_the_other_unit() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 5, "TOKEN").await;
    let first = message(ACTIVITY, SKU, 42, "one");
    let second = message(ACTIVITY, SKU, 42, "two");
    stack.publish_all(&[first.clone(), second.clone()]).await;
    let worker = start(stack.worker_config(8)).expect("start");
    wait_drained(&stack).await;
    wait_outbox_published(&stack).await;
    worker.shutdown().expect("shutdown");

    assert_eq!(stack.count("SELECT count(*) FROM orders WHERE user_id = 42").await, 1);
    let statuses = [
        stack.reservation_status(&first.reservation_id).await,
        stack.reservation_status(&second.reservation_id).await,
    ];
    let mut sorted: Vec<String> = statuses.iter().flatten().cloned().collect();
    sorted.sort();
    assert_eq!(sorted, ["ORDER_CREATED", "REJECTED_DUPLICATE_USER"]);
    let loser = if statuses[0].as_deref() == Some("ORDER_CREATED") { &second } else { &first };
    assert_eq!(
        stack
            .count(&format!(
                "SELECT count(*) FROM inventory_token WHERE reservation_id = '{}'",
                loser.reservation_id
            ))
            .await,
        0
    );
    let compensation: Vec<_> = stack
        .outbox()
        .await
        .into_iter()
        .filter(|(_, _, _, e)| e.event_type == EventType::Compensate)
        .collect();
    assert_eq!(compensation.len(), 1);
    let e = &compensation[0].3;
    assert_eq!(e.reservation_id, loser.reservation_id);
    assert_eq!(e.reason_code, Some(RejectReason::DuplicateUser));
    assert!(e.return_stock && !e.release_user, "stock back, the buyer keeps the marker");
    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!((report.orders_live, report.tokens_claimed, report.tokens_available), (1, 1, 4));
}

/// The dead letters on `SECKILL_DLQ`: (error header, deliveries header, body).
async fn dead_letters(stack: &Stack) -> Vec<(String, String, Vec<u8>)> {
    stack
        .stream_messages(DLQ_STREAM)
        .await
        .into_iter()
        .map(|m| {
            assert_eq!(m.subject.as_str(), "seckill.dlq.order-writer");
            let header =
                |name: &str| m.headers.get(name).map(|v| v.as_str().to_owned()).unwrap_or_default();
            (header(DLQ_ERROR_HEADER), header(DLQ_DELIVERIES_HEADER), m.payload.to_vec())
        })
        .collect()
}

#[tokio::test]
async fn malformed_and_unknown_schema_messages_are_dead_lettered_once() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 5, "TOKEN").await;
    let publisher = stack.log.publisher();
    let garbage = b"{\"schema_version\": 1, \"this is\": not json".to_vec();
    let mut newer = message(ACTIVITY, SKU, 1, "v2");
    newer.schema_version = 2;
    let newer = newer.encode();
    let good = message(ACTIVITY, SKU, 2, "good");
    publisher
        .publish(ORDER_CREATE_SUBJECT, "msg_garbage", None, &[], Bytes::from(garbage.clone()))
        .await
        .expect("publish");
    publisher
        .publish(ORDER_CREATE_SUBJECT, "msg_v2", None, &[], Bytes::from(newer.clone()))
        .await
        .expect("publish");
    stack.publish_all(std::slice::from_ref(&good)).await;

    let worker = start(stack.worker_config(8)).expect("start");
    wait_drained(&stack).await;
    let letters = dead_letters(&stack).await;
    assert_eq!(letters.len(), 2);
    let garbage_letter =
        letters.iter().find(|l| l.2 == garbage).expect("garbage dead-lettered with its body");
    assert!(garbage_letter.0.starts_with("malformed message"), "{}", garbage_letter.0);
    assert_eq!(garbage_letter.1, "1", "dead-lettered on the first delivery");
    let newer_letter =
        letters.iter().find(|l| l.2 == newer).expect("v2 dead-lettered with its body");
    assert!(newer_letter.0.contains("unknown schema_version 2"), "{}", newer_letter.0);
    // TERMed: not redelivered after several ack waits, and gone from the work queue.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(dead_letters(&stack).await.len(), 2);
    assert_eq!(stack.consumer_state(ORDERS_STREAM, ORDER_WRITER_CONSUMER).await, (0, 0));
    assert_eq!(stack.stream_messages(ORDERS_STREAM).await.len(), 0);
    worker.shutdown().expect("shutdown");
    // The good message beside them was not held back.
    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(stack.count("SELECT count(*) FROM consumer_inbox").await, 1);
    stack.assert_invariants(ACTIVITY, SKU).await;
}

#[tokio::test]
async fn exhausted_deliveries_are_dead_lettered_with_the_last_error() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 2, "TOKEN").await;
    let locker = lock_all_tokens(&stack, SKU).await;
    let m = message(ACTIVITY, SKU, 1, "stuck");
    stack.publish_all(std::slice::from_ref(&m)).await;
    let worker = start(stack.worker_config(1)).expect("start");
    eventually("dead letter", WAIT, || async { dead_letters(&stack).await.len() == 1 }).await;
    wait_drained(&stack).await;
    worker.shutdown().expect("shutdown");
    locker.batch_execute("ROLLBACK").await.expect("release");

    let letters = dead_letters(&stack).await;
    let (error, deliveries, body) = &letters[0];
    assert!(error.contains("deliveries exhausted (5 of max_deliver 5)"), "{error}");
    assert!(error.contains("contended"), "{error}");
    assert_eq!(deliveries, "5");
    assert_eq!(body, &m.encode());
    // Rolled back every time: nothing of it in PostgreSQL.
    assert_eq!(stack.reservation_status(&m.reservation_id).await, None);
    assert_eq!(stack.count("SELECT count(*) FROM consumer_inbox").await, 0);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(stack.consumer_state(ORDERS_STREAM, ORDER_WRITER_CONSUMER).await, (0, 0));
    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 0);
    stack.assert_invariants(ACTIVITY, SKU).await;
}

#[tokio::test]
async fn a_transient_failure_is_naked_and_then_succeeds() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 2, "TOKEN").await;
    let locker = lock_all_tokens(&stack, SKU).await;
    let m = message(ACTIVITY, SKU, 1, "later");
    stack.publish_all(std::slice::from_ref(&m)).await;
    let mut config = stack.worker_config(1);
    config.contended_nak_ms = 200; // five deliveries span 800 ms
    let worker = start(config).expect("start");
    // The first delivery happens while the tokens are held: it is contended, rolled back and
    // NAKed, so nothing of the message exists yet.
    eventually("a first delivery", WAIT, || async {
        let source = stack.log.context().get_stream(ORDERS_STREAM).await.expect("stream");
        let info = source.consumer_info(ORDER_WRITER_CONSUMER).await.expect("info");
        info.delivered.stream_sequence >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(stack.reservation_status(&m.reservation_id).await, None);
    assert_eq!(stack.count("SELECT count(*) FROM consumer_inbox").await, 0);
    locker.batch_execute("ROLLBACK").await.expect("release");
    wait_for_orders(&stack, 1).await;
    wait_drained(&stack).await;
    worker.shutdown().expect("shutdown");
    assert!(dead_letters(&stack).await.is_empty());
    assert_eq!(stack.reservation_status(&m.reservation_id).await.as_deref(), Some("ORDER_CREATED"));
    stack.assert_invariants(ACTIVITY, SKU).await;
}

#[tokio::test]
async fn a_batch_of_32_with_one_poisoned_message_commits_the_other_31() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 40, "TOKEN").await;
    // The poison passes decoding but fails inside the transaction: its order id is taken by
    // an order of another SKU (a primary-key violation the order insert does not absorb).
    seed_sku(&stack.client, ACTIVITY, 99, 1, "ROW").await;
    stack
        .client
        .execute(
            "INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, reservation_id) \
             VALUES ('ord_poison', $1, 99, 999999, 'req_other', 'resv_other')",
            &[&ACTIVITY],
        )
        .await
        .expect("the colliding order");
    let mut messages: Vec<OrderCreate> =
        (1..=31).map(|u| message(ACTIVITY, SKU, u, &format!("p{u}"))).collect();
    messages.insert(16, message(ACTIVITY, SKU, 5_000, "poison"));
    stack.publish_all(&messages).await;

    let mut config = stack.worker_config(32);
    config.order_writers = 1;
    let worker = start(config).expect("start");
    wait_for_orders(&stack, 32).await; // 31 + the colliding one
    eventually("the poison dead-lettered", WAIT, || async {
        dead_letters(&stack).await.len() == 1
    })
    .await;
    wait_drained(&stack).await;
    worker.shutdown().expect("shutdown");

    let (error, deliveries, _) = &dead_letters(&stack).await[0];
    assert!(error.contains("SQLSTATE 23505"), "{error}");
    assert_eq!(deliveries, "5");
    assert_eq!(stack.count(&format!("SELECT count(*) FROM orders WHERE sku_id = {SKU}")).await, 31);
    assert_eq!(stack.reservation_status("resv_poison").await, None, "nothing of it committed");
    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!((report.orders_live, report.tokens_available), (31, 9));
}

/// 150 buyers for 100 units: exactly 100 orders, 50 final rejections, every count conserved.
async fn oversubscribed(allocator: &str) {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 100, allocator).await;
    let messages: Vec<OrderCreate> =
        (1..=150).map(|u| message(ACTIVITY, SKU, u, &format!("o{u}"))).collect();
    stack.publish_all(&messages).await;
    let mut config = stack.worker_config(8);
    config.order_writers = 3;
    let worker = start(config).expect("start");
    wait_drained(&stack).await;
    wait_outbox_published(&stack).await;
    worker.shutdown().expect("shutdown");

    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 100);
    assert_eq!(
        stack.count("SELECT count(*) FROM inventory_reservation WHERE status = 'REJECTED_NO_FINAL_STOCK'").await,
        50
    );
    let report = stack.assert_invariants(ACTIVITY, SKU).await;
    assert_eq!(report.reservations_total, 150);
    assert_eq!(report.duplicate_buyers, 0);
    match allocator {
        "ROW" => {
            assert_eq!(report.available_stock, Some(0));
            assert_eq!(
                stack
                    .count("SELECT count(*) FROM orders WHERE inventory_token_id IS NOT NULL")
                    .await,
                0
            );
        }
        _ => assert_eq!((report.tokens_claimed, report.tokens_available), (100, 0)),
    }
    let events = stack.outbox().await;
    assert_eq!(events.len(), 150);
    let no_stock: Vec<_> = events
        .iter()
        .filter(|(_, _, _, e)| e.reason_code == Some(RejectReason::NoFinalStock))
        .collect();
    assert_eq!(no_stock.len(), 50);
    assert!(no_stock.iter().all(|(_, _, _, e)| !e.return_stock && e.release_user));
}

#[tokio::test]
async fn the_row_allocator_never_oversells() {
    oversubscribed("ROW").await;
}

#[tokio::test]
async fn the_token_allocator_never_oversells() {
    oversubscribed("TOKEN").await;
}

#[tokio::test]
async fn graceful_shutdown_settles_the_batch_in_hand() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 300, "TOKEN").await;
    let messages: Vec<OrderCreate> =
        (1..=300).map(|u| message(ACTIVITY, SKU, u, &format!("g{u}"))).collect();
    stack.publish_all(&messages).await;
    let worker = start(stack.worker_config(8)).expect("start");
    eventually("some orders", WAIT, || async {
        stack.count("SELECT count(*) FROM orders").await > 0
    })
    .await;
    worker.shutdown().expect("graceful shutdown");

    // Nothing delivered is left unsettled, and every order's message was acked.
    let (pending, unacked) = stack.consumer_state(ORDERS_STREAM, ORDER_WRITER_CONSUMER).await;
    assert_eq!(unacked, 0, "the batch in hand was committed and settled");
    let orders = stack.count("SELECT count(*) FROM orders").await;
    assert_eq!(pending as i64, 300 - orders, "exactly the unwritten messages remain");
    // What was committed before the stop was also published.
    assert_eq!(
        stack.count("SELECT count(*) FROM event_outbox WHERE published_at IS NULL").await,
        0
    );
    stack.assert_invariants(ACTIVITY, SKU).await;

    // A second worker finishes the rest without duplicates.
    let worker = start(stack.worker_config(8)).expect("restart");
    wait_for_orders(&stack, 300).await;
    wait_drained(&stack).await;
    worker.shutdown().expect("shutdown");
    assert_eq!(stack.count("SELECT count(*) FROM consumer_inbox").await, 300);
    stack.assert_invariants(ACTIVITY, SKU).await;
}

/// The per-message functions run with `enable_seqscan = off`: PL/pgSQL caches one plan per
/// statement per session, and a lookup planned while a table was empty (ANALYZEd empty, or
/// fresh) is cached as a sequential scan and stays one as the table grows, making each message
/// cost O(rows). This shows the trap and that the functions are out of it.
#[tokio::test]
async fn the_order_functions_cannot_be_planned_into_sequential_scans() {
    let stack = stack().await;
    stack.client.batch_execute("ANALYZE").await.expect("analyze the empty tables");
    for function in ["flashsale_order_create", "flashsale_fill_pool"] {
        let settings: Vec<String> = stack
            .client
            .query("SELECT unnest(proconfig) FROM pg_proc WHERE proname = $1", &[&function])
            .await
            .expect("proconfig")
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(settings, vec!["enable_seqscan=off".to_owned()], "{function}");
    }
    let plan = |sql: &'static str| {
        let client = &stack.client;
        async move {
            client
                .query(sql, &[])
                .await
                .expect("explain")
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
                .join("\n")
        }
    };
    let lookup = "EXPLAIN SELECT status, order_id FROM inventory_reservation WHERE reservation_id = 'resv_x'";
    // The trap: analyzed empty, the by-key lookup plans as a sequential scan.
    assert!(
        plan(lookup).await.contains("Seq Scan"),
        "the planner's choice on an empty table changed"
    );
    // Inside the functions' setting it uses the primary key.
    stack.client.batch_execute("SET enable_seqscan = off").await.expect("set");
    let with_setting = plan(lookup).await;
    assert!(with_setting.contains("inventory_reservation_pkey"), "{with_setting}");
}

// ---------------------------------------------------------------------------------------------
// The set-based path against the per-message path
// ---------------------------------------------------------------------------------------------

use std::collections::HashMap;

use flashsale_pg_worker::deadpool_postgres::ClientWrapper;
use flashsale_pg_worker::set_writer::{write_set_once, Attempt};
use flashsale_pg_worker::write_batch_per_message;

/// A fresh migrated database and a pooled-style connection to it (no NATS: the transaction
/// alone).
struct Db {
    db: flashsale_tests::TestDb,
    client: Client,
    writer: ClientWrapper,
}

async fn fresh_db() -> Db {
    let db = flashsale_tests::pg_database().await;
    let mut client = connect(&db.url).await;
    flashsale_pg_worker::migrate(&mut client).await.expect("migrate");
    let writer = wrapped(&db.url, None).await;
    Db { db, client, writer }
}

/// A connection as the pool hands it out; with `notices`, every NOTICE the server sends on it
/// (auto_explain's plans) goes there.
async fn wrapped(
    url: &str,
    notices: Option<tokio::sync::mpsc::UnboundedSender<String>>,
) -> ClientWrapper {
    use futures::StreamExt;
    let (client, mut connection) =
        tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    let task = tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let (tokio_postgres::AsyncMessage::Notice(notice), Some(to)) = (message, &notices) {
                let _ = to.send(notice.message().to_owned());
            }
        }
    });
    ClientWrapper::new(client, task)
}

/// Every row the order transaction writes, without generated ids and timestamps, one JSON
/// object per line, in a fixed order (events in event-id order: their order is part of the
/// contract).
async fn canonical_dump(client: &Client) -> String {
    const QUERIES: [(&str, &str); 8] = [
        (
            "orders",
            "SELECT order_id, activity_id, sku_id, user_id, request_id, reservation_id, \
                    inventory_token_id, status, quantity FROM orders ORDER BY order_id",
        ),
        (
            "order_items",
            "SELECT order_id, activity_id, sku_id, quantity, token_ids FROM order_items \
                    ORDER BY order_id",
        ),
        (
            "inventory_token",
            "SELECT token_id, status, reservation_id, order_id, \
                    claimed_at IS NOT NULL AS claimed FROM inventory_token ORDER BY token_id",
        ),
        (
            "consumer_inbox",
            "SELECT consumer_group, message_id, reservation_id FROM consumer_inbox \
                    ORDER BY consumer_group, message_id",
        ),
        (
            "inventory_reservation",
            "SELECT reservation_id, request_id, message_id, activity_id, \
                    sku_id, user_id, status, order_id, reserved_at, expires_at, quantity \
                    FROM inventory_reservation ORDER BY reservation_id",
        ),
        (
            "inventory_ledger",
            "SELECT activity_id, sku_id, token_id, order_id, reservation_id, \
                    kind, unit_no FROM inventory_ledger ORDER BY reservation_id, kind, unit_no",
        ),
        (
            "event_outbox",
            "SELECT aggregate_id, event_type, payload, published_at \
                    FROM event_outbox ORDER BY event_id",
        ),
        (
            "sku_inventory",
            "SELECT activity_id, sku_id, total_stock, allocator, available_stock \
                    FROM sku_inventory ORDER BY activity_id, sku_id",
        ),
    ];
    let mut dump = String::new();
    for (table, query) in QUERIES {
        let sql = format!(
            "SELECT coalesce(string_agg(row_to_json(t)::text, E'\\n'), '') FROM ({query}) t"
        );
        let rows: String = client.query_one(&sql, &[]).await.expect(table).get(0);
        dump.push_str(&format!("-- {table}\n{rows}\n"));
    }
    dump
}

/// The outcome with its timing made comparable: whether a claim was timed, not how long.
fn comparable(outcome: &WriteOutcome) -> WriteOutcome {
    let timed = |us: &Option<i64>| us.map(|_| 0);
    match outcome {
        WriteOutcome::Created { order_id, token_ids, claim_us } => WriteOutcome::Created {
            order_id: order_id.clone(),
            token_ids: token_ids.clone(),
            claim_us: timed(claim_us),
        },
        WriteOutcome::Rejected { reason, claim_us } => {
            WriteOutcome::Rejected { reason: *reason, claim_us: timed(claim_us) }
        }
        other => other.clone(),
    }
}

/// How a script's batch is written on the set-based side.
#[derive(Clone, Copy, PartialEq, Debug)]
enum SetSide {
    /// `write_set_once`: must commit set-based (no fallback).
    SetOnly,
    /// `write_batch`: the set is refused and the batch falls back (a poisoned message).
    WithFallback,
}

/// Both databases of an equivalence run: the per-message path writes `old`, the set-based
/// path `new`; each step checks the outcomes, the end checks every row.
struct Pair {
    old: Db,
    new: Db,
    now_ms: u64,
}

impl Pair {
    async fn new() -> Pair {
        Pair { old: fresh_db().await, new: fresh_db().await, now_ms: now_ms() }
    }

    async fn both(&self, sql: &str) {
        for db in [&self.old, &self.new] {
            db.client.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
    }

    async fn seed(&self, activity_id: i64, sku_id: i64, stock: i64, allocator: &str) {
        for db in [&self.old, &self.new] {
            seed_sku(&db.client, activity_id, sku_id, stock, allocator).await;
        }
    }

    /// Writes `batch` both ways and asserts the same outcomes; returns them.
    async fn step(&self, label: &str, batch: &[OrderCreate], side: SetSide) -> Vec<WriteOutcome> {
        let refs: Vec<&OrderCreate> = batch.iter().collect();
        let old =
            write_batch_per_message(&self.old.writer, ORDER_WRITER_CONSUMER, &refs, self.now_ms)
                .await
                .unwrap_or_else(|e| panic!("{label}: per-message: {e}"));
        let new = match side {
            SetSide::SetOnly => {
                match write_set_once(&self.new.writer, ORDER_WRITER_CONSUMER, &refs, self.now_ms)
                    .await
                    .unwrap_or_else(|e| panic!("{label}: set-based: {e}"))
                {
                    Attempt::Committed(outcomes) => outcomes,
                    Attempt::Refused(reason, error) => {
                        panic!(
                            "{label}: the set-based path refused the batch ({reason:?}): {error}"
                        )
                    }
                }
            }
            SetSide::WithFallback => {
                match write_set_once(&self.new.writer, ORDER_WRITER_CONSUMER, &refs, self.now_ms)
                    .await
                    .expect("set attempt")
                {
                    Attempt::Refused(..) => {}
                    Attempt::Committed(_) => panic!("{label}: expected the set to be refused"),
                }
                write_batch(&self.new.writer, ORDER_WRITER_CONSUMER, &refs, self.now_ms)
                    .await
                    .unwrap_or_else(|e| panic!("{label}: set-based with fallback: {e}"))
            }
        };
        let comparable_old: Vec<WriteOutcome> = old.iter().map(comparable).collect();
        let comparable_new: Vec<WriteOutcome> = new.iter().map(comparable).collect();
        assert_eq!(comparable_new, comparable_old, "{label}: outcomes differ");
        old
    }

    async fn assert_same_rows(&self) {
        let (old, new) =
            (canonical_dump(&self.old.client).await, canonical_dump(&self.new.client).await);
        if old != new {
            let first = old.lines().zip(new.lines()).position(|(a, b)| a != b);
            panic!(
                "rows differ (first differing line {first:?}):\n--- per-message\n{old}\n--- set-based\n{new}"
            );
        }
    }
}

fn with_ids(mut m: OrderCreate, message_tag: &str) -> OrderCreate {
    m.message_id = format!("msg_{message_tag}");
    m
}

/// Another reservation of `m`'s request (what Redis mints when it lost the first): new
/// reservation and message ids, not expired.
fn same_request(m: &OrderCreate, tag: &str) -> OrderCreate {
    let mut again = m.clone();
    again.reservation_id = format!("resv_{tag}");
    again.message_key = format!("resv_{tag}");
    again.message_id = format!("msg_{tag}");
    again.reservation_expires_at_ms = now_ms() + 300_000;
    again
}

/// Every outcome of DESIGN.md section 5, both allocators, through both paths: the same
/// outcomes message by message and the same rows in every table.
#[tokio::test]
async fn the_set_based_path_writes_what_the_per_message_path_writes() {
    const TERMINATED: i64 = 10002;
    const T: i64 = 1; // TOKEN, 3 units
    const R: i64 = 2; // ROW, 3 units
    const L: i64 = 3; // TOKEN, 5 units, all held by another transaction at first
    let pair = Pair::new().await;
    pair.seed(ACTIVITY, T, 3, "TOKEN").await;
    pair.seed(ACTIVITY, R, 3, "ROW").await;
    pair.seed(ACTIVITY, L, 5, "TOKEN").await;
    seed_activity(&pair.old.client, TERMINATED, "TERMINATED").await;
    seed_activity(&pair.new.client, TERMINATED, "TERMINATED").await;
    pair.seed(TERMINATED, T, 2, "TOKEN").await;
    // An ENDED activity still honours reservations taken inside its window.
    pair.seed(10003, T, 1, "ROW").await;
    pair.both("UPDATE activity SET status = 'ENDED' WHERE activity_id = 10003").await;
    let lockers = [lock_all_tokens_of(&pair.old, L).await, lock_all_tokens_of(&pair.new, L).await];

    let m = |sku: i64, user: u64, tag: &str| message(ACTIVITY, sku, user, tag);
    let m1 = m(T, 1, "m1");
    let m2 = m(T, 2, "m2");
    let m3 = m(T, 1, "m3"); // m1's buyer: a duplicate within the batch, a unit to spare
    let x1 = expired(m(T, 9, "x1"));
    let t1 = message(TERMINATED, T, 3, "t1");
    let u1 = message(999, T, 4, "u1"); // an activity PostgreSQL does not know
    let e1 = message(10003, T, 4, "e1");
    let r1 = m(R, 1, "r1");
    let r2 = m(R, 1, "r2"); // r1's buyer
    let r3 = m(R, 3, "r3");
    let m2_twin = with_ids(m2.clone(), "m2twin"); // m2's reservation under another message id
    let c1 = m(L, 1, "c1"); // contended
    let first = vec![
        m1.clone(),
        m2.clone(),
        m1.clone(),
        m3,
        x1.clone(),
        t1,
        u1,
        e1,
        r1,
        r2,
        r3,
        m2_twin,
        c1.clone(),
        c1.clone(),
        x1.clone(),
    ];
    let outcomes = pair.step("first batch", &first, SetSide::SetOnly).await;
    // The script covers what it claims to (checked on the per-message side, which is the
    // reference): created, duplicates, every rejection, contention.
    let kinds: Vec<&str> = outcomes.iter().map(kind).collect();
    assert_eq!(
        kinds,
        [
            "created",
            "created",
            "duplicate",
            "rejected",
            "rejected",
            "rejected",
            "rejected",
            "created",
            "created",
            "rejected",
            "created",
            "duplicate",
            "contended",
            "contended",
            "duplicate"
        ]
    );

    let m4 = m(T, 5, "m4"); // the last TOKEN unit
    let m5 = m(T, 6, "m5"); // none left
    let m6 = m(T, 2, "m6"); // m2's buyer, but no unit left: no final stock comes first
    let r4 = m(R, 4, "r4");
    let r5 = m(R, 5, "r5"); // none left
    let r6 = m(R, 3, "r6"); // r3's buyer across batches, no unit left either
    let m1_twin = with_ids(m1.clone(), "m1twin"); // across batches
    let second = vec![m1.clone(), m4, m5, m6, r4, r5, r6, m1_twin, x1.clone(), c1.clone()];
    let outcomes = pair.step("second batch", &second, SetSide::SetOnly).await;
    assert_eq!(
        outcomes.iter().map(kind).collect::<Vec<_>>(),
        [
            "duplicate",
            "created",
            "rejected",
            "rejected",
            "created",
            "rejected",
            "rejected",
            "duplicate",
            "duplicate",
            "contended"
        ]
    );

    // The holder goes away: the contended message now succeeds; a buyer with an order from
    // an earlier batch and a unit to spare is a duplicate buyer (the unit goes back).
    for locker in &lockers {
        locker.batch_execute("ROLLBACK").await.expect("release");
    }
    let c2 = m(L, 1, "c2");
    let third = vec![c1.clone(), c2.clone(), m(L, 7, "c3"), c2];
    let outcomes = pair.step("third batch", &third, SetSide::SetOnly).await;
    assert_eq!(
        outcomes.iter().map(kind).collect::<Vec<_>>(),
        ["created", "rejected", "created", "duplicate"]
    );

    // A poisoned message (its order id is taken): the set is refused, the batch falls back,
    // and the other messages commit on both sides.
    pair.seed(ACTIVITY, 99, 1, "ROW").await;
    pair.both(&format!(
        "INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, reservation_id) \
         VALUES ('ord_poison', {ACTIVITY}, 99, 999999, 'req_other', 'resv_other')"
    ))
    .await;
    let fourth = vec![m(L, 8, "p1"), m(L, 5_000, "poison"), m(L, 9, "p2")];
    let outcomes = pair.step("poisoned batch", &fourth, SetSide::WithFallback).await;
    assert_eq!(outcomes.iter().map(kind).collect::<Vec<_>>(), ["created", "failed", "created"]);

    // Rule 2b (migration 0009): a buyer's request id recorded under another reservation —
    // Redis lost the first and minted a second — makes the second a duplicate (no unit),
    // across batches and within one, whatever became of the first (an order, an expiry).
    const D: i64 = 4; // TOKEN, 5 units
    pair.seed(ACTIVITY, D, 5, "TOKEN").await;
    let q1 = m(D, 20, "q1");
    let q2 = expired(m(D, 21, "q2"));
    let fifth = vec![q1.clone(), q2.clone()];
    let outcomes = pair.step("requests, first", &fifth, SetSide::SetOnly).await;
    assert_eq!(outcomes.iter().map(kind).collect::<Vec<_>>(), ["created", "rejected"]);
    let q3 = m(D, 22, "q3");
    let q4 = expired(m(D, 23, "q4"));
    let sixth = vec![
        same_request(&q1, "q1b"),
        same_request(&q2, "q2b"),
        q3.clone(),
        same_request(&q3, "q3b"),
        q4.clone(),
        same_request(&q4, "q4b"),
        m(D, 24, "q5"),
    ];
    let outcomes = pair.step("requests, again", &sixth, SetSide::SetOnly).await;
    let duplicate = WriteOutcome::Rejected { reason: RejectReason::DuplicateUser, claim_us: None };
    for i in [0, 1, 3, 5] {
        assert_eq!(outcomes[i], duplicate, "{i}: {outcomes:?}");
    }
    assert_eq!(kind(&outcomes[2]), "created");
    assert_eq!(kind(&outcomes[6]), "created", "the units the duplicates did not take");

    // Quantities (migration 0010): all units or none, per allocator; a duplicate buyer's units
    // stay for the next message; the last units go to whoever asks for no more than is left.
    const QT: i64 = 5; // TOKEN, 5 units
    const QR: i64 = 6; // ROW, 5 units
    pair.seed(ACTIVITY, QT, 5, "TOKEN").await;
    pair.seed(ACTIVITY, QR, 5, "ROW").await;
    let units = |sku: i64, user: u64, tag: &str, quantity: u32| OrderCreate {
        quantity,
        ..m(sku, user, tag)
    };
    let seventh = vec![
        units(QT, 30, "qa1", 2),
        units(QT, 30, "qa2", 2), // qa1's buyer: its two units stay
        units(QT, 31, "qa3", 3),
        units(QT, 32, "qa4", 2), // 0 left of 5
        units(QR, 30, "qb1", 3),
        units(QR, 31, "qb2", 3), // 2 left: none of them taken
        units(QR, 32, "qb3", 2),
    ];
    let outcomes = pair.step("quantities", &seventh, SetSide::SetOnly).await;
    assert_eq!(
        outcomes.iter().map(kind).collect::<Vec<_>>(),
        ["created", "rejected", "created", "rejected", "created", "rejected", "created"]
    );
    let WriteOutcome::Created { token_ids, .. } = &outcomes[2] else { unreachable!() };
    assert_eq!(token_ids.len(), 3, "one token per unit");
    for db in [&pair.old, &pair.new] {
        let units_sold = db
            .client
            .query_one(
                "SELECT coalesce(sum(quantity), 0)::bigint FROM orders \
                 WHERE activity_id = $1 AND sku_id IN ($2, $3)",
                &[&ACTIVITY, &QT, &QR],
            )
            .await
            .expect("units")
            .get::<_, i64>(0);
        assert_eq!(units_sold, 10, "{}: every unit of both SKUs, in whole orders", db.db.name);
    }

    pair.assert_same_rows().await;
    for db in [&pair.old, &pair.new] {
        for (activity, sku) in [
            (ACTIVITY, T),
            (ACTIVITY, R),
            (ACTIVITY, L),
            (ACTIVITY, D),
            (ACTIVITY, QT),
            (ACTIVITY, QR),
            (TERMINATED, T),
        ] {
            let report = flashsale_pg_worker::check_invariants(&db.client, activity, sku)
                .await
                .expect("invariants");
            assert!(report.ok(), "{}: {report:#?}", db.db.name);
        }
    }
}

/// Holds every token of a SKU of `ACTIVITY` locked in an open transaction.
async fn lock_all_tokens_of(db: &Db, sku_id: i64) -> Client {
    let locker = connect(&db.db.url).await;
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT token_id FROM inventory_token WHERE activity_id = {ACTIVITY} \
             AND sku_id = {sku_id} FOR UPDATE"
        ))
        .await
        .expect("lock tokens");
    locker
}

/// Random message sequences (seeded, the seed printed): repeats, reservations under two
/// message ids, shared buyers, expiries, the TERMINATED and unknown activities, both
/// allocators, a SKU half held by another transaction; batches of 1 to 40. Both paths must
/// answer and write the same.
#[tokio::test]
async fn random_sequences_give_the_same_rows_on_both_paths() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = std::env::var("FLASHSALE_EQUIVALENCE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("FLASHSALE_EQUIVALENCE_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    const RUNS: i64 = 12;
    let pair = Pair::new().await;
    seed_activity(&pair.old.client, 20_999, "TERMINATED").await;
    seed_activity(&pair.new.client, 20_999, "TERMINATED").await;
    pair.seed(20_999, 1, 3, "TOKEN").await;
    for run in 0..RUNS {
        let activity = 20_000 + run;
        pair.seed(activity, 1, rng.gen_range(0..6), "TOKEN").await;
        pair.seed(activity, 2, rng.gen_range(0..6), "ROW").await;
        pair.seed(activity, 3, 6, "TOKEN").await;
    }
    // SKU 3: tokens 1-3 of every run held by another transaction (partly contended).
    let hold = "BEGIN; SELECT token_id FROM inventory_token WHERE activity_id >= 20000 \
                AND activity_id < 20999 AND sku_id = 3 AND seq <= 3 FOR UPDATE";
    let mut lockers = Vec::new();
    for db in [&pair.old, &pair.new] {
        let locker = connect(&db.db.url).await;
        locker.batch_execute(hold).await.expect("hold");
        lockers.push(locker);
    }
    let mut totals: HashMap<&'static str, usize> = HashMap::new();
    for run in 0..RUNS {
        let activity = 20_000 + run;
        // A pool of message bodies: a message id always carries the same body.
        let bodies: Vec<OrderCreate> = (0..30)
            .map(|n| {
                let tag = format!("s{seed}_{run}_{n}");
                let (activity, sku) = match rng.gen_range(0..10) {
                    0 => (20_999, 1),
                    1 => (998, 1),
                    k => (activity, 1 + k % 3),
                };
                let mut m = message(activity, sku, rng.gen_range(1..8), &tag);
                // 1 to 3 units (migration 0010: both paths take all of them or none).
                m.quantity = rng.gen_range(1..=3);
                if rng.gen_bool(0.2) {
                    // Another message's reservation under this message id.
                    m.reservation_id = format!("resv_s{seed}_{run}_{}", rng.gen_range(0..30));
                }
                if rng.gen_bool(0.1) {
                    m = expired(m);
                }
                m
            })
            .collect();
        for step in 0..4 {
            let size = rng.gen_range(1..=40);
            let batch: Vec<OrderCreate> =
                (0..size).map(|_| bodies[rng.gen_range(0..bodies.len())].clone()).collect();
            let label = format!("seed {seed} run {run} batch {step}");
            for outcome in pair.step(&label, &batch, SetSide::SetOnly).await {
                *totals.entry(kind(&outcome)).or_default() += 1;
            }
        }
    }
    println!("outcomes over every batch: {totals:?}");
    pair.assert_same_rows().await;
    for kind in ["created", "rejected", "duplicate", "contended"] {
        assert!(totals.get(kind).copied().unwrap_or(0) > 0, "no {kind} outcome: {totals:?}");
    }
}

/// The set-based functions' statements keep per-row index lookups in their cached generic
/// plans, even after the tables were analyzed empty (the trap of FIELD-NOTES.md: a lookup or an
/// EXISTS planned on an empty table becomes a sequential or hashed whole-table scan per
/// batch). auto_explain prints every statement's plan inside the functions as a NOTICE; the
/// generic plans are forced, which is what PL/pgSQL caches after five calls.
#[tokio::test]
async fn the_set_based_functions_keep_index_lookups_in_generic_plans() {
    let db = fresh_db().await;
    db.client.batch_execute("ANALYZE").await.expect("analyze the empty tables");
    seed_sku(&db.client, ACTIVITY, 1, 50, "TOKEN").await;
    seed_sku(&db.client, ACTIVITY, 2, 50, "ROW").await;
    seed_sku(&db.client, ACTIVITY, 3, 2, "TOKEN").await;
    let locker = connect(&db.db.url).await;
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM inventory_token WHERE activity_id = {ACTIVITY} AND sku_id = 3 \
             FOR UPDATE"
        ))
        .await
        .expect("hold SKU 3");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let writer = wrapped(&db.db.url, Some(tx)).await;
    writer
        .batch_execute(
            "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; \
             SET auto_explain.log_nested_statements = on; SET auto_explain.log_level = notice; \
             SET plan_cache_mode = force_generic_plan",
        )
        .await
        .expect("auto_explain");
    let batch: Vec<OrderCreate> = vec![
        message(ACTIVITY, 1, 1, "g1"),
        message(ACTIVITY, 1, 1, "g2"), // the same buyer
        message(ACTIVITY, 2, 1, "g3"),
        message(ACTIVITY, 3, 2, "g4"), // contended
        expired(message(ACTIVITY, 1, 3, "g5")),
    ];
    for round in 0..2 {
        // The second round: every message a duplicate of the first.
        let refs: Vec<&OrderCreate> = batch.iter().collect();
        match write_set_once(&writer, ORDER_WRITER_CONSUMER, &refs, now_ms()).await.expect("write")
        {
            Attempt::Committed(outcomes) => assert_eq!(outcomes.len(), batch.len(), "{round}"),
            Attempt::Refused(reason, error) => panic!("refused ({reason:?}): {error}"),
        }
    }
    drop(writer);
    let mut plans = Vec::new();
    while let Some(notice) = rx.recv().await {
        plans.push(notice);
    }
    let all = plans.join("\n----\n");
    println!("{all}");
    for plan in &plans {
        assert!(!plan.contains("Seq Scan on"), "a sequential scan:\n{plan}");
        assert!(!plan.contains("Hashed SubPlan"), "a hashed subplan:\n{plan}");
        let problems = hot_scans_that_walk(plan);
        assert!(problems.is_empty(), "{problems:?}:\n{plan}");
    }
    for index in [
        "inventory_token_available_idx",
        "inventory_reservation_pkey",
        "orders_activity_sku_user_key",
        "inventory_token_pkey",
    ] {
        assert!(all.contains(index), "no plan uses {index}:\n{all}");
    }
    locker.batch_execute("ROLLBACK").await.expect("release");
}

/// The scans of a hot table in an EXPLAIN text that are not lookups by key: no index or recheck
/// condition, or a filter on a key column (rows walked and filtered instead of looked up).
fn hot_scans_that_walk(plan: &str) -> Vec<String> {
    const HOT: [&str; 4] = ["inventory_reservation", "orders", "inventory_token", "consumer_inbox"];
    const KEYS: [&str; 4] = ["message_id", "reservation_id", "token_id", "user_id"];
    let lines: Vec<&str> = plan.lines().collect();
    let mut problems = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let is_scan =
            line.contains("Scan") && HOT.iter().any(|t| line.contains(&format!(" on {t} ")));
        if !is_scan || line.contains("Bitmap Index Scan") {
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let details: Vec<&str> = lines[i + 1..]
            .iter()
            .take_while(|l| {
                let l_indent = l.len() - l.trim_start().len();
                l_indent > indent && !l.trim_start().starts_with("->")
            })
            .copied()
            .collect();
        if !details.iter().any(|d| d.contains("Index Cond:") || d.contains("Recheck Cond:")) {
            problems.push(format!("no key condition on `{}`", line.trim()));
        }
        // An inequality is a residual check on the rows a key lookup found (0009's "another
        // reservation of the request": `reservation_id <> m.reservation_id` after the request
        // key), never a way in.
        for filter in details.iter().filter(|d| d.contains("Filter:") && !d.contains(" <> ")) {
            if KEYS.iter().any(|k| filter.contains(k)) {
                problems.push(format!("a key filtered, not looked up: `{}`", filter.trim()));
            }
        }
    }
    problems
}

/// A buyer whose order another transaction inserts after the set-based facts were read: the
/// set's order insert waits for it, then refuses the batch (FS001, "buyer race") instead of
/// committing a stale plan; written again, the batch sees the order and rejects the buyer,
/// and the unit it had locked stays AVAILABLE.
#[tokio::test]
async fn a_buyer_raced_by_a_concurrent_transaction_is_a_refusal_then_a_duplicate_buyer() {
    let db = fresh_db().await;
    seed_sku(&db.client, ACTIVITY, SKU, 5, "TOKEN").await;
    let first = connect(&db.db.url).await;
    let (a, b) = (message(ACTIVITY, SKU, 7, "race_a"), message(ACTIVITY, SKU, 7, "race_b"));
    first.batch_execute("BEGIN").await.expect("begin");
    assert_eq!(call(&first, &a).await.0, "ORDER_CREATED");
    let writer = db.writer;
    let task = tokio::spawn(async move {
        let refused = write_set_once(&writer, ORDER_WRITER_CONSUMER, &[&b], now_ms())
            .await
            .expect("set attempt");
        let again = write_batch(&writer, ORDER_WRITER_CONSUMER, &[&b], now_ms()).await;
        (refused, again.expect("write"))
    });
    eventually("the set's order insert waits for the first transaction", WAIT, || async {
        count(
            &db.client,
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        .await
            == 1
    })
    .await;
    first.batch_execute("COMMIT").await.expect("commit");
    let (refused, again) = task.await.expect("join");
    match refused {
        Attempt::Refused(reason, error) => {
            assert_eq!(reason.label(), "buyer_race", "{error}");
            assert!(error.contains("FS001"), "{error}");
        }
        Attempt::Committed(outcomes) => panic!("committed a stale plan: {outcomes:?}"),
    }
    assert_eq!(
        again.iter().map(comparable).collect::<Vec<_>>(),
        vec![WriteOutcome::Rejected { reason: RejectReason::DuplicateUser, claim_us: Some(0) }]
    );
    assert_eq!(count(&db.client, "SELECT count(*) FROM orders").await, 1);
    let report =
        flashsale_pg_worker::check_invariants(&db.client, ACTIVITY, SKU).await.expect("invariants");
    assert!(report.ok(), "{report:#?}");
    assert_eq!((report.orders_live, report.tokens_available), (1, 4));
}

/// The same message in a set-based batch while another transaction holds its inbox row: the
/// set waits for it, and then re-announces the outcome that transaction committed.
#[tokio::test]
async fn a_set_batch_waits_for_a_concurrent_twin_and_re_announces_its_outcome() {
    let db = fresh_db().await;
    seed_sku(&db.client, ACTIVITY, SKU, 5, "TOKEN").await;
    let first = connect(&db.db.url).await;
    let m = message(ACTIVITY, SKU, 9, "twin");
    first.batch_execute("BEGIN").await.expect("begin");
    assert_eq!(call(&first, &m).await.0, "ORDER_CREATED");
    let writer = db.writer;
    let copy = m.clone();
    let task = tokio::spawn(async move {
        write_set_once(&writer, ORDER_WRITER_CONSUMER, &[&copy], now_ms()).await.expect("write")
    });
    eventually("the set's inbox insert waits for the first transaction", WAIT, || async {
        count(
            &db.client,
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        .await
            == 1
    })
    .await;
    first.batch_execute("COMMIT").await.expect("commit");
    match task.await.expect("join") {
        Attempt::Committed(outcomes) => assert_eq!(
            outcomes,
            vec![WriteOutcome::Duplicate {
                recorded: Recorded::Created { order_id: m.order_id() }
            }]
        ),
        Attempt::Refused(reason, error) => panic!("refused ({reason:?}): {error}"),
    }
    assert_eq!(count(&db.client, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(count(&db.client, "SELECT count(*) FROM consumer_inbox").await, 1);
    assert_eq!(
        count(&db.client, "SELECT count(*) FROM event_outbox").await,
        1,
        "the re-announcement"
    );
}

/// The batch follows the backlog: a lone message on an idle worker is written at once (no
/// waiting for a batch to fill), and a backlog is written in transactions that grow from
/// `fetch_min` and never exceed `fetch_max` (transactions counted by the orders' xmin).
#[tokio::test]
async fn the_batch_grows_with_the_backlog_and_a_lone_message_does_not_wait() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 1_000, "TOKEN").await;
    let backlog: Vec<OrderCreate> =
        (1..=600).map(|u| message(ACTIVITY, SKU, u, &format!("bk{u}"))).collect();
    stack.publish_all(&backlog).await;
    // Two writers of 256 fit the tests' max_ack_pending (1,000).
    let mut config = stack.worker_config(16);
    config.fetch_min = 16;
    config.fetch_max = 256;
    let worker = start(config).expect("start");
    wait_for_orders(&stack, 600).await;
    let sizes: Vec<i64> = stack
        .client
        .query("SELECT count(*) FROM orders GROUP BY xmin::text ORDER BY min(created_at)", &[])
        .await
        .expect("orders per transaction")
        .iter()
        .map(|r| r.get(0))
        .collect();
    println!("orders per transaction while draining 600: {sizes:?}");
    assert!(sizes.iter().all(|&n| n <= 256), "a transaction above fetch_max: {sizes:?}");
    assert!(sizes.iter().any(|&n| n > 16), "the batch never grew past fetch_min: {sizes:?}");
    assert_eq!(sizes.first(), Some(&16), "the first pull asks fetch_min: {sizes:?}");

    // Idle now: one message alone.
    wait_drained(&stack).await;
    let lone = message(ACTIVITY, SKU, 5_000, "lone");
    let published = std::time::Instant::now();
    stack.publish_all(std::slice::from_ref(&lone)).await;
    wait_for_orders(&stack, 601).await;
    let waited = published.elapsed();
    println!("a lone message on an idle worker: committed {waited:?} after its publish");
    // Generous: the pull waits at most fetch_wait_ms (50 ms) for a first message; a worker
    // that waited for 16 messages would never commit it.
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    wait_drained(&stack).await;
    worker.shutdown().expect("shutdown");
    stack.assert_invariants(ACTIVITY, SKU).await;
}
