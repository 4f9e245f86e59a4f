//! Dead letters, for an operator (CONTRACT.md section 4; `flashsale admin dlq`): the admin
//! routes over `flashsale_io::jetstream`'s dead-letter calls, run on the durable side.
//!
//! - `GET /admin/v1/dlq[?after=SEQ]`: up to [`LISTED_MAX`] dead letters, oldest first, each
//!   with its consumer, error, deliveries, source subject and sequence, original message id
//!   and body (as text when it is UTF-8);
//! - `POST /admin/v1/dlq/{seq}` with `{"action":"replay"|"discard"}`: replay publishes the
//!   body to its source subject again and deletes the dead letter (why a repeat does nothing
//!   twice: `io/src/jetstream/dlq.rs`); discard deletes it.
//!
//! Fix the cause first: a message replayed into the same failure comes back as a new dead
//! letter after its deliveries.

use flashsale_io::jetstream::{DeadLetter, Replay};
use serde::Deserialize;
use serde_json::json;

use crate::http::Status;
use crate::logic::ids::parse_decimal_u64;
use crate::shard::reply::error;
use crate::shard::shared::EdgeShared;

/// Dead letters one list answer holds; `next_after` continues.
pub const LISTED_MAX: usize = 100;

/// `GET /admin/v1/dlq[?after=SEQ]`
pub async fn list(shared: &EdgeShared, query: Option<&str>) -> (Status, String) {
    let after = match query.unwrap_or("") {
        "" => 0,
        q => match q.strip_prefix("after=").and_then(|n| parse_decimal_u64(n.as_bytes())) {
            Some(after) => after,
            None => return error(Status::BadRequest, "QUERY_INVALID"),
        },
    };
    let listed = shared
        .durable
        .log(move |log, _| async move { log.dead_letters(after, LISTED_MAX).await })
        .await;
    match listed {
        Ok(page) => {
            let letters: Vec<_> = page.letters.iter().map(describe).collect();
            let body = json!({
                "count": page.count,
                "listed": letters.len(),
                "next_after": page.next_after,
                "dead_letters": letters,
            });
            (Status::Ok, body.to_string())
        }
        Err(e) => {
            tracing::warn!(error = %e, "listing dead letters failed");
            error(Status::ServiceUnavailable, "LOG_UNAVAILABLE")
        }
    }
}

fn describe(letter: &DeadLetter) -> serde_json::Value {
    json!({
        "sequence": letter.sequence,
        "stored_ms": letter.stored_ms,
        "consumer": letter.consumer,
        "error": letter.error,
        "deliveries": letter.deliveries,
        "source_subject": letter.source_subject,
        "source_sequence": letter.source_sequence,
        "original_msg_id": letter.original_msg_id,
        "replayable": letter.source_subject.is_some(),
        "body": std::str::from_utf8(&letter.payload).ok(),
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ActionBody {
    action: Action,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Action {
    Replay,
    Discard,
}

/// `POST /admin/v1/dlq/{seq}`
pub async fn act(shared: &EdgeShared, sequence: &str, body: &[u8]) -> (Status, String) {
    let Some(sequence) = parse_decimal_u64(sequence.as_bytes()) else {
        return error(Status::BadRequest, "SEQUENCE_INVALID");
    };
    if sequence == 0 {
        // Stream sequences start at 1: there is no dead letter 0 to ask the log about.
        return error(Status::NotFound, "NO_SUCH_DEAD_LETTER");
    }
    let Ok(ActionBody { action }) = serde_json::from_slice::<ActionBody>(body) else {
        return error(Status::BadRequest, "ACTION_INVALID");
    };
    let durable = &shared.durable;
    match action {
        Action::Replay => {
            let replayed = durable
                .log(move |log, publisher| async move {
                    log.replay_dead_letter(&publisher, sequence).await
                })
                .await;
            match replayed {
                Ok(Replay::Replayed { subject, sequence: at, duplicate }) => {
                    tracing::info!(dlq_sequence = sequence, %subject, duplicate, "dead letter replayed");
                    let body = json!({
                        "resolution": "REPLAYED",
                        "subject": subject,
                        "stream_sequence": at,
                        "duplicate": duplicate,
                    });
                    (Status::Accepted, body.to_string())
                }
                Ok(Replay::NotFound) => error(Status::NotFound, "NO_SUCH_DEAD_LETTER"),
                Ok(Replay::NoSourceSubject) => error(Status::Conflict, "SOURCE_SUBJECT_UNKNOWN"),
                Err(e) => {
                    tracing::warn!(error = %e, dlq_sequence = sequence, "replaying a dead letter failed");
                    error(Status::ServiceUnavailable, "LOG_UNAVAILABLE")
                }
            }
        }
        Action::Discard => {
            let discarded = durable
                .log(move |log, _| async move { log.discard_dead_letter(sequence).await })
                .await;
            match discarded {
                Ok(true) => {
                    tracing::warn!(dlq_sequence = sequence, "dead letter discarded by an operator");
                    (Status::Ok, json!({"resolution": "DISCARDED"}).to_string())
                }
                Ok(false) => error(Status::NotFound, "NO_SUCH_DEAD_LETTER"),
                Err(e) => {
                    tracing::warn!(error = %e, dlq_sequence = sequence, "discarding a dead letter failed");
                    error(Status::ServiceUnavailable, "LOG_UNAVAILABLE")
                }
            }
        }
    }
}
