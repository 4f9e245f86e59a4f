//! The sans-I/O decisions of the edge: what a request, a SKU, a mode or a dependency's health
//! means, decided with no sockets, no runtime and no clock (time is an argument). Nothing here
//! imports glommio, tokio or `flashsale_io`'s connections; the layers above (`durable`,
//! `shard`, `app`) do the I/O around these calls.

pub mod admission;
pub mod api;
pub mod auth;
pub mod circuit;
pub mod clock;
pub mod failover;
pub mod ids;
pub mod key;
pub mod limiter;
pub mod metrics;
pub mod modes;
pub mod outcome;
pub mod overload;
pub mod partition;
pub mod payment;
pub mod reconcile;
pub mod router;
pub mod submit;
