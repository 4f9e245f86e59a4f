//! The arrival schedule and the plan of who sends what: sans-I/O, no clock, no sockets.
//!
//! What it is:
//! - [`Profile`]: when the `i`-th request is due, as an offset from the start of the run.
//!   Constant rate puts request `i` at `i / rate`; the burst profile ramps the rate linearly
//!   from 0 to the peak over `ramp_ms` (≤ 1 s, so the peak is reached within a second, as
//!   issue 5 asks) and then holds it. Offsets are a pure function of `i`, so the schedule
//!   never bends to the server: that is what makes the generator open-loop.
//! - [`Plan`]: a seeded generator of [`Intent`]s — which user sends, and whether it is a new
//!   request id or a re-send of an earlier request of that same user with the SAME request id
//!   (the seed's duplicate clicks, 10% by default). Same seed, same sequence.
//!
//! What it is not: the driver that sleeps until the offsets and writes to sockets
//! (`driver.rs`), nor the retry policy (a retry is scheduled by the driver from a response).
//!
//! Read next: `driver.rs`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Longest ramp accepted: the burst must reach its peak within one second.
pub const RAMP_MS_MAX: u64 = 1_000;
/// Highest rate accepted (requests per second); far above what one machine can send.
pub const RATE_MAX: u64 = 10_000_000;
/// Earlier intents a duplicate may re-send (a ring of the most recent ones): duplicate
/// clicks come within moments of the original, and the ring bounds the plan's memory.
pub const DUPLICATE_WINDOW: usize = 4_096;

/// The arrival profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// `rate_per_s` requests per second from the first instant.
    Constant { rate_per_s: u64 },
    /// Linear ramp from 0 to `peak_per_s` over `ramp_ms`, then constant.
    Burst { peak_per_s: u64, ramp_ms: u64 },
}

impl Profile {
    /// Checks the bounds; `None` when the profile is valid.
    pub fn invalid_reason(&self) -> Option<String> {
        let (rate, ramp_ms) = match *self {
            Profile::Constant { rate_per_s } => (rate_per_s, 0),
            Profile::Burst { peak_per_s, ramp_ms } => (peak_per_s, ramp_ms),
        };
        if rate == 0 || rate > RATE_MAX {
            return Some(format!("rate must be 1..={RATE_MAX} requests/s, got {rate}"));
        }
        if ramp_ms > RAMP_MS_MAX {
            return Some(format!(
                "ramp must reach the peak within {RAMP_MS_MAX} ms, got {ramp_ms}"
            ));
        }
        None
    }

    /// The steady (peak) rate.
    pub fn peak_per_s(&self) -> u64 {
        match *self {
            Profile::Constant { rate_per_s } => rate_per_s,
            Profile::Burst { peak_per_s, .. } => peak_per_s,
        }
    }

    /// Requests due in `[0, duration_ns)`, i.e. the number the run schedules.
    pub fn count_within(&self, duration_ns: u64) -> u64 {
        let t = duration_ns as f64 / 1e9;
        let n = match *self {
            Profile::Constant { rate_per_s } => rate_per_s as f64 * t,
            Profile::Burst { peak_per_s, ramp_ms } => {
                let peak = peak_per_s as f64;
                let ramp = ramp_ms as f64 / 1e3;
                if t <= ramp {
                    peak * t * t / (2.0 * ramp)
                } else {
                    peak * ramp / 2.0 + peak * (t - ramp)
                }
            }
        };
        // Request i is due at offset(i); those with offset < duration are i < ceil(n).
        n.ceil().max(0.0) as u64
    }

    /// When request `index` (0-based) is due, in nanoseconds from the start.
    pub fn offset_ns(&self, index: u64) -> u64 {
        match *self {
            // Integer arithmetic: request i lands exactly on the i-th grid point. In u64 while
            // `i × 10⁹` fits (any run under ~18 × 10⁹ requests): a u128 division is a library
            // call, and this runs once per request.
            Profile::Constant { rate_per_s } => match index.checked_mul(1_000_000_000) {
                Some(ns_x_rate) => ns_x_rate / rate_per_s,
                None => (u128::from(index) * 1_000_000_000 / u128::from(rate_per_s)) as u64,
            },
            Profile::Burst { peak_per_s, ramp_ms } => {
                let peak = peak_per_s as f64;
                let ramp = ramp_ms as f64 / 1e3;
                let i = index as f64;
                let in_ramp = peak * ramp / 2.0;
                let t = if i < in_ramp {
                    // N(t) = peak t² / (2 ramp)  ⇒  t = sqrt(2 ramp i / peak)
                    (2.0 * ramp * i / peak).sqrt()
                } else {
                    ramp + (i - in_ramp) / peak
                };
                (t * 1e9) as u64
            }
        }
    }
}

/// What one scheduled request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Intent {
    /// Index of this request in the schedule (its due time is `offset_ns(index)`).
    pub index: u64,
    /// Which request id it carries: the index of the intent that first used it. Equal to
    /// `index` for a new request; an earlier index for a duplicate.
    pub request_seq: u64,
    /// Which pre-minted user sends it (0-based into the pass table).
    pub user: u32,
    pub duplicate: bool,
}

/// The seeded sequence of intents.
pub struct Plan {
    rng: StdRng,
    users: u32,
    /// Probability of a duplicate in parts per million (integer: reproducible across
    /// platforms, no float rounding in the decision).
    duplicate_ppm: u32,
    /// The most recent new intents: (request_seq, user).
    recent: Vec<(u64, u32)>,
    recent_next: usize,
    next_index: u64,
}

impl Plan {
    /// `users` ≥ 1; `duplicate_ratio` in [0, 1].
    pub fn new(seed: u64, users: u32, duplicate_ratio: f64) -> Plan {
        assert!(users >= 1, "at least one user");
        assert!((0.0..=1.0).contains(&duplicate_ratio), "duplicate ratio in [0, 1]");
        Plan {
            rng: StdRng::seed_from_u64(seed),
            users,
            duplicate_ppm: (duplicate_ratio * 1e6).round() as u32,
            recent: Vec::with_capacity(DUPLICATE_WINDOW),
            recent_next: 0,
            next_index: 0,
        }
    }

    /// The next intent. A duplicate re-sends a random one of the last
    /// [`DUPLICATE_WINDOW`] new requests (same user, same request id); the very first
    /// request is always new.
    pub fn next_intent(&mut self) -> Intent {
        let index = self.next_index;
        self.next_index += 1;
        let roll = self.rng.gen_range(0..1_000_000u32);
        if roll < self.duplicate_ppm && !self.recent.is_empty() {
            let (request_seq, user) = self.recent[self.rng.gen_range(0..self.recent.len())];
            return Intent { index, request_seq, user, duplicate: true };
        }
        let user = self.rng.gen_range(0..self.users);
        if self.recent.len() < DUPLICATE_WINDOW {
            self.recent.push((index, user));
        } else {
            self.recent[self.recent_next] = (index, user);
            self.recent_next = (self.recent_next + 1) % DUPLICATE_WINDOW;
        }
        Intent { index, request_seq: index, user, duplicate: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_rate_is_a_fixed_grid() {
        let p = Profile::Constant { rate_per_s: 2_000 };
        for i in 0..10_000 {
            assert_eq!(p.offset_ns(i), i * 500_000);
        }
        assert_eq!(p.count_within(2_000_000_000), 4_000);
        assert_eq!(p.count_within(1), 1, "request 0 is due at 0");
        let odd = Profile::Constant { rate_per_s: 3 };
        assert_eq!(odd.offset_ns(1), 333_333_333);
        assert_eq!(odd.count_within(1_000_000_000), 3);
        // Either side of where `i × 10⁹` leaves u64, the grid is the exact u128 one.
        let edge = u64::MAX / 1_000_000_000;
        for rate_per_s in [1, 7, 10_000_000] {
            let p = Profile::Constant { rate_per_s };
            for i in [edge - 1, edge, edge + 1, edge + 2, u64::MAX / 2] {
                let exact = u128::from(i) * 1_000_000_000 / u128::from(rate_per_s);
                assert_eq!(u128::from(p.offset_ns(i)), exact & u128::from(u64::MAX), "{i}");
            }
        }
    }

    #[test]
    fn burst_reaches_peak_within_the_ramp_and_is_monotonic() {
        let p = Profile::Burst { peak_per_s: 10_000, ramp_ms: 500 };
        assert!(p.invalid_reason().is_none());
        // 10,000/s × 0.5 s / 2 = 2,500 requests in the ramp, then 10 per ms.
        assert_eq!(p.count_within(500_000_000), 2_500);
        assert_eq!(p.count_within(1_500_000_000), 12_500);
        let mut last = 0;
        for i in 0..20_000 {
            let t = p.offset_ns(i);
            assert!(t >= last, "offsets are monotonic");
            last = t;
        }
        // After the ramp the gap is exactly the peak's interval (100 µs), up to rounding.
        let gap = p.offset_ns(5_001) - p.offset_ns(5_000);
        assert!((99_000..=101_000).contains(&gap), "{gap}");
        // Half-way through the ramp a quarter of the ramp's requests are due: N ∝ t².
        assert_eq!(p.count_within(250_000_000), 625);
        assert!(Profile::Burst { peak_per_s: 1, ramp_ms: 1_001 }.invalid_reason().is_some());
        assert!(Profile::Constant { rate_per_s: 0 }.invalid_reason().is_some());
    }

    #[test]
    fn plan_is_reproducible_and_has_the_duplicate_share() {
        let take = |seed| {
            let mut plan = Plan::new(seed, 500, 0.10);
            (0..20_000).map(|_| plan.next_intent()).collect::<Vec<_>>()
        };
        let a = take(7);
        assert_eq!(a, take(7), "same seed, same plan");
        assert_ne!(a, take(8));
        let dups = a.iter().filter(|i| i.duplicate).count();
        assert!((1_800..=2_200).contains(&dups), "{dups} duplicates of 20,000");
        for (k, intent) in a.iter().enumerate() {
            assert_eq!(intent.index, k as u64);
            assert!(intent.user < 500);
            if intent.duplicate {
                // Re-sends an earlier new request of the same user with its id.
                let original = &a[intent.request_seq as usize];
                assert!(intent.request_seq < intent.index);
                assert!(!original.duplicate);
                assert_eq!(original.user, intent.user);
            } else {
                assert_eq!(intent.request_seq, intent.index);
            }
        }
        assert!(!a[0].duplicate);
        let mut none = Plan::new(1, 3, 0.0);
        assert!((0..1_000).all(|_| !none.next_intent().duplicate));
    }
}
