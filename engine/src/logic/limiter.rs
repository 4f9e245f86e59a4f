//! Per-user and per-client-address rate limits of the public API (`RATE_LIMITED`, CONTRACT.md
//! 3.2). Sans-I/O: time is an argument.
//!
//! Memory is fixed: a table of token buckets indexed by a hash of the key. Two keys that
//! collide share a bucket — at worst an innocent user is limited a little early when the table
//! is crowded, never a flood let through — so no map grows with the number of attackers and
//! nothing needs eviction. Each shard has its own limiter (no sharing between cores); a client
//! spread over shards gets each shard's allowance, which the per-shard rates account for.

/// One bucket: whole tokens scaled by 1000 to refill at sub-token precision.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    tokens_milli: u64,
    refilled_ms: u64,
    used: bool,
}

/// Rate and burst of one limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub per_s: u32,
    pub burst: u32,
}

/// At most one event per `every_ms` passes (a log line per second, say); the others are
/// counted and reported with the next one that passes.
#[derive(Debug, Clone, Copy)]
pub struct Throttle {
    every_ms: u64,
    last_ms: Option<u64>,
    suppressed: u64,
}

impl Throttle {
    pub const fn new(every_ms: u64) -> Throttle {
        Throttle { every_ms, last_ms: None, suppressed: 0 }
    }

    /// `Some(suppressed since the last one)` when this event may pass; `None` otherwise.
    pub fn allow(&mut self, now_ms: u64) -> Option<u64> {
        match self.last_ms {
            Some(last) if now_ms.saturating_sub(last) < self.every_ms => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last_ms = Some(now_ms);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// A fixed-size table of token buckets.
#[derive(Debug)]
pub struct Limiter {
    rate: Rate,
    buckets: Box<[Bucket]>,
}

impl Limiter {
    /// `slots` buckets (rounded up to a power of two).
    pub fn new(rate: Rate, slots: usize) -> Limiter {
        assert!(rate.burst > 0, "a burst of 0 would refuse everything");
        let slots = slots.max(1).next_power_of_two();
        Limiter { rate, buckets: vec![Bucket::default(); slots].into_boxed_slice() }
    }

    /// Takes one token for `key`; `Err(retry_after_ms)` when its bucket is empty.
    pub fn check(&mut self, key: u64, now_ms: u64) -> Result<(), u64> {
        let index = (mix(key) as usize) & (self.buckets.len() - 1);
        let cap = u64::from(self.rate.burst) * 1000;
        let bucket = &mut self.buckets[index];
        if !bucket.used {
            *bucket = Bucket { tokens_milli: cap, refilled_ms: now_ms, used: true };
        }
        let elapsed = now_ms.saturating_sub(bucket.refilled_ms);
        bucket.tokens_milli =
            bucket.tokens_milli.saturating_add(u64::from(self.rate.per_s) * elapsed).min(cap);
        bucket.refilled_ms = now_ms;
        if bucket.tokens_milli >= 1000 {
            bucket.tokens_milli -= 1000;
            Ok(())
        } else if self.rate.per_s == 0 {
            Err(1000)
        } else {
            let missing = 1000 - bucket.tokens_milli;
            Err(missing.div_ceil(u64::from(self.rate.per_s)).max(1))
        }
    }
}

/// splitmix64's finaliser: spreads sequential user ids over the table.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A user id as it may appear in logs and spans: not reversible at a glance, stable within
/// and across processes so one buyer's lines can be followed. THE hash lives with the
/// exported spans (`flashsale_io::trace::user_id_hash`, the worker's too): one value per
/// buyer in log lines and traces alike.
pub fn hash_user(user_id: u64) -> u64 {
    flashsale_io::trace::user_id_hash(user_id)
}

/// A client address as a limiter key (IPv4 and IPv6 alike).
pub fn ip_key(ip: std::net::IpAddr) -> u64 {
    match ip {
        std::net::IpAddr::V4(v4) => u64::from(u32::from(v4)),
        // /64: one customer network, not one address of its many.
        std::net::IpAddr::V6(v6) => (u128::from(v6) >> 64) as u64 ^ 0x6_0000_0000,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn burst_then_refill() {
        let mut l = Limiter::new(Rate { per_s: 10, burst: 3 }, 16);
        for _ in 0..3 {
            assert_eq!(l.check(7, 0), Ok(()));
        }
        assert_eq!(l.check(7, 0), Err(100), "one token takes 100 ms at 10/s");
        assert_eq!(l.check(7, 50), Err(50));
        assert_eq!(l.check(7, 100), Ok(()));
        // Another key has its own bucket (16 slots, no collision for 7 vs 8 after mixing).
        assert_eq!(l.check(8, 100), Ok(()));
    }

    proptest! {
        /// Over any window, one key never gets more than burst + rate × elapsed tokens.
        #[test]
        fn never_exceeds_rate(times in proptest::collection::vec(0u64..50, 1..300)) {
            let rate = Rate { per_s: 20, burst: 5 };
            let mut l = Limiter::new(rate, 8);
            let mut now = 0;
            let mut granted = 0u64;
            for dt in times {
                now += dt;
                if l.check(42, now).is_ok() { granted += 1; }
            }
            prop_assert!(granted <= u64::from(rate.burst) + u64::from(rate.per_s) * now / 1000 + 1);
        }
    }

    #[test]
    fn a_throttle_lets_one_event_per_period_through_and_counts_the_rest() {
        let mut t = Throttle::new(1_000);
        assert_eq!(t.allow(10), Some(0));
        assert_eq!(t.allow(500), None);
        assert_eq!(t.allow(1_009), None);
        assert_eq!(t.allow(1_010), Some(2));
        assert_eq!(t.allow(5_000), Some(0));
    }
}
