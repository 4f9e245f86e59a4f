//! The standalone stack: one redis-server, one PostgreSQL and one nats-server under
//! `DIR/<kind>`, started or reused ([`up`]), or one of them alone ([`ensure`], what the
//! integration tests call).
//!
//! With [`WalArchiving::On`] the PostgreSQL server archives its WAL into
//! `DIR/postgres/wal-archive` (`wal_archive.rs`).
//!
//! Not here: the multi-node topologies and `down` (`topology.rs`).

use std::fs;
use std::net::TcpListener;
use std::path::Path;

use super::dir::{lock_dir, StackEnv};
use super::error::{io_err, StackError};
use super::kind::Kind;
use super::server::Server;
use super::wal_archive::{self, WalArchiving, ARCHIVE_DIR_NAME};

/// Starts (or reuses) every server under `dir` and writes `dir/env`. Serialised by a lock
/// file so that two `up`s racing (e.g. parallel test binaries) share one stack.
pub fn up(dir: &Path) -> Result<StackEnv, StackError> {
    up_archiving(dir, WalArchiving::AsConfigured)
}

/// [`up`], with PostgreSQL's WAL archiving switched on when `wal` says so.
pub fn up_archiving(dir: &Path, wal: WalArchiving) -> Result<StackEnv, StackError> {
    fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    let lock = lock_dir(dir)?;
    let mut urls = Vec::with_capacity(3);
    // Servers this call started, stopped again when a later one fails (a refused PostgreSQL
    // directory must not leave a new redis-server running); running ones are reused as is.
    let mut started_now = Vec::with_capacity(3);
    for kind in Kind::ALL {
        let kind_dir = dir.join(kind.name());
        let running = Server::find_running(kind, &kind_dir).is_some();
        match ensure_archiving(kind, &kind_dir, wal) {
            Ok(server) => {
                urls.push(server.url());
                if !running {
                    started_now.push(server);
                }
            }
            Err(e) => {
                for server in started_now {
                    if let Err(refused) = server.kill() {
                        eprintln!("stack up: could not stop {}: {refused}", server.kind.name());
                    }
                }
                return Err(e);
            }
        }
    }
    let env =
        StackEnv { redis_url: urls[0].clone(), pg_url: urls[1].clone(), nats_url: urls[2].clone() };
    fs::write(dir.join("env"), env.render()).map_err(io_err("write env"))?;
    drop(lock);
    Ok(env)
}

/// [`ensure_locked`], for PostgreSQL with its WAL archive configured first when asked and
/// checked to be in force afterwards (a server already running may predate the settings).
pub(super) fn ensure_archiving(
    kind: Kind,
    dir: &Path,
    wal: WalArchiving,
) -> Result<Server, StackError> {
    let archiving = kind == Kind::Postgres && wal == WalArchiving::On;
    if archiving {
        wal_archive::enable(dir, &dir.join(ARCHIVE_DIR_NAME))?;
    }
    let server = ensure_locked(kind, dir)?;
    if archiving {
        wal_archive::check_running(server.addr())?;
    }
    Ok(server)
}

/// One server of `kind` under `dir`: the running one, or a new one (on its previous port when
/// that is free, so URLs stay stable across restarts). Serialised by a lock file in `dir`, so
/// that concurrent callers (parallel tests, two processes) start one server and share it.
pub fn ensure(kind: Kind, dir: &Path) -> Result<Server, StackError> {
    let lock = lock_dir(dir)?;
    let server = ensure_locked(kind, dir);
    drop(lock);
    server
}

/// [`ensure`] for a caller that already holds the lock of a directory above `dir`.
pub(super) fn ensure_locked(kind: Kind, dir: &Path) -> Result<Server, StackError> {
    if let Some(server) = Server::find_running(kind, dir) {
        return Ok(server);
    }
    let previous_port = fs::read_to_string(dir.join("port"))
        .ok()
        .and_then(|p| p.trim().parse::<u16>().ok())
        .filter(|p| TcpListener::bind(("127.0.0.1", *p)).is_ok());
    match previous_port {
        Some(port) => {
            Server::start(kind, dir, Some(port)).or_else(|_| Server::start(kind, dir, None))
        }
        None => Server::start(kind, dir, None),
    }
}
