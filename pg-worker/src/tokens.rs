//! Inventory tokens: generating a SKU's tokens and claiming one.
//!
//! What it is: the TOKEN allocator's two statements. Each sellable unit is one
//! `inventory_token` row with a deterministic id (`tok_<activity>_<sku>_<seq>`,
//! enforced by a CHECK), so generation is one idempotent `INSERT ... SELECT
//! generate_series ... ON CONFLICT DO NOTHING`. A claim locks one AVAILABLE
//! token with `FOR UPDATE SKIP LOCKED` and marks it CLAIMED in the same
//! statement, so concurrent workers never wait on one hot row and never take
//! the same unit (DESIGN.md section 8, invariant 1).
//!
//! What it is not: the order transaction. `claim_token` runs inside the
//! caller's transaction and commits nothing; the worker composes it with the
//! inbox, order, ledger and outbox writes (DESIGN.md section 5). The ROW
//! allocator's conditional UPDATE lives with the worker too.
//!
//! Read next: `migrations/0001_init.sql` (`inventory_token_available_idx`, the
//! partial index this claim is written for; `tests/tests/pg_schema.rs` checks
//! the plan uses it).

use tokio_postgres::Transaction;

use crate::error::PgError;

/// Most tokens one SKU may have (`io/src/bounds.rs` STOCK_MAX, the one bound the admin API
/// checks too). Generation is one statement: a million rows take a few seconds and a few
/// hundred MB of WAL, which is the most a single admin call should do. A flash sale sells
/// thousands.
pub const TOKENS_PER_SKU_MAX: i64 = flashsale_io::bounds::STOCK_MAX as i64;

/// Ensures tokens `1..=$3` of SKU (`$1`, `$2`) exist; returns how many it
/// created. Existing tokens keep their status (a re-run never resurrects a
/// sold unit). The sku_inventory row must exist (foreign key).
pub const GENERATE_TOKENS_SQL: &str = "\
    INSERT INTO inventory_token (token_id, activity_id, sku_id, seq, status, updated_at) \
    SELECT 'tok_' || $1::bigint || '_' || $2::bigint || '_' || n, $1, $2, n, 'AVAILABLE', now() \
    FROM generate_series(1::bigint, $3::bigint) AS n \
    ON CONFLICT (token_id) DO NOTHING";

/// Tokens `$3 + 1 ..= $3 + $4` of SKU (`$1`, `$2`): a top-up after `$3` existing ones.
pub const GENERATE_MORE_TOKENS_SQL: &str = "\
    INSERT INTO inventory_token (token_id, activity_id, sku_id, seq, status, updated_at) \
    SELECT 'tok_' || $1::bigint || '_' || $2::bigint || '_' || n, $1, $2, n, 'AVAILABLE', now() \
    FROM generate_series($3::bigint + 1, $3::bigint + $4::bigint) AS n \
    ON CONFLICT (token_id) DO NOTHING";

/// Claims one AVAILABLE token of SKU (`$1`, `$2`) for reservation `$3`,
/// returning its id, or no row when none is free to lock right now.
///
/// `ORDER BY seq` is load-bearing, not cosmetic: it makes the partial index
/// `inventory_token_available_idx (activity_id, sku_id, seq) WHERE status =
/// 'AVAILABLE'` the only plan that avoids a sort. Without it, right after
/// ANALYZE of a table holding one SKU ("every row matches") the planner picks a
/// heap or primary-key walk for `LIMIT 1`, which then steps over every claimed
/// token on each claim (FIELD-NOTES.md: 6x slower at 10,000 orders).
pub const CLAIM_TOKEN_SQL: &str = "\
    WITH picked AS (\
        SELECT token_id FROM inventory_token \
        WHERE activity_id = $1 AND sku_id = $2 AND status = 'AVAILABLE' \
        ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED) \
    UPDATE inventory_token t \
    SET status = 'CLAIMED', reservation_id = $3, claimed_at = now(), updated_at = now() \
    FROM picked WHERE t.token_id = picked.token_id \
    RETURNING t.token_id";

/// After an empty claim: does any AVAILABLE token remain, locked by someone
/// else? A plain read (no locks) sees rows other transactions have locked but
/// not yet committed as still AVAILABLE.
pub const ANY_TOKEN_AVAILABLE_SQL: &str = "\
    SELECT EXISTS (SELECT 1 FROM inventory_token \
                   WHERE activity_id = $1 AND sku_id = $2 AND status = 'AVAILABLE')";

/// The deterministic id of unit `seq` (1-based) of a SKU; the same text
/// `GENERATE_TOKENS_SQL` builds and `inventory_token_id_check` enforces.
pub fn token_id(activity_id: i64, sku_id: i64, seq: i64) -> String {
    format!("tok_{activity_id}_{sku_id}_{seq}")
}

/// Creates the tokens `1..=count` of a SKU that do not exist yet, in ONE
/// statement; returns how many rows it inserted. Calling it again with the
/// same `count` inserts nothing, so the SKU has exactly `count` tokens however
/// often the admin call is retried. Pass the SKU's `total_stock`.
pub async fn generate_tokens(
    client: &impl tokio_postgres::GenericClient,
    activity_id: i64,
    sku_id: i64,
    count: i64,
) -> Result<u64, PgError> {
    if !(0..=TOKENS_PER_SKU_MAX).contains(&count) {
        return Err(PgError::InvalidArgument("token count must be within 0..=TOKENS_PER_SKU_MAX"));
    }
    Ok(client.execute(GENERATE_TOKENS_SQL, &[&activity_id, &sku_id, &count]).await?)
}

/// The result of one claim attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// This transaction now holds the token (CLAIMED, locked until commit).
    Claimed { token_id: String },
    /// No free token now, but other transactions hold locked AVAILABLE ones;
    /// they may roll back. Retry shortly (bounded), then give up retryably.
    Contended,
    /// No AVAILABLE token at all: final stock is exhausted
    /// (`REJECTED_NO_FINAL_STOCK`).
    Exhausted,
}

impl ClaimOutcome {
    /// Whether trying again can give a different answer.
    pub fn is_worth_retrying(&self) -> bool {
        matches!(self, ClaimOutcome::Contended)
    }
}

/// Claims one AVAILABLE token for `reservation_id` inside `tx`. One round trip
/// when a token is free, two when none is (to tell contended from exhausted).
/// A unique violation on `inventory_token_reservation_key` means this
/// reservation already holds a token in the database: a caller bug, reported
/// as the error it is.
pub async fn claim_token(
    tx: &Transaction<'_>,
    activity_id: i64,
    sku_id: i64,
    reservation_id: &str,
) -> Result<ClaimOutcome, PgError> {
    if let Some(row) =
        tx.query_opt(CLAIM_TOKEN_SQL, &[&activity_id, &sku_id, &reservation_id]).await?
    {
        return Ok(ClaimOutcome::Claimed { token_id: row.get(0) });
    }
    let any_available: bool =
        tx.query_one(ANY_TOKEN_AVAILABLE_SQL, &[&activity_id, &sku_id]).await?.get(0);
    Ok(if any_available { ClaimOutcome::Contended } else { ClaimOutcome::Exhausted })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_id_matches_the_sql_format() {
        assert_eq!(token_id(10001, 20001, 1), "tok_10001_20001_1");
        // The SQL builds the same text from the same three parts.
        assert!(
            GENERATE_TOKENS_SQL.contains("'tok_' || $1::bigint || '_' || $2::bigint || '_' || n")
        );
    }

    #[test]
    fn only_contention_is_worth_retrying() {
        assert!(ClaimOutcome::Contended.is_worth_retrying());
        assert!(!ClaimOutcome::Exhausted.is_worth_retrying());
        assert!(!ClaimOutcome::Claimed { token_id: token_id(1, 2, 3) }.is_worth_retrying());
    }
}
