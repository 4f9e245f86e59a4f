//! The PostgreSQL half of the reconcile report (DESIGN.md section 8): every count of one SKU
//! and the ids behind every non-zero finding, read in ONE read-only REPEATABLE READ
//! transaction so that all of it describes one snapshot.
//!
//! What it is: [`reconcile_postgres`] runs [`crate::audit::check_invariants`] (I1–I3, I7, the
//! judge stays there), adds the counts the audit does not need (orders, reservations and
//! ledger rows by status/kind, inbox rows, two further checks: reservations without an inbox
//! row (I7) and request ids with two reservations (I6)), lists the ids behind each non-zero
//! finding through the audit's own row sets ([`crate::audit::FINDINGS`]), and reads the SKU's
//! reservations (id, status, order) for the engine's cross-check against Redis (I4, I5).
//! [`reservation_statuses`] re-reads chosen reservations after the Redis read, so that an
//! outcome committed between the two reads is not reported as a gap.
//!
//! What it is not: Redis, the merge or the verdict (`engine/src/logic/reconcile.rs`, its reads
//! `engine/src/shard/reconcile.rs`); a repair tool (it writes nothing).

use std::collections::BTreeMap;

use tokio_postgres::{Client, IsolationLevel, Row};

use crate::audit::{check_invariants, InvariantReport, FINDINGS};
use crate::error::PgError;

/// Bounds of one reconcile read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PgReconcileLimits {
    /// Ids listed per finding (all are counted).
    pub ids_listed_max: usize,
    /// Reservations read for the cross-check; beyond it the list is truncated and the
    /// cross-check is incomplete (the report says so).
    pub reservations_max: usize,
    /// `statement_timeout` of the snapshot's statements (0: the server's): the caller's own
    /// bound, so a report given up on does not keep PostgreSQL busy.
    pub statement_timeout_ms: u64,
}

/// Up to `ids_listed_max` ids of one finding, and whether there were more.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct IdSample {
    pub ids: Vec<String>,
    pub truncated: bool,
}

/// One reservation as PostgreSQL recorded it, with its order if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgReservation {
    pub reservation_id: String,
    /// `inventory_reservation.status`.
    pub status: String,
    pub order_id: Option<String>,
    /// The order's status (`orders.status`), when an order row exists for the reservation.
    pub order_status: Option<String>,
    pub reserved_at_ms: Option<i64>,
    /// When the order last changed (a cancellation's time), ms.
    pub order_updated_at_ms: Option<i64>,
}

impl PgReservation {
    /// The order exists and is not CANCELLED/CLOSED (it holds a unit).
    pub fn order_live(&self) -> bool {
        matches!(self.order_status.as_deref(), Some(s) if s != "CANCELLED" && s != "CLOSED")
    }
}

/// What PostgreSQL knows about one SKU.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PgReconcile {
    /// The audit's counts and its violations in words (the judge of I1–I3, I7).
    pub invariants: InvariantReport,
    pub orders_by_status: BTreeMap<String, i64>,
    pub reservations_by_status: BTreeMap<String, i64>,
    pub ledger_by_kind: BTreeMap<String, i64>,
    /// `consumer_inbox` rows (any consumer group) of this SKU's reservations.
    pub inbox_rows: i64,
    /// Reservations with no inbox row: an effect without its "applied once" record (I7).
    pub reservations_without_inbox: i64,
    /// (user, request id) pairs with more than one reservation (I6: one request id → one
    /// reservation id; possible when Redis lost the request record and the client retried).
    pub duplicate_requests: i64,
    /// Ids behind each non-zero finding, by finding name (the audit's field names, plus
    /// `orders_over_stock`, `reservations_without_inbox`, `duplicate_requests`).
    pub ids: BTreeMap<&'static str, IdSample>,
    /// The SKU's reservations (for the Redis cross-check; not serialized).
    #[serde(skip)]
    pub reservations: Vec<PgReservation>,
    /// `reservations` hit `reservations_max`: the cross-check is incomplete.
    pub reservations_truncated: bool,
    /// The activity's release policy puts a cancelled or closed order's unit back on sale
    /// (`BACK_TO_SALE`), so Redis must get it back; false for `RELEASED` (or no activity).
    pub release_returns_stock: bool,
}

/// Reservations (ids) with no inbox row.
const RESERVATIONS_WITHOUT_INBOX_SQL: &str = "\
SELECT r.reservation_id FROM inventory_reservation r \
WHERE r.activity_id = $1 AND r.sku_id = $2 \
  AND NOT EXISTS (SELECT 1 FROM consumer_inbox i WHERE i.reservation_id = r.reservation_id)";

/// Reservations (ids) sharing their (user, request id) with another reservation.
const DUPLICATE_REQUESTS_SQL: &str = "\
SELECT r.reservation_id FROM inventory_reservation r \
WHERE r.activity_id = $1 AND r.sku_id = $2 \
  AND (r.user_id, r.request_id) IN (SELECT user_id, request_id FROM inventory_reservation \
                                    WHERE activity_id = $1 AND sku_id = $2 \
                                    GROUP BY user_id, request_id HAVING count(*) > 1)";

/// Counts the audit does not need. The inbox has no index on reservation_id (its key is the
/// message id): these are hash joins over the inbox, fine for an on-demand/periodic report.
const COUNTS_SQL: &str = "\
SELECT \
  (SELECT count(*) FROM consumer_inbox i JOIN inventory_reservation r \
     ON r.reservation_id = i.reservation_id WHERE r.activity_id = $1 AND r.sku_id = $2), \
  (SELECT count(*) FROM inventory_reservation r \
     WHERE r.activity_id = $1 AND r.sku_id = $2 \
       AND NOT EXISTS (SELECT 1 FROM consumer_inbox i WHERE i.reservation_id = r.reservation_id)), \
  (SELECT count(*) FROM (SELECT 1 FROM inventory_reservation \
     WHERE activity_id = $1 AND sku_id = $2 \
     GROUP BY user_id, request_id HAVING count(*) > 1) x)";

const ORDERS_BY_STATUS_SQL: &str = "\
SELECT status, count(*) FROM orders WHERE activity_id = $1 AND sku_id = $2 GROUP BY status";
const RESERVATIONS_BY_STATUS_SQL: &str = "\
SELECT status, count(*) FROM inventory_reservation WHERE activity_id = $1 AND sku_id = $2 \
GROUP BY status";
const LEDGER_BY_KIND_SQL: &str = "\
SELECT kind, count(*) FROM inventory_ledger WHERE activity_id = $1 AND sku_id = $2 GROUP BY kind";

/// Live orders beyond the stock, latest first (the ones that should not exist).
const ORDERS_OVER_STOCK_SQL: &str = "\
SELECT order_id FROM orders \
WHERE activity_id = $1 AND sku_id = $2 AND status NOT IN ('CANCELLED', 'CLOSED') \
ORDER BY created_at DESC, order_id DESC LIMIT $3";

const RESERVATION_COLUMNS: &str = "\
SELECT r.reservation_id, r.status, r.order_id, \
       (extract(epoch FROM r.reserved_at) * 1000)::bigint, o.status, \
       (extract(epoch FROM o.updated_at) * 1000)::bigint \
FROM inventory_reservation r LEFT JOIN orders o ON o.reservation_id = r.reservation_id";

/// Reads everything PostgreSQL knows about one SKU in one read-only snapshot.
pub async fn reconcile_postgres(
    client: &mut Client,
    activity_id: i64,
    sku_id: i64,
    limits: PgReconcileLimits,
) -> Result<PgReconcile, PgError> {
    if limits.ids_listed_max == 0 || limits.reservations_max == 0 {
        return Err(PgError::InvalidArgument("reconcile limits must be above zero"));
    }
    let txn = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    let c = txn.client();
    if limits.statement_timeout_ms > 0 {
        let set = format!("SET LOCAL statement_timeout = {}", limits.statement_timeout_ms);
        c.batch_execute(&set).await?;
    }
    // Every query here reads whole SKUs (joins of tens of thousands of rows). In a sale the
    // tables grow from nothing in seconds, faster than autovacuum's ANALYZE (a minute's nap),
    // and with the stale row estimates the planner picks nested loops — the anti-join of
    // reservations against the inbox (no index on reservation_id) went quadratic: > 30 s for
    // 23,624 reservations, 1.3 s once analyzed. Without nested loops the plans are hash or
    // merge joins, linear whatever the statistics say.
    c.batch_execute("SET LOCAL enable_nestloop = off").await?;
    let invariants = check_invariants(c, activity_id, sku_id).await?;
    let keys: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&activity_id, &sku_id];
    let counts = c.query_one(COUNTS_SQL, &keys).await?;
    let mut report = PgReconcile {
        orders_by_status: grouped(&c.query(ORDERS_BY_STATUS_SQL, &keys).await?)?,
        reservations_by_status: grouped(&c.query(RESERVATIONS_BY_STATUS_SQL, &keys).await?)?,
        ledger_by_kind: grouped(&c.query(LEDGER_BY_KIND_SQL, &keys).await?)?,
        inbox_rows: counts.try_get(0)?,
        reservations_without_inbox: counts.try_get(1)?,
        duplicate_requests: counts.try_get(2)?,
        invariants,
        ..PgReconcile::default()
    };
    let policy = c
        .query_opt("SELECT release_policy FROM activity WHERE activity_id = $1", &[&activity_id])
        .await?;
    report.release_returns_stock = match policy {
        Some(row) => row.try_get::<_, String>(0)? == "BACK_TO_SALE",
        None => false,
    };
    list_ids(c, &mut report, activity_id, sku_id, limits.ids_listed_max).await?;
    let rows = c
        .query(
            &format!(
                "{RESERVATION_COLUMNS} WHERE r.activity_id = $1 AND r.sku_id = $2 \
                 ORDER BY r.reservation_id LIMIT $3"
            ),
            &[&activity_id, &sku_id, &limit_plus_one(limits.reservations_max)],
        )
        .await?;
    report.reservations_truncated = rows.len() > limits.reservations_max;
    report.reservations =
        rows.iter().take(limits.reservations_max).map(reservation).collect::<Result<_, _>>()?;
    // Read-only: nothing to commit; ending it explicitly returns the connection clean.
    txn.rollback().await?;
    Ok(report)
}

/// The current rows of the given reservations (those that exist).
pub async fn reservation_statuses(
    client: &Client,
    reservation_ids: &[String],
) -> Result<Vec<PgReservation>, PgError> {
    if reservation_ids.is_empty() {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            &format!("{RESERVATION_COLUMNS} WHERE r.reservation_id = ANY($1)"),
            &[&reservation_ids],
        )
        .await?;
    rows.iter().map(reservation).collect()
}

fn reservation(row: &Row) -> Result<PgReservation, PgError> {
    Ok(PgReservation {
        reservation_id: row.try_get(0)?,
        status: row.try_get(1)?,
        order_id: row.try_get(2)?,
        reserved_at_ms: row.try_get(3)?,
        order_status: row.try_get(4)?,
        order_updated_at_ms: row.try_get(5)?,
    })
}

fn grouped(rows: &[Row]) -> Result<BTreeMap<String, i64>, PgError> {
    rows.iter().map(|row| Ok((row.try_get::<_, String>(0)?, row.try_get::<_, i64>(1)?))).collect()
}

fn limit_plus_one(max: usize) -> i64 {
    i64::try_from(max).unwrap_or(i64::MAX - 1).saturating_add(1)
}

/// Lists the ids behind every non-zero finding (a query per finding, only when it counted).
async fn list_ids(
    c: &Client,
    report: &mut PgReconcile,
    activity_id: i64,
    sku_id: i64,
    max: usize,
) -> Result<(), PgError> {
    let limit = limit_plus_one(max);
    let inv = &report.invariants;
    let counted = |name: &str| -> i64 {
        match name {
            "tokens_shared" => inv.tokens_shared,
            "held_tokens_without_order" => inv.held_tokens_without_order,
            "orders_without_held_token" => inv.orders_without_held_token,
            "duplicate_buyers" => inv.duplicate_buyers,
            "reservations_processing" => inv.reservations_processing,
            "created_reservations_without_order" => inv.created_reservations_without_order,
            "orders_without_created_reservation" => inv.orders_without_created_reservation,
            "duplicate_claims" => inv.duplicate_claims,
            "reservations_without_inbox" => report.reservations_without_inbox,
            "duplicate_requests" => report.duplicate_requests,
            _ => 0,
        }
    };
    let extra = [
        ("reservations_without_inbox", RESERVATIONS_WITHOUT_INBOX_SQL),
        ("duplicate_requests", DUPLICATE_REQUESTS_SQL),
    ];
    let mut found: Vec<(&'static str, IdSample)> = Vec::new();
    for (name, set_sql) in FINDINGS.iter().chain(extra.iter()) {
        if counted(name) == 0 {
            continue;
        }
        let sql = format!("SELECT * FROM ({set_sql}) x ORDER BY 1 LIMIT $3");
        let rows = c.query(&sql, &[&activity_id, &sku_id, &limit]).await?;
        found.push((*name, sample(&rows, max)?));
    }
    if inv.sku_found && inv.units_live > inv.total_stock {
        // The newest live orders, as many as the units over stock (each holds at least one).
        let over = inv.units_live - inv.total_stock;
        let listed = over.min(limit - 1);
        let rows = c.query(ORDERS_OVER_STOCK_SQL, &[&activity_id, &sku_id, &listed]).await?;
        let mut ids = sample(&rows, max)?;
        ids.truncated = over > listed;
        found.push(("orders_over_stock", ids));
    }
    report.ids.extend(found);
    Ok(())
}

fn sample(rows: &[Row], max: usize) -> Result<IdSample, PgError> {
    let ids = rows.iter().take(max).map(|r| r.try_get::<_, String>(0)).collect::<Result<_, _>>()?;
    Ok(IdSample { ids, truncated: rows.len() > max })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_of_an_order_follows_its_status() {
        let mut r = PgReservation {
            reservation_id: "resv_1".into(),
            status: "ORDER_CREATED".into(),
            order_id: Some("ord_1".into()),
            order_status: Some("PENDING_PAYMENT".into()),
            reserved_at_ms: Some(1),
            order_updated_at_ms: Some(2),
        };
        assert!(r.order_live());
        r.order_status = Some("CANCELLED".into());
        assert!(!r.order_live());
        r.order_status = None;
        assert!(!r.order_live());
    }

    #[test]
    fn every_finding_selects_one_id_column_for_this_sku() {
        for (name, sql) in FINDINGS {
            assert!(sql.starts_with("SELECT "), "{name}");
            assert!(sql.contains("$1") && sql.contains("$2"), "{name}");
            assert!(!sql.contains("$3"), "{name}: $3 is the listing's LIMIT");
        }
        assert_eq!(limit_plus_one(10), 11);
        assert_eq!(limit_plus_one(usize::MAX), i64::MAX);
    }
}
