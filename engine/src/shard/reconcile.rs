//! The reconcile report's I/O (DESIGN.md section 8): the reads of one report, in the order
//! that keeps a live sale from showing false gaps (`logic/reconcile.rs` explains the order and
//! judges), the admin endpoint's reply, and the periodic job on shard 0 with its gauges.
//!
//! 1. PostgreSQL, one read-only snapshot (`flashsale_pg_worker::reconcile`), on the durable
//!    side;
//! 2. Redis, read only, through the typed reads of `io::redis` (counters before and after, a
//!    bounded SCAN of the SKU's keys, each reservation's memberships then its record, every
//!    compensation marker), retried while the counters move;
//! 3. PostgreSQL again for the reservations the snapshot did not explain.
//!
//! What it is not: a repair tool. It never writes to Redis.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use flashsale_io::redis::script::{Functions, ScriptError, SkuKeys};
use flashsale_pg_worker::reconcile::{
    reconcile_postgres, reservation_statuses, PgReconcileLimits, PgReservation,
};

use super::shared::EdgeShared;
use super::state::Shard;
use super::store::Store;
use crate::http::Status;
use crate::logic::clock::now_ms;
use crate::logic::placement::SkuKey;
use crate::logic::reconcile::{
    cross_check_ids, judge, JudgeParams, ReconcileConfig, RedisSnapshot, Report, DELTA_KINDS,
};

/// Pending entries whose retry time is this far past count as overdue (the scanner re-scores
/// every entry it claims, every `interval_ms`, so a healthy one leaves none this old).
const PENDING_OVERDUE_MS: u64 = 60_000;

/// The keys one SCAN of a SKU found, sorted by kind.
#[derive(Default)]
struct Scanned {
    resv_ids: HashSet<String>,
    comp_ids: HashSet<String>,
    user_markers: HashSet<String>,
    request_records: HashSet<String>,
    complete: bool,
    calls: u32,
}

async fn scan(
    functions: &Functions,
    keys: &SkuKeys,
    config: &ReconcileConfig,
) -> Result<Scanned, ScriptError> {
    let mut out = Scanned::default();
    let mut cursor = 0u64;
    while out.calls < config.scan_calls_max {
        out.calls += 1;
        let page = functions.scan_sku_keys(keys, cursor, config.scan_count).await?;
        out.resv_ids.extend(page.reservation_ids);
        out.comp_ids.extend(page.compensation_ids);
        out.user_markers.extend(page.user_markers);
        out.request_records.extend(page.request_records);
        if out.resv_ids.len() + out.comp_ids.len() > config.records_max
            || out.user_markers.len() + out.request_records.len()
                > config.records_max.saturating_mul(2)
        {
            break;
        }
        cursor = page.next_cursor;
        if cursor == 0 {
            out.complete = true;
            break;
        }
    }
    Ok(out)
}

/// Each id's read, `read_batch` at a time (pipelined on the shard's connection).
async fn read_batched<T, F, Fut>(
    ids: &HashSet<String>,
    batch_max: usize,
    read: F,
) -> Result<Vec<(String, T)>, ScriptError>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<(String, T), ScriptError>>,
{
    let ids: Vec<&String> = ids.iter().collect();
    let mut out = Vec::with_capacity(ids.len());
    for batch in ids.chunks(batch_max) {
        let reads = batch.iter().map(|id| read((*id).clone()));
        for result in futures::future::join_all(reads).await {
            out.push(result?);
        }
    }
    Ok(out)
}

async fn read_redis_once(
    functions: &Functions,
    keys: &SkuKeys,
    config: &ReconcileConfig,
    now: u64,
) -> Result<RedisSnapshot, ScriptError> {
    let before = functions.counters(keys).await?;
    let scanned = scan(functions, keys, config).await?;
    let records = read_batched(&scanned.resv_ids, config.read_batch, |id| async move {
        let record = functions.read_reservation(keys, &id).await?;
        Ok((id, record))
    })
    .await?;
    let markers = read_batched(&scanned.comp_ids, config.read_batch, |id| async move {
        let marker = functions.read_compensation(keys, &id).await?;
        Ok((id, marker))
    })
    .await?;
    let flags = functions.sku_flags(keys).await?;
    let overdue = functions.pending_due_count(keys, now.saturating_sub(PENDING_OVERDUE_MS)).await?;
    let stuck_sample = functions.stuck_sample(keys, config.ids_listed_max).await?;
    let after = functions.counters(keys).await?;
    let drift = before.stock.unwrap_or(0).abs_diff(after.stock.unwrap_or(0))
        + before.pending.abs_diff(after.pending)
        + before.stuck.abs_diff(after.stuck);
    Ok(RedisSnapshot {
        stock: after.stock,
        soldout: flags.soldout,
        meta_status: flags.meta_status,
        pending: after.pending,
        pending_overdue: overdue,
        stuck: after.stuck,
        stuck_sample,
        records: records.into_iter().collect::<HashMap<_, _>>(),
        comp_markers: markers.into_iter().filter_map(|(id, m)| Some((id, m?))).collect(),
        user_markers: scanned.user_markers.len() as u64,
        request_records: scanned.request_records.len() as u64,
        scan_complete: scanned.complete,
        scan_calls: scanned.calls,
        settled: before == after,
        drift,
        read_attempts: 1,
    })
}

/// Reads until the counters hold still (at most `settle_attempts` reads).
pub async fn read_redis(
    functions: &Functions,
    keys: &SkuKeys,
    config: &ReconcileConfig,
) -> Result<RedisSnapshot, String> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut snapshot =
            read_redis_once(functions, keys, config, now_ms()).await.map_err(|e| e.to_string())?;
        snapshot.read_attempts = attempts;
        if snapshot.settled || attempts >= config.settle_attempts {
            return Ok(snapshot);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One report, the admin endpoint, the periodic job
// ---------------------------------------------------------------------------------------------

thread_local! {
    /// Reports being made on this shard (admin plane and periodic job live on shard 0).
    static RUNNING: Cell<usize> = const { Cell::new(0) };
}

/// Counts a running report; released on drop.
struct Running;

impl Running {
    fn enter(limit: Option<usize>) -> Option<Running> {
        RUNNING.with(|n| {
            if limit.is_some_and(|max| n.get() >= max) {
                return None;
            }
            n.set(n.get() + 1);
            Some(Running)
        })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

/// Makes the report of one SKU (PostgreSQL, then Redis, then the re-read; see the module
/// documentation). Never fails: a store that cannot be read is a problem in the report.
pub async fn reconcile(shared: &EdgeShared, store: &Store, key: SkuKey) -> Report {
    let started = Instant::now();
    let config = shared.config.reconcile;
    let params = JudgeParams {
        now_ms: now_ms(),
        recovery_deadline_ms: shared.config.scanner.recovery_deadline_ms,
        ids_listed_max: config.ids_listed_max,
    };
    let pg_timeout = Duration::from_millis(config.pg_timeout_ms);
    let ids = (i64::try_from(key.activity_id), i64::try_from(key.sku_id));
    let pg = match ids {
        (Ok(activity_id), Ok(sku_id)) => {
            let limits = PgReconcileLimits {
                ids_listed_max: config.ids_listed_max,
                reservations_max: config.records_max,
                statement_timeout_ms: config.pg_timeout_ms,
            };
            shared
                .durable
                .pg_within(pg_timeout, move |mut client| async move {
                    reconcile_postgres(&mut client, activity_id, sku_id, limits).await
                })
                .await
                .map_err(|e| e.to_string())
        }
        _ => Err("activity or sku id beyond PostgreSQL's bigint".to_owned()),
    };
    let keys = store.sku_keys(key);
    let redis = read_redis(&store.functions, &keys, &config).await;
    let mut rechecked = Vec::new();
    if let (Ok(pg_read), Ok(redis_read)) = (&pg, &redis) {
        let by_id: HashMap<&str, &PgReservation> =
            pg_read.reservations.iter().map(|r| (r.reservation_id.as_str(), r)).collect();
        let mut ids = cross_check_ids(&by_id, redis_read, &params, pg_read.release_returns_stock);
        ids.truncate(config.recheck_max);
        if !ids.is_empty() {
            let read = shared
                .durable
                .pg_within(pg_timeout, move |client| async move {
                    reservation_statuses(&client, &ids).await
                })
                .await;
            match read {
                Ok(rows) => rechecked = rows,
                Err(e) => tracing::warn!(error = %e, "reconcile: re-read of PostgreSQL failed"),
            }
        }
    }
    let mut report = judge(key, pg, redis, &rechecked, params);
    report.took_ms = started.elapsed().as_millis() as u64;
    report
}

/// `GET /admin/v1/activities/{a}/skus/{s}/reconcile`: 200 with the report (`ok` says the
/// verdict), 404 with the report when PostgreSQL does not know the SKU, 503 when
/// `concurrent_max` reports are already running.
pub async fn admin_reply(shared: &EdgeShared, store: &Store, key: SkuKey) -> (Status, String) {
    let Some(_running) = Running::enter(Some(shared.config.reconcile.concurrent_max)) else {
        return (
            Status::ServiceUnavailable,
            r#"{"state":"SYSTEM_BUSY","reason_code":"RECONCILE_BUSY"}"#.to_owned(),
        );
    };
    let report = reconcile(shared, store, key).await;
    let unknown = report.postgres.as_ref().is_some_and(|p| !p.invariants.sku_found);
    match serde_json::to_string(&report) {
        Ok(body) if unknown => (Status::NotFound, body),
        Ok(body) => (Status::Ok, body),
        Err(e) => {
            tracing::error!(error = %e, "reconcile: report not serializable");
            (Status::InternalServerError, r#"{"state":"INVALID"}"#.to_owned())
        }
    }
}

/// The periodic job: on shard 0 only, every `interval_ms` (0: never), one report per active
/// SKU, gauges set from the round, a warning per SKU that is not ok; only on the instance
/// holding the reconcile lease (`durable/lease.rs`), the others idle (their admin endpoint
/// still answers).
pub fn spawn(shard: &Rc<Shard>) {
    let config = shard.config().reconcile;
    if shard.id != 0 || config.interval_ms == 0 {
        return;
    }
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        loop {
            // Sleep in slices so a stopping engine is not held up by a long interval.
            let wake = Instant::now() + Duration::from_millis(config.interval_ms);
            while Instant::now() < wake {
                if shard.shared.stopping.load(Ordering::Relaxed) {
                    return;
                }
                glommio::timer::sleep(Duration::from_millis(200)).await;
            }
            if shard.shared.reconcile_lease.held(now_ms()) {
                round(&shard, &config).await;
            }
        }
    })
    .detach();
}

async fn round(shard: &Rc<Shard>, config: &ReconcileConfig) {
    let Some(_running) = Running::enter(None) else { return };
    let Ok(members) = shard.store.functions.active_skus().await else {
        tracing::warn!("reconcile: cannot read the active SKUs; round skipped");
        return;
    };
    let mut skus: Vec<SkuKey> =
        members.into_iter().map(|m| SkuKey::new(m.activity_id, m.sku_id)).collect();
    skus.sort_unstable_by_key(|k| (k.activity_id, k.sku_id));
    if skus.len() > config.skus_per_round_max {
        tracing::warn!(
            active = skus.len(),
            reconciled = config.skus_per_round_max,
            "reconcile: more active SKUs than one round covers"
        );
        skus.truncate(config.skus_per_round_max);
    }
    let mut totals = [0u64; 7];
    let (mut ok, mut not_ok) = (0u64, 0u64);
    for key in skus {
        if shard.shared.stopping.load(Ordering::Relaxed) {
            return;
        }
        let report = reconcile(&shard.shared, &shard.store, key).await;
        for (total, value) in totals.iter_mut().zip(report.deltas.values()) {
            *total = total.saturating_add(value);
        }
        if report.ok {
            ok += 1;
        } else {
            not_ok += 1;
            tracing::warn!(
                activity_id = key.activity_id,
                sku_id = key.sku_id,
                deltas = ?DELTA_KINDS.iter().zip(report.deltas.values()).collect::<Vec<_>>(),
                problems = ?report.problems,
                "reconcile: conservation gap (GET .../reconcile lists the ids)"
            );
        }
    }
    let m = &shard.metrics().reconcile;
    for (gauge, total) in m.delta.iter().zip(totals) {
        gauge.store(total, Ordering::Relaxed);
    }
    m.skus_ok.store(ok, Ordering::Relaxed);
    m.skus_not_ok.store(not_ok, Ordering::Relaxed);
    m.rounds.fetch_add(1, Ordering::Relaxed);
    m.last_round_ms.store(now_ms(), Ordering::Relaxed);
}
