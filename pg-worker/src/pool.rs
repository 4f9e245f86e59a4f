//! The PostgreSQL connection pool of one worker process: its size is this process's share of
//! the database's connection budget (DESIGN.md section 3, bulkheads).
//!
//! What it is: [`PgPoolConfig`] (every knob spelled out) and [`build_pool`], a
//! `deadpool-postgres` pool over connections whose URL goes through tokio-postgres' own parser
//! untouched, so a libpq-style multi-host URL with `target_session_attrs=read-write`
//! (`postgres://u@h1:5432,h2:5432/db?target_session_attrs=read-write`) connects to whichever
//! host is a writable primary, trying them in order. Every connection starts with our
//! `statement_timeout` and `lock_timeout` (a stuck lock surfaces as 55P03, which is transient,
//! instead of hanging a worker) appended to whatever `options` the URL carried.
//!
//! What it is not: a health checker. A connection that fails mid-batch is discarded by the
//! caller (`deadpool_postgres::Object::take`), and the pool opens a new one on demand.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

use crate::error::PgError;

/// Connection settings for one pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgPoolConfig {
    /// libpq-style URL; several hosts with `target_session_attrs=read-write` allowed.
    pub url: String,
    /// Most connections this pool opens (this process's share of the connection budget).
    pub pool_size: usize,
    /// Bound on opening one connection (per host tried).
    pub connect_timeout_ms: u64,
    /// Longest a task waits for a free connection before giving up (transient error).
    pub wait_timeout_ms: u64,
    /// Server-side bound on one statement.
    pub statement_timeout_ms: u64,
    /// Server-side bound on waiting for a lock.
    pub lock_timeout_ms: u64,
    /// `application_name`, shown in `pg_stat_activity`.
    pub application_name: String,
}

impl Default for PgPoolConfig {
    fn default() -> PgPoolConfig {
        PgPoolConfig {
            url: "postgres://postgres@127.0.0.1:5432/postgres".to_owned(),
            pool_size: 8,
            connect_timeout_ms: 5_000,
            wait_timeout_ms: 5_000,
            statement_timeout_ms: 10_000,
            lock_timeout_ms: 2_000,
            application_name: "flashsale-worker".to_owned(),
        }
    }
}

/// Largest pool one process may ask for; PostgreSQL's `max_connections` is shared by every
/// process, and a worker that needs more should be a second process.
pub const POOL_SIZE_MAX: usize = 256;

impl PgPoolConfig {
    pub fn validate(&self) -> Result<(), PgError> {
        if !(1..=POOL_SIZE_MAX).contains(&self.pool_size) {
            return Err(PgError::Config(format!(
                "pool_size {} must be within 1..={POOL_SIZE_MAX}",
                self.pool_size
            )));
        }
        for (name, value) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("wait_timeout_ms", self.wait_timeout_ms),
            ("statement_timeout_ms", self.statement_timeout_ms),
            ("lock_timeout_ms", self.lock_timeout_ms),
        ] {
            if value == 0 {
                return Err(PgError::Config(format!("{name} must be positive")));
            }
        }
        self.url
            .parse::<tokio_postgres::Config>()
            .map_err(|e| PgError::Config(format!("pg url: {e}")))?;
        Ok(())
    }
}

/// Builds the pool (no connection is opened until the first `get`).
pub fn build_pool(config: &PgPoolConfig) -> Result<Pool, PgError> {
    config.validate()?;
    let mut pg: tokio_postgres::Config =
        config.url.parse().map_err(|e| PgError::Config(format!("pg url: {e}")))?;
    pg.connect_timeout(Duration::from_millis(config.connect_timeout_ms));
    pg.application_name(&config.application_name);
    let options = format!(
        "{} -c statement_timeout={} -c lock_timeout={}",
        pg.get_options().unwrap_or(""),
        config.statement_timeout_ms,
        config.lock_timeout_ms
    );
    pg.options(options.trim_start());
    let manager = Manager::from_config(
        pg,
        NoTls,
        // Fast: no test query on checkout; a dead connection fails its next statement, the
        // caller discards it and the message is redelivered.
        ManagerConfig { recycling_method: RecyclingMethod::Fast },
    );
    let wait = Some(Duration::from_millis(config.wait_timeout_ms));
    Pool::builder(manager)
        .max_size(config.pool_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(wait)
        .create_timeout(wait)
        .recycle_timeout(wait)
        .build()
        .map_err(|e| PgError::Config(format!("build pool: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_host_urls_are_accepted() {
        let config = PgPoolConfig {
            url:
                "postgres://postgres@10.0.0.1:5432,10.0.0.2:5433/db?target_session_attrs=read-write"
                    .into(),
            ..Default::default()
        };
        config.validate().expect("multi-host URL");
        let parsed: tokio_postgres::Config = config.url.parse().expect("parse");
        assert_eq!(parsed.get_hosts().len(), 2);
        assert_eq!(parsed.get_ports(), &[5432, 5433]);
        assert_eq!(
            parsed.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        for config in [
            PgPoolConfig { pool_size: 0, ..Default::default() },
            PgPoolConfig { pool_size: POOL_SIZE_MAX + 1, ..Default::default() },
            PgPoolConfig { lock_timeout_ms: 0, ..Default::default() },
            PgPoolConfig {
                url: "postgres://h/db?target_session_attrs=bogus".into(),
                ..Default::default()
            },
        ] {
            assert!(matches!(config.validate(), Err(PgError::Config(_))), "{config:?}");
        }
    }
}
