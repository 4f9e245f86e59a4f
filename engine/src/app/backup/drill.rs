//! `flashsale admin restore-drill --backup DIR --to RFC3339 [--json FILE] [--keep]`: the seed's
//! restore drill (ch9 §13.6: restore from a base backup and the WAL to a chosen point, in an
//! isolated environment; check orders, payments, the ledger, unique keys and each SKU's
//! conservation; measure RPO and RTO; write the report).
//!
//! The steps, in order, each timed (`report.rs` says what the figures mean):
//! 1. the input, before anything is touched ([`DrillPlan::check`]): a backup directory with
//!    its manifest, a target after the backup finished and not in the future, a work
//!    directory — else [`UsageError`] (exit 2);
//! 2. `pg_verifybackup` of the base backup against its own manifest, parsing its WAL from the
//!    archive (a damaged backup or a missing early segment stops here), and a survey of the
//!    archive's continuity from the backup's first segment;
//! 3. the isolated copy and its recovery settings (`restored.rs`), started on a free loopback
//!    port (it must answer within the stack's 60 s start bound, which it does once it is
//!    consistent: the backup's own stretch of WAL replayed); waiting, within
//!    `--recovery-deadline-s`, until it has replayed the rest to the target, promoted, and is
//!    not in recovery (a recovery that runs out of archive before the target exits FATAL,
//!    "recovery ended before configured recovery target was reached": the drill fails with
//!    that line);
//! 4. the newest commit it holds (before anything writes to it), its timeline, a write;
//! 5. the checks (`flashsale_pg_worker::restore_audit`), then the verdict, the report, and the
//!    copy stopped and removed unless `--keep`.
//!
//! Exit status: 0 when the copy reconciles, 1 when a check fails or the restore does not get
//! there, 2 for bad input.
//!
//! Not here: the copy's directory and settings (`restored.rs`), the report's shape
//! (`report.rs`), the backup (`take.rs`).

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use flashsale_io::wire::{format_rfc3339_ms, parse_rfc3339_ms};
use flashsale_pg_worker::pitr;
use flashsale_pg_worker::pool::{Connector, PgPoolConfig};
use flashsale_pg_worker::restore_audit::{audit_restored, RestoreAuditLimits};
use tokio_postgres::Client;

use super::manifest::BackupManifest;
use super::report::{DrillReport, RestoredSummary};
use super::restored::{AfterDrill, RestoredCopy, TARGET_NOT_REACHED};
use super::usage::UsageError;
use crate::app::stack::{self, wal_archive};
use crate::logic::clock::now_ms;

/// `flashsale admin restore-drill`'s arguments.
#[derive(Debug, clap::Args)]
pub struct DrillArgs {
    /// A directory `flashsale admin backup` wrote.
    #[arg(long)]
    pub backup: PathBuf,
    /// The point to restore to, RFC 3339 (`2026-06-25T19:00:00.123Z`): every transaction
    /// committed at or before it, none after.
    #[arg(long, value_parser = parse_time)]
    pub to: u64,
    /// Also write the report to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Leave the restored server running and its directory in place (the report names both;
    /// stop it with `pg_ctl -D DIR/data stop` as the postgres user, then delete DIR).
    #[arg(long)]
    pub keep: bool,
    /// Where the isolated directory is made (default: the system's temporary directory); the
    /// postgres user must be able to reach it, and it needs the backup's size free.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Longest the restored server may take to replay up to --to and promote.
    #[arg(long, default_value_t = 600)]
    pub recovery_deadline_s: u64,
}

fn parse_time(text: &str) -> Result<u64, String> {
    parse_rfc3339_ms(text)
        .ok_or_else(|| format!("{text:?} is not an RFC 3339 time (2026-06-25T19:00:00.123Z)"))
}

/// Bounds of the checks: statements of a whole table each, on a copy nobody else uses.
const AUDIT_LIMITS: RestoreAuditLimits =
    RestoreAuditLimits { ids_listed_max: 20, skus_max: 10_000, statement_timeout_ms: 600_000 };

/// The drill's input, checked.
#[derive(Debug)]
pub struct DrillPlan {
    pub backup_dir: PathBuf,
    pub manifest: BackupManifest,
    pub target_ms: u64,
    pub work_dir: PathBuf,
    pub after: AfterDrill,
    pub recovery_deadline: Duration,
}

impl DrillPlan {
    /// Refuses what no restore could do, before anything is written.
    pub fn check(args: &DrillArgs, now_ms: u64) -> Result<DrillPlan, UsageError> {
        let manifest = BackupManifest::read(&args.backup)?;
        let finished_ms = manifest.finished_ms()?;
        let to = format_rfc3339_ms(args.to);
        if args.to < finished_ms {
            return Err(UsageError(format!(
                "--to {} is before the backup finished ({}): a restore reaches only points after \
                 its base backup; use an older backup",
                to.as_str(),
                manifest.finished_at
            )));
        }
        if args.to > now_ms {
            return Err(UsageError(format!(
                "--to {} is in the future: the archive cannot hold a commit after it yet",
                to.as_str()
            )));
        }
        let work_dir = args.work_dir.clone().unwrap_or_else(std::env::temp_dir);
        if !work_dir.is_dir() {
            return Err(UsageError(format!(
                "--work-dir {} is not a directory",
                work_dir.display()
            )));
        }
        let backup_dir = args.backup.canonicalize().map_err(|e| UsageError(e.to_string()))?;
        Ok(DrillPlan {
            backup_dir,
            manifest,
            target_ms: args.to,
            work_dir,
            after: if args.keep { AfterDrill::Keep } else { AfterDrill::Remove },
            recovery_deadline: Duration::from_secs(args.recovery_deadline_s.max(1)),
        })
    }

    fn archive(&self) -> PathBuf {
        PathBuf::from(&self.manifest.wal_archive)
    }
}

/// Runs the drill, prints the report (and writes `--json`); returns the exit status.
pub fn restore_drill(args: &DrillArgs, out: &mut dyn Write) -> anyhow::Result<u8> {
    let clock = Instant::now();
    let plan = DrillPlan::check(args, now_ms())?;
    anyhow::ensure!(
        plan.archive().is_dir(),
        "the backup's WAL archive {} is not a directory here",
        plan.archive().display()
    );
    let mut report = DrillReport::new(&plan.backup_dir, &plan.manifest, plan.target_ms);
    let copy = drill(&plan, &mut report, clock);
    report.conclude(elapsed_ms(clock));
    let text = serde_json::to_string_pretty(&report)?;
    writeln!(out, "{text}")?;
    if let Some(path) = &args.json {
        std::fs::write(path, format!("{text}\n"))
            .with_context(|| format!("write {}", path.display()))?;
    }
    // Stopped and removed here (unless kept), after the report: the RTO ended before.
    drop(copy);
    Ok(if report.ok { 0 } else { 1 })
}

fn elapsed_ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Steps 2–5; a failure is recorded in the report and ends the drill. Returns the copy, whose
/// drop stops and removes it.
fn drill(plan: &DrillPlan, report: &mut DrillReport, clock: Instant) -> Option<RestoredCopy> {
    let step = Instant::now();
    let verified = verify_backup(plan);
    report.phases_ms.verify = elapsed_ms(step);
    report.wal_archive = wal_archive::survey(
        &plan.archive(),
        &plan.manifest.start_wal_file,
        plan.manifest.wal_segment_bytes,
    )
    .map_err(|e| tracing::warn!(error = %e, "restore drill: archive survey"))
    .ok();
    if let Err(e) = verified {
        report.fail(&e);
        return None;
    }
    report.backup_verified = true;
    let step = Instant::now();
    let data = plan.manifest.data_dir(&plan.backup_dir);
    let created =
        RestoredCopy::create(&plan.work_dir, &data, &plan.archive(), plan.target_ms, plan.after);
    report.phases_ms.copy = elapsed_ms(step);
    let mut copy = match created {
        Ok(copy) => copy,
        Err(e) => {
            report.fail(&e);
            return None;
        }
    };
    let step = Instant::now();
    let mut summary = RestoredSummary {
        dir: copy.dir().display().to_string(),
        port: None,
        kept: plan.after == AfterDrill::Keep,
        timeline: None,
        recovery_log: Vec::new(),
    };
    let recovered = copy.start().and_then(|port| {
        summary.port = Some(port);
        recover_and_check(&copy, plan, (report, &mut summary), step, clock)
    });
    if let Err(e) = recovered {
        report.fail(&e.context(not_reached_hint(&copy)));
    }
    summary.recovery_log =
        copy.log_lines(&["recovery stopping", "last completed transaction", "FATAL", "PANIC"]);
    report.restored = Some(summary);
    Some(copy)
}

/// What a failed recovery means when it ran out of WAL before the target.
fn not_reached_hint(copy: &RestoredCopy) -> &'static str {
    if copy.log_lines(&[TARGET_NOT_REACHED]).is_empty() {
        "the restore did not get to the target"
    } else {
        "the archive ends before --to: no commit after it is archived yet (archive_timeout, or \
         SELECT pg_switch_wal() on the source), or a segment is missing (wal_archive.first_missing)"
    }
}

/// `pg_verifybackup`: every file of the base backup against its manifest's checksums, and the
/// WAL from its start to its end parsed from the archive.
fn verify_backup(plan: &DrillPlan) -> anyhow::Result<()> {
    let data = plan.manifest.data_dir(&plan.backup_dir);
    let output = stack::postgres_tool("pg_verifybackup")?
        .arg("--wal-directory")
        .arg(plan.archive())
        .arg(&data)
        .output()
        .context("run pg_verifybackup")?;
    if !output.status.success() {
        bail!(
            "pg_verifybackup refused the backup: {} {}",
            String::from_utf8_lossy(&output.stdout).trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Steps 3 (after the start) to 5 on the running copy.
fn recover_and_check(
    copy: &RestoredCopy,
    plan: &DrillPlan,
    (report, summary): (&mut DrillReport, &mut RestoredSummary),
    recovery_started: Instant,
    clock: Instant,
) -> anyhow::Result<()> {
    let port = summary.port.context("the copy has no port")?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let url = format!("postgres://postgres@127.0.0.1:{port}/{}", plan.manifest.database);
        let (mut client, driver) = wait_promoted(copy, &url, plan.recovery_deadline).await?;
        if let Some(newest) = pitr::newest_commit(&client).await? {
            report.recovered_up_to(newest.at_ms, newest.source, plan.target_ms);
        }
        summary.timeline = Some(pitr::timeline(&client).await?);
        pitr::write_probe(&mut client).await.context("the restored server refused a write")?;
        report.phases_ms.recovery = elapsed_ms(recovery_started);
        let step = Instant::now();
        let audit = audit_restored(&mut client, AUDIT_LIMITS).await.context("the checks")?;
        report.phases_ms.checks = elapsed_ms(step);
        if audit.ok() {
            report.rto_ms = Some(elapsed_ms(clock));
        }
        report.checks = Some(audit);
        drop(client);
        let _ = driver.await;
        anyhow::Ok(())
    })
}

/// Connects to the copy and waits until it is out of recovery (replayed to the target and
/// promoted), checking that the server still runs.
async fn wait_promoted(
    copy: &RestoredCopy,
    url: &str,
    deadline: Duration,
) -> anyhow::Result<(Client, tokio::task::JoinHandle<()>)> {
    let config = PgPoolConfig {
        url: url.to_owned(),
        application_name: "flashsale-restore-drill".to_owned(),
        statement_timeout_ms: AUDIT_LIMITS.statement_timeout_ms,
        transaction_deadline_ms: AUDIT_LIMITS.statement_timeout_ms,
        ..PgPoolConfig::default()
    };
    let connector = Connector::new(&config)?;
    let started = Instant::now();
    let mut session = None;
    loop {
        copy.check_alive()?;
        if session.is_none() {
            session = connector.connect().await.ok();
        }
        if let Some((client, driver)) = session.take() {
            match pitr::in_recovery(&client).await {
                Ok(false) => return Ok((client, driver)),
                Ok(true) => session = Some((client, driver)),
                // The connection broke (a restart): connect again.
                Err(_) => driver.abort(),
            }
        }
        if started.elapsed() > deadline {
            bail!("the restored server was still recovering after {deadline:?} (--recovery-deadline-s)");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
