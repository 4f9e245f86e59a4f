//! One shard: a glommio executor pinned to a core, owning its listener, its connections, its
//! slice of SKU partitions, its pipelined Redis connections and its replicas of every SKU's
//! sold-out flag (DESIGN.md section 3). Shards share nothing mutable; they talk through a
//! bounded glommio channel mesh (`mesh.rs`).
//!
//! The folder stands in layers (no file imports one that imports it; `engine/tests/tidy.rs`):
//! - the services a shard owns, each knowing nothing of the shard: [`config`], [`shared`]
//!   (what every shard shares), [`store`] (Redis), [`mesh`] (shard to shard, replicas),
//!   [`limiters`], [`publish`] (THE path a message takes to the log), [`retry`], [`spans`]
//!   (the edge's trace spans, recorded into the sink the durable side exports);
//! - [`state`]: the [`Shard`] that holds them; [`request`] and [`reply`]: what every handler
//!   shares;
//! - the handlers, each taking only what it uses: [`submit`] and [`query`] (the reservation
//!   and query flows), [`orders`] (orders and payments), [`admin`] (the admin plane);
//! - the shard's background tasks: [`scanner`] (republish), [`sync`] (the owner's side of
//!   `redis-sync`), [`refresh`] (activity snapshots, stale sold-out re-reads), [`replays`]
//!   (the replay map after sell-out), [`reconcile`], [`failover`] (Redis failovers close
//!   their SKUs until a reconcile passes), [`dependency_poll`] (Redis' own health, shard 0);
//! - [`routes`] (the route table), [`conn`] (the connection loop), [`tasks`] (the executor's
//!   body: start, spawn, serve, stop).
//!
//! Not here: decisions that need no I/O (`logic`), the tokio side (`durable`, reached only
//! through its handle).

pub mod admin;
pub mod config;
pub mod conn;
pub mod dependency_poll;
pub mod failover;
pub mod limiters;
pub mod mesh;
pub mod orders;
pub mod publish;
pub mod query;
pub mod rebuild;
pub mod reconcile;
pub mod refresh;
pub mod replays;
pub mod reply;
pub mod request;
pub mod retry;
pub mod routes;
pub mod scanner;
pub mod shared;
pub mod spans;
pub mod state;
pub mod store;
pub mod submit;
pub mod sync;
pub mod tasks;

pub use config::EdgeConfig;
pub use shared::EdgeShared;
pub use state::Shard;
pub use tasks::{run, ShardStart};
