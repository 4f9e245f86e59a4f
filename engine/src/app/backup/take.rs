//! `flashsale admin backup --dir DIR`: a PostgreSQL base backup with PostgreSQL's own tool,
//! `pg_basebackup`, beside the WAL archive the server keeps (CONTRACT.md section 1).
//!
//! How: the server is asked first (`flashsale_pg_worker::pitr::server_facts`): a primary, WAL
//! archiving on and not failing, an archive directory it names (`flashsale.wal_archive`, set by
//! `flashsale stack up --archive-wal`) or `--wal-archive` names, the role `postgres` a
//! superuser. Then `pg_basebackup --wal-method=none --checkpoint=fast` into `DIR/data`
//! (plain format), then the manifest (`manifest.rs`).
//!
//! Why `--wal-method=none`: a point-in-time restore reads its WAL from the archive anyway, from
//! the backup's first segment to the target; copying the backup's own stretch of WAL into it
//! as well would let a restore to the backup's end succeed while the archive behind it is
//! broken, and hide that until the day a later point is needed. Without WAL of its own,
//! `pg_basebackup` waits until the server has archived every segment the backup needs ("all
//! required WAL segments have been archived"), so a backup that finishes is restorable from
//! the archive as it stands — which is why the archiver must not be failing before it starts,
//! and why the wait is bounded (`--deadline-s`). `--checkpoint=fast`: the backup starts at
//! once instead of waiting for the next spread checkpoint (up to `checkpoint_timeout`). The
//! files are fsynced (no `--no-sync`): a backup that a crash can truncate is not one.
//!
//! Exit status: 0 with the manifest printed; 2 for a target directory that is not new or empty
//! (nothing written); 1 when the server cannot be backed up (said why) or `pg_basebackup` fails.
//!
//! Not here: the restore (`drill.rs`), the archive's settings (`stack/wal_archive.rs`).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use flashsale_io::wire::format_rfc3339_ms;
use flashsale_pg_worker::pitr::{server_facts, ServerFacts};

use super::manifest::{BackupManifest, Taken, DATA_DIR};
use super::usage::UsageError;
use crate::app::stack;
use crate::logic::clock::now_ms;

/// `flashsale admin backup`'s arguments.
#[derive(Debug, clap::Args)]
pub struct BackupArgs {
    /// A new or empty directory: the base backup goes to DIR/data, its manifest to
    /// DIR/flashsale-backup.json.
    #[arg(long)]
    pub dir: PathBuf,
    /// The PostgreSQL primary to back up (overrides FLASHSALE_PG_URL); its database is the one
    /// a restore drill checks.
    #[arg(long)]
    pub pg_url: Option<String>,
    /// The WAL archive, for a server that does not name it (`flashsale.wal_archive`).
    #[arg(long)]
    pub wal_archive: Option<PathBuf>,
    /// Longest pg_basebackup may take, waiting for its WAL to be archived included.
    #[arg(long, default_value_t = 3600)]
    pub deadline_s: u64,
}

/// The `pg_basebackup` options besides the connection, the target and the label.
const OPTIONS: [&str; 3] = ["--wal-method=none", "--checkpoint=fast", "--no-password"];

/// Takes the backup and prints its manifest; returns the exit status.
pub fn backup(args: &BackupArgs, pg_url: &str, out: &mut dyn Write) -> anyhow::Result<u8> {
    check_target(&args.dir)?;
    let facts = read_facts(pg_url)?;
    let archive = archive_of(&facts, args.wal_archive.as_deref())?;
    fs::create_dir_all(&args.dir).with_context(|| format!("create {}", args.dir.display()))?;
    let dir = args.dir.canonicalize().with_context(|| format!("resolve {}", args.dir.display()))?;
    stack::hand_to_postgres(&dir)?;
    let started_ms = now_ms();
    let label = format!("flashsale-{}", format_rfc3339_ms(started_ms));
    run_pg_basebackup(pg_url, &dir, &label, Duration::from_secs(args.deadline_s.max(1)))?;
    let taken = Taken {
        label: &label,
        options: &OPTIONS.join(" "),
        facts: &facts,
        wal_archive: &archive,
        started_ms,
        finished_ms: now_ms(),
    };
    let manifest = BackupManifest::from_backup(&dir, &taken)?;
    manifest.write(&dir)?;
    writeln!(out, "{}", serde_json::to_string_pretty(&manifest)?)?;
    Ok(0)
}

/// The target must be new or an empty directory (`pg_basebackup` writes into nothing else).
fn check_target(dir: &Path) -> Result<(), UsageError> {
    let Ok(meta) = fs::metadata(dir) else { return Ok(()) };
    let empty =
        meta.is_dir() && fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none());
    if empty {
        Ok(())
    } else {
        Err(UsageError(format!("--dir {}: exists and is not an empty directory", dir.display())))
    }
}

fn read_facts(pg_url: &str) -> anyhow::Result<ServerFacts> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let config = flashsale_pg_worker::pool::PgPoolConfig {
            url: pg_url.to_owned(),
            application_name: "flashsale-backup".to_owned(),
            ..Default::default()
        };
        let connector = flashsale_pg_worker::pool::Connector::new(&config)?;
        let (client, driver) =
            connector.connect().await.with_context(|| format!("connect to {pg_url}"))?;
        let facts = server_facts(&client).await;
        drop(client);
        let _ = driver.await;
        Ok(facts?)
    })
}

/// The archive this server's backup relies on, or why there is none to rely on.
fn archive_of(facts: &ServerFacts, named: Option<&Path>) -> anyhow::Result<PathBuf> {
    if facts.in_recovery {
        bail!("the server is a standby (in recovery): back up the primary (a URL with target_session_attrs=read-write)");
    }
    if facts.archive_mode == "off" {
        bail!(
            "the server does not archive its WAL (archive_mode=off), so no point-in-time \
             restore could follow a backup: start the stack with `flashsale stack up --archive-wal`"
        );
    }
    let Some(archive) =
        named.map(Path::to_path_buf).or(facts.wal_archive.as_ref().map(PathBuf::from))
    else {
        bail!("the server does not say where it archives (flashsale.wal_archive): pass --wal-archive DIR");
    };
    anyhow::ensure!(
        archive.is_dir(),
        "the WAL archive {} is not a directory here: back up on the machine that keeps it",
        archive.display()
    );
    if facts.archiver.failing() {
        bail!(
            "WAL archiving is failing (last failed segment {:?}, {} failures; see the server's \
             log): a base backup would wait for its WAL forever",
            facts.archiver.last_failed_wal,
            facts.archiver.failed_count
        );
    }
    anyhow::ensure!(
        facts.postgres_superuser,
        "the role `postgres` is not a superuser here: the restore drill connects to its copy as it"
    );
    archive.canonicalize().with_context(|| format!("resolve {}", archive.display()))
}

/// `pg_basebackup` as the server's user, its output in `DIR/pg_basebackup.log`, killed past
/// `deadline`.
fn run_pg_basebackup(
    pg_url: &str,
    dir: &Path,
    label: &str,
    deadline: Duration,
) -> anyhow::Result<()> {
    let log_path = dir.join("pg_basebackup.log");
    let log =
        fs::File::create(&log_path).with_context(|| format!("create {}", log_path.display()))?;
    let mut command = stack::postgres_tool("pg_basebackup")?;
    command
        .arg("--dbname")
        .arg(pg_url)
        .arg("--pgdata")
        .arg(dir.join(DATA_DIR))
        .args(OPTIONS)
        .args(["--label", label])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let started = Instant::now();
    let mut child = command.spawn().context("run pg_basebackup")?;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            // pg_basebackup removes a half-written target when it fails on its own, not when
            // it is killed.
            let _ = fs::remove_dir_all(dir.join(DATA_DIR));
            bail!(
                "pg_basebackup did not finish within {deadline:?} (it waits for its WAL to be \
                 archived: is the archiver keeping up? pg_stat_archiver); see {}",
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !status.success() {
        let text = fs::read_to_string(&log_path).unwrap_or_default();
        bail!("pg_basebackup failed ({status}): {}", text.trim());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_new_or_empty_directory_takes_a_backup() {
        let root = tempfile::tempdir().unwrap();
        assert!(check_target(&root.path().join("new")).is_ok());
        assert!(check_target(root.path()).is_ok(), "empty");
        fs::write(root.path().join("x"), "").unwrap();
        assert!(check_target(root.path()).unwrap_err().0.contains("not an empty directory"));
        assert!(check_target(&root.path().join("x")).is_err(), "a file");
    }
}
