//! Telling a Redis failover from ordinary topology changes, per SKU (DESIGN.md section 11),
//! sans-I/O. Redis replication is asynchronous: a promoted replica (or a master restarted
//! without its data) may have lost acknowledged writes, so the SKUs it serves must stop taking
//! reservations until a reconcile against PostgreSQL passes.
//!
//! Each observation of a SKU is the node serving its slot and that node's `run_id`. A SKU
//! failed over when, compared with its previous observation:
//! - the same node answers with another `run_id` (it restarted: whatever it held in memory
//!   may be gone), or
//! - another node serves it and the previous one is no master any more (its replica was
//!   promoted). A slot that moved while its old master stays a master is resharding (the
//!   keys migrated with `MIGRATE`), not a failover.
//!
//! An observation without a `run_id` (the node did not answer) changes nothing: the circuit
//! handles an unreachable node, and the next answer is compared with the last good one.
//!
//! Read next: `shard/failover.rs` (the polling and the recovery), `partition.rs` (the flag).

use std::collections::HashMap;
use std::net::SocketAddr;

use crate::logic::placement::SkuKey;

/// Who served a SKU when last seen.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    node: SocketAddr,
    run_id: String,
}

/// The last observation of each SKU, bounded by `skus_max` (SKUs beyond it are not watched;
/// their reconcile still reports any loss).
#[derive(Debug)]
pub struct FailoverWatch {
    seen: HashMap<SkuKey, Seen>,
    skus_max: usize,
}

impl FailoverWatch {
    pub fn new(skus_max: usize) -> FailoverWatch {
        FailoverWatch { seen: HashMap::new(), skus_max }
    }

    /// Records what serves `key` now; true when that is a failover (module documentation).
    /// `masters`: every node that serves a slot in the current map.
    pub fn observe(
        &mut self,
        key: SkuKey,
        node: SocketAddr,
        run_id: Option<&str>,
        masters: &[SocketAddr],
    ) -> bool {
        let Some(run_id) = run_id.filter(|r| !r.is_empty()) else { return false };
        let now = Seen { node, run_id: run_id.to_owned() };
        let failed_over = match self.seen.get(&key) {
            None => false,
            Some(before) if before.node == node => before.run_id != now.run_id,
            Some(before) => !masters.contains(&before.node),
        };
        if self.seen.contains_key(&key) || self.seen.len() < self.skus_max {
            self.seen.insert(key, now);
        }
        failed_over
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    const KEY: SkuKey = SkuKey { activity_id: 1, sku_id: 2 };

    #[test]
    fn a_promoted_replica_and_a_restart_are_failovers_resharding_is_not() {
        let (a, b, c) = (addr(7000), addr(7001), addr(7002));
        let mut w = FailoverWatch::new(8);
        assert!(!w.observe(KEY, a, Some("run-a"), &[a, c]), "a first look is no change");
        assert!(!w.observe(KEY, a, Some("run-a"), &[a, c]));
        // The slot moved to c while a stays a master: resharding.
        assert!(!w.observe(KEY, c, Some("run-c"), &[a, c]));
        // c's replica b took over and c is gone from the masters: failover.
        assert!(w.observe(KEY, b, Some("run-b"), &[a, b]));
        // b restarted (another run id): failover again.
        assert!(w.observe(KEY, b, Some("run-b2"), &[a, b]));
        // No answer: nothing learned, nothing changed.
        assert!(!w.observe(KEY, b, None, &[a, b]));
        assert!(!w.observe(KEY, b, Some("run-b2"), &[a, b]));
    }

    #[test]
    fn the_watch_is_bounded() {
        let mut w = FailoverWatch::new(1);
        let other = SkuKey { activity_id: 9, sku_id: 9 };
        w.observe(KEY, addr(1), Some("r"), &[addr(1)]);
        w.observe(other, addr(1), Some("r"), &[addr(1)]);
        // The second SKU was not recorded, so its change cannot be seen.
        assert!(!w.observe(other, addr(1), Some("r2"), &[addr(1)]));
        assert!(w.observe(KEY, addr(1), Some("r2"), &[addr(1)]));
    }
}
