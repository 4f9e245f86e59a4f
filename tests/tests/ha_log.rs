//! The replicated log on a 3-node JetStream cluster (nats-server 2.9, `stack::nats_cluster`):
//! `[log] replicas = 3` makes every stream and the mode bucket R3 through `serve` (durable
//! side and worker); a lower setting against existing R3 streams is refused at start, naming
//! the setting; raising a stream's replicas is an update; the placement gauges follow the
//! peers; kill -9 of a stream leader mid-publish makes publishes fail, then resume, with
//! `Nats-Msg-Id` dedup intact; and the engine with a sale running while the stream leader,
//! the consumer leader and the meta leader are killed in turn; and a node cut off without a
//! reset (a partition) left by the client within seconds.
//!
//! The tests of this file share one cluster (created by the first, stopped after the last)
//! and take turns on it; each leaves it healthy (a killed node restarted, peers current).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use flashsale_engine::app::chaos::proxy::Proxy;
use flashsale_engine::app::config::{Config, Env, Overrides};
use flashsale_engine::app::serve;
use flashsale_io::jetstream::async_nats::jetstream::stream;
use flashsale_io::jetstream::{Log, LogConfig, ORDERS_STREAM, REPLICATED_STREAMS};
use flashsale_tests::sale::{self, assert_promise_kept, Buyers};
use flashsale_tests::{nats_cluster, PrivateNatsCluster};

static SHARED: Mutex<Weak<Mutex<PrivateNatsCluster>>> = Mutex::new(Weak::new());

/// The file's cluster: the running one, or a new one when no test holds it.
fn shared_cluster() -> Arc<Mutex<PrivateNatsCluster>> {
    let mut slot = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(cluster) = slot.upgrade() {
        return cluster;
    }
    let cluster = Arc::new(Mutex::new(nats_cluster()));
    *slot = Arc::downgrade(&cluster);
    cluster
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn replicated(url: &str, replicas: usize) -> LogConfig {
    LogConfig { url: url.to_owned(), replicas, publish_timeout_ms: 1_000, ..LogConfig::default() }
}

/// A new R3 stream of the test's own, `HA_<tag>_<random>` on one subject (15 min duplicate
/// window), once all three peers are current; its (name, subject).
async fn scratch_stream(log: &Log, tag: &str) -> (String, String) {
    let name = format!("HA_{tag}_{}", rand::random::<u32>());
    let subject = format!("ha.{}.{name}", tag.to_lowercase());
    let config = stream::Config {
        name: name.clone(),
        subjects: vec![subject.clone()],
        num_replicas: 3,
        duplicate_window: Duration::from_secs(15 * 60),
        ..Default::default()
    };
    log.ensure_stream(config).await.expect("R3 stream");
    wait_current_peers(log, &name, 3).await;
    (name, subject)
}

/// A gauge's value in a Prometheus exposition, if present.
fn gauge(text: &str, prefix: &str) -> Option<f64> {
    text.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// (configured, current) replicas of `stream` as /metrics shows them.
fn placement_gauges(metrics: &str, stream: &str) -> (Option<f64>, Option<f64>) {
    (
        gauge(metrics, &format!("flashsale_log_stream_replicas{{stream=\"{stream}\"}}")),
        gauge(metrics, &format!("flashsale_log_stream_replicas_current{{stream=\"{stream}\"}}")),
    )
}

/// Waits until `stream` has `peers` current peers (leader included) per its stream info.
async fn wait_current_peers(log: &Log, stream: &str, peers: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let current = match log.context().get_stream(stream).await {
            Ok(s) => s.cached_info().cluster.as_ref().map_or(0, |c| {
                usize::from(c.leader.is_some())
                    + c.replicas.iter().filter(|p| p.current && !p.offline).count()
            }),
            Err(_) => 0,
        };
        if current == peers {
            return;
        }
        assert!(Instant::now() < deadline, "{stream}: {current} current peers, want {peers}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn log_replicas_3_makes_every_stream_r3_and_the_placement_gauges_follow_the_peers() {
    let shared = shared_cluster();
    let mut cluster = shared.lock().unwrap_or_else(PoisonError::into_inner);
    cluster.wait_healthy(Duration::from_secs(30)).expect("healthy");
    let redis = flashsale_tests::redis();
    let db = flashsale_tests::migrated_database();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flashsale.toml");
    let toml = format!(
        "[nats]\nurl = \"{}\"\n[pg]\nurl = \"{}\"\n[log]\nreplicas = 3\n",
        cluster.url(),
        db.url
    );
    std::fs::write(&path, toml).unwrap();
    let config = Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).unwrap();
    assert_eq!(config.log.replicas, 3);
    let mut serve_config =
        flashsale_tests::serve_config(redis.addr(), &config.nats_url, &config.pg_url);
    serve_config.durable = serve::durable_config(&config);
    let mut worker = serve::worker_config(&config);
    worker.pg.pool_size = 8;
    worker.runtime_threads = 1;
    worker.order_writers = 2;
    worker.fetch_wait_ms = 50;
    assert_eq!(worker.log.replicas, 3, "the worker gets the same LogConfig");
    serve_config.worker = Some(worker);
    serve_config.render_extra = Some(flashsale_tests::prometheus_render());
    let handle = serve::start(serve_config).expect("serve starts on the cluster with R3");

    for stream in REPLICATED_STREAMS {
        assert_eq!(cluster.stream_replicas(stream), Some(3), "{stream} as /jsz shows it");
    }
    // The starter's leader look-ups name nodes of the cluster.
    let names: Vec<String> = cluster.nodes().iter().map(|n| n.name.clone()).collect();
    for leader in [
        cluster.meta_leader(),
        cluster.stream_leader(ORDERS_STREAM),
        cluster.consumer_leader(ORDERS_STREAM, flashsale_io::jetstream::ORDER_WRITER_CONSUMER),
    ] {
        assert!(leader.as_ref().is_some_and(|l| names.contains(l)), "{leader:?} in {names:?}");
    }
    let metrics = || {
        flashsale_tests::HttpClient::connect(handle.admin_addr)
            .request("GET", "/metrics", None, None)
            .body
    };
    let started = Instant::now();
    flashsale_tests::wait_for_ms("placement gauges 3/3 for every stream", 30_000, || {
        let text = metrics();
        REPLICATED_STREAMS.iter().all(|s| placement_gauges(&text, s) == (Some(3.0), Some(3.0)))
    });
    println!("placement gauges at 3/3 after {:?}", started.elapsed());

    // One follower of SECKILL_ORDERS dies: configured stays 3, current drops to 2.
    let leader = cluster.stream_leader(ORDERS_STREAM).expect("orders leader");
    let victim = (0..cluster.nodes().len())
        .find(|&i| cluster.nodes()[i].name != leader)
        .expect("a follower");
    let killed_at = Instant::now();
    cluster.kill(victim).expect("kill -9 of a follower");
    flashsale_tests::wait_for_ms("current replicas 2 after a follower died", 60_000, || {
        placement_gauges(&metrics(), ORDERS_STREAM) == (Some(3.0), Some(2.0))
    });
    println!("current replicas of {ORDERS_STREAM} read 2 after {:?}", killed_at.elapsed());
    cluster.restart(victim).expect("restart the follower");
    let restarted_at = Instant::now();
    flashsale_tests::wait_for_ms("current replicas back to 3", 60_000, || {
        placement_gauges(&metrics(), ORDERS_STREAM) == (Some(3.0), Some(3.0))
    });
    println!("current replicas back at 3 after {:?}", restarted_at.elapsed());
    handle.shutdown();
    cluster.wait_healthy(Duration::from_secs(30)).expect("healthy again");
}

#[test]
fn a_lower_replicas_setting_against_existing_r3_streams_is_refused_at_start_naming_it() {
    let shared = shared_cluster();
    let cluster = shared.lock().unwrap_or_else(PoisonError::into_inner);
    cluster.wait_healthy(Duration::from_secs(30)).expect("healthy");
    let rt = runtime();
    let url = cluster.url();
    rt.block_on(async {
        let log = Log::connect(&replicated(&url, 3)).await.expect("connect");
        log.ensure_streams().await.expect("R3 streams");
        log.mode_store().await.expect("R3 mode bucket");
    });
    let dir = tempfile::tempdir().unwrap();
    let env: Env = [
        ("FLASHSALE_NATS_URL".to_owned(), url.clone()),
        ("FLASHSALE_LOG_REPLICAS".to_owned(), "1".to_owned()),
    ]
    .into_iter()
    .collect();
    let config = Config::load(None, &env, &Overrides::default(), dir.path()).unwrap();
    assert_eq!(config.log.replicas, 1);
    // The log is the first thing the durable side sets up: nothing else is needed to fail.
    let unused: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
    let mut serve_config = flashsale_tests::serve_config(unused, &url, &config.pg_url);
    serve_config.durable = serve::durable_config(&config);
    let error = match serve::start(serve_config) {
        Ok(_) => panic!("serve must refuse to lower R3 streams"),
        Err(e) => format!("{e:#}"),
    };
    for needle in ["FLASHSALE_LOG_REPLICAS", "[log] replicas", "current 3", "SECKILL_ORDERS"] {
        assert!(error.contains(needle), "{needle} missing from: {error}");
    }
    let error = match flashsale_pg_worker::worker::start(serve::worker_config(&config)) {
        Ok(_) => panic!("the worker must refuse too"),
        Err(e) => e.to_string(),
    };
    assert!(error.contains("FLASHSALE_LOG_REPLICAS") && error.contains("current 3"), "{error}");
    for stream in REPLICATED_STREAMS {
        assert_eq!(cluster.stream_replicas(stream), Some(3), "{stream} was not lowered");
    }
}

#[test]
fn raising_an_existing_streams_replicas_is_an_update_on_nats_2_9() {
    let shared = shared_cluster();
    let cluster = shared.lock().unwrap_or_else(PoisonError::into_inner);
    cluster.wait_healthy(Duration::from_secs(30)).expect("healthy");
    let url = cluster.url();
    runtime().block_on(async {
        let log = Log::connect(&replicated(&url, 1)).await.expect("connect");
        let name = format!("HA_RAISE_{}", rand::random::<u32>());
        let config = |replicas| stream::Config {
            name: name.clone(),
            subjects: vec![format!("ha.raise.{name}")],
            num_replicas: replicas,
            ..Default::default()
        };
        log.ensure_stream(config(1)).await.expect("R1");
        wait_current_peers(&log, &name, 1).await;
        let raised_at = Instant::now();
        log.ensure_stream(config(3)).await.expect("raising R1 to R3 is an update");
        let info = log.context().get_stream(&name).await.expect("info");
        assert_eq!(info.cached_info().config.num_replicas, 3);
        wait_current_peers(&log, &name, 3).await;
        println!("R1 -> R3 with 3 current peers after {:?}", raised_at.elapsed());
        let lowered = log.ensure_stream(config(1)).await;
        assert!(lowered.is_err_and(|e| e.to_string().contains("never lowered")));
        // Best effort: right after a scale-up the delete request can outlast its timeout, and
        // a leftover stream in this private cluster harms no other test.
        let _ = log.context().delete_stream(&name).await;
    });
}

#[test]
fn kill_9_of_the_stream_leader_mid_publish_publishes_fail_then_resume_and_dedup_holds() {
    const MESSAGES: usize = 100;
    const KILL_AT: usize = 30;
    let shared = shared_cluster();
    let mut cluster = shared.lock().unwrap_or_else(PoisonError::into_inner);
    cluster.wait_healthy(Duration::from_secs(30)).expect("healthy");
    let rt = runtime();
    let log = rt.block_on(Log::connect(&replicated(&cluster.url(), 3))).expect("connect");
    let (name, subject) = rt.block_on(scratch_stream(&log, "KILL"));
    let publisher = log.publisher();
    let publish = |i: usize| {
        rt.block_on(publisher.publish(
            &subject,
            &format!("m-{i}"),
            None,
            &[],
            Bytes::from(i.to_string()),
        ))
    };
    let (mut failures, mut killed) = (0usize, None);
    let mut outage = Duration::ZERO;
    for i in 0..MESSAGES {
        if i == KILL_AT {
            let leader = cluster.stream_leader(&name).expect("stream leader");
            let index = cluster.index_of(&leader).expect("leader is a node");
            cluster.kill(index).expect("kill -9 of the stream leader");
            killed = Some((index, Instant::now()));
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match publish(i) {
                Ok(_) => break,
                Err(e) => {
                    assert!(e.is_transient(), "{e}");
                    assert!(Instant::now() < deadline, "publishes did not resume: {e}");
                    failures += 1;
                }
            }
        }
        if i == KILL_AT {
            outage = killed.map_or(Duration::ZERO, |(_, at)| at.elapsed());
        }
    }
    println!("leader killed: first acked publish after {outage:?}; {failures} failed attempts");
    assert!(failures > 0, "publishes must fail while the stream has no leader");
    rt.block_on(async {
        // Every id again, on the new leader: all duplicates, nothing stored twice (a publish
        // whose ack was lost in the change and was retried is in the stream once).
        for i in 0..MESSAGES {
            let ack = publisher
                .publish(&subject, &format!("m-{i}"), None, &[], Bytes::from(i.to_string()))
                .await
                .expect("republish");
            assert!(ack.duplicate, "m-{i} stored twice");
        }
        let info = log.context().get_stream(&name).await.expect("info");
        assert_eq!(info.cached_info().state.messages, MESSAGES as u64);
    });
    let (index, _) = killed.expect("killed");
    cluster.restart(index).expect("restart the old leader");
    cluster.wait_healthy(Duration::from_secs(30)).expect("healthy again");
    rt.block_on(async {
        wait_current_peers(&log, &name, 3).await;
        let _ = log.context().delete_stream(&name).await;
    });
}

/// A node cut off from the client without a reset (the chaos proxy's partition: bytes held,
/// no FIN, no RST — a partition or a hung host) is left within seconds: the client's pings go
/// unanswered, it drops the connection and publishes again through a node the cluster told it
/// of. The control, a client with async-nats' 60 s default, still fails every publish 15 s on
/// (it would wait about three minutes).
#[test]
fn a_node_cut_off_without_a_reset_is_left_within_seconds_and_publishes_resume() {
    const CONTROL_FOR: Duration = Duration::from_secs(15);
    let shared = shared_cluster();
    let cluster = shared.lock().unwrap_or_else(PoisonError::into_inner);
    cluster.wait_healthy(Duration::from_secs(30)).expect("healthy");
    let node = cluster.nodes()[0].ports.client;
    let proxy = Proxy::start(SocketAddr::from(([127, 0, 0, 1], node))).expect("proxy");
    let url = format!("nats://{}", proxy.addr);
    let rt = runtime();
    let config = replicated(&url, 3);
    assert_eq!(config.ping_interval_ms, 2_000, "the default under test");
    let log = rt.block_on(Log::connect(&config)).expect("connect");
    let default_pings = LogConfig { ping_interval_ms: 60_000, ..config.clone() };
    let control = rt.block_on(Log::connect(&default_pings)).expect("connect the control");
    let (name, subject) = rt.block_on(scratch_stream(&log, "CUT"));
    let publish = |log: &Log, id: String| {
        let (publisher, subject) = (log.publisher(), subject.clone());
        async move { publisher.publish(&subject, &id, None, &[], Bytes::from(id.clone())).await }
    };
    rt.block_on(publish(&log, "before".into())).expect("a publish through the proxy");
    rt.block_on(publish(&control, "before-control".into())).expect("the control's");

    proxy.partition();
    let cut = Instant::now();
    let (resumed, control_acks) = rt.block_on(async {
        let resumed = async {
            for i in 0u64.. {
                if publish(&log, format!("after-{i}")).await.is_ok() {
                    return Some(cut.elapsed());
                }
                if cut.elapsed() >= Duration::from_secs(60) {
                    break;
                }
            }
            None
        };
        let control = async {
            let (mut acks, mut i) = (0, 0u64);
            while cut.elapsed() <= CONTROL_FOR {
                acks += usize::from(publish(&control, format!("control-{i}")).await.is_ok());
                i += 1;
            }
            acks
        };
        tokio::join!(resumed, control)
    });
    proxy.heal();
    println!("cut off without a reset: publishes resumed after {resumed:?}; control: {control_acks} acks in {CONTROL_FOR:?}");
    let resumed = resumed.expect("publishes resumed within 60 s");
    assert!(resumed < Duration::from_secs(30), "left the cut-off node only after {resumed:?}");
    assert_eq!(control_acks, 0, "the control (60 s pings) left the cut-off node: not a control");
    rt.block_on(async {
        let _ = log.context().delete_stream(&name).await;
    });
}

/// Which of the three leaderships `node` holds right now.
fn roles_of(cluster: &PrivateNatsCluster, node: &str) -> Vec<&'static str> {
    let consumer = flashsale_io::jetstream::ORDER_WRITER_CONSUMER;
    [
        ("stream", cluster.stream_leader(ORDERS_STREAM)),
        ("consumer", cluster.consumer_leader(ORDERS_STREAM, consumer)),
        ("meta", cluster.meta_leader()),
    ]
    .into_iter()
    .filter(|(_, leader)| leader.as_deref() == Some(node))
    .map(|(role, _)| role)
    .collect()
}

/// The engine (2 shards, its worker) on the R3 cluster, a sale running, and kill -9 of the
/// `SECKILL_ORDERS` stream leader, then of the order-writer's consumer leader, then of the
/// meta leader (each restarted 7 s later, the cluster healthy again before the next). What
/// admission answered around each kill is printed per second; every buyer told QUEUED or
/// QUEUED_PENDING gets exactly one order and nobody else one; submissions reopen after each
/// change; audit and reconcile pass. Production admission budgets (not the suite's lifted
/// ones): what a buyer would be told is the point.
#[test]
fn stream_consumer_and_meta_leaders_killed_mid_sale_every_queued_buyer_gets_one_order() {
    const SKU: (u64, u64) = (14_601, 24_601);
    let shared = shared_cluster();
    let mut cluster = shared.lock().unwrap_or_else(PoisonError::into_inner);
    cluster.wait_healthy(Duration::from_secs(30)).expect("healthy");
    let redis = flashsale_tests::redis();
    let db = flashsale_tests::migrated_database();
    let mut config = flashsale_tests::serve_config(redis.addr(), &cluster.url(), &db.url);
    config.edge.admission = flashsale_engine::logic::admission::Budgets::default();
    config.durable.log = replicated(&cluster.url(), 3);
    let mut worker = flashsale_tests::small_worker(&config);
    worker.log = replicated(&cluster.url(), 3);
    config.worker = Some(worker);
    let handle = serve::start(config).expect("serve on the R3 cluster");
    sale::create_activity(handle.admin_addr, SKU, 20_000);

    let buyers = Buyers::start(handle.http_addr, SKU, 4, Duration::from_millis(40), "leader");
    let mut kills = Vec::new();
    for role in ["stream", "consumer", "meta"] {
        std::thread::sleep(Duration::from_secs(3));
        let leader = match role {
            "stream" => cluster.stream_leader(ORDERS_STREAM),
            "consumer" => cluster
                .consumer_leader(ORDERS_STREAM, flashsale_io::jetstream::ORDER_WRITER_CONSUMER),
            _ => cluster.meta_leader(),
        };
        let leader = leader.unwrap_or_else(|| panic!("no {role} leader"));
        let index = cluster.index_of(&leader).expect("the leader is a node");
        let held = roles_of(&cluster, &leader);
        let killed_at = Instant::now();
        cluster.kill(index).expect("kill -9 of the leader");
        std::thread::sleep(Duration::from_secs(7));
        cluster.restart(index).expect("restart the killed node");
        cluster.wait_healthy(Duration::from_secs(60)).expect("healthy again");
        kills.push((role, leader, held, killed_at));
    }
    std::thread::sleep(Duration::from_secs(3));
    let mut answers = buyers.stop();
    for (i, (role, leader, held, at)) in kills.iter().enumerate() {
        // Submissions reopened: a QUEUED answer after the change (before the next kill).
        let next = kills.get(i + 1).map_or(Instant::now(), |k| k.3);
        println!("{role} leader {leader} killed (it led: {held:?}); answers per second:");
        let seconds = (next - *at).as_secs() + 1;
        println!("{}", answers.by_second(*at - Duration::from_secs(1), seconds));
        let reopened = answers.first_queued_after(*at + Duration::from_secs(1));
        assert!(
            reopened.is_some_and(|t| t < next),
            "no QUEUED answer after the {role} leader's kill: {reopened:?}"
        );
    }
    let promised =
        assert_promise_kept((handle.http_addr, handle.admin_addr), &db.url, SKU, &mut answers);
    println!(
        "{} buyers answered, {} promised, each exactly one order",
        answers.by_buyer.len(),
        promised.len()
    );
    handle.shutdown();
    cluster.wait_healthy(Duration::from_secs(30)).expect("healthy at the end");
}
