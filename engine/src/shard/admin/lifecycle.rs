//! The activity lifecycle on the admin plane (CONTRACT.md section 4; `flashsale admin
//! activity ...`): a SKU added, an activity or one SKU ended or terminated, stock topped up,
//! the release policy set.
//!
//! Every call is PostgreSQL first (`flashsale_pg_worker::lifecycle`: one transaction, a new
//! version, the change recorded with who made it), then Redis with calls idempotent by that
//! version: `preheat` installs the SKU's new `meta` snapshot (status, version), `top_up` adds
//! the new units to `stock` once. A retry of the same call after a failure between the two
//! steps finds the change `Already` in PostgreSQL and completes the Redis step; a change that
//! only reached PostgreSQL shows in reconcile until then.
//!
//! Who: the body's optional `actor` (default `admin`), recorded in `activity_change`.
//!
//! After an end or a terminate, new submissions are answered `ACTIVITY_NOT_ACTIVE` by `reserve`
//! at once and by the owner shard's snapshot within its refresh (`refresh.rs`, 1 s);
//! reservations in flight of a terminated activity or SKU are rejected by the order-writer
//! and compensated (migration 0006). After a top-up every instance's sold-out flag clears
//! through the stock-returned notice (`durable/notice.rs`).

use flashsale_io::redis::layout::{ActivityStatus, SkuMember};
use flashsale_io::redis::script::{PreheatArgs, ScriptError, TopUpArgs, TopUpReply};
use flashsale_pg_worker::lifecycle::{self, Change, Closing, SkuSnapshot};
use flashsale_pg_worker::sku::SkuSpec;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::json;

use super::activity::{sku_fields, SkuBody};
use super::deps::AdminDeps;
use crate::durable::DurableRequest;
use crate::http::Status;
use crate::logic::ids::{ActivityId, SkuId};
use crate::logic::placement::SkuKey;
use crate::shard::reply::error;

const DEFAULT_ACTOR: &str = "admin";
/// Longest top-up request id (an operator's idempotency key for one top-up).
const TOP_UP_REQUEST_ID_LEN_MAX: usize = 128;

/// Routes `POST /admin/v1/activities/{a}/...` lifecycle calls; `None`: not one of them.
pub async fn route(deps: &AdminDeps<'_>, path: &str, body: &[u8]) -> Option<(Status, String)> {
    let rest = path.strip_prefix("/admin/v1/activities/")?;
    let parts: Vec<&str> = rest.split('/').collect();
    let id = |text: &str| ActivityId::parse_decimal(text.as_bytes()).map(|id| id.get() as i64);
    let activity_id = id(parts.first()?)?;
    let sku = |text: &str| SkuId::parse_decimal(text.as_bytes()).map(|id| id.get() as i64);
    Some(match parts.as_slice() {
        [_, "skus"] => add_sku(deps, activity_id, body).await,
        [_, "end"] => close(deps, activity_id, None, Closing::End, body).await,
        [_, "terminate"] => close(deps, activity_id, None, Closing::Terminate, body).await,
        [_, "release-policy"] => release_policy(deps, activity_id, body).await,
        [_, "skus", s, "end"] => close(deps, activity_id, Some(sku(s)?), Closing::End, body).await,
        [_, "skus", s, "terminate"] => {
            close(deps, activity_id, Some(sku(s)?), Closing::Terminate, body).await
        }
        [_, "skus", s, "stock"] => top_up(deps, activity_id, sku(s)?, body).await,
        _ => return None,
    })
}

/// The body as `T`; an empty body is `{}` (the calls whose fields are all optional).
fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, (Status, String)> {
    let body = if body.iter().all(u8::is_ascii_whitespace) { b"{}".as_slice() } else { body };
    serde_json::from_slice(body).map_err(|_| error(Status::BadRequest, "BODY_INVALID"))
}

/// 1..=`len_max` bytes of printable ASCII (spaces allowed, no control characters): what an
/// operator's free-text field may hold, so that it cannot forge log lines or listings.
fn printable(text: &str, len_max: usize) -> bool {
    !text.is_empty()
        && text.len() <= len_max
        && text.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
}

fn actor(given: Option<String>) -> Result<String, (Status, String)> {
    let actor = given.unwrap_or_else(|| DEFAULT_ACTOR.to_owned());
    if printable(&actor, lifecycle::ACTOR_LEN_MAX) {
        Ok(actor)
    } else {
        Err(error(Status::BadRequest, "ACTOR_INVALID"))
    }
}

/// Runs a PostgreSQL lifecycle call on the durable side (bounded by [`super::deps::ADMIN_PG_WAIT`]:
/// a stock top-up creates tokens); 503 when it cannot.
async fn pg<T, F, Fut>(deps: &AdminDeps<'_>, f: F) -> Result<T, (Status, String)>
where
    T: Send + 'static,
    F: FnOnce(deadpool_postgres::Object) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, flashsale_pg_worker::PgError>> + Send + 'static,
{
    deps.shared.durable.pg_within(super::deps::ADMIN_PG_WAIT, f).await.map_err(|e| {
        tracing::warn!(error = %e, "lifecycle change: PostgreSQL step failed");
        match e {
            crate::durable::DurableError::Pg(flashsale_pg_worker::PgError::InvalidArgument(_)) => {
                error(Status::BadRequest, "ARGUMENT_INVALID")
            }
            _ => error(Status::ServiceUnavailable, "POSTGRES_UNAVAILABLE"),
        }
    })
}

/// Installs each snapshot in Redis `meta` (idempotent by version; `stock` is set only if the
/// key is absent, i.e. for a new SKU).
async fn preheat(deps: &AdminDeps<'_>, snapshots: &[SkuSnapshot]) -> Result<(), ScriptError> {
    for snapshot in snapshots {
        let key = SkuKey::new(snapshot.activity_id as u64, snapshot.sku_id as u64);
        let args = PreheatArgs {
            status: ActivityStatus::parse(&snapshot.status).unwrap_or(ActivityStatus::Terminated),
            start_ms: snapshot.start_at_ms.max(0) as u64,
            end_ms: snapshot.end_at_ms.max(0) as u64,
            version: snapshot.meta_version.max(1) as u64,
            reservation_ttl_ms: snapshot.reservation_ttl_ms.max(1) as u64,
            stock: snapshot.total_stock.max(0) as u64,
            max_per_buyer: u32::try_from(snapshot.max_per_buyer).unwrap_or(1).max(1),
        };
        deps.store.functions.preheat(&deps.store.sku_keys(key), &args).await?;
    }
    Ok(())
}

fn redis_failed(e: ScriptError) -> (Status, String) {
    tracing::warn!(error = %e, "lifecycle change: Redis step failed (a retry completes it)");
    error(Status::ServiceUnavailable, "REDIS_UNAVAILABLE")
}

fn describe(snapshots: &[SkuSnapshot]) -> Vec<serde_json::Value> {
    snapshots
        .iter()
        .map(|s| {
            json!({
                "activity_id": s.activity_id,
                "sku_id": s.sku_id,
                "status": s.status,
                "version": s.meta_version,
                "total_stock": s.total_stock,
                "release_policy": s.release_policy,
            })
        })
        .collect()
}

/// The answer to a change: `applied` says whether this call made it.
fn answer(status: Status, applied: bool, snapshots: &[SkuSnapshot]) -> (Status, String) {
    (status, json!({"applied": applied, "skus": describe(snapshots)}).to_string())
}

fn unchanged(change: Change, not_found: &str) -> (Status, String) {
    match change {
        Change::NotFound => error(Status::NotFound, not_found),
        Change::Refused { current } if current == "CONFLICT" => {
            error(Status::Conflict, "EXISTS_WITH_OTHER_BODY")
        }
        Change::Refused { current } => error(Status::Conflict, &format!("ACTIVITY_{current}")),
        Change::Applied(_) | Change::Already(_) => error(Status::InternalServerError, "INTERNAL"),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddSkuBody {
    sku_id: i64,
    stock: i64,
    allocator: Option<String>,
    price_cents: Option<i64>,
    max_per_buyer: Option<i64>,
    actor: Option<String>,
}

/// `POST /admin/v1/activities/{a}/skus`: rows and tokens, then the preheat, then the SKU in
/// the active-SKU set (its owner's scanner and reconcile find it there).
async fn add_sku(deps: &AdminDeps<'_>, activity_id: i64, body: &[u8]) -> (Status, String) {
    let body: AddSkuBody = match parse(body) {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let actor = match actor(body.actor) {
        Ok(actor) => actor,
        Err(refused) => return refused,
    };
    if body.sku_id <= 0 {
        return error(Status::BadRequest, "SKU_ID_INVALID");
    }
    let fields = SkuBody {
        stock: body.stock,
        allocator: body.allocator.as_deref(),
        price_cents: body.price_cents,
        max_per_buyer: body.max_per_buyer,
    };
    let sku = match sku_fields(fields) {
        Ok(sku) => sku,
        Err(reason) => return error(Status::BadRequest, reason),
    };
    let spec = SkuSpec {
        activity_id,
        sku_id: body.sku_id,
        stock: sku.stock,
        allocator: sku.allocator,
        price_cents: sku.price_cents,
        max_per_buyer: sku.max_per_buyer,
    };
    let change = match pg(deps, move |mut client| async move {
        lifecycle::add_sku(&mut client, &spec, &actor).await
    })
    .await
    {
        Ok(change) => change,
        Err(refused) => return refused,
    };
    let (status, applied, snapshots) = match change {
        Change::Applied(s) => (Status::Created, true, s),
        Change::Already(s) => (Status::Ok, false, s),
        other => return unchanged(other, "NO_SUCH_ACTIVITY"),
    };
    if let Err(e) = preheat(deps, &snapshots).await {
        return redis_failed(e);
    }
    let member = SkuMember { activity_id: activity_id as u64, sku_id: body.sku_id as u64 };
    if let Err(e) = deps.store.functions.add_active_sku(member).await {
        return redis_failed(e);
    }
    answer(status, applied, &snapshots)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ActorBody {
    actor: Option<String>,
}

/// `POST /admin/v1/activities/{a}/end|terminate`, `.../skus/{s}/end|terminate`.
async fn close(
    deps: &AdminDeps<'_>,
    activity_id: i64,
    sku_id: Option<i64>,
    closing: Closing,
    body: &[u8],
) -> (Status, String) {
    let actor = match parse::<ActorBody>(body).and_then(|b| actor(b.actor)) {
        Ok(actor) => actor,
        Err(refused) => return refused,
    };
    let change = match pg(deps, move |mut client| async move {
        lifecycle::close(&mut client, activity_id, sku_id, closing, &actor).await
    })
    .await
    {
        Ok(change) => change,
        Err(refused) => return refused,
    };
    let (applied, snapshots) = match change {
        Change::Applied(s) => (true, s),
        Change::Already(s) => (false, s),
        other => {
            let missing = if sku_id.is_some() { "NO_SUCH_SKU" } else { "NO_SUCH_ACTIVITY" };
            return unchanged(other, missing);
        }
    };
    if let Err(e) = preheat(deps, &snapshots).await {
        return redis_failed(e);
    }
    tracing::info!(activity_id, ?sku_id, ?closing, applied, "activity lifecycle: closed");
    answer(Status::Ok, applied, &snapshots)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TopUpBody {
    add: i64,
    request_id: Option<String>,
    actor: Option<String>,
}

/// `POST /admin/v1/activities/{a}/skus/{s}/stock` with `{add, request_id?}`.
async fn top_up(
    deps: &AdminDeps<'_>,
    activity_id: i64,
    sku_id: i64,
    body: &[u8],
) -> (Status, String) {
    let body: TopUpBody = match parse(body) {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let actor = match actor(body.actor) {
        Ok(actor) => actor,
        Err(refused) => return refused,
    };
    if !(1..=flashsale_pg_worker::tokens::TOKENS_PER_SKU_MAX).contains(&body.add) {
        return error(Status::BadRequest, "ADD_INVALID");
    }
    if body.request_id.as_deref().is_some_and(|r| !printable(r, TOP_UP_REQUEST_ID_LEN_MAX)) {
        return error(Status::BadRequest, "REQUEST_ID_INVALID");
    }
    let (add, request_id) = (body.add, body.request_id);
    let topped = match pg(deps, move |mut client| async move {
        lifecycle::top_up(&mut client, activity_id, sku_id, add, request_id.as_deref(), &actor)
            .await
    })
    .await
    {
        Ok(Ok(topped)) => topped,
        Ok(Err(unchanged_change)) => return unchanged(unchanged_change, "NO_SUCH_SKU"),
        Err(refused) => return refused,
    };
    let key = SkuKey::new(activity_id as u64, sku_id as u64);
    let args = TopUpArgs { add: topped.add as u64, version: topped.version as u64 };
    let applied = match deps.store.functions.top_up(&deps.store.sku_keys(key), &args).await {
        Ok(TopUpReply::Applied { .. }) => true,
        Ok(TopUpReply::Already { .. }) => false,
        Ok(TopUpReply::NoMeta) => return error(Status::Conflict, "NOT_PREHEATED"),
        Err(e) => return redis_failed(e),
    };
    // Every instance's (this one's too) sold-out flag: the owner re-reads stock on the notice.
    let _ = deps.shared.durable.try_send(DurableRequest::StockReturned { key });
    tracing::info!(activity_id, sku_id, add, version = topped.version, applied, "stock topped up");
    answer(Status::Ok, applied, std::slice::from_ref(&topped.snapshot))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyBody {
    release_policy: String,
    actor: Option<String>,
}

/// `POST /admin/v1/activities/{a}/release-policy` with `{release_policy}`.
async fn release_policy(deps: &AdminDeps<'_>, activity_id: i64, body: &[u8]) -> (Status, String) {
    let body: PolicyBody = match parse(body) {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let actor = match actor(body.actor) {
        Ok(actor) => actor,
        Err(refused) => return refused,
    };
    if body.release_policy != "BACK_TO_SALE" && body.release_policy != "RELEASED" {
        return error(Status::BadRequest, "RELEASE_POLICY_INVALID");
    }
    let policy = body.release_policy;
    let change = match pg(deps, move |mut client| async move {
        lifecycle::set_release_policy(&mut client, activity_id, &policy, &actor).await
    })
    .await
    {
        Ok(change) => change,
        Err(refused) => return refused,
    };
    match change {
        Change::Applied(s) => answer(Status::Ok, true, &s),
        Change::Already(s) => answer(Status::Ok, false, &s),
        other => unchanged(other, "NO_SUCH_ACTIVITY"),
    }
}
