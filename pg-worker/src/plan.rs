//! What each message of a set-based batch becomes, decided without I/O.
//!
//! What it is: [`plan`], which takes a batch of order-create messages and the [`Facts`]
//! PostgreSQL read and locked for them (`flashsale_order_facts`, migration 0004: inbox rows
//! inserted, recorded reservations, buyers holding orders, per SKU the activity and the units
//! locked), and returns every message's [`WriteOutcome`] plus the rows to write
//! ([`Plan`], written by `flashsale_order_apply`).
//!
//! The rules are those of the per-message function `flashsale_order_create` (migration 0002,
//! DESIGN.md section 5), applied to the messages in batch order as if each ran after the one
//! before it in the same transaction:
//!
//! 1. inbox: a message id seen before (committed, or earlier in this batch and not contended)
//!    is a duplicate and re-announces the reservation's recorded outcome; a repeat of a message
//!    contended earlier in the batch runs afresh (its inbox row went back);
//! 2. a reservation already recorded (committed, or by an earlier message of this batch under
//!    another message id) is a duplicate; its inbox row is kept;
//!    2b. the buyer's request id recorded under another reservation (committed, or decided
//!    earlier in this batch), neither of them a duplicate buyer → `REJECTED_DUPLICATE_USER`,
//!    no unit (migration 0009: Redis lost the request record and minted a second reservation;
//!    the first stays the one the request id names);
//! 3. expired (`reservation_expires_at <= now`) → `REJECTED_EXPIRED`; activity or SKU unknown,
//!    or activity TERMINATED → `REJECTED_ACTIVITY`;
//! 4. claim a unit of the SKU: TOKEN takes the lowest-seq locked token, ROW one unit of the
//!    locked counter; none left → `CONTENDED` (TOKEN only, when others hold AVAILABLE tokens:
//!    nothing of it is kept) or `REJECTED_NO_FINAL_STOCK`;
//! 5. the buyer already holds an order (committed, or created earlier in this batch) →
//!    `REJECTED_DUPLICATE_USER`, and the unit stays for the next message (the per-message
//!    function claims it and puts it back in the same transaction: the same rows result);
//! 6. otherwise `ORDER_CREATED` with that unit.
//!
//! Why the decision is here and not in SQL: it is the one place where the batch's messages
//! meet each other (a duplicate buyer, a unit put back and reused, a reservation under two
//! ids), and as a plain loop over the batch it is O(B) and reads like the per-message rules it
//! must equal; in SQL it would be window functions over positions. PostgreSQL still keeps the
//! final guards: the orders insert raises FS001 if a buyer the facts did not show got there
//! first, and every constraint of migration 0001 holds.
//!
//! Asserted here, in release builds too, on every plan before anything of it is written
//! (`assert_keeps_the_sale`): I1, no oversell — per SKU no more orders than the units the
//! facts show sellable for this batch, each TOKEN order on its own token locked for its SKU,
//! each ROW counter lowered by exactly its orders; I2, one order per buyer — never two orders
//! for one (activity, SKU, user), and none for a buyer who already holds one. A breach is a bug
//! in this file, and the writes would oversell or double an order (some of it PostgreSQL's
//! constraints would refuse, not all: nothing checks a ROW counter against the orders): the
//! panic names the invariant and the ids, and the caller rolls back (`set_writer.rs`), so
//! nothing of the batch commits and nothing is acked. Test-only planning bugs
//! (`InjectedBugs`, the `failpoints` feature) make each assertion fire in
//! `pg-worker/tests/plan_assertions.rs`.
//!
//! What it is not: the SQL (`migrations/0004_order_create_set.sql`, `sql.rs`), the transaction
//! (`set_writer.rs`), or the settlement of deliveries (`classify.rs`).
//!
//! Read next: `set_writer.rs` (`write_set_once`), `migrations/0004_order_create_set.sql`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use flashsale_io::wire::{OrderCreate, RejectReason};

use crate::classify::{Recorded, WriteOutcome};

/// `reservation_status` of a created order (`inventory_reservation.status`).
pub const ORDER_CREATED_STATUS: &str = "ORDER_CREATED";

/// (activity id, SKU id), as PostgreSQL stores them.
pub type SkuKey = (i64, i64);

/// What `flashsale_order_facts` found, decoded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// Message ids whose inbox row this transaction inserted.
    pub inserted_ids: Vec<String>,
    /// Recorded reservations among the batch's reservation ids.
    pub recorded: Vec<RecordedRow>,
    /// 0-based positions whose buyer already holds an order.
    pub ordered_positions: Vec<usize>,
    /// 0-based positions whose buyer's request id is recorded under another reservation that
    /// is not `REJECTED_DUPLICATE_USER` (`flashsale_order_facts`'s `r_requested_positions`, rule 2b).
    pub requested_positions: Vec<usize>,
    /// Every SKU the batch may claim from.
    pub skus: Vec<SkuFacts>,
}

/// One `inventory_reservation` row as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRow {
    pub reservation_id: String,
    pub status: String,
    pub order_id: Option<String>,
}

/// One SKU's activity and claim, as read and locked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkuFacts {
    pub key: SkuKey,
    pub claim: SkuClaim,
    /// How long the claim step took (microseconds); `None` when no claim ran.
    pub claim_us: Option<i64>,
}

/// What the batch can take from one SKU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkuClaim {
    /// Activity or SKU unknown, or the activity TERMINATED: every reservation is rejected.
    Closed,
    /// ROW allocator: `available_stock`, its row locked by this transaction.
    Row { available: u64 },
    /// TOKEN allocator: the tokens this transaction locked, lowest seq first, and whether
    /// other transactions hold AVAILABLE tokens it could not lock.
    Token { tokens: Vec<String>, contended: bool },
}

impl SkuClaim {
    /// From the facts row: activity status (`None`: activity or SKU unknown), allocator, ROW's
    /// `available_stock`, the TOKEN tokens locked and whether others hold more. The same
    /// branches as the per-message function: unknown or TERMINATED rejects (an ENDED activity
    /// still honours reservations taken inside its window), `ROW` counts, anything else is
    /// TOKEN (the schema allows only the two).
    pub fn from_facts(
        status: Option<&str>,
        allocator: Option<&str>,
        available: Option<i64>,
        tokens: Vec<String>,
        contended: bool,
    ) -> SkuClaim {
        match (status, allocator) {
            (None, _) | (Some("TERMINATED"), _) => SkuClaim::Closed,
            (Some(_), Some("ROW")) => SkuClaim::Row {
                available: available.and_then(|a| u64::try_from(a).ok()).unwrap_or(0),
            },
            (Some(_), _) => SkuClaim::Token { tokens, contended },
        }
    }
}

/// A message with a final outcome: its `inventory_reservation` row (and order, when created).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalRow {
    /// Index into the batch.
    pub position: usize,
    /// `inventory_reservation.status`.
    pub status: &'static str,
    /// Set for `ORDER_CREATED`.
    pub order_id: Option<String>,
    /// `ORDER_CREATED` with the TOKEN allocator: its tokens, one per unit of the message's
    /// quantity, in the order they were taken (seq order).
    pub token_ids: Vec<String>,
}

/// What to write and what to answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Every message's outcome, by position.
    pub outcomes: Vec<WriteOutcome>,
    /// Messages whose inbox row goes back (their last outcome in the batch is contended),
    /// each id once, sorted.
    pub contended_ids: Vec<String>,
    /// The reservations (and orders) to insert, in batch order.
    pub finals: Vec<FinalRow>,
    /// Units each ROW SKU sold in this batch (only SKUs that sold any), in key order.
    pub row_units: Vec<(SkuKey, i64)>,
}

/// Facts that contradict the batch (a defect in the SQL or its decoding, never a business
/// outcome): the caller rolls back and writes the batch the per-message way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InconsistentFacts(pub &'static str);

/// How a message id seen earlier in the batch ended.
#[derive(Clone, Copy)]
enum Seen {
    /// Its inbox row stays: a repeat is a duplicate.
    Kept,
    /// Contended: its inbox row goes back; a repeat is contended too.
    Contended,
}

/// A SKU's units while the batch is planned.
enum Units<'f> {
    Closed,
    Row { left: u64, sold: i64 },
    Token { queue: VecDeque<&'f str>, contended: bool },
}

struct SkuState<'f> {
    units: Units<'f>,
    claim_us: Option<i64>,
}

/// Planning state over one batch (see the module documentation for the rules).
struct Planner<'m, 'f> {
    now_ms: u64,
    inserted: HashSet<&'f str>,
    /// Recorded before this batch, by reservation id.
    table: HashMap<&'f str, &'f RecordedRow>,
    /// Recorded by this batch, by reservation id (wins over `table`: it is newer).
    batch: HashMap<&'m str, Recorded>,
    seen: HashMap<&'m str, Seen>,
    /// (activity, sku, user) holding an order, committed or created in this batch.
    ordered: HashSet<(u64, u64, u64)>,
    /// Positions whose request id is recorded under another reservation (rule 2b).
    requested: HashSet<usize>,
    /// (activity, sku, user, request id) decided in this batch other than as a duplicate
    /// buyer (rule 2b, the batch's own half).
    requests: HashSet<(u64, u64, u64, &'m str)>,
    skus: HashMap<SkuKey, SkuState<'f>>,
    plan: Plan,
    bugs: InjectedBugs,
}

/// Plans `messages` (in batch order) from `facts`, judged at `now_ms`.
pub fn plan(
    messages: &[&OrderCreate],
    facts: &Facts,
    now_ms: u64,
) -> Result<Plan, InconsistentFacts> {
    let mut planner = Planner::new(messages, facts, now_ms, InjectedBugs::read())?;
    for (position, message) in messages.iter().enumerate() {
        let outcome = planner.decide(position, message)?;
        planner.plan.outcomes.push(outcome);
    }
    let plan = planner.finish();
    debug_assert_eq!(plan.outcomes.len(), messages.len());
    assert_keeps_the_sale(messages, facts, &plan);
    Ok(plan)
}

impl<'m, 'f> Planner<'m, 'f> {
    fn new(
        messages: &[&'m OrderCreate],
        facts: &'f Facts,
        now_ms: u64,
        bugs: InjectedBugs,
    ) -> Result<Planner<'m, 'f>, InconsistentFacts> {
        let mut ordered = HashSet::with_capacity(facts.ordered_positions.len());
        for &position in &facts.ordered_positions {
            let m = messages.get(position).ok_or(InconsistentFacts("ordered position"))?;
            if !bugs.forget_held_orders {
                ordered.insert(buyer(m));
            }
        }
        let skus = facts
            .skus
            .iter()
            .map(|sku| {
                let units = match &sku.claim {
                    SkuClaim::Closed => Units::Closed,
                    SkuClaim::Row { available } => {
                        let left = available + u64::from(bugs.extra_unit);
                        Units::Row { left, sold: 0 }
                    }
                    SkuClaim::Token { tokens, contended } => {
                        let mut queue: VecDeque<&str> = tokens.iter().map(String::as_str).collect();
                        if bugs.extra_unit {
                            queue.push_back(INJECTED_TOKEN);
                        }
                        Units::Token { queue, contended: *contended }
                    }
                };
                (sku.key, SkuState { units, claim_us: sku.claim_us })
            })
            .collect();
        Ok(Planner {
            now_ms,
            inserted: facts.inserted_ids.iter().map(String::as_str).collect(),
            table: facts.recorded.iter().map(|r| (r.reservation_id.as_str(), r)).collect(),
            batch: HashMap::with_capacity(messages.len()),
            seen: HashMap::with_capacity(messages.len()),
            ordered,
            requested: facts.requested_positions.iter().copied().collect(),
            requests: HashSet::with_capacity(messages.len()),
            skus,
            plan: Plan {
                outcomes: Vec::with_capacity(messages.len()),
                finals: Vec::with_capacity(messages.len()),
                ..Plan::default()
            },
            bugs,
        })
    }

    /// One message, after every message before it in the batch.
    fn decide(
        &mut self,
        position: usize,
        m: &'m OrderCreate,
    ) -> Result<WriteOutcome, InconsistentFacts> {
        if !dedup_switched_off() {
            if let Some(duplicate) = self.dedup(m) {
                return duplicate;
            }
        }
        if self.requested.contains(&position) || self.requests.contains(&request(m)) {
            return Ok(self.finish_rejected(position, m, RejectReason::DuplicateUser, None));
        }
        if m.reservation_expires_at_ms <= self.now_ms {
            return Ok(self.finish_rejected(position, m, RejectReason::Expired, None));
        }
        let key = sku_key(m);
        let state = self.skus.get_mut(&key).ok_or(InconsistentFacts("no facts for a SKU"))?;
        let claim_us = state.claim_us;
        // `wire::OrderCreate::validate` bounds it by QUANTITY_MAX; all or none of its units.
        let wanted = m.quantity as usize;
        let units: Option<Vec<&'f str>> = match &mut state.units {
            Units::Closed => {
                let reason = RejectReason::ActivityTerminated;
                return Ok(self.finish_rejected(position, m, reason, None));
            }
            Units::Row { left, .. } => (*left >= wanted as u64).then(Vec::new),
            Units::Token { queue, contended } if queue.len() < wanted => {
                if *contended {
                    self.seen.insert(&m.message_id, Seen::Contended);
                    return Ok(WriteOutcome::Contended);
                }
                None
            }
            Units::Token { queue, .. } => Some(queue.iter().take(wanted).copied().collect()),
        };
        let Some(tokens) = units else {
            let reason = RejectReason::NoFinalStock;
            return Ok(self.finish_rejected(position, m, reason, claim_us));
        };
        if !self.ordered.insert(buyer(m)) && !self.bugs.skip_buyer_check {
            // The units stay where they were, for the next message of this SKU.
            let reason = RejectReason::DuplicateUser;
            return Ok(self.finish_rejected(position, m, reason, claim_us));
        }
        match &mut state.units {
            Units::Row { left, sold } => {
                *left -= wanted as u64;
                if !self.bugs.row_sale_uncounted {
                    *sold += wanted as i64;
                }
            }
            Units::Token { queue, .. } => {
                if !self.bugs.reuse_token {
                    queue.drain(..wanted);
                }
            }
            Units::Closed => return Err(InconsistentFacts("a closed SKU gave a unit")),
        }
        let mut tokens: Vec<String> = tokens.into_iter().map(str::to_owned).collect();
        if self.bugs.unlocked_token {
            if let Some(first) = tokens.first_mut() {
                *first = INJECTED_TOKEN.to_owned();
            }
        }
        Ok(self.finish_created(position, m, tokens, claim_us))
    }

    /// Rules 1 and 2: the message's inbox row or its reservation was seen before; `Some` is
    /// the duplicate's outcome.
    fn dedup(&mut self, m: &'m OrderCreate) -> Option<Result<WriteOutcome, InconsistentFacts>> {
        let reservation = m.reservation_id.as_str();
        match self.seen.get(m.message_id.as_str()) {
            // Its inbox row went back, so the per-message function inserts it again and runs
            // the message afresh (after its reservation may have been recorded under another
            // message id).
            Some(Seen::Contended) => {}
            Some(Seen::Kept) => return Some(self.duplicate(reservation)),
            None if !self.inserted.contains(m.message_id.as_str()) => {
                self.seen.insert(&m.message_id, Seen::Kept);
                return Some(self.duplicate(reservation));
            }
            None => {}
        }
        if self.batch.contains_key(reservation) || self.table.contains_key(reservation) {
            self.seen.insert(&m.message_id, Seen::Kept);
            return Some(self.duplicate(reservation));
        }
        None
    }

    /// A duplicate re-announces what is recorded for its reservation now.
    fn duplicate(&self, reservation: &str) -> Result<WriteOutcome, InconsistentFacts> {
        let recorded = match self.batch.get(reservation) {
            Some(recorded) => recorded.clone(),
            None => match self.table.get(reservation) {
                Some(row) if row.status == ORDER_CREATED_STATUS => Recorded::Created {
                    order_id: row
                        .order_id
                        .clone()
                        .ok_or(InconsistentFacts("ORDER_CREATED without an order id"))?,
                },
                Some(row) => RejectReason::from_reservation_status(&row.status)
                    .map_or(Recorded::Unresolved, Recorded::Rejected),
                None => Recorded::Unresolved,
            },
        };
        Ok(WriteOutcome::Duplicate { recorded })
    }

    fn finish_rejected(
        &mut self,
        position: usize,
        m: &'m OrderCreate,
        reason: RejectReason,
        claim_us: Option<i64>,
    ) -> WriteOutcome {
        self.seen.insert(&m.message_id, Seen::Kept);
        self.batch.insert(&m.reservation_id, Recorded::Rejected(reason));
        if reason != RejectReason::DuplicateUser {
            self.requests.insert(request(m));
        }
        self.plan.finals.push(FinalRow {
            position,
            status: reason.reservation_status(),
            order_id: None,
            token_ids: Vec::new(),
        });
        WriteOutcome::Rejected { reason, claim_us }
    }

    fn finish_created(
        &mut self,
        position: usize,
        m: &'m OrderCreate,
        token_ids: Vec<String>,
        claim_us: Option<i64>,
    ) -> WriteOutcome {
        let order_id = m.order_id();
        self.seen.insert(&m.message_id, Seen::Kept);
        self.requests.insert(request(m));
        self.batch.insert(&m.reservation_id, Recorded::Created { order_id: order_id.clone() });
        self.plan.finals.push(FinalRow {
            position,
            status: ORDER_CREATED_STATUS,
            order_id: Some(order_id.clone()),
            token_ids: token_ids.clone(),
        });
        WriteOutcome::Created { order_id, token_ids, claim_us }
    }

    fn finish(mut self) -> Plan {
        let sold: BTreeMap<SkuKey, i64> = self
            .skus
            .iter()
            .filter_map(|(key, state)| match state.units {
                Units::Row { sold, .. } if sold > 0 => Some((*key, sold)),
                _ => None,
            })
            .collect();
        self.plan.row_units = sold.into_iter().collect();
        // The inbox rows to take back: messages whose last outcome in the batch is contended.
        let mut contended: Vec<String> = self
            .seen
            .iter()
            .filter(|(_, seen)| matches!(seen, Seen::Contended))
            .map(|(id, _)| (*id).to_owned())
            .collect();
        contended.sort_unstable();
        self.plan.contended_ids = contended;
        self.plan
    }
}

/// Negative control (tests/tests/negative_controls.rs): with the `negctl.inbox_dedup_off`
/// failpoint set, rules 1 and 2 are skipped and a message seen before is planned afresh.
/// Always false without the `failpoints` feature.
fn dedup_switched_off() -> bool {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("negctl.inbox_dedup_off", |_| true);
    false
}

/// Test-only planning bugs, each switched on by the failpoint of its name (the `failpoints`
/// feature; `pg-worker/tests/plan_assertions.rs`) so that the assertion guarding the invariant
/// it breaks is seen to fire. Read once per batch; all off without the feature.
#[derive(Debug, Clone, Copy, Default)]
struct InjectedBugs {
    /// `plan_bug.extra_unit`: every open SKU has one unit more than the facts show (a ROW
    /// counter one higher, a TOKEN SKU one made-up token).
    extra_unit: bool,
    /// `plan_bug.reuse_token`: a TOKEN order does not use its token up.
    reuse_token: bool,
    /// `plan_bug.unlocked_token`: a TOKEN order holds a made-up token instead of the one it
    /// took.
    unlocked_token: bool,
    /// `plan_bug.row_sale_uncounted`: a ROW order is not counted against the counter.
    row_sale_uncounted: bool,
    /// `plan_bug.forget_held_orders`: the facts' buyers already holding an order are dropped.
    forget_held_orders: bool,
    /// `plan_bug.skip_buyer_check`: a second message of a buyer is not refused.
    skip_buyer_check: bool,
}

/// The made-up token of `plan_bug.extra_unit` and `plan_bug.unlocked_token`.
const INJECTED_TOKEN: &str = "tok_injected_by_plan_bug";

impl InjectedBugs {
    fn read() -> InjectedBugs {
        InjectedBugs {
            extra_unit: bug_injected("plan_bug.extra_unit"),
            reuse_token: bug_injected("plan_bug.reuse_token"),
            unlocked_token: bug_injected("plan_bug.unlocked_token"),
            row_sale_uncounted: bug_injected("plan_bug.row_sale_uncounted"),
            forget_held_orders: bug_injected("plan_bug.forget_held_orders"),
            skip_buyer_check: bug_injected("plan_bug.skip_buyer_check"),
        }
    }
}

/// Whether the failpoint `name` is set; always false without the `failpoints` feature.
fn bug_injected(name: &'static str) -> bool {
    #[cfg(feature = "failpoints")]
    fail::fail_point!(name, |_| true);
    let _ = name;
    false
}

/// The sale's invariants I1 and I2 (DESIGN.md section 8) on `plan`, against the facts it was
/// made from (see the module documentation). `assert!`, kept in release builds: the plan is
/// about to be written, and a breach means oversell or a second order for a buyer. O(batch)
/// with hashing, once per batch: microseconds beside the batch's two round trips.
fn assert_keeps_the_sale(messages: &[&OrderCreate], facts: &Facts, plan: &Plan) {
    let orders: Vec<(&OrderCreate, &[String])> = plan
        .finals
        .iter()
        .filter(|f| f.status == ORDER_CREATED_STATUS)
        .map(|f| (messages[f.position], f.token_ids.as_slice()))
        .collect();
    assert_units_within_sellable(facts, plan, &orders);
    assert_tokens_locked_and_distinct(facts, &orders);
    assert_one_order_per_buyer(messages, facts, &orders);
}

/// I1: per SKU, no more units ordered than the units sellable for the batch (the tokens locked
/// for it, the ROW counter, none when closed or unknown), and each ROW counter lowered by
/// exactly the units ordered of its SKU.
fn assert_units_within_sellable(facts: &Facts, plan: &Plan, orders: &[(&OrderCreate, &[String])]) {
    let claims: HashMap<SkuKey, &SkuClaim> = facts.skus.iter().map(|s| (s.key, &s.claim)).collect();
    let mut by_sku: BTreeMap<SkuKey, (u64, Vec<&str>)> = BTreeMap::new();
    for (m, _) in orders {
        let entry = by_sku.entry(sku_key(m)).or_default();
        entry.0 += u64::from(m.quantity);
        entry.1.push(m.reservation_id.as_str());
    }
    for (&(activity, sku), (ordered, reservations)) in &by_sku {
        let units = match claims.get(&(activity, sku)) {
            Some(SkuClaim::Row { available }) => *available,
            Some(SkuClaim::Token { tokens, .. }) => tokens.len() as u64,
            Some(SkuClaim::Closed) | None => 0,
        };
        assert!(
            *ordered <= units,
            "plan breaks I1 (no oversell): {ordered} units ordered for SKU (activity {activity}, \
             sku {sku}) with {units} sellable unit(s) locked for this batch; reservations \
             {reservations:?}"
        );
    }
    let lowered: HashMap<SkuKey, i64> = plan.row_units.iter().copied().collect();
    for (&(activity, sku), claim) in &claims {
        if let SkuClaim::Row { .. } = claim {
            let (ordered, reservations) =
                by_sku.get(&(activity, sku)).map_or((0, &[][..]), |(n, r)| (*n, r.as_slice()));
            let by = lowered.get(&(activity, sku)).copied().unwrap_or(0);
            assert!(
                by == ordered as i64,
                "plan breaks I1 (no oversell): ROW SKU (activity {activity}, sku {sku}) has \
                 {ordered} units ordered but its counter lowered by {by}; reservations \
                 {reservations:?}"
            );
        }
    }
}

/// I1: every order on a TOKEN SKU holds one token per unit, each locked by this batch for that
/// SKU, and no token is planned twice.
fn assert_tokens_locked_and_distinct(facts: &Facts, orders: &[(&OrderCreate, &[String])]) {
    let mut locked: HashMap<&str, SkuKey> = HashMap::new();
    let mut token_skus: HashSet<SkuKey> = HashSet::new();
    for sku in &facts.skus {
        if let SkuClaim::Token { tokens, .. } = &sku.claim {
            token_skus.insert(sku.key);
            locked.extend(tokens.iter().map(|t| (t.as_str(), sku.key)));
        }
    }
    let mut holders: HashMap<&str, &str> = HashMap::with_capacity(orders.len());
    for &(m, tokens) in orders {
        let key = sku_key(m);
        if tokens.is_empty() && !token_skus.contains(&key) {
            continue; // A ROW order: its units are the counter's.
        }
        let (activity, sku, user) = buyer(m);
        let reservation = m.reservation_id.as_str();
        assert!(
            tokens.len() == m.quantity as usize,
            "plan breaks I1 (no oversell): reservation {reservation} (activity {activity}, sku \
             {sku}, user {user}) of {} units planned with {} tokens",
            m.quantity,
            tokens.len()
        );
        for token in tokens {
            let token = token.as_str();
            assert!(
                locked.get(token) == Some(&key),
                "plan breaks I1 (no oversell): reservation {reservation} (activity {activity}, \
                 sku {sku}, user {user}) planned with token {token}, which is not a token \
                 locked for its SKU"
            );
            let first = holders.insert(token, reservation);
            assert!(
                first.is_none(),
                "plan breaks I1 (no oversell): token {token} (activity {activity}, sku {sku}) \
                 planned for reservations {} and {reservation}",
                first.unwrap_or_default()
            );
        }
    }
}

/// I2: no two orders for one buyer (activity, SKU, user) in the plan, and none for a buyer the
/// facts show already holding an order.
fn assert_one_order_per_buyer(
    messages: &[&OrderCreate],
    facts: &Facts,
    orders: &[(&OrderCreate, &[String])],
) {
    let holding: HashSet<(u64, u64, u64)> =
        facts.ordered_positions.iter().filter_map(|&p| messages.get(p)).map(|m| buyer(m)).collect();
    let mut planned: HashMap<(u64, u64, u64), &str> = HashMap::with_capacity(orders.len());
    for &(m, _) in orders {
        let (activity, sku, user) = buyer(m);
        let reservation = m.reservation_id.as_str();
        assert!(
            !holding.contains(&(activity, sku, user)),
            "plan breaks I2 (one order per buyer): an order planned for buyer (activity \
             {activity}, sku {sku}, user {user}), who already holds one per the facts read; \
             reservation {reservation}"
        );
        let first = planned.insert((activity, sku, user), reservation);
        assert!(
            first.is_none(),
            "plan breaks I2 (one order per buyer): two orders planned for buyer (activity \
             {activity}, sku {sku}, user {user}): reservations {} and {reservation}",
            first.unwrap_or_default()
        );
    }
}

/// The buyer of a message: (activity, SKU, user), the key of `orders`' one-per-buyer rule.
fn buyer(m: &OrderCreate) -> (u64, u64, u64) {
    (m.activity_id, m.sku_id, m.user_id)
}

/// The buyer's request (rule 2b).
fn request(m: &OrderCreate) -> (u64, u64, u64, &str) {
    (m.activity_id, m.sku_id, m.user_id, m.request_id.as_str())
}

/// The SKU key as PostgreSQL stores it. `wire::OrderCreate::validate` bounds the ids by
/// i64::MAX; saturate like the per-message path does (the SQL then finds no such SKU).
pub fn sku_key(m: &OrderCreate) -> SkuKey {
    (bigint(m.activity_id), bigint(m.sku_id))
}

pub fn bigint(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsale_io::wire::ORDER_CREATE_EVENT_TYPE;
    use proptest::prelude::*;

    const NOW_MS: u64 = 1_000_000;

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

    fn token_sku(sku_id: i64, tokens: &[&str], contended: bool) -> SkuFacts {
        SkuFacts {
            key: (1, sku_id),
            claim: SkuClaim::Token {
                tokens: tokens.iter().map(|t| (*t).to_owned()).collect(),
                contended,
            },
            claim_us: Some(3),
        }
    }

    fn inserted(messages: &[&OrderCreate]) -> Vec<String> {
        messages.iter().map(|m| m.message_id.clone()).collect()
    }

    #[test]
    fn a_duplicate_buyer_leaves_its_unit_to_the_next_message() {
        let (a, b, c) = (message("a", 2, 7), message("b", 2, 7), message("c", 2, 8));
        let batch = [&a, &b, &c];
        let facts = Facts {
            inserted_ids: inserted(&batch),
            skus: vec![token_sku(2, &["t1", "t2"], false)],
            ..Facts::default()
        };
        let plan = plan(&batch, &facts, NOW_MS).expect("plan");
        assert_eq!(
            plan.outcomes,
            vec![
                WriteOutcome::Created {
                    order_id: a.order_id(),
                    token_ids: vec!["t1".into()],
                    claim_us: Some(3)
                },
                WriteOutcome::Rejected { reason: RejectReason::DuplicateUser, claim_us: Some(3) },
                WriteOutcome::Created {
                    order_id: c.order_id(),
                    token_ids: vec!["t2".into()],
                    claim_us: Some(3)
                },
            ]
        );
        assert_eq!(
            plan.finals.iter().map(|f| f.status).collect::<Vec<_>>(),
            ["ORDER_CREATED", "REJECTED_DUPLICATE_USER", "ORDER_CREATED"]
        );
    }

    /// A quantity takes its units all or none: 2 asked with 1 left is no final stock and the
    /// unit stays for a later message of 1; the ROW counter is lowered by the units ordered.
    #[test]
    fn a_quantity_takes_all_its_units_or_none() {
        let two = |tag: &str, user| OrderCreate { quantity: 2, ..message(tag, 2, user) };
        let (a, b, c) = (two("a", 7), two("b", 8), message("c", 2, 9));
        let batch = [&a, &b, &c];
        let facts = Facts {
            inserted_ids: inserted(&batch),
            skus: vec![token_sku(2, &["t1", "t2", "t3"], false)],
            ..Facts::default()
        };
        let plan = plan(&batch, &facts, NOW_MS).expect("plan");
        assert_eq!(
            plan.outcomes,
            vec![
                WriteOutcome::Created {
                    order_id: a.order_id(),
                    token_ids: vec!["t1".into(), "t2".into()],
                    claim_us: Some(3)
                },
                WriteOutcome::Rejected { reason: RejectReason::NoFinalStock, claim_us: Some(3) },
                WriteOutcome::Created {
                    order_id: c.order_id(),
                    token_ids: vec!["t3".into()],
                    claim_us: Some(3)
                },
            ]
        );
        let row = Facts {
            skus: vec![SkuFacts {
                key: (1, 2),
                claim: SkuClaim::Row { available: 3 },
                claim_us: None,
            }],
            ..facts
        };
        let plan = super::plan(&batch, &row, NOW_MS).expect("plan");
        assert_eq!(plan.row_units, vec![((1, 2), 3)]);
        assert_eq!(
            plan.finals.iter().map(|f| f.status).collect::<Vec<_>>(),
            ["ORDER_CREATED", "REJECTED_NO_FINAL_STOCK", "ORDER_CREATED"]
        );
    }

    #[test]
    fn contention_is_sticky_and_a_repeat_of_a_contended_message_is_contended() {
        let (a, b) = (message("a", 2, 7), message("b", 2, 8));
        let batch = [&a, &b, &a];
        let facts = Facts {
            inserted_ids: inserted(&[&a, &b]),
            skus: vec![token_sku(2, &[], true)],
            ..Facts::default()
        };
        let plan = plan(&batch, &facts, NOW_MS).expect("plan");
        assert_eq!(plan.outcomes, vec![WriteOutcome::Contended; 3]);
        assert_eq!(plan.contended_ids, vec!["msg_a".to_owned(), "msg_b".to_owned()]);
        assert!(plan.finals.is_empty());
    }

    #[test]
    fn row_units_are_counted_per_sku() {
        let (a, b, c) = (message("a", 2, 7), message("b", 2, 8), message("c", 2, 9));
        let batch = [&a, &b, &c];
        let facts = Facts {
            inserted_ids: inserted(&batch),
            skus: vec![SkuFacts {
                key: (1, 2),
                claim: SkuClaim::Row { available: 2 },
                claim_us: Some(1),
            }],
            ..Facts::default()
        };
        let plan = plan(&batch, &facts, NOW_MS).expect("plan");
        assert_eq!(plan.row_units, vec![((1, 2), 2)]);
        assert_eq!(
            plan.outcomes[2],
            WriteOutcome::Rejected { reason: RejectReason::NoFinalStock, claim_us: Some(1) }
        );
    }

    #[test]
    fn sku_claims_follow_the_per_message_branches() {
        let tokens = || vec!["t1".to_owned()];
        assert_eq!(SkuClaim::from_facts(None, None, None, vec![], false), SkuClaim::Closed);
        assert_eq!(
            SkuClaim::from_facts(Some("TERMINATED"), Some("ROW"), Some(3), vec![], false),
            SkuClaim::Closed
        );
        assert_eq!(
            SkuClaim::from_facts(Some("ENDED"), Some("ROW"), Some(3), vec![], false),
            SkuClaim::Row { available: 3 }
        );
        assert_eq!(
            SkuClaim::from_facts(Some("ACTIVE"), Some("TOKEN"), None, tokens(), true),
            SkuClaim::Token { tokens: tokens(), contended: true }
        );
    }

    #[test]
    fn missing_facts_are_an_error_not_an_outcome() {
        let a = message("a", 2, 7);
        let facts = Facts { inserted_ids: inserted(&[&a]), ..Facts::default() };
        assert_eq!(plan(&[&a], &facts, NOW_MS), Err(InconsistentFacts("no facts for a SKU")));
    }

    // -----------------------------------------------------------------------------------------
    // Against a model: the per-message function of migration 0002, transliterated statement by
    // statement over an in-memory database (inbox, reservations, orders, a token pool refilled
    // from the lowest AVAILABLE seq, tokens held by "others"). The planner, fed the facts such a
    // database would give, must answer exactly what the model answers message by message.

    #[derive(Clone, Debug)]
    struct World {
        /// (sku, user) of each order already committed.
        orders: Vec<(u64, u64)>,
        /// Committed reservations: (reservation tag, status).
        recorded: Vec<(String, String)>,
        /// Committed inbox ids.
        inbox: Vec<String>,
        /// Per SKU 2 and 3: AVAILABLE token count, of which the last `held` are locked by
        /// others (TOKEN); SKU 4 is ROW with this many units; SKU 5 is TERMINATED.
        tokens: [u64; 2],
        held: [u64; 2],
        row_units: u64,
    }

    fn model(world: &World, batch: &[&OrderCreate]) -> Vec<WriteOutcome> {
        let mut inbox: HashSet<String> = world.inbox.iter().cloned().collect();
        let mut recorded: HashMap<String, Recorded> = world
            .recorded
            .iter()
            .map(|(r, s)| {
                let recorded = if s == ORDER_CREATED_STATUS {
                    Recorded::Created { order_id: format!("ord_{r}") }
                } else {
                    RejectReason::from_reservation_status(s)
                        .map_or(Recorded::Unresolved, Recorded::Rejected)
                };
                (r.clone(), recorded)
            })
            .collect();
        let mut orders: HashSet<(u64, u64)> = world.orders.iter().copied().collect();
        // (sku, user, request id) recorded other than as a duplicate buyer (step 2b); the
        // world's committed reservations carry no request of a batch's buyers.
        let mut requests: HashSet<(u64, u64, String)> = HashSet::new();
        // Per TOKEN SKU: next free seq, last free seq (others hold the rest), pool.
        let mut next = [1u64, 1u64];
        let mut pools: [VecDeque<String>; 2] = [VecDeque::new(), VecDeque::new()];
        let mut row_left = world.row_units;
        let mut out = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            if !inbox.insert(m.message_id.clone()) {
                out.push(WriteOutcome::Duplicate {
                    recorded: recorded
                        .get(&m.reservation_id)
                        .cloned()
                        .unwrap_or(Recorded::Unresolved),
                });
                continue;
            }
            if let Some(r) = recorded.get(&m.reservation_id) {
                out.push(WriteOutcome::Duplicate { recorded: r.clone() });
                continue;
            }
            let reject = |reason: RejectReason, claim_us: Option<i64>| WriteOutcome::Rejected {
                reason,
                claim_us,
            };
            let request = (m.sku_id, m.user_id, m.request_id.clone());
            let outcome = if requests.contains(&request) {
                reject(RejectReason::DuplicateUser, None)
            } else if m.reservation_expires_at_ms <= NOW_MS {
                reject(RejectReason::Expired, None)
            } else if m.sku_id == 5 || m.sku_id == 6 {
                reject(RejectReason::ActivityTerminated, None)
            } else if m.sku_id == 4 {
                let q = u64::from(m.quantity);
                if row_left < q {
                    reject(RejectReason::NoFinalStock, Some(3))
                } else if !orders.insert((m.sku_id, m.user_id)) {
                    reject(RejectReason::DuplicateUser, Some(3))
                } else {
                    row_left -= q;
                    WriteOutcome::Created {
                        order_id: m.order_id(),
                        token_ids: Vec::new(),
                        claim_us: Some(3),
                    }
                }
            } else {
                let s = (m.sku_id - 2) as usize;
                let free = world.tokens[s] - world.held[s];
                let q = m.quantity as usize;
                if pools[s].len() < q {
                    // Refill up to the greater of this SKU's units asked from here to the
                    // batch's end and this message's own quantity (0010's pool size).
                    let rest: u64 = batch[i..]
                        .iter()
                        .filter(|x| x.sku_id == m.sku_id)
                        .map(|x| u64::from(x.quantity))
                        .sum();
                    refill(&mut pools[s], &mut next[s], free, rest.max(q as u64), m.sku_id);
                }
                if pools[s].len() < q {
                    if world.held[s] > 0 {
                        inbox.remove(&m.message_id);
                        out.push(WriteOutcome::Contended);
                        continue;
                    }
                    reject(RejectReason::NoFinalStock, Some(3))
                } else if !orders.insert((m.sku_id, m.user_id)) {
                    reject(RejectReason::DuplicateUser, Some(3))
                } else {
                    WriteOutcome::Created {
                        order_id: m.order_id(),
                        token_ids: pools[s].drain(..q).collect(),
                        claim_us: Some(3),
                    }
                }
            };
            let r = match &outcome {
                WriteOutcome::Created { order_id, .. } => {
                    Recorded::Created { order_id: order_id.clone() }
                }
                WriteOutcome::Rejected { reason, .. } => Recorded::Rejected(*reason),
                _ => unreachable!("final outcomes only here"),
            };
            if r != Recorded::Rejected(RejectReason::DuplicateUser) {
                requests.insert(request);
            }
            recorded.insert(m.reservation_id.clone(), r);
            out.push(outcome);
        }
        out
    }

    /// The model's pool refill: the lowest free seqs, up to `want` tokens in the pool.
    fn refill(pool: &mut VecDeque<String>, next: &mut u64, free: u64, want: u64, sku: u64) {
        while (pool.len() as u64) < want && *next <= free {
            pool.push_back(format!("t{sku}_{next}"));
            *next += 1;
        }
    }

    /// The facts `flashsale_order_facts` would read from `world` for `batch`.
    fn facts_of(world: &World, batch: &[&OrderCreate]) -> Facts {
        let mut inserted_ids: Vec<String> = Vec::new();
        for m in batch {
            if !world.inbox.contains(&m.message_id) && !inserted_ids.contains(&m.message_id) {
                inserted_ids.push(m.message_id.clone());
            }
        }
        let recorded = batch
            .iter()
            .filter_map(|m| world.recorded.iter().find(|(r, _)| *r == m.reservation_id))
            .map(|(r, s)| RecordedRow {
                reservation_id: r.clone(),
                status: s.clone(),
                order_id: (s == ORDER_CREATED_STATUS).then(|| format!("ord_{r}")),
            })
            .collect();
        let ordered_positions = batch
            .iter()
            .enumerate()
            .filter(|(_, m)| {
                m.reservation_expires_at_ms > NOW_MS
                    && world.orders.contains(&(m.sku_id, m.user_id))
            })
            .map(|(i, _)| i)
            .collect();
        let mut skus = Vec::new();
        for sku in 2..=6u64 {
            let distinct: HashMap<&str, u64> = batch
                .iter()
                .filter(|m| m.sku_id == sku && m.reservation_expires_at_ms > NOW_MS)
                .map(|m| (m.message_id.as_str(), u64::from(m.quantity)))
                .collect();
            if distinct.is_empty() {
                continue;
            }
            let wanted: u64 = distinct.values().sum();
            let claim = match sku {
                2 | 3 => {
                    let s = (sku - 2) as usize;
                    let free = world.tokens[s] - world.held[s];
                    let got = free.min(wanted);
                    SkuClaim::Token {
                        tokens: (1..=got).map(|n| format!("t{sku}_{n}")).collect(),
                        contended: got < wanted && world.held[s] > 0,
                    }
                }
                4 => SkuClaim::Row { available: world.row_units },
                _ => SkuClaim::Closed,
            };
            let claim_us = (claim != SkuClaim::Closed).then_some(3);
            skus.push(SkuFacts { key: (1, sku as i64), claim, claim_us });
        }
        Facts { inserted_ids, recorded, ordered_positions, requested_positions: Vec::new(), skus }
    }

    fn world() -> impl Strategy<Value = World> {
        (
            proptest::collection::vec((2u64..=4, 0u64..6), 0..4),
            proptest::collection::vec((0usize..12, 0usize..5), 0..3),
            proptest::collection::vec(0usize..12, 0..3),
            [0u64..6, 0u64..6],
            [0u64..3, 0u64..3],
            0u64..6,
        )
            .prop_map(|(orders, recorded, inbox, tokens, held, row_units)| {
                let statuses = [
                    "ORDER_CREATED",
                    "REJECTED_EXPIRED",
                    "REJECTED_NO_FINAL_STOCK",
                    "REJECTED_ACTIVITY",
                    "REJECTED_DUPLICATE_USER",
                ];
                World {
                    orders,
                    recorded: recorded
                        .into_iter()
                        .map(|(r, s)| (format!("resv_{r}"), statuses[s].to_owned()))
                        .fold(Vec::new(), |mut kept: Vec<(String, String)>, (r, s)| {
                            if !kept.iter().any(|(k, _)| *k == r) {
                                kept.push((r, s));
                            }
                            kept
                        }),
                    inbox: inbox.into_iter().map(|i| format!("msg_{i}")).collect(),
                    held: [held[0].min(tokens[0]), held[1].min(tokens[1])],
                    tokens,
                    row_units,
                }
            })
    }

    /// Messages over 12 tags (so repeats, reservations under two ids and shared buyers are
    /// common), SKUs 2..=6 and 6 buyers, 1 to 3 units each; some expired.
    fn batch() -> impl Strategy<Value = Vec<OrderCreate>> {
        let spec = (0usize..12, 0usize..12, 2u64..=6, 0u64..6, any::<bool>(), 0u8..4, 1u32..=3);
        proptest::collection::vec(spec, 1..24).prop_map(|specs| {
            specs
                .into_iter()
                .map(|(msg, resv, sku, user, expired, shared_request, quantity)| {
                    // A message id always carries the same body; the reservation id is
                    // shared by design between some message ids, a quarter of the
                    // messages carry their buyer's one shared request id (step 2b), and
                    // quantities are 1 to 3 units.
                    let resv = if resv % 3 == 0 { resv } else { msg };
                    let mut m = message(&format!("{msg}"), sku, user);
                    m.reservation_id = format!("resv_{resv}");
                    m.quantity = quantity;
                    if shared_request == 0 {
                        m.request_id = format!("req_shared_{user}");
                    }
                    if expired && msg % 4 == 0 {
                        m.reservation_expires_at_ms = NOW_MS;
                    }
                    m
                })
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]
        #[test]
        fn the_plan_answers_what_the_per_message_function_answers(world in world(), batch in batch()) {
            // One body per message id: the first one generated wins.
            let mut bodies: HashMap<String, OrderCreate> = HashMap::new();
            let batch: Vec<OrderCreate> = batch
                .into_iter()
                .map(|m| bodies.entry(m.message_id.clone()).or_insert(m).clone())
                .collect();
            let refs: Vec<&OrderCreate> = batch.iter().collect();
            let facts = facts_of(&world, &refs);
            let planned = plan(&refs, &facts, NOW_MS).expect("plan");
            prop_assert_eq!(&planned.outcomes, &model(&world, &refs));
            // Every final outcome has its row, and only those.
            let finals = planned.outcomes.iter().filter(|o| matches!(o, WriteOutcome::Created { .. } | WriteOutcome::Rejected { .. })).count();
            prop_assert_eq!(finals, planned.finals.len());
        }
    }
}
