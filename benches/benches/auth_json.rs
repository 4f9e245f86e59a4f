//! Per-request CPU costs of the edge before any I/O: user-pass verification, submit-body
//! parsing, the payload hash and business-id generation (`engine::{auth, api, ids}`).
//!
//! The pairs measured side by side decide implementation choices, so compare them within one
//! run (runs drift 20–50% on the shared 2-core machines, FIELD-NOTES.md):
//! - `hmac/prepared_clone` vs `hmac/rekey`: keep a keyed HMAC state per pass key and clone it,
//!   or derive the key pads on every verification.
//! - `submit_parse/serde_json/*` vs `submit_parse/simd_json*/*`: the JSON backend of
//!   `api::parse_submit`, on the real ~90-byte body and a 4 KiB one (same validation: both
//!   drive `api::SubmitFields`). simd-json parses in place, so its figure includes copying the
//!   body into a reused scratch buffer, as the engine would have to.
//! - `ids/engine_encoder` vs `ids/ulid_crate_encoder`: the hand-written ULID text encoder vs
//!   the `ulid` crate's (both allocation-free).
//!
//! Run: `cargo bench -p flashsale-benches --bench auth_json -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flashsale_engine::logic::api::{parse_submit, payload_hash, SubmitFields};
use flashsale_engine::logic::auth::PassKeys;
use flashsale_engine::logic::ids::{
    encode_ulid, ActivityId, IdGenerator, IdKind, SkuId, UserId, ULID_LEN,
};
use hmac::{Hmac, Mac};
use sha2::Sha256;

const KEY_HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
const NOW_S: u64 = 1_750_000_000;

/// The body a real client sends (about 90 bytes).
const BODY: &[u8] =
    br#"{"activity_id":10001,"sku_id":20001,"request_id":"req_01J0Z3Q8YB3W5M2N7K4T9R6P1C","quantity":1}"#;

/// A body at the 4 KiB limit: the real fields plus an unknown field padding it out.
fn body_4k() -> Vec<u8> {
    let head = br#"{"activity_id":10001,"sku_id":20001,"request_id":"req_01J0Z3Q8YB3W5M2N7K4T9R6P1C","quantity":1,"note":""#;
    let mut body = head.to_vec();
    body.resize(4096 - 2, b'x');
    body.extend_from_slice(b"\"}");
    body
}

fn pass_verify(c: &mut Criterion) {
    let keys = PassKeys::parse(&format!("old:{KEY_HEX},new:{}", &KEY_HEX[..32].repeat(2)))
        .expect("bench keys parse");
    let pass = keys.mint("new", UserId(30001), ActivityId(10001), NOW_S + 600).expect("known kid");
    let header = format!("Bearer {pass}").into_bytes();
    assert!(keys.verify(&header, NOW_S).is_ok());
    c.bench_function("pass/verify", |b| b.iter(|| keys.verify(black_box(&header), NOW_S)));

    let mut forged = header.clone();
    let at = forged.len() - 2;
    forged[at] = if forged[at] == b'A' { b'B' } else { b'A' };
    assert!(keys.verify(&forged, NOW_S).is_err());
    c.bench_function("pass/verify_bad_signature", |b| {
        b.iter(|| keys.verify(black_box(&forged), NOW_S))
    });

    // The two ways to key HMAC-SHA256, on the message a pass signs.
    let key = [0x5au8; 32];
    let message = pass.rsplit_once('.').map(|(message, _)| message).unwrap_or_default();
    let tag = {
        let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("any key length");
        mac.update(message.as_bytes());
        mac.finalize().into_bytes()
    };
    let prepared = Hmac::<Sha256>::new_from_slice(&key).expect("any key length");
    let mut group = c.benchmark_group("hmac");
    group.bench_function("prepared_clone", |b| {
        b.iter(|| {
            let mut mac = prepared.clone();
            mac.update(black_box(message.as_bytes()));
            mac.verify_slice(black_box(&tag)).is_ok()
        })
    });
    group.bench_function("rekey", |b| {
        b.iter(|| {
            let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(black_box(&key)) else {
                return false;
            };
            mac.update(black_box(message.as_bytes()));
            mac.verify_slice(black_box(&tag)).is_ok()
        })
    });
    group.finish();
}

fn submit_parse(c: &mut Criterion) {
    let big = body_4k();
    assert_eq!(big.len(), 4096);
    let mut group = c.benchmark_group("submit_parse");
    for (name, body) in [("90B", BODY), ("4KiB", big.as_slice())] {
        assert!(parse_submit(body).is_ok(), "{name} body must be valid");
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::new("serde_json", name), body, |b, body| {
            b.iter(|| parse_submit(black_box(body)).map(|request| request.activity_id))
        });

        // simd-json with its buffers reused across calls (its best case).
        let mut scratch = Vec::with_capacity(body.len());
        let mut buffers = simd_json::Buffers::new(body.len());
        group.bench_with_input(BenchmarkId::new("simd_json_buffers", name), body, |b, body| {
            b.iter(|| {
                scratch.clear();
                scratch.extend_from_slice(black_box(body));
                simd_json::serde::from_slice_with_buffers::<SubmitFields<'_>>(
                    &mut scratch,
                    &mut buffers,
                )
                .ok()
                .and_then(|fields| fields.validate().ok())
                .map(|request| request.activity_id)
            })
        });

        // simd-json as usually called (fresh buffers per call).
        let mut scratch = Vec::with_capacity(body.len());
        group.bench_with_input(BenchmarkId::new("simd_json", name), body, |b, body| {
            b.iter(|| {
                scratch.clear();
                scratch.extend_from_slice(black_box(body));
                simd_json::serde::from_slice::<SubmitFields<'_>>(&mut scratch)
                    .ok()
                    .and_then(|fields| fields.validate().ok())
                    .map(|request| request.activity_id)
            })
        });
    }
    group.finish();
}

fn hashing(c: &mut Criterion) {
    c.bench_function("payload_hash", |b| {
        b.iter(|| {
            payload_hash(
                black_box(ActivityId(10001)),
                black_box(SkuId(20001)),
                black_box(UserId(30001)),
                black_box(1),
            )
        })
    });
}

fn ids(c: &mut Criterion) {
    let mut group = c.benchmark_group("ids");
    let mut generator = IdGenerator::new([42; 32]);
    let mut now_ms = 1_750_000_000_000u64;
    // A new millisecond every 64 ids: mostly the increment path, with fresh randomness
    // often enough to count.
    let mut count = 0u64;
    group.bench_function("next_resv", |b| {
        b.iter(|| {
            count += 1;
            if count.is_multiple_of(64) {
                now_ms += 1;
            }
            generator.next(IdKind::Reservation, black_box(now_ms))
        })
    });
    let mut fresh = IdGenerator::new([43; 32]);
    let mut tick_ms = 1_750_000_000_000u64;
    group.bench_function("next_resv_new_ms_each", |b| {
        b.iter(|| {
            tick_ms += 1;
            fresh.next(IdKind::Reservation, black_box(tick_ms))
        })
    });
    let value = IdGenerator::new([44; 32]).next_ulid(1_750_000_000_000);
    group.bench_function("engine_encoder", |b| {
        b.iter(|| {
            let mut out = [0u8; ULID_LEN];
            encode_ulid(black_box(value), &mut out);
            out
        })
    });
    group.bench_function("ulid_crate_encoder", |b| {
        b.iter(|| {
            let mut out = [0u8; ulid::ULID_LEN];
            ulid::Ulid(black_box(value)).array_to_str(&mut out);
            out
        })
    });
    // The x-request-id of an answer to a request that carried none: the former format!
    // (one allocation per answer) against the stack-built id the shard uses now.
    let mut seq = 1_000_000u64;
    group.bench_function("request_id_format", |b| {
        b.iter(|| {
            seq += 1;
            let id = format!("fs-{}-{}-{}", black_box("1234abcd"), black_box(1usize), seq);
            black_box(id.len())
        })
    });
    let instance = flashsale_engine::logic::ids::InstanceId::from_random(0x1234_abcd);
    group.bench_function("request_id_stack", |b| {
        b.iter(|| {
            seq += 1;
            let id = flashsale_engine::logic::ids::GeneratedRequestId::new(
                black_box(&instance),
                black_box(1),
                seq,
            );
            black_box(id.len())
        })
    });
    group.finish();
}

criterion_group!(benches, pass_verify, submit_parse, hashing, ids);
criterion_main!(benches);
