//! `flashsale stack up | down`: private redis-server, PostgreSQL and nats-server on loopback.
//!
//! Each server runs on a free 127.0.0.1 port with its data under one directory
//! (`DIR/redis`, `DIR/pg`, `DIR/nats`). `up` is idempotent: a server whose recorded pid is
//! alive, is the binary we started, and answers on its recorded port is reused. `down` stops
//! only processes whose pid file we wrote AND whose `/proc/PID/cmdline` still names our binary
//! and port, so a recycled pid or a server someone else runs is never touched.
//!
//! The integration tests start their servers through the same [`Server`] code (one private
//! instance per test for Redis and NATS, one private PostgreSQL cluster per suite), so test
//! and demo behave alike.
//!
//! This file only declares the parts and re-exports what callers use; no part imports it.
//! The shared pieces: `error` ([`StackError`]), `kind` (the three servers, finding their
//! binaries), `process` (pids read from `/proc`, signals), `pg_init` (`initdb`, the
//! `postgres` user, and the tools run as it), `pg_query` (a blocking simple-query client),
//! `server` (one server started, found, probed, stopped) and `dir` (`DIR/env`, `DIR/.lock`);
//! `wal_archive` (PostgreSQL's WAL archive: settings, `archive_command`, continuity survey).
//! The stacks: `standalone` (one server of each kind) and `topology` (`--topology`, and
//! `down` for all of them). Multi-node starters: `nats_cluster`
//! (three JetStream nodes), `pg_standbys` (a PostgreSQL primary with two streaming standbys),
//! `redis_cluster` (3 masters + 3 replicas); `balancer` puts HAProxy (TCP mode) in front of
//! several engine instances.
//!
//! Not here: configuration of the engine (see `config`), migrations (`flashsale_pg_worker`).

pub mod balancer;
mod dir;
mod error;
mod kind;
pub mod log_stats;
pub mod nats_cluster;
mod pg_init;
mod pg_query;
pub mod pg_standbys;
mod process;
mod redis_cluster;
pub mod redis_stats;
mod server;
mod standalone;
mod topology;
pub mod wal_archive;

pub use dir::StackEnv;
pub use error::StackError;
pub use kind::Kind;
pub use pg_init::{hand_to_postgres, postgres_tool};
pub use process::process_state;
pub(crate) use process::signal_process;
pub use redis_cluster::{call as redis_call, ClusterNode, RedisCluster, MASTER_COUNT, NODE_COUNT};
pub use server::{free_port, Server};
pub use standalone::{ensure, up, up_archiving};
pub use topology::{
    archive_dir, down, running_servers, up_with, up_with_archiving, Topology, NATS_CLUSTER_DIR,
    PG_STANDBYS_DIR, REDIS_CLUSTER_DIR,
};
pub use wal_archive::WalArchiving;
