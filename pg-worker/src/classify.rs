//! What becomes of one order-create delivery, decided without I/O.
//!
//! What it is: the outcome types the order transaction produces ([`WriteOutcome`]), the event
//! each outcome announces ([`event_for`]), and the settlement of each delivery ([`classify`]):
//! ack, NAK with a delay, or dead-letter then TERM. The rules (DESIGN.md section 5):
//!
//! - committed outcomes (order created, rejected, duplicate) → ack (the caller acks only after
//!   COMMIT succeeded);
//! - undecodable body or unknown `schema_version` → dead letter at once (the same bytes fail
//!   the same way every time);
//! - claim contended / transient database error / batch not committed → NAK with a delay,
//!   unless this was the last delivery the consumer allows (`max_deliver`): then dead letter
//!   with the last error, because the server will not deliver it again and a message left
//!   unacked would sit in the work queue forever;
//! - a database error not known to be transient is retried the same way: a bug or a schema
//!   drift should get the redeliveries' time to be noticed, and `max_deliver` still bounds it
//!   (the asymmetry argued in `error.rs`).
//!
//! What it is not: the transaction, the acks or the publishing (`order_path.rs`,
//! `worker/`). No clock: `now_ms` and delivery counts are arguments.
//!
//! Read next: `order_path.rs`.

use flashsale_io::wire::{DecodeError, OrderCreate, RejectReason, ReservationEvent};

use crate::compensation::RejectedEvent;

/// The result of one message inside the batch transaction. Only meaningful to settle if the
/// transaction committed (see [`Attempt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Order created; the tokens it holds, one per unit in seq order (none for the ROW
    /// allocator).
    Created { order_id: String, token_ids: Vec<String>, claim_us: Option<i64> },
    /// Reservation ended without an order.
    Rejected { reason: RejectReason, claim_us: Option<i64> },
    /// The inbox (or the reservation table) already had this message: nothing written; the
    /// recorded outcome is re-announced.
    Duplicate { recorded: Recorded },
    /// Every AVAILABLE token is locked by other transactions right now; nothing written.
    Contended,
    /// This message's statement failed; the batch was redone without it (nothing of it
    /// committed).
    Failed { transient: bool, error: String },
}

/// The outcome a duplicate found recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    Created {
        order_id: String,
    },
    Rejected(RejectReason),
    /// No final outcome recorded (cannot happen after a commit: every message ends final in
    /// its own transaction). Nothing is re-announced.
    Unresolved,
}

impl WriteOutcome {
    /// Whether this outcome's writes are part of the batch's commit.
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            WriteOutcome::Created { .. }
                | WriteOutcome::Rejected { .. }
                | WriteOutcome::Duplicate { .. }
        )
    }
}

/// What happened to one delivery this time.
#[derive(Debug, Clone, Copy)]
pub enum Attempt<'a> {
    /// The body could not be decoded (malformed, unknown schema, invalid field).
    Undecodable(&'a DecodeError),
    /// The batch committed; this is the message's outcome in it.
    Written(&'a WriteOutcome),
    /// The batch did not commit, or whether it did is unknown (connection lost at COMMIT).
    BatchFailed { transient: bool, error: &'a str },
}

/// How to settle a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Ack,
    Nak {
        delay_ms: u64,
    },
    /// Publish to `SECKILL_DLQ` with this error, then TERM (NAK if the DLQ publish fails).
    DeadLetter {
        error: String,
    },
}

/// The redelivery policy the worker applies to failed attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The consumer's `max_deliver`: the delivery with this number is the last.
    pub max_deliver: u32,
    /// NAK delay after failed delivery `n` is entry `min(n, len) - 1`; empty means 1 s.
    pub nak_backoff_ms: Vec<u64>,
    /// NAK delay after a contended claim (short: the holders commit within milliseconds).
    pub contended_nak_ms: u64,
}

/// NAK delay when the backoff list is empty.
const NAK_DELAY_DEFAULT_MS: u64 = 1_000;

impl RetryPolicy {
    /// The NAK delay after failed delivery number `delivered` (1-based).
    pub fn nak_delay_ms(&self, delivered: u32) -> u64 {
        if self.nak_backoff_ms.is_empty() {
            return NAK_DELAY_DEFAULT_MS;
        }
        let index = (delivered.max(1) as usize - 1).min(self.nak_backoff_ms.len() - 1);
        self.nak_backoff_ms[index]
    }
}

/// Settles one delivery (see the module documentation for the rules).
pub fn classify(attempt: Attempt<'_>, delivered: u32, policy: &RetryPolicy) -> Action {
    let last = delivered >= policy.max_deliver;
    let retry = |delay_ms: u64, error: &str| {
        if last {
            Action::DeadLetter {
                error: format!(
                    "deliveries exhausted ({delivered} of max_deliver {}): {error}",
                    policy.max_deliver
                ),
            }
        } else {
            Action::Nak { delay_ms }
        }
    };
    match attempt {
        Attempt::Undecodable(error) => Action::DeadLetter { error: error.to_string() },
        Attempt::Written(outcome) => match outcome {
            WriteOutcome::Created { .. }
            | WriteOutcome::Rejected { .. }
            | WriteOutcome::Duplicate { .. } => Action::Ack,
            WriteOutcome::Contended => retry(
                policy.contended_nak_ms,
                "token claim contended: every AVAILABLE token was locked by other transactions",
            ),
            WriteOutcome::Failed { error, .. } => retry(policy.nak_delay_ms(delivered), error),
        },
        Attempt::BatchFailed { error, .. } => retry(policy.nak_delay_ms(delivered), error),
    }
}

/// The outbox event a committed outcome announces, if any: `order_created` for an order (new
/// or re-announced), `compensate` with the flags of THE rule (`compensation.rs`) for a
/// rejection (new or re-announced). Rolled-back outcomes announce nothing.
pub fn event_for(
    message: &OrderCreate,
    outcome: &WriteOutcome,
    now_ms: u64,
) -> Option<ReservationEvent> {
    match outcome {
        WriteOutcome::Created { order_id, .. }
        | WriteOutcome::Duplicate { recorded: Recorded::Created { order_id } } => {
            Some(ReservationEvent::order_created(message, order_id, now_ms))
        }
        WriteOutcome::Rejected { reason, .. }
        | WriteOutcome::Duplicate { recorded: Recorded::Rejected(reason) } => {
            Some(ReservationEvent::rejected(message, *reason, now_ms))
        }
        WriteOutcome::Duplicate { recorded: Recorded::Unresolved }
        | WriteOutcome::Contended
        | WriteOutcome::Failed { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsale_io::wire::{EventType, ORDER_CREATE_EVENT_TYPE};

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_deliver: 5,
            nak_backoff_ms: vec![100, 1_000, 5_000],
            contended_nak_ms: 20,
        }
    }

    fn message() -> OrderCreate {
        OrderCreate {
            schema_version: 1,
            event_type: ORDER_CREATE_EVENT_TYPE.into(),
            message_id: "msg_1".into(),
            message_key: "resv_1".into(),
            request_id: "req_1".into(),
            reservation_id: "resv_1".into(),
            activity_id: 1,
            sku_id: 2,
            user_id: 3,
            quantity: 1,
            reserved_at_ms: 1_000,
            reservation_expires_at_ms: 2_000,
            retry_count: 0,
            payload_hash: "sha256:x".into(),
            traceparent: None,
            created_at_ms: 1_000,
        }
    }

    fn created() -> WriteOutcome {
        WriteOutcome::Created { order_id: "ord_1".into(), token_ids: vec![], claim_us: Some(5) }
    }

    #[test]
    fn committed_outcomes_are_acked() {
        let outcomes = [
            created(),
            WriteOutcome::Rejected { reason: RejectReason::Expired, claim_us: None },
            WriteOutcome::Duplicate { recorded: Recorded::Unresolved },
            WriteOutcome::Duplicate { recorded: Recorded::Created { order_id: "ord_1".into() } },
        ];
        for outcome in &outcomes {
            // Even on the last delivery: the commit happened.
            for delivered in [1, 5, 9] {
                assert_eq!(classify(Attempt::Written(outcome), delivered, &policy()), Action::Ack);
            }
        }
    }

    #[test]
    fn undecodable_messages_go_to_the_dlq_at_once() {
        let malformed = DecodeError::Malformed("expected value at line 1".into());
        match classify(Attempt::Undecodable(&malformed), 1, &policy()) {
            Action::DeadLetter { error } => assert!(error.contains("expected value"), "{error}"),
            other => panic!("{other:?}"),
        }
        let newer = DecodeError::UnknownSchema { version: 2 };
        match classify(Attempt::Undecodable(&newer), 1, &policy()) {
            Action::DeadLetter { error } => {
                assert!(error.contains("unknown schema_version 2"), "{error}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn transient_failures_are_naked_with_backoff() {
        let failed = WriteOutcome::Failed { transient: true, error: "40P01 deadlock".into() };
        let expect = [(1, 100), (2, 1_000), (3, 5_000), (4, 5_000)];
        for (delivered, delay_ms) in expect {
            assert_eq!(
                classify(Attempt::Written(&failed), delivered, &policy()),
                Action::Nak { delay_ms }
            );
        }
        let batch = Attempt::BatchFailed { transient: true, error: "connection closed" };
        assert_eq!(classify(batch, 2, &policy()), Action::Nak { delay_ms: 1_000 });
        // A non-transient database error is still retried until the last delivery.
        let permanent = WriteOutcome::Failed { transient: false, error: "42883".into() };
        assert_eq!(
            classify(Attempt::Written(&permanent), 1, &policy()),
            Action::Nak { delay_ms: 100 }
        );
    }

    #[test]
    fn contention_is_retried_soon() {
        assert_eq!(
            classify(Attempt::Written(&WriteOutcome::Contended), 1, &policy()),
            Action::Nak { delay_ms: 20 }
        );
    }

    #[test]
    fn the_last_delivery_goes_to_the_dlq_with_its_error() {
        let failed = WriteOutcome::Failed { transient: true, error: "55P03 lock timeout".into() };
        for attempt in [
            Attempt::Written(&failed),
            Attempt::Written(&WriteOutcome::Contended),
            Attempt::BatchFailed { transient: true, error: "55P03 lock timeout" },
        ] {
            match classify(attempt, 5, &policy()) {
                Action::DeadLetter { error } => {
                    assert!(error.contains("deliveries exhausted (5 of max_deliver 5)"), "{error}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn an_empty_backoff_list_uses_the_default() {
        let p = RetryPolicy { nak_backoff_ms: vec![], ..policy() };
        assert_eq!(p.nak_delay_ms(3), NAK_DELAY_DEFAULT_MS);
    }

    #[test]
    fn events_announce_committed_outcomes_only() {
        let m = message();
        let event = event_for(&m, &created(), 7).expect("order event");
        assert_eq!(event.event_type, EventType::OrderCreated);
        assert_eq!(event.order_id.as_deref(), Some("ord_1"));

        let dup =
            WriteOutcome::Duplicate { recorded: Recorded::Rejected(RejectReason::DuplicateUser) };
        let event = event_for(&m, &dup, 7).expect("re-announced rejection");
        assert_eq!(event.event_type, EventType::Compensate);
        assert_eq!(event.reason_code, Some(RejectReason::DuplicateUser));
        assert!(event.return_stock && !event.release_user);

        let expired = WriteOutcome::Rejected { reason: RejectReason::Expired, claim_us: None };
        let event = event_for(&m, &expired, 7).expect("compensation");
        assert!(event.return_stock && event.release_user);

        for none in [
            WriteOutcome::Contended,
            WriteOutcome::Failed { transient: true, error: "x".into() },
            WriteOutcome::Duplicate { recorded: Recorded::Unresolved },
        ] {
            assert_eq!(event_for(&m, &none, 7), None, "{none:?}");
        }
    }
}
