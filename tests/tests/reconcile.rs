//! The reconcile report (DESIGN.md section 8, CONTRACT.md section 4) end to end: the engine
//! in-process with its order worker (`small_worker`) against private Redis, NATS and
//! PostgreSQL; the report asked over the admin API and through `flashsale admin` (the
//! `admin_cli` functions `main` calls).
//!
//! - `a_clean_sale_reconciles_ok_with_exact_counts`: every count is exact, every delta 0, the
//!   periodic job exports zero deltas and one ok SKU, the CLI exits 0.
//! - `a_reservation_deleted_from_redis_is_reported_with_its_id`: one `resv:` record deleted;
//!   the report names it (Redis conservation), the CLI exits 1, the metric goes non-zero.
//! - `a_token_forced_to_a_wrong_status_is_reported`: a sold token set back to AVAILABLE; the
//!   report names the order that lost its token (no oversell / token conservation).
//! - `flushall_mid_sale_is_reported_and_postgres_still_shows_no_oversell`: Redis loses
//!   everything while orders are being written, and the engine's rebuild from PostgreSQL is
//!   switched off (failpoint `negctl.redis_rebuild_off`: the SKU only preheated with
//!   PostgreSQL's sellable units): the report lists every reservation Redis no longer knows,
//!   and PostgreSQL's invariants still hold. (With the rebuild on, the report is ok again:
//!   `tests/tests/redis_rebuild.rs`.)
//!
//! Why the CLI is tested through `admin_cli::run` and not by spawning `target/debug/flashsale`:
//! this crate cannot make cargo build another package's binary before its tests, so a spawned
//! binary could be stale or missing; `run` is exactly what `main` calls, and `main` only turns
//! its returned status into the exit code.

use std::collections::BTreeSet;

use flashsale_engine::app::admin_cli;
use flashsale_tests::{redis_cmd, small_worker, state, wait_for_ms, Engine, HttpClient};
use serde_json::Value;

/// `GET .../reconcile` over the admin API.
fn report(engine: &Engine, activity: u64, sku: u64) -> (u16, Value) {
    let path = format!("/admin/v1/activities/{activity}/skus/{sku}/reconcile");
    let resp = HttpClient::connect(engine.admin()).request("GET", &path, None, None);
    (resp.status, resp.json())
}

/// One value of PostgreSQL (an `i64` query) in the engine's database.
fn pg_i64(engine: &Engine, sql: &str) -> i64 {
    pg(engine, sql, |rows| rows[0].get::<_, i64>(0))
}

fn pg<T>(engine: &Engine, sql: &str, f: impl FnOnce(&[tokio_postgres::Row]) -> T) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let (client, conn) =
            tokio_postgres::connect(&engine.db.url, tokio_postgres::NoTls).await.unwrap();
        let driver = tokio::spawn(conn);
        let rows = client.query(sql, &[]).await.unwrap();
        drop(client);
        let _ = driver.await;
        f(&rows)
    })
}

/// The audit of DESIGN.md section 8 (I1–I3, I7) on PostgreSQL, asserted clean.
fn assert_postgres_invariants(engine: &Engine, activity: i64, sku: i64) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let (client, conn) =
            tokio_postgres::connect(&engine.db.url, tokio_postgres::NoTls).await.unwrap();
        let driver = tokio::spawn(conn);
        let audit = flashsale_pg_worker::check_invariants(&client, activity, sku).await.unwrap();
        assert!(audit.ok(), "{:?}", audit.violations);
        drop(client);
        let _ = driver.await;
    });
}

/// `flashsale admin ARGS...` against this engine: (exit status, printed JSON).
fn cli(engine: &Engine, args: &[&str]) -> (u8, Value) {
    let mut argv = vec!["admin".to_owned()];
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    argv.extend(["--admin-addr".to_owned(), engine.admin().to_string()]);
    let parsed = admin_cli::parse_from(argv).unwrap();
    let mut out = Vec::new();
    let status = admin_cli::run(parsed, &Default::default(), &mut out).unwrap();
    (status, serde_json::from_slice(&out).unwrap())
}

fn metric(engine: &Engine, line_prefix: &str) -> Option<u64> {
    engine
        .metrics()
        .lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Buyers 1..=n submit once each; returns the reservation ids they were answered.
fn sale(engine: &Engine, activity: u64, sku: u64, buyers: u64) -> Vec<String> {
    let mut c = HttpClient::connect(engine.http());
    let mut reserved = Vec::new();
    for user in 1..=buyers {
        let (status, v) = engine.submit(&mut c, user, activity, sku, &format!("req-{user}"));
        match state(&v) {
            "QUEUED" | "QUEUED_PENDING" => {
                assert_eq!(status, 202);
                reserved.push(v["reservation_id"].as_str().unwrap().to_owned());
            }
            "SOLD_OUT" => {}
            other => panic!("unexpected answer {other}: {v}"),
        }
    }
    reserved
}

/// Waits until PostgreSQL has `orders` orders and every outcome reached Redis.
fn wait_settled(engine: &Engine, activity: u64, sku: u64, orders: i64) {
    wait_for_ms("orders in PostgreSQL", 20_000, || {
        pg_i64(engine, "SELECT count(*) FROM orders") == orders
    });
    let pending = format!("seckill:{{{activity}:{sku}}}:resv:pending");
    wait_for_ms("outcomes in Redis", 20_000, || {
        redis_cmd(&engine.redis, &["ZCARD", &pending]) == "0"
    });
}

fn ids(v: &Value) -> BTreeSet<String> {
    v["ids"].as_array().unwrap().iter().map(|id| id.as_str().unwrap().to_owned()).collect()
}

fn assert_all_deltas_zero(report: &Value) {
    for (kind, delta) in report["deltas"].as_object().unwrap() {
        assert_eq!(delta["value"], 0, "{kind}: {delta}");
    }
}

#[test]
fn a_clean_sale_reconciles_ok_with_exact_counts() {
    let engine = Engine::start_with(|c| {
        c.worker = Some(small_worker(c));
        c.edge.reconcile.interval_ms = 300;
    });
    let (status, created) =
        cli(&engine, &["create-activity", "--activity", "61", "--sku", "62", "--stock", "5"]);
    assert_eq!((status, created["status"].as_str()), (0, Some("ACTIVE")), "{created}");
    let reserved = sale(&engine, 61, 62, 8);
    assert_eq!(reserved.len(), 5);
    wait_settled(&engine, 61, 62, 5);

    let (status, r) = report(&engine, 61, 62);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["ok"], true, "{r:#}");
    assert_eq!(r["problems"].as_array().unwrap().len(), 0);
    assert_eq!(r["cross_checked"], true);
    assert_eq!(r["initial_stock"], 5);
    assert_all_deltas_zero(&r);
    assert_eq!(r["in_flight"]["reservations"], 0);
    // PostgreSQL: 5 orders on 5 tokens, 5 reservations, one CLAIM each, one inbox row each.
    let p = &r["postgres"];
    let inv = &p["invariants"];
    assert_eq!((inv["orders_total"].as_i64(), inv["orders_live"].as_i64()), (Some(5), Some(5)));
    assert_eq!((inv["tokens_total"].as_i64(), inv["tokens_claimed"].as_i64()), (Some(5), Some(5)));
    assert_eq!(inv["tokens_available"], 0);
    assert_eq!(p["reservations_by_status"]["ORDER_CREATED"], 5);
    assert_eq!(p["orders_by_status"]["PENDING_PAYMENT"], 5);
    assert_eq!(p["ledger_by_kind"]["CLAIM"], 5);
    assert_eq!(p["inbox_rows"], 5);
    assert_eq!(p["reservations_without_inbox"], 0);
    // Redis: sold out, 5 records holding 5 units, nothing pending or stuck.
    let rd = &r["redis"];
    assert_eq!((rd["stock"].as_i64(), rd["soldout"].as_bool()), (Some(0), Some(true)));
    assert_eq!(rd["records"], 5);
    assert_eq!(rd["records_by_status"]["ORDER_CREATED"], 5);
    assert_eq!((rd["units_held"].as_i64(), rd["units_delta_raw"].as_i64()), (Some(5), Some(0)));
    assert_eq!((rd["pending"].as_i64(), rd["stuck"].as_i64()), (Some(0), Some(0)));
    assert_eq!((rd["user_markers"].as_i64(), rd["request_records"].as_i64()), (Some(5), Some(5)));
    assert_eq!(rd["compensation_markers"], 0);
    assert_eq!(rd["scan_complete"], true);
    assert_eq!(rd["meta_status"], "ACTIVE");

    // The periodic job (every 300 ms here) saw the same: one ok SKU, every delta 0.
    let rounds = metric(&engine, "flashsale_reconcile_rounds_total").unwrap();
    wait_for_ms("two more periodic rounds", 10_000, || {
        metric(&engine, "flashsale_reconcile_rounds_total").unwrap() >= rounds + 2
    });
    assert_eq!(metric(&engine, "flashsale_reconcile_skus{result=\"ok\"}"), Some(1));
    assert_eq!(metric(&engine, "flashsale_reconcile_skus{result=\"not_ok\"}"), Some(0));
    for kind in flashsale_engine::logic::reconcile::DELTA_KINDS {
        let line = format!("flashsale_inventory_conservation_delta{{kind=\"{kind}\"}}");
        assert_eq!(metric(&engine, &line), Some(0), "{kind}");
    }

    // The CLI agrees and exits 0.
    let (status, printed) = cli(&engine, &["reconcile", "--activity", "61", "--sku", "62"]);
    assert_eq!((status, &printed["ok"]), (0, &Value::Bool(true)), "{printed:#}");
    // An unknown SKU: 404 with a report that is not ok; the CLI exits 1.
    let (status, unknown) = report(&engine, 61, 999);
    assert_eq!((status, &unknown["ok"]), (404, &Value::Bool(false)));
    assert_eq!(cli(&engine, &["reconcile", "--activity", "61", "--sku", "999"]).0, 1);
    assert_postgres_invariants(&engine, 61, 62);
}

#[test]
fn a_reservation_deleted_from_redis_is_reported_with_its_id() {
    let engine = Engine::start_with(|c| {
        c.worker = Some(small_worker(c));
        c.edge.reconcile.interval_ms = 300;
    });
    engine.create_activity(71, 72, 3);
    let reserved = sale(&engine, 71, 72, 3);
    assert_eq!(reserved.len(), 3);
    wait_settled(&engine, 71, 72, 3);
    let (status, before) = cli(&engine, &["reconcile", "--activity", "71", "--sku", "72"]);
    assert_eq!((status, &before["ok"]), (0, &Value::Bool(true)), "{before:#}");

    let victim = &reserved[1];
    let key = format!("seckill:{{71:72}}:resv:{victim}");
    assert_eq!(redis_cmd(&engine.redis, &["DEL", &key]), "1");

    let (status, r) = report(&engine, 71, 72);
    assert_eq!(status, 200);
    assert_eq!(r["ok"], false, "{r:#}");
    let rc = &r["deltas"]["redis_conservation"];
    assert_eq!(rc["parts"]["records_missing"], 1, "{rc}");
    assert_eq!(ids(&rc["ids"]["records_missing"]), BTreeSet::from([victim.clone()]));
    // Redis alone: stock 0 + 2 records = 3 - 1: one unit unaccounted for.
    assert_eq!(rc["parts"]["units"], -1);
    assert_eq!(rc["value"], 2);
    assert_eq!(r["redis"]["records"], 2);
    // Nothing else is wrong: PostgreSQL holds every order.
    for kind in ["no_oversell", "one_per_buyer", "token_conservation", "ack_after_commit"] {
        assert_eq!(r["deltas"][kind]["value"], 0, "{kind}");
    }
    assert_eq!(r["problems"].as_array().unwrap().len(), 0, "{r:#}");

    // The CLI exits 1 and prints the same report; the periodic job exports the gap.
    let (status, printed) = cli(&engine, &["reconcile", "--activity", "71", "--sku", "72"]);
    assert_eq!((status, &printed["ok"]), (1, &Value::Bool(false)));
    assert_eq!(ids(&printed["deltas"]["redis_conservation"]["ids"]["records_missing"]).len(), 1);
    let line = "flashsale_inventory_conservation_delta{kind=\"redis_conservation\"}";
    wait_for_ms("the periodic job to see the gap", 10_000, || metric(&engine, line) == Some(2));
    assert_eq!(metric(&engine, "flashsale_reconcile_skus{result=\"not_ok\"}"), Some(1));
    // The report wrote nothing to Redis: the record is still gone.
    assert_eq!(redis_cmd(&engine.redis, &["EXISTS", &key]), "0");
    assert_postgres_invariants(&engine, 71, 72);
}

#[test]
fn a_token_forced_to_a_wrong_status_is_reported() {
    let engine = Engine::start_with(|c| c.worker = Some(small_worker(c)));
    engine.create_activity(81, 82, 4);
    assert_eq!(sale(&engine, 81, 82, 3).len(), 3);
    wait_settled(&engine, 81, 82, 3);
    assert_eq!(report(&engine, 81, 82).1["ok"], true);

    let (order_id, token_id) = pg(
        &engine,
        "SELECT order_id, inventory_token_id FROM orders ORDER BY order_id LIMIT 1",
        |rows| (rows[0].get::<_, String>(0), rows[0].get::<_, String>(1)),
    );
    let changed = pg_i64(
        &engine,
        &format!(
            "WITH u AS (UPDATE inventory_token SET status = 'AVAILABLE', reservation_id = NULL, \
             order_id = NULL WHERE token_id = '{token_id}' RETURNING 1) SELECT count(*) FROM u"
        ),
    );
    assert_eq!(changed, 1);

    let (status, r) = report(&engine, 81, 82);
    assert_eq!(status, 200);
    assert_eq!(r["ok"], false, "{r:#}");
    let d = &r["deltas"];
    assert_eq!(d["no_oversell"]["parts"]["orders_without_held_token"], 1, "{d:#}");
    assert_eq!(
        ids(&d["no_oversell"]["ids"]["orders_without_held_token"]),
        BTreeSet::from([order_id])
    );
    assert_eq!(d["token_conservation"]["parts"]["held_tokens_vs_live_orders"], -1);
    assert_eq!(r["postgres"]["invariants"]["tokens_available"], 2);
    let problems: Vec<&str> =
        r["problems"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    assert!(problems.iter().any(|p| p.starts_with("postgres: I1")), "{problems:?}");
    assert!(problems.iter().any(|p| p.starts_with("postgres: I3")), "{problems:?}");
    // Redis is untouched and still conserves its units.
    assert_eq!(d["redis_conservation"]["value"], 0);
    assert_eq!(cli(&engine, &["reconcile", "--activity", "81", "--sku", "82"]).0, 1);
}

#[test]
fn flushall_mid_sale_is_reported_and_postgres_still_shows_no_oversell() {
    // No other test of this binary loses Redis data, so the process-global switch touches
    // only this one.
    fail::cfg("negctl.redis_rebuild_off", "return").unwrap();
    let engine = Engine::start_with(|c| c.worker = Some(small_worker(c)));
    engine.create_activity(91, 92, 20);
    let reserved = sale(&engine, 91, 92, 10);
    assert_eq!(reserved.len(), 10);
    // Mid-sale: orders are still being written when Redis loses everything.
    assert_eq!(redis_cmd(&engine.redis, &["FLUSHALL"]), "OK");
    let mut c = HttpClient::connect(engine.http());
    let (_, after) = engine.submit(&mut c, 500, 91, 92, "after-flush");
    assert_eq!(after["reason_code"], "REDIS_DATA_LOST", "closed at once: {after}");
    wait_for_ms("every reservation final in PostgreSQL", 20_000, || {
        pg_i64(&engine, "SELECT count(*) FROM inventory_reservation WHERE status <> 'PROCESSING'")
            == 10
    });
    // Without the rebuild the SKU comes back with PostgreSQL's sellable units only.
    wait_for_ms("the SKU preheated again", 30_000, || {
        redis_cmd(&engine.redis, &["EXISTS", "seckill:{91:92}:meta"]) == "1"
    });

    let (status, r) = report(&engine, 91, 92);
    fail::remove("negctl.redis_rebuild_off");
    assert_eq!(status, 200);
    assert_eq!(r["ok"], false, "{r:#}");
    let rc = &r["deltas"]["redis_conservation"];
    assert_eq!(rc["parts"]["records_missing"], 10, "{rc:#}");
    let expected: BTreeSet<String> = reserved.iter().cloned().collect();
    assert_eq!(ids(&rc["ids"]["records_missing"]), expected);
    // Stock is what PostgreSQL can still sell; no record of who holds the other 10 units.
    assert_eq!(r["redis"]["stock"], 10);
    assert_eq!(r["redis"]["records"], 0);
    // PostgreSQL is the truth and still holds: 10 orders, no oversell, one per buyer.
    let d = &r["deltas"];
    for kind in ["no_oversell", "one_per_buyer", "token_conservation", "ack_after_commit"] {
        assert_eq!(d[kind]["value"], 0, "{kind}: {}", d[kind]);
    }
    assert_eq!(r["postgres"]["invariants"]["orders_live"], 10);
    assert_eq!(r["postgres"]["invariants"]["violations"].as_array().unwrap().len(), 0);
    assert_postgres_invariants(&engine, 91, 92);
    assert_eq!(cli(&engine, &["reconcile", "--activity", "91", "--sku", "92"]).0, 1);
}

/// Every PostgreSQL finding lists exactly the rows it counts (the audit's row sets are shared
/// with the listing), on a database broken by hand in every way its constraints allow.
/// A sale's tables outgrow their planner statistics within seconds (autovacuum's ANALYZE
/// naps a minute): the snapshot must stay linear on tables never analyzed. With nested loops
/// allowed, the reservations-without-inbox anti-join over 25,000 rows ran past this
/// statement timeout (quadratic; > 30 s in the demo for 23,624); without, it takes ~1 s.
#[tokio::test]
async fn the_postgres_snapshot_of_a_large_sku_is_linear_on_tables_never_analyzed() {
    use flashsale_pg_worker::reconcile::{reconcile_postgres, PgReconcileLimits};

    let db = flashsale_tests::pg_database().await;
    let (mut client, conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls).await.unwrap();
    let driver = tokio::spawn(conn);
    flashsale_pg_worker::migrate(&mut client).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO activity (activity_id, status, start_at, end_at, reservation_ttl_ms, \
               pay_timeout_ms) VALUES (7, 'ACTIVE', now(), now() + interval '1 hour', 300000, 900000); \
             INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator) \
               VALUES (7, 8, 1, 'TOKEN'); \
             INSERT INTO inventory_reservation (reservation_id, request_id, message_id, \
               activity_id, sku_id, user_id, status, reserved_at, expires_at) \
             SELECT 'resv_' || g, 'req-' || g, 'msg_' || g, 7, 8, g, 'REJECTED_NO_FINAL_STOCK', \
               now(), now() + interval '5 minutes' FROM generate_series(1, 25000) g; \
             INSERT INTO consumer_inbox (consumer_group, message_id, reservation_id) \
             SELECT 'order-writer', 'msg_' || g, 'resv_' || g FROM generate_series(1, 25000) g;",
        )
        .await
        .unwrap();
    flashsale_pg_worker::generate_tokens(&client, 7, 8, 1).await.unwrap();
    let limits = PgReconcileLimits {
        ids_listed_max: 10,
        reservations_max: 50_000,
        statement_timeout_ms: 10_000,
    };
    let started = std::time::Instant::now();
    let pg = reconcile_postgres(&mut client, 7, 8, limits).await.expect("within the timeout");
    println!("snapshot of 25,000 reservations, tables never analyzed: {:?}", started.elapsed());
    assert_eq!(
        (pg.reservations.len(), pg.inbox_rows, pg.reservations_without_inbox),
        (25_000, 25_000, 0)
    );
    drop(client);
    let _ = driver.await;
}

#[tokio::test]
async fn postgres_findings_list_exactly_the_rows_they_count() {
    use flashsale_pg_worker::reconcile::{reconcile_postgres, PgReconcileLimits};

    let db = flashsale_tests::pg_database().await;
    let (mut client, conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls).await.unwrap();
    let driver = tokio::spawn(conn);
    flashsale_pg_worker::migrate(&mut client).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO activity (activity_id, status, start_at, end_at, reservation_ttl_ms, \
               pay_timeout_ms) VALUES (5, 'ACTIVE', now(), now() + interval '1 hour', 300000, 900000); \
             INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator) \
               VALUES (5, 6, 3, 'TOKEN');",
        )
        .await
        .unwrap();
    flashsale_pg_worker::generate_tokens(&client, 5, 6, 3).await.unwrap();
    let reservation = |id: &str, user: i64, request: &str, status: &str, order: &str| {
        format!(
            "INSERT INTO inventory_reservation (reservation_id, request_id, message_id, \
               activity_id, sku_id, user_id, status, order_id, reserved_at, expires_at) \
             VALUES ('{id}', '{request}', 'msg_{id}', 5, 6, {user}, '{status}', \
               nullif('{order}', ''), now(), now() + interval '5 minutes');"
        )
    };
    let inbox = |id: &str| {
        format!(
            "INSERT INTO consumer_inbox (consumer_group, message_id, reservation_id) \
             VALUES ('order-writer', 'msg_{id}', '{id}');"
        )
    };
    let order = |id: &str, user: i64, resv: &str, token: &str| {
        format!(
            "INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, \
               reservation_id, inventory_token_id) \
             VALUES ('{id}', 5, 6, {user}, 'req-{user}', '{resv}', nullif('{token}', ''));"
        )
    };
    let sql = [
        // a: a sound order.
        reservation("resv_a", 10, "req-10", "ORDER_CREATED", "ord_a"),
        inbox("resv_a"),
        "UPDATE inventory_token SET status = 'CLAIMED', reservation_id = 'resv_a', \
         order_id = 'ord_a' WHERE token_id = 'tok_5_6_1';"
            .to_owned(),
        order("ord_a", 10, "resv_a", "tok_5_6_1"),
        "INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id, reservation_id, \
         kind) VALUES (5, 6, 'tok_5_6_1', 'ord_a', 'resv_a', 'CLAIM');"
            .to_owned(),
        // b: an order whose token is still AVAILABLE, and no inbox row.
        reservation("resv_b", 20, "req-20", "ORDER_CREATED", "ord_b"),
        order("ord_b", 20, "resv_b", "tok_5_6_2"),
        // A held token nobody's order holds.
        "UPDATE inventory_token SET status = 'CLAIMED', reservation_id = 'resv_x' \
         WHERE token_id = 'tok_5_6_3';"
            .to_owned(),
        // c, d: one request id, two reservations (the second recorded as the duplicate it is:
        // migration 0009's key allows no other); c committed PROCESSING.
        reservation("resv_c", 30, "req-dup", "PROCESSING", ""),
        inbox("resv_c"),
        reservation("resv_d", 30, "req-dup", "REJECTED_DUPLICATE_USER", ""),
        inbox("resv_d"),
        // e: ORDER_CREATED without its order.
        reservation("resv_e", 50, "req-50", "ORDER_CREATED", "ord_e"),
        inbox("resv_e"),
        // f: an order without an ORDER_CREATED reservation (and without a token).
        order("ord_f", 40, "resv_f", ""),
        // Three live orders for a stock of two.
        "UPDATE sku_inventory SET total_stock = 2 WHERE activity_id = 5 AND sku_id = 6;".to_owned(),
    ];
    client.batch_execute(&sql.concat()).await.unwrap();

    let limits =
        PgReconcileLimits { ids_listed_max: 10, reservations_max: 100, statement_timeout_ms: 0 };
    let pg = reconcile_postgres(&mut client, 5, 6, limits).await.unwrap();
    let listed = |name: &str| -> BTreeSet<String> {
        pg.ids.get(name).map(|s| s.ids.iter().cloned().collect()).unwrap_or_default()
    };
    let set = |ids: &[&str]| -> BTreeSet<String> { ids.iter().map(|s| (*s).to_owned()).collect() };
    assert_eq!(listed("orders_without_held_token"), set(&["ord_b", "ord_f"]));
    assert_eq!(listed("held_tokens_without_order"), set(&["tok_5_6_3"]));
    assert_eq!(listed("reservations_processing"), set(&["resv_c"]));
    assert_eq!(listed("created_reservations_without_order"), set(&["resv_e"]));
    assert_eq!(listed("orders_without_created_reservation"), set(&["ord_f"]));
    assert_eq!(listed("reservations_without_inbox"), set(&["resv_b"]));
    assert_eq!(listed("duplicate_requests"), set(&["resv_c", "resv_d"]));
    assert_eq!(listed("orders_over_stock"), set(&["ord_f"]));
    // What the constraints make impossible is counted 0 and listed nowhere.
    for name in ["tokens_shared", "duplicate_buyers", "duplicate_claims"] {
        assert!(listed(name).is_empty(), "{name}");
    }
    // Each audit count equals the rows its listing found (one row set, two uses).
    let counts = serde_json::to_value(&pg.invariants).unwrap();
    for (name, _) in flashsale_pg_worker::audit::FINDINGS {
        let count = counts[name].as_u64().unwrap() as usize;
        assert_eq!(count, listed(name).len(), "{name}");
    }
    assert_eq!((pg.reservations_without_inbox, pg.duplicate_requests), (1, 1));
    assert_eq!(pg.inbox_rows, 4);
    assert_eq!(pg.orders_by_status.get("PENDING_PAYMENT"), Some(&3));
    assert_eq!(pg.ledger_by_kind.get("CLAIM"), Some(&1));
    assert_eq!(pg.reservations.len(), 5);
    assert!(!pg.reservations_truncated);
    let b = pg.reservations.iter().find(|r| r.reservation_id == "resv_b").unwrap();
    assert_eq!(b.order_status.as_deref(), Some("PENDING_PAYMENT"));
    assert!(b.order_live());
    // The audit's verdict sees the same breaches.
    assert!(pg.invariants.violations.iter().any(|v| v.starts_with("I1 oversell")), "{pg:?}");
    assert!(pg.invariants.violations.iter().any(|v| v.contains("PROCESSING")));
    // Bounded: one id per finding listed, the rest announced.
    let one =
        PgReconcileLimits { ids_listed_max: 1, reservations_max: 2, statement_timeout_ms: 5_000 };
    let pg = reconcile_postgres(&mut client, 5, 6, one).await.unwrap();
    let sample = &pg.ids["orders_without_held_token"];
    assert_eq!((sample.ids.len(), sample.truncated), (1, true));
    assert_eq!((pg.reservations.len(), pg.reservations_truncated), (2, true));
    drop(client);
    let _ = driver.await;
}

/// While orders are being written, every report is ok: reservations between the stores are
/// in flight, not gaps (PostgreSQL is read before Redis, Redis' memberships before statuses,
/// a moving stock is allowed its drift, outcomes newer than the snapshot are re-read).
#[test]
fn a_live_sale_reconciles_ok_at_every_moment() {
    let engine = Engine::start_with(|c| c.worker = Some(small_worker(c)));
    engine.create_activity(101, 102, 150);
    let admin = engine.admin();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut reports = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let resp = HttpClient::connect(admin).request(
                    "GET",
                    "/admin/v1/activities/101/skus/102/reconcile",
                    None,
                    None,
                );
                assert_eq!(resp.status, 200, "{}", resp.body);
                reports.push(resp.json());
            }
            reports
        })
    };
    let reserved = sale(&engine, 101, 102, 200);
    assert_eq!(reserved.len(), 150);
    wait_settled(&engine, 101, 102, 150);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reports = watcher.join().unwrap();
    assert!(reports.len() >= 3, "only {} reports during the sale", reports.len());
    let mut saw_in_flight = false;
    for r in &reports {
        assert_eq!(r["ok"], true, "a gap reported during a healthy sale: {r:#}");
        saw_in_flight |= r["in_flight"]["reservations"].as_u64().unwrap() > 0;
    }
    assert!(saw_in_flight, "no report caught a reservation in flight ({} reports)", reports.len());
    let (_, last) = report(&engine, 101, 102);
    assert_eq!(last["ok"], true, "{last:#}");
    assert_all_deltas_zero(&last);
    assert_eq!(last["redis"]["stock"], 0);
    assert_postgres_invariants(&engine, 101, 102);
}

/// A buyer's cancel and a pay-timeout close each compensate their reservation in Redis with
/// `ORDER_CANCELLED`; reconcile must count those units exactly, not report a gap (it did: the
/// marker's reason was unknown to it, and every later round said not ok).
#[test]
fn a_cancelled_and_a_closed_order_reconcile_ok_with_exact_counts() {
    use flashsale_io::key::HmacKey;
    use flashsale_io::payment::Signed;
    const PAY_KEY: &str = "00112233445566778899aabbccddeeff";
    let engine = Engine::start_with(|c| {
        let mut worker = small_worker(c);
        worker.closer.interval_ms = 100;
        // Buyer 2's order is closed at its timeout without a provider: the explicit opt-in.
        worker.closer.without_provider =
            flashsale_pg_worker::payments::WithoutProvider::CloseUnverified;
        c.worker = Some(worker);
        c.edge.payment_key = Some(HmacKey::from_hex(PAY_KEY).unwrap());
    });
    let (a, s) = (71, 72);
    let body = format!(r#"{{"activity_id":{a},"sku_id":{s},"stock":4,"pay_timeout_ms":4000}}"#);
    engine.create_activity_with(&body);
    assert_eq!(sale(&engine, a, s, 4).len(), 4);
    wait_settled(&engine, a, s, 4);
    let order_of = |user: i64| {
        pg(&engine, &format!("SELECT order_id FROM orders WHERE user_id = {user}"), |rows| {
            rows[0].get::<_, String>(0)
        })
    };
    let mut c = HttpClient::connect(engine.http());
    // Buyer 1 cancels; buyers 3 and 4 pay; buyer 2 does nothing and is closed at its timeout.
    let pass = engine.pass(1, a);
    let path = format!("/v1/orders/{}/cancel?activity_id={a}", order_of(1));
    let cancelled = c.request("POST", &path, Some(&pass), None);
    assert_eq!((cancelled.status, state(&cancelled.json())), (200, "CANCELLED"));
    let key = HmacKey::from_hex(PAY_KEY).unwrap();
    for user in [3, 4] {
        let order_id = order_of(user);
        let signed =
            Signed { payment_id: "p", order_id: &order_id, status: "PAID", amount_cents: 5 };
        let sig = Signed { payment_id: &format!("pay_{user}"), ..signed }.sign(&key);
        let body = format!(
            r#"{{"payment_id":"pay_{user}","order_id":"{order_id}","status":"PAID","amount_cents":5,"signature":"{sig}"}}"#
        );
        let paid = c.request("POST", "/v1/payments/callback", None, Some(&body));
        assert_eq!(paid.status, 200, "{}", paid.body);
    }
    wait_for_ms("buyer 2's order closed", 20_000, || {
        pg_i64(&engine, "SELECT count(*) FROM orders WHERE status = 'CLOSED'") == 1
    });
    let stock_key = format!("seckill:{{{a}:{s}}}:stock");
    wait_for_ms("both units back in Redis", 20_000, || {
        redis_cmd(&engine.redis, &["GET", &stock_key]) == "2"
    });
    let (status, r) = report(&engine, a, s);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["ok"], true, "{r:#}");
    assert_all_deltas_zero(&r);
    assert_eq!(r["in_flight"]["repair"], 0);
    let p = &r["postgres"];
    assert_eq!(p["orders_by_status"]["CANCELLED"], 1);
    assert_eq!(p["orders_by_status"]["CLOSED"], 1);
    assert_eq!(p["orders_by_status"]["PAID"], 2);
    let rd = &r["redis"];
    assert_eq!(rd["stock"], 2);
    assert_eq!(rd["records_by_status"]["COMPENSATED"], 2);
    assert_eq!(rd["records_by_status"]["ORDER_CREATED"], 2);
    assert_eq!((rd["units_held"].as_i64(), rd["units_delta_raw"].as_i64()), (Some(2), Some(0)));
    assert_eq!(rd["compensation_markers"], 2);
    assert_eq!(rd["compensation_stock_returned"], 2);
    assert_postgres_invariants(&engine, a as i64, s as i64);
}
