//! The funnel per activity and SKU (seed ch9 §12.2: "activity_id、sku_id 数量很大时 ... 只对当前
//! 热点活动建立标签 / Top-K 聚合"; ch8 §12.1), with a bound on its series: attempts, reserved,
//! sold out, shed, orders and compensations of each SKU that holds a *slot*, and of every other
//! SKU together in one aggregate series (`activity_id="other"`, `sku_id="other"`).
//!
//! Who gets a slot, at most `series_max` (≤ [`SKU_SERIES_BOUND`]) SKUs for the life of the
//! instance:
//! 1. the SKUs an operator marks hot (`[metrics] hot_skus`, and every SKU `[engine] pins`
//!    pins to a shard), at start;
//! 2. then the top SKUs by traffic: while slots are free, each shard notes the SKUs without a
//!    slot in a small Space-Saving table ([`CANDIDATES_MAX`] entries, so its memory is fixed
//!    however many SKUs there are), and each scrape of `/metrics` promotes the heaviest
//!    candidates since the last scrape (at least `promote_min_events` events each) into the
//!    free slots. Counts made before a SKU's promotion stay in the aggregate; its own series
//!    starts at 0 (a new label set, which `rate()` reads correctly).
//!
//! Slots are never reassigned, so a slot's counters only ever belong to one SKU and a reader
//! never sees a half-written key: the assigner writes a slot's two ids, then publishes it by
//! raising `used` (release); a counting shard reads `used` (acquire) and scans the slots below
//! it. Once every slot is taken, nothing is noted any more: the steady-state cost of a count is
//! one acquire load, a scan of at most `series_max` id pairs, and one relaxed add on the
//! shard's own cache lines (no allocation, no lock; the candidate table's lock is taken with
//! `try_lock` by its own shard only, so a count never waits for a scrape).
//!
//! Series: (`series_max` + 1) × 6 stages of `flashsale_sku_funnel_total`, plus two gauges.
//! Business ids other than the activity and the SKU never become labels (seed §15.14).
//!
//! What it is not: where the outcomes are known (the submit flow, `shard/publish.rs`,
//! `shard/sync.rs` call [`SkuFunnel::count`] / [`SkuFunnel::count_answer`]); the edge's other
//! metrics (`metrics.rs`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::logic::outcome::SubmitOutcome;
use crate::logic::placement::SkuKey;

/// The most SKUs with series of their own any configuration may ask for: 32 × 6 + 6 series.
pub const SKU_SERIES_BOUND: usize = 32;
/// Candidates one shard remembers while slots are free (Space-Saving: the heaviest SKUs
/// survive, each count over-estimated by at most the smallest entry's).
pub const CANDIDATES_MAX: usize = 16;

/// The funnel's stages, in the order of the seed's Dashboard 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Every submission that named the SKU and got past the pass and the body checks.
    Attempts,
    /// A fresh reservation (`reserve` answered CREATED).
    Reserved,
    SoldOut,
    /// Turned away unreserved by this instance: `OVERLOADED`, `SUBMIT_CLOSED`, `SYSTEM_BUSY`.
    Shed,
    /// An order's outcome applied to Redis by `redis-sync`.
    Orders,
    /// A compensation applied (`compensate` answered APPLIED).
    Compensations,
}

pub const STAGES: [Stage; 6] = [
    Stage::Attempts,
    Stage::Reserved,
    Stage::SoldOut,
    Stage::Shed,
    Stage::Orders,
    Stage::Compensations,
];

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Attempts => "attempts",
            Stage::Reserved => "reserved",
            Stage::SoldOut => "sold_out",
            Stage::Shed => "shed",
            Stage::Orders => "orders",
            Stage::Compensations => "compensations",
        }
    }
}

/// Who gets a slot (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkuFunnelConfig {
    /// Marked hot by the operator: slots from the start, in this order (duplicates ignored;
    /// beyond `series_max` the rest share the aggregate, and the start-up log says so).
    pub hot: Vec<SkuKey>,
    /// SKUs with series of their own (0..=[`SKU_SERIES_BOUND`]); 0 keeps only the aggregate.
    pub series_max: usize,
    /// Events between two scrapes a candidate needs to take a free slot.
    pub promote_min_events: u64,
}

impl Default for SkuFunnelConfig {
    fn default() -> SkuFunnelConfig {
        SkuFunnelConfig { hot: Vec::new(), series_max: 16, promote_min_events: 10 }
    }
}

impl SkuFunnelConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.series_max > SKU_SERIES_BOUND {
            return Err(format!(
                "sku_series_max {} is above the bound {SKU_SERIES_BOUND}",
                self.series_max
            ));
        }
        if self.promote_min_events == 0 {
            return Err("sku_promote_min_events must be at least 1".into());
        }
        Ok(())
    }
}

/// One SKU's place; written once by the assigner before `used` publishes it.
#[derive(Debug, Default)]
struct Slot {
    activity_id: AtomicU64,
    sku_id: AtomicU64,
}

/// One shard's counters (index 0: the aggregate, `i + 1`: slot `i`) and its candidates.
#[derive(Debug)]
#[repr(align(128))]
struct ShardFunnel {
    counts: [[AtomicU64; STAGES.len()]; SKU_SERIES_BOUND + 1],
    candidates: Mutex<Candidates>,
}

impl Default for ShardFunnel {
    fn default() -> ShardFunnel {
        ShardFunnel {
            counts: std::array::from_fn(|_| Default::default()),
            candidates: Mutex::new(Candidates { entries: Vec::with_capacity(CANDIDATES_MAX) }),
        }
    }
}

/// A Space-Saving table of SKUs without a slot.
#[derive(Debug, Default)]
struct Candidates {
    entries: Vec<(SkuKey, u64)>,
}

impl Candidates {
    fn note(&mut self, key: SkuKey) {
        if let Some(entry) = self.entries.iter_mut().find(|(k, _)| *k == key) {
            entry.1 += 1;
        } else if self.entries.len() < CANDIDATES_MAX {
            self.entries.push((key, 1));
        } else if let Some(min) = self.entries.iter_mut().min_by_key(|(_, n)| *n) {
            // The newcomer takes the smallest entry's place and count (+1): its count is an
            // upper bound, which is what keeps a truly heavy SKU from being starved out.
            *min = (key, min.1 + 1);
        }
    }
}

/// Every shard's funnel counters and the slot table.
#[derive(Debug)]
pub struct SkuFunnel {
    series_max: usize,
    promote_min_events: u64,
    slots: [Slot; SKU_SERIES_BOUND],
    /// Slots `0..used` are assigned (release by the assigner, acquire by the counters).
    used: AtomicUsize,
    /// Held while slots are assigned (at start and by a scrape): one assigner at a time.
    assigning: Mutex<()>,
    shards: Box<[ShardFunnel]>,
}

impl SkuFunnel {
    /// The funnel of `shard_count` shards, the hot SKUs already in their slots.
    pub fn new(config: &SkuFunnelConfig, shard_count: usize) -> SkuFunnel {
        let funnel = SkuFunnel {
            series_max: config.series_max.min(SKU_SERIES_BOUND),
            promote_min_events: config.promote_min_events.max(1),
            slots: Default::default(),
            used: AtomicUsize::new(0),
            assigning: Mutex::new(()),
            shards: (0..shard_count).map(|_| ShardFunnel::default()).collect(),
        };
        for key in &config.hot {
            funnel.assign(*key);
        }
        funnel
    }

    /// Counts one event of `stage` for `key` on shard `shard` (its own counters only).
    pub fn count(&self, shard: usize, key: SkuKey, stage: Stage) {
        let index = match self.slot_of(key) {
            Some(slot) => slot + 1,
            None => {
                self.note_candidate(shard, key);
                0
            }
        };
        self.shards[shard].counts[index][stage as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a submission's answer: an attempt, and its stage when it is one (a reservation
    /// is counted where it is made, [`Stage::Reserved`], not from the answer).
    pub fn count_answer(&self, shard: usize, key: SkuKey, outcome: SubmitOutcome) {
        self.count(shard, key, Stage::Attempts);
        let stage = match outcome {
            SubmitOutcome::SoldOut => Stage::SoldOut,
            SubmitOutcome::Overloaded | SubmitOutcome::SubmitClosed | SubmitOutcome::SystemBusy => {
                Stage::Shed
            }
            _ => return,
        };
        self.count(shard, key, stage);
    }

    /// The SKUs with a slot, in slot order.
    pub fn slotted(&self) -> Vec<SkuKey> {
        let used = self.used.load(Ordering::Acquire);
        self.slots[..used].iter().map(Slot::key).collect()
    }

    fn slot_of(&self, key: SkuKey) -> Option<usize> {
        let used = self.used.load(Ordering::Acquire);
        self.slots[..used].iter().position(|slot| slot.key() == key)
    }

    fn note_candidate(&self, shard: usize, key: SkuKey) {
        if self.used.load(Ordering::Relaxed) >= self.series_max {
            return;
        }
        // Never waits: a scrape merging this table at this moment costs one sample.
        if let Ok(mut candidates) = self.shards[shard].candidates.try_lock() {
            candidates.note(key);
        }
    }

    /// Gives `key` the next free slot (no-op when it has one or none is free).
    fn assign(&self, key: SkuKey) -> bool {
        let _one_assigner = self.assigning.lock().unwrap_or_else(|e| e.into_inner());
        let used = self.used.load(Ordering::Acquire);
        if used >= self.series_max || self.slots[..used].iter().any(|s| s.key() == key) {
            return false;
        }
        self.slots[used].activity_id.store(key.activity_id, Ordering::Relaxed);
        self.slots[used].sku_id.store(key.sku_id, Ordering::Relaxed);
        self.used.store(used + 1, Ordering::Release);
        true
    }

    /// Moves the heaviest candidates since the last call into free slots (each scrape calls
    /// it); the candidate tables start over.
    pub fn promote(&self) {
        if self.used.load(Ordering::Acquire) >= self.series_max {
            return;
        }
        let mut merged: Vec<(SkuKey, u64)> = Vec::new();
        for shard in self.shards.iter() {
            let mut candidates = shard.candidates.lock().unwrap_or_else(|e| e.into_inner());
            for (key, n) in candidates.entries.drain(..) {
                match merged.iter_mut().find(|(k, _)| *k == key) {
                    Some(entry) => entry.1 += n,
                    None => merged.push((key, n)),
                }
            }
        }
        merged.sort_by_key(|entry| std::cmp::Reverse(entry.1));
        for (key, n) in merged {
            if n < self.promote_min_events {
                break;
            }
            self.assign(key);
        }
    }

    /// Prometheus text: `flashsale_sku_funnel_total{activity_id,sku_id,stage}` for every slot
    /// and the aggregate, `flashsale_sku_series` (slots taken) and `flashsale_sku_series_max`.
    pub fn render(&self, out: &mut String) {
        let used = self.used.load(Ordering::Acquire);
        let _ = writeln!(out, "# TYPE flashsale_sku_funnel_total counter");
        for index in 0..=used {
            let (activity, sku) = match index {
                0 => ("other".to_owned(), "other".to_owned()),
                i => {
                    let key = self.slots[i - 1].key();
                    (key.activity_id.to_string(), key.sku_id.to_string())
                }
            };
            for stage in STAGES {
                let n: u64 = self
                    .shards
                    .iter()
                    .map(|s| s.counts[index][stage as usize].load(Ordering::Relaxed))
                    .sum();
                let _ = writeln!(
                    out,
                    "flashsale_sku_funnel_total{{activity_id=\"{activity}\",sku_id=\"{sku}\",\
                     stage=\"{}\"}} {n}",
                    stage.name()
                );
            }
        }
        let _ = writeln!(out, "# TYPE flashsale_sku_series gauge\nflashsale_sku_series {used}");
        let _ = writeln!(
            out,
            "# TYPE flashsale_sku_series_max gauge\nflashsale_sku_series_max {}",
            self.series_max
        );
    }
}

impl Slot {
    fn key(&self) -> SkuKey {
        SkuKey::new(self.activity_id.load(Ordering::Relaxed), self.sku_id.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(hot: &[(u64, u64)], series_max: usize, promote_min_events: u64) -> SkuFunnelConfig {
        SkuFunnelConfig {
            hot: hot.iter().map(|(a, s)| SkuKey::new(*a, *s)).collect(),
            series_max,
            promote_min_events,
        }
    }

    /// The value of one series line of `out`.
    fn value(out: &str, activity: &str, sku: &str, stage: &str) -> Option<u64> {
        let head = format!(
            "flashsale_sku_funnel_total{{activity_id=\"{activity}\",sku_id=\"{sku}\",stage=\"{stage}\"}} "
        );
        out.lines().find_map(|l| l.strip_prefix(head.as_str())?.parse().ok())
    }

    fn series(out: &str) -> usize {
        out.lines().filter(|l| l.starts_with("flashsale_sku_funnel_total{")).count()
    }

    #[test]
    fn hot_skus_have_series_from_the_start_and_the_rest_are_aggregated() {
        let funnel = SkuFunnel::new(&config(&[(1, 10), (1, 11)], 4, 1_000), 2);
        funnel.count_answer(0, SkuKey::new(1, 10), SubmitOutcome::SoldOut);
        funnel.count_answer(1, SkuKey::new(1, 10), SubmitOutcome::Queued);
        funnel.count(1, SkuKey::new(1, 10), Stage::Reserved);
        funnel.count_answer(1, SkuKey::new(9, 99), SubmitOutcome::SubmitClosed);
        let mut out = String::new();
        funnel.render(&mut out);
        assert_eq!(value(&out, "1", "10", "attempts"), Some(2), "{out}");
        assert_eq!(value(&out, "1", "10", "sold_out"), Some(1));
        assert_eq!(value(&out, "1", "10", "reserved"), Some(1));
        assert_eq!(value(&out, "1", "11", "attempts"), Some(0), "a hot SKU's series from 0");
        assert_eq!(value(&out, "other", "other", "shed"), Some(1));
        assert_eq!(value(&out, "9", "99", "shed"), None, "below the promotion threshold");
        assert_eq!(series(&out), 3 * STAGES.len());
        assert!(out.contains("\nflashsale_sku_series 2\n"), "{out}");
    }

    #[test]
    fn the_series_stay_within_the_bound_however_many_skus_come() {
        let max = 5;
        let funnel = SkuFunnel::new(&config(&[(7, 7)], max, 1), 2);
        for round in 0..50u64 {
            // A thousand SKUs seen once a round, five of them (every 200th) 200 times.
            for sku in 0..1_000u64 {
                let times = if sku % 200 == 0 { 200 } else { 1 };
                for i in 0..times {
                    funnel.count(usize::from(i % 2 == 0), SkuKey::new(1, sku), Stage::Attempts);
                }
            }
            if round % 7 == 0 {
                funnel.promote();
            }
            let mut out = String::new();
            funnel.render(&mut out);
            assert!(series(&out) <= (max + 1) * STAGES.len(), "round {round}: {out}");
        }
        let slotted = funnel.slotted();
        assert_eq!(slotted.len(), max);
        assert_eq!(slotted[0], SkuKey::new(7, 7), "the hot SKU keeps the first slot");
        // The top SKUs by traffic took the rest (Space-Saving keeps the heavy ones).
        for key in &slotted[1..] {
            assert_eq!(key.sku_id % 200, 0, "{slotted:?}");
        }
        let mut out = String::new();
        funnel.render(&mut out);
        assert_eq!(series(&out), (max + 1) * STAGES.len());
        assert!(out.contains(&format!("\nflashsale_sku_series_max {max}\n")));
    }

    #[test]
    fn nothing_is_lost_between_the_slots_and_the_aggregate() {
        let funnel = SkuFunnel::new(&config(&[], 2, 1), 3);
        let mut expected = 0u64;
        for i in 0..3_000u64 {
            funnel.count((i % 3) as usize, SkuKey::new(1, i % 5), Stage::Orders);
            expected += 1;
            if i % 500 == 0 {
                funnel.promote();
            }
        }
        let mut out = String::new();
        funnel.render(&mut out);
        let total: u64 = out
            .lines()
            .filter(|l| l.contains("stage=\"orders\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        assert_eq!(total, expected, "{out}");
        assert_eq!(funnel.slotted().len(), 2);
    }

    #[test]
    fn a_zero_bound_keeps_only_the_aggregate_and_bad_bounds_are_refused() {
        let funnel = SkuFunnel::new(&config(&[(1, 1)], 0, 1), 1);
        funnel.count(0, SkuKey::new(1, 1), Stage::Attempts);
        funnel.promote();
        let mut out = String::new();
        funnel.render(&mut out);
        assert_eq!(series(&out), STAGES.len());
        assert_eq!(value(&out, "other", "other", "attempts"), Some(1));
        assert!(config(&[], SKU_SERIES_BOUND + 1, 1).validate().is_err());
        assert!(config(&[], 4, 0).validate().is_err());
        assert!(SkuFunnelConfig::default().validate().is_ok());
    }
}
