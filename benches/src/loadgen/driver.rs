//! The open-loop driver (tokio): a dispatcher that releases requests on the schedule's fixed
//! grid, a bounded send queue, keep-alive connections that take from it, retries, and the
//! progress line.
//!
//! How it stays open-loop: the dispatcher sleeps until request `i`'s intended time
//! (`start + profile.offset_ns(i)`) and pushes it onto the queue whatever the server is
//! doing; it never waits for an answer. A connection takes a request when it has a free
//! pipeline slot. When every connection is busy the request waits in the queue, and since its
//! latency is measured from its INTENDED time, that wait is charged to the server, as it would
//! be for a real buyer (no coordinated omission). The queue is bounded (`queue_max`): a
//! request due while it is full is dropped and counted, never silently skipped.
//!
//! Requests already due when the dispatcher wakes are released together (one queue lock and
//! one wake-up per batch of at most `DISPATCH_BATCH_MAX`), each still at its own intended
//! time. The dispatcher is a thread of its own sleeping with `std::thread::sleep` (nanosleep,
//! ~50-100 µs late on Linux), not a tokio timer: tokio's timer wheel ticks in whole
//! milliseconds, which put a 0.5-1 ms floor under every measured latency (measured: SOLD_OUT
//! p50 1.03 ms of which 0.75 ms was the timer). Its lateness is still charged to the
//! requests, and reported apart as `dispatch_lag`, beside `send_lag` (dispatch lag plus the
//! wait for a free connection), so a generator that cannot keep up is visible, not hidden.
//!
//! A connection is a hand-rolled HTTP/1.1 client (`http.rs`) over one `TcpStream`: it writes
//! up to `pipeline` requests in one write, reads answers in order, and gives up the
//! connection (counting what was in flight as errors) on EOF, a reset, a parse error, a
//! `Connection: close`, or no answer within `timeout_ms`; then it reconnects with a backoff.
//!
//! What it is not: the schedule itself (`schedule.rs`), the checks after the run
//! (`verify.rs`), the report (`report.rs`).
//!
//! Read next: `verify.rs`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use super::config::{Progress, RetryPolicy, RETRY_AFTER_MS_DEFAULT, RETRY_AFTER_MS_MAX};
use super::http::{self, State, SubmitAnswer};
use super::schedule::{Plan, Profile};
use super::stats::{latency_histogram, LatencySummary, Recorder, Seen, TIMELINE_SECONDS_MAX};
use hdrhistogram::Histogram;

/// Reconnect backoff bounds.
const RECONNECT_BACKOFF_MS_MIN: u64 = 10;
const RECONNECT_BACKOFF_MS_MAX: u64 = 1_000;
/// How long the run waits for its connections before the schedule starts.
const WARMUP_MS_MAX: u64 = 3_000;
/// An idle connection re-checks whether the run is over this often (a wake-up can race
/// with the final notification).
const IDLE_RECHECK_MS: u64 = 200;
/// Most requests the dispatcher releases under one lock of the queue and one wake-up. At
/// 100,000 req/s and more, a lock and a cross-thread wake-up per request made the generator
/// the limit (measured on one core: dispatch lag p99 16 ms at 112,500 req/s while the bare
/// server used 0.3 cores). Only requests already due are batched, so none waits for another.
const DISPATCH_BATCH_MAX: usize = 64;
/// Read buffer per connection; responses are ~200 bytes, so this holds a full pipeline.
const READ_BUFFER_BYTES: usize = 16 * 1024;

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
}

#[derive(Debug, Clone, Copy)]
struct Job {
    index: u64,
    request_seq: u64,
    user: u32,
    intended: Instant,
    attempt: u32,
}

struct InFlight {
    job: Job,
    written: Instant,
}

struct Shared {
    params: DriveParams,
    start: Instant,
    started_unix_us: u64,
    queue: Mutex<VecDeque<Job>>,
    work: Notify,
    recorder: Mutex<Recorder>,
    seen: Mutex<Seen>,
    trace: Mutex<Vec<TraceEntry>>,
    dropped: AtomicU64,
    unsent: AtomicU64,
    /// Requests pushed and not yet settled (answered for good, failed, or dropped on retry).
    outstanding: AtomicU64,
    retries_waiting: AtomicUsize,
    scheduling_done: AtomicBool,
    stop: AtomicBool,
    last_written_us: AtomicU64,
    last_answer_us: AtomicU64,
}

/// A poisoned lock only means another task panicked mid-record; the counts are still
/// usable for a report, so take the data rather than propagate the panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    fn elapsed_us(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.start).as_micros() as u64
    }

    /// Queues a request; false (and counted as dropped) when the queue is full.
    fn push(&self, job: Job) -> bool {
        let mut queue = lock(&self.queue);
        if queue.len() >= self.params.queue_max {
            drop(queue);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        queue.push_back(job);
        drop(queue);
        self.work.notify_one();
        true
    }

    /// Queues as many of `jobs` as fit (one lock, one wake-up; the wake-up is passed on by
    /// [`Shared::pop`]); the rest are dropped and counted. Empties `jobs`; returns how many
    /// were dropped.
    fn push_batch(&self, jobs: &mut Vec<Job>) -> u64 {
        let mut queue = lock(&self.queue);
        let taken = jobs.len().min(self.params.queue_max.saturating_sub(queue.len()));
        queue.extend(jobs.drain(..taken));
        drop(queue);
        let dropped = jobs.len() as u64;
        jobs.clear();
        if dropped > 0 {
            self.dropped.fetch_add(dropped, Ordering::Relaxed);
        }
        if taken > 0 {
            self.work.notify_one();
        }
        dropped
    }

    fn pop(&self) -> Option<Job> {
        let mut queue = lock(&self.queue);
        let job = queue.pop_front();
        let more = !queue.is_empty();
        drop(queue);
        if more {
            // Pass the wake-up on: another idle connection may take the next one.
            self.work.notify_one();
        }
        job
    }

    fn settle(&self) {
        // Wake every idle connection only when the run is over. While the schedule runs,
        // `outstanding` touches 0 after almost every answer at low rates, and waking all
        // connections each time cost ~130 µs of CPU per request (measured at 1,000 req/s).
        // The dispatcher wakes everyone itself once it sets `scheduling_done`.
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1
            && self.scheduling_done.load(Ordering::Acquire)
        {
            self.work.notify_waiters();
        }
    }

    fn finished(&self) -> bool {
        self.stop.load(Ordering::Acquire)
            || (self.scheduling_done.load(Ordering::Acquire)
                && self.outstanding.load(Ordering::Acquire) == 0)
    }
}

/// Runs the schedule against the target and returns what was measured. Must be called
/// inside a tokio runtime.
pub async fn drive(params: DriveParams) -> Measured {
    // Connections are opened before the schedule's zero, so connection set-up is not
    // charged to the first requests (a connection that fails here retries in its task).
    let (streams, connect_errors) = open_connections(&params).await;
    let shared = Arc::new(Shared {
        start: Instant::now(),
        started_unix_us: unix_us(),
        queue: Mutex::new(VecDeque::with_capacity(params.queue_max.min(1 << 16))),
        work: Notify::new(),
        recorder: Mutex::new(Recorder::new()),
        seen: Mutex::new(Seen::default()),
        trace: Mutex::new(Vec::with_capacity(params.trace_max.min(1 << 16))),
        dropped: AtomicU64::new(0),
        unsent: AtomicU64::new(0),
        outstanding: AtomicU64::new(0),
        retries_waiting: AtomicUsize::new(0),
        scheduling_done: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        last_written_us: AtomicU64::new(0),
        last_answer_us: AtomicU64::new(0),
        params,
    });
    lock(&shared.recorder).errors.connect += connect_errors;
    let tasks: Vec<_> =
        streams.into_iter().map(|s| tokio::spawn(connection(Arc::clone(&shared), s))).collect();
    let progress = match shared.params.progress {
        Progress::Stderr => Some(tokio::spawn(progress_loop(Arc::clone(&shared)))),
        Progress::Off => None,
    };
    let dispatcher = Arc::clone(&shared);
    let (scheduled, per_second, dispatch_lag) =
        match tokio::task::spawn_blocking(move || dispatch(&dispatcher)).await {
            Ok(done) => done,
            // The dispatcher panicked: a bug; surface it as such.
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
    {
        let mut recorder = lock(&shared.recorder);
        recorder.dispatch_lag = dispatch_lag;
        for (second, count) in per_second.into_iter().enumerate() {
            recorder.on_scheduled(second, count);
        }
    }
    // Wait for everything in flight, bounded by the time a request and its retries can take.
    let retry_horizon_ms = match shared.params.retry {
        RetryPolicy::Off => 0,
        RetryPolicy::SameId { retry_max } => {
            u64::from(retry_max) * (RETRY_AFTER_MS_MAX + shared.params.timeout_ms)
        }
    };
    let give_up = Instant::now()
        + Duration::from_millis(2 * shared.params.timeout_ms + retry_horizon_ms + 1_000);
    while !shared.finished() && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    shared.stop.store(true, Ordering::Release);
    shared.work.notify_waiters();
    for task in tasks {
        let _ = task.await;
    }
    if let Some(progress) = progress {
        progress.abort();
    }
    let unsent = {
        let mut queue = lock(&shared.queue);
        let n = queue.len() as u64;
        queue.clear();
        n
    };
    shared.unsent.fetch_add(unsent, Ordering::Relaxed);
    let mut trace = std::mem::take(&mut *lock(&shared.trace));
    trace.sort_by_key(|t| (t.index, t.attempt));
    let recorder = std::mem::take(&mut *lock(&shared.recorder));
    let seen = std::mem::take(&mut *lock(&shared.seen));
    Measured {
        recorder,
        seen,
        scheduled,
        dropped: shared.dropped.load(Ordering::Relaxed),
        unsent: shared.unsent.load(Ordering::Relaxed),
        sending_s: shared.last_written_us.load(Ordering::Relaxed) as f64 / 1e6,
        answering_s: shared.last_answer_us.load(Ordering::Relaxed) as f64 / 1e6,
        started_unix_us: shared.started_unix_us,
        last_answer_us: shared.last_answer_us.load(Ordering::Relaxed),
        trace,
    }
}

fn unix_us() -> u64 {
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since_epoch.map_or(0, |d| d.as_micros() as u64)
}

/// Opens every connection at once (bounded by the warm-up time); returns the streams (None
/// for those that failed) and the number of failures.
async fn open_connections(params: &DriveParams) -> (Vec<Option<TcpStream>>, u64) {
    let warmup = Duration::from_millis(WARMUP_MS_MAX.min(params.timeout_ms));
    let attempts = (0..params.connections).map(|_| async {
        match tokio::time::timeout(warmup, TcpStream::connect(params.target)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                Some(stream)
            }
            Ok(Err(_)) | Err(_) => None,
        }
    });
    let streams = futures::future::join_all(attempts).await;
    let failed = streams.iter().filter(|s| s.is_none()).count() as u64;
    (streams, failed)
}

/// Releases every request of the schedule at its intended time (blocking: runs on a thread
/// of its own); returns how many, how many per second, and how late each was released.
fn dispatch(shared: &Arc<Shared>) -> (u64, Vec<u64>, Histogram<u64>) {
    let p = &shared.params;
    let start = shared.start;
    let total = p.profile.count_within(p.duration_ms * 1_000_000);
    let mut plan = Plan::new(p.seed, p.users, p.duplicate_ratio);
    let mut lag = latency_histogram();
    let mut per_second: Vec<u64> = Vec::new();
    let mut batch: Vec<Job> = Vec::with_capacity(DISPATCH_BATCH_MAX);
    for i in 0..total {
        let offset_ns = p.profile.offset_ns(i);
        let second = ((offset_ns / 1_000_000_000) as usize).min(TIMELINE_SECONDS_MAX - 1);
        if per_second.len() <= second {
            per_second.resize(second + 1, 0);
        }
        per_second[second] += 1;
        let intended = start + Duration::from_nanos(offset_ns);
        let now = Instant::now();
        if now < intended {
            // Everything due is released before sleeping: a batch never waits for the next.
            release(shared, &mut batch, &mut lag);
            std::thread::sleep(intended - now);
        }
        let intent = plan.next_intent();
        batch.push(Job {
            index: intent.index,
            request_seq: intent.request_seq,
            user: intent.user,
            intended,
            attempt: 0,
        });
        if batch.len() >= DISPATCH_BATCH_MAX {
            release(shared, &mut batch, &mut lag);
        }
    }
    release(shared, &mut batch, &mut lag);
    shared.scheduling_done.store(true, Ordering::Release);
    shared.work.notify_waiters();
    (total, per_second, lag)
}

/// Queues the due requests of `batch` under one lock with one wake-up, and records how late
/// each was released.
fn release(shared: &Shared, batch: &mut Vec<Job>, lag: &mut Histogram<u64>) {
    if batch.is_empty() {
        return;
    }
    let now = Instant::now();
    for job in batch.iter() {
        lag.saturating_record(now.saturating_duration_since(job.intended).as_micros() as u64);
    }
    // Counted before they can be answered, so that `settle` never runs ahead of it.
    shared.outstanding.fetch_add(batch.len() as u64, Ordering::AcqRel);
    for _ in 0..shared.push_batch(batch) {
        shared.settle();
    }
}

async fn connection(shared: Arc<Shared>, first: Option<TcpStream>) {
    let mut backoff_ms = RECONNECT_BACKOFF_MS_MIN;
    if let Some(stream) = first {
        serve_stream(&shared, stream).await;
    }
    while !shared.finished() {
        let connect = TcpStream::connect(shared.params.target);
        let timeout = Duration::from_millis(shared.params.timeout_ms);
        match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                backoff_ms = RECONNECT_BACKOFF_MS_MIN;
                serve_stream(&shared, stream).await;
            }
            Ok(Err(_)) | Err(_) => {
                lock(&shared.recorder).errors.connect += 1;
                tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
                backoff_ms = (backoff_ms * 2).min(RECONNECT_BACKOFF_MS_MAX);
            }
        }
    }
}

/// Why a connection was given up; what was in flight is counted accordingly.
#[derive(Clone, Copy)]
enum Failure {
    Io,
    Timeout,
}

async fn serve_stream(shared: &Arc<Shared>, stream: TcpStream) {
    let pipeline = shared.params.pipeline;
    let timeout = Duration::from_millis(shared.params.timeout_ms);
    let (mut reader, mut writer) = stream.into_split();
    let mut in_flight: VecDeque<InFlight> = VecDeque::with_capacity(pipeline);
    let mut write_buf: Vec<u8> = Vec::with_capacity(pipeline * 512);
    let mut read_buf: Vec<u8> = Vec::with_capacity(READ_BUFFER_BYTES);
    // Requests taken for the next write; reused so the hot loop does not allocate.
    let mut taken: Vec<Job> = Vec::with_capacity(pipeline);
    loop {
        while in_flight.len() + taken.len() < pipeline {
            let Some(job) = shared.pop() else { break };
            let p = &shared.params;
            let pass = p.passes.get(job.user as usize).map_or("", String::as_str);
            let id = (p.run_id.as_str(), job.request_seq);
            http::encode_submit(&mut write_buf, &p.host, pass, p.activity_id, p.sku_id, id);
            taken.push(job);
        }
        if !taken.is_empty() {
            let result = writer.write_all(&write_buf).await;
            write_buf.clear();
            let written = Instant::now();
            let elapsed = shared.elapsed_us(written);
            if result.is_ok() {
                shared.last_written_us.fetch_max(elapsed, Ordering::Relaxed);
                let mut recorder = lock(&shared.recorder);
                for job in &taken {
                    let lag = written.saturating_duration_since(job.intended).as_micros() as u64;
                    recorder.on_sent(elapsed, lag, job.attempt > 0);
                }
            }
            in_flight.extend(taken.drain(..).map(|job| InFlight { job, written }));
            if result.is_err() {
                fail_all(shared, &mut in_flight, Failure::Io);
                return;
            }
        }
        if in_flight.is_empty() {
            if shared.finished() {
                return;
            }
            tokio::select! {
                _ = shared.work.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(IDLE_RECHECK_MS)) => {}
            }
            continue;
        }
        let deadline = in_flight.front().map_or_else(Instant::now, |f| f.written) + timeout;
        let can_take_more = in_flight.len() < pipeline;
        tokio::select! {
            biased;
            read = reader.read_buf(&mut read_buf) => match read {
                Ok(0) | Err(_) => {
                    fail_all(shared, &mut in_flight, Failure::Io);
                    return;
                }
                Ok(_) => match take_responses(shared, &mut read_buf, &mut in_flight) {
                    Ok(Stream::Open) => {}
                    Ok(Stream::Closed) => {
                        fail_all(shared, &mut in_flight, Failure::Io);
                        return;
                    }
                    Err(()) => {
                        lock(&shared.recorder).errors.protocol += 1;
                        fail_all(shared, &mut in_flight, Failure::Io);
                        return;
                    }
                },
            },
            _ = tokio::time::sleep_until(deadline.into()) => {
                fail_all(shared, &mut in_flight, Failure::Timeout);
                return;
            }
            _ = shared.work.notified(), if can_take_more => {}
        }
    }
}

enum Stream {
    Open,
    Closed,
}

/// Handles every complete response at the front of `buf`, in pipeline order.
fn take_responses(
    shared: &Arc<Shared>,
    buf: &mut Vec<u8>,
    in_flight: &mut VecDeque<InFlight>,
) -> Result<Stream, ()> {
    let mut used = 0;
    let mut closed = false;
    while !closed {
        let response = match http::parse_response(&buf[used..]) {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(_) => return Err(()),
        };
        // An answer nobody asked for: the stream is out of step.
        let Some(f) = in_flight.pop_front() else { return Err(()) };
        let answer = SubmitAnswer::parse(response.body);
        on_answer(shared, f, response.status, answer);
        used += response.len;
        closed = response.close;
    }
    buf.drain(..used);
    Ok(if closed { Stream::Closed } else { Stream::Open })
}

fn on_answer(shared: &Arc<Shared>, f: InFlight, status: u16, answer: SubmitAnswer) {
    let now = Instant::now();
    let job = f.job;
    let latency_us = now.saturating_duration_since(job.intended).as_micros() as u64;
    let elapsed = shared.elapsed_us(now);
    shared.last_answer_us.fetch_max(elapsed, Ordering::Relaxed);
    lock(&shared.recorder).on_answer(elapsed, latency_us, status, answer.state, answer.replayed);
    if let Some(reservation_id) = answer.reservation_id.as_deref() {
        lock(&shared.seen).on_answer(
            job.user,
            job.request_seq,
            answer.state,
            answer.replayed,
            Some(reservation_id),
        );
    }
    if shared.params.trace_max > 0 {
        let mut trace = lock(&shared.trace);
        if trace.len() < shared.params.trace_max {
            trace.push(TraceEntry {
                index: job.index,
                attempt: job.attempt,
                intended_us: shared.elapsed_us(job.intended),
                written_us: shared.elapsed_us(f.written),
                answered_us: elapsed,
                latency_us,
                state: answer.state.as_str().to_owned(),
            });
        }
    }
    match shared.params.retry {
        RetryPolicy::SameId { retry_max }
            if answer.state.is_retryable() && job.attempt < retry_max =>
        {
            retry_later(shared, job, answer.retry_after_ms, now);
        }
        _ => shared.settle(),
    }
}

/// Re-sends `job` with the same request id after the server's hint (capped), as a new
/// request whose intended time is the retry time.
fn retry_later(shared: &Arc<Shared>, job: Job, retry_after_ms: Option<u64>, now: Instant) {
    if shared.retries_waiting.load(Ordering::Relaxed) >= shared.params.queue_max {
        shared.dropped.fetch_add(1, Ordering::Relaxed);
        shared.settle();
        return;
    }
    shared.retries_waiting.fetch_add(1, Ordering::Relaxed);
    let delay_ms = retry_after_ms.unwrap_or(RETRY_AFTER_MS_DEFAULT).min(RETRY_AFTER_MS_MAX);
    let at = now + Duration::from_millis(delay_ms);
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        tokio::time::sleep_until(at.into()).await;
        shared.retries_waiting.fetch_sub(1, Ordering::Relaxed);
        let retry = Job { intended: at, attempt: job.attempt + 1, ..job };
        if shared.stop.load(Ordering::Acquire) || !shared.push(retry) {
            shared.settle();
        }
    });
}

fn fail_all(shared: &Arc<Shared>, in_flight: &mut VecDeque<InFlight>, why: Failure) {
    let n = in_flight.len() as u64;
    if n == 0 {
        return;
    }
    {
        let mut recorder = lock(&shared.recorder);
        match why {
            Failure::Io => recorder.errors.io += n,
            Failure::Timeout => recorder.errors.timeout += n,
        }
    }
    for _ in in_flight.drain(..) {
        shared.settle();
    }
}

/// One line a second on stderr: what was sent, the rate, p99 so far, the main states.
async fn progress_loop(shared: Arc<Shared>) {
    let start = shared.start;
    let mut tick =
        tokio::time::interval_at((start + Duration::from_secs(1)).into(), Duration::from_secs(1));
    let mut last_sent = 0u64;
    loop {
        tick.tick().await;
        let line = {
            let r = lock(&shared.recorder);
            let p99 = LatencySummary::of(&r.overall).p99;
            let queued = r.count(State::Queued) + r.count(State::QueuedPending);
            let sold_out = r.count(State::SoldOut);
            let other = r.answered - queued - sold_out;
            let errors = r.errors.connect + r.errors.io + r.errors.timeout + r.errors.protocol;
            let rate = r.sent - last_sent;
            last_sent = r.sent;
            format!(
                "[{:>4}s] sent {} ({rate}/s)  answered {}  p99 {p99:.2} ms  QUEUED {queued}  \
                 SOLD_OUT {sold_out}  other {other}  queue {}  dropped {}  errors {errors}",
                start.elapsed().as_secs(),
                r.sent,
                r.answered,
                lock(&shared.queue).len(),
                shared.dropped.load(Ordering::Relaxed),
            )
        };
        eprintln!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A deliberately slow server: one connection, answers strictly one at a time, each
    /// after `delay` (a stand-in for a busy engine).
    async fn slow_server(delay: Duration) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else { return };
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        // Requests end with the JSON body's closing brace.
                        while let Some(end) = buf.iter().position(|&b| b == b'}') {
                            buf.drain(..=end);
                            tokio::time::sleep(delay).await;
                            let body = r#"{"state":"SOLD_OUT"}"#;
                            let head = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
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
        addr
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
            assert!(t.latency_us >= t.written_us - t.intended_us + 4_000, "{t:?}");
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
}
