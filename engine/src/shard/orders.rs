//! Orders and payments on the public port (CONTRACT.md 3.4; DESIGN.md section 6):
//!
//! - `GET /v1/orders/{order_id}?activity_id=..`: the order, to its buyer only (the user comes
//!   from the pass, and passes are per activity, hence the parameter);
//! - `POST /v1/orders/{order_id}/cancel?activity_id=..`: the buyer cancels an unpaid order;
//! - `POST /v1/payments/callback`: the payment provider's callback, authenticated not by a
//!   user pass but by `signature` = lowercase hex HMAC-SHA256(`FLASHSALE_PAYMENT_KEY`,
//!   `v1|{payment_id}|{order_id}|{status}|{amount_cents}`), compared in constant time. Without
//!   a configured key every callback is refused (`503 PAYMENTS_DISABLED`).
//!
//! The `order_cancelled` event a release writes is applied by `shard/sync.rs` (`compensate`
//! once per reservation, so a cancelled or closed order's unit returns exactly once).
//!
//! Every PostgreSQL call goes through `DurableHandle::pg` to `flashsale_pg_worker::payments`,
//! which owns the SQL and the state machine. A call that failed or timed out after it was sent
//! answers `503 UNKNOWN`: the client (or provider) retries, and every call is idempotent.
//!
//! What it is not: a hot path (a few calls per order, not per buyer), so answers are built in
//! a small fresh buffer rather than the shard's reused ones.

use bytes::BytesMut;
use flashsale_io::payment::Signed;
use flashsale_pg_worker::payments::{self, CallbackOutcome, PaymentCallback, ReleaseOutcome};
use serde::Deserialize;

use super::limiters::Limiters;
use super::request::RequestCtx;
use super::shared::EdgeShared;
use super::state::Shard;
use crate::durable::DurableError;
use crate::http::json::JsonObject;
use crate::http::{write_response, Method, Request, ResponseHead, Status};
use crate::logic::clock::now_ms;
use crate::logic::ids::ActivityId;

/// Path prefix of the order routes.
pub const ORDERS_PREFIX: &str = "/v1/orders/";
/// The callback route.
pub const CALLBACK_PATH: &str = "/v1/payments/callback";
/// Longest id accepted (order and payment ids), the alphabet being `[A-Za-z0-9_-]`.
pub const ID_LEN_MAX: usize = 64;
/// Longest callback status accepted (`[A-Z_]`).
pub const STATUS_LEN_MAX: usize = 32;
/// How long a client should wait before retrying after a 503.
const RETRY_AFTER_MS: u64 = 1_000;

// ---------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------

/// What orders and payment callbacks touch: the limiters and the shared edge state (pass
/// keys, the payment key, the durable side for PostgreSQL, metrics). No Redis: orders live in
/// PostgreSQL.
pub struct OrderDeps<'a> {
    pub id: usize,
    pub shared: &'a EdgeShared,
    pub limiters: &'a Limiters,
}

impl<'a> OrderDeps<'a> {
    pub fn of(shard: &'a Shard) -> OrderDeps<'a> {
        OrderDeps { id: shard.id, shared: &shard.shared, limiters: &shard.limiters }
    }
}

/// `…/v1/orders/{rest}`: `{order_id}` (GET) or `{order_id}/cancel` (POST).
pub async fn handle_order(
    deps: &OrderDeps<'_>,
    request: &Request<'_>,
    ctx: &RequestCtx,
    rest: &str,
    head: &mut ResponseHead<'_>,
    out: &mut BytesMut,
) {
    let (order_id, cancel) = match rest.strip_suffix("/cancel") {
        Some(id) => (id, true),
        None => (rest, false),
    };
    let answer = match (request.method, cancel) {
        (Method::Get, false) => get_order(deps, request, ctx, order_id).await,
        (Method::Post, true) => cancel_order(deps, request, ctx, order_id).await,
        _ if valid_id(order_id) => {
            Answer::state(Status::MethodNotAllowed, "INVALID").reason("METHOD")
        }
        _ => Answer::state(Status::NotFound, "INVALID").reason("NO_SUCH_ROUTE"),
    };
    answer.write(head, out);
}

/// `POST /v1/payments/callback`.
pub async fn handle_callback(
    deps: &OrderDeps<'_>,
    body: &[u8],
    ctx: &RequestCtx,
    head: &mut ResponseHead<'_>,
    out: &mut BytesMut,
) {
    let answer = match deps.limiters.check_address(ctx.peer_ip, now_ms()) {
        Ok(()) => callback(deps, body).await,
        Err(retry_ms) => Answer::rate_limited(retry_ms),
    };
    answer.write(head, out);
}

// ---------------------------------------------------------------------------------------------
// Answers
// ---------------------------------------------------------------------------------------------

/// A response being assembled: status and flat JSON fields, in order.
struct Answer {
    status: Status,
    retry_after_ms: Option<u64>,
    fields: Vec<(&'static str, Field)>,
}

enum Field {
    Text(String),
    Static(&'static str),
    Int(u64),
    Bool(bool),
}

impl Answer {
    fn state(status: Status, state: &'static str) -> Answer {
        Answer { status, retry_after_ms: None, fields: vec![("state", Field::Static(state))] }
    }

    fn reason(mut self, reason: &'static str) -> Answer {
        self.fields.push(("reason_code", Field::Static(reason)));
        self
    }

    fn text(mut self, name: &'static str, value: impl Into<String>) -> Answer {
        self.fields.push((name, Field::Text(value.into())));
        self
    }

    fn int(mut self, name: &'static str, value: i64) -> Answer {
        self.fields.push((name, Field::Int(u64::try_from(value).unwrap_or(0))));
        self
    }

    fn flag(mut self, name: &'static str, value: bool) -> Answer {
        self.fields.push((name, Field::Bool(value)));
        self
    }

    fn retry(mut self) -> Answer {
        self.retry_after_ms = Some(RETRY_AFTER_MS);
        self
    }

    fn rate_limited(retry_after_ms: u64) -> Answer {
        let limited = Answer::state(Status::TooManyRequests, "RATE_LIMITED");
        Answer { retry_after_ms: Some(retry_after_ms), ..limited }
    }

    fn unauthorized() -> Answer {
        Answer::state(Status::Unauthorized, "UNAUTHORIZED")
    }

    fn invalid(reason: &'static str) -> Answer {
        Answer::state(Status::BadRequest, "INVALID").reason(reason)
    }

    fn not_found() -> Answer {
        Answer::state(Status::NotFound, "NOT_FOUND")
    }

    /// The durable side could not answer: a full queue means nothing was sent (busy); any
    /// other failure may have happened after the statement was sent (unknown).
    fn from_durable(error: &DurableError) -> Answer {
        match error {
            DurableError::Unavailable => Answer::state(Status::ServiceUnavailable, "SYSTEM_BUSY"),
            other => {
                tracing::warn!(error = %other, "order/payment call failed");
                Answer::state(Status::ServiceUnavailable, "UNKNOWN")
            }
        }
        .retry()
    }

    fn write(self, head: &mut ResponseHead<'_>, out: &mut BytesMut) {
        head.status = self.status;
        head.retry_after_ms = self.retry_after_ms;
        let mut body = BytesMut::with_capacity(256);
        let mut object = JsonObject::begin(&mut body);
        for (name, field) in &self.fields {
            match field {
                Field::Text(value) => object.str(name, value),
                Field::Static(value) => object.str(name, value),
                Field::Int(value) => object.u64(name, *value),
                Field::Bool(value) => object.bool(name, *value),
            };
        }
        object.finish();
        write_response(out, head, &body);
    }
}

// ---------------------------------------------------------------------------------------------
// GET and cancel
// ---------------------------------------------------------------------------------------------

/// The buyer behind the request: a valid pass for the `activity_id` query parameter, and
/// the order id well-formed.
fn authorized(
    deps: &OrderDeps<'_>,
    request: &Request<'_>,
    ctx: &RequestCtx,
    order_id: &str,
) -> Result<(i64, i64), Answer> {
    let now = now_ms();
    deps.limiters.check_address(ctx.peer_ip, now).map_err(Answer::rate_limited)?;
    if !valid_id(order_id) {
        return Err(Answer::invalid("ORDER_ID_INVALID"));
    }
    let activity = activity_param(request.query.unwrap_or(""))?;
    let auth = request.authorization.ok_or_else(Answer::unauthorized)?;
    let pass = deps
        .shared
        .pass_keys
        .verify(auth.as_bytes(), now_ms() / 1000)
        .map_err(|_| Answer::unauthorized())?;
    if !pass.authorizes(activity) {
        return Err(Answer::unauthorized());
    }
    deps.limiters.check_reader(pass.user_id.0, now).map_err(Answer::rate_limited)?;
    // ids are 1..=i64::MAX (ids.rs), so these conversions never saturate.
    let activity_id = i64::try_from(activity.0).unwrap_or(i64::MAX);
    let user_id = i64::try_from(pass.user_id.0).unwrap_or(i64::MAX);
    Ok((activity_id, user_id))
}

async fn get_order(
    deps: &OrderDeps<'_>,
    request: &Request<'_>,
    ctx: &RequestCtx,
    order_id: &str,
) -> Answer {
    let (activity_id, user_id) = match authorized(deps, request, ctx, order_id) {
        Ok(ids) => ids,
        Err(answer) => return answer,
    };
    let id = order_id.to_owned();
    let found =
        deps.shared
            .durable
            .pg(move |client| async move {
                payments::find_order(&client, &id, activity_id, user_id).await
            })
            .await;
    match found {
        Ok(Some(order)) => {
            // `state` is the order's status, the field every answer leads with.
            let mut answer = Answer {
                status: Status::Ok,
                retry_after_ms: None,
                fields: vec![("state", Field::Text(order.status))],
            }
            .text("order_id", order.order_id)
            .int("activity_id", order.activity_id)
            .int("sku_id", order.sku_id)
            .text("reservation_id", order.reservation_id)
            .text("request_id", order.request_id);
            if let Some(amount) = order.amount_cents {
                answer = answer.int("amount_cents", amount);
            }
            answer
                .int("created_at_ms", order.created_at_ms)
                .int("updated_at_ms", order.updated_at_ms)
                .int("pay_deadline_ms", order.pay_deadline_ms)
        }
        Ok(None) => Answer::not_found(),
        Err(e) => Answer::from_durable(&e),
    }
}

async fn cancel_order(
    deps: &OrderDeps<'_>,
    request: &Request<'_>,
    ctx: &RequestCtx,
    order_id: &str,
) -> Answer {
    let (activity_id, user_id) = match authorized(deps, request, ctx, order_id) {
        Ok(ids) => ids,
        Err(answer) => return answer,
    };
    let id = order_id.to_owned();
    let now = now_ms();
    let released = deps
        .shared
        .durable
        .pg(move |client| async move {
            payments::cancel_order(&client, &id, activity_id, user_id, now).await
        })
        .await;
    let base = |status, state| Answer::state(status, state).text("order_id", order_id);
    match released {
        Ok(ReleaseOutcome::Released) => base(Status::Ok, "CANCELLED"),
        // A retried cancel: the first one won.
        Ok(ReleaseOutcome::NotPending { status }) if status == "CANCELLED" => {
            base(Status::Ok, "CANCELLED").flag("replayed", true)
        }
        Ok(ReleaseOutcome::NotPending { status }) => {
            Answer::state(Status::Conflict, "NOT_CANCELLABLE")
                .text("order_id", order_id)
                .text("status", status)
        }
        Ok(ReleaseOutcome::PaidRecorded) => {
            base(Status::Conflict, "NOT_CANCELLABLE").reason("PAYMENT_RECORDED")
        }
        Ok(ReleaseOutcome::NotFound) => Answer::not_found(),
        // Close-only outcomes: cannot happen for a cancel; say "try again" rather than guess.
        Ok(ReleaseOutcome::Busy | ReleaseOutcome::NotDue) => {
            Answer::state(Status::ServiceUnavailable, "UNKNOWN").retry()
        }
        Err(e) => Answer::from_durable(&e),
    }
}

/// `activity_id` from a query string (canonical decimal; a second one is refused, as in the
/// reservation query).
fn activity_param(query: &str) -> Result<ActivityId, Answer> {
    let mut activity: Option<&str> = None;
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if name == "activity_id" && activity.replace(value).is_some() {
            return Err(Answer::invalid("DUPLICATE_FIELD"));
        }
    }
    activity
        .and_then(|text| ActivityId::parse_decimal(text.as_bytes()))
        .ok_or_else(|| Answer::invalid("ACTIVITY_ID_INVALID"))
}

/// 1..=[`ID_LEN_MAX`] bytes of `[A-Za-z0-9_-]`.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= ID_LEN_MAX
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

// ---------------------------------------------------------------------------------------------
// Payment callback
// ---------------------------------------------------------------------------------------------

/// The callback body. Every field is required; unknown fields are ignored (as for submits).
#[derive(Deserialize)]
struct CallbackBody {
    payment_id: Option<String>,
    order_id: Option<String>,
    status: Option<String>,
    amount_cents: Option<u64>,
    signature: Option<String>,
}

/// A callback that passed validation (its signature not yet checked).
struct ParsedCallback {
    payment_id: String,
    order_id: String,
    status: String,
    amount_cents: u64,
    signature: String,
}

fn parse_callback(body: &[u8]) -> Result<ParsedCallback, &'static str> {
    let parsed: CallbackBody = serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => "BODY_INVALID",
        _ => "BODY_NOT_JSON",
    })?;
    let payment_id = parsed.payment_id.filter(|id| valid_id(id)).ok_or("PAYMENT_ID_INVALID")?;
    let order_id = parsed.order_id.filter(|id| valid_id(id)).ok_or("ORDER_ID_INVALID")?;
    let status = parsed
        .status
        .filter(|s| {
            !s.is_empty()
                && s.len() <= STATUS_LEN_MAX
                && s.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
        })
        .ok_or("STATUS_INVALID")?;
    let amount_cents =
        parsed.amount_cents.filter(|&a| i64::try_from(a).is_ok()).ok_or("AMOUNT_CENTS_INVALID")?;
    let signature = parsed.signature.filter(|s| s.len() == 64).ok_or("SIGNATURE_INVALID")?;
    Ok(ParsedCallback { payment_id, order_id, status, amount_cents, signature })
}

async fn callback(deps: &OrderDeps<'_>, body: &[u8]) -> Answer {
    let Some(key) = deps.shared.config.payment_key.as_ref() else {
        return Answer::state(Status::ServiceUnavailable, "PAYMENTS_DISABLED");
    };
    let parsed = match parse_callback(body) {
        Ok(parsed) => parsed,
        Err(reason) => return Answer::invalid(reason),
    };
    let signed = Signed {
        payment_id: &parsed.payment_id,
        order_id: &parsed.order_id,
        status: &parsed.status,
        amount_cents: parsed.amount_cents,
    };
    if !signed.verify(key, &parsed.signature) {
        deps.shared
            .shard_metrics(deps.id)
            .callback_bad_signature
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(suppressed) = deps.limiters.bad_signature_log(now_ms()) {
            tracing::warn!(
                payment_id = %parsed.payment_id,
                suppressed,
                "payment callback with a bad signature (one line a second at most)"
            );
        }
        return Answer::unauthorized().reason("BAD_SIGNATURE");
    }
    let callback = PaymentCallback {
        payment_id: parsed.payment_id,
        order_id: parsed.order_id,
        status: parsed.status,
        // Checked to fit by parse_callback.
        amount_cents: i64::try_from(parsed.amount_cents).unwrap_or(i64::MAX),
    };
    let (payment_id, order_id) = (callback.payment_id.clone(), callback.order_id.clone());
    let now = now_ms();
    let applied = deps
        .shared
        .durable
        .pg(move |client| async move { payments::apply_callback(&client, &callback, now).await })
        .await;
    match applied {
        Ok(result) => {
            let status = match result.outcome {
                CallbackOutcome::PaymentConflict => Status::Conflict,
                _ => Status::Ok,
            };
            let mut answer = Answer::state(status, result.outcome.as_str())
                .text("payment_id", payment_id)
                .text("order_id", order_id);
            if let Some(order_status) = result.order_status {
                answer = answer.text("order_status", order_status);
            }
            answer = answer.flag("refund_needed", result.outcome.refund_needed());
            if result.replayed {
                answer = answer.flag("replayed", true);
            }
            answer
        }
        Err(e) => Answer::from_durable(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callback_bodies_are_validated_field_by_field() {
        let sig = "a".repeat(64);
        let ok = format!(
            r#"{{"payment_id":"pay_1","order_id":"ord_1","status":"PAID","amount_cents":5,"signature":"{sig}","extra":1}}"#
        );
        assert!(parse_callback(ok.as_bytes()).is_ok());
        let cases = [
            ("{", "BODY_NOT_JSON"),
            (r#"{"amount_cents":"5"}"#, "BODY_INVALID"),
            (r#"{"amount_cents":-5}"#, "BODY_INVALID"),
            (r#"{"order_id":"o","status":"PAID","amount_cents":5}"#, "PAYMENT_ID_INVALID"),
            (
                r#"{"payment_id":"p|1","order_id":"o","status":"PAID","amount_cents":5}"#,
                "PAYMENT_ID_INVALID",
            ),
            (
                r#"{"payment_id":"p","order_id":"","status":"PAID","amount_cents":5}"#,
                "ORDER_ID_INVALID",
            ),
            (
                r#"{"payment_id":"p","order_id":"o","status":"paid","amount_cents":5}"#,
                "STATUS_INVALID",
            ),
            (r#"{"payment_id":"p","order_id":"o","status":"PAID"}"#, "AMOUNT_CENTS_INVALID"),
            (
                r#"{"payment_id":"p","order_id":"o","status":"PAID","amount_cents":9223372036854775808}"#,
                "AMOUNT_CENTS_INVALID",
            ),
            (
                r#"{"payment_id":"p","order_id":"o","status":"PAID","amount_cents":5,"signature":"ab"}"#,
                "SIGNATURE_INVALID",
            ),
        ];
        for (body, reason) in cases {
            assert_eq!(parse_callback(body.as_bytes()).err(), Some(reason), "{body}");
        }
    }

    #[test]
    fn activity_param_is_required_and_canonical() {
        assert_eq!(activity_param("activity_id=7").ok(), Some(ActivityId(7)));
        assert_eq!(activity_param("x=1&activity_id=7").ok(), Some(ActivityId(7)));
        assert!(activity_param("").is_err());
        assert!(activity_param("activity_id=07").is_err());
        assert!(activity_param("activity_id=7&activity_id=7").is_err());
    }
}
