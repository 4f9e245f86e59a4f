//! The reservation flow on a shard (DESIGN.md sections 1, 3.1, 4; CONTRACT.md 3.2):
//!
//! 1. on the shard that accepted the connection: the address limit, pass → user (never from
//!    the body), body → request, activity must match the pass, the user limit;
//! 2. the SKU's replica: sold out → `SOLD_OUT` (or the replay) right here, no Redis, no hop;
//! 3. otherwise the owner shard (here, or over the bounded mesh; full → `OVERLOADED`), which
//!    only does I/O between the sans-I/O calls of `logic::submit`: `begin` (plan, admission,
//!    the Redis circuit, ids), `FCALL reserve`, `finish`, then [`super::publish`] for a
//!    `CREATED` reservation and `on_published`.
//!
//! Not here: the query flow ([`super::query`]), the decisions (`logic::submit`).

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::BytesMut;
use flashsale_io::redis::script::{RequestState, ReserveArgs, ReserveReply, ScriptError};
use futures::channel::oneshot;

use super::conn::RequestCtx;
use super::publish::{publish_order, MsgIdentity, Origin};
use super::Shard;
use crate::http::{write_response, Request, ResponseHead, StateBody, Status};
use crate::logic::api::{self, PayloadHash};
use crate::logic::clock::now_ms;
use crate::logic::ids::UserId;
use crate::logic::limiter;
use crate::logic::outcome::SubmitOutcome;
use crate::logic::partition::{AcceptedState, FastPath};
use crate::logic::placement::SkuKey;
use crate::logic::submit::{Begin, Outside, ReserveResult, SubmitAnswer, SubmitRequest};

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
pub(super) fn write_state(out: &mut BytesMut, head: &ResponseHead<'_>, body: &StateBody<'_>) {
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
    if let Err(retry_ms) = shard.check_address(ctx.peer_ip, now) {
        return (SubmitAnswer::retry(SubmitOutcome::RateLimited, retry_ms), None);
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
        replica.map_or(FastPath::Forward, |r| r.fast_path(user_id.0, request_id, &payload_hash))
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
    let owner = shard.shared.table.owner(key);
    if owner == shard.id {
        let owned = SubmitRequest {
            key,
            request_id,
            user_id,
            payload_hash: &payload_hash,
            traceparent: request.traceparent,
        };
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

pub async fn owner_forwarded(shard: &Rc<Shard>, forwarded: ForwardedSubmit) {
    let owned = SubmitRequest {
        key: forwarded.key,
        request_id: &forwarded.request_id,
        user_id: UserId(forwarded.user_id),
        payload_hash: &forwarded.payload_hash,
        traceparent: forwarded.traceparent.as_deref(),
    };
    let answer = owner_submit(shard, &owned).await;
    let _ = forwarded.reply.send(answer);
}

/// The owner shard's part, inside a span carrying the business ids (never metric labels;
/// the user id only hashed).
async fn owner_submit(shard: &Rc<Shard>, s: &SubmitRequest<'_>) -> SubmitAnswer {
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

/// `begin`, `reserve`, `finish`, and for a fresh reservation the publish: I/O only between
/// the decisions, each decision one borrow of the owner state.
async fn owner_submit_inner(shard: &Rc<Shard>, s: &SubmitRequest<'_>) -> SubmitAnswer {
    let now = now_ms();
    let outside = outside(shard, s.key, now);
    let keys = shard.sku_keys(s.key);
    let node = shard.functions.router().node_of(keys.slot());
    let call = match shard.owner.borrow_mut().begin(s, node, &outside, now) {
        Begin::Answer { answer, admission_reject } => {
            if let Some(reason) = admission_reject {
                shard.metrics().count_admission_reject(reason);
                tracing::debug!(reason, "submission not admitted");
            }
            return answer;
        }
        Begin::Call(call) => call,
    };
    let span = tracing::Span::current();
    span.record("reservation_id", call.reservation_id.as_str());
    span.record("message_id", call.message_id.as_str());
    let args = ReserveArgs {
        request_id: s.request_id,
        user_id: s.user_id.0,
        payload_hash: s.payload_hash.as_str(),
        reservation_id: &call.reservation_id,
        message_id: &call.message_id,
        now_ms: now,
        pending_grace_ms: shard.config().pending_grace_ms,
    };
    let started = Instant::now();
    let reply = shard.functions.reserve(&keys, &args).await;
    shard.metrics().lua_latency.observe_ns(started.elapsed().as_nanos() as u64);
    let finish = shard.owner.borrow_mut().finish(call, s, reserve_result(reply), now);
    let circuit = u64::from(finish.redis_circuit.metric_value());
    shard.metrics().redis_circuit.store(circuit, Ordering::Relaxed);
    if let Some(update) = finish.replica {
        let sold_out = update.sold_out;
        shard.broadcast(update);
        if sold_out {
            super::replays::ensure_loaded(shard, s.key);
        }
    }
    let Some(message) = finish.publish else { return finish.answer };
    #[cfg(feature = "failpoints")]
    fail::fail_point!("after_reserve_created");
    let published =
        publish_order(shard, &keys, message, MsgIdentity::Original, Origin::Submit).await;
    shard.owner.borrow_mut().on_published(s, finish.answer, published)
}

/// Admission's inputs that live outside the owner state.
fn outside(shard: &Shard, key: SkuKey, now: u64) -> Outside {
    let shared = &shard.shared;
    Outside {
        mode: shard.modes.borrow_mut().effective(&shared.modes, key.activity_id, key.sku_id, now),
        log_publish: shard.publish_circuit.borrow().state(now),
        backlog: shared.health.backlog(),
        pg_outage_age_ms: shared.health.pg_outage_age_ms(now),
        draw: rand::random(),
    }
}

/// The script binding's answer as the decision needs it.
/// The first answer a request got, from its state in Redis now: `QUEUED_PENDING` stays, any
/// later state means the first answer was `QUEUED` (replays of `IDEMPOTENT`, and the replay
/// map loaded after sell-out, `replays.rs`).
pub(super) fn first_answer(state: RequestState) -> AcceptedState {
    match state {
        RequestState::QueuedPending => AcceptedState::QueuedPending,
        _ => AcceptedState::Queued,
    }
}

fn reserve_result(reply: Result<ReserveReply, ScriptError>) -> ReserveResult {
    match reply {
        Ok(ReserveReply::Created { stock_after, expires_at_ms }) => {
            ReserveResult::Created { stock_after, expires_at_ms }
        }
        Ok(ReserveReply::Idempotent { reservation_id, message_id, state, .. }) => {
            let first = first_answer(state);
            ReserveResult::Idempotent { reservation_id, message_id, first }
        }
        Ok(ReserveReply::SoldOut) => ReserveResult::SoldOut,
        Ok(ReserveReply::DuplicateUser { reservation_id }) => {
            ReserveResult::DuplicateUser { reservation_id }
        }
        Ok(ReserveReply::ActivityInvalid { .. }) => ReserveResult::ActivityInvalid,
        Ok(ReserveReply::IdempotencyConflict) => ReserveResult::IdempotencyConflict,
        Err(e) if e.is_refusal() => {
            // The edge's bounds are the library's (io/src/bounds.rs): reaching this is a bug
            // between the two, so it is loud; it is still the buyer's answer, not the node's.
            tracing::error!(error = %e, "reserve refused an argument the edge accepted");
            ReserveResult::Refused
        }
        Err(e) if e.outcome_unknown() => {
            tracing::warn!(error = %e, "reserve outcome unknown");
            ReserveResult::Unknown
        }
        Err(e) => {
            tracing::warn!(error = %e, "reserve not executed");
            ReserveResult::NotRun
        }
    }
}
