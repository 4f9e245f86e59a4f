//! Dead letters for an operator (`flashsale admin dlq`, CONTRACT.md section 6): `SECKILL_DLQ`
//! listed in stream order with the headers [`Publisher::dead_letter`] wrote, one replayed to
//! the subject it came from, or one discarded.
//!
//! Replay publishes the dead letter's body unchanged to its source subject (the
//! [`DLQ_SUBJECT_HEADER`]) under `Nats-Msg-Id dlq-replay-<dlq sequence>`, then deletes the dead
//! letter. Why that is safe to repeat: a second replay of the same dead letter inside the
//! duplicate window is dropped by the stream (same id); after the delete there is nothing left
//! to replay; and what the consumer does with the body is idempotent by its own keys (the
//! order-writer's inbox is keyed by the body's message id, redis-sync's functions by the
//! reservation). A replay is one more delivery, never a second effect.
//!
//! What it is not: a decision about which dead letters to replay (an operator's, after fixing
//! the cause), or a reader of the bodies (`wire/`).

use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use bytes::Bytes;

use super::client::Log;
use super::error::LogError;
use super::names::{
    DLQ_CONSUMER_HEADER, DLQ_DELIVERIES_HEADER, DLQ_ERROR_HEADER, DLQ_ORIGINAL_MSG_ID_HEADER,
    DLQ_STREAM, DLQ_STREAM_SEQUENCE_HEADER, DLQ_SUBJECT_HEADER, TRACEPARENT_HEADER,
};
use super::publisher::Publisher;

/// Sequences one listing looks at (deleted ones leave gaps), whatever `limit` says.
pub const DLQ_SCAN_MAX: u64 = 10_000;

/// One dead letter as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// Its sequence in `SECKILL_DLQ` (the handle replay and discard take).
    pub sequence: u64,
    /// When `SECKILL_DLQ` stored it (ms since the Unix epoch).
    pub stored_ms: u64,
    pub consumer: Option<String>,
    pub error: Option<String>,
    pub deliveries: Option<u32>,
    /// The message's sequence in its source stream.
    pub source_sequence: Option<u64>,
    /// The subject it was consumed from (`None`: written before the header existed).
    pub source_subject: Option<String>,
    pub original_msg_id: Option<String>,
    pub traceparent: Option<String>,
    pub payload: Bytes,
}

/// A page of dead letters, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeadLetterPage {
    /// Dead letters in the stream now.
    pub count: u64,
    pub letters: Vec<DeadLetter>,
    /// The sequence to continue from (`after`) when more may follow.
    pub next_after: Option<u64>,
}

/// What [`Log::replay_dead_letter`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replay {
    /// Published to `subject` (a `duplicate` ack: the stream already had this replay) and the
    /// dead letter deleted.
    Replayed { subject: String, sequence: u64, duplicate: bool },
    /// No dead letter with this sequence (never, or already replayed or discarded).
    NotFound,
    /// The dead letter does not say where it came from (or names a subject no consumer
    /// reads): nothing published, the dead letter kept.
    NoSourceSubject,
}

impl Log {
    async fn dlq(&self) -> Result<Stream, LogError> {
        self.context().get_stream(DLQ_STREAM).await.map_err(|e| api("get the DLQ stream", e))
    }

    /// Up to `limit` dead letters with a sequence above `after`, oldest first.
    pub async fn dead_letters(&self, after: u64, limit: usize) -> Result<DeadLetterPage, LogError> {
        let stream = self.dlq().await?;
        let state = stream.get_info().await.map_err(|e| api("DLQ info", e))?.state;
        let mut page = DeadLetterPage { count: state.messages, ..DeadLetterPage::default() };
        let first = state.first_sequence.max(after.saturating_add(1));
        let last = state.last_sequence.min(first.saturating_add(DLQ_SCAN_MAX - 1));
        let mut sequence = first;
        while sequence <= last && page.letters.len() < limit {
            if let Some(letter) = read(&stream, sequence).await? {
                page.letters.push(letter);
            }
            sequence += 1;
        }
        if sequence <= state.last_sequence {
            page.next_after = Some(sequence - 1);
        }
        Ok(page)
    }

    /// One dead letter (`None`: no such sequence, or it was deleted).
    pub async fn dead_letter(&self, sequence: u64) -> Result<Option<DeadLetter>, LogError> {
        read(&self.dlq().await?, sequence).await
    }

    /// Replays one dead letter (see the module documentation), publishing with `publisher`.
    pub async fn replay_dead_letter(
        &self,
        publisher: &Publisher,
        sequence: u64,
    ) -> Result<Replay, LogError> {
        let stream = self.dlq().await?;
        let Some(letter) = read(&stream, sequence).await? else { return Ok(Replay::NotFound) };
        let Some(subject) = letter.source_subject.filter(|s| is_replayable_subject(s)) else {
            return Ok(Replay::NoSourceSubject);
        };
        let msg_id = format!("dlq-replay-{sequence}");
        let ack = publisher
            .publish(&subject, &msg_id, letter.traceparent.as_deref(), &[], letter.payload)
            .await?;
        let replayed =
            Replay::Replayed { subject, sequence: ack.sequence, duplicate: ack.duplicate };
        // Drill (tests/tests/stuck_dlq.rs): a crash between the publish and the delete leaves
        // the dead letter; a second replay must then be dropped by the stream as a duplicate.
        #[cfg(feature = "failpoints")]
        if crate::negctl::switched_off("dlq.keep_after_replay") {
            return Ok(replayed);
        }
        delete(&stream, sequence).await?;
        Ok(replayed)
    }

    /// Deletes one dead letter; `false` when there was none with this sequence.
    pub async fn discard_dead_letter(&self, sequence: u64) -> Result<bool, LogError> {
        let stream = self.dlq().await?;
        if read(&stream, sequence).await?.is_none() {
            return Ok(false);
        }
        delete(&stream, sequence).await
    }
}

/// A subject one of the consumers reads (orders or events), never the DLQ's own.
fn is_replayable_subject(subject: &str) -> bool {
    subject.starts_with("seckill.") && !subject.starts_with("seckill.dlq.")
}

async fn read(stream: &Stream, sequence: u64) -> Result<Option<DeadLetter>, LogError> {
    let message = match stream.get_raw_message(sequence).await {
        Ok(message) => message,
        Err(e) if matches!(e.kind(), LastRawMessageErrorKind::NoMessageFound) => return Ok(None),
        Err(e) => return Err(api("read a dead letter", e)),
    };
    let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
    Ok(Some(DeadLetter {
        sequence: message.sequence,
        stored_ms: u64::try_from(message.time.unix_timestamp_nanos() / 1_000_000).unwrap_or(0),
        consumer: header(DLQ_CONSUMER_HEADER),
        error: header(DLQ_ERROR_HEADER),
        deliveries: header(DLQ_DELIVERIES_HEADER).and_then(|v| v.parse().ok()),
        source_sequence: header(DLQ_STREAM_SEQUENCE_HEADER).and_then(|v| v.parse().ok()),
        source_subject: header(DLQ_SUBJECT_HEADER),
        original_msg_id: header(DLQ_ORIGINAL_MSG_ID_HEADER),
        traceparent: header(TRACEPARENT_HEADER),
        payload: message.payload,
    }))
}

async fn delete(stream: &Stream, sequence: u64) -> Result<bool, LogError> {
    stream.delete_message(sequence).await.map_err(|e| api("delete a dead letter", e))
}

fn api(op: &'static str, e: impl std::fmt::Display) -> LogError {
    LogError::Api { op, message: e.to_string(), transient: true }
}

#[cfg(test)]
mod tests {
    use super::is_replayable_subject;

    #[test]
    fn only_consumed_subjects_are_replayed() {
        assert!(is_replayable_subject("seckill.order.create"));
        assert!(is_replayable_subject("seckill.event.reservation_failed"));
        assert!(!is_replayable_subject("seckill.dlq.order-writer"));
        assert!(!is_replayable_subject("other.subject"));
    }
}
