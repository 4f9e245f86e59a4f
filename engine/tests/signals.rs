//! SIGTERM through the real binary: `flashsale serve` and `flashsale worker` run as child
//! processes over a private stack (`flashsale stack up`), are signalled with kill(2) while
//! submissions flow, and must exit 0 having lost and duplicated nothing (DESIGN.md section 8:
//! every submission answered QUEUED has exactly one order, no oversell, one order per buyer,
//! tokens conserved).
//!
//! The in-process drill (tests/tests/degradation.rs) calls `drain()`/`shutdown()` directly;
//! these cover what it cannot: the signal handler of `main.rs`, the grace period, the exit
//! status, and the worker's stop in a process of its own.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flashsale_engine::app::stack::StackEnv;
use flashsale_engine::logic::auth::{PassKeys, DEV_PASS_KEYS};
use flashsale_engine::logic::ids::{ActivityId, UserId};

/// The drills share a 2-core machine with others: one at a time keeps their timings honest.
static SERIAL: Mutex<()> = Mutex::new(());

/// How long a signalled process may take to exit before the drill fails (generous: the
/// grace period is 2 s, the worker's shutdown phases are bounded by 10 s each).
const EXIT_BOUND: Duration = Duration::from_secs(40);

fn flashsale() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flashsale"))
}

// ---- the private stack --------------------------------------------------------------------

/// `flashsale stack up --dir <tmp>`; `stack down --purge` on drop.
struct Stack {
    dir: PathBuf,
    env: StackEnv,
    _root: tempfile::TempDir,
}

impl Stack {
    fn up() -> Stack {
        // Under /tmp and world-traversable: run as root, PostgreSQL runs as `postgres`.
        let root = tempfile::Builder::new().prefix("flashsale-signals-").tempdir().expect("tmp");
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let dir = root.path().join("stack");
        let out = flashsale().args(["stack", "up", "--dir"]).arg(&dir).output().expect("run up");
        assert!(out.status.success(), "stack up: {}", String::from_utf8_lossy(&out.stderr));
        let env = StackEnv::read(&dir).expect("DIR/env written");
        let out = flashsale()
            .args(["migrate", "--stack-dir"])
            .arg(&dir)
            .current_dir(root.path())
            .env("FLASHSALE_PG_URL", &env.pg_url)
            .output()
            .expect("run migrate");
        assert!(out.status.success(), "migrate: {}", String::from_utf8_lossy(&out.stderr));
        Stack { dir, env, _root: root }
    }

    fn root(&self) -> &Path {
        self._root.path()
    }

    /// `flashsale <args> --stack-dir DIR` with the stack's URLs in the environment, its
    /// output in `<root>/<log>.log`.
    fn command(&self, args: &[&str], log: &str) -> (Command, PathBuf) {
        let log_path = self.root().join(format!("{log}.log"));
        let file = std::fs::File::create(&log_path).expect("log file");
        let mut command = flashsale();
        command
            .args(args)
            .arg("--stack-dir")
            .arg(&self.dir)
            .current_dir(self.root())
            .env("FLASHSALE_REDIS_URL", &self.env.redis_url)
            .env("FLASHSALE_PG_URL", &self.env.pg_url)
            .env("FLASHSALE_NATS_URL", &self.env.nats_url)
            .env("FLASHSALE_MODE_STATE_FILE", self.root().join(format!("{log}.modes")))
            .env_remove("FLASHSALE_PASS_KEYS")
            .env_remove("FLASHSALE_ADMIN_TOKEN")
            .env_remove("FLASHSALE_SHARDS")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("clone"))
            .stderr(file);
        (command, log_path)
    }

    fn spawn(&self, args: &[&str], log: &str) -> Proc {
        let (mut command, log) = self.command(args, log);
        Proc { child: Some(command.spawn().expect("spawn flashsale")), log }
    }

    /// `serve --no-pin --insecure-dev-auth --shards 1` on free ports, once it is started and
    /// ready; `extra` appended (e.g. `--no-worker`).
    fn serve(&self, extra: &[&str], log: &str) -> Serve {
        let http = free_addr();
        let admin = free_addr();
        let mut args =
            vec!["serve", "--no-pin", "--insecure-dev-auth", "--shards", "1", "--grace-s", "2"];
        args.extend_from_slice(extra);
        let (mut command, log) = self.command(&args, log);
        command
            .env("FLASHSALE_HTTP_ADDR", http.to_string())
            .env("FLASHSALE_ADMIN_ADDR", admin.to_string());
        let child = command.spawn().expect("spawn flashsale serve");
        let mut proc = Proc { child: Some(child), log };
        let deadline = Instant::now() + Duration::from_secs(60);
        for path in ["/readyz", "/startupz"] {
            while get(admin, path) != Some(200) {
                proc.assert_running("serve before ready");
                assert!(Instant::now() < deadline, "serve not {path} within 60 s: {}", proc.tail());
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Serve { proc, http, admin }
    }

    /// A `flashsale.toml` in the root with `text` (for `--config`).
    fn config(&self, text: &str) -> String {
        let path = self.root().join("flashsale.toml");
        std::fs::write(&path, text).expect("write config");
        path.display().to_string()
    }

    fn pg(&self) -> Pg {
        Pg::connect(&self.env.pg_url)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = flashsale().args(["stack", "down", "--purge", "--dir"]).arg(&self.dir).output();
    }
}

fn free_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

// ---- child processes ----------------------------------------------------------------------

/// A `flashsale` child; SIGKILLed and reaped on drop if it is still running.
struct Proc {
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    fn pid(&self) -> i32 {
        i32::try_from(self.child.as_ref().expect("running").id()).expect("pid")
    }

    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(30).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    fn assert_running(&mut self, what: &str) {
        let child = self.child.as_mut().expect("a child");
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what}: flashsale exited early ({status}):\n{}", self.tail());
        }
    }

    /// SIGTERM through kill(2), as an init system or an orchestrator sends it.
    #[allow(unsafe_code)]
    fn sigterm(&self) {
        let pid = self.pid();
        // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our unreaped child,
        // so it cannot have been recycled.
        let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill -TERM {pid}: {}", std::io::Error::last_os_error());
    }

    /// Waits (bounded) for the exit; returns its status and how long it took.
    fn wait_exit(&mut self, since: Instant) -> (ExitStatus, Duration) {
        let mut child = self.child.take().expect("a child");
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return (status, since.elapsed());
            }
            if since.elapsed() > EXIT_BOUND {
                let _ = child.kill();
                let _ = child.wait();
                panic!("no exit within {EXIT_BOUND:?} of SIGTERM:\n{}", self.tail());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then the exit: it must be 0 within [`EXIT_BOUND`]; returns the time taken.
    fn terminate(&mut self, what: &str) -> Duration {
        let sent = Instant::now();
        self.sigterm();
        let (status, took) = self.wait_exit(sent);
        eprintln!("{what}: exited with {status} {took:?} after SIGTERM");
        assert!(status.success(), "{what} after SIGTERM: {status}:\n{}", self.tail());
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        assert!(log.contains("signal received"), "{what} did not log the signal:\n{log}");
        took
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct Serve {
    proc: Proc,
    http: SocketAddr,
    admin: SocketAddr,
}

// ---- HTTP ---------------------------------------------------------------------------------

/// One keep-alive HTTP/1.1 connection (the test's own client: this package has no helper).
struct Http {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Http {
    fn connect(addr: SocketAddr) -> Option<Http> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        stream.set_nodelay(true).ok()?;
        Some(Http { stream, buf: Vec::new() })
    }

    /// (status, body), or None when the connection broke first.
    fn request(
        &mut self,
        method: &str,
        path: &str,
        bearer: Option<&str>,
        body: &str,
    ) -> Option<(u16, String)> {
        let auth = bearer.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
        let raw = format!(
            "{method} {path} HTTP/1.1\r\nHost: test\r\n{auth}Content-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.stream.write_all(raw.as_bytes()).ok()?;
        loop {
            if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..end]).to_string();
                let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
                let len: usize = head
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .find(|(n, _)| n.trim().eq_ignore_ascii_case("content-length"))
                    .and_then(|(_, v)| v.trim().parse().ok())
                    .unwrap_or(0);
                if self.buf.len() >= end + 4 + len {
                    let body = String::from_utf8_lossy(&self.buf[end + 4..end + 4 + len]);
                    let body = body.to_string();
                    self.buf.drain(..end + 4 + len);
                    return Some((status, body));
                }
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

fn get(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut http = Http::connect(addr)?;
    http.request("GET", path, None, "").map(|(status, _)| status)
}

fn create_activity(admin: SocketAddr, activity: u64, sku: u64, stock: u64) {
    let body = format!(r#"{{"activity_id":{activity},"sku_id":{sku},"stock":{stock}}}"#);
    let mut http = Http::connect(admin).expect("connect admin");
    let (status, body) =
        http.request("POST", "/admin/v1/activities", None, &body).expect("admin answer");
    assert_eq!(status, 201, "{body}");
}

/// A pass signed with the development key (`--insecure-dev-auth`), valid for an hour.
fn dev_pass(keys: &PassKeys, user: u64, activity: u64) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock");
    keys.mint("dev", UserId(user), ActivityId(activity), now.as_secs() + 3600).expect("dev kid")
}

/// One buyer's submission and what the engine said (`None`: the connection broke first, the
/// outcome is unknown to the client).
#[derive(Debug)]
struct Answer {
    user: u64,
    state: Option<String>,
}

/// Load from `threads` threads, each buyer submitting once, `pace` apart, until the engine
/// stops accepting connections or `users_per_thread` buyers are done. `queued` counts the
/// QUEUED answers as they come.
fn start_load(
    http: SocketAddr,
    (activity, sku): (u64, u64),
    threads: u64,
    users_per_thread: u64,
    pace: Duration,
    queued: &Arc<AtomicUsize>,
) -> Vec<std::thread::JoinHandle<Vec<Answer>>> {
    (0..threads)
        .map(|t| {
            let queued = Arc::clone(queued);
            let first = 1 + t * 1_000_000;
            std::thread::spawn(move || {
                let keys = PassKeys::parse(DEV_PASS_KEYS).expect("dev keys");
                let mut answers = Vec::new();
                let Some(mut client) = Http::connect(http) else { return answers };
                for user in first..first + users_per_thread {
                    let pass = dev_pass(&keys, user, activity);
                    let body = format!(
                        r#"{{"activity_id":{activity},"sku_id":{sku},"request_id":"r-{user}","quantity":1}}"#
                    );
                    let answer = client.request("POST", "/v1/reservations", Some(&pass), &body);
                    let state = answer.map(|(_, body)| {
                        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
                        v["state"].as_str().unwrap_or("").to_owned()
                    });
                    if state.as_deref() == Some("QUEUED") {
                        queued.fetch_add(1, Ordering::Relaxed);
                    }
                    let broke = state.is_none();
                    answers.push(Answer { user, state });
                    if broke {
                        // Closed by the drain; once the listener is gone, a connect fails.
                        match Http::connect(http) {
                            Some(again) => client = again,
                            None => return answers,
                        }
                    }
                    std::thread::sleep(pace);
                }
                answers
            })
        })
        .collect()
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- PostgreSQL ---------------------------------------------------------------------------

struct Pg {
    runtime: tokio::runtime::Runtime,
    client: tokio_postgres::Client,
}

impl Pg {
    fn connect(url: &str) -> Pg {
        let runtime =
            tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let client = runtime.block_on(async {
            let (client, conn) =
                tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect pg");
            tokio::spawn(conn);
            client
        });
        Pg { runtime, client }
    }

    fn orders(&self, (activity, sku): (u64, u64)) -> i64 {
        let (a, s) = (activity as i64, sku as i64);
        self.runtime
            .block_on(self.client.query_one(
                "SELECT count(*) FROM orders WHERE activity_id = $1 AND sku_id = $2",
                &[&a, &s],
            ))
            .expect("count orders")
            .get(0)
    }

    /// Orders per buyer of the SKU: (user_id, count).
    fn orders_by_user(&self, (activity, sku): (u64, u64)) -> std::collections::HashMap<u64, i64> {
        let (a, s) = (activity as i64, sku as i64);
        let rows = self
            .runtime
            .block_on(self.client.query(
                "SELECT user_id, count(*) FROM orders WHERE activity_id = $1 AND sku_id = $2 \
                 GROUP BY user_id",
                &[&a, &s],
            ))
            .expect("orders by user");
        rows.iter().map(|r| (r.get::<_, i64>(0) as u64, r.get::<_, i64>(1))).collect()
    }

    /// DESIGN.md section 8's PostgreSQL invariants of the SKU (I1 no oversell, I2 one order
    /// per buyer, I3 token conservation, I7 reservation/order agreement).
    fn assert_invariants(&self, (activity, sku): (u64, u64)) {
        let report = self
            .runtime
            .block_on(flashsale_pg_worker::audit::check_invariants(
                &self.client,
                activity as i64,
                sku as i64,
            ))
            .expect("check invariants");
        assert!(report.ok(), "invariants violated: {report:#?}");
        eprintln!(
            "invariants hold: {} live orders, stock {}, tokens {} (available {}, claimed {}, \
             sold {}, released {})",
            report.orders_live,
            report.total_stock,
            report.tokens_total,
            report.tokens_available,
            report.tokens_claimed,
            report.tokens_sold,
            report.tokens_released
        );
    }
}

/// Every QUEUED buyer has exactly one order; a buyer told anything else (a refusal) has none;
/// buyers whose answer was lost may have one or none. Returns the number of QUEUED buyers.
/// `log` (the process's log tail) goes into every failure message.
fn assert_exactly_once(pg: &Pg, sku: (u64, u64), answers: &[Answer], log: &str) -> usize {
    let orders = pg.orders_by_user(sku);
    let mut queued = 0;
    for a in answers {
        let count = orders.get(&a.user).copied().unwrap_or(0);
        match a.state.as_deref() {
            Some("QUEUED") => {
                queued += 1;
                assert_eq!(count, 1, "buyer {} was answered QUEUED: orders {count}\n{log}", a.user);
            }
            // Reserved, the publish unconfirmed: one order or none, never two.
            Some("QUEUED_PENDING") | None => {
                assert!(count <= 1, "buyer {}: {count}\n{log}", a.user)
            }
            Some(other) => assert_eq!(count, 0, "buyer {} was answered {other}\n{log}", a.user),
        }
    }
    let asked: std::collections::HashSet<u64> = answers.iter().map(|a| a.user).collect();
    let strangers: Vec<_> = orders.keys().filter(|u| !asked.contains(u)).collect();
    assert!(strangers.is_empty(), "orders for buyers who never submitted: {strangers:?}");
    queued
}

fn summary(answers: &[Answer]) -> std::collections::BTreeMap<String, usize> {
    let mut by_state = std::collections::BTreeMap::new();
    for a in answers {
        let key = a.state.clone().unwrap_or_else(|| "<no answer>".into());
        *by_state.entry(key).or_insert(0) += 1;
    }
    by_state
}

// ---- the drills ---------------------------------------------------------------------------

#[test]
fn sigterm_to_serve_under_load_exits_0_and_every_queued_submission_has_one_order() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let stack = Stack::up();
    let mut serve = stack.serve(&[], "serve");
    let sku = (7_001, 7_002);
    create_activity(serve.admin, sku.0, sku.1, 1_500);

    let queued = Arc::new(AtomicUsize::new(0));
    let load = start_load(serve.http, sku, 4, 1_000, Duration::from_millis(3), &queued);
    // Mid-load: a few hundred QUEUED answers in, the stream still flowing.
    wait_until("QUEUED answers", Duration::from_secs(30), || queued.load(Ordering::Relaxed) >= 200);
    let took = serve.proc.terminate("flashsale serve");
    let answers: Vec<Answer> = load.into_iter().flat_map(|t| t.join().expect("load")).collect();
    eprintln!("answers: {:?}", summary(&answers));
    assert!(answers.len() < 4_000, "the drain stopped the load part-way");

    // The process is gone: what PostgreSQL holds now is what the in-process worker wrote
    // during the grace period and its shutdown (finish the batch, commit, then ack).
    let pg = stack.pg();
    let queued = assert_exactly_once(&pg, sku, &answers, &serve.proc.tail());
    let orders = pg.orders(sku);
    eprintln!("serve exited {took:?} after SIGTERM; {queued} QUEUED answers, {orders} orders");
    assert!(queued >= 200, "{queued}");
    pg.assert_invariants(sku);
}

#[test]
fn sigterm_to_a_worker_with_a_backlog_then_restart_loses_and_duplicates_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let stack = Stack::up();
    // The edge alone, its backlog budgets lifted (nothing drains the log until the worker
    // starts); the worker in small batches on one writer so that the backlog takes a while.
    let config = stack.config(
        "[admission]\noldest_pending_age_max_ms = 600000\npending_count_max = 1000000\n\
         [worker]\norder_writers = 1\nbatch_max = 4\nfetch_min = 4\nfetch_max = 4\n",
    );
    let mut serve = stack.serve(&["--no-worker", "--config", &config], "serve");
    let sku = (7_101, 7_102);
    create_activity(serve.admin, sku.0, sku.1, 1_200);

    let queued = Arc::new(AtomicUsize::new(0));
    let load = start_load(serve.http, sku, 3, 500, Duration::ZERO, &queued);
    let answers: Vec<Answer> = load.into_iter().flat_map(|t| t.join().expect("load")).collect();
    eprintln!("answers: {:?}", summary(&answers));
    let total = answers.iter().filter(|a| a.state.as_deref() == Some("QUEUED")).count();
    assert!(total >= 1_000, "the backlog: {total} QUEUED");
    let pg = stack.pg();
    assert_eq!(pg.orders(sku), 0, "no worker yet");

    // The worker starts on the backlog; SIGTERM as soon as it has written some of it.
    let mut worker = stack.spawn(&["worker", "--config", &config], "worker-1");
    wait_until("the first orders", Duration::from_secs(60), || {
        worker.assert_running("worker");
        pg.orders(sku) > 0
    });
    let at_signal = pg.orders(sku);
    let took = worker.terminate("flashsale worker");
    let at_exit = pg.orders(sku);
    eprintln!(
        "worker exited {took:?} after SIGTERM: {at_signal} orders at the signal, {at_exit} at \
         the exit, of {total} QUEUED"
    );
    assert!(at_exit < total as i64, "the backlog was gone before the signal ({at_exit})");
    let partial = assert_exactly_once_so_far(&pg, sku, &answers);
    assert_eq!(partial, at_exit as usize);

    // A second worker finishes the backlog: nothing lost, nothing written twice.
    let mut worker = stack.spawn(&["worker", "--config", &config], "worker-2");
    let started = Instant::now();
    wait_until("the whole backlog", Duration::from_secs(60), || {
        worker.assert_running("worker");
        pg.orders(sku) >= total as i64
    });
    eprintln!("the restarted worker wrote the rest in {:?}", started.elapsed());
    worker.terminate("flashsale worker (restarted)");
    let counted = assert_exactly_once(&pg, sku, &answers, &worker.tail());
    assert_eq!(counted, total);
    assert_eq!(pg.orders(sku), total as i64, "orders {} for {total} QUEUED", pg.orders(sku));
    pg.assert_invariants(sku);
    serve.proc.terminate("flashsale serve --no-worker");
}

/// Mid-backlog check: no buyer has two orders, none belongs to a buyer not told QUEUED;
/// returns the orders counted.
fn assert_exactly_once_so_far(pg: &Pg, sku: (u64, u64), answers: &[Answer]) -> usize {
    let orders = pg.orders_by_user(sku);
    let queued: std::collections::HashSet<u64> =
        answers.iter().filter(|a| a.state.as_deref() == Some("QUEUED")).map(|a| a.user).collect();
    for (user, count) in &orders {
        assert_eq!(*count, 1, "buyer {user} has {count} orders");
        assert!(queued.contains(user), "an order for buyer {user}, never told QUEUED");
    }
    orders.len()
}
