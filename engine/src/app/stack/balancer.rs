//! An L4 balancer in front of engine instances (DESIGN.md section 11): HAProxy in TCP mode,
//! as operators run one in front of a fleet. The demo's `instance` fault puts two instances
//! behind it; the tests use it for the same, and for the PROXY protocol (`send-proxy-v2`).
//!
//! It is a child of the process that starts it (`-db`: foreground), configured under `dir`
//! (`haproxy.cfg`, `haproxy.log`), and killed when dropped.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::error::{io_err, StackError};

/// How long HAProxy gets to listen.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);

pub struct Balancer {
    child: Child,
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl Balancer {
    /// One backend with HAProxy `server` options of the caller's (e.g. `send-proxy-v2`).
    pub fn single(dir: &Path, backend: SocketAddr, options: &str) -> Result<Balancer, StackError> {
        Balancer::start(dir, &format!("    server engine {backend} {options}\n"))
    }

    /// Connections balanced round robin over `backends`. A backend that stops accepting is
    /// taken out by the health check (a TCP connect every 500 ms, out after 2 failures, back
    /// after 2 successes), and a connect it refuses meanwhile is sent to another backend
    /// (`option redispatch`), as a production L4 balancer is set up.
    pub fn round_robin(dir: &Path, backends: &[SocketAddr]) -> Result<Balancer, StackError> {
        let servers: String = backends
            .iter()
            .enumerate()
            .map(|(i, addr)| format!("    server engine{i} {addr} check inter 500 fall 2 rise 2\n"))
            .collect();
        let lines =
            format!("    balance roundrobin\n    option redispatch\n    retries 2\n{servers}");
        Balancer::start(dir, &lines)
    }

    fn start(dir: &Path, backend_lines: &str) -> Result<Balancer, StackError> {
        let binary = haproxy_binary()?;
        std::fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        // A port that was free a moment ago; if it was taken since, HAProxy exits and the
        // wait below reports it with HAProxy's own words.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(io_err("pick a port for haproxy"))?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let config = format!(
            "global\n    maxconn 4096\n\
             defaults\n    mode tcp\n    timeout connect 2s\n    timeout client 30s\n    timeout server 30s\n\
             frontend edge\n    bind {addr}\n    default_backend engine\n\
             backend engine\n{backend_lines}"
        );
        let config_path = dir.join("haproxy.cfg");
        std::fs::write(&config_path, config).map_err(io_err("write haproxy.cfg"))?;
        let log_path = dir.join("haproxy.log");
        let log = std::fs::File::create(&log_path).map_err(io_err("create haproxy.log"))?;
        let child = Command::new(binary)
            .arg("-db")
            .arg("-f")
            .arg(&config_path)
            .stdout(log.try_clone().map_err(io_err("haproxy.log"))?)
            .stderr(log)
            .spawn()
            .map_err(io_err("start haproxy"))?;
        let mut balancer = Balancer { child, addr, dir: dir.to_path_buf() };
        let deadline = Instant::now() + LISTEN_TIMEOUT;
        while TcpStream::connect(addr).is_err() {
            let exited = balancer.child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                return Err(StackError::Service {
                    service: "haproxy",
                    message: format!("not listening on {addr} ({exited:?}): {}", balancer.log()),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(balancer)
    }

    /// What HAProxy wrote to stdout and stderr.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("haproxy.log")).unwrap_or_default()
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn haproxy_binary() -> Result<PathBuf, StackError> {
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    dirs.extend(["/usr/sbin", "/usr/bin"].map(PathBuf::from));
    dirs.iter().map(|d| d.join("haproxy")).find(|p| p.is_file()).ok_or_else(|| {
        StackError::MissingBinary {
            binary: "haproxy",
            package: "haproxy",
            searched: "PATH, /usr/sbin, /usr/bin".into(),
        }
    })
}
