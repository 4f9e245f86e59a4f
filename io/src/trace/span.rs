//! The spans flashsale exports (README "Tracing"), each recorded after the fact: a
//! [`SpanRecord`] holds what happened (its context, parent, link, times, outcome and business
//! ids) and becomes the SDK's `SpanData` only when recorded (`sink.rs`). Their names and
//! attribute keys are what trace queries and dashboards rely on: change them with care.
//!
//! Why after the fact and not the SDK's `Tracer`: a glommio shard runs many requests on one
//! thread, so a span held open across an `await` through thread-local context would be entered
//! by whichever request ran next; and the ids and times are all known when the step ends.
//!
//! Attributes (seed ch9 §12.10): `request_id`, `reservation_id`, `message_id`, `order_id`,
//! `activity_id`, `sku_id`, `user_id_hash` (never the user id), `result_code`, and per span
//! `retry_count`, `messaging.*`, `db.system`. Business ids are attributes, never metric labels.
//!
//! What it is not: the decision of which context a span takes (`context.rs`).

use std::borrow::Cow;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};

use super::context::{ReservationContext, SampleRatio, TraceContext};

/// The spans, one per step of a reservation's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanName {
    /// The owner shard's reservation: from `reserved_at` until the buyer's answer is decided
    /// (Redis `reserve`, then the publish). Server span; its parent is the buyer's span.
    Reservation,
    /// The order-create message's first publish, child of the reservation (producer).
    Publish,
    /// The scanner's republish of a pending message: a new span in the trace the message id
    /// names, linked to the reservation span (seed ch9 §12.10: a replay links to its
    /// original producer).
    Republish,
    /// The worker's transaction for one message and delivery, child of the context the
    /// message carries (consumer).
    OrderWrite,
    /// `redis-sync` undoing a reservation's Redis effects, child of the context its event
    /// carries (consumer).
    Compensate,
}

impl SpanName {
    pub const ALL: [SpanName; 5] = [
        SpanName::Reservation,
        SpanName::Publish,
        SpanName::Republish,
        SpanName::OrderWrite,
        SpanName::Compensate,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SpanName::Reservation => "seckill.reservation",
            SpanName::Publish => "log.publish",
            SpanName::Republish => "log.republish",
            SpanName::OrderWrite => "order.write",
            SpanName::Compensate => "inventory.compensate",
        }
    }

    fn kind(self) -> SpanKind {
        match self {
            SpanName::Reservation => SpanKind::Server,
            SpanName::Publish | SpanName::Republish => SpanKind::Producer,
            SpanName::OrderWrite | SpanName::Compensate => SpanKind::Consumer,
        }
    }
}

/// Where a span hangs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parent {
    /// A root span.
    Root,
    /// A span of this process.
    Local([u8; 8]),
    /// A span of another process: the buyer's, or the producer's across the log.
    Remote([u8; 8]),
}

/// One finished span, as its step knew it.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    pub name: SpanName,
    /// Its trace, its own id; only sampled spans are recorded.
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent: Parent,
    /// A span this one follows from without being its child (a republish's reservation).
    pub link: Option<TraceContext>,
    pub start: SystemTime,
    pub end: SystemTime,
    /// `Some(why)`: the step failed (the span's status is an error).
    pub error: Option<&'static str>,
    pub attributes: Vec<KeyValue>,
}

impl SpanRecord {
    /// A span of `name` in `context` (its own id) under `parent`, between `start` and `end`.
    pub fn new(
        name: SpanName,
        context: TraceContext,
        parent: Parent,
        start: SystemTime,
        end: SystemTime,
    ) -> SpanRecord {
        SpanRecord {
            name,
            trace_id: context.trace_id,
            span_id: context.span_id,
            parent,
            link: None,
            start,
            end: end.max(start),
            error: None,
            attributes: Vec::with_capacity(ATTRIBUTES_TYPICAL),
        }
    }

    /// A span of a step after the log hop (the order write, the compensation), or None when
    /// its trace is not sampled. Under the context the message or event carries, when it
    /// carries one (its sampled flag is the reservation's decision, honoured here); else,
    /// e.g. an event no reservation context travelled with, a root span in the trace the
    /// message id names, linked to the reservation span and sampled by `ratio` on that trace.
    pub fn downstream(
        name: SpanName,
        carried: Option<&str>,
        message_id: &str,
        ratio: SampleRatio,
        start: SystemTime,
        end: SystemTime,
    ) -> Option<SpanRecord> {
        if let Some(parent) = carried.and_then(TraceContext::parse) {
            if !parent.sampled {
                return None;
            }
            let context = TraceContext { span_id: new_span_id(), ..parent };
            return Some(SpanRecord::new(
                name,
                context,
                Parent::Remote(parent.span_id),
                start,
                end,
            ));
        }
        let reservation = ReservationContext::of_message(message_id, ratio);
        if !reservation.sampled {
            return None;
        }
        let context = TraceContext { span_id: new_span_id(), ..reservation };
        let mut span = SpanRecord::new(name, context, Parent::Root, start, end);
        span.link = Some(reservation);
        Some(span)
    }

    pub fn attr(&mut self, key: &'static str, value: impl Into<opentelemetry::Value>) {
        self.attributes.push(KeyValue::new(key, value));
    }

    /// The business ids every span of a reservation carries (the user id hashed).
    pub fn ids(&mut self, ids: &BusinessIds<'_>) {
        if let Some(request_id) = ids.request_id {
            self.attr("request_id", request_id.to_owned());
        }
        self.attr("reservation_id", ids.reservation_id.to_owned());
        self.attr("message_id", ids.message_id.to_owned());
        if let Some(order_id) = ids.order_id {
            self.attr("order_id", order_id.to_owned());
        }
        self.attr("activity_id", ids.activity_id as i64);
        self.attr("sku_id", ids.sku_id as i64);
        self.attr("user_id_hash", format!("{:016x}", user_id_hash(ids.user_id)));
    }

    /// The SDK's span, as OTLP exports it.
    pub fn into_span_data(self, scope: &InstrumentationScope) -> SpanData {
        let flags = TraceFlags::SAMPLED;
        let context = SpanContext::new(
            TraceId::from_bytes(self.trace_id),
            SpanId::from_bytes(self.span_id),
            flags,
            false,
            TraceState::NONE,
        );
        let (parent_span_id, parent_span_is_remote) = match self.parent {
            Parent::Root => (SpanId::INVALID, false),
            Parent::Local(id) => (SpanId::from_bytes(id), false),
            Parent::Remote(id) => (SpanId::from_bytes(id), true),
        };
        let mut links = SpanLinks::default();
        if let Some(link) = self.link {
            let linked = SpanContext::new(
                TraceId::from_bytes(link.trace_id),
                SpanId::from_bytes(link.span_id),
                if link.sampled { TraceFlags::SAMPLED } else { TraceFlags::default() },
                true,
                TraceState::NONE,
            );
            links.links.push(Link::with_context(linked));
        }
        SpanData {
            span_context: context,
            parent_span_id,
            parent_span_is_remote,
            span_kind: self.name.kind(),
            name: Cow::Borrowed(self.name.as_str()),
            start_time: self.start,
            end_time: self.end,
            attributes: self.attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links,
            status: match self.error {
                Some(why) => Status::error(why),
                None => Status::Ok,
            },
            instrumentation_scope: scope.clone(),
        }
    }
}

/// Attributes a span usually has (the vector is sized once).
const ATTRIBUTES_TYPICAL: usize = 12;

/// The ids of a reservation a span names.
#[derive(Debug, Clone, Copy)]
pub struct BusinessIds<'a> {
    pub request_id: Option<&'a str>,
    pub reservation_id: &'a str,
    pub message_id: &'a str,
    pub order_id: Option<&'a str>,
    pub activity_id: u64,
    pub sku_id: u64,
    pub user_id: u64,
}

/// A user id as it may appear in logs and spans: not reversible at a glance, stable within
/// and across processes so one buyer's lines and spans can be followed (the engine's log
/// lines use it too, through `logic::limiter::hash_user`). Its values must never change:
/// operators search old traces and logs by them.
pub fn user_id_hash(user_id: u64) -> u64 {
    // splitmix64's finalizer over the id and a fixed seed.
    let mut x = user_id ^ 0x5eed_f1a5_4a1e_0001;
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A fresh span id (never zero).
pub fn new_span_id() -> [u8; 8] {
    (rand::random::<u64>() | 1).to_be_bytes()
}

/// The wall-clock time of a millisecond timestamp (the business times in messages).
pub fn at_ms(unix_ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(unix_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_hash_keeps_its_values() {
        // splitmix64's finalizer of the id xor the seed, as the log lines had it before.
        let mut x = 42u64 ^ 0x5eed_f1a5_4a1e_0001;
        x ^= x >> 30;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x >> 27;
        x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
        assert_eq!(user_id_hash(42), x ^ (x >> 31));
        assert_ne!(user_id_hash(1), user_id_hash(2));
    }

    #[test]
    fn a_step_after_the_log_hangs_under_the_carried_context_and_honours_its_flag() {
        let (t0, t1) = (at_ms(1), at_ms(2));
        let reservation = ReservationContext::decide(None, "msg_1", SampleRatio::ALL).context;
        let carried = reservation.traceparent();
        let span = SpanRecord::downstream(
            SpanName::OrderWrite,
            Some(&carried),
            "msg_1",
            SampleRatio::NONE,
            t0,
            t1,
        )
        .expect("the carried decision wins over this process's ratio");
        assert_eq!(span.trace_id, reservation.trace_id);
        assert_eq!(span.parent, Parent::Remote(reservation.span_id));
        assert_ne!(span.span_id, reservation.span_id);
        let unsampled = TraceContext { sampled: false, ..reservation }.traceparent();
        let none = SpanRecord::downstream(
            SpanName::OrderWrite,
            Some(&unsampled),
            "msg_1",
            SampleRatio::ALL,
            t0,
            t1,
        );
        assert_eq!(none, None, "not sampled at the reservation, not recorded after it");
        // Nothing carried: the message's own trace, linked to the reservation span.
        let linked =
            SpanRecord::downstream(SpanName::Compensate, None, "msg_1", SampleRatio::ALL, t0, t1)
                .expect("sampled");
        assert_eq!((linked.trace_id, linked.parent), (reservation.trace_id, Parent::Root));
        assert_eq!(linked.link, Some(reservation));
        assert_eq!(
            SpanRecord::downstream(SpanName::Compensate, None, "msg_1", SampleRatio::NONE, t0, t1),
            None
        );
    }

    #[test]
    fn a_record_becomes_the_sdks_span_with_its_parent_link_and_status() {
        let reservation = ReservationContext::of_message("msg_1", SampleRatio::ALL);
        let context = TraceContext { span_id: new_span_id(), ..reservation };
        let start = at_ms(1_000);
        let mut record =
            SpanRecord::new(SpanName::Republish, context, Parent::Root, start, at_ms(900));
        record.link = Some(reservation);
        record.error = Some("not acknowledged");
        record.ids(&BusinessIds {
            request_id: Some("req_1"),
            reservation_id: "resv_1",
            message_id: "msg_1",
            order_id: None,
            activity_id: 1,
            sku_id: 2,
            user_id: 3,
        });
        let scope = InstrumentationScope::builder("flashsale").build();
        let span = record.into_span_data(&scope);
        assert_eq!(span.name, "log.republish");
        assert_eq!(span.span_kind, SpanKind::Producer);
        assert_eq!(span.end_time, start, "an end before the start is clamped to it");
        assert_eq!(span.parent_span_id, SpanId::INVALID);
        assert_eq!(span.links.len(), 1);
        assert_eq!(span.links[0].span_context.span_id().to_bytes(), reservation.span_id);
        assert!(matches!(span.status, Status::Error { .. }));
        let user = span.attributes.iter().find(|kv| kv.key.as_str() == "user_id_hash");
        assert_eq!(user.map(|kv| kv.value.to_string()), Some(format!("{:016x}", user_id_hash(3))));
        assert!(span.attributes.iter().all(|kv| kv.value.to_string() != "3"), "no raw user id");
    }
}
