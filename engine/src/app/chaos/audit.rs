//! The auditor of `flashsale chaos` (issue 27, item 3): from the generator's record of every
//! answer and what PostgreSQL holds at the end, every way a buyer or the stock could have been
//! wronged, each breach named with its ids. Sans-I/O: the caller reads the stores into
//! [`Stores`] (the SKU's reservations, orders and payments, PostgreSQL's own invariant report
//! and the engine's reconcile report, which holds Redis against PostgreSQL); this file only
//! judges, so every rule is unit-tested on hand-made records.
//!
//! The rules (DESIGN.md section 8 and the list):
//! - `invariants`: PostgreSQL's audit (no oversell, one order per buyer, tokens conserved,
//!   ack after commit) and the reconcile report (Redis conservation, nothing lost) are ok.
//! - `promise`: every request answered `QUEUED`/`QUEUED_PENDING` has exactly one order, or
//!   its reservation ended in a recorded rejection or compensation.
//! - `one_reservation_per_id`: every answer naming a reservation for one request id names the
//!   same one (idempotency).
//! - `contradiction`: no request with an order was later answered a contradicting final state
//!   (`FAILED`, `NOT_FOUND`, `SOLD_OUT`) or another order id.
//! - `payment`: every accepted `PAID` callback's order is PAID in PostgreSQL (or recorded
//!   REFUND_NEEDED), and no order is PAID that no callback was sent for (one whose answer
//!   was lost may have taken effect).
//! - `cancel`: every order whose cancel was answered `CANCELLED` is CANCELLED in PostgreSQL
//!   (never PAID: a payment after it is recorded for a refund), and every one answered
//!   `NOT_CANCELLABLE` is not. A query may answer `FAILED ORDER_CANCELLED` for a request whose
//!   order was cancelled or closed: that is no contradiction.
//!
//! What it is not: the generator or the reading of the stores (`mod.rs`).

use std::collections::{BTreeMap, BTreeSet};

/// One answer the generator received.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Answer {
    /// Since the start of the sale.
    pub at_ms: u64,
    pub kind: AnswerKind,
    pub user: u64,
    pub request_id: String,
    pub status: u16,
    /// `state` of the body (`""` when none, e.g. a broken connection is not recorded).
    pub state: String,
    pub reason: Option<String>,
    pub reservation_id: Option<String>,
    pub order_id: Option<String>,
    #[serde(default)]
    pub retry_after_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerKind {
    Submit,
    Query,
    /// A PAID callback for `order_id`.
    Pay,
    /// The buyer's cancel of `order_id`.
    Cancel,
}

/// What the stores hold at the end, as far as the rules need.
#[derive(Debug, Clone, Default)]
pub struct Stores {
    /// request id → (reservation id, status) of PostgreSQL's reservations of the SKU.
    pub reservations: BTreeMap<String, (String, String)>,
    /// request id → (order id, status) of the orders of the SKU.
    pub orders: BTreeMap<String, (String, String)>,
    /// Order ids with a PAID callback recorded (outcome PAID or REFUND_NEEDED).
    pub paid_orders: BTreeSet<String>,
    /// Problems PostgreSQL's audit reported (empty: ok).
    pub audit_problems: Vec<String>,
    /// Whether the engine's reconcile report was ok, and its text otherwise.
    pub reconcile_problem: Option<String>,
}

impl Stores {
    /// Whether the promise made to request `id` has settled: an order, or a reservation that
    /// ended without one (the harness waits for this before it judges, the auditor judges it).
    pub fn promise_settled(&self, id: &str) -> bool {
        self.orders.contains_key(id)
            || self.reservations.get(id).is_some_and(|(_, status)| settled_without_order(status))
    }
}

fn settled_without_order(status: &str) -> bool {
    SETTLED_WITHOUT_ORDER.iter().any(|s| status.starts_with(s))
}

/// One breach: the rule and the ids behind it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Breach {
    pub rule: &'static str,
    pub detail: String,
}

/// Reservation outcomes that settle a promise without an order.
const SETTLED_WITHOUT_ORDER: &[&str] = &["REJECTED", "REJECTED_EXPIRED", "COMPENSATED", "FAILED"];

pub fn audit(answers: &[Answer], stores: &Stores) -> Vec<Breach> {
    let mut breaches = Vec::new();
    for problem in &stores.audit_problems {
        breaches.push(Breach { rule: "invariants", detail: problem.clone() });
    }
    if let Some(problem) = &stores.reconcile_problem {
        breaches.push(Breach { rule: "invariants", detail: format!("reconcile: {problem}") });
    }
    promises(answers, stores, &mut breaches);
    one_reservation_per_id(answers, &mut breaches);
    contradictions(answers, stores, &mut breaches);
    payments(answers, stores, &mut breaches);
    cancels(answers, stores, &mut breaches);
    breaches
}

/// An answer that promised the buyer a reservation (`QUEUED` or `QUEUED_PENDING`).
pub fn is_promise(a: &Answer) -> bool {
    a.kind == AnswerKind::Submit && (a.state == "QUEUED" || a.state == "QUEUED_PENDING")
}

fn promises(answers: &[Answer], stores: &Stores, out: &mut Vec<Breach>) {
    let promised: BTreeMap<&str, u64> =
        answers.iter().filter(|a| is_promise(a)).map(|a| (a.request_id.as_str(), a.user)).collect();
    for (id, user) in promised.into_iter().filter(|(id, _)| !stores.promise_settled(id)) {
        match stores.reservations.get(id) {
            Some((resv, status)) => out.push(Breach {
                rule: "promise",
                detail: format!(
                    "user {user} request {id}: reservation {resv} is {status}, no order"
                ),
            }),
            None => out.push(Breach {
                rule: "promise",
                detail: format!("user {user} request {id}: promised, no reservation in PostgreSQL"),
            }),
        }
    }
}

fn one_reservation_per_id(answers: &[Answer], out: &mut Vec<Breach>) {
    let mut seen: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for a in answers {
        if let Some(resv) = &a.reservation_id {
            seen.entry(a.request_id.as_str()).or_default().insert(resv.as_str());
        }
    }
    for (id, reservations) in seen.into_iter().filter(|(_, r)| r.len() > 1) {
        out.push(Breach {
            rule: "one_reservation_per_id",
            detail: format!("request {id} answered with reservations {reservations:?}"),
        });
    }
}

fn contradictions(answers: &[Answer], stores: &Stores, out: &mut Vec<Breach>) {
    let asked = |a: &&Answer| matches!(a.kind, AnswerKind::Submit | AnswerKind::Query);
    for a in answers.iter().filter(asked) {
        let Some((order, status)) = stores.orders.get(&a.request_id) else { continue };
        let released = matches!(status.as_str(), "CANCELLED" | "CLOSED")
            && a.reason.as_deref() == Some("ORDER_CANCELLED");
        let final_without = matches!(a.state.as_str(), "FAILED" | "NOT_FOUND" | "SOLD_OUT");
        let final_without = final_without && !(a.state == "FAILED" && released);
        let other_order = a.order_id.as_ref().is_some_and(|o| o != order);
        if final_without || other_order {
            out.push(Breach {
                rule: "contradiction",
                detail: format!(
                    "user {} request {} has order {order} but was told {} {:?} at +{} ms",
                    a.user, a.request_id, a.state, a.order_id, a.at_ms
                ),
            });
        }
    }
}

fn payments(answers: &[Answer], stores: &Stores, out: &mut Vec<Breach>) {
    let accepted: BTreeSet<&str> = answers
        .iter()
        .filter(|a| a.kind == AnswerKind::Pay && a.status == 200)
        .filter_map(|a| a.order_id.as_deref())
        .collect();
    for order in &accepted {
        if !stores.paid_orders.contains(*order) {
            out.push(Breach {
                rule: "payment",
                detail: format!("order {order}: PAID accepted, no PAID payment in PostgreSQL"),
            });
        }
    }
    // A callback whose answer was lost may still have taken effect: only an order nobody
    // sent a callback for must not be PAID.
    let sent: BTreeSet<&str> = answers
        .iter()
        .filter(|a| a.kind == AnswerKind::Pay)
        .filter_map(|a| a.order_id.as_deref())
        .collect();
    let paid_status = stores.orders.values().filter(|(_, status)| status == "PAID");
    for (order, _) in paid_status.filter(|(o, _)| !sent.contains(o.as_str())) {
        out.push(Breach {
            rule: "payment",
            detail: format!("order {order} is PAID, and no callback was sent for it"),
        });
    }
}

fn cancels(answers: &[Answer], stores: &Stores, out: &mut Vec<Breach>) {
    let status_of = |order: &str| {
        stores.orders.values().find(|(o, _)| o == order).map_or("none", |(_, s)| s.as_str())
    };
    for a in answers.iter().filter(|a| a.kind == AnswerKind::Cancel) {
        let Some(order) = a.order_id.as_deref() else { continue };
        let status = status_of(order);
        let wrong = match a.state.as_str() {
            "CANCELLED" => status != "CANCELLED",
            "NOT_CANCELLABLE" => status == "CANCELLED",
            _ => false,
        };
        if wrong {
            out.push(Breach {
                rule: "cancel",
                detail: format!(
                    "user {} request {} order {order}: cancel answered {} at +{} ms, order is {status}",
                    a.user, a.request_id, a.state, a.at_ms
                ),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(kind: AnswerKind, id: &str, state: &str, resv: Option<&str>) -> Answer {
        Answer {
            at_ms: 1,
            kind,
            user: 7,
            request_id: id.to_owned(),
            status: 200,
            state: state.to_owned(),
            reason: None,
            reservation_id: resv.map(str::to_owned),
            order_id: None,
            retry_after_ms: None,
        }
    }

    fn clean() -> (Vec<Answer>, Stores) {
        let answers = vec![
            answer(AnswerKind::Submit, "r1", "QUEUED", Some("resv_1")),
            answer(AnswerKind::Submit, "r1", "QUEUED", Some("resv_1")),
            answer(AnswerKind::Submit, "r2", "QUEUED_PENDING", Some("resv_2")),
            answer(AnswerKind::Submit, "r3", "SUBMIT_CLOSED", None),
            Answer {
                order_id: Some("ord_1".into()),
                ..answer(AnswerKind::Pay, "r1", "PAID", None)
            },
        ];
        let mut stores = Stores::default();
        stores.reservations.insert("r1".into(), ("resv_1".into(), "ORDER_CREATED".into()));
        stores.reservations.insert("r2".into(), ("resv_2".into(), "REJECTED_EXPIRED".into()));
        stores.orders.insert("r1".into(), ("ord_1".into(), "PAID".into()));
        stores.paid_orders.insert("ord_1".into());
        (answers, stores)
    }

    fn rules(breaches: &[Breach]) -> Vec<&'static str> {
        breaches.iter().map(|b| b.rule).collect()
    }

    #[test]
    fn a_clean_record_passes() {
        let (answers, stores) = clean();
        assert_eq!(audit(&answers, &stores), vec![]);
    }

    #[test]
    fn a_promise_without_order_or_rejection_is_a_breach_naming_the_ids() {
        let (answers, mut stores) = clean();
        stores.reservations.insert("r2".into(), ("resv_2".into(), "CREATED".into()));
        let breaches = audit(&answers, &stores);
        assert_eq!(rules(&breaches), vec!["promise"]);
        assert!(breaches[0].detail.contains("r2") && breaches[0].detail.contains("resv_2"));
        stores.reservations.remove("r2");
        assert_eq!(rules(&audit(&answers, &stores)), vec!["promise"]);
    }

    #[test]
    fn two_reservations_for_one_id_and_contradictions_are_breaches() {
        let (mut answers, stores) = clean();
        answers.push(answer(AnswerKind::Submit, "r1", "QUEUED", Some("resv_9")));
        assert_eq!(rules(&audit(&answers, &stores)), vec!["one_reservation_per_id"]);
        let (mut answers, stores) = clean();
        answers.push(answer(AnswerKind::Query, "r1", "FAILED", None));
        assert_eq!(rules(&audit(&answers, &stores)), vec!["contradiction"]);
    }

    #[test]
    fn cancels_must_agree_with_the_order_and_a_cancelled_order_may_query_failed() {
        let (mut answers, mut stores) = clean();
        stores.orders.insert("r1".into(), ("ord_1".into(), "CANCELLED".into()));
        answers.retain(|a| a.kind != AnswerKind::Pay);
        let cancel = Answer {
            order_id: Some("ord_1".into()),
            ..answer(AnswerKind::Cancel, "r1", "CANCELLED", None)
        };
        answers.push(cancel.clone());
        let cancelled = Answer {
            reason: Some("ORDER_CANCELLED".into()),
            ..answer(AnswerKind::Query, "r1", "FAILED", None)
        };
        answers.push(cancelled.clone());
        assert_eq!(audit(&answers, &stores), vec![]);
        // The same answers against an order that stayed payable: both are breaches.
        stores.orders.insert("r1".into(), ("ord_1".into(), "PENDING_PAYMENT".into()));
        assert_eq!(rules(&audit(&answers, &stores)), vec!["contradiction", "cancel"]);
        // NOT_CANCELLABLE for an order that was cancelled after all.
        stores.orders.insert("r1".into(), ("ord_1".into(), "CANCELLED".into()));
        answers.retain(|a| a.kind != AnswerKind::Cancel);
        answers.push(Answer { state: "NOT_CANCELLABLE".into(), ..cancel });
        assert_eq!(rules(&audit(&answers, &stores)), vec!["cancel"]);
    }

    #[test]
    fn payments_must_agree_and_store_problems_are_breaches() {
        let (answers, mut stores) = clean();
        stores.paid_orders.clear();
        assert_eq!(rules(&audit(&answers, &stores)), vec!["payment"]);
        let (mut answers, stores) = clean();
        answers.retain(|a| a.kind != AnswerKind::Pay);
        assert_eq!(rules(&audit(&answers, &stores)), vec!["payment"]);
        // A callback whose answer was lost: its order may be PAID.
        let (mut answers, stores) = clean();
        answers.iter_mut().filter(|a| a.kind == AnswerKind::Pay).for_each(|a| a.status = 0);
        assert_eq!(audit(&answers, &stores), vec![]);
        let (answers, mut stores) = clean();
        stores.audit_problems.push("I1: 3 units over stock".into());
        stores.reconcile_problem = Some("redis_conservation 1".into());
        assert_eq!(rules(&audit(&answers, &stores)), vec!["invariants", "invariants"]);
    }
}
