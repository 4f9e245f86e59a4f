//! What an operator resolves by hand, against real Redis, NATS and PostgreSQL, through
//! `admin_cli::run` (the functions `main` calls) and the admin routes: stuck reservations
//! (`flashsale admin stuck`, `shard/stuck.rs`) and dead letters (`flashsale admin dlq`,
//! `shard/dlq.rs`).
//!
//! How reservations get stuck here: the engine runs with no order-writer, a 300 ms order
//! deadline and a 1.5 s recovery deadline, so every accepted reservation's message sits in
//! `SECKILL_ORDERS` unconsumed (in flight, with the scanner's republishes beside it) and the
//! scanner moves the reservation to `resv:stuck`. One SKU's reservations expire after 1 s
//! (compensable once stuck), the other's after 60 s (republish only). The order-writer starts
//! only after the operator's decisions, so every decision is taken while copies of the
//! message are still in flight — and each must still create nothing twice.

use std::time::Duration;

use flashsale_engine::shard::scanner::ScannerConfig;
use flashsale_tests::{
    redis_cmd, serve_config, small_worker, state, wait_for_ms, Engine, HttpClient,
};

/// Reservations expire after 1 s: past it when they get stuck.
const SHORT: (u64, u64) = (10_001, 20_001);
/// Reservations expire after 60 s: still live when stuck.
const LONG: (u64, u64) = (10_002, 20_002);
const STOCK: i64 = 10;

fn engine() -> Engine {
    Engine::start_with(|c| {
        c.edge.order_deadline_ms = 300;
        c.edge.scanner = ScannerConfig {
            interval_ms: 100,
            batch_max: 128,
            backoff_base_ms: 200,
            backoff_max_ms: 400,
            recovery_deadline_ms: 1_500,
            sku_refresh_ms: 200,
        };
    })
}

fn create(engine: &Engine, (activity, sku): (u64, u64), ttl_ms: u64) {
    let body = format!(
        r#"{{"activity_id":{activity},"sku_id":{sku},"stock":{STOCK},"reservation_ttl_ms":{ttl_ms}}}"#
    );
    engine.create_activity_with(&body);
}

fn key((activity, sku): (u64, u64), suffix: &str) -> String {
    format!("seckill:{{{activity}:{sku}}}:{suffix}")
}

fn stuck_count(engine: &Engine, sku: (u64, u64)) -> u64 {
    redis_cmd(&engine.redis, &["ZCARD", &key(sku, "resv:stuck")]).parse().unwrap()
}

fn list(engine: &Engine, (activity, sku): (u64, u64)) -> serde_json::Value {
    let (a, s) = (activity.to_string(), sku.to_string());
    let (status, out) = engine.admin_cli(&["stuck", "list", "--activity", &a, "--sku", &s]);
    assert_eq!(status, Ok(0), "{out}");
    out
}

fn resolve(
    engine: &Engine,
    (activity, sku): (u64, u64),
    reservation: &str,
    action: &str,
) -> (Result<u8, String>, serde_json::Value) {
    let (a, s) = (activity.to_string(), sku.to_string());
    let args = ["stuck", "resolve", "--activity", &a, "--sku", &s, "--reservation", reservation];
    let mut argv = args.to_vec();
    argv.push(action);
    engine.admin_cli(&argv)
}

fn ids(listed: &serde_json::Value) -> Vec<String> {
    let entries = listed["stuck"].as_array().unwrap();
    entries.iter().map(|e| e["reservation_id"].as_str().unwrap().to_owned()).collect()
}

#[test]
fn stuck_reservations_are_listed_and_resolved_once_each_way_while_their_messages_are_in_flight() {
    let engine = engine();
    create(&engine, SHORT, 1_000);
    create(&engine, LONG, 60_000);
    let mut c = HttpClient::connect(engine.http());
    for user in 1..=3 {
        let (status, v) = engine.submit(&mut c, user, SHORT.0, SHORT.1, &format!("s-{user}"));
        assert_eq!((status, state(&v)), (202, "QUEUED"), "{v}");
    }
    for user in 11..=12 {
        let (status, v) = engine.submit(&mut c, user, LONG.0, LONG.1, &format!("l-{user}"));
        assert_eq!((status, state(&v)), (202, "QUEUED"), "{v}");
    }
    wait_for_ms("every reservation stuck", 20_000, || {
        stuck_count(&engine, SHORT) == 3 && stuck_count(&engine, LONG) == 2
    });
    assert_eq!(
        (engine.redis_stock(SHORT.0, SHORT.1), engine.redis_stock(LONG.0, LONG.1)),
        (STOCK - 3, STOCK - 2)
    );

    // Listed with what may resolve each.
    let short = list(&engine, SHORT);
    assert_eq!((short["count"].as_u64(), short["listed"].as_u64()), (Some(3), Some(3)), "{short}");
    for e in short["stuck"].as_array().unwrap() {
        assert_eq!(e["last_error_code"], "RECOVERY_DEADLINE", "{e}");
        assert_eq!(
            (e["republishable"].as_bool(), e["compensable"].as_bool()),
            (Some(true), Some(true))
        );
    }
    let long = list(&engine, LONG);
    for e in long["stuck"].as_array().unwrap() {
        assert_eq!(
            (e["republishable"].as_bool(), e["compensable"].as_bool()),
            (Some(true), Some(false))
        );
    }
    let (short_ids, long_ids) = (ids(&short), ids(&long));

    // A live reservation cannot be compensated (the writer could still create its order).
    let (status, out) = resolve(&engine, LONG, &long_ids[0], "--compensate");
    assert_eq!((status, out["reason_code"].as_str()), (Ok(1), Some("NOT_EXPIRED")), "{out}");
    // Republished, twice for the first one: the log dedups the second inside its window.
    for id in [&long_ids[0], &long_ids[0], &long_ids[1]] {
        let (status, out) = resolve(&engine, LONG, id, "--republish");
        assert_eq!((status, out["resolution"].as_str()), (Ok(0), Some("REPUBLISHED")), "{out}");
    }

    // Compensated: the writer's verdict recorded now; a second compensation finds it.
    let (status, out) = resolve(&engine, SHORT, &short_ids[0], "--compensate");
    assert_eq!((status, out["resolution"].as_str()), (Ok(0), Some("COMPENSATED")), "{out}");
    let (status, out) = resolve(&engine, SHORT, &short_ids[0], "--compensate");
    assert_eq!((status, out["resolution"].as_str()), (Ok(0), Some("ALREADY_RECORDED")), "{out}");
    assert_eq!(out["recorded"]["reason_code"], "EXPIRED", "{out}");
    let (status, out) = resolve(&engine, SHORT, &short_ids[1], "--compensate");
    assert_eq!((status, out["resolution"].as_str()), (Ok(0), Some("COMPENSATED")), "{out}");
    // The third is left alone: its own message, still in the stream, decides it.

    // Bad input: a clear error, nothing changed.
    let (status, out) = resolve(&engine, SHORT, "resv_unknown", "--compensate");
    assert_eq!((status, out["reason_code"].as_str()), (Ok(1), Some("NOT_STUCK")), "{out}");
    let path = format!("/admin/v1/activities/{}/skus/{}/stuck/{}", SHORT.0, SHORT.1, short_ids[2]);
    let resp = HttpClient::connect(engine.admin()).request(
        "POST",
        &path,
        None,
        Some(r#"{"action":"forget"}"#),
    );
    assert_eq!((resp.status, resp.json()["reason_code"].as_str()), (400, Some("ACTION_INVALID")));
    assert_eq!(stuck_count(&engine, SHORT), 3, "nothing leaves stuck before redis-sync applies");

    // Now the order-writer drains the stream: every original, every scanner republish and
    // every operator republish arrives after (or beside) the decisions above.
    let config = serve_config(engine.redis.addr(), &engine.nats.url(), &engine.db.url);
    let worker = flashsale_pg_worker::worker::start(small_worker(&config)).expect("worker starts");
    wait_for_ms("stuck emptied by the outcomes", 20_000, || {
        stuck_count(&engine, SHORT) == 0 && stuck_count(&engine, LONG) == 0
    });
    wait_for_ms("every unit of the short SKU back", 10_000, || {
        engine.redis_stock(SHORT.0, SHORT.1) == STOCK
    });
    // Give any copy still in the stream time to arrive before counting.
    std::thread::sleep(Duration::from_millis(1_000));
    worker.shutdown().expect("worker stops");

    // Exactly one outcome each: no order for an expired reservation, one per live buyer, each
    // unit of the short SKU returned once (a second return would show as stock 11+).
    assert_eq!(engine.redis_stock(SHORT.0, SHORT.1), STOCK);
    assert_eq!(engine.redis_stock(LONG.0, LONG.1), STOCK - 2);
    let orders = |sku: (u64, u64)| {
        engine.pg_count(&format!("SELECT count(*) FROM orders WHERE sku_id = {}", sku.1))
    };
    assert_eq!((orders(SHORT), orders(LONG)), (0, 2));
    let expired = engine.pg_count(&format!(
            "SELECT count(*) FROM inventory_reservation WHERE sku_id = {} AND status = 'REJECTED_EXPIRED'",
            SHORT.1
        ),
    );
    assert_eq!(expired, 3);
    for user in 1..=3 {
        let (_, v) = engine.query(&mut c, user, SHORT.0, SHORT.1, &format!("s-{user}"));
        assert_eq!((state(&v), v["reason_code"].as_str()), ("FAILED", Some("EXPIRED")), "{v}");
    }
    for user in 11..=12 {
        let (_, v) = engine.query(&mut c, user, LONG.0, LONG.1, &format!("l-{user}"));
        assert_eq!(state(&v), "SUCCEEDED", "{v}");
    }
    // A buyer whose reservation was compensated may buy again.
    let (status, v) = engine.submit(&mut c, 1, SHORT.0, SHORT.1, "s-1-again");
    assert_eq!((status, state(&v)), (202, "QUEUED"), "{v}");
    engine.assert_reconciled(LONG.0, LONG.1);
    engine.assert_invariants(SHORT.0, SHORT.1);
}

/// Dead letters made the way the worker makes them: a message whose every delivery met a
/// contended claim (a transaction of the test holds every token locked) and an undecodable
/// one. The first is replayed after the lock goes and becomes the buyer's one order; the
/// second, replayed unfixed, comes back as a new dead letter and is then discarded.
#[test]
fn dead_letters_are_listed_replayed_once_and_discarded() {
    let engine = Engine::start_with(|c| {
        c.durable.log.max_deliver = 2;
        c.durable.log.ack_wait_ms = 1_000;
        c.durable.log.backoff_ms = vec![];
        // The scanner must not resolve the buyer behind the operator's back.
        c.edge.order_deadline_ms = 600_000;
        let mut worker = small_worker(c);
        worker.log = c.durable.log.clone();
        worker.contended_nak_ms = 50;
        worker.nak_backoff_ms = vec![50];
        c.worker = Some(worker);
    });
    engine.create_activity(SHORT.0, SHORT.1, 5);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (client, driver) = runtime.block_on(async {
        let (client, conn) =
            tokio_postgres::connect(&engine.db.url, tokio_postgres::NoTls).await.unwrap();
        (client, tokio::spawn(conn))
    });
    // Every token locked by an open transaction: the writer's claim is contended each time.
    runtime.block_on(async {
        client.batch_execute("BEGIN").await.unwrap();
        let locked = client
            .query(
                "SELECT token_id FROM inventory_token WHERE sku_id = $1 FOR UPDATE",
                &[&(SHORT.1 as i64)],
            )
            .await
            .unwrap();
        assert_eq!(locked.len(), 5);
    });
    let mut c = HttpClient::connect(engine.http());
    let (status, v) = engine.submit(&mut c, 7, SHORT.0, SHORT.1, "dlq-1");
    assert_eq!((status, state(&v)), (202, "QUEUED"), "{v}");
    let reservation = v["reservation_id"].as_str().unwrap().to_owned();
    // And a body no schema version explains, published where the edge publishes.
    runtime.block_on(async {
        let log = flashsale_io::jetstream::Log::connect(&flashsale_io::jetstream::LogConfig {
            url: engine.nats.url(),
            ..Default::default()
        })
        .await
        .unwrap();
        let body = bytes::Bytes::from_static(b"{\"schema_version\":99}");
        log.publisher()
            .publish(flashsale_io::jetstream::ORDER_CREATE_SUBJECT, "poison-1", None, &[], body)
            .await
            .unwrap();
    });

    let dlq_list = || {
        let (status, out) = engine.admin_cli(&["dlq", "list"]);
        assert_eq!(status, Ok(0), "{out}");
        out
    };
    let mut listed = serde_json::Value::Null;
    wait_for_ms("both messages dead-lettered", 20_000, || {
        listed = dlq_list();
        listed["count"] == 2
    });
    let letters = listed["dead_letters"].as_array().unwrap().clone();
    let find = |needle: &str| {
        letters
            .iter()
            .find(|l| l["body"].as_str().unwrap_or("").contains(needle))
            .unwrap_or_else(|| panic!("no dead letter with {needle}: {listed:#}"))
            .clone()
    };
    let contended = find(&reservation);
    assert_eq!(contended["consumer"], "order-writer", "{contended}");
    assert_eq!(contended["deliveries"], 2, "{contended}");
    assert!(contended["error"].as_str().unwrap().contains("deliveries exhausted"), "{contended}");
    assert_eq!(contended["source_subject"], flashsale_io::jetstream::ORDER_CREATE_SUBJECT);
    let poison = find("schema_version\":99");
    assert_eq!(poison["deliveries"], 1, "dead-lettered at once: {poison}");
    let seq = |letter: &serde_json::Value| letter["sequence"].as_u64().unwrap().to_string();

    // Unfixed, a replay goes round again: a new dead letter, the old one gone.
    let (status, out) = engine.admin_cli(&["dlq", "replay", "--seq", &seq(&poison)]);
    assert_eq!((status, out["resolution"].as_str()), (Ok(0), Some("REPLAYED")), "{out}");
    wait_for_ms("the replayed poison dead-lettered again", 20_000, || {
        let listed = dlq_list();
        let letters = listed["dead_letters"].as_array().unwrap();
        letters.iter().any(|l| {
            l["sequence"].as_u64() > poison["sequence"].as_u64()
                && l["body"].as_str().unwrap_or("").contains("schema_version\":99")
        })
    });
    let again = dlq_list();
    let again = again["dead_letters"].as_array().unwrap();
    let poison_again = again
        .iter()
        .find(|l| l["body"].as_str().unwrap_or("").contains("schema_version\":99"))
        .unwrap();
    assert_eq!(again.len(), 2, "{again:?}");
    let (status, out) = engine.admin_cli(&["dlq", "discard", "--seq", &seq(poison_again)]);
    assert_eq!((status, out["resolution"].as_str()), (Ok(0), Some("DISCARDED")), "{out}");
    let (status, out) = engine.admin_cli(&["dlq", "discard", "--seq", &seq(poison_again)]);
    assert_eq!((status, out["reason_code"].as_str()), (Ok(1), Some("NO_SUCH_DEAD_LETTER")));

    // The buyer is still queued: nothing decided them.
    let (_, v) = engine.query(&mut c, 7, SHORT.0, SHORT.1, "dlq-1");
    assert_eq!(state(&v), "QUEUING", "{v}");
    // Cause fixed (the lock goes), then replayed: one order; a second replay finds nothing.
    runtime.block_on(async { client.batch_execute("ROLLBACK").await.unwrap() });
    // As if the engine died between the replay's publish and its delete: the dead letter stays,
    // and replaying it again publishes a copy the stream drops (same `Nats-Msg-Id`).
    fail::cfg("dlq.keep_after_replay", "return").unwrap();
    let replay = || engine.admin_cli(&["dlq", "replay", "--seq", &seq(&contended)]);
    let (status, first) = replay();
    assert_eq!((status, first["duplicate"].as_bool()), (Ok(0), Some(false)), "{first}");
    let (status, second) = replay();
    assert_eq!((status, second["duplicate"].as_bool()), (Ok(0), Some(true)), "{second}");
    fail::remove("dlq.keep_after_replay");
    let (status, out) = replay();
    assert_eq!((status, out["resolution"].as_str()), (Ok(0), Some("REPLAYED")), "{out}");
    assert_eq!(out["duplicate"], true, "{out}");
    let (status, out) = engine.admin_cli(&["dlq", "replay", "--seq", &seq(&contended)]);
    assert_eq!((status, out["reason_code"].as_str()), (Ok(1), Some("NO_SUCH_DEAD_LETTER")));
    wait_for_ms("the replayed message becomes the order", 20_000, || {
        let (_, v) = engine.query(&mut c, 7, SHORT.0, SHORT.1, "dlq-1");
        assert_ne!(state(&v), "FAILED", "{v}");
        state(&v) == "SUCCEEDED"
    });
    assert_eq!(dlq_list()["count"], 0);

    // Bad input: a clear error.
    let mut admin_http = HttpClient::connect(engine.admin());
    let resp =
        admin_http.request("POST", "/admin/v1/dlq/abc", None, Some(r#"{"action":"replay"}"#));
    assert_eq!((resp.status, resp.json()["reason_code"].as_str()), (400, Some("SEQUENCE_INVALID")));
    let resp = admin_http.request("POST", "/admin/v1/dlq/1", None, Some(r#"{"action":"burn"}"#));
    assert_eq!((resp.status, resp.json()["reason_code"].as_str()), (400, Some("ACTION_INVALID")));
    let resp = admin_http.request("GET", "/admin/v1/dlq?after=x", None, None);
    assert_eq!((resp.status, resp.json()["reason_code"].as_str()), (400, Some("QUERY_INVALID")));

    let orders =
        engine.pg_count(&format!("SELECT count(*) FROM orders WHERE sku_id = {}", SHORT.1));
    assert_eq!(orders, 1);
    drop(client);
    runtime.block_on(async {
        let _ = driver.await;
    });
    engine.assert_reconciled(SHORT.0, SHORT.1);
}
