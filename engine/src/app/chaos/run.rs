//! `flashsale chaos` end to end: the `ha` stack under `DIR` (from empty), a proxy in front of
//! each Redis, NATS and PostgreSQL node, two engine instances behind HAProxy, one SKU on sale, the buyers,
//! the nemesis on the seed's schedule; then every fault healed, the open outcomes settled
//! (same-id retries), the stores read, and the auditor's verdict with the figures per round.
//!
//! What it is not: any rule (`audit.rs`), the schedule (`schedule.rs`), the faults
//! (`nemesis.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use flashsale_io::jetstream::{EVENTS_STREAM, ORDERS_STREAM, RECREATION_LOG};
use flashsale_io::key::HmacKey;

use super::audit::{self, Answer, AnswerKind, Breach, Stores};
use super::buyers::{Buyers, Market};
use super::http;
use super::instances::{Instance, InstanceSpec};
use super::nemesis::{self, Event, Proxies, Targets};
use super::proxy::Proxy;
use super::schedule::{Bounds, Schedule};
use crate::app::stack::balancer::Balancer;
use crate::app::stack::nats_cluster::NatsCluster;
use crate::app::stack::pg_standbys::PgStandbys;
use crate::app::stack::{self, RedisCluster, Topology};

/// The keys of the run (test keys: the run is private).
const PAYMENT_KEY_HEX: &str = "abababababababababababababababababababababababababababababababab";
const CONTROL_KEY_HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
const SKU: (u64, u64) = (27_001, 1);
const BUYER_THREADS: u64 = 4;
/// Bound on settling the open outcomes and on the stores agreeing after the sale.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);

/// What `flashsale chaos` was asked.
#[derive(Debug, Clone)]
pub struct ChaosPlan {
    pub seed: u64,
    pub duration_s: u64,
    pub dir: PathBuf,
    pub json: Option<PathBuf>,
    /// The `flashsale` binary (the instances run its `serve`).
    pub engine: PathBuf,
    /// Test only: a protection switched off in every instance.
    pub negative_control: Option<NegativeControl>,
}

/// The protections a negative control may switch off (issue 27 item 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NegativeControl {
    /// The reservation scanner: a reservation whose publish was not acknowledged is never
    /// republished, so a buyer told QUEUED_PENDING in a log fault never gets his order.
    ScannerOff,
}

impl NegativeControl {
    pub fn parse(text: &str) -> Result<NegativeControl, String> {
        match text {
            "scanner-off" => Ok(NegativeControl::ScannerOff),
            other => Err(format!("unknown negative control {other:?}: scanner-off")),
        }
    }

    /// The failpoint that does it (`negctl.*`, see README "Drills").
    pub fn failpoint(self) -> &'static str {
        match self {
            NegativeControl::ScannerOff => "negctl.scanner_off",
        }
    }
}

/// What one round did to the sale.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RoundFigures {
    pub round: usize,
    pub faults: String,
    pub at_ms: u64,
    pub hold_ms: u64,
    /// From the start of the round to the first refusal (SUBMIT_CLOSED, SYSTEM_BUSY, UNKNOWN).
    pub closed_after_ms: Option<u64>,
    /// The longest stretch without a QUEUED answer that overlaps the round.
    pub longest_without_queued_ms: u64,
}

/// The run's outcome; `breaches` empty = no invariant broke.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Verdict {
    pub seed: u64,
    pub duration_s: u64,
    pub schedule: String,
    pub events: Vec<Event>,
    pub rounds: Vec<RoundFigures>,
    pub answers: BTreeMap<String, usize>,
    pub breaches: Vec<Breach>,
    /// Each NATS node's view of the two streams once the stores were read
    /// ([`stack::NatsCluster::stream_views`]): the first thing to read after a promise breach.
    pub log_state: Vec<String>,
    /// What nats-server did to its own copies and what the engines did about it, counted in
    /// the run's logs ([`log_repairs`]).
    pub log_repairs: LogRepairs,
}

/// Lines of the run's logs that say the log lost or repaired state: nats-server resetting a
/// replica's stream state (every node's `server.log`), and the engines' workers recreating
/// `order-writer` over stranded messages (`engine-N.log`; `flashsale_io::jetstream::StrandWatch`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LogRepairs {
    pub stream_resets: usize,
    pub consumer_recreations: usize,
}

pub fn run(plan: &ChaosPlan) -> anyhow::Result<Verdict> {
    let schedule = Schedule::from_seed(plan.seed, plan.duration_s * 1_000, &Bounds::default());
    println!("{}", schedule.render());
    let (mut targets, pg_url) = start(plan)?;
    let admin = targets.engines[0].admin;
    create_activity(admin, plan.duration_s * 30)?;
    let backends: Vec<SocketAddr> = targets.engines.iter().map(|e| e.http).collect();
    let balancer = Balancer::round_robin(&plan.dir.join("balancer"), &backends)?;
    let market = Market {
        target: balancer.addr,
        sku: SKU,
        seed: plan.seed,
        started: Instant::now(),
        payment_key: HmacKey::from_hex(PAYMENT_KEY_HEX)?,
    };
    let buyers = Buyers::start(&market, BUYER_THREADS);
    let mut events = nemesis::run(&mut targets, &schedule, market.started);
    let end = market.started + Duration::from_millis(schedule.duration_ms);
    std::thread::sleep(end.saturating_duration_since(Instant::now()));
    let mut answers = buyers.stop();
    // A node that does not come back is the run's finding, not the end of it: the auditor
    // still judges what the buyers were told (seed 7 once left a NATS node unhealthy).
    if let Err(e) = nemesis::heal_all(&mut targets) {
        let at_ms = market.started.elapsed().as_millis() as u64;
        let (what, error) = ("heal everything".to_owned(), Some(e.to_string()));
        events.push(Event { at_ms, round: schedule.rounds.len(), what, error });
    }
    settle(&market, &mut answers);
    let admins: Vec<SocketAddr> = targets.engines.iter().map(|e| e.admin).collect();
    let stores = read_stores(&pg_url, &admins, &answers)?;
    let breaches = audit::audit(&answers, &stores);
    let verdict = Verdict {
        seed: plan.seed,
        duration_s: plan.duration_s,
        schedule: schedule.render(),
        rounds: figures(&schedule, &events, &answers),
        events,
        answers: count_answers(&answers),
        breaches,
        log_state: [ORDERS_STREAM, EVENTS_STREAM]
            .iter()
            .flat_map(|stream| targets.nats.stream_views(stream))
            .collect(),
        log_repairs: log_repairs(&plan.dir),
    };
    report(plan, &verdict)?;
    write_record(plan, &answers)?;
    drop(balancer);
    drop(targets);
    // The data stays for a look (`flashsale stack up --dir D` starts it again).
    stack::down(&plan.dir, false)?;
    Ok(verdict)
}

/// The stack from empty, the proxies, the schema, two instances.
fn start(plan: &ChaosPlan) -> anyhow::Result<(Targets, String)> {
    if plan.dir.exists() {
        stack::down(&plan.dir, true)?;
    }
    stack::up_with(&plan.dir, Topology::Ha)?;
    let (mut redis, _) = RedisCluster::ensure(&plan.dir.join(stack::REDIS_CLUSTER_DIR))?;
    let mut nats = NatsCluster::up(&plan.dir.join(stack::NATS_CLUSTER_DIR))?;
    let pg = PgStandbys::up(&plan.dir.join(stack::PG_STANDBYS_DIR))?;
    let local = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let proxies = Proxies {
        redis: front(redis.nodes.iter().map(|n| n.addr()))?,
        nats: front(nats.nodes().iter().map(|n| local(n.ports.client)))?,
        pg: front(pg.nodes().iter().map(|n| local(n.port)))?,
    };
    // Redis and NATS clients go where the servers tell them: the servers name the proxies.
    redis.announce_clients(&proxies.redis.iter().map(|p| p.addr.port()).collect::<Vec<_>>())?;
    nats.advertise_clients(&proxies.nats.iter().map(|p| p.addr).collect::<Vec<_>>())?;
    let addrs = |proxies: &[Proxy]| proxies.iter().map(|p| p.addr).collect::<Vec<_>>();
    let redis_url = flashsale_io::redis::url::RedisUrl::render(&addrs(&proxies.redis));
    let nats_url = addrs(&proxies.nats).iter().map(|a| format!("nats://{a}")).collect::<Vec<_>>();
    let pg_hosts = addrs(&proxies.pg).iter().map(SocketAddr::to_string).collect::<Vec<_>>();
    let pg_url = format!(
        "postgres://postgres@{}/postgres?target_session_attrs=read-write",
        pg_hosts.join(",")
    );
    migrate(&pg_url)?;
    let spec = InstanceSpec {
        engine: &plan.engine,
        dir: &plan.dir,
        redis_url: &redis_url,
        nats_url: &nats_url.join(","),
        pg_url: &pg_url,
        payment_key_hex: PAYMENT_KEY_HEX,
        control_key_hex: CONTROL_KEY_HEX,
        failpoint: plan.negative_control.map(NegativeControl::failpoint),
    };
    let engines = (0..2).map(|i| Instance::start(&spec, i)).collect::<anyhow::Result<Vec<_>>>()?;
    Ok((Targets { redis, nats, pg, proxies, engines }, pg_url))
}

/// A proxy in front of each address, in order.
fn front(targets: impl Iterator<Item = SocketAddr>) -> std::io::Result<Vec<Proxy>> {
    targets.map(Proxy::start).collect()
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

async fn connect(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let config =
        flashsale_pg_worker::pool::PgPoolConfig { url: url.to_owned(), ..Default::default() };
    let connector = flashsale_pg_worker::pool::Connector::new(&config)?;
    let (client, driver) = connector.connect().await.context("connect to PostgreSQL")?;
    tokio::spawn(driver);
    Ok(client)
}

fn migrate(url: &str) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        let mut client = connect(url).await?;
        flashsale_pg_worker::migrate(&mut client).await?;
        Ok(())
    })
}

fn create_activity(admin: SocketAddr, stock: u64) -> anyhow::Result<()> {
    let (a, s) = SKU;
    let body = format!(r#"{{"activity_id":{a},"sku_id":{s},"stock":{stock}}}"#);
    let r = http::request(
        admin,
        ("POST", "/admin/v1/activities"),
        None,
        Some(&body),
        Duration::from_secs(30),
    )?;
    anyhow::ensure!(r.status == 201, "create the activity: {} {}", r.status, r.body);
    Ok(())
}

/// Retries, with the same id, every request whose last answer left it open, until it is not
/// (or [`SETTLE_TIMEOUT`] passes: the auditor then sees what is left).
fn settle(market: &Market, answers: &mut Vec<Answer>) {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    let mut last: BTreeMap<(u64, String), String> = BTreeMap::new();
    for a in answers.iter().filter(|a| a.kind == AnswerKind::Submit) {
        last.insert((a.user, a.request_id.clone()), a.state.clone());
    }
    let open = |s: &str| matches!(s, "UNKNOWN" | "");
    for ((user, id), _) in last.into_iter().filter(|(_, s)| open(s)) {
        while Instant::now() < deadline {
            let answer = super::buyers::retry(market, user, &id);
            let done = !open(&answer.state) && answer.state != "SYSTEM_BUSY";
            answers.push(answer);
            if done {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// PostgreSQL's view of the SKU once every promise has settled there (or the bound passed),
/// with its audit, and the engine's reconcile report once ok (or its last text).
fn read_stores(pg_url: &str, admins: &[SocketAddr], answers: &[Answer]) -> anyhow::Result<Stores> {
    let promised: Vec<&str> =
        answers.iter().filter(|a| audit::is_promise(a)).map(|a| a.request_id.as_str()).collect();
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    let rt = runtime()?;
    let mut stores = loop {
        let stores = rt.block_on(read_pg(pg_url))?;
        if promised.iter().all(|id| stores.promise_settled(id)) || Instant::now() > deadline {
            break stores;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    stores.reconcile_problem = wait_reconciled(admins);
    Ok(stores)
}

async fn read_pg(url: &str) -> anyhow::Result<Stores> {
    let client = connect(url).await?;
    let (a, s) = (SKU.0 as i64, SKU.1 as i64);
    let mut stores = Stores::default();
    let sql = "SELECT request_id, reservation_id, status FROM inventory_reservation \
               WHERE activity_id = $1 AND sku_id = $2";
    for row in client.query(sql, &[&a, &s]).await? {
        stores.reservations.insert(row.get(0), (row.get(1), row.get(2)));
    }
    let sql =
        "SELECT request_id, order_id, status FROM orders WHERE activity_id = $1 AND sku_id = $2";
    for row in client.query(sql, &[&a, &s]).await? {
        stores.orders.insert(row.get(0), (row.get(1), row.get(2)));
    }
    let sql = "SELECT order_id FROM payment \
               WHERE status = 'PAID' AND outcome IN ('PAID', 'REFUND_NEEDED')";
    for row in client.query(sql, &[]).await? {
        stores.paid_orders.insert(row.get(0));
    }
    let report = flashsale_pg_worker::audit::check_invariants(&client, a, s).await?;
    stores.audit_problems = flashsale_pg_worker::audit::judge(&report);
    Ok(stores)
}

/// `None` once the reconcile report is ok (within 60 s); else its last text. Asked of each
/// instance in turn: one that did not come back must not read as a breach (campaign seed 16).
fn wait_reconciled(admins: &[SocketAddr]) -> Option<String> {
    let path = format!("/admin/v1/activities/{}/skus/{}/reconcile", SKU.0, SKU.1);
    let deadline = Instant::now() + Duration::from_secs(60);
    for turn in 0.. {
        let admin = admins[turn % admins.len()];
        let r = http::request(admin, ("GET", &path), None, None, Duration::from_secs(30));
        let last = match r {
            Ok(r) if r.body["ok"] == true => return None,
            Ok(r) => r.body.to_string(),
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Some(last);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    unreachable!("the loop returns")
}

/// Per round: when refusals began, and the longest stretch without a QUEUED answer that
/// overlaps it (until the next round starts).
fn figures(schedule: &Schedule, events: &[Event], answers: &[Answer]) -> Vec<RoundFigures> {
    let submits: Vec<&Answer> = answers.iter().filter(|a| a.kind == AnswerKind::Submit).collect();
    let queued: Vec<u64> =
        submits.iter().filter(|a| a.state == "QUEUED").map(|a| a.at_ms).collect();
    let refused =
        |a: &&&Answer| matches!(a.state.as_str(), "SUBMIT_CLOSED" | "SYSTEM_BUSY" | "UNKNOWN");
    let mut out = Vec::new();
    for (i, r) in schedule.rounds.iter().enumerate() {
        let until = schedule.rounds.get(i + 1).map_or(schedule.duration_ms, |n| n.at_ms);
        let closed_after_ms = submits
            .iter()
            .filter(|a| a.at_ms >= r.at_ms && a.at_ms < until)
            .find(refused)
            .map(|a| a.at_ms - r.at_ms);
        let mut longest = 0;
        let mut previous = queued.iter().copied().rfind(|t| *t < r.at_ms).unwrap_or(0);
        for t in queued.iter().copied().filter(|t| *t >= r.at_ms).chain([until]) {
            longest = longest.max(t.saturating_sub(previous.max(r.at_ms)));
            previous = t;
            if t >= until {
                break;
            }
        }
        let faults = events.iter().filter(|e| e.round == i && !e.what.starts_with("heal"));
        let faults = faults.filter(|e| !e.what.starts_with("round skipped"));
        let faults: Vec<&str> =
            faults.map(|e| e.what.split(" (took").next().unwrap_or("")).collect();
        out.push(RoundFigures {
            round: i,
            faults: faults.join(" + "),
            at_ms: r.at_ms,
            hold_ms: r.hold_ms,
            closed_after_ms,
            longest_without_queued_ms: longest,
        });
    }
    out
}

fn count_answers(answers: &[Answer]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for a in answers {
        let kind = match a.kind {
            AnswerKind::Submit => "submit",
            AnswerKind::Query => "query",
            AnswerKind::Pay => "pay",
            AnswerKind::Cancel => "cancel",
        };
        let label = match &a.reason {
            Some(reason) => format!("{kind} {}:{reason}", a.state),
            None if a.state.is_empty() => format!("{kind} (no answer)"),
            None => format!("{kind} {}", a.state),
        };
        *counts.entry(label).or_default() += 1;
    }
    counts
}

/// The generator's record, one answer per line, beside the JSON verdict (`F.answers.jsonl`):
/// the ids behind a breach, for whoever replays the seed.
fn write_record(plan: &ChaosPlan, answers: &[Answer]) -> anyhow::Result<()> {
    let Some(json) = &plan.json else { return Ok(()) };
    let mut path = json.clone().into_os_string();
    path.push(".answers.jsonl");
    let mut text = Vec::new();
    for answer in answers {
        serde_json::to_writer(&mut text, answer)?;
        text.push(b'\n');
    }
    std::fs::write(&path, text).with_context(|| format!("write {}", path.to_string_lossy()))
}

/// Counts [`LogRepairs`] in the logs under `dir` (a log that cannot be read counts nothing).
fn log_repairs(dir: &Path) -> LogRepairs {
    let count = |path: PathBuf, needle: &str| {
        std::fs::read(&path)
            .map(|bytes| {
                String::from_utf8_lossy(&bytes).lines().filter(|l| l.contains(needle)).count()
            })
            .unwrap_or(0)
    };
    let nodes = std::fs::read_dir(dir.join("nats-cluster")).into_iter().flatten().flatten();
    let engines = std::fs::read_dir(dir).into_iter().flatten().flatten().filter(|e| {
        e.file_name().to_str().is_some_and(|n| n.starts_with("engine-") && n.ends_with(".log"))
    });
    LogRepairs {
        stream_resets: nodes
            .map(|node| count(node.path().join("server.log"), "Resetting stream cluster state"))
            .sum(),
        consumer_recreations: engines.map(|e| count(e.path(), RECREATION_LOG)).sum(),
    }
}

/// Prints the events, the figures, the answers and the verdict; writes the JSON.
fn report(plan: &ChaosPlan, verdict: &Verdict) -> anyhow::Result<()> {
    for e in &verdict.events {
        let error = e.error.as_deref().map(|e| format!(" FAILED: {e}")).unwrap_or_default();
        println!("  +{:>6.1}s round {} {}{error}", e.at_ms as f64 / 1e3, e.round, e.what);
    }
    for r in &verdict.rounds {
        println!(
            "  round {} ({}): refusals after {:?} ms, longest stretch without QUEUED {} ms",
            r.round, r.faults, r.closed_after_ms, r.longest_without_queued_ms
        );
    }
    println!("  answers: {:?}", verdict.answers);
    let repairs = &verdict.log_repairs;
    println!(
        "  log: {} stream-state resets by nats-server, {} order-writer recreations",
        repairs.stream_resets, repairs.consumer_recreations
    );
    if !verdict.breaches.is_empty() {
        verdict.log_state.iter().for_each(|line| println!("  log: {line}"));
    }
    for b in &verdict.breaches {
        println!("  BREACH seed {} [{}] {}", verdict.seed, b.rule, b.detail);
    }
    let word = if verdict.breaches.is_empty() { "OK" } else { "BREACHED" };
    println!("chaos seed {}: {word} ({} breaches)", verdict.seed, verdict.breaches.len());
    if let Some(path) = &plan.json {
        std::fs::write(path, serde_json::to_vec_pretty(verdict)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_repairs_count_the_servers_resets_and_the_engines_recreations() {
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |path: &str, text: &str| {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        };
        let reset = "[WRN] Resetting stream cluster state for '$G > SECKILL_ORDERS'\n";
        write("nats-cluster/n1/server.log", &format!("[INF] up\n{reset}{reset}"));
        write("nats-cluster/n3/server.log", reset);
        // The engine's log as tracing writes it, colours included.
        let line = format!("\u{1b}[31mERROR\u{1b}[0m lag_task: {RECREATION_LOG} stranded=3\n");
        write("engine-0.log", &format!("INFO started\n{line}"));
        write("engine-1.log", "INFO started\n");
        write("balancer/haproxy.log", &line);
        let repairs = log_repairs(dir.path());
        assert_eq!((repairs.stream_resets, repairs.consumer_recreations), (3, 1));
        assert_eq!(log_repairs(&dir.path().join("missing")).stream_resets, 0);
    }
}
