//! One server of a stack ([`Server`]): started on a free loopback port (retried on a fresh
//! one when the port raced away), found again from its recorded pid and port, probed until it
//! answers its protocol, stopped or killed. Every starter (the single servers, the Redis
//! Cluster, the NATS cluster, the PostgreSQL standbys) spawns through
//! [`spawn_command_and_wait`].
//!
//! Not here: a whole stack (`standalone.rs`, `topology.rs`), the `/proc` reading behind the
//! pid checks (`process.rs`), the PostgreSQL data directory (`pg_init.rs`).

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::error::{io_err, StackError};
use super::kind::{find_binary, Kind};
use super::pg_init::{as_postgres_user, init_postgres};
use super::process::{check_process, process_alive, process_matches, reap, signal_process};

/// Time a freshly started server gets to answer before `up` gives up. PostgreSQL recovery
/// after a kill -9 of a large cluster is the slow case.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Time a server gets to exit after SIGTERM/SIGINT before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// How often a server that failed to bind (port raced away) is retried on a new port.
const START_ATTEMPTS_MAX: u32 = 3;

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
pub(super) fn spawn_and_wait_with(
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
pub(super) fn spawn_command_and_wait(
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

/// Asks `problem` every 50 ms until it has none; after `timeout`, the last problem it had.
pub(super) fn poll_until_clear(
    timeout: Duration,
    mut problem: impl FnMut() -> Option<String>,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        match problem() {
            None => return Ok(()),
            Some(last) if Instant::now() > deadline => return Err(last),
            Some(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

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

/// The log's last 5 lines, after the server's own first FATAL or PANIC when that is earlier
/// (the cause: e.g. a recovery that ended before its target, which the lines of the shutdown
/// that follows, and the answers to clients polling meanwhile, push out of the tail).
fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let tail = &all[all.len().saturating_sub(5)..];
    // "the database system is starting up / in recovery mode / shutting down": answers to
    // clients, not the server's own failure.
    let cause = all[..all.len() - tail.len()].iter().find(|line| {
        (line.contains("FATAL:") || line.contains("PANIC:"))
            && !line.contains("the database system is")
    });
    cause.into_iter().chain(tail).copied().collect::<Vec<_>>().join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recovery that stopped short: its FATAL is early, the shutdown's lines and the answers
    /// to polling clients come after it; the tail keeps the cause.
    #[test]
    fn the_log_tail_keeps_the_servers_first_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.log");
        let lines = [
            "LOG:  starting PostgreSQL",
            "FATAL:  the database system is starting up",
            "FATAL:  recovery ended before configured recovery target was reached",
            "LOG:  startup process (PID 9) exited with exit code 1",
            "LOG:  terminating any other active server processes",
            "FATAL:  the database system is in recovery mode",
            "LOG:  shutting down due to startup process failure",
            "LOG:  database system is shut down",
        ];
        fs::write(&path, lines.join("\n")).unwrap();
        let tail = log_tail(&path);
        assert!(tail.starts_with("FATAL:  recovery ended before"), "{tail}");
        assert!(tail.ends_with("database system is shut down"), "{tail}");
        assert_eq!(tail.matches(" | ").count(), 5, "the cause and the last five lines: {tail}");
        fs::write(&path, lines[3..].join("\n")).unwrap();
        assert!(log_tail(&path).starts_with("LOG:  startup process"), "no cause: the tail only");
    }
}
