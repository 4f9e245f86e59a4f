//! flashsale-io: everything that crosses a socket to a store or the log, below the engine.
//!
//! - [`resp`]: the RESP2 codec, runtime-agnostic (bytes in, frames out); hot `FCALL` frames are
//!   encoded by hand into reused buffers.
//! - [`redis`]: the pipelined Redis connection for glommio and [`redis::script`], the binding
//!   of the `seckill` Redis Functions library in `lua/`.
//! - [`jetstream`]: the JetStream client of the replicated log (streams, consumers, publishing
//!   with `Nats-Msg-Id`, dead letters, lag).
//! - [`wire`]: the order-create message and outbox event schemas.
//! - [`bounds`]: the one set of bounds for every id and number a buyer or an operator sends.
//! - [`key`] and [`payment`]: the one prepared HMAC key type and the payment provider's
//!   signature scheme (callbacks, status requests and answers); pure, shared by the engine and
//!   the worker.
//! - [`trace`]: trace export over OTLP (spans recorded after the fact into a bounded sink, a
//!   tokio exporter that fails open).
//!
//! This crate decides nothing about business outcomes; it reports what the stores said, and
//! says "outcome unknown" when it cannot know.

pub mod bounds;
pub mod jetstream;
pub mod key;
pub mod payment;
pub mod redis;
pub mod resp;
pub mod trace;
pub mod wire;

/// The negative controls' switches (tests/tests/negative_controls.rs): failpoints that each
/// disable one protection, so a drill can show it sees the loss that protection prevents.
/// Compiled only with the test-only `failpoints` feature.
#[cfg(feature = "failpoints")]
pub(crate) mod negctl {
    /// True while the failpoint `name` is configured (any action but `off`).
    pub fn switched_off(name: &str) -> bool {
        fail::fail_point!(name, |_| true);
        false
    }
}
