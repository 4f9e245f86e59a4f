//! Stranded work: messages `SECKILL_ORDERS` holds that `order-writer` will never deliver, and
//! the repair (the consumer recreated, which delivers every message the work queue holds).
//!
//! How it happens: a consumer delivers only stream sequences above the one it last delivered.
//! If the stream's store loses its sequence while the consumer's state survives, the stream
//! numbers new messages from 1 again, below the consumer's floor: every publish is acked (the
//! buyer was told `QUEUED`, the scanner's republishes are acked too) and none is ever
//! delivered. nats-server 2.9.10 (Debian's) has known defects that leave such a store: a
//! replica's clustered state reset ("stream store EOF" → "Resetting stream cluster state";
//! nats-server#7308/#7348, fixed in 2.12) and a work queue's sequence lost after kill -9
//! (#6881/#6789, fixed in 2.11). The suspected cause of the 41 queued buyers without an order
//! in seed 8 of an earlier fault campaign (README, "Several faults at once"); the state itself
//! is reproduced by `tests/tests/order_writer.rs`.
//!
//! How it is seen: in a work queue a settled message leaves the stream, so every message it
//! holds is either not yet delivered (the consumer's `num_pending`) or delivered and not yet
//! settled (`num_ack_pending`, which also keeps a message whose deliveries ran out). A stream
//! with messages while the consumer has neither holds them below the consumer's floor. The
//! two counts come from two requests, so one sample can see an ack land between them; the
//! watch acts only when the same first message stayed stranded for `hold_ms` of samples.
//!
//! Why recreating is safe: the new durable consumer (deliver-all, the same config) delivers
//! every message the work queue holds, stranded or not; one delivered twice (it was in a
//! worker's hands when the consumer went) is written once, by the order-writer's inbox.
//! Partly stranded work (new messages above the floor flowing while older ones sit below it)
//! is seen once the flow drains, at the end of a sale at the latest.
//!
//! What it is not: the poll (`lag.rs`, whose sample carries [`LagSample::stranded`]) or the
//! loop that repairs (`pg-worker/src/worker/lag_task.rs`); the recreation itself is
//! [`Log::recreate_order_writer`](super::Log::recreate_order_writer).

use super::lag::LagSample;

/// The message the worker logs (at ERROR) when it recreates the consumer: one line per repair,
/// which the fault soak counts in the engines' logs.
pub const RECREATION_LOG: &str =
    "SECKILL_ORDERS holds messages order-writer will never deliver (a stream store that lost \
     its sequence): recreating the consumer";

/// Watches successive lag samples for stranded messages.
#[derive(Debug, Clone)]
pub struct StrandWatch {
    hold_ms: u64,
    /// The stranded first sequence and when it was first seen so.
    since: Option<(u64, u64)>,
}

impl StrandWatch {
    /// `hold_ms` 0 turns the repair off (the drill's control).
    pub fn new(hold_ms: u64) -> StrandWatch {
        StrandWatch { hold_ms, since: None }
    }

    /// True when the consumer should be recreated now: the same first message has been
    /// stranded in every sample for at least `hold_ms`. Starts over after saying so.
    pub fn observe(&mut self, sample: &LagSample, now_ms: u64) -> bool {
        if self.hold_ms == 0 || sample.stranded == 0 {
            self.since = None;
            return false;
        }
        match self.since {
            Some((first, seen_ms)) if first == sample.first_sequence => {
                if now_ms.saturating_sub(seen_ms) >= self.hold_ms {
                    self.since = None;
                    return true;
                }
                false
            }
            _ => {
                self.since = Some((sample.first_sequence, now_ms));
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stranded(count: u64, first_sequence: u64) -> LagSample {
        LagSample { stranded: count, first_sequence, ..LagSample::default() }
    }

    #[test]
    fn stranded_work_held_for_the_hold_time_asks_for_one_repair() {
        let mut watch = StrandWatch::new(5_000);
        assert!(!watch.observe(&stranded(2, 1), 1_000), "first sight only starts the clock");
        assert!(!watch.observe(&stranded(3, 1), 5_999));
        assert!(watch.observe(&stranded(3, 1), 6_000), "held 5 s: repair");
        assert!(!watch.observe(&stranded(3, 1), 6_500), "after a repair the clock starts over");
        assert!(watch.observe(&stranded(3, 1), 11_500));
    }

    #[test]
    fn a_moving_queue_or_a_clear_sample_starts_over() {
        let mut watch = StrandWatch::new(5_000);
        watch.observe(&stranded(2, 1), 0);
        // The first message left (an ack landed between the two requests of a sample).
        assert!(!watch.observe(&stranded(1, 2), 5_000));
        assert!(!watch.observe(&stranded(1, 2), 9_999));
        assert!(!watch.observe(&stranded(0, 2), 10_000), "nothing stranded: clock cleared");
        assert!(!watch.observe(&stranded(1, 2), 10_500));
        assert!(!watch.observe(&stranded(1, 2), 15_499));
        assert!(watch.observe(&stranded(1, 2), 15_500));
    }

    #[test]
    fn a_zero_hold_never_repairs() {
        let mut watch = StrandWatch::new(0);
        for now in [0, 10_000, 1_000_000] {
            assert!(!watch.observe(&stranded(5, 1), now));
        }
    }
}
