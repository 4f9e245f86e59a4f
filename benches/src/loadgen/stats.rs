//! What the run measured: latency histograms (overall and per response state), counts, the
//! per-second timeline, error counts, and what the generator learned about reservations.
//!
//! What it is: [`Recorder`] (one per event-loop thread, owned by it: no lock on the hot path;
//! the driver merges them after the run) and [`Seen`] (reservation ids by user, for the
//! checks after the run). Latency is in microseconds, HdrHistogram with 3 significant digits,
//! from the request's INTENDED send time, so time spent queued behind a busy connection is
//! part of it (no coordinated omission).
//!
//! Two views of the answers (issue 24 item 3): per ATTEMPT (`counts`, `by_state`: every answer,
//! retries included, each from its own intended send) and per INTENT (a buyer's click: its
//! FIRST answer, its FINAL answer — the last one, after which it did not retry — and its time
//! to that final answer from its first intended send, retry waits included).
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

/// Requests due, written and answered in one second of the run, and what the answers were.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SecondCounts {
    pub second: u32,
    /// Requests whose intended send time falls in this second (the schedule itself).
    pub scheduled: u64,
    /// Requests written (retries included).
    pub sent: u64,
    /// Answers read (retries included); the four kinds below add up to it.
    pub answered: u64,
    /// `QUEUED` / `QUEUED_PENDING` answers (replays included).
    #[serde(default)]
    pub accepted: u64,
    #[serde(default)]
    pub sold_out: u64,
    /// `OVERLOADED` answers: the engine shed the request.
    #[serde(default)]
    pub shed: u64,
    /// Every other answer: `DUPLICATE_USER`, `RATE_LIMITED`, `SUBMIT_CLOSED`,
    /// `SYSTEM_BUSY`, `UNKNOWN`, refusals and `OTHER`.
    #[serde(default)]
    pub other: u64,
}

impl SecondCounts {
    fn add(&mut self, o: &SecondCounts) {
        self.scheduled += o.scheduled;
        self.sent += o.sent;
        self.answered += o.answered;
        self.accepted += o.accepted;
        self.sold_out += o.sold_out;
        self.shed += o.shed;
        self.other += o.other;
    }
}

/// How the intents (scheduled requests, one buyer's click each) ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IntentCounts {
    /// Intents whose last attempt was answered (their final answer is in `final_counts`).
    pub final_answered: u64,
    /// Intents whose last attempt got no answer: a broken connection or a timeout.
    pub failed: u64,
    /// Intents never sent: due while the send queue was full.
    pub dropped: u64,
    /// Intents still queued (never written) when the run stopped waiting.
    pub unsent: u64,
    /// Intents retried at least once.
    pub retried: u64,
    /// Final answers that were worth retrying but ended the intent, and why: `retry_max`
    /// retries made, the budget would be exceeded, the retry queue was full, the run ended
    /// while the retry waited. Retries off: none of these count.
    pub gave_up_retry_max: u64,
    pub gave_up_budget: u64,
    pub gave_up_queue_full: u64,
    pub gave_up_run_end: u64,
}

impl IntentCounts {
    fn add(&mut self, o: &IntentCounts) {
        self.final_answered += o.final_answered;
        self.failed += o.failed;
        self.dropped += o.dropped;
        self.unsent += o.unsent;
        self.retried += o.retried;
        self.gave_up_retry_max += o.gave_up_retry_max;
        self.gave_up_budget += o.gave_up_budget;
        self.gave_up_queue_full += o.gave_up_queue_full;
        self.gave_up_run_end += o.gave_up_run_end;
    }
}

/// Why an intent's final answer ended it (for [`IntentCounts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// A final answer by its nature (or retries off).
    Settled,
    RetryMax,
    Budget,
    QueueFull,
    RunEnd,
}

/// One answer as [`Recorder::on_answer`] records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnswerRecord {
    /// When it arrived, µs into the run.
    pub elapsed_us: u64,
    /// From this attempt's intended send time to the answer.
    pub latency_us: u64,
    pub http_status: u16,
    pub state: State,
    pub replayed: bool,
    /// 0 for the first send of the intent, n for its n-th retry.
    pub attempt: u32,
}

/// Attempts per intent counted one by one (`final_attempts[n]`: intents that ended after n
/// attempts); more fold into the last (beyond the retry bound, so never in practice).
pub const ATTEMPTS_TRACKED_MAX: usize = 16;

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

/// Statuses counted one by one: every three-digit status (the response parser takes exactly
/// three digits, `http.rs`).
pub const HTTP_STATUS_SLOTS: usize = 1_000;

/// Answers per HTTP status: a counter per possible status, so that counting an answer is an
/// index, not a hash (a `HashMap<u16, u64>` with SipHash was ~3% of the generator's own
/// instructions per answer).
#[derive(Debug, Clone)]
pub struct StatusCounts(Box<[u64; HTTP_STATUS_SLOTS]>);

impl Default for StatusCounts {
    fn default() -> Self {
        StatusCounts(Box::new([0; HTTP_STATUS_SLOTS]))
    }
}

impl StatusCounts {
    /// Counts `n` answers of `status`; a status outside `0..1000` (which the parser never
    /// yields) is counted as 999 rather than lost.
    pub fn add(&mut self, status: u16, n: u64) {
        self.0[usize::from(status).min(HTTP_STATUS_SLOTS - 1)] += n;
    }

    pub fn get(&self, status: u16) -> u64 {
        self.0.get(usize::from(status)).copied().unwrap_or(0)
    }

    /// `(status, answers)` for every status seen, in status order.
    pub fn iter(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        self.0.iter().enumerate().filter(|(_, n)| **n > 0).map(|(s, n)| (s as u16, *n))
    }
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
    pub http_status: StatusCounts,
    /// When the first SOLD_OUT answer arrived, µs into the run: the end of the selling
    /// phase (`flashsale demo` splits its CPU table there).
    pub first_sold_out_us: Option<u64>,
    /// Each intent's first answer, per state.
    pub first_counts: [u64; State::COUNT],
    /// Each intent's final answer, per state.
    pub final_counts: [u64; State::COUNT],
    /// Each intent's time from its first intended send to its final answer (retry waits
    /// included), overall and by final state.
    pub time_to_final: Histogram<u64>,
    pub time_to_final_by_state: Vec<Histogram<u64>>,
    /// `final_attempts[n]`: answered intents that took n attempts (index 0 unused).
    pub final_attempts: [u64; ATTEMPTS_TRACKED_MAX + 1],
    pub intents: IntentCounts,
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
            http_status: StatusCounts::default(),
            first_sold_out_us: None,
            first_counts: [0; State::COUNT],
            final_counts: [0; State::COUNT],
            time_to_final: latency_histogram(),
            time_to_final_by_state: (0..State::COUNT).map(|_| latency_histogram()).collect(),
            final_attempts: [0; ATTEMPTS_TRACKED_MAX + 1],
            intents: IntentCounts::default(),
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

    /// An answer arrived (any attempt).
    pub fn on_answer(&mut self, a: &AnswerRecord) {
        let value = a.latency_us.max(1);
        let i = a.state.index();
        self.overall.saturating_record(value);
        self.by_state[i].saturating_record(value);
        self.counts[i] += 1;
        if a.replayed {
            self.replayed[i] += 1;
        }
        if a.attempt == 0 {
            self.first_counts[i] += 1;
        }
        self.answered += 1;
        if a.state == State::SoldOut {
            let first = self.first_sold_out_us.get_or_insert(a.elapsed_us);
            *first = (*first).min(a.elapsed_us);
        }
        self.http_status.add(a.http_status, 1);
        let second = self.second(a.elapsed_us);
        second.answered += 1;
        match a.state {
            s if s.is_reserved() => second.accepted += 1,
            State::SoldOut => second.sold_out += 1,
            s if s.is_shed() => second.shed += 1,
            _ => second.other += 1,
        }
    }

    /// An intent ended with `state` as its final answer, after `attempts` attempts and
    /// `time_to_final_us` from its first intended send.
    pub fn on_final(&mut self, state: State, time_to_final_us: u64, attempts: u32, why: Ending) {
        let value = time_to_final_us.max(1);
        self.final_counts[state.index()] += 1;
        self.time_to_final.saturating_record(value);
        self.time_to_final_by_state[state.index()].saturating_record(value);
        self.final_attempts[(attempts as usize).clamp(1, ATTEMPTS_TRACKED_MAX)] += 1;
        let n = &mut self.intents;
        n.final_answered += 1;
        if attempts > 1 {
            n.retried += 1;
        }
        match why {
            Ending::Settled => {}
            Ending::RetryMax => n.gave_up_retry_max += 1,
            Ending::Budget => n.gave_up_budget += 1,
            Ending::QueueFull => n.gave_up_queue_full += 1,
            Ending::RunEnd => n.gave_up_run_end += 1,
        }
    }

    /// An intent ended without a final answer: its last attempt was lost (broken
    /// connection, timeout); `retried` when that was not its first attempt.
    pub fn on_failed(&mut self, attempt: u32) {
        self.intents.failed += 1;
        if attempt > 0 {
            self.intents.retried += 1;
        }
    }

    /// Adds another loop's measurements to these (histograms have the same bounds).
    pub fn merge(&mut self, o: &Recorder) {
        let add = |h: &mut Histogram<u64>, o: &Histogram<u64>| {
            // Same bounds by construction (`latency_histogram`), so `add` cannot fail.
            let _ = h.add(o);
        };
        add(&mut self.overall, &o.overall);
        for (h, oh) in self.by_state.iter_mut().zip(&o.by_state) {
            add(h, oh);
        }
        add(&mut self.send_lag, &o.send_lag);
        add(&mut self.dispatch_lag, &o.dispatch_lag);
        add(&mut self.time_to_final, &o.time_to_final);
        for (h, oh) in self.time_to_final_by_state.iter_mut().zip(&o.time_to_final_by_state) {
            add(h, oh);
        }
        for i in 0..State::COUNT {
            self.counts[i] += o.counts[i];
            self.replayed[i] += o.replayed[i];
            self.first_counts[i] += o.first_counts[i];
            self.final_counts[i] += o.final_counts[i];
        }
        for (a, b) in self.final_attempts.iter_mut().zip(&o.final_attempts) {
            *a += b;
        }
        if self.timeline.len() < o.timeline.len() {
            let from = self.timeline.len();
            self.timeline.extend(
                o.timeline[from..]
                    .iter()
                    .map(|s| SecondCounts { second: s.second, ..Default::default() }),
            );
        }
        for (a, b) in self.timeline.iter_mut().zip(&o.timeline) {
            a.add(b);
        }
        let e = &mut self.errors;
        e.connect += o.errors.connect;
        e.io += o.errors.io;
        e.timeout += o.errors.timeout;
        e.protocol += o.errors.protocol;
        self.sent += o.sent;
        self.retries_sent += o.retries_sent;
        self.answered += o.answered;
        for (status, n) in o.http_status.iter() {
            self.http_status.add(status, n);
        }
        self.first_sold_out_us = match (self.first_sold_out_us, o.first_sold_out_us) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.intents.add(&o.intents);
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
        let answer = |elapsed_us, latency_us, state, attempt| AnswerRecord {
            elapsed_us,
            latency_us,
            http_status: 200,
            state,
            replayed: false,
            attempt,
        };
        let mut r = Recorder::new();
        for i in 0..1_000u64 {
            r.on_sent(i * 2_000, 10, false);
            r.on_answer(&answer(i * 2_000 + 500, (i + 1) * 1_000, State::SoldOut, 0));
        }
        r.on_answer(&AnswerRecord {
            http_status: 202,
            replayed: true,
            ..answer(2_500_000, 5_000, State::Queued, 0)
        });
        assert_eq!((r.sent, r.answered), (1_000, 1_001));
        assert_eq!(r.first_sold_out_us, Some(500));
        assert_eq!((r.count(State::SoldOut), r.count(State::Queued)), (1_000, 1));
        assert_eq!(r.replayed[State::Queued.index()], 1);
        assert_eq!(r.timeline.len(), 3);
        assert_eq!(
            r.timeline[0],
            SecondCounts {
                second: 0,
                sent: 500,
                answered: 500,
                sold_out: 500,
                ..SecondCounts::default()
            }
        );
        assert_eq!((r.timeline[2].accepted, r.timeline[2].answered), (1, 1));
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
        r.on_answer(&answer(0, u64::MAX, State::Other, 0));
        assert_eq!(LatencySummary::of(&r.by_state[State::Other.index()]).count, 1);
        assert_eq!(r.timeline[0].other, 1);
    }

    /// First answers count attempt 0 only; final answers and the time to them count once
    /// per intent; the per-second split adds up; two loops' recorders merge into the sum.
    #[test]
    fn first_and_final_answers_per_intent_and_merge() {
        let answer = |elapsed_us, state, attempt| AnswerRecord {
            elapsed_us,
            latency_us: 1_000,
            http_status: 429,
            state,
            replayed: false,
            attempt,
        };
        let mut a = Recorder::new();
        // Intent 1: shed, shed, accepted after 0.6 s.
        a.on_answer(&answer(1_000, State::Overloaded, 0));
        a.on_answer(&answer(300_000, State::Overloaded, 1));
        a.on_answer(&answer(600_000, State::Queued, 2));
        a.on_final(State::Queued, 600_000, 3, Ending::Settled);
        // Intent 2: sold out at once.
        a.on_answer(&answer(2_000, State::SoldOut, 0));
        a.on_final(State::SoldOut, 1_000, 1, Ending::Settled);
        // Intent 3: shed, then its retry was lost with its connection.
        a.on_answer(&answer(3_000, State::Overloaded, 0));
        a.on_failed(1);
        assert_eq!(a.first_counts[State::Overloaded.index()], 2);
        assert_eq!(a.first_counts[State::SoldOut.index()], 1);
        assert_eq!(a.first_counts.iter().sum::<u64>(), 3);
        assert_eq!(a.final_counts[State::Queued.index()], 1);
        assert_eq!(a.final_counts.iter().sum::<u64>(), 2);
        assert_eq!((a.final_attempts[1], a.final_attempts[3]), (1, 1));
        assert_eq!((a.intents.final_answered, a.intents.failed, a.intents.retried), (2, 1, 2));
        let t = &a.timeline[0];
        assert_eq!((t.accepted, t.sold_out, t.shed, t.other, t.answered), (1, 1, 3, 0, 5));
        assert_eq!(LatencySummary::of(&a.time_to_final).count, 2);
        let queued = LatencySummary::of(&a.time_to_final_by_state[State::Queued.index()]);
        assert!((queued.max - 600.0).abs() < 1.0, "{queued:?}");

        let mut b = Recorder::new();
        b.on_answer(&answer(2_500_000, State::SystemBusy, 0));
        b.on_final(State::SystemBusy, 1_000, 1, Ending::RetryMax);
        b.errors.io = 2;
        let mut merged = Recorder::new();
        merged.merge(&a);
        merged.merge(&b);
        assert_eq!(merged.answered, 6);
        assert_eq!(merged.count(State::Overloaded), 3);
        assert_eq!(merged.final_counts.iter().sum::<u64>(), 3);
        assert_eq!(merged.intents.gave_up_retry_max, 1);
        assert_eq!(merged.errors.io, 2);
        assert_eq!(merged.timeline.len(), 3);
        assert_eq!(merged.timeline[2].other, 1);
        assert_eq!(merged.time_to_final.len(), 3);
        assert_eq!(merged.first_sold_out_us, Some(2_000));
        assert_eq!(merged.http_status.iter().collect::<Vec<_>>(), vec![(429, 6)]);
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
