//! Trace export over OTLP (issue 28 item 4) against a real OTLP/HTTP receiver
//! (`flashsale_tests::otlp`: real export requests decoded with the protocol's protobuf
//! definitions), each test with its own engine and receiver:
//!
//! - a reservation's life arrives as spans with their names, business ids (the user id only
//!   hashed) and links across the log: the reservation (under the buyer's span), its publish,
//!   the order write (exported by a separate worker process's exporter, under the context the
//!   message carried) and the compensation of an expired reservation;
//! - sampling is decided once, at the reservation: ratio 1 exports every reservation's spans
//!   (even for a buyer whose own flag said "not sampled"), ratio 0 nothing, and a worker
//!   configured otherwise honours the decision the message carries;
//! - a dead (connection refused) or hung (accepts, never answers) collector changes nothing
//!   for buyers: the same answers, latency printed per phase (not asserted against a time),
//!   and the drop counter rises.
//!
//! Run: `cargo test -p flashsale-tests --test tracing_export -- --test-threads=1`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use flashsale_engine::app::serve;
use flashsale_io::trace::{user_id_hash, MessageIds, OtlpEndpoint, SampleRatio, TraceConfig};
use flashsale_pg_worker::worker::{WorkerHandle, WorkerTracing};
use flashsale_tests::otlp::{dead_endpoint, Collector, OtlpReceiver, ReceivedSpan};
use flashsale_tests::{metric, state, wait_for_ms, Engine, HttpClient};
use serde_json::Value;

/// OTLP span kinds (opentelemetry-proto `SpanKind`).
const KIND_SERVER: i32 = 2;
const KIND_PRODUCER: i32 = 4;
const KIND_CONSUMER: i32 = 5;
/// OTLP status codes.
const STATUS_ERROR: i32 = 2;

/// Trace export to `endpoint` at `ratio`, looked at every 50 ms, each export bounded by
/// 500 ms, in a queue of `queue` spans (batches of at most half of it).
fn tracing(endpoint: &str, ratio: &str, queue: usize) -> TraceConfig {
    TraceConfig {
        endpoint: Some(OtlpEndpoint::parse(endpoint).unwrap()),
        sample_ratio: SampleRatio::parse(ratio).unwrap(),
        queue_spans_max: queue,
        export_batch_max: (queue / 2).max(1),
        export_interval_ms: 50,
        export_timeout_ms: 500,
        service_instance_id: String::new(),
    }
}

/// A worker process of its own (as `flashsale worker` runs it), exporting its spans to
/// `endpoint` with its own sampling ratio.
fn worker_exporting(engine: &Engine, endpoint: &str, ratio: &str) -> WorkerHandle {
    let mut worker = serve::default_worker_config(&engine.db.url, &engine.nats.url());
    worker.pg.pool_size = 8;
    worker.runtime_threads = 1;
    worker.order_writers = 2;
    worker.fetch_wait_ms = 50;
    worker.nice = 0;
    let mut config = tracing(endpoint, ratio, 1_024);
    config.service_instance_id = "test-worker".into();
    worker.tracing = WorkerTracing::Export(config);
    flashsale_pg_worker::worker::start(worker).expect("the worker starts")
}

/// `POST /v1/reservations`, with a `traceparent` when given; the answer and its latency.
fn submit(
    engine: &Engine,
    client: &mut HttpClient,
    (user, activity, sku): (u64, u64, u64),
    request_id: &str,
    traceparent: Option<&str>,
) -> (u16, Value, Duration) {
    let body = format!(
        r#"{{"activity_id":{activity},"sku_id":{sku},"request_id":"{request_id}","quantity":1}}"#
    );
    let trace_header = traceparent.map(|t| format!("traceparent: {t}\r\n")).unwrap_or_default();
    let raw = format!(
        "POST /v1/reservations HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {}\r\n\
         {trace_header}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        engine.pass(user, activity),
        body.len()
    );
    let sent = Instant::now();
    client.send_raw(raw.as_bytes());
    let response = client.read_response().expect("an answer");
    (response.status, response.json(), sent.elapsed())
}

fn named<'a>(spans: &'a [ReceivedSpan], name: &str) -> Vec<&'a ReceivedSpan> {
    spans.iter().filter(|s| s.name == name).collect()
}

fn count(spans: &[ReceivedSpan], name: &str) -> usize {
    named(spans, name).len()
}

/// The one span called `name` whose `reservation_id` is `reservation_id`.
fn one<'a>(spans: &'a [ReceivedSpan], name: &str, reservation_id: &str) -> &'a ReceivedSpan {
    let found: Vec<_> = named(spans, name)
        .into_iter()
        .filter(|s| s.attr("reservation_id") == Some(reservation_id))
        .collect();
    assert_eq!(found.len(), 1, "one {name} for {reservation_id}: {found:#?}");
    found[0]
}

/// The business ids every span of a reservation carries, the user id only hashed.
fn assert_ids(span: &ReceivedSpan, request_id: &str, (user, activity, sku): (u64, u64, u64)) {
    assert_eq!(span.attr("request_id"), Some(request_id), "{span:#?}");
    assert_eq!(span.attr("activity_id"), Some(activity.to_string().as_str()));
    assert_eq!(span.attr("sku_id"), Some(sku.to_string().as_str()));
    assert_eq!(span.attr("user_id_hash"), Some(format!("{:016x}", user_id_hash(user)).as_str()));
    assert!(span.attr("message_id").is_some_and(|m| m.starts_with("msg_")), "{span:#?}");
    let raw_user = user.to_string();
    assert!(span.attributes.values().all(|v| *v != raw_user), "raw user id exported: {span:#?}");
    assert_eq!(span.service_name, "flashsale");
}

const A1: u64 = 81_001;
const S1: u64 = 82_001;
const A2: u64 = 81_002;
const S2: u64 = 82_002;

#[test]
fn a_reservations_life_arrives_as_spans_linked_across_the_log() {
    let receiver = OtlpReceiver::start(Collector::Answering);
    let engine = Engine::start_with(|c| c.tracing = tracing(&receiver.endpoint(), "1", 1_024));
    engine.create_activity(A1, S1, 2);
    // A second activity whose reservations expire before any worker runs: the worker rejects
    // them and redis-sync compensates.
    engine.create_activity_with(&format!(
        r#"{{"activity_id":{A2},"sku_id":{S2},"stock":1,"reservation_ttl_ms":200}}"#
    ));
    let mut client = HttpClient::connect(engine.http());
    // The buyer's own flag says "not sampled": the ratio decides, not the buyer.
    let buyer_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let buyer_span = "00f067aa0ba902b7";
    let buyer_traceparent = format!("00-{buyer_trace}-{buyer_span}-00");
    let buyers = [
        ((777_001, A1, S1), "req-trace-1", Some(buyer_traceparent.as_str())),
        ((777_002, A1, S1), "req-trace-2", None),
        ((777_003, A2, S2), "req-trace-3", None),
    ];
    let mut reservations = BTreeMap::new();
    for (buyer, request_id, traceparent) in buyers {
        let (status, answer, _) = submit(&engine, &mut client, buyer, request_id, traceparent);
        assert_eq!((status, state(&answer)), (202, "QUEUED"), "{answer}");
        reservations.insert(request_id, answer["reservation_id"].as_str().unwrap().to_owned());
    }
    // Sold out: answered without Redis or the log, and without a span.
    let (_, sold_out, _) = submit(&engine, &mut client, (777_004, A1, S1), "req-trace-4", None);
    assert_eq!(state(&sold_out), "SOLD_OUT");
    std::thread::sleep(Duration::from_millis(400));
    // The worker samples nothing of its own: every order.write below exists because the
    // message carried the reservation's decision.
    let worker = worker_exporting(&engine, &receiver.endpoint(), "0");
    wait_for_ms("3 reservations, 3 publishes, 3 order writes, 1 compensation", 30_000, || {
        let spans = receiver.spans();
        count(&spans, "seckill.reservation") == 3
            && count(&spans, "log.publish") == 3
            && count(&spans, "order.write") == 3
            && count(&spans, "inventory.compensate") == 1
    });
    worker.shutdown().expect("the worker stops");
    let spans = receiver.spans();
    for (buyer, request_id, _) in buyers {
        let reservation_id = &reservations[request_id];
        let reservation = one(&spans, "seckill.reservation", reservation_id);
        let publish = one(&spans, "log.publish", reservation_id);
        let write = one(&spans, "order.write", reservation_id);
        for span in [reservation, publish, write] {
            assert_ids(span, request_id, buyer);
        }
        // The reservation span's id is the one its message id names, so a step that knows
        // only the message id can link to it.
        let message_id = reservation.attr("message_id").unwrap();
        let named_ids = MessageIds::of(message_id);
        assert_eq!(reservation.span_id, hex(&named_ids.reservation_span_id));
        assert_eq!(
            (reservation.kind, reservation.attr("result_code")),
            (KIND_SERVER, Some("QUEUED"))
        );
        // Its publish, a child, in the same trace.
        assert_eq!((publish.kind, publish.attr("result_code")), (KIND_PRODUCER, Some("ACKED")));
        assert_eq!(
            (&publish.trace_id, &publish.parent_span_id),
            (&reservation.trace_id, &reservation.span_id)
        );
        assert_eq!(publish.attr("messaging.message.id"), Some(message_id));
        // Across the log: the order write hangs under the reservation span the message carried.
        assert_eq!(write.kind, KIND_CONSUMER);
        assert_eq!(
            (&write.trace_id, &write.parent_span_id),
            (&reservation.trace_id, &reservation.span_id)
        );
        assert_eq!(write.attr("message_id"), Some(message_id));
        assert_eq!(write.attr("messaging.consumer.group.name"), Some("order-writer"));
        if request_id == "req-trace-1" {
            // The buyer's trace continued, under the buyer's span (remote).
            assert_eq!(
                (reservation.trace_id.as_str(), reservation.parent_span_id.as_str()),
                (buyer_trace, buyer_span)
            );
            assert_ne!(reservation.flags & 0x200, 0, "the parent is remote: {reservation:#?}");
        } else {
            // No traceparent: the trace the message id names, a root span.
            assert_eq!(reservation.trace_id, hex(&named_ids.trace_id));
            assert_eq!(reservation.parent_span_id, "");
        }
    }
    // The two orders: each write names the order PostgreSQL committed.
    for request_id in ["req-trace-1", "req-trace-2"] {
        let reservation_id = &reservations[request_id];
        let write = one(&spans, "order.write", reservation_id);
        assert_eq!(write.attr("result_code"), Some("ORDER_CREATED"));
        let order_id = write.attr("order_id").expect("the order id");
        let sql = format!(
            "SELECT count(*) FROM orders WHERE reservation_id = '{reservation_id}' AND order_id = '{order_id}'"
        );
        assert_eq!(engine.pg_count(&sql), 1, "{write:#?}");
    }
    // The expired one: rejected by the worker, compensated by redis-sync, in the same trace.
    let expired = &reservations["req-trace-3"];
    let write = one(&spans, "order.write", expired);
    assert_eq!(write.attr("result_code"), Some("REJECTED_EXPIRED"));
    let compensation = one(&spans, "inventory.compensate", expired);
    assert_ids(compensation, "req-trace-3", (777_003, A2, S2));
    let reservation = one(&spans, "seckill.reservation", expired);
    assert_eq!(compensation.kind, KIND_CONSUMER);
    assert_eq!(
        (&compensation.trace_id, &compensation.parent_span_id),
        (&reservation.trace_id, &reservation.span_id)
    );
    assert_eq!(compensation.attr("result_code"), Some("EXPIRED"));
    assert_eq!(compensation.attr("compensation"), Some("APPLIED"));
    assert_eq!(compensation.attr("return_stock"), Some("true"));
    assert!(spans.iter().all(|s| s.status_code != STATUS_ERROR), "no failed step");
    assert!(
        spans.iter().all(|s| s.attr("request_id") != Some("req-trace-4")),
        "no span for SOLD_OUT"
    );
    assert_eq!(receiver.bad_requests(), 0);
    // The engine's own account: 3 reservations + 3 publishes + 1 compensation, none dropped.
    let metrics = engine.metrics();
    assert_eq!(metric(&metrics, "flashsale_trace_spans_exported_total"), 7, "{metrics}");
    assert_eq!(metric(&metrics, "flashsale_trace_spans_dropped_total{reason=\"queue_full\"}"), 0);
    assert_eq!(
        metric(&metrics, "flashsale_trace_spans_dropped_total{reason=\"export_failed\"}"),
        0
    );
    println!(
        "tracing_export: {} spans in {} export requests from the engine and the worker",
        spans.len(),
        receiver.requests()
    );
}

#[test]
fn ratio_zero_exports_nothing_and_the_worker_honours_the_reservations_decision() {
    let receiver = OtlpReceiver::start(Collector::Answering);
    let engine = Engine::start_with(|c| c.tracing = tracing(&receiver.endpoint(), "0", 1_024));
    engine.create_activity(A1, S1, 3);
    let mut client = HttpClient::connect(engine.http());
    // A buyer asking for sampling does not get it either.
    let asked = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for (i, traceparent) in [Some(asked), None, None].into_iter().enumerate() {
        let request_id = format!("req-zero-{i}");
        let buyer = (778_000 + i as u64, A1, S1);
        let (_, answer, _) = submit(&engine, &mut client, buyer, &request_id, traceparent);
        assert_eq!(state(&answer), "QUEUED", "{answer}");
    }
    // This worker would sample everything of its own; the messages say "not sampled".
    let worker = worker_exporting(&engine, &receiver.endpoint(), "1");
    wait_for_ms("3 orders written", 30_000, || {
        engine.pg_count(&format!("SELECT count(*) FROM orders WHERE sku_id = {S1}")) == 3
    });
    // The worker's exporter makes its last export before the shutdown returns.
    worker.shutdown().expect("the worker stops");
    let metrics = engine.metrics();
    assert_eq!(metric(&metrics, "flashsale_trace_spans_recorded_total"), 0, "{metrics}");
    assert!(receiver.spans().is_empty(), "{:#?}", receiver.spans());
    assert_eq!(receiver.requests(), 0);
}

/// What buyers saw in one phase: each answer's state, and each answer's latency; what the
/// engine counted of its spans.
struct Phase {
    states: Vec<String>,
    latencies_us: Vec<u64>,
    exported: u64,
    dropped_queue_full: u64,
    dropped_export_failed: u64,
}

impl Phase {
    fn dropped(&self) -> u64 {
        self.dropped_queue_full + self.dropped_export_failed
    }
}

/// Spans a phase's queue holds: more than its sale makes (30 reservations, two spans each), so
/// a healthy collector gets every one however the exporter's rounds fall on a busy box.
const PHASE_QUEUE_SPANS: usize = 256;

/// A short sale (30 units, 40 buyers, one after another on one connection) on an engine whose
/// collector is `endpoint`; waits for the exporter to have failed when `expect_drops`.
fn sale_against(endpoint: &str, expect_drops: bool) -> Phase {
    let engine = Engine::start_with(|c| c.tracing = tracing(endpoint, "1", PHASE_QUEUE_SPANS));
    engine.create_activity(A1, S1, 30);
    let mut client = HttpClient::connect(engine.http());
    let (mut states, mut latencies_us) = (Vec::new(), Vec::new());
    for i in 0..40u64 {
        let buyer = (779_000 + i, A1, S1);
        let (_, answer, latency) =
            submit(&engine, &mut client, buyer, &format!("req-fo-{i}"), None);
        states.push(state(&answer).to_owned());
        latencies_us.push(latency.as_micros() as u64);
    }
    let queue_full =
        |m: &str| metric(m, "flashsale_trace_spans_dropped_total{reason=\"queue_full\"}");
    let export_failed =
        |m: &str| metric(m, "flashsale_trace_spans_dropped_total{reason=\"export_failed\"}");
    let dropped = |m: &str| queue_full(m) + export_failed(m);
    if expect_drops {
        wait_for_ms("the exporter to drop spans", 10_000, || dropped(&engine.metrics()) > 0);
    } else {
        wait_for_ms("every span exported", 10_000, || {
            let m = engine.metrics();
            metric(&m, "flashsale_trace_spans_exported_total") == 60
        });
    }
    let metrics = engine.metrics();
    Phase {
        states,
        latencies_us,
        exported: metric(&metrics, "flashsale_trace_spans_exported_total"),
        dropped_queue_full: queue_full(&metrics),
        dropped_export_failed: export_failed(&metrics),
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[test]
fn a_dead_or_hung_collector_changes_nothing_for_buyers() {
    let answering = OtlpReceiver::start(Collector::Answering);
    let hung = OtlpReceiver::start(Collector::Hung);
    let phases = [
        ("answering", sale_against(&answering.endpoint(), false)),
        ("dead (connection refused)", sale_against(&dead_endpoint(), true)),
        ("hung (accepts, never answers)", sale_against(&hung.endpoint(), true)),
    ];
    println!(
        "collector                       answers                        P50 µs   P99 µs   max µs  \
         exported  dropped (queue full / export failed)"
    );
    for (name, phase) in &phases {
        let mut sorted = phase.latencies_us.clone();
        sorted.sort_unstable();
        let queued = phase.states.iter().filter(|s| *s == "QUEUED").count();
        let sold_out = phase.states.iter().filter(|s| *s == "SOLD_OUT").count();
        println!(
            "{name:<31} {queued} QUEUED, {sold_out} SOLD_OUT, {} other {:>8} {:>8} {:>8} {:>9} {:>8} ({} / {})",
            phase.states.len() - queued - sold_out,
            percentile(&sorted, 0.5),
            percentile(&sorted, 0.99),
            sorted[sorted.len() - 1],
            phase.exported,
            phase.dropped(),
            phase.dropped_queue_full,
            phase.dropped_export_failed,
        );
    }
    let (_, baseline) = &phases[0];
    let expected: Vec<&str> = (0..40).map(|i| if i < 30 { "QUEUED" } else { "SOLD_OUT" }).collect();
    assert_eq!(baseline.states, expected, "the baseline sale");
    assert_eq!(
        (baseline.exported, baseline.dropped()),
        (60, 0),
        "every span of the baseline exported"
    );
    for (name, phase) in &phases[1..] {
        assert_eq!(phase.states, baseline.states, "{name}: the buyers' answers changed");
        assert_eq!(phase.exported, 0, "{name}");
        assert!(phase.dropped() > 0, "{name}: spans dropped and counted");
    }
    assert!(hung.connections() > 0, "the exporter did reach the hung collector");
    assert_eq!(answering.bad_requests(), 0);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
