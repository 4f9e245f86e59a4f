//! The restore drill's report ([`DrillReport`], printed as JSON and written to `--json FILE`):
//! what was restored from where to which point, how the recovery went, the measured RPO and
//! RTO, the checks of the copy per SKU, and `ok`.
//!
//! The two figures:
//! - `rpo_ms` = the target time − the newest commit the copy holds (`newest_commit`). Recovery
//!   replays every commit the archive holds up to the target, so this is the stretch before the
//!   target of which the copy holds nothing: had the primary been lost at the target, anything
//!   committed in it would be lost. On a busy system with a complete archive it is the quiet
//!   time before the target; restoring to "now" it is the archive's lag (at most about
//!   `archive_timeout` plus the copy while the server lives).
//! - `rto_ms` = wall time from the drill's start (verifying the backup included) to "the
//!   restored server takes writes and every check passed"; `phases_ms` splits it. Absent when
//!   the drill failed: there is no recovered copy to time.
//!
//! Not here: the steps that fill it (`drill.rs`), the checks themselves
//! (`flashsale_pg_worker::restore_audit`).

use flashsale_io::wire::format_rfc3339_ms;
use flashsale_pg_worker::pitr::CommitSource;
use flashsale_pg_worker::restore_audit::RestoreAudit;
use serde::Serialize;

use crate::app::stack::wal_archive::ArchiveSurvey;

use super::manifest::BackupManifest;

/// The report of one drill.
#[derive(Debug, Clone, Serialize)]
pub struct DrillReport {
    pub backup: BackupSummary,
    /// `--to`, RFC 3339.
    pub target: String,
    /// The recovery settings the copy ran with.
    pub recovery: RecoverySettings,
    /// `pg_verifybackup` against the backup's own manifest and the archive's WAL passed.
    pub backup_verified: bool,
    /// The archive from the backup's first segment on.
    pub wal_archive: Option<ArchiveSurvey>,
    /// The copy: where, on which port, whether it is kept running.
    pub restored: Option<RestoredSummary>,
    pub newest_commit: Option<CommitSummary>,
    pub rpo_ms: Option<i64>,
    pub rto_ms: Option<u64>,
    /// Wall time until the drill ended, failed or not.
    pub elapsed_ms: u64,
    pub phases_ms: Phases,
    /// The copy's checks (`flashsale_pg_worker::restore_audit`).
    pub checks: Option<RestoreAudit>,
    /// What failed, when the drill could not finish (the checks' own findings are in
    /// `violations`).
    pub error: Option<String>,
    /// Every broken rule of the copy, and the error.
    pub violations: Vec<String>,
    pub ok: bool,
}

/// The backup as its manifest describes it.
#[derive(Debug, Clone, Serialize)]
pub struct BackupSummary {
    pub dir: String,
    pub label: String,
    pub finished_at: String,
    pub server_version: String,
    pub database: String,
    pub timeline: u32,
    pub start_lsn: String,
    pub end_lsn: String,
    pub wal_archive: String,
}

/// The recovery target as PostgreSQL was given it.
#[derive(Debug, Clone, Serialize)]
pub struct RecoverySettings {
    pub recovery_target_time: String,
    pub recovery_target_inclusive: bool,
    pub recovery_target_action: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct RestoredSummary {
    pub dir: String,
    pub port: Option<u16>,
    pub kept: bool,
    /// The copy's timeline after promotion (the backup's + 1 when nothing else branched).
    pub timeline: Option<i64>,
    /// The server log's account of the recovery: where it stopped (the first commit after
    /// the target), the last transaction replayed, or why it failed.
    pub recovery_log: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CommitSummary {
    pub at: String,
    pub source: CommitSource,
}

/// Milliseconds per step; their sum is about `elapsed_ms`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Phases {
    /// `pg_verifybackup`.
    pub verify: u64,
    /// Copying the base backup and writing the recovery settings.
    pub copy: u64,
    /// Start, replay to the target, promotion, the write probe.
    pub recovery: u64,
    /// The checks of the copy.
    pub checks: u64,
}

impl DrillReport {
    pub fn new(dir: &std::path::Path, manifest: &BackupManifest, target_ms: u64) -> DrillReport {
        let target = format_rfc3339_ms(target_ms).to_string();
        DrillReport {
            backup: BackupSummary {
                dir: dir.display().to_string(),
                label: manifest.label.clone(),
                finished_at: manifest.finished_at.clone(),
                server_version: manifest.server_version.clone(),
                database: manifest.database.clone(),
                timeline: manifest.timeline,
                start_lsn: manifest.start_lsn.clone(),
                end_lsn: manifest.end_lsn.clone(),
                wal_archive: manifest.wal_archive.clone(),
            },
            recovery: RecoverySettings {
                recovery_target_time: target.replace('T', " ").replace('Z', "+00"),
                recovery_target_inclusive: true,
                recovery_target_action: "promote",
            },
            target,
            backup_verified: false,
            wal_archive: None,
            restored: None,
            newest_commit: None,
            rpo_ms: None,
            rto_ms: None,
            elapsed_ms: 0,
            phases_ms: Phases::default(),
            checks: None,
            error: None,
            violations: Vec::new(),
            ok: false,
        }
    }

    /// Records why the drill could not go on.
    pub fn fail(&mut self, error: &anyhow::Error) {
        self.error = Some(format!("{error:#}"));
    }

    /// The newest commit recovered, and the RPO from it.
    pub fn recovered_up_to(&mut self, at_ms: i64, source: CommitSource, target_ms: u64) {
        let at = format_rfc3339_ms(u64::try_from(at_ms).unwrap_or(0)).to_string();
        self.newest_commit = Some(CommitSummary { at, source });
        self.rpo_ms = Some(i64::try_from(target_ms).unwrap_or(i64::MAX).saturating_sub(at_ms));
    }

    /// The verdict: ok when the drill finished without an error and the checks found nothing.
    pub fn conclude(&mut self, elapsed_ms: u64) {
        self.elapsed_ms = elapsed_ms;
        self.violations = self.checks.as_ref().map(|c| c.violations.clone()).unwrap_or_default();
        if let Some(error) = &self.error {
            self.violations.push(error.clone());
        }
        self.ok = self.error.is_none() && self.checks.is_some() && self.violations.is_empty();
        if !self.ok {
            self.rto_ms = None;
        }
    }
}
