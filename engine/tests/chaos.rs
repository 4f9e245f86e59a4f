//! `flashsale chaos` through the real binary, as CI runs it (issue 27 item 5): one short seed
//! end to end — the schedule printed first and equal to `--schedule-only`'s, the nemesis'
//! events without an error, buyers answered, exit 0 and a verdict without breaches — and the
//! negative control (item 4): with the reservation scanner switched off in both instances, a
//! seed of a short fixed list fails the auditor (exit 1, a `promise` breach naming the seed
//! and the ids). Each run leaves its servers stopped (`stack down`); the data is deleted with
//! the temporary directory.
//!
//! The negative control needs the `failpoints` feature in the binary, which a workspace build
//! has (`cargo test --workspace --test chaos`).

use std::path::Path;
use std::process::{Command, Output};

/// One run at a time: each starts a whole `ha` stack and two engines on the 2 shared cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn flashsale() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flashsale"))
}

/// A temporary directory the `postgres` user can traverse (PostgreSQL runs as it under root).
fn workdir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("flashsale-chaos-test-").tempdir().expect("tmp");
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

/// Stops whatever a run left under `dir` (a run that failed part-way keeps its servers).
struct Down<'a>(&'a Path);

impl Drop for Down<'_> {
    fn drop(&mut self) {
        let _ = flashsale().args(["stack", "down", "--dir"]).arg(self.0).output();
    }
}

fn chaos(seed: u64, duration_s: u64, dir: &Path, extra: &[&str]) -> (Output, serde_json::Value) {
    let json = dir.join(format!("verdict-{seed}.json"));
    let out = flashsale()
        .args(["chaos", "--seed", &seed.to_string(), "--duration-s", &duration_s.to_string()])
        .arg("--dir")
        .arg(dir.join(format!("stack-{seed}")))
        .arg("--json")
        .arg(&json)
        .args(extra)
        .output()
        .expect("run flashsale chaos");
    let verdict = std::fs::read(&json)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null);
    (out, verdict)
}

#[test]
fn a_short_seed_runs_clean_and_replays_its_schedule() {
    const SEED: u64 = 1;
    let _turn = turn();
    let root = workdir();
    let _down = Down(&root.path().join(format!("stack-{SEED}")));
    let (out, verdict) = chaos(SEED, 30, root.path(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let schedule = flashsale()
        .args(["chaos", "--seed", &SEED.to_string(), "--duration-s", "30", "--schedule-only"])
        .output()
        .expect("schedule only");
    let schedule = String::from_utf8_lossy(&schedule.stdout).into_owned();
    assert!(schedule.starts_with("chaos schedule of seed 1"), "{schedule}");
    assert!(stdout.starts_with(&schedule), "the run prints the seed's schedule first");
    assert_eq!(verdict["schedule"].as_str(), Some(schedule.as_str()));
    let events = verdict["events"].as_array().expect("events");
    assert!(!events.is_empty(), "the nemesis did nothing: {verdict}");
    for e in events {
        assert!(e["error"].is_null(), "a fault or heal failed: {e}");
    }
    assert!(verdict["answers"]["submit QUEUED"].as_u64().unwrap_or(0) > 0, "{verdict}");
    assert_eq!(verdict["breaches"].as_array().map(Vec::len), Some(0), "{verdict}");
    assert!(stdout.contains("chaos seed 1: OK (0 breaches)"), "{stdout}");
    // The generator's record, one answer per line, for whoever replays the seed.
    let record = root.path().join(format!("verdict-{SEED}.json.answers.jsonl"));
    let record = std::fs::read_to_string(&record).expect("the record beside the verdict");
    let first: serde_json::Value =
        serde_json::from_str(record.lines().next().unwrap_or("")).expect("a JSON answer per line");
    assert!(first["request_id"].as_str().is_some_and(|id| id.starts_with("c1-")), "{first}");
}

/// The seeds tried, in order, until one fails the auditor: each freezes (or kills) the
/// `SECKILL_ORDERS` leader for longer than a publish waits, so some acknowledged-late-or-never
/// messages are left for the scanner to republish (seed 19 did, 7 buyers, when this was
/// written).
const NEGATIVE_CONTROL_SEEDS: [u64; 3] = [19, 33, 36];

#[test]
fn with_the_scanner_off_a_seed_of_the_fixed_list_fails_the_auditor() {
    let _turn = turn();
    let root = workdir();
    let mut seen = Vec::new();
    for seed in NEGATIVE_CONTROL_SEEDS {
        let _down = Down(&root.path().join(format!("stack-{seed}")));
        let (out, verdict) = chaos(seed, 30, root.path(), &["--negative-control", "scanner-off"]);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("needs a build with the failpoints"), "{stderr}");
        if out.status.code() == Some(1) {
            let breaches = verdict["breaches"].as_array().expect("breaches");
            assert!(breaches.iter().any(|b| b["rule"] == "promise"), "{verdict}");
            let line = format!("BREACH seed {seed} [promise]");
            assert!(stdout.contains(&line), "the breach names the seed and ids: {stdout}");
            println!("seed {seed} fails the auditor with the scanner off:\n{stdout}");
            return;
        }
        assert!(out.status.success(), "seed {seed}: {:?} {stderr}", out.status);
        seen.push((seed, verdict["answers"].clone()));
    }
    panic!("no seed of {NEGATIVE_CONTROL_SEEDS:?} saw the loss: {seen:?}");
}
