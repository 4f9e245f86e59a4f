//! Start-up checks of the host: the facts a thread-per-core engine depends on but cannot fix
//! itself (locked-memory and file limits, which CPUs it may use and which are isolated,
//! transparent huge pages, the kernel's cap on listen backlogs), compared with what this
//! `serve` configuration needs. Each finding is a [`Warning`] whose message names the knob
//! and the fix; `tuning/README.md` explains every knob with a measured reason.
//!
//! The core is sans-I/O: [`check`] takes observed [`Facts`] and the configuration's
//! [`Needs`] and returns the warnings, so every branch is unit-tested with fabricated facts.
//! [`read_facts`] is the thin reader of `/proc` and `/sys` (no `unsafe`: the limits come
//! from `/proc/self/limits`, the affinity mask from `/proc/self/status`), and
//! [`log_warnings`] reports through `tracing`.
//!
//! Deliberately not here: changing anything (limits, sysctls, affinity). The engine warns
//! and starts; an operator applies `tuning/` (or the systemd unit) and restarts. A fact that
//! cannot be read is `None` and its checks are skipped, never guessed.

use std::fmt;

/// glommio 0.9 refuses to build a reactor when the soft `RLIMIT_MEMLOCK` is below this
/// (`sys/uring.rs`, `MIN_MEMLOCK_LIMIT`): the shard fails to start.
pub const GLOMMIO_MEMLOCK_MIN_BYTES: u64 = 512 * 1024;
/// glommio registers its I/O buffer (at least 64 KiB, rounded up to 4 KiB) with each of its
/// three io_uring rings (main, latency, poll); the kernel charges each registration to the
/// user's locked memory (summed over all processes of the user) unless the process has
/// `CAP_IPC_LOCK`. Measured: `VmPin` 3,072 kB per shard with 1 MiB `io_memory` and THP off.
pub const GLOMMIO_RINGS_PER_EXECUTOR: u64 = 3;
const GLOMMIO_IO_MEMORY_MIN_BYTES: u64 = 64 * 1024;
/// When the buffer sits in transparent huge pages the kernel charges every huge page it
/// touches in full (measured: 6,144 kB for one 1 MiB-buffer shard with THP `madvise`, and a
/// failed registration under 8 MiB when the buffer straddled two huge pages).
const HUGE_PAGE_BYTES: u64 = 2 * 1024 * 1024;
/// The backlog `glommio::net::TcpListener::bind` passes to `listen(2)` (`net/tcp_socket.rs`),
/// and the public listener's (bound by `shard::conn::bind_public` with the same value).
pub const GLOMMIO_LISTEN_BACKLOG: u32 = crate::shard::conn::LISTEN_BACKLOG;
/// File descriptors beyond the client connections: per shard its rings, eventfds, listeners
/// and Redis connections; per process the PostgreSQL pools, NATS and the log. Measured on an
/// idle engine (`ls /proc/PID/fd`): 33, 40 and 46 for 1, 2 and 3 shards; 256 leaves room for
/// pools that grow under load.
pub const FDS_RESERVED: u64 = 256;
/// `CAP_IPC_LOCK` in the capability bit sets of `/proc/self/status`.
const CAP_IPC_LOCK_BIT: u32 = 14;

/// A resource limit as `getrlimit(2)` reports it; `None` is "unlimited".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub soft: Option<u64>,
    pub hard: Option<u64>,
}

/// `/sys/kernel/mm/transparent_hugepage/enabled`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThpMode {
    Always,
    Madvise,
    Never,
}

/// What the host looks like, as far as it could be read. `None`: unknown, check skipped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// `RLIMIT_MEMLOCK` in bytes.
    pub memlock: Option<Limit>,
    /// `RLIMIT_NOFILE`.
    pub nofile: Option<Limit>,
    /// Whether the process holds `CAP_IPC_LOCK` (io_uring then charges no locked memory).
    pub ipc_lock: Option<bool>,
    /// `/sys/devices/system/cpu/online`.
    pub online_cpus: Option<Vec<usize>>,
    /// The affinity mask the process started with (`sched_getaffinity`, systemd's
    /// `CPUAffinity=`, `taskset`).
    pub allowed_cpus: Option<Vec<usize>>,
    /// `/sys/devices/system/cpu/isolated` (`isolcpus=`); empty when none.
    pub isolated_cpus: Option<Vec<usize>>,
    pub thp: Option<ThpMode>,
    /// `net.core.somaxconn`: the kernel silently caps every listen backlog at it.
    pub somaxconn: Option<u32>,
    /// `net.ipv4.tcp_max_syn_backlog`: half-open connections per listener.
    pub tcp_max_syn_backlog: Option<u32>,
}

/// What this configuration needs from the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Needs {
    pub shards: usize,
    /// The CPU each shard is pinned to ([`shard_cpus`]), empty when unpinned.
    pub pinned_cpus: Vec<usize>,
    /// Memory glommio registers for I/O, per executor.
    pub io_memory_bytes: u64,
    pub listen_backlog: u32,
    pub connections_per_shard_max: u64,
    /// Admin-plane connections (shard 0 only).
    pub admin_connections_max: u64,
}

impl Needs {
    /// Locked memory glommio's buffer registrations may charge for all shards: exact with
    /// THP `never`; otherwise the worst case of the buffer straddling one more huge page
    /// than its size needs (unknown THP counts as enabled).
    pub fn memlock_bytes(&self, thp: Option<ThpMode>) -> u64 {
        let io = self.io_memory_bytes.max(GLOMMIO_IO_MEMORY_MIN_BYTES).div_ceil(4096) * 4096;
        let per_ring = match thp {
            Some(ThpMode::Never) => io,
            _ => (io.div_ceil(HUGE_PAGE_BYTES) + 1) * HUGE_PAGE_BYTES,
        };
        per_ring * GLOMMIO_RINGS_PER_EXECUTOR * self.shards as u64
    }

    /// File descriptors for every shard full of connections, plus the admin port's and the
    /// rest of the process's (Redis, NATS, PostgreSQL, rings: [`FDS_RESERVED`]).
    pub fn nofile(&self) -> u64 {
        self.connections_per_shard_max * self.shards as u64
            + self.admin_connections_max
            + FDS_RESERVED
    }

    /// The largest `connections_per_shard_max` whose [`Needs::nofile`] fits `soft` (at
    /// least 1: a limit that leaves nothing for clients still lets the engine answer one).
    pub fn connections_per_shard_fitting(&self, soft: u64) -> u64 {
        let for_clients = soft.saturating_sub(self.admin_connections_max + FDS_RESERVED);
        (for_clients / self.shards.max(1) as u64).max(1)
    }
}

/// One finding. The `Display` text says what happens and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Warning {
    /// glommio refuses to start an executor below 512 KiB of locked memory.
    MemlockBelowGlommioMinimum { soft_bytes: u64 },
    /// The I/O buffers may not all be registered: glommio logs "registering buffers ...
    /// Skipping" and those shards run without registered buffers (glommio uses them for
    /// file DMA and UDP, not for the TCP path; other io_uring users of the same Unix user
    /// lose that budget too).
    MemlockBelowRegisteredBuffers { soft_bytes: u64, needed_bytes: u64 },
    /// The open-file limit cannot hold every shard full of connections: the connection bound
    /// was lowered to what fits (otherwise accepts fail with EMFILE and the admin port,
    /// Redis, NATS and PostgreSQL lose their descriptors to clients).
    NofileBelowConnections { soft: u64, hard: Option<u64>, needed: u64, per_shard_max: u64 },
    /// More shards than CPUs this process may run on: shards share cores.
    ShardsExceedAllowedCpus { shards: usize, allowed: Vec<usize> },
    /// A shard is pinned to a CPU that is offline or does not exist: it fails to start.
    PinsOffline { cpus: Vec<usize>, online: Vec<usize> },
    /// A shard is pinned outside the affinity mask the process was given (systemd
    /// `CPUAffinity=`, `taskset`): pinning silently overrides the operator's mask, or fails
    /// where a cgroup cpuset forbids the CPU.
    PinsOutsideAllowed { cpus: Vec<usize>, allowed: Vec<usize> },
    /// Some CPUs are isolated but shards are pinned to CPUs that are not.
    PinsNotIsolated { cpus: Vec<usize>, isolated: Vec<usize> },
    /// Unpinned threads never migrate onto isolated CPUs: those cores stay idle.
    UnpinnedWithIsolatedCpus { isolated: Vec<usize> },
    /// Shards are pinned but share their cores with every other process.
    PinnedWithoutIsolation { cpus: Vec<usize> },
    /// Transparent huge pages `always`: page-fault compaction stalls and memory growth.
    ThpAlways,
    /// The kernel caps the listen backlog at `net.core.somaxconn`.
    SomaxconnBelowBacklog { somaxconn: u32, backlog: u32 },
    /// Half-open connections per listener are capped below the backlog.
    SynBacklogBelowBacklog { tcp_max_syn_backlog: u32, backlog: u32 },
}

impl Warning {
    /// A stable short name for logs and dashboards.
    pub fn name(&self) -> &'static str {
        match self {
            Warning::MemlockBelowGlommioMinimum { .. } => "memlock_below_glommio_minimum",
            Warning::MemlockBelowRegisteredBuffers { .. } => "memlock_below_registered_buffers",
            Warning::NofileBelowConnections { .. } => "nofile_below_connections",
            Warning::ShardsExceedAllowedCpus { .. } => "shards_exceed_allowed_cpus",
            Warning::PinsOffline { .. } => "pins_offline",
            Warning::PinsOutsideAllowed { .. } => "pins_outside_allowed",
            Warning::PinsNotIsolated { .. } => "pins_not_isolated",
            Warning::UnpinnedWithIsolatedCpus { .. } => "unpinned_with_isolated_cpus",
            Warning::PinnedWithoutIsolation { .. } => "pinned_without_isolation",
            Warning::ThpAlways => "thp_always",
            Warning::SomaxconnBelowBacklog { .. } => "somaxconn_below_backlog",
            Warning::SynBacklogBelowBacklog { .. } => "syn_backlog_below_backlog",
        }
    }
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Warning::MemlockBelowGlommioMinimum { soft_bytes } => write!(
                f,
                "locked-memory limit {soft_bytes} B is below glommio's minimum \
                 {GLOMMIO_MEMLOCK_MIN_BYTES} B: shards will fail to start; raise it \
                 (systemd LimitMEMLOCK=, limits.conf memlock; see tuning/README.md)"
            ),
            Warning::MemlockBelowRegisteredBuffers { soft_bytes, needed_bytes } => write!(
                f,
                "locked-memory limit {soft_bytes} B is below the {needed_bytes} B the shards' \
                 io_uring buffer registrations may need (charged per Unix user, across its \
                 processes): glommio will log `registering buffers ... Skipping` and run those \
                 shards without registered buffers; raise LimitMEMLOCK= or grant CAP_IPC_LOCK \
                 (see tuning/README.md)"
            ),
            Warning::NofileBelowConnections { soft, hard, needed, per_shard_max } => write!(
                f,
                "open-file limit {soft} (hard {}) is below the {needed} descriptors that full \
                 shards need (connections_per_shard_max x shards + admin connections + \
                 {FDS_RESERVED}): connections_per_shard_max lowered to {per_shard_max} so \
                 that accepts never fail with EMFILE; raise LimitNOFILE= to serve more",
                hard.map_or_else(|| "unlimited".to_owned(), |h| h.to_string())
            ),
            Warning::ShardsExceedAllowedCpus { .. }
            | Warning::PinsOffline { .. }
            | Warning::PinsOutsideAllowed { .. }
            | Warning::PinsNotIsolated { .. }
            | Warning::UnpinnedWithIsolatedCpus { .. }
            | Warning::PinnedWithoutIsolation { .. } => self.fmt_cpu_placement(f),
            Warning::ThpAlways => write!(
                f,
                "transparent huge pages are `always`: every process on this host may stall \
                 in page-fault compaction and grow its resident memory; set `madvise` so only \
                 programs that ask get huge pages (see tuning/README.md)"
            ),
            Warning::SomaxconnBelowBacklog { somaxconn, backlog } => write!(
                f,
                "net.core.somaxconn={somaxconn} caps the listen backlog {backlog}: a \
                 connection burst beyond it is dropped (ListenOverflows) and clients retry \
                 SYN after 1 s; set net.core.somaxconn >= {backlog}"
            ),
            Warning::SynBacklogBelowBacklog { tcp_max_syn_backlog, backlog } => write!(
                f,
                "net.ipv4.tcp_max_syn_backlog={tcp_max_syn_backlog} is below the listen \
                 backlog {backlog}: half-open connections beyond it fall back to SYN cookies \
                 or are dropped; set it >= {backlog}"
            ),
        }
    }
}

impl Warning {
    /// The messages of the warnings about where shards run (CPU counts, pins, isolation).
    fn fmt_cpu_placement(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Warning::ShardsExceedAllowedCpus { shards, allowed } => write!(
                f,
                "{shards} shards but this process may run on {} CPUs ({}): shards share cores \
                 and one core's stall delays several shards; set FLASHSALE_SHARDS to at most \
                 {}",
                allowed.len(),
                CpuList(allowed),
                allowed.len()
            ),
            Warning::PinsOffline { cpus, online } => write!(
                f,
                "shards would be pinned to CPUs {} which are not online (online: {}): those \
                 shards fail to start; lower FLASHSALE_SHARDS or use --no-pin",
                CpuList(cpus),
                CpuList(online)
            ),
            Warning::PinsOutsideAllowed { cpus, allowed } => write!(
                f,
                "shards would be pinned to CPUs {} outside this process's affinity mask ({}): \
                 pinning overrides CPUAffinity=/taskset (or fails under a cgroup cpuset); \
                 widen the mask or use --no-pin",
                CpuList(cpus),
                CpuList(allowed)
            ),
            Warning::PinsNotIsolated { cpus, isolated } => write!(
                f,
                "shards are pinned to CPUs {} which are not isolated while CPUs {} are: other \
                 processes and interrupts share the shards' cores and the isolated ones idle \
                 (see tuning/README.md, CPU isolation)",
                CpuList(cpus),
                CpuList(isolated)
            ),
            Warning::UnpinnedWithIsolatedCpus { isolated } => write!(
                f,
                "shards are unpinned but CPUs {} are isolated: the scheduler never moves \
                 threads onto them, so those cores stay idle; pin the shards",
                CpuList(isolated)
            ),
            Warning::PinnedWithoutIsolation { cpus } => write!(
                f,
                "shards are pinned to CPUs {} that no kernel isolation reserves: any busy \
                 process on those cores stalls a whole shard (tail latency); isolate them \
                 (isolcpus=/nohz_full=, IRQ affinity) or run with --no-pin on shared hosts",
                CpuList(cpus)
            ),
            // Written by `Display::fmt` itself; never sent here.
            Warning::MemlockBelowGlommioMinimum { .. }
            | Warning::MemlockBelowRegisteredBuffers { .. }
            | Warning::NofileBelowConnections { .. }
            | Warning::ThpAlways
            | Warning::SomaxconnBelowBacklog { .. }
            | Warning::SynBacklogBelowBacklog { .. } => f.write_str(self.name()),
        }
    }
}

/// Compares the host with the configuration's needs. Pure: every input is an argument.
pub fn check(facts: &Facts, needs: &Needs) -> Vec<Warning> {
    let mut warnings = Vec::new();
    check_memlock(facts, needs, &mut warnings);
    check_nofile(facts, needs, &mut warnings);
    check_cpus(facts, needs, &mut warnings);
    if facts.thp == Some(ThpMode::Always) {
        warnings.push(Warning::ThpAlways);
    }
    check_backlog(facts, needs, &mut warnings);
    warnings
}

fn check_memlock(facts: &Facts, needs: &Needs, warnings: &mut Vec<Warning>) {
    let Some(Limit { soft: Some(soft_bytes), .. }) = facts.memlock else { return };
    if soft_bytes < GLOMMIO_MEMLOCK_MIN_BYTES {
        warnings.push(Warning::MemlockBelowGlommioMinimum { soft_bytes });
        return;
    }
    // With CAP_IPC_LOCK (root in the initial namespace) io_uring charges nothing; when the
    // capability is unknown, assume it is missing (the common case for a service user).
    let needed_bytes = needs.memlock_bytes(facts.thp);
    if facts.ipc_lock != Some(true) && soft_bytes < needed_bytes {
        warnings.push(Warning::MemlockBelowRegisteredBuffers { soft_bytes, needed_bytes });
    }
}

fn check_nofile(facts: &Facts, needs: &Needs, warnings: &mut Vec<Warning>) {
    if let Some(warning) = fit_connections(facts, needs) {
        warnings.push(warning);
    }
}

/// The one nofile finding: `Some` when the soft open-file limit cannot hold every shard full
/// of connections; its `per_shard_max` is the bound that fits, which [`warn_about_host`]
/// applies. Pure.
pub fn fit_connections(facts: &Facts, needs: &Needs) -> Option<Warning> {
    let Some(Limit { soft: Some(soft), hard }) = facts.nofile else { return None };
    let needed = needs.nofile();
    (soft < needed).then(|| Warning::NofileBelowConnections {
        soft,
        hard,
        needed,
        per_shard_max: needs.connections_per_shard_fitting(soft),
    })
}

fn check_cpus(facts: &Facts, needs: &Needs, warnings: &mut Vec<Warning>) {
    if let Some(allowed) = &facts.allowed_cpus {
        if needs.shards > allowed.len() {
            warnings.push(Warning::ShardsExceedAllowedCpus {
                shards: needs.shards,
                allowed: allowed.clone(),
            });
        }
    }
    let isolated = facts.isolated_cpus.as_deref().unwrap_or(&[]);
    if needs.pinned_cpus.is_empty() {
        if !isolated.is_empty() {
            warnings.push(Warning::UnpinnedWithIsolatedCpus { isolated: isolated.to_vec() });
        }
        return;
    }
    if let Some(online) = &facts.online_cpus {
        let offline = missing_from(&needs.pinned_cpus, online);
        if !offline.is_empty() {
            warnings.push(Warning::PinsOffline { cpus: offline, online: online.clone() });
        }
    }
    if let Some(allowed) = &facts.allowed_cpus {
        let outside = missing_from(&needs.pinned_cpus, allowed);
        if !outside.is_empty() {
            warnings.push(Warning::PinsOutsideAllowed { cpus: outside, allowed: allowed.clone() });
        }
    }
    match &facts.isolated_cpus {
        Some(isolated) if !isolated.is_empty() => {
            let shared = missing_from(&needs.pinned_cpus, isolated);
            if !shared.is_empty() {
                warnings
                    .push(Warning::PinsNotIsolated { cpus: shared, isolated: isolated.clone() });
            }
        }
        Some(_) => {
            warnings.push(Warning::PinnedWithoutIsolation { cpus: needs.pinned_cpus.clone() })
        }
        None => {}
    }
}

fn check_backlog(facts: &Facts, needs: &Needs, warnings: &mut Vec<Warning>) {
    let backlog = needs.listen_backlog;
    if let Some(somaxconn) = facts.somaxconn {
        if somaxconn < backlog {
            warnings.push(Warning::SomaxconnBelowBacklog { somaxconn, backlog });
        }
    }
    if let Some(tcp_max_syn_backlog) = facts.tcp_max_syn_backlog {
        if tcp_max_syn_backlog < backlog {
            warnings.push(Warning::SynBacklogBelowBacklog { tcp_max_syn_backlog, backlog });
        }
    }
}

/// The members of `wanted` that are not in `set`, in order.
fn missing_from(wanted: &[usize], set: &[usize]) -> Vec<usize> {
    wanted.iter().copied().filter(|cpu| !set.contains(cpu)).collect()
}

/// Formats a CPU list the way the kernel does (`0-3,8`).
struct CpuList<'a>(&'a [usize]);

impl fmt::Display for CpuList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        let mut first = true;
        let mut i = 0;
        while i < self.0.len() {
            let start = self.0[i];
            let mut end = start;
            while i + 1 < self.0.len() && self.0[i + 1] == end + 1 {
                i += 1;
                end = self.0[i];
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if start == end {
                write!(f, "{start}")?;
            } else {
                write!(f, "{start}-{end}")?;
            }
            i += 1;
        }
        Ok(())
    }
}

// ---- parsers of the kernel's text formats (pure) -------------------------------------------

/// Parses a kernel CPU list (`0-3,8,10-11`; empty or blank: no CPUs). `None` if malformed.
pub fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let text = text.trim();
    let mut cpus = Vec::new();
    if text.is_empty() {
        return Some(cpus);
    }
    for part in text.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                // A bound on what a range may claim keeps a corrupt file from allocating.
                if b < a || b - a > 65_536 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    Some(cpus)
}

/// Reads one limit from `/proc/self/limits` (`name` as the file spells it, e.g.
/// `Max locked memory`).
pub fn parse_limit(limits: &str, name: &str) -> Option<Limit> {
    let line = limits.lines().find(|l| l.starts_with(name))?;
    let mut fields = line[name.len()..].split_whitespace();
    let value = |field: Option<&str>| -> Option<Option<u64>> {
        match field? {
            "unlimited" => Some(None),
            number => number.parse().ok().map(Some),
        }
    };
    let soft = value(fields.next())?;
    let hard = value(fields.next())?;
    Some(Limit { soft, hard })
}

/// The bracketed choice of `/sys/kernel/mm/transparent_hugepage/enabled`.
pub fn parse_thp(text: &str) -> Option<ThpMode> {
    let start = text.find('[')?;
    let end = text[start..].find(']')? + start;
    match &text[start + 1..end] {
        "always" => Some(ThpMode::Always),
        "madvise" => Some(ThpMode::Madvise),
        "never" => Some(ThpMode::Never),
        _ => None,
    }
}

/// A `Key:\tvalue` field of `/proc/self/status`.
pub fn status_field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == key).then_some(v.trim())
    })
}

/// Whether the hex `CapEff` mask of `/proc/self/status` holds `CAP_IPC_LOCK`.
pub fn parse_ipc_lock(cap_eff_hex: &str) -> Option<bool> {
    let mask = u64::from_str_radix(cap_eff_hex.trim(), 16).ok()?;
    Some(mask & (1 << CAP_IPC_LOCK_BIT) != 0)
}

// ---- the I/O shell -------------------------------------------------------------------------

/// Reads the facts from `/proc` and `/sys`; what cannot be read stays `None`.
pub fn read_facts() -> Facts {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let limits = read("/proc/self/limits");
    let status = read("/proc/self/status");
    let status_cpus = status.as_deref().and_then(|s| status_field(s, "Cpus_allowed_list"));
    let cap_eff = status.as_deref().and_then(|s| status_field(s, "CapEff"));
    let number = |path: &str| read(path).and_then(|t| t.trim().parse().ok());
    Facts {
        memlock: limits.as_deref().and_then(|l| parse_limit(l, "Max locked memory")),
        nofile: limits.as_deref().and_then(|l| parse_limit(l, "Max open files")),
        ipc_lock: cap_eff.and_then(parse_ipc_lock),
        online_cpus: read("/sys/devices/system/cpu/online").and_then(|t| parse_cpu_list(&t)),
        allowed_cpus: status_cpus.and_then(parse_cpu_list),
        isolated_cpus: read("/sys/devices/system/cpu/isolated").and_then(|t| parse_cpu_list(&t)),
        thp: read("/sys/kernel/mm/transparent_hugepage/enabled").and_then(|t| parse_thp(&t)),
        somaxconn: number("/proc/sys/net/core/somaxconn"),
        tcp_max_syn_backlog: number("/proc/sys/net/ipv4/tcp_max_syn_backlog"),
    }
}

/// Logs each warning once, with its stable name.
pub fn log_warnings(warnings: &[Warning]) {
    for warning in warnings {
        tracing::warn!(check = warning.name(), "host tuning: {warning}");
    }
}

/// The CPU of each pinned shard: the `i`-th CPU the process may run on (systemd's
/// `CPUAffinity=`, `taskset`), so a mask that leaves CPU 0 to the system is respected; it
/// wraps around when there are more shards than allowed CPUs (the start-up check warns), and
/// is CPU `i` when the mask is unknown.
pub fn shard_cpus(shards: usize, allowed: Option<&[usize]>) -> Vec<usize> {
    match allowed {
        Some(cpus) if !cpus.is_empty() => (0..shards).map(|i| cpus[i % cpus.len()]).collect(),
        _ => (0..shards).collect(),
    }
}

/// The CPUs this process may run on (`Cpus_allowed_list` of `/proc/self/status`).
pub fn allowed_cpus() -> Option<Vec<usize>> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status_field(&status, "Cpus_allowed_list").and_then(parse_cpu_list)
}

/// Reads the host's facts, checks them against what `needs` (built from the facts' allowed
/// CPUs) asks for, logs one line per problem, and lowers `per_shard_max` / `per_address_max`
/// to what the open-file limit holds. `serve::check_host` is its one caller.
pub fn warn_about_host(
    needs: impl FnOnce(Option<&[usize]>) -> Needs,
    per_shard_max: &mut usize,
    per_address_max: &mut usize,
) -> Vec<Warning> {
    let facts = read_facts();
    let warnings = check(&facts, &needs(facts.allowed_cpus.as_deref()));
    lower_connection_bounds(&warnings, per_shard_max, per_address_max);
    log_warnings(&warnings);
    warnings
}

/// Applies a [`Warning::NofileBelowConnections`] to the connection bounds (the per-address
/// cap never above the per-shard one).
pub fn lower_connection_bounds(
    warnings: &[Warning],
    per_shard_max: &mut usize,
    per_address_max: &mut usize,
) {
    for warning in warnings {
        if let Warning::NofileBelowConnections { per_shard_max: fitting, .. } = warning {
            let fitting = usize::try_from(*fitting).unwrap_or(usize::MAX);
            *per_shard_max = (*per_shard_max).min(fitting);
            *per_address_max = (*per_address_max).min(*per_shard_max);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    /// A well-tuned host: 8 CPUs, 1-7 isolated, generous limits.
    fn tuned() -> Facts {
        Facts {
            memlock: Some(Limit { soft: Some(1024 * MIB), hard: Some(1024 * MIB) }),
            nofile: Some(Limit { soft: Some(1 << 20), hard: Some(1 << 20) }),
            ipc_lock: Some(false),
            online_cpus: Some((0..8).collect()),
            allowed_cpus: Some((0..8).collect()),
            isolated_cpus: Some((1..8).collect()),
            thp: Some(ThpMode::Madvise),
            somaxconn: Some(4096),
            tcp_max_syn_backlog: Some(4096),
        }
    }

    fn needs(shards: usize, pinned_cpus: Vec<usize>) -> Needs {
        Needs {
            shards,
            pinned_cpus,
            io_memory_bytes: MIB,
            listen_backlog: GLOMMIO_LISTEN_BACKLOG,
            connections_per_shard_max: 16_384,
            admin_connections_max: 64,
        }
    }

    #[test]
    fn a_tuned_host_with_shards_on_isolated_cpus_has_no_warnings() {
        let facts = tuned();
        assert_eq!(check(&facts, &needs(7, (1..8).collect())), vec![]);
        // Unknown facts are skipped, never guessed.
        assert_eq!(check(&Facts::default(), &needs(64, (0..64).collect())), vec![]);
    }

    #[test]
    fn memlock_below_glommio_minimum_is_reported_alone() {
        let mut facts = tuned();
        facts.memlock = Some(Limit { soft: Some(64 * 1024), hard: Some(MIB) });
        let w = check(&facts, &needs(7, (1..8).collect()));
        assert_eq!(w, vec![Warning::MemlockBelowGlommioMinimum { soft_bytes: 64 * 1024 }]);
        assert!(w[0].to_string().contains("fail to start"), "{}", w[0]);
        // Exactly at the minimum glommio starts.
        facts.memlock = Some(Limit { soft: Some(GLOMMIO_MEMLOCK_MIN_BYTES), hard: None });
        facts.ipc_lock = Some(true);
        assert_eq!(check(&facts, &needs(7, (1..8).collect())), vec![]);
    }

    #[test]
    fn memlock_for_buffer_registration_counts_three_rings_per_shard_unless_ipc_lock() {
        // The measured case: 3 shards of 1 MiB under 8 MiB with THP off fail the third
        // shard's registration (9 MiB), 2 shards fit (6 MiB).
        let mut facts = tuned();
        facts.thp = Some(ThpMode::Never);
        facts.memlock = Some(Limit { soft: Some(8 * MIB), hard: Some(8 * MIB) });
        assert_eq!(needs(2, vec![]).memlock_bytes(facts.thp), 6 * MIB);
        let n = needs(3, vec![1, 2, 3]);
        assert_eq!(
            check(&facts, &n),
            vec![Warning::MemlockBelowRegisteredBuffers {
                soft_bytes: 8 * MIB,
                needed_bytes: 9 * MIB
            }]
        );
        facts.ipc_lock = None;
        assert_eq!(check(&facts, &n).len(), 1, "unknown capability counts as missing");
        facts.ipc_lock = Some(true);
        assert_eq!(check(&facts, &n), vec![]);
        // Unlimited soft limit: nothing to say.
        facts.ipc_lock = Some(false);
        facts.memlock = Some(Limit { soft: None, hard: None });
        assert_eq!(check(&facts, &n), vec![]);
        // glommio's floor: at least 64 KiB per executor, rounded up to pages.
        let tiny = Needs { io_memory_bytes: 1, ..needs(2, vec![]) };
        assert_eq!(tiny.memlock_bytes(Some(ThpMode::Never)), 2 * 3 * 64 * 1024);
        let odd = Needs { io_memory_bytes: 100_000, ..needs(1, vec![]) };
        assert_eq!(odd.memlock_bytes(Some(ThpMode::Never)), 3 * 102_400);
    }

    #[test]
    fn huge_pages_charge_whole_pages_so_the_need_is_the_worst_straddle() {
        // 1 MiB may straddle two 2 MiB pages: 4 MiB per ring, 12 MiB per shard (measured:
        // one shard failed to register under 8 MiB with THP `madvise`).
        let one = needs(1, vec![]);
        assert_eq!(one.memlock_bytes(Some(ThpMode::Madvise)), 12 * MIB);
        assert_eq!(one.memlock_bytes(Some(ThpMode::Always)), 12 * MIB);
        assert_eq!(one.memlock_bytes(None), 12 * MIB, "unknown THP: assume enabled");
        let big = Needs { io_memory_bytes: 3 * MIB, ..needs(1, vec![]) };
        assert_eq!(big.memlock_bytes(Some(ThpMode::Madvise)), 3 * 6 * MIB);
        let mut facts = tuned();
        facts.memlock = Some(Limit { soft: Some(8 * MIB), hard: Some(8 * MIB) });
        assert_eq!(
            check(&facts, &needs(1, vec![1])),
            vec![Warning::MemlockBelowRegisteredBuffers {
                soft_bytes: 8 * MIB,
                needed_bytes: 12 * MIB
            }]
        );
    }

    #[test]
    fn nofile_must_cover_every_shard_full_of_connections_or_the_bound_is_lowered() {
        let mut facts = tuned();
        // This machine's default: 20,000 < 2 x 16,384 + 64 + 256.
        facts.nofile = Some(Limit { soft: Some(20_000), hard: Some(20_000) });
        let w = check(&facts, &needs(2, vec![1, 2]));
        let needed = 2 * 16_384 + 64 + FDS_RESERVED;
        let per_shard_max = (20_000 - 64 - FDS_RESERVED) / 2;
        assert_eq!(
            w,
            vec![Warning::NofileBelowConnections {
                soft: 20_000,
                hard: Some(20_000),
                needed,
                per_shard_max
            }]
        );
        assert!(w[0].to_string().contains("lowered to 9840"), "{}", w[0]);
        // What it lowers fits exactly.
        let fitted = Needs { connections_per_shard_max: per_shard_max, ..needs(2, vec![1, 2]) };
        assert!(fitted.nofile() <= 20_000);
        let one_more = Needs { connections_per_shard_max: per_shard_max + 1, ..fitted.clone() };
        assert!(one_more.nofile() > 20_000);
        let (mut per_shard, mut per_address) = (16_384, 16_384);
        lower_connection_bounds(&w, &mut per_shard, &mut per_address);
        assert_eq!(per_shard, 9_840);
        assert_eq!(per_address, 9_840, "the per-address cap follows");
        // A tiny limit (the attack's 600) still leaves one connection per shard at least.
        facts.nofile = Some(Limit { soft: Some(600), hard: Some(600) });
        let w = check(&facts, &needs(2, vec![1, 2]));
        assert!(matches!(w[..], [Warning::NofileBelowConnections { per_shard_max: 140, .. }]));
        facts.nofile = Some(Limit { soft: Some(100), hard: Some(100) });
        let w = check(&facts, &needs(2, vec![1, 2]));
        assert!(matches!(w[..], [Warning::NofileBelowConnections { per_shard_max: 1, .. }]));
        // Enough, or unlimited: nothing to say, nothing lowered.
        facts.nofile = Some(Limit { soft: Some(needed), hard: None });
        assert_eq!(check(&facts, &needs(2, vec![1, 2])), vec![]);
        facts.nofile = Some(Limit { soft: None, hard: None });
        assert_eq!(check(&facts, &needs(2, vec![1, 2])), vec![]);
    }

    #[test]
    fn more_shards_than_allowed_cpus_share_cores() {
        let mut facts = tuned();
        facts.allowed_cpus = Some(vec![0, 1]);
        facts.isolated_cpus = Some(vec![]);
        let w = check(&facts, &needs(3, vec![]));
        assert_eq!(w, vec![Warning::ShardsExceedAllowedCpus { shards: 3, allowed: vec![0, 1] }]);
        assert!(w[0].to_string().contains("at most 2"), "{}", w[0]);
    }

    #[test]
    fn pins_offline_or_outside_the_affinity_mask_are_named() {
        let mut facts = tuned();
        facts.online_cpus = Some(vec![0, 1]);
        facts.allowed_cpus = Some(vec![1]);
        facts.isolated_cpus = Some(vec![1]);
        let w = check(&facts, &needs(3, vec![0, 1, 2]));
        assert_eq!(
            w,
            vec![
                Warning::ShardsExceedAllowedCpus { shards: 3, allowed: vec![1] },
                Warning::PinsOffline { cpus: vec![2], online: vec![0, 1] },
                Warning::PinsOutsideAllowed { cpus: vec![0, 2], allowed: vec![1] },
                Warning::PinsNotIsolated { cpus: vec![0, 2], isolated: vec![1] },
            ]
        );
    }

    #[test]
    fn systemd_cpu_affinity_that_skips_cpu_0_is_respected_by_pin_per_core() {
        // CPUAffinity=1-3 and FLASHSALE_SHARDS unset: available_parallelism gives 3 shards,
        // which serve pins to the allowed CPUs 1, 2, 3 (no warning).
        let mut facts = tuned();
        facts.allowed_cpus = Some(vec![1, 2, 3]);
        facts.isolated_cpus = Some(vec![1, 2, 3]);
        let pinned = shard_cpus(3, facts.allowed_cpus.as_deref());
        assert_eq!(pinned, vec![1, 2, 3]);
        assert_eq!(check(&facts, &needs(3, pinned)), vec![]);
        // Pins outside the mask (not produced by shard_cpus) are still caught.
        let w = check(&facts, &needs(3, vec![0, 1, 2]));
        assert_eq!(
            w,
            vec![
                Warning::PinsOutsideAllowed { cpus: vec![0], allowed: vec![1, 2, 3] },
                Warning::PinsNotIsolated { cpus: vec![0], isolated: vec![1, 2, 3] },
            ]
        );
        assert!(w[0].to_string().contains("CPUs 0 outside"), "{}", w[0]);
    }

    #[test]
    fn isolation_mismatches_in_both_directions() {
        let mut facts = tuned();
        // Unpinned shards never reach isolated CPUs.
        let w = check(&facts, &needs(2, vec![]));
        assert_eq!(w, vec![Warning::UnpinnedWithIsolatedCpus { isolated: (1..8).collect() }]);
        assert!(w[0].to_string().contains("CPUs 1-7"), "{}", w[0]);
        // Pinned on a host without isolation.
        facts.isolated_cpus = Some(vec![]);
        assert_eq!(
            check(&facts, &needs(2, vec![0, 1])),
            vec![Warning::PinnedWithoutIsolation { cpus: vec![0, 1] }]
        );
        // Unpinned on a host without isolation: the dev/CI setting, nothing to say.
        assert_eq!(check(&facts, &needs(2, vec![])), vec![]);
    }

    #[test]
    fn thp_always_warns_and_madvise_or_never_do_not() {
        let mut facts = tuned();
        let n = needs(7, (1..8).collect());
        facts.thp = Some(ThpMode::Always);
        assert_eq!(check(&facts, &n), vec![Warning::ThpAlways]);
        for mode in [ThpMode::Madvise, ThpMode::Never] {
            facts.thp = Some(mode);
            assert_eq!(check(&facts, &n), vec![]);
        }
    }

    #[test]
    fn backlog_caps_below_glommios_1024() {
        let mut facts = tuned();
        facts.somaxconn = Some(128);
        facts.tcp_max_syn_backlog = Some(512);
        let n = needs(7, (1..8).collect());
        assert_eq!(
            check(&facts, &n),
            vec![
                Warning::SomaxconnBelowBacklog { somaxconn: 128, backlog: 1024 },
                Warning::SynBacklogBelowBacklog { tcp_max_syn_backlog: 512, backlog: 1024 },
            ]
        );
        facts.somaxconn = Some(1024);
        facts.tcp_max_syn_backlog = Some(1024);
        assert_eq!(check(&facts, &n), vec![]);
    }

    #[test]
    fn every_warning_has_a_distinct_name() {
        let all = [
            Warning::MemlockBelowGlommioMinimum { soft_bytes: 0 },
            Warning::MemlockBelowRegisteredBuffers { soft_bytes: 0, needed_bytes: 1 },
            Warning::NofileBelowConnections { soft: 0, hard: None, needed: 1, per_shard_max: 1 },
            Warning::ShardsExceedAllowedCpus { shards: 2, allowed: vec![0] },
            Warning::PinsOffline { cpus: vec![2], online: vec![0] },
            Warning::PinsOutsideAllowed { cpus: vec![0], allowed: vec![1] },
            Warning::PinsNotIsolated { cpus: vec![0], isolated: vec![1] },
            Warning::UnpinnedWithIsolatedCpus { isolated: vec![1] },
            Warning::PinnedWithoutIsolation { cpus: vec![0] },
            Warning::ThpAlways,
            Warning::SomaxconnBelowBacklog { somaxconn: 1, backlog: 2 },
            Warning::SynBacklogBelowBacklog { tcp_max_syn_backlog: 1, backlog: 2 },
        ];
        let mut names: Vec<_> = all.iter().map(Warning::name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
        assert!(all.iter().all(|w| !w.to_string().is_empty()));
    }

    #[test]
    fn cpu_lists_parse_and_print_like_the_kernel() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list("\n"), Some(vec![]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("0-x"), None);
        assert_eq!(parse_cpu_list("0-99999999"), None);
        assert_eq!(CpuList(&[0, 1, 2, 3, 8, 10, 11]).to_string(), "0-3,8,10-11");
        assert_eq!(CpuList(&[]).to_string(), "none");
        assert_eq!(CpuList(&[4]).to_string(), "4");
    }

    #[test]
    fn proc_limits_status_and_thp_parse() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            20000                40000                files     \n\
                      Max locked memory         8388608              unlimited            bytes     \n";
        assert_eq!(
            parse_limit(limits, "Max locked memory"),
            Some(Limit { soft: Some(8 * MIB), hard: None })
        );
        assert_eq!(
            parse_limit(limits, "Max open files"),
            Some(Limit { soft: Some(20_000), hard: Some(40_000) })
        );
        assert_eq!(parse_limit(limits, "Max processes"), None);
        let status = "Name:\tflashsale\nCapEff:\t000001fffeffffff\nCpus_allowed_list:\t0-1\n";
        assert_eq!(status_field(status, "Cpus_allowed_list"), Some("0-1"));
        assert_eq!(status_field(status, "CapEff").and_then(parse_ipc_lock), Some(true));
        assert_eq!(parse_ipc_lock("0000000000000000"), Some(false));
        assert_eq!(parse_ipc_lock("zz"), None);
        assert_eq!(parse_thp("always [madvise] never\n"), Some(ThpMode::Madvise));
        assert_eq!(parse_thp("[always] madvise never"), Some(ThpMode::Always));
        assert_eq!(parse_thp("always madvise [never]"), Some(ThpMode::Never));
        assert_eq!(parse_thp("always madvise never"), None);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn facts_read_from_this_host_are_consistent() {
        // A real read: on Linux every one of these files exists and parses.
        let facts = read_facts();
        let online = facts.online_cpus.expect("/sys/devices/system/cpu/online");
        let allowed = facts.allowed_cpus.expect("Cpus_allowed_list");
        assert!(!allowed.is_empty());
        assert!(allowed.iter().all(|c| online.contains(c)), "{allowed:?} not within {online:?}");
        assert!(facts.isolated_cpus.is_some(), "/sys/devices/system/cpu/isolated");
        assert!(facts.ipc_lock.is_some(), "CapEff");
        assert!(facts.somaxconn.is_some_and(|n| n > 0));
        let Some(Limit { soft, hard }) = facts.nofile else { panic!("Max open files") };
        assert!(soft.unwrap_or(u64::MAX) <= hard.unwrap_or(u64::MAX));
        assert!(facts.memlock.is_some(), "Max locked memory");
    }

    #[test]
    fn shards_take_the_allowed_cpus_in_order() {
        assert_eq!(shard_cpus(3, Some(&[2, 3, 5, 7])), vec![2, 3, 5]);
        assert_eq!(shard_cpus(3, Some(&[4, 6])), vec![4, 6, 4], "wraps (and is warned about)");
        assert_eq!(shard_cpus(2, None), vec![0, 1]);
        assert_eq!(shard_cpus(2, Some(&[])), vec![0, 1]);
    }
}
