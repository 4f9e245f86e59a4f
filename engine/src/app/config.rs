//! Configuration: a TOML file, overridden by environment variables, overridden by flags
//! (CONTRACT.md section 2). Parsed and validated once in `main`, then passed down by value;
//! nothing below `main` reads the environment.
//!
//! Only the settings that the implemented commands use live here; each later subsystem adds
//! its section (with its bounds checked where it is read: `admission_budgets`,
//! `overload_settings`, `worker_settings`, ...).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use flashsale_io::jetstream::LogConfig;

use crate::app::stack::StackEnv;

/// The stack directory used when none is given (CONTRACT.md section 1).
pub const DEFAULT_STACK_DIR: &str = "var/stack";
/// The configuration file read when `--config` is absent and it exists.
pub const DEFAULT_CONFIG_FILE: &str = "flashsale.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid {name}: {message}")]
    Invalid { name: &'static str, message: String },
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `redis://h:p[,h:p...]`: one standalone server, or seeds of a cluster.
    pub redis_url: String,
    /// `FLASHSALE_REDIS_MIN_REPLICA_ACKS` over `[redis] min_replica_acks` over `auto` (1 when
    /// every master serving the SKUs has a replica, else 0 with a start-up warning).
    pub redis_min_replica_acks: flashsale_io::redis::fence::MinReplicaAcks,
    /// `FLASHSALE_REDIS_ALLOW_EVICTION` over `[redis] allow_eviction` (default false →
    /// `Enforce`): whether a master without `maxmemory-policy noeviction` refuses the start.
    pub redis_eviction: crate::logic::redis_settings::EvictionCheck,
    pub pg_url: String,
    pub nats_url: String,
    pub http_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Number of glommio shards (`FLASHSALE_SHARDS`, default: available cores).
    pub shards: usize,
    /// `kid:hexkey,...` as given; parsed and checked by `auth::PassKeys::parse` in `main`.
    pub pass_keys: Option<String>,
    pub admin_token: Option<String>,
    pub control_key: Option<String>,
    /// `FLASHSALE_PAYMENT_KEY` (hex) as given; parsed by `shard::orders::PaymentKey::from_hex`
    /// in `main`. None: payment callbacks are refused.
    pub payment_key: Option<String>,
    /// `decide_submit`'s budgets (`[admission]`, validated).
    pub admission: crate::logic::admission::Budgets,
    /// The expensive path's adaptive limit (`[overload]`, validated).
    pub overload: crate::logic::overload::OverloadConfig,
    /// Where accepted mode snapshots persist (`FLASHSALE_MODE_STATE_FILE`, default
    /// `var/modes.json`).
    pub mode_state_file: PathBuf,
    /// Hot SKUs pinned to shards (`[engine] pins = ["10001:20001=1"]`).
    pub pins: Vec<(crate::logic::placement::SkuKey, usize)>,
    /// `FLASHSALE_INSTANCE_ID` over `[engine] instance_id`, validated
    /// (`logic::ids::InstanceId::parse`); None: 8 random hex digits drawn at start.
    pub instance_id: Option<crate::logic::ids::InstanceId>,
    /// The log client's configuration, built once here and handed to `serve` (durable side and
    /// worker) and `worker` by value: `url` = `nats_url`, `replicas` from `[log] replicas` /
    /// `FLASHSALE_LOG_REPLICAS` (default 1; every stream and the mode bucket; an existing
    /// stream is never lowered), the rest `LogConfig::default()`.
    pub log: LogConfig,
    /// The order-writer's sizing (`[worker]`, `FLASHSALE_PG_CORES`), validated; applied to a
    /// worker configuration with [`WorkerSettings::apply`].
    pub worker: WorkerSettings,
    /// The edge's `[http]` settings beyond `addr` (validated; unset fields keep the defaults).
    pub http: HttpSettings,
    /// `[payments]`: the provider the closer asks before closing an order (validated).
    pub payments: PaymentsSettings,
    /// `[metrics]`: the SKUs with funnel series of their own (the pinned SKUs first, then
    /// `hot_skus`), their bound and the promotion threshold (validated).
    pub sku_funnel: crate::logic::sku_funnel::SkuFunnelConfig,
    /// Trace export (`[tracing]`, `FLASHSALE_OTLP_ENDPOINT`, `FLASHSALE_TRACE_SAMPLE_RATIO`),
    /// validated; off without an endpoint. `service_instance_id` is set by `main` (the
    /// instance id is drawn there when not configured).
    pub tracing: flashsale_io::trace::TraceConfig,
}

/// `[payments]`: the payment provider's status endpoint, which the worker's closer asks (a
/// request signed with `FLASHSALE_PAYMENT_KEY`, see `flashsale_pg_worker::provider`) before it
/// closes an order that got no callback. Without `status_url` the closer closes unverified
/// (and says so at start). Unset numbers keep `ProviderConfig::new`'s defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PaymentsSettings {
    /// `FLASHSALE_PAYMENT_STATUS_URL` over `[payments] status_url`: `http://host[:port][/path]`
    /// (plain HTTP to a loopback or private-network endpoint). Requires the payment key.
    pub status_url: Option<String>,
    /// `[payments] status_timeout_ms`: deadline of one attempt.
    pub timeout_ms: Option<u64>,
    /// `[payments] status_attempts`: attempts per ask (1..=5).
    pub attempts: Option<u32>,
    /// `[payments] backoff_min_ms` / `backoff_max_ms`: asking again about an unknown order.
    pub backoff_min_ms: Option<u64>,
    pub backoff_max_ms: Option<u64>,
    /// `FLASHSALE_PAYMENT_CLOSE_UNPAID_WITHOUT_PROVIDER` over `[payments]
    /// close_unpaid_without_provider` (default false): without a `status_url`, orders past
    /// their pay timeout are held PAYMENT_UNKNOWN with their unit (`HoldUnknown`) unless this
    /// opts in to closing them unverified (`CloseUnverified`, logged loudly at start).
    pub without_provider: flashsale_pg_worker::payments::WithoutProvider,
}

impl PaymentsSettings {
    /// The provider's configuration with `key` (None without a `status_url`).
    pub fn provider(
        &self,
        key: &flashsale_io::key::HmacKey,
    ) -> Option<flashsale_pg_worker::provider::ProviderConfig> {
        let url = self.status_url.as_ref()?;
        let mut config = flashsale_pg_worker::provider::ProviderConfig::new(url, key.clone());
        if let Some(v) = self.timeout_ms {
            config.timeout_ms = v;
        }
        if let Some(v) = self.attempts {
            config.attempts = v;
        }
        if let Some(v) = self.backoff_min_ms {
            config.backoff_min_ms = v;
        }
        if let Some(v) = self.backoff_max_ms {
            config.backoff_max_ms = v;
        }
        Some(config)
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PaymentsSection {
    status_url: Option<String>,
    status_timeout_ms: Option<u64>,
    status_attempts: Option<u32>,
    backoff_min_ms: Option<u64>,
    backoff_max_ms: Option<u64>,
    close_unpaid_without_provider: Option<bool>,
}

/// `[payments]` and `FLASHSALE_PAYMENT_STATUS_URL`, checked with the provider's own validation
/// (a status URL needs a valid payment key to sign with).
fn payments_settings(
    section: PaymentsSection,
    env: &Env,
    payment_key: Option<&str>,
) -> Result<PaymentsSettings, ConfigError> {
    let invalid = |message: String| ConfigError::Invalid { name: "[payments]", message };
    let status_url = env
        .get("FLASHSALE_PAYMENT_STATUS_URL")
        .cloned()
        .or(section.status_url)
        .map(|u| u.trim().to_owned())
        .filter(|u| !u.is_empty());
    let close_unverified = flag(
        env,
        "FLASHSALE_PAYMENT_CLOSE_UNPAID_WITHOUT_PROVIDER",
        section.close_unpaid_without_provider,
    )?;
    let settings = PaymentsSettings {
        status_url,
        timeout_ms: section.status_timeout_ms,
        attempts: section.status_attempts,
        backoff_min_ms: section.backoff_min_ms,
        backoff_max_ms: section.backoff_max_ms,
        without_provider: if close_unverified {
            flashsale_pg_worker::payments::WithoutProvider::CloseUnverified
        } else {
            flashsale_pg_worker::payments::WithoutProvider::HoldUnknown
        },
    };
    if settings.status_url.is_some() {
        let hex = payment_key.ok_or_else(|| {
            invalid("FLASHSALE_PAYMENT_STATUS_URL needs FLASHSALE_PAYMENT_KEY to sign with".into())
        })?;
        let key = flashsale_io::key::HmacKey::from_hex(hex)
            .map_err(|e| invalid(format!("FLASHSALE_PAYMENT_KEY: {e}")))?;
        if let Some(provider) = settings.provider(&key) {
            provider.validate().map_err(|e| invalid(e.to_string()))?;
        }
    }
    Ok(settings)
}

/// The order-writer settings an operator sizes for the deployment (`[worker]` in the TOML,
/// `FLASHSALE_PG_CORES`). Unset fields keep `flashsale_pg_worker::worker::WorkerConfig`'s
/// defaults, which were measured with `benches/benches/order_pipeline.rs`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerSettings {
    /// Cores of the PostgreSQL primary: two order writers each (`[worker] pg_cores`,
    /// `FLASHSALE_PG_CORES`; default: this machine's cores, right when PostgreSQL runs beside
    /// the worker).
    pub pg_cores: usize,
    /// Explicit writer count (`[worker] order_writers`), overriding `pg_cores`.
    pub order_writers: Option<usize>,
    /// `[worker] order_path`: `"set"` (default) or `"per_message"`.
    pub order_path: Option<flashsale_pg_worker::OrderPath>,
    /// `[worker] fetch_min` / `fetch_max`: the adaptive batch's floor and bound (messages).
    pub fetch_min: Option<usize>,
    pub fetch_max: Option<usize>,
    /// `[worker] batch_max`: messages per transaction on the per-message path (1..=64).
    pub batch_max: Option<usize>,
    /// `[worker] nice`: the worker threads' niceness (0..=19; default 19).
    pub nice: Option<i32>,
}

impl WorkerSettings {
    /// Applies the settings to `worker` and grows its pool to hold every writer, the outbox
    /// publishers and the lag task (the pool is this process's connection budget: one each).
    pub fn apply(&self, worker: &mut flashsale_pg_worker::worker::WorkerConfig) {
        worker.order_writers = self.order_writers.unwrap_or_else(|| {
            flashsale_pg_worker::worker::order_writers_for_pg_cores(self.pg_cores)
        });
        if let Some(path) = self.order_path {
            worker.order_path = path;
        }
        if let Some(v) = self.fetch_min {
            worker.fetch_min = v;
        }
        if let Some(v) = self.fetch_max {
            worker.fetch_max = v;
        }
        if let Some(v) = self.batch_max {
            worker.batch_max = v;
        }
        if let Some(v) = self.nice {
            worker.nice = v;
        }
        let needed = worker.order_writers + worker.outbox_publishers + 1;
        worker.pg.pool_size = worker.pg.pool_size.max(needed);
    }
}

/// `[http]`: connection bounds, deadlines, the public health path and the trusted PROXY
/// protocol sources. `None`: keep `serve::default_edge_config`'s value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpSettings {
    /// `FLASHSALE_PROXY_PROTOCOL_FROM` / `proxy_protocol_from`: comma-separated CIDRs.
    pub proxy_protocol_from: crate::http::proxy::TrustedSources,
    /// e.g. `/healthz`: 200 when ready, 503 while draining, on the public port.
    pub health_path: Option<String>,
    pub connections_per_shard_max: Option<usize>,
    pub connections_per_address_max: Option<usize>,
    pub header_read_timeout_ms: Option<u64>,
    pub body_read_timeout_ms: Option<u64>,
    pub write_timeout_ms: Option<u64>,
    pub idle_timeout_ms: Option<u64>,
}

impl HttpSettings {
    /// Puts the settings into the edge's configuration (called by `main` on the defaults).
    pub fn apply(&self, edge: &mut crate::shard::EdgeConfig) {
        edge.proxy_protocol_from = self.proxy_protocol_from.clone();
        edge.health_path = self.health_path.clone();
        let sizes = [
            (self.connections_per_shard_max, &mut edge.connections_per_shard_max),
            (self.connections_per_address_max, &mut edge.connections_per_address_max),
        ];
        for (value, field) in sizes {
            if let Some(value) = value {
                *field = value;
            }
        }
        let times = [
            (self.header_read_timeout_ms, &mut edge.header_read_timeout_ms),
            (self.body_read_timeout_ms, &mut edge.body_read_timeout_ms),
            (self.write_timeout_ms, &mut edge.write_timeout_ms),
            (self.idle_timeout_ms, &mut edge.idle_timeout_ms),
        ];
        for (value, field) in times {
            if let Some(value) = value {
                *field = value;
            }
        }
        edge.connections_per_address_max =
            edge.connections_per_address_max.min(edge.connections_per_shard_max);
    }
}

/// Longest deadline `[http]` accepts: an hour is already far past any client's patience.
const HTTP_TIMEOUT_MS_MAX: u64 = 3_600_000;
/// Longest public health path.
const HEALTH_PATH_BYTES_MAX: usize = 64;

/// The TOML file's shape. Every field optional: the file only overrides defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    redis: Option<RedisSection>,
    pg: Option<UrlSection>,
    nats: Option<UrlSection>,
    http: Option<HttpSection>,
    admin: Option<AdminSection>,
    engine: Option<EngineSection>,
    auth: Option<AuthSection>,
    admission: Option<AdmissionSection>,
    overload: Option<OverloadSection>,
    log: Option<LogSection>,
    worker: Option<WorkerSection>,
    payments: Option<PaymentsSection>,
    metrics: Option<MetricsSection>,
    tracing: Option<TracingSection>,
}

/// `[tracing]`: trace export over OTLP/HTTP (`flashsale_io::trace`; defaults in
/// `TraceConfig::default`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TracingSection {
    otlp_endpoint: Option<String>,
    sample_ratio: Option<f64>,
    queue_spans_max: Option<usize>,
    export_batch_max: Option<usize>,
    export_interval_ms: Option<u64>,
    export_timeout_ms: Option<u64>,
}

/// `[metrics]`: see `logic::sku_funnel` (`hot_skus = ["10001:20001"]`, `sku_series_max`,
/// `sku_promote_min_events`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricsSection {
    hot_skus: Option<Vec<String>>,
    sku_series_max: Option<usize>,
    sku_promote_min_events: Option<u64>,
}

/// `[log]`: the replicated log's placement (the NATS URL itself is `[nats] url`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LogSection {
    replicas: Option<usize>,
}

/// `[worker]`: see [`WorkerSettings`].
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerSection {
    pg_cores: Option<usize>,
    order_writers: Option<usize>,
    order_path: Option<String>,
    fetch_min: Option<usize>,
    fetch_max: Option<usize>,
    batch_max: Option<usize>,
    nice: Option<i32>,
}

/// `[overload]`: the expensive path's adaptive limit (`logic::overload`; defaults there).
/// Off unless `enabled = true`: pinned at `limit_max` (no shedding by it, no readiness by it).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct OverloadSection {
    enabled: Option<bool>,
    target_ms: Option<u64>,
    window_ms: Option<u64>,
    limit_min: Option<u32>,
    limit_max: Option<u32>,
    limit_initial: Option<u32>,
    backlog_age_soft_ms: Option<u64>,
    retry_ms: Option<u64>,
    unready_after_ms: Option<u64>,
    ready_after_ms: Option<u64>,
}

/// `[admission]`: `decide_submit`'s budgets (defaults derived from the 3 s order SLO in
/// `admission.rs`; override them knowingly, e.g. with the deployment's measured drain rate).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdmissionSection {
    oldest_pending_age_max_ms: Option<u64>,
    pending_count_max: Option<u64>,
    backlog_sample_age_max_ms: Option<u64>,
    pg_outage_age_max_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdminSection {
    addr: Option<String>,
    token: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineSection {
    shards: Option<usize>,
    /// `"activity:sku=shard"` entries pinning hot SKUs to shards.
    pins: Option<Vec<String>>,
    instance_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthSection {
    pass_keys: Option<String>,
    control_key: Option<String>,
    payment_key: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct UrlSection {
    url: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RedisSection {
    url: Option<String>,
    /// A number or `"auto"`.
    min_replica_acks: Option<String>,
    allow_eviction: Option<bool>,
}

/// `[http]`: the public listener and its connections (see [`HttpSettings`]).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpSection {
    addr: Option<String>,
    health_path: Option<String>,
    proxy_protocol_from: Option<String>,
    connections_per_shard_max: Option<usize>,
    connections_per_address_max: Option<usize>,
    header_read_timeout_ms: Option<u64>,
    body_read_timeout_ms: Option<u64>,
    write_timeout_ms: Option<u64>,
    idle_timeout_ms: Option<u64>,
}

/// Flag values (highest precedence); `None` = not given.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub redis_url: Option<String>,
    pub pg_url: Option<String>,
    pub nats_url: Option<String>,
    pub http_addr: Option<String>,
    pub admin_addr: Option<String>,
    pub shards: Option<usize>,
}

/// Where the environment comes from: the process environment in `main`, a map in tests.
pub type Env = BTreeMap<String, String>;

pub fn process_env() -> Env {
    std::env::vars().filter(|(k, _)| k.starts_with("FLASHSALE_")).collect()
}

impl Config {
    /// TOML (explicit path, else `flashsale.toml` if present) < env < flags. URL defaults
    /// come from the stack's env file (`var/stack/env`) when a stack was started here.
    pub fn load(
        config_path: Option<&Path>,
        env: &Env,
        flags: &Overrides,
        stack_dir: &Path,
    ) -> Result<Config, ConfigError> {
        let file = match config_path {
            Some(path) => read_file(path)?,
            None => read_default_file()?,
        };
        let layers = Layers { env, flags, stack: StackEnv::read(stack_dir) };
        let FileConfig {
            redis,
            pg,
            nats,
            http,
            admin,
            engine,
            auth,
            admission,
            overload,
            log,
            worker,
            payments,
            metrics,
            tracing,
        } = file;
        let mut http_section = http.unwrap_or_default();
        let endpoints = layers.endpoints(redis, pg, nats, &mut http_section, admin)?;
        let (file_keys, file_control, file_payment) =
            auth.map_or((None, None, None), |s| (s.pass_keys, s.control_key, s.payment_key));
        let worker = worker_settings(worker.unwrap_or_default(), env)?;
        let proxy_from = env
            .get("FLASHSALE_PROXY_PROTOCOL_FROM")
            .cloned()
            .or(http_section.proxy_protocol_from.take());
        let http = http_settings(http_section, proxy_from.as_deref())?;
        let engine = engine_settings(engine.as_ref(), flags, env)?;
        let nats_url = check_scheme("FLASHSALE_NATS_URL", endpoints.nats_url, &["nats://"])?;
        let log = log_config(env, log.unwrap_or_default(), &nats_url)?;
        let payment_key = layers.optional("FLASHSALE_PAYMENT_KEY", file_payment);
        let payments =
            payments_settings(payments.unwrap_or_default(), env, payment_key.as_deref())?;
        Ok(Config {
            redis_url: check_redis_url(endpoints.redis_url)?,
            redis_min_replica_acks: endpoints.redis_min_replica_acks,
            redis_eviction: endpoints.redis_eviction,
            pg_url: check_pg_url(endpoints.pg_url)?,
            nats_url,
            http_addr: parse_addr("FLASHSALE_HTTP_ADDR", &endpoints.http_addr)?,
            admin_addr: parse_addr("FLASHSALE_ADMIN_ADDR", &endpoints.admin_addr)?,
            shards: engine.shards,
            pass_keys: layers.optional("FLASHSALE_PASS_KEYS", file_keys),
            admin_token: layers.optional("FLASHSALE_ADMIN_TOKEN", endpoints.admin_file_token),
            control_key: layers.optional("FLASHSALE_CONTROL_KEY", file_control),
            payment_key,
            admission: admission_budgets(admission.unwrap_or_default())?,
            overload: overload_settings(overload.unwrap_or_default())?,
            mode_state_file: layers.mode_state_file(),
            sku_funnel: sku_funnel_settings(metrics.unwrap_or_default(), &engine.pins)?,
            pins: engine.pins,
            instance_id: engine.instance_id,
            log,
            worker,
            http,
            payments,
            tracing: tracing_settings(tracing.unwrap_or_default(), env)?,
        })
    }
}

/// `[tracing]` with `FLASHSALE_OTLP_ENDPOINT` over `otlp_endpoint` and
/// `FLASHSALE_TRACE_SAMPLE_RATIO` over `sample_ratio`; every bound checked.
fn tracing_settings(
    section: TracingSection,
    env: &Env,
) -> Result<flashsale_io::trace::TraceConfig, ConfigError> {
    use flashsale_io::trace::{OtlpEndpoint, SampleRatio, TraceConfig};
    let invalid = |name: &'static str, message: String| ConfigError::Invalid { name, message };
    let mut config = TraceConfig::default();
    let endpoint = env
        .get("FLASHSALE_OTLP_ENDPOINT")
        .cloned()
        .or(section.otlp_endpoint)
        .filter(|url| !url.trim().is_empty());
    if let Some(url) = endpoint {
        config.endpoint =
            Some(OtlpEndpoint::parse(&url).map_err(|e| invalid("FLASHSALE_OTLP_ENDPOINT", e))?);
    }
    let ratio = env
        .get("FLASHSALE_TRACE_SAMPLE_RATIO")
        .cloned()
        .or(section.sample_ratio.map(|r| r.to_string()));
    if let Some(text) = ratio {
        config.sample_ratio =
            SampleRatio::parse(&text).map_err(|e| invalid("FLASHSALE_TRACE_SAMPLE_RATIO", e))?;
    }
    let fields = [
        (section.queue_spans_max, &mut config.queue_spans_max),
        (section.export_batch_max, &mut config.export_batch_max),
    ];
    for (value, field) in fields {
        if let Some(v) = value {
            *field = v;
        }
    }
    if let Some(v) = section.export_interval_ms {
        config.export_interval_ms = v;
    }
    if let Some(v) = section.export_timeout_ms {
        config.export_timeout_ms = v;
    }
    config.validate().map_err(|e| invalid("[tracing]", e))?;
    Ok(config)
}

/// `[metrics]`: the pinned SKUs are hot (an operator pinned them for their traffic), then
/// `hot_skus` (`"activity:sku"`); the bound and threshold checked by the funnel's own rule.
fn sku_funnel_settings(
    section: MetricsSection,
    pins: &[(crate::logic::placement::SkuKey, usize)],
) -> Result<crate::logic::sku_funnel::SkuFunnelConfig, ConfigError> {
    let invalid = |message: String| ConfigError::Invalid { name: "[metrics]", message };
    let mut config = crate::logic::sku_funnel::SkuFunnelConfig {
        hot: pins.iter().map(|(key, _)| *key).collect(),
        ..Default::default()
    };
    for entry in section.hot_skus.unwrap_or_default() {
        let key = entry.split_once(':').and_then(|(a, s)| {
            Some(crate::logic::placement::SkuKey::new(
                a.trim().parse().ok()?,
                s.trim().parse().ok()?,
            ))
        });
        let key =
            key.ok_or_else(|| invalid(format!("hot_skus: {entry:?} is not \"activity:sku\"")))?;
        if !config.hot.contains(&key) {
            config.hot.push(key);
        }
    }
    if let Some(v) = section.sku_series_max {
        config.series_max = v;
    }
    if let Some(v) = section.sku_promote_min_events {
        config.promote_min_events = v;
    }
    config.validate().map_err(invalid)?;
    Ok(config)
}

/// Where [`Config::load`] reads a setting, highest first: its flag, its `FLASHSALE_*`
/// variable, the file; then a default (for the store URLs, the stack's env file when a stack
/// was started here).
struct Layers<'a> {
    env: &'a Env,
    flags: &'a Overrides,
    stack: Option<StackEnv>,
}

/// The addresses [`Layers::endpoints`] picked, checked later by [`Config::load`].
struct Endpoints {
    redis_url: String,
    redis_min_replica_acks: flashsale_io::redis::fence::MinReplicaAcks,
    redis_eviction: crate::logic::redis_settings::EvictionCheck,
    pg_url: String,
    nats_url: String,
    http_addr: String,
    admin_addr: String,
    /// `[admin] token`, below `FLASHSALE_ADMIN_TOKEN`.
    admin_file_token: Option<String>,
}

impl Layers<'_> {
    /// `FLASHSALE_MODE_STATE_FILE`, default `var/modes.json`.
    fn mode_state_file(&self) -> PathBuf {
        self.optional("FLASHSALE_MODE_STATE_FILE", None)
            .map_or_else(|| PathBuf::from("var/modes.json"), PathBuf::from)
    }

    fn pick(
        &self,
        flag: &Option<String>,
        var: &str,
        file: Option<String>,
        default: String,
    ) -> String {
        flag.clone().or_else(|| self.env.get(var).cloned()).or(file).unwrap_or(default)
    }

    /// A setting without a flag or a default (keys, token, a path): unset when blank.
    fn optional(&self, var: &str, file: Option<String>) -> Option<String> {
        self.env.get(var).cloned().or(file).filter(|v| !v.trim().is_empty())
    }

    /// The store URLs (and Redis' replica acknowledgements) and the two listeners, as picked
    /// from the layers; `http` keeps its other fields for [`http_settings`].
    fn endpoints(
        &self,
        redis: Option<RedisSection>,
        pg: Option<UrlSection>,
        nats: Option<UrlSection>,
        http: &mut HttpSection,
        admin: Option<AdminSection>,
    ) -> Result<Endpoints, ConfigError> {
        let (flags, stack) = (self.flags, self.stack.as_ref());
        let (file_redis_url, file_acks, file_eviction) =
            redis.map_or((None, None, None), |s| (s.url, s.min_replica_acks, s.allow_eviction));
        let redis_min_replica_acks = min_replica_acks(self.env, file_acks)?;
        let redis_eviction = if flag(self.env, "FLASHSALE_REDIS_ALLOW_EVICTION", file_eviction)? {
            crate::logic::redis_settings::EvictionCheck::Overridden
        } else {
            crate::logic::redis_settings::EvictionCheck::Enforce
        };
        let redis_url = self.pick(
            &flags.redis_url,
            "FLASHSALE_REDIS_URL",
            file_redis_url,
            stack.map_or("redis://127.0.0.1:6379".into(), |s| s.redis_url.clone()),
        );
        let pg_url = self.pick(
            &flags.pg_url,
            "FLASHSALE_PG_URL",
            pg.and_then(|s| s.url),
            stack
                .map_or("postgres://postgres@127.0.0.1:5432/postgres".into(), |s| s.pg_url.clone()),
        );
        let nats_url = self.pick(
            &flags.nats_url,
            "FLASHSALE_NATS_URL",
            nats.and_then(|s| s.url),
            stack.map_or("nats://127.0.0.1:4222".into(), |s| s.nats_url.clone()),
        );
        let http_addr = self.pick(
            &flags.http_addr,
            "FLASHSALE_HTTP_ADDR",
            http.addr.take(),
            "0.0.0.0:8080".into(),
        );
        let (admin_file_addr, admin_file_token) = admin.map_or((None, None), |s| (s.addr, s.token));
        let admin_addr = self.pick(
            &flags.admin_addr,
            "FLASHSALE_ADMIN_ADDR",
            admin_file_addr,
            "127.0.0.1:9090".into(),
        );
        Ok(Endpoints {
            redis_url,
            redis_min_replica_acks,
            redis_eviction,
            pg_url,
            nats_url,
            http_addr,
            admin_addr,
            admin_file_token,
        })
    }
}

/// `[engine]` with its variables and flag: hot-SKU pins, the instance id, the shard count.
struct EngineSettings {
    pins: Vec<(crate::logic::placement::SkuKey, usize)>,
    instance_id: Option<crate::logic::ids::InstanceId>,
    shards: usize,
}

fn engine_settings(
    engine: Option<&EngineSection>,
    flags: &Overrides,
    env: &Env,
) -> Result<EngineSettings, ConfigError> {
    let pins = parse_pins(engine.and_then(|e| e.pins.as_deref()).unwrap_or(&[]))?;
    let instance_id = instance_id(env, engine.and_then(|e| e.instance_id.clone()))?;
    let shards = shard_count(flags.shards, env, engine.and_then(|e| e.shards))?;
    Ok(EngineSettings { pins, instance_id, shards })
}

/// `flashsale.toml` in the working directory when it exists, else an empty file.
fn read_default_file() -> Result<FileConfig, ConfigError> {
    let path = Path::new(DEFAULT_CONFIG_FILE);
    if path.is_file() {
        read_file(path)
    } else {
        Ok(FileConfig::default())
    }
}

/// `FLASHSALE_REDIS_URL` must read as `redis://host:port[,host:port...][/db]` (names are
/// resolved when the engine starts, `serve::edge_config`, not here).
fn check_redis_url(url: String) -> Result<String, ConfigError> {
    let invalid = |why: &str| ConfigError::Invalid {
        name: "FLASHSALE_REDIS_URL",
        message: format!("{url:?}: {why} (expected redis://host:port[,host:port...])"),
    };
    let rest = url.trim().strip_prefix("redis://").ok_or_else(|| invalid("no redis:// scheme"))?;
    for seed in rest.split(',') {
        let seed = seed.trim();
        let seed = seed.strip_prefix("redis://").unwrap_or(seed);
        let host_port = seed.split('/').next().unwrap_or(seed);
        if host_port.contains('@') {
            return Err(invalid("credentials are not supported"));
        }
        match host_port.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {}
            _ => return Err(invalid("a seed without host:port")),
        }
    }
    Ok(url)
}

/// `FLASHSALE_INSTANCE_ID` over `[engine] instance_id` (None: drawn at start).
fn instance_id(
    env: &Env,
    file: Option<String>,
) -> Result<Option<crate::logic::ids::InstanceId>, ConfigError> {
    let text = env.get("FLASHSALE_INSTANCE_ID").cloned().or(file);
    let text = text.filter(|t| !t.trim().is_empty());
    text.map(|t| crate::logic::ids::InstanceId::parse(t.trim()))
        .transpose()
        .map_err(|message| ConfigError::Invalid { name: "FLASHSALE_INSTANCE_ID", message })
}

/// `FLASHSALE_REDIS_MIN_REPLICA_ACKS` over `[redis] min_replica_acks` over `auto`.
fn min_replica_acks(
    env: &Env,
    file: Option<String>,
) -> Result<flashsale_io::redis::fence::MinReplicaAcks, ConfigError> {
    use flashsale_io::redis::fence::MinReplicaAcks;
    match env.get("FLASHSALE_REDIS_MIN_REPLICA_ACKS").cloned().or(file) {
        None => Ok(MinReplicaAcks::Auto),
        Some(text) => MinReplicaAcks::parse(&text).map_err(|message| ConfigError::Invalid {
            name: "FLASHSALE_REDIS_MIN_REPLICA_ACKS",
            message,
        }),
    }
}

/// A yes/no setting: `var` (`true`/`false`, `1`/`0`, `yes`/`no`) over the file's value over
/// false.
fn flag(env: &Env, var: &'static str, file: Option<bool>) -> Result<bool, ConfigError> {
    match env.get(var).map(|t| t.trim().to_ascii_lowercase()) {
        None => Ok(file.unwrap_or(false)),
        Some(text) => match text.as_str() {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" | "" => Ok(false),
            _ => Err(ConfigError::Invalid {
                name: var,
                message: format!("{text:?} is not true/false, 1/0 or yes/no"),
            }),
        },
    }
}

/// `--shards` over `FLASHSALE_SHARDS` over `[engine] shards` over the available cores, within
/// 1..=`SHARDS_MAX`.
fn shard_count(flag: Option<usize>, env: &Env, file: Option<usize>) -> Result<usize, ConfigError> {
    let invalid = |message: String| ConfigError::Invalid { name: "FLASHSALE_SHARDS", message };
    let shards = match flag {
        Some(n) => n,
        None => match env.get("FLASHSALE_SHARDS") {
            Some(text) => {
                text.trim().parse().map_err(|_| invalid(format!("{text:?} is not a number")))?
            }
            None => {
                file.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            }
        },
    };
    let max = crate::logic::placement::SHARDS_MAX;
    if shards == 0 || shards > max {
        return Err(invalid(format!("{shards} must be between 1 and {max}")));
    }
    Ok(shards)
}

/// The log config: `FLASHSALE_LOG_REPLICAS` over `[log] replicas` over 1, validated with the
/// rest of `LogConfig` (replicas within 1..=5).
fn log_config(env: &Env, section: LogSection, nats_url: &str) -> Result<LogConfig, ConfigError> {
    let invalid =
        |message: String| ConfigError::Invalid { name: "FLASHSALE_LOG_REPLICAS", message };
    let replicas = match env.get("FLASHSALE_LOG_REPLICAS") {
        Some(text) => {
            text.trim().parse().map_err(|_| invalid(format!("{text:?} is not a number")))?
        }
        None => section.replicas.unwrap_or(1),
    };
    let log = LogConfig { url: nats_url.to_owned(), replicas, ..LogConfig::default() };
    log.validate().map_err(|e| invalid(format!("[log] replicas = {replicas}: {e}")))?;
    Ok(log)
}

fn admission_budgets(
    section: AdmissionSection,
) -> Result<crate::logic::admission::Budgets, ConfigError> {
    let mut budgets = crate::logic::admission::Budgets::default();
    let fields = [
        (section.oldest_pending_age_max_ms, &mut budgets.oldest_pending_age_max_ms),
        (section.pending_count_max, &mut budgets.pending_count_max),
        (section.backlog_sample_age_max_ms, &mut budgets.backlog_sample_age_max_ms),
        (section.pg_outage_age_max_ms, &mut budgets.pg_outage_age_max_ms),
    ];
    for (value, field) in fields {
        if let Some(value) = value {
            *field = value;
        }
    }
    budgets.validate().map_err(|message| ConfigError::Invalid { name: "[admission]", message })?;
    Ok(budgets)
}

fn overload_settings(
    s: OverloadSection,
) -> Result<crate::logic::overload::OverloadConfig, ConfigError> {
    let d = crate::logic::overload::OverloadConfig::default();
    let mut c = crate::logic::overload::OverloadConfig {
        target_ms: s.target_ms.unwrap_or(d.target_ms),
        window_ms: s.window_ms.unwrap_or(d.window_ms),
        limit_min: s.limit_min.unwrap_or(d.limit_min),
        limit_max: s.limit_max.unwrap_or(d.limit_max),
        limit_initial: s.limit_initial.unwrap_or(d.limit_initial),
        backlog_age_soft_ms: s.backlog_age_soft_ms.unwrap_or(d.backlog_age_soft_ms),
        retry_ms: s.retry_ms.unwrap_or(d.retry_ms),
        unready_after_ms: s.unready_after_ms.unwrap_or(d.unready_after_ms),
        ready_after_ms: s.ready_after_ms.unwrap_or(d.ready_after_ms),
    };
    if s.enabled != Some(true) {
        c = c.pinned();
    }
    c.validate().map_err(|message| ConfigError::Invalid { name: "[overload]", message })?;
    Ok(c)
}

fn worker_settings(section: WorkerSection, env: &Env) -> Result<WorkerSettings, ConfigError> {
    let invalid = |name: &'static str, message: String| ConfigError::Invalid { name, message };
    let pg_cores = match env.get("FLASHSALE_PG_CORES") {
        Some(text) => text
            .trim()
            .parse()
            .map_err(|_| invalid("FLASHSALE_PG_CORES", format!("{text:?} is not a number")))?,
        None => section
            .pg_cores
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
    };
    if pg_cores == 0 {
        return Err(invalid("FLASHSALE_PG_CORES", "must be at least 1".into()));
    }
    let order_path = match section.order_path.as_deref() {
        None => None,
        Some("set") => Some(flashsale_pg_worker::OrderPath::SetBased),
        Some("per_message") => Some(flashsale_pg_worker::OrderPath::PerMessage),
        Some(other) => {
            return Err(invalid(
                "[worker] order_path",
                format!("{other:?} is not \"set\" or \"per_message\""),
            ))
        }
    };
    let settings = WorkerSettings {
        pg_cores,
        order_writers: section.order_writers,
        order_path,
        fetch_min: section.fetch_min,
        fetch_max: section.fetch_max,
        batch_max: section.batch_max,
        nice: section.nice,
    };
    // The worker's own validation names the knob that is out of bounds.
    let mut worker = flashsale_pg_worker::worker::WorkerConfig::default();
    settings.apply(&mut worker);
    worker.validate().map_err(|e| invalid("[worker]", e.to_string()))?;
    Ok(settings)
}

fn http_settings(
    section: HttpSection,
    proxy_from: Option<&str>,
) -> Result<HttpSettings, ConfigError> {
    let invalid = |name: &'static str, message: String| ConfigError::Invalid { name, message };
    let proxy_protocol_from = crate::http::proxy::TrustedSources::parse(proxy_from.unwrap_or(""))
        .map_err(|m| invalid("FLASHSALE_PROXY_PROTOCOL_FROM", m))?;
    if let Some(path) = &section.health_path {
        let well_formed = path.starts_with('/')
            && path.len() <= HEALTH_PATH_BYTES_MAX
            && path.bytes().all(|b| b.is_ascii_alphanumeric() || b"/-_.".contains(&b))
            && !path.starts_with("/v1/");
        if !well_formed {
            return Err(invalid(
                "[http] health_path",
                format!(
                    "{path:?} must start with /, use only [A-Za-z0-9/-_.], be at most \
                     {HEALTH_PATH_BYTES_MAX} bytes and stay out of /v1/"
                ),
            ));
        }
    }
    let times = [
        ("[http] header_read_timeout_ms", section.header_read_timeout_ms),
        ("[http] body_read_timeout_ms", section.body_read_timeout_ms),
        ("[http] write_timeout_ms", section.write_timeout_ms),
        ("[http] idle_timeout_ms", section.idle_timeout_ms),
    ];
    for (name, value) in times {
        if value.is_some_and(|ms| ms == 0 || ms > HTTP_TIMEOUT_MS_MAX) {
            return Err(invalid(name, format!("must be 1..={HTTP_TIMEOUT_MS_MAX}")));
        }
    }
    for (name, value) in [
        ("[http] connections_per_shard_max", section.connections_per_shard_max),
        ("[http] connections_per_address_max", section.connections_per_address_max),
    ] {
        if value == Some(0) {
            return Err(invalid(name, "must be at least 1".to_owned()));
        }
    }
    if let (Some(per_address), Some(per_shard)) =
        (section.connections_per_address_max, section.connections_per_shard_max)
    {
        if per_address > per_shard {
            return Err(invalid(
                "[http] connections_per_address_max",
                format!("{per_address} exceeds connections_per_shard_max {per_shard}"),
            ));
        }
    }
    Ok(HttpSettings {
        proxy_protocol_from,
        health_path: section.health_path,
        connections_per_shard_max: section.connections_per_shard_max,
        connections_per_address_max: section.connections_per_address_max,
        header_read_timeout_ms: section.header_read_timeout_ms,
        body_read_timeout_ms: section.body_read_timeout_ms,
        write_timeout_ms: section.write_timeout_ms,
        idle_timeout_ms: section.idle_timeout_ms,
    })
}

fn parse_pins(
    entries: &[String],
) -> Result<Vec<(crate::logic::placement::SkuKey, usize)>, ConfigError> {
    entries
        .iter()
        .map(|entry| {
            let parsed = entry.split_once('=').and_then(|(sku, shard)| {
                let (a, s) = sku.split_once(':')?;
                Some((
                    crate::logic::placement::SkuKey::new(
                        a.trim().parse().ok()?,
                        s.trim().parse().ok()?,
                    ),
                    shard.trim().parse().ok()?,
                ))
            });
            parsed.ok_or_else(|| ConfigError::Invalid {
                name: "[engine] pins",
                message: format!("{entry:?} is not \"activity:sku=shard\""),
            })
        })
        .collect()
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
    toml::from_str(&text)
        .map_err(|e| ConfigError::Parse { path: path.to_path_buf(), message: e.to_string() })
}

fn check_scheme(
    name: &'static str,
    value: String,
    schemes: &[&str],
) -> Result<String, ConfigError> {
    // Comma-separated seeds (cluster) are allowed; each must carry the scheme.
    let ok = value.split(',').all(|part| schemes.iter().any(|s| part.trim().starts_with(s)));
    if ok && !value.trim().is_empty() {
        Ok(value)
    } else {
        Err(ConfigError::Invalid {
            name,
            message: format!("{value:?} must start with {}", schemes.join(" or ")),
        })
    }
}

/// `FLASHSALE_PG_URL`: a libpq-style connection string in either form tokio-postgres (and
/// libpq) read: the URL (`postgres://u@h1:5432,h2:5433/db?target_session_attrs=read-write`,
/// several hosts separated by commas INSIDE one URL, so the value must not be split on
/// commas) or `key=value` pairs (`host=h1,h2 port=5432,5433 user=u dbname=db`). Several hosts
/// require `target_session_attrs=read-write`: otherwise a standby listed first would be handed
/// the writes.
fn check_pg_url(value: String) -> Result<String, ConfigError> {
    let invalid = |message: String| ConfigError::Invalid { name: "FLASHSALE_PG_URL", message };
    let parsed: tokio_postgres::Config = value.parse().map_err(|e| {
        invalid(format!(
            "{value:?} is neither a postgres:// URL nor a key=value connection string ({e})"
        ))
    })?;
    let hosts = parsed.get_hosts().len().max(parsed.get_hostaddrs().len());
    if hosts == 0 {
        return Err(invalid(format!("{value:?} names no host")));
    }
    if hosts > 1
        && parsed.get_target_session_attrs()
            != tokio_postgres::config::TargetSessionAttrs::ReadWrite
    {
        return Err(invalid(format!(
            "{value:?} lists {hosts} hosts without target_session_attrs=read-write (a standby \
             listed first would be handed the writes)"
        )));
    }
    Ok(value)
}

fn parse_addr(name: &'static str, value: &str) -> Result<SocketAddr, ConfigError> {
    value.parse().map_err(|e| ConfigError::Invalid {
        name,
        message: format!("{value:?} is not host:port ({e})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Env {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn precedence_is_file_then_env_then_flags() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.toml");
        std::fs::write(
            &path,
            "[redis]\nurl = \"redis://file:1\"\n[pg]\nurl = \"postgres://file/db\"\n",
        )
        .expect("write");
        let e = env(&[("FLASHSALE_PG_URL", "postgres://env/db")]);
        let flags = Overrides { redis_url: Some("redis://flag:3".into()), ..Default::default() };
        let c = Config::load(Some(&path), &e, &flags, dir.path()).expect("config");
        assert_eq!(c.redis_url, "redis://flag:3");
        assert_eq!(c.pg_url, "postgres://env/db");
        assert_eq!(c.nats_url, "nats://127.0.0.1:4222");
    }

    #[test]
    fn redis_seeds_and_replica_acks() {
        use flashsale_io::redis::fence::MinReplicaAcks;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.toml");
        let toml = "[redis]\nurl = \"redis://a:1,b:2\"\nmin_replica_acks = \"2\"\n";
        std::fs::write(&path, toml).expect("write");
        let none = Overrides::default();
        let c = Config::load(Some(&path), &Env::new(), &none, dir.path()).expect("config");
        assert_eq!(
            (c.redis_url.as_str(), c.redis_min_replica_acks),
            ("redis://a:1,b:2", MinReplicaAcks::Exactly(2))
        );
        let e = env(&[("FLASHSALE_REDIS_MIN_REPLICA_ACKS", "auto")]);
        let c = Config::load(Some(&path), &e, &none, dir.path()).expect("config");
        assert_eq!(c.redis_min_replica_acks, MinReplicaAcks::Auto);
        for bad in ["x", "17", "-1"] {
            let e = env(&[("FLASHSALE_REDIS_MIN_REPLICA_ACKS", bad)]);
            let err = Config::load(Some(&path), &e, &none, dir.path()).unwrap_err();
            assert!(err.to_string().contains("FLASHSALE_REDIS_MIN_REPLICA_ACKS"), "{err}");
        }
        for bad in ["http://a:1", "redis://a", "redis://u:p@a:1", "redis://a:1,"] {
            let e = env(&[("FLASHSALE_REDIS_URL", bad)]);
            assert!(Config::load(None, &e, &none, dir.path()).is_err(), "{bad}");
        }
    }

    #[test]
    fn stack_env_file_supplies_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let stack = StackEnv {
            redis_url: "redis://127.0.0.1:1111".into(),
            pg_url: "postgres://postgres@127.0.0.1:2222/postgres".into(),
            nats_url: "nats://127.0.0.1:3333".into(),
        };
        std::fs::write(dir.path().join("env"), stack.render()).expect("write");
        let c = Config::load(None, &Env::new(), &Overrides::default(), dir.path()).expect("config");
        assert_eq!(c.redis_url, stack.redis_url);
        assert_eq!(c.pg_url, stack.pg_url);
        assert_eq!(c.nats_url, stack.nats_url);
    }

    #[test]
    fn pins_parse_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.toml");
        std::fs::write(&path, "[engine]\nshards = 2\npins = [\"10001:20001=1\"]\n").expect("w");
        let c =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).expect("c");
        assert_eq!(c.shards, 2);
        assert_eq!(c.pins, vec![(crate::logic::placement::SkuKey::new(10001, 20001), 1)]);
        std::fs::write(&path, "[engine]\npins = [\"10001-20001\"]\n").expect("w");
        let err =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("pins"), "{err}");
        let e = env(&[("FLASHSALE_SHARDS", "0")]);
        let err = Config::load(None, &e, &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_SHARDS"), "{err}");
    }

    #[test]
    fn instance_id_comes_from_env_over_file_and_is_validated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let none = Overrides::default();
        let c = Config::load(None, &Env::new(), &none, dir.path()).expect("c");
        assert_eq!(c.instance_id, None, "drawn at start when unset");
        let path = dir.path().join("i.toml");
        std::fs::write(&path, "[engine]\ninstance_id = \"edge-a\"\n").expect("w");
        let c = Config::load(Some(&path), &Env::new(), &none, dir.path()).expect("c");
        assert_eq!(c.instance_id.map(|i| i.to_string()).as_deref(), Some("edge-a"));
        let e = env(&[("FLASHSALE_INSTANCE_ID", "edge-b")]);
        let c = Config::load(Some(&path), &e, &none, dir.path()).expect("c");
        assert_eq!(c.instance_id.map(|i| i.to_string()).as_deref(), Some("edge-b"));
        let e = env(&[("FLASHSALE_INSTANCE_ID", "edge b")]);
        let err = Config::load(None, &e, &none, dir.path()).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_INSTANCE_ID"), "{err}");
    }

    #[test]
    fn admission_budgets_come_from_the_file_and_are_validated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.toml");
        std::fs::write(&path, "[admission]\npending_count_max = 20000\n").expect("w");
        let c =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).expect("c");
        assert_eq!(c.admission.pending_count_max, 20_000);
        assert_eq!(
            c.admission.oldest_pending_age_max_ms,
            crate::logic::admission::Budgets::default().oldest_pending_age_max_ms
        );
        std::fs::write(&path, "[admission]\npg_outage_age_max_ms = 0\n").expect("w");
        let err =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("[admission]"), "{err}");
    }

    #[test]
    fn the_adaptive_limit_is_off_unless_enabled_and_its_bounds_are_validated() {
        use crate::logic::overload::OverloadConfig;
        let dir = tempfile::tempdir().expect("tempdir");
        let load = |text: &str| {
            let path = dir.path().join("o.toml");
            std::fs::write(&path, text).expect("w");
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path())
        };
        let off = load("[overload]\ntarget_ms = 10\n").expect("c").overload;
        assert_eq!((off.limit_min, off.limit_max), (off.limit_max, 4_096), "pinned");
        let on = load("[overload]\nenabled = true\ntarget_ms = 10\n").expect("c").overload;
        assert_eq!(on, OverloadConfig { target_ms: 10, ..OverloadConfig::default() });
        let err = load("[overload]\nenabled = true\nlimit_min = 0\n").unwrap_err();
        assert!(err.to_string().contains("[overload]"), "{err}");
        let err = load("[worker]\nnice = 20\n").unwrap_err();
        assert!(err.to_string().contains("nice"), "{err}");
    }

    #[test]
    fn log_replicas_come_from_env_over_file_and_are_validated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = Config::load(None, &Env::new(), &Overrides::default(), dir.path()).expect("c");
        assert_eq!(c.log.replicas, 1, "default");
        assert_eq!(c.log.url, c.nats_url);
        let path = dir.path().join("l.toml");
        std::fs::write(&path, "[nats]\nurl = \"nats://a:1,nats://b:2\"\n[log]\nreplicas = 3\n")
            .expect("w");
        let c =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).expect("c");
        assert_eq!((c.log.replicas, c.log.url.as_str()), (3, "nats://a:1,nats://b:2"));
        let e = env(&[("FLASHSALE_LOG_REPLICAS", "5")]);
        let c = Config::load(Some(&path), &e, &Overrides::default(), dir.path()).expect("c");
        assert_eq!(c.log.replicas, 5, "env over file");
        for bad in ["0", "7", "three"] {
            let e = env(&[("FLASHSALE_LOG_REPLICAS", bad)]);
            let err = Config::load(None, &e, &Overrides::default(), dir.path()).unwrap_err();
            assert!(err.to_string().contains("FLASHSALE_LOG_REPLICAS"), "{bad}: {err}");
        }
    }

    #[test]
    fn multi_host_and_key_value_pg_urls_are_accepted() {
        let dir = tempfile::tempdir().expect("tempdir");
        for url in [
            "postgres://postgres@127.0.0.1:5432,127.0.0.1:5433/postgres?target_session_attrs=read-write",
            "postgresql://u@h1,h2,h3/db?target_session_attrs=read-write&connect_timeout=2",
            "host=127.0.0.1,127.0.0.1 port=5432,5433 user=postgres dbname=postgres target_session_attrs=read-write",
            "host=127.0.0.1 port=5432 user=postgres",
            "postgres://postgres@127.0.0.1:5432/postgres",
        ] {
            let e = env(&[("FLASHSALE_PG_URL", url)]);
            let c = Config::load(None, &e, &Overrides::default(), dir.path())
                .unwrap_or_else(|err| panic!("{url}: {err}"));
            assert_eq!(c.pg_url, url);
        }
        for url in [
            "http://x",
            "mysql://u@h/db",
            "postgres://u@h1:1,h2:2/db",
            "host=a,b user=u",
            "dbname=x",
        ] {
            let e = env(&[("FLASHSALE_PG_URL", url)]);
            let err = Config::load(None, &e, &Overrides::default(), dir.path()).unwrap_err();
            assert!(err.to_string().contains("FLASHSALE_PG_URL"), "{url}: {err}");
        }
    }

    #[test]
    fn tracing_is_off_without_an_endpoint_and_the_environment_wins_over_the_file() {
        use flashsale_io::trace::SampleRatio;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.toml");
        let load = |e: &Env| Config::load(Some(&path), e, &Overrides::default(), dir.path());
        std::fs::write(&path, "").expect("w");
        let c = load(&Env::new()).expect("config");
        assert_eq!(c.tracing.endpoint, None);
        assert_eq!(c.tracing.sample_ratio, SampleRatio::ALL);
        std::fs::write(
            &path,
            "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\nsample_ratio = 0.5\n\
             queue_spans_max = 100\nexport_batch_max = 10\nexport_timeout_ms = 500\n",
        )
        .expect("w");
        let c = load(&Env::new()).expect("config");
        let endpoint = c.tracing.endpoint.as_ref().map(ToString::to_string);
        assert_eq!(endpoint.as_deref(), Some("http://127.0.0.1:4318/v1/traces"));
        assert_eq!(c.tracing.sample_ratio.ppm(), 500_000);
        assert_eq!((c.tracing.queue_spans_max, c.tracing.export_batch_max), (100, 10));
        assert_eq!(c.tracing.export_timeout_ms, 500);
        let e = env(&[
            ("FLASHSALE_OTLP_ENDPOINT", "http://collector:4318/otlp"),
            ("FLASHSALE_TRACE_SAMPLE_RATIO", "0"),
        ]);
        let c = load(&e).expect("config");
        let endpoint = c.tracing.endpoint.as_ref().map(ToString::to_string);
        assert_eq!(endpoint.as_deref(), Some("http://collector:4318/otlp"));
        assert_eq!(c.tracing.sample_ratio, SampleRatio::NONE);
        for (var, value) in [
            ("FLASHSALE_OTLP_ENDPOINT", "https://collector:4318"),
            ("FLASHSALE_TRACE_SAMPLE_RATIO", "2"),
        ] {
            let err = load(&env(&[(var, value)])).unwrap_err();
            assert!(err.to_string().contains(var), "{var}={value}: {err}");
        }
        std::fs::write(&path, "[tracing]\nqueue_spans_max = 0\n").expect("w");
        assert!(load(&Env::new()).unwrap_err().to_string().contains("queue_spans_max"));
    }

    #[test]
    fn worker_settings_size_the_writers_and_are_validated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w.toml");
        let load = |e: &Env| Config::load(Some(&path), e, &Overrides::default(), dir.path());
        std::fs::write(&path, "[worker]\npg_cores = 4\nfetch_max = 256\n").expect("w");
        let c = load(&Env::new()).expect("config");
        let mut worker = flashsale_pg_worker::worker::WorkerConfig::default();
        c.worker.apply(&mut worker);
        let writers = flashsale_pg_worker::worker::order_writers_for_pg_cores(4);
        assert_eq!((worker.order_writers, worker.fetch_max), (writers, 256));
        assert!(worker.pg.pool_size > writers + worker.outbox_publishers, "writers + outbox + lag");
        worker.validate().expect("applied settings are valid");
        // The environment wins over the file; an explicit writer count over both.
        let c = load(&env(&[("FLASHSALE_PG_CORES", "3")])).expect("config");
        assert_eq!(c.worker.pg_cores, 3);
        std::fs::write(&path, "[worker]\norder_writers = 1\norder_path = \"per_message\"\n")
            .expect("w");
        let c = load(&env(&[("FLASHSALE_PG_CORES", "3")])).expect("config");
        let mut worker = flashsale_pg_worker::worker::WorkerConfig::default();
        c.worker.apply(&mut worker);
        assert_eq!(worker.order_writers, 1);
        assert_eq!(worker.order_path, flashsale_pg_worker::OrderPath::PerMessage);
        for (toml, needle) in [
            ("[worker]\nfetch_max = 5000\n", "fetch_max"),
            ("[worker]\nfetch_min = 0\n", "fetch_min"),
            ("[worker]\nbatch_max = 65\n", "batch_max"),
            ("[worker]\norder_path = \"rows\"\n", "order_path"),
        ] {
            std::fs::write(&path, toml).expect("w");
            let err = load(&Env::new()).unwrap_err();
            assert!(err.to_string().contains(needle), "{toml}: {err}");
        }
        let err = load(&env(&[("FLASHSALE_PG_CORES", "0")])).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_PG_CORES"), "{err}");
    }

    #[test]
    fn payments_status_url_needs_the_key_and_is_validated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let load = |e: &Env| Config::load(None, e, &Overrides::default(), dir.path());
        let key = ("FLASHSALE_PAYMENT_KEY", "00112233445566778899aabbccddeeff");
        let url = ("FLASHSALE_PAYMENT_STATUS_URL", "http://127.0.0.1:8099/status");
        assert_eq!(load(&Env::new()).expect("config").payments.status_url, None);
        let c = load(&env(&[key, url])).expect("config");
        assert_eq!(c.payments.status_url.as_deref(), Some("http://127.0.0.1:8099/status"));
        let worker = crate::app::serve::worker_config(&c);
        let provider = worker.closer.provider.expect("provider configured");
        assert_eq!(provider.status_url, "http://127.0.0.1:8099/status");
        assert_eq!(
            crate::app::serve::worker_config(&load(&env(&[key])).expect("c")).closer.provider,
            None
        );
        let err = load(&env(&[url])).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_PAYMENT_KEY"), "{err}");
        let err = load(&env(&[key, ("FLASHSALE_PAYMENT_STATUS_URL", "https://p/")])).unwrap_err();
        assert!(err.to_string().contains("https"), "{err}");
    }

    #[test]
    fn payments_hold_by_default_and_redis_eviction_is_enforced_unless_overridden() {
        use crate::logic::redis_settings::EvictionCheck;
        use flashsale_pg_worker::payments::WithoutProvider;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.toml");
        let load = |e: &Env| Config::load(Some(&path), e, &Overrides::default(), dir.path());
        std::fs::write(&path, "").expect("w");
        let c = load(&Env::new()).expect("config");
        assert_eq!(c.payments.without_provider, WithoutProvider::HoldUnknown);
        assert_eq!(c.redis_eviction, EvictionCheck::Enforce);
        let worker = crate::app::serve::worker_config(&c);
        assert_eq!(worker.closer.without_provider, WithoutProvider::HoldUnknown);
        std::fs::write(
            &path,
            "[payments]\nclose_unpaid_without_provider = true\n[redis]\nallow_eviction = true\n",
        )
        .expect("w");
        let c = load(&Env::new()).expect("config");
        assert_eq!(c.payments.without_provider, WithoutProvider::CloseUnverified);
        assert_eq!(c.redis_eviction, EvictionCheck::Overridden);
        assert_eq!(edge_of(&c).redis_eviction, EvictionCheck::Overridden);
        let off = env(&[
            ("FLASHSALE_PAYMENT_CLOSE_UNPAID_WITHOUT_PROVIDER", "0"),
            ("FLASHSALE_REDIS_ALLOW_EVICTION", "no"),
        ]);
        let c = load(&off).expect("the environment wins");
        assert_eq!(c.payments.without_provider, WithoutProvider::HoldUnknown);
        assert_eq!(c.redis_eviction, EvictionCheck::Enforce);
        let err = load(&env(&[("FLASHSALE_REDIS_ALLOW_EVICTION", "maybe")])).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_REDIS_ALLOW_EVICTION"), "{err}");
    }

    fn edge_of(c: &Config) -> crate::shard::EdgeConfig {
        crate::app::serve::edge_config(c).expect("edge config")
    }

    #[test]
    fn bad_values_are_clear_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = env(&[("FLASHSALE_REDIS_URL", "http://x")]);
        let err = Config::load(None, &e, &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_REDIS_URL"), "{err}");
        let e = env(&[("FLASHSALE_HTTP_ADDR", "nonsense")]);
        let err = Config::load(None, &e, &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_HTTP_ADDR"), "{err}");
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "[redis]\nurll = \"x\"\n").expect("write");
        let err =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }

    #[test]
    fn http_section_and_proxy_protocol_sources() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("h.toml");
        std::fs::write(
            &path,
            "[http]\naddr = \"127.0.0.1:8081\"\nhealth_path = \"/healthz\"\n\
             proxy_protocol_from = \"10.0.0.0/8\"\nconnections_per_address_max = 8\n\
             header_read_timeout_ms = 2000\nwrite_timeout_ms = 3000\n",
        )
        .expect("w");
        let c =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).expect("c");
        assert_eq!(c.http_addr, "127.0.0.1:8081".parse().expect("addr"));
        assert_eq!(c.http.health_path.as_deref(), Some("/healthz"));
        assert!(c.http.proxy_protocol_from.contains("10.1.2.3".parse().expect("ip")));
        let mut edge = crate::app::serve::default_edge_config("127.0.0.1:1".parse().expect("a"));
        c.http.apply(&mut edge);
        assert_eq!(edge.connections_per_address_max, 8);
        assert_eq!(edge.header_read_timeout_ms, 2_000);
        assert_eq!(edge.write_timeout_ms, 3_000);
        assert_eq!(edge.body_read_timeout_ms, 5_000, "unset keeps the default");
        assert_eq!(edge.health_path.as_deref(), Some("/healthz"));
        // The environment variable overrides the file.
        let e = env(&[("FLASHSALE_PROXY_PROTOCOL_FROM", "192.168.0.0/16, ::1")]);
        let c = Config::load(Some(&path), &e, &Overrides::default(), dir.path()).expect("c");
        assert!(!c.http.proxy_protocol_from.contains("10.1.2.3".parse().expect("ip")));
        assert!(c.http.proxy_protocol_from.contains("::1".parse().expect("ip")));
        // Bad values are named.
        let e = env(&[("FLASHSALE_PROXY_PROTOCOL_FROM", "10.0.0.1/8")]);
        let err = Config::load(None, &e, &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_PROXY_PROTOCOL_FROM"), "{err}");
        for (body, name) in [
            ("health_path = \"healthz\"", "health_path"),
            ("health_path = \"/v1/reservations\"", "health_path"),
            ("write_timeout_ms = 0", "write_timeout_ms"),
            ("connections_per_address_max = 0", "connections_per_address_max"),
            (
                "connections_per_shard_max = 4\nconnections_per_address_max = 5",
                "connections_per_address_max",
            ),
        ] {
            std::fs::write(&path, format!("[http]\n{body}\n")).expect("w");
            let err = Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path())
                .unwrap_err();
            assert!(err.to_string().contains(name), "{body}: {err}");
        }
    }

    #[test]
    fn metrics_section_marks_hot_skus_after_the_pinned_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.toml");
        std::fs::write(
            &path,
            "[engine]\npins = [\"1:2=1\"]\n[metrics]\nhot_skus = [\"3:4\", \"1:2\"]\n\
             sku_series_max = 8\nsku_promote_min_events = 5\n",
        )
        .expect("w");
        let c =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).expect("c");
        let key = crate::logic::placement::SkuKey::new;
        assert_eq!(c.sku_funnel.hot, vec![key(1, 2), key(3, 4)]);
        assert_eq!((c.sku_funnel.series_max, c.sku_funnel.promote_min_events), (8, 5));
        for body in ["hot_skus = [\"3-4\"]", "sku_series_max = 33", "sku_promote_min_events = 0"] {
            std::fs::write(&path, format!("[metrics]\n{body}\n")).expect("w");
            let err = Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path())
                .unwrap_err();
            assert!(err.to_string().contains("[metrics]"), "{body}: {err}");
        }
    }
}
