//! WAL archiving of a stack's PostgreSQL (issue 26 item 4; seed ch9 §11.4: continuous WAL
//! archiving, base backups, point-in-time restore): how a segment gets into the archive
//! ([`enable`] writes the settings, [`archive_command`] copies), how a restore reads it back
//! ([`restore_command`]), and whether the archive is continuous from a backup on ([`survey`]).
//!
//! Switched on by `flashsale stack up --archive-wal` (or a test calling [`enable`] before
//! `Server::start`); once written, the settings stay with the data directory, so a later `stack
//! up` without the flag keeps archiving. A flag rather than always on: the test suite's shared
//! cluster and the demo's stack write all the time and never restore, and every switch archives
//! a whole segment — they would fill the disk with archives nobody reads. They live in `data/flashsale-archive.conf`, included
//! from `postgresql.conf`, so a base backup carries them: the restore drill turns archiving off
//! in its copy (`app/backup/restored.rs`), or a promoted drill copy would push a timeline of
//! its own into the archive that real restores follow.
//!
//! Where the archive is: a directory beside the cluster's data, [`ARCHIVE_DIR_NAME`] —
//! `DIR/postgres/wal-archive` for the standalone and cluster stacks, `DIR/pg-standbys/wal-archive`
//! for `ha` (one archive for the three nodes: only the primary archives, and a promoted standby
//! goes on on its new timeline, whose segments have other names). The server names it itself,
//! `SHOW flashsale.wal_archive` ([`ARCHIVE_SETTING`]): `flashsale admin backup` needs only the
//! PostgreSQL URL. On one machine the archive shares the data's disk; in production it belongs
//! on other storage (another site, write-once), which `archive_command` is the place to change.
//!
//! Not here: base backups and the restore drill (`app/backup/`).

use std::collections::BTreeSet;
use std::fs;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::Path;

use super::error::{io_err, StackError};
use super::pg_init::{ensure_traversable, init_postgres, postgres_owner};
use super::pg_query::simple_query;

/// The archive's directory name beside a cluster's data directories.
pub const ARCHIVE_DIR_NAME: &str = "wal-archive";

/// The custom setting through which a server names its archive directory.
pub const ARCHIVE_SETTING: &str = "flashsale.wal_archive";

/// `archive_timeout`: the longest a committed transaction's WAL waits in a half-filled segment
/// before it is switched out and archived. The seed's RPO for orders after losing the primary's
/// site is 60 s (ch9 §6.7); a busy sale fills a 16 MiB segment in seconds (~3.3 kB of WAL per
/// order, FIELD-NOTES.md), but its quiet tail (payments trickling in) would not. 30 s keeps the
/// archive's lag at half that budget, leaving the other half for the copy off the site. The
/// cost: each forced switch archives a whole segment, at most 2 a minute (~1.9 GiB an hour of
/// mostly empty files) while anything writes, none while the server is idle.
pub const ARCHIVE_TIMEOUT_S: u32 = 30;

/// The settings file in the data directory, and the line that includes it.
const CONF_FILE: &str = "flashsale-archive.conf";
const INCLUDE_LINE: &str = "include_if_exists = 'flashsale-archive.conf'";

/// Most directory entries [`survey`] reads (a day at the forced-switch rate is 2,880).
const ARCHIVE_ENTRIES_MAX: usize = 1_000_000;

/// Whether `stack up` turns archiving on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalArchiving {
    /// As the data directory says: off for a new one, on for one [`enable`]d before.
    AsConfigured,
    /// On (`stack up --archive-wal`).
    On,
}

/// Configures the cluster under `pg_dir` (`pg_dir/data`, created by `initdb` if missing) to
/// archive into `archive` (created, owned by the server's user). Takes effect at the server's
/// next start; idempotent.
pub fn enable(pg_dir: &Path, archive: &Path) -> Result<(), StackError> {
    fs::create_dir_all(pg_dir).map_err(io_err(format!("create {}", pg_dir.display())))?;
    init_postgres(pg_dir)?;
    fs::create_dir_all(archive).map_err(io_err(format!("create {}", archive.display())))?;
    let archive =
        archive.canonicalize().map_err(io_err(format!("canonicalize {}", archive.display())))?;
    if let Some(owner) = postgres_owner()? {
        ensure_traversable(&archive, owner)?;
        std::os::unix::fs::chown(&archive, Some(owner.uid), Some(owner.gid))
            .map_err(io_err(format!("chown {}", archive.display())))?;
    }
    let data = pg_dir.join("data");
    let settings = format!(
        "# Written by flashsale (engine/src/app/stack/wal_archive.rs): WAL archiving.\n\
         wal_level = replica\n\
         archive_mode = on\n\
         archive_command = '{}'\n\
         archive_timeout = {ARCHIVE_TIMEOUT_S}\n\
         # The restore drill reads the newest recovered commit's time (pg_last_committed_xact).\n\
         track_commit_timestamp = on\n\
         {ARCHIVE_SETTING} = '{}'\n",
        archive_command(&archive)?,
        archive.display()
    );
    let conf = data.join(CONF_FILE);
    fs::write(&conf, settings).map_err(io_err(format!("write {}", conf.display())))?;
    if let Some(owner) = postgres_owner()? {
        std::os::unix::fs::chown(&conf, Some(owner.uid), Some(owner.gid))
            .map_err(io_err(format!("chown {}", conf.display())))?;
    }
    include_once(&data.join("postgresql.conf"))
}

fn include_once(postgresql_conf: &Path) -> Result<(), StackError> {
    let text = fs::read_to_string(postgresql_conf)
        .map_err(io_err(format!("read {}", postgresql_conf.display())))?;
    if text.lines().any(|line| line.trim() == INCLUDE_LINE) {
        return Ok(());
    }
    let mut file = fs::OpenOptions::new()
        .append(true)
        .open(postgresql_conf)
        .map_err(io_err(format!("open {}", postgresql_conf.display())))?;
    writeln!(file, "\n{INCLUDE_LINE}")
        .map_err(io_err(format!("append to {}", postgresql_conf.display())))
}

/// Checks that the running server at `addr` archives: one started before [`enable`] wrote the
/// settings does not until it restarts (`archive_mode` is read at start only).
pub fn check_running(addr: SocketAddr) -> Result<(), StackError> {
    let sql = format!(
        "SELECT current_setting('archive_mode'), current_setting('{ARCHIVE_SETTING}', true)"
    );
    let rows = simple_query(addr, &sql)?;
    let row = rows.first();
    let mode = row.and_then(|r| r.first().cloned().flatten()).unwrap_or_default();
    let archive = row.and_then(|r| r.get(1).cloned().flatten()).unwrap_or_default();
    if mode == "off" || archive.is_empty() {
        return Err(StackError::Service {
            service: "postgres",
            message: format!(
                "the server at {addr} runs without WAL archiving (archive_mode={mode}): it was \
                 started before archiving was configured (`archive_mode` is read at start only); \
                 `flashsale stack down`, then `stack up --archive-wal` again (the data is kept; \
                 an `ha` stack must be purged first, `stack down --purge`)"
            ),
        });
    }
    Ok(())
}

/// The `archive_command` copying a segment into `archive`. A segment already there with the
/// same bytes counts as archived (the archiver retries a segment it archived just before a
/// crash); one there with other bytes fails the command: the archive is never overwritten (an
/// old primary back from the dead, or a second cluster pointed at the same archive, must not
/// replace the history a restore follows — PostgreSQL then retries and `pg_stat_archiver`
/// counts the failures). Otherwise: copy under a temporary name, fsync, rename, fsync the
/// directory, so that a crash leaves the whole segment under its name or none at all.
pub fn archive_command(archive: &Path) -> Result<String, StackError> {
    let dir = quotable(archive)?;
    Ok(format!(
        "f=\"{dir}/%f\"; if [ -f \"$f\" ]; then cmp -s \"%p\" \"$f\"; else cp \"%p\" \"$f.part\" \
         && sync \"$f.part\" && mv \"$f.part\" \"$f\" && sync \"{dir}\"; fi"
    ))
}

/// The `restore_command` reading a segment (or a timeline history file) back from `archive`;
/// it fails, as PostgreSQL expects, for a file the archive does not hold.
pub fn restore_command(archive: &Path) -> Result<String, StackError> {
    let dir = quotable(archive)?;
    Ok(format!("cp \"{dir}/%f\" \"%p\""))
}

/// `archive` as it may stand inside double quotes in a shell command that is itself a
/// single-quoted PostgreSQL setting: absolute, and none of `'"$\`%` (PostgreSQL expands `%`)
/// nor a line break.
fn quotable(archive: &Path) -> Result<String, StackError> {
    let text = archive.display().to_string();
    let refused = |c: char| matches!(c, '\'' | '"' | '$' | '\\' | '`' | '%' | '\n' | '\r');
    if !archive.is_absolute() || text.chars().any(refused) {
        return Err(StackError::Service {
            service: "postgres",
            message: format!(
                "WAL archive path {text:?} must be absolute and free of quotes, `$`, `\\`, \
                 backquotes, `%` and line breaks (it is spelled inside archive_command)"
            ),
        });
    }
    Ok(text)
}

/// What the archive holds from a backup's first segment on, on that segment's timeline.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ArchiveSurvey {
    /// WAL segments in the archive, every timeline.
    pub segments: usize,
    /// Timeline history files (`*.history`): the archive saw a promotion.
    pub history_files: usize,
    /// The backup's first segment.
    pub from: String,
    /// The last segment of the unbroken run from `from` (None: `from` itself is missing).
    pub contiguous_through: Option<String>,
    /// The first segment missing after that run when a later one of the timeline exists: a
    /// gap, past which no restore can replay on this timeline.
    pub first_missing: Option<String>,
    /// The newest segment of that timeline.
    pub newest: Option<String>,
}

/// Surveys `archive` from the segment `from` (24 hex digits) on, for segments of
/// `wal_segment_bytes` (`SHOW wal_segment_size`).
pub fn survey(
    archive: &Path,
    from: &str,
    wal_segment_bytes: u64,
) -> Result<ArchiveSurvey, StackError> {
    let bad = |what: &str| StackError::Service { service: "postgres", message: what.to_owned() };
    let start = Segment::parse(from).ok_or_else(|| bad("not a WAL segment name"))?;
    let per_log = segments_per_log(wal_segment_bytes).ok_or_else(|| bad("bad segment size"))?;
    let context = format!("read {}", archive.display());
    let mut on_timeline = BTreeSet::new();
    let (mut segments, mut history_files) = (0, 0);
    for (count, entry) in fs::read_dir(archive).map_err(io_err(&context))?.enumerate() {
        if count >= ARCHIVE_ENTRIES_MAX {
            return Err(bad("the archive holds more entries than the survey reads"));
        }
        let name = entry.map_err(io_err(&context))?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".history") {
            history_files += 1;
        } else if let Some(segment) = Segment::parse(&name) {
            segments += 1;
            if segment.timeline == start.timeline {
                on_timeline.insert(segment.number(per_log));
            }
        }
    }
    let first = start.number(per_log);
    let newest = on_timeline.iter().next_back().copied();
    let mut through = None;
    let mut next = first;
    while on_timeline.contains(&next) {
        through = Some(next);
        next += 1;
    }
    let name = |number: u64| start.with_number(number, per_log).name();
    Ok(ArchiveSurvey {
        segments,
        history_files,
        from: from.to_owned(),
        contiguous_through: through.map(name),
        first_missing: newest.filter(|n| *n > next).map(|_| name(next)),
        newest: newest.map(name),
    })
}

/// The segments of one 4 GiB "log" id (`0x1_0000_0000 / segment size`).
fn segments_per_log(wal_segment_bytes: u64) -> Option<u64> {
    let valid =
        wal_segment_bytes.is_power_of_two() && (1 << 20..=1 << 30).contains(&wal_segment_bytes);
    valid.then(|| (1u64 << 32) / wal_segment_bytes)
}

/// A WAL segment's name: timeline, log id and segment, 8 hex digits each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    timeline: u32,
    log: u32,
    seg: u32,
}

impl Segment {
    fn parse(name: &str) -> Option<Segment> {
        if name.len() != 24 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let field = |at: usize| u32::from_str_radix(&name[at..at + 8], 16).ok();
        Some(Segment { timeline: field(0)?, log: field(8)?, seg: field(16)? })
    }

    /// Its position on the timeline, counted in segments.
    fn number(self, per_log: u64) -> u64 {
        u64::from(self.log) * per_log + u64::from(self.seg)
    }

    fn with_number(self, number: u64, per_log: u64) -> Segment {
        let log = u32::try_from(number / per_log).unwrap_or(u32::MAX);
        let seg = u32::try_from(number % per_log).unwrap_or(u32::MAX);
        Segment { timeline: self.timeline, log, seg }
    }

    fn name(self) -> String {
        format!("{:08X}{:08X}{:08X}", self.timeline, self.log, self.seg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_count_across_log_ids() {
        let per_log = segments_per_log(16 << 20).unwrap();
        assert_eq!(per_log, 256);
        let s = Segment::parse("0000000200000001000000FF").unwrap();
        assert_eq!((s.timeline, s.log, s.seg), (2, 1, 255));
        let next = s.with_number(s.number(per_log) + 1, per_log);
        assert_eq!(next.name(), "000000020000000200000000");
        assert_eq!(Segment::parse("000000010000000000000002.00000028.backup"), None);
        assert_eq!(Segment::parse("00000001000000000000000G"), None);
        assert_eq!(segments_per_log(3 << 20), None, "not a power of two");
    }

    #[test]
    fn a_survey_finds_the_run_and_the_first_gap() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "000000010000000000000002",
            "000000010000000000000003",
            "000000010000000000000005",
            "000000020000000000000005",
            "00000002.history",
            "000000010000000000000002.00000028.backup",
        ] {
            fs::write(dir.path().join(name), b"").unwrap();
        }
        let survey = survey(dir.path(), "000000010000000000000002", 16 << 20).unwrap();
        assert_eq!(survey.segments, 4);
        assert_eq!(survey.history_files, 1);
        assert_eq!(survey.contiguous_through.as_deref(), Some("000000010000000000000003"));
        assert_eq!(survey.first_missing.as_deref(), Some("000000010000000000000004"));
        assert_eq!(survey.newest.as_deref(), Some("000000010000000000000005"));
        let none = super::survey(dir.path(), "000000010000000000000009", 16 << 20).unwrap();
        assert_eq!((none.contiguous_through, none.first_missing), (None, None));
    }

    #[test]
    fn commands_refuse_paths_a_shell_or_postgres_would_reinterpret() {
        let ok = archive_command(Path::new("/var/tmp/stack/postgres/wal-archive")).unwrap();
        assert!(ok.contains("cmp -s \"%p\""), "{ok}");
        assert_eq!(restore_command(Path::new("/a/b")).unwrap(), "cp \"/a/b/%f\" \"%p\"".to_owned());
        for bad in ["relative/dir", "/a/'b", "/a/\"b", "/a/$b", "/a/%b", "/a/`b`"] {
            assert!(archive_command(Path::new(bad)).is_err(), "{bad}");
        }
    }
}
