//! The set-based batch transaction (migration 0004): a fixed number of statements per batch,
//! whatever its size, every per-message outcome of DESIGN.md section 5 kept.
//!
//! What it is: [`write_set_once`], one attempt: two pipelined round trips around a sans-I/O
//! decision:
//!
//! ```text
//! BEGIN; SELECT ... FROM flashsale_order_facts(arrays)     -- inbox, recorded, buyers, locks
//!     plan::plan(messages, facts)                          -- every outcome, in Rust
//! SELECT flashsale_order_apply(arrays); INSERT INTO event_outbox ...; COMMIT;
//! ```
//!
//! Why two round trips and not one function that also decides: the decision is the one place
//! where a batch's messages meet each other, and `plan.rs` states it as the per-message rules
//! over a loop (property-tested against a model of the per-message function); the facts
//! function only reads and locks, the apply function only writes. The round trip between them
//! costs ~0.1 ms per batch; the per-message path also needs two.
//!
//! When PostgreSQL refuses the batch (a message breaks a constraint, a buyer was raced by a
//! concurrent transaction — SQLSTATE FS001 —, a deadlock or lock timeout), the transaction is
//! rolled back and the attempt answers [`Attempt::Refused`] with its [`Refusal`]; the caller
//! (`order_path.rs`) then writes the batch the per-message way. A broken connection is `Err`,
//! as on the per-message path. A plan that breaks the sale's invariants (`plan.rs` asserts
//! them) panics after this rolls the transaction back: nothing of the batch commits, nothing
//! is acked.
//!
//! What it is not: the rules (`plan.rs`), the fallback (`order_path.rs`), the SQL
//! (`migrations/0004_order_create_set.sql`, `sql.rs`), the statements' pipelining
//! (`statements.rs`), the settlement of deliveries (`classify.rs`, `worker/`).
//!
//! Read next: `plan.rs`, `migrations/0004_order_create_set.sql`.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::SystemTime;

use deadpool_postgres::ClientWrapper;
use flashsale_io::wire::OrderCreate;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::batch_events::EventColumns;
use crate::classify::WriteOutcome;
use crate::error::PgError;
use crate::plan::{self, bigint, Facts, Plan, RecordedRow, SkuClaim, SkuFacts};
use crate::sql;
use crate::statements::{
    call, describe, exec, next_result, pipeline, system_time, Pending, Statements,
};

/// Most messages in one set-based transaction (its arrays, the rows and token locks it holds,
/// and what a fallback to the per-message path redoes). The worker's `fetch_max` is bounded
/// by it.
pub const SET_BATCH_MAX: usize = 1024;

/// Why a batch left the set-based path (the metric's `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// FS001: an order met a buyer the facts did not show.
    BuyerRace,
    /// Any other error the server answered (constraint, deadlock, timeout, ...).
    Server,
    /// The facts contradicted the batch (a defect; logged).
    Inconsistent,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::BuyerRace => "buyer_race",
            Refusal::Server => "server_error",
            Refusal::Inconsistent => "inconsistent_facts",
        }
    }

    fn of(error: &tokio_postgres::Error) -> Refusal {
        match error.code() {
            Some(code) if code.code() == sql::BUYER_RACE_SQLSTATE => Refusal::BuyerRace,
            _ => Refusal::Server,
        }
    }
}

/// What one set-based attempt did.
#[derive(Debug)]
pub enum Attempt {
    /// Committed: every message's outcome, in input order.
    Committed(Vec<WriteOutcome>),
    /// Not committed, the transaction closed (the error's text beside the reason): write the
    /// batch another way.
    Refused(Refusal, String),
}

/// One set-based attempt without the fallback (the equivalence tests use it to be sure the
/// set-based statements wrote the batch). `Err` as in the module documentation.
pub async fn write_set_once(
    client: &ClientWrapper,
    consumer_group: &str,
    messages: &[&OrderCreate],
    now_ms: u64,
) -> Result<Attempt, PgError> {
    if messages.is_empty() || messages.len() > SET_BATCH_MAX {
        return Err(PgError::InvalidArgument("a set batch holds 1..=SET_BATCH_MAX messages"));
    }
    let statements = Statements::prepare(client).await?;
    attempt(client, &statements, consumer_group, messages, now_ms).await
}

async fn attempt(
    client: &tokio_postgres::Client,
    statements: &Statements,
    consumer_group: &str,
    messages: &[&OrderCreate],
    now_ms: u64,
) -> Result<Attempt, PgError> {
    let facts = match read_facts(client, statements, consumer_group, messages, now_ms).await? {
        Ok(facts) => facts,
        Err(refused) => return Ok(refused),
    };
    let planned = catch_unwind(AssertUnwindSafe(|| plan::plan(messages, &facts, now_ms)));
    let plan = match planned {
        Ok(Ok(plan)) => plan,
        Ok(Err(inconsistent)) => {
            client.execute(&statements.rollback, &[]).await?;
            return Ok(Attempt::Refused(Refusal::Inconsistent, inconsistent.0.to_owned()));
        }
        Err(breach) => return Err(stop_on_breach(client, statements, messages, breach).await),
    };
    let apply = ApplyColumns::new(consumer_group, messages, &plan);
    let apply_args = apply.args();
    let events = EventColumns::new(messages, &plan.outcomes, now_ms)?;
    let event_args = events.args();
    let mut requests: Vec<Pending<'_>> = Vec::with_capacity(3);
    if !plan.finals.is_empty() || !plan.contended_ids.is_empty() {
        requests.push(call(client, &statements.order_apply, &apply_args));
    }
    if !events.is_empty() {
        requests.push(Box::pin(async move {
            client.execute(&statements.insert_events, &event_args).await.map(|_| None)
        }));
    }
    requests.push(exec(client, &statements.commit));
    // The first error is the one that counts: after it, COMMIT answers ROLLBACK (no error),
    // which closes the transaction; it must not be mistaken for success.
    let mut refused: Option<Attempt> = None;
    for result in pipeline(requests).await {
        match result {
            Ok(_) => {}
            Err(error) if error.code().is_none() => return Err(error.into()),
            Err(error) => {
                if refused.is_none() {
                    let text = describe(&error);
                    refused = Some(Attempt::Refused(Refusal::of(&error), text));
                }
            }
        }
    }
    Ok(refused.unwrap_or(Attempt::Committed(plan.outcomes)))
}

/// The plan broke an invariant of the sale (`plan.rs` asserted it; its panic message, already
/// written by the panic hook, names the invariant and the ids): the transaction is rolled back
/// here, so that nothing of the batch commits even if this connection goes back to its pool
/// and is used again, and the panic carries on. Nothing is acked: the caller never sees an
/// outcome. Never returns; typed as the attempt's error so that the call site reads as one.
async fn stop_on_breach(
    client: &tokio_postgres::Client,
    statements: &Statements,
    messages: &[&OrderCreate],
    breach: Box<dyn Any + Send>,
) -> PgError {
    let text = breach
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| breach.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    let first = messages.first().map_or("", |m| m.reservation_id.as_str());
    tracing::error!(
        size = messages.len(),
        first_reservation_id = first,
        breach = text,
        "set batch stopped: its plan breaks an invariant of the sale; rolled back, nothing acked"
    );
    // If the rollback fails the connection is broken, which ends the transaction too.
    let _ = client.execute(&statements.rollback, &[]).await;
    resume_unwind(breach)
}

/// BEGIN and the facts, in one round trip. `Ok(Err(refused))`: the server refused the facts
/// call and the transaction was rolled back.
async fn read_facts(
    client: &tokio_postgres::Client,
    statements: &Statements,
    consumer_group: &str,
    messages: &[&OrderCreate],
    now_ms: u64,
) -> Result<Result<Facts, Attempt>, PgError> {
    let columns = FactColumns::new(messages);
    let now = system_time(now_ms);
    let args: [&(dyn ToSql + Sync); 10] = [
        &consumer_group,
        &columns.message_ids,
        &columns.reservation_ids,
        &columns.activity_ids,
        &columns.sku_ids,
        &columns.user_ids,
        &columns.expires_at,
        &columns.quantities,
        &columns.request_ids,
        &now,
    ];
    let requests =
        vec![exec(client, &statements.begin), call(client, &statements.order_facts, &args)];
    let mut results = pipeline(requests).await.into_iter();
    next_result(&mut results)?; // BEGIN: fails only if the connection broke.
    match results.next() {
        Some(Ok(Some(row))) => Ok(Ok(decode_facts(&row, messages.len())?)),
        Some(Err(error)) if error.code().is_some() => {
            client.execute(&statements.rollback, &[]).await?;
            let text = describe(&error);
            Ok(Err(Attempt::Refused(Refusal::of(&error), text)))
        }
        Some(Err(error)) => Err(error.into()),
        Some(Ok(None)) | None => Err(PgError::InvalidArgument("the facts call returned no row")),
    }
}

/// 1-based positions as 0-based indexes into a batch of `batch_len`; `None` if one is outside.
fn positions(one_based: Vec<i32>, batch_len: usize) -> Option<Vec<usize>> {
    one_based
        .into_iter()
        .map(|p| usize::try_from(p).ok().and_then(|p| p.checked_sub(1)).filter(|&p| p < batch_len))
        .collect()
}

/// The messages as the facts function's arrays, by position.
struct FactColumns<'a> {
    message_ids: Vec<&'a str>,
    reservation_ids: Vec<&'a str>,
    request_ids: Vec<&'a str>,
    activity_ids: Vec<i64>,
    sku_ids: Vec<i64>,
    user_ids: Vec<i64>,
    expires_at: Vec<SystemTime>,
    quantities: Vec<i32>,
}

impl<'a> FactColumns<'a> {
    fn new(messages: &[&'a OrderCreate]) -> FactColumns<'a> {
        FactColumns {
            message_ids: messages.iter().map(|m| m.message_id.as_str()).collect(),
            reservation_ids: messages.iter().map(|m| m.reservation_id.as_str()).collect(),
            request_ids: messages.iter().map(|m| m.request_id.as_str()).collect(),
            activity_ids: messages.iter().map(|m| bigint(m.activity_id)).collect(),
            sku_ids: messages.iter().map(|m| bigint(m.sku_id)).collect(),
            user_ids: messages.iter().map(|m| bigint(m.user_id)).collect(),
            expires_at: messages.iter().map(|m| system_time(m.reservation_expires_at_ms)).collect(),
            quantities: messages.iter().map(|m| quantity(m.quantity)).collect(),
        }
    }
}

/// A quantity as PostgreSQL stores it (`wire::OrderCreate::validate` bounds it by
/// QUANTITY_MAX; saturate like the ids, the schema's CHECK then refuses it).
fn quantity(units: u32) -> i32 {
    i32::try_from(units).unwrap_or(i32::MAX)
}

/// The plan as the apply function's arrays (see `ORDER_APPLY_SQL`).
struct ApplyColumns<'a> {
    consumer_group: &'a str,
    contended_ids: &'a [String],
    reservation_ids: Vec<&'a str>,
    request_ids: Vec<&'a str>,
    message_ids: Vec<&'a str>,
    activity_ids: Vec<i64>,
    sku_ids: Vec<i64>,
    user_ids: Vec<i64>,
    statuses: Vec<&'static str>,
    order_ids: Vec<Option<&'a str>>,
    quantities: Vec<i32>,
    first_token_ids: Vec<Option<&'a str>>,
    unit_token_ids: Vec<&'a str>,
    unit_rows: Vec<i32>,
    reserved_at: Vec<SystemTime>,
    expires_at: Vec<SystemTime>,
    row_activity_ids: Vec<i64>,
    row_sku_ids: Vec<i64>,
    row_units: Vec<i64>,
}

impl<'a> ApplyColumns<'a> {
    fn new(
        consumer_group: &'a str,
        messages: &[&'a OrderCreate],
        plan: &'a Plan,
    ) -> ApplyColumns<'a> {
        let finals = || plan.finals.iter().map(|f| (f, messages[f.position]));
        // Every claimed token with its final row (1-based, as SQL arrays count).
        let units = || {
            plan.finals
                .iter()
                .zip(1..)
                .flat_map(|(f, row)| f.token_ids.iter().map(move |t| (t, row)))
        };
        ApplyColumns {
            consumer_group,
            contended_ids: &plan.contended_ids,
            reservation_ids: finals().map(|(_, m)| m.reservation_id.as_str()).collect(),
            request_ids: finals().map(|(_, m)| m.request_id.as_str()).collect(),
            message_ids: finals().map(|(_, m)| m.message_id.as_str()).collect(),
            activity_ids: finals().map(|(_, m)| bigint(m.activity_id)).collect(),
            sku_ids: finals().map(|(_, m)| bigint(m.sku_id)).collect(),
            user_ids: finals().map(|(_, m)| bigint(m.user_id)).collect(),
            statuses: finals().map(|(f, _)| f.status).collect(),
            order_ids: finals().map(|(f, _)| f.order_id.as_deref()).collect(),
            quantities: finals().map(|(_, m)| quantity(m.quantity)).collect(),
            first_token_ids: finals()
                .map(|(f, _)| f.token_ids.first().map(String::as_str))
                .collect(),
            unit_token_ids: units().map(|(t, _)| t.as_str()).collect(),
            unit_rows: units().map(|(_, row)| row).collect(),
            reserved_at: finals().map(|(_, m)| system_time(m.reserved_at_ms)).collect(),
            expires_at: finals().map(|(_, m)| system_time(m.reservation_expires_at_ms)).collect(),
            row_activity_ids: plan.row_units.iter().map(|((a, _), _)| *a).collect(),
            row_sku_ids: plan.row_units.iter().map(|((_, s), _)| *s).collect(),
            row_units: plan.row_units.iter().map(|(_, units)| *units).collect(),
        }
    }

    fn args(&self) -> [&(dyn ToSql + Sync); 19] {
        [
            &self.consumer_group,
            &self.contended_ids,
            &self.reservation_ids,
            &self.request_ids,
            &self.message_ids,
            &self.activity_ids,
            &self.sku_ids,
            &self.user_ids,
            &self.statuses,
            &self.order_ids,
            &self.quantities,
            &self.first_token_ids,
            &self.unit_token_ids,
            &self.unit_rows,
            &self.reserved_at,
            &self.expires_at,
            &self.row_activity_ids,
            &self.row_sku_ids,
            &self.row_units,
        ]
    }
}

/// The facts row (`ORDER_FACTS_SQL`'s columns, in order), checked for shape.
fn decode_facts(row: &Row, batch_len: usize) -> Result<Facts, PgError> {
    let bad = |what: &'static str| PgError::InvalidArgument(what);
    let recorded_ids: Vec<String> = row.try_get(1)?;
    let recorded_statuses: Vec<String> = row.try_get(2)?;
    let recorded_orders: Vec<Option<String>> = row.try_get(3)?;
    if recorded_statuses.len() != recorded_ids.len() || recorded_orders.len() != recorded_ids.len()
    {
        return Err(bad("facts: recorded arrays differ in length"));
    }
    let recorded = recorded_ids
        .into_iter()
        .zip(recorded_statuses)
        .zip(recorded_orders)
        .map(|((reservation_id, status), order_id)| RecordedRow {
            reservation_id,
            status,
            order_id,
        })
        .collect();
    let ordered_positions = positions(row.try_get(4)?, batch_len)
        .ok_or(bad("facts: a buyer position outside the batch"))?;
    Ok(Facts {
        inserted_ids: row.try_get(0)?,
        recorded,
        ordered_positions,
        requested_positions: positions(row.try_get(14)?, batch_len)
            .ok_or(bad("facts: a request position outside the batch"))?,
        skus: decode_skus(row)?,
    })
}

fn decode_skus(row: &Row) -> Result<Vec<SkuFacts>, PgError> {
    let activity_ids: Vec<i64> = row.try_get(5)?;
    let sku_ids: Vec<i64> = row.try_get(6)?;
    let statuses: Vec<Option<String>> = row.try_get(7)?;
    let allocators: Vec<Option<String>> = row.try_get(8)?;
    let available: Vec<Option<i64>> = row.try_get(9)?;
    let contended: Vec<bool> = row.try_get(10)?;
    let claim_us: Vec<Option<i64>> = row.try_get(11)?;
    let token_skus: Vec<i32> = row.try_get(12)?;
    let token_ids: Vec<String> = row.try_get(13)?;
    let n = activity_ids.len();
    let lengths =
        [sku_ids.len(), statuses.len(), allocators.len(), available.len(), contended.len()];
    if lengths.iter().any(|&l| l != n) || claim_us.len() != n || token_skus.len() != token_ids.len()
    {
        return Err(PgError::InvalidArgument("facts: SKU arrays differ in length"));
    }
    let mut tokens: Vec<Vec<String>> = vec![Vec::new(); n];
    for (sku, token) in token_skus.into_iter().zip(token_ids) {
        let index = usize::try_from(sku).ok().and_then(|i| i.checked_sub(1)).filter(|&i| i < n);
        let index = index.ok_or(PgError::InvalidArgument("facts: a token of no SKU"))?;
        tokens[index].push(token);
    }
    Ok((0..n)
        .zip(tokens)
        .map(|(i, tokens)| SkuFacts {
            key: (activity_ids[i], sku_ids[i]),
            claim: SkuClaim::from_facts(
                statuses[i].as_deref(),
                allocators[i].as_deref(),
                available[i],
                tokens,
                contended[i],
            ),
            claim_us: claim_us[i],
        })
        .collect())
}
