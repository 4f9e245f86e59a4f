//! `flashsale stack up | down` and `migrate` through the real binary: private servers on free ports,
//! idempotent `up`, `down` stops only what it started, a missing binary is a clear error.

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;

use flashsale_engine::app::stack::{Kind, StackEnv};

fn flashsale() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flashsale"))
}

fn pid_of(dir: &Path, kind: Kind) -> u32 {
    std::fs::read_to_string(dir.join(kind.name()).join("pid"))
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid")
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'))
}

#[test]
fn up_is_idempotent_and_down_stops_only_its_own() {
    // Under /tmp so the `postgres` user can traverse to the data directory.
    let root = tempfile::Builder::new().prefix("flashsale-stack-test-").tempdir().expect("tmp");
    let dir = root.path().join("stack");

    // A "foreign" listener that stack up must not disturb.
    let foreign = TcpListener::bind("127.0.0.1:0").expect("bind");
    let foreign_port = foreign.local_addr().expect("addr").port();

    let out = flashsale().args(["stack", "up", "--dir"]).arg(&dir).output().expect("run up");
    assert!(out.status.success(), "stack up failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let env = StackEnv::read(&dir).expect("DIR/env written");
    assert!(stdout.contains(&format!("export FLASHSALE_REDIS_URL={}", env.redis_url)), "{stdout}");
    assert!(env.pg_url.starts_with("postgres://postgres@127.0.0.1:"), "{}", env.pg_url);
    assert!(env.nats_url.starts_with("nats://127.0.0.1:"), "{}", env.nats_url);
    for url in [&env.redis_url, &env.pg_url, &env.nats_url] {
        assert!(!url.contains(&format!(":{foreign_port}")), "took a busy port: {url}");
        assert!(!url.contains(":6379") && !url.contains(":5432") && !url.contains(":4222"));
    }
    let pids: Vec<u32> = Kind::ALL.iter().map(|k| pid_of(&dir, *k)).collect();
    assert!(pids.iter().all(|p| alive(*p)), "servers not running: {pids:?}");

    // Second up reuses the running servers: same pids, same URLs.
    let out = flashsale().args(["stack", "up", "--dir"]).arg(&dir).output().expect("run up");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let again: Vec<u32> = Kind::ALL.iter().map(|k| pid_of(&dir, *k)).collect();
    assert_eq!(pids, again, "second up must reuse the running stack");
    let env2 = StackEnv::read(&dir).expect("env");
    assert_eq!(env.redis_url, env2.redis_url);
    assert_eq!(env.pg_url, env2.pg_url);

    // Migrations run against the stack's PostgreSQL.
    let out = flashsale()
        .args(["migrate", "--stack-dir"])
        .arg(&dir)
        .env_remove("FLASHSALE_PG_URL")
        .output()
        .expect("run migrate");
    assert!(out.status.success(), "migrate failed: {}", String::from_utf8_lossy(&out.stderr));

    let out = flashsale().args(["stack", "down", "--dir"]).arg(&dir).output().expect("run down");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for pid in &pids {
        assert!(!alive(*pid), "pid {pid} still running after down");
    }
    // The foreign listener is untouched and data is kept without --purge.
    assert!(foreign.local_addr().is_ok());
    assert!(dir.join("postgres").join("data").join("PG_VERSION").is_file());

    // A stale pid file pointing at an unrelated live process (ours) is never signalled.
    std::fs::write(dir.join("redis").join("pid"), std::process::id().to_string()).expect("w");
    let out = flashsale().args(["stack", "down", "--dir"]).arg(&dir).output().expect("down");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("stopped nothing"));

    let out = flashsale()
        .args(["stack", "down", "--purge", "--dir"])
        .arg(&dir)
        .output()
        .expect("down --purge");
    assert!(out.status.success());
    assert!(!dir.exists(), "--purge must remove the data directory");
}

#[test]
fn usage_errors_exit_2() {
    let out = flashsale().args(["stack", "sideways"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    let out = flashsale().args(["--help"]).output().expect("run");
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn missing_server_binary_names_the_package() {
    let root = tempfile::tempdir().expect("tmp");
    let out = flashsale()
        .args(["stack", "up", "--dir"])
        .arg(root.path().join("s"))
        // redis-server lives in /usr/bin: only reachable through PATH.
        .env("PATH", "/nonexistent")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("apt-get install -y redis-server"), "{stderr}");
}

#[test]
fn serve_refuses_to_start_without_pass_keys() {
    let root = tempfile::tempdir().expect("tmp");
    let out = flashsale()
        .args(["serve", "--no-pin", "--stack-dir"])
        .arg(root.path())
        .env_remove("FLASHSALE_PASS_KEYS")
        .output()
        .expect("run serve");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("FLASHSALE_PASS_KEYS") && stderr.contains("--insecure-dev-auth"),
        "{stderr}"
    );

    // A malformed key list is refused with the variable named.
    let out = flashsale()
        .args(["serve", "--no-pin", "--stack-dir"])
        .arg(root.path())
        .env("FLASHSALE_PASS_KEYS", "k1:nothex")
        .output()
        .expect("run serve");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("FLASHSALE_PASS_KEYS"));

    // An admin listener off loopback needs a token.
    let out = flashsale()
        .args([
            "serve",
            "--no-pin",
            "--insecure-dev-auth",
            "--admin-addr",
            "0.0.0.0:0",
            "--stack-dir",
        ])
        .arg(root.path())
        .env_remove("FLASHSALE_ADMIN_TOKEN")
        .output()
        .expect("run serve");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("FLASHSALE_ADMIN_TOKEN"));
}

/// Every process whose command line names `dir` (the servers a stack started under it).
fn processes_under(dir: &Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&needle))
                .unwrap_or(false)
        })
        .filter(|pid| alive(*pid))
        .collect()
}

#[test]
fn topology_ha_starts_every_cluster_and_down_stops_them_all() {
    let root = tempfile::Builder::new().prefix("flashsale-stack-ha-").tempdir().expect("tmp");
    let dir = root.path().join("stack");
    let up = || flashsale().args(["stack", "up", "--topology", "ha", "--dir"]).arg(&dir).output();
    let out = up().expect("run up");
    assert!(out.status.success(), "stack up failed: {}", String::from_utf8_lossy(&out.stderr));
    let env = StackEnv::read(&dir).expect("DIR/env written");
    assert_eq!(env.redis_url.matches(',').count(), 5, "six Redis seeds: {}", env.redis_url);
    assert_eq!(env.nats_url.matches("nats://").count(), 3, "three NATS nodes: {}", env.nats_url);
    assert!(env.pg_url.contains("target_session_attrs=read-write"), "{}", env.pg_url);
    assert_eq!(env.pg_url.matches(',').count(), 2, "primary and two standbys: {}", env.pg_url);
    // redis-server rewrites its process title, so the nodes are counted by their ports.
    let redis_ports: Vec<String> =
        env.redis_url.trim_start_matches("redis://").split(',').map(str::to_owned).collect();
    let listening = |hp: &String| std::net::TcpStream::connect(hp.as_str()).is_ok();
    assert!(redis_ports.iter().all(listening), "every Redis node listens: {redis_ports:?}");
    let running = processes_under(&dir);
    // 3 nats-server and 3 postmasters (their backends name no directory).
    assert!(running.len() >= 6, "servers running: {running:?}");
    let again = up().expect("run up again");
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(StackEnv::read(&dir).expect("env"), env, "a second up reuses the stack");
    let down = flashsale().args(["stack", "down", "--dir"]).arg(&dir).output().expect("down");
    assert!(down.status.success(), "{}", String::from_utf8_lossy(&down.stderr));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !processes_under(&dir).is_empty() || redis_ports.iter().any(listening) {
        assert!(std::time::Instant::now() < deadline, "left running: {:?}", processes_under(&dir));
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn an_up_that_fails_part_way_stops_what_it_started() {
    let root = tempfile::Builder::new().prefix("flashsale-stack-test-").tempdir().expect("tmp");
    let dir = root.path().join("stack");
    std::fs::create_dir_all(&dir).expect("mkdir");
    // PostgreSQL's directory cannot be created (a file stands there): redis-server starts
    // first, then PostgreSQL fails.
    std::fs::write(dir.join(Kind::Postgres.name()), "not a directory").expect("write");
    let out = flashsale().args(["stack", "up", "--dir"]).arg(&dir).output().expect("run up");
    assert!(!out.status.success(), "stack up must fail");
    let redis_pid = pid_of(&dir, Kind::Redis);
    assert!(!alive(redis_pid), "redis-server {redis_pid} left running after a failed up");
    println!("failed up: {}", String::from_utf8_lossy(&out.stderr).trim());
}
