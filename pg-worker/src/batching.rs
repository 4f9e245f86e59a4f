//! How many deliveries an order-writer asks for next, decided without I/O.
//!
//! What it is: [`FetchSizer`]. A pull returns at once with whatever is waiting, up to the
//! ask, and only an empty consumer makes it wait (for ONE message, `io::jetstream::PullSource::
//! fetch`), so a lone message is never held back to fill a batch whatever the ask. The ask
//! therefore only matters under a backlog, and there it is the batch size (one pull is one
//! set-based transaction): it doubles after every pull that came back full (more was waiting)
//! up to `fetch_max`, and after a short pull (the backlog is drained) falls back to what came,
//! but not below `fetch_min`. So the batch follows the backlog: small and immediate when idle,
//! `fetch_max` within a few pulls of a burst's start.
//!
//! Why not always ask `fetch_max`: after an idle spell the first pulls of a burst would each
//! take everything there is, leaving the other writers idle while one long transaction runs
//! (and the first orders of the burst commit only after it); growing from `fetch_min` starts
//! every writer with a short transaction and reaches the bound after log2(max/min) pulls.
//!
//! What it is not: the pull itself (`worker/order_writer_task.rs`), nor the bounds'
//! validation (`worker/config.rs`, `WorkerConfig::validate`).

/// The next pull's size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchSizer {
    min: usize,
    max: usize,
    ask: usize,
}

impl FetchSizer {
    /// Asks `min` first. `1 <= min <= max` (checked by `WorkerConfig::validate`; clamped here
    /// so a sizer is always usable).
    pub fn new(min: usize, max: usize) -> FetchSizer {
        let max = max.max(1);
        let min = min.clamp(1, max);
        FetchSizer { min, max, ask: min }
    }

    /// Deliveries to ask for now, within `min..=max`.
    pub fn ask(&self) -> usize {
        self.ask
    }

    /// After a pull that asked [`FetchSizer::ask`] and got `pulled`.
    pub fn observe(&mut self, pulled: usize) {
        self.ask = if pulled >= self.ask {
            self.ask.saturating_mul(2).min(self.max)
        } else {
            pulled.clamp(self.min, self.max)
        };
        debug_assert!((self.min..=self.max).contains(&self.ask));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_burst_grows_the_ask_to_the_bound_and_idling_shrinks_it() {
        let mut sizer = FetchSizer::new(32, 512);
        let mut asks = Vec::new();
        for _ in 0..6 {
            asks.push(sizer.ask());
            let full = sizer.ask();
            sizer.observe(full);
        }
        assert_eq!(asks, [32, 64, 128, 256, 512, 512]);
        sizer.observe(300);
        assert_eq!(sizer.ask(), 300);
        sizer.observe(1);
        assert_eq!(sizer.ask(), 32, "never below the floor");
        sizer.observe(0);
        assert_eq!(sizer.ask(), 32);
    }

    #[test]
    fn bad_bounds_are_clamped() {
        assert_eq!(FetchSizer::new(0, 0).ask(), 1);
        assert_eq!(FetchSizer::new(64, 8).ask(), 8);
    }

    proptest! {
        #[test]
        fn the_ask_stays_within_its_bounds(min in 1usize..64, extra in 0usize..1024, pulls in proptest::collection::vec(0usize..2048, 0..64)) {
            let max = min + extra;
            let mut sizer = FetchSizer::new(min, max);
            for pulled in pulls {
                // A pull never returns more than it asked for.
                sizer.observe(pulled.min(sizer.ask()));
                prop_assert!((min..=max).contains(&sizer.ask()));
            }
        }
    }
}
