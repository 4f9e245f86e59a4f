//! The order timeout closer task (DESIGN.md section 6): orders unpaid past their pay timeout
//! closed in bounded rounds, asking the payment provider first when one is configured.
//!
//! What it is: [`run`] and one round on a pooled connection, bounded by the database deadline
//! and, with a provider, by the asks' own bound.
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
/// round asks it before closing (`payments::close_due_orders_verified`); without one, orders
/// with no callback are closed unverified, which is logged once here.
pub(super) async fn run(shared: &Shared, mut stop: watch::Receiver<bool>) {
    let closer = &shared.config.closer;
    let provider = match &closer.provider {
        None => {
            tracing::warn!(
                "no payment provider configured ([payments] status_url): the closer closes \
                 orders past their pay timeout without asking the provider (closes are not \
                 verified)"
            );
            None
        }
        Some(config) => match crate::provider::Provider::new(config.clone()) {
            Ok(provider) => {
                tracing::info!(status_url = %config.status_url, "the closer asks the payment provider before closing");
                Some(provider)
            }
            Err(e) => {
                // validate() refused this config before start; keep today's behaviour visibly.
                tracing::error!(error = %e, "payment provider unusable: closes are not verified");
                None
            }
        },
    };
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

/// One closer round on a pooled connection: (candidates, whether any order moved on).
async fn closer_round(
    shared: &Shared,
    provider: Option<&crate::provider::Provider>,
) -> Result<(usize, bool), PgError> {
    let closer = &shared.config.closer;
    let client = shared.pool.get().await?;
    let round = match provider {
        None => within_deadline(
            shared,
            "closer round",
            crate::payments::close_due_orders(&client, closer.batch_max, now_ms()),
        )
        .await
        .map(|r| (r.candidates, !r.closed.is_empty())),
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
    if round.is_err() {
        drop(deadpool_postgres::Object::take(client));
    }
    round
}
