//! The shard's Redis side: the `seckill` function binding over this shard's own router
//! (standalone or cluster, pipelined connections per master) and the key names of each SKU,
//! built once. Every Redis call a shard makes goes through [`Store::functions`]. Shard 0 also
//! checks Redis' own settings at start ([`Store::check_settings`]).
//!
//! Not here: what a call means (`logic`), the layout of keys and replies (`io::redis`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use flashsale_io::redis::script::{Functions, SkuKeys};

use super::config::EdgeConfig;
use super::shared::EdgeShared;
use crate::logic::placement::SkuKey;

/// Longest a shard tries to reach Redis at start (a dependency, like the log and PostgreSQL,
/// that must answer once before the engine serves).
const REDIS_START_WAIT_MS: u64 = 5_000;

pub struct Store {
    pub functions: Functions,
    keys: RefCell<HashMap<SkuKey, Rc<SkuKeys>>>,
    skus_tracked_max: usize,
}

impl Store {
    pub fn new(functions: Functions, skus_tracked_max: usize) -> Store {
        Store { functions, keys: RefCell::new(HashMap::new()), skus_tracked_max }
    }

    /// The Redis key names of a SKU, built once per shard (beyond `skus_tracked_max` SKUs
    /// they are built per call).
    pub fn sku_keys(&self, key: SkuKey) -> Rc<SkuKeys> {
        let mut keys = self.keys.borrow_mut();
        if let Some(k) = keys.get(&key) {
            return Rc::clone(k);
        }
        let k = Rc::new(SkuKeys::new(key.activity_id, key.sku_id));
        if keys.len() < self.skus_tracked_max {
            keys.insert(key, Rc::clone(&k));
        }
        k
    }

    /// Shard `id`'s router (decided by asking a seed) with the function library loaded on
    /// every master; `None` when no seed answered in time.
    pub async fn connect(id: usize, config: &EdgeConfig) -> Option<Store> {
        use flashsale_io::redis::router::{Router, RouterConfig};
        let router_config = RouterConfig {
            min_replica_acks: config.min_replica_acks,
            ..RouterConfig::new(config.redis_seeds.clone(), config.redis.clone())
        };
        let deadline = std::time::Instant::now() + Duration::from_millis(REDIS_START_WAIT_MS);
        let router = loop {
            match Router::connect(router_config.clone()).await {
                Ok(router) => break router,
                Err(e) if std::time::Instant::now() < deadline => {
                    tracing::debug!(shard = id, error = %e, "redis not reachable yet");
                    glommio::timer::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    tracing::error!(shard = id, error = %e, seeds = ?config.redis_seeds, "redis not reachable at start");
                    return None;
                }
            }
        };
        if let (0, Some(warning)) = (id, router.fence_warning()) {
            tracing::warn!("{warning}");
        }
        let functions = Functions::over(router);
        // "Function not found" reloads the library on the node that says so; loading it here
        // only saves the first calls that round trip.
        if let Err(e) = functions.load_everywhere().await {
            tracing::warn!(shard = id, error = %e, "redis: loading the function library failed");
        }
        Some(Store::new(functions, config.skus_tracked_max))
    }

    /// Shard 0 at start: every master's eviction and persistence settings, judged by
    /// `logic::redis_settings` and kept for `/readyz` and the metrics. `false`: the start is
    /// refused (logged, and the reason left in `start_error` for `serve::start` to return).
    pub async fn check_settings(&self, shared: &EdgeShared) -> bool {
        use crate::logic::redis_settings::{judge, RedisFacts, Verdict};
        let nodes = flashsale_io::redis::settings::read_settings(self.functions.router()).await;
        let facts = RedisFacts { check: shared.config.redis_eviction, nodes };
        match judge(&facts) {
            Verdict::Refuse(why) => {
                tracing::error!("{why}");
                let _ = shared.start_error.set(why);
                false
            }
            Verdict::Start { warnings } => {
                for warning in &warnings {
                    tracing::warn!("{warning}");
                }
                for n in &facts.nodes {
                    tracing::info!(
                        node = %n.node,
                        maxmemory_policy = n.maxmemory_policy.as_deref().unwrap_or("unknown"),
                        appendonly = n.appendonly.as_deref().unwrap_or("unknown"),
                        appendfsync = n.appendfsync.as_deref().unwrap_or("unknown"),
                        save = n.save.as_deref().unwrap_or("unknown"),
                        "redis settings"
                    );
                }
                let _ = shared.redis_facts.set(facts);
                true
            }
        }
    }
}
