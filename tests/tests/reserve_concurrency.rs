//! The seed's concurrency scenario against a real Redis: 100 units, 10,000 distinct buyers
//! reserving at once through ONE pipelined client on one glommio executor, while a second
//! client keeps reading `stock`.
//!
//! What it proves: `reserve` is atomic under a real pipelined burst — exactly 100 CREATED and
//! 9,900 SOLD_OUT, stock never seen below zero and ending at zero, one user key and one
//! reservation per winner, nothing recorded for the losers (their replays are still SOLD_OUT),
//! and every winner's replay returns its own first ids.
//!
//! The same burst with quantities (issue 29): buyers ask 1, 2 or 3 units of a SKU that allows
//! 2 per buyer; exactly the stock is sold, no reservation is split (each winner holds exactly
//! what it asked), none is over the limit, and the answers that reserved nothing recorded
//! nothing.
//!
//! Retries follow the client's contract: `Full` and `NotSent` are retried as is; an unknown
//! outcome is retried with the SAME ids, and such a request then counts as a winner only via
//! an IDEMPOTENT reply (which the test then requires). The timeout is generous so that in
//! practice no outcome is unknown.

#![allow(clippy::unwrap_used)]

use std::cell::Cell;
use std::collections::HashSet;
use std::rc::Rc;
use std::time::Duration;

use flashsale_io::redis::layout::ActivityStatus;
use flashsale_io::redis::script::{
    load_library, Functions, PreheatArgs, PreheatReply, RequestState, ReserveArgs, ReserveReply,
    ScriptError, SkuKeys,
};
use flashsale_io::redis::{RedisClient, RedisConfig, RedisError};
use flashsale_io::resp::Reply;

const A: u64 = 10001;
const S: u64 = 20001;
const STOCK: u64 = 100;
const BUYERS: u64 = 10_000;
const NOW_MS: u64 = 1_750_000_000_000;
/// Attempts per request before the test gives up (it must never hang).
const ATTEMPTS_MAX: u32 = 20_000;

fn key(suffix: &str) -> String {
    format!("seckill:{{{A}:{S}}}:{suffix}")
}

fn request_id(i: u64) -> String {
    format!("req_{i}")
}
fn reservation_id(i: u64) -> String {
    format!("resv_{i}")
}
fn message_id(i: u64) -> String {
    format!("msg_{i}")
}
fn user_id(i: u64) -> u64 {
    1_000_000 + i
}

/// The final reply for buyer `i`, retrying as the client contract allows. Returns the reply
/// and whether any attempt had an unknown outcome.
async fn reserve_until_answered(f: &Functions, keys: &SkuKeys, i: u64) -> (ReserveReply, bool) {
    reserve_units_until_answered(f, keys, i, 1).await
}

/// [`reserve_until_answered`] for `quantity` units.
async fn reserve_units_until_answered(
    f: &Functions,
    keys: &SkuKeys,
    i: u64,
    quantity: u32,
) -> (ReserveReply, bool) {
    let (request_id, reservation_id, message_id) =
        (request_id(i), reservation_id(i), message_id(i));
    let payload_hash = format!("sha256:{i}");
    let args = ReserveArgs {
        request_id: &request_id,
        user_id: user_id(i),
        payload_hash: &payload_hash,
        reservation_id: &reservation_id,
        message_id: &message_id,
        now_ms: NOW_MS,
        pending_grace_ms: 2_000,
        quantity,
    };
    let mut unknown = false;
    for _ in 0..ATTEMPTS_MAX {
        match f.reserve(keys, &args).await {
            Ok(reply) => return (reply, unknown),
            Err(e) if e.is_transient() => {
                unknown |= e.outcome_unknown();
                if !matches!(e, ScriptError::Redis(RedisError::Full)) {
                    eprintln!("buyer {i}: {e}; retrying with the same ids");
                }
                glommio::timer::sleep(Duration::from_millis(1)).await;
            }
            Err(e) => panic!("buyer {i}: {e}"),
        }
    }
    panic!("buyer {i}: no answer after {ATTEMPTS_MAX} attempts");
}

async fn count_keys(client: &RedisClient, pattern: &str) -> usize {
    let reply = client.command(&[b"KEYS", pattern.as_bytes()]).await.unwrap();
    reply.as_array().unwrap().len()
}

/// The library loaded and the SKU preheated with [`STOCK`] units, `max_per_buyer` each, on a
/// connection for a burst: bounded by in_flight_max (Full is retried by the buyers), with a
/// timeout generous enough that a slow CI machine does not turn replies into unknown outcomes.
async fn preheated(addr: std::net::SocketAddr, max_per_buyer: u32) -> (Rc<Functions>, Rc<SkuKeys>) {
    let mut config = RedisConfig::new(addr);
    config.in_flight_max = 1024;
    config.command_timeout = Duration::from_secs(10);
    let client = RedisClient::connect(config).await.unwrap();
    let f = Rc::new(Functions::new(client));
    let keys = Rc::new(SkuKeys::new(A, S));
    load_library(f.client()).await.unwrap();
    let preheat = PreheatArgs {
        status: ActivityStatus::Active,
        start_ms: NOW_MS - 1_000,
        end_ms: NOW_MS + 3_600_000,
        version: 1,
        reservation_ttl_ms: 300_000,
        stock: STOCK,
        max_per_buyer,
    };
    assert_eq!(f.preheat(&keys, &preheat).await.unwrap(), PreheatReply::Applied { version: 1 });
    (f, keys)
}

#[test]
fn hundred_units_ten_thousand_buyers() {
    let redis = flashsale_tests::redis();
    let addr = redis.addr();
    flashsale_tests::glommio(move || async move {
        let (f, keys) = preheated(addr, 1).await;

        // The observer: its own connection, reading stock until the burst is over.
        // Its timeout as generous as the buyers': a loaded CI box delays a GET too.
        let mut observer_config = RedisConfig::new(addr);
        observer_config.command_timeout = Duration::from_secs(10);
        let observer_client = RedisClient::connect(observer_config).await.unwrap();
        let burst_over = Rc::new(Cell::new(false));
        let observer = glommio::spawn_local({
            let burst_over = burst_over.clone();
            let stock_key = key("stock");
            async move {
                let (mut reads, mut min, mut max) = (0u64, i64::MAX, i64::MIN);
                while !burst_over.get() {
                    let reply = observer_client.command(&[b"GET", stock_key.as_bytes()]).await;
                    let stock: i64 = reply.unwrap().as_str().unwrap().parse().unwrap();
                    min = min.min(stock);
                    max = max.max(stock);
                    reads += 1;
                }
                (reads, min, max)
            }
        });

        let buyers: Vec<_> = (0..BUYERS)
            .map(|i| {
                let (f, keys) = (f.clone(), keys.clone());
                glommio::spawn_local(async move { reserve_until_answered(&f, &keys, i).await })
            })
            .collect();
        let mut winners = HashSet::new();
        let mut created = 0;
        let mut sold_out = 0;
        for (i, buyer) in (0..BUYERS).zip(buyers) {
            match buyer.await {
                (ReserveReply::Created { .. }, _) => {
                    created += 1;
                    winners.insert(i);
                }
                (ReserveReply::SoldOut, _) => sold_out += 1,
                // Only after an unknown outcome: the first attempt ran and created it.
                (ReserveReply::Idempotent { reservation_id: r, .. }, true) => {
                    assert_eq!(r, reservation_id(i));
                    winners.insert(i);
                }
                other => panic!("buyer {i}: unexpected {other:?}"),
            }
        }
        burst_over.set(true);
        let (reads, min_seen, max_seen) = observer.await;

        let client = f.client();
        eprintln!(
            "created {created}, sold out {sold_out}; observer read stock {reads} times \
             (min {min_seen}, max {max_seen}); {} commands in {} writes",
            client.commands_total(),
            client.writes_total()
        );
        assert_eq!(winners.len() as u64, STOCK, "exactly the stock was reserved");
        assert_eq!(winners.len() as u64 + sold_out, BUYERS, "every buyer got a final answer");
        assert_eq!(sold_out, BUYERS - STOCK);
        assert!(reads >= 2, "the observer must have read stock during the burst ({reads})");
        assert!(min_seen >= 0, "stock observed below zero: {min_seen}");
        assert!(max_seen <= STOCK as i64);
        assert!(client.writes_total() < client.commands_total(), "commands were pipelined");

        // Redis state after the burst.
        let stock = client.command(&[b"GET", key("stock").as_bytes()]).await.unwrap();
        assert_eq!(stock.as_str(), Some("0"));
        let soldout = client.command(&[b"EXISTS", key("soldout").as_bytes()]).await.unwrap();
        assert_eq!(soldout.as_int(), Some(1));
        assert_eq!(count_keys(client, &key("user:*")).await, STOCK as usize);
        assert_eq!(count_keys(client, &key("req:*")).await, STOCK as usize);
        // resv:<id> hashes plus the resv:pending ZSET itself.
        assert_eq!(count_keys(client, &key("resv:*")).await, STOCK as usize + 1);
        let pending = client.command(&[b"ZCARD", key("resv:pending").as_bytes()]).await.unwrap();
        assert_eq!(pending.as_int(), Some(STOCK as i64));
        for &i in &winners {
            let user_key = key(&format!("user:{}", user_id(i)));
            let held = client.command(&[b"GET", user_key.as_bytes()]).await.unwrap();
            assert_eq!(held, Reply::Bulk(reservation_id(i).into_bytes().into()), "user of {i}");
        }

        // Replay every request: winners get their own first ids back, losers are still
        // SOLD_OUT because nothing was recorded for them. One reservation per request id.
        let replays: Vec<_> = (0..BUYERS)
            .map(|i| {
                let (f, keys) = (f.clone(), keys.clone());
                glommio::spawn_local(async move { reserve_until_answered(&f, &keys, i).await })
            })
            .collect();
        for (i, replay) in (0..BUYERS).zip(replays) {
            let (reply, _) = replay.await;
            if winners.contains(&i) {
                assert_eq!(
                    reply,
                    ReserveReply::Idempotent {
                        reservation_id: reservation_id(i),
                        message_id: message_id(i),
                        state: RequestState::QueuedPending,
                        order_id: None,
                        reason_code: None,
                    },
                    "replay of winner {i}"
                );
            } else {
                assert_eq!(reply, ReserveReply::SoldOut, "replay of loser {i}");
            }
        }
        assert_eq!(
            count_keys(client, &key("req:*")).await,
            STOCK as usize,
            "replays record nothing"
        );
        let stock = client.command(&[b"GET", key("stock").as_bytes()]).await.unwrap();
        assert_eq!(stock.as_str(), Some("0"));
    });
    drop(redis);
}

/// Buyers asking 1, 2 or 3 units (in turn) of a SKU of 100 units that allows 2 per buyer.
#[test]
fn one_to_three_units_per_buyer_never_split_never_over_the_limit_never_oversold() {
    const BUYERS: u64 = 3_000;
    let redis = flashsale_tests::redis();
    let addr = redis.addr();
    flashsale_tests::glommio(move || async move {
        let (f, keys) = preheated(addr, 2).await;
        let quantity = |i: u64| 1 + (i % 3) as u32;
        let buyers: Vec<_> = (0..BUYERS)
            .map(|i| {
                let (f, keys) = (f.clone(), keys.clone());
                glommio::spawn_local(async move {
                    reserve_units_until_answered(&f, &keys, i, quantity(i)).await
                })
            })
            .collect();
        let (mut units_sold, mut winners, mut over, mut fewer, mut sold_out) = (0u64, 0, 0, 0, 0);
        let mut won = Vec::new();
        for (i, buyer) in (0..BUYERS).zip(buyers) {
            match buyer.await {
                (ReserveReply::Created { .. }, _) => {
                    units_sold += u64::from(quantity(i));
                    winners += 1;
                    won.push(i);
                }
                (ReserveReply::Idempotent { reservation_id: r, .. }, true) => {
                    assert_eq!(r, reservation_id(i));
                    units_sold += u64::from(quantity(i));
                    winners += 1;
                    won.push(i);
                }
                (ReserveReply::OverLimit { max_per_buyer }, _) => {
                    assert_eq!((quantity(i), max_per_buyer), (3, 2), "buyer {i}");
                    over += 1;
                }
                (ReserveReply::FewerLeft { units_left }, _) => {
                    assert!(u64::from(quantity(i)) > units_left, "buyer {i}: {units_left} left");
                    fewer += 1;
                }
                (ReserveReply::SoldOut, _) => sold_out += 1,
                other => panic!("buyer {i}: unexpected {other:?}"),
            }
        }
        eprintln!(
            "{winners} winners took {units_sold} units; {over} over the limit, {fewer} asked \
             more than was left, {sold_out} sold out"
        );
        assert_eq!(units_sold, STOCK, "exactly the stock was sold, in whole reservations");
        assert_eq!(over, BUYERS / 3, "every buyer asking 3 units is over the limit of 2");
        let client = f.client();
        let stock = client.command(&[b"GET", key("stock").as_bytes()]).await.unwrap();
        assert_eq!(stock.as_str(), Some("0"));
        // Records exist for the winners only, each with the units it asked.
        assert_eq!(count_keys(client, &key("req:*")).await, won.len());
        assert_eq!(count_keys(client, &key("user:*")).await, won.len());
        for &i in &won {
            let resv = key(&format!("resv:{}", reservation_id(i)));
            let q = client.command(&[b"HGET", resv.as_bytes(), b"quantity"]).await.unwrap();
            assert_eq!(q.as_str(), Some(quantity(i).to_string().as_str()), "winner {i}");
        }
    });
    drop(redis);
}
