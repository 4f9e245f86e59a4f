//! Orders whose payment is unknown keep their unit (seed ch9 §7.10; DESIGN.md section 6):
//! the closer's round when no payment provider can be asked, the operator's listing of the
//! orders held `PAYMENT_UNKNOWN`, and their gauges.
//!
//! What it is: [`hold_due_orders`], one bounded round of the closer without a provider (the
//! default; migration 0008's `flashsale_order_hold_unknown`, one transaction per order): an
//! unpaid order past its pay timeout with no word from the provider becomes PAYMENT_UNKNOWN
//! and keeps its unit; one with a recorded FAILED/CLOSED payment (the provider's own word) is
//! closed. [`list_unknown`] (`GET /admin/v1/payments/unknown`) and [`record_gauges`]
//! (`flashsale_orders_payment_unknown`, `flashsale_orders_payment_unknown_oldest_seconds`,
//! set after every closer round) make the held orders visible, so a person settles them — by
//! the provider's statement (`payment_reconcile.rs`) or a late callback.
//!
//! What it is not: the state machine (`payments.rs` and migrations 0003, 0005, 0008), the
//! closer that asks a provider (`payments::close_due_orders_verified`), or the opt-in that
//! closes without asking (`payments::close_due_orders`, `WithoutProvider::CloseUnverified`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;

use crate::error::PgError;
use crate::payments::{CLOSE_BATCH_MAX, CLOSE_CANDIDATES_SQL};

const HOLD_SQL: &str = "SELECT r_outcome, r_status FROM flashsale_order_hold_unknown($1, $2)";

/// The held orders, oldest first, with why each is held: a PAID of another amount
/// (`AMOUNT_MISMATCH`), a provider that was asked and gave no authoritative answer
/// (`PROVIDER_NO_ANSWER`), or nobody to ask / a non-authoritative callback (`UNVERIFIED`).
const LIST_SQL: &str = "\
    SELECT o.order_id, o.activity_id, o.sku_id, o.user_id, o.amount_cents, \
           (extract(epoch FROM o.updated_at) * 1000)::bigint, \
           (extract(epoch FROM o.created_at) * 1000)::bigint + a.pay_timeout_ms, \
           CASE WHEN EXISTS (SELECT 1 FROM payment p WHERE p.order_id = o.order_id \
                             AND p.outcome = 'AMOUNT_MISMATCH') THEN 'AMOUNT_MISMATCH' \
                WHEN q.order_id IS NOT NULL THEN 'PROVIDER_NO_ANSWER' \
                ELSE 'UNVERIFIED' END \
    FROM orders o JOIN activity a ON a.activity_id = o.activity_id \
    LEFT JOIN payment_status_ask q ON q.order_id = o.order_id \
    WHERE o.status = 'PAYMENT_UNKNOWN' \
    ORDER BY o.created_at, o.order_id LIMIT $1";

/// Count and oldest (by last change, ≈ since held) of the held orders
/// (`orders_payment_unknown_idx`).
const GAUGES_SQL: &str = "\
    SELECT count(*), coalesce(extract(epoch FROM $1::timestamptz - min(updated_at)), 0)::float8 \
    FROM orders WHERE status = 'PAYMENT_UNKNOWN'";

/// Largest listing of held orders.
pub const UNKNOWN_MAX: usize = 1_000;

/// What one no-provider closer round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HoldRound {
    /// Candidates the scan returned (at most the batch).
    pub candidates: usize,
    /// Order ids now PAYMENT_UNKNOWN, their unit kept.
    pub held: Vec<String>,
    /// Order ids closed because a FAILED/CLOSED payment was recorded for them.
    pub closed: Vec<String>,
    /// Candidates left alone: locked by someone, paid or cancelled meanwhile, not due.
    pub skipped: usize,
    /// Candidates whose transaction failed permanently (logged; the rest still handled).
    pub failed: usize,
}

/// One bounded round at `now_ms` of the closer without a provider (see the module
/// documentation). Errors as `payments::close_due_orders`: a transient one ends the round, a
/// permanent one on one order is logged and counted.
pub async fn hold_due_orders(
    client: &Client,
    batch_max: usize,
    now_ms: u64,
) -> Result<HoldRound, PgError> {
    if !(1..=CLOSE_BATCH_MAX).contains(&batch_max) {
        return Err(PgError::InvalidArgument("batch_max must be within 1..=CLOSE_BATCH_MAX"));
    }
    let now = system_time(now_ms);
    let rows = client.query(CLOSE_CANDIDATES_SQL, &[&now, &(batch_max as i64)]).await?;
    let mut round = HoldRound { candidates: rows.len(), ..HoldRound::default() };
    for row in rows {
        let order_id: String = row.try_get(0)?;
        match client.query_one(HOLD_SQL, &[&order_id, &now]).await {
            Ok(row) => {
                let outcome: String = row.try_get(0)?;
                note(&mut round, order_id, &outcome);
            }
            Err(e) => {
                let e = PgError::from(e);
                if e.is_transient() {
                    return Err(e);
                }
                round.failed += 1;
                tracing::error!(order_id = %order_id, error = %e, "holding an order failed");
            }
        }
    }
    Ok(round)
}

fn note(round: &mut HoldRound, order_id: String, outcome: &str) {
    match outcome {
        "HELD" => {
            metrics::counter!("flashsale_orders_held_total", "cause" => "no_provider").increment(1);
            tracing::warn!(
                order_id = %order_id,
                "order past its pay timeout with no word from the payment provider: \
                 PAYMENT_UNKNOWN, its unit kept (settle it: flashsale admin payments)"
            );
            round.held.push(order_id);
        }
        "RELEASED" => {
            metrics::counter!("flashsale_orders_released_total", "kind" => "close").increment(1);
            tracing::info!(order_id = %order_id, "order with a FAILED/CLOSED payment closed after its pay timeout");
            round.closed.push(order_id);
        }
        _ => round.skipped += 1,
    }
}

/// One order held PAYMENT_UNKNOWN (`GET /admin/v1/payments/unknown`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownOrder {
    pub order_id: String,
    pub activity_id: i64,
    pub sku_id: i64,
    pub user_id: i64,
    pub amount_cents: Option<i64>,
    /// When the order last changed (Unix ms): about when it was held.
    pub since_ms: i64,
    /// When its pay timeout passed (Unix ms).
    pub pay_deadline_ms: i64,
    /// `AMOUNT_MISMATCH`, `PROVIDER_NO_ANSWER` or `UNVERIFIED` (see [`LIST_SQL`]).
    pub cause: String,
}

/// The orders held PAYMENT_UNKNOWN, oldest first, at most `limit` (1..=[`UNKNOWN_MAX`]).
pub async fn list_unknown(client: &Client, limit: usize) -> Result<Vec<UnknownOrder>, PgError> {
    if !(1..=UNKNOWN_MAX).contains(&limit) {
        return Err(PgError::InvalidArgument("limit must be within 1..=UNKNOWN_MAX"));
    }
    let rows = client.query(LIST_SQL, &[&(limit as i64)]).await?;
    let mut orders = Vec::with_capacity(rows.len());
    for row in rows {
        orders.push(UnknownOrder {
            order_id: row.try_get(0)?,
            activity_id: row.try_get(1)?,
            sku_id: row.try_get(2)?,
            user_id: row.try_get(3)?,
            amount_cents: row.try_get(4)?,
            since_ms: row.try_get(5)?,
            pay_deadline_ms: row.try_get(6)?,
            cause: row.try_get(7)?,
        });
    }
    Ok(orders)
}

/// Sets `flashsale_orders_payment_unknown` (held orders now) and
/// `flashsale_orders_payment_unknown_oldest_seconds` (how long the oldest has been held; 0
/// when none), which the alert `FlashsalePaymentUnknownOrders` reads.
pub async fn record_gauges(client: &Client, now_ms: u64) -> Result<(), PgError> {
    let row = client.query_one(GAUGES_SQL, &[&system_time(now_ms)]).await?;
    let count: i64 = row.try_get(0)?;
    let oldest_s: f64 = row.try_get(1)?;
    metrics::gauge!("flashsale_orders_payment_unknown").set(count as f64);
    metrics::gauge!("flashsale_orders_payment_unknown_oldest_seconds").set(oldest_s.max(0.0));
    Ok(())
}

fn system_time(unix_ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(unix_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sql_outcomes_match_the_migration() {
        let migration = include_str!("../migrations/0008_payment_hold.sql");
        for outcome in ["HELD", "PAYMENT_UNKNOWN"] {
            assert!(migration.contains(&format!("'{outcome}'")), "{outcome}");
        }
        // RELEASED comes from flashsale_order_release, which 0008 calls.
        assert!(migration.contains("flashsale_order_release(p_order_id, 'CLOSE'"));
        assert!(include_str!("../migrations/0003_payments.sql").contains("'RELEASED'"));
    }

    #[test]
    fn outcomes_are_counted_where_they_belong() {
        let mut round = HoldRound::default();
        note(&mut round, "a".into(), "HELD");
        note(&mut round, "b".into(), "RELEASED");
        note(&mut round, "c".into(), "BUSY");
        assert_eq!(
            (round.held, round.closed, round.skipped),
            (vec!["a".into()], vec!["b".into()], 1)
        );
    }
}
