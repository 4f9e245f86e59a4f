//! Leases among the engine instances on one set of stores (DESIGN.md section 11): a job that
//! must run on one instance at a time (the periodic reconcile) runs where the lease is held.
//!
//! The lease is a key of the JetStream KV bucket [`flashsale_io::jetstream::LEASES_BUCKET`], whose
//! messages expire after the lease period (`max_age`, counted by the NATS server: no
//! instance's clock decides). An instance takes it with `create` (succeeds only when the key
//! holds nothing: never taken, or expired), renews it every period / 3 with
//! `update(key, id, revision)` (fails when someone else holds a newer entry), and loses it
//! when a renewal fails. A graceful stop releases it (an empty value written at the held
//! revision; the next instance's attempt takes an empty entry by revision), so a restart or
//! a rolling deploy hands the job over at once; a holder that dies or hangs is outlived by
//! the expiry. Locally the lease counts as held until the start of the last
//! successful write plus the period, which is never later than the server's expiry of that
//! write: two instances never both believe they hold it (a round already running finishes;
//! the reconcile only reads, so an overlap costs work, not correctness).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flashsale_io::jetstream::async_nats::jetstream::kv;

use crate::logic::ids::InstanceId;

/// The lease key of the periodic reconcile.
pub const RECONCILE_LEASE: &str = "reconcile";

/// Whether this instance holds a lease, as its holder task last established it.
#[derive(Debug, Default)]
pub struct Lease {
    /// Held until this instant (ms since the epoch); 0: not held.
    held_until_ms: AtomicU64,
    /// Times this instance took the lease (a fresh `create`).
    pub acquired: AtomicU64,
}

impl Lease {
    pub fn held(&self, now_ms: u64) -> bool {
        now_ms < self.held_until_ms.load(Ordering::Acquire)
    }

    fn hold_until(&self, until_ms: u64) {
        self.held_until_ms.store(until_ms, Ordering::Release);
    }
}

/// What one attempt did.
enum Step {
    /// Written at revision `.0`.
    Held(u64),
    /// Someone else holds it.
    Other,
    /// The bucket did not answer; try again next tick.
    Failed,
}

/// Keeps `lease` current for `key` until `stop`: every `period / 3` a create or a renewal,
/// each bounded by `period / 3`. On stop a held lease is released (bounded the same way).
pub async fn hold(
    store: kv::Store,
    key: &'static str,
    instance: InstanceId,
    period: Duration,
    lease: Arc<Lease>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let tick = (period / 3).max(Duration::from_millis(10));
    let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
    let mut revision: Option<u64> = None;
    loop {
        let started = crate::logic::clock::now_ms();
        let step = tokio::time::timeout(tick, attempt(&store, key, &instance, revision))
            .await
            .unwrap_or(Step::Failed);
        let was_held = revision.is_some();
        match step {
            Step::Held(at) => {
                if !was_held {
                    lease.acquired.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(lease = key, instance = %instance, "lease taken");
                }
                revision = Some(at);
                lease.hold_until(started.saturating_add(period_ms));
            }
            Step::Other | Step::Failed => {
                if was_held {
                    tracing::warn!(lease = key, instance = %instance, "lease lost");
                }
                revision = None;
                lease.hold_until(0);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            lease.hold_until(0);
            if let Some(revision) = revision {
                let _ = tokio::time::timeout(tick, release(&store, key, &instance, revision)).await;
            }
            return;
        }
    }
}

/// Writes the empty value at the held revision (fails harmlessly when someone else holds a
/// newer entry).
async fn release(store: &kv::Store, key: &str, instance: &InstanceId, revision: u64) {
    // A holder that dies without releasing (the takeover-by-expiry drill).
    #[cfg(feature = "failpoints")]
    fail::fail_point!("lease_no_release", |_| ());
    match store.update(key, bytes::Bytes::new(), revision).await {
        Ok(_) => tracing::info!(lease = key, instance = %instance, "lease released"),
        Err(e) => tracing::debug!(lease = key, error = %e, "lease release failed"),
    }
}

async fn attempt(
    store: &kv::Store,
    key: &str,
    instance: &InstanceId,
    revision: Option<u64>,
) -> Step {
    let value = || bytes::Bytes::copy_from_slice(instance.as_str().as_bytes());
    if let Some(revision) = revision {
        return match store.update(key, value(), revision).await {
            Ok(at) => Step::Held(at),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Step::Other,
            Err(e) => {
                tracing::debug!(lease = key, error = %e, "lease renewal failed");
                Step::Failed
            }
        };
    }
    match store.create(key, value()).await {
        Ok(at) => Step::Held(at),
        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
            // Released (empty), or ours from before (a renewal that landed after its timeout,
            // or this instance id's previous process): take it by revision.
            match store.entry(key).await {
                Ok(Some(entry))
                    if entry.value.is_empty()
                        || entry.value.as_ref() == instance.as_str().as_bytes() =>
                {
                    match store.update(key, value(), entry.revision).await {
                        Ok(at) => Step::Held(at),
                        Err(_) => Step::Other,
                    }
                }
                Ok(_) => Step::Other,
                Err(_) => Step::Failed,
            }
        }
        Err(e) => {
            tracing::debug!(lease = key, error = %e, "lease create failed");
            Step::Failed
        }
    }
}

/// Opens the lease bucket (retrying every `period / 3` until it answers or `stop`), then
/// [`hold`]s `key`.
pub async fn run(
    log: flashsale_io::jetstream::Log,
    key: &'static str,
    instance: InstanceId,
    period: Duration,
    lease: Arc<Lease>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
    let store = loop {
        match log.lease_store(period_ms).await {
            Ok(store) => break store,
            Err(e) => tracing::warn!(error = %e, "lease bucket unavailable; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep((period / 3).max(Duration::from_millis(10))) => {}
            _ = stop.changed() => return,
        }
    };
    hold(store, key, instance, period, lease, stop).await;
}
