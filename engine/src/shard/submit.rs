//! The reservation and query flows (DESIGN.md sections 1, 3.1, 4; CONTRACT.md 3.2, 3.3).
//!
//! Submit, on the shard that accepted the connection:
//! 1. pass → user (never from the body), body → request, activity must match the pass;
//! 2. the SKU's replica: sold out → `SOLD_OUT` (or the replay) right here, no Redis, no hop;
//! 3. otherwise the owner shard (here, or over the bounded mesh; full → `OVERLOADED`):
//!    `partition::plan_submit`, then `FCALL reserve` with ids minted before the call, then
//!    the publish through the durable side: ack → `mark_sent` + `QUEUED`; no ack in time →
//!    `QUEUED_PENDING` (the reservation stands; the scanner republishes with the same id).
//!
//! Query reads Redis, falls back to PostgreSQL on a miss, and answers `UNKNOWN` — never
//! `NOT_FOUND` — when a store that might know could not be asked.

use std::borrow::Cow;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use flashsale_io::redis::script::{
    MarkSentArgs, RequestState, ReserveArgs, ReserveReply, ScriptError,
};
use flashsale_io::resp::Reply;
use flashsale_io::wire::{OrderCreate, ORDER_CREATE_EVENT_TYPE, SCHEMA_VERSION};
use futures::channel::oneshot;

use super::conn::RequestCtx;
use super::{now_ms, Shard};
use crate::admission::{decide_submit, AdmissionInput, Decision};
use crate::api::{self, PayloadHash};
use crate::circuit::{Admit, CallOutcome};
use crate::durable::{DurableError, DurableRequest};
use crate::http::{write_response, Request, ResponseHead, StateBody, Status};
use crate::ids::UserId;
use crate::limiter;
use crate::outcome::{QueryOutcome, SubmitOutcome};
use crate::partition::{Accepted, AcceptedState, FastPath, ReserveSeen, SubmitPlan};
use crate::router::SkuKey;

/// An answer to a submit, ready to be written (and `Send`, to cross the mesh).
#[derive(Debug, Clone)]
pub struct SubmitAnswer {
    pub outcome: SubmitOutcome,
    pub reservation_id: Option<Arc<str>>,
    pub reason_code: Option<Cow<'static, str>>,
    pub retry_after_ms: Option<u64>,
    pub replayed: bool,
}

impl SubmitAnswer {
    fn of(outcome: SubmitOutcome) -> SubmitAnswer {
        SubmitAnswer {
            outcome,
            reservation_id: None,
            reason_code: None,
            retry_after_ms: None,
            replayed: false,
        }
    }

    fn retry(outcome: SubmitOutcome, retry_after_ms: u64) -> SubmitAnswer {
        SubmitAnswer { retry_after_ms: Some(retry_after_ms), ..SubmitAnswer::of(outcome) }
    }

    fn invalid(reason: &'static str) -> SubmitAnswer {
        SubmitAnswer {
            reason_code: Some(Cow::Borrowed(reason)),
            ..SubmitAnswer::of(SubmitOutcome::Invalid)
        }
    }

    fn replay(entry: &Accepted) -> SubmitAnswer {
        let outcome = match entry.state {
            AcceptedState::Queued => SubmitOutcome::Queued,
            AcceptedState::QueuedPending => SubmitOutcome::QueuedPending,
        };
        SubmitAnswer {
            reservation_id: Some(Arc::clone(&entry.reservation_id)),
            replayed: true,
            ..SubmitAnswer::of(outcome)
        }
    }
}

/// A submit on its way to the owner shard: owned, `Send`.
pub struct ForwardedSubmit {
    pub key: SkuKey,
    pub request_id: Box<str>,
    pub user_id: u64,
    pub payload_hash: PayloadHash,
    pub traceparent: Option<Box<str>>,
    pub reply: oneshot::Sender<SubmitAnswer>,
}

pub async fn handle_submit(
    shard: &Rc<Shard>,
    request: &Request<'_>,
    body: &[u8],
    ctx: &RequestCtx,
    head: &mut ResponseHead<'_>,
    out: &mut BytesMut,
) {
    let (answer, request_id) = submit(shard, request, body, ctx).await;
    shard.metrics().count_submit(answer.outcome);
    let (code, state) = answer.outcome.http();
    head.status = Status::from_code(code).unwrap_or(Status::InternalServerError);
    head.retry_after_ms = answer.retry_after_ms;
    let body = StateBody {
        request_id,
        state,
        reservation_id: answer.reservation_id.as_deref(),
        order_id: None,
        reason_code: answer.reason_code.as_deref(),
        retry_after_ms: answer.retry_after_ms,
        replayed: answer.replayed,
    };
    write_state(out, head, &body);
}

thread_local! {
    /// This shard's JSON scratch (one thread per shard): an answer's body is built here and
    /// then written after its head, so no answer allocates once the buffer has grown.
    static JSON_SCRATCH: std::cell::RefCell<BytesMut> =
        std::cell::RefCell::new(BytesMut::with_capacity(512));
}

/// Writes a state answer (head + flat JSON body) into the connection's buffer.
fn write_state(out: &mut BytesMut, head: &ResponseHead<'_>, body: &StateBody<'_>) {
    JSON_SCRATCH.with(|cell| {
        let mut json = cell.borrow_mut();
        json.clear();
        body.write_json(&mut json);
        write_response(out, head, &json);
    });
}

/// The submit flow up to the answer; also returns the body's request id (borrowed) for the
/// response.
async fn submit<'b>(
    shard: &Rc<Shard>,
    request: &Request<'_>,
    body: &'b [u8],
    ctx: &RequestCtx,
) -> (SubmitAnswer, Option<&'b str>) {
    let now = now_ms();
    // The address limit comes before any HMAC: it is what protects the CPU.
    if let Some(ip) = ctx.peer_ip.filter(|ip| !ip.is_loopback()) {
        if let Err(retry_ms) = shard.ip_limiter.borrow_mut().check(limiter::ip_key(ip), now) {
            return (SubmitAnswer::retry(SubmitOutcome::RateLimited, retry_ms), None);
        }
    }
    let Some(auth) = request.authorization else {
        return (SubmitAnswer::of(SubmitOutcome::Unauthorized), None);
    };
    let pass = match shard.shared.pass_keys.verify(auth.as_bytes(), now / 1000) {
        Ok(pass) => pass,
        Err(_) => return (SubmitAnswer::of(SubmitOutcome::Unauthorized), None),
    };
    let submit = match api::parse_submit(body) {
        Ok(submit) => submit,
        Err(invalid) => return (SubmitAnswer::invalid(invalid.reason_code()), None),
    };
    let request_id = submit.request_id.as_str();
    if !pass.authorizes(submit.activity_id) {
        return (SubmitAnswer::of(SubmitOutcome::Unauthorized), Some(request_id));
    }
    if let Err(retry_ms) = shard.user_limiter.borrow_mut().check(pass.user_id.0, now) {
        return (SubmitAnswer::retry(SubmitOutcome::RateLimited, retry_ms), Some(request_id));
    }
    let answer = submit_checked(shard, request, &submit, pass.user_id).await;
    (answer, Some(request_id))
}

async fn submit_checked(
    shard: &Rc<Shard>,
    request: &Request<'_>,
    submit: &api::SubmitRequest<'_>,
    user_id: UserId,
) -> SubmitAnswer {
    let key = SkuKey::new(submit.activity_id.0, submit.sku_id.0);
    let payload_hash = submit.payload_hash(user_id);
    let request_id = submit.request_id.as_str();
    // After sell-out: answered on this core.
    let fast = shard.with_replica(key, |replica| {
        replica.map_or(FastPath::Forward, |r| r.fast_path(request_id, &payload_hash))
    });
    match fast {
        FastPath::SoldOut => {
            shard.metrics().sold_out_fast_path.fetch_add(1, Ordering::Relaxed);
            return SubmitAnswer::of(SubmitOutcome::SoldOut);
        }
        FastPath::Replay(entry) => {
            shard.metrics().sold_out_fast_path.fetch_add(1, Ordering::Relaxed);
            return SubmitAnswer::replay(&entry);
        }
        FastPath::Conflict => return SubmitAnswer::of(SubmitOutcome::IdempotencyConflict),
        FastPath::Forward => {}
    }
    let owned =
        OwnedSubmit { key, request_id, user_id, payload_hash, traceparent: request.traceparent };
    let owner = shard.shared.table.owner(key);
    if owner == shard.id {
        return owner_submit(shard, &owned).await;
    }
    let (tx, rx) = oneshot::channel();
    let forwarded = Box::new(ForwardedSubmit {
        key,
        request_id: request_id.into(),
        user_id: user_id.0,
        payload_hash,
        traceparent: request.traceparent.map(Into::into),
        reply: tx,
    });
    if shard.forward(owner, forwarded).is_err() {
        shard.metrics().mesh_full.fetch_add(1, Ordering::Relaxed);
        return SubmitAnswer::retry(SubmitOutcome::Overloaded, shard.config().overloaded_retry_ms);
    }
    shard.metrics().forwarded.fetch_add(1, Ordering::Relaxed);
    // The owner always answers (its flow is bounded by Redis and publish deadlines); a
    // dropped reply means it stopped mid-request, so the outcome is unknown.
    rx.await.unwrap_or_else(|_| SubmitAnswer::of(SubmitOutcome::Unknown))
}

/// A submit as the owner works on it (borrowed when local, from a [`ForwardedSubmit`] when
/// it came over the mesh).
struct OwnedSubmit<'a> {
    key: SkuKey,
    request_id: &'a str,
    user_id: UserId,
    payload_hash: PayloadHash,
    traceparent: Option<&'a str>,
}

pub async fn owner_forwarded(shard: &Rc<Shard>, forwarded: ForwardedSubmit) {
    let owned = OwnedSubmit {
        key: forwarded.key,
        request_id: &forwarded.request_id,
        user_id: UserId(forwarded.user_id),
        payload_hash: forwarded.payload_hash,
        traceparent: forwarded.traceparent.as_deref(),
    };
    let answer = owner_submit(shard, &owned).await;
    let _ = forwarded.reply.send(answer);
}

/// The owner shard's part, inside a span carrying the business ids (never metric labels;
/// the user id only hashed).
async fn owner_submit(shard: &Rc<Shard>, s: &OwnedSubmit<'_>) -> SubmitAnswer {
    use tracing::Instrument as _;
    let span = tracing::debug_span!(
        "reserve",
        request_id = s.request_id,
        activity_id = s.key.activity_id,
        sku_id = s.key.sku_id,
        user = %format_args!("{:016x}", limiter::hash_user(s.user_id.0)),
        reservation_id = tracing::field::Empty,
        message_id = tracing::field::Empty,
        traceparent = s.traceparent.unwrap_or(""),
    );
    owner_submit_inner(shard, s).instrument(span).await
}

async fn owner_submit_inner(shard: &Rc<Shard>, s: &OwnedSubmit<'_>) -> SubmitAnswer {
    let now = now_ms();
    let (plan, tracked) = shard.with_partition(s.key, |p| {
        (p.plan_submit(s.request_id, &s.payload_hash, now), p.key() == s.key)
    });
    let permit = match plan {
        SubmitPlan::Replay(entry) => return SubmitAnswer::replay(&entry),
        SubmitPlan::Conflict => return SubmitAnswer::of(SubmitOutcome::IdempotencyConflict),
        SubmitPlan::NotActive => return SubmitAnswer::of(SubmitOutcome::ActivityNotActive),
        SubmitPlan::SoldOut => return SubmitAnswer::of(SubmitOutcome::SoldOut),
        SubmitPlan::Overloaded { retry_after_ms } => {
            return SubmitAnswer::retry(SubmitOutcome::Overloaded, u64::from(retry_after_ms))
        }
        SubmitPlan::CallRedis(permit) => permit,
    };
    // Fail closed before reserving anything: modes, the log, the backlog, PostgreSQL, Redis,
    // this shard's in-flight (admission.rs).
    if let Decision::Reject { outcome, retry_after_ms, reason } = admit(shard, s.key, now) {
        shard.with_partition(s.key, |p| p.release(permit));
        shard.metrics().count_admission_reject(reason);
        tracing::debug!(reason, "submission not admitted");
        return SubmitAnswer {
            reason_code: Some(Cow::Borrowed(reason)),
            ..SubmitAnswer::retry(outcome, retry_after_ms)
        };
    }
    let _in_flight = InFlight::enter(shard);
    let redis_call = match shard.redis_circuit.borrow_mut().allow(now) {
        Admit::Call(call) => call,
        Admit::Reject { retry_after_ms } => {
            shard.with_partition(s.key, |p| p.release(permit));
            return SubmitAnswer::retry(SubmitOutcome::SystemBusy, retry_after_ms);
        }
    };
    let (reservation_id, message_id) = shard.next_ids(now);
    let span = tracing::Span::current();
    span.record("reservation_id", reservation_id.as_str());
    span.record("message_id", message_id.as_str());
    let keys = shard.sku_keys(s.key);
    let args = ReserveArgs {
        request_id: s.request_id,
        user_id: s.user_id.0,
        payload_hash: &s.payload_hash,
        reservation_id: &reservation_id,
        message_id: &message_id,
        now_ms: now,
        pending_grace_ms: shard.config().pending_grace_ms,
    };
    let started = Instant::now();
    let result = shard.functions.reserve(&keys, &args).await;
    shard.metrics().lua_latency.observe_ns(started.elapsed().as_nanos() as u64);
    let health = match &result {
        Ok(_) => CallOutcome::Success,
        Err(e) if e.outcome_unknown() => CallOutcome::Unknown,
        Err(_) => CallOutcome::Failure,
    };
    {
        let mut circuit = shard.redis_circuit.borrow_mut();
        circuit.record(redis_call, health, now_ms());
        shard
            .metrics()
            .redis_circuit
            .store(u64::from(circuit.state(now_ms()).metric_value()), Ordering::Relaxed);
    }
    let (seen, answer) =
        classify_reserve(shard, &result, &reservation_id, &message_id, &s.payload_hash);
    // The untracked bucket shares admission only: never let one SKU's stock flip it.
    let seen = if tracked { seen } else { ReserveSeen::Other };
    // Both borrows end here, before any await.
    let update = {
        let mut budget = shard.accepted_budget.borrow_mut();
        shard.with_partition(s.key, |p| p.on_reserve(permit, s.request_id, seen, &mut budget))
    };
    if let Some(update) = update {
        shard.broadcast(update);
    }
    match (&result, answer) {
        (Ok(ReserveReply::Created { .. }), Some(_)) => {}
        (_, Some(answer)) => return answer,
        (_, None) => return SubmitAnswer::of(SubmitOutcome::Unknown),
    }
    #[cfg(feature = "failpoints")]
    fail::fail_point!("after_reserve_created");
    // CREATED: publish the order-create message (same ids forever after).
    let message = OrderCreate {
        schema_version: SCHEMA_VERSION,
        event_type: ORDER_CREATE_EVENT_TYPE.to_owned(),
        message_id: message_id.as_str().to_owned(),
        message_key: reservation_id.as_str().to_owned(),
        request_id: s.request_id.to_owned(),
        reservation_id: reservation_id.as_str().to_owned(),
        activity_id: s.key.activity_id,
        sku_id: s.key.sku_id,
        user_id: s.user_id.0,
        quantity: 1,
        reserved_at_ms: now,
        reservation_expires_at_ms: now + reservation_ttl_ms(shard, s.key).await,
        retry_count: 0,
        payload_hash: s.payload_hash.as_str().to_owned(),
        traceparent: s.traceparent.map(str::to_owned),
        created_at_ms: now,
    };
    let reservation: Arc<str> = Arc::from(reservation_id.as_str());
    let queued = publish_and_mark(shard, &keys, message).await;
    if queued {
        shard.with_partition(s.key, |p| p.on_queued(s.request_id));
    }
    SubmitAnswer {
        reservation_id: Some(reservation),
        ..SubmitAnswer::of(if queued {
            SubmitOutcome::Queued
        } else {
            SubmitOutcome::QueuedPending
        })
    }
}

/// `decide_submit` over this shard's view of the world.
fn admit(shard: &Shard, key: SkuKey, now: u64) -> Decision {
    let shared = &shard.shared;
    let mode = shard.modes.borrow_mut().effective(&shared.modes, key.activity_id, key.sku_id, now);
    let input = AdmissionInput {
        mode,
        redis: shard.redis_circuit.borrow().state(now),
        log_publish: shard.publish_circuit.borrow().state(now),
        backlog: shared.health.backlog(),
        pg_outage_age_ms: shared.health.pg_outage_age_ms(now),
        in_flight: shard.submits_in_flight.get(),
        in_flight_max: shard.config().submit_in_flight_max,
        draw: rand::random(),
    };
    decide_submit(&input, &shard.config().admission, now)
}

/// Counts an owner-side submission from admission to its answer.
struct InFlight<'a>(&'a Shard);

impl<'a> InFlight<'a> {
    fn enter(shard: &'a Shard) -> InFlight<'a> {
        shard.submits_in_flight.set(shard.submits_in_flight.get() + 1);
        InFlight(shard)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.submits_in_flight.set(self.0.submits_in_flight.get().saturating_sub(1));
    }
}

/// The reservation TTL stamped into the message: the SKU's `meta.reservation_ttl_ms` (what
/// `reserve` used for the record), read once per SKU and shard; the configured default when
/// Redis cannot say.
async fn reservation_ttl_ms(shard: &Shard, key: SkuKey) -> u64 {
    if let Some(ttl) = shard.ttl_cache.borrow().get(&key) {
        return *ttl;
    }
    let keys = shard.sku_keys(key);
    let reply = shard
        .functions
        .client()
        .command(&[b"HGET", keys.meta().as_bytes(), b"reservation_ttl_ms"])
        .await;
    match reply.ok().and_then(|r| r.as_str().and_then(|s| s.parse::<u64>().ok())) {
        Some(ttl) => {
            let mut cache = shard.ttl_cache.borrow_mut();
            if cache.len() < shard.config().skus_tracked_max {
                cache.insert(key, ttl);
            }
            ttl
        }
        None => shard.config().reservation_ttl_ms_default,
    }
}

/// Maps `reserve`'s reply to what the partition learns and what the client gets. `None` as
/// the answer means "CREATED: publish first".
fn classify_reserve(
    shard: &Shard,
    result: &Result<ReserveReply, ScriptError>,
    reservation_id: &str,
    message_id: &str,
    payload_hash: &PayloadHash,
) -> (ReserveSeen, Option<SubmitAnswer>) {
    let accepted = |state| Accepted {
        reservation_id: Arc::from(reservation_id),
        message_id: Arc::from(message_id),
        payload_hash: Arc::from(payload_hash.as_str()),
        state,
    };
    match result {
        Ok(ReserveReply::Created { stock_after }) => {
            let entry = accepted(AcceptedState::QueuedPending);
            let seen = if *stock_after == 0 {
                ReserveSeen::AcceptedLast(entry)
            } else {
                ReserveSeen::Accepted(entry)
            };
            (seen, Some(SubmitAnswer::of(SubmitOutcome::QueuedPending)))
        }
        Ok(ReserveReply::Idempotent { reservation_id, message_id, state, .. }) => {
            let accepted_state = match state {
                RequestState::QueuedPending => AcceptedState::QueuedPending,
                // Queued, and later outcomes: the first answer was QUEUED.
                _ => AcceptedState::Queued,
            };
            let entry = Accepted {
                reservation_id: Arc::from(reservation_id.as_str()),
                message_id: Arc::from(message_id.as_str()),
                payload_hash: Arc::from(payload_hash.as_str()),
                state: accepted_state,
            };
            let answer = SubmitAnswer::replay(&entry);
            (ReserveSeen::Accepted(entry), Some(answer))
        }
        Ok(ReserveReply::SoldOut) => {
            (ReserveSeen::SoldOut, Some(SubmitAnswer::of(SubmitOutcome::SoldOut)))
        }
        Ok(ReserveReply::DuplicateUser { reservation_id }) => (
            ReserveSeen::Other,
            Some(SubmitAnswer {
                reservation_id: Some(Arc::from(reservation_id.as_str())),
                ..SubmitAnswer::of(SubmitOutcome::DuplicateUser)
            }),
        ),
        Ok(ReserveReply::ActivityInvalid { .. }) => {
            (ReserveSeen::Other, Some(SubmitAnswer::of(SubmitOutcome::ActivityNotActive)))
        }
        Ok(ReserveReply::IdempotencyConflict) => {
            (ReserveSeen::Other, Some(SubmitAnswer::of(SubmitOutcome::IdempotencyConflict)))
        }
        Err(e) if e.outcome_unknown() => {
            tracing::warn!(error = %e, "reserve outcome unknown");
            (ReserveSeen::Other, Some(SubmitAnswer::of(SubmitOutcome::Unknown)))
        }
        Err(e) => {
            tracing::warn!(error = %e, "reserve not executed");
            (
                ReserveSeen::Other,
                Some(SubmitAnswer::retry(SubmitOutcome::SystemBusy, shard.config().busy_retry_ms)),
            )
        }
    }
}

/// Publishes an order-create message (first time or republish: the same message id) and, on
/// the log's ack, marks the reservation sent. True when the log acknowledged in time.
pub(crate) async fn publish_and_mark(
    shard: &Shard,
    keys: &flashsale_io::redis::script::SkuKeys,
    message: OrderCreate,
) -> bool {
    let reservation_id = message.reservation_id.clone();
    let request_id = message.request_id.clone();
    // An open circuit skips the publish (the reservation stays pending for the scanner);
    // half-open admits a few probes, whose outcome closes or re-opens it.
    let call = match shard.publish_circuit.borrow_mut().allow(now_ms()) {
        Admit::Call(call) => call,
        Admit::Reject { .. } => return false,
    };
    let published = publish(shard, message).await;
    let outcome = if published { CallOutcome::Success } else { CallOutcome::Failure };
    {
        let mut circuit = shard.publish_circuit.borrow_mut();
        circuit.record(call, outcome, now_ms());
        let state = u64::from(circuit.state(now_ms()).metric_value());
        shard.metrics().publish_circuit.store(state, Ordering::Relaxed);
    }
    if !published {
        return false;
    }
    #[cfg(feature = "failpoints")]
    fail::fail_point!("after_publish_ack");
    let mark = MarkSentArgs {
        reservation_id: &reservation_id,
        request_id: &request_id,
        now_ms: now_ms(),
        order_deadline_ms: shard.config().order_deadline_ms,
    };
    // Best effort: the message is durable either way; a failed mark only means the scanner
    // republishes later (deduplicated by message id).
    let retry = &shard.config().idempotent_retry;
    let _ = super::retry_idempotent(retry, || shard.functions.mark_sent(keys, &mark)).await;
    true
}

/// Publishes through the durable side; true when the log acknowledged within the wait.
async fn publish(shard: &Shard, message: OrderCreate) -> bool {
    let (tx, rx) = oneshot::channel();
    let request = DurableRequest::Publish { message: Box::new(message), reply: tx };
    if shard.shared.durable.try_send(request).is_err() {
        shard.metrics().publish_error.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    let wait = Duration::from_millis(shard.config().publish_wait_ms);
    match glommio::timer::timeout(wait, async { Ok(rx.await) }).await {
        Ok(Ok(Ok(_ack))) => {
            shard.metrics().publish_ok.fetch_add(1, Ordering::Relaxed);
            true
        }
        Ok(_) => {
            shard.metrics().publish_error.fetch_add(1, Ordering::Relaxed);
            false
        }
        Err(_) => {
            shard.metrics().publish_timeout.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

// ---- query --------------------------------------------------------------------------------

pub async fn handle_query(
    shard: &Rc<Shard>,
    request: &Request<'_>,
    path_id: &str,
    head: &mut ResponseHead<'_>,
    out: &mut BytesMut,
) {
    let (outcome, answer) = query(shard, request, path_id).await;
    shard.metrics().count_query(outcome);
    let (code, state) = outcome.http();
    head.status = Status::from_code(code).unwrap_or(Status::InternalServerError);
    let body = StateBody {
        request_id: answer.request_id.as_deref(),
        state,
        reservation_id: answer.reservation_id.as_deref(),
        order_id: answer.order_id.as_deref(),
        reason_code: answer.reason_code.as_deref(),
        retry_after_ms: None,
        replayed: false,
    };
    write_state(out, head, &body);
}

#[derive(Default)]
struct QueryAnswer {
    request_id: Option<String>,
    reservation_id: Option<String>,
    order_id: Option<String>,
    reason_code: Option<String>,
}

async fn query(
    shard: &Rc<Shard>,
    request: &Request<'_>,
    path_id: &str,
) -> (QueryOutcome, QueryAnswer) {
    let now = now_ms();
    let none = QueryAnswer::default;
    let Some(auth) = request.authorization else { return (QueryOutcome::Unauthorized, none()) };
    let Ok(pass) = shard.shared.pass_keys.verify(auth.as_bytes(), now / 1000) else {
        return (QueryOutcome::Unauthorized, none());
    };
    let q = match api::parse_query(path_id, request.query.unwrap_or("")) {
        Ok(q) => q,
        Err(invalid) => {
            return (
                QueryOutcome::Invalid,
                QueryAnswer { reason_code: Some(invalid.reason_code().to_owned()), ..none() },
            )
        }
    };
    if !pass.authorizes(q.activity_id) {
        return (QueryOutcome::Unauthorized, none());
    }
    let request_id = q.request_id.as_str().to_owned();
    let key = SkuKey::new(q.activity_id.0, q.sku_id.0);
    let keys = shard.sku_keys(key);
    let redis_known = match keys.req(&request_id) {
        Ok(req_key) => {
            let fields: [&[u8]; 7] = [
                b"HMGET",
                req_key.as_bytes(),
                b"state",
                b"reservation_id",
                b"order_id",
                b"reason_code",
                b"user_id",
            ];
            let client = shard.functions.client();
            let retry = &shard.config().idempotent_retry;
            let reply = super::retry_idempotent(retry, || client.command(&fields)).await;
            match reply {
                Ok(Reply::Array(fields)) if fields.len() == 5 => {
                    let text =
                        |i: usize| fields[i].as_str().filter(|s| !s.is_empty()).map(str::to_owned);
                    match (text(0), text(4)) {
                        (Some(state), Some(owner)) => {
                            if owner != pass.user_id.0.to_string() {
                                // Someone else's request: indistinguishable from absent.
                                return (
                                    QueryOutcome::NotFound,
                                    QueryAnswer { request_id: Some(request_id), ..none() },
                                );
                            }
                            let outcome = match state.as_str() {
                                "SUCCEEDED" => QueryOutcome::Succeeded,
                                "FAILED" => QueryOutcome::Failed,
                                _ => QueryOutcome::Queuing,
                            };
                            return (
                                outcome,
                                QueryAnswer {
                                    request_id: Some(request_id),
                                    reservation_id: text(1),
                                    order_id: text(2),
                                    reason_code: text(3),
                                },
                            );
                        }
                        // No record (all nil): a miss.
                        _ => true,
                    }
                }
                _ => false,
            }
        }
        Err(_) => false,
    };
    // Redis missed (or could not be asked): PostgreSQL.
    let wait = Duration::from_millis(shard.config().query_fallback_wait_ms);
    let durable = shard.shared.durable.clone();
    let lookup = durable.call(|reply| DurableRequest::FindReservation {
        activity_id: key.activity_id as i64,
        sku_id: key.sku_id as i64,
        user_id: pass.user_id.0 as i64,
        request_id: request_id.clone(),
        reply,
    });
    let found: Result<_, DurableError> =
        match glommio::timer::timeout(wait, async { Ok(lookup.await) }).await {
            Ok(result) => result,
            Err(_) => Err(DurableError::Timeout),
        };
    match found {
        Ok(Some(record)) => {
            let (outcome, reason) = match record.status.as_str() {
                "ORDER_CREATED" => (QueryOutcome::Succeeded, None),
                "PROCESSING" => (QueryOutcome::Queuing, None),
                other => {
                    (QueryOutcome::Failed, Some(other.trim_start_matches("REJECTED_").to_owned()))
                }
            };
            let reason =
                reason.map(|r| if r == "ACTIVITY" { "ACTIVITY_TERMINATED".to_owned() } else { r });
            (
                outcome,
                QueryAnswer {
                    request_id: Some(request_id),
                    reservation_id: Some(record.reservation_id),
                    order_id: record.order_id,
                    reason_code: reason,
                },
            )
        }
        // Both stores answered and neither knows it.
        Ok(None) if redis_known => {
            (QueryOutcome::NotFound, QueryAnswer { request_id: Some(request_id), ..none() })
        }
        // A store that might know could not be asked: never NOT_FOUND.
        Ok(None) | Err(_) => {
            (QueryOutcome::Unknown, QueryAnswer { request_id: Some(request_id), ..none() })
        }
    }
}
