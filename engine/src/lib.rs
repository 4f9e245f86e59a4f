//! flashsale-engine: the edge (glommio shards, HTTP, partitions, admission) and the
//! operational commands of the `flashsale` binary. Four layers, each a folder, each importing
//! only the ones below it:
//!
//! - [`logic`], [`http`]: sans-I/O decisions and the HTTP/1.1 codec;
//! - [`durable`]: the tokio side (log publisher, the edge's PostgreSQL jobs, `redis-sync`'s
//!   consumer, the mode-bucket watcher and the health poller);
//! - [`shard`]: one glommio executor per core and every task that runs on it;
//! - [`app`]: configuration, `serve`, start-up checks, the admin CLI, the private stack.
//!
//! `tests/tidy.rs` keeps it so. Read `ARCHITECTURE.md` at the repository root for the map of
//! the whole workspace.

pub mod app;
pub mod durable;
pub mod http;
pub mod logic;
pub mod shard;
