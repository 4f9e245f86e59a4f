//! The receiving side: pulling deliveries from a durable consumer and settling each one.
//!
//! What it is: [`PullSource`] (one durable pull consumer) and [`Delivery`] (one received
//! message with its delivery count, stream sequence and publish time), with the four ways to
//! settle it: ack, NAK with a delay, TERM, and [`Publisher::dead_letter`] (copy to
//! `SECKILL_DLQ` with the error in a header, then the caller TERMs).
//!
//! Pulling: [`PullSource::fetch`] first asks for what is available now (a no-wait pull of up
//! to `max`); only when nothing is, it waits up to `wait` for ONE message and then tops the
//! batch up with another no-wait pull. So a busy consumer gets full batches without waiting
//! and an idle one answers a lone message at once, with no pull request left open behind it
//! (a dropped open request would strand a message until its ack wait).
//!
//! Every pull is bounded on the client too ([`PULL_ANSWER_GRACE`] beyond its own wait): a
//! pull request is held by the consumer's leader, and a leader killed while holding it never
//! answers (no 404, no 408), so without the bound the pull — and the order-writer task
//! awaiting it — would wait forever after a consumer-leader change (found by the drill in
//! `tests/tests/ha_log.rs`: submissions stayed closed by `BACKLOG_AGE`). The new leader
//! knows nothing of the dead one's requests, so giving one up strands nothing.
//!
//! What it is not: the decision of how to settle. That is the caller's (the worker's
//! sans-I/O classification). Acks are fire-and-forget publishes: a lost ack means a
//! redelivery, which the PostgreSQL inbox absorbs.
//!
//! Read next: `pg-worker/src/worker/order_writer_task.rs`.

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures::StreamExt;

use super::error::LogError;
use super::names::{
    DLQ_CONSUMER_HEADER, DLQ_DELIVERIES_HEADER, DLQ_ERROR_HEADER, DLQ_ORIGINAL_MSG_ID_HEADER,
    DLQ_STREAM_SEQUENCE_HEADER, DLQ_SUBJECT_HEADER, TRACEPARENT_HEADER,
};
use super::publisher::{PublishAck, Publisher};

/// Longest error text put into a dead letter's header (headers are one line each and count
/// against the server's max payload).
pub const DLQ_ERROR_LEN_MAX: usize = 1024;

/// How long a pull may go unanswered beyond its own wait before it is given up (an error:
/// the caller pauses and pulls again, reaching the new leader once there is one). A healthy
/// leader answers a pull in milliseconds, a saturated one well under a second; every second
/// more is a second the backlog waits after the election (5 s bound: submissions stayed
/// closed by `BACKLOG_AGE` ~4 s past the new leader; 2 s: see README "HA deployment").
pub const PULL_ANSWER_GRACE: Duration = Duration::from_secs(2);

/// One durable pull consumer.
#[derive(Clone)]
pub struct PullSource {
    consumer: PullConsumer,
    name: &'static str,
}

impl PullSource {
    pub(super) async fn bind(
        context: &jetstream::Context,
        stream: &'static str,
        durable: &'static str,
    ) -> Result<PullSource, LogError> {
        let consumer: PullConsumer =
            context.get_consumer_from_stream(durable, stream).await.map_err(|e| LogError::Api {
                op: "bind consumer",
                message: e.to_string(),
                transient: true,
            })?;
        Ok(PullSource { consumer, name: durable })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Up to `max` deliveries: whatever is available now, or (when nothing is) the first
    /// message to arrive within `wait` plus whatever is available right after it. Empty when
    /// nothing arrived within `wait`.
    pub async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>, LogError> {
        let mut out = Vec::with_capacity(max);
        if max == 0 {
            return Ok(out);
        }
        let result = self.fetch_into(max, wait, &mut out).await;
        match result {
            // What arrived before an error is handed over and settled as usual (dropping it
            // would leave it unacked until its ack wait).
            Err(e) if !out.is_empty() => {
                tracing::warn!(consumer = self.name, error = %e, kept = out.len(), "pull cut short");
                Ok(out)
            }
            Err(e) => Err(e),
            Ok(()) => Ok(out),
        }
    }

    async fn fetch_into(
        &self,
        max: usize,
        wait: Duration,
        out: &mut Vec<Delivery>,
    ) -> Result<(), LogError> {
        self.fetch_available(max, out).await?;
        if out.is_empty() && !wait.is_zero() {
            let waiting = async {
                let mut batch = self
                    .consumer
                    .batch()
                    .max_messages(1)
                    .expires(wait)
                    .messages()
                    .await
                    .map_err(|e| self.fetch_error(e))?;
                while let Some(message) = batch.next().await {
                    out.push(Delivery::new(message.map_err(|e| self.fetch_error(e))?)?);
                }
                Ok::<(), LogError>(())
            };
            self.bounded(wait + PULL_ANSWER_GRACE, waiting).await?;
            if !out.is_empty() && max > 1 {
                self.fetch_available(max - 1, out).await?;
            }
        }
        Ok(())
    }

    async fn fetch_available(&self, max: usize, out: &mut Vec<Delivery>) -> Result<(), LogError> {
        let pull = async {
            let mut batch = self
                .consumer
                .fetch()
                .max_messages(max)
                .messages()
                .await
                .map_err(|e| self.fetch_error(e))?;
            while let Some(message) = batch.next().await {
                out.push(Delivery::new(message.map_err(|e| self.fetch_error(e))?)?);
            }
            Ok(())
        };
        self.bounded(PULL_ANSWER_GRACE, pull).await
    }

    /// `pull` within `bound`, else a fetch error (see [`PULL_ANSWER_GRACE`]). Deliveries it
    /// received before the bound stay in the caller's batch and are settled as usual.
    async fn bounded(
        &self,
        bound: Duration,
        pull: impl std::future::Future<Output = Result<(), LogError>>,
    ) -> Result<(), LogError> {
        match tokio::time::timeout(bound, pull).await {
            Ok(result) => result,
            Err(_) => Err(self.fetch_error(format!(
                "no answer to the pull within {bound:?} (the consumer's leader may have changed)"
            ))),
        }
    }

    fn fetch_error(&self, e: impl std::fmt::Display) -> LogError {
        LogError::Fetch { consumer: self.name, message: e.to_string() }
    }
}

/// One received message.
pub struct Delivery {
    message: jetstream::Message,
    delivered: u32,
    stream_sequence: u64,
    published_ms: u64,
}

impl Delivery {
    fn new(message: jetstream::Message) -> Result<Delivery, LogError> {
        let info = message.info().map_err(|e| LogError::Fetch {
            consumer: "unknown",
            message: format!("delivery without JetStream metadata: {e}"),
        })?;
        let delivered = u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX);
        let stream_sequence = info.stream_sequence;
        let published_ms =
            u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
        Ok(Delivery { message, delivered, stream_sequence, published_ms })
    }

    pub fn payload(&self) -> &Bytes {
        &self.message.payload
    }

    /// This delivery's number, from 1 (the server's count, redeliveries included).
    pub fn delivered(&self) -> u32 {
        self.delivered
    }

    pub fn stream_sequence(&self) -> u64 {
        self.stream_sequence
    }

    /// When the server stored the message (ms since the Unix epoch).
    pub fn published_ms(&self) -> u64 {
        self.published_ms
    }

    /// A header's value, if present and valid text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.message.headers.as_ref()?.get(name).map(|v| v.as_str())
    }

    /// The subject it was published to.
    pub fn subject(&self) -> &str {
        self.message.subject.as_str()
    }

    pub fn msg_id(&self) -> Option<&str> {
        self.header("Nats-Msg-Id")
    }

    pub fn traceparent(&self) -> Option<&str> {
        self.header(TRACEPARENT_HEADER)
    }

    /// Done: the server forgets the message.
    pub async fn ack(&self) -> Result<(), LogError> {
        self.message.ack().await.map_err(|e| LogError::Ack { kind: "ack", message: e.to_string() })
    }

    /// Not now: redeliver after `delay` (counts as a delivery).
    pub async fn nak(&self, delay: Duration) -> Result<(), LogError> {
        self.message
            .ack_with(AckKind::Nak(Some(delay)))
            .await
            .map_err(|e| LogError::Ack { kind: "nak", message: e.to_string() })
    }

    /// Still working on it: restarts the server's ack wait (a batch held while the database
    /// is away keeps its messages instead of having them redelivered elsewhere).
    pub async fn in_progress(&self) -> Result<(), LogError> {
        self.message
            .ack_with(AckKind::Progress)
            .await
            .map_err(|e| LogError::Ack { kind: "in-progress", message: e.to_string() })
    }

    /// Never: stop redelivering (after a dead letter was written).
    pub async fn term(&self) -> Result<(), LogError> {
        self.message
            .ack_with(AckKind::Term)
            .await
            .map_err(|e| LogError::Ack { kind: "term", message: e.to_string() })
    }
}

impl Publisher {
    /// Copies `delivery` to `seckill.dlq.<consumer>` with the original body and the error,
    /// consumer, delivery count, stream sequence, source subject and original `Nats-Msg-Id`
    /// in headers. Its own
    /// `Nats-Msg-Id` is `dlq_<consumer>_<stream_seq>`, so a crash between this publish and the
    /// TERM that follows it does not dead-letter the message twice. The caller TERMs the
    /// delivery only after this returns `Ok`.
    pub async fn dead_letter(
        &self,
        delivery: &Delivery,
        consumer: &str,
        error: &str,
    ) -> Result<PublishAck, LogError> {
        let subject = format!("seckill.dlq.{consumer}");
        let msg_id = format!("dlq_{consumer}_{}", delivery.stream_sequence());
        let error = header_text(error, DLQ_ERROR_LEN_MAX);
        let deliveries = delivery.delivered().to_string();
        let sequence = delivery.stream_sequence().to_string();
        let mut headers: Vec<(&str, &str)> = vec![
            (DLQ_ERROR_HEADER, &error),
            (DLQ_CONSUMER_HEADER, consumer),
            (DLQ_DELIVERIES_HEADER, &deliveries),
            (DLQ_STREAM_SEQUENCE_HEADER, &sequence),
            (DLQ_SUBJECT_HEADER, delivery.subject()),
        ];
        if let Some(original) = delivery.msg_id() {
            headers.push((DLQ_ORIGINAL_MSG_ID_HEADER, original));
        }
        self.publish(
            &subject,
            &msg_id,
            delivery.traceparent(),
            &headers,
            delivery.payload().clone(),
        )
        .await
    }
}

/// `text` made safe for a header value: control characters (CR/LF would end the header line)
/// become spaces, and it is cut to `len_max` bytes on a character boundary.
pub fn header_text(text: &str, len_max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(len_max));
    for c in text.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > len_max {
            break;
        }
        out.push(c);
    }
    let trimmed = out.trim();
    if trimmed.is_empty() {
        return "unknown error".to_owned();
    }
    trimmed.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_text_is_one_bounded_line() {
        assert_eq!(header_text("a\r\nb", 100), "a  b");
        assert_eq!(header_text("  \n ", 100), "unknown error");
        assert_eq!(header_text("ééé", 5), "éé");
        assert_eq!(header_text(&"x".repeat(5000), DLQ_ERROR_LEN_MAX).len(), DLQ_ERROR_LEN_MAX);
    }
}
