//! CPU time of processes from `/proc` (Linux): a process's own `utime + stime`, a PostgreSQL
//! server's (the postmaster, every live child — backends, WAL writer, checkpointer,
//! autovacuum — and the postmaster's `cutime + cstime` for the children that exited), and
//! the threads of a process by name. `flashsale demo` (its CPU table, `demo_cpu.rs`) and the
//! `order_pipeline` bench read CPU through here.
//!
//! Parsing is sans-I/O ([`parse_stat`]); the `read_*` / `*_ticks` functions read the files.
//! Times are in USER_HZ ticks, which the kernel ABI fixes at 100 per second on every
//! architecture this runs on ([`TICKS_PER_S`]; `sysconf(_SC_CLK_TCK)` would need `unsafe`).
//!
//! Phase arithmetic: a phase's CPU is the difference of a process's cumulative ticks at its
//! two ends. The readings come from a sampling thread (every 100 ms); [`ticks_at`]
//! interpolates linearly between the two readings around a moment, so a boundary that falls
//! between samples costs the error of a straight line over one interval, not the interval.
//!
//! What it is not: a profiler; nothing here runs on the request path.

use std::path::Path;

/// Ticks of `utime`/`stime` per second (USER_HZ).
pub const TICKS_PER_S: u64 = 100;
/// Microseconds of CPU per tick.
pub const US_PER_TICK: u64 = 1_000_000 / TICKS_PER_S;

/// The CPU fields of one `/proc/PID/stat` (or `/proc/PID/task/TID/stat`) line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatTimes {
    /// Field 4.
    pub ppid: u32,
    /// `utime + stime` (fields 14 and 15): this process, all its threads (also those that
    /// exited); for a task file, that thread alone.
    pub own: u64,
    /// `cutime + cstime` (fields 16 and 17): children that exited and were waited for.
    pub reaped: u64,
}

/// The command name (field 2, without its parentheses) and the CPU fields of a stat line.
/// The name may itself contain spaces and parentheses, so the fields are counted after the
/// LAST `)`.
pub fn parse_stat(stat: &str) -> Option<(&str, StatTimes)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?;
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let unsigned = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
    // cutime and cstime are `long` in the kernel's format: never negative in practice.
    let signed = |i: usize| fields.get(i).and_then(|v| v.parse::<i64>().ok()).map(|v| v.max(0));
    // After the name: state (field 3) is index 0, ppid (4) index 1, utime (14) index 11,
    // stime (15) 12, cutime (16) 13, cstime (17) 14.
    let times = StatTimes {
        ppid: u32::try_from(unsigned(1)?).ok()?,
        own: unsigned(11)? + unsigned(12)?,
        reaped: (signed(13)? + signed(14)?) as u64,
    };
    Some((comm, times))
}

/// The CPU fields of `/proc/{pid}/stat` (`pid` a number or `self`); `None` when the process
/// is gone or the file does not parse.
pub fn read_stat(pid: &str) -> Option<StatTimes> {
    read_stat_file(&Path::new("/proc").join(pid).join("stat")).map(|(_, times)| times)
}

fn read_stat_file(path: &Path) -> Option<(String, StatTimes)> {
    let text = std::fs::read_to_string(path).ok()?;
    parse_stat(&text).map(|(comm, times)| (comm.to_owned(), times))
}

/// `utime + stime` of process `pid`, all threads.
pub fn process_ticks(pid: u32) -> Option<u64> {
    read_stat(&pid.to_string()).map(|t| t.own)
}

/// `utime + stime` of this process.
pub fn self_ticks() -> u64 {
    read_stat("self").map_or(0, |t| t.own)
}

/// CPU ticks of the postmaster `pid` and its live children, plus what its exited children
/// left (its `cutime + cstime`); `None` when the postmaster is gone.
pub fn postgres_ticks(pid: u32) -> Option<u64> {
    let postmaster = read_stat(&pid.to_string())?;
    let children = children_of(pid);
    let own: u64 = children.iter().filter_map(|c| read_stat(&c.to_string())).map(|t| t.own).sum();
    Some(postmaster.own + postmaster.reaped + own)
}

/// The children of process `pid`: `/proc/PID/task/*/children` where the kernel has it (a
/// small read per thread — one for the single-threaded postmaster — instead of every
/// `/proc/*/stat`), else every process whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"));
    let listed: Option<Vec<u32>> = tasks.ok().and_then(|tasks| {
        let mut children = Vec::new();
        for task in tasks.flatten() {
            let text = std::fs::read_to_string(task.path().join("children")).ok()?;
            children.extend(text.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
        }
        Some(children)
    });
    if let Some(children) = listed {
        return children;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| read_stat(&child.to_string()).is_some_and(|t| t.ppid == pid))
        .collect()
}

/// `(thread name, utime + stime)` of every live thread of `pid` (`/proc/PID/task/TID/stat`;
/// names are at most 15 bytes, as the kernel keeps them). Threads that exited are missing
/// here but counted in the process's own total.
pub fn thread_ticks(pid: &str) -> Vec<(String, u64)> {
    let Ok(tasks) = std::fs::read_dir(Path::new("/proc").join(pid).join("task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| read_stat_file(&task.path().join("stat")))
        .map(|(name, times)| (name, times.own))
        .collect()
}

/// One cumulative reading of a process: ticks at a moment (µs on a clock the caller keeps,
/// e.g. since the Unix epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    pub at_us: u64,
    pub ticks: u64,
}

/// Cumulative ticks at `at_us`, linear between the readings around it (sorted by time);
/// before the first or after the last reading, that reading's value. `None` without
/// readings.
pub fn ticks_at(readings: &[Reading], at_us: u64) -> Option<f64> {
    let after = readings.partition_point(|r| r.at_us <= at_us);
    match (after.checked_sub(1).map(|i| readings[i]), readings.get(after).copied()) {
        (None, None) => None,
        (Some(only), None) | (None, Some(only)) => Some(only.ticks as f64),
        (Some(a), Some(b)) => {
            let span = (b.at_us - a.at_us) as f64;
            let share = (at_us - a.at_us) as f64 / span;
            Some(a.ticks as f64 + (b.ticks as f64 - a.ticks as f64) * share)
        }
    }
}

/// CPU microseconds between `from_us` and `to_us` (never negative: a process that was
/// restarted mid-phase, and so lost its count, counts 0 rather than a negative amount).
pub fn cpu_us_between(readings: &[Reading], from_us: u64, to_us: u64) -> Option<f64> {
    let from = ticks_at(readings, from_us)?;
    let to = ticks_at(readings, to_us)?;
    Some(((to - from) * US_PER_TICK as f64).max(0.0))
}

/// `cpu_us / count`, `None` for no items (a phase that did not happen).
pub fn per_item(cpu_us: Option<f64>, count: u64) -> Option<f64> {
    (count > 0).then_some(cpu_us? / count as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_after_the_last_parenthesis() {
        // Fields: pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt
        // cmajflt utime stime cutime cstime ...
        let stat = "4242 (a (b) c) S 17 2 3 4 5 6 7 8 9 10 1234 567 89 11 20 0 9 0 100 200";
        let (comm, times) = parse_stat(stat).unwrap();
        assert_eq!(comm, "a (b) c");
        assert_eq!(times, StatTimes { ppid: 17, own: 1234 + 567, reaped: 89 + 11 });
        let spaced = "7 (postgres: walwriter ) R 1 7 7 0 -1 4194368 1 0 0 0 3 4 0 0 20 0 1 0";
        let (comm, times) = parse_stat(spaced).unwrap();
        assert_eq!((comm, times.own, times.reaped, times.ppid), ("postgres: walwriter ", 7, 0, 1));
        let cut_short = "7 (x) R 1 7 7 0 -1 4194368 1 0 0 0 3";
        assert_eq!(parse_stat(cut_short), None);
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat(") ("), None);
    }

    #[test]
    fn this_process_and_its_threads_can_be_read() {
        let me = read_stat("self").unwrap();
        assert!(me.ppid > 0);
        let threads = thread_ticks("self");
        assert!(!threads.is_empty());
        assert!(process_ticks(std::process::id()).is_some());
        assert_eq!(postgres_ticks(u32::MAX), None);
        // A child of ours is found (through either way of listing children).
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let me = std::process::id();
        assert!(children_of(me).contains(&child.id()), "{:?}", children_of(me));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn phase_cpu_is_interpolated_between_samples() {
        let r = |at_us, ticks| Reading { at_us, ticks };
        // 100 ms apart, 5 ticks (50 ms of CPU) per interval, then idle.
        let readings = [r(1_000_000, 10), r(1_100_000, 15), r(1_200_000, 20), r(1_300_000, 20)];
        assert_eq!(ticks_at(&readings, 1_100_000), Some(15.0));
        assert_eq!(ticks_at(&readings, 1_150_000), Some(17.5));
        // Outside the readings: the nearest one.
        assert_eq!(ticks_at(&readings, 0), Some(10.0));
        assert_eq!(ticks_at(&readings, 9_000_000), Some(20.0));
        assert_eq!(ticks_at(&[], 5), None);
        // Selling from 1.05 s to 1.15 s: 5 ticks = 50,000 µs; 2,000 units = 25 µs/unit.
        let selling = cpu_us_between(&readings, 1_050_000, 1_150_000);
        assert_eq!(selling, Some(50_000.0));
        assert_eq!(per_item(selling, 2_000), Some(25.0));
        // Sold out from 1.15 s to the end: 2.5 ticks over 500 answers = 50 µs/answer.
        let sold_out = cpu_us_between(&readings, 1_150_000, 1_300_000);
        assert_eq!(per_item(sold_out, 500), Some(50.0));
        // No answers in a phase: no figure rather than a division by zero.
        assert_eq!(per_item(sold_out, 0), None);
        // A restarted process (its count went down) is not negative CPU.
        let restarted = [r(0, 500), r(100_000, 3)];
        assert_eq!(cpu_us_between(&restarted, 0, 100_000), Some(0.0));
    }
}
