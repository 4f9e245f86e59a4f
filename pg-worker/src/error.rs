//! The crate's one error type at its boundary, and the SqlState classification
//! behind `is_transient()`.
//!
//! What it is: `PgError` wraps driver errors, the few failures this crate
//! detects itself (a refused migration, a bad argument, a bad worker config), the
//! pool's and the log's errors (the worker's two other boundaries), and answers the two
//! questions callers ask: "is this worth retrying on a fresh connection or a
//! new transaction?" and "which constraint fired?".
//!
//! What it is not: business outcomes. A duplicate buyer or an exhausted SKU is
//! a value the worker returns (see `tokens::ClaimOutcome`), never a `PgError`;
//! the worker decides which constraint violations are outcomes by asking
//! `is_unique_violation()` / `constraint()` right where it handles them.
//!
//! Read next: `migrate.rs` (who raises the migration variants), DESIGN.md
//! section 5 (what the worker does with transient vs permanent errors).

use std::error::Error as _;

use tokio_postgres::error::SqlState;

/// Every failure of this crate. Not `Clone`: driver errors are not.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// Anything the driver or the server reported (shown with the server's SQLSTATE and
    /// message: the driver's own text is only "db error").
    #[error("postgres: {}", describe(.0))]
    Db(#[from] tokio_postgres::Error),

    /// A migration's SQL failed; `source` says why.
    #[error("migration {version} ({name}) failed: {source}")]
    MigrationFailed {
        version: u32,
        name: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },

    /// An applied migration's SQL differs from the one embedded in this binary:
    /// someone edited a frozen file (or the database was migrated by a different
    /// build). Running on would leave the schema different from what the code
    /// expects, so `migrate` refuses.
    #[error(
        "migration {version} ({name}) was changed after it was applied: the database \
         recorded checksum {recorded}, this binary embeds {embedded}; never edit an applied \
         migration, add a new one instead"
    )]
    MigrationChecksumMismatch { version: u32, name: String, recorded: String, embedded: String },

    /// The database has a migration this binary does not know: it was migrated
    /// by a newer build. Refused rather than guessed at.
    #[error(
        "the database has migration {version} ({name}) which this binary does not know \
         (it knows up to {known_max}); run a build at least as new as the one that migrated it"
    )]
    MigrationUnknown { version: i64, name: String, known_max: u32 },

    /// The embedded migration list itself is malformed (a build defect).
    #[error("invalid migration list: {0}")]
    MigrationList(&'static str),

    /// A caller passed an argument outside its documented bounds.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),

    /// The connection pool handed out no connection in time, or was closed. A
    /// connect failure of the server itself arrives as `Db`.
    #[error("connection pool: {0}")]
    Pool(String),

    /// The replicated log (JetStream) failed; the worker's other boundary.
    #[error(transparent)]
    Log(#[from] flashsale_io::jetstream::LogError),

    /// A worker configuration that cannot work (refused at start-up).
    #[error("invalid worker configuration: {0}")]
    Config(String),

    /// The worker's own runtime or threads could not be started or joined.
    #[error("worker runtime: {0}")]
    Runtime(String),
}

impl From<deadpool_postgres::PoolError> for PgError {
    fn from(e: deadpool_postgres::PoolError) -> PgError {
        match e {
            deadpool_postgres::PoolError::Backend(db) => PgError::Db(db),
            other => PgError::Pool(other.to_string()),
        }
    }
}

impl PgError {
    /// The driver error inside, if any.
    pub fn db_error(&self) -> Option<&tokio_postgres::Error> {
        match self {
            PgError::Db(e) | PgError::MigrationFailed { source: e, .. } => Some(e),
            PgError::MigrationChecksumMismatch { .. }
            | PgError::MigrationUnknown { .. }
            | PgError::MigrationList(_)
            | PgError::InvalidArgument(_)
            | PgError::Pool(_)
            | PgError::Log(_)
            | PgError::Config(_)
            | PgError::Runtime(_) => None,
        }
    }

    /// The server's SqlState, when the server answered with an error.
    pub fn sql_state(&self) -> Option<&SqlState> {
        self.db_error().and_then(tokio_postgres::Error::code)
    }

    /// The name of the violated constraint (or unique index), when the server
    /// named one. Every constraint in `migrations/` is named for this reason.
    pub fn constraint(&self) -> Option<&str> {
        self.db_error().and_then(|e| e.as_db_error()).and_then(|db| db.constraint())
    }

    /// 23505: a UNIQUE or PRIMARY KEY constraint rejected the row.
    pub fn is_unique_violation(&self) -> bool {
        self.sql_state() == Some(&SqlState::UNIQUE_VIOLATION)
    }

    /// 23514: a CHECK constraint rejected the row (e.g. an unknown status).
    pub fn is_check_violation(&self) -> bool {
        self.sql_state() == Some(&SqlState::CHECK_VIOLATION)
    }

    /// 23503: a FOREIGN KEY constraint rejected the row.
    pub fn is_foreign_key_violation(&self) -> bool {
        self.sql_state() == Some(&SqlState::FOREIGN_KEY_VIOLATION)
    }

    /// Worth retrying: the same work, in a new transaction (and, for
    /// connection-class failures, on a new connection), may succeed. Never true
    /// for constraint violations, bad SQL or a refused migration.
    pub fn is_transient(&self) -> bool {
        match self {
            // Waiting longer (or a reconnect) may hand out a connection.
            PgError::Pool(_) => true,
            PgError::Log(e) => e.is_transient(),
            _ => match self.db_error() {
                Some(e) => driver_error_is_transient(e),
                None => false,
            },
        }
    }
}

impl PgError {
    /// The database cannot be reached or is not accepting work (no connection, connection
    /// lost, shutting down, starting up, read-only standby): a retry of the same work on a
    /// new connection will do once it is back. Narrower than [`PgError::is_transient`], which
    /// also covers lost races (serialization, deadlock, lock timeout) that should be redone
    /// promptly rather than held.
    pub fn is_unavailable(&self) -> bool {
        match self {
            PgError::Pool(_) => true,
            PgError::Db(e) => match e.code() {
                Some(code) => {
                    code.code().starts_with("08")
                        || *code == SqlState::ADMIN_SHUTDOWN
                        || *code == SqlState::CRASH_SHUTDOWN
                        || *code == SqlState::CANNOT_CONNECT_NOW
                        || *code == SqlState::READ_ONLY_SQL_TRANSACTION
                        || *code == SqlState::TOO_MANY_CONNECTIONS
                }
                None => driver_error_is_transient(e),
            },
            _ => false,
        }
    }
}

/// A driver error as an operator needs it in a log line: `ERROR 22008: timestamp out of
/// range` for a server error, the driver's text (with its cause) for anything else.
pub fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} {}: {}", db.severity(), db.code().code(), db.message()),
        None => match e.source() {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        },
    }
}

/// Whether a bare driver error is worth a retry (the rules of
/// [`PgError::is_transient`], for callers that must keep the error itself).
pub fn sql_error_is_transient(e: &tokio_postgres::Error) -> bool {
    driver_error_is_transient(e)
}

/// Classifies one driver error.
fn driver_error_is_transient(e: &tokio_postgres::Error) -> bool {
    if let Some(code) = e.code() {
        return sql_state_is_transient(code);
    }
    if e.is_closed() {
        return true;
    }
    // No SqlState: the failure happened on our side of the wire. The driver's
    // kind is private, so look at the cause: socket errors (reset, refused, EOF,
    // timed out) are transient; InvalidInput/InvalidData are how the driver
    // reports messages it could not encode or parse, which a retry repeats.
    match e.source().and_then(|s| s.downcast_ref::<std::io::Error>()) {
        Some(io) => {
            !matches!(io.kind(), std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData)
        }
        None => false,
    }
}

/// The SqlStates worth a retry. Sans-I/O so it can be unit-tested and reused
/// by anyone holding a bare `SqlState`.
///
/// - 40001 serialization failure, 40P01 deadlock: the transaction lost a race;
///   rerun it.
/// - 55P03 lock not available: our `lock_timeout` fired while another
///   transaction held the row/lock; rerun later.
/// - class 08 (connection exception), 57P01 admin shutdown, 57P02 crash
///   shutdown, 57P03 cannot connect now (starting up / in recovery): the server
///   went away or is not ready; reconnect, perhaps to the new primary.
/// - 25006 read-only transaction: we reached a standby (e.g. just after a
///   failover, before `target_session_attrs=read-write` re-resolves);
///   reconnect.
/// - 57014 query canceled (our `statement_timeout`, or an operator's cancel)
///   and class 53 (too many connections, out of memory, disk full): the server
///   is overloaded or short of a resource, not the message bad.
///
/// The asymmetry decides the doubtful cases: a permanent failure wrongly called
/// transient costs a bounded number of redeliveries before the DLQ; a transient
/// one wrongly called permanent sends a good reservation to the DLQ at once.
pub fn sql_state_is_transient(code: &SqlState) -> bool {
    *code == SqlState::T_R_SERIALIZATION_FAILURE
        || *code == SqlState::T_R_DEADLOCK_DETECTED
        || *code == SqlState::LOCK_NOT_AVAILABLE
        || *code == SqlState::ADMIN_SHUTDOWN
        || *code == SqlState::CRASH_SHUTDOWN
        || *code == SqlState::CANNOT_CONNECT_NOW
        || *code == SqlState::READ_ONLY_SQL_TRANSACTION
        || *code == SqlState::QUERY_CANCELED
        || code.code().starts_with("08")
        || code.code().starts_with("53")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_states_are_exactly_the_retryable_ones() {
        let transient = [
            "40001", "40P01", "55P03", "08000", "08006", "08003", "57P01", "57P02", "57P03",
            "25006", "57014", "53300", "53100",
        ];
        for code in transient {
            assert!(sql_state_is_transient(&SqlState::from_code(code)), "{code} must be transient");
        }
        // Constraint violations, bad SQL, permissions and data errors repeat on
        // every retry.
        for code in
            ["23505", "23514", "23503", "23502", "42601", "42P01", "42501", "22P02", "XX000"]
        {
            assert!(
                !sql_state_is_transient(&SqlState::from_code(code)),
                "{code} must not be transient"
            );
        }
    }

    #[test]
    fn errors_without_a_driver_error_are_permanent() {
        let e = PgError::InvalidArgument("count");
        assert!(!e.is_transient());
        assert!(!e.is_unique_violation());
        assert!(!e.is_check_violation());
        assert_eq!(e.sql_state(), None);
        assert_eq!(e.constraint(), None);
    }
}
