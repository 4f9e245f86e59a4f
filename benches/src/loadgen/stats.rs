//! What the run measured: latency histograms (overall and per response state), counts, the
//! per-second timeline, error counts, and what the generator learned about reservations.
//!
//! What it is: [`Recorder`] (one per run, behind a mutex in the driver: a record is a few
//! array increments, far cheaper than the socket work around it) and [`Seen`] (reservation
//! ids by user, for the checks after the run). Latency is in microseconds, HdrHistogram with
//! 3 significant digits, from the request's INTENDED send time, so time spent queued behind a
//! busy connection is part of it (no coordinated omission).
//!
//! What it is not: the clock (times are arguments), the report format (`report.rs`).
//!
//! Read next: `report.rs`.

use std::collections::HashMap;

use hdrhistogram::Histogram;

use super::http::State;

/// Highest latency recorded exactly (60 s, in µs); above it values saturate. The request
/// timeout is capped below it (`config.rs`), so only pathological waits saturate.
pub const LATENCY_US_MAX: u64 = 60_000_000;
/// Seconds of timeline kept (an hour); later seconds are folded into the last one.
pub const TIMELINE_SECONDS_MAX: usize = 3_600;
/// Reservation ids remembered for the post-run checks; beyond it tracking stops and the
/// report says so (the checks then cover the first ones only).
pub const SEEN_RESERVATIONS_MAX: usize = 2_000_000;

/// Percentiles of one histogram, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl LatencySummary {
    pub fn of(h: &Histogram<u64>) -> LatencySummary {
        let ms = |us: u64| us as f64 / 1_000.0;
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
        }
    }
}

/// A fresh latency histogram (µs, 1 µs .. 60 s, 3 significant digits).
pub fn latency_histogram() -> Histogram<u64> {
    // The bounds are constants that satisfy the library's preconditions (low ≥ 1,
    // high ≥ 2 × low, 0 < sigfig ≤ 5), so this cannot fail.
    Histogram::new_with_bounds(1, LATENCY_US_MAX, 3).unwrap_or_else(|_| unreachable!())
}

/// Requests due, written and answered in one second of the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SecondCounts {
    pub second: u32,
    /// Requests whose intended send time falls in this second (the schedule itself).
    pub scheduled: u64,
    pub sent: u64,
    pub answered: u64,
}

/// Errors outside the HTTP answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ErrorCounts {
    /// Connection attempts that failed.
    pub connect: u64,
    /// Requests lost to a broken connection (reset, EOF, `Connection: close` with more
    /// requests pipelined behind it) after they were written.
    pub io: u64,
    /// Requests with no answer within the request timeout.
    pub timeout: u64,
    /// Responses the client could not parse (the connection is then closed).
    pub protocol: u64,
}

/// The run's measurements.
pub struct Recorder {
    pub overall: Histogram<u64>,
    pub by_state: Vec<Histogram<u64>>,
    pub counts: [u64; State::COUNT],
    /// Answers with `replayed: true`, per state.
    pub replayed: [u64; State::COUNT],
    /// How late requests were written relative to their intended time (the generator's own
    /// lag plus queueing behind busy connections).
    pub send_lag: Histogram<u64>,
    /// How late the dispatcher released requests (the generator's own lag alone).
    pub dispatch_lag: Histogram<u64>,
    pub timeline: Vec<SecondCounts>,
    pub errors: ErrorCounts,
    pub sent: u64,
    pub retries_sent: u64,
    pub answered: u64,
    pub http_status: HashMap<u16, u64>,
    /// When the first SOLD_OUT answer arrived, µs into the run: the end of the selling
    /// phase (`flashsale demo` splits its CPU table there).
    pub first_sold_out_us: Option<u64>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

impl Recorder {
    pub fn new() -> Recorder {
        Recorder {
            overall: latency_histogram(),
            by_state: (0..State::COUNT).map(|_| latency_histogram()).collect(),
            counts: [0; State::COUNT],
            replayed: [0; State::COUNT],
            send_lag: latency_histogram(),
            dispatch_lag: latency_histogram(),
            timeline: Vec::new(),
            errors: ErrorCounts::default(),
            sent: 0,
            retries_sent: 0,
            answered: 0,
            http_status: HashMap::new(),
            first_sold_out_us: None,
        }
    }

    fn second(&mut self, elapsed_us: u64) -> &mut SecondCounts {
        let second = usize::try_from(elapsed_us / 1_000_000)
            .unwrap_or(usize::MAX)
            .min(TIMELINE_SECONDS_MAX - 1);
        while self.timeline.len() <= second {
            let next = self.timeline.len() as u32;
            self.timeline.push(SecondCounts { second: next, ..Default::default() });
        }
        &mut self.timeline[second]
    }

    /// `count` requests were due in `second` (from the dispatcher, after the run).
    pub fn on_scheduled(&mut self, second: usize, count: u64) {
        self.second((second as u64).saturating_mul(1_000_000)).scheduled += count;
    }

    /// A request was written `lag_us` after its intended time, `elapsed_us` into the run.
    pub fn on_sent(&mut self, elapsed_us: u64, lag_us: u64, retry: bool) {
        self.sent += 1;
        if retry {
            self.retries_sent += 1;
        }
        self.send_lag.saturating_record(lag_us.max(1));
        self.second(elapsed_us).sent += 1;
    }

    /// An answer arrived `latency_us` after the request's intended time.
    pub fn on_answer(
        &mut self,
        elapsed_us: u64,
        latency_us: u64,
        http_status: u16,
        state: State,
        replayed: bool,
    ) {
        let value = latency_us.max(1);
        self.overall.saturating_record(value);
        self.by_state[state.index()].saturating_record(value);
        self.counts[state.index()] += 1;
        if replayed {
            self.replayed[state.index()] += 1;
        }
        self.answered += 1;
        if state == State::SoldOut {
            let first = self.first_sold_out_us.get_or_insert(elapsed_us);
            *first = (*first).min(elapsed_us);
        }
        *self.http_status.entry(http_status).or_insert(0) += 1;
        self.second(elapsed_us).answered += 1;
    }

    pub fn count(&self, state: State) -> u64 {
        self.counts[state.index()]
    }
}

/// One reservation as the generator saw it answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenReservation {
    pub user: u32,
    /// The request id's sequence number (`{run_id}-{seq}`) of the first answer naming it.
    pub request_seq: u64,
    /// First state that named it (QUEUED or QUEUED_PENDING).
    pub state: State,
}

/// Reservation ids answered, by id and by user.
#[derive(Debug, Default)]
pub struct Seen {
    pub reservations: HashMap<String, SeenReservation>,
    /// Each user's reservation id, from QUEUED / QUEUED_PENDING / DUPLICATE_USER answers.
    pub by_user: HashMap<u32, String>,
    /// Users that were named two different reservation ids (one-per-user seen from the
    /// client; legitimate only after a compensation released the first).
    pub users_with_two_ids: u64,
    /// Non-replayed QUEUED / QUEUED_PENDING answers (each is a new reservation).
    pub new_reservations: u64,
    pub truncated: bool,
}

impl Seen {
    pub fn on_answer(
        &mut self,
        user: u32,
        request_seq: u64,
        state: State,
        replayed: bool,
        reservation_id: Option<&str>,
    ) {
        let Some(id) = reservation_id else { return };
        if state.is_reserved() && !replayed {
            self.new_reservations += 1;
        }
        if !(state.is_reserved() || state == State::DuplicateUser) {
            return;
        }
        if self.reservations.len() + self.by_user.len() >= 2 * SEEN_RESERVATIONS_MAX {
            self.truncated = true;
            return;
        }
        if state.is_reserved() && !self.reservations.contains_key(id) {
            self.reservations.insert(id.to_owned(), SeenReservation { user, request_seq, state });
        }
        match self.by_user.get(&user) {
            Some(known) if known != id => self.users_with_two_ids += 1,
            Some(_) => {}
            None => {
                self.by_user.insert(user, id.to_owned());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorder_counts_states_timeline_and_percentiles() {
        let mut r = Recorder::new();
        for i in 0..1_000u64 {
            r.on_sent(i * 2_000, 10, false);
            r.on_answer(i * 2_000 + 500, (i + 1) * 1_000, 200, State::SoldOut, false);
        }
        r.on_answer(2_500_000, 5_000, 202, State::Queued, true);
        assert_eq!((r.sent, r.answered), (1_000, 1_001));
        assert_eq!(r.first_sold_out_us, Some(500));
        assert_eq!((r.count(State::SoldOut), r.count(State::Queued)), (1_000, 1));
        assert_eq!(r.replayed[State::Queued.index()], 1);
        assert_eq!(r.timeline.len(), 3);
        assert_eq!(
            r.timeline[0],
            SecondCounts { second: 0, scheduled: 0, sent: 500, answered: 500 }
        );
        r.on_scheduled(1, 7);
        assert_eq!(r.timeline[1].scheduled, 7);
        assert_eq!(r.timeline[2].answered, 1);
        let s = LatencySummary::of(&r.by_state[State::SoldOut.index()]);
        assert_eq!(s.count, 1_000);
        // 1..1000 ms uniformly: p50 ≈ 500 ms, p99 ≈ 990 ms, within 3 significant digits.
        assert!((s.p50 - 500.0).abs() < 1.0, "{s:?}");
        assert!((s.p99 - 990.0).abs() < 1.0, "{s:?}");
        assert!((s.max - 1_000.0).abs() < 1.0, "{s:?}");
        assert_eq!(LatencySummary::of(&r.overall).count, 1_001);
        // Far beyond the histogram's range: saturates instead of failing.
        r.on_answer(0, u64::MAX, 200, State::Other, false);
        assert_eq!(LatencySummary::of(&r.by_state[State::Other.index()]).count, 1);
    }

    #[test]
    fn seen_tracks_new_reservations_and_users() {
        let mut seen = Seen::default();
        seen.on_answer(1, 10, State::Queued, false, Some("resv_a"));
        seen.on_answer(1, 10, State::Queued, true, Some("resv_a"));
        seen.on_answer(1, 11, State::DuplicateUser, false, Some("resv_a"));
        seen.on_answer(2, 12, State::QueuedPending, false, Some("resv_b"));
        seen.on_answer(3, 13, State::SoldOut, false, None);
        assert_eq!(seen.new_reservations, 2);
        assert_eq!(seen.reservations.len(), 2);
        assert_eq!(seen.reservations["resv_a"].request_seq, 10);
        assert_eq!(seen.users_with_two_ids, 0);
        seen.on_answer(2, 14, State::DuplicateUser, false, Some("resv_c"));
        assert_eq!(seen.users_with_two_ids, 1);
    }
}
