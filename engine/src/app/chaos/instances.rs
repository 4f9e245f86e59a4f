//! The soak's engine instances: `flashsale serve` (each with its worker) in child processes
//! on the stack's stores, on ports chosen here so that a restart takes the same ones (the
//! balancer's backend list does not change), so the nemesis can kill -9, freeze and restart
//! each one like any other node. Their logs go to `DIR/engine-N.log`.
//!
//! What it is not: the balancer (`stack::balancer`), or the configuration of the engine
//! (the command line and environment below are what an operator would pass).

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::app::stack;

/// Starts of a restarted instance before the nemesis reports it failed.
const RESTARTS_MAX: u32 = 10;

/// How long an instance gets to answer `/readyz` after a start.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// What every instance is started with.
pub struct InstanceSpec<'a> {
    pub engine: &'a Path,
    pub dir: &'a Path,
    pub redis_url: &'a str,
    pub nats_url: &'a str,
    pub pg_url: &'a str,
    pub payment_key_hex: &'a str,
    pub control_key_hex: &'a str,
    /// Test only: a negative control's failpoint (`FLASHSALE_TEST_FAILPOINT`).
    pub failpoint: Option<&'a str>,
}

pub struct Instance {
    command: Command,
    child: Child,
    pub http: SocketAddr,
    pub admin: SocketAddr,
}

impl Instance {
    pub fn start(spec: &InstanceSpec<'_>, index: usize) -> anyhow::Result<Instance> {
        let http = SocketAddr::from(([127, 0, 0, 1], stack::free_port()?));
        let admin = SocketAddr::from(([127, 0, 0, 1], stack::free_port()?));
        let log_path = spec.dir.join(format!("engine-{index}.log"));
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("create {}", log_path.display()))?;
        let mut command = Command::new(spec.engine);
        command
            .args(["serve", "--no-pin", "--insecure-dev-auth", "--grace-s", "1", "--shards", "1"])
            .args(["--http-addr", &http.to_string(), "--admin-addr", &admin.to_string()])
            .args(["--redis-url", spec.redis_url, "--nats-url", spec.nats_url])
            .args(["--pg-url", spec.pg_url, "--stack-dir"])
            .arg(spec.dir)
            .env("FLASHSALE_LOG_REPLICAS", "3")
            .env("FLASHSALE_PAYMENT_KEY", spec.payment_key_hex)
            .env("FLASHSALE_CONTROL_KEY", spec.control_key_hex)
            .env("FLASHSALE_INSTANCE_ID", format!("chaos{index}"))
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(failpoint) = spec.failpoint {
            command.env("FLASHSALE_TEST_FAILPOINT", failpoint);
        }
        let child = command.spawn().context("start an engine instance")?;
        let mut instance = Instance { command, child, http, admin };
        instance.wait_ready()?;
        Ok(instance)
    }

    pub fn wait_ready(&mut self) -> anyhow::Result<Duration> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!("engine instance on {} exited at start ({status})", self.http);
            }
            let ready = super::http::request(
                self.admin,
                ("GET", "/readyz"),
                None,
                None,
                Duration::from_secs(1),
            );
            if ready.is_ok_and(|r| r.status == 200) {
                return Ok(started.elapsed());
            }
            anyhow::ensure!(started.elapsed() < READY_TIMEOUT, "{} not ready", self.http);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// kill -9 (a frozen one dies too) and the wait for its exit.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().context("kill -9 of an engine instance")?;
        self.child.wait()?;
        Ok(())
    }

    /// Started again on the same ports, as a supervisor would: an instance that exits at
    /// start (its dependencies may be mid-fault: `serve` refuses to start without the log)
    /// is started again, up to [`RESTARTS_MAX`] times; waits until ready.
    pub fn restart(&mut self) -> anyhow::Result<Duration> {
        if let Ok(None) = self.child.try_wait() {
            self.kill()?;
        }
        let started = Instant::now();
        let mut last = None;
        for _ in 0..RESTARTS_MAX {
            self.child = self.command.spawn().context("restart an engine instance")?;
            match self.wait_ready() {
                Ok(_) => return Ok(started.elapsed()),
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no restart attempted")))
    }

    pub fn signal(&self, signal: i32) {
        stack::signal_process(self.child.id(), signal);
    }
}

/// A run that fails part-way must not leave an instance running (or frozen).
impl Drop for Instance {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal(libc::SIGCONT);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
