//! The submit path's steps as a shard runs them, shared by the benches that price a whole
//! request on one core: `sold_out_path` (the path after sell-out, answered from the replica)
//! and `owner_path` (the path before it, through the owner and Redis), so that both run the
//! same engine code up to where they part and from where they join again.
//!
//! The order is the shard's (`engine/src/shard/routes.rs` and `shard/submit.rs`): HTTP parse,
//! the body taken from the input buffer, pass verify (HMAC), body parse, the pass's activity,
//! the payload hash, the SKU replica's fast path ([`front`]); then either the replica's answer
//! ([`sold_out_path`]) or the owner's, and the state answer written into the connection's
//! buffer ([`write_answer`]). Socket syscalls are not here.
//!
//! Deliberately left out of both paths, as equal costs that would only lower the owner/sold-out
//! ratio: the address and buyer rate limiters (`shard/limiters.rs`), the per-shard counters
//! (relaxed atomic adds) and the SKU funnel's count.
//!
//! Read next: `benches/benches/sold_out_path.rs`, `benches/benches/owner_path.rs`.

use std::sync::Arc;

use bytes::BytesMut;
use flashsale_engine::http::{parse_request, Parsed, Request, ResponseHead};
use flashsale_engine::logic::api::{self, PayloadHash};
use flashsale_engine::logic::auth::PassKeys;
use flashsale_engine::logic::ids::{ActivityId, SkuId, UserId};
use flashsale_engine::logic::outcome::SubmitOutcome;
use flashsale_engine::logic::partition::{
    Accepted, AcceptedMap, AcceptedState, FastPath, ReplicaUpdate, SkuReplica,
};
use flashsale_engine::logic::placement::SkuKey;
use flashsale_engine::logic::submit::SubmitAnswer;
use flashsale_engine::shard::reply::write_state;
use flashsale_engine::shard::submit::answer_body;

/// The benches' activity and SKU.
pub const ACTIVITY_ID: u64 = 10001;
pub const SKU_ID: u64 = 20001;

/// The benches' pass key (`kid:secret`).
const PASS_KEYS: &str = "k1:0123456789abcdef0123456789abcdef";

/// A pass's lifetime from when it is minted: far less than a day (the longest `verify`
/// accepts), far more than a bench run.
const PASS_LIFETIME_S: u64 = 3_600;

/// The response's `x-request-id` when the request carried none (the shard generates one of
/// this shape, `fs-<shard>-<seq>`).
const GENERATED_REQUEST_ID: &str = "fs-0-1";

pub fn pass_keys() -> PassKeys {
    PassKeys::parse(PASS_KEYS).expect("bench pass keys")
}

/// Buyer `user_id`'s pass for the benches' activity, valid for an hour from `now_unix_s`.
pub fn pass(keys: &PassKeys, user_id: u64, now_unix_s: u64) -> String {
    let exp_unix_s = now_unix_s + PASS_LIFETIME_S;
    keys.mint("k1", UserId(user_id), ActivityId(ACTIVITY_ID), exp_unix_s).expect("mint a pass")
}

/// `POST /v1/reservations` for one unit of the benches' SKU, as a browser-like client sends it.
pub fn request(pass: &str, request_id: &str) -> Vec<u8> {
    let body = format!(
        r#"{{"activity_id":{ACTIVITY_ID},"sku_id":{SKU_ID},"request_id":"{request_id}","quantity":1}}"#
    );
    format!(
        "POST /v1/reservations HTTP/1.1\r\nHost: edge.example\r\nAuthorization: Bearer {pass}\r\n\
         Content-Type: application/json\r\nUser-Agent: bench/1.0\r\nAccept: */*\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Requests of buyers `users` (one each: a new buyer and a new request id `req-<user>`), their
/// passes minted now; minted before a timed loop, so their cost is not in it.
pub fn buyers(keys: &PassKeys, users: std::ops::Range<u64>, now_unix_s: u64) -> Vec<Vec<u8>> {
    users.map(|user| request(&pass(keys, user, now_unix_s), &format!("req-{user}"))).collect()
}

/// The complete request in `raw` (the benches only feed valid ones).
pub fn parse(raw: &[u8]) -> Request<'_> {
    match parse_request(raw, &Default::default()) {
        Parsed::Complete { request, .. } => request,
        other => panic!("a bench request did not parse: {other:?}"),
    }
}

/// What the shard knows of a submit once the replica has spoken.
pub struct Front<'b> {
    pub submit: api::SubmitRequest<'b>,
    pub user_id: UserId,
    pub payload_hash: PayloadHash,
    pub key: SkuKey,
    pub fast: FastPath,
}

/// `shard::submit::submit` and `submit_checked` up to the fast path: pass, body, the pass's
/// activity, the payload hash, the replica (`body` is the request's, taken as the router
/// takes it). Panics on anything but a valid request: the benches price the success paths.
pub fn front<'b>(
    request: &Request<'_>,
    body: &'b [u8],
    keys: &PassKeys,
    replica: &SkuReplica,
    now_ms: u64,
) -> Front<'b> {
    let authorization = request.authorization.expect("a pass");
    let pass = keys.verify(authorization.as_bytes(), now_ms / 1000).expect("a valid pass");
    let submit = api::parse_submit(body).expect("a valid body");
    assert!(pass.authorizes(submit.activity_id), "the pass is for the SKU's activity");
    let key = SkuKey::new(submit.activity_id.0, submit.sku_id.0);
    let payload_hash = submit.payload_hash(pass.user_id);
    let fast = replica.fast_path(pass.user_id.0, submit.request_id.as_str(), &payload_hash);
    Front { submit, user_id: pass.user_id, payload_hash, key, fast }
}

/// `shard::submit::handle_submit`'s answer and `routes.rs`'s head: status, state body, into
/// `out` (through the shard's JSON scratch, `shard::reply::write_state`).
pub fn write_answer(
    out: &mut BytesMut,
    request: &Request<'_>,
    body_request_id: Option<&str>,
    answer: &SubmitAnswer,
) {
    let (status, body) = answer_body(answer, body_request_id);
    let mut head = ResponseHead::new(status, request.x_request_id.unwrap_or(GENERATED_REQUEST_ID));
    head.traceparent = request.traceparent;
    head.retry_after_ms = answer.retry_after_ms;
    write_state(out, &head, &body);
}

/// The whole sold-out path (DESIGN.md section 10) for the request in `raw`, into `out`;
/// returns the bytes written. `now_ms` is read by the caller (the shard reads the clock once
/// per request).
pub fn sold_out_path(
    raw: &[u8],
    keys: &PassKeys,
    replica: &SkuReplica,
    now_ms: u64,
    out: &mut BytesMut,
) -> usize {
    out.clear();
    let request = parse(raw);
    // A Content-Length body is a slice of the input; `chunked` stays unallocated.
    let mut chunked = Vec::new();
    let body = request.body.bytes(&mut chunked);
    let front = front(&request, body, keys, replica, now_ms);
    let answer = match front.fast {
        FastPath::SoldOut => SubmitAnswer::of(SubmitOutcome::SoldOut),
        FastPath::Replay(entry) => SubmitAnswer::replay(&entry),
        other => unreachable!("a sold-out SKU's replica answers, got {other:?}"),
    };
    write_answer(out, &request, Some(front.submit.request_id.as_str()), &answer);
    out.len()
}

/// The replica of a sold-out SKU in its steady state after sell-out: its request records
/// loaded, 10,000 accepted requests. Buyer `replay_user` holds request `req-0` (its payload
/// hash that of one unit of the benches' SKU); buyers 100,001.. hold one request each.
pub fn sold_out_replica(replay_user: u64) -> SkuReplica {
    let replay_hash =
        api::payload_hash(ActivityId(ACTIVITY_ID), SkuId(SKU_ID), UserId(replay_user), 1);
    let mut accepted = AcceptedMap::new();
    for i in 0..10_000u64 {
        let (user, hash): (u64, Arc<str>) = match i {
            0 => (replay_user, Arc::from(replay_hash.as_str())),
            _ => (100_000 + i, Arc::from("x")),
        };
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
        key: SkuKey::new(ACTIVITY_ID, SKU_ID),
        revision: 1,
        sold_out: true,
        replays_complete: true,
        accepted: Arc::new(accepted),
    });
    replica
}
