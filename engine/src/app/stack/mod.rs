//! `flashsale stack up | down`: private redis-server, PostgreSQL and nats-server on loopback.
//!
//! Each server runs on a free 127.0.0.1 port with its data under one directory
//! (`DIR/redis`, `DIR/pg`, `DIR/nats`). `up` is idempotent: a server whose recorded pid is
//! alive, is the binary we started, and answers on its recorded port is reused. `down` stops
//! only processes whose pid file we wrote AND whose `/proc/PID/cmdline` still names our binary
//! and port, so a recycled pid or a server someone else runs is never touched.
//!
//! The integration tests start their servers through the same [`Server`] code (one private
//! instance per test for Redis and NATS, one private PostgreSQL cluster per suite), so test
//! and demo behave alike.
//!
//! Multi-node starters live beside this file and reuse its helpers: `nats_cluster` (three
//! JetStream nodes) and `pg_standbys` (a PostgreSQL primary with two streaming standbys);
//! `balancer` puts HAProxy (TCP mode) in front of several engine instances.
//!
//! Not here: configuration of the engine (see `config`), migrations (`flashsale_pg_worker`).

pub mod balancer;
pub mod nats_cluster;
pub mod pg_standbys;
mod redis_cluster;
mod topology;

pub use redis_cluster::{call as redis_call, ClusterNode, RedisCluster, MASTER_COUNT, NODE_COUNT};
pub use topology::{running_servers, up_with, Topology};

use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Time a freshly started server gets to answer before `up` gives up. PostgreSQL recovery
/// after a kill -9 of a large cluster is the slow case.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Time a server gets to exit after SIGTERM/SIGINT before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// How often a server that failed to bind (port raced away) is retried on a new port.
const START_ATTEMPTS_MAX: u32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error(
        "`{binary}` not found (looked in PATH and {searched}); install the Debian package: \
         apt-get install -y {package}"
    )]
    MissingBinary { binary: &'static str, package: &'static str, searched: String },
    #[error("{service}: {message}")]
    Service { service: &'static str, message: String },
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    /// A signal was not sent (or did not take): the recorded process is gone, or is not the
    /// server we started, or did not reach the state the signal asks for.
    #[error("{service}: refused to signal pid {pid}: {reason}")]
    Refused { service: &'static str, pid: u32, reason: String },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> StackError {
    let context = context.into();
    move |source| StackError::Io { context, source }
}

/// The three servers of a stack. A closed set: placement of data and the readiness probe
/// are decided per variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Redis,
    Postgres,
    Nats,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Redis, Kind::Postgres, Kind::Nats];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Redis => "redis",
            Kind::Postgres => "postgres",
            Kind::Nats => "nats",
        }
    }

    fn binary(self) -> &'static str {
        match self {
            Kind::Redis => "redis-server",
            Kind::Postgres => "postgres",
            Kind::Nats => "nats-server",
        }
    }

    fn package(self) -> &'static str {
        match self {
            Kind::Redis => "redis-server",
            Kind::Postgres => "postgresql",
            Kind::Nats => "nats-server",
        }
    }

    /// The URL clients use, as written to `DIR/env`.
    pub fn url(self, port: u16) -> String {
        match self {
            Kind::Redis => format!("redis://127.0.0.1:{port}"),
            Kind::Postgres => format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            Kind::Nats => format!("nats://127.0.0.1:{port}"),
        }
    }

    fn env_name(self) -> &'static str {
        match self {
            Kind::Redis => "FLASHSALE_REDIS_URL",
            Kind::Postgres => "FLASHSALE_PG_URL",
            Kind::Nats => "FLASHSALE_NATS_URL",
        }
    }
}

/// Where Debian puts PostgreSQL's server binaries (they are not on PATH).
const PG_BIN_DIRS: [&str; 4] = [
    "/usr/lib/postgresql/17/bin",
    "/usr/lib/postgresql/16/bin",
    "/usr/lib/postgresql/15/bin",
    "/usr/lib/postgresql/14/bin",
];

fn find_binary(kind: Kind, name: &'static str) -> Result<PathBuf, StackError> {
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    dirs.extend(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from));
    if kind == Kind::Postgres {
        dirs.extend(PG_BIN_DIRS.map(PathBuf::from));
    }
    for dir in &dirs {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(StackError::MissingBinary {
        binary: name,
        package: kind.package(),
        searched: "/usr/sbin, /usr/lib/postgresql/*/bin".to_string(),
    })
}

/// A free port on 127.0.0.1 at the time of asking. Another process can take it before the
/// server binds, so starting is retried on a fresh port (`START_ATTEMPTS_MAX`).
pub fn free_port() -> Result<u16, StackError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io_err("bind 127.0.0.1:0"))?;
    let port = listener.local_addr().map_err(io_err("local_addr"))?.port();
    Ok(port)
}

/// One running server that this code started (or found running from an earlier `up`).
#[derive(Debug)]
pub struct Server {
    pub kind: Kind,
    pub port: u16,
    pub pid: u32,
    /// `DIR/<kind>`: data, logs, pid and port files.
    pub dir: PathBuf,
}

impl Server {
    pub fn url(&self) -> String {
        self.kind.url(self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Starts a server of `kind` with its data under `dir` (created if missing). `port` = None
    /// picks a free port.
    pub fn start(kind: Kind, dir: &Path, port: Option<u16>) -> Result<Server, StackError> {
        fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        let dir = dir.canonicalize().map_err(io_err(format!("canonicalize {}", dir.display())))?;
        if kind == Kind::Postgres {
            init_postgres(&dir)?;
        }
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS_MAX {
            let chosen = match port {
                Some(port) => port,
                None => free_port()?,
            };
            match spawn_and_wait(kind, &dir, chosen) {
                Ok(server) => return Ok(server),
                // A fixed port is not retried elsewhere: the caller asked for that one.
                Err(e) if port.is_some() => return Err(e),
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error.unwrap_or_else(|| StackError::Service {
            service: kind.name(),
            message: "could not start".into(),
        }))
    }

    /// The server recorded under `dir`, if its pid is alive, is our binary on the recorded
    /// port, and answers (waiting up to `READY_TIMEOUT` for one that is still starting).
    pub fn find_running(kind: Kind, dir: &Path) -> Option<Server> {
        let recorded = || -> Option<(u32, u16)> {
            let pid = fs::read_to_string(dir.join("pid")).ok()?.trim().parse().ok()?;
            let port = fs::read_to_string(dir.join("port")).ok()?.trim().parse().ok()?;
            Some((pid, port))
        };
        let (pid, port) = recorded()
            .filter(|(pid, port)| process_matches(*pid, kind, *port))
            .or_else(|| if kind == Kind::Postgres { postmaster_of(dir) } else { None })?;
        let server = Server { kind, port, pid, dir: dir.to_path_buf() };
        // Alive but not answering yet (PostgreSQL in crash recovery after a kill -9, or a
        // server another caller just started): wait for it rather than start a second one
        // on the same data directory.
        let deadline = Instant::now() + READY_TIMEOUT;
        while probe(kind, server.addr()).is_err() {
            if !process_alive(pid) || Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Re-record what we found, so `down` can stop it.
        fs::write(dir.join("pid"), pid.to_string()).ok()?;
        fs::write(dir.join("port"), port.to_string()).ok()?;
        Some(server)
    }

    /// Stops the server (fast shutdown for PostgreSQL) and waits for it to exit, escalating
    /// to SIGKILL after `STOP_TIMEOUT`. Removes the pid file.
    pub fn stop(&self) -> Result<(), StackError> {
        if process_matches(self.pid, self.kind, self.port) {
            // PostgreSQL: SIGINT is "fast shutdown" (abort transactions, checkpoint, exit).
            let signal = if self.kind == Kind::Postgres { libc::SIGINT } else { libc::SIGTERM };
            signal_process(self.pid, signal);
            let deadline = Instant::now() + STOP_TIMEOUT;
            while process_alive(self.pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if process_alive(self.pid) {
                signal_process(self.pid, libc::SIGKILL);
                while process_alive(self.pid) {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            reap(self.pid);
        }
        let _ = fs::remove_file(self.dir.join("pid"));
        Ok(())
    }

    /// Whether the recorded pid is still this server (alive, our binary, our port): the
    /// check every signal of ours passes first, with the reason when it does not.
    pub fn check(&self) -> Result<(), StackError> {
        check_process(self.pid, self.kind, self.port).map_err(|reason| StackError::Refused {
            service: self.kind.name(),
            pid: self.pid,
            reason,
        })
    }

    /// kill -9, for drills: no shutdown, pid file kept so the next start reuses the port.
    /// `Err(Refused)` when the pid is not this server (nothing is signalled) or it is still
    /// alive `STOP_TIMEOUT` after SIGKILL; `Ok` means the process is gone.
    pub fn kill(&self) -> Result<(), StackError> {
        self.check()?;
        signal_process(self.pid, libc::SIGKILL);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while process_alive(self.pid) {
            if Instant::now() > deadline {
                return Err(StackError::Refused {
                    service: self.kind.name(),
                    pid: self.pid,
                    reason: format!("still alive {STOP_TIMEOUT:?} after SIGKILL"),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // A zombie still "exists" for kill(pid, 0): PostgreSQL would refuse to start on
        // its data directory ("another postmaster running") until it is reaped.
        reap(self.pid);
        Ok(())
    }
}

/// The postmaster that PostgreSQL itself records in `data/postmaster.pid` (line 1 pid, line 4
/// port), when it is alive and ours. Covers a cluster whose pid/port files were lost or
/// overwritten (a crash between spawn and recording): adopting it beats failing on
/// "lock file postmaster.pid already exists".
fn postmaster_of(dir: &Path) -> Option<(u32, u16)> {
    let text = fs::read_to_string(dir.join("data").join("postmaster.pid")).ok()?;
    let mut lines = text.lines();
    let pid: u32 = lines.next()?.trim().parse().ok()?;
    let port: u16 = lines.nth(2)?.trim().parse().ok()?;
    process_matches(pid, Kind::Postgres, port).then_some((pid, port))
}

fn spawn_and_wait(kind: Kind, dir: &Path, port: u16) -> Result<Server, StackError> {
    spawn_command_and_wait(kind, dir, port, server_command(kind, dir, port)?)
}

/// [`spawn_and_wait`] with arguments appended to the server's command line (a Redis Cluster
/// node's `--cluster-enabled yes ...`; see `redis_cluster`).
fn spawn_and_wait_with(
    kind: Kind,
    dir: &Path,
    port: u16,
    extra_args: &[&str],
) -> Result<Server, StackError> {
    let mut command = server_command(kind, dir, port)?;
    command.args(extra_args);
    spawn_command_and_wait(kind, dir, port, command)
}

/// Spawns `command` (a server of `kind` that will listen on `port`) with its output in
/// `dir/server.log`, waits until it answers its protocol, and records its pid and port in
/// `dir`. The multi-node starters (`nats_cluster`, `pg_standbys`, `redis_cluster`) pass
/// commands of their own.
fn spawn_command_and_wait(
    kind: Kind,
    dir: &Path,
    port: u16,
    mut command: Command,
) -> Result<Server, StackError> {
    let log_path = dir.join("server.log");
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(io_err(format!("open {}", log_path.display())))?;
    let log_err = log.try_clone().map_err(io_err("clone log handle"))?;
    command
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err))
        // Its own process group: a Ctrl-C aimed at the caller's terminal must not take the
        // servers down with it; `down` stops them.
        .process_group(0);
    let mut child = command.spawn().map_err(io_err(format!("spawn {}", kind.binary())))?;
    let pid = child.id();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(StackError::Service {
                service: kind.name(),
                message: format!(
                    "exited with {status} before answering on {addr}; see {}: {}",
                    log_path.display(),
                    log_tail(&log_path)
                ),
            });
        }
        if probe(kind, addr).is_ok() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err(StackError::Service {
                service: kind.name(),
                message: format!("no answer on {addr} within {READY_TIMEOUT:?}"),
            });
        }
        std::thread::sleep(Duration::from_millis(15));
    }
    fs::write(dir.join("pid"), pid.to_string()).map_err(io_err("write pid"))?;
    fs::write(dir.join("port"), port.to_string()).map_err(io_err("write port"))?;
    // The child handle is dropped without waiting: the server outlives this process by design
    // and is reaped by init when we exit. Tests that own servers stop them explicitly.
    drop(child);
    Ok(Server { kind, port, pid, dir: dir.to_path_buf() })
}

fn server_command(kind: Kind, dir: &Path, port: u16) -> Result<Command, StackError> {
    let port_s = port.to_string();
    let command = match kind {
        Kind::Redis => {
            let mut c = Command::new(find_binary(kind, "redis-server")?);
            // Redis is not the source of truth (DESIGN.md section 2): no persistence, so a
            // private instance starts in milliseconds and leaves nothing behind.
            c.args(["--bind", "127.0.0.1", "--port", &port_s, "--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir)
                .args(["--daemonize", "no", "--protected-mode", "yes"]);
            c
        }
        Kind::Nats => {
            let mut c = Command::new(find_binary(kind, "nats-server")?);
            c.arg("-c").arg(jetstream_limits(dir)?);
            c.args(["-a", "127.0.0.1", "-p", &port_s, "-js", "-sd"]).arg(dir.join("store"));
            c
        }
        Kind::Postgres => {
            let mut c = Command::new(find_binary(kind, "postgres")?);
            c.arg("-D")
                .arg(dir.join("data"))
                .args(["-p", &port_s, "-c", "listen_addresses=127.0.0.1"])
                .args(["-c", "unix_socket_directories="])
                // fsync stays on: the order pipeline's benchmarks and drills are about
                // durable commits.
                .args(["-c", "fsync=on", "-c", "max_connections=200"]);
            as_postgres_user(&mut c)?;
            c
        }
    };
    Ok(command)
}

/// `initdb` once per data directory (trust auth on loopback only, user `postgres`).
/// JetStream's storage limits for a private nats-server, written as `dir/jetstream.conf`
/// (the command-line flags add the address, port and store directory). Left unset, a server
/// takes 75% of the disk's free space at start as its limit, and a stream's `max_bytes` is
/// reserved against it (the orders stream's 1 GiB per replica): on a busy disk stream
/// creation then fails with "insufficient storage resources". A fixed limit makes a private
/// stack behave the same whatever the disk holds at that moment; the store only grows with
/// what is written.
pub(super) fn jetstream_limits(dir: &Path) -> Result<PathBuf, StackError> {
    let path = dir.join("jetstream.conf");
    let text = "jetstream {\n  max_file_store: 16GB\n  max_memory_store: 256MB\n}\n";
    fs::write(&path, text).map_err(io_err(format!("write {}", path.display())))?;
    Ok(path)
}

fn init_postgres(dir: &Path) -> Result<(), StackError> {
    let data = dir.join("data");
    if data.join("PG_VERSION").is_file() {
        return Ok(());
    }
    if let Some(owner) = postgres_owner()? {
        ensure_traversable(dir, owner)?;
        chown_tree(dir, owner)?;
    }
    let mut command = Command::new(find_binary(Kind::Postgres, "initdb")?);
    command.arg("-D").arg(&data).args([
        "-U",
        "postgres",
        "--auth=trust",
        "--encoding=UTF8",
        "--no-locale",
        "--no-sync",
    ]);
    as_postgres_user(&mut command)?;
    let output = command.output().map_err(io_err("run initdb"))?;
    if !output.status.success() {
        return Err(StackError::Service {
            service: "postgres",
            message: format!(
                "initdb failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        });
    }
    Ok(())
}

/// PostgreSQL refuses to run as root. When we are root, the cluster runs as the `postgres`
/// system user (created by the Debian package), which must own the data directory.
#[derive(Debug, Clone, Copy)]
struct Owner {
    uid: u32,
    gid: u32,
}

fn postgres_owner() -> Result<Option<Owner>, StackError> {
    if current_euid() != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd").map_err(io_err("read /etc/passwd"))?;
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() >= 4 && fields[0] == "postgres" {
            let uid = fields[2].parse().ok();
            let gid = fields[3].parse().ok();
            if let (Some(uid), Some(gid)) = (uid, gid) {
                return Ok(Some(Owner { uid, gid }));
            }
        }
    }
    Err(StackError::Service {
        service: "postgres",
        message: "running as root but there is no `postgres` user to run the server as; \
                  apt-get install -y postgresql creates it"
            .into(),
    })
}

fn as_postgres_user(command: &mut Command) -> Result<(), StackError> {
    if let Some(owner) = postgres_owner()? {
        command.uid(owner.uid).gid(owner.gid);
        // The inherited HOME (/root) is unreadable for postgres; psql-style tools look there.
        command.env("HOME", "/var/lib/postgresql");
    }
    Ok(())
}

fn chown_tree(dir: &Path, owner: Owner) -> Result<(), StackError> {
    std::os::unix::fs::chown(dir, Some(owner.uid), Some(owner.gid))
        .map_err(io_err(format!("chown {}", dir.display())))?;
    for entry in fs::read_dir(dir).map_err(io_err(format!("read {}", dir.display())))? {
        let entry = entry.map_err(io_err("read_dir entry"))?;
        let path = entry.path();
        if entry.file_type().map_err(io_err("file_type"))?.is_dir() {
            chown_tree(&path, owner)?;
        } else {
            std::os::unix::fs::chown(&path, Some(owner.uid), Some(owner.gid))
                .map_err(io_err(format!("chown {}", path.display())))?;
        }
    }
    Ok(())
}

/// The postgres user must be able to walk down to its data directory. A checkout under a
/// private home (mode 0700) cannot host the cluster; say so instead of failing obscurely.
fn ensure_traversable(dir: &Path, owner: Owner) -> Result<(), StackError> {
    let mut current = dir.parent();
    while let Some(path) = current {
        let meta = fs::metadata(path).map_err(io_err(format!("stat {}", path.display())))?;
        let mode = meta.permissions().mode();
        let others_x = mode & 0o001 != 0;
        let owner_x = std::os::unix::fs::MetadataExt::uid(&meta) == owner.uid && mode & 0o100 != 0;
        if !others_x && !owner_x {
            return Err(StackError::Service {
                service: "postgres",
                message: format!(
                    "the `postgres` user cannot traverse {} (mode {:o}); use --dir on a \
                     world-traversable path such as /var/tmp/flashsale, or chmod o+x {}",
                    path.display(),
                    mode & 0o777,
                    path.display()
                ),
            });
        }
        current = path.parent();
    }
    Ok(())
}

/// Readiness probe: the server answers its protocol, not just accepts TCP.
fn probe(kind: Kind, addr: SocketAddr) -> Result<(), std::io::Error> {
    let timeout = Duration::from_millis(500);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    match kind {
        Kind::Redis => {
            stream.write_all(b"PING\r\n")?;
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line)?;
            if line.starts_with("+PONG") {
                Ok(())
            } else {
                Err(bad(&line))
            }
        }
        Kind::Nats => {
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line)?;
            // JetStream must be on (`-js`), or the log streams cannot be created.
            if line.starts_with("INFO ") && line.contains("\"jetstream\":true") {
                Ok(())
            } else {
                Err(bad("nats INFO without jetstream"))
            }
        }
        Kind::Postgres => {
            // A StartupMessage for user postgres / database postgres; trust auth answers
            // AuthenticationOk ('R', 0) once the server accepts connections. While starting
            // up it answers an ErrorResponse ('E') instead.
            let mut msg = Vec::with_capacity(64);
            msg.extend_from_slice(&0u32.to_be_bytes());
            msg.extend_from_slice(&196_608u32.to_be_bytes()); // protocol 3.0
            for s in ["user", "postgres", "database", "postgres"] {
                msg.extend_from_slice(s.as_bytes());
                msg.push(0);
            }
            msg.push(0);
            let len = msg.len() as u32;
            msg[0..4].copy_from_slice(&len.to_be_bytes());
            stream.write_all(&msg)?;
            let mut head = [0u8; 9];
            stream.read_exact(&mut head)?;
            if head[0] == b'R' && head[5..9] == [0, 0, 0, 0] {
                // Terminate politely.
                let _ = stream.write_all(&[b'X', 0, 0, 0, 4]);
                Ok(())
            } else {
                Err(bad("postgres not ready"))
            }
        }
    }
}

fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

// ---- processes ----------------------------------------------------------------------------

/// The state letter of `/proc/PID/stat` (`R`, `S`, `D`, `T` stopped, `Z` zombie, ...), or
/// `None` when there is no such process.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is parenthesised and may itself hold ") ": the state follows the last.
    stat.rsplit(')').next()?.trim_start().chars().next()
}

fn process_alive(pid: u32) -> bool {
    // A zombie (exited, not yet reaped by its parent — us, in tests) counts as gone.
    process_state(pid).is_some_and(|state| state != 'Z')
}

/// True when `pid` is alive and its command line is our server binary on `port`: never
/// signal a process that merely reuses a recorded pid.
fn process_matches(pid: u32, kind: Kind, port: u16) -> bool {
    check_process(pid, kind, port).is_ok()
}

/// [`process_matches`] with the reason when it does not.
fn check_process(pid: u32, kind: Kind, port: u16) -> Result<(), String> {
    if !process_alive(pid) {
        return Err("no such process (exited or never started)".into());
    }
    let raw = fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| format!("cannot read /proc/{pid}/cmdline: {e}"))?;
    let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
    if cmdline.contains(kind.binary()) && cmdline.contains(&port.to_string()) {
        Ok(())
    } else {
        Err(format!(
            "its command line `{}` is not {} on port {port} (a recycled pid?)",
            cmdline.trim(),
            kind.binary()
        ))
    }
}

#[allow(unsafe_code)]
pub(crate) fn signal_process(pid: u32, signal: i32) {
    let Ok(pid) = i32::try_from(pid) else { return };
    // SAFETY: kill(2) has no memory-safety preconditions; pid was checked against
    // /proc/PID/cmdline by the caller, and a stale pid only yields ESRCH.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Collects `pid`'s exit status if it is our child (a server spawned by this process);
/// otherwise a no-op (ECHILD).
#[allow(unsafe_code)]
fn reap(pid: u32) {
    let Ok(pid) = i32::try_from(pid) else { return };
    let mut status = 0;
    // SAFETY: waitpid(2) writes only to `status`, a live local; WNOHANG never blocks.
    unsafe {
        libc::waitpid(pid, &mut status, libc::WNOHANG);
    }
}

#[allow(unsafe_code)]
fn current_euid() -> u32 {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

// ---- the stack ----------------------------------------------------------------------------

/// The three URLs of a running stack, as written to `DIR/env`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackEnv {
    pub redis_url: String,
    pub pg_url: String,
    pub nats_url: String,
}

impl StackEnv {
    /// Reads `DIR/env` (`export NAME=value` lines).
    pub fn read(dir: &Path) -> Option<StackEnv> {
        let text = fs::read_to_string(dir.join("env")).ok()?;
        let get = |name: &str| {
            text.lines().find_map(|line| {
                let rest = line.strip_prefix("export ")?.strip_prefix(name)?.strip_prefix('=')?;
                Some(rest.trim().to_string())
            })
        };
        Some(StackEnv {
            redis_url: get("FLASHSALE_REDIS_URL")?,
            pg_url: get("FLASHSALE_PG_URL")?,
            nats_url: get("FLASHSALE_NATS_URL")?,
        })
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        for (kind, url) in [
            (Kind::Redis, &self.redis_url),
            (Kind::Postgres, &self.pg_url),
            (Kind::Nats, &self.nats_url),
        ] {
            let _ = writeln!(out, "export {}={}", kind.env_name(), url);
        }
        out
    }
}

/// Starts (or reuses) every server under `dir` and writes `dir/env`. Serialised by a lock
/// file so that two `up`s racing (e.g. parallel test binaries) share one stack.
pub fn up(dir: &Path) -> Result<StackEnv, StackError> {
    fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    let lock = lock_dir(dir)?;
    let mut urls = Vec::with_capacity(3);
    // Servers this call started, stopped again when a later one fails (a refused PostgreSQL
    // directory must not leave a new redis-server running); running ones are reused as is.
    let mut started_now = Vec::with_capacity(3);
    for kind in Kind::ALL {
        let kind_dir = dir.join(kind.name());
        let running = Server::find_running(kind, &kind_dir).is_some();
        match ensure_locked(kind, &kind_dir) {
            Ok(server) => {
                urls.push(server.url());
                if !running {
                    started_now.push(server);
                }
            }
            Err(e) => {
                for server in started_now {
                    if let Err(refused) = server.kill() {
                        eprintln!("stack up: could not stop {}: {refused}", server.kind.name());
                    }
                }
                return Err(e);
            }
        }
    }
    let env =
        StackEnv { redis_url: urls[0].clone(), pg_url: urls[1].clone(), nats_url: urls[2].clone() };
    fs::write(dir.join("env"), env.render()).map_err(io_err("write env"))?;
    drop(lock);
    Ok(env)
}

/// One server of `kind` under `dir`: the running one, or a new one (on its previous port when
/// that is free, so URLs stay stable across restarts). Serialised by a lock file in `dir`, so
/// that concurrent callers (parallel tests, two processes) start one server and share it.
pub fn ensure(kind: Kind, dir: &Path) -> Result<Server, StackError> {
    let lock = lock_dir(dir)?;
    let server = ensure_locked(kind, dir);
    drop(lock);
    server
}

/// [`ensure`] for a caller that already holds the lock of a directory above `dir`.
fn ensure_locked(kind: Kind, dir: &Path) -> Result<Server, StackError> {
    if let Some(server) = Server::find_running(kind, dir) {
        return Ok(server);
    }
    let previous_port = fs::read_to_string(dir.join("port"))
        .ok()
        .and_then(|p| p.trim().parse::<u16>().ok())
        .filter(|p| TcpListener::bind(("127.0.0.1", *p)).is_ok());
    match previous_port {
        Some(port) => {
            Server::start(kind, dir, Some(port)).or_else(|_| Server::start(kind, dir, None))
        }
        None => Server::start(kind, dir, None),
    }
}

/// Stops every server recorded under `dir`; `purge` also deletes the data.
pub fn down(dir: &Path, purge: bool) -> Result<Vec<&'static str>, StackError> {
    let lock = lock_dir(dir)?;
    let mut stopped = Vec::new();
    for kind in Kind::ALL {
        let sub = dir.join(kind.name());
        let pid = fs::read_to_string(sub.join("pid")).ok().and_then(|p| p.trim().parse().ok());
        let port = fs::read_to_string(sub.join("port")).ok().and_then(|p| p.trim().parse().ok());
        if let (Some(pid), Some(port)) = (pid, port) {
            let server = Server { kind, port, pid, dir: sub };
            if process_matches(pid, kind, port) {
                server.stop()?;
                stopped.push(kind.name());
            }
        }
    }
    // Multi-node topologies (`stack up --topology ...`) keep their servers beside these.
    stopped.extend(topology::down_nodes(dir)?);
    drop(lock);
    if purge {
        fs::remove_dir_all(dir).map_err(io_err(format!("remove {}", dir.display())))?;
    }
    Ok(stopped)
}

fn lock_dir(dir: &Path) -> Result<fs::File, StackError> {
    fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    let path = dir.join(".lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(format!("open {}", path.display())))?;
    file.lock().map_err(io_err(format!("lock {}", path.display())))?;
    Ok(file)
}
