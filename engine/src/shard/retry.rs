//! Bounded retries of idempotent calls on a shard (reads, `mark_sent`): full-jitter delays
//! from `logic::circuit::RetryPolicy`, slept on the shard's own timer.
//!
//! Not here: anything that is not safe to repeat (a reservation is never retried here; its
//! client retries with the same request id).

use std::time::Duration;

use crate::logic::circuit::RetryPolicy;

/// Runs the idempotent `op` up to `policy.attempts_max` times while it fails, waiting a
/// full-jitter delay between attempts and starting none past `policy.budget_ms`. Only for
/// operations whose repetition is harmless (reads, `mark_sent`).
pub async fn retry_idempotent<T, E, F, Fut>(policy: &RetryPolicy, mut op: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let started = std::time::Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        match op().await {
            Ok(value) => return Ok(value),
            Err(e) => {
                let elapsed_ms = started.elapsed().as_millis() as u64;
                match policy.next_delay_ms(attempts, elapsed_ms, rand::random()) {
                    Some(delay_ms) => {
                        glommio::timer::sleep(Duration::from_millis(delay_ms)).await;
                    }
                    None => return Err(e),
                }
            }
        }
    }
}
