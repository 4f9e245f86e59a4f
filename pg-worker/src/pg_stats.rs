//! PostgreSQL's own health for the dependency metrics (seed ch9 §12.5: replication lag, sync
//! standby count, lock waits, connections against their budget), read from the primary's
//! statistics views in one round trip of three statements.
//!
//! What it is: [`sample`] and the plain record it returns, and [`sync_standbys_required`],
//! which reads `synchronous_standby_names` into the number of standbys a commit waits for (the
//! quorum the alert compares with). What it is not: the loop (the edge's `durable/health.rs`
//! samples it on a connection of its own at a modest interval).
//!
//! Privileges: `pg_stat_replication`'s positions are visible to superusers and `pg_monitor`
//! members only; without them the lag reads as unknown (no series), never as 0.

use tokio_postgres::Client;

use crate::error::PgError;

/// Standbys reported (a primary has two or three here; the bound keeps the labels few).
pub const STANDBYS_REPORTED_MAX: usize = 16;

/// Each standby: its name, its sync state, bytes and seconds of replay lag.
const STANDBYS_SQL: &str = "SELECT application_name, sync_state, \
     pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint AS lag_bytes, \
     EXTRACT(EPOCH FROM replay_lag)::float8 AS lag_s \
     FROM pg_stat_replication ORDER BY application_name LIMIT 16";

/// Locks waited for, connections in use, their limit, the synchronous standby rule.
const SERVER_SQL: &str = "SELECT \
     (SELECT count(*) FROM pg_locks WHERE NOT granted)::bigint, \
     (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::bigint, \
     current_setting('max_connections')::bigint, \
     current_setting('synchronous_standby_names')";

const _: () = assert!(STANDBYS_REPORTED_MAX == 16, "STANDBYS_SQL's LIMIT");

/// One standby as the primary sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct StandbyStats {
    pub name: String,
    /// `sync`, `quorum`, `potential` or `async`.
    pub sync_state: String,
    /// Replay position behind the primary's WAL (None: not visible to this role).
    pub lag_bytes: Option<i64>,
    /// Replay lag in seconds as PostgreSQL measures it (None while idle or not visible).
    pub lag_s: Option<f64>,
}

/// The primary's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct PgStats {
    pub standbys: Vec<StandbyStats>,
    /// Standbys whose `sync_state` is `sync` or `quorum` (a commit may wait on them).
    pub sync_standbys: u64,
    /// How many of them a commit waits for (`synchronous_standby_names`; 0: none).
    pub sync_standbys_required: u64,
    pub locks_waiting: i64,
    pub connections: i64,
    pub max_connections: i64,
}

/// Reads the figures on `client` (meant to be a connection of its own: the worker's pool is
/// the order path's budget).
pub async fn sample(client: &Client) -> Result<PgStats, PgError> {
    let rows = client.query(STANDBYS_SQL, &[]).await?;
    let standbys: Vec<StandbyStats> = rows
        .iter()
        .map(|row| StandbyStats {
            name: row.get::<_, Option<String>>(0).unwrap_or_default(),
            sync_state: row.get::<_, Option<String>>(1).unwrap_or_default(),
            lag_bytes: row.get(2),
            lag_s: row.get(3),
        })
        .collect();
    let row = client.query_one(SERVER_SQL, &[]).await?;
    let rule: String = row.get(3);
    Ok(PgStats {
        sync_standbys: standbys
            .iter()
            .filter(|s| matches!(s.sync_state.as_str(), "sync" | "quorum"))
            .count() as u64,
        standbys,
        sync_standbys_required: sync_standbys_required(&rule),
        locks_waiting: row.get(0),
        connections: row.get(1),
        max_connections: row.get(2),
    })
}

/// The number of synchronous standbys `synchronous_standby_names` makes a commit wait for:
/// `ANY n (...)` / `FIRST n (...)` / `n (...)` → n; a plain list `a, b` → 1 (the first one);
/// `*` → 1; empty → 0.
pub fn sync_standbys_required(rule: &str) -> u64 {
    let rule = rule.trim();
    if rule.is_empty() {
        return 0;
    }
    let words: Vec<&str> = rule.split(|c: char| c.is_whitespace() || c == '(').collect();
    let mut words = words.into_iter().filter(|w| !w.is_empty());
    let first = words.next().unwrap_or("");
    let counted = if first.eq_ignore_ascii_case("ANY") || first.eq_ignore_ascii_case("FIRST") {
        words.next()
    } else {
        Some(first)
    };
    counted.and_then(|n| n.parse().ok()).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standby_rule_says_how_many_a_commit_waits_for() {
        assert_eq!(sync_standbys_required(""), 0);
        assert_eq!(sync_standbys_required("ANY 1 (s1, s2)"), 1);
        assert_eq!(sync_standbys_required("any 2 (\"s1\",s2,s3)"), 2);
        assert_eq!(sync_standbys_required("FIRST 2 (s1, s2, s3)"), 2);
        assert_eq!(sync_standbys_required("2 (s1, s2)"), 2);
        assert_eq!(sync_standbys_required("s1, s2"), 1);
        assert_eq!(sync_standbys_required("*"), 1);
    }
}
