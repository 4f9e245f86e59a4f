//! `flashsale-pg-worker`: the PostgreSQL side of flashsale, the final source of
//! truth (DESIGN.md section 2).
//!
//! What it is: the schema and its migrations (`migrate`), inventory token
//! generation and claiming (`tokens`), the crate's one error type with its
//! retry classification (`error`), and the durable pipeline's PostgreSQL side
//! (DESIGN.md section 5):
//!
//! - `order_path`: several order-create messages per transaction, each outcome kept apart,
//!   set-based (`set_writer`, with `plan` deciding every outcome sans I/O) or one function
//!   call per message (`order_writer`, the fallback and reference); what both writers share:
//!   `statements` (prepared statements, pipelining) and `batch_events` (the outbox rows);
//!   `settle_expired`: an operator's settlement through that path;
//!   `classify`: the sans-I/O rules that settle each delivery (ack after commit,
//!   NAK with backoff, dead letter) and the event each outcome announces;
//!   `compensation`: THE rule of which Redis effects each rejection undoes;
//! - `outbox`: `SKIP LOCKED` batches of `event_outbox` to `SECKILL_EVENTS`;
//! - `pg_stats`: the primary's replication, lock waits and connections (dependency metrics)
//! - `payments`: callbacks, cancel, the closer; `payment_unknown`: orders held PAYMENT_UNKNOWN
//!   without a provider to ask; `payment_statement` (sans-I/O) and `payment_reconcile`: the
//!   provider's statement compared with, and applied through, the payment state machine;
//! - `worker`: the pool of tasks on its own tokio runtime (`start` →
//!   `WorkerHandle`; `WorkerConfig` in `worker/config.rs`, one file per task), used by
//!   `flashsale serve` and `flashsale worker`;
//!   `batching`: the sans-I/O size of each pull (the batch follows the backlog);
//! - `pool`: the connection pool (multi-host URLs); `sql`: the statements;
//! - `audit`: the invariant checker of DESIGN.md section 8 (items 1–3, 7);
//! - `pitr`: what the backup commands ask the server itself (archiving, recovery, newest
//!   commit); `restore_audit`: the checks of a restored copy (the reconcile half per SKU, the
//!   ledger and payments against the orders, every unique key);
//! - `activity_creation`, `lifecycle`, `sku`: what the admin plane asks of PostgreSQL
//!   (activities created; SKUs added, ended, terminated, topped up; a SKU's config and its
//!   sellable units); `reservation_lookup`: the query fallback; `redis_rebuild`: what a SKU
//!   Redis lost is rebuilt from.
//!
//! What it is not: the edge (no Redis, no HTTP), nor the JetStream client (the
//! `io` crate's `log`, which this crate drives).
//!
//! Read next: `migrations/0001_init.sql` for the tables and which invariant of
//! DESIGN.md section 8 each constraint enforces, `0002_order_create.sql` for the
//! per-message transaction, `0004_order_create_set.sql` for the set-based one; then
//! `worker/mod.rs`, `order_path.rs`, `set_writer.rs`, `plan.rs`, `classify.rs`.

pub mod activity_creation;
pub mod audit;
pub mod batch_events;
pub mod batching;
pub mod classify;
pub mod compensation;
pub mod error;
pub mod lifecycle;
pub mod migrate;
pub mod order_path;
pub mod order_writer;
pub mod outbox;
pub mod payment_reconcile;
pub mod payment_statement;
pub mod payment_unknown;
pub mod payments;
pub mod pg_stats;
pub mod pitr;
pub mod plan;
pub mod pool;
pub mod provider;
pub mod reconcile;
pub mod redis_rebuild;
pub mod reservation_lookup;
pub mod restore_audit;
pub mod set_writer;
pub mod settle_expired;
pub mod sku;
pub mod sql;
pub mod statements;
pub mod tokens;
pub mod worker;

/// The pool crate, so callers can name `Pool` / `Client` without depending on it.
pub use deadpool_postgres;

pub use audit::{check_invariants, InvariantReport};
pub use classify::{Action, Attempt, Recorded, RetryPolicy, WriteOutcome};
pub use error::PgError;
pub use migrate::{apply_migrations, migrate, MigrateReport, Migration, MIGRATIONS};
pub use order_path::{write_batch, write_batch_with, OrderPath};
pub use order_writer::write_batch_per_message;
pub use outbox::{publish_once, OutboxRound};
pub use pool::{build_pool, PgPoolConfig};
pub use set_writer::SET_BATCH_MAX;
pub use settle_expired::{settle_expired, Settled};
pub use tokens::{claim_token, generate_tokens, ClaimOutcome};
pub use worker::{start, WorkerConfig, WorkerHandle};
