//! The edge's spans (`flashsale_io::trace`; README "Tracing"), recorded after the fact
//! into the shared sink, which never blocks (the durable side exports):
//!
//! - a fresh reservation: `seckill.reservation` (from its `reserved_at` until the buyer's
//!   answer is decided) and its child `log.publish`. Both are recorded by the publish path
//!   ([`PublishTrace`]), where every `CREATED` reservation passes with its message, and where
//!   the reservation's context is fixed and written into the message's `traceparent` (so the
//!   log carries the reservation span, and the decision to sample it, to the worker);
//! - a republish: `log.republish` in the trace the message id names, linked to the
//!   reservation span (the scanner does not know a buyer's trace: the `resv` record does not
//!   keep it);
//! - a compensation: `inventory.compensate` under the context its event carries.
//!
//! Reserve answers other than `CREATED` (sold out at Redis, duplicate buyer, unknown) make no
//! span: no message carries their context, and the sold-out path must stay free of tracing.
//!
//! What it is not: the context rule or the export (`flashsale_io::trace`).

use std::time::SystemTime;

use flashsale_io::jetstream::ORDER_CREATE_SUBJECT;
use flashsale_io::redis::script::{CompensateReply, ScriptError};
use flashsale_io::trace::{
    at_ms, new_span_id, BusinessIds, MessageIds, Parent, ReservationContext, SpanName, SpanRecord,
    TraceContext, TraceSink,
};
use flashsale_io::wire::{Compensation, OrderCreate, ReservationEvent};

/// Which message is published: a fresh reservation's first, or the scanner's republish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sending {
    Fresh,
    Republish,
}

/// How the shard's wait for the log ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishEnd {
    Acked,
    /// The publish circuit is open: not sent.
    CircuitOpen,
    /// The log (or the durable side's full queue) refused it.
    Refused,
    /// No ack within `publish_wait_ms` (a late ack may still come).
    Timeout,
}

impl PublishEnd {
    fn result_code(self) -> &'static str {
        match self {
            PublishEnd::Acked => "ACKED",
            PublishEnd::CircuitOpen => "CIRCUIT_OPEN",
            PublishEnd::Refused => "REFUSED",
            PublishEnd::Timeout => "TIMEOUT",
        }
    }
}

/// A sampled publish's trace, from before its message leaves until the shard stops waiting.
pub struct PublishTrace {
    sending: Sending,
    /// The reservation span (fresh) or the republish span (scanner).
    context: TraceContext,
    /// Fresh: the buyer's span. Scanner: none (a root, linked to the reservation span).
    buyer: Option<[u8; 8]>,
    started: SystemTime,
    reserved_at_ms: u64,
    request_id: String,
    reservation_id: String,
    message_id: String,
    activity_id: u64,
    sku_id: u64,
    user_id: u64,
    retry_count: u32,
}

/// Fixes the context of `message` and writes it into its `traceparent` (the log carries it:
/// the reservation span for a fresh reservation, the republish span for a republish, each with
/// the sampling decision); returns what the spans need when sampled. Nothing when tracing is
/// off (the message is left as it was).
pub fn begin_publish(
    sink: &TraceSink,
    message: &mut OrderCreate,
    sending: Sending,
) -> Option<PublishTrace> {
    let ratio = sink.ratio()?;
    let (context, buyer) = match sending {
        Sending::Fresh => {
            let decided = ReservationContext::decide(
                message.traceparent.as_deref(),
                &message.message_id,
                ratio,
            );
            (decided.context, decided.parent)
        }
        Sending::Republish => {
            let reservation = ReservationContext::of_message(&message.message_id, ratio);
            (TraceContext { span_id: new_span_id(), ..reservation }, None)
        }
    };
    message.traceparent = Some(context.traceparent());
    if !context.sampled {
        return None;
    }
    Some(PublishTrace {
        sending,
        context,
        buyer,
        started: SystemTime::now(),
        reserved_at_ms: message.reserved_at_ms,
        request_id: message.request_id.clone(),
        reservation_id: message.reservation_id.clone(),
        message_id: message.message_id.clone(),
        activity_id: message.activity_id,
        sku_id: message.sku_id,
        user_id: message.user_id,
        retry_count: message.retry_count,
    })
}

/// Records the publish's spans (and a fresh reservation's own) as the wait ended.
pub fn end_publish(sink: &TraceSink, trace: Option<PublishTrace>, end: PublishEnd) {
    let Some(t) = trace else { return };
    let now = SystemTime::now();
    let ids = BusinessIds {
        request_id: Some(&t.request_id),
        reservation_id: &t.reservation_id,
        message_id: &t.message_id,
        order_id: None,
        activity_id: t.activity_id,
        sku_id: t.sku_id,
        user_id: t.user_id,
    };
    let mut publish = match t.sending {
        Sending::Fresh => {
            let own = TraceContext { span_id: new_span_id(), ..t.context };
            let parent = Parent::Local(t.context.span_id);
            SpanRecord::new(SpanName::Publish, own, parent, t.started, now)
        }
        Sending::Republish => {
            // The republish is in the trace the message id names, as is the span it links to.
            let reservation_span_id = MessageIds::of(&t.message_id).reservation_span_id;
            let mut span =
                SpanRecord::new(SpanName::Republish, t.context, Parent::Root, t.started, now);
            span.link = Some(TraceContext { span_id: reservation_span_id, ..t.context });
            span
        }
    };
    publish.ids(&ids);
    publish.attr("result_code", end.result_code());
    publish.attr("retry_count", i64::from(t.retry_count));
    publish.attr("messaging.system", "nats");
    publish.attr("messaging.destination.name", ORDER_CREATE_SUBJECT);
    publish.attr("messaging.message.id", t.message_id.clone());
    if end != PublishEnd::Acked {
        publish.error = Some("not acknowledged within the publish wait");
    }
    sink.record(publish);
    if t.sending == Sending::Fresh {
        let parent = t.buyer.map_or(Parent::Root, Parent::Remote);
        let start = at_ms(t.reserved_at_ms).min(t.started);
        let mut reservation = SpanRecord::new(SpanName::Reservation, t.context, parent, start, now);
        reservation.ids(&ids);
        let answer = if end == PublishEnd::Acked { "QUEUED" } else { "QUEUED_PENDING" };
        reservation.attr("result_code", answer);
        sink.record(reservation);
    }
}

/// Records a compensation's span (`inventory.compensate`) under the context its event
/// carries; `reply` is how `compensate` answered.
pub fn compensation(
    sink: &TraceSink,
    event: &ReservationEvent,
    reason_code: &str,
    compensation: Compensation,
    started: SystemTime,
    reply: &Result<CompensateReply, ScriptError>,
) {
    let Some(ratio) = sink.ratio() else { return };
    let Some(mut span) = SpanRecord::downstream(
        SpanName::Compensate,
        event.traceparent.as_deref(),
        &event.message_id,
        ratio,
        started,
        SystemTime::now(),
    ) else {
        return;
    };
    span.ids(&BusinessIds {
        request_id: Some(&event.request_id),
        reservation_id: &event.reservation_id,
        message_id: &event.message_id,
        order_id: event.order_id.as_deref(),
        activity_id: event.activity_id,
        sku_id: event.sku_id,
        user_id: event.user_id,
    });
    span.attr("result_code", reason_code.to_owned());
    span.attr("return_stock", compensation.return_stock);
    span.attr("release_user", compensation.release_user);
    let applied = match reply {
        Ok(CompensateReply::Applied { .. }) => "APPLIED",
        Ok(CompensateReply::AlreadyApplied) => "ALREADY_APPLIED",
        Err(_) => {
            span.error = Some("compensate failed; the event is redelivered");
            "FAILED"
        }
    };
    span.attr("compensation", applied);
    sink.record(span);
}
