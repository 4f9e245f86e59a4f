//! Backups and point-in-time restore with PostgreSQL's own tools (issue 26 item 4; seed ch9
//! §11.4, §13.6). A private PostgreSQL archives its WAL (`stack::wal_archive`, as `flashsale
//! stack up --archive-wal` sets it), an engine with its worker sells through it, a base backup
//! is taken mid-sale (`flashsale admin backup`, while buyers keep buying), the sale goes on, and
//! `flashsale admin restore-drill` brings copies back to chosen points:
//!
//! - to a time between phase 2 and phase 3: exit 0, the copy holds exactly the orders and
//!   payments committed before it — every one of phases 1-2, none of 3 —, reconciles, and
//!   reports RPO and RTO;
//! - to a time before phase 2: none of phase 2's orders (what "exactly" must also exclude);
//! - to a time after a write outside the state machine (a ledger CLAIM deleted by hand): exit
//!   1, the ledger check names it — the checks can fail, and the restore to before the write is
//!   how such damage is undone;
//! - from an archive missing the segment that holds phase 2: exit 1, the recovery cannot reach
//!   the target and the survey names the missing segment;
//! - bad input: refused as a usage error (exit 2 in `main`) before anything is written.
//!
//! The scenario is built once per test binary ([`scenario`]), then its servers are stopped: the
//! drills need only the backup and the archive. A watchdog deletes the scenario's directory (and
//! kills any server recorded in it, such as a copy a failed test kept) once the binary exits.
//!
//! The `flashsale admin` commands run in-process through `admin_cli::parse_from` and `run`, as
//! this crate's other tests run `flashsale admin` (it cannot name the `flashsale` binary, which
//! `engine/tests/backup_cli.rs` runs for the exit codes and `stack up --archive-wal`).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use flashsale_engine::app::admin_cli;
use flashsale_engine::app::backup::{UsageError, MANIFEST_FILE};
use flashsale_engine::app::stack::{wal_archive, Kind, Server};
use flashsale_io::wire::{format_rfc3339_ms, parse_rfc3339_ms};
use flashsale_tests::{sale, small_worker, state, wait_for_ms, Engine, HttpClient, TestDb};
use serde_json::{json, Value};

const ACTIVITY: u64 = 7001;
const SKU: u64 = 1;
const PRICE_CENTS: i64 = 500;
/// Quiet time on either side of a recorded restore point: no commit of the sale falls near it.
const MARGIN: Duration = Duration::from_millis(300);

fn now_ms() -> u64 {
    flashsale_engine::logic::clock::now_ms()
}

// ---- the scenario ---------------------------------------------------------------------------

/// What the sale left: the backup, the archive, and what was committed at each point.
struct Scenario {
    root: PathBuf,
    backup: PathBuf,
    archive: PathBuf,
    database: String,
    timeline: u64,
    finished_ms: u64,
    before_phase_two: u64,
    orders_phase_one: BTreeSet<String>,
    phase_two_started: u64,
    between: u64,
    orders_up_to_two: BTreeSet<String>,
    payments_up_to_two: BTreeSet<String>,
    /// The segment PostgreSQL was writing when phase 2 had committed.
    phase_two_segment: String,
    after_tamper: u64,
}

static SCENARIO: OnceLock<Scenario> = OnceLock::new();

fn scenario() -> &'static Scenario {
    SCENARIO.get_or_init(build_scenario)
}

/// A PostgreSQL server of the scenario's own, stopped on drop (also when building panics).
struct Source(Server);

impl Drop for Source {
    fn drop(&mut self) {
        let _ = self.0.stop();
    }
}

fn build_scenario() -> Scenario {
    let root = tempfile::Builder::new().prefix("flashsale-test-pitr-").tempdir().unwrap().keep();
    flashsale_tests::watchdog(&root);
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let pg_dir = root.join("pg");
    let archive = pg_dir.join(wal_archive::ARCHIVE_DIR_NAME);
    wal_archive::enable(&pg_dir, &archive).expect("archiving configured");
    let source = Source(Server::start(Kind::Postgres, &pg_dir, None).expect("source PostgreSQL"));
    wal_archive::check_running(source.0.addr()).expect("the source archives");
    execute(&source.0.url(), "CREATE DATABASE drill");
    let db = TestDb {
        url: format!("postgres://postgres@127.0.0.1:{}/drill", source.0.port),
        name: "drill".into(),
    };
    let engine = Engine::start_on(db.clone(), |c| c.worker = Some(small_worker(c)));
    engine.create_activity_with(&format!(
        r#"{{"activity_id":{ACTIVITY},"sku_id":{SKU},"stock":100,"price_cents":{PRICE_CENTS}}}"#
    ));
    sell(engine.http(), 1..=8);
    pay(&db.url, &[1, 2]);
    let backup = root.join("backup");
    // Mid-sale: buyers keep buying while the base backup runs.
    let manifest = std::thread::scope(|s| {
        let buyers = s.spawn(|| sell(engine.http(), 101..=110));
        let manifest = take_backup(&backup, &db.url);
        buyers.join().expect("phase 1b sold");
        manifest
    });
    let orders_phase_one = strings(&db.url, "SELECT order_id FROM orders");
    std::thread::sleep(MARGIN);
    let before_phase_two = now_ms();
    std::thread::sleep(MARGIN);
    let phase_two_started = now_ms();
    sell(engine.http(), 201..=208);
    pay(&db.url, &[201, 202]);
    let phase_two_segment = string(&db.url, "SELECT pg_walfile_name(pg_current_wal_lsn())");
    // Phase 2's segment is closed and archived: what follows goes to later ones, so that a copy
    // of the archive without it has a gap, not just an end.
    archive_everything(&db.url);
    let orders_up_to_two = strings(&db.url, "SELECT order_id FROM orders");
    let payments_up_to_two = strings(&db.url, "SELECT payment_id FROM payment");
    std::thread::sleep(MARGIN);
    let between = now_ms();
    std::thread::sleep(MARGIN);
    sell(engine.http(), 301..=308);
    // A write outside the state machine: one order's ledger CLAIM deleted by hand.
    execute(
        &db.url,
        "DELETE FROM inventory_ledger l USING orders o \
         WHERE o.user_id = 1 AND l.reservation_id = o.reservation_id AND l.kind = 'CLAIM'",
    );
    std::thread::sleep(MARGIN);
    let after_tamper = now_ms();
    std::thread::sleep(MARGIN);
    sell(engine.http(), 401..=402);
    archive_everything(&db.url);
    drop(engine);
    drop(source);
    Scenario {
        timeline: manifest["timeline"].as_u64().unwrap(),
        finished_ms: parse_rfc3339_ms(manifest["finished_at"].as_str().unwrap()).unwrap(),
        database: manifest["database"].as_str().unwrap().to_owned(),
        root,
        backup,
        archive,
        before_phase_two,
        orders_phase_one,
        phase_two_started,
        between,
        orders_up_to_two,
        payments_up_to_two,
        phase_two_segment,
        after_tamper,
    }
}

/// Each buyer of `users` submits once and gets an order (waits for all of them).
fn sell(http: SocketAddr, users: std::ops::RangeInclusive<u64>) {
    let mut c = HttpClient::connect(http);
    let sku = (ACTIVITY, SKU);
    for user in users.clone() {
        let v = sale::submit(&mut c, user, sku, &format!("req-{user}")).expect("an answer");
        assert_eq!(state(&v), "QUEUED", "{v}");
    }
    for user in users {
        wait_for_ms("the order", 20_000, || {
            let v = sale::query(&mut c, user, sku, &format!("req-{user}"));
            v.is_some_and(|v| state(&v) == "SUCCEEDED")
        });
    }
}

/// The orders of `users` paid through the payment state machine.
fn pay(url: &str, users: &[u64]) {
    block_on(url, |client| async move {
        for user in users {
            let row = client
                .query_one("SELECT order_id FROM orders WHERE user_id = $1", &[&(*user as i64)])
                .await
                .unwrap();
            let order_id: String = row.get(0);
            let callback = flashsale_pg_worker::payments::PaymentCallback {
                payment_id: format!("pay-{user}"),
                order_id,
                status: "PAID".into(),
                amount_cents: PRICE_CENTS,
            };
            flashsale_pg_worker::payments::apply_callback(&client, &callback, now_ms())
                .await
                .expect("payment applied");
        }
    })
}

/// `flashsale admin backup --dir DIR --pg-url URL`; its manifest.
fn take_backup(dir: &Path, url: &str) -> Value {
    let (status, out) = admin(&["backup", "--dir", &dir.display().to_string(), "--pg-url", url]);
    assert_eq!(status.expect("backup"), 0, "{out}");
    let manifest: Value = serde_json::from_str(&out).expect("the manifest printed");
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(MANIFEST_FILE)).unwrap()).unwrap();
    assert_eq!(manifest, written);
    manifest
}

/// Switches the WAL segment and waits until the archive holds it: everything committed so far
/// is in the archive.
fn archive_everything(url: &str) {
    let switched = string(url, "SELECT pg_walfile_name(pg_switch_wal())");
    wait_for_ms("the last segment archived", 30_000, || {
        let archived = string(url, "SELECT coalesce(last_archived_wal, '') FROM pg_stat_archiver");
        archived.as_str() >= switched.as_str()
    });
}

// ---- PostgreSQL and the CLI -----------------------------------------------------------------

fn block_on<R, F>(url: &str, f: impl FnOnce(tokio_postgres::Client) -> F) -> R
where
    F: std::future::Future<Output = R>,
{
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("connect {url}: {e}"));
        let driver = tokio::spawn(conn);
        let out = f(client).await;
        let _ = driver.await;
        out
    })
}

fn execute(url: &str, sql: &str) {
    block_on(
        url,
        |c| async move { c.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}")) },
    )
}

fn strings(url: &str, sql: &str) -> BTreeSet<String> {
    block_on(url, |c| async move {
        let rows = c.query(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        rows.iter().map(|r| r.get::<_, String>(0)).collect()
    })
}

fn string(url: &str, sql: &str) -> String {
    block_on(url, |c| async move {
        c.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}")).get::<_, String>(0)
    })
}

/// `flashsale admin <args>` in-process: (the status or the error, what it printed).
fn admin(args: &[&str]) -> (anyhow::Result<u8>, String) {
    let mut argv = vec!["admin", "--stack-dir", "/nonexistent"];
    argv.extend_from_slice(args);
    let parsed = admin_cli::parse_from(argv).expect("the command line parses");
    let mut out = Vec::new();
    let status = admin_cli::run(parsed, &Default::default(), &mut out);
    (status, String::from_utf8(out).unwrap())
}

/// One drill's outcome, and the work directory of its own it ran in (tests may run at once).
struct Drilled {
    status: u8,
    report: Value,
    work: PathBuf,
}

/// `flashsale admin restore-drill --backup DIR --to T --work-dir W --json FILE [--keep]`, in a
/// fresh work directory `W`.
fn drill(backup: &Path, to_ms: u64, keep: Keep) -> Drilled {
    let s = scenario();
    let to = format_rfc3339_ms(to_ms).to_string();
    let work = s.root.join(format!("work-{}", rand::random::<u32>()));
    std::fs::create_dir(&work).unwrap();
    let json_path = work.join("report.json");
    let (backup, w, json_file) =
        (backup.display().to_string(), work.display().to_string(), json_path.display().to_string());
    let mut args = vec!["restore-drill", "--backup", &backup, "--to", &to, "--work-dir", &w];
    args.extend(["--json", &json_file]);
    if keep == Keep::Running {
        args.push("--keep");
    }
    let (status, out) = admin(&args);
    let status = status.unwrap_or_else(|e| panic!("the drill did not run: {e:#}"));
    let report: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(report, written, "--json writes the printed report");
    Drilled { status, report, work }
}

/// The directories a drill left in its work directory (a copy not removed).
fn dirs_left(work: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(work).unwrap().flatten();
    entries.map(|e| e.path()).filter(|p| p.is_dir()).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    Running,
    No,
}

/// A copy the drill kept running (`--keep`): stopped and deleted on drop.
struct Kept {
    dir: PathBuf,
    port: u16,
}

impl Kept {
    fn of(report: &Value) -> Kept {
        let restored = &report["restored"];
        let (Some(dir), Some(port)) = (restored["dir"].as_str(), restored["port"].as_u64()) else {
            panic!("no copy kept: {report:#}");
        };
        Kept { dir: PathBuf::from(dir), port: port as u16 }
    }

    fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        if let Some(server) = Server::find_running(Kind::Postgres, &self.dir) {
            let _ = server.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ---- the drills -----------------------------------------------------------------------------

#[test]
fn a_restore_between_two_phases_holds_exactly_what_was_committed_before_it() {
    let s = scenario();
    let started = Instant::now();
    let Drilled { status, report, .. } = drill(&s.backup, s.between, Keep::Running);
    let wall_ms = started.elapsed().as_millis() as u64;
    let kept = Kept::of(&report);
    assert_eq!((status, &report["ok"]), (0, &json!(true)), "{report:#}");
    let url = kept.url(&s.database);
    let orders = strings(&url, "SELECT order_id FROM orders");
    assert_eq!(orders, s.orders_up_to_two, "exactly the orders of phases 1 and 2");
    assert_eq!(strings(&url, "SELECT payment_id FROM payment"), s.payments_up_to_two);
    let skus = report["checks"]["skus"].as_array().expect("per-SKU figures");
    assert_eq!(skus.len(), 1, "{report:#}");
    assert_eq!(skus[0]["violations"], json!([]));
    assert_eq!(skus[0]["reconcile"]["invariants"]["orders_total"], json!(orders.len()));
    assert_eq!(skus[0]["payments"]["paid_amount_cents"], json!(4 * PRICE_CENTS));
    assert!(report["checks"]["unique_keys"]["amcheck"] == json!(true), "{report:#}");
    // The copy ended its recovery as a primary on a timeline of its own.
    assert_eq!(report["restored"]["timeline"], json!(s.timeline + 1));
    let log = report["restored"]["recovery_log"].to_string();
    assert!(log.contains("recovery stopping before commit"), "{log}");
    // RPO: the newest commit recovered is at or before the target, and not older than phase
    // 2's start (its orders are in the copy).
    assert_eq!(report["newest_commit"]["source"], "commit_timestamp");
    let rpo_ms = report["rpo_ms"].as_i64().expect("rpo_ms");
    assert!((0..=(s.between - s.phase_two_started) as i64).contains(&rpo_ms), "{report:#}");
    let rto_ms = report["rto_ms"].as_u64().expect("rto_ms");
    let elapsed_ms = report["elapsed_ms"].as_u64().unwrap();
    assert!(0 < rto_ms && rto_ms <= elapsed_ms && elapsed_ms <= wall_ms, "{report:#}");
    eprintln!(
        "restore drill: RPO {rpo_ms} ms, RTO {rto_ms} ms (phases {}), {} orders, archive {}",
        report["phases_ms"],
        orders.len(),
        report["wal_archive"]
    );
}

#[test]
fn a_restore_to_before_phase_two_holds_none_of_its_orders() {
    let s = scenario();
    let Drilled { status, report, .. } = drill(&s.backup, s.before_phase_two, Keep::Running);
    let kept = Kept::of(&report);
    assert_eq!(status, 0, "{report:#}");
    let orders = strings(&kept.url(&s.database), "SELECT order_id FROM orders");
    assert_eq!(
        orders, s.orders_phase_one,
        "the orders of phase 1 (and those sold during the backup)"
    );
    assert!(orders.len() < s.orders_up_to_two.len());
    assert!(orders.iter().all(|o| s.orders_up_to_two.contains(o)));
}

#[test]
fn a_write_outside_the_state_machine_fails_the_restore_that_holds_it() {
    let s = scenario();
    let Drilled { status, report, work } = drill(&s.backup, s.after_tamper, Keep::No);
    assert_eq!((status, &report["ok"]), (1, &json!(false)), "{report:#}");
    let violations = report["violations"].to_string();
    assert!(violations.contains("ledger: 1 orders without their CLAIM"), "{violations}");
    assert_eq!(report["rto_ms"], Value::Null, "no RTO for a copy that does not reconcile");
    assert!(report["error"].is_null(), "the restore itself worked: {report:#}");
    assert_eq!(dirs_left(&work), Vec::<PathBuf>::new(), "the copy was stopped and removed");
}

#[test]
fn an_archive_missing_a_segment_cannot_reach_the_target() {
    let s = scenario();
    // The same backup, beside a copy of the archive without the segment phase 2 is in.
    let gap = s.root.join(format!("gap-{}", rand::random::<u32>()));
    let (backup, archive) = (gap.join("backup"), gap.join("archive"));
    std::fs::create_dir_all(&backup).unwrap();
    std::fs::create_dir_all(&archive).unwrap();
    std::os::unix::fs::symlink(s.backup.join("data"), backup.join("data")).unwrap();
    for entry in std::fs::read_dir(&s.archive).unwrap().flatten() {
        if entry.file_name().to_string_lossy() != s.phase_two_segment {
            std::fs::hard_link(entry.path(), archive.join(entry.file_name())).unwrap();
        }
    }
    let mut manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(s.backup.join(MANIFEST_FILE)).unwrap())
            .unwrap();
    manifest["wal_archive"] = json!(archive.display().to_string());
    std::fs::write(backup.join(MANIFEST_FILE), manifest.to_string()).unwrap();
    let Drilled { status, report, work } = drill(&backup, s.between, Keep::No);
    assert_eq!((status, &report["ok"]), (1, &json!(false)), "{report:#}");
    assert_eq!(report["backup_verified"], true, "the base backup itself is whole");
    assert_eq!(report["wal_archive"]["first_missing"], json!(s.phase_two_segment), "{report:#}");
    let error = report["error"].as_str().unwrap_or_default();
    assert!(error.contains("recovery ended before configured recovery target"), "{error}");
    assert!(error.contains("archive ends before --to"), "{error}");
    assert_eq!(dirs_left(&work), Vec::<PathBuf>::new(), "the failed copy was removed");
}

#[test]
fn bad_input_is_refused_before_anything_is_touched() {
    let s = scenario();
    let work = s.root.join(format!("untouched-{}", rand::random::<u32>()));
    std::fs::create_dir(&work).unwrap();
    let w = work.display().to_string();
    let backup = s.backup.display().to_string();
    let at = |ms: u64| format_rfc3339_ms(ms).to_string();
    let cases = [
        ("/nonexistent/backup".to_owned(), at(s.between), "not a backup directory"),
        (backup.clone(), at(s.finished_ms - 1_000), "before the backup finished"),
        (backup.clone(), at(now_ms() + 3_600_000), "in the future"),
    ];
    for (dir, to, why) in cases {
        let (status, out) =
            admin(&["restore-drill", "--backup", &dir, "--to", &to, "--work-dir", &w]);
        let e = status.expect_err(why);
        assert!(e.downcast_ref::<UsageError>().is_some(), "{why}: {e:#}");
        assert!(e.to_string().contains(why), "{e}");
        assert!(out.is_empty(), "no report for refused input: {out}");
    }
    let unparsable =
        admin_cli::parse_from(["admin", "restore-drill", "--backup", &backup, "--to", "yesterday"]);
    let e = unparsable.expect_err("an unparsable time");
    assert_eq!(e.exit_code(), 2, "{e}");
    assert_eq!(std::fs::read_dir(&work).unwrap().count(), 0, "nothing written");
    // A backup into a directory that holds something: refused before connecting anywhere.
    let (status, _) =
        admin(&["backup", "--dir", &backup, "--pg-url", "postgres://postgres@127.0.0.1:1/x"]);
    let e = status.expect_err("a non-empty --dir");
    assert!(e.downcast_ref::<UsageError>().is_some(), "{e:#}");
    assert!(s.backup.join(MANIFEST_FILE).is_file(), "the backup is untouched");
}
