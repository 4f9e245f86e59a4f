//! The PostgreSQL connections of one process: the worker's pool, the edge's pool and the
//! edge's health ping all connect through the [`Connector`] here, so each gets the same
//! failover, fencing, deadlines and session settings (DESIGN.md sections 3 and 11).
//!
//! What it is:
//! - [`PgPoolConfig`]: every knob spelled out; the URL is libpq-style, either form
//!   (`postgres://u@h1:5432,h2:5433/db?target_session_attrs=read-write` or
//!   `host=h1,h2 port=5432,5433 ...`), parsed by tokio-postgres.
//! - [`Connector`]: tries each host in turn, the last good host first, and bounds the WHOLE
//!   attempt on one host by `connect_timeout_ms`: TCP connect, the start-up exchange and the
//!   role check. tokio-postgres' own `connect_timeout` covers only the TCP connect, so a host
//!   that accepts the connection and then says nothing (a SIGSTOPped postmaster, a machine
//!   that died without sending RST) would hold its multi-host connect forever, and the
//!   promoted standby behind it would never be tried. Every socket gets TCP keepalives and
//!   `TCP_USER_TIMEOUT` (tokio-postgres 0.7 sets both through `Config`).
//! - The fencing rule, [`verdict`] (sans-I/O): the connector remembers the highest timeline
//!   it has seen on a writable host and refuses a writable host whose timeline is behind it.
//!   A promoted standby starts a new timeline; an old primary restarted without
//!   `standby.signal` is writable on the old one, and `target_session_attrs=read-write`
//!   alone would pick it when it is listed first (FIELD-NOTES.md). A connector that has seen
//!   no timeline yet first asks every host at once (one deadline in all) and learns the
//!   highest writable timeline, so a fresh process is not fooled either; so does a connector
//!   one of whose connections ended since its last connect (a server that shut down, or one
//!   the caller discarded as unresponsive: a failover may have happened meanwhile — found by
//!   the mid-sale drill in `tests/tests/ha_pg.rs`: an idle pool went back to the old primary
//!   as its last good host once it was writable again, and the worker kept reconnecting to a
//!   frozen-then-resumed old primary whose COMMITs wait forever for the synchronous standby
//!   that had been promoted away). When a connector learns a higher timeline it closes the
//!   connections behind it (the pool then discards them as closed), so a connection opened
//!   before the failover cannot keep writing to the old primary. What is learned is shared by
//!   every multi-host connector of the process on the same hosts (health ping, edge pool,
//!   worker pool), and a caller whose statement outlasted its deadline makes the connector
//!   survey at once ([`Connector::suspect`]). The timeline is read as the first 8 hex digits of
//!   `pg_walfile_name(pg_current_wal_lsn())`: the WAL being written now, on the new
//!   timeline from the moment of promotion (`pg_control_checkpoint().timeline_id` moves only
//!   with the next checkpoint).
//! - [`build_pool`]: a `deadpool-postgres` pool whose connections come from a [`Connector`];
//!   every connection starts with our `statement_timeout` and `lock_timeout` (a stuck lock
//!   surfaces as 55P03, transient) appended to the URL's own `options`.
//!   `transaction_deadline_ms` is the client-side bound the worker puts on each transaction
//!   (`worker/shared.rs`): the server's own timeouts cannot fire on a server that does not run.
//!
//! What it is not: a failover manager. It never promotes or demotes; it only picks the host
//! to talk to and refuses the ones it must not (see `tuning/postgresql-ha.md` for the rest:
//! who promotes, who fences, `synchronous_standby_names`). Nor a health checker: a connection
//! that fails mid-batch is discarded by the caller (`deadpool_postgres::Object::take`).

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::config::{Host, TargetSessionAttrs};
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

use crate::error::PgError;

/// Connection settings for one pool (or one connector).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgPoolConfig {
    /// libpq-style URL or key=value string; several hosts with
    /// `target_session_attrs=read-write`.
    pub url: String,
    /// Most connections this pool opens (this process's share of the connection budget).
    pub pool_size: usize,
    /// Bound on the WHOLE attempt on one host: TCP connect, start-up exchange, role and
    /// timeline check. libpq's `connect_timeout` means the same; 2 s is what libpq needed here
    /// to move past a SIGSTOPped first host.
    pub connect_timeout_ms: u64,
    /// Longest a task waits for a free connection before giving up (transient error).
    pub wait_timeout_ms: u64,
    /// Server-side bound on one statement.
    pub statement_timeout_ms: u64,
    /// Server-side bound on waiting for a lock.
    pub lock_timeout_ms: u64,
    /// Client-side bound on one transaction of the worker (at least `statement_timeout_ms`, so
    /// a live server's own timeout answers first with a clean error).
    pub transaction_deadline_ms: u64,
    /// Idle time before the first TCP keepalive probe, then the interval and count of probes:
    /// an idle connection to a vanished machine is dropped after idle + interval × retries.
    pub keepalives_idle_ms: u64,
    pub keepalives_interval_ms: u64,
    pub keepalives_retries: u32,
    /// `TCP_USER_TIMEOUT`: sent data unacknowledged this long drops the connection (a machine
    /// that vanished mid-transaction). A SIGSTOPped server's kernel still acknowledges, which
    /// is why the transaction deadline exists too.
    pub tcp_user_timeout_ms: u64,
    /// `application_name`, shown in `pg_stat_activity`.
    pub application_name: String,
}

impl Default for PgPoolConfig {
    fn default() -> PgPoolConfig {
        PgPoolConfig {
            url: "postgres://postgres@127.0.0.1:5432/postgres".to_owned(),
            pool_size: 8,
            connect_timeout_ms: 2_000,
            wait_timeout_ms: 5_000,
            statement_timeout_ms: 10_000,
            lock_timeout_ms: 2_000,
            transaction_deadline_ms: 12_000,
            keepalives_idle_ms: 5_000,
            keepalives_interval_ms: 1_000,
            keepalives_retries: 3,
            tcp_user_timeout_ms: 5_000,
            application_name: "flashsale-worker".to_owned(),
        }
    }
}

/// Largest pool one process may ask for; PostgreSQL's `max_connections` is shared by every
/// process, and a worker that needs more should be a second process.
pub const POOL_SIZE_MAX: usize = 256;
/// Most hosts in one URL (a primary and its standbys; each costs a deadline when hung).
pub const HOSTS_MAX: usize = 8;

impl PgPoolConfig {
    pub fn validate(&self) -> Result<(), PgError> {
        if !(1..=POOL_SIZE_MAX).contains(&self.pool_size) {
            return Err(PgError::Config(format!(
                "pool_size {} must be within 1..={POOL_SIZE_MAX}",
                self.pool_size
            )));
        }
        for (name, value) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("wait_timeout_ms", self.wait_timeout_ms),
            ("statement_timeout_ms", self.statement_timeout_ms),
            ("lock_timeout_ms", self.lock_timeout_ms),
            ("transaction_deadline_ms", self.transaction_deadline_ms),
            ("keepalives_idle_ms", self.keepalives_idle_ms),
            ("keepalives_interval_ms", self.keepalives_interval_ms),
            ("tcp_user_timeout_ms", self.tcp_user_timeout_ms),
        ] {
            if value == 0 {
                return Err(PgError::Config(format!("{name} must be positive")));
            }
        }
        if self.transaction_deadline_ms < self.statement_timeout_ms {
            return Err(PgError::Config(format!(
                "transaction_deadline_ms {} is below statement_timeout_ms {}",
                self.transaction_deadline_ms, self.statement_timeout_ms
            )));
        }
        let hosts = host_specs(&self.parsed()?)?;
        if hosts.len() > HOSTS_MAX {
            return Err(PgError::Config(format!(
                "pg url: {} hosts, at most {HOSTS_MAX}",
                hosts.len()
            )));
        }
        Ok(())
    }

    /// The settings of one connection kept by a side task that asks every `every` (the edge's
    /// health ping, the dependency stats): its whole connect bounded by the same interval.
    pub fn probe(url: String, every: Duration, application_name: &str) -> PgPoolConfig {
        PgPoolConfig {
            url,
            pool_size: 1,
            connect_timeout_ms: u64::try_from(every.as_millis()).unwrap_or(u64::MAX).max(1),
            application_name: application_name.to_owned(),
            ..PgPoolConfig::default()
        }
    }

    fn parsed(&self) -> Result<tokio_postgres::Config, PgError> {
        self.url.parse().map_err(|e| PgError::Config(format!("pg url: {e}")))
    }

    /// Bound on creating one pooled connection: every host once, plus the first survey.
    fn create_timeout(&self, hosts: usize) -> Duration {
        Duration::from_millis(self.connect_timeout_ms.saturating_mul(hosts as u64 + 1))
    }
}

// ---- the fencing rule (sans-I/O) --------------------------------------------------------------

/// What one host said about itself right after connecting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRole {
    /// Not in recovery and `transaction_read_only` off.
    pub writable: bool,
    /// The timeline of the WAL it writes now (writable hosts only).
    pub timeline: Option<u32>,
}

/// Whether to keep a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    /// `target_session_attrs=read-write` and the host is a standby or read-only.
    RefuseReadOnly,
    /// `target_session_attrs=read-only` and the host is writable.
    RefuseWritable,
    /// Writable on a timeline behind the highest seen: an old primary that came back.
    RefuseFenced {
        timeline: u32,
        timeline_max: u32,
    },
}

/// The fencing rule: a writable host whose timeline is behind `timeline_max` (0 = none seen)
/// is refused whatever the session attributes; otherwise the attributes decide.
pub fn verdict(attrs: TargetSessionAttrs, role: HostRole, timeline_max: u32) -> Verdict {
    if role.writable {
        let timeline = role.timeline.unwrap_or(0);
        if timeline < timeline_max {
            return Verdict::RefuseFenced { timeline, timeline_max };
        }
    }
    match (attrs, role.writable) {
        (TargetSessionAttrs::ReadWrite, false) => Verdict::RefuseReadOnly,
        (TargetSessionAttrs::ReadOnly, true) => Verdict::RefuseWritable,
        _ => Verdict::Accept,
    }
}

/// The timeline in a WAL file name (`000000020000000000000003` → 2).
pub fn timeline_of_walfile(name: &str) -> Option<u32> {
    u32::from_str_radix(name.get(..8)?, 16).ok()
}

// ---- the connector ------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct HostSpec {
    host: Host,
    hostaddr: Option<IpAddr>,
    port: u16,
}

fn host_specs(config: &tokio_postgres::Config) -> Result<Vec<HostSpec>, PgError> {
    let (hosts, addrs, ports) = (config.get_hosts(), config.get_hostaddrs(), config.get_ports());
    let count = hosts.len().max(addrs.len());
    if count == 0 {
        return Err(PgError::Config("pg url: no host".into()));
    }
    if ports.len() > 1 && ports.len() != count {
        return Err(PgError::Config("pg url: as many ports as hosts, or one".into()));
    }
    Ok((0..count)
        .map(|i| HostSpec {
            host: hosts.get(i).cloned().unwrap_or_else(|| Host::Tcp(addrs[i].to_string())),
            hostaddr: addrs.get(i).copied(),
            port: ports.get(i).or(ports.first()).copied().unwrap_or(5432),
        })
        .collect())
}

/// Opens connections by the failover and fencing rules of this module. Clone freely: clones
/// share what was learned (last good host, highest timeline, live connections).
#[derive(Clone)]
pub struct Connector {
    hosts: Arc<[HostSpec]>,
    base: tokio_postgres::Config,
    attrs: TargetSessionAttrs,
    deadline: Duration,
    settings: Arc<PgPoolConfig>,
    state: Arc<Learned>,
}

/// What the multi-host connectors of one process learned, one entry per host list: the
/// highest timeline is a fact about the servers, not about one pool. The health ping, the
/// edge's pool and the in-process worker each have a connector; when one of them learns that
/// a standby was promoted, the others' connections to the old primary are closed too (found
/// by `tests/tests/ha_pg.rs`: the edge's pool, idle while its primary was frozen, kept
/// reading the thawed old primary after the health ping and the worker had moved on). A
/// single host has nothing to share: a server re-created on a reused port starts again.
fn shared_learned(hosts: &[HostSpec]) -> Arc<Learned> {
    type Registry = Mutex<Vec<(String, std::sync::Weak<Learned>)>>;
    static REGISTRY: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    let key = hosts
        .iter()
        .map(|h| format!("{:?}/{:?}:{}", h.host, h.hostaddr, h.port))
        .collect::<Vec<_>>()
        .join(",");
    let registry = REGISTRY.get_or_init(Registry::default);
    let mut entries = registry.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    entries.retain(|(_, learned)| learned.strong_count() > 0);
    if let Some(learned) = entries.iter().find(|(k, _)| *k == key).and_then(|(_, l)| l.upgrade()) {
        return learned;
    }
    let learned = Arc::new(Learned::default());
    entries.push((key, Arc::downgrade(&learned)));
    learned
}

#[derive(Default)]
struct Learned {
    /// Index of the host of the last successful connect (tried first next time).
    last_good: AtomicUsize,
    /// Highest timeline seen on a writable host; 0 = none yet.
    timeline_max: AtomicU32,
    /// A connection ended since the last connect: survey before the next one.
    lost: Arc<AtomicBool>,
    /// A survey started by [`Connector::suspect`] is running (one at a time).
    surveying: AtomicBool,
    /// Each live connection's timeline and task, so the ones behind a newly learned timeline
    /// can be closed. Pruned of finished tasks on every insert: bounded by live connections.
    live: Mutex<Vec<(u32, tokio::task::AbortHandle)>>,
}

impl Connector {
    /// A connector sharing what this process's other connectors to the same hosts learned
    /// (several hosts; a single host has nothing to share).
    pub fn new(config: &PgPoolConfig) -> Result<Connector, PgError> {
        let mut connector = Connector::isolated(config)?;
        if connector.hosts.len() > 1 {
            connector.state = shared_learned(&connector.hosts);
        }
        Ok(connector)
    }

    /// A connector that has learned nothing, as in a fresh process (the drills' "new process"
    /// case: its first connect must survey every host itself).
    pub fn isolated(config: &PgPoolConfig) -> Result<Connector, PgError> {
        config.validate()?;
        let base = config.parsed()?;
        let hosts: Arc<[HostSpec]> = host_specs(&base)?.into();
        Ok(Connector {
            hosts,
            attrs: base.get_target_session_attrs(),
            base,
            deadline: Duration::from_millis(config.connect_timeout_ms),
            settings: Arc::new(config.clone()),
            state: Arc::default(),
        })
    }

    /// The highest timeline seen on a writable host (0: none yet).
    pub fn timeline_max(&self) -> u32 {
        self.state.timeline_max.load(Ordering::Acquire)
    }

    /// The port of the host tried first next time.
    pub fn preferred_port(&self) -> u16 {
        self.hosts[self.state.last_good.load(Ordering::Relaxed) % self.hosts.len()].port
    }

    /// One connection: hosts in turn, the last good one first, each within the whole-connect
    /// deadline; the first the fencing rule and session attributes accept wins. The error is
    /// the last host's (a deadline that passed reads as `TimedOut`).
    pub async fn connect(
        &self,
    ) -> Result<(Client, tokio::task::JoinHandle<()>), tokio_postgres::Error> {
        let lost = self.state.lost.swap(false, Ordering::AcqRel);
        if self.hosts.len() > 1 && (self.timeline_max() == 0 || lost) {
            self.survey().await;
        }
        let first = self.state.last_good.load(Ordering::Relaxed) % self.hosts.len();
        let order = std::iter::once(first).chain((0..self.hosts.len()).filter(|&i| i != first));
        let mut last_error = None;
        for index in order {
            match tokio::time::timeout(self.deadline, self.try_host(index)).await {
                Ok(Ok((client, task, timeline))) => {
                    self.state.last_good.store(index, Ordering::Relaxed);
                    self.adopt(&task, timeline);
                    metrics::counter!("flashsale_pg_connects_total", "result" => "ok").increment(1);
                    return Ok((client, task));
                }
                Ok(Err(e)) => last_error = Some(e),
                Err(_) => {
                    metrics::counter!("flashsale_pg_connects_total", "result" => "deadline")
                        .increment(1);
                    let port = self.hosts[index].port;
                    let message = format!(
                        "host {index} (port {port}) did not finish connecting within {} ms \
                         (TCP + start-up + role check)",
                        self.deadline.as_millis()
                    );
                    tracing::debug!(%message, "postgres host skipped");
                    last_error = Some(minted_error(std::io::ErrorKind::TimedOut, message).await);
                }
            }
        }
        match last_error {
            Some(e) => Err(e),
            None => Err(minted_error(std::io::ErrorKind::NotFound, "no host".into()).await),
        }
    }

    /// A caller's statement outlasted its deadline: the host may be hung and a standby
    /// promoted meanwhile. Surveys every host now, in the background (one survey at a time),
    /// so a newer timeline closes the connections behind it at once — not only at the next
    /// connect, which an idle pool of connections to a frozen-then-resumed old primary would
    /// never make (found by `tests/tests/ha_pg.rs`: the edge's reconcile kept reading the
    /// thawed old primary, and the worker spent a transaction deadline on each of its idle
    /// connections to the frozen one). Needs a tokio runtime; a single host has nothing to
    /// learn.
    pub fn suspect(&self) {
        if self.hosts.len() < 2 || self.state.surveying.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            this.survey().await;
            this.state.surveying.store(false, Ordering::Release);
        });
    }

    /// Asks every host at once (each within the deadline) and learns the highest timeline of
    /// the writable ones; the connections are closed again.
    async fn survey(&self) {
        let probes = (0..self.hosts.len()).map(|index| async move {
            match tokio::time::timeout(self.deadline, self.open_and_probe(index)).await {
                Ok(Ok((client, task, role))) => {
                    task.abort();
                    drop(client);
                    role.writable.then_some(role.timeline).flatten()
                }
                _ => None,
            }
        });
        let timelines = futures::future::join_all(probes).await;
        if let Some(max) = timelines.into_iter().flatten().max() {
            self.learn_timeline(max);
            tracing::info!(timeline = max, "postgres: highest writable timeline learned by survey");
        }
    }

    /// Connects to one host, probes it and applies the rule.
    async fn try_host(
        &self,
        index: usize,
    ) -> Result<(Client, tokio::task::JoinHandle<()>, u32), tokio_postgres::Error> {
        let (client, task, role) = self.open_and_probe(index).await?;
        let timeline_max = self.timeline_max();
        let refusal = match verdict(self.attrs, role, timeline_max) {
            Verdict::Accept => return Ok((client, task, role.timeline.unwrap_or(0))),
            Verdict::RefuseReadOnly => ("read_only", "is read-only (a standby)".to_owned()),
            Verdict::RefuseWritable => ("writable", "is writable (read-only wanted)".to_owned()),
            Verdict::RefuseFenced { timeline, timeline_max } => {
                tracing::warn!(
                    port = self.hosts[index].port,
                    timeline,
                    timeline_max,
                    "postgres: refusing a writable host behind the newest timeline (fenced: an \
                     old primary that came back)"
                );
                (
                    "fenced",
                    format!("is writable on timeline {timeline}, behind {timeline_max} (fenced)"),
                )
            }
        };
        task.abort();
        drop(client);
        metrics::counter!("flashsale_pg_connects_total", "result" => refusal.0).increment(1);
        let message = format!("host {index} (port {}) {}", self.hosts[index].port, refusal.1);
        Err(minted_error(std::io::ErrorKind::PermissionDenied, message).await)
    }

    async fn open_and_probe(
        &self,
        index: usize,
    ) -> Result<(Client, tokio::task::JoinHandle<()>, HostRole), tokio_postgres::Error> {
        let config = self.host_config(&self.hosts[index]);
        let (client, connection) = config.connect(NoTls).await?;
        let lost = Arc::clone(&self.state.lost);
        let task = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "postgres connection ended");
            }
            // Any end of a connection in use — the server went away, or the caller discarded
            // it as unresponsive (a transaction past its deadline: e.g. a COMMIT waiting for a
            // synchronous standby that was promoted away) — may mean a failover: survey before
            // the next connect. Probes and refused hosts are aborted first and never get here.
            lost.store(true, Ordering::Release);
        });
        // Dropped with the future when the deadline passes: the task must not outlive it.
        let guard = AbortOnDrop(Some(task));
        let role = probe_role(&client).await?;
        Ok((client, guard.defuse(), role))
    }

    /// Remembers a new connection; the live connections behind its timeline are closed.
    fn adopt(&self, task: &tokio::task::JoinHandle<()>, timeline: u32) {
        self.learn_timeline(timeline);
        // Only writable connections carry a timeline worth fencing on.
        if timeline > 0 {
            let mut live =
                self.state.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            live.push((timeline, task.abort_handle()));
        }
    }

    /// Raises the highest timeline seen to at least `timeline` and closes every live
    /// connection behind the highest (whether a connect or a survey learned it).
    fn learn_timeline(&self, timeline: u32) {
        let max = self.state.timeline_max.fetch_max(timeline, Ordering::AcqRel).max(timeline);
        let mut live = self.state.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        live.retain(|(_, handle)| !handle.is_finished());
        let behind = live.iter().filter(|(t, _)| *t < max).count();
        if behind > 0 {
            tracing::warn!(
                timeline = max,
                behind,
                "postgres: newer timeline; closing older connections"
            );
            for (_, handle) in live.iter().filter(|(t, _)| *t < max) {
                handle.abort();
            }
            live.retain(|(t, _)| *t >= max);
        }
    }

    /// A single-host config from the URL's settings plus ours (the role check is ours, so
    /// tokio-postgres is told `any`).
    fn host_config(&self, spec: &HostSpec) -> tokio_postgres::Config {
        let (base, s) = (&self.base, &self.settings);
        let mut c = tokio_postgres::Config::new();
        if let Some(user) = base.get_user() {
            c.user(user);
        }
        if let Some(password) = base.get_password() {
            c.password(password);
        }
        if let Some(dbname) = base.get_dbname() {
            c.dbname(dbname);
        }
        match &spec.host {
            Host::Tcp(host) => c.host(host),
            Host::Unix(path) => c.host_path(path),
        };
        if let Some(addr) = spec.hostaddr {
            c.hostaddr(addr);
        }
        let options = format!(
            "{} -c statement_timeout={} -c lock_timeout={}",
            base.get_options().unwrap_or(""),
            s.statement_timeout_ms,
            s.lock_timeout_ms
        );
        c.port(spec.port)
            .options(options.trim_start())
            .application_name(&s.application_name)
            .ssl_mode(base.get_ssl_mode())
            .channel_binding(base.get_channel_binding())
            .connect_timeout(self.deadline)
            .tcp_user_timeout(Duration::from_millis(s.tcp_user_timeout_ms))
            .keepalives(true)
            .keepalives_idle(Duration::from_millis(s.keepalives_idle_ms))
            .keepalives_interval(Duration::from_millis(s.keepalives_interval_ms))
            .keepalives_retries(s.keepalives_retries)
            .target_session_attrs(TargetSessionAttrs::Any);
        c
    }
}

/// Reads the host's role in one round trip. `pg_current_wal_lsn()` fails during recovery,
/// hence the CASE (a volatile function inside it is only evaluated on its branch).
async fn probe_role(client: &Client) -> Result<HostRole, tokio_postgres::Error> {
    let messages = client
        .simple_query(
            "SELECT pg_is_in_recovery()::text, current_setting('transaction_read_only'), \
             CASE WHEN pg_is_in_recovery() THEN NULL \
             ELSE pg_walfile_name(pg_current_wal_lsn()) END",
        )
        .await?;
    let row = messages.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(row) => Some(row),
        _ => None,
    });
    let Some(row) = row else {
        return Err(
            minted_error(std::io::ErrorKind::InvalidData, "role probe: no row".into()).await
        );
    };
    let in_recovery = row.try_get(0)?.unwrap_or("true") == "true";
    let read_only = row.try_get(1)?.unwrap_or("on") == "on";
    let timeline = row.try_get(2)?.and_then(timeline_of_walfile);
    Ok(HostRole { writable: !in_recovery && !read_only, timeline })
}

struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl AbortOnDrop {
    fn defuse(mut self) -> tokio::task::JoinHandle<()> {
        match self.0.take() {
            Some(task) => task,
            None => unreachable!("defused once"),
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// A `tokio_postgres::Error` carrying our own `io::Error` (kind and message) as its source.
/// The driver's constructors are private and deadpool's connect hook must return its error
/// type; a start-up over a stream that refuses every write yields exactly
/// `Error::io(that error)` without touching the network. `PgError`'s classification then
/// reads the kind like any socket error (TimedOut, PermissionDenied: unavailable, retried).
pub async fn minted_error(kind: std::io::ErrorKind, message: String) -> tokio_postgres::Error {
    let mut config = tokio_postgres::Config::new();
    config.user("flashsale");
    match config.connect_raw(Refusing(Some(std::io::Error::new(kind, message))), NoTls).await {
        Err(e) => e,
        Ok(_) => unreachable!("a stream that refuses every write cannot complete a start-up"),
    }
}

/// A stream whose first write fails with the error it holds (then "broken pipe").
struct Refusing(Option<std::io::Error>);

impl tokio::io::AsyncRead for Refusing {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for Refusing {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let error = self.0.take().unwrap_or_else(|| std::io::ErrorKind::BrokenPipe.into());
        std::task::Poll::Ready(Err(error))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// deadpool's hook: every pooled connection comes from the connector.
struct ConnectorHook(Connector);

impl deadpool_postgres::Connect for ConnectorHook {
    fn connect(
        &self,
        _: &tokio_postgres::Config,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<(Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>,
                > + Send
                + '_,
        >,
    > {
        Box::pin(self.0.connect())
    }
}

/// Builds the pool (no connection is opened until the first `get`).
pub fn build_pool(config: &PgPoolConfig) -> Result<Pool, PgError> {
    build_pool_with(config, Connector::new(config)?)
}

/// [`build_pool`] over a given connector (callers that also want to read what it learned).
pub fn build_pool_with(config: &PgPoolConfig, connector: Connector) -> Result<Pool, PgError> {
    let create = config.create_timeout(connector.hosts.len());
    let base = connector.base.clone();
    let manager = Manager::from_connect(
        base,
        ConnectorHook(connector),
        // Fast: no test query on checkout; a dead connection fails its next statement, the
        // caller discards it and the message is redelivered. A connection behind a newer
        // timeline is closed by the connector, and a closed one is never handed out.
        ManagerConfig { recycling_method: RecyclingMethod::Fast },
    );
    let wait = Some(Duration::from_millis(config.wait_timeout_ms));
    Pool::builder(manager)
        .max_size(config.pool_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(wait)
        .create_timeout(Some(create))
        .recycle_timeout(wait)
        .build()
        .map_err(|e| PgError::Config(format!("build pool: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connectors_on_the_same_hosts_share_what_they_learn_and_a_single_host_does_not() {
        let config = |url: &str| PgPoolConfig { url: url.into(), ..Default::default() };
        let hosts = "postgres://u@127.0.0.1:6001,127.0.0.1:6002/db";
        let (edge, worker) =
            (Connector::new(&config(hosts)).unwrap(), Connector::new(&config(hosts)).unwrap());
        let other =
            Connector::new(&config("postgres://u@127.0.0.1:6001,127.0.0.1:6003/db")).unwrap();
        worker.learn_timeline(3);
        assert_eq!((edge.timeline_max(), other.timeline_max()), (3, 0));
        let single = "postgres://u@127.0.0.1:6004/db";
        let (a, b) =
            (Connector::new(&config(single)).unwrap(), Connector::new(&config(single)).unwrap());
        a.learn_timeline(2);
        assert_eq!((a.timeline_max(), b.timeline_max()), (2, 0));
    }

    #[test]
    fn multi_host_urls_are_accepted() {
        let config = PgPoolConfig {
            url:
                "postgres://postgres@10.0.0.1:5432,10.0.0.2:5433/db?target_session_attrs=read-write"
                    .into(),
            ..Default::default()
        };
        config.validate().expect("multi-host URL");
        let parsed: tokio_postgres::Config = config.url.parse().expect("parse");
        let specs = host_specs(&parsed).expect("hosts");
        assert_eq!(specs.iter().map(|s| s.port).collect::<Vec<_>>(), vec![5432, 5433]);
        let kv = PgPoolConfig {
            url: "host=a,b,c port=5432 user=u dbname=d target_session_attrs=read-write".into(),
            ..Default::default()
        };
        kv.validate().expect("key=value form");
        let specs = host_specs(&kv.parsed().expect("parse")).expect("hosts");
        assert_eq!(
            specs.iter().map(|s| s.port).collect::<Vec<_>>(),
            vec![5432; 3],
            "one port for all"
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        for config in [
            PgPoolConfig { pool_size: 0, ..Default::default() },
            PgPoolConfig { pool_size: POOL_SIZE_MAX + 1, ..Default::default() },
            PgPoolConfig { lock_timeout_ms: 0, ..Default::default() },
            PgPoolConfig { tcp_user_timeout_ms: 0, ..Default::default() },
            PgPoolConfig { transaction_deadline_ms: 5_000, ..Default::default() },
            PgPoolConfig {
                url: "postgres://h/db?target_session_attrs=bogus".into(),
                ..Default::default()
            },
            PgPoolConfig { url: "host=a,b port=1,2,3".into(), ..Default::default() },
        ] {
            assert!(matches!(config.validate(), Err(PgError::Config(_))), "{config:?}");
        }
    }

    #[test]
    fn the_fencing_rule_refuses_a_writable_host_behind_the_newest_timeline() {
        use TargetSessionAttrs::{Any, ReadWrite};
        let primary = |timeline| HostRole { writable: true, timeline: Some(timeline) };
        let standby = HostRole { writable: false, timeline: None };
        assert_eq!(verdict(ReadWrite, primary(1), 0), Verdict::Accept, "nothing seen yet");
        assert_eq!(verdict(ReadWrite, primary(2), 1), Verdict::Accept, "a newer primary");
        assert_eq!(verdict(ReadWrite, primary(2), 2), Verdict::Accept);
        assert_eq!(
            verdict(ReadWrite, primary(1), 2),
            Verdict::RefuseFenced { timeline: 1, timeline_max: 2 }
        );
        assert_eq!(
            verdict(Any, primary(1), 2),
            Verdict::RefuseFenced { timeline: 1, timeline_max: 2 },
            "whatever the session attributes"
        );
        assert_eq!(verdict(ReadWrite, standby, 2), Verdict::RefuseReadOnly);
        assert_eq!(verdict(Any, standby, 2), Verdict::Accept, "a standby writes nothing");
        assert_eq!(
            verdict(ReadWrite, HostRole { writable: true, timeline: None }, 1),
            Verdict::RefuseFenced { timeline: 0, timeline_max: 1 },
            "a writable host whose timeline cannot be read is not trusted"
        );
    }

    #[test]
    fn timelines_are_read_from_wal_file_names() {
        assert_eq!(timeline_of_walfile("000000020000000000000003"), Some(2));
        assert_eq!(timeline_of_walfile("0000001A0000000000000001"), Some(26));
        assert_eq!(timeline_of_walfile("zz"), None);
    }

    #[tokio::test]
    async fn minted_errors_carry_our_kind_and_message_and_classify_as_unavailable() {
        use std::error::Error as _;
        let e = minted_error(std::io::ErrorKind::TimedOut, "host 0 hung".into()).await;
        let io = e.source().and_then(|s| s.downcast_ref::<std::io::Error>()).expect("io source");
        assert_eq!(io.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(io.to_string(), "host 0 hung");
        let pg = PgError::Db(e);
        assert!(pg.is_unavailable() && pg.is_transient(), "{pg}");
    }
}
