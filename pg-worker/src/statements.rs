//! How the order transaction's statements reach PostgreSQL, for both ways of writing a batch
//! (`set_writer.rs`, `order_writer.rs`): every statement prepared once per connection, and
//! requests pipelined so that a batch costs two round trips whatever its size.
//!
//! What it is: [`Statements`] (prepared with `prepare_cached`: cache hits after a connection's
//! first batch); [`Pending`], [`exec`], [`call`] and [`pipeline`], which put several requests on
//! the wire back-to-back and hand back their results in order; [`next_result`]; and the two
//! conversions the statements' parameters and errors need ([`system_time`], [`describe`]).
//!
//! What it is not: the SQL text (`sql.rs`), what a batch sends (the writers), or the events a
//! batch writes (`batch_events.rs`). It decides nothing and holds no transaction state.
//!
//! Read next: `set_writer.rs`, `order_writer.rs`, `sql.rs`.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_postgres::ClientWrapper;
use futures::future::{maybe_done, MaybeDone};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Statement};

use crate::error::PgError;
use crate::sql;

/// Every statement a batch may send, prepared once per connection.
pub(crate) struct Statements {
    pub(crate) begin: Statement,
    pub(crate) commit: Statement,
    pub(crate) rollback: Statement,
    pub(crate) order_create: Statement,
    pub(crate) insert_events: Statement,
    pub(crate) return_units: Statement,
    pub(crate) order_facts: Statement,
    pub(crate) order_apply: Statement,
}

impl Statements {
    /// Cache hits after a connection's first batch (no round trip).
    pub(crate) async fn prepare(client: &ClientWrapper) -> Result<Statements, PgError> {
        Ok(Statements {
            begin: client.prepare_cached(sql::BEGIN_SQL).await?,
            commit: client.prepare_cached(sql::COMMIT_SQL).await?,
            rollback: client.prepare_cached(sql::ROLLBACK_SQL).await?,
            order_create: client.prepare_cached(sql::ORDER_CREATE_SQL).await?,
            insert_events: client.prepare_cached(sql::INSERT_EVENTS_SQL).await?,
            return_units: client.prepare_cached(sql::RETURN_UNITS_SQL).await?,
            order_facts: client.prepare_cached(sql::ORDER_FACTS_SQL).await?,
            order_apply: client.prepare_cached(sql::ORDER_APPLY_SQL).await?,
        })
    }
}

/// A unix time in milliseconds as the `timestamptz` parameter it is sent as.
pub(crate) fn system_time(unix_ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(unix_ms)
}

/// "SQLSTATE 40P01: deadlock detected" for server errors, the driver's text otherwise.
pub fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("SQLSTATE {}: {}", db.code().code(), db.message()),
        None => error.to_string(),
    }
}

pub(crate) fn next_result(
    results: &mut impl Iterator<Item = Result<Option<Row>, tokio_postgres::Error>>,
) -> Result<Option<Row>, PgError> {
    match results.next() {
        Some(result) => Ok(result?),
        None => Err(PgError::InvalidArgument("pipeline returned fewer results than requests")),
    }
}

pub(crate) type Pending<'a> =
    Pin<Box<dyn Future<Output = Result<Option<Row>, tokio_postgres::Error>> + Send + 'a>>;

pub(crate) fn exec<'a>(pg: &'a tokio_postgres::Client, statement: &'a Statement) -> Pending<'a> {
    Box::pin(async move { pg.execute(statement, &[]).await.map(|_| None) })
}

pub(crate) fn call<'a>(
    pg: &'a tokio_postgres::Client,
    statement: &'a Statement,
    args: &'a [&'a (dyn ToSql + Sync)],
) -> Pending<'a> {
    Box::pin(async move { pg.query_one(statement, args).await.map(Some) })
}

/// Runs `requests` pipelined: tokio-postgres sends a request when its future is first polled,
/// so polling every future once, in order, puts them on the wire back-to-back in that order;
/// the server executes them in that order and the responses come back in it.
pub(crate) async fn pipeline(
    requests: Vec<Pending<'_>>,
) -> Vec<Result<Option<Row>, tokio_postgres::Error>> {
    let mut slots: Vec<MaybeDone<Pending<'_>>> = requests.into_iter().map(maybe_done).collect();
    for slot in slots.iter_mut() {
        // Sends the request; the result (if already there) stays in the slot.
        let _ = futures::poll!(&mut *slot);
    }
    for slot in slots.iter_mut() {
        (&mut *slot).await;
    }
    slots
        .iter_mut()
        .map(|slot| match Pin::new(slot).take_output() {
            Some(result) => result,
            // Every slot was awaited to completion just above.
            None => unreachable!("pipelined request without an output"),
        })
        .collect()
}
