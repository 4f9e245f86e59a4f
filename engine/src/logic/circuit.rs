//! A circuit breaker per dependency (a Redis node, the log publisher, PostgreSQL) and the
//! bounded retry policy (DESIGN.md section 7; seed chapter 9 §7.4 and §10.3: 有界重试与熔断).
//! Sans-I/O: time and randomness are arguments; nothing here sleeps, spawns or reads a clock.
//!
//! What it is:
//! - [`Circuit`]: `Closed` → `Open` → `HalfOpen` → `Closed` | `Open`.
//!   - **Opens** on EITHER of two rules, both kept in fixed memory: `consecutive_failures_max`
//!     failures in a row (a dependency that is down: connection refused, every call times
//!     out — trips within a handful of calls), OR at least `window_failure_percent_max` % of
//!     the last `window_len` calls failed, once the window holds `window_calls_min` calls (a
//!     flaky dependency that still answers some calls and would never produce a long streak).
//!     The window is a 64-bit shift register of the last ≤ 64 outcomes: O(1) per call, no
//!     allocation, no timestamps.
//!   - **Open** rejects at once with `retry_after_ms` = the time left, for `open_ms` the first
//!     time; each failed half-open period doubles it, up to `open_max_ms` (a dependency that
//!     keeps failing its probes is probed less and less often, but never more than
//!     `open_max_ms` apart, so recovery is noticed within that bound).
//!   - **HalfOpen** (entered lazily, by the first [`Circuit::allow`] after the open time)
//!     admits at most `half_open_probes` calls; when all of them succeed → `Closed`; any
//!     failure → `Open` again (longer). Probes that are never recorded (a caller that lost
//!     its [`Call`]) count as failed after `probe_timeout_ms`, so the breaker cannot stay
//!     half-open forever.
//! - [`CallOutcome::Unknown`] (a timeout after the request was written) **counts as a
//!   failure**: it is the signature of an overloaded or partitioned dependency, and the
//!   breaker judges health, not business outcome. Whether the operation ran (the caller then
//!   answers `UNKNOWN` and never releases stock) is the caller's concern, unaffected by this.
//!   A business answer (`SOLD_OUT`, a unique violation) is a `Success`: the dependency worked.
//! - Results are matched to the state that admitted them: [`Circuit::allow`] hands out a
//!   [`Call`] stamped with an epoch that changes at every transition, and
//!   [`Circuit::record`] ignores a result from an earlier epoch. Without that, the successes
//!   of calls admitted before the breaker opened could close a half-open breaker that has
//!   not probed anything yet, and a backlog of stale failures could re-open a breaker that
//!   just closed. (This is why `record` takes the `Call` back.)
//! - [`RetryPolicy`]: bounded attempts, a total time budget, exponential backoff with FULL
//!   jitter (delay uniform in `[0, min(delay_max, base × 2^(n-1))]`: retries of many clients
//!   spread out instead of arriving in synchronized waves). **For idempotent operations
//!   only**: a `reserve` retried with the same request id, a republish with the same message
//!   id (`Nats-Msg-Id` dedup), a PostgreSQL transaction that is all-or-nothing and guarded by
//!   the inbox, reads, `FUNCTION LOAD`. Never for anything that would take effect twice. A
//!   retry goes through [`Circuit::allow`] like any call: once open, no real call is made.
//!
//! What it is not: the driver (the connection code calls `allow`/`record` around each call
//! and sleeps the retry delays), nor the admission rule that reads the state
//! (`admission.rs`). Metrics: [`CircuitState::metric_value`], [`Circuit::opened_count`].
//!
//! Read next: `admission.rs`.

/// Most outcomes the sliding window remembers (bits of its shift register).
pub const WINDOW_LEN_MAX: u32 = 64;
/// Most probes per half-open period.
pub const HALF_OPEN_PROBES_MAX: u32 = 1_024;
/// Longest open time and retry delay accepted in a configuration (one hour).
pub const DELAY_MS_MAX: u64 = 3_600_000;

/// Thresholds and times of one breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircuitConfig {
    /// Failures in a row that open the breaker.
    pub consecutive_failures_max: u32,
    /// Calls the failure-ratio window covers (1..=64).
    pub window_len: u32,
    /// The ratio rule applies once the window holds this many calls (1..=window_len).
    pub window_calls_min: u32,
    /// Failure share of the window, in percent, that opens the breaker.
    pub window_failure_percent_max: u8,
    /// First open time.
    pub open_ms: u64,
    /// Longest open time after repeated failed probes.
    pub open_max_ms: u64,
    /// Calls admitted in a half-open period; all must succeed to close.
    pub half_open_probes: u32,
    /// A probe not recorded within this time after the last probe was admitted counts as
    /// failed (set it above the dependency's call timeout).
    pub probe_timeout_ms: u64,
}

impl Default for CircuitConfig {
    /// Sized for a Redis node (DESIGN.md section 3.2; issue 7 drill: "Redis killed → new
    /// submissions SYSTEM_BUSY within 1 s"): 5 refused connections or timeouts in a row open
    /// it at once; half of the last 64 calls failing opens it; first open 500 ms, growing to
    /// 8 s; 3 probes; a probe is lost after 1 s (the pipelined call timeout is well below).
    fn default() -> CircuitConfig {
        CircuitConfig {
            consecutive_failures_max: 5,
            window_len: 64,
            window_calls_min: 20,
            window_failure_percent_max: 50,
            open_ms: 500,
            open_max_ms: 8_000,
            half_open_probes: 3,
            probe_timeout_ms: 1_000,
        }
    }
}

impl CircuitConfig {
    pub fn validate(&self) -> Result<(), String> {
        let checks: [(bool, &str); 7] = [
            (self.consecutive_failures_max >= 1, "consecutive_failures_max must be at least 1"),
            ((1..=WINDOW_LEN_MAX).contains(&self.window_len), "window_len must be within 1..=64"),
            (
                (1..=self.window_len).contains(&self.window_calls_min),
                "window_calls_min must be within 1..=window_len",
            ),
            (
                (1..=100).contains(&self.window_failure_percent_max),
                "window_failure_percent_max must be within 1..=100",
            ),
            (
                self.open_ms >= 1
                    && self.open_ms <= self.open_max_ms
                    && self.open_max_ms <= DELAY_MS_MAX,
                "need 1 <= open_ms <= open_max_ms <= 3600000",
            ),
            (
                (1..=HALF_OPEN_PROBES_MAX).contains(&self.half_open_probes),
                "half_open_probes must be within 1..=1024",
            ),
            (
                (1..=DELAY_MS_MAX).contains(&self.probe_timeout_ms),
                "probe_timeout_ms must be within 1..=3600000",
            ),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, why)) => Err((*why).to_owned()),
            None => Ok(()),
        }
    }
}

/// Where a breaker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Calls flow; outcomes are counted.
    Closed,
    /// Calls are refused without touching the dependency.
    Open,
    /// A few probes are admitted; the rest is refused.
    HalfOpen,
}

impl CircuitState {
    /// For the breaker-state gauge: Closed 0, HalfOpen 1, Open 2.
    pub const fn metric_value(self) -> u8 {
        match self {
            CircuitState::Closed => 0,
            CircuitState::HalfOpen => 1,
            CircuitState::Open => 2,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::HalfOpen => "half_open",
            CircuitState::Open => "open",
        }
    }
}

/// Whether an admitted call is an ordinary one or a half-open probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeOrNormal {
    Normal,
    Probe,
}

/// Permission for one call; give it back to [`Circuit::record`] with the outcome.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "record the outcome of the call with Circuit::record"]
pub struct Call {
    kind: ProbeOrNormal,
    epoch: u64,
}

impl Call {
    pub fn kind(&self) -> ProbeOrNormal {
        self.kind
    }
}

/// The answer of [`Circuit::allow`].
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    Call(Call),
    /// Do not call; the breaker expects to admit again in about this long (≥ 1).
    Reject {
        retry_after_ms: u64,
    },
}

/// How a call went, as far as the dependency's health is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// The dependency answered (whatever the business answer).
    Success,
    /// Refused, reset, an error reply that means the dependency is unwell.
    Failure,
    /// No answer in time after the request was sent: counted as a failure.
    Unknown,
}

/// One breaker. Owned by one shard (or one task); not shared.
#[derive(Debug, Clone)]
pub struct Circuit {
    config: CircuitConfig,
    state: CircuitState,
    /// Changes at every transition; stamps every [`Call`].
    epoch: u64,
    consecutive_failures: u32,
    /// Bit i set = the (i+1)-th most recent outcome failed.
    window_bits: u64,
    window_calls: u32,
    open_until_ms: u64,
    open_for_ms: u64,
    probes_issued: u32,
    probes_succeeded: u32,
    last_probe_ms: u64,
    outage_since_ms: Option<u64>,
    opened_count: u64,
}

impl Circuit {
    /// Panics on an invalid configuration (validated in `main`; see [`CircuitConfig::validate`]).
    pub fn new(config: CircuitConfig) -> Circuit {
        if let Err(why) = config.validate() {
            panic!("invalid CircuitConfig: {why}");
        }
        Circuit {
            config,
            state: CircuitState::Closed,
            epoch: 0,
            consecutive_failures: 0,
            window_bits: 0,
            window_calls: 0,
            open_until_ms: 0,
            open_for_ms: config.open_ms,
            probes_issued: 0,
            probes_succeeded: 0,
            last_probe_ms: 0,
            outage_since_ms: None,
            opened_count: 0,
        }
    }

    /// May a call be made now?
    pub fn allow(&mut self, now_ms: u64) -> Admit {
        match self.state {
            CircuitState::Closed => {
                Admit::Call(Call { kind: ProbeOrNormal::Normal, epoch: self.epoch })
            }
            CircuitState::Open if now_ms < self.open_until_ms => {
                Admit::Reject { retry_after_ms: self.open_until_ms - now_ms }
            }
            CircuitState::Open => {
                self.transition(CircuitState::HalfOpen);
                self.probes_issued = 0;
                self.probes_succeeded = 0;
                self.allow_probe(now_ms)
            }
            CircuitState::HalfOpen => self.allow_probe(now_ms),
        }
    }

    fn allow_probe(&mut self, now_ms: u64) -> Admit {
        if self.probes_issued < self.config.half_open_probes {
            self.probes_issued += 1;
            self.last_probe_ms = now_ms;
            return Admit::Call(Call { kind: ProbeOrNormal::Probe, epoch: self.epoch });
        }
        let lost_at_ms = self.last_probe_ms.saturating_add(self.config.probe_timeout_ms);
        if now_ms >= lost_at_ms {
            // Every probe is out and at least one never came back: as good as failed.
            self.reopen(now_ms);
            return Admit::Reject { retry_after_ms: self.open_until_ms - now_ms };
        }
        Admit::Reject { retry_after_ms: lost_at_ms - now_ms }
    }

    /// Gives back a call that was admitted but never made (something else refused the
    /// request first): a half-open probe slot returns to the pool instead of counting as a
    /// probe that never came back (which would re-open the breaker); an ordinary call counted
    /// nothing yet.
    pub fn cancel(&mut self, call: Call) {
        if call.epoch == self.epoch
            && call.kind == ProbeOrNormal::Probe
            && self.state == CircuitState::HalfOpen
        {
            assert!(self.probes_issued > 0, "a probe returned that was never issued");
            self.probes_issued -= 1;
        }
    }

    /// The outcome of a call [`Circuit::allow`] admitted.
    pub fn record(&mut self, call: Call, outcome: CallOutcome, now_ms: u64) {
        if call.epoch != self.epoch {
            // Admitted under an earlier state: says nothing about this one.
            return;
        }
        let failed = !matches!(outcome, CallOutcome::Success);
        match (self.state, call.kind) {
            (CircuitState::Closed, ProbeOrNormal::Normal) => self.on_closed_result(failed, now_ms),
            (CircuitState::HalfOpen, ProbeOrNormal::Probe) if failed => self.reopen(now_ms),
            (CircuitState::HalfOpen, ProbeOrNormal::Probe) => {
                self.probes_succeeded += 1;
                if self.probes_succeeded >= self.config.half_open_probes {
                    self.close();
                }
            }
            // Epochs change at every transition, so a current-epoch call always matches the
            // state that issued it; nothing else can arrive here.
            _ => debug_assert!(false, "call {:?} in state {:?}", call.kind, self.state),
        }
    }

    fn on_closed_result(&mut self, failed: bool, now_ms: u64) {
        let len = self.config.window_len;
        let mask = if len >= 64 { u64::MAX } else { (1u64 << len) - 1 };
        self.window_bits = ((self.window_bits << 1) | u64::from(failed)) & mask;
        self.window_calls = (self.window_calls + 1).min(len);
        self.consecutive_failures = if failed { self.consecutive_failures + 1 } else { 0 };
        let window_failures = u64::from(self.window_bits.count_ones());
        let ratio_trips = self.window_calls >= self.config.window_calls_min
            && window_failures * 100
                >= u64::from(self.config.window_failure_percent_max) * u64::from(self.window_calls);
        if self.consecutive_failures >= self.config.consecutive_failures_max || ratio_trips {
            self.open_for_ms = self.config.open_ms;
            self.outage_since_ms = Some(now_ms);
            self.open(now_ms);
        }
    }

    /// Half-open failed: open again, for twice as long (bounded).
    fn reopen(&mut self, now_ms: u64) {
        self.open_for_ms = self.open_for_ms.saturating_mul(2).min(self.config.open_max_ms);
        self.open(now_ms);
    }

    fn open(&mut self, now_ms: u64) {
        self.transition(CircuitState::Open);
        self.open_until_ms = now_ms.saturating_add(self.open_for_ms);
        self.opened_count += 1;
    }

    fn close(&mut self) {
        self.transition(CircuitState::Closed);
        self.consecutive_failures = 0;
        self.window_bits = 0;
        self.window_calls = 0;
        self.open_for_ms = self.config.open_ms;
        self.outage_since_ms = None;
    }

    fn transition(&mut self, to: CircuitState) {
        self.state = to;
        self.epoch += 1;
    }

    /// The state as of `now_ms`: an open breaker whose time is up reads `HalfOpen` (the next
    /// [`Circuit::allow`] will admit a probe). Admission must read this, not a stored state,
    /// or an open breaker that nobody calls would never be probed again.
    pub fn state(&self, now_ms: u64) -> CircuitState {
        match self.state {
            CircuitState::Open if now_ms >= self.open_until_ms => CircuitState::HalfOpen,
            state => state,
        }
    }

    /// When the current outage began (the breaker left `Closed`); `None` while closed. Stays
    /// put through half-open attempts, so `now - opened_at` is the outage age.
    pub fn opened_at_ms(&self) -> Option<u64> {
        self.outage_since_ms
    }

    /// Times the breaker opened (first opens and re-opens): seed 熔断重开次数.
    pub fn opened_count(&self) -> u64 {
        self.opened_count
    }

    pub fn config(&self) -> &CircuitConfig {
        &self.config
    }
}

// ---------------------------------------------------------------------------------------------
// Retries
// ---------------------------------------------------------------------------------------------

/// Bounded retries with exponential backoff and full jitter, for idempotent operations only
/// (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub attempts_max: u32,
    /// Ceiling of the first retry's delay; doubles per retry.
    pub base_delay_ms: u64,
    /// Largest ceiling.
    pub delay_max_ms: u64,
    /// No retry starts after this long since the first attempt started.
    pub budget_ms: u64,
}

impl RetryPolicy {
    pub fn validate(&self) -> Result<(), String> {
        if self.attempts_max == 0 {
            return Err("attempts_max must be at least 1".into());
        }
        if self.base_delay_ms == 0 || self.base_delay_ms > self.delay_max_ms {
            return Err("need 1 <= base_delay_ms <= delay_max_ms".into());
        }
        if self.delay_max_ms > DELAY_MS_MAX || self.budget_ms > DELAY_MS_MAX {
            return Err("delays and budget are limited to one hour".into());
        }
        Ok(())
    }

    /// The delay before the next attempt, or `None` to give up. `attempts_made` counts the
    /// attempts already made (≥ 1 after the first failure), `elapsed_ms` is the time since
    /// the first attempt started, `rng_u64` a uniformly random number (the caller's RNG).
    ///
    /// Gives up when `attempts_max` attempts were made, or when the retry would start at or
    /// after the budget. Otherwise the delay is uniform in `[0, min(delay_max, base ×
    /// 2^(attempts_made - 1))]` (full jitter).
    pub fn next_delay_ms(&self, attempts_made: u32, elapsed_ms: u64, rng_u64: u64) -> Option<u64> {
        if attempts_made >= self.attempts_max {
            return None;
        }
        let ceiling = self.ceiling_ms(attempts_made);
        // Modulo bias: at most ceiling / 2^64, far below anything measurable.
        let delay_ms = rng_u64 % (ceiling + 1);
        if elapsed_ms.saturating_add(delay_ms) >= self.budget_ms {
            return None;
        }
        Some(delay_ms)
    }

    /// The largest delay after `attempts_made` attempts.
    pub fn ceiling_ms(&self, attempts_made: u32) -> u64 {
        let doublings = attempts_made.saturating_sub(1).min(63);
        self.base_delay_ms.saturating_mul(1u64 << doublings).min(self.delay_max_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn config() -> CircuitConfig {
        CircuitConfig {
            consecutive_failures_max: 3,
            window_len: 8,
            window_calls_min: 4,
            window_failure_percent_max: 50,
            open_ms: 100,
            open_max_ms: 350,
            half_open_probes: 2,
            probe_timeout_ms: 50,
        }
    }

    fn call(c: &mut Circuit, now: u64) -> Call {
        match c.allow(now) {
            Admit::Call(call) => call,
            other => panic!("expected a call at {now}, got {other:?}"),
        }
    }

    fn run(c: &mut Circuit, outcome: CallOutcome, now: u64) {
        let k = call(c, now);
        c.record(k, outcome, now);
    }

    #[test]
    fn consecutive_failures_open_then_probes_close() {
        let mut c = Circuit::new(config());
        run(&mut c, CallOutcome::Failure, 0);
        run(&mut c, CallOutcome::Unknown, 1);
        assert_eq!(c.state(1), CircuitState::Closed);
        assert_eq!(c.opened_at_ms(), None);
        run(&mut c, CallOutcome::Failure, 2);
        assert_eq!(c.state(2), CircuitState::Open, "3 in a row (Unknown counts)");
        assert_eq!(c.opened_at_ms(), Some(2));
        assert_eq!(c.allow(50), Admit::Reject { retry_after_ms: 52 });
        // Time up: reads half-open before anyone calls, then admits exactly 2 probes.
        assert_eq!(c.state(102), CircuitState::HalfOpen);
        let p1 = call(&mut c, 102);
        let p2 = call(&mut c, 103);
        assert_eq!((p1.kind(), p2.kind()), (ProbeOrNormal::Probe, ProbeOrNormal::Probe));
        assert_eq!(c.allow(104), Admit::Reject { retry_after_ms: 49 });
        c.record(p1, CallOutcome::Success, 105);
        assert_eq!(c.state(105), CircuitState::HalfOpen, "one success is not enough");
        c.record(p2, CallOutcome::Success, 106);
        assert_eq!(c.state(106), CircuitState::Closed);
        assert_eq!(c.opened_at_ms(), None);
        assert_eq!(call(&mut c, 107).kind(), ProbeOrNormal::Normal);
        assert_eq!(c.opened_count(), 1);
    }

    #[test]
    fn a_success_resets_the_streak() {
        // Ratio rule out of the way (100 % of 8): only the streak can open it.
        let mut c = Circuit::new(CircuitConfig {
            window_calls_min: 8,
            window_failure_percent_max: 100,
            ..config()
        });
        for t in 0..4 {
            run(&mut c, CallOutcome::Failure, t * 3);
            run(&mut c, CallOutcome::Unknown, t * 3 + 1);
            run(&mut c, CallOutcome::Success, t * 3 + 2);
        }
        // 8 of 12 failed, never 3 in a row.
        assert_eq!(c.state(12), CircuitState::Closed);
        run(&mut c, CallOutcome::Failure, 12);
        run(&mut c, CallOutcome::Failure, 13);
        assert_eq!(c.state(13), CircuitState::Closed);
        run(&mut c, CallOutcome::Failure, 14);
        assert_eq!(c.state(14), CircuitState::Open);
    }

    #[test]
    fn failure_ratio_opens_a_flaky_dependency() {
        let mut c = Circuit::new(CircuitConfig {
            consecutive_failures_max: 100,
            window_calls_min: 8,
            ..config()
        });
        // Alternating: never two failures in a row, 50 % of the window.
        for t in 0..7u64 {
            let o = if t.is_multiple_of(2) { CallOutcome::Failure } else { CallOutcome::Success };
            run(&mut c, o, t);
        }
        assert_eq!(c.state(7), CircuitState::Closed, "window not yet at its minimum");
        run(&mut c, CallOutcome::Success, 7);
        assert_eq!(c.state(8), CircuitState::Open, "4 of 8 = 50 %");
    }

    #[test]
    fn failed_probe_reopens_longer_up_to_the_bound() {
        let mut c = Circuit::new(config());
        for t in 0..3 {
            run(&mut c, CallOutcome::Failure, t);
        }
        let mut now = 2;
        let mut opens = Vec::new();
        for _ in 0..4 {
            let Admit::Reject { retry_after_ms } = c.allow(now) else { panic!("open") };
            opens.push(retry_after_ms);
            now += retry_after_ms;
            run(&mut c, CallOutcome::Failure, now);
        }
        assert_eq!(opens, [100, 200, 350, 350]);
        assert_eq!(c.opened_at_ms(), Some(2), "the outage began at the first open");
        assert_eq!(c.opened_count(), 5);
        // Recovery resets the open time.
        now += 350;
        run(&mut c, CallOutcome::Success, now);
        run(&mut c, CallOutcome::Success, now);
        assert_eq!(c.state(now), CircuitState::Closed);
        for _ in 0..3 {
            run(&mut c, CallOutcome::Failure, now);
        }
        assert_eq!(c.allow(now), Admit::Reject { retry_after_ms: 100 });
    }

    #[test]
    fn lost_probes_time_out() {
        let mut c = Circuit::new(config());
        for t in 0..3 {
            run(&mut c, CallOutcome::Failure, t);
        }
        let lost1 = call(&mut c, 102);
        let lost2 = call(&mut c, 110);
        // Nobody records them: after probe_timeout since the last probe, it reopens.
        assert_eq!(c.allow(159), Admit::Reject { retry_after_ms: 1 });
        assert_eq!(c.allow(160), Admit::Reject { retry_after_ms: 200 });
        assert_eq!(c.state(160), CircuitState::Open);
        // Their late results are ignored.
        c.record(lost1, CallOutcome::Success, 161);
        c.record(lost2, CallOutcome::Success, 161);
        assert_eq!(c.state(161), CircuitState::Open);
    }

    #[test]
    fn stale_results_do_not_count() {
        let mut c = Circuit::new(config());
        let early: Vec<Call> = (0..5).map(|t| call(&mut c, t)).collect();
        for t in 0..3 {
            run(&mut c, CallOutcome::Failure, t);
        }
        assert_eq!(c.state(3), CircuitState::Open);
        let probe = call(&mut c, 103);
        // Calls admitted while closed answer now: they must not close the breaker...
        for k in early {
            c.record(k, CallOutcome::Success, 104);
        }
        assert_eq!(c.state(104), CircuitState::HalfOpen);
        c.record(probe, CallOutcome::Success, 105);
        let probe = call(&mut c, 105);
        c.record(probe, CallOutcome::Success, 106);
        assert_eq!(c.state(106), CircuitState::Closed);
        // ...and stale failures of an earlier epoch do not re-open a closed one.
        let mut c2 = Circuit::new(config());
        let old: Vec<Call> = (0..3).map(|t| call(&mut c2, t)).collect();
        for t in 0..3 {
            run(&mut c2, CallOutcome::Failure, t);
        }
        let p1 = call(&mut c2, 200);
        let p2 = call(&mut c2, 200);
        c2.record(p1, CallOutcome::Success, 201);
        c2.record(p2, CallOutcome::Success, 201);
        for k in old {
            c2.record(k, CallOutcome::Failure, 202);
        }
        assert_eq!(c2.state(202), CircuitState::Closed);
    }

    #[test]
    fn invalid_configs_are_named() {
        let bad = |c: CircuitConfig| c.validate().unwrap_err();
        assert!(bad(CircuitConfig { window_len: 65, ..config() }).contains("window_len"));
        assert!(bad(CircuitConfig { window_calls_min: 9, ..config() }).contains("window_calls"));
        assert!(bad(CircuitConfig { open_max_ms: 99, ..config() }).contains("open_ms"));
        assert!(bad(CircuitConfig { half_open_probes: 0, ..config() }).contains("probes"));
        assert!(CircuitConfig::default().validate().is_ok());
        assert_eq!(CircuitState::Open.metric_value(), 2);
    }

    #[test]
    fn retry_policy_bounds() {
        let p =
            RetryPolicy { attempts_max: 4, base_delay_ms: 10, delay_max_ms: 25, budget_ms: 100 };
        assert_eq!(p.ceiling_ms(1), 10);
        assert_eq!(p.ceiling_ms(2), 20);
        assert_eq!(p.ceiling_ms(3), 25, "capped");
        assert_eq!(p.ceiling_ms(200), 25, "no overflow");
        // rng % (ceiling + 1): full range reachable, 0 included.
        assert_eq!(p.next_delay_ms(1, 0, 10), Some(10));
        assert_eq!(p.next_delay_ms(1, 0, 11), Some(0));
        assert_eq!(p.next_delay_ms(3, 0, 25), Some(25));
        assert_eq!(p.next_delay_ms(4, 0, 0), None, "attempts exhausted");
        assert_eq!(p.next_delay_ms(1, 95, 4), Some(4));
        assert_eq!(p.next_delay_ms(1, 95, 5), None, "would start at the budget");
        assert_eq!(p.next_delay_ms(1, 100, 0), None);
        assert!(RetryPolicy { attempts_max: 0, ..p }.validate().is_err());
        assert!(RetryPolicy { base_delay_ms: 30, ..p }.validate().is_err());
        assert!(p.validate().is_ok());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Allow,
        Record(usize, u8),
        Tick(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Allow),
            3 => (any::<usize>(), 0u8..3).prop_map(|(i, o)| Op::Record(i, o)),
            1 => (0u16..200).prop_map(Op::Tick),
        ]
    }

    proptest! {
        /// Against a trivial model of the rules: nothing is admitted while open; at most
        /// `half_open_probes` probes per half-open period; open times stay within
        /// [open_ms, open_max_ms]; normal calls only while closed; the outage start is set
        /// exactly while not closed; `consecutive_failures_max` current failures in a row
        /// always open a closed breaker.
        #[test]
        fn model(ops in proptest::collection::vec(op(), 1..300)) {
            let cfg = config();
            let mut c = Circuit::new(cfg);
            let mut now = 0u64;
            let mut out: Vec<(Call, u64)> = Vec::new();
            let mut probes_this_period = 0u32;
            let mut streak = 0u32;
            for op in ops {
                match op {
                    Op::Allow => {
                        let before = c.state(now);
                        match c.allow(now) {
                            Admit::Call(k) => {
                                prop_assert_ne!(before, CircuitState::Open);
                                match k.kind() {
                                    ProbeOrNormal::Normal => {
                                        prop_assert_eq!(before, CircuitState::Closed);
                                        probes_this_period = 0;
                                    }
                                    ProbeOrNormal::Probe => {
                                        probes_this_period += 1;
                                        prop_assert!(probes_this_period <= cfg.half_open_probes);
                                    }
                                }
                                let epoch = k.epoch;
                                out.push((k, epoch));
                            }
                            Admit::Reject { retry_after_ms } => {
                                prop_assert!(retry_after_ms >= 1);
                                prop_assert!(retry_after_ms <= cfg.open_max_ms.max(cfg.probe_timeout_ms));
                                prop_assert_ne!(c.state(now), CircuitState::Closed);
                                if c.state == CircuitState::Open {
                                    probes_this_period = 0;
                                }
                            }
                        }
                    }
                    Op::Record(i, o) => {
                        if out.is_empty() { continue; }
                        let (k, epoch) = out.swap_remove(i % out.len());
                        let outcome = [CallOutcome::Success, CallOutcome::Failure, CallOutcome::Unknown][usize::from(o)];
                        let counts = epoch == c.epoch && c.state == CircuitState::Closed;
                        if counts {
                            streak = if outcome == CallOutcome::Success { 0 } else { streak + 1 };
                        }
                        let was = c.state;
                        c.record(k, outcome, now);
                        if counts && streak >= cfg.consecutive_failures_max {
                            prop_assert_eq!(c.state, CircuitState::Open);
                        }
                        if was != c.state {
                            streak = 0;
                            probes_this_period = 0;
                        }
                    }
                    Op::Tick(ms) => now += u64::from(ms),
                }
                prop_assert!(c.open_for_ms >= cfg.open_ms && c.open_for_ms <= cfg.open_max_ms);
                prop_assert_eq!(c.opened_at_ms().is_some(), c.state != CircuitState::Closed);
                if c.state == CircuitState::Closed {
                    prop_assert_eq!(streak, c.consecutive_failures);
                }
            }
        }

        /// Full jitter: every delay lies in [0, ceiling], attempts and the budget bound the
        /// whole sequence, and the mean over many draws is about half the ceiling.
        #[test]
        fn retry_delays_are_bounded_and_jittered(
            attempts_max in 1u32..10,
            base in 1u64..100,
            extra in 0u64..1_000,
            budget in 0u64..5_000,
            seed in any::<u64>(),
        ) {
            let p = RetryPolicy { attempts_max, base_delay_ms: base, delay_max_ms: base + extra, budget_ms: budget };
            let mut rng = seed;
            let mut elapsed = 0u64;
            let mut attempts = 1u32;
            while let Some(d) = p.next_delay_ms(attempts, elapsed, splitmix(&mut rng)) {
                prop_assert!(d <= p.ceiling_ms(attempts));
                elapsed += d + 1; // the attempt itself takes a little time
                attempts += 1;
            }
            prop_assert!(attempts <= attempts_max);
            prop_assert!(elapsed <= budget + attempts_max as u64);
            let ceiling = p.ceiling_ms(3);
            let n = 4_000u64;
            let sum: u64 = (0..n).map(|_| p.next_delay_ms(3, 0, splitmix(&mut rng)).unwrap_or(0)).sum();
            if attempts_max > 3 && budget > ceiling && ceiling >= 10 {
                let mean = sum as f64 / n as f64;
                prop_assert!((mean - ceiling as f64 / 2.0).abs() < ceiling as f64 * 0.05, "mean {mean} vs ceiling {ceiling}");
            }
        }
    }

    fn splitmix(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}
