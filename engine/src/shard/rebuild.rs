//! A SKU whose Redis keys were lost, rebuilt from PostgreSQL on its owner shard (DESIGN.md
//! section 7, "Lost data"; seed ch9 §7.2 and §11.5 stage 4). Redis is a cache of PostgreSQL's
//! truth: when a SKU's keys vanish (FLUSHALL, a node restarted without persistence, a master
//! lost together with its replica) the SKU is closed (`SUBMIT_CLOSED`, reason
//! `REDIS_DATA_LOST`; `failover.rs` decides when) and rebuilt here:
//!
//! 1. it waits until the order log has settled every message published before the loss (the
//!    consumer's ack floor passes the stream's last sequence seen after it: those reservations
//!    are in PostgreSQL then), or [`DRAIN_WAIT_MAX_MS`] passed — the reconcile after the
//!    rebuild still decides the reopening;
//! 2. it reads, in one snapshot, the SKU's configuration, every reservation PostgreSQL has
//!    and every event it announced about them (`pg-worker/src/redis_rebuild.rs`), and
//!    replays them in time order onto the SKU's total stock through the library's own
//!    functions — `restore` for a reservation (as `reserve` wrote it, its message
//!    acknowledged), then `apply_results` and `compensate` for its events, exactly as
//!    redis-sync applied them the first time (`logic::rebuild` plans it). What comes out is
//!    what the sale left in Redis: stock = total − units still held, a user marker for every
//!    buyer holding a reservation or an order, a request record for every request (a same-id
//!    retry gets its reservation or order back), the compensation markers;
//! 3. under a lock in Redis (`restore`'s `rebuild` key, renewed by every step): one rebuilder
//!    writes, whichever instance; the others find it `BUSY`, then `LIVE`. `meta` is written
//!    last, so nobody reserves from a half-built SKU, and redis-sync's events for the SKU are
//!    held back (NAKed, `sync.rs`) until it is back, so none is wiped or overwritten by the
//!    replay (they apply after it, idempotently).
//!
//! Reservations it cannot prove (final in PostgreSQL with no event to replay, an event that
//! does not decode) are restored as pending — the scanner republishes them under their
//! message id and PostgreSQL's inbox answers with the recorded outcome — and reported to the
//! operator: `flashsale_redis_rebuild_anomalies_total` and the log line with their ids.
//!
//! What is lost with Redis and cannot come back: a reservation whose message never reached the
//! log (`QUEUED_PENDING`, its only record was Redis' pending set). Its unit returns to sale;
//! a retry of its request id reserves afresh.
//!
//! Also here: [`find_lost`], the SKUs PostgreSQL says are on sale, owned by this shard, whose
//! `meta` is gone — how a loss is noticed when nothing else would (a FLUSHALL before the
//! owner ever read the SKU, an engine restarted onto an empty Redis): all of them now and
//! then, and at once those `reserve` found without `meta` (a buyer meanwhile is answered
//! `ACTIVITY_NOT_ACTIVE`, what Redis says of a SKU it does not know).
//!
//! What it is not: when a SKU closes or reopens (`failover.rs`), the plan of the replay
//! (`logic/rebuild.rs`), the functions (`lua/seckill.lua::restore`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use flashsale_io::redis::layout::{ActivityStatus, SkuMember};
use flashsale_io::redis::script::{
    RestoreLock, RestoreMeta, RestoreReply, RestoreReservation, RestoreStep, ScriptError, SkuKeys,
};
use flashsale_pg_worker::redis_rebuild::{
    active_among, active_skus, rebuild_source, RebuildSource,
};
use flashsale_pg_worker::sku::{self, SkuConfig};

use super::state::Shard;
use super::sync::{apply_all, Applying};
use crate::logic::clock::now_ms;
use crate::logic::placement::SkuKey;
use crate::logic::rebuild::{plan, PlanNotes, Step};

/// How long a rebuild waits at most for the order log to settle what was published before
/// the loss (reservations still in the log are not in PostgreSQL yet: a rebuild before they
/// are written cannot count them, and the reconcile after it then fails and the SKU stays
/// closed for the operator).
pub const DRAIN_WAIT_MAX_MS: u64 = 20_000;
/// How long a rebuilder holds the SKU's lock without taking a step (another instance takes
/// over after it).
const REBUILD_LOCK_TTL_MS: u64 = 30_000;
/// Keys one wipe deletes.
const WIPE_PAGE: u32 = 500;
/// SKUs on sale one look at PostgreSQL returns at most (per instance; each shard keeps the
/// ones it owns).
const ACTIVE_SKUS_MAX: i64 = 4_096;
/// How long the PostgreSQL reads of a rebuild may take (a large SKU's history).
const PG_READ_MS: u64 = 30_000;

/// How far the order log must be settled before a lost SKU is rebuilt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainTarget {
    /// The stream's last sequence in the first poll after the loss.
    pub sequence: u64,
    /// When that poll was taken.
    pub polled_at_ms: u64,
}

/// Whether the order log has settled what was published before the loss (step 1), or the wait
/// is over. `target` is remembered by the caller across rounds: set from the first poll taken
/// after `since_ms + settle_ms` (a publish in flight at the loss has landed by then).
pub fn drained(
    shard: &Shard,
    target: &mut Option<DrainTarget>,
    since_ms: u64,
    settle_ms: u64,
    now: u64,
) -> bool {
    let lag = &shard.shared.health.lag;
    if target.is_none() && lag.polled_at_ms() > since_ms + settle_ms {
        *target =
            Some(DrainTarget { sequence: lag.last_sequence(), polled_at_ms: lag.polled_at_ms() });
    }
    if let Some(t) = target {
        if lag.polled_at_ms() > t.polled_at_ms && lag.ack_floor() >= t.sequence {
            return true;
        }
    }
    let waited = now.saturating_sub(since_ms) >= DRAIN_WAIT_MAX_MS;
    if waited {
        tracing::warn!(
            ack_floor = lag.ack_floor(),
            target = ?target,
            "redis rebuild: the order log did not settle in time; rebuilding anyway \
            (the reconcile decides the reopening)"
        );
    }
    waited
}

/// Which SKUs [`find_lost`] looks at.
pub enum Look {
    /// Every SKU on sale (at most [`ACTIVE_SKUS_MAX`]) this shard owns.
    Everything,
    /// These, which `reserve` found without `meta` before the owner knew them.
    Suspects(Vec<SkuKey>),
}

/// The SKUs PostgreSQL says are on sale (activity `ACTIVE`: preheated once), owned by this
/// shard, whose `meta` is missing in Redis. Errors read as "none found now".
pub async fn find_lost(shard: &Shard, look: Look) -> Vec<SkuKey> {
    let read = match look {
        Look::Everything => {
            shard
                .shared
                .durable
                .pg(|client| async move { active_skus(&client, ACTIVE_SKUS_MAX).await })
                .await
        }
        Look::Suspects(keys) => {
            let keys: Vec<(i64, i64)> =
                keys.iter().map(|k| (k.activity_id as i64, k.sku_id as i64)).collect();
            shard
                .shared
                .durable
                .pg(|client| async move { active_among(&client, &keys).await })
                .await
        }
    };
    let Ok(active) = read else { return Vec::new() };
    let mut lost = Vec::new();
    for (activity_id, sku_id) in active {
        let (Ok(a), Ok(s)) = (u64::try_from(activity_id), u64::try_from(sku_id)) else { continue };
        let key = SkuKey::new(a, s);
        if shard.shared.table.owner(key) != shard.id {
            continue;
        }
        if let Ok(None) = shard.store.functions.read_meta(&shard.store.sku_keys(key)).await {
            lost.push(key);
        }
    }
    lost
}

/// Rebuilds a SKU Redis lost from PostgreSQL (module documentation, steps 2 and 3).
pub async fn rebuild(shard: &Shard, key: SkuKey) {
    let (activity_id, sku_id) = (key.activity_id as i64, key.sku_id as i64);
    #[cfg(feature = "failpoints")]
    if negative_control_rebuild_off() {
        return preheat_stock_only(shard, key).await;
    }
    let read = shard
        .shared
        .durable
        .pg_within(Duration::from_millis(PG_READ_MS), move |mut client| async move {
            let config = sku::sku_config(&client, activity_id, sku_id).await?;
            let source = rebuild_source(&mut client, activity_id, sku_id).await?;
            Ok(config.zip(source))
        })
        .await;
    let (config, source) = match read {
        Ok(Some(read)) => read,
        Ok(None) => return,
        Err(e) => {
            return tracing::warn!(activity_id, sku_id, error = %e,
                "redis rebuild: cannot read PostgreSQL");
        }
    };
    let started = std::time::Instant::now();
    match replay(shard, key, &config, &source).await {
        Ok(Some(notes)) => {
            shard.metrics().redis_rebuilds.fetch_add(1, Ordering::Relaxed);
            let anomalies = notes.without_events.len() + notes.undecodable;
            shard.metrics().redis_rebuild_anomalies.fetch_add(anomalies as u64, Ordering::Relaxed);
            tracing::warn!(activity_id, sku_id, reservations = source.reservations.len(),
                events = source.events.len(), in_flight = notes.in_flight.len(),
                unproven = ?notes.without_events, undecodable = notes.undecodable,
                took_ms = started.elapsed().as_millis() as u64,
                "redis rebuild: SKU rebuilt from PostgreSQL; reopens after a passing reconcile");
            let member = SkuMember { activity_id: key.activity_id, sku_id: key.sku_id };
            let _ = shard.store.functions.add_active_sku(member).await;
        }
        Ok(None) => tracing::info!(activity_id, sku_id, "redis rebuild: done by another"),
        Err(e) => tracing::warn!(activity_id, sku_id, error = %e, "redis rebuild failed"),
    }
}

/// The replay itself: lock, wipe what the lost Redis was left with, the plan's steps, meta.
/// `None`: another rebuilder holds the lock, or finished.
async fn replay(
    shard: &Shard,
    key: SkuKey,
    config: &SkuConfig,
    source: &RebuildSource,
) -> Result<Option<PlanNotes>, String> {
    let Some(status) = ActivityStatus::parse(&config.status) else {
        return Err(format!("unknown activity status {:?}", config.status));
    };
    let keys = shard.store.sku_keys(key);
    let token = format!("{}-{}-{}", shard.shared.config.instance_id, shard.id, now_ms());
    let lock = RestoreLock { token: &token, ttl_ms: REBUILD_LOCK_TTL_MS };
    if !step(shard, &keys, lock, &RestoreStep::Begin { stock: source.total_stock }).await? {
        return Ok(None);
    }
    wipe(shard, &keys, lock).await?;
    let (steps, notes) = plan(key, source);
    let next_retry_at_ms = now_ms() + shard.shared.config.order_deadline_ms;
    for planned in &steps {
        match planned {
            Step::Reserve { reservation: r, payload_hash } => {
                let restored = RestoreStep::Reservation(RestoreReservation {
                    request_id: &r.request_id,
                    user_id: r.user_id,
                    payload_hash,
                    reservation_id: &r.reservation_id,
                    message_id: &r.message_id,
                    reserved_at_ms: r.reserved_at_ms,
                    expires_at_ms: r.expires_at_ms,
                    next_retry_at_ms,
                    quantity: r.quantity,
                });
                if !step(shard, &keys, lock, &restored).await? {
                    return Ok(None);
                }
            }
            Step::Events(events) => {
                let results = apply_all(shard, events, Applying::Replay).await;
                if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
                    return Err(format!("replaying an event: {e}"));
                }
            }
        }
    }
    let meta = RestoreMeta {
        status,
        start_ms: config.start_at_ms.max(0) as u64,
        end_ms: config.end_at_ms.max(0) as u64,
        version: config.version.max(1) as u64,
        reservation_ttl_ms: config.reservation_ttl_ms.max(1) as u64,
        max_per_buyer: u32::try_from(config.max_per_buyer).unwrap_or(1).max(1),
    };
    Ok(step(shard, &keys, lock, &RestoreStep::Finish(meta)).await?.then_some(notes))
}

/// One `restore` step: true when done, false when another holds the lock or the SKU is whole.
async fn step(
    shard: &Shard,
    keys: &SkuKeys,
    lock: RestoreLock<'_>,
    step: &RestoreStep<'_>,
) -> Result<bool, String> {
    match shard.store.functions.restore(keys, lock, step).await {
        Ok(RestoreReply::Ok { .. }) => Ok(true),
        Ok(RestoreReply::Live | RestoreReply::Busy) => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

/// Deletes every record key the lost Redis still holds for the SKU (what redis-sync or a
/// compensation recreated before the loss was noticed), a SCAN page at a time.
async fn wipe(shard: &Shard, keys: &SkuKeys, lock: RestoreLock<'_>) -> Result<(), String> {
    let mut cursor = 0;
    loop {
        let page = shard.store.functions.scan_sku_keys(keys, cursor, WIPE_PAGE).await;
        let page = page.map_err(|e: ScriptError| e.to_string())?;
        let prefix = keys.prefix();
        let named = [
            ("resv:", &page.reservation_ids),
            ("comp:", &page.compensation_ids),
            ("user:", &page.user_markers),
            ("req:", &page.request_records),
        ];
        let wiped: Vec<String> = named
            .iter()
            .flat_map(|(kind, ids)| ids.iter().map(move |id| format!("{prefix}{kind}{id}")))
            .collect();
        if !wiped.is_empty()
            && !step(shard, keys, lock, &RestoreStep::Wipe { keys: &wiped }).await?
        {
            return Err("lost the rebuild lock while wiping".into());
        }
        if page.next_cursor == 0 {
            return Ok(());
        }
        cursor = page.next_cursor;
    }
}

/// Negative control (`tests/tests/redis_rebuild.rs`): the rebuild switched off; the SKU is
/// only preheated with PostgreSQL's sellable units, as recovery did before the rebuild — its
/// user markers and request records stay lost.
#[cfg(feature = "failpoints")]
fn negative_control_rebuild_off() -> bool {
    fail::fail_point!("negctl.redis_rebuild_off", |_| true);
    false
}

/// What recovery did before the rebuild (the negative control's "without"): stock only.
#[cfg(feature = "failpoints")]
async fn preheat_stock_only(shard: &Shard, key: SkuKey) {
    use flashsale_io::redis::script::PreheatArgs;
    let (activity_id, sku_id) = (key.activity_id as i64, key.sku_id as i64);
    let read = shard
        .shared
        .durable
        .pg(move |client| async move {
            let config = sku::sku_config(&client, activity_id, sku_id).await?;
            let units = sku::sellable_units(&client, activity_id, sku_id).await?;
            Ok(config.zip(units))
        })
        .await;
    let Ok(Some((config, units))) = read else { return };
    let Some(status) = ActivityStatus::parse(&config.status) else { return };
    let args = PreheatArgs {
        status,
        start_ms: config.start_at_ms.max(0) as u64,
        end_ms: config.end_at_ms.max(0) as u64,
        version: config.version.max(1) as u64,
        reservation_ttl_ms: config.reservation_ttl_ms.max(1) as u64,
        stock: units.max(0) as u64,
        max_per_buyer: u32::try_from(config.max_per_buyer).unwrap_or(1).max(1),
    };
    let _ = shard.store.functions.preheat(&shard.store.sku_keys(key), &args).await;
}
