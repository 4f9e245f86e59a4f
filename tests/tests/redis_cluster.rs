//! The Redis Cluster client (`flashsale_io::redis::{cluster, router}`) and replica fencing
//! against a real private cluster of 3 masters + 3 replicas, shared by this file (started
//! once, `flashsale_tests::redis_cluster`); each test uses SKUs of its own and the tests that
//! change the topology take the cluster's drill lock, so they run one at a time and heal the
//! cluster after themselves.
//!
//! What each test pins down:
//! - slots: our CRC16 slot of a key equals the server's `CLUSTER KEYSLOT`;
//! - routing: with ONE seed configured, SKUs on every master are reached, and a slot moved
//!   after the map was read is followed through `MOVED`;
//! - live resharding of a hot SKU's slot mid-traffic (SETSLOT MIGRATING/IMPORTING, MIGRATE,
//!   SETSLOT NODE): `TRYAGAIN`, `ASK` and `MOVED` are answered, and no reservation is lost or
//!   doubled (stock + reserved = initial, exactly);
//! - kill -9 of a master mid-traffic: calls for its SKUs fail as not-sent / unknown / fence
//!   short (never a reservation that then vanishes), other masters keep serving, the client
//!   finds the promoted replica, every buyer ends reserved exactly once;
//! - the loss drill: the replica's link cut and kept cut, reservations made, the master
//!   killed. With fencing every reservation the client was told about survives on the
//!   promoted replica and the others came back `FenceShort`; without fencing a reservation
//!   answered CREATED is missing after the failover (the drill can fail).
//!
//! Every reservation loop retries a request only with the SAME ids (request, reservation,
//! message), as the engine does on an unknown outcome.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flashsale_io::redis::fence::MinReplicaAcks;
use flashsale_io::redis::layout::ActivityStatus;
use flashsale_io::redis::router::{Router, RouterConfig};
use flashsale_io::redis::script::{
    Functions, PreheatArgs, PreheatReply, RequestState, ReserveArgs, ReserveReply, ScriptError,
    SkuKeys,
};
use flashsale_io::redis::slot::{Redirect, Slot};
use flashsale_io::redis::{RedisConfig, RedisError};
use flashsale_io::resp::Reply;
use flashsale_tests::cluster::call;
use flashsale_tests::SharedCluster;

const T0: u64 = 1_750_000_000_000;
const GRACE_MS: u64 = 2_000;

// ---- helpers ---------------------------------------------------------------------------------

fn cluster() -> &'static SharedCluster {
    flashsale_tests::redis_cluster()
}

/// SKUs of `activity` whose slot `master` serves, `count` of them, from `sku_from` on.
fn skus_on(master: SocketAddr, activity: u64, sku_from: u64, count: usize) -> Vec<SkuKeys> {
    let map = cluster().map();
    (sku_from..sku_from + 100_000)
        .map(|sku| SkuKeys::new(activity, sku))
        .filter(|keys| map.addr_of(keys.slot()) == Some(master))
        .take(count)
        .collect()
}

fn router_config(seeds: Vec<SocketAddr>, acks: MinReplicaAcks) -> RouterConfig {
    let mut node = RedisConfig::new(seeds[0]);
    node.in_flight_max = 1_024;
    node.reconnect_backoff_base = Duration::from_millis(20);
    node.reconnect_backoff_max = Duration::from_millis(200);
    RouterConfig { min_replica_acks: acks, ..RouterConfig::new(seeds, node) }
}

async fn functions(seeds: Vec<SocketAddr>, acks: MinReplicaAcks) -> Rc<Functions> {
    let router = Router::connect(router_config(seeds, acks)).await.expect("connect to the cluster");
    assert!(router.cluster().is_some(), "a cluster node must be detected as one");
    if let MinReplicaAcks::Auto = acks {
        // Every master of this cluster has a replica: the default rule must fence.
        assert_eq!(router.fence().min_replica_acks, 1, "{:?}", router.fence_warning());
    }
    let f = Functions::over(router);
    f.load_everywhere().await.expect("FUNCTION LOAD on every master");
    Rc::new(f)
}

async fn preheat(f: &Functions, keys: &SkuKeys, stock: u64) {
    let args = PreheatArgs {
        status: ActivityStatus::Active,
        start_ms: T0 - 1_000,
        end_ms: T0 + 3_600_000,
        version: 1,
        reservation_ttl_ms: 300_000,
        stock,
        max_per_buyer: 1,
    };
    // Preheat is idempotent; a cluster in motion may need a retry.
    for _ in 0..100 {
        match f.preheat(keys, &args).await {
            Ok(PreheatReply::Applied { .. } | PreheatReply::Stale { .. }) => return,
            Err(e) => eprintln!("preheat retry: {e}"),
        }
        glommio::timer::sleep(Duration::from_millis(50)).await;
    }
    panic!("preheat {} never succeeded", keys.prefix());
}

/// The ids of one buyer's one intent on one SKU, fixed before the first attempt.
struct Intent {
    user_id: u64,
    request_id: String,
    reservation_id: String,
    message_id: String,
    payload_hash: String,
}

impl Intent {
    fn new(keys: &SkuKeys, user_id: u64) -> Intent {
        let tag = keys.prefix().trim_start_matches("seckill:").trim_end_matches(':');
        let tag = tag.replace(['{', '}', ':'], "");
        Intent {
            user_id,
            request_id: format!("r{user_id}"),
            reservation_id: format!("v{tag}u{user_id}"),
            message_id: format!("m{tag}u{user_id}"),
            payload_hash: format!("h{user_id}"),
        }
    }

    fn args(&self) -> ReserveArgs<'_> {
        ReserveArgs {
            request_id: &self.request_id,
            user_id: self.user_id,
            payload_hash: &self.payload_hash,
            reservation_id: &self.reservation_id,
            message_id: &self.message_id,
            now_ms: T0,
            pending_grace_ms: GRACE_MS,
            quantity: 1,
        }
    }
}

/// One attempt's outcome, as the engine would classify it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Attempt {
    /// A reservation the buyer may be told about: CREATED, or a replay of a queued one.
    Reserved {
        created: bool,
    },
    SoldOut,
    /// Nothing ran (SYSTEM_BUSY).
    NotSent,
    /// It may have run (UNKNOWN): retry with the same ids.
    Unknown,
    /// It ran on the master but replicas did not confirm it (UNKNOWN).
    FenceShort,
    /// A transient server refusal (CLUSTERDOWN, TRYAGAIN, READONLY...): nothing ran.
    Busy,
    Other(String),
}

fn classify(result: Result<ReserveReply, ScriptError>) -> Attempt {
    match result {
        Ok(ReserveReply::Created { .. }) => Attempt::Reserved { created: true },
        Ok(ReserveReply::Idempotent { state: RequestState::QueuedPending, .. }) => {
            Attempt::Reserved { created: false }
        }
        Ok(ReserveReply::SoldOut) => Attempt::SoldOut,
        Ok(other) => Attempt::Other(format!("{other:?}")),
        Err(ScriptError::FenceShort { .. }) => Attempt::FenceShort,
        Err(ScriptError::Redis(e)) if e.outcome_unknown() => Attempt::Unknown,
        Err(ScriptError::Redis(RedisError::NotSent(_) | RedisError::Full)) => Attempt::NotSent,
        Err(e) if e.is_transient() && !e.outcome_unknown() => Attempt::Busy,
        Err(e) => Attempt::Other(e.to_string()),
    }
}

/// Tries `intent` until it is reserved (or sold out), retrying with the same ids; each
/// attempt's outcome is handed to `seen`. Gives up after `deadline`.
async fn reserve_until_definite(
    f: &Functions,
    keys: &SkuKeys,
    intent: &Intent,
    deadline: Instant,
    mut seen: impl FnMut(&Attempt),
) -> Attempt {
    loop {
        let attempt = classify(f.reserve(keys, &intent.args()).await);
        seen(&attempt);
        match attempt {
            Attempt::Reserved { .. } | Attempt::SoldOut => return attempt,
            Attempt::Other(what) => panic!("{}: unexpected {what}", intent.request_id),
            _ if Instant::now() > deadline => return attempt,
            _ => glommio::timer::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Raw read of a SKU key on the master that serves it now (a replica's view of the map can
/// lag a manual SETSLOT by a gossip round: one MOVED is followed).
fn get(keys: &SkuKeys, suffix: &str) -> Reply {
    let master = cluster().master_of(keys.slot());
    let key = format!("{}{suffix}", keys.prefix());
    let reply = call(master, &["GET", &key]);
    match reply.as_error().and_then(|m| Redirect::parse(m, master.ip())) {
        Some(Redirect::Moved { addr, .. }) => call(addr, &["GET", &key]),
        _ => reply,
    }
}

fn stock(keys: &SkuKeys) -> u64 {
    let reply = get(keys, "stock");
    reply.as_str().and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("stock: {reply:?}"))
}

fn exists(node: SocketAddr, key: &str) -> bool {
    call(node, &["EXISTS", key]) == Reply::Integer(1)
}

fn resv_key(keys: &SkuKeys, intent: &Intent) -> String {
    format!("{}resv:{}", keys.prefix(), intent.reservation_id)
}

/// Heals the cluster when a drill ends, passed or failed, so the next test finds six healthy
/// nodes.
struct HealOnDrop;

impl Drop for HealOnDrop {
    fn drop(&mut self) {
        let healed = std::panic::catch_unwind(|| cluster().heal());
        if healed.is_err() {
            eprintln!("could not heal the cluster after a drill");
        }
    }
}

// ---- slots -----------------------------------------------------------------------------------

#[test]
fn our_slot_of_a_key_is_the_servers() {
    // Stable nodes: no drill may kill this one meanwhile.
    let _drill = cluster().exclusive();
    let node = cluster().masters()[0];
    let mut keys: Vec<String> =
        vec!["{10001:20001}".into(), "seckill:active-skus".into(), "foo{}{bar}".into()];
    keys.extend((0..200).map(|i| format!("seckill:{{{}:{}}}:stock", 10_000 + i, 7 * i)));
    keys.extend((0..50).map(|i| format!("k{i}{{{i}x")));
    for key in &keys {
        let server = call(node, &["CLUSTER", "KEYSLOT", key]).as_int().unwrap();
        assert_eq!(i64::from(Slot::of_key(key.as_bytes()).get()), server, "{key}");
    }
    assert_eq!(SkuKeys::new(10001, 20001).slot().get(), 13039);
    assert_eq!(Slot::of_key(b"seckill:active-skus").get(), 15413);
}

// ---- routing ---------------------------------------------------------------------------------

#[test]
fn one_seed_reaches_every_master_and_follows_moved() {
    let c = cluster();
    let _drill = c.exclusive();
    // Start from six healthy nodes whatever drill ran before.
    c.heal();
    let masters = c.masters();
    assert_eq!(masters.len(), 3);
    let per_master: Vec<(SocketAddr, Vec<SkuKeys>)> =
        masters.iter().map(|&m| (m, skus_on(m, 71_001, 1, 2))).collect();
    // One more SKU whose (empty) slot is moved to another master after the client read the
    // map: the client's first call for it meets MOVED.
    let moved_sku = skus_on(masters[0], 71_002, 1, 1).remove(0);
    let one_seed = vec![c.seeds()[5]];
    flashsale_tests::glommio(move || async move {
        let f = functions(one_seed, MinReplicaAcks::Auto).await;
        let cluster_client = f.router().cluster().unwrap();
        let version_before = cluster_client.topology_version();
        // The documented sequence even for an empty slot: SETSLOT NODE on a node that was not
        // IMPORTING does not bump its config epoch, so after the failover drills (higher epochs
        // elsewhere) gossip could hand the slot back and the nodes MOVED each other forever
        // ("too many cluster redirects": seen once in 20 runs).
        cluster().begin_migration(moved_sku.slot(), masters[0], masters[1]);
        cluster().finish_migration(moved_sku.slot(), masters[0], masters[1]);
        for keys in per_master.iter().flat_map(|(_, skus)| skus).chain([&moved_sku]) {
            preheat(&f, keys, 10).await;
            let intent = Intent::new(keys, 1);
            let result = f.reserve(keys, &intent.args()).await;
            assert!(
                matches!(result, Ok(ReserveReply::Created { stock_after: 9, .. })),
                "{result:?}"
            );
        }
        for (master, skus) in &per_master {
            for keys in skus {
                assert_eq!(cluster_client.node_of(keys.slot()), Some(*master));
                let on_master = call(*master, &["GET", keys.stock()]);
                assert_eq!(on_master.as_str(), Some("9"), "the reservation landed on {master}");
            }
        }
        let stats = cluster_client.stats();
        eprintln!("routing stats: {stats:?}");
        assert!(stats.moved_total >= 1, "the moved slot must have been redirected");
        assert_eq!(cluster_client.node_of(moved_sku.slot()), Some(masters[1]));
        assert!(cluster_client.topology_version() > version_before);
        assert_eq!(stock(&moved_sku), 9);
    });
}

// ---- live resharding -------------------------------------------------------------------------

#[test]
fn live_resharding_of_a_hot_sku_loses_and_doubles_nothing() {
    const USERS: u64 = 400;
    const STOCK: u64 = 1_000;
    let c = cluster();
    let _drill = c.exclusive();
    let masters = c.masters();
    let (from, to) = (masters[0], masters[1]);
    let keys = skus_on(from, 72_001, 1, 1).remove(0);
    let slot = keys.slot();
    let reserved = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let migrator = {
        let (reserved, done) = (Arc::clone(&reserved), Arc::clone(&done));
        std::thread::spawn(move || {
            while reserved.load(Ordering::Relaxed) < 50 && !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(2));
            }
            let c = cluster();
            c.begin_migration(slot, from, to);
            std::thread::sleep(Duration::from_millis(150));
            let moved = c.migrate_keys(slot, from, to);
            std::thread::sleep(Duration::from_millis(150));
            c.finish_migration(slot, from, to);
            eprintln!("migrated slot {} ({moved} keys) {from} -> {to}", slot.get());
            moved
        })
    };
    let (outcomes, stats) = {
        let keys = keys.clone();
        let reserved = Arc::clone(&reserved);
        flashsale_tests::glommio(move || async move {
            let f = functions(cluster().seeds(), MinReplicaAcks::Auto).await;
            preheat(&f, &keys, STOCK).await;
            let keys = Rc::new(keys);
            let deadline = Instant::now() + Duration::from_secs(30);
            let tasks: Vec<_> = (0..16)
                .map(|t| {
                    let (f, keys, reserved) =
                        (Rc::clone(&f), Rc::clone(&keys), Arc::clone(&reserved));
                    glommio::spawn_local(async move {
                        let mut outcomes = Vec::new();
                        for user in (t..USERS).step_by(16) {
                            let intent = Intent::new(&keys, user + 1);
                            let final_attempt =
                                reserve_until_definite(&f, &keys, &intent, deadline, |_| {}).await;
                            reserved.fetch_add(1, Ordering::Relaxed);
                            outcomes.push((intent, final_attempt));
                            glommio::timer::sleep(Duration::from_millis(3)).await;
                        }
                        outcomes
                    })
                })
                .collect();
            let mut outcomes = Vec::new();
            for task in tasks {
                outcomes.extend(task.await);
            }
            (outcomes, f.router().cluster().unwrap().stats())
        })
    };
    done.store(true, Ordering::Relaxed);
    let moved = migrator.join().unwrap();
    eprintln!("resharding stats: {stats:?}");
    assert!(moved >= 4, "the SKU's keys were migrated ({moved})");
    assert_eq!(c.master_of(slot), to);
    for (intent, attempt) in &outcomes {
        assert!(matches!(attempt, Attempt::Reserved { .. }), "{}: {attempt:?}", intent.request_id);
        assert!(exists(to, &resv_key(&keys, intent)), "{} lost", intent.reservation_id);
    }
    // Exactly one unit per buyer: nothing lost, nothing reserved twice.
    assert_eq!(stock(&keys) + USERS, STOCK, "stock + reserved = initial");
    let pending = call(to, &["ZCARD", keys.pending()]);
    assert_eq!(pending, Reply::Integer(USERS as i64), "one pending entry per reservation");
    assert!(stats.tryagain_total >= 1, "TRYAGAIN during the migration: {stats:?}");
    assert!(stats.ask_total >= 1, "ASK during the migration: {stats:?}");
    assert!(stats.moved_total >= 1, "MOVED after it: {stats:?}");
}

// ---- failover --------------------------------------------------------------------------------

/// Per SKU group: attempts by class during the gap, and when the first success after the
/// kill came.
#[derive(Debug, Default)]
struct GapLog {
    by_class: HashMap<String, u64>,
    successes_in_gap: u64,
    first_success_after_kill: Option<Duration>,
}

#[test]
fn kill_of_a_master_mid_traffic_fails_closed_then_follows_the_replica() {
    const USERS_PER_SKU: u64 = 150;
    const STOCK: u64 = 1_000;
    let c = cluster();
    let _drill = c.exclusive();
    let _heal = HealOnDrop;
    let masters = c.masters();
    let victim = masters[0];
    let replica = c.replica_of(victim);
    let hit = skus_on(victim, 73_001, 1, 2);
    let spared: Vec<SkuKeys> = skus_on(masters[1], 73_001, 1, 1)
        .into_iter()
        .chain(skus_on(masters[2], 73_001, 1, 1))
        .collect();
    let started = Arc::new(AtomicU64::new(0));
    let killed_at_ms = Arc::new(AtomicU64::new(0));
    let heal_started_ms = Arc::new(AtomicU64::new(0));
    let epoch = Instant::now();
    let killer = {
        let (started, killed_at_ms) = (Arc::clone(&started), Arc::clone(&killed_at_ms));
        let heal_started_ms = Arc::clone(&heal_started_ms);
        std::thread::spawn(move || {
            while started.load(Ordering::Relaxed) < 40 {
                std::thread::sleep(Duration::from_millis(2));
            }
            cluster().kill(victim);
            killed_at_ms.store(epoch.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
            let promoted = cluster().wait_promoted(replica, Duration::from_secs(30));
            // The promoted replica has no replica of its own: with fencing on, nothing it
            // reserves can be promised until redundancy is back. Restore it, as an operator
            // (or an orchestrator) would: the killed node rejoins as its replica.
            // A second with the promoted master alone: fenced reservations must all come back
            // short (nothing may be promised without a replica), which the gap log checks.
            std::thread::sleep(Duration::from_secs(1));
            let healing = Instant::now();
            heal_started_ms.store(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
            cluster().heal();
            (promoted, healing.elapsed())
        })
    };
    let all: Vec<(bool, SkuKeys)> = hit
        .iter()
        .map(|k| (true, k.clone()))
        .chain(spared.iter().map(|k| (false, k.clone())))
        .collect();
    let (outcomes, logs) = {
        let (all, started, killed_at_ms) =
            (all.clone(), Arc::clone(&started), Arc::clone(&killed_at_ms));
        flashsale_tests::glommio(move || async move {
            let f = functions(cluster().seeds(), MinReplicaAcks::Auto).await;
            for (_, keys) in &all {
                preheat(&f, keys, STOCK).await;
            }
            let logs = Rc::new(std::cell::RefCell::new([GapLog::default(), GapLog::default()]));
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut tasks = Vec::new();
            for (is_hit, keys) in all {
                let keys = Rc::new(keys);
                for lane in 0..4u64 {
                    let (f, keys, logs) = (Rc::clone(&f), Rc::clone(&keys), Rc::clone(&logs));
                    let (started, killed_at_ms) = (Arc::clone(&started), Arc::clone(&killed_at_ms));
                    tasks.push(glommio::spawn_local(async move {
                        let mut outcomes = Vec::new();
                        for user in (lane..USERS_PER_SKU).step_by(4) {
                            let intent = Intent::new(&keys, user + 1);
                            started.fetch_add(1, Ordering::Relaxed);
                            let attempt =
                                reserve_until_definite(&f, &keys, &intent, deadline, |a| {
                                    note(&logs, is_hit, a, &killed_at_ms, epoch)
                                })
                                .await;
                            outcomes.push(((*keys).clone(), intent, attempt));
                            glommio::timer::sleep(Duration::from_millis(5)).await;
                        }
                        outcomes
                    }));
                }
            }
            let mut outcomes = Vec::new();
            for task in tasks {
                outcomes.extend(task.await);
            }
            let logs = std::mem::take(&mut *logs.borrow_mut());
            (outcomes, logs)
        })
    };
    let (promoted_after, healed_in) = killer.join().unwrap();
    eprintln!("old master back as a replica and in sync {healed_in:?} after the promotion");
    let [hit_log, spared_log] = logs;
    eprintln!("replica promoted {promoted_after:?} after the kill");
    eprintln!("hit SKUs during the gap: {hit_log:?}");
    eprintln!("spared SKUs during the gap: {spared_log:?}");
    // During the gap the victim's SKUs got only "nothing ran" / "maybe" answers...
    for class in hit_log.by_class.keys() {
        assert!(
            ["NotSent", "Unknown", "FenceShort", "Busy"].contains(&class.as_str()),
            "unexpected class during the gap: {class}"
        );
    }
    assert!(!hit_log.by_class.is_empty(), "the kill was felt: {hit_log:?}");
    // ...while the other masters kept serving theirs.
    assert!(spared_log.successes_in_gap > 0, "other masters served during the gap");
    let recovered = hit_log.first_success_after_kill.expect("the victim's SKUs recovered");
    eprintln!("first reservation on the victim's SKUs {recovered:?} after the kill");
    let killed = Duration::from_millis(killed_at_ms.load(Ordering::Relaxed) - 1);
    let healing = Duration::from_millis(heal_started_ms.load(Ordering::Relaxed));
    assert!(
        killed + recovered >= healing,
        "a reservation was confirmed {:?} after the kill, before the promoted master had a \
         replica again ({:?} after the kill)",
        recovered,
        healing - killed
    );
    // Every buyer reserved exactly once, on whichever master serves the SKU now.
    for (keys, intent, attempt) in &outcomes {
        assert!(matches!(attempt, Attempt::Reserved { .. }), "{}: {attempt:?}", intent.request_id);
        let master = c.master_of(keys.slot());
        assert!(exists(master, &resv_key(keys, intent)), "{} lost", intent.reservation_id);
    }
    for (_, keys) in &all {
        assert_eq!(
            stock(keys) + USERS_PER_SKU,
            STOCK,
            "{}: stock + reserved = initial",
            keys.prefix()
        );
    }
}

/// Logs an attempt made after the kill and before the victim's SKUs' first success again
/// (the gap); that first success ends the gap.
fn note(
    logs: &std::cell::RefCell<[GapLog; 2]>,
    is_hit: bool,
    attempt: &Attempt,
    killed_at_ms: &AtomicU64,
    epoch: Instant,
) {
    let killed = killed_at_ms.load(Ordering::Relaxed);
    if killed == 0 {
        return;
    }
    let since_kill = epoch.elapsed().saturating_sub(Duration::from_millis(killed - 1));
    let mut logs = logs.borrow_mut();
    if logs[0].first_success_after_kill.is_some() {
        return; // the gap is over
    }
    let reserved = matches!(attempt, Attempt::Reserved { .. });
    let class = match attempt {
        Attempt::Reserved { .. } => "Reserved",
        Attempt::NotSent => "NotSent",
        Attempt::Unknown => "Unknown",
        Attempt::FenceShort => "FenceShort",
        Attempt::Busy => "Busy",
        Attempt::SoldOut => "SoldOut",
        Attempt::Other(_) => "Other",
    };
    let log = &mut logs[usize::from(!is_hit)];
    if !(is_hit && reserved) {
        *log.by_class.entry(class.to_owned()).or_default() += 1;
    }
    if reserved {
        log.successes_in_gap += 1;
        if is_hit {
            log.first_success_after_kill = Some(since_kill);
        }
    }
}

// ---- the loss drill --------------------------------------------------------------------------

struct LossDrill {
    /// Answered CREATED with the fence holding (or unfenced): the buyer would be told.
    confirmed: Vec<Intent>,
    /// Answered FenceShort: the buyer would be told UNKNOWN.
    unconfirmed: Vec<Intent>,
    /// Confirmed reservations the promoted replica does not have.
    missing: Vec<String>,
    promoted_after: Duration,
}

/// Cuts `victim`'s replica link, makes reservations, kills `victim`, and checks the promoted
/// replica for what the client was told.
fn loss_drill(acks: MinReplicaAcks, activity: u64) -> LossDrill {
    let c = cluster();
    let victim = c.masters()[0];
    let replica = c.replica_of(victim);
    let keys = skus_on(victim, activity, 1, 1).remove(0);
    let heal = HealOnDrop;
    let drill = flashsale_tests::glommio(move || async move {
        let f = functions(cluster().seeds(), acks).await;
        preheat(&f, &keys, 100).await;
        let mut drill = LossDrill {
            confirmed: Vec::new(),
            unconfirmed: Vec::new(),
            missing: Vec::new(),
            promoted_after: Duration::ZERO,
        };
        let mut record =
            |intent: Intent, result: Result<ReserveReply, ScriptError>| match classify(result) {
                Attempt::Reserved { created: true } => drill.confirmed.push(intent),
                Attempt::FenceShort => drill.unconfirmed.push(intent),
                other => panic!("{}: {other:?}", intent.request_id),
            };
        for user in 1..=5 {
            let intent = Intent::new(&keys, user);
            let result = f.reserve(&keys, &intent.args()).await;
            record(intent, result);
        }
        cluster().cut_replica_link(victim);
        for user in 6..=15 {
            let intent = Intent::new(&keys, user);
            let result = f.reserve(&keys, &intent.args()).await;
            record(intent, result);
        }
        cluster().kill(victim);
        drill.promoted_after = cluster().wait_promoted(replica, Duration::from_secs(30));
        for intent in &drill.confirmed {
            if !exists(replica, &resv_key(&keys, intent)) {
                drill.missing.push(intent.reservation_id.clone());
            }
        }
        // Redundancy back (the old master rejoins as the new one's replica), so fenced
        // reservations can be confirmed again.
        cluster().heal();
        // The client follows the failover: a fresh buyer is served by the promoted replica.
        let probe = Intent::new(&keys, 1_000);
        let deadline = Instant::now() + Duration::from_secs(20);
        let attempt = reserve_until_definite(&f, &keys, &probe, deadline, |_| {}).await;
        assert!(matches!(attempt, Attempt::Reserved { .. }), "after failover: {attempt:?}");
        assert_eq!(f.router().cluster().unwrap().node_of(keys.slot()), Some(replica));
        // An unconfirmed one is retried with the same ids: it ends reserved once, with the
        // same reservation id (never a second one for the same request).
        for intent in &drill.unconfirmed {
            let attempt = reserve_until_definite(&f, &keys, intent, deadline, |_| {}).await;
            assert!(matches!(attempt, Attempt::Reserved { .. }), "retry: {attempt:?}");
            assert!(exists(replica, &resv_key(&keys, intent)));
        }
        drill
    });
    drop(heal);
    drill
}

#[test]
fn loss_drill_with_fencing_every_confirmed_reservation_survives_failover() {
    let c = cluster();
    let _drill = c.exclusive();
    let drill = loss_drill(MinReplicaAcks::Exactly(1), 74_001);
    eprintln!(
        "fenced: {} confirmed, {} fence-short, missing {:?}, promoted after {:?}",
        drill.confirmed.len(),
        drill.unconfirmed.len(),
        drill.missing,
        drill.promoted_after
    );
    assert_eq!(drill.confirmed.len(), 5, "the reservations before the cut were confirmed");
    assert_eq!(drill.unconfirmed.len(), 10, "every reservation after the cut is fence-short");
    assert!(drill.missing.is_empty(), "confirmed reservations lost: {:?}", drill.missing);
}

#[test]
fn loss_drill_without_fencing_loses_a_created_reservation() {
    let c = cluster();
    let _drill = c.exclusive();
    let drill = loss_drill(MinReplicaAcks::Exactly(0), 75_001);
    eprintln!(
        "unfenced: {} confirmed, missing {} after failover ({:?}), promoted after {:?}",
        drill.confirmed.len(),
        drill.missing.len(),
        drill.missing,
        drill.promoted_after
    );
    assert_eq!(drill.confirmed.len(), 15, "without fencing every CREATED is passed on");
    assert!(!drill.missing.is_empty(), "the drill must show the loss fencing prevents");
}
