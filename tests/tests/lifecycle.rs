//! An activity's life after its creation (CONTRACT.md section 4, `shard/lifecycle.rs`,
//! `pg-worker/src/lifecycle.rs`), through `flashsale admin activity ...` (`admin_cli::run`)
//! against real Redis, NATS and PostgreSQL: several SKUs per activity, stock topped up (the
//! sold-out flag clears), the release policy set, a SKU ended, a SKU and an activity
//! terminated while reservations are in flight. Every change is recorded with its actor, every
//! call is idempotent, and every SKU reconciles at the end.

use flashsale_tests::{serve_config, small_worker, state, wait_for_ms, Engine, HttpClient};

fn wait_state(
    engine: &Engine,
    c: &mut HttpClient,
    user: u64,
    (a, s): (u64, u64),
    id: &str,
    want: &str,
) {
    wait_for_ms(&format!("{id} becomes {want}"), 20_000, || {
        let (_, v) = engine.query(c, user, a, s, id);
        state(&v) == want
    });
}

#[test]
fn skus_are_added_topped_up_and_the_release_policy_set_idempotently() {
    let engine = Engine::start_with(|c| c.worker = Some(small_worker(c)));
    let (a, first, second) = (101u64, 1011u64, 1012u64);
    engine.create_activity(a, first, 2);
    let (at, s2) = (a.to_string(), second.to_string());
    let add = |stock: &str| {
        engine.admin_cli(&[
            "activity",
            "add-sku",
            "--activity",
            &at,
            "--sku",
            &s2,
            "--stock",
            stock,
        ])
    };
    let (status, out) = add("3");
    assert_eq!((status, out["applied"].as_bool()), (Ok(0), Some(true)), "{out}");
    assert_eq!(out["skus"][0]["total_stock"], 3, "{out}");
    let (status, out) = add("3");
    assert_eq!((status, out["applied"].as_bool()), (Ok(0), Some(false)), "same body: {out}");
    let (status, out) = add("4");
    assert_eq!((status, out["reason_code"].as_str()), (Ok(1), Some("EXISTS_WITH_OTHER_BODY")));
    // The activity's first SKU, created with it, is the same SKU under the same values.
    let f = first.to_string();
    let (status, out) =
        engine.admin_cli(&["activity", "add-sku", "--activity", &at, "--sku", &f, "--stock", "2"]);
    assert_eq!((status, out["applied"].as_bool()), (Ok(0), Some(false)), "{out}");
    let (status, out) = engine.admin_cli(&[
        "activity",
        "add-sku",
        "--activity",
        "999",
        "--sku",
        "1",
        "--stock",
        "1",
    ]);
    assert_eq!((status, out["reason_code"].as_str()), (Ok(1), Some("NO_SUCH_ACTIVITY")));

    // Both SKUs sell; the second sells out.
    let mut c = HttpClient::connect(engine.http());
    for user in 1..=2u64 {
        let (_, v) = engine.submit(&mut c, user, a, first, &format!("f-{user}"));
        assert_eq!(state(&v), "QUEUED", "{v}");
    }
    for user in 1..=3u64 {
        let (_, v) = engine.submit(&mut c, user, a, second, &format!("s-{user}"));
        assert_eq!(state(&v), "QUEUED", "{v}");
    }
    let (_, v) = engine.submit(&mut c, 4, a, second, "s-4");
    assert_eq!(state(&v), "SOLD_OUT", "{v}");
    for user in 1..=3u64 {
        wait_state(&engine, &mut c, user, (a, second), &format!("s-{user}"), "SUCCEEDED");
    }

    // Topped up by 2, once, however often the same request is sent.
    let top_up = |add: &str| {
        engine.admin_cli(&[
            "activity",
            "top-up",
            "--activity",
            &at,
            "--sku",
            &s2,
            "--add",
            add,
            "--request-id",
            "t-1",
        ])
    };
    let (status, out) = top_up("2");
    assert_eq!((status, out["applied"].as_bool()), (Ok(0), Some(true)), "{out}");
    assert_eq!(out["skus"][0]["total_stock"], 5, "{out}");
    let (status, out) = top_up("2");
    assert_eq!((status, out["applied"].as_bool()), (Ok(0), Some(false)), "a retry: {out}");
    let (status, out) = top_up("7");
    assert_eq!((status, out["reason_code"].as_str()), (Ok(1), Some("EXISTS_WITH_OTHER_BODY")));
    assert_eq!(engine.redis_stock(a, second), 2, "the two new units, once");
    // The sold-out flag clears on whichever shard a buyer lands (a new connection each).
    let mut user = 10u64;
    let mut queued = Vec::new();
    wait_for_ms("the two new units sold", 10_000, || {
        user += 1;
        let mut fresh = HttpClient::connect(engine.http());
        let id = format!("s-{user}");
        let (_, v) = engine.submit(&mut fresh, user, a, second, &id);
        if state(&v) == "QUEUED" {
            queued.push((user, id));
        }
        queued.len() == 2
    });
    let (_, v) = engine.submit(&mut c, 99, a, second, "s-99");
    assert_eq!(state(&v), "SOLD_OUT", "exactly two more: {v}");
    for (user, id) in &queued {
        wait_state(&engine, &mut c, *user, (a, second), id, "SUCCEEDED");
    }
    assert_eq!(engine.pg_count(&format!("SELECT count(*) FROM orders WHERE sku_id = {second}")), 5);
    assert_eq!(
        engine.pg_count(&format!("SELECT count(*) FROM inventory_token WHERE sku_id = {second}")),
        5
    );

    // The release policy.
    let policy = |p: &str| {
        engine.admin_cli(&["activity", "release-policy", "--activity", &at, "--policy", p])
    };
    let (status, out) = policy("RELEASED");
    assert_eq!((status, out["applied"].as_bool()), (Ok(0), Some(true)), "{out}");
    assert_eq!(out["skus"][0]["release_policy"], "RELEASED", "{out}");
    assert_eq!(policy("RELEASED").1["applied"], false);
    let (status, out) = policy("SOMETIMES");
    assert_eq!((status, out["reason_code"].as_str()), (Ok(1), Some("RELEASE_POLICY_INVALID")));

    // Who and when: one row per applied change, none for the repeats.
    let changes = |action: &str| {
        engine.pg_count(&format!(
            "SELECT count(*) FROM activity_change WHERE activity_id = {a} AND action = '{action}' \
             AND actor = 'flashsale-admin' AND created_at > now() - interval '5 minutes'"
        ))
    };
    assert_eq!((changes("add_sku"), changes("top_up"), changes("release_policy")), (1, 1, 1));
    engine.assert_reconciled(a, first);
    engine.assert_reconciled(a, second);
}

#[test]
fn an_ended_sku_keeps_its_reservations_and_terminated_ones_are_returned() {
    // No order-writer until every change is made: the reservations are in flight throughout.
    let engine = Engine::start();
    let (a, ended, terminated) = (201u64, 2011u64, 2012u64);
    let (whole, whole_sku) = (301u64, 3011u64);
    engine.create_activity(a, ended, 5);
    let at = a.to_string();
    let (status, out) = engine.admin_cli(&[
        "activity",
        "add-sku",
        "--activity",
        &at,
        "--sku",
        &terminated.to_string(),
        "--stock",
        "5",
    ]);
    assert_eq!(status, Ok(0), "{out}");
    engine.create_activity(whole, whole_sku, 5);
    let mut c = HttpClient::connect(engine.http());
    let skus = [(a, ended), (a, terminated), (whole, whole_sku)];
    for (activity, sku) in skus {
        for user in 1..=2u64 {
            let (_, v) = engine.submit(&mut c, user, activity, sku, &format!("r-{sku}-{user}"));
            assert_eq!(state(&v), "QUEUED", "{v}");
        }
    }

    let (e, t) = (ended.to_string(), terminated.to_string());
    let (status, out) = engine.admin_cli(&["activity", "end", "--activity", &at, "--sku", &e]);
    assert_eq!((status, out["applied"].as_bool()), (Ok(0), Some(true)), "{out}");
    assert_eq!(out["skus"][0]["status"], "ENDED", "{out}");
    let (status, out) = engine.admin_cli(&["activity", "end", "--activity", &at, "--sku", &e]);
    assert_eq!((status, out["applied"].as_bool()), (Ok(0), Some(false)), "{out}");
    let (status, out) =
        engine.admin_cli(&["activity", "terminate", "--activity", &at, "--sku", &t]);
    assert_eq!((status, out["skus"][0]["status"].as_str()), (Ok(0), Some("TERMINATED")), "{out}");
    let (status, out) = engine.admin_cli(&["activity", "end", "--activity", &at, "--sku", &t]);
    assert_eq!((status, out["reason_code"].as_str()), (Ok(1), Some("ACTIVITY_TERMINATED")));
    let (status, out) =
        engine.admin_cli(&["activity", "terminate", "--activity", &whole.to_string()]);
    assert_eq!((status, out["skus"][0]["status"].as_str()), (Ok(0), Some("TERMINATED")), "{out}");
    // The sibling SKU of the terminated one is untouched.
    assert_eq!(
        engine.pg_count(&format!(
            "SELECT count(*) FROM sku_inventory WHERE activity_id = {a} AND status = 'ACTIVE'"
        )),
        0,
        "one ended, one terminated"
    );

    // No new submission on any of them.
    for (activity, sku) in skus {
        wait_for_ms("new submissions refused", 5_000, || {
            let mut fresh = HttpClient::connect(engine.http());
            let (_, v) = engine.submit(&mut fresh, 50, activity, sku, &format!("late-{sku}"));
            assert_ne!(state(&v), "QUEUED", "a reservation after the change: {v}");
            state(&v) == "ACTIVITY_NOT_ACTIVE"
        });
    }

    // Now the order-writer: the ended SKU's reservations become orders, the terminated ones'
    // are rejected and their units returned.
    let config = serve_config(engine.redis.addr(), &engine.nats.url(), &engine.db.url);
    let worker = flashsale_pg_worker::worker::start(small_worker(&config)).expect("worker starts");
    for user in 1..=2u64 {
        wait_state(&engine, &mut c, user, (a, ended), &format!("r-{ended}-{user}"), "SUCCEEDED");
        for (activity, sku) in [(a, terminated), (whole, whole_sku)] {
            let id = format!("r-{sku}-{user}");
            wait_state(&engine, &mut c, user, (activity, sku), &id, "FAILED");
            let (_, v) = engine.query(&mut c, user, activity, sku, &id);
            assert_eq!(v["reason_code"], "ACTIVITY_TERMINATED", "{v}");
        }
    }
    wait_for_ms("terminated units back in Redis", 10_000, || {
        engine.redis_stock(a, terminated) == 5 && engine.redis_stock(whole, whole_sku) == 5
    });
    worker.shutdown().expect("worker stops");
    assert_eq!(engine.redis_stock(a, ended), 3);
    let orders =
        |sku: u64| engine.pg_count(&format!("SELECT count(*) FROM orders WHERE sku_id = {sku}"));
    assert_eq!((orders(ended), orders(terminated), orders(whole_sku)), (2, 0, 0));
    let changes = engine.pg_count(&format!(
        "SELECT count(*) FROM activity_change WHERE activity_id IN ({a}, {whole}) \
         AND action IN ('end', 'terminate')"
    ));
    assert_eq!(changes, 3, "one row per applied change");
    for (activity, sku) in skus {
        engine.assert_reconciled(activity, sku);
    }
}
