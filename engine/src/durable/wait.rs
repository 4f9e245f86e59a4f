//! Waits on the durable side that end early when the side is told to stop.
//!
//! Not here: the shards' timers (glommio, `shard/`).

use std::time::Duration;

/// Sleeps `wait` or until `stop` changes; true when the side should stop.
pub async fn pause(wait: Duration, stop: &mut tokio::sync::watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(wait) => *stop.borrow(),
        _ = stop.changed() => true,
    }
}
