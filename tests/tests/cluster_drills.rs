//! The engine over a real Redis Cluster (3 masters + 3 replicas, one per test binary), with
//! its order worker, NATS and PostgreSQL (DESIGN.md section 11, issue "Redis Cluster and
//! failover"). Each drill ends with the invariants of DESIGN.md section 8: PostgreSQL's audit
//! (no oversell, one order per buyer, token conservation, ack after commit) and the reconcile
//! report of every SKU it used.
//!
//! - `skus_on_every_master_sell_through_one_seed`: the engine is given ONE seed (a replica),
//!   finds every master, and sells a SKU on each.
//! - `a_killed_master_closes_only_its_skus_until_a_reconcile_passes`: kill -9 of a master
//!   mid-sale: its SKUs answer SUBMIT_CLOSED (REDIS_FAILOVER) once the promotion is seen,
//!   reopen after a passing reconcile, a SKU on another master keeps selling, and every buyer
//!   told QUEUED / QUEUED_PENDING gets exactly one order.
//! - `with_fencing_a_lost_replica_link_loses_no_promised_buyer` and
//!   `without_fencing_the_same_drill_shows_the_loss`: the replica link of a master is cut, a
//!   burst of buyers arrives, the master is killed. With `min_replica_acks = 1` none of them is
//!   promised (UNKNOWN: retry with the same id) and everything reconciles; with 0 they are
//!   promised (QUEUED), the promoted replica has no record of them, and reconcile reports
//!   exactly those reservations as missing (the drill can see the loss).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flashsale_io::redis::fence::MinReplicaAcks;
use flashsale_io::redis::slot::Slot;
use flashsale_tests::sale::{self, Answers};
use flashsale_tests::{redis_cluster, small_worker, state, wait_for_ms, Engine, HttpClient};
use serde_json::Value;

/// An engine whose Redis is the shared cluster, reached through `seed`.
fn engine_on(seed: SocketAddr, acks: MinReplicaAcks) -> Engine {
    Engine::start_with(|c| {
        c.edge.redis_seeds = vec![seed];
        c.edge.redis.addr = seed;
        c.edge.min_replica_acks = acks;
        c.worker = Some(small_worker(c));
    })
}

/// The first SKU id from `from` whose slot `{activity:sku}` is served by `master`.
fn sku_on(master: SocketAddr, activity: u64, from: u64) -> u64 {
    let cluster = redis_cluster();
    let map = cluster.map();
    (from..from + 10_000)
        .find(|sku| {
            let slot = Slot::of_key(format!("{{{activity}:{sku}}}").as_bytes());
            map.addr_of(slot) == Some(master)
        })
        .expect("a SKU on every master")
}

fn report(engine: &Engine, activity: u64, sku: u64) -> Value {
    sale::reconcile(engine.admin(), (activity, sku))
}

fn wait_ordered(engine: &Engine, activity: u64, sku: u64, buyers: &[(u64, String)]) {
    sale::wait_ordered(engine.http(), (activity, sku), buyers);
}

fn wait_reconciled(engine: &Engine, activity: u64, sku: u64) -> Value {
    sale::wait_reconciled(engine.admin(), (activity, sku))
}

#[test]
fn skus_on_every_master_sell_through_one_seed() {
    let cluster = redis_cluster();
    let _drill = cluster.exclusive();
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    // A replica as the only seed: the engine must find the masters itself.
    let seed = cluster.replica_of(masters[0]);
    let engine = engine_on(seed, MinReplicaAcks::Auto);
    // One activity (of one SKU) per master.
    let skus: Vec<(u64, u64)> =
        (5_101..).zip(&masters).map(|(a, m)| (a, sku_on(*m, a, 1))).collect();
    for (activity, sku) in &skus {
        engine.create_activity(*activity, *sku, 3);
    }
    let mut c = HttpClient::connect(engine.http());
    for &(activity, ref sku) in &skus {
        let mut buyers = Vec::new();
        for user in 1..=4u64 {
            let id = format!("one-seed-{sku}-{user}");
            let (status, v) = engine.submit(&mut c, user, activity, *sku, &id);
            match (user, state(&v)) {
                (1..=3, "QUEUED") => buyers.push((user, id)),
                (4, "SOLD_OUT") => {}
                _ => panic!("SKU {sku}, buyer {user}: {status} {v}"),
            }
        }
        wait_ordered(&engine, activity, *sku, &buyers);
        engine.assert_invariants(activity, *sku);
        let r = wait_reconciled(&engine, activity, *sku);
        assert_eq!(r["redis"]["stock"], 0, "{r}");
    }
}

#[test]
fn a_killed_master_closes_only_its_skus_until_a_reconcile_passes() {
    let cluster = redis_cluster();
    let _drill = cluster.exclusive();
    let masters = cluster.masters();
    let (victim, other) = (masters[1], masters[2]);
    let engine = Arc::new(engine_on(masters[0], MinReplicaAcks::Auto));
    let (activity, control_activity) = (5_200, 5_201);
    let (hot, control) = (sku_on(victim, activity, 1), sku_on(other, control_activity, 1));
    engine.create_activity(activity, hot, 5_000);
    engine.create_activity(control_activity, control, 5_000);
    let answers = Arc::new(Mutex::new(Answers::default()));
    let control_sold = Arc::new(Mutex::new(Vec::new()));
    // Buyers keep coming for 14 s, and past that until the hot SKU has reopened (a QUEUED
    // after a REDIS_FAILOVER) or 40 s: how long the reopening takes is reported, not bounded.
    let started = Instant::now();
    let (min_stop, max_stop) =
        (started + Duration::from_secs(14), started + Duration::from_secs(40));
    let buyers: Vec<_> = (0..4u64)
        .map(|t| {
            let (engine, answers, control_sold) =
                (Arc::clone(&engine), Arc::clone(&answers), Arc::clone(&control_sold));
            std::thread::spawn(move || {
                let mut c = HttpClient::connect(engine.http());
                let mut n = 0u64;
                let reopened = |a: &Answers| {
                    let closed =
                        a.timeline.iter().rposition(|(_, x)| x == "SUBMIT_CLOSED:REDIS_FAILOVER");
                    closed.is_some_and(|i| a.timeline[i..].iter().any(|(_, x)| x == "QUEUED"))
                };
                while Instant::now() < max_stop
                    && (Instant::now() < min_stop || !reopened(&answers.lock().unwrap()))
                {
                    n += 1;
                    let user = t * 100_000 + n;
                    let id = format!("kill-{user}");
                    let (_, v) = engine.submit(&mut c, user, activity, hot, &id);
                    answers.lock().unwrap().record(user, &id, &v);
                    // The control SKU on another master, every tenth buyer.
                    if n.is_multiple_of(10) {
                        let cid = format!("ctl-{user}");
                        let (_, cv) = engine.submit(&mut c, user, control_activity, control, &cid);
                        control_sold.lock().unwrap().push((Instant::now(), state(&cv).to_owned()));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let replica = cluster.replica_of(victim);
    let killed_at = Instant::now();
    cluster.kill(victim);
    let promoted = cluster.wait_promoted(replica, Duration::from_secs(30));
    println!("replica promoted {promoted:?} after the kill");
    // Redundancy back (the killed node rejoins as a replica), so fenced reservations can be
    // confirmed again.
    cluster.heal();
    println!("cluster healed {:?} after the kill", killed_at.elapsed());
    for buyer in buyers {
        buyer.join().unwrap();
    }
    // Unknown outcomes are retried with the same request id, as the contract asks.
    let unknown: Vec<(u64, String)> = {
        let a = answers.lock().unwrap();
        let unknown =
            |answers: &Vec<String>| answers.last().is_some_and(|l| l.starts_with("UNKNOWN"));
        a.by_buyer
            .iter()
            .filter(|(_, (_, v))| unknown(v))
            .map(|(u, (id, _))| (*u, id.clone()))
            .collect()
    };
    let mut c = HttpClient::connect(engine.http());
    for (user, id) in &unknown {
        wait_for_ms("an unknown outcome resolves on retry", 60_000, || {
            let (_, v) = engine.submit(&mut c, *user, activity, hot, id);
            answers.lock().unwrap().record(*user, id, &v);
            !state(&v).starts_with("UNKNOWN") && state(&v) != "SUBMIT_CLOSED"
        });
    }
    let a = answers.lock().unwrap();
    let closed = a.count("SUBMIT_CLOSED:REDIS_FAILOVER");
    println!(
        "hot SKU: {} buyers, {} QUEUED, {} QUEUED_PENDING, {} UNKNOWN, {} SYSTEM_BUSY, {closed} REDIS_FAILOVER, {} retried",
        a.by_buyer.len(),
        a.count("QUEUED"),
        a.count("QUEUED_PENDING"),
        a.count("UNKNOWN"),
        a.count("SYSTEM_BUSY") + a.count("SYSTEM_BUSY:REDIS_UNAVAILABLE"),
        unknown.len()
    );
    assert!(closed > 0, "the failover must close the hot SKU for a while");
    // Reopened: buyers were queued again after the closure.
    let last_closed = a.timeline.iter().rev().find(|(_, x)| x == "SUBMIT_CLOSED:REDIS_FAILOVER");
    let first_closed = a.timeline.iter().find(|(_, x)| x == "SUBMIT_CLOSED:REDIS_FAILOVER");
    let (Some((closed_at, _)), Some((opened_from, _))) = (first_closed, last_closed) else {
        unreachable!("counted above")
    };
    let reopened_at = a.timeline.iter().find(|(at, x)| at > opened_from && x == "QUEUED");
    let Some((reopened_at, _)) = reopened_at else { panic!("the hot SKU never reopened") };
    println!(
        "closed {:?} after the kill, reopened {:?} after that",
        closed_at.duration_since(killed_at),
        reopened_at.duration_since(*closed_at)
    );
    let promised = a.promised();
    drop(a);
    // The other master's SKU sold meanwhile.
    let sold_during = control_sold
        .lock()
        .unwrap()
        .iter()
        .filter(|(at, s)| *at > killed_at && *at < killed_at + promoted && s == "QUEUED")
        .count();
    println!("control SKU: {sold_during} QUEUED while the hot SKU's master was down");
    wait_ordered(&engine, activity, hot, &promised);
    engine.assert_invariants(activity, hot);
    engine.assert_invariants(control_activity, control);
    let r = wait_reconciled(&engine, activity, hot);
    assert_eq!(r["deltas"]["idempotency"]["value"], 0, "{r}");
    wait_reconciled(&engine, control_activity, control);
}

/// The loss drill: returns (answers of the burst after the cut, the final report).
fn loss_drill(acks: MinReplicaAcks, activity: u64) -> (Vec<String>, Value) {
    let cluster = redis_cluster();
    let masters = cluster.masters();
    let victim = masters[1];
    let engine = engine_on(masters[0], acks);
    let sku = sku_on(victim, activity, 1);
    engine.create_activity(activity, sku, 100);
    let mut c = HttpClient::connect(engine.http());
    let mut before = Vec::new();
    for user in 1..=5u64 {
        let id = format!("loss-{user}");
        let (_, v) = engine.submit(&mut c, user, activity, sku, &id);
        assert_eq!(state(&v), "QUEUED", "{v}");
        before.push((user, id));
    }
    wait_ordered(&engine, activity, sku, &before);
    let replica = cluster.replica_of(victim);
    cluster.cut_replica_link(victim);
    let mut burst = Vec::new();
    for user in 11..=20u64 {
        let (_, v) = engine.submit(&mut c, user, activity, sku, &format!("loss-{user}"));
        burst.push(state(&v).to_owned());
    }
    cluster.kill(victim);
    cluster.wait_promoted(replica, Duration::from_secs(30));
    cluster.heal();
    // Whatever was promised must become an order; unknown ones are retried with their ids
    // once the SKU reopens (with fencing it does; without, it stays closed: the loss).
    for (user, answer) in (11..=20u64).zip(&burst) {
        if answer == "QUEUED" || answer == "QUEUED_PENDING" {
            wait_ordered(&engine, activity, sku, &[(user, format!("loss-{user}"))]);
        }
    }
    let mut last = Value::Null;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        last = report(&engine, activity, sku);
        if last["ok"] == true {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    engine.assert_invariants(activity, sku);
    (burst, last)
}

#[test]
fn with_fencing_a_lost_replica_link_loses_no_promised_buyer() {
    let cluster = redis_cluster();
    let _drill = cluster.exclusive();
    let (burst, r) = loss_drill(MinReplicaAcks::Exactly(1), 5_300);
    println!("burst after the cut, fenced: {burst:?}\nreport: {r:#}");
    // Fence short: UNKNOWN (retry with the same id), then the circuit closes the node
    // (SYSTEM_BUSY: nothing reserved). Never a promise.
    assert!(burst.iter().all(|a| a == "UNKNOWN" || a == "SYSTEM_BUSY"), "{burst:?}");
    assert!(burst.iter().any(|a| a == "UNKNOWN"), "{burst:?}");
    assert_eq!(r["ok"], true, "{r:#}");
    assert_eq!(r["deltas"]["redis_conservation"]["parts"]["records_missing"], 0);
}

#[test]
fn without_fencing_the_same_drill_shows_the_loss() {
    let cluster = redis_cluster();
    let _drill = cluster.exclusive();
    let (burst, r) = loss_drill(MinReplicaAcks::Exactly(0), 5_400);
    println!("burst after the cut, unfenced: {burst:?}");
    let promised = burst.iter().filter(|a| *a == "QUEUED" || *a == "QUEUED_PENDING").count();
    assert_eq!(promised, 10, "unfenced, every buyer is promised: {burst:?}");
    // The promoted replica never saw them: reconcile names them, and the SKU stays closed.
    assert_eq!(r["ok"], false, "{r:#}");
    assert_eq!(r["deltas"]["redis_conservation"]["parts"]["records_missing"], 10, "{r:#}");
}

/// Submits `id` for `user` until the answer is final for a buyer (not closed, busy, unknown,
/// shed or rate limited), within 60 s; records every answer; returns the last.
fn submit_until_final(
    engine: &Engine,
    c: &mut HttpClient,
    (user, id): (u64, &str),
    (activity, sku): (u64, u64),
    answers: &mut Answers,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, v) = engine.submit(c, user, activity, sku, id);
        answers.record(user, id, &v);
        let open = matches!(
            state(&v),
            "SUBMIT_CLOSED" | "SYSTEM_BUSY" | "UNKNOWN" | "OVERLOADED" | "RATE_LIMITED"
        );
        if !open || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(v["retry_after_ms"].as_u64().unwrap_or(200)));
    }
}

/// A master and its replica both lost (kill -9 of both, restarted without data: the cluster
/// keeps no persistence) mid-sale under load: the SKU's keys are gone with their only copies.
/// The engine sees the master's new run id, finds no `meta`, rebuilds the SKU from PostgreSQL
/// (`engine/src/shard/rebuild.rs`) and reopens it after a passing reconcile; every buyer told
/// QUEUED before the loss gets his reservation back for his request id, none reserves twice,
/// every promised buyer has one order (issue 26 item 2; the standalone FLUSHALL drill and its
/// negative control: `tests/tests/redis_rebuild.rs`).
#[test]
fn a_master_lost_with_its_replica_is_rebuilt_from_postgres() {
    let cluster = redis_cluster();
    let _drill = cluster.exclusive();
    let masters = cluster.masters();
    let victim = masters[1];
    let engine = engine_on(masters[0], MinReplicaAcks::Auto);
    let activity = 5_500;
    let sku = sku_on(victim, activity, 1);
    engine.create_activity(activity, sku, 300);
    let mut c = HttpClient::connect(engine.http());
    let mut answers = Answers::default();
    let mut first = Vec::new();
    for user in 1..=20u64 {
        let id = format!("lost-{user}");
        let (_, v) = engine.submit(&mut c, user, activity, sku, &id);
        answers.record(user, &id, &v);
        assert_eq!(state(&v), "QUEUED", "{v}");
        first.push((user, id, v["reservation_id"].as_str().unwrap().to_owned()));
    }
    let load =
        sale::Buyers::start(engine.http(), (activity, sku), 2, Duration::from_millis(50), "L");
    std::thread::sleep(Duration::from_millis(500));
    let replica = cluster.replica_of(victim);
    let killed_at = Instant::now();
    cluster.kill(victim);
    cluster.kill(replica);
    std::thread::sleep(Duration::from_secs(2));
    cluster.heal();
    println!("master and replica back, empty, {:?} after the kill", killed_at.elapsed());
    for (user, id, reservation) in &first {
        let v = submit_until_final(&engine, &mut c, (*user, id), (activity, sku), &mut answers);
        assert_eq!(v["reservation_id"].as_str(), Some(reservation.as_str()), "{user}: {v}");
    }
    // The rebuild restored their request records on the master that lost them (the engine's
    // own replay map may have answered the retries above, even while the SKU was closed;
    // Redis must know them too).
    wait_for_ms("the SKU rebuilt", 60_000, || {
        flashsale_tests::metric(&engine.metrics(), "flashsale_redis_rebuilds_total") >= 1
    });
    let master = cluster.master_of(Slot::of_key(format!("{{{activity}:{sku}}}").as_bytes()));
    for (user, id, reservation) in &first {
        let key = format!("seckill:{{{activity}:{sku}}}:req:{user}:{id}");
        let held = flashsale_tests::cluster::call(master, &["HGET", &key, "reservation_id"]);
        assert_eq!(held.as_str(), Some(reservation.as_str()), "{key}");
    }
    for (user, _, _) in &first {
        let id = format!("lost-again-{user}");
        let v = submit_until_final(&engine, &mut c, (*user, &id), (activity, sku), &mut answers);
        assert_eq!(state(&v), "DUPLICATE_USER", "{user}: {v}");
    }
    let mut all = load.stop();
    all.merge(answers);
    let lost = all.count("SUBMIT_CLOSED:REDIS_DATA_LOST");
    println!("after the kill:\n{}\n{lost} REDIS_DATA_LOST answers", all.by_second(killed_at, 16));
    assert!(lost > 0, "the loss closed the SKU with its own reason");
    sale::assert_promise_kept(
        (engine.http(), engine.admin()),
        &engine.db.url,
        (activity, sku),
        &mut all,
    );
}
