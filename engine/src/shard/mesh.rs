//! Shard to shard (DESIGN.md sections 3 and 3.1): the bounded glommio channel mesh that
//! carries submits to their owner shard and the owners' replica updates to every shard, and
//! this shard's replicas of each SKU's sold-out flag and accepted requests. The owner is the
//! only writer of its SKUs' replicas; a full queue hands the item back (submits) or drops it
//! (replica updates: they only save work).
//!
//! Not here: what a replica decides (`logic::partition`), the owner's flow (`submit.rs`).

use std::cell::RefCell;
use std::collections::HashMap;

use futures::channel::oneshot;
use glommio::channels::channel_mesh::Senders;

use crate::logic::api::PayloadHash;
use crate::logic::partition::{ReplicaUpdate, SkuReplica};
use crate::logic::placement::SkuKey;
use crate::logic::submit::SubmitAnswer;

/// Messages between shards. Everything in them is `Send`.
pub enum MeshMsg {
    Submit(Box<ForwardedSubmit>),
    Replica(ReplicaUpdate),
}

/// A submit on its way to the owner shard: owned, `Send`.
pub struct ForwardedSubmit {
    pub key: SkuKey,
    pub request_id: Box<str>,
    pub user_id: u64,
    pub quantity: u32,
    pub payload_hash: PayloadHash,
    pub traceparent: Option<Box<str>>,
    pub reply: oneshot::Sender<SubmitAnswer>,
}

pub struct Mesh {
    id: usize,
    shard_count: usize,
    senders: Senders<MeshMsg>,
    replicas: RefCell<HashMap<SkuKey, SkuReplica>>,
    skus_tracked_max: usize,
}

impl Mesh {
    pub fn new(
        id: usize,
        shard_count: usize,
        senders: Senders<MeshMsg>,
        skus_tracked_max: usize,
    ) -> Mesh {
        Mesh { id, shard_count, senders, replicas: RefCell::new(HashMap::new()), skus_tracked_max }
    }

    /// The replica's local answer for a SKU owned elsewhere (or here).
    pub fn with_replica<T>(&self, key: SkuKey, f: impl FnOnce(Option<&SkuReplica>) -> T) -> T {
        f(self.replicas.borrow().get(&key))
    }

    /// Applies an owner's update locally and sends it to every other shard. A full mesh
    /// queue drops the update for that shard: replicas only save work, and the next flip
    /// (or the owner answering forwarded requests) corrects it.
    pub fn broadcast(&self, update: ReplicaUpdate) {
        self.apply_replica(&update);
        for peer in 0..self.shard_count {
            if peer != self.id {
                let _ = self.senders.try_send_to(peer, MeshMsg::Replica(update.clone()));
            }
        }
    }

    /// An owner's update, received from the mesh (or made here).
    pub fn apply_replica(&self, update: &ReplicaUpdate) {
        let mut replicas = self.replicas.borrow_mut();
        if replicas.contains_key(&update.key) || replicas.len() < self.skus_tracked_max {
            replicas.entry(update.key).or_default().apply(update);
        }
    }

    /// Forwards a submit to its owner; a full queue hands it back.
    pub fn forward(
        &self,
        owner: usize,
        forwarded: Box<ForwardedSubmit>,
    ) -> Result<(), Box<ForwardedSubmit>> {
        match self.senders.try_send_to(owner, MeshMsg::Submit(forwarded)) {
            Ok(()) => Ok(()),
            Err(glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(
                MeshMsg::Submit(f),
            )))
            | Err(glommio::GlommioError::Closed(glommio::ResourceType::Channel(
                MeshMsg::Submit(f),
            ))) => Err(f),
            Err(_) => {
                // Other errors (invalid peer) cannot carry the message back; the caller
                // answers from what it knows.
                unreachable_forward()
            }
        }
    }
}

#[cold]
fn unreachable_forward() -> Result<(), Box<ForwardedSubmit>> {
    // try_send_to only fails with WouldBlock/Closed for a valid peer index, and the owner
    // index comes from the partition table built for this shard count.
    panic!("mesh send to an invalid peer: partition table and shard count disagree")
}
