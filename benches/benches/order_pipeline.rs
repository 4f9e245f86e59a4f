//! Order pipeline throughput and PostgreSQL's CPU per order: N order-create messages already in
//! `SECKILL_ORDERS` → time until all N orders are committed by the worker
//! (`flashsale_pg_worker::start`), fsync on, with the CPU the postgres processes used for it;
//! each case is a write path (set-based or per message), a batch bound and a writer count;
//! then, optionally, pgbench running the per-message single-message transaction
//! (`benches/pgbench/order_txn.sql`) against the same server, for the ratio.
//!
//! A bench, not a timed test (`harness = false`): `cargo bench -p flashsale-benches --bench
//! order_pipeline`. It starts its own PostgreSQL (`initdb` in a temp dir, fsync on) and a fresh
//! nats-server per case, with the stack code of `flashsale stack up`; nothing touches the
//! machine's servers. Each case gets a fresh database, so no case inherits another's bloat.
//!
//! Knobs (environment):
//! - `FLASHSALE_BENCH_ORDERS` (10000);
//! - `FLASHSALE_BENCH_CASES`: comma-separated `path:batch:writers[:option...]`, path `set` or
//!   `per_message`; for `set` the batch is `fetch_max` (the adaptive bound; `fetch_min` is
//!   min(32, batch)), for `per_message` it is `batch_max` (= `fetch_max`, at most 64); options:
//!   `ff50` (inventory_token at fillfactor 50 before the tokens are generated), `cd`
//!   (`commit_delay = 100`, `commit_siblings = 2` on the server for this case), `row` (the ROW
//!   allocator instead of TOKEN), `noout` (the outbox publisher held back, to attribute
//!   PostgreSQL's CPU; not a production setting), `fixed` (`fetch_min = fetch_max`: no
//!   adaptive growth), `mix` (buyers of 1, 2 and 3 units in turn, issue 29: 2 units per order
//!   on average, the SKU's limit 3; the table gives per order and per unit). Default: the baseline (`per_message:32:4`), the old worker
//!   default (`per_message:32:6`), the new default (`set:512:4`), and the set path at 512
//!   with 2 writers and at 128 and 32 with 4, and the new default with the quantity mix;
//! - `FLASHSALE_BENCH_REPEATS` (3): every case that many times, interleaved (case 1, case 2,
//!   ..., case 1, ...), so a noisy spell of the shared machine spreads over all cases;
//!   medians are reported, and ratios against the first case;
//! - `FLASHSALE_BENCH_PGBENCH_CLIENTS` (0 = skip; the old bench ran 8).
//!
//! Timing: from the moment `start` returns (connected, streams and pool ready, tasks spawned)
//! until `order-writer` is drained: nothing pending, nothing unacked (polled every 5 ms); a
//! message is acked only after its order committed, and the count is checked afterwards.
//! The worker's outbox publisher runs during the measurement, as in production. Every case
//! ends with the invariant checker.
//!
//! PostgreSQL CPU: utime + stime of the postmaster and every live child (backends, WAL writer,
//! checkpointer, autovacuum), plus the postmaster's cutime + cstime (children that exited
//! meanwhile), read from /proc before and after the measured interval
//! (`flashsale_engine::app::cpu`, shared with `flashsale demo`'s CPU table). The bench process's
//! own CPU (worker, NATS client, the drain poll) is printed beside it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use flashsale_benches::loadgen::search::median;
use flashsale_benches::pg::{
    connect, db_url, fresh_database, load_average, order_create, Running, SkuSpec, ACTIVITY, SKU,
};
use flashsale_engine::app::cpu::{postgres_ticks, self_ticks, TICKS_PER_S};
use flashsale_engine::app::stack::{Kind, Server};
use flashsale_io::jetstream::{Log, LogConfig};
use flashsale_io::wire::OrderCreate;
use flashsale_pg_worker::{check_invariants, start, OrderPath, PgPoolConfig, WorkerConfig};
use tokio_postgres::Client;

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

/// One configuration to measure.
#[derive(Debug, Clone, PartialEq)]
struct Spec {
    path: OrderPath,
    batch: usize,
    writers: usize,
    allocator: &'static str,
    /// inventory_token at fillfactor 50 (half-empty pages; the schema keeps the default 100).
    half_empty_tokens: bool,
    commit_delay: bool,
    /// The ask fixed at the bound (`fetch_min = fetch_max`) instead of growing from 32.
    fixed_ask: bool,
    /// The outbox publisher held back during the measurement (for attribution only: in
    /// production it runs beside the writers).
    no_outbox: bool,
    /// Orders of 1, 2 and 3 units in turn instead of one unit each.
    mixed_quantities: bool,
}

impl Spec {
    fn parse(text: &str) -> Spec {
        let parts: Vec<&str> = text.split(':').collect();
        assert!(parts.len() >= 3, "case {text:?} is not path:batch:writers[:options]");
        let path = match parts[0] {
            "set" => OrderPath::SetBased,
            "per_message" => OrderPath::PerMessage,
            other => panic!("case {text:?}: unknown path {other:?}"),
        };
        let number = |s: &str| s.parse::<usize>().unwrap_or_else(|_| panic!("case {text:?}"));
        let options = &parts[3..];
        Spec {
            path,
            batch: number(parts[1]),
            writers: number(parts[2]),
            allocator: if options.contains(&"row") { "ROW" } else { "TOKEN" },
            half_empty_tokens: options.contains(&"ff50"),
            commit_delay: options.contains(&"cd"),
            no_outbox: options.contains(&"noout"),
            fixed_ask: options.contains(&"fixed"),
            mixed_quantities: options.contains(&"mix"),
        }
    }

    fn label(&self) -> String {
        let path = match self.path {
            OrderPath::SetBased => "set",
            OrderPath::PerMessage => "per-message",
        };
        let mut label = format!("{path} batch {} writers {}", self.batch, self.writers);
        if self.allocator == "ROW" {
            label.push_str(" ROW");
        }
        if self.half_empty_tokens {
            label.push_str(" fillfactor 50");
        }
        if self.commit_delay {
            label.push_str(" commit_delay 100us");
        }
        if self.no_outbox {
            label.push_str(" outbox held");
        }
        if self.fixed_ask {
            label.push_str(" fixed ask");
        }
        if self.mixed_quantities {
            label.push_str(" 1-3 units");
        }
        label
    }

    /// Units of the `n`th order (from 1).
    fn quantity(&self, n: u64) -> u32 {
        if self.mixed_quantities {
            1 + (n % 3) as u32
        } else {
            1
        }
    }

    fn worker_config(&self, url: String, log: LogConfig) -> WorkerConfig {
        let (batch_max, fetch_min) = match self.path {
            OrderPath::SetBased if self.fixed_ask => (self.batch.min(32), self.batch),
            OrderPath::SetBased => (self.batch.min(32), self.batch.min(32)),
            OrderPath::PerMessage => (self.batch, self.batch),
        };
        WorkerConfig {
            pg: PgPoolConfig { url, pool_size: self.writers + 2, ..PgPoolConfig::default() },
            log,
            order_writers: self.writers,
            order_path: self.path,
            batch_max,
            fetch_min,
            fetch_max: self.batch,
            // Held: the publisher's first round finds nothing, the next is after the case.
            outbox_idle_ms: if self.no_outbox { 600_000 } else { 20 },
            ..WorkerConfig::default()
        }
    }
}

struct Sample {
    seconds: f64,
    /// Units the orders hold (= orders unless the case mixes quantities).
    units: i64,
    pg_cpu_s: f64,
    bench_cpu_s: f64,
    wal_bytes: i64,
    /// The 1-minute load average before the case: the machine is shared, and a number taken
    /// while something else was busy says so here.
    load_before: String,
}

async fn wal_lsn(admin: &Client) -> String {
    admin.query_one("SELECT pg_current_wal_lsn()::text", &[]).await.expect("wal lsn").get(0)
}

/// WAL bytes written since `lsn` (the whole server: the case is alone on it).
async fn wal_since(admin: &Client, lsn: &str) -> i64 {
    let row = admin
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::bigint",
            &[&lsn],
        )
        .await
        .expect("wal diff");
    row.get(0)
}

fn main() {
    let orders: i64 = env_or("FLASHSALE_BENCH_ORDERS", 10_000);
    let repeats: usize = env_or("FLASHSALE_BENCH_REPEATS", 3);
    let pgbench_clients: usize = env_or("FLASHSALE_BENCH_PGBENCH_CLIENTS", 0);
    let specs: Vec<Spec> = env_list(
        "FLASHSALE_BENCH_CASES",
        "per_message:32:4,per_message:32:6,set:512:4,set:512:2,set:128:4,set:32:4,set:512:4:mix",
    )
    .iter()
    .map(|c| Spec::parse(c))
    .collect();
    let ticks_per_s = TICKS_PER_S as f64;

    let dir =
        tempfile::Builder::new().prefix("flashsale-bench-orders-").tempdir().expect("temp dir");
    let pg = Running(
        Server::start(Kind::Postgres, &dir.path().join("pg"), None).expect("start PostgreSQL"),
    );
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    println!(
        "order pipeline: {orders} messages in the log -> {orders} committed orders; \
         PostgreSQL fsync=on on port {}; {repeats} rounds of {} cases, interleaved",
        pg.0.port,
        specs.len()
    );

    let mut samples: Vec<Vec<Sample>> = specs.iter().map(|_| Vec::new()).collect();
    for round in 0..repeats {
        for (index, spec) in specs.iter().enumerate() {
            let name = format!("bench_{index}_{round}");
            let sample =
                runtime.block_on(run_case(&pg.0, dir.path(), &name, spec, orders, ticks_per_s));
            println!(
                "  round {round} {:<44} {:>6.3} s {:>7.0} orders/s  PG CPU {:>6.3} s = {:>4.0} us/order  \
                 WAL {:>5.0} B/order  {:>6} units  bench process CPU {:>5.2} s  (load average before {})",
                spec.label(),
                sample.seconds,
                orders as f64 / sample.seconds,
                sample.pg_cpu_s,
                sample.pg_cpu_s * 1e6 / orders as f64,
                sample.wal_bytes as f64 / orders as f64,
                sample.units,
                sample.bench_cpu_s,
                sample.load_before
            );
            samples[index].push(sample);
        }
    }
    report(&specs, &mut samples, orders);

    if pgbench_clients > 0 {
        match runtime.block_on(pgbench(&pg.0, "TOKEN", pgbench_clients, orders)) {
            Ok(tps) => println!(
                "\npgbench TOKEN (per-message function, one message per transaction, \
                 {pgbench_clients} clients): {tps:.0} TPS"
            ),
            Err(e) => println!("\npgbench: not run ({e})"),
        }
    }
}

/// Medians per case, per order and per unit, and ratios against the first case (measured
/// in the same rounds).
fn report(specs: &[Spec], samples: &mut [Vec<Sample>], orders: i64) {
    println!(
        "\n| case | {orders} orders, median s | orders/s | units/s | PG CPU us/order | \
         PG CPU us/unit | x first case time | x first case PG CPU |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let medians: Vec<(f64, f64)> = samples
        .iter()
        .map(|case| {
            let seconds: Vec<f64> = case.iter().map(|s| s.seconds).collect();
            let cpu: Vec<f64> = case.iter().map(|s| s.pg_cpu_s).collect();
            (median(seconds), median(cpu))
        })
        .collect();
    let (base_s, base_cpu) = medians[0];
    for ((spec, case), (seconds, cpu)) in specs.iter().zip(samples.iter()).zip(&medians) {
        // Every round of a case has the same units (the messages are the same).
        let units = case.first().map_or(orders, |s| s.units) as f64;
        println!(
            "| {} | {seconds:.3} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |",
            spec.label(),
            orders as f64 / seconds,
            units / seconds,
            cpu * 1e6 / orders as f64,
            cpu * 1e6 / units,
            seconds / base_s,
            cpu / base_cpu
        );
    }
}

fn messages(count: i64, spec: &Spec) -> Vec<OrderCreate> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    (1..=count as u64).map(|n| order_create(n, spec.quantity(n), now)).collect()
}

async fn run_case(
    pg: &Server,
    dir: &Path,
    name: &str,
    spec: &Spec,
    orders: i64,
    ticks_per_s: f64,
) -> Sample {
    let all = messages(orders, spec);
    let units: i64 = all.iter().map(|m| i64::from(m.quantity)).sum();
    let max_per_buyer = all.iter().map(|m| m.quantity as i32).max().unwrap_or(1);
    let sku = SkuSpec {
        allocator: spec.allocator,
        half_empty_tokens: spec.half_empty_tokens,
        stock: units,
        max_per_buyer,
    };
    let client = fresh_database(pg, name, &sku).await;
    let admin = connect(&pg.url()).await;
    // ALTER SYSTEM refuses to run in a transaction block: one statement per call.
    let settings = if spec.commit_delay {
        ["ALTER SYSTEM SET commit_delay = 100", "ALTER SYSTEM SET commit_siblings = 2"]
    } else {
        ["ALTER SYSTEM RESET commit_delay", "ALTER SYSTEM RESET commit_siblings"]
    };
    for sql in settings.into_iter().chain(["SELECT pg_reload_conf()"]) {
        admin.batch_execute(sql).await.expect("commit_delay");
    }
    let nats_dir: PathBuf = dir.join(format!("nats_{name}"));
    let nats = Running(Server::start(Kind::Nats, &nats_dir, None).expect("start nats"));
    let log_config =
        LogConfig { url: nats.0.url(), max_ack_pending: 20_000, ..LogConfig::default() };
    let log = Log::connect(&log_config).await.expect("connect nats");
    log.ensure_streams().await.expect("streams");
    log.ensure_consumers().await.expect("consumers");
    let publisher = log.publisher();
    for chunk in all.chunks(1_000) {
        for result in
            futures::future::join_all(chunk.iter().map(|m| publisher.publish_order(m))).await
        {
            result.expect("publish");
        }
    }

    let config = spec.worker_config(db_url(pg, name), log_config);
    let load_before = load_average();
    let worker = start(config).expect("start worker");
    let started = Instant::now();
    let (pg_before, self_before) = (postgres_ticks(pg.pid).unwrap_or(0), self_ticks());
    let wal_before = wal_lsn(&admin).await;
    // Drained (nothing pending, nothing unacked) means every message was acked, and a message
    // is acked only after its order committed. Polling JetStream every 5 ms costs the machine
    // far less than counting orders in PostgreSQL that often.
    let orders_stream =
        log.context().get_stream(flashsale_io::jetstream::ORDERS_STREAM).await.expect("stream");
    loop {
        let info = orders_stream
            .consumer_info(flashsale_io::jetstream::ORDER_WRITER_CONSUMER)
            .await
            .expect("consumer info");
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(300), "{name}: not drained after 300 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let (pg_after, self_after) = (postgres_ticks(pg.pid).unwrap_or(0), self_ticks());
    let wal_bytes = wal_since(&admin, &wal_before).await;
    let committed: i64 =
        client.query_one("SELECT count(*) FROM orders", &[]).await.expect("count").get(0);
    assert_eq!(committed, orders, "{name}: drained with {committed} orders");
    worker.shutdown().expect("shutdown");
    let report = check_invariants(&client, ACTIVITY, SKU).await.expect("invariants");
    assert!(report.ok(), "{name}: {report:#?}");
    assert_eq!((report.orders_live, report.units_live), (orders, units), "{name}: sold out");
    drop(client);
    admin
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .expect("drop the case database");
    Sample {
        seconds,
        units,
        pg_cpu_s: pg_after.saturating_sub(pg_before) as f64 / ticks_per_s,
        bench_cpu_s: self_after.saturating_sub(self_before) as f64 / ticks_per_s,
        wal_bytes,
        load_before,
    }
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
    // Only the SKU's allocator matters here (the path and batch are the worker's).
    let sku = SkuSpec {
        allocator: if allocator == "ROW" { "ROW" } else { "TOKEN" },
        half_empty_tokens: false,
        stock: orders + orders / 5,
        max_per_buyer: 1,
    };
    drop(fresh_database(pg, &name, &sku).await);
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
