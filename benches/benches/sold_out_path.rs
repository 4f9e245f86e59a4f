//! The whole sold-out path per request on one core (DESIGN.md section 10): after sell-out a
//! request costs one HTTP parse, one HMAC, one body parse, one flag read and one small
//! response, on the core that received it. This bench runs exactly those steps in the order
//! the shard runs them (minus the socket syscalls), for a new request and for a replay.

use std::sync::Arc;

use bytes::BytesMut;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use flashsale_engine::http::{
    parse_request, write_response, Parsed, ResponseHead, StateBody, Status,
};
use flashsale_engine::logic::api;
use flashsale_engine::logic::auth::PassKeys;
use flashsale_engine::logic::ids::{ActivityId, UserId};
use flashsale_engine::logic::outcome::SubmitOutcome;
use flashsale_engine::logic::partition::{
    Accepted, AcceptedMap, AcceptedState, FastPath, ReplicaUpdate, SkuReplica,
};
use flashsale_engine::logic::placement::SkuKey;

fn request(pass: &str, request_id: &str) -> Vec<u8> {
    let body = format!(
        r#"{{"activity_id":10001,"sku_id":20001,"request_id":"{request_id}","quantity":1}}"#
    );
    format!(
        "POST /v1/reservations HTTP/1.1\r\nHost: edge.example\r\nAuthorization: Bearer {pass}\r\n\
         Content-Type: application/json\r\nUser-Agent: bench/1.0\r\nAccept: */*\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The sold-out path as the shard runs it; returns the bytes written.
fn sold_out_path(
    raw: &[u8],
    keys: &PassKeys,
    replica: &SkuReplica,
    out: &mut BytesMut,
    json: &mut BytesMut,
) -> usize {
    out.clear();
    json.clear();
    let Parsed::Complete { request, .. } = parse_request(raw, &Default::default()) else {
        unreachable!("valid request")
    };
    let pass = keys.verify(request.authorization.unwrap_or("").as_bytes(), 1_800_000_000).ok();
    let pass = pass.expect("valid pass");
    let mut scratch = Vec::new();
    let body = request.body.bytes(&mut scratch);
    let submit = api::parse_submit(body).expect("valid body");
    assert!(pass.authorizes(submit.activity_id));
    let hash = submit.payload_hash(pass.user_id);
    let (outcome, reservation_id, replayed) =
        match replica.fast_path(pass.user_id.0, submit.request_id.as_str(), &hash) {
            FastPath::SoldOut => (SubmitOutcome::SoldOut, None, false),
            FastPath::Replay(entry) => (SubmitOutcome::Queued, Some(entry.reservation_id), true),
            other => unreachable!("{other:?}"),
        };
    let (code, state) = outcome.http();
    StateBody {
        request_id: Some(submit.request_id.as_str()),
        state,
        reservation_id: reservation_id.as_deref(),
        replayed,
        ..Default::default()
    }
    .write_json(json);
    let request_id = request.x_request_id.unwrap_or("fs-0-1");
    let head = ResponseHead::new(Status::from_code(code).expect("status"), request_id);
    write_response(out, &head, json);
    out.len()
}

fn bench(c: &mut Criterion) {
    let keys = PassKeys::parse("k1:0123456789abcdef0123456789abcdef").expect("keys");
    let pass = keys.mint("k1", UserId(30001), ActivityId(10001), 1_800_000_600).expect("mint");
    // A sold-out SKU whose replica knows 10,000 accepted requests.
    let replay_hash = api::payload_hash(
        ActivityId(10001),
        flashsale_engine::logic::ids::SkuId(20001),
        UserId(30001),
        1,
    );
    let mut accepted = AcceptedMap::new();
    for i in 0..10_000 {
        let hash: Arc<str> = if i == 0 { Arc::from(replay_hash.as_str()) } else { Arc::from("x") };
        // Buyer 30001 holds req-0; 9,999 other buyers hold one request each.
        let user = if i == 0 { 30001 } else { 100_000 + i };
        accepted.insert(
            user,
            Accepted {
                request_id: Arc::from(format!("req-{i}")),
                reservation_id: Arc::from(format!("resv_{i:026}")),
                message_id: Arc::from(format!("msg_{i:026}")),
                payload_hash: hash,
                state: AcceptedState::Queued,
            },
        );
    }
    let mut replica = SkuReplica::default();
    replica.apply(&ReplicaUpdate {
        key: SkuKey::new(10001, 20001),
        revision: 1,
        sold_out: true,
        // The steady state after sell-out: the SKU's request records are loaded.
        replays_complete: true,
        accepted: Arc::new(accepted),
    });
    let new_request = request(&pass, "req-new-01J0000000000000");
    let replay = request(&pass, "req-0");
    let mut out = BytesMut::with_capacity(4096);
    // Reused like the shard's JSON scratch.
    let mut json = BytesMut::with_capacity(512);
    assert!(sold_out_path(&new_request, &keys, &replica, &mut out, &mut json) > 0);
    assert!(String::from_utf8_lossy(&out).contains("SOLD_OUT"));
    sold_out_path(&replay, &keys, &replica, &mut out, &mut json);
    assert!(String::from_utf8_lossy(&out).contains("\"replayed\":true"));

    let mut group = c.benchmark_group("sold_out_path");
    group.bench_function("new_request", |b| {
        b.iter(|| sold_out_path(black_box(&new_request), &keys, &replica, &mut out, &mut json))
    });
    group.bench_function("replay", |b| {
        b.iter(|| sold_out_path(black_box(&replay), &keys, &replica, &mut out, &mut json))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
