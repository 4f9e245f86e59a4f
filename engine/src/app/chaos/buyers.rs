//! The soak's buyers: threads through the balancer, each buyer a new user with the mix of a
//! real sale — duplicate clicks (the same request sent twice at once), same-id retries of
//! every answer that leaves the outcome open (`UNKNOWN`, `SUBMIT_CLOSED`, `SYSTEM_BUSY`,
//! `OVERLOADED`, a broken connection) after the answer's `Retry-After`, queries of their own
//! request, and PAID callbacks for the orders they see. Every answer is recorded for the
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
        let twin = std::thread::spawn(move || submit(&m, user, &i));
        out.extend(submit(market, user, &id));
        out.extend(twin.join().ok().flatten());
    }
    let mut last = submit(market, user, &id);
    for _ in 1..ATTEMPTS_MAX {
        let open = last.as_ref().is_none_or(|a| is_open(&a.state));
        if !open {
            break;
        }
        let retry_ms = retry_after(last.as_ref()).min(RETRY_AFTER_MAX_MS);
        out.extend(last.take());
        std::thread::sleep(Duration::from_millis(retry_ms.max(50)));
        last = submit(market, user, &id);
    }
    let promised = last.as_ref().is_some_and(|a| a.state.starts_with("QUEUED"));
    out.extend(last);
    if promised && rng.chance(40) {
        std::thread::sleep(Duration::from_millis(rng.between(200, 1_500)));
        if let Some(q) = query(market, user, &id) {
            let order = q.order_id.clone().filter(|_| q.state == "SUCCEEDED");
            out.push(q);
            if let Some(order) = order.filter(|_| rng.chance(50)) {
                out.extend(pay(market, user, &id, &order));
            }
        }
    }
}

fn is_open(state: &str) -> bool {
    matches!(state, "UNKNOWN" | "SUBMIT_CLOSED" | "SYSTEM_BUSY" | "OVERLOADED" | "")
}

fn retry_after(answer: Option<&Answer>) -> u64 {
    answer.and_then(|a| a.retry_after_ms).unwrap_or(250)
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
pub fn retry(market: &Market, user: u64, id: &str) -> Option<Answer> {
    submit(market, user, id)
}

fn submit(market: &Market, user: u64, id: &str) -> Option<Answer> {
    let (a, s) = market.sku;
    let body = format!(r#"{{"activity_id":{a},"sku_id":{s},"request_id":"{id}","quantity":1}}"#);
    let pass = pass(market, user);
    let r = http::request(
        market.target,
        ("POST", "/v1/reservations"),
        Some(&pass),
        Some(&body),
        REQUEST_TIMEOUT,
    );
    Some(record(market, AnswerKind::Submit, (user, id), r.ok()))
}

fn query(market: &Market, user: u64, id: &str) -> Option<Answer> {
    let (a, s) = market.sku;
    let path = format!("/v1/reservations/{id}?activity_id={a}&sku_id={s}");
    let pass = pass(market, user);
    let r = http::request(market.target, ("GET", &path), Some(&pass), None, REQUEST_TIMEOUT);
    Some(record(market, AnswerKind::Query, (user, id), r.ok()))
}

fn pay(market: &Market, user: u64, id: &str, order: &str) -> Option<Answer> {
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
    Some(answer)
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
