//! The command line of `flashsale-loadgen` (and of `flashsale loadgen`, which execs it):
//! flags, their defaults, and the conversion into a [`LoadConfig`].
//!
//! Exit codes (CONTRACT.md section 1): 0 the run completed and every checked invariant held;
//! 1 the run could not complete, a checked invariant was violated, or (with `--pg-url`) the
//! orders did not drain within `--drain-timeout-s`; 2 usage errors.
//!
//! Read next: `config.rs`.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use super::config::{default_run_id, ConfigError, LoadConfig, Progress};
use super::http::State;
use super::retry::{self, RetryPolicy, SameId};
use super::schedule::Profile;
use super::search::SearchConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RetryFlag {
    /// Every answer is final: record it and move on.
    Off,
    /// A "not now" answer (OVERLOADED, RATE_LIMITED, SUBMIT_CLOSED, SYSTEM_BUSY, UNKNOWN) is
    /// re-sent with the SAME request id after the server's Retry-After / retry_after_ms
    /// stretched by a uniform factor in [1, 1 + --retry-jitter-pct/100), at most --retry-max
    /// times and never later than --retry-budget-ms after the first send.
    SameId,
}

/// Open-loop load generator for the flashsale engine: requests leave on a fixed schedule
/// whatever the server does, latency is measured from each request's intended send time.
#[derive(Debug, Parser)]
#[command(name = "flashsale-loadgen", version)]
pub struct Args {
    /// Public listener of the engine.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub target: String,
    /// Admin listener (for --create-activity).
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    pub admin: String,
    /// Bearer token of the admin API.
    #[arg(long, env = "FLASHSALE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Requests per second (the peak, with --ramp-ms).
    #[arg(long, default_value_t = 10_000)]
    pub rate: u64,
    /// Burst profile: ramp linearly from 0 to --rate over this many ms (≤ 1000), then hold.
    /// 0 = constant rate from the start.
    #[arg(long, default_value_t = 0)]
    pub ramp_ms: u64,
    /// Length of the schedule in seconds (fractions allowed).
    #[arg(long, default_value_t = 10.0)]
    pub duration_s: f64,
    /// Keep-alive connections.
    #[arg(long, default_value_t = 256)]
    pub connections: usize,
    /// Requests in flight per connection (1 = no pipelining).
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,
    /// Threads of the generator: event loops, each with its share of the connections and
    /// of the schedule (at most --connections).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value_t = 10_001)]
    pub activity_id: u64,
    #[arg(long, default_value_t = 20_001)]
    pub sku_id: u64,
    /// Initial stock (created with --create-activity; the Redis checks compare against it).
    #[arg(long)]
    pub stock: Option<u64>,
    /// Create the activity through the admin API before the run (needs --stock).
    #[arg(long)]
    pub create_activity: bool,
    /// Distinct users (one pass each, minted before the run).
    #[arg(long, default_value_t = 50_000)]
    pub users: u32,
    /// First user id.
    #[arg(long, default_value_t = 1)]
    pub user_id_base: u64,
    /// Pass keys `kid:hexkey[,...]` (passes are minted with the first). Default: the public
    /// development key that `flashsale serve --insecure-dev-auth` accepts.
    #[arg(long, env = "FLASHSALE_PASS_KEYS", hide_env_values = true,
          default_value = flashsale_engine::logic::auth::DEV_PASS_KEYS)]
    pub pass_keys: String,
    /// Share of requests that re-send an earlier request of the same user with the same
    /// request id (duplicate clicks).
    #[arg(long, default_value_t = 0.10)]
    pub duplicate_ratio: f64,
    /// Retry policy for "not now" answers (OVERLOADED, RATE_LIMITED, SUBMIT_CLOSED,
    /// SYSTEM_BUSY, UNKNOWN).
    #[arg(long, value_enum, default_value_t = RetryFlag::SameId)]
    pub retry: RetryFlag,
    /// Most retries of one intent (a buyer's click), after its first send.
    #[arg(long, default_value_t = retry::RETRY_MAX_DEFAULT)]
    pub retry_max: u32,
    /// No retry starts later than this after the intent's first intended send (the buyer
    /// gives up; his last answer is his final one).
    #[arg(long, default_value_t = retry::RETRY_BUDGET_MS_DEFAULT)]
    pub retry_budget_ms: u64,
    /// Each retry waits the server's hint times a uniform factor in [1, 1 + this/100):
    /// never earlier than asked, spread so that clients do not return in lock-step.
    #[arg(long, default_value_t = retry::RETRY_JITTER_PCT_DEFAULT)]
    pub retry_jitter_pct: u32,
    /// Seed of the schedule's users and duplicates (same seed, same plan).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Prefix of request ids; default: derived from the clock, unique per run.
    #[arg(long)]
    pub run_id: Option<String>,
    /// No answer within this long → the request counts as a timeout.
    #[arg(long, default_value_t = 5_000)]
    pub timeout_ms: u64,
    /// Requests that may wait for a free connection; beyond it they are dropped (counted).
    #[arg(long, default_value_t = 1 << 20)]
    pub queue_max: usize,
    /// Redis of the engine: enables the Redis checks after the run.
    #[arg(long)]
    pub redis_url: Option<String>,
    /// PostgreSQL of the engine: waits for the orders, then checks the invariants.
    #[arg(long)]
    pub pg_url: Option<String>,
    /// Longest wait for the asynchronous path to drain before checking.
    #[arg(long, default_value_t = 60)]
    pub drain_timeout_s: u64,
    /// A reservation without a final outcome younger than this is in flight, not lost.
    #[arg(long, default_value_t = 900)]
    pub recovery_deadline_s: u64,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the latency and throughput picture (SVG) here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// No progress line on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Find the highest rate the target sustains instead of one run: steps of --duration-s
    /// starting at --rate, up by --search-growth, then bisected (see `loadgen/search.rs` for
    /// the criterion). --json gets the search report.
    #[arg(long)]
    pub max_rate_search: bool,
    /// Highest rate the search tries.
    #[arg(long, default_value_t = 2_000_000)]
    pub search_rate_max: u64,
    /// Factor between search steps while they are sustained.
    #[arg(long, default_value_t = 1.5)]
    pub search_growth: f64,
    /// The search stops when lowest failed / highest sustained is at most this.
    #[arg(long, default_value_t = 1.05)]
    pub search_precision: f64,
    /// A step is sustained only with a p99 (from intended send time) at most this.
    #[arg(long, default_value_t = 50.0)]
    pub search_p99_ms: f64,
    /// A step is sustained only if it achieved at least this share of the offered rate.
    #[arg(long, default_value_t = 0.98)]
    pub search_achieved_min: f64,
    /// A step is sustained only if every answer has this state (e.g. SOLD_OUT).
    #[arg(long)]
    pub expect_state: Option<String>,
    /// Pause between search steps (the target drains a failed step's backlog).
    #[arg(long, default_value_t = 1_000)]
    pub settle_ms: u64,
    /// Runs of a failed search step before its rate counts as failed (a second chance
    /// against another tenant's burst on a shared machine).
    #[arg(long, default_value_t = 2)]
    pub search_attempts: u32,
    /// After the search: this many runs at half the maximum rate.
    #[arg(long, default_value_t = 0)]
    pub half_rate_runs: u32,
    /// Length of each half-rate run.
    #[arg(long, default_value_t = 10.0)]
    pub half_rate_duration_s: f64,
    /// The server's process id: each search step records its CPU use and VmRSS / VmHWM.
    #[arg(long)]
    pub server_pid: Option<u32>,
}

impl Args {
    /// The search's settings with `--max-rate-search` (`None` without it).
    pub fn search_config(&self) -> Option<Result<SearchConfig, ConfigError>> {
        if !self.max_rate_search {
            return None;
        }
        let expect_state = match self.expect_state.as_deref().map(State::parse) {
            Some(State::Other) => {
                return Some(Err(ConfigError(format!(
                    "--expect-state: unknown state {:?}",
                    self.expect_state.as_deref().unwrap_or_default()
                ))));
            }
            other => other,
        };
        let half_rate_duration_ms =
            if self.half_rate_duration_s.is_finite() && self.half_rate_duration_s > 0.0 {
                (self.half_rate_duration_s * 1_000.0).round() as u64
            } else {
                0 // refused by validate
            };
        let config = SearchConfig {
            start_rps: self.rate,
            rate_max: self.search_rate_max,
            growth: self.search_growth,
            precision: self.search_precision,
            p99_ms_max: self.search_p99_ms,
            achieved_ratio_min: self.search_achieved_min,
            expect_state,
            settle_ms: self.settle_ms,
            attempts_max: self.search_attempts,
            half_rate_runs: self.half_rate_runs,
            half_rate_duration_ms,
            server_pid: self.server_pid,
        };
        Some(config.validate().map(|()| config))
    }

    pub fn into_config(self) -> LoadConfig {
        let profile = if self.ramp_ms == 0 {
            Profile::Constant { rate_per_s: self.rate }
        } else {
            Profile::Burst { peak_per_s: self.rate, ramp_ms: self.ramp_ms }
        };
        let duration_ms = if self.duration_s.is_finite() && self.duration_s > 0.0 {
            (self.duration_s * 1_000.0).round() as u64
        } else {
            0 // refused by validate
        };
        LoadConfig {
            target: self.target,
            admin: Some(self.admin),
            admin_token: self.admin_token,
            profile,
            duration_ms,
            connections: self.connections,
            pipeline: self.pipeline,
            threads: self.threads,
            activity_id: self.activity_id,
            sku_id: self.sku_id,
            stock: self.stock,
            create_activity: self.create_activity,
            users: self.users,
            user_id_base: self.user_id_base,
            pass_keys: self.pass_keys,
            duplicate_ratio: self.duplicate_ratio,
            retry: match self.retry {
                RetryFlag::Off => RetryPolicy::Off,
                RetryFlag::SameId => RetryPolicy::SameId(SameId {
                    retry_max: self.retry_max,
                    budget_ms: self.retry_budget_ms,
                    jitter_pct: self.retry_jitter_pct,
                }),
            },
            seed: self.seed,
            run_id: self.run_id.unwrap_or_else(default_run_id),
            timeout_ms: self.timeout_ms,
            queue_max: self.queue_max,
            redis_url: self.redis_url,
            pg_url: self.pg_url,
            drain_timeout_s: self.drain_timeout_s,
            recovery_deadline_ms: self.recovery_deadline_s.saturating_mul(1_000),
            json_path: self.json,
            svg_path: self.svg,
            progress: if self.quiet { Progress::Off } else { Progress::Stderr },
            trace_max: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_map_onto_the_config() {
        let args = Args::try_parse_from([
            "flashsale-loadgen",
            "--rate",
            "5000",
            "--ramp-ms",
            "500",
            "--duration-s",
            "1.5",
            "--retry",
            "off",
            "--pipeline",
            "4",
            "--quiet",
        ])
        .unwrap();
        let c = args.into_config();
        assert_eq!(c.profile, Profile::Burst { peak_per_s: 5_000, ramp_ms: 500 });
        assert_eq!((c.duration_ms, c.pipeline, c.retry), (1_500, 4, RetryPolicy::Off));
        assert_eq!(c.progress, Progress::Off);
        assert!(c.validate().is_ok());
        let d = Args::try_parse_from(["flashsale-loadgen"]).unwrap().into_config();
        assert_eq!(d.profile, Profile::Constant { rate_per_s: 10_000 });
        assert_eq!((d.connections, d.duplicate_ratio), (256, 0.10));
        assert_eq!(d.retry, RetryPolicy::SameId(SameId::DEFAULT));
        let tuned = Args::try_parse_from([
            "flashsale-loadgen",
            "--retry-max",
            "2",
            "--retry-budget-ms",
            "1500",
            "--retry-jitter-pct",
            "0",
        ])
        .unwrap()
        .into_config();
        assert_eq!(
            tuned.retry,
            RetryPolicy::SameId(SameId { retry_max: 2, budget_ms: 1_500, jitter_pct: 0 })
        );
        let wild = Args::try_parse_from(["flashsale-loadgen", "--retry-jitter-pct", "101"]);
        assert!(wild.unwrap().into_config().validate().is_err());
        assert!(Args::try_parse_from(["flashsale-loadgen", "--rate", "x"]).is_err());
        let bad = Args::try_parse_from(["flashsale-loadgen", "--duration-s=-1"]).unwrap();
        assert!(bad.into_config().validate().is_err());
    }

    #[test]
    fn search_flags_map_onto_the_search_config() {
        let plain = Args::try_parse_from(["flashsale-loadgen"]).unwrap();
        assert!(plain.search_config().is_none());
        let args = Args::try_parse_from([
            "flashsale-loadgen",
            "--max-rate-search",
            "--rate",
            "20000",
            "--expect-state",
            "SOLD_OUT",
            "--half-rate-runs",
            "3",
            "--server-pid",
            "42",
        ])
        .unwrap();
        let c = args.search_config().unwrap().unwrap();
        assert_eq!((c.start_rps, c.expect_state), (20_000, Some(State::SoldOut)));
        assert_eq!(
            (c.half_rate_runs, c.half_rate_duration_ms, c.server_pid),
            (3, 10_000, Some(42))
        );
        assert_eq!((c.p99_ms_max, c.achieved_ratio_min, c.growth), (50.0, 0.98, 1.5));
        assert_eq!(c.attempts_max, 2);
        for bad in [["--expect-state", "SOLDOUT"], ["--search-growth", "1"], ["--rate", "10"]] {
            let mut argv = vec!["flashsale-loadgen", "--max-rate-search"];
            argv.extend(bad);
            let args = Args::try_parse_from(argv).unwrap();
            assert!(args.search_config().unwrap().is_err(), "{bad:?}");
        }
    }
}
