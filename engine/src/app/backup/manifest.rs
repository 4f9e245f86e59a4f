//! What `flashsale admin backup` writes beside a base backup, so that `flashsale admin
//! restore-drill --backup DIR` needs nothing else: [`BackupManifest`] in
//! `DIR/flashsale-backup.json` (when, the server and cluster, the database the sale lives in,
//! the WAL range and timeline, where the WAL archive is), filled from PostgreSQL's own files
//! in the backup (`backup_label`: start LSN, first segment, timeline; `backup_manifest`: end
//! LSN) by [`BackupManifest::from_backup`].
//!
//! Layout of a backup directory: `DIR/data/` (`pg_basebackup`'s plain output, with its own
//! `backup_manifest` of checksums that `pg_verifybackup` checks) and `DIR/flashsale-backup.json`.
//!
//! Not here: taking the backup (`take.rs`) or restoring it (`drill.rs`).

use std::path::{Path, PathBuf};

use anyhow::Context;
use flashsale_io::wire::{format_rfc3339_ms, parse_rfc3339_ms};
use flashsale_pg_worker::pitr::ServerFacts;
use serde::{Deserialize, Serialize};

use super::usage::UsageError;

/// The manifest's file name inside a backup directory.
pub const MANIFEST_FILE: &str = "flashsale-backup.json";
/// The base backup's directory inside a backup directory.
pub const DATA_DIR: &str = "data";
/// The manifest's format; a reader refuses another.
pub const MANIFEST_FORMAT: u32 = 1;
/// Largest `backup_manifest` read (one line per file of the cluster).
const PG_MANIFEST_BYTES_MAX: u64 = 64 << 20;

/// A backup directory's description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupManifest {
    pub format: u32,
    /// `pg_basebackup --label`.
    pub label: String,
    /// Just before `pg_basebackup` started (RFC 3339, ms).
    pub started_at: String,
    /// Just after it returned, its WAL archived: a restore may aim at any later time.
    pub finished_at: String,
    pub server_version: String,
    /// The cluster the backup and its archive belong to.
    pub system_identifier: String,
    /// The database the sale lives in (the one the backup's URL named): the drill checks it.
    pub database: String,
    pub timeline: u32,
    pub start_lsn: String,
    pub end_lsn: String,
    /// The first WAL segment a restore needs (from the archive).
    pub start_wal_file: String,
    pub wal_segment_bytes: u64,
    /// The WAL archive (absolute): the restore's `restore_command` reads it.
    pub wal_archive: String,
    /// How the base backup was taken.
    pub pg_basebackup: String,
}

/// What `pg_basebackup` itself recorded about one backup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupRange {
    pub start_lsn: String,
    pub start_wal_file: String,
    pub timeline: u32,
    pub end_lsn: String,
}

/// What `from_backup` takes besides the backup's own files.
pub struct Taken<'a> {
    pub label: &'a str,
    pub options: &'a str,
    pub facts: &'a ServerFacts,
    pub wal_archive: &'a Path,
    pub started_ms: u64,
    pub finished_ms: u64,
}

impl BackupManifest {
    /// The manifest of the backup just taken into `dir`.
    pub fn from_backup(dir: &Path, taken: &Taken<'_>) -> anyhow::Result<BackupManifest> {
        let range = read_range(&dir.join(DATA_DIR))?;
        Ok(BackupManifest {
            format: MANIFEST_FORMAT,
            label: taken.label.to_owned(),
            started_at: format_rfc3339_ms(taken.started_ms).to_string(),
            finished_at: format_rfc3339_ms(taken.finished_ms).to_string(),
            server_version: taken.facts.server_version.clone(),
            system_identifier: taken.facts.system_identifier.clone(),
            database: taken.facts.database.clone(),
            timeline: range.timeline,
            start_lsn: range.start_lsn,
            end_lsn: range.end_lsn,
            start_wal_file: range.start_wal_file,
            wal_segment_bytes: u64::try_from(taken.facts.wal_segment_bytes)
                .context("wal_segment_size is negative")?,
            wal_archive: taken.wal_archive.display().to_string(),
            pg_basebackup: taken.options.to_owned(),
        })
    }

    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let path = dir.join(MANIFEST_FILE);
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(&path, text + "\n").with_context(|| format!("write {}", path.display()))
    }

    /// The manifest of the backup directory `dir`; a missing or foreign directory is the
    /// caller's mistake ([`UsageError`]).
    pub fn read(dir: &Path) -> Result<BackupManifest, UsageError> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            UsageError(format!(
                "{} is not a backup directory (no readable {MANIFEST_FILE}: {e}); \
                 `flashsale admin backup --dir DIR` makes one",
                dir.display()
            ))
        })?;
        let manifest: BackupManifest = serde_json::from_str(&text)
            .map_err(|e| UsageError(format!("{}: not a backup manifest: {e}", path.display())))?;
        if manifest.format != MANIFEST_FORMAT {
            return Err(UsageError(format!(
                "{}: manifest format {} (this build reads {MANIFEST_FORMAT})",
                path.display(),
                manifest.format
            )));
        }
        Ok(manifest)
    }

    /// `finished_at` in ms since the epoch.
    pub fn finished_ms(&self) -> Result<u64, UsageError> {
        parse_rfc3339_ms(&self.finished_at)
            .ok_or_else(|| UsageError(format!("bad finished_at {:?}", self.finished_at)))
    }

    pub fn data_dir(&self, dir: &Path) -> PathBuf {
        dir.join(DATA_DIR)
    }
}

/// The start (from `backup_label`) and end (from `backup_manifest`) of the backup in `data`.
fn read_range(data: &Path) -> anyhow::Result<BackupRange> {
    let label_path = data.join("backup_label");
    let label = std::fs::read_to_string(&label_path)
        .with_context(|| format!("read {}", label_path.display()))?;
    let manifest_path = data.join("backup_manifest");
    let size = std::fs::metadata(&manifest_path)
        .with_context(|| format!("read {}", manifest_path.display()))?
        .len();
    anyhow::ensure!(
        size <= PG_MANIFEST_BYTES_MAX,
        "backup_manifest over {PG_MANIFEST_BYTES_MAX} bytes"
    );
    let manifest = std::fs::read_to_string(&manifest_path)
        .with_context(|| format!("read {}", manifest_path.display()))?;
    parse_range(&label, &manifest).context("backup_label / backup_manifest not understood")
}

/// Sans-I/O: `START WAL LOCATION: 0/2000028 (file 000000010000000000000002)` and `START
/// TIMELINE: 1` of `backup_label`, and the last `End-LSN` of `backup_manifest`'s `WAL-Ranges`.
pub fn parse_range(backup_label: &str, backup_manifest: &str) -> Option<BackupRange> {
    let field =
        |name: &str| backup_label.lines().find_map(|line| line.strip_prefix(name).map(str::trim));
    let location = field("START WAL LOCATION:")?;
    let (start_lsn, file) = location.split_once(" (file ")?;
    let start_wal_file = file.strip_suffix(')')?.to_owned();
    let timeline = field("START TIMELINE:")?.parse().ok()?;
    let manifest: serde_json::Value = serde_json::from_str(backup_manifest).ok()?;
    let ranges = manifest.get("WAL-Ranges")?.as_array()?;
    let end_lsn = ranges.last()?.get("End-LSN")?.as_str()?.to_owned();
    Some(BackupRange { start_lsn: start_lsn.trim().to_owned(), start_wal_file, timeline, end_lsn })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LABEL: &str = "START WAL LOCATION: 0/2000028 (file 000000010000000000000002)\n\
        CHECKPOINT LOCATION: 0/2000060\nBACKUP METHOD: streamed\nBACKUP FROM: primary\n\
        START TIME: 2026-12-07 00:07:10 UTC\nLABEL: x\nSTART TIMELINE: 1\n";
    const PG_MANIFEST: &str = r#"{"PostgreSQL-Backup-Manifest-Version": 1, "Files": [],
        "WAL-Ranges": [{"Timeline": 1, "Start-LSN": "0/2000028", "End-LSN": "0/2000100"}]}"#;

    #[test]
    fn the_range_comes_from_postgresqls_own_files() {
        let range = parse_range(LABEL, PG_MANIFEST).unwrap();
        assert_eq!(range.start_lsn, "0/2000028");
        assert_eq!(range.start_wal_file, "000000010000000000000002");
        assert_eq!(range.timeline, 1);
        assert_eq!(range.end_lsn, "0/2000100");
        assert_eq!(parse_range("START TIMELINE: 1\n", PG_MANIFEST), None);
        assert_eq!(parse_range(LABEL, "{}"), None);
    }

    #[test]
    fn a_directory_without_a_manifest_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = BackupManifest::read(dir.path()).unwrap_err();
        assert!(e.0.contains("not a backup directory"), "{e}");
        std::fs::write(dir.path().join(MANIFEST_FILE), "{\"format\": 1}").unwrap();
        assert!(BackupManifest::read(dir.path()).unwrap_err().0.contains("not a backup manifest"));
    }
}
