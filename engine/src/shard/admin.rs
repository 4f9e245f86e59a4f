//! The admin plane (CONTRACT.md section 4), served by shard 0 on `FLASHSALE_ADMIN_ADDR`:
//! activity creation and inspection, `/metrics`, health, drain. Authenticated with
//! `Authorization: Bearer $FLASHSALE_ADMIN_TOKEN` when a token is configured; without one,
//! only loopback peers are served (and `serve` refuses a non-loopback admin address).
//! `GET /livez` and `GET /readyz` are the exception: they answer anyone, token or not.
//!
//! Health (DESIGN.md section 7): `/livez` checks only that every shard's event loop ticks;
//! `/readyz` only local state (started, not draining). Dependency health never decides
//! liveness.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::BytesMut;
use flashsale_io::bounds;
use flashsale_io::redis::layout::{ActivityStatus, SkuMember};
use flashsale_io::redis::script::{PreheatArgs, PreheatReply};
use flashsale_pg_worker::edge::{self, ActivitySpec, Allocator, CreateActivity};
use serde::Deserialize;
use serde_json::json;

use super::conn::RequestCtx;
use super::Shard;
use crate::durable::DurableRequest;
use crate::http::{write_response, ContentType, Method, Request, ResponseHead, Status};
use crate::logic::auth::bearer_credential;
use crate::logic::clock::now_ms;
use crate::logic::ids::{ActivityId, SkuId};
use crate::logic::placement::SkuKey;

/// A shard whose loop has not ticked for this long is not live.
const HEARTBEAT_STALE_MS: u64 = 2_000;
/// Defaults of CONTRACT.md section 4's optional fields.
const DEFAULT_WINDOW_MS: i64 = 24 * 3600 * 1000;
const DEFAULT_RESERVATION_TTL_MS: i64 = 5 * 60 * 1000;
const DEFAULT_PAY_TIMEOUT_MS: i64 = 15 * 60 * 1000;
/// Bound on an admin call's wait for PostgreSQL.
const ADMIN_PG_WAIT_MS: u64 = 30_000;

pub async fn handle(
    shard: &Rc<Shard>,
    request: &Request<'_>,
    body: &[u8],
    ctx: &RequestCtx,
    head: &mut ResponseHead<'_>,
    out: &mut BytesMut,
) {
    // Balancers' health checks cannot send a token, and these two reveal nothing.
    if !is_public_health(request) && !authorized(shard, request, ctx) {
        head.status = Status::Unauthorized;
        write_response(out, head, br#"{"state":"UNAUTHORIZED"}"#);
        return;
    }
    let (status, text) = route(shard, request, body).await;
    head.status = status;
    if request.path == "/metrics" && status == Status::Ok {
        head.content_type = ContentType::PrometheusText;
    }
    write_response(out, head, text.as_bytes());
}

/// `GET /livez` and `GET /readyz` answer without a token (CONTRACT.md section 4); `/startupz`
/// keeps it (no balancer needs it, and it is what an orchestrator with credentials polls).
pub(super) fn is_public_health(request: &Request<'_>) -> bool {
    request.method == Method::Get && matches!(request.path, "/livez" | "/readyz")
}

fn authorized(shard: &Shard, request: &Request<'_>, ctx: &RequestCtx) -> bool {
    match &shard.shared.admin_token {
        Some(token) => {
            let header = request.authorization.unwrap_or("").as_bytes();
            let given = bearer_credential(header).unwrap_or(b"");
            constant_time_eq(given, token.as_bytes())
        }
        None => ctx.peer_is_loopback,
    }
}

/// Length leaks (tokens are fixed-length secrets in practice); contents do not.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn route(shard: &Rc<Shard>, request: &Request<'_>, body: &[u8]) -> (Status, String) {
    let shared = &shard.shared;
    match (request.method, request.path) {
        (Method::Get, "/livez") => {
            let now = now_ms();
            let live = shared
                .heartbeats
                .iter()
                .all(|h| now.saturating_sub(h.load(Ordering::Relaxed)) < HEARTBEAT_STALE_MS);
            health(live, "live")
        }
        (Method::Get, "/startupz") => {
            // Listening everywhere, and the backlog read once (admission needs it).
            let started = shared.started.iter().all(|s| s.load(Ordering::Relaxed))
                && shared.health.lag.polled_at_ms() != 0;
            health(started, "started")
        }
        (Method::Get, "/readyz") => {
            let ready = shared.started.iter().all(|s| s.load(Ordering::Relaxed))
                && !shared.draining.load(Ordering::Relaxed);
            health(ready, "ready")
        }
        (Method::Get, "/metrics") => {
            let mut text = String::with_capacity(16 * 1024);
            shared.metrics.render(&mut text);
            render_mode(shard, &mut text);
            if let Some(extra) = &shared.render_extra {
                text.push_str(&extra());
            }
            (Status::Ok, text)
        }
        (Method::Post, "/internal/drain") => {
            shared.draining.store(true, Ordering::Relaxed);
            tracing::info!("drain requested: readiness false, public listeners stop accepting");
            (Status::Ok, json!({"draining": true}).to_string())
        }
        (Method::Post, "/admin/v1/activities") => create_activity(shard, body).await,
        (Method::Post, "/admin/v1/mode") => post_mode(shard, body).await,
        (Method::Get, "/admin/v1/mode") => get_mode(shard),
        (Method::Get, "/admin/v1/refunds") => refunds(shard).await,
        (Method::Get, "/admin/v1/dlq") => crate::shard::dlq::list(shard, request.query).await,
        (Method::Post, path) if path.starts_with("/admin/v1/dlq/") => {
            let sequence = &path["/admin/v1/dlq/".len()..];
            crate::shard::dlq::act(shard, sequence, body).await
        }
        (Method::Get, path) if path.ends_with("/reconcile") => reconcile(shard, path).await,
        (Method::Get, path) if path.ends_with("/stuck") => {
            match path.strip_suffix("/stuck").and_then(parse_sku_path) {
                Some(key) => crate::shard::stuck::list(shard, key).await,
                None => not_found(),
            }
        }
        (Method::Post, path) if path.contains("/stuck/") => match parse_stuck_path(path) {
            Some((key, reservation_id)) => {
                crate::shard::stuck::resolve(shard, key, reservation_id, body).await
            }
            None => not_found(),
        },
        (Method::Post, path) if path.starts_with("/admin/v1/activities/") => {
            match crate::shard::lifecycle::route(shard, path, body).await {
                Some(answer) => answer,
                None => not_found(),
            }
        }
        (Method::Get, path) if path.starts_with("/admin/v1/activities/") => {
            match parse_sku_path(path) {
                Some(key) => sku_status(shard, key).await,
                None => not_found(),
            }
        }
        _ => not_found(),
    }
}

/// `POST /admin/v1/mode`: a signed snapshot (DESIGN.md section 7). Checked against this
/// instance's table first (forged, stale, expired or a forbidden transition never reach the
/// fleet), then put into the replicated mode bucket, then applied here; every other instance
/// applies it from the bucket.
async fn post_mode(shard: &Rc<Shard>, body: &[u8]) -> (Status, String) {
    let signed = match accept_mode(shard, body).await {
        Ok(signed) => signed,
        Err(e) => {
            let (code, reason) = e.http();
            tracing::warn!(error = %e, "mode snapshot refused");
            let status = Status::from_code(code).unwrap_or(Status::BadRequest);
            let body = json!({"state": "REFUSED", "reason_code": reason, "error": e.to_string()});
            return (status, body.to_string());
        }
    };
    let snapshot = &signed.snapshot;
    let body = json!({
        "state": "ACCEPTED",
        "scope": snapshot.scope.to_string(),
        "version": snapshot.version,
        "mode": snapshot.mode.name(),
        "admit_percent": snapshot.mode.admit_percent(),
        "expires_at_ms": snapshot.expires_at_ms,
    });
    (Status::Ok, body.to_string())
}

/// Checks, replicates and applies one signed snapshot (the steps of [`post_mode`]).
async fn accept_mode(
    shard: &Rc<Shard>,
    body: &[u8],
) -> Result<crate::logic::modes::SignedSnapshot, crate::durable::control::ControlError> {
    use crate::durable::control::{kv_key, ControlError};
    let modes = &shard.shared.modes;
    let text = std::str::from_utf8(body).unwrap_or("");
    let signed =
        crate::logic::modes::SignedSnapshot::from_json(text).map_err(ControlError::Mode)?;
    modes.check(&signed, now_ms())?;
    let (scope, version) = (signed.snapshot.scope, signed.snapshot.version);
    let (key, value) = (kv_key(scope), signed.to_json());
    let put =
        shard.shared.durable.call(|reply| DurableRequest::PutMode { key, value, version, reply });
    put.await.map_err(|e| match e {
        crate::durable::DurableError::StaleMode { current } => {
            ControlError::Mode(crate::logic::modes::ModeError::StaleVersion {
                scope,
                current,
                offered: version,
            })
        }
        e => ControlError::Store(e.to_string()),
    })?;
    // The watcher may already have applied our own put: a stale version then means "done".
    match modes.apply(&signed, now_ms()) {
        Ok(_) | Err(ControlError::Mode(crate::logic::modes::ModeError::StaleVersion { .. })) => {
            Ok(signed)
        }
        Err(e) => Err(e),
    }
}

/// `GET /admin/v1/mode`: the global scope's effective mode and its snapshot.
fn get_mode(shard: &Shard) -> (Status, String) {
    let modes = &shard.shared.modes;
    let effective = modes.global(now_ms());
    let snapshot = modes
        .describe(crate::logic::modes::Scope::Global)
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s.to_json()).ok());
    let body = json!({
        "mode": effective.mode.name(),
        "admit_percent": effective.admit_percent(),
        "reason_code": effective.reason(),
        "closes_submissions": effective.closes_submissions(),
        "snapshot": snapshot,
    });
    (Status::Ok, body.to_string())
}

/// `flashsale_mode`: the global scope's effective mode (NORMAL 0 .. QUERY_ONLY 4; an expired or
/// unverifiable state counts as SUBMIT_CLOSED).
fn render_mode(shard: &Shard, out: &mut String) {
    use std::fmt::Write as _;
    let effective = shard.shared.modes.global(now_ms());
    let value = if effective.closes_submissions() {
        effective.mode.metric_value().max(crate::logic::modes::Mode::SubmitClosed.metric_value())
    } else {
        effective.mode.metric_value()
    };
    let _ =
        writeln!(out, "# TYPE flashsale_mode gauge\nflashsale_mode{{scope=\"global\"}} {value}");
    // The reconcile lease among instances (durable/lease.rs): 1 where the periodic job runs.
    let lease = &shard.shared.reconcile_lease;
    let held = u8::from(lease.held(now_ms()));
    let acquired = lease.acquired.load(std::sync::atomic::Ordering::Relaxed);
    let _ = writeln!(
        out,
        "# TYPE flashsale_reconcile_lease_held gauge\nflashsale_reconcile_lease_held {held}\n\
         # TYPE flashsale_reconcile_lease_acquired_total counter\n\
         flashsale_reconcile_lease_acquired_total {acquired}"
    );
}

/// `GET /admin/v1/refunds`: payments recorded REFUND_NEEDED (money received for an order
/// that no longer takes it) or AMOUNT_MISMATCH (another amount than the order's), oldest first, at most `payments::REFUNDS_MAX`. Each also produced
/// a `refund_requested` event on `seckill.event.refund_requested` when its order exists.
async fn refunds(shard: &Rc<Shard>) -> (Status, String) {
    use flashsale_pg_worker::payments::{list_refunds, REFUNDS_MAX};
    let listed = shard
        .shared
        .durable
        .pg(|client| async move { list_refunds(&client, REFUNDS_MAX).await })
        .await;
    match listed {
        Ok(refunds) => {
            let items: Vec<_> = refunds
                .iter()
                .map(|r| {
                    json!({
                        "order_id": r.order_id,
                        "payment_id": r.payment_id,
                        "amount_cents": r.amount_cents,
                        "since_ms": r.since_ms,
                        "order_status": r.order_status,
                        "outcome": r.outcome,
                    })
                })
                .collect();
            (Status::Ok, json!({"count": items.len(), "refunds": items}).to_string())
        }
        Err(e) => {
            tracing::warn!(error = %e, "listing refunds failed");
            error(Status::ServiceUnavailable, "PG_UNAVAILABLE")
        }
    }
}

fn health(ok: bool, what: &str) -> (Status, String) {
    let status = if ok { Status::Ok } else { Status::ServiceUnavailable };
    (status, json!({ what: ok }).to_string())
}

fn not_found() -> (Status, String) {
    (Status::NotFound, r#"{"state":"INVALID","reason_code":"NO_SUCH_ROUTE"}"#.to_owned())
}

pub(super) fn error(status: Status, reason: &str) -> (Status, String) {
    (status, json!({"state": "INVALID", "reason_code": reason}).to_string())
}

/// `GET /admin/v1/activities/{a}/skus/{s}/reconcile`: the conservation report
/// (`crate::shard::reconcile`).
async fn reconcile(shard: &Rc<Shard>, path: &str) -> (Status, String) {
    match path.strip_suffix("/reconcile").and_then(parse_sku_path) {
        Some(key) => crate::shard::reconcile::admin_reply(shard, key).await,
        None => not_found(),
    }
}

/// `/admin/v1/activities/{a}/skus/{s}`
fn parse_sku_path(path: &str) -> Option<SkuKey> {
    let rest = path.strip_prefix("/admin/v1/activities/")?;
    let (a, rest) = rest.split_once('/')?;
    let s = rest.strip_prefix("skus/")?;
    let activity = ActivityId::parse_decimal(a.as_bytes())?;
    let sku = SkuId::parse_decimal(s.as_bytes())?;
    Some(SkuKey::new(activity.get(), sku.get()))
}

/// `/admin/v1/activities/{a}/skus/{s}/stuck/{reservation_id}`
fn parse_stuck_path(path: &str) -> Option<(SkuKey, &str)> {
    let (sku_path, reservation_id) = path.split_once("/stuck/")?;
    let key = parse_sku_path(sku_path)?;
    (!reservation_id.is_empty() && !reservation_id.contains('/')).then_some((key, reservation_id))
}

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
pub(super) struct SkuFields {
    pub stock: i64,
    pub allocator: Allocator,
    pub price_cents: Option<i64>,
}

pub(super) fn sku_fields(
    stock: i64,
    allocator: Option<&str>,
    price_cents: Option<i64>,
) -> Result<SkuFields, &'static str> {
    let stock = within(stock, 0, bounds::STOCK_MAX, "STOCK_INVALID")?;
    let allocator = match allocator {
        None => Allocator::Token,
        Some(text) => Allocator::parse(text).ok_or("ALLOCATOR_INVALID")?,
    };
    let price_cents =
        price_cents.map(|p| within(p, 0, bounds::PRICE_CENTS_MAX, "PRICE_INVALID")).transpose()?;
    Ok(SkuFields { stock, allocator, price_cents })
}

/// Every field within the bounds of every store that will hold it (PostgreSQL, Redis' Lua
/// library, the message schema), so that nothing is written for a body some later step
/// would refuse.
fn validate(body: CreateBody) -> Result<ActivitySpec, &'static str> {
    let id = |value, reason| within(value, 1, bounds::ID_VALUE_MAX, reason);
    let activity_id = id(body.activity_id, "ACTIVITY_ID_INVALID")?;
    let sku_id = id(body.sku_id, "SKU_ID_INVALID")?;
    let sku = sku_fields(body.stock, body.allocator.as_deref(), body.price_cents)?;
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
    })
}

/// PostgreSQL rows and tokens first, then the Redis preheat, and only then `ACTIVE`: no buyer
/// can see an active activity whose stock is not in Redis.
async fn create_activity(shard: &Rc<Shard>, body: &[u8]) -> (Status, String) {
    let parsed: CreateBody = match serde_json::from_slice(body) {
        Ok(b) => b,
        Err(_) => return error(Status::BadRequest, "BODY_INVALID"),
    };
    let spec = match validate(parsed) {
        Ok(spec) => spec,
        Err(reason) => return error(Status::BadRequest, reason),
    };
    let durable = shard.shared.durable.clone();
    let wait = Duration::from_millis(ADMIN_PG_WAIT_MS);
    let spec_for_pg = spec.clone();
    let create = durable.pg(move |mut client| async move {
        edge::create_activity(&mut client, &spec_for_pg).await
    });
    let created = glommio::timer::timeout(wait, async { Ok(create.await) }).await;
    let outcome = match created {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "create activity failed");
            return error(Status::ServiceUnavailable, "POSTGRES_UNAVAILABLE");
        }
        Err(_) => return error(Status::ServiceUnavailable, "POSTGRES_TIMEOUT"),
    };
    let fresh = match &outcome {
        CreateActivity::Conflict => {
            return error(Status::Conflict, "ACTIVITY_EXISTS_WITH_OTHER_BODY")
        }
        CreateActivity::Created => true,
        CreateActivity::Existing { status } => status == "PENDING",
    };
    if fresh || matches!(&outcome, CreateActivity::Existing { .. }) {
        // Preheat is idempotent (same version → STALE, no change), so a retry after a crash
        // between the steps completes the activation.
        let key = SkuKey::new(spec.activity_id as u64, spec.sku_id as u64);
        let keys = shard.sku_keys(key);
        let args = PreheatArgs {
            status: ActivityStatus::Active,
            start_ms: spec.start_at_ms as u64,
            end_ms: spec.end_at_ms as u64,
            version: 1,
            reservation_ttl_ms: spec.reservation_ttl_ms as u64,
            stock: spec.stock as u64,
        };
        match shard.functions.preheat(&keys, &args).await {
            Ok(PreheatReply::Applied { .. }) | Ok(PreheatReply::Stale { .. }) => {}
            Err(e) => {
                tracing::warn!(error = %e, "preheat failed");
                return error(Status::ServiceUnavailable, "REDIS_UNAVAILABLE");
            }
        }
        // Every shard's scanner finds the SKUs it owns here (survives engine restarts).
        let member = SkuMember { activity_id: key.activity_id, sku_id: key.sku_id };
        if shard.functions.add_active_sku(member).await.is_err() {
            return error(Status::ServiceUnavailable, "REDIS_UNAVAILABLE");
        }
        let activity_id = spec.activity_id;
        let marked = durable
            .pg(move |client| async move { edge::mark_activity_active(&client, activity_id).await })
            .await;
        if marked.is_err() {
            return error(Status::ServiceUnavailable, "POSTGRES_UNAVAILABLE");
        }
    }
    let status =
        if matches!(outcome, CreateActivity::Created) { Status::Created } else { Status::Ok };
    (
        status,
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
        .to_string(),
    )
}

async fn sku_status(shard: &Rc<Shard>, key: SkuKey) -> (Status, String) {
    let (activity_id, sku_id) = (key.activity_id as i64, key.sku_id as i64);
    let config = shard
        .shared
        .durable
        .pg(move |client| async move { edge::sku_config(&client, activity_id, sku_id).await })
        .await;
    let config = match config {
        Ok(Some(config)) => config,
        Ok(None) => return not_found(),
        Err(_) => return error(Status::ServiceUnavailable, "POSTGRES_UNAVAILABLE"),
    };
    let keys = shard.sku_keys(key);
    let counters = shard.functions.counters(&keys).await.ok();
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
    fn sku_path_and_validation() {
        assert_eq!(parse_sku_path("/admin/v1/activities/1/skus/2"), Some(SkuKey::new(1, 2)));
        assert_eq!(parse_sku_path("/admin/v1/activities/1/skus/x"), None);
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
        assert!(constant_time_eq(b"abc", b"abc") && !constant_time_eq(b"abc", b"abd"));
    }
}
