//! Trace export over OTLP (DESIGN.md section 9; seed ch9 §12.9-12.10): the spans of a
//! reservation's life — the reservation, its publish (or republish), the order write, the
//! compensation — linked across the log by the message id and the `traceparent` the message
//! carries, head-sampled once per reservation, queued without blocking in a bounded sink and
//! exported by a tokio task that fails open.
//!
//! - `context.rs`: `traceparent`, the sampling ratio, the ids a message id names, the rule
//!   that fixes a reservation's context ([`ReservationContext`]); sans-I/O.
//! - `span.rs`: the spans ([`SpanName`]) as recorded after the fact ([`SpanRecord`]), their
//!   attributes, the hashed user id.
//! - `sink.rs`: [`TraceSink`], the bounded queue every recording step pushes into, and its
//!   counters ([`TraceStats`], `flashsale_trace_*`).
//! - `export.rs`: [`TraceConfig`] and [`export::run`], the exporter task.
//! - `http_post.rs`: the collector's endpoint ([`OtlpEndpoint`]) and the one POST.
//!
//! Declares and re-exports only.

pub mod context;
pub mod export;
pub mod http_post;
pub mod sink;
pub mod span;

pub use context::{MessageIds, ReservationContext, SampleRatio, TraceContext};
pub use export::TraceConfig;
pub use http_post::OtlpEndpoint;
pub use sink::{TraceSink, TraceStats};
pub use span::{at_ms, new_span_id, user_id_hash, BusinessIds, Parent, SpanName, SpanRecord};
