//! The dependencies' own health beside the engine's series (seed ch9 §12.3–12.5; issue 28 item
//! 2): Redis memory, evictions, replicas and their offset lag (sampled by shard 0 over its own
//! Redis connections, `shard/dependency_poll.rs`), PostgreSQL replication lag, synchronous
//! standbys, lock waits and connections (a connection of its own, `pg_stats`), JetStream
//! streams' messages, bytes, limits, leaders and consumers' pending counts.
//!
//! Sampled every [`DEPENDENCY_POLL_MS`], off every request's path: the samplers write the last
//! answer here (a lock taken once per sample and once per scrape, never per request) and
//! `/metrics` renders it. A sampler whose dependency did not answer keeps no stale figures:
//! its `flashsale_dependency_up{dependency}` is 0 and its figures are absent, so no alert
//! reads an old value as current.
//!
//! Bounds on the labels: Redis masters (at most 64, one circuit each) with at most 8 replicas
//! each (`io::redis::info`), PostgreSQL standbys (at most 16, `pg_stats`), the three streams
//! of the log and their two consumers.
//!
//! What it is not: admission (which reads `health.rs`'s backlog and PostgreSQL contact).

use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use flashsale_io::jetstream::{Log, StreamStats};
use flashsale_io::redis::info::NodeInfo;
use flashsale_pg_worker::pg_stats::PgStats;
use flashsale_pg_worker::pool::{Connector, PgPoolConfig};

use super::wait::pause;

/// How often each dependency is sampled: figures an operator reads at a 15 s scrape, from
/// servers that are themselves busy in a sale.
pub const DEPENDENCY_POLL_MS: u64 = 5_000;

/// The last answer of each sampler (`None`: never answered, or the last try failed).
#[derive(Debug, Default)]
pub struct Dependencies {
    redis: Mutex<Option<Vec<NodeInfo>>>,
    pg: Mutex<Option<PgStats>>,
    log: Mutex<Option<Vec<StreamStats>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Dependencies {
    pub fn set_redis(&self, nodes: Vec<NodeInfo>) {
        *lock(&self.redis) = Some(nodes);
    }

    fn set_pg(&self, stats: Option<PgStats>) {
        *lock(&self.pg) = stats;
    }

    fn set_log(&self, streams: Vec<StreamStats>) {
        let answered = streams.iter().any(|s| s.error.is_none());
        *lock(&self.log) = answered.then_some(streams);
    }

    /// Prometheus text of every sampler's last answer.
    pub fn render(&self, out: &mut String) {
        let redis = lock(&self.redis).clone();
        let pg = lock(&self.pg).clone();
        let log = lock(&self.log).clone();
        let _ = writeln!(out, "# TYPE flashsale_dependency_up gauge");
        let redis_up = redis.as_ref().is_some_and(|n| n.iter().any(|n| n.error.is_none()));
        for (dependency, up) in
            [("redis", redis_up), ("postgres", pg.is_some()), ("log", log.is_some())]
        {
            let _ = writeln!(
                out,
                "flashsale_dependency_up{{dependency=\"{dependency}\"}} {}",
                u8::from(up)
            );
        }
        render_redis(redis.as_deref().unwrap_or(&[]), out);
        if let Some(pg) = &pg {
            render_pg(pg, out);
        }
        render_log(log.as_deref().unwrap_or(&[]), out);
    }
}

/// One gauge family: its TYPE line, then a line per (labels, value).
fn family(out: &mut String, name: &str, kind: &str, lines: &[(String, f64)]) {
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in lines {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

fn render_redis(nodes: &[NodeInfo], out: &mut String) {
    let ok: Vec<&NodeInfo> = nodes.iter().filter(|n| n.error.is_none()).collect();
    let node =
        |n: &NodeInfo| format!("node=\"{}\"", n.node.map(|a| a.to_string()).unwrap_or_default());
    let per_node = |f: fn(&NodeInfo) -> Option<u64>| -> Vec<(String, f64)> {
        ok.iter().filter_map(|n| Some((node(n), f(n)? as f64))).collect()
    };
    family(out, "flashsale_redis_used_memory_bytes", "gauge", &per_node(|n| n.used_memory_bytes));
    family(out, "flashsale_redis_maxmemory_bytes", "gauge", &per_node(|n| n.maxmemory_bytes));
    family(
        out,
        "flashsale_redis_evicted_keys_total",
        "counter",
        &per_node(|n| n.evicted_keys_total),
    );
    family(out, "flashsale_redis_connected_replicas", "gauge", &per_node(|n| n.connected_replicas));
    let lags: Vec<(String, f64)> = ok
        .iter()
        .flat_map(|n| {
            n.replicas.iter().map(move |r| {
                let labels = format!("{},replica=\"{}\",state=\"{}\"", node(n), r.addr, r.state);
                (labels, r.offset_lag_bytes as f64)
            })
        })
        .collect();
    family(out, "flashsale_redis_replica_offset_lag_bytes", "gauge", &lags);
}

fn render_pg(pg: &PgStats, out: &mut String) {
    let one = |v: f64| vec![(String::new(), v)];
    family(out, "flashsale_pg_sync_standbys", "gauge", &one(pg.sync_standbys as f64));
    let required = pg.sync_standbys_required as f64;
    family(out, "flashsale_pg_sync_standbys_required", "gauge", &one(required));
    family(out, "flashsale_pg_locks_waiting", "gauge", &one(pg.locks_waiting as f64));
    family(out, "flashsale_pg_connections", "gauge", &one(pg.connections as f64));
    family(out, "flashsale_pg_max_connections", "gauge", &one(pg.max_connections as f64));
    let standby = |s: &flashsale_pg_worker::pg_stats::StandbyStats| {
        format!("standby=\"{}\",sync_state=\"{}\"", s.name, s.sync_state)
    };
    let bytes: Vec<(String, f64)> =
        pg.standbys.iter().filter_map(|s| Some((standby(s), s.lag_bytes? as f64))).collect();
    family(out, "flashsale_pg_replication_lag_bytes", "gauge", &bytes);
    // PostgreSQL reports no replay lag while nothing is being written: an idle, caught-up
    // standby reads 0, not absent, when its byte lag is 0.
    let seconds: Vec<(String, f64)> = pg
        .standbys
        .iter()
        .filter_map(|s| {
            let lag_s = s.lag_s.or_else(|| (s.lag_bytes? == 0).then_some(0.0))?;
            Some((standby(s), lag_s))
        })
        .collect();
    family(out, "flashsale_pg_replication_lag_seconds", "gauge", &seconds);
}

fn render_log(streams: &[StreamStats], out: &mut String) {
    let ok: Vec<&StreamStats> = streams.iter().filter(|s| s.error.is_none()).collect();
    let label = |s: &StreamStats| format!("stream=\"{}\"", s.stream);
    let per_stream = |f: fn(&StreamStats) -> Option<u64>| -> Vec<(String, f64)> {
        ok.iter().filter_map(|s| Some((label(s), f(s)? as f64))).collect()
    };
    family(out, "flashsale_log_stream_messages", "gauge", &per_stream(|s| Some(s.messages)));
    family(out, "flashsale_log_stream_bytes", "gauge", &per_stream(|s| Some(s.bytes)));
    family(out, "flashsale_log_stream_max_bytes", "gauge", &per_stream(|s| s.max_bytes));
    let leaders: Vec<(String, f64)> = ok
        .iter()
        .map(|s| {
            let leader = s.leader.as_deref().unwrap_or("standalone");
            (format!("{},leader=\"{leader}\"", label(s)), 1.0)
        })
        .collect();
    family(out, "flashsale_log_stream_leader", "gauge", &leaders);
    let consumers = |f: fn(&flashsale_io::jetstream::ConsumerStats) -> u64| -> Vec<(String, f64)> {
        ok.iter()
            .flat_map(|s| {
                s.consumers.iter().map(move |c| {
                    (format!("{},consumer=\"{}\"", label(s), c.consumer), f(c) as f64)
                })
            })
            .collect()
    };
    family(out, "flashsale_log_consumer_pending", "gauge", &consumers(|c| c.pending));
    family(out, "flashsale_log_consumer_ack_pending", "gauge", &consumers(|c| c.ack_pending));
}

/// Samples PostgreSQL (a connection of its own, through the pool's connector: failover and
/// fencing as everywhere) and the log every `every`, each sample bounded by `every`, until
/// `stop`.
pub async fn poll(
    log: Log,
    pg_url: String,
    deps: std::sync::Arc<Dependencies>,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let settings = PgPoolConfig::probe(pg_url, every, "flashsale-dependency-stats");
    let connector = Connector::new(&settings).ok();
    let mut pg: Option<(tokio_postgres::Client, tokio::task::JoinHandle<()>)> = None;
    loop {
        match tokio::time::timeout(every, log.poll_stats()).await {
            Ok(streams) => deps.set_log(streams),
            Err(_) => deps.set_log(Vec::new()),
        }
        if pg.as_ref().is_none_or(|(client, _)| client.is_closed()) {
            if let Some((_, task)) = pg.take() {
                task.abort();
            }
            if let Some(connector) = &connector {
                pg = tokio::time::timeout(every, connector.connect())
                    .await
                    .ok()
                    .and_then(Result::ok);
            }
        }
        let stats = match &pg {
            Some((client, _)) => {
                tokio::time::timeout(every, flashsale_pg_worker::pg_stats::sample(client)).await
            }
            None => Ok(Err(flashsale_pg_worker::error::PgError::Pool("not connected".into()))),
        };
        match stats {
            Ok(Ok(stats)) => deps.set_pg(Some(stats)),
            other => {
                tracing::debug!(?other, "postgres dependency sample failed");
                deps.set_pg(None);
                if let Some((_, task)) = pg.take() {
                    task.abort();
                }
            }
        }
        if pause(every, &mut stop).await {
            if let Some((_, task)) = pg.take() {
                task.abort();
            }
            return;
        }
    }
}
