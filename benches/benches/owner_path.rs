//! The whole owner path per request on one core (issue 25 item 6): the edge's reservation path
//! before sell-out, priced beside its sold-out path so that "the reservation path within 1.5×
//! the sold-out path per request" can be read off one run.
//!
//! Run: `cargo bench -p flashsale-benches --bench owner_path -- --warm-up-time 1 --measurement-time 3`
//! (needs `redis-server` on the PATH; a private one is started on a free port).
//!
//! What one request runs, in the shard's order (`engine/src/shard/submit.rs`,
//! `engine/src/logic/submit.rs`), all of it the engine's own code: HTTP parse, pass verify
//! (HMAC), body parse, the payload hash and the SKU replica's fast path ("not sold out":
//! forward), the owner's sans-I/O `begin` (partition, admission, the Redis circuit, the ids),
//! the real `FCALL reserve` through the engine's Redis store (`shard::store::Store::connect`,
//! which loads the `seckill` library as the engine does) and script binding, `finish`, the
//! order-create message encoded as the durable side encodes it before publishing
//! (`OrderCreate::encode`), `on_published` as if the log had acknowledged it, `path_done`, and
//! the `QUEUED` answer written into the connection's buffer. Every request is a new buyer with
//! a new request id (passes minted before the timed loop), so each one is a real reservation;
//! before each batch Redis is flushed and the SKU preheated with more stock than the batch
//! takes (outside the timing), and the owner state starts fresh.
//!
//! What it excludes: the HTTP socket's syscalls (as `sold_out_path` does; the Redis socket's
//! are in), the rate limiters, counters and tracing spans of both paths, the modes table and
//! health lookups behind admission's inputs (a fixed "normal, backlog fresh" view), and the
//! publish itself — the bench stops at the handoff: no NATS, no log-publish circuit, no
//! crossing to the durable side's thread and back, no publish wait timer and no deferred
//! `mark_sent`.
//!
//! What it prints: criterion's wall time per request (one in flight; redis-server's time on
//! the other core included), then a same-run CPU account: the bench thread's CPU time per
//! request (`CLOCK_THREAD_CPUTIME_ID`, `flashsale_benches::cpu_clock`: user and kernel time of
//! this thread only, so redis-server's CPU is not in it; printed apart from `/proc`) for the
//! sold-out path (new buyers of a sold-out SKU, `flashsale_benches::submit_path`, the steps the
//! `sold_out_path` bench runs), for the owner path with 1 and with 16 requests in flight, their
//! ratios, and the owner path's CPU by step (each step timed alone over the same number of
//! requests; the rest is the glue between them). Rounds are interleaved; medians are printed.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use criterion::{black_box, Criterion};
use flashsale_benches::cpu_clock::{on_thread_cpu, thread_cpu};
use flashsale_benches::loadgen::search::median;
use flashsale_benches::submit_path::{
    buyers, front, parse, pass_keys, sold_out_path, sold_out_replica, write_answer, ACTIVITY_ID,
    SKU_ID,
};
use flashsale_benches::{on_glommio, BenchRedis};
use flashsale_engine::app::cpu::{process_ticks, US_PER_TICK};
use flashsale_engine::app::serve::default_edge_config;
use flashsale_engine::logic::admission::Backlog;
use flashsale_engine::logic::api::{payload_hash, PayloadHash};
use flashsale_engine::logic::auth::PassKeys;
use flashsale_engine::logic::circuit::CircuitState;
use flashsale_engine::logic::clock::now_ms;
use flashsale_engine::logic::ids::{ActivityId, SkuId, UserId};
use flashsale_engine::logic::modes::EffectiveMode;
use flashsale_engine::logic::outcome::SubmitOutcome;
use flashsale_engine::logic::overload::Permit as PathPermit;
use flashsale_engine::logic::partition::{FastPath, SkuReplica};
use flashsale_engine::logic::placement::SkuKey;
use flashsale_engine::logic::submit::{
    Begin, Call, Outside, OwnerLimits, OwnerState, Published, ReserveResult, SubmitAnswer,
    SubmitRequest,
};
use flashsale_engine::shard::store::Store;
use flashsale_engine::shard::submit::reserve_args;
use flashsale_io::redis::layout::ActivityStatus;
use flashsale_io::redis::script::{PreheatArgs, ReserveArgs, ReserveReply, ScriptError, SkuKeys};
use flashsale_io::wire::OrderCreate;

/// Units beyond a batch's requests: no batch sells the SKU out (a sell-out would flip the
/// replica and end the path being priced).
const STOCK_SLACK: u64 = 1_000;

/// Requests per pass of the CPU account: 20,000 requests of the owner path are about a second
/// of this thread's CPU and as much of redis-server's, enough for the thread clock (ns
/// resolution) and for redis-server's /proc ticks (10 ms) to within one per cent.
const CPU_REQUESTS: u64 = 20_000;

/// Interleaved rounds of the CPU account (medians printed).
const CPU_ROUNDS: usize = 3;

/// Requests in flight in the CPU account's concurrent owner pass (the engine pipelines every
/// task's `FCALL` on one connection, so a busy shard shares each socket write and read).
const DEPTH_CONCURRENT: usize = 16;

/// The first bench buyer: above the sold-out replica's buyers (100,001..110,000).
const FIRST_USER: u64 = 1_000_000;

/// The shard's side of the bench: its Redis store, its owner state (fresh per batch) and what
/// the front needs (pass keys; the SKU's replica, not sold out).
struct Edge {
    store: Store,
    owner: RefCell<OwnerState>,
    limits: OwnerLimits,
    pending_grace_ms: u64,
    keys: PassKeys,
    replica: SkuReplica,
}

impl Edge {
    /// The engine's store for a shard (router, pipelined connection, library loaded) over the
    /// edge's default configuration.
    async fn connect(addr: SocketAddr) -> Edge {
        let mut config = default_edge_config(addr);
        // One SKU is driven here faster than its production admission rate (50,000 `reserve`
        // attempts a second, a token bucket): the bucket is still consulted on every request,
        // only never empty, so every request takes the path being priced.
        config.partition.attempts_per_s = 1_000_000;
        let store = Store::connect(0, &config).await.expect("connect the store to bench redis");
        let limits = config.owner_limits();
        Edge {
            store,
            owner: RefCell::new(OwnerState::new(limits, rand::random())),
            limits,
            pending_grace_ms: config.pending_grace_ms,
            keys: pass_keys(),
            replica: SkuReplica::default(),
        }
    }

    /// Outside any timing: Redis flushed, the SKU on sale from a minute ago for a day with
    /// `stock` units (one per buyer), and a fresh owner state.
    async fn reseed(&self, stock: u64) {
        let client = self.store.functions.client();
        client.command(&[b"FLUSHALL", b"SYNC"]).await.expect("FLUSHALL");
        let now = now_ms();
        let args = PreheatArgs {
            status: ActivityStatus::Active,
            start_ms: now - 60_000,
            end_ms: now + 86_400_000,
            version: 1,
            reservation_ttl_ms: 300_000,
            stock,
            max_per_buyer: 1,
        };
        let keys = self.store.sku_keys(sku());
        self.store.functions.preheat(&keys, &args).await.expect("preheat");
        *self.owner.borrow_mut() = OwnerState::new(self.limits, rand::random());
    }
}

fn sku() -> SkuKey {
    SkuKey::new(ACTIVITY_ID, SKU_ID)
}

/// The whole owner path for the request in `raw`, into `out`; returns the bytes written.
async fn owner_path(edge: &Edge, raw: &[u8], out: &mut BytesMut) -> usize {
    out.clear();
    let now = now_ms();
    let request = parse(raw);
    let mut chunked = Vec::new();
    let body = request.body.bytes(&mut chunked);
    let front = front(&request, body, &edge.keys, &edge.replica, now);
    assert!(matches!(front.fast, FastPath::Forward), "the SKU is on sale: {:?}", front.fast);
    let owned = SubmitRequest {
        key: front.key,
        request_id: front.submit.request_id.as_str(),
        user_id: front.user_id,
        quantity: front.submit.quantity,
        payload_hash: &front.payload_hash,
        traceparent: request.traceparent,
    };
    let answer = owner_submit(edge, &owned).await;
    assert_eq!(answer.outcome, SubmitOutcome::Queued, "{answer:?}");
    write_answer(out, &request, Some(owned.request_id), &answer);
    out.len()
}

/// The SKU's keys and the owner's `begin`, which must call Redis here (never answer at once).
fn begin(edge: &Edge, s: &SubmitRequest<'_>, now: u64) -> (Rc<SkuKeys>, Call) {
    let keys = edge.store.sku_keys(s.key);
    let node = edge.store.functions.router().node_of(keys.slot());
    match edge.owner.borrow_mut().begin(s, node, &outside(now), now) {
        Begin::Call(call) => (keys, call),
        Begin::Answer { answer, .. } => panic!("begin answered at once: {answer:?}"),
    }
}

/// `shard/submit.rs`'s `owner_submit_inner`: `begin`, the expensive path, `path_done`.
async fn owner_submit(edge: &Edge, s: &SubmitRequest<'_>) -> SubmitAnswer {
    let now = now_ms();
    let (keys, call) = begin(edge, s, now);
    let started = Instant::now();
    let (answer, path) = expensive_path(edge, s, &keys, call, now).await;
    let latency_us = started.elapsed().as_micros() as u64;
    edge.owner.borrow_mut().path_done(path, latency_us);
    answer
}

/// `shard/submit.rs`'s `expensive_path` for a fresh reservation, up to the handoff: `reserve`,
/// `finish`, the message encoded, `on_published` as if acknowledged.
async fn expensive_path(
    edge: &Edge,
    s: &SubmitRequest<'_>,
    keys: &SkuKeys,
    call: Call,
    now: u64,
) -> (SubmitAnswer, PathPermit) {
    assert!(!call.sold_out_reads, "the SKU is not sold out");
    let args = reserve_args(s, &call, now, edge.pending_grace_ms);
    let started = Instant::now();
    let reply = edge.store.functions.reserve(keys, &args).await;
    // The shard observes `reserve`'s latency into a histogram here.
    black_box(started.elapsed());
    let finish = edge.owner.borrow_mut().finish(call, s, created(reply), now);
    assert!(finish.replica.is_none(), "no sold-out flip");
    let message = finish.publish.expect("CREATED publishes");
    handoff(message);
    let answer = edge.owner.borrow_mut().on_published(s, finish.answer, Published::Acked);
    (answer, finish.path)
}

/// Where the bench stops: the message as it leaves for the log, encoded as the durable side's
/// publisher encodes it (`Publisher::publish_order_as`).
fn handoff(message: OrderCreate) {
    black_box(message.encode());
}

/// Admission's other inputs (`shard/submit.rs`'s `outside`): no mode snapshot, log circuit
/// closed, a backlog sampled just now and empty, PostgreSQL answered just now, a random draw.
fn outside(now: u64) -> Outside {
    Outside {
        mode: EffectiveMode::NO_SNAPSHOT,
        log_publish: CircuitState::Closed,
        backlog: Backlog { oldest_pending_age_ms: 0, pending_count: 0, polled_at_ms: now },
        pg_outage_age_ms: 0,
        draw: rand::random(),
    }
}

/// `shard/submit.rs`'s `reserve_result` for the one reply a bench batch expects.
fn created(reply: Result<ReserveReply, ScriptError>) -> ReserveResult {
    match reply {
        Ok(ReserveReply::Created { stock_after, expires_at_ms }) => {
            ReserveResult::Created { stock_after, expires_at_ms }
        }
        other => panic!("reserve did not create a reservation: {other:?}"),
    }
}

/// Runs every request of `requests` through the owner path, `depth` at a time (one task each,
/// as the shard runs one per connection); returns the wall time.
async fn run_owner(edge: &Rc<Edge>, requests: &Rc<Vec<Vec<u8>>>, depth: usize) -> Duration {
    let start = Instant::now();
    let tasks: Vec<_> = (0..depth)
        .map(|task| {
            let (edge, requests) = (Rc::clone(edge), Rc::clone(requests));
            glommio::spawn_local(async move {
                let mut out = BytesMut::with_capacity(4096);
                for raw in requests.iter().skip(task).step_by(depth) {
                    owner_path(&edge, raw, &mut out).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await;
    }
    start.elapsed()
}

/// One criterion batch: `iters` new buyers from `first_user` through the owner path, one in
/// flight, on a fresh executor, store and owner state; returns the timed loop's wall time.
fn owner_batch(addr: SocketAddr, first_user: u64, iters: u64) -> Duration {
    on_glommio(move || async move {
        let edge = Rc::new(Edge::connect(addr).await);
        edge.reseed(iters + STOCK_SLACK).await;
        let requests = Rc::new(buyers(&edge.keys, first_user..first_user + iters, now_ms() / 1000));
        run_owner(&edge, &requests, 1).await
    })
}

fn criterion_pass(addr: SocketAddr) {
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
        .configure_from_args();
    let mut next_user = FIRST_USER;
    {
        let mut group = criterion.benchmark_group("owner_path");
        group.bench_function("reserve_queued_in_flight_1", |b| {
            b.iter_custom(|iters| {
                let first = next_user;
                next_user += iters;
                owner_batch(addr, first, iters)
            })
        });
        group.finish();
    }
    criterion.final_summary();
}

/// A pass of `n` requests: the bench thread's CPU and the wall time.
#[derive(Debug, Clone, Copy)]
struct Pass {
    cpu: Duration,
    wall: Duration,
    n: u64,
}

impl Pass {
    fn cpu_us(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.n as f64
    }

    fn wall_us(&self) -> f64 {
        self.wall.as_secs_f64() * 1e6 / self.n as f64
    }
}

/// The owner path's steps, each timed alone over the same requests (µs of CPU per request).
#[derive(Debug, Clone, Copy)]
struct Steps {
    front_us: f64,
    reserve_us: f64,
    decisions_us: f64,
    encode_us: f64,
    answer_us: f64,
}

/// One round of the CPU account.
#[derive(Debug, Clone, Copy)]
struct Round {
    sold_out: Pass,
    owner: Pass,
    owner_concurrent: Pass,
    /// redis-server's CPU per request during the 1-in-flight owner pass (from /proc).
    redis_us: f64,
    steps: Steps,
}

/// The sold-out path for `n` new buyers of a sold-out SKU, on this thread.
fn sold_out_pass(first_user: u64, n: u64) -> Pass {
    let keys = pass_keys();
    let replica = sold_out_replica(30001);
    let requests = buyers(&keys, first_user..first_user + n, now_ms() / 1000);
    let mut out = BytesMut::with_capacity(4096);
    let start = Instant::now();
    let ((), cpu) = on_thread_cpu(|| {
        for raw in &requests {
            black_box(sold_out_path(raw, &keys, &replica, now_ms(), &mut out));
        }
    });
    Pass { cpu, wall: start.elapsed(), n }
}

/// The owner path for `n` new buyers, `depth` in flight; also redis-server's CPU per request.
async fn owner_pass(
    edge: &Rc<Edge>,
    redis_pid: u32,
    first_user: u64,
    n: u64,
    depth: usize,
) -> (Pass, f64) {
    edge.reseed(n + STOCK_SLACK).await;
    let requests = Rc::new(buyers(&edge.keys, first_user..first_user + n, now_ms() / 1000));
    let redis_before = process_ticks(redis_pid).unwrap_or(0);
    let cpu_before = thread_cpu();
    let wall = run_owner(edge, &requests, depth).await;
    let cpu = thread_cpu().saturating_sub(cpu_before);
    let redis_ticks = process_ticks(redis_pid).unwrap_or(0).saturating_sub(redis_before);
    let redis_us = (redis_ticks * US_PER_TICK) as f64 / n as f64;
    (Pass { cpu, wall, n }, redis_us)
}

fn main() {
    let redis = BenchRedis::start();
    let (addr, redis_pid) = (redis.addr(), redis.pid());
    criterion_pass(addr);
    let rounds: Vec<Round> = on_glommio(move || async move {
        let edge = Rc::new(Edge::connect(addr).await);
        let mut rounds = Vec::new();
        // Buyers of the CPU account: past any the criterion pass could have used.
        let mut next_user = 1_000_000_000;
        for _ in 0..CPU_ROUNDS {
            rounds.push(cpu_round(&edge, redis_pid, next_user).await);
            next_user += 10 * CPU_REQUESTS;
        }
        rounds
    });
    report(&rounds);
    drop(redis);
}

/// One round: the sold-out path, the owner path at 1 and at [`DEPTH_CONCURRENT`] in flight,
/// then the owner path's steps alone; buyers from `first_user` on, each pass its own.
async fn cpu_round(edge: &Rc<Edge>, redis_pid: u32, first_user: u64) -> Round {
    let n = CPU_REQUESTS;
    let sold_out = sold_out_pass(first_user, n);
    let (owner, redis_us) = owner_pass(edge, redis_pid, first_user + n, n, 1).await;
    let (owner_concurrent, _) =
        owner_pass(edge, redis_pid, first_user + 2 * n, n, DEPTH_CONCURRENT).await;
    let steps = steps(edge, first_user + 3 * n, n).await;
    Round { sold_out, owner, owner_concurrent, redis_us, steps }
}

/// The owner path's steps alone, each over `n` new buyers from `first_user` (µs of this
/// thread's CPU per request).
async fn steps(edge: &Rc<Edge>, first_user: u64, n: u64) -> Steps {
    let per_request = |cpu: Duration| cpu.as_secs_f64() * 1e6 / n as f64;
    let users = first_user..first_user + n;
    let requests = buyers(&edge.keys, users.clone(), now_ms() / 1000);
    let front_us = per_request(front_step(edge, &requests));
    edge.reseed(n + STOCK_SLACK).await;
    let reserve_us = per_request(reserve_step(edge, users.clone()).await);
    let (decisions, messages) = decisions_step(edge, users.clone());
    // The message is dropped after its encoding in the path too.
    let ((), encode) = on_thread_cpu(|| {
        for message in messages {
            black_box(message.encode());
        }
    });
    let answer_us = per_request(answer_step(&requests, users));
    Steps {
        front_us,
        reserve_us,
        decisions_us: per_request(decisions),
        encode_us: per_request(encode),
        answer_us,
    }
}

/// The front as the owner path runs it: clock, parse, body, pass, body parse, hash, replica.
fn front_step(edge: &Edge, requests: &[Vec<u8>]) -> Duration {
    on_thread_cpu(|| {
        for raw in requests {
            let now = now_ms();
            let request = parse(raw);
            let mut chunked = Vec::new();
            let body = request.body.bytes(&mut chunked);
            let front = front(&request, body, &edge.keys, &edge.replica, now);
            assert!(matches!(black_box(front.fast), FastPath::Forward));
        }
    })
    .1
}

/// A reservation's ids and payload hash, made up (no `begin`) for the Redis step alone.
struct Made {
    user_id: u64,
    request_id: String,
    reservation_id: String,
    message_id: String,
    payload_hash: PayloadHash,
}

fn made(user_id: u64) -> Made {
    Made {
        user_id,
        request_id: format!("req-{user_id}"),
        reservation_id: format!("resv_{user_id:026}"),
        message_id: format!("msg_{user_id:026}"),
        payload_hash: payload_hash(ActivityId(ACTIVITY_ID), SkuId(SKU_ID), UserId(user_id), 1),
    }
}

/// `FCALL reserve` alone, one in flight, through the store: the arguments' check and encoding,
/// the socket write and read, the reply's parse.
async fn reserve_step(edge: &Edge, users: std::ops::Range<u64>) -> Duration {
    let calls: Vec<Made> = users.map(made).collect();
    let keys = edge.store.sku_keys(sku());
    let now = now_ms();
    let start = thread_cpu();
    for call in &calls {
        let args = ReserveArgs {
            request_id: &call.request_id,
            user_id: call.user_id,
            payload_hash: call.payload_hash.as_str(),
            reservation_id: &call.reservation_id,
            message_id: &call.message_id,
            now_ms: now,
            pending_grace_ms: edge.pending_grace_ms,
            quantity: 1,
        };
        let reply = edge.store.functions.reserve(&keys, &args).await;
        assert!(matches!(reply, Ok(ReserveReply::Created { .. })), "{reply:?}");
    }
    thread_cpu().saturating_sub(start)
}

/// The owner's decisions without I/O, as `owner_submit` makes them: clock, admission's
/// inputs, the SKU's keys and node, `begin`, `finish` (with the `CREATED` Redis would have
/// answered), `on_published`, `path_done`. Returns the messages to publish (encoded apart).
fn decisions_step(edge: &Edge, users: std::ops::Range<u64>) -> (Duration, Vec<OrderCreate>) {
    *edge.owner.borrow_mut() = OwnerState::new(edge.limits, rand::random());
    let inputs: Vec<Made> = users.map(made).collect();
    let mut messages = Vec::with_capacity(inputs.len());
    let ((), cpu) = on_thread_cpu(|| {
        for made in &inputs {
            let s = SubmitRequest {
                key: sku(),
                request_id: &made.request_id,
                user_id: UserId(made.user_id),
                quantity: 1,
                payload_hash: &made.payload_hash,
                traceparent: None,
            };
            messages.push(decide(edge, &s));
        }
    });
    (cpu, messages)
}

fn decide(edge: &Edge, s: &SubmitRequest<'_>) -> OrderCreate {
    let now = now_ms();
    let (_, call) = begin(edge, s, now);
    let started = Instant::now();
    let created = ReserveResult::Created { stock_after: 1_000_000, expires_at_ms: now + 300_000 };
    let finish = edge.owner.borrow_mut().finish(call, s, created, now);
    let message = finish.publish.expect("CREATED publishes");
    let answer = edge.owner.borrow_mut().on_published(s, finish.answer, Published::Acked);
    assert_eq!(black_box(answer).outcome, SubmitOutcome::Queued);
    let latency_us = started.elapsed().as_micros() as u64;
    edge.owner.borrow_mut().path_done(finish.path, latency_us);
    message
}

/// The `QUEUED` answer written for each request (parsed before the timing).
fn answer_step(requests: &[Vec<u8>], users: std::ops::Range<u64>) -> Duration {
    let parsed: Vec<_> = requests.iter().map(|raw| parse(raw)).collect();
    let answers: Vec<(String, SubmitAnswer)> = users
        .map(|user| {
            let id = format!("resv_{user:026}");
            (format!("req-{user}"), SubmitAnswer::holding(SubmitOutcome::Queued, id.into()))
        })
        .collect();
    let mut out = BytesMut::with_capacity(4096);
    on_thread_cpu(|| {
        for (request, (request_id, answer)) in parsed.iter().zip(&answers) {
            out.clear();
            write_answer(&mut out, request, Some(request_id), answer);
            black_box(&out);
        }
    })
    .1
}

/// `f` over the rounds: its median and each round's value.
fn over_rounds<T>(rounds: &[T], f: impl Fn(&T) -> f64) -> (f64, String) {
    let values: Vec<f64> = rounds.iter().map(f).collect();
    let each: Vec<String> = values.iter().map(|v| format!("{v:.2}")).collect();
    (median(values), each.join(" / "))
}

fn line(what: &str, rounds: &[Round], f: impl Fn(&Round) -> f64) {
    let (m, each) = over_rounds(rounds, f);
    println!("  {what:<50} {m:>8.2}   ({each})");
}

/// The medians (and the rounds) of the CPU account.
fn report(rounds: &[Round]) {
    let concurrent = format!("owner path, {DEPTH_CONCURRENT} in flight");
    println!(
        "\nsame-run CPU account ({CPU_ROUNDS} interleaved rounds of {CPU_REQUESTS} requests; \
         medians, rounds in brackets)"
    );
    println!("bench thread CPU per request, µs (redis-server's not included):");
    line("sold-out path (new buyers)", rounds, |r| r.sold_out.cpu_us());
    line("owner path, 1 in flight", rounds, |r| r.owner.cpu_us());
    line(&concurrent, rounds, |r| r.owner_concurrent.cpu_us());
    println!("ratio owner / sold-out, thread CPU per request (issue 25 goal: <= 1.5):");
    line("1 in flight", rounds, |r| r.owner.cpu_us() / r.sold_out.cpu_us());
    line(&format!("{DEPTH_CONCURRENT} in flight"), rounds, |r| {
        r.owner_concurrent.cpu_us() / r.sold_out.cpu_us()
    });
    println!("wall time per request, µs:");
    line("sold-out path", rounds, |r| r.sold_out.wall_us());
    line("owner path, 1 in flight", rounds, |r| r.owner.wall_us());
    line(&concurrent, rounds, |r| r.owner_concurrent.wall_us());
    line("redis-server CPU per request, 1 in flight (/proc)", rounds, |r| r.redis_us);
    report_steps(rounds);
}

/// The owner path's CPU by step, each step's share of the whole path's median.
fn report_steps(rounds: &[Round]) {
    let (owner, _) = over_rounds(rounds, |r| r.owner.cpu_us());
    println!("owner path (1 in flight) by step, µs of CPU per request, each step timed alone:");
    let step = |what: &str, f: fn(&Steps) -> f64| {
        let (m, each) = over_rounds(rounds, |r| f(&r.steps));
        println!("  {what:<50} {m:>8.2}   {:>5.1}%   ({each})", 100.0 * m / owner);
        m
    };
    let sum = step("front: parse, pass, body, hash, replica", |s| s.front_us)
        + step("FCALL reserve via the store (syscalls included)", |s| s.reserve_us)
        + step("begin, finish, on_published, path_done", |s| s.decisions_us)
        + step("order-create encode (the handoff)", |s| s.encode_us)
        + step("QUEUED answer written", |s| s.answer_us);
    let rest = owner - sum;
    let what = "rest: the glue between the steps";
    println!("  {what:<50} {rest:>8.2}   {:>5.1}%", 100.0 * rest / owner);
}
