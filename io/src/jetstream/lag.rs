//! How far `order-writer` is behind: the pending count and the age of the oldest message not
//! yet settled, polled from JetStream and shared through a cheap handle.
//!
//! What it is: [`poll`] (one sample: consumer info for the count, stream info for the age) and
//! [`LogLag`], an `Arc` of atomics written by the poller and read by anyone (the edge's
//! admission reads it per request: two relaxed loads, no locks, no I/O).
//!
//! Oldest pending age: the age of the oldest message not yet DELIVERED to a worker — the head
//! of the queue a message published now waits behind (the consumer's delivered floor + 1, one
//! message get, only when something is undelivered). Not the stream's first message: that
//! may be one a worker has written already whose ack was lost (acks are fire-and-forget, and
//! a consumer-leader change drops those in flight), and it stays in the work queue until its
//! ack wait (30 s) redelivers it — counting its age closed submissions for that long with no
//! backlog at all (found by the leader-kill drill in `tests/tests/ha_log.rs`). Messages in a
//! worker's hands are counted in `pending`, bounded by `max_ack_pending`.
//!
//! Also here: [`placement`] (one stream's configured replicas and the peers current per its
//! info's cluster section) and [`record_placement`], which sets the gauges
//! `flashsale_log_stream_replicas{stream}` and `flashsale_log_stream_replicas_current{stream}`
//! in the `metrics` registry that `/metrics` renders. The edge's health poller
//! (`engine/src/durable/health.rs`) refreshes them beside the backlog sample.
//!
//! What it is not: the poll loops; the worker runs the lag loop and sets its gauges
//! (`pg-worker/src/worker/lag_task.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_nats::jetstream;

use super::error::LogError;

/// One observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LagSample {
    /// Messages not yet delivered plus delivered but not yet acked.
    pub pending: u64,
    /// Age of the oldest message not yet delivered to a worker (0 when none).
    pub oldest_pending_age_ms: u64,
    /// The stream's last sequence: every message published before the poll has one at most
    /// this. Also the messages ever published: with `pending`, the produce and consume rates
    /// of the drain-time estimate (`engine::logic::drain`).
    pub last_sequence: u64,
    /// The consumer's ack floor: every message up to this sequence is settled (acked after its
    /// commit, or terminated into the dead letters).
    pub ack_floor: u64,
    /// The stream's first sequence (its oldest message, when it holds one).
    pub first_sequence: u64,
    /// Messages the stream holds while the consumer has none pending and none unacked: below
    /// its floor, never to be delivered (`strand.rs`). 0 whenever the consumer has work.
    pub stranded: u64,
}

/// The last sample, shared. Clone freely.
#[derive(Debug, Clone, Default)]
pub struct LogLag {
    inner: Arc<LagInner>,
}

#[derive(Debug, Default)]
struct LagInner {
    pending: AtomicU64,
    oldest_pending_age_ms: AtomicU64,
    last_sequence: AtomicU64,
    ack_floor: AtomicU64,
    /// When the sample was taken (ms since the Unix epoch); 0 = never. Readers use it to tell
    /// a fresh "no backlog" from a poller that stopped answering.
    polled_at_ms: AtomicU64,
}

// Relaxed everywhere: each value is an independent observation; a reader that sees a new count
// with an old age is off by one poll interval, which admission tolerates by design.
impl LogLag {
    pub fn pending(&self) -> u64 {
        self.inner.pending.load(Ordering::Relaxed)
    }

    pub fn oldest_pending_age_ms(&self) -> u64 {
        self.inner.oldest_pending_age_ms.load(Ordering::Relaxed)
    }

    pub fn polled_at_ms(&self) -> u64 {
        self.inner.polled_at_ms.load(Ordering::Relaxed)
    }

    /// See [`LagSample::last_sequence`].
    pub fn last_sequence(&self) -> u64 {
        self.inner.last_sequence.load(Ordering::Relaxed)
    }

    /// See [`LagSample::ack_floor`].
    pub fn ack_floor(&self) -> u64 {
        self.inner.ack_floor.load(Ordering::Relaxed)
    }

    pub fn store(&self, sample: LagSample, now_ms: u64) {
        self.inner.pending.store(sample.pending, Ordering::Relaxed);
        self.inner.oldest_pending_age_ms.store(sample.oldest_pending_age_ms, Ordering::Relaxed);
        self.inner.last_sequence.store(sample.last_sequence, Ordering::Relaxed);
        self.inner.ack_floor.store(sample.ack_floor, Ordering::Relaxed);
        self.inner.polled_at_ms.store(now_ms.max(1), Ordering::Relaxed);
    }
}

/// Samples `durable` on `stream` once.
pub(super) async fn poll(
    context: &jetstream::Context,
    stream: &str,
    durable: &str,
    now_ms: u64,
) -> Result<LagSample, LogError> {
    let api = |e: &dyn std::fmt::Display| LogError::Api {
        op: "lag poll",
        message: e.to_string(),
        transient: true,
    };
    let stream = context.get_stream(stream).await.map_err(|e| api(&e))?;
    let consumer = stream.consumer_info(durable).await.map_err(|e| api(&e))?;
    let pending = consumer.num_pending + consumer.num_ack_pending as u64;
    let state = &stream.cached_info().state;
    let oldest_pending_age_ms = if state.messages == 0 || consumer.num_pending == 0 {
        0
    } else {
        let head = consumer.delivered.stream_sequence.saturating_add(1).max(state.first_sequence);
        // The head's own time; if it cannot be read, the stream's first message (older or
        // equal: a conservative age).
        let head_ns = match stream.get_raw_message(head).await {
            Ok(message) => message.time.unix_timestamp_nanos(),
            Err(_) => state.first_timestamp.unix_timestamp_nanos(),
        };
        now_ms.saturating_sub(u64::try_from(head_ns / 1_000_000).unwrap_or(0))
    };
    let idle = consumer.num_pending == 0 && consumer.num_ack_pending == 0;
    Ok(LagSample {
        pending,
        oldest_pending_age_ms,
        last_sequence: state.last_sequence,
        ack_floor: consumer.ack_floor.stream_sequence,
        first_sequence: state.first_sequence,
        stranded: if idle { state.messages } else { 0 },
    })
}

/// Where one stream's copies stand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamPlacement {
    pub stream: &'static str,
    /// `LogConfig::replicas`: what the stream should have.
    pub replicas_configured: usize,
    /// Peers that are current: the leader plus each replica the cluster section marks current
    /// and not offline. 1 on a server without clustering; 0 when the stream did not answer.
    pub replicas_current: usize,
    /// The stream leader's server name, when known.
    pub leader: Option<String>,
}

/// Samples `stream`'s placement once; a failed info request reads as no current peer.
pub(super) async fn placement(
    context: &jetstream::Context,
    stream: &'static str,
    replicas_configured: usize,
) -> StreamPlacement {
    let info = match context.get_stream(stream).await {
        Ok(handle) => Some(handle.cached_info().clone()),
        Err(e) => {
            tracing::debug!(stream, error = %e, "stream placement poll failed");
            None
        }
    };
    let (replicas_current, leader) = match info.as_ref().map(|i| i.cluster.as_ref()) {
        None => (0, None),
        Some(cluster) => current_peers(cluster),
    };
    StreamPlacement { stream, replicas_configured, replicas_current, leader }
}

/// Current peers from a stream info's cluster section (absent: a server without clustering,
/// which is the one copy).
fn current_peers(cluster: Option<&jetstream::stream::ClusterInfo>) -> (usize, Option<String>) {
    let Some(cluster) = cluster else { return (1, None) };
    let leader = cluster.leader.clone().filter(|l| !l.is_empty());
    let followers = cluster.replicas.iter().filter(|p| p.current && !p.offline).count();
    (usize::from(leader.is_some()) + followers, leader)
}

/// Sets the two placement gauges of every sampled stream.
pub fn record_placement(placements: &[StreamPlacement]) {
    for p in placements {
        metrics::gauge!("flashsale_log_stream_replicas", "stream" => p.stream)
            .set(p.replicas_configured as f64);
        metrics::gauge!("flashsale_log_stream_replicas_current", "stream" => p.stream)
            .set(p.replicas_current as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handle_shares_the_last_sample() {
        let lag = LogLag::default();
        assert_eq!(lag.polled_at_ms(), 0);
        let reader = lag.clone();
        let sample = LagSample {
            pending: 7,
            oldest_pending_age_ms: 1_500,
            last_sequence: 40,
            ack_floor: 33,
            ..LagSample::default()
        };
        lag.store(sample, 1_000);
        assert_eq!(reader.pending(), 7);
        assert_eq!((reader.last_sequence(), reader.ack_floor()), (40, 33));
        assert_eq!(reader.oldest_pending_age_ms(), 1_500);
        assert_eq!(reader.polled_at_ms(), 1_000);
    }

    #[test]
    fn current_peers_count_the_leader_and_current_followers() {
        let peer = |name: &str, current, offline| jetstream::stream::PeerInfo {
            name: name.into(),
            current,
            active: std::time::Duration::ZERO,
            offline,
            lag: None,
        };
        let cluster = |leader: Option<&str>, replicas| jetstream::stream::ClusterInfo {
            name: Some("c".into()),
            raft_group: None,
            leader: leader.map(str::to_owned),
            leader_since: None,
            replicas,
        };
        assert_eq!(current_peers(None), (1, None), "no clustering: the server is the copy");
        let healthy = cluster(Some("n1"), vec![peer("n2", true, false), peer("n3", true, false)]);
        assert_eq!(current_peers(Some(&healthy)), (3, Some("n1".into())));
        let degraded = cluster(Some("n2"), vec![peer("n1", false, true), peer("n3", true, false)]);
        assert_eq!(current_peers(Some(&degraded)).0, 2);
        let lagging = cluster(Some("n2"), vec![peer("n1", false, false), peer("n3", true, false)]);
        assert_eq!(current_peers(Some(&lagging)).0, 2);
        let leaderless = cluster(None, vec![peer("n1", true, false)]);
        assert_eq!(current_peers(Some(&leaderless)), (1, None));
    }
}
