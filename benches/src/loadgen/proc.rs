//! Process figures from `/proc` (Linux): CPU time of a process (the generator itself, or the
//! server under test with `--server-pid`) and its resident memory (`VmRSS`, and the peak,
//! `VmHWM`). Used by the rate search (`search.rs`) to show which side was the limit and
//! whether memory stays bounded.
//!
//! Parsing is sans-I/O ([`parse_cpu_ticks`], [`parse_status_kb`]); [`sample`] reads the files.
//! CPU times in `/proc/PID/stat` are in USER_HZ ticks (`flashsale_engine::app::cpu`, which
//! parses the stat line for this module too).
//!
//! What it is not: a profiler; nothing here runs on the request path.

/// Ticks of `utime`/`stime` per second (USER_HZ).
pub const TICKS_PER_S: f64 = flashsale_engine::app::cpu::TICKS_PER_S as f64;

/// One reading of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcSample {
    /// User + system CPU time, in USER_HZ ticks, all threads.
    pub cpu_ticks: u64,
    /// Resident set now, KiB.
    pub vm_rss_kb: u64,
    /// Peak resident set since the process started, KiB.
    pub vm_hwm_kb: u64,
}

/// Reads `/proc/{pid}/stat` and `/proc/{pid}/status` (`pid` a number or `self`); `None` when
/// the process is gone or the files do not parse.
pub fn sample(pid: &str) -> Option<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(ProcSample {
        cpu_ticks: parse_cpu_ticks(&stat)?,
        vm_rss_kb: parse_status_kb(&status, "VmRSS")?,
        vm_hwm_kb: parse_status_kb(&status, "VmHWM")?,
    })
}

/// Cores used between two samples taken `wall_s` apart (1.0 = one core busy throughout).
pub fn cores_used(before: &ProcSample, after: &ProcSample, wall_s: f64) -> f64 {
    if wall_s <= 0.0 {
        return 0.0;
    }
    after.cpu_ticks.saturating_sub(before.cpu_ticks) as f64 / TICKS_PER_S / wall_s
}

/// `utime + stime` (fields 14 and 15) of a `/proc/PID/stat` line
/// (`flashsale_engine::app::cpu::parse_stat`, which counts fields after the LAST `)`).
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    flashsale_engine::app::cpu::parse_stat(stat).map(|(_, times)| times.own)
}

/// The KiB value of a `Name:   1234 kB` line of `/proc/PID/status`.
pub fn parse_status_kb(status: &str, name: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_and_status_parse() {
        let stat = "4242 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 1234 567 0 0 20 0 9 0 100 200 300";
        assert_eq!(parse_cpu_ticks(stat), Some(1234 + 567));
        assert_eq!(parse_cpu_ticks("garbage"), None);
        let status = "Name:\tx\nVmHWM:\t  20480 kB\nVmRSS:\t   10240 kB\n";
        assert_eq!(parse_status_kb(status, "VmHWM"), Some(20_480));
        assert_eq!(parse_status_kb(status, "VmRSS"), Some(10_240));
        assert_eq!(parse_status_kb(status, "VmSwap"), None);
        let a = ProcSample { cpu_ticks: 100, vm_rss_kb: 0, vm_hwm_kb: 0 };
        let b = ProcSample { cpu_ticks: 300, ..a };
        assert!((cores_used(&a, &b, 2.0) - 1.0).abs() < 1e-9);
        // This process can be read.
        let me = sample("self").unwrap();
        assert!(me.vm_hwm_kb >= me.vm_rss_kb && me.vm_rss_kb > 0);
    }
}
