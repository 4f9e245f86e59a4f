//! THE table from business outcomes to the public API's states and HTTP statuses
//! (CONTRACT.md 3.2 and 3.3). Every answer the edge gives passes through [`SubmitOutcome`] or
//! [`QueryOutcome`]; nothing else chooses a status code.
//!
//! Not here: producing the outcomes (shard, partition, admission) or writing bytes
//! (`http::response`).

/// Every answer to `POST /v1/reservations`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitOutcome {
    /// Stock pre-reserved and the order-create message is durably in the log.
    Queued,
    /// Stock pre-reserved; the message is not confirmed yet (the scanner republishes it).
    QueuedPending,
    SoldOut,
    /// The user already holds a reservation for this SKU (its id is returned).
    DuplicateUser,
    ActivityNotActive,
    IdempotencyConflict,
    Invalid,
    Unauthorized,
    RateLimited,
    /// This instance's in-flight bound (or the SKU's admission bound) is full.
    Overloaded,
    /// A degradation mode or an exhausted async buffer closed submissions.
    SubmitClosed,
    /// A dependency is unavailable; nothing was reserved.
    SystemBusy,
    /// The outcome could not be confirmed (e.g. Redis timed out after the command was
    /// written): the client retries with the same request id or queries.
    Unknown,
}

impl SubmitOutcome {
    /// Every submit outcome, in CONTRACT.md 3.2's order (metrics iterate it).
    pub const ALL: [SubmitOutcome; 13] = [
        SubmitOutcome::Queued,
        SubmitOutcome::QueuedPending,
        SubmitOutcome::SoldOut,
        SubmitOutcome::DuplicateUser,
        SubmitOutcome::ActivityNotActive,
        SubmitOutcome::IdempotencyConflict,
        SubmitOutcome::Invalid,
        SubmitOutcome::Unauthorized,
        SubmitOutcome::RateLimited,
        SubmitOutcome::Overloaded,
        SubmitOutcome::SubmitClosed,
        SubmitOutcome::SystemBusy,
        SubmitOutcome::Unknown,
    ];

    /// `(HTTP status, state)` — the one place where they are decided.
    pub const fn http(self) -> (u16, &'static str) {
        match self {
            SubmitOutcome::Queued => (202, "QUEUED"),
            SubmitOutcome::QueuedPending => (202, "QUEUED_PENDING"),
            SubmitOutcome::SoldOut => (200, "SOLD_OUT"),
            SubmitOutcome::DuplicateUser => (200, "DUPLICATE_USER"),
            SubmitOutcome::ActivityNotActive => (200, "ACTIVITY_NOT_ACTIVE"),
            SubmitOutcome::IdempotencyConflict => (409, "IDEMPOTENCY_CONFLICT"),
            SubmitOutcome::Invalid => (400, "INVALID"),
            SubmitOutcome::Unauthorized => (401, "UNAUTHORIZED"),
            SubmitOutcome::RateLimited => (429, "RATE_LIMITED"),
            SubmitOutcome::Overloaded => (429, "OVERLOADED"),
            SubmitOutcome::SubmitClosed => (503, "SUBMIT_CLOSED"),
            SubmitOutcome::SystemBusy => (503, "SYSTEM_BUSY"),
            SubmitOutcome::Unknown => (503, "UNKNOWN"),
        }
    }

    /// Whether the client should retry this exact request (same `request_id`) later.
    pub const fn worth_retrying(self) -> bool {
        matches!(
            self,
            SubmitOutcome::RateLimited
                | SubmitOutcome::Overloaded
                | SubmitOutcome::SubmitClosed
                | SubmitOutcome::SystemBusy
                | SubmitOutcome::Unknown
        )
    }

    /// Whether the buyer holds a reservation after this answer.
    pub const fn holds_reservation(self) -> bool {
        matches!(self, SubmitOutcome::Queued | SubmitOutcome::QueuedPending)
    }
}

/// Every answer to `GET /v1/reservations/{request_id}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryOutcome {
    Queuing,
    Succeeded,
    Failed,
    NotFound,
    /// A store that would know could not be reached: never `NotFound` then.
    Unknown,
    Invalid,
    Unauthorized,
    /// Per-user or per-address limit on reads; `Retry-After` set.
    RateLimited,
}

impl QueryOutcome {
    /// Every query outcome (metrics iterate it).
    pub const ALL: [QueryOutcome; 8] = [
        QueryOutcome::Queuing,
        QueryOutcome::Succeeded,
        QueryOutcome::Failed,
        QueryOutcome::NotFound,
        QueryOutcome::Unknown,
        QueryOutcome::Invalid,
        QueryOutcome::Unauthorized,
        QueryOutcome::RateLimited,
    ];

    pub const fn http(self) -> (u16, &'static str) {
        match self {
            QueryOutcome::Queuing => (200, "QUEUING"),
            QueryOutcome::Succeeded => (200, "SUCCEEDED"),
            QueryOutcome::Failed => (200, "FAILED"),
            QueryOutcome::NotFound => (404, "NOT_FOUND"),
            QueryOutcome::Unknown => (503, "UNKNOWN"),
            QueryOutcome::Invalid => (400, "INVALID"),
            QueryOutcome::Unauthorized => (401, "UNAUTHORIZED"),
            QueryOutcome::RateLimited => (429, "RATE_LIMITED"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [SubmitOutcome; 13] = SubmitOutcome::ALL;

    #[test]
    fn contract_table() {
        // CONTRACT.md 3.2, row by row.
        let expected = [
            (202, "QUEUED"),
            (202, "QUEUED_PENDING"),
            (200, "SOLD_OUT"),
            (200, "DUPLICATE_USER"),
            (200, "ACTIVITY_NOT_ACTIVE"),
            (409, "IDEMPOTENCY_CONFLICT"),
            (400, "INVALID"),
            (401, "UNAUTHORIZED"),
            (429, "RATE_LIMITED"),
            (429, "OVERLOADED"),
            (503, "SUBMIT_CLOSED"),
            (503, "SYSTEM_BUSY"),
            (503, "UNKNOWN"),
        ];
        for (outcome, want) in ALL.iter().zip(expected) {
            assert_eq!(outcome.http(), want, "{outcome:?}");
        }
    }

    #[test]
    fn unknown_is_never_a_failure_to_forget() {
        // An unknown outcome must be retried with the same id, never treated as "no".
        assert!(SubmitOutcome::Unknown.worth_retrying());
        assert!(!SubmitOutcome::Unknown.holds_reservation());
        assert!(!SubmitOutcome::SoldOut.worth_retrying());
        let holders: Vec<_> = ALL.iter().filter(|o| o.holds_reservation()).collect();
        assert_eq!(holders, [&SubmitOutcome::Queued, &SubmitOutcome::QueuedPending]);
    }

    #[test]
    fn query_never_not_found_with_5xx() {
        assert_eq!(QueryOutcome::Unknown.http(), (503, "UNKNOWN"));
        assert_eq!(QueryOutcome::NotFound.http(), (404, "NOT_FOUND"));
        assert_eq!(QueryOutcome::Succeeded.http(), (200, "SUCCEEDED"));
    }
}
