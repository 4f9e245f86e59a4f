//! An activity's creation (admin API `POST /admin/v1/activities`, CONTRACT.md 4): its row, its
//! first SKU and that SKU's stock in one idempotent transaction, then `PENDING` → `ACTIVE` once
//! the edge has preheated Redis.
//!
//! What it is: [`ActivitySpec`] (the validated body, with the config hash that decides "same
//! body"), [`create_activity`] and [`mark_activity_active`]. It returns rows and typed outcomes
//! ([`CreateActivity`]); which HTTP state each becomes is the engine's decision.
//!
//! What it is not: the SKU's own row and stock (`sku.rs::insert_sku`), an activity's changes
//! after its creation (`lifecycle.rs`), or Redis.
//!
//! Read next: `sku.rs`, `lifecycle.rs`, `migrations/0001_init.sql` (`activity`).

use tokio_postgres::Client;

use crate::error::PgError;
use crate::sku::{insert_sku, with_optional_fields, Allocator, SkuSpec};

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
    /// Units one buyer may take in his one order of the SKU (1 when the body names none).
    pub max_per_buyer: i32,
}

impl ActivitySpec {
    /// The canonical text whose equality decides "same body" for idempotency (a body without
    /// a price, or with the default limit per buyer, hashes as before those existed).
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
        with_optional_fields(base, self.price_cents, self.max_per_buyer)
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
             VALUES ($1, 'PENDING', \
                     to_timestamp($2::int8 / 1000) + ($2::int8 % 1000) * interval '1 millisecond', \
                     to_timestamp($3::int8 / 1000) + ($3::int8 % 1000) * interval '1 millisecond', \
                     1, $4, $5, $6) \
             ON CONFLICT (activity_id) DO NOTHING RETURNING activity_id",
            &[
                &spec.activity_id,
                // Whole seconds plus the milliseconds, both exact: `to_timestamp(ms / 1000.0)`
                // rounds through a float, and the last millisecond of year 9999 (the edge's
                // bound) came out 8 µs past the column's CHECK.
                &spec.start_at_ms,
                &spec.end_at_ms,
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
    let sku = SkuSpec {
        activity_id: spec.activity_id,
        sku_id: spec.sku_id,
        stock: spec.stock,
        allocator: spec.allocator,
        price_cents: spec.price_cents,
        max_per_buyer: spec.max_per_buyer,
    };
    insert_sku(&tx, &sku).await?;
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
