//! THE rule of which of a reservation's Redis effects a rejection undoes (DESIGN.md section 5):
//! for each [`RejectReason`] PostgreSQL gives, whether `compensate` returns the stock unit,
//! releases the buyer's user marker, or both. The worker decides every outcome of an
//! order-create message, so the rule lives with it; the engine's reconcile reads the same rule
//! to tell whether a compensation returned a unit.
//!
//! What it is: two extension traits, so the rule reads as a property of the reason at every
//! call site while `io::wire` stays plain data: [`RejectionCompensation::compensation`]
//! (`reason.compensation()`) and [`RejectedEvent::rejected`] (`ReservationEvent::rejected`,
//! the `compensate` event with the rule's flags, which `classify::event_for` announces).
//!
//! What it is not: I/O, or the compensation itself (`lua/seckill.lua::compensate`, called by
//! the engine's `redis-sync` with the event's flags).
//!
//! Read next: `classify.rs` (the event each outcome announces), `io/src/wire/event.rs` (the
//! event's fields).

use flashsale_io::wire::{Compensation, OrderCreate, RejectReason, ReservationEvent};

/// The rule as a method of the reason: `reason.compensation()`.
pub trait RejectionCompensation {
    /// THE mapping from a rejection to the Redis effects it undoes (DESIGN.md section 5). The
    /// reservation took one unit of Redis stock and set the buyer's user marker; which of the
    /// two to give back depends on why PostgreSQL said no:
    ///
    /// - expired / activity terminated: the unit is sellable again and the buyer may try
    ///   again: return stock, release the user.
    /// - no final stock: PostgreSQL has nothing left, so the Redis unit must stay taken (the
    ///   SKU stays sold out); the buyer got nothing and may try again: release the user only.
    /// - duplicate user: the buyer already holds an order, so the user marker is right and
    ///   stays; this reservation's unit was never used: return stock only.
    fn compensation(self) -> Compensation;
}

impl RejectionCompensation for RejectReason {
    fn compensation(self) -> Compensation {
        match self {
            RejectReason::Expired | RejectReason::ActivityTerminated => {
                Compensation { return_stock: true, release_user: true }
            }
            RejectReason::NoFinalStock => Compensation { return_stock: false, release_user: true },
            RejectReason::DuplicateUser => Compensation { return_stock: true, release_user: false },
        }
    }
}

/// `ReservationEvent::rejected`: the `compensate` event of a rejected reservation, its flags
/// from [`RejectionCompensation::compensation`].
pub trait RejectedEvent {
    fn rejected(message: &OrderCreate, reason: RejectReason, now_ms: u64) -> Self;
}

impl RejectedEvent for ReservationEvent {
    fn rejected(message: &OrderCreate, reason: RejectReason, now_ms: u64) -> ReservationEvent {
        ReservationEvent::compensate(message, reason, reason.compensation(), now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test per branch of THE compensation mapping.

    #[test]
    fn expired_returns_stock_and_releases_the_user() {
        let c = RejectReason::Expired.compensation();
        assert_eq!(c, Compensation { return_stock: true, release_user: true });
    }

    #[test]
    fn activity_terminated_returns_stock_and_releases_the_user() {
        let c = RejectReason::ActivityTerminated.compensation();
        assert_eq!(c, Compensation { return_stock: true, release_user: true });
    }

    #[test]
    fn no_final_stock_releases_the_user_and_keeps_sold_out() {
        let c = RejectReason::NoFinalStock.compensation();
        assert_eq!(c, Compensation { return_stock: false, release_user: true });
    }

    #[test]
    fn duplicate_user_returns_stock_and_keeps_the_user_marker() {
        let c = RejectReason::DuplicateUser.compensation();
        assert_eq!(c, Compensation { return_stock: true, release_user: false });
    }
}
