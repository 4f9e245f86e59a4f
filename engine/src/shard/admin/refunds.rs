//! `GET /admin/v1/refunds`: the money to give back, as PostgreSQL recorded it.
//!
//! Not here: how a payment's outcome is decided (`pg-worker/src/payments.rs`).

use serde_json::json;

use crate::http::Status;
use crate::shard::reply::error;
use crate::shard::shared::EdgeShared;

/// `GET /admin/v1/refunds`: payments recorded REFUND_NEEDED (money received for an order
/// that no longer takes it) or AMOUNT_MISMATCH (another amount than the order's), oldest
/// first, at most `payments::REFUNDS_MAX`. Each also produced a `refund_requested` event on `seckill.event.refund_requested` when its order exists.
pub async fn refunds(shared: &EdgeShared) -> (Status, String) {
    use flashsale_pg_worker::payments::{list_refunds, REFUNDS_MAX};
    let listed =
        shared.durable.pg(|client| async move { list_refunds(&client, REFUNDS_MAX).await }).await;
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
