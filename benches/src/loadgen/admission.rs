//! The engine's adaptive admission over the run (issue 24 item 4): `/metrics` on the admin
//! plane sampled every 100 ms while the load runs — the expensive path's limit
//! (`flashsale_admission_limit`, summed over the shards), whether it keeps the instance
//! ready (`flashsale_admission_limit_ready`), and the answers it shed so far
//! (`flashsale_admission_rejections_total{reason="ADAPTIVE_LIMIT"}`). The report aligns the
//! samples with the run's start (`timing.started_unix_us`) and the picture draws them.
//!
//! Not on the hot path: one request on a fresh admin connection per sample, on the
//! generator's tokio runtime, never on its event-loop threads.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One sample of the engine's admission state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AdmissionSample {
    /// When it was taken: µs since the Unix epoch (the report turns it into ms since start).
    pub at_unix_us: u64,
    /// Places on the expensive path, over all shards.
    pub limit: u64,
    pub ready: bool,
    /// `OVERLOADED` answers of the adaptive limit since the engine started.
    pub shed_total: u64,
}

/// Samples kept at most: ten minutes at 10 a second.
const SAMPLES_MAX: usize = 6_000;
const EVERY: Duration = Duration::from_millis(100);

/// A running sampler; [`Sampler::finish`] stops it and hands the samples back.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<AdmissionSample>>,
}

impl Sampler {
    pub fn start(admin: SocketAddr, host: String, token: Option<String>) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            while !stopped.load(Ordering::Relaxed) && samples.len() < SAMPLES_MAX {
                let answer =
                    super::request(admin, &host, "GET", "/metrics", token.as_deref(), None).await;
                if let Ok((200, text)) = answer {
                    if let Some(sample) = parse(&text, unix_us()) {
                        samples.push(sample);
                    }
                }
                tokio::time::sleep(EVERY).await;
            }
            samples
        });
        Sampler { stop, task }
    }

    pub async fn finish(self) -> Vec<AdmissionSample> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or_default()
    }
}

fn unix_us() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map_or(0, |d| d.as_micros() as u64)
}

/// The sample in a Prometheus text page; `None` when the engine exposes no adaptive limit.
pub fn parse(text: &str, at_unix_us: u64) -> Option<AdmissionSample> {
    let value = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    Some(AdmissionSample {
        at_unix_us,
        limit: value("flashsale_admission_limit")? as u64,
        ready: value("flashsale_admission_limit_ready").is_none_or(|v| v != 0.0),
        shed_total: value("flashsale_admission_rejections_total{reason=\"ADAPTIVE_LIMIT\"}")
            .unwrap_or(0.0) as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_limit_readiness_and_shed_count() {
        let text = "# TYPE flashsale_admission_limit gauge\nflashsale_admission_limit 37\n\
                    flashsale_admission_limit_ready 0\n\
                    flashsale_admission_rejections_total{reason=\"IN_FLIGHT\"} 3\n\
                    flashsale_admission_rejections_total{reason=\"ADAPTIVE_LIMIT\"} 12\n";
        let s = parse(text, 5).unwrap();
        assert_eq!((s.at_unix_us, s.limit, s.ready, s.shed_total), (5, 37, false, 12));
        assert_eq!(parse("flashsale_requests_total 1\n", 5), None, "no limit, no sample");
    }
}
