//! Several engine instances on one set of stores (DESIGN.md section 11): two in-process
//! `flashsale serve` on ports of their own over one Redis, one NATS JetStream and one
//! PostgreSQL database, as they run behind an L4 balancer.

use std::time::{Duration, Instant};

use flashsale_engine::logic::ids::InstanceId;
use flashsale_engine::logic::modes::{control_key, sign, Mode, ModeSnapshot, Scope};
use flashsale_tests::{
    metric, redis_cmd, serve_config, small_worker, state, wait_for_ms, Engine, Haproxy, HttpClient,
    Peer,
};

const CONTROL: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

fn signed(version: u64, mode: Mode, issuer: &str) -> String {
    let now = now_ms();
    let snapshot = ModeSnapshot {
        version,
        scope: Scope::Global,
        mode,
        issued_at_ms: now,
        expires_at_ms: now + 600_000,
        issuer: issuer.into(),
    };
    sign(&control_key(CONTROL).unwrap(), snapshot).unwrap().to_json()
}

fn post_mode(admin: std::net::SocketAddr, body: &str) -> (u16, serde_json::Value) {
    let r = HttpClient::connect(admin).request("POST", "/admin/v1/mode", None, Some(body));
    (r.status, r.json())
}

/// The global snapshot an instance holds: (version, mode, issuer).
fn held(admin: std::net::SocketAddr) -> (u64, String, String) {
    let view = HttpClient::connect(admin).request("GET", "/admin/v1/mode", None, None).json();
    let snapshot = &view["snapshot"]["snapshot"];
    (
        snapshot["version"].as_u64().unwrap_or(0),
        view["mode"].as_str().unwrap_or("").to_owned(),
        snapshot["issuer"].as_str().unwrap_or("").to_owned(),
    )
}

fn with_control(config: &mut flashsale_engine::app::serve::ServeConfig) {
    config.edge.control.key = Some(control_key(CONTROL).unwrap());
}

/// Posts `a` to instance `first` and `b` to `second` at the same moment (a barrier between
/// two threads); returns both answers.
fn race(
    (first, a): (std::net::SocketAddr, String),
    (second, b): (std::net::SocketAddr, String),
) -> ((u16, serde_json::Value), (u16, serde_json::Value)) {
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
    let other = {
        let barrier = std::sync::Arc::clone(&barrier);
        std::thread::spawn(move || {
            let mut c = HttpClient::connect(second);
            barrier.wait();
            let r = c.request("POST", "/admin/v1/mode", None, Some(&b));
            (r.status, r.json())
        })
    };
    let mut c = HttpClient::connect(first);
    barrier.wait();
    let r = c.request("POST", "/admin/v1/mode", None, Some(&a));
    ((r.status, r.json()), other.join().unwrap())
}

/// Item 1: two instances accepting snapshots of one scope at once never overwrite each other
/// blindly. Same version on both: exactly one is accepted, the other answers 409
/// STALE_VERSION, and both instances end up holding the winner. Consecutive versions at
/// once: whatever the order, the bucket and both instances end on the higher one.
#[test]
fn concurrent_mode_posts_on_two_instances_compare_and_set() {
    let a = Engine::start_with(with_control);
    let b = a.start_peer(with_control);
    let rounds = 12u64;
    for round in 1..=rounds {
        let version = round * 3;
        let ((sa, va), (sb, vb)) = race(
            (a.admin(), signed(version, Mode::SubmitClosed, "instance-a")),
            (b.admin(), signed(version, Mode::ShedLoad { admit_percent: 50 }, "instance-b")),
        );
        let mut statuses = [sa, sb];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 409], "round {round}: a {sa} {va}, b {sb} {vb}");
        let loser = if sa == 409 { &va } else { &vb };
        assert_eq!(loser["reason_code"], "STALE_VERSION", "{loser}");
        let winner = if sa == 200 { "instance-a" } else { "instance-b" };
        wait_for_ms("both instances hold the winning snapshot", 10_000, || {
            [a.admin(), b.admin()]
                .into_iter()
                .all(|admin| held(admin).0 == version && held(admin).2 == winner)
        });
        println!("round {round}: version {version} won by {winner}");
        // Two consecutive versions at once: the higher one ends up everywhere.
        let (lower, higher) = (version + 1, version + 2);
        let ((sa, va), (sb, vb)) = race(
            (a.admin(), signed(lower, Mode::SubmitClosed, "lower")),
            (b.admin(), signed(higher, Mode::ShedLoad { admit_percent: 40 }, "higher")),
        );
        assert_eq!(sb, 200, "the higher version is always accepted: {vb}");
        assert!(sa == 200 || (sa == 409 && va["reason_code"] == "STALE_VERSION"), "{sa} {va}");
        wait_for_ms("both instances hold the higher version", 10_000, || {
            [a.admin(), b.admin()].into_iter().all(|admin| held(admin).0 == higher)
        });
        // A stale post after the fact is refused by the store check too.
        assert_eq!(post_mode(a.admin(), &signed(lower, Mode::QueryOnly, "late")).0, 409);
    }
    let _ = (Instant::now(), Duration::ZERO);
}

/// The instance that answered, from a generated `x-request-id` (`fs-{instance}-{shard}-{seq}`).
fn answered_by(resp: &flashsale_tests::HttpResponse) -> String {
    let id = resp.header("x-request-id").expect("every answer carries x-request-id");
    let rest = id.strip_prefix("fs-").unwrap_or_else(|| panic!("not a generated id: {id}"));
    let mut parts: Vec<&str> = rest.rsplitn(3, '-').collect();
    assert_eq!(parts.len(), 3, "{id}");
    parts.pop().unwrap().to_owned()
}

fn instance(id: &str) -> InstanceId {
    InstanceId::parse(id).unwrap()
}

/// Item 2: every process has an instance id (configured, or 8 random hex digits), and the
/// request ids it generates carry it, so two instances' ids never collide.
#[test]
fn two_instances_generate_distinguishable_request_ids() {
    let a = Engine::start_with(|c| c.edge.instance_id = instance("edge-a"));
    let b = a.start_peer(|c| c.edge.instance_id = instance("edge-b"));
    // A third one with the default, drawn at random.
    let c = a.start_peer(|_| {});
    let mut seen = std::collections::HashSet::new();
    let mut by = std::collections::HashMap::new();
    for (name, addr) in [("edge-a", a.http()), ("edge-b", b.http()), ("default", c.http())] {
        for _ in 0..20 {
            // No pass: refused, with a generated request id.
            let resp = HttpClient::connect(addr).request("GET", "/v1/reservations/x", None, None);
            assert!(resp.status >= 400, "{}", resp.body);
            let id = resp.header("x-request-id").unwrap().to_owned();
            assert!(seen.insert(id.clone()), "request id {id} generated twice");
            by.entry(name)
                .or_insert_with(std::collections::HashSet::new)
                .insert(answered_by(&resp));
        }
    }
    assert_eq!(by["edge-a"], ["edge-a".to_owned()].into());
    assert_eq!(by["edge-b"], ["edge-b".to_owned()].into());
    let default: Vec<_> = by["default"].iter().cloned().collect();
    assert_eq!(default.len(), 1, "one id per process: {default:?}");
    assert!(default[0].len() == 8 && default[0].bytes().all(|b| b.is_ascii_hexdigit()));
    println!("generated ids name their instance: edge-a, edge-b, {}", default[0]);
}

fn lease_held(metrics: &str) -> bool {
    metric(metrics, "flashsale_reconcile_lease_held ") == 1
}

fn rounds(metrics: &str) -> u64 {
    metric(metrics, "flashsale_reconcile_rounds_total ")
}

const LEASE_MS: u64 = 1_500;

fn lease_tune(c: &mut flashsale_engine::app::serve::ServeConfig, id: &str) {
    c.edge.reconcile.interval_ms = 200;
    c.edge.reconcile.lease_ms = LEASE_MS;
    c.edge.instance_id = instance(id);
}

/// The index of the running instance that holds the lease, once exactly one does and has
/// run a round since; panics when two hold it at once.
fn wait_for_one_holder(peers: &[Option<Peer>], what: &str) -> usize {
    let mut holder = None;
    let before: Vec<u64> =
        peers.iter().map(|p| p.as_ref().map_or(0, |p| rounds(&p.metrics()))).collect();
    wait_for_ms(what, 10 * LEASE_MS, || {
        let held: Vec<usize> = (0..peers.len())
            .filter(|&i| peers[i].as_ref().is_some_and(|p| lease_held(&p.metrics())))
            .collect();
        assert!(held.len() <= 1, "two instances hold the lease: {held:?}");
        holder = held.first().copied();
        holder.is_some_and(|i| rounds(&peers[i].as_ref().unwrap().metrics()) > before[i])
    });
    holder.unwrap()
}

/// Item 3: one reconcile runner among the instances, elected by a lease in the KV bucket
/// `flashsale_leases`; the others idle (their admin reconcile still answers). A holder that
/// dies without a word is outlived by the lease's expiry (takeover within about one lease
/// period); one that stops gracefully releases it (takeover at the next attempt).
#[test]
fn one_instance_runs_the_periodic_reconcile_and_another_takes_over() {
    let mut stores = Engine::start_with(|c| lease_tune(c, "lease-0"));
    stores.create_activity(31, 32, 5);
    // Only peers run from here on (the first engine releases its lease as it stops).
    stores.terminate(Duration::ZERO);
    let mut peers: Vec<Option<Peer>> = ["lease-1", "lease-2"]
        .into_iter()
        .map(|id| Some(stores.start_peer(|c| lease_tune(c, id))))
        .collect();
    let holder = wait_for_one_holder(&peers, "one instance holds the lease and runs rounds");
    // Over three lease periods: the same single holder, and only it runs rounds.
    let count = |peers: &[Option<Peer>]| -> Vec<u64> {
        peers.iter().map(|p| p.as_ref().map_or(0, |p| rounds(&p.metrics()))).collect()
    };
    let before = count(&peers);
    let until = Instant::now() + Duration::from_millis(3 * LEASE_MS);
    while Instant::now() < until {
        for (i, p) in peers.iter().enumerate() {
            let held = lease_held(&p.as_ref().unwrap().metrics());
            assert_eq!(held, i == holder, "instance {i} lease {held}, holder {holder}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = count(&peers);
    println!(
        "rounds over {} ms: {:?} (holder {holder})",
        3 * LEASE_MS,
        [after[0] - before[0], after[1] - before[1]]
    );
    let idle = 1 - holder;
    assert!(after[holder] > before[holder], "the holder runs rounds");
    assert_eq!(after[idle], before[idle], "the idle instance runs none");
    // The idle instance still answers on-demand reports.
    let admin = peers[idle].as_ref().unwrap().admin();
    let path = "/admin/v1/activities/31/skus/32/reconcile";
    let report = HttpClient::connect(admin).request("GET", path, None, None);
    assert_eq!((report.status, report.json()["ok"].clone()), (200, true.into()), "{}", report.body);

    // The holder dies without releasing: the other takes over when the lease expires.
    fail::cfg("lease_no_release", "return").unwrap();
    let stopped = Instant::now();
    peers[holder].take().unwrap().terminate();
    fail::remove("lease_no_release");
    let next = wait_for_one_holder(&peers, "the survivor takes over after the expiry");
    assert_eq!(next, idle);
    println!(
        "takeover by expiry: the survivor ran a round {} ms after the holder stopped (lease \
         {LEASE_MS} ms, renewed every {} ms, interval 200 ms)",
        stopped.elapsed().as_millis(),
        LEASE_MS / 3
    );
    // A third instance; the holder stops gracefully and releases: the new one takes over.
    peers.push(Some(stores.start_peer(|c| lease_tune(c, "lease-3"))));
    std::thread::sleep(Duration::from_millis(LEASE_MS / 3));
    let stopped = Instant::now();
    peers[next].take().unwrap().terminate();
    let last = wait_for_one_holder(&peers, "the new instance takes over after the release");
    assert_eq!(last, 2);
    println!(
        "takeover after a release: a round {} ms after the holder stopped",
        stopped.elapsed().as_millis()
    );
}

/// One reservation through `client`, without an `x-request-id` (the answer's generated one
/// names the instance): (instance, state, body).
fn submit_via(
    engine: &Engine,
    client: &mut HttpClient,
    user: u64,
    (activity, sku): (u64, u64),
) -> (String, String, serde_json::Value) {
    let body = format!(
        r#"{{"activity_id":{activity},"sku_id":{sku},"request_id":"u-{user}","quantity":1}}"#
    );
    let pass = engine.pass(user, activity);
    let resp = client.request("POST", "/v1/reservations", Some(&pass), Some(&body));
    let v = resp.json();
    (answered_by(&resp), state(&v).to_owned(), v)
}

fn fast_path(metrics: &str) -> u64 {
    metric(metrics, "flashsale_sold_out_fast_path_total")
}

/// Items 4 and 5: two instances behind HAProxy round robin sell a SKU out (each instance's
/// fast path answers SOLD_OUT), a compensation returns the unit through whichever instance's
/// `redis-sync` pulls it, and the other instance stops answering SOLD_OUT from its fast path
/// within the notice's delivery (`seckill.notice.stock_returned.<a>.<s>`), not its periodic
/// stock re-check, which is set out of reach here (10 min). The unit comes back the real way:
/// no order-writer runs until the reservation has expired (1 s), then one does and rejects it
/// as expired, and redis-sync compensates.
#[test]
fn stock_returned_on_one_instance_clears_the_other_instances_sold_out_flag() {
    let sku = (41, 42);
    let tune = |c: &mut flashsale_engine::app::serve::ServeConfig| {
        c.edge.partition.stock_recheck_ms = 600_000;
    };
    let a = Engine::start_with(|c| {
        tune(c);
        c.edge.instance_id = instance("sell-a");
    });
    let b = a.start_peer(|c| {
        tune(c);
        c.edge.instance_id = instance("sell-b");
    });
    let proxy = Haproxy::round_robin(&[a.http(), b.http()]);
    a.create_activity_with(&format!(
        r#"{{"activity_id":{},"sku_id":{},"stock":1,"reservation_ttl_ms":1000}}"#,
        sku.0, sku.1
    ));
    let metrics_of = |who: &str| if who == "sell-a" { a.metrics() } else { b.metrics() };
    // Sell out through the balancer; then buyers until both instances answer from their
    // fast path (each instance's owner learns "sold out" from its own Redis answer).
    let (_, won, v) = submit_via(&a, &mut HttpClient::connect(proxy.addr), 1, sku);
    let reserved = Instant::now();
    assert_eq!(won, "QUEUED", "{v}");
    let mut user = 100;
    let mut fast = std::collections::HashSet::new();
    wait_for_ms("both instances answer SOLD_OUT from their fast path", 10_000, || {
        user += 1;
        let who_before = [fast_path(&a.metrics()), fast_path(&b.metrics())];
        let (who, st, v) = submit_via(&a, &mut HttpClient::connect(proxy.addr), user, sku);
        assert_eq!(st, "SOLD_OUT", "{v}");
        let i = usize::from(who == "sell-b");
        if fast_path(&metrics_of(&who)) > who_before[i] {
            fast.insert(who);
        }
        fast.len() == 2
    });
    // The unit comes back: past its expiry, the order-writer rejects the reservation.
    std::thread::sleep(Duration::from_millis(1_200).saturating_sub(reserved.elapsed()));
    let config = serve_config(a.redis.addr(), &a.nats.url(), &a.db.url);
    let worker = flashsale_pg_worker::worker::start(small_worker(&config)).expect("worker starts");
    let compensations = |m: &str| metric(m, "flashsale_compensations_total");
    let mut compensated_by = String::new();
    wait_for_ms("one instance applies the compensation", 10_000, || {
        for who in ["sell-a", "sell-b"] {
            if compensations(&metrics_of(who)) == 1 {
                compensated_by = who.to_owned();
            }
        }
        !compensated_by.is_empty()
    });
    let returned = Instant::now();
    let other = if compensated_by == "sell-a" { "sell-b" } else { "sell-a" };
    assert_eq!(compensations(&metrics_of(other)), 0, "compensated once");
    // The other instance, reached through the balancer: no longer a fast-path SOLD_OUT.
    let mut probes = 0;
    wait_for_ms("the other instance's sold-out flag clears", 5_000, || loop {
        user += 1;
        probes += 1;
        let before = fast_path(&metrics_of(other));
        let (who, st, v) = submit_via(&a, &mut HttpClient::connect(proxy.addr), user, sku);
        if who != other {
            // The compensating instance: its own flag cleared at once; may take the unit.
            assert!(st == "QUEUED" || st == "SOLD_OUT", "{v}");
            continue;
        }
        let from_fast_path = st == "SOLD_OUT" && fast_path(&metrics_of(other)) > before;
        break !from_fast_path;
    });
    let cleared_ms = returned.elapsed().as_millis();
    println!(
        "compensated by {compensated_by}; {other} stopped answering SOLD_OUT from its fast path \
         {cleared_ms} ms later ({probes} probes; its stock re-check period is 600 s)"
    );
    // A probe that took the unit back may expire too (1 s TTL): drain, then count exactly.
    wait_for_ms("every reservation has its outcome", 20_000, || {
        redis_cmd(&a.redis, &["ZCARD", "seckill:{41:42}:resv:pending"]) == "0"
    });
    worker.shutdown().expect("worker stops");
    let expired = a.pg_count(
        "SELECT count(*) FROM inventory_reservation \
         WHERE sku_id = 42 AND status = 'REJECTED_EXPIRED'",
    );
    let total = compensations(&a.metrics()) + compensations(&b.metrics());
    assert_eq!(
        total as i64, expired,
        "each expired reservation compensated once across the instances"
    );
    a.assert_reconciled(sku.0, sku.1);
}
