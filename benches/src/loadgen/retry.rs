//! The generator's retry rule, sans-I/O: given an answer, whether and when the buyer tries
//! again with the SAME request id (CONTRACT.md 3.2; issue 24 item 3). No clock (times are
//! arguments), no randomness of its own (the caller passes a uniform draw).
//!
//! The rule, as a careful real client would apply it:
//! - Only answers that say "not now" are retried: `OVERLOADED`, `RATE_LIMITED` (429),
//!   `SUBMIT_CLOSED`, `SYSTEM_BUSY` (503, nothing was reserved) and `UNKNOWN` (503, the
//!   outcome could not be confirmed: the contract asks for the same id). Everything else is
//!   the buyer's final answer.
//! - The wait is the server's hint — the body's `retry_after_ms`, else the `Retry-After`
//!   header's seconds, else [`RETRY_AFTER_MS_DEFAULT`] — capped at [`RETRY_AFTER_MS_MAX`], then
//!   stretched by a uniform factor in `[1, 1 + jitter)` (default `[1, 1.5)`).
//!   Why not "full jitter" (uniform in `[0, hint)`, as the engine's own Redis retries use,
//!   `engine::logic::circuit::RetryPolicy`)? The hint here is the server's own back-off: a
//!   client that comes back before it is told to undoes the shed it was given, and a shed
//!   answer is cheap only if it is not repeated at once (issue 24: retrying at once made P99
//!   worse). The engine already spreads its hint (`[base, 1.5 × base)`, `admission.rs`);
//!   the client's own factor spreads clients that read the same coarse hint (the header has
//!   whole seconds) so they do not return in lock-step. Never earlier, at most 1.5× later.
//! - At most `retry_max` retries, and none that would start later than `budget_ms` after the
//!   intent's first intended send (the buyer gives up; the answer he has is his final one).
//!
//! What it is not: the timer that waits, or the queue the retry goes back into (`event_loop.rs`).
//!
//! Read next: `event_loop.rs` (`on_answer`).

use super::http::State;

/// Longest `retry_after_ms` honoured; a longer hint is capped (the run would otherwise wait
/// on one answer for longer than it lasts).
pub const RETRY_AFTER_MS_MAX: u64 = 5_000;
/// Delay before a retry when the answer carried no hint at all.
pub const RETRY_AFTER_MS_DEFAULT: u64 = 100;
/// Most retries of one intent.
pub const RETRY_MAX_MAX: u32 = 10;
/// Longest retry budget (time from the first intended send to the last retry's start).
pub const RETRY_BUDGET_MS_MAX: u64 = 120_000;
/// Largest jitter spread, percent of the hint (100: a factor in `[1, 2)`).
pub const RETRY_JITTER_PCT_MAX: u32 = 100;

/// Defaults of the command line (`cli.rs`): five retries within ten seconds, each after the
/// hint stretched by up to half. A buyer in a flash sale keeps trying for seconds, not
/// minutes: the units are gone within a few seconds, and with the engine's hints (a few
/// hundred ms) five retries span about 1-3 s, well inside the budget; the budget only bites
/// on long hints (a `SUBMIT_CLOSED` mode closure of several seconds).
pub const RETRY_MAX_DEFAULT: u32 = 5;
pub const RETRY_BUDGET_MS_DEFAULT: u64 = 10_000;
pub const RETRY_JITTER_PCT_DEFAULT: u32 = 50;

/// What to do with an answer worth retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Record the answer as final and move on.
    Off,
    /// Re-send with the SAME request id, within these bounds.
    SameId(SameId),
}

/// The bounds of same-id retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SameId {
    /// Retries after the first attempt (0: none).
    pub retry_max: u32,
    /// No retry starts later than this after the intent's first intended send.
    pub budget_ms: u64,
    /// The wait is the hint × a uniform factor in `[1, 1 + jitter_pct / 100)`.
    pub jitter_pct: u32,
}

impl SameId {
    pub const DEFAULT: SameId = SameId {
        retry_max: RETRY_MAX_DEFAULT,
        budget_ms: RETRY_BUDGET_MS_DEFAULT,
        jitter_pct: RETRY_JITTER_PCT_DEFAULT,
    };
}

impl RetryPolicy {
    /// Checks the bounds; `None` when valid.
    pub fn invalid_reason(&self) -> Option<String> {
        let RetryPolicy::SameId(p) = self else { return None };
        if p.retry_max > RETRY_MAX_MAX {
            return Some(format!("retry max must be 0..={RETRY_MAX_MAX}"));
        }
        if p.budget_ms > RETRY_BUDGET_MS_MAX {
            return Some(format!("retry budget must be 0..={RETRY_BUDGET_MS_MAX} ms"));
        }
        if p.jitter_pct > RETRY_JITTER_PCT_MAX {
            return Some(format!("retry jitter must be 0..={RETRY_JITTER_PCT_MAX} %"));
        }
        None
    }

    /// The longest a retried intent can take past its first intended send before its last
    /// retry starts (what the end of a run must wait for, beside the request timeout).
    pub fn horizon_ms(&self) -> u64 {
        match self {
            RetryPolicy::Off => 0,
            RetryPolicy::SameId(p) => {
                let longest_wait_ms = RETRY_AFTER_MS_MAX * (100 + u64::from(p.jitter_pct)) / 100;
                p.budget_ms.min(u64::from(p.retry_max) * longest_wait_ms)
            }
        }
    }

    /// A short description for the report (`same-id x5 within 10000 ms, wait hint x[1, 1.5)`).
    pub fn describe(&self) -> String {
        match self {
            RetryPolicy::Off => "off".to_owned(),
            RetryPolicy::SameId(p) => format!(
                "same-id x{} within {} ms, wait hint x[1, {})",
                p.retry_max,
                p.budget_ms,
                1.0 + f64::from(p.jitter_pct) / 100.0
            ),
        }
    }
}

/// What an answer was: whom it came to and what it said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answered {
    pub state: State,
    /// The attempt this answer is for: 0 for the first send, 1 for the first retry, ...
    pub attempt: u32,
    /// The body's `retry_after_ms`.
    pub retry_after_ms: Option<u64>,
    /// The `Retry-After` header (seconds).
    pub retry_after_s: Option<u64>,
    /// Time from the intent's first intended send to now, µs.
    pub since_first_us: u64,
}

/// The rule's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send attempt `attempt + 1` this long from now.
    RetryIn { delay_us: u64 },
    /// This answer is the buyer's final one.
    Final(Why),
}

/// Why an answer is final.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Not a "try again later" answer (or retries are off).
    Settled,
    /// Worth retrying, but `retry_max` retries were made.
    RetryMax,
    /// Worth retrying, but the next retry would start after the budget.
    Budget,
}

/// The server's hint in µs: body, else header, else the default; capped.
pub fn hint_us(retry_after_ms: Option<u64>, retry_after_s: Option<u64>) -> u64 {
    let ms = retry_after_ms
        .or_else(|| retry_after_s.map(|s| s.saturating_mul(1_000)))
        .unwrap_or(RETRY_AFTER_MS_DEFAULT)
        .min(RETRY_AFTER_MS_MAX);
    ms * 1_000
}

/// Decides what follows `answer`; `draw` is a uniform random u64 (the jitter).
pub fn decide(policy: &RetryPolicy, answer: &Answered, draw: u64) -> Decision {
    let p = match policy {
        RetryPolicy::SameId(p) if answer.state.is_retryable() => p,
        _ => return Decision::Final(Why::Settled),
    };
    if answer.attempt >= p.retry_max {
        return Decision::Final(Why::RetryMax);
    }
    let hint = hint_us(answer.retry_after_ms, answer.retry_after_s);
    let spread = hint * u64::from(p.jitter_pct) / 100;
    // A uniform share of [0, spread): the high 64 bits of draw × spread (no float, no bias
    // worth a mention at these sizes).
    let extra = ((u128::from(draw) * u128::from(spread)) >> 64) as u64;
    let delay_us = hint + extra;
    if answer.since_first_us.saturating_add(delay_us) > p.budget_ms.saturating_mul(1_000) {
        return Decision::Final(Why::Budget);
    }
    Decision::RetryIn { delay_us }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(state: State, attempt: u32) -> Answered {
        Answered {
            state,
            attempt,
            retry_after_ms: Some(200),
            retry_after_s: Some(1),
            since_first_us: 0,
        }
    }

    const POLICY: RetryPolicy =
        RetryPolicy::SameId(SameId { retry_max: 3, budget_ms: 2_000, jitter_pct: 50 });

    #[test]
    fn only_not_now_answers_are_retried() {
        for state in State::ALL {
            let d = decide(&POLICY, &answered(state, 0), 0);
            let retried = matches!(d, Decision::RetryIn { .. });
            let expected = matches!(
                state,
                State::Overloaded
                    | State::RateLimited
                    | State::SubmitClosed
                    | State::SystemBusy
                    | State::Unknown
            );
            assert_eq!(retried, expected, "{state:?}: {d:?}");
            if !expected {
                assert_eq!(d, Decision::Final(Why::Settled));
            }
        }
        let off = decide(&RetryPolicy::Off, &answered(State::Overloaded, 0), 0);
        assert_eq!(off, Decision::Final(Why::Settled));
    }

    #[test]
    fn the_wait_is_the_hint_stretched_by_up_to_half_never_less() {
        let a = answered(State::Overloaded, 0);
        assert_eq!(decide(&POLICY, &a, 0), Decision::RetryIn { delay_us: 200_000 });
        assert_eq!(decide(&POLICY, &a, u64::MAX), Decision::RetryIn { delay_us: 299_999 });
        assert_eq!(decide(&POLICY, &a, 1 << 63), Decision::RetryIn { delay_us: 250_000 });
        // Many draws: all in [hint, 1.5 hint), spread over the whole range.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let delays: Vec<u64> = (0..10_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                match decide(&POLICY, &a, x) {
                    Decision::RetryIn { delay_us } => delay_us,
                    d => panic!("{d:?}"),
                }
            })
            .collect();
        assert!(delays.iter().all(|d| (200_000..300_000).contains(d)));
        let mean = delays.iter().sum::<u64>() as f64 / delays.len() as f64;
        assert!((mean - 250_000.0).abs() < 3_000.0, "{mean}");
        assert!(delays.iter().any(|d| *d < 205_000) && delays.iter().any(|d| *d > 295_000));
        // No jitter: exactly the hint.
        let exact = RetryPolicy::SameId(SameId { jitter_pct: 0, ..SameId::DEFAULT });
        assert_eq!(decide(&exact, &a, u64::MAX), Decision::RetryIn { delay_us: 200_000 });
    }

    #[test]
    fn the_hint_comes_from_the_body_then_the_header_then_the_default_and_is_capped() {
        assert_eq!(hint_us(Some(250), Some(1)), 250_000);
        assert_eq!(hint_us(None, Some(2)), 2_000_000);
        assert_eq!(hint_us(None, None), RETRY_AFTER_MS_DEFAULT * 1_000);
        assert_eq!(hint_us(Some(60_000), None), RETRY_AFTER_MS_MAX * 1_000);
        assert_eq!(hint_us(None, Some(u64::MAX)), RETRY_AFTER_MS_MAX * 1_000);
        assert_eq!(hint_us(Some(0), Some(3)), 0, "an explicit 0 ms is honoured");
    }

    #[test]
    fn retries_are_bounded_in_count_and_time() {
        for attempt in 0..3 {
            let d = decide(&POLICY, &answered(State::SystemBusy, attempt), 0);
            assert!(matches!(d, Decision::RetryIn { .. }), "{attempt}: {d:?}");
        }
        assert_eq!(
            decide(&POLICY, &answered(State::SystemBusy, 3), 0),
            Decision::Final(Why::RetryMax)
        );
        // 1.85 s into a 2 s budget: a 0.2 s wait would start the retry after it.
        let late = Answered { since_first_us: 1_850_000, ..answered(State::Unknown, 1) };
        assert_eq!(decide(&POLICY, &late, 0), Decision::Final(Why::Budget));
        let in_time = Answered { since_first_us: 1_800_000, ..late };
        assert_eq!(decide(&POLICY, &in_time, 0), Decision::RetryIn { delay_us: 200_000 });
        // ... but its jitter may push it past the budget.
        assert_eq!(decide(&POLICY, &in_time, u64::MAX), Decision::Final(Why::Budget));
        let none = RetryPolicy::SameId(SameId { retry_max: 0, ..SameId::DEFAULT });
        assert_eq!(
            decide(&none, &answered(State::Overloaded, 0), 0),
            Decision::Final(Why::RetryMax)
        );
    }

    #[test]
    fn bounds_and_horizon() {
        assert!(POLICY.invalid_reason().is_none());
        assert!(RetryPolicy::Off.invalid_reason().is_none());
        let bad = |p: SameId| RetryPolicy::SameId(p).invalid_reason().is_some();
        assert!(bad(SameId { retry_max: 11, ..SameId::DEFAULT }));
        assert!(bad(SameId { budget_ms: 120_001, ..SameId::DEFAULT }));
        assert!(bad(SameId { jitter_pct: 101, ..SameId::DEFAULT }));
        assert_eq!(RetryPolicy::Off.horizon_ms(), 0);
        assert_eq!(POLICY.horizon_ms(), 2_000);
        let short = RetryPolicy::SameId(SameId { retry_max: 1, budget_ms: 60_000, jitter_pct: 50 });
        assert_eq!(short.horizon_ms(), 7_500);
        assert_eq!(
            RetryPolicy::SameId(SameId::DEFAULT).describe(),
            "same-id x5 within 10000 ms, wait hint x[1, 1.5)"
        );
    }
}
