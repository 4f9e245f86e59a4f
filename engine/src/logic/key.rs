//! THE prepared HMAC-SHA256 key (user pass keys, the control key, the payment key): one type,
//! defined in `flashsale_io::key` because the worker's closer signs with the payment key too
//! (a pure type: no I/O comes with it). Read `io/src/key.rs`.

pub use flashsale_io::key::{HmacKey, HmacSha256, KeyError, KEY_LEN_MAX, KEY_LEN_MIN};
