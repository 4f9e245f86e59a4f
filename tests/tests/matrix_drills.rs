//! The seed's multi-failure matrix (ch9 §7.11, issue 27): two faults at once on the `ha`
//! topology (Redis Cluster 3 + 3, JetStream 3 nodes with R3 streams, PostgreSQL primary with
//! two `ANY 1` synchronous standbys), a sale running on one engine with its worker and the
//! production admission budgets.
//!
//! Each drill: a buyer (`known`) has an order before the faults; buyers keep submitting; both
//! faults are injected and held for [`HOLD`]. While they hold it asserts what buyers and
//! operators see — submissions stop being promised within [`CLOSE_BOUND`] and every answer
//! after that is one of the row's closed answers, queries and payments as the row says,
//! `/readyz` 200 throughout (dependencies never drive readiness), the rejection counters of
//! the row's reasons risen. Then the documented recovery order (seed §10.7): the log healed
//! first, traffic held by a signed SKU-scoped `SUBMIT_CLOSED`, the other fault healed; the
//! consumers drain first (every promised buyer has his order and the reconcile report is ok
//! while new submissions are still refused); then staged traffic (`RECOVERING` 25 → 50 → 75
//! → 100 → `NORMAL`, the 25 % stage asserted to admit some and refuse some). The end: every
//! promised buyer exactly one order, nobody else one, the PostgreSQL audit and the reconcile
//! report (DESIGN.md section 8, `sale::assert_promise_kept`).
//!
//! One topology and one engine for the file (started by the first drill); the drills take
//! turns on it ([`ha`] holds a lock) and each leaves every node running and healthy. Faults:
//! Redis = the SKU's master and its replica SIGSTOPped (no failover possible: the SKU's data
//! is unreachable); the log = two of three NATS nodes killed (no quorum); PostgreSQL = the
//! primary SIGSTOPped (no promotion); standbys short = both standbys SIGSTOPped (commits wait
//! for the synchronous quorum); the control plane = the mode bucket's NATS quorum (as the log)
//! while the SKU's last signed snapshot runs out. Timings are printed, bounds are generous.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use flashsale_engine::app::serve::{self, ServeConfig};
use flashsale_engine::app::stack::nats_cluster::NatsCluster;
use flashsale_engine::app::stack::pg_standbys::PgStandbys;
use flashsale_engine::logic::modes::{control_key, sign, Mode, ModeSnapshot, Scope};
use flashsale_io::jetstream::LogConfig;
use flashsale_io::key::HmacKey;
use flashsale_io::payment::Signed;
use flashsale_io::redis::fence::MinReplicaAcks;
use flashsale_io::redis::slot::Slot;
use flashsale_tests::sale::{self, Answers, Buyers};
use flashsale_tests::{redis_cluster, small_worker, state, HttpClient};
use serde_json::Value;

const CONTROL: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
const PAY_KEY: &str = "abababababababababababababababababababababababababababababababab";
/// How long both faults are held.
const HOLD: Duration = Duration::from_secs(10);
/// Promises must stop within this of the second fault (the contract's budgets are 1–1.5 s;
/// the NATS rows wait out a publish timeout; generous for a loaded 2-core box).
const CLOSE_BOUND: Duration = Duration::from_secs(7);

/// The file's topology and engine.
struct Ha {
    nats: NatsCluster,
    pg: PgStandbys,
    http: SocketAddr,
    admin: SocketAddr,
    /// The primary's URL (it stays pg0: no drill promotes), for the audit.
    primary_url: String,
}

static HA: OnceLock<Mutex<Ha>> = OnceLock::new();

/// The topology, started on first use; held for the whole drill (drills take turns).
fn ha() -> MutexGuard<'static, Ha> {
    HA.get_or_init(|| Mutex::new(start_ha())).lock().unwrap_or_else(PoisonError::into_inner)
}

fn start_ha() -> Ha {
    let started = Instant::now();
    let root = tempfile::Builder::new().prefix("flashsale-test-matrix-").tempdir().unwrap().keep();
    // PostgreSQL runs as `postgres` when we are root and must traverse to its data.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    // A static is never dropped: the watchdog stops every node when the binary exits.
    flashsale_tests::watchdog(&root);
    let seeds = redis_cluster().seeds();
    let nats = NatsCluster::up(&root.join("nats")).unwrap_or_else(|e| panic!("NATS: {e}"));
    let pg = PgStandbys::up(&root.join("pg")).unwrap_or_else(|e| panic!("PostgreSQL: {e}"));
    let primary_url = pg.node_url(0, "postgres");
    migrate(&primary_url);
    let config = engine_config(&seeds, &nats.url(), &pg.url("postgres"), &root);
    let handle = serve::start(config).expect("the engine starts on the ha topology");
    let (http, admin) = (handle.http_addr, handle.admin_addr);
    // Runs until the binary exits, like the topology.
    std::mem::forget(handle);
    println!("ha topology and engine up in {:?}", started.elapsed());
    Ha { nats, pg, http, admin, primary_url }
}

fn migrate(url: &str) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let (mut client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
        let driver = tokio::spawn(conn);
        flashsale_pg_worker::migrate(&mut client).await.expect("migrate");
        drop(client);
        let _ = driver.await;
    });
}

fn replicated(url: &str) -> LogConfig {
    LogConfig {
        url: url.to_owned(),
        replicas: 3,
        publish_timeout_ms: 1_000,
        ..LogConfig::default()
    }
}

/// The engine as an HA deployment runs it: every Redis node a seed, fenced reservations, R3
/// log, the multi-host PostgreSQL URL, signed modes, payments, production admission budgets.
fn engine_config(
    seeds: &[SocketAddr],
    nats: &str,
    pg: &str,
    root: &std::path::Path,
) -> ServeConfig {
    let mut c = flashsale_tests::serve_config(seeds[0], nats, pg);
    c.edge.redis_seeds = seeds.to_vec();
    c.edge.min_replica_acks = MinReplicaAcks::Auto;
    c.edge.admission = flashsale_engine::logic::admission::Budgets::default();
    c.edge.control.key = Some(control_key(CONTROL).unwrap());
    c.edge.control.state_file = Some(root.join("modes.json"));
    c.edge.payment_key = Some(HmacKey::from_hex(PAY_KEY).unwrap());
    c.durable.log = replicated(nats);
    c.render_extra = Some(flashsale_tests::prometheus_render());
    let mut worker = small_worker(&c);
    worker.log = replicated(nats);
    c.worker = Some(worker);
    c
}

// ---- faults -------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// The SKU's Redis master and its replica frozen.
    Redis { master: SocketAddr, replica: SocketAddr },
    /// Two of the three NATS nodes killed: the log (and the mode bucket) lose their quorum.
    Log,
    /// The PostgreSQL primary frozen.
    Pg,
    /// Both synchronous standbys frozen: the primary's commits wait for the quorum.
    Standbys,
}

impl Ha {
    fn inject(&mut self, fault: Fault) {
        match fault {
            Fault::Redis { master, replica } => {
                redis_cluster().freeze(master);
                redis_cluster().freeze(replica);
            }
            Fault::Log => {
                for node in [1, 2] {
                    self.nats.kill(node).expect("kill -9 of a NATS node");
                }
            }
            Fault::Pg => self.pg.freeze(0).expect("freeze the primary"),
            Fault::Standbys => {
                for node in [1, 2] {
                    self.pg.freeze(node).expect("freeze a standby");
                }
            }
        }
    }

    fn heal(&mut self, fault: Fault) {
        match fault {
            Fault::Redis { master, replica } => {
                redis_cluster().thaw(replica);
                redis_cluster().thaw(master);
                redis_cluster().heal();
            }
            Fault::Log => {
                for node in [1, 2] {
                    self.nats.restart(node).expect("restart a NATS node");
                }
                self.nats.wait_healthy(Duration::from_secs(60)).expect("NATS healthy again");
            }
            Fault::Pg => self.pg.thaw(0).expect("thaw the primary"),
            Fault::Standbys => {
                for node in [1, 2] {
                    self.pg.thaw(node).expect("thaw a standby");
                }
            }
        }
    }
}

/// A SKU of `activity` whose slot the master `master` serves.
fn sku_on(master: SocketAddr, activity: u64) -> (u64, u64) {
    let map = redis_cluster().map();
    let sku = (1..10_000)
        .find(|sku| {
            map.addr_of(Slot::of_key(format!("{{{activity}:{sku}}}").as_bytes())) == Some(master)
        })
        .expect("a SKU on every master");
    (activity, sku)
}

/// The Redis fault of the SKU `activity` will sell (on the second master).
fn redis_fault(activity: u64) -> ((u64, u64), Fault) {
    let master = redis_cluster().masters()[1];
    let replica = redis_cluster().replica_of(master);
    (sku_on(master, activity), Fault::Redis { master, replica })
}

// ---- modes --------------------------------------------------------------------------------

static VERSION: AtomicU64 = AtomicU64::new(1);

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

/// Posts a signed snapshot for the SKU's scope; retries (the bucket may be regaining its
/// quorum) until accepted, for 60 s.
fn post_mode(admin: SocketAddr, (activity, sku): (u64, u64), mode: Mode, ttl_ms: u64) {
    let version = VERSION.fetch_add(1, Ordering::Relaxed);
    let now = now_ms();
    let snapshot = ModeSnapshot {
        version,
        scope: Scope::Sku(activity, sku),
        mode,
        issued_at_ms: now,
        expires_at_ms: now + ttl_ms,
        issuer: "matrix".into(),
    };
    let body = sign(&control_key(CONTROL).unwrap(), snapshot).unwrap().to_json();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = HttpClient::try_connect(admin)
            .and_then(|mut c| c.try_request("POST", "/admin/v1/mode", None, Some(&body)));
        match r {
            Some(r) if r.status == 200 => return,
            other => {
                let seen = other.map(|r| format!("{} {}", r.status, r.body));
                assert!(Instant::now() < deadline, "mode {mode:?} not accepted: {seen:?}");
                std::thread::sleep(Duration::from_millis(250));
            }
        }
    }
}

// ---- what operators and buyers see ----------------------------------------------------------

/// A counter of a Prometheus exposition, 0 when absent.
fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

fn metrics(admin: SocketAddr) -> String {
    HttpClient::connect(admin).request("GET", "/metrics", None, None).body
}

fn rejections(text: &str, reasons: &[&str]) -> f64 {
    reasons
        .iter()
        .map(|r| counter(text, &format!("flashsale_admission_rejections_total{{reason=\"{r}\"}}")))
        .sum()
}

/// A buyer with an order before the faults.
struct Known {
    user: u64,
    id: String,
    order_id: String,
}

/// The running sale of one drill.
struct Sale {
    sku: (u64, u64),
    buyers: Buyers,
    known: Known,
    known_answers: Answers,
}

fn open_sale(ha: &Ha, sku: (u64, u64), tag: &str) -> Sale {
    sale::create_activity(ha.admin, sku, 100_000);
    let mut c = HttpClient::connect(ha.http);
    let id = format!("{tag}-known");
    // Retried with the same id while a previous drill's circuit may still be open (a closed
    // answer reserves nothing).
    let mut first = Value::Null;
    flashsale_tests::wait_for_ms("the known buyer is QUEUED", 30_000, || {
        first = sale::submit(&mut c, 1, sku, &id).unwrap_or(Value::Null);
        state(&first) == "QUEUED"
    });
    let mut known_answers = Answers::default();
    known_answers.record(1, &id, &first);
    sale::wait_ordered(ha.http, sku, &[(1, id.clone())]);
    let v = sale::query(&mut c, 1, sku, &id).expect("an answer");
    let order_id = v["order_id"].as_str().expect("an order id").to_owned();
    let buyers = Buyers::start(ha.http, sku, 3, Duration::from_millis(50), tag);
    std::thread::sleep(Duration::from_secs(2));
    let running = buyers.answers.lock().unwrap_or_else(PoisonError::into_inner).count("QUEUED");
    assert!(running > 0, "the sale is not selling before the faults");
    Sale { sku, buyers, known: Known { user: 1, id, order_id }, known_answers }
}

/// A copy of the answers' timeline so far (asserting on it never poisons the buyers' lock).
fn timeline(sale: &Sale) -> Answers {
    let guard = sale.buyers.answers.lock().unwrap_or_else(PoisonError::into_inner);
    Answers { timeline: guard.timeline.clone(), ..Answers::default() }
}

/// What the probes saw while both faults held: per kind, each answer with its time.
#[derive(Default)]
struct Probes {
    seen: BTreeMap<&'static str, Vec<(Instant, String)>>,
}

impl Probes {
    fn push(&mut self, kind: &'static str, answer: String) {
        self.seen.entry(kind).or_default().push((Instant::now(), answer));
    }

    /// The answers of `kind` from `from` on.
    fn after(&self, kind: &str, from: Instant) -> Vec<&str> {
        let all = self.seen.get(kind).map(Vec::as_slice).unwrap_or_default();
        all.iter().filter(|(t, _)| *t >= from).map(|(_, a)| a.as_str()).collect()
    }
}

/// Every 200 ms until `until`: `/readyz`, the known buyer's query, a query of a request id
/// nobody sent, and `extra` (a row's own probe).
fn probe(
    ha: &Ha,
    sale: &Sale,
    until: Instant,
    mut extra: impl FnMut(&mut HttpClient, &mut Probes),
) -> Probes {
    let mut probes = Probes::default();
    let mut c = HttpClient::connect(ha.http);
    let mut n = 0u64;
    while Instant::now() < until {
        n += 1;
        let ready = HttpClient::try_connect(ha.admin)
            .and_then(|mut a| a.try_request("GET", "/readyz", None, None))
            .map_or(0, |r| r.status);
        probes.push("readyz", ready.to_string());
        let known = sale::query(&mut c, sale.known.user, sale.sku, &sale.known.id);
        probes.push("known", known.as_ref().map_or("NO_ANSWER".into(), sale::label));
        let nobody = sale::query(&mut c, 7, sale.sku, &format!("never-sent-{n}"));
        probes.push("never_sent", nobody.as_ref().map_or("NO_ANSWER".into(), sale::label));
        extra(&mut c, &mut probes);
        if known.is_none() || nobody.is_none() {
            c = HttpClient::connect(ha.http);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    probes
}

/// When the last promise (`QUEUED`/`QUEUED_PENDING`) after `from` was answered.
fn last_promise(answers: &Answers, from: Instant) -> Option<Instant> {
    answers
        .timeline
        .iter()
        .filter(|(t, a)| *t >= from && (a == "QUEUED" || a == "QUEUED_PENDING"))
        .map(|(t, _)| *t)
        .next_back()
}

/// The hold's buyer answers: promises stop within [`CLOSE_BOUND`] of `at`; every answer after
/// that is in `closed`. Returns the measured close time.
fn assert_closed(row: &str, answers: &Answers, at: Instant, closed: &[&str]) -> Duration {
    println!("{row}: answers per second from 1 s before the second fault");
    println!("{}", answers.by_second(at - Duration::from_secs(1), HOLD.as_secs() + 1));
    let close = last_promise(answers, at).map_or(Duration::ZERO, |t| t - at);
    assert!(close < CLOSE_BOUND, "{row}: still promising {close:?} after the faults");
    let after = answers.timeline.iter().filter(|(t, _)| *t >= at + CLOSE_BOUND);
    let mut seen = 0;
    for (_, answer) in after.filter(|(t, _)| *t < at + HOLD) {
        assert!(is_one_of(answer, closed), "{row}: {answer} while closed ({closed:?})");
        seen += 1;
    }
    assert!(seen > 0, "{row}: no buyer answered while both faults held");
    close
}

/// `answer` is one of `closed`: exactly, or an entry without a reason matches every reason.
fn is_one_of(answer: &str, closed: &[&str]) -> bool {
    closed
        .iter()
        .any(|c| answer == *c || answer.strip_prefix(c).is_some_and(|r| r.starts_with(':')))
}

/// The whole hold as operators see it: `/readyz` 200 throughout.
fn assert_ready(row: &str, probes: &Probes, from: Instant) {
    let ready = probes.after("readyz", from);
    assert!(!ready.is_empty() && ready.iter().all(|s| *s == "200"), "{row}: /readyz {ready:?}");
}

// ---- recovery -----------------------------------------------------------------------------

/// The documented recovery (seed §10.7) after both faults: the log first (the mode bucket
/// lives there), traffic held by a signed SKU-scoped SUBMIT_CLOSED, the other fault; then the
/// consumers (every promise so far an order, reconcile ok, while submissions stay refused);
/// then staged traffic. Returns (consumers drained, first QUEUED) after the last heal.
fn recover(ha: &mut Ha, sale: &Sale, faults: &[Fault]) -> (Duration, Duration) {
    let (log, others): (Vec<Fault>, Vec<Fault>) =
        faults.iter().partition(|f| matches!(f, Fault::Log));
    for fault in log {
        ha.heal(fault);
    }
    post_mode(ha.admin, sale.sku, Mode::SubmitClosed, 600_000);
    let held_at = Instant::now();
    for fault in others {
        ha.heal(fault);
    }
    let healed = Instant::now();
    let promised = sale.buyers.answers.lock().unwrap_or_else(PoisonError::into_inner).promised();
    sale::wait_ordered(ha.http, sale.sku, &promised);
    sale::wait_reconciled(ha.admin, sale.sku);
    let drained = healed.elapsed();
    // Consumers first: nothing was promised while the consumers drained.
    let sneaked = last_promise(&timeline(sale), held_at + Duration::from_millis(500));
    assert!(sneaked.is_none(), "a promise while traffic was held for the consumers");
    staged_traffic(ha, sale);
    let opened = timeline(sale).first_queued_after(healed);
    (drained, opened.expect("traffic reopened") - healed)
}

/// RECOVERING 25 (some admitted, some refused `MODE_RECOVERING`), 50, 75, 100, NORMAL. The
/// 25 % stage lasts until both answers were seen (a dependency's circuit may still be open
/// for up to its longest open time, 8 s for Redis), 30 s at most.
fn staged_traffic(ha: &Ha, sale: &Sale) {
    let at = Instant::now();
    post_mode(ha.admin, sale.sku, Mode::Recovering { admit_percent: 25 }, 600_000);
    let both = || {
        let answers = timeline(sale);
        let stage: Vec<&str> =
            answers.timeline.iter().filter(|(t, _)| *t >= at).map(|(_, a)| a.as_str()).collect();
        stage.contains(&"QUEUED") && stage.contains(&"SUBMIT_CLOSED:MODE_RECOVERING")
    };
    flashsale_tests::wait_for_ms("RECOVERING 25 admits some and refuses some", 30_000, both);
    println!("RECOVERING 25: admitting again {:?} after it was posted", at.elapsed());
    for admit_percent in [50, 75, 100] {
        post_mode(ha.admin, sale.sku, Mode::Recovering { admit_percent }, 600_000);
        std::thread::sleep(Duration::from_millis(300));
    }
    post_mode(ha.admin, sale.sku, Mode::Normal, 3_600_000);
    std::thread::sleep(Duration::from_secs(1));
}

/// The end (DESIGN.md section 8): every promised buyer exactly one order, nobody else one,
/// the PostgreSQL audit and the reconcile report.
fn close_sale(ha: &Ha, sale: Sale) -> usize {
    let mut answers = sale.buyers.stop();
    answers.merge(sale.known_answers);
    let promised =
        sale::assert_promise_kept((ha.http, ha.admin), &ha.primary_url, sale.sku, &mut answers);
    promised.len()
}

/// One row: sale, both faults, `observe` while they hold (the row's assertions), recovery,
/// invariants. Prints the measured times.
fn drill(
    row: &str,
    sku: (u64, u64),
    faults: &[Fault],
    (before, observe): (impl FnOnce(&Ha, &Sale), impl FnOnce(&mut Ha, &Sale, Instant) -> Duration),
) {
    let mut ha = ha();
    let started = Instant::now();
    let sale = open_sale(&ha, sku, &format!("m{}", sku.0));
    before(&ha, &sale);
    for fault in faults {
        ha.inject(*fault);
    }
    let at = Instant::now();
    let close = observe(&mut ha, &sale, at);
    let (drained, reopened) = recover(&mut ha, &sale, faults);
    let promised = close_sale(&ha, sale);
    println!(
        "{row}: promises stopped {close:?} after the faults; consumers drained {drained:?} and \
         traffic reopened {reopened:?} after the last heal; {promised} promised buyers, each one \
         order; drill took {:?}",
        started.elapsed()
    );
}

const LOG_CLOSED: &[&str] = &[
    "SUBMIT_CLOSED:LOG_UNAVAILABLE",
    "SUBMIT_CLOSED:BACKLOG_UNKNOWN",
    "SUBMIT_CLOSED:BACKLOG_AGE",
    "SUBMIT_CLOSED:BACKLOG_COUNT",
];
const PG_CLOSED: &[&str] =
    &["SUBMIT_CLOSED:PG_OUTAGE", "SUBMIT_CLOSED:BACKLOG_AGE", "SUBMIT_CLOSED:BACKLOG_COUNT"];
const REDIS_CLOSED: &[&str] = &["SYSTEM_BUSY:REDIS_UNAVAILABLE", "UNKNOWN", "SYSTEM_BUSY"];

fn union(sets: &[&[&'static str]]) -> Vec<&'static str> {
    sets.iter().flat_map(|s| s.iter().copied()).collect()
}

/// The reasons of `closed` (the part after `:`), for the rejection counters.
fn reasons<'a>(closed: &[&'a str]) -> Vec<&'a str> {
    closed.iter().filter_map(|c| c.split_once(':').map(|(_, r)| r)).collect()
}

/// The common part of a row's hold: probes (with `extra`), the buyers' answers closed to
/// `closed`, `/readyz`, the rejection counters risen. Returns the probes and the close time.
fn hold(
    ha: &Ha,
    sale: &Sale,
    at: Instant,
    (row, closed): (&str, &[&str]),
    extra: impl FnMut(&mut HttpClient, &mut Probes),
) -> (Probes, Duration) {
    let before = rejections(&metrics(ha.admin), &reasons(closed));
    let probes = probe(ha, sale, at + HOLD, extra);
    let after = rejections(&metrics(ha.admin), &reasons(closed));
    let close = assert_closed(row, &timeline(sale), at, closed);
    assert_ready(row, &probes, at);
    assert!(after > before, "{row}: the rejection counters of {closed:?} did not rise");
    (probes, close)
}

/// A PAID callback for the known buyer's order: accepted, and the order reads PAID.
fn pay_known(ha: &Ha, sale: &Sale) {
    let key = HmacKey::from_hex(PAY_KEY).unwrap();
    let order = sale.known.order_id.as_str();
    let payment = format!("pay-{order}");
    let sig = Signed { payment_id: &payment, order_id: order, status: "PAID", amount_cents: 100 }
        .sign(&key);
    let body = format!(
        r#"{{"payment_id":"{payment}","order_id":"{order}","status":"PAID","amount_cents":100,"signature":"{sig}"}}"#
    );
    let mut c = HttpClient::connect(ha.http);
    let r = c.request("POST", "/v1/payments/callback", None, Some(&body));
    assert_eq!(r.status, 200, "the payment callback while the faults hold: {}", r.body);
    let path = format!("/v1/orders/{order}?activity_id={}", sale.sku.0);
    let pass = sale::pass(sale.known.user, sale.sku.0);
    let v = c.request("GET", &path, Some(&pass), None).json();
    assert_eq!(v["status"].as_str().or(v["state"].as_str()), Some("PAID"), "{v}");
}

// ---- the rows -----------------------------------------------------------------------------

/// Redis + the log: new reservations close at once; queries and payments keep working.
#[test]
fn redis_and_the_log_close_reservations_and_queries_and_payments_keep_working() {
    let (sku, redis) = redis_fault(27_101);
    drill(
        "Redis + log",
        sku,
        &[redis, Fault::Log],
        (
            |_, _| {},
            |ha, sale, at| {
                let closed = union(&[LOG_CLOSED, REDIS_CLOSED]);
                let (probes, close) = hold(ha, sale, at, ("Redis + log", &closed), |_, _| {});
                // The order's state comes from PostgreSQL (Redis cannot be asked).
                let known = probes.after("known", at + CLOSE_BOUND);
                assert!(known.iter().all(|a| *a == "SUCCEEDED"), "known buyer's query: {known:?}");
                pay_known(ha, sale);
                close
            },
        ),
    );
}

/// Redis + PostgreSQL: closed; no final order state from Redis (queries answer UNKNOWN).
#[test]
fn redis_and_postgres_close_reservations_and_never_answer_a_final_state_from_redis() {
    let (sku, redis) = redis_fault(27_201);
    drill(
        "Redis + PostgreSQL",
        sku,
        &[redis, Fault::Pg],
        (
            |_, _| {},
            |ha, sale, at| {
                let closed = union(&[PG_CLOSED, REDIS_CLOSED]);
                let (probes, close) =
                    hold(ha, sale, at, ("Redis + PostgreSQL", &closed), |_, _| {});
                for kind in ["known", "never_sent"] {
                    let seen = probes.after(kind, at + CLOSE_BOUND);
                    assert!(
                        seen.iter().all(|a| a.starts_with("UNKNOWN")),
                        "{kind} query: {seen:?}"
                    );
                }
                close
            },
        ),
    );
}

/// The log + PostgreSQL: closed; the reservation scanner keeps running but what it holds
/// stops growing.
#[test]
fn the_log_and_postgres_close_reservations_and_the_pending_set_stops_growing() {
    drill(
        "log + PostgreSQL",
        (27_301, 1),
        &[Fault::Log, Fault::Pg],
        (
            |_, _| {},
            |ha, sale, at| {
                let closed = union(&[LOG_CLOSED, PG_CLOSED]);
                let mut pending = Vec::new();
                let (_, close) = hold(ha, sale, at, ("log + PostgreSQL", &closed), |_, _| {
                    let text = metrics(ha.admin);
                    pending
                        .push((Instant::now(), counter(&text, "flashsale_reservations_pending ")));
                });
                let settled: Vec<f64> = pending
                    .iter()
                    .filter(|(t, _)| *t >= at + CLOSE_BOUND)
                    .map(|(_, n)| *n)
                    .collect();
                println!("log + PostgreSQL: reservations pending while closed {settled:?}");
                assert!(!settled.is_empty());
                assert!(settled.windows(2).all(|w| w[1] <= w[0]), "pending grew while closed");
                assert!(settled[0] < 100.0, "pending is not small: {settled:?}");
                close
            },
        ),
    );
}

/// PostgreSQL + queries: unknown answers are UNKNOWN; a buyer with an order cannot order again
/// with a new request id.
#[test]
fn postgres_and_queries_answer_unknown_and_a_new_request_id_never_reorders() {
    drill(
        "PostgreSQL + queries",
        (27_401, 1),
        &[Fault::Pg],
        (
            |_, _| {},
            |ha, sale, at| {
                let row = ("PostgreSQL + queries", PG_CLOSED);
                let (known, sku) = ((sale.known.user, sale.known.id.clone()), sale.sku);
                let mut n = 0;
                let (probes, close) = hold(ha, sale, at, row, |c, p| {
                    n += 1;
                    let answer = sale::submit(c, known.0, sku, &format!("{}-again-{n}", known.1));
                    p.push("again", answer.as_ref().map_or("NO_ANSWER".into(), sale::label));
                });
                let unknown = probes.after("never_sent", at + CLOSE_BOUND);
                assert!(
                    unknown.iter().all(|a| a.starts_with("UNKNOWN")),
                    "never-sent query: {unknown:?}"
                );
                let again = probes.after("again", at);
                assert!(!again.is_empty());
                for answer in again {
                    assert!(!answer.starts_with("QUEUED"), "a second order's promise: {answer}");
                }
                close
            },
        ),
    );
}

/// Redis + queries: queries fall back to PostgreSQL; new reservations closed.
#[test]
fn redis_and_queries_fall_back_to_postgres_and_reservations_close() {
    let (sku, redis) = redis_fault(27_501);
    drill(
        "Redis + queries",
        sku,
        &[redis],
        (
            |_, _| {},
            |ha, sale, at| {
                let (probes, close) =
                    hold(ha, sale, at, ("Redis + queries", REDIS_CLOSED), |_, _| {});
                let known = probes.after("known", at + CLOSE_BOUND);
                assert!(known.iter().all(|a| *a == "SUCCEEDED"), "known buyer's query: {known:?}");
                close
            },
        ),
    );
}

/// PostgreSQL standbys short (the synchronous quorum lost): database writes close — no order
/// commits while it holds — and so do new reservations.
#[test]
fn standbys_short_close_database_writes_and_reservations() {
    drill(
        "standbys short",
        (27_601, 1),
        &[Fault::Standbys],
        (
            |_, _| {},
            |ha, sale, at| {
                let orders = |ha: &Ha| {
                    let rows = ha.pg.query(0, "SELECT count(*) FROM orders").expect("count orders");
                    rows[0][0].as_deref().and_then(|n| n.parse::<i64>().ok()).expect("a count")
                };
                let (_, close) = hold(ha, sale, at, ("standbys short", PG_CLOSED), |_, _| {});
                let first = orders(ha);
                std::thread::sleep(Duration::from_secs(2));
                assert_eq!(orders(ha), first, "an order committed without the synchronous quorum");
                println!(
                    "standbys short: {first} orders visible, none added while the quorum was lost"
                );
                close
            },
        ),
    );
}

/// Control plane + data plane: the last signed mode is kept; once its TTL passes, the SKU
/// answers SUBMIT_CLOSED MODE_EXPIRED.
#[test]
fn control_and_data_plane_keep_the_last_signed_mode_then_close_at_its_ttl() {
    const TTL_MS: u64 = 5_000;
    let (sku, redis) = redis_fault(27_701);
    let posted = std::cell::Cell::new(None);
    // Signed just before the faults (while the bucket is up), expiring inside the hold.
    let before = |ha: &Ha, sale: &Sale| {
        post_mode(ha.admin, sale.sku, Mode::Normal, TTL_MS);
        posted.set(Some(Instant::now()));
    };
    drill(
        "control + data plane",
        sku,
        &[Fault::Log, redis],
        (before, |ha, sale, at| {
            let expires = posted.get().expect("posted") + Duration::from_millis(TTL_MS);
            let closed = union(&[LOG_CLOSED, REDIS_CLOSED, &["SUBMIT_CLOSED:MODE_EXPIRED"]]);
            let (_, close) = hold(ha, sale, at, ("control + data plane", &closed), |_, _| {});
            let answers = timeline(sale);
            let expired = |t: &Instant, a: &String| *t >= at && a == "SUBMIT_CLOSED:MODE_EXPIRED";
            let first = answers.timeline.iter().find(|(t, a)| expired(t, a)).map(|(t, _)| *t);
            let first = first.expect("no MODE_EXPIRED answer after the TTL");
            assert!(
                first + Duration::from_millis(200) >= expires,
                "closed by the mode before its TTL"
            );
            let late =
                answers.timeline.iter().filter(|(t, _)| *t >= expires + Duration::from_secs(1));
            for (_, a) in late.filter(|(t, _)| *t < at + HOLD) {
                assert_eq!(a, "SUBMIT_CLOSED:MODE_EXPIRED", "after the TTL");
            }
            println!("control + data plane: MODE_EXPIRED {:?} after the faults", first - at);
            close
        }),
    );
}
