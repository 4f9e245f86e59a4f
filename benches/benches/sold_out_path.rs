//! The whole sold-out path per request on one core (DESIGN.md section 10): after sell-out a
//! request costs one HTTP parse, one HMAC, one body parse, one flag read and one small
//! response, on the core that received it. This bench runs exactly those steps in the order
//! the shard runs them (minus the socket syscalls, the rate limiters and the counters), for a
//! new request and for a replay. The steps are `flashsale_benches::submit_path`'s, shared with
//! the `owner_path` bench, which also prices this path's thread CPU beside the owner's.

use bytes::BytesMut;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use flashsale_benches::submit_path::{pass, pass_keys, request, sold_out_path, sold_out_replica};
use flashsale_engine::logic::clock::now_ms;

fn bench(c: &mut Criterion) {
    let keys = pass_keys();
    // A sold-out SKU whose replica knows 10,000 accepted requests, req-0 among them buyer
    // 30001's.
    let replica = sold_out_replica(30001);
    let pass = pass(&keys, 30001, now_ms() / 1000);
    let new_request = request(&pass, "req-new-01J0000000000000");
    let replay = request(&pass, "req-0");
    let mut out = BytesMut::with_capacity(4096);
    assert!(sold_out_path(&new_request, &keys, &replica, now_ms(), &mut out) > 0);
    assert!(String::from_utf8_lossy(&out).contains("SOLD_OUT"));
    sold_out_path(&replay, &keys, &replica, now_ms(), &mut out);
    assert!(String::from_utf8_lossy(&out).contains("\"replayed\":true"));

    let mut group = c.benchmark_group("sold_out_path");
    group.bench_function("new_request", |b| {
        b.iter(|| sold_out_path(black_box(&new_request), &keys, &replica, now_ms(), &mut out))
    });
    group.bench_function("replay", |b| {
        b.iter(|| sold_out_path(black_box(&replay), &keys, &replica, now_ms(), &mut out))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
