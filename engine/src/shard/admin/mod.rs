//! The admin plane (CONTRACT.md section 4), served by shard 0 on `FLASHSALE_ADMIN_ADDR`: its
//! route table and who may call it. Authenticated with `Authorization: Bearer
//! $FLASHSALE_ADMIN_TOKEN` when a token is configured; without one, only loopback peers are
//! served (and `serve` refuses a non-loopback admin address). `GET /livez` and `GET /readyz`
//! are the exception: they answer anyone, token or not.
//!
//! The handlers, one concern each: [`health`] (health, metrics, drain), [`activity`]
//! (create, inspect), [`lifecycle`] (an activity's later changes), [`modes`], [`refunds`],
//! [`payments`] (orders held PAYMENT_UNKNOWN),
//! [`dlq`] (dead letters), [`stuck`] (stuck reservations); what they use is [`AdminDeps`].

mod activity;
pub mod deps;
mod dlq;
mod health;
mod lifecycle;
mod modes;
mod payments;
mod refunds;
mod stuck;

use bytes::BytesMut;

use crate::http::{write_response, ContentType, Method, Request, ResponseHead, Status};
use crate::logic::auth::bearer_credential;
use crate::logic::ids::{ActivityId, SkuId};
use crate::logic::placement::SkuKey;
use crate::shard::reply::not_found;
use crate::shard::request::RequestCtx;
use crate::shard::shared::EdgeShared;
use deps::AdminDeps;

pub async fn handle(
    deps: &AdminDeps<'_>,
    request: &Request<'_>,
    body: &[u8],
    ctx: &RequestCtx,
    head: &mut ResponseHead<'_>,
    out: &mut BytesMut,
) {
    // Balancers' health checks cannot send a token, and these two reveal nothing.
    if !is_public_health(request) && !authorized(deps.shared, request, ctx) {
        head.status = Status::Unauthorized;
        write_response(out, head, br#"{"state":"UNAUTHORIZED"}"#);
        return;
    }
    let (status, text) = route(deps, request, body).await;
    head.status = status;
    if request.path == "/metrics" && status == Status::Ok {
        head.content_type = ContentType::PrometheusText;
    }
    write_response(out, head, text.as_bytes());
}

/// `GET /livez` and `GET /readyz` answer without a token (CONTRACT.md section 4); `/startupz`
/// keeps it (no balancer needs it, and it is what an orchestrator with credentials polls).
pub fn is_public_health(request: &Request<'_>) -> bool {
    request.method == Method::Get && matches!(request.path, "/livez" | "/readyz")
}

fn authorized(shared: &EdgeShared, request: &Request<'_>, ctx: &RequestCtx) -> bool {
    match &shared.admin_token {
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

async fn route(deps: &AdminDeps<'_>, request: &Request<'_>, body: &[u8]) -> (Status, String) {
    let shared = deps.shared;
    match (request.method, request.path) {
        (Method::Get, "/livez") => health::livez(shared),
        (Method::Get, "/startupz") => health::startupz(shared),
        (Method::Get, "/readyz") => health::readyz(shared),
        (Method::Get, "/metrics") => health::metrics(shared),
        (Method::Post, "/internal/drain") => health::drain(shared),
        (Method::Post, "/admin/v1/activities") => activity::create_activity(deps, body).await,
        (Method::Post, "/admin/v1/mode") => modes::post_mode(shared, body).await,
        (Method::Get, "/admin/v1/mode") => modes::get_mode(shared),
        (Method::Get, "/admin/v1/refunds") => refunds::refunds(shared).await,
        (Method::Get, "/admin/v1/payments/unknown") => payments::unknown(shared).await,
        (Method::Get, "/admin/v1/dlq") => dlq::list(shared, request.query).await,
        (Method::Post, path) if path.starts_with("/admin/v1/dlq/") => {
            let sequence = &path["/admin/v1/dlq/".len()..];
            dlq::act(shared, sequence, body).await
        }
        (Method::Get, path) if path.ends_with("/reconcile") => reconcile(deps, path).await,
        (Method::Get, path) if path.ends_with("/stuck") => {
            match path.strip_suffix("/stuck").and_then(parse_sku_path) {
                Some(key) => stuck::list(deps, key).await,
                None => not_found(),
            }
        }
        (Method::Post, path) if path.contains("/stuck/") => match parse_stuck_path(path) {
            Some((key, reservation_id)) => stuck::resolve(deps, key, reservation_id, body).await,
            None => not_found(),
        },
        (Method::Post, path) if path.starts_with("/admin/v1/activities/") => {
            match lifecycle::route(deps, path, body).await {
                Some(answer) => answer,
                None => not_found(),
            }
        }
        (Method::Get, path) if path.starts_with("/admin/v1/activities/") => {
            match parse_sku_path(path) {
                Some(key) => activity::sku_status(deps, key).await,
                None => not_found(),
            }
        }
        _ => not_found(),
    }
}

/// `GET /admin/v1/activities/{a}/skus/{s}/reconcile`: the conservation report
/// (`crate::shard::reconcile`).
async fn reconcile(deps: &AdminDeps<'_>, path: &str) -> (Status, String) {
    match path.strip_suffix("/reconcile").and_then(parse_sku_path) {
        Some(key) => crate::shard::reconcile::admin_reply(deps.shared, deps.store, key).await,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sku_paths_and_token_comparison() {
        assert_eq!(parse_sku_path("/admin/v1/activities/1/skus/2"), Some(SkuKey::new(1, 2)));
        assert_eq!(parse_sku_path("/admin/v1/activities/1/skus/x"), None);
        assert!(constant_time_eq(b"abc", b"abc") && !constant_time_eq(b"abc", b"abd"));
    }
}
