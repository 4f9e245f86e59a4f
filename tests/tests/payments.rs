//! Payments and the order lifecycle (CONTRACT.md 3.4; DESIGN.md sections 6 and 8), against
//! real servers:
//!
//! - the PostgreSQL side (`flashsale_pg_worker::payments` over migration 0003), orders made by
//!   the real order-writer transaction (`write_batch`): callback idempotency, the PAID /
//!   cancel / closer race, the closer's choice of orders, release policies, resale;
//! - end to end through an in-process engine with its worker: the HTTP routes, signatures,
//!   owner checks, and Redis stock coming back exactly once through `redis-sync`, including
//!   from the closer running inside the worker.
//!
//! Every scenario ends with the DESIGN.md section 8 audit (`check_invariants`).

mod pipeline_support;

use std::sync::Arc;
use std::time::Duration;

use flashsale_io::jetstream::{EVENTS_STREAM, REDIS_SYNC_CONSUMER};
use flashsale_io::key::HmacKey;
use flashsale_io::payment::Signed;
use flashsale_io::wire::{decode_event, EventType, ReservationEvent};
use flashsale_pg_worker::payments::{
    apply_callback, cancel_order, close_due_orders, find_order, mark_payment_unknown,
    CallbackOutcome, ReleaseOutcome,
};
use flashsale_tests::{redis_cmd, small_worker, state, wait_for_ms, Engine, HttpClient};
use pipeline_support::{cb, connect, count, db, now_ms, order_for, orders, seed_sku};
use tokio_postgres::Client;

const PAY_KEY_HEX: &str = "5f3c1a2b4d6e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";
/// The pay timeout `pipeline_support::seed_activity` gives every activity.
const PAY_TIMEOUT_MS: u64 = 900_000;

// ---------------------------------------------------------------------------------------------
// PostgreSQL-level helpers
// ---------------------------------------------------------------------------------------------

async fn order_status(client: &Client, order_id: &str) -> String {
    client
        .query_one("SELECT status FROM orders WHERE order_id = $1", &[&order_id])
        .await
        .expect("order")
        .get(0)
}

async fn token_of(client: &Client, order_id: &str) -> (String, String) {
    let row = client
        .query_one(
            "SELECT t.token_id, t.status FROM orders o JOIN inventory_token t \
             ON t.token_id = o.inventory_token_id WHERE o.order_id = $1",
            &[&order_id],
        )
        .await
        .expect("token");
    (row.get(0), row.get(1))
}

/// Decoded outbox events of one type (every payload must decode as `redis-sync` decodes it).
async fn events(client: &Client, event_type: &str) -> Vec<ReservationEvent> {
    client
        .query(
            "SELECT payload::text FROM event_outbox WHERE event_type = $1 ORDER BY event_id",
            &[&event_type],
        )
        .await
        .expect("outbox")
        .iter()
        .map(|row| {
            let payload: String = row.get(0);
            decode_event(payload.as_bytes())
                .unwrap_or_else(|e| panic!("{payload} does not decode: {e}"))
        })
        .collect()
}

async fn assert_invariants(client: &Client, activity: i64, sku: i64) {
    let report = flashsale_pg_worker::check_invariants(client, activity, sku).await.expect("audit");
    assert!(report.ok(), "invariants violated: {report:#?}");
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL level
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_callback_applies_once_per_payment_id() {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 1, 2, 3, "TOKEN").await;
    let ids = orders(&db, 1, 2, 1..3, "idem").await;
    let (o1, o2) = (&ids[0], &ids[1]);

    let first = apply_callback(c, &cb("pay_1", o1, "PAID", 1999), now_ms()).await.expect("cb");
    assert_eq!(first.outcome, CallbackOutcome::Paid);
    assert_eq!(first.order_status.as_deref(), Some("PAID"));
    assert!(!first.replayed);
    for _ in 0..3 {
        let again = apply_callback(c, &cb("pay_1", o1, "PAID", 1999), now_ms()).await.expect("cb");
        assert_eq!((again.outcome, again.replayed), (CallbackOutcome::Paid, true));
    }
    // One effect: one payment, one SELL, one order_paid event, the token SOLD.
    assert_eq!(count(c, "SELECT count(*) FROM payment").await, 1);
    assert_eq!(count(c, "SELECT count(*) FROM inventory_ledger WHERE kind = 'SELL'").await, 1);
    let paid = events(c, "order_paid").await;
    assert_eq!(paid.len(), 1);
    assert_eq!(paid[0].order_id.as_deref(), Some(o1.as_str()));
    assert_eq!(paid[0].event_type, EventType::OrderPaid);
    assert_eq!(token_of(c, o1).await.1, "SOLD");
    assert_eq!(
        count(c, "SELECT amount_cents FROM orders WHERE status = 'PAID'").await,
        1999,
        "the paid amount is recorded on the order"
    );

    // The same payment id with another body: refused, nothing changes.
    let conflict = apply_callback(c, &cb("pay_1", o1, "PAID", 1), now_ms()).await.expect("cb");
    assert_eq!(conflict.outcome, CallbackOutcome::PaymentConflict);
    let conflict = apply_callback(c, &cb("pay_1", o2, "PAID", 1999), now_ms()).await.expect("cb");
    assert_eq!(conflict.outcome, CallbackOutcome::PaymentConflict);
    assert_eq!(order_status(c, o2).await, "PENDING_PAYMENT");

    // A second, different payment for the paid order: money to give back, order untouched.
    let double = apply_callback(c, &cb("pay_2", o1, "PAID", 1999), now_ms()).await.expect("cb");
    assert_eq!(double.outcome, CallbackOutcome::RefundNeeded);
    assert!(double.outcome.refund_needed());
    // PAID for an order nobody knows: recorded, refund needed.
    let unknown =
        apply_callback(c, &cb("pay_3", "ord_nope", "PAID", 5), now_ms()).await.expect("cb");
    assert_eq!((unknown.outcome, unknown.order_status), (CallbackOutcome::RefundNeeded, None));
    assert_eq!(count(c, "SELECT count(*) FROM payment WHERE outcome = 'REFUND_NEEDED'").await, 2);

    // FAILED is authoritative unpaid; the order stays payable.
    let failed = apply_callback(c, &cb("pay_4", o2, "FAILED", 1999), now_ms()).await.expect("cb");
    assert_eq!(failed.outcome, CallbackOutcome::Unpaid);
    assert_eq!(order_status(c, o2).await, "PENDING_PAYMENT");
    let failed = apply_callback(c, &cb("pay_4", o2, "FAILED", 1999), now_ms()).await.expect("cb");
    assert_eq!((failed.outcome, failed.replayed), (CallbackOutcome::Unpaid, true));
    // Then paid by another attempt.
    let paid = apply_callback(c, &cb("pay_5", o2, "PAID", 1999), now_ms()).await.expect("cb");
    assert_eq!(paid.outcome, CallbackOutcome::Paid);
    assert_eq!(count(c, "SELECT count(*) FROM inventory_ledger WHERE kind = 'SELL'").await, 2);
    assert_invariants(c, 1, 2).await;
}

/// Issue 23: an order carries its amount (the SKU's `price_cents`), so a provider-signed PAID
/// of another amount is AMOUNT_MISMATCH — the order keeps its unit (PAYMENT_UNKNOWN), and the
/// money is listed for refund with a `refund_requested` event — while the right amount pays.
/// Before migration 0007 the order had no amount and any amount, 0 included, paid it.
#[tokio::test]
async fn an_order_carries_its_price_and_a_payment_of_another_amount_is_refunded() {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 1, 2, 3, "TOKEN").await;
    c.execute("UPDATE sku_inventory SET price_cents = 1500 WHERE activity_id = 1", &[])
        .await
        .expect("price");
    let ids = orders(&db, 1, 2, 1..3, "price").await;
    let (short, exact) = (&ids[0], &ids[1]);
    assert_eq!(count(c, "SELECT count(*) FROM orders WHERE amount_cents = 1500").await, 2);

    for (payment, amount) in [("p_zero", 0), ("p_short", 1499)] {
        let mismatch = apply_callback(c, &cb(payment, short, "PAID", amount), now_ms()).await;
        let mismatch = mismatch.expect("cb");
        assert_eq!(mismatch.outcome, CallbackOutcome::AmountMismatch, "{payment}");
        assert_eq!(mismatch.order_status.as_deref(), Some("PAYMENT_UNKNOWN"));
    }
    assert_eq!(token_of(c, short).await.1, "CLAIMED", "the unit is kept, never resold");
    let refunds = flashsale_pg_worker::payments::list_refunds(c, 10).await.expect("refunds");
    let listed: Vec<(&str, i64, &str)> = refunds
        .iter()
        .map(|r| (r.payment_id.as_str(), r.amount_cents, r.outcome.as_str()))
        .collect();
    assert_eq!(listed, [("p_zero", 0, "AMOUNT_MISMATCH"), ("p_short", 1499, "AMOUNT_MISMATCH")]);
    assert_eq!(events(c, "refund_requested").await.len(), 2, "each announced for refund");

    let paid = apply_callback(c, &cb("p_exact", exact, "PAID", 1500), now_ms()).await.expect("cb");
    assert_eq!(paid.outcome, CallbackOutcome::Paid);
    assert_eq!(token_of(c, exact).await.1, "SOLD");

    // A SKU created without a price: its orders carry no amount (the old behaviour).
    seed_sku(c, 3, 4, 1, "TOKEN").await;
    let unpriced = orders(&db, 3, 4, 7..8, "noprice").await;
    let any = apply_callback(c, &cb("p_any", &unpriced[0], "PAID", 1), now_ms()).await.expect("cb");
    assert_eq!(any.outcome, CallbackOutcome::Paid);
    assert_invariants(c, 1, 2).await;
}

#[tokio::test]
async fn concurrent_identical_callbacks_apply_once() {
    let db = db().await;
    seed_sku(&db.client, 1, 2, 1, "TOKEN").await;
    let ids = orders(&db, 1, 2, 1..2, "twin").await;
    let clients: Vec<Client> = futures::future::join_all((0..4).map(|_| connect(&db.db.url))).await;
    let twin = cb("pay_t", &ids[0], "PAID", 10);
    let results =
        futures::future::join_all(clients.iter().map(|c| apply_callback(c, &twin, now_ms()))).await;
    let results: Vec<_> = results.into_iter().map(|r| r.expect("callback")).collect();
    assert!(results.iter().all(|r| r.outcome == CallbackOutcome::Paid), "{results:?}");
    assert_eq!(results.iter().filter(|r| !r.replayed).count(), 1, "{results:?}");
    assert_eq!(events(&db.client, "order_paid").await.len(), 1);
    assert_invariants(&db.client, 1, 2).await;
}

/// How one order of the race ended.
#[derive(Debug, Default)]
struct RaceTally {
    paid: usize,
    cancelled: usize,
    closed: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paid_cancel_and_closer_race_exactly_one_wins() {
    const ORDERS: u64 = 60;
    const ROUNDS: u64 = 3;
    let db = db().await;
    seed_sku(&db.client, 1, 2, (ORDERS * ROUNDS) as i64, "TOKEN").await;
    let mut total = RaceTally::default();
    let mut rounds = Vec::new();
    for round in 0..ROUNDS {
        let before = (total.paid, total.cancelled, total.closed);
        let users = round * ORDERS + 1..(round + 1) * ORDERS + 1;
        let ids = Arc::new(orders(&db, 1, 2, users.clone(), &format!("race{round}_")).await);
        // Separate backends for each side, so the three really race for the row locks.
        let payers = Arc::new(futures::future::join_all((0..3).map(|_| connect(&db.db.url))).await);
        let cancellers =
            Arc::new(futures::future::join_all((0..3).map(|_| connect(&db.db.url))).await);
        let closer = connect(&db.db.url).await;
        let late = now_ms() + PAY_TIMEOUT_MS + 60_000;

        // The closer starts first: it needs one round trip per 16 orders where each payer and
        // canceller needs one per order, so started last it may find no order left to close.
        let closing = tokio::spawn(async move {
            let mut closed = Vec::new();
            for _ in 0..20 {
                let round = close_due_orders(&closer, 16, late).await.expect("closer round");
                closed.extend(round.closed);
                tokio::task::yield_now().await;
            }
            closed
        });
        let mut tasks = Vec::new();
        for (i, user) in users.clone().enumerate() {
            let (ids, payers, cancellers) = (ids.clone(), payers.clone(), cancellers.clone());
            tasks.push(tokio::spawn(async move {
                let order_id = &ids[i];
                let pay = async {
                    let client = &payers[i % payers.len()];
                    apply_callback(
                        client,
                        &cb(&format!("pay_{order_id}"), order_id, "PAID", 7),
                        now_ms(),
                    )
                    .await
                    .expect("callback")
                };
                let cancel = async {
                    let client = &cancellers[i % cancellers.len()];
                    cancel_order(client, order_id, 1, user as i64, now_ms()).await.expect("cancel")
                };
                // Alternate who is sent first; the backends decide who locks first.
                if i % 2 == 0 {
                    tokio::join!(pay, cancel)
                } else {
                    let (c, p) = tokio::join!(cancel, pay);
                    (p, c)
                }
            }));
        }
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.expect("race task"));
        }
        let closed = closing.await.expect("closer task");

        for (i, (pay, cancel)) in outcomes.iter().enumerate() {
            let order_id = &ids[i];
            let status = order_status(&db.client, order_id).await;
            let pay_won = pay.outcome == CallbackOutcome::Paid;
            let cancel_won = *cancel == ReleaseOutcome::Released;
            let close_won = closed.contains(order_id);
            let winners = [pay_won, cancel_won, close_won].iter().filter(|w| **w).count();
            assert_eq!(
                winners, 1,
                "{order_id}: pay {pay:?}, cancel {cancel:?}, closed {close_won}"
            );
            match status.as_str() {
                "PAID" => {
                    assert!(pay_won);
                    assert_eq!(*cancel, ReleaseOutcome::NotPending { status: "PAID".into() });
                    total.paid += 1;
                }
                "CANCELLED" => {
                    assert!(cancel_won);
                    assert_eq!(pay.outcome, CallbackOutcome::RefundNeeded, "never resurrected");
                    total.cancelled += 1;
                }
                "CLOSED" => {
                    assert!(close_won);
                    assert_eq!(pay.outcome, CallbackOutcome::RefundNeeded, "never resurrected");
                    assert_eq!(*cancel, ReleaseOutcome::NotPending { status: "CLOSED".into() });
                    total.closed += 1;
                }
                other => panic!("{order_id} ended {other}"),
            }
        }
        assert_invariants(&db.client, 1, 2).await;
        rounds.push((total.paid - before.0, total.cancelled - before.1, total.closed - before.2));
    }
    let c = &db.client;
    let released = (total.cancelled + total.closed) as i64;
    assert_eq!(
        count(c, "SELECT count(*) FROM inventory_ledger WHERE kind = 'RELEASE'").await,
        released
    );
    assert_eq!(
        count(c, "SELECT count(*) FROM inventory_ledger WHERE kind = 'SELL'").await,
        total.paid as i64
    );
    assert_eq!(events(c, "order_cancelled").await.len() as i64, released);
    assert_eq!(events(c, "order_paid").await.len(), total.paid);
    assert_eq!(
        count(c, "SELECT count(*) FROM inventory_token WHERE status = 'AVAILABLE'").await,
        released,
        "released units are back on sale"
    );
    assert_eq!(
        count(c, "SELECT count(*) FROM payment WHERE outcome = 'REFUND_NEEDED'").await,
        released
    );
    // Every racer won some races (else the drill did not make that one race): the split for
    // the report, per round as (paid, cancelled, closed).
    println!("race tally over {} orders: {total:?}; per round {rounds:?}", ORDERS * ROUNDS);
    assert!(
        total.paid > 0 && total.cancelled > 0 && total.closed > 0,
        "every racer must win at least once: {total:?}, per round {rounds:?}"
    );
}

#[tokio::test]
async fn the_closer_closes_only_authoritatively_unpaid_orders_past_their_timeout() {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 1, 2, 7, "TOKEN").await;
    let ids = orders(&db, 1, 2, 1..8, "close").await;
    let (none, failed, closed_pay, unknown, paid, timed_out, mismatch) =
        (&ids[0], &ids[1], &ids[2], &ids[3], &ids[4], &ids[5], &ids[6]);
    let now = now_ms();
    apply_callback(c, &cb("p_failed", failed, "FAILED", 10), now).await.expect("cb");
    apply_callback(c, &cb("p_closed", closed_pay, "CLOSED", 10), now).await.expect("cb");
    let odd = apply_callback(c, &cb("p_odd", unknown, "PROCESSING", 10), now).await.expect("cb");
    assert_eq!(odd.outcome, CallbackOutcome::PaymentUnknown);
    assert_eq!(odd.order_status.as_deref(), Some("PAYMENT_UNKNOWN"));
    apply_callback(c, &cb("p_paid", paid, "PAID", 10), now).await.expect("cb");
    assert!(mark_payment_unknown(c, timed_out).await.expect("mark"), "provider timeout");
    assert!(!mark_payment_unknown(c, paid).await.expect("mark"), "only unpaid orders");
    c.execute("UPDATE orders SET amount_cents = 500 WHERE order_id = $1", &[mismatch])
        .await
        .expect("price");
    let short = apply_callback(c, &cb("p_short", mismatch, "PAID", 499), now).await.expect("cb");
    assert_eq!(short.outcome, CallbackOutcome::AmountMismatch);

    // Before the pay timeout: nothing is due.
    let early = close_due_orders(c, 100, now + PAY_TIMEOUT_MS - 60_000).await.expect("round");
    assert_eq!((early.candidates, early.closed.len()), (0, 0), "{early:?}");
    // After it: exactly the authoritatively unpaid ones.
    let late = now + PAY_TIMEOUT_MS + 60_000;
    let round = close_due_orders(c, 100, late).await.expect("round");
    let mut closed = round.closed.clone();
    closed.sort();
    let mut expected = vec![none.clone(), failed.clone(), closed_pay.clone()];
    expected.sort();
    assert_eq!(closed, expected, "{round:?}");
    for id in [unknown, timed_out, mismatch] {
        assert_eq!(order_status(c, id).await, "PAYMENT_UNKNOWN", "unknown keeps its stock");
        assert_eq!(token_of(c, id).await.1, "CLAIMED");
    }
    assert_eq!(order_status(c, paid).await, "PAID");
    for id in &expected {
        assert_eq!(order_status(c, id).await, "CLOSED");
        let (token, status) = token_of(c, id).await;
        assert_eq!(status, "AVAILABLE", "{token} back on sale");
    }
    // Ledger and compensation events, once each.
    assert_eq!(count(c, "SELECT count(*) FROM inventory_ledger WHERE kind = 'RELEASE'").await, 3);
    let released = events(c, "order_cancelled").await;
    assert_eq!(released.len(), 3);
    for event in &released {
        assert!(event.return_stock && !event.release_user, "{event:?}");
        assert!(expected.contains(event.order_id.as_ref().expect("order id")));
        assert!(event.message_id.starts_with("msg_"), "{event:?}");
    }
    let again = close_due_orders(c, 100, late).await.expect("round");
    assert!(again.closed.is_empty(), "{again:?}");
    assert_eq!(events(c, "order_cancelled").await.len(), 3, "no second release");

    // PAID after the close never resurrects the order.
    let after = apply_callback(c, &cb("p_late", none, "PAID", 10), late).await.expect("cb");
    assert_eq!(after.outcome, CallbackOutcome::RefundNeeded);
    assert_eq!(order_status(c, none).await, "CLOSED");

    // An authoritative FAILED resolves the unknown order; then it is closed like the others.
    let resolved = apply_callback(c, &cb("p_odd2", unknown, "FAILED", 10), late).await.expect("cb");
    assert_eq!(resolved.order_status.as_deref(), Some("PENDING_PAYMENT"));
    // The mismatched order holds a PAID payment: a FAILED does not make it unpaid.
    apply_callback(c, &cb("p_short2", mismatch, "FAILED", 10), late).await.expect("cb");
    assert_eq!(order_status(c, mismatch).await, "PAYMENT_UNKNOWN");
    let round = close_due_orders(c, 100, late).await.expect("round");
    assert_eq!(round.closed, vec![unknown.clone()]);

    // The returned tokens are sold again: four new buyers get the four released units.
    let resold = orders(&db, 1, 2, 100..104, "resale").await;
    assert_eq!(resold.len(), 4);
    assert_eq!(
        count(c, "SELECT count(*) FROM inventory_token WHERE status = 'AVAILABLE'").await,
        0
    );
    assert_invariants(c, 1, 2).await;
}

#[tokio::test]
async fn release_policies_and_the_row_allocator() {
    let db = db().await;
    let c = &db.client;
    // Activity 1: tokens retired on release. Activity 3: the ROW allocator.
    seed_sku(c, 1, 2, 2, "TOKEN").await;
    c.execute("UPDATE activity SET release_policy = 'RELEASED' WHERE activity_id = 1", &[])
        .await
        .expect("policy");
    seed_sku(c, 3, 4, 2, "ROW").await;
    let retired = orders(&db, 1, 2, 1..3, "ret").await;
    let row = orders(&db, 3, 4, 1..3, "row").await;

    // Owner checks: another buyer, or the right buyer in another activity, sees nothing.
    assert_eq!(
        cancel_order(c, &retired[0], 1, 2, now_ms()).await.expect("c"),
        ReleaseOutcome::NotFound
    );
    assert_eq!(
        cancel_order(c, &retired[0], 3, 1, now_ms()).await.expect("c"),
        ReleaseOutcome::NotFound
    );
    assert!(find_order(c, &retired[0], 1, 2).await.expect("find").is_none());
    let view = find_order(c, &retired[0], 1, 1).await.expect("find").expect("own order");
    assert_eq!(view.status, "PENDING_PAYMENT");
    assert_eq!(view.pay_deadline_ms - view.created_at_ms, PAY_TIMEOUT_MS as i64);

    assert_eq!(
        cancel_order(c, &retired[0], 1, 1, now_ms()).await.expect("c"),
        ReleaseOutcome::Released
    );
    assert_eq!(
        cancel_order(c, &retired[0], 1, 1, now_ms()).await.expect("c"),
        ReleaseOutcome::NotPending { status: "CANCELLED".into() }
    );
    assert_eq!(token_of(c, &retired[0]).await.1, "RELEASED");
    let event = events(c, "order_cancelled").await.pop().expect("event");
    assert!(!event.return_stock, "a retired unit is not returned to Redis either");

    assert_eq!(
        cancel_order(c, &row[1], 3, 2, now_ms()).await.expect("c"),
        ReleaseOutcome::Released
    );
    assert_eq!(
        count(c, "SELECT available_stock FROM sku_inventory WHERE activity_id = 3").await,
        1
    );
    assert!(events(c, "order_cancelled").await.pop().expect("event").return_stock);
    assert_eq!(count(c, "SELECT count(*) FROM inventory_ledger WHERE kind = 'RELEASE'").await, 2);
    assert_invariants(c, 1, 2).await;
    assert_invariants(c, 3, 4).await;
}

// ---------------------------------------------------------------------------------------------
// End to end
// ---------------------------------------------------------------------------------------------

fn engine_with_worker(tune: impl FnOnce(&mut flashsale_pg_worker::WorkerConfig)) -> Engine {
    Engine::start_with(|c| {
        let mut worker = small_worker(c);
        tune(&mut worker);
        c.worker = Some(worker);
        c.edge.payment_key = Some(HmacKey::from_hex(PAY_KEY_HEX).unwrap());
    })
}

fn create_activity(engine: &Engine, activity: u64, sku: u64, stock: u64, pay_timeout_ms: u64) {
    let body = format!(
        r#"{{"activity_id":{activity},"sku_id":{sku},"stock":{stock},"pay_timeout_ms":{pay_timeout_ms}}}"#
    );
    engine.create_activity_with(&body);
}

fn stock(engine: &Engine, activity: u64, sku: u64) -> String {
    redis_cmd(&engine.redis, &["GET", &format!("seckill:{{{activity}:{sku}}}:stock")])
}

fn get_order(
    engine: &Engine,
    c: &mut HttpClient,
    user: u64,
    activity: u64,
    id: &str,
) -> (u16, serde_json::Value) {
    let pass = engine.pass(user, activity);
    let r = c.request("GET", &format!("/v1/orders/{id}?activity_id={activity}"), Some(&pass), None);
    (r.status, r.json())
}

fn cancel(
    engine: &Engine,
    c: &mut HttpClient,
    user: u64,
    activity: u64,
    id: &str,
) -> (u16, serde_json::Value) {
    let pass = engine.pass(user, activity);
    let path = format!("/v1/orders/{id}/cancel?activity_id={activity}");
    let r = c.request("POST", &path, Some(&pass), None);
    (r.status, r.json())
}

fn callback_body(
    key: &HmacKey,
    payment_id: &str,
    order_id: &str,
    status: &str,
    amount: u64,
) -> String {
    let sig = Signed { payment_id, order_id, status, amount_cents: amount }.sign(key);
    format!(
        r#"{{"payment_id":"{payment_id}","order_id":"{order_id}","status":"{status}","amount_cents":{amount},"signature":"{sig}"}}"#
    )
}

fn post_callback(c: &mut HttpClient, body: &str) -> (u16, serde_json::Value) {
    let r = c.request("POST", "/v1/payments/callback", None, Some(body));
    (r.status, r.json())
}

fn pg<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

fn engine_invariants(engine: &Engine, activity: i64, sku: i64) {
    pg(async {
        let client = connect(&engine.db.url).await;
        assert_invariants(&client, activity, sku).await;
    });
}

/// redis-sync has nothing left to apply (every published event delivered and acked).
fn redis_sync_idle(engine: &Engine) -> bool {
    let url = engine.nats.url();
    pg(async move {
        let client = flashsale_io::jetstream::async_nats::connect(url).await.unwrap();
        let js = flashsale_io::jetstream::async_nats::jetstream::new(client);
        let stream = js.get_stream(EVENTS_STREAM).await.unwrap();
        let info = stream.consumer_info(REDIS_SYNC_CONSUMER).await.unwrap();
        info.num_pending == 0 && info.num_ack_pending == 0
    })
}

fn outbox_drained(engine: &Engine) -> bool {
    pg(async {
        let client = connect(&engine.db.url).await;
        count(&client, "SELECT count(*) FROM event_outbox WHERE published_at IS NULL").await == 0
    })
}

#[test]
fn cancel_over_http_returns_redis_stock_exactly_once() {
    let engine = engine_with_worker(|_| {});
    let (a, s) = (201, 202);
    create_activity(&engine, a, s, 2, PAY_TIMEOUT_MS);
    let mut c = HttpClient::connect(engine.http());
    let o1 = order_for(&engine, &mut c, 1, a, s);
    let _o2 = order_for(&engine, &mut c, 2, a, s);
    assert_eq!(stock(&engine, a, s), "0");
    assert_eq!(state(&engine.submit(&mut c, 3, a, s, "pay-3-early").1), "SOLD_OUT");

    let (status, view) = get_order(&engine, &mut c, 1, a, &o1);
    assert_eq!((status, state(&view)), (200, "PENDING_PAYMENT"), "{view}");
    assert_eq!(view["order_id"], o1.as_str());
    assert!(view["pay_deadline_ms"].as_u64().unwrap() > view["created_at_ms"].as_u64().unwrap());
    // Someone else's order is not found, for reading and for cancelling; no pass: 401.
    assert_eq!(get_order(&engine, &mut c, 2, a, &o1).0, 404);
    let (status, v) = cancel(&engine, &mut c, 2, a, &o1);
    assert_eq!((status, state(&v)), (404, "NOT_FOUND"));
    let r = c.request("GET", &format!("/v1/orders/{o1}?activity_id={a}"), None, None);
    assert_eq!(r.status, 401);
    // A pass of another activity does not reach it; bad ids and params are 400.
    let other = engine.pass(1, 999);
    let r = c.request("GET", &format!("/v1/orders/{o1}?activity_id={a}"), Some(&other), None);
    assert_eq!(r.status, 401);
    assert_eq!(get_order(&engine, &mut c, 1, a, "ord%20x").0, 400);
    let pass = engine.pass(1, a);
    let r = c.request("GET", &format!("/v1/orders/{o1}"), Some(&pass), None);
    assert_eq!((r.status, r.json()["reason_code"].as_str()), (400, Some("ACTIVITY_ID_INVALID")));
    let r = c.request("DELETE", &format!("/v1/orders/{o1}?activity_id={a}"), Some(&pass), None);
    assert_eq!(r.status, 405);
    assert_eq!(get_order(&engine, &mut c, 1, a, &o1).1["state"], "PENDING_PAYMENT");

    let (status, v) = cancel(&engine, &mut c, 1, a, &o1);
    assert_eq!((status, state(&v)), (200, "CANCELLED"), "{v}");
    let (status, v) = cancel(&engine, &mut c, 1, a, &o1);
    assert_eq!((status, state(&v), v["replayed"].as_bool()), (200, "CANCELLED", Some(true)));
    wait_for_ms("stock returned", 10_000, || stock(&engine, a, s) == "1");
    wait_for_ms("outbox drained", 10_000, || outbox_drained(&engine));
    wait_for_ms("redis-sync idle", 10_000, || redis_sync_idle(&engine));
    // The reservation's query now says why it ended; the buyer stays marked (one per buyer).
    let (_, q) = engine.query(&mut c, 1, a, s, "pay-1");
    assert_eq!((state(&q), q["reason_code"].as_str()), ("FAILED", Some("ORDER_CANCELLED")));
    assert_eq!(state(&engine.submit(&mut c, 1, a, s, "pay-1b").1), "DUPLICATE_USER");

    // A redelivered compensation (the same event published again under a new id) changes
    // nothing: compensate acts once per reservation.
    pg(async {
        let client = connect(&engine.db.url).await;
        client
            .execute(
                "INSERT INTO event_outbox (aggregate_id, event_type, payload) \
                 SELECT aggregate_id, event_type, payload FROM event_outbox \
                 WHERE event_type = 'order_cancelled'",
                &[],
            )
            .await
            .unwrap();
    });
    wait_for_ms("outbox drained", 10_000, || outbox_drained(&engine));
    wait_for_ms("redis-sync idle", 10_000, || redis_sync_idle(&engine));
    assert_eq!(stock(&engine, a, s), "1", "stock returned once");

    // The returned unit sells again, to a new buyer, from the token put back on sale.
    let o3 = order_for(&engine, &mut c, 3, a, s);
    assert_ne!(o3, o1);
    assert_eq!(stock(&engine, a, s), "0");
    engine_invariants(&engine, a as i64, s as i64);
}

#[test]
fn payment_callbacks_over_http() {
    let engine = engine_with_worker(|_| {});
    let key = HmacKey::from_hex(PAY_KEY_HEX).unwrap();
    let (a, s) = (301, 302);
    create_activity(&engine, a, s, 2, PAY_TIMEOUT_MS);
    let mut c = HttpClient::connect(engine.http());
    let o1 = order_for(&engine, &mut c, 1, a, s);

    // Forged: another key, another amount, a tampered order id.
    let forged_key = HmacKey::from_hex("00112233445566778899aabbccddeeff").unwrap();
    let forged = [
        callback_body(&forged_key, "pay_1", &o1, "PAID", 100),
        callback_body(&key, "pay_1", &o1, "PAID", 100).replace("100,", "1,"),
        callback_body(&key, "pay_1", "ord_other", "PAID", 100).replace("ord_other", &o1),
    ];
    for body in &forged {
        let (status, v) = post_callback(&mut c, body);
        assert_eq!(
            (status, state(&v), v["reason_code"].as_str()),
            (401, "UNAUTHORIZED", Some("BAD_SIGNATURE")),
            "{body}"
        );
    }
    let (status, v) = post_callback(&mut c, r#"{"payment_id":"p"}"#);
    assert_eq!((status, state(&v)), (400, "INVALID"));
    assert_eq!(get_order(&engine, &mut c, 1, a, &o1).1["state"], "PENDING_PAYMENT");

    let good = callback_body(&key, "pay_1", &o1, "PAID", 100);
    let (status, v) = post_callback(&mut c, &good);
    assert_eq!((status, state(&v), v["order_status"].as_str()), (200, "PAID", Some("PAID")), "{v}");
    assert_eq!(v["refund_needed"], false);
    let (status, v) = post_callback(&mut c, &good);
    assert_eq!((status, state(&v), v["replayed"].as_bool()), (200, "PAID", Some(true)));
    let (status, v) = post_callback(&mut c, &callback_body(&key, "pay_1", &o1, "PAID", 99));
    assert_eq!((status, state(&v)), (409, "PAYMENT_CONFLICT"));
    let (_, view) = get_order(&engine, &mut c, 1, a, &o1);
    assert_eq!((state(&view), view["amount_cents"].as_u64()), ("PAID", Some(100)));
    // A paid order cannot be cancelled; a second payment must be refunded.
    let (status, v) = cancel(&engine, &mut c, 1, a, &o1);
    assert_eq!((status, state(&v), v["status"].as_str()), (409, "NOT_CANCELLABLE", Some("PAID")));
    let (status, v) = post_callback(&mut c, &callback_body(&key, "pay_2", &o1, "PAID", 100));
    assert_eq!(
        (status, state(&v), v["refund_needed"].as_bool()),
        (200, "REFUND_NEEDED", Some(true))
    );
    // A paid order's stock stays sold.
    wait_for_ms("outbox drained", 10_000, || outbox_drained(&engine));
    wait_for_ms("redis-sync idle", 10_000, || redis_sync_idle(&engine));
    assert_eq!(stock(&engine, a, s), "1");
    engine_invariants(&engine, a as i64, s as i64);
    drop(engine);

    // Without a key every callback is refused.
    let bare = Engine::start();
    let mut c = HttpClient::connect(bare.http());
    let (status, v) = post_callback(&mut c, &good);
    assert_eq!((status, state(&v)), (503, "PAYMENTS_DISABLED"));
}

/// With the explicit opt-in to closing without a provider (`[payments]
/// close_unpaid_without_provider`); the default holds such orders (tests/tests/payments_recovery.rs).
#[test]
fn the_worker_closes_unpaid_orders_and_keeps_unknown_ones() {
    let engine = engine_with_worker(|w| {
        w.closer.interval_ms = 100;
        w.closer.without_provider = flashsale_pg_worker::payments::WithoutProvider::CloseUnverified;
    });
    let key = HmacKey::from_hex(PAY_KEY_HEX).unwrap();
    let (a, s) = (401, 402);
    // A pay timeout short enough to pass during the test.
    create_activity(&engine, a, s, 2, 5_000);
    let mut c = HttpClient::connect(engine.http());
    let unpaid = order_for(&engine, &mut c, 1, a, s);
    let unknown = order_for(&engine, &mut c, 2, a, s);
    let (status, v) =
        post_callback(&mut c, &callback_body(&key, "pay_u", &unknown, "PROCESSING", 5));
    assert_eq!(
        (status, state(&v), v["order_status"].as_str()),
        (200, "PAYMENT_UNKNOWN", Some("PAYMENT_UNKNOWN"))
    );
    assert_eq!(stock(&engine, a, s), "0");

    wait_for_ms("closed", 20_000, || {
        get_order(&engine, &mut c, 1, a, &unpaid).1["state"] == "CLOSED"
    });
    wait_for_ms("stock returned", 10_000, || stock(&engine, a, s) == "1");
    // Well past the timeout, the unknown order still holds its unit.
    std::thread::sleep(Duration::from_millis(1_000));
    assert_eq!(get_order(&engine, &mut c, 2, a, &unknown).1["state"], "PAYMENT_UNKNOWN");
    wait_for_ms("outbox drained", 10_000, || outbox_drained(&engine));
    wait_for_ms("redis-sync idle", 10_000, || redis_sync_idle(&engine));
    assert_eq!(stock(&engine, a, s), "1", "only the closed order's unit came back");
    // A late PAID for the closed order: refund, no resurrection.
    let (_, v) = post_callback(&mut c, &callback_body(&key, "pay_late", &unpaid, "PAID", 5));
    assert_eq!((state(&v), v["order_status"].as_str()), ("REFUND_NEEDED", Some("CLOSED")));
    engine_invariants(&engine, a as i64, s as i64);
}

/// Buying more than one unit (issue 29) end to end: a buyer takes up to the SKU's limit in one
/// order; over it, another quantity under the same request id, a second request of a buyer
/// with an order, and more units than are left are refused with their own answers and reserve
/// nothing; the order holds one token, one ledger CLAIM and one item per unit and costs price
/// × quantity; a cancel gives every unit back (PostgreSQL and Redis), a payment of the total
/// sells every unit; every invariant holds per unit.
#[test]
fn an_order_of_several_units_moves_every_unit_and_costs_its_total() {
    let engine = engine_with_worker(|_| {});
    let (a, s) = (291, 292);
    engine.create_activity_with(&format!(
        r#"{{"activity_id":{a},"sku_id":{s},"stock":10,"max_per_buyer":3,"price_cents":500,"pay_timeout_ms":{PAY_TIMEOUT_MS}}}"#
    ));
    let mut c = HttpClient::connect(engine.http());
    let units = |c: &mut HttpClient, user: u64, id: &str, quantity: u32| {
        engine.submit_units(c, (user, id), (a, s), quantity).1
    };
    let config = HttpClient::connect(engine.admin()).request(
        "GET",
        &format!("/admin/v1/activities/{a}/skus/{s}"),
        None,
        None,
    );
    assert_eq!(config.json()["max_per_buyer"], 3, "{}", config.body);
    let v = units(&mut c, 2, "q-2", 4);
    assert_eq!((state(&v), v["reason_code"].as_str()), ("INVALID", Some("QUANTITY_OVER_LIMIT")));
    let v = units(&mut c, 1, "q-1", 3);
    assert_eq!(state(&v), "QUEUED", "{v}");
    assert_eq!(stock(&engine, a, s), "7");
    assert_eq!(state(&units(&mut c, 1, "q-1", 2)), "IDEMPOTENCY_CONFLICT");
    assert_eq!(state(&units(&mut c, 1, "q-1b", 1)), "DUPLICATE_USER");
    let order_of = |c: &mut HttpClient, user: u64, id: &str| {
        let mut order_id = String::new();
        wait_for_ms("order created", 10_000, || {
            let (_, v) = engine.query(c, user, a, s, id);
            order_id = v["order_id"].as_str().unwrap_or("").to_owned();
            state(&v) == "SUCCEEDED"
        });
        order_id
    };
    let o1 = order_of(&mut c, 1, "q-1");
    assert_eq!(state(&units(&mut c, 3, "q-3", 3)), "QUEUED");
    assert_eq!(state(&units(&mut c, 4, "q-4", 3)), "QUEUED");
    // One unit left: two asked is its own answer, nothing reserved, not sold out.
    let v = units(&mut c, 5, "q-5", 2);
    assert_eq!((state(&v), v["reason_code"].as_str()), ("SOLD_OUT", Some("QUANTITY_UNAVAILABLE")));
    assert_eq!(stock(&engine, a, s), "1");
    assert_eq!(state(&units(&mut c, 6, "q-6", 1)), "QUEUED");
    assert_eq!(stock(&engine, a, s), "0");
    let o4 = order_of(&mut c, 4, "q-4");
    order_of(&mut c, 6, "q-6");

    let orders = pg(async {
        let client = connect(&engine.db.url).await;
        let row = client
            .query_one(
                "SELECT o.quantity, o.amount_cents, cardinality(i.token_ids), \
                        (SELECT count(*) FROM inventory_ledger l \
                         WHERE l.order_id = o.order_id AND l.kind = 'CLAIM') \
                 FROM orders o JOIN order_items i ON i.order_id = o.order_id \
                 WHERE o.order_id = $1",
                &[&o1],
            )
            .await
            .unwrap();
        let facts: (i32, i64, i32, i64) = (row.get(0), row.get(1), row.get(2), row.get(3));
        facts
    });
    assert_eq!(orders, (3, 1_500, 3, 3), "3 units: 3 tokens, 3 CLAIMs, 3 × 500");

    // The buyer cancels: all three units back on sale, in PostgreSQL and in Redis.
    let (status, v) = cancel(&engine, &mut c, 1, a, &o1);
    assert_eq!((status, state(&v)), (200, "CANCELLED"), "{v}");
    wait_for_ms("the three units back in Redis", 10_000, || stock(&engine, a, s) == "3");
    // A payment of one unit's price is not the order's amount; the total pays all three.
    let key = HmacKey::from_hex(PAY_KEY_HEX).unwrap();
    let (_, short) = post_callback(&mut c, &callback_body(&key, "p-short", &o4, "PAID", 500));
    assert_eq!(short["state"], "AMOUNT_MISMATCH", "{short}");
    let o3 = order_of(&mut c, 3, "q-3");
    let (_, paid) = post_callback(&mut c, &callback_body(&key, "p-3", &o3, "PAID", 1_500));
    assert_eq!(paid["state"], "PAID", "{paid}");
    pg(async {
        let client = connect(&engine.db.url).await;
        let sold = count(
            &client,
            &format!(
                "SELECT count(*) FROM inventory_token t JOIN orders o \
                 ON o.reservation_id = t.reservation_id \
                 WHERE o.order_id = '{o3}' AND t.status = 'SOLD'"
            ),
        )
        .await;
        assert_eq!(sold, 3, "every unit of the paid order sold");
        let sells = count(
            &client,
            &format!(
                "SELECT count(*) FROM inventory_ledger WHERE order_id = '{o3}' AND kind = 'SELL'"
            ),
        )
        .await;
        assert_eq!(sells, 3, "one SELL per unit");
        let released = count(
            &client,
            &format!(
                "SELECT count(*) FROM inventory_ledger WHERE order_id = '{o1}' AND kind = 'RELEASE'"
            ),
        )
        .await;
        assert_eq!(released, 3, "one RELEASE per unit");
    });
    engine_invariants(&engine, a as i64, s as i64);
    wait_for_ms("redis-sync idle", 20_000, || redis_sync_idle(&engine));
    engine.assert_reconciled(a, s);
}
