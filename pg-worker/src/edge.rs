//! The SQL the edge needs from PostgreSQL: creating an activity (admin API) and the query
//! fallback when Redis does not know a request (CONTRACT.md 3.3 and 4).
//!
//! What it is not: the order pipeline (`order_writer`), or any decision about HTTP states —
//! it returns rows and typed outcomes; `engine` maps them.

use tokio_postgres::Client;

use crate::error::PgError;

/// Which allocator the order-writer uses for a SKU (CONTRACT.md 7, `sku_inventory.allocator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocator {
    Token,
    Row,
}

impl Allocator {
    pub fn as_str(self) -> &'static str {
        match self {
            Allocator::Token => "TOKEN",
            Allocator::Row => "ROW",
        }
    }

    pub fn parse(text: &str) -> Option<Allocator> {
        match text {
            "TOKEN" => Some(Allocator::Token),
            "ROW" => Some(Allocator::Row),
            _ => None,
        }
    }
}

/// A validated `POST /admin/v1/activities` body, every default already applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivitySpec {
    pub activity_id: i64,
    pub sku_id: i64,
    pub stock: i64,
    pub start_at_ms: i64,
    pub end_at_ms: i64,
    pub reservation_ttl_ms: i64,
    pub pay_timeout_ms: i64,
    pub allocator: Allocator,
    /// The SKU's unit price; `None`: created without one (orders then carry no amount).
    pub price_cents: Option<i64>,
}

impl ActivitySpec {
    /// The canonical text whose equality decides "same body" for idempotency (a body without
    /// a price hashes as before prices existed).
    pub fn config_hash(&self) -> String {
        let base = format!(
            "v1|{}|{}|{}|{}|{}|{}|{}|{}",
            self.activity_id,
            self.sku_id,
            self.stock,
            self.start_at_ms,
            self.end_at_ms,
            self.reservation_ttl_ms,
            self.pay_timeout_ms,
            self.allocator.as_str()
        );
        match self.price_cents {
            None => base,
            Some(price) => format!("{base}|price={price}"),
        }
    }
}

/// What [`create_activity`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateActivity {
    /// Rows and tokens created now (status PENDING until the edge preheated Redis).
    Created,
    /// The same body was applied before; `status` is its current status.
    Existing { status: String },
    /// The id exists with a different body.
    Conflict,
}

/// Creates the activity, its SKU row and `stock` tokens in one transaction (idempotent for the
/// same spec). The activity stays `PENDING` until [`mark_activity_active`], which the edge calls
/// only after Redis was preheated, so that no buyer ever sees an active activity without stock.
pub async fn create_activity(
    client: &mut Client,
    spec: &ActivitySpec,
) -> Result<CreateActivity, PgError> {
    let hash = spec.config_hash();
    let tx = client.transaction().await?;
    let inserted = tx
        .query_opt(
            "INSERT INTO activity (activity_id, status, start_at, end_at, version, \
                                   reservation_ttl_ms, pay_timeout_ms, config_hash) \
             VALUES ($1, 'PENDING', to_timestamp($2::float8 / 1000), to_timestamp($3::float8 / 1000), \
                     1, $4, $5, $6) \
             ON CONFLICT (activity_id) DO NOTHING RETURNING activity_id",
            &[
                &spec.activity_id,
                &(spec.start_at_ms as f64),
                &(spec.end_at_ms as f64),
                &spec.reservation_ttl_ms,
                &spec.pay_timeout_ms,
                &hash,
            ],
        )
        .await?;
    if inserted.is_none() {
        let row = tx
            .query_one(
                "SELECT config_hash, status FROM activity WHERE activity_id = $1",
                &[&spec.activity_id],
            )
            .await?;
        let existing_hash: Option<String> = row.get(0);
        let status: String = row.get(1);
        tx.rollback().await?;
        return Ok(if existing_hash.as_deref() == Some(hash.as_str()) {
            CreateActivity::Existing { status }
        } else {
            CreateActivity::Conflict
        });
    }
    let sku = crate::lifecycle::SkuSpec {
        activity_id: spec.activity_id,
        sku_id: spec.sku_id,
        stock: spec.stock,
        allocator: spec.allocator,
        price_cents: spec.price_cents,
    };
    crate::lifecycle::insert_sku(&tx, &sku).await?;
    tx.commit().await?;
    Ok(CreateActivity::Created)
}

/// `PENDING` → `ACTIVE` after the preheat; a no-op for any other status.
pub async fn mark_activity_active(client: &Client, activity_id: i64) -> Result<(), PgError> {
    client
        .execute(
            "UPDATE activity SET status = 'ACTIVE', updated_at = now() \
             WHERE activity_id = $1 AND status = 'PENDING'",
            &[&activity_id],
        )
        .await?;
    Ok(())
}

/// The configuration of one SKU as the admin API reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkuConfig {
    pub status: String,
    pub version: i64,
    pub total_stock: i64,
    pub allocator: String,
    pub start_at_ms: i64,
    pub end_at_ms: i64,
    pub reservation_ttl_ms: i64,
    pub pay_timeout_ms: i64,
    pub orders_created: i64,
}

pub async fn sku_config(
    client: &Client,
    activity_id: i64,
    sku_id: i64,
) -> Result<Option<SkuConfig>, PgError> {
    let row = client
        .query_opt(
            "SELECT a.status, a.version, s.total_stock, s.allocator, \
                    (extract(epoch FROM a.start_at) * 1000)::int8, \
                    (extract(epoch FROM a.end_at) * 1000)::int8, \
                    a.reservation_ttl_ms, a.pay_timeout_ms, \
                    (SELECT count(*) FROM orders o WHERE o.activity_id = s.activity_id AND o.sku_id = s.sku_id) \
             FROM sku_inventory s JOIN activity a ON a.activity_id = s.activity_id \
             WHERE s.activity_id = $1 AND s.sku_id = $2",
            &[&activity_id, &sku_id],
        )
        .await?;
    Ok(row.map(|row| SkuConfig {
        status: row.get(0),
        version: row.get(1),
        total_stock: row.get(2),
        allocator: row.get(3),
        start_at_ms: row.get(4),
        end_at_ms: row.get(5),
        reservation_ttl_ms: row.get(6),
        pay_timeout_ms: row.get(7),
        orders_created: row.get(8),
    }))
}

/// A reservation as PostgreSQL recorded it (the query fallback).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationRecord {
    pub reservation_id: String,
    /// `inventory_reservation.status` (PROCESSING, ORDER_CREATED, REJECTED_…).
    pub status: String,
    pub order_id: Option<String>,
}

/// The reservation of `request_id` for this user and SKU, if the order-writer has seen it.
/// Scoped by user: a user can only ever find their own requests.
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
             ORDER BY reserved_at LIMIT 1",
            &[&activity_id, &sku_id, &user_id, &request_id],
        )
        .await?;
    Ok(row.map(|row| ReservationRecord {
        reservation_id: row.get(0),
        status: row.get(1),
        order_id: row.get(2),
    }))
}

/// Units PostgreSQL can still sell for a SKU: AVAILABLE tokens (TOKEN allocator) or the
/// counter (ROW), minus reservations being processed right now. This is the truth a Redis
/// stock lost in a failover is rebuilt from — never the activity's initial stock, which would
/// sell again what PostgreSQL already sold. `None`: the SKU is unknown.
pub async fn sellable_units(
    client: &Client,
    activity_id: i64,
    sku_id: i64,
) -> Result<Option<i64>, PgError> {
    let row = client
        .query_opt(
            "SELECT CASE s.allocator \
                      WHEN 'ROW' THEN coalesce(s.available_stock, 0) \
                      ELSE (SELECT count(*) FROM inventory_token t \
                            WHERE t.activity_id = s.activity_id AND t.sku_id = s.sku_id \
                              AND t.status = 'AVAILABLE') END \
                    - (SELECT count(*) FROM inventory_reservation r \
                       WHERE r.activity_id = s.activity_id AND r.sku_id = s.sku_id \
                         AND r.status = 'PROCESSING') \
             FROM sku_inventory s WHERE s.activity_id = $1 AND s.sku_id = $2",
            &[&activity_id, &sku_id],
        )
        .await?;
    Ok(row.map(|row| row.get::<_, i64>(0).max(0)))
}
