//! How long the `order-writer` backlog takes to drain (seed ch9 §7.8): "积压清空时间 = 当前积压量 /
//! (恢复后的消费速度 - 当前新增生产速度)；当消费速度小于等于生产速度时，积压无法清空". Sans-I/O: the
//! samples (time, backlog, messages ever published) are arguments; nothing here reads a clock.
//!
//! What it is: [`estimate`], the arithmetic, and [`DrainWindow`], the rates over the last
//! `window_ms` of the health poller's samples (a bounded ring: [`DRAIN_SAMPLES_MAX`]). The
//! consume rate is the rate at which messages leave the backlog: published minus still
//! pending, so a message counts as consumed once acknowledged, whatever its outcome.
//!
//! Where it is used (the seed's two decisions): `flashsale_backlog_drain_seconds` and
//! `/readyz`'s `backlog` detail feed the alert `FlashsaleBacklogNotDraining` (close new
//! reservations when the drain time is unacceptable, README runbook), and a mode snapshot that
//! reopens submissions (`RECOVERING`, `NORMAL`) is answered with the estimate, so the operator
//! who reopens sees whether the consumers outrun the producers (`shard/admin/modes.rs`).
//!
//! What it is not: the polling (`durable/health.rs`), admission (`admission.rs` reads the
//! backlog's age and count, not this estimate).

use std::collections::VecDeque;

/// Samples kept: at the 500 ms poll, 64 cover 32 s, more than any sensible window.
pub const DRAIN_SAMPLES_MAX: usize = 64;

/// One poll of the backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainSample {
    pub at_ms: u64,
    /// Messages published but not yet acknowledged (undelivered + in a worker's hands).
    pub backlog: u64,
    /// Messages ever published to the stream (its last sequence).
    pub produced_total: u64,
}

/// The drain time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DrainEstimate {
    /// Nothing to drain.
    Empty,
    /// Drains in this many seconds at the current rates.
    Seconds(f64),
    /// A backlog that does not shrink: consumers no faster than producers.
    Never,
    /// Not enough samples yet (or the stream was reset).
    Unknown,
}

impl DrainEstimate {
    /// The gauge's value: 0, the seconds, +Inf, NaN (comparisons with NaN are false, so an
    /// unknown estimate fires no alert; `BACKLOG_UNKNOWN` covers a silent poller).
    pub fn gauge(self) -> f64 {
        match self {
            DrainEstimate::Empty => 0.0,
            DrainEstimate::Seconds(s) => s,
            DrainEstimate::Never => f64::INFINITY,
            DrainEstimate::Unknown => f64::NAN,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DrainEstimate::Empty => "empty",
            DrainEstimate::Seconds(_) => "draining",
            DrainEstimate::Never => "not_draining",
            DrainEstimate::Unknown => "unknown",
        }
    }
}

/// `backlog / (consume − produce)`; [`DrainEstimate::Never`] when the consumers are no faster.
pub fn estimate(backlog: u64, consume_per_s: f64, produce_per_s: f64) -> DrainEstimate {
    if backlog == 0 {
        return DrainEstimate::Empty;
    }
    let net_per_s = consume_per_s - produce_per_s;
    if !net_per_s.is_finite() || net_per_s <= 0.0 {
        return DrainEstimate::Never;
    }
    DrainEstimate::Seconds(backlog as f64 / net_per_s)
}

/// The rates over the last `window_ms` of samples.
#[derive(Debug, Clone)]
pub struct DrainWindow {
    window_ms: u64,
    samples: VecDeque<DrainSample>,
}

/// Consume and produce rates (messages per second) and the drain estimate from them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrainRates {
    pub backlog: u64,
    pub consume_per_s: f64,
    pub produce_per_s: f64,
    pub estimate: DrainEstimate,
}

impl DrainWindow {
    pub fn new(window_ms: u64) -> DrainWindow {
        DrainWindow {
            window_ms: window_ms.max(1),
            samples: VecDeque::with_capacity(DRAIN_SAMPLES_MAX),
        }
    }

    /// Adds a sample; samples older than the window (but the one just before it, so the
    /// window is always spanned) and beyond the bound are dropped. A sample from the past or
    /// a stream whose sequence went back (recreated) starts over.
    pub fn push(&mut self, sample: DrainSample) {
        if let Some(last) = self.samples.back() {
            if sample.at_ms <= last.at_ms || sample.produced_total < last.produced_total {
                self.samples.clear();
            }
        }
        if self.samples.len() == DRAIN_SAMPLES_MAX {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
        let horizon = sample.at_ms.saturating_sub(self.window_ms);
        while self.samples.len() > 2 && self.samples[1].at_ms <= horizon {
            self.samples.pop_front();
        }
    }

    /// The rates between the oldest and the newest sample (unknown until they span at least
    /// a quarter of the window).
    pub fn rates(&self) -> DrainRates {
        let (Some(first), Some(last)) = (self.samples.front(), self.samples.back()) else {
            return DrainRates::unknown(0);
        };
        let span_ms = last.at_ms - first.at_ms;
        if span_ms == 0 || span_ms < self.window_ms / 4 {
            return DrainRates::unknown(last.backlog);
        }
        let seconds = span_ms as f64 / 1e3;
        let produced = (last.produced_total - first.produced_total) as f64;
        let consumed_at = |s: &DrainSample| s.produced_total.saturating_sub(s.backlog) as f64;
        let consumed = (consumed_at(last) - consumed_at(first)).max(0.0);
        let (consume_per_s, produce_per_s) = (consumed / seconds, produced / seconds);
        DrainRates {
            backlog: last.backlog,
            consume_per_s,
            produce_per_s,
            estimate: estimate(last.backlog, consume_per_s, produce_per_s),
        }
    }
}

/// The window the health poller uses: 10 s, twenty samples at the 500 ms poll — long enough
/// that one slow fetch does not read as a stall, short enough to see a recovery within it.
pub const DRAIN_WINDOW_MS: u64 = 10_000;

impl Default for DrainWindow {
    fn default() -> DrainWindow {
        DrainWindow::new(DRAIN_WINDOW_MS)
    }
}

impl DrainRates {
    fn unknown(backlog: u64) -> DrainRates {
        let estimate = if backlog == 0 { DrainEstimate::Empty } else { DrainEstimate::Unknown };
        DrainRates { backlog, consume_per_s: f64::NAN, produce_per_s: f64::NAN, estimate }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_seed_formula() {
        assert_eq!(estimate(0, 0.0, 100.0), DrainEstimate::Empty);
        assert_eq!(estimate(6_000, 4_000.0, 1_000.0), DrainEstimate::Seconds(2.0));
        assert_eq!(estimate(10, 100.0, 100.0), DrainEstimate::Never, "equal rates never drain");
        assert_eq!(estimate(10, 50.0, 100.0), DrainEstimate::Never);
        assert_eq!(estimate(10, f64::NAN, 0.0), DrainEstimate::Never);
        assert!(DrainEstimate::Never.gauge().is_infinite());
        assert!(DrainEstimate::Unknown.gauge().is_nan());
    }

    #[test]
    fn rates_come_from_the_window() {
        let mut w = DrainWindow::new(10_000);
        assert_eq!(w.rates().estimate, DrainEstimate::Empty);
        // 1,000 produced/s, 3,000 consumed/s: the backlog of 8,000 falls 2,000 a second.
        for i in 0..=10u64 {
            let backlog = 8_000 + 2_000 * (10 - i);
            w.push(DrainSample { at_ms: 1_000 * i, backlog, produced_total: 50_000 + 1_000 * i });
        }
        let r = w.rates();
        assert!((r.produce_per_s - 1_000.0).abs() < 1e-9, "{r:?}");
        assert!((r.consume_per_s - 3_000.0).abs() < 1e-9, "{r:?}");
        assert_eq!(r.estimate, DrainEstimate::Seconds(4.0));
        // A recreated stream (the sequence went back) starts over: unknown again.
        w.push(DrainSample { at_ms: 11_000, backlog: 5, produced_total: 5 });
        assert_eq!(w.rates().estimate, DrainEstimate::Unknown);
    }

    #[test]
    fn the_ring_is_bounded_and_spans_the_window() {
        let mut w = DrainWindow::new(5_000);
        for i in 0..1_000u64 {
            w.push(DrainSample { at_ms: 100 * i, backlog: 10, produced_total: i });
            assert!(w.samples.len() <= DRAIN_SAMPLES_MAX);
        }
        let span = w.samples.back().unwrap().at_ms - w.samples.front().unwrap().at_ms;
        assert!((5_000..=5_100).contains(&span), "{span}");
    }

    proptest! {
        /// Against the model: seconds × (consume − produce) = backlog; never negative; Never
        /// exactly when the consumers are no faster; more backlog never drains sooner.
        #[test]
        fn estimate_matches_the_model(
            backlog in 0u64..10_000_000,
            consume in 0.0f64..1e6,
            produce in 0.0f64..1e6,
            more in 0u64..1_000_000,
        ) {
            match estimate(backlog, consume, produce) {
                DrainEstimate::Empty => prop_assert_eq!(backlog, 0),
                DrainEstimate::Never => prop_assert!(backlog > 0 && consume <= produce),
                DrainEstimate::Seconds(s) => {
                    prop_assert!(backlog > 0 && consume > produce && s > 0.0);
                    let back = s * (consume - produce);
                    prop_assert!((back - backlog as f64).abs() <= 1e-6 * backlog as f64);
                    match estimate(backlog + more, consume, produce) {
                        DrainEstimate::Seconds(t) => prop_assert!(t >= s),
                        other => prop_assert!(false, "{:?}", other),
                    }
                }
                DrainEstimate::Unknown => prop_assert!(false, "the arithmetic always knows"),
            }
        }

        /// Rates from any steady pipeline are recovered from its samples.
        #[test]
        fn steady_rates_are_recovered(
            produce in 0u64..5_000,
            consume in 0u64..5_000,
            start_backlog in 0u64..100_000,
        ) {
            let mut w = DrainWindow::new(10_000);
            let mut backlog = start_backlog as i64;
            for i in 0..=20u64 {
                let sample = DrainSample {
                    at_ms: 500 * i,
                    backlog: backlog.max(0) as u64,
                    produced_total: 1_000_000 + produce * i / 2,
                };
                w.push(sample);
                backlog += (produce as i64 - consume as i64) / 2;
            }
            let r = w.rates();
            prop_assert!((r.produce_per_s - produce as f64).abs() <= 2.0);
            if backlog > 0 && start_backlog as i64 > (consume as i64) * 10 {
                prop_assert!((r.consume_per_s - consume as f64).abs() <= 2.0, "{:?}", r);
            }
        }
    }
}
