//! `flashsale-pg-worker`: the PostgreSQL side of flashsale, the final source of
//! truth (DESIGN.md section 2).
//!
//! What it is today: the schema and its migrations (`migrate`), inventory token
//! generation and claiming (`tokens`), and the crate's one error type with its
//! retry classification (`error`).
//!
//! What it is not: the edge (no Redis, no HTTP), nor the JetStream client (the
//! `io` crate). The consumer loop that turns order-create messages into
//! orders, and the outbox publisher, are built on these pieces (DESIGN.md
//! section 5).
//!
//! Read next: `migrations/0001_init.sql` for the tables and which invariant of
//! DESIGN.md section 8 each constraint enforces; then `migrate.rs`, `tokens.rs`.

pub mod edge;
pub mod error;
pub mod migrate;
pub mod tokens;

pub use error::PgError;
pub use migrate::{apply_migrations, migrate, MigrateReport, Migration, MIGRATIONS};
pub use tokens::{claim_token, generate_tokens, ClaimOutcome};
