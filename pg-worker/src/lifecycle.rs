//! An activity's life after its creation (CONTRACT.md section 4, migration 0006): a SKU added
//! to an existing activity, an activity or one SKU ended or terminated, stock topped up, the
//! release policy set.
//!
//! Each call is one transaction that locks the row it changes, bumps its version, records the
//! change with who made it in `activity_change`, and returns what Redis must show afterwards
//! ([`SkuSnapshot`]: the SKU's effective status and `meta` version; a top-up's units). The
//! edge writes Redis only after the commit, with calls that are idempotent by version
//! (`preheat`, `top_up` in `lua/seckill.lua`), so a retry after a crash between the two steps
//! completes the change, and every call here is idempotent too: the same change again is
//! `Already`, with the snapshot to re-apply.
//!
//! Effective status of a SKU (what Redis `meta.status` says): TERMINATED when the activity or
//! the SKU is, else ENDED when either is, else ACTIVE (a PENDING activity is preheated active:
//! its window decides). Only TERMINATED reaches the order-writer (migration 0006): reservations
//! still in flight are rejected and compensated; an ENDED SKU's reservations still become
//! orders. Allowed moves: ACTIVE/PENDING → ENDED → TERMINATED, or straight to TERMINATED; a
//! TERMINATED one never moves again.
//!
//! What it is not: the Redis writes or the HTTP answers (`engine/src/shard/admin/lifecycle.rs`).

use serde_json::json;
use tokio_postgres::{Client, GenericClient};

use crate::error::PgError;
use crate::sku::{insert_sku, Allocator, SkuSpec};
use crate::tokens::TOKENS_PER_SKU_MAX;

/// Longest `actor` recorded (the table's check).
pub const ACTOR_LEN_MAX: usize = 128;

/// What Redis `meta` of one SKU must say after a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkuSnapshot {
    pub activity_id: i64,
    pub sku_id: i64,
    /// `ACTIVE`, `ENDED` or `TERMINATED` (see the module documentation).
    pub status: String,
    pub start_at_ms: i64,
    pub end_at_ms: i64,
    pub reservation_ttl_ms: i64,
    /// `activity.version + sku_inventory.version - 1`: grows with every change of either.
    pub meta_version: i64,
    pub total_stock: i64,
    pub release_policy: String,
    /// Units one buyer may take in his one order (`sku_inventory.max_per_buyer`).
    pub max_per_buyer: i32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Applied now.
    Applied(Vec<SkuSnapshot>),
    /// The same change was applied before: nothing written; the snapshots to re-apply.
    Already(Vec<SkuSnapshot>),
    /// No such activity (or SKU).
    NotFound,
    /// Not allowed from the current status (`current`), e.g. a TERMINATED activity ended, a
    /// SKU added to an ended activity, or another body for an existing SKU (`CONFLICT`).
    Refused { current: String },
}

/// `end` or `terminate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closing {
    End,
    Terminate,
}

impl Closing {
    fn status(self) -> &'static str {
        match self {
            Closing::End => "ENDED",
            Closing::Terminate => "TERMINATED",
        }
    }

    fn action(self) -> &'static str {
        match self {
            Closing::End => "end",
            Closing::Terminate => "terminate",
        }
    }
}

fn check_actor(actor: &str) -> Result<(), PgError> {
    if actor.is_empty() || actor.len() > ACTOR_LEN_MAX {
        return Err(PgError::InvalidArgument("actor must be 1..=128 bytes"));
    }
    Ok(())
}

const SNAPSHOT_SQL: &str = "\
    SELECT s.activity_id, s.sku_id, \
           CASE WHEN a.status = 'TERMINATED' OR s.status = 'TERMINATED' THEN 'TERMINATED' \
                WHEN a.status = 'ENDED' OR s.status = 'ENDED' THEN 'ENDED' \
                ELSE 'ACTIVE' END, \
           (extract(epoch FROM a.start_at) * 1000)::int8, \
           (extract(epoch FROM a.end_at) * 1000)::int8, \
           a.reservation_ttl_ms, a.version + s.version - 1, s.total_stock, a.release_policy, \
           s.max_per_buyer \
    FROM sku_inventory s JOIN activity a ON a.activity_id = s.activity_id \
    WHERE s.activity_id = $1 AND ($2::int8 IS NULL OR s.sku_id = $2) \
    ORDER BY s.sku_id";

/// The snapshots of one SKU (`sku_id`) or of every SKU of the activity (`None`).
pub async fn snapshots(
    client: &impl GenericClient,
    activity_id: i64,
    sku_id: Option<i64>,
) -> Result<Vec<SkuSnapshot>, PgError> {
    let rows = client.query(SNAPSHOT_SQL, &[&activity_id, &sku_id]).await?;
    Ok(rows
        .iter()
        .map(|row| SkuSnapshot {
            activity_id: row.get(0),
            sku_id: row.get(1),
            status: row.get(2),
            start_at_ms: row.get(3),
            end_at_ms: row.get(4),
            reservation_ttl_ms: row.get(5),
            meta_version: row.get(6),
            total_stock: row.get(7),
            release_policy: row.get(8),
            max_per_buyer: row.get(9),
        })
        .collect())
}

/// One `activity_change` row.
struct ChangeRow<'a> {
    activity_id: i64,
    sku_id: Option<i64>,
    action: &'a str,
    detail: serde_json::Value,
    version: i64,
    request_id: Option<&'a str>,
}

async fn record(
    client: &impl GenericClient,
    row: ChangeRow<'_>,
    actor: &str,
) -> Result<(), PgError> {
    client
        .execute(
            "INSERT INTO activity_change (activity_id, sku_id, action, detail, version, actor, \
                                          request_id) \
             VALUES ($1, $2, $3, $4::text::jsonb, $5, $6, $7)",
            &[
                &row.activity_id,
                &row.sku_id,
                &row.action,
                &row.detail.to_string(),
                &row.version,
                &actor,
                &row.request_id,
            ],
        )
        .await?;
    Ok(())
}

/// Locks the activity row: every change of an activity or of one of its SKUs takes it first,
/// so changes of one activity are serialized and each reads the versions the previous one
/// committed (two concurrent changes can never hand Redis the same `meta_version` for
/// different states). `None`: no such activity.
async fn lock_activity(
    client: &impl GenericClient,
    activity_id: i64,
) -> Result<Option<tokio_postgres::Row>, PgError> {
    Ok(client
        .query_opt(
            "SELECT status, release_policy FROM activity WHERE activity_id = $1 FOR UPDATE",
            &[&activity_id],
        )
        .await?)
}

/// Adds a SKU with `stock` units to an existing, not yet ended activity.
pub async fn add_sku(client: &mut Client, spec: &SkuSpec, actor: &str) -> Result<Change, PgError> {
    check_actor(actor)?;
    if !(0..=TOKENS_PER_SKU_MAX).contains(&spec.stock) {
        return Err(PgError::InvalidArgument("stock must be within 0..=TOKENS_PER_SKU_MAX"));
    }
    let tx = client.transaction().await?;
    let Some(activity) = lock_activity(&tx, spec.activity_id).await? else {
        return Ok(Change::NotFound);
    };
    let hash = spec.config_hash();
    let existing = tx
        .query_opt(
            "SELECT config_hash, total_stock, allocator FROM sku_inventory \
             WHERE activity_id = $1 AND sku_id = $2",
            &[&spec.activity_id, &spec.sku_id],
        )
        .await?;
    if let Some(row) = existing {
        let recorded: Option<String> = row.get(0);
        // A SKU made before migration 0006 has no hash: its stock and allocator decide.
        let same = match recorded {
            Some(recorded) => recorded == hash,
            None => {
                let (total, allocator): (i64, String) = (row.get(1), row.get(2));
                total == spec.stock && allocator == spec.allocator.as_str()
            }
        };
        if !same {
            return Ok(Change::Refused { current: "CONFLICT".into() });
        }
        let found = snapshots(&tx, spec.activity_id, Some(spec.sku_id)).await?;
        tx.commit().await?;
        return Ok(Change::Already(found));
    }
    let status: String = activity.get(0);
    if status == "ENDED" || status == "TERMINATED" {
        return Ok(Change::Refused { current: status });
    }
    insert_sku(&tx, spec).await?;
    let detail = json!({"stock": spec.stock, "allocator": spec.allocator.as_str()});
    let row = ChangeRow {
        activity_id: spec.activity_id,
        sku_id: Some(spec.sku_id),
        action: "add_sku",
        detail,
        version: 1,
        request_id: None,
    };
    record(&tx, row, actor).await?;
    let created = snapshots(&tx, spec.activity_id, Some(spec.sku_id)).await?;
    tx.commit().await?;
    Ok(Change::Applied(created))
}

/// Ends or terminates an activity (`sku_id` None: every SKU of it) or one SKU.
pub async fn close(
    client: &mut Client,
    activity_id: i64,
    sku_id: Option<i64>,
    closing: Closing,
    actor: &str,
) -> Result<Change, PgError> {
    check_actor(actor)?;
    let tx = client.transaction().await?;
    let Some(activity) = lock_activity(&tx, activity_id).await? else {
        return Ok(Change::NotFound);
    };
    let current = match sku_id {
        None => Some(activity),
        Some(sku_id) => {
            tx.query_opt(
                "SELECT status FROM sku_inventory WHERE activity_id = $1 AND sku_id = $2 \
                 FOR UPDATE",
                &[&activity_id, &sku_id],
            )
            .await?
        }
    };
    let Some(current) = current else { return Ok(Change::NotFound) };
    let current: String = current.get(0);
    let target = closing.status();
    if current == target {
        let found = snapshots(&tx, activity_id, sku_id).await?;
        tx.commit().await?;
        return Ok(Change::Already(found));
    }
    if current == "TERMINATED" {
        return Ok(Change::Refused { current });
    }
    let version: i64 = match sku_id {
        None => tx
            .query_one(
                "UPDATE activity SET status = $2, version = version + 1, updated_at = now() \
                 WHERE activity_id = $1 RETURNING version",
                &[&activity_id, &target],
            )
            .await?
            .get(0),
        Some(sku_id) => tx
            .query_one(
                "UPDATE sku_inventory SET status = $3, version = version + 1, updated_at = now() \
                 WHERE activity_id = $1 AND sku_id = $2 RETURNING version",
                &[&activity_id, &sku_id, &target],
            )
            .await?
            .get(0),
    };
    let detail = json!({"from": current, "to": target});
    let row = ChangeRow {
        activity_id,
        sku_id,
        action: closing.action(),
        detail,
        version,
        request_id: None,
    };
    record(&tx, row, actor).await?;
    let changed = snapshots(&tx, activity_id, sku_id).await?;
    tx.commit().await?;
    Ok(Change::Applied(changed))
}

/// What a top-up created, for the Redis step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopUp {
    /// The SKU's version after the top-up: the Redis step's idempotency key.
    pub version: i64,
    pub add: i64,
    pub snapshot: SkuSnapshot,
}

/// Adds `add` units to a live SKU: tokens `total + 1 ..= total + add` (TOKEN) or the counter
/// (ROW), `total_stock` raised with them. With a `request_id`, the same id again is the same
/// top-up (`Already`, nothing written), another `add` under it is refused.
pub async fn top_up(
    client: &mut Client,
    activity_id: i64,
    sku_id: i64,
    add: i64,
    request_id: Option<&str>,
    actor: &str,
) -> Result<Result<TopUp, Change>, PgError> {
    check_actor(actor)?;
    if add < 1 {
        return Err(PgError::InvalidArgument("a top-up adds at least one unit"));
    }
    let tx = client.transaction().await?;
    if lock_activity(&tx, activity_id).await?.is_none() {
        return Ok(Err(Change::NotFound));
    }
    let Some(row) = lock_sku_for_top_up(&tx, activity_id, sku_id).await? else {
        return Ok(Err(Change::NotFound));
    };
    if let Some(request_id) = request_id {
        if let Some((version, recorded_add)) =
            earlier_top_up(&tx, activity_id, sku_id, request_id).await?
        {
            if recorded_add != add {
                return Ok(Err(Change::Refused { current: "CONFLICT".into() }));
            }
            let mut found = snapshots(&tx, activity_id, Some(sku_id)).await?;
            tx.commit().await?;
            let snapshot = found.pop().ok_or(PgError::InvalidArgument("the SKU vanished"))?;
            return Ok(Ok(TopUp { version, add, snapshot }));
        }
    }
    let (allocator, total, status): (String, i64, String) = (row.get(0), row.get(1), row.get(2));
    if status != "ACTIVE" {
        return Ok(Err(Change::Refused { current: status }));
    }
    if total.saturating_add(add) > TOKENS_PER_SKU_MAX {
        return Err(PgError::InvalidArgument("stock would exceed TOKENS_PER_SKU_MAX"));
    }
    let version = add_units(&tx, activity_id, sku_id, &allocator, total, add).await?;
    let detail = json!({"add": add, "total_stock": total + add});
    let row = ChangeRow {
        activity_id,
        sku_id: Some(sku_id),
        action: "top_up",
        detail,
        version,
        request_id,
    };
    record(&tx, row, actor).await?;
    let mut found = snapshots(&tx, activity_id, Some(sku_id)).await?;
    tx.commit().await?;
    let snapshot = found.pop().ok_or(PgError::InvalidArgument("the SKU vanished"))?;
    Ok(Ok(TopUp { version, add, snapshot }))
}

/// The SKU's allocator, total stock and effective status, its row locked for the top-up.
/// `None`: no such SKU.
async fn lock_sku_for_top_up(
    client: &impl GenericClient,
    activity_id: i64,
    sku_id: i64,
) -> Result<Option<tokio_postgres::Row>, PgError> {
    Ok(client
        .query_opt(
            "SELECT s.allocator, s.total_stock, \
                    CASE WHEN a.status = 'TERMINATED' OR s.status = 'TERMINATED' THEN 'TERMINATED' \
                         WHEN a.status = 'ENDED' OR s.status = 'ENDED' THEN 'ENDED' \
                         ELSE 'ACTIVE' END \
             FROM sku_inventory s JOIN activity a ON a.activity_id = s.activity_id \
             WHERE s.activity_id = $1 AND s.sku_id = $2 FOR UPDATE OF s",
            &[&activity_id, &sku_id],
        )
        .await?)
}

/// The top-up recorded under `request_id` for this SKU, as (the SKU's version it made, the
/// units it added).
async fn earlier_top_up(
    client: &impl GenericClient,
    activity_id: i64,
    sku_id: i64,
    request_id: &str,
) -> Result<Option<(i64, i64)>, PgError> {
    let done = client
        .query_opt(
            "SELECT version, (detail->>'add')::int8 FROM activity_change \
             WHERE activity_id = $1 AND sku_id = $2 AND request_id = $3",
            &[&activity_id, &sku_id, &request_id],
        )
        .await?;
    Ok(done.map(|done| (done.get(0), done.get(1))))
}

/// The new units: tokens `total + 1 ..= total + add` (TOKEN), and `total_stock` and
/// `available_stock` raised by `add`; returns the SKU's new version.
async fn add_units(
    client: &impl GenericClient,
    activity_id: i64,
    sku_id: i64,
    allocator: &str,
    total: i64,
    add: i64,
) -> Result<i64, PgError> {
    if allocator == Allocator::Token.as_str() {
        client
            .execute(
                crate::tokens::GENERATE_MORE_TOKENS_SQL,
                &[&activity_id, &sku_id, &total, &add],
            )
            .await?;
    }
    let version: i64 = client
        .query_one(
            "UPDATE sku_inventory SET total_stock = total_stock + $3, \
                    available_stock = available_stock + $3, version = version + 1, \
                    updated_at = now() \
             WHERE activity_id = $1 AND sku_id = $2 RETURNING version",
            &[&activity_id, &sku_id, &add],
        )
        .await?
        .get(0);
    Ok(version)
}

/// Sets what a cancelled or closed order's unit becomes (`BACK_TO_SALE` or `RELEASED`).
pub async fn set_release_policy(
    client: &mut Client,
    activity_id: i64,
    policy: &str,
    actor: &str,
) -> Result<Change, PgError> {
    check_actor(actor)?;
    if policy != "BACK_TO_SALE" && policy != "RELEASED" {
        return Err(PgError::InvalidArgument("release policy must be BACK_TO_SALE or RELEASED"));
    }
    let tx = client.transaction().await?;
    let Some(activity) = lock_activity(&tx, activity_id).await? else {
        return Ok(Change::NotFound);
    };
    let current: String = activity.get(1);
    if current == policy {
        let found = snapshots(&tx, activity_id, None).await?;
        tx.commit().await?;
        return Ok(Change::Already(found));
    }
    let version: i64 = tx
        .query_one(
            "UPDATE activity SET release_policy = $2, version = version + 1, updated_at = now() \
             WHERE activity_id = $1 RETURNING version",
            &[&activity_id, &policy],
        )
        .await?
        .get(0);
    let detail = json!({"from": current, "to": policy});
    let row = ChangeRow {
        activity_id,
        sku_id: None,
        action: "release_policy",
        detail,
        version,
        request_id: None,
    };
    record(&tx, row, actor).await?;
    let changed = snapshots(&tx, activity_id, None).await?;
    tx.commit().await?;
    Ok(Change::Applied(changed))
}
