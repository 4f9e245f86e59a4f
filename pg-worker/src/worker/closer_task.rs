//! The order timeout closer task (DESIGN.md section 6): orders unpaid past their pay timeout
//! closed in bounded rounds, asking the payment provider first when one is configured.
//!
//! What it is: [`run`] and one round on a pooled connection, bounded by the database deadline
//! and, with a provider, by the asks' own bound; without a provider, orders are held
//! PAYMENT_UNKNOWN (`payment_unknown.rs`) unless the operator opted in to closing them.
//!
//! What it is not: what a close does (`payments.rs`), or the provider's client (`provider.rs`).
//!
//! Read next: `../payments.rs` (`close_due_orders`, `close_due_orders_verified`),
//! `../provider.rs`.

use tokio::sync::watch;

use super::shared::{ms, now_ms, pause, within_deadline, Shared};
use crate::error::PgError;

/// The order timeout closer (DESIGN.md section 6): a bounded round, then the next one at once
/// if it was full, else after `closer.interval_ms`. With a payment provider configured each
/// round asks it before closing (`payments::close_due_orders_verified`); without one, due
/// orders are held PAYMENT_UNKNOWN (`payment_unknown::hold_due_orders`) unless the operator
/// opted in to closing them unverified, which is logged loudly here. After every round the
/// held orders' gauges are set.
pub(super) async fn run(shared: &Shared, mut stop: watch::Receiver<bool>) {
    let closer = &shared.config.closer;
    let provider = provider_at_start(closer);
    let mode = match (&provider, closer.without_provider) {
        (Some(_), _) => "verified",
        (None, without) => without.mode_label(),
    };
    metrics::gauge!("flashsale_payment_closer_mode", "mode" => mode).set(1.0);
    loop {
        let round = closer_round(shared, provider.as_ref()).await;
        let pause_ms = match round {
            Ok((candidates, acted)) if candidates == closer.batch_max && acted => 0,
            Ok(_) => closer.interval_ms,
            Err(e) => {
                tracing::warn!(error = %e, "closer round failed");
                shared.config.error_pause_ms.max(closer.interval_ms)
            }
        };
        if pause(ms(pause_ms), &mut stop).await {
            return;
        }
    }
}

/// The provider the closer asks, said at start together with what happens without one.
fn provider_at_start(closer: &crate::payments::CloserConfig) -> Option<crate::provider::Provider> {
    use crate::payments::WithoutProvider;
    let Some(config) = &closer.provider else {
        match closer.without_provider {
            WithoutProvider::HoldUnknown => tracing::warn!(
                "no payment provider configured ([payments] status_url): orders past their pay \
                 timeout become PAYMENT_UNKNOWN and keep their unit until the provider's word \
                 arrives (a callback, or `flashsale admin payments reconcile`)"
            ),
            WithoutProvider::CloseUnverified => tracing::error!(
                "PAYMENTS CLOSE UNVERIFIED: [payments] close_unpaid_without_provider = true and \
                 no payment provider configured: orders past their pay timeout are CLOSED and \
                 their unit RESOLD without asking anyone; a payment whose callback is late \
                 becomes a refund and the unit is sold twice"
            ),
        }
        return None;
    };
    match crate::provider::Provider::new(config.clone()) {
        Ok(provider) => {
            tracing::info!(status_url = %config.status_url, "the closer asks the payment provider before closing");
            Some(provider)
        }
        Err(e) => {
            // validate() refused this config before start; if it still happens, the closer
            // does what it does without a provider (by default: hold, never close blind).
            tracing::error!(
                error = %e,
                without_provider = closer.without_provider.mode_label(),
                "payment provider unusable: the closer acts as without a provider"
            );
            None
        }
    }
}

/// One closer round on a pooled connection: (candidates, whether any order moved on).
async fn closer_round(
    shared: &Shared,
    provider: Option<&crate::provider::Provider>,
) -> Result<(usize, bool), PgError> {
    let closer = &shared.config.closer;
    let client = shared.pool.get().await?;
    let round = match provider {
        None => unverified_round(shared, &client).await,
        Some(provider) => {
            // The asks' own bound on top of the database's: waves of `concurrency` asks,
            // each at most attempts x timeout plus the pauses between attempts.
            let c = provider.config();
            let waves = closer.batch_max.div_ceil(c.concurrency) as u64;
            let ask_ms = u64::from(c.attempts) * c.timeout_ms
                + u64::from(c.attempts.saturating_sub(1)) * c.retry_pause_ms;
            let bound_ms = shared.config.pg.transaction_deadline_ms + waves * ask_ms;
            let work = crate::payments::close_due_orders_verified(
                &client,
                provider,
                closer.batch_max,
                now_ms(),
            );
            match tokio::time::timeout(ms(bound_ms), work).await {
                Ok(r) => r.map(|r| {
                    let acted = !r.round.closed.is_empty() || !r.paid.is_empty();
                    (r.round.candidates, acted || !r.unknown.is_empty())
                }),
                Err(_) => Err(PgError::Runtime(format!(
                    "verified closer round outlasted its bound of {bound_ms} ms"
                ))),
            }
        }
    };
    let round = match round {
        Ok(r) => within_deadline(
            shared,
            "payment unknown gauges",
            crate::payment_unknown::record_gauges(&client, now_ms()),
        )
        .await
        .map(|()| r),
        Err(e) => Err(e),
    };
    if round.is_err() {
        drop(deadpool_postgres::Object::take(client));
    }
    round
}

/// A round without a provider: hold (the default) or, opted in, close unverified.
async fn unverified_round(
    shared: &Shared,
    client: &deadpool_postgres::Object,
) -> Result<(usize, bool), PgError> {
    use crate::payments::WithoutProvider;
    let batch_max = shared.config.closer.batch_max;
    match shared.config.closer.without_provider {
        WithoutProvider::HoldUnknown => within_deadline(
            shared,
            "closer round (hold)",
            crate::payment_unknown::hold_due_orders(client, batch_max, now_ms()),
        )
        .await
        .map(|r| (r.candidates, !r.held.is_empty() || !r.closed.is_empty())),
        WithoutProvider::CloseUnverified => within_deadline(
            shared,
            "closer round",
            crate::payments::close_due_orders(client, batch_max, now_ms()),
        )
        .await
        .map(|r| (r.candidates, !r.closed.is_empty())),
    }
}
