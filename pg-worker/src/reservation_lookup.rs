//! The query fallback (CONTRACT.md 3.3): a reservation as PostgreSQL recorded it, for a request
//! Redis no longer knows.
//!
//! What it is: [`find_reservation`], scoped by (activity, SKU, user, request id) so a user can
//! only ever find their own requests, and [`ReservationRecord`], the row as read.
//!
//! What it is not: a decision about HTTP states (the engine maps the status), or the writer of
//! the rows it reads (`order_writer.rs`, `set_writer.rs`).
//!
//! Read next: `engine/src/shard/query.rs` (Redis first, then this), `migrations/0001_init.sql`
//! (`inventory_reservation`).

use tokio_postgres::Client;

use crate::error::PgError;

/// A reservation as PostgreSQL recorded it (the query fallback).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationRecord {
    pub reservation_id: String,
    /// `inventory_reservation.status` (PROCESSING, ORDER_CREATED, REJECTED_…).
    pub status: String,
    pub order_id: Option<String>,
}

/// The reservation of `request_id` for this user and SKU, if the order-writer has seen it.
/// Scoped by user: a user can only ever find their own requests. A request id names one
/// reservation (migration 0009); a second one minted after Redis lost the first is recorded
/// as `REJECTED_DUPLICATE_USER`, so the original is preferred.
pub async fn find_reservation(
    client: &Client,
    activity_id: i64,
    sku_id: i64,
    user_id: i64,
    request_id: &str,
) -> Result<Option<ReservationRecord>, PgError> {
    let row = client
        .query_opt(
            "SELECT reservation_id, status, order_id FROM inventory_reservation \
             WHERE activity_id = $1 AND sku_id = $2 AND user_id = $3 AND request_id = $4 \
             ORDER BY status = 'REJECTED_DUPLICATE_USER', reserved_at LIMIT 1",
            &[&activity_id, &sku_id, &user_id, &request_id],
        )
        .await?;
    Ok(row.map(|row| ReservationRecord {
        reservation_id: row.get(0),
        status: row.get(1),
        order_id: row.get(2),
    }))
}
