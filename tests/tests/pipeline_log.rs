//! The log side of the durable pipeline against a real nats-server 2.9 (and PostgreSQL for the
//! outbox and the pool): stream and consumer creation (idempotent, the contract's settings),
//! publishing (dedup by `Nats-Msg-Id`, headers, "no stream found" retried until a stream
//! appears, a dead server reported as transient, the outstanding-ack bound waiting instead of
//! failing), the lag observer, outbox publishers side by side, and a multi-host PostgreSQL URL.

mod pipeline_support;

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use flashsale_io::jetstream::async_nats::jetstream::{consumer, stream};
use flashsale_io::jetstream::{
    Log, LogConfig, LogError, DLQ_STREAM, EVENTS_STREAM, ORDERS_STREAM, ORDER_WRITER_CONSUMER,
    REDIS_SYNC_CONSUMER,
};
use flashsale_io::wire::EventType;
use flashsale_pg_worker::{build_pool, publish_once, start, PgPoolConfig};
use pipeline_support::*;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn streams_and_consumers_are_created_idempotently_with_the_contract_settings() {
    let stack = stack().await;
    // The stack created them once; again with the same config changes nothing.
    stack.log.ensure_streams().await.expect("streams again");
    stack.log.ensure_consumers().await.expect("consumers again");
    let js = stack.log.context();

    let orders = js.get_stream(ORDERS_STREAM).await.expect("orders").cached_info().config.clone();
    assert_eq!(orders.subjects, vec!["seckill.order.create".to_owned()]);
    assert_eq!(orders.storage, stream::StorageType::File);
    assert_eq!(orders.retention, stream::RetentionPolicy::WorkQueue);
    assert_eq!(orders.discard, stream::DiscardPolicy::New);
    assert_eq!(orders.num_replicas, 1);
    assert!(orders.duplicate_window >= Duration::from_secs(600), "{:?}", orders.duplicate_window);
    let events = js.get_stream(EVENTS_STREAM).await.expect("events").cached_info().config.clone();
    assert_eq!(events.subjects, vec!["seckill.event.>".to_owned()]);
    assert_eq!(events.storage, stream::StorageType::File);
    let dlq = js.get_stream(DLQ_STREAM).await.expect("dlq").cached_info().config.clone();
    assert_eq!(dlq.subjects, vec!["seckill.dlq.>".to_owned()]);
    assert_eq!(dlq.storage, stream::StorageType::File);

    for (stream_name, durable) in
        [(ORDERS_STREAM, ORDER_WRITER_CONSUMER), (EVENTS_STREAM, REDIS_SYNC_CONSUMER)]
    {
        let stream = js.get_stream(stream_name).await.expect("stream");
        let info = stream.consumer_info(durable).await.expect("consumer");
        assert_eq!(info.config.durable_name.as_deref(), Some(durable));
        assert_eq!(info.config.ack_policy, consumer::AckPolicy::Explicit);
        assert_eq!(info.config.ack_wait, Duration::from_secs(1));
        assert_eq!(info.config.max_deliver, 5);
        assert!(info.config.deliver_subject.is_none(), "pull consumer");
    }
    assert_eq!(
        js.get_stream(ORDERS_STREAM).await.expect("orders").cached_info().state.consumer_count,
        1
    );

    // A changed delivery policy is applied to the existing consumers (and again is a no-op).
    let mut changed = stack.log.config().clone();
    changed.max_deliver = 7;
    changed.backoff_ms = vec![1_000, 3_000];
    let log = Log::connect(&changed).await.expect("connect");
    for _ in 0..2 {
        log.ensure_streams().await.expect("streams");
        log.ensure_consumers().await.expect("consumers");
    }
    let info = js
        .get_stream(ORDERS_STREAM)
        .await
        .expect("orders")
        .consumer_info(ORDER_WRITER_CONSUMER)
        .await
        .expect("consumer");
    assert_eq!(info.config.max_deliver, 7);
    assert_eq!(info.config.backoff, vec![Duration::from_secs(1), Duration::from_secs(3)]);

    // A dedup window under the contract's 10 minutes is refused before connecting.
    let short = LogConfig { duplicate_window_ms: 9 * 60 * 1000, ..stack.log.config().clone() };
    match Log::connect(&short).await {
        Err(LogError::Config(message)) => {
            assert!(message.contains("duplicate_window_ms"), "{message}")
        }
        other => panic!("expected a config error, got {:?}", other.err()),
    }
}

#[tokio::test]
async fn publishes_are_deduplicated_by_message_id_and_carry_their_headers() {
    let stack = stack().await;
    let publisher = stack.log.publisher();
    let m = message(ACTIVITY, SKU, 1, "dedup");
    let first = publisher.publish_order(&m).await.expect("publish");
    assert!(!first.duplicate);
    let again = publisher.publish_order(&m).await.expect("republish");
    assert!(again.duplicate, "same message_id inside the window");
    assert_eq!(again.sequence, first.sequence);
    let stored = stack.stream_messages(ORDERS_STREAM).await;
    assert_eq!(stored.len(), 1);
    let header = |name: &str| stored[0].headers.get(name).map(|v| v.as_str().to_owned());
    assert_eq!(header("Nats-Msg-Id"), Some(m.message_id.clone()));
    assert_eq!(header("traceparent"), m.traceparent.clone());
    assert_eq!(flashsale_io::wire::decode_order_create(&stored[0].payload), Ok(m));

    let body = Bytes::from_static(b"{}");
    let event =
        publisher.publish_event(7, EventType::Compensate, body.clone(), None).await.expect("event");
    let event_again =
        publisher.publish_event(7, EventType::Compensate, body, None).await.expect("event");
    assert!(!event.duplicate && event_again.duplicate);
    let stored = stack.stream_messages(EVENTS_STREAM).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].subject.as_str(), "seckill.event.compensate");
    assert_eq!(stored[0].headers.get("Nats-Msg-Id").map(|v| v.as_str()), Some("evt_7"));
    assert!(stored[0].headers.get("traceparent").is_none());
}

#[tokio::test]
async fn no_stream_found_is_retried_until_the_stream_appears_or_the_deadline() {
    let nats = flashsale_tests::nats();
    let config = LogConfig { publish_timeout_ms: 3_000, ..log_config(nats.url()) };
    let log = Log::connect(&config).await.expect("connect");
    let publisher = log.publisher();
    let m = message(ACTIVITY, SKU, 1, "early");

    // The stream appears 300 ms into the publish (as after a leader change): it succeeds.
    let creator = log.clone();
    let create_later = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        creator.ensure_streams().await.expect("streams");
    });
    let started = std::time::Instant::now();
    let ack = publisher.publish_order(&m).await.expect("published once the stream exists");
    assert!(started.elapsed() >= Duration::from_millis(250), "it had to wait for the stream");
    assert_eq!(ack.sequence, 1);
    create_later.await.expect("join");

    // A subject no stream listens on: retried until the deadline, then a transient error.
    let short = LogConfig { publish_timeout_ms: 400, ..config };
    let log = Log::connect(&short).await.expect("connect");
    let started = std::time::Instant::now();
    let err = log
        .publisher()
        .publish("seckill.nowhere", "msg_x", None, &[], Bytes::from_static(b"x"))
        .await
        .expect_err("no stream");
    assert!(matches!(err, LogError::NoStream { .. }), "{err:?}");
    assert!(err.is_transient());
    assert!(started.elapsed() < Duration::from_secs(2), "bounded by the publish timeout");
}

#[tokio::test]
async fn a_dead_server_is_a_transient_publish_error() {
    let mut stack = stack_with(|c| c.publish_timeout_ms = 500).await;
    let publisher = stack.log.publisher();
    stack.nats.kill();
    let err = publisher
        .publish_order(&message(ACTIVITY, SKU, 1, "dead"))
        .await
        .expect_err("server is gone");
    assert!(err.is_transient(), "{err:?}");
}

#[tokio::test]
async fn the_outstanding_ack_bound_makes_publishes_wait_not_fail() {
    const BOUND: usize = 4;
    let stack = stack().await;
    // The bounded client talks to NATS through a proxy that counts order publishes written
    // and their acks delivered: their difference is exactly the acks outstanding.
    let proxy = CountingProxy::start(stack.nats.addr());
    let mut config = log_config(format!("nats://{}", proxy.addr));
    config.publish_acks_outstanding_max = BOUND;
    let log = Log::connect(&config).await.expect("connect through the proxy");
    let publisher = log.publisher();
    let messages: Vec<_> = (1..=200).map(|u| message(ACTIVITY, SKU, u, &format!("b{u}"))).collect();
    let results =
        futures::future::join_all(messages.iter().map(|m| publisher.publish_order(m))).await;
    for r in &results {
        assert!(matches!(r, Ok(ack) if !ack.duplicate), "{r:?}");
    }
    assert_eq!(stack.stream_messages(ORDERS_STREAM).await.len(), 200);
    let (published, acked, max_outstanding) = proxy.counts();
    println!("{published} publishes, {acked} acks, at most {max_outstanding} outstanding");
    assert_eq!((published, acked), (200, 200));
    // Never more than the bound on the wire, and the bound was reached with 200 publishes
    // started at once: the others waited for a slot (and none failed, above).
    assert_eq!(max_outstanding, BOUND as u64, "the outstanding-ack bound held and was reached");
}

/// A TCP proxy in front of nats-server that parses the protocol both ways and counts order
/// publishes (`PUB`/`HPUB` to the order subject) and the messages delivered to reply inboxes
/// (the publish acks), keeping the largest difference seen.
struct CountingProxy {
    addr: std::net::SocketAddr,
    counts: std::sync::Arc<ProxyCounts>,
}

#[derive(Default)]
struct ProxyCounts {
    published: std::sync::atomic::AtomicU64,
    acked: std::sync::atomic::AtomicU64,
    max_outstanding: std::sync::atomic::AtomicU64,
}

impl CountingProxy {
    fn start(server: std::net::SocketAddr) -> CountingProxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = std::sync::Arc::new(ProxyCounts::default());
        let shared = std::sync::Arc::clone(&counts);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(upstream) = std::net::TcpStream::connect(server) else { return };
                let (c2, u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
                let up = std::sync::Arc::clone(&shared);
                std::thread::spawn(move || pump(client, upstream, &up, true));
                let down = std::sync::Arc::clone(&shared);
                std::thread::spawn(move || pump(u2, c2, &down, false));
            }
        });
        CountingProxy { addr, counts }
    }

    fn counts(&self) -> (u64, u64, u64) {
        use std::sync::atomic::Ordering::SeqCst;
        let c = &self.counts;
        (c.published.load(SeqCst), c.acked.load(SeqCst), c.max_outstanding.load(SeqCst))
    }
}

/// Forwards one direction operation by operation, counting before forwarding.
fn pump(from: std::net::TcpStream, mut to: std::net::TcpStream, counts: &ProxyCounts, up: bool) {
    use std::io::{BufRead, Read, Write};
    use std::sync::atomic::Ordering::SeqCst;
    let mut from = std::io::BufReader::new(from);
    loop {
        let mut line = Vec::new();
        match from.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&line).to_string();
        let words: Vec<&str> = text.split_whitespace().collect();
        let op = words.first().map(|w| w.to_ascii_uppercase()).unwrap_or_default();
        // PUB/HPUB (client to server) and MSG/HMSG (server to client): the last word is the
        // size of the payload that follows, then CRLF.
        if matches!(op.as_str(), "PUB" | "HPUB" | "MSG" | "HMSG") {
            let size: usize = words.last().unwrap().parse().unwrap();
            let mut payload = vec![0; size + 2];
            if from.read_exact(&mut payload).is_err() {
                break;
            }
            line.extend_from_slice(&payload);
            let subject = words.get(1).copied().unwrap_or("");
            if up && subject == flashsale_io::jetstream::ORDER_CREATE_SUBJECT {
                counts.published.fetch_add(1, SeqCst);
            } else if !up && subject.starts_with("_INBOX.") {
                counts.acked.fetch_add(1, SeqCst);
            }
            let outstanding =
                counts.published.load(SeqCst).saturating_sub(counts.acked.load(SeqCst));
            counts.max_outstanding.fetch_max(outstanding, SeqCst);
        }
        if to.write_all(&line).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

#[tokio::test]
async fn the_lag_observer_reports_pending_count_and_oldest_age() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 10, "TOKEN").await;
    let empty = stack.log.poll_order_writer_lag(now_ms()).await.expect("poll");
    assert_eq!((empty.pending, empty.oldest_pending_age_ms), (0, 0));
    let messages: Vec<_> = (1..=10).map(|u| message(ACTIVITY, SKU, u, &format!("l{u}"))).collect();
    stack.publish_all(&messages).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sample = stack.log.poll_order_writer_lag(now_ms()).await.expect("poll");
    assert_eq!(sample.pending, 10);
    assert!((300..10_000).contains(&sample.oldest_pending_age_ms), "{sample:?}");

    let worker = start(stack.worker_config(8)).expect("start");
    let lag = worker.lag();
    eventually("the worker's lag handle sees the drained backlog", WAIT, || {
        let lag = lag.clone();
        async move { lag.polled_at_ms() > 0 && lag.pending() == 0 && lag.oldest_pending_age_ms() == 0 }
    })
    .await;
    worker.shutdown().expect("shutdown");
    let drained = stack.log.poll_order_writer_lag(now_ms()).await.expect("poll");
    assert_eq!((drained.pending, drained.oldest_pending_age_ms), (0, 0));
}

/// The age is that of the oldest message not yet DELIVERED (the queue a new message waits
/// behind), not of the stream's first one: messages in a worker's hands — or written with
/// their acks lost, as in a consumer-leader change — count in `pending` but are no queue.
#[tokio::test]
async fn delivered_but_unacked_messages_count_as_pending_not_as_queue_age() {
    let stack = stack().await;
    seed_sku(&stack.client, ACTIVITY, SKU, 10, "TOKEN").await;
    let messages: Vec<_> = (1..=10).map(|u| message(ACTIVITY, SKU, u, &format!("d{u}"))).collect();
    stack.publish_all(&messages[..4]).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    stack.publish_all(&messages[4..]).await;
    let source = stack.log.order_writer().await.expect("bind");
    let first = source.fetch(4, Duration::ZERO).await.expect("pull 4");
    assert_eq!(first.len(), 4);
    let sample = stack.log.poll_order_writer_lag(now_ms()).await.expect("poll");
    assert_eq!(sample.pending, 10, "{sample:?}");
    assert!(sample.oldest_pending_age_ms < 400, "the undelivered head is young: {sample:?}");
    let rest = source.fetch(10, Duration::ZERO).await.expect("pull the rest");
    assert_eq!(rest.len(), 6);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sample = stack.log.poll_order_writer_lag(now_ms()).await.expect("poll");
    assert_eq!((sample.pending, sample.oldest_pending_age_ms), (10, 0), "nothing undelivered");
}

/// `count` outbox events with a minimal valid payload, straight into the table.
async fn insert_events(stack: &Stack, count: i64) {
    stack
        .client
        .execute(
            "INSERT INTO event_outbox (aggregate_id, event_type, payload) \
             SELECT 'resv_' || n, 'order_created', \
                    jsonb_build_object('n', n, 'traceparent', '00-' || n || '-01') \
             FROM generate_series(1, $1::bigint) AS n",
            &[&count],
        )
        .await
        .expect("insert events");
}

#[tokio::test]
async fn outbox_publishers_side_by_side_publish_every_event_and_mark_it_once() {
    let stack = stack().await;
    insert_events(&stack, 400).await;
    let pool = build_pool(&stack.pool_config()).expect("pool");

    // Deterministic: while one publisher holds the oldest 25 events, another takes the next 50.
    let holder = connect(&stack.db.url).await;
    holder.batch_execute("BEGIN").await.expect("begin");
    let held: HashSet<i64> = holder
        .query(flashsale_pg_worker::sql::CLAIM_UNPUBLISHED_SQL, &[&25i64])
        .await
        .expect("hold")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(held.len(), 25);
    let mut client = pool.get().await.expect("connection");
    let round = publish_once(&mut client, &stack.log.publisher(), 50).await.expect("round");
    assert_eq!(round.published.len(), 50);
    assert_eq!(round.marked, 50);
    assert!(
        round.published.iter().all(|id| !held.contains(id)),
        "SKIP LOCKED skipped the held events"
    );
    drop(client);
    holder.batch_execute("ROLLBACK").await.expect("release");

    // Then two publishers race for the rest.
    let run = |pool: flashsale_pg_worker::deadpool_postgres::Pool,
               publisher: flashsale_io::jetstream::Publisher| async move {
        let mut mine = Vec::new();
        let mut marked = 0;
        loop {
            let mut client = pool.get().await.expect("connection");
            let round = publish_once(&mut client, &publisher, 25).await.expect("round");
            assert_eq!(round.marked, round.published.len() as u64, "every held event marked once");
            assert_eq!(round.failed, 0);
            if round.claimed == 0 {
                return (mine, marked);
            }
            marked += round.marked;
            mine.extend(round.published);
        }
    };
    let (a, b) = tokio::join!(
        tokio::spawn(run(pool.clone(), stack.log.publisher())),
        tokio::spawn(run(pool.clone(), stack.log.publisher()))
    );
    let ((a, marked_a), (b, marked_b)) = (a.expect("join"), b.expect("join"));
    let a: HashSet<i64> = a.into_iter().collect();
    let b: HashSet<i64> = b.into_iter().collect();
    assert!(a.is_disjoint(&b), "an event was published by both");
    assert_eq!(marked_a + marked_b + 50, 400);
    let all: HashSet<i64> = a.union(&b).copied().chain(round.published.iter().copied()).collect();
    assert_eq!(all.len(), 400);
    assert_eq!(
        stack.count("SELECT count(*) FROM event_outbox WHERE published_at IS NULL").await,
        0
    );

    let wire = stack.stream_messages(EVENTS_STREAM).await;
    assert_eq!(wire.len(), 400);
    let ids: HashSet<String> = wire
        .iter()
        .map(|m| m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned()).expect("msg id"))
        .collect();
    let expected: HashSet<String> = all.iter().map(|id| format!("evt_{id}")).collect();
    assert_eq!(ids, expected);
    assert!(
        wire.iter().all(|m| m.headers.get("traceparent").is_some()),
        "traceparent from the payload"
    );
}

#[tokio::test]
async fn a_two_host_url_with_the_first_host_dead_connects_to_the_second() {
    let db = flashsale_tests::pg_database().await;
    let live: tokio_postgres::Config = db.url.parse().expect("url");
    let live_port = live.get_ports()[0];
    let dead_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    }; // closed again: connections there are refused
    let url = format!(
        "postgres://postgres@127.0.0.1:{dead_port},127.0.0.1:{live_port}/{}?target_session_attrs=read-write",
        db.name
    );
    let pool =
        build_pool(&PgPoolConfig { url, pool_size: 2, ..PgPoolConfig::default() }).expect("pool");
    let client = pool.get().await.expect("connects to the second host");
    let row = client
        .query_one("SELECT current_database(), current_setting('lock_timeout'), current_setting('statement_timeout')", &[])
        .await
        .expect("query");
    assert_eq!(row.get::<_, String>(0), db.name);
    assert_eq!(row.get::<_, String>(1), "2s", "the pool's lock_timeout");
    assert_eq!(row.get::<_, String>(2), "10s", "the pool's statement_timeout");
}
