//! `GET /admin/v1/payments/unknown`: the orders held PAYMENT_UNKNOWN, each keeping its unit
//! until the provider's word settles it (a callback, or `flashsale admin payments reconcile`).
//!
//! Not here: why an order is held (`pg-worker/src/payment_unknown.rs`), the money to give
//! back (`refunds.rs`).

use serde_json::json;

use crate::http::Status;
use crate::shard::reply::error;
use crate::shard::shared::EdgeShared;

/// `GET /admin/v1/payments/unknown`: oldest first, at most `payment_unknown::UNKNOWN_MAX`, each
/// with its `cause` (`AMOUNT_MISMATCH`, `PROVIDER_NO_ANSWER`, `UNVERIFIED`).
pub async fn unknown(shared: &EdgeShared) -> (Status, String) {
    use flashsale_pg_worker::payment_unknown::{list_unknown, UNKNOWN_MAX};
    let listed =
        shared.durable.pg(|client| async move { list_unknown(&client, UNKNOWN_MAX).await }).await;
    match listed {
        Ok(orders) => {
            let items: Vec<_> = orders
                .iter()
                .map(|o| {
                    json!({
                        "order_id": o.order_id,
                        "activity_id": o.activity_id,
                        "sku_id": o.sku_id,
                        "user_id": o.user_id,
                        "amount_cents": o.amount_cents,
                        "since_ms": o.since_ms,
                        "pay_deadline_ms": o.pay_deadline_ms,
                        "cause": o.cause,
                    })
                })
                .collect();
            (Status::Ok, json!({"count": items.len(), "orders": items}).to_string())
        }
        Err(e) => {
            tracing::warn!(error = %e, "listing PAYMENT_UNKNOWN orders failed");
            error(Status::ServiceUnavailable, "PG_UNAVAILABLE")
        }
    }
}
