//! The soak's buyers: threads through the balancer, each buyer a new user with the mix of a
//! real sale — duplicate clicks (the same request sent twice at once), same-id retries of
//! every answer that leaves the outcome open (`UNKNOWN`, `SUBMIT_CLOSED`, `SYSTEM_BUSY`,
//! `OVERLOADED`, a broken connection) after the answer's `Retry-After`, buyers who give up
//! waiting (a client timeout of 30–400 ms, then the same id again), queries of their own
//! request, and for the orders they see PAID callbacks, cancels, and cancels followed by a
//! late payment (which must be recorded for a refund). Every answer is recorded for the
//! auditor ([`super::audit::Answer`]); the choices come from the seed (the timing does not:
//! it is a real run).
//!
//! What it is not: a load generator (`flashsale-loadgen` measures latency; this one only
//! needs every answer and a rate the 2-core box carries beside the nemesis).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flashsale_io::key::HmacKey;
use flashsale_io::payment::Signed;

use super::audit::{Answer, AnswerKind};
use super::http;
use super::schedule::SplitMix64;
use crate::logic::auth::{PassKeys, DEV_PASS_KEYS};
use crate::logic::ids::{ActivityId, UserId};

/// Same-id attempts of one buyer at most (the first included).
const ATTEMPTS_MAX: u32 = 6;
/// Longest Retry-After honoured (a longer one is cut: the run is short).
const RETRY_AFTER_MAX_MS: u64 = 2_000;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The share of submits sent by an impatient buyer, who waits [`IMPATIENT_MS`] at most.
const IMPATIENT_PERCENT: u64 = 10;
const IMPATIENT_MS: (u64, u64) = (30, 400);

/// What the buyers need.
#[derive(Clone)]
pub struct Market {
    pub target: SocketAddr,
    pub sku: (u64, u64),
    pub seed: u64,
    pub started: Instant,
    pub payment_key: HmacKey,
}

pub struct Buyers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Vec<Answer>>>,
}

impl Buyers {
    pub fn start(market: &Market, threads: u64) -> Buyers {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..threads)
            .map(|t| {
                let (market, stop) = (market.clone(), Arc::clone(&stop));
                std::thread::spawn(move || buyer_thread(&market, t, &stop))
            })
            .collect();
        Buyers { stop, threads }
    }

    /// Stops the buyers (each finishes the buyer in hand); every answer, in time order.
    pub fn stop(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all: Vec<Answer> =
            self.threads.into_iter().flat_map(|t| t.join().unwrap_or_default()).collect();
        all.sort_by_key(|a| a.at_ms);
        all
    }
}

fn buyer_thread(market: &Market, thread: u64, stop: &AtomicBool) -> Vec<Answer> {
    let mut rng = SplitMix64::new(market.seed ^ (thread + 1).wrapping_mul(0x9E37_79B9));
    let mut answers = Vec::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let user = (thread + 1) * 1_000_000 + n;
        one_buyer(market, &mut rng, user, &mut answers);
        std::thread::sleep(Duration::from_millis(rng.between(20, 80)));
    }
    answers
}

/// One buyer's visit: submit (twice at once now and then), retry the same id while the
/// outcome is open, then maybe query and pay.
fn one_buyer(market: &Market, rng: &mut SplitMix64, user: u64, out: &mut Vec<Answer>) {
    let id = format!("c{}-{user}", market.seed);
    if rng.chance(15) {
        let (m, i) = (market.clone(), id.clone());
        let twin = std::thread::spawn(move || submit(&m, user, &i, REQUEST_TIMEOUT));
        out.push(submit(market, user, &id, REQUEST_TIMEOUT));
        out.extend(twin.join().ok());
    }
    let mut last = submit(market, user, &id, patience(rng));
    for _ in 1..ATTEMPTS_MAX {
        if !is_open(&last.state) {
            break;
        }
        let retry_ms = last.retry_after_ms.unwrap_or(250).min(RETRY_AFTER_MAX_MS);
        let answer = std::mem::replace(&mut last, submit(market, user, &id, patience(rng)));
        std::thread::sleep(Duration::from_millis(retry_ms.max(50)));
        out.push(answer);
    }
    let promised = last.state.starts_with("QUEUED");
    out.push(last);
    if promised && rng.chance(40) {
        std::thread::sleep(Duration::from_millis(rng.between(200, 1_500)));
        let q = query(market, user, &id);
        let order = q.order_id.clone().filter(|_| q.state == "SUCCEEDED");
        out.push(q);
        if let Some(order) = order {
            after_order(market, rng, (user, &id, &order), out);
        }
    }
}

/// What a buyer with an order does: pays (45 %), cancels (20 %), cancels and pays anyway
/// (10 %: the payment must be recorded for a refund), or nothing (the order closes unpaid).
fn after_order(
    market: &Market,
    rng: &mut SplitMix64,
    ids: (u64, &str, &str),
    out: &mut Vec<Answer>,
) {
    let choice = rng.between(0, 99);
    if (45..75).contains(&choice) {
        let mut answer = cancel(market, ids);
        if is_open(&answer.state) {
            std::thread::sleep(Duration::from_millis(500));
            out.push(std::mem::replace(&mut answer, cancel(market, ids)));
        }
        out.push(answer);
    }
    if choice < 45 || (65..75).contains(&choice) {
        out.push(pay(market, ids));
    }
}

/// How long this submit waits for its answer: mostly the whole request timeout.
fn patience(rng: &mut SplitMix64) -> Duration {
    if rng.chance(IMPATIENT_PERCENT) {
        Duration::from_millis(rng.between(IMPATIENT_MS.0, IMPATIENT_MS.1))
    } else {
        REQUEST_TIMEOUT
    }
}

fn is_open(state: &str) -> bool {
    matches!(state, "UNKNOWN" | "SUBMIT_CLOSED" | "SYSTEM_BUSY" | "OVERLOADED" | "")
}

fn pass(market: &Market, user: u64) -> String {
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        + 3_600;
    let keys = PassKeys::parse(DEV_PASS_KEYS).expect("the development key parses");
    keys.mint("dev", UserId(user), ActivityId(market.sku.0), exp).expect("a pass")
}

/// One same-id retry after the sale (the settling of open outcomes).
pub fn retry(market: &Market, user: u64, id: &str) -> Answer {
    submit(market, user, id, REQUEST_TIMEOUT)
}

fn submit(market: &Market, user: u64, id: &str, timeout: Duration) -> Answer {
    let (a, s) = market.sku;
    let body = format!(r#"{{"activity_id":{a},"sku_id":{s},"request_id":"{id}","quantity":1}}"#);
    let pass = pass(market, user);
    let r = http::request(
        market.target,
        ("POST", "/v1/reservations"),
        Some(&pass),
        Some(&body),
        timeout,
    );
    record(market, AnswerKind::Submit, (user, id), r.ok())
}

fn query(market: &Market, user: u64, id: &str) -> Answer {
    let (a, s) = market.sku;
    let path = format!("/v1/reservations/{id}?activity_id={a}&sku_id={s}");
    let pass = pass(market, user);
    let r = http::request(market.target, ("GET", &path), Some(&pass), None, REQUEST_TIMEOUT);
    record(market, AnswerKind::Query, (user, id), r.ok())
}

fn cancel(market: &Market, (user, id, order): (u64, &str, &str)) -> Answer {
    let path = format!("/v1/orders/{order}/cancel?activity_id={}", market.sku.0);
    let pass = pass(market, user);
    let r = http::request(market.target, ("POST", &path), Some(&pass), None, REQUEST_TIMEOUT);
    let mut answer = record(market, AnswerKind::Cancel, (user, id), r.ok());
    answer.order_id = Some(order.to_owned());
    answer
}

fn pay(market: &Market, (user, id, order): (u64, &str, &str)) -> Answer {
    let payment = format!("pay-{order}");
    let sig = Signed { payment_id: &payment, order_id: order, status: "PAID", amount_cents: 100 }
        .sign(&market.payment_key);
    let body = format!(
        r#"{{"payment_id":"{payment}","order_id":"{order}","status":"PAID","amount_cents":100,"signature":"{sig}"}}"#
    );
    let r = http::request(
        market.target,
        ("POST", "/v1/payments/callback"),
        None,
        Some(&body),
        REQUEST_TIMEOUT,
    );
    let mut answer = record(market, AnswerKind::Pay, (user, id), r.ok());
    answer.order_id = Some(order.to_owned());
    answer
}

/// The answer as the auditor reads it; a broken connection is state `""` (outcome open).
fn record(
    market: &Market,
    kind: AnswerKind,
    (user, id): (u64, &str),
    r: Option<http::Response>,
) -> Answer {
    let text = |r: &http::Response, f: &str| r.body[f].as_str().map(str::to_owned);
    Answer {
        at_ms: market.started.elapsed().as_millis() as u64,
        kind,
        user,
        request_id: id.to_owned(),
        status: r.as_ref().map_or(0, |r| r.status),
        state: r.as_ref().and_then(|r| text(r, "state")).unwrap_or_default(),
        reason: r.as_ref().and_then(|r| text(r, "reason_code")),
        reservation_id: r.as_ref().and_then(|r| text(r, "reservation_id")),
        order_id: r.as_ref().and_then(|r| text(r, "order_id")),
        retry_after_ms: r.as_ref().and_then(|r| r.body["retry_after_ms"].as_u64()),
    }
}
