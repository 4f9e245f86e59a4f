//! Redis' own health for the dependency metrics (`durable/dependencies.rs`): shard 0 asks every
//! master for `INFO memory stats replication` (`io::redis::info`) every
//! `DEPENDENCY_POLL_MS`, over the connections it already has (a plain-lane command beside its
//! pipelined calls: one small reply each few seconds, off every request's path).
//!
//! Not here: the figures' rendering (`durable/dependencies.rs`), a decision on them (alerts).

use std::rc::Rc;
use std::time::Duration;

use super::state::Shard;
use crate::durable::dependencies::DEPENDENCY_POLL_MS;

/// Samples the Redis masters until the shard stops (shard 0 only).
pub fn spawn(shard: &Rc<Shard>) {
    if shard.id != 0 {
        return;
    }
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        while !shard.shared.is_stopping() {
            let nodes = flashsale_io::redis::info::read_info(shard.store.functions.router()).await;
            shard.shared.health.deps.set_redis(nodes);
            glommio::timer::sleep(Duration::from_millis(DEPENDENCY_POLL_MS)).await;
        }
    })
    .detach();
}
