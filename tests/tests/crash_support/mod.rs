//! Support for the crash drills (`crash_drills.rs`): the engine in a child process that can
//! die at a failpoint, the servers that outlive it, a load driver that survives the crash,
//! and the end-of-drill checks (DESIGN.md section 8 and the promise to every queued buyer).
//!
//! Why a child process: a crash must take the whole engine down at once (shards, durable
//! side, in-process worker), as `kill -9` does, while Redis, NATS and PostgreSQL keep their
//! data. The drill re-executes its own test binary (`current_exe() --exact drill_child`)
//! with the servers' URLs in the environment; the child runs the engine in-process exactly
//! as `flashsale serve` does ([`flashsale_engine::app::serve::start`] with a worker), configures
//! the failpoint with `fail::cfg_callback`, and prints its ports. Spawning
//! `target/debug/flashsale serve` instead would need the binary built with the `failpoints`
//! feature (`cargo test -p flashsale-tests` does not build it) and a way to configure an
//! abort from the environment, which the `fail` crate's action strings do not offer.
//!
//! Why `abort()` in a callback: the process dies exactly at the point, on the thread that
//! reached it, with no destructor, flush or graceful step — the stores see the same thing as
//! after `kill -9` (sockets reset, nothing acked). `pause` + SIGKILL from the parent would
//! leave a window in which the other shards and the worker keep running past the point.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flashsale_engine::app::serve;
use flashsale_io::jetstream::LogConfig;
use flashsale_tests::{PrivateNats, PrivateRedis, TestDb};
use serde_json::Value;

pub const CHILD_TEST: &str = "drill_child";
const ENV_CHILD: &str = "FLASHSALE_DRILL_CHILD";
const ENV_REDIS: &str = "FLASHSALE_DRILL_REDIS";
const ENV_NATS: &str = "FLASHSALE_DRILL_NATS";
const ENV_PG: &str = "FLASHSALE_DRILL_PG";
/// `name:hit` — abort on the `hit`-th evaluation of failpoint `name`.
const ENV_FAILPOINT: &str = "FLASHSALE_DRILL_FAILPOINT";
/// `0`: no in-process worker (messages stay in SECKILL_ORDERS).
const ENV_WORKER: &str = "FLASHSALE_DRILL_WORKER";
const READY: &str = "DRILL_READY";

/// Short repair deadlines so that a drill resolves in seconds.
pub const PENDING_GRACE_MS: u64 = 300;
pub const ORDER_DEADLINE_MS: u64 = 1_500;
pub const ACK_WAIT_MS: u64 = 1_000;

/// One drill at a time: each drives a 2-shard engine, a worker and three servers on a
/// 2-core machine; in parallel their deadlines would measure the scheduler.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---- the child ----------------------------------------------------------------------------

/// A test log config: 1 s ack wait, no server backoff list (both sides must agree: the
/// consumers are created or updated by whoever starts first).
fn log_config(url: &str) -> LogConfig {
    LogConfig {
        url: url.to_owned(),
        ack_wait_ms: ACK_WAIT_MS,
        backoff_ms: Vec::new(),
        max_deliver: 20,
        ..LogConfig::default()
    }
}

/// The body of the `drill_child` test: runs only when started by a drill.
pub fn child_main() {
    if std::env::var(ENV_CHILD).is_err() {
        eprintln!("drill_child: not started by a crash drill; nothing to do");
        return;
    }
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"));
    let redis: SocketAddr = var(ENV_REDIS).parse().unwrap();
    let nats = var(ENV_NATS);
    let pg = var(ENV_PG);
    if let Ok(spec) = std::env::var(ENV_FAILPOINT) {
        let (name, hit) = spec.split_once(':').unwrap();
        let hit: u64 = hit.parse().unwrap();
        let hits = AtomicU64::new(0);
        let point = name.to_owned();
        fail::cfg_callback(name, move || {
            if hits.fetch_add(1, Ordering::Relaxed) + 1 == hit {
                eprintln!("{}", failpoint_line(&point, hit));
                std::process::abort();
            }
        })
        .unwrap();
    }
    let mut config = flashsale_tests::serve_config(redis, &nats, &pg);
    let edge = &mut config.edge;
    edge.pending_grace_ms = PENDING_GRACE_MS;
    edge.order_deadline_ms = ORDER_DEADLINE_MS;
    edge.scanner.interval_ms = 100;
    edge.scanner.sku_refresh_ms = 200;
    edge.scanner.backoff_base_ms = 300;
    edge.scanner.backoff_max_ms = 1_000;
    config.durable.log = log_config(&nats);
    if std::env::var(ENV_WORKER).as_deref() != Ok("0") {
        let mut worker = flashsale_tests::small_worker(&config);
        worker.log = log_config(&nats);
        worker.nak_backoff_ms = vec![100, 200, 500];
        config.worker = Some(worker);
    }
    let handle = serve::start(config).expect("engine starts");
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{READY} {} {}", handle.http_addr, handle.admin_addr).unwrap();
        out.flush().unwrap();
    }
    // Runs until the drill closes our stdin (or dies), or a failpoint aborts us.
    let mut sink = Vec::new();
    let _ = std::io::stdin().lock().read_to_end(&mut sink);
    handle.shutdown();
}

/// The servers a drill keeps alive across engine crashes.
pub struct Stores {
    pub redis: PrivateRedis,
    pub nats: PrivateNats,
    pub db: TestDb,
}

impl Stores {
    pub fn start(rt: &tokio::runtime::Runtime) -> Stores {
        let redis = flashsale_tests::redis();
        let nats = flashsale_tests::nats();
        let db = rt.block_on(async {
            let db = flashsale_tests::pg_database().await;
            let mut client = pg_connect(&db.url).await;
            flashsale_pg_worker::migrate(&mut client).await.unwrap();
            db
        });
        Stores { redis, nats, db }
    }
}

pub async fn pg_connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// Options of one child engine.
#[derive(Default, Clone)]
pub struct ChildOptions {
    /// `(failpoint, hit)`: abort on that evaluation.
    pub failpoint: Option<(&'static str, u64)>,
    pub no_worker: bool,
}

/// The engine in a child process; killed (SIGKILL) when dropped.
pub struct EngineProcess {
    child: Child,
    pub http: SocketAddr,
    pub admin: SocketAddr,
    failpoint: Option<(&'static str, u64)>,
    /// The child's `drill_child:` stderr lines, sent once its stderr closes (it died).
    stderr_lines: std::sync::mpsc::Receiver<Vec<String>>,
}

/// The line the child's failpoint callback writes just before it aborts (see `child_main`).
fn failpoint_line(name: &str, hit: u64) -> String {
    format!("drill_child: failpoint {name} hit #{hit}: abort")
}

impl EngineProcess {
    pub fn spawn(stores: &Stores, options: ChildOptions) -> EngineProcess {
        let exe = std::env::current_exe().unwrap();
        let mut command = Command::new(exe);
        command
            .args(["--exact", CHILD_TEST, "--nocapture", "--include-ignored", "--test-threads=1"])
            .env(ENV_CHILD, "1")
            .env(ENV_REDIS, stores.redis.addr().to_string())
            .env(ENV_NATS, stores.nats.url())
            .env(ENV_PG, &stores.db.url)
            .env_remove(ENV_FAILPOINT)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some((name, hit)) = options.failpoint {
            command.env(ENV_FAILPOINT, format!("{name}:{hit}"));
        }
        if options.no_worker {
            command.env(ENV_WORKER, "0");
        }
        let mut child = command.spawn().expect("spawn the engine child");
        // Echoes the child's stderr into this test's output and keeps its own lines, so that
        // an abort can be told to be the failpoint's and not any other.
        let stderr = child.stderr.take().unwrap();
        let (lines_tx, stderr_lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut own = Vec::new();
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("{line}");
                if line.contains("drill_child:") {
                    own.push(line);
                }
            }
            let _ = lines_tx.send(own);
        });
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads the ready line, then drains the rest so the child never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // The harness may have printed "test drill_child ... " on the same line.
                if let Some(rest) = line.find(READY).map(|at| &line[at + READY.len()..]) {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(rest.trim().to_owned());
                    }
                }
            }
        });
        let ready = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(ready) => ready,
            Err(_) => {
                let _ = child.kill();
                panic!("the engine child did not report ready: {:?}", child.wait());
            }
        };
        let mut addrs = ready.split(' ').map(|a| a.parse::<SocketAddr>().unwrap());
        let (http, admin) = (addrs.next().unwrap(), addrs.next().unwrap());
        EngineProcess { child, http, admin, failpoint: options.failpoint, stderr_lines }
    }

    /// Waits for the child to die at its failpoint; asserts it aborted (SIGABRT) and that the
    /// abort was the failpoint's own (its line on the child's stderr), not another one.
    pub fn expect_abort(mut self, within: Duration) {
        let (name, hit) = self.failpoint.expect("expect_abort needs a failpoint");
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert_eq!(
                    status.signal(),
                    Some(libc::SIGABRT),
                    "the engine child should die at its failpoint, got {status:?}"
                );
                let lines = self
                    .stderr_lines
                    .recv_timeout(Duration::from_secs(10))
                    .expect("the dead child's stderr closes");
                let expected = failpoint_line(name, hit);
                assert!(
                    lines.iter().any(|l| l.contains(&expected)),
                    "aborted, but not at {name}#{hit}: the child wrote {lines:?}"
                );
                return;
            }
            assert!(Instant::now() < deadline, "the failpoint was not reached within {within:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Graceful stop: closes stdin, the child drains and exits 0.
    pub fn stop(mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "engine child exit: {status:?}");
                return;
            }
            assert!(Instant::now() < deadline, "engine child did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn create_activity(&self, activity: u64, sku: u64, stock: u64) -> u16 {
        self.create_activity_limited(activity, sku, stock, 1)
    }

    /// [`EngineProcess::create_activity`] whose buyers may take `max_per_buyer` units each.
    pub fn create_activity_limited(
        &self,
        activity: u64,
        sku: u64,
        stock: u64,
        max_per_buyer: u32,
    ) -> u16 {
        let body = format!(
            r#"{{"activity_id":{activity},"sku_id":{sku},"stock":{stock},"max_per_buyer":{max_per_buyer}}}"#
        );
        let (status, v) = http(self.admin, "POST", "/admin/v1/activities", None, Some(&body))
            .expect("admin answers");
        assert!(status == 201 || status == 200, "create activity: {status} {v}");
        status
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---- HTTP that survives a dying server ----------------------------------------------------

/// One request on a fresh connection; `None` when the server is gone or closed first.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    body: Option<&str>,
) -> Option<(u16, Value)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    stream.set_nodelay(true).ok()?;
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: drill\r\nConnection: close\r\n");
    if let Some(token) = bearer {
        raw.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    match body {
        Some(body) => raw.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )),
        None => raw.push_str("\r\n"),
    }
    stream.write_all(raw.as_bytes()).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
            let len: usize = head
                .split("\r\n")
                .filter_map(|l| l.split_once(':'))
                .find(|(n, _)| n.trim().eq_ignore_ascii_case("content-length"))
                .and_then(|(_, v)| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                let body = &buf[end + 4..end + 4 + len];
                return Some((status, serde_json::from_slice(body).ok()?));
            }
        }
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

pub use flashsale_tests::sale::pass;

/// One submit of `intent` (its request id, quantity 1) on a fresh connection; `None` when no
/// answer came.
pub fn submit_once(
    addr: SocketAddr,
    activity: u64,
    sku: u64,
    intent: &Intent,
) -> Option<(u16, Value)> {
    let body = format!(
        r#"{{"activity_id":{activity},"sku_id":{sku},"request_id":"{}","quantity":{}}}"#,
        intent.request_id, intent.quantity
    );
    http(addr, "POST", "/v1/reservations", Some(&pass(intent.user, activity)), Some(&body))
}

pub fn state(v: &Value) -> &str {
    v["state"].as_str().unwrap_or("")
}

/// One buyer's intent: a request id reused on every retry, and what it was told.
#[derive(Debug, Clone)]
pub struct Intent {
    pub user: u64,
    pub request_id: String,
    /// The units asked.
    pub quantity: u32,
    /// Every answer received, in order (`None`: no answer — the server died or was down).
    pub answers: Vec<Option<(u16, Value)>>,
}

impl Intent {
    pub fn new(user: u64, request_id: String) -> Intent {
        Intent { user, request_id, quantity: 1, answers: Vec::new() }
    }

    pub fn last_state(&self) -> Option<&str> {
        self.answers.last().and_then(|a| a.as_ref()).map(|(_, v)| state(v))
    }

    /// Told QUEUED or QUEUED_PENDING at least once: the promise applies.
    pub fn promised(&self) -> bool {
        self.answers.iter().flatten().any(|(_, v)| matches!(state(v), "QUEUED" | "QUEUED_PENDING"))
    }

    /// The reservation ids it was told (all must be one: I6).
    pub fn reservation_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .answers
            .iter()
            .flatten()
            .filter_map(|(_, v)| v["reservation_id"].as_str().map(str::to_owned))
            .collect();
        ids.dedup();
        ids
    }

    /// A final submit answer: nothing more to retry.
    pub fn settled(&self) -> bool {
        matches!(
            self.last_state(),
            Some("QUEUED" | "QUEUED_PENDING" | "SOLD_OUT" | "DUPLICATE_USER")
        )
    }
}

/// Submits every unsettled intent once, from `threads` client threads; returns them with the
/// new answers appended. Any error (refused, reset, EOF) is recorded as no answer.
pub fn submit_all(
    addr: SocketAddr,
    activity: u64,
    sku: u64,
    intents: Vec<Intent>,
    threads: usize,
) -> Vec<Intent> {
    let queue = Arc::new(Mutex::new(intents.into_iter().enumerate().collect::<Vec<_>>()));
    let done = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (queue, done) = (Arc::clone(&queue), Arc::clone(&done));
            std::thread::spawn(move || loop {
                let Some((i, mut intent)) = queue.lock().unwrap().pop() else { return };
                if !intent.settled() {
                    let answer = submit_once(addr, activity, sku, &intent);
                    intent.answers.push(answer);
                }
                done.lock().unwrap().push((i, intent));
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let mut done = std::mem::take(&mut *done.lock().unwrap());
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, intent)| intent).collect()
}

/// Retries unsettled intents (same request ids) until each has a final answer.
pub fn settle_all(
    addr: SocketAddr,
    activity: u64,
    sku: u64,
    mut intents: Vec<Intent>,
) -> Vec<Intent> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while intents.iter().any(|i| !i.settled()) {
        assert!(
            Instant::now() < deadline,
            "intents without a final answer: {:?}",
            intents.iter().filter(|i| !i.settled()).collect::<Vec<_>>()
        );
        intents = submit_all(addr, activity, sku, intents, 4);
        if intents.iter().any(|i| !i.settled()) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    for intent in &intents {
        let s = intent.last_state().unwrap();
        assert!(
            matches!(s, "QUEUED" | "QUEUED_PENDING" | "SOLD_OUT" | "DUPLICATE_USER"),
            "unexpected final answer {s}: {intent:?}"
        );
        assert!(
            intent.reservation_ids().len() <= 1,
            "I6: one request id, one reservation: {intent:?}"
        );
    }
    intents
}

/// What a query finally said about a promised intent.
#[derive(Debug, Clone)]
pub struct Resolution {
    pub state: String,
    pub reservation_id: Option<String>,
    pub order_id: Option<String>,
    pub reason_code: Option<String>,
}

/// Queries every promised intent until each is SUCCEEDED or FAILED (the promise), or panics
/// after `within`.
pub fn resolve_all(
    addr: SocketAddr,
    activity: u64,
    sku: u64,
    intents: &[Intent],
    within: Duration,
) -> BTreeMap<String, Resolution> {
    let deadline = Instant::now() + within;
    let mut resolved = BTreeMap::new();
    loop {
        let mut open = Vec::new();
        for intent in intents.iter().filter(|i| i.promised()) {
            if resolved.contains_key(&intent.request_id) {
                continue;
            }
            let path = format!(
                "/v1/reservations/{}?activity_id={activity}&sku_id={sku}",
                intent.request_id
            );
            let token = pass(intent.user, activity);
            match http(addr, "GET", &path, Some(&token), None) {
                Some((_, v)) if matches!(state(&v), "SUCCEEDED" | "FAILED") => {
                    let text = |k: &str| v[k].as_str().map(str::to_owned);
                    resolved.insert(
                        intent.request_id.clone(),
                        Resolution {
                            state: state(&v).to_owned(),
                            reservation_id: text("reservation_id"),
                            order_id: text("order_id"),
                            reason_code: text("reason_code"),
                        },
                    );
                }
                other => open.push((intent.request_id.clone(), other)),
            }
        }
        if open.is_empty() {
            return resolved;
        }
        assert!(
            Instant::now() < deadline,
            "promise broken: {} queued requests unresolved after {within:?}, e.g. {:?}",
            open.len(),
            &open[..open.len().min(5)]
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

// ---- Redis and PostgreSQL views -----------------------------------------------------------

pub fn redis_cmd(stores: &Stores, args: &[&str]) -> String {
    flashsale_tests::redis_cmd(&stores.redis, args)
}

/// Statuses of every reservation record of one SKU in Redis.
pub fn redis_reservations(stores: &Stores, activity: u64, sku: u64) -> BTreeMap<String, String> {
    const SCRIPT: &str = "local out = {} \
        for _, k in ipairs(redis.call('KEYS', ARGV[1])) do \
          out[#out + 1] = k; out[#out + 1] = redis.call('HGET', k, 'status') or '' end \
        return out";
    let pattern = format!("seckill:{{{activity}:{sku}}}:resv:resv_*");
    let out = redis_cmd(stores, &["EVAL", SCRIPT, "0", &pattern]);
    let lines: Vec<&str> = out.lines().collect();
    lines
        .chunks(2)
        .filter(|c| c.len() == 2)
        .map(|c| (c[0].rsplit(':').next().unwrap().to_owned(), c[1].to_owned()))
        .collect()
}

pub fn redis_int(stores: &Stores, args: &[&str]) -> i64 {
    let out = redis_cmd(stores, args);
    out.parse().unwrap_or_else(|_| panic!("{args:?} answered {out:?}"))
}

/// Waits until Redis has nothing pending for the SKU.
pub fn wait_pending_empty(stores: &Stores, activity: u64, sku: u64, within: Duration) {
    let key = format!("seckill:{{{activity}:{sku}}}:resv:pending");
    let deadline = Instant::now() + within;
    loop {
        let n = redis_int(stores, &["ZCARD", &key]);
        if n == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{n} reservations still pending after {within:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// PostgreSQL's side: DESIGN.md 8 items 1-3 and 7 (`check_invariants`), plus the facts the
/// drills compare with Redis.
pub struct PgView {
    pub report: flashsale_pg_worker::audit::InvariantReport,
    /// reservation_id -> status
    pub reservations: BTreeMap<String, String>,
    /// reservation_id -> order_id of live orders
    pub orders: BTreeMap<String, String>,
    /// The units of REJECTED_NO_FINAL_STOCK reservations (Redis keeps them sold: I5).
    pub kept_units: u64,
}

pub fn pg_view(rt: &tokio::runtime::Runtime, stores: &Stores, activity: u64, sku: u64) -> PgView {
    rt.block_on(async {
        let client = pg_connect(&stores.db.url).await;
        let report =
            flashsale_pg_worker::audit::check_invariants(&client, activity as i64, sku as i64)
                .await
                .unwrap();
        let rows = client
            .query(
                "SELECT reservation_id, status FROM inventory_reservation \
                 WHERE activity_id = $1 AND sku_id = $2",
                &[&(activity as i64), &(sku as i64)],
            )
            .await
            .unwrap();
        let reservations = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let rows = client
            .query(
                "SELECT reservation_id, order_id FROM orders WHERE activity_id = $1 AND sku_id = $2 \
                 AND status NOT IN ('CANCELLED', 'CLOSED')",
                &[&(activity as i64), &(sku as i64)],
            )
            .await
            .unwrap();
        let orders = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let kept: i64 = client
            .query_one(
                "SELECT coalesce(sum(quantity), 0)::bigint FROM inventory_reservation \
                 WHERE activity_id = $1 AND sku_id = $2 AND status = 'REJECTED_NO_FINAL_STOCK'",
                &[&(activity as i64), &(sku as i64)],
            )
            .await
            .unwrap()
            .get(0);
        PgView { report, reservations, orders, kept_units: kept as u64 }
    })
}

/// PostgreSQL's invariants (DESIGN.md 8 items 1-3, 7): `check_invariants` and nothing left
/// in PROCESSING.
pub fn assert_pg(pg: &PgView) {
    assert!(pg.report.ok(), "PostgreSQL invariants: {:?}", pg.report);
    assert_eq!(pg.report.reservations_processing, 0, "{:?}", pg.report);
    assert!(pg.report.units_live <= pg.report.total_stock, "{:?}", pg.report);
}

/// Redis' side when Redis kept its data (I4, I5): nothing pending or stuck, every reservation
/// final and known to PostgreSQL with the same outcome, stock ≥ 0 and conserved.
pub fn assert_redis_settled(stores: &Stores, pg: &PgView, activity: u64, sku: u64, stock: u64) {
    let prefix = format!("seckill:{{{activity}:{sku}}}");
    assert_eq!(redis_int(stores, &["ZCARD", &format!("{prefix}:resv:pending")]), 0);
    assert_eq!(redis_int(stores, &["ZCARD", &format!("{prefix}:resv:stuck")]), 0, "stuck");
    let redis = redis_reservations(stores, activity, sku);
    for (id, status) in &redis {
        assert!(
            matches!(status.as_str(), "ORDER_CREATED" | "FAILED" | "COMPENSATED"),
            "I4: reservation {id} ended as {status:?} in Redis"
        );
        let in_pg = pg.reservations.get(id).map(String::as_str);
        match status.as_str() {
            "ORDER_CREATED" => assert_eq!(in_pg, Some("ORDER_CREATED"), "{id}"),
            _ => assert!(
                in_pg.is_some_and(|s| s.starts_with("REJECTED_")),
                "{id}: {status} in Redis, {in_pg:?} in PostgreSQL"
            ),
        }
    }
    assert_eq!(
        redis.keys().collect::<Vec<_>>(),
        pg.reservations.keys().collect::<Vec<_>>(),
        "I4: the same reservations in Redis and PostgreSQL"
    );
    // I5: stock + units held (orders, and rejections that keep their units sold out) =
    // initial.
    let redis_stock = redis_int(stores, &["GET", &format!("{prefix}:stock")]);
    assert!(redis_stock >= 0, "I5: negative stock {redis_stock}");
    let (units, kept) = (pg.report.units_live as u64, pg.kept_units);
    assert_eq!(
        redis_stock as u64 + units + kept,
        stock,
        "I5 conservation: stock {redis_stock}, units ordered {units}, kept {kept}"
    );
}

/// The promise: every QUEUED/QUEUED_PENDING answer ended as an order (SUCCEEDED, the order in
/// PostgreSQL) or a compensated rejection (FAILED with a reason, `comp` marker set), and the
/// query names the reservation the submit named (I6).
pub fn assert_promise(
    stores: &Stores,
    pg: &PgView,
    activity: u64,
    sku: u64,
    intents: &[Intent],
    resolved: &BTreeMap<String, Resolution>,
) {
    let prefix = format!("seckill:{{{activity}:{sku}}}");
    let promised: Vec<&Intent> = intents.iter().filter(|i| i.promised()).collect();
    assert_eq!(promised.len(), resolved.len());
    for intent in promised {
        let r = &resolved[&intent.request_id];
        let told = intent.reservation_ids();
        assert_eq!(told.len(), 1, "{intent:?}");
        assert_eq!(r.reservation_id.as_deref(), Some(told[0].as_str()), "{intent:?} {r:?}");
        match r.state.as_str() {
            "SUCCEEDED" => {
                let order = r.order_id.as_deref().unwrap_or("");
                assert!(order.starts_with("ord_"), "{r:?}");
                assert_eq!(pg.orders.get(&told[0]).map(String::as_str), Some(order), "{r:?}");
            }
            "FAILED" => {
                let reason = r.reason_code.as_deref().unwrap_or("");
                assert!(
                    matches!(
                        reason,
                        "NO_FINAL_STOCK" | "DUPLICATE_USER" | "EXPIRED" | "ACTIVITY_TERMINATED"
                    ),
                    "{r:?}"
                );
                let comp = redis_cmd(stores, &["GET", &format!("{prefix}:comp:{}", told[0])]);
                assert!(!comp.is_empty(), "FAILED without compensation: {r:?}");
            }
            other => panic!("unexpected resolution {other}"),
        }
    }
}

/// The engine's reconcile report (`GET .../reconcile`, DESIGN.md section 8) of the SKU.
pub fn reconcile(engine: &EngineProcess, activity: u64, sku: u64) -> Value {
    let path = format!("/admin/v1/activities/{activity}/skus/{sku}/reconcile");
    let (status, report) = http(engine.admin, "GET", &path, None, None).expect("reconcile answers");
    assert_eq!(status, 200, "{report}");
    report
}

/// After a drill whose stores kept their data, the report agrees: every delta 0, `ok`.
pub fn assert_reconcile_ok(engine: &EngineProcess, activity: u64, sku: u64) {
    let report = reconcile(engine, activity, sku);
    assert_eq!(report["ok"], true, "reconcile: {report:#}");
}
