//! What the worker's tasks share: [`Shared`] (the configuration, the pool, the log and its
//! publisher, the lag the edge reads), and the three things every task loop does the same way —
//! read the clock ([`now_ms`]), pause until the next round or the stop signal ([`pause`]), and
//! bound one transaction client-side ([`within_deadline`]).
//!
//! What it is not: a task (the `*_task.rs` files), or the runtime that builds this state
//! (`mod.rs::start`).
//!
//! Read next: `order_writer_task.rs`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_postgres::Pool;
use flashsale_io::jetstream::{Log, LogLag, Publisher};
use tokio::sync::watch;

use super::config::WorkerConfig;
use crate::classify::RetryPolicy;
use crate::error::PgError;

/// State shared by the worker's tasks.
pub(super) struct Shared {
    pub(super) config: WorkerConfig,
    pub(super) policy: RetryPolicy,
    pub(super) pool: Pool,
    /// The pool's connector, told when a transaction outlasts its deadline.
    pub(super) connector: crate::pool::Connector,
    pub(super) log: Log,
    pub(super) publisher: Publisher,
    pub(super) lag: LogLag,
    /// Where the order writes' spans go (disabled unless tracing is configured).
    pub(super) traces: flashsale_io::trace::TraceSink,
}

/// The wall clock, in unix milliseconds (0 before 1970).
pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(super) fn ms(value: u64) -> Duration {
    Duration::from_millis(value)
}

/// Sleeps `duration` unless `stop` turns true first; returns whether to stop.
pub(super) async fn pause(duration: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(duration) => *stop.borrow(),
        changed = stop.changed() => changed.is_err() || *stop.borrow(),
    }
}

/// Bounds one transaction (or round) on a pooled connection by `pg.transaction_deadline_ms`,
/// client-side: `statement_timeout` cannot fire on a server that does not run (SIGSTOPped,
/// or a machine gone without a reset), and the commit's outcome is then unknown. The caller
/// discards the connection on any error (it may still be inside the transaction); every
/// round here is idempotent (the inbox, SKIP LOCKED claims, conditional transitions), so the
/// retry that follows is safe. The error reads as unavailable (`TimedOut`).
pub(super) async fn within_deadline<T>(
    shared: &Shared,
    what: &str,
    work: impl std::future::Future<Output = Result<T, PgError>>,
) -> Result<T, PgError> {
    let deadline_ms = shared.config.pg.transaction_deadline_ms;
    match tokio::time::timeout(ms(deadline_ms), work).await {
        Ok(result) => result,
        Err(_) => {
            metrics::counter!("flashsale_pg_transaction_deadlines_total").increment(1);
            // The pool's other connections to the same host may hang as well: a survey now
            // closes them all if a standby was promoted (`Connector::suspect`).
            shared.connector.suspect();
            let message = format!(
                "{what} outlasted the client-side transaction deadline of {deadline_ms} ms \
                 (outcome unknown; the retry is idempotent)"
            );
            Err(PgError::Db(crate::pool::minted_error(std::io::ErrorKind::TimedOut, message).await))
        }
    }
}
