//! What marking acknowledged reservations sent costs (`mark_sent`, `shard/publish.rs` step 3):
//! N reservations of one SKU marked one call per reservation (batch 1: what a shard did before
//! the acks that arrive together were marked as one call) against batches of 8, 32 and 128,
//! with 16 calls in flight on one connection, as a shard's pipeline has. Prints redis-server's
//! CPU per mark (read from /proc, `flashsale_engine::app::cpu`), the bench process's (the
//! client: encoding, parsing, tasks) and the wall time; rounds interleave the batch sizes,
//! medians and ratios against batch 1.
//!
//! Run: `cargo bench -p flashsale-benches --bench mark_sent` (`FLASHSALE_BENCH_MARKS` marks
//! per case, default 40,000). The reservations are made before each measured interval.

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use flashsale_benches::loadgen::search::median;
use flashsale_benches::{preheat_args, reserve_one, with_client, BenchRedis, T0};
use flashsale_engine::app::cpu::{process_ticks, self_ticks, US_PER_TICK};
use flashsale_io::redis::script::{Functions, MarkSent, MarkSentArgs, MarkSentReply, SkuKeys};

const BATCHES: [usize; 4] = [1, 8, 32, 128];
const ROUNDS: u64 = 3;
const IN_FLIGHT: usize = 16;
/// Per command: a call of 128 marks under a loaded Redis stays far below it.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

struct Sample {
    redis_us_per_mark: f64,
    client_us_per_mark: f64,
    wall_s: f64,
}

fn main() {
    let marks: usize =
        std::env::var("FLASHSALE_BENCH_MARKS").ok().and_then(|v| v.parse().ok()).unwrap_or(40_000);
    let redis = BenchRedis::start();
    let mut samples: Vec<Vec<Sample>> = BATCHES.iter().map(|_| Vec::new()).collect();
    for round in 0..ROUNDS {
        for (case, &batch) in BATCHES.iter().enumerate() {
            let sku = round * 1_000 + batch as u64;
            let sample = run(redis.addr(), redis.pid(), sku, batch, marks);
            println!(
                "round {round} batch {batch:>3}: redis {:.2} µs/mark, client {:.2} µs/mark, {:.3} s",
                sample.redis_us_per_mark, sample.client_us_per_mark, sample.wall_s
            );
            samples[case].push(sample);
        }
    }
    let base = median(samples[0].iter().map(|s| s.redis_us_per_mark).collect());
    println!("\n{marks} marks per case, {IN_FLIGHT} calls in flight, medians of {ROUNDS} rounds");
    println!("batch  redis µs/mark  ratio  client µs/mark  wall s");
    for (case, &batch) in BATCHES.iter().enumerate() {
        let of = |f: fn(&Sample) -> f64| median(samples[case].iter().map(f).collect());
        let redis_us = of(|s| s.redis_us_per_mark);
        println!(
            "{batch:>5}  {redis_us:>13.2}  {:>5.2}  {:>14.2}  {:>6.3}",
            redis_us / base,
            of(|s| s.client_us_per_mark),
            of(|s| s.wall_s)
        );
    }
}

/// Reserves `marks` units of SKU `sku` (not measured), then marks them all in calls of `batch`.
fn run(addr: SocketAddr, pid: u32, sku: u64, batch: usize, marks: usize) -> Sample {
    with_client(addr, COMMAND_TIMEOUT, move |client| async move {
        let functions = Rc::new(Functions::new(client));
        let keys = Rc::new(SkuKeys::new(77, sku));
        functions.preheat(&keys, &preheat_args(marks as u64)).await.expect("preheat");
        let ids: Rc<Vec<u64>> = Rc::new((1..=marks as u64).collect());
        let (f, k) = (Rc::clone(&functions), Rc::clone(&keys));
        in_flight(&ids, 1, move |chunk| {
            let (functions, keys) = (Rc::clone(&f), Rc::clone(&k));
            async move { reserve_one(&functions, &keys, chunk[0]).await }
        })
        .await;

        let (redis_before, client_before) =
            (process_ticks(pid).expect("redis ticks"), self_ticks());
        let started = Instant::now();
        let (f, k) = (Rc::clone(&functions), Rc::clone(&keys));
        in_flight(&ids, batch, move |chunk| {
            let (functions, keys) = (Rc::clone(&f), Rc::clone(&k));
            async move { mark(&functions, &keys, chunk).await }
        })
        .await;
        let wall_s = started.elapsed().as_secs_f64();
        let redis_ticks = process_ticks(pid).expect("redis ticks") - redis_before;
        let client_ticks = self_ticks() - client_before;
        let per_mark = |ticks: u64| (ticks * US_PER_TICK) as f64 / marks as f64;
        Sample {
            redis_us_per_mark: per_mark(redis_ticks),
            client_us_per_mark: per_mark(client_ticks),
            wall_s,
        }
    })
}

/// Runs `call` over `ids` in chunks of `chunk`, [`IN_FLIGHT`] calls at once.
async fn in_flight<F, Fut>(ids: &Rc<Vec<u64>>, chunk: usize, call: F)
where
    F: Fn(Vec<u64>) -> Fut + Clone + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    let chunks: Rc<Vec<Vec<u64>>> = Rc::new(ids.chunks(chunk).map(<[u64]>::to_vec).collect());
    let next = Rc::new(std::cell::Cell::new(0usize));
    let tasks: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (chunks, next, call) = (Rc::clone(&chunks), Rc::clone(&next), call.clone());
            glommio::spawn_local(async move {
                loop {
                    let i = next.get();
                    let Some(chunk) = chunks.get(i) else { break };
                    next.set(i + 1);
                    call(chunk.clone()).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await;
    }
}

async fn mark(functions: &Functions, keys: &SkuKeys, ns: Vec<u64>) {
    let ids: Vec<(String, String, u64)> =
        ns.iter().map(|n| (format!("resv_{n}"), format!("req_{n}"), *n)).collect();
    let marks: Vec<MarkSent<'_>> = ids
        .iter()
        .map(|(reservation_id, request_id, user_id)| MarkSent {
            reservation_id,
            request_id,
            user_id: *user_id,
        })
        .collect();
    let args = MarkSentArgs { marks: &marks, now_ms: T0 + 20, order_deadline_ms: 60_000 };
    let replies = functions.mark_sent(keys, &args).await.expect("mark_sent");
    assert!(replies.iter().all(|r| *r == MarkSentReply::Ok), "{replies:?}");
}
