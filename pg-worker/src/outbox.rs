//! The outbox publisher: moves committed `event_outbox` rows to `SECKILL_EVENTS`.
//!
//! What it is: [`publish_once`], one round: in a transaction, lock the oldest unpublished
//! events nobody else holds (`FOR UPDATE SKIP LOCKED`, at most `batch_max`), publish them all
//! concurrently with `Nats-Msg-Id = evt_<event_id>` (and the event's `traceparent`), mark the
//! acknowledged ones published, commit. Several publishers (threads or processes) can run side
//! by side: SKIP LOCKED gives each a disjoint batch, and `published_at IS NULL` in the marking
//! statement makes a second marking impossible. A crash after publishing and before COMMIT
//! republishes the same events with the same message ids: JetStream drops the duplicates
//! inside its window, and `redis-sync` applies each event idempotently after it.
//!
//! What it is not: the loop or its pacing (`worker/outbox_task.rs`), nor an ordering guarantee across
//! publishers (events of one reservation are produced by one transaction, and `redis-sync`'s
//! Lua functions are order-tolerant: a final outcome is never overwritten).
//!
//! Read next: `io/src/jetstream/publisher.rs`.

use bytes::Bytes;
use flashsale_io::jetstream::Publisher;
use flashsale_io::wire::EventType;
use serde::Deserialize;

use crate::error::PgError;
use crate::sql;

/// What one round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboxRound {
    /// Events locked by this round (the batch size it saw).
    pub claimed: usize,
    /// Event ids acknowledged by JetStream and marked published by this round, ascending.
    pub published: Vec<i64>,
    /// Rows the marking statement changed; equals `published.len()` unless another
    /// publisher marked one of our locked rows, which SKIP LOCKED makes impossible.
    pub marked: u64,
    /// Events whose publish failed this round (retried next round).
    pub failed: usize,
}

/// The only field of a payload the publisher reads itself.
#[derive(Deserialize)]
struct TraceOnly {
    #[serde(default)]
    traceparent: Option<String>,
}

/// One round; see the module documentation. `batch_max` must not exceed the log's
/// outstanding-ack bound (the worker config checks it).
pub async fn publish_once(
    client: &mut deadpool_postgres::Client,
    publisher: &Publisher,
    batch_max: usize,
) -> Result<OutboxRound, PgError> {
    let claim = client.prepare_cached(sql::CLAIM_UNPUBLISHED_SQL).await?;
    let mark = client.prepare_cached(sql::MARK_PUBLISHED_SQL).await?;
    let limit = i64::try_from(batch_max).unwrap_or(i64::MAX);
    let tx = client.transaction().await?;
    let rows = tx.query(&claim, &[&limit]).await?;
    let mut round = OutboxRound { claimed: rows.len(), ..OutboxRound::default() };
    if rows.is_empty() {
        tx.commit().await?;
        return Ok(round);
    }
    let mut events = Vec::with_capacity(rows.len());
    for row in &rows {
        let event_id: i64 = row.try_get(0)?;
        let event_type: &str = row.try_get(1)?;
        let payload: String = row.try_get(2)?;
        match EventType::parse(event_type) {
            Some(event_type) => events.push((event_id, event_type, payload)),
            // The table's CHECK allows only known types; a newer build's type stays unpublished
            // (visible in flashsale_outbox_backlog) rather than being sent somewhere wrong.
            None => tracing::error!(event_id, event_type, "outbox event of unknown type"),
        }
    }
    let publishes = events.into_iter().map(|(event_id, event_type, payload)| async move {
        let traceparent =
            serde_json::from_str::<TraceOnly>(&payload).ok().and_then(|t| t.traceparent);
        let result = publisher
            .publish_event(event_id, event_type, Bytes::from(payload), traceparent.as_deref())
            .await;
        (event_id, result)
    });
    for (event_id, result) in futures::future::join_all(publishes).await {
        match result {
            Ok(_) => round.published.push(event_id),
            Err(error) => {
                round.failed += 1;
                tracing::warn!(event_id, %error, "outbox publish failed; retried next round");
            }
        }
    }
    if !round.published.is_empty() {
        round.marked = tx.execute(&mark, &[&round.published]).await?;
        if round.marked != round.published.len() as u64 {
            tracing::error!(
                marked = round.marked,
                published = round.published.len(),
                "outbox rows marked by someone else while locked by this publisher"
            );
        }
    }
    tx.commit().await?;
    Ok(round)
}

/// `flashsale_outbox_backlog`: unpublished events.
pub async fn backlog(client: &deadpool_postgres::Client) -> Result<i64, PgError> {
    let statement = client.prepare_cached(sql::OUTBOX_BACKLOG_SQL).await?;
    Ok(client.query_one(&statement, &[]).await?.try_get(0)?)
}
