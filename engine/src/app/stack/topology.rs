//! `flashsale stack up --topology standalone|cluster|ha` (CONTRACT.md section 1): which
//! servers a stack runs per dependency.
//!
//! - `standalone`: one redis-server, PostgreSQL and nats-server (`super::standalone`).
//! - `cluster`: a Redis Cluster of 3 masters + 3 replicas (`super::redis_cluster`), with
//!   the single PostgreSQL and NATS; `DIR/env` names every Redis node as a seed.
//! - `ha`: that Redis Cluster, a 3-node NATS JetStream cluster (`super::nats_cluster`) and a
//!   PostgreSQL primary with 2 streaming standbys, `synchronous_standby_names = 'ANY 1
//!   (s1, s2)'` (`super::pg_standbys`); `DIR/env` holds the comma-separated seeds and the
//!   multi-host PostgreSQL URL (`target_session_attrs=read-write`).
//!
//! With archiving on (`--archive-wal`), PostgreSQL archives its WAL into [`archive_dir`].
//!
//! [`down`] stops every server of every topology recorded under the directory (the single
//! ones, then the multi-node ones through [`down_nodes`]).

use std::fs;
use std::path::{Path, PathBuf};

use super::dir::{lock_dir, StackEnv};
use super::error::{io_err, StackError};
use super::kind::Kind;
use super::nats_cluster::{self, NatsCluster};
use super::pg_standbys::{self, PgStandbys};
use super::process::process_matches;
use super::redis_cluster::{self, RedisCluster};
use super::server::Server;
use super::standalone::{self, ensure_archiving, ensure_locked};
use super::wal_archive::{WalArchiving, ARCHIVE_DIR_NAME};

/// Where the multi-node servers live under a stack directory.
pub const REDIS_CLUSTER_DIR: &str = "redis-cluster";
pub const NATS_CLUSTER_DIR: &str = "nats-cluster";
pub const PG_STANDBYS_DIR: &str = "pg-standbys";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    Standalone,
    Cluster,
    Ha,
}

impl Topology {
    pub const ALL: [Topology; 3] = [Topology::Standalone, Topology::Cluster, Topology::Ha];

    pub fn name(self) -> &'static str {
        match self {
            Topology::Standalone => "standalone",
            Topology::Cluster => "cluster",
            Topology::Ha => "ha",
        }
    }

    pub fn parse(text: &str) -> Result<Topology, String> {
        Topology::ALL
            .into_iter()
            .find(|t| t.name() == text)
            .ok_or_else(|| format!("unknown topology {text:?}: standalone, cluster or ha"))
    }
}

/// Starts (or reuses) the stack of `topology` under `dir` and writes `dir/env`.
pub fn up_with(dir: &Path, topology: Topology) -> Result<StackEnv, StackError> {
    up_with_archiving(dir, topology, WalArchiving::AsConfigured)
}

/// [`up_with`], with PostgreSQL archiving its WAL into [`archive_dir`] when `wal` says so
/// (`flashsale stack up --archive-wal`).
pub fn up_with_archiving(
    dir: &Path,
    topology: Topology,
    wal: WalArchiving,
) -> Result<StackEnv, StackError> {
    match topology {
        Topology::Standalone => standalone::up_archiving(dir, wal),
        Topology::Cluster => up_cluster(dir, wal),
        Topology::Ha => up_ha(dir, wal),
    }
}

/// Where the stack of `topology` under `dir` keeps its WAL archive (when archiving is on):
/// beside the PostgreSQL data, `DIR/postgres/wal-archive` or `DIR/pg-standbys/wal-archive`.
pub fn archive_dir(dir: &Path, topology: Topology) -> PathBuf {
    let pg = match topology {
        Topology::Standalone | Topology::Cluster => Kind::Postgres.name(),
        Topology::Ha => PG_STANDBYS_DIR,
    };
    dir.join(pg).join(ARCHIVE_DIR_NAME)
}

fn up_cluster(dir: &Path, wal: WalArchiving) -> Result<StackEnv, StackError> {
    up_with_redis_cluster(dir, || {
        let pg = ensure_archiving(Kind::Postgres, &dir.join(Kind::Postgres.name()), wal)?;
        let nats = ensure_locked(Kind::Nats, &dir.join(Kind::Nats.name()))?;
        Ok((pg.url(), nats.url()))
    })
}

fn up_ha(dir: &Path, wal: WalArchiving) -> Result<StackEnv, StackError> {
    up_with_redis_cluster(dir, || {
        let mut nats = NatsCluster::up(&dir.join(NATS_CLUSTER_DIR))?;
        match PgStandbys::up_with(&dir.join(PG_STANDBYS_DIR), wal) {
            Ok(pg) => Ok((pg.url("postgres"), nats.url())),
            Err(e) => {
                nats.stop();
                Err(e)
            }
        }
    })
}

/// The Redis Cluster first (it has the most parts that can fail), then `others` (the
/// PostgreSQL and NATS URLs), under the stack's lock; `DIR/env` is written when all are up.
/// A part-way failure stops the cluster if this call started it (a reused cluster stays).
fn up_with_redis_cluster(
    dir: &Path,
    others: impl FnOnce() -> Result<(String, String), StackError>,
) -> Result<StackEnv, StackError> {
    fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    let lock = lock_dir(dir)?;
    let (cluster, started_now) = RedisCluster::ensure(&dir.join(REDIS_CLUSTER_DIR))?;
    let (pg_url, nats_url) = match others() {
        Ok(urls) => urls,
        Err(e) => {
            if started_now {
                cluster.stop();
            }
            return Err(e);
        }
    };
    let env = StackEnv { redis_url: cluster.url(), pg_url, nats_url };
    fs::write(dir.join("env"), env.render()).map_err(io_err("write env"))?;
    drop(lock);
    Ok(env)
}

/// The servers running under `dir`, whatever its topology: the single ones (`DIR/<kind>`)
/// and every node of the multi-node sets, each checked as [`Server::find_running`] does
/// (alive, our binary on its recorded port). Starts nothing; `flashsale demo` reads their
/// CPU times through the pids.
pub fn running_servers(dir: &Path) -> Vec<Server> {
    let mut servers: Vec<Server> =
        Kind::ALL.iter().filter_map(|k| Server::find_running(*k, &dir.join(k.name()))).collect();
    for (sets, kind) in [
        (REDIS_CLUSTER_DIR, Kind::Redis),
        (NATS_CLUSTER_DIR, Kind::Nats),
        (PG_STANDBYS_DIR, Kind::Postgres),
    ] {
        let Ok(entries) = fs::read_dir(dir.join(sets)) else { continue };
        let mut nodes: Vec<_> =
            entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
        nodes.sort();
        servers.extend(nodes.iter().filter_map(|node| Server::find_running(kind, node)));
    }
    servers
}

/// Stops every server recorded under `dir`; `purge` also deletes the data.
pub fn down(dir: &Path, purge: bool) -> Result<Vec<&'static str>, StackError> {
    let lock = lock_dir(dir)?;
    let mut stopped = Vec::new();
    for kind in Kind::ALL {
        let sub = dir.join(kind.name());
        let pid = fs::read_to_string(sub.join("pid")).ok().and_then(|p| p.trim().parse().ok());
        let port = fs::read_to_string(sub.join("port")).ok().and_then(|p| p.trim().parse().ok());
        if let (Some(pid), Some(port)) = (pid, port) {
            let server = Server { kind, port, pid, dir: sub };
            if process_matches(pid, kind, port) {
                server.stop()?;
                stopped.push(kind.name());
            }
        }
    }
    // Multi-node topologies (`stack up --topology ...`) keep their servers beside these.
    stopped.extend(down_nodes(dir)?);
    drop(lock);
    if purge {
        fs::remove_dir_all(dir).map_err(io_err(format!("remove {}", dir.display())))?;
    }
    Ok(stopped)
}

/// [`down`]'s second half: stops the multi-node servers recorded under `dir`.
fn down_nodes(dir: &Path) -> Result<Vec<&'static str>, StackError> {
    let mut stopped = redis_cluster::down(&dir.join(REDIS_CLUSTER_DIR))?;
    if !nats_cluster::down(&dir.join(NATS_CLUSTER_DIR))?.is_empty() {
        stopped.push("nats-cluster");
    }
    if !pg_standbys::down(&dir.join(PG_STANDBYS_DIR))?.is_empty() {
        stopped.push("pg-standbys");
    }
    Ok(stopped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_names_round_trip() {
        for t in Topology::ALL {
            assert_eq!(Topology::parse(t.name()), Ok(t));
        }
        assert!(Topology::parse("mesh").is_err());
    }
}
