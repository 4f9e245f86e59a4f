//! The pipelined Redis connection for one glommio executor: many tasks share one TCP
//! connection; every command queued within one executor tick goes out in ONE write, replies
//! are matched to commands in FIFO order. Single-threaded by construction (`Rc`, not `Send`):
//! each owner shard owns its own clients.
//!
//! How it works (DESIGN.md 3.2):
//! - [`RedisClient::request`] encodes the command straight into the shared queue buffer,
//!   records a completion slot and wakes the connection task. Nothing is written yet.
//! - The connection task (one per client, spawned by [`RedisClient::new`]) runs four futures
//!   side by side: the **writer** swaps the whole queue buffer out and writes it with one
//!   `write_all` (auto-pipelining: everyone who queued before the task ran shares that
//!   write), the **reader** decodes replies and completes the oldest written command, the
//!   **deadline sweeper** answers commands whose `command_timeout` has passed, and a close
//!   signal. One timer serves all deadlines: every command has the same timeout and joins
//!   the queue in time order, so deadlines are ordered and only the oldest one matters.
//! - The bookkeeping (`Pipeline`) does no I/O and reads no clock (time is an argument), so
//!   it is unit-tested below without a socket.
//!
//! What a caller can be told, and why it is safe:
//! - [`RedisError::NotSent`]: the command was never written, nothing happened; a command
//!   whose caller stopped waiting (deadline passed or future dropped) before the writer ran
//!   is cut out of the buffer and really never sent.
//! - [`RedisError::OutcomeUnknown`]: it was written (or its write had started) and no reply
//!   came: the script MAY have run. Retry only with the same idempotency key.
//! - [`RedisError::Full`]: `in_flight_max` reached; answered at once, nothing grows.
//! - Server error replies (`-ERR …`) are `Ok(Reply::Error(..))`: the caller interprets them.
//!
//! Connection loss fails written commands `OutcomeUnknown` and queued ones `NotSent`, then
//! reconnects in the background with exponential backoff and full jitter. While
//! disconnected, requests fail fast with `NotSent` (fail closed: no queue builds up). A
//! connection whose oldest written command has gone unanswered for twice `command_timeout`
//! is treated as dead (e.g. a peer that stopped without closing TCP), dropped and re-made;
//! otherwise a late reply is simply matched and discarded.
//!
//! Replica fencing ([`FenceConfig`]): a fencing connection appends one `WAIT` to every batch
//! and releases the batch's replies only with its answer ([`RedisClient::request_fenced`]
//! returns the reply and its [`FenceOutcome`]). A reply whose `WAIT` never answered is
//! `OutcomeUnknown`, like any written command without a reply.
//!
//! Not here: `FCALL` reply meaning and "function not found" reloads (`super::script`), the
//! circuit breaker (the engine), Cluster routing (`super::cluster`; this file only offers the
//! `ASKING` pair, [`RedisClient::request_asking`]), encoding details (`crate::resp`).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fmt;
use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_lite::future::or;
use futures_lite::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use glommio::net::TcpStream;
use rand::Rng;

use crate::resp::{self, ProtocolError, Reply};

/// Settings of one client (one TCP connection to one Redis node).
#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub addr: SocketAddr,
    /// Most commands queued or written and not yet answered. Full → [`RedisError::Full`] at
    /// once. Redis itself has no pipeline limit, so this is the only bound: it caps what the
    /// server buffers for us (query buffer, default `client-query-buffer-limit` 1 GiB; the
    /// replies in its output buffer, unlimited for normal clients by default) and, more
    /// tightly, the queueing delay — Redis runs commands one at a time, so the last of
    /// `in_flight_max` commands waits for all the others: keep
    /// `in_flight_max × server time per command` well below `command_timeout` (256 × ~30 µs
    /// for a creating `reserve` ≈ 8 ms, against 250 ms).
    pub in_flight_max: usize,
    /// Deadline of one command, counted from the request (queueing included).
    pub command_timeout: Duration,
    /// Deadline of one TCP connect attempt, and of [`RedisClient::connect`]'s wait.
    pub connect_timeout: Duration,
    /// Reconnect sleep is `random(0, min(reconnect_backoff_max, base × 2^attempt))`.
    pub reconnect_backoff_base: Duration,
    pub reconnect_backoff_max: Duration,
    /// Bytes asked of the socket per read, and the starting size of both buffers. One
    /// reply is bounded separately by `resp::DecodeLimits::DEFAULT.frame_bytes_max`.
    pub read_buffer_bytes: usize,
    /// Replica fencing of this connection (see [`FenceConfig`]); off by default.
    pub fence: FenceConfig,
}

/// Replica fencing (DESIGN.md section 11): a connection with `min_replica_acks > 0` appends
/// ONE `WAIT min_replica_acks wait_timeout_ms` after every batch it writes, and hands each
/// command's reply to its caller only together with that WAIT's answer
/// ([`FenceOutcome`]). So a reply is known to be held by that many replicas — or known not
/// to be — before anyone acts on it.
///
/// Why a connection and not a flag per command: Redis blocks a client inside `WAIT`, so every
/// command written behind it on the same connection waits too. Fenced commands get a
/// connection of their own (the cluster client's fenced lane); everything else keeps its
/// unfenced connection and is never delayed by a `WAIT`.
///
/// `WAIT` covers every write the master made before this connection's last command, whoever
/// made it (measured on Redis 7.0: a read-only command moves the connection's offset up to
/// the master's), so a replayed reply (`IDEMPOTENT`) is fenced as well as a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceConfig {
    /// Replicas that must acknowledge; 0 = no fencing, no `WAIT`.
    pub min_replica_acks: u32,
    /// The `WAIT` timeout. Must stay below `command_timeout`, or a healthy fence would be
    /// reported as a timeout; a short `WAIT` answers [`FenceOutcome::Short`].
    pub wait_timeout: Duration,
}

impl FenceConfig {
    pub const OFF: FenceConfig =
        FenceConfig { min_replica_acks: 0, wait_timeout: Duration::from_millis(50) };

    pub fn replicas(min_replica_acks: u32, wait_timeout: Duration) -> FenceConfig {
        FenceConfig { min_replica_acks, wait_timeout }
    }

    pub fn is_on(&self) -> bool {
        self.min_replica_acks > 0
    }
}

/// What the `WAIT` after a command's batch said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceOutcome {
    /// The connection does not fence.
    NotFenced,
    /// At least `min_replica_acks` replicas hold everything up to this command.
    Met { acks: u32 },
    /// Fewer did within the timeout (or `WAIT` answered an error, counted as 0): the reply
    /// is real but may be lost on failover. Never a promise.
    Short { acks: u32, wanted: u32 },
}

impl FenceOutcome {
    /// True unless the fence was asked for and not met.
    pub fn holds(&self) -> bool {
        !matches!(self, FenceOutcome::Short { .. })
    }
}

/// A reply together with its fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fenced {
    pub reply: Reply,
    pub fence: FenceOutcome,
}

impl RedisConfig {
    /// Values for a shard talking to a nearby Redis; every one is spelled out here rather
    /// than left to a library default.
    pub fn new(addr: SocketAddr) -> RedisConfig {
        RedisConfig {
            addr,
            in_flight_max: 256,
            command_timeout: Duration::from_millis(250),
            connect_timeout: Duration::from_millis(1_000),
            reconnect_backoff_base: Duration::from_millis(50),
            reconnect_backoff_max: Duration::from_millis(2_000),
            read_buffer_bytes: 16 * 1024,
            fence: FenceConfig::OFF,
        }
    }

    /// Checks the bounds against each other; call it where the configuration is parsed.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.in_flight_max == 0 {
            return Err("redis in_flight_max must be at least 1");
        }
        if self.command_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err("redis command_timeout and connect_timeout must be above zero");
        }
        if self.reconnect_backoff_base.is_zero()
            || self.reconnect_backoff_base > self.reconnect_backoff_max
        {
            return Err("redis reconnect_backoff_base must be above zero and at most _max");
        }
        if self.read_buffer_bytes < 512 {
            return Err("redis read_buffer_bytes must be at least 512");
        }
        if self.fence.is_on()
            && (self.fence.wait_timeout.is_zero()
                || self.fence.wait_timeout >= self.command_timeout)
        {
            return Err("redis fence wait_timeout must be above zero and below command_timeout");
        }
        Ok(())
    }
}

/// Why a command was not sent. In every case nothing happened on the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotSentReason {
    /// No connection right now (connecting or backing off).
    Disconnected,
    /// [`RedisClient::connect`] gave up after `connect_timeout`.
    ConnectTimedOut,
    /// The deadline passed while the command was still queued.
    TimedOut,
    /// The connection broke before the command was written.
    ConnectionLost,
    /// The encode closure wrote nothing (a caller bug; nothing was queued).
    EmptyCommand,
    /// Redis Cluster: no master is known for the command's slot (map not loaded, slot
    /// unassigned, or its node could not be reached).
    NoNodeForSlot,
    /// Redis Cluster: `MOVED`/`ASK` redirects exceeded their bound; every redirected attempt
    /// was refused before running.
    RedirectsExhausted,
    /// Redis Cluster: `TRYAGAIN` (a slot being migrated) kept coming back within the bound;
    /// the command never ran.
    TryAgainExhausted,
}

/// Why a written command has no reply. In every case the command may have run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownReason {
    TimedOut,
    ConnectionLost,
    /// [`RedisClient::close`] was called while the reply was outstanding.
    Closed,
}

impl fmt::Display for NotSentReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NotSentReason::Disconnected => "not connected",
            NotSentReason::ConnectTimedOut => "connect timed out",
            NotSentReason::TimedOut => "deadline passed while queued",
            NotSentReason::ConnectionLost => "connection lost before the write",
            NotSentReason::EmptyCommand => "empty command",
            NotSentReason::NoNodeForSlot => "no node known for the slot",
            NotSentReason::RedirectsExhausted => "too many cluster redirects",
            NotSentReason::TryAgainExhausted => "slot kept migrating (TRYAGAIN)",
        })
    }
}

impl fmt::Display for UnknownReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UnknownReason::TimedOut => "deadline passed after the write",
            UnknownReason::ConnectionLost => "connection lost after the write",
            UnknownReason::Closed => "client closed after the write",
        })
    }
}

/// The error at this crate's Redis boundary. A server error reply is not one of these.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("redis command not sent ({0}): nothing happened")]
    NotSent(NotSentReason),
    #[error("redis command outcome unknown ({0}): it may have run")]
    OutcomeUnknown(UnknownReason),
    #[error("redis pipeline full (in_flight_max reached)")]
    Full,
    /// The reply to this command was malformed; the command was written, so its outcome is
    /// unknown too. The connection is dropped and re-made.
    #[error("redis protocol error, outcome unknown: {0}")]
    Protocol(ProtocolError),
    #[error("redis client closed")]
    Closed,
}

impl RedisError {
    /// Worth trying again later (with the same idempotency key if
    /// [`RedisError::outcome_unknown`]). A protocol error means a bug or a peer that is not
    /// Redis: retrying would hammer it, so it is not transient.
    pub fn is_transient(&self) -> bool {
        match self {
            RedisError::NotSent(reason) => *reason != NotSentReason::EmptyCommand,
            RedisError::OutcomeUnknown(_) | RedisError::Full => true,
            RedisError::Protocol(_) | RedisError::Closed => false,
        }
    }

    /// The command was written and may have run: the caller must treat its effect as
    /// "maybe" (answer `UNKNOWN`, retry only idempotently).
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, RedisError::OutcomeUnknown(_) | RedisError::Protocol(_))
    }
}

// ---------------------------------------------------------------------------------------
// Completion slots: one per command, shared by the waiting caller and the pipeline.

enum SlotState {
    Waiting(Option<Waker>),
    Done(Result<Reply, RedisError>),
    /// The result was taken, or the caller stopped waiting.
    Finished,
}

struct Slot {
    state: RefCell<SlotState>,
    /// Set by the pipeline before `complete` on a fencing connection.
    fence: Cell<FenceOutcome>,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            state: RefCell::new(SlotState::Waiting(None)),
            fence: Cell::new(FenceOutcome::NotFenced),
        }
    }

    fn is_waiting(&self) -> bool {
        matches!(*self.state.borrow(), SlotState::Waiting(_))
    }

    /// Hands `result` to the caller if it is still waiting; otherwise drops it.
    fn complete(&self, result: Result<Reply, RedisError>) {
        let mut state = self.state.borrow_mut();
        if let SlotState::Waiting(waker) = &mut *state {
            let waker = waker.take();
            *state = SlotState::Done(result);
            drop(state);
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }
}

/// The caller's side of a slot. Dropping it before the result arrives cancels the command:
/// unsent, it is cut from the buffer; written, its reply is discarded.
struct SlotWait {
    slot: Rc<Slot>,
}

impl Future for SlotWait {
    type Output = Result<Reply, RedisError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.slot.state.borrow_mut();
        match &mut *state {
            SlotState::Waiting(waker) => {
                match waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => *waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
            SlotState::Done(_) => match std::mem::replace(&mut *state, SlotState::Finished) {
                SlotState::Done(result) => Poll::Ready(result),
                _ => Poll::Ready(Err(RedisError::Closed)),
            },
            SlotState::Finished => Poll::Ready(Err(RedisError::Closed)),
        }
    }
}

impl Drop for SlotWait {
    fn drop(&mut self) {
        let mut state = self.slot.state.borrow_mut();
        *state = SlotState::Finished;
    }
}

// ---------------------------------------------------------------------------------------
// The pipeline bookkeeping: no I/O, no clock.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Connecting or backing off: requests fail fast with `NotSent`.
    Disconnected,
    Connected,
    Closed,
}

struct Queued {
    slot: Rc<Slot>,
    /// Bytes of this command in `Pipeline::queue_buf`, which holds the queued commands
    /// back to back in queue order.
    len: usize,
    deadline: Instant,
}

struct Written {
    /// `None`: the `WAIT` a fencing connection appended to the batch.
    slot: Option<Rc<Slot>>,
    deadline: Instant,
}

/// A reply that arrived on a fencing connection and waits for its batch's `WAIT`.
struct Held {
    slot: Rc<Slot>,
    reply: Reply,
    deadline: Instant,
}

/// What the deadline sweeper should do next.
#[derive(Debug, PartialEq, Eq)]
enum Sweep {
    /// Nothing in flight: park until a request arrives.
    Idle,
    /// Sleep until then and sweep again.
    Until(Instant),
    /// The oldest written command has waited two deadlines: the connection is dead.
    Stalled,
}

/// How a connection ended.
#[derive(Debug)]
enum ConnEnd {
    Closed,
    Eof,
    Io(std::io::Error),
    Protocol(ProtocolError),
    Stalled,
}

impl fmt::Display for ConnEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnEnd::Closed => f.write_str("closed by the client"),
            ConnEnd::Eof => f.write_str("closed by the server"),
            ConnEnd::Io(e) => write!(f, "i/o error: {e}"),
            ConnEnd::Protocol(e) => write!(f, "protocol error: {e}"),
            ConnEnd::Stalled => f.write_str("no reply for two command timeouts"),
        }
    }
}

struct Pipeline {
    phase: Phase,
    in_flight_max: usize,
    command_timeout: Duration,
    /// Commands encoded by callers and not yet taken by the writer.
    queue_buf: BytesMut,
    queued: VecDeque<Queued>,
    /// Written commands awaiting replies, oldest first (replies come in this order).
    written: VecDeque<Written>,
    /// How many of the oldest `written` entries the sweeper already answered
    /// `OutcomeUnknown` (deadlines are ordered, so they are always a prefix).
    written_swept: usize,
    /// Same for `queued` (answered `NotSent`, skipped by the writer).
    queued_swept: usize,
    /// Fencing only: replies that arrived and wait for their batch's `WAIT`, oldest first.
    held: VecDeque<Held>,
    /// Same as `written_swept`, for `held` (answered `OutcomeUnknown`).
    held_swept: usize,
    fence: FenceConfig,
    /// `WAIT n timeout_ms`, encoded once.
    wait_command: BytesMut,
    /// The connection task: writer, sweeper and close signal all park on it.
    driver_waker: Option<Waker>,
    /// [`RedisClient::connect`] callers waiting for the phase to change.
    phase_wakers: Vec<Waker>,
}

/// `WAIT <min_replica_acks> <wait_timeout_ms>`, or nothing when fencing is off.
fn wait_command(fence: &FenceConfig) -> BytesMut {
    let mut buf = BytesMut::new();
    if fence.is_on() {
        let acks = resp::U64Text::new(u64::from(fence.min_replica_acks));
        let timeout_ms = u64::try_from(fence.wait_timeout.as_millis()).unwrap_or(u64::MAX);
        let timeout_ms = resp::U64Text::new(timeout_ms.max(1));
        resp::encode_command(&mut buf, &[b"WAIT", acks.as_bytes(), timeout_ms.as_bytes()]);
    }
    buf
}

impl Pipeline {
    fn new(config: &RedisConfig) -> Pipeline {
        Pipeline {
            phase: Phase::Disconnected,
            in_flight_max: config.in_flight_max,
            command_timeout: config.command_timeout,
            queue_buf: BytesMut::with_capacity(config.read_buffer_bytes),
            queued: VecDeque::with_capacity(config.in_flight_max),
            written: VecDeque::with_capacity(config.in_flight_max),
            written_swept: 0,
            queued_swept: 0,
            held: VecDeque::with_capacity(if config.fence.is_on() {
                config.in_flight_max
            } else {
                0
            }),
            held_swept: 0,
            fence: config.fence,
            wait_command: wait_command(&config.fence),
            driver_waker: None,
            phase_wakers: Vec::new(),
        }
    }

    /// Commands not yet answered: queued, written, or held for a `WAIT` (a fencing batch's
    /// `WAIT` counts too, so the bound also covers it).
    fn in_flight(&self) -> usize {
        self.queued.len() + self.written.len() + self.held.len()
    }

    /// Queues one command. The waker to wake (the connection task) is returned so that it
    /// is woken after the caller has released the borrow.
    fn enqueue(
        &mut self,
        encode: impl FnOnce(&mut BytesMut),
        now: Instant,
    ) -> Result<(Rc<Slot>, Option<Waker>), RedisError> {
        match self.phase {
            Phase::Connected => {}
            Phase::Disconnected => return Err(RedisError::NotSent(NotSentReason::Disconnected)),
            Phase::Closed => return Err(RedisError::Closed),
        }
        if self.in_flight() >= self.in_flight_max {
            return Err(RedisError::Full);
        }
        let start = self.queue_buf.len();
        encode(&mut self.queue_buf);
        let len = self.queue_buf.len() - start;
        if len == 0 {
            return Err(RedisError::NotSent(NotSentReason::EmptyCommand));
        }
        // FIFO matching breaks if a closure writes anything but exactly one command.
        debug_assert_eq!(
            resp::scan(&self.queue_buf[start..], &resp::DecodeLimits::DEFAULT),
            Ok(Some(len)),
            "request() closures must encode exactly one command"
        );
        let slot = Rc::new(Slot::new());
        let deadline = now + self.command_timeout;
        self.queued.push_back(Queued { slot: Rc::clone(&slot), len, deadline });
        Ok((slot, self.driver_waker.take()))
    }

    /// Moves every queued command into `out` (which the writer then writes in one go) and
    /// into `written`. Commands whose callers stopped waiting are cut out, so they are never
    /// sent. Returns how many commands `out` holds.
    fn take_batch(&mut self, out: &mut BytesMut) -> usize {
        out.clear();
        if self.queued.iter().all(|q| q.slot.is_waiting()) {
            // The common case: hand the whole buffer over, no copy; the writer's old buffer
            // becomes the new queue buffer, so both keep their capacity.
            std::mem::swap(&mut self.queue_buf, out);
        } else {
            let mut offset = 0;
            for q in &self.queued {
                if q.slot.is_waiting() {
                    out.extend_from_slice(&self.queue_buf[offset..offset + q.len]);
                }
                offset += q.len;
            }
            self.queue_buf.clear();
        }
        let mut taken = 0;
        let mut last_deadline = None;
        for q in self.queued.drain(..) {
            if q.slot.is_waiting() {
                last_deadline = Some(q.deadline);
                self.written.push_back(Written { slot: Some(q.slot), deadline: q.deadline });
                taken += 1;
            }
        }
        self.queued_swept = 0;
        // ONE `WAIT` per fenced batch, after every command of it: its answer covers them all.
        // Its deadline is the batch's last, so `written` stays ordered by deadline.
        if let (true, Some(deadline)) = (self.fence.is_on(), last_deadline) {
            out.extend_from_slice(&self.wait_command);
            self.written.push_back(Written { slot: None, deadline });
        }
        taken
    }

    /// Completes the oldest written command (on a fencing connection: holds its reply until
    /// the batch's `WAIT` answers, then releases the batch). `false` if nothing was waiting
    /// for a reply.
    fn deliver(&mut self, reply: Reply) -> bool {
        let Some(oldest) = self.written.pop_front() else { return false };
        self.written_swept = self.written_swept.saturating_sub(1);
        match oldest.slot {
            Some(slot) if self.fence.is_on() => {
                self.held.push_back(Held { slot, reply, deadline: oldest.deadline });
            }
            Some(slot) => slot.complete(Ok(reply)),
            None => self.release_held(&reply),
        }
        true
    }

    /// The `WAIT` answered: every held reply (all of its batch) goes out with the fence.
    fn release_held(&mut self, wait_reply: &Reply) {
        let wanted = self.fence.min_replica_acks;
        // An error reply (e.g. WAIT on a replica) or a negative count means "not confirmed".
        let acks = wait_reply.as_int().and_then(|n| u32::try_from(n).ok()).unwrap_or(0);
        let fence = if acks >= wanted {
            FenceOutcome::Met { acks }
        } else {
            FenceOutcome::Short { acks, wanted }
        };
        for held in self.held.drain(..) {
            held.slot.fence.set(fence);
            held.slot.complete(Ok(held.reply));
        }
        self.held_swept = 0;
    }

    /// Answers every command whose deadline has passed and says when to look again.
    fn sweep(&mut self, now: Instant) -> Sweep {
        while let Some(w) = self.written.get(self.written_swept) {
            if w.deadline > now {
                break;
            }
            if let Some(slot) = &w.slot {
                slot.complete(Err(RedisError::OutcomeUnknown(UnknownReason::TimedOut)));
            }
            self.written_swept += 1;
        }
        // A held reply whose WAIT did not answer in time: the command ran, its fence is
        // unknown, so the caller may not rely on it.
        while let Some(h) = self.held.get(self.held_swept) {
            if h.deadline > now {
                break;
            }
            h.slot.complete(Err(RedisError::OutcomeUnknown(UnknownReason::TimedOut)));
            self.held_swept += 1;
        }
        while let Some(q) = self.queued.get(self.queued_swept) {
            if q.deadline > now {
                break;
            }
            // No longer waiting, so `take_batch` will cut it out: it is never sent.
            q.slot.complete(Err(RedisError::NotSent(NotSentReason::TimedOut)));
            self.queued_swept += 1;
        }
        let stall_at = self.written.front().map(|w| w.deadline + self.command_timeout);
        if stall_at.is_some_and(|at| at <= now) {
            return Sweep::Stalled;
        }
        let next = [
            stall_at,
            self.written.get(self.written_swept).map(|w| w.deadline),
            self.queued.get(self.queued_swept).map(|q| q.deadline),
            self.held.get(self.held_swept).map(|h| h.deadline),
        ]
        .into_iter()
        .flatten()
        .min();
        match next {
            Some(at) => Sweep::Until(at),
            None if self.in_flight() == 0 => Sweep::Idle,
            // Only swept queued entries remain; the writer drops them on its next turn.
            None => Sweep::Until(now + self.command_timeout),
        }
    }

    /// Fails everything in flight after the connection ended: written → outcome unknown
    /// (the head gets the protocol error if that is what ended it), queued → not sent.
    fn fail_all(&mut self, end: &ConnEnd) {
        let closed = self.phase == Phase::Closed;
        let mut head_error = match end {
            ConnEnd::Protocol(e) => Some(e.clone()),
            _ => None,
        };
        let unknown = if closed { UnknownReason::Closed } else { UnknownReason::ConnectionLost };
        // Held replies came before anything still written: they ran, their fence is unknown.
        for h in self.held.drain(..) {
            h.slot.complete(Err(RedisError::OutcomeUnknown(unknown)));
        }
        for w in self.written.drain(..) {
            let error = match head_error.take() {
                Some(e) => RedisError::Protocol(e),
                None => RedisError::OutcomeUnknown(unknown),
            };
            if let Some(slot) = w.slot {
                slot.complete(Err(error));
            }
        }
        for q in self.queued.drain(..) {
            q.slot.complete(Err(if closed {
                RedisError::Closed
            } else {
                RedisError::NotSent(NotSentReason::ConnectionLost)
            }));
        }
        self.queue_buf.clear();
        self.written_swept = 0;
        self.queued_swept = 0;
        self.held_swept = 0;
    }

    /// Changes the phase; returns the wakers to wake once the borrow is released.
    fn set_phase(&mut self, phase: Phase) -> Vec<Waker> {
        if self.phase == Phase::Closed {
            return Vec::new();
        }
        self.phase = phase;
        let mut wakers = std::mem::take(&mut self.phase_wakers);
        wakers.extend(self.driver_waker.take());
        wakers
    }

    fn register_driver(&mut self, cx: &Context<'_>) {
        match &self.driver_waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => self.driver_waker = Some(cx.waker().clone()),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The client and its connection task.

struct Shared {
    config: RedisConfig,
    pipeline: RefCell<Pipeline>,
    writes_total: Cell<u64>,
    commands_total: Cell<u64>,
    connects_total: Cell<u64>,
}

impl Shared {
    fn set_phase(&self, phase: Phase) {
        let wakers = self.pipeline.borrow_mut().set_phase(phase);
        wakers.into_iter().for_each(Waker::wake);
    }

    fn close(&self) {
        let wakers = {
            let mut pipeline = self.pipeline.borrow_mut();
            let wakers = pipeline.set_phase(Phase::Closed);
            pipeline.phase = Phase::Closed;
            pipeline.fail_all(&ConnEnd::Closed);
            wakers
        };
        wakers.into_iter().for_each(Waker::wake);
    }

    fn is_closed(&self) -> bool {
        self.pipeline.borrow().phase == Phase::Closed
    }

    /// Resolves once the client is closed; meant to be raced against the driver's waits.
    async fn closed(&self) {
        poll_fn(|cx| {
            let mut pipeline = self.pipeline.borrow_mut();
            if pipeline.phase == Phase::Closed {
                Poll::Ready(())
            } else {
                pipeline.register_driver(cx);
                Poll::Pending
            }
        })
        .await
    }
}

/// Closes the client when the last [`RedisClient`] clone is dropped, so the connection
/// task never outlives its users.
struct Handle {
    shared: Rc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.close();
    }
}

/// A pipelined, bounded, reconnecting client for one Redis node on the current glommio
/// executor. Cheap to clone; all clones share one connection.
#[derive(Clone)]
pub struct RedisClient {
    handle: Rc<Handle>,
}

impl RedisClient {
    /// Spawns the connection task on the current glommio executor (panics outside one) and
    /// connects in the background. Until connected, requests fail with `NotSent`.
    ///
    /// # Panics
    /// If `config.validate()` fails: a configuration error is a start-up bug.
    pub fn new(config: RedisConfig) -> RedisClient {
        if let Err(message) = config.validate() {
            panic!("invalid RedisConfig: {message}");
        }
        let shared = Rc::new(Shared {
            pipeline: RefCell::new(Pipeline::new(&config)),
            config,
            writes_total: Cell::new(0),
            commands_total: Cell::new(0),
            connects_total: Cell::new(0),
        });
        glommio::spawn_local(drive(Rc::clone(&shared))).detach();
        RedisClient { handle: Rc::new(Handle { shared }) }
    }

    /// [`RedisClient::new`], then waits until the first connection is up, at most
    /// `connect_timeout`. Background reconnect attempts count within that time.
    pub async fn connect(config: RedisConfig) -> Result<RedisClient, RedisError> {
        let connect_timeout = config.connect_timeout;
        let client = RedisClient::new(config);
        client.wait_connected(connect_timeout).await?;
        Ok(client)
    }

    /// Waits until the connection is up, at most `timeout` (at once if it is).
    pub async fn wait_connected(&self, timeout: Duration) -> Result<(), RedisError> {
        let shared = &self.handle.shared;
        let up = poll_fn(|cx| {
            let mut pipeline = shared.pipeline.borrow_mut();
            match pipeline.phase {
                Phase::Connected => Poll::Ready(Ok(())),
                Phase::Closed => Poll::Ready(Err(RedisError::Closed)),
                Phase::Disconnected => {
                    // Bounded: one entry per waiter, drained on every phase change.
                    pipeline.phase_wakers.push(cx.waker().clone());
                    Poll::Pending
                }
            }
        });
        let deadline = async {
            glommio::timer::sleep(timeout).await;
            Err(RedisError::NotSent(NotSentReason::ConnectTimedOut))
        };
        or(up, deadline).await
    }

    /// Sends one command and waits for its reply. `encode` must append exactly ONE command
    /// to the shared pipeline buffer (e.g. with [`resp::encode_fcall`]); it runs while the
    /// pipeline is borrowed, so it must not touch this client, and must not panic.
    pub async fn request(&self, encode: impl FnOnce(&mut BytesMut)) -> Result<Reply, RedisError> {
        self.request_fenced(encode).await.map(|fenced| fenced.reply)
    }

    /// [`RedisClient::request`] that also says what the batch's `WAIT` answered
    /// ([`FenceOutcome::NotFenced`] unless this connection fences, see [`FenceConfig`]).
    pub async fn request_fenced(
        &self,
        encode: impl FnOnce(&mut BytesMut),
    ) -> Result<Fenced, RedisError> {
        let shared = &self.handle.shared;
        let (slot, waker) = shared.pipeline.borrow_mut().enqueue(encode, Instant::now())?;
        if let Some(waker) = waker {
            waker.wake();
        }
        let wait = SlotWait { slot: Rc::clone(&slot) };
        let reply = wait.await?;
        Ok(Fenced { reply, fence: slot.fence.get() })
    }

    /// `ASKING` and then the command, adjacent in the same batch (Redis Cluster's one-shot
    /// redirect: the flag covers exactly the next command of this connection). Both are
    /// queued in one step or neither is, and both are cancelled together if this future is
    /// dropped, so an `ASKING` never goes out alone to flag a stranger's command.
    pub async fn request_asking(
        &self,
        encode: impl FnOnce(&mut BytesMut),
    ) -> Result<Fenced, RedisError> {
        let shared = &self.handle.shared;
        let now = Instant::now();
        let (asking, command, waker) = {
            let mut pipeline = shared.pipeline.borrow_mut();
            if pipeline.in_flight() + 2 > pipeline.in_flight_max {
                return Err(RedisError::Full);
            }
            let (asking, waker) =
                pipeline.enqueue(|buf| resp::encode_command(buf, &[b"ASKING"]), now)?;
            // Cannot be Full (checked above); on any other refusal the ASKING is cut out
            // when its wait is dropped below, before any write.
            let asking = SlotWait { slot: asking };
            let command = pipeline.enqueue(encode, now).map(|(slot, _)| slot);
            (asking, command, waker)
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        let slot = command?;
        let command = SlotWait { slot: Rc::clone(&slot) };
        // Replies come in order: ASKING's `+OK` first. The pair shares one batch and one
        // deadline, so the command's own result says everything (an ASKING refused by the
        // server shows up as the command's redirect or error reply).
        let _ = asking.await;
        let reply = command.await?;
        Ok(Fenced { reply, fence: slot.fence.get() })
    }

    /// A command given as its arguments, e.g. `&[b"GET", key]`.
    pub async fn command(&self, args: &[&[u8]]) -> Result<Reply, RedisError> {
        self.request(|buf| resp::encode_command(buf, args)).await
    }

    /// `FCALL function numkeys keys… args…`.
    pub async fn fcall(
        &self,
        function: &str,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<Reply, RedisError> {
        self.request(|buf| resp::encode_fcall(buf, function.as_bytes(), keys, args)).await
    }

    /// Commands queued or written and not yet answered (the `in_flight_max` count).
    pub fn in_flight(&self) -> usize {
        self.handle.shared.pipeline.borrow().in_flight()
    }

    pub fn is_connected(&self) -> bool {
        self.handle.shared.pipeline.borrow().phase == Phase::Connected
    }

    /// Stops the connection task. Queued commands fail `Closed`, written ones
    /// `OutcomeUnknown`; later requests fail `Closed`.
    pub fn close(&self) {
        self.handle.shared.close();
    }

    /// Socket writes made (one per pipelined batch), for tests and metrics.
    pub fn writes_total(&self) -> u64 {
        self.handle.shared.writes_total.get()
    }

    /// Commands written, for tests and metrics; `commands_total / writes_total` is the
    /// average batch size.
    pub fn commands_total(&self) -> u64 {
        self.handle.shared.commands_total.get()
    }

    /// Connections established (1 + reconnects).
    pub fn connects_total(&self) -> u64 {
        self.handle.shared.connects_total.get()
    }

    pub fn config(&self) -> &RedisConfig {
        &self.handle.shared.config
    }
}

/// The connection task: connect, run the connection until it ends, fail what was in
/// flight, back off, repeat — until the client is closed.
async fn drive(shared: Rc<Shared>) {
    let config = shared.config.clone();
    let mut attempt: u32 = 0;
    let mut read_buf = BytesMut::with_capacity(config.read_buffer_bytes);
    let mut out_buf = BytesMut::with_capacity(config.read_buffer_bytes);
    loop {
        let connecting =
            async { Some(TcpStream::connect_timeout(config.addr, config.connect_timeout).await) };
        let connected = or(
            async {
                shared.closed().await;
                None
            },
            connecting,
        )
        .await;
        match connected {
            None => return,
            Some(Ok(stream)) => {
                attempt = 0;
                // Each batch is one write; Nagle would only add latency to it.
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::warn!(addr = %config.addr, error = %e, "redis: set_nodelay failed");
                }
                shared.connects_total.set(shared.connects_total.get() + 1);
                shared.set_phase(Phase::Connected);
                read_buf.clear();
                let end = run_connection(&shared, stream, &mut read_buf, &mut out_buf).await;
                shared.pipeline.borrow_mut().fail_all(&end);
                shared.set_phase(Phase::Disconnected);
                if matches!(end, ConnEnd::Closed) || shared.is_closed() {
                    return;
                }
                tracing::warn!(addr = %config.addr, end = %end, "redis: connection lost, reconnecting");
            }
            Some(Err(e)) => {
                tracing::warn!(addr = %config.addr, attempt, error = %e, "redis: connect failed");
            }
        }
        let pause = backoff(&config, attempt);
        attempt = attempt.saturating_add(1);
        let closed = or(
            async {
                shared.closed().await;
                true
            },
            async {
                glommio::timer::sleep(pause).await;
                false
            },
        )
        .await;
        if closed {
            return;
        }
    }
}

/// Full jitter: `random(0, min(max, base × 2^attempt))`, so a fleet of shards that lost
/// Redis together does not reconnect in lockstep.
fn backoff(config: &RedisConfig, attempt: u32) -> Duration {
    let ceiling = config
        .reconnect_backoff_base
        .saturating_mul(1u32 << attempt.min(20))
        .min(config.reconnect_backoff_max);
    let ceiling_us = u64::try_from(ceiling.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(rand::thread_rng().gen_range(0..=ceiling_us))
}

async fn run_connection(
    shared: &Shared,
    stream: TcpStream,
    read_buf: &mut BytesMut,
    out_buf: &mut BytesMut,
) -> ConnEnd {
    let stream = RefCell::new(stream);
    let closed = async {
        shared.closed().await;
        ConnEnd::Closed
    };
    // Polled in this order on every wake: replies the reader can get are delivered before
    // the sweeper judges deadlines, so a reply that has arrived is not reported as a timeout.
    or(
        closed,
        or(
            read_loop(shared, &stream, read_buf),
            or(write_loop(shared, &stream, out_buf), sweep_loop(shared)),
        ),
    )
    .await
}

async fn write_loop(shared: &Shared, stream: &RefCell<TcpStream>, out: &mut BytesMut) -> ConnEnd {
    loop {
        let taken = poll_fn(|cx| {
            let mut pipeline = shared.pipeline.borrow_mut();
            if pipeline.queued.is_empty() {
                pipeline.register_driver(cx);
                return Poll::Pending;
            }
            Poll::Ready(pipeline.take_batch(out))
        })
        .await;
        if taken == 0 {
            continue; // every queued command had been cancelled
        }
        if let Err(e) = Io(stream).write_all(&out[..]).await {
            return ConnEnd::Io(e);
        }
        shared.writes_total.set(shared.writes_total.get() + 1);
        shared.commands_total.set(shared.commands_total.get() + taken as u64);
    }
}

async fn read_loop(shared: &Shared, stream: &RefCell<TcpStream>, buf: &mut BytesMut) -> ConnEnd {
    let chunk = shared.config.read_buffer_bytes;
    loop {
        loop {
            match resp::decode(buf) {
                Ok(Some(reply)) => {
                    if !shared.pipeline.borrow_mut().deliver(reply) {
                        return ConnEnd::Protocol(ProtocolError::Unsolicited);
                    }
                }
                Ok(None) => break,
                Err(e) => return ConnEnd::Protocol(e),
            }
        }
        // The decoder bounds one incomplete reply (frame_bytes_max), so this buffer never
        // holds more than that plus one chunk.
        let filled = buf.len();
        buf.resize(filled + chunk, 0);
        let read = Io(stream).read(&mut buf[filled..]).await;
        match read {
            Ok(0) => return ConnEnd::Eof,
            Ok(n) => buf.truncate(filled + n),
            Err(e) => return ConnEnd::Io(e),
        }
    }
}

async fn sweep_loop(shared: &Shared) -> ConnEnd {
    loop {
        let now = Instant::now();
        let next = shared.pipeline.borrow_mut().sweep(now);
        match next {
            Sweep::Stalled => return ConnEnd::Stalled,
            Sweep::Until(at) => glommio::timer::sleep(at.saturating_duration_since(now)).await,
            Sweep::Idle => {
                poll_fn(|cx| {
                    let mut pipeline = shared.pipeline.borrow_mut();
                    if pipeline.in_flight() > 0 {
                        return Poll::Ready(());
                    }
                    pipeline.register_driver(cx);
                    Poll::Pending
                })
                .await
            }
        }
    }
}

/// Lets the reader and the writer use one stream from one task: each poll borrows it only
/// for the duration of the call, and glommio keeps separate read and write wakers.
struct Io<'a>(&'a RefCell<TcpStream>);

impl AsyncRead for Io<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.borrow_mut()).poll_read(cx, buf)
    }
}

impl AsyncWrite for Io<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.borrow_mut()).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.borrow_mut()).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.borrow_mut()).poll_close(cx)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use futures::task::noop_waker;

    fn pipeline(in_flight_max: usize) -> Pipeline {
        let mut config = RedisConfig::new(SocketAddr::from(([127, 0, 0, 1], 1)));
        config.in_flight_max = in_flight_max;
        config.command_timeout = Duration::from_millis(100);
        let mut p = Pipeline::new(&config);
        p.phase = Phase::Connected;
        p
    }

    fn get(key: &'static [u8]) -> impl FnOnce(&mut BytesMut) {
        move |buf| resp::encode_command(buf, &[b"GET", key])
    }

    /// Polls a slot once with a no-op waker.
    fn poll_slot(wait: &mut SlotWait) -> Poll<Result<Reply, RedisError>> {
        let waker = noop_waker();
        Pin::new(wait).poll(&mut Context::from_waker(&waker))
    }

    fn encoded(keys: &[&'static [u8]]) -> BytesMut {
        let mut buf = BytesMut::new();
        for key in keys {
            resp::encode_command(&mut buf, &[b"GET", key]);
        }
        buf
    }

    #[test]
    fn batch_holds_every_queued_command_and_replies_match_fifo() {
        let mut p = pipeline(8);
        let now = Instant::now();
        let mut a = SlotWait { slot: p.enqueue(get(b"a"), now).unwrap().0 };
        let mut b = SlotWait { slot: p.enqueue(get(b"b"), now).unwrap().0 };
        let mut out = BytesMut::new();
        assert_eq!(p.take_batch(&mut out), 2);
        assert_eq!(out, encoded(&[b"a", b"b"]));
        assert_eq!(p.in_flight(), 2);
        assert!(p.deliver(Reply::Integer(1)));
        assert!(p.deliver(Reply::Integer(2)));
        assert!(!p.deliver(Reply::Integer(3)), "unsolicited reply must be refused");
        assert!(matches!(poll_slot(&mut a), Poll::Ready(Ok(Reply::Integer(1)))));
        assert!(matches!(poll_slot(&mut b), Poll::Ready(Ok(Reply::Integer(2)))));
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn full_at_in_flight_max_and_nothing_grows() {
        let mut p = pipeline(2);
        let now = Instant::now();
        let _a = p.enqueue(get(b"a"), now).unwrap();
        let _b = p.enqueue(get(b"b"), now).unwrap();
        let bytes = p.queue_buf.len();
        assert!(matches!(p.enqueue(get(b"c"), now), Err(RedisError::Full)));
        assert_eq!(p.queue_buf.len(), bytes, "a refused command must not be encoded");
        // Written-but-unanswered commands still count.
        p.take_batch(&mut BytesMut::new());
        assert!(matches!(p.enqueue(get(b"c"), now), Err(RedisError::Full)));
    }

    #[test]
    fn timed_out_unsent_command_is_never_sent() {
        let mut p = pipeline(8);
        let t0 = Instant::now();
        let mut a = SlotWait { slot: p.enqueue(get(b"a"), t0).unwrap().0 };
        let t1 = t0 + Duration::from_millis(60);
        let mut b = SlotWait { slot: p.enqueue(get(b"b"), t1).unwrap().0 };
        // a's deadline (t0+100) passes, b's (t1+100) not yet.
        assert_eq!(
            p.sweep(t0 + Duration::from_millis(100)),
            Sweep::Until(t1 + Duration::from_millis(100))
        );
        assert!(matches!(
            poll_slot(&mut a),
            Poll::Ready(Err(RedisError::NotSent(NotSentReason::TimedOut)))
        ));
        let mut out = BytesMut::new();
        assert_eq!(p.take_batch(&mut out), 1);
        assert_eq!(out, encoded(&[b"b"]), "the timed-out command was cut out");
        assert!(poll_slot(&mut b).is_pending());
    }

    #[test]
    fn dropped_caller_before_write_is_cut_out() {
        let mut p = pipeline(8);
        let now = Instant::now();
        let a = SlotWait { slot: p.enqueue(get(b"a"), now).unwrap().0 };
        let _b = SlotWait { slot: p.enqueue(get(b"b"), now).unwrap().0 };
        drop(a);
        let mut out = BytesMut::new();
        assert_eq!(p.take_batch(&mut out), 1);
        assert_eq!(out, encoded(&[b"b"]));
    }

    #[test]
    fn timed_out_written_command_is_unknown_and_its_late_reply_is_discarded() {
        let mut p = pipeline(8);
        let t0 = Instant::now();
        let mut a = SlotWait { slot: p.enqueue(get(b"a"), t0).unwrap().0 };
        p.take_batch(&mut BytesMut::new());
        let mut b =
            SlotWait { slot: p.enqueue(get(b"b"), t0 + Duration::from_millis(50)).unwrap().0 };
        p.take_batch(&mut BytesMut::new());
        let deadline_a = t0 + Duration::from_millis(100);
        assert_eq!(p.sweep(deadline_a), Sweep::Until(deadline_a + Duration::from_millis(50)));
        assert!(matches!(
            poll_slot(&mut a),
            Poll::Ready(Err(RedisError::OutcomeUnknown(UnknownReason::TimedOut)))
        ));
        // The late reply of `a` is consumed in order and goes to nobody; `b` gets its own.
        assert!(p.deliver(Reply::Integer(1)));
        assert!(p.deliver(Reply::Integer(2)));
        assert!(matches!(poll_slot(&mut b), Poll::Ready(Ok(Reply::Integer(2)))));
    }

    #[test]
    fn unanswered_for_two_deadlines_is_a_stall() {
        let mut p = pipeline(8);
        let t0 = Instant::now();
        let _a = p.enqueue(get(b"a"), t0).unwrap();
        p.take_batch(&mut BytesMut::new());
        assert_eq!(p.sweep(t0), Sweep::Until(t0 + Duration::from_millis(100)));
        assert_eq!(
            p.sweep(t0 + Duration::from_millis(100)),
            Sweep::Until(t0 + Duration::from_millis(200))
        );
        assert_eq!(p.sweep(t0 + Duration::from_millis(200)), Sweep::Stalled);
    }

    #[test]
    fn connection_loss_fails_written_unknown_and_queued_not_sent() {
        let mut p = pipeline(8);
        let now = Instant::now();
        let mut a = SlotWait { slot: p.enqueue(get(b"a"), now).unwrap().0 };
        let mut b = SlotWait { slot: p.enqueue(get(b"b"), now).unwrap().0 };
        p.take_batch(&mut BytesMut::new());
        let mut c = SlotWait { slot: p.enqueue(get(b"c"), now).unwrap().0 };
        p.fail_all(&ConnEnd::Protocol(ProtocolError::InvalidType(b'?')));
        assert!(matches!(poll_slot(&mut a), Poll::Ready(Err(RedisError::Protocol(_)))));
        assert!(matches!(
            poll_slot(&mut b),
            Poll::Ready(Err(RedisError::OutcomeUnknown(UnknownReason::ConnectionLost)))
        ));
        assert!(matches!(
            poll_slot(&mut c),
            Poll::Ready(Err(RedisError::NotSent(NotSentReason::ConnectionLost)))
        ));
        assert_eq!(p.in_flight(), 0);
        assert!(p.queue_buf.is_empty());
    }

    #[test]
    fn disconnected_fails_fast_and_empty_commands_are_refused() {
        let mut p = pipeline(8);
        let now = Instant::now();
        assert!(matches!(
            p.enqueue(|_| {}, now),
            Err(RedisError::NotSent(NotSentReason::EmptyCommand))
        ));
        p.phase = Phase::Disconnected;
        assert!(matches!(
            p.enqueue(get(b"a"), now),
            Err(RedisError::NotSent(NotSentReason::Disconnected))
        ));
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn error_classification() {
        let unknown = RedisError::OutcomeUnknown(UnknownReason::TimedOut);
        assert!(unknown.to_string().contains("outcome unknown"));
        assert!(unknown.outcome_unknown() && unknown.is_transient());
        let not_sent = RedisError::NotSent(NotSentReason::Disconnected);
        assert!(!not_sent.outcome_unknown() && not_sent.is_transient());
        assert!(RedisError::Full.is_transient() && !RedisError::Full.outcome_unknown());
        let protocol = RedisError::Protocol(ProtocolError::Unsolicited);
        assert!(protocol.outcome_unknown() && !protocol.is_transient());
        assert!(protocol.to_string().contains("outcome unknown"));
        assert!(!RedisError::Closed.is_transient());
        let _ = Reply::Bulk(Bytes::new());
    }

    fn fencing_pipeline(acks: u32) -> Pipeline {
        let mut config = RedisConfig::new(SocketAddr::from(([127, 0, 0, 1], 1)));
        config.command_timeout = Duration::from_millis(100);
        config.fence = FenceConfig::replicas(acks, Duration::from_millis(20));
        let mut p = Pipeline::new(&config);
        p.phase = Phase::Connected;
        p
    }

    fn poll_fence(wait: &mut SlotWait) -> Option<(Reply, FenceOutcome)> {
        match poll_slot(wait) {
            Poll::Ready(Ok(reply)) => Some((reply, wait.slot.fence.get())),
            Poll::Ready(Err(e)) => panic!("unexpected error {e}"),
            Poll::Pending => None,
        }
    }

    #[test]
    fn fenced_batch_gets_one_wait_and_replies_wait_for_it() {
        let mut p = fencing_pipeline(1);
        let now = Instant::now();
        let mut a = SlotWait { slot: p.enqueue(get(b"a"), now).unwrap().0 };
        let mut b = SlotWait { slot: p.enqueue(get(b"b"), now).unwrap().0 };
        let mut out = BytesMut::new();
        assert_eq!(p.take_batch(&mut out), 2);
        let mut expected = encoded(&[b"a", b"b"]);
        resp::encode_command(&mut expected, &[b"WAIT", b"1", b"20"]);
        assert_eq!(out, expected, "exactly one WAIT, after the whole batch");
        assert!(p.deliver(Reply::Integer(1)));
        assert!(p.deliver(Reply::Integer(2)));
        assert!(poll_fence(&mut a).is_none(), "a reply is held until the WAIT answers");
        assert!(poll_fence(&mut b).is_none());
        assert_eq!(p.in_flight(), 3, "two held replies and the WAIT");
        assert!(p.deliver(Reply::Integer(1)), "the WAIT's answer");
        assert_eq!(poll_fence(&mut a), Some((Reply::Integer(1), FenceOutcome::Met { acks: 1 })));
        assert_eq!(poll_fence(&mut b), Some((Reply::Integer(2), FenceOutcome::Met { acks: 1 })));
        assert_eq!(p.in_flight(), 0);
        // An empty batch (everything cancelled) carries no WAIT.
        let cancelled = SlotWait { slot: p.enqueue(get(b"c"), now).unwrap().0 };
        drop(cancelled);
        assert_eq!(p.take_batch(&mut out), 0);
        assert!(out.is_empty() && p.written.is_empty());
    }

    #[test]
    fn wait_short_or_error_is_short_never_met() {
        for (wait_reply, acks) in
            [(Reply::Integer(1), 1), (Reply::Error(Bytes::from_static(b"ERR replica")), 0)]
        {
            let mut p = fencing_pipeline(2);
            let now = Instant::now();
            let mut a = SlotWait { slot: p.enqueue(get(b"a"), now).unwrap().0 };
            p.take_batch(&mut BytesMut::new());
            assert!(p.deliver(Reply::Integer(7)));
            assert!(p.deliver(wait_reply));
            assert_eq!(
                poll_fence(&mut a),
                Some((Reply::Integer(7), FenceOutcome::Short { acks, wanted: 2 }))
            );
        }
    }

    #[test]
    fn unfenced_connection_sends_no_wait_and_reports_not_fenced() {
        let mut p = pipeline(8);
        let mut a = SlotWait { slot: p.enqueue(get(b"a"), Instant::now()).unwrap().0 };
        let mut out = BytesMut::new();
        p.take_batch(&mut out);
        assert_eq!(out, encoded(&[b"a"]));
        assert!(p.deliver(Reply::Integer(1)));
        assert_eq!(poll_fence(&mut a), Some((Reply::Integer(1), FenceOutcome::NotFenced)));
    }

    #[test]
    fn held_reply_without_its_wait_is_unknown_on_deadline_and_on_loss() {
        let mut p = fencing_pipeline(1);
        let t0 = Instant::now();
        let mut a = SlotWait { slot: p.enqueue(get(b"a"), t0).unwrap().0 };
        p.take_batch(&mut BytesMut::new());
        assert!(p.deliver(Reply::Integer(1)));
        // The WAIT hangs past the deadline: the command ran, its fence is unknown.
        p.sweep(t0 + Duration::from_millis(100));
        assert!(matches!(
            poll_slot(&mut a),
            Poll::Ready(Err(RedisError::OutcomeUnknown(UnknownReason::TimedOut)))
        ));
        // The late WAIT answer goes to nobody and breaks nothing.
        assert!(p.deliver(Reply::Integer(1)));
        assert_eq!(p.in_flight(), 0);

        let mut b = SlotWait { slot: p.enqueue(get(b"b"), t0).unwrap().0 };
        p.take_batch(&mut BytesMut::new());
        assert!(p.deliver(Reply::Integer(2)));
        p.fail_all(&ConnEnd::Eof);
        assert!(matches!(
            poll_slot(&mut b),
            Poll::Ready(Err(RedisError::OutcomeUnknown(UnknownReason::ConnectionLost)))
        ));
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn fence_must_fit_inside_the_command_timeout() {
        let mut config = RedisConfig::new(SocketAddr::from(([127, 0, 0, 1], 1)));
        config.fence = FenceConfig::replicas(1, config.command_timeout);
        assert!(config.validate().is_err());
        config.fence = FenceConfig::replicas(1, Duration::from_millis(50));
        assert!(config.validate().is_ok());
    }

    #[test]
    fn backoff_is_full_jitter_under_the_cap() {
        let config = RedisConfig::new(SocketAddr::from(([127, 0, 0, 1], 1)));
        for attempt in [0, 1, 3, 10, 40, u32::MAX] {
            let ceiling = (config.reconnect_backoff_base * 2u32.pow(attempt.min(20)))
                .min(config.reconnect_backoff_max);
            for _ in 0..100 {
                assert!(backoff(&config, attempt) <= ceiling);
            }
        }
    }
}
