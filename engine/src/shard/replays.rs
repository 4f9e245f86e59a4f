//! After sell-out, the replay map is completed from Redis (`logic/partition.rs` says why):
//! the owner shard lists the SKU's request records — a `SCAN` of its keys for the `req:`
//! records — reads the replay fields of those its map does not hold yet (the other
//! instances' acceptances; none with one instance), `LOAD_BATCH` at a time pipelined on the
//! shard's connection, and hands them to the partition, which merges them and, once complete,
//! lets every shard answer unknown request ids `SOLD_OUT` locally again. Until then those go
//! to Redis. A failed load is retried by the stock re-check loop (`refresh.rs`) while the SKU
//! stays sold out.
//!
//! Cost: one load per sell-out per instance, O(records of the SKU) reads, bounded by the
//! partition's `accepted_max` (a SKU with more records than that never completes and keeps
//! sending unknown ids to Redis: slower, still correct).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use flashsale_io::redis::script::{RequestState, ScriptError, SkuKeys};

use super::mesh::Mesh;
use super::store::Store;
use crate::logic::partition::{Accepted, AcceptedState};
use crate::logic::placement::SkuKey;
use crate::logic::submit::OwnerState;

/// Records read at once (pipelined on the owner's Redis connection, far below its in-flight
/// bound so buyers keep their share).
const LOAD_BATCH: usize = 128;
/// `SCAN ... COUNT` hint: few round trips while every sold-out request of the SKU waits on
/// Redis, each call a few milliseconds of Redis time (~20 ms on this box). Measured against
/// 256 (each call under a millisecond, issue 25): the load then took ~0.75 s instead of
/// ~0.1 s, and the sold-out requests sent to Redis meanwhile cost ~9 commands more per sold
/// unit than the long calls stall.
const SCAN_COUNT: u32 = 5_000;

/// Starts the load of `key`'s request records when one is due (sold out, map incomplete, no
/// load running).
pub fn ensure_loaded(
    owner: &Rc<RefCell<OwnerState>>,
    store: &Rc<Store>,
    mesh: &Rc<Mesh>,
    key: SkuKey,
) {
    if !owner.borrow_mut().replay_load_due(key) {
        return;
    }
    let (owner, store, mesh) = (Rc::clone(owner), Rc::clone(store), Rc::clone(mesh));
    glommio::spawn_local(async move {
        let started = std::time::Instant::now();
        let keys = store.sku_keys(key);
        let loaded = match load(&owner, &store, key, &keys).await {
            Ok(loaded) => Some(loaded),
            Err(e) => {
                tracing::warn!(activity_id = key.activity_id, sku_id = key.sku_id, error = %e,
                    "replays after sell-out not loaded; unknown request ids go to Redis");
                None
            }
        };
        let count = loaded.as_ref().map_or(0, Vec::len);
        let update = owner.borrow_mut().on_replays_loaded(key, loaded);
        if let Some(update) = update {
            tracing::info!(
                activity_id = key.activity_id,
                sku_id = key.sku_id,
                count,
                took_ms = started.elapsed().as_millis() as u64,
                "replays after sell-out loaded (count: other instances' acceptances)"
            );
            mesh.broadcast(update);
        }
    })
    .detach();
}

/// Every request record of the SKU as (buyer, accepted entry).
async fn load(
    owner: &RefCell<OwnerState>,
    store: &Store,
    key: SkuKey,
    keys: &SkuKeys,
) -> Result<Vec<(u64, Accepted)>, ScriptError> {
    let mut names = Vec::new();
    let mut cursor = 0u64;
    loop {
        let page = store.functions.scan_sku_keys(keys, cursor, SCAN_COUNT).await?;
        names.extend(page.request_records);
        cursor = page.next_cursor;
        if cursor == 0 {
            break;
        }
    }
    // `req:` suffixes are `{user_id}:{request_id}` (request ids are scoped per buyer); the
    // ones this instance accepted itself are in its map already.
    let requests: Vec<(u64, String)> = {
        let owner = owner.borrow();
        names
            .iter()
            .filter_map(|n| n.split_once(':'))
            .filter_map(|(user, request)| Some((user.parse().ok()?, request)))
            .filter(|(user, request)| !owner.knows_request(key, *user, request))
            .map(|(user, request)| (user, request.to_owned()))
            .collect()
    };
    let mut out = Vec::with_capacity(requests.len());
    for batch in requests.chunks(LOAD_BATCH) {
        let reads = batch.iter().map(|(user, request)| async move {
            let record = store.functions.read_replay(keys, *user, request).await?;
            Ok::<_, ScriptError>(record.map(|r| (*user, accepted(request, r))))
        });
        for read in futures::future::join_all(reads).await {
            out.extend(read?);
        }
    }
    Ok(out)
}

fn accepted(request_id: &str, r: flashsale_io::redis::layout::ReplayRecord) -> Accepted {
    Accepted {
        request_id: Arc::from(request_id),
        reservation_id: Arc::from(r.reservation_id.as_str()),
        message_id: Arc::from(r.message_id.as_str()),
        payload_hash: Arc::from(r.payload_hash.as_str()),
        state: first_answer_of(&r.state),
    }
}

/// [`first_answer`] of a record's state as stored (an unknown one reads as `QUEUED`).
pub fn first_answer_of(state: &str) -> AcceptedState {
    RequestState::parse(state).map_or(AcceptedState::Queued, first_answer)
}

/// The first answer a request got, from its state in Redis now: `QUEUED_PENDING` stays, any
/// later state means the first answer was `QUEUED` (replays of `IDEMPOTENT` in the submit
/// flow, and the records loaded here).
pub fn first_answer(state: RequestState) -> AcceptedState {
    match state {
        RequestState::QueuedPending => AcceptedState::QueuedPending,
        _ => AcceptedState::Queued,
    }
}
