//! Adaptive admission to the expensive path (DESIGN.md section 7, issue 24): how many
//! submissions an accepting shard lets into the path that needs Redis and the log at once,
//! found from what that path's latency does, and the readiness that tells a balancer when the
//! instance stays overloaded.
//!
//! # Why a limit that finds itself
//!
//! A flash sale is overload by definition: while units remain, more buyers arrive than the
//! expensive path (a `reserve` call, then the publish and its ack) can finish. Whatever it
//! cannot finish waits somewhere — in the shard, in Redis' pipeline, in the log — and every
//! answer behind it waits too (measured: P99 of all answers 2–4 s with a fixed in-flight
//! bound that never fired). A fixed bound is no answer either: the right number differs by
//! machine and by moment (a static 48 made P99 worse, and its refusals waited in the same
//! queues). So each accepting shard keeps a concurrency limit and answers the rest
//! `OVERLOADED` at once, on the accepting core, before anything is forwarded or reserved, at
//! the cost of the sold-out path.
//!
//! # Which algorithm, and why
//!
//! The limit follows the expensive path's own latency against a target, AIMD in the way of
//! TCP Vegas and Netflix's concurrency-limits (Gradient2), with CoDel's rule that what counts
//! is the time a request spends in the system, not how many wait:
//! - every `window_ms`, the mean latency of the path's completions in the window is compared
//!   with `target_ms` (the share of the 100 ms answer SLO the path may use);
//! - above it, the limit shrinks by the ratio target/mean, bounded to [0.5, 0.9] per window
//!   (multiplicative decrease: a queue drains in a few windows, and one slow window cannot
//!   collapse it to the floor);
//! - at or below it, and only if the limit was actually reached in the window (there was more
//!   demand than it admitted), the limit grows by √limit (Vegas' additive step: quick from a
//!   small limit, cautious near a large one). An unused limit does not grow, so a quiet
//!   period never leaves a limit far above what the path can take;
//! - a window with requests in flight and not one completion counts as latency of a whole
//!   window: a stalled path shrinks the limit without waiting for answers that do not come;
//! - the order writer's backlog is a second signal: while its oldest pending message is older
//!   than `backlog_age_soft_ms`, the limit only shrinks (×0.9 per window). Admission then
//!   matches what PostgreSQL drains, with `OVERLOADED` answers, long before the backlog's hard
//!   budget (`admission.rs`, `BACKLOG_AGE`) would close submissions with `SUBMIT_CLOSED` while
//!   stock remains.
//!
//! Envoy's adaptive concurrency measures a minimum RTT in periodic pauses of traffic and
//! sheds by gradient against it; a flash sale's path has no quiet moment to measure in, and
//! the SLO gives the target directly, so the absolute target is simpler and needs no pauses.
//!
//! # Readiness
//!
//! A limit pinned at `limit_min` for `unready_after_ms`, with demand beyond it in every
//! window, means the path is slow even with almost nothing admitted: the instance is sick or
//! starved, and `/readyz` (and the public health path) fail so that an L4 balancer moves new
//! connections elsewhere (seed ch9: 本地限流、摘除过载实例). It is ready again only after `ready_after_ms` off the floor: the two
//! delays are the hysteresis that keeps readiness from flapping with the limit.
//!
//! Sans-I/O: time is an argument, nothing here reads a clock, blocks or allocates.
//!
//! Not here: the per-SKU admission bucket and in-flight bound (`partition.rs`), the
//! dependency gates (`admission.rs`), the per-user and per-address limits (`limiter.rs`).

/// The limiter's settings; see the module documentation for what each does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverloadConfig {
    /// The expensive path's mean latency the limit aims at.
    pub target_ms: u64,
    /// How often the limit is adjusted.
    pub window_ms: u64,
    pub limit_min: u32,
    pub limit_max: u32,
    pub limit_initial: u32,
    /// Above this age of the order writer's oldest pending message the limit only shrinks.
    pub backlog_age_soft_ms: u64,
    /// `Retry-After` base of an `OVERLOADED` answer (jittered over [base, 1.5 × base)).
    pub retry_ms: u64,
    /// At the floor this long: not ready.
    pub unready_after_ms: u64,
    /// Off the floor this long: ready again.
    pub ready_after_ms: u64,
}

impl Default for OverloadConfig {
    fn default() -> OverloadConfig {
        OverloadConfig {
            // A quarter of the 100 ms SLO: the path's answer waits for Redis and the log's
            // ack, and what is left covers the connection's queue and the client's side.
            target_ms: 25,
            window_ms: 100,
            limit_min: 4,
            limit_max: 4_096,
            limit_initial: 64,
            // Half of the backlog's hard budget (admission.rs: 1,500 ms).
            backlog_age_soft_ms: 750,
            retry_ms: 250,
            unready_after_ms: 2_000,
            ready_after_ms: 5_000,
        }
    }
}

impl OverloadConfig {
    /// The same bounds with the limit fixed at `limit_max`: no adaptation, no shedding below
    /// it and no readiness by it (`[overload] enabled = false`, the default: README
    /// "Admission" has the demo A/B that made it so).
    pub fn pinned(self) -> OverloadConfig {
        OverloadConfig { limit_min: self.limit_max, limit_initial: self.limit_max, ..self }
    }

    /// Bounds that contradict each other are refused at start-up.
    pub fn validate(&self) -> Result<(), String> {
        if self.limit_min == 0 || self.limit_min > self.limit_max {
            return Err("limit_min must be at least 1 and at most limit_max".into());
        }
        if !(self.limit_min..=self.limit_max).contains(&self.limit_initial) {
            return Err("limit_initial must be within limit_min..=limit_max".into());
        }
        if self.target_ms == 0 || self.window_ms == 0 || self.retry_ms == 0 {
            return Err("target_ms, window_ms and retry_ms must be at least 1".into());
        }
        Ok(())
    }
}

/// Proof of a place on the expensive path; owed back to [`AdaptiveLimit::complete`].
#[derive(Debug)]
#[must_use = "a permit must be completed, or the limit leaks a place"]
pub struct Permit {
    _private: (),
}

/// The expensive path's limit on one accepting shard.
#[derive(Debug, Clone)]
pub struct AdaptiveLimit {
    config: OverloadConfig,
    limit: f64,
    in_flight: u32,
    window: Window,
    readiness: Readiness,
    admitted_total: u64,
    shed_total: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Window {
    started_ms: u64,
    latency_sum_us: u64,
    completions: u32,
    /// The limit was reached (a request shed, or in flight at the limit) in this window.
    saturated: bool,
}

#[derive(Debug, Clone, Copy)]
struct Readiness {
    ready: bool,
    /// When the limit reached the floor (None: not at the floor).
    floor_since_ms: Option<u64>,
    /// When the limit left the floor (None: at the floor).
    off_floor_since_ms: Option<u64>,
}

impl AdaptiveLimit {
    pub fn new(config: OverloadConfig, now_ms: u64) -> AdaptiveLimit {
        if let Err(why) = config.validate() {
            panic!("invalid OverloadConfig: {why}");
        }
        AdaptiveLimit {
            config,
            limit: f64::from(config.limit_initial),
            in_flight: 0,
            window: Window { started_ms: now_ms, ..Window::default() },
            readiness: Readiness {
                ready: true,
                floor_since_ms: None,
                off_floor_since_ms: Some(now_ms),
            },
            admitted_total: 0,
            shed_total: 0,
        }
    }

    /// A place on the expensive path, or `Err(retry_after_ms)`: answer `OVERLOADED` now.
    /// `draw` (random) jitters the Retry-After.
    pub fn try_acquire(&mut self, draw: u32) -> Result<Permit, u64> {
        if self.in_flight >= self.limit() {
            self.window.saturated = true;
            self.shed_total += 1;
            let jitter = u64::from(draw) % (self.config.retry_ms / 2).max(1);
            return Err(self.config.retry_ms + jitter);
        }
        self.in_flight += 1;
        if self.in_flight >= self.limit() {
            self.window.saturated = true;
        }
        self.admitted_total += 1;
        Ok(Permit { _private: () })
    }

    /// The path answered after `latency_us` (from the acquire to the answer).
    pub fn complete(&mut self, permit: Permit, latency_us: u64) {
        let Permit { .. } = permit;
        assert!(self.in_flight > 0, "a permit completed that was never acquired");
        self.in_flight -= 1;
        self.window.latency_sum_us = self.window.latency_sum_us.saturating_add(latency_us);
        self.window.completions += 1;
    }

    /// Adjusts the limit when a window has passed. `backlog_age_ms`: the order writer's
    /// oldest pending message as last polled. Cheap when called on every request.
    pub fn tick(&mut self, now_ms: u64, backlog_age_ms: u64) {
        let elapsed = now_ms.saturating_sub(self.window.started_ms);
        if elapsed < self.config.window_ms {
            return;
        }
        let saturated = self.in_flight >= self.limit();
        let fresh = Window { started_ms: now_ms, saturated, ..Window::default() };
        let window = std::mem::replace(&mut self.window, fresh);
        self.limit = self.next_limit(&window, elapsed, backlog_age_ms);
        self.readiness_after(now_ms, window.saturated);
    }

    fn next_limit(&self, window: &Window, elapsed_ms: u64, backlog_age_ms: u64) -> f64 {
        let config = &self.config;
        let (min, max) = (f64::from(config.limit_min), f64::from(config.limit_max));
        let target_us = (config.target_ms * 1_000) as f64;
        let mean_us = match window.completions {
            // Requests in flight and none came back in a whole window: that long, at least.
            0 if self.in_flight > 0 => (elapsed_ms * 1_000) as f64,
            0 => return self.limit,
            n => window.latency_sum_us as f64 / f64::from(n),
        };
        let next = if mean_us > target_us {
            self.limit * (target_us / mean_us).clamp(0.5, 0.9)
        } else if backlog_age_ms > config.backlog_age_soft_ms {
            self.limit * 0.9
        } else if window.saturated {
            self.limit + self.limit.sqrt().max(1.0)
        } else {
            self.limit
        };
        next.clamp(min, max)
    }

    /// `saturated`: the window that just closed had more demand than the limit admitted.
    fn readiness_after(&mut self, now_ms: u64, saturated: bool) {
        // Overloaded is the floor with demand beyond it. A floor without demand (the path's
        // dependency failed and its circuit answers instead, or a quiet moment after a storm)
        // is not this instance's overload: readiness must not move a fleet-wide dependency
        // fault onto the balancer. A limit that cannot move (limit_min = limit_max:
        // adaptation off) says nothing either.
        let pinned = self.config.limit_min == self.config.limit_max;
        let at_floor = !pinned && saturated && self.limit() <= self.config.limit_min;
        let r = &mut self.readiness;
        if at_floor {
            r.off_floor_since_ms = None;
            let since = *r.floor_since_ms.get_or_insert(now_ms);
            if now_ms.saturating_sub(since) >= self.config.unready_after_ms {
                r.ready = false;
            }
        } else {
            r.floor_since_ms = None;
            let since = *r.off_floor_since_ms.get_or_insert(now_ms);
            if now_ms.saturating_sub(since) >= self.config.ready_after_ms {
                r.ready = true;
            }
        }
    }

    /// The current limit (whole places).
    pub fn limit(&self) -> u32 {
        self.limit as u32
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// False while the limit has stayed at its floor (see the module documentation).
    pub fn ready(&self) -> bool {
        self.readiness.ready
    }

    /// Admitted and shed since start.
    pub fn totals(&self) -> (u64, u64) {
        (self.admitted_total, self.shed_total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn config() -> OverloadConfig {
        OverloadConfig::default()
    }

    /// Drives `windows` windows: `demand` requests offered per window, each completing at
    /// `latency_ms` within the window it was admitted in.
    fn drive(l: &mut AdaptiveLimit, now: &mut u64, windows: u32, demand: u32, latency_ms: u64) {
        for _ in 0..windows {
            let mut permits = Vec::new();
            for i in 0..demand {
                if let Ok(p) = l.try_acquire(i) {
                    permits.push(p);
                }
            }
            for p in permits {
                l.complete(p, latency_ms * 1_000);
            }
            *now += l.config.window_ms;
            l.tick(*now, 0);
        }
    }

    #[test]
    fn a_fast_path_under_demand_raises_the_limit_to_meet_it() {
        let mut now = 0;
        let mut l = AdaptiveLimit::new(config(), now);
        // √limit per window: 64 -> ~500 in 3 s, past 1,000 in 6 s.
        drive(&mut l, &mut now, 60, 2_000, 5);
        assert!(l.limit() >= 1_000, "{}", l.limit());
        assert!(l.ready());
    }

    #[test]
    fn an_unused_limit_does_not_grow() {
        let mut now = 0;
        let mut l = AdaptiveLimit::new(config(), now);
        drive(&mut l, &mut now, 50, 10, 5);
        assert_eq!(l.limit(), 64);
    }

    #[test]
    fn a_slow_path_shrinks_the_limit_and_sheds_the_rest_at_once() {
        let mut now = 0;
        let mut l = AdaptiveLimit::new(config(), now);
        drive(&mut l, &mut now, 30, 2_000, 5);
        let high = l.limit();
        drive(&mut l, &mut now, 3, 2_000, 100);
        assert!(l.limit() <= high / 4, "{high} -> {}", l.limit());
        // Shed answers carry a jittered Retry-After in [base, 1.5 × base).
        let mut held = Vec::new();
        while let Ok(p) = l.try_acquire(0) {
            held.push(p);
        }
        for draw in [0, 1, 77, u32::MAX] {
            let retry = l.try_acquire(draw).expect_err("full");
            assert!((250..375).contains(&retry), "{retry}");
        }
        for p in held {
            l.complete(p, 1_000);
        }
    }

    #[test]
    fn a_stalled_path_shrinks_without_answers() {
        let mut now = 0;
        let mut l = AdaptiveLimit::new(config(), now);
        let held: Vec<_> = (0..64).map(|_| l.try_acquire(0).unwrap()).collect();
        for _ in 0..10 {
            now += 100;
            l.tick(now, 0);
        }
        assert_eq!(l.limit(), config().limit_min);
        for p in held {
            l.complete(p, 1_000_000);
        }
    }

    #[test]
    fn an_old_backlog_only_shrinks_the_limit() {
        let mut now = 0;
        let mut l = AdaptiveLimit::new(config(), now);
        for _ in 0..20 {
            for i in 0..500 {
                if let Ok(p) = l.try_acquire(i) {
                    l.complete(p, 2_000);
                }
            }
            now += 100;
            l.tick(now, 1_000);
        }
        assert!(l.limit() < 64, "{}", l.limit());
    }

    #[test]
    fn readiness_fails_only_when_pinned_at_the_floor_and_returns_with_hysteresis() {
        let mut now = 0;
        let mut l = AdaptiveLimit::new(config(), now);
        // Alternating slow and fast windows never stay at the floor long: no flapping.
        for round in 0..40 {
            let latency = if round % 2 == 0 { 200 } else { 1 };
            drive(&mut l, &mut now, 1, 200, latency);
            assert!(l.ready(), "round {round}: limit {}", l.limit());
        }
        // Slow for good: at the floor, then not ready after unready_after_ms.
        drive(&mut l, &mut now, 10, 200, 500);
        assert_eq!(l.limit(), config().limit_min);
        let floor_at = now;
        while now < floor_at + config().unready_after_ms + 200 {
            drive(&mut l, &mut now, 1, 200, 500);
        }
        assert!(!l.ready());
        // Fast again: off the floor at once, ready only after ready_after_ms.
        drive(&mut l, &mut now, 1, 200, 1);
        let off_at = now;
        while now < off_at + config().ready_after_ms - 200 {
            drive(&mut l, &mut now, 1, 200, 1);
            assert!(!l.ready(), "not before the hysteresis");
        }
        drive(&mut l, &mut now, 4, 200, 1);
        assert!(l.ready());
    }

    #[test]
    fn a_floor_without_demand_is_not_overload() {
        let mut now = 0;
        let mut l = AdaptiveLimit::new(config(), now);
        drive(&mut l, &mut now, 10, 200, 500);
        assert_eq!(l.limit(), config().limit_min);
        // The dependency's circuit answers instead: nothing reaches the path for a long time.
        drive(&mut l, &mut now, 100, 0, 0);
        assert!(l.ready(), "an idle floor must not fail readiness");
        assert_eq!(l.limit(), config().limit_min, "an unused limit does not grow");
    }

    #[test]
    fn a_pinned_limit_never_fails_readiness() {
        let pinned = OverloadConfig { limit_min: 8, limit_max: 8, limit_initial: 8, ..config() };
        let mut now = 0;
        let mut l = AdaptiveLimit::new(pinned, now);
        drive(&mut l, &mut now, 100, 200, 500);
        assert!(l.ready());
        assert_eq!(l.limit(), 8);
    }

    proptest! {
        /// Whatever happens, the limit stays within its bounds, nothing is admitted over the
        /// limit of the moment, and every admitted request is counted once.
        #[test]
        fn bounds_hold_for_any_history(
            steps in proptest::collection::vec((0u32..300, 0u64..300, 0u64..2_000, 1u64..250), 1..60)
        ) {
            let mut now = 0;
            let mut l = AdaptiveLimit::new(config(), now);
            let (mut held, mut admitted) = (Vec::new(), 0u64);
            for (demand, latency_ms, backlog_ms, advance_ms) in steps {
                for i in 0..demand {
                    match l.try_acquire(i) {
                        Ok(p) => {
                            held.push(p);
                            admitted += 1;
                            prop_assert!(l.in_flight() <= l.limit(), "admitted over the limit");
                        }
                        Err(retry) => prop_assert!(retry >= config().retry_ms),
                    }
                }
                // Half of what is held completes.
                let keep = held.len() / 2;
                for p in held.drain(keep..) {
                    l.complete(p, latency_ms * 1_000);
                }
                now += advance_ms;
                l.tick(now, backlog_ms);
                prop_assert!((config().limit_min..=config().limit_max).contains(&l.limit()));
            }
            prop_assert_eq!(l.totals().0, admitted);
            for p in held {
                l.complete(p, 0);
            }
            prop_assert_eq!(l.in_flight(), 0);
        }
    }
}
