//! A SKU's local state on its owner shard, and the read-only replica every shard keeps
//! (DESIGN.md section 3.1). Sans-I/O: no sockets, no clock (`now_ms` is an argument), no
//! spawning; the shard's event loop drives it and carries its broadcasts.
//!
//! The owner ([`SkuPartition`]) decides, per submit, whether Redis needs to be asked at all:
//! - a request id this instance already accepted is answered from memory (replay), even after
//!   sell-out, without touching Redis;
//! - sold out → `SOLD_OUT` at once;
//! - the per-SKU admission bound (attempts/s towards Redis and in-flight calls) is full →
//!   `OVERLOADED` at once;
//! - otherwise a [`Permit`] to call `reserve`, returned through [`SkuPartition::on_reserve`].
//!
//! Every shard holds a [`SkuReplica`]: the sold-out flag and a frozen copy of the accepted
//! map, published by the owner with a revision whenever the flag changes. After sell-out a
//! request — a replay included — is therefore answered on the core that accepted it, with no
//! Redis call and no cross-core hop. The owner is the single writer; replicas only apply
//! newer revisions.
//!
//! Redis stays the authority: local state only saves work. A stale sold-out flag is bounded
//! by the periodic stock re-check ([`SkuPartition::stock_check_due`] and
//! [`SkuPartition::on_stock_observed`]), and a replay unknown here goes to Redis, which
//! answers `IDEMPOTENT`.
//!
//! Replays after sell-out need the requests OTHER instances accepted too: a buyer whose
//! instance died before answering retries elsewhere and must get the first result, not
//! `SOLD_OUT` (found by the instance-kill drill in `tests/tests/crash_drills.rs`). So when the
//! flag flips to sold out the map is marked incomplete, the shard loads every request record
//! of the SKU from Redis ([`SkuPartition::replay_load_due`], `shard/replays.rs`), and until
//! [`SkuPartition::on_replays_loaded`] completes it, a request id unknown here goes to Redis
//! (which answers `IDEMPOTENT` or `SOLD_OUT`) instead of being answered `SOLD_OUT` locally.
//!
//! Release assertions guard what this state promises: the accepted map never passes its bound,
//! a permit is never returned twice, revisions only grow, and a request the partition holds as
//! accepted is never handed to Redis to be accepted again (`assert_not_accepted_twice`, which
//! also says what it deliberately leaves to Redis and PostgreSQL).

use std::collections::HashMap;
use std::sync::Arc;

use flashsale_io::redis::layout::ActivityStatus;

use crate::logic::placement::SkuKey;

/// What the owner knows of the activity; refreshed from Redis/PostgreSQL by the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivitySnapshot {
    pub status: ActivityStatus,
    pub start_ms: u64,
    pub end_ms: u64,
    pub version: u64,
}

impl ActivitySnapshot {
    /// True only when the activity is certainly over for good: ended or terminated, or past
    /// its end. "Not started yet" is left to Redis, whose `meta` may be newer than ours.
    fn certainly_closed(&self, now_ms: u64) -> bool {
        matches!(self.status, ActivityStatus::Ended | ActivityStatus::Terminated)
            || now_ms >= self.end_ms
    }
}

/// The submit state a request id was answered with (CONTRACT.md 3.2), kept for replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptedState {
    /// Reserved, message not yet confirmed by the log.
    QueuedPending,
    /// Reserved and the order-create message is durably in the log.
    Queued,
}

/// One request accepted (Redis `CREATED` or `IDEMPOTENT`) by this instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// The buyer's own request id (request ids are scoped per buyer, CONTRACT.md section 5).
    pub request_id: Arc<str>,
    pub reservation_id: Arc<str>,
    pub message_id: Arc<str>,
    pub payload_hash: Arc<str>,
    pub state: AcceptedState,
}

/// The accepted map, keyed by buyer: a buyer holds at most one reservation of a SKU at a time
/// (`reserve`'s user marker), so the latest accepted request of each buyer is the one worth
/// answering locally; an older one of the same buyer goes to Redis (`IDEMPOTENT`). As replicas
/// see it: frozen, shared by `Arc`, replaced wholesale.
pub type AcceptedMap = HashMap<u64, Accepted>;

/// Accepted-map entries a shard may still add over all its SKUs (~570 bytes each, measured by
/// `benches/baseline.sh`); entries are never removed, so this bounds the shard's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptedBudget {
    left: usize,
}

impl AcceptedBudget {
    pub fn new(entries: usize) -> AcceptedBudget {
        AcceptedBudget { left: entries }
    }

    /// No shard-wide bound (tests, benches).
    pub fn unlimited() -> AcceptedBudget {
        AcceptedBudget { left: usize::MAX }
    }

    pub fn left(&self) -> usize {
        self.left
    }

    /// One entry, if any is left.
    fn take(&mut self) -> bool {
        if self.left == 0 {
            return false;
        }
        self.left -= 1;
        true
    }
}

/// Limits of one SKU's partition state. A limit on everything: the accepted map is bounded by
/// `accepted_max` per SKU and by the shard's [`AcceptedBudget`] overall, admission by rate and
/// concurrency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionLimits {
    /// Entries kept in the accepted map; beyond it replays go to Redis (still correct).
    pub accepted_max: usize,
    /// `reserve` calls towards Redis per second for this SKU (token bucket rate).
    pub attempts_per_s: u32,
    /// Token bucket depth: attempts allowed in a burst.
    pub attempts_burst: u32,
    /// `reserve` calls of this SKU waiting for Redis at once.
    pub in_flight_max: u32,
    /// How often the owner re-reads `stock` while sold out, to clear a stale flag.
    pub stock_recheck_ms: u64,
    /// Retry-After suggested when the admission bound rejects.
    pub overloaded_retry_ms: u32,
}

impl PartitionLimits {
    pub fn for_stock(stock: u64) -> PartitionLimits {
        PartitionLimits {
            accepted_max: usize::try_from(stock).unwrap_or(usize::MAX).clamp(1, 1_000_000),
            attempts_per_s: 50_000,
            attempts_burst: 5_000,
            in_flight_max: 1_024,
            stock_recheck_ms: 1_000,
            overloaded_retry_ms: 200,
        }
    }
}

/// What to do with a submit, decided on the owner shard before any I/O.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitPlan {
    /// This request id was accepted here before with the same payload.
    Replay(Accepted),
    /// This request id was accepted here before with a different payload.
    Conflict,
    /// The activity is certainly over.
    NotActive,
    SoldOut,
    /// The Redis node serving this SKU failed over, or lost the SKU's keys, and the SKU is
    /// not rebuilt and reconciled yet (`SUBMIT_CLOSED`, reason `REDIS_FAILOVER` or, when the
    /// keys were seen gone, `REDIS_DATA_LOST`).
    RedisFailover {
        data_lost: bool,
    },
    /// The per-SKU admission bound is full; answer `OVERLOADED` with this Retry-After.
    Overloaded {
        retry_after_ms: u32,
    },
    /// Call `reserve`; hand the permit back with the result.
    CallRedis(Permit),
}

/// Proof that an admission slot was taken; must be returned via [`SkuPartition::on_reserve`]
/// (or [`SkuPartition::release`] when the call never happened).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "an admission slot leaks unless the permit is returned"]
pub struct Permit {
    _private: (),
}

/// The `reserve` outcomes the partition cares about (mapped by the shard from the script
/// binding's reply enum).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveSeen {
    /// `CREATED` or `IDEMPOTENT`: the request holds a reservation.
    Accepted(Accepted),
    /// `CREATED` that took the last unit (`stock_after` = 0): accepted, and now sold out.
    AcceptedLast(Accepted),
    SoldOut,
    /// Anything that says nothing about stock (duplicate user, conflict, inactive, error,
    /// unknown outcome).
    Other,
}

/// A change the owner publishes to every shard's replica.
#[derive(Debug, Clone)]
pub struct ReplicaUpdate {
    pub key: SkuKey,
    pub revision: u64,
    pub sold_out: bool,
    /// The map holds every request of the SKU Redis knows (loaded after sell-out): an id not
    /// in it may be answered `SOLD_OUT` locally.
    pub replays_complete: bool,
    pub accepted: Arc<AcceptedMap>,
}

/// Owner-side state of one SKU.
#[derive(Debug)]
pub struct SkuPartition {
    key: SkuKey,
    limits: PartitionLimits,
    activity: Option<ActivitySnapshot>,
    sold_out: bool,
    revision: u64,
    accepted: AcceptedMap,
    in_flight: u32,
    bucket_tokens_milli: u64,
    bucket_refilled_ms: u64,
    stock_checked_ms: u64,
    /// When a failover of its Redis node was seen; cleared by a passing reconcile.
    failover_since_ms: Option<u64>,
    /// The closure began with the SKU's keys seen gone (meta missing for a SKU we knew).
    data_lost: bool,
    /// A `reserve` answer proved Redis held the SKU's `meta` (see `knew_meta`).
    meta_seen: bool,
    /// `reserve` found no `meta` while the owner did not know the SKU: unknown to Redis, or
    /// lost before the owner ever read it. The failover task asks PostgreSQL (`suspects`).
    meta_missing: bool,
    /// redis-sync's events for the SKU are held back (NAKed) from the loss until its `meta` is
    /// back (rebuilt here or by another instance): an event applied to a half-rebuilt SKU
    /// could be wiped or overwritten by the rebuild's replay.
    events_held: bool,
    /// See the module documentation: false from the flip to sold out until the load of the
    /// SKU's request records is merged.
    replays_complete: bool,
    replays_loading: bool,
    /// Test-only: forget the replay lookup, to prove `assert_not_accepted_twice` fires.
    #[cfg(test)]
    skip_replay_lookup: bool,
}

impl SkuPartition {
    pub fn new(key: SkuKey, limits: PartitionLimits, now_ms: u64) -> SkuPartition {
        assert!(limits.attempts_burst > 0 && limits.in_flight_max > 0 && limits.accepted_max > 0);
        SkuPartition {
            key,
            limits,
            activity: None,
            sold_out: false,
            revision: 0,
            accepted: HashMap::new(),
            in_flight: 0,
            bucket_tokens_milli: u64::from(limits.attempts_burst) * 1000,
            bucket_refilled_ms: now_ms,
            stock_checked_ms: now_ms,
            failover_since_ms: None,
            data_lost: false,
            meta_seen: false,
            meta_missing: false,
            events_held: false,
            replays_complete: false,
            replays_loading: false,
            #[cfg(test)]
            skip_replay_lookup: false,
        }
    }

    pub fn key(&self) -> SkuKey {
        self.key
    }

    pub fn is_sold_out(&self) -> bool {
        self.sold_out
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    pub fn accepted_len(&self) -> usize {
        self.accepted.len()
    }

    pub fn set_activity(&mut self, snapshot: ActivitySnapshot) {
        match self.activity {
            Some(current) if current.version > snapshot.version => {}
            _ => self.activity = Some(snapshot),
        }
    }

    pub fn activity(&self) -> Option<ActivitySnapshot> {
        self.activity
    }

    /// Decides a submit. Order matters: a replay is answered even when sold out or
    /// overloaded (it costs nothing and must return the first result).
    pub fn plan_submit(
        &mut self,
        user_id: u64,
        request_id: &str,
        payload_hash: &str,
        now_ms: u64,
    ) -> SubmitPlan {
        if let Some(entry) = self.replayable(user_id, request_id) {
            return if &*entry.payload_hash == payload_hash {
                SubmitPlan::Replay(entry.clone())
            } else {
                SubmitPlan::Conflict
            };
        }
        if self.activity.is_some_and(|a| a.certainly_closed(now_ms)) {
            return SubmitPlan::NotActive;
        }
        if self.failover_since_ms.is_some() {
            return SubmitPlan::RedisFailover { data_lost: self.data_lost };
        }
        if self.sold_out && self.replays_complete {
            return SubmitPlan::SoldOut;
        }
        // Sold out with the replays not loaded yet: Redis decides (IDEMPOTENT or SOLD_OUT).
        self.refill(now_ms);
        if self.in_flight >= self.limits.in_flight_max || self.bucket_tokens_milli < 1000 {
            return SubmitPlan::Overloaded { retry_after_ms: self.limits.overloaded_retry_ms };
        }
        self.assert_not_accepted_twice(user_id, request_id);
        self.bucket_tokens_milli -= 1000;
        self.in_flight += 1;
        SubmitPlan::CallRedis(Permit { _private: () })
    }

    /// The buyer's accepted entry, when it is for this request id: a retry, answered from memory.
    fn replayable(&self, user_id: u64, request_id: &str) -> Option<&Accepted> {
        #[cfg(test)]
        if self.skip_replay_lookup {
            return None;
        }
        self.accepted.get(&user_id).filter(|e| &*e.request_id == request_id)
    }

    /// One per buyer, where this partition keeps it (DESIGN.md section 8, invariant 2): a
    /// request of a buyer this partition already holds an accepted reservation for (a retry:
    /// same buyer, same request id) is answered from memory ([`SubmitPlan::Replay`], or
    /// [`SubmitPlan::Conflict`] for another payload) and never handed to Redis to be accepted a
    /// second time: `begin` would mint a second reservation id for it, and if Redis no longer
    /// knew the first (a failover that lost it), the buyer would hold two reservations. Kept in
    /// release; one map lookup on the way to a Redis call.
    ///
    /// Deliberately not asserted: another request id of a held buyer goes to Redis, and may be
    /// accepted with a reservation of its own. That is legitimate once the buyer's earlier
    /// reservation was compensated and the buyer released (`compensate` in `lua/seckill.lua`;
    /// `tests/tests/stuck_dlq.rs`: "a buyer whose reservation was compensated may buy again"),
    /// and nobody tells the partition of compensations: Redis' user marker answers
    /// `DUPLICATE_USER` while the first one lives, PostgreSQL's `UNIQUE (activity_id, sku_id,
    /// user_id)` holds whatever Redis said, and the reconcile report's `one_per_buyer` delta
    /// audits both.
    fn assert_not_accepted_twice(&self, user_id: u64, request_id: &str) {
        if let Some(held) = self.accepted.get(&user_id) {
            assert!(
                &*held.request_id != request_id,
                "one per buyer broken: SKU {}:{} hands request {request_id} of buyer {user_id} \
                 to Redis again, though it already holds reservation {} for it",
                self.key.activity_id,
                self.key.sku_id,
                held.reservation_id,
            );
        }
    }

    fn refill(&mut self, now_ms: u64) {
        let elapsed_ms = now_ms.saturating_sub(self.bucket_refilled_ms);
        if elapsed_ms == 0 {
            return;
        }
        // tokens (in thousandths) gained = rate/s * elapsed_ms / 1000 * 1000.
        let gained = u64::from(self.limits.attempts_per_s).saturating_mul(elapsed_ms);
        let cap = u64::from(self.limits.attempts_burst) * 1000;
        self.bucket_tokens_milli = self.bucket_tokens_milli.saturating_add(gained).min(cap);
        self.bucket_refilled_ms = now_ms;
    }

    /// The call for `permit` finished. Returns a replica update when the sold-out flag
    /// changed (the shard broadcasts it).
    /// `budget`: the accepted entries the whole shard may still add (every SKU's map counts
    /// against it), so memory stays bounded however many SKUs are tracked.
    pub fn on_reserve(
        &mut self,
        permit: Permit,
        user_id: u64,
        seen: ReserveSeen,
        budget: &mut AcceptedBudget,
    ) -> Option<ReplicaUpdate> {
        self.release(permit);
        match seen {
            ReserveSeen::Accepted(entry) => {
                self.remember(user_id, entry, budget);
                None
            }
            ReserveSeen::AcceptedLast(entry) => {
                self.remember(user_id, entry, budget);
                self.set_sold_out(true)
            }
            ReserveSeen::SoldOut => self.set_sold_out(true),
            ReserveSeen::Other => None,
        }
    }

    /// Keeps the entry for local replays while this SKU and the shard have room; beyond, a
    /// replay goes to Redis (`reserve` answers IDEMPOTENT): slower, still correct.
    fn remember(&mut self, user_id: u64, entry: Accepted, budget: &mut AcceptedBudget) {
        let known = self.accepted.contains_key(&user_id);
        if known || (self.accepted.len() < self.limits.accepted_max && budget.take()) {
            self.accepted.insert(user_id, entry);
        }
        // The map is this SKU's memory bound: past it, memory grows with the buyers.
        assert!(self.accepted.len() <= self.limits.accepted_max, "accepted map over its bound");
    }

    /// Gives back an admission slot whose call never happened.
    pub fn release(&mut self, permit: Permit) {
        drop(permit);
        // A permit exists only while in_flight counts it.
        assert!(self.in_flight > 0, "permit returned twice for {:?}", self.key);
        self.in_flight -= 1;
    }

    /// The log confirmed the message of an accepted request (`mark_sent`).
    pub fn on_queued(&mut self, user_id: u64, request_id: &str) {
        if let Some(entry) = self.accepted.get_mut(&user_id) {
            if &*entry.request_id == request_id {
                entry.state = AcceptedState::Queued;
            }
        }
    }

    /// Its Redis node failed over: no reservations until a reconcile passes (the first mark
    /// stays: it is when the possible loss began).
    pub fn mark_failover(&mut self, now_ms: u64) {
        self.failover_since_ms.get_or_insert(now_ms);
    }

    /// Its keys are gone from Redis (meta missing for a SKU whose activity we knew): closed
    /// like a failover until rebuilt from PostgreSQL and reconciled.
    /// True when this call marked it (it was not marked lost already).
    pub fn mark_data_lost(&mut self, now_ms: u64) -> bool {
        let newly = !self.data_lost;
        self.mark_failover(now_ms);
        self.data_lost = true;
        self.events_held = true;
        newly
    }

    /// Its `meta` is back (the rebuild finished, here or on another instance): redis-sync's
    /// events apply again; still closed until a reconcile passes.
    pub fn release_events(&mut self) {
        self.events_held = false;
    }

    /// A reconcile passed (or an operator forced it): reservations again.
    pub fn clear_failover(&mut self) {
        self.failover_since_ms = None;
        self.data_lost = false;
        self.events_held = false;
    }

    pub fn data_lost(&self) -> bool {
        self.data_lost
    }

    pub fn holds_events(&self) -> bool {
        self.events_held
    }

    /// A `reserve` answer read the SKU's `meta`.
    pub fn saw_meta(&mut self) {
        self.meta_seen = true;
    }

    /// `reserve` found no `meta` for a SKU the owner did not know (see `meta_missing`).
    pub fn saw_meta_missing(&mut self) {
        self.meta_missing = true;
    }

    /// Whether `reserve` found no `meta` since the last call; clears it.
    pub fn take_meta_missing(&mut self) -> bool {
        std::mem::take(&mut self.meta_missing)
    }

    /// Whether Redis held the SKU's `meta` once (an activity snapshot read from it, or a
    /// `reserve` answer that read it): a missing `meta` is then a loss.
    pub fn knew_meta(&self) -> bool {
        self.meta_seen || self.activity().is_some()
    }

    pub fn failover_since_ms(&self) -> Option<u64> {
        self.failover_since_ms
    }

    /// Compensation returned stock (redis-sync on this shard): not sold out any more.
    pub fn on_stock_returned(&mut self) -> Option<ReplicaUpdate> {
        self.set_sold_out(false)
    }

    /// Whether the owner should re-read `stock` now (only while sold out: that is the flag
    /// that can go stale when another instance returned stock).
    pub fn stock_check_due(&self, now_ms: u64) -> bool {
        self.sold_out
            && now_ms.saturating_sub(self.stock_checked_ms) >= self.limits.stock_recheck_ms
    }

    /// The result of a stock re-read: positive stock clears a stale sold-out flag.
    pub fn on_stock_observed(&mut self, stock: i64, now_ms: u64) -> Option<ReplicaUpdate> {
        self.stock_checked_ms = now_ms;
        if stock > 0 {
            self.set_sold_out(false)
        } else {
            None
        }
    }

    /// This request id of this buyer is in the replay map.
    pub fn knows_request(&self, user_id: u64, request_id: &str) -> bool {
        self.accepted.get(&user_id).is_some_and(|e| &*e.request_id == request_id)
    }

    /// True once per needed load: sold out, the replays incomplete, no load running. The
    /// caller loads the SKU's request records and hands them to
    /// [`SkuPartition::on_replays_loaded`].
    pub fn replay_load_due(&mut self) -> bool {
        let due = self.sold_out && !self.replays_complete && !self.replays_loading;
        self.replays_loading |= due;
        due
    }

    /// The SKU's request records from Redis (`None`: the load failed; a later
    /// [`SkuPartition::replay_load_due`] retries). Entries this instance holds stay; the
    /// others are added within the map's bounds. Complete — a flip for the replicas — only
    /// when every record fits; otherwise unknown ids keep going to Redis (slower, correct).
    pub fn on_replays_loaded(
        &mut self,
        loaded: Option<Vec<(u64, Accepted)>>,
        budget: &mut AcceptedBudget,
    ) -> Option<ReplicaUpdate> {
        self.replays_loading = false;
        let loaded = loaded?;
        if !self.sold_out {
            // Stock came back meanwhile: the next sell-out loads again.
            return None;
        }
        let mut fits = true;
        for (user_id, entry) in loaded {
            if !self.accepted.contains_key(&user_id) {
                self.remember(user_id, entry, budget);
                fits &= self.accepted.contains_key(&user_id);
            }
        }
        if !fits {
            return None;
        }
        self.replays_complete = true;
        self.bump_revision();
        Some(self.replica_update())
    }

    fn set_sold_out(&mut self, sold_out: bool) -> Option<ReplicaUpdate> {
        if self.sold_out == sold_out {
            return None;
        }
        self.sold_out = sold_out;
        if sold_out {
            self.replays_complete = false;
        }
        self.bump_revision();
        Some(self.replica_update())
    }

    fn bump_revision(&mut self) {
        let previous = self.revision;
        self.revision += 1;
        // Replicas apply only newer revisions: a revision that did not grow would be ignored
        // everywhere and leave a stale flag (a buyer told SOLD_OUT with stock left, or worse,
        // a sold-out SKU sent to Redis by every shard).
        assert!(self.revision > previous, "replica revisions must grow");
    }

    /// The current state for replicas (also sent to a shard that starts late).
    pub fn replica_update(&self) -> ReplicaUpdate {
        ReplicaUpdate {
            key: self.key,
            revision: self.revision,
            sold_out: self.sold_out,
            replays_complete: self.replays_complete,
            // Copied only when the flag flips and once more when the replays are loaded (a
            // handful of times per sale), bounded by accepted_max entries.
            accepted: Arc::new(self.accepted.clone()),
        }
    }
}

/// What a non-owner shard can answer locally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FastPath {
    Replay(Accepted),
    Conflict,
    SoldOut,
    /// Not decidable here: send to the owner shard.
    Forward,
}

/// Every shard's read-only copy of a SKU's flags. Updated only by newer revisions.
#[derive(Debug, Clone, Default)]
pub struct SkuReplica {
    revision: u64,
    sold_out: bool,
    replays_complete: bool,
    accepted: Arc<AcceptedMap>,
}

impl SkuReplica {
    /// Applies an owner update; an older or equal revision (reordered delivery) is ignored.
    pub fn apply(&mut self, update: &ReplicaUpdate) -> bool {
        if update.revision <= self.revision && self.revision != 0 {
            return false;
        }
        self.revision = update.revision;
        self.sold_out = update.sold_out;
        self.replays_complete = update.replays_complete;
        self.accepted = Arc::clone(&update.accepted);
        true
    }

    pub fn is_sold_out(&self) -> bool {
        self.sold_out
    }

    /// After sell-out, answers on this core; before, everything goes to the owner (whose
    /// map is the live one).
    pub fn fast_path(&self, user_id: u64, request_id: &str, payload_hash: &str) -> FastPath {
        if !self.sold_out {
            return FastPath::Forward;
        }
        match self.accepted.get(&user_id).filter(|e| &*e.request_id == request_id) {
            Some(entry) if &*entry.payload_hash == payload_hash => FastPath::Replay(entry.clone()),
            Some(_) => FastPath::Conflict,
            None if self.replays_complete => FastPath::SoldOut,
            // Maybe another instance's acceptance, not loaded yet: the owner asks Redis.
            None => FastPath::Forward,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key() -> SkuKey {
        SkuKey::new(10001, 20001)
    }

    /// Each request id of these tests is its own buyer's.
    fn uid(request_id: &str) -> u64 {
        request_id.bytes().fold(7, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
    }

    fn accepted(n: u32, hash: &str) -> Accepted {
        accepted_as(&format!("r{n}"), n, hash)
    }

    fn accepted_as(request_id: &str, n: u32, hash: &str) -> Accepted {
        Accepted {
            request_id: Arc::from(request_id),
            reservation_id: Arc::from(format!("resv_{n}")),
            message_id: Arc::from(format!("msg_{n}")),
            payload_hash: Arc::from(hash),
            state: AcceptedState::QueuedPending,
        }
    }

    fn limits() -> PartitionLimits {
        PartitionLimits {
            accepted_max: 4,
            attempts_per_s: 1000,
            attempts_burst: 3,
            in_flight_max: 2,
            stock_recheck_ms: 100,
            overloaded_retry_ms: 50,
        }
    }

    fn permit(p: &mut SkuPartition, id: &str, now: u64) -> Permit {
        match p.plan_submit(uid(id), id, "h", now) {
            SubmitPlan::CallRedis(permit) => permit,
            other => panic!("expected CallRedis, got {other:?}"),
        }
    }

    #[test]
    fn the_shard_budget_bounds_the_accepted_maps_of_all_skus() {
        let limits = PartitionLimits { accepted_max: 10, ..limits() };
        let mut budget = AcceptedBudget::new(3);
        let mut a = SkuPartition::new(SkuKey::new(1, 1), limits, 0);
        let mut b = SkuPartition::new(SkuKey::new(1, 2), limits, 0);
        for (in_a, id) in [(true, "a1"), (true, "a2"), (false, "b1"), (false, "b2")] {
            let p = if in_a { &mut a } else { &mut b };
            let SubmitPlan::CallRedis(pm) = p.plan_submit(uid(id), id, "h", 0) else {
                panic!("admit")
            };
            p.on_reserve(pm, uid(id), ReserveSeen::Accepted(accepted(1, "h")), &mut budget);
        }
        assert_eq!((a.accepted_len(), b.accepted_len(), budget.left()), (2, 1, 0));
        // Past the budget the request is not remembered: its replay goes to Redis.
        assert!(matches!(b.plan_submit(uid("b2"), "b2", "h", 0), SubmitPlan::CallRedis(_)));
    }

    /// A retry of an accepted request that got past the replay lookup (here through the
    /// test-only hook that skips it, as a reordering of `plan_submit` could) stops the shard.
    #[test]
    #[should_panic(expected = "one per buyer broken: SKU 10001:20001 hands request first of \
                               buyer 42 to Redis again, though it already holds reservation \
                               resv_1 for it")]
    fn an_accepted_request_handed_to_redis_again_panics() {
        let buyer = 42;
        let mut p = SkuPartition::new(key(), limits(), 0);
        let SubmitPlan::CallRedis(first) = p.plan_submit(buyer, "first", "h", 0) else {
            panic!("the first request goes to Redis")
        };
        let seen = ReserveSeen::Accepted(accepted_as("first", 1, "h"));
        let _ = p.on_reserve(first, buyer, seen, &mut AcceptedBudget::unlimited());
        assert_eq!(
            p.plan_submit(buyer, "first", "h", 1),
            SubmitPlan::Replay(accepted_as("first", 1, "h"))
        );
        p.skip_replay_lookup = true;
        let _ = p.plan_submit(buyer, "first", "h", 2);
    }

    /// What the assertion leaves alone: two copies of one request sent before the first answer
    /// came back (`CREATED`, then `IDEMPOTENT`), and the buyer back after a compensation with a
    /// new request and a reservation of its own.
    #[test]
    fn a_buyer_released_by_a_compensation_may_be_accepted_again() {
        let buyer = 42;
        let mut p = SkuPartition::new(key(), limits(), 0);
        let mut budget = AcceptedBudget::unlimited();
        let plan = |p: &mut SkuPartition, id: &str| match p.plan_submit(buyer, id, "h", 0) {
            SubmitPlan::CallRedis(permit) => permit,
            other => panic!("expected CallRedis, got {other:?}"),
        };
        let (copy_a, copy_b) = (plan(&mut p, "first"), plan(&mut p, "first"));
        let seen = || ReserveSeen::Accepted(accepted_as("first", 1, "h"));
        assert!(p.on_reserve(copy_a, buyer, seen(), &mut budget).is_none());
        assert!(p.on_reserve(copy_b, buyer, seen(), &mut budget).is_none());
        let again = plan(&mut p, "again");
        let seen = ReserveSeen::Accepted(accepted_as("again", 2, "h"));
        assert!(p.on_reserve(again, buyer, seen, &mut budget).is_none());
        let replay = SubmitPlan::Replay(accepted_as("again", 2, "h"));
        assert_eq!(p.plan_submit(buyer, "again", "h", 0), replay);
        assert_eq!(p.accepted_len(), 1);
    }

    #[test]
    fn replay_after_sell_out_without_redis() {
        let mut p = SkuPartition::new(key(), limits(), 0);
        let pm = permit(&mut p, "r1", 0);
        assert!(p
            .on_reserve(
                pm,
                uid("r1"),
                ReserveSeen::Accepted(accepted(1, "h")),
                &mut AcceptedBudget::unlimited()
            )
            .is_none());
        let pm = permit(&mut p, "r2", 0);
        let update = p
            .on_reserve(pm, uid("r2"), ReserveSeen::SoldOut, &mut AcceptedBudget::unlimited())
            .expect("flag flips");
        assert!(update.sold_out && update.revision == 1 && !update.replays_complete);
        assert_eq!(p.plan_submit(uid("r1"), "r1", "h", 1), SubmitPlan::Replay(accepted(1, "h")));
        assert_eq!(p.plan_submit(uid("r1"), "r1", "other", 1), SubmitPlan::Conflict);
        // Until the SKU's records are loaded, an id unknown here may be another instance's
        // acceptance: Redis answers it (IDEMPOTENT or SOLD_OUT), on the owner and replicas.
        let unknown = p.plan_submit(uid("r5"), "r5", "h", 1);
        let SubmitPlan::CallRedis(pm) = unknown else { panic!("{unknown:?}") };
        p.release(pm);
        let mut replica = SkuReplica::default();
        assert!(replica.apply(&update));
        assert_eq!(replica.fast_path(uid("r1"), "r1", "h"), FastPath::Replay(accepted(1, "h")));
        assert_eq!(replica.fast_path(uid("r1"), "r1", "x"), FastPath::Conflict);
        assert_eq!(replica.fast_path(uid("r5"), "r5", "h"), FastPath::Forward);

        // One load at a time; a failed one is due again.
        assert!(p.replay_load_due());
        assert!(!p.replay_load_due(), "a load is running");
        assert!(p.on_replays_loaded(None, &mut AcceptedBudget::unlimited()).is_none());
        assert!(p.replay_load_due());
        // Loaded: r5 was accepted by another instance (as Redis has it), r1 stays ours.
        let loaded = vec![(uid("r5"), accepted(5, "h")), (uid("r1"), accepted(1, "stale"))];
        let update = p
            .on_replays_loaded(Some(loaded), &mut AcceptedBudget::unlimited())
            .expect("complete: a flip for the replicas");
        assert!(update.sold_out && update.replays_complete && update.revision == 2);
        assert!(!p.replay_load_due(), "complete");
        assert_eq!(p.plan_submit(uid("r5"), "r5", "h", 1), SubmitPlan::Replay(accepted(5, "h")));
        assert_eq!(p.plan_submit(uid("r1"), "r1", "h", 1), SubmitPlan::Replay(accepted(1, "h")));
        assert_eq!(p.plan_submit(uid("r3"), "r3", "h", 1), SubmitPlan::SoldOut);
        assert_eq!(p.in_flight(), 0);
        assert!(replica.apply(&update));
        assert_eq!(replica.fast_path(uid("r5"), "r5", "h"), FastPath::Replay(accepted(5, "h")));
        assert_eq!(replica.fast_path(uid("r9"), "r9", "h"), FastPath::SoldOut);
    }

    #[test]
    fn replays_loaded_after_the_stock_came_back_or_past_the_bound_complete_nothing() {
        let mut p = SkuPartition::new(key(), limits(), 0);
        let pm = permit(&mut p, "r1", 0);
        p.on_reserve(pm, uid("r1"), ReserveSeen::SoldOut, &mut AcceptedBudget::unlimited());
        assert!(p.replay_load_due());
        assert!(p.on_stock_observed(1, 10).is_some(), "stock came back: not sold out");
        let loaded = vec![(uid("r5"), accepted(5, "h"))];
        assert!(p.on_replays_loaded(Some(loaded), &mut AcceptedBudget::unlimited()).is_none());
        // Sold out again: a load is due again, and more records than the map holds leave
        // it incomplete (unknown ids keep going to Redis).
        let pm = permit(&mut p, "r2", 20);
        p.on_reserve(pm, uid("r2"), ReserveSeen::SoldOut, &mut AcceptedBudget::unlimited());
        assert!(p.replay_load_due());
        let many: Vec<_> = (0..5).map(|n| (uid(&format!("m{n}")), accepted(n, "h"))).collect();
        assert!(p.on_replays_loaded(Some(many), &mut AcceptedBudget::unlimited()).is_none());
        assert!(matches!(p.plan_submit(uid("z"), "z", "h", 30), SubmitPlan::CallRedis(_)));
    }

    #[test]
    fn last_unit_flips_sold_out_and_is_replayable_everywhere() {
        let mut p = SkuPartition::new(key(), limits(), 0);
        let pm = permit(&mut p, "r1", 0);
        let update = p
            .on_reserve(
                pm,
                uid("r1"),
                ReserveSeen::AcceptedLast(accepted(1, "h")),
                &mut AcceptedBudget::unlimited(),
            )
            .expect("flip");
        assert!(update.sold_out);
        assert_eq!(update.accepted.get(&uid("r1")), Some(&accepted(1, "h")));
        assert!(p.replay_load_due());
        assert!(p.on_replays_loaded(Some(Vec::new()), &mut AcceptedBudget::unlimited()).is_some());
        assert_eq!(p.plan_submit(uid("r2"), "r2", "h", 0), SubmitPlan::SoldOut);
    }

    #[test]
    fn admission_bounds_in_flight_and_rate() {
        let mut p = SkuPartition::new(key(), limits(), 0);
        let a = permit(&mut p, "a", 0);
        let b = permit(&mut p, "b", 0);
        assert_eq!(
            p.plan_submit(uid("c"), "c", "h", 0),
            SubmitPlan::Overloaded { retry_after_ms: 50 }
        );
        p.release(a);
        let c = permit(&mut p, "c", 0);
        p.release(b);
        p.release(c);
        // Burst of 3 spent at t=0: the 4th waits for the refill (1000/s = 1 per ms).
        assert_eq!(
            p.plan_submit(uid("d"), "d", "h", 0),
            SubmitPlan::Overloaded { retry_after_ms: 50 }
        );
        let d = permit(&mut p, "d", 1);
        p.release(d);
    }

    #[test]
    fn stale_sold_out_cleared_by_recheck_and_returned_stock() {
        let mut p = SkuPartition::new(key(), limits(), 0);
        let pm = permit(&mut p, "a", 0);
        assert!(p
            .on_reserve(pm, uid("a"), ReserveSeen::SoldOut, &mut AcceptedBudget::unlimited())
            .is_some());
        assert!(!p.stock_check_due(50));
        assert!(p.stock_check_due(100));
        assert_eq!(p.on_stock_observed(0, 100).map(|u| u.sold_out), None);
        assert!(!p.stock_check_due(150));
        let update = p.on_stock_observed(2, 200).expect("flag clears");
        assert!(!update.sold_out && update.revision == 2);
        assert!(matches!(p.plan_submit(uid("b"), "b", "h", 200), SubmitPlan::CallRedis(_)));
        let mut replica = SkuReplica::default();
        replica.apply(&update);
        assert_eq!(replica.fast_path(uid("b"), "b", "h"), FastPath::Forward);
        assert!(p.on_stock_returned().is_none(), "already not sold out: no broadcast");
    }

    #[test]
    fn replica_ignores_older_revisions() {
        let mut p = SkuPartition::new(key(), limits(), 0);
        let pm = permit(&mut p, "a", 0);
        let first = p
            .on_reserve(pm, uid("a"), ReserveSeen::SoldOut, &mut AcceptedBudget::unlimited())
            .expect("flip");
        let second = p.on_stock_returned().expect("flip back");
        let mut replica = SkuReplica::default();
        assert!(replica.apply(&second));
        assert!(!replica.apply(&first), "older revision must not win");
        assert!(!replica.is_sold_out());
    }

    #[test]
    fn closed_activity_is_answered_locally() {
        let mut p = SkuPartition::new(key(), limits(), 0);
        p.set_activity(ActivitySnapshot {
            status: ActivityStatus::Active,
            start_ms: 0,
            end_ms: 1000,
            version: 2,
        });
        assert!(matches!(p.plan_submit(uid("a"), "a", "h", 999), SubmitPlan::CallRedis(_)));
        assert_eq!(p.plan_submit(uid("b"), "b", "h", 1000), SubmitPlan::NotActive);
        // An older snapshot never replaces a newer one.
        p.set_activity(ActivitySnapshot {
            status: ActivityStatus::Terminated,
            start_ms: 0,
            end_ms: 1000,
            version: 1,
        });
        assert_eq!(p.activity().map(|a| a.status), Some(ActivityStatus::Active));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Submit(u8),
        Finish(bool, bool),
        Recheck(i8),
        Returned,
        Tick(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<u8>().prop_map(|r| Op::Submit(r % 16)),
            (any::<bool>(), any::<bool>()).prop_map(|(a, b)| Op::Finish(a, b)),
            any::<i8>().prop_map(Op::Recheck),
            Just(Op::Returned),
            any::<u8>().prop_map(Op::Tick),
        ]
    }

    proptest! {
        /// Against a trivial model: in_flight equals outstanding permits and never exceeds
        /// the bound; the accepted map never exceeds its bound; a replica fed every update
        /// agrees with the owner's flag; an accepted id is always replayed, never re-reserved.
        #[test]
        fn model(ops in proptest::collection::vec(op(), 1..200)) {
            let lim = limits();
            let mut p = SkuPartition::new(key(), lim, 0);
            let mut replica = SkuReplica::default();
            let mut outstanding: Vec<(Permit, String)> = Vec::new();
            let mut now = 0u64;
            let mut seen_accepted: std::collections::HashSet<String> = Default::default();
            let mut n = 0u32;
            for op in ops {
                match op {
                    Op::Submit(r) => {
                        let id = format!("r{r}");
                        match p.plan_submit(uid(&id), &id, "h", now) {
                            SubmitPlan::CallRedis(permit) => {
                                prop_assert!(!seen_accepted.contains(&id) || p.accepted_len() >= lim.accepted_max);
                                outstanding.push((permit, id));
                            }
                            SubmitPlan::Replay(_) => prop_assert!(seen_accepted.contains(&id)),
                            _ => {}
                        }
                    }
                    Op::Finish(ok, sold) => {
                        if let Some((permit, id)) = outstanding.pop() {
                            n += 1;
                            let seen = if ok { ReserveSeen::Accepted(accepted_as(&id, n, "h")) }
                                else if sold { ReserveSeen::SoldOut } else { ReserveSeen::Other };
                            let accepted_now = ok && (p.accepted_len() < lim.accepted_max);
                            if let Some(u) = p.on_reserve(permit, uid(&id), seen, &mut AcceptedBudget::unlimited()) { replica.apply(&u); }
                            if accepted_now { seen_accepted.insert(id); }
                        }
                    }
                    Op::Recheck(stock) => {
                        if let Some(u) = p.on_stock_observed(i64::from(stock), now) { replica.apply(&u); }
                    }
                    Op::Returned => { if let Some(u) = p.on_stock_returned() { replica.apply(&u); } }
                    Op::Tick(ms) => now += u64::from(ms),
                }
                prop_assert_eq!(p.in_flight() as usize, outstanding.len());
                prop_assert!(p.in_flight() <= lim.in_flight_max);
                prop_assert!(p.accepted_len() <= lim.accepted_max);
                prop_assert_eq!(replica.is_sold_out(), p.is_sold_out());
            }
            for (permit, _) in outstanding { p.release(permit); }
            prop_assert_eq!(p.in_flight(), 0);
        }
    }
}
