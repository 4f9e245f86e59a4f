//! Redis access for the edge: [`connection`] is the pipelined, bounded, reconnecting client
//! (one per owner shard and node); [`script`] binds the `seckill` function library with one
//! enum per function mirroring its closed set of replies.

pub mod connection;
pub mod script;

pub use connection::{RedisClient, RedisConfig, RedisError};
