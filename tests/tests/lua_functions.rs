//! The `seckill` Redis Functions library (`lua/seckill.lua`), branch by branch, against a real
//! private redis-server, through its Rust binding (`flashsale_io::redis::script`).
//!
//! Each test starts its own Redis (so keys never leak between tests), calls the functions
//! through [`Functions`], and then reads the raw keys back to check exactly what was written
//! and what was not. Key names are spelled out here with `format!` rather than taken from
//! [`SkuKeys`], so a binding that built the wrong names would fail these tests too.
//!
//! Not here: the 10,000-buyer concurrency test (`reserve_concurrency.rs`).

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use flashsale_io::redis::layout::{ActivityStatus, PendingStatus};
use flashsale_io::redis::script::{
    load_library, ActivityInvalidReason, ApplyResultArgs, ApplyResultReply, ClaimDueArgs,
    ClaimDueReply, CompensateArgs, CompensateReply, FinalOutcome, Functions, MarkSent,
    MarkSentArgs, MarkSentReply, PreheatArgs, PreheatReply, RequestState, ReserveArgs,
    ReserveReply, RestoreLock, RestoreMeta, RestoreReply, RestoreReservation, RestoreStep,
    ScriptError, SkuKeys, TopUpArgs, TopUpReply, MARK_SENT_MAX,
};
use flashsale_io::redis::{RedisClient, RedisConfig};
use flashsale_io::resp::Reply;

const A: u64 = 10001;
const S: u64 = 20001;
const T0: u64 = 1_750_000_000_000;
const WINDOW_MS: u64 = 3_600_000;
const TTL_MS: u64 = 300_000;
const GRACE_MS: u64 = 2_000;

fn key(suffix: &str) -> String {
    format!("seckill:{{{A}:{S}}}:{suffix}")
}

/// Runs `test` on a glommio executor against a fresh private Redis.
fn with_redis<F, Fut>(test: F)
where
    F: FnOnce(Functions) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    let redis = flashsale_tests::redis();
    let addr = redis.addr();
    flashsale_tests::glommio(move || async move {
        let client = connect(addr).await;
        test(Functions::new(client)).await;
    });
    drop(redis);
}

async fn connect(addr: std::net::SocketAddr) -> RedisClient {
    RedisClient::connect(RedisConfig::new(addr)).await.expect("connect to the private redis")
}

// ---- raw reads -------------------------------------------------------------------------------

async fn cmd(f: &Functions, args: &[&str]) -> Reply {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    f.client().command(&args).await.expect("redis command")
}

async fn get(f: &Functions, k: &str) -> Option<String> {
    match cmd(f, &["GET", k]).await {
        Reply::Nil => None,
        r => Some(r.as_str().expect("GET string").to_owned()),
    }
}

async fn exists(f: &Functions, k: &str) -> bool {
    cmd(f, &["EXISTS", k]).await.as_int() == Some(1)
}

async fn hgetall(f: &Functions, k: &str) -> HashMap<String, String> {
    let items = cmd(f, &["HGETALL", k]).await.into_array().expect("HGETALL array");
    items
        .chunks_exact(2)
        .map(|kv| (kv[0].as_str().unwrap().to_owned(), kv[1].as_str().unwrap().to_owned()))
        .collect()
}

async fn zscore(f: &Functions, k: &str, member: &str) -> Option<u64> {
    match cmd(f, &["ZSCORE", k, member]).await {
        Reply::Nil => None,
        r => Some(r.as_str().unwrap().parse().unwrap()),
    }
}

async fn zcard(f: &Functions, k: &str) -> i64 {
    cmd(f, &["ZCARD", k]).await.as_int().unwrap()
}

async fn stock(f: &Functions) -> Option<i64> {
    get(f, &key("stock")).await.map(|s| s.parse().unwrap())
}

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

// ---- calls -----------------------------------------------------------------------------------

fn keys() -> SkuKeys {
    SkuKeys::new(A, S)
}

async fn preheat(f: &Functions, status: ActivityStatus, version: u64, stock: u64) -> PreheatReply {
    let args = PreheatArgs {
        status,
        start_ms: T0,
        end_ms: T0 + WINDOW_MS,
        version,
        reservation_ttl_ms: TTL_MS,
        stock,
        max_per_buyer: 1,
    };
    f.preheat(&keys(), &args).await.expect("preheat")
}

/// Ids derived from one number, so a test can say "request 3" and know every id.
struct Ids {
    request_id: String,
    reservation_id: String,
    message_id: String,
}

fn ids(n: u64) -> Ids {
    Ids {
        request_id: format!("req_{n}"),
        reservation_id: format!("resv_{n}"),
        message_id: format!("msg_{n}"),
    }
}

async fn reserve_as(
    f: &Functions,
    ids: &Ids,
    user_id: u64,
    payload_hash: &str,
    now_ms: u64,
) -> ReserveReply {
    let args = ReserveArgs {
        request_id: &ids.request_id,
        user_id,
        payload_hash,
        reservation_id: &ids.reservation_id,
        message_id: &ids.message_id,
        now_ms,
        pending_grace_ms: GRACE_MS,
        quantity: 1,
    };
    f.reserve(&keys(), &args).await.expect("reserve")
}

/// `reserve`'s CREATED reply for a call at `now_ms` (the SKU's TTL is [`TTL_MS`]).
fn created(stock_after: u64, now_ms: u64) -> ReserveReply {
    ReserveReply::Created { stock_after, expires_at_ms: now_ms + TTL_MS }
}

/// Request n by user 30000+n with payload "h", at T0 + 10 ms.
async fn reserve_n(f: &Functions, n: u64) -> ReserveReply {
    reserve_as(f, &ids(n), 30000 + n, "h", T0 + 10).await
}

async fn mark_sent(f: &Functions, n: u64, now_ms: u64, order_deadline_ms: u64) -> MarkSentReply {
    let replies = mark_sent_batch(f, &[n], now_ms, order_deadline_ms).await;
    assert_eq!(replies.len(), 1, "one reply per reservation");
    replies[0]
}

/// One `mark_sent` call for the reservations of requests `ns` (users 30000 + n).
async fn mark_sent_batch(
    f: &Functions,
    ns: &[u64],
    now_ms: u64,
    order_deadline_ms: u64,
) -> Vec<MarkSentReply> {
    let ids: Vec<Ids> = ns.iter().map(|&n| ids(n)).collect();
    let marks: Vec<MarkSent<'_>> = ids
        .iter()
        .zip(ns)
        .map(|(ids, &n)| MarkSent {
            reservation_id: &ids.reservation_id,
            request_id: &ids.request_id,
            user_id: 30000 + n,
        })
        .collect();
    let args = MarkSentArgs { marks: &marks, now_ms, order_deadline_ms };
    f.mark_sent(&keys(), &args).await.expect("mark_sent")
}

async fn apply(f: &Functions, n: u64, outcome: FinalOutcome<'_>, now_ms: u64) -> ApplyResultReply {
    let ids = ids(n);
    let args = ApplyResultArgs {
        request_id: &ids.request_id,
        reservation_id: &ids.reservation_id,
        outcome,
        now_ms,
        payload_hash: "h",
        message_id: &ids.message_id,
        user_id: 30000 + n,
    };
    f.apply_result(&keys(), &args).await.expect("apply_result")
}

async fn compensate(
    f: &Functions,
    n: u64,
    return_stock: bool,
    release_user: bool,
    reason_code: &str,
) -> CompensateReply {
    let ids = ids(n);
    let args = CompensateArgs {
        reservation_id: &ids.reservation_id,
        request_id: &ids.request_id,
        user_id: 30000 + n,
        return_stock,
        release_user,
        reason_code,
        now_ms: T0 + 50_000,
        units: 1,
    };
    f.compensate(&keys(), &args).await.expect("compensate")
}

const BACKOFF_BASE_MS: u64 = 1_000;
const BACKOFF_MAX_MS: u64 = 8_000;
const RECOVERY_DEADLINE_MS: u64 = 600_000;

async fn claim(f: &Functions, now_ms: u64, batch_max: u32) -> Result<ClaimDueReply, ScriptError> {
    let args = ClaimDueArgs {
        now_ms,
        batch_max,
        backoff_base_ms: BACKOFF_BASE_MS,
        backoff_max_ms: BACKOFF_MAX_MS,
        recovery_deadline_ms: RECOVERY_DEADLINE_MS,
    };
    f.claim_due(&keys(), &args).await
}

fn assert_bad_arg<T: std::fmt::Debug>(r: Result<T, ScriptError>, arg: &str) {
    match r {
        Err(e @ ScriptError::Refused(_)) => {
            assert!(e.is_refusal(), "a validation reply is a refusal, never a node failure");
            assert_eq!(e.to_string(), format!("refused by the seckill library: bad {arg}"));
        }
        other => panic!("expected `bad {arg}`, got {other:?}"),
    }
}

// ---- reserve ---------------------------------------------------------------------------------

#[test]
fn reserve_created_writes_every_key() {
    with_redis(|f| async move {
        assert_eq!(
            preheat(&f, ActivityStatus::Active, 1, 10).await,
            PreheatReply::Applied { version: 1 }
        );
        let now = T0 + 1_234;
        let reply = reserve_as(&f, &ids(1), 30001, "sha256:aa", now).await;
        assert_eq!(reply, ReserveReply::Created { stock_after: 9, expires_at_ms: now + TTL_MS });

        assert_eq!(stock(&f).await, Some(9));
        assert_eq!(get(&f, &key("user:30001")).await.as_deref(), Some("resv_1"));
        assert_eq!(
            hgetall(&f, &key("req:30001:req_1")).await,
            map(&[
                ("payload_hash", "sha256:aa"),
                ("reservation_id", "resv_1"),
                ("message_id", "msg_1"),
                ("state", "QUEUED_PENDING"),
                ("order_id", ""),
                ("reason_code", ""),
                ("user_id", "30001"),
            ])
        );
        let expires_at = (now + TTL_MS).to_string();
        let next_retry_at = (now + GRACE_MS).to_string();
        assert_eq!(
            hgetall(&f, &key("resv:resv_1")).await,
            map(&[
                ("reservation_id", "resv_1"),
                ("message_id", "msg_1"),
                ("request_id", "req_1"),
                ("user_id", "30001"),
                ("status", "PENDING_MESSAGE"),
                ("payload_hash", "sha256:aa"),
                ("reserved_at", &now.to_string()),
                ("expires_at", &expires_at),
                ("send_attempts", "0"),
                ("next_retry_at", &next_retry_at),
                ("last_error_code", ""),
                ("quantity", "1"),
            ])
        );
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, Some(now + GRACE_MS));
        assert_eq!(zcard(&f, &key("resv:pending")).await, 1);
        assert!(!exists(&f, &key("soldout")).await, "9 left is not sold out");
    });
}

#[test]
fn reserve_replay_is_idempotent_and_other_payload_conflicts() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 1).await;
        assert_eq!(reserve_n(&f, 1).await, created(0, T0 + 10));

        // Replay with the same ids: the first result.
        let expected = ReserveReply::Idempotent {
            reservation_id: "resv_1".into(),
            message_id: "msg_1".into(),
            state: RequestState::QueuedPending,
            order_id: None,
            reason_code: None,
        };
        assert_eq!(reserve_n(&f, 1).await, expected);
        // A retry that minted new reservation/message ids still gets the FIRST ids back, even
        // though the SKU is sold out now and the activity has ended (idempotency comes first).
        let retry = Ids { request_id: "req_1".into(), ..ids(99) };
        assert_eq!(reserve_as(&f, &retry, 30001, "h", T0 + WINDOW_MS + 5).await, expected);

        // Same request id, different payload.
        assert_eq!(
            reserve_as(&f, &ids(1), 30001, "other", T0 + 20).await,
            ReserveReply::IdempotencyConflict
        );
        // Nothing written by the replays or the conflict.
        assert_eq!(stock(&f).await, Some(0));
        assert!(!exists(&f, &key("resv:resv_99")).await);
        assert_eq!(zcard(&f, &key("resv:pending")).await, 1);
        assert_eq!(hgetall(&f, &key("req:30001:req_1")).await["payload_hash"], "h");

        // The replay reports the state the request reached.
        assert_eq!(mark_sent(&f, 1, T0 + 30, 60_000).await, MarkSentReply::Ok);
        assert_eq!(
            apply(&f, 1, FinalOutcome::OrderCreated { order_id: "ord_1" }, T0 + 40).await,
            ApplyResultReply::Applied
        );
        assert_eq!(
            reserve_n(&f, 1).await,
            ReserveReply::Idempotent {
                reservation_id: "resv_1".into(),
                message_id: "msg_1".into(),
                state: RequestState::Succeeded,
                order_id: Some("ord_1".into()),
                reason_code: None,
            }
        );
    });
}

#[test]
fn reserve_activity_invalid_branches_write_nothing() {
    with_redis(|f| async move {
        // No meta at all.
        assert_eq!(
            reserve_n(&f, 1).await,
            ReserveReply::ActivityInvalid { reason: ActivityInvalidReason::Unknown }
        );

        preheat(&f, ActivityStatus::Pending, 1, 10).await;
        assert_eq!(
            reserve_n(&f, 1).await,
            ReserveReply::ActivityInvalid { reason: ActivityInvalidReason::Pending }
        );

        preheat(&f, ActivityStatus::Active, 2, 10).await;
        let before = reserve_as(&f, &ids(1), 30001, "h", T0 - 1).await;
        assert_eq!(
            before,
            ReserveReply::ActivityInvalid { reason: ActivityInvalidReason::NotStarted }
        );
        // end_ms is exclusive.
        let at_end = reserve_as(&f, &ids(1), 30001, "h", T0 + WINDOW_MS).await;
        assert_eq!(at_end, ReserveReply::ActivityInvalid { reason: ActivityInvalidReason::Ended });
        let after = reserve_as(&f, &ids(1), 30001, "h", T0 + WINDOW_MS + 1).await;
        assert_eq!(after, ReserveReply::ActivityInvalid { reason: ActivityInvalidReason::Ended });

        preheat(&f, ActivityStatus::Ended, 3, 10).await;
        assert_eq!(
            reserve_n(&f, 1).await,
            ReserveReply::ActivityInvalid { reason: ActivityInvalidReason::Ended }
        );
        preheat(&f, ActivityStatus::Terminated, 4, 10).await;
        assert_eq!(
            reserve_n(&f, 1).await,
            ReserveReply::ActivityInvalid { reason: ActivityInvalidReason::Terminated }
        );

        // None of these recorded anything.
        assert_eq!(stock(&f).await, Some(10));
        assert!(!exists(&f, &key("req:30001:req_1")).await);
        assert!(!exists(&f, &key("resv:resv_1")).await);
        assert!(!exists(&f, &key("user:30001")).await);
        assert_eq!(zcard(&f, &key("resv:pending")).await, 0);

        // The boundaries the other way: exactly start_ms and end_ms - 1 are inside.
        preheat(&f, ActivityStatus::Active, 5, 10).await;
        let at_start = reserve_as(&f, &ids(1), 30001, "h", T0).await;
        assert_eq!(at_start, created(9, T0));
        let last_ms = reserve_as(&f, &ids(2), 30002, "h", T0 + WINDOW_MS - 1).await;
        assert_eq!(last_ms, created(8, T0 + WINDOW_MS - 1));
    });
}

#[test]
fn reserve_duplicate_user_gets_the_first_reservation() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        assert_eq!(reserve_as(&f, &ids(1), 777, "h", T0 + 1).await, created(9, T0 + 1));
        // A different request (and payload) from the same user.
        assert_eq!(
            reserve_as(&f, &ids(2), 777, "h2", T0 + 2).await,
            ReserveReply::DuplicateUser { reservation_id: "resv_1".into() }
        );
        assert_eq!(stock(&f).await, Some(9));
        assert!(!exists(&f, &key("req:777:req_2")).await, "a losing request is not recorded");
        assert!(!exists(&f, &key("resv:resv_2")).await);
        assert_eq!(get(&f, &key("user:777")).await.as_deref(), Some("resv_1"));
        // Another user is unaffected.
        assert_eq!(reserve_as(&f, &ids(3), 778, "h", T0 + 3).await, created(8, T0 + 3));
    });
}

#[test]
fn reserve_sells_the_last_unit_then_sold_out() {
    with_redis(|f| async move {
        // Stock 0 from the start.
        preheat(&f, ActivityStatus::Active, 1, 0).await;
        assert!(exists(&f, &key("soldout")).await, "preheat with 0 marks sold out");
        assert_eq!(reserve_n(&f, 1).await, ReserveReply::SoldOut);
        assert_eq!(stock(&f).await, Some(0));
        assert!(!exists(&f, &key("req:30001:req_1")).await, "sold-out requests are not recorded");
        assert!(!exists(&f, &key("user:30001")).await);

        // Stock 1: the last unit sets soldout in the same step.
        cmd(&f, &["SET", &key("stock"), "1"]).await;
        cmd(&f, &["DEL", &key("soldout")]).await;
        assert_eq!(reserve_n(&f, 2).await, created(0, T0 + 10));
        assert!(exists(&f, &key("soldout")).await);
        assert_eq!(reserve_n(&f, 3).await, ReserveReply::SoldOut);
        assert_eq!(stock(&f).await, Some(0), "never below zero");
        assert!(!exists(&f, &key("req:30003:req_3")).await);

        // A missing stock key is sold out too (and marks it).
        cmd(&f, &["DEL", &key("stock"), &key("soldout")]).await;
        assert_eq!(reserve_n(&f, 4).await, ReserveReply::SoldOut);
        assert!(exists(&f, &key("soldout")).await);
        assert_eq!(stock(&f).await, None, "SOLD_OUT never creates the stock key");
    });
}

/// A sold-out SKU's plain reads (`Functions::sold_out_reads`, issue 25: instead of a whole
/// `reserve` before the replay map is loaded) see what `reserve` decides by: the request's
/// replay fields, `meta`'s status and limit, the buyer's marker — and write nothing.
#[test]
fn sold_out_reads_see_what_reserve_decides_by_and_write_nothing() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 1).await;
        assert_eq!(reserve_n(&f, 1).await, created(0, T0 + 10));
        let dbsize = cmd(&f, &["DBSIZE"]).await;
        let reads = |user, request: &'static str| {
            let f = &f;
            async move { f.sold_out_reads(&keys(), user, request).await.expect("reads") }
        };
        // The buyer's retry: his record, as IDEMPOTENT returns it.
        let retry = reads(30001, "req_1").await;
        let replay = retry.replay.expect("the record");
        assert_eq!((replay.payload_hash.as_str(), replay.state.as_str()), ("h", "QUEUED_PENDING"));
        assert_eq!(
            (replay.reservation_id.as_str(), replay.message_id.as_str()),
            ("resv_1", "msg_1")
        );
        assert!(matches!(reserve_n(&f, 1).await, ReserveReply::Idempotent { .. }));
        // The same buyer with a new request id: no record, his marker (DUPLICATE_USER).
        let again = reads(30001, "req_9").await;
        assert_eq!((again.replay, again.marker.as_deref()), (None, Some("resv_1")));
        assert_eq!((again.status.as_deref(), again.max_per_buyer), (Some("ACTIVE"), Some(1)));
        let dup = reserve_as(&f, &ids(9), 30001, "h", T0 + 10).await;
        assert_eq!(dup, ReserveReply::DuplicateUser { reservation_id: "resv_1".into() });
        // Another buyer: nothing of his (SOLD_OUT).
        let other = reads(30002, "req_2").await;
        assert_eq!((other.replay, other.marker), (None, None));
        assert_eq!(reserve_n(&f, 2).await, ReserveReply::SoldOut);
        assert_eq!(cmd(&f, &["DBSIZE"]).await, dbsize, "neither the reads nor SOLD_OUT wrote");
        // The SKU's keys gone: no meta.
        cmd(&f, &["DEL", &key("meta")]).await;
        assert_eq!(reads(30002, "req_2").await.status, None);
    });
}

/// FCALL by hand, for arguments the typed binding cannot even express.
async fn fcall_raw(f: &Functions, function: &str, keys: &[&str], args: &[&str]) -> String {
    let numkeys = keys.len().to_string();
    let mut all = vec!["FCALL", function, numkeys.as_str()];
    all.extend_from_slice(keys);
    all.extend_from_slice(args);
    let reply = cmd(f, &all).await;
    let error =
        reply.as_error().unwrap_or_else(|| panic!("expected an error reply, got {reply:?}"));
    String::from_utf8(error.to_vec()).unwrap()
}

/// 64-bit buyer ids (issue 23): the library takes every id PostgreSQL's `bigint` holds, as
/// text, through the whole life of a reservation — reserve, the scanner's claim, mark_sent,
/// the outcome and a compensation — and refuses only what is not an id.
#[test]
fn sixty_four_bit_buyer_ids_live_a_whole_reservation() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        let users = [1_000_000_000_000_000u64, 1_234_567_890_123_456_789, i64::MAX as u64];
        for (n, &user) in users.iter().enumerate() {
            let n = n as u64 + 1;
            let reply = reserve_as(&f, &ids(n), user, "h", T0 + 10).await;
            assert!(matches!(reply, ReserveReply::Created { .. }), "user {user}: {reply:?}");
            assert_eq!(get(&f, &key(&format!("user:{user}"))).await, Some(format!("resv_{n}")));
            assert_eq!(
                hgetall(&f, &key(&format!("resv:resv_{n}"))).await["user_id"],
                user.to_string()
            );
        }
        // The scanner claims them as valid records (not INVALID_RECORD), with their ids.
        let claimed = claim(&f, T0 + 10 + GRACE_MS, 16).await.unwrap();
        assert!(claimed.stuck.is_empty(), "{claimed:?}");
        let mut claimed_users: Vec<u64> = claimed.claimed.iter().map(|e| e.user_id).collect();
        claimed_users.sort_unstable();
        assert_eq!(claimed_users, users.to_vec());
        // mark_sent, an order for the first, a compensation for the second.
        let id1 = ids(1);
        let marks = [MarkSent {
            reservation_id: &id1.reservation_id,
            request_id: &id1.request_id,
            user_id: users[0],
        }];
        let args = MarkSentArgs { marks: &marks, now_ms: T0 + 20, order_deadline_ms: 60_000 };
        assert_eq!(f.mark_sent(&keys(), &args).await.unwrap(), vec![MarkSentReply::Ok]);
        let order = ApplyResultArgs {
            request_id: &id1.request_id,
            reservation_id: &id1.reservation_id,
            outcome: FinalOutcome::OrderCreated { order_id: "ord_1" },
            now_ms: T0 + 30,
            payload_hash: "h",
            message_id: &id1.message_id,
            user_id: users[0],
        };
        assert_eq!(f.apply_result(&keys(), &order).await.unwrap(), ApplyResultReply::Applied);
        let id2 = ids(2);
        let back = CompensateArgs {
            reservation_id: &id2.reservation_id,
            request_id: &id2.request_id,
            user_id: users[1],
            return_stock: true,
            release_user: true,
            reason_code: "EXPIRED",
            now_ms: T0 + 40,
            units: 1,
        };
        assert!(matches!(
            f.compensate(&keys(), &back).await.unwrap(),
            CompensateReply::Applied { .. }
        ));
        assert!(!exists(&f, &key(&format!("user:{}", users[1]))).await, "user released");

        // Not ids: one past i64::MAX, a leading zero, zero. Refused before any write.
        let k: Vec<String> = [
            key("meta"),
            key("stock"),
            String::new(),
            String::new(),
            key("resv:resv_9"),
            key("resv:pending"),
            key("soldout"),
        ]
        .to_vec();
        for bad in ["9223372036854775808", "012", "0", "99999999999999999999"] {
            let mut k = k.clone();
            k[2] = key(&format!("user:{bad}"));
            k[3] = key(&format!("req:{bad}:req_9"));
            let k: Vec<&str> = k.iter().map(String::as_str).collect();
            let argv = ["req_9", bad, "h", "resv_9", "msg_9", "1750000000010", "2000", "1"];
            assert_eq!(
                fcall_raw(&f, "reserve", &k, &argv).await,
                "ERR seckill: bad user_id",
                "{bad}"
            );
        }
        assert!(!exists(&f, &key("resv:resv_9")).await);
    });
}

#[test]
fn bad_arguments_are_refused_before_any_write() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        let (meta, stock_k, req, resv, pending, soldout) = (
            key("meta"),
            key("stock"),
            key("req:30001:req_1"),
            key("resv:resv_1"),
            key("resv:pending"),
            key("soldout"),
        );
        let user = key("user:30001");
        let reserve_keys = |user: &str| {
            [
                meta.clone(),
                stock_k.clone(),
                user.to_owned(),
                req.clone(),
                resv.clone(),
                pending.clone(),
                soldout.clone(),
            ]
        };
        let ok_argv = ["req_1", "30001", "h", "resv_1", "msg_1", "1750000000010", "2000", "1"];
        let k = reserve_keys(&user);
        let k: Vec<&str> = k.iter().map(String::as_str).collect();

        let mut bad_now = ok_argv;
        bad_now[5] = "12x";
        assert_eq!(fcall_raw(&f, "reserve", &k, &bad_now).await, "ERR seckill: bad now_ms");
        let mut bad_user = ok_argv;
        bad_user[1] = "-5";
        assert_eq!(fcall_raw(&f, "reserve", &k, &bad_user).await, "ERR seckill: bad user_id");
        let mut huge = ok_argv;
        huge[5] = "1234567890123456"; // 16 digits: beyond what a Lua number holds exactly
        assert_eq!(fcall_raw(&f, "reserve", &k, &huge).await, "ERR seckill: bad now_ms");
        for bad in ["0", "101", "-1", "1.5", ""] {
            let mut bad_quantity = ok_argv;
            bad_quantity[7] = bad;
            let refused = fcall_raw(&f, "reserve", &k, &bad_quantity).await;
            assert_eq!(refused, "ERR seckill: bad quantity", "{bad}");
        }
        assert_eq!(fcall_raw(&f, "reserve", &k, &ok_argv[..6]).await, "ERR seckill: bad arity");
        // A user key that does not match the user_id argument, or a key of another SKU.
        let wrong_user = reserve_keys(&key("user:30002"));
        let wrong_user: Vec<&str> = wrong_user.iter().map(String::as_str).collect();
        assert_eq!(fcall_raw(&f, "reserve", &wrong_user, &ok_argv).await, "ERR seckill: bad keys");
        let mut other_sku = k.clone();
        other_sku[1] = "seckill:{1:2}:stock";
        assert_eq!(fcall_raw(&f, "reserve", &other_sku, &ok_argv).await, "ERR seckill: bad keys");
        assert_eq!(stock(&f).await, Some(10));
        assert!(!exists(&f, &req).await);
        assert!(!exists(&f, &key("user:30002")).await);
        assert_eq!(zcard(&f, &pending).await, 0);

        // Flags must be 0/1; numbers must be numbers; outcomes must be known.
        let comp_keys = [
            key("comp:resv_1"),
            stock_k.clone(),
            user.clone(),
            resv.clone(),
            req.clone(),
            pending.clone(),
            soldout.clone(),
            key("resv:stuck"),
        ];
        let comp_keys: Vec<&str> = comp_keys.iter().map(String::as_str).collect();
        assert_eq!(
            fcall_raw(&f, "compensate", &comp_keys, &["resv_1", "yes", "1", "EXPIRED", "1", "1"])
                .await,
            "ERR seckill: bad return_stock"
        );
        assert_eq!(
            fcall_raw(&f, "compensate", &comp_keys, &["resv_1", "1", "2", "EXPIRED", "1", "1"])
                .await,
            "ERR seckill: bad release_user"
        );
        for bad in ["0", "101", "x"] {
            let argv = ["resv_1", "1", "1", "EXPIRED", "1", bad];
            let refused = fcall_raw(&f, "compensate", &comp_keys, &argv).await;
            assert_eq!(refused, "ERR seckill: bad units", "{bad}");
        }
        assert!(!exists(&f, &key("comp:resv_1")).await);
        assert_eq!(
            fcall_raw(
                &f,
                "preheat",
                &[&meta, &stock_k, &soldout],
                &["ACTIVE", "1", "2", "v2", "1", "1", "1"]
            )
            .await,
            "ERR seckill: bad version"
        );
        assert_eq!(
            fcall_raw(
                &f,
                "apply_result",
                &[&req, &resv, &pending, &key("resv:stuck")],
                &["resv_1", "MAYBE", "", "", "1", "req_1", "h", "msg_1", "30001"]
            )
            .await,
            "ERR seckill: bad outcome"
        );
        assert_eq!(
            fcall_raw(
                &f,
                "claim_due",
                &[&pending, &key("resv:stuck")],
                &["seckill:{1:2}:", "1", "1", "1", "1", "1"]
            )
            .await,
            "ERR seckill: bad key_prefix"
        );
        assert_eq!(hgetall(&f, &meta).await["version"], "1");

        // Through the binding, the library's validation is ScriptError::Refused, not
        // transient, and its outcome is known (the function wrote nothing).
        let e = f
            .preheat(
                &keys(),
                &PreheatArgs {
                    status: ActivityStatus::Active,
                    start_ms: T0,
                    end_ms: T0,
                    version: 9,
                    reservation_ttl_ms: 1,
                    stock: 1,
                    max_per_buyer: 1,
                },
            )
            .await;
        assert!(matches!(&e, Err(e) if !e.is_transient() && !e.outcome_unknown()));
        assert_bad_arg(e, "end_ms");
        assert_eq!(hgetall(&f, &meta).await["version"], "1");
    });
}

// ---- mark_sent -------------------------------------------------------------------------------

#[test]
fn mark_sent_every_reply() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        assert_eq!(mark_sent(&f, 1, T0 + 20, 60_000).await, MarkSentReply::NotFound);

        reserve_n(&f, 1).await;
        assert_eq!(mark_sent(&f, 1, T0 + 20, 60_000).await, MarkSentReply::Ok);
        assert_eq!(hgetall(&f, &key("resv:resv_1")).await["status"], "MESSAGE_SENT");
        assert_eq!(hgetall(&f, &key("req:30001:req_1")).await["state"], "QUEUED");
        // Re-scored, not removed: a message lost after the ack is still republished.
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, Some(T0 + 60_020));
        assert_eq!(
            hgetall(&f, &key("resv:resv_1")).await["next_retry_at"],
            (T0 + 60_020).to_string()
        );

        // Second call: nothing changes.
        assert_eq!(mark_sent(&f, 1, T0 + 99, 1).await, MarkSentReply::NotPending);
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, Some(T0 + 60_020));

        // After a final outcome: NOT_PENDING, and the entry is not re-added.
        reserve_n(&f, 2).await;
        apply(&f, 2, FinalOutcome::Failed { reason_code: "EXPIRED" }, T0 + 30).await;
        assert_eq!(mark_sent(&f, 2, T0 + 40, 60_000).await, MarkSentReply::NotPending);
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_2").await, None);
        assert_eq!(hgetall(&f, &key("req:30002:req_2")).await["state"], "FAILED");

        // A PENDING_MESSAGE reservation whose pending entry vanished is not re-added (ZADD XX).
        reserve_n(&f, 3).await;
        cmd(&f, &["ZREM", &key("resv:pending"), "resv_3"]).await;
        assert_eq!(mark_sent(&f, 3, T0 + 40, 60_000).await, MarkSentReply::Ok);
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_3").await, None);
        assert_eq!(hgetall(&f, &key("resv:resv_3")).await["status"], "MESSAGE_SENT");

        // A req hash that belongs to another reservation is left alone.
        reserve_n(&f, 4).await;
        cmd(&f, &["HSET", &key("req:30004:req_4"), "reservation_id", "resv_other"]).await;
        assert_eq!(mark_sent(&f, 4, T0 + 40, 60_000).await, MarkSentReply::Ok);
        assert_eq!(hgetall(&f, &key("req:30004:req_4")).await["state"], "QUEUED_PENDING");
    });
}

/// One call marks a batch: each reservation gets the answer a call of its own would give, in
/// order; a batch with one bad member changes nothing at all.
#[test]
fn mark_sent_marks_a_batch_each_as_alone_and_a_bad_batch_not_at_all() {
    with_redis(|f| async move {
        use MarkSentReply::{NotFound, NotPending, Ok as Marked};
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        for n in 2..=5 {
            reserve_n(&f, n).await;
        }
        assert_eq!(mark_sent(&f, 3, T0 + 15, 60_000).await, Marked);
        apply(&f, 5, FinalOutcome::Failed { reason_code: "EXPIRED" }, T0 + 16).await;

        // 1 was never reserved, 3 is already sent, 5 is final.
        let replies = mark_sent_batch(&f, &[1, 2, 3, 4, 5], T0 + 20, 60_000).await;
        assert_eq!(replies, vec![NotFound, Marked, NotPending, Marked, NotPending]);
        for n in [2, 4] {
            assert_eq!(
                hgetall(&f, &key(&format!("resv:resv_{n}"))).await["status"],
                "MESSAGE_SENT"
            );
            assert_eq!(hgetall(&f, &key(&format!("req:3000{n}:req_{n}"))).await["state"], "QUEUED");
            assert_eq!(
                zscore(&f, &key("resv:pending"), &format!("resv_{n}")).await,
                Some(T0 + 60_020)
            );
        }
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_3").await, Some(T0 + 60_015), "kept");
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_5").await, None, "not re-added");

        // A batch whose second member names a stranger's key: refused before any write, so
        // the first member is not marked either.
        reserve_n(&f, 6).await;
        let (pending, resv6, req6) =
            (key("resv:pending"), key("resv:resv_6"), key("req:30006:req_6"));
        let stranger = "seckill:{9:9}:resv:resv_7";
        let e = fcall_raw(
            &f,
            "mark_sent",
            &[&pending, &resv6, &req6, stranger, &req6],
            &[&(T0 + 30).to_string(), "60000", "resv_6", "resv_7"],
        )
        .await;
        assert_eq!(e, "ERR seckill: bad keys");
        assert_eq!(hgetall(&f, &resv6).await["status"], "PENDING_MESSAGE");
        // Arity: one id per key pair, and at least one reservation.
        let e = fcall_raw(&f, "mark_sent", &[&pending, &resv6, &req6], &["1", "1"]).await;
        assert_eq!(e, "ERR seckill: bad arity");
        let e = fcall_raw(&f, "mark_sent", &[&pending], &["1", "1"]).await;
        assert_eq!(e, "ERR seckill: bad arity");
        let e = fcall_raw(&f, "mark_sent", &[&pending, &resv6], &["1", "1", "resv_6"]).await;
        assert_eq!(e, "ERR seckill: bad arity");
        assert_eq!(hgetall(&f, &resv6).await["status"], "PENDING_MESSAGE");

        // The binding refuses an empty batch and one above MARK_SENT_MAX before sending.
        let none = MarkSentArgs { marks: &[], now_ms: T0, order_deadline_ms: 1 };
        assert!(matches!(
            f.mark_sent(&keys(), &none).await,
            Err(ScriptError::InvalidArgument("marks"))
        ));
        let one = MarkSent { reservation_id: "resv_6", request_id: "req_6", user_id: 30006 };
        let many = vec![one; MARK_SENT_MAX + 1];
        let over = MarkSentArgs { marks: &many, now_ms: T0, order_deadline_ms: 1 };
        assert!(matches!(
            f.mark_sent(&keys(), &over).await,
            Err(ScriptError::InvalidArgument("marks"))
        ));
        // MARK_SENT_MAX itself is accepted by the function (the same reservation each time:
        // the first marks it, the others find it sent).
        let full =
            MarkSentArgs { marks: &many[..MARK_SENT_MAX], now_ms: T0 + 40, order_deadline_ms: 1 };
        let replies = f.mark_sent(&keys(), &full).await.expect("a full batch");
        assert_eq!(replies[0], Marked);
        assert!(replies[1..].iter().all(|r| *r == NotPending) && replies.len() == MARK_SENT_MAX);
    });
}

// ---- claim_due -------------------------------------------------------------------------------

#[test]
fn claim_due_claims_backs_off_cleans_and_sticks() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        // All reserved at T0 + 10: pending score T0 + 10 + GRACE_MS.
        for n in 1..=5 {
            assert!(matches!(reserve_n(&f, n).await, ReserveReply::Created { .. }));
        }
        let due_at = T0 + 10 + GRACE_MS;

        // Not due yet: nothing claimed, nothing touched.
        let r = claim(&f, due_at - 1, 16).await.unwrap();
        assert!(r.claimed.is_empty() && r.stuck.is_empty());
        assert_eq!(hgetall(&f, &key("resv:resv_1")).await["send_attempts"], "0");
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, Some(due_at));

        // 2 gets its final outcome; 3 is sent (re-scored to later, so not due); 4's hash is lost.
        apply(&f, 2, FinalOutcome::OrderCreated { order_id: "ord_2" }, T0 + 20).await;
        cmd(&f, &["ZADD", &key("resv:pending"), &due_at.to_string(), "resv_2"]).await;
        mark_sent(&f, 3, T0 + 20, 60_000).await;
        cmd(&f, &["DEL", &key("resv:resv_4")]).await;
        // 5 is corrupt (a status nobody writes): it must not poison the batch.
        cmd(&f, &["HSET", &key("resv:resv_5"), "status", "BOGUS"]).await;

        // Due: 1 claimed (attempt 1, next at now + base); 2 and 4 cleaned, not reported;
        // 5 moved to stuck as an invalid record.
        let now = due_at;
        let r = claim(&f, now, 16).await.unwrap();
        assert_eq!(r.stuck, vec!["resv_5".to_string()]);
        assert_eq!(zscore(&f, &key("resv:stuck"), "resv_5").await, Some(now));
        assert_eq!(hgetall(&f, &key("resv:resv_5")).await["last_error_code"], "INVALID_RECORD");
        assert_eq!(r.claimed.len(), 1);
        let e = &r.claimed[0];
        assert_eq!(
            (e.reservation_id.as_str(), e.message_id.as_str(), e.request_id.as_str()),
            ("resv_1", "msg_1", "req_1")
        );
        assert_eq!((e.user_id, e.payload_hash.as_str()), (30001, "h"));
        assert_eq!((e.reserved_at_ms, e.expires_at_ms), (T0 + 10, T0 + 10 + TTL_MS));
        assert_eq!((e.send_attempts, e.status), (1, PendingStatus::PendingMessage));
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, Some(now + BACKOFF_BASE_MS));
        let resv1 = hgetall(&f, &key("resv:resv_1")).await;
        assert_eq!(resv1["send_attempts"], "1");
        assert_eq!(resv1["next_retry_at"], (now + BACKOFF_BASE_MS).to_string());
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_2").await, None, "final: cleaned");
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_4").await, None, "lost: cleaned");
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_3").await, Some(T0 + 60_020));

        // Exponential backoff, capped: delays 2 s, 4 s, 8 s, 8 s.
        let mut now = now + BACKOFF_BASE_MS;
        for (attempt, delay) in [(2, 2_000), (3, 4_000), (4, 8_000), (5, 8_000)] {
            let r = claim(&f, now, 16).await.unwrap();
            assert_eq!(r.claimed.len(), 1, "attempt {attempt}");
            assert_eq!(r.claimed[0].send_attempts, attempt);
            assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, Some(now + delay));
            now += delay;
        }

        // A sent reservation past its order deadline is claimed again (status MESSAGE_SENT).
        let r = claim(&f, T0 + 60_020, 16).await.unwrap();
        let ids: Vec<_> = r.claimed.iter().map(|e| e.reservation_id.as_str()).collect();
        assert_eq!(ids, vec!["resv_1", "resv_3"]);
        assert_eq!(r.claimed[1].status, PendingStatus::MessageSent);
        assert_eq!(r.claimed[1].send_attempts, 1);

        // Past the recovery deadline: moved to stuck, reported, marked; never silently dropped.
        let late = T0 + 10 + RECOVERY_DEADLINE_MS + 1;
        let r = claim(&f, late, 16).await.unwrap();
        assert!(r.claimed.is_empty());
        // Oldest score first: resv_3 (re-scored +1 s) before resv_1 (+8 s backoff).
        assert_eq!(r.stuck, vec!["resv_3".to_string(), "resv_1".to_string()]);
        assert_eq!(zcard(&f, &key("resv:pending")).await, 0);
        assert_eq!(zscore(&f, &key("resv:stuck"), "resv_1").await, Some(late));
        assert_eq!(hgetall(&f, &key("resv:resv_3")).await["last_error_code"], "RECOVERY_DEADLINE");
        // Stock and users are untouched by the scanner.
        assert_eq!(stock(&f).await, Some(5));
        assert!(exists(&f, &key("user:30001")).await);
    });
}

/// A stuck reservation whose outcome arrives after all (a late message, an operator's
/// republish or compensation) leaves `resv:stuck` with it: stuck means "no outcome yet".
#[test]
fn a_final_outcome_takes_a_reservation_out_of_stuck() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        reserve_n(&f, 1).await;
        reserve_n(&f, 2).await;
        let late = T0 + 10 + RECOVERY_DEADLINE_MS + 1;
        let r = claim(&f, late, 16).await.unwrap();
        assert_eq!(r.stuck.len(), 2);
        assert_eq!(zcard(&f, &key("resv:stuck")).await, 2);

        let created = FinalOutcome::OrderCreated { order_id: "ord_1" };
        assert_eq!(apply(&f, 1, created, late + 1).await, ApplyResultReply::Applied);
        assert_eq!(zscore(&f, &key("resv:stuck"), "resv_1").await, None, "applied: not stuck");
        assert_eq!(
            compensate(&f, 2, true, true, "EXPIRED").await,
            CompensateReply::Applied { stock_after: 9 }
        );
        assert_eq!(zscore(&f, &key("resv:stuck"), "resv_2").await, None, "compensated: not stuck");
        assert_eq!(zcard(&f, &key("resv:stuck")).await, 0);
    });
}

#[test]
fn claim_due_respects_the_batch_bound() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        for n in 1..=5 {
            reserve_n(&f, n).await;
        }
        let now = T0 + 10 + GRACE_MS;
        let first = claim(&f, now, 2).await.unwrap();
        assert_eq!(first.claimed.len(), 2);
        let second = claim(&f, now, 2).await.unwrap();
        assert_eq!(second.claimed.len(), 2);
        let third = claim(&f, now, 2).await.unwrap();
        assert_eq!(third.claimed.len(), 1);
        let mut all: Vec<_> = [first, second, third]
            .iter()
            .flat_map(|r| r.claimed.iter().map(|e| e.reservation_id.clone()))
            .collect();
        all.sort();
        assert_eq!(all, ["resv_1", "resv_2", "resv_3", "resv_4", "resv_5"], "each claimed once");
        assert!(claim(&f, now, 2).await.unwrap().claimed.is_empty(), "all re-scored");

        assert_eq!(claim(&f, now + 60_000, 512).await.unwrap().claimed.len(), 5);
        assert_bad_arg(claim(&f, now, 513).await, "batch_max");
        assert_bad_arg(claim(&f, now, 0).await, "batch_max");
    });
}

// ---- top_up ----------------------------------------------------------------------------------

#[test]
fn top_up_raises_stock_once_per_version_in_any_order_and_clears_soldout() {
    with_redis(|f| async move {
        let top_up = |add: u64, version: u64| {
            let f = &f;
            async move { f.top_up(&keys(), &TopUpArgs { add, version }).await }
        };
        assert_eq!(top_up(2, 2).await.unwrap(), TopUpReply::NoMeta, "never preheated");
        assert_eq!(stock(&f).await, None);
        preheat(&f, ActivityStatus::Active, 1, 1).await;
        reserve_n(&f, 1).await;
        assert!(exists(&f, &key("soldout")).await, "the last unit sold");
        // Version 3 arrives before version 2: both apply, each once.
        assert_eq!(top_up(5, 3).await.unwrap(), TopUpReply::Applied { stock_after: 5 });
        assert!(!exists(&f, &key("soldout")).await, "stock back: not sold out");
        assert_eq!(top_up(2, 2).await.unwrap(), TopUpReply::Applied { stock_after: 7 });
        assert_eq!(top_up(5, 3).await.unwrap(), TopUpReply::Already { stock: 7 });
        assert_eq!(top_up(2, 2).await.unwrap(), TopUpReply::Already { stock: 7 });
        assert_eq!(stock(&f).await, Some(7));
        assert_bad_arg(top_up(0, 4).await, "add");
        assert_bad_arg(top_up(1, 0).await, "version");
        assert_eq!(stock(&f).await, Some(7), "bad input wrote nothing");
    });
}

// ---- apply_result ----------------------------------------------------------------------------

#[test]
fn apply_result_applied_already_conflict() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        reserve_n(&f, 1).await;
        let created = FinalOutcome::OrderCreated { order_id: "ord_1" };
        assert_eq!(apply(&f, 1, created, T0 + 100).await, ApplyResultReply::Applied);
        let req = hgetall(&f, &key("req:30001:req_1")).await;
        assert_eq!((req["state"].as_str(), req["order_id"].as_str()), ("SUCCEEDED", "ord_1"));
        let resv = hgetall(&f, &key("resv:resv_1")).await;
        assert_eq!(resv["status"], "ORDER_CREATED");
        assert_eq!(resv["order_id"], "ord_1");
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, None, "left pending now");

        assert_eq!(apply(&f, 1, created, T0 + 200).await, ApplyResultReply::Already);
        let failed = FinalOutcome::Failed { reason_code: "NO_FINAL_STOCK" };
        assert_eq!(apply(&f, 1, failed, T0 + 300).await, ApplyResultReply::Conflict);
        let other = FinalOutcome::OrderCreated { order_id: "ord_other" };
        assert_eq!(apply(&f, 1, other, T0 + 300).await, ApplyResultReply::Conflict);
        // Nothing changed by ALREADY / CONFLICT.
        assert_eq!(hgetall(&f, &key("req:30001:req_1")).await, req);
        assert_eq!(hgetall(&f, &key("resv:resv_1")).await, resv);

        // FAILED: req FAILED + reason; a later ORDER_CREATED does not overwrite it.
        reserve_n(&f, 2).await;
        let failed = FinalOutcome::Failed { reason_code: "DUPLICATE_USER" };
        assert_eq!(apply(&f, 2, failed, T0 + 100).await, ApplyResultReply::Applied);
        let req2 = hgetall(&f, &key("req:30002:req_2")).await;
        assert_eq!(
            (req2["state"].as_str(), req2["reason_code"].as_str()),
            ("FAILED", "DUPLICATE_USER")
        );
        assert_eq!(hgetall(&f, &key("resv:resv_2")).await["status"], "FAILED");
        assert_eq!(apply(&f, 2, failed, T0 + 100).await, ApplyResultReply::Already);
        let late = FinalOutcome::OrderCreated { order_id: "ord_2" };
        assert_eq!(apply(&f, 2, late, T0 + 100).await, ApplyResultReply::Conflict);
        // Stock and users belong to compensate, not to apply_result.
        assert_eq!(stock(&f).await, Some(8));
        assert!(exists(&f, &key("user:30002")).await);
    });
}

#[test]
fn apply_result_recreates_a_lost_request_record() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        reserve_n(&f, 1).await;
        cmd(&f, &["DEL", &key("req:30001:req_1")]).await;
        let created = FinalOutcome::OrderCreated { order_id: "ord_1" };
        assert_eq!(apply(&f, 1, created, T0 + 100).await, ApplyResultReply::Applied);
        assert_eq!(
            hgetall(&f, &key("req:30001:req_1")).await,
            map(&[
                ("payload_hash", "h"),
                ("reservation_id", "resv_1"),
                ("message_id", "msg_1"),
                ("state", "SUCCEEDED"),
                ("order_id", "ord_1"),
                ("reason_code", ""),
                ("user_id", "30001"),
            ])
        );
        // The replay of the request works again.
        assert_eq!(
            reserve_n(&f, 1).await,
            ReserveReply::Idempotent {
                reservation_id: "resv_1".into(),
                message_id: "msg_1".into(),
                state: RequestState::Succeeded,
                order_id: Some("ord_1".into()),
                reason_code: None,
            }
        );

        // Both records lost (a failover): the req comes back from the event alone, and a
        // second delivery is ALREADY (judged from req.state when resv is gone).
        reserve_n(&f, 2).await;
        cmd(&f, &["DEL", &key("req:30002:req_2"), &key("resv:resv_2")]).await;
        let failed = FinalOutcome::Failed { reason_code: "EXPIRED" };
        assert_eq!(apply(&f, 2, failed, T0 + 100).await, ApplyResultReply::Applied);
        assert_eq!(hgetall(&f, &key("req:30002:req_2")).await["state"], "FAILED");
        assert!(!exists(&f, &key("resv:resv_2")).await, "resv is never fabricated");
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_2").await, None);
        assert_eq!(apply(&f, 2, failed, T0 + 200).await, ApplyResultReply::Already);
        let created2 = FinalOutcome::OrderCreated { order_id: "ord_2" };
        assert_eq!(apply(&f, 2, created2, T0 + 200).await, ApplyResultReply::Conflict);

        // A req that belongs to another reservation is never overwritten.
        reserve_n(&f, 3).await;
        cmd(&f, &["HSET", &key("req:30003:req_3"), "reservation_id", "resv_someone_else"]).await;
        let created3 = FinalOutcome::OrderCreated { order_id: "ord_3" };
        assert_eq!(apply(&f, 3, created3, T0 + 100).await, ApplyResultReply::Conflict);
        assert_eq!(hgetall(&f, &key("resv:resv_3")).await["status"], "PENDING_MESSAGE");
    });
}

/// One `apply_results` call applies a batch: each outcome gets the reply and the writes a call
/// of its own would give, in order; a batch the library refuses changes nothing, and the
/// binding then applies its outcomes one by one so only the bad one fails.
#[test]
fn apply_results_applies_a_batch_each_as_alone_and_a_bad_one_alone() {
    with_redis(|f| async move {
        use ApplyResultReply::{Already, Applied, Conflict};
        preheat(&f, ActivityStatus::Active, 1, 10).await;
        for n in 1..=4 {
            reserve_n(&f, n).await;
        }
        let ids: Vec<Ids> = (1..=4).map(ids).collect();
        let outcome = |n: usize, outcome| ApplyResultArgs {
            request_id: &ids[n - 1].request_id,
            reservation_id: &ids[n - 1].reservation_id,
            outcome,
            now_ms: T0 + 100,
            payload_hash: "h",
            message_id: &ids[n - 1].message_id,
            user_id: 30000 + n as u64,
        };
        let created = FinalOutcome::OrderCreated { order_id: "ord_1" };
        let failed = FinalOutcome::Failed { reason_code: "EXPIRED" };
        // 1 twice (the second finds the first), 2 failed, then 2 as an order (a conflict).
        let batch =
            [outcome(1, created), outcome(1, created), outcome(2, failed), outcome(2, created)];
        let replies: Vec<_> = f
            .apply_results(&keys(), &batch)
            .await
            .unwrap()
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(replies, vec![Applied, Already, Applied, Conflict]);
        let req1 = hgetall(&f, &key("req:30001:req_1")).await;
        assert_eq!((req1["state"].as_str(), req1["order_id"].as_str()), ("SUCCEEDED", "ord_1"));
        assert_eq!(hgetall(&f, &key("resv:resv_1")).await["status"], "ORDER_CREATED");
        assert_eq!(hgetall(&f, &key("resv:resv_2")).await["status"], "FAILED");
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, None);
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_2").await, None);

        // A user id the binding lets through but the library refuses (0 is no business id):
        // the batch is refused as a whole, so the binding applies one by one and only that
        // outcome fails.
        let bad = ApplyResultArgs { user_id: 0, ..outcome(4, created) };
        let replies = f.apply_results(&keys(), &[outcome(3, failed), bad]).await.unwrap();
        assert_eq!(replies[0].as_ref().unwrap(), &Applied);
        assert!(matches!(&replies[1], Err(ScriptError::Refused(what)) if what == "user_id"));
        assert_eq!(hgetall(&f, &key("resv:resv_3")).await["status"], "FAILED");
        assert_eq!(hgetall(&f, &key("resv:resv_4")).await["status"], "PENDING_MESSAGE");

        // The library itself, given that batch: refused before any write.
        let (pending, stuck) = (key("resv:pending"), key("resv:stuck"));
        let (req4, resv4) = (key("req:30004:req_4"), key("resv:resv_4"));
        let args4 = ["resv_4", "ORDER_CREATED", "ord_4", "", "1", "req_4", "h", "msg_4", "30004"];
        let mut args: Vec<&str> = args4.to_vec();
        args.extend(["resv_4", "ORDER_CREATED", "ord_4", "", "1", "req_4", "h", "msg_4", "0"]);
        let e = fcall_raw(
            &f,
            "apply_results",
            &[&pending, &stuck, &req4, &resv4, &req4, &resv4],
            &args,
        )
        .await;
        assert_eq!(e, "ERR seckill: bad user_id");
        assert_eq!(hgetall(&f, &resv4).await["status"], "PENDING_MESSAGE");
        // Arity: nine arguments and two keys per outcome, at least one outcome.
        let e = fcall_raw(&f, "apply_results", &[&pending, &stuck, &req4], &args4).await;
        assert_eq!(e, "ERR seckill: bad arity");
        let e = fcall_raw(&f, "apply_results", &[&pending, &stuck], &[]).await;
        assert_eq!(e, "ERR seckill: bad arity");
        let e =
            fcall_raw(&f, "apply_results", &[&pending, &stuck, &req4, &resv4], &args4[..8]).await;
        assert_eq!(e, "ERR seckill: bad arity");
        // A stranger's key.
        let stranger = "seckill:{9:9}:resv:resv_4";
        let e = fcall_raw(&f, "apply_results", &[&pending, &stuck, &req4, stranger], &args4).await;
        assert_eq!(e, "ERR seckill: bad keys");
        assert_eq!(hgetall(&f, &resv4).await["status"], "PENDING_MESSAGE");
    });
}

// ---- compensate ------------------------------------------------------------------------------

#[test]
fn compensate_returns_stock_once_and_clears_soldout() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 1).await;
        assert_eq!(reserve_n(&f, 1).await, created(0, T0 + 10));
        assert!(exists(&f, &key("soldout")).await);

        assert_eq!(
            compensate(&f, 1, true, true, "EXPIRED").await,
            CompensateReply::Applied { stock_after: 1 }
        );
        assert_eq!(stock(&f).await, Some(1));
        assert!(!exists(&f, &key("soldout")).await, "stock returned: not sold out");
        assert!(!exists(&f, &key("user:30001")).await, "user released");
        let resv = hgetall(&f, &key("resv:resv_1")).await;
        assert_eq!(
            (resv["status"].as_str(), resv["last_error_code"].as_str()),
            ("COMPENSATED", "EXPIRED")
        );
        let req = hgetall(&f, &key("req:30001:req_1")).await;
        assert_eq!((req["state"].as_str(), req["reason_code"].as_str()), ("FAILED", "EXPIRED"));
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, None);
        // The marker says what it returned (reconcile counts units from it).
        assert_eq!(get(&f, &key("comp:resv_1")).await.as_deref(), Some("EXPIRED|1"));

        // The same compensation again (a redelivered event): no second return.
        assert_eq!(compensate(&f, 1, true, true, "EXPIRED").await, CompensateReply::AlreadyApplied);
        assert_eq!(stock(&f).await, Some(1), "stock returned exactly once");

        // The released user may buy again; a replay of the old request reports FAILED.
        assert_eq!(reserve_as(&f, &ids(2), 30001, "h", T0 + 60).await, created(0, T0 + 60));
        assert!(matches!(
            reserve_n(&f, 1).await,
            ReserveReply::Idempotent { state: RequestState::Failed, reason_code: Some(r), .. }
                if r == "EXPIRED"
        ));
        // FAILED from the event after compensation is ALREADY.
        let failed = FinalOutcome::Failed { reason_code: "EXPIRED" };
        assert_eq!(apply(&f, 1, failed, T0 + 70).await, ApplyResultReply::Already);
    });
}

#[test]
fn compensate_flags_and_user_ownership() {
    with_redis(|f| async move {
        preheat(&f, ActivityStatus::Active, 1, 2).await;
        reserve_n(&f, 1).await;
        assert_eq!(reserve_n(&f, 2).await, created(0, T0 + 10));

        // No final stock: release the user, keep sold out (stock not returned).
        assert_eq!(
            compensate(&f, 1, false, true, "NO_FINAL_STOCK").await,
            CompensateReply::Applied { stock_after: 0 }
        );
        assert_eq!(stock(&f).await, Some(0));
        assert!(exists(&f, &key("soldout")).await, "stock not returned: still sold out");
        assert!(!exists(&f, &key("user:30001")).await);

        // The user key now holds ANOTHER reservation: release_user must not delete it.
        cmd(&f, &["SET", &key("user:30002"), "resv_newer"]).await;
        assert_eq!(
            compensate(&f, 2, true, true, "DUPLICATE_USER").await,
            CompensateReply::Applied { stock_after: 1 }
        );
        assert_eq!(get(&f, &key("user:30002")).await.as_deref(), Some("resv_newer"));
        assert!(!exists(&f, &key("soldout")).await);

        // return_stock without release_user keeps the user marker.
        preheat(&f, ActivityStatus::Active, 2, 0).await; // newer version: stock untouched
        assert_eq!(stock(&f).await, Some(1));
        reserve_n(&f, 3).await;
        assert_eq!(
            compensate(&f, 3, true, false, "ORDER_CANCELLED").await,
            CompensateReply::Applied { stock_after: 1 }
        );
        assert_eq!(get(&f, &key("user:30003")).await.as_deref(), Some("resv_3"));
        assert_eq!(zcard(&f, &key("resv:pending")).await, 0);
    });
}

// ---- preheat ---------------------------------------------------------------------------------

#[test]
fn preheat_versions_and_stock_set_once() {
    with_redis(|f| async move {
        assert_eq!(
            preheat(&f, ActivityStatus::Pending, 5, 3).await,
            PreheatReply::Applied { version: 5 }
        );
        assert_eq!(
            hgetall(&f, &key("meta")).await,
            map(&[
                ("status", "PENDING"),
                ("start_ms", &T0.to_string()),
                ("end_ms", &(T0 + WINDOW_MS).to_string()),
                ("version", "5"),
                ("reservation_ttl_ms", &TTL_MS.to_string()),
                ("max_per_buyer", "1"),
            ])
        );
        assert_eq!(stock(&f).await, Some(3));
        assert!(!exists(&f, &key("soldout")).await);

        // Equal or lower versions are stale and change nothing.
        assert_eq!(
            preheat(&f, ActivityStatus::Active, 5, 3).await,
            PreheatReply::Stale { current_version: 5 }
        );
        assert_eq!(
            preheat(&f, ActivityStatus::Active, 4, 3).await,
            PreheatReply::Stale { current_version: 5 }
        );
        assert_eq!(hgetall(&f, &key("meta")).await["status"], "PENDING");

        // A newer version changes the status but never resets live stock.
        assert_eq!(
            preheat(&f, ActivityStatus::Active, 6, 3).await,
            PreheatReply::Applied { version: 6 }
        );
        assert_eq!(hgetall(&f, &key("meta")).await["status"], "ACTIVE");
        reserve_n(&f, 1).await;
        assert_eq!(stock(&f).await, Some(2));
        assert_eq!(
            preheat(&f, ActivityStatus::Active, 7, 100).await,
            PreheatReply::Applied { version: 7 }
        );
        assert_eq!(stock(&f).await, Some(2), "live stock untouched by a newer snapshot");
        assert_eq!(hgetall(&f, &key("meta")).await["version"], "7");
    });
}

// ---- reload ----------------------------------------------------------------------------------

/// How many `FUNCTION LOAD` commands the server has run (`INFO commandstats`).
async fn function_loads(f: &Functions) -> u64 {
    let info = cmd(f, &["INFO", "commandstats"]).await;
    let info = info.as_str().unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_function|load:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

#[test]
fn function_not_found_reloads_and_resends_once() {
    with_redis(|f| async move {
        // A fresh Redis has no library: the very first call already goes through the reload.
        assert_eq!(
            preheat(&f, ActivityStatus::Active, 1, 5).await,
            PreheatReply::Applied { version: 1 }
        );
        assert!(cmd(&f, &["FUNCTION", "FLUSH"]).await.is_ok());
        assert_eq!(
            cmd(&f, &["FCALL", "reserve", "0"]).await.as_error().map(|e| e.to_vec()),
            Some(b"ERR Function not found".to_vec()),
            "the server really lost the library"
        );
        // The call succeeds, and ran exactly once (stock 5 -> 4).
        assert_eq!(reserve_n(&f, 1).await, created(4, T0 + 10));
        assert_eq!(stock(&f).await, Some(4));
        let list = cmd(&f, &["FUNCTION", "LIST", "LIBRARYNAME", "seckill"]).await;
        assert_eq!(list.as_array().map(<[Reply]>::len), Some(1), "library loaded again");

        // Many concurrent callers that all hit "not found" each get their answer, and the
        // library is loaded once between them, not once each.
        assert!(cmd(&f, &["FUNCTION", "FLUSH"]).await.is_ok());
        let loads_before = function_loads(&f).await;
        let f = std::rc::Rc::new(f);
        let tasks: Vec<_> = (2..=4)
            .map(|n| {
                let f = f.clone();
                glommio::spawn_local(async move { reserve_n(&f, n).await })
            })
            .collect();
        let mut stocks = Vec::new();
        for t in tasks {
            match t.await {
                ReserveReply::Created { stock_after, .. } => stocks.push(stock_after),
                other => panic!("expected CREATED, got {other:?}"),
            }
        }
        stocks.sort();
        assert_eq!(stocks, vec![1, 2, 3]);
        assert_eq!(function_loads(&f).await, loads_before + 1, "one reload for the burst");

        // load_library on its own is idempotent (REPLACE).
        load_library(f.client()).await.unwrap();
        load_library(f.client()).await.unwrap();
    });
}

// ---- restore ---------------------------------------------------------------------------------

const LOCK_TTL_MS: u64 = 30_000;

fn lock(token: &str) -> RestoreLock<'_> {
    RestoreLock { token, ttl_ms: LOCK_TTL_MS }
}

async fn restore(f: &Functions, token: &str, step: RestoreStep<'_>) -> RestoreReply {
    f.restore(&keys(), lock(token), &step).await.expect("restore")
}

async fn restore_reservation(f: &Functions, token: &str, n: u64, user_id: u64) -> RestoreReply {
    let ids = ids(n);
    let step = RestoreStep::Reservation(RestoreReservation {
        request_id: &ids.request_id,
        user_id,
        payload_hash: "h1",
        reservation_id: &ids.reservation_id,
        message_id: &ids.message_id,
        reserved_at_ms: T0 + n,
        expires_at_ms: T0 + n + TTL_MS,
        next_retry_at_ms: T0 + 9_000,
        quantity: 1,
    });
    restore(f, token, step).await
}

fn meta() -> RestoreMeta {
    RestoreMeta {
        status: ActivityStatus::Active,
        start_ms: T0,
        end_ms: T0 + WINDOW_MS,
        version: 3,
        reservation_ttl_ms: TTL_MS,
        max_per_buyer: 1,
    }
}

/// The rebuild's steps under one lock: BEGIN takes it (another token is BUSY), a reservation is
/// written as `reserve` writes a CREATED one whose message the log acknowledged, every step
/// renews the lock, FINISH writes meta and lets go, and a SKU with meta is LIVE to every step.
#[test]
fn restore_rebuilds_a_lost_sku_under_one_lock_and_never_touches_a_live_one() {
    with_redis(|f| async move {
        // Left over from the lost SKU: a pending entry, a stuck one, a sold-out flag.
        cmd(&f, &["ZADD", &key("resv:pending"), "1", "resv_old"]).await;
        cmd(&f, &["ZADD", &key("resv:stuck"), "1", "resv_old"]).await;
        cmd(&f, &["SET", &key("soldout"), "1"]).await;
        assert_eq!(
            restore(&f, "a", RestoreStep::Begin { stock: 3 }).await,
            RestoreReply::Ok { stock: 3 }
        );
        assert_eq!(get(&f, &key("rebuild")).await.as_deref(), Some("a"));
        assert_eq!(
            (zcard(&f, &key("resv:pending")).await, zcard(&f, &key("resv:stuck")).await),
            (0, 0)
        );
        assert!(!exists(&f, &key("soldout")).await);
        // Another rebuilder is BUSY at every step and changes nothing.
        assert_eq!(restore(&f, "b", RestoreStep::Begin { stock: 9 }).await, RestoreReply::Busy);
        assert_eq!(restore_reservation(&f, "b", 1, 7).await, RestoreReply::Busy);
        assert_eq!(restore(&f, "b", RestoreStep::Finish(meta())).await, RestoreReply::Busy);
        assert_eq!(stock(&f).await, Some(3));
        assert!(!exists(&f, &key("meta")).await);

        // A reservation, as reserve wrote it and the log acknowledged it.
        cmd(&f, &["PEXPIRE", &key("rebuild"), "1000"]).await;
        assert_eq!(restore_reservation(&f, "a", 1, 7).await, RestoreReply::Ok { stock: 2 });
        let ttl = cmd(&f, &["PTTL", &key("rebuild")]).await.as_int().unwrap();
        assert!(ttl > 1_000 && ttl <= LOCK_TTL_MS as i64, "the step renewed the lock: {ttl}");
        assert_eq!(get(&f, &key("user:7")).await.as_deref(), Some("resv_1"));
        assert_eq!(
            hgetall(&f, &key("req:7:req_1")).await,
            map(&[
                ("payload_hash", "h1"),
                ("reservation_id", "resv_1"),
                ("message_id", "msg_1"),
                ("state", "QUEUED"),
                ("order_id", ""),
                ("reason_code", ""),
                ("user_id", "7"),
            ])
        );
        let resv = hgetall(&f, &key("resv:resv_1")).await;
        assert_eq!(resv["status"], "MESSAGE_SENT");
        assert_eq!(resv["request_id"], "req_1");
        assert_eq!(resv["expires_at"], (T0 + 1 + TTL_MS).to_string());
        assert_eq!(zscore(&f, &key("resv:pending"), "resv_1").await, Some(T0 + 9_000));
        // The same buyer's second reservation takes a unit but not the marker (first wins).
        assert_eq!(restore_reservation(&f, "a", 2, 7).await, RestoreReply::Ok { stock: 1 });
        assert_eq!(get(&f, &key("user:7")).await.as_deref(), Some("resv_1"));
        assert!(!exists(&f, &key("meta")).await, "nobody can reserve from a half-built SKU");

        assert_eq!(
            restore(&f, "a", RestoreStep::Finish(meta())).await,
            RestoreReply::Ok { stock: 1 }
        );
        assert_eq!(hgetall(&f, &key("meta")).await["version"], "3");
        assert!(!exists(&f, &key("rebuild")).await, "the lock is let go");
        assert!(!exists(&f, &key("soldout")).await);
        // Whole again: every step is LIVE and writes nothing.
        assert_eq!(restore(&f, "c", RestoreStep::Begin { stock: 50 }).await, RestoreReply::Live);
        assert_eq!(restore_reservation(&f, "a", 3, 8).await, RestoreReply::Live);
        assert_eq!(stock(&f).await, Some(1));
        assert!(!exists(&f, &key("user:8")).await);
        // And the rebuilt SKU answers like the one it replaces.
        let replay = reserve_as(&f, &ids(1), 7, "h1", T0 + 10).await;
        assert!(matches!(replay, ReserveReply::Idempotent { .. }), "{replay:?}");
    });
}

/// WIPE deletes the SKU's record keys and nothing else; FINISH never leaves a negative stock.
#[test]
fn restore_wipes_only_record_keys_and_finishes_at_zero_stock_at_least() {
    with_redis(|f| async move {
        assert_eq!(
            restore(&f, "a", RestoreStep::Begin { stock: 1 }).await,
            RestoreReply::Ok { stock: 1 }
        );
        for k in ["resv:resv_9", "req:7:req_9", "user:7", "comp:resv_9"] {
            cmd(&f, &["SET", &key(k), "x"]).await;
        }
        let wiped: Vec<String> =
            ["resv:resv_9", "req:7:req_9", "user:7", "comp:resv_9"].map(key).to_vec();
        assert_eq!(
            restore(&f, "a", RestoreStep::Wipe { keys: &wiped }).await,
            RestoreReply::Ok { stock: 1 }
        );
        for k in &wiped {
            assert!(!exists(&f, k).await, "{k} wiped");
        }
        // Anything but a record key of this SKU refuses the whole call.
        for stranger in [key("stock"), key("meta"), "seckill:{1:2}:user:7".to_owned()] {
            let wipe = RestoreStep::Wipe { keys: std::slice::from_ref(&stranger) };
            let refused = f.restore(&keys(), lock("a"), &wipe).await;
            assert!(matches!(refused, Err(ScriptError::Refused(_))), "{stranger}: {refused:?}");
        }
        assert_eq!(stock(&f).await, Some(1));
        // A history that took more units than the total (a past loss re-preheated the SKU)
        // ends at 0 and sold out, never negative.
        for n in 1..=3 {
            restore_reservation(&f, "a", n, 10 + n).await;
        }
        assert_eq!(stock(&f).await, Some(-2));
        assert_eq!(
            restore(&f, "a", RestoreStep::Finish(meta())).await,
            RestoreReply::Ok { stock: 0 }
        );
        assert_eq!(stock(&f).await, Some(0));
        assert!(exists(&f, &key("soldout")).await);
    });
}

// ---- quantities (issue 29) -------------------------------------------------------------------

/// A SKU whose meta allows `max_per_buyer` units per buyer, with `stock` units.
async fn preheat_limited(f: &Functions, max_per_buyer: u32, stock: u64) {
    let args = PreheatArgs {
        status: ActivityStatus::Active,
        start_ms: T0,
        end_ms: T0 + WINDOW_MS,
        version: 1,
        reservation_ttl_ms: TTL_MS,
        stock,
        max_per_buyer,
    };
    f.preheat(&keys(), &args).await.expect("preheat");
}

/// Request n by user 30000+n for `quantity` units, at T0 + 10 ms.
async fn reserve_units(f: &Functions, n: u64, quantity: u32) -> ReserveReply {
    let ids = ids(n);
    let args = ReserveArgs {
        request_id: &ids.request_id,
        user_id: 30000 + n,
        payload_hash: "h",
        reservation_id: &ids.reservation_id,
        message_id: &ids.message_id,
        now_ms: T0 + 10,
        pending_grace_ms: GRACE_MS,
        quantity,
    };
    f.reserve(&keys(), &args).await.expect("reserve")
}

/// A reservation takes all its units or none: over the SKU's limit is refused before any
/// write; with fewer units left than asked (but some) nothing is written and the SKU is not
/// sold out, so a smaller quantity still succeeds and takes the last unit; the record carries
/// its quantity (what a compensation gives back and a republish carries).
#[test]
fn a_reservation_takes_all_its_units_or_none() {
    with_redis(|f| async move {
        preheat_limited(&f, 2, 3).await;
        assert_eq!(hgetall(&f, &key("meta")).await["max_per_buyer"], "2");
        assert_eq!(reserve_units(&f, 1, 3).await, ReserveReply::OverLimit { max_per_buyer: 2 });
        assert!(!exists(&f, &key("user:30001")).await, "over the limit writes nothing");
        assert_eq!(reserve_units(&f, 1, 2).await, created(1, T0 + 10));
        assert_eq!(stock(&f).await, Some(1));
        assert_eq!(hgetall(&f, &key("resv:resv_1")).await["quantity"], "2");
        // 2 asked, 1 left: its own answer, nothing written, not sold out.
        assert_eq!(reserve_units(&f, 2, 2).await, ReserveReply::FewerLeft { units_left: 1 });
        assert!(!exists(&f, &key("user:30002")).await);
        assert!(!exists(&f, &key("req:30002:req_2")).await);
        assert!(!exists(&f, &key("soldout")).await, "a smaller quantity can still be had");
        // A buyer who holds a reservation is told so, whatever he asks.
        assert!(matches!(reserve_units(&f, 1, 1).await, ReserveReply::Idempotent { .. }));
        let mut again = ids(1);
        again.request_id = "req_1b".into();
        again.reservation_id = "resv_1b".into();
        let args = ReserveArgs {
            request_id: &again.request_id,
            user_id: 30001,
            payload_hash: "h2",
            reservation_id: &again.reservation_id,
            message_id: "msg_1b",
            now_ms: T0 + 10,
            pending_grace_ms: GRACE_MS,
            quantity: 2,
        };
        assert_eq!(
            f.reserve(&keys(), &args).await.unwrap(),
            ReserveReply::DuplicateUser { reservation_id: "resv_1".into() }
        );
        // The last unit to whoever asks for one: sold out.
        assert_eq!(reserve_units(&f, 3, 1).await, created(0, T0 + 10));
        assert!(exists(&f, &key("soldout")).await);
        assert_eq!(reserve_units(&f, 4, 1).await, ReserveReply::SoldOut);

        // The scanner republishes a record with its quantity.
        let claimed = claim(&f, T0 + 10 + GRACE_MS, 10).await.expect("claim");
        let quantities: Vec<(String, u32)> =
            claimed.claimed.iter().map(|e| (e.reservation_id.clone(), e.quantity)).collect();
        assert_eq!(quantities, [("resv_1".to_owned(), 2), ("resv_3".to_owned(), 1)]);

        // A compensation gives back exactly the reservation's units, once.
        apply(&f, 1, FinalOutcome::Failed { reason_code: "NO_FINAL_STOCK" }, T0 + 20).await;
        let back = CompensateArgs {
            reservation_id: "resv_1",
            request_id: "req_1",
            user_id: 30001,
            return_stock: true,
            release_user: true,
            reason_code: "EXPIRED",
            now_ms: T0 + 40,
            units: 2,
        };
        assert!(matches!(
            f.compensate(&keys(), &back).await.unwrap(),
            CompensateReply::Applied { stock_after: 2 }
        ));
        assert!(!exists(&f, &key("soldout")).await);
        assert!(matches!(
            f.compensate(&keys(), &back).await.unwrap(),
            CompensateReply::AlreadyApplied
        ));
        assert_eq!(stock(&f).await, Some(2));
    });
}
