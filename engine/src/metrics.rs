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

use crate::admission::REJECT_REASONS;
use crate::outcome::{QueryOutcome, SubmitOutcome};

const SUBMIT_OUTCOMES: [SubmitOutcome; 13] = SubmitOutcome::ALL;
const QUERY_OUTCOMES: [QueryOutcome; 7] = QueryOutcome::ALL;

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
    pub query: [AtomicU64; 7],
    /// Answered `SOLD_OUT` (or replayed) by a replica, with no Redis call and no hop.
    pub sold_out_fast_path: AtomicU64,
    /// Submits forwarded to another shard over the mesh.
    pub forwarded: AtomicU64,
    /// Forwards refused because the mesh queue was full.
    pub mesh_full: AtomicU64,
    pub publish_ok: AtomicU64,
    pub publish_timeout: AtomicU64,
    pub publish_error: AtomicU64,
    pub http_rejections: AtomicU64,
    pub connections_open: AtomicU64,
    pub connections_refused: AtomicU64,
    /// Order-create messages republished by the scanner (acknowledged).
    pub republished: AtomicU64,
    /// Reservations the scanner moved to `stuck` (past the recovery deadline).
    pub stuck_reservations: AtomicU64,
    /// Circuit states (0 closed, 1 half-open, 2 open), as last recorded.
    pub redis_circuit: AtomicU64,
    pub publish_circuit: AtomicU64,
    pub request_latency: Histogram,
    pub lua_latency: Histogram,
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
    pub reconcile: crate::reconcile::ReconcileMetrics,
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

    /// Requests in flight on every shard.
    pub fn requests_in_flight(&self) -> u64 {
        self.sum(|s| &s.requests_in_flight)
    }

    fn sum(&self, f: impl Fn(&ShardMetrics) -> &AtomicU64) -> u64 {
        self.shards.iter().map(|s| f(s).load(Ordering::Relaxed)).sum()
    }

    /// Prometheus text exposition of the merged counters.
    pub fn render(&self, out: &mut String) {
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
        let counters: [(&str, Field); 11] = [
            ("flashsale_republished_total", |s| &s.republished),
            ("flashsale_stuck_reservations_total", |s| &s.stuck_reservations),
            ("flashsale_sold_out_fast_path_total", |s| &s.sold_out_fast_path),
            ("flashsale_mesh_forwarded_total", |s| &s.forwarded),
            ("flashsale_mesh_full_total", |s| &s.mesh_full),
            ("flashsale_http_rejections_total", |s| &s.http_rejections),
            ("flashsale_connections_refused_total", |s| &s.connections_refused),
            ("flashsale_connections_open", |s| &s.connections_open),
            ("flashsale_requests_in_flight", |s| &s.requests_in_flight),
            ("flashsale_compensations_total", |s| &s.compensations),
            ("flashsale_reservations_pending", |s| &s.reservations_pending),
        ];
        for (name, field) in counters {
            let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
            let _ = writeln!(out, "# TYPE {name} {kind}\n{name} {}", self.sum(field));
        }
        let _ = writeln!(out, "# TYPE flashsale_publish_total counter");
        for (outcome, field) in [
            ("ok", (|s| &s.publish_ok) as Field),
            ("timeout", |s| &s.publish_timeout),
            ("error", |s| &s.publish_error),
        ] {
            let _ = writeln!(
                out,
                "flashsale_publish_total{{outcome=\"{outcome}\"}} {}",
                self.sum(field)
            );
        }
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
        let _ = writeln!(out, "# TYPE flashsale_admission_rejections_total counter");
        for (i, reason) in REJECT_REASONS.iter().enumerate() {
            let v = self.sum(|s| &s.admission_rejected[i]);
            let _ =
                writeln!(out, "flashsale_admission_rejections_total{{reason=\"{reason}\"}} {v}");
        }
        self.render_histogram(out, "flashsale_request_latency_seconds", |s| &s.request_latency);
        self.render_histogram(out, "flashsale_lua_latency_seconds", |s| &s.lua_latency);
        crate::reconcile::ReconcileMetrics::render(self.shards.iter().map(|s| &s.reconcile), out);
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
    }
}
