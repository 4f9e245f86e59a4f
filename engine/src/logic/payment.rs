//! The payment provider's signature scheme (CONTRACT.md 3.4): `signature` = lowercase hex
//! HMAC-SHA256(`FLASHSALE_PAYMENT_KEY`, `"v1|" payment_id "|" order_id "|" status "|"
//! amount_cents`). Defined in `flashsale_io::payment` (pure: no I/O) because the worker's
//! closer signs its status requests to the provider, and checks the answers, in the same
//! scheme; re-exported here for the callback route (`shard::orders`). Read `io/src/payment.rs`.

pub use flashsale_io::payment::{Signed, StatusAnswer, StatusRequest};
