//! The exporter: a tokio task that drains the sink ([`TraceSink`]) in batches, encodes each as
//! an OTLP `ExportTraceServiceRequest` (opentelemetry-proto's conversion of the SDK's spans,
//! protobuf by prost) and POSTs it to the collector (`http_post.rs`), one request at a time,
//! each bounded by `export_timeout_ms`.
//!
//! Failing open (seed ch9 §12.9, §13): a batch whose export fails or times out is dropped and
//! counted (`flashsale_trace_spans_dropped_total{reason="export_failed"}`), never retried:
//! retrying would hold spans while new ones queue behind them, and a trace with a gap is worth
//! less than a buyer's latency. While the collector is down or hung the queue fills and the
//! sink drops at the door; the recording steps never wait. It runs on the durable side's
//! runtime (`flashsale serve`) or the worker's (`flashsale worker`), never on a shard.
//!
//! What it is not: recording (`sink.rs`, `span.rs`), deciding (`context.rs`).

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
use opentelemetry_sdk::trace::SpanData;
use opentelemetry_sdk::Resource;
use prost::Message as _;
use tokio::sync::watch;

use super::context::SampleRatio;
use super::http_post::{post, OtlpEndpoint};
use super::sink::TraceSink;

/// OTLP/HTTP's protobuf content type.
pub const PROTOBUF_CONTENT_TYPE: &str = "application/x-protobuf";

/// Trace export's settings (`[tracing]`, `FLASHSALE_OTLP_ENDPOINT`,
/// `FLASHSALE_TRACE_SAMPLE_RATIO`), validated by [`TraceConfig::validate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceConfig {
    /// The collector; None: nothing is recorded, decided, carried or exported.
    pub endpoint: Option<OtlpEndpoint>,
    /// Head sampling, decided once per reservation (`context.rs`).
    pub sample_ratio: SampleRatio,
    /// Spans waiting for export at most; beyond, dropped and counted. ~1 KB each.
    pub queue_spans_max: usize,
    /// Spans per export request at most.
    pub export_batch_max: usize,
    /// How often the queue is looked at when it holds less than a batch.
    pub export_interval_ms: u64,
    /// Deadline of one export request, connection included.
    pub export_timeout_ms: u64,
    /// `service.instance.id` of the spans' resource (the engine's instance id).
    pub service_instance_id: String,
}

impl Default for TraceConfig {
    fn default() -> TraceConfig {
        TraceConfig {
            endpoint: None,
            // Spans come only from reservations (bounded by stock), never from the sold-out
            // path, so all of them fit: a 10,000-unit sale makes ~30,000 spans.
            sample_ratio: SampleRatio::ALL,
            // ~8 MB at most; at the export rate below it absorbs a collector pause of seconds
            // in a sale's busiest phase.
            queue_spans_max: 8_192,
            // ~0.3 MB of protobuf per request: small enough for any collector's default
            // request limit, large enough that a busy sale needs tens of requests a second.
            export_batch_max: 512,
            export_interval_ms: 500,
            // A collector on loopback or the private network answers in milliseconds; two
            // seconds is a hung one, whose pending spans are dropped and counted.
            export_timeout_ms: 2_000,
            service_instance_id: String::new(),
        }
    }
}

impl TraceConfig {
    pub const QUEUE_SPANS_MAX: usize = 1 << 20;

    /// Every bound, named in the message when wrong.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=TraceConfig::QUEUE_SPANS_MAX).contains(&self.queue_spans_max) {
            return Err(format!(
                "queue_spans_max must be 1..={} (got {})",
                TraceConfig::QUEUE_SPANS_MAX,
                self.queue_spans_max
            ));
        }
        if !(1..=self.queue_spans_max).contains(&self.export_batch_max) {
            return Err("export_batch_max must be 1..=queue_spans_max".into());
        }
        if !(10..=60_000).contains(&self.export_interval_ms) {
            return Err("export_interval_ms must be 10..=60000".into());
        }
        if !(10..=60_000).contains(&self.export_timeout_ms) {
            return Err("export_timeout_ms must be 10..=60000".into());
        }
        Ok(())
    }

    /// The sink the recording steps share: disabled without an endpoint.
    pub fn sink(&self) -> TraceSink {
        match self.endpoint {
            Some(_) => TraceSink::new(self.queue_spans_max, self.sample_ratio),
            None => TraceSink::disabled(),
        }
    }
}

/// Drains `sink` into the collector until `stop` turns true, then exports what is left once
/// (bounded by the deadline). Returns at once when no endpoint is configured.
pub async fn run(sink: TraceSink, config: TraceConfig, mut stop: watch::Receiver<bool>) {
    let Some(endpoint) = config.endpoint.clone() else { return };
    let resource = ResourceAttributesWithSchema::from(&resource(&config));
    let mut exporter = Exporter { sink, config, endpoint, resource, failing: false };
    let every = Duration::from_millis(exporter.config.export_interval_ms);
    loop {
        let stopping = tokio::select! {
            _ = tokio::time::sleep(every) => false,
            changed = stop.changed() => changed.is_err() || *stop.borrow(),
        };
        exporter.export_queued().await;
        if stopping {
            break;
        }
    }
}

/// `service.name` flashsale, its version, the instance.
fn resource(config: &TraceConfig) -> Resource {
    let mut attributes = vec![KeyValue::new("service.version", env!("CARGO_PKG_VERSION"))];
    if !config.service_instance_id.is_empty() {
        attributes.push(KeyValue::new("service.instance.id", config.service_instance_id.clone()));
    }
    Resource::builder_empty().with_service_name("flashsale").with_attributes(attributes).build()
}

struct Exporter {
    sink: TraceSink,
    config: TraceConfig,
    endpoint: OtlpEndpoint,
    resource: ResourceAttributesWithSchema,
    /// The last export failed (a change is logged once, not every batch).
    failing: bool,
}

impl Exporter {
    /// Exports full batches while the queue holds them, then what is left; stops at the
    /// first failure (the next round tries again).
    async fn export_queued(&mut self) {
        let batch_max = self.config.export_batch_max;
        loop {
            let mut batch = Vec::with_capacity(batch_max.min(64));
            self.sink.drain(batch_max, &mut batch);
            let full = batch.len() == batch_max;
            if batch.is_empty() || !self.export(batch).await || !full {
                return;
            }
        }
    }

    /// One request; true when the collector took it.
    async fn export(&mut self, batch: Vec<SpanData>) -> bool {
        let Some(counts) = self.sink.counts() else { return false };
        let spans = batch.len() as u64;
        let body = encode(batch, &self.resource);
        let deadline = Duration::from_millis(self.config.export_timeout_ms);
        let sent =
            tokio::time::timeout(deadline, post(&self.endpoint, PROTOBUF_CONTENT_TYPE, &body));
        use std::sync::atomic::Ordering::Relaxed;
        let failure = match sent.await {
            Ok(Ok(_status)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => {
                Some(format!("collector at {} did not answer within {deadline:?}", self.endpoint))
            }
        };
        match failure {
            None => {
                counts.exported.fetch_add(spans, Relaxed);
                if std::mem::replace(&mut self.failing, false) {
                    tracing::info!(endpoint = %self.endpoint, "trace export resumed");
                }
                true
            }
            Some(why) => {
                counts.dropped_export_failed.fetch_add(spans, Relaxed);
                counts.export_failures.fetch_add(1, Relaxed);
                if !std::mem::replace(&mut self.failing, true) {
                    tracing::warn!(error = %why, spans, "trace export failed: spans dropped (buyers unaffected)");
                }
                false
            }
        }
    }
}

/// The OTLP request body of `batch`.
pub fn encode(batch: Vec<SpanData>, resource: &ResourceAttributesWithSchema) -> Vec<u8> {
    let request = ExportTraceServiceRequest {
        resource_spans: group_spans_by_resource_and_scope(batch, resource),
    };
    request.encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid_and_each_bound_is_checked() {
        let config = TraceConfig::default();
        assert_eq!(config.validate(), Ok(()));
        assert!(!config.sink().is_enabled(), "no endpoint, no sink");
        let on = TraceConfig {
            endpoint: Some(OtlpEndpoint::parse("http://127.0.0.1:4318").expect("valid")),
            ..TraceConfig::default()
        };
        assert!(on.sink().is_enabled());
        for bad in [
            TraceConfig { queue_spans_max: 0, ..TraceConfig::default() },
            TraceConfig { export_batch_max: 9_000, ..TraceConfig::default() },
            TraceConfig { export_interval_ms: 0, ..TraceConfig::default() },
            TraceConfig { export_timeout_ms: 120_000, ..TraceConfig::default() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
