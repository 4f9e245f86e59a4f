//! A SKU as PostgreSQL keeps it (`sku_inventory`, CONTRACT.md 7): the definition a SKU is
//! created from, THE insert of a new SKU, and the two reads of one SKU the edge makes.
//!
//! What it is: [`Allocator`] and [`SkuSpec`] (with its config hash, the "same body" of an
//! idempotent create); [`insert_sku`], the row and its stock (tokens, or the ROW counter),
//! shared by an activity's creation (`activity_creation.rs`) and a SKU added later
//! (`lifecycle.rs::add_sku`); [`sku_config`], the SKU as the admin API reports it; and
//! [`sellable_units`], the units a Redis stock lost in a failover is rebuilt from.
//!
//! What it is not: a transaction of its own (`insert_sku` runs inside the caller's), the
//! activity's rows or its changes (`activity_creation.rs`, `lifecycle.rs`), or the order
//! pipeline's claims (`plan.rs`, `tokens.rs`).
//!
//! Read next: `activity_creation.rs`, `lifecycle.rs`, `tokens.rs`.

use tokio_postgres::{Client, GenericClient};

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

/// A validated `POST /admin/v1/activities/{a}/skus` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkuSpec {
    pub activity_id: i64,
    pub sku_id: i64,
    pub stock: i64,
    pub allocator: Allocator,
    /// The unit price (`sku_inventory.price_cents`); an order's amount comes from it.
    pub price_cents: Option<i64>,
    /// Units one buyer may take in his one order (`sku_inventory.max_per_buyer`, 1..=
    /// `QUANTITY_MAX`; 1 when the body names none).
    pub max_per_buyer: i32,
}

impl SkuSpec {
    /// The canonical text whose equality decides "same body" (also written by
    /// `activity_creation::create_activity` for the activity's first SKU).
    pub fn config_hash(&self) -> String {
        let base = format!("sku-v1|{}|{}|{}", self.sku_id, self.stock, self.allocator.as_str());
        with_optional_fields(base, self.price_cents, self.max_per_buyer)
    }
}

/// A body's optional fields after its base text: a SKU without a price, or with the default
/// limit of one unit per buyer, hashes as before those fields existed, so bodies sent before
/// then are still "the same body".
pub fn with_optional_fields(base: String, price_cents: Option<i64>, max_per_buyer: i32) -> String {
    let base = match price_cents {
        None => base,
        Some(price) => format!("{base}|price={price}"),
    };
    match max_per_buyer {
        1 => base,
        max => format!("{base}|max_per_buyer={max}"),
    }
}

/// THE insert of a new SKU: its row (with its config hash) and its stock (tokens, or the ROW
/// counter); for `lifecycle::add_sku` and `activity_creation::create_activity` alike.
pub async fn insert_sku(client: &impl GenericClient, spec: &SkuSpec) -> Result<(), PgError> {
    let available: Option<i64> = (spec.allocator == Allocator::Row).then_some(spec.stock);
    client
        .execute(
            "INSERT INTO sku_inventory (activity_id, sku_id, total_stock, allocator, \
                                        available_stock, config_hash, price_cents, max_per_buyer) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[
                &spec.activity_id,
                &spec.sku_id,
                &spec.stock,
                &spec.allocator.as_str(),
                &available,
                &spec.config_hash(),
                &spec.price_cents,
                &spec.max_per_buyer,
            ],
        )
        .await?;
    if spec.allocator == Allocator::Token {
        crate::tokens::generate_tokens(client, spec.activity_id, spec.sku_id, spec.stock).await?;
    }
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
    /// Units one buyer may take in his one order.
    pub max_per_buyer: i32,
}

/// The SKU's row and its activity's as the admin API reports them; `None`: unknown.
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
                    (SELECT count(*) FROM orders o WHERE o.activity_id = s.activity_id AND o.sku_id = s.sku_id), \
                    s.max_per_buyer \
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
        max_per_buyer: row.get(9),
    }))
}

/// Units PostgreSQL can still sell for a SKU: AVAILABLE tokens (TOKEN allocator) or the
/// counter (ROW), minus the units of reservations being processed right now. This is the truth a Redis
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
                    - (SELECT coalesce(sum(r.quantity), 0) FROM inventory_reservation r \
                       WHERE r.activity_id = s.activity_id AND r.sku_id = s.sku_id \
                         AND r.status = 'PROCESSING') \
             FROM sku_inventory s WHERE s.activity_id = $1 AND s.sku_id = $2",
            &[&activity_id, &sku_id],
        )
        .await?;
    Ok(row.map(|row| row.get::<_, i64>(0).max(0)))
}
