//! The durable side's one error type at its boundary with the shards.

use flashsale_io::jetstream::LogError;
use flashsale_pg_worker::PgError;

#[derive(Debug, thiserror::Error)]
pub enum DurableError {
    #[error("postgres: {0}")]
    Pg(#[from] PgError),
    #[error("postgres pool: {0}")]
    Pool(String),
    #[error("postgres call timed out")]
    Timeout,
    #[error("log: {0}")]
    Log(#[from] LogError),
    #[error("mode store: {0}")]
    ModeStore(String),
    /// The bucket already holds a snapshot of this scope with version `current` or newer.
    #[error("mode store holds version {current}, not older than the offered one")]
    StaleMode { current: u64 },
    #[error("durable side unavailable (queue full or stopped)")]
    Unavailable,
}
