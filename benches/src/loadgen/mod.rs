//! `flashsale-loadgen`: the open-loop load generator of issue 5 (DESIGN.md section 10).
//!
//! [`run`] does, in order: validate the [`LoadConfig`]; optionally create the activity
//! through the admin API; mint one pass per user (before the clock starts, never on the hot
//! path); drive the schedule (`driver.rs`); check the stores (`verify.rs`) when `--redis-url`
//! (and `--pg-url`) are given; build the [`Report`]; write `--json` and `--svg`.
//!
//! Code map:
//! - `schedule` — sans-I/O: arrival profile (constant / burst ramp) and the seeded plan of
//!   users and duplicate re-sends.
//! - `http` — sans-I/O: request bytes, response framing, the submit states.
//! - `stats` — HdrHistograms per state, counts, timeline, what was seen.
//! - `driver` — the threads: one `event_loop` each (epoll: schedule, bounded send queue,
//!   connections, retry timers), merged after the run; the progress line.
//! - `retry` — sans-I/O: which answers are retried, after how long, within what bounds.
//! - `redis`, `verify` — the checks after the run.
//! - `admission` — the engine's adaptive limit, sampled from `/metrics` during the run.
//! - `report`, `svg` — the outputs. `config`, `cli` — the knobs.
//! - `search` — `--max-rate-search`: steps the rate up, then bisects, to the highest rate
//!   the target sustains (the bare-server baseline and the engine, same settings); `proc` —
//!   CPU and memory of the generator and the server from `/proc`.
//!
//! What it is not: a benchmark of the generator itself (see `send_lag_ms` in the report
//! for whether it kept up), nor the demo (`flashsale demo` drives this).

pub mod admission;
pub mod cli;
pub mod config;
pub mod driver;
mod event_loop;
pub mod http;
pub mod proc;
pub mod redis;
pub mod report;
pub mod retry;
pub mod schedule;
pub mod search;
pub mod stats;
pub mod svg;
pub mod verify;

use std::net::SocketAddr;
use std::time::Duration;

use flashsale_engine::logic::ids::{ActivityId, UserId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use config::{ConfigError, LoadConfig, Progress};
pub use http::State;
pub use report::Report;
pub use retry::{RetryPolicy, SameId};
pub use schedule::Profile;

/// Why a run could not produce a report (or its files).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Bad configuration: exit code 2.
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("setup: {0}")]
    Setup(String),
    #[error("write {path}: {message}")]
    Output { path: String, message: String },
}

/// The generator's tokio runtime (`--threads` workers) for set-up and checks; the load
/// itself runs on the driver's own event-loop threads.
pub(crate) fn runtime(config: &LoadConfig) -> Result<tokio::runtime::Runtime, LoadError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.threads)
        .thread_name("loadgen")
        .enable_all()
        .build()
        .map_err(|e| LoadError::Setup(format!("tokio runtime: {e}")))
}

/// Runs one load test (builds its own tokio runtime; call it from plain code).
pub fn run(config: LoadConfig) -> Result<Report, LoadError> {
    let resolved = config.validate()?;
    let report = runtime(&config)?.block_on(run_async(&config, &resolved))?;
    if let Some(path) = &config.json_path {
        std::fs::write(path, report.to_json()).map_err(|e| LoadError::Output {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
    }
    if let Some(path) = &config.svg_path {
        svg::write_svg(&report, path)
            .map_err(|message| LoadError::Output { path: path.display().to_string(), message })?;
    }
    Ok(report)
}

async fn run_async(config: &LoadConfig, resolved: &config::Resolved) -> Result<Report, LoadError> {
    if config.create_activity {
        let (admin, host) = resolved
            .admin
            .clone()
            .ok_or_else(|| LoadError::Setup("--create-activity without --admin".into()))?;
        let stock = config.stock.unwrap_or(0);
        create_activity(admin, &host, config.admin_token.as_deref(), config, stock).await?;
    }
    let passes = mint_passes(config, resolved)?;
    let params = drive_params(config, resolved, passes);
    let sampler = resolved
        .admin
        .clone()
        .map(|(admin, host)| admission::Sampler::start(admin, host, config.admin_token.clone()));
    let measured = driver::drive(params).await;
    let admission = match sampler {
        Some(sampler) => sampler.finish().await,
        None => Vec::new(),
    };
    let verification = match resolved.redis {
        Some(redis) => {
            if config.progress == Progress::Stderr {
                eprintln!(
                    "checking the stores{}...",
                    if config.pg_url.is_some() { " after the drain" } else { "" }
                );
            }
            Some(
                verify::verify(verify::VerifyInput {
                    redis,
                    pg_url: config.pg_url.as_deref(),
                    activity_id: config.activity_id,
                    sku_id: config.sku_id,
                    initial_stock: config.stock,
                    seen: &measured.seen,
                    drain_timeout: Duration::from_secs(config.drain_timeout_s),
                    recovery_deadline_ms: config.recovery_deadline_ms,
                })
                .await,
            )
        }
        None => None,
    };
    let mut report = Report::build(run_info(config), measured, verification);
    report.set_admission(&admission);
    Ok(report)
}

/// What the driver needs for one run of `config`.
fn drive_params(
    config: &LoadConfig,
    resolved: &config::Resolved,
    passes: Vec<String>,
) -> driver::DriveParams {
    driver::DriveParams {
        target: resolved.target,
        host: resolved.target_host.clone(),
        passes,
        activity_id: config.activity_id,
        sku_id: config.sku_id,
        run_id: config.run_id.clone(),
        profile: config.profile,
        duration_ms: config.duration_ms,
        connections: config.connections,
        pipeline: config.pipeline,
        threads: config.threads,
        users: config.users,
        duplicate_ratio: config.duplicate_ratio,
        seed: config.seed,
        retry: config.retry,
        timeout_ms: config.timeout_ms,
        queue_max: config.queue_max,
        progress: config.progress,
        trace_max: config.trace_max,
    }
}

fn run_info(config: &LoadConfig) -> report::RunInfo {
    report::RunInfo {
        run_id: config.run_id.clone(),
        target: config.target.clone(),
        activity_id: config.activity_id,
        sku_id: config.sku_id,
        profile: match config.profile {
            Profile::Constant { rate_per_s } => format!("constant {rate_per_s} req/s"),
            Profile::Burst { peak_per_s, ramp_ms } => {
                format!("burst to {peak_per_s} req/s over {ramp_ms} ms")
            }
        },
        target_rps: config.profile.peak_per_s(),
        duration_s: config.duration_ms as f64 / 1e3,
        connections: config.connections,
        pipeline: config.pipeline,
        users: config.users,
        duplicate_ratio: config.duplicate_ratio,
        retry: config.retry.describe(),
        threads: config.threads,
        seed: config.seed,
    }
}

/// One pass per user, valid for the run plus an hour.
fn mint_passes(config: &LoadConfig, resolved: &config::Resolved) -> Result<Vec<String>, LoadError> {
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let exp_unix_s = now_s + config.duration_ms / 1_000 + config.drain_timeout_s + 3_600;
    (0..u64::from(config.users))
        .map(|i| {
            let user = UserId(config.user_id_base + i);
            resolved
                .pass_keys
                .mint(&resolved.kid, user, ActivityId(config.activity_id), exp_unix_s)
                .ok_or_else(|| {
                    LoadError::Setup(format!("cannot mint a pass with kid {}", resolved.kid))
                })
        })
        .collect()
}

/// `POST /admin/v1/activities`: 201 (created) or 200 (the same activity existed).
async fn create_activity(
    admin: SocketAddr,
    host: &str,
    token: Option<&str>,
    config: &LoadConfig,
    stock: u64,
) -> Result<(), LoadError> {
    let body = format!(
        r#"{{"activity_id":{},"sku_id":{},"stock":{stock}}}"#,
        config.activity_id, config.sku_id
    );
    let (status, answer) = request(admin, host, "POST", "/admin/v1/activities", token, Some(&body))
        .await
        .map_err(LoadError::Setup)?;
    if status == 200 || status == 201 {
        return Ok(());
    }
    Err(LoadError::Setup(format!("create activity: HTTP {status}: {answer}")))
}

/// One request on a fresh connection (admin calls; not the hot path).
pub async fn request(
    addr: SocketAddr,
    host: &str,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    body: Option<&str>,
) -> Result<(u16, String), String> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let mut out = Vec::new();
        http::encode_request(&mut out, method, host, path, bearer, body);
        stream.write_all(&out).await.map_err(|e| format!("write to {addr}: {e}"))?;
        let mut buf = Vec::with_capacity(4096);
        loop {
            if let Some(r) = http::parse_response(&buf).map_err(|e| e.to_string())? {
                return Ok((r.status, String::from_utf8_lossy(r.body).into_owned()));
            }
            let n = stream.read_buf(&mut buf).await.map_err(|e| format!("read {addr}: {e}"))?;
            if n == 0 {
                return Err(format!("{addr} closed the connection before answering"));
            }
        }
    };
    // The admin call waits for PostgreSQL and Redis (preheat): generous, but bounded.
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .map_err(|_| format!("{method} {path}: no answer within 30 s"))?
}
