//! The query flow, `GET /v1/reservations/{request_id}` (CONTRACT.md 3.3): the buyer's own
//! request record in Redis, then, on a miss, PostgreSQL's reservation of the same buyer and
//! request id. It answers `UNKNOWN` — never `NOT_FOUND` — when a store that might know could
//! not be asked; another buyer's request id is indistinguishable from an absent one.
//!
//! Not here: the submit flow ([`super::submit`]).

use std::time::Duration;

use bytes::BytesMut;
use flashsale_io::redis::layout::RequestRecord;
use flashsale_pg_worker::reservation_lookup::{self, ReservationRecord};

use super::limiters::Limiters;
use super::reply::write_state;
use super::request::RequestCtx;
use super::retry::retry_idempotent;
use super::shared::EdgeShared;
use super::state::Shard;
use super::store::Store;
use crate::durable::DurableError;
use crate::http::{Request, ResponseHead, StateBody, Status};
use crate::logic::api;
use crate::logic::clock::now_ms;
use crate::logic::outcome::QueryOutcome;
use crate::logic::placement::SkuKey;

/// What a query touches: the limiters, this shard's Redis, the durable side (the PostgreSQL
/// fallback) and the shared edge state (pass keys, configuration, metrics).
pub struct QueryDeps<'a> {
    pub id: usize,
    pub shared: &'a EdgeShared,
    pub limiters: &'a Limiters,
    pub store: &'a Store,
}

impl<'a> QueryDeps<'a> {
    pub fn of(shard: &'a Shard) -> QueryDeps<'a> {
        QueryDeps {
            id: shard.id,
            shared: &shard.shared,
            limiters: &shard.limiters,
            store: &shard.store,
        }
    }
}

pub async fn handle_query(
    deps: &QueryDeps<'_>,
    request: &Request<'_>,
    ctx: &RequestCtx,
    path_id: &str,
    head: &mut ResponseHead<'_>,
    out: &mut BytesMut,
) {
    let (outcome, answer) = query(deps, request, ctx, path_id).await;
    deps.shared.shard_metrics(deps.id).count_query(outcome);
    let (code, state) = outcome.http();
    head.status = Status::from_code(code).unwrap_or(Status::InternalServerError);
    head.retry_after_ms = answer.retry_after_ms;
    let body = StateBody {
        request_id: answer.request_id.as_deref(),
        state,
        reservation_id: answer.reservation_id.as_deref(),
        order_id: answer.order_id.as_deref(),
        reason_code: answer.reason_code.as_deref(),
        retry_after_ms: answer.retry_after_ms,
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
    retry_after_ms: Option<u64>,
}

/// Who asks about what, once the pass and the path checked out.
struct Asked {
    key: SkuKey,
    user_id: u64,
    request_id: String,
}

/// What Redis said about the request.
enum RedisSays {
    Found(RequestRecord),
    /// Asked and answered: no record.
    Miss,
    /// Could not be asked.
    Unreachable,
}

async fn query(
    deps: &QueryDeps<'_>,
    request: &Request<'_>,
    ctx: &RequestCtx,
    path_id: &str,
) -> (QueryOutcome, QueryAnswer) {
    let asked = match authorize(deps, request, ctx, path_id) {
        Ok(asked) => asked,
        Err(refused) => return refused,
    };
    let redis_says = read_redis(deps, &asked).await;
    if let RedisSays::Found(record) = redis_says {
        return from_redis(record, asked);
    }
    match read_postgres(deps, &asked).await {
        Ok(Some(record)) => from_postgres(record, asked.request_id),
        // Both stores answered and neither knows it.
        Ok(None) if matches!(redis_says, RedisSays::Miss) => (
            QueryOutcome::NotFound,
            QueryAnswer { request_id: Some(asked.request_id), ..QueryAnswer::default() },
        ),
        // A store that might know could not be asked: never NOT_FOUND.
        Ok(None) | Err(_) => (
            QueryOutcome::Unknown,
            QueryAnswer { request_id: Some(asked.request_id), ..QueryAnswer::default() },
        ),
    }
}

/// The address limit, the pass, the user's read limit, the path and the query string; the
/// user comes from the pass only.
fn authorize(
    deps: &QueryDeps<'_>,
    request: &Request<'_>,
    ctx: &RequestCtx,
    path_id: &str,
) -> Result<Asked, (QueryOutcome, QueryAnswer)> {
    let now = now_ms();
    let limited = |retry_ms| {
        let answer = QueryAnswer { retry_after_ms: Some(retry_ms), ..QueryAnswer::default() };
        (QueryOutcome::RateLimited, answer)
    };
    deps.limiters.check_address(ctx.peer_ip, now).map_err(limited)?;
    let unauthorized = || (QueryOutcome::Unauthorized, QueryAnswer::default());
    let auth = request.authorization.ok_or_else(unauthorized)?;
    let verified = deps.shared.pass_keys.verify(auth.as_bytes(), now / 1000);
    let pass = verified.map_err(|_| unauthorized())?;
    deps.limiters.check_reader(pass.user_id.0, now).map_err(limited)?;
    let q = api::parse_query(path_id, request.query.unwrap_or("")).map_err(|invalid| {
        let answer = QueryAnswer {
            reason_code: Some(invalid.reason_code().to_owned()),
            ..QueryAnswer::default()
        };
        (QueryOutcome::Invalid, answer)
    })?;
    if !pass.authorizes(q.activity_id) {
        return Err(unauthorized());
    }
    Ok(Asked {
        key: SkuKey::new(q.activity_id.0, q.sku_id.0),
        user_id: pass.user_id.0,
        request_id: q.request_id.as_str().to_owned(),
    })
}

async fn read_redis(deps: &QueryDeps<'_>, asked: &Asked) -> RedisSays {
    let keys = deps.store.sku_keys(asked.key);
    let retry = &deps.shared.config.idempotent_retry;
    let read = retry_idempotent(retry, || {
        deps.store.functions.read_request(&keys, asked.user_id, &asked.request_id)
    })
    .await;
    match read {
        // The key is the buyer's own; the recorded owner is checked as well (a record written
        // under another layout would otherwise leak).
        Ok(Some(record)) if record.user_id == Some(asked.user_id) => RedisSays::Found(record),
        Ok(_) => RedisSays::Miss,
        Err(_) => RedisSays::Unreachable,
    }
}

fn from_redis(record: RequestRecord, asked: Asked) -> (QueryOutcome, QueryAnswer) {
    let outcome = match record.state.as_str() {
        "SUCCEEDED" => QueryOutcome::Succeeded,
        "FAILED" => QueryOutcome::Failed,
        _ => QueryOutcome::Queuing,
    };
    let answer = QueryAnswer {
        request_id: Some(asked.request_id),
        reservation_id: record.reservation_id,
        order_id: record.order_id,
        reason_code: record.reason_code,
        retry_after_ms: None,
    };
    (outcome, answer)
}

/// The PostgreSQL fallback, bounded by `query_fallback_wait_ms`.
async fn read_postgres(
    deps: &QueryDeps<'_>,
    asked: &Asked,
) -> Result<Option<ReservationRecord>, DurableError> {
    let wait = Duration::from_millis(deps.shared.config.query_fallback_wait_ms);
    let (activity_id, sku_id) = (asked.key.activity_id as i64, asked.key.sku_id as i64);
    let (user_id, request_id) = (asked.user_id as i64, asked.request_id.clone());
    let lookup = deps.shared.durable.pg(move |client| async move {
        reservation_lookup::find_reservation(&client, activity_id, sku_id, user_id, &request_id)
            .await
    });
    match glommio::timer::timeout(wait, async { Ok(lookup.await) }).await {
        Ok(result) => result,
        Err(_) => Err(DurableError::Timeout),
    }
}

fn from_postgres(record: ReservationRecord, request_id: String) -> (QueryOutcome, QueryAnswer) {
    let (outcome, reason) = match record.status.as_str() {
        "ORDER_CREATED" => (QueryOutcome::Succeeded, None),
        "PROCESSING" => (QueryOutcome::Queuing, None),
        other => (QueryOutcome::Failed, Some(other.trim_start_matches("REJECTED_").to_owned())),
    };
    let reason = reason.map(|r| if r == "ACTIVITY" { "ACTIVITY_TERMINATED".to_owned() } else { r });
    let answer = QueryAnswer {
        request_id: Some(request_id),
        reservation_id: Some(record.reservation_id),
        order_id: record.order_id,
        reason_code: reason,
        retry_after_ms: None,
    };
    (outcome, answer)
}
