//! The payment-channel reconciliation (seed ch9 §7.10 step 4; `flashsale admin payments
//! reconcile --statement FILE [--apply]`): the provider's statement against what PostgreSQL
//! recorded, and the differences applied through THE payment state machine.
//!
//! What it is: [`reconcile_statement`] reads, for every statement line, the payment recorded
//! under its id and its order (one round trip per [`FACTS_CHUNK`] lines), and the payments
//! recorded PAID within the statement's period; `payment_statement::diff` classifies; with
//! [`ReconcileMode::Apply`] every `Apply` difference is its line fed to
//! `payments::apply_callback` — the very function a provider callback goes through, so the
//! same rules hold (PAID wins only over an unpaid order, a CLOSED order is never resurrected,
//! another amount is AMOUNT_MISMATCH). Idempotent by `payment_id`: once applied a line is
//! recorded as the statement says, so the same statement again finds no difference and
//! changes nothing; two operators applying it at once are serialised by the payment row.
//!
//! What it is not: the format or the classification (`payment_statement.rs`), a side door
//! into the tables (there is no SQL here that writes), or the CLI (`engine::app`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;

use crate::error::PgError;
use crate::payment_statement::{
    diff, Action, Difference, LineFacts, OrderFacts, PaidHere, RecordedPayment, Statement,
    STATEMENT_LINES_MAX,
};
use crate::payments::{apply_callback, CallbackOutcome, CallbackResult, PaymentCallback};

/// Statement lines whose facts one query reads.
pub const FACTS_CHUNK: usize = 5_000;

/// Most payments recorded PAID within one statement's period that are read.
const PAID_HERE_MAX: usize = 2 * STATEMENT_LINES_MAX;

const FACTS_SQL: &str = "\
    SELECT p.order_id, p.status, p.amount_cents, o.status, o.amount_cents \
    FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS s(payment_id, order_id, i) \
    LEFT JOIN payment p ON p.payment_id = s.payment_id \
    LEFT JOIN orders o ON o.order_id = s.order_id \
    ORDER BY s.i";

const PAID_HERE_SQL: &str = "\
    SELECT p.payment_id, p.order_id, p.amount_cents, o.status \
    FROM payment p LEFT JOIN orders o ON o.order_id = p.order_id \
    WHERE p.status = 'PAID' AND p.created_at >= $1 AND p.created_at <= $2 \
    ORDER BY p.created_at, p.payment_id LIMIT $3";

/// Report the differences only, or also apply those with [`Action::Apply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconcileMode {
    Report,
    Apply,
}

/// One difference and, when applied, what the state machine did with its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciled {
    pub difference: Difference,
    pub applied: Option<CallbackResult>,
}

impl Reconciled {
    /// Whether applying it changed PostgreSQL (not a replay, not refused as a conflict).
    pub fn changed(&self) -> bool {
        self.applied
            .as_ref()
            .is_some_and(|r| !r.replayed && r.outcome != CallbackOutcome::PaymentConflict)
    }
}

/// What one reconciliation found (and did).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconcileReport {
    pub lines: usize,
    /// The statement's period (earliest and latest `at`, Unix ms).
    pub period_ms: Option<(u64, u64)>,
    /// Lines recorded here exactly as the statement says.
    pub matched: usize,
    pub differences: Vec<Reconciled>,
}

impl ReconcileReport {
    /// Differences that applying changed.
    pub fn changed(&self) -> usize {
        self.differences.iter().filter(|d| d.changed()).count()
    }

    /// Differences left for a person: every `Review` one, and every `Apply` one not applied.
    pub fn open(&self) -> usize {
        self.differences
            .iter()
            .filter(|d| d.difference.action == Action::Review || d.applied.is_none())
            .count()
    }
}

/// Compares `statement` with PostgreSQL and, in [`ReconcileMode::Apply`], applies what it can
/// at `now_ms` (see the module documentation). A database error ends the call: what was
/// applied stays applied, and running it again is safe.
pub async fn reconcile_statement(
    client: &Client,
    statement: &Statement,
    mode: ReconcileMode,
    now_ms: u64,
) -> Result<ReconcileReport, PgError> {
    let facts = read_facts(client, statement).await?;
    let paid_here = match statement.period_ms() {
        Some(period) => read_paid_here(client, period).await?,
        None => Vec::new(),
    };
    let differences = diff(statement, &facts, &paid_here);
    let with_line = differences.iter().filter(|d| d.line.is_some()).count();
    let mut report = ReconcileReport {
        lines: statement.lines.len(),
        period_ms: statement.period_ms(),
        matched: statement.lines.len() - with_line,
        differences: Vec::with_capacity(differences.len()),
    };
    for difference in differences {
        let applied = match (mode, difference.action, &difference.line) {
            (ReconcileMode::Apply, Action::Apply, Some(line)) => {
                let callback = PaymentCallback {
                    payment_id: line.payment_id.clone(),
                    order_id: line.order_id.clone(),
                    status: line.status.as_str().to_owned(),
                    amount_cents: line.amount_cents,
                };
                let result = apply_callback(client, &callback, now_ms).await?;
                tracing::info!(
                    payment_id = %line.payment_id,
                    order_id = %line.order_id,
                    kind = difference.kind.as_str(),
                    outcome = result.outcome.as_str(),
                    replayed = result.replayed,
                    "payment statement line applied through the callback state machine"
                );
                Some(result)
            }
            _ => None,
        };
        report.differences.push(Reconciled { difference, applied });
    }
    Ok(report)
}

async fn read_facts(client: &Client, statement: &Statement) -> Result<Vec<LineFacts>, PgError> {
    let mut facts = Vec::with_capacity(statement.lines.len());
    for chunk in statement.lines.chunks(FACTS_CHUNK) {
        let payments: Vec<&str> = chunk.iter().map(|l| l.payment_id.as_str()).collect();
        let orders: Vec<&str> = chunk.iter().map(|l| l.order_id.as_str()).collect();
        let rows = client.query(FACTS_SQL, &[&payments, &orders]).await?;
        if rows.len() != chunk.len() {
            return Err(PgError::InvalidArgument("statement facts: one row per line expected"));
        }
        for row in rows {
            let recorded = match row.try_get::<_, Option<String>>(0)? {
                Some(order_id) => Some(RecordedPayment {
                    order_id,
                    status: row.try_get(1)?,
                    amount_cents: row.try_get(2)?,
                }),
                None => None,
            };
            let order = match row.try_get::<_, Option<String>>(3)? {
                Some(status) => Some(OrderFacts { status, amount_cents: row.try_get(4)? }),
                None => None,
            };
            facts.push(LineFacts { recorded, order });
        }
    }
    Ok(facts)
}

async fn read_paid_here(client: &Client, (from, to): (u64, u64)) -> Result<Vec<PaidHere>, PgError> {
    let limit = (PAID_HERE_MAX + 1) as i64;
    let rows = client.query(PAID_HERE_SQL, &[&system_time(from), &system_time(to), &limit]).await?;
    if rows.len() > PAID_HERE_MAX {
        return Err(PgError::InvalidArgument(
            "more payments recorded in the statement's period than one reconciliation reads: \
             split the statement",
        ));
    }
    let mut paid = Vec::with_capacity(rows.len());
    for row in rows {
        paid.push(PaidHere {
            payment_id: row.try_get(0)?,
            order_id: row.try_get(1)?,
            amount_cents: row.try_get(2)?,
            order_status: row.try_get(3)?,
        });
    }
    Ok(paid)
}

fn system_time(unix_ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(unix_ms)
}
