//! What a SKU Redis lost is rebuilt from (DESIGN.md section 11, the engine's
//! `shard/failover.rs`): PostgreSQL's record of every reservation of the SKU it has seen, and
//! every event it announced about them (`event_outbox`, kept after publishing), oldest first.
//! Replayed onto the SKU's total stock through the library's own functions, they give back the
//! Redis the sale would have left: user markers, request records (a same-id retry finds its
//! reservation or order), compensation markers, and the stock.
//!
//! Also here: [`active_skus`], the SKUs on sale (their activity `ACTIVE`: activated only after
//! Redis was preheated), which the engine checks for a `meta` Redis lost.
//!
//! What it is not: the replay (the engine's `logic::rebuild` plans it, `shard/failover.rs`
//! runs it), or the SKU's configuration (`sku::sku_config`).
//!
//! Read next: `lua/seckill.lua::restore`, `engine/src/logic/rebuild.rs`.

use tokio_postgres::Client;

use crate::error::PgError;

/// One `inventory_reservation` row, as the rebuild replays it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuiltReservation {
    pub reservation_id: String,
    pub request_id: String,
    pub message_id: String,
    pub user_id: u64,
    /// Its units.
    pub quantity: u32,
    pub reserved_at_ms: u64,
    pub expires_at_ms: u64,
    /// `PROCESSING` or a final status.
    pub status: String,
}

/// One outbox event of the SKU: when PostgreSQL committed it, and its JSON payload (a
/// `ReservationEvent`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuiltEvent {
    pub event_id: i64,
    pub created_at_ms: u64,
    pub payload: String,
}

/// Everything of one SKU a rebuild reads, in one repeatable-read snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RebuildSource {
    /// `sku_inventory.total_stock` (top-ups included): the stock the replay starts from.
    pub total_stock: u64,
    /// By `reserved_at`, then id.
    pub reservations: Vec<RebuiltReservation>,
    /// By `event_id` (commit order of the events of one reservation).
    pub events: Vec<RebuiltEvent>,
}

const TOTAL_SQL: &str =
    "SELECT total_stock FROM sku_inventory WHERE activity_id = $1 AND sku_id = $2";
const RESERVATIONS_SQL: &str = "\
SELECT reservation_id, request_id, message_id, user_id, \
       (extract(epoch FROM reserved_at) * 1000)::bigint, \
       (extract(epoch FROM expires_at) * 1000)::bigint, status, quantity \
FROM inventory_reservation WHERE activity_id = $1 AND sku_id = $2 \
ORDER BY reserved_at, reservation_id";
/// No index serves the payload's SKU: a sequential scan of the outbox, acceptable for a
/// recovery that runs once per loss (tens of thousands of rows in well under a second).
const EVENTS_SQL: &str = "\
SELECT event_id, (extract(epoch FROM created_at) * 1000)::bigint, payload::text \
FROM event_outbox \
WHERE event_type IN ('order_created', 'reservation_failed', 'compensate', 'order_cancelled') \
  AND (payload->>'activity_id')::bigint = $1 AND (payload->>'sku_id')::bigint = $2 \
ORDER BY event_id";

const ACTIVE_SKUS_SQL: &str = "\
SELECT s.activity_id, s.sku_id FROM sku_inventory s \
JOIN activity a ON a.activity_id = s.activity_id \
WHERE a.status = 'ACTIVE' ORDER BY s.activity_id, s.sku_id LIMIT $1";

const ACTIVE_AMONG_SQL: &str = "\
SELECT s.activity_id, s.sku_id FROM sku_inventory s \
JOIN activity a ON a.activity_id = s.activity_id \
JOIN unnest($1::bigint[], $2::bigint[]) AS k(activity_id, sku_id) \
  ON k.activity_id = s.activity_id AND k.sku_id = s.sku_id \
WHERE a.status = 'ACTIVE' ORDER BY s.activity_id, s.sku_id";

/// The (activity, SKU) pairs on sale, at most `limit`, in key order.
pub async fn active_skus(client: &Client, limit: i64) -> Result<Vec<(i64, i64)>, PgError> {
    let rows = client.query(ACTIVE_SKUS_SQL, &[&limit]).await?;
    Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
}

/// Those of `keys` (activity, SKU) on sale, in key order.
pub async fn active_among(
    client: &Client,
    keys: &[(i64, i64)],
) -> Result<Vec<(i64, i64)>, PgError> {
    let activity_ids: Vec<i64> = keys.iter().map(|k| k.0).collect();
    let sku_ids: Vec<i64> = keys.iter().map(|k| k.1).collect();
    let rows = client.query(ACTIVE_AMONG_SQL, &[&activity_ids, &sku_ids]).await?;
    Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
}

/// The SKU's rebuild source; `None` when PostgreSQL does not know the SKU.
pub async fn rebuild_source(
    client: &mut Client,
    activity_id: i64,
    sku_id: i64,
) -> Result<Option<RebuildSource>, PgError> {
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    let Some(total) = tx.query_opt(TOTAL_SQL, &[&activity_id, &sku_id]).await? else {
        return Ok(None);
    };
    let ms = |v: i64| u64::try_from(v).unwrap_or(0);
    let reservations = tx
        .query(RESERVATIONS_SQL, &[&activity_id, &sku_id])
        .await?
        .iter()
        .map(|row| RebuiltReservation {
            reservation_id: row.get(0),
            request_id: row.get(1),
            message_id: row.get(2),
            user_id: u64::try_from(row.get::<_, i64>(3)).unwrap_or(0),
            reserved_at_ms: ms(row.get(4)),
            expires_at_ms: ms(row.get(5)),
            status: row.get(6),
            quantity: u32::try_from(row.get::<_, i32>(7)).unwrap_or(1).max(1),
        })
        .collect();
    let events = tx
        .query(EVENTS_SQL, &[&activity_id, &sku_id])
        .await?
        .iter()
        .map(|row| RebuiltEvent {
            event_id: row.get(0),
            created_at_ms: ms(row.get(1)),
            payload: row.get(2),
        })
        .collect();
    tx.commit().await?;
    let total_stock = u64::try_from(total.get::<_, i64>(0)).unwrap_or(0);
    Ok(Some(RebuildSource { total_stock, reservations, events }))
}
