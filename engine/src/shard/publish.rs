//! THE path an order-create message takes to the log, for a fresh reservation (submit) and
//! for every republish (scanner) alike (DESIGN.md sections 4 and 6):
//!
//! 1. the shard's log-publish circuit: open → not sent (the reservation stays pending and
//!    the scanner retries; half-open admits a few probes whose outcome closes or re-opens it);
//! 2. the publish through the durable side ([`DurableRequest::Publish`], the messages of one
//!    poll of the shard together: [`Outgoing`]), awaited for at most
//!    `publish_wait_ms`; counted as ok / timeout / error in `flashsale_publish_total`. The
//!    circuit records how the log really answered, not how long the shard waited: an ack that
//!    arrives after `publish_wait_ms` (a healthy but slow log, e.g. on CPU-saturated cores)
//!    is a success recorded when it arrives, and only a refusal or the log's own publish
//!    timeout (`log.publish_timeout_ms`) is a failure. So slow acks never close submissions
//!    while NATS answers, and a log that stops answering still opens the circuit;
//! 3. on the log's ack the answer goes out (`QUEUED`) and, best effort and off the buyer's
//!    answer, the reservation waits for its `mark_sent` (status `MESSAGE_SENT`, the pending
//!    entry re-scored to the order deadline). The mark only keeps the scanner from
//!    republishing an acknowledged message before its order deadline, so it is deferred to
//!    half the pending grace after the ack, and not made at all when the reservation's
//!    outcome reaches Redis first (`sync.rs` tells [`PublishPath::outcome_recorded`]): in a
//!    healthy pipeline most units never need one, which saves five Redis commands each.
//!    [`Marks`] sends the marks that fall due together as one call per SKU, and while a call
//!    is out the next batch gathers; each call is retried within the idempotent-retry
//!    policy. A mark that fails or is never made (the shard stopped) only means a later
//!    republish, deduplicated by message id; a stopping shard makes its deferred marks at
//!    once.
//!
//! Traces (`spans.rs`): before the message leaves, its `traceparent` becomes the
//! reservation span's context (a republish's: the republish span's) with the sampling
//! decision, and when the wait ends the reservation's and the publish's spans are recorded.
//!
//! The `Nats-Msg-Id` is the message id itself, except for a message the log already
//! acknowledged whose outcome is overdue ([`MsgIdentity::Attempt`]): JetStream's duplicate
//! window would drop it as a copy of the lost original, so it goes out as
//! `<message_id>-r<attempt>`; the body keeps every business id and the PostgreSQL inbox,
//! keyed by the body's message id, turns a copy into a duplicate that re-emits the outcome.

use std::cell::{Cell, RefCell};
use std::collections::{HashSet, VecDeque};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use flashsale_io::jetstream::{LogError, PublishAck};
use flashsale_io::redis::script::{MarkSent, MarkSentArgs, SkuKeys, MARK_SENT_MAX};
use flashsale_io::wire::OrderCreate;
use futures::channel::oneshot;

use super::config::EdgeConfig;
use super::retry::retry_idempotent;
use super::shared::EdgeShared;
use super::spans::{self, PublishEnd, Sending};
use super::store::Store;
use crate::durable::DurableRequest;
use crate::logic::circuit::{Admit, CallOutcome, Circuit, CircuitState};
use crate::logic::clock::now_ms;
use crate::logic::metrics::ShardMetrics;
use crate::logic::placement::SkuKey;
use crate::logic::sku_funnel::Stage;
use crate::logic::submit::Published;

/// Under which `Nats-Msg-Id` a message goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgIdentity {
    /// The message id: first publishes and republishes of a message never acknowledged.
    Original,
    /// `<message_id>-r<retry_count>`: a message acknowledged before whose outcome is overdue.
    Attempt,
}

/// Who publishes: a fresh reservation, or the scanner (whose acked republishes are counted in
/// `flashsale_republished_total`, late ones included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Submit,
    Scanner,
}

/// Longest a late ack is waited for after the shard answered (the durable side replies
/// within the log's own publish timeout; this only bounds a reply that never comes).
const LATE_ACK_WAIT_MS: u64 = 10_000;

type Reply = oneshot::Receiver<Result<PublishAck, LogError>>;

/// One shard's publish path: its log-publish circuit, the messages crossing to the durable
/// side this poll, the marks still to be made, and what they need (the durable side's
/// handle, the shard's Redis for `mark_sent`, its metrics).
pub struct PublishPath {
    id: usize,
    shared: Arc<EdgeShared>,
    store: Rc<Store>,
    /// Open → new submissions get SUBMIT_CLOSED before anything is reserved (reservations
    /// already made stay safe: the scanner republishes).
    circuit: RefCell<Circuit>,
    outgoing: Outgoing,
    marks: Marks,
}

impl PublishPath {
    pub fn new(id: usize, shared: &Arc<EdgeShared>, store: &Rc<Store>) -> PublishPath {
        PublishPath {
            id,
            shared: Arc::clone(shared),
            store: Rc::clone(store),
            circuit: RefCell::new(Circuit::new(shared.config.publish_circuit)),
            outgoing: Outgoing::default(),
            marks: Marks::default(),
        }
    }

    /// The log-publish circuit now (admission closes submissions while it is open).
    pub fn circuit_state(&self, now_ms: u64) -> CircuitState {
        self.circuit.borrow().state(now_ms)
    }

    /// No mark waiting or being sent (a stopping shard waits for this).
    pub fn is_idle(&self) -> bool {
        self.marks.is_idle()
    }

    /// The final outcome of `reservation_id` is in Redis: its deferred mark is not needed.
    pub fn outcome_recorded(&self, reservation_id: &str) {
        self.marks.awaiting.borrow_mut().remove(reservation_id);
    }

    fn metrics(&self) -> &ShardMetrics {
        self.shared.shard_metrics(self.id)
    }

    fn config(&self) -> &EdgeConfig {
        &self.shared.config
    }
}

/// Publishes `message` (steps 1-3 of the module documentation).
pub async fn publish_order(
    path: &Rc<PublishPath>,
    keys: &Rc<SkuKeys>,
    mut message: OrderCreate,
    identity: MsgIdentity,
    origin: Origin,
) -> Published {
    let traces = &path.shared.traces;
    let sending = match origin {
        Origin::Submit => Sending::Fresh,
        Origin::Scanner => Sending::Republish,
    };
    let trace = spans::begin_publish(traces, &mut message, sending);
    if origin == Origin::Submit {
        // A fresh reservation: `reserve` answered CREATED (every submit publishes its own once).
        let key = SkuKey::new(message.activity_id, message.sku_id);
        path.shared.sku_funnel.count(path.id, key, Stage::Reserved);
    }
    let call = match path.circuit.borrow_mut().allow(now_ms()) {
        Admit::Call(call) => call,
        Admit::Reject { .. } => {
            spans::end_publish(traces, trace, PublishEnd::CircuitOpen);
            return Published::NotAcked;
        }
    };
    let mark = MarkRequest {
        reservation_id: message.reservation_id.clone(),
        request_id: message.request_id.clone(),
        user_id: message.user_id,
        identity,
        origin,
        due_ms: mark_due_ms(path.config().pending_grace_ms, message.reserved_at_ms, origin),
    };
    let mut reply = send(path, message, identity);
    let wait = Duration::from_millis(path.config().publish_wait_ms);
    match glommio::timer::timeout(wait, async { Ok((&mut reply).await) }).await {
        Ok(Ok(Ok(_ack))) => {
            path.metrics().publish_ok.fetch_add(1, Ordering::Relaxed);
            record(path, call, CallOutcome::Success);
            spans::end_publish(traces, trace, PublishEnd::Acked);
        }
        Ok(_) => {
            path.metrics().publish_error.fetch_add(1, Ordering::Relaxed);
            record(path, call, CallOutcome::Failure);
            spans::end_publish(traces, trace, PublishEnd::Refused);
            return Published::NotAcked;
        }
        Err(_) => {
            // The answer goes out now (QUEUED_PENDING); how the log answers is still worth
            // knowing, for the circuit and to spare the scanner a republish.
            path.metrics().publish_timeout.fetch_add(1, Ordering::Relaxed);
            spans::end_publish(traces, trace, PublishEnd::Timeout);
            let (path, keys) = (Rc::clone(path), Rc::clone(keys));
            glommio::spawn_local(async move { late_ack(&path, &keys, reply, call, mark).await })
                .detach();
            return Published::NotAcked;
        }
    }
    #[cfg(feature = "failpoints")]
    fail::fail_point!("after_publish_ack");
    acked(path, keys, mark);
    Published::Acked
}

/// The log's answer to a publish the shard stopped waiting for.
async fn late_ack(
    path: &Rc<PublishPath>,
    keys: &Rc<SkuKeys>,
    reply: Reply,
    call: crate::logic::circuit::Call,
    mark: MarkRequest,
) {
    let wait = Duration::from_millis(LATE_ACK_WAIT_MS);
    match glommio::timer::timeout(wait, async { Ok(reply.await) }).await {
        Ok(Ok(Ok(_ack))) => {
            path.metrics().publish_late_ok.fetch_add(1, Ordering::Relaxed);
            record(path, call, CallOutcome::Success);
            acked(path, keys, mark);
        }
        _ => record(path, call, CallOutcome::Failure),
    }
}

fn record(path: &PublishPath, call: crate::logic::circuit::Call, outcome: CallOutcome) {
    let mut circuit = path.circuit.borrow_mut();
    circuit.record(call, outcome, now_ms());
    let state = u64::from(circuit.state(now_ms()).metric_value());
    path.metrics().publish_circuit.store(state, Ordering::Relaxed);
}

struct MarkRequest {
    reservation_id: String,
    request_id: String,
    user_id: u64,
    identity: MsgIdentity,
    origin: Origin,
    /// When the mark is made if the outcome has not reached Redis by then.
    due_ms: u64,
}

/// When a fresh reservation's mark falls due: a quarter of the pending grace before the
/// scanner would republish it (what is left covers the mark's own round trip on a busy
/// shard; a mark that is late anyway costs one republish, deduplicated by message id). A
/// scanner's republish is marked at once: its pending entry is due again after one backoff.
fn mark_due_ms(pending_grace_ms: u64, reserved_at_ms: u64, origin: Origin) -> u64 {
    match origin {
        Origin::Submit => reserved_at_ms + pending_grace_ms - pending_grace_ms / 4,
        Origin::Scanner => 0,
    }
}

/// The log has the message: count a republish, queue the reservation's mark.
fn acked(path: &Rc<PublishPath>, keys: &Rc<SkuKeys>, mark: MarkRequest) {
    if mark.origin == Origin::Scanner {
        path.metrics().republished.fetch_add(1, Ordering::Relaxed);
    }
    // A message acknowledged before is already `MESSAGE_SENT` (a mark would answer
    // `NOT_PENDING`).
    if mark.identity == MsgIdentity::Attempt {
        return;
    }
    if mark.due_ms <= now_ms() {
        // A republish, or an ack later than its mark's time: marked now, never behind the
        // deferred ones.
        path.marks.queue.borrow_mut().push((Rc::clone(keys), mark));
        if !path.marks.flushing.replace(true) {
            let path = Rc::clone(path);
            glommio::spawn_local(async move { flush_marks(&path).await }).detach();
        }
        return;
    }
    path.marks.awaiting.borrow_mut().insert(mark.reservation_id.clone());
    path.marks.deferred.borrow_mut().push_back((Rc::clone(keys), mark));
    if !path.marks.waiting.replace(true) {
        let path = Rc::clone(path);
        glommio::spawn_local(async move { wait_marks(&path).await }).detach();
    }
}

/// The acks of one shard whose `mark_sent` is still to be made (step 3 of the module
/// documentation): deferred until due, then queued and sent; and whether a task is waiting
/// for due marks or sending them.
#[derive(Default)]
struct Marks {
    /// Fresh reservations' marks in ack order, so in order of the time each falls due but for
    /// acks that overtake each other (a mark behind a later one waits for it: a publish's ack
    /// comes within its wait, far less than the grace). Marks already due skip this queue.
    deferred: RefCell<VecDeque<(Rc<SkuKeys>, MarkRequest)>>,
    /// Reservations in `deferred` whose outcome has not reached Redis yet.
    awaiting: RefCell<HashSet<String>>,
    waiting: Cell<bool>,
    queue: RefCell<Vec<(Rc<SkuKeys>, MarkRequest)>>,
    flushing: Cell<bool>,
}

impl Marks {
    /// No mark deferred, waiting or being sent.
    fn is_idle(&self) -> bool {
        !self.waiting.get() && !self.flushing.get()
    }

    /// Moves the marks due at `now_ms` (every one when `all`) whose outcome is still unknown
    /// to the send queue; true when any was queued.
    fn take_due(&self, now_ms: u64, all: bool) -> bool {
        let mut deferred = self.deferred.borrow_mut();
        let mut awaiting = self.awaiting.borrow_mut();
        let mut queue = self.queue.borrow_mut();
        let before = queue.len();
        while deferred.front().is_some_and(|(_, mark)| all || mark.due_ms <= now_ms) {
            let Some((keys, mark)) = deferred.pop_front() else { break };
            if awaiting.remove(&mark.reservation_id) {
                queue.push((keys, mark));
            }
        }
        queue.len() > before
    }
}

/// How often deferred marks are looked at.
const MARK_TICK_MS: u64 = 20;

/// Until no mark is deferred: queues the due ones and sends them (all of them once the shard
/// stops).
async fn wait_marks(path: &Rc<PublishPath>) {
    while !path.marks.deferred.borrow().is_empty() {
        glommio::timer::sleep(Duration::from_millis(MARK_TICK_MS)).await;
        let stopping = path.shared.is_stopping();
        if path.marks.take_due(now_ms(), stopping) && !path.marks.flushing.replace(true) {
            let path = Rc::clone(path);
            glommio::spawn_local(async move { flush_marks(&path).await }).detach();
        }
    }
    path.marks.waiting.set(false);
}

/// Sends the queued marks, one call per SKU (at most [`MARK_SENT_MAX`] each), until none is
/// left. Marks queued while a call is out wait for the next round.
async fn flush_marks(path: &PublishPath) {
    loop {
        // The other marks of this poll of the shard join the batch first.
        futures_lite::future::yield_now().await;
        let mut batch = std::mem::take(&mut *path.marks.queue.borrow_mut());
        if batch.is_empty() {
            break;
        }
        while let Some((keys, _)) = batch.first() {
            let keys = Rc::clone(keys);
            let (sku, rest): (Vec<_>, Vec<_>) =
                batch.into_iter().partition(|(k, _)| Rc::ptr_eq(k, &keys));
            batch = rest;
            for chunk in sku.chunks(MARK_SENT_MAX) {
                mark_sent(path, &keys, chunk).await;
            }
        }
    }
    path.marks.flushing.set(false);
}

/// Best effort: the messages are durable either way.
async fn mark_sent(path: &PublishPath, keys: &SkuKeys, chunk: &[(Rc<SkuKeys>, MarkRequest)]) {
    let marks: Vec<MarkSent<'_>> = chunk
        .iter()
        .map(|(_, mark)| MarkSent {
            reservation_id: &mark.reservation_id,
            request_id: &mark.request_id,
            user_id: mark.user_id,
        })
        .collect();
    let args = MarkSentArgs {
        marks: &marks,
        now_ms: now_ms(),
        order_deadline_ms: path.config().order_deadline_ms,
    };
    let retry = &path.config().idempotent_retry;
    let _ = retry_idempotent(retry, || path.store.functions.mark_sent(keys, &args)).await;
}

/// Queues the message for this poll's crossing to the durable side ([`Outgoing`]).
fn send(path: &Rc<PublishPath>, message: OrderCreate, identity: MsgIdentity) -> Reply {
    let msg_id = match identity {
        MsgIdentity::Original => None,
        MsgIdentity::Attempt => Some(format!("{}-r{}", message.message_id, message.retry_count)),
    };
    let (reply, rx) = oneshot::channel();
    path.outgoing.queue.borrow_mut().push(Outbound { message, msg_id, reply });
    if !path.outgoing.scheduled.replace(true) {
        let path = Rc::clone(path);
        glommio::spawn_local(async move { cross(&path).await }).detach();
    }
    rx
}

/// Messages to the log that are published in the same poll of the shard: they cross to the
/// durable side as one request and their acks come back as one answer, two wake-ups across
/// the thread boundary per batch instead of two per message.
#[derive(Default)]
struct Outgoing {
    queue: RefCell<Vec<Outbound>>,
    scheduled: Cell<bool>,
}

struct Outbound {
    message: OrderCreate,
    msg_id: Option<String>,
    reply: oneshot::Sender<Result<PublishAck, LogError>>,
}

/// Messages in one request to the durable side, at most.
const PUBLISH_BATCH_MAX: usize = 128;

/// Hands what this poll queued to the durable side and each ack to its publisher. A full
/// queue or a stopped durable side drops the replies: each publisher sees "not sent".
async fn cross(path: &PublishPath) {
    // The other publishes of this poll join the batch first.
    futures_lite::future::yield_now().await;
    path.outgoing.scheduled.set(false);
    let mut queued = std::mem::take(&mut *path.outgoing.queue.borrow_mut());
    let mut answers = Vec::new();
    while !queued.is_empty() {
        let rest = queued.split_off(queued.len().min(PUBLISH_BATCH_MAX));
        let (messages, replies): (Vec<_>, Vec<_>) =
            queued.into_iter().map(|o| ((o.message, o.msg_id), o.reply)).unzip();
        queued = rest;
        let (tx, rx) = oneshot::channel();
        if path.shared.durable.try_send(DurableRequest::Publish { messages, reply: tx }).is_ok() {
            answers.push(async move {
                if let Ok(acks) = rx.await {
                    for (reply, ack) in replies.into_iter().zip(acks) {
                        let _ = reply.send(ack);
                    }
                }
            });
        }
    }
    futures::future::join_all(answers).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(reservation_id: &str, due_ms: u64) -> MarkRequest {
        MarkRequest {
            reservation_id: reservation_id.to_owned(),
            request_id: format!("req_{reservation_id}"),
            user_id: 7,
            identity: MsgIdentity::Original,
            origin: Origin::Submit,
            due_ms,
        }
    }

    fn defer(marks: &Marks, keys: &Rc<SkuKeys>, due_ms: u64, reservation_id: &str) {
        marks.awaiting.borrow_mut().insert(reservation_id.to_owned());
        marks.deferred.borrow_mut().push_back((Rc::clone(keys), mark(reservation_id, due_ms)));
    }

    #[test]
    fn a_fresh_mark_falls_due_a_quarter_grace_before_the_scanner_and_a_republish_at_once() {
        assert_eq!(mark_due_ms(2_000, 10_000, Origin::Submit), 11_500);
        assert_eq!(mark_due_ms(2_000, 10_000, Origin::Scanner), 0);
    }

    fn queued(marks: &Marks) -> Vec<String> {
        marks.queue.borrow().iter().map(|(_, m)| m.reservation_id.clone()).collect()
    }

    #[test]
    fn a_deferred_mark_is_sent_when_due_unless_its_outcome_came_first() {
        let marks = Marks::default();
        let keys = Rc::new(SkuKeys::new(1, 2));
        defer(&marks, &keys, 100, "r1");
        defer(&marks, &keys, 110, "r2");
        defer(&marks, &keys, 200, "r3");
        // r2's outcome reached Redis before its mark fell due: no mark for it.
        marks.awaiting.borrow_mut().remove("r2");

        assert!(!marks.take_due(99, false), "nothing due yet");
        assert!(marks.take_due(150, false));
        assert_eq!(queued(&marks), ["r1"]);
        assert_eq!(marks.deferred.borrow().len(), 1, "r3 still deferred");
        // A stopping shard sends every deferred mark at once.
        assert!(marks.take_due(150, true));
        assert_eq!(queued(&marks), ["r1", "r3"]);
        assert!(marks.deferred.borrow().is_empty() && marks.awaiting.borrow().is_empty());
        // Nothing left to take.
        assert!(!marks.take_due(u64::MAX, true));
    }
}
