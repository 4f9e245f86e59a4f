//! The checks after a run (DESIGN.md section 8), in Redis and, when given, PostgreSQL.
//!
//! 1. Redis: every `seckill:{a:s}:resv:resv_*` record (status, user, reserved_at), the stock
//!    and the pending set. From them: no oversell as Redis sees it (stock ≥ 0, reservations
//!    holding stock ≤ the initial stock, stock + holding ≤ initial), one reservation per user,
//!    and the Redis side of "nothing lost": every reservation the generator was answered
//!    `QUEUED`/`QUEUED_PENDING` for has its record.
//! 2. With PostgreSQL: wait (bounded by `drain_timeout`) until every known reservation (the
//!    Redis records and the ones the generator saw) has a final `inventory_reservation`
//!    status (`ORDER_CREATED` or `REJECTED_*`) and none is `PROCESSING`. Then
//!    `flashsale_pg_worker::audit::check_invariants` judges I1–I3 and I7, "nothing lost" is
//!    judged per reservation (final, or younger than the recovery deadline, else lost and its
//!    id reported), and the orders are counted with the share created within 3 s of their
//!    reservation (`orders.created_at − inventory_reservation.reserved_at`).
//!
//! What it is not: a repair tool (read-only), nor the engine's reconcile report (which also
//! looks at the log); it checks one SKU.
//!
//! Read next: `report.rs`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use flashsale_io::resp::Reply;

use super::redis::{text, Redis};
use super::stats::Seen;

/// Most reservation records read from Redis (stock bounds them; this bounds a mistake).
pub const REDIS_RECORDS_MAX: usize = 5_000_000;
/// Commands per Redis pipeline.
const REDIS_BATCH: usize = 512;
/// Lost ids listed in the report (all are counted).
pub const LOST_IDS_LISTED_MAX: usize = 100;
/// How often the drain is polled.
const DRAIN_POLL_MS: u64 = 250;

/// What to check.
pub struct VerifyInput<'a> {
    pub redis: SocketAddr,
    pub pg_url: Option<&'a str>,
    pub activity_id: u64,
    pub sku_id: u64,
    pub initial_stock: Option<u64>,
    pub seen: &'a Seen,
    pub drain_timeout: Duration,
    pub recovery_deadline_ms: u64,
}

/// The invariant verdicts; `None` where the store that would know was not checked.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Invariants {
    pub no_oversell: Option<bool>,
    pub one_per_user: Option<bool>,
    /// PostgreSQL only (inventory tokens).
    pub tokens_conserved: Option<bool>,
    pub nothing_lost: Option<bool>,
    /// Every checked invariant holds (PostgreSQL's I7 included when checked).
    pub ok: Option<bool>,
    /// Which stores were checked: "redis", "postgres".
    pub checked_in: Vec<String>,
    /// PostgreSQL checked: whether every reservation reached a final status in time.
    pub drained: Option<bool>,
    pub drain_s: Option<f64>,
    /// Reservations with no final outcome and older than the recovery deadline (or with no
    /// record at all), the first [`LOST_IDS_LISTED_MAX`].
    pub lost_ids: Vec<String>,
    pub lost_count: u64,
    /// Reservations without a final outcome yet, younger than the recovery deadline.
    pub in_flight_count: u64,
    /// Every broken rule, in words.
    pub violations: Vec<String>,
    /// Why a check could not run (then the verdicts it would give are `None`).
    pub error: Option<String>,
}

/// Redis as it was after the run (and after the drain, when PostgreSQL was checked).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RedisView {
    pub stock: Option<i64>,
    pub reservations: u64,
    pub by_status: BTreeMap<String, u64>,
    /// Records still holding a unit (PENDING_MESSAGE, MESSAGE_SENT, ORDER_CREATED).
    pub holding: u64,
    /// `resv:pending` entries (reservations whose final outcome has not reached Redis).
    pub pending: u64,
    /// Reservation records the generator never saw answered (an UNKNOWN, a timeout, a lost
    /// connection): not a loss, but worth knowing.
    pub unanswered: u64,
}

/// What PostgreSQL says about the orders.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OrderView {
    pub orders_created: u64,
    pub orders_within_3s: u64,
    pub orders_within_3s_ratio: Option<f64>,
    /// Reservation → order delay, milliseconds.
    pub order_delay_ms_p50: Option<f64>,
    pub order_delay_ms_p99: Option<f64>,
    pub order_delay_ms_max: Option<f64>,
}

/// Everything the checks found.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Verification {
    pub invariants: Invariants,
    pub redis: Option<RedisView>,
    pub orders: Option<OrderView>,
}

#[derive(Debug, Clone)]
struct RedisRecord {
    status: String,
    user_id: Option<u64>,
    reserved_at_ms: Option<u64>,
}

/// Runs the checks. Failures to reach a store are reported in `invariants.error`.
pub async fn verify(input: VerifyInput<'_>) -> Verification {
    let mut out = Verification::default();
    // Any node of a cluster will do: the SKU's keys share one slot, and its node is found.
    let tag = format!("seckill:{{{}:{}}}:stock", input.activity_id, input.sku_id);
    let mut redis = match Redis::connect_serving(input.redis, &tag).await {
        Ok(r) => r,
        Err(e) => {
            out.invariants.error = Some(e);
            return out;
        }
    };
    let records = match scan_records(&mut redis, &input).await {
        Ok(r) => r,
        Err(e) => {
            out.invariants.error = Some(e);
            return out;
        }
    };
    let mut pg_checked = false;
    if let Some(pg_url) = input.pg_url {
        match check_postgres(pg_url, &mut redis, &input, &records, &mut out).await {
            Ok(()) => {
                out.invariants.checked_in.push("postgres".into());
                pg_checked = true;
            }
            Err(e) => out.invariants.error = Some(e),
        }
    }
    // Redis last: after the drain its statuses are final.
    let records = match scan_records(&mut redis, &input).await {
        Ok(r) => r,
        Err(e) => {
            out.invariants.error = Some(e);
            return out;
        }
    };
    match redis_view(&mut redis, &input, &records).await {
        Ok(view) => {
            judge_redis(&input, &records, &view, pg_checked, &mut out.invariants);
            out.invariants.checked_in.insert(0, "redis".into());
            out.redis = Some(view);
        }
        Err(e) => out.invariants.error = Some(e),
    }
    let inv = &mut out.invariants;
    let verdicts = [inv.no_oversell, inv.one_per_user, inv.tokens_conserved, inv.nothing_lost];
    inv.ok = if inv.error.is_some() {
        Some(false)
    } else {
        Some(verdicts.iter().flatten().all(|v| *v) && inv.violations.is_empty())
    };
    out
}

fn keys(input: &VerifyInput<'_>) -> (String, String, String) {
    let tag = format!("seckill:{{{}:{}}}", input.activity_id, input.sku_id);
    (format!("{tag}:resv:resv_*"), format!("{tag}:stock"), format!("{tag}:resv:pending"))
}

async fn scan_records(
    redis: &mut Redis,
    input: &VerifyInput<'_>,
) -> Result<HashMap<String, RedisRecord>, String> {
    let (pattern, _, _) = keys(input);
    let prefix_len = pattern.len() - "resv_*".len();
    let mut names: Vec<String> = Vec::new();
    let mut cursor = String::from("0");
    loop {
        let reply = redis
            .command(&[b"SCAN", cursor.as_bytes(), b"MATCH", pattern.as_bytes(), b"COUNT", b"1000"])
            .await?;
        let parts = reply.as_array().ok_or_else(|| format!("SCAN: unexpected {reply:?}"))?;
        let (Some(next), Some(batch)) = (parts.first().and_then(text), parts.get(1)) else {
            return Err(format!("SCAN: unexpected {reply:?}"));
        };
        for key in batch.as_array().unwrap_or_default() {
            if let Some(k) = text(key) {
                names.push(k.to_owned());
            }
        }
        if names.len() > REDIS_RECORDS_MAX {
            return Err(format!("more than {REDIS_RECORDS_MAX} reservation records"));
        }
        cursor = next.to_owned();
        if cursor == "0" {
            break;
        }
    }
    // SCAN may return a key twice; the map dedups.
    let mut records = HashMap::with_capacity(names.len());
    for chunk in names.chunks(REDIS_BATCH) {
        let commands: Vec<Vec<&[u8]>> = chunk
            .iter()
            .map(|k| vec![&b"HMGET"[..], k.as_bytes(), b"status", b"user_id", b"reserved_at"])
            .collect();
        let replies = redis.pipeline(&commands).await?;
        for (key, reply) in chunk.iter().zip(replies) {
            let fields = reply.as_array().unwrap_or_default();
            let field = |i: usize| fields.get(i).and_then(text).map(str::to_owned);
            let Some(status) = field(0) else { continue }; // deleted meanwhile
            records.insert(
                key[prefix_len..].to_owned(),
                RedisRecord {
                    status,
                    user_id: field(1).and_then(|v| v.parse().ok()),
                    reserved_at_ms: field(2).and_then(|v| v.parse().ok()),
                },
            );
        }
    }
    Ok(records)
}

async fn redis_view(
    redis: &mut Redis,
    input: &VerifyInput<'_>,
    records: &HashMap<String, RedisRecord>,
) -> Result<RedisView, String> {
    let (_, stock_key, pending_key) = keys(input);
    let replies = redis
        .pipeline(&[
            vec![&b"GET"[..], stock_key.as_bytes()],
            vec![b"ZCARD", pending_key.as_bytes()],
        ])
        .await?;
    let stock = replies.first().and_then(text).and_then(|s| s.parse().ok());
    let pending = replies.get(1).and_then(Reply::as_int).unwrap_or(0).max(0) as u64;
    let mut by_status = BTreeMap::new();
    for r in records.values() {
        *by_status.entry(r.status.clone()).or_insert(0) += 1;
    }
    let holding = records.values().filter(|r| holds_unit(&r.status)).count() as u64;
    let unanswered =
        records.keys().filter(|id| !input.seen.reservations.contains_key(*id)).count() as u64;
    Ok(RedisView {
        stock,
        reservations: records.len() as u64,
        by_status,
        holding,
        pending,
        unanswered,
    })
}

fn holds_unit(status: &str) -> bool {
    matches!(status, "PENDING_MESSAGE" | "MESSAGE_SENT" | "ORDER_CREATED")
}

fn and(a: Option<bool>, b: bool) -> Option<bool> {
    Some(a.unwrap_or(true) && b)
}

fn judge_redis(
    input: &VerifyInput<'_>,
    records: &HashMap<String, RedisRecord>,
    view: &RedisView,
    pg_checked: bool,
    inv: &mut Invariants,
) {
    // No oversell as Redis sees it.
    let mut oversold = false;
    match view.stock {
        Some(stock) if stock < 0 => {
            oversold = true;
            inv.violations.push(format!("redis: stock is negative ({stock})"));
        }
        None => inv.violations.push("redis: no stock key".into()),
        Some(_) => {}
    }
    if let (Some(initial), Some(stock)) = (input.initial_stock, view.stock) {
        if view.holding > initial || stock.max(0) as u64 + view.holding > initial {
            oversold = true;
            inv.violations.push(format!(
                "redis: {} reservations hold units and stock is {stock}, initial stock {initial}",
                view.holding
            ));
        }
    }
    inv.no_oversell = and(inv.no_oversell, !oversold);
    // One reservation holding a unit per user.
    let mut users = HashSet::new();
    let mut twice = 0u64;
    for r in records.values().filter(|r| holds_unit(&r.status)) {
        if let Some(user) = r.user_id {
            if !users.insert(user) {
                twice += 1;
            }
        }
    }
    if twice > 0 {
        inv.violations.push(format!("redis: {twice} users hold two reservations"));
    }
    inv.one_per_user = and(inv.one_per_user, twice == 0);
    // Every reservation the generator was told about exists in Redis. With PostgreSQL
    // checked, PostgreSQL decides what is lost (a record Redis lost may still have become an
    // order); the missing record is still a violation of its own.
    let mut missing: Vec<&String> =
        input.seen.reservations.keys().filter(|id| !records.contains_key(*id)).collect();
    missing.sort();
    if !missing.is_empty() {
        inv.violations.push(format!(
            "redis: {} reservations answered QUEUED/QUEUED_PENDING have no record",
            missing.len()
        ));
    }
    if !pg_checked {
        inv.lost_count = missing.len() as u64;
        inv.lost_ids = missing.iter().take(LOST_IDS_LISTED_MAX).map(|id| (*id).clone()).collect();
        inv.nothing_lost = Some(missing.is_empty());
    }
}

/// Final reservation statuses in PostgreSQL.
fn is_final(status: &str) -> bool {
    status == "ORDER_CREATED" || status.starts_with("REJECTED_")
}

async fn check_postgres(
    pg_url: &str,
    redis: &mut Redis,
    input: &VerifyInput<'_>,
    records: &HashMap<String, RedisRecord>,
    out: &mut Verification,
) -> Result<(), String> {
    let (client, connection) = tokio_postgres::connect(pg_url, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("connect to PostgreSQL: {e}"))?;
    let driver = tokio::spawn(connection);
    let result = check_postgres_with(&client, redis, input, records, out).await;
    drop(client);
    let _ = driver.await;
    result
}

async fn check_postgres_with(
    client: &tokio_postgres::Client,
    redis: &mut Redis,
    input: &VerifyInput<'_>,
    records: &HashMap<String, RedisRecord>,
    out: &mut Verification,
) -> Result<(), String> {
    let activity = i64::try_from(input.activity_id).map_err(|_| "activity id over i64")?;
    let sku = i64::try_from(input.sku_id).map_err(|_| "sku id over i64")?;
    let mut known: HashSet<&str> = records.keys().map(String::as_str).collect();
    known.extend(input.seen.reservations.keys().map(String::as_str));
    // Drain: every known reservation final, nothing PROCESSING.
    let started = Instant::now();
    let (statuses, drained) = loop {
        let statuses = reservation_statuses(client, activity, sku).await?;
        let processing = statuses.values().any(|(s, _)| s == "PROCESSING");
        let all_final = known.iter().all(|id| statuses.get(*id).is_some_and(|(s, _)| is_final(s)));
        if (all_final && !processing) || started.elapsed() >= input.drain_timeout {
            break (statuses, all_final && !processing);
        }
        tokio::time::sleep(Duration::from_millis(DRAIN_POLL_MS)).await;
        // Keep the Redis connection warm for the view read after the drain.
        let _ = redis.command(&[b"PING"]).await;
    };
    let inv = &mut out.invariants;
    inv.drained = Some(drained);
    inv.drain_s = Some(started.elapsed().as_secs_f64());
    // Nothing lost, per reservation.
    let now_ms = now_ms();
    let mut lost: Vec<&str> = Vec::new();
    for id in &known {
        match statuses.get(*id) {
            Some((s, _)) if is_final(s) => {}
            found => {
                let reserved_at_ms = records
                    .get(*id)
                    .and_then(|r| r.reserved_at_ms)
                    .or_else(|| found.and_then(|(_, at)| *at));
                match reserved_at_ms {
                    Some(at) if now_ms.saturating_sub(at) < input.recovery_deadline_ms => {
                        inv.in_flight_count += 1;
                    }
                    _ => lost.push(id),
                }
            }
        }
    }
    lost.sort_unstable();
    if !lost.is_empty() {
        inv.violations.push(format!(
            "postgres: {} reservations have no final outcome past the recovery deadline",
            lost.len()
        ));
    }
    inv.lost_count += lost.len() as u64;
    for id in lost.iter().take(LOST_IDS_LISTED_MAX) {
        inv.lost_ids.push((*id).to_owned());
    }
    inv.nothing_lost = Some(lost.is_empty());
    // I1–I3, I7.
    let report = flashsale_pg_worker::audit::check_invariants(client, activity, sku)
        .await
        .map_err(|e| format!("check invariants: {e}"))?;
    let broken =
        |tags: &[&str]| report.violations.iter().any(|v| tags.iter().any(|t| v.starts_with(t)));
    let missing_sku = !report.sku_found;
    inv.no_oversell = Some(!missing_sku && !broken(&["I1"]));
    inv.one_per_user = Some(!missing_sku && !broken(&["I2"]));
    inv.tokens_conserved = Some(!missing_sku && !broken(&["I3", "I1/I3"]));
    inv.violations.extend(report.violations.iter().map(|v| format!("postgres: {v}")));
    out.orders = Some(order_view(client, activity, sku).await?);
    Ok(())
}

/// Reservation id → (status, reserved_at ms) for one SKU.
async fn reservation_statuses(
    client: &tokio_postgres::Client,
    activity: i64,
    sku: i64,
) -> Result<HashMap<String, (String, Option<u64>)>, String> {
    let rows = client
        .query(
            "SELECT reservation_id, status, \
                    (extract(epoch FROM reserved_at) * 1000)::bigint \
             FROM inventory_reservation WHERE activity_id = $1 AND sku_id = $2",
            &[&activity, &sku],
        )
        .await
        .map_err(|e| format!("read reservations: {e}"))?;
    let mut map = HashMap::with_capacity(rows.len());
    for row in rows {
        let id: String = row.try_get(0).map_err(|e| e.to_string())?;
        let status: String = row.try_get(1).map_err(|e| e.to_string())?;
        let at: Option<i64> = row.try_get(2).map_err(|e| e.to_string())?;
        map.insert(id, (status, at.and_then(|v| u64::try_from(v).ok())));
    }
    Ok(map)
}

async fn order_view(
    client: &tokio_postgres::Client,
    activity: i64,
    sku: i64,
) -> Result<OrderView, String> {
    // Over ALL orders of the SKU: an order whose reservation row is missing counts as late.
    let row = client
        .query_one(
            "WITH d AS (SELECT extract(epoch FROM o.created_at - r.reserved_at)::float8 * 1000 \
                               AS delay_ms \
                        FROM orders o LEFT JOIN inventory_reservation r \
                          ON r.reservation_id = o.reservation_id \
                        WHERE o.activity_id = $1 AND o.sku_id = $2) \
             SELECT count(*), count(*) FILTER (WHERE delay_ms <= 3000), \
                    percentile_cont(0.5) WITHIN GROUP (ORDER BY delay_ms), \
                    percentile_cont(0.99) WITHIN GROUP (ORDER BY delay_ms), \
                    max(delay_ms) FROM d",
            &[&activity, &sku],
        )
        .await
        .map_err(|e| format!("read orders: {e}"))?;
    let total: i64 = row.try_get(0).map_err(|e| e.to_string())?;
    let within: i64 = row.try_get(1).map_err(|e| e.to_string())?;
    let ms = |i: usize| -> Result<Option<f64>, String> {
        let v: Option<f64> = row.try_get(i).map_err(|e| e.to_string())?;
        Ok(v.map(|x| (x * 1_000.0).round() / 1_000.0))
    };
    Ok(OrderView {
        orders_created: total.max(0) as u64,
        orders_within_3s: within.max(0) as u64,
        orders_within_3s_ratio: (total > 0).then(|| within as f64 / total as f64),
        order_delay_ms_p50: ms(2)?,
        order_delay_ms_p99: ms(3)?,
        order_delay_ms_max: ms(4)?,
    })
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
