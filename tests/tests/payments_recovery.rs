//! Payments fail closed (issue 26 item 5; seed ch9 §7.10: "宁可暂时占用库存，也不能把可能已经
//! 支付的订单释放后再次售卖"), against real PostgreSQL (and, end to end, real Redis and NATS):
//!
//! - without a payment provider, the closer holds an order past its pay timeout as
//!   PAYMENT_UNKNOWN with its unit (`payment_unknown::hold_due_orders`, migration 0008) and
//!   closes only one the provider said is unpaid (a recorded FAILED/CLOSED);
//! - the negative control: the explicit opt-in (`WithoutProvider::CloseUnverified`, the old
//!   behaviour) releases the unit, a new buyer gets it, and the late payment becomes a refund —
//!   the loss the default prevents;
//! - the provider's statement (`flashsale admin payments reconcile`): every kind of
//!   difference, applied through the callback state machine, and the same statement applied
//!   again changing nothing;
//! - end to end: the worker's closer in an engine holds the order (Redis stock not returned),
//!   `GET /admin/v1/payments/unknown` lists it, `/metrics` counts it, and a statement settles it.

mod pipeline_support;

use flashsale_io::jetstream::ORDER_WRITER_CONSUMER;
use flashsale_io::key::HmacKey;
use flashsale_pg_worker::payment_unknown::{hold_due_orders, list_unknown};
use flashsale_pg_worker::payments::{
    apply_callback, close_due_orders, CallbackOutcome, WithoutProvider,
};
use flashsale_pg_worker::{write_batch, WriteOutcome};
use flashsale_tests::{
    metric, prometheus_render, redis_cmd, small_worker, wait_for_ms, Engine, HttpClient,
};
use pipeline_support::{
    cb, connect, count, db, message, now_ms, order_for, orders, seed_sku, status_and_token, Db,
};
use serde_json::Value;
use tokio_postgres::Client;

/// The pay timeout `pipeline_support::seed_activity` gives every activity.
const PAY_TIMEOUT_MS: u64 = 900_000;
const PAY_KEY_HEX: &str = "5f3c1a2b4d6e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

async fn assert_invariants(c: &Client, activity: i64, sku: i64) {
    let report = flashsale_pg_worker::check_invariants(c, activity, sku).await.expect("audit");
    assert!(report.ok(), "invariants violated: {report:#?}");
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[tokio::test]
async fn without_a_provider_due_orders_are_held_with_their_unit() {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 1, 2, 5, "TOKEN").await;
    let ids = orders(&db, 1, 2, 0..5, "hold").await;
    let [silent, late_payer, failed, closed, paid] = &ids[..] else { unreachable!() };
    let now = now_ms();
    apply_callback(c, &cb("p_failed", failed, "FAILED", 10), now).await.expect("cb");
    apply_callback(c, &cb("p_closed", closed, "CLOSED", 10), now).await.expect("cb");
    apply_callback(c, &cb("p_paid", paid, "PAID", 10), now).await.expect("cb");

    let early = hold_due_orders(c, 100, now + PAY_TIMEOUT_MS - 60_000).await.expect("round");
    assert_eq!(early.candidates, 0, "{early:?}");
    let late = now + PAY_TIMEOUT_MS + 60_000;
    let round = hold_due_orders(c, 100, late).await.expect("round");
    // No word from the provider: held. Its own word (FAILED/CLOSED): closed.
    assert_eq!(sorted(round.held.clone()), sorted(vec![silent.clone(), late_payer.clone()]));
    assert_eq!(sorted(round.closed.clone()), sorted(vec![failed.clone(), closed.clone()]));
    for id in [silent, late_payer] {
        assert_eq!(status_and_token(c, id).await, ("PAYMENT_UNKNOWN".into(), "CLAIMED".into()));
    }
    for id in [failed, closed] {
        assert_eq!(status_and_token(c, id).await, ("CLOSED".into(), "AVAILABLE".into()));
    }
    assert_eq!(status_and_token(c, paid).await, ("PAID".into(), "SOLD".into()));
    let again = hold_due_orders(c, 100, late).await.expect("round");
    assert_eq!((again.candidates, again.held.len(), again.closed.len()), (0, 0, 0), "{again:?}");
    let listed = list_unknown(c, 100).await.expect("list");
    let listed_ids: Vec<String> = listed.iter().map(|o| o.order_id.clone()).collect();
    assert_eq!(sorted(listed_ids), sorted(vec![silent.clone(), late_payer.clone()]));
    assert!(listed.iter().all(|o| o.cause == "UNVERIFIED"), "{listed:?}");

    // The late payment finds its unit: PAID, sold once.
    let paid_late =
        apply_callback(c, &cb("p_late", late_payer, "PAID", 10), late).await.expect("cb");
    assert_eq!(paid_late.outcome, CallbackOutcome::Paid);
    assert_eq!(status_and_token(c, late_payer).await, ("PAID".into(), "SOLD".into()));
    // The provider's word that the other is unpaid: back to PENDING_PAYMENT, then closed.
    let unpaid = apply_callback(c, &cb("p_no", silent, "CLOSED", 10), late).await.expect("cb");
    assert_eq!(unpaid.order_status.as_deref(), Some("PENDING_PAYMENT"));
    let round = hold_due_orders(c, 100, late).await.expect("round");
    assert_eq!(round.closed, vec![silent.clone()]);
    assert_eq!(status_and_token(c, silent).await, ("CLOSED".into(), "AVAILABLE".into()));
    assert!(list_unknown(c, 100).await.expect("list").is_empty());
    assert_invariants(c, 1, 2).await;
}

/// The negative control: the explicit opt-in closes without asking, the unit is resold, and the
/// payment that was only late becomes money to give back. The held path keeps the sale.
#[tokio::test]
async fn opting_in_to_close_unverified_resells_a_unit_that_was_paid() {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 3, 4, 1, "TOKEN").await;
    let first = orders(&db, 3, 4, 0..1, "first").await.remove(0);
    let late = now_ms() + PAY_TIMEOUT_MS + 60_000;
    let round = close_due_orders(c, 100, late).await.expect("opt-in round");
    assert_eq!(round.closed, vec![first.clone()]);
    assert_eq!(status_and_token(c, &first).await, ("CLOSED".into(), "AVAILABLE".into()));
    let second = orders(&db, 3, 4, 1..2, "second").await.remove(0);
    assert_eq!(status_and_token(c, &second).await.1, "CLAIMED", "the unit is sold again");
    let money = apply_callback(c, &cb("p_first", &first, "PAID", 10), late).await.expect("cb");
    assert_eq!(money.outcome, CallbackOutcome::RefundNeeded, "the first buyer paid for nothing");
    assert_invariants(c, 3, 4).await;

    // The default on the same story: the unit waits for the payment.
    seed_sku(c, 5, 6, 1, "TOKEN").await;
    let held = orders(&db, 5, 6, 0..1, "held").await.remove(0);
    let round = hold_due_orders(c, 100, late).await.expect("hold round");
    assert!(round.held.contains(&held), "{round:?}");
    let refused = orders_refused(&db, 5, 6, 1).await;
    assert!(refused, "no unit to resell while the payment is unknown");
    let money = apply_callback(c, &cb("p_held", &held, "PAID", 10), late).await.expect("cb");
    assert_eq!(money.outcome, CallbackOutcome::Paid);
    assert_invariants(c, 5, 6).await;
}

/// A second buyer's order-create finds no unit (`REJECTED_NO_FINAL_STOCK`).
async fn orders_refused(db: &Db, activity: i64, sku: i64, user: u64) -> bool {
    let m = message(activity, sku, user, &format!("refused{user}"));
    let client = db.pool.get().await.expect("pooled connection");
    let outcomes =
        write_batch(&client, ORDER_WRITER_CONSUMER, &[&m], now_ms()).await.expect("write");
    !matches!(outcomes[0], WriteOutcome::Created { .. })
}

// ---------------------------------------------------------------------------------------------
// The provider's statement
// ---------------------------------------------------------------------------------------------

fn at(ms: u64) -> String {
    flashsale_io::wire::format_rfc3339_ms(ms).to_string()
}

/// [`reconcile_cli`] off the test's runtime (the CLI runs one of its own).
async fn reconcile(pg_url: &str, statement: &str, apply: bool) -> (u8, Value) {
    let (url, text) = (pg_url.to_owned(), statement.to_owned());
    tokio::task::spawn_blocking(move || reconcile_cli(&url, &text, apply)).await.expect("join")
}

/// `flashsale admin payments reconcile --statement FILE [--apply] --pg-url URL` through the
/// CLI's own entry point: (exit status, the JSON it printed).
fn reconcile_cli(pg_url: &str, statement: &str, apply: bool) -> (u8, Value) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("statement.csv");
    std::fs::write(&path, statement).expect("write the statement");
    let path = path.display().to_string();
    let mut argv = vec!["admin", "--stack-dir", "/nonexistent", "payments", "reconcile"];
    argv.extend(["--statement", &path, "--pg-url", pg_url]);
    if apply {
        argv.push("--apply");
    }
    let parsed = flashsale_engine::app::admin_cli::parse_from(argv).expect("arguments");
    let mut out = Vec::new();
    let status = flashsale_engine::app::admin_cli::run(parsed, &Default::default(), &mut out)
        .unwrap_or_else(|e| panic!("reconcile failed: {e:#}"));
    (status, serde_json::from_slice(&out).expect("JSON report"))
}

fn kinds(report: &Value) -> Vec<(String, String, String)> {
    let mut v: Vec<_> = report["differences"]
        .as_array()
        .expect("differences")
        .iter()
        .map(|d| {
            let s = |k: &str| d[k].as_str().unwrap_or("").to_owned();
            (s("payment_id"), s("kind"), s("outcome"))
        })
        .collect();
    v.sort();
    v
}

fn owned(items: &[(&str, &str, &str)]) -> Vec<(String, String, String)> {
    items.iter().map(|(a, b, c)| ((*a).into(), (*b).into(), (*c).into())).collect()
}

/// State of the tables a statement may touch, to prove a replay changed nothing.
async fn footprint(c: &Client) -> Vec<i64> {
    let mut out = Vec::new();
    for sql in [
        "SELECT count(*) FROM payment",
        "SELECT count(*) FROM event_outbox",
        "SELECT count(*) FROM inventory_ledger",
        "SELECT count(*) FROM orders WHERE status = 'PAID'",
        "SELECT count(*) FROM orders WHERE status = 'PAYMENT_UNKNOWN'",
        "SELECT count(*) FROM inventory_token WHERE status = 'AVAILABLE'",
    ] {
        out.push(count(c, sql).await);
    }
    out
}

#[tokio::test]
async fn a_statement_is_applied_through_the_state_machine_and_replays_to_nothing() {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 7, 8, 6, "TOKEN").await;
    let ids = orders(&db, 7, 8, 0..6, "st").await;
    let [unknown, closed, mismatch, unpaid, paid_here, matched] = &ids[..] else { unreachable!() };
    let now = now_ms();
    let late = now + PAY_TIMEOUT_MS + 60_000;
    c.execute("UPDATE orders SET amount_cents = 500 WHERE order_id = ANY($1)", &[&ids])
        .await
        .expect("prices");
    apply_callback(c, &cb("p_fail", closed, "FAILED", 500), now).await.expect("cb");
    apply_callback(c, &cb("p_here", paid_here, "PAID", 500), now).await.expect("cb");
    apply_callback(c, &cb("p_same", matched, "PAID", 500), now).await.expect("cb");
    // Past the timeout without a provider: unknown, mismatch and unpaid are held, closed is
    // closed (FAILED recorded).
    let round = hold_due_orders(c, 100, late).await.expect("round");
    assert_eq!(sorted(round.held), sorted(vec![unknown.clone(), unpaid.clone(), mismatch.clone()]));
    assert_eq!(round.closed, vec![closed.clone()]);

    let statement = format!(
        "payment_id,order_id,amount_cents,status,at\n\
         p_1,{unknown},500,PAID,{}\n\
         p_2,{closed},500,PAID,{}\n\
         p_3,{mismatch},400,PAID,{}\n\
         p_4,{unpaid},0,CLOSED,{}\n\
         p_same,{matched},500,PAID,{}\n",
        at(now - 3_600_000),
        at(now - 60_000),
        at(now - 30_000),
        at(now - 10_000),
        at(now + 3_600_000),
    );
    let before = footprint(c).await;
    let (status, report) = reconcile(&db.db.url, &statement, false).await;
    assert_eq!(status, 1, "differences are open: {report:#}");
    let expected = [
        ("p_1", "PAID_THERE_UNPAID_HERE", ""),
        ("p_2", "PAID_THERE_CLOSED_HERE", ""),
        ("p_3", "AMOUNT_MISMATCH", ""),
        ("p_4", "UNPAID_THERE_NOT_RECORDED", ""),
        ("p_here", "PAID_HERE_ABSENT_THERE", ""),
    ];
    assert_eq!(kinds(&report), owned(&expected), "{report:#}");
    assert_eq!((report["matched"].as_u64(), report["changed"].as_u64()), (Some(1), Some(0)));
    assert_eq!(footprint(c).await, before, "a report changes nothing");

    let (status, report) = reconcile(&db.db.url, &statement, true).await;
    assert_eq!(status, 1, "the review item stays open: {report:#}");
    let applied = [
        ("p_1", "PAID_THERE_UNPAID_HERE", "PAID"),
        ("p_2", "PAID_THERE_CLOSED_HERE", "REFUND_NEEDED"),
        ("p_3", "AMOUNT_MISMATCH", "AMOUNT_MISMATCH"),
        ("p_4", "UNPAID_THERE_NOT_RECORDED", "UNPAID"),
        ("p_here", "PAID_HERE_ABSENT_THERE", ""),
    ];
    assert_eq!(kinds(&report), owned(&applied), "{report:#}");
    assert_eq!((report["changed"].as_u64(), report["open"].as_u64()), (Some(4), Some(1)));
    assert_eq!(status_and_token(c, unknown).await, ("PAID".into(), "SOLD".into()));
    assert_eq!(
        status_and_token(c, closed).await,
        ("CLOSED".into(), "AVAILABLE".into()),
        "never resurrected"
    );
    assert_eq!(status_and_token(c, mismatch).await, ("PAYMENT_UNKNOWN".into(), "CLAIMED".into()));
    assert_eq!(status_and_token(c, unpaid).await.0, "PENDING_PAYMENT", "authoritatively unpaid");
    let refunds = flashsale_pg_worker::payments::list_refunds(c, 10).await.expect("refunds");
    let mut refunded: Vec<_> =
        refunds.iter().map(|r| (r.payment_id.as_str(), r.outcome.as_str())).collect();
    refunded.sort();
    assert_eq!(refunded, vec![("p_2", "REFUND_NEEDED"), ("p_3", "AMOUNT_MISMATCH")]);

    // The same statement again: nothing to apply, nothing changes.
    let after_first = footprint(c).await;
    let (status, report) = reconcile(&db.db.url, &statement, true).await;
    assert_eq!(status, 1, "{report:#}");
    assert_eq!(kinds(&report), owned(&[("p_here", "PAID_HERE_ABSENT_THERE", "")]), "{report:#}");
    assert_eq!((report["matched"].as_u64(), report["changed"].as_u64()), (Some(5), Some(0)));
    assert_eq!(footprint(c).await, after_first, "a replayed statement changes nothing");

    // The closer acts on the provider's word: the unpaid order is closed, its unit back.
    let round = hold_due_orders(c, 100, late).await.expect("round");
    assert_eq!(round.closed, vec![unpaid.clone()]);
    // A statement that lists everything recorded: nothing open, exit 0.
    let full = format!("{statement}p_here,{paid_here},500,PAID,{}\n", at(now));
    let (status, report) = reconcile(&db.db.url, &full, true).await;
    assert_eq!((status, report["ok"].as_bool()), (0, Some(true)), "{report:#}");
    // A malformed statement is refused whole.
    let bad = format!("{statement}p_9,{paid_here},-5,PAID,{}\n", at(now));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.csv");
    std::fs::write(&path, bad).unwrap();
    let argv = ["admin", "payments", "reconcile", "--apply", "--pg-url", &db.db.url, "--statement"];
    let mut argv: Vec<&str> = argv.to_vec();
    let path_text = path.display().to_string();
    argv.push(&path_text);
    let parsed = flashsale_engine::app::admin_cli::parse_from(argv).unwrap();
    let before_bad = footprint(c).await;
    let err = tokio::task::spawn_blocking(move || {
        flashsale_engine::app::admin_cli::run(parsed, &Default::default(), &mut Vec::new())
    })
    .await
    .expect("join")
    .unwrap_err();
    assert!(err.to_string().contains("line 7: amount_cents"), "{err:#}");
    assert_eq!(footprint(c).await, before_bad, "nothing applied from a refused statement");
    assert_invariants(c, 7, 8).await;
}

// ---------------------------------------------------------------------------------------------
// End to end
// ---------------------------------------------------------------------------------------------

fn engine_with_worker(without: WithoutProvider) -> Engine {
    Engine::start_with(|c| {
        let mut worker = small_worker(c);
        worker.closer.interval_ms = 100;
        worker.closer.without_provider = without;
        c.worker = Some(worker);
        c.render_extra = Some(prometheus_render());
        c.edge.payment_key = Some(HmacKey::from_hex(PAY_KEY_HEX).unwrap());
    })
}

fn order_status(engine: &Engine, order_id: &str) -> String {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let c = connect(&engine.db.url).await;
        let sql = "SELECT status FROM orders WHERE order_id = $1";
        c.query_one(sql, &[&order_id]).await.expect("order").get(0)
    })
}

#[test]
fn the_worker_holds_an_unpaid_order_lists_it_and_a_statement_settles_it() {
    let engine = engine_with_worker(WithoutProvider::HoldUnknown);
    let (a, s) = (901, 902);
    engine.create_activity_with(&format!(
        r#"{{"activity_id":{a},"sku_id":{s},"stock":1,"pay_timeout_ms":3000,"price_cents":700}}"#
    ));
    let mut c = HttpClient::connect(engine.http());
    let order = order_for(&engine, &mut c, 1, a, s);
    wait_for_ms("held PAYMENT_UNKNOWN", 20_000, || {
        order_status(&engine, &order) == "PAYMENT_UNKNOWN"
    });
    // Well past the timeout the unit is still held: Redis stock not returned.
    std::thread::sleep(std::time::Duration::from_millis(1_000));
    let stock_key = format!("seckill:{{{a}:{s}}}:stock");
    assert_eq!(redis_cmd(&engine.redis, &["GET", &stock_key]), "0");
    let mut admin = HttpClient::connect(engine.admin());
    let listed = admin.request("GET", "/admin/v1/payments/unknown", None, None);
    assert_eq!(listed.status, 200, "{}", listed.body);
    let listed = listed.json();
    assert_eq!(listed["count"], 1, "{listed}");
    assert_eq!(listed["orders"][0]["order_id"], order.as_str());
    assert_eq!(listed["orders"][0]["cause"], "UNVERIFIED");
    let (status, cli) = engine.admin_cli(&["payments", "unknown"]);
    assert_eq!((status, cli["count"].as_u64()), (Ok(0), Some(1)), "{cli}");
    let mut metrics = String::new();
    wait_for_ms("the held order on /metrics", 10_000, || {
        metrics = engine.metrics();
        metrics.contains("\nflashsale_orders_payment_unknown 1\n")
    });
    assert!(
        metrics.contains("flashsale_payment_closer_mode{mode=\"hold_unknown\"} 1"),
        "{metrics}"
    );
    // A counter of this process (the PostgreSQL-level tests beside this one hold orders too).
    assert!(metric(&metrics, "flashsale_orders_held_total{cause=\"no_provider\"}") >= 1);

    // The provider's statement says it was paid: PAID, the unit sold to its payer.
    let statement = format!(
        "payment_id,order_id,amount_cents,status,at\npay_1,{order},700,PAID,{}\n",
        at(now_ms())
    );
    let (status, report) = reconcile_cli(&engine.db.url, &statement, true);
    assert_eq!((status, report["changed"].as_u64()), (0, Some(1)), "{report:#}");
    assert_eq!(order_status(&engine, &order), "PAID");
    wait_for_ms("gauge back to 0", 10_000, || {
        engine.metrics().contains("\nflashsale_orders_payment_unknown 0\n")
    });
    assert_eq!(redis_cmd(&engine.redis, &["GET", &stock_key]), "0");
    engine.assert_invariants(a, s);
}
