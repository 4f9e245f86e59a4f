//! `decide_submit`: whether a new submission may try to reserve at all, from cheap local
//! state only (DESIGN.md section 7; seed chapter 9 §6.8 Fail Closed, §7.7–7.8, §8.2, §10.5).
//! Sans-I/O: every input is a value (the caller reads its atomics and breakers), `now_ms` and
//! the random draw are arguments; nothing here blocks, allocates or reads a clock.
//!
//! # The rules
//!
//! Checked in this order; the first that matches answers (so when several hold, the
//! client sees the longest-lived cause). Every rejection carries a `Retry-After`, jittered
//! over `[base, 1.5 × base)` so that clients turned away together do not return together.
//!
//! | # | condition | answer | reason code | why |
//! |---|---|---|---|---|
//! | 1 | effective mode QUERY_ONLY or SUBMIT_CLOSED, or the control state for this SKU expired or did not verify | `SUBMIT_CLOSED` | `MODE_QUERY_ONLY`, `MODE_SUBMIT_CLOSED`, `MODE_EXPIRED`, `MODE_UNVERIFIABLE` | an operator closed submissions; a control state we cannot trust any more fails closed (seed: 安全 TTL 过期后进入 SUBMIT_CLOSED) |
//! | 2 | log-publish circuit open | `SUBMIT_CLOSED` | `LOG_UNAVAILABLE` | a new reservation could not be confirmed into the log (it would sit in `resv:pending` growing without bound); the reservations already made are safe (the scanner republishes them) |
//! | 3 | `order-writer` backlog never polled, or its sample older than `backlog_sample_age_max_ms` | `SUBMIT_CLOSED` | `BACKLOG_UNKNOWN` | fail closed: an unknown backlog is treated as a full one, never as an empty one |
//! | 4 | oldest pending age > `oldest_pending_age_max_ms` | `SUBMIT_CLOSED` | `BACKLOG_AGE` | a message admitted now waits about as long as the head did, then needs its transaction: it would miss the 3 s order SLO (seed §7.7: MQ 最老消息年龄 < 订单 SLA 安全阈值) |
//! | 5 | pending count > `pending_count_max` | `SUBMIT_CLOSED` | `BACKLOG_COUNT` | the age lags a burst (it reads the head); the count sees it at once: N messages ahead drain in N / rate |
//! | 6 | PostgreSQL outage age > `pg_outage_age_max_ms` | `SUBMIT_CLOSED` | `PG_OUTAGE` | no order can be created while PostgreSQL is away; the outage age bounds the backlog age from below even when there is no traffic or the lag sample lags (seed §7.8) |
//! | 7 | Redis circuit open | `SYSTEM_BUSY` | `REDIS_UNAVAILABLE` | nothing can be reserved; the answer says so and costs the dependency nothing |
//! | 8 | SHED_LOAD / RECOVERING and the draw falls outside the mode's share | `SUBMIT_CLOSED` | `MODE_SHED_LOAD`, `MODE_RECOVERING` | the mode admits only that share (CONTRACT 3.2: a degradation mode answers `SUBMIT_CLOSED`) |
//! | 9 | local in-flight ≥ its max | `OVERLOADED` | `IN_FLIGHT` | this instance is full; another instance or a moment later may not be (429, not 503) |
//! | — | otherwise | admit | | |
//!
//! A half-open circuit admits: the breaker itself lets only its probes through
//! (`circuit::Circuit::allow`), and the caller answers `SYSTEM_BUSY` for the rest. A
//! reservation admitted while the log circuit is half-open and whose publish is then refused
//! is `QUEUED_PENDING` (reserved, republished by the scanner), which is safe.
//!
//! Properties (tested against a trivial model): a worse input never turns a rejection into
//! an admission (monotone); an unknown, stale or expired input always rejects; QUERY_ONLY and
//! SUBMIT_CLOSED never admit; every rejection has a Retry-After; the admitted share of
//! SHED_LOAD / RECOVERING converges to the configured percentage.
//!
//! # Default budgets, derived from the 3 s order SLO
//!
//! The SLO: an order is committed within 3 s of its reservation (DESIGN.md section 10).
//! Figures ([`SloBasis::MEASURED`]):
//! - order-create time, from a message reaching the head of `order-writer` to its commit:
//!   the worker's fetch wait (`fetch_wait_ms` 250) + a batch transaction (P99 ≤ 105 ms, the
//!   worst case measured in FIELD-NOTES: the single-row UPDATE allocator at 32 clients) =
//!   355, rounded up to **500 ms**;
//! - the lag is polled every `lag_poll_ms` = **500 ms** (pg-worker `WorkerConfig`), and one
//!   missed poll is tolerated, so a sample may be up to 2 × 500 = **1,000 ms** old;
//! - drain rate ≈ **4,000 orders/s** (FIELD-NOTES: 4,100 TPS single-message transactions at
//!   8 clients; 10,000 orders in 2.1 s batched). Replace it with the `order_pipeline`
//!   bench's figure for the deployment.
//!
//! Arithmetic:
//! - `backlog_sample_age_max_ms` = 500 × (1 + 1) = **1,000**;
//! - `oldest_pending_age_max_ms` = 3,000 − 500 (order create) − 1,000 (the true age may exceed
//!   the sample by its staleness) = **1,500**;
//! - `pending_count_max` = 4,000/s × 1.5 s = **6,000** (a message behind 6,000 others waits
//!   the same 1.5 s);
//! - `pg_outage_age_max_ms` = `oldest_pending_age_max_ms` = **1,500**: once PostgreSQL has
//!   been away that long, a message admitted at its start is already that old.
//!
//! Consequence worth knowing: a sale whose burst puts more than ~6,000 messages in the log
//! faster than they drain sees `SUBMIT_CLOSED` for a moment (Retry-After ~1 s) rather than
//! orders that miss the SLO. Raise the drain rate (batching) or the budgets, knowingly.
//!
//! What it is not: the reading of the inputs (the shard: mode table, breakers, `LogLag`,
//! the worker's last PostgreSQL contact), the per-SKU admission bucket (`partition.rs`), or
//! the per-user limits (`limiter.rs`).
//!
//! Read next: `modes.rs` (where the effective mode comes from), `circuit.rs`.

use crate::logic::circuit::CircuitState;
use crate::logic::modes::{EffectiveMode, Mode, ModeSource};
use crate::logic::outcome::SubmitOutcome;

/// The `order-writer` backlog as last polled (`flashsale_io::jetstream::LogLag`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Age of the oldest unsettled message at the time of the poll.
    pub oldest_pending_age_ms: u64,
    /// Messages not yet delivered plus delivered but not acked.
    pub pending_count: u64,
    /// When it was polled (same clock as `now_ms`); 0 = never.
    pub polled_at_ms: u64,
}

impl Backlog {
    pub const NEVER_POLLED: Backlog =
        Backlog { oldest_pending_age_ms: 0, pending_count: 0, polled_at_ms: 0 };
}

/// Everything `decide_submit` looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionInput {
    /// `ModeTable::effective` for the SKU.
    pub mode: EffectiveMode,
    /// The Redis circuit of the SKU's node, read with `Circuit::state(now_ms)`.
    pub redis: CircuitState,
    /// The log publisher's circuit, read the same way.
    pub log_publish: CircuitState,
    pub backlog: Backlog,
    /// Milliseconds since the worker last reached PostgreSQL (0 = reached just now). Computed
    /// by the caller as `now - last_success`, so a worker that stops reporting ages into
    /// closing by itself.
    pub pg_outage_age_ms: u64,
    /// Submissions this instance (or shard) is working on.
    pub in_flight: u32,
    pub in_flight_max: u32,
    /// A uniformly random number: the high 32 bits draw the share of SHED_LOAD/RECOVERING,
    /// the low 32 bits jitter the Retry-After.
    pub draw: u64,
}

/// The thresholds; see the module doc for the defaults and their derivation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    pub oldest_pending_age_max_ms: u64,
    pub pending_count_max: u64,
    /// A backlog sample older than this is unknown.
    pub backlog_sample_age_max_ms: u64,
    pub pg_outage_age_max_ms: u64,
    /// Retry-After bases.
    pub mode_closed_retry_ms: u64,
    pub mode_share_retry_ms: u64,
    pub dependency_retry_ms: u64,
    pub system_busy_retry_ms: u64,
    pub overloaded_retry_ms: u64,
}

/// The figures the default budgets are computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SloBasis {
    /// Reservation → order committed.
    pub order_slo_ms: u64,
    /// Head of the backlog → committed (fetch wait + transaction P99, rounded up).
    pub order_create_ms: u64,
    /// How often the backlog is polled.
    pub lag_poll_ms: u64,
    /// Polls that may be missed before the sample counts as unknown.
    pub lag_polls_missed_max: u64,
    /// Orders committed per second while draining a backlog.
    pub drain_orders_per_s: u64,
}

impl SloBasis {
    /// The figures of the module doc.
    pub const MEASURED: SloBasis = SloBasis {
        order_slo_ms: 3_000,
        order_create_ms: 500,
        lag_poll_ms: 500,
        lag_polls_missed_max: 1,
        drain_orders_per_s: 4_000,
    };
}

impl Budgets {
    /// The arithmetic of the module doc. Saturating: a basis whose fixed costs exceed the SLO
    /// gives zero budgets (everything closed), which [`Budgets::validate`] reports.
    pub const fn derive(basis: SloBasis) -> Budgets {
        let sample_age_max_ms = basis.lag_poll_ms.saturating_mul(1 + basis.lag_polls_missed_max);
        let oldest_age_max_ms = basis
            .order_slo_ms
            .saturating_sub(basis.order_create_ms)
            .saturating_sub(sample_age_max_ms);
        Budgets {
            oldest_pending_age_max_ms: oldest_age_max_ms,
            pending_count_max: basis.drain_orders_per_s.saturating_mul(oldest_age_max_ms) / 1000,
            backlog_sample_age_max_ms: sample_age_max_ms,
            pg_outage_age_max_ms: oldest_age_max_ms,
            mode_closed_retry_ms: 2_000,
            mode_share_retry_ms: 1_000,
            dependency_retry_ms: 1_000,
            system_busy_retry_ms: 1_000,
            overloaded_retry_ms: 200,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.oldest_pending_age_max_ms == 0 || self.pg_outage_age_max_ms == 0 {
            return Err(
                "the SLO leaves no backlog budget (order_create_ms + sample age >= SLO)".into()
            );
        }
        if self.pending_count_max == 0 || self.backlog_sample_age_max_ms == 0 {
            return Err("pending_count_max and backlog_sample_age_max_ms must be positive".into());
        }
        let retries = [
            self.mode_closed_retry_ms,
            self.mode_share_retry_ms,
            self.dependency_retry_ms,
            self.system_busy_retry_ms,
            self.overloaded_retry_ms,
        ];
        if retries.iter().any(|&r| r == 0 || r > 3_600_000) {
            return Err("every Retry-After base must be within 1..=3600000 ms".into());
        }
        Ok(())
    }
}

impl Default for Budgets {
    fn default() -> Budgets {
        DEFAULT_BUDGETS
    }
}

const DEFAULT_BUDGETS: Budgets = Budgets::derive(SloBasis::MEASURED);
// The derivation, checked where it is written down.
const _: () = assert!(DEFAULT_BUDGETS.backlog_sample_age_max_ms == 1_000);
const _: () = assert!(DEFAULT_BUDGETS.oldest_pending_age_max_ms == 1_500);
const _: () = assert!(DEFAULT_BUDGETS.pending_count_max == 6_000);
const _: () = assert!(DEFAULT_BUDGETS.pg_outage_age_max_ms == 1_500);
const _: () = assert!(
    DEFAULT_BUDGETS.oldest_pending_age_max_ms
        + DEFAULT_BUDGETS.backlog_sample_age_max_ms
        + SloBasis::MEASURED.order_create_ms
        <= SloBasis::MEASURED.order_slo_ms
);

/// Every `reason` a rejection can carry (the closed label set of
/// `flashsale_admission_rejections_total`).
pub const REJECT_REASONS: [&str; 16] = [
    "MODE_QUERY_ONLY",
    "MODE_SUBMIT_CLOSED",
    "MODE_EXPIRED",
    "MODE_UNVERIFIABLE",
    "MODE_SHED_LOAD",
    "MODE_RECOVERING",
    "LOG_UNAVAILABLE",
    "BACKLOG_UNKNOWN",
    "BACKLOG_AGE",
    "BACKLOG_COUNT",
    "PG_OUTAGE",
    "REDIS_UNAVAILABLE",
    "IN_FLIGHT",
    // Not decide_submit's: the owner's partition closes a SKU whose Redis node failed over.
    "REDIS_FAILOVER",
    // Not decide_submit's: the owner's partition closes a SKU whose Redis keys were lost.
    "REDIS_DATA_LOST",
    // Not decide_submit's: the expensive path's adaptive limit (`overload.rs`).
    "ADAPTIVE_LIMIT",
];

/// The answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Admit,
    Reject {
        /// `SubmitClosed`, `SystemBusy` or `Overloaded`.
        outcome: SubmitOutcome,
        /// Always ≥ 1.
        retry_after_ms: u64,
        /// A stable code (module doc table) for `reason_code`, logs and metric labels.
        reason: &'static str,
    },
}

impl Decision {
    pub fn is_admit(&self) -> bool {
        matches!(self, Decision::Admit)
    }
}

/// Decides one submission (module doc for the rules).
pub fn decide_submit(input: &AdmissionInput, budgets: &Budgets, now_ms: u64) -> Decision {
    let reject = |outcome, base_ms, reason| Decision::Reject {
        outcome,
        retry_after_ms: jittered(base_ms, input.draw),
        reason,
    };
    let closed = SubmitOutcome::SubmitClosed;

    if input.mode.closes_submissions() {
        return reject(closed, budgets.mode_closed_retry_ms, input.mode.reason());
    }
    if input.log_publish == CircuitState::Open {
        return reject(closed, budgets.dependency_retry_ms, "LOG_UNAVAILABLE");
    }
    let backlog = &input.backlog;
    let sample_age_ms = now_ms.saturating_sub(backlog.polled_at_ms);
    if backlog.polled_at_ms == 0 || sample_age_ms > budgets.backlog_sample_age_max_ms {
        return reject(closed, budgets.dependency_retry_ms, "BACKLOG_UNKNOWN");
    }
    if backlog.oldest_pending_age_ms > budgets.oldest_pending_age_max_ms {
        return reject(closed, budgets.dependency_retry_ms, "BACKLOG_AGE");
    }
    if backlog.pending_count > budgets.pending_count_max {
        return reject(closed, budgets.dependency_retry_ms, "BACKLOG_COUNT");
    }
    if input.pg_outage_age_ms > budgets.pg_outage_age_max_ms {
        return reject(closed, budgets.dependency_retry_ms, "PG_OUTAGE");
    }
    if input.redis == CircuitState::Open {
        return reject(
            SubmitOutcome::SystemBusy,
            budgets.system_busy_retry_ms,
            "REDIS_UNAVAILABLE",
        );
    }
    if let Mode::ShedLoad { .. } | Mode::Recovering { .. } = input.mode.mode {
        if !in_share(input.draw, input.mode.admit_percent()) {
            return reject(closed, budgets.mode_share_retry_ms, input.mode.reason());
        }
    }
    if input.in_flight >= input.in_flight_max {
        return reject(SubmitOutcome::Overloaded, budgets.overloaded_retry_ms, "IN_FLIGHT");
    }
    // A mode that closes must have answered above, whatever its source.
    debug_assert!(!matches!(
        input.mode.source,
        ModeSource::Expired { .. } | ModeSource::Unverifiable { .. }
    ));
    Decision::Admit
}

/// Whether the draw falls inside `percent` % (high 32 bits mapped onto 0..100 by
/// multiply-shift: unbiased to within 100 / 2^32).
fn in_share(draw: u64, percent: u8) -> bool {
    let slot = ((draw >> 32) * 100) >> 32;
    slot < u64::from(percent)
}

/// `base` spread over `[base, 1.5 × base)` by the low 32 bits of the draw; never 0.
fn jittered(base_ms: u64, draw: u64) -> u64 {
    let spread_ms = base_ms / 2;
    let extra_ms = ((draw & 0xffff_ffff) * spread_ms) >> 32;
    base_ms.saturating_add(extra_ms).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logic::modes::Scope;
    use proptest::prelude::*;

    const NOW: u64 = 1_000_000;

    fn mode(m: Mode) -> EffectiveMode {
        EffectiveMode { mode: m, source: ModeSource::Snapshot { scope: Scope::Global, version: 1 } }
    }

    fn healthy() -> AdmissionInput {
        AdmissionInput {
            mode: EffectiveMode::NO_SNAPSHOT,
            redis: CircuitState::Closed,
            log_publish: CircuitState::Closed,
            backlog: Backlog {
                oldest_pending_age_ms: 0,
                pending_count: 0,
                polled_at_ms: NOW - 100,
            },
            pg_outage_age_ms: 0,
            in_flight: 0,
            in_flight_max: 10,
            draw: 0,
        }
    }

    fn decide(input: AdmissionInput) -> Decision {
        decide_submit(&input, &Budgets::default(), NOW)
    }

    fn reason(d: Decision) -> Option<(SubmitOutcome, &'static str)> {
        match d {
            Decision::Admit => None,
            Decision::Reject { outcome, reason, .. } => Some((outcome, reason)),
        }
    }

    #[test]
    fn healthy_admits() {
        assert_eq!(decide(healthy()), Decision::Admit);
        assert_eq!(
            decide(AdmissionInput { mode: mode(Mode::Normal), ..healthy() }),
            Decision::Admit
        );
        // Half-open circuits admit (the breaker limits its probes itself).
        let half = AdmissionInput {
            redis: CircuitState::HalfOpen,
            log_publish: CircuitState::HalfOpen,
            ..healthy()
        };
        assert_eq!(decide(half), Decision::Admit);
    }

    #[test]
    fn each_rule_row() {
        let closed = SubmitOutcome::SubmitClosed;
        let b = Budgets::default();
        let backlog = healthy().backlog;
        let expired = EffectiveMode {
            mode: Mode::SubmitClosed,
            source: ModeSource::Expired { scope: Scope::Sku(1, 2), version: 4 },
        };
        let unverifiable = EffectiveMode {
            mode: Mode::SubmitClosed,
            source: ModeSource::Unverifiable { scope: Scope::Global, version: 0 },
        };
        let rows: [(AdmissionInput, SubmitOutcome, &str); 14] = [
            (
                AdmissionInput { mode: mode(Mode::QueryOnly), ..healthy() },
                closed,
                "MODE_QUERY_ONLY",
            ),
            (
                AdmissionInput { mode: mode(Mode::SubmitClosed), ..healthy() },
                closed,
                "MODE_SUBMIT_CLOSED",
            ),
            (AdmissionInput { mode: expired, ..healthy() }, closed, "MODE_EXPIRED"),
            (AdmissionInput { mode: unverifiable, ..healthy() }, closed, "MODE_UNVERIFIABLE"),
            (
                AdmissionInput { log_publish: CircuitState::Open, ..healthy() },
                closed,
                "LOG_UNAVAILABLE",
            ),
            (
                AdmissionInput { backlog: Backlog::NEVER_POLLED, ..healthy() },
                closed,
                "BACKLOG_UNKNOWN",
            ),
            (
                AdmissionInput {
                    backlog: Backlog {
                        polled_at_ms: NOW - b.backlog_sample_age_max_ms - 1,
                        ..backlog
                    },
                    ..healthy()
                },
                closed,
                "BACKLOG_UNKNOWN",
            ),
            (
                AdmissionInput {
                    backlog: Backlog { oldest_pending_age_ms: 1_501, ..backlog },
                    ..healthy()
                },
                closed,
                "BACKLOG_AGE",
            ),
            (
                AdmissionInput {
                    backlog: Backlog { pending_count: 6_001, ..backlog },
                    ..healthy()
                },
                closed,
                "BACKLOG_COUNT",
            ),
            (AdmissionInput { pg_outage_age_ms: 1_501, ..healthy() }, closed, "PG_OUTAGE"),
            (
                AdmissionInput { redis: CircuitState::Open, ..healthy() },
                SubmitOutcome::SystemBusy,
                "REDIS_UNAVAILABLE",
            ),
            (
                AdmissionInput { mode: mode(Mode::ShedLoad { admit_percent: 0 }), ..healthy() },
                closed,
                "MODE_SHED_LOAD",
            ),
            (
                AdmissionInput { mode: mode(Mode::Recovering { admit_percent: 0 }), ..healthy() },
                closed,
                "MODE_RECOVERING",
            ),
            (AdmissionInput { in_flight: 10, ..healthy() }, SubmitOutcome::Overloaded, "IN_FLIGHT"),
        ];
        for (input, outcome, why) in rows {
            assert_eq!(reason(decide(input)), Some((outcome, why)), "{input:?}");
        }
    }

    #[test]
    fn budgets_are_inclusive_limits() {
        let backlog = healthy().backlog;
        let at_limit = AdmissionInput {
            backlog: Backlog {
                oldest_pending_age_ms: 1_500,
                pending_count: 6_000,
                polled_at_ms: NOW - 1_000,
            },
            pg_outage_age_ms: 1_500,
            in_flight: 9,
            ..healthy()
        };
        assert_eq!(decide(at_limit), Decision::Admit);
        // A sample from the "future" (clocks of two threads) is fresh, not unknown.
        let future =
            AdmissionInput { backlog: Backlog { polled_at_ms: NOW + 5, ..backlog }, ..healthy() };
        assert_eq!(decide(future), Decision::Admit);
    }

    #[test]
    fn first_matching_rule_answers() {
        // Redis down AND the log down: SUBMIT_CLOSED (seed §7.11: Redis + MQ → close).
        let both = AdmissionInput {
            redis: CircuitState::Open,
            log_publish: CircuitState::Open,
            ..healthy()
        };
        assert_eq!(reason(decide(both)), Some((SubmitOutcome::SubmitClosed, "LOG_UNAVAILABLE")));
        // An operator's closure names itself even when dependencies are down too.
        let all = AdmissionInput { mode: mode(Mode::QueryOnly), in_flight: 99, ..both };
        assert_eq!(reason(decide(all)), Some((SubmitOutcome::SubmitClosed, "MODE_QUERY_ONLY")));
    }

    #[test]
    fn retry_after_is_jittered_within_bounds() {
        let input = AdmissionInput { mode: mode(Mode::SubmitClosed), ..healthy() };
        let at = |draw| match decide(AdmissionInput { draw, ..input }) {
            Decision::Reject { retry_after_ms, .. } => retry_after_ms,
            Decision::Admit => panic!("closed"),
        };
        assert_eq!(at(0), 2_000);
        assert_eq!(at(0xffff_ffff), 2_999);
        assert_eq!(at(0x8000_0000), 2_500);
        assert_eq!(jittered(1, u64::MAX), 1);
        assert_eq!(jittered(0, u64::MAX), 1, "never zero");
    }

    #[test]
    fn share_mapping() {
        assert!(!in_share(0, 0));
        assert!(in_share(0, 1));
        assert!(in_share(u64::MAX, 100));
        assert!(!in_share(u64::MAX, 99));
        // The high half of the draw decides; the low half only jitters.
        assert!(in_share(0x0000_0000_ffff_ffff, 1));
    }

    #[test]
    fn default_budgets_follow_the_derivation() {
        let b = Budgets::default();
        assert_eq!(
            (b.backlog_sample_age_max_ms, b.oldest_pending_age_max_ms, b.pending_count_max),
            (1_000, 1_500, 6_000)
        );
        assert!(b.validate().is_ok());
        let impossible = Budgets::derive(SloBasis { order_create_ms: 2_500, ..SloBasis::MEASURED });
        assert_eq!(impossible.oldest_pending_age_max_ms, 0);
        assert!(impossible.validate().is_err());
        let faster = Budgets::derive(SloBasis { drain_orders_per_s: 10_000, ..SloBasis::MEASURED });
        assert_eq!(faster.pending_count_max, 15_000);
    }

    // --- properties -------------------------------------------------------------------------

    fn any_mode() -> impl Strategy<Value = EffectiveMode> {
        let m = prop_oneof![
            3 => Just(Mode::Normal),
            1 => Just(Mode::SubmitClosed),
            1 => Just(Mode::QueryOnly),
            1 => (0u8..=100).prop_map(|p| Mode::ShedLoad { admit_percent: p }),
            1 => (0u8..=100).prop_map(|p| Mode::Recovering { admit_percent: p }),
        ];
        (m, 0u8..10).prop_map(|(m, s)| match s {
            0 => EffectiveMode::NO_SNAPSHOT,
            1 => EffectiveMode {
                mode: Mode::SubmitClosed,
                source: ModeSource::Expired { scope: Scope::Global, version: 1 },
            },
            2 => EffectiveMode {
                mode: Mode::SubmitClosed,
                source: ModeSource::Unverifiable { scope: Scope::Global, version: 1 },
            },
            _ => mode(m),
        })
    }

    fn any_circuit() -> impl Strategy<Value = CircuitState> {
        prop_oneof![
            4 => Just(CircuitState::Closed),
            1 => Just(CircuitState::HalfOpen),
            1 => Just(CircuitState::Open),
        ]
    }

    fn circuit_rank(c: CircuitState) -> u8 {
        c.metric_value()
    }

    prop_compose! {
        fn any_input()(
            mode in any_mode(),
            redis in any_circuit(),
            log_publish in any_circuit(),
            // Each input healthy most of the time, so that "all healthy but one" is common
            // and every rule is exercised alone, near its boundary.
            age in prop_oneof![3 => 0u64..=1_500, 1 => 0u64..3_000],
            count in prop_oneof![3 => 0u64..=6_000, 1 => 0u64..12_000],
            polled_ago in prop_oneof![
                4 => (0u64..=1_000).prop_map(Some),
                1 => Just(None),
                1 => (0u64..2_000).prop_map(Some),
            ],
            pg in prop_oneof![3 => 0u64..=1_500, 1 => 0u64..3_000],
            in_flight in 0u32..12,
            in_flight_max in 1u32..20,
            draw in any::<u64>(),
        ) -> AdmissionInput {
            AdmissionInput {
                mode, redis, log_publish,
                backlog: Backlog {
                    oldest_pending_age_ms: age,
                    pending_count: count,
                    polled_at_ms: polled_ago.map_or(0, |ago| NOW - ago),
                },
                pg_outage_age_ms: pg, in_flight, in_flight_max, draw,
            }
        }
    }

    /// The trivial model: all conditions at once, no order.
    fn model_admits(x: &AdmissionInput, b: &Budgets) -> bool {
        let fresh = x.backlog.polled_at_ms != 0
            && NOW.saturating_sub(x.backlog.polled_at_ms) <= b.backlog_sample_age_max_ms;
        let share_ok = {
            let slot = ((x.draw >> 32) as u128 * 100) >> 32;
            slot < u128::from(x.mode.admit_percent())
        };
        !x.mode.closes_submissions()
            && x.log_publish != CircuitState::Open
            && fresh
            && x.backlog.oldest_pending_age_ms <= b.oldest_pending_age_max_ms
            && x.backlog.pending_count <= b.pending_count_max
            && x.pg_outage_age_ms <= b.pg_outage_age_max_ms
            && x.redis != CircuitState::Open
            && share_ok
            && x.in_flight < x.in_flight_max
    }

    /// Makes `x` worse (or equal) field by field, driven by `w`.
    fn worsen(x: &AdmissionInput, w: &[u64; 8], other_mode: EffectiveMode) -> AdmissionInput {
        let mut y = *x;
        if other_mode.admit_percent() <= x.mode.admit_percent()
            && (other_mode.closes_submissions() || !x.mode.closes_submissions())
        {
            y.mode = other_mode;
        }
        let up = |c: CircuitState, k: u64| match (circuit_rank(c) as u64 + k % 3).min(2) {
            0 => CircuitState::Closed,
            1 => CircuitState::HalfOpen,
            _ => CircuitState::Open,
        };
        y.redis = up(x.redis, w[0]);
        y.log_publish = up(x.log_publish, w[1]);
        y.backlog.oldest_pending_age_ms += w[2] % 1_000;
        y.backlog.pending_count += w[3] % 4_000;
        if w[4].is_multiple_of(5) {
            y.backlog.polled_at_ms = 0;
        } else if x.backlog.polled_at_ms != 0 {
            y.backlog.polled_at_ms -= (w[4] % 700).min(x.backlog.polled_at_ms - 1);
        }
        y.pg_outage_age_ms += w[5] % 1_000;
        y.in_flight += (w[6] % 5) as u32;
        y.in_flight_max -= ((w[7] % 5) as u32).min(x.in_flight_max - 1);
        y
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1_024, ..ProptestConfig::default() })]

        /// decide_submit agrees with the model; rejections carry a Retry-After and the
        /// outcome its rule names.
        #[test]
        fn agrees_with_the_model(x in any_input()) {
            let b = Budgets::default();
            let d = decide_submit(&x, &b, NOW);
            prop_assert_eq!(d.is_admit(), model_admits(&x, &b), "{:?} -> {:?}", x, d);
            if let Decision::Reject { outcome, retry_after_ms, reason } = d {
                prop_assert!(retry_after_ms >= 1);
                prop_assert!(REJECT_REASONS.contains(&reason), "{} not in REJECT_REASONS", reason);
                prop_assert!(matches!(outcome,
                    SubmitOutcome::SubmitClosed | SubmitOutcome::SystemBusy | SubmitOutcome::Overloaded));
                prop_assert_eq!(outcome == SubmitOutcome::SystemBusy, reason == "REDIS_UNAVAILABLE");
                prop_assert_eq!(outcome == SubmitOutcome::Overloaded, reason == "IN_FLIGHT");
                if outcome == SubmitOutcome::SystemBusy { prop_assert_eq!(x.redis, CircuitState::Open); }
                if outcome == SubmitOutcome::Overloaded { prop_assert!(x.in_flight >= x.in_flight_max); }
            }
        }

        /// Monotone: a worse input never turns a rejection into an admission.
        #[test]
        fn monotone(x in any_input(), w in any::<[u64; 8]>(), other in any_mode()) {
            let b = Budgets::default();
            let y = worsen(&x, &w, other);
            if !decide_submit(&x, &b, NOW).is_admit() {
                prop_assert!(!decide_submit(&y, &b, NOW).is_admit(), "{:?} rejected but {:?} admitted", x, y);
            }
        }

        /// Fail closed: an unknown backlog (never polled or stale), an expired or unverifiable
        /// control state, QUERY_ONLY and SUBMIT_CLOSED never admit — so they never admit where
        /// the known-bad value (a backlog over budget, SUBMIT_CLOSED) would reject.
        #[test]
        fn unknown_and_closed_never_admit(x in any_input(), stale_by in 1u64..1_000_000) {
            let b = Budgets::default();
            let never = AdmissionInput { backlog: Backlog::NEVER_POLLED, ..x };
            prop_assert!(!decide_submit(&never, &b, NOW).is_admit());
            let stale = AdmissionInput {
                backlog: Backlog {
                    polled_at_ms: NOW - b.backlog_sample_age_max_ms - stale_by.min(NOW - b.backlog_sample_age_max_ms - 1),
                    ..x.backlog
                },
                ..x
            };
            prop_assert!(!decide_submit(&stale, &b, NOW).is_admit());
            for source in [
                ModeSource::Expired { scope: Scope::Global, version: 1 },
                ModeSource::Unverifiable { scope: Scope::Global, version: 1 },
            ] {
                // Even a (mis)constructed NORMAL from an expired source closes.
                for m in [Mode::Normal, Mode::SubmitClosed] {
                    let y = AdmissionInput { mode: EffectiveMode { mode: m, source }, ..x };
                    prop_assert!(!decide_submit(&y, &b, NOW).is_admit());
                }
            }
            for m in [Mode::QueryOnly, Mode::SubmitClosed] {
                let y = AdmissionInput { mode: mode(m), ..x };
                let d = decide_submit(&y, &b, NOW);
                let closed = matches!(d, Decision::Reject { outcome: SubmitOutcome::SubmitClosed, .. });
                prop_assert!(closed, "{:?}", d);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Over many random draws the admitted share of SHED_LOAD / RECOVERING converges to
        /// the configured percentage (±1.5 points over 40,000 draws; ≥ 4 standard deviations).
        #[test]
        fn admitted_share_converges(percent in 0u8..=100, seed in any::<u64>(), recovering in any::<bool>()) {
            let m = if recovering {
                Mode::Recovering { admit_percent: percent }
            } else {
                Mode::ShedLoad { admit_percent: percent }
            };
            let b = Budgets::default();
            let mut state = seed;
            let n = 40_000u32;
            let mut admitted = 0u32;
            for _ in 0..n {
                let x = AdmissionInput { mode: mode(m), draw: splitmix(&mut state), ..healthy() };
                match decide_submit(&x, &b, NOW) {
                    Decision::Admit => admitted += 1,
                    Decision::Reject { outcome, .. } => prop_assert_eq!(outcome, SubmitOutcome::SubmitClosed),
                }
            }
            let share = f64::from(admitted) / f64::from(n) * 100.0;
            prop_assert!((share - f64::from(percent)).abs() < 1.5, "{share} vs {percent}");
            if percent == 0 { prop_assert_eq!(admitted, 0); }
            if percent == 100 { prop_assert_eq!(admitted, n); }
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
