//! Order pipeline throughput: N order-create messages already in `SECKILL_ORDERS` → time until
//! all N orders are committed by the worker (`flashsale_pg_worker::start`), for the TOKEN and
//! ROW allocators and batch sizes 1, 8 and 32, fsync on; then pgbench running the same
//! single-message transaction (`benches/pgbench/order_txn.sql`) against the same server, for
//! the ratio.
//!
//! A bench, not a timed test (`harness = false`): `cargo bench -p flashsale-benches --bench
//! order_pipeline`. It starts its own PostgreSQL (`initdb` in a temp dir, fsync on) and a fresh
//! nats-server per case, with the stack code of `flashsale stack up`; nothing touches the
//! machine's servers. Each case gets a fresh database, so no case inherits another's bloat.
//!
//! Knobs (environment): `FLASHSALE_BENCH_ORDERS` (10000), `FLASHSALE_BENCH_WRITERS` (order
//! writers = concurrent transactions, 4), `FLASHSALE_BENCH_BATCHES` ("1,8,32"),
//! `FLASHSALE_BENCH_ALLOCATORS` ("TOKEN,ROW"), `FLASHSALE_BENCH_PGBENCH_CLIENTS` (8).
//!
//! Timing: from the moment `start` returns (connected, streams and pool ready, tasks spawned)
//! until `order-writer` is drained: nothing pending, nothing unacked (polled every 5 ms); a
//! message is acked only after its order committed, and the count is checked afterwards.
//! The worker's outbox publisher runs during the measurement, as in production. Every case
//! ends with the invariant checker.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use flashsale_engine::stack::{Kind, Server};
use flashsale_io::log::{Log, LogConfig};
use flashsale_io::wire::{OrderCreate, ORDER_CREATE_EVENT_TYPE};
use flashsale_pg_worker::{
    check_invariants, generate_tokens, migrate, start, PgPoolConfig, WorkerConfig,
};
use tokio_postgres::{Client, NoTls};

const ACTIVITY: i64 = 10001;
const SKU: i64 = 20001;

/// Stops a server when dropped (also on panic), so no bench run leaves one behind.
struct Running(Server);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.stop();
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

struct Case {
    allocator: String,
    batch: usize,
    seconds: f64,
    startup_ms: u128,
    /// The 1-minute load average before the case: the machine is shared, and a number taken
    /// while something else was busy says so here.
    load_before: String,
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

fn main() {
    let orders: i64 = env_or("FLASHSALE_BENCH_ORDERS", 10_000);
    let writers: usize = env_or("FLASHSALE_BENCH_WRITERS", 4);
    let pgbench_clients: usize = env_or("FLASHSALE_BENCH_PGBENCH_CLIENTS", 8);
    let batches: Vec<usize> = env_list("FLASHSALE_BENCH_BATCHES", "1,8,32")
        .iter()
        .filter_map(|b| b.parse().ok())
        .collect();
    let allocators = env_list("FLASHSALE_BENCH_ALLOCATORS", "TOKEN,ROW");

    let dir =
        tempfile::Builder::new().prefix("flashsale-bench-orders-").tempdir().expect("temp dir");
    let pg = Running(
        Server::start(Kind::Postgres, &dir.path().join("pg"), None).expect("start PostgreSQL"),
    );
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    println!(
        "order pipeline: {orders} messages in the log -> {orders} committed orders; \
         {writers} order writers; PostgreSQL fsync=on on port {}",
        pg.0.port
    );

    let mut cases = Vec::new();
    for allocator in &allocators {
        for &batch in &batches {
            let case =
                runtime.block_on(run_case(&pg.0, dir.path(), allocator, batch, writers, orders));
            println!(
                "  {allocator:>5} batch {batch:>2}: {:>6.3} s  {:>7.0} orders/s  (worker start-up {} ms; \
                 load average before {})",
                case.seconds,
                orders as f64 / case.seconds,
                case.startup_ms,
                case.load_before
            );
            cases.push(case);
        }
    }

    let mut pgbench_tps = Vec::new();
    for allocator in &allocators {
        match runtime.block_on(pgbench(&pg.0, allocator, pgbench_clients, orders)) {
            Ok(tps) => {
                println!("  pgbench {allocator:>5} (one message per transaction, {pgbench_clients} clients): {tps:>7.0} TPS");
                pgbench_tps.push((allocator.clone(), tps));
            }
            Err(e) => println!("  pgbench {allocator}: not run ({e})"),
        }
    }

    println!("\n| allocator | batch | orders/s | x batch 1 | x pgbench |");
    println!("|---|---|---|---|---|");
    for case in &cases {
        let rate = orders as f64 / case.seconds;
        let base = cases
            .iter()
            .find(|c| c.allocator == case.allocator && c.batch == 1)
            .map(|c| format!("{:.2}", rate / (orders as f64 / c.seconds)))
            .unwrap_or_else(|| "-".into());
        let versus = pgbench_tps
            .iter()
            .find(|(a, _)| *a == case.allocator)
            .map(|(_, tps)| format!("{:.2}", rate / tps))
            .unwrap_or_else(|| "-".into());
        println!("| {} | {} | {rate:.0} | {base} | {versus} |", case.allocator, case.batch);
    }
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

fn db_url(pg: &Server, name: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{}/{name}", pg.port)
}

/// A fresh, migrated database with one ACTIVE SKU of `stock` units.
async fn fresh_database(pg: &Server, name: &str, allocator: &str, stock: i64) -> Client {
    let admin = connect(&pg.url()).await;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name}")).await.expect("drop");
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create");
    let mut client = connect(&db_url(pg, name)).await;
    migrate(&mut client).await.expect("migrate");
    client
        .execute(
            "INSERT INTO activity (activity_id, status, start_at, end_at, reservation_ttl_ms, \
             pay_timeout_ms) VALUES ($1, 'ACTIVE', now() - interval '1 hour', \
             now() + interval '1 hour', 300000, 900000)",
            &[&ACTIVITY],
        )
        .await
        .expect("activity");
    let available = (allocator == "ROW").then_some(stock);
    client
        .execute(
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator, available_stock) \
             VALUES ($1, $2, $3, $4, $5)",
            &[&ACTIVITY, &SKU, &stock, &allocator, &available],
        )
        .await
        .expect("sku");
    if allocator == "TOKEN" {
        generate_tokens(&client, ACTIVITY, SKU, stock).await.expect("tokens");
    }
    client.batch_execute("VACUUM ANALYZE").await.expect("vacuum");
    client
}

fn messages(count: i64) -> Vec<OrderCreate> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    (1..=count as u64)
        .map(|n| OrderCreate {
            schema_version: 1,
            event_type: ORDER_CREATE_EVENT_TYPE.to_owned(),
            message_id: format!("msg_bench{n:020}"),
            message_key: format!("resv_bench{n:020}"),
            request_id: format!("req_bench{n:020}"),
            reservation_id: format!("resv_bench{n:020}"),
            activity_id: ACTIVITY as u64,
            sku_id: SKU as u64,
            user_id: 1_000_000 + n,
            quantity: 1,
            reserved_at_ms: now,
            reservation_expires_at_ms: now + 3_600_000,
            retry_count: 0,
            payload_hash: format!("sha256:{n:064x}"),
            traceparent: Some(format!("00-{n:032x}-{n:016x}-01")),
            created_at_ms: now,
        })
        .collect()
}

async fn run_case(
    pg: &Server,
    dir: &Path,
    allocator: &str,
    batch: usize,
    writers: usize,
    orders: i64,
) -> Case {
    let name = format!("bench_{}_{batch}", allocator.to_ascii_lowercase());
    let client = fresh_database(pg, &name, allocator, orders).await;
    let nats_dir: PathBuf = dir.join(format!("nats_{name}"));
    let nats = Running(Server::start(Kind::Nats, &nats_dir, None).expect("start nats"));
    let log_config =
        LogConfig { url: nats.0.url(), max_ack_pending: 20_000, ..LogConfig::default() };
    let log = Log::connect(&log_config).await.expect("connect nats");
    log.ensure_streams().await.expect("streams");
    log.ensure_consumers().await.expect("consumers");
    let publisher = log.publisher();
    let all = messages(orders);
    for chunk in all.chunks(1_000) {
        for result in
            futures::future::join_all(chunk.iter().map(|m| publisher.publish_order(m))).await
        {
            result.expect("publish");
        }
    }

    let config = WorkerConfig {
        pg: PgPoolConfig {
            url: db_url(pg, &name),
            pool_size: writers + 2,
            ..PgPoolConfig::default()
        },
        log: log_config,
        order_writers: writers,
        batch_max: batch,
        fetch_max: batch,
        ..WorkerConfig::default()
    };
    let load_before = load_average();
    let asked = Instant::now();
    let worker = start(config).expect("start worker");
    let started = Instant::now();
    let startup_ms = (started - asked).as_millis();
    // Drained (nothing pending, nothing unacked) means every message was acked, and a message
    // is acked only after its order committed. Polling JetStream every 5 ms costs the machine
    // far less than counting orders in PostgreSQL that often.
    let orders_stream =
        log.context().get_stream(flashsale_io::log::ORDERS_STREAM).await.expect("stream");
    loop {
        let info = orders_stream
            .consumer_info(flashsale_io::log::ORDER_WRITER_CONSUMER)
            .await
            .expect("consumer info");
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(300), "{name}: not drained after 300 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let committed: i64 =
        client.query_one("SELECT count(*) FROM orders", &[]).await.expect("count").get(0);
    assert_eq!(committed, orders, "{name}: drained with {committed} orders");
    worker.shutdown().expect("shutdown");
    let report = check_invariants(&client, ACTIVITY, SKU).await.expect("invariants");
    assert!(report.ok(), "{name}: {report:#?}");
    assert_eq!(report.orders_live, orders);
    Case { allocator: allocator.to_owned(), batch, seconds, startup_ms, load_before }
}

fn pgbench_binary() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin/pgbench"))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}

/// Runs the single-message transaction with pgbench (`orders` transactions in all) on a fresh
/// database whose SKU has more units than transactions; returns its TPS.
async fn pgbench(pg: &Server, allocator: &str, clients: usize, orders: i64) -> Result<f64, String> {
    let binary = pgbench_binary().ok_or("pgbench not found under /usr/lib/postgresql")?;
    let name = format!("pgbench_{}", allocator.to_ascii_lowercase());
    drop(fresh_database(pg, &name, allocator, orders + orders / 5).await);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("pgbench/order_txn.sql");
    let per_client = (orders as usize).div_ceil(clients);
    let output = Command::new(binary)
        .args(["-n", "-M", "prepared", "-f"])
        .arg(&script)
        .args(["-c", &clients.to_string(), "-j", "2", "-t", &per_client.to_string()])
        .args(["-D", &format!("activity={ACTIVITY}"), "-D", &format!("sku={SKU}")])
        .args(["-h", "127.0.0.1", "-p", &pg.port.to_string(), "-U", "postgres", &name])
        .output()
        .map_err(|e| format!("run pgbench: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "pgbench failed: {}{}",
            stdout,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    stdout
        .lines()
        .find(|l| l.starts_with("tps = ") && l.contains("without initial connection"))
        .and_then(|l| l.trim_start_matches("tps = ").split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no tps line in: {stdout}"))
}
