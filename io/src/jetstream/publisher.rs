//! Publishing to JetStream with the business dedup key.
//!
//! What it is: [`Publisher`], a cheap clonable handle used from tokio. Every publish sets
//! `Nats-Msg-Id` (the order-create `message_id`, `evt_<event_id>` for outbox events,
//! `dlq_<consumer>_<stream_seq>` for dead letters) and `traceparent` when known, then awaits
//! the server's ack. The whole call, retries included, is bounded by `publish_timeout_ms`; a
//! timeout is reported as "outcome unknown" (the message may be in the stream), never as a
//! failure that would justify a new id. "No stream found" (the 503 a publish gets while a
//! stream changes leader) is retried with doubling pauses inside the same deadline. The
//! number of acks outstanding is bounded by the context (`publish_acks_outstanding_max`): a
//! publish past the bound waits for a slot within its deadline.
//!
//! What it is not: a retry policy for the business. After a timeout the edge answers
//! `QUEUED_PENDING` and the republish scanner retries with the same id (DESIGN.md section 4).
//!
//! Read next: `consumer.rs` (the receiving side and dead letters).

use std::time::Duration;

use async_nats::header::{HeaderMap, NATS_MESSAGE_ID};
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self};
use bytes::Bytes;
use tokio::time::Instant;

use super::config::LogConfig;
use super::error::LogError;
use super::names::{ORDER_CREATE_SUBJECT, TRACEPARENT_HEADER};
use crate::wire::{EventType, OrderCreate};

/// Longest pause between "no stream found" retries.
const NO_STREAM_RETRY_MAX: Duration = Duration::from_millis(500);

/// What the server said about an accepted publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishAck {
    /// The `Nats-Msg-Id` was seen within the dedup window: nothing new was stored (the first
    /// publish's sequence is returned).
    pub duplicate: bool,
    /// Stream sequence of the stored message.
    pub sequence: u64,
}

/// Publishes with `Nats-Msg-Id`; see the module documentation. Clone per task.
#[derive(Clone)]
pub struct Publisher {
    context: jetstream::Context,
    timeout: Duration,
    no_stream_retry: Duration,
}

impl Publisher {
    pub(super) fn new(context: jetstream::Context, config: &LogConfig) -> Publisher {
        Publisher {
            context,
            timeout: Duration::from_millis(config.publish_timeout_ms),
            no_stream_retry: Duration::from_millis(config.no_stream_retry_ms),
        }
    }

    /// Publishes an order-create message to `seckill.order.create` with
    /// `Nats-Msg-Id = message_id` (the edge's call, from its tokio side).
    pub async fn publish_order(&self, message: &OrderCreate) -> Result<PublishAck, LogError> {
        self.publish_order_as(message, &message.message_id).await
    }

    /// [`Publisher::publish_order`] under another `Nats-Msg-Id` (the scanner's republish of a
    /// message the log already acknowledged, which the duplicate window must not swallow).
    pub async fn publish_order_as(
        &self,
        message: &OrderCreate,
        msg_id: &str,
    ) -> Result<PublishAck, LogError> {
        let body = Bytes::from(message.encode());
        self.publish(ORDER_CREATE_SUBJECT, msg_id, message.traceparent.as_deref(), &[], body).await
    }

    /// Publishes an outbox event to `seckill.event.<type>` with `Nats-Msg-Id = evt_<event_id>`.
    pub async fn publish_event(
        &self,
        event_id: i64,
        event_type: EventType,
        payload: Bytes,
        traceparent: Option<&str>,
    ) -> Result<PublishAck, LogError> {
        let msg_id = event_msg_id(event_id);
        self.publish(event_type.subject(), &msg_id, traceparent, &[], payload).await
    }

    /// Publishes `payload` to `subject` with `Nats-Msg-Id = msg_id`, `traceparent` when given
    /// and the extra headers, and waits for the ack (see the module documentation).
    pub async fn publish(
        &self,
        subject: &str,
        msg_id: &str,
        traceparent: Option<&str>,
        extra_headers: &[(&str, &str)],
        payload: Bytes,
    ) -> Result<PublishAck, LogError> {
        let deadline = Instant::now() + self.timeout;
        let mut pause = self.no_stream_retry;
        loop {
            let headers = headers(msg_id, traceparent, extra_headers);
            let attempt = async {
                let ack = self
                    .context
                    .publish_with_headers(subject.to_owned(), headers, payload.clone())
                    .await?;
                ack.await
            };
            let error = match tokio::time::timeout_at(deadline, attempt).await {
                Err(_elapsed) => return Err(self.timed_out(subject)),
                Ok(Ok(ack)) => {
                    return Ok(PublishAck { duplicate: ack.duplicate, sequence: ack.sequence })
                }
                Ok(Err(error)) => error,
            };
            match error.kind() {
                PublishErrorKind::StreamNotFound => {
                    // A leader change (or streams not yet created): retry within the deadline.
                    if Instant::now() + pause >= deadline {
                        return Err(LogError::NoStream { subject: subject.to_owned() });
                    }
                    tracing::debug!(subject, msg_id, "publish found no stream; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(NO_STREAM_RETRY_MAX);
                }
                PublishErrorKind::TimedOut => return Err(self.timed_out(subject)),
                kind => return Err(refused(subject, kind, &error)),
            }
        }
    }

    fn timed_out(&self, subject: &str) -> LogError {
        LogError::PublishTimeout {
            subject: subject.to_owned(),
            timeout_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

/// The headers of one publish attempt: `Nats-Msg-Id`, `traceparent` when known, the extras.
fn headers(msg_id: &str, traceparent: Option<&str>, extra_headers: &[(&str, &str)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    // Negative control (tests/tests/negative_controls.rs): no `Nats-Msg-Id`, so the
    // stream's duplicate window cannot recognise a republish.
    #[cfg(feature = "failpoints")]
    let omit_msg_id = crate::negctl::switched_off("negctl.nats_msg_id_off");
    #[cfg(not(feature = "failpoints"))]
    let omit_msg_id = false;
    if !omit_msg_id {
        headers.insert(NATS_MESSAGE_ID, msg_id);
    }
    if let Some(traceparent) = traceparent {
        headers.insert(TRACEPARENT_HEADER, traceparent);
    }
    for (name, value) in extra_headers {
        headers.insert(*name, *value);
    }
    headers
}

/// A publish the server refused (not a timeout, not "no stream").
fn refused(subject: &str, kind: PublishErrorKind, error: &PublishError) -> LogError {
    // Payload too large or a conditional-publish mismatch repeat on every try; everything
    // else (broken pipe, a JetStream error such as a full or leaderless stream) may clear.
    let transient = !matches!(
        kind,
        PublishErrorKind::MaxPayloadExceeded
            | PublishErrorKind::WrongLastMessageId
            | PublishErrorKind::WrongLastSequence
    );
    LogError::Publish { subject: subject.to_owned(), message: error.to_string(), transient }
}

/// `evt_<event_id>`: the dedup key of an outbox event.
pub fn event_msg_id(event_id: i64) -> String {
    format!("evt_{event_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_ids_are_prefixed() {
        assert_eq!(event_msg_id(42), "evt_42");
    }
}
