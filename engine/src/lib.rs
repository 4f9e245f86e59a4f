//! flashsale-engine: the edge (glommio shards, HTTP, partitions, admission — arriving with
//! the edge issue) and the operational commands of the `flashsale` binary.
//!
//! - [`config`]: TOML < env < flags, validated once in `main`.
//! - [`stack`]: `flashsale stack up | down`, the private servers also used by the tests.
//!
//! Read `ARCHITECTURE.md` at the repository root for the map of the whole workspace.

pub mod admin_cli;
pub mod admission;
pub mod api;
pub mod auth;
pub mod circuit;
pub mod config;
pub mod control;
pub mod durable;
pub mod http;
pub mod ids;
pub mod limiter;
pub mod metrics;
pub mod modes;
pub mod outcome;
pub mod partition;
pub mod reconcile;
pub mod router;
pub mod scanner;
pub mod serve;
pub mod shard;
pub mod stack;
pub mod startup;
pub mod sync;
