//! Bad input never takes the sale down (issue 23), against a real engine, Redis, NATS and
//! PostgreSQL: each finding of the attack pass as the test that failed before its fix.
//!
//! - 64-bit buyer ids are sold to, and a value a store refuses never opens a circuit;
//! - a silent flood of the admin port neither locks the operators out nor fails `/livez`;
//! - a connection that never sends a byte is closed at the header deadline, on both planes;
//! - create-activity refuses what any store would refuse before writing anything, and a
//!   create that failed on a transient Redis outage completes when retried;
//! - a property test over admin bodies and passes' numeric fields: a 4xx or a real answer,
//!   never a 5xx, never a circuit opened.

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use flashsale_engine::logic::ids::{ActivityId, UserId};
use flashsale_tests::{connect_from, metric, state, wait_for_ms, Engine, HttpClient};
use proptest::prelude::*;

fn submit_as(
    engine: &Engine,
    c: &mut HttpClient,
    user: u64,
    sku: (u64, u64),
    id: &str,
) -> (u16, serde_json::Value) {
    engine.submit(c, user, sku.0, sku.1, id)
}

fn redis_circuit(engine: &Engine) -> u64 {
    metric(&engine.metrics(), "flashsale_circuit_state{dependency=\"redis\"}")
}

/// Before the fix: buyer 1,000,000,000,000,000 (16 digits) was refused by the Lua library,
/// the refusal counted as a Redis failure, and after five of them every buyer of the shard
/// got `503 SYSTEM_BUSY REDIS_UNAVAILABLE`.
#[test]
fn sixty_four_bit_buyers_are_sold_to_and_never_close_the_shard() {
    let engine = Engine::start_with(|c| c.shards = 1);
    engine.create_activity(9001, 9002, 100);
    let mut c = HttpClient::connect(engine.http());
    let big = [1_000_000_000_000_000u64, 1_234_567_890_123_456_789, i64::MAX as u64];
    for (i, &user) in big.iter().enumerate() {
        let (status, v) = submit_as(&engine, &mut c, user, (9001, 9002), &format!("big-{i}"));
        assert_eq!((status, state(&v)), (202, "QUEUED"), "user {user}: {v}");
        // The same buyer again and again (new request ids): his one reservation, never a 503.
        for n in 0..8 {
            let (status, v) =
                submit_as(&engine, &mut c, user, (9001, 9002), &format!("big-{i}-{n}"));
            assert_eq!((status, state(&v)), (200, "DUPLICATE_USER"), "user {user}: {v}");
        }
        let (status, v) = engine.query(&mut c, user, 9001, 9002, &format!("big-{i}"));
        assert_eq!(status, 200, "{v}");
    }
    assert_eq!(redis_circuit(&engine), 0, "the Redis circuit stayed closed");
    for user in 1..=20 {
        let (status, v) = submit_as(&engine, &mut c, user, (9001, 9002), &format!("small-{user}"));
        assert_eq!((status, state(&v)), (202, "QUEUED"), "other buyers are served: {v}");
    }
    // Passes whose user id no store can hold are refused at the edge (401), not by a store.
    let beyond = engine.keys.mint("k1", UserId(u64::MAX), ActivityId(9001), unix_s() + 600);
    let beyond = beyond.unwrap();
    let body = r#"{"activity_id":9001,"sku_id":9002,"request_id":"x","quantity":1}"#;
    let resp = c.request("POST", "/v1/reservations", Some(&beyond), Some(body));
    assert_eq!(resp.status, 401, "{}", resp.body);
    assert_eq!(redis_circuit(&engine), 0);
    engine.assert_invariants(9001, 9002);
}

fn unix_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

fn loopback(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

/// `count` connections from `from` that never send a byte (held open by the returned vec).
fn silent(from: IpAddr, to: SocketAddr, count: usize) -> Vec<TcpStream> {
    (0..count)
        .filter_map(|_| {
            let socket =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
            socket.bind(&SocketAddr::new(from, 0).into()).ok()?;
            socket.connect(&to.into()).ok()?;
            Some(socket.into())
        })
        .collect()
}

fn livez_from(from: IpAddr, admin: SocketAddr) -> Option<u16> {
    let mut c = connect_from(from, admin);
    c.try_request("GET", "/livez", None, None).map(|r| r.status)
}

/// Before the fix: 64 silent connections held the admin port for the 60 s idle timeout, and
/// `/livez` failed for everyone (a liveness probe then restarts a healthy engine mid-sale).
/// Now: one address holds at most its share, connections beyond the budget are served health
/// probes (evicting silent ones), and a silent connection is closed at the header deadline.
#[test]
fn a_silent_flood_of_the_admin_port_never_fails_livez_or_locks_operators_out() {
    let engine = Engine::start_with(|c| {
        c.shards = 1;
        c.edge.header_read_timeout_ms = 2_000;
    });
    let admin = engine.admin();
    // One address, far over its share and the whole budget.
    let one = silent(loopback(1), admin, 200);
    assert_eq!(livez_from(loopback(2), admin), Some(200), "another address is served at once");
    let mut operator = connect_from(loopback(3), admin);
    assert_eq!(operator.request("GET", "/metrics", None, None).status, 200, "operators get in");
    // Many addresses, together over the budget and every probe slot: probes still answer.
    let many: Vec<Vec<TcpStream>> = (10..30).map(|a| silent(loopback(a), admin, 16)).collect();
    for probe in 0..20 {
        assert_eq!(livez_from(loopback(4), admin), Some(200), "probe {probe} under the flood");
    }
    // A request other than a probe on a probe slot is refused at once, not queued.
    let mut extra = connect_from(loopback(40), admin);
    let busy = extra.try_request("GET", "/metrics", None, None).map(|r| r.status);
    assert!(matches!(busy, Some(503) | None), "{busy:?}");
    // Every silent connection is closed at the header deadline, not the idle timeout.
    let started = Instant::now();
    for mut stream in one.into_iter().chain(many.into_iter().flatten()) {
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 64];
        assert!(matches!(stream.read(&mut buf), Ok(0) | Err(_)), "closed by the engine");
    }
    assert!(started.elapsed() < Duration::from_secs(8), "within the 2 s header deadline");
    assert_eq!(livez_from(loopback(2), admin), Some(200));
}

/// Before the fix a public connection that never sent a byte was held for the 60 s idle
/// timeout: one /56 of IPv6 could hold a shard's 16,384 slots, renewed every minute.
#[test]
fn a_public_connection_that_never_sends_a_byte_is_closed_at_the_header_deadline() {
    let engine = Engine::start_with(|c| {
        c.shards = 1;
        c.edge.header_read_timeout_ms = 1_000;
    });
    let started = Instant::now();
    let mut stream = TcpStream::connect(engine.http()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut buf = [0u8; 64];
    assert!(matches!(stream.read(&mut buf), Ok(0) | Err(_)));
    let held = started.elapsed();
    assert!(held >= Duration::from_millis(900) && held < Duration::from_secs(10), "{held:?}");
    let m = engine.metrics();
    assert_eq!(metric(&m, "flashsale_connection_timeouts_total{phase=\"first_byte\"}"), 1);
    // A keep-alive connection after its first answer keeps the idle timeout.
    let mut c = HttpClient::connect(engine.http());
    assert_eq!(c.request("GET", "/nope", None, None).status, 404);
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(c.request("GET", "/nope", None, None).status, 404, "idle, not first-byte");
}

fn create(engine: &Engine, body: &str) -> (u16, serde_json::Value) {
    let resp = HttpClient::connect(engine.admin()).request(
        "POST",
        "/admin/v1/activities",
        None,
        Some(body),
    );
    (resp.status, resp.json())
}

/// Before the fix: `reservation_ttl_ms` = i64::MAX committed the rows and tokens, then
/// answered 503 forever (Redis refused it) and burned the id; an `end_at_ms` past PostgreSQL's
/// timestamps was a 503 `POSTGRES_UNAVAILABLE`; a stock over the token table's bound too.
#[test]
fn create_activity_refuses_what_any_store_would_before_writing_and_a_retry_completes() {
    let mut engine = Engine::start();
    let refused = [
        (r#""reservation_ttl_ms":9223372036854775807"#, "TIMEOUT_INVALID"),
        (r#""reservation_ttl_ms":86400001"#, "TIMEOUT_INVALID"),
        (r#""pay_timeout_ms":604800001"#, "TIMEOUT_INVALID"),
        (r#""end_at_ms":92000000000000000"#, "WINDOW_INVALID"),
        (r#""start_at_ms":253402300800000,"end_at_ms":253402300800001"#, "WINDOW_INVALID"),
        (r#""price_cents":-1"#, "PRICE_INVALID"),
        (r#""price_cents":1000000000001"#, "PRICE_INVALID"),
    ];
    for (field, reason) in refused {
        let body = format!(r#"{{"activity_id":7001,"sku_id":1,"stock":5,{field}}}"#);
        let (status, v) = create(&engine, &body);
        assert_eq!((status, v["reason_code"].as_str()), (400, Some(reason)), "{body}: {v}");
    }
    let (status, v) = create(&engine, r#"{"activity_id":7001,"sku_id":1,"stock":1000001}"#);
    assert_eq!((status, v["reason_code"].as_str()), (400, Some("STOCK_INVALID")), "{v}");
    assert_eq!(engine.pg_count("SELECT count(*) FROM activity"), 0, "nothing written");

    // The id is not burned: the valid body creates it.
    let body = r#"{"activity_id":7001,"sku_id":1,"stock":5,"price_cents":1500}"#;
    let (status, v) = create(&engine, body);
    assert_eq!(
        (status, v["status"].as_str(), v["price_cents"].as_i64()),
        (201, Some("ACTIVE"), Some(1500)),
        "{v}"
    );

    // A transient Redis outage between the PostgreSQL rows and the preheat: 503, and the
    // same body completes the activation once Redis is back.
    engine.redis.kill();
    let body = r#"{"activity_id":7002,"sku_id":1,"stock":5}"#;
    let (status, v) = create(&engine, body);
    assert_eq!((status, v["reason_code"].as_str()), (503, Some("REDIS_UNAVAILABLE")), "{v}");
    engine.redis.restart();
    wait_for_ms("the same body completes the create", 20_000, || create(&engine, body).0 == 200);
    let sku = HttpClient::connect(engine.admin()).request(
        "GET",
        "/admin/v1/activities/7002/skus/1",
        None,
        None,
    );
    assert_eq!((sku.status, sku.json()["status"].as_str()), (200, Some("ACTIVE")), "{}", sku.body);
}

/// Lifecycle paths take only the canonical spelling of an id; a top-up request id may not
/// carry control characters; DLQ sequence 0 is not found, not a log failure.
#[test]
fn admin_paths_and_free_text_take_one_spelling_and_no_control_characters() {
    let engine = Engine::start();
    engine.create_activity(30001, 1, 5);
    let mut a = HttpClient::connect(engine.admin());
    for path in ["/admin/v1/activities/+30001/end", "/admin/v1/activities/030001/end"] {
        assert_eq!(a.request("POST", path, None, Some("{}")).status, 404, "{path}");
    }
    let body = "{\"add\":1,\"request_id\":\"t\\u0007-1\"}";
    let resp = a.request("POST", "/admin/v1/activities/30001/skus/1/stock", None, Some(body));
    assert_eq!(
        (resp.status, resp.json()["reason_code"].as_str()),
        (400, Some("REQUEST_ID_INVALID"))
    );
    let resp = a.request("POST", "/admin/v1/dlq/0", None, Some(r#"{"action":"discard"}"#));
    assert_eq!(
        (resp.status, resp.json()["reason_code"].as_str()),
        (404, Some("NO_SUCH_DEAD_LETTER"))
    );
    assert_eq!(a.request("GET", "/admin/v1/activities/30001/skus/01", None, None).status, 404);
}

// ---- property test: bad numbers never reach a store as a failure ---------------------------

/// Numbers at and around every bound a store has.
fn edgy_i64() -> impl Strategy<Value = i64> {
    prop_oneof![
        Just(0i64),
        Just(1),
        Just(-1),
        Just(i64::MAX),
        Just(i64::MIN),
        Just(86_400_000),
        Just(86_400_001),
        Just(253_402_300_799_999),
        Just(253_402_300_800_000),
        Just(999_999_999_999_999),
        Just(1_000_000_000_000_000),
        Just(1_000_000),
        Just(1_000_001),
        any::<i64>(),
        0i64..10_000,
    ]
}

fn field(name: &str, value: Option<i64>) -> String {
    value.map(|v| format!(",\"{name}\":{v}")).unwrap_or_default()
}

/// The bounds themselves are valid: an activity that ends in the last millisecond of year
/// 9999 (`TIME_MS_MAX`) is created and stored exactly (found by the property test below:
/// `to_timestamp(ms / 1000.0)` rounded it 8 µs past the column's CHECK, a 503).
#[test]
fn an_activity_ending_at_the_time_bound_is_created_exactly() {
    let engine = Engine::start_with(|c| c.shards = 1);
    let end = flashsale_io::bounds::TIME_MS_MAX;
    let body = format!(r#"{{"activity_id":5101,"sku_id":1,"stock":0,"end_at_ms":{end}}}"#);
    let (status, v) = create(&engine, &body);
    assert_eq!(status, 201, "{v}");
    let stored = engine.pg_count(
        "SELECT (extract(epoch FROM end_at) * 1000)::int8 FROM activity WHERE activity_id = 5101",
    );
    assert_eq!(stored as u64, end);
}

/// Any numbers in a create-activity body, any ids in a valid pass and body: a 4xx or a real
/// answer, never a 5xx, never a circuit opened (one engine for every case: a seeded
/// `TestRunner` rather than `proptest!`, whose cases would each need their own servers).
#[test]
fn numbers_at_every_bound_answer_4xx_or_a_real_answer_never_5xx() {
    let engine = Engine::start_with(|c| c.shards = 1);
    engine.create_activity(5001, 1, 1_000);
    let config =
        ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() };
    let mut runner = proptest::test_runner::TestRunner::new(config.clone());
    let optional = || proptest::option::of(edgy_i64());
    let bodies = (
        edgy_i64(),
        edgy_i64(),
        edgy_i64(),
        optional(),
        optional(),
        optional(),
        optional(),
        optional(),
    );
    runner
        .run(&bodies, |(activity, sku, stock, start, end, ttl, pay, price)| {
            // Valid stocks stay small (tokens are created per unit); the bound is covered above.
            let stock_max = flashsale_io::bounds::STOCK_MAX as i64;
            let stock = if (0..=stock_max).contains(&stock) { stock.min(50) } else { stock };
            let body = format!(
                "{{\"activity_id\":{activity},\"sku_id\":{sku},\"stock\":{stock}{}{}{}{}{}}}",
                field("start_at_ms", start),
                field("end_at_ms", end),
                field("reservation_ttl_ms", ttl),
                field("pay_timeout_ms", pay),
                field("price_cents", price),
            );
            let (status, v) = create(&engine, &body);
            prop_assert!(matches!(status, 200 | 201 | 400 | 409), "{} -> {} {}", body, status, v);
            prop_assert_eq!(redis_circuit(&engine), 0);
            Ok(())
        })
        .unwrap();

    let mut runner = proptest::test_runner::TestRunner::new(config);
    let max = i64::MAX as u64;
    let users = prop_oneof![Just(1u64), Just(max), Just(1_000_000_000_000_000), 1u64..=max];
    let skus = prop_oneof![Just(1u64), Just(2), Just(max)];
    let c = std::cell::RefCell::new(HttpClient::connect(engine.http()));
    runner
        .run(&(users, any::<bool>(), skus), |(user, on_sale, sku)| {
            let activity = if on_sale { 5001 } else { 5002 };
            let pass = engine.keys.mint("k1", UserId(user), ActivityId(activity), unix_s() + 600);
            let body = format!(
                r#"{{"activity_id":{activity},"sku_id":{sku},"request_id":"p-{user}","quantity":1}}"#
            );
            let resp =
                c.borrow_mut().request("POST", "/v1/reservations", pass.as_deref(), Some(&body));
            prop_assert!(resp.status < 500, "{} -> {} {}", body, resp.status, resp.body);
            prop_assert_eq!(redis_circuit(&engine), 0);
            Ok(())
        })
        .unwrap();
    engine.assert_invariants(5001, 1);
}
