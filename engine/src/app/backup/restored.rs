//! The isolated copy a restore drill brings back ([`RestoredCopy`]): a fresh directory
//! `WORK/flashsale-restore-<ms>-<pid>` laid out like a stack server's (`data/`, `server.log`,
//! `pid`, `port`), the base backup copied into `data/`, the recovery settings written, and the
//! server started with the stack's own code (`Server::start`, as the `postgres` user, on a free
//! loopback port). Dropped, it stops that server and deletes the directory, unless kept.
//!
//! The recovery settings, appended to the copy's `postgresql.auto.conf` (read last, so they win
//! over what the backup brought) with `recovery.signal`:
//!
//! - `restore_command` from the archive (`stack/wal_archive.rs`), read-only;
//! - `recovery_target_time` = the drill's `--to` (numeric offset: PostgreSQL refuses a `Z` in
//!   this setting), `recovery_target_inclusive = on`: a transaction committed exactly at the
//!   target is in the copy, the first one committed after it is not — "the state as of T";
//! - `recovery_target_action = promote`: the copy ends its recovery as a primary, so that the
//!   drill can prove it takes writes (its RTO ends there);
//! - `archive_mode = off`: the backup brought the source's archiving settings, and a promoted
//!   copy would push its own new timeline into the source's archive, where a later real restore
//!   (`recovery_target_timeline = latest`) could follow it;
//! - `synchronous_standby_names = ''`, `primary_conninfo = ''`: a copy of an `ha` primary would
//!   otherwise wait for standbys that are not there (every commit hangs) or try to follow one;
//! - `hot_standby = on`: it answers (read-only) once consistent, before the target is reached,
//!   which is how the stack's readiness probe sees it start;
//! - `autovacuum = off`: nothing may commit in the copy before the drill has read the newest
//!   commit it recovered (an autovacuum's ANALYZE would be newer than the target); a copy that
//!   lives for a drill needs no vacuuming.
//!
//! `pg_hba.conf` is replaced by trust on loopback only: the copy listens on 127.0.0.1 alone and
//! the drill needs no production credentials.
//!
//! Not here: the order of the drill's steps and its report (`drill.rs`).

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use flashsale_io::wire::format_rfc3339_ms;

use crate::app::stack::{self, wal_archive, Kind, Server};

/// Largest server log read for the recovery's lines.
const LOG_BYTES_MAX: u64 = 4 << 20;
/// How PostgreSQL refuses a connection while it starts: logged for every probe.
const STARTING_UP: [&str; 3] = [
    "the database system is starting up",
    "the database system is not yet accepting connections",
    "the database system is in recovery mode",
];
/// How a recovery that ran out of WAL before its target ends.
pub const TARGET_NOT_REACHED: &str = "recovery ended before configured recovery target was reached";

/// What happens to the copy when the drill ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterDrill {
    /// Stop the server, delete the directory.
    Remove,
    /// Leave both (`--keep`): the report names them.
    Keep,
}

/// The restored copy and, once started, its server.
#[derive(Debug)]
pub struct RestoredCopy {
    dir: PathBuf,
    server: Option<Server>,
    after: AfterDrill,
}

impl RestoredCopy {
    /// A new directory under `work` with `backup_data` copied into `data/` and the recovery
    /// settings for `target_ms` from `archive`.
    pub fn create(
        work: &Path,
        backup_data: &Path,
        archive: &Path,
        target_ms: u64,
        after: AfterDrill,
    ) -> anyhow::Result<RestoredCopy> {
        let name =
            format!("flashsale-restore-{}-{}", crate::logic::clock::now_ms(), std::process::id());
        let dir = work.join(name);
        fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        // From here on a failure removes what was made (or keeps it, when asked).
        let copy = RestoredCopy { dir, server: None, after };
        copy_tree(backup_data, &copy.data())?;
        fs::set_permissions(copy.data(), fs::Permissions::from_mode(0o700))?;
        copy.configure(archive, target_ms)?;
        stack::hand_to_postgres(&copy.dir)?;
        Ok(copy)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn configure(&self, archive: &Path, target_ms: u64) -> anyhow::Result<()> {
        let data = self.data();
        let target = format_rfc3339_ms(target_ms).replace('T', " ").replace('Z', "+00");
        let settings = format!(
            "\n# flashsale admin restore-drill (engine/src/app/backup/restored.rs)\n\
             restore_command = '{}'\n\
             recovery_target_time = '{target}'\n\
             recovery_target_inclusive = on\n\
             recovery_target_action = 'promote'\n\
             archive_mode = off\n\
             synchronous_standby_names = ''\n\
             primary_conninfo = ''\n\
             hot_standby = on\n\
             autovacuum = off\n",
            wal_archive::restore_command(archive)?
        );
        let mut auto = fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(data.join("postgresql.auto.conf"))
            .context("open the copy's postgresql.auto.conf")?;
        auto.write_all(settings.as_bytes())?;
        fs::write(data.join("recovery.signal"), "")?;
        let _ = fs::remove_file(data.join("standby.signal"));
        fs::write(
            data.join("pg_hba.conf"),
            "# flashsale restore drill: loopback only, trust\nhost all all 127.0.0.1/32 trust\n",
        )?;
        Ok(())
    }

    /// Starts the copy's server on a free loopback port; returns once it answers (read-only
    /// while it replays). A server that exits first (a recovery that failed early) is an error
    /// with its log's last lines.
    pub fn start(&mut self) -> anyhow::Result<u16> {
        // One attempt on one port: `Server::start` retries a failed start on fresh ports, and a
        // failed recovery would only be replayed again.
        let port = stack::free_port()?;
        let server = Server::start(Kind::Postgres, &self.dir, Some(port))
            .context("the restored server did not start")?;
        self.server = Some(server);
        Ok(port)
    }

    /// Whether the server still runs (a recovery that ends before its target exits FATAL).
    pub fn check_alive(&self) -> anyhow::Result<()> {
        match &self.server {
            Some(server) if server.check().is_ok() => Ok(()),
            _ => bail!(
                "the restored server exited: {}",
                self.log_lines(&["FATAL", "PANIC"]).join(" | ")
            ),
        }
    }

    /// The server log's lines holding any of `needles` (the recovery's story: where it
    /// stopped, the last transaction it replayed, why it failed).
    pub fn log_lines(&self, needles: &[&str]) -> Vec<String> {
        let path = self.dir.join("server.log");
        let text = fs::File::open(&path)
            .and_then(|file| {
                let mut text = String::new();
                std::io::Read::read_to_string(
                    &mut std::io::Read::take(file, LOG_BYTES_MAX),
                    &mut text,
                )?;
                Ok(text)
            })
            .unwrap_or_default();
        text.lines()
            .filter(|line| needles.iter().any(|n| line.contains(n)))
            // The readiness probe's own refusals while the server starts are not the story.
            .filter(|line| !STARTING_UP.iter().any(|n| line.contains(n)))
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for RestoredCopy {
    fn drop(&mut self) {
        if self.after == AfterDrill::Keep {
            return;
        }
        if let Some(server) = self.server.take() {
            if let Err(e) = server.stop() {
                tracing::warn!(error = %e, "restore drill: could not stop the restored server");
            }
        }
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            tracing::warn!(error = %e, dir = %self.dir.display(), "restore drill: not removed");
        }
    }
}

/// Copies the directory tree `from` into the new directory `to`, file modes kept. A symbolic
/// link (a tablespace in `pg_tblspc`) is refused: the copy would share its files with the
/// backup.
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    fs::create_dir(to).with_context(|| format!("create {}", to.display()))?;
    let mode = fs::metadata(from)?.permissions();
    fs::set_permissions(to, mode)?;
    for entry in fs::read_dir(from).with_context(|| format!("read {}", from.display()))? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            fs::copy(entry.path(), &target)
                .with_context(|| format!("copy {}", entry.path().display()))?;
        } else {
            bail!(
                "{}: not a plain file or directory (a tablespace link?): the drill restores \
                 plain single-directory backups only",
                entry.path().display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_is_copied_with_its_modes_and_links_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let from = root.path().join("from");
        fs::create_dir_all(from.join("base/1")).unwrap();
        fs::write(from.join("base/1/123"), b"page").unwrap();
        fs::set_permissions(from.join("base/1/123"), fs::Permissions::from_mode(0o600)).unwrap();
        copy_tree(&from, &root.path().join("to")).unwrap();
        let copied = root.path().join("to/base/1/123");
        assert_eq!(fs::read(&copied).unwrap(), b"page");
        assert_eq!(fs::metadata(&copied).unwrap().permissions().mode() & 0o777, 0o600);
        std::os::unix::fs::symlink("/tmp", from.join("pg_tblspc")).unwrap();
        let e = copy_tree(&from, &root.path().join("again")).unwrap_err();
        assert!(e.to_string().contains("tablespace"), "{e}");
    }
}
