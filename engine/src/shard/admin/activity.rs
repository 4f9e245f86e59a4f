//! Activities on the admin plane (CONTRACT.md section 4): `POST /admin/v1/activities` —
//! validated against every store that will hold it (`io/src/bounds.rs`), then the
//! PostgreSQL rows and tokens, the Redis preheat, and only then `ACTIVE` — and
//! `GET .../skus/{s}`, a SKU's configuration and live counters.
//!
//! Not here: an activity's later changes (`lifecycle.rs`).

use crate::durable::DurableError;

use flashsale_io::bounds;
use flashsale_io::redis::layout::{ActivityStatus, SkuMember};
use flashsale_io::redis::script::{PreheatArgs, PreheatReply};
use flashsale_pg_worker::activity_creation::{self, ActivitySpec, CreateActivity};
use flashsale_pg_worker::sku::{self, Allocator};
use serde::Deserialize;
use serde_json::json;

use super::deps::AdminDeps;
use crate::http::Status;
use crate::logic::placement::SkuKey;
use crate::shard::reply::{error, not_found};

/// Defaults of CONTRACT.md section 4's optional fields.
const DEFAULT_WINDOW_MS: i64 = 24 * 3600 * 1000;
const DEFAULT_RESERVATION_TTL_MS: i64 = 5 * 60 * 1000;
const DEFAULT_PAY_TIMEOUT_MS: i64 = 15 * 60 * 1000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    activity_id: i64,
    sku_id: i64,
    stock: i64,
    start_at_ms: Option<i64>,
    end_at_ms: Option<i64>,
    reservation_ttl_ms: Option<i64>,
    pay_timeout_ms: Option<i64>,
    allocator: Option<String>,
    price_cents: Option<i64>,
    max_per_buyer: Option<i64>,
}

/// `value` within `lo..=hi` (the bounds of `io/src/bounds.rs`), else `reason`.
fn within(value: i64, lo: u64, hi: u64, reason: &'static str) -> Result<i64, &'static str> {
    let ok = u64::try_from(value).is_ok_and(|v| (lo..=hi).contains(&v));
    if ok {
        Ok(value)
    } else {
        Err(reason)
    }
}

/// The fields a SKU is created with, checked against every store that will hold them
/// (`io/src/bounds.rs`), for `POST /admin/v1/activities` and `.../skus` alike.
pub struct SkuFields {
    pub stock: i64,
    pub allocator: Allocator,
    pub price_cents: Option<i64>,
    /// Units one buyer may take in his one order (1 when the body names none).
    pub max_per_buyer: i32,
}

/// A SKU's fields as a body sends them.
pub struct SkuBody<'a> {
    pub stock: i64,
    pub allocator: Option<&'a str>,
    pub price_cents: Option<i64>,
    pub max_per_buyer: Option<i64>,
}

pub fn sku_fields(body: SkuBody<'_>) -> Result<SkuFields, &'static str> {
    let SkuBody { stock, allocator, price_cents, max_per_buyer } = body;
    let stock = within(stock, 0, bounds::STOCK_MAX, "STOCK_INVALID")?;
    let allocator = match allocator {
        None => Allocator::Token,
        Some(text) => Allocator::parse(text).ok_or("ALLOCATOR_INVALID")?,
    };
    let price_cents =
        price_cents.map(|p| within(p, 0, bounds::PRICE_CENTS_MAX, "PRICE_INVALID")).transpose()?;
    let max = u64::from(bounds::QUANTITY_MAX);
    let max_per_buyer = within(max_per_buyer.unwrap_or(1), 1, max, "MAX_PER_BUYER_INVALID")?;
    // Within 1..=QUANTITY_MAX (100).
    let max_per_buyer = i32::try_from(max_per_buyer).unwrap_or(1);
    Ok(SkuFields { stock, allocator, price_cents, max_per_buyer })
}

/// Every field within the bounds of every store that will hold it (PostgreSQL, Redis' Lua
/// library, the message schema), so that nothing is written for a body some later step
/// would refuse.
fn validate(body: CreateBody) -> Result<ActivitySpec, &'static str> {
    let id = |value, reason| within(value, 1, bounds::ID_VALUE_MAX, reason);
    let activity_id = id(body.activity_id, "ACTIVITY_ID_INVALID")?;
    let sku_id = id(body.sku_id, "SKU_ID_INVALID")?;
    let sku = sku_fields(SkuBody {
        stock: body.stock,
        allocator: body.allocator.as_deref(),
        price_cents: body.price_cents,
        max_per_buyer: body.max_per_buyer,
    })?;
    // Defaults are fixed numbers, not "now": a retried call must hash to the same body.
    let start_at_ms = body.start_at_ms.unwrap_or(0);
    let end_at_ms = body.end_at_ms.unwrap_or_else(|| {
        if start_at_ms == 0 {
            i64::from(i32::MAX) * 1000
        } else {
            start_at_ms.saturating_add(DEFAULT_WINDOW_MS)
        }
    });
    let time = |value| within(value, 0, bounds::TIME_MS_MAX, "WINDOW_INVALID");
    let (start_at_ms, end_at_ms) = (time(start_at_ms)?, time(end_at_ms)?);
    if end_at_ms <= start_at_ms {
        return Err("WINDOW_INVALID");
    }
    let reservation_ttl_ms = body.reservation_ttl_ms.unwrap_or(DEFAULT_RESERVATION_TTL_MS);
    let reservation_ttl_ms =
        within(reservation_ttl_ms, 1, bounds::RESERVATION_TTL_MS_MAX, "TIMEOUT_INVALID")?;
    let pay_timeout_ms = body.pay_timeout_ms.unwrap_or(DEFAULT_PAY_TIMEOUT_MS);
    let pay_timeout_ms = within(pay_timeout_ms, 1, bounds::PAY_TIMEOUT_MS_MAX, "TIMEOUT_INVALID")?;
    Ok(ActivitySpec {
        activity_id,
        sku_id,
        stock: sku.stock,
        start_at_ms,
        end_at_ms,
        reservation_ttl_ms,
        pay_timeout_ms,
        allocator: sku.allocator,
        price_cents: sku.price_cents,
        max_per_buyer: sku.max_per_buyer,
    })
}

/// PostgreSQL rows and tokens first, then the Redis preheat, and only then `ACTIVE`: no buyer
/// can see an active activity whose stock is not in Redis.
pub async fn create_activity(deps: &AdminDeps<'_>, body: &[u8]) -> (Status, String) {
    let parsed: CreateBody = match serde_json::from_slice(body) {
        Ok(b) => b,
        Err(_) => return error(Status::BadRequest, "BODY_INVALID"),
    };
    let spec = match validate(parsed) {
        Ok(spec) => spec,
        Err(reason) => return error(Status::BadRequest, reason),
    };
    let outcome = match create_rows(deps, &spec).await {
        Ok(CreateActivity::Conflict) => {
            return error(Status::Conflict, "ACTIVITY_EXISTS_WITH_OTHER_BODY")
        }
        Ok(outcome) => outcome,
        Err(refused) => return refused,
    };
    // Created now or before (the same body): the activation is idempotent (preheat by
    // version, the set, the conditional status), so a retry after a failure between the
    // steps completes it.
    if let Err(refused) = activate(deps, &spec, &outcome).await {
        return refused;
    }
    let status =
        if matches!(outcome, CreateActivity::Created) { Status::Created } else { Status::Ok };
    (status, created_body(&spec))
}

/// The activity's rows and tokens (PENDING), in one transaction, bounded by
/// [`super::deps::ADMIN_PG_WAIT`].
async fn create_rows(
    deps: &AdminDeps<'_>,
    spec: &ActivitySpec,
) -> Result<CreateActivity, (Status, String)> {
    let spec = spec.clone();
    let create =
        deps.shared.durable.pg_within(super::deps::ADMIN_PG_WAIT, move |mut client| async move {
            activity_creation::create_activity(&mut client, &spec).await
        });
    match create.await {
        Ok(outcome) => Ok(outcome),
        Err(DurableError::Timeout) => Err(error(Status::ServiceUnavailable, "POSTGRES_TIMEOUT")),
        Err(e) => {
            tracing::warn!(error = %e, "create activity failed");
            Err(error(Status::ServiceUnavailable, "POSTGRES_UNAVAILABLE"))
        }
    }
}

/// Redis preheated, the SKU in the active-SKU set (every shard's scanner finds the SKUs it
/// owns there, across engine restarts), then `ACTIVE` in PostgreSQL.
///
/// An activity activated before (`Existing`, no longer `PENDING`) is never preheated again:
/// its initial stock would sell again what PostgreSQL already sold. If Redis lost it, its
/// owner shard rebuilds it from PostgreSQL (`shard/rebuild.rs`, found within seconds).
async fn activate(
    deps: &AdminDeps<'_>,
    spec: &ActivitySpec,
    outcome: &CreateActivity,
) -> Result<(), (Status, String)> {
    let key = SkuKey::new(spec.activity_id as u64, spec.sku_id as u64);
    let redis_down = || error(Status::ServiceUnavailable, "REDIS_UNAVAILABLE");
    if matches!(outcome, CreateActivity::Existing { status } if status != "PENDING") {
        let member = SkuMember { activity_id: key.activity_id, sku_id: key.sku_id };
        return deps
            .store
            .functions
            .add_active_sku(member)
            .await
            .map(drop)
            .map_err(|_| redis_down());
    }
    let keys = deps.store.sku_keys(key);
    let args = PreheatArgs {
        status: ActivityStatus::Active,
        start_ms: spec.start_at_ms as u64,
        end_ms: spec.end_at_ms as u64,
        version: 1,
        reservation_ttl_ms: spec.reservation_ttl_ms as u64,
        stock: spec.stock as u64,
        max_per_buyer: u32::try_from(spec.max_per_buyer).unwrap_or(1).max(1),
    };
    match deps.store.functions.preheat(&keys, &args).await {
        Ok(PreheatReply::Applied { .. }) | Ok(PreheatReply::Stale { .. }) => {}
        Err(e) => {
            tracing::warn!(error = %e, "preheat failed");
            return Err(redis_down());
        }
    }
    let member = SkuMember { activity_id: key.activity_id, sku_id: key.sku_id };
    deps.store.functions.add_active_sku(member).await.map_err(|_| redis_down())?;
    let activity_id = spec.activity_id;
    let marked = deps
        .shared
        .durable
        .pg(move |client| async move {
            activity_creation::mark_activity_active(&client, activity_id).await
        })
        .await;
    marked.map_err(|_| error(Status::ServiceUnavailable, "POSTGRES_UNAVAILABLE"))
}

fn created_body(spec: &ActivitySpec) -> String {
    json!({
        "activity_id": spec.activity_id,
        "sku_id": spec.sku_id,
        "stock": spec.stock,
        "start_at_ms": spec.start_at_ms,
        "end_at_ms": spec.end_at_ms,
        "reservation_ttl_ms": spec.reservation_ttl_ms,
        "pay_timeout_ms": spec.pay_timeout_ms,
        "allocator": spec.allocator.as_str(),
        "price_cents": spec.price_cents,
        "status": "ACTIVE",
    })
    .to_string()
}

pub async fn sku_status(deps: &AdminDeps<'_>, key: SkuKey) -> (Status, String) {
    let (activity_id, sku_id) = (key.activity_id as i64, key.sku_id as i64);
    let config = deps
        .shared
        .durable
        .pg(move |client| async move { sku::sku_config(&client, activity_id, sku_id).await })
        .await;
    let config = match config {
        Ok(Some(config)) => config,
        Ok(None) => return not_found(),
        Err(_) => return error(Status::ServiceUnavailable, "POSTGRES_UNAVAILABLE"),
    };
    let keys = deps.store.sku_keys(key);
    let counters = deps.store.functions.counters(&keys).await.ok();
    (
        Status::Ok,
        json!({
            "activity_id": key.activity_id,
            "sku_id": key.sku_id,
            "status": config.status,
            "version": config.version,
            "total_stock": config.total_stock,
            "allocator": config.allocator,
            "start_at_ms": config.start_at_ms,
            "end_at_ms": config.end_at_ms,
            "reservation_ttl_ms": config.reservation_ttl_ms,
            "pay_timeout_ms": config.pay_timeout_ms,
            "max_per_buyer": config.max_per_buyer,
            "live": {
                "redis_stock": counters.and_then(|c| c.stock),
                "pending_reservations": counters.map(|c| c.pending),
                "stuck_reservations": counters.map(|c| c.stuck),
                "orders_created": config.orders_created,
            }
        })
        .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        let body = |s: &str| serde_json::from_str::<CreateBody>(s).expect("json");
        let spec = validate(body(r#"{"activity_id":1,"sku_id":2,"stock":10}"#)).expect("valid");
        assert_eq!(spec.allocator, Allocator::Token);
        assert_eq!(spec.reservation_ttl_ms, DEFAULT_RESERVATION_TTL_MS);
        assert_eq!(
            validate(body(r#"{"activity_id":1,"sku_id":2,"stock":-1}"#)),
            Err("STOCK_INVALID")
        );
        assert_eq!(
            validate(body(
                r#"{"activity_id":1,"sku_id":2,"stock":1,"start_at_ms":5,"end_at_ms":5}"#
            )),
            Err("WINDOW_INVALID")
        );
        assert_eq!(
            validate(body(r#"{"activity_id":1,"sku_id":2,"stock":1,"allocator":"X"}"#)),
            Err("ALLOCATOR_INVALID")
        );
        assert!(serde_json::from_str::<CreateBody>(
            r#"{"activity_id":1,"sku_id":2,"stock":1,"x":1}"#
        )
        .is_err());
    }
}
