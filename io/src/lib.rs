//! flashsale-io: everything that crosses a socket to a store or the log, below the engine.
//!
//! - [`resp`]: the RESP2 codec, runtime-agnostic (bytes in, frames out); hot `FCALL` frames are
//!   encoded by hand into reused buffers.
//! - [`redis`]: the pipelined Redis connection for glommio and [`redis::script`], the binding
//!   of the `seckill` Redis Functions library in `lua/`.
//! - [`log`]: the JetStream side (streams, consumers, publishing with `Nats-Msg-Id`).
//! - [`wire`]: the order-create message and outbox event schemas.
//!
//! This crate decides nothing about business outcomes; it reports what the stores said, and
//! says "outcome unknown" when it cannot know.

pub mod log;
pub mod redis;
pub mod resp;
pub mod wire;
