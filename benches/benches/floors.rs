//! The floors (issue 25 item 1): what each building block costs, in its own CPU, for one sold
//! unit's work done as leanly as it can be done, beside what the engine's use of it costs.
//! Every later per-unit figure is read as a ratio to these.
//!
//! - **Redis**: one `FCALL` of a six-command function (the seed's reservation: the request's
//!   record read, the buyer's marker set, the stock decremented, the reservation written, the
//!   pending entry added, the request's record written) against one `FCALL reserve` of the
//!   engine's library, interleaved on the same private server, 16 calls in flight (a shard's
//!   pipeline), five calls per unit of the other cases; redis-server's CPU per call from
//!   /proc and the commands each ran (`INFO commandstats`).
//! - **NATS**: order-create messages published to the engine's own `SECKILL_ORDERS` stream
//!   (file storage, duplicate window, `Nats-Msg-Id`; 256 publishes awaiting their acks at
//!   once), then pulled by its `order-writer` consumer in batches of 256 and acked one by one;
//!   nats-server's CPU per publish and per pull-and-ack. A sold unit needs two of each (the
//!   order-create and the outbox's `order_created`, pulled by the order writer and by
//!   `redis-sync`), so its floor is twice their sum.
//! - **PostgreSQL**: the rows one order writes (inbox, order, its token claimed, its item,
//!   the ledger's CLAIM, the reservation, the outbox event) as plain multi-row statements, one
//!   transaction per batch, fsync on, on the same schema and indexes, in batches of 512 (the
//!   worker's bound: the floor) and 11 (what the demo commits per transaction: 10,000 orders
//!   in ~900);
//!   the postgres processes' CPU per order. No reads: the worker must read and lock a batch's
//!   facts first, which the floor does not. The invariant checker runs over the result, so
//!   the floor writes the same facts an order writes.
//!
//! Then the demo's CPU table (a `flashsale demo` report, `FLASHSALE_FLOORS_DEMO`, default
//! `var/demo-report.json`, else the committed `benches/results/demo-2026-12-03.json`): each
//! server's CPU per sold unit in the selling phase, and its ratio to the floor.
//!
//! The engine's own use of PostgreSQL for the same rows at the same batch bound is the
//! `order_pipeline` bench's set-based case; `benches/floors.sh` runs both.
//!
//! A bench, not a test (`harness = false`): `cargo bench -p flashsale-benches --bench floors`.
//! Knobs: `FLASHSALE_FLOORS_UNITS` (10000 per case), `FLASHSALE_FLOORS_ROUNDS` (3; cases
//! interleave, medians reported).

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use flashsale_benches::loadgen::search::median;
use flashsale_benches::pg::{
    connect, fresh_database, load_average, order_create, Running, SkuSpec, ACTIVITY, SKU,
};
use flashsale_benches::{preheat_args, reserve_one, with_client, BenchRedis};
use flashsale_engine::app::cpu::{postgres_ticks, process_ticks, US_PER_TICK};
use flashsale_engine::app::stack::redis_stats::commandstats;
use flashsale_engine::app::stack::{Kind, Server};
use flashsale_io::jetstream::{Log, LogConfig};
use flashsale_io::redis::script::{Functions, SkuKeys};
use flashsale_io::redis::RedisClient;
use flashsale_io::resp::Reply;
use flashsale_io::wire::OrderCreate;
use flashsale_pg_worker::check_invariants;

use flashsale_benches::T0;
const IN_FLIGHT: usize = 16;
const PUBLISH_WINDOW: usize = 256;
/// The worker's batch bound first (the floor), then what the demo commits per transaction
/// (10,000 orders in ~900): the price of small commits.
const PG_BATCHES: [usize; 2] = [512, 11];
/// Redis calls per phase for every unit of the other cases: /proc counts CPU in 10 ms ticks,
/// and a call costs a few µs.
const REDIS_CALLS_PER_UNIT: usize = 5;

/// The seed's reservation, six commands, nothing else.
const FLOOR_LIBRARY: &str = r#"#!lua name=flashsale_floor
redis.register_function('floor_reserve', function(keys, args)
  local seen = redis.call('GET', keys[1])
  if seen then return seen end
  if not redis.call('SET', keys[2], args[1], 'NX') then return 'DUPLICATE_USER' end
  if redis.call('DECR', keys[3]) < 0 then return 'SOLD_OUT' end
  redis.call('HSET', keys[4], 'request_id', args[2], 'user_id', args[1],
             'message_id', args[3], 'status', 'RESERVED')
  redis.call('ZADD', keys[5], args[4], args[5])
  redis.call('SET', keys[1], args[5])
  return 'QUEUED'
end)
"#;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One round's figures, µs of the server's CPU per item.
#[derive(Default)]
struct Round {
    redis_floor: RedisCost,
    redis_reserve: RedisCost,
    nats_publish: f64,
    nats_pull_ack: f64,
    pg: Vec<f64>,
}

fn main() {
    let units: usize = env_or("FLASHSALE_FLOORS_UNITS", 10_000);
    let rounds: usize = env_or("FLASHSALE_FLOORS_ROUNDS", 3);
    let dir = tempfile::Builder::new().prefix("flashsale-floors-").tempdir().expect("temp dir");
    let redis = BenchRedis::start();
    let pg = Running(Server::start(Kind::Postgres, &dir.path().join("pg"), None).expect("pg"));
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    println!("floors: {units} units per case, {rounds} rounds, load average {}", load_average());
    let mut all = Vec::new();
    for round in 0..rounds {
        let mut r = Round::default();
        (r.redis_floor, r.redis_reserve) =
            redis_round(&redis, round as u64, units * REDIS_CALLS_PER_UNIT);
        (r.nats_publish, r.nats_pull_ack) =
            runtime.block_on(nats_round(&dir.path().join(format!("nats{round}")), units));
        for batch in PG_BATCHES {
            let name = format!("floor_{round}_{batch}");
            r.pg.push(runtime.block_on(pg_round(&pg.0, &name, units, batch)));
        }
        println!(
            "round {round}: redis floor {:.2} µs ({:.2} inside) / {:.1} commands, reserve {:.2} \
             µs ({:.2} inside) / {:.1} commands a call; nats publish {:.2}, pull-and-ack {:.2} \
             µs a message; postgres {:.1} / {:.1} µs an order (batch {:?}); load average {}",
            r.redis_floor.cpu_us,
            r.redis_floor.inside_us,
            r.redis_floor.commands,
            r.redis_reserve.cpu_us,
            r.redis_reserve.inside_us,
            r.redis_reserve.commands,
            r.nats_publish,
            r.nats_pull_ack,
            r.pg[0],
            r.pg[1],
            PG_BATCHES,
            load_average()
        );
        all.push(r);
    }
    report(&all);
}

fn med(rounds: &[Round], f: impl Fn(&Round) -> f64) -> f64 {
    median(rounds.iter().map(f).collect())
}

/// The floors table, and the demo's per-unit figures as ratios to them.
fn report(rounds: &[Round]) {
    let redis_floor = med(rounds, |r| r.redis_floor.cpu_us);
    let redis_reserve = med(rounds, |r| r.redis_reserve.cpu_us);
    let commands =
        (med(rounds, |r| r.redis_floor.commands), med(rounds, |r| r.redis_reserve.commands));
    let inside =
        (med(rounds, |r| r.redis_floor.inside_us), med(rounds, |r| r.redis_reserve.inside_us));
    let (publish, pull_ack) = (med(rounds, |r| r.nats_publish), med(rounds, |r| r.nats_pull_ack));
    let nats_floor = 2.0 * (publish + pull_ack);
    let pg: Vec<f64> = (0..PG_BATCHES.len()).map(|i| med(rounds, |r| r.pg[i])).collect();
    let demo = demo_report();
    let demo_of = |name: &str| demo.as_ref().and_then(|(_, d)| demo_unit_cost(d, name));
    println!("\nmedians of {} rounds; µs of the server's own CPU", rounds.len());
    println!("| component | floor: the unit's work done leanly | floor per unit | demo per sold unit | ratio |");
    println!("|---|---|---|---|---|");
    let row = |name: &str, what: String, floor: f64, process: &str| {
        let (demo, ratio) = match demo_of(process) {
            Some(d) => (format!("{d:.1}"), format!("{:.1}x", d / floor)),
            None => ("-".into(), "-".into()),
        };
        println!("| {name} | {what} | {floor:.1} | {demo} | {ratio} |");
    };
    row(
        "Redis",
        format!(
            "one FCALL of {:.0} commands, {:.1} µs inside it (the engine's reserve alone: \
             {redis_reserve:.1} µs, {:.1} inside, {:.0} commands, {:.2}x)",
            commands.0,
            inside.0,
            inside.1,
            commands.1,
            redis_reserve / redis_floor
        ),
        redis_floor,
        "redis",
    );
    row(
        "NATS",
        format!("2 x (publish {publish:.1} + pull-and-ack {pull_ack:.1})"),
        nats_floor,
        "nats",
    );
    row(
        "PostgreSQL",
        format!(
            "the order's rows, {} per transaction (at {}: {:.1})",
            PG_BATCHES[0], PG_BATCHES[1], pg[1]
        ),
        pg[0],
        "postgres",
    );
    match demo {
        Some((path, _)) => println!("demo figures from {}", path.display()),
        None => println!("no demo report found: run `./run demo` for the last column"),
    }
}

fn demo_report() -> Option<(PathBuf, serde_json::Value)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let candidates = [
        std::env::var("FLASHSALE_FLOORS_DEMO").map(PathBuf::from).ok(),
        Some(root.join("var/demo-report.json")),
        Some(root.join("benches/results/demo-2026-12-03.json")),
    ];
    candidates.into_iter().flatten().find_map(|path| {
        let text = std::fs::read_to_string(&path).ok()?;
        Some((path, serde_json::from_str(&text).ok()?))
    })
}

/// A process's CPU per sold unit in the selling phase from the demo's CPU table.
fn demo_unit_cost(report: &serde_json::Value, process: &str) -> Option<f64> {
    report["cpu"]["processes"]
        .as_array()?
        .iter()
        .find(|p| p["process"].as_str() == Some(process))?["selling_us_per_unit"]
        .as_f64()
}

/// redis-server's CPU per call: the floor function and the engine's `reserve`, `units` calls
/// each, on fresh SKUs of `units` units.
fn redis_round(redis: &BenchRedis, round: u64, units: usize) -> (RedisCost, RedisCost) {
    let (addr, pid) = (redis.addr(), redis.pid());
    with_client(addr, Duration::from_secs(5), move |client| async move {
        let reply = client
            .command(&[b"FUNCTION", b"LOAD", b"REPLACE", FLOOR_LIBRARY.as_bytes()])
            .await
            .expect("load the floor library");
        assert!(matches!(reply, Reply::Bulk(_)), "{reply:?}");
        let client = Rc::new(client);
        let sku = format!("{{floor{round}}}");
        let stock_key = format!("{sku}:stock");
        client.command(&[b"SET", stock_key.as_bytes(), units.to_string().as_bytes()]).await.ok();
        let floor = priced(&client, pid, units, {
            let (client, sku) = (Rc::clone(&client), Rc::new(sku));
            move |n| {
                let (client, sku) = (Rc::clone(&client), Rc::clone(&sku));
                async move { floor_call(&client, &sku, n).await }
            }
        })
        .await;
        let functions = Rc::new(Functions::new((*client).clone()));
        let keys = Rc::new(SkuKeys::new(88, 1_000 + round));
        functions.preheat(&keys, &preheat_args(units as u64)).await.expect("preheat");
        let reserve = priced(&client, pid, units, move |n| {
            let (functions, keys) = (Rc::clone(&functions), Rc::clone(&keys));
            async move { reserve_one(&functions, &keys, n).await }
        })
        .await;
        (floor, reserve)
    })
}

/// What one phase of calls cost Redis: its CPU per call (µs, from /proc) and the commands
/// each call ran inside its function (`INFO commandstats`, `FCALL` itself not counted).
#[derive(Default, Clone, Copy)]
struct RedisCost {
    cpu_us: f64,
    commands: f64,
    /// Redis' own time inside the function (`usec_per_call` of `fcall`): the call's CPU
    /// without reading, parsing and answering it.
    inside_us: f64,
}

/// `usec_per_call` of `cmdstat_<name>` in `INFO commandstats`.
fn usec_per_call(info: &str, name: &str) -> f64 {
    info.lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{name}:")))
        .and_then(|stats| stats.split(',').find_map(|kv| kv.strip_prefix("usec_per_call=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Runs `call(1..=units)`, [`IN_FLIGHT`] at once, and prices it.
async fn priced<F, Fut>(client: &RedisClient, pid: u32, units: usize, call: F) -> RedisCost
where
    F: Fn(u64) -> Fut + Clone + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    client.command(&[b"CONFIG", b"RESETSTAT"]).await.expect("CONFIG RESETSTAT");
    let next = Rc::new(std::cell::Cell::new(1u64));
    let before = process_ticks(pid).expect("redis ticks");
    let tasks: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (next, call) = (Rc::clone(&next), call.clone());
            glommio::spawn_local(async move {
                loop {
                    let n = next.get();
                    if n > units as u64 {
                        break;
                    }
                    next.set(n + 1);
                    call(n).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await;
    }
    let ticks = process_ticks(pid).expect("redis ticks") - before;
    let info = match client.command(&[b"INFO", b"commandstats"]).await.expect("INFO") {
        Reply::Bulk(text) => String::from_utf8_lossy(&text).into_owned(),
        other => panic!("INFO commandstats: {other:?}"),
    };
    let inner: u64 = commandstats(&info)
        .into_iter()
        .filter(|(name, _)| !["fcall", "config|resetstat", "info"].contains(&name.as_str()))
        .map(|(_, calls)| calls)
        .sum();
    RedisCost {
        cpu_us: (ticks * US_PER_TICK) as f64 / units as f64,
        commands: inner as f64 / units as f64,
        inside_us: usec_per_call(&info, "fcall"),
    }
}

async fn floor_call(client: &RedisClient, sku: &str, n: u64) {
    let keys = [
        format!("{sku}:req:req_{n}"),
        format!("{sku}:user:{n}"),
        format!("{sku}:stock"),
        format!("{sku}:resv:resv_{n}"),
        format!("{sku}:pending"),
    ];
    let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    let (user, request, message, score, reservation) = (
        n.to_string(),
        format!("req_{n}"),
        format!("msg_{n}"),
        (T0 + n).to_string(),
        format!("resv_{n}"),
    );
    let args: [&[u8]; 5] = [
        user.as_bytes(),
        request.as_bytes(),
        message.as_bytes(),
        score.as_bytes(),
        reservation.as_bytes(),
    ];
    let reply = client.fcall("floor_reserve", &keys, &args).await.expect("floor_reserve");
    assert!(matches!(&reply, Reply::Bulk(b) if b.as_ref() == b"QUEUED"), "{reply:?}");
}

/// nats-server's CPU per publish and per pull-and-ack, on a fresh server in `dir`.
async fn nats_round(dir: &Path, units: usize) -> (f64, f64) {
    let nats = Running(Server::start(Kind::Nats, dir, None).expect("start nats"));
    let config = LogConfig { url: nats.0.url(), max_ack_pending: 20_000, ..LogConfig::default() };
    let log = Log::connect(&config).await.expect("connect nats");
    log.ensure_streams().await.expect("streams");
    log.ensure_consumers().await.expect("consumers");
    let messages: Vec<OrderCreate> = (1..=units as u64).map(|n| order_create(n, 1, T0)).collect();
    let publisher = log.publisher();
    let ticks = || process_ticks(nats.0.pid).expect("nats ticks");
    let before = ticks();
    for window in messages.chunks(PUBLISH_WINDOW) {
        for ack in
            futures::future::join_all(window.iter().map(|m| publisher.publish_order(m))).await
        {
            ack.expect("publish");
        }
    }
    let published = ticks();
    let source = log.order_writer().await.expect("order-writer");
    let mut acked = 0;
    while acked < units {
        let batch = source.fetch(256, Duration::from_millis(500)).await.expect("fetch");
        assert!(!batch.is_empty(), "{acked} of {units} pulled, then nothing");
        for ack in futures::future::join_all(batch.iter().map(|d| d.ack())).await {
            ack.expect("ack");
        }
        acked += batch.len();
    }
    log.flush().await.expect("flush");
    let done = ticks();
    let per = |ticks: u64| (ticks * US_PER_TICK) as f64 / units as f64;
    (per(published - before), per(done - published))
}

/// The postgres processes' CPU per order for `units` orders written `batch` per transaction.
async fn pg_round(pg: &Server, name: &str, units: usize, batch: usize) -> f64 {
    let sku = SkuSpec {
        allocator: "TOKEN",
        half_empty_tokens: false,
        stock: units as i64,
        max_per_buyer: 1,
    };
    let mut client = fresh_database(pg, name, &sku).await;
    let tokens: Vec<String> = client
        .query("SELECT token_id FROM inventory_token WHERE activity_id = $1 AND sku_id = $2 ORDER BY seq", &[&ACTIVITY, &SKU])
        .await
        .expect("tokens")
        .iter()
        .map(|row| row.get(0))
        .collect();
    let statements = FloorStatements::prepare(&client).await;
    let before = postgres_ticks(pg.pid).expect("postgres ticks");
    for (chunk, start) in tokens.chunks(batch).zip((0..).step_by(batch)) {
        let rows = FloorRows::new(start as u64, chunk);
        statements.write(&mut client, &rows).await;
    }
    let ticks = postgres_ticks(pg.pid).expect("postgres ticks") - before;
    let report = check_invariants(&client, ACTIVITY, SKU).await.expect("invariants");
    assert!(report.ok(), "{name}: {report:#?}");
    assert_eq!(report.orders_live, units as i64, "{name}: every unit sold once");
    drop(client);
    let admin = connect(&pg.url()).await;
    admin.batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)")).await.expect("drop");
    (ticks * US_PER_TICK) as f64 / units as f64
}

/// One batch's columns.
struct FloorRows {
    orders: Vec<String>,
    users: Vec<i64>,
    requests: Vec<String>,
    reservations: Vec<String>,
    messages: Vec<String>,
    tokens: Vec<String>,
}

impl FloorRows {
    fn new(start: u64, tokens: &[String]) -> FloorRows {
        let ns: Vec<u64> = (start + 1..=start + tokens.len() as u64).collect();
        let each = |f: &dyn Fn(u64) -> String| ns.iter().map(|&n| f(n)).collect::<Vec<_>>();
        FloorRows {
            orders: each(&|n| format!("ord_floor{n:020}")),
            users: ns.iter().map(|&n| 1_000_000 + n as i64).collect(),
            requests: each(&|n| format!("req_floor{n:020}")),
            reservations: each(&|n| format!("resv_floor{n:020}")),
            messages: each(&|n| format!("msg_floor{n:020}")),
            tokens: tokens.to_vec(),
        }
    }
}

/// The order's row writes as plain statements over a batch's columns (0 orders, 1 users,
/// 2 requests, 3 reservations, 4 messages, 5 tokens), each statement's `$n` the n-th column
/// it lists; the activity and SKU are the bench's constants.
const FLOOR_SQL: [(&str, &[usize]); 7] = [
    (
        "INSERT INTO consumer_inbox (consumer_group, message_id, reservation_id) \
         SELECT 'order-writer', m, r FROM unnest($1::text[], $2::text[]) AS x(m, r)",
        &[4, 3],
    ),
    (
        "INSERT INTO orders (order_id, activity_id, sku_id, user_id, request_id, \
                             reservation_id, inventory_token_id, quantity) \
         SELECT o, 10001, 20001, u, q, r, t, 1 \
         FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[]) \
              AS x(o, u, q, r, t)",
        &[0, 1, 2, 3, 5],
    ),
    (
        "UPDATE inventory_token k SET status = 'CLAIMED', reservation_id = x.r, \
                order_id = x.o, claimed_at = now(), updated_at = now() \
         FROM unnest($1::text[], $2::text[], $3::text[]) AS x(t, r, o) WHERE k.token_id = x.t",
        &[5, 3, 0],
    ),
    (
        "INSERT INTO order_items (order_id, activity_id, sku_id, quantity, token_ids) \
         SELECT o, 10001, 20001, 1, ARRAY[t] FROM unnest($1::text[], $2::text[]) AS x(o, t)",
        &[0, 5],
    ),
    (
        "INSERT INTO inventory_ledger (activity_id, sku_id, token_id, order_id, \
                                       reservation_id, kind, unit_no) \
         SELECT 10001, 20001, t, o, r, 'CLAIM', 1 \
         FROM unnest($1::text[], $2::text[], $3::text[]) AS x(t, o, r)",
        &[5, 0, 3],
    ),
    (
        "INSERT INTO inventory_reservation (reservation_id, request_id, message_id, \
             activity_id, sku_id, user_id, status, order_id, reserved_at, expires_at, quantity) \
         SELECT r, q, m, 10001, 20001, u, 'ORDER_CREATED', o, now(), \
                now() + interval '1 hour', 1 \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[]) \
              AS x(r, q, m, u, o)",
        &[3, 2, 4, 1, 0],
    ),
    (
        "INSERT INTO event_outbox (aggregate_id, event_type, payload) \
         SELECT r, 'order_created', jsonb_build_object('order_id', o, 'reservation_id', r, \
             'request_id', q, 'user_id', u, 'activity_id', 10001, 'sku_id', 20001, \
             'quantity', 1, 'status', 'PENDING_PAYMENT') \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS x(r, o, q, u)",
        &[3, 0, 2, 1],
    ),
];

/// [`FLOOR_SQL`] prepared.
struct FloorStatements(Vec<(tokio_postgres::Statement, &'static [usize])>);

impl FloorStatements {
    async fn prepare(client: &tokio_postgres::Client) -> FloorStatements {
        let mut prepared = Vec::new();
        for (sql, columns) in FLOOR_SQL {
            let statement = client.prepare(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
            prepared.push((statement, columns));
        }
        FloorStatements(prepared)
    }

    /// One batch in one transaction.
    async fn write(&self, client: &mut tokio_postgres::Client, rows: &FloorRows) {
        let tx = client.transaction().await.expect("begin");
        for (statement, columns) in &self.0 {
            let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                columns.iter().map(|&c| rows.column(c)).collect();
            tx.execute(statement, &params).await.expect("floor write");
        }
        tx.commit().await.expect("commit");
    }
}

impl FloorRows {
    fn column(&self, c: usize) -> &(dyn tokio_postgres::types::ToSql + Sync) {
        match c {
            0 => &self.orders,
            1 => &self.users,
            2 => &self.requests,
            3 => &self.reservations,
            4 => &self.messages,
            _ => &self.tokens,
        }
    }
}
