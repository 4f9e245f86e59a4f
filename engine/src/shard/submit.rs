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

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::BytesMut;
use flashsale_io::redis::layout::{ActivityStatus, SoldOutReads};
use flashsale_io::redis::script::{
    ActivityInvalidReason, ReserveArgs, ReserveReply, ScriptError, SkuKeys,
};
use futures::channel::oneshot;

use super::limiters::Limiters;
use super::mesh::{ForwardedSubmit, Mesh};
use super::publish::{publish_order, MsgIdentity, Origin, PublishPath};
use super::replays::{ensure_loaded, first_answer, first_answer_of};
use super::reply::write_state;
use super::request::RequestCtx;
use super::shared::EdgeShared;
use super::state::Shard;
use super::store::Store;
use crate::durable::modes::ShardModes;
use crate::http::{Request, ResponseHead, StateBody, Status};
use crate::logic::api;
use crate::logic::clock::now_ms;
use crate::logic::ids::UserId;
use crate::logic::limiter;
use crate::logic::metrics::ShardMetrics;
use crate::logic::outcome::SubmitOutcome;
use crate::logic::overload::Permit as PathPermit;
use crate::logic::partition::FastPath;
use crate::logic::placement::SkuKey;
use crate::logic::submit::{
    Begin, Call, Outside, OwnerState, ReserveResult, SubmitAnswer, SubmitRequest,
};

/// What a submission touches (issue 22: a handler says what it uses): the limiters, the
/// replicas and the mesh, as owner the owner state, Redis and the publish path, the modes,
/// and the shared edge state (pass keys, partition table, health, configuration, metrics).
pub struct SubmitDeps<'a> {
    pub id: usize,
    pub shared: &'a EdgeShared,
    pub limiters: &'a Limiters,
    pub mesh: &'a Rc<Mesh>,
    pub owner: &'a Rc<RefCell<OwnerState>>,
    pub store: &'a Rc<Store>,
    pub modes: &'a RefCell<ShardModes>,
    pub publish: &'a Rc<PublishPath>,
}

impl<'a> SubmitDeps<'a> {
    pub fn of(shard: &'a Shard) -> SubmitDeps<'a> {
        SubmitDeps {
            id: shard.id,
            shared: &shard.shared,
            limiters: &shard.limiters,
            mesh: &shard.mesh,
            owner: &shard.owner,
            store: &shard.store,
            modes: &shard.modes,
            publish: &shard.publish,
        }
    }

    fn metrics(&self) -> &ShardMetrics {
        self.shared.shard_metrics(self.id)
    }
}

pub async fn handle_submit(
    deps: &SubmitDeps<'_>,
    request: &Request<'_>,
    body: &[u8],
    ctx: &RequestCtx,
    head: &mut ResponseHead<'_>,
    out: &mut BytesMut,
) {
    let (answer, request_id) = submit(deps, request, body, ctx).await;
    deps.metrics().count_submit(answer.outcome);
    let (status, body) = answer_body(&answer, request_id);
    head.status = status;
    head.retry_after_ms = answer.retry_after_ms;
    write_state(out, head, &body);
}

/// A submission's answer as HTTP: its status and its JSON body (the benches write it so too).
pub fn answer_body<'a>(
    answer: &'a SubmitAnswer,
    request_id: Option<&'a str>,
) -> (Status, StateBody<'a>) {
    let (code, state) = answer.outcome.http();
    let body = StateBody {
        request_id,
        state,
        reservation_id: answer.reservation_id.as_deref(),
        order_id: None,
        reason_code: answer.reason_code.as_deref(),
        retry_after_ms: answer.retry_after_ms,
        replayed: answer.replayed,
    };
    (Status::from_code(code).unwrap_or(Status::InternalServerError), body)
}

/// The submit flow up to the answer; also returns the body's request id (borrowed) for the
/// response.
async fn submit<'b>(
    deps: &SubmitDeps<'_>,
    request: &Request<'_>,
    body: &'b [u8],
    ctx: &RequestCtx,
) -> (SubmitAnswer, Option<&'b str>) {
    let now = now_ms();
    if let Err(retry_ms) = deps.limiters.check_address(ctx.peer_ip, now) {
        return (SubmitAnswer::retry(SubmitOutcome::RateLimited, retry_ms), None);
    }
    let Some(auth) = request.authorization else {
        return (SubmitAnswer::of(SubmitOutcome::Unauthorized), None);
    };
    let pass = match deps.shared.pass_keys.verify(auth.as_bytes(), now / 1000) {
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
    if let Err(retry_ms) = deps.limiters.check_submitter(pass.user_id.0, now) {
        return (SubmitAnswer::retry(SubmitOutcome::RateLimited, retry_ms), Some(request_id));
    }
    let answer = submit_checked(deps, request, &submit, pass.user_id).await;
    let key = SkuKey::new(submit.activity_id.0, submit.sku_id.0);
    deps.shared.sku_funnel.count_answer(deps.id, key, answer.outcome);
    (answer, Some(request_id))
}

async fn submit_checked(
    deps: &SubmitDeps<'_>,
    request: &Request<'_>,
    submit: &api::SubmitRequest<'_>,
    user_id: UserId,
) -> SubmitAnswer {
    let key = SkuKey::new(submit.activity_id.0, submit.sku_id.0);
    let payload_hash = submit.payload_hash(user_id);
    let request_id = submit.request_id.as_str();
    // After sell-out: answered on this core.
    let fast = deps.mesh.with_replica(key, |replica| {
        replica.map_or(FastPath::Forward, |r| r.fast_path(user_id.0, request_id, &payload_hash))
    });
    match fast {
        FastPath::SoldOut => {
            deps.metrics().sold_out_fast_path.fetch_add(1, Ordering::Relaxed);
            return SubmitAnswer::of(SubmitOutcome::SoldOut);
        }
        FastPath::Replay(entry) => {
            deps.metrics().sold_out_fast_path.fetch_add(1, Ordering::Relaxed);
            return SubmitAnswer::replay(&entry);
        }
        FastPath::Conflict => return SubmitAnswer::of(SubmitOutcome::IdempotencyConflict),
        FastPath::Forward => {}
    }
    let owner = deps.shared.table.owner(key);
    if owner == deps.id {
        let owned = SubmitRequest {
            key,
            request_id,
            user_id,
            quantity: submit.quantity,
            payload_hash: &payload_hash,
            traceparent: request.traceparent,
        };
        return owner_submit(deps, &owned).await;
    }
    let (tx, rx) = oneshot::channel();
    let forwarded = Box::new(ForwardedSubmit {
        key,
        request_id: request_id.into(),
        user_id: user_id.0,
        quantity: submit.quantity,
        payload_hash,
        traceparent: request.traceparent.map(Into::into),
        reply: tx,
    });
    if deps.mesh.forward(owner, forwarded).is_err() {
        deps.metrics().mesh_full.fetch_add(1, Ordering::Relaxed);
        return SubmitAnswer::retry(
            SubmitOutcome::Overloaded,
            deps.shared.config.overloaded_retry_ms,
        );
    }
    deps.metrics().forwarded.fetch_add(1, Ordering::Relaxed);
    // The owner always answers (its flow is bounded by Redis and publish deadlines); a
    // dropped reply means it stopped mid-request, so the outcome is unknown.
    rx.await.unwrap_or_else(|_| SubmitAnswer::of(SubmitOutcome::Unknown))
}

pub async fn owner_forwarded(deps: &SubmitDeps<'_>, forwarded: ForwardedSubmit) {
    let owned = SubmitRequest {
        key: forwarded.key,
        request_id: &forwarded.request_id,
        user_id: UserId(forwarded.user_id),
        quantity: forwarded.quantity,
        payload_hash: &forwarded.payload_hash,
        traceparent: forwarded.traceparent.as_deref(),
    };
    let answer = owner_submit(deps, &owned).await;
    let _ = forwarded.reply.send(answer);
}

/// The owner shard's part, inside a span carrying the business ids (never metric labels;
/// the user id only hashed).
async fn owner_submit(deps: &SubmitDeps<'_>, s: &SubmitRequest<'_>) -> SubmitAnswer {
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
    owner_submit_inner(deps, s).instrument(span).await
}

/// `begin`, then the expensive path (`reserve`, `finish`, the publish) with its place under
/// the adaptive limit, which learns the path's latency when the answer is known.
async fn owner_submit_inner(deps: &SubmitDeps<'_>, s: &SubmitRequest<'_>) -> SubmitAnswer {
    let now = now_ms();
    let outside = outside(deps, s.key, now);
    let keys = deps.store.sku_keys(s.key);
    let node = deps.store.functions.router().node_of(keys.slot());
    let call = match deps.owner.borrow_mut().begin(s, node, &outside, now) {
        Begin::Answer { answer, admission_reject } => {
            if let Some(reason) = admission_reject {
                deps.metrics().count_admission_reject(reason);
                tracing::debug!(reason, "submission not admitted");
            }
            return answer;
        }
        Begin::Call(call) => call,
    };
    let started = Instant::now();
    let (answer, path) = expensive_path(deps, s, &keys, call, now).await;
    let latency_ns = started.elapsed().as_nanos() as u64;
    deps.metrics().path_latency.observe_ns(latency_ns);
    deps.owner.borrow_mut().path_done(path, latency_ns / 1_000);
    answer
}

/// `reserve`'s arguments for the owner's call (the `owner_path` bench builds them here too).
pub fn reserve_args<'a>(
    s: &SubmitRequest<'a>,
    call: &'a Call,
    now_ms: u64,
    pending_grace_ms: u64,
) -> ReserveArgs<'a> {
    ReserveArgs {
        request_id: s.request_id,
        user_id: s.user_id.0,
        payload_hash: s.payload_hash.as_str(),
        reservation_id: &call.reservation_id,
        message_id: &call.message_id,
        now_ms,
        pending_grace_ms,
        quantity: s.quantity,
    }
}

/// `reserve`, `finish`, and for a fresh reservation the publish: I/O only between the
/// decisions, each decision one borrow of the owner state.
async fn expensive_path(
    deps: &SubmitDeps<'_>,
    s: &SubmitRequest<'_>,
    keys: &Rc<SkuKeys>,
    call: Call,
    now: u64,
) -> (SubmitAnswer, PathPermit) {
    let span = tracing::Span::current();
    span.record("reservation_id", call.reservation_id.as_str());
    span.record("message_id", call.message_id.as_str());
    let args = reserve_args(s, &call, now, deps.shared.config.pending_grace_ms);
    let result = if call.sold_out_reads {
        let reads = deps.store.functions.sold_out_reads(keys, s.user_id.0, s.request_id).await;
        sold_out_result(reads, s.payload_hash.as_str(), s.quantity)
    } else {
        let started = Instant::now();
        let reply = deps.store.functions.reserve(keys, &args).await;
        deps.metrics().lua_latency.observe_ns(started.elapsed().as_nanos() as u64);
        reserve_result(reply)
    };
    let finish = deps.owner.borrow_mut().finish(call, s, result, now);
    if finish.data_lost {
        deps.metrics().redis_data_losses.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            activity_id = s.key.activity_id,
            sku_id = s.key.sku_id,
            "redis data lost: reserve found no meta for a SKU on sale; closed until rebuilt \
            from PostgreSQL and reconciled"
        );
    }
    let circuit = u64::from(finish.redis_circuit.metric_value());
    deps.metrics().redis_circuit.store(circuit, Ordering::Relaxed);
    if let Some(update) = finish.replica {
        let sold_out = update.sold_out;
        deps.mesh.broadcast(update);
        if sold_out {
            ensure_loaded(deps.owner, deps.store, deps.mesh, s.key);
        }
    }
    let Some(message) = finish.publish else { return (finish.answer, finish.path) };
    #[cfg(feature = "failpoints")]
    fail::fail_point!("after_reserve_created");
    let published =
        publish_order(deps.publish, keys, message, MsgIdentity::Original, Origin::Submit).await;
    let answer = deps.owner.borrow_mut().on_published(s, finish.answer, published);
    (answer, finish.path)
}

/// Admission's inputs that live outside the owner state.
fn outside(deps: &SubmitDeps<'_>, key: SkuKey, now: u64) -> Outside {
    let shared = deps.shared;
    Outside {
        mode: deps.modes.borrow_mut().effective(&shared.modes, key.activity_id, key.sku_id, now),
        log_publish: deps.publish.circuit_state(now),
        backlog: shared.health.backlog(),
        pg_outage_age_ms: shared.health.pg_outage_age_ms(now),
        draw: rand::random(),
    }
}

/// A sold-out SKU's answer from its plain reads, in `reserve`'s order: the request's record
/// (`IDEMPOTENT` or `IDEMPOTENCY_CONFLICT`), `meta` (gone: the SKU's keys were lost; not
/// `ACTIVE`), the limit per buyer, the buyer's marker (`DUPLICATE_USER`), else `SOLD_OUT`.
/// A read that failed wrote nothing: not run.
fn sold_out_result(
    reads: Result<SoldOutReads, ScriptError>,
    payload_hash: &str,
    quantity: u32,
) -> ReserveResult {
    let reads = match reads {
        Ok(reads) => reads,
        Err(e) => {
            tracing::warn!(error = %e, "sold-out reads failed");
            return ReserveResult::NotRun;
        }
    };
    if let Some(r) = reads.replay {
        if r.payload_hash != payload_hash {
            return ReserveResult::IdempotencyConflict;
        }
        return ReserveResult::Idempotent {
            first: first_answer_of(&r.state),
            reservation_id: r.reservation_id,
            message_id: r.message_id,
        };
    }
    match reads.status.as_deref() {
        None => return ReserveResult::MetaMissing,
        Some(status) if status != ActivityStatus::Active.as_str() => {
            return ReserveResult::ActivityInvalid
        }
        Some(_) => {}
    }
    if u64::from(quantity) > reads.max_per_buyer.unwrap_or(1) {
        return ReserveResult::OverLimit;
    }
    match reads.marker {
        Some(reservation_id) => ReserveResult::DuplicateUser { reservation_id },
        None => ReserveResult::SoldOut,
    }
}

/// The script binding's answer as the decision needs it.
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
        Ok(ReserveReply::OverLimit { .. }) => ReserveResult::OverLimit,
        Ok(ReserveReply::FewerLeft { .. }) => ReserveResult::FewerLeft,
        Ok(ReserveReply::DuplicateUser { reservation_id }) => {
            ReserveResult::DuplicateUser { reservation_id }
        }
        Ok(ReserveReply::ActivityInvalid { reason: ActivityInvalidReason::Unknown }) => {
            ReserveResult::MetaMissing
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logic::partition::AcceptedState;
    use flashsale_io::redis::layout::ReplayRecord;

    fn reads(
        replay: Option<(&str, &str)>,
        status: Option<&str>,
        marker: Option<&str>,
    ) -> SoldOutReads {
        SoldOutReads {
            replay: replay.map(|(hash, state)| ReplayRecord {
                payload_hash: hash.into(),
                reservation_id: "resv_1".into(),
                message_id: "msg_1".into(),
                state: state.into(),
            }),
            status: status.map(str::to_owned),
            max_per_buyer: Some(2),
            marker: marker.map(str::to_owned),
        }
    }

    /// In `reserve`'s order: the record first (even when `meta` is gone or not ACTIVE), then
    /// `meta`, the limit, the marker, and only then SOLD_OUT.
    #[test]
    fn a_sold_out_skus_reads_answer_in_reserves_order() {
        let active = Some("ACTIVE");
        let answer = |r: SoldOutReads, quantity| sold_out_result(Ok(r), "h", quantity);
        assert_eq!(
            answer(reads(Some(("h", "QUEUED_PENDING")), None, Some("resv_1")), 1),
            ReserveResult::Idempotent {
                reservation_id: "resv_1".into(),
                message_id: "msg_1".into(),
                first: AcceptedState::QueuedPending,
            }
        );
        assert!(matches!(
            answer(reads(Some(("h", "SUCCEEDED")), active, None), 1),
            ReserveResult::Idempotent { first: AcceptedState::Queued, .. }
        ));
        assert_eq!(
            answer(reads(Some(("other", "QUEUED")), active, None), 1),
            ReserveResult::IdempotencyConflict
        );
        assert_eq!(answer(reads(None, None, Some("resv_1")), 1), ReserveResult::MetaMissing);
        assert_eq!(answer(reads(None, Some("ENDED"), None), 1), ReserveResult::ActivityInvalid);
        assert_eq!(answer(reads(None, active, Some("resv_1")), 3), ReserveResult::OverLimit);
        assert_eq!(
            answer(reads(None, active, Some("resv_9")), 2),
            ReserveResult::DuplicateUser { reservation_id: "resv_9".into() }
        );
        assert_eq!(answer(reads(None, active, None), 1), ReserveResult::SoldOut);
        let failed = sold_out_result(Err(ScriptError::Server("down".into())), "h", 1);
        assert_eq!(failed, ReserveResult::NotRun);
    }
}
