//! Redis access for the edge: [`connection`] is the pipelined, bounded, reconnecting client
//! (one per owner shard and node) and [`fence`] its replica-fencing setting; [`slot`] is Redis
//! Cluster addressing (key slots, the slot map, redirects), sans-I/O; [`cluster`] routes
//! commands over one pipelined connection per master (plus a fencing lane), following
//! `MOVED`/`ASK`/`TRYAGAIN`; [`router`] hides whether the server is one node or a cluster;
//! [`url`] parses `FLASHSALE_REDIS_URL`; [`script`] binds the `seckill` function library with
//! one enum per function mirroring its closed set of replies; [`reads`] holds every other
//! command the engine needs (typed reads of meta, stock, requests, the active-SKU set,
//! reconcile's reads); [`layout`] the plain data those return; [`settings`] the server's own
//! eviction and persistence settings, read from every master at start; [`info`] its memory,
//! evictions and replication lag for the dependency metrics.
//! No file outside this folder spells a Redis command or a key.
pub mod cluster;
pub mod connection;
pub mod fence;
pub mod info;
pub mod layout;
pub mod reads;
pub mod router;
pub mod script;
pub mod settings;
pub mod slot;
pub mod url;

pub use connection::{RedisClient, RedisConfig, RedisError};
