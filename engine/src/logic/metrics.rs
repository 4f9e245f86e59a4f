//! The edge's metrics (DESIGN.md section 9): per-shard counters and histograms, written only
//! by their own shard (relaxed atomics on their own cache lines: no sharing on the hot path)
//! and merged when `/metrics` is scraped.
//!
//! Labels are closed sets (states, outcomes); business ids never become labels — they go into
//! tracing spans. The durable side (pg-worker, log lag) reports through the `metrics` crate's
//! recorder, whose rendering is appended to ours by the admin endpoint.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::logic::admission::REJECT_REASONS;
use crate::logic::outcome::{QueryOutcome, SubmitOutcome};
use crate::logic::reconcile::DELTA_KINDS;

const SUBMIT_OUTCOMES: [SubmitOutcome; 13] = SubmitOutcome::ALL;
const QUERY_OUTCOMES: [QueryOutcome; 8] = QueryOutcome::ALL;

fn submit_index(outcome: SubmitOutcome) -> usize {
    SUBMIT_OUTCOMES.iter().position(|o| *o == outcome).unwrap_or(0)
}

fn query_index(outcome: QueryOutcome) -> usize {
    QUERY_OUTCOMES.iter().position(|o| *o == outcome).unwrap_or(0)
}

/// Upper bounds (seconds) of the latency histograms: 50 µs .. 10 s.
const BUCKETS_S: [f64; 16] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

/// A fixed-bucket histogram; one writer (its shard), many readers (the scrape).
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS_S.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn observe_ns(&self, ns: u64) {
        let seconds = ns as f64 / 1e9;
        // Buckets are cumulative at render time; store per-bucket counts here.
        let index = BUCKETS_S.iter().position(|b| seconds <= *b).unwrap_or(BUCKETS_S.len() - 1);
        self.buckets[index].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

/// Picks one counter out of a shard's metrics (rendering tables).
type Field = fn(&ShardMetrics) -> &AtomicU64;

/// One shard's counters. Padded to keep shards off each other's cache lines.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct ShardMetrics {
    pub submit: [AtomicU64; 13],
    pub query: [AtomicU64; 8],
    /// Answered `SOLD_OUT` (or replayed) by a replica, with no Redis call and no hop.
    pub sold_out_fast_path: AtomicU64,
    /// Submits forwarded to another shard over the mesh.
    pub forwarded: AtomicU64,
    /// Payment callbacks refused for a bad signature (logged at most once a second).
    pub callback_bad_signature: AtomicU64,
    /// Redis failovers seen per SKU (its node promoted or restarted), and the SKUs closed
    /// by one right now (a gauge).
    pub redis_failovers: AtomicU64,
    pub skus_closed_by_failover: AtomicU64,
    /// SKUs whose Redis keys were found lost; SKUs rebuilt from PostgreSQL after it, and the
    /// reservations those rebuilds could not prove (final in PostgreSQL with no event to
    /// replay, or an event that does not decode).
    pub redis_data_losses: AtomicU64,
    pub redis_rebuilds: AtomicU64,
    pub redis_rebuild_anomalies: AtomicU64,
    /// Forwards refused because the mesh queue was full.
    pub mesh_full: AtomicU64,
    pub publish_ok: AtomicU64,
    pub publish_timeout: AtomicU64,
    /// Publishes acknowledged after the shard stopped waiting (counted in `timeout` too).
    pub publish_late_ok: AtomicU64,
    pub publish_error: AtomicU64,
    pub http_rejections: AtomicU64,
    pub connections_open: AtomicU64,
    pub connections_refused: AtomicU64,
    /// Connections closed at once because their client address held its per-shard share.
    pub connections_refused_per_address: AtomicU64,
    /// Failed accepts (EMFILE, ENFILE, ...): each one is followed by a backoff pause.
    pub accept_errors: AtomicU64,
    /// Connections closed by a deadline: the head, the body (408), or a write the peer did
    /// not take.
    pub timeouts_head: AtomicU64,
    pub timeouts_body: AtomicU64,
    /// Connections closed because their first byte did not arrive within the header deadline.
    pub timeouts_first_byte: AtomicU64,
    pub timeouts_write: AtomicU64,
    /// Trusted balancers' connections without a valid PROXY header (closed).
    pub proxy_refused_malformed: AtomicU64,
    /// PROXY headers from untrusted peers (400 and closed).
    pub proxy_refused_untrusted: AtomicU64,
    /// Order-create messages republished by the scanner (acknowledged).
    pub republished: AtomicU64,
    /// Reservations the scanner moved to `stuck` (past the recovery deadline).
    pub stuck_reservations: AtomicU64,
    /// Circuit states (0 closed, 1 half-open, 2 open), as last recorded.
    pub redis_circuit: AtomicU64,
    pub publish_circuit: AtomicU64,
    pub request_latency: Histogram,
    pub lua_latency: Histogram,
    /// The expensive path: from its place under the adaptive limit to the answer (`reserve`,
    /// and for a fresh reservation the publish and its ack).
    pub path_latency: Histogram,
    /// The adaptive limit of the expensive path (a gauge, `logic::overload`), and 1 while it
    /// has sat at its floor long enough to make the instance unready (readiness reads it).
    pub admission_limit: AtomicU64,
    pub admission_unready: AtomicU64,
    /// Compensations this shard applied (`compensate` answered APPLIED; repeats excluded).
    pub compensations: AtomicU64,
    /// Reservations in the `resv:pending` sets of the SKUs this shard owns, as last sampled
    /// by its scanner, and the age of the oldest (ms since its `reserved_at`).
    pub reservations_pending: AtomicU64,
    pub oldest_pending_age_ms: AtomicU64,
    /// Requests being answered right now (connections' routes and forwarded submits); a
    /// stopping shard waits for the sum over shards to reach zero.
    pub requests_in_flight: AtomicU64,
    /// Submissions refused by `decide_submit`, by `admission::REJECT_REASONS` index.
    pub admission_rejected: [AtomicU64; REJECT_REASONS.len()],
    /// Gauges of the periodic reconcile (shard 0 only).
    pub reconcile: ReconcileMetrics,
}

impl ShardMetrics {
    pub fn count_submit(&self, outcome: SubmitOutcome) {
        self.submit[submit_index(outcome)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_admission_reject(&self, reason: &str) {
        let index = REJECT_REASONS.iter().position(|r| *r == reason).unwrap_or(0);
        self.admission_rejected[index].fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_query(&self, outcome: QueryOutcome) {
        self.query[query_index(outcome)].fetch_add(1, Ordering::Relaxed);
    }
}

/// All shards' metrics, as the admin endpoint sees them.
#[derive(Debug, Clone)]
pub struct EdgeMetrics {
    shards: Arc<[ShardMetrics]>,
}

impl EdgeMetrics {
    pub fn new(shard_count: usize) -> EdgeMetrics {
        EdgeMetrics { shards: (0..shard_count).map(|_| ShardMetrics::default()).collect() }
    }

    pub fn shard(&self, id: usize) -> &ShardMetrics {
        &self.shards[id]
    }

    /// Whether any shard's adaptive limit has made the instance unready (sustained overload).
    pub fn overloaded(&self) -> bool {
        self.shards.iter().any(|s| s.admission_unready.load(Ordering::Relaxed) != 0)
    }

    /// Requests in flight on every shard.
    pub fn requests_in_flight(&self) -> u64 {
        self.sum(|s| &s.requests_in_flight)
    }

    fn sum(&self, f: impl Fn(&ShardMetrics) -> &AtomicU64) -> u64 {
        self.shards.iter().map(|s| f(s).load(Ordering::Relaxed)).sum()
    }

    /// Prometheus text exposition of the merged counters.
    pub fn render(&self, out: &mut String) {
        self.render_requests(out);
        self.render_counters(out);
        self.render_labelled_counters(out);
        self.render_pending_and_circuits(out);
        self.render_admission_rejections(out);
        self.render_histogram(out, "flashsale_request_latency_seconds", |s| &s.request_latency);
        self.render_histogram(out, "flashsale_lua_latency_seconds", |s| &s.lua_latency);
        self.render_histogram(out, "flashsale_expensive_path_seconds", |s| &s.path_latency);
        self.render_overload(out);
        ReconcileMetrics::render(self.shards.iter().map(|s| &s.reconcile), out);
    }

    /// The unlabelled counters and gauges, each summed over the shards.
    fn render_counters(&self, out: &mut String) {
        let counters: [(&str, Field); 19] = [
            ("flashsale_republished_total", |s| &s.republished),
            ("flashsale_stuck_reservations_total", |s| &s.stuck_reservations),
            ("flashsale_sold_out_fast_path_total", |s| &s.sold_out_fast_path),
            ("flashsale_mesh_forwarded_total", |s| &s.forwarded),
            ("flashsale_mesh_full_total", |s| &s.mesh_full),
            ("flashsale_http_rejections_total", |s| &s.http_rejections),
            ("flashsale_connections_refused_total", |s| &s.connections_refused),
            ("flashsale_connections_refused_per_address_total", |s| {
                &s.connections_refused_per_address
            }),
            ("flashsale_accept_errors_total", |s| &s.accept_errors),
            ("flashsale_connections_open", |s| &s.connections_open),
            ("flashsale_requests_in_flight", |s| &s.requests_in_flight),
            ("flashsale_compensations_total", |s| &s.compensations),
            ("flashsale_payment_callback_bad_signature_total", |s| &s.callback_bad_signature),
            ("flashsale_redis_failovers_total", |s| &s.redis_failovers),
            ("flashsale_skus_closed_by_failover", |s| &s.skus_closed_by_failover),
            ("flashsale_redis_data_losses_total", |s| &s.redis_data_losses),
            ("flashsale_redis_rebuilds_total", |s| &s.redis_rebuilds),
            ("flashsale_redis_rebuild_anomalies_total", |s| &s.redis_rebuild_anomalies),
            ("flashsale_reservations_pending", |s| &s.reservations_pending),
        ];
        for (name, field) in counters {
            let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
            let _ = writeln!(out, "# TYPE {name} {kind}\n{name} {}", self.sum(field));
        }
    }

    /// The counters with one closed label: publish outcomes, connection timeouts by phase,
    /// refused PROXY headers by reason.
    fn render_labelled_counters(&self, out: &mut String) {
        self.render_labelled(
            out,
            "flashsale_publish_total",
            "outcome",
            &[
                ("ok", |s| &s.publish_ok),
                ("timeout", |s| &s.publish_timeout),
                ("late_ack", |s| &s.publish_late_ok),
                ("error", |s| &s.publish_error),
            ],
        );
        self.render_labelled(
            out,
            "flashsale_connection_timeouts_total",
            "phase",
            &[
                ("first_byte", |s| &s.timeouts_first_byte),
                ("head", |s| &s.timeouts_head),
                ("body", |s| &s.timeouts_body),
                ("write", |s| &s.timeouts_write),
            ],
        );
        self.render_labelled(
            out,
            "flashsale_proxy_protocol_refused_total",
            "reason",
            &[
                ("malformed", |s| &s.proxy_refused_malformed),
                ("untrusted", |s| &s.proxy_refused_untrusted),
            ],
        );
    }

    /// The oldest pending reservation (the worst shard's) and each dependency's circuit (the
    /// worst shard's state).
    fn render_pending_and_circuits(&self, out: &mut String) {
        let oldest_ms = self
            .shards
            .iter()
            .map(|s| s.oldest_pending_age_ms.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0);
        let _ = writeln!(
            out,
            "# TYPE flashsale_reservations_oldest_pending_age_seconds gauge\n\
             flashsale_reservations_oldest_pending_age_seconds {}",
            oldest_ms as f64 / 1000.0
        );
        let _ = writeln!(out, "# TYPE flashsale_circuit_state gauge");
        for (dependency, field) in
            [("redis", (|s| &s.redis_circuit) as Field), ("log_publish", |s| &s.publish_circuit)]
        {
            // The worst shard: one open circuit is what an operator needs to see.
            let worst =
                self.shards.iter().map(|s| field(s).load(Ordering::Relaxed)).max().unwrap_or(0);
            let _ = writeln!(out, "flashsale_circuit_state{{dependency=\"{dependency}\"}} {worst}");
        }
    }

    /// The adaptive limit summed over shards (the places the instance offers), and readiness
    /// by it: 0 when any shard's limit has sat at its floor.
    fn render_overload(&self, out: &mut String) {
        let limit = self.sum(|s| &s.admission_limit);
        let ready = !self.overloaded();
        let _ = writeln!(out, "# TYPE flashsale_admission_limit gauge");
        let _ = writeln!(out, "flashsale_admission_limit {limit}");
        let _ = writeln!(out, "# TYPE flashsale_admission_limit_ready gauge");
        let _ = writeln!(out, "flashsale_admission_limit_ready {}", u8::from(ready));
    }

    fn render_admission_rejections(&self, out: &mut String) {
        let _ = writeln!(out, "# TYPE flashsale_admission_rejections_total counter");
        for (i, reason) in REJECT_REASONS.iter().enumerate() {
            let v = self.sum(|s| &s.admission_rejected[i]);
            let _ =
                writeln!(out, "flashsale_admission_rejections_total{{reason=\"{reason}\"}} {v}");
        }
    }

    /// `flashsale_requests_total`, a line per route and answered state.
    fn render_requests(&self, out: &mut String) {
        let _ = writeln!(out, "# TYPE flashsale_requests_total counter");
        for (i, outcome) in SUBMIT_OUTCOMES.iter().enumerate() {
            let v = self.sum(|s| &s.submit[i]);
            let _ = writeln!(
                out,
                "flashsale_requests_total{{route=\"submit\",state=\"{}\"}} {v}",
                outcome.http().1
            );
        }
        for (i, outcome) in QUERY_OUTCOMES.iter().enumerate() {
            let v = self.sum(|s| &s.query[i]);
            let _ = writeln!(
                out,
                "flashsale_requests_total{{route=\"query\",state=\"{}\"}} {v}",
                outcome.http().1
            );
        }
    }

    /// One counter with one label, a line per value (summed over shards).
    fn render_labelled(&self, out: &mut String, name: &str, label: &str, values: &[(&str, Field)]) {
        let _ = writeln!(out, "# TYPE {name} counter");
        for (value, field) in values {
            let _ = writeln!(out, "{name}{{{label}=\"{value}\"}} {}", self.sum(field));
        }
    }

    fn render_histogram(&self, out: &mut String, name: &str, h: fn(&ShardMetrics) -> &Histogram) {
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0u64;
        for (i, bound) in BUCKETS_S.iter().enumerate() {
            cumulative +=
                self.shards.iter().map(|s| h(s).buckets[i].load(Ordering::Relaxed)).sum::<u64>();
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count: u64 = self.shards.iter().map(|s| h(s).count.load(Ordering::Relaxed)).sum();
        let sum_ns: u64 = self.shards.iter().map(|s| h(s).sum_ns.load(Ordering::Relaxed)).sum();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", sum_ns as f64 / 1e9);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// Gauges of the last periodic round (written by shard 0 only; summed over shards on render).
#[derive(Debug, Default)]
pub struct ReconcileMetrics {
    /// Per [`DELTA_KINDS`]: Σ over the round's SKUs of that delta's value.
    pub delta: [AtomicU64; 7],
    pub skus_ok: AtomicU64,
    pub skus_not_ok: AtomicU64,
    pub rounds: AtomicU64,
    pub last_round_ms: AtomicU64,
}

impl ReconcileMetrics {
    /// Prometheus text of all shards' gauges. The delta is labelled by its kind (a closed set
    /// of 7), never by SKU: the active-SKU set only grows over an instance's life, so SKU
    /// labels would make an unbounded series count; which SKU it is lives in the log line of
    /// the round and in `flashsale admin reconcile`.
    pub fn render<'a>(all: impl Iterator<Item = &'a ReconcileMetrics> + Clone, out: &mut String) {
        let sum = |f: &dyn Fn(&ReconcileMetrics) -> &AtomicU64| -> u64 {
            all.clone().map(|m| f(m).load(Ordering::Relaxed)).sum()
        };
        let _ = writeln!(out, "# TYPE flashsale_inventory_conservation_delta gauge");
        for (i, kind) in DELTA_KINDS.iter().enumerate() {
            let v = sum(&|m| &m.delta[i]);
            let _ = writeln!(out, "flashsale_inventory_conservation_delta{{kind=\"{kind}\"}} {v}");
        }
        let _ = writeln!(out, "# TYPE flashsale_reconcile_skus gauge");
        let _ = writeln!(out, "flashsale_reconcile_skus{{result=\"ok\"}} {}", sum(&|m| &m.skus_ok));
        let _ = writeln!(
            out,
            "flashsale_reconcile_skus{{result=\"not_ok\"}} {}",
            sum(&|m| &m.skus_not_ok)
        );
        let _ = writeln!(
            out,
            "# TYPE flashsale_reconcile_rounds_total counter\nflashsale_reconcile_rounds_total {}",
            sum(&|m| &m.rounds)
        );
        let last_ms = all.clone().map(|m| m.last_round_ms.load(Ordering::Relaxed)).max();
        let _ = writeln!(
            out,
            "# TYPE flashsale_reconcile_last_round_timestamp_seconds gauge\n\
             flashsale_reconcile_last_round_timestamp_seconds {}",
            last_ms.unwrap_or(0) as f64 / 1e3
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_shards_on_render() {
        let m = EdgeMetrics::new(2);
        m.shard(0).count_submit(SubmitOutcome::SoldOut);
        m.shard(1).count_submit(SubmitOutcome::SoldOut);
        m.shard(1).count_query(QueryOutcome::Unknown);
        m.shard(0).request_latency.observe_ns(300_000);
        m.shard(1).request_latency.observe_ns(20_000_000_000);
        let mut out = String::new();
        m.render(&mut out);
        assert!(out.contains("flashsale_requests_total{route=\"submit\",state=\"SOLD_OUT\"} 2"));
        assert!(out.contains("flashsale_requests_total{route=\"query\",state=\"UNKNOWN\"} 1"));
        assert!(out.contains("flashsale_request_latency_seconds_bucket{le=\"0.0005\"} 1"));
        assert!(out.contains("flashsale_request_latency_seconds_count 2"));
        m.shard(0).accept_errors.fetch_add(3, Ordering::Relaxed);
        m.shard(1).timeouts_body.fetch_add(1, Ordering::Relaxed);
        m.shard(1).proxy_refused_untrusted.fetch_add(2, Ordering::Relaxed);
        let mut out = String::new();
        m.render(&mut out);
        assert!(out.contains("\nflashsale_accept_errors_total 3\n"), "{out}");
        assert!(out.contains("flashsale_connection_timeouts_total{phase=\"body\"} 1"));
        assert!(out.contains("flashsale_proxy_protocol_refused_total{reason=\"untrusted\"} 2"));
    }

    #[test]
    fn metrics_render_every_kind() {
        let m = ReconcileMetrics::default();
        m.delta[4].store(3, Ordering::Relaxed);
        m.skus_not_ok.store(1, Ordering::Relaxed);
        let mut out = String::new();
        ReconcileMetrics::render([&m].into_iter(), &mut out);
        for kind in DELTA_KINDS {
            assert!(
                out.contains(&format!("flashsale_inventory_conservation_delta{{kind=\"{kind}\"}}"))
            );
        }
        assert!(
            out.contains("flashsale_inventory_conservation_delta{kind=\"redis_conservation\"} 3")
        );
        assert!(out.contains("flashsale_reconcile_skus{result=\"not_ok\"} 1"));
    }
}
