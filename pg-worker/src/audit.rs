//! The invariant checker of DESIGN.md section 8, items 1–3 and 7, as seen from PostgreSQL.
//!
//! What it is: [`check_invariants`], ONE query that counts what each invariant is about for one
//! SKU, and [`InvariantReport`], the counts plus a list of violations in words. Tests call it
//! at the end of every scenario; the load generator, drills and the reconcile report reuse it.
//! [`FINDINGS`] names the row sets behind the counts that have ids, so that the reconcile report
//! (`reconcile.rs`) lists exactly the rows a count counted.
//!
//! Every count of units is per unit: an order holds `orders.quantity` units (migration 0010).
//!
//! - I1 no oversell: units of live orders (not CANCELLED/CLOSED) ≤ total stock; no token held
//!   by two live orders; every live TOKEN order holds exactly its quantity of CLAIMED/SOLD
//!   tokens claimed by its own reservation; ROW: `available_stock` + live units = total stock.
//! - I2 one per buyer: no (activity, sku, user) with two orders.
//! - I3 token conservation (TOKEN): tokens = total stock = AVAILABLE + CLAIMED + SOLD +
//!   RELEASED, and held (CLAIMED + SOLD) tokens = live units (a held token without an order
//!   is a leaked unit).
//! - I7 ack after commit, from the database's side: no reservation committed in PROCESSING,
//!   every ORDER_CREATED reservation has its order and every order its ORDER_CREATED
//!   reservation, no reservation with more ledger CLAIMs than its units (a replay that
//!   slipped through).
//!
//! What it is not: Redis (I4, I5) or the log: those need the other stores' view and live with
//! the reconcile job. Read-only; runs in one statement, so it sees one snapshot.

use tokio_postgres::Client;

use crate::error::PgError;

/// The counts behind the invariants of one SKU, and what is wrong with them.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct InvariantReport {
    pub activity_id: i64,
    pub sku_id: i64,
    /// False when the SKU has no `sku_inventory` row (then nothing else is meaningful).
    pub sku_found: bool,
    pub allocator: String,
    pub total_stock: i64,
    /// ROW allocator only.
    pub available_stock: Option<i64>,
    pub orders_total: i64,
    pub orders_live: i64,
    /// The units of the live orders (their quantities summed).
    pub units_live: i64,
    pub tokens_total: i64,
    pub tokens_available: i64,
    pub tokens_claimed: i64,
    pub tokens_sold: i64,
    pub tokens_released: i64,
    /// Tokens held by more than one live order.
    pub tokens_shared: i64,
    /// Held tokens no live order holds.
    pub held_tokens_without_order: i64,
    /// Live TOKEN orders whose token is not held for their reservation.
    pub orders_without_held_token: i64,
    /// Buyers with more than one order.
    pub duplicate_buyers: i64,
    pub reservations_total: i64,
    pub reservations_processing: i64,
    pub reservations_created: i64,
    pub reservations_rejected: i64,
    pub created_reservations_without_order: i64,
    pub orders_without_created_reservation: i64,
    /// Reservations with more ledger CLAIMs than their units.
    pub duplicate_claims: i64,
    /// Every broken invariant, in words; empty when all hold.
    pub violations: Vec<String>,
}

impl InvariantReport {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

// The row sets behind the counts that name rows: each is a `SELECT <id> FROM ... WHERE ...`
// over the base tables for ($1 activity_id, $2 sku_id). The check counts them
// (`SELECT count(*) FROM (<set>) x`); the reconcile report (`reconcile.rs`) lists their ids
// (`SELECT * FROM (<set>) x ORDER BY 1 LIMIT n`) — one definition, so a count and the ids it
// reports can never disagree. Macros, not consts: `concat!` takes only literals.
// `LIVE` = not CANCELLED/CLOSED.

/// Tokens (ids) held by more than one live order.
macro_rules! tokens_shared_sql {
    () => {
        "SELECT inventory_token_id FROM orders \
         WHERE activity_id = $1 AND sku_id = $2 AND status NOT IN ('CANCELLED', 'CLOSED') \
           AND inventory_token_id IS NOT NULL \
         GROUP BY inventory_token_id HAVING count(*) > 1"
    };
}
/// Held tokens (ids) no live order holds (their reservation has no live order).
macro_rules! held_tokens_without_order_sql {
    () => {
        "SELECT t.token_id FROM inventory_token t \
         WHERE t.activity_id = $1 AND t.sku_id = $2 AND t.status IN ('CLAIMED', 'SOLD') \
           AND NOT EXISTS (SELECT 1 FROM orders o WHERE o.reservation_id = t.reservation_id \
                           AND o.status NOT IN ('CANCELLED', 'CLOSED'))"
    };
}
/// Live TOKEN orders (ids) that do not hold exactly their quantity of tokens for their
/// reservation (CLAIMED or SOLD), or whose first token is not among them.
macro_rules! orders_without_held_token_sql {
    () => {
        "SELECT o.order_id FROM orders o \
           LEFT JOIN inventory_token t ON t.token_id = o.inventory_token_id \
         WHERE o.activity_id = $1 AND o.sku_id = $2 AND o.status NOT IN ('CANCELLED', 'CLOSED') \
           AND (SELECT allocator FROM sku_inventory \
                WHERE activity_id = $1 AND sku_id = $2) = 'TOKEN' \
           AND (t.token_id IS NULL OR t.status NOT IN ('CLAIMED', 'SOLD') \
                OR t.reservation_id IS DISTINCT FROM o.reservation_id \
                OR (SELECT count(*) FROM inventory_token h \
                    WHERE h.reservation_id = o.reservation_id \
                      AND h.status IN ('CLAIMED', 'SOLD')) <> o.quantity)"
    };
}
/// Buyers (user ids, as text) with more than one order.
macro_rules! duplicate_buyers_sql {
    () => {
        "SELECT user_id::text FROM orders WHERE activity_id = $1 AND sku_id = $2 \
         GROUP BY user_id HAVING count(*) > 1"
    };
}
/// Reservations (ids) committed as PROCESSING.
macro_rules! reservations_processing_sql {
    () => {
        "SELECT reservation_id FROM inventory_reservation \
         WHERE activity_id = $1 AND sku_id = $2 AND status = 'PROCESSING'"
    };
}
/// ORDER_CREATED reservations (ids) without an order.
macro_rules! created_reservations_without_order_sql {
    () => {
        "SELECT r.reservation_id FROM inventory_reservation r \
         WHERE r.activity_id = $1 AND r.sku_id = $2 AND r.status = 'ORDER_CREATED' \
           AND NOT EXISTS (SELECT 1 FROM orders o WHERE o.reservation_id = r.reservation_id)"
    };
}
/// Orders (ids) without an ORDER_CREATED reservation.
macro_rules! orders_without_created_reservation_sql {
    () => {
        "SELECT o.order_id FROM orders o WHERE o.activity_id = $1 AND o.sku_id = $2 \
           AND NOT EXISTS (SELECT 1 FROM inventory_reservation r \
                           WHERE r.reservation_id = o.reservation_id \
                             AND r.status = 'ORDER_CREATED')"
    };
}
/// Reservations (ids) with more ledger CLAIMs than their units (one per unit, 0010).
macro_rules! duplicate_claims_sql {
    () => {
        "SELECT l.reservation_id FROM inventory_ledger l \
         WHERE l.activity_id = $1 AND l.sku_id = $2 AND l.kind = 'CLAIM' \
         GROUP BY l.reservation_id \
         HAVING count(*) > coalesce((SELECT r.quantity FROM inventory_reservation r \
                                     WHERE r.reservation_id = l.reservation_id), 1)"
    };
}

/// The findings whose rows have ids, by name: the name is the [`InvariantReport`] field that
/// counts them; the SQL selects their ids (see the macros above).
pub const FINDINGS: [(&str, &str); 8] = [
    ("tokens_shared", tokens_shared_sql!()),
    ("held_tokens_without_order", held_tokens_without_order_sql!()),
    ("orders_without_held_token", orders_without_held_token_sql!()),
    ("duplicate_buyers", duplicate_buyers_sql!()),
    ("reservations_processing", reservations_processing_sql!()),
    ("created_reservations_without_order", created_reservations_without_order_sql!()),
    ("orders_without_created_reservation", orders_without_created_reservation_sql!()),
    ("duplicate_claims", duplicate_claims_sql!()),
];

/// Every count reads the base tables (not shared CTEs: PostgreSQL materializes a CTE that is
/// referenced twice, and an anti-join against a materialized CTE has no index, which made
/// this O(orders x tokens)). `LIVE` = not CANCELLED/CLOSED.
const CHECK_SQL: &str = concat!(
    "SELECT \
  (SELECT count(*) FROM sku_inventory WHERE activity_id = $1 AND sku_id = $2), \
  (SELECT allocator FROM sku_inventory WHERE activity_id = $1 AND sku_id = $2), \
  (SELECT total_stock FROM sku_inventory WHERE activity_id = $1 AND sku_id = $2), \
  (SELECT available_stock FROM sku_inventory WHERE activity_id = $1 AND sku_id = $2), \
  (SELECT count(*) FROM orders WHERE activity_id = $1 AND sku_id = $2), \
  (SELECT count(*) FROM orders WHERE activity_id = $1 AND sku_id = $2 \
     AND status NOT IN ('CANCELLED', 'CLOSED')), \
  (SELECT coalesce(sum(quantity), 0)::bigint FROM orders \
     WHERE activity_id = $1 AND sku_id = $2 AND status NOT IN ('CANCELLED', 'CLOSED')), \
  (SELECT count(*) FROM inventory_token WHERE activity_id = $1 AND sku_id = $2), \
  (SELECT count(*) FROM inventory_token WHERE activity_id = $1 AND sku_id = $2 \
     AND status = 'AVAILABLE'), \
  (SELECT count(*) FROM inventory_token WHERE activity_id = $1 AND sku_id = $2 \
     AND status = 'CLAIMED'), \
  (SELECT count(*) FROM inventory_token WHERE activity_id = $1 AND sku_id = $2 \
     AND status = 'SOLD'), \
  (SELECT count(*) FROM inventory_token WHERE activity_id = $1 AND sku_id = $2 \
     AND status = 'RELEASED'), \
  (SELECT count(*) FROM (",
    tokens_shared_sql!(),
    ") x), (SELECT count(*) FROM (",
    held_tokens_without_order_sql!(),
    ") x), (SELECT count(*) FROM (",
    orders_without_held_token_sql!(),
    ") x), (SELECT count(*) FROM (",
    duplicate_buyers_sql!(),
    ") x), \
  (SELECT count(*) FROM inventory_reservation WHERE activity_id = $1 AND sku_id = $2), \
  (SELECT count(*) FROM (",
    reservations_processing_sql!(),
    ") x), \
  (SELECT count(*) FROM inventory_reservation WHERE activity_id = $1 AND sku_id = $2 \
     AND status = 'ORDER_CREATED'), \
  (SELECT count(*) FROM inventory_reservation WHERE activity_id = $1 AND sku_id = $2 \
     AND status LIKE 'REJECTED_%'), \
  (SELECT count(*) FROM (",
    created_reservations_without_order_sql!(),
    ") x), (SELECT count(*) FROM (",
    orders_without_created_reservation_sql!(),
    ") x), (SELECT count(*) FROM (",
    duplicate_claims_sql!(),
    ") x)"
);

/// Counts and judges the invariants of one SKU (see the module documentation).
pub async fn check_invariants(
    client: &Client,
    activity_id: i64,
    sku_id: i64,
) -> Result<InvariantReport, PgError> {
    let row = client.query_one(CHECK_SQL, &[&activity_id, &sku_id]).await?;
    let count = |i: usize| -> Result<i64, PgError> { Ok(row.try_get::<_, i64>(i)?) };
    let mut report = InvariantReport {
        activity_id,
        sku_id,
        sku_found: count(0)? == 1,
        allocator: row.try_get::<_, Option<String>>(1)?.unwrap_or_default(),
        total_stock: row.try_get::<_, Option<i64>>(2)?.unwrap_or(0),
        available_stock: row.try_get(3)?,
        orders_total: count(4)?,
        orders_live: count(5)?,
        units_live: count(6)?,
        tokens_total: count(7)?,
        tokens_available: count(8)?,
        tokens_claimed: count(9)?,
        tokens_sold: count(10)?,
        tokens_released: count(11)?,
        tokens_shared: count(12)?,
        held_tokens_without_order: count(13)?,
        orders_without_held_token: count(14)?,
        duplicate_buyers: count(15)?,
        reservations_total: count(16)?,
        reservations_processing: count(17)?,
        reservations_created: count(18)?,
        reservations_rejected: count(19)?,
        created_reservations_without_order: count(20)?,
        orders_without_created_reservation: count(21)?,
        duplicate_claims: count(22)?,
        violations: Vec::new(),
    };
    report.violations = judge(&report);
    Ok(report)
}

/// The rules, over the counts (sans-I/O, unit-tested below), in the module documentation's
/// order: I1 and I2, I3, I7.
pub fn judge(r: &InvariantReport) -> Vec<String> {
    let mut v = Vec::new();
    if !r.sku_found {
        v.push(format!("sku ({}, {}) not found", r.activity_id, r.sku_id));
        return v;
    }
    judge_oversell_and_buyers(r, &mut v);
    judge_conservation(r, &mut v);
    judge_ack_after_commit(r, &mut v);
    v
}

/// I1 (no oversell) and I2 (one order per buyer).
fn judge_oversell_and_buyers(r: &InvariantReport, v: &mut Vec<String>) {
    if r.units_live > r.total_stock {
        v.push(format!(
            "I1 oversell: {} units in {} live orders for a stock of {}",
            r.units_live, r.orders_live, r.total_stock
        ));
    }
    if r.tokens_shared > 0 {
        v.push(format!("I1 oversell: {} tokens held by several live orders", r.tokens_shared));
    }
    if r.orders_without_held_token > 0 {
        v.push(format!(
            "I1: {} live orders do not hold their units' tokens claimed for their reservation",
            r.orders_without_held_token
        ));
    }
    if r.duplicate_buyers > 0 {
        v.push(format!("I2: {} buyers have more than one order", r.duplicate_buyers));
    }
}

/// I3 (token conservation) for the SKU's allocator; ROW's counter also answers for I1.
fn judge_conservation(r: &InvariantReport, v: &mut Vec<String>) {
    match r.allocator.as_str() {
        "TOKEN" => judge_tokens(r, v),
        "ROW" => {
            let available = r.available_stock.unwrap_or(-1);
            if available < 0 || available + r.units_live != r.total_stock {
                v.push(format!(
                    "I1/I3 (ROW): available_stock {available} + live units {} != total stock {}",
                    r.units_live, r.total_stock
                ));
            }
        }
        other => v.push(format!("unknown allocator {other:?}")),
    }
}

/// I3 for the TOKEN allocator: tokens = stock = the sum of their states, held = live units.
fn judge_tokens(r: &InvariantReport, v: &mut Vec<String>) {
    if r.tokens_total != r.total_stock {
        v.push(format!("I3: {} tokens for a total stock of {}", r.tokens_total, r.total_stock));
    }
    let by_status = r.tokens_available + r.tokens_claimed + r.tokens_sold + r.tokens_released;
    if by_status != r.tokens_total {
        v.push(format!("I3: token states sum to {by_status}, not {}", r.tokens_total));
    }
    if r.tokens_claimed + r.tokens_sold != r.units_live {
        v.push(format!(
            "I3: {} held tokens but {} live units",
            r.tokens_claimed + r.tokens_sold,
            r.units_live
        ));
    }
    if r.held_tokens_without_order > 0 {
        v.push(format!("I3: {} held tokens have no live order", r.held_tokens_without_order));
    }
}

/// I7 (ack after commit), from the database's side.
fn judge_ack_after_commit(r: &InvariantReport, v: &mut Vec<String>) {
    if r.reservations_processing > 0 {
        v.push(format!("I7: {} reservations committed as PROCESSING", r.reservations_processing));
    }
    if r.created_reservations_without_order > 0 {
        v.push(format!(
            "I7: {} ORDER_CREATED reservations without an order",
            r.created_reservations_without_order
        ));
    }
    if r.orders_without_created_reservation > 0 {
        v.push(format!(
            "I7: {} orders without an ORDER_CREATED reservation",
            r.orders_without_created_reservation
        ));
    }
    if r.duplicate_claims > 0 {
        v.push(format!(
            "I7: {} reservations with more ledger CLAIMs than their units",
            r.duplicate_claims
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy_token() -> InvariantReport {
        InvariantReport {
            activity_id: 1,
            sku_id: 2,
            sku_found: true,
            allocator: "TOKEN".into(),
            total_stock: 10,
            orders_total: 3,
            orders_live: 3,
            // Three orders, one of them of two units.
            units_live: 4,
            tokens_total: 10,
            tokens_available: 6,
            tokens_claimed: 4,
            reservations_total: 5,
            reservations_created: 3,
            reservations_rejected: 2,
            ..Default::default()
        }
    }

    #[test]
    fn a_healthy_sku_has_no_violations() {
        assert!(judge(&healthy_token()).is_empty());
        let row = InvariantReport {
            allocator: "ROW".into(),
            available_stock: Some(6),
            tokens_total: 0,
            tokens_available: 0,
            tokens_claimed: 0,
            ..healthy_token()
        };
        assert!(judge(&row).is_empty(), "{:?}", judge(&row));
    }

    #[test]
    fn each_breach_is_reported() {
        let cases: Vec<(&str, InvariantReport)> = vec![
            (
                "I1 oversell",
                InvariantReport {
                    units_live: 11,
                    tokens_claimed: 11,
                    tokens_available: -1,
                    ..healthy_token()
                },
            ),
            ("several live orders", InvariantReport { tokens_shared: 1, ..healthy_token() }),
            ("I2", InvariantReport { duplicate_buyers: 1, ..healthy_token() }),
            (
                "I3: 9 tokens",
                InvariantReport { tokens_total: 9, tokens_available: 5, ..healthy_token() },
            ),
            (
                "held tokens but",
                InvariantReport { tokens_claimed: 5, tokens_available: 5, ..healthy_token() },
            ),
            ("PROCESSING", InvariantReport { reservations_processing: 1, ..healthy_token() }),
            (
                "without an order",
                InvariantReport { created_reservations_without_order: 1, ..healthy_token() },
            ),
            ("more ledger CLAIMs", InvariantReport { duplicate_claims: 1, ..healthy_token() }),
            (
                "(ROW)",
                InvariantReport {
                    allocator: "ROW".into(),
                    available_stock: Some(7),
                    ..healthy_token()
                },
            ),
        ];
        for (needle, report) in cases {
            let violations = judge(&report);
            assert!(violations.iter().any(|v| v.contains(needle)), "{needle}: {violations:?}");
        }
    }
}
