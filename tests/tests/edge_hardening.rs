//! The edge attacked as an outsider would (issue 12): raw sockets against the engine
//! in-process, each test one attack and the bound that defeats it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use flashsale_tests::{
    connect_from, metric, redis_cmd, state, wait_for_ms, Engine, Haproxy, HttpClient,
};

// The allocator `flashsale serve` runs with, so that the memory test measures what production
// holds per connection.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// One test at a time: the memory test samples this process's RSS, and the deadline tests
/// measure time on a 2-core machine.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Sends `prefix`, then one byte of `trickle` per second, until the server answers or closes
/// (or `give_up` passes). Returns the status of the answer (None: closed without one) and the
/// time from the first byte to the answer or close.
fn trickle(
    addr: SocketAddr,
    prefix: &[u8],
    trickle: &[u8],
    give_up: Duration,
) -> (Option<u16>, Duration) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let started = Instant::now();
    stream.write_all(prefix).expect("send the prefix");
    let mut received = Vec::new();
    let mut next = trickle.iter().cycle();
    while started.elapsed() < give_up {
        let mut buf = [0u8; 4096];
        match stream.read(&mut buf) {
            Ok(0) => return (status_of(&received), started.elapsed()),
            Ok(n) => {
                received.extend_from_slice(&buf[..n]);
                if received.windows(4).any(|w| w == b"\r\n\r\n") {
                    return (status_of(&received), started.elapsed());
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return (status_of(&received), started.elapsed()),
        }
        // One byte per second (the read above waited up to a second).
        let byte = [*next.next().expect("cycle")];
        if stream.write_all(&byte).is_err() {
            return (status_of(&received), started.elapsed());
        }
    }
    panic!("still open after {give_up:?} of one byte per second: no whole-request deadline");
}

fn status_of(received: &[u8]) -> Option<u16> {
    let text = String::from_utf8_lossy(received);
    text.split(' ').nth(1)?.parse().ok()
}

const HEADER_TIMEOUT_MS: u64 = 2_000;
const BODY_TIMEOUT_MS: u64 = 2_000;

fn trickle_engine() -> Engine {
    Engine::start_with(|c| {
        c.edge.header_read_timeout_ms = HEADER_TIMEOUT_MS;
        c.edge.body_read_timeout_ms = BODY_TIMEOUT_MS;
    })
}

#[test]
fn a_head_trickled_one_byte_per_second_gets_408_at_the_header_deadline() {
    let _serial = serial();
    let engine = trickle_engine();
    let (status, elapsed) = trickle(
        engine.http(),
        b"GET /v1/reservations/x HTTP/1.1\r\nHost: t\r\nX-Slow: ",
        b"a",
        Duration::from_secs(20),
    );
    eprintln!("trickled head: {status:?} after {elapsed:?} (deadline {HEADER_TIMEOUT_MS} ms)");
    assert_eq!(status, Some(408));
    assert!(elapsed >= Duration::from_millis(HEADER_TIMEOUT_MS - 100), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(HEADER_TIMEOUT_MS + 4_000), "{elapsed:?}");
}

#[test]
fn a_declared_body_trickled_one_byte_per_second_gets_408() {
    let _serial = serial();
    let engine = trickle_engine();
    let (status, elapsed) = trickle(
        engine.http(),
        b"POST /v1/reservations HTTP/1.1\r\nHost: t\r\nContent-Length: 4000\r\n\r\n",
        b"x",
        Duration::from_secs(20),
    );
    eprintln!("trickled body: {status:?} after {elapsed:?} (deadline {BODY_TIMEOUT_MS} ms)");
    assert_eq!(status, Some(408));
    assert!(elapsed >= Duration::from_millis(BODY_TIMEOUT_MS - 100), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(BODY_TIMEOUT_MS + 4_000), "{elapsed:?}");
}

#[test]
fn a_chunked_body_trickled_one_byte_per_second_gets_408() {
    let _serial = serial();
    let engine = trickle_engine();
    let (status, elapsed) = trickle(
        engine.http(),
        b"POST /v1/reservations HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"1\r\na\r\n",
        Duration::from_secs(20),
    );
    eprintln!("trickled chunks: {status:?} after {elapsed:?} (deadline {BODY_TIMEOUT_MS} ms)");
    assert_eq!(status, Some(408));
    assert!(elapsed >= Duration::from_millis(BODY_TIMEOUT_MS - 100), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(BODY_TIMEOUT_MS + 4_000), "{elapsed:?}");
}

#[test]
fn a_client_that_pipelines_and_never_reads_is_closed() {
    let _serial = serial();
    let engine = Engine::start_with(|c| {
        c.edge.idle_timeout_ms = 60_000;
        c.edge.write_timeout_ms = 1_000;
    });
    let mut stream = TcpStream::connect(engine.http()).expect("connect");
    stream.set_write_timeout(Some(Duration::from_millis(200))).unwrap();
    let request = b"GET /nope HTTP/1.1\r\nHost: t\r\n\r\n".repeat(64);
    let started = Instant::now();
    let closed = loop {
        match stream.write(&request) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => break e,
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "a peer that never reads still holds its connection after 20 s"
        );
    };
    eprintln!("never-reading peer closed after {:?} ({closed})", started.elapsed());
    let metrics = engine.metrics();
    assert_eq!(metric(&metrics, "flashsale_connection_timeouts_total{phase=\"write\"}"), 1);
}

// ---- memory per idle connection ------------------------------------------------------------

const IDLE_CHILD: &str = "idle_connections_child";
const ENV_IDLE_ADDR: &str = "FLASHSALE_IDLE_ADDR";
const ENV_IDLE_COUNT: &str = "FLASHSALE_IDLE_COUNT";
/// Set: the child waits for a line on stdin before it connects.
const ENV_IDLE_WAIT: &str = "FLASHSALE_IDLE_WAIT";
const IDLE_CONNECTIONS: u64 = 10_000;

/// Raises the soft open-file limit to the hard one (10,000 sockets need more than the
/// common default of 1,024).
#[allow(unsafe_code)]
fn raise_nofile_soft_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed by pointer.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = limit.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
    limit.rlim_cur
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The client side of the memory test, in a process of its own so that the 10,000 client
/// sockets count against its own open-file limit, not the engine's.
#[test]
fn idle_connections_child() {
    let Ok(addr) = std::env::var(ENV_IDLE_ADDR) else {
        eprintln!("{IDLE_CHILD}: not started by the memory test; nothing to do");
        return;
    };
    raise_nofile_soft_limit();
    let addr: SocketAddr = addr.parse().unwrap();
    let count: usize = std::env::var(ENV_IDLE_COUNT).unwrap().parse().unwrap();
    if std::env::var(ENV_IDLE_WAIT).is_ok() {
        let mut go = String::new();
        std::io::stdin().read_line(&mut go).unwrap();
    }
    let streams: Vec<TcpStream> = (0..count).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Past the test harness's output capture: the parent reads this line.
    let mut out = std::io::stdout().lock();
    writeln!(out, "IDLE_OPEN {}", streams.len()).unwrap();
    out.flush().unwrap();
    drop(out);
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(streams);
}

#[test]
fn idle_connections_cost_little_memory() {
    let _serial = serial();
    // 10,000 connections, or as many as a lower hard limit leaves room for (both processes
    // hold one descriptor per connection).
    let hard = raise_nofile_soft_limit();
    let connections = IDLE_CONNECTIONS.min(hard.saturating_sub(512));
    assert!(connections >= 1_000, "open-file hard limit {hard} is too low to measure");
    let engine = Engine::start_with(|c| {
        c.edge.idle_timeout_ms = 600_000;
        c.edge.header_read_timeout_ms = 600_000;
        // Every client of this test is 127.0.0.1.
        c.edge.connections_per_address_max = c.edge.connections_per_shard_max;
    });
    // Warm up: a few requests, so that lazily built state exists before the first sample.
    for _ in 0..10 {
        let mut c = HttpClient::connect(engine.http());
        assert_eq!(c.request("GET", "/nope", None, None).status, 404);
    }
    // The scrape's own admin connection is one of the open connections it reports.
    let open = || metric(&engine.metrics(), "flashsale_connections_open") - 1;
    wait_for_ms("warm-up connections closed", 10_000, || open() == 0);
    let before_kib = rss_kib();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", IDLE_CHILD, "--nocapture", "--test-threads=1"])
        .env(ENV_IDLE_ADDR, engine.http().to_string())
        .env(ENV_IDLE_COUNT, connections.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let opened = loop {
        let line = lines.next().expect("the child reports its connections").unwrap();
        // The harness prints `test <name> ... ` on the same line first.
        if let Some((_, n)) = line.split_once("IDLE_OPEN ") {
            break n.trim().parse::<u64>().unwrap();
        }
    };
    assert_eq!(opened, connections);
    wait_for_ms("the engine holds every connection", 60_000, || open() == connections);
    let after_kib = rss_kib();
    let per_connection_bytes = (after_kib.saturating_sub(before_kib) * 1024) / connections;
    eprintln!(
        "RSS {before_kib} KiB -> {after_kib} KiB with {connections} idle connections: \
         {per_connection_bytes} bytes each"
    );
    drop(child.stdin.take());
    let _ = child.wait();
    assert!(per_connection_bytes <= 8 * 1024, "{per_connection_bytes} bytes per idle connection");
}

// ---- health for balancers, drain ------------------------------------------------------------

#[test]
fn livez_and_readyz_answer_without_the_admin_token_and_nothing_else_does() {
    let _serial = serial();
    let engine = Engine::start_with(|c| c.admin_token = Some("s3cret-token".into()));
    let mut a = HttpClient::connect(engine.admin());
    assert_eq!(a.request("GET", "/livez", None, None).status, 200);
    assert_eq!(a.request("GET", "/readyz", None, None).status, 200);
    assert_eq!(a.request("GET", "/startupz", None, None).status, 401);
    assert_eq!(a.request("GET", "/metrics", None, None).status, 401);
    assert_eq!(a.request("POST", "/internal/drain", None, None).status, 401);
    assert_eq!(a.request("POST", "/readyz", None, None).status, 401, "only GET is exempt");
    assert_eq!(a.request("GET", "/startupz", Some("s3cret-token"), None).status, 200);
}

#[test]
fn the_public_health_path_and_a_drain_that_refuses_new_connections() {
    let _serial = serial();
    let engine = Engine::start_with(|c| c.edge.health_path = Some("/healthz".into()));
    let mut kept = HttpClient::connect(engine.http());
    let ok = kept.request("GET", "/healthz", None, None);
    assert_eq!((ok.status, ok.body.as_str()), (200, r#"{"ready":true}"#));
    assert_eq!(ok.header("connection"), None, "keep-alive while ready");
    // No health route unless configured: the default engine answers 404 there.
    let mut a = HttpClient::connect(engine.admin());
    assert_eq!(a.request("POST", "/internal/drain", None, None).status, 200);
    // New TCP connections are refused once every shard's listener is shut down.
    let started = Instant::now();
    wait_for_ms("the public port refuses connections", 5_000, || {
        TcpStream::connect(engine.http()).is_err()
    });
    eprintln!("public port refusing {:?} after the drain", started.elapsed());
    // The connection already open is still answered: 503, then closed.
    let draining = kept.request("GET", "/healthz", None, None);
    assert_eq!((draining.status, draining.body.as_str()), (503, r#"{"ready":false}"#));
    assert_eq!(draining.header("connection"), Some("close"));
    assert!(kept.is_closed());
    assert_eq!(a.request("GET", "/readyz", None, None).status, 503);
    assert_eq!(a.request("GET", "/livez", None, None).status, 200);
}

#[test]
fn a_request_in_flight_when_the_engine_stops_is_answered() {
    let _serial = serial();
    let mut engine = Engine::start();
    engine.create_activity(1201, 1202, 5);
    // Writes wait 1.5 s in Redis: the submit is in flight (until its 250 ms deadline).
    redis_cmd(&engine.redis, &["CLIENT", "PAUSE", "1500", "WRITE"]);
    let mut c = HttpClient::connect(engine.http());
    let pass = engine.pass(1, 1201);
    let body = r#"{"activity_id":1201,"sku_id":1202,"request_id":"f-1","quantity":1}"#;
    c.send_raw(
        format!(
            "POST /v1/reservations HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {pass}\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
    let reader = std::thread::spawn(move || c.read_response());
    std::thread::sleep(Duration::from_millis(50));
    engine.terminate(Duration::ZERO);
    let answer = reader.join().unwrap().expect("an answer, not a dropped connection");
    assert_eq!((answer.status, state(&answer.json())), (503, "UNKNOWN"), "{}", answer.body);
    // Whatever the paused reserve did once Redis resumed, the stores still reconcile (a
    // reservation it made is in flight, republished by the next engine's scanner).
    // A write through redis-cli is held until the pause ends: the reconcile then reads Redis.
    assert_eq!(redis_cmd(&engine.redis, &["SET", "drill:pause-over", "1"]), "OK");
    engine.restart_with(|_| {});
    engine.assert_reconciled(1201, 1202);
}

// ---- Expect: 100-continue -------------------------------------------------------------------

#[test]
fn expect_100_continue_is_answered_before_the_body_and_a_refused_head_at_once() {
    let _serial = serial();
    let engine = Engine::start();
    let mut stream = TcpStream::connect(engine.http()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let body = r#"{"activity_id":1,"sku_id":2,"request_id":"e-1","quantity":1}"#;
    let head = format!(
        "POST /v1/reservations HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    let started = Instant::now();
    let interim = read_until_blank_line(&mut stream);
    eprintln!("100 Continue after {:?}", started.elapsed());
    assert_eq!(interim, "HTTP/1.1 100 Continue\r\n\r\n");
    stream.write_all(body.as_bytes()).unwrap();
    let last = read_until_blank_line(&mut stream);
    assert!(last.starts_with("HTTP/1.1 401 "), "the final answer after the body: {last}");
    // A head the parser refuses is answered at once, with no 100 first.
    let mut refused = HttpClient::connect(engine.http());
    refused.send_raw(
        b"POST /v1/reservations HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n",
    );
    let answer = refused.read_response().expect("413 at once");
    assert_eq!(answer.status, 413);
    assert!(refused.is_closed());
}

fn read_until_blank_line(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut byte = [0u8; 1];
    while !received.ends_with(b"\r\n\r\n") {
        let n = stream.read(&mut byte).expect("an answer within the read timeout");
        assert_eq!(n, 1, "closed after {:?}", String::from_utf8_lossy(&received));
        received.push(byte[0]);
    }
    String::from_utf8(received).unwrap()
}

// ---- traceparent ------------------------------------------------------------------------------

#[test]
fn an_invalid_traceparent_is_neither_echoed_nor_stored_and_a_valid_one_is_both() {
    let _serial = serial();
    let engine = Engine::start();
    engine.create_activity(1301, 1302, 10);
    let mut c = HttpClient::connect(engine.http());
    let submit = |c: &mut HttpClient, user: u64, traceparent: &str| {
        let pass = engine.pass(user, 1301);
        let body =
            format!(r#"{{"activity_id":1301,"sku_id":1302,"request_id":"t-{user}","quantity":1}}"#);
        c.send_raw(
            format!(
                "POST /v1/reservations HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {pass}\r\n\
                 traceparent: {traceparent}\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        );
        c.read_response().unwrap()
    };
    let injected = r#"00-<script>-INJECT"x\y-zz"#;
    let answer = submit(&mut c, 1, injected);
    assert_eq!((answer.status, state(&answer.json())), (202, "QUEUED"), "{}", answer.body);
    assert_eq!(answer.header("traceparent"), None, "the injected value is not echoed");
    let (payload, header) = last_order_message(&engine);
    assert!(payload["traceparent"].is_null(), "stored in the message: {payload}");
    assert_eq!(header, None);
    // The control: a valid one is echoed and carried.
    let valid = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let answer = submit(&mut c, 2, valid);
    assert_eq!(answer.header("traceparent"), Some(valid));
    let (payload, header) = last_order_message(&engine);
    assert_eq!(payload["traceparent"], valid);
    assert_eq!(header.as_deref(), Some(valid));
}

/// The last order-create message's JSON body and `traceparent` header.
fn last_order_message(engine: &Engine) -> (serde_json::Value, Option<String>) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = async_nats::connect(engine.nats.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream("SECKILL_ORDERS").await.unwrap();
        let message = stream.get_last_raw_message_by_subject("seckill.order.create").await.unwrap();
        let header = message.headers.get("traceparent").map(|v| v.as_str().to_owned());
        (serde_json::from_slice(&message.payload).unwrap(), header)
    })
}

// ---- connection caps and accept errors --------------------------------------------------------

#[test]
fn one_address_holds_at_most_its_share_of_a_shard() {
    let _serial = serial();
    let engine = Engine::start_with(|c| {
        c.shards = 1;
        c.edge.connections_per_address_max = 2;
    });
    let mut first = HttpClient::connect(engine.http());
    let mut second = HttpClient::connect(engine.http());
    assert_eq!(first.request("GET", "/nope", None, None).status, 404);
    assert_eq!(second.request("GET", "/nope", None, None).status, 404);
    let mut third = HttpClient::connect(engine.http());
    assert!(third.is_closed(), "a third connection from 127.0.0.1 is closed at once");
    let metrics = engine.metrics();
    assert_eq!(metric(&metrics, "flashsale_connections_refused_per_address_total"), 1);
    // A closed connection frees its place.
    drop(first);
    wait_for_ms("the freed place is usable", 5_000, || {
        let mut again = HttpClient::connect(engine.http());
        again.try_request("GET", "/nope", None, None).is_some_and(|r| r.status == 404)
    });
}

/// Sets the soft open-file limit (the hard one stays).
#[allow(unsafe_code)]
fn set_nofile_soft_limit(soft: u64) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed by pointer.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = soft;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
}

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

#[test]
fn accepts_that_fail_for_descriptors_back_off_and_recover() {
    let _serial = serial();
    let hard = raise_nofile_soft_limit();
    let engine = Engine::start();
    let warm = HttpClient::connect(engine.http());
    drop(warm);
    // Clients in a child process (with its own limit), started before the engine's process
    // runs out of descriptors (spawning needs some) and told to connect after.
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", IDLE_CHILD, "--nocapture", "--test-threads=1"])
        .env(ENV_IDLE_ADDR, engine.http().to_string())
        .env(ENV_IDLE_COUNT, "40")
        .env(ENV_IDLE_WAIT, "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    set_nofile_soft_limit(open_fds() + 2);
    stdin.write_all(b"go\n").unwrap();
    let starved_for = Duration::from_secs(2);
    std::thread::sleep(starved_for);
    set_nofile_soft_limit(hard);
    let open = || metric(&engine.metrics(), "flashsale_connections_open") - 1;
    wait_for_ms("every connection accepted once descriptors are back", 10_000, || open() >= 40);
    let errors = metric(&engine.metrics(), "flashsale_accept_errors_total");
    eprintln!("{errors} failed accepts while starved for {starved_for:?}");
    assert!(errors > 0, "the engine did run out of descriptors");
    // Backoff 1, 2, 4 .. 250 ms: about 8 + 4/s attempts per shard, not one per 10 ms.
    assert!(errors <= 2 * (8 + 4 * 3), "{errors} failed accepts: no backoff");
    drop(stdin);
    let _ = child.wait();
}

// ---- PROXY protocol -----------------------------------------------------------------------

/// A PROXY v2 header (command PROXY, TCP) from `source` to `destination`.
fn proxy_v2(source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let mut header = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    let mut block = Vec::new();
    match (source.ip(), destination.ip()) {
        (std::net::IpAddr::V4(s), std::net::IpAddr::V4(d)) => {
            header.extend_from_slice(&[0x21, 0x11]);
            block.extend_from_slice(&s.octets());
            block.extend_from_slice(&d.octets());
        }
        (std::net::IpAddr::V6(s), std::net::IpAddr::V6(d)) => {
            header.extend_from_slice(&[0x21, 0x21]);
            block.extend_from_slice(&s.octets());
            block.extend_from_slice(&d.octets());
        }
        _ => panic!("one family per header"),
    }
    block.extend_from_slice(&source.port().to_be_bytes());
    block.extend_from_slice(&destination.port().to_be_bytes());
    header.extend_from_slice(&(block.len() as u16).to_be_bytes());
    header.extend_from_slice(&block);
    header
}

const UNAUTHENTICATED_SUBMIT: &[u8] =
    b"POST /v1/reservations HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}";

#[test]
fn a_trusted_balancers_proxy_header_sets_the_client_address_for_limits() {
    let _serial = serial();
    let engine = Engine::start_with(|c| {
        c.shards = 1;
        c.edge.connections_per_address_max = 1;
        c.edge.ip_rate = flashsale_engine::logic::limiter::Rate { per_s: 1, burst: 2 };
        c.edge.proxy_protocol_from =
            flashsale_engine::http::proxy::TrustedSources::parse("127.0.0.0/8").unwrap();
    });
    let statuses = |c: &mut HttpClient, n: usize| -> Vec<u16> {
        (0..n).map(|_| c.read_response().expect("an answer").status).collect()
    };
    // v1 from "203.0.113.9": the address limit (loopback peers are exempt, this one is not)
    // counts that client: its third request is RATE_LIMITED.
    let mut a = HttpClient::connect(engine.http());
    a.send_raw(b"PROXY TCP4 203.0.113.9 10.0.0.1 40000 443\r\n");
    a.send_raw(&UNAUTHENTICATED_SUBMIT.repeat(3));
    assert_eq!(statuses(&mut a, 3), [401, 401, 429]);
    // The same client again, in v2: over its one connection per shard, closed at once.
    let mut b = HttpClient::connect(engine.http());
    b.send_raw(&proxy_v2("203.0.113.9:40001".parse().unwrap(), "10.0.0.1:443".parse().unwrap()));
    assert!(b.is_closed(), "a second connection of 203.0.113.9");
    // Another client (IPv6), its header split across two writes: its own limits.
    let mut c = HttpClient::connect(engine.http());
    let header =
        proxy_v2("[2001:db8::5]:5000".parse().unwrap(), "[2001:db8::1]:443".parse().unwrap());
    c.send_raw(&header[..10]);
    std::thread::sleep(Duration::from_millis(100));
    c.send_raw(&header[10..]);
    c.send_raw(UNAUTHENTICATED_SUBMIT);
    assert_eq!(statuses(&mut c, 1), [401]);
    // LOCAL (a balancer's own health check): the TCP peer's address, loopback, served.
    let mut local = HttpClient::connect(engine.http());
    local.send_raw(b"\r\n\r\n\0\r\nQUIT\n\x20\x00\x00\x00");
    assert_eq!(local.request("GET", "/nope", None, None).status, 404);
    // From a trusted source a missing or malformed header closes without an answer.
    let mut missing = HttpClient::connect(engine.http());
    missing.send_raw(b"GET /nope HTTP/1.1\r\nHost: t\r\n\r\n");
    assert!(missing.read_response().is_none(), "no answer without a PROXY header");
    let mut malformed = HttpClient::connect(engine.http());
    malformed.send_raw(b"PROXY TCP4 203.0.113.010 10.0.0.1 1 2\r\nGET /nope HTTP/1.1\r\n\r\n");
    assert!(malformed.read_response().is_none(), "no answer after a malformed header");
    let metrics = engine.metrics();
    assert_eq!(metric(&metrics, "flashsale_proxy_protocol_refused_total{reason=\"malformed\"}"), 2);
    assert_eq!(metric(&metrics, "flashsale_connections_refused_per_address_total"), 1);
}

#[test]
fn a_proxy_header_from_an_untrusted_peer_is_a_400() {
    let _serial = serial();
    let engine = Engine::start();
    let v2 = proxy_v2("203.0.113.9:1".parse().unwrap(), "10.0.0.1:443".parse().unwrap());
    for header in [&b"PROXY TCP4 203.0.113.9 10.0.0.1 40000 443\r\n"[..], &v2] {
        let mut c = HttpClient::connect(engine.http());
        c.send_raw(header);
        c.send_raw(b"GET /nope HTTP/1.1\r\nHost: t\r\n\r\n");
        let answer = c.read_response().expect("an answer");
        assert_eq!(answer.status, 400);
        assert_eq!(answer.json()["reason_code"], "proxy_protocol_not_trusted");
        assert!(c.is_closed());
    }
    let metrics = engine.metrics();
    assert_eq!(metric(&metrics, "flashsale_proxy_protocol_refused_total{reason=\"untrusted\"}"), 2);
    // An ordinary request starting with P is HTTP, not a header.
    let mut post = HttpClient::connect(engine.http());
    assert_eq!(post.request("POST", "/v1/reservations", None, Some("{}")).status, 401);
}

#[test]
fn through_haproxy_with_send_proxy_v2_the_engine_counts_the_real_client() {
    let _serial = serial();
    let engine = Engine::start_with(|c| {
        c.shards = 1;
        c.edge.connections_per_address_max = 2;
        c.edge.proxy_protocol_from =
            flashsale_engine::http::proxy::TrustedSources::parse("127.0.0.1/32").unwrap();
    });
    // HAProxy signs its headers (CRC32C TLV), which the engine checks.
    let haproxy = Haproxy::start(engine.http(), "send-proxy-v2 proxy-v2-options crc32c");
    let client_a: std::net::IpAddr = "127.0.0.5".parse().unwrap();
    let client_b: std::net::IpAddr = "127.0.0.6".parse().unwrap();
    // Every connection reaches the engine from HAProxy's 127.0.0.1; counted by that address,
    // the third would be refused. Counted by the address HAProxy reports, A has two and B one.
    let mut a1 = connect_from(client_a, haproxy.addr);
    let mut a2 = connect_from(client_a, haproxy.addr);
    let mut b1 = connect_from(client_b, haproxy.addr);
    for (name, c) in [("a1", &mut a1), ("a2", &mut a2), ("b1", &mut b1)] {
        let answer = c.try_request("GET", "/nope", None, None);
        assert_eq!(answer.map(|r| r.status), Some(404), "{name}: {}", haproxy.log());
    }
    // A's third connection is over its cap: the engine closes it, HAProxy closes ours.
    let mut a3 = connect_from(client_a, haproxy.addr);
    assert!(a3.try_request("GET", "/nope", None, None).is_none(), "{}", haproxy.log());
    let metrics = engine.metrics();
    assert_eq!(metric(&metrics, "flashsale_connections_refused_per_address_total"), 1);
    assert_eq!(metric(&metrics, "flashsale_proxy_protocol_refused_total{reason=\"malformed\"}"), 0);
}
