//! A submission on its owner shard, as a sans-I/O pair (DESIGN.md sections 3.1, 4 and 7):
//!
//! 1. [`OwnerState::begin`] decides everything that needs no I/O, in one call: the SKU's
//!    partition (replay, conflict, closed activity, sold out, the per-SKU admission bound),
//!    then `decide_submit` over the shard's view of the world with the Redis circuit consulted
//!    once, then this shard's in-flight bound and the expensive path's adaptive limit
//!    (`overload.rs`: past it, `OVERLOADED` with `ADAPTIVE_LIMIT`); it either answers at once
//!    or hands out a [`Call`]: a [`Ticket`] (the partition's permit and the circuit's call,
//!    both owed back), the place on the path (owed to [`OwnerState::path_done`] after the
//!    publish) and the reservation and message ids, minted before the side effect that needs
//!    them.
//! 2. The shard calls `reserve` (the only I/O) and maps the reply to a [`ReserveResult`].
//! 3. [`OwnerState::finish`] takes the ticket and the result back, in one call: the circuit
//!    learns the outcome, the partition its permit and what it saw (maybe a sold-out flip to
//!    broadcast), and the answer — or, for `CREATED`, the order-create message to publish.
//! 4. After the publish, [`OwnerState::on_published`] turns the answer into `QUEUED` when the
//!    log acknowledged it.
//!
//! Every permit is returned exactly once (a second return panics in release builds: an
//! admission slot counted twice would let the bound drift), the in-flight count never goes
//! below zero, and an answer that promises a place in the queue always carries its
//! reservation id. Time is an argument; nothing here reads a clock or touches a socket.
//!
//! Read next: `shard/submit.rs` (the I/O between the calls), `partition.rs` (the per-SKU
//! state), `admission.rs` (`decide_submit`).

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use flashsale_io::wire::{OrderCreate, ReservationFacts};

use crate::logic::admission::{decide_submit, AdmissionInput, Backlog, Budgets, Decision};
use crate::logic::api::PayloadHash;
use crate::logic::circuit::{Admit, Call as CircuitCall, CallOutcome, Circuit, CircuitConfig};
use crate::logic::circuit::{CircuitState, ProbeOrNormal};
use crate::logic::ids::{BusinessId, IdGenerator, IdKind, UserId};
use crate::logic::modes::EffectiveMode;
use crate::logic::outcome::SubmitOutcome;
use crate::logic::overload::{AdaptiveLimit, OverloadConfig, Permit as PathPermit};
use crate::logic::partition::{
    Accepted, AcceptedBudget, AcceptedState, ActivitySnapshot, PartitionLimits, Permit,
    ReplicaUpdate, ReserveSeen, SkuPartition, SubmitPlan,
};
use crate::logic::placement::SkuKey;

/// An answer to a submit, ready to be written (and `Send`, to cross the mesh).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitAnswer {
    pub outcome: SubmitOutcome,
    pub reservation_id: Option<Arc<str>>,
    pub reason_code: Option<Cow<'static, str>>,
    pub retry_after_ms: Option<u64>,
    pub replayed: bool,
}

impl SubmitAnswer {
    /// An answer that holds no reservation (never `QUEUED`/`QUEUED_PENDING`).
    pub fn of(outcome: SubmitOutcome) -> SubmitAnswer {
        assert!(!outcome.holds_reservation(), "{outcome:?} must carry its reservation id");
        SubmitAnswer {
            outcome,
            reservation_id: None,
            reason_code: None,
            retry_after_ms: None,
            replayed: false,
        }
    }

    /// `QUEUED` / `QUEUED_PENDING` (and `DUPLICATE_USER`): with the reservation it names.
    pub fn holding(outcome: SubmitOutcome, reservation_id: Arc<str>) -> SubmitAnswer {
        assert!(!reservation_id.is_empty(), "a held reservation has an id");
        SubmitAnswer {
            outcome,
            reservation_id: Some(reservation_id),
            reason_code: None,
            retry_after_ms: None,
            replayed: false,
        }
    }

    pub fn retry(outcome: SubmitOutcome, retry_after_ms: u64) -> SubmitAnswer {
        SubmitAnswer { retry_after_ms: Some(retry_after_ms), ..SubmitAnswer::of(outcome) }
    }

    /// The same answer with a `reason_code`.
    pub fn with_reason(self, reason: &'static str) -> SubmitAnswer {
        SubmitAnswer { reason_code: Some(Cow::Borrowed(reason)), ..self }
    }

    pub fn invalid(reason: &'static str) -> SubmitAnswer {
        SubmitAnswer::of(SubmitOutcome::Invalid).with_reason(reason)
    }

    /// The first answer of a request accepted before.
    pub fn replay(entry: &Accepted) -> SubmitAnswer {
        let outcome = match entry.state {
            AcceptedState::Queued => SubmitOutcome::Queued,
            AcceptedState::QueuedPending => SubmitOutcome::QueuedPending,
        };
        SubmitAnswer {
            replayed: true,
            ..SubmitAnswer::holding(outcome, Arc::clone(&entry.reservation_id))
        }
    }
}

/// A submit as its owner works on it.
#[derive(Debug, Clone, Copy)]
pub struct SubmitRequest<'a> {
    pub key: SkuKey,
    pub request_id: &'a str,
    pub user_id: UserId,
    /// The units asked (1..=`QUANTITY_MAX`), in the payload hash.
    pub quantity: u32,
    pub payload_hash: &'a PayloadHash,
    pub traceparent: Option<&'a str>,
}

/// What the shard knows of the world beyond the owner state (admission's other inputs).
#[derive(Debug, Clone, Copy)]
pub struct Outside {
    pub mode: EffectiveMode,
    pub log_publish: CircuitState,
    pub backlog: Backlog,
    pub pg_outage_age_ms: u64,
    /// A uniform random draw (RECOVERING/SHED_LOAD shares, Retry-After jitter).
    pub draw: u64,
}

/// The bounds of an owner state, fixed at start.
#[derive(Debug, Clone, Copy)]
pub struct OwnerLimits {
    pub partition: PartitionLimits,
    /// SKUs with state of their own; the rest share one admission bucket.
    pub skus_tracked_max: usize,
    /// Accepted-map entries over all SKUs of this shard.
    pub accepted_per_shard_max: usize,
    /// Submissions being worked on at once (admission's local in-flight).
    pub in_flight_max: u32,
    pub budgets: Budgets,
    pub redis_circuit: CircuitConfig,
    /// Redis nodes with a circuit of their own (a cluster's masters); beyond it the rest
    /// share one.
    pub redis_nodes_max: usize,
    /// Retry-After of a `SYSTEM_BUSY` when `reserve` did not run.
    pub busy_retry_ms: u64,
    /// The expensive path's adaptive limit (`overload.rs`).
    pub overload: OverloadConfig,
}

/// What `reserve` said, as the decision needs it (the shard maps the script binding's reply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveResult {
    Created {
        stock_after: u64,
        expires_at_ms: u64,
    },
    /// Recorded before with the same payload: its ids and how it was first answered.
    Idempotent {
        reservation_id: String,
        message_id: String,
        first: AcceptedState,
    },
    SoldOut,
    DuplicateUser {
        reservation_id: String,
    },
    /// The quantity is over the SKU's limit per buyer.
    OverLimit,
    /// Fewer units left than the quantity, but some: nothing reserved, not sold out.
    FewerLeft,
    ActivityInvalid,
    /// The SKU has no `meta` in Redis: unknown to Redis, or its keys lost (`finish` tells the
    /// two apart by what the owner knew of the activity).
    MetaMissing,
    IdempotencyConflict,
    /// The library refused an argument (bad input, or a bound the edge and the library
    /// disagree on): nothing was reserved, and the node answered — it is healthy.
    Refused,
    /// The function did not run (not sent, or the node failed): nothing was reserved.
    NotRun,
    /// The function may have run (written, no answer; or an unreadable answer).
    Unknown,
}

impl ReserveResult {
    /// Whether Redis held the SKU's `meta` when it answered (`reserve` reads it before these
    /// answers; `IDEMPOTENT` and `IDEMPOTENCY_CONFLICT` come before it).
    fn proves_meta(&self) -> bool {
        matches!(
            self,
            ReserveResult::Created { .. }
                | ReserveResult::SoldOut
                | ReserveResult::DuplicateUser { .. }
                | ReserveResult::OverLimit
                | ReserveResult::FewerLeft
                | ReserveResult::ActivityInvalid
        )
    }
}

/// `reason_code` of an `INVALID` answer for a quantity over the SKU's limit per buyer.
pub const QUANTITY_OVER_LIMIT: &str = "QUANTITY_OVER_LIMIT";

/// `reason_code` of a `SOLD_OUT` answer when units are left, but fewer than asked: the buyer
/// may ask for fewer (nothing was reserved; the SKU is not sold out).
pub const QUANTITY_UNAVAILABLE: &str = "QUANTITY_UNAVAILABLE";

/// `reason_code` of an `INVALID` answer for a value the store refused (`ReserveResult::Refused`).
pub const ARGUMENT_REFUSED: &str = "ARGUMENT_REFUSED";

/// `reason_code` of an `OVERLOADED` answer past the adaptive limit (`REJECT_REASONS`).
pub const ADAPTIVE_LIMIT: &str = "ADAPTIVE_LIMIT";

/// `reason_code` of a SKU closed by a Redis failover (`REJECT_REASONS`).
pub const REDIS_FAILOVER: &str = "REDIS_FAILOVER";

/// `reason_code` of a SKU closed because Redis lost its keys (`REJECT_REASONS`): closed until
/// rebuilt from PostgreSQL and reconciled (`shard/failover.rs`).
pub const REDIS_DATA_LOST: &str = "REDIS_DATA_LOST";

/// The key used for SKUs without local state: one shared admission bucket per shard.
const UNTRACKED: SkuKey = SkuKey { activity_id: 0, sku_id: 0 };

/// Proof that a submit holds an admission slot and a circuit call; owed back to
/// [`OwnerState::finish`].
#[derive(Debug)]
#[must_use = "a ticket holds an admission slot and a circuit call until finish takes it"]
pub struct Ticket {
    key: SkuKey,
    /// False: the SKU shares the untracked bucket (its stock must not flip a flag).
    tracked: bool,
    permit: Permit,
    /// The Redis node whose circuit admitted the call.
    node: Option<SocketAddr>,
    call: CircuitCall,
}

/// The go-ahead for `reserve`, with the ids it must use.
#[derive(Debug)]
pub struct Call {
    pub ticket: Ticket,
    pub reservation_id: BusinessId,
    pub message_id: BusinessId,
    /// The place on the expensive path; [`Finish`] hands it back for
    /// [`OwnerState::path_done`] once the answer (after the publish) is known.
    pub path: PathPermit,
    /// The SKU is sold out and this instance's replay map not loaded yet: the request's record
    /// and the buyer's marker are read instead of calling `reserve` (nothing can be reserved).
    pub sold_out_reads: bool,
}

/// The first step's outcome.
#[derive(Debug)]
pub enum Begin {
    /// Answer now; `admission_reject` names `decide_submit`'s reason when it refused.
    Answer {
        answer: SubmitAnswer,
        admission_reject: Option<&'static str>,
    },
    Call(Call),
}

/// The second step's outcome.
#[derive(Debug)]
pub struct Finish {
    /// The answer so far (`QUEUED_PENDING` with its id when `publish` is set).
    pub answer: SubmitAnswer,
    /// A sold-out flip for every shard's replica.
    pub replica: Option<ReplicaUpdate>,
    /// `CREATED`: the order-create message to publish (same ids forever after).
    pub publish: Option<OrderCreate>,
    /// The Redis circuit after this call (for its gauge).
    pub redis_circuit: CircuitState,
    /// Owed to [`OwnerState::path_done`] when the answer is final (after the publish).
    pub path: PathPermit,
    /// This call found the SKU's keys lost (Redis had no `meta` for a SKU whose activity the
    /// owner knew) and closed it (`REDIS_DATA_LOST`): the caller reports it once.
    pub data_lost: bool,
}

/// Everything the owner shard decides submissions with, behind one borrow.
pub struct OwnerState {
    limits: OwnerLimits,
    partitions: HashMap<SkuKey, SkuPartition>,
    accepted_budget: AcceptedBudget,
    /// One circuit per Redis node (a master down closes only the SKUs it serves); `None` is
    /// the node not known yet (no slot map) and the shared one past `redis_nodes_max`.
    redis_circuits: HashMap<Option<SocketAddr>, Circuit>,
    ids: IdGenerator,
    /// Submissions between `begin` and `finish`.
    in_flight: u32,
    /// How many of them the expensive path takes at once, found from its latency.
    overload: AdaptiveLimit,
}

impl OwnerState {
    /// The adaptive limit's first window starts at time 0: the first `begin` closes it.
    pub fn new(limits: OwnerLimits, id_seed: [u8; 32]) -> OwnerState {
        OwnerState {
            overload: AdaptiveLimit::new(limits.overload, 0),
            limits,
            partitions: HashMap::new(),
            accepted_budget: AcceptedBudget::new(limits.accepted_per_shard_max),
            redis_circuits: HashMap::new(),
            ids: IdGenerator::new(id_seed),
            in_flight: 0,
        }
    }

    /// Submissions between `begin` and `finish` right now.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// The expensive path's limit (its gauge, readiness).
    pub fn overload(&self) -> &AdaptiveLimit {
        &self.overload
    }

    /// Moves the adaptive limit on when a window has passed (the heartbeat calls it, so that
    /// a shard without submissions still recovers its readiness).
    pub fn overload_tick(&mut self, now_ms: u64, backlog: Backlog) {
        self.overload.tick(now_ms, backlog.oldest_pending_age_ms);
    }

    /// The expensive path answered `latency_us` after its place was taken.
    pub fn path_done(&mut self, path: PathPermit, latency_us: u64) {
        self.overload.complete(path, latency_us);
    }

    /// The worst Redis circuit (the gauge: one open circuit is what an operator must see).
    pub fn redis_circuit(&self, now_ms: u64) -> CircuitState {
        let states = self.redis_circuits.values().map(|c| c.state(now_ms));
        states.max_by_key(|s| s.metric_value()).unwrap_or(CircuitState::Closed)
    }

    /// The circuit of `node` (created on first use; the shared one past the bound).
    fn circuit(&mut self, node: Option<SocketAddr>) -> &mut Circuit {
        let known = self.redis_circuits.contains_key(&node);
        let slot = if known || self.redis_circuits.len() < self.limits.redis_nodes_max {
            node
        } else {
            None
        };
        let config = self.limits.redis_circuit;
        self.redis_circuits.entry(slot).or_insert_with(|| Circuit::new(config))
    }

    /// Accepted-map entries the shard may still add.
    pub fn accepted_left(&self) -> usize {
        self.accepted_budget.left()
    }

    /// This SKU's partition (created on first use, or the shared untracked bucket once
    /// `skus_tracked_max` SKUs have state), and whether it is the SKU's own.
    fn partition(&mut self, key: SkuKey, now_ms: u64) -> (&mut SkuPartition, bool) {
        let tracked = self.partitions.contains_key(&key)
            || self.partitions.len() < self.limits.skus_tracked_max;
        let slot = if tracked { key } else { UNTRACKED };
        let limits = self.limits.partition;
        let partition =
            self.partitions.entry(slot).or_insert_with(|| SkuPartition::new(slot, limits, now_ms));
        (partition, tracked)
    }

    /// The SKU's own partition, if it has one (never the untracked bucket).
    fn own_partition(&mut self, key: SkuKey) -> Option<&mut SkuPartition> {
        if key == UNTRACKED {
            return None;
        }
        self.partitions.get_mut(&key)
    }

    /// Step 1 (module documentation). `node`: the Redis node serving the SKU's slot now.
    pub fn begin(
        &mut self,
        request: &SubmitRequest<'_>,
        node: Option<SocketAddr>,
        outside: &Outside,
        now_ms: u64,
    ) -> Begin {
        let failover_retry_ms = self.limits.budgets.dependency_retry_ms;
        self.overload_tick(now_ms, outside.backlog);
        let (partition, tracked) = self.partition(request.key, now_ms);
        // A permit for a sold-out partition means its replays are not loaded yet.
        let sold_out_reads = partition.is_sold_out();
        let permit = match plan_permit(partition, request, failover_retry_ms, now_ms) {
            Ok(permit) => permit,
            Err((answer, admission_reject)) => return Begin::Answer { answer, admission_reject },
        };
        let key = partition.key();
        // The Redis circuit is consulted once: its answer is both admission's input and, when
        // everything admits, the call itself.
        let circuit = self.circuit(node).allow(now_ms);
        let input = self.admission_input(outside, redis_state(&circuit));
        let decision = decide_submit(&input, &self.limits.budgets, now_ms);
        // Everything else admits: the last word is the expensive path's own limit.
        let path = match (decision, &circuit) {
            (Decision::Admit, Admit::Call(_)) => {
                Some(self.overload.try_acquire(outside.draw as u32))
            }
            _ => None,
        };
        match (decision, circuit, path) {
            (Decision::Admit, Admit::Call(call), Some(Ok(path))) => {
                self.in_flight += 1;
                assert!(self.in_flight <= self.limits.in_flight_max, "in-flight bound broken");
                let reservation_id = self.ids.next(IdKind::Reservation, now_ms);
                let message_id = self.ids.next(IdKind::Message, now_ms);
                Begin::Call(Call {
                    ticket: Ticket { key, tracked, permit, node, call },
                    reservation_id,
                    message_id,
                    path,
                    sold_out_reads,
                })
            }
            (Decision::Admit, Admit::Call(call), Some(Err(retry_after_ms))) => {
                self.give_back(key, permit);
                self.circuit(node).cancel(call);
                let answer = SubmitAnswer::retry(SubmitOutcome::Overloaded, retry_after_ms);
                Begin::Answer {
                    answer: answer.with_reason(ADAPTIVE_LIMIT),
                    admission_reject: Some(ADAPTIVE_LIMIT),
                }
            }
            (decision, circuit, _) => {
                self.give_back(key, permit);
                if let Admit::Call(call) = circuit {
                    self.circuit(node).cancel(call);
                }
                Begin::Answer {
                    answer: rejected(decision),
                    admission_reject: decision_reason(decision),
                }
            }
        }
    }

    /// Admission's view of this shard and the world, with the Redis circuit's state.
    fn admission_input(&self, outside: &Outside, redis: CircuitState) -> AdmissionInput {
        AdmissionInput {
            mode: outside.mode,
            redis,
            log_publish: outside.log_publish,
            backlog: outside.backlog,
            pg_outage_age_ms: outside.pg_outage_age_ms,
            in_flight: self.in_flight,
            in_flight_max: self.limits.in_flight_max,
            draw: outside.draw,
        }
    }

    /// Step 3 (module documentation): `result` is what `reserve` said under `call`'s ids.
    pub fn finish(
        &mut self,
        call: Call,
        request: &SubmitRequest<'_>,
        result: ReserveResult,
        now_ms: u64,
    ) -> Finish {
        let Call { ticket, reservation_id, message_id, path, .. } = call;
        let Ticket { key, tracked, permit, node, call: circuit_call } = ticket;
        assert!(self.in_flight > 0, "a submission finished that never began");
        self.in_flight -= 1;
        let health = match result {
            ReserveResult::NotRun => CallOutcome::Failure,
            ReserveResult::Unknown => CallOutcome::Unknown,
            // A refusal is the node answering: one buyer's value never opens the circuit.
            ReserveResult::Refused => CallOutcome::Success,
            _ => CallOutcome::Success,
        };
        self.circuit(node).record(circuit_call, health, now_ms);
        let missing = result == ReserveResult::MetaMissing && tracked;
        let lost = missing && self.knew_activity(key);
        let (seen, answer, publish) = if lost {
            let retry_ms = self.limits.budgets.dependency_retry_ms;
            (ReserveSeen::Other, closed_for(REDIS_DATA_LOST, retry_ms), None)
        } else {
            classify(&result, request, reservation_id.as_str(), message_id.as_str(), self.limits)
        };
        let publish = publish.map(|expires_at_ms| {
            let facts = ReservationFacts {
                message_id: message_id.as_str(),
                reservation_id: reservation_id.as_str(),
                request_id: request.request_id,
                activity_id: request.key.activity_id,
                sku_id: request.key.sku_id,
                user_id: request.user_id.0,
                quantity: request.quantity,
                reserved_at_ms: now_ms,
                expires_at_ms,
                payload_hash: request.payload_hash.as_str(),
                traceparent: request.traceparent,
                send_attempts: 0,
            };
            OrderCreate::for_reservation(&facts, now_ms)
        });
        // The untracked bucket shares admission only: never let one SKU's stock flip it.
        let seen = if tracked { seen } else { ReserveSeen::Other };
        let partition = self.partitions.get_mut(&key).unwrap_or_else(|| missing_partition(key));
        let replica =
            partition.on_reserve(permit, request.user_id.0, seen, &mut self.accepted_budget);
        if result.proves_meta() {
            partition.saw_meta();
        } else if missing && !lost {
            partition.saw_meta_missing();
        }
        let data_lost = lost && partition.mark_data_lost(now_ms);
        let redis_circuit = self.redis_circuit(now_ms);
        Finish { answer, replica, publish, redis_circuit, path, data_lost }
    }

    /// Step 4 (module documentation): the log acknowledged (`Acked`) the message of the
    /// answer `pending` from [`Finish`], or did not in time.
    pub fn on_published(
        &mut self,
        request: &SubmitRequest<'_>,
        pending: SubmitAnswer,
        published: Published,
    ) -> SubmitAnswer {
        assert_eq!(pending.outcome, SubmitOutcome::QueuedPending, "only a fresh reservation");
        match published {
            Published::NotAcked => pending,
            Published::Acked => {
                if let Some(partition) = self.own_partition(request.key) {
                    partition.on_queued(request.user_id.0, request.request_id);
                }
                SubmitAnswer { outcome: SubmitOutcome::Queued, ..pending }
            }
        }
    }

    fn give_back(&mut self, key: SkuKey, permit: Permit) {
        let partition = self.partitions.get_mut(&key).unwrap_or_else(|| missing_partition(key));
        partition.release(permit);
    }

    /// The SKUs with state of their own (for the periodic refreshes).
    pub fn tracked_skus(&self) -> Vec<SkuKey> {
        self.partitions.keys().filter(|k| **k != UNTRACKED).copied().collect()
    }

    /// The SKUs whose sold-out flag is due for a stock re-read.
    pub fn stock_checks_due(&self, now_ms: u64) -> Vec<SkuKey> {
        let due =
            self.partitions.iter().filter(|(k, p)| **k != UNTRACKED && p.stock_check_due(now_ms));
        due.map(|(k, _)| *k).collect()
    }

    /// The activity snapshot read from Redis' `meta`.
    pub fn set_activity(&mut self, key: SkuKey, snapshot: ActivitySnapshot) {
        if let Some(partition) = self.own_partition(key) {
            partition.set_activity(snapshot);
        }
    }

    /// A stock re-read's result; a flip for the replicas when positive stock clears the flag.
    pub fn on_stock_observed(
        &mut self,
        key: SkuKey,
        stock: i64,
        now_ms: u64,
    ) -> Option<ReplicaUpdate> {
        self.own_partition(key)?.on_stock_observed(stock, now_ms)
    }

    /// The SKU's Redis node failed over: closed until `clear_failover` (state is created for
    /// a SKU not seen yet; a SKU past `skus_tracked_max` cannot be closed alone and is left to
    /// Redis and reconcile).
    pub fn mark_failover(&mut self, key: SkuKey, now_ms: u64) {
        if let (partition, true) = self.partition(key, now_ms) {
            partition.mark_failover(now_ms);
        }
    }

    /// The SKU's keys are lost (no `meta` in Redis for a SKU on sale): closed until rebuilt
    /// from PostgreSQL and reconciled. True when this call marked it.
    pub fn mark_data_lost(&mut self, key: SkuKey, now_ms: u64) -> bool {
        match self.partition(key, now_ms) {
            (partition, true) => partition.mark_data_lost(now_ms),
            (_, false) => false,
        }
    }

    /// Whether the owner knew the SKU's `meta` (from a refresh, or a `reserve` answer that
    /// read it): then a missing `meta` is a loss, not a SKU Redis never had.
    pub fn knew_activity(&self, key: SkuKey) -> bool {
        key != UNTRACKED && self.partitions.get(&key).is_some_and(SkuPartition::knew_meta)
    }

    /// Whether the SKU's closure began with its keys seen gone.
    pub fn data_lost(&self, key: SkuKey) -> bool {
        self.partitions.get(&key).is_some_and(SkuPartition::data_lost)
    }

    /// The SKUs whose `reserve` found no `meta` while the owner did not know them, since the
    /// last call (cleared): the failover task asks PostgreSQL whether they are on sale.
    pub fn suspects(&mut self) -> Vec<SkuKey> {
        let marked = self.partitions.iter_mut().filter(|(k, _)| **k != UNTRACKED);
        marked.filter_map(|(k, p)| p.take_meta_missing().then_some(*k)).collect()
    }

    /// Whether redis-sync's events for the SKU are held back (lost, not rebuilt yet).
    pub fn holds_events(&self, key: SkuKey) -> bool {
        key != UNTRACKED && self.partitions.get(&key).is_some_and(SkuPartition::holds_events)
    }

    /// The SKU's `meta` is back: its events apply again (`SkuPartition::release_events`).
    pub fn release_events(&mut self, key: SkuKey) {
        if let Some(partition) = self.own_partition(key) {
            partition.release_events();
        }
    }

    pub fn clear_failover(&mut self, key: SkuKey) {
        if let Some(partition) = self.own_partition(key) {
            partition.clear_failover();
        }
    }

    /// The SKUs closed by a failover, with when it was seen.
    pub fn failed_over(&self) -> Vec<(SkuKey, u64)> {
        let marked = self.partitions.iter().filter(|(k, _)| **k != UNTRACKED);
        marked.filter_map(|(k, p)| Some((*k, p.failover_since_ms()?))).collect()
    }

    /// Whether the SKU's request records should be loaded now (sold out, replays incomplete,
    /// no load running); see `logic/partition.rs`.
    pub fn replay_load_due(&mut self, key: SkuKey) -> bool {
        self.own_partition(key).is_some_and(SkuPartition::replay_load_due)
    }

    /// Whether this instance's replay map already holds this request (its record need not be
    /// read again).
    pub fn knows_request(&self, key: SkuKey, user_id: u64, request_id: &str) -> bool {
        self.partitions.get(&key).is_some_and(|p| p.knows_request(user_id, request_id))
    }

    /// The load's result (`None`: failed); a flip for the replicas when the map is complete.
    pub fn on_replays_loaded(
        &mut self,
        key: SkuKey,
        loaded: Option<Vec<(u64, Accepted)>>,
    ) -> Option<ReplicaUpdate> {
        let partition = self.partitions.get_mut(&key).filter(|_| key != UNTRACKED)?;
        partition.on_replays_loaded(loaded, &mut self.accepted_budget)
    }

    /// A compensation returned a unit: not sold out any more.
    pub fn on_stock_returned(&mut self, key: SkuKey) -> Option<ReplicaUpdate> {
        self.own_partition(key)?.on_stock_returned()
    }

    /// Whether this shard's flag says the SKU is sold out (a stock-returned notice from
    /// another instance is then worth a re-read of `stock`).
    pub fn is_sold_out(&mut self, key: SkuKey) -> bool {
        self.own_partition(key).is_some_and(|p| p.is_sold_out())
    }
}

/// How the log took an order-create message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// Acknowledged within the wait: durably in the log.
    Acked,
    /// Refused, timed out, or not sent (open circuit, full queue): the scanner republishes.
    NotAcked,
}

#[cold]
fn missing_partition(key: SkuKey) -> ! {
    // A ticket is only issued for a partition that exists, and partitions are never removed.
    panic!("no partition for {key:?} although it issued a permit")
}

fn plan_answer(plan: SubmitPlan) -> SubmitAnswer {
    match plan {
        SubmitPlan::Replay(entry) => SubmitAnswer::replay(&entry),
        SubmitPlan::Conflict => SubmitAnswer::of(SubmitOutcome::IdempotencyConflict),
        SubmitPlan::NotActive => SubmitAnswer::of(SubmitOutcome::ActivityNotActive),
        SubmitPlan::SoldOut => SubmitAnswer::of(SubmitOutcome::SoldOut),
        SubmitPlan::Overloaded { retry_after_ms } => {
            SubmitAnswer::retry(SubmitOutcome::Overloaded, u64::from(retry_after_ms))
        }
        SubmitPlan::CallRedis(_) | SubmitPlan::RedisFailover { .. } => {
            unreachable!("the caller answers CallRedis and RedisFailover itself")
        }
    }
}

/// A refusal of admission (or of the circuit, which admission then reports as open).
fn rejected(decision: Decision) -> SubmitAnswer {
    match decision {
        Decision::Reject { outcome, retry_after_ms, reason } => {
            SubmitAnswer::retry(outcome, retry_after_ms).with_reason(reason)
        }
        // Admission admitted but the circuit refused: decide_submit saw it as open and would
        // have refused, so this arm only exists for the type.
        Decision::Admit => SubmitAnswer::retry(SubmitOutcome::SystemBusy, 1),
    }
}

fn decision_reason(decision: Decision) -> Option<&'static str> {
    match decision {
        Decision::Reject { reason, .. } => Some(reason),
        Decision::Admit => None,
    }
}

/// Step 1's first decision, the partition's: a permit to call Redis, or the answer at once
/// with its admission reason (replay, conflict, closed activity, sold out, the SKU's bound
/// full, or its Redis node failed over: `SUBMIT_CLOSED` with `REDIS_FAILOVER`, retry after
/// `failover_retry_ms`).
fn plan_permit(
    partition: &mut SkuPartition,
    request: &SubmitRequest<'_>,
    failover_retry_ms: u64,
    now_ms: u64,
) -> Result<Permit, (SubmitAnswer, Option<&'static str>)> {
    let plan = partition.plan_submit(
        request.user_id.0,
        request.request_id,
        request.payload_hash.as_str(),
        now_ms,
    );
    match plan {
        SubmitPlan::CallRedis(permit) => Ok(permit),
        SubmitPlan::RedisFailover { data_lost } => {
            let reason = if data_lost { REDIS_DATA_LOST } else { REDIS_FAILOVER };
            Err((closed_for(reason, failover_retry_ms), Some(reason)))
        }
        plan => Err((plan_answer(plan), None)),
    }
}

/// `SUBMIT_CLOSED` with `reason`, retry after `retry_ms`: nothing was reserved.
fn closed_for(reason: &'static str, retry_ms: u64) -> SubmitAnswer {
    SubmitAnswer::retry(SubmitOutcome::SubmitClosed, retry_ms).with_reason(reason)
}

/// The Redis circuit's state as admission sees it, from what it said to this call.
fn redis_state(circuit: &Admit) -> CircuitState {
    match circuit {
        Admit::Reject { .. } => CircuitState::Open,
        Admit::Call(call) if call.kind() == ProbeOrNormal::Probe => CircuitState::HalfOpen,
        Admit::Call(_) => CircuitState::Closed,
    }
}

/// What the partition learns, what the client gets, and (for CREATED) the expiry of the
/// message to publish.
fn classify(
    result: &ReserveResult,
    request: &SubmitRequest<'_>,
    reservation_id: &str,
    message_id: &str,
    limits: OwnerLimits,
) -> (ReserveSeen, SubmitAnswer, Option<u64>) {
    let entry = |reservation_id: &str, message_id: &str, state| Accepted {
        request_id: Arc::from(request.request_id),
        reservation_id: Arc::from(reservation_id),
        message_id: Arc::from(message_id),
        payload_hash: Arc::from(request.payload_hash.as_str()),
        state,
    };
    match result {
        ReserveResult::Created { stock_after, expires_at_ms } => {
            let accepted = entry(reservation_id, message_id, AcceptedState::QueuedPending);
            let answer = SubmitAnswer::holding(
                SubmitOutcome::QueuedPending,
                Arc::clone(&accepted.reservation_id),
            );
            let seen = if *stock_after == 0 {
                ReserveSeen::AcceptedLast(accepted)
            } else {
                ReserveSeen::Accepted(accepted)
            };
            (seen, answer, Some(*expires_at_ms))
        }
        ReserveResult::Idempotent { reservation_id, message_id, first } => {
            let accepted = entry(reservation_id, message_id, *first);
            let answer = SubmitAnswer::replay(&accepted);
            (ReserveSeen::Accepted(accepted), answer, None)
        }
        ReserveResult::SoldOut => {
            (ReserveSeen::SoldOut, SubmitAnswer::of(SubmitOutcome::SoldOut), None)
        }
        ReserveResult::DuplicateUser { reservation_id } => {
            let answer = SubmitAnswer::holding(
                SubmitOutcome::DuplicateUser,
                Arc::from(reservation_id.as_str()),
            );
            (ReserveSeen::Other, answer, None)
        }
        ReserveResult::OverLimit => {
            (ReserveSeen::Other, SubmitAnswer::invalid(QUANTITY_OVER_LIMIT), None)
        }
        ReserveResult::FewerLeft => (
            ReserveSeen::Other,
            SubmitAnswer::of(SubmitOutcome::SoldOut).with_reason(QUANTITY_UNAVAILABLE),
            None,
        ),
        ReserveResult::ActivityInvalid | ReserveResult::MetaMissing => {
            (ReserveSeen::Other, SubmitAnswer::of(SubmitOutcome::ActivityNotActive), None)
        }
        ReserveResult::IdempotencyConflict => {
            (ReserveSeen::Other, SubmitAnswer::of(SubmitOutcome::IdempotencyConflict), None)
        }
        ReserveResult::Refused => {
            (ReserveSeen::Other, SubmitAnswer::invalid(ARGUMENT_REFUSED), None)
        }
        ReserveResult::NotRun => (
            ReserveSeen::Other,
            SubmitAnswer::retry(SubmitOutcome::SystemBusy, limits.busy_retry_ms),
            None,
        ),
        ReserveResult::Unknown => {
            (ReserveSeen::Other, SubmitAnswer::of(SubmitOutcome::Unknown), None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logic::api::payload_hash;
    use crate::logic::ids::{ActivityId, SkuId};
    use crate::logic::modes::{Mode, ModeSource, Scope};
    use proptest::prelude::*;

    const NOW: u64 = 1_000_000;

    fn limits() -> OwnerLimits {
        OwnerLimits {
            partition: PartitionLimits {
                accepted_max: 8,
                attempts_per_s: 1_000_000,
                attempts_burst: 1_000,
                in_flight_max: 3,
                stock_recheck_ms: 100,
                overloaded_retry_ms: 50,
            },
            skus_tracked_max: 2,
            accepted_per_shard_max: 10,
            in_flight_max: 4,
            budgets: Budgets::default(),
            redis_circuit: CircuitConfig::default(),
            redis_nodes_max: 4,
            busy_retry_ms: 1_000,
            // Out of the way of these tests (its own test below brings it close).
            overload: OverloadConfig { limit_max: 1_000_000, ..OverloadConfig::default() }.pinned(),
        }
    }

    fn hash(user: u64) -> PayloadHash {
        payload_hash(ActivityId(1), SkuId(2), UserId(user), 1)
    }

    fn outside(closed: bool, now: u64) -> Outside {
        let mode = if closed {
            EffectiveMode {
                mode: Mode::SubmitClosed,
                source: ModeSource::Snapshot { scope: Scope::Global, version: 1 },
            }
        } else {
            EffectiveMode::NO_SNAPSHOT
        };
        Outside {
            mode,
            log_publish: CircuitState::Closed,
            backlog: Backlog { oldest_pending_age_ms: 0, pending_count: 0, polled_at_ms: now },
            pg_outage_age_ms: 0,
            draw: 7,
        }
    }

    fn request<'a>(sku: u64, id: &'a str, hash: &'a PayloadHash) -> SubmitRequest<'a> {
        SubmitRequest {
            key: SkuKey::new(1, sku),
            request_id: id,
            user_id: UserId(3),
            quantity: 1,
            payload_hash: hash,
            traceparent: None,
        }
    }

    fn call(begin: Begin) -> Call {
        match begin {
            Begin::Call(call) => call,
            Begin::Answer { answer, .. } => panic!("expected a call, got {answer:?}"),
        }
    }

    #[test]
    fn created_publishes_with_the_minted_ids_and_the_returned_expiry_then_replays() {
        let mut owner = OwnerState::new(limits(), [1; 32]);
        let h = hash(3);
        let r = request(2, "req_1", &h);
        let c = call(owner.begin(&r, None, &outside(false, NOW), NOW));
        let (resv, msg) = (c.reservation_id.as_str().to_owned(), c.message_id.as_str().to_owned());
        let created = ReserveResult::Created { stock_after: 5, expires_at_ms: NOW + 300_000 };
        let finish = owner.finish(c, &r, created, NOW);
        let message = finish.publish.expect("CREATED publishes");
        assert_eq!((message.reservation_id.as_str(), message.message_id.as_str()), (&*resv, &*msg));
        assert_eq!(message.reservation_expires_at_ms, NOW + 300_000);
        assert_eq!(finish.answer.outcome, SubmitOutcome::QueuedPending);
        let queued = owner.on_published(&r, finish.answer, Published::Acked);
        assert_eq!(
            (queued.outcome, queued.reservation_id.as_deref()),
            (SubmitOutcome::Queued, Some(&*resv))
        );
        // The same request again is answered from memory with the first answer.
        match owner.begin(&r, None, &outside(false, NOW), NOW) {
            Begin::Answer { answer, admission_reject: None } => {
                assert_eq!(answer.outcome, SubmitOutcome::Queued);
                assert!(answer.replayed);
                assert_eq!(answer.reservation_id.as_deref(), Some(&*resv));
            }
            other => panic!("expected a replay, got {other:?}"),
        }
        assert_eq!(owner.in_flight(), 0);
    }

    /// Sold out with the replays not loaded, a request still needs Redis (a retry must get
    /// its first answer), but only its record read, not a `reserve` (issue 25); loaded, it is
    /// answered here.
    #[test]
    fn sold_out_before_the_replays_are_loaded_asks_for_reads_not_a_reserve() {
        let mut owner = OwnerState::new(limits(), [6; 32]);
        let h = hash(3);
        let key = SkuKey::new(1, 2);
        let r = request(2, "req_1", &h);
        let c = call(owner.begin(&r, None, &outside(false, NOW), NOW));
        assert!(!c.sold_out_reads, "not sold out: reserve");
        let finish = owner.finish(c, &r, ReserveResult::SoldOut, NOW);
        owner.path_done(finish.path, 10);
        let r2 = request(2, "req_2", &h);
        let c = call(owner.begin(&r2, None, &outside(false, NOW), NOW));
        assert!(c.sold_out_reads, "sold out, replays not loaded: reads");
        let finish = owner.finish(c, &r2, ReserveResult::SoldOut, NOW);
        owner.path_done(finish.path, 10);
        assert_eq!(finish.answer.outcome, SubmitOutcome::SoldOut);
        assert!(owner.replay_load_due(key));
        owner.on_replays_loaded(key, Some(Vec::new()));
        match owner.begin(&request(2, "req_3", &h), None, &outside(false, NOW), NOW) {
            Begin::Answer { answer, .. } => assert_eq!(answer.outcome, SubmitOutcome::SoldOut),
            Begin::Call(_) => panic!("loaded replays answer a sold-out SKU without Redis"),
        }
    }

    /// A SKU whose `meta` Redis no longer has: unknown to the owner it is `ACTIVITY_NOT_ACTIVE`
    /// and a suspect for PostgreSQL; known (a `reserve` answer read its meta) it is lost —
    /// closed with its own reason, once, its events held until `meta` is back.
    #[test]
    fn a_sku_whose_meta_vanished_is_closed_as_lost_once_the_owner_knew_it() {
        let mut owner = OwnerState::new(limits(), [5; 32]);
        let h = hash(3);
        let key = SkuKey::new(1, 2);
        let r = request(2, "req_1", &h);
        let c = call(owner.begin(&r, None, &outside(false, NOW), NOW));
        let unknown = owner.finish(c, &r, ReserveResult::MetaMissing, NOW);
        assert_eq!(unknown.answer.outcome, SubmitOutcome::ActivityNotActive);
        assert!(!unknown.data_lost);
        owner.path_done(unknown.path, 10);
        assert_eq!(owner.suspects(), [key], "asked of PostgreSQL");
        assert_eq!(owner.suspects(), [], "once");

        let c = call(owner.begin(&r, None, &outside(false, NOW), NOW));
        let finish = owner.finish(c, &r, ReserveResult::SoldOut, NOW);
        owner.path_done(finish.path, 10);
        assert!(owner.knew_activity(key), "SOLD_OUT is read after meta");
        let r2 = request(2, "req_2", &h);
        let c = call(owner.begin(&r2, None, &outside(false, NOW), NOW));
        let lost = owner.finish(c, &r2, ReserveResult::MetaMissing, NOW);
        owner.path_done(lost.path, 10);
        assert!(lost.data_lost, "reported once");
        assert_eq!(lost.answer.outcome, SubmitOutcome::SubmitClosed);
        assert_eq!(lost.answer.reason_code.as_deref(), Some(REDIS_DATA_LOST));
        assert!(owner.holds_events(key));
        assert!(!owner.mark_data_lost(key, NOW + 1), "already marked");
        assert_eq!(owner.failed_over(), [(key, NOW)]);
        // Closed: answered without a call, with the same reason.
        match owner.begin(&request(2, "req_3", &h), None, &outside(false, NOW), NOW) {
            Begin::Answer { answer, admission_reject } => {
                assert_eq!(answer.reason_code.as_deref(), Some(REDIS_DATA_LOST));
                assert_eq!(admission_reject, Some(REDIS_DATA_LOST));
            }
            other => panic!("expected SUBMIT_CLOSED, got {other:?}"),
        }
        // Meta back: events apply again, still closed until a reconcile passes.
        owner.release_events(key);
        assert!(!owner.holds_events(key));
        assert_eq!(owner.failed_over(), [(key, NOW)]);
        owner.clear_failover(key);
        assert_eq!(owner.failed_over(), []);
        assert!(!owner.data_lost(key));
        assert_eq!(owner.in_flight(), 0);
    }

    #[test]
    fn an_admission_refusal_gives_back_a_half_open_probe() {
        let mut owner = OwnerState::new(limits(), [2; 32]);
        let h = hash(3);
        // Open the Redis circuit with failures.
        let mut now = NOW;
        while owner.redis_circuit(now) == CircuitState::Closed {
            let id = format!("f{now}");
            let r = request(2, &id, &h);
            let c = call(owner.begin(&r, None, &outside(false, now), now));
            owner.finish(c, &r, ReserveResult::NotRun, now);
            now += 1;
        }
        now += limits().redis_circuit.open_max_ms + 1;
        assert_eq!(owner.redis_circuit(now), CircuitState::HalfOpen);
        // Far more refusals (mode closed) than there are probes: none may leak a probe.
        for i in 0..(limits().redis_circuit.half_open_probes * 4) {
            let id = format!("c{i}");
            let r = request(2, &id, &h);
            let Begin::Answer { answer, admission_reject } =
                owner.begin(&r, None, &outside(true, now), now)
            else {
                panic!("a closed mode refuses")
            };
            assert_eq!(
                (answer.outcome, admission_reject),
                (SubmitOutcome::SubmitClosed, Some("MODE_SUBMIT_CLOSED"))
            );
        }
        // Long after a lost probe would have re-opened it, a probe is still available.
        now += limits().redis_circuit.probe_timeout_ms + 1;
        let r = request(2, "probe", &h);
        let c = call(owner.begin(&r, None, &outside(false, now), now));
        owner.finish(c, &r, ReserveResult::SoldOut, now);
        assert_ne!(owner.redis_circuit(now), CircuitState::Open);
    }

    /// Issue 23: one buyer whose value the store refuses, however often, never opens the
    /// SKU's Redis circuit; the same number of node failures does (the control).
    #[test]
    fn refused_arguments_never_open_the_circuit_failures_do() {
        let h = hash(3);
        let run = |result: fn() -> ReserveResult| {
            let mut owner = OwnerState::new(limits(), [5; 32]);
            let mut answers = Vec::new();
            for now in NOW..NOW + 50 {
                let id = format!("r{now}");
                let r = request(2, &id, &h);
                match owner.begin(&r, None, &outside(false, now), now) {
                    Begin::Call(c) => answers.push(owner.finish(c, &r, result(), now).answer),
                    Begin::Answer { answer, .. } => answers.push(answer),
                }
            }
            (owner.redis_circuit(NOW + 50), answers)
        };
        let (circuit, answers) = run(|| ReserveResult::Refused);
        assert_eq!(circuit, CircuitState::Closed);
        assert!(answers.iter().all(|a| a.outcome == SubmitOutcome::Invalid
            && a.reason_code.as_deref() == Some(ARGUMENT_REFUSED)));
        let (circuit, answers) = run(|| ReserveResult::NotRun);
        assert_eq!(circuit, CircuitState::Open, "the control: node failures do open it");
        assert!(answers.iter().all(|a| a.outcome == SubmitOutcome::SystemBusy));
    }

    /// Issue 24: past the adaptive limit a new request is answered `OVERLOADED` at once with
    /// its reason and a jittered Retry-After, nothing minted, its partition permit and circuit
    /// call given back; a replay of an accepted request is still answered; a finished path
    /// frees its place.
    #[test]
    fn past_the_adaptive_limit_new_requests_are_shed_and_replays_still_answered() {
        let two =
            OverloadConfig { limit_min: 1, limit_max: 2, limit_initial: 2, ..limits().overload };
        let mut owner = OwnerState::new(OwnerLimits { overload: two, ..limits() }, [6; 32]);
        let h = hash(3);
        let (r1, r2, r3) = (request(2, "a", &h), request(2, "b", &h), request(2, "c", &h));
        let c1 = call(owner.begin(&r1, None, &outside(false, NOW), NOW));
        let created = ReserveResult::Created { stock_after: 5, expires_at_ms: NOW + 300_000 };
        let f1 = owner.finish(c1, &r1, created, NOW);
        let queued = owner.on_published(&r1, f1.answer, Published::Acked);
        let c2 = call(owner.begin(&r2, None, &outside(false, NOW), NOW));
        // r1's path still holds its place (its answer not sent yet) and r2 holds the other.
        let Begin::Answer { answer, admission_reject } =
            owner.begin(&r3, None, &outside(false, NOW), NOW)
        else {
            panic!("past the limit a new request is shed")
        };
        assert_eq!(admission_reject, Some(ADAPTIVE_LIMIT));
        assert_eq!(answer.outcome, SubmitOutcome::Overloaded);
        assert_eq!(answer.reason_code.as_deref(), Some(ADAPTIVE_LIMIT));
        assert_eq!(answer.reservation_id, None, "nothing reserved");
        let retry = answer.retry_after_ms.expect("Retry-After");
        let base = two.retry_ms;
        assert!((base..base + base / 2).contains(&retry), "jittered: {retry}");
        assert_eq!(owner.in_flight(), 1, "the shed request holds nothing");
        // The accepted buyer's replay is answered from memory whatever the load.
        match owner.begin(&r1, None, &outside(false, NOW), NOW) {
            Begin::Answer { answer, admission_reject: None } => {
                assert_eq!((answer.outcome, answer.replayed), (queued.outcome, true));
            }
            other => panic!("expected a replay, got {other:?}"),
        }
        owner.path_done(f1.path, 1_000);
        let c3 = call(owner.begin(&r3, None, &outside(false, NOW), NOW));
        let f2 = owner.finish(c2, &r2, ReserveResult::SoldOut, NOW);
        let f3 = owner.finish(c3, &r3, ReserveResult::SoldOut, NOW);
        owner.path_done(f2.path, 1_000);
        owner.path_done(f3.path, 1_000);
        assert_eq!((owner.in_flight(), owner.overload().in_flight()), (0, 0));
    }

    /// SKUs 0 and 1 on two masters, 2 and 3 where no slot map is known yet.
    fn node_of(sku: u64) -> Option<SocketAddr> {
        (sku < 2).then(|| SocketAddr::from(([127, 0, 0, 1], 7000 + sku as u16)))
    }

    #[test]
    fn one_failing_redis_node_closes_only_its_own_skus() {
        let mut owner = OwnerState::new(limits(), [4; 32]);
        let h = hash(3);
        let mut now = NOW;
        // Node of SKU 0 fails until its circuit opens.
        loop {
            let id = format!("f{now}");
            let r = request(0, &id, &h);
            match owner.begin(&r, node_of(0), &outside(false, now), now) {
                Begin::Call(c) => {
                    owner.finish(c, &r, ReserveResult::NotRun, now);
                }
                Begin::Answer { answer, admission_reject } => {
                    assert_eq!(answer.outcome, SubmitOutcome::SystemBusy);
                    assert_eq!(admission_reject, Some("REDIS_UNAVAILABLE"));
                    break;
                }
            }
            now += 1;
        }
        assert_eq!(owner.redis_circuit(now), CircuitState::Open, "the gauge shows the worst");
        // SKU 1's node is healthy: still called.
        let r = request(1, "ok-1", &h);
        let c = call(owner.begin(&r, node_of(1), &outside(false, now), now));
        let created = ReserveResult::Created { stock_after: 1, expires_at_ms: now + 1 };
        assert_eq!(owner.finish(c, &r, created, now).answer.outcome, SubmitOutcome::QueuedPending);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Begin { sku: u64, id: u8, closed: bool },
        Finish { pick: usize, result: u8 },
        Tick(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..4, 0u8..12, any::<bool>()).prop_map(|(sku, id, closed)| Op::Begin {
                sku,
                id,
                closed: closed && id % 3 == 0
            }),
            (any::<usize>(), 0u8..8).prop_map(|(pick, result)| Op::Finish { pick, result }),
            any::<u16>().prop_map(Op::Tick),
        ]
    }

    fn result_of(n: u8, now: u64) -> ReserveResult {
        match n {
            0 => ReserveResult::Created { stock_after: 3, expires_at_ms: now + 1 },
            1 => ReserveResult::Created { stock_after: 0, expires_at_ms: now + 1 },
            2 => ReserveResult::Idempotent {
                reservation_id: "resv_old".into(),
                message_id: "msg_old".into(),
                first: AcceptedState::Queued,
            },
            3 => ReserveResult::SoldOut,
            4 => ReserveResult::DuplicateUser { reservation_id: "resv_other".into() },
            5 => ReserveResult::NotRun,
            6 => ReserveResult::Unknown,
            _ => ReserveResult::ActivityInvalid,
        }
    }

    proptest! {
        /// Every reply x every admission input: the owner's and each partition's in-flight
        /// counts equal the outstanding tickets and never pass their bounds; every answer that
        /// holds a reservation names it; CREATED (and only CREATED) asks for a publish; the
        /// accepted maps never pass the shard's budget; and once everything finished, nothing
        /// is held.
        #[test]
        fn permits_and_counters_stay_balanced(ops in proptest::collection::vec(op(), 1..300)) {
            let lim = limits();
            let mut owner = OwnerState::new(lim, [3; 32]);
            let h = hash(3);
            let mut outstanding: Vec<(Call, u64, String)> = Vec::new();
            let mut now = NOW;
            for op in ops {
                match op {
                    Op::Begin { sku, id, closed } => {
                        let id = format!("r{id}");
                        let r = request(sku, &id, &h);
                        match owner.begin(&r, node_of(sku), &outside(closed, now), now) {
                            Begin::Call(c) => outstanding.push((c, sku, id)),
                            Begin::Answer { answer, .. } => {
                                if answer.outcome.holds_reservation() {
                                    prop_assert!(answer.reservation_id.is_some());
                                }
                            }
                        }
                    }
                    Op::Finish { pick, result } => {
                        if outstanding.is_empty() { continue; }
                        let (c, sku, id) = outstanding.swap_remove(pick % outstanding.len());
                        let r = request(sku, &id, &h);
                        let result = result_of(result, now);
                        let created = matches!(result, ReserveResult::Created { .. });
                        let finish = owner.finish(c, &r, result, now);
                        prop_assert_eq!(finish.publish.is_some(), created);
                        if finish.answer.outcome.holds_reservation() {
                            prop_assert!(finish.answer.reservation_id.is_some());
                        }
                        if created {
                            let answer = owner.on_published(&r, finish.answer, Published::Acked);
                            prop_assert_eq!(answer.outcome, SubmitOutcome::Queued);
                        }
                    }
                    Op::Tick(ms) => now += u64::from(ms),
                }
                prop_assert_eq!(owner.in_flight() as usize, outstanding.len());
                prop_assert!(owner.in_flight() <= lim.in_flight_max);
                for (key, partition) in &owner.partitions {
                    let held = outstanding
                        .iter()
                        .filter(|(c, _, _)| c.ticket.key == *key)
                        .count();
                    prop_assert_eq!(partition.in_flight() as usize, held);
                    prop_assert!(partition.in_flight() <= lim.partition.in_flight_max);
                }
                let accepted: usize = owner.partitions.values().map(|p| p.accepted_len()).sum();
                prop_assert!(accepted + owner.accepted_left() == lim.accepted_per_shard_max);
                prop_assert!(owner.partitions.len() <= lim.skus_tracked_max + 1);
            }
            for (c, sku, id) in outstanding.drain(..) {
                let r = request(sku, &id, &h);
                owner.finish(c, &r, ReserveResult::Unknown, now);
            }
            prop_assert_eq!(owner.in_flight(), 0);
            for partition in owner.partitions.values() {
                prop_assert_eq!(partition.in_flight(), 0);
            }
        }
    }
}
