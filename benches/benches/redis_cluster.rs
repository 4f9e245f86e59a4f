//! What replica fencing costs: creating `reserve` calls through `flashsale_io::redis::script`
//! with 64 in flight, on a private Redis Cluster (3 masters + 3 replicas, the stack's own
//! `RedisCluster`) with fencing off (`min_replica_acks` 0) and on (1: one `WAIT` per batch on
//! each master's fenced connection), for one hot SKU and for 64 SKUs spread over the three
//! masters; beside one standalone node (no replica, no fencing) as the baseline.
//!
//! Run: `cargo bench -p flashsale-benches --bench redis_cluster`. Everything shares the
//! machine's cores (six redis-servers, their replication, the bench's glommio executor,
//! unpinned); quote ratios from one run. Keys are flushed before every measured pass so
//! memory stays flat. After criterion's report, a fixed-time pass prints ops/s per case and
//! the fenced/unfenced ratios.

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use flashsale_benches::{on_glommio, BenchRedis};
use flashsale_engine::app::stack::{redis_call, RedisCluster};
use flashsale_io::redis::fence::MinReplicaAcks;
use flashsale_io::redis::layout::ActivityStatus;
use flashsale_io::redis::router::{Router, RouterConfig};
use flashsale_io::redis::script::{Functions, PreheatArgs, ReserveArgs, ReserveReply, SkuKeys};
use flashsale_io::redis::RedisConfig;

const IN_FLIGHT: usize = 64;
const T0: u64 = 1_750_000_000_000;

#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    cluster: bool,
    skus: u64,
    acks: u32,
}

const CASES: [Case; 5] = [
    Case { name: "standalone_1sku", cluster: false, skus: 1, acks: 0 },
    Case { name: "cluster_1sku_unfenced", cluster: true, skus: 1, acks: 0 },
    Case { name: "cluster_1sku_fenced", cluster: true, skus: 1, acks: 1 },
    Case { name: "cluster_64sku_unfenced", cluster: true, skus: 64, acks: 0 },
    Case { name: "cluster_64sku_fenced", cluster: true, skus: 64, acks: 1 },
];

/// Distinct users across every pass, so every call creates.
static NEXT_USER: AtomicU64 = AtomicU64::new(1);

struct Servers {
    standalone: BenchRedis,
    cluster: RedisCluster,
    _dir: tempfile::TempDir,
}

impl Servers {
    fn seeds(&self, case: Case) -> Vec<SocketAddr> {
        if case.cluster {
            self.cluster.seeds()
        } else {
            vec![self.standalone.addr()]
        }
    }

    /// FLUSHALL on every node that holds data (functions survive it).
    fn flush(&self) {
        let mut nodes = self.cluster.seeds();
        nodes.push(self.standalone.addr());
        for node in nodes {
            let _ = redis_call(node, &["FLUSHALL"]); // replicas refuse: READONLY
        }
    }
}

/// Runs `passes` on one glommio executor with Functions for `case`.
fn with_functions<T: Send + 'static>(
    seeds: Vec<SocketAddr>,
    case: Case,
    run: impl FnOnce(
            Rc<Functions>,
            Rc<Vec<SkuKeys>>,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>>
        + Send
        + 'static,
) -> T {
    on_glommio(move || async move {
        let mut node = RedisConfig::new(seeds[0]);
        node.in_flight_max = 1_024;
        node.command_timeout = Duration::from_secs(2);
        let mut config = RouterConfig::new(seeds, node);
        config.min_replica_acks = MinReplicaAcks::Exactly(case.acks);
        let router = Router::connect(config).await.expect("connect");
        assert_eq!(router.fence().min_replica_acks, case.acks);
        let f = Rc::new(Functions::over(router));
        f.load_everywhere().await.expect("FUNCTION LOAD");
        let skus: Vec<SkuKeys> = (1..=case.skus).map(|s| SkuKeys::new(90_001, s)).collect();
        for keys in &skus {
            let args = PreheatArgs {
                status: ActivityStatus::Active,
                start_ms: T0 - 1_000,
                end_ms: T0 + 3_600_000,
                version: 1,
                reservation_ttl_ms: 300_000,
                stock: 1_000_000_000,
                max_per_buyer: 1,
            };
            f.preheat(keys, &args).await.expect("preheat");
        }
        run(f, Rc::new(skus)).await
    })
}

async fn reserve_one(f: &Functions, keys: &SkuKeys) {
    let user = NEXT_USER.fetch_add(1, Ordering::Relaxed);
    let (request, resv, msg) = (format!("r{user}"), format!("v{user}"), format!("m{user}"));
    let args = ReserveArgs {
        request_id: &request,
        user_id: user,
        payload_hash: "h",
        reservation_id: &resv,
        message_id: &msg,
        now_ms: T0,
        pending_grace_ms: 2_000,
        quantity: 1,
    };
    let reply = f.reserve(keys, &args).await;
    assert!(matches!(reply, Ok(ReserveReply::Created { .. })), "{reply:?}");
}

/// `IN_FLIGHT` tasks make `ops` creating calls, round-robin over the SKUs; wall time.
async fn run_ops(f: Rc<Functions>, skus: Rc<Vec<SkuKeys>>, ops: u64) -> Duration {
    let per_task = ops.div_ceil(IN_FLIGHT as u64).max(1);
    let start = Instant::now();
    let tasks: Vec<_> = (0..IN_FLIGHT)
        .map(|t| {
            let (f, skus) = (Rc::clone(&f), Rc::clone(&skus));
            glommio::spawn_local(async move {
                for i in 0..per_task {
                    let keys = &skus[(t + i as usize) % skus.len()];
                    reserve_one(&f, keys).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await;
    }
    start.elapsed().mul_f64(ops as f64 / (per_task * IN_FLIGHT as u64) as f64)
}

async fn run_for(f: Rc<Functions>, skus: Rc<Vec<SkuKeys>>, window: Duration) -> f64 {
    let start = Instant::now();
    let tasks: Vec<_> = (0..IN_FLIGHT)
        .map(|t| {
            let (f, skus) = (Rc::clone(&f), Rc::clone(&skus));
            glommio::spawn_local(async move {
                let mut done = 0u64;
                while start.elapsed() < window {
                    let keys = &skus[(t + done as usize) % skus.len()];
                    reserve_one(&f, keys).await;
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await;
    }
    total as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let dir = tempfile::Builder::new().prefix("flashsale-bench-cluster-").tempdir().expect("dir");
    let cluster = RedisCluster::create(dir.path()).expect("start the bench cluster");
    let servers = Servers { standalone: BenchRedis::start(), cluster, _dir: dir };

    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10)
        .configure_from_args();
    {
        let mut group = criterion.benchmark_group("reserve_created");
        group.throughput(Throughput::Elements(1));
        for case in CASES {
            group.bench_with_input(BenchmarkId::new(case.name, IN_FLIGHT), &case, |b, &case| {
                b.iter_custom(|ops| {
                    servers.flush();
                    with_functions(servers.seeds(case), case, move |f, skus| {
                        Box::pin(run_ops(f, skus, ops))
                    })
                })
            });
        }
        group.finish();
    }
    criterion.final_summary();

    println!("\nsame-run throughput, 2 s per case, {IN_FLIGHT} creating reserves in flight:");
    let mut rates = Vec::new();
    for case in CASES {
        servers.flush();
        let rate = with_functions(servers.seeds(case), case, |f, skus| {
            Box::pin(run_for(f, skus, Duration::from_secs(2)))
        });
        println!("  {:<24} {rate:>9.0} ops/s", case.name);
        rates.push(rate);
    }
    println!(
        "  fenced/unfenced: 1 SKU {:.2}, 64 SKUs {:.2}; cluster 64 SKUs unfenced / standalone {:.2}",
        rates[2] / rates[1],
        rates[4] / rates[3],
        rates[3] / rates[0]
    );
    servers.cluster.stop();
}
