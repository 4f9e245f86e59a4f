//! The run's report: one serialisable [`Report`] (the `--json` file), its text summary, and
//! the percentile curves the picture is drawn from.
//!
//! JSON fields (issue 5): `sent`, `achieved_rps`, `latency_ms {p50,p90,p99,p999,max}` overall
//! and `latency_ms_by_state`, `counts` per state, `errors`, `dropped`, `orders_created`,
//! `orders_within_3s_ratio` and `invariants {no_oversell, one_per_user, tokens_conserved,
//! nothing_lost, ok}` — the last three `null` when the stores were not checked.
//!
//! Per attempt vs per buyer (issue 24 item 3): `counts`, `latency_ms*` count every answer,
//! retries included, each from its own intended send. `first_counts` / `final_counts` count
//! each intent's (a buyer's click's) first and final answer; `time_to_final_ms` (and
//! `_by_state`, by final state) is each intent's time from its first intended send to its
//! final answer, retry waits included; `intents` says how the others ended. `throughput[]`
//! splits each second's answers into `accepted`, `sold_out`, `shed` (OVERLOADED), `other`.
//! `client_cpu` is the generator's own CPU per answer (issue 25 item 5).
//!
//! Read next: `svg.rs`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use hdrhistogram::Histogram;

use super::driver::{Measured, TraceEntry};
use super::http::State;
use super::stats::{ErrorCounts, IntentCounts, LatencySummary, SecondCounts, ATTEMPTS_TRACKED_MAX};
use super::verify::{Invariants, OrderView, RedisView, Verification};

/// Points per percentile curve: x from 0 to 4 "nines" (0% .. 99.99%) in steps of 0.05.
const CURVE_STEPS: u32 = 80;
const CURVE_NINES_MAX: f64 = 4.0;
/// Lost reservation ids printed in the text summary.
const LOST_IDS_SHOWN: usize = 5;

/// How the run was set up (echoed in the report so a JSON file stands on its own).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunInfo {
    pub run_id: String,
    pub target: String,
    pub activity_id: u64,
    pub sku_id: u64,
    pub profile: String,
    pub target_rps: u64,
    pub duration_s: f64,
    pub connections: usize,
    pub pipeline: usize,
    pub users: u32,
    pub duplicate_ratio: f64,
    pub retry: String,
    pub seed: u64,
    /// Event-loop threads of the generator.
    #[serde(default)]
    pub threads: usize,
}

/// How the scheduled intents ended (each is one buyer's click).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IntentReport {
    /// Intents the schedule released (`scheduled`).
    pub scheduled: u64,
    #[serde(flatten)]
    pub counts: IntentCounts,
    /// Answered intents by the number of attempts they took (`"1"`: answered at once).
    pub attempts: BTreeMap<String, u64>,
}

/// The generator's own CPU over the run (from before its connections opened to after its
/// last answer; `/proc/self/stat`, every thread).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClientCpu {
    pub cpu_s: f64,
    /// CPU per answer read (retries included), µs: the instrument's cost per request, to be
    /// held against wrk's (`benches/client-cost.sh`).
    pub us_per_answer: Option<f64>,
}

/// One point of a percentile curve: x in "nines" (`-log10(1 - p)`), the percentile, ms.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CurvePoint {
    pub nines: f64,
    pub percentile: f64,
    pub ms: f64,
}

/// The run's moments: the schedule's zero on the wall clock, and the first SOLD_OUT and the
/// last answer relative to it. `flashsale demo` splits its CPU table into the selling phase
/// (zero .. first SOLD_OUT) and the sold-out phase (.. last answer) with these.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunTiming {
    /// µs since the Unix epoch.
    pub started_unix_us: u64,
    /// µs after the start; `None` when nothing was answered SOLD_OUT.
    pub first_sold_out_us: Option<u64>,
    /// µs after the start.
    pub last_answer_us: u64,
}

/// The adaptive limit at one moment of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AdmissionPoint {
    /// ms since the run's start (negative: sampled before it; dropped).
    pub t_ms: u64,
    pub limit: u64,
    pub ready: bool,
    /// Answers shed by the limit since the run started.
    pub shed: u64,
}

/// Everything a run produced.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Report {
    pub run: RunInfo,
    /// Requests the schedule released.
    pub scheduled: u64,
    /// Scheduled requests written to a connection (duplicates included, retries not).
    pub sent: u64,
    pub retries_sent: u64,
    pub answered: u64,
    /// Requests due while the send queue was full (and retries that found it full).
    pub dropped: u64,
    /// Requests still queued when the run stopped waiting (the target never took them).
    pub unsent: u64,
    /// Answers per second, from the schedule's start to the last answer.
    pub achieved_rps: f64,
    /// Requests written per second, from the start to the last write.
    pub sent_rps: f64,
    pub latency_ms: LatencySummary,
    pub latency_ms_by_state: BTreeMap<String, LatencySummary>,
    /// How late requests were written relative to their intended time (generator lag and
    /// queueing behind busy connections; included in the latencies above).
    pub send_lag_ms: LatencySummary,
    /// How late the generator's dispatcher released requests (its own lag alone; included in
    /// `send_lag_ms`). Well above 0.1 ms means the generator, not the target, was the limit.
    pub dispatch_lag_ms: LatencySummary,
    /// Every answer per state (retries included).
    pub counts: BTreeMap<String, u64>,
    /// Each intent's first answer, per state.
    #[serde(default)]
    pub first_counts: BTreeMap<String, u64>,
    /// Each intent's final answer (its last; it was not retried after it), per state.
    #[serde(default)]
    pub final_counts: BTreeMap<String, u64>,
    /// How the intents ended.
    #[serde(default)]
    pub intents: IntentReport,
    /// Each answered intent's time from its first intended send to its final answer, retry
    /// waits included (the buyer's wait), overall and by final state.
    #[serde(default)]
    pub time_to_final_ms: LatencySummary,
    #[serde(default)]
    pub time_to_final_ms_by_state: BTreeMap<String, LatencySummary>,
    /// `time_to_final_ms` by percentile (the picture's dashed curve).
    #[serde(default)]
    pub time_to_final_curve: Vec<CurvePoint>,
    /// Answers with `replayed: true`, per state.
    pub replayed: BTreeMap<String, u64>,
    pub http_status: BTreeMap<String, u64>,
    pub errors: ErrorCounts,
    /// Non-replayed QUEUED / QUEUED_PENDING answers.
    pub reservations_new: u64,
    /// Distinct reservation ids answered QUEUED / QUEUED_PENDING.
    pub reservations_seen: u64,
    /// Distinct users those reservations belong to.
    pub reservation_users: u64,
    /// Users the engine named two different reservation ids (client view of one-per-user).
    pub users_with_two_reservation_ids: u64,
    pub seen_truncated: bool,
    pub orders_created: Option<u64>,
    pub orders_within_3s_ratio: Option<f64>,
    pub orders: Option<OrderView>,
    pub redis: Option<RedisView>,
    pub invariants: Invariants,
    pub throughput: Vec<SecondCounts>,
    /// When the run started and sold out, for aligning other measurements with it.
    #[serde(default)]
    pub timing: RunTiming,
    /// The generator's own CPU; `None` where `/proc` could not be read.
    #[serde(default)]
    pub client_cpu: Option<ClientCpu>,
    /// The engine's adaptive admission limit over the run (`admission.rs`), every 100 ms;
    /// empty without `--admin` or against a target that exposes none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub admission: Vec<AdmissionPoint>,
    /// Latency by percentile, overall (`ALL`) and per state with answers.
    pub percentile_curves: BTreeMap<String, Vec<CurvePoint>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trace: Vec<TraceEntry>,
}

impl Report {
    /// The samples of `admission.rs`, aligned with the run's start.
    pub fn set_admission(&mut self, samples: &[super::admission::AdmissionSample]) {
        let start = self.timing.started_unix_us;
        let base = samples.iter().find(|s| s.at_unix_us >= start).map_or(0, |s| s.shed_total);
        self.admission = samples
            .iter()
            .filter(|s| s.at_unix_us >= start)
            .map(|s| AdmissionPoint {
                t_ms: (s.at_unix_us - start) / 1_000,
                limit: s.limit,
                ready: s.ready,
                shed: s.shed_total.saturating_sub(base),
            })
            .collect();
    }

    pub fn build(run: RunInfo, m: Measured, v: Option<Verification>) -> Report {
        let r = &m.recorder;
        let mut latency_ms_by_state = BTreeMap::new();
        let mut counts = BTreeMap::new();
        let mut replayed = BTreeMap::new();
        let mut first_counts = BTreeMap::new();
        let mut final_counts = BTreeMap::new();
        let mut time_to_final_ms_by_state = BTreeMap::new();
        let mut percentile_curves = BTreeMap::new();
        percentile_curves.insert("ALL".to_owned(), curve(&r.overall));
        for s in State::ALL {
            let name = || s.as_str().to_owned();
            if r.first_counts[s.index()] > 0 {
                first_counts.insert(name(), r.first_counts[s.index()]);
            }
            if r.final_counts[s.index()] > 0 {
                final_counts.insert(name(), r.final_counts[s.index()]);
                let h = &r.time_to_final_by_state[s.index()];
                time_to_final_ms_by_state.insert(name(), LatencySummary::of(h));
            }
        }
        let attempts = (1..=ATTEMPTS_TRACKED_MAX)
            .filter(|n| r.final_attempts[*n] > 0)
            .map(|n| (n.to_string(), r.final_attempts[n]))
            .collect();
        let client_cpu = m.cpu_ticks.map(|ticks| {
            let cpu_s = ticks as f64 / super::proc::TICKS_PER_S;
            ClientCpu {
                cpu_s: round3(cpu_s),
                us_per_answer: (r.answered > 0)
                    .then(|| (cpu_s * 1e6 / r.answered as f64 * 100.0).round() / 100.0),
            }
        });
        for s in State::ALL {
            let n = r.count(s);
            if n == 0 {
                continue;
            }
            let h = &r.by_state[s.index()];
            latency_ms_by_state.insert(s.as_str().to_owned(), LatencySummary::of(h));
            counts.insert(s.as_str().to_owned(), n);
            if r.replayed[s.index()] > 0 {
                replayed.insert(s.as_str().to_owned(), r.replayed[s.index()]);
            }
            percentile_curves.insert(s.as_str().to_owned(), curve(h));
        }
        let http_status = r.http_status.iter().map(|(k, v)| (k.to_string(), v)).collect();
        let per_s = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        let users: std::collections::HashSet<u32> =
            m.seen.reservations.values().map(|r| r.user).collect();
        let v = v.unwrap_or_default();
        Report {
            scheduled: m.scheduled,
            sent: r.sent - r.retries_sent,
            retries_sent: r.retries_sent,
            answered: r.answered,
            dropped: m.dropped,
            unsent: m.unsent,
            achieved_rps: round3(per_s(r.answered, m.answering_s)),
            sent_rps: round3(per_s(r.sent, m.sending_s)),
            latency_ms: LatencySummary::of(&r.overall),
            latency_ms_by_state,
            send_lag_ms: LatencySummary::of(&r.send_lag),
            dispatch_lag_ms: LatencySummary::of(&r.dispatch_lag),
            counts,
            first_counts,
            final_counts,
            intents: IntentReport { scheduled: m.scheduled, counts: r.intents, attempts },
            time_to_final_ms: LatencySummary::of(&r.time_to_final),
            time_to_final_ms_by_state,
            time_to_final_curve: curve(&r.time_to_final),
            replayed,
            http_status,
            errors: r.errors,
            reservations_new: m.seen.new_reservations,
            reservations_seen: m.seen.reservations.len() as u64,
            reservation_users: users.len() as u64,
            users_with_two_reservation_ids: m.seen.users_with_two_ids,
            seen_truncated: m.seen.truncated,
            orders_created: v.orders.as_ref().map(|o| o.orders_created),
            orders_within_3s_ratio: v.orders.as_ref().and_then(|o| o.orders_within_3s_ratio),
            orders: v.orders,
            redis: v.redis,
            invariants: v.invariants,
            throughput: r.timeline.clone(),
            timing: RunTiming {
                started_unix_us: m.started_unix_us,
                first_sold_out_us: r.first_sold_out_us,
                last_answer_us: m.last_answer_us,
            },
            client_cpu,
            admission: Vec::new(),
            percentile_curves,
            trace: m.trace,
            run,
        }
    }

    pub fn count(&self, state: State) -> u64 {
        self.counts.get(state.as_str()).copied().unwrap_or(0)
    }

    pub fn to_json(&self) -> String {
        // A Report has only string keys and finite numbers, so this cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The human summary printed on stdout.
    pub fn render_text(&self) -> String {
        let mut t = String::new();
        let run = &self.run;
        let _ = writeln!(
            t,
            "flashsale-loadgen {}: {} for {:.1} s, {} connections, pipeline {}, {} users, \
             {:.0}% duplicates, retry {}, seed {}",
            run.run_id,
            run.profile,
            run.duration_s,
            run.connections,
            run.pipeline,
            run.users,
            run.duplicate_ratio * 100.0,
            run.retry,
            run.seed
        );
        let _ =
            writeln!(t, "target {}  activity {}  sku {}", run.target, run.activity_id, run.sku_id);
        let _ = writeln!(
            t,
            "\nsent {} of {} scheduled ({} dropped, {} unsent, {} retries)  answered {}  \
             achieved {:.0} req/s (target {})",
            self.sent,
            self.scheduled,
            self.dropped,
            self.unsent,
            self.retries_sent,
            self.answered,
            self.achieved_rps,
            run.target_rps
        );
        let e = &self.errors;
        let _ = writeln!(
            t,
            "errors: connect {}, io {}, timeout {}, protocol {}",
            e.connect, e.io, e.timeout, e.protocol
        );
        let (d, lag) = (&self.dispatch_lag_ms, &self.send_lag_ms);
        let _ = writeln!(
            t,
            "lag behind schedule (part of every latency): released by the generator p50 {:.3} / \
             p99 {:.3} / max {:.3} ms; written (+ wait for a free connection) p50 {:.3} / p99 \
             {:.3} / max {:.3} ms",
            d.p50, d.p99, d.max, lag.p50, lag.p99, lag.max
        );
        let _ = writeln!(
            t,
            "\n{:<22}{:>9}{:>9}{:>10}{:>10}{:>10}{:>10}{:>10}   (latency ms from intended send)",
            "state", "count", "replay", "p50", "p90", "p99", "p99.9", "max"
        );
        let mut row = |name: &str, n: u64, replays: u64, s: &LatencySummary| {
            let _ = writeln!(
                t,
                "{name:<22}{n:>9}{replays:>9}{:>10.3}{:>10.3}{:>10.3}{:>10.3}{:>10.3}",
                s.p50, s.p90, s.p99, s.p999, s.max
            );
        };
        row("ALL", self.answered, self.replayed.values().sum(), &self.latency_ms);
        for (state, s) in &self.latency_ms_by_state {
            let n = self.counts.get(state).copied().unwrap_or(0);
            row(state, n, self.replayed.get(state).copied().unwrap_or(0), s);
        }
        t.push_str(&self.render_buyers());
        t.push_str(&self.render_admission());
        let _ = writeln!(
            t,
            "\nreservations: {} new answers, {} distinct ids for {} users; users named two ids: {}",
            self.reservations_new,
            self.reservations_seen,
            self.reservation_users,
            self.users_with_two_reservation_ids
        );
        if let Some(redis) = &self.redis {
            let _ = writeln!(
                t,
                "redis: stock {}, {} reservation records ({} holding a unit, {} pending, {} never \
                 answered to the generator) {:?}",
                redis.stock.map_or("?".to_owned(), |s| s.to_string()),
                redis.reservations,
                redis.holding,
                redis.pending,
                redis.unanswered,
                redis.by_status
            );
        }
        if let Some(o) = &self.orders {
            let pct =
                o.orders_within_3s_ratio.map_or("-".to_owned(), |r| format!("{:.2}%", r * 100.0));
            let ms = |v: Option<f64>| v.map_or("-".to_owned(), |x| format!("{x:.0} ms"));
            let _ = writeln!(
                t,
                "orders: {} created, {pct} within 3 s of their reservation (delay p50 {}, p99 {}, \
                 max {})",
                o.orders_created,
                ms(o.order_delay_ms_p50),
                ms(o.order_delay_ms_p99),
                ms(o.order_delay_ms_max)
            );
        }
        t.push_str(&render_invariants(&self.invariants));
        t
    }

    /// The lowest and highest adaptive limit sampled; `None` without samples.
    pub fn admission_limit_range(&self) -> Option<(u64, u64)> {
        let limits = self.admission.iter().map(|p| p.limit);
        Some((limits.clone().min()?, limits.max()?))
    }

    /// The engine's adaptive limit over the run, when it was sampled.
    fn render_admission(&self) -> String {
        let points = &self.admission;
        let (Some(first), Some(last)) = (points.first(), points.last()) else {
            return String::new();
        };
        let (min, max) = self.admission_limit_range().unwrap_or((0, 0));
        let unready = points.iter().filter(|p| !p.ready).count();
        format!(
            "\nadaptive admission: limit {} at the start, {min}..{max} over the run, {} at the end; \
             {} shed by it; unready in {unready} of {} samples (100 ms)\n",
            first.limit,
            last.limit,
            last.shed,
            points.len()
        )
    }

    /// The buyers' view: first and final answers, how intents ended, time to final answer.
    fn render_buyers(&self) -> String {
        let mut t = String::new();
        let n = &self.intents.counts;
        let _ = writeln!(
            t,
            "\nbuyers (intents): {} scheduled, {} with a final answer ({} retried), {} failed, \
             {} dropped, {} unsent; gave up retrying: {} at --retry-max, {} at the budget, {} \
             queue full, {} at the end",
            self.intents.scheduled,
            n.final_answered,
            n.retried,
            n.failed,
            n.dropped,
            n.unsent,
            n.gave_up_retry_max,
            n.gave_up_budget,
            n.gave_up_queue_full,
            n.gave_up_run_end
        );
        let _ = writeln!(
            t,
            "{:<22}{:>9}{:>9}{:>10}{:>10}{:>10}{:>10}   (first / final answer; time to final ms \
             from the first intended send, retry waits included)",
            "state", "first", "final", "p50", "p99", "p99.9", "max"
        );
        let mut row = |name: &str, first: u64, last: u64, s: &LatencySummary| {
            let _ = writeln!(
                t,
                "{name:<22}{first:>9}{last:>9}{:>10.3}{:>10.3}{:>10.3}{:>10.3}",
                s.p50, s.p99, s.p999, s.max
            );
        };
        let first_all = self.first_counts.values().sum();
        row("ALL", first_all, n.final_answered, &self.time_to_final_ms);
        let states: std::collections::BTreeSet<&String> =
            self.first_counts.keys().chain(self.final_counts.keys()).collect();
        for state in states {
            let first = self.first_counts.get(state).copied().unwrap_or(0);
            let last = self.final_counts.get(state).copied().unwrap_or(0);
            let summary = self.time_to_final_ms_by_state.get(state).copied().unwrap_or_default();
            row(state, first, last, &summary);
        }
        if let Some(cpu) = &self.client_cpu {
            let per = cpu.us_per_answer.map_or("-".to_owned(), |us| format!("{us:.2}"));
            let _ = writeln!(
                t,
                "generator CPU: {:.3} s over the run, {per} us per answer ({} thread(s))",
                cpu.cpu_s, self.run.threads
            );
        }
        t
    }
}

fn render_invariants(inv: &Invariants) -> String {
    let mut t = String::new();
    if inv.checked_in.is_empty() && inv.error.is_none() {
        t.push_str("invariants: not checked (give --redis-url, and --pg-url after the drain)\n");
        return t;
    }
    let v = |b: Option<bool>| match b {
        Some(true) => "ok",
        Some(false) => "VIOLATED",
        None => "not checked",
    };
    let _ = writeln!(
        t,
        "invariants ({}): no_oversell {}, one_per_user {}, tokens_conserved {}, nothing_lost {} \
         => {}",
        inv.checked_in.join(" + "),
        v(inv.no_oversell),
        v(inv.one_per_user),
        v(inv.tokens_conserved),
        v(inv.nothing_lost),
        if inv.ok == Some(true) { "OK" } else { "FAILED" }
    );
    if let Some(drained) = inv.drained {
        let _ = writeln!(
            t,
            "drain: {} after {:.1} s; {} reservations still in flight (younger than the recovery \
             deadline)",
            if drained { "complete" } else { "NOT complete" },
            inv.drain_s.unwrap_or(0.0),
            inv.in_flight_count
        );
    }
    if let Some(e) = &inv.error {
        let _ = writeln!(t, "check error: {e}");
    }
    for violation in &inv.violations {
        let _ = writeln!(t, "  violation: {violation}");
    }
    if inv.lost_count > 0 {
        // The JSON lists up to LOST_IDS_LISTED_MAX; a terminal line shows the first few.
        let shown = inv.lost_ids.iter().take(LOST_IDS_SHOWN).cloned().collect::<Vec<_>>();
        let more = if inv.lost_count > shown.len() as u64 { ", ... (see --json)" } else { "" };
        let _ = writeln!(t, "  lost ({}): {}{more}", inv.lost_count, shown.join(", "));
    }
    t
}

fn round3(x: f64) -> f64 {
    (x * 1_000.0).round() / 1_000.0
}

/// Latency at percentiles evenly spaced on the "nines" scale: 0, 90, 99, 99.9, 99.99 % are
/// x = 0, 1, 2, 3, 4.
fn curve(h: &Histogram<u64>) -> Vec<CurvePoint> {
    if h.is_empty() {
        return Vec::new();
    }
    (0..=CURVE_STEPS)
        .map(|i| {
            let nines = CURVE_NINES_MAX * f64::from(i) / f64::from(CURVE_STEPS);
            let q = 1.0 - 10f64.powf(-nines);
            CurvePoint {
                nines,
                percentile: round3(q * 100.0),
                ms: h.value_at_quantile(q) as f64 / 1_000.0,
            }
        })
        .collect()
}
