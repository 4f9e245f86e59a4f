//! Throughput of the pipelined client (`flashsale_io::redis`) against a private
//! redis-server: a trivial Redis function (`FCALL bump`, one `INCR`) with 1, 16 and 64
//! commands in flight on one connection. The gain from 1 to 16/64 is what auto-pipelining
//! buys; the absolute numbers include Redis's own time per call.
//!
//! Run: `cargo bench -p flashsale-benches --bench redis_pipeline -- --warm-up-time 1 --measurement-time 3`.
//! The glommio executor is unpinned (`Placement::Unbound`) and shares the 2 cores with
//! redis-server. After criterion's report, a fixed-time pass prints ops/s per depth and the
//! ratios 16/1 and 64/1, all measured in the same run.

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use flashsale_benches::{with_client, BenchRedis};
use flashsale_io::redis::RedisClient;
use flashsale_io::resp::Reply;

const LIBRARY: &str = "#!lua name=flashsale_bench\n\
redis.register_function('bump', function(keys, args) return redis.call('INCR', keys[1]) end)";

const DEPTHS: [usize; 3] = [1, 16, 64];

/// Per command; the calls here answer in microseconds.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

fn load_library(addr: SocketAddr) {
    with_client(addr, COMMAND_TIMEOUT, |client| async move {
        let reply = client
            .command(&[b"FUNCTION", b"LOAD", b"REPLACE", LIBRARY.as_bytes()])
            .await
            .expect("FUNCTION LOAD");
        assert_eq!(reply.as_str(), Some("flashsale_bench"), "{reply:?}");
    });
}

async fn bump(client: &RedisClient) {
    let reply = client.fcall("bump", &[b"bench:counter"], &[]).await.expect("FCALL bump");
    assert!(matches!(reply, Reply::Integer(_)), "{reply:?}");
}

/// `depth` tasks share `ops` calls; returns the wall time of all of them.
async fn run_ops(client: RedisClient, depth: usize, ops: u64) -> Duration {
    let client = Rc::new(client);
    let per_task = ops.div_ceil(depth as u64);
    let start = Instant::now();
    let tasks: Vec<_> = (0..depth)
        .map(|_| {
            let client = Rc::clone(&client);
            glommio::spawn_local(async move {
                for _ in 0..per_task {
                    bump(&client).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await;
    }
    start.elapsed().mul_f64(ops as f64 / (per_task * depth as u64) as f64)
}

/// `depth` tasks call for `window`; returns ops per second and the average batch size.
async fn run_for(client: RedisClient, depth: usize, window: Duration) -> (f64, f64) {
    let client = Rc::new(client);
    let start = Instant::now();
    let (writes, commands) = (client.writes_total(), client.commands_total());
    let tasks: Vec<_> = (0..depth)
        .map(|_| {
            let client = Rc::clone(&client);
            glommio::spawn_local(async move {
                let mut done = 0u64;
                while start.elapsed() < window {
                    bump(&client).await;
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0u64;
    for task in tasks {
        total += task.await;
    }
    let batch = (client.commands_total() - commands) as f64
        / (client.writes_total() - writes).max(1) as f64;
    (total as f64 / start.elapsed().as_secs_f64(), batch)
}

fn main() {
    let redis = BenchRedis::start();
    let addr = redis.addr();
    load_library(addr);

    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
        .configure_from_args();
    {
        let mut group = criterion.benchmark_group("fcall_bump");
        group.throughput(Throughput::Elements(1));
        for depth in DEPTHS {
            group.bench_with_input(BenchmarkId::new("in_flight", depth), &depth, |b, &depth| {
                b.iter_custom(|ops| {
                    with_client(addr, COMMAND_TIMEOUT, move |client| run_ops(client, depth, ops))
                })
            });
        }
        group.finish();
    }
    criterion.final_summary();

    println!("\nsame-run throughput, 2 s per depth (FCALL bump, one connection):");
    let mut rates = Vec::new();
    for depth in DEPTHS {
        let (rate, batch) = with_client(addr, COMMAND_TIMEOUT, move |client| {
            run_for(client, depth, Duration::from_secs(2))
        });
        println!("  in flight {depth:>2}: {rate:>9.0} ops/s, {batch:.1} commands per write");
        rates.push(rate);
    }
    println!("  ratio 16/1 = {:.2}x, 64/1 = {:.2}x", rates[1] / rates[0], rates[2] / rates[0]);
    drop(redis);
}
