//! One thread of the open-loop driver: its share of the schedule, its connections, its
//! retries and its measurements, in one single-threaded epoll loop — the shape of wrk's
//! event loop, plus the schedule.
//!
//! Why not tokio (as before 2026-12): the instrument must cost no more than wrk (issue 25
//! item 5). The tokio driver's profile was a dispatcher thread waking every ~50 µs
//! (nanosleep, 15% of the samples), a cross-thread wake-up (eventfd) per batch, a mutex per
//! queue operation and per answer, and a timer and `Notify` future per connection per turn.
//! Here one thread does everything: it sleeps in ONE `epoll_pwait2` until the next request
//! is due or a socket has something, and that wait's nanosecond timeout is the schedule's
//! clock (tokio's timer ticks in whole milliseconds, which put a 0.5-1 ms floor under every
//! latency). No lock is taken per request, nothing is allocated per request (the request is
//! copied from a [`SubmitTemplate`], the answer scanned in place), and a histogram record is
//! a few adds; per request it makes one `send`, one `recv` and a share of one wait (wrk: a
//! `write`, a `read`, an `epoll_ctl` and a share of a wait).
//!
//! Measured (`benches/client-cost.sh`, results in `benches/results/client-cost-2026-12-02.json`,
//! medians of 3 alternated rounds, µs of CPU per request, 64 connections, no pipelining):
//! paced at 0.9× wrk's rate, tokio driver 20.7 vs wrk 13.1, this loop 14.6 vs wrk 12.9;
//! offered 1.3× wrk's rate (the server saturated by both, like for like), tokio 20.1 vs
//! 13.2, this loop 12.2 vs 12.5. What is left when paced is the kernel's, not ours: user
//! space is under a tenth of the samples; the rest is `send` (which wakes an idle server and
//! is charged to the sender) and the loop's own sleep and wake-up between requests, which
//! cost several µs each on this VM (a bare `nanosleep` loop: ~12 µs of CPU per sleep) and
//! which a closed-loop client that keeps the server saturated never pays. Waking on a
//! coarser release grid (100-250 µs) cut the context switches by up to half but not the CPU
//! measurably, so requests are released at their own due times.
//!
//! Re-measured 2026-12-03 (`benches/results/client-cost-2026-12-03.json`, 5 alternated
//! rounds, a busier box): wrk 9.25, this loop 12.47 paced (1.35×) and 9.66 saturating
//! (1.09×). `perf` at the paced rate: the kernel is ~88% of the loop's CPU — `send` waking
//! the server (`sock_def_readable`, ~22%; at 10,000 req/s, when the server's vCPU halts
//! between requests, ~30% and 52 µs a request in all) and the loop's own sleep and wake-up
//! (`finish_task_switch`, ~14%). A release grid of 50 µs-1 ms (with the timer slack set to
//! 1 ns so that the grid is the only lateness) and a 20 µs spin before sleeping were tried
//! again: within the noise, and a precise timer alone costs more (more wake-ups). User space
//! was cut from 5,798 to 4,291 instructions a request (callgrind; `http.rs`'s word-at-a-time
//! searches, the status counter, the next due time computed once), ~2% of the total.
//!
//! How it stays open-loop (unchanged): request `i` is released at `start + offset_ns(i)`
//! whatever the server does, into a bounded queue; a connection with a free pipeline slot
//! takes it. Its latency is measured from its INTENDED time, so a wait for a free connection
//! is charged to the server (no coordinated omission), and the loop's own lateness is
//! reported apart (`dispatch_lag`), beside `send_lag`. Answers are timestamped when the wait
//! returns, before anything else is done, so the loop's own work is not added to them.
//!
//! Retries (`retry.rs` decides): a "not now" answer puts the intent into a bounded timer heap
//! with the SAME request id; when due it joins the send queue as a new attempt whose
//! latency counts from its own intended (retry) time, while the intent's time to its final
//! answer counts from its first intended send.
//!
//! Connections: non-blocking sockets, level-triggered `EPOLLIN` (plus `EPOLLOUT` only while
//! a write is pending or a connect is in progress). A broken connection, a parse error, a
//! `Connection: close` or a request unanswered for `timeout_ms` gives the connection up
//! (what was in flight counts as errors) and it reconnects with a backoff. Timeouts,
//! reconnects and the progress gauges are checked every [`HOUSEKEEPING_MS`].
//!
//! Needs Linux 5.11+ (`epoll_pwait2`, through rustix's `linux_5_11`).
//!
//! What it is not: the threads' orchestration, merging and progress line (`driver.rs`), the
//! retry rule (`retry.rs`), the bytes (`http.rs`).
//!
//! Read next: `driver.rs`.

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BinaryHeap, VecDeque};
use std::io::{ErrorKind, Read as _, Write as _};
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use rustix::event::{epoll, Timespec};

use super::driver::{DriveParams, TraceEntry};
use super::http::{self, State, SubmitAnswer, SubmitTemplate};
use super::retry::{self, Answered, Decision, Why};
use super::schedule::Plan;
use super::stats::{
    latency_histogram, AnswerRecord, Ending, LatencySummary, Recorder, Seen, TIMELINE_SECONDS_MAX,
};

/// Reconnect backoff bounds.
const RECONNECT_BACKOFF_MS_MIN: u64 = 10;
const RECONNECT_BACKOFF_MS_MAX: u64 = 1_000;
/// How long the run waits for its connections before the schedule starts.
const WARMUP_MS_MAX: u64 = 3_000;
/// Timeouts, reconnects and gauges are looked at this often (a scan of this loop's
/// connections: negligible at this period, and far below the request timeout's resolution
/// anyone needs).
pub const HOUSEKEEPING_MS: u64 = 10;
/// The progress gauges' p99 is recomputed this often (a histogram walk).
const GAUGE_P99_EVERY_MS: u64 = 1_000;
/// Read buffer per connection; responses are ~200 bytes, so this holds a full pipeline.
const READ_BUFFER_BYTES: usize = 16 * 1024;
/// Largest read buffer: one response head and body at their limits.
const READ_BUFFER_BYTES_MAX: usize = http::HEAD_BYTES_MAX + http::BODY_BYTES_MAX + 4;
/// Events taken from one wait.
const EVENTS_MAX: usize = 256;
/// A connection's epoll token is its index; this one is never a connection.
const NO_CONNECTION: usize = usize::MAX;

/// The schedule's zero, shared by every loop: set by the first loop through the barrier.
pub(super) struct Clock {
    pub barrier: Barrier,
    pub start: OnceLock<(Instant, u64)>,
}

/// What one loop publishes for the progress line (stored, not added: one writer each).
#[derive(Default)]
pub(super) struct Gauges {
    pub sent: AtomicU64,
    pub answered: AtomicU64,
    pub accepted: AtomicU64,
    pub sold_out: AtomicU64,
    pub shed: AtomicU64,
    pub queued: AtomicU64,
    pub dropped: AtomicU64,
    pub errors: AtomicU64,
    pub p99_us: AtomicU64,
}

/// What one loop is given.
pub(super) struct LoopSetup {
    pub params: Arc<DriveParams>,
    pub template: Arc<SubmitTemplate>,
    /// This loop takes schedule indices `index, index + loops, ...`.
    pub index: usize,
    pub loops: usize,
    pub connections: usize,
    /// This loop's share of the send queue bound (and of the retry heap's).
    pub queue_max: usize,
    pub clock: Arc<Clock>,
    /// One per loop (this one publishes into `gauges[index]`).
    pub gauges: Arc<Vec<Gauges>>,
    pub seen: Arc<Mutex<Seen>>,
    pub trace: Arc<Mutex<Vec<TraceEntry>>>,
}

/// What one loop measured.
pub(super) struct LoopResult {
    pub recorder: Recorder,
    pub scheduled: u64,
    pub per_second: Vec<u64>,
    pub dropped: u64,
    pub unsent: u64,
    pub last_written_us: u64,
    pub last_answer_us: u64,
}

/// A poisoned lock only means another thread panicked mid-record; the data is still
/// usable for a report.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One attempt of one intent.
#[derive(Debug, Clone, Copy)]
struct Job {
    index: u64,
    request_seq: u64,
    user: u32,
    /// This attempt's intended send time (latency counts from here).
    intended: Instant,
    /// The intent's first intended send (time to final answer counts from here).
    first_intended: Instant,
    attempt: u32,
    /// The previous attempt's answer (a retry's fallback final answer).
    last_state: State,
}

struct InFlight {
    job: Job,
    written: Instant,
}

/// A retry waiting for its time.
struct Due {
    at: Instant,
    /// Ties broken by order of scheduling (a heap is not stable).
    seq: u64,
    job: Job,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    /// Reversed: `BinaryHeap` is a max-heap, the earliest retry must come out first.
    fn cmp(&self, other: &Self) -> CmpOrdering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

enum ConnState {
    /// No socket; a connect is tried at `retry_at`.
    Down {
        retry_at: Instant,
    },
    Connecting {
        since: Instant,
    },
    Open,
}

/// Why a connection was given up; what was in flight is counted accordingly.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Failure {
    Io,
    Timeout,
    Protocol,
}

struct Conn {
    stream: Option<TcpStream>,
    state: ConnState,
    backoff_ms: u64,
    /// Written, waiting for their answers, in pipeline order.
    in_flight: VecDeque<InFlight>,
    /// Encoded into `out`, not yet fully written.
    pending: Vec<Job>,
    out: Vec<u8>,
    out_at: usize,
    /// `EPOLLOUT` is registered (a write or a connect is waiting).
    wants_out: bool,
    inbuf: Vec<u8>,
    in_len: usize,
    /// In the loop's `ready` list.
    ready: bool,
    /// In the loop's `dirty` list.
    dirty: bool,
}

impl Conn {
    fn new(pipeline: usize, now: Instant) -> Conn {
        Conn {
            stream: None,
            state: ConnState::Down { retry_at: now },
            backoff_ms: RECONNECT_BACKOFF_MS_MIN,
            in_flight: VecDeque::with_capacity(pipeline),
            pending: Vec::with_capacity(pipeline),
            out: Vec::with_capacity(pipeline * 512),
            out_at: 0,
            wants_out: false,
            inbuf: vec![0; READ_BUFFER_BYTES],
            in_len: 0,
            ready: false,
            dirty: false,
        }
    }

    fn busy(&self) -> usize {
        self.in_flight.len() + self.pending.len()
    }
}

/// Everything but the connections (so that an answer borrowed from a connection's buffer
/// can be booked while the connection is borrowed).
struct Books {
    setup: LoopSetup,
    start: Instant,
    recorder: Recorder,
    dispatch_lag: Histogram<u64>,
    queue: VecDeque<Job>,
    retries: BinaryHeap<Due>,
    retry_seq: u64,
    rng: StdRng,
    /// Intents released and not yet ended.
    outstanding: u64,
    dropped: u64,
    unsent: u64,
    last_written_us: u64,
    last_answer_us: u64,
}

/// The loop.
pub(super) struct EventLoop {
    books: Books,
    conns: Vec<Conn>,
    epoll: OwnedFd,
    events: Vec<epoll::Event>,
    /// Open connections with a free pipeline slot, least recently given work first.
    ready: VecDeque<usize>,
    /// Connections with bytes to write after this turn's assignments.
    dirty: Vec<usize>,
    /// The plan is drawn in order by every loop (same seed, same sequence); each keeps its
    /// own indices, so duplicates re-send the same users' ids whichever loop sends them.
    plan: Plan,
    /// This loop's next schedule index, and how many the schedule has in all.
    next_index: u64,
    /// When `next_index` is due (offset from the start, and the instant), computed once per
    /// request rather than at every look (`set_next_due`).
    next_offset_ns: u64,
    next_due: Instant,
    total: u64,
    scheduled: u64,
    per_second: Vec<u64>,
    give_up_at: Option<Instant>,
    next_housekeeping: Instant,
    next_gauge_p99: Instant,
}

impl Books {
    fn params(&self) -> &DriveParams {
        &self.setup.params
    }

    fn elapsed_us(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.start).as_micros() as u64
    }

    /// Queues an attempt; false (counted as dropped) when the queue is full.
    fn enqueue(&mut self, job: Job) -> bool {
        if self.queue.len() >= self.setup.queue_max {
            self.dropped += 1;
            return false;
        }
        self.queue.push_back(job);
        true
    }

    /// An answer to `f`, read at `now`.
    fn on_answer(
        &mut self,
        f: &InFlight,
        status: u16,
        answer: &SubmitAnswer<'_>,
        hint_s: Option<u64>,
        now: Instant,
    ) {
        let job = f.job;
        let latency_us = now.saturating_duration_since(job.intended).as_micros() as u64;
        let elapsed_us = self.elapsed_us(now);
        self.last_answer_us = self.last_answer_us.max(elapsed_us);
        self.recorder.on_answer(&AnswerRecord {
            elapsed_us,
            latency_us,
            http_status: status,
            state: answer.state,
            replayed: answer.replayed,
            attempt: job.attempt,
        });
        if let Some(reservation_id) = answer.reservation_id.as_deref() {
            lock(&self.setup.seen).on_answer(
                job.user,
                job.request_seq,
                answer.state,
                answer.replayed,
                Some(reservation_id),
            );
        }
        if self.params().trace_max > 0 {
            self.trace(f, now, latency_us, answer.state);
        }
        let since_first_us = now.saturating_duration_since(job.first_intended).as_micros() as u64;
        let answered = Answered {
            state: answer.state,
            attempt: job.attempt,
            retry_after_ms: answer.retry_after_ms,
            retry_after_s: hint_s,
            since_first_us,
        };
        let draw = self.rng.next_u64();
        match retry::decide(&self.params().retry, &answered, draw) {
            Decision::RetryIn { delay_us } => {
                if self.retries.len() >= self.setup.queue_max {
                    self.dropped += 1;
                    self.end(job, answer.state, since_first_us, Ending::QueueFull);
                    return;
                }
                let at = now + Duration::from_micros(delay_us);
                let next =
                    Job { intended: at, attempt: job.attempt + 1, last_state: answer.state, ..job };
                self.retry_seq += 1;
                self.retries.push(Due { at, seq: self.retry_seq, job: next });
            }
            Decision::Final(why) => {
                let ending = match why {
                    Why::Settled => Ending::Settled,
                    Why::RetryMax => Ending::RetryMax,
                    Why::Budget => Ending::Budget,
                };
                self.end(job, answer.state, since_first_us, ending);
            }
        }
    }

    /// The intent of `job` ends with `state` as its final answer.
    fn end(&mut self, job: Job, state: State, since_first_us: u64, ending: Ending) {
        self.recorder.on_final(state, since_first_us, job.attempt + 1, ending);
        self.outstanding -= 1;
    }

    fn trace(&mut self, f: &InFlight, now: Instant, latency_us: u64, state: State) {
        let entry = TraceEntry {
            index: f.job.index,
            attempt: f.job.attempt,
            intended_us: self.elapsed_us(f.job.intended),
            written_us: self.elapsed_us(f.written),
            answered_us: self.elapsed_us(now),
            latency_us,
            state: state.as_str().to_owned(),
        };
        let mut trace = lock(&self.setup.trace);
        if trace.len() < self.params().trace_max {
            trace.push(entry);
        }
    }

    /// Attempts lost with a connection: counted as `why`, their intents end unanswered.
    fn lost(&mut self, jobs: impl Iterator<Item = Job>, why: Failure) {
        for job in jobs {
            match why {
                Failure::Io | Failure::Protocol => self.recorder.errors.io += 1,
                Failure::Timeout => self.recorder.errors.timeout += 1,
            }
            self.recorder.on_failed(job.attempt);
            self.outstanding -= 1;
        }
    }
}

impl EventLoop {
    pub(super) fn new(setup: LoopSetup) -> std::io::Result<EventLoop> {
        let p = Arc::clone(&setup.params);
        let now = Instant::now();
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let conns = (0..setup.connections).map(|_| Conn::new(p.pipeline, now)).collect();
        let total = p.profile.count_within(p.duration_ms * 1_000_000);
        let seed = p.seed ^ (setup.index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let books = Books {
            start: now,
            recorder: Recorder::new(),
            dispatch_lag: latency_histogram(),
            queue: VecDeque::with_capacity(setup.queue_max.min(1 << 16)),
            retries: BinaryHeap::new(),
            retry_seq: 0,
            rng: StdRng::seed_from_u64(seed),
            outstanding: 0,
            dropped: 0,
            unsent: 0,
            last_written_us: 0,
            last_answer_us: 0,
            setup,
        };
        Ok(EventLoop {
            next_index: books.setup.index as u64,
            next_offset_ns: 0,
            next_due: now,
            books,
            conns,
            epoll,
            events: Vec::with_capacity(EVENTS_MAX),
            ready: VecDeque::new(),
            dirty: Vec::new(),
            plan: Plan::new(p.seed, p.users, p.duplicate_ratio),
            total,
            scheduled: 0,
            per_second: Vec::new(),
            give_up_at: None,
            next_housekeeping: now,
            next_gauge_p99: now,
        })
    }

    /// Connects, waits for every loop, runs the schedule and the drain; returns what it saw.
    pub(super) fn run(mut self) -> LoopResult {
        self.warm_up();
        let clock = Arc::clone(&self.books.setup.clock);
        clock.barrier.wait();
        let (start, _) = *clock.start.get_or_init(|| (Instant::now(), super::driver::unix_us()));
        self.books.start = start;
        self.set_next_due();
        self.next_housekeeping = start;
        self.next_gauge_p99 = start + Duration::from_millis(GAUGE_P99_EVERY_MS);
        loop {
            let now = Instant::now();
            self.release_due(now);
            self.release_retries(now);
            self.assign();
            if now >= self.next_housekeeping {
                self.housekeeping(now);
            }
            if self.finished() {
                break;
            }
            if self.give_up_at.is_some_and(|at| now >= at) {
                self.give_up(now);
                break;
            }
            self.wait(now);
        }
        self.publish_gauges(true);
        self.into_result()
    }

    fn finished(&self) -> bool {
        self.next_index >= self.total && self.books.outstanding == 0
    }

    /// Opens every connection and waits (at most the warm-up) until each is open or failed,
    /// so that connection set-up is not charged to the first requests.
    fn warm_up(&mut self) {
        let now = Instant::now();
        for c in 0..self.conns.len() {
            self.connect(c, now);
        }
        let timeout_ms = self.books.params().timeout_ms;
        let deadline = now + Duration::from_millis(WARMUP_MS_MAX.min(timeout_ms));
        loop {
            let now = Instant::now();
            let connecting =
                self.conns.iter().any(|c| matches!(c.state, ConnState::Connecting { .. }));
            if !connecting || now >= deadline {
                break;
            }
            self.poll(deadline.saturating_duration_since(now));
        }
        // Failed ones retry at once (their backoff grows per failure).
        let now = Instant::now();
        for conn in &mut self.conns {
            if let ConnState::Down { retry_at } = &mut conn.state {
                *retry_at = now;
            }
        }
    }

    /// Sleeps until the next thing is due (a request, a retry, housekeeping, the give-up)
    /// or a socket is ready, then handles what is ready.
    fn wait(&mut self, now: Instant) {
        let mut wake = self.next_housekeeping;
        if self.next_index < self.total {
            wake = wake.min(self.next_due);
        }
        if let Some(due) = self.books.retries.peek() {
            wake = wake.min(due.at);
        }
        if let Some(at) = self.give_up_at {
            wake = wake.min(at);
        }
        self.poll(wake.saturating_duration_since(now));
    }

    /// One `epoll_pwait2` with a nanosecond timeout, then every event it returned.
    fn poll(&mut self, timeout: Duration) {
        let timeout =
            Timespec { tv_sec: timeout.as_secs() as _, tv_nsec: timeout.subsec_nanos() as _ };
        self.events.clear();
        match epoll::wait(
            &self.epoll,
            rustix::buffer::spare_capacity(&mut self.events),
            Some(&timeout),
        ) {
            Ok(_) => {}
            // EINTR and friends: the loop comes round again.
            Err(_) => return,
        }
        // One timestamp for every answer of this wake-up, taken before any of them is
        // handled: the loop's own work is not charged to the server.
        let now = Instant::now();
        for i in 0..self.events.len() {
            let event = self.events[i];
            let c = event.data.u64() as usize;
            if c != NO_CONNECTION && c < self.conns.len() {
                self.on_event(c, event.flags, now);
            }
        }
    }

    fn on_event(&mut self, c: usize, flags: epoll::EventFlags, now: Instant) {
        let failed = flags.intersects(epoll::EventFlags::ERR | epoll::EventFlags::HUP);
        match self.conns[c].state {
            ConnState::Connecting { .. } => self.on_connect_ready(c, failed, now),
            ConnState::Open => {
                if flags.contains(epoll::EventFlags::OUT)
                    && self.conns[c].out_at < self.conns[c].out.len()
                {
                    self.flush(c);
                }
                if flags.contains(epoll::EventFlags::IN) || failed {
                    self.on_readable(c, now);
                }
            }
            ConnState::Down { .. } => {}
        }
    }

    /// Releases every request of this loop's schedule due by `now` into the send queue.
    fn release_due(&mut self, now: Instant) {
        let loops = self.books.setup.loops as u64;
        while self.next_index < self.total {
            let (i, offset_ns, intended) = (self.next_index, self.next_offset_ns, self.next_due);
            if intended > now {
                return;
            }
            let intent = loop {
                let intent = self.plan.next_intent();
                if intent.index == i {
                    break intent;
                }
            };
            self.next_index += loops;
            self.set_next_due();
            self.scheduled += 1;
            let second = ((offset_ns / 1_000_000_000) as usize).min(TIMELINE_SECONDS_MAX - 1);
            if self.per_second.len() <= second {
                self.per_second.resize(second + 1, 0);
            }
            self.per_second[second] += 1;
            let lag_us = now.saturating_duration_since(intended).as_micros() as u64;
            self.books.dispatch_lag.saturating_record(lag_us);
            self.books.outstanding += 1;
            let job = Job {
                index: intent.index,
                request_seq: intent.request_seq,
                user: intent.user,
                intended,
                first_intended: intended,
                attempt: 0,
                last_state: State::Other,
            };
            if !self.books.enqueue(job) {
                self.books.recorder.intents.dropped += 1;
                self.books.outstanding -= 1;
            }
        }
        if self.give_up_at.is_none() {
            // Everything is released: wait for what is in flight, bounded by the time a
            // request and its retries can take.
            let p = self.books.params();
            let horizon_ms = 2 * p.timeout_ms + p.retry.horizon_ms() + 1_000;
            self.give_up_at = Some(now + Duration::from_millis(horizon_ms));
        }
    }

    /// Computes when `next_index` is due (nothing to compute once the schedule is done).
    fn set_next_due(&mut self) {
        if self.next_index < self.total {
            self.next_offset_ns = self.books.params().profile.offset_ns(self.next_index);
            self.next_due = self.books.start + Duration::from_nanos(self.next_offset_ns);
        }
    }

    /// Moves the retries due by `now` into the send queue.
    fn release_retries(&mut self, now: Instant) {
        while self.books.retries.peek().is_some_and(|d| d.at <= now) {
            let Some(due) = self.books.retries.pop() else { break };
            let job = due.job;
            if !self.books.enqueue(job) {
                let since_first_us =
                    now.saturating_duration_since(job.first_intended).as_micros() as u64;
                let previous = Job { attempt: job.attempt - 1, ..job };
                self.books.end(previous, job.last_state, since_first_us, Ending::QueueFull);
            }
        }
    }

    /// Gives queued requests to connections with free slots (filling one connection's
    /// pipeline before the next, as one write), then writes.
    fn assign(&mut self) {
        while !self.books.queue.is_empty() {
            let Some(&c) = self.ready.front() else { break };
            let pipeline = self.books.params().pipeline;
            let conn = &mut self.conns[c];
            if !matches!(conn.state, ConnState::Open) || conn.busy() >= pipeline {
                conn.ready = false;
                self.ready.pop_front();
                continue;
            }
            let Some(job) = self.books.queue.pop_front() else { break };
            let p = &self.books.setup.params;
            let pass = p.passes.get(job.user as usize).map_or("", String::as_str);
            self.books.setup.template.encode(&mut conn.out, pass, job.request_seq);
            conn.pending.push(job);
            if !conn.dirty {
                conn.dirty = true;
                self.dirty.push(c);
            }
            if conn.busy() >= pipeline {
                conn.ready = false;
                self.ready.pop_front();
            }
        }
        while let Some(c) = self.dirty.pop() {
            self.conns[c].dirty = false;
            self.flush(c);
        }
    }

    /// Writes what connection `c` has to write; when all of it is out, its requests are
    /// in flight (timestamped now). A full socket buffer waits for `EPOLLOUT`.
    fn flush(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        let Some(stream) = conn.stream.as_ref() else { return };
        while conn.out_at < conn.out.len() {
            match (&*stream).write(&conn.out[conn.out_at..]) {
                Ok(n) => conn.out_at += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if !conn.wants_out {
                        conn.wants_out = true;
                        let interest = epoll::EventFlags::IN | epoll::EventFlags::OUT;
                        let _ = epoll::modify(
                            &self.epoll,
                            stream,
                            epoll::EventData::new_u64(c as u64),
                            interest,
                        );
                    }
                    return;
                }
                Err(_) => {
                    self.fail(c, Failure::Io, Instant::now());
                    return;
                }
            }
        }
        conn.out.clear();
        conn.out_at = 0;
        if conn.wants_out {
            conn.wants_out = false;
            let _ = epoll::modify(
                &self.epoll,
                stream,
                epoll::EventData::new_u64(c as u64),
                epoll::EventFlags::IN,
            );
        }
        let written = Instant::now();
        let elapsed_us = self.books.elapsed_us(written);
        self.books.last_written_us = self.books.last_written_us.max(elapsed_us);
        for job in conn.pending.drain(..) {
            let lag_us = written.saturating_duration_since(job.intended).as_micros() as u64;
            self.books.recorder.on_sent(elapsed_us, lag_us, job.attempt > 0);
            conn.in_flight.push_back(InFlight { job, written });
        }
    }

    fn on_readable(&mut self, c: usize, now: Instant) {
        loop {
            let conn = &mut self.conns[c];
            if conn.in_len == conn.inbuf.len() {
                if conn.inbuf.len() >= READ_BUFFER_BYTES_MAX {
                    // parse_response refuses anything this large; never reached.
                    self.fail(c, Failure::Protocol, now);
                    return;
                }
                let grown = (conn.inbuf.len() * 2).min(READ_BUFFER_BYTES_MAX);
                conn.inbuf.resize(grown, 0);
            }
            let Some(stream) = conn.stream.as_ref() else { return };
            match (&*stream).read(&mut conn.inbuf[conn.in_len..]) {
                Ok(0) => {
                    // EOF: answers already read still count.
                    if self.take_responses(c, now) {
                        self.fail(c, Failure::Io, now);
                    }
                    return;
                }
                Ok(n) => {
                    conn.in_len += n;
                    if conn.in_len < conn.inbuf.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.fail(c, Failure::Io, now);
                    return;
                }
            }
        }
        self.take_responses(c, now);
    }

    /// Books every complete response at the front of `c`'s buffer, in pipeline order;
    /// false when the connection was given up (closed by the server, or out of step).
    fn take_responses(&mut self, c: usize, now: Instant) -> bool {
        let conn = &mut self.conns[c];
        let mut used = 0;
        let mut outcome = None;
        while used < conn.in_len {
            let response = match http::parse_response(&conn.inbuf[used..conn.in_len]) {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(_) => {
                    outcome = Some(Failure::Protocol);
                    break;
                }
            };
            // An answer nobody asked for: the stream is out of step.
            let Some(f) = conn.in_flight.pop_front() else {
                outcome = Some(Failure::Protocol);
                break;
            };
            let answer = SubmitAnswer::parse(response.body);
            self.books.on_answer(&f, response.status, &answer, response.retry_after_s, now);
            used += response.len;
            if response.close {
                outcome = Some(Failure::Io);
                break;
            }
        }
        if used > 0 {
            conn.inbuf.copy_within(used..conn.in_len, 0);
            conn.in_len -= used;
            if !conn.ready && matches!(conn.state, ConnState::Open) {
                conn.ready = true;
                self.ready.push_back(c);
            }
        }
        match outcome {
            None => true,
            Some(why) => {
                if why == Failure::Protocol {
                    self.books.recorder.errors.protocol += 1;
                }
                self.fail(c, why, now);
                false
            }
        }
    }

    /// Gives connection `c` up: what it had in flight or pending is lost; it reconnects
    /// at once (after a failure of a working connection) or after its backoff (after a
    /// failed connect).
    fn fail(&mut self, c: usize, why: Failure, now: Instant) {
        let conn = &mut self.conns[c];
        let lost: Vec<Job> =
            conn.in_flight.drain(..).map(|f| f.job).chain(conn.pending.drain(..)).collect();
        conn.stream = None; // closing the socket also removes it from the epoll set
        conn.out.clear();
        conn.out_at = 0;
        conn.in_len = 0;
        conn.wants_out = false;
        conn.state = ConnState::Down { retry_at: now };
        self.books.lost(lost.into_iter(), why);
    }

    /// Starts a non-blocking connect of connection `c`.
    fn connect(&mut self, c: usize, now: Instant) {
        let target = self.books.params().target;
        let started = start_connect(target).and_then(|(stream, open)| {
            let interest = if open { epoll::EventFlags::IN } else { epoll::EventFlags::OUT };
            epoll::add(&self.epoll, &stream, epoll::EventData::new_u64(c as u64), interest)?;
            Ok((stream, open))
        });
        let conn = &mut self.conns[c];
        match started {
            Ok((stream, open)) => {
                conn.stream = Some(stream);
                if open {
                    self.opened(c);
                } else {
                    conn.state = ConnState::Connecting { since: now };
                }
            }
            Err(_) => self.connect_failed(c, now),
        }
    }

    fn on_connect_ready(&mut self, c: usize, failed: bool, now: Instant) {
        let conn = &mut self.conns[c];
        let Some(stream) = conn.stream.as_ref() else { return };
        let error = stream.take_error().ok().flatten();
        if failed || error.is_some() {
            self.connect_failed(c, now);
            return;
        }
        let _ = epoll::modify(
            &self.epoll,
            stream,
            epoll::EventData::new_u64(c as u64),
            epoll::EventFlags::IN,
        );
        self.opened(c);
    }

    fn opened(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        conn.state = ConnState::Open;
        conn.backoff_ms = RECONNECT_BACKOFF_MS_MIN;
        if !conn.ready {
            conn.ready = true;
            self.ready.push_back(c);
        }
    }

    fn connect_failed(&mut self, c: usize, now: Instant) {
        self.books.recorder.errors.connect += 1;
        let conn = &mut self.conns[c];
        conn.stream = None;
        conn.state = ConnState::Down { retry_at: now + Duration::from_millis(conn.backoff_ms) };
        conn.backoff_ms = (conn.backoff_ms * 2).min(RECONNECT_BACKOFF_MS_MAX);
    }

    /// Request and connect timeouts, reconnects, the progress gauges.
    fn housekeeping(&mut self, now: Instant) {
        self.next_housekeeping = now + Duration::from_millis(HOUSEKEEPING_MS);
        let timeout = Duration::from_millis(self.books.params().timeout_ms);
        let done = self.finished();
        for c in 0..self.conns.len() {
            match self.conns[c].state {
                ConnState::Open => {
                    let front = self.conns[c].in_flight.front().map(|f| f.written);
                    if front.is_some_and(|written| now >= written + timeout) {
                        self.fail(c, Failure::Timeout, now);
                    }
                }
                ConnState::Connecting { since } if now >= since + timeout => {
                    self.connect_failed(c, now);
                }
                ConnState::Down { retry_at } if now >= retry_at && !done => self.connect(c, now),
                _ => {}
            }
        }
        let p99 = now >= self.next_gauge_p99;
        if p99 {
            self.next_gauge_p99 = now + Duration::from_millis(GAUGE_P99_EVERY_MS);
        }
        self.publish_gauges(p99);
    }

    fn publish_gauges(&self, with_p99: bool) {
        let g = &self.books.setup.gauges[self.books.setup.index];
        let r = &self.books.recorder;
        let e = &r.errors;
        g.sent.store(r.sent, Ordering::Relaxed);
        g.answered.store(r.answered, Ordering::Relaxed);
        g.accepted.store(r.count(State::Queued) + r.count(State::QueuedPending), Ordering::Relaxed);
        g.sold_out.store(r.count(State::SoldOut), Ordering::Relaxed);
        g.shed.store(r.count(State::Overloaded), Ordering::Relaxed);
        g.queued.store(self.books.queue.len() as u64, Ordering::Relaxed);
        g.dropped.store(self.books.dropped, Ordering::Relaxed);
        g.errors.store(e.connect + e.io + e.timeout + e.protocol, Ordering::Relaxed);
        if with_p99 {
            let p99_us = (LatencySummary::of(&r.overall).p99 * 1_000.0) as u64;
            g.p99_us.store(p99_us, Ordering::Relaxed);
        }
    }

    /// The run is over while things are still waiting: queued requests are unsent,
    /// waiting retries end with their last answer, what is in flight timed out.
    fn give_up(&mut self, now: Instant) {
        let unsent = self.books.queue.len() as u64;
        for job in std::mem::take(&mut self.books.queue) {
            if job.attempt == 0 {
                self.books.recorder.intents.unsent += 1;
                self.books.outstanding -= 1;
            } else {
                let since_first_us =
                    now.saturating_duration_since(job.first_intended).as_micros() as u64;
                let previous = Job { attempt: job.attempt - 1, ..job };
                self.books.end(previous, job.last_state, since_first_us, Ending::RunEnd);
            }
        }
        self.books.unsent += unsent;
        while let Some(due) = self.books.retries.pop() {
            let job = due.job;
            let since_first_us =
                now.saturating_duration_since(job.first_intended).as_micros() as u64;
            let previous = Job { attempt: job.attempt - 1, ..job };
            self.books.end(previous, job.last_state, since_first_us, Ending::RunEnd);
        }
        for c in 0..self.conns.len() {
            if self.conns[c].busy() > 0 {
                self.fail(c, Failure::Timeout, now);
            }
        }
    }

    fn into_result(self) -> LoopResult {
        let mut recorder = self.books.recorder;
        recorder.dispatch_lag = self.books.dispatch_lag;
        LoopResult {
            recorder,
            scheduled: self.scheduled,
            per_second: self.per_second,
            dropped: self.books.dropped,
            unsent: self.books.unsent,
            last_written_us: self.books.last_written_us,
            last_answer_us: self.books.last_answer_us,
        }
    }
}

/// A non-blocking TCP connect to `target` with `TCP_NODELAY`; `true` when it completed at
/// once (loopback can), `false` while it is in progress (wait for `EPOLLOUT`).
fn start_connect(target: std::net::SocketAddr) -> std::io::Result<(TcpStream, bool)> {
    use socket2::{Domain, Protocol, Socket, Type};
    // socket2 sets close-on-exec itself.
    let socket = Socket::new(Domain::for_address(target), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_nonblocking(true)?;
    socket.set_tcp_nodelay(true)?;
    let open = match socket.connect(&target.into()) {
        Ok(()) => true,
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INPROGRESS.raw_os_error()) => false,
        Err(e) => return Err(e),
    };
    Ok((socket.into(), open))
}
