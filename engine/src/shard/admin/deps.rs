//! What the admin plane's handlers use (issue 22: a handler says what it touches): the
//! shared edge state (configuration, the durable side, modes, the reconcile lease, metrics),
//! this shard's Redis side, and its publish path (a stuck reservation republished).
//!
//! Not here: the routes (`mod.rs`).

use std::rc::Rc;

use crate::shard::publish::PublishPath;
use crate::shard::shared::EdgeShared;
use crate::shard::state::Shard;
use crate::shard::store::Store;

/// Bound on an admin call's wait for PostgreSQL: not a buyer's work, and a million tokens
/// take seconds to create, more than `pg_timeout_ms`.
pub const ADMIN_PG_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

pub struct AdminDeps<'a> {
    pub shared: &'a EdgeShared,
    pub store: &'a Store,
    pub publish: &'a Rc<PublishPath>,
}

impl<'a> AdminDeps<'a> {
    pub fn of(shard: &'a Shard) -> AdminDeps<'a> {
        AdminDeps { shared: &shard.shared, store: &shard.store, publish: &shard.publish }
    }
}
