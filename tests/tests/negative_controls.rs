//! Negative controls for the drills: each protection is switched off by a test-only failpoint
//! (the `failpoints` feature; nothing of it is compiled into a release build) and the drill
//! that relies on it must SEE the loss it prevents; switched back on, the same check passes.
//!
//! | switch (failpoint)        | where                        | what the drill sees when on |
//! |---------------------------|------------------------------|-----------------------------|
//! | `negctl.scanner_off`      | engine/src/shard/scanner.rs  | QUEUED buyers whose message was lost get no order |
//! | `negctl.inbox_dedup_off`  | pg-worker/src/plan.rs        | the redelivered batch planned afresh, refused by the reservation key |
//! | `negctl.nats_msg_id_off`  | io/src/jetstream/publisher.rs | a republished message stored twice |
//! | `negctl.comp_marker_off`  | io/src/redis/script/client.rs | stock returned twice for one reservation |
//!
//! And the other way round, a bug switched ON where a release assertion guards the invariant:
//! `plan_bug.extra_unit` (pg-worker/src/plan.rs) plans one unit more than PostgreSQL locked; the
//! drill must see the assertion stop the batch with nothing of it committed (each planning bug
//! against the pure planner: `pg-worker/tests/plan_assertions.rs`).
//!
//! Failpoints are process-global: every test here holds [`serial`] while it runs, and a
//! [`Switch`] removes its failpoint when dropped (a failing assertion included).

mod pipeline_support;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use flashsale_io::jetstream::{
    EVENTS_STREAM, ORDERS_STREAM, ORDER_WRITER_CONSUMER, REDIS_SYNC_CONSUMER,
};
use flashsale_io::wire::{OrderCreate, RejectReason, ReservationEvent};
use flashsale_pg_worker::compensation::{RejectedEvent, RejectionCompensation};
use flashsale_pg_worker::plan::{self, Facts, RecordedRow, SkuClaim, SkuFacts};
use flashsale_pg_worker::set_writer::{write_set_once, Attempt};
use flashsale_pg_worker::{build_pool, start, write_batch, PgPoolConfig, WriteOutcome};
use flashsale_tests::{metric, redis_cmd, small_worker, state, wait_for_ms, Engine, HttpClient};
use pipeline_support::*;

const WAIT: Duration = Duration::from_secs(30);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One protection switched off while this lives.
struct Switch(&'static str);

impl Switch {
    fn on(name: &'static str) -> Switch {
        fail::cfg(name, "return").unwrap();
        Switch(name)
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        fail::remove(self.0);
    }
}

/// The async drills' runtime (the worker and the log client want more than one thread).
fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// `SELECT count(*)` over the engine's database.
fn pg_count(engine: &Engine, sql: &str) -> i64 {
    runtime().block_on(async {
        let client = connect(&engine.db.url).await;
        count(&client, sql).await
    })
}

// ---- (a) the republish scanner --------------------------------------------------------------

/// Short repair deadlines (as the crash drills use) and, when `worker`, an in-process worker.
fn scanner_drill_config(c: &mut flashsale_engine::app::serve::ServeConfig, worker: bool) {
    c.edge.pending_grace_ms = 200;
    c.edge.order_deadline_ms = 1_500;
    c.edge.scanner.interval_ms = 100;
    c.edge.scanner.sku_refresh_ms = 100;
    c.edge.scanner.backoff_base_ms = 200;
    c.edge.scanner.backoff_max_ms = 500;
    if worker {
        c.worker = Some(small_worker(c));
    }
}

/// Purges SECKILL_ORDERS; returns how many messages it dropped.
fn purge_orders(engine: &Engine) -> u64 {
    runtime().block_on(async {
        let client = async_nats::connect(engine.nats.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(ORDERS_STREAM).await.unwrap();
        let purged = stream.purge().await.unwrap();
        assert!(purged.success);
        purged.purged
    })
}

/// Waits until `resv:pending` holds exactly `n` entries, each due more than `margin_ms` ago
/// (scores are next-retry times): a scanner would have claimed every one several times.
fn wait_all_overdue(engine: &Engine, a: u64, s: u64, n: usize, margin_ms: u64) {
    let key = format!("seckill:{{{a}:{s}}}:resv:pending");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let out = redis_cmd(&engine.redis, &["ZRANGE", &key, "0", "-1", "WITHSCORES"]);
        let scores: Vec<u64> =
            out.lines().skip(1).step_by(2).filter_map(|l| l.trim().parse().ok()).collect();
        let now = pipeline_support::now_ms();
        if scores.len() == n && scores.iter().all(|at| at + margin_ms < now) {
            return;
        }
        assert!(Instant::now() < deadline, "pending not {n} overdue entries: {out:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// crash_drills.rs drill b: order-create messages acknowledged by the log are lost before any
/// worker read them (the stream purged); the scanner republishes every overdue reservation
/// and nothing is lost. With the scanner off, the pipeline works (a new buyer is QUEUED and
/// gets an order) but every buyer whose message was lost stays without an outcome: lost
/// buyers. Switched back on, the same engine finds them all.
///
/// Not the NATS-down drill of edge.rs: there the NATS client itself re-sends the publishes it
/// buffered while disconnected once NATS is back, so with the scanner off those buyers still
/// got their orders (observed while writing this test); only edge.rs's checks of the
/// reservation's status (`MESSAGE_SENT`) and send attempts see the scanner missing.
#[test]
fn scanner_off_leaves_buyers_whose_message_was_lost_without_an_order() {
    let _serial = serial();
    let (a, s) = (301, 302);
    let mut engine = Engine::start_with(|c| scanner_drill_config(c, false));
    engine.create_activity(a, s, 50);
    let mut c = HttpClient::connect(engine.http());
    let buyers: Vec<(u64, String)> = (1..=10u64).map(|u| (u, format!("a-{u}"))).collect();
    for (user, id) in &buyers {
        let (_, v) = engine.submit(&mut c, *user, a, s, id);
        assert_eq!(state(&v), "QUEUED", "{v}");
    }
    assert_eq!(purge_orders(&engine), buyers.len() as u64, "each acked message was lost");

    let switch = Switch::on("negctl.scanner_off");
    engine.restart_with(|c| scanner_drill_config(c, true));
    let mut c = HttpClient::connect(engine.http());
    // The witness that the pipeline works: a new buyer is QUEUED and gets an order.
    let (_, v) = engine.submit(&mut c, 500, a, s, "a-witness");
    assert_eq!(state(&v), "QUEUED", "{v}");
    wait_for_ms("the witness's order", 30_000, || {
        state(&engine.query(&mut c, 500, a, s, "a-witness").1) == "SUCCEEDED"
    });
    wait_all_overdue(&engine, a, s, buyers.len(), 1_000);
    let lost = buyers
        .iter()
        .filter(|(user, id)| {
            let (_, v) = engine.query(&mut c, *user, a, s, id);
            !matches!(state(&v), "SUCCEEDED" | "FAILED")
        })
        .count();
    let orders = pg_count(
        &engine,
        &format!("SELECT count(*) FROM orders WHERE activity_id = {a} AND sku_id = {s}"),
    );
    let republished = metric(&engine.metrics(), "flashsale_republished_total");
    eprintln!(
        "scanner off: {} buyers told QUEUED, their messages lost; {lost} without an outcome, \
         all overdue; {orders} order(s) in PostgreSQL (the witness's), {republished} republished",
        buyers.len()
    );
    assert_eq!(lost, buyers.len(), "the drill sees every buyer the scanner would save");
    assert_eq!((orders, republished), (1, 0));

    // Switched back on: the same check passes.
    drop(switch);
    let started = Instant::now();
    for (user, id) in &buyers {
        wait_for_ms("every queued buyer gets an order", 60_000, || {
            let (_, v) = engine.query(&mut c, *user, a, s, id);
            assert_ne!(state(&v), "FAILED", "{v}");
            state(&v) == "SUCCEEDED"
        });
    }
    let republished = metric(&engine.metrics(), "flashsale_republished_total");
    eprintln!(
        "scanner on: all {} found and ordered in {:.1} s ({republished} republished)",
        buyers.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(republished >= buyers.len() as u64);
    engine.assert_invariants(a, s);
}

// ---- (b) the order-writer's inbox dedup -----------------------------------------------------

async fn wait_drained(stack: &Stack) {
    eventually("the order-writer consumer drained", WAIT, || async {
        stack.consumer_state(ORDERS_STREAM, ORDER_WRITER_CONSUMER).await == (0, 0)
    })
    .await;
}

async fn wait_outbox_published(stack: &Stack) {
    eventually("every outbox row published", WAIT, || async {
        stack.count("SELECT count(*) FROM event_outbox WHERE published_at IS NULL").await == 0
    })
    .await;
}

/// The planner's decision (`pg-worker/src/plan.rs`) for `m` redelivered after its commit:
/// the facts it meets then (its inbox row present, its reservation recorded as an order, its
/// buyer holding that order, a spare token of the SKU locked).
fn plan_redelivery(m: &OrderCreate) -> WriteOutcome {
    let facts = Facts {
        inserted_ids: Vec::new(),
        recorded: vec![RecordedRow {
            reservation_id: m.reservation_id.clone(),
            status: plan::ORDER_CREATED_STATUS.to_owned(),
            order_id: Some(m.order_id()),
        }],
        ordered_positions: vec![0],
        requested_positions: Vec::new(),
        skus: vec![SkuFacts {
            key: (ACTIVITY, SKU),
            claim: SkuClaim::Token { tokens: vec!["tok_spare".to_owned()], contended: false },
            claim_us: None,
        }],
    };
    let mut planned = plan::plan(&[m], &facts, now_ms()).expect("consistent facts");
    planned.outcomes.remove(0)
}

fn set_fallbacks(render: &dyn Fn() -> String) -> u64 {
    render()
        .lines()
        .filter(|l| l.starts_with("flashsale_order_writer_set_fallbacks_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// order_writer.rs / crash_drills.rs: the worker dies between COMMIT and the ack, the batch is
/// redelivered. With the planner's dedup off, the redelivered messages are planned afresh
/// (each buyer already holds its order: REJECTED_DUPLICATE_USER, an outcome whose event would
/// compensate a sold unit) and the set-based transaction is refused by the
/// `inventory_reservation` primary key; the worker then falls back to the per-message
/// function, whose own inbox (SQL, migration 0002) finds the duplicates. So the end state is
/// the passing drill's: this protection is redundant with the reservation key plus the
/// per-message path's inbox; what the drill sees is the refusal and the fallback.
#[test]
fn inbox_dedup_off_a_redelivered_batch_is_planned_again_and_refused_by_the_key() {
    let _serial = serial();
    multi_thread().block_on(inbox_dedup_drill());
}

async fn inbox_dedup_drill() {
    let render = flashsale_tests::prometheus_render();
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 10, "TOKEN").await;
    let messages: Vec<OrderCreate> =
        (1..=5).map(|u| message(ACTIVITY, SKU, u, &format!("b{u}"))).collect();
    stack.publish_all(&messages).await;
    let refs: Vec<&OrderCreate> = messages.iter().collect();

    // "The worker": pull, commit, and die before acking.
    let pool = build_pool(&stack.pool_config()).expect("pool");
    {
        let source = stack.log.order_writer().await.expect("consumer");
        let deliveries = source.fetch(5, Duration::from_secs(1)).await.expect("fetch");
        assert_eq!(deliveries.len(), 5);
        let client = pool.get().await.expect("connection");
        let outcomes =
            write_batch(&client, ORDER_WRITER_CONSUMER, &refs, now_ms()).await.expect("commit");
        assert!(outcomes.iter().all(|o| matches!(o, WriteOutcome::Created { .. })));
    }

    let switch = Switch::on("negctl.inbox_dedup_off");
    // The redelivered batch, set-based only: planned afresh, refused by PostgreSQL.
    let client = pool.get().await.expect("connection");
    let attempt = write_set_once(&client, ORDER_WRITER_CONSUMER, &refs, now_ms()).await.unwrap();
    let Attempt::Refused(refusal, error) = attempt else {
        panic!("dedup off: the redelivered batch committed: {attempt:?}")
    };
    eprintln!("inbox dedup off: redelivered batch refused ({}): {error}", refusal.label());
    assert!(error.contains("inventory_reservation_pkey"), "{error}");
    drop(client);
    // What the key refused: for a buyer who holds the order, a rejection whose event would
    // return the sold unit to Redis and tell the buyer FAILED.
    let planned = plan_redelivery(&messages[0]);
    eprintln!("inbox dedup off: the redelivery was planned as {planned:?}");
    let WriteOutcome::Rejected { reason, .. } = planned else { panic!("{planned:?}") };
    assert_eq!(reason, RejectReason::DuplicateUser);
    assert!(reason.compensation().return_stock, "its event would return a sold unit");

    // The real worker on the redelivery: falls back per message, which dedups in SQL.
    let fallbacks_before = set_fallbacks(&*render);
    let worker = start(stack.worker_config(8)).expect("start");
    wait_drained(&stack).await;
    wait_outbox_published(&stack).await;
    worker.shutdown().expect("shutdown");
    let fallbacks = set_fallbacks(&*render) - fallbacks_before;
    let orders = stack.count("SELECT count(*) FROM orders").await;
    let inbox = stack.count("SELECT count(*) FROM consumer_inbox").await;
    let events = stack.outbox().await.len();
    eprintln!(
        "inbox dedup off, worker: {fallbacks} set batch(es) fell back to the per-message path; \
         {orders} orders, {inbox} inbox rows, {events} outbox events (the per-message inbox \
         caught the duplicates)"
    );
    assert!(fallbacks >= 1, "the redelivery left the set-based path");
    assert_eq!((orders, inbox, events), (5, 5, 10), "the per-message inbox still dedups");
    stack.assert_invariants(ACTIVITY, SKU).await;

    // Switched back on: the set-based planner itself finds every duplicate.
    drop(switch);
    let client = pool.get().await.expect("connection");
    let attempt = write_set_once(&client, ORDER_WRITER_CONSUMER, &refs, now_ms()).await.unwrap();
    let Attempt::Committed(outcomes) = attempt else { panic!("dedup on: {attempt:?}") };
    let planned = plan_redelivery(&messages[0]);
    assert!(matches!(planned, WriteOutcome::Duplicate { .. }), "{planned:?}");
    assert!(outcomes.iter().all(|o| matches!(o, WriteOutcome::Duplicate { .. })), "{outcomes:?}");
    assert_eq!(stack.count("SELECT count(*) FROM orders").await, 5);
    stack.assert_invariants(ACTIVITY, SKU).await;
}

// ---- (c) JetStream's Nats-Msg-Id dedup ------------------------------------------------------

/// edge.rs: a republish after a lost ack carries the same `Nats-Msg-Id`, and the stream stores
/// the message once. Without the header the stream stores it twice (the check "every
/// reservation's message is in the log exactly once" fails); the order-writer's inbox still
/// makes one order of it and re-announces the outcome: for correctness this protection is
/// backed by the inbox, what it saves is the log's space and the worker's second pass.
#[test]
fn nats_msg_id_off_a_republish_after_a_lost_ack_is_stored_twice() {
    let _serial = serial();
    multi_thread().block_on(nats_msg_drill());
}

async fn nats_msg_drill() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 10, "TOKEN").await;
    let publisher = stack.log.publisher();
    let off = message(ACTIVITY, SKU, 1, "c-off");
    let on = message(ACTIVITY, SKU, 2, "c-on");

    let switch = Switch::on("negctl.nats_msg_id_off");
    let first = publisher.publish_order(&off).await.expect("publish");
    let again = publisher.publish_order(&off).await.expect("republish");
    drop(switch);
    let stored_off = stack.stream_messages(ORDERS_STREAM).await.len();
    eprintln!(
        "Nats-Msg-Id off: republish duplicate={} (sequences {} and {}), {stored_off} messages \
         stored for 1 reservation",
        again.duplicate, first.sequence, again.sequence
    );
    assert!(!again.duplicate);
    assert_eq!(stored_off, 2, "the republish was stored again");

    let first = publisher.publish_order(&on).await.expect("publish");
    let again = publisher.publish_order(&on).await.expect("republish");
    let stored = stack.stream_messages(ORDERS_STREAM).await.len();
    assert!(again.duplicate, "Nats-Msg-Id on: the republish is recognised");
    assert_eq!(again.sequence, first.sequence);
    assert_eq!(stored - stored_off, 1, "stored once");

    let worker = start(stack.worker_config(8)).expect("start");
    wait_drained(&stack).await;
    wait_outbox_published(&stack).await;
    worker.shutdown().expect("shutdown");
    let orders = stack.count("SELECT count(*) FROM orders").await;
    let inbox = stack.count("SELECT count(*) FROM consumer_inbox").await;
    let events = stack.outbox().await;
    let of = |m: &OrderCreate| events.iter().filter(|e| e.1 == m.reservation_id).count();
    eprintln!(
        "worker: {orders} orders, {inbox} inbox rows; outbox events: {} for the twice-stored \
         message (one a re-announce), {} for the deduplicated one",
        of(&off),
        of(&on)
    );
    assert_eq!((orders, inbox), (2, 2), "the inbox absorbed the second copy");
    assert_eq!((of(&off), of(&on)), (2, 1));
    stack.assert_invariants(ACTIVITY, SKU).await;
}

// ---- (d) the compensation marker ------------------------------------------------------------

fn events_left(engine: &Engine) -> u64 {
    runtime().block_on(async {
        let client = async_nats::connect(engine.nats.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(EVENTS_STREAM).await.unwrap();
        let info = stream.consumer_info(REDIS_SYNC_CONSUMER).await.unwrap();
        info.num_pending + info.num_ack_pending as u64
    })
}

/// Two units reserved by one buyer (all the stock), their expiry rejection delivered twice
/// (two event ids, as a re-emitted outcome is); returns (stock after, compensations counted).
fn compensate_twice(engine: &Engine, a: u64, s: u64, first_event_id: i64) -> (i64, u64) {
    engine.create_activity_with(&format!(
        r#"{{"activity_id":{a},"sku_id":{s},"stock":2,"max_per_buyer":2}}"#
    ));
    let mut c = HttpClient::connect(engine.http());
    let (_, won) = engine.submit_units(&mut c, (1, "d-1"), (a, s), 2);
    assert_eq!(state(&won), "QUEUED", "{won}");
    let resv = won["reservation_id"].as_str().unwrap().to_string();
    let counted_before = metric(&engine.metrics(), "flashsale_compensations_total");
    let message = engine.order_create_of(a, s, &resv, 1, "d-1");
    let event = ReservationEvent::rejected(&message, RejectReason::Expired, 0);
    // One after the other, each applied before the next is sent (redis-sync acks an event
    // only after the shard applied it: applied when its consumer has nothing pending or
    // unacknowledged). Two in one fetch run their compensations concurrently, and the switch's
    // DEL of the marker then reaches Redis before both calls, not before each: the second
    // would find the first's marker and the control would pass or fail with the timing.
    for event_id in [first_event_id, first_event_id + 1] {
        engine.publish_event(event_id, &event);
        wait_for_ms("the event applied", 10_000, || events_left(engine) == 0);
    }
    let (_, v) = engine.query(&mut c, 1, a, s, "d-1");
    assert_eq!((state(&v), v["reason_code"].as_str()), ("FAILED", Some("EXPIRED")), "{v}");
    let stock: i64 =
        redis_cmd(&engine.redis, &["GET", &format!("seckill:{{{a}:{s}}}:stock")]).parse().unwrap();
    let counted = metric(&engine.metrics(), "flashsale_compensations_total") - counted_before;
    (stock, counted)
}

/// edge.rs (`redis_sync_applies_results_and_compensation_clears_sold_out`): a rejection
/// delivered twice returns its units once. With the marker forgotten the units come back
/// twice: Redis conservation (stock + live reservations = initial stock) is off by two.
#[test]
fn comp_marker_off_a_compensation_applied_twice_returns_stock_twice() {
    let _serial = serial();
    let engine = Engine::start();
    let switch = Switch::on("negctl.comp_marker_off");
    let (stock, counted) = compensate_twice(&engine, 401, 402, 1);
    drop(switch);
    eprintln!(
        "compensation marker off: 2 units reserved and rejected twice -> stock {stock} \
         (initial 2), {counted} compensations counted"
    );
    assert_eq!((stock, counted), (4, 2), "the units came back twice");

    let (stock, counted) = compensate_twice(&engine, 403, 404, 3);
    eprintln!("compensation marker on: stock {stock}, {counted} compensation counted");
    assert_eq!((stock, counted), (2, 1), "returned exactly once");
}

// ---- (e) the set-based planner's release assertions -----------------------------------------

/// plan.rs: with `plan_bug.extra_unit` the planner sells one unit more than the facts locked,
/// and its assertion on I1 panics; the set writer rolls the transaction back and the panic
/// carries on, so nothing of the batch commits and no outcome reaches anything that would ack.
/// The pool holds ONE connection: the next batch runs on the connection that panicked, and it
/// commits the same messages afresh (not as duplicates of inbox rows a still-open transaction
/// held), which shows the rollback happened.
#[test]
fn plan_bug_extra_unit_the_assertion_stops_the_batch_before_anything_commits() {
    let _serial = serial();
    multi_thread().block_on(plan_breach_drill());
}

async fn plan_breach_drill() {
    let db = db().await;
    seed_sku(&db.client, ACTIVITY, SKU, 1, "TOKEN").await;
    let messages: Vec<OrderCreate> =
        (1..=2).map(|u| message(ACTIVITY, SKU, u, &format!("e{u}"))).collect();
    let pool =
        build_pool(&PgPoolConfig { url: db.db.url.clone(), pool_size: 1, ..Default::default() })
            .expect("pool");
    let written = {
        let _bug = Switch::on("plan_bug.extra_unit");
        let (pool, messages) = (pool.clone(), messages.clone());
        tokio::spawn(async move {
            let client = pool.get().await.expect("connection");
            let refs: Vec<&OrderCreate> = messages.iter().collect();
            write_batch(&client, ORDER_WRITER_CONSUMER, &refs, now_ms()).await
        })
        .await
    };
    let breach = match written {
        Err(join) if join.is_panic() => join.into_panic(),
        other => panic!("plan bug on: the batch was not stopped: {other:?}"),
    };
    let text = breach.downcast_ref::<String>().cloned().unwrap_or_default();
    eprintln!("plan bug on: the batch stopped: {text}");
    assert!(text.contains("plan breaks I1 (no oversell)"), "{text}");
    assert!(text.contains("resv_e1") && text.contains("resv_e2"), "the ids are named: {text}");
    for table in ["consumer_inbox", "inventory_reservation", "orders", "event_outbox"] {
        let rows = count(&db.client, &format!("SELECT count(*) FROM {table}")).await;
        assert_eq!(rows, 0, "{table}: nothing of the stopped batch committed");
    }
    let available = "SELECT count(*) FROM inventory_token WHERE status = 'AVAILABLE'";
    assert_eq!(count(&db.client, available).await, 1, "the unit is still for sale");

    // Bug off: the same batch on the same connection plans and commits as the rules say.
    let client = pool.get().await.expect("the connection that panicked, back in the pool");
    let refs: Vec<&OrderCreate> = messages.iter().collect();
    let outcomes =
        write_batch(&client, ORDER_WRITER_CONSUMER, &refs, now_ms()).await.expect("commit");
    eprintln!("plan bug off: {outcomes:?}");
    assert!(matches!(outcomes[0], WriteOutcome::Created { .. }), "{outcomes:?}");
    assert!(
        matches!(&outcomes[1], WriteOutcome::Rejected { reason: RejectReason::NoFinalStock, .. }),
        "{outcomes:?}"
    );
    let report =
        flashsale_pg_worker::check_invariants(&db.client, ACTIVITY, SKU).await.expect("audit");
    assert!(report.ok(), "{report:#?}");
}
