//! The one place that reads the wall clock for business timestamps. The decisions in this
//! folder never call it: they take `now_ms` as an argument, so tests drive time. The I/O
//! layers (`durable`, `shard`, `app`) call [`now_ms`] and pass the value down.

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
