//! The outbox events of a batch's committed outcomes, as the one `INSERT` both ways of writing
//! a batch send before COMMIT (`sql::INSERT_EVENTS_SQL`).
//!
//! What it is: [`EventColumns`], the events `classify::event_for` gives each outcome, as three
//! parallel arrays in message order (so event ids follow it).
//!
//! What it is not: which event an outcome announces (`classify.rs`), or their publishing
//! (`outbox.rs`).
//!
//! Read next: `classify.rs` (`event_for`), `outbox.rs`.

use flashsale_io::wire::OrderCreate;
use tokio_postgres::types::ToSql;

use crate::classify::{event_for, WriteOutcome};
use crate::error::PgError;

/// The outbox rows of a batch's committed outcomes, as the three parallel arrays
/// `INSERT_EVENTS_SQL` takes, in message order (so event ids follow it).
pub(crate) struct EventColumns<'a> {
    aggregate_ids: Vec<&'a str>,
    event_types: Vec<&'static str>,
    payloads: Vec<String>,
}

impl<'a> EventColumns<'a> {
    pub(crate) fn new(
        messages: &[&'a OrderCreate],
        outcomes: &[WriteOutcome],
        now_ms: u64,
    ) -> Result<EventColumns<'a>, PgError> {
        let mut columns = EventColumns {
            aggregate_ids: Vec::with_capacity(messages.len()),
            event_types: Vec::with_capacity(messages.len()),
            payloads: Vec::with_capacity(messages.len()),
        };
        for (message, outcome) in messages.iter().zip(outcomes) {
            if let Some(event) = event_for(message, outcome, now_ms) {
                columns.aggregate_ids.push(&message.reservation_id);
                columns.event_types.push(event.event_type.as_str());
                columns.payloads.push(
                    serde_json::to_string(&event)
                        .map_err(|_| PgError::InvalidArgument("event does not serialize"))?,
                );
            }
        }
        Ok(columns)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.payloads.is_empty()
    }

    pub(crate) fn args(&self) -> [&(dyn ToSql + Sync); 3] {
        [&self.aggregate_ids, &self.event_types, &self.payloads]
    }
}
