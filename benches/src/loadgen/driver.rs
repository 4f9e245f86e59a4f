//! The open-loop driver: splits the run over `threads` event loops (`event_loop.rs`, one
//! thread each, each with its share of the connections and of the schedule), starts them on
//! one shared clock, prints the progress line, and merges what they measured.
//!
//! Open loop, as before: request `i` is due at `start + profile.offset_ns(i)` whatever the
//! server does; loop `k` of `n` sends the requests `i ≡ k (mod n)`, so together they keep the
//! whole grid. Latency counts from each attempt's intended send time (no coordinated
//! omission); the generator's own lateness is `dispatch_lag`, its wait for a free
//! connection is in `send_lag`, and its CPU over the run is `cpu_ticks` (the report divides
//! it by the answers: the instrument's own cost per request, issue 25 item 5).
//!
//! What it is not: the loop itself (`event_loop.rs`), the schedule (`schedule.rs`), the
//! retry rule (`retry.rs`), the checks after the run (`verify.rs`), the report.
//!
//! Read next: `event_loop.rs`, then `verify.rs`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier, Mutex, OnceLock};
use std::time::Duration;

use super::config::Progress;
use super::event_loop::{lock, Clock, EventLoop, Gauges, LoopSetup};
use super::http::SubmitTemplate;
use super::proc;
use super::retry::RetryPolicy;
use super::schedule::Profile;
use super::stats::{Recorder, Seen};

/// What the driver needs, resolved by the caller.
#[derive(Debug, Clone)]
pub struct DriveParams {
    pub target: SocketAddr,
    pub host: String,
    /// One pass per user, indexed by the plan's user number.
    pub passes: Vec<String>,
    pub activity_id: u64,
    pub sku_id: u64,
    pub run_id: String,
    pub profile: Profile,
    pub duration_ms: u64,
    pub connections: usize,
    pub pipeline: usize,
    /// Event loops (threads); at most `connections`.
    pub threads: usize,
    pub users: u32,
    pub duplicate_ratio: f64,
    pub seed: u64,
    pub retry: RetryPolicy,
    pub timeout_ms: u64,
    pub queue_max: usize,
    pub progress: Progress,
    pub trace_max: usize,
}

/// One request's timing (the first `trace_max` answers), offsets from the run's start.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceEntry {
    pub index: u64,
    pub attempt: u32,
    pub intended_us: u64,
    pub written_us: u64,
    pub answered_us: u64,
    pub latency_us: u64,
    pub state: String,
}

/// What the driver measured.
pub struct Measured {
    pub recorder: Recorder,
    pub seen: Seen,
    pub scheduled: u64,
    pub dropped: u64,
    /// Requests still queued (never written) when the run gave up waiting.
    pub unsent: u64,
    /// Time from the start to the last request written / the last answer read.
    pub sending_s: f64,
    pub answering_s: f64,
    /// The schedule's zero on the wall clock, µs since the Unix epoch (another process can
    /// align its own samples with the run: `flashsale demo`'s CPU table).
    pub started_unix_us: u64,
    /// Time from the start to the last answer read, µs.
    pub last_answer_us: u64,
    pub trace: Vec<TraceEntry>,
    /// The generator's CPU (user + system, every thread, USER_HZ ticks) from before its
    /// connections opened to after its last answer; `None` where `/proc` cannot be read.
    pub cpu_ticks: Option<u64>,
}

/// Runs the schedule against the target and returns what was measured. Must be called
/// inside a tokio runtime (the loops run on blocking threads, so a server in the same
/// runtime — the tests' — keeps running).
pub async fn drive(params: DriveParams) -> Measured {
    let loops = params.threads.clamp(1, params.connections.max(1));
    let gauges: Arc<Vec<Gauges>> = Arc::new((0..loops).map(|_| Gauges::default()).collect());
    let clock = Arc::new(Clock { barrier: Barrier::new(loops), start: OnceLock::new() });
    let progress = match params.progress {
        Progress::Stderr => {
            Some(tokio::spawn(progress_loop(Arc::clone(&gauges), Arc::clone(&clock))))
        }
        Progress::Off => None,
    };
    let run = {
        let gauges = Arc::clone(&gauges);
        let clock = Arc::clone(&clock);
        tokio::task::spawn_blocking(move || drive_blocking(params, loops, &gauges, clock))
    };
    let measured = match run.await {
        Ok(measured) => measured,
        // A loop panicked: a bug; surface it as such.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };
    if let Some(progress) = progress {
        progress.abort();
    }
    measured
}

fn drive_blocking(
    params: DriveParams,
    loops: usize,
    gauges: &Arc<Vec<Gauges>>,
    clock: Arc<Clock>,
) -> Measured {
    let cpu_before = proc::sample("self");
    let template = Arc::new(SubmitTemplate::new(
        &params.host,
        params.activity_id,
        params.sku_id,
        &params.run_id,
    ));
    let params = Arc::new(params);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let trace = Arc::new(Mutex::new(Vec::with_capacity(params.trace_max.min(1 << 16))));
    let share = |n: usize, k: usize| n / loops + usize::from(k < n % loops);
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..loops)
            .map(|k| {
                let setup = LoopSetup {
                    params: Arc::clone(&params),
                    template: Arc::clone(&template),
                    index: k,
                    loops,
                    connections: share(params.connections, k).max(1),
                    queue_max: share(params.queue_max, k).max(1),
                    clock: Arc::clone(&clock),
                    gauges: Arc::clone(gauges),
                    seen: Arc::clone(&seen),
                    trace: Arc::clone(&trace),
                };
                std::thread::Builder::new()
                    .name(format!("loadgen-{k}"))
                    .spawn_scoped(scope, move || run_loop(setup))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                Err(e) => panic!("spawn an event-loop thread: {e}"),
            })
            .collect()
    });
    let cpu_after = proc::sample("self");
    let mut recorder = Recorder::new();
    let (mut scheduled, mut dropped, mut unsent, mut last_written_us, mut last_answer_us) =
        (0, 0, 0, 0, 0);
    let mut per_second: Vec<u64> = Vec::new();
    for r in &results {
        recorder.merge(&r.recorder);
        scheduled += r.scheduled;
        dropped += r.dropped;
        unsent += r.unsent;
        last_written_us = last_written_us.max(r.last_written_us);
        last_answer_us = last_answer_us.max(r.last_answer_us);
        if per_second.len() < r.per_second.len() {
            per_second.resize(r.per_second.len(), 0);
        }
        for (a, b) in per_second.iter_mut().zip(&r.per_second) {
            *a += b;
        }
    }
    for (second, count) in per_second.into_iter().enumerate() {
        recorder.on_scheduled(second, count);
    }
    let mut trace = std::mem::take(&mut *lock(&trace));
    trace.sort_by_key(|t| (t.index, t.attempt));
    let seen = std::mem::take(&mut *lock(&seen));
    let started_unix_us = clock.start.get().map_or(0, |(_, unix_us)| *unix_us);
    Measured {
        recorder,
        seen,
        scheduled,
        dropped,
        unsent,
        sending_s: last_written_us as f64 / 1e6,
        answering_s: last_answer_us as f64 / 1e6,
        started_unix_us,
        last_answer_us,
        trace,
        cpu_ticks: cpu_before.zip(cpu_after).map(|(a, b)| b.cpu_ticks.saturating_sub(a.cpu_ticks)),
    }
}

/// One loop on this thread.
fn run_loop(setup: LoopSetup) -> super::event_loop::LoopResult {
    match EventLoop::new(setup) {
        Ok(event_loop) => event_loop.run(),
        // epoll_create1 failing (out of descriptors) leaves nothing to measure with.
        Err(e) => panic!("event loop: epoll: {e}"),
    }
}

pub(super) fn unix_us() -> u64 {
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since_epoch.map_or(0, |d| d.as_micros() as u64)
}

/// One line a second on stderr: what was sent, the rate, p99 so far, the main states.
async fn progress_loop(gauges: Arc<Vec<Gauges>>, clock: Arc<Clock>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut last_sent = 0u64;
    loop {
        tick.tick().await;
        let Some((start, _)) = clock.start.get() else { continue };
        let sum = |f: fn(&Gauges) -> u64| gauges.iter().map(f).sum::<u64>();
        let sent = sum(|g| g.sent.load(Ordering::Relaxed));
        let answered = sum(|g| g.answered.load(Ordering::Relaxed));
        let accepted = sum(|g| g.accepted.load(Ordering::Relaxed));
        let sold_out = sum(|g| g.sold_out.load(Ordering::Relaxed));
        let shed = sum(|g| g.shed.load(Ordering::Relaxed));
        let p99_ms =
            gauges.iter().map(|g| g.p99_us.load(Ordering::Relaxed)).max().unwrap_or(0) as f64 / 1e3;
        let rate = sent.saturating_sub(last_sent);
        last_sent = sent;
        eprintln!(
            "[{:>4}s] sent {sent} ({rate}/s)  answered {answered}  p99 {p99_ms:.2} ms  QUEUED \
             {accepted}  SOLD_OUT {sold_out}  OVERLOADED {shed}  other {}  queue {}  dropped {}  \
             errors {}",
            start.elapsed().as_secs(),
            answered.saturating_sub(accepted + sold_out + shed),
            sum(|g| g.queued.load(Ordering::Relaxed)),
            sum(|g| g.dropped.load(Ordering::Relaxed)),
            sum(|g| g.errors.load(Ordering::Relaxed)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::http::State;
    use crate::loadgen::retry::SameId;
    use crate::loadgen::stats::LatencySummary;
    use std::collections::HashMap;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// What a scripted server answers: given the request id and how many times it has been
    /// seen before (0 for its first send), the status line and the body.
    type Script = fn(&str, u32) -> (&'static str, String);

    /// Requests seen by a scripted server: request id → sends.
    type Sends = Arc<Mutex<HashMap<String, u32>>>;

    /// A tiny in-process server: every connection answers its requests strictly one at a
    /// time, each after `delay` (a stand-in for a busy engine), as `script` says.
    async fn scripted_server(delay: Duration, script: Script) -> (SocketAddr, Sends) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sends: Sends = Arc::default();
        let seen = Arc::clone(&sends);
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else { return };
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        // Requests end with the JSON body's closing brace.
                        while let Some(end) = buf.iter().position(|&b| b == b'}') {
                            let request = String::from_utf8_lossy(&buf[..=end]).into_owned();
                            buf.drain(..=end);
                            let id = request_id(&request);
                            let before = {
                                let mut seen = lock(&seen);
                                let n = seen.entry(id.clone()).or_insert(0);
                                *n += 1;
                                *n - 1
                            };
                            tokio::time::sleep(delay).await;
                            let (status, body) = script(&id, before);
                            let head = format!(
                                "HTTP/1.1 {status}\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            );
                            if s.write_all(head.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                });
            }
        });
        (addr, sends)
    }

    fn request_id(request: &str) -> String {
        let key = r#""request_id":""#;
        let from = request.find(key).map_or(0, |i| i + key.len());
        request[from..].split('"').next().unwrap_or_default().to_owned()
    }

    fn sold_out(_: &str, _: u32) -> (&'static str, String) {
        ("200 OK", r#"{"state":"SOLD_OUT"}"#.to_owned())
    }

    async fn slow_server(delay: Duration) -> SocketAddr {
        scripted_server(delay, sold_out).await.0
    }

    fn params(target: SocketAddr) -> DriveParams {
        DriveParams {
            target,
            host: target.to_string(),
            passes: vec!["p".into(); 4],
            activity_id: 1,
            sku_id: 2,
            run_id: "t".into(),
            profile: Profile::Constant { rate_per_s: 1_000 },
            duration_ms: 200,
            connections: 1,
            pipeline: 1,
            threads: 1,
            users: 4,
            duplicate_ratio: 0.0,
            seed: 1,
            retry: RetryPolicy::Off,
            timeout_ms: 10_000,
            queue_max: 10_000,
            progress: Progress::Off,
            trace_max: 10_000,
        }
    }

    /// Open loop: 1,000 req/s against a server that answers one per 5 ms. A closed-loop
    /// client would send 200 req/s and report 5 ms; here the requests still leave on the
    /// 1 ms grid (they queue), and each latency includes its wait in the queue.
    #[tokio::test(flavor = "current_thread")]
    async fn intended_times_stay_on_the_grid_and_latency_includes_queueing() {
        let delay = Duration::from_millis(5);
        let addr = slow_server(delay).await;
        let m = drive(params(addr)).await;
        assert_eq!(m.scheduled, 200);
        assert_eq!((m.dropped, m.unsent), (0, 0));
        assert_eq!(m.recorder.answered, 200);
        assert_eq!(m.recorder.count(State::SoldOut), 200);
        assert_eq!(m.trace.len(), 200);
        for (i, t) in m.trace.iter().enumerate() {
            assert_eq!(t.index, i as u64);
            // Intended times are exactly on the 1 ms grid.
            assert_eq!(t.intended_us, i as u64 * 1_000, "{t:?}");
            // Latency is answer − intended, so it includes the time queued before writing.
            assert_eq!(t.latency_us, t.answered_us - t.intended_us, "{t:?}");
            assert!(t.written_us >= t.intended_us);
            assert!(t.answered_us >= t.written_us, "{t:?}");
            // The server answers one request per 5 ms from the first one's arrival (at or after
            // the start): request i cannot be answered before (i + 1) × 5 ms, however the box
            // schedules the client. (Not `written + 5 ms`: the write's time is taken after the
            // write returns, and a client descheduled in between stamps it late — seen at
            // 2.3 ms with three builds beside it.)
            assert!(t.answered_us >= (i as u64 + 1) * 5_000, "{t:?}");
        }
        // The server serialises at 5 ms: request i is answered no earlier than (i+1) × 5 ms,
        // so the last one waited about 200 × 5 − 199 ms ≈ 0.8 s.
        let last = m.trace.last().unwrap();
        assert!(last.latency_us >= 790_000, "{last:?}");
        let summary = LatencySummary::of(&m.recorder.overall);
        assert!(summary.max >= 790.0 && summary.p50 >= 350.0, "{summary:?}");
        // The generator released every request on time (its own lag stays small) while the
        // wait for the busy connection shows in the send lag.
        assert!(m.recorder.dispatch_lag.max() < 50_000, "{}", m.recorder.dispatch_lag.max());
        assert_eq!(m.recorder.dispatch_lag.len(), 200);
        let due: Vec<u64> = m.recorder.timeline.iter().map(|s| s.scheduled).collect();
        assert_eq!(due[0], 200, "all 200 due within the first second: {due:?}");
        assert!(m.recorder.send_lag.max() >= 700_000);
    }

    /// A full queue drops (and counts) instead of growing; the schedule does not slow.
    #[tokio::test(flavor = "current_thread")]
    async fn full_queue_drops_and_counts() {
        let addr = slow_server(Duration::from_millis(20)).await;
        let m = drive(DriveParams { queue_max: 5, trace_max: 0, ..params(addr) }).await;
        assert_eq!(m.scheduled, 200);
        assert!(m.dropped >= 150, "dropped {}", m.dropped);
        assert_eq!(m.recorder.answered + m.dropped, 200);
    }

    /// No server at all: every connection attempt fails and is counted; the run ends.
    #[tokio::test(flavor = "current_thread")]
    async fn unreachable_target_ends_with_connect_errors() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let m = drive(DriveParams { timeout_ms: 100, duration_ms: 50, ..params(port) }).await;
        assert_eq!(m.scheduled, 50);
        assert_eq!(m.recorder.answered, 0);
        assert!(m.recorder.errors.connect > 0);
        assert_eq!(m.unsent + m.dropped, 50);
    }

    /// Every scheduled intent ends one way: final answer, failed, dropped or unsent.
    fn assert_intents_add_up(m: &Measured) {
        let n = &m.recorder.intents;
        assert_eq!(n.final_answered + n.failed + n.dropped + n.unsent, m.scheduled, "{n:?}");
        assert_eq!(n.final_answered, m.recorder.final_counts.iter().sum::<u64>());
        assert_eq!(n.final_answered, m.recorder.time_to_final.len());
        let t = &m.recorder.timeline;
        let kinds: u64 = t.iter().map(|s| s.accepted + s.sold_out + s.shed + s.other).sum();
        assert_eq!(kinds, m.recorder.answered);
        assert_eq!(t.iter().map(|s| s.answered).sum::<u64>(), m.recorder.answered);
    }

    /// Shed twice, then sold out: each buyer's FIRST answer is OVERLOADED, his FINAL one
    /// SOLD_OUT, after two retries with the SAME request id, each waiting the server's hint
    /// (100 ms) stretched by [1, 1.5); his time to the final answer includes both waits,
    /// while each attempt's latency counts from its own intended send.
    #[tokio::test(flavor = "current_thread")]
    async fn shed_answers_are_retried_with_the_same_id_after_the_hint_with_jitter() {
        fn shed_twice(_: &str, before: u32) -> (&'static str, String) {
            if before < 2 {
                let body = r#"{"state":"OVERLOADED","retry_after_ms":100}"#;
                ("429 Too Many Requests", body.to_owned())
            } else {
                ("200 OK", r#"{"state":"SOLD_OUT"}"#.to_owned())
            }
        }
        let (addr, sends) = scripted_server(Duration::from_millis(1), shed_twice).await;
        let p = DriveParams {
            profile: Profile::Constant { rate_per_s: 100 },
            duration_ms: 200,
            connections: 4,
            retry: RetryPolicy::SameId(SameId { retry_max: 5, budget_ms: 10_000, jitter_pct: 50 }),
            ..params(addr)
        };
        let m = drive(p).await;
        let r = &m.recorder;
        assert_eq!(m.scheduled, 20);
        assert_eq!((r.sent, r.retries_sent, r.answered), (60, 40, 60));
        assert_eq!(r.first_counts[State::Overloaded.index()], 20);
        assert_eq!(r.first_counts.iter().sum::<u64>(), 20);
        assert_eq!(r.final_counts[State::SoldOut.index()], 20);
        assert_eq!(r.count(State::Overloaded), 40);
        assert_eq!(r.final_attempts[3], 20, "{:?}", r.final_attempts);
        assert_eq!((r.intents.retried, r.intents.gave_up_retry_max), (20, 0));
        assert_intents_add_up(&m);
        // The same id each time: 20 ids, each sent exactly three times.
        let sends = lock(&sends).clone();
        assert_eq!(sends.len(), 20);
        assert!(sends.values().all(|n| *n == 3), "{sends:?}");
        // Each retry was intended [100, 150) ms after the answer it follows.
        let mut by_intent: HashMap<u64, Vec<&TraceEntry>> = HashMap::new();
        for t in &m.trace {
            by_intent.entry(t.index).or_default().push(t);
        }
        for attempts in by_intent.values() {
            assert_eq!(attempts.len(), 3);
            for pair in attempts.windows(2) {
                let wait_us = pair[1].intended_us - pair[0].answered_us;
                assert!((100_000..150_001).contains(&wait_us), "{pair:?}");
                // (each figure is rounded down to whole µs on its own)
                let from_offsets = pair[1].answered_us - pair[1].intended_us;
                assert!(pair[1].latency_us.abs_diff(from_offsets) <= 1, "{pair:?}");
            }
        }
        // Per attempt the answers are fast; per buyer they took both waits.
        let buyer = LatencySummary::of(&r.time_to_final);
        assert!(buyer.p50 >= 200.0 && buyer.max < 400.0, "{buyer:?}");
        assert!(LatencySummary::of(&r.overall).p50 < 50.0);
        let sold = LatencySummary::of(&r.time_to_final_by_state[State::SoldOut.index()]);
        assert_eq!(sold.count, 20);
    }

    /// A server that never stops shedding: retries stop at --retry-max, or at the budget,
    /// whichever comes first; the last answer is the final one, and why is counted.
    #[tokio::test(flavor = "current_thread")]
    async fn retries_stop_at_the_bound_or_the_budget() {
        fn always_busy(_: &str, _: u32) -> (&'static str, String) {
            let body = r#"{"state":"SYSTEM_BUSY","retry_after_ms":40}"#;
            ("503 Service Unavailable", body.to_owned())
        }
        let (addr, _) = scripted_server(Duration::from_millis(1), always_busy).await;
        let base = DriveParams {
            profile: Profile::Constant { rate_per_s: 100 },
            duration_ms: 100,
            connections: 4,
            trace_max: 0,
            ..params(addr)
        };
        let bounded = DriveParams {
            retry: RetryPolicy::SameId(SameId { retry_max: 2, budget_ms: 10_000, jitter_pct: 0 }),
            ..base.clone()
        };
        let m = drive(bounded).await;
        let r = &m.recorder;
        assert_eq!((m.scheduled, r.answered, r.retries_sent), (10, 30, 20));
        assert_eq!(r.final_counts[State::SystemBusy.index()], 10);
        assert_eq!((r.intents.gave_up_retry_max, r.intents.gave_up_budget), (10, 0));
        assert_eq!(r.final_attempts[3], 10);
        assert_intents_add_up(&m);
        // 40 ms waits, 110 ms budget: retries start at ~41 and ~82 ms; a third would start
        // at ~123 ms, past the budget.
        let budgeted = DriveParams {
            retry: RetryPolicy::SameId(SameId { retry_max: 10, budget_ms: 110, jitter_pct: 0 }),
            ..base.clone()
        };
        let m = drive(budgeted).await;
        let r = &m.recorder;
        assert_eq!((r.intents.gave_up_retry_max, r.intents.gave_up_budget), (0, 10));
        assert_eq!(r.final_attempts[3], 10, "{:?}", r.final_attempts);
        let buyer = LatencySummary::of(&r.time_to_final);
        assert!(buyer.max < 110.0 && buyer.p50 >= 80.0, "{buyer:?}");
        assert_intents_add_up(&m);
        // Retries off: the first answer is the final one.
        let m = drive(DriveParams { retry: RetryPolicy::Off, ..base }).await;
        let r = &m.recorder;
        assert_eq!((r.answered, r.retries_sent, r.intents.retried), (10, 0, 0));
        assert_eq!(r.first_counts, r.final_counts);
        assert_intents_add_up(&m);
    }

    /// Only "not now" answers are retried: a QUEUED or DUPLICATE_USER is final at once.
    #[tokio::test(flavor = "current_thread")]
    async fn final_answers_are_not_retried() {
        fn mixed(id: &str, _: u32) -> (&'static str, String) {
            let seq: u64 = id.rsplit('-').next().and_then(|n| n.parse().ok()).unwrap_or(0);
            match seq % 3 {
                0 => ("202 Accepted", r#"{"state":"QUEUED","reservation_id":"resv_1"}"#.into()),
                1 => ("200 OK", r#"{"state":"DUPLICATE_USER","reservation_id":"resv_1"}"#.into()),
                _ => ("400 Bad Request", r#"{"state":"INVALID"}"#.into()),
            }
        }
        let (addr, _) = scripted_server(Duration::from_millis(1), mixed).await;
        let m = drive(DriveParams { duration_ms: 60, trace_max: 0, ..params(addr) }).await;
        let r = &m.recorder;
        assert_eq!((m.scheduled, r.answered, r.retries_sent), (60, 60, 0));
        assert_eq!(r.first_counts, r.final_counts);
        assert_eq!(r.final_counts[State::Queued.index()], 20);
        let accepted: u64 = r.timeline.iter().map(|s| s.accepted).sum();
        let other: u64 = r.timeline.iter().map(|s| s.other).sum();
        assert_eq!((accepted, other), (20, 40));
        assert_intents_add_up(&m);
    }

    /// Two event loops share the grid: together they release every request on time, and
    /// their measurements merge.
    #[tokio::test(flavor = "current_thread")]
    async fn two_loops_keep_the_grid_together() {
        let addr = slow_server(Duration::from_millis(0)).await;
        let p = DriveParams { connections: 4, threads: 2, ..params(addr) };
        let m = drive(p).await;
        assert_eq!((m.scheduled, m.recorder.answered), (200, 200));
        assert_eq!(m.trace.len(), 200);
        for (i, t) in m.trace.iter().enumerate() {
            assert_eq!((t.index, t.intended_us), (i as u64, i as u64 * 1_000));
        }
        assert_eq!(m.recorder.dispatch_lag.len(), 200);
        assert_eq!(m.recorder.timeline[0].scheduled, 200);
        assert!(m.cpu_ticks.is_some());
        assert_intents_add_up(&m);
    }
}
