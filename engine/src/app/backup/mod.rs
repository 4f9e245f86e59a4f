//! `flashsale admin backup` and `flashsale admin restore-drill` (CONTRACT.md section 1; issue 26
//! item 4; seed ch9 §11.4 and §13.6): PostgreSQL base backups beside the WAL archive the stack
//! keeps, and the drill that restores one to a point in time in an isolated directory, checks
//! the copy and measures RPO and RTO.
//!
//! This file only declares the parts and re-exports what callers use; no part imports it.
//! `take` (the backup), `manifest` (what a backup directory holds), `drill` (the restore drill's
//! steps), `restored` (the isolated copy: directory, recovery settings, server), `report` (the
//! drill's report, RPO and RTO), `usage` (input refused before anything is touched, exit 2).
//! The archive itself is the stack's (`app/stack/wal_archive.rs`); every SQL statement is
//! `flashsale_pg_worker`'s (`pitr`, `restore_audit`).

mod drill;
mod manifest;
mod report;
mod restored;
mod take;
mod usage;

pub use drill::{restore_drill, DrillArgs};
pub use manifest::{BackupManifest, DATA_DIR, MANIFEST_FILE};
pub use report::DrillReport;
pub use take::{backup, BackupArgs};
pub use usage::UsageError;
