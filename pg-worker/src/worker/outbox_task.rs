//! The outbox task: the committed `event_outbox` rows published to `SECKILL_EVENTS`, round
//! after round.
//!
//! What it is: [`run`], [`crate::outbox::publish_once`] in a loop, the next round at once while
//! rounds come back full, else after `outbox_idle_ms`; on stop, one final round drains what was
//! committed. `outbox_publishers` of these run at once (`SKIP LOCKED` keeps them apart). A
//! round that fails discards its connection (it may be mid-transaction).
//!
//! What it is not: the round itself (`outbox.rs`: claim, publish with `Nats-Msg-Id`, mark).
//!
//! Read next: `../outbox.rs`.

use tokio::sync::watch;

use super::shared::{ms, pause, within_deadline, Shared};
use crate::outbox;

/// Publishes committed events until `stop`, then drains once more.
pub(super) async fn run(shared: &Shared, mut stop: watch::Receiver<bool>) {
    let config = &shared.config;
    loop {
        // Read before the round: the round after the stop signal is the final drain.
        let stopping = *stop.borrow();
        let round = async {
            let mut client = shared.pool.get().await?;
            let batch_max = config.outbox_batch_max;
            let round = within_deadline(
                shared,
                "outbox round",
                outbox::publish_once(&mut client, &shared.publisher, batch_max),
            )
            .await;
            if round.is_err() {
                drop(deadpool_postgres::Object::take(client));
            }
            round
        }
        .await;
        match round {
            Ok(round) if round.claimed == config.outbox_batch_max && round.failed == 0 => {}
            Ok(_) if stopping => return,
            Ok(_) => {
                pause(ms(config.outbox_idle_ms), &mut stop).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "outbox round failed");
                if stopping {
                    return;
                }
                pause(ms(config.error_pause_ms), &mut stop).await;
            }
        }
    }
}
