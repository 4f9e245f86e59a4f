//! A PostgreSQL primary with two streaming standbys on loopback (DESIGN.md section 11,
//! CONTRACT.md section 1's `--topology ha`), and the operations a failover drill needs.
//!
//! What it is: [`PgStandbys::up`] initialises `pg0` (the first primary) with
//! `synchronous_standby_names = 'ANY 1 (s1, s2)'`, copies it with `pg_basebackup -R` into
//! `s1` and `s2` (each `primary_conninfo` carrying its `application_name`, so the names
//! match), starts both and waits until `pg_stat_replication` shows them streaming. Then:
//! [`PgStandbys::promote`] (`pg_promote()`), [`PgStandbys::follow`] (re-point a standby at
//! the new primary, as a failover manager does), [`PgStandbys::stop`], `freeze`/`thaw`
//! (SIGSTOP/SIGCONT of the postmaster and its backends: a hung host whose kernel still
//! accepts connections), `kill` (-9), and [`PgStandbys::restart_writable`] (an old primary
//! brought back WITHOUT `standby.signal`: writable, on the timeline it had, which is the
//! split brain the client's fencing rule refuses, see `pg-worker/src/pool.rs`).
//! [`PgStandbys::url`] is the libpq multi-host URL with `target_session_attrs=read-write`.
//!
//! SQL for set-up and drills goes through the stack's tiny blocking simple-query client
//! (`pg_query.rs`, trust authentication on loopback only): the starters are synchronous and
//! must not need an async runtime.
//!
//! What it is not: a failover manager. Nothing here promotes on its own; a drill (or an
//! operator, or Patroni in production, see `tuning/postgresql-ha.md`) decides. Layout:
//! `DIR/pg0`, `DIR/s1`, `DIR/s2`, each with `data/`, `server.log`, `pid` and `port`, and with
//! [`PgStandbys::up_with`] archiving on, `DIR/wal-archive` (`wal_archive.rs`).
//! Measured here (FIELD-NOTES.md): primary + standby from scratch ~1.1 s; stop primary +
//! promote + first read-write connect ~0.24 s.

use std::fs;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::error::{io_err, StackError};
use super::kind::{find_binary, Kind};
use super::pg_init::{
    as_postgres_user, chown_tree, ensure_traversable, init_postgres, postgres_owner,
};
use super::pg_query::simple_query;
use super::process::{process_alive, process_matches, process_state, signal_process};
use super::server::Server;
use super::wal_archive::{self, WalArchiving, ARCHIVE_DIR_NAME};

/// The nodes: the first primary, then the two standbys (also their `application_name`s).
pub const NODE_NAMES: [&str; 3] = ["pg0", "s1", "s2"];
/// The primary's synchronous replication rule: a commit waits for either standby.
pub const SYNCHRONOUS_STANDBY_NAMES: &str = "ANY 1 (s1, s2)";
/// Bound on waiting for standbys to stream, a promotion, or a role change.
const ROLE_TIMEOUT: Duration = Duration::from_secs(60);

fn service_err(message: String) -> StackError {
    StackError::Service { service: "postgres standbys", message }
}

/// Whether an old primary brought back keeps its synchronous-standby rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncStandbys {
    /// As configured: its commits then wait for a standby that no longer follows it.
    AsConfigured,
    /// Cleared (`synchronous_standby_names = ''`): it commits alone, the worst case of a
    /// primary an operator restarted by hand.
    Cleared,
}

/// One node: name, port, directory, and the process while it runs.
#[derive(Debug)]
pub struct PgNode {
    pub name: &'static str,
    pub port: u16,
    pub dir: PathBuf,
    server: Option<Server>,
}

impl PgNode {
    pub fn pid(&self) -> Option<u32> {
        self.server.as_ref().map(|s| s.pid)
    }

    pub fn is_running(&self) -> bool {
        self.server.is_some()
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }
}

/// The primary and its standbys.
#[derive(Debug)]
pub struct PgStandbys {
    dir: PathBuf,
    nodes: Vec<PgNode>,
}

impl PgStandbys {
    /// Reuses the three nodes recorded under `dir` when all run; builds them from scratch
    /// when none exists; refuses a half-present set (`stack down --purge` first). A failure
    /// part-way stops what this call started.
    pub fn up(dir: &Path) -> Result<PgStandbys, StackError> {
        PgStandbys::up_with(dir, WalArchiving::AsConfigured)
    }

    /// [`PgStandbys::up`], with WAL archiving into `DIR/wal-archive` when `wal` says so: set
    /// on `pg0` before its first start, and copied to the standbys by `pg_basebackup` with
    /// the rest of its configuration, so that a promoted standby archives too. A running set
    /// is only checked (its primary must already archive).
    pub fn up_with(dir: &Path, wal: WalArchiving) -> Result<PgStandbys, StackError> {
        let set = PgStandbys::start_or_build(dir, wal)?;
        if wal == WalArchiving::On {
            let primary = (0..set.nodes.len()).find(|&i| set.is_primary(i));
            if let Some(index) = primary {
                wal_archive::check_running(SocketAddr::from((
                    [127, 0, 0, 1],
                    set.nodes[index].port,
                )))?;
            }
        }
        Ok(set)
    }

    fn start_or_build(dir: &Path, wal: WalArchiving) -> Result<PgStandbys, StackError> {
        fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        let dir = dir.canonicalize().map_err(io_err(format!("canonicalize {}", dir.display())))?;
        let present = NODE_NAMES.iter().filter(|n| dir.join(n).join("data").exists()).count();
        if present == NODE_NAMES.len() {
            let running: Vec<Option<Server>> = NODE_NAMES
                .iter()
                .map(|n| Server::find_running(Kind::Postgres, &dir.join(n)))
                .collect();
            if running.iter().all(Option::is_some) {
                let nodes = NODE_NAMES
                    .iter()
                    .zip(running)
                    .filter_map(|(name, server)| {
                        let server = server?;
                        Some(PgNode {
                            name,
                            port: server.port,
                            dir: dir.join(name),
                            server: Some(server),
                        })
                    })
                    .collect();
                return Ok(PgStandbys { dir, nodes });
            }
        }
        if present > 0 {
            return Err(service_err(format!(
                "{} holds a partial or stopped primary/standby set; stop it and purge the \
                 directory first (stack down --purge)",
                dir.display()
            )));
        }
        let mut set = PgStandbys {
            dir: dir.clone(),
            nodes: NODE_NAMES
                .iter()
                .map(|name| PgNode { name, port: 0, dir: dir.join(name), server: None })
                .collect(),
        };
        match set.build(wal) {
            Ok(()) => Ok(set),
            Err(e) => {
                set.stop_all();
                Err(e)
            }
        }
    }

    fn build(&mut self, wal: WalArchiving) -> Result<(), StackError> {
        let primary_dir = self.nodes[0].dir.clone();
        fs::create_dir_all(&primary_dir).map_err(io_err("create the primary's directory"))?;
        init_postgres(&primary_dir)?;
        if wal == WalArchiving::On {
            wal_archive::enable(&primary_dir, &self.dir.join(ARCHIVE_DIR_NAME))?;
        }
        append(
            &primary_dir.join("data").join("postgresql.conf"),
            &format!(
                "\n# flashsale pg_standbys\nsynchronous_standby_names = '{SYNCHRONOUS_STANDBY_NAMES}'\n\
                 wal_keep_size = '512MB'\n"
            ),
        )?;
        let primary = Server::start(Kind::Postgres, &primary_dir, None)?;
        self.nodes[0].port = primary.port;
        self.nodes[0].server = Some(primary);
        for index in 1..self.nodes.len() {
            self.base_backup(index, 0)?;
            let server = Server::start(Kind::Postgres, &self.nodes[index].dir, None)?;
            self.nodes[index].port = server.port;
            self.nodes[index].server = Some(server);
        }
        self.wait_streaming(0, &[1, 2])
    }

    /// `pg_basebackup -R` of `primary` into node `index`, with its `application_name`.
    fn base_backup(&self, index: usize, primary: usize) -> Result<(), StackError> {
        let node = &self.nodes[index];
        fs::create_dir_all(&node.dir).map_err(io_err(format!("create {}", node.dir.display())))?;
        if let Some(owner) = postgres_owner()? {
            ensure_traversable(&node.dir, owner)?;
            chown_tree(&node.dir, owner)?;
        }
        let mut command = Command::new(find_binary(Kind::Postgres, "pg_basebackup")?);
        command
            .args(["-h", "127.0.0.1", "-p", &self.nodes[primary].port.to_string()])
            .args(["-U", "postgres", "-X", "stream", "-R", "--no-sync", "--checkpoint=fast", "-D"])
            .arg(node.data());
        as_postgres_user(&mut command)?;
        let output = command.output().map_err(io_err("run pg_basebackup"))?;
        if !output.status.success() {
            return Err(service_err(format!(
                "pg_basebackup for {} failed: {}",
                node.name,
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        // Later lines win: the conninfo -R wrote, plus the name the primary's rule expects.
        append(
            &node.data().join("postgresql.auto.conf"),
            &format!("primary_conninfo = '{}'\n", self.conninfo(index, primary)),
        )
    }

    fn conninfo(&self, standby: usize, primary: usize) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres application_name={}",
            self.nodes[primary].port, self.nodes[standby].name
        )
    }

    pub fn nodes(&self) -> &[PgNode] {
        &self.nodes
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The libpq multi-host URL over every node in order, `target_session_attrs=read-write`.
    pub fn url(&self, dbname: &str) -> String {
        self.url_ordered(&(0..self.nodes.len()).collect::<Vec<_>>(), dbname)
    }

    /// The same over the nodes in `order` (a drill lists the old primary first).
    pub fn url_ordered(&self, order: &[usize], dbname: &str) -> String {
        let hosts: Vec<String> =
            order.iter().map(|&i| format!("127.0.0.1:{}", self.nodes[i].port)).collect();
        format!("postgres://postgres@{}/{dbname}?target_session_attrs=read-write", hosts.join(","))
    }

    /// A single-host URL of node `index`.
    pub fn node_url(&self, index: usize, dbname: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{dbname}", self.nodes[index].port)
    }

    /// Runs `sql` on node `index` (database `postgres`); rows of text values.
    pub fn query(&self, index: usize, sql: &str) -> Result<Vec<Vec<Option<String>>>, StackError> {
        simple_query(SocketAddr::from(([127, 0, 0, 1], self.nodes[index].port)), sql)
    }

    /// True when node `index` answers and is not in recovery (a writable primary).
    pub fn is_primary(&self, index: usize) -> bool {
        self.query(index, "SELECT pg_is_in_recovery()")
            .is_ok_and(|rows| rows.first().and_then(|r| r[0].as_deref()) == Some("f"))
    }

    /// Waits until `primary`'s `pg_stat_replication` shows every one of `standbys` streaming.
    pub fn wait_streaming(&self, primary: usize, standbys: &[usize]) -> Result<(), StackError> {
        let deadline = Instant::now() + ROLE_TIMEOUT;
        loop {
            let rows = self
                .query(
                    primary,
                    "SELECT application_name FROM pg_stat_replication WHERE state = 'streaming'",
                )
                .unwrap_or_default();
            let streaming: Vec<&str> = rows.iter().filter_map(|r| r[0].as_deref()).collect();
            if standbys.iter().all(|&s| streaming.contains(&self.nodes[s].name)) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(service_err(format!(
                    "standbys {standbys:?} not streaming from {} within {ROLE_TIMEOUT:?} \
                     (streaming: {streaming:?})",
                    self.nodes[primary].name
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Promotes standby `index` (`pg_promote`, waiting) and waits until it is writable.
    pub fn promote(&self, index: usize) -> Result<(), StackError> {
        self.query(index, "SELECT pg_promote(true, 60)")?;
        let deadline = Instant::now() + ROLE_TIMEOUT;
        while !self.is_primary(index) {
            if Instant::now() > deadline {
                return Err(service_err(format!(
                    "{} not writable after promote",
                    self.nodes[index].name
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Re-points standby `standby` at `primary` (`primary_conninfo` is reloadable since
    /// PostgreSQL 13; `recovery_target_timeline = latest`, the default, follows the new
    /// timeline) and waits until it streams from there.
    pub fn follow(&self, standby: usize, primary: usize) -> Result<(), StackError> {
        let conninfo = self.conninfo(standby, primary);
        self.query(standby, &format!("ALTER SYSTEM SET primary_conninfo = '{conninfo}'"))?;
        self.query(standby, "SELECT pg_reload_conf()")?;
        self.wait_streaming(primary, &[standby])
    }

    /// Fast shutdown of node `index` (a frozen one is thawed first).
    pub fn stop(&mut self, index: usize) -> Result<(), StackError> {
        // A node that is not running has nothing to thaw.
        let _ = self.thaw(index);
        match self.nodes[index].server.take() {
            Some(server) => server.stop(),
            None => Ok(()),
        }
    }

    /// kill -9 of the postmaster (its backends exit when they notice). `Err(Refused)` when
    /// the node is not running or its pid is not our server (nothing signalled, node kept).
    pub fn kill(&mut self, index: usize) -> Result<(), StackError> {
        let _ = self.thaw(index);
        let node = &mut self.nodes[index];
        let Some(server) = node.server.as_ref() else {
            return Err(not_running(node));
        };
        server.kill()?;
        node.server = None;
        Ok(())
    }

    /// SIGSTOP of the postmaster and its children: the kernel still completes TCP handshakes,
    /// nothing answers (a hung host, or a dead machine that sends no RST). `Ok` once the
    /// postmaster is stopped (`T` in `/proc/PID/stat`); `Err(Refused)` when the node is not
    /// our running server.
    pub fn freeze(&self, index: usize) -> Result<(), StackError> {
        self.signal_tree(index, libc::SIGSTOP)
    }

    /// SIGCONT of the postmaster and its children; `Ok` once the postmaster runs again.
    pub fn thaw(&self, index: usize) -> Result<(), StackError> {
        self.signal_tree(index, libc::SIGCONT)
    }

    fn signal_tree(&self, index: usize, signal: i32) -> Result<(), StackError> {
        let node = &self.nodes[index];
        let server = node.server.as_ref().ok_or_else(|| not_running(node))?;
        server.check()?;
        signal_process(server.pid, signal);
        for child in children_of(server.pid) {
            signal_process(child, signal);
        }
        let stopped = signal == libc::SIGSTOP;
        let deadline = Instant::now() + Duration::from_secs(5);
        while (process_state(server.pid) == Some('T')) != stopped {
            if Instant::now() > deadline {
                return Err(StackError::Refused {
                    service: Kind::Postgres.name(),
                    pid: server.pid,
                    reason: format!(
                        "state {:?} 5 s after signal {signal}",
                        process_state(server.pid)
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Starts node `index` again on its port as a primary: any `standby.signal` removed, so
    /// it comes up writable on the timeline it had.
    pub fn restart_writable(&mut self, index: usize, sync: SyncStandbys) -> Result<(), StackError> {
        self.stop(index)?;
        let data = self.nodes[index].data();
        let _ = fs::remove_file(data.join("standby.signal"));
        if sync == SyncStandbys::Cleared {
            append(&data.join("postgresql.auto.conf"), "synchronous_standby_names = ''\n")?;
        }
        self.restart(index)
    }

    /// Starts node `index` again on its port as it was (after [`PgStandbys::kill`]): a
    /// standby comes back a standby, a primary comes back writable after crash recovery.
    pub fn restart(&mut self, index: usize) -> Result<(), StackError> {
        self.stop(index)?;
        let port = self.nodes[index].port;
        let deadline = Instant::now() + Duration::from_secs(10);
        let server = loop {
            match Server::start(Kind::Postgres, &self.nodes[index].dir, Some(port)) {
                Ok(server) => break server,
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        self.nodes[index].server = Some(server);
        Ok(())
    }

    /// Node `index` (an old primary, stopped or not) rebuilt as a standby of `primary`: its
    /// data replaced by a `pg_basebackup` of the new primary, started on its port, streaming.
    /// What a failover manager does with a fenced old primary (`tuning/postgresql-ha.md`).
    pub fn rejoin(&mut self, index: usize, primary: usize) -> Result<(), StackError> {
        self.stop(index)?;
        let data = self.nodes[index].data();
        fs::remove_dir_all(&data).map_err(io_err(format!("remove {}", data.display())))?;
        self.base_backup(index, primary)?;
        self.restart(index)?;
        self.wait_streaming(primary, &[index])
    }

    /// Stops every node (frozen ones are thawed first).
    pub fn stop_all(&mut self) {
        for index in 0..self.nodes.len() {
            let _ = self.stop(index);
        }
    }
}

/// Stops the nodes recorded under `dir` (only our `postgres` on the recorded port, thawed
/// first); returns the names of those stopped.
pub fn down(dir: &Path) -> Result<Vec<&'static str>, StackError> {
    let mut stopped = Vec::new();
    for name in NODE_NAMES {
        let node_dir = dir.join(name);
        let read = |file: &str| fs::read_to_string(node_dir.join(file)).ok();
        let pid = read("pid").and_then(|p| p.trim().parse::<u32>().ok());
        let port = read("port").and_then(|p| p.trim().parse::<u16>().ok());
        if let (Some(pid), Some(port)) = (pid, port) {
            if process_matches(pid, Kind::Postgres, port) {
                signal_process(pid, libc::SIGCONT);
                children_of(pid).into_iter().for_each(|c| signal_process(c, libc::SIGCONT));
                Server { kind: Kind::Postgres, port, pid, dir: node_dir }.stop()?;
                stopped.push(name);
            }
        }
    }
    Ok(stopped)
}

fn append(path: &Path, text: &str) -> Result<(), StackError> {
    let mut file = fs::OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(io_err(format!("open {}", path.display())))?;
    file.write_all(text.as_bytes()).map_err(io_err(format!("append to {}", path.display())))
}

/// Live children of `pid` (PostgreSQL's backends and auxiliary processes), from `/proc`.
fn not_running(node: &PgNode) -> StackError {
    StackError::Refused {
        service: Kind::Postgres.name(),
        pid: 0,
        reason: format!("node {} is not running (killed or stopped before)", node.name),
    }
}

fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| {
            // Field 4 of /proc/PID/stat, after the parenthesised command name.
            let ppid = fs::read_to_string(format!("/proc/{child}/stat")).ok().and_then(|stat| {
                stat.rsplit(')').next()?.split_whitespace().nth(1)?.parse::<u32>().ok()
            });
            ppid == Some(pid) && process_alive(child)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_list_the_hosts_in_the_order_asked() {
        let set = PgStandbys {
            dir: PathBuf::from("/x"),
            nodes: NODE_NAMES
                .iter()
                .zip([5000, 5001, 5002])
                .map(|(name, port)| PgNode { name, port, dir: PathBuf::from("/x"), server: None })
                .collect(),
        };
        assert_eq!(
            set.url("db"),
            "postgres://postgres@127.0.0.1:5000,127.0.0.1:5001,127.0.0.1:5002/db\
             ?target_session_attrs=read-write"
        );
        assert!(set.url_ordered(&[1, 0], "db").starts_with("postgres://postgres@127.0.0.1:5001,"));
        assert_eq!(
            set.conninfo(2, 1),
            "host=127.0.0.1 port=5001 user=postgres application_name=s2"
        );
    }
}
