//! Redis' own settings checked at start (issue 26 item 3; `logic::redis_settings`,
//! `io::redis::settings`), against real redis-server: a master whose `maxmemory-policy` is not
//! `noeviction` refuses the start with a message naming the setting and the fix; the explicit
//! override starts and says so (`/readyz`, `flashsale_redis_eviction_override`); the default
//! starts and `/readyz` and `/metrics` carry each master's persistence settings. The same on a
//! Redis Cluster: every master is read, the one that may evict is named.

use std::net::SocketAddr;

use flashsale_engine::app::serve::{self, ServeConfig, ServeHandle};
use flashsale_engine::logic::redis_settings::EvictionCheck;
use flashsale_tests::{migrated_database, nats, redis, redis_cluster, redis_cmd, HttpClient};
use serde_json::Value;

/// `serve::start` on `redis` (a seed) with the test configuration, tuned.
fn start(
    redis: SocketAddr,
    nats_url: &str,
    pg_url: &str,
    tune: impl FnOnce(&mut ServeConfig),
) -> anyhow::Result<ServeHandle> {
    let mut config = flashsale_tests::serve_config(redis, nats_url, pg_url);
    tune(&mut config);
    serve::start(config)
}

fn readyz(handle: &ServeHandle) -> Value {
    let r = HttpClient::connect(handle.admin_addr).request("GET", "/readyz", None, None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

fn metrics(handle: &ServeHandle) -> String {
    HttpClient::connect(handle.admin_addr).request("GET", "/metrics", None, None).body
}

#[test]
fn a_server_that_may_evict_refuses_the_start_unless_overridden() {
    let (redis, nats, db) = (redis(), nats(), migrated_database());
    assert_eq!(redis_cmd(&redis, &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]), "OK");
    let refused = start(redis.addr(), &nats.url(), &db.url, |_| {});
    let Err(why) = refused else { panic!("an evicting Redis must refuse the start") };
    let why = why.to_string();
    assert!(why.contains(&format!("{} has maxmemory-policy allkeys-lru", redis.addr())), "{why}");
    assert!(why.contains("CONFIG SET maxmemory-policy noeviction"), "the fix: {why}");
    assert!(
        why.contains("FLASHSALE_REDIS_ALLOW_EVICTION") && why.contains("allow_eviction"),
        "{why}"
    );

    // The explicit override: it starts, and says so.
    let handle = start(redis.addr(), &nats.url(), &db.url, |c| {
        c.edge.redis_eviction = EvictionCheck::Overridden;
    })
    .expect("the override starts");
    let ready = readyz(&handle);
    assert_eq!(ready["ready"], true, "{ready}");
    assert_eq!(ready["redis"]["eviction_override"], true, "{ready}");
    assert_eq!(ready["redis"]["nodes"][0]["maxmemory_policy"], "allkeys-lru", "{ready}");
    let text = metrics(&handle);
    assert!(text.contains("\nflashsale_redis_eviction_override 1\n"), "{text}");
    handle.shutdown();
}

#[test]
fn the_default_starts_and_reports_persistence() {
    let (redis, nats, db) = (redis(), nats(), migrated_database());
    // The stack starts Redis without persistence; turn on what a deployment would.
    assert_eq!(redis_cmd(&redis, &["CONFIG", "SET", "appendonly", "yes"]), "OK");
    assert_eq!(redis_cmd(&redis, &["CONFIG", "SET", "save", "60 1000"]), "OK");
    let handle = start(redis.addr(), &nats.url(), &db.url, |_| {}).expect("noeviction starts");
    let ready = readyz(&handle);
    let node = &ready["redis"]["nodes"][0];
    assert_eq!(ready["redis"]["eviction_override"], false, "{ready}");
    assert_eq!(node["node"], redis.addr().to_string(), "{ready}");
    assert_eq!(node["maxmemory_policy"], "noeviction", "{ready}");
    assert_eq!(
        (node["appendonly"].as_str(), node["appendfsync"].as_str()),
        (Some("yes"), Some("everysec"))
    );
    assert_eq!(node["save"], "60 1000", "{ready}");
    let text = metrics(&handle);
    assert!(text.contains("\nflashsale_redis_eviction_override 0\n"), "{text}");
    let info = format!(
        "flashsale_redis_settings_info{{node=\"{}\",maxmemory_policy=\"noeviction\",appendonly=\"yes\",appendfsync=\"everysec\",save=\"60 1000\"}} 1",
        redis.addr()
    );
    assert!(text.contains(&info), "{text}");
    handle.shutdown();
}

#[test]
fn every_master_of_a_cluster_is_checked() {
    let cluster = redis_cluster();
    let _drill = cluster.exclusive();
    let (nats, db) = (nats(), migrated_database());
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    let evicting = masters[2];
    let set = |policy: &str| {
        let reply = flashsale_tests::cluster::call(
            evicting,
            &["CONFIG", "SET", "maxmemory-policy", policy],
        );
        assert_eq!(reply.as_str(), Some("OK"), "{reply:?}");
    };
    set("volatile-lru");
    let seed = cluster.replica_of(masters[0]);
    let on_cluster = |c: &mut ServeConfig| {
        c.edge.redis_seeds = vec![seed];
        c.edge.redis.addr = seed;
    };
    let refused = start(seed, &nats.url(), &db.url, on_cluster);
    let why = refused.err().expect("one evicting master refuses the start").to_string();
    assert!(why.contains(&format!("{evicting} has maxmemory-policy volatile-lru")), "{why}");
    for other in &masters[..2] {
        assert!(!why.contains(&format!("{other} has")), "only the evicting master: {why}");
    }
    let handle = start(seed, &nats.url(), &db.url, |c| {
        on_cluster(c);
        c.edge.redis_eviction = EvictionCheck::Overridden;
    })
    .expect("the override starts on a cluster");
    let ready = readyz(&handle);
    let nodes = ready["redis"]["nodes"].as_array().expect("nodes").clone();
    let mut read: Vec<String> =
        nodes.iter().map(|n| n["node"].as_str().unwrap().to_owned()).collect();
    read.sort();
    let mut want: Vec<String> = masters.iter().map(ToString::to_string).collect();
    want.sort();
    assert_eq!(read, want, "every master read: {ready}");
    assert_eq!(ready["redis"]["eviction_override"], true);
    handle.shutdown();
    set("noeviction");
    let handle = start(seed, &nats.url(), &db.url, on_cluster).expect("all noeviction starts");
    assert_eq!(readyz(&handle)["redis"]["eviction_override"], false);
    handle.shutdown();
}
