//! What admission reads about the dependencies behind the log (DESIGN.md section 7): the
//! `order-writer` backlog and the last PostgreSQL contact, polled on the durable side
//! ([`poll_health`]) every `health_poll_ms` and read by admission per request. Both are this
//! instance's own observations, independent of whether an order worker runs in the process
//! (`--no-worker` included).
//!
//! Not here: what admission decides from them (`logic::admission`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flashsale_io::jetstream::LogLag;
use flashsale_pg_worker::pool::{Connector, PgPoolConfig};

use super::wait::pause;
use crate::logic::admission::Backlog;
use crate::logic::drain::{DrainRates, DrainSample, DrainWindow};

/// What admission reads about the dependencies behind the log, written by [`poll_health`].
#[derive(Debug, Default)]
pub struct Health {
    pub lag: LogLag,
    /// When this instance last completed a PostgreSQL round trip (ms since the epoch).
    pub pg_ok_at_ms: AtomicU64,
    /// The backlog samples of the last 10 s, for the drain-time estimate (written by the
    /// poller every poll, read by `/metrics`, `/readyz` and the mode answer: never per request).
    drain: Mutex<DrainWindow>,
    /// The dependencies' own health, sampled every few seconds (`dependencies.rs`).
    pub deps: Arc<super::dependencies::Dependencies>,
}

impl Health {
    pub fn backlog(&self) -> Backlog {
        Backlog {
            oldest_pending_age_ms: self.lag.oldest_pending_age_ms(),
            pending_count: self.lag.pending(),
            polled_at_ms: self.lag.polled_at_ms(),
        }
    }

    /// The consume and produce rates of `order-writer` and the drain-time estimate
    /// (`logic::drain`; seed ch9 §7.8).
    pub fn drain_rates(&self) -> DrainRates {
        self.drain.lock().unwrap_or_else(|e| e.into_inner()).rates()
    }

    fn record_drain(&self, sample: DrainSample) {
        self.drain.lock().unwrap_or_else(|e| e.into_inner()).push(sample);
    }

    /// `flashsale_backlog_drain_seconds` (0 empty, +Inf not draining, NaN unknown) and the two
    /// rates behind it.
    pub fn render_drain(&self, out: &mut String) {
        let rates = self.drain_rates();
        for (name, value) in [
            ("flashsale_backlog_drain_seconds", rates.estimate.gauge()),
            ("flashsale_order_writer_consume_per_second", rates.consume_per_s),
            ("flashsale_order_writer_produce_per_second", rates.produce_per_s),
        ] {
            let _ = writeln!(out, "# TYPE {name} gauge\n{name} {}", prometheus_float(value));
        }
    }

    /// The backlog and its drain estimate as `/readyz` and the mode answer show them.
    pub fn drain_detail(&self) -> serde_json::Value {
        let rates = self.drain_rates();
        let finite = |v: f64| v.is_finite().then_some(v);
        serde_json::json!({
            "pending": self.lag.pending(),
            "oldest_pending_age_ms": self.lag.oldest_pending_age_ms(),
            "drain": rates.estimate.name(),
            "drain_seconds": finite(rates.estimate.gauge()),
            "consume_per_s": finite(rates.consume_per_s),
            "produce_per_s": finite(rates.produce_per_s),
        })
    }

    /// Milliseconds since the last PostgreSQL contact.
    pub fn pg_outage_age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.pg_ok_at_ms.load(Ordering::Relaxed))
    }
}

/// Polls the `order-writer` backlog and pings PostgreSQL (on a connection of its own, so a
/// busy pool never reads as an outage) every `every`, each call bounded. The two run side by
/// side: a hung PostgreSQL connect must not age the backlog sample into BACKLOG_UNKNOWN, nor
/// a slow JetStream answer PostgreSQL's contact into PG_OUTAGE.
///
/// After each backlog sample the replicated streams' placement is sampled too and exported
/// (`flashsale_log_stream_replicas{stream}` / `..._current{stream}`), bounded by `every`.
///
/// The ping connects through the worker pool's [`Connector`] (failover over a multi-host URL,
/// the fencing rule, keepalives), each host's whole connect bounded by `every`: a hung first
/// host costs one poll interval, then the next host is tried in the same round, and the
/// connector tries the host that answered first next time. The ping itself is bounded by
/// `every`; a connection that missed it is dropped.
pub async fn poll_health(
    log: flashsale_io::jetstream::Log,
    pg_url: String,
    health: Arc<Health>,
    every: Duration,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let backlog = {
        let (health, mut stop) = (Arc::clone(&health), stop.clone());
        async move {
            loop {
                let now = crate::logic::clock::now_ms();
                match tokio::time::timeout(every, log.poll_order_writer_lag(now)).await {
                    Ok(Ok(sample)) => {
                        let at_ms = crate::logic::clock::now_ms();
                        health.lag.store(sample, at_ms);
                        let (backlog, produced_total) = (sample.pending, sample.last_sequence);
                        health.record_drain(DrainSample { at_ms, backlog, produced_total });
                    }
                    Ok(Err(e)) => tracing::debug!(error = %e, "backlog poll failed"),
                    Err(_) => tracing::debug!("backlog poll timed out"),
                }
                match tokio::time::timeout(every, log.poll_placement()).await {
                    Ok(placements) => flashsale_io::jetstream::record_placement(&placements),
                    Err(_) => tracing::debug!("stream placement poll timed out"),
                }
                if pause(every, &mut stop).await {
                    return;
                }
            }
        }
    };
    let postgres = ping_postgres(pg_url, health, every, stop);
    tokio::join!(backlog, postgres);
}

/// Prometheus' spelling of a float (`+Inf`, `NaN`).
fn prometheus_float(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        v.to_string()
    }
}

async fn ping_postgres(
    pg_url: String,
    health: Arc<Health>,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let settings = PgPoolConfig::probe(pg_url, every, "flashsale-health");
    let connector = match Connector::new(&settings) {
        Ok(connector) => Some(connector),
        Err(e) => {
            // The URL was validated at start-up; without a connector every ping fails
            // (PG_OUTAGE), which is the honest answer.
            tracing::error!(error = %e, "health ping cannot connect to PostgreSQL");
            None
        }
    };
    let mut pg: Option<(tokio_postgres::Client, tokio::task::JoinHandle<()>)> = None;
    loop {
        if pg.as_ref().is_none_or(|(client, _)| client.is_closed()) {
            if let Some((_, task)) = pg.take() {
                task.abort();
            }
            if let Some(connector) = &connector {
                pg = connector.connect().await.ok();
            }
        }
        if let Some((client, task)) = &pg {
            match tokio::time::timeout(every, client.simple_query("SELECT 1")).await {
                Ok(Ok(_)) => {
                    health.pg_ok_at_ms.store(crate::logic::clock::now_ms(), Ordering::Relaxed)
                }
                _ => {
                    task.abort();
                    pg = None;
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
