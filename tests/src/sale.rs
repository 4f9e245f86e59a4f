//! A sale under way for the fault drills: buyers submitting from threads while a server is
//! killed, every answer recorded with its time, and the end checks the drills share — every
//! buyer told `QUEUED`/`QUEUED_PENDING` gets exactly one order and nobody else gets one, the
//! PostgreSQL audit and the reconcile report pass (DESIGN.md section 8).
//!
//! Everything takes addresses and a PostgreSQL URL, not an [`crate::Engine`], so a drill can
//! run the engine on a topology of its own (a NATS cluster, PostgreSQL standbys).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flashsale_engine::logic::auth::PassKeys;
use flashsale_engine::logic::ids::{ActivityId, UserId};
use serde_json::Value;

use crate::{state, wait_for_ms, HttpClient, KEYS};

/// A buyer's pass for `activity` (the suite's key `k1`, an hour long).
pub fn pass(user: u64, activity: u64) -> String {
    let exp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
        + 3600;
    PassKeys::parse(KEYS).unwrap().mint("k1", UserId(user), ActivityId(activity), exp).unwrap()
}

/// `POST /admin/v1/activities` on the admin plane at `admin` with this body; asserts 201.
pub fn create_activity_with(admin: SocketAddr, body: &str) {
    let resp = HttpClient::connect(admin).request("POST", "/admin/v1/activities", None, Some(body));
    assert_eq!(resp.status, 201, "{}", resp.body);
}

/// A SKU of `stock` units (`POST /admin/v1/activities`); asserts 201.
pub fn create_activity(admin: SocketAddr, (activity, sku): (u64, u64), stock: u64) {
    let body = format!(r#"{{"activity_id":{activity},"sku_id":{sku},"stock":{stock}}}"#);
    create_activity_with(admin, &body);
}

/// `POST /v1/reservations` on `c`; None when the connection broke first.
pub fn submit(
    c: &mut HttpClient,
    user: u64,
    (activity, sku): (u64, u64),
    request_id: &str,
) -> Option<Value> {
    let body = format!(
        r#"{{"activity_id":{activity},"sku_id":{sku},"request_id":"{request_id}","quantity":1}}"#
    );
    let resp =
        c.try_request("POST", "/v1/reservations", Some(&pass(user, activity)), Some(&body))?;
    Some(resp.json())
}

/// `GET /v1/reservations/{request_id}` on `c`; None when the connection broke first.
pub fn query(
    c: &mut HttpClient,
    user: u64,
    (activity, sku): (u64, u64),
    request_id: &str,
) -> Option<Value> {
    let path = format!("/v1/reservations/{request_id}?activity_id={activity}&sku_id={sku}");
    Some(c.try_request("GET", &path, Some(&pass(user, activity)), None)?.json())
}

/// An answer as the drills count it: `STATE` or `STATE:REASON_CODE`.
pub fn label(v: &Value) -> String {
    match v["reason_code"].as_str() {
        Some(reason) => format!("{}:{reason}", state(v)),
        None => state(v).to_owned(),
    }
}

/// Every answer of a sale: per buyer, and in the order they came.
#[derive(Default)]
pub struct Answers {
    pub by_buyer: HashMap<u64, (String, Vec<String>)>,
    pub timeline: Vec<(Instant, String)>,
}

impl Answers {
    pub fn record(&mut self, user: u64, id: &str, v: &Value) {
        let answer = label(v);
        self.timeline.push((Instant::now(), answer.clone()));
        let entry = self.by_buyer.entry(user).or_insert_with(|| (id.to_owned(), Vec::new()));
        entry.1.push(answer);
    }

    /// Adds `other`'s answers (other buyers', or later ones of the same buyers), keeping the
    /// timeline in time order.
    pub fn merge(&mut self, other: Answers) {
        for (user, (id, answers)) in other.by_buyer {
            let entry = self.by_buyer.entry(user).or_insert_with(|| (id, Vec::new()));
            entry.1.extend(answers);
        }
        self.timeline.extend(other.timeline);
        self.timeline.sort_by_key(|(at, _)| *at);
    }

    /// How many answers were exactly `answer`.
    pub fn count(&self, answer: &str) -> usize {
        self.by_buyer.values().flat_map(|(_, a)| a).filter(|a| a.as_str() == answer).count()
    }

    /// Buyers told `QUEUED` or `QUEUED_PENDING` at least once (the promise applies).
    pub fn promised(&self) -> Vec<(u64, String)> {
        let promised = |a: &String| a == "QUEUED" || a == "QUEUED_PENDING";
        let mut out: Vec<_> = self
            .by_buyer
            .iter()
            .filter(|(_, (_, answers))| answers.iter().any(promised))
            .map(|(user, (id, _))| (*user, id.clone()))
            .collect();
        out.sort();
        out
    }

    /// Buyers whose last answer left the outcome open (`UNKNOWN`: retry with the same id).
    pub fn unknown(&self) -> Vec<(u64, String)> {
        let mut out: Vec<_> = self
            .by_buyer
            .iter()
            .filter(|(_, (_, a))| a.last().is_some_and(|l| l.starts_with("UNKNOWN")))
            .map(|(user, (id, _))| (*user, id.clone()))
            .collect();
        out.sort();
        out
    }

    /// What was answered in each second from `from` for `seconds`: one line per second, the
    /// counts of every answer (`+3s QUEUED 41, SUBMIT_CLOSED:BACKLOG_UNKNOWN 12`).
    pub fn by_second(&self, from: Instant, seconds: u64) -> String {
        let mut lines = Vec::new();
        for s in 0..seconds {
            let (lo, hi) = (from + Duration::from_secs(s), from + Duration::from_secs(s + 1));
            let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
            for (at, answer) in &self.timeline {
                if *at >= lo && *at < hi {
                    *counts.entry(answer.as_str()).or_default() += 1;
                }
            }
            let row: Vec<String> = counts.iter().map(|(a, n)| format!("{a} {n}")).collect();
            lines.push(format!("  +{s:>2}s {}", row.join(", ")));
        }
        lines.join("\n")
    }

    /// The first `QUEUED` answer at or after `at` (submissions open again).
    pub fn first_queued_after(&self, at: Instant) -> Option<Instant> {
        self.timeline.iter().find(|(t, a)| *t >= at && a == "QUEUED").map(|(t, _)| *t)
    }
}

/// Buyers on `threads` threads, each a new user with a request id of its own, one submit
/// every `pause` per thread, keep-alive connections (a broken one is opened again and the
/// same request id retried, as the contract asks); until [`Buyers::stop`].
pub struct Buyers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    pub answers: Arc<Mutex<Answers>>,
}

impl Buyers {
    pub fn start(
        http: SocketAddr,
        sku: (u64, u64),
        threads: u64,
        pause: Duration,
        tag: &str,
    ) -> Buyers {
        let stop = Arc::new(AtomicBool::new(false));
        let answers = Arc::new(Mutex::new(Answers::default()));
        let threads = (0..threads)
            .map(|t| {
                let (stop, answers, tag) =
                    (Arc::clone(&stop), Arc::clone(&answers), tag.to_owned());
                std::thread::spawn(move || {
                    let mut c = None;
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let user = (t + 1) * 1_000_000 + n;
                        let id = format!("{tag}-{user}");
                        for _attempt in 0..20 {
                            if c.is_none() {
                                c = HttpClient::try_connect(http);
                            }
                            let answer = c.as_mut().and_then(|c| submit(c, user, sku, &id));
                            match answer {
                                Some(v) => {
                                    answers.lock().unwrap().record(user, &id, &v);
                                    break;
                                }
                                None => {
                                    c = None;
                                    std::thread::sleep(Duration::from_millis(100));
                                }
                            }
                        }
                        std::thread::sleep(pause);
                    }
                })
            })
            .collect();
        Buyers { stop, threads, answers }
    }

    /// Stops the buyers; returns every answer.
    pub fn stop(self) -> Answers {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        std::mem::take(&mut *self.answers.lock().unwrap())
    }
}

/// Retries every buyer whose outcome is unknown with the same request id until the answer
/// is final (not `UNKNOWN`, not `SUBMIT_CLOSED`), recording each answer.
pub fn settle_unknown(http: SocketAddr, sku: (u64, u64), answers: &mut Answers) {
    let mut c = HttpClient::connect(http);
    for (user, id) in answers.unknown() {
        wait_for_ms("an unknown outcome resolves on retry", 60_000, || {
            let Some(v) = submit(&mut c, user, sku, &id) else {
                c = HttpClient::connect(http);
                return false;
            };
            answers.record(user, &id, &v);
            !state(&v).starts_with("UNKNOWN") && state(&v) != "SUBMIT_CLOSED"
        });
    }
}

/// Waits until every `(user, request id)` queries `SUCCEEDED` (an order); `FAILED` fails.
pub fn wait_ordered(http: SocketAddr, sku: (u64, u64), buyers: &[(u64, String)]) {
    let mut c = HttpClient::connect(http);
    for (user, id) in buyers {
        wait_for_ms("every promised buyer gets an order", 60_000, || {
            let Some(v) = query(&mut c, *user, sku, id) else {
                c = HttpClient::connect(http);
                return false;
            };
            assert_ne!(state(&v), "FAILED", "{v}");
            state(&v) == "SUCCEEDED"
        });
    }
}

/// The SKU's reconcile report (`GET .../reconcile`) on the admin plane at `admin`.
pub fn reconcile(admin: SocketAddr, (activity, sku): (u64, u64)) -> Value {
    let path = format!("/admin/v1/activities/{activity}/skus/{sku}/reconcile");
    HttpClient::connect(admin).request("GET", &path, None, None).json()
}

/// Polls the reconcile report until it is ok (reservations in flight settle); returns it.
/// Panics with the last report after 60 s.
pub fn wait_reconciled(admin: SocketAddr, sku: (u64, u64)) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let last = reconcile(admin, sku);
        if last["ok"] == true {
            return last;
        }
        assert!(Instant::now() < deadline, "the reconcile report is not ok after 60 s: {last:#}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The buyers with an order of the SKU in the database at `pg_url`, and the audit of
/// DESIGN.md section 8 (asserted).
pub fn orders_and_audit(pg_url: &str, (activity, sku): (u64, u64)) -> Vec<u64> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let (client, conn) = tokio_postgres::connect(pg_url, tokio_postgres::NoTls).await.unwrap();
        let driver = tokio::spawn(conn);
        let (a, s) = (activity as i64, sku as i64);
        let report =
            flashsale_pg_worker::audit::check_invariants(&client, a, s).await.expect("audit");
        assert!(report.ok(), "invariants violated: {report:#?}");
        let rows = client
            .query(
                "SELECT user_id FROM orders WHERE activity_id = $1 AND sku_id = $2 ORDER BY 1",
                &[&a, &s],
            )
            .await
            .unwrap();
        drop(client);
        let _ = driver.await;
        rows.iter().map(|r| r.get::<_, i64>(0) as u64).collect()
    })
}

/// The end of a drill with a sale: unknown outcomes retried, every promised buyer has an
/// order, the orders are exactly the promised buyers' (one each, nobody else), the audit and
/// the reconcile report pass. Returns the promised buyers.
pub fn assert_promise_kept(
    (http, admin): (SocketAddr, SocketAddr),
    pg_url: &str,
    sku: (u64, u64),
    answers: &mut Answers,
) -> Vec<(u64, String)> {
    settle_unknown(http, sku, answers);
    let promised = answers.promised();
    wait_ordered(http, sku, &promised);
    let ordered = orders_and_audit(pg_url, sku);
    let promised_users: Vec<u64> = promised.iter().map(|(u, _)| *u).collect();
    assert_eq!(ordered, promised_users, "orders are exactly the promised buyers', one each");
    wait_reconciled(admin, sku);
    promised
}
