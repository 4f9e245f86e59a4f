//! Where finished spans wait for the exporter: a bounded lock-free queue that any thread (a
//! glommio shard, a tokio task of the worker) pushes into without blocking, and that drops and
//! counts a span when it is full (seed ch9 §12.9: asynchronous, bounded, sampled, failing open).
//!
//! A full queue means the exporter is behind: the collector is slow, hung or down. The span
//! is dropped at once and counted (`flashsale_trace_spans_dropped_total{reason="queue_full"}`);
//! nothing a buyer waits on ever waits for tracing, and the memory tracing holds is bounded by
//! `queue_spans_max` spans.
//!
//! What it is not: the exporter that drains it (`export.rs`), or the decision of what to
//! record (`context.rs`).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam::queue::ArrayQueue;
use opentelemetry::InstrumentationScope;
use opentelemetry_sdk::trace::SpanData;

use super::context::SampleRatio;
use super::span::SpanRecord;

/// The handle every recording step holds (cheap to clone). A disabled sink (no collector
/// configured) records nothing and costs one branch.
#[derive(Clone, Default)]
pub struct TraceSink {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    queue: ArrayQueue<SpanData>,
    ratio: SampleRatio,
    scope: InstrumentationScope,
    counts: Counts,
}

/// The counters behind `flashsale_trace_*` (relaxed: each is a tally read on a scrape).
#[derive(Default)]
pub(super) struct Counts {
    pub recorded: AtomicU64,
    pub dropped_queue_full: AtomicU64,
    pub dropped_export_failed: AtomicU64,
    pub exported: AtomicU64,
    pub export_failures: AtomicU64,
}

impl TraceSink {
    /// A sink that records nothing.
    pub fn disabled() -> TraceSink {
        TraceSink { inner: None }
    }

    /// A sink of at most `queue_spans_max` spans, sampling traces at `ratio`.
    pub fn new(queue_spans_max: usize, ratio: SampleRatio) -> TraceSink {
        let scope =
            InstrumentationScope::builder("flashsale").with_version(env!("CARGO_PKG_VERSION"));
        TraceSink {
            inner: Some(Arc::new(Inner {
                queue: ArrayQueue::new(queue_spans_max.max(1)),
                ratio,
                scope: scope.build(),
                counts: Counts::default(),
            })),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// The head-sampling ratio; None when disabled (then nothing is decided or carried).
    pub fn ratio(&self) -> Option<SampleRatio> {
        self.inner.as_ref().map(|inner| inner.ratio)
    }

    /// Queues a finished, sampled span without blocking; a full queue drops it and counts.
    pub fn record(&self, span: SpanRecord) {
        let Some(inner) = &self.inner else { return };
        let data = span.into_span_data(&inner.scope);
        match inner.queue.push(data) {
            Ok(()) => inner.counts.recorded.fetch_add(1, Ordering::Relaxed),
            Err(_) => inner.counts.dropped_queue_full.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// Moves up to `max` queued spans into `out`.
    pub(super) fn drain(&self, max: usize, out: &mut Vec<SpanData>) {
        let Some(inner) = &self.inner else { return };
        while out.len() < max {
            match inner.queue.pop() {
                Some(span) => out.push(span),
                None => break,
            }
        }
    }

    pub(super) fn counts(&self) -> Option<&Counts> {
        self.inner.as_ref().map(|inner| &inner.counts)
    }

    /// The counters now (zero when disabled).
    pub fn stats(&self) -> TraceStats {
        let Some(inner) = &self.inner else { return TraceStats::default() };
        let c = &inner.counts;
        TraceStats {
            enabled: true,
            sample_ratio: inner.ratio.as_f64(),
            queued: inner.queue.len() as u64,
            queue_max: inner.queue.capacity() as u64,
            recorded: c.recorded.load(Ordering::Relaxed),
            exported: c.exported.load(Ordering::Relaxed),
            dropped_queue_full: c.dropped_queue_full.load(Ordering::Relaxed),
            dropped_export_failed: c.dropped_export_failed.load(Ordering::Relaxed),
            export_failures: c.export_failures.load(Ordering::Relaxed),
        }
    }
}

/// Two handles are equal when they are the same sink (or both disabled).
impl PartialEq for TraceSink {
    fn eq(&self, other: &TraceSink) -> bool {
        match (&self.inner, &other.inner) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for TraceSink {}

impl fmt::Debug for TraceSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            None => f.write_str("TraceSink(disabled)"),
            Some(inner) => write!(
                f,
                "TraceSink(ratio {}, {}/{} queued)",
                inner.ratio.as_f64(),
                inner.queue.len(),
                inner.queue.capacity()
            ),
        }
    }
}

/// A snapshot of the sink's counters (`/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TraceStats {
    pub enabled: bool,
    pub sample_ratio: f64,
    pub queued: u64,
    pub queue_max: u64,
    /// Spans queued (sampled spans the queue took).
    pub recorded: u64,
    /// Spans the collector accepted.
    pub exported: u64,
    /// Spans dropped because the queue was full.
    pub dropped_queue_full: u64,
    /// Spans dropped because their export failed or timed out.
    pub dropped_export_failed: u64,
    /// Export requests that failed or timed out.
    pub export_failures: u64,
}

impl TraceStats {
    /// The `flashsale_trace_*` series in Prometheus text (none when disabled).
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        if !self.enabled {
            return;
        }
        let _ = writeln!(
            out,
            "# TYPE flashsale_trace_sample_ratio gauge\nflashsale_trace_sample_ratio {}\n\
             # TYPE flashsale_trace_spans_queued gauge\nflashsale_trace_spans_queued {}\n\
             # TYPE flashsale_trace_spans_queue_max gauge\nflashsale_trace_spans_queue_max {}\n\
             # TYPE flashsale_trace_spans_recorded_total counter\n\
             flashsale_trace_spans_recorded_total {}\n\
             # TYPE flashsale_trace_spans_exported_total counter\n\
             flashsale_trace_spans_exported_total {}\n\
             # TYPE flashsale_trace_spans_dropped_total counter\n\
             flashsale_trace_spans_dropped_total{{reason=\"queue_full\"}} {}\n\
             flashsale_trace_spans_dropped_total{{reason=\"export_failed\"}} {}\n\
             # TYPE flashsale_trace_export_failures_total counter\n\
             flashsale_trace_export_failures_total {}",
            self.sample_ratio,
            self.queued,
            self.queue_max,
            self.recorded,
            self.exported,
            self.dropped_queue_full,
            self.dropped_export_failed,
            self.export_failures,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::span::{at_ms, Parent, SpanName};
    use crate::trace::ReservationContext;

    fn span(i: u64) -> SpanRecord {
        let context = ReservationContext::of_message(&format!("msg_{i}"), SampleRatio::ALL);
        SpanRecord::new(SpanName::Publish, context, Parent::Root, at_ms(i), at_ms(i + 1))
    }

    #[test]
    fn a_full_queue_drops_and_counts_and_a_disabled_sink_records_nothing() {
        let sink = TraceSink::new(2, SampleRatio::ALL);
        for i in 0..5 {
            sink.record(span(i));
        }
        let stats = sink.stats();
        assert_eq!((stats.recorded, stats.dropped_queue_full, stats.queued), (2, 3, 2));
        let mut out = Vec::new();
        sink.drain(10, &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].start_time, at_ms(0), "first in, first out");
        let mut text = String::new();
        sink.stats().render(&mut text);
        assert!(text.contains("flashsale_trace_spans_dropped_total{reason=\"queue_full\"} 3\n"));

        let off = TraceSink::disabled();
        off.record(span(9));
        assert_eq!(off.stats(), TraceStats::default());
        assert_eq!(off.ratio(), None);
        assert_eq!(off, TraceSink::disabled());
        assert_ne!(sink, off);
        assert_eq!(sink, sink.clone());
    }
}
