//! What one shard owns, as services that each say what they are (issue 22): its Redis side
//! ([`Store`]), its owner state of the SKUs it owns, the mesh and its replicas ([`Mesh`]),
//! its limiters, its publish path to the log ([`PublishPath`]) and its copy of the mode
//! table. A handler takes the services it uses (each handler file's `...Deps`); a background
//! task of the shard takes the [`Shard`].
//!
//! Shards share nothing mutable; everything here lives on one executor (hence `Rc` and
//! `RefCell`, never held across an await).
//!
//! Not here: how the shard starts and which tasks it runs (`tasks.rs`).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use glommio::channels::channel_mesh::Senders;

use super::config::EdgeConfig;
use super::limiters::Limiters;
use super::mesh::{Mesh, MeshMsg};
use super::publish::PublishPath;
use super::shared::EdgeShared;
use super::store::Store;
use crate::durable::modes::ShardModes;
use crate::logic::ids::GeneratedRequestId;
use crate::logic::metrics::ShardMetrics;
use crate::logic::submit::OwnerState;

pub struct Shard {
    pub id: usize,
    pub shared: Arc<EdgeShared>,
    pub store: Rc<Store>,
    /// What this shard decides submissions with as owner (partitions, accepted budget, the
    /// Redis circuit, ids, in-flight): one borrow per decision, never held across an await.
    pub owner: Rc<RefCell<OwnerState>>,
    pub mesh: Rc<Mesh>,
    pub limiters: Limiters,
    pub publish: Rc<PublishPath>,
    /// This shard's copy of the mode table.
    pub modes: RefCell<ShardModes>,
    request_seq: Cell<u64>,
}

impl Shard {
    /// A shard's state before its tasks start.
    pub fn new(
        id: usize,
        shared: &Arc<EdgeShared>,
        store: Store,
        senders: Senders<MeshMsg>,
        id_seed: [u8; 32],
    ) -> Shard {
        let config = &shared.config;
        let store = Rc::new(store);
        let shard_count = shared.table.shard_count();
        Shard {
            id,
            shared: Arc::clone(shared),
            owner: Rc::new(RefCell::new(OwnerState::new(config.owner_limits(), id_seed))),
            mesh: Rc::new(Mesh::new(id, shard_count, senders, config.skus_tracked_max)),
            limiters: Limiters::new(config),
            publish: Rc::new(PublishPath::new(id, shared, &store)),
            modes: RefCell::new(ShardModes::new(&shared.modes)),
            store,
            request_seq: Cell::new(0),
        }
    }

    pub fn metrics(&self) -> &ShardMetrics {
        self.shared.shard_metrics(self.id)
    }

    pub fn config(&self) -> &EdgeConfig {
        &self.shared.config
    }

    /// A request id for responses whose request carried none (`x-request-id`).
    pub fn next_request_id(&self) -> GeneratedRequestId {
        let n = self.request_seq.get() + 1;
        self.request_seq.set(n);
        GeneratedRequestId::new(&self.shared.config.instance_id, self.id, n)
    }

    pub fn is_draining(&self) -> bool {
        self.shared.is_draining()
    }
}
