//! The load generator's configuration: every knob spelled out, validated once, then passed
//! down by value. The command line (`cli.rs`) and the tests build a [`LoadConfig`]; nothing
//! below reads the environment.
//!
//! Read next: `cli.rs` for the flags and their defaults, `driver.rs` for how they are used.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

use flashsale_engine::logic::auth::PassKeys;

use super::retry::{RetryPolicy, SameId};
use super::schedule::Profile;

/// Most connections opened at once (each is a socket and a task; the engine's per-shard
/// bound is 16,384).
pub const CONNECTIONS_MAX: usize = 16_384;
/// Deepest pipeline per connection: 64 requests of ~300 bytes fit the socket buffers, so a
/// blocked write can never wait on an unread response.
pub const PIPELINE_MAX: usize = 64;
/// Most distinct users (passes are minted up front, ~150 bytes each: 300 MB at the bound).
pub const USERS_MAX: u32 = 2_000_000;
/// Longest request timeout; below the latency histogram's ceiling (`stats.rs`).
pub const TIMEOUT_MS_MAX: u64 = 30_000;
/// Longest run.
pub const DURATION_MS_MAX: u64 = 3_600_000;
/// Deepest send queue (requests due while every connection is busy).
pub const QUEUE_MAX_MAX: usize = 10_000_000;
/// Longest prefix of request ids (`{run_id}-{seq}` must stay within 64 characters with a
/// 20-digit sequence number).
pub const RUN_ID_LEN_MAX: usize = 43;

/// Whether a progress line goes to stderr every second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    Stderr,
    Off,
}

/// Everything one run needs.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// Public listener, `http://host:port`.
    pub target: String,
    /// Admin listener, `http://host:port` (activity creation).
    pub admin: Option<String>,
    pub admin_token: Option<String>,
    pub profile: Profile,
    pub duration_ms: u64,
    pub connections: usize,
    /// Requests in flight per connection (1 = no pipelining).
    pub pipeline: usize,
    /// Event-loop threads of the generator (each with its share of the connections and of
    /// the schedule); also the worker threads of the tokio runtime around them (set-up and
    /// checks).
    pub threads: usize,
    pub activity_id: u64,
    pub sku_id: u64,
    /// Initial stock: created with `create_activity`, and the base of the Redis checks.
    pub stock: Option<u64>,
    pub create_activity: bool,
    pub users: u32,
    /// User ids are `user_id_base .. user_id_base + users`.
    pub user_id_base: u64,
    /// `kid:hexkey[,...]`; passes are minted with the first kid.
    pub pass_keys: String,
    /// Share of requests that re-send an earlier request of the same user, same request id.
    pub duplicate_ratio: f64,
    pub retry: RetryPolicy,
    pub seed: u64,
    /// Prefix of every request id, unique per run so that two runs against one activity do
    /// not replay each other.
    pub run_id: String,
    pub timeout_ms: u64,
    pub queue_max: usize,
    pub redis_url: Option<String>,
    pub pg_url: Option<String>,
    /// How long to wait for the asynchronous path to settle before checking.
    pub drain_timeout_s: u64,
    /// A reservation younger than this that has no final outcome yet is "in flight", not
    /// lost (the engine's scanner default is 15 min).
    pub recovery_deadline_ms: u64,
    pub json_path: Option<PathBuf>,
    pub svg_path: Option<PathBuf>,
    pub progress: Progress,
    /// Per-request timing of the first `trace_max` requests, in the report (tests).
    pub trace_max: usize,
}

impl LoadConfig {
    /// A configuration with the command line's defaults, for tests to adjust.
    pub fn new(target: impl Into<String>) -> LoadConfig {
        LoadConfig {
            target: target.into(),
            admin: None,
            admin_token: None,
            profile: Profile::Constant { rate_per_s: 1_000 },
            duration_ms: 10_000,
            connections: 256,
            pipeline: 1,
            threads: 1,
            activity_id: 10_001,
            sku_id: 20_001,
            stock: None,
            create_activity: false,
            users: 50_000,
            user_id_base: 1,
            pass_keys: flashsale_engine::logic::auth::DEV_PASS_KEYS.to_owned(),
            duplicate_ratio: 0.10,
            retry: RetryPolicy::SameId(SameId::DEFAULT),
            seed: 1,
            run_id: default_run_id(),
            timeout_ms: 5_000,
            queue_max: 1 << 20,
            redis_url: None,
            pg_url: None,
            drain_timeout_s: 60,
            recovery_deadline_ms: 15 * 60 * 1_000,
            json_path: None,
            svg_path: None,
            progress: Progress::Stderr,
            trace_max: 0,
        }
    }

    /// Checks every bound and resolves what can be resolved before the run.
    pub fn validate(&self) -> Result<Resolved, ConfigError> {
        let bad = |m: String| Err(ConfigError(m));
        if let Some(reason) = self.profile.invalid_reason() {
            return bad(reason);
        }
        if self.duration_ms == 0 || self.duration_ms > DURATION_MS_MAX {
            return bad(format!("duration must be 1..={DURATION_MS_MAX} ms"));
        }
        if self.connections == 0 || self.connections > CONNECTIONS_MAX {
            return bad(format!("connections must be 1..={CONNECTIONS_MAX}"));
        }
        if self.pipeline == 0 || self.pipeline > PIPELINE_MAX {
            return bad(format!("pipeline must be 1..={PIPELINE_MAX}"));
        }
        if self.threads == 0 || self.threads > 64 {
            return bad("threads must be 1..=64".into());
        }
        if self.users == 0 || self.users > USERS_MAX {
            return bad(format!("users must be 1..={USERS_MAX}"));
        }
        if self.user_id_base == 0 || self.user_id_base.checked_add(u64::from(self.users)).is_none()
        {
            return bad("user ids must be ≥ 1 and fit in u64".into());
        }
        if self.activity_id == 0 || self.sku_id == 0 {
            return bad("activity and sku ids must be ≥ 1".into());
        }
        if !(0.0..=1.0).contains(&self.duplicate_ratio) {
            return bad("duplicate ratio must be in [0, 1]".into());
        }
        if let Some(reason) = self.retry.invalid_reason() {
            return bad(reason);
        }
        if self.timeout_ms == 0 || self.timeout_ms > TIMEOUT_MS_MAX {
            return bad(format!("timeout must be 1..={TIMEOUT_MS_MAX} ms"));
        }
        if self.queue_max == 0 || self.queue_max > QUEUE_MAX_MAX {
            return bad(format!("queue max must be 1..={QUEUE_MAX_MAX}"));
        }
        if self.run_id.is_empty()
            || self.run_id.len() > RUN_ID_LEN_MAX
            || !self.run_id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return bad(format!("run id must be 1-{RUN_ID_LEN_MAX} characters of [A-Za-z0-9_-]"));
        }
        if self.create_activity && (self.admin.is_none() || self.stock.is_none()) {
            return bad("--create-activity needs --admin and --stock".into());
        }
        if self.pg_url.is_some() && self.redis_url.is_none() {
            return bad("--pg-url needs --redis-url (the checks join both stores)".into());
        }
        let pass_keys = PassKeys::parse(&self.pass_keys)
            .map_err(|e| ConfigError(format!("--pass-keys: {e}")))?;
        let kid = pass_keys.kid(0).unwrap_or_default().to_owned();
        let (target, target_host) = http_addr("--target", &self.target)?;
        let admin = match &self.admin {
            Some(url) => Some(http_addr("--admin", url)?),
            None => None,
        };
        let redis = match &self.redis_url {
            Some(url) => Some(redis_addr(url)?),
            None => None,
        };
        Ok(Resolved { target, target_host, admin, redis, pass_keys, kid })
    }
}

/// What [`LoadConfig::validate`] resolved.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub target: SocketAddr,
    /// The `Host` header value.
    pub target_host: String,
    pub admin: Option<(SocketAddr, String)>,
    pub redis: Option<SocketAddr>,
    pub pass_keys: PassKeys,
    pub kid: String,
}

/// A configuration that cannot run (exit code 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn http_addr(flag: &str, url: &str) -> Result<(SocketAddr, String), ConfigError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| ConfigError(format!("{flag} must be http://host:port, got {url:?}")))?;
    let host_port = rest.trim_end_matches('/');
    if host_port.contains('/') || !host_port.contains(':') {
        return Err(ConfigError(format!("{flag} must be http://host:port, got {url:?}")));
    }
    let addr = resolve(flag, host_port)?;
    Ok((addr, host_port.to_owned()))
}

fn redis_addr(url: &str) -> Result<SocketAddr, ConfigError> {
    let rest = url.strip_prefix("redis://").ok_or_else(|| {
        ConfigError(format!("--redis-url must be redis://host:port, got {url:?}"))
    })?;
    let first = rest.split(',').next().unwrap_or(rest);
    let host_port = first.split('/').next().unwrap_or(first);
    resolve("--redis-url", host_port)
}

fn resolve(flag: &str, host_port: &str) -> Result<SocketAddr, ConfigError> {
    host_port
        .to_socket_addrs()
        .map_err(|e| ConfigError(format!("{flag}: resolve {host_port}: {e}")))?
        .next()
        .ok_or_else(|| ConfigError(format!("{flag}: no address for {host_port}")))
}

/// A run id from the wall clock (base 36 milliseconds): unique per run in practice, short.
pub fn default_run_id() -> String {
    let mut ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut digits = Vec::new();
    loop {
        digits.push(b"0123456789abcdefghijklmnopqrstuvwxyz"[(ms % 36) as usize]);
        ms /= 36;
        if ms == 0 {
            break;
        }
    }
    digits.reverse();
    format!("lg{}", String::from_utf8_lossy(&digits))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bounds_are_checked() {
        let ok = LoadConfig::new("http://127.0.0.1:8080");
        let resolved = ok.validate().unwrap();
        assert_eq!(resolved.kid, "dev");
        assert_eq!(resolved.target_host, "127.0.0.1:8080");
        let cases: Vec<(&str, LoadConfig)> = vec![
            ("target", LoadConfig::new("127.0.0.1:8080")),
            ("target", LoadConfig::new("http://127.0.0.1:8080/v1")),
            ("pipeline", LoadConfig { pipeline: 65, ..ok.clone() }),
            ("connections", LoadConfig { connections: 0, ..ok.clone() }),
            ("duplicate", LoadConfig { duplicate_ratio: 1.5, ..ok.clone() }),
            ("run id", LoadConfig { run_id: "a.b".into(), ..ok.clone() }),
            ("--create-activity", LoadConfig { create_activity: true, ..ok.clone() }),
            ("--pass-keys", LoadConfig { pass_keys: "nokey".into(), ..ok.clone() }),
            ("--pg-url", LoadConfig { pg_url: Some("postgres://x".into()), ..ok.clone() }),
            ("rate", LoadConfig { profile: Profile::Constant { rate_per_s: 0 }, ..ok.clone() }),
            (
                "retry budget",
                LoadConfig {
                    retry: RetryPolicy::SameId(SameId { budget_ms: 1 << 40, ..SameId::DEFAULT }),
                    ..ok.clone()
                },
            ),
        ];
        for (needle, config) in cases {
            let err = config.validate().unwrap_err();
            assert!(err.0.contains(needle), "{needle}: {err}");
        }
        let id = default_run_id();
        assert!(id.starts_with("lg") && id.len() <= RUN_ID_LEN_MAX, "{id}");
    }
}
