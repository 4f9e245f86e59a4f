//! Degradation modes on the admin plane (DESIGN.md section 7): a signed snapshot checked
//! against this instance's table, put into the replicated mode bucket, then applied here;
//! the global effective mode as JSON and as the `flashsale_mode` gauge.
//!
//! Not here: the rules (`logic::modes`), the bucket and its watcher (`durable::modes`).

use serde_json::json;

use crate::durable::DurableRequest;
use crate::http::Status;
use crate::logic::clock::now_ms;
use crate::shard::shared::EdgeShared;

/// `POST /admin/v1/mode`: a signed snapshot (DESIGN.md section 7). Checked against this
/// instance's table first (forged, stale, expired or a forbidden transition never reach the
/// fleet), then put into the replicated mode bucket, then applied here; every other instance
/// applies it from the bucket.
pub async fn post_mode(shared: &EdgeShared, body: &[u8]) -> (Status, String) {
    let signed = match accept_mode(shared, body).await {
        Ok(signed) => signed,
        Err(e) => {
            let (code, reason) = e.http();
            tracing::warn!(error = %e, "mode snapshot refused");
            let status = Status::from_code(code).unwrap_or(Status::BadRequest);
            let body = json!({"state": "REFUSED", "reason_code": reason, "error": e.to_string()});
            return (status, body.to_string());
        }
    };
    let snapshot = &signed.snapshot;
    let body = json!({
        "state": "ACCEPTED",
        "scope": snapshot.scope.to_string(),
        "version": snapshot.version,
        "mode": snapshot.mode.name(),
        "admit_percent": snapshot.mode.admit_percent(),
        "expires_at_ms": snapshot.expires_at_ms,
        // Reopening (seed ch9 §7.8): does the backlog drain at the current rates? The
        // operator who raises RECOVERING's share reads it here (advice, never a refusal).
        "backlog": opens_submissions(snapshot.mode).then(|| shared.health.drain_detail()),
    });
    (Status::Ok, body.to_string())
}

/// Whether a mode lets new submissions in (the moment the drain estimate matters).
fn opens_submissions(mode: crate::logic::modes::Mode) -> bool {
    use crate::logic::modes::Mode;
    matches!(mode, Mode::Normal | Mode::Recovering { .. } | Mode::ShedLoad { .. })
}

/// Checks, replicates and applies one signed snapshot (the steps of [`post_mode`]).
async fn accept_mode(
    shared: &EdgeShared,
    body: &[u8],
) -> Result<crate::logic::modes::SignedSnapshot, crate::durable::modes::ControlError> {
    use crate::durable::modes::{kv_key, ControlError};
    let modes = &shared.modes;
    let text = std::str::from_utf8(body).unwrap_or("");
    let signed =
        crate::logic::modes::SignedSnapshot::from_json(text).map_err(ControlError::Mode)?;
    modes.check(&signed, now_ms())?;
    let (scope, version) = (signed.snapshot.scope, signed.snapshot.version);
    let (key, value) = (kv_key(scope), signed.to_json());
    let put = shared.durable.call(|reply| DurableRequest::PutMode { key, value, version, reply });
    put.await.map_err(|e| match e {
        crate::durable::DurableError::StaleMode { current } => {
            ControlError::Mode(crate::logic::modes::ModeError::StaleVersion {
                scope,
                current,
                offered: version,
            })
        }
        e => ControlError::Store(e.to_string()),
    })?;
    // The watcher may already have applied our own put: a stale version then means "done".
    match modes.apply(&signed, now_ms()) {
        Ok(_) | Err(ControlError::Mode(crate::logic::modes::ModeError::StaleVersion { .. })) => {
            Ok(signed)
        }
        Err(e) => Err(e),
    }
}

/// `GET /admin/v1/mode`: the global scope's effective mode and its snapshot.
pub fn get_mode(shared: &EdgeShared) -> (Status, String) {
    let modes = &shared.modes;
    let effective = modes.global(now_ms());
    let snapshot = modes
        .describe(crate::logic::modes::Scope::Global)
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s.to_json()).ok());
    let body = json!({
        "mode": effective.mode.name(),
        "admit_percent": effective.admit_percent(),
        "reason_code": effective.reason(),
        "closes_submissions": effective.closes_submissions(),
        "snapshot": snapshot,
    });
    (Status::Ok, body.to_string())
}

/// `flashsale_mode`: the global scope's effective mode (NORMAL 0 .. QUERY_ONLY 4; an expired or
/// unverifiable state counts as SUBMIT_CLOSED).
pub fn render_mode(shared: &EdgeShared, out: &mut String) {
    use std::fmt::Write as _;
    let effective = shared.modes.global(now_ms());
    let value = if effective.closes_submissions() {
        effective.mode.metric_value().max(crate::logic::modes::Mode::SubmitClosed.metric_value())
    } else {
        effective.mode.metric_value()
    };
    let _ =
        writeln!(out, "# TYPE flashsale_mode gauge\nflashsale_mode{{scope=\"global\"}} {value}");
    // The reconcile lease among instances (durable/lease.rs): 1 where the periodic job runs.
    let lease = &shared.reconcile_lease;
    let held = u8::from(lease.held(now_ms()));
    let acquired = lease.acquired.load(std::sync::atomic::Ordering::Relaxed);
    let _ = writeln!(
        out,
        "# TYPE flashsale_reconcile_lease_held gauge\nflashsale_reconcile_lease_held {held}\n\
         # TYPE flashsale_reconcile_lease_acquired_total counter\n\
         flashsale_reconcile_lease_acquired_total {acquired}"
    );
}
