//! The sans-I/O decisions of the edge: what a request, a SKU, a mode or a dependency's health
//! means, decided with no sockets, no runtime and no clock (time is an argument). Nothing here
//! imports glommio, tokio or `flashsale_io`'s connections; the layers above (`durable`,
//! `shard`, `app`) do the I/O around these calls.
//!
//! Two things the edge decides with are pure types of `flashsale_io`, imported from there
//! directly because the worker uses them too: THE prepared HMAC key (`flashsale_io::key`:
//! user passes, the control key, the payment key) and the payment provider's signature
//! scheme (`flashsale_io::payment`). `redis_settings` judges the plain record of Redis' own
//! settings that `flashsale_io::redis::settings` reads (the record, not the reader).

pub mod admission;
pub mod api;
pub mod auth;
pub mod circuit;
pub mod clock;
pub mod drain;
pub mod failover;
pub mod ids;
pub mod limiter;
pub mod metrics;
pub mod modes;
pub mod outcome;
pub mod overload;
pub mod partition;
pub mod placement;
pub mod rebuild;
pub mod reconcile;
pub mod redis_settings;
pub mod sku_funnel;
pub mod submit;
