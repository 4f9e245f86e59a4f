//! The closer asks the payment provider before it closes (`flashsale_pg_worker::provider`,
//! `payments::close_due_orders_verified`, migration 0005), against real PostgreSQL and a
//! stand-in provider: a tiny HTTP server on a thread that checks each signed status request and
//! answers in one of its modes (paid / unpaid / unknown / down / forged), signing its answers.
//!
//! PostgreSQL level (time is an argument, so the backoff is observed without waiting):
//! unpaid → closed and released; paid → applied as a callback; unknown, down and forged →
//! PAYMENT_UNKNOWN with the unit kept, asked again only after the backoff, then paid → PAID.
//! End to end: the worker's closer in an in-process engine closes a verified-unpaid order, a
//! late PAID becomes REFUND_NEEDED, its `refund_requested` event is published and
//! `GET /admin/v1/refunds` lists it.

mod pipeline_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use flashsale_io::jetstream::ORDER_WRITER_CONSUMER;
use flashsale_io::key::HmacKey;
use flashsale_io::payment::{Signed, StatusAnswer, StatusRequest};
use flashsale_pg_worker::payments::{
    apply_callback, close_due_orders_verified, list_refunds, CallbackOutcome, PaymentCallback,
};
use flashsale_pg_worker::provider::{Provider, ProviderConfig};
use flashsale_pg_worker::{write_batch, WriteOutcome};
use flashsale_tests::{small_worker, state, wait_for_ms, Engine, HttpClient};
use pipeline_support::{connect, count, db, message, now_ms, seed_sku, status_and_token, Db};
use tokio_postgres::Client;

const PAY_KEY_HEX: &str = "5f3c1a2b4d6e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";
const FORGED_KEY_HEX: &str = "00112233445566778899aabbccddeeff";
/// The pay timeout `pipeline_support::seed_activity` gives every activity.
const PAY_TIMEOUT_MS: u64 = 900_000;

// ---------------------------------------------------------------------------------------------
// The stand-in provider
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    Paid {
        payment_id: String,
        amount_cents: u64,
    },
    Unpaid,
    Unknown,
    /// Accepts and closes the connection without an answer.
    Down,
    /// Answers UNPAID signed with another key.
    Forged,
}

struct StandIn {
    addr: SocketAddr,
    mode: Arc<Mutex<Mode>>,
    /// Connections accepted (attempts).
    hits: Arc<AtomicUsize>,
    /// Requests whose signature did not verify (must stay 0).
    bad_requests: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl StandIn {
    fn start(mode: Mode) -> StandIn {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stand_in = StandIn {
            addr,
            mode: Arc::new(Mutex::new(mode)),
            hits: Arc::default(),
            bad_requests: Arc::default(),
            stop: Arc::default(),
        };
        let (mode, hits, bad, stop) = (
            stand_in.mode.clone(),
            stand_in.hits.clone(),
            stand_in.bad_requests.clone(),
            stand_in.stop.clone(),
        );
        std::thread::spawn(move || {
            let key = HmacKey::from_hex(PAY_KEY_HEX).unwrap();
            let forged = HmacKey::from_hex(FORGED_KEY_HEX).unwrap();
            for stream in listener.incoming() {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                hits.fetch_add(1, Ordering::Relaxed);
                let mode = mode.lock().unwrap().clone();
                serve(stream, &mode, &key, &forged, &bad);
            }
        });
        stand_in
    }

    fn url(&self) -> String {
        format!("http://{}/v1/payment-status", self.addr)
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::Relaxed)
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr);
        assert_eq!(self.bad_requests.load(Ordering::Relaxed), 0, "unsigned requests");
    }
}

fn read_request(stream: &mut TcpStream) -> Option<serde_json::Value> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let head = text[..end].to_ascii_lowercase();
            assert!(head.starts_with("post /v1/payment-status http/1.1"), "{head}");
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if raw.len() >= end + 4 + len {
                return serde_json::from_slice(&raw[end + 4..end + 4 + len]).ok();
            }
        }
    }
}

fn serve(mut stream: TcpStream, mode: &Mode, key: &HmacKey, forged: &HmacKey, bad: &AtomicUsize) {
    let Some(request) = read_request(&mut stream) else { return };
    let order_id = request["order_id"].as_str().unwrap_or("").to_owned();
    let nonce = request["nonce"].as_str().unwrap_or("").to_owned();
    let signed = StatusRequest {
        order_id: &order_id,
        nonce: &nonce,
        requested_at_ms: request["requested_at_ms"].as_u64().unwrap_or(0),
    };
    if !signed.verify(key, request["signature"].as_str().unwrap_or("")) {
        bad.fetch_add(1, Ordering::Relaxed);
        let _ = stream.write_all(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n");
        return;
    }
    let (payment_id, status, amount, signer) = match mode {
        Mode::Down => return,
        Mode::Paid { payment_id, amount_cents } => {
            (payment_id.as_str(), "PAID", *amount_cents, key)
        }
        Mode::Unpaid => ("", "UNPAID", 0, key),
        Mode::Unknown => ("", "PROCESSING", 0, key),
        Mode::Forged => ("", "UNPAID", 0, forged),
    };
    let answer = StatusAnswer {
        nonce: &nonce,
        payment_id,
        order_id: &order_id,
        status,
        amount_cents: amount,
    };
    let body = serde_json::json!({
        "order_id": order_id, "payment_id": payment_id, "status": status,
        "amount_cents": amount, "nonce": nonce, "signature": answer.sign(signer),
    })
    .to_string();
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body.as_bytes());
}

fn provider_config(url: &str) -> ProviderConfig {
    let mut config = ProviderConfig::new(url, HmacKey::from_hex(PAY_KEY_HEX).unwrap());
    config.timeout_ms = 2_000;
    config.attempts = 2;
    config.retry_pause_ms = 10;
    config.backoff_min_ms = 1_000;
    config.backoff_max_ms = 4_000;
    config
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL level
// ---------------------------------------------------------------------------------------------

async fn order(db: &Db, activity: i64, sku: i64, user: u64) -> String {
    let m = message(activity, sku, user, &format!("prov{user}"));
    let client = db.pool.get().await.expect("pooled connection");
    match write_batch(&client, ORDER_WRITER_CONSUMER, &[&m], now_ms())
        .await
        .expect("write")
        .remove(0)
    {
        WriteOutcome::Created { order_id, .. } => order_id,
        other => panic!("expected an order, got {other:?}"),
    }
}

async fn asks(c: &Client, order_id: &str) -> i64 {
    c.query_opt("SELECT attempts::bigint FROM payment_status_ask WHERE order_id = $1", &[&order_id])
        .await
        .expect("asks")
        .map_or(0, |r| r.get(0))
}

async fn outbox_count(c: &Client, event_type: &str) -> i64 {
    c.query_one("SELECT count(*) FROM event_outbox WHERE event_type = $1", &[&event_type])
        .await
        .expect("outbox")
        .get(0)
}

async fn assert_invariants(client: &Client, activity: i64, sku: i64) {
    let report = flashsale_pg_worker::check_invariants(client, activity, sku).await.expect("audit");
    assert!(report.ok(), "invariants violated: {report:#?}");
}

#[tokio::test]
async fn unpaid_closes_and_releases_paid_applies_as_a_callback() {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 1, 2, 2, "TOKEN").await;
    let (o1, o2) = (order(&db, 1, 2, 1).await, order(&db, 1, 2, 2).await);
    let stand_in = StandIn::start(Mode::Unpaid);
    let provider = Provider::new(provider_config(&stand_in.url())).unwrap();
    let late = now_ms() + PAY_TIMEOUT_MS + 1_000;

    // Not due yet: nobody is asked.
    let early = close_due_orders_verified(c, &provider, 16, now_ms()).await.expect("round");
    assert_eq!((early.round.candidates, stand_in.hits()), (0, 0));

    // o2 is paid at the provider but its callback never came.
    let paid_first = close_due_orders_verified(c, &provider, 1, late).await.expect("round");
    assert_eq!(paid_first.round.closed, vec![o1.clone()], "oldest first: o1, unpaid");
    assert_eq!(status_and_token(c, &o1).await, ("CLOSED".into(), "AVAILABLE".into()));
    assert_eq!(outbox_count(c, "order_cancelled").await, 1);
    stand_in.set(Mode::Paid { payment_id: "pay_p2".into(), amount_cents: 100 });
    let round = close_due_orders_verified(c, &provider, 16, late).await.expect("round");
    assert_eq!((round.paid, round.round.closed.len()), (vec![o2.clone()], 0));
    assert_eq!(status_and_token(c, &o2).await, ("PAID".into(), "SOLD".into()));
    assert_eq!(outbox_count(c, "order_paid").await, 1);
    assert_eq!(count(c, "SELECT count(*) FROM payment WHERE payment_id = 'pay_p2'").await, 1);
    // Settled orders are not asked again.
    let hits = stand_in.hits();
    let again = close_due_orders_verified(c, &provider, 16, late + 60_000).await.expect("round");
    assert_eq!((again.round.candidates, stand_in.hits()), (0, hits));
    assert_invariants(c, 1, 2).await;
}

/// Rounds every 250 ms of (simulated) time over 20 s with the provider in `mode`: the order
/// stays PAYMENT_UNKNOWN with its unit, and is asked only at the backoff's pace.
async fn unknown_for_20s(mode: Mode) {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 1, 2, 1, "TOKEN").await;
    let o = order(&db, 1, 2, 1).await;
    let stand_in = StandIn::start(mode.clone());
    let provider = Provider::new(provider_config(&stand_in.url())).unwrap();
    let start = now_ms() + PAY_TIMEOUT_MS + 1_000;
    let mut rounds = 0;
    let mut asked_in_rounds = 0;
    for step in 0..=80u64 {
        let round = close_due_orders_verified(c, &provider, 16, start + step * 250).await.unwrap();
        rounds += 1;
        assert!(round.round.closed.is_empty() && round.paid.is_empty(), "{mode:?}: {round:?}");
        asked_in_rounds += round.unknown.len();
    }
    let asked = asks(c, &o).await;
    println!(
        "{mode:?}: {rounds} rounds over 20 s, asked {asked} times ({} connections), backoff 1..4 s",
        stand_in.hits()
    );
    // 1 s, 2 s, 4 s, 4 s, ...: asks at 0, 1, 3, 7, 11, 15, 19 s.
    assert_eq!(asked, 7, "{mode:?}");
    assert_eq!(asked_in_rounds as i64, asked);
    let per_ask = if mode == Mode::Down { 2 } else { 1 };
    assert_eq!(stand_in.hits(), 7 * per_ask, "{mode:?}: retries only for no answer");
    assert_eq!(status_and_token(c, &o).await, ("PAYMENT_UNKNOWN".into(), "CLAIMED".into()));
    assert_eq!(outbox_count(c, "order_cancelled").await, 0);

    // Then the provider knows: paid → PAID.
    stand_in.set(Mode::Paid { payment_id: "pay_late".into(), amount_cents: 100 });
    let round = close_due_orders_verified(c, &provider, 16, start + 30_000).await.unwrap();
    assert_eq!(round.paid, vec![o.clone()]);
    assert_eq!(status_and_token(c, &o).await, ("PAID".into(), "SOLD".into()));
    assert_invariants(c, 1, 2).await;
}

#[tokio::test]
async fn unknown_keeps_the_unit_and_is_asked_again_with_backoff() {
    unknown_for_20s(Mode::Unknown).await;
}

#[tokio::test]
async fn a_provider_that_is_down_is_unknown() {
    unknown_for_20s(Mode::Down).await;
}

#[tokio::test]
async fn a_forged_answer_is_unknown() {
    unknown_for_20s(Mode::Forged).await;
}

#[tokio::test]
async fn a_provider_nobody_listens_on_is_unknown_and_unpaid_then_closes_an_unknown_order() {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 1, 2, 1, "TOKEN").await;
    let o = order(&db, 1, 2, 1).await;
    // A port with no listener: connection refused, within the attempts' bound.
    let free = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let provider = Provider::new(provider_config(&format!("http://{free}/s"))).unwrap();
    let late = now_ms() + PAY_TIMEOUT_MS + 1_000;
    let started = std::time::Instant::now();
    let round = close_due_orders_verified(c, &provider, 16, late).await.unwrap();
    println!("refused provider: round took {:?}", started.elapsed());
    assert_eq!(round.unknown, vec![o.clone()]);
    assert_eq!(status_and_token(c, &o).await.0, "PAYMENT_UNKNOWN");
    // The provider comes back and says unpaid: the PAYMENT_UNKNOWN order is closed, released.
    let stand_in = StandIn::start(Mode::Unpaid);
    let provider = Provider::new(provider_config(&stand_in.url())).unwrap();
    let round = close_due_orders_verified(c, &provider, 16, late + 10_000).await.unwrap();
    assert_eq!(round.round.closed, vec![o.clone()]);
    assert_eq!(status_and_token(c, &o).await, ("CLOSED".into(), "AVAILABLE".into()));
    assert_invariants(c, 1, 2).await;
}

#[tokio::test]
async fn refund_needed_emits_refund_requested_and_is_listed() {
    let db = db().await;
    let c = &db.client;
    seed_sku(c, 1, 2, 1, "TOKEN").await;
    let o = order(&db, 1, 2, 1).await;
    let stand_in = StandIn::start(Mode::Unpaid);
    let provider = Provider::new(provider_config(&stand_in.url())).unwrap();
    let late = now_ms() + PAY_TIMEOUT_MS + 1_000;
    close_due_orders_verified(c, &provider, 16, late).await.unwrap();
    assert_eq!(status_and_token(c, &o).await.0, "CLOSED");
    // The money arrives after the close (the race the closer cannot rule out).
    let cb = PaymentCallback {
        payment_id: "pay_r".into(),
        order_id: o.clone(),
        status: "PAID".into(),
        amount_cents: 250,
    };
    let applied = apply_callback(c, &cb, late + 1).await.unwrap();
    assert_eq!(applied.outcome, CallbackOutcome::RefundNeeded);
    assert!(apply_callback(c, &cb, late + 2).await.unwrap().replayed);
    let payloads: Vec<String> = c
        .query("SELECT payload::text FROM event_outbox WHERE event_type = 'refund_requested'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(payloads.len(), 1, "one event, not one per replay");
    let event =
        flashsale_io::wire::decode_event(payloads[0].as_bytes()).expect("redis-sync decodes it");
    assert_eq!(event.event_type, flashsale_io::wire::EventType::RefundRequested);
    assert_eq!(event.event_type.subject(), "seckill.event.refund_requested");
    assert_eq!(event.order_id.as_deref(), Some(o.as_str()));
    let json: serde_json::Value = serde_json::from_str(&payloads[0]).unwrap();
    assert_eq!(
        (json["payment_id"].as_str(), json["amount_cents"].as_i64()),
        (Some("pay_r"), Some(250))
    );
    let refunds = list_refunds(c, 100).await.unwrap();
    assert_eq!(refunds.len(), 1);
    assert_eq!(
        (refunds[0].order_id.as_str(), refunds[0].payment_id.as_str()),
        (o.as_str(), "pay_r")
    );
    assert_eq!(
        (refunds[0].amount_cents, refunds[0].order_status.as_deref()),
        (250, Some("CLOSED"))
    );
    assert_invariants(c, 1, 2).await;
}

// ---------------------------------------------------------------------------------------------
// End to end: the worker's closer, the outbox, the admin route
// ---------------------------------------------------------------------------------------------

fn callback_body(
    key: &HmacKey,
    payment_id: &str,
    order_id: &str,
    status: &str,
    amount: u64,
) -> String {
    let sig = Signed { payment_id, order_id, status, amount_cents: amount }.sign(key);
    format!(
        r#"{{"payment_id":"{payment_id}","order_id":"{order_id}","status":"{status}","amount_cents":{amount},"signature":"{sig}"}}"#
    )
}

#[test]
fn the_worker_asks_before_closing_and_refunds_are_listed() {
    let stand_in = StandIn::start(Mode::Unknown);
    let url = stand_in.url();
    let engine = Engine::start_with(|c| {
        let mut worker = small_worker(c);
        worker.closer.interval_ms = 100;
        let mut provider = provider_config(&url);
        provider.backoff_min_ms = 200;
        provider.backoff_max_ms = 400;
        worker.closer.provider = Some(provider);
        c.worker = Some(worker);
        c.edge.payment_key = Some(HmacKey::from_hex(PAY_KEY_HEX).unwrap());
    });
    let (a, s) = (501, 502);
    let body = format!(r#"{{"activity_id":{a},"sku_id":{s},"stock":1,"pay_timeout_ms":2000}}"#);
    engine.create_activity_with(&body);
    let mut c = HttpClient::connect(engine.http());
    let (status, queued) = engine.submit(&mut c, 1, a, s, "prov-1");
    assert_eq!((status, state(&queued)), (202, "QUEUED"), "{queued}");
    let mut order_id = String::new();
    wait_for_ms("order created", 10_000, || {
        let (_, v) = engine.query(&mut c, 1, a, s, "prov-1");
        order_id = v["order_id"].as_str().unwrap_or("").to_string();
        state(&v) == "SUCCEEDED"
    });
    let pg = |sql: String| -> i64 {
        let url = engine.db.url.clone();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move { count(&connect(&url).await, &sql).await })
    };
    let asks_sql = format!("SELECT coalesce(max(attempts), 0)::bigint FROM payment_status_ask WHERE order_id = '{order_id}'");
    // Unknown: asked again and again, the order kept.
    wait_for_ms("asked three times", 20_000, || pg(asks_sql.clone()) >= 3);
    let unknown_sql = format!(
        "SELECT count(*) FROM orders WHERE order_id = '{order_id}' AND status = 'PAYMENT_UNKNOWN'"
    );
    assert_eq!(pg(unknown_sql), 1);
    // Unpaid: closed by the worker.
    stand_in.set(Mode::Unpaid);
    let closed_sql =
        format!("SELECT count(*) FROM orders WHERE order_id = '{order_id}' AND status = 'CLOSED'");
    wait_for_ms("closed", 20_000, || pg(closed_sql.clone()) == 1);
    // A late PAID: refund needed, an event published, listed by the admin route.
    let key = HmacKey::from_hex(PAY_KEY_HEX).unwrap();
    let r = c.request(
        "POST",
        "/v1/payments/callback",
        None,
        Some(&callback_body(&key, "pay_e2e", &order_id, "PAID", 300)),
    );
    assert_eq!((r.status, state(&r.json())), (200, "REFUND_NEEDED"), "{}", r.body);
    wait_for_ms("refund_requested published", 10_000, || {
        pg("SELECT count(*) FROM event_outbox WHERE event_type = 'refund_requested' AND published_at IS NOT NULL".into()) == 1
    });
    let r = HttpClient::connect(engine.admin()).request("GET", "/admin/v1/refunds", None, None);
    assert_eq!(r.status, 200, "{}", r.body);
    let listed = r.json();
    assert_eq!(listed["count"], 1, "{listed}");
    let refund = &listed["refunds"][0];
    assert_eq!(
        (refund["order_id"].as_str(), refund["payment_id"].as_str()),
        (Some(order_id.as_str()), Some("pay_e2e"))
    );
    assert_eq!(
        (refund["amount_cents"].as_i64(), refund["order_status"].as_str()),
        (Some(300), Some("CLOSED"))
    );
    assert!(refund["since_ms"].as_i64().unwrap() > 0);
    engine.assert_invariants(a, s);
}
