//! What the backup commands ask PostgreSQL about itself, not about the sale: whether a server
//! archives its WAL and where ([`server_facts`], before a base backup), whether a restored copy
//! has finished recovering ([`in_recovery`]), the newest commit it recovered
//! ([`newest_commit`], the "recovered up to" of the restore drill's RPO), its timeline, and
//! whether it takes a write ([`write_probe`]).
//!
//! What it is not: the checks of the sale's data in a restored copy (`restore_audit.rs`), the
//! base backup itself or the restore (`pg_basebackup` and `postgres`, driven by
//! `engine/src/app/backup/`).

use tokio_postgres::Client;

use crate::error::PgError;

/// A server as `flashsale admin backup` finds it before copying it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ServerFacts {
    /// `server_version` (e.g. `15.20 (Debian 15.20-0+deb12u1)`).
    pub server_version: String,
    /// The database the connection is on: the one the restore drill checks.
    pub database: String,
    /// `pg_control_system().system_identifier`: which cluster a backup and its archive are of.
    pub system_identifier: String,
    pub in_recovery: bool,
    pub wal_level: String,
    pub archive_mode: String,
    /// `flashsale.wal_archive`: where the stack's `archive_command` copies segments (None when
    /// the server does not say).
    pub wal_archive: Option<String>,
    /// `wal_segment_size` in bytes: segment names in the archive follow from it.
    pub wal_segment_bytes: i64,
    /// Whether the role `postgres` exists and is a superuser (the restore drill connects to its
    /// copy as `postgres` and installs `amcheck` there).
    pub postgres_superuser: bool,
    pub archiver: ArchiverStats,
}

/// `pg_stat_archiver`, times in ms since the epoch.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ArchiverStats {
    pub archived_count: i64,
    pub last_archived_wal: Option<String>,
    pub last_archived_at_ms: Option<i64>,
    pub failed_count: i64,
    pub last_failed_wal: Option<String>,
    pub last_failed_at_ms: Option<i64>,
}

impl ArchiverStats {
    /// The last attempt failed: the newest failure is newer than the newest success. A base
    /// backup without WAL of its own waits until its WAL is archived, so it would wait forever.
    pub fn failing(&self) -> bool {
        match (self.last_failed_at_ms, self.last_archived_at_ms) {
            (Some(failed), Some(archived)) => failed > archived,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }
}

const SERVER_FACTS_SQL: &str = "\
SELECT current_setting('server_version'), current_database(), \
       (SELECT system_identifier::text FROM pg_control_system()), pg_is_in_recovery(), \
       current_setting('wal_level'), current_setting('archive_mode'), \
       nullif(current_setting('flashsale.wal_archive', true), ''), \
       (SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size'), \
       coalesce((SELECT rolsuper FROM pg_roles WHERE rolname = 'postgres'), false), \
       a.archived_count, a.last_archived_wal, \
       (extract(epoch FROM a.last_archived_time) * 1000)::bigint, \
       a.failed_count, a.last_failed_wal, \
       (extract(epoch FROM a.last_failed_time) * 1000)::bigint \
FROM pg_stat_archiver a";

/// The server's archiving settings and state (one statement).
pub async fn server_facts(client: &Client) -> Result<ServerFacts, PgError> {
    let row = client.query_one(SERVER_FACTS_SQL, &[]).await?;
    Ok(ServerFacts {
        server_version: row.try_get(0)?,
        database: row.try_get(1)?,
        system_identifier: row.try_get(2)?,
        in_recovery: row.try_get(3)?,
        wal_level: row.try_get(4)?,
        archive_mode: row.try_get(5)?,
        wal_archive: row.try_get(6)?,
        wal_segment_bytes: row.try_get(7)?,
        postgres_superuser: row.try_get(8)?,
        archiver: ArchiverStats {
            archived_count: row.try_get(9)?,
            last_archived_wal: row.try_get(10)?,
            last_archived_at_ms: row.try_get(11)?,
            failed_count: row.try_get(12)?,
            last_failed_wal: row.try_get(13)?,
            last_failed_at_ms: row.try_get(14)?,
        },
    })
}

/// Whether the server is still replaying WAL (a restore not yet promoted).
pub async fn in_recovery(client: &Client) -> Result<bool, PgError> {
    Ok(client.query_one("SELECT pg_is_in_recovery()", &[]).await?.try_get(0)?)
}

/// The timeline of the server's latest checkpoint: a promoted copy is on a new one (the
/// end-of-recovery checkpoint runs before it takes connections as a primary).
pub async fn timeline(client: &Client) -> Result<i64, PgError> {
    let row =
        client.query_one("SELECT timeline_id::bigint FROM pg_control_checkpoint()", &[]).await?;
    Ok(row.try_get(0)?)
}

/// Where a [`NewestCommit`] was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CommitSource {
    /// `pg_last_committed_xact()`: the commit time of the newest transaction replayed
    /// (`track_commit_timestamp` on, as the stack's archiving settings make it).
    CommitTimestamp,
    /// The newest `created_at`/`updated_at`/`published_at` of the sale's tables: each is its
    /// transaction's start (`now()`), so the commit came a little later.
    NewestRow,
}

/// The newest commit a copy holds, ms since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct NewestCommit {
    pub at_ms: i64,
    pub source: CommitSource,
}

const NEWEST_ROW_SQL: &str = "\
SELECT (extract(epoch FROM greatest( \
    (SELECT max(greatest(created_at, updated_at)) FROM orders), \
    (SELECT max(updated_at) FROM inventory_reservation), \
    (SELECT max(created_at) FROM inventory_ledger), \
    (SELECT max(created_at) FROM payment), \
    (SELECT max(received_at) FROM consumer_inbox), \
    (SELECT max(greatest(created_at, published_at)) FROM event_outbox))) * 1000)::bigint";

/// The newest commit the server holds. Read it before anything writes to a restored copy:
/// afterwards the newest commit is that write.
pub async fn newest_commit(client: &Client) -> Result<Option<NewestCommit>, PgError> {
    let tracked: String = client
        .query_one("SELECT current_setting('track_commit_timestamp')", &[])
        .await?
        .try_get(0)?;
    if tracked == "on" {
        let row = client
            .query_one(
                "SELECT (extract(epoch FROM timestamp) * 1000)::bigint FROM pg_last_committed_xact()",
                &[],
            )
            .await?;
        if let Some(at_ms) = row.try_get::<_, Option<i64>>(0)? {
            return Ok(Some(NewestCommit { at_ms, source: CommitSource::CommitTimestamp }));
        }
    }
    let at_ms: Option<i64> = client.query_one(NEWEST_ROW_SQL, &[]).await?.try_get(0)?;
    Ok(at_ms.map(|at_ms| NewestCommit { at_ms, source: CommitSource::NewestRow }))
}

/// One durable write and its commit (a table created, filled and dropped in one transaction):
/// the server is a primary that takes writes, not a copy still replaying or read-only.
pub async fn write_probe(client: &mut Client) -> Result<(), PgError> {
    let txn = client.transaction().await?;
    txn.batch_execute(
        "CREATE TABLE flashsale_restore_probe (written_at timestamptz NOT NULL); \
         INSERT INTO flashsale_restore_probe VALUES (now()); \
         DROP TABLE flashsale_restore_probe",
    )
    .await?;
    txn.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_archiver_fails_when_its_newest_attempt_failed() {
        let at = |archived, failed| ArchiverStats {
            last_archived_at_ms: archived,
            last_failed_at_ms: failed,
            ..ArchiverStats::default()
        };
        assert!(!at(None, None).failing(), "nothing archived yet, nothing failed");
        assert!(!at(Some(2), Some(1)).failing(), "a failure since recovered");
        assert!(at(Some(1), Some(2)).failing());
        assert!(at(None, Some(1)).failing());
    }
}
