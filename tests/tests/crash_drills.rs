//! Crash drills (DESIGN.md sections 4-8): the engine dies abruptly at a failpoint under load,
//! or a store loses data mid-sale; afterwards every invariant of DESIGN.md section 8 holds,
//! and every buyer who was told QUEUED/QUEUED_PENDING ends with an order or a compensated
//! rejection.
//!
//! The engine runs in a child process (this test binary re-executed as `drill_child`, see
//! `crash_support`); Redis, NATS and PostgreSQL belong to the drill and outlive it. A buyer
//! who got no answer retries with the SAME request id once the engine is back, as the
//! contract tells clients to.

mod crash_support;

use std::time::Duration;

use crash_support::*;

const ACTIVITY: u64 = 7001;
const SKU: u64 = 8001;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn intents(users: std::ops::RangeInclusive<u64>, tag: &str) -> Vec<Intent> {
    users.map(|u| Intent::new(u, format!("{tag}-{u}"))).collect()
}

/// The child's entry point: runs the engine only when a drill started this binary with the
/// servers in its environment (see `crash_support::child_main`); never on its own.
#[test]
#[ignore = "the crash drills' child process: started by the drills, not on its own"]
fn drill_child() {
    child_main();
}

/// Purges a stream of the drill's NATS; returns how many messages it dropped.
fn purge(rt: &tokio::runtime::Runtime, stores: &Stores, stream: &str) -> u64 {
    rt.block_on(async {
        let client = async_nats::connect(stores.nats.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(stream).await.unwrap();
        let purged = stream.purge().await.unwrap();
        assert!(purged.success);
        purged.purged
    })
}

/// Drill a: the engine (with its in-process worker) dies at `failpoint` on its `hit`-th
/// evaluation while 90 buyers compete for 60 units; a fresh engine takes over.
/// The end of a drill in which every unit sells: every intent resolves, then PostgreSQL,
/// Redis, the promise and the reconcile report are checked, and all `stock` units are orders.
fn resolve_and_check_sold_out(
    rt: &tokio::runtime::Runtime,
    stores: &Stores,
    engine: &EngineProcess,
    intents: &[Intent],
    stock: u64,
) -> std::collections::BTreeMap<String, Resolution> {
    let resolved = resolve_all(engine.http, ACTIVITY, SKU, intents, Duration::from_secs(60));
    wait_pending_empty(stores, ACTIVITY, SKU, Duration::from_secs(20));
    let pg = pg_view(rt, stores, ACTIVITY, SKU);
    assert_pg(&pg);
    assert_redis_settled(stores, &pg, ACTIVITY, SKU, stock);
    assert_promise(stores, &pg, ACTIVITY, SKU, intents, &resolved);
    assert_eq!(pg.report.units_live as u64, stock, "{:?}", pg.report);
    assert_reconcile_ok(engine, ACTIVITY, SKU);
    resolved
}

/// How many units each buyer of a drill asks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Units {
    One,
    /// 1, 2 and 3 in turn, of a SKU that allows 3 per buyer (issue 29).
    OneToThree,
}

fn kill_at(failpoint: &'static str, hit: u64) {
    kill_at_with(failpoint, hit, Units::One);
}

fn kill_at_with(failpoint: &'static str, hit: u64, units: Units) {
    let _serial = serial();
    let rt = runtime();
    let stores = Stores::start(&rt);
    let stock = 60;
    let first = EngineProcess::spawn(
        &stores,
        ChildOptions { failpoint: Some((failpoint, hit)), ..ChildOptions::default() },
    );
    let mut buyers = intents(1..=90, failpoint);
    if units == Units::OneToThree {
        first.create_activity_limited(ACTIVITY, SKU, stock, 3);
        for intent in &mut buyers {
            intent.quantity = 1 + (intent.user % 3) as u32;
        }
    } else {
        first.create_activity(ACTIVITY, SKU, stock);
    }
    let before = submit_all(first.http, ACTIVITY, SKU, buyers, 6);
    first.expect_abort(Duration::from_secs(30));
    let unanswered = before.iter().filter(|i| !i.settled()).count();
    eprintln!("{failpoint}@{hit}: engine aborted; {unanswered} of 90 buyers without an answer");

    let second = EngineProcess::spawn(&stores, ChildOptions::default());
    let intents = settle_all(second.http, ACTIVITY, SKU, before);
    // Every buyer left without an answer by the crash has one now (same request id).
    let still_unanswered: Vec<_> = intents.iter().filter(|i| !i.settled()).collect();
    assert!(still_unanswered.is_empty(), "buyers without an answer: {still_unanswered:?}");
    // 90 buyers who all got an answer in the end for 60 units: every unit is an order (in
    // whole reservations), no reservation was lost and none failed.
    let resolved = resolve_and_check_sold_out(&rt, &stores, &second, &intents, stock);
    assert!(resolved.values().all(|r| r.state == "SUCCEEDED"), "{resolved:?}");
    let promised: u64 =
        intents.iter().filter(|i| i.promised()).map(|i| u64::from(i.quantity)).sum();
    assert_eq!(promised, stock, "the promised buyers' units are the stock");
    second.stop();
}

#[test]
fn kill_after_reserve_created_then_restart() {
    kill_at("after_reserve_created", 15);
}

/// Drill a with buyers of 1, 2 or 3 units each: the reservations of several units survive the
/// crash whole, and the units sold are exactly the stock.
#[test]
fn kill_after_reserve_created_with_several_units_per_buyer_then_restart() {
    kill_at_with("after_reserve_created", 10, Units::OneToThree);
}

#[test]
fn kill_after_publish_ack_then_restart() {
    kill_at("after_publish_ack", 15);
}

#[test]
fn kill_worker_after_commit_then_restart() {
    kill_at("worker_after_commit", 2);
}

#[test]
fn kill_sync_before_apply_then_restart() {
    kill_at("sync_before_apply", 5);
}

/// Drill b: order-create messages acknowledged by the log are lost before any worker read
/// them (the stream purged: a stand-in for JetStream losing acknowledged writes). The scanner
/// republishes every overdue reservation with its message id; nothing is lost.
#[test]
fn orders_stream_lost_after_acks_scanner_republishes() {
    let _serial = serial();
    let rt = runtime();
    let stores = Stores::start(&rt);
    let stock = 40;
    let edge_only =
        EngineProcess::spawn(&stores, ChildOptions { no_worker: true, ..ChildOptions::default() });
    edge_only.create_activity(ACTIVITY, SKU, stock);
    let intents = settle_all(edge_only.http, ACTIVITY, SKU, intents(1..=60, "b"));
    assert!(
        intents.iter().filter(|i| i.promised()).all(|i| i.last_state() == Some("QUEUED")),
        "every reservation's message was acknowledged by the log"
    );
    edge_only.stop();
    let purged = purge(&rt, &stores, "SECKILL_ORDERS");
    assert_eq!(purged, stock, "each acknowledged order-create message was in the stream");

    let engine = EngineProcess::spawn(&stores, ChildOptions::default());
    resolve_and_check_sold_out(&rt, &stores, &engine, &intents, stock);
    engine.stop();
}

/// Drill c: outbox events published to SECKILL_EVENTS are lost before redis-sync applied them
/// (the engine dies applying the first one, then the stream is purged). The reservations
/// still resolve: overdue ones are republished, the inbox finds them and re-emits their
/// recorded outcome.
#[test]
fn events_stream_lost_reservations_still_resolve() {
    let _serial = serial();
    let rt = runtime();
    let stores = Stores::start(&rt);
    let stock = 40;
    let first = EngineProcess::spawn(
        &stores,
        ChildOptions { failpoint: Some(("sync_before_apply", 1)), ..ChildOptions::default() },
    );
    first.create_activity(ACTIVITY, SKU, stock);
    let before = submit_all(first.http, ACTIVITY, SKU, intents(1..=60, "c"), 6);
    first.expect_abort(Duration::from_secs(30));
    let purged = purge(&rt, &stores, "SECKILL_EVENTS");
    assert!(purged >= 1, "the event being applied was in the stream");
    eprintln!("events purged: {purged}");

    let engine = EngineProcess::spawn(&stores, ChildOptions::default());
    let intents = settle_all(engine.http, ACTIVITY, SKU, before);
    resolve_and_check_sold_out(&rt, &stores, &engine, &intents, stock);
    engine.stop();
}

/// Drill d: Redis loses everything mid-sale (FLUSHALL). The operator's documented re-create
/// of the activity is accepted but never preheats the initial stock again (that would sell
/// what PostgreSQL already sold); the engine, a child process here, closes the SKU
/// (`REDIS_DATA_LOST`), rebuilds it from PostgreSQL and reopens it after a passing reconcile.
/// Redis then forgets nobody: a first-phase buyer's same request id is his reservation, his
/// new request id is DUPLICATE_USER, and the remaining units go to new buyers. (The drill's
/// in-process twin with buyers arriving through the loss, and its negative control:
/// `tests/tests/redis_rebuild.rs`.)
#[test]
fn redis_flushall_mid_sale_is_rebuilt_from_postgres_and_forgets_nobody() {
    let _serial = serial();
    let rt = runtime();
    let stores = Stores::start(&rt);
    let stock = 50;
    let engine = EngineProcess::spawn(&stores, ChildOptions::default());
    engine.create_activity(ACTIVITY, SKU, stock);
    let phase1 = settle_all(engine.http, ACTIVITY, SKU, intents(1..=30, "d1"));
    assert!(
        phase1.iter().all(|i| i.last_state() == Some("QUEUED")),
        "every first-phase message is in the log before the flush"
    );
    assert_eq!(redis_cmd(&stores, &["FLUSHALL"]), "OK");
    assert_eq!(engine.create_activity(ACTIVITY, SKU, stock), 200, "re-created, not preheated");
    // The first phase retries its request ids through the closure: each gets its own
    // reservation back (settle_all asserts one reservation id per request id, I6).
    let phase1 = settle_all(engine.http, ACTIVITY, SKU, retry_all(phase1));
    for intent in &phase1 {
        let states: Vec<&str> = intent.answers.iter().flatten().map(|(_, v)| state(v)).collect();
        assert!(
            states.iter().all(|s| matches!(*s, "QUEUED" | "SUBMIT_CLOSED" | "ACTIVITY_NOT_ACTIVE")),
            "{intent:?}"
        );
    }
    // The same 30 buyers with new request ids while units are left (once sold out, the edge
    // answers SOLD_OUT to any new request id on its own), then 70 more for the last 20 units.
    let mut phase2 = settle_all(engine.http, ACTIVITY, SKU, intents(1..=30, "d2"));
    for intent in &phase2 {
        assert_eq!(intent.last_state(), Some("DUPLICATE_USER"), "{intent:?}");
    }
    phase2.extend(settle_all(engine.http, ACTIVITY, SKU, intents(31..=100, "d2")));
    let all: Vec<Intent> = phase1.iter().chain(&phase2).cloned().collect();
    let resolved = resolve_all(engine.http, ACTIVITY, SKU, &all, Duration::from_secs(60));
    wait_pending_empty(&stores, ACTIVITY, SKU, Duration::from_secs(20));

    let pg = pg_view(&rt, &stores, ACTIVITY, SKU);
    assert_pg(&pg);
    assert_promise(&stores, &pg, ACTIVITY, SKU, &all, &resolved);
    assert_eq!(pg.orders.len() as u64, stock, "{:?}", pg.report);
    assert_eq!(pg.report.duplicate_buyers, 0);
    for intent in &phase1 {
        assert_eq!(resolved[&intent.request_id].state, "SUCCEEDED", "{intent:?}");
    }
    // Redis knows every reservation PostgreSQL has, and conserves its units again.
    let known = redis_reservations(&stores, ACTIVITY, SKU);
    let forgotten: Vec<&String> = pg.orders.keys().filter(|r| !known.contains_key(*r)).collect();
    assert_eq!(forgotten, Vec::<&String>::new(), "Redis forgot nobody");
    assert_redis_settled(&stores, &pg, ACTIVITY, SKU, stock);
    assert_reconcile_ok(&engine, ACTIVITY, SKU);
    engine.stop();
}

/// The same intents, marked for one more submit each (same request ids).
fn retry_all(intents: Vec<Intent>) -> Vec<Intent> {
    intents
        .into_iter()
        .map(|mut i| {
            i.answers.push(None);
            i
        })
        .collect()
}

/// Drill d, several instances (DESIGN.md section 11): two engines on the same stores behind
/// HAProxy (TCP, round robin). One request id sent to each instance in turn gets one
/// reservation; then one instance is killed (SIGKILL) while buyers keep arriving through the
/// balancer. The survivor finishes the sale: its scanner republishes what the dead one left
/// pending, and every buyer told QUEUED/QUEUED_PENDING ends with exactly one order.
#[test]
fn one_of_two_instances_killed_mid_sale_behind_the_balancer_loses_no_queued_buyer() {
    let _serial = serial();
    let rt = runtime();
    let stores = Stores::start(&rt);
    let stock = 120;
    let doomed = EngineProcess::spawn(&stores, ChildOptions::default());
    let survivor = EngineProcess::spawn(&stores, ChildOptions::default());
    doomed.create_activity(ACTIVITY, SKU, stock);
    // The same request ids to each instance in turn: every answer names one reservation.
    let mut alternating = intents(1..=10, "alt");
    for round in 0..4 {
        let addr = if round % 2 == 0 { doomed.http } else { survivor.http };
        for intent in &mut alternating {
            let answer = submit_once(addr, ACTIVITY, SKU, intent);
            intent.answers.push(answer);
        }
    }
    for intent in &alternating {
        assert!(intent.answers.iter().all(|a| a
            .as_ref()
            .is_some_and(|(_, v)| { matches!(state(v), "QUEUED" | "QUEUED_PENDING") })));
        assert_eq!(
            intent.reservation_ids().len(),
            1,
            "one request id, one reservation: {intent:?}"
        );
    }
    assert_eq!(redis_reservations(&stores, ACTIVITY, SKU).len(), 10, "10 ids, 10 reservations");

    let balancer = flashsale_tests::Haproxy::round_robin(&[doomed.http, survivor.http]);
    let addr = balancer.addr;
    let load =
        std::thread::spawn(move || submit_all(addr, ACTIVITY, SKU, intents(11..=200, "lb"), 6));
    std::thread::sleep(Duration::from_millis(300));
    drop(doomed);
    let before = load.join().unwrap();
    let unanswered = before.iter().filter(|i| !i.settled()).count();
    eprintln!("instance killed mid-sale: {unanswered} of 190 buyers without a final answer");
    let mut all = alternating;
    all.extend(settle_all(balancer.addr, ACTIVITY, SKU, before));
    let resolved = resolve_and_check_sold_out(&rt, &stores, &survivor, &all, stock);
    assert!(resolved.values().all(|r| r.state == "SUCCEEDED"), "{resolved:?}");
    // Every unit is an order of a promised buyer: a buyer whose reservation the killed
    // instance made without answering is answered QUEUED (replayed) on the retry, also after
    // sell-out (the survivor loads the SKU's request records into its replay map).
    let promised = all.iter().filter(|i| i.promised()).count() as u64;
    let unanswered = all.iter().filter(|i| i.answers.first().is_some_and(Option::is_none)).count();
    eprintln!("{promised} promised buyers; {unanswered} were left unanswered by the kill");
    assert_eq!(promised, stock, "an order of a buyer not told QUEUED");
    survivor.stop();
}
