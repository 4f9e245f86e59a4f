//! The planner's release assertions (`pg-worker/src/plan.rs`, `assert_keeps_the_sale`), each
//! seen to fire: a test-only planning bug (a failpoint of the `failpoints` feature) makes the
//! pure planner break one invariant of the sale, and `plan` must panic naming the invariant and
//! the ids; with the bug switched off, the same input plans as the rules say. No database: the
//! planner does no I/O (the same breach against PostgreSQL, rolled back before anything
//! commits, is `tests/tests/negative_controls.rs`).
//!
//! | bug (failpoint)                 | the planner then            | the assertion that fires   |
//! |---------------------------------|-----------------------------|----------------------------|
//! | `plan_bug.extra_unit`           | sells one unit too many     | I1: orders <= sellable units |
//! | `plan_bug.reuse_token`          | gives one token twice       | I1: one token per order    |
//! | `plan_bug.unlocked_token`       | gives a token it did not lock | I1: a locked token per order |
//! | `plan_bug.row_sale_uncounted`   | forgets to lower a ROW counter | I1: counter lowered by its orders |
//! | `plan_bug.forget_held_orders`   | drops "already holds an order" | I2: none for a buyer holding one |
//! | `plan_bug.skip_buyer_check`     | lets a buyer's second message through | I2: never two orders per buyer |
//!
//! Failpoints are process-global: every test holds [`serial`], and a [`Bug`] removes its
//! failpoint when dropped. Without the feature this file is empty.

#![cfg(feature = "failpoints")]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};

use flashsale_io::wire::{OrderCreate, RejectReason, ORDER_CREATE_EVENT_TYPE};
use flashsale_pg_worker::plan::{plan, Facts, Plan, SkuClaim, SkuFacts};
use flashsale_pg_worker::WriteOutcome;

const NOW_MS: u64 = 1_000_000;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One planning bug switched on while this lives.
struct Bug(&'static str);

impl Bug {
    fn on(name: &'static str) -> Bug {
        fail::cfg(name, "return").expect("failpoint");
        Bug(name)
    }
}

impl Drop for Bug {
    fn drop(&mut self) {
        fail::remove(self.0);
    }
}

fn message(tag: &str, sku_id: u64, user_id: u64) -> OrderCreate {
    OrderCreate {
        schema_version: 1,
        event_type: ORDER_CREATE_EVENT_TYPE.into(),
        message_id: format!("msg_{tag}"),
        message_key: format!("resv_{tag}"),
        request_id: format!("req_{tag}"),
        reservation_id: format!("resv_{tag}"),
        activity_id: 1,
        sku_id,
        user_id,
        quantity: 1,
        reserved_at_ms: NOW_MS - 1_000,
        reservation_expires_at_ms: NOW_MS + 1_000,
        retry_count: 0,
        payload_hash: "sha256:x".into(),
        traceparent: None,
        created_at_ms: NOW_MS - 1_000,
    }
}

/// Facts with every message's inbox row new and one SKU `(1, 2)` claimed as `claim`.
fn facts(batch: &[&OrderCreate], claim: SkuClaim) -> Facts {
    Facts {
        inserted_ids: batch.iter().map(|m| m.message_id.clone()).collect(),
        skus: vec![SkuFacts { key: (1, 2), claim, claim_us: Some(3) }],
        ..Facts::default()
    }
}

fn tokens(ids: &[&str]) -> SkuClaim {
    SkuClaim::Token { tokens: ids.iter().map(|t| (*t).to_owned()).collect(), contended: false }
}

/// Plans `batch` with the failpoint `bug` on; returns the panic's message (fails if the plan
/// went through). Then plans it again with the bug off and returns that plan too.
fn with_and_without(bug: &'static str, batch: &[&OrderCreate], facts: &Facts) -> (String, Plan) {
    let _serial = serial();
    let breach = {
        let _bug = Bug::on(bug);
        catch_unwind(AssertUnwindSafe(|| plan(batch, facts, NOW_MS)))
    };
    let message = match breach {
        Ok(planned) => panic!("{bug}: the plan went through: {planned:?}"),
        Err(payload) => payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default(),
    };
    let sound = plan(batch, facts, NOW_MS).expect("consistent facts");
    (message, sound)
}

fn created(m: &OrderCreate, token: Option<&str>) -> WriteOutcome {
    WriteOutcome::Created {
        order_id: m.order_id(),
        token_ids: token.map(str::to_owned).into_iter().collect(),
        claim_us: Some(3),
    }
}

fn rejected(reason: RejectReason) -> WriteOutcome {
    WriteOutcome::Rejected { reason, claim_us: Some(3) }
}

#[test]
fn an_extra_unit_is_an_oversell_the_plan_refuses() {
    let (a, b) = (message("a", 2, 7), message("b", 2, 8));
    let batch = [&a, &b];
    // TOKEN: one token locked, the bug makes up a second one.
    let (breach, sound) =
        with_and_without("plan_bug.extra_unit", &batch, &facts(&batch, tokens(&["t1"])));
    assert!(breach.contains("I1 (no oversell)"), "{breach}");
    assert!(breach.contains("2 units ordered for SKU (activity 1, sku 2)"), "{breach}");
    assert!(breach.contains("1 sellable unit(s)"), "{breach}");
    assert!(breach.contains("resv_a") && breach.contains("resv_b"), "{breach}");
    assert_eq!(sound.outcomes, vec![created(&a, Some("t1")), rejected(RejectReason::NoFinalStock)]);
    // ROW: a counter of one, the bug reads two.
    let row = facts(&batch, SkuClaim::Row { available: 1 });
    let (breach, sound) = with_and_without("plan_bug.extra_unit", &batch, &row);
    assert!(breach.contains("I1 (no oversell): 2 units ordered"), "{breach}");
    assert_eq!(sound.outcomes, vec![created(&a, None), rejected(RejectReason::NoFinalStock)]);
    assert_eq!(sound.row_units, vec![((1, 2), 1)]);
}

#[test]
fn a_token_given_twice_is_refused() {
    let (a, b) = (message("a", 2, 7), message("b", 2, 8));
    let batch = [&a, &b];
    let facts = facts(&batch, tokens(&["t1", "t2"]));
    let (breach, sound) = with_and_without("plan_bug.reuse_token", &batch, &facts);
    assert!(breach.contains("I1 (no oversell): token t1"), "{breach}");
    assert!(breach.contains("planned for reservations resv_a and resv_b"), "{breach}");
    assert_eq!(sound.outcomes, vec![created(&a, Some("t1")), created(&b, Some("t2"))]);
}

#[test]
fn a_token_the_batch_did_not_lock_is_refused() {
    let a = message("a", 2, 7);
    let batch = [&a];
    let facts = facts(&batch, tokens(&["t1"]));
    let (breach, sound) = with_and_without("plan_bug.unlocked_token", &batch, &facts);
    assert!(breach.contains("I1 (no oversell): reservation resv_a"), "{breach}");
    assert!(breach.contains("(activity 1, sku 2, user 7)"), "{breach}");
    assert!(breach.contains("which is not a token locked for its SKU"), "{breach}");
    assert_eq!(sound.outcomes, vec![created(&a, Some("t1"))]);
}

#[test]
fn a_row_counter_not_lowered_by_its_orders_is_refused() {
    let (a, b) = (message("a", 2, 7), message("b", 2, 8));
    let batch = [&a, &b];
    let facts = facts(&batch, SkuClaim::Row { available: 2 });
    let (breach, sound) = with_and_without("plan_bug.row_sale_uncounted", &batch, &facts);
    assert!(breach.contains("I1 (no oversell): ROW SKU (activity 1, sku 2)"), "{breach}");
    assert!(breach.contains("2 units ordered but its counter lowered by 0"), "{breach}");
    assert!(breach.contains("resv_a") && breach.contains("resv_b"), "{breach}");
    assert_eq!(sound.outcomes, vec![created(&a, None), created(&b, None)]);
    assert_eq!(sound.row_units, vec![((1, 2), 2)]);
}

#[test]
fn an_order_for_a_buyer_who_holds_one_is_refused() {
    let a = message("a", 2, 7);
    let batch = [&a];
    // The facts read say buyer 7 already holds an order of SKU (1, 2).
    let facts = Facts { ordered_positions: vec![0], ..facts(&batch, tokens(&["t1"])) };
    let (breach, sound) = with_and_without("plan_bug.forget_held_orders", &batch, &facts);
    assert!(breach.contains("I2 (one order per buyer)"), "{breach}");
    assert!(
        breach.contains("buyer (activity 1, sku 2, user 7), who already holds one"),
        "{breach}"
    );
    assert!(breach.contains("reservation resv_a"), "{breach}");
    assert_eq!(sound.outcomes, vec![rejected(RejectReason::DuplicateUser)]);
}

#[test]
fn two_orders_for_one_buyer_in_a_batch_are_refused() {
    let (a, b) = (message("a", 2, 7), message("b", 2, 7));
    let batch = [&a, &b];
    let facts = facts(&batch, tokens(&["t1", "t2"]));
    let (breach, sound) = with_and_without("plan_bug.skip_buyer_check", &batch, &facts);
    assert!(breach.contains("I2 (one order per buyer): two orders planned"), "{breach}");
    assert!(breach.contains("buyer (activity 1, sku 2, user 7): reservations resv_a and resv_b"));
    assert_eq!(
        sound.outcomes,
        vec![created(&a, Some("t1")), rejected(RejectReason::DuplicateUser)]
    );
}
