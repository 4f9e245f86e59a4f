//! Redis loses a SKU's keys mid-sale and the engine rebuilds them from PostgreSQL (issue 26
//! items 1-2, DESIGN.md section 7 "Lost data", `engine/src/shard/rebuild.rs`), against a real
//! Redis, NATS and PostgreSQL with the order worker in-process.
//!
//! - `flushall_mid_sale_every_buyer_keeps_his_answer`: FLUSHALL while buyers keep arriving
//!   and the queued buyers retry with their request ids (honouring `Retry-After`). The SKU
//!   answers `SUBMIT_CLOSED` `REDIS_DATA_LOST` until it is rebuilt and a reconcile passes;
//!   then every buyer told `QUEUED` before the loss gets his own reservation back for the same
//!   request id, a new request id of his is `DUPLICATE_USER`, every promised buyer has exactly
//!   one order, orders = stock, the audit and the reconcile pass.
//! - `without_the_rebuild_the_same_drill_sees_the_wrong_answers` (negative control): the same
//!   drill with the rebuild switched off (failpoint `negctl.redis_rebuild_off`: the SKU only
//!   preheated with PostgreSQL's sellable units, as recovery did before) and reopened by an
//!   operator's signed mode: queued buyers retrying their request id get a second reservation,
//!   not theirs (a buyer holding one reserves twice; PostgreSQL's keys reject it later).
//! - `an_engine_restarted_onto_an_empty_redis_rebuilds_and_a_re_create_never_resells`: Redis
//!   flushed while the engine is down; the restarted engine finds the SKU from PostgreSQL, the
//!   activity's idempotent re-create does not preheat its initial stock again, and the rebuilt
//!   stock is what PostgreSQL can still sell.
//!
//! Failpoints are process-global: the tests here run one at a time ([`serial`]).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use flashsale_engine::logic::modes::{control_key, sign, Mode, ModeSnapshot, Scope};
use flashsale_tests::sale::{self, Answers, Buyers};
use flashsale_tests::{
    metric, redis_cmd, small_worker, state, wait_for_ms, Engine, HttpClient, Peer,
};
use serde_json::Value;

const CONTROL: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
/// Buyers who reserve before the loss.
const FIRST: u64 = 30;
/// Units each first buyer takes: the rebuild restores quantities, not just markers.
const FIRST_UNITS: u32 = 2;
/// Enough that units are left when the SKU reopens: the checks after it need a SKU on sale
/// (sold out, the edge answers SOLD_OUT to any new request id on its own).
const STOCK: u64 = 200;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn engine(state_dir: &std::path::Path) -> Engine {
    let state_file = state_dir.join("modes.json");
    Engine::start_with(|c| {
        c.worker = Some(small_worker(c));
        c.edge.control.key = Some(control_key(CONTROL).unwrap());
        c.edge.control.state_file = Some(state_file);
    })
}

/// A second instance on the same stores (no worker of its own), as behind a balancer.
fn peer(engine: &Engine, state_dir: &std::path::Path) -> Peer {
    let state_file = state_dir.join("peer-modes.json");
    engine.start_peer(|c| {
        c.edge.control.key = Some(control_key(CONTROL).unwrap());
        c.edge.control.state_file = Some(state_file);
    })
}

/// Submits `id` for `user` until the answer is not `SUBMIT_CLOSED` (honouring its
/// `retry_after_ms`) or `within` passed; records every answer; returns the last.
fn submit_through_closure(
    engine: &Engine,
    c: &mut HttpClient,
    (user, id): (u64, &str),
    (sku, quantity): ((u64, u64), u32),
    answers: &mut Answers,
    within: Duration,
) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let (_, v) = engine.submit_units(c, (user, id), sku, quantity);
        answers.record(user, id, &v);
        if state(&v) != "SUBMIT_CLOSED" || Instant::now() > deadline {
            return v;
        }
        let retry_ms = v["retry_after_ms"].as_u64().unwrap_or(200).clamp(50, 1_000);
        std::thread::sleep(Duration::from_millis(retry_ms));
    }
}

/// What a drill saw.
struct Drill {
    /// Every answer, the first buyers' included.
    answers: Answers,
    /// Each first buyer's request id and reservation id before the loss.
    first: BTreeMap<u64, (String, String)>,
    /// First buyers whose same-id retry after the loss did not give back their reservation.
    not_theirs: Vec<(u64, Value)>,
    /// First buyers (all of them hold a reservation) whose new request id was reserved again.
    reserved_again: Vec<(u64, Value)>,
    flushed_at: Instant,
}

/// The sale, the loss, the retries (module documentation), on two instances: the first
/// buyers reserve on `engine`, the load arrives on `peer`, and after the loss the first buyers
/// retry on `peer`, which never accepted them (its replay map cannot answer for them: only
/// Redis can). `reopen` runs once the SKU is closed (the negative control's operator).
fn drill(engine: &Engine, peer: &Peer, sku: (u64, u64), reopen: impl FnOnce()) -> Drill {
    engine.create_activity_with(&format!(
        r#"{{"activity_id":{},"sku_id":{},"stock":{STOCK},"max_per_buyer":{FIRST_UNITS}}}"#,
        sku.0, sku.1
    ));
    // The owner has read the SKU's meta at least once (the activity refresh, every second).
    std::thread::sleep(Duration::from_millis(1_500));
    let mut c = HttpClient::connect(engine.http());
    let mut answers = Answers::default();
    let mut first = BTreeMap::new();
    for user in 1..=FIRST {
        let id = format!("first-{user}");
        let (_, v) = engine.submit_units(&mut c, (user, &id), sku, FIRST_UNITS);
        answers.record(user, &id, &v);
        assert_eq!(state(&v), "QUEUED", "{v}");
        first.insert(user, (id, v["reservation_id"].as_str().unwrap().to_owned()));
    }
    // Mid-sale: more buyers keep arriving, orders are still being written.
    let load = Buyers::start(peer.http(), sku, 3, Duration::from_millis(40), "load");
    std::thread::sleep(Duration::from_millis(300));
    let flushed_at = Instant::now();
    assert_eq!(redis_cmd(&engine.redis, &["FLUSHALL"]), "OK");
    wait_for_ms("the loss closes the SKU", 15_000, || {
        let a = load.answers.lock().unwrap();
        a.timeline.iter().any(|(at, x)| *at > flushed_at && x == "SUBMIT_CLOSED:REDIS_DATA_LOST")
    });
    reopen();
    // The first buyers retry their request ids through the closure, on the other instance.
    let mut c = HttpClient::connect(peer.http());
    let mut not_theirs = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    for (user, (id, reservation)) in &first {
        let v = submit_through_closure(
            engine,
            &mut c,
            (*user, id),
            (sku, FIRST_UNITS),
            &mut answers,
            deadline.saturating_duration_since(Instant::now()),
        );
        if v["reservation_id"].as_str() != Some(reservation.as_str()) {
            not_theirs.push((*user, v));
        }
    }
    // Every first buyer (each holds a reservation) with a new request id, while units are
    // left: DUPLICATE_USER, never a second reservation.
    let mut reserved_again = Vec::new();
    for user in first.keys() {
        let id = format!("again-{user}");
        let v = submit_through_closure(
            engine,
            &mut c,
            (*user, &id),
            (sku, 1),
            &mut answers,
            deadline.saturating_duration_since(Instant::now()),
        );
        if state(&v) != "DUPLICATE_USER" {
            reserved_again.push((*user, v));
        }
    }
    // The load sells what is left.
    wait_for_ms("the SKU sells out after it reopened", 60_000, || {
        let a = load.answers.lock().unwrap();
        a.timeline.iter().any(|(at, x)| *at > flushed_at && x == "SOLD_OUT")
    });
    answers.merge(load.stop());
    Drill { answers, first, not_theirs, reserved_again, flushed_at }
}

#[test]
fn flushall_mid_sale_every_buyer_keeps_his_answer() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(dir.path());
    let peer = peer(&engine, dir.path());
    let sku = (7_101, 1);
    let mut d = drill(&engine, &peer, sku, || {});
    let closed = d.answers.count("SUBMIT_CLOSED:REDIS_DATA_LOST");
    let timeline = &d.answers.timeline;
    let first_closed = timeline.iter().find(|(_, x)| x == "SUBMIT_CLOSED:REDIS_DATA_LOST");
    let first_closed = first_closed.map(|(at, _)| *at).expect("closed");
    let reopened = d.answers.first_queued_after(first_closed);
    println!(
        "closed answers {closed}; closed {:?} after the flush, reopened {:?} after that\n{}",
        first_closed.duration_since(d.flushed_at),
        reopened.map(|t| t.duration_since(first_closed)),
        d.answers.by_second(d.flushed_at, 12)
    );
    assert!(closed > 0, "the loss closed the SKU with its own reason");
    assert!(reopened.is_some(), "the SKU reopened");
    assert_eq!(d.not_theirs, [], "every queued buyer gets his own reservation back");
    assert_eq!(d.reserved_again, [], "no buyer holding a reservation reserves again");
    // Both instances see the loss; whichever takes the rebuild's lock first rebuilds.
    let both = |name: &str| metric(&engine.metrics(), name) + metric(&peer.metrics(), name);
    assert!(both("flashsale_redis_data_losses_total") >= 2, "each instance saw the loss");
    assert_eq!(both("flashsale_redis_rebuilds_total"), 1, "one rebuild for both");
    let promised = sale::assert_promise_kept(
        (engine.http(), engine.admin()),
        &engine.db.url,
        sku,
        &mut d.answers,
    );
    for user in d.first.keys() {
        assert!(promised.iter().any(|(u, _)| u == user), "first buyer {user} promised");
    }
    let units = engine.pg_count(&format!(
        "SELECT coalesce(sum(quantity), 0) FROM orders WHERE activity_id = {} AND sku_id = {}",
        sku.0, sku.1
    ));
    assert_eq!(units as u64, STOCK, "sold out: units ordered = stock");
    // Redis holds what PostgreSQL holds: no stock left, every buyer's marker.
    assert_eq!(engine.redis_stock(sku.0, sku.1), 0);
}

#[test]
fn without_the_rebuild_the_same_drill_sees_the_wrong_answers() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(dir.path());
    let peer = peer(&engine, dir.path());
    let sku = (7_102, 1);
    fail::cfg("negctl.redis_rebuild_off", "return").unwrap();
    let admin = engine.admin();
    // Without the rebuild the reconcile never passes (Redis forgot every reservation): the
    // operator's signed NORMAL for the SKU reopens it, as the runbook allows.
    let d = drill(&engine, &peer, sku, || {
        std::thread::sleep(Duration::from_secs(3));
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
                as u64;
        let snapshot = ModeSnapshot {
            version: 1,
            scope: Scope::Sku(sku.0, sku.1),
            mode: Mode::Normal,
            issued_at_ms: now,
            expires_at_ms: now + 600_000,
            issuer: "negative-control".into(),
        };
        let body = sign(&control_key(CONTROL).unwrap(), snapshot).unwrap().to_json();
        let r = HttpClient::connect(admin).request("POST", "/admin/v1/mode", None, Some(&body));
        assert_eq!(r.status, 200, "{}", r.body);
    });
    fail::remove("negctl.redis_rebuild_off");
    println!(
        "without the rebuild: {} of {FIRST} queued buyers got another reservation for their \
         request id, {} buyers holding one reserved again",
        d.not_theirs.len(),
        d.reserved_again.len()
    );
    // A queued buyer's retry became a second reservation for a buyer who holds one (or
    // SOLD_OUT for a buyer who was queued): both are what the rebuild prevents.
    let twice = d.not_theirs.iter().filter(|(_, v)| state(v) == "QUEUED").count();
    assert!(!d.not_theirs.is_empty(), "the drill must see a buyer lose his reservation");
    assert!(twice > 0, "the drill must see a buyer reserve twice: {:?}", d.not_theirs);
    // PostgreSQL's own guards still hold: no oversell, one order per buyer.
    sale::orders_and_audit(&engine.db.url, sku);
}

#[test]
fn an_engine_restarted_onto_an_empty_redis_rebuilds_and_a_re_create_never_resells() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut engine = engine(dir.path());
    let sku = (7_103, 1);
    engine.create_activity(sku.0, sku.1, 20);
    let mut c = HttpClient::connect(engine.http());
    let mut ids = Vec::new();
    for user in 1..=8 {
        let id = format!("r-{user}");
        let (_, v) = engine.submit(&mut c, user, sku.0, sku.1, &id);
        assert_eq!(state(&v), "QUEUED", "{v}");
        ids.push((user, id));
    }
    sale::wait_ordered(engine.http(), sku, &ids);
    engine.terminate(Duration::ZERO);
    assert_eq!(redis_cmd(&engine.redis, &["FLUSHALL"]), "OK");
    let state_file = dir.path().join("modes.json");
    engine.restart_with(|c| {
        c.worker = Some(small_worker(c));
        c.edge.control.key = Some(control_key(CONTROL).unwrap());
        c.edge.control.state_file = Some(state_file);
    });
    // The operator's documented re-create: idempotent, and it never preheats the initial stock
    // of an activity that was on sale.
    let body = format!(r#"{{"activity_id":{},"sku_id":{},"stock":20}}"#, sku.0, sku.1);
    let r = HttpClient::connect(engine.admin()).request(
        "POST",
        "/admin/v1/activities",
        None,
        Some(&body),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let key = format!("seckill:{{{}:{}}}:", sku.0, sku.1);
    let mut c = HttpClient::connect(engine.http());
    // Found from PostgreSQL (nothing else knows the SKU now), rebuilt, reconciled. Until the
    // engine knows, Redis' word for a SKU it does not have is ACTIVITY_NOT_ACTIVE; then
    // SUBMIT_CLOSED (REDIS_DATA_LOST) until the rebuild is reconciled.
    let mut seen = Vec::new();
    let mut last = Value::Null;
    wait_for_ms("the same request id gets its reservation back", 60_000, || {
        std::thread::sleep(Duration::from_millis(200));
        let (_, v) = engine.submit(&mut c, 1, sku.0, sku.1, "r-1");
        seen.push(sale::label(&v));
        last = v;
        state(&last) == "QUEUED"
    });
    println!("answers to a retry of r-1 after the restart: {seen:?}");
    assert_eq!(last["replayed"], true, "{last}");
    let allowed =
        ["ACTIVITY_NOT_ACTIVE", "SUBMIT_CLOSED:REDIS_DATA_LOST", "RATE_LIMITED", "QUEUED"];
    assert!(seen.iter().all(|a| allowed.contains(&a.as_str())), "{seen:?}");
    assert_eq!(engine.redis_stock(sku.0, sku.1), 12, "stock = 20 - 8 orders, never 20 again");
    assert_eq!(redis_cmd(&engine.redis, &["EXISTS", &format!("{key}user:2")]), "1");
    let (_, again) = engine.submit(&mut c, 2, sku.0, sku.1, "r-2-again");
    assert_eq!(state(&again), "DUPLICATE_USER", "{again}");
    let (_, new) = engine.submit(&mut c, 9, sku.0, sku.1, "r-9");
    assert_eq!(state(&new), "QUEUED", "{new}");
    sale::wait_ordered(engine.http(), sku, &[(9, "r-9".to_owned())]);
    sale::wait_reconciled(engine.admin(), sku);
    engine.assert_invariants(sku.0, sku.1);
}
