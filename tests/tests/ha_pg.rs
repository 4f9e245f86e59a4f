//! The PostgreSQL client against a primary with two streaming standbys
//! (`stack::pg_standbys`, `synchronous_standby_names = 'ANY 1 (s1, s2)'`): the pool follows a
//! failover, gets past a hung (SIGSTOPped) old primary within its whole-connect deadline,
//! never writes to an old primary restarted writable (the fencing rule, with a control that
//! shows plain `target_session_attrs=read-write` would pick it), and `flashsale serve` starts
//! on the multi-host URL.
//!
//! Every test changes the roles of its nodes, so each builds its own set (~2 s here).

use std::time::{Duration, Instant};

use flashsale_engine::app::config::{Config, Env, Overrides};
use flashsale_engine::app::serve;
use flashsale_engine::app::stack::pg_standbys::SyncStandbys;
use flashsale_pg_worker::deadpool_postgres::{Object, Pool};
use flashsale_pg_worker::pool::{build_pool_with, Connector};
use flashsale_pg_worker::{build_pool, PgPoolConfig};
use flashsale_tests::sale::{self, assert_promise_kept, Buyers};
use flashsale_tests::{pg_standbys, HttpClient, PrivatePgStandbys};

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

async fn server_port(client: &tokio_postgres::Client) -> u16 {
    let row = client.query_one("SELECT inet_server_port()", &[]).await.expect("port");
    u16::try_from(row.get::<_, i32>(0)).expect("a port")
}

/// Inserts `value` into `t` through the pool, retrying (a failed connection is discarded, as
/// the worker does) until it commits or `bound` passes; returns the port that took it.
async fn insert_through(pool: &Pool, value: &str, bound: Duration) -> u16 {
    let deadline = Instant::now() + bound;
    loop {
        let attempt = async {
            let client = pool.get().await.map_err(|e| e.to_string())?;
            let work = async {
                client.execute("INSERT INTO t VALUES ($1)", &[&value]).await?;
                Ok::<u16, tokio_postgres::Error>(server_port(&client).await)
            };
            match tokio::time::timeout(Duration::from_secs(5), work).await {
                Ok(Ok(port)) => Ok(port),
                other => {
                    drop(Object::take(client));
                    Err(format!("{other:?}"))
                }
            }
        };
        match attempt.await {
            Ok(port) => return port,
            Err(e) => {
                assert!(Instant::now() < deadline, "insert {value} never committed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn pool_config(url: String, pool_size: usize) -> PgPoolConfig {
    PgPoolConfig { url, pool_size, connect_timeout_ms: 2_000, ..PgPoolConfig::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_primary_and_a_promoted_standby_the_next_connect_reaches_the_new_primary() {
    let mut set = blocking(pg_standbys);
    let ports: Vec<u16> = set.nodes().iter().map(|n| n.port).collect();
    let pool = build_pool(&pool_config(set.url("postgres"), 2)).expect("pool");
    {
        let client = pool.get().await.expect("first connect");
        assert_eq!(server_port(&client).await, ports[0], "pg0 is the primary");
        client.batch_execute("CREATE TABLE t (v text)").await.expect("create");
    }
    assert_eq!(insert_through(&pool, "before", Duration::from_secs(5)).await, ports[0]);
    let failed_at = Instant::now();
    blocking(|| {
        set.stop(0).expect("stop the primary");
        set.promote(1).expect("promote s1");
        set.follow(2, 1).expect("s2 follows s1");
    });
    let promoted = failed_at.elapsed();
    let port = insert_through(&pool, "after", Duration::from_secs(30)).await;
    println!(
        "stop + promote + follow {promoted:?}; first commit on the new primary after {:?}",
        failed_at.elapsed()
    );
    assert_eq!(port, ports[1], "the new primary took the write");
    let rows = blocking(|| set.query(1, "SELECT v FROM t ORDER BY v")).expect("read s1");
    let values: Vec<_> = rows.into_iter().filter_map(|r| r[0].clone()).collect();
    assert_eq!(values, vec!["after".to_owned(), "before".to_owned()], "nothing lost in the change");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_primary_the_pool_gets_past_the_hung_host_within_its_whole_connect_deadline() {
    let set = blocking(pg_standbys);
    let ports: Vec<u16> = set.nodes().iter().map(|n| n.port).collect();
    let config = pool_config(set.url("postgres"), 4);
    let pool = build_pool(&config).expect("pool");
    // Three pooled connections to the primary, held through the failover.
    let held = futures::future::join_all((0..3).map(|_| pool.get())).await;
    let held: Vec<Object> = held.into_iter().map(|c| c.expect("connect")).collect();
    for client in &held {
        assert_eq!(server_port(client).await, ports[0]);
    }
    held[0].batch_execute("CREATE TABLE t (v text)").await.expect("create");
    blocking(|| {
        set.freeze(0).expect("freeze pg0");
        set.promote(1).expect("promote s1");
        set.follow(2, 1).expect("s2 follows s1");
    });

    // The driver alone: its connect_timeout bounds only the TCP connect, which the frozen
    // host's kernel completes; the start-up exchange then waits forever.
    let plain = format!("{}&connect_timeout=2", set.url("postgres"));
    let hung = tokio::time::timeout(
        Duration::from_secs(6),
        tokio_postgres::connect(&plain, tokio_postgres::NoTls),
    )
    .await;
    assert!(hung.is_err(), "tokio-postgres' own multi-host connect must hang on the frozen host");

    let started = Instant::now();
    let fresh = tokio::time::timeout(Duration::from_secs(20), pool.get())
        .await
        .expect("the pool's connect finished")
        .expect("the pool got past the hung host");
    let elapsed = started.elapsed();
    println!(
        "past the hung host after {elapsed:?} (whole-connect deadline {} ms)",
        config.connect_timeout_ms
    );
    assert!(
        elapsed < Duration::from_millis(3 * config.connect_timeout_ms),
        "one deadline on the hung host, then the next host: {elapsed:?}"
    );
    assert_eq!(server_port(&fresh).await, ports[1], "the promoted standby");
    fresh.execute("INSERT INTO t VALUES ('on s1')", &[]).await.expect("write on the new primary");
    // The connections to the old primary are behind the new timeline: closed, so the pool
    // cannot hand them out once the old primary runs again.
    flashsale_tests::wait_for_ms("the held connections to the old primary closed", 10_000, || {
        held.iter().all(|c| c.is_closed())
    });
    drop(held);
    blocking(|| set.thaw(0)).expect("thaw pg0");
    for _ in 0..3 {
        assert_eq!(insert_through(&pool, "after thaw", Duration::from_secs(15)).await, ports[1]);
    }
    let on_old = blocking(|| set.query(0, "SELECT count(*) FROM t")).expect("read pg0");
    assert_eq!(on_old[0][0].as_deref(), Some("0"), "nothing written to the old primary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_primary_restarted_writable_is_never_written_to() {
    let mut set = blocking(pg_standbys);
    let ports: Vec<u16> = set.nodes().iter().map(|n| n.port).collect();
    let config = pool_config(set.url("postgres"), 3);
    let connector = Connector::new(&config).expect("connector");
    let pool = build_pool_with(&config, connector.clone()).expect("pool");
    pool.get().await.expect("connect").batch_execute("CREATE TABLE t (v text)").await.expect("t");
    assert_eq!(insert_through(&pool, "tl1", Duration::from_secs(5)).await, ports[0]);
    assert_eq!(connector.timeline_max(), 1);
    blocking(|| {
        set.stop(0).expect("stop the primary");
        set.promote(1).expect("promote s1");
        set.follow(2, 1).expect("s2 follows s1");
    });
    assert_eq!(insert_through(&pool, "tl2", Duration::from_secs(30)).await, ports[1]);
    assert_eq!(connector.timeline_max(), 2, "the promotion started timeline 2");
    blocking(|| set.restart_writable(0, SyncStandbys::Cleared)).expect("old primary back");

    // Without the rule: target_session_attrs=read-write takes the first writable host.
    let (plain, connection) = tokio_postgres::connect(&set.url("postgres"), tokio_postgres::NoTls)
        .await
        .expect("plain connect");
    tokio::spawn(connection);
    assert_eq!(server_port(&plain).await, ports[0], "the old primary WOULD be picked");
    drop(plain);

    // With it: new connections of this pool (the old ones discarded) all go to s1...
    let objects = futures::future::join_all((0..3).map(|_| pool.get())).await;
    for object in objects {
        drop(Object::take(object.expect("pooled")));
    }
    for k in 0..6 {
        let port = insert_through(&pool, &format!("fenced-{k}"), Duration::from_secs(10)).await;
        assert_eq!(port, ports[1], "write {k}");
    }
    // ...and so do those of a fresh process's pool, whose first connect surveys every host.
    let fresh = Connector::isolated(&config).expect("connector");
    let fresh_pool = build_pool_with(&config, fresh.clone()).expect("pool");
    assert_eq!(insert_through(&fresh_pool, "fresh", Duration::from_secs(10)).await, ports[1]);
    assert_eq!(fresh.timeline_max(), 2, "learned by the survey");
    let on_old = blocking(|| set.query(0, "SELECT v FROM t ORDER BY v")).expect("read pg0");
    let values: Vec<_> = on_old.into_iter().filter_map(|r| r[0].clone()).collect();
    assert_eq!(values, vec!["tl1".to_owned()], "only what it had before the failover");
}

/// `flashsale serve` (2 shards, its worker) on the set's multi-host URL (database `postgres`,
/// migrated on the primary); with its own Redis and NATS.
fn serve_on(
    set: &PrivatePgStandbys,
    tune: impl FnOnce(&mut serve::ServeConfig),
) -> (serve::ServeHandle, flashsale_tests::PrivateRedis, flashsale_tests::PrivateNats) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let (mut client, conn) =
            tokio_postgres::connect(&set.node_url(0, "postgres"), tokio_postgres::NoTls)
                .await
                .unwrap();
        let driver = tokio::spawn(conn);
        flashsale_pg_worker::migrate(&mut client).await.expect("migrate");
        drop(client);
        let _ = driver.await;
    });
    let (redis, nats) = (flashsale_tests::redis(), flashsale_tests::nats());
    let dir = tempfile::tempdir().unwrap();
    let env: Env = [
        ("FLASHSALE_PG_URL".to_owned(), set.url("postgres")),
        ("FLASHSALE_NATS_URL".to_owned(), nats.url()),
        ("FLASHSALE_REDIS_URL".to_owned(), redis.url()),
    ]
    .into_iter()
    .collect();
    let config = Config::load(None, &env, &Overrides::default(), dir.path())
        .expect("a multi-host FLASHSALE_PG_URL is accepted");
    let mut serve_config =
        flashsale_tests::serve_config(redis.addr(), &config.nats_url, &config.pg_url);
    serve_config.durable = serve::durable_config(&config);
    let mut worker = flashsale_tests::small_worker(&serve_config);
    worker.pg = PgPoolConfig { url: config.pg_url.clone(), ..worker.pg };
    serve_config.worker = Some(worker);
    tune(&mut serve_config);
    let handle = serve::start(serve_config).expect("serve starts on the multi-host URL");
    (handle, redis, nats)
}

fn orders_on(set: &PrivatePgStandbys, index: usize) -> i64 {
    let rows = set.query(index, "SELECT count(*) FROM orders").expect("count orders");
    rows[0][0].as_deref().and_then(|n| n.parse().ok()).expect("a count")
}

#[test]
fn serve_starts_on_a_multi_host_url_and_both_pools_use_it() {
    let set = pg_standbys();
    let (handle, _redis, _nats) = serve_on(&set, |_| {});
    let mut admin = HttpClient::connect(handle.admin_addr);
    let body = r#"{"activity_id":10001,"sku_id":20001,"stock":5}"#;
    let resp = admin.request("POST", "/admin/v1/activities", None, Some(body));
    assert_eq!(resp.status, 201, "the edge's pool wrote the activity: {}", resp.body);
    let mut c = HttpClient::connect(handle.http_addr);
    let answer = sale::submit(&mut c, 7, (10001, 20001), "ha-1").expect("an answer");
    assert_eq!(flashsale_tests::state(&answer), "QUEUED", "{answer}");
    flashsale_tests::wait_for_ms("the worker's pool wrote the order", 20_000, || {
        orders_on(&set, 0) == 1
    });
    handle.shutdown();
}

/// A sale running on `flashsale serve` over the multi-host URL while PostgreSQL fails over
/// twice: the primary stopped and s1 promoted (s2 follows it); then s1 frozen (SIGSTOP, a hung
/// primary) and s2 promoted; then the old primary pg0 restarted writable on its old timeline,
/// and s1 thawed (writable, behind s2's timeline). What admission answered around each change
/// is printed per second; every buyer told QUEUED/QUEUED_PENDING gets exactly one order on
/// the current primary, nobody else one, audit and reconcile pass; neither old primary gets a
/// single order after it stopped being the primary.
#[test]
fn primary_stopped_then_hung_mid_sale_every_queued_buyer_gets_one_order_on_the_new_primary() {
    const SKU: (u64, u64) = (14_701, 24_701);
    let mut set = pg_standbys();
    let (handle, _redis, _nats) = serve_on(&set, |c| {
        c.edge.admission = flashsale_engine::logic::admission::Budgets::default();
    });
    sale::create_activity(handle.admin_addr, SKU, 20_000);
    let buyers = Buyers::start(handle.http_addr, SKU, 4, Duration::from_millis(40), "pgha");
    std::thread::sleep(Duration::from_secs(3));
    let stopped_at = Instant::now();
    set.stop(0).expect("stop the primary");
    set.promote(1).expect("promote s1");
    set.follow(2, 1).expect("s2 follows s1");
    println!("pg0 stopped, s1 promoted, s2 following after {:?}", stopped_at.elapsed());
    std::thread::sleep(Duration::from_secs(5));
    let frozen_at = Instant::now();
    set.freeze(1).expect("freeze s1");
    set.promote(2).expect("promote s2");
    // What a failover manager does with the last node standing: no synchronous standby left
    // to wait for (s2's copy of the setting names s1 and s2).
    set.query(2, "ALTER SYSTEM SET synchronous_standby_names = ''").expect("sync off");
    set.query(2, "SELECT pg_reload_conf()").expect("reload");
    println!("s1 frozen, s2 promoted after {:?}", frozen_at.elapsed());
    std::thread::sleep(Duration::from_secs(4));
    set.restart_writable(0, SyncStandbys::Cleared).expect("the old primary back, writable");
    let on_pg0 = orders_on(&set, 0);
    set.thaw(1).expect("thaw s1");
    let on_s1 = orders_on(&set, 1);
    println!("pg0 writable again with {on_pg0} orders, s1 thawed with {on_s1}");
    std::thread::sleep(Duration::from_secs(4));
    let mut answers = buyers.stop();
    for (what, at) in [("primary stopped", stopped_at), ("primary frozen", frozen_at)] {
        println!("{what}; answers per second:");
        println!("{}", answers.by_second(at - Duration::from_secs(1), 10));
    }
    let reopened = answers.first_queued_after(frozen_at + Duration::from_secs(1));
    assert!(reopened.is_some(), "no QUEUED answer after the second failover");
    for node in [0, 1] {
        let sessions = set.query(
            node,
            "SELECT application_name, state, left(query, 60) FROM pg_stat_activity \
             WHERE application_name LIKE 'flashsale%'",
        );
        println!("sessions on node {node}: {sessions:?}");
    }
    for node in 0..3 {
        println!("node {node}: {} orders", orders_on(&set, node));
    }
    assert_eq!(orders_on(&set, 0), on_pg0, "an order written to the old primary pg0");
    assert_eq!(orders_on(&set, 1), on_s1, "an order written to the old primary s1");
    let url = set.node_url(2, "postgres");
    let promised =
        assert_promise_kept((handle.http_addr, handle.admin_addr), &url, SKU, &mut answers);
    println!(
        "{} buyers, {} promised, each one order on s2",
        answers.by_buyer.len(),
        promised.len()
    );
    handle.shutdown();
}
