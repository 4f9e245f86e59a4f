//! `flashsale stack up --archive-wal`, `flashsale admin backup` and `flashsale admin
//! restore-drill` through the real binary: the exit codes of CONTRACT.md section 1 (0 the copy
//! reconciles, 1 it does not get there, 2 input refused) and the archiving flag on a private
//! stack. The drill's substance — a sale backed up mid-way and restored between its phases —
//! is `tests/tests/restore_drill.rs`.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use flashsale_engine::app::stack::StackEnv;
use serde_json::Value;

fn flashsale() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flashsale"))
}

fn run(args: &[&str], dir: &Path) -> Output {
    let mut command = flashsale();
    command.args(args).arg("--stack-dir").arg(dir).env_remove("FLASHSALE_PG_URL");
    command.output().expect("run flashsale")
}

/// `flashsale stack ...` (which takes `--dir`, not `--stack-dir`).
fn stack_cmd(args: &[&str]) -> Output {
    flashsale().args(args).output().expect("run flashsale stack")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn now_rfc3339() -> String {
    flashsale_io::wire::format_rfc3339_ms(flashsale_engine::logic::clock::now_ms()).to_string()
}

#[test]
fn refused_input_exits_2_and_writes_nothing() {
    let root = tempfile::tempdir().expect("tmp");
    let dir = root.path();
    let out =
        run(&["admin", "restore-drill", "--backup", "/nonexistent", "--to", &now_rfc3339()], dir);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("not a backup directory"), "{}", stderr(&out));
    let out =
        run(&["admin", "restore-drill", "--backup", "/nonexistent", "--to", "yesterday"], dir);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("RFC 3339"), "{}", stderr(&out));
    std::fs::write(dir.join("something"), "kept").expect("write");
    let out = run(&["admin", "backup", "--dir", &dir.display().to_string()], dir);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("not an empty directory"), "{}", stderr(&out));
    assert_eq!(std::fs::read_dir(dir).expect("dir").count(), 1, "nothing written");
}

/// Runs `sql` (simple query protocol) on `url`.
fn sql(url: &str, sql: &str) -> Vec<String> {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let (client, conn) =
            tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
        let driver = tokio::spawn(conn);
        let rows = client.query(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        drop(client);
        let _ = driver.await;
        rows.iter().map(|r| r.get::<_, String>(0)).collect()
    })
}

#[test]
fn a_stack_that_archives_is_backed_up_and_restored_to_a_point_in_time() {
    // Under /tmp and world-traversable: run as root, PostgreSQL runs as `postgres`.
    let root = tempfile::Builder::new().prefix("flashsale-backup-cli-").tempdir().expect("tmp");
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let stack = root.path().join("stack");
    let s = stack.display().to_string();
    let up = stack_cmd(&["stack", "up", "--dir", &s]);
    assert!(up.status.success(), "{}", stderr(&up));
    // Archiving asked of a server already running without it: refused until it restarts.
    let refused = stack_cmd(&["stack", "up", "--archive-wal", "--dir", &s]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(stderr(&refused).contains("runs without WAL archiving"), "{}", stderr(&refused));
    assert!(stack_cmd(&["stack", "down", "--dir", &s]).status.success());
    let up = stack_cmd(&["stack", "up", "--archive-wal", "--dir", &s]);
    assert!(up.status.success(), "{}", stderr(&up));
    assert!(stderr(&up).contains("archives its WAL into"), "{}", stderr(&up));
    let result = std::panic::catch_unwind(|| backup_and_drill(root.path(), &stack));
    let down = stack_cmd(&["stack", "down", "--purge", "--dir", &s]);
    assert!(down.status.success(), "{}", stderr(&down));
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

fn backup_and_drill(root: &Path, stack: &Path) {
    let url = StackEnv::read(stack).expect("DIR/env").pg_url;
    assert!(run(&["migrate"], stack).status.success());
    let backup = root.join("backup").display().to_string();
    let out = run(&["admin", "backup", "--dir", &backup], stack);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let manifest: Value = serde_json::from_slice(&out.stdout).expect("the manifest");
    assert_eq!(manifest["database"], "postgres");
    sql(
        &url,
        "INSERT INTO activity (activity_id, start_at, end_at, reservation_ttl_ms, pay_timeout_ms) \
               VALUES (1, now(), now() + interval '1 hour', 1000, 1000) RETURNING 'x'",
    );
    std::thread::sleep(Duration::from_millis(200));
    let target = now_rfc3339();
    std::thread::sleep(Duration::from_millis(200));
    // A commit after the target: recovery stops at it (with none, it could not tell it got there).
    sql(&url, "UPDATE activity SET version = 2 WHERE activity_id = 1 RETURNING 'x'");
    let switched = sql(&url, "SELECT pg_walfile_name(pg_switch_wal())").remove(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while sql(&url, "SELECT coalesce(last_archived_wal, '') FROM pg_stat_archiver")[0] < switched {
        assert!(Instant::now() < deadline, "segment {switched} not archived");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Nothing committed after this can be in the archive yet.
    let late = now_rfc3339();
    let json = root.join("report.json");
    let out = run(
        &[
            "admin",
            "restore-drill",
            "--backup",
            &backup,
            "--to",
            &target,
            "--json",
            &json.display().to_string(),
        ],
        stack,
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
    let report: Value =
        serde_json::from_slice(&std::fs::read(&json).expect("--json")).expect("JSON");
    assert_eq!(report["ok"], true);
    assert!(report["rpo_ms"].as_i64().is_some_and(|ms| ms >= 0), "{report:#}");
    assert!(report["rto_ms"].as_u64().is_some_and(|ms| ms > 0), "{report:#}");
    // No commit after `late` is archived: the recovery cannot get there.
    let out = run(&["admin", "restore-drill", "--backup", &backup, "--to", &late], stack);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).expect("a report");
    assert!(report["error"].as_str().is_some_and(|e| e.contains("archive ends before --to")));
}
