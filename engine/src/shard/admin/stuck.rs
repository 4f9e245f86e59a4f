//! Stuck reservations, for an operator (CONTRACT.md section 4; `flashsale admin stuck`): a
//! SKU's `resv:stuck` listed with each record, and one entry resolved.
//!
//! A reservation is stuck when the scanner found it past the recovery deadline with no
//! outcome (`lua/seckill.lua`, `claim_due`): its unit and its buyer are held until something
//! decides it. An operator decides it one of two ways:
//!
//! - **republish**: its order-create message goes to the log once more, through the one
//!   publish path (`publish.rs`), under a fresh per-attempt `Nats-Msg-Id` (past the duplicate
//!   window the log could not deduplicate it anyway; the PostgreSQL inbox, keyed by the body's
//!   message id, does). The order-writer decides as for any message; its outcome reaches Redis
//!   through redis-sync and takes the entry out of `resv:stuck`. Always allowed.
//! - **compensate**: the order-writer's verdict is written now, on the durable side, without
//!   the log (`flashsale_pg_worker::settle_expired`, which states why no copy of the message
//!   still in flight can create a second outcome). Allowed only once the reservation has
//!   expired: before that the writer could still create its order, so only a republish may
//!   resolve it. If the message reached the writer first, its recorded outcome stands and is
//!   announced again. Either way redis-sync applies the outcome (returning the unit once,
//!   guarded by the compensation marker), which takes the entry out of `resv:stuck`.
//!
//! Both answer once PostgreSQL or the log has the decision; Redis follows within a
//! redis-sync round. Resolving an entry twice, or while its message is in flight, creates
//! nothing twice (`tests/tests/stuck_dlq.rs`).
//!
//! Runs on shard 0 (the admin plane) with shard 0's Redis connections: every write it causes
//! in Redis is one atomic function call (`mark_sent`, then redis-sync's), which needs no
//! owner-shard state.

use std::rc::Rc;

use flashsale_io::redis::layout::StuckEntry;
use flashsale_pg_worker::{settle_expired, Recorded, Settled};
use serde::Deserialize;
use serde_json::json;
use tracing::Instrument as _;

use super::deps::AdminDeps;
use crate::http::Status;
use crate::logic::clock::now_ms;
use crate::logic::placement::SkuKey;
use crate::logic::submit::Published;
use crate::shard::publish::{publish_order, MsgIdentity, Origin};
use crate::shard::reply::error;
use crate::shard::scanner::message_of;

/// Entries one list answer holds (oldest first); `count` says how many there are.
pub const LISTED_MAX: usize = 100;

/// `GET /admin/v1/activities/{a}/skus/{s}/stuck`
pub async fn list(deps: &AdminDeps<'_>, key: SkuKey) -> (Status, String) {
    let keys = deps.store.sku_keys(key);
    let (counters, entries) = match futures::try_join!(
        deps.store.functions.counters(&keys),
        deps.store.functions.stuck_entries(&keys, LISTED_MAX)
    ) {
        Ok(read) => read,
        Err(e) => {
            tracing::warn!(error = %e, activity_id = key.activity_id, sku_id = key.sku_id, "listing stuck reservations failed");
            return error(Status::ServiceUnavailable, "REDIS_UNAVAILABLE");
        }
    };
    let now = now_ms();
    let items: Vec<_> = entries.iter().map(|e| describe(e, now)).collect();
    let body = json!({
        "activity_id": key.activity_id,
        "sku_id": key.sku_id,
        "count": counters.stuck,
        "listed": items.len(),
        "stuck": items,
    });
    (Status::Ok, body.to_string())
}

fn describe(e: &StuckEntry, now: u64) -> serde_json::Value {
    let mut item = json!({
        "reservation_id": e.reservation_id,
        "stuck_at_ms": e.stuck_at_ms,
        "status": e.status,
        "last_error_code": e.last_error_code,
        "republishable": e.entry.is_some(),
        "compensable": e.entry.as_ref().is_some_and(|p| p.expires_at_ms <= now),
    });
    if let Some(p) = &e.entry {
        item["message_id"] = json!(p.message_id);
        item["request_id"] = json!(p.request_id);
        item["user_id"] = json!(p.user_id);
        item["reserved_at_ms"] = json!(p.reserved_at_ms);
        item["expires_at_ms"] = json!(p.expires_at_ms);
        item["send_attempts"] = json!(p.send_attempts);
    }
    item
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    action: Action,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Action {
    Republish,
    Compensate,
}

/// `POST /admin/v1/activities/{a}/skus/{s}/stuck/{reservation_id}` with
/// `{"action":"republish"|"compensate"}`.
pub async fn resolve(
    deps: &AdminDeps<'_>,
    key: SkuKey,
    reservation_id: &str,
    body: &[u8],
) -> (Status, String) {
    let Ok(ResolveBody { action }) = serde_json::from_slice::<ResolveBody>(body) else {
        return error(Status::BadRequest, "ACTION_INVALID");
    };
    let keys = deps.store.sku_keys(key);
    let stuck = match deps.store.functions.stuck_entry(&keys, reservation_id).await {
        Ok(Some(stuck)) => stuck,
        Ok(None) => return error(Status::NotFound, "NOT_STUCK"),
        Err(flashsale_io::redis::script::ScriptError::InvalidArgument(_)) => {
            return error(Status::BadRequest, "RESERVATION_ID_INVALID")
        }
        Err(e) => {
            tracing::warn!(error = %e, reservation_id, "reading a stuck reservation failed");
            return error(Status::ServiceUnavailable, "REDIS_UNAVAILABLE");
        }
    };
    // A record that cannot rebuild its message (`INVALID_RECORD`, or its hash gone) is for
    // reconcile's report and a human: neither action can be proven safe for it.
    let Some(mut entry) = stuck.entry else {
        return error(Status::Conflict, "RECORD_INCOMPLETE");
    };
    // A fresh attempt number: never the scanner's last `Nats-Msg-Id`, and the same one for a
    // second resolve of the same entry (the log drops the copy inside its window).
    entry.send_attempts = entry.send_attempts.saturating_add(1);
    let span = tracing::info_span!("stuck_resolve", reservation_id, activity_id = key.activity_id,
        sku_id = key.sku_id, action = ?action);
    apply(deps, key, &keys, entry, action).instrument(span).await
}

async fn apply(
    deps: &AdminDeps<'_>,
    key: SkuKey,
    keys: &Rc<flashsale_io::redis::script::SkuKeys>,
    entry: flashsale_io::redis::layout::PendingEntry,
    action: Action,
) -> (Status, String) {
    let message = message_of(key, &entry);
    match action {
        Action::Republish => {
            match publish_order(deps.publish, keys, message, MsgIdentity::Attempt, Origin::Scanner)
                .await
            {
                Published::Acked => {
                    tracing::info!("stuck reservation republished by an operator");
                    (Status::Accepted, json!({"resolution": "REPUBLISHED"}).to_string())
                }
                Published::NotAcked => error(Status::ServiceUnavailable, "LOG_UNAVAILABLE"),
            }
        }
        Action::Compensate => {
            let now = now_ms();
            if entry.expires_at_ms > now {
                return error(Status::Conflict, "NOT_EXPIRED");
            }
            let settled = deps
                .shared
                .durable
                .pg(move |client| async move {
                    let settled = settle_expired(&client, &message, now).await;
                    if settled.is_err() {
                        // Possibly mid-transaction: never back into the pool.
                        let _ = deadpool_postgres::Object::take(client);
                    }
                    settled
                })
                .await;
            match settled {
                Ok(Settled::RejectedNow) => {
                    tracing::info!("stuck reservation compensated by an operator");
                    (Status::Accepted, json!({"resolution": "COMPENSATED"}).to_string())
                }
                Ok(Settled::AlreadyRecorded(recorded)) => {
                    let recorded = match recorded {
                        Recorded::Created { order_id } => {
                            json!({"outcome": "ORDER_CREATED", "order_id": order_id})
                        }
                        Recorded::Rejected(reason) => {
                            json!({"outcome": "FAILED", "reason_code": reason.reason_code()})
                        }
                        Recorded::Unresolved => json!({"outcome": "UNRESOLVED"}),
                    };
                    tracing::info!(?recorded, "stuck reservation had reached the order-writer");
                    let body = json!({"resolution": "ALREADY_RECORDED", "recorded": recorded});
                    (Status::Accepted, body.to_string())
                }
                Err(e) => {
                    tracing::warn!(error = %e, "compensating a stuck reservation failed");
                    error(Status::ServiceUnavailable, "PG_UNAVAILABLE")
                }
            }
        }
    }
}
