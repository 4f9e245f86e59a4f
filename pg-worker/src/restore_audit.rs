//! The checks of a restored copy (seed ch9 §11.4 "恢复后验证订单数、库存流水、唯一约束和库存守恒",
//! §13.6): what `flashsale admin restore-drill` asks of the database it brought back before it
//! calls the copy good.
//!
//! What it is: [`audit_restored`] runs, for every SKU of `sku_inventory`, the reconcile
//! report's PostgreSQL half ([`crate::reconcile::reconcile_postgres`], which runs the audit of
//! DESIGN.md section 8, [`crate::audit::check_invariants`]: no oversell, one order per buyer,
//! token conservation, ack after commit; and adds I6, one reservation per request id, and I7's
//! inbox rows), then what a restore must also prove and a live reconcile takes for granted:
//!
//! - the ledger agrees with the orders: every order has its CLAIM and every CLAIM its order, a
//!   RELEASE exactly for the CANCELLED/CLOSED ones, a SELL exactly for the PAID ones, and
//!   CLAIMs − RELEASEs = live orders ([`LedgerFacts`]);
//! - the payments agree with the orders: a PAID order has exactly one applied PAID payment of
//!   its amount, and no applied PAID payment belongs to an order that is not PAID
//!   ([`PaymentFacts`]); no payment row anywhere escaped the callback's state machine;
//! - every unique key holds ([`UniqueKeys`]): for each unique B-tree index of the schema, the
//!   table read with index scans off (a damaged index would hide the very duplicates it should
//!   forbid) has no two live rows with one key, and, where `amcheck` is installable,
//!   `bt_index_check(index, heapallindexed => true)` finds the index sound and holding every
//!   row.
//!
//! The verdict is sans-I/O ([`judge_ledger`], [`judge_payments`]) and unit-tested below.
//!
//! What it is not: a repair tool, or read-only — it installs `amcheck` in the copy it checks
//! (never run it against a live database); the reads run in the caller's session, one SKU at a
//! time. Not the RPO/RTO or the restore itself (`engine/src/app/backup/`).

use tokio_postgres::Client;

use crate::error::PgError;
use crate::reconcile::{reconcile_postgres, PgReconcile, PgReconcileLimits};

/// Bounds of one audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreAuditLimits {
    /// Ids listed per finding of the reconcile half (all are counted).
    pub ids_listed_max: usize,
    /// SKUs audited; more is an error, not a silent cut.
    pub skus_max: usize,
    /// `statement_timeout` of every statement.
    pub statement_timeout_ms: u64,
}

/// The ledger of one SKU against its orders.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct LedgerFacts {
    pub claims: i64,
    pub releases: i64,
    pub sells: i64,
    pub orders_without_claim: i64,
    pub claims_without_order: i64,
    /// Orders whose RELEASE row says otherwise than their status (CANCELLED/CLOSED ⇔ RELEASE).
    pub release_mismatches: i64,
    /// Orders whose SELL row says otherwise than their status (PAID ⇔ SELL).
    pub sell_mismatches: i64,
}

/// The payments of one SKU's orders.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PaymentFacts {
    pub payments: i64,
    /// The money of the payments that paid an order (`outcome` PAID).
    pub paid_amount_cents: i64,
    pub paid_orders_without_payment: i64,
    pub orders_paid_twice: i64,
    /// Applied PAID payments whose order is not PAID.
    pub applied_on_unpaid_orders: i64,
    /// Applied PAID payments of another amount than their order's.
    pub applied_amount_mismatches: i64,
}

/// One SKU of the restored copy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SkuAudit {
    pub activity_id: i64,
    pub sku_id: i64,
    /// The reconcile report's PostgreSQL half: the audit's counts and violations, orders,
    /// reservations and ledger rows by status or kind, and the ids behind any finding.
    pub reconcile: PgReconcile,
    pub ledger: LedgerFacts,
    pub payments: PaymentFacts,
    /// Every broken rule of this SKU, in words; empty when all hold.
    pub violations: Vec<String>,
}

/// How one unique index was checked.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct UniqueIndexCheck {
    pub index: String,
    pub table: String,
    pub columns: Vec<String>,
    /// Keys held by more than one row (read from the table, index scans off).
    pub duplicates: i64,
    /// `bt_index_check(heapallindexed)`: `passed`, `skipped` (no amcheck) or the error.
    pub btree: String,
}

/// Every unique key of the schema.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct UniqueKeys {
    /// Whether `amcheck` could be installed in the copy.
    pub amcheck: bool,
    pub indexes: Vec<UniqueIndexCheck>,
    /// Unique indexes over an expression, whose duplicates are not counted (the schema has
    /// none; `bt_index_check` still runs on them).
    pub unchecked: Vec<String>,
    pub violations: Vec<String>,
}

/// The whole restored copy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RestoreAudit {
    pub skus: Vec<SkuAudit>,
    pub unique_keys: UniqueKeys,
    /// Payment rows no callback wrote (no outcome, or money for an unknown order recorded as
    /// anything but a refund or an unpaid notice).
    pub payments_outside_state_machine: i64,
    /// Every violation of the copy: the SKUs', the unique keys', the payments'.
    pub violations: Vec<String>,
}

impl RestoreAudit {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

const LEDGER_AND_PAYMENTS_SQL: &str = "\
SELECT \
  (SELECT count(*) FROM inventory_ledger WHERE activity_id = $1 AND sku_id = $2 AND kind = 'CLAIM'), \
  (SELECT count(*) FROM inventory_ledger WHERE activity_id = $1 AND sku_id = $2 \
     AND kind = 'RELEASE'), \
  (SELECT count(*) FROM inventory_ledger WHERE activity_id = $1 AND sku_id = $2 AND kind = 'SELL'), \
  (SELECT count(*) FROM orders o WHERE o.activity_id = $1 AND o.sku_id = $2 \
     AND NOT EXISTS (SELECT 1 FROM inventory_ledger l \
                     WHERE l.reservation_id = o.reservation_id AND l.kind = 'CLAIM')), \
  (SELECT count(*) FROM inventory_ledger l \
     WHERE l.activity_id = $1 AND l.sku_id = $2 AND l.kind = 'CLAIM' \
       AND NOT EXISTS (SELECT 1 FROM orders o WHERE o.reservation_id = l.reservation_id)), \
  (SELECT count(*) FROM orders o WHERE o.activity_id = $1 AND o.sku_id = $2 \
     AND (o.status IN ('CANCELLED', 'CLOSED')) <> EXISTS (SELECT 1 FROM inventory_ledger l \
                     WHERE l.reservation_id = o.reservation_id AND l.kind = 'RELEASE')), \
  (SELECT count(*) FROM orders o WHERE o.activity_id = $1 AND o.sku_id = $2 \
     AND (o.status = 'PAID') <> EXISTS (SELECT 1 FROM inventory_ledger l \
                     WHERE l.reservation_id = o.reservation_id AND l.kind = 'SELL')), \
  (SELECT count(*) FROM payment p JOIN orders o ON o.order_id = p.order_id \
     WHERE o.activity_id = $1 AND o.sku_id = $2), \
  (SELECT coalesce(sum(p.amount_cents), 0)::bigint FROM payment p \
     JOIN orders o ON o.order_id = p.order_id \
     WHERE o.activity_id = $1 AND o.sku_id = $2 AND p.outcome = 'PAID'), \
  (SELECT count(*) FROM orders o WHERE o.activity_id = $1 AND o.sku_id = $2 AND o.status = 'PAID' \
     AND NOT EXISTS (SELECT 1 FROM payment p WHERE p.order_id = o.order_id \
                     AND p.status = 'PAID' AND p.outcome = 'PAID')), \
  (SELECT count(*) FROM (SELECT p.order_id FROM payment p JOIN orders o ON o.order_id = p.order_id \
     WHERE o.activity_id = $1 AND o.sku_id = $2 AND p.outcome = 'PAID' \
     GROUP BY p.order_id HAVING count(*) > 1) x), \
  (SELECT count(*) FROM payment p JOIN orders o ON o.order_id = p.order_id \
     WHERE o.activity_id = $1 AND o.sku_id = $2 AND p.outcome = 'PAID' AND o.status <> 'PAID'), \
  (SELECT count(*) FROM payment p JOIN orders o ON o.order_id = p.order_id \
     WHERE o.activity_id = $1 AND o.sku_id = $2 AND p.outcome = 'PAID' \
       AND o.amount_cents IS NOT NULL AND p.amount_cents <> o.amount_cents)";

const PAYMENTS_OUTSIDE_SQL: &str = "\
SELECT count(*) FROM payment p \
WHERE p.outcome IS NULL \
   OR (NOT EXISTS (SELECT 1 FROM orders o WHERE o.order_id = p.order_id) \
       AND p.outcome NOT IN ('REFUND_NEEDED', 'UNPAID'))";

/// The unique B-tree indexes of the schema `public`: name, table, key columns (a NULL for an
/// expression column), partial-index predicate.
const UNIQUE_INDEXES_SQL: &str = "\
SELECT i.indexrelid::regclass::text, c.relname::text, \
       array_agg(a.attname::text ORDER BY k.ord), pg_get_expr(i.indpred, i.indrelid) \
FROM pg_index i \
JOIN pg_class c ON c.oid = i.indrelid \
JOIN pg_namespace n ON n.oid = c.relnamespace \
JOIN pg_class ic ON ic.oid = i.indexrelid \
JOIN pg_am am ON am.oid = ic.relam \
CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum AND k.attnum > 0 \
WHERE i.indisunique AND n.nspname = 'public' AND am.amname = 'btree' AND k.ord <= i.indnkeyatts \
GROUP BY i.indexrelid, c.relname, i.indpred, i.indrelid \
ORDER BY 1";

/// Audits the restored database `client` is connected to (see the module documentation).
pub async fn audit_restored(
    client: &mut Client,
    limits: RestoreAuditLimits,
) -> Result<RestoreAudit, PgError> {
    let set = format!("SET statement_timeout = {}", limits.statement_timeout_ms);
    client.batch_execute(&set).await?;
    let skus_max = i64::try_from(limits.skus_max).unwrap_or(i64::MAX - 1);
    let rows = client
        .query(
            "SELECT activity_id, sku_id FROM sku_inventory ORDER BY 1, 2 LIMIT $1",
            &[&skus_max.saturating_add(1)],
        )
        .await?;
    if rows.len() > limits.skus_max {
        return Err(PgError::InvalidArgument("more SKUs than the restore audit's skus_max"));
    }
    let mut skus = Vec::with_capacity(rows.len());
    for row in &rows {
        skus.push(audit_sku(client, row.try_get(0)?, row.try_get(1)?, limits).await?);
    }
    let outside: i64 = client.query_one(PAYMENTS_OUTSIDE_SQL, &[]).await?.try_get(0)?;
    let unique_keys = check_unique_keys(client).await?;
    let mut violations: Vec<String> = skus
        .iter()
        .flat_map(|s| {
            s.violations.iter().map(move |v| format!("sku ({}, {}): {v}", s.activity_id, s.sku_id))
        })
        .collect();
    violations.extend(unique_keys.violations.iter().cloned());
    if outside > 0 {
        violations.push(format!("{outside} payment rows did not come through the callback"));
    }
    Ok(RestoreAudit { skus, unique_keys, payments_outside_state_machine: outside, violations })
}

async fn audit_sku(
    client: &mut Client,
    activity_id: i64,
    sku_id: i64,
    limits: RestoreAuditLimits,
) -> Result<SkuAudit, PgError> {
    let reconcile_limits = PgReconcileLimits {
        ids_listed_max: limits.ids_listed_max,
        // The reservations are read for the Redis cross-check, which a restored copy has no
        // Redis for: one row is the least the reconcile half accepts.
        reservations_max: 1,
        statement_timeout_ms: limits.statement_timeout_ms,
    };
    let reconcile = reconcile_postgres(client, activity_id, sku_id, reconcile_limits).await?;
    let row = client.query_one(LEDGER_AND_PAYMENTS_SQL, &[&activity_id, &sku_id]).await?;
    let count = |i: usize| -> Result<i64, PgError> { Ok(row.try_get::<_, i64>(i)?) };
    let ledger = LedgerFacts {
        claims: count(0)?,
        releases: count(1)?,
        sells: count(2)?,
        orders_without_claim: count(3)?,
        claims_without_order: count(4)?,
        release_mismatches: count(5)?,
        sell_mismatches: count(6)?,
    };
    let payments = PaymentFacts {
        payments: count(7)?,
        paid_amount_cents: count(8)?,
        paid_orders_without_payment: count(9)?,
        orders_paid_twice: count(10)?,
        applied_on_unpaid_orders: count(11)?,
        applied_amount_mismatches: count(12)?,
    };
    let mut violations = reconcile.invariants.violations.clone();
    if reconcile.reservations_without_inbox > 0 {
        let n = reconcile.reservations_without_inbox;
        violations.push(format!("I7: {n} reservations without their inbox row"));
    }
    if reconcile.duplicate_requests > 0 {
        let n = reconcile.duplicate_requests;
        violations.push(format!("I6: {n} request ids with more than one reservation"));
    }
    violations.extend(judge_ledger(&ledger, reconcile.invariants.orders_live));
    violations.extend(judge_payments(&payments));
    Ok(SkuAudit { activity_id, sku_id, reconcile, ledger, payments, violations })
}

/// The ledger's rules over its counts; `orders_live` = orders not CANCELLED/CLOSED.
pub fn judge_ledger(l: &LedgerFacts, orders_live: i64) -> Vec<String> {
    let mut v = Vec::new();
    let mut rule = |count: i64, what: &str| {
        if count > 0 {
            v.push(format!("ledger: {count} {what}"));
        }
    };
    rule(l.orders_without_claim, "orders without their CLAIM");
    rule(l.claims_without_order, "CLAIMs without their order");
    rule(l.release_mismatches, "orders whose RELEASE disagrees with their status");
    rule(l.sell_mismatches, "orders whose SELL disagrees with their status");
    if l.claims - l.releases != orders_live {
        v.push(format!(
            "ledger: {} CLAIMs - {} RELEASEs != {orders_live} live orders",
            l.claims, l.releases
        ));
    }
    v
}

/// The payments' rules over their counts.
pub fn judge_payments(p: &PaymentFacts) -> Vec<String> {
    let mut v = Vec::new();
    let mut rule = |count: i64, what: &str| {
        if count > 0 {
            v.push(format!("payments: {count} {what}"));
        }
    };
    rule(p.paid_orders_without_payment, "PAID orders without an applied PAID payment");
    rule(p.orders_paid_twice, "orders paid by more than one payment");
    rule(p.applied_on_unpaid_orders, "applied PAID payments whose order is not PAID");
    rule(p.applied_amount_mismatches, "applied PAID payments of another amount than the order's");
    v
}

/// Every unique B-tree index of the schema: duplicates read from the table, and
/// `bt_index_check` where `amcheck` can be installed.
async fn check_unique_keys(client: &mut Client) -> Result<UniqueKeys, PgError> {
    let amcheck = client
        .batch_execute("CREATE EXTENSION IF NOT EXISTS amcheck")
        .await
        .map_err(|e| tracing::warn!(error = %PgError::from(e), "amcheck unavailable"))
        .is_ok();
    let mut keys = UniqueKeys { amcheck, ..UniqueKeys::default() };
    for row in client.query(UNIQUE_INDEXES_SQL, &[]).await? {
        let index: String = row.try_get(0)?;
        let table: String = row.try_get(1)?;
        let columns: Vec<Option<String>> = row.try_get(2)?;
        let predicate: Option<String> = row.try_get(3)?;
        let btree = if amcheck { btree_check(client, &index).await } else { "skipped".into() };
        if btree != "passed" && btree != "skipped" {
            keys.violations.push(format!("{index}: {btree}"));
        }
        let Some(columns) = columns.into_iter().collect::<Option<Vec<String>>>() else {
            keys.unchecked.push(index);
            continue;
        };
        let duplicates = count_duplicates(client, &table, &columns, predicate.as_deref()).await?;
        if duplicates > 0 {
            keys.violations.push(format!("{index}: {duplicates} keys held by several rows"));
        }
        keys.indexes.push(UniqueIndexCheck { index, table, columns, duplicates, btree });
    }
    Ok(keys)
}

/// Keys of `table` held by more than one row (NULL keys never collide), reading the table
/// itself: with index scans off the planner cannot answer from the index under test.
async fn count_duplicates(
    client: &mut Client,
    table: &str,
    columns: &[String],
    predicate: Option<&str>,
) -> Result<i64, PgError> {
    let quoted: Vec<String> = columns.iter().map(|c| quote_ident(c)).collect();
    let mut filter: Vec<String> = quoted.iter().map(|c| format!("{c} IS NOT NULL")).collect();
    filter.extend(predicate.map(|p| format!("({p})")));
    let sql = format!(
        "SELECT count(*) FROM (SELECT 1 FROM {} WHERE {} GROUP BY {} HAVING count(*) > 1) d",
        quote_ident(table),
        filter.join(" AND "),
        quoted.join(", ")
    );
    let txn = client.transaction().await?;
    txn.batch_execute(
        "SET LOCAL enable_indexscan = off; SET LOCAL enable_indexonlyscan = off; \
         SET LOCAL enable_bitmapscan = off",
    )
    .await?;
    let duplicates: i64 = txn.query_one(&sql, &[]).await?.try_get(0)?;
    txn.rollback().await?;
    Ok(duplicates)
}

/// `bt_index_check(index, heapallindexed => true)`: `passed`, or the error it raised.
async fn btree_check(client: &Client, index: &str) -> String {
    match client.query_one("SELECT bt_index_check($1::text::regclass, true)", &[&index]).await {
        Ok(_) => "passed".into(),
        Err(e) => format!("bt_index_check failed: {}", PgError::from(e)),
    }
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consistent_ledger_and_payments_have_no_violations() {
        let ledger = LedgerFacts { claims: 5, releases: 1, sells: 2, ..LedgerFacts::default() };
        assert!(judge_ledger(&ledger, 4).is_empty());
        assert!(judge_payments(&PaymentFacts { payments: 3, ..PaymentFacts::default() }).is_empty());
    }

    #[test]
    fn each_ledger_and_payment_breach_is_reported() {
        let base = LedgerFacts { claims: 5, releases: 1, ..LedgerFacts::default() };
        let cases = [
            ("without their CLAIM", LedgerFacts { orders_without_claim: 1, ..base.clone() }),
            ("without their order", LedgerFacts { claims_without_order: 1, ..base.clone() }),
            ("RELEASE disagrees", LedgerFacts { release_mismatches: 1, ..base.clone() }),
            ("SELL disagrees", LedgerFacts { sell_mismatches: 1, ..base.clone() }),
            ("!= 4 live orders", LedgerFacts { claims: 6, ..base.clone() }),
        ];
        for (needle, ledger) in cases {
            let v = judge_ledger(&ledger, 4);
            assert!(v.iter().any(|s| s.contains(needle)), "{needle}: {v:?}");
        }
        let cases = [
            (
                "without an applied",
                PaymentFacts { paid_orders_without_payment: 1, ..Default::default() },
            ),
            ("more than one payment", PaymentFacts { orders_paid_twice: 1, ..Default::default() }),
            ("is not PAID", PaymentFacts { applied_on_unpaid_orders: 1, ..Default::default() }),
            ("another amount", PaymentFacts { applied_amount_mismatches: 1, ..Default::default() }),
        ];
        for (needle, payments) in cases {
            let v = judge_payments(&payments);
            assert!(v.iter().any(|s| s.contains(needle)), "{needle}: {v:?}");
        }
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("orders"), "\"orders\"");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
    }
}
