//! The order lifecycle after creation (DESIGN.md sections 6 and 8; CONTRACT.md 3.4): payment
//! callbacks, the buyer's cancel, the order timeout closer, and the order read the API needs.
//!
//! What it is: thin typed drivers around the PL/pgSQL functions of
//! `migrations/0003_payments.sql` (read its header for the state machine). Each business call
//! is ONE statement, hence one transaction per order: the conditional state change, the unit's
//! release or sale, the ledger row and the outbox event commit together or not at all.
//! Outcomes are values ([`CallbackOutcome`], [`ReleaseOutcome`]), never errors; `PgError` is
//! left for the database failing.
//!
//! - [`apply_callback`]: idempotent by `payment_id`; PAID wins over a cancel or the closer
//!   only when it locks the order first; a PAID that comes after them is recorded as
//!   [`CallbackOutcome::RefundNeeded`] and never resurrects the order.
//! - [`cancel_order`]: the owner's cancel of an unpaid order (waits for the row lock, so
//!   against a racing PAID exactly one of the two wins).
//! - [`close_due_orders`]: one bounded round of the unverified closer, which an operator must
//!   opt in to (`[payments] close_unpaid_without_provider`, [`WithoutProvider::CloseUnverified`];
//!   the default without a provider holds such orders instead: `payment_unknown.rs`):
//!   candidates past their activity's `pay_timeout_ms` without a PAID payment, each closed in
//!   its own transaction with `FOR UPDATE SKIP LOCKED` (several closers, or a callback in
//!   flight, never wait on each other). `PAYMENT_UNKNOWN` orders are never candidates.
//! - [`mark_payment_unknown`]: a provider timeout (the payment's fate cannot be learnt now)
//!   moves a PENDING_PAYMENT order to PAYMENT_UNKNOWN, so the closer keeps its unit.
//! - [`close_due_orders_verified`]: the closer with a payment provider configured
//!   (`[payments] status_url`, migration 0005): before closing, each due order without a PAID
//!   payment (PENDING_PAYMENT, and PAYMENT_UNKNOWN ones whose backoff has passed) is asked
//!   about with a signed status request (`provider.rs`). UNPAID/CLOSED/FAILED → closed and
//!   released (a PAYMENT_UNKNOWN order too); PAID → applied as a callback; no answer, an
//!   unknown status or a forged answer → PAYMENT_UNKNOWN, unit kept, asked again after
//!   `backoff_min_ms · 2^(asks−1)` (at most `backoff_max_ms`), counted in `payment_status_ask`.
//! - [`list_refunds`]: payments recorded REFUND_NEEDED (money to give back), oldest first;
//!   each also produced a `refund_requested` outbox event when its order exists (migration
//!   0005's trigger).
//!
//! What it is not: HTTP or signature checking (`engine::shard::orders`), the periodic loop
//! (`worker/closer_task.rs`), Redis (the `order_cancelled` event is applied by `redis-sync`).
//!
//! Metrics (no ids as labels): `flashsale_payment_callbacks_total{outcome}`,
//! `flashsale_orders_released_total{kind=cancel|close}`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;

use crate::error::PgError;
use crate::provider::{Answer, Provider, ProviderConfig};

/// Statuses a provider may report that are authoritative about money (CONTRACT.md 3.4). Any
/// other status string that arrives signed is treated as "payment unknown".
pub const AUTHORITATIVE_STATUSES: [&str; 3] = ["PAID", "FAILED", "CLOSED"];

/// Largest closer batch: one round stays a few hundred short transactions.
pub const CLOSE_BATCH_MAX: usize = 1024;

const CALLBACK_SQL: &str = "\
    SELECT r_outcome, r_order_status, r_replayed \
    FROM flashsale_payment_callback($1, $2, $3, $4, $5)";

const RELEASE_SQL: &str = "\
    SELECT r_outcome, r_status FROM flashsale_order_release($1, $2, $3, $4, $5)";

/// Candidates of one closer round: unpaid orders past their activity's pay timeout at `$1`,
/// oldest first. The first bound (`created_at` older than the shortest pay timeout of any
/// activity) lets `orders_pending_payment_idx` stop the scan early; the per-activity bound and
/// the payment check are then filters. The function re-checks all of it under the row lock.
pub(crate) const CLOSE_CANDIDATES_SQL: &str = "\
    SELECT o.order_id FROM orders o \
    JOIN activity a ON a.activity_id = o.activity_id \
    WHERE o.status = 'PENDING_PAYMENT' \
      AND o.created_at <= $1::timestamptz \
          - (SELECT coalesce(min(pay_timeout_ms), 0) FROM activity) * interval '1 millisecond' \
      AND o.created_at + a.pay_timeout_ms * interval '1 millisecond' <= $1::timestamptz \
      AND NOT EXISTS (SELECT 1 FROM payment p WHERE p.order_id = o.order_id AND p.status = 'PAID') \
    ORDER BY o.created_at LIMIT $2";

const FIND_ORDER_SQL: &str = "\
    SELECT o.order_id, o.activity_id, o.sku_id, o.user_id, o.status, o.amount_cents, \
           o.reservation_id, o.request_id, \
           (extract(epoch FROM o.created_at) * 1000)::bigint, \
           (extract(epoch FROM o.updated_at) * 1000)::bigint, \
           (extract(epoch FROM o.created_at) * 1000)::bigint + a.pay_timeout_ms \
    FROM orders o JOIN activity a ON a.activity_id = o.activity_id \
    WHERE o.order_id = $1 AND o.activity_id = $2 AND o.user_id = $3";

/// Candidates of a verified round: like [`CLOSE_CANDIDATES_SQL`], plus PAYMENT_UNKNOWN orders
/// past their pay timeout, each only once its backoff (`payment_status_ask.next_ask_at`) has
/// passed; with the asks so far.
const VERIFY_CANDIDATES_SQL: &str = "\
    SELECT c.order_id, c.attempts FROM ( \
      SELECT o.order_id, o.created_at, coalesce(q.attempts, 0) AS attempts FROM orders o \
      JOIN activity a ON a.activity_id = o.activity_id \
      LEFT JOIN payment_status_ask q ON q.order_id = o.order_id \
      WHERE o.status = 'PENDING_PAYMENT' \
        AND o.created_at <= $1::timestamptz \
            - (SELECT coalesce(min(pay_timeout_ms), 0) FROM activity) * interval '1 millisecond' \
        AND o.created_at + a.pay_timeout_ms * interval '1 millisecond' <= $1::timestamptz \
        AND (q.order_id IS NULL OR q.next_ask_at <= $1::timestamptz) \
        AND NOT EXISTS (SELECT 1 FROM payment p WHERE p.order_id = o.order_id AND p.status = 'PAID') \
      UNION ALL \
      SELECT o.order_id, o.created_at, coalesce(q.attempts, 0) FROM orders o \
      JOIN activity a ON a.activity_id = o.activity_id \
      LEFT JOIN payment_status_ask q ON q.order_id = o.order_id \
      WHERE o.status = 'PAYMENT_UNKNOWN' \
        AND o.created_at + a.pay_timeout_ms * interval '1 millisecond' <= $1::timestamptz \
        AND (q.order_id IS NULL OR q.next_ask_at <= $1::timestamptz) \
        AND NOT EXISTS (SELECT 1 FROM payment p WHERE p.order_id = o.order_id AND p.status = 'PAID') \
    ) c ORDER BY c.created_at LIMIT $2";

const CLOSE_VERIFIED_SQL: &str = "\
    SELECT r_outcome, r_status FROM flashsale_order_close_verified($1, $2)";

/// Records one ask: `$2` the asks so far including this one, `$3` the next ask's time.
const RECORD_ASK_SQL: &str = "\
    INSERT INTO payment_status_ask (order_id, attempts, next_ask_at, last_answer, asked_at) \
    VALUES ($1, $2, $3, $4, $5) \
    ON CONFLICT (order_id) DO UPDATE SET attempts = payment_status_ask.attempts + 1, \
      next_ask_at = EXCLUDED.next_ask_at, last_answer = EXCLUDED.last_answer, \
      asked_at = EXCLUDED.asked_at";

const REFUNDS_SQL: &str = "\
    SELECT p.order_id, p.payment_id, p.amount_cents, \
           (extract(epoch FROM p.created_at) * 1000)::bigint, o.status, p.outcome \
    FROM payment p LEFT JOIN orders o ON o.order_id = p.order_id \
    WHERE p.outcome IN ('REFUND_NEEDED', 'AMOUNT_MISMATCH') \
    ORDER BY p.created_at, p.payment_id LIMIT $1";

const MARK_UNKNOWN_SQL: &str = "\
    UPDATE orders SET status = 'PAYMENT_UNKNOWN', updated_at = now() \
    WHERE order_id = $1 AND status = 'PENDING_PAYMENT'";

// ---------------------------------------------------------------------------------------------
// Payment callbacks
// ---------------------------------------------------------------------------------------------

/// A verified provider callback (the signature was checked by the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentCallback {
    pub payment_id: String,
    pub order_id: String,
    /// As sent: `PAID`, `FAILED`, `CLOSED`, or anything else (→ payment unknown).
    pub status: String,
    pub amount_cents: i64,
}

/// What a callback did (see `flashsale_payment_callback` in migration 0003).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallbackOutcome {
    /// The order is now PAID (token SOLD, ledger SELL, `order_paid` event).
    Paid,
    /// FAILED/CLOSED recorded: the order is authoritatively unpaid.
    Unpaid,
    /// Money arrived for an order that no longer takes it (CANCELLED, CLOSED, paid by another
    /// payment) or that is unknown: recorded, the order untouched; the money must be refunded.
    RefundNeeded,
    /// PAID with another amount than the order's: recorded, order PAYMENT_UNKNOWN (unit kept).
    AmountMismatch,
    /// A status that says nothing authoritative; the order (if PENDING_PAYMENT) is now
    /// PAYMENT_UNKNOWN and keeps its unit.
    PaymentUnknown,
    /// This `payment_id` was recorded with another order, status or amount: nothing done.
    PaymentConflict,
}

impl CallbackOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            CallbackOutcome::Paid => "PAID",
            CallbackOutcome::Unpaid => "UNPAID",
            CallbackOutcome::RefundNeeded => "REFUND_NEEDED",
            CallbackOutcome::AmountMismatch => "AMOUNT_MISMATCH",
            CallbackOutcome::PaymentUnknown => "PAYMENT_UNKNOWN",
            CallbackOutcome::PaymentConflict => "PAYMENT_CONFLICT",
        }
    }

    /// Every outcome (the closed label set of `flashsale_payment_callbacks_total`).
    pub const ALL: [CallbackOutcome; 6] = [
        CallbackOutcome::Paid,
        CallbackOutcome::Unpaid,
        CallbackOutcome::RefundNeeded,
        CallbackOutcome::AmountMismatch,
        CallbackOutcome::PaymentUnknown,
        CallbackOutcome::PaymentConflict,
    ];

    pub fn parse(text: &str) -> Option<CallbackOutcome> {
        CallbackOutcome::ALL.into_iter().find(|o| o.as_str() == text)
    }

    /// Whether the provider should be told the money has to go back.
    pub fn refund_needed(self) -> bool {
        matches!(self, CallbackOutcome::RefundNeeded)
    }
}

/// The answer to one callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallbackResult {
    pub outcome: CallbackOutcome,
    /// The order's status afterwards; `None` when the order is unknown.
    pub order_status: Option<String>,
    /// The same callback was applied before: `outcome` is the recorded one, nothing changed.
    pub replayed: bool,
}

/// Applies one verified callback (one transaction). Idempotent by `payment_id`: the same
/// callback again returns the first outcome with `replayed`, a different body for the same id
/// returns [`CallbackOutcome::PaymentConflict`].
pub async fn apply_callback(
    client: &Client,
    callback: &PaymentCallback,
    now_ms: u64,
) -> Result<CallbackResult, PgError> {
    if callback.amount_cents < 0 {
        return Err(PgError::InvalidArgument("amount_cents must not be negative"));
    }
    let row = client
        .query_one(
            CALLBACK_SQL,
            &[
                &callback.payment_id,
                &callback.order_id,
                &callback.status,
                &callback.amount_cents,
                &system_time(now_ms),
            ],
        )
        .await?;
    let outcome_text: Option<String> = row.try_get(0)?;
    // NULL only for a replay of a row whose outcome was never written, which the function
    // makes impossible (written before COMMIT); report it as the conflict it would be.
    let outcome = outcome_text
        .as_deref()
        .and_then(CallbackOutcome::parse)
        .unwrap_or(CallbackOutcome::PaymentConflict);
    let result =
        CallbackResult { outcome, order_status: row.try_get(1)?, replayed: row.try_get(2)? };
    if !result.replayed {
        metrics::counter!("flashsale_payment_callbacks_total", "outcome" => outcome.as_str())
            .increment(1);
    }
    if result.outcome.refund_needed() && !result.replayed {
        tracing::warn!(
            payment_id = %callback.payment_id,
            order_id = %callback.order_id,
            order_status = result.order_status.as_deref().unwrap_or("unknown"),
            "payment received for an order that does not take it: refund needed"
        );
    }
    Ok(result)
}

/// A provider timeout: the payment's fate is unknown. A PENDING_PAYMENT order becomes
/// PAYMENT_UNKNOWN (the closer then keeps its unit); returns whether it changed.
pub async fn mark_payment_unknown(client: &Client, order_id: &str) -> Result<bool, PgError> {
    Ok(client.execute(MARK_UNKNOWN_SQL, &[&order_id]).await? == 1)
}

// ---------------------------------------------------------------------------------------------
// Cancel and close
// ---------------------------------------------------------------------------------------------

/// What a cancel or close attempt found (see `flashsale_order_release` in migration 0003).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// Done: the order is CANCELLED/CLOSED, its unit released, ledger and event written.
    Released,
    /// No such order (cancel: or not this buyer's in this activity).
    NotFound,
    /// Close only: another transaction holds the order now; looked at again next round.
    Busy,
    /// The order is not PENDING_PAYMENT; its status.
    NotPending { status: String },
    /// A PAID payment is recorded for it: never released.
    PaidRecorded,
    /// Close only: not past its pay timeout yet.
    NotDue,
}

/// The buyer's cancel of an unpaid order (one transaction). The order must belong to
/// (`activity_id`, `user_id`), else [`ReleaseOutcome::NotFound`] (someone else's order is
/// indistinguishable from none).
pub async fn cancel_order(
    client: &Client,
    order_id: &str,
    activity_id: i64,
    user_id: i64,
    now_ms: u64,
) -> Result<ReleaseOutcome, PgError> {
    let outcome = release(client, order_id, "CANCEL", activity_id, user_id, now_ms).await?;
    if outcome == ReleaseOutcome::Released {
        metrics::counter!("flashsale_orders_released_total", "kind" => "cancel").increment(1);
        tracing::info!(order_id, "order cancelled by its buyer");
    }
    Ok(outcome)
}

async fn release(
    client: &Client,
    order_id: &str,
    kind: &str,
    activity_id: i64,
    user_id: i64,
    now_ms: u64,
) -> Result<ReleaseOutcome, PgError> {
    let row = client
        .query_one(RELEASE_SQL, &[&order_id, &kind, &activity_id, &user_id, &system_time(now_ms)])
        .await?;
    let outcome: String = row.try_get(0)?;
    let status: Option<String> = row.try_get(1)?;
    Ok(match outcome.as_str() {
        "RELEASED" => ReleaseOutcome::Released,
        "NOT_FOUND" => ReleaseOutcome::NotFound,
        "BUSY" => ReleaseOutcome::Busy,
        "NOT_PENDING" => ReleaseOutcome::NotPending { status: status.unwrap_or_default() },
        "PAID_RECORDED" => ReleaseOutcome::PaidRecorded,
        "NOT_DUE" => ReleaseOutcome::NotDue,
        _ => return Err(PgError::InvalidArgument("unknown flashsale_order_release outcome")),
    })
}

/// The closer's settings (part of `WorkerConfig`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloserConfig {
    /// Pause between rounds when the last one was not full. A closed order's unit is back on
    /// sale within about this much after its pay timeout.
    pub interval_ms: u64,
    /// Orders looked at per round (1..=[`CLOSE_BATCH_MAX`]).
    pub batch_max: usize,
    /// The payment provider asked before each close ([`close_due_orders_verified`]); `None`:
    /// what happens to an order without a callback is [`CloserConfig::without_provider`].
    pub provider: Option<ProviderConfig>,
    /// Without a provider: hold due orders PAYMENT_UNKNOWN (the default) or, only when the
    /// operator opted in, close them unverified. Ignored when `provider` is set.
    pub without_provider: WithoutProvider,
}

/// What the closer does, with no payment provider to ask, to an unpaid order past its pay
/// timeout (seed ch9 §7.10: a unit whose payment may have happened is never resold on a
/// guess).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WithoutProvider {
    /// PAYMENT_UNKNOWN, its unit kept, listed and alerted until the provider's word arrives
    /// (a callback, or its statement reconciled); closed only on a recorded FAILED/CLOSED
    /// (`payment_unknown::hold_due_orders`).
    #[default]
    HoldUnknown,
    /// Closed and its unit released without asking anyone ([`close_due_orders`]): a payment
    /// whose callback is late sees its unit resold. An explicit opt-in
    /// (`[payments] close_unpaid_without_provider = true`), logged loudly at start.
    CloseUnverified,
}

impl WithoutProvider {
    /// The label of `flashsale_payment_closer_mode{mode}` for this choice.
    pub fn mode_label(self) -> &'static str {
        match self {
            WithoutProvider::HoldUnknown => "hold_unknown",
            WithoutProvider::CloseUnverified => "close_unverified",
        }
    }
}

impl Default for CloserConfig {
    fn default() -> CloserConfig {
        // Pay timeouts are minutes; a second of lateness is noise, and a round that finds
        // nothing costs one index probe.
        CloserConfig {
            interval_ms: 1_000,
            batch_max: 128,
            provider: None,
            without_provider: WithoutProvider::HoldUnknown,
        }
    }
}

impl CloserConfig {
    pub fn validate(&self) -> Result<(), PgError> {
        if let Some(provider) = &self.provider {
            provider.validate()?;
        }
        if self.interval_ms == 0 {
            return Err(PgError::Config("closer.interval_ms must be positive".into()));
        }
        if !(1..=CLOSE_BATCH_MAX).contains(&self.batch_max) {
            return Err(PgError::Config(format!(
                "closer.batch_max {} must be within 1..={CLOSE_BATCH_MAX}",
                self.batch_max
            )));
        }
        Ok(())
    }
}

/// What one closer round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CloseRound {
    /// Candidates the scan returned (at most the batch).
    pub candidates: usize,
    /// Order ids closed by this round, in the order they were closed.
    pub closed: Vec<String>,
    /// Candidates left alone: locked by someone, paid or cancelled meanwhile, not due.
    pub skipped: usize,
    /// Candidates whose transaction failed permanently (logged; the rest still closed).
    pub failed: usize,
}

/// One bounded closer round at `now_ms` (see the module documentation). A transient error
/// ends the round with `Err` (the caller pauses and retries); a permanent error on one order
/// is logged and counted, so one bad row cannot stop the others from closing.
pub async fn close_due_orders(
    client: &Client,
    batch_max: usize,
    now_ms: u64,
) -> Result<CloseRound, PgError> {
    if !(1..=CLOSE_BATCH_MAX).contains(&batch_max) {
        return Err(PgError::InvalidArgument("batch_max must be within 1..=CLOSE_BATCH_MAX"));
    }
    let limit = batch_max as i64;
    let rows = client.query(CLOSE_CANDIDATES_SQL, &[&system_time(now_ms), &limit]).await?;
    let mut round = CloseRound { candidates: rows.len(), ..CloseRound::default() };
    for row in rows {
        let order_id: String = row.try_get(0)?;
        match release(client, &order_id, "CLOSE", 0, 0, now_ms).await {
            Ok(ReleaseOutcome::Released) => {
                metrics::counter!("flashsale_orders_released_total", "kind" => "close")
                    .increment(1);
                tracing::info!(order_id = %order_id, "unpaid order closed after its pay timeout");
                round.closed.push(order_id);
            }
            Ok(_) => round.skipped += 1,
            Err(e) if e.is_transient() => return Err(e),
            Err(e) => {
                round.failed += 1;
                tracing::error!(order_id = %order_id, error = %e, "closing an order failed");
            }
        }
    }
    Ok(round)
}

/// What one verified closer round did (on top of [`CloseRound`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifiedRound {
    /// Closes, skips and failures as in an unverified round (`closed`: the provider said
    /// unpaid and the order was released).
    pub round: CloseRound,
    /// Order ids the provider said are paid, applied as callbacks.
    pub paid: Vec<String>,
    /// Order ids with no authoritative answer: PAYMENT_UNKNOWN now, asked again later.
    pub unknown: Vec<String>,
}

/// One bounded round of the verified closer at `now_ms` (see the module documentation). The
/// asks run concurrently (at most `provider.config().concurrency`), each bounded by its
/// deadline and attempts; then each answer is applied in its own transaction. A transient
/// database error ends the round with `Err` like [`close_due_orders`].
pub async fn close_due_orders_verified(
    client: &Client,
    provider: &Provider,
    batch_max: usize,
    now_ms: u64,
) -> Result<VerifiedRound, PgError> {
    use futures::StreamExt as _;
    if !(1..=CLOSE_BATCH_MAX).contains(&batch_max) {
        return Err(PgError::InvalidArgument("batch_max must be within 1..=CLOSE_BATCH_MAX"));
    }
    let limit = batch_max as i64;
    let rows = client.query(VERIFY_CANDIDATES_SQL, &[&system_time(now_ms), &limit]).await?;
    let mut candidates = Vec::with_capacity(rows.len());
    for row in &rows {
        let order_id: String = row.try_get(0)?;
        let attempts: i32 = row.try_get(1)?;
        candidates.push((order_id, attempts));
    }
    let asks =
        futures::stream::iter(candidates.into_iter().map(|(order_id, attempts)| async move {
            let answer = provider.ask(&order_id, now_ms).await;
            (order_id, attempts, answer)
        }))
        .buffer_unordered(provider.config().concurrency)
        .collect::<Vec<_>>()
        .await;
    let mut result = VerifiedRound::default();
    result.round.candidates = rows.len();
    for (order_id, attempts, answer) in asks {
        let asks_now = u32::try_from(attempts).unwrap_or(0).saturating_add(1);
        let next_ms = now_ms.saturating_add(provider.config().backoff_ms(asks_now));
        let last = match &answer {
            Answer::Paid { .. } => "PAID".to_owned(),
            Answer::Unpaid { status } => format!("UNPAID ({status})"),
            Answer::Unknown { why } => format!("UNKNOWN ({why})"),
        };
        client
            .execute(
                RECORD_ASK_SQL,
                &[
                    &order_id,
                    &i32::try_from(asks_now).unwrap_or(i32::MAX),
                    &system_time(next_ms),
                    &last,
                    &system_time(now_ms),
                ],
            )
            .await?;
        match apply_answer(client, &order_id, answer, now_ms, &mut result).await {
            Ok(()) => {}
            Err(e) if e.is_transient() => return Err(e),
            Err(e) => {
                result.round.failed += 1;
                tracing::error!(order_id = %order_id, error = %e, "acting on a payment status failed");
            }
        }
    }
    Ok(result)
}

/// Acts on one provider answer (one transaction), recording what happened in `result`.
async fn apply_answer(
    client: &Client,
    order_id: &str,
    answer: Answer,
    now_ms: u64,
    result: &mut VerifiedRound,
) -> Result<(), PgError> {
    match answer {
        Answer::Paid { payment_id, amount_cents } => {
            let callback = PaymentCallback {
                payment_id,
                order_id: order_id.to_owned(),
                status: "PAID".to_owned(),
                amount_cents: i64::try_from(amount_cents)
                    .map_err(|_| PgError::InvalidArgument("amount_cents out of range"))?,
            };
            let applied = apply_callback(client, &callback, now_ms).await?;
            tracing::info!(
                order_id,
                outcome = applied.outcome.as_str(),
                "the payment provider says paid: applied as a callback"
            );
            result.paid.push(order_id.to_owned());
        }
        Answer::Unpaid { status } => {
            let row =
                client.query_one(CLOSE_VERIFIED_SQL, &[&order_id, &system_time(now_ms)]).await?;
            let outcome: String = row.try_get(0)?;
            if outcome == "RELEASED" {
                metrics::counter!("flashsale_orders_released_total", "kind" => "close")
                    .increment(1);
                tracing::info!(order_id, provider_status = %status, "unpaid order closed after its pay timeout (verified)");
                result.round.closed.push(order_id.to_owned());
            } else {
                result.round.skipped += 1;
            }
        }
        Answer::Unknown { why } => {
            mark_payment_unknown(client, order_id).await?;
            tracing::warn!(order_id, why = %why, "payment status unknown: unit kept, asked again later");
            result.unknown.push(order_id.to_owned());
        }
    }
    Ok(())
}

/// One payment whose money must go back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refund {
    pub order_id: String,
    pub payment_id: String,
    pub amount_cents: i64,
    /// When the payment was recorded (Unix ms).
    pub since_ms: i64,
    /// The order's status (`None`: no such order).
    pub order_status: Option<String>,
    /// Why the money goes back: `REFUND_NEEDED` (no live order took it) or `AMOUNT_MISMATCH`
    /// (another amount than the order's).
    pub outcome: String,
}

/// Largest refund listing.
pub const REFUNDS_MAX: usize = 1_000;

/// Payments recorded REFUND_NEEDED or AMOUNT_MISMATCH (money to give back), oldest first, at most `limit` (1..=[`REFUNDS_MAX`]).
pub async fn list_refunds(client: &Client, limit: usize) -> Result<Vec<Refund>, PgError> {
    if !(1..=REFUNDS_MAX).contains(&limit) {
        return Err(PgError::InvalidArgument("limit must be within 1..=REFUNDS_MAX"));
    }
    let rows = client.query(REFUNDS_SQL, &[&(limit as i64)]).await?;
    let mut refunds = Vec::with_capacity(rows.len());
    for row in rows {
        refunds.push(Refund {
            order_id: row.try_get(0)?,
            payment_id: row.try_get(1)?,
            amount_cents: row.try_get(2)?,
            since_ms: row.try_get(3)?,
            order_status: row.try_get(4)?,
            outcome: row.try_get(5)?,
        });
    }
    Ok(refunds)
}

// ---------------------------------------------------------------------------------------------
// Reading an order
// ---------------------------------------------------------------------------------------------

/// An order as its buyer sees it (`GET /v1/orders/{order_id}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderView {
    pub order_id: String,
    pub activity_id: i64,
    pub sku_id: i64,
    pub user_id: i64,
    pub status: String,
    pub amount_cents: Option<i64>,
    pub reservation_id: String,
    pub request_id: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// When the closer may close it if unpaid (`created_at` + the activity's pay timeout).
    pub pay_deadline_ms: i64,
}

/// The order if it belongs to (`activity_id`, `user_id`); `None` otherwise (someone else's
/// order is indistinguishable from none).
pub async fn find_order(
    client: &Client,
    order_id: &str,
    activity_id: i64,
    user_id: i64,
) -> Result<Option<OrderView>, PgError> {
    let Some(row) = client.query_opt(FIND_ORDER_SQL, &[&order_id, &activity_id, &user_id]).await?
    else {
        return Ok(None);
    };
    Ok(Some(OrderView {
        order_id: row.try_get(0)?,
        activity_id: row.try_get(1)?,
        sku_id: row.try_get(2)?,
        user_id: row.try_get(3)?,
        status: row.try_get(4)?,
        amount_cents: row.try_get(5)?,
        reservation_id: row.try_get(6)?,
        request_id: row.try_get(7)?,
        created_at_ms: row.try_get(8)?,
        updated_at_ms: row.try_get(9)?,
        pay_deadline_ms: row.try_get(10)?,
    }))
}

fn system_time(unix_ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(unix_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callback_outcomes_round_trip_their_text() {
        for outcome in CallbackOutcome::ALL {
            assert_eq!(CallbackOutcome::parse(outcome.as_str()), Some(outcome));
        }
        assert_eq!(CallbackOutcome::parse("paid"), None);
        assert!(CallbackOutcome::RefundNeeded.refund_needed());
        assert!(!CallbackOutcome::Paid.refund_needed());
    }

    #[test]
    fn closer_config_bounds() {
        CloserConfig::default().validate().expect("default");
        assert!(CloserConfig { interval_ms: 0, ..Default::default() }.validate().is_err());
        assert!(CloserConfig { batch_max: 0, ..Default::default() }.validate().is_err());
        assert!(CloserConfig { batch_max: CLOSE_BATCH_MAX + 1, ..Default::default() }
            .validate()
            .is_err());
    }

    #[test]
    fn the_sql_outcomes_match_the_migration() {
        let migration = include_str!("../migrations/0003_payments.sql");
        for outcome in ["RELEASED", "NOT_FOUND", "BUSY", "NOT_PENDING", "PAID_RECORDED", "NOT_DUE"]
        {
            assert!(migration.contains(&format!("'{outcome}'")), "{outcome}");
        }
        for outcome in ["PAID", "UNPAID", "REFUND_NEEDED", "AMOUNT_MISMATCH", "PAYMENT_UNKNOWN"] {
            assert!(migration.contains(&format!("'{outcome}'")), "{outcome}");
        }
    }
}
