//! The maximum-rate search (`flashsale-loadgen --max-rate-search`, issue 5's baselines): the
//! same open-loop runs as a normal load test, stepped up until the target stops keeping up,
//! then bisected, so that two servers driven with the same settings can be compared by their
//! highest sustained rate.
//!
//! **Sustained** (one step at offered rate R, open loop, latency from the intended send time):
//! every scheduled request answered (no connect / I/O / timeout / protocol error, nothing
//! dropped or left unsent); achieved ≥ `achieved_ratio_min` × R (default 0.98); p99 ≤
//! `p99_ms_max` (default 50 ms: below the target's capacity the p99 is a few ms; above it
//! the backlog grows for the whole step and the p99 reaches hundreds of ms, so the exact
//! bound hardly moves the result); and, with `expect_state`, every answer in that state (a
//! RATE_LIMITED or OVERLOADED answer is not the path being measured).
//!
//! **Search** ([`Search`], sans-I/O): start at `--rate`, multiply by `growth` (1.5) after
//! each sustained step until one is not (or `rate_max`); then try the geometric mean of the
//! highest sustained and the lowest failed rate until they are within `precision` (5%) of
//! each other. If the first step already fails, divide by `growth` until one is sustained.
//! The result is the highest sustained rate seen. Noise can make the outcome non-monotone (a
//! pass above a fail): the search then stops, and every step is in the report. With
//! `attempts_max` > 1 a failed step is run again (a shared machine's other tenants fail
//! single steps); the rate is sustained if any attempt is.
//!
//! With `half_rate_runs`, the search ends with that many runs at half the maximum (the P99
//! goal of issue 5 is stated there). With `server_pid`, each step records the server's CPU
//! use (cores) and its `VmRSS`/`VmHWM`, beside the generator's own CPU use: a generator at
//! ~1 core on its one core was the limit, not the server.
//!
//! Read next: `proc.rs` for the `/proc` readings, `driver.rs` for one run.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use super::config::{ConfigError, LoadConfig, Progress, Resolved};
use super::http::State;
use super::proc::{self, ProcSample};
use super::report::Report;
use super::schedule::Profile;
use super::stats::LatencySummary;
use super::{driver, LoadError};

/// Lowest rate tried when even the first step fails.
pub const SEARCH_RATE_MIN: u64 = 1_000;
/// Most steps of one search (bounds its run time: ~24 × (step + settle)).
pub const SEARCH_STEPS_MAX: usize = 24;
/// Most attempts of one rate.
pub const ATTEMPTS_MAX: u32 = 3;
/// Most runs at half the maximum rate.
pub const HALF_RATE_RUNS_MAX: u32 = 10;
/// Rates are rounded to multiples of this (readable reports).
const RATE_ROUNDING: u64 = 500;
/// Longest prefix of a step's run id, leaving room for `s{step}`.
const STEP_RUN_ID_PREFIX_MAX: usize = 38;

/// The search's knobs (the load settings themselves are the [`LoadConfig`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SearchConfig {
    /// First offered rate.
    pub start_rps: u64,
    /// Highest rate tried.
    pub rate_max: u64,
    /// Factor between steps while every step is sustained.
    pub growth: f64,
    /// Stop bisecting when lowest-failed / highest-sustained ≤ this.
    pub precision: f64,
    pub p99_ms_max: f64,
    pub achieved_ratio_min: f64,
    /// Every answer must be in this state (`None`: any state).
    pub expect_state: Option<State>,
    /// Pause between steps, so that the target drains a failed step's backlog.
    pub settle_ms: u64,
    /// Runs of a failed step before the rate counts as failed (1 = no second chance). On a
    /// shared machine another tenant's burst fails a single step; the rate is sustained if
    /// any of its attempts is.
    pub attempts_max: u32,
    pub half_rate_runs: u32,
    pub half_rate_duration_ms: u64,
    /// The server under test, for its CPU and memory figures.
    pub server_pid: Option<u32>,
}

impl SearchConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError(m.to_owned()));
        if self.start_rps < SEARCH_RATE_MIN || self.start_rps > self.rate_max {
            return bad("the search's start rate (--rate) must be ≥ 1000 and ≤ --search-rate-max");
        }
        if !(self.growth > 1.01 && self.growth <= 10.0) {
            return bad("--search-growth must be in (1.01, 10]");
        }
        if !(self.precision > 1.0 && self.precision < self.growth) {
            return bad("--search-precision must be in (1, --search-growth)");
        }
        if !(self.p99_ms_max > 0.0 && self.p99_ms_max.is_finite()) {
            return bad("--search-p99-ms must be positive");
        }
        if !(self.achieved_ratio_min > 0.0 && self.achieved_ratio_min <= 1.0) {
            return bad("--search-achieved-min must be in (0, 1]");
        }
        if self.expect_state == Some(State::Other) {
            return bad("--expect-state must be one of the contract's states");
        }
        if self.attempts_max == 0 || self.attempts_max > ATTEMPTS_MAX {
            return bad("--search-attempts must be 1..=3");
        }
        if self.half_rate_runs > HALF_RATE_RUNS_MAX || self.half_rate_duration_ms == 0 {
            return bad("--half-rate-runs must be 0..=10 and --half-rate-duration-s positive");
        }
        Ok(())
    }

    /// The criterion in words, for the report.
    pub fn criterion(&self) -> String {
        let mut text = format!(
            "all scheduled requests answered, no errors, nothing dropped; achieved >= {:.0}% of \
             offered; p99 (from intended send time) <= {} ms",
            self.achieved_ratio_min * 100.0,
            self.p99_ms_max
        );
        if let Some(state) = self.expect_state {
            let _ = write!(text, "; every answer {}", state.as_str());
        }
        if self.attempts_max > 1 {
            let _ =
                write!(text, "; a rate fails only if {} attempts in a row fail", self.attempts_max);
        }
        text
    }
}

/// The search itself: which rate next, given the verdicts so far. No I/O, no clock.
#[derive(Debug, Clone)]
pub struct Search {
    start_rps: u64,
    rate_max: u64,
    growth: f64,
    precision: f64,
    highest_sustained: Option<u64>,
    lowest_failed: Option<u64>,
    steps: usize,
}

impl Search {
    pub fn new(config: &SearchConfig) -> Search {
        Search {
            start_rps: config.start_rps,
            rate_max: config.rate_max,
            growth: config.growth,
            precision: config.precision,
            highest_sustained: None,
            lowest_failed: None,
            steps: 0,
        }
    }

    /// The next rate to try; `None` when the search is over.
    pub fn next_rate(&self) -> Option<u64> {
        if self.steps >= SEARCH_STEPS_MAX {
            return None;
        }
        match (self.highest_sustained, self.lowest_failed) {
            (None, None) => Some(self.start_rps),
            (Some(pass), None) => {
                if pass >= self.rate_max {
                    return None;
                }
                let up = round_rate(pass as f64 * self.growth).max(pass + RATE_ROUNDING);
                Some(up.min(self.rate_max))
            }
            (None, Some(fail)) => {
                let down = round_rate(fail as f64 / self.growth);
                (down >= SEARCH_RATE_MIN && down < fail).then_some(down)
            }
            (Some(pass), Some(fail)) => {
                if fail as f64 <= pass as f64 * self.precision {
                    return None;
                }
                let mid = round_rate((pass as f64 * fail as f64).sqrt());
                (mid > pass && mid < fail).then_some(mid)
            }
        }
    }

    pub fn record(&mut self, rate: u64, sustained: bool) {
        self.steps += 1;
        if sustained {
            self.highest_sustained = Some(self.highest_sustained.map_or(rate, |p| p.max(rate)));
        } else {
            self.lowest_failed = Some(self.lowest_failed.map_or(rate, |f| f.min(rate)));
        }
    }

    pub fn highest_sustained(&self) -> Option<u64> {
        self.highest_sustained
    }

    pub fn lowest_failed(&self) -> Option<u64> {
        self.lowest_failed
    }
}

fn round_rate(rate: f64) -> u64 {
    let steps = (rate / RATE_ROUNDING as f64).round().max(1.0);
    steps as u64 * RATE_ROUNDING
}

/// One run at one offered rate, as the search saw it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Step {
    pub rate: u64,
    /// 1 for the first run at this rate, 2 for the second chance of a failed one, ...
    pub attempt: u32,
    pub duration_s: f64,
    pub scheduled: u64,
    pub answered: u64,
    pub achieved_rps: f64,
    pub latency_ms: LatencySummary,
    /// Connect, I/O, timeout and protocol errors.
    pub errors: u64,
    pub dropped: u64,
    pub unsent: u64,
    /// Answers not in the expected state (0 without `expect_state`).
    pub unexpected: u64,
    pub counts: std::collections::BTreeMap<String, u64>,
    pub dispatch_lag_p99_ms: f64,
    pub send_lag_p99_ms: f64,
    /// CPU the generator used during the step, in cores.
    pub generator_cores: f64,
    /// CPU the server used during the step, in cores (`--server-pid`).
    pub server_cores: Option<f64>,
    /// Server CPU time per answer, µs (`--server-pid`): the cost of one request on the
    /// server, comparable between servers even when the generator, not the server, was the
    /// limit of the rate search.
    pub server_us_per_answer: Option<f64>,
    /// Generator CPU time per answer, µs.
    pub generator_us_per_answer: f64,
    /// The server's memory at the end of the step (`--server-pid`).
    pub server_after: Option<ProcSample>,
    pub sustained: bool,
    /// Why the step is not sustained (empty when it is).
    pub failed: Vec<String>,
}

/// Why a step at `rate` is not sustained (empty: it is).
pub fn judge(rate: u64, report: &Report, config: &SearchConfig) -> Vec<String> {
    let mut failed = Vec::new();
    let e = &report.errors;
    let errors = e.connect + e.io + e.timeout + e.protocol;
    if errors > 0 {
        failed.push(format!("{errors} errors"));
    }
    if report.dropped + report.unsent > 0 {
        failed.push(format!("{} dropped, {} unsent", report.dropped, report.unsent));
    }
    if report.answered < report.scheduled {
        failed.push(format!("{} of {} answered", report.answered, report.scheduled));
    }
    if report.achieved_rps < config.achieved_ratio_min * rate as f64 {
        failed.push(format!("achieved {:.0} req/s", report.achieved_rps));
    }
    if report.latency_ms.p99 > config.p99_ms_max {
        failed.push(format!("p99 {:.1} ms", report.latency_ms.p99));
    }
    if let Some(state) = config.expect_state {
        let unexpected = report.answered - report.count(state).min(report.answered);
        if unexpected > 0 {
            failed.push(format!("{unexpected} answers not {}", state.as_str()));
        }
    }
    failed
}

/// Runs at half the maximum rate.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HalfRate {
    pub rate: u64,
    pub runs: Vec<Step>,
    pub p99_ms_median: f64,
    pub p999_ms_median: f64,
}

/// The `--json` file of a search.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SearchReport {
    pub target: String,
    pub connections: usize,
    pub pipeline: usize,
    pub threads: usize,
    pub users: u32,
    pub duplicate_ratio: f64,
    pub step_s: f64,
    pub criterion: String,
    pub steps: Vec<Step>,
    pub max_sustained_rps: Option<u64>,
    pub lowest_failed_rps: Option<u64>,
    pub half_rate: Option<HalfRate>,
    pub server_pid: Option<u32>,
}

impl SearchReport {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    pub fn render_text(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "rate search against {}: {} connections, pipeline {}, {} users, {:.1} s steps\n\
             sustained = {}",
            self.target, self.connections, self.pipeline, self.users, self.step_s, self.criterion
        );
        let _ = writeln!(
            t,
            "{:>9}{:>11}{:>9}{:>9}{:>9}{:>8}{:>8}{:>8}{:>9}{:>9}  verdict",
            "offered",
            "achieved",
            "p50",
            "p99",
            "p99.9",
            "gen",
            "server",
            "µs/req",
            "lag p99",
            "RSS MiB"
        );
        let half = self.half_rate.iter().flat_map(|h| h.runs.iter());
        for step in self.steps.iter().chain(half) {
            let _ = writeln!(t, "{}", step_line(step));
        }
        let rate = |r: Option<u64>| r.map_or("none".to_owned(), |r| format!("{r} req/s"));
        let _ = writeln!(
            t,
            "max sustained: {} (lowest failed: {})",
            rate(self.max_sustained_rps),
            rate(self.lowest_failed_rps)
        );
        if let Some(h) = &self.half_rate {
            let p99s: Vec<String> =
                h.runs.iter().map(|r| format!("{:.2}", r.latency_ms.p99)).collect();
            let _ = writeln!(
                t,
                "half of the maximum, {} req/s: p99 {} ms (median {:.2}), p99.9 median {:.2} ms",
                h.rate,
                p99s.join(" / "),
                h.p99_ms_median,
                h.p999_ms_median
            );
        }
        t
    }
}

fn step_line(step: &Step) -> String {
    let server = step.server_cores.map_or("-".to_owned(), |c| format!("{c:.2}"));
    let rss =
        step.server_after.map_or("-".to_owned(), |s| format!("{:.1}", s.vm_rss_kb as f64 / 1024.0));
    let cost = step.server_us_per_answer.map_or("-".to_owned(), |c| format!("{c:.2}"));
    let mut verdict = if step.sustained { "ok".to_owned() } else { step.failed.join(", ") };
    if step.attempt > 1 {
        let _ = write!(verdict, " (attempt {})", step.attempt);
    }
    format!(
        "{:>9}{:>11.0}{:>9.3}{:>9.3}{:>9.3}{:>8.2}{:>8}{cost:>8}{:>9.3}{:>9}  {verdict}",
        step.rate,
        step.achieved_rps,
        step.latency_ms.p50,
        step.latency_ms.p99,
        step.latency_ms.p999,
        step.generator_cores,
        server,
        step.dispatch_lag_p99_ms,
        rss
    )
}

/// Runs a search (builds its own tokio runtime, like [`super::run`]) and writes `--json`.
pub fn run(config: LoadConfig, search: SearchConfig) -> Result<SearchReport, LoadError> {
    let resolved = config.validate()?;
    search.validate()?;
    let report = super::runtime(&config)?.block_on(run_async(&config, &resolved, &search))?;
    if let Some(path) = &config.json_path {
        std::fs::write(path, report.to_json()).map_err(|e| LoadError::Output {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
    }
    Ok(report)
}

async fn run_async(
    config: &LoadConfig,
    resolved: &Resolved,
    search: &SearchConfig,
) -> Result<SearchReport, LoadError> {
    if config.create_activity {
        let (admin, host) = resolved
            .admin
            .clone()
            .ok_or_else(|| LoadError::Setup("--create-activity without --admin".into()))?;
        let stock = config.stock.unwrap_or(0);
        super::create_activity(admin, &host, config.admin_token.as_deref(), config, stock).await?;
    }
    let passes = super::mint_passes(config, resolved)?;
    let runner = StepRunner { config, resolved, passes: &passes, search };
    let mut state = Search::new(search);
    let mut steps = Vec::new();
    while let Some(rate) = state.next_rate() {
        let mut sustained = false;
        for attempt in 1..=search.attempts_max {
            let mut step = runner.step(rate, config.duration_ms, steps.len()).await;
            step.attempt = attempt;
            sustained = step.sustained;
            if config.progress == Progress::Stderr {
                eprintln!("{}", step_line(&step));
            }
            steps.push(step);
            if sustained {
                break;
            }
        }
        state.record(rate, sustained);
    }
    let half_rate = match state.highest_sustained() {
        Some(max) if search.half_rate_runs > 0 => {
            let rate = round_rate(max as f64 / 2.0);
            let mut runs = Vec::new();
            for i in 0..search.half_rate_runs {
                let index = steps.len() + i as usize;
                let run = runner.step(rate, search.half_rate_duration_ms, index).await;
                if config.progress == Progress::Stderr {
                    eprintln!("{}", step_line(&run));
                }
                runs.push(run);
            }
            let p99_ms_median = median(runs.iter().map(|r| r.latency_ms.p99).collect());
            let p999_ms_median = median(runs.iter().map(|r| r.latency_ms.p999).collect());
            Some(HalfRate { rate, runs, p99_ms_median, p999_ms_median })
        }
        _ => None,
    };
    Ok(SearchReport {
        target: config.target.clone(),
        connections: config.connections,
        pipeline: config.pipeline,
        threads: config.threads,
        users: config.users,
        duplicate_ratio: config.duplicate_ratio,
        step_s: config.duration_ms as f64 / 1e3,
        criterion: search.criterion(),
        steps,
        max_sustained_rps: state.highest_sustained(),
        lowest_failed_rps: state.lowest_failed(),
        half_rate,
        server_pid: search.server_pid,
    })
}

/// The median (the mean of the middle two for an even count); 0 for none.
pub fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

struct StepRunner<'a> {
    config: &'a LoadConfig,
    resolved: &'a Resolved,
    passes: &'a [String],
    search: &'a SearchConfig,
}

impl StepRunner<'_> {
    async fn step(&self, rate: u64, duration_ms: u64, index: usize) -> Step {
        let prefix_len = self.config.run_id.len().min(STEP_RUN_ID_PREFIX_MAX);
        let run_id = format!("{}s{index}", &self.config.run_id[..prefix_len]);
        let step_config = LoadConfig {
            profile: Profile::Constant { rate_per_s: rate },
            duration_ms,
            run_id,
            progress: Progress::Off,
            ..self.config.clone()
        };
        let params = super::drive_params(&step_config, self.resolved, self.passes.to_vec());
        let server_pid = self.search.server_pid.map(|p| p.to_string());
        let server_before = server_pid.as_deref().and_then(proc::sample);
        let me_before = proc::sample("self");
        let started = Instant::now();
        let measured = driver::drive(params).await;
        let wall_s = started.elapsed().as_secs_f64();
        let me_after = proc::sample("self");
        let server_after = server_pid.as_deref().and_then(proc::sample);
        let report = Report::build(super::run_info(&step_config), measured, None);
        let failed = judge(rate, &report, self.search);
        let e = &report.errors;
        let unexpected = self
            .search
            .expect_state
            .map_or(0, |s| report.answered - report.count(s).min(report.answered));
        let per_answer = |before: Option<ProcSample>, after: Option<ProcSample>| {
            let (a, b) = (before?, after?);
            let cpu_s = b.cpu_ticks.saturating_sub(a.cpu_ticks) as f64 / proc::TICKS_PER_S;
            (report.answered > 0).then(|| round2(cpu_s * 1e6 / report.answered as f64))
        };
        let step = Step {
            rate,
            attempt: 1,
            server_us_per_answer: per_answer(server_before, server_after),
            generator_us_per_answer: per_answer(me_before, me_after).unwrap_or(0.0),
            duration_s: duration_ms as f64 / 1e3,
            scheduled: report.scheduled,
            answered: report.answered,
            achieved_rps: report.achieved_rps,
            latency_ms: report.latency_ms,
            errors: e.connect + e.io + e.timeout + e.protocol,
            dropped: report.dropped,
            unsent: report.unsent,
            unexpected,
            counts: report.counts.clone(),
            dispatch_lag_p99_ms: report.dispatch_lag_ms.p99,
            send_lag_p99_ms: report.send_lag_ms.p99,
            generator_cores: match (me_before, me_after) {
                (Some(a), Some(b)) => round2(proc::cores_used(&a, &b, wall_s)),
                _ => 0.0,
            },
            server_cores: match (server_before, server_after) {
                (Some(a), Some(b)) => Some(round2(proc::cores_used(&a, &b, wall_s))),
                _ => None,
            },
            server_after,
            sustained: failed.is_empty(),
            failed,
        };
        tokio::time::sleep(Duration::from_millis(self.search.settle_ms)).await;
        step
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SearchConfig {
        SearchConfig {
            start_rps: 10_000,
            rate_max: 1_000_000,
            growth: 1.5,
            precision: 1.05,
            p99_ms_max: 50.0,
            achieved_ratio_min: 0.98,
            expect_state: Some(State::SoldOut),
            settle_ms: 0,
            attempts_max: 2,
            half_rate_runs: 3,
            half_rate_duration_ms: 1_000,
            server_pid: None,
        }
    }

    /// Against a server that sustains exactly `capacity`, the search ends within the
    /// precision below it, never reports a failed rate as sustained, and stays bounded.
    #[test]
    fn search_converges_below_the_capacity() {
        for capacity in [1_000, 7_300, 10_000, 64_000, 230_000, 999_000, 5_000_000] {
            let c = config();
            let mut search = Search::new(&c);
            let mut tried = Vec::new();
            while let Some(rate) = search.next_rate() {
                assert!(!tried.contains(&rate), "{capacity}: {rate} twice in {tried:?}");
                tried.push(rate);
                search.record(rate, rate <= capacity);
            }
            assert!(tried.len() <= SEARCH_STEPS_MAX, "{capacity}: {tried:?}");
            let found = search.highest_sustained();
            match capacity {
                c if c >= 1_000_000 => assert_eq!(found, Some(1_000_000), "{tried:?}"),
                c if c < SEARCH_RATE_MIN => assert_eq!(found, None),
                _ => {
                    let found = found.unwrap_or_else(|| panic!("{capacity}: {tried:?}"));
                    assert!(found <= capacity, "{capacity}: {found}");
                    let fail = search.lowest_failed().unwrap();
                    assert!(fail as f64 <= found as f64 * c.precision + 500.0, "{tried:?}");
                }
            }
        }
    }

    /// A first step that fails walks down; a non-monotone outcome (noise) ends the search.
    #[test]
    fn failing_start_walks_down_and_noise_stops() {
        let mut search = Search::new(&config());
        search.record(10_000, false);
        assert_eq!(search.next_rate(), Some(6_500));
        search.record(6_500, false);
        assert_eq!(search.next_rate(), Some(4_500));
        search.record(4_500, true);
        assert_eq!(search.next_rate(), Some(5_500));
        let mut noisy = Search::new(&config());
        noisy.record(10_000, true);
        noisy.record(15_000, false);
        noisy.record(12_000, true);
        noisy.record(13_500, true);
        noisy.record(12_500, false);
        // 13,500 sustained above a failed 12,500: over (the report keeps both).
        assert_eq!(noisy.next_rate(), None);
        assert_eq!(noisy.highest_sustained(), Some(13_500));
        let mut never = Search::new(&config());
        while let Some(rate) = never.next_rate() {
            never.record(rate, false);
        }
        assert_eq!(never.highest_sustained(), None);
        assert!(never.lowest_failed().unwrap() >= SEARCH_RATE_MIN);
    }

    #[test]
    fn validation_and_median() {
        assert!(config().validate().is_ok());
        let bad = [
            SearchConfig { start_rps: 10, ..config() },
            SearchConfig { growth: 1.0, ..config() },
            SearchConfig { precision: 2.0, ..config() },
            SearchConfig { achieved_ratio_min: 1.5, ..config() },
            SearchConfig { expect_state: Some(State::Other), ..config() },
            SearchConfig { half_rate_runs: 11, ..config() },
            SearchConfig { attempts_max: 0, ..config() },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
        assert!(config().criterion().contains("every answer SOLD_OUT"));
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(Vec::new()), 0.0);
    }
}
