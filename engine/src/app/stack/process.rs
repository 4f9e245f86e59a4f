//! The processes behind a stack's servers, read from `/proc` and signalled with `kill(2)`:
//! whether a recorded pid is still the server we started (alive, our binary, our port), its
//! state letter, signalling and reaping it.
//!
//! Not here: which signal stops which server and how long to wait (`server.rs`,
//! `pg_standbys.rs`). Every signal is sent only after [`process_matches`] or
//! [`check_process`] passed, so a recycled pid is never touched.

use std::fs;

use super::kind::Kind;

/// The state letter of `/proc/PID/stat` (`R`, `S`, `D`, `T` stopped, `Z` zombie, ...), or
/// `None` when there is no such process.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is parenthesised and may itself hold ") ": the state follows the last.
    stat.rsplit(')').next()?.trim_start().chars().next()
}

pub(super) fn process_alive(pid: u32) -> bool {
    // A zombie (exited, not yet reaped by its parent — us, in tests) counts as gone.
    process_state(pid).is_some_and(|state| state != 'Z')
}

/// True when `pid` is alive and its command line is our server binary on `port`: never
/// signal a process that merely reuses a recorded pid.
pub(super) fn process_matches(pid: u32, kind: Kind, port: u16) -> bool {
    check_process(pid, kind, port).is_ok()
}

/// [`process_matches`] with the reason when it does not.
pub(super) fn check_process(pid: u32, kind: Kind, port: u16) -> Result<(), String> {
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
pub(super) fn reap(pid: u32) {
    let Ok(pid) = i32::try_from(pid) else { return };
    let mut status = 0;
    // SAFETY: waitpid(2) writes only to `status`, a live local; WNOHANG never blocks.
    unsafe {
        libc::waitpid(pid, &mut status, libc::WNOHANG);
    }
}

#[allow(unsafe_code)]
pub(super) fn current_euid() -> u32 {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}
